/* railwaved configuration: a JSON cluster file (or the embedded loopback default), then the
 * environment (RAILWAVE_*), then command-line flags, folded into one validated rw_svc_config_t.
 * Every error names the field it is about, in the form the operator wrote it: "nodes[2].rails[1]
 * .address", "RAILWAVE_HTTP" or "--http". Field reference: docs/service.md. */
#include "service/core/config_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ipc/ipc.h" /* the word poller's defaults */

#define CONFIG_MAX_BYTES (64u << 20) /* a cluster file is kilobytes; this only stops a wrong path */

/* ---------------------------------------------------------------------------------------------
 * The embedded default: 4 nodes x 4 rails on loopback, rail r of node n on 127.0.r.(n+1).
 * deploy/clusters/loopback-4x4.json holds the same cluster (a test checks they agree).
 * ------------------------------------------------------------------------------------------- */

const char rw_svc_default_config_json[] =
	"{\n"
	"  \"cluster\": \"loopback\",\n"
	"  \"transport\": \"tcp\",\n"
	"  \"gpus_per_node\": 4,\n"
	"  \"nic_gbps\": 100,\n"
	"  \"control_port\": 7400,\n"
	"  \"rail_port\": 7500,\n"
	"  \"ipc_socket\": \"/run/railwave/{node}.sock\",\n"
	"  \"stats_socket\": \"/run/railwave/{node}.stats\",\n"
	"  \"http\": \"127.0.0.1:9470\",\n"
	"  \"nodes\": [\n"
	"    {\"name\": \"node0\", \"control\": \"127.0.0.1\", \"http\": \"127.0.0.1:9470\",\n"
	"     \"rails\": [\"127.0.0.1\", \"127.0.1.1\", \"127.0.2.1\", \"127.0.3.1\"]},\n"
	"    {\"name\": \"node1\", \"control\": \"127.0.0.2\", \"http\": \"127.0.0.2:9470\",\n"
	"     \"rails\": [\"127.0.0.2\", \"127.0.1.2\", \"127.0.2.2\", \"127.0.3.2\"]},\n"
	"    {\"name\": \"node2\", \"control\": \"127.0.0.3\", \"http\": \"127.0.0.3:9470\",\n"
	"     \"rails\": [\"127.0.0.3\", \"127.0.1.3\", \"127.0.2.3\", \"127.0.3.3\"]},\n"
	"    {\"name\": \"node3\", \"control\": \"127.0.0.4\", \"http\": \"127.0.0.4:9470\",\n"
	"     \"rails\": [\"127.0.0.4\", \"127.0.1.4\", \"127.0.2.4\", \"127.0.3.4\"]}\n"
	"  ]\n"
	"}\n";

/* ---------------------------------------------------------------------------------------------
 * Scalar top-level fields: one table drives the file, the environment, the flags and the dump.
 * ------------------------------------------------------------------------------------------- */

#define OFF(m) offsetof(rw_svc_config_t, m)
#define SZ(m) sizeof(((rw_svc_config_t *)0)->m)

static const field_t fields[] = {
	{"cluster", K_NAME, OFF(cluster), SZ(cluster), 0, 0},
	{"node", K_NODE, 0, 0, 0, 0},
	{"transport", K_TRANSPORT, OFF(transport), 0, 0, 0},
	{"gpus_per_node", K_U32, OFF(gpus_per_node), 0, 1, RW_MAX_GPUS},
	{"control_port", K_U32, OFF(control_port), 0, 1, 65535},
	{"rail_port", K_U32, OFF(rail_port), 0, 1, 65535},
	{"nic_gbps", K_F64, OFF(nic_gbps), 0, 0.001, 100000},
	{"anchors", K_FILE, OFF(anchors), SZ(anchors), 0, 0},
	{"ipc_socket", K_SOCK, OFF(ipc_socket), SZ(ipc_socket), 0, 0},
	{"ipc_group", K_GROUP, OFF(ipc_group), SZ(ipc_group), 0, 0},
	{"stats_socket", K_SOCK, OFF(stats_socket), SZ(stats_socket), 0, 0},
	{"http", K_HTTP, 0, 0, 0, 0},
	{"phase_timeout_ms", K_U32, OFF(phase_timeout_ms), 0, 1, 3600000},
	{"heartbeat_interval_ms", K_U32, OFF(heartbeat_interval_ms), 0, 1, 600000},
	{"heartbeat_timeout_ms", K_U32, OFF(heartbeat_timeout_ms), 0, 2, 3600000},
	{"recv_region_mib", K_U32, OFF(recv_region_mib), 0, 1, 1048576},
	{"group_area_mib", K_U32, OFF(group_area_mib), 0, 0, 65536},
	{"group_pool_mib", K_U32, OFF(group_pool_mib), 0, 1, 1048576},
	{"group_local_mib", K_U32, OFF(group_local_mib), 0, 0, 65535},
	{"group_carve_per_uid", K_U32, OFF(group_carve_per_uid), 0, 0, 65536},
	{"group_carve_idle_s", K_U32, OFF(group_carve_idle_s), 0, 0, 604800},
	{"stats_timeout_ms", K_U32, OFF(stats_timeout_ms), 0, 1, 3600000},
	{"gpu_stall_ms", K_U32, OFF(gpu_stall_ms), 0, 10, 3600000},
	{"max_tokens", K_U32, OFF(max_tokens), 0, 1, 1048576},
	{"log_level", K_LOGLEVEL, OFF(log_level), 0, 0, 0},
	{"path", K_FORCEPATH, OFF(force_path), 0, 0, 0},
	{"pace", K_BOOL, OFF(pace), 0, 0, 0},
	{"rail_weights", K_RAILWEIGHTS, OFF(rail_weights_measured), 0, 0, 0},
	{"trace_dir", K_FILE, OFF(trace_dir), SZ(trace_dir), 0, 0},
	{"trace_max_kib", K_U32, OFF(trace_max_kib), 0, 16, 1u << 30},
	/* peer authentication */
	{"key_file", K_FILE, OFF(key_file), SZ(key_file), 0, 0},
	/* rank authentication on the IPC socket */
	{"ipc_require_group_key", K_BOOL, OFF(ipc_require_group_key), 0, 0, 0},
	{"ipc_max_per_uid", K_U32, OFF(ipc_max_per_uid), 0, 1, 65536},
	{"ipc_hello_timeout_ms", K_U32, OFF(ipc_hello_timeout_ms), 0, 100, 600000},
	{"ipc_busy_poll_us", K_U32, OFF(ipc_busy_poll_us), 0, 0, 10000},
	/* the word poller's schedule */
	{"poller_spin_us", K_U32, OFF(poller_spin_us), 0, 0, 1000000},
	{"poller_yield_us", K_U32, OFF(poller_yield_us), 0, 0, 1000000},
	{"poller_sleep_min_us", K_U32, OFF(poller_sleep_min_us), 0, 1, 1000000},
	{"poller_sleep_max_us", K_U32, OFF(poller_sleep_max_us), 0, 1, 1000000},
	{"poller_busy_sleep_max_us", K_U32, OFF(poller_busy_sleep_max_us), 0, 0, 1000000},
};
#define N_FIELDS RW_ARRAY_SIZE(fields)

const rw_svc_option_t rw_svc_options[] = {
	{"config", "config", "RAILWAVE_CONFIG", "FILE", "cluster file (default: embedded 4x4 loopback)"},
	{"node", "node", "RAILWAVE_NODE", "NAME|INDEX", "this node (default: match the host name)"},
	{"transport", "transport", "RAILWAVE_TRANSPORT", "tcp|shm|verbs", "rail transport"},
	{"anchors", "anchors", "RAILWAVE_ANCHORS", "FILE", "anchor table (\"\" = none: Joint)"},
	{"path", "path", "RAILWAVE_PATH", "auto|native|rail-only|perm-only|joint", "force a path"},
	{"ipc_socket", "ipc-socket", "RAILWAVE_SOCKET", "PATH",
	 "trainer rank socket (librailwave reads the same variable)"},
	{"ipc_group", "ipc-group", "RAILWAVE_IPC_GROUP", "GROUP", "group owning the sockets"},
	{"stats_socket", "stats-socket", "RAILWAVE_STATS_SOCKET", "PATH", "stats socket (\"\" = off)"},
	{"http", "http", "RAILWAVE_HTTP", "ADDR:PORT|0", "Prometheus endpoint (0 = off)"},
	{"log_level", "log-level", "RAILWAVE_LOG_LEVEL", "error|warn|info|debug", "log level"},
	{"nic_gbps", "nic-gbps", "RAILWAVE_NIC_GBPS", "GBPS", "default rail rate"},
	{"gpus_per_node", "gpus-per-node", "RAILWAVE_GPUS_PER_NODE", "G", "GPUs per node"},
	{"control_port", "control-port", "RAILWAVE_CONTROL_PORT", "PORT", "default control port"},
	{"rail_port", "rail-port", "RAILWAVE_RAIL_PORT", "PORT", "default rail port"},
	{"phase_timeout_ms", "phase-timeout-ms", "RAILWAVE_PHASE_TIMEOUT_MS", "MS", "phase timeout"},
	{"heartbeat_interval_ms", "heartbeat-interval-ms", "RAILWAVE_HEARTBEAT_INTERVAL_MS", "MS",
	 "peer heartbeat period"},
	{"heartbeat_timeout_ms", "heartbeat-timeout-ms", "RAILWAVE_HEARTBEAT_TIMEOUT_MS", "MS",
	 "peer declared dead after"},
	{"recv_region_mib", "recv-region-mib", "RAILWAVE_RECV_REGION_MIB", "MIB", "receive region"},
	{"group_area_mib", "group-area-mib", "RAILWAVE_GROUP_AREA_MIB", "MIB",
	 "each group's own carve-out per rail (0 = groups share the region)"},
	{"group_pool_mib", "group-pool-mib", "RAILWAVE_GROUP_POOL_MIB", "MIB",
	 "per rail, the groups' carve-outs together"},
	{"group_local_mib", "group-local-mib", "RAILWAVE_GROUP_LOCAL_MIB", "MIB",
	 "of each carve-out, the local area (0 = a fifth)"},
	{"group_carve_per_uid", "group-carve-per-uid", "RAILWAVE_GROUP_CARVE_PER_UID", "N",
	 "carve-outs one uid's groups may hold (0 = no bound)"},
	{"group_carve_idle_s", "group-carve-idle-s", "RAILWAVE_GROUP_CARVE_IDLE_S", "S",
	 "take back a carve-out idle this long when the pool is spent (0 = never)"},
	{"stats_timeout_ms", "stats-timeout-ms", "RAILWAVE_STATS_TIMEOUT_MS", "MS",
	 "stats client line deadline"},
	{"gpu_stall_ms", "gpu-stall-ms", "RAILWAVE_GPU_STALL_MS", "MS",
	 "a GPU whose copies have not landed for this long is stalled"},
	{"pace", "pace", "RAILWAVE_PACE", "on|off", "pace every rail at its rate_gbps (tcp, shm)"},
	{"rail_weights", "rail-weights", "RAILWAVE_RAIL_WEIGHTS", "config|measured",
	 "rail capacity weights: rate_gbps, or measured throughput"},
	{"max_tokens", "max-tokens", "RAILWAVE_MAX_TOKENS", "N",
	 "most tokens one rank may submit per phase"},
	{"trace_dir", "trace-dir", "RAILWAVE_TRACE_DIR", "DIR", "phase traces (\"\" = off)"},
	{"trace_max_kib", "trace-max-kib", "RAILWAVE_TRACE_MAX_KIB", "KIB", "trace files' size bound"},
	/* peer authentication */
	{"key_file", "key-file", "RAILWAVE_KEY_FILE", "FILE",
	 "cluster key from 'railwave keygen' (\"\" = none: peers unauthenticated)"},
	/* rank authentication on the IPC socket */
	{"ipc_require_group_key", "ipc-require-group-key", "RAILWAVE_IPC_REQUIRE_GROUP_KEY", "on|off",
	 "refuse ranks without a group key (RAILWAVE_GROUP_KEY)"},
	{"ipc_max_per_uid", "ipc-max-per-uid", "RAILWAVE_IPC_MAX_PER_UID", "N",
	 "IPC connections one uid may hold"},
	{"ipc_hello_timeout_ms", "ipc-hello-timeout-ms", "RAILWAVE_IPC_HELLO_TIMEOUT_MS", "MS",
	 "an IPC connection must join within this"},
	{"ipc_busy_poll_us", "ipc-busy-poll-us", "RAILWAVE_IPC_BUSY_POLL_US", "US",
	 "after a submission, poll the ranks' rings this long before sleeping (0 = never)"},
	{"poller_spin_us", "poller-spin-us", "RAILWAVE_POLLER_SPIN_US", "US",
	 "rank pages' word poller: spin this long after a word moved"},
	{"poller_yield_us", "poller-yield-us", "RAILWAVE_POLLER_YIELD_US", "US",
	 "then look between sched_yield()s this long"},
	{"poller_sleep_min_us", "poller-sleep-min-us", "RAILWAVE_POLLER_SLEEP_MIN_US", "US",
	 "then sleep from this long, doubling"},
	{"poller_sleep_max_us", "poller-sleep-max-us", "RAILWAVE_POLLER_SLEEP_MAX_US", "US",
	 "up to this long with no rank-path phase in flight"},
	{"poller_busy_sleep_max_us", "poller-busy-sleep-max-us", "RAILWAVE_POLLER_BUSY_SLEEP_MAX_US",
	 "US", "up to this long while one is (0 = spin while one is)"},
	{NULL, NULL, NULL, NULL, NULL},
};

/* The dump walks the same table (config_dump.c). */
const field_t *const config_fields = fields;
const size_t config_n_fields = N_FIELDS;
_Static_assert(N_FIELDS <= CONFIG_FIELDS_MAX, "raise CONFIG_FIELDS_MAX in config_int.h");

/* Set one scalar field from a JSON value. `where` names the source for messages. */
static rw_status_t set_field(loader_t *ld, size_t fi, const json_t *v, const char *where,
			     source_t src)
{
	const field_t *f = &fields[fi];
	rw_svc_config_t *cfg = ld->cfg;
	char *base = (char *)cfg;
	const char *s = json_is_string(v) ? json_string_value(v) : NULL;

	switch (f->kind) {
	case K_NAME:
		if (!s)
			return cfg_fail(ld, "%s: expected a string, got %s", where, cfg_json_type_name(v));
		if (!cfg_is_name(s))
			return cfg_fail(ld, "%s: '%s' is not a valid name (1-63 of A-Z a-z 0-9 . _ -)",
				    where, s);
		snprintf(base + f->off, f->size, "%s", s);
		break;
	case K_NODE:
		if (json_is_integer(v)) {
			if (json_integer_value(v) < 0 || json_integer_value(v) >= RW_MAX_NODES)
				return cfg_fail(ld, "%s: index %lld out of range", where,
					    (long long)json_integer_value(v));
			snprintf(ld->node_sel, sizeof(ld->node_sel), "%lld",
				 (long long)json_integer_value(v));
			break;
		}
		if (!s)
			return cfg_fail(ld, "%s: expected a node name or index, got %s", where,
				    cfg_json_type_name(v));
		if (!cfg_is_name(s))
			return cfg_fail(ld, "%s: '%s' is not a valid node name or index", where, s);
		snprintf(ld->node_sel, sizeof(ld->node_sel), "%s", s);
		break;
	case K_SOCK:
	case K_FILE:
	case K_GROUP:
		if (!s)
			return cfg_fail(ld, "%s: expected a string, got %s", where, cfg_json_type_name(v));
		if (strlen(s) >= f->size)
			return cfg_fail(ld, "%s: longer than %zu bytes", where, f->size - 1);
		if (f->kind == K_GROUP && *s && !cfg_is_name(s))
			return cfg_fail(ld, "%s: '%s' is not a valid group name", where, s);
		if (f->kind == K_SOCK && !strcmp(f->key, "ipc_socket") && !*s)
			return cfg_fail(ld, "%s: must not be empty", where);
		snprintf(base + f->off, f->size, "%s", s);
		break;
	case K_U32: {
		if (!json_is_integer(v))
			return cfg_fail(ld, "%s: expected an integer, got %s", where, cfg_json_type_name(v));
		json_int_t x = json_integer_value(v);
		if ((double)x < f->min || (double)x > f->max)
			return cfg_fail(ld, "%s: %lld out of range [%.0f, %.0f]", where, (long long)x,
				    f->min, f->max);
		*(uint32_t *)(void *)(base + f->off) = (uint32_t)x;
		break;
	}
	case K_F64: {
		if (!json_is_number(v))
			return cfg_fail(ld, "%s: expected a number, got %s", where, cfg_json_type_name(v));
		double x = json_number_value(v);
		if (!(x >= f->min && x <= f->max))
			return cfg_fail(ld, "%s: %g out of range [%g, %g]", where, x, f->min, f->max);
		*(double *)(void *)(base + f->off) = x;
		break;
	}
	case K_TRANSPORT:
		if (!s || (strcmp(s, "tcp") && strcmp(s, "verbs") && strcmp(s, "shm")))
			return cfg_fail(ld, "%s: expected \"tcp\", \"shm\" or \"verbs\"", where);
		cfg->transport = !strcmp(s, "verbs") ? RW_SVC_TRANSPORT_VERBS
				 : !strcmp(s, "shm") ? RW_SVC_TRANSPORT_SHM : RW_SVC_TRANSPORT_TCP;
		break;
	case K_LOGLEVEL: {
		int i = s ? cfg_lookup_name(cfg_log_level_names, RW_ARRAY_SIZE(cfg_log_level_names), s) : -1;
		if (i < 0)
			return cfg_fail(ld, "%s: expected one of error, warn, info, debug", where);
		cfg->log_level = (rw_log_level_t)i;
		break;
	}
	case K_FORCEPATH: {
		rw_path_t path = RW_PATH_JOINT;
		if (!s || (strcmp(s, "auto") && rw_sched_path_parse(s, &path) != RW_OK))
			return cfg_fail(ld, "%s: expected one of auto, native, rail-only, perm-only, joint",
				    where);
		cfg->force_path = strcmp(s, "auto") ? (int)path : RW_SVC_PATH_AUTO;
		break;
	}
	case K_RAILWEIGHTS:
		if (!s || (strcmp(s, "config") && strcmp(s, "measured")))
			return cfg_fail(ld, "%s: expected \"config\" or \"measured\"", where);
		cfg->rail_weights_measured = !strcmp(s, "measured");
		break;
	case K_HTTP: {
		char buf[64];
		if (json_is_integer(v) && json_integer_value(v) == 0)
			s = "0";
		if (!s)
			return cfg_fail(ld, "%s: expected \"ADDR:PORT\" or 0, got %s", where,
				    cfg_json_type_name(v));
		int en;
		rw_svc_endpoint_t ep;
		if (strlen(s) >= sizeof(buf) || !cfg_parse_http(s, &en, &ep))
			return cfg_fail(ld, "%s: '%s' is not an IPv4 ADDR:PORT (or 0 = off)", where, s);
		snprintf(ld->http_text, sizeof(ld->http_text), "%s", s);
		break;
	}
	case K_BOOL:
		if (!json_is_boolean(v))
			return cfg_fail(ld, "%s: expected true or false, got %s", where, cfg_json_type_name(v));
		*(int *)(void *)(base + f->off) = json_is_true(v);
		break;
	}
	ld->src[fi] = src;
	return RW_OK;
}

static int find_field(const char *key)
{
	for (size_t i = 0; i < N_FIELDS; i++)
		if (!strcmp(fields[i].key, key))
			return (int)i;
	return -1;
}

/* An override given as text (environment or flag): convert to the JSON type the field wants,
 * then set it like a file value. */
static rw_status_t set_field_text(loader_t *ld, size_t fi, const char *text, const char *where,
				  source_t src)
{
	const field_t *f = &fields[fi];
	json_t *v = NULL;
	if (f->kind == K_U32) {
		unsigned long long x;
		if (!cfg_parse_uint(text, 0, UINT32_MAX, &x))
			return cfg_fail(ld, "%s: '%s' is not a non-negative integer", where, text);
		v = json_integer((json_int_t)x);
	} else if (f->kind == K_BOOL) {
		static const char *const on[] = {"on", "true", "yes", "1"};
		static const char *const off[] = {"off", "false", "no", "0"};
		if (cfg_lookup_name(on, RW_ARRAY_SIZE(on), text) >= 0)
			v = json_true();
		else if (cfg_lookup_name(off, RW_ARRAY_SIZE(off), text) >= 0)
			v = json_false();
		else
			return cfg_fail(ld, "%s: '%s' is not on or off (also true/false, yes/no, 1/0)",
				    where, text);
	} else if (f->kind == K_F64) {
		char *end = NULL;
		errno = 0;
		double x = strtod(text, &end);
		if (!*text || errno || !end || *end)
			return cfg_fail(ld, "%s: '%s' is not a number", where, text);
		v = json_real(x);
	} else {
		v = json_string(text);
	}
	if (!v)
		return cfg_fail(ld, "%s: not valid text (UTF-8 expected)", where);
	rw_status_t st = set_field(ld, fi, v, where, src);
	json_decref(v);
	return st;
}


/* ---------------------------------------------------------------------------------------------
 * Finishing touches, the passes in order, and the public functions
 * ------------------------------------------------------------------------------------------- */

/* Expand "{node}" in a socket path template into dst. */
static rw_status_t expand_sock(loader_t *ld, const char *key, const char *tmpl, char *dst)
{
	const char *name = ld->cfg->nodes[ld->cfg->me].name;
	char out[RW_SVC_SOCK_MAX + RW_SVC_NAME_MAX];
	size_t n = 0;
	for (const char *p = tmpl; *p && n < sizeof(out) - 1;) {
		if (!strncmp(p, "{node}", 6)) {
			n += (size_t)snprintf(out + n, sizeof(out) - n, "%s", name);
			p += 6;
		} else {
			out[n++] = *p++;
		}
		if (n >= sizeof(out))
			n = sizeof(out) - 1;
	}
	out[n] = '\0';
	if (n >= RW_SVC_SOCK_MAX)
		return cfg_fail(ld, "%s: '%s' is longer than %d bytes after expansion", key, out,
			    RW_SVC_SOCK_MAX - 1);
	memcpy(dst, out, n + 1);
	return RW_OK;
}

static rw_status_t finish(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	rw_status_t st;
	if (cfg->group_area_mib && cfg->group_local_mib >= cfg->group_area_mib)
		return cfg_fail(ld, "group_local_mib: %u must be below group_area_mib (%u): the "
			    "carve-out's four record areas take the rest", cfg->group_local_mib,
			    cfg->group_area_mib);
	if (cfg->heartbeat_timeout_ms <= cfg->heartbeat_interval_ms)
		return cfg_fail(ld, "heartbeat_timeout_ms: %u must exceed heartbeat_interval_ms (%u)",
			    cfg->heartbeat_timeout_ms, cfg->heartbeat_interval_ms);
	if (cfg->poller_sleep_max_us < cfg->poller_sleep_min_us)
		return cfg_fail(ld, "poller_sleep_max_us: %u is below poller_sleep_min_us (%u)",
			    cfg->poller_sleep_max_us, cfg->poller_sleep_min_us);
	if (cfg->poller_busy_sleep_max_us != 0 &&
	    (cfg->poller_busy_sleep_max_us < cfg->poller_sleep_min_us ||
	     cfg->poller_busy_sleep_max_us > cfg->poller_sleep_max_us))
		return cfg_fail(ld, "poller_busy_sleep_max_us: %u is outside poller_sleep_min_us .. "
			    "poller_sleep_max_us (%u .. %u; 0 = spin while busy)",
			    cfg->poller_busy_sleep_max_us, cfg->poller_sleep_min_us, cfg->poller_sleep_max_us);
	for (uint32_t i = 0; i < cfg->n_nodes; i++)
		for (uint32_t r = 0; r < cfg->rails; r++) {
			rw_svc_rail_cfg_t *rail = &cfg->nodes[i].rails[r];
			if (rail->rate_gbps == 0)
				rail->rate_gbps = cfg->nic_gbps;
			if (cfg->transport != RW_SVC_TRANSPORT_VERBS && !rail->has_addr)
				return cfg_fail(ld, "nodes[%u].rails[%u].address: missing (the %s transport "
					    "needs an address)", i, r, rw_svc_transport_name(cfg->transport));
		}
	if (cfg->pace && cfg->transport == RW_SVC_TRANSPORT_VERBS)
		return cfg_fail(ld, "pace: on, but the %s transport cannot pace (an RDMA NIC runs at its "
			    "own rate); pacing emulates NICs of a chosen speed with tcp or shm",
			    rw_svc_transport_name(cfg->transport));
	struct stat tsb;
	if (cfg->trace_dir[0] && stat(cfg->trace_dir, &tsb) == 0 && !S_ISDIR(tsb.st_mode))
		return cfg_fail(ld, "trace_dir: '%s' is not a directory", cfg->trace_dir);
	if ((st = cfg_check_duplicates(ld)))
		return st;
	if ((st = cfg_find_me(ld)))
		return st;

	/* Node-level overrides beat the file's cluster-wide value, not env or flags. */
	const rw_svc_node_cfg_t *me = &cfg->nodes[cfg->me];
	if (me->ipc_socket[0] && ld->src[find_field("ipc_socket")] < SRC_ENV)
		snprintf(cfg->ipc_socket, sizeof(cfg->ipc_socket), "%s", me->ipc_socket);
	if (me->stats_socket[0] && ld->src[find_field("stats_socket")] < SRC_ENV)
		snprintf(cfg->stats_socket, sizeof(cfg->stats_socket), "%s",
			 me->stats_socket[0] == '\x01' ? "" : me->stats_socket);
	if (me->http[0] && ld->src[find_field("http")] < SRC_ENV)
		snprintf(ld->http_text, sizeof(ld->http_text), "%s", me->http);
	if ((st = expand_sock(ld, "ipc_socket", cfg->ipc_socket, cfg->ipc_socket)))
		return st;
	if ((st = expand_sock(ld, "stats_socket", cfg->stats_socket, cfg->stats_socket)))
		return st;
	if (!cfg_parse_http(ld->http_text, &cfg->http_enabled, &cfg->http))
		return cfg_fail(ld, "http: '%s' is not an IPv4 ADDR:PORT", ld->http_text);
	return RW_OK;
}

static void set_defaults(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	memset(cfg, 0, sizeof(*cfg));
	snprintf(cfg->cluster, sizeof(cfg->cluster), "railwave");
	cfg->transport = RW_SVC_TRANSPORT_TCP;
	cfg->control_port = 7400;
	cfg->rail_port = 7500;
	cfg->nic_gbps = 100;
	snprintf(cfg->ipc_socket, sizeof(cfg->ipc_socket), "/run/railwave/railwaved.sock");
	snprintf(cfg->stats_socket, sizeof(cfg->stats_socket), "/run/railwave/stats.sock");
	snprintf(ld->http_text, sizeof(ld->http_text), "127.0.0.1:9470");
	cfg->phase_timeout_ms = 10000;
	cfg->heartbeat_interval_ms = 500;
	cfg->heartbeat_timeout_ms = 3000;
	cfg->recv_region_mib = 64;
	cfg->group_area_mib = 0;
	cfg->group_pool_mib = 256;
	cfg->group_carve_per_uid = 0;
	cfg->group_carve_idle_s = 600;
	cfg->stats_timeout_ms = 30000;
	cfg->gpu_stall_ms = 5000;
	cfg->max_tokens = 65536;
	cfg->log_level = RW_LOG_INFO;
	cfg->force_path = RW_SVC_PATH_AUTO;
	cfg->trace_max_kib = 64u << 10;
	cfg->ipc_require_group_key = 0; /* docs/ipc.md: optional, so torchrun and the demo work */
	cfg->ipc_max_per_uid = 64;
	cfg->ipc_hello_timeout_ms = 5000;
	cfg->poller_spin_us = RW_IPC_POLLER_SPIN_US;
	cfg->poller_yield_us = RW_IPC_POLLER_YIELD_US;
	cfg->poller_sleep_min_us = RW_IPC_POLLER_SLEEP_MIN_US;
	cfg->poller_sleep_max_us = RW_IPC_POLLER_SLEEP_MAX_US;
	cfg->poller_busy_sleep_max_us = RW_IPC_POLLER_BUSY_SLEEP_MAX_US;
}

static const char *env_get(char *const *envp, const char *name)
{
	size_t n = strlen(name);
	for (; envp && *envp; envp++)
		if (!strncmp(*envp, name, n) && (*envp)[n] == '=')
			return *envp + n + 1;
	return NULL;
}

static const rw_svc_option_t *option_of(const char *key)
{
	for (const rw_svc_option_t *o = rw_svc_options; o->key; o++)
		if (!strcmp(o->key, key))
			return o;
	return NULL;
}

static rw_status_t load(loader_t *ld, json_t *root, char *const *envp, const rw_svc_kv_t *flags,
			size_t n_flags)
{
	rw_svc_config_t *cfg = ld->cfg;
	rw_status_t st;
	if (!json_is_object(root))
		return cfg_fail(ld, "(top level): expected a JSON object, got %s", cfg_json_type_name(root));

	/* Scalars first (ports are the defaults nodes[] needs), then env and flags, so that the
	 * defaults nodes[] inherits (rail_port, control_port) already carry every override. */
	const char *key;
	json_t *v;
	json_object_foreach(root, key, v) {
		if (key[0] == '_' || !strcmp(key, "nodes") || !strcmp(key, "gpu_rail"))
			continue;
		int fi = find_field(key);
		if (fi < 0)
			return cfg_fail(ld, "%s: unknown field", key);
		if ((st = set_field(ld, (size_t)fi, v, key, SRC_FILE)))
			return st;
	}
	if (env_get(envp, "RAILWAVE_IPC_SOCKET"))
		return cfg_fail(ld, "RAILWAVE_IPC_SOCKET: renamed RAILWAVE_SOCKET (the variable librailwave "
			    "reads too); set that instead");
	for (const rw_svc_option_t *o = rw_svc_options; o->key; o++) {
		const char *val = env_get(envp, o->env);
		int fi = find_field(o->key);
		if (!val || fi < 0)
			continue;
		if ((st = set_field_text(ld, (size_t)fi, val, o->env, SRC_ENV)))
			return st;
	}
	for (size_t i = 0; i < n_flags; i++) {
		int fi = find_field(flags[i].key);
		const rw_svc_option_t *o = option_of(flags[i].key);
		char where[64];
		snprintf(where, sizeof(where), "--%s", o ? o->flag : flags[i].key);
		if (fi < 0 || !o)
			return cfg_fail(ld, "%s: not a setting that a flag may change", where);
		if ((st = set_field_text(ld, (size_t)fi, flags[i].value ? flags[i].value : "",
					 where, SRC_FLAG)))
			return st;
	}

	json_t *nodes = json_object_get(root, "nodes");
	if (!nodes)
		return cfg_fail(ld, "nodes: missing");
	if ((st = cfg_parse_nodes(ld, nodes)))
		return st;
	if (ld->src[find_field("gpus_per_node")] == SRC_DEFAULT)
		cfg->gpus_per_node = cfg->rails;
	json_t *gr = json_object_get(root, "gpu_rail");
	if (gr) {
		if ((st = cfg_parse_gpu_rail(ld, gr)))
			return st;
	} else {
		for (uint32_t g = 0; g < cfg->gpus_per_node; g++)
			cfg->gpu_rail[g] = (uint8_t)(g % cfg->rails);
	}
	return finish(ld);
}

rw_status_t rw_svc_config_load_text(const char *json, char *const *envp,
				    const rw_svc_kv_t *flags, size_t n_flags,
				    rw_svc_config_t *cfg, char *err, size_t err_len)
{
	loader_t ld = {.cfg = cfg, .err = err, .err_len = err_len};
	if (err && err_len)
		err[0] = '\0';
	set_defaults(&ld);
	json_error_t jerr;
	json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &jerr);
	if (!root) {
		cfg_fail(&ld, "(JSON) line %d column %d: %s", jerr.line, jerr.column, jerr.text);
		return RW_ERR_PARSE;
	}
	rw_status_t st = load(&ld, root, envp, flags, n_flags);
	json_decref(root);
	if (st) {
		if (st == RW_ERR_NOMEM && err && err_len)
			snprintf(err, err_len, "out of memory");
		rw_svc_config_free(cfg);
	}
	return st;
}

rw_status_t rw_svc_config_load(const char *path, char *const *envp, const rw_svc_kv_t *flags,
			       size_t n_flags, rw_svc_config_t *cfg, char *err, size_t err_len)
{
	if (!path || !*path)
		path = env_get(envp, "RAILWAVE_CONFIG");
	if (!path || !*path)
		return rw_svc_config_load_text(rw_svc_default_config_json, envp, flags, n_flags, cfg,
					       err, err_len);
	memset(cfg, 0, sizeof(*cfg));
	char *text = NULL;
	char why[512];
	rw_status_t st = rw_read_file(path, CONFIG_MAX_BYTES, &text, NULL, why, sizeof(why));
	if (st) {
		if (err && err_len)
			snprintf(err, err_len, "config: %s", why);
		return st;
	}
	st = rw_svc_config_load_text(text, envp, flags, n_flags, cfg, err, err_len);
	if (st == RW_ERR_PARSE && err && err_len && strncmp(err, "--", 2) != 0 &&
	    strncmp(err, "RAILWAVE_", 9) != 0) {
		/* Prefix the file name so the operator knows which file; errors in a flag or an
		 * environment variable start with its name and are not the file's. */
		char msg[512];
		snprintf(msg, sizeof(msg), "%s", err);
		snprintf(err, err_len, "%s: %s", path, msg);
	}
	free(text);
	return st;
}

void rw_svc_config_free(rw_svc_config_t *cfg)
{
	if (!cfg)
		return;
	free(cfg->nodes);
	memset(cfg, 0, sizeof(*cfg));
}

void rw_svc_config_topo(const rw_svc_config_t *cfg, rw_topo_t *topo)
{
	memset(topo, 0, sizeof(*topo));
	topo->nodes = cfg->n_nodes;
	topo->gpus_per_node = cfg->gpus_per_node;
	topo->rails = cfg->rails;
	memcpy(topo->gpu_rail, cfg->gpu_rail, sizeof(topo->gpu_rail));
	for (uint32_t r = 0; r < cfg->rails; r++) {
		double slowest = 0;
		for (uint32_t i = 0; i < cfg->n_nodes; i++) {
			double g = cfg->nodes[i].rails[r].rate_gbps;
			if (i == 0 || g < slowest)
				slowest = g;
		}
		topo->rail_weight[r] = slowest < 1 ? 1 : (uint32_t)(slowest + 0.5);
	}
}
