/* sched_bench: what one node spends per phase on the decision (features, selection,
 * RailBalance plans) at N up to 128, R = G = 8, on one core. A benchmark, not a test: it prints
 * medians in microseconds, and the one-shot feature pass as a ratio to a bare read of the same
 * count matrix measured in the same run. docs/perf/sched-decision.md records the numbers, the
 * command and what each column is.
 * Built with -DSCHED_BENCH_OLD it uses only the API that existed before the row accumulator, so
 * the same program measures an older sched/ for a before/after comparison. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "sched/sched.h"

/* ---- timing: median of batches, each long enough for the clock ---- */

typedef void (*bench_fn_t)(void *arg);

static double min_time = 0.2;
static int use_min; /* --stat min: the fastest batch, the lower envelope on a busy machine */

/* Median (or least) nanoseconds per call of fn(arg). */
static double time_ns(bench_fn_t fn, void *arg)
{
	enum { MAX_REPS = 2001 };
	static double per_call[MAX_REPS];
	uint64_t t0 = rw_now_ns();
	fn(arg);
	uint64_t one = rw_now_ns() - t0;
	uint64_t batch = one >= 20000 ? 1 : 20000 / (one ? one : 1) + 1;
	unsigned reps = 0;
	uint64_t start = rw_now_ns();
	while (reps < MAX_REPS && (reps < 11 || (double)(rw_now_ns() - start) < min_time * 1e9)) {
		uint64_t a = rw_now_ns();
		for (uint64_t i = 0; i < batch; i++)
			fn(arg);
		per_call[reps++] = (double)(rw_now_ns() - a) / (double)batch;
	}
	qsort(per_call, reps, sizeof(double), rw_cmp_double);
	return use_min ? per_call[0] : per_call[reps / 2];
}

/* ---- workload ---- */

static uint64_t rng_state;

static uint64_t rng_next(void) /* splitmix64 */
{
	uint64_t z = (rng_state += UINT64_C(0x9e3779b97f4a7c15));
	z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
	return z ^ (z >> 31);
}

static uint32_t rng_below(uint32_t n) { return n ? (uint32_t)(rng_next() % n) : 0; }

/* A phase of the issue-2 shape: 4096 tokens per rank, top-8 over N nodes gives about
 * 8 * 4096 * G * (distinct remote nodes per token) / N records per pair; rails skewed (each
 * node's GPUs carry a random share), a fraction of pairs empty when `sparse` > 0. */
static void make_counts(uint32_t *counts, uint32_t nodes, uint32_t rails, uint32_t sparse_pct)
{
	const uint32_t per_pair = (uint32_t)(8ull * 4096 * 8 * 6 / (8 * nodes) + 1);
	for (uint32_t s = 0; s < nodes; s++) {
		uint32_t share[RW_MAX_RAILS], sum = 0;
		for (uint32_t r = 0; r < rails; r++)
			sum += share[r] = 1 + rng_below(100);
		for (uint32_t d = 0; d < nodes; d++) {
			uint32_t *c = counts + ((size_t)s * nodes + d) * rails;
			int empty = rng_below(100) < sparse_pct;
			uint32_t t = empty ? 0 : per_pair / 2 + rng_below(per_pair);
			for (uint32_t r = 0; r < rails; r++)
				c[r] = empty ? 0 : (uint32_t)((uint64_t)t * share[r] / sum) + rng_below(3);
		}
	}
}

typedef struct ctx {
	rw_topo_t topo;
	uint32_t *counts;
	uint32_t me;
	rw_anchor_table_t table;
	rw_anchor_t anchors[36];
	rw_features_t feat;
	rw_selection_t sel;
	rw_pair_plan_t *pairs, *recv;
	rw_phase_plan_t plan;
#ifndef SCHED_BENCH_OLD
	rw_sched_feat_acc_t acc;
	void *ws;
#endif
	volatile uint64_t sink;
} ctx_t;

/* The floor of any one-shot feature pass: read the N x N x R matrix once. */
static void run_read(void *arg)
{
	ctx_t *c = arg;
	const size_t n = (size_t)c->topo.nodes * c->topo.nodes * c->topo.rails / 2;
	uint64_t a = 0, b = 0, x = 0, y = 0, w[4];
	for (size_t i = 0; i + 4 <= n; i += 4) { /* 64-bit words, four chains */
		memcpy(w, c->counts + 2 * i, sizeof(w));
		a += w[0];
		b += w[1];
		x += w[2];
		y += w[3];
	}
	c->sink += a + b + x + y;
}

static void run_features(void *arg)
{
	ctx_t *c = arg;
	rw_sched_features(&c->topo, c->counts, 8192, &c->feat);
	c->sink += c->feat.max_fan_in;
}

static void run_select(void *arg)
{
	ctx_t *c = arg;
	rw_sched_select(&c->table, &c->feat, &c->sel);
	c->sink += (uint64_t)c->sel.path;
}

/* The plan runs take the next node each call: a different row every time, as every phase has
 * new counts (repeating one row would let the branch predictor learn its pairs). */
static uint32_t next_me(ctx_t *c)
{
	c->me = c->me + 1 == c->topo.nodes ? 0 : c->me + 1;
	return c->me;
}

static void run_plan_joint(void *arg)
{
	ctx_t *c = arg;
	next_me(c);
	rw_sched_plan_build(&c->topo, RW_PATH_JOINT, c->me, c->counts, &c->plan);
	c->sink += c->plan.egress[0];
}

static void run_plan_native(void *arg)
{
	ctx_t *c = arg;
	next_me(c);
	rw_sched_plan_build(&c->topo, RW_PATH_NATIVE, c->me, c->counts, &c->plan);
	c->sink += c->plan.egress[0];
}

/* The receive side: the plan of (s, me) for every source, as each sender builds it (the old
 * API had no bulk call: rw_sched_balance per source with the rotation of the time). */
static void run_recv(void *arg)
{
	ctx_t *c = arg;
	const uint32_t N = c->topo.nodes, R = c->topo.rails;
	next_me(c);
#ifdef SCHED_BENCH_OLD
	for (uint32_t s = 0; s < N; s++)
		if (s != c->me)
			rw_sched_balance(&c->topo, c->counts + ((size_t)s * N + c->me) * R, c->me,
					 &c->recv[s]);
#else
	(void)R;
	rw_sched_plan_build_recv(&c->topo, RW_PATH_JOINT, c->me, c->counts, c->recv);
#endif
	c->sink += c->recv[(c->me + 1) % N].quota[0];
}

#ifndef SCHED_BENCH_OLD
static void run_acc_rows(void *arg)
{
	ctx_t *c = arg;
	const uint32_t N = c->topo.nodes, R = c->topo.rails;
	rw_sched_feat_begin(&c->acc, &c->topo, c->ws, rw_sched_feat_workspace(N, R));
	for (uint32_t s = 0; s < N; s++)
		rw_sched_feat_add_row(&c->acc, s, c->counts + (size_t)s * N * R);
	c->sink += c->acc.rows;
}

static void run_acc_finish(void *arg)
{
	ctx_t *c = arg;
	rw_sched_feat_finish(&c->acc, 8192, &c->feat);
	c->sink += c->feat.max_fan_in;
}

/* Everything after the last row arrives if nothing is overlapped with the exchange: finish,
 * select, the send plan and the receive-side pair plans. */
static void run_after_last(void *arg)
{
	ctx_t *c = arg;
	const uint32_t me = next_me(c);
	rw_sched_feat_finish(&c->acc, 8192, &c->feat);
	rw_sched_select(&c->table, &c->feat, &c->sel);
	rw_sched_plan_build(&c->topo, RW_PATH_JOINT, me, c->counts, &c->plan);
	rw_sched_plan_build_recv(&c->topo, RW_PATH_JOINT, me, c->counts, c->recv);
	c->sink += c->plan.egress[0] + c->recv[(me + 1) % c->topo.nodes].quota[0] + c->sel.path;
}
#endif

static void make_table(ctx_t *c)
{
	rw_anchor_table_t *t = &c->table;
	memset(t, 0, sizeof(*t));
	t->schema_version = RW_ANCHOR_SCHEMA;
	t->max_size_ratio = 4.0;
	t->shape_tolerance = 0.2;
	t->n_anchors = 36;
	t->anchors = c->anchors;
	for (uint32_t i = 0; i < 36; i++) {
		memset(&c->anchors[i], 0, sizeof(c->anchors[i]));
		c->anchors[i].case_id = i;
		c->anchors[i].feat[0] = 18.0 + (i % 6) * 2.0;
		c->anchors[i].feat[1] = ((i / 6) % 3) * 0.4;
		c->anchors[i].feat[2] = (i / 18) * 0.4;
		c->anchors[i].selected = (rw_path_t)(i % RW_PATH_COUNT);
	}
}

static void usage(FILE *out)
{
	fprintf(out,
		"usage: sched_bench [--nodes LIST] [--rails R] [--sparse PCT] [--min-time S] [--seed N]\n"
		"                   [--stat median|min]\n"
		"Per-phase decision work of node 0 on one core (G = 8); microseconds per call.\n"
		"  --nodes LIST   comma-separated N values (default 16,32,64,128)\n"
		"  --rails R      rails per node (default 8)\n"
		"  --sparse PCT   percent of node pairs without records (default 0)\n"
		"  --min-time S   seconds per measurement at least (default 0.2)\n"
		"  --seed N       workload seed (default 1)\n"
		"  --stat S       median of the timed batches (default) or min (their fastest)\n");
}

int main(int argc, char **argv)
{
	char nodes_list[256] = "16,32,64,128";
	uint32_t rails = 8, sparse = 0;
	uint64_t seed = 1;
	static const struct option opts[] = {
		{ "nodes", required_argument, NULL, 'n' }, { "rails", required_argument, NULL, 'r' },
		{ "sparse", required_argument, NULL, 'p' }, { "min-time", required_argument, NULL, 't' },
		{ "seed", required_argument, NULL, 's' }, { "stat", required_argument, NULL, 'm' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int o;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (o) {
		case 'n': snprintf(nodes_list, sizeof(nodes_list), "%s", optarg); break;
		case 'r': rails = (uint32_t)strtoul(optarg, NULL, 0); break;
		case 'p': sparse = (uint32_t)strtoul(optarg, NULL, 0); break;
		case 't': min_time = strtod(optarg, NULL); break;
		case 's': seed = strtoull(optarg, NULL, 0); break;
		case 'm': use_min = strcmp(optarg, "min") == 0; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	rng_state = seed;
#ifdef SCHED_BENCH_OLD
	printf("%5s %8s %9s %9s %8s %8s %8s %8s %8s %8s %10s\n", "N", "read", "features",
	       "feat/read", "acc_row", "finish", "select", "plan", "native", "recv", "after_last");
#else
	printf("%5s %8s %9s %9s %8s %8s %8s %8s %8s %8s %10s\n", "N", "read", "features",
	       "feat/read", "acc_row", "finish", "select", "plan", "native", "recv", "after_last");
#endif
	for (char *tok = strtok(nodes_list, ","); tok; tok = strtok(NULL, ",")) {
		ctx_t *c = calloc(1, sizeof(*c));
		uint32_t N = (uint32_t)strtoul(tok, NULL, 0);
		if (!c || rw_sched_topo_init(&c->topo, N, 8, rails) != RW_OK) {
			fprintf(stderr, "sched_bench: bad N %s or R %u\n", tok, rails);
			return 2;
		}
		c->counts = malloc((size_t)N * N * rails * sizeof(uint32_t));
		c->pairs = calloc(N, sizeof(*c->pairs));
		c->recv = calloc(N, sizeof(*c->recv));
		if (!c->counts || !c->pairs || !c->recv)
			return 1;
		c->plan.pairs = c->pairs;
		make_counts(c->counts, N, rails, sparse);
		make_table(c);
		double t_read = time_ns(run_read, c), t_feat = time_ns(run_features, c);
		double t_sel = time_ns(run_select, c), t_plan = time_ns(run_plan_joint, c);
		double t_nat = time_ns(run_plan_native, c), t_recv = time_ns(run_recv, c);
#ifdef SCHED_BENCH_OLD
		/* Before the accumulator the whole matrix was read after the last row. */
		printf("%5u %8.2f %9.2f %9.2f %8s %8s %8.2f %8.2f %8.2f %8.2f %10.2f\n", N,
		       t_read / 1e3, t_feat / 1e3, t_feat / t_read, "-", "-", t_sel / 1e3, t_plan / 1e3,
		       t_nat / 1e3, t_recv / 1e3, (t_feat + t_sel + t_plan + t_recv) / 1e3);
#else
		c->ws = malloc(rw_sched_feat_workspace(N, rails));
		if (!c->ws)
			return 1;
		double t_rows = time_ns(run_acc_rows, c), t_fin = time_ns(run_acc_finish, c);
		double t_after = time_ns(run_after_last, c);
		printf("%5u %8.2f %9.2f %9.2f %8.3f %8.2f %8.2f %8.2f %8.2f %8.2f %10.2f\n", N,
		       t_read / 1e3, t_feat / 1e3, t_feat / t_read, t_rows / N / 1e3, t_fin / 1e3,
		       t_sel / 1e3, t_plan / 1e3, t_nat / 1e3, t_recv / 1e3, t_after / 1e3);
		free(c->ws);
#endif
		free(c->counts);
		free(c->pairs);
		free(c->recv);
		free(c);
	}
	return 0;
}
