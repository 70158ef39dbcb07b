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

/* Launch rank kernel `f` (a handle from rw_fake_rank_function) on stream s: its argument block
 * (params[0], as the driver copies it at the call) runs on the CPU as stream work. */
CUresult rw_fake_rank_launch(uintptr_t f, CUstream s, void **params);

#endif /* RW_FAKE_CUDA_RANK_H */
