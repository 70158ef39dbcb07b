/* tests/cuda/bench_pack.c: bandwidth of the pack / unpack / combine kernels against a
 * device-to-device cuMemcpy of the same bytes, measured in the same run on the same stream.
 * Bytes counted = bytes read + bytes written (a copy of N bytes moves 2N).
 *   bench_pack [rows]      (default 65536 rows per slab; needs a GPU, exits 77 without one)
 * Each figure is the median of 7 timed batches of 10 launches after 3 warm-up launches; every
 * configuration runs twice so the spread between the two is visible. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "cuda/rw_cuda.h"

#define BATCHES 7
#define PER_BATCH 10

typedef rw_status_t (*op_fn)(void *ctx);

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* Median seconds per launch of op. */
static double time_op(rw_cuda_stream_t *s, op_fn op, void *ctx)
{
	double t[BATCHES];

	for (int i = 0; i < 3; i++)
		if (op(ctx) != RW_OK)
			return -1;
	if (rw_cuda_stream_sync(s) != RW_OK)
		return -1;
	for (int b = 0; b < BATCHES; b++) {
		uint64_t t0 = rw_now_ns();
		for (int i = 0; i < PER_BATCH; i++)
			op(ctx);
		if (rw_cuda_stream_sync(s) != RW_OK)
			return -1;
		t[b] = (double)(rw_now_ns() - t0) / 1e9 / PER_BATCH;
	}
	qsort(t, BATCHES, sizeof(double), cmp_double);
	return t[BATCHES / 2];
}

struct move_ctx {
	rw_cuda_stream_t *s;
	rw_cuda_dptr_t dst, src, idx;
	uint32_t nrows, row_bytes;
	int gather;
};

static rw_status_t do_move(void *p)
{
	struct move_ctx *c = p;
	return c->gather ? rw_cuda_pack(c->s, c->dst, c->src, c->idx, c->nrows, c->row_bytes)
			 : rw_cuda_unpack(c->s, c->dst, c->src, c->idx, c->nrows, c->row_bytes);
}

static rw_status_t do_copy(void *p)
{
	struct move_ctx *c = p;
	return rw_cuda_copy_dtod_async(c->s, c->dst, c->src, (size_t)c->nrows * c->row_bytes);
}

struct comb_ctx {
	rw_cuda_stream_t *s;
	rw_cuda_dptr_t out, rows, off, ri, w;
	uint32_t hidden, ntok;
};

static rw_status_t do_combine(void *p)
{
	struct comb_ctx *c = p;
	return rw_cuda_combine(c->s, c->out, RW_CUDA_BF16, c->rows, RW_CUDA_BF16, c->hidden, c->ntok,
			       c->off, c->ri, c->w);
}

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint64_t rng(void)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 2685821657736338717ull;
}

/* Fill device memory with random bytes (never time on zeros). */
static int fill_random(rw_cuda_dptr_t d, size_t bytes)
{
	const size_t chunk = 64u << 20;
	uint64_t *buf = malloc(chunk);
	int rc = 0;

	if (!buf)
		return -1;
	for (size_t off = 0; off < bytes && rc == 0; off += chunk) {
		size_t n = RW_MIN(chunk, bytes - off);
		for (size_t i = 0; i < chunk / 8; i++)
			buf[i] = rng() & 0x3fff3fff3fff3fffull; /* finite bf16 values */
		rc = rw_cuda_memcpy_htod(0, d + off, buf, n) == RW_OK ? 0 : -1;
	}
	free(buf);
	return rc;
}

static int bench_rows(rw_cuda_stream_t *s, uint32_t hidden, uint32_t nrows)
{
	const uint32_t row_bytes = hidden * 2; /* bf16 */
	const size_t slab = (size_t)nrows * row_bytes;
	uint32_t *idx = malloc((size_t)nrows * 4);
	struct move_ctx c = { .s = s, .nrows = nrows, .row_bytes = row_bytes };
	rw_cuda_dptr_t src, dst, d_idx;

	if (!idx || rw_cuda_mem_alloc(0, slab, &src) != RW_OK || rw_cuda_mem_alloc(0, slab, &dst) != RW_OK ||
	    rw_cuda_mem_alloc(0, (size_t)nrows * 4, &d_idx) != RW_OK)
		return -1;
	for (uint32_t i = 0; i < nrows; i++) /* a random permutation: scattered rows, all distinct */
		idx[i] = i;
	for (uint32_t i = nrows - 1; i > 0; i--) {
		uint32_t j = (uint32_t)(rng() % (i + 1)), t = idx[i];
		idx[i] = idx[j];
		idx[j] = t;
	}
	if (fill_random(src, slab) || rw_cuda_memcpy_htod(0, d_idx, idx, (size_t)nrows * 4) != RW_OK)
		return -1;
	c.src = src;
	c.dst = dst;
	c.idx = d_idx;
	for (int rep = 0; rep < 2; rep++) {
		double t_copy, t_pack, t_unpack;
		c.gather = 1;
		t_copy = time_op(s, do_copy, &c);
		t_pack = time_op(s, do_move, &c);
		c.gather = 0;
		t_unpack = time_op(s, do_move, &c);
		if (t_copy <= 0 || t_pack <= 0 || t_unpack <= 0)
			return -1;
		printf("hidden %5u bf16  rows %6u  slab %7.1f MiB | memcpy D2D %7.1f GB/s | pack %7.1f GB/s "
		       "(%.2fx memcpy) | unpack %7.1f GB/s (%.2fx) | run %d\n",
		       hidden, nrows, slab / 1048576.0, 2.0 * slab / t_copy / 1e9, 2.0 * slab / t_pack / 1e9,
		       t_copy / t_pack, 2.0 * slab / t_unpack / 1e9, t_copy / t_unpack, rep + 1);
	}
	rw_cuda_mem_free(0, src);
	rw_cuda_mem_free(0, dst);
	rw_cuda_mem_free(0, d_idx);
	free(idx);
	return 0;
}

/* Combine: ntok tokens, topk copies each from a slab of ntok*topk rows (bf16 in, bf16 out). */
static int bench_combine(rw_cuda_stream_t *s, uint32_t hidden, uint32_t ntok, uint32_t topk)
{
	const uint32_t nrows = ntok * topk;
	const size_t row_bytes = (size_t)hidden * 2, rows_bytes = nrows * row_bytes, out_bytes = ntok * row_bytes;
	uint32_t *off = malloc((ntok + 1) * 4u), *ri = malloc(nrows * 4u);
	float *w = malloc(nrows * 4u);
	struct comb_ctx c = { .s = s, .hidden = hidden, .ntok = ntok };
	struct move_ctx cp = { .s = s };
	double moved = (double)rows_bytes + 2.0 * out_bytes;

	if (!off || !ri || !w)
		return -1;
	for (uint32_t t = 0; t <= ntok; t++)
		off[t] = t * topk;
	for (uint32_t j = 0; j < nrows; j++) {
		ri[j] = (uint32_t)(rng() % nrows);
		w[j] = 1.0f / (float)topk;
	}
	if (rw_cuda_mem_alloc(0, rows_bytes, &c.rows) != RW_OK || rw_cuda_mem_alloc(0, out_bytes, &c.out) != RW_OK ||
	    rw_cuda_mem_alloc(0, (ntok + 1) * 4u, &c.off) != RW_OK || rw_cuda_mem_alloc(0, nrows * 4u, &c.ri) != RW_OK ||
	    rw_cuda_mem_alloc(0, nrows * 4u, &c.w) != RW_OK)
		return -1;
	if (fill_random(c.rows, rows_bytes) || fill_random(c.out, out_bytes) ||
	    rw_cuda_memcpy_htod(0, c.off, off, (ntok + 1) * 4u) != RW_OK ||
	    rw_cuda_memcpy_htod(0, c.ri, ri, nrows * 4u) != RW_OK || rw_cuda_memcpy_htod(0, c.w, w, nrows * 4u) != RW_OK)
		return -1;
	/* baseline: a copy moving the same total bytes (moved/2 read + moved/2 written) */
	cp.src = c.rows;
	cp.dst = c.rows + rows_bytes / 2;
	cp.nrows = 1;
	cp.row_bytes = (uint32_t)RW_MIN(moved / 2, rows_bytes / 2);
	for (int rep = 0; rep < 2; rep++) {
		double t_copy = time_op(s, do_copy, &cp), t_comb = time_op(s, do_combine, &c);
		if (t_copy <= 0 || t_comb <= 0)
			return -1;
		printf("combine hidden %u bf16->bf16 tokens %u top-%u | memcpy D2D %7.1f GB/s | combine %7.1f GB/s "
		       "(%.2fx memcpy) %.3f ms | run %d\n", hidden, ntok, topk,
		       2.0 * cp.row_bytes / t_copy / 1e9, moved / t_comb / 1e9,
		       (moved / t_comb) / (2.0 * cp.row_bytes / t_copy), t_comb * 1e3, rep + 1);
	}
	rw_cuda_mem_free(0, c.rows);
	rw_cuda_mem_free(0, c.out);
	rw_cuda_mem_free(0, c.off);
	rw_cuda_mem_free(0, c.ri);
	rw_cuda_mem_free(0, c.w);
	free(off);
	free(ri);
	free(w);
	return 0;
}

int main(int argc, char **argv)
{
	uint32_t nrows = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 0) : 65536;
	rw_cuda_stream_t *s;
	char name[128] = "";
	int rc = 0;

	if (rw_cuda_init() != RW_OK) {
		printf("bench_pack: skipped: %s\n", rw_cuda_unavailable_reason());
		return 77;
	}
	if (!rw_cuda_kernels_available(0)) {
		printf("bench_pack: skipped: kernels not built\n");
		return 77;
	}
	rw_cuda_device_name(0, name, sizeof(name));
	printf("device: %s\n", name);
	if (rw_cuda_stream_create(0, &s) != RW_OK)
		return 1;
	rc |= bench_rows(s, 7168, nrows);
	rc |= bench_rows(s, 4096, nrows);
	rc |= bench_rows(s, 4096, nrows / 16); /* 32 MiB slab: launch and L2 effects show */
	rc |= bench_combine(s, 7168, 8192, 8);
	rc |= bench_combine(s, 4096, 8192, 8);
	rw_cuda_stream_destroy(s);
	rw_cuda_shutdown();
	return rc ? 1 : 0;
}
