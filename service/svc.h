/* railwaved's private shared header: the daemon object, its configuration, metrics, the stats
 * socket, the Prometheus endpoint and the hooks between the daemon's parts. Only service/ and
 * tests/service/ include it. Everything here runs on the one libev loop thread unless a comment
 * says otherwise (STYLE.md "Concurrency"). See docs/service.md for the operator's view. */
#ifndef RW_SVC_H
#define RW_SVC_H

#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>

#include <ev.h>

#include "common/common.h"
#include "rdma/rail.h"
#include "sched/sched.h"

/* =============================================================================================
 * Configuration (service/config.c; its private parts in service/config_int.h)
 * ============================================================================================= */

#define RW_SVC_NAME_MAX 64     /* node and cluster names, incl. NUL: [A-Za-z0-9._-]{1,63} */
#define RW_SVC_HOST_MAX 256    /* host names (identity match) */
#define RW_SVC_SOCK_MAX 108    /* Unix socket paths (sizeof sun_path), incl. NUL */
#define RW_SVC_PATH_MAX 1024   /* other file paths */
#define RW_SVC_DEVICE_MAX 64   /* verbs device names ("mlx5_0") */

typedef enum rw_svc_transport {
	RW_SVC_TRANSPORT_TCP = 0,
	RW_SVC_TRANSPORT_VERBS = 1,
} rw_svc_transport_t;

const char *rw_svc_transport_name(rw_svc_transport_t t); /* "tcp" | "verbs" */

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
	uint32_t stats_timeout_ms;   /* a stats client must finish each line within this */
	uint32_t max_tokens;         /* tokens per submission (the IPC server refuses more) */
	rw_log_level_t log_level;
	int force_path;              /* RW_SVC_PATH_AUTO or an rw_path_t */
	int rail_weights_measured;   /* rail weights from measured throughput, not rate_gbps */
	int pace;                    /* tcp: pace each rail's sends at its rate_gbps (emulates
	                              * slower NICs on loopback; rdma/rail.h pace_bps) */
	char trace_dir[RW_SVC_PATH_MAX]; /* phase traces (docs/service.md); "" = off */
	uint32_t trace_max_kib;      /* bound of the two trace files together */
	/* ---- peer authentication (docs/security.md "Peer authentication") ---- */
	char key_file[RW_SVC_PATH_MAX]; /* cluster key (railwave keygen), mode 0600 or stricter;
	                                 * "" = none: peers are not authenticated ("auth none") */

	/* ---- rank authentication on the IPC socket (docs/ipc.md "Rank authentication") ---- */
	int ipc_require_group_key;   /* refuse a rank whose hello carries no group key */
	uint32_t ipc_max_per_uid;    /* IPC connections one uid may hold at once */
	uint32_t ipc_hello_timeout_ms; /* an IPC connection that has not joined by then is closed */
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

/* =============================================================================================
 * Metrics (service/metrics.c)
 *
 * The loop thread is the only writer: it updates the live rw_svc_metrics_t with plain stores
 * through the inline helpers below (no locks, no atomics). Other threads (HTTP) never read the
 * live copy; the loop publishes a copy every RW_SVC_METRICS_PUBLISH_MS (and on demand) under a
 * mutex held only for the memcpy, and readers copy it out under the same mutex. A reader thus
 * sees a consistent snapshot at most one publish interval old.
 * ============================================================================================= */

#define RW_SVC_HIST_SUB 4        /* log-linear: 4 buckets per power of two (<= 19% wide) */
#define RW_SVC_HIST_MIN_LOG2 10  /* bucket 0: < 2^10 ns (~1 us) */
#define RW_SVC_HIST_MAX_LOG2 38  /* last bucket: >= 2^38 ns (~275 s) */
#define RW_SVC_HIST_BUCKETS (2 + RW_SVC_HIST_SUB * (RW_SVC_HIST_MAX_LOG2 - RW_SVC_HIST_MIN_LOG2))
#define RW_SVC_DECISIONS 64      /* selector decisions kept (ring) */
#define RW_SVC_ERR_KINDS 64      /* errors[k] counts status -k; k >= 62 lumped into 63 */
#define RW_SVC_METRICS_PUBLISH_MS 250

typedef enum rw_svc_phase_kind {
	RW_SVC_DISPATCH = 0,
	RW_SVC_COMBINE = 1,
	RW_SVC_KIND_COUNT = 2,
} rw_svc_phase_kind_t;

typedef enum rw_svc_peer_state {
	RW_SVC_PEER_DOWN = 0,        /* not connected, not trying yet */
	RW_SVC_PEER_CONNECTING = 1,  /* connect/handshake in progress or backing off */
	RW_SVC_PEER_UP = 2,          /* control channel and every rail connected */
	RW_SVC_PEER_FAILED = 3,      /* detected dead (heartbeat timeout, reset); will retry */
	RW_SVC_PEER_SELF = 4,        /* this node */
} rw_svc_peer_state_t;

/* Names for logs, the stats socket and metric labels (service/text.c). */
const char *rw_svc_peer_state_name(rw_svc_peer_state_t s);
const char *rw_svc_kind_name(rw_svc_phase_kind_t k);       /* "dispatch" | "combine" */
const char *rw_svc_err_name(rw_status_t st);                /* short label: "peer", "timeout" */

/* Latency histogram in nanoseconds, log-linear buckets (see rw_svc_hist_bucket()). */
typedef struct rw_svc_hist {
	uint64_t count;
	uint64_t sum_ns;
	uint64_t max_ns;
	uint64_t bucket[RW_SVC_HIST_BUCKETS];
} rw_svc_hist_t;

typedef struct rw_svc_rail_metrics {
	uint64_t tx_bytes, tx_records, tx_writes, tx_busy_ns;
	uint64_t rx_bytes, rx_records, rx_writes, rx_busy_ns;
	uint64_t errors;
	uint32_t weight;             /* this node's capacity weight of the rail (its count rows) */
	uint32_t pad_;
	/* The transport's own counters of the rail's device (rdma/rail.h rw_rail_dev_stats_t),
	 * copied in by the mesh at every heartbeat tick and write completion: bytes it handed to
	 * the wire, frame headers and acks included (tcp; 0 with verbs), and times a send waited
	 * for the pacing budget (tcp with "pace": true). */
	uint64_t wire_tx_bytes, pace_waits;
	/* The rest of the device's counters (failures by cause, back-pressure), sampled likewise. */
	rw_rail_dev_stats_t transport;
} rw_svc_rail_metrics_t;

typedef struct rw_svc_peer_metrics {
	uint32_t state;              /* rw_svc_peer_state_t */
	uint32_t rails_up;           /* rails connected to this peer */
	uint32_t ever_up;            /* reached UP at least once */
	uint32_t pad_;
	uint64_t reconnects;         /* times the peer came back up after having been up */
	uint64_t errors;             /* peer/link errors attributed to it */
	uint64_t heartbeat_rtt_ns;   /* last measured control round trip, 0 = none */
	/* Rail health (docs/dataflow.md "Rail health"), published by the mesh: bit r = rail r to
	 * this peer is connected; per rail the times it went down while the peer stayed up, the
	 * time spent down in outages that ended, and when the running outage began (0: none). */
	uint32_t rail_up_mask;
	uint32_t pad2_;
	uint64_t rail_failovers[RW_MAX_RAILS];
	uint64_t rail_degraded_ns[RW_MAX_RAILS];
	uint64_t rail_down_since_ns[RW_MAX_RAILS];
} rw_svc_peer_metrics_t;

typedef struct rw_svc_phase_metrics {
	uint64_t ok;
	uint64_t failed;
	rw_svc_hist_t latency;       /* completed phases only */
} rw_svc_phase_metrics_t;

typedef struct rw_svc_decision {
	uint64_t seq;                /* 1-based; 0 = empty slot */
	uint64_t mono_ns;            /* rw_now_ns() when decided */
	uint32_t group, layer;
	uint64_t step;
	rw_features_t feat;
	rw_selection_t sel;
} rw_svc_decision_t;

typedef struct rw_svc_metrics {
	uint32_t rails, peers;       /* sizes (R, N) */
	uint64_t start_ns;
	rw_svc_rail_metrics_t rail[RW_MAX_RAILS];
	rw_svc_phase_metrics_t phase[RW_PATH_COUNT][RW_SVC_KIND_COUNT];
	uint64_t selected[RW_PATH_COUNT][RW_SELECT_FORCED + 1]; /* decisions by path and reason */
	uint64_t n_decisions;        /* total ever; the newest is decision[(n - 1) % RW_SVC_DECISIONS] */
	rw_svc_decision_t decision[RW_SVC_DECISIONS];
	uint64_t errors[RW_SVC_ERR_KINDS];
	uint32_t clients;            /* trainer ranks connected (ipc/) */
	uint32_t stats_clients;      /* stats socket connections open */
	uint64_t stats_rejected;     /* stats clients dropped for bad input/timeouts/limits */
	uint64_t anchor_reloads, anchor_reload_failures;
	/* Waved paths: the most sources seen writing one phase's data into this node at once (1 under
	 * the receiver gate, docs/dataflow.md "Send"). */
	uint32_t wave_fanin_max;
	/* Dispatches whose count row this node's CPU counted / a data mover counted on the GPU
	 * (docs/dataflow.md "Count on the GPU"). */
	uint64_t counts_host, counts_gpu;
	/* Prefixes of ranges handed to a data mover before the range completed (its forward or
	 * reduce overlapping the transfer: rw_svc_mover_ops_t.part, docs/dataflow.md "Receive and
	 * forward"). */
	uint64_t rx_prefixes;
	/* Times a write waited for the mover to finish writing its piece of a slab while earlier
	 * pieces were already posted (rw_svc_mover_ops_t.ready, docs/dataflow.md "Send"). */
	uint64_t tx_piece_waits;
	/* Phases planned without some rail for some pair (a rail down at either end, docs/dataflow.md
	 * "Rail health"). */
	uint64_t phases_rail_excluded;
	/* Where the rails' send and receive slabs live and why (docs/cuda.md "Where the slabs
	 * live"): set once by the mesh at start, e.g. "host (tcp rails are sockets)". */
	char slabs[160];
	rw_svc_peer_metrics_t *peer; /* [peers], owned */
} rw_svc_metrics_t;

rw_status_t rw_svc_metrics_init(rw_svc_metrics_t *m, uint32_t rails, uint32_t peers);
/* Seconds rail `rail` to `peer` spent down while the peer stayed up, the running outage
 * included (rail health). */
static inline double rw_svc_metrics_rail_degraded_s(const rw_svc_peer_metrics_t *p, uint32_t rail,
						    uint64_t now)
{
	uint64_t since = p->rail_down_since_ns[rail];
	return (double)(p->rail_degraded_ns[rail] + (since && now > since ? now - since : 0)) * 1e-9;
}
void rw_svc_metrics_fini(rw_svc_metrics_t *m);
/* Copy src into dst (same rails/peers, dst initialised). */
void rw_svc_metrics_copy(rw_svc_metrics_t *dst, const rw_svc_metrics_t *src);

static inline uint32_t rw_svc_hist_bucket(uint64_t ns)
{
	if (ns < (1ull << RW_SVC_HIST_MIN_LOG2))
		return 0;
	uint32_t msb = 63u - (uint32_t)__builtin_clzll(ns);
	if (msb >= RW_SVC_HIST_MAX_LOG2)
		return RW_SVC_HIST_BUCKETS - 1;
	uint32_t sub = (uint32_t)(ns >> (msb - 2)) & 3u; /* the two bits after the leading one */
	return 1 + RW_SVC_HIST_SUB * (msb - RW_SVC_HIST_MIN_LOG2) + sub;
}
/* Exclusive upper bound of bucket b in ns (UINT64_MAX for the last). */
uint64_t rw_svc_hist_upper(uint32_t b);
/* Value at quantile q in [0,1]: the upper bound of the bucket holding the ceil(q*count)-th
 * sample, clamped to max_ns (so never above the largest sample). 0 when empty. */
uint64_t rw_svc_hist_quantile(const rw_svc_hist_t *h, double q);

static inline void rw_svc_hist_add(rw_svc_hist_t *h, uint64_t ns)
{
	h->count++;
	h->sum_ns += ns;
	if (ns > h->max_ns)
		h->max_ns = ns;
	h->bucket[rw_svc_hist_bucket(ns)]++;
}

/* ---- writer helpers (loop thread only) ---- */

static inline void rw_svc_metrics_tx(rw_svc_metrics_t *m, uint32_t rail, uint64_t bytes,
				     uint64_t records, uint64_t busy_ns)
{
	if (rail >= m->rails)
		return;
	m->rail[rail].tx_bytes += bytes;
	m->rail[rail].tx_records += records;
	m->rail[rail].tx_writes++;
	m->rail[rail].tx_busy_ns += busy_ns;
}

static inline void rw_svc_metrics_rx(rw_svc_metrics_t *m, uint32_t rail, uint64_t bytes,
				     uint64_t records, uint64_t busy_ns)
{
	if (rail >= m->rails)
		return;
	m->rail[rail].rx_bytes += bytes;
	m->rail[rail].rx_records += records;
	m->rail[rail].rx_writes++;
	m->rail[rail].rx_busy_ns += busy_ns;
}

/* The rail device's counters as the transport reports them now (they only grow). */
static inline void rw_svc_metrics_rail_dev(rw_svc_metrics_t *m, uint32_t rail,
					   uint64_t wire_tx_bytes, uint64_t pace_waits)
{
	if (rail >= m->rails)
		return;
	m->rail[rail].wire_tx_bytes = wire_tx_bytes;
	m->rail[rail].pace_waits = pace_waits;
}

static inline void rw_svc_metrics_rail_transport(rw_svc_metrics_t *m, uint32_t rail,
						 const rw_rail_dev_stats_t *st)
{
	if (rail < m->rails)
		m->rail[rail].transport = *st;
}

static inline void rw_svc_metrics_error(rw_svc_metrics_t *m, rw_status_t st)
{
	uint32_t k = st < 0 ? (uint32_t)(-(int)st) : 0;
	m->errors[k < RW_SVC_ERR_KINDS ? k : RW_SVC_ERR_KINDS - 1]++;
}

static inline void rw_svc_metrics_peer_state(rw_svc_metrics_t *m, uint32_t peer,
					     rw_svc_peer_state_t s)
{
	if (peer >= m->peers)
		return;
	rw_svc_peer_metrics_t *p = &m->peer[peer];
	if (s == RW_SVC_PEER_UP && p->state != RW_SVC_PEER_UP) {
		if (p->ever_up)
			p->reconnects++;
		p->ever_up = 1;
	}
	p->state = (uint32_t)s;
}

/* A finished phase (ok = 0 on failure; the latency is only recorded for successes). */
static inline void rw_svc_metrics_phase(rw_svc_metrics_t *m, rw_path_t path,
					rw_svc_phase_kind_t kind, int ok, uint64_t ns)
{
	if ((unsigned)path >= RW_PATH_COUNT || (unsigned)kind >= RW_SVC_KIND_COUNT)
		return;
	rw_svc_phase_metrics_t *p = &m->phase[path][kind];
	if (ok) {
		p->ok++;
		rw_svc_hist_add(&p->latency, ns);
	} else {
		p->failed++;
	}
}

/* Record a selector decision (copies feat and sel). */
void rw_svc_metrics_decision(rw_svc_metrics_t *m, uint32_t group, uint32_t layer, uint64_t step,
			     const rw_features_t *feat, const rw_selection_t *sel);

/* ---- publishing to other threads ---- */

typedef struct rw_svc_metrics_pub {
	pthread_mutex_t lock;
	rw_svc_metrics_t snap;       /* guarded by lock */
	uint64_t version;            /* publishes so far, guarded by lock */
} rw_svc_metrics_pub_t;

rw_status_t rw_svc_metrics_pub_init(rw_svc_metrics_pub_t *pub, uint32_t rails, uint32_t peers);
void rw_svc_metrics_pub_fini(rw_svc_metrics_pub_t *pub);
/* Loop thread: copy the live metrics into the published snapshot. */
void rw_svc_metrics_publish(rw_svc_metrics_pub_t *pub, const rw_svc_metrics_t *live);
/* Any thread: copy the latest snapshot into out (initialised with the same sizes). Returns the
 * snapshot's version (0 = nothing published yet; out then holds zeros). */
uint64_t rw_svc_metrics_read(rw_svc_metrics_pub_t *pub, rw_svc_metrics_t *out);

/* Text renderers, shared by the stats socket and tests. Each appends to a growable buffer
 * (rw_svc_buf_*: service/text.c). */
typedef struct rw_svc_buf {
	char *data;
	size_t len, cap;
	int oom;                     /* an append failed; data holds what fit */
} rw_svc_buf_t;

void rw_svc_buf_printf(rw_svc_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void rw_svc_buf_free(rw_svc_buf_t *b);

/* Prometheus text exposition format 0.0.4 of a snapshot (names in docs/service.md). */
void rw_svc_metrics_prometheus(const rw_svc_config_t *cfg, const rw_svc_metrics_t *m,
			       rw_svc_buf_t *out);

/* =============================================================================================
 * The daemon object
 * ============================================================================================= */

typedef struct rw_svc_stats rw_svc_stats_t;
typedef struct rw_svc_http rw_svc_http_t;

typedef struct rw_svc {
	struct ev_loop *loop;
	rw_svc_config_t cfg;
	rw_topo_t topo;                 /* from cfg (rw_svc_config_topo) */
	rw_svc_metrics_t metrics;       /* live; loop thread only */
	rw_svc_metrics_pub_t pub;       /* published copy for the HTTP thread */
	/* The anchor table for the selector; NULL = none (Joint). Replaced on SIGHUP between loop
	 * callbacks: read it at selection time, never keep the pointer across callbacks. */
	rw_anchor_table_t *anchors;
	rw_svc_stats_t *stats;
	rw_svc_http_t *http;
	int draining;                   /* SIGTERM seen: no new phases */
	int stopping;                   /* rw_svc_stop() called */

	/* ---- owned by main.c ---- */
	ev_signal sig_term, sig_int, sig_hup;
	ev_timer publish_timer;
	ev_timer drain_timer;           /* forces the stop if the drain overruns */

	/* The phase executor with the peer mesh and the IPC server (service/exec.h). */
	struct rw_svc_exec *exec;
	/* The executor's IPC server while it listens (NULL otherwise), for the stats socket's
	 * client listing; loop thread only. */
	struct rw_ipc_server *ipc;
} rw_svc_t;

/* main.c starts, in order: stats, HTTP, the executor (rw_svc_exec_create: mesh and movers),
 * its IPC server, the loop; and stops them in reverse. SIGTERM/SIGINT call rw_svc_exec_drain(),
 * which refuses new phases, lets the running ones finish or fail by their phase timeout and
 * then calls rw_svc_stop(); main.c also arms drain_timer at phase_timeout_ms + 1 s and stops
 * the daemon itself if the drain has not finished by then. */

/* Stop the daemon: ev_break the loop (idempotent). Inline, so the parts that end a drain need
 * not call back into main.c. */
static inline void rw_svc_stop(rw_svc_t *svc)
{
	if (svc->stopping)
		return;
	svc->stopping = 1;
	ev_timer_stop(svc->loop, &svc->drain_timer);
	ev_break(svc->loop, EVBREAK_ALL);
}

/* SIGHUP: re-read cfg.anchors. A table that does not parse or whose fingerprint does not match
 * this cluster is refused (the old one stays; the reason is logged and counted). An empty
 * anchors path unloads the table. Defined in main.c. */
rw_status_t rw_svc_anchors_reload(rw_svc_t *svc);

/* =============================================================================================
 * Stats socket (service/stats.c)
 * Unix stream socket on the loop; text protocol, one command per line, every reply ends with
 * an empty line. See docs/service.md for the commands and the error rules.
 * ============================================================================================= */

#define RW_SVC_STATS_LINE_MAX 4096   /* longest accepted command line, incl. newline */
#define RW_SVC_STATS_CLIENTS_MAX 64  /* further clients get an error and are closed */

/* Bind cfg->stats_socket (replacing a stale socket file, refusing a live one) and start
 * accepting on svc->loop. The server reads svc->cfg and svc->metrics when answering. */
rw_status_t rw_svc_stats_start(rw_svc_t *svc, rw_svc_stats_t **stats_p);
/* Close every client and the listening socket, unlink the path. NULL is fine. */
void rw_svc_stats_stop(rw_svc_stats_t *stats);
/* Render one command's reply (without the trailing empty line) - what the socket sends.
 * Returns 0 for a known command, -1 for an unknown one (out then holds an "error ..." line). */
int rw_svc_stats_answer(const rw_svc_t *svc, const char *line, rw_svc_buf_t *out);

/* =============================================================================================
 * Prometheus endpoint (service/http.c, libmicrohttpd; a no-op stub without RW_HAVE_MHD)
 * ============================================================================================= */

/* Listen on cfg.http (when http_enabled) with MHD's internal polling thread; GET /metrics
 * renders the published snapshot (svc->pub). *http_p = NULL when disabled. */
rw_status_t rw_svc_http_start(rw_svc_t *svc, rw_svc_http_t **http_p);
void rw_svc_http_stop(rw_svc_http_t *http);
/* The bound port (useful with port 0). */
uint16_t rw_svc_http_port(const rw_svc_http_t *http);

#endif /* RW_SVC_H */
