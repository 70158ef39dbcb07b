/* railwaved configuration: a JSON cluster file (or the embedded loopback default), then the
 * environment (RAILWAVE_*), then command-line flags, folded into one validated rw_svc_config_t.
 * Every error names the field it is about, in the form the operator wrote it: "nodes[2].rails[1]
 * .address", "RAILWAVE_HTTP" or "--http". Field reference: docs/service.md. */
#include "service/svc.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

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
	"  \"ipc_socket\": \"/tmp/railwave/{node}.sock\",\n"
	"  \"stats_socket\": \"/tmp/railwave/{node}.stats\",\n"
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

typedef enum field_kind {
	K_NAME,      /* [A-Za-z0-9._-]{1,63} */
	K_NODE,      /* node name or index (identity) */
	K_SOCK,      /* Unix socket path template ("{node}" expands) */
	K_FILE,      /* other path; "" allowed */
	K_GROUP,     /* group name; "" allowed */
	K_U32,
	K_F64,
	K_TRANSPORT,
	K_LOGLEVEL,
	K_FORCEPATH,
	K_HTTP,      /* "ADDR:PORT" | "0" | "off" | "" */
	K_BOOL,      /* JSON true/false; text on|off, true|false, yes|no, 1|0 */
} field_kind_t;

typedef struct field {
	const char *key;
	field_kind_t kind;
	size_t off;          /* into rw_svc_config_t (unused for K_NODE and K_HTTP) */
	size_t size;         /* string capacity */
	double min, max;     /* numeric range, inclusive */
} field_t;

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
	{"stats_timeout_ms", K_U32, OFF(stats_timeout_ms), 0, 1, 3600000},
	{"log_level", K_LOGLEVEL, OFF(log_level), 0, 0, 0},
	{"path", K_FORCEPATH, OFF(force_path), 0, 0, 0},
	{"pace", K_BOOL, OFF(pace), 0, 0, 0},
	{"trace_dir", K_FILE, OFF(trace_dir), SZ(trace_dir), 0, 0},
	{"trace_max_kib", K_U32, OFF(trace_max_kib), 0, 16, 1u << 30},
};
#define N_FIELDS RW_ARRAY_SIZE(fields)

const rw_svc_option_t rw_svc_options[] = {
	{"config", "config", "RAILWAVE_CONFIG", "FILE", "cluster file (default: embedded 4x4 loopback)"},
	{"node", "node", "RAILWAVE_NODE", "NAME|INDEX", "this node (default: match the host name)"},
	{"transport", "transport", "RAILWAVE_TRANSPORT", "tcp|verbs", "rail transport"},
	{"anchors", "anchors", "RAILWAVE_ANCHORS", "FILE", "anchor table (\"\" = none: Joint)"},
	{"path", "path", "RAILWAVE_PATH", "auto|native|rail-only|perm-only|joint", "force a path"},
	{"ipc_socket", "ipc-socket", "RAILWAVE_IPC_SOCKET", "PATH", "trainer rank socket"},
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
	{"stats_timeout_ms", "stats-timeout-ms", "RAILWAVE_STATS_TIMEOUT_MS", "MS",
	 "stats client line deadline"},
	{"pace", "pace", "RAILWAVE_PACE", "on|off", "pace every rail at its rate_gbps (tcp)"},
	{"trace_dir", "trace-dir", "RAILWAVE_TRACE_DIR", "DIR", "phase traces (\"\" = off)"},
	{"trace_max_kib", "trace-max-kib", "RAILWAVE_TRACE_MAX_KIB", "KIB", "trace files' size bound"},
	{NULL, NULL, NULL, NULL, NULL},
};

typedef enum source {
	SRC_DEFAULT = 0,
	SRC_FILE,
	SRC_NODE,
	SRC_ENV,
	SRC_FLAG,
} source_t;

typedef struct loader {
	rw_svc_config_t *cfg;
	char *err;
	size_t err_len;
	source_t src[N_FIELDS];
	char node_sel[RW_SVC_NAME_MAX];
	char http_text[64];
} loader_t;

static const char *const log_level_names[] = {"error", "warn", "info", "debug"};

const char *rw_svc_transport_name(rw_svc_transport_t t)
{
	return t == RW_SVC_TRANSPORT_VERBS ? "verbs" : "tcp";
}

static rw_status_t fail(loader_t *ld, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static rw_status_t fail(loader_t *ld, const char *fmt, ...)
{
	if (ld->err && ld->err_len) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(ld->err, ld->err_len, fmt, ap);
		va_end(ap);
	}
	return RW_ERR_PARSE;
}

static int is_name(const char *s)
{
	size_t n = strlen(s);
	if (n == 0 || n >= RW_SVC_NAME_MAX)
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)s[i]) && s[i] != '.' && s[i] != '_' && s[i] != '-')
			return 0;
	return 1;
}

static const char *json_type_name(const json_t *v)
{
	switch (json_typeof(v)) {
	case JSON_OBJECT: return "an object";
	case JSON_ARRAY: return "an array";
	case JSON_STRING: return "a string";
	case JSON_INTEGER: return "an integer";
	case JSON_REAL: return "a number";
	case JSON_TRUE:
	case JSON_FALSE: return "a boolean";
	case JSON_NULL: return "null";
	}
	return "?";
}

/* "a.b.c.d" -> endpoint (port untouched). 0 if not a dotted-quad IPv4 address. */
static int parse_ipv4(const char *s, rw_svc_endpoint_t *ep)
{
	struct in_addr a;
	if (strlen(s) >= sizeof(ep->text) || inet_pton(AF_INET, s, &a) != 1)
		return 0;
	memset(&ep->sin, 0, sizeof(ep->sin));
	ep->sin.sin_family = AF_INET;
	ep->sin.sin_addr = a;
	ep->sin.sin_port = htons(ep->port);
	snprintf(ep->text, sizeof(ep->text), "%s", s);
	return 1;
}

static void set_port(rw_svc_endpoint_t *ep, uint16_t port)
{
	ep->port = port;
	ep->sin.sin_port = htons(port);
}

/* Parse a decimal integer in [min, max]; the whole string must be digits. */
static int parse_uint(const char *s, unsigned long long min, unsigned long long max,
		      unsigned long long *v_p)
{
	if (!*s || strlen(s) > 20)
		return 0;
	for (const char *p = s; *p; p++)
		if (!isdigit((unsigned char)*p))
			return 0;
	errno = 0;
	unsigned long long v = strtoull(s, NULL, 10);
	if (errno || v < min || v > max)
		return 0;
	*v_p = v;
	return 1;
}

/* "ADDR" or "ADDR:PORT" (port 0..65535 when allow_zero, else 1..). has_port_p may be NULL. */
static int parse_addr_port(const char *s, int allow_zero, rw_svc_endpoint_t *ep, int *has_port_p)
{
	char buf[64];
	if (strlen(s) >= sizeof(buf))
		return 0;
	snprintf(buf, sizeof(buf), "%s", s);
	char *colon = strchr(buf, ':');
	int has_port = 0;
	unsigned long long port = 0;
	if (colon) {
		*colon = '\0';
		if (!parse_uint(colon + 1, allow_zero ? 0 : 1, 65535, &port))
			return 0;
		has_port = 1;
	}
	if (!parse_ipv4(buf, ep))
		return 0;
	if (has_port)
		set_port(ep, (uint16_t)port);
	if (has_port_p)
		*has_port_p = has_port;
	return 1;
}

/* http value: off, or an address with a port. Returns 1 if valid. */
static int parse_http(const char *s, int *enabled_p, rw_svc_endpoint_t *ep)
{
	if (!*s || !strcmp(s, "0") || !strcmp(s, "off")) {
		*enabled_p = 0;
		return 1;
	}
	int has_port = 0;
	rw_svc_endpoint_t tmp = {0};
	if (!parse_addr_port(s, 1, &tmp, &has_port) || !has_port)
		return 0;
	*ep = tmp;
	*enabled_p = 1;
	return 1;
}

static int lookup_name(const char *const *names, size_t n, const char *s)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(names[i], s))
			return (int)i;
	return -1;
}

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
			return fail(ld, "%s: expected a string, got %s", where, json_type_name(v));
		if (!is_name(s))
			return fail(ld, "%s: '%s' is not a valid name (1-63 of A-Z a-z 0-9 . _ -)",
				    where, s);
		snprintf(base + f->off, f->size, "%s", s);
		break;
	case K_NODE:
		if (json_is_integer(v)) {
			if (json_integer_value(v) < 0 || json_integer_value(v) >= RW_MAX_NODES)
				return fail(ld, "%s: index %lld out of range", where,
					    (long long)json_integer_value(v));
			snprintf(ld->node_sel, sizeof(ld->node_sel), "%lld",
				 (long long)json_integer_value(v));
			break;
		}
		if (!s)
			return fail(ld, "%s: expected a node name or index, got %s", where,
				    json_type_name(v));
		if (!is_name(s))
			return fail(ld, "%s: '%s' is not a valid node name or index", where, s);
		snprintf(ld->node_sel, sizeof(ld->node_sel), "%s", s);
		break;
	case K_SOCK:
	case K_FILE:
	case K_GROUP:
		if (!s)
			return fail(ld, "%s: expected a string, got %s", where, json_type_name(v));
		if (strlen(s) >= f->size)
			return fail(ld, "%s: longer than %zu bytes", where, f->size - 1);
		if (f->kind == K_GROUP && *s && !is_name(s))
			return fail(ld, "%s: '%s' is not a valid group name", where, s);
		if (f->kind == K_SOCK && !strcmp(f->key, "ipc_socket") && !*s)
			return fail(ld, "%s: must not be empty", where);
		snprintf(base + f->off, f->size, "%s", s);
		break;
	case K_U32: {
		if (!json_is_integer(v))
			return fail(ld, "%s: expected an integer, got %s", where, json_type_name(v));
		json_int_t x = json_integer_value(v);
		if ((double)x < f->min || (double)x > f->max)
			return fail(ld, "%s: %lld out of range [%.0f, %.0f]", where, (long long)x,
				    f->min, f->max);
		*(uint32_t *)(void *)(base + f->off) = (uint32_t)x;
		break;
	}
	case K_F64: {
		if (!json_is_number(v))
			return fail(ld, "%s: expected a number, got %s", where, json_type_name(v));
		double x = json_number_value(v);
		if (!(x >= f->min && x <= f->max))
			return fail(ld, "%s: %g out of range [%g, %g]", where, x, f->min, f->max);
		*(double *)(void *)(base + f->off) = x;
		break;
	}
	case K_TRANSPORT:
		if (!s || (strcmp(s, "tcp") && strcmp(s, "verbs")))
			return fail(ld, "%s: expected \"tcp\" or \"verbs\"", where);
		cfg->transport = !strcmp(s, "verbs") ? RW_SVC_TRANSPORT_VERBS : RW_SVC_TRANSPORT_TCP;
		break;
	case K_LOGLEVEL: {
		int i = s ? lookup_name(log_level_names, RW_ARRAY_SIZE(log_level_names), s) : -1;
		if (i < 0)
			return fail(ld, "%s: expected one of error, warn, info, debug", where);
		cfg->log_level = (rw_log_level_t)i;
		break;
	}
	case K_FORCEPATH: {
		rw_path_t path = RW_PATH_JOINT;
		if (!s || (strcmp(s, "auto") && rw_sched_path_parse(s, &path) != RW_OK))
			return fail(ld, "%s: expected one of auto, native, rail-only, perm-only, joint",
				    where);
		cfg->force_path = strcmp(s, "auto") ? (int)path : RW_SVC_PATH_AUTO;
		break;
	}
	case K_HTTP: {
		char buf[64];
		if (json_is_integer(v) && json_integer_value(v) == 0)
			s = "0";
		if (!s)
			return fail(ld, "%s: expected \"ADDR:PORT\" or 0, got %s", where,
				    json_type_name(v));
		int en;
		rw_svc_endpoint_t ep;
		if (strlen(s) >= sizeof(buf) || !parse_http(s, &en, &ep))
			return fail(ld, "%s: '%s' is not an IPv4 ADDR:PORT (or 0 = off)", where, s);
		snprintf(ld->http_text, sizeof(ld->http_text), "%s", s);
		break;
	}
	case K_BOOL:
		if (!json_is_boolean(v))
			return fail(ld, "%s: expected true or false, got %s", where, json_type_name(v));
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
		if (!parse_uint(text, 0, UINT32_MAX, &x))
			return fail(ld, "%s: '%s' is not a non-negative integer", where, text);
		v = json_integer((json_int_t)x);
	} else if (f->kind == K_BOOL) {
		static const char *const on[] = {"on", "true", "yes", "1"};
		static const char *const off[] = {"off", "false", "no", "0"};
		if (lookup_name(on, RW_ARRAY_SIZE(on), text) >= 0)
			v = json_true();
		else if (lookup_name(off, RW_ARRAY_SIZE(off), text) >= 0)
			v = json_false();
		else
			return fail(ld, "%s: '%s' is not on or off (also true/false, yes/no, 1/0)",
				    where, text);
	} else if (f->kind == K_F64) {
		char *end = NULL;
		errno = 0;
		double x = strtod(text, &end);
		if (!*text || errno || !end || *end)
			return fail(ld, "%s: '%s' is not a number", where, text);
		v = json_real(x);
	} else {
		v = json_string(text);
	}
	if (!v)
		return fail(ld, "%s: not valid text (UTF-8 expected)", where);
	rw_status_t st = set_field(ld, fi, v, where, src);
	json_decref(v);
	return st;
}

/* ---------------------------------------------------------------------------------------------
 * nodes[] and gpu_rail
 * ------------------------------------------------------------------------------------------- */

static rw_status_t parse_rail(loader_t *ld, const json_t *v, uint32_t ni, uint32_t ri,
			      rw_svc_rail_cfg_t *rail)
{
	char where[64];
	snprintf(where, sizeof(where), "nodes[%u].rails[%u]", ni, ri);
	rail->device_port = 1;
	rail->rate_gbps = 0; /* = nic_gbps, filled later */
	set_port(&rail->addr, (uint16_t)ld->cfg->rail_port);
	if (json_is_string(v)) {
		int has_port = 0;
		if (!parse_addr_port(json_string_value(v), 0, &rail->addr, &has_port))
			return fail(ld, "%s: '%s' is not an IPv4 address (ADDR or ADDR:PORT)", where,
				    json_string_value(v));
		if (!has_port)
			set_port(&rail->addr, (uint16_t)ld->cfg->rail_port);
		rail->has_addr = 1;
		return RW_OK;
	}
	if (!json_is_object(v))
		return fail(ld, "%s: expected an address string or an object, got %s", where,
			    json_type_name(v));
	const char *key;
	json_t *x;
	json_object_foreach((json_t *)v, key, x) {
		if (key[0] == '_')
			continue; /* comment */
		if (!strcmp(key, "address")) {
			if (!json_is_string(x) || !parse_ipv4(json_string_value(x), &rail->addr))
				return fail(ld, "%s.address: not an IPv4 address", where);
			rail->has_addr = 1;
		} else if (!strcmp(key, "port")) {
			if (!json_is_integer(x) || json_integer_value(x) < 1 ||
			    json_integer_value(x) > 65535)
				return fail(ld, "%s.port: expected an integer in [1, 65535]", where);
		} else if (!strcmp(key, "device")) {
			if (!json_is_string(x) || !json_string_length(x) ||
			    json_string_length(x) >= RW_SVC_DEVICE_MAX || !is_name(json_string_value(x)))
				return fail(ld, "%s.device: expected a device name like \"mlx5_0\"", where);
			snprintf(rail->device, sizeof(rail->device), "%s", json_string_value(x));
		} else if (!strcmp(key, "device_port")) {
			if (!json_is_integer(x) || json_integer_value(x) < 1 ||
			    json_integer_value(x) > 255)
				return fail(ld, "%s.device_port: expected an integer in [1, 255]", where);
			rail->device_port = (uint32_t)json_integer_value(x);
		} else if (!strcmp(key, "rate_gbps")) {
			if (!json_is_number(x) || !(json_number_value(x) >= 0.001 &&
						     json_number_value(x) <= 100000))
				return fail(ld, "%s.rate_gbps: expected a number in [0.001, 100000]",
					    where);
			rail->rate_gbps = json_number_value(x);
		} else {
			return fail(ld, "%s.%s: unknown field", where, key);
		}
	}
	json_t *port = json_object_get(v, "port");
	if (port)
		set_port(&rail->addr, (uint16_t)json_integer_value(port));
	if (!rail->has_addr && !rail->device[0])
		return fail(ld, "%s: needs an address (or a device for verbs)", where);
	return RW_OK;
}

static rw_status_t parse_node(loader_t *ld, const json_t *v, uint32_t ni, rw_svc_node_cfg_t *node,
			      uint32_t *n_rails_p)
{
	char where[48];
	snprintf(where, sizeof(where), "nodes[%u]", ni);
	if (!json_is_object(v))
		return fail(ld, "%s: expected an object, got %s", where, json_type_name(v));
	const json_t *name = json_object_get(v, "name");
	if (!name)
		return fail(ld, "%s.name: missing", where);
	if (!json_is_string(name) || !is_name(json_string_value(name)))
		return fail(ld, "%s.name: expected a name (1-63 of A-Z a-z 0-9 . _ -)", where);
	snprintf(node->name, sizeof(node->name), "%s", json_string_value(name));
	snprintf(node->host, sizeof(node->host), "%s", node->name);

	const json_t *rails = json_object_get(v, "rails");
	if (!rails)
		return fail(ld, "%s.rails: missing", where);
	if (!json_is_array(rails) || json_array_size(rails) == 0)
		return fail(ld, "%s.rails: expected a non-empty array", where);
	if (json_array_size(rails) > RW_MAX_RAILS)
		return fail(ld, "%s.rails: %zu rails, at most %d supported", where,
			    json_array_size(rails), RW_MAX_RAILS);
	size_t ri;
	json_t *rv;
	json_array_foreach(rails, ri, rv) {
		rw_status_t st = parse_rail(ld, rv, ni, (uint32_t)ri, &node->rails[ri]);
		if (st)
			return st;
	}
	*n_rails_p = (uint32_t)json_array_size(rails);

	int has_control = 0;
	const char *key;
	json_t *x;
	json_object_foreach((json_t *)v, key, x) {
		if (key[0] == '_' || !strcmp(key, "name") || !strcmp(key, "rails"))
			continue;
		if (!strcmp(key, "host")) {
			if (!json_is_string(x) || !json_string_length(x) ||
			    json_string_length(x) >= RW_SVC_HOST_MAX)
				return fail(ld, "%s.host: expected a host name", where);
			snprintf(node->host, sizeof(node->host), "%s", json_string_value(x));
		} else if (!strcmp(key, "control")) {
			int has_port = 0;
			if (!json_is_string(x) ||
			    !parse_addr_port(json_string_value(x), 0, &node->control, &has_port))
				return fail(ld, "%s.control: not an IPv4 address (ADDR or ADDR:PORT)",
					    where);
			if (!has_port)
				set_port(&node->control, (uint16_t)ld->cfg->control_port);
			has_control = 1;
		} else if (!strcmp(key, "ipc_socket") || !strcmp(key, "stats_socket")) {
			char *dst = key[0] == 'i' ? node->ipc_socket : node->stats_socket;
			if (!json_is_string(x) || json_string_length(x) >= RW_SVC_SOCK_MAX)
				return fail(ld, "%s.%s: expected a path shorter than %d bytes", where,
					    key, RW_SVC_SOCK_MAX);
			if (!json_string_length(x) && key[0] == 'i')
				return fail(ld, "%s.%s: must not be empty", where, key);
			/* An empty per-node stats_socket turns it off: keep a marker. */
			snprintf(dst, RW_SVC_SOCK_MAX, "%s", json_string_length(x) ?
				 json_string_value(x) : "\x01");
		} else if (!strcmp(key, "http")) {
			const char *s = json_is_string(x) ? json_string_value(x) :
				(json_is_integer(x) && json_integer_value(x) == 0) ? "0" : NULL;
			int en;
			rw_svc_endpoint_t ep;
			if (!s || strlen(s) >= sizeof(node->http) || !parse_http(s, &en, &ep))
				return fail(ld, "%s.http: not an IPv4 ADDR:PORT (or 0 = off)", where);
			snprintf(node->http, sizeof(node->http), "%s", *s ? s : "0");
		} else {
			return fail(ld, "%s.%s: unknown field", where, key);
		}
	}
	if (!has_control) {
		if (!node->rails[0].has_addr)
			return fail(ld, "%s.control: missing (rails[0] has no address to default to)",
				    where);
		node->control = node->rails[0].addr;
		set_port(&node->control, (uint16_t)ld->cfg->control_port);
	}
	return RW_OK;
}

typedef struct ep_ref {
	uint32_t ip, port;
	uint32_t node, rail; /* rail == UINT32_MAX: the control endpoint */
} ep_ref_t;

static int ep_cmp(const void *a, const void *b)
{
	const ep_ref_t *x = a, *y = b;
	if (x->ip != y->ip)
		return x->ip < y->ip ? -1 : 1;
	if (x->port != y->port)
		return x->port < y->port ? -1 : 1;
	if (x->node != y->node)
		return x->node < y->node ? -1 : 1;
	return x->rail < y->rail ? -1 : x->rail > y->rail;
}

static void ep_name(const ep_ref_t *e, char *buf, size_t len)
{
	if (e->rail == UINT32_MAX)
		snprintf(buf, len, "nodes[%u].control", e->node);
	else
		snprintf(buf, len, "nodes[%u].rails[%u]", e->node, e->rail);
}

/* Every control and rail endpoint (address:port) must be unique across the cluster. */
static rw_status_t check_duplicates(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	size_t n = 0, cap = (size_t)cfg->n_nodes * (cfg->rails + 1);
	ep_ref_t *eps = calloc(cap, sizeof(*eps));
	if (!eps)
		return RW_ERR_NOMEM;
	for (uint32_t i = 0; i < cfg->n_nodes; i++) {
		const rw_svc_node_cfg_t *nd = &cfg->nodes[i];
		eps[n++] = (ep_ref_t){nd->control.sin.sin_addr.s_addr, nd->control.port, i, UINT32_MAX};
		for (uint32_t r = 0; r < cfg->rails; r++)
			if (nd->rails[r].has_addr)
				eps[n++] = (ep_ref_t){nd->rails[r].addr.sin.sin_addr.s_addr,
						      nd->rails[r].addr.port, i, r};
	}
	qsort(eps, n, sizeof(*eps), ep_cmp);
	rw_status_t st = RW_OK;
	for (size_t k = 1; k < n; k++) {
		if (eps[k].ip != eps[k - 1].ip || eps[k].port != eps[k - 1].port)
			continue;
		char a[48], b[48];
		ep_name(&eps[k], a, sizeof(a));
		ep_name(&eps[k - 1], b, sizeof(b));
		const rw_svc_endpoint_t *e = eps[k].rail == UINT32_MAX ?
			&cfg->nodes[eps[k].node].control : &cfg->nodes[eps[k].node].rails[eps[k].rail].addr;
		st = fail(ld, "%s%s: duplicate address %s:%u, also used by %s", a,
			  eps[k].rail == UINT32_MAX ? "" : ".address", e->text, e->port, b);
		break;
	}
	free(eps);
	return st;
}

static int name_cmp(const void *a, const void *b, void *nodes)
{
	const rw_svc_node_cfg_t *nd = nodes;
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	int c = strcmp(nd[x].name, nd[y].name);
	return c ? c : (x > y) - (x < y);
}

/* Node names are unique (sorted, so that 4096-node clusters load fast). */
static rw_status_t check_names(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	uint32_t *idx = malloc(cfg->n_nodes * sizeof(*idx));
	if (!idx)
		return RW_ERR_NOMEM;
	for (uint32_t i = 0; i < cfg->n_nodes; i++)
		idx[i] = i;
	qsort_r(idx, cfg->n_nodes, sizeof(*idx), name_cmp, cfg->nodes);
	rw_status_t st = RW_OK;
	for (uint32_t k = 1; k < cfg->n_nodes && !st; k++)
		if (!strcmp(cfg->nodes[idx[k]].name, cfg->nodes[idx[k - 1]].name))
			st = fail(ld, "nodes[%u].name: duplicate name '%s' (also nodes[%u])", idx[k],
				  cfg->nodes[idx[k]].name, idx[k - 1]);
	free(idx);
	return st;
}

/* Node names unique; every node has the same rail count. */
static rw_status_t parse_nodes(loader_t *ld, const json_t *nodes)
{
	rw_svc_config_t *cfg = ld->cfg;
	if (!json_is_array(nodes) || json_array_size(nodes) == 0)
		return fail(ld, "nodes: expected a non-empty array");
	if (json_array_size(nodes) > RW_MAX_NODES)
		return fail(ld, "nodes: %zu nodes, at most %d supported", json_array_size(nodes),
			    RW_MAX_NODES);
	cfg->n_nodes = (uint32_t)json_array_size(nodes);
	cfg->nodes = calloc(cfg->n_nodes, sizeof(*cfg->nodes));
	if (!cfg->nodes)
		return RW_ERR_NOMEM;
	size_t i;
	json_t *v;
	json_array_foreach(nodes, i, v) {
		uint32_t n_rails = 0;
		rw_status_t st = parse_node(ld, v, (uint32_t)i, &cfg->nodes[i], &n_rails);
		if (st)
			return st;
		if (i == 0)
			cfg->rails = n_rails;
		else if (n_rails != cfg->rails)
			return fail(ld, "nodes[%zu].rails: %u rails, but nodes[0] has %u (every node "
				    "needs the same rail count)", i, n_rails, cfg->rails);
	}
	return check_names(ld);
}

static rw_status_t parse_gpu_rail(loader_t *ld, const json_t *v)
{
	rw_svc_config_t *cfg = ld->cfg;
	if (!json_is_array(v))
		return fail(ld, "gpu_rail: expected an array of rail indices");
	if (json_array_size(v) != cfg->gpus_per_node)
		return fail(ld, "gpu_rail: %zu entries, but gpus_per_node is %u",
			    json_array_size(v), cfg->gpus_per_node);
	size_t g;
	json_t *x;
	json_array_foreach(v, g, x) {
		if (!json_is_integer(x) || json_integer_value(x) < 0 ||
		    json_integer_value(x) >= cfg->rails)
			return fail(ld, "gpu_rail[%zu]: expected a rail index in [0, %u]", g,
				    cfg->rails - 1);
		cfg->gpu_rail[g] = (uint8_t)json_integer_value(x);
	}
	return RW_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Identity and finishing touches
 * ------------------------------------------------------------------------------------------- */

static rw_status_t find_me(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	if (ld->node_sel[0]) {
		/* A name first (a node may be called "3"), then an index. */
		for (uint32_t i = 0; i < cfg->n_nodes; i++)
			if (!strcmp(cfg->nodes[i].name, ld->node_sel)) {
				cfg->me = i;
				return RW_OK;
			}
		unsigned long long idx;
		if (parse_uint(ld->node_sel, 0, UINT32_MAX, &idx)) {
			if (idx >= cfg->n_nodes) {
				fail(ld, "node: index %llu out of range (the cluster has %u nodes)", idx,
				     cfg->n_nodes);
				return RW_ERR_NOTFOUND;
			}
			cfg->me = (uint32_t)idx;
			return RW_OK;
		}
		fail(ld, "node: '%s' not found in nodes[] (%u nodes: %s%s%s)", ld->node_sel,
		     cfg->n_nodes, cfg->nodes[0].name, cfg->n_nodes > 1 ? ", " : "",
		     cfg->n_nodes > 2 ? "..." : cfg->n_nodes > 1 ? cfg->nodes[1].name : "");
		return RW_ERR_NOTFOUND;
	}
	char host[RW_SVC_HOST_MAX] = "";
	if (gethostname(host, sizeof(host) - 1) != 0)
		host[0] = '\0';
	char short_host[RW_SVC_HOST_MAX];
	snprintf(short_host, sizeof(short_host), "%s", host);
	char *dot = strchr(short_host, '.');
	if (dot)
		*dot = '\0';
	int found = -1;
	for (uint32_t i = 0; i < cfg->n_nodes && host[0]; i++) {
		const char *h = cfg->nodes[i].host;
		if (strcmp(h, host) && strcmp(h, short_host))
			continue;
		if (found >= 0)
			return fail(ld, "node: host name '%s' matches nodes[%d] and nodes[%u]; pass "
				    "--node NAME|INDEX", host, found, i);
		found = (int)i;
	}
	if (found < 0) {
		fail(ld, "node: this host ('%s') matches no nodes[].host; pass --node NAME|INDEX "
		     "or set RAILWAVE_NODE", host);
		return RW_ERR_NOTFOUND;
	}
	cfg->me = (uint32_t)found;
	return RW_OK;
}

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
		return fail(ld, "%s: '%s' is longer than %d bytes after expansion", key, out,
			    RW_SVC_SOCK_MAX - 1);
	memcpy(dst, out, n + 1);
	return RW_OK;
}

static rw_status_t finish(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	rw_status_t st;
	if (cfg->heartbeat_timeout_ms <= cfg->heartbeat_interval_ms)
		return fail(ld, "heartbeat_timeout_ms: %u must exceed heartbeat_interval_ms (%u)",
			    cfg->heartbeat_timeout_ms, cfg->heartbeat_interval_ms);
	for (uint32_t i = 0; i < cfg->n_nodes; i++)
		for (uint32_t r = 0; r < cfg->rails; r++) {
			rw_svc_rail_cfg_t *rail = &cfg->nodes[i].rails[r];
			if (rail->rate_gbps == 0)
				rail->rate_gbps = cfg->nic_gbps;
			if (cfg->transport == RW_SVC_TRANSPORT_TCP && !rail->has_addr)
				return fail(ld, "nodes[%u].rails[%u].address: missing (the tcp transport "
					    "needs an address)", i, r);
		}
	if (cfg->pace && cfg->transport != RW_SVC_TRANSPORT_TCP)
		return fail(ld, "pace: on, but the %s transport cannot pace (an RDMA NIC runs at its "
			    "own rate); pacing emulates slower NICs with tcp",
			    rw_svc_transport_name(cfg->transport));
	struct stat tsb;
	if (cfg->trace_dir[0] && stat(cfg->trace_dir, &tsb) == 0 && !S_ISDIR(tsb.st_mode))
		return fail(ld, "trace_dir: '%s' is not a directory", cfg->trace_dir);
	if ((st = check_duplicates(ld)))
		return st;
	if ((st = find_me(ld)))
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
	if (!parse_http(ld->http_text, &cfg->http_enabled, &cfg->http))
		return fail(ld, "http: '%s' is not an IPv4 ADDR:PORT", ld->http_text);
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
	cfg->stats_timeout_ms = 30000;
	cfg->log_level = RW_LOG_INFO;
	cfg->force_path = RW_SVC_PATH_AUTO;
	cfg->trace_max_kib = 64u << 10;
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
		return fail(ld, "(top level): expected a JSON object, got %s", json_type_name(root));

	/* Scalars first (ports are the defaults nodes[] needs), then env and flags, so that the
	 * defaults nodes[] inherits (rail_port, control_port) already carry every override. */
	const char *key;
	json_t *v;
	json_object_foreach(root, key, v) {
		if (key[0] == '_' || !strcmp(key, "nodes") || !strcmp(key, "gpu_rail"))
			continue;
		int fi = find_field(key);
		if (fi < 0)
			return fail(ld, "%s: unknown field", key);
		if ((st = set_field(ld, (size_t)fi, v, key, SRC_FILE)))
			return st;
	}
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
			return fail(ld, "%s: not a setting that a flag may change", where);
		if ((st = set_field_text(ld, (size_t)fi, flags[i].value ? flags[i].value : "",
					 where, SRC_FLAG)))
			return st;
	}

	json_t *nodes = json_object_get(root, "nodes");
	if (!nodes)
		return fail(ld, "nodes: missing");
	if ((st = parse_nodes(ld, nodes)))
		return st;
	if (ld->src[find_field("gpus_per_node")] == SRC_DEFAULT)
		cfg->gpus_per_node = cfg->rails;
	json_t *gr = json_object_get(root, "gpu_rail");
	if (gr) {
		if ((st = parse_gpu_rail(ld, gr)))
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
		fail(&ld, "(JSON) line %d column %d: %s", jerr.line, jerr.column, jerr.text);
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
	if (st == RW_ERR_PARSE && err && err_len) {
		/* Prefix the file name so the operator knows which file. */
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

/* ---------------------------------------------------------------------------------------------
 * --dump-config
 * ------------------------------------------------------------------------------------------- */

static json_t *ep_json(const rw_svc_endpoint_t *ep)
{
	char buf[32];
	snprintf(buf, sizeof(buf), "%s:%u", ep->text, ep->port);
	return json_string(buf);
}

/* json_object_set_new that records allocation failure instead of leaking. */
static void put(json_t *obj, const char *key, json_t *v, int *oom)
{
	if (!v || json_object_set_new(obj, key, v))
		*oom = 1;
}

char *rw_svc_config_dump(const rw_svc_config_t *cfg)
{
	int oom = 0;
	json_t *root = json_object();
	if (!root)
		return NULL;
	const char *base = (const char *)cfg;
	for (size_t i = 0; i < N_FIELDS; i++) {
		const field_t *f = &fields[i];
		json_t *v = NULL;
		switch (f->kind) {
		case K_NAME:
		case K_SOCK:
		case K_FILE:
		case K_GROUP:
			v = json_string(base + f->off);
			break;
		case K_NODE:
			v = json_string(cfg->nodes[cfg->me].name);
			break;
		case K_U32:
			v = json_integer(*(const uint32_t *)(const void *)(base + f->off));
			break;
		case K_F64:
			v = json_real(*(const double *)(const void *)(base + f->off));
			break;
		case K_TRANSPORT:
			v = json_string(rw_svc_transport_name(cfg->transport));
			break;
		case K_LOGLEVEL:
			v = json_string(log_level_names[cfg->log_level]);
			break;
		case K_FORCEPATH:
			v = json_string(cfg->force_path == RW_SVC_PATH_AUTO ? "auto" :
					rw_sched_path_name((rw_path_t)cfg->force_path));
			break;
		case K_HTTP:
			v = cfg->http_enabled ? ep_json(&cfg->http) : json_string("0");
			break;
		case K_BOOL:
			v = json_boolean(*(const int *)(const void *)(base + f->off));
			break;
		}
		put(root, f->key, v, &oom);
	}
	json_t *gr = json_array();
	for (uint32_t g = 0; gr && g < cfg->gpus_per_node; g++)
		if (json_array_append_new(gr, json_integer(cfg->gpu_rail[g])))
			oom = 1;
	put(root, "gpu_rail", gr, &oom);

	json_t *nodes = json_array();
	put(root, "nodes", nodes, &oom);
	for (uint32_t i = 0; nodes && i < cfg->n_nodes; i++) {
		const rw_svc_node_cfg_t *nd = &cfg->nodes[i];
		json_t *n = json_object();
		if (!n || json_array_append_new(nodes, n)) {
			oom = 1;
			break;
		}
		put(n, "name", json_string(nd->name), &oom);
		if (strcmp(nd->host, nd->name))
			put(n, "host", json_string(nd->host), &oom);
		put(n, "control", ep_json(&nd->control), &oom);
		/* This node's overrides are already folded into the top-level values. */
		if (i != cfg->me) {
			if (nd->ipc_socket[0])
				put(n, "ipc_socket", json_string(nd->ipc_socket), &oom);
			if (nd->stats_socket[0])
				put(n, "stats_socket", json_string(nd->stats_socket[0] == '\x01' ?
								   "" : nd->stats_socket), &oom);
			if (nd->http[0])
				put(n, "http", json_string(nd->http), &oom);
		}
		json_t *rails = json_array();
		put(n, "rails", rails, &oom);
		for (uint32_t r = 0; rails && r < cfg->rails; r++) {
			const rw_svc_rail_cfg_t *rl = &nd->rails[r];
			json_t *ro = json_object();
			if (!ro || json_array_append_new(rails, ro)) {
				oom = 1;
				break;
			}
			if (rl->has_addr) {
				put(ro, "address", json_string(rl->addr.text), &oom);
				put(ro, "port", json_integer(rl->addr.port), &oom);
			}
			if (rl->device[0]) {
				put(ro, "device", json_string(rl->device), &oom);
				put(ro, "device_port", json_integer(rl->device_port), &oom);
			}
			put(ro, "rate_gbps", json_real(rl->rate_gbps), &oom);
		}
	}
	char *out = oom ? NULL : json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
	json_decref(root);
	return out;
}
