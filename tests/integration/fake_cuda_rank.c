/* tests/integration/fake_cuda_rank.c: the rank kernels (cuda/rank_kernels.cu) on the CPU, joined
 * to the kernel stand-in (fake_cuda_kernels.c hands their names and launches here), so the rank
 * path runs without a GPU. Each runs the production CPU version the host ranks use
 * (rank/host_kernels.c: what cuda/rw_cuda.h "rank kernels" states, the host mover's bytes).
 * Device memory here is host-addressable, so every address a block names is dereferenced as is.
 * A launch copies its block (as the driver does) and runs as stream work: at once, or late and
 * in order with $RW_FAKE_CUDA_LAG_MS. This checks the bytes the contract promises against the
 * host mover's (tests/integration/test_rank_kernels.c), not the GPU code: test/cuda runs that
 * on a GPU. */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "rank/rank.h"
#include "tests/cuda/fake_cuda_base.h"
#include "tests/integration/fake_cuda_rank.h"

enum { K_PACK_INDEX = 1, K_PACK_ROWS, K_FORWARD, K_GATHER, K_REDUCE, K_END };
#define HANDLE_BASE 100 /* fake_cuda_kernels.c's own handles are small numbers */

static const char *const names[K_END] = {
	[K_PACK_INDEX] = "rw_rank_pack_index", [K_PACK_ROWS] = "rw_rank_pack_rows",
	[K_FORWARD] = "rw_rank_forward",       [K_GATHER] = "rw_rank_gather",
	[K_REDUCE] = "rw_rank_reduce",
};

uintptr_t rw_fake_rank_function(const char *name)
{
	for (int k = 1; k < K_END; k++)
		if (strcmp(name, names[k]) == 0)
			return HANDLE_BASE + (uintptr_t)k;
	return 0;
}

int rw_fake_rank_function_of(uintptr_t f)
{
	return f > HANDLE_BASE && f < HANDLE_BASE + K_END;
}

/* A launch as stream work: which kernel, and its block (copied; freed once it ran). */
struct launch {
	int k;
	void *block;
};

static void run(const void *arg)
{
	const struct launch *L = arg;
	/* $RW_FAKE_CUDA_RANK_THREADS: rows split over that many threads, however few (the split
	 * host ranks make for big phases, checked on small ones); unset: this thread alone. */
	const char *v = getenv("RW_FAKE_CUDA_RANK_THREADS");
	const rw_rank_host_par_t par = { v && atoi(v) > 0 ? (uint32_t)atoi(v) : 1, 0 };
	switch (L->k) {
	case K_PACK_INDEX: rw_rank_host_pack_index(L->block); break;
	case K_PACK_ROWS: rw_rank_host_pack_rows(L->block, par); break;
	case K_FORWARD: rw_rank_host_forward(L->block, par); break;
	case K_GATHER: rw_rank_host_gather(L->block, par); break;
	default: rw_rank_host_reduce(L->block, par); break;
	}
	free(L->block);
}

CUresult rw_fake_rank_launch(uintptr_t f, CUstream s, void **params)
{
	static const size_t size[K_END] = {
		[K_PACK_INDEX] = sizeof(rw_cuda_rank_pack_t), [K_PACK_ROWS] = sizeof(rw_cuda_rank_pack_t),
		[K_FORWARD] = sizeof(rw_cuda_rank_forward_t), [K_GATHER] = sizeof(rw_cuda_rank_gather_t),
		[K_REDUCE] = sizeof(rw_cuda_rank_reduce_t),
	};
	struct launch L = { .k = (int)(f - HANDLE_BASE) };
	if (!rw_fake_rank_function_of(f))
		return CUDA_ERROR_INVALID_HANDLE;
	L.block = malloc(size[L.k]);
	if (!L.block)
		return CUDA_ERROR_OUT_OF_MEMORY;
	memcpy(L.block, params[0], size[L.k]);
	rw_fake_cuda_submit(s, run, &L, sizeof(L));
	return CUDA_SUCCESS;
}
#endif /* RW_HAVE_CUDA_H */
