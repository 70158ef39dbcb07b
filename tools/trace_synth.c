/* `railwave trace-synth`: phase records (the format of railwaved's trace_dir, docs/service.md
 * "Phase traces") for synthetic routing from tools/synth.c, so `railwave analyze` can be run on
 * many step-layer pairs of a model-shaped workload without a cluster (docs/perf/analyze.md). One
 * dispatch record per node and (step, layer): the count matrix, the node's expert loads, the
 * features and the selector's verdict; "synthetic": true and no times.
 *   railwave trace-synth [--nodes N --gpus G --rails R] [--shape glm|dsv3] [--tokens T]
 *                        [--zipf S] [--dirichlet A] [--rail-skew P] [--seed S]
 *                        [--layers L] [--steps K] [--gbps C] > synth.trace.jsonl */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/synth.h"
#include "tools/tools.h"

static const char CMD[] = "trace-synth";

typedef struct synth_args {
	unsigned long long nodes, gpus, rails, tokens, layers, steps, seed;
	double zipf, dirichlet, rail_skew, gbps;
	const rw_synth_shape_t *shape;
} synth_args_t;

static int usage(int rc)
{
	fprintf(rc ? stderr : stdout,
		"usage: railwave %s [--nodes N] [--gpus G] [--rails R] [--shape glm|dsv3] [--tokens T]\n"
		"                         [--zipf S] [--dirichlet A] [--rail-skew P] [--seed S]\n"
		"                         [--layers L] [--steps K] [--gbps C]\n"
		"Phase records (railwaved's trace format) of synthetic routing, one dispatch record per\n"
		"node and (step, layer), for `railwave analyze`. Defaults: 4 x 8 x 8, glm (GLM-4.5-Air:\n"
		"128 experts, top-8, hidden 4096), 4096 tokens/rank, zipf 0.8, dirichlet 20 (per-source\n"
		"heterogeneity), rail-skew 0, seed 1, 45 layers x 20 steps (900 pairs), 400 Gbit/s.\n", CMD);
	return rc;
}

/* One (step, layer): every node's record on stdout. */
static rw_status_t synth_pair(const synth_args_t *a, uint32_t step, uint32_t layer, uint32_t *counts,
			      int32_t *ids, uint32_t *load, size_t load_cap)
{
	const uint32_t N = (uint32_t)a->nodes, G = (uint32_t)a->gpus, R = (uint32_t)a->rails;
	rw_synth_cfg_t cfg = {
		.nodes = N, .gpus_per_node = G, .n_experts = a->shape->n_experts, .topk = 8,
		.n_groups = a->shape->n_groups, .topk_groups = a->shape->topk_groups,
		.tokens_per_rank = (uint32_t)a->tokens, .layer = layer,
		.seed = a->seed * 1000003ull + step, .zipf_s = a->zipf, .dirichlet = a->dirichlet,
		.rail_skew = a->rail_skew,
	};
	rw_topo_t topo;
	rw_synth_t gen;
	rw_status_t st = rw_sched_topo_init(&topo, N, G, R);
	if (st != RW_OK || (st = rw_synth_init(&gen, &cfg)) != RW_OK)
		return st;
	const uint32_t E = gen.phys_experts, per_node = E / N;
	if (E > load_cap) {
		rw_synth_free(&gen);
		return RW_ERR_RANGE;
	}
	memset(load, 0, sizeof(uint32_t) * E);
	for (uint32_t n = 0; n < N && st == RW_OK; n++) {
		rw_rank_tokens_t ranks[RW_MAX_GPUS];
		rw_synth_node(&gen, n, ids, ranks);
		st = rw_sched_count(&topo, E, n, ranks, G, counts + (size_t)n * N * R, NULL);
		for (size_t i = 0; i < (size_t)G * cfg.tokens_per_rank * cfg.topk; i++)
			if (ids[i] >= 0)
				load[ids[i]]++;
	}
	rw_synth_free(&gen);
	if (st != RW_OK)
		return st;
	const uint64_t rec = rw_sched_rec_bytes(cfg.topk, a->shape->hidden, 2);
	const uint64_t crec = rw_sched_crec_bytes(a->shape->hidden, 2);
	rw_features_t f;
	rw_selection_t sel;
	rw_sched_features(&topo, counts, rec, &f);
	rw_sched_select(NULL, &f, &sel);
	for (uint32_t n = 0; n < N; n++) {
		printf("{\"v\":1,\"synthetic\":true,\"node\":%u,\"name\":\"s%u\",\"group\":\"synth-%s\","
		       "\"layer\":%u,\"step\":%u,\"kind\":\"dispatch\",\"N\":%u,\"R\":%u,\"G\":%u,\"gbps\":[",
		       n, n, a->shape->name, layer, step, N, R, G);
		for (uint32_t r = 0; r < R; r++)
			printf("%s%g", r ? "," : "", a->gbps);
		printf("],\"status\":\"ok\",\"t0_ns\":0,\"us\":null,\"last_rank\":null,\"last_submit_us\":null,"
		       "\"last_peer\":null,\"path\":\"%s\",\"reason\":\"%s\",\"case\":%lld,"
		       "\"features\":{\"remote_bytes\":%llu,\"B\":%.6g,\"rho_g\":%.6g,\"kappa\":%.6g,"
		       "\"f\":[%.6g,%.6g,%.6g],\"max_fan_in\":%u,\"busiest_dst_rail_share\":%.6g},"
		       "\"rec_size\":%llu,\"combine_rec_size\":%llu,\"experts\":%u,\"topk\":%u,\"counts\":[",
		       rw_sched_path_name(sel.path), rw_sched_reason_name(sel.reason),
		       (long long)sel.case_id, (unsigned long long)f.remote_bytes, f.B, f.rho_g, f.kappa,
		       f.f[0], f.f[1], f.f[2], f.max_fan_in, f.busiest_dst_rail_share,
		       (unsigned long long)rec, (unsigned long long)crec, E, cfg.topk);
		for (size_t i = 0; i < (size_t)N * N * R; i++)
			printf("%s%u", i ? "," : "", counts[i]);
		printf("],\"expert_first\":%u,\"expert_load\":[", n * per_node);
		for (uint32_t e = 0; e < per_node; e++)
			printf("%s%u", e ? "," : "", load[n * per_node + e]);
		printf("],\"tx\":[],\"waves\":[],\"rx\":[],\"grants\":[]}\n");
	}
	return RW_OK;
}

int rw_tool_trace_synth(int argc, char **argv)
{
	enum { O_NODES = 256, O_GPUS, O_RAILS, O_SHAPE, O_TOKENS, O_ZIPF, O_DIR, O_SKEW, O_SEED,
	       O_LAYERS, O_STEPS, O_GBPS };
	static const struct option opts[] = {
		{ "nodes", required_argument, NULL, O_NODES }, { "gpus", required_argument, NULL, O_GPUS },
		{ "rails", required_argument, NULL, O_RAILS }, { "shape", required_argument, NULL, O_SHAPE },
		{ "tokens", required_argument, NULL, O_TOKENS }, { "zipf", required_argument, NULL, O_ZIPF },
		{ "dirichlet", required_argument, NULL, O_DIR }, { "rail-skew", required_argument, NULL, O_SKEW },
		{ "seed", required_argument, NULL, O_SEED }, { "layers", required_argument, NULL, O_LAYERS },
		{ "steps", required_argument, NULL, O_STEPS }, { "gbps", required_argument, NULL, O_GBPS },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	synth_args_t a = { .nodes = 4, .gpus = 8, .rails = 8, .tokens = 4096, .layers = 45, .steps = 20,
			   .seed = 1, .zipf = 0.8, .dirichlet = 20, .rail_skew = 0, .gbps = 400,
			   .shape = rw_synth_shape("glm") };
	int c;
	optind = 0;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		int bad = 0;
		switch (c) {
		case O_NODES: bad = rw_tool_parse_u64(CMD, "--nodes", optarg, &a.nodes); break;
		case O_GPUS: bad = rw_tool_parse_u64(CMD, "--gpus", optarg, &a.gpus); break;
		case O_RAILS: bad = rw_tool_parse_u64(CMD, "--rails", optarg, &a.rails); break;
		case O_TOKENS: bad = rw_tool_parse_u64(CMD, "--tokens", optarg, &a.tokens); break;
		case O_SEED: bad = rw_tool_parse_u64(CMD, "--seed", optarg, &a.seed); break;
		case O_LAYERS: bad = rw_tool_parse_u64(CMD, "--layers", optarg, &a.layers); break;
		case O_STEPS: bad = rw_tool_parse_u64(CMD, "--steps", optarg, &a.steps); break;
		case O_ZIPF: bad = rw_tool_parse_double(CMD, "--zipf", optarg, &a.zipf); break;
		case O_DIR: bad = rw_tool_parse_double(CMD, "--dirichlet", optarg, &a.dirichlet); break;
		case O_SKEW: bad = rw_tool_parse_double(CMD, "--rail-skew", optarg, &a.rail_skew); break;
		case O_GBPS: bad = rw_tool_parse_double(CMD, "--gbps", optarg, &a.gbps); break;
		case O_SHAPE:
			if (!(a.shape = rw_synth_shape(optarg))) {
				fprintf(stderr, "railwave %s: --shape must be glm or dsv3\n", CMD);
				bad = 1;
			}
			break;
		case 'h': return usage(0);
		default: return usage(2);
		}
		if (bad)
			return 2;
	}
	if (optind < argc || a.nodes < 2 || a.nodes > 64 || a.gpus < 1 || a.gpus > RW_MAX_GPUS ||
	    a.rails < 1 || a.rails > RW_MAX_RAILS || a.tokens < 1 || a.tokens > (1u << 20) ||
	    a.layers < 1 || a.steps < 1 || !(a.gbps > 0)) {
		fprintf(stderr, "railwave %s: need 2 <= nodes <= 64, 1 <= gpus <= %d, 1 <= rails <= %d, "
			"tokens in 1..2^20, layers and steps >= 1, gbps > 0\n", CMD, RW_MAX_GPUS, RW_MAX_RAILS);
		return 2;
	}
	const size_t N = a.nodes, R = a.rails, load_cap = 1u << 16;
	uint32_t *counts = calloc(N * N * R, sizeof(uint32_t));
	int32_t *ids = malloc(sizeof(int32_t) * a.gpus * a.tokens * 8);
	uint32_t *load = malloc(sizeof(uint32_t) * load_cap);
	int rc = 0;
	if (!counts || !ids || !load) {
		fprintf(stderr, "railwave %s: out of memory\n", CMD);
		rc = 1;
	}
	for (uint32_t s = 0; !rc && s < a.steps; s++)
		for (uint32_t l = 0; !rc && l < a.layers; l++) {
			rw_status_t st = synth_pair(&a, s, l, counts, ids, load, load_cap);
			if (st != RW_OK) {
				fprintf(stderr, "railwave %s: cannot draw step %u layer %u: %s (check the "
					"knobs: zipf >= 0, dirichlet >= 0, rail-skew in [0,1])\n", CMD, s, l,
					rw_status_str(st));
				rc = st == RW_ERR_INVAL ? 2 : 1;
			}
		}
	free(counts);
	free(ids);
	free(load);
	return rc;
}
