/* `railwave bench-plan`: the planning benchmark (docs/perf/plan.md). For each
 * cluster size and model shape it times, on one core, the per-phase work of one node: building
 * its counts, features + selection, its RailBalance send plan + waves, the receive-side pair
 * plans, the per-record owner -> proxy mapping, and the Birkhoff-von Neumann baseline on the
 * same demand, and prints the medians and the Birkhoff / ours ratio. A benchmark, not a test. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "sched/sched.h"
#include "tools/synth.h"
#include "tools/tools.h"

#define GPUS 8
#define RAILS 8
#define TOPK 8


/* ---- timing: median over batches, each batch long enough for the clock ---- */

typedef void (*bench_fn_t)(void *arg);

/* Median nanoseconds per call of fn(arg). */
static double time_median_ns(bench_fn_t fn, void *arg, double min_seconds, unsigned min_reps)
{
	enum { MAX_REPS = 1001 };
	static double per_call[MAX_REPS];
	uint64_t t0 = rw_now_ns();
	fn(arg); /* warm caches and branch predictors */
	uint64_t one = rw_now_ns() - t0;
	uint64_t batch = one >= 20000 ? 1 : 20000 / (one ? one : 1) + 1;
	unsigned reps = 0;
	uint64_t start = rw_now_ns();
	while (reps < MAX_REPS &&
	       (reps < min_reps || (double)(rw_now_ns() - start) < min_seconds * 1e9)) {
		uint64_t a = rw_now_ns();
		for (uint64_t i = 0; i < batch; i++)
			fn(arg);
		per_call[reps++] = (double)(rw_now_ns() - a) / (double)batch;
	}
	qsort(per_call, reps, sizeof(double), rw_cmp_double);
	return reps % 2 ? per_call[reps / 2] : 0.5 * (per_call[reps / 2 - 1] + per_call[reps / 2]);
}

/* ---- the work being timed ---- */

typedef struct bench_ctx {
	rw_topo_t topo;
	uint32_t phys_experts;
	uint64_t record_bytes;
	uint32_t me;
	rw_rank_tokens_t ranks[GPUS]; /* node me's routing */
	uint32_t *counts;             /* N x N x R */
	uint32_t *row, *offset;       /* node me's row (pass 1) and its prefix */
	rw_record_t *rec;
	rw_anchor_table_t *table;
	rw_features_t feat;
	rw_sched_feat_acc_t acc; /* every row folded in, as the daemon does while rows arrive */
	void *acc_ws;
	rw_selection_t sel;
	rw_pair_plan_t *pairs, *recv_pairs;
	rw_phase_plan_t plan;
	uint8_t *egress;
	uint32_t *slot;
	uint64_t *demand;
	void *bvn_ws;
	uint32_t *bvn_perm;
	uint64_t *bvn_weight;
	uint32_t bvn_stages;
	volatile uint64_t sink;
} bench_ctx_t;

static void run_count(void *arg)
{
	bench_ctx_t *b = arg;
	rw_sched_count(&b->topo, b->phys_experts, b->me, b->ranks, GPUS, b->row, NULL);
	b->sink += b->row[0];
}

static void run_records(void *arg)
{
	bench_ctx_t *b = arg;
	const uint32_t n = b->topo.nodes * b->topo.rails;
	rw_sched_prefix(b->row, n, b->offset);
	rw_sched_records(&b->topo, b->phys_experts, b->me, b->ranks, GPUS, b->offset, b->rec);
	b->sink += b->offset[n];
}

/* Folding all N rows into the feature accumulator: the daemon does this row by row while the
 * all-gather is still running, so it is reported per row and not counted in "ours". */
static void run_fold(void *arg)
{
	bench_ctx_t *b = arg;
	const uint32_t N = b->topo.nodes, R = b->topo.rails;
	rw_sched_feat_begin(&b->acc, &b->topo, b->acc_ws, rw_sched_feat_workspace(N, R));
	for (uint32_t s = 0; s < N; s++)
		rw_sched_feat_add_row(&b->acc, s, b->counts + (size_t)s * N * R);
	b->sink += b->acc.rows;
}

/* What is left once the last row arrived: finish the features and select. */
static void run_select(void *arg)
{
	bench_ctx_t *b = arg;
	rw_sched_feat_finish(&b->acc, b->record_bytes, &b->feat);
	rw_sched_select(b->table, &b->feat, &b->sel);
	b->sink += (uint64_t)b->sel.path;
}

static void run_plan(void *arg)
{
	bench_ctx_t *b = arg;
	rw_sched_plan_build(&b->topo, RW_PATH_JOINT, b->me, b->counts, &b->plan);
	b->sink += b->plan.egress[0];
}

/* The receive side of the same phase: pair plans (s, me) for every source, exactly as each
 * sender computed them. */
static void run_recv_plans(void *arg)
{
	bench_ctx_t *b = arg;
	rw_sched_plan_build_recv(&b->topo, RW_PATH_JOINT, b->me, b->counts, b->recv_pairs);
	b->sink += b->recv_pairs[(b->me + 1) % b->topo.nodes].quota[0];
}

static void run_map(void *arg)
{
	bench_ctx_t *b = arg;
	size_t at = 0;
	for (uint32_t d = 0; d < b->topo.nodes; d++) {
		const rw_pair_plan_t *pp = &b->plan.pairs[d];
		if (d == b->me)
			continue;
		for (uint32_t r = 0; r < b->topo.rails; r++) {
			rw_sched_map_rail(pp, r, b->egress + at, b->slot + at);
			at += pp->count[r];
		}
	}
	b->sink += b->slot[at ? at - 1 : 0];
}

static void run_bvn(void *arg)
{
	bench_ctx_t *b = arg;
	const uint32_t N = b->topo.nodes;
	b->bvn_stages = rw_sched_bvn_plan(N, b->demand, N * N, b->bvn_perm, b->bvn_weight, b->bvn_ws);
	b->sink += b->bvn_stages;
}

/* A selector table of the size calibration produces (a grid over the feature space), so that
 * selection costs what it will cost in the daemon. */
static void make_table(rw_anchor_table_t *t, rw_anchor_t *anchors, uint32_t n)
{
	memset(t, 0, sizeof(*t));
	t->schema_version = RW_ANCHOR_SCHEMA;
	t->max_size_ratio = 4.0;
	t->shape_tolerance = 0.2;
	t->n_anchors = n;
	t->anchors = anchors;
	for (uint32_t i = 0; i < n; i++) {
		memset(&anchors[i], 0, sizeof(anchors[i]));
		anchors[i].case_id = i;
		anchors[i].feat[0] = 18.0 + (i % 6) * 2.0;
		anchors[i].feat[1] = ((i / 6) % 3) * 0.4;
		anchors[i].feat[2] = (i / 18) * 0.4;
		anchors[i].selected = (rw_path_t)(i % RW_PATH_COUNT);
	}
}

static void usage(FILE *out)
{
	fprintf(out,
		"usage: railwave bench-plan [--nodes LIST] [--shape dsv3|glm|both] [--tokens T] [--seed N]\n"
		"                           [--min-time SECONDS]\n"
		"Times one node's per-phase planning work (G = R = %d, top-%d) and the Birkhoff-von Neumann\n"
		"baseline on the same demand; medians over repeated batches on one core.\n"
		"  --nodes LIST    comma-separated N values (default 4,8,16,32,64,128)\n"
		"  --shape S       dsv3 (256 experts, 8 groups/top-4), glm (128 experts), both (default)\n"
		"  --tokens T      tokens per rank (default 4096)\n"
		"  --seed N        routing seed (default 1); zipf 0.8, dirichlet 100, rail-skew 0.5\n"
		"  --min-time S    seconds per measurement at least (default 0.2)\n",
		GPUS, TOPK);
}

/* One (shape, N) row. Returns 0 on success. */
static int bench_one(const rw_synth_shape_t *sh, uint32_t N, uint32_t tokens, uint64_t seed,
		     double min_time, double *plan_us_p, double *map_rate_p)
{
	rw_synth_cfg_t cfg = {
		.nodes = N, .gpus_per_node = GPUS, .n_experts = sh->n_experts, .topk = TOPK,
		.n_groups = sh->n_groups, .topk_groups = sh->topk_groups, .tokens_per_rank = tokens,
		.seed = seed, .zipf_s = 0.8, .dirichlet = 100.0, .rail_skew = 0.5,
	};
	bench_ctx_t *b = calloc(1, sizeof(*b));
	rw_synth_t gen;
	rw_anchor_t anchors[36];
	rw_anchor_table_t table;
	int rc = 1;

	if (!b)
		return 1;
	if (rw_synth_init(&gen, &cfg) != RW_OK) {
		free(b);
		return 1;
	}
	rw_sched_topo_init(&b->topo, N, GPUS, RAILS);
	b->phys_experts = gen.phys_experts;
	b->record_bytes = (uint64_t)sh->hidden * 2;
	b->me = 0;
	make_table(&table, anchors, 36);
	b->table = &table;

	const size_t ids_len = (size_t)GPUS * tokens * TOPK;
	const size_t records_max = (size_t)GPUS * tokens * (TOPK < N ? TOPK : N);
	int32_t *all_ids = malloc(sizeof(int32_t) * ids_len);
	int32_t *my_ids = malloc(sizeof(int32_t) * ids_len);
	b->counts = calloc((size_t)N * N * RAILS, sizeof(uint32_t));
	b->row = calloc((size_t)N * RAILS, sizeof(uint32_t));
	b->offset = calloc((size_t)N * RAILS + 1, sizeof(uint32_t));
	b->rec = malloc(sizeof(rw_record_t) * records_max);
	b->pairs = calloc(N, sizeof(rw_pair_plan_t));
	b->recv_pairs = calloc(N, sizeof(rw_pair_plan_t));
	b->egress = malloc(records_max);
	b->slot = malloc(sizeof(uint32_t) * records_max);
	b->demand = calloc((size_t)N * N, sizeof(uint64_t));
	b->bvn_ws = malloc(rw_sched_bvn_workspace(N));
	b->bvn_perm = malloc(sizeof(uint32_t) * (size_t)N * N * N);
	b->bvn_weight = malloc(sizeof(uint64_t) * (size_t)N * N);
	b->acc_ws = malloc(rw_sched_feat_workspace(N, RAILS));
	if (!b->acc_ws || !all_ids || !my_ids || !b->counts || !b->row || !b->offset || !b->rec || !b->pairs ||
	    !b->recv_pairs || !b->egress || !b->slot || !b->demand || !b->bvn_ws || !b->bvn_perm ||
	    !b->bvn_weight) {
		fprintf(stderr, "railwave bench-plan: out of memory at N = %u\n", N);
		goto cleanup;
	}
	if (rw_synth_counts(&gen, &b->topo, all_ids, b->counts) != RW_OK) {
		fprintf(stderr, "railwave bench-plan: counting failed at N = %u\n", N);
		goto cleanup;
	}
	rw_synth_node(&gen, b->me, my_ids, b->ranks);
	b->plan.pairs = b->pairs;
	for (uint32_t s = 0; s < N; s++)
		for (uint32_t d = 0; d < N; d++) {
			uint64_t sum = 0;
			for (uint32_t r = 0; r < RAILS; r++)
				sum += b->counts[((size_t)s * N + d) * RAILS + r];
			b->demand[(size_t)s * N + d] = s == d ? 0 : sum * b->record_bytes;
		}

	double t_count = time_median_ns(run_count, b, min_time, 15);
	double t_records = time_median_ns(run_records, b, min_time, 15);
	double t_fold = time_median_ns(run_fold, b, min_time, 15) / N;
	double t_select = time_median_ns(run_select, b, min_time, 15);
	double t_plan = time_median_ns(run_plan, b, min_time, 15);
	double t_recv = time_median_ns(run_recv_plans, b, min_time, 15);
	double t_map = time_median_ns(run_map, b, min_time, 15);
	double t_bvn = time_median_ns(run_bvn, b, min_time, N >= 64 ? 5 : 15);

	uint64_t remote = 0, moved = 0;
	for (uint32_t d = 0; d < N; d++) {
		if (d == b->me)
			continue;
		remote += b->pairs[d].total;
		moved += b->pairs[d].moved;
	}
	double ours = t_select + t_plan + t_recv;
	double rate = remote / (t_map * 1e-9) / 1e6;
	printf("%-5s %4u %5u %6u %8llu %9.1f %8.1f %8.2f %9.2f %8.2f %8.2f %8.2f %8.1f %6.1f%% %11.1f %6u %9.0f\n",
	       sh->name, N, N * GPUS, b->phys_experts, (unsigned long long)remote, t_count / 1e3,
	       t_records / 1e3, t_fold / 1e3, t_select / 1e3, t_plan / 1e3, t_recv / 1e3, ours / 1e3, rate,
	       remote ? 100.0 * moved / remote : 0.0, t_bvn / 1e3, b->bvn_stages, t_bvn / ours);
	fflush(stdout);
	*plan_us_p = ours / 1e3;
	*map_rate_p = rate;
	rc = 0;

cleanup:
	free(b->bvn_weight);
	free(b->acc_ws);
	free(b->bvn_perm);
	free(b->bvn_ws);
	free(b->demand);
	free(b->slot);
	free(b->egress);
	free(b->recv_pairs);
	free(b->pairs);
	free(b->rec);
	free(b->offset);
	free(b->row);
	free(b->counts);
	free(my_ids);
	free(all_ids);
	rw_synth_free(&gen);
	free(b);
	return rc;
}

static void print_cpu(void)
{
	char line[256];
	FILE *f = fopen("/proc/cpuinfo", "r");
	if (!f)
		return;
	while (fgets(line, sizeof(line), f)) {
		if (strncmp(line, "model name", 10) == 0) {
			char *v = strchr(line, ':');
			if (v)
				printf("cpu:%s", v + 1);
			break;
		}
	}
	fclose(f);
}

int rw_tool_bench_plan(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "nodes", required_argument, NULL, 'n' },
		{ "shape", required_argument, NULL, 'S' },
		{ "tokens", required_argument, NULL, 't' },
		{ "seed", required_argument, NULL, 's' },
		{ "min-time", required_argument, NULL, 'm' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	uint32_t nodes[32] = { 4, 8, 16, 32, 64, 128 };
	unsigned n_nodes = 6;
	int want[RW_SYNTH_N_SHAPES] = { 1, 1 };
	uint64_t seed = 1;
	uint32_t tokens = 4096;
	double min_time = 0.2;
	unsigned long long u;
	int c;

	optind = 0; /* GNU getopt: full re-initialisation (subcommands may run more than once in tests) */
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'n': {
			n_nodes = 0;
			char *list = optarg, *tok, *save = NULL;
			while ((tok = strtok_r(list, ",", &save)) && n_nodes < 32) {
				list = NULL;
				if (rw_tool_parse_u64("bench-plan", "--nodes", tok, &u) || u < 2 || u > 1024) {
					fprintf(stderr, "railwave bench-plan: N must be in [2, 1024]\n");
					return 2;
				}
				nodes[n_nodes++] = (uint32_t)u;
			}
			if (n_nodes == 0)
				return 2;
			break;
		}
		case 'S':
			want[0] = !strcmp(optarg, "dsv3") || !strcmp(optarg, "both");
			want[1] = !strcmp(optarg, "glm") || !strcmp(optarg, "both");
			if (!want[0] && !want[1]) {
				usage(stderr);
				return 2;
			}
			break;
		case 't':
			if (rw_tool_parse_u64("bench-plan", "--tokens", optarg, &u) || u == 0 || u > (1u << 20))
				return 2;
			tokens = (uint32_t)u;
			break;
		case 's':
			if (rw_tool_parse_u64("bench-plan", "--seed", optarg, &u))
				return 2;
			seed = u;
			break;
		case 'm':
			if (rw_tool_parse_double("bench-plan", "--min-time", optarg, &min_time) ||
			    !(min_time >= 0.0))
				return 2;
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc) {
		usage(stderr);
		return 2;
	}

	print_cpu();
	printf("railwave bench-plan: G = R = %d, top-%d, %u tokens/rank, seed %llu (zipf 0.8, dirichlet 100,"
	       " rail-skew 0.5); node 0's work, medians in microseconds\n", GPUS, TOPK, tokens,
	       (unsigned long long)seed);
	printf("(a) count = pass 1, records = prefix + pass 2 (microseconds);\n"
	       "fold/row = one peer's count row folded into the feature accumulator as it arrives"
	       " (overlaps the exchange, not in ours);\n"
	       "(b) fin+sel = finish the features + selector, after the last row;"
	       " (c) plan = Joint send plan (RailBalance quotas for all N\ndestinations + waves);"
	       " recv = receive-side pair plans; ours = (b)+(c)+recv = all work left after the last row;\n"
	       "(d) map = rw_sched_map_rail over every record, M records/s;"
	       " (e) bvn = Birkhoff-von Neumann baseline on the same N x N demand; ratio = bvn / ours\n\n");
	printf("shape    N     W  slots  records  count(a)  records fold/row  fin+sel  plan(c)     recv"
	       "     ours  map(d)  moved     bvn(e) stages  bvn/ours\n");
	int rc = 0;
	double ours_128[RW_SYNTH_N_SHAPES] = { -1, -1 }, worst_rate = INFINITY;
	for (unsigned s = 0; s < RW_SYNTH_N_SHAPES; s++) {
		if (!want[s])
			continue;
		for (unsigned i = 0; i < n_nodes; i++) {
			double ours, rate;
			if (bench_one(&rw_synth_shapes[s], nodes[i], tokens, seed, min_time, &ours, &rate)) {
				rc = 1;
				continue;
			}
			if (nodes[i] == 128)
				ours_128[s] = ours;
			worst_rate = RW_MIN(worst_rate, rate);
		}
	}
	printf("\ntargets: (b)+(c)+recv <= 20 us at N = 128:");
	for (unsigned s = 0; s < RW_SYNTH_N_SHAPES; s++)
		if (ours_128[s] >= 0)
			printf(" %s %.2f us %s;", rw_synth_shapes[s].name, ours_128[s], ours_128[s] <= 20.0 ? "met" : "MISSED");
	if (ours_128[0] < 0 && ours_128[1] < 0)
		printf(" (N = 128 not run);");
	printf("  mapping >= 50 M records/s: slowest %.1f M/s %s\n", worst_rate,
	       worst_rate >= 50.0 ? "met" : "MISSED");
	return rc;
}
