/* tests/lib/workload.h: the seeded MoE workload that the executor test (tests/service/test_exec.c)
 * and the integration rank (tests/integration/rw_rank.c) both run, and the reference each checks
 * against. A rank's tokens, top-k ids, weights and rows at (step, layer) are a pure function of
 * (seed, step, layer, rank), so every rank knows what must reach it without asking anyone.
 * Experts: rank r hosts experts [r*E/W, (r+1)*E/W); expert e's "MLP" multiplies by (e % 3 + 1).
 * Values are small integers and weights 0.5 or 1, so every sum is exact in fp32 and bf16. */
#ifndef RW_TEST_LIB_WORKLOAD_H
#define RW_TEST_LIB_WORKLOAD_H

#include <stdint.h>

enum {
	RW_WL_TOPK = 4,        /* ids per token */
	RW_WL_MAX_TOKENS = 48, /* a rank draws 1..48 tokens (x3 on local GPU 0) unless fixed */
};

/* One rank's workload of a phase: its tokens' top-k ids (-1: none) and weights and their rows.
 * The caller owns the arrays: ids and w for max_rows tokens, x for max_rows * hidden floats. */
typedef struct rw_wl_work {
	uint32_t n;
	int32_t (*ids)[RW_WL_TOPK];
	float (*w)[RW_WL_TOPK];
	float *x;
} rw_wl_work_t;

/* What the workload depends on besides (step, layer, rank). */
typedef struct rw_wl_shape {
	uint64_t seed;
	uint32_t gpus;      /* ranks per node */
	uint32_t experts;   /* E */
	uint32_t per_rank;  /* experts per rank (E / world) */
	uint32_t hidden;    /* elements per row */
	uint32_t tokens;    /* every rank dispatches exactly this many (0: 1..48, x3 on local GPU 0) */
	int empty;          /* some phases route nothing anywhere, some ranks nothing in others */
	uint32_t stay_home; /* bit n: node n's ranks pick experts of node n only */
} rw_wl_shape_t;

/* splitmix64's finalizer after one step: the workload's only source of randomness. */
uint64_t rw_wl_mix(uint64_t z);

/* The workload of `rank` at (step, layer): skewed experts (a hot quarter chosen half the time,
 * shifted per rank: per-source heterogeneity) and skewed rails (local GPU 0 owns 3x tokens).
 * With empty, phase (step 0, layer 1) and one phase in five route nothing anywhere (every rank
 * dispatches 0 tokens and combines 0 rows) and one rank in four routes nothing in the others. */
void rw_wl_gen(const rw_wl_shape_t *sh, uint32_t step, uint32_t layer, uint32_t rank,
	       rw_wl_work_t *wk);

/* Which dtype a phase uses: fp32 and bf16 alternate over (step + layer). */
static inline int rw_wl_bf16(uint32_t step, uint32_t layer) { return (int)((layer + step) % 2); }

/* One row of `hidden` values into dst as bf16 or fp32, and element h of such a row back. */
void rw_wl_put_row(uint8_t *dst, int bf16, const float *v, uint32_t hidden);
float rw_wl_get_elem(const uint8_t *src, int bf16, uint32_t h);

/* How many tokens of wk have an expert at rank `me`; each such id counted in ecount[expert]. */
uint32_t rw_wl_hits(const rw_wl_work_t *wk, uint32_t me, uint32_t per_rank, uint32_t *ecount);

/* What rank `me` returns for token `token` of wk: the sum over the token's experts hosted at me
 * of weight * (e % 3 + 1) * row, into out[hidden]. Returns 0 when none of them is at me. */
int rw_wl_expert_row(const rw_wl_work_t *wk, uint32_t token, uint32_t me, uint32_t per_rank,
		     uint32_t hidden, float *out);

/* What combine must give back for element h of token t: the sum over all the token's experts. */
float rw_wl_combined(const rw_wl_work_t *wk, uint32_t t, uint32_t h, uint32_t hidden);

#endif /* RW_TEST_LIB_WORKLOAD_H */
