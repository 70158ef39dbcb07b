/* railwaved's configuration (docs/service.md "Configuration"): the effective configuration's
 * types and the loader that builds it from defaults, file, environment and flags
 * (service/core/config*.c; their private parts in config_int.h). Read-only once the daemon runs. */
#ifndef RW_SVC_CONFIG_H
#define RW_SVC_CONFIG_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "sched/sched.h"

#define RW_SVC_NAME_MAX 64     /* node and cluster names, incl. NUL: [A-Za-z0-9._-]{1,63} */
#define RW_SVC_HOST_MAX 256    /* host names (identity match) */
#define RW_SVC_SOCK_MAX 108    /* Unix socket paths (sizeof sun_path), incl. NUL */
#define RW_SVC_PATH_MAX 1024   /* other file paths */
#define RW_SVC_DEVICE_MAX 64   /* verbs device names ("mlx5_0") */

typedef enum rw_svc_transport {
	RW_SVC_TRANSPORT_TCP = 0,
	RW_SVC_TRANSPORT_VERBS = 1,
	RW_SVC_TRANSPORT_SHM = 2,    /* daemons of one host: development and benchmarks */
} rw_svc_transport_t;

const char *rw_svc_transport_name(rw_svc_transport_t t); /* "tcp" | "verbs" | "shm" */

/* An IPv4 address and port. `text` is the dotted quad; `sin` is ready for bind/connect. */
typedef struct rw_svc_endpoint {
	char text[16];
	uint16_t port;
	struct sockaddr_in sin;
} rw_svc_endpoint_t;

/* One Rail NIC of one node. tcp needs `addr`; verbs needs `addr` (rdmacm resolves by IP) or a
 * `device` (+ `device_port`, the HCA port number, default 1). */
typedef struct rw_svc_rail_cfg {
	int has_addr;
	rw_svc_endpoint_t addr;      /* port defaults to the cluster's rail_port */
	char device[RW_SVC_DEVICE_MAX]; /* "" = none */
	uint32_t device_port;
	double rate_gbps;            /* defaults to the cluster's nic_gbps */
} rw_svc_rail_cfg_t;

typedef struct rw_svc_node_cfg {
	char name[RW_SVC_NAME_MAX];
	char host[RW_SVC_HOST_MAX];  /* matched against gethostname() when no --node; default = name */
	rw_svc_endpoint_t control;   /* peer control channel; port defaults to control_port */
	rw_svc_rail_cfg_t rails[RW_MAX_RAILS];
	/* Per-node overrides for what must differ when several daemons share one host
	 * ("" = use the cluster-wide value). Kept as written (templates unexpanded). */
	char ipc_socket[RW_SVC_SOCK_MAX];
	char stats_socket[RW_SVC_SOCK_MAX];
	char http[64];
} rw_svc_node_cfg_t;

typedef enum rw_svc_force_path {
	RW_SVC_PATH_AUTO = -1,       /* the selector decides (default) */
	/* otherwise an rw_path_t value: the operator forced that path */
} rw_svc_force_path_t;

/* The effective configuration, after defaults, file, environment and flags (in that order of
 * increasing precedence), validated, with this node identified. Socket paths are expanded
 * ("{node}" -> this node's name). Read-only once the daemon runs. */
typedef struct rw_svc_config {
	char cluster[RW_SVC_NAME_MAX];
	uint32_t n_nodes;            /* N >= 1 */
	rw_svc_node_cfg_t *nodes;    /* [n_nodes], owned */
	uint32_t me;                 /* this node's index */
	uint32_t rails;              /* R: every node has exactly R rails */
	uint32_t gpus_per_node;      /* G */
	uint8_t gpu_rail[RW_MAX_GPUS]; /* local GPU -> native rail (default g % R) */
	rw_svc_transport_t transport;
	uint32_t control_port;       /* default port of nodes[].control */
	uint32_t rail_port;          /* default port of nodes[].rails[].address */
	double nic_gbps;             /* default rail rate; also the anchor-table fingerprint rate */
	char anchors[RW_SVC_PATH_MAX]; /* anchor table path; "" = none (selector says Joint) */
	char ipc_socket[RW_SVC_SOCK_MAX];
	char ipc_group[RW_SVC_NAME_MAX]; /* group owning the IPC (and stats) socket; "" = ours */
	char stats_socket[RW_SVC_SOCK_MAX];
	int http_enabled;            /* 0 when http is "0"/"off"/"" */
	rw_svc_endpoint_t http;      /* port 0 = ephemeral (tests) */
	uint32_t phase_timeout_ms;
	uint32_t heartbeat_interval_ms;
	uint32_t heartbeat_timeout_ms; /* > heartbeat_interval_ms */
	uint32_t recv_region_mib;    /* receive region per node (all peers and rails share it) */
	uint32_t group_area_mib;     /* a group's own carve-out per rail; 0: groups share the area */
	uint32_t group_pool_mib;     /* per rail: what the groups' carve-outs may hold together */
	uint32_t group_carve_per_uid; /* carve-outs the groups of one uid may hold; 0: no bound */
	uint32_t group_carve_idle_s; /* a carve-out with no phase for this long is taken back when
				      * another group finds the pool spent; 0: never */
	uint32_t group_local_mib;    /* of group_area_mib, the local area; the rest is four equal
	                              * record areas. 0: a fifth (the five areas equal) */
	uint32_t stats_timeout_ms;   /* a stats client must finish each line within this */
	uint32_t gpu_stall_ms;       /* a GPU whose marks have not landed for this long is stalled */
	uint32_t max_tokens;         /* tokens per submission (the IPC server refuses more) */
	rw_log_level_t log_level;
	int force_path;              /* RW_SVC_PATH_AUTO or an rw_path_t */
	int rail_weights_measured;   /* rail weights from measured throughput, not rate_gbps */
	int pace;                    /* tcp, shm: pace each rail's sends at its rate_gbps (emulates
	                              * NICs of that speed on one host; rdma/rail.h pace_bps) */
	char trace_dir[RW_SVC_PATH_MAX]; /* phase traces (docs/service.md); "" = off */
	uint32_t trace_max_kib;      /* bound of the two trace files together */
	/* ---- peer authentication (docs/security.md "Peer authentication") ---- */
	char key_file[RW_SVC_PATH_MAX]; /* cluster key (railwave keygen), mode 0600 or stricter;
	                                 * "" = none: peers are not authenticated ("auth none") */

	/* ---- rank authentication on the IPC socket (docs/ipc.md "Rank authentication") ---- */
	int ipc_require_group_key;   /* refuse a rank whose hello carries no group key */
	uint32_t ipc_max_per_uid;    /* IPC connections one uid may hold at once */
	uint32_t ipc_hello_timeout_ms; /* an IPC connection that has not joined by then is closed */
	uint32_t ipc_busy_poll_us;     /* docs/ipc.md "Busy polling" (0: sleep on the eventfds) */
	/* the word poller's schedule (ipc/ipc.h "The word poller"; docs/rankpath.md "The poller") */
	uint32_t poller_spin_us, poller_yield_us, poller_sleep_min_us, poller_sleep_max_us;
	uint32_t poller_busy_sleep_max_us; /* 0: spin while a rank-path phase is in flight */
} rw_svc_config_t;

/* One override: `key` is a top-level field name as in the JSON file ("http", "node", ...).
 * main.c turns command-line flags into these; tests build them by hand. */
typedef struct rw_svc_kv {
	const char *key;
	const char *value;
} rw_svc_kv_t;

/* The fields that flags and environment variables may set (for --help and docs). Terminated
 * by an entry with key == NULL. */
typedef struct rw_svc_option {
	const char *key;   /* JSON field */
	const char *flag;  /* long option without "--" */
	const char *env;   /* environment variable */
	const char *arg;   /* argument placeholder for --help */
	const char *help;
} rw_svc_option_t;

extern const rw_svc_option_t rw_svc_options[];

/* The embedded default configuration: a 4-node x 4-rail loopback cluster (rail r of node n on
 * 127.0.r.(n+1)), used when neither --config nor RAILWAVE_CONFIG names a file. */
extern const char rw_svc_default_config_json[];

/* Load the effective configuration.
 *   path   JSON file; NULL = RAILWAVE_CONFIG from envp, else the embedded default.
 *   envp   NULL-terminated "NAME=value" array (environ in the daemon); NULL = none.
 *   flags  overrides from the command line, highest precedence; n_flags may be 0.
 * Precedence: flags > environment > node-level fields > file > defaults.
 * Node identity: "node" (flag --node, RAILWAVE_NODE or the file) as a name or an index, else the
 * node whose host (or name) equals gethostname().
 * On error returns RW_ERR_PARSE (bad input; err names the field, e.g.
 * "nodes[2].rails[1].address: not an IPv4 address"), RW_ERR_NOTFOUND (file missing or node not
 * found; err says which), RW_ERR_NOMEM; *cfg is then left zeroed and owns nothing. */
rw_status_t rw_svc_config_load(const char *path, char *const *envp, const rw_svc_kv_t *flags,
			       size_t n_flags, rw_svc_config_t *cfg, char *err, size_t err_len);

/* Same, from JSON text instead of a file (tests; `json` NUL-terminated). */
rw_status_t rw_svc_config_load_text(const char *json, char *const *envp,
				    const rw_svc_kv_t *flags, size_t n_flags,
				    rw_svc_config_t *cfg, char *err, size_t err_len);

/* The effective configuration as JSON (loadable again: loading it for the same node gives the
 * same configuration). Returns a malloc'd NUL-terminated string or NULL on ENOMEM. */
char *rw_svc_config_dump(const rw_svc_config_t *cfg);

void rw_svc_config_free(rw_svc_config_t *cfg);

/* Topology for sched/: N, G, R, gpu_rail, and rail weights = each rail's rate in whole Gbit/s
 * (the slowest node's NIC on that rail; at least 1). */
void rw_svc_config_topo(const rw_svc_config_t *cfg, rw_topo_t *topo);

#endif /* RW_SVC_CONFIG_H */
