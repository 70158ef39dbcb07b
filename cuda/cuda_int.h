/* cuda/ private: the run-time driver table and per-device state shared by the module's files.
 * Compiled against the toolkit's cuda.h for types and names only; nothing links libcuda.
 * cuda.h #defines the versioned entry points (cuMemAlloc -> cuMemAlloc_v2, ...), so a table field
 * named after the plain API takes the _v2 name and type, and RW_CU_NAME() gives the exact symbol
 * string that dlsym must look up. */
#ifndef RW_CUDA_INT_H
#define RW_CUDA_INT_H

#include "config.h"

#if RW_HAVE_CUDA_H
#include <pthread.h>

#include <cuda.h>

#include "cuda/rw_cuda.h"

/* Entry points without which the module reports RW_ERR_UNSUPPORTED (all exist since CUDA 11.4). */
#define RW_CU_REQUIRED(X) \
	X(cuInit) X(cuDriverGetVersion) X(cuGetErrorString) X(cuGetErrorName) \
	X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetName) X(cuDeviceGetUuid) \
	X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) \
	X(cuCtxSetCurrent) X(cuCtxGetCurrent) \
	X(cuMemAlloc) X(cuMemFree) X(cuMemGetAddressRange) X(cuMemcpyHtoD) X(cuMemcpyDtoH) \
	X(cuMemsetD8) X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemHostRegister) X(cuMemHostUnregister) \
	X(cuPointerGetAttribute) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle) \
	X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamQuery) X(cuStreamSynchronize) \
	X(cuMemcpyHtoDAsync) X(cuMemcpyDtoHAsync) X(cuMemcpyDtoDAsync) X(cuLaunchHostFunc)

/* Entry points a feature needs; absent -> that feature reports RW_ERR_UNSUPPORTED. */
#define RW_CU_OPTIONAL(X) \
	X(cuMemGetHandleForAddressRange) X(cuMemHostGetDevicePointer) X(cuMemsetD8Async) \
	X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction) X(cuLaunchKernel) \
	X(cuEventCreate) X(cuEventRecord) X(cuEventDestroy) X(cuIpcGetEventHandle) \
	X(cuIpcOpenEventHandle) X(cuStreamWaitEvent) X(cuStreamWriteValue32) X(cuStreamWaitValue32) \
	X(cuEventSynchronize) X(cuDeviceCanAccessPeer) X(cuCtxEnablePeerAccess) \
	X(cuFlushGPUDirectRDMAWrites) X(cuStreamWriteValue64) X(cuStreamWaitValue64) \
	X(cuStreamCreateWithPriority) X(cuCtxGetStreamPriorityRange) \
	X(cuStreamBeginCapture) X(cuStreamEndCapture) X(cuGraphInstantiate) X(cuGraphLaunch) \
	X(cuGraphExecDestroy) X(cuGraphDestroy) \
	X(cuMemCreate) X(cuMemRelease) X(cuMemExportToShareableHandle) \
	X(cuMemImportFromShareableHandle) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) \
	X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAllocationGranularity) X(cuMemcpy2DAsync)

#define RW_CU_STR_(x) #x
#define RW_CU_NAME(x) RW_CU_STR_(x) /* expands the cuda.h version macro first */

typedef struct rw_cu_api {
#define RW_CU_FIELD(fn) __typeof__(fn) *fn;
	RW_CU_REQUIRED(RW_CU_FIELD)
	RW_CU_OPTIONAL(RW_CU_FIELD)
#undef RW_CU_FIELD
} rw_cu_api_t;

extern rw_cu_api_t rw_cu; /* valid once rw_cuda_init() returned RW_OK */

/* Kernels loaded into one device's primary context (cuda/kernels.c). */
enum {
	RW_K_PACK16, RW_K_UNPACK16, RW_K_PACK1, RW_K_UNPACK1,
	RW_K_COMB_BB_V, RW_K_COMB_BF_V, RW_K_COMB_FB_V, RW_K_COMB_FF_V, /* out, row: b=bf16 f=fp32 */
	RW_K_COMB_BB_S, RW_K_COMB_BF_S, RW_K_COMB_FB_S, RW_K_COMB_FF_S, /* _V 16-byte, _S scalar */
	RW_K_COPY_ROWS16, RW_K_COPY_ROWS1, RW_K_ROWS_ACC, RW_K_ROWS_SUM, RW_K_STORE_F32, /* lists */
	RW_K_ROUTE_COUNT,
	RW_K_COUNT
};

/* The rank kernels (cuda/rank_kernels.c), a second image. */
enum { RW_RK_PACK_INDEX, RW_RK_PACK_ROWS, RW_RK_FORWARD, RW_RK_GATHER, RW_RK_REDUCE, RW_RK_CTL,
       RW_RK_COUNT };

/* A kernel image's module in one device's primary context. */
typedef struct rw_cu_module {
	int state;              /* 0 not tried, 1 loaded, -1 failed */
	CUmodule module;
} rw_cu_module_t;

typedef struct rw_cu_device {
	CUdevice dev;
	CUcontext ctx;          /* retained primary context, or NULL */
	rw_cu_module_t kern;    /* cuda/kernels.cu */
	CUfunction fn[RW_K_COUNT];
	rw_cu_module_t rank;    /* cuda/rank_kernels.cu */
	CUfunction rank_fn[RW_RK_COUNT];
	int gdr_ordering;       /* 1 + CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING (0: not
	                         * asked yet; atomics: rw_cuda_gdr_flush runs per arrival) */
} rw_cu_device_t;

extern rw_cu_device_t *rw_cu_devices;
extern int rw_cu_ndevices;
extern pthread_mutex_t rw_cu_lock; /* guards ctx retain/release and kernel loading */

/* Make `device`'s primary context current on this thread (retained on first use). */
rw_status_t rw_cu_enter(int device);

/* Log "cuda: <what>: <driver message>" once and map the CUresult to a status. */
rw_status_t rw_cu_fail(CUresult res, const char *what);

/* Status for a failed call without logging (expected failures decided by the caller). */
rw_status_t rw_cu_status(CUresult res);

/* The CUstream behind a stream (cuda/stream.c), for kernel launches. */
CUstream rw_cu_stream_handle(rw_cuda_stream_t *s);

/* A stream memory operation (cuda/words.c): write `value` into, or wait until GEQ, the `bits`
 * (32 or 64) word at addr on stream h of `device`. RW_ERR_INVAL: addr 0, unaligned, or refused. */
rw_status_t rw_cu_value_op(int device, CUstream h, rw_cuda_dptr_t addr, uint64_t value, int bits,
			   int wait);

/* An embedded kernel image: its bytes (len 0: built without nvcc), what to call it and its
 * load in the log, its entry points. */
typedef struct rw_cu_image {
	const unsigned char *data;
	size_t len;
	const char *what, *load;
	const char *const *names;
	int n;
} rw_cu_image_t;

/* Load an image into the device's context once, its entry points into fn[] (caller holds
 * nothing; any thread); 0 ok (the device's context left current), -1 absent or failed (logged
 * once). rw_cuda_shutdown (cuda/driver.c) unloads it with the context. */
int rw_cu_image_load(int device, const rw_cu_image_t *img, rw_cu_module_t *m, CUfunction *fn);

/* The data-path kernels (cuda/kernels.cu) through rw_cu_image_load; 0 ok, -1 absent. */
int rw_cu_kernels_load(int device);

#endif /* RW_HAVE_CUDA_H */
#endif /* RW_CUDA_INT_H */
