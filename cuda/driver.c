/* cuda/driver.c: load libcuda.so.1 at run time, resolve the versioned entry points, keep one
 * retained primary context per device; plain memory helpers and the dmabuf export.
 * Why dlopen: the daemon and librailwave must run on CPU-only nodes from the same build. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

rw_cu_api_t rw_cu;
rw_cu_device_t *rw_cu_devices;
int rw_cu_ndevices;
pthread_mutex_t rw_cu_lock = PTHREAD_MUTEX_INITIALIZER;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static rw_status_t init_status = RW_ERR_UNSUPPORTED;
static char init_reason[320];
static void *driver_handle;

static void init_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void init_fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(init_reason, sizeof(init_reason), fmt, ap);
	va_end(ap);
	init_status = RW_ERR_UNSUPPORTED;
	rw_info("cuda: unavailable: %s", init_reason);
}

static const char *cu_err_name(CUresult res)
{
	const char *name = NULL;
	if (rw_cu.cuGetErrorName == NULL || rw_cu.cuGetErrorName(res, &name) != CUDA_SUCCESS || !name)
		return "CUDA_ERROR_?";
	return name;
}

static void init_run(void)
{
	const char *path = getenv("RW_CUDA_DRIVER");
	int count = 0, version = 0;
	CUresult res;

	if (path == NULL || path[0] == '\0')
		path = "libcuda.so.1";
	driver_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (driver_handle == NULL) {
		init_fail("no CUDA driver: cannot load %s (%s); CUDA buffers and kernels are disabled",
			  path, dlerror());
		return;
	}
#define RW_CU_LOAD(fn) \
	do { \
		void *sym = dlsym(driver_handle, RW_CU_NAME(fn)); \
		if (sym == NULL && required) { \
			init_fail("CUDA driver %s is too old: no %s", path, RW_CU_NAME(fn)); \
			goto fail_close; \
		} \
		rw_cu.fn = (__typeof__(rw_cu.fn))sym; \
	} while (0);
	{
		int required = 1;
		RW_CU_REQUIRED(RW_CU_LOAD)
		required = 0;
		RW_CU_OPTIONAL(RW_CU_LOAD)
		(void)required;
	}
#undef RW_CU_LOAD

	res = rw_cu.cuInit(0);
	if (res != CUDA_SUCCESS) {
		init_fail("cuInit failed: %s (no usable GPU, or driver and kernel module disagree)",
			  cu_err_name(res));
		goto fail_close;
	}
	if (rw_cu.cuDriverGetVersion(&version) != CUDA_SUCCESS)
		version = 0;
	if (version < CUDA_VERSION)
		rw_info("cuda: driver API %d is older than the headers built against (%d)", version,
			CUDA_VERSION);
	res = rw_cu.cuDeviceGetCount(&count);
	if (res != CUDA_SUCCESS || count <= 0) {
		init_fail("no CUDA device visible (%s)", res == CUDA_SUCCESS ? "count 0" : cu_err_name(res));
		goto fail_close;
	}
	rw_cu_devices = calloc((size_t)count, sizeof(*rw_cu_devices));
	if (rw_cu_devices == NULL) {
		init_fail("out of memory");
		goto fail_close;
	}
	for (int i = 0; i < count; i++) {
		res = rw_cu.cuDeviceGet(&rw_cu_devices[i].dev, i);
		if (res != CUDA_SUCCESS) {
			init_fail("cuDeviceGet(%d): %s", i, cu_err_name(res));
			goto fail_free;
		}
	}
	rw_cu_ndevices = count;
	init_status = RW_OK;
	rw_info("cuda: driver %d.%d, %d device(s)", version / 1000, version % 1000 / 10, count);
	return;

fail_free:
	free(rw_cu_devices);
	rw_cu_devices = NULL;
fail_close:
	/* Keep the table zeroed so nothing can call into an unloaded library. */
	memset(&rw_cu, 0, sizeof(rw_cu));
	dlclose(driver_handle);
	driver_handle = NULL;
}

rw_status_t rw_cuda_init(void)
{
	pthread_once(&init_once, init_run);
	return init_status;
}

const char *rw_cuda_unavailable_reason(void)
{
	return init_status == RW_OK ? "" : init_reason;
}

int rw_cuda_device_count(void)
{
	return rw_cuda_init() == RW_OK ? rw_cu_ndevices : 0;
}

rw_status_t rw_cu_status(CUresult res)
{
	switch (res) {
	case CUDA_SUCCESS: return RW_OK;
	case CUDA_ERROR_INVALID_VALUE: return RW_ERR_INVAL;
	case CUDA_ERROR_OUT_OF_MEMORY: return RW_ERR_NOMEM;
	case CUDA_ERROR_NOT_SUPPORTED: return RW_ERR_UNSUPPORTED;
	case CUDA_ERROR_NOT_READY: return RW_ERR_AGAIN;
	case CUDA_ERROR_ALREADY_MAPPED: return RW_ERR_EXISTS;
	case CUDA_ERROR_NOT_FOUND: return RW_ERR_NOTFOUND;
	default: return RW_ERR_SYS;
	}
}

rw_status_t rw_cu_fail(CUresult res, const char *what)
{
	const char *msg = NULL;
	if (rw_cu.cuGetErrorString == NULL || rw_cu.cuGetErrorString(res, &msg) != CUDA_SUCCESS)
		msg = NULL;
	rw_err("cuda: %s: %s (%s)", what, msg ? msg : "unknown error", cu_err_name(res));
	return rw_cu_status(res);
}

rw_status_t rw_cu_enter(int device)
{
	rw_status_t st = rw_cuda_init();
	CUresult res;
	CUcontext ctx;

	if (st != RW_OK)
		return st;
	if (device < 0 || device >= rw_cu_ndevices) {
		rw_err("cuda: device %d out of range (%d visible)", device, rw_cu_ndevices);
		return RW_ERR_INVAL;
	}
	pthread_mutex_lock(&rw_cu_lock);
	ctx = rw_cu_devices[device].ctx;
	if (ctx == NULL) {
		res = rw_cu.cuDevicePrimaryCtxRetain(&ctx, rw_cu_devices[device].dev);
		if (res != CUDA_SUCCESS) {
			pthread_mutex_unlock(&rw_cu_lock);
			return rw_cu_fail(res, "cuDevicePrimaryCtxRetain");
		}
		rw_cu_devices[device].ctx = ctx;
	}
	pthread_mutex_unlock(&rw_cu_lock);
	res = rw_cu.cuCtxSetCurrent(ctx);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuCtxSetCurrent");
	return RW_OK;
}

/* A kernel module loaded into d's context (cuda/kernels.c loads it on first use), unloaded
 * with the context it lives in. Caller holds rw_cu_lock with d's context current. */
static void module_unload_locked(rw_cu_module_t *m)
{
	if (m->state == 1 && rw_cu.cuModuleUnload)
		rw_cu.cuModuleUnload(m->module);
	m->state = 0;
	m->module = NULL;
}

void rw_cuda_shutdown(void)
{
	if (rw_cuda_init() != RW_OK)
		return;
	pthread_mutex_lock(&rw_cu_lock);
	for (int i = 0; i < rw_cu_ndevices; i++) {
		rw_cu_device_t *d = &rw_cu_devices[i];
		if (d->ctx == NULL)
			continue;
		if (rw_cu.cuCtxSetCurrent(d->ctx) == CUDA_SUCCESS) {
			module_unload_locked(&d->kern);
			module_unload_locked(&d->rank);
		}
		rw_cu.cuCtxSetCurrent(NULL);
		rw_cu.cuDevicePrimaryCtxRelease(d->dev);
		d->ctx = NULL;
	}
	pthread_mutex_unlock(&rw_cu_lock);
}

rw_status_t rw_cuda_device_uuid(int device, uint8_t uuid_p[16])
{
	CUuuid uuid;
	CUresult res;
	rw_status_t st = rw_cuda_init();

	if (st != RW_OK)
		return st;
	if (device < 0 || device >= rw_cu_ndevices)
		return RW_ERR_INVAL;
	res = rw_cu.cuDeviceGetUuid(&uuid, rw_cu_devices[device].dev);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuDeviceGetUuid");
	memcpy(uuid_p, uuid.bytes, 16);
	return RW_OK;
}

rw_status_t rw_cuda_device_by_uuid(const uint8_t uuid[16], int *device_p)
{
	rw_status_t st = rw_cuda_init();
	uint8_t have[16];

	if (st != RW_OK)
		return st;
	for (int i = 0; i < rw_cu_ndevices; i++) {
		if (rw_cuda_device_uuid(i, have) == RW_OK && memcmp(have, uuid, 16) == 0) {
			*device_p = i;
			return RW_OK;
		}
	}
	return RW_ERR_NOTFOUND;
}

rw_status_t rw_cuda_device_name(int device, char *buf, size_t len)
{
	rw_status_t st = rw_cuda_init();
	CUresult res;

	if (st != RW_OK)
		return st;
	if (device < 0 || device >= rw_cu_ndevices || len == 0 || len > (size_t)INT32_MAX)
		return RW_ERR_INVAL;
	res = rw_cu.cuDeviceGetName(buf, (int)len, rw_cu_devices[device].dev);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuDeviceGetName");
	buf[len - 1] = '\0';
	return RW_OK;
}

rw_status_t rw_cuda_driver_version(int *version_p)
{
	rw_status_t st = rw_cuda_init();
	int v;

	if (st != RW_OK)
		return st;
	if (rw_cu.cuDriverGetVersion(&v) != CUDA_SUCCESS)
		return RW_ERR_SYS;
	*version_p = v;
	return RW_OK;
}

/* ---- memory ---------------------------------------------------------------------------- */

rw_status_t rw_cuda_mem_alloc(int device, size_t bytes, rw_cuda_dptr_t *dptr_p)
{
	rw_status_t st = rw_cu_enter(device);
	CUdeviceptr d;
	CUresult res;

	if (st != RW_OK)
		return st;
	if (bytes == 0)
		return RW_ERR_INVAL;
	res = rw_cu.cuMemAlloc(&d, bytes);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuMemAlloc");
	*dptr_p = (rw_cuda_dptr_t)d;
	return RW_OK;
}

void rw_cuda_mem_free(int device, rw_cuda_dptr_t dptr)
{
	CUresult res;

	if (dptr == 0 || rw_cu_enter(device) != RW_OK)
		return;
	res = rw_cu.cuMemFree((CUdeviceptr)dptr);
	if (res != CUDA_SUCCESS)
		rw_cu_fail(res, "cuMemFree");
}

/* The "blocking" helpers below must be done when they return, for every stream and every
 * process: cuMemsetD8 on device memory is asynchronous with respect to the host, and
 * cuMemcpyHtoD from pageable memory may return before its DMA lands (the driver API's "API
 * synchronization behavior"). Both run on the legacy default stream, which a NON_BLOCKING
 * stream (all of ours) does not wait for, nor does another process reading the memory through
 * CUDA IPC: a rank that zeroed its buffer this way and then copied its inputs on its own stream
 * could see the zeros land after its inputs (the daemon then routed a whole rank's tokens to
 * expert 0 on the H200, docs/perf/runs/gpu-e2e.md). So they wait for the legacy stream. */
static rw_status_t legacy_sync(const char *what)
{
	CUresult res = rw_cu.cuStreamSynchronize(NULL);
	if (res != CUDA_SUCCESS) {
		rw_err("cuda: %s: waiting for the legacy stream failed", what);
		return rw_cu_fail(res, "cuStreamSynchronize");
	}
	return RW_OK;
}

rw_status_t rw_cuda_memcpy_htod(int device, rw_cuda_dptr_t dst, const void *src, size_t bytes)
{
	rw_status_t st = rw_cu_enter(device);
	CUresult res;

	if (st != RW_OK)
		return st;
	res = rw_cu.cuMemcpyHtoD((CUdeviceptr)dst, src, bytes);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuMemcpyHtoD");
	return legacy_sync("cuMemcpyHtoD");
}

rw_status_t rw_cuda_memcpy_dtoh(int device, void *dst, rw_cuda_dptr_t src, size_t bytes)
{
	rw_status_t st = rw_cu_enter(device);
	CUresult res;

	if (st != RW_OK)
		return st;
	res = rw_cu.cuMemcpyDtoH(dst, (CUdeviceptr)src, bytes);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuMemcpyDtoH");
}

rw_status_t rw_cuda_memset_d8(int device, rw_cuda_dptr_t dst, uint8_t value, size_t bytes)
{
	rw_status_t st = rw_cu_enter(device);
	CUresult res;

	if (st != RW_OK)
		return st;
	res = rw_cu.cuMemsetD8((CUdeviceptr)dst, value, bytes);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuMemsetD8");
	return legacy_sync("cuMemsetD8");
}

/* Pinned host memory is not tied to one context with the PORTABLE flag, but the driver still
 * wants some context current: use device 0's primary context. */
rw_status_t rw_cuda_host_alloc(size_t bytes, void **ptr_p)
{
	rw_status_t st = rw_cu_enter(0);
	void *p = NULL;
	CUresult res;

	if (st != RW_OK)
		return st;
	if (bytes == 0)
		return RW_ERR_INVAL;
	res = rw_cu.cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuMemHostAlloc");
	*ptr_p = p;
	return RW_OK;
}

void rw_cuda_host_free(void *ptr)
{
	if (ptr != NULL && rw_cu_enter(0) == RW_OK)
		rw_cu.cuMemFreeHost(ptr);
}

rw_status_t rw_cuda_host_register(void *ptr, size_t bytes)
{
	rw_status_t st = rw_cu_enter(0);
	CUresult res;

	if (st != RW_OK)
		return st;
	if (ptr == NULL || bytes == 0)
		return RW_ERR_INVAL;
	res = rw_cu.cuMemHostRegister(ptr, bytes, CU_MEMHOSTREGISTER_PORTABLE);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuMemHostRegister");
}

rw_status_t rw_cuda_host_register_mapped(void *ptr, size_t bytes, rw_cuda_dptr_t *dptr_p)
{
	rw_status_t st = rw_cu_enter(0);
	CUdeviceptr d = (CUdeviceptr)(uintptr_t)ptr;
	CUresult res;

	if (st != RW_OK)
		return st;
	if (ptr == NULL || bytes == 0)
		return RW_ERR_INVAL;
	res = rw_cu.cuMemHostRegister(ptr, bytes, CU_MEMHOSTREGISTER_PORTABLE |
					      CU_MEMHOSTREGISTER_DEVICEMAP);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuMemHostRegister(DEVICEMAP)");
	/* With unified addressing (every 64-bit platform CUDA supports today) the answer is ptr
	 * itself; ask anyway where the driver can say. */
	if (rw_cu.cuMemHostGetDevicePointer &&
	    (res = rw_cu.cuMemHostGetDevicePointer(&d, ptr, 0)) != CUDA_SUCCESS) {
		rw_cu.cuMemHostUnregister(ptr);
		return rw_cu_fail(res, "cuMemHostGetDevicePointer");
	}
	*dptr_p = (rw_cuda_dptr_t)d;
	return RW_OK;
}

void rw_cuda_host_unregister(void *ptr)
{
	if (ptr != NULL && rw_cu_enter(0) == RW_OK)
		rw_cu.cuMemHostUnregister(ptr);
}

/* ---- dmabuf ---------------------------------------------------------------------------- */

int rw_cuda_dmabuf_supported(int device)
{
	int attr = 0;

	if (rw_cuda_init() != RW_OK || device < 0 || device >= rw_cu_ndevices)
		return 0;
	if (rw_cu.cuMemGetHandleForAddressRange == NULL)
		return 0;
	if (rw_cu.cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
				       rw_cu_devices[device].dev) != CUDA_SUCCESS)
		return 0;
	return attr != 0;
}

rw_status_t rw_cuda_dmabuf_export(int device, rw_cuda_dptr_t dptr, size_t bytes, int *fd_p)
{
	long page = sysconf(_SC_PAGESIZE);
	rw_status_t st = rw_cu_enter(device);
	int fd = -1;
	CUresult res;

	if (st != RW_OK)
		return st;
	if (!rw_cuda_dmabuf_supported(device)) {
		rw_info("cuda: device %d cannot export dmabuf (driver or device lacks support)", device);
		return RW_ERR_UNSUPPORTED;
	}
	if (page <= 0)
		page = 4096;
	if (dptr == 0 || bytes == 0 || dptr % (uint64_t)page != 0 || bytes % (size_t)page != 0)
		return RW_ERR_INVAL;
	res = rw_cu.cuMemGetHandleForAddressRange(&fd, (CUdeviceptr)dptr, bytes,
						  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuMemGetHandleForAddressRange(DMA_BUF_FD)");
	*fd_p = fd;
	return RW_OK;
}

int rw_cuda_gdr_ordering(int device)
{
	int attr = 0;

	if (rw_cuda_init() != RW_OK || device < 0 || device >= rw_cu_ndevices)
		return 0;
	int *known = &rw_cu_devices[device].gdr_ordering; /* a device property: asked once */
	int v = __atomic_load_n(known, __ATOMIC_RELAXED);
	if (v)
		return v - 1;
	if (rw_cu.cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
				       rw_cu_devices[device].dev) != CUDA_SUCCESS)
		return 0;
	__atomic_store_n(known, attr + 1, __ATOMIC_RELAXED);
	return attr;
}

rw_status_t rw_cuda_gdr_flush(int device, int all_devices)
{
	const int scope = all_devices ? CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES
				      : CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER;
	/* The scopes and the ordering attribute share their numbers (100 owner, 200 all): where
	 * the device orders the writes that far itself, nothing to do (no driver call). */
	if (rw_cuda_gdr_ordering(device) >= scope)
		return RW_OK;
	rw_status_t st = rw_cu_enter(device);
	if (st != RW_OK)
		return st;
	if (rw_cu.cuFlushGPUDirectRDMAWrites == NULL)
		return RW_ERR_UNSUPPORTED;
	CUresult res = rw_cu.cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
							(CUflushGPUDirectRDMAWritesScope)scope);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuFlushGPUDirectRDMAWrites");
}

#endif /* RW_HAVE_CUDA_H */
