/* Workload options and token data shared by `railwave demo`/`bench` and the rank program
 * (tools/bench.h). */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "common/bf16.h"
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
	"  --nodes N --gpus G --rails R     cluster shape (4, 2, 4); GPU g on rail g % R\n"
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

/* Row of token tk (hidden bf16 elements) scaled by c: exact for the small values used here.
 * Element h is lut[(a + b·h) mod 9], so a row repeats with period 9 (RW_BENCH_ROW_PERIOD): the
 * first period is computed, the rest copied in doubling blocks, and a check compares the first
 * period element by element and every later element with the one a period before (one memcmp)
 * — every element checked, at memcpy speed, so the ranks leave the CPU to the daemons. */
static void row_period(uint16_t pat[RW_BENCH_ROW_PERIOD], const rw_bench_tok_t *tk, float c)
{
	uint16_t lut[9];
	for (int v = 0; v < 9; v++)
		lut[v] = rw_bf16_from_f32(c * (float)(v - 4));
	for (uint32_t h = 0; h < RW_BENCH_ROW_PERIOD; h++)
		pat[h] = lut[(tk->a + tk->b * h) % 9u];
}

void rw_bench_put_row(uint16_t *dst, const rw_bench_tok_t *tk, float c, uint32_t hidden)
{
	uint16_t pat[RW_BENCH_ROW_PERIOD];
	row_period(pat, tk, c);
	uint32_t n = RW_MIN(hidden, RW_BENCH_ROW_PERIOD);
	memcpy(dst, pat, 2u * n);
	while (n < hidden) { /* [0, n) holds whole periods (or all of a short row) */
		uint32_t m = RW_MIN(n, hidden - n);
		memcpy(dst + n, dst, 2u * m);
		n += m;
	}
}

int rw_bench_row_equals(const uint16_t *got, const rw_bench_tok_t *tk, float c, uint32_t hidden,
		      uint32_t *bad_h)
{
	uint16_t pat[RW_BENCH_ROW_PERIOD];
	row_period(pat, tk, c);
	for (uint32_t h = 0; h < RW_MIN(hidden, RW_BENCH_ROW_PERIOD); h++)
		if (got[h] != pat[h]) {
			*bad_h = h;
			return 0;
		}
	if (hidden <= RW_BENCH_ROW_PERIOD || !memcmp(got + RW_BENCH_ROW_PERIOD, got, 2u * (hidden - RW_BENCH_ROW_PERIOD)))
		return 1;
	for (uint32_t h = RW_BENCH_ROW_PERIOD; h < hidden; h++) /* name the first bad element */
		if (got[h] != got[h - RW_BENCH_ROW_PERIOD]) {
			*bad_h = h;
			break;
		}
	return 0;
}
