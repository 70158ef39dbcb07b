/* tests/cuda/bench_pack.c: bandwidth of the pack / unpack / combine kernels against a
 * device-to-device cuMemcpy of the same bytes, measured in the same run on the same stream.
 * Bytes counted = bytes read + bytes written (a copy of N bytes moves 2N).
 *   bench_pack [rows]      (default 65536 rows per slab; needs a GPU, exits 77 without one)
 * Each figure is the median of 7 timed batches of 10 launches after 3 warm-up launches; every
 * configuration runs twice so the spread between the two is visible.
 * Then the CUDA mover's own kernels (row lists in pinned host memory, as service/mover/mover_cuda.c
 * launches them), each against the copy engine moving the same bytes the same way: scattered
 * rows device to device against cuMemcpyDtoD, rows into mapped host memory (the slabs on tcp)
 * against cuMemcpyDtoHAsync into the same pinned pages, rows out of mapped host memory against
 * cuMemcpyHtoDAsync, and two-row fp32 sums into mapped host memory (the combine slabs). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/common.h"
#include "cuda/rw_cuda.h"

#define BATCHES 7
#define PER_BATCH 10

typedef rw_status_t (*op_fn)(void *ctx);

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
	qsort(t, BATCHES, sizeof(double), rw_cmp_double);
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
static uint64_t rng(void) { return rw_xorshift64s(&rng_state); }

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

/* ---- the mover's kernels ---- */

struct list_ctx {
	rw_cuda_stream_t *s;
	rw_cuda_dptr_t list, srcs, dev, host; /* host: mapped device address of the host rows */
	uint8_t *host_ptr;
	uint32_t n, hidden, row_bytes, sum;
	size_t bytes;
	int dir; /* copy engine: 0 D2D, 1 D2H, 2 H2D */
};

static rw_status_t do_list(void *p)
{
	struct list_ctx *c = p;
	return c->sum ? rw_cuda_rows_sum(c->s, c->list, c->srcs, c->n, c->hidden, RW_CUDA_BF16, 1)
		      : rw_cuda_copy_rows(c->s, c->list, c->n, c->row_bytes, 1);
}

static rw_status_t do_engine(void *p)
{
	struct list_ctx *c = p;
	if (c->dir == 1)
		return rw_cuda_copy_dtoh_async(c->s, c->host_ptr, c->dev, c->bytes);
	if (c->dir == 2)
		return rw_cuda_copy_htod_async(c->s, c->dev, c->host_ptr, c->bytes);
	return rw_cuda_copy_dtod_async(c->s, c->dev + c->bytes, c->dev, c->bytes);
}

/* One line: the kernel's GB/s (bytes written; reads the same or, for sums, twice) against the
 * copy engine's on the same bytes. */
static int list_line(struct list_ctx *c, const char *what)
{
	for (int rep = 0; rep < 2; rep++) {
		double t_eng = time_op(c->s, do_engine, c), t_k = time_op(c->s, do_list, c);
		if (t_eng <= 0 || t_k <= 0)
			return -1;
		printf("mover %-26s hidden %5u rows %6u %7.1f MiB | copy engine %7.1f GB/s | kernel "
		       "%7.1f GB/s (%.2fx) | run %d\n", what, c->hidden, c->n, c->bytes / 1048576.0,
		       c->bytes / t_eng / 1e9, c->bytes / t_k / 1e9, t_eng / t_k, rep + 1);
	}
	return 0;
}

/* The list for rows i < n: src row perm[i] of `from` to row i of `to` (or the sum of rows
 * perm[i] and perm[(i + 1) % n] of `from`). */
static void fill_list(struct list_ctx *c, const uint32_t *perm, rw_cuda_dptr_t from,
		      rw_cuda_dptr_t to)
{
	rw_cuda_row_copy_t *cl = (rw_cuda_row_copy_t *)(uintptr_t)c->list;
	rw_cuda_row_sum_t *sl = (rw_cuda_row_sum_t *)(uintptr_t)c->list;
	uint64_t *src = (uint64_t *)(uintptr_t)c->srcs;
	for (uint32_t i = 0; i < c->n; i++) {
		rw_cuda_dptr_t a = from + (uint64_t)perm[i] * c->row_bytes, b = to + (uint64_t)i * c->row_bytes;
		if (c->sum) {
			sl[i] = (rw_cuda_row_sum_t){ .dst = b, .first = 2 * i, .count = 2 };
			src[2 * i] = a;
			src[2 * i + 1] = from + (uint64_t)perm[(i + 1) % c->n] * c->row_bytes;
		} else {
			cl[i] = (rw_cuda_row_copy_t){ .src = a, .dst = b };
		}
	}
}

static int bench_mover(rw_cuda_stream_t *s, uint32_t hidden, uint32_t n)
{
	struct list_ctx c = { .s = s, .n = n, .hidden = hidden, .row_bytes = hidden * 2 };
	c.bytes = (size_t)n * c.row_bytes;
	uint32_t *perm = malloc((size_t)n * 4);
	void *list = NULL, *srcs = NULL;
	c.host_ptr = mmap(NULL, c.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (!perm || c.host_ptr == MAP_FAILED || rw_cuda_host_alloc((size_t)n * 16, &list) != RW_OK ||
	    rw_cuda_host_alloc((size_t)n * 16, &srcs) != RW_OK ||
	    rw_cuda_mem_alloc(0, 2 * c.bytes, &c.dev) != RW_OK ||
	    rw_cuda_host_register_mapped(c.host_ptr, c.bytes, &c.host) != RW_OK || fill_random(c.dev, 2 * c.bytes))
		return -1;
	memset(c.host_ptr, 0x11, c.bytes);
	c.list = (rw_cuda_dptr_t)(uintptr_t)list;
	c.srcs = (rw_cuda_dptr_t)(uintptr_t)srcs;
	for (uint32_t i = 0; i < n; i++)
		perm[i] = i;
	for (uint32_t i = n - 1; i > 0; i--) {
		uint32_t j = (uint32_t)(rng() % (i + 1)), t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	int rc = 0;
	c.dir = 0; /* scattered rows between ranks' device buffers (forward, CUDA output) */
	fill_list(&c, perm, c.dev, c.dev + c.bytes);
	rc |= list_line(&c, "copy_rows dev->dev");
	c.dir = 1; /* token rows into the mapped send slabs (dispatch pack on tcp) */
	fill_list(&c, perm, c.dev, c.host);
	rc |= list_line(&c, "copy_rows dev->mapped host");
	c.dir = 2; /* received rows out of the mapped slabs (forward on tcp) */
	fill_list(&c, perm, c.host, c.dev);
	rc |= list_line(&c, "copy_rows mapped host->dev");
	c.dir = 1;
	c.sum = 1; /* combine slabs: two ranks' rows summed into the mapped send slab */
	fill_list(&c, perm, c.dev, c.host);
	rc |= list_line(&c, "rows_sum(2) dev->mapped host");
	rw_cuda_host_unregister(c.host_ptr);
	munmap(c.host_ptr, c.bytes);
	rw_cuda_mem_free(0, c.dev);
	rw_cuda_host_free(list);
	rw_cuda_host_free(srcs);
	free(perm);
	return rc;
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
	rc |= bench_mover(s, 7168, 8192);
	rc |= bench_mover(s, 4096, 8192);
	rw_cuda_stream_destroy(s);
	rw_cuda_shutdown();
	return rc ? 1 : 0;
}
