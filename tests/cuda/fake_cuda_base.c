/* tests/cuda/fake_cuda_base.c: the driver entry points both stand-in libcuda.so.1 builds answer
 * the same way (tests/cuda/fake_libcuda.c, in-process IPC; tests/integration/fake_cuda_ipc.c,
 * cross-process IPC): devices ($RW_FAKE_CUDA_DEVICES, default 1) with fixed names and UUIDs, a
 * refcounted primary context, and copies, since "device memory" is host-addressable in both.
 * What differs between them (allocation, IPC handles, pointer lookup, streams) stays in each. */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

static int ctx_refs;

/* Test hook (found with dlsym): primary-context retains not yet released. */
int rw_fake_cuda_ctx_refs(void);
int rw_fake_cuda_ctx_refs(void) { return ctx_refs; }

CUresult CUDAAPI cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDriverGetVersion(int *v) { *v = CUDA_VERSION; return CUDA_SUCCESS; }
CUresult CUDAAPI cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake error"; return CUDA_SUCCESS; }
CUresult CUDAAPI cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_ERROR_FAKE"; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetCount(int *n)
{
	const char *e = getenv("RW_FAKE_CUDA_DEVICES");
	*n = e ? atoi(e) : 1;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGet(CUdevice *d, int ord) { *d = ord; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice d)
{
	(void)d;
	strncpy(name, "RailWave fake GPU", (size_t)len);
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
	for (int i = 0; i < 16; i++)
		u->bytes[i] = (char)(0xA0 + i + d);
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d)
{
	(void)a; (void)d;
	*v = 0; /* no dmabuf, nothing else asked */
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
	(void)d;
	ctx_refs++;
	*c = (CUcontext)&ctx_refs;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; ctx_refs--; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext c) { (void)c; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *c) { *c = NULL; return CUDA_SUCCESS; }

/* Copies run at once, also the "async" ones (the stream's ordering is trivially kept). */
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr d, const void *s, size_t n) { memcpy((void *)(uintptr_t)d, s, n); return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n) { memcpy(d, (const void *)(uintptr_t)s, n); return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n) { memset((void *)(uintptr_t)d, v, n); return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemHostAlloc(void **p, size_t n, unsigned int f) { (void)f; *p = malloc(n); return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY; }
CUresult CUDAAPI cuMemFreeHost(void *p) { free(p); return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemHostRegister(void *p, size_t n, unsigned int f) { (void)p; (void)n; (void)f; return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemHostUnregister(void *p) { (void)p; return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr d, const void *s, size_t n, CUstream st) { (void)st; return cuMemcpyHtoD(d, s, n); }
CUresult CUDAAPI cuMemcpyDtoHAsync(void *d, CUdeviceptr s, size_t n, CUstream st) { (void)st; return cuMemcpyDtoH(d, s, n); }
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
	(void)st;
	memmove((void *)(uintptr_t)d, (const void *)(uintptr_t)s, n);
	return CUDA_SUCCESS;
}
#endif /* RW_HAVE_CUDA_H */
