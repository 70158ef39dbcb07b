/* Workload options and token data shared by `railwave demo`/`bench` and the rank program
 * (tools/bench.h). */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "tools/bench.h"
#include "tools/tools.h"

enum {
	O_NODES = RW_BENCH_OPT_BASE, O_GPUS, O_RAILS, O_EXPERTS, O_TOPK, O_HIDDEN, O_TOKENS, O_ZIPF,
	O_DIRICHLET, O_RAIL_SKEW, O_SEED, O_LAYER,
};

const struct option rw_bench_wl_options[] = {
	{ "nodes", required_argument, NULL, O_NODES },
	{ "gpus", required_argument, NULL, O_GPUS },
	{ "rails", required_argument, NULL, O_RAILS },
	{ "experts", required_argument, NULL, O_EXPERTS },
	{ "topk", required_argument, NULL, O_TOPK },
	{ "hidden", required_argument, NULL, O_HIDDEN },
	{ "tokens", required_argument, NULL, O_TOKENS },
	{ "zipf", required_argument, NULL, O_ZIPF },
	{ "dirichlet", required_argument, NULL, O_DIRICHLET },
	{ "rail-skew", required_argument, NULL, O_RAIL_SKEW },
	{ "seed", required_argument, NULL, O_SEED },
	{ "layer", required_argument, NULL, O_LAYER },
	{ NULL, 0, NULL, 0 },
};

const char rw_bench_wl_usage[] =
	"workload (GLM-4.5-Air-shaped defaults):\n"
	"  --nodes N --gpus G --rails R     cluster shape (4, 2, 4); GPU g on rail g %% R\n"
	"  --experts E --topk K --hidden H  routed experts, experts per token, bf16 row (128, 8, 4096)\n"
	"  --tokens T                       tokens per rank (300)\n"
	"  --zipf S --dirichlet A           global expert skew, per-source heterogeneity (0.8, 20)\n"
	"  --rail-skew P                    direct rail skew in [0,1] (0.7; tools/synth.h)\n"
	"  --seed S --layer L               routing seed and synthetic layer (1, 0)\n";

void rw_bench_wl_default(rw_bench_wl_t *wl)
{
	*wl = (rw_bench_wl_t){ .nodes = 4, .gpus = 2, .rails = 4, .experts = 128, .topk = 8,
			       .hidden = 4096, .tokens = 300, .zipf = 0.8, .dirichlet = 20,
			       .rail_skew = 0.7, .seed = 1, .layer = 0 };
}

static int u32_opt(const char *cmd, const char *name, const char *arg, uint32_t lo, uint32_t hi,
		   uint32_t *out)
{
	unsigned long long v;
	if (rw_tool_parse_u64(cmd, name, arg, &v) < 0)
		return -1;
	if (v < lo || v > hi) {
		fprintf(stderr, "railwave %s: %s must be in [%u, %u]\n", cmd, name, lo, hi);
		return -1;
	}
	*out = (uint32_t)v;
	return 0;
}

static int f64_opt(const char *cmd, const char *name, const char *arg, double lo, double hi,
		   double *out)
{
	double v;
	if (rw_tool_parse_double(cmd, name, arg, &v) < 0)
		return -1;
	if (!(v >= lo && v <= hi)) {
		fprintf(stderr, "railwave %s: %s must be in [%g, %g]\n", cmd, name, lo, hi);
		return -1;
	}
	*out = v;
	return 0;
}

int rw_bench_wl_opt(const char *cmd, int opt, const char *arg, rw_bench_wl_t *wl)
{
	switch (opt) {
	case O_NODES: return u32_opt(cmd, "--nodes", arg, 2, 64, &wl->nodes);
	case O_GPUS: return u32_opt(cmd, "--gpus", arg, 1, RW_MAX_GPUS, &wl->gpus);
	case O_RAILS: return u32_opt(cmd, "--rails", arg, 1, RW_MAX_RAILS, &wl->rails);
	case O_EXPERTS: return u32_opt(cmd, "--experts", arg, 1, 65536, &wl->experts);
	case O_TOPK: return u32_opt(cmd, "--topk", arg, 1, 32, &wl->topk);
	case O_HIDDEN: return u32_opt(cmd, "--hidden", arg, 1, 65536, &wl->hidden);
	case O_TOKENS: return u32_opt(cmd, "--tokens", arg, 1, 1u << 20, &wl->tokens);
	case O_ZIPF: return f64_opt(cmd, "--zipf", arg, 0, 10, &wl->zipf);
	case O_DIRICHLET: return f64_opt(cmd, "--dirichlet", arg, 0, 1e9, &wl->dirichlet);
	case O_RAIL_SKEW: return f64_opt(cmd, "--rail-skew", arg, 0, 1, &wl->rail_skew);
	case O_SEED: {
		unsigned long long v;
		if (rw_tool_parse_u64(cmd, "--seed", arg, &v) < 0)
			return -1;
		wl->seed = v;
		return 0;
	}
	case O_LAYER: return u32_opt(cmd, "--layer", arg, 0, 1u << 20, &wl->layer);
	default: return 1;
	}
}

void rw_bench_wl_synth(const rw_bench_wl_t *wl, rw_synth_cfg_t *cfg)
{
	*cfg = (rw_synth_cfg_t){ .nodes = wl->nodes, .gpus_per_node = wl->gpus,
				 .n_experts = wl->experts, .topk = wl->topk,
				 .tokens_per_rank = wl->tokens, .layer = wl->layer, .seed = wl->seed,
				 .zipf_s = wl->zipf, .dirichlet = wl->dirichlet,
				 .rail_skew = wl->rail_skew };
}

static uint64_t mix(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

rw_bench_tok_t rw_bench_tok(uint64_t seed, uint64_t step, uint32_t rank, uint32_t token)
{
	uint64_t z = mix(seed ^ mix(step ^ ((uint64_t)rank << 32) ^ mix(token)));
	/* b in 1..8 is coprime with 9 except 3 and 6: rows still differ by a. */
	return (rw_bench_tok_t){ .a = (uint32_t)(z % 9), .b = 1 + (uint32_t)((z >> 8) % 8),
				 .wbits = (uint32_t)(z >> 32) };
}
