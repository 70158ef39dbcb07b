/* tests/integration/fake_cuda_kernels.c: the module API for the stand-in libcuda.so.1 of
 * fake_cuda_ipc.c, linked into a second stand-in (libfakecuda_kern.so) so the CUDA data mover
 * (service/mover/mover_cuda.c) runs its whole control path — accepting pairs, staging ids, the
 * count row, row lists, marks, host-memory ranks' staging — on machines without a GPU. The mover's
 * kernels run at once on the calling thread, on the CPU, with the arithmetic cuda/kernels.cu states
 * (fp32 adds in list order, bf16 rounded to nearest even with NaN kept quiet; the count row's
 * distinct nodes per token, -1 skipped, a bad id flagged): this checks the mover's bookkeeping, not
 * the GPU code (the GPU test, tests/integration/test_cuda_mover.py, checks that). Device memory
 * here is host-addressable, so every address the lists name is dereferenced as is. Launches and
 * memsets are stream work: at once, or late and in order with $RW_FAKE_CUDA_LAG_MS. Only the
 * mover's kernels exist; the index-based pack/unpack/combine are refused. The rank kernels
 * (cuda/rank_kernels.cu) are fake_cuda_rank.c's: their names and launches are handed over. The
 * module image is not looked at. rw_fake_cuda_grid_take (fake_cuda_rank.h) tells the largest grid
 * launched, so a test can check a budget of blocks was kept. */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include <cuda.h>

#include "common/bf16.h"
#include "cuda/rw_cuda.h"
#include "tests/cuda/fake_cuda_base.h"
#include "tests/integration/fake_cuda_rank.h"

static const char *const names[] = { "rw_copy_rows16", "rw_copy_rows1", "rw_rows_acc",
				     "rw_rows_sum", "rw_store_f32", "rw_route_count" };
static int module_obj;

CUresult CUDAAPI cuModuleLoadData(CUmodule *m, const void *image)
{
	(void)image;
	*m = (CUmodule)&module_obj;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleUnload(CUmodule m) { (void)m; return CUDA_SUCCESS; }

CUresult CUDAAPI cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
	(void)m;
	if ((*f = (CUfunction)rw_fake_rank_function(name)) != NULL)
		return CUDA_SUCCESS; /* a rank kernel (fake_cuda_rank.c) */
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (strcmp(name, names[i]) == 0) {
			*f = (CUfunction)(uintptr_t)(i + 1);
			return CUDA_SUCCESS;
		}
	*f = (CUfunction)(uintptr_t)1000; /* present, but launching it is refused */
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s)
{
	rw_fake_cuda_fill(s, (void *)(uintptr_t)d, v, n);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostGetDevicePointer(CUdeviceptr *d, void *p, unsigned int f)
{
	(void)f;
	*d = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

struct row_copy { uint64_t src, dst; };
struct row_sum { uint64_t dst; uint32_t first, count; };

static float elem(uint64_t row, uint32_t h, int bf16)
{
	float f;
	if (bf16) {
		uint16_t v;
		memcpy(&v, (const void *)(uintptr_t)(row + 2ull * h), 2);
		f = rw_bf16_to_f32(v);
	} else {
		memcpy(&f, (const void *)(uintptr_t)(row + 4ull * h), 4);
	}
	return f;
}


#define ARG(i, type) (*(type *)params[i])

/* A launch's arguments, read when it is submitted (as the driver does). rw_route_count: a0 ids,
 * a1 row, n64 bad, n tokens, w topk, bf16 n_experts, and the three below. A larger struct would
 * not fit a lagging stream's queue entry and would run at once, out of stream order. */
struct launch {
	uintptr_t k;
	uint64_t a0, a1, n64;
	uint32_t n, w, bf16;
	uint32_t per_node, rails, rail;
};
_Static_assert(sizeof(struct launch) <= 64, "a launch must fit a stream queue entry");

/* rw_route_count as cuda/kernels.cu states it: the host ranks' count (cuda/rank_cpu.c). */
static void route_count_run(const struct launch *L)
{
	rw_cuda_cpu_count((const int32_t *)(uintptr_t)L->a0, L->n, L->w, L->bf16,
			   L->bf16 / L->per_node, L->rails, L->rail, (uint32_t *)(uintptr_t)L->a1,
			   (uint32_t *)(uintptr_t)L->n64);
}

static void launch_run(const void *arg)
{
	const struct launch *L = arg;
	uintptr_t k = L->k;
	if (k == 6) {
		route_count_run(L);
		return;
	}
	if (k == 1 || k == 2) { /* rw_copy_rows16 (16-byte units) / rw_copy_rows1 (bytes) */
		const struct row_copy *l = (const struct row_copy *)(uintptr_t)L->a0;
		uint32_t n = L->n;
		size_t len = (size_t)L->w * (k == 1 ? 16 : 1);
		/* Last entry first: a GPU promises no order among a launch's entries, and a list
		 * naming one destination twice must not pass here by luck of order. */
		for (uint32_t e = n; e-- > 0;)
			memmove((void *)(uintptr_t)l[e].dst, (const void *)(uintptr_t)l[e].src, len);
		return;
	}
	if (k == 3 || k == 4) { /* rw_rows_acc / rw_rows_sum */
		const struct row_sum *l = (const struct row_sum *)(uintptr_t)L->a0;
		const uint64_t *src = (const uint64_t *)(uintptr_t)L->a1;
		uint32_t n = L->n, hidden = L->w;
		int bf16 = L->bf16 != 0;
		for (uint32_t e = 0; e < n; e++) {
			uint8_t *dst = (uint8_t *)(uintptr_t)l[e].dst;
			if (k == 4 && l[e].count == 1) {
				memmove(dst, (const void *)(uintptr_t)src[l[e].first], (size_t)hidden * (bf16 ? 2 : 4));
				continue;
			}
			for (uint32_t h = 0; h < hidden; h++) {
				float acc;
				uint32_t j = 0;
				if (k == 3) {
					memcpy(&acc, dst + 4ull * h, 4);
				} else {
					acc = elem(src[l[e].first], h, bf16);
					j = 1;
				}
				for (; j < l[e].count; j++)
					acc += elem(src[l[e].first + j], h, bf16);
				if (k == 3 || !bf16) {
					memcpy(dst + 4ull * h, &acc, 4);
				} else {
					uint16_t v = rw_bf16_from_f32(acc);
					memcpy(dst + 2ull * h, &v, 2);
				}
			}
		}
		return;
	}
	/* rw_store_f32 */
	uint8_t *dst = (uint8_t *)(uintptr_t)L->a0;
	const float *src = (const float *)(uintptr_t)L->a1;
	for (uint64_t i = 0; i < L->n64; i++) {
		if (L->bf16) {
			uint16_t v = rw_bf16_from_f32(src[i]);
			memcpy(dst + 2 * i, &v, 2);
		} else {
			memcpy(dst + 4 * i, &src[i], 4);
		}
	}
}

/* The largest grid (blocks) launched since the last rw_fake_cuda_grid_take. */
static _Atomic unsigned long long grid_max;

unsigned long long rw_fake_cuda_grid_take(void)
{
	return atomic_exchange(&grid_max, 0);
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
				unsigned by, unsigned bz, unsigned shared, CUstream s, void **params,
				void **extra)
{
	(void)bx, (void)by, (void)bz, (void)shared, (void)s, (void)extra;
	rw_fake_cuda_count(RW_FAKE_N_KERNEL);
	const unsigned long long grid = (unsigned long long)gx * gy * gz;
	for (unsigned long long m = atomic_load(&grid_max); grid > m;)
		if (atomic_compare_exchange_weak(&grid_max, &m, grid))
			break;
	if (grid == 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (rw_fake_rank_function_of((uintptr_t)f))
		return rw_fake_rank_launch((uintptr_t)f, s, gx, params);
	struct launch L = { .k = (uintptr_t)f, .a0 = ARG(0, CUdeviceptr) };
	if (L.k == 1 || L.k == 2) {
		L.n = ARG(1, uint32_t);
		L.w = ARG(2, uint32_t);
	} else if (L.k == 3 || L.k == 4) {
		L.a1 = ARG(1, CUdeviceptr);
		L.n = ARG(2, uint32_t);
		L.w = ARG(3, uint32_t);
		L.bf16 = ARG(4, uint32_t);
	} else if (L.k == 5) {
		L.a1 = ARG(1, CUdeviceptr);
		L.n64 = ARG(2, uint64_t);
		L.bf16 = ARG(3, uint32_t);
	} else if (L.k == 6) { /* ids, n_tokens, topk, n_experts, per_node, rails, rail, row, bad */
		L.n = ARG(1, uint32_t);
		L.w = ARG(2, uint32_t);
		L.bf16 = ARG(3, uint32_t);
		L.per_node = ARG(4, uint32_t);
		L.rails = ARG(5, uint32_t);
		L.rail = ARG(6, uint32_t);
		L.a1 = ARG(7, CUdeviceptr);
		L.n64 = ARG(8, CUdeviceptr);
	} else {
		return CUDA_ERROR_NOT_SUPPORTED;
	}
	rw_fake_cuda_submit(s, launch_run, &L, sizeof(L));
	return CUDA_SUCCESS;
}
#endif /* RW_HAVE_CUDA_H */
