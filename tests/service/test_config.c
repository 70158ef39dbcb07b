/* railwaved configuration: every invalid field is rejected with a message naming it; flags beat
 * the environment, which beats node-level fields, which beat the file, which beats defaults;
 * --dump-config output loads back to the same configuration; the embedded default and
 * deploy/clusters/loopback-4x4.json describe the same cluster. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "service/core/svc.h"

/* A 2-node x 2-rail cluster; each case replaces one part. */
#define TOP_DEFAULT ""
#define NODE1_DEFAULT ""
#define RAILS1_DEFAULT "[\"127.0.0.2\", \"127.0.1.2\"]"

static char *make_json(const char *top, const char *node1, const char *rails1)
{
	static char buf[8192];
	snprintf(buf, sizeof(buf),
		 "{%s \"nodes\": ["
		 "{\"name\": \"a\", \"rails\": [\"127.0.0.1\", \"127.0.1.1\"]},"
		 "{\"name\": \"b\" %s, \"rails\": %s}]}",
		 top ? top : TOP_DEFAULT, node1 ? node1 : NODE1_DEFAULT,
		 rails1 ? rails1 : RAILS1_DEFAULT);
	return buf;
}

static const rw_svc_kv_t node0_flag[] = {{"node", "0"}};

typedef struct bad_case {
	const char *top, *node1, *rails1; /* NULL = default part */
	const char *raw;                  /* whole document instead of the parts */
	const char *expect;               /* substring the message must contain */
	rw_status_t status;
} bad_case_t;

static const bad_case_t bad_cases[] = {
	/* top-level scalars */
	{"\"colour\": 1,", 0, 0, 0, "colour: unknown field", RW_ERR_PARSE},
	{"\"cluster\": \"bad name!\",", 0, 0, 0, "cluster: 'bad name!' is not a valid name", RW_ERR_PARSE},
	{"\"cluster\": 7,", 0, 0, 0, "cluster: expected a string", RW_ERR_PARSE},
	{"\"transport\": \"udp\",", 0, 0, 0, "transport: expected \"tcp\", \"shm\" or \"verbs\"", RW_ERR_PARSE},
	{"\"gpus_per_node\": 0,", 0, 0, 0, "gpus_per_node: 0 out of range", RW_ERR_PARSE},
	{"\"gpus_per_node\": 17,", 0, 0, 0, "gpus_per_node: 17 out of range", RW_ERR_PARSE},
	{"\"gpus_per_node\": \"4\",", 0, 0, 0, "gpus_per_node: expected an integer, got a string", RW_ERR_PARSE},
	{"\"gpus_per_node\": 4.5,", 0, 0, 0, "gpus_per_node: expected an integer", RW_ERR_PARSE},
	{"\"control_port\": 70000,", 0, 0, 0, "control_port: 70000 out of range", RW_ERR_PARSE},
	{"\"rail_port\": 0,", 0, 0, 0, "rail_port: 0 out of range", RW_ERR_PARSE},
	{"\"nic_gbps\": -1,", 0, 0, 0, "nic_gbps: -1 out of range", RW_ERR_PARSE},
	{"\"nic_gbps\": \"fast\",", 0, 0, 0, "nic_gbps: expected a number", RW_ERR_PARSE},
	{"\"anchors\": 5,", 0, 0, 0, "anchors: expected a string", RW_ERR_PARSE},
	{"\"ipc_socket\": \"\",", 0, 0, 0, "ipc_socket: must not be empty", RW_ERR_PARSE},
	{"\"ipc_socket\": \"/tmp/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\",",
	 0, 0, 0, "ipc_socket: longer than 107 bytes", RW_ERR_PARSE},
	{0, 0, 0, "{\"stats_socket\": \"/tmp/{node}/{node}\", \"nodes\": [{\"name\": "
	 "\"nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\", \"rails\": [\"127.0.0.1\"]}]}",
	 "stats_socket: '/tmp/nnnn", RW_ERR_PARSE},
	{"\"stats_socket\": 3,", 0, 0, 0, "stats_socket: expected a string", RW_ERR_PARSE},
	{"\"ipc_group\": \"bad group\",", 0, 0, 0, "ipc_group: 'bad group' is not a valid group name", RW_ERR_PARSE},
	{"\"http\": \"localhost:80\",", 0, 0, 0, "http: 'localhost:80' is not an IPv4 ADDR:PORT", RW_ERR_PARSE},
	{"\"http\": \"127.0.0.1\",", 0, 0, 0, "http: '127.0.0.1' is not an IPv4 ADDR:PORT", RW_ERR_PARSE},
	{"\"http\": \"127.0.0.1:99999\",", 0, 0, 0, "http: '127.0.0.1:99999'", RW_ERR_PARSE},
	{"\"http\": true,", 0, 0, 0, "http: expected \"ADDR:PORT\" or 0, got a boolean", RW_ERR_PARSE},
	{"\"phase_timeout_ms\": 0,", 0, 0, 0, "phase_timeout_ms: 0 out of range", RW_ERR_PARSE},
	{"\"heartbeat_interval_ms\": 0,", 0, 0, 0, "heartbeat_interval_ms: 0 out of range", RW_ERR_PARSE},
	{"\"heartbeat_interval_ms\": 2000, \"heartbeat_timeout_ms\": 1000,", 0, 0, 0,
	 "heartbeat_timeout_ms: 1000 must exceed heartbeat_interval_ms (2000)", RW_ERR_PARSE},
	{"\"group_area_mib\": 8, \"group_local_mib\": 8,", 0, 0, 0,
	 "group_local_mib: 8 must be below group_area_mib (8)", RW_ERR_PARSE},
	{"\"group_local_mib\": 65536,", 0, 0, 0, "group_local_mib: 65536 out of range", RW_ERR_PARSE},
	{"\"recv_region_mib\": 0,", 0, 0, 0, "recv_region_mib: 0 out of range", RW_ERR_PARSE},
	{"\"stats_timeout_ms\": -5,", 0, 0, 0, "stats_timeout_ms: -5 out of range", RW_ERR_PARSE},
	{"\"gpu_stall_ms\": 5,", 0, 0, 0, "gpu_stall_ms: 5 out of range", RW_ERR_PARSE},
	{"\"max_tokens\": 2000000,", 0, 0, 0, "max_tokens: 2000000 out of range", RW_ERR_PARSE},
	{"\"ipc_busy_poll_us\": 10001,", 0, 0, 0, "ipc_busy_poll_us: 10001 out of range", RW_ERR_PARSE},
	{"\"poller_sleep_min_us\": 0,", 0, 0, 0, "poller_sleep_min_us: 0 out of range", RW_ERR_PARSE},
	{"\"poller_sleep_min_us\": 500, \"poller_sleep_max_us\": 400, \"poller_busy_sleep_max_us\": 0,",
	 0, 0, 0, "poller_sleep_max_us: 400 is below poller_sleep_min_us (500)", RW_ERR_PARSE},
	{"\"poller_busy_sleep_max_us\": 5,", 0, 0, 0,
	 "poller_busy_sleep_max_us: 5 is outside poller_sleep_min_us .. poller_sleep_max_us (20 .. 1000",
	 RW_ERR_PARSE},
	{"\"poller_busy_sleep_max_us\": 2000,", 0, 0, 0,
	 "poller_busy_sleep_max_us: 2000 is outside", RW_ERR_PARSE},
	{"\"log_level\": \"verbose\",", 0, 0, 0, "log_level: expected one of error, warn, info, debug", RW_ERR_PARSE},
	{"\"path\": \"fastest\",", 0, 0, 0, "path: expected one of auto, native", RW_ERR_PARSE},
	{"\"rail_weights\": \"fast\",", 0, 0, 0, "rail_weights: expected \"config\" or \"measured\"", RW_ERR_PARSE},
	{"\"rail_weights\": 1,", 0, 0, 0, "rail_weights: expected \"config\" or \"measured\"", RW_ERR_PARSE},
	{"\"node\": [1],", 0, 0, 0, "node: expected a node name or index, got an array", RW_ERR_PARSE},
	{"\"pace\": \"yes\",", 0, 0, 0, "pace: expected true or false, got a string", RW_ERR_PARSE},
	{"\"pace\": 1,", 0, 0, 0, "pace: expected true or false, got an integer", RW_ERR_PARSE},
	{"\"pace\": null,", 0, 0, 0, "pace: expected true or false, got null", RW_ERR_PARSE},
	{"\"pace\": true, \"transport\": \"verbs\",", 0, 0, 0,
	 "pace: on, but the verbs transport cannot pace", RW_ERR_PARSE},
	/* gpu_rail */
	{"\"gpu_rail\": [0, 1, 0],", 0, 0, 0, "gpu_rail: 3 entries, but gpus_per_node is 2", RW_ERR_PARSE},
	{"\"gpu_rail\": [0, 5],", 0, 0, 0, "gpu_rail[1]: expected a rail index in [0, 1]", RW_ERR_PARSE},
	{"\"gpu_rail\": \"0,1\",", 0, 0, 0, "gpu_rail: expected an array", RW_ERR_PARSE},
	/* nodes[] */
	{0, 0, 0, "{\"cluster\": \"t\"}", "nodes: missing", RW_ERR_PARSE},
	{0, 0, 0, "{\"nodes\": []}", "nodes: expected a non-empty array", RW_ERR_PARSE},
	{0, 0, 0, "{\"nodes\": {\"a\": 1}}", "nodes: expected a non-empty array", RW_ERR_PARSE},
	{0, 0, 0, "{\"nodes\": [{\"name\": \"a\", \"rails\": [\"127.0.0.1\"]}, 5]}",
	 "nodes[1]: expected an object, got an integer", RW_ERR_PARSE},
	{0, 0, 0, "{\"nodes\": [{\"name\": \"a\", \"rails\": [\"127.0.0.1\"]}, {\"rails\": [\"127.0.0.2\"]}]}",
	 "nodes[1].name: missing", RW_ERR_PARSE},
	{0, 0, 0, "{\"nodes\": [{\"name\": \"a\", \"rails\": [\"127.0.0.1\"]}, {\"name\": \"a b\", \"rails\": [\"127.0.0.2\"]}]}",
	 "nodes[1].name: expected a name", RW_ERR_PARSE},
	{0, 0, 0, "{\"nodes\": [{\"name\": \"a\", \"rails\": [\"127.0.0.1\"]}, {\"name\": \"a\", \"rails\": [\"127.0.0.2\"]}]}",
	 "nodes[1].name: duplicate name 'a' (also nodes[0])", RW_ERR_PARSE},
	{0, 0, 0, "{\"nodes\": [{\"name\": \"a\", \"rails\": [\"127.0.0.1\"]}, {\"name\": \"b\"}]}",
	 "nodes[1].rails: missing", RW_ERR_PARSE},
	{0, 0, "[]", 0, "nodes[1].rails: expected a non-empty array", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\","
	 "\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\","
	 "\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\",\"127.0.0.2\"]", 0,
	 "nodes[1].rails: 17 rails, at most 16 supported", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\"]", 0,
	 "nodes[1].rails: 1 rails, but nodes[0] has 2 (every node needs the same rail count)", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", \"300.0.0.1\"]", 0,
	 "nodes[1].rails[1]: '300.0.0.1' is not an IPv4 address", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", \"127.0.1.2:0\"]", 0,
	 "nodes[1].rails[1]: '127.0.1.2:0' is not an IPv4 address", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {\"address\": \"abc\"}]", 0,
	 "nodes[1].rails[1].address: not an IPv4 address", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {\"address\": \"::1\"}]", 0,
	 "nodes[1].rails[1].address: not an IPv4 address", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {\"address\": \"127.0.1.2\", \"port\": 0}]", 0,
	 "nodes[1].rails[1].port: expected an integer in [1, 65535]", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {\"address\": \"127.0.1.2\", \"device\": \"mlx 5\"}]", 0,
	 "nodes[1].rails[1].device: expected a device name", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {\"address\": \"127.0.1.2\", \"device_port\": 0}]", 0,
	 "nodes[1].rails[1].device_port: expected an integer in [1, 255]", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {\"address\": \"127.0.1.2\", \"rate_gbps\": 0}]", 0,
	 "nodes[1].rails[1].rate_gbps: expected a number", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {\"address\": \"127.0.1.2\", \"speed\": 1}]", 0,
	 "nodes[1].rails[1].speed: unknown field", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {}]", 0, "nodes[1].rails[1]: needs an address", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", 5]", 0,
	 "nodes[1].rails[1]: expected an address string or an object, got an integer", RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", {\"device\": \"mlx5_1\"}]", 0,
	 "nodes[1].rails[1].address: missing (the tcp transport needs an address)", RW_ERR_PARSE},
	{"\"transport\": \"shm\",", 0, "[\"127.0.0.2\", {\"device\": \"mlx5_1\"}]", 0,
	 "nodes[1].rails[1].address: missing (the shm transport needs an address)", RW_ERR_PARSE},
	{0, ", \"control\": \"127.0.0.2\"", "[\"127.0.0.1\", \"127.0.1.2\"]", 0,
	 "nodes[1].rails[0].address: duplicate address 127.0.0.1:7500, also used by nodes[0].rails[0]",
	 RW_ERR_PARSE},
	{0, 0, "[\"127.0.0.2\", \"127.0.0.2:7400\"]", 0,
	 "duplicate address 127.0.0.2:7400", RW_ERR_PARSE},
	{0, ", \"control\": \"127.0.0.1\"", 0, 0,
	 "nodes[1].control: duplicate address 127.0.0.1:7400, also used by nodes[0].control", RW_ERR_PARSE},
	{0, ", \"control\": \"127.0.0.1:abc\"", 0, 0, "nodes[1].control: not an IPv4 address", RW_ERR_PARSE},
	{0, ", \"host\": \"\"", 0, 0, "nodes[1].host: expected a host name", RW_ERR_PARSE},
	{0, ", \"http\": \"x\"", 0, 0, "nodes[1].http: not an IPv4 ADDR:PORT", RW_ERR_PARSE},
	{0, ", \"ipc_socket\": \"\"", 0, 0, "nodes[1].ipc_socket: must not be empty", RW_ERR_PARSE},
	{0, ", \"stats_socket\": 1", 0, 0, "nodes[1].stats_socket: expected a path", RW_ERR_PARSE},
	{0, ", \"colour\": 1", 0, 0, "nodes[1].colour: unknown field", RW_ERR_PARSE},
	{0, 0, 0, "{\"nodes\": [{\"name\": \"a\", \"rails\": [{\"device\": \"mlx5_0\"}]}], \"transport\": \"verbs\"}",
	 "nodes[0].control: missing (rails[0] has no address to default to)", RW_ERR_PARSE},
	/* JSON itself */
	{0, 0, 0, "{\"nodes\": [", "(JSON) line 1", RW_ERR_PARSE},
	{0, 0, 0, "[1, 2]", "(top level): expected a JSON object, got an array", RW_ERR_PARSE},
	{0, 0, 0, "{\"cluster\": \"a\", \"cluster\": \"b\"}", "(JSON)", RW_ERR_PARSE},
	/* identity */
	{"\"node\": 99,", 0, 0, 0, "node: index 99 out of range (the cluster has 2 nodes)", RW_ERR_NOTFOUND},
	{"\"node\": \"nowhere\",", 0, 0, 0, "node: 'nowhere' not found in nodes[]", RW_ERR_NOTFOUND},
};

static void test_bad_fields(void **state)
{
	(void)state;
	for (size_t i = 0; i < RW_ARRAY_SIZE(bad_cases); i++) {
		const bad_case_t *c = &bad_cases[i];
		const char *json = c->raw ? c->raw : make_json(c->top, c->node1, c->rails1);
		/* Cases that set "node" themselves must not get the flag (it would win). */
		int own_node = c->top && strstr(c->top, "\"node\"");
		rw_svc_config_t cfg;
		char err[512];
		rw_status_t st = rw_svc_config_load_text(json, NULL, own_node ? NULL : node0_flag,
							 own_node ? 0 : 1, &cfg, err, sizeof(err));
		if (st != c->status || !strstr(err, c->expect)) {
			print_error("case %zu: status %d (want %d), message \"%s\"\n  want \"%s\"\n", i,
				    st, c->status, err, c->expect);
			fail();
		}
		assert_null(cfg.nodes); /* nothing owned after a failure */
	}
}

static void test_bad_env_and_flags(void **state)
{
	(void)state;
	const char *json = make_json(NULL, NULL, NULL);
	rw_svc_config_t cfg;
	char err[512];
	struct {
		const char *env;
		rw_svc_kv_t flag;
		const char *expect;
	} cases[] = {
		{"RAILWAVE_PHASE_TIMEOUT_MS=abc", {0, 0}, "RAILWAVE_PHASE_TIMEOUT_MS: 'abc' is not a non-negative integer"},
		{"RAILWAVE_PHASE_TIMEOUT_MS=0", {0, 0}, "RAILWAVE_PHASE_TIMEOUT_MS: 0 out of range"},
		{"RAILWAVE_HTTP=bogus", {0, 0}, "RAILWAVE_HTTP: 'bogus' is not an IPv4 ADDR:PORT"},
		{"RAILWAVE_NIC_GBPS=12x", {0, 0}, "RAILWAVE_NIC_GBPS: '12x' is not a number"},
		{"RAILWAVE_TRANSPORT=ib", {0, 0}, "RAILWAVE_TRANSPORT: expected \"tcp\", \"shm\" or \"verbs\""},
		{NULL, {"log_level", "loud"}, "--log-level: expected one of error"},
		{NULL, {"http", "1.2.3.4:"}, "--http: '1.2.3.4:' is not an IPv4 ADDR:PORT"},
		{NULL, {"rail_port", "-3"}, "--rail-port: '-3' is not a non-negative integer"},
		{NULL, {"nodes", "x"}, "--nodes: not a setting that a flag may change"},
		{NULL, {"node", "7"}, "node: index 7 out of range"},
		{"RAILWAVE_PACE=maybe", {0, 0}, "RAILWAVE_PACE: 'maybe' is not on or off"},
		{NULL, {"pace", ""}, "--pace: '' is not on or off"},
		{NULL, {"pace", "ON"}, "--pace: 'ON' is not on or off"},
		{"RAILWAVE_PACE=on", {"transport", "verbs"}, "pace: on, but the verbs transport"},
		/* the daemon and librailwave read one variable; the old name is refused, not ignored */
		{"RAILWAVE_IPC_SOCKET=/tmp/x.sock", {0, 0}, "RAILWAVE_IPC_SOCKET: renamed RAILWAVE_SOCKET"},
	};
	for (size_t i = 0; i < RW_ARRAY_SIZE(cases); i++) {
		char *envp[] = {(char *)cases[i].env, NULL};
		rw_svc_kv_t flags[2] = {{"node", "0"}, cases[i].flag};
		size_t n = cases[i].flag.key ? 2 : 1;
		rw_status_t st = rw_svc_config_load_text(json, cases[i].env ? envp : NULL, flags, n,
							 &cfg, err, sizeof(err));
		if (st == RW_OK || !strstr(err, cases[i].expect)) {
			print_error("case %zu: status %d, message \"%s\"\n  want \"%s\"\n", i, st, err,
				    cases[i].expect);
			fail();
		}
	}
}

static void test_embedded_default(void **state)
{
	(void)state;
	for (uint32_t n = 0; n < 4; n++) {
		char idx[8], name[16];
		snprintf(idx, sizeof(idx), "%u", n);
		snprintf(name, sizeof(name), "node%u", n);
		for (int by_name = 0; by_name < 2; by_name++) {
			rw_svc_kv_t flag = {"node", by_name ? name : idx};
			rw_svc_config_t cfg;
			char err[256];
			assert_int_equal(rw_svc_config_load(NULL, NULL, &flag, 1, &cfg, err, sizeof(err)),
					 RW_OK);
			assert_int_equal(cfg.n_nodes, 4);
			assert_int_equal(cfg.rails, 4);
			assert_int_equal(cfg.gpus_per_node, 4);
			assert_int_equal(cfg.me, n);
			assert_int_equal(cfg.transport, RW_SVC_TRANSPORT_TCP);
			assert_int_equal(cfg.force_path, RW_SVC_PATH_AUTO);
			for (uint32_t i = 0; i < 4; i++)
				for (uint32_t r = 0; r < 4; r++) {
					char want[16];
					snprintf(want, sizeof(want), "127.0.%u.%u", r, i + 1);
					assert_string_equal(cfg.nodes[i].rails[r].addr.text, want);
					assert_int_equal(cfg.nodes[i].rails[r].addr.port, 7500);
					assert_int_equal(ntohs(cfg.nodes[i].rails[r].addr.sin.sin_port), 7500);
					assert_true(cfg.nodes[i].rails[r].rate_gbps == 100.0);
				}
			for (uint32_t g = 0; g < 4; g++)
				assert_int_equal(cfg.gpu_rail[g], g);
			char want[64];
			snprintf(want, sizeof(want), "/run/railwave/node%u.stats", n);
			assert_string_equal(cfg.stats_socket, want);
			snprintf(want, sizeof(want), "/run/railwave/node%u.sock", n);
			assert_string_equal(cfg.ipc_socket, want);
			snprintf(want, sizeof(want), "127.0.0.%u", n + 1);
			assert_true(cfg.http_enabled);
			assert_string_equal(cfg.http.text, want); /* node-level http override */
			assert_int_equal(cfg.http.port, 9470);
			assert_string_equal(cfg.nodes[n].control.text, want);
			assert_int_equal(cfg.nodes[n].control.port, 7400);
			rw_svc_config_free(&cfg);
		}
	}
}

static char *read_text(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	static char buf[65536];
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = '\0';
	fclose(f);
	return buf;
}

/* Load text for `node`, dump, reload the dump, dump again: both dumps equal; returns dump 1. */
static char *round_trip(const char *json, char *const *envp, const rw_svc_kv_t *flags,
			size_t n_flags)
{
	rw_svc_config_t a, b;
	char err[512];
	assert_int_equal(rw_svc_config_load_text(json, envp, flags, n_flags, &a, err, sizeof(err)),
			 RW_OK);
	char *d1 = rw_svc_config_dump(&a);
	assert_non_null(d1);
	/* The dump carries the node, so it loads without flags or environment. */
	if (rw_svc_config_load_text(d1, NULL, NULL, 0, &b, err, sizeof(err)) != RW_OK) {
		print_error("reloading the dump failed: %s\n%s\n", err, d1);
		fail();
	}
	char *d2 = rw_svc_config_dump(&b);
	assert_non_null(d2);
	assert_string_equal(d1, d2);
	/* And the structures agree field by field where it matters. */
	assert_int_equal(a.me, b.me);
	assert_int_equal(a.n_nodes, b.n_nodes);
	assert_int_equal(a.rails, b.rails);
	assert_memory_equal(a.gpu_rail, b.gpu_rail, sizeof(a.gpu_rail));
	assert_string_equal(a.stats_socket, b.stats_socket);
	assert_string_equal(a.ipc_socket, b.ipc_socket);
	assert_int_equal(a.http_enabled, b.http_enabled);
	assert_int_equal(a.http.port, b.http.port);
	assert_int_equal(a.force_path, b.force_path);
	assert_int_equal(a.pace, b.pace);
	assert_int_equal(a.rail_weights_measured, b.rail_weights_measured);
	for (uint32_t i = 0; i < a.n_nodes; i++)
		for (uint32_t r = 0; r < a.rails; r++) {
			assert_string_equal(a.nodes[i].rails[r].addr.text, b.nodes[i].rails[r].addr.text);
			assert_int_equal(a.nodes[i].rails[r].addr.port, b.nodes[i].rails[r].addr.port);
			assert_string_equal(a.nodes[i].rails[r].device, b.nodes[i].rails[r].device);
			assert_true(a.nodes[i].rails[r].rate_gbps == b.nodes[i].rails[r].rate_gbps);
		}
	free(d2);
	rw_svc_config_free(&a);
	rw_svc_config_free(&b);
	return d1;
}

static void test_dump_round_trip(void **state)
{
	(void)state;
	free(round_trip(rw_svc_default_config_json, NULL, node0_flag, 1));
	rw_svc_kv_t n2 = {"node", "node2"};
	free(round_trip(rw_svc_default_config_json, NULL, &n2, 1));

	/* Everything non-default at once, plus overrides from env and flags. */
	const char *json =
		"{\"cluster\": \"big-1\", \"transport\": \"verbs\", \"gpus_per_node\": 8,"
		" \"gpu_rail\": [0, 0, 1, 1, 0, 0, 1, 1], \"nic_gbps\": 400, \"control_port\": 9000,"
		" \"rail_port\": 9100, \"anchors\": \"/etc/railwave/anchors.json\","
		" \"ipc_group\": \"trainers\", \"stats_socket\": \"\", \"http\": 0,"
		" \"phase_timeout_ms\": 1234, \"heartbeat_interval_ms\": 100,"
		" \"heartbeat_timeout_ms\": 900, \"recv_region_mib\": 512, \"stats_timeout_ms\": 77,"
		" \"log_level\": \"debug\", \"path\": \"rail-only\", \"_comment\": \"ignored\","
		" \"nodes\": ["
		"  {\"name\": \"gpu-a\", \"host\": \"gpu-a.example\", \"control\": \"10.0.0.1:9001\","
		"   \"rails\": [{\"address\": \"10.1.0.1\", \"device\": \"mlx5_0\", \"rate_gbps\": 200},"
		"             {\"address\": \"10.1.1.1\", \"port\": 9200, \"device\": \"mlx5_1\", \"device_port\": 2}]},"
		"  {\"name\": \"gpu-b\", \"stats_socket\": \"/run/b/{node}.stats\", \"http\": \"10.0.0.2:9999\","
		"   \"rails\": [\"10.1.0.2\", \"10.1.1.2:9300\"]}]}";
	char *env[] = {"RAILWAVE_PHASE_TIMEOUT_MS=4321", "RAILWAVE_NODE=gpu-b", NULL};
	rw_svc_kv_t flags[] = {{"log_level", "warn"}};
	char *dump = round_trip(json, env, flags, 1);
	/* Spot checks on what the dump says. */
	assert_non_null(strstr(dump, "\"phase_timeout_ms\": 4321"));
	assert_non_null(strstr(dump, "\"log_level\": \"warn\""));
	assert_non_null(strstr(dump, "\"node\": \"gpu-b\""));
	assert_non_null(strstr(dump, "\"stats_socket\": \"/run/b/gpu-b.stats\""));
	assert_non_null(strstr(dump, "\"http\": \"10.0.0.2:9999\""));
	assert_non_null(strstr(dump, "\"path\": \"rail-only\""));
	assert_non_null(strstr(dump, "\"device_port\": 2"));
	assert_non_null(strstr(dump, "\"pace\": false"));
	free(dump);
	dump = round_trip(make_json("\"pace\": true,", NULL, NULL), NULL, node0_flag, 1);
	assert_non_null(strstr(dump, "\"pace\": true"));
	assert_non_null(strstr(dump, "\"rail_weights\": \"config\""));
	free(dump);
	dump = round_trip(make_json("\"rail_weights\": \"measured\",", NULL, NULL), NULL, node0_flag, 1);
	assert_non_null(strstr(dump, "\"rail_weights\": \"measured\""));
	free(dump);
}

/* pace: off by default; file < environment < flag; the text forms of on and off. */
static void test_pace(void **state)
{
	(void)state;
	rw_svc_config_t cfg;
	char err[256];
	char json[2048]; /* make_json's buffer is reused */
	snprintf(json, sizeof(json), "%.2000s", make_json("\"pace\": true,", NULL, NULL));
	assert_int_equal(rw_svc_config_load_text(make_json(NULL, NULL, NULL), NULL, node0_flag, 1,
						 &cfg, err, sizeof(err)), RW_OK);
	assert_false(cfg.pace);
	rw_svc_config_free(&cfg);
	assert_int_equal(rw_svc_config_load_text(json, NULL, node0_flag, 1, &cfg, err, sizeof(err)),
			 RW_OK);
	assert_true(cfg.pace);
	rw_svc_config_free(&cfg);
	static const struct {
		const char *text;
		int on;
	} forms[] = {{"on", 1}, {"true", 1}, {"yes", 1}, {"1", 1},
		     {"off", 0}, {"false", 0}, {"no", 0}, {"0", 0}};
	for (size_t i = 0; i < RW_ARRAY_SIZE(forms); i++) {
		char var[64];
		snprintf(var, sizeof(var), "RAILWAVE_PACE=%s", forms[i].text);
		char *env[] = {var, NULL};
		/* The environment beats the file (which says true) ... */
		assert_int_equal(rw_svc_config_load_text(json, env, node0_flag, 1, &cfg, err,
							 sizeof(err)), RW_OK);
		assert_int_equal(cfg.pace, forms[i].on);
		rw_svc_config_free(&cfg);
		/* ... and a flag beats the environment. */
		rw_svc_kv_t flags[] = {{"node", "0"}, {"pace", forms[i].on ? "off" : "on"}};
		assert_int_equal(rw_svc_config_load_text(json, env, flags, 2, &cfg, err, sizeof(err)),
				 RW_OK);
		assert_int_equal(cfg.pace, !forms[i].on);
		rw_svc_config_free(&cfg);
	}
	/* shm paces too (each rail at its rate_gbps, here 25 GB/s = 200 Gbit/s on rail 1). */
	snprintf(json, sizeof(json), "%.2000s", make_json("\"pace\": true, \"transport\": \"shm\",",
							   NULL, "[\"127.0.0.2\", {\"address\": "
							   "\"127.0.1.2\", \"rate_gbps\": 200}]"));
	assert_int_equal(rw_svc_config_load_text(json, NULL, node0_flag, 1, &cfg, err, sizeof(err)),
			 RW_OK);
	assert_true(cfg.pace);
	assert_int_equal(cfg.transport, RW_SVC_TRANSPORT_SHM);
	assert_string_equal(rw_svc_transport_name(cfg.transport), "shm");
	assert_true(cfg.nodes[1].rails[1].rate_gbps == 200.0);
	rw_svc_config_free(&cfg);
}

static void test_precedence(void **state)
{
	(void)state;
	char json[2048]; /* make_json's buffer is reused below */
	snprintf(json, sizeof(json), "%.2000s",
		 make_json("\"phase_timeout_ms\": 111, \"http\": \"127.0.0.1:1000\","
			   " \"stats_socket\": \"/tmp/file-{node}\",",
			   ", \"http\": \"127.0.0.9:2000\", \"stats_socket\": \"/tmp/node-level\"",
			   NULL));
	rw_svc_config_t cfg;
	char err[256];
	rw_svc_kv_t n1 = {"node", "b"};

	/* defaults < file */
	assert_int_equal(rw_svc_config_load_text(make_json(NULL, NULL, NULL), NULL, &n1, 1, &cfg,
						 err, sizeof(err)), RW_OK);
	assert_int_equal(cfg.phase_timeout_ms, 10000);
	assert_int_equal(cfg.gpu_stall_ms, 5000);
	rw_svc_config_free(&cfg);
	assert_int_equal(rw_svc_config_load_text(json, NULL, &n1, 1, &cfg, err, sizeof(err)), RW_OK);
	assert_int_equal(cfg.phase_timeout_ms, 111);
	/* node-level beats the file's cluster-wide value */
	assert_string_equal(cfg.http.text, "127.0.0.9");
	assert_int_equal(cfg.http.port, 2000);
	assert_string_equal(cfg.stats_socket, "/tmp/node-level");
	rw_svc_config_free(&cfg);
	/* node a has no node-level value: the file's, expanded */
	rw_svc_kv_t n0 = {"node", "a"};
	assert_int_equal(rw_svc_config_load_text(json, NULL, &n0, 1, &cfg, err, sizeof(err)), RW_OK);
	assert_string_equal(cfg.stats_socket, "/tmp/file-a");
	assert_int_equal(cfg.http.port, 1000);
	rw_svc_config_free(&cfg);

	/* environment beats file and node-level */
	char *env[] = {"RAILWAVE_PHASE_TIMEOUT_MS=222", "RAILWAVE_HTTP=0",
		       "RAILWAVE_STATS_SOCKET=/tmp/env-{node}", "RAILWAVE_NODE=a", "UNRELATED=1",
		       "RAILWAVE_SOCKET=/tmp/env-{node}.sock", NULL};
	assert_int_equal(rw_svc_config_load_text(json, env, NULL, 0, &cfg, err, sizeof(err)), RW_OK);
	assert_int_equal(cfg.me, 0); /* RAILWAVE_NODE */
	assert_int_equal(cfg.phase_timeout_ms, 222);
	assert_false(cfg.http_enabled);
	assert_string_equal(cfg.stats_socket, "/tmp/env-a");
	assert_string_equal(cfg.ipc_socket, "/tmp/env-a.sock");
	rw_svc_config_free(&cfg);

	/* flags beat the environment */
	rw_svc_kv_t flags[] = {{"node", "b"}, {"phase_timeout_ms", "333"},
			       {"http", "127.0.0.3:0"}, {"stats_socket", ""}};
	assert_int_equal(rw_svc_config_load_text(json, env, flags, RW_ARRAY_SIZE(flags), &cfg, err,
						 sizeof(err)), RW_OK);
	assert_int_equal(cfg.me, 1);
	assert_int_equal(cfg.phase_timeout_ms, 333);
	assert_true(cfg.http_enabled);
	assert_string_equal(cfg.http.text, "127.0.0.3");
	assert_int_equal(cfg.http.port, 0);
	assert_string_equal(cfg.stats_socket, "");
	rw_svc_config_free(&cfg);

	/* A flag changing a default that nodes[] inherits (rail_port) applies to nodes[] too. */
	rw_svc_kv_t rp[] = {{"node", "0"}, {"rail_port", "8123"}};
	assert_int_equal(rw_svc_config_load_text(make_json("\"rail_port\": 8000,", NULL, NULL), NULL,
						 rp, 2, &cfg, err, sizeof(err)), RW_OK);
	assert_int_equal(cfg.nodes[1].rails[0].addr.port, 8123);
	rw_svc_config_free(&cfg);
}

static void test_identity_by_hostname(void **state)
{
	(void)state;
	char host[256] = "";
	assert_int_equal(gethostname(host, sizeof(host) - 1), 0);
	char node1[400];
	rw_svc_config_t cfg;
	char err[512];

	snprintf(node1, sizeof(node1), ", \"host\": \"%s\"", host);
	assert_int_equal(rw_svc_config_load_text(make_json(NULL, node1, NULL), NULL, NULL, 0, &cfg, err, sizeof(err)), RW_OK);
	assert_int_equal(cfg.me, 1);
	rw_svc_config_free(&cfg);

	/* No host matches. */
	assert_int_equal(rw_svc_config_load_text(make_json(NULL, ", \"host\": \"no-such-host.invalid\"",
							   NULL), NULL, NULL, 0, &cfg, err,
						 sizeof(err)), RW_ERR_NOTFOUND);
	assert_non_null(strstr(err, "matches no nodes[].host; pass --node"));

	/* Two nodes on this host: ambiguous, the operator must say which. */
	char two[1024];
	snprintf(two, sizeof(two),
		 "{\"nodes\": [{\"name\": \"a\", \"host\": \"%s\", \"rails\": [\"127.0.0.1\"]},"
		 "{\"name\": \"b\", \"host\": \"%s\", \"rails\": [\"127.0.0.2\"]}]}", host, host);
	assert_int_equal(rw_svc_config_load_text(two, NULL, NULL, 0, &cfg, err, sizeof(err)),
			 RW_ERR_PARSE);
	assert_non_null(strstr(err, "matches nodes[0] and nodes[1]; pass --node"));
	rw_svc_kv_t flag = {"node", "b"};
	assert_int_equal(rw_svc_config_load_text(two, NULL, &flag, 1, &cfg, err, sizeof(err)), RW_OK);
	assert_int_equal(cfg.me, 1);
	rw_svc_config_free(&cfg);

	/* A name that looks like an index is matched as a name first. */
	const char *digits = "{\"nodes\": [{\"name\": \"1\", \"rails\": [\"127.0.0.1\"]},"
			     "{\"name\": \"0\", \"rails\": [\"127.0.0.2\"]},"
			     "{\"name\": \"x\", \"rails\": [\"127.0.0.3\"]}]}";
	rw_svc_kv_t by_name = {"node", "1"}, by_index = {"node", "2"};
	assert_int_equal(rw_svc_config_load_text(digits, NULL, &by_name, 1, &cfg, err, sizeof(err)),
			 RW_OK);
	assert_int_equal(cfg.me, 0);
	rw_svc_config_free(&cfg);
	assert_int_equal(rw_svc_config_load_text(digits, NULL, &by_index, 1, &cfg, err, sizeof(err)),
			 RW_OK);
	assert_int_equal(cfg.me, 2);
	rw_svc_config_free(&cfg);
}

static void test_files(void **state)
{
	(void)state;
	rw_svc_config_t cfg;
	char err[512];
	/* The shipped loopback example is the embedded default. */
	const char *path = "deploy/clusters/loopback-4x4.json";
	char *text = read_text(path);
	if (!text) {
		print_error("%s not found: run the tests from the repository root\n", path);
		fail();
	}
	char *d_file = NULL, *d_embedded = NULL;
	assert_int_equal(rw_svc_config_load(path, NULL, node0_flag, 1, &cfg, err, sizeof(err)),
			 RW_OK);
	d_file = rw_svc_config_dump(&cfg);
	rw_svc_config_free(&cfg);
	assert_int_equal(rw_svc_config_load(NULL, NULL, node0_flag, 1, &cfg, err, sizeof(err)),
			 RW_OK);
	d_embedded = rw_svc_config_dump(&cfg);
	rw_svc_config_free(&cfg);
	assert_string_equal(d_file, d_embedded);
	free(d_file);
	free(d_embedded);

	/* Every shipped example loads (with some node picked); all but the embedded default turn
	 * the rank path on, their carve-out sized by `railwave size` (a pool of at least one, the
	 * local area apart). */
	const char *examples[] = {"deploy/clusters/loopback-4x4.json",
				  "deploy/clusters/loopback-2x2-one-ip.json",
				  "deploy/clusters/example-verbs-8x8.json",
				  "deploy/clusters/shm-2x2.json", "deploy/clusters/shm-4x4.json"};
	for (size_t i = 0; i < RW_ARRAY_SIZE(examples); i++) {
		if (rw_svc_config_load(examples[i], NULL, node0_flag, 1, &cfg, err, sizeof(err))) {
			print_error("%s: %s\n", examples[i], err);
			fail();
		}
		if (i > 0 && (!cfg.group_area_mib || cfg.group_pool_mib < cfg.group_area_mib ||
			      !cfg.group_local_mib)) {
			print_error("%s: group_area_mib %u, group_local_mib %u, group_pool_mib %u: the "
				    "rank path is off, or its local area not sized\n", examples[i],
				    cfg.group_area_mib, cfg.group_local_mib, cfg.group_pool_mib);
			fail();
		}
		rw_svc_config_free(&cfg);
	}

	/* RAILWAVE_CONFIG names the file when no path is given. */
	char *env[] = {"RAILWAVE_CONFIG=deploy/clusters/loopback-2x2-one-ip.json", NULL};
	assert_int_equal(rw_svc_config_load(NULL, env, node0_flag, 1, &cfg, err, sizeof(err)), RW_OK);
	assert_int_equal(cfg.n_nodes, 2);
	rw_svc_config_free(&cfg);

	/* Missing file, and a parse error prefixed with the file name. */
	assert_int_equal(rw_svc_config_load("/nonexistent/railwave.json", NULL, NULL, 0, &cfg, err,
					    sizeof(err)), RW_ERR_NOTFOUND);
	assert_non_null(strstr(err, "/nonexistent/railwave.json"));
	char tmp[] = "/tmp/rw_cfg_XXXXXX";
	int fd = mkstemp(tmp);
	assert_true(fd >= 0);
	const char *bad = "{\"nodes\": [{\"name\": \"a\", \"rails\": [\"1.2.3\"]}]}";
	assert_int_equal(write(fd, bad, strlen(bad)), (ssize_t)strlen(bad));
	close(fd);
	assert_int_equal(rw_svc_config_load(tmp, NULL, node0_flag, 1, &cfg, err, sizeof(err)),
			 RW_ERR_PARSE);
	assert_non_null(strstr(err, tmp));
	assert_non_null(strstr(err, "nodes[0].rails[0]: '1.2.3' is not an IPv4 address"));
	unlink(tmp);

	/* A bad flag or variable is named on its own, not as an error of the file. */
	rw_svc_kv_t bad_flag[] = {{"node", "0"}, {"phase_timeout_ms", "abc"}};
	assert_int_equal(rw_svc_config_load("deploy/clusters/loopback-4x4.json", NULL, bad_flag, 2,
					    &cfg, err, sizeof(err)), RW_ERR_PARSE);
	assert_string_equal(err, "--phase-timeout-ms: 'abc' is not a non-negative integer");
	char *bad_env[] = {"RAILWAVE_HTTP=x", NULL};
	assert_int_equal(rw_svc_config_load("deploy/clusters/loopback-4x4.json", bad_env, node0_flag,
					    1, &cfg, err, sizeof(err)), RW_ERR_PARSE);
	assert_string_equal(err, "RAILWAVE_HTTP: 'x' is not an IPv4 ADDR:PORT (or 0 = off)");
}

static void test_topo(void **state)
{
	(void)state;
	const char *json = make_json("\"gpus_per_node\": 4, \"nic_gbps\": 100,", NULL,
				     "[\"127.0.0.2\", {\"address\": \"127.0.1.2\", \"rate_gbps\": 25}]");
	rw_svc_config_t cfg;
	char err[256];
	assert_int_equal(rw_svc_config_load_text(json, NULL, node0_flag, 1, &cfg, err, sizeof(err)),
			 RW_OK);
	rw_topo_t topo;
	rw_svc_config_topo(&cfg, &topo);
	assert_int_equal(topo.nodes, 2);
	assert_int_equal(topo.rails, 2);
	assert_int_equal(topo.gpus_per_node, 4);
	assert_int_equal(topo.gpu_rail[0], 0);
	assert_int_equal(topo.gpu_rail[3], 1); /* default g % R */
	assert_int_equal(topo.rail_weight[0], 100);
	assert_int_equal(topo.rail_weight[1], 25); /* the slowest node's NIC on rail 1 */
	rw_svc_config_free(&cfg);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_bad_fields),
		cmocka_unit_test(test_bad_env_and_flags),
		cmocka_unit_test(test_embedded_default),
		cmocka_unit_test(test_dump_round_trip),
		cmocka_unit_test(test_pace),
		cmocka_unit_test(test_precedence),
		cmocka_unit_test(test_identity_by_hostname),
		cmocka_unit_test(test_files),
		cmocka_unit_test(test_topo),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
