/* cuda/kernels_none.c: the kernel image of a build without nvcc: empty, so
 * rw_cuda_kernels_available() reports 0 and callers take their host paths. */
#include <stddef.h>

extern const unsigned char rw_cuda_kernels_fatbin[];
extern const size_t rw_cuda_kernels_fatbin_len;
const unsigned char rw_cuda_kernels_fatbin[1] = { 0 };
const size_t rw_cuda_kernels_fatbin_len = 0;
