/* cuda/kernels_none.c: a kernel image of a build without nvcc: empty, so
 * rw_cuda_kernels_available() (and, compiled with RW_RANK_IMAGE for the second image,
 * rw_cuda_rank_kernels_available()) report 0 and callers take their host paths. */
#include <stddef.h>

#ifdef RW_RANK_IMAGE
#define RW_IMAGE rw_cuda_rank_fatbin
#define RW_IMAGE_LEN rw_cuda_rank_fatbin_len
#else
#define RW_IMAGE rw_cuda_kernels_fatbin
#define RW_IMAGE_LEN rw_cuda_kernels_fatbin_len
#endif

extern const unsigned char RW_IMAGE[];
extern const size_t RW_IMAGE_LEN;
const unsigned char RW_IMAGE[1] = { 0 };
const size_t RW_IMAGE_LEN = 0;
