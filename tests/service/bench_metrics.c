/* Cost of railwaved's metrics on the loop thread and on the scrape path, against baselines
 * measured in the same run: a rail update vs a bare counter add, a phase (histogram) update vs
 * the same, a publish vs a plain memcpy of the same bytes, and the Prometheus render / stats
 * replies for a large cluster. Usage: $b/bench/svc_metrics [nodes] (default 1024). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "service/core/svc.h"

static volatile uint64_t sink;

static double per_op_ns(uint64_t t0, uint64_t t1, uint64_t n) { return (double)(t1 - t0) / (double)n; }

int main(int argc, char **argv)
{
	uint32_t nodes = argc > 1 ? (uint32_t)atoi(argv[1]) : 1024;
	if (nodes < 2 || nodes > RW_MAX_NODES) {
		fprintf(stderr, "nodes must be in [2, %d]\n", RW_MAX_NODES);
		return 2;
	}
	const uint32_t rails = 8;
	const uint64_t n = 50u * 1000 * 1000;

	/* A cluster description of that size, as JSON. */
	size_t cap = (size_t)nodes * 256 + 256, len = 0;
	char *json = malloc(cap);
	len += (size_t)snprintf(json + len, cap - len, "{\"gpus_per_node\": 8, \"nodes\": [");
	for (uint32_t i = 0; i < nodes; i++) {
		len += (size_t)snprintf(json + len, cap - len, "%s{\"name\": \"n%u\", \"rails\": [", i ? "," : "", i);
		for (uint32_t r = 0; r < rails; r++)
			len += (size_t)snprintf(json + len, cap - len, "%s\"10.%u.%u.%u\"", r ? "," : "", r,
						(i + 1) >> 8, (i + 1) & 255);
		len += (size_t)snprintf(json + len, cap - len, "]}");
	}
	snprintf(json + len, cap - len, "]}");

	rw_svc_t svc;
	memset(&svc, 0, sizeof(svc));
	rw_svc_kv_t flag = {"node", "0"};
	char err[256];
	uint64_t t0 = rw_now_ns();
	if (rw_svc_config_load_text(json, NULL, &flag, 1, &svc.cfg, err, sizeof(err))) {
		fprintf(stderr, "config: %s\n", err);
		return 1;
	}
	uint64_t t1 = rw_now_ns();
	printf("config load, %u nodes x %u rails: %.2f ms\n", nodes, rails, (double)(t1 - t0) / 1e6);
	rw_svc_metrics_init(&svc.metrics, rails, nodes);
	rw_svc_metrics_pub_init(&svc.pub, rails, nodes);

	/* Loop-thread updates. */
	uint64_t bare[RW_MAX_RAILS] = {0};
	t0 = rw_now_ns();
	for (uint64_t i = 0; i < n; i++) {
		bare[i & 7] += i;
		__asm__ volatile("" ::: "memory");
	}
	t1 = rw_now_ns();
	double base = per_op_ns(t0, t1, n);
	sink = bare[3];
	t0 = rw_now_ns();
	for (uint64_t i = 0; i < n; i++) {
		rw_svc_metrics_tx(&svc.metrics, (uint32_t)(i & 7), i, 1, 100);
		__asm__ volatile("" ::: "memory");
	}
	t1 = rw_now_ns();
	double tx = per_op_ns(t0, t1, n);
	t0 = rw_now_ns();
	for (uint64_t i = 0; i < n; i++) {
		rw_svc_metrics_phase(&svc.metrics, (rw_path_t)(i & 3), RW_SVC_DISPATCH, 1, 1000 + (i & 0xfffff) * 997);
		__asm__ volatile("" ::: "memory");
	}
	t1 = rw_now_ns();
	double ph = per_op_ns(t0, t1, n);
	printf("counter add (baseline)          %6.2f ns\n", base);
	printf("rw_svc_metrics_tx (4 counters)  %6.2f ns  %.1fx baseline\n", tx, tx / base);
	printf("rw_svc_metrics_phase (hist)     %6.2f ns  %.1fx baseline\n", ph, ph / base);

	/* Publish vs a bare memcpy of the same bytes. */
	size_t bytes = sizeof(rw_svc_metrics_t) + (size_t)nodes * sizeof(rw_svc_peer_metrics_t);
	char *a = malloc(bytes), *b = malloc(bytes);
	memset(a, 1, bytes);
	const int reps = 2000;
	t0 = rw_now_ns();
	for (int i = 0; i < reps; i++) {
		memcpy(b, a, bytes);
		__asm__ volatile("" ::: "memory");
	}
	t1 = rw_now_ns();
	double cp = per_op_ns(t0, t1, reps);
	t0 = rw_now_ns();
	for (int i = 0; i < reps; i++)
		rw_svc_metrics_publish(&svc.pub, &svc.metrics);
	t1 = rw_now_ns();
	double pub = per_op_ns(t0, t1, reps);
	printf("memcpy %zu bytes (baseline)   %8.0f ns\n", bytes, cp);
	printf("rw_svc_metrics_publish          %8.0f ns  %.2fx baseline; every %d ms = %.4f%% of a core\n",
	       pub, pub / cp, RW_SVC_METRICS_PUBLISH_MS, pub / (RW_SVC_METRICS_PUBLISH_MS * 1e6) * 100);

	/* Scrape and stats replies. */
	rw_svc_metrics_t snap;
	rw_svc_metrics_init(&snap, rails, nodes);
	t0 = rw_now_ns();
	rw_svc_buf_t out = {0};
	for (int i = 0; i < 20; i++) {
		out.len = 0;
		rw_svc_metrics_read(&svc.pub, &snap);
		rw_svc_metrics_prometheus(&svc.cfg, &snap, &out);
	}
	t1 = rw_now_ns();
	printf("GET /metrics render (%zu bytes)  %.3f ms\n", out.len, (double)(t1 - t0) / 20 / 1e6);
	const char *cmds[] = {"stats", "stats rails", "stats peers", "stats phases", "stats selector"};
	for (size_t c = 0; c < RW_ARRAY_SIZE(cmds); c++) {
		t0 = rw_now_ns();
		for (int i = 0; i < 20; i++) {
			out.len = 0;
			rw_svc_stats_answer(&svc, cmds[c], &out);
		}
		t1 = rw_now_ns();
		printf("%-15s reply (%7zu bytes) %.3f ms on the loop\n", cmds[c], out.len,
		       (double)(t1 - t0) / 20 / 1e6);
	}
	rw_svc_buf_free(&out);
	rw_svc_metrics_fini(&snap);
	free(a);
	free(b);
	free(json);
	rw_svc_metrics_pub_fini(&svc.pub);
	rw_svc_metrics_fini(&svc.metrics);
	rw_svc_config_free(&svc.cfg);
	return 0;
}
