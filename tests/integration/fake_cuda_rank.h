/* tests/integration/fake_cuda_rank.h: how the kernel stand-in (fake_cuda_kernels.c) hands the
 * rank kernels (cuda/rank_kernels.cu) to their CPU stand-ins (fake_cuda_rank.c). */
#ifndef RW_FAKE_CUDA_RANK_H
#define RW_FAKE_CUDA_RANK_H

#include <stdint.h>

#include <cuda.h>

/* The function handle of rank kernel `name` (cuModuleGetFunction's answer), 0 if it is none. */
uintptr_t rw_fake_rank_function(const char *name);

/* 1 if `f` is a rank kernel's handle. */
int rw_fake_rank_function_of(uintptr_t f);

/* Launch rank kernel `f` (a handle from rw_fake_rank_function) on stream s over a grid of
 * `grid` blocks: its argument block (params[0], as the driver copies it at the call) runs on the
 * CPU as stream work, the data kernels (pack rows, forward, gather, reduce) block by block,
 * each block its grid-stride items as rank_kernels.cu's loops, so a result that depended on the
 * grid would show; pack index (one block) and rw_rank_ctl run whole. */
CUresult rw_fake_rank_launch(uintptr_t f, CUstream s, unsigned grid, void **params);

/* The largest grid (blocks, gx * gy * gz) of any kernel this process launched since the last
 * call, then 0 again: exported by libfakecuda_kern.so for tests (dlsym), which check that an SM
 * budget bounded every launch. */
unsigned long long rw_fake_cuda_grid_take(void);

#endif /* RW_FAKE_CUDA_RANK_H */
