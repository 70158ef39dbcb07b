/* common/rows.c: rows of bf16 or fp32 elements summed in fp32 (common/bf16.h "Rows"), one
 * implementation for the daemon's combine (service/phase/forward.c) and the rank kernels' CPU
 * versions (cuda/rank_cpu.c), so both give the same bits. */
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "common/bf16.h"

/* The row loops below run in blocks of ROW_BLOCK elements with a fixed trip count, which the
 * compiler turns into vector code at -O2, then a scalar tail. Rows are hidden × 2 or 4 bytes
 * and may sit at any alignment inside a record, so every access goes through memcpy. */
#define ROW_BLOCK 16u

static inline float bf16_at(const uint8_t *p, size_t i)
{
	uint16_t v;
	memcpy(&v, p + 2 * i, 2);
	return rw_bf16_to_f32(v);
}

static inline float f32_at(const uint8_t *p, size_t i)
{
	float v;
	memcpy(&v, p + 4 * i, 4);
	return v;
}

/* One block of a row into v[] (fp32), through a local copy so the compiler need not prove
 * that the row and the sums do not overlap. */
static inline void block_in(float v[ROW_BLOCK], const uint8_t *p, int bf16, size_t i)
{
	if (bf16) {
		uint16_t b[ROW_BLOCK];
		memcpy(b, p + 2 * i, sizeof(b));
		for (size_t j = 0; j < ROW_BLOCK; j++)
			v[j] = rw_bf16_to_f32(b[j]);
	} else {
		memcpy(v, p + 4 * i, 4 * ROW_BLOCK);
	}
}

static inline float elem_in(const uint8_t *p, int bf16, size_t i)
{
	return bf16 ? bf16_at(p, i) : f32_at(p, i);
}

enum { ROW_SET, ROW_ADD, ROW_ZERO_ADD };

/* acc = row (ROW_SET), acc += row (ROW_ADD) or acc = +0 + row (ROW_ZERO_ADD: a -0 element
 * becomes +0, as adding it to a zeroed sum does; compilers keep the addition unless told that
 * signed zeros do not matter); inlined with a constant `op`, so each vectorizes. */
static inline float row_op(float a, float v, int op)
{
	return op == ROW_ADD ? a + v : op == ROW_ZERO_ADD ? 0.0f + v : v;
}

static inline void row_in(float *acc, const uint8_t *p, int bf16, uint32_t hidden, int op)
{
	size_t i = 0;
	for (; i + ROW_BLOCK <= hidden; i += ROW_BLOCK) {
		float v[ROW_BLOCK];
		block_in(v, p, bf16, i);
		for (size_t j = 0; j < ROW_BLOCK; j++)
			acc[i + j] = row_op(acc[i + j], v[j], op);
	}
	for (; i < hidden; i++)
		acc[i] = row_op(acc[i], elem_in(p, bf16, i), op);
}

void rw_row_acc(float *acc, const void *row, int bf16, uint32_t hidden)
{
	row_in(acc, row, bf16, hidden, ROW_ADD);
}

void rw_row_load(float *acc, const void *row, int bf16, uint32_t hidden)
{
	row_in(acc, row, bf16, hidden, ROW_SET);
}

#ifdef __SSE2__
/* rw_bf16_round_bits on four lanes, the result sign-extended from its 16 bits: the compilers'
 * own vector code narrows 32 to 16 bits with shuffles and ran at a third of this speed (a
 * combine's stores were a quarter of the daemon's CPU, docs/perf/shm.md). Rounding to nearest
 * even adds 0x7fff plus the kept part's lowest bit; a NaN keeps its bits with the quiet bit
 * set; the high half is taken with an arithmetic shift, so the signed pack below keeps it. */
static inline __m128i bf16_round4(__m128i u)
{
	const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
	const __m128i rounded = _mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb);
	const __m128i quiet = _mm_or_si128(u, _mm_set1_epi32(0x400000));
	const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)),
					    _mm_set1_epi32(0x7f800000));
	const __m128i t = _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded));
	return _mm_srai_epi32(t, 16);
}
#endif

void rw_row_store(void *dst, int bf16, const float *acc, uint32_t hidden)
{
	uint8_t *p = dst;
	if (!bf16) {
		memcpy(p, acc, (size_t)hidden * 4);
		return;
	}
	size_t i = 0;
#ifdef __SSE2__
	for (; i + 8 <= hidden; i += 8) {
		__m128i lo = _mm_loadu_si128((const __m128i *)(const void *)(acc + i));
		__m128i hi = _mm_loadu_si128((const __m128i *)(const void *)(acc + i + 4));
		_mm_storeu_si128((__m128i *)(void *)(p + 2 * i),
				 _mm_packs_epi32(bf16_round4(lo), bf16_round4(hi)));
	}
#endif
	for (; i + ROW_BLOCK <= hidden; i += ROW_BLOCK) {
		uint16_t v[ROW_BLOCK];
		for (size_t j = 0; j < ROW_BLOCK; j++) {
			uint32_t u;
			memcpy(&u, &acc[i + j], 4);
			v[j] = rw_bf16_round_bits(u);
		}
		memcpy(p + 2 * i, v, sizeof(v));
	}
	for (; i < hidden; i++) {
		uint16_t v = rw_bf16_from_f32(acc[i]);
		memcpy(p + 2 * i, &v, 2);
	}
}

/* Elements per block of rw_rows_sum: its fp32 sums (2 KiB) stay in the L1 cache while
 * every term's block is added, so a token costs one read of each term and one write of its
 * row; the sums of the whole phase never exist in memory. */
#define REDUCE_BLOCK 512u

void rw_rows_sum_by(void *dst, int bf16, rw_rows_term_fn term, const void *ctx, uint32_t n,
		    uint32_t hidden, int from_zero)
{
	const size_t esz = bf16 ? 2 : 4;
	uint8_t *out = dst;
	if (n == 0) {
		memset(out, 0, hidden * esz);
		return;
	}
	if (n == 1 && !from_zero) { /* one term, copied as it is */
		memcpy(out, term(ctx, 0), hidden * esz);
		return;
	}
	float acc[REDUCE_BLOCK];
	for (uint32_t i = 0; i < hidden; i += REDUCE_BLOCK) {
		const uint32_t m = hidden - i < REDUCE_BLOCK ? hidden - i : REDUCE_BLOCK;
		const uint8_t *first = (const uint8_t *)term(ctx, 0) + i * esz;
		if (from_zero)
			row_in(acc, first, bf16, m, ROW_ZERO_ADD);
		else
			row_in(acc, first, bf16, m, ROW_SET);
		for (uint32_t k = 1; k < n; k++)
			row_in(acc, (const uint8_t *)term(ctx, k) + i * esz, bf16, m, ROW_ADD);
		rw_row_store(out + i * esz, bf16, acc, m);
	}
}

static const void *array_term(const void *ctx, uint32_t k)
{
	return ((const void *const *)ctx)[k];
}

void rw_rows_sum(void *dst, int bf16, const void *const *rows, uint32_t n, uint32_t hidden,
		 int from_zero)
{
	rw_rows_sum_by(dst, bf16, array_term, rows, n, hidden, from_zero);
}
