/* Shared by `railwave demo` / `railwave bench` and their rank program (tools/bench_rank.c): the
 * synthetic workload of one test-bed run, described by the same options everywhere so that the
 * planner's view (tools/bench_workload.c) and what the ranks submit are the same phase.
 * Private to tools/. */
#ifndef RW_TOOLS_BENCH_H
#define RW_TOOLS_BENCH_H

#include <getopt.h>
#include <stdint.h>

#include "tools/synth.h"

typedef struct rw_bench_wl {
	uint32_t nodes, gpus, rails;
	uint32_t experts, topk, hidden; /* hidden elements of bf16 */
	uint32_t tokens;                /* per rank */
	double zipf, dirichlet, rail_skew;
	uint64_t seed;
	uint32_t layer;                 /* the synthetic layer drawn (fixed over a run's steps) */
} rw_bench_wl_t;

/* GLM-4.5-Air-shaped defaults on the 4 x 2 x 4 test bed (docs/demo.md). */
void rw_bench_wl_default(rw_bench_wl_t *wl);

/* Workload options, for getopt_long tables: every entry has val >= RW_BENCH_OPT_BASE. */
#define RW_BENCH_OPT_BASE 0x400
extern const char rw_bench_wl_usage[];
/* If `opt` is one of the workload options, parse `arg` into wl: 0 ok, -1 bad value (message
 * printed naming cmd and the option); 1 = not a workload option. */
int rw_bench_wl_opt(const char *cmd, int opt, const char *arg, rw_bench_wl_t *wl);
/* The getopt_long entries (terminated by a zero entry); callers append their own. */
extern const struct option rw_bench_wl_options[];
#define RW_BENCH_WL_NOPTS 12

/* The synth configuration of the workload. */
void rw_bench_wl_synth(const rw_bench_wl_t *wl, rw_synth_cfg_t *cfg);

/* Token data of the workload (what a rank submits and what every check expects): element h
 * of token t of rank q at step s is a small integer in [-4, 4]; gate weights are 0.5 or 1;
 * expert e's "MLP" multiplies by (e % 3 + 1). Sums of these are exact in bf16 and fp32. */
typedef struct rw_bench_tok {
	uint32_t a, b;        /* x_h = (a + b * h) % 9 - 4 */
	uint32_t wbits;       /* bit k: weight of top-k slot k is 0.5 (set) or 1 (clear) */
} rw_bench_tok_t;

rw_bench_tok_t rw_bench_tok(uint64_t seed, uint64_t step, uint32_t rank, uint32_t token);
static inline int rw_bench_x(const rw_bench_tok_t *t, uint32_t h) { return (int)((t->a + t->b * h) % 9u) - 4; }
static inline float rw_bench_w(const rw_bench_tok_t *t, uint32_t k) { return (t->wbits >> k) & 1u ? 0.5f : 1.0f; }
static inline float rw_bench_factor(int32_t e) { return (float)(e % 3 + 1); }

/* Token tk's row (hidden bf16 elements) scaled by c, into dst; whether got[] is exactly that row
 * (0: no, and *bad_h = the first element that differs). Every element is checked. */
#define RW_BENCH_ROW_PERIOD 9u
void rw_bench_put_row(uint16_t *dst, const rw_bench_tok_t *tk, float c, uint32_t hidden);
int rw_bench_row_equals(const uint16_t *got, const rw_bench_tok_t *tk, float c, uint32_t hidden,
			uint32_t *bad_h);

#endif /* RW_TOOLS_BENCH_H */
