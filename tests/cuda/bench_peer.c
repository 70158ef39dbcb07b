/* tests/cuda/bench_peer.c: the CUDA mover's list kernels across GPUs (docs/perf/runs/multigpu.md)
 * against a plain peer copy of the same bytes in the same run. Needs two or more GPUs with peer
 * access between them; exits 77 (and says why) otherwise.
 *   bench_peer [MiB]      bytes per move (default 256), rows of 7168 bf16 (DeepSeek-V3's hidden)
 * For every ordered pair of devices (a, b), with peer access enabled both ways first
 * (cuCtxEnablePeerAccess, from the libcuda.so.1 cuda/ loaded: cuda/ itself has no call for it):
 *   peer copy   cuMemcpyDtoDAsync b <- a on b's stream: the copy engines over the link
 *   fwd pull    rw_cuda_copy_rows on b, rows of a -> b: the mover's forward of a local record whose
 *               token lives on another rank's GPU
 *   fwd push    rw_cuda_copy_rows on a, rows of a -> b
 *   sum pull    rw_cuda_rows_sum on b, out_b = row_a + row_b (fp32 sum, bf16 out): a combine row
 *               two local ranks on different GPUs computed
 *   local d2d   cuMemcpyDtoDAsync b <- b (what one GPU's memory does)
 * GB/s counts the bytes that crossed the link once (peer copy, fwd: the moved bytes; sum pull:
 * the peer rows read), ratio = that / peer copy. Best of 5 batches of 5 launches after a warm-up.
 * Every result is checked (first and last rows) before its figure is printed. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "cuda/rw_cuda.h"

#define HIDDEN 7168
#define ROW (HIDDEN * 2)
#define BATCHES 5
#define PER_BATCH 5

/* The few driver entry points cuda/ does not wrap, from the same library (CUresult is an int). */
static struct {
	int (*ctx_get)(void **ctx);
	int (*can_peer)(int *can, int dev, int peer);
	int (*enable_peer)(void *peer_ctx, unsigned flags);
} drv;

static int drv_load(void)
{
	const char *path = getenv("RW_CUDA_DRIVER");
	void *h = dlopen(path ? path : "libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (!h)
		return -1;
	*(void **)&drv.ctx_get = dlsym(h, "cuCtxGetCurrent");
	*(void **)&drv.can_peer = dlsym(h, "cuDeviceCanAccessPeer");
	*(void **)&drv.enable_peer = dlsym(h, "cuCtxEnablePeerAccess");
	return drv.ctx_get && drv.can_peer && drv.enable_peer ? 0 : -1;
}

/* Device d's primary context (the one cuda/ retained and makes current in every call). */
static void *dev_ctx(int d)
{
	void *ctx = NULL;
	rw_cuda_stream_t *s;
	if (rw_cuda_stream_create(d, &s) != RW_OK) /* leaves d's context current */
		return NULL;
	drv.ctx_get(&ctx);
	rw_cuda_stream_destroy(s);
	return ctx;
}

struct dev {
	rw_cuda_stream_t *s;
	rw_cuda_dptr_t a, b;       /* two buffers of `bytes` */
};

struct job {
	int kind;                  /* 0 copy engine, 1 copy_rows, 2 rows_sum */
	rw_cuda_stream_t *s;
	rw_cuda_dptr_t dst, src, list, srcs;
	uint32_t n;
	size_t bytes;
};

static rw_status_t job_run(const struct job *j)
{
	if (j->kind == 0)
		return rw_cuda_copy_dtod_async(j->s, j->dst, j->src, j->bytes);
	if (j->kind == 1)
		return rw_cuda_copy_rows(j->s, j->list, j->n, ROW, 1);
	return rw_cuda_rows_sum(j->s, j->list, j->srcs, j->n, HIDDEN, RW_CUDA_BF16, 1);
}

/* Best seconds per launch. */
static double job_time(const struct job *j)
{
	double best = 1e30;
	if (job_run(j) != RW_OK || rw_cuda_stream_sync(j->s) != RW_OK)
		return -1;
	for (int b = 0; b < BATCHES; b++) {
		uint64_t t0 = rw_now_ns();
		for (int i = 0; i < PER_BATCH; i++)
			job_run(j);
		if (rw_cuda_stream_sync(j->s) != RW_OK)
			return -1;
		double t = (double)(rw_now_ns() - t0) / 1e9 / PER_BATCH;
		best = t < best ? t : best;
	}
	return best;
}

/* Rows 0 and n-1 of dst on device d hold `want` in every element (bf16 bits). */
static int rows_are(int d, rw_cuda_dptr_t dst, uint32_t n, uint16_t want)
{
	static uint16_t row[HIDDEN];
	for (int k = 0; k < 2; k++) {
		uint64_t at = dst + (uint64_t)(k ? n - 1 : 0) * ROW;
		if (rw_cuda_memcpy_dtoh(d, row, at, ROW) != RW_OK)
			return 0;
		for (int h = 0; h < HIDDEN; h++)
			if (row[h] != want)
				return 0;
	}
	return 1;
}

static int fill(int d, rw_cuda_dptr_t p, size_t bytes, uint16_t v)
{
	static uint16_t row[HIDDEN];
	for (int h = 0; h < HIDDEN; h++)
		row[h] = v;
	for (size_t off = 0; off + ROW <= bytes; off += ROW)
		if (rw_cuda_memcpy_htod(d, p + off, row, ROW) != RW_OK)
			return -1;
	return 0;
}

enum { ONE = 0x3f80, TWO = 0x4000 }; /* bf16 1 and 2 */

int main(int argc, char **argv)
{
	size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 256;
	if (rw_cuda_init() != RW_OK) {
		printf("skip: no CUDA: %s\n", rw_cuda_unavailable_reason());
		return 77;
	}
	int nd = rw_cuda_device_count();
	if (nd < 2) {
		printf("skip: %d GPU visible; the cross-GPU kernels need 2 or more\n", nd);
		return 77;
	}
	if (!rw_cuda_kernels_available(0)) {
		printf("skip: this build embeds no kernels (no nvcc)\n");
		return 77;
	}
	if (drv_load() != 0) {
		printf("FAIL: the driver lacks cuCtxGetCurrent / cuDeviceCanAccessPeer / cuCtxEnablePeerAccess\n");
		return 1;
	}
	const uint32_t n = (uint32_t)((mib << 20) / ROW);
	const size_t bytes = (size_t)n * ROW;
	struct dev *dv = calloc((size_t)nd, sizeof(*dv));
	void **ctx = calloc((size_t)nd, sizeof(*ctx));
	rw_cuda_row_copy_t *cl;
	rw_cuda_row_sum_t *sl;
	uint64_t *srcs;
	if (!dv || !ctx || rw_cuda_host_alloc((size_t)n * sizeof(*cl), (void **)&cl) != RW_OK ||
	    rw_cuda_host_alloc((size_t)n * sizeof(*sl), (void **)&sl) != RW_OK ||
	    rw_cuda_host_alloc((size_t)n * 2 * sizeof(*srcs), (void **)&srcs) != RW_OK) {
		printf("FAIL: out of pinned memory\n");
		return 1;
	}
	for (int d = 0; d < nd; d++) {
		ctx[d] = dev_ctx(d);
		if (!ctx[d] || rw_cuda_stream_create(d, &dv[d].s) != RW_OK ||
		    rw_cuda_mem_alloc(d, bytes, &dv[d].a) != RW_OK ||
		    rw_cuda_mem_alloc(d, bytes, &dv[d].b) != RW_OK || fill(d, dv[d].a, bytes, ONE) != 0) {
			printf("FAIL: cannot set up GPU %d (%zu MiB x 2)\n", d, bytes >> 20);
			return 1;
		}
	}
	int peers = 0;
	for (int a = 0; a < nd; a++)
		for (int b = 0; b < nd; b++) {
			int can = 0;
			if (a == b || drv.can_peer(&can, a, b) != 0 || !can)
				continue;
			rw_cuda_memset_d8(a, dv[a].b, 0, 1); /* a's context current */
			int r = drv.enable_peer(ctx[b], 0);
			peers += r == 0 || r == 704; /* CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED */
		}
	if (!peers) {
		printf("skip: no two of the %d GPUs can access each other's memory\n", nd);
		return 77;
	}
	char name[64] = "";
	rw_cuda_device_name(0, name, sizeof(name));
	printf("== %d x %s, %zu MiB per move (%u rows of %d bf16), GB/s of bytes over the link, "
	       "best of %d x %d\n", nd, name, bytes >> 20, n, HIDDEN, BATCHES, PER_BATCH);
	printf("%-7s %10s %10s %6s %10s %6s %10s %6s %10s\n", "a->b", "peer copy", "fwd pull", "x",
	       "fwd push", "x", "sum pull", "x", "local d2d");
	int bad = 0;
	for (int a = 0; a < nd; a++)
		for (int b = 0; b < nd; b++) {
			int can = 0;
			if (a == b || drv.can_peer(&can, a, b) != 0 || !can)
				continue;
			for (uint32_t i = 0; i < n; i++) {
				cl[i] = (rw_cuda_row_copy_t){ .src = dv[a].a + (uint64_t)i * ROW,
							      .dst = dv[b].b + (uint64_t)i * ROW };
				sl[i] = (rw_cuda_row_sum_t){ .dst = dv[b].b + (uint64_t)i * ROW,
							     .first = 2 * i, .count = 2 };
				srcs[2 * i] = dv[a].a + (uint64_t)i * ROW;
				srcs[2 * i + 1] = dv[b].a + (uint64_t)i * ROW;
			}
			struct job jobs[5] = {
				{ .kind = 0, .s = dv[b].s, .dst = dv[b].b, .src = dv[a].a, .bytes = bytes },
				{ .kind = 1, .s = dv[b].s, .list = (uintptr_t)cl, .n = n },
				{ .kind = 1, .s = dv[a].s, .list = (uintptr_t)cl, .n = n },
				{ .kind = 2, .s = dv[b].s, .list = (uintptr_t)sl, .srcs = (uintptr_t)srcs, .n = n },
				{ .kind = 0, .s = dv[b].s, .dst = dv[b].b, .src = dv[b].a, .bytes = bytes },
			};
			const uint16_t want[5] = { ONE, ONE, ONE, TWO, ONE }; /* sum: a's 1 + b's 1 */
			double gbs[5];
			for (int k = 0; k < 5; k++) {
				rw_cuda_memset_d8(b, dv[b].b, 0, bytes);
				double t = job_time(&jobs[k]);
				if (t <= 0 || !rows_are(b, dv[b].b, n, want[k])) {
					printf("FAIL: %d->%d measure %d: launch failed or wrong result\n", a, b, k);
					bad = 1;
					gbs[k] = 0;
					continue;
				}
				gbs[k] = bytes / t / 1e9;
			}
			printf("%d->%-4d %10.1f %10.1f %6.2f %10.1f %6.2f %10.1f %6.2f %10.1f\n", a, b,
			       gbs[0], gbs[1], gbs[1] / gbs[0], gbs[2], gbs[2] / gbs[0], gbs[3],
			       gbs[3] / gbs[0], gbs[4]);
		}
	return bad;
}
