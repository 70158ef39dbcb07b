/* bf16 <-> fp32 on the host, as the GPU kernels convert (__float2bfloat16_rn): round to nearest
 * even, a NaN stays a quiet NaN. One definition for the daemon's forwarding and combine, the
 * tools' rank rows and the tests' references, so they agree bit for bit. */
#ifndef RW_COMMON_BF16_H
#define RW_COMMON_BF16_H

#include <stdint.h>
#include <string.h>

/* Branch-free so the daemon's row loops vectorize. */
static inline uint16_t rw_bf16_round_bits(uint32_t u)
{
	uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
	uint32_t quiet = (u >> 16) | 0x40u;
	return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline uint16_t rw_bf16_from_f32(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return rw_bf16_round_bits(u);
}

static inline float rw_bf16_to_f32(uint16_t v)
{
	uint32_t u = (uint32_t)v << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* ---- Rows (common/rows.c): hidden elements of bf16 (bf16 != 0) or fp32, at any alignment,
 * summed in fp32; bf16 results rounded once as above. The loops run in fixed blocks the
 * compiler vectorizes. */
/* acc[i] += row[i]. */
void rw_row_acc(float *acc, const void *row, int bf16, uint32_t hidden);
/* acc[i] = row[i]: the first term of a sum. */
void rw_row_load(float *acc, const void *row, int bf16, uint32_t hidden);
/* dst[i] = acc[i] as the row's type. */
void rw_row_store(void *dst, int bf16, const float *acc, uint32_t hidden);
/* dst = the sum of rows[0 .. n), added in fp32 in this order and rounded once: from +0
 * (from_zero: the owner's sum, docs/dataflow.md "Combine") or from the first term (then one
 * term is copied as it is); n = 0 gives zeros. No sum is kept beyond a block on the stack. */
void rw_rows_sum(void *dst, int bf16, const void *const *rows, uint32_t n, uint32_t hidden,
		 int from_zero);
/* The same with term k's row at term(ctx, k), asked once per block of the row: for callers
 * whose terms are not in an array (cuda/rank_cpu.c's reduce computes each from its list entry,
 * so a token of any number of terms needs no memory of its own). */
typedef const void *(*rw_rows_term_fn)(const void *ctx, uint32_t k);
void rw_rows_sum_by(void *dst, int bf16, rw_rows_term_fn term, const void *ctx, uint32_t n,
		    uint32_t hidden, int from_zero);

#endif
