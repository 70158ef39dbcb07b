/* tests/integration/fake_cuda_mgpu.c: the kernel stand-in (libfakecuda_kern.so: fake_cuda_ipc.c +
 * fake_cuda_kernels.c) made into several devices that hold each other to what real CUDA enforces
 * across devices, so CI catches a multi-GPU bug a one-device stand-in cannot (docs/cuda.md
 * "Several GPUs"). Loaded as libfakecuda_mgpu.so through $RW_CUDA_DRIVER; it needs the kernel
 * stand-in (DT_NEEDED) and forwards every call to it after its own bookkeeping:
 *  - every primary context is its own device ($RW_FAKE_CUDA_DEVICES), current per thread;
 *  - memory belongs to a device: cuMemAlloc to the current one, an IPC mapping to the exporter's
 *    (carried in the handle's spare bytes, as the real handle names its device), and
 *    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL says which;
 *  - a stream, a module and its functions belong to the context they were made in; a launch in
 *    another context is refused (CUDA_ERROR_INVALID_CONTEXT / _INVALID_HANDLE);
 *  - before a launch runs, every address the RailWave list kernels will touch is checked: memory
 *    of another device needs peer access from the launching context (cuCtxEnablePeerAccess, or an
 *    IPC open with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS in a context of another device), and host
 *    memory must be page-locked (cuMemHostAlloc / cuMemHostRegister). A violation is what a GPU
 *    does with it: the launch returns success, the kernel never runs, the context is faulted
 *    (CUDA_ERROR_ILLEGAL_ADDRESS from every later stream call in it, host functions never run),
 *    and one line on stderr names the kernel, the device, the address and whose memory it is.
 * cuDeviceCanAccessPeer says yes between any two devices (one NVLink domain), unless
 * $RW_FAKE_CUDA_NO_P2P=1 (PCIe across sockets: no peer access possible).
 * $RW_FAKE_CUDA_PEERS=all starts every context with peer access to every other (what a daemon
 * that enables it at start-up would have): the same checks, with that one rule granted.
 * $RW_FAKE_CUDA_PEERS=report lets every violation run but logs each distinct one (kernel,
 * device, whose memory, what) once: a census of a run's cross-device accesses. */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#define MAXDEV 16
#define NREGIONS 4096
#define NFUNCS 256
#define HOST (-1)          /* a region of page-locked host memory: every device reaches it */
#define HANDLE_TAG 56      /* spare handle bytes: 'D', device (fake_cuda_ipc.c uses the first 32) */

#define STR_(x) #x
#define STR(x) STR_(x) /* after cuda.h's versioned-name macros */
/* The kernel stand-in's definition of `fn` (same versioned symbol). */
#define REAL(fn) ((__typeof__(fn) *)real_sym(STR(fn)))

static __thread int cur = -1;          /* device of this thread's current context */
static int ctx_obj[MAXDEV];            /* primary contexts: &ctx_obj[d] */
static unsigned char peer[MAXDEV][MAXDEV]; /* peer[a][b]: kernels of a may touch b's memory */
static CUresult fault[MAXDEV];         /* sticky context error */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

struct region {
	uintptr_t lo, hi;
	int dev;                           /* owning device, or HOST */
};
static struct region regions[NREGIONS];
static unsigned n_regions;

struct stream {
	CUstream real;
	int dev;
};
struct module {
	CUmodule real;
	int dev;
};
struct func {
	CUfunction real;
	int dev;
	char name[32];
};
static struct func funcs[NFUNCS];
static unsigned n_funcs;

static void *real_sym(const char *name)
{
	static void *kern;
	if (!kern)
		kern = dlopen("libfakecuda_kern.so", RTLD_NOW | RTLD_NOLOAD);
	void *p = kern ? dlsym(kern, name) : NULL;
	if (!p) {
		fprintf(stderr, "fake cuda mgpu: the kernel stand-in has no %s\n", name);
		abort();
	}
	return p;
}

/* Error names the daemon logs (the kernel stand-in has one text for all). */
CUresult CUDAAPI cuGetErrorName(CUresult e, const char **s)
{
	switch (e) {
	case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; return CUDA_SUCCESS;
	case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return CUDA_SUCCESS;
	case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return CUDA_SUCCESS;
	default: return REAL(cuGetErrorName)(e, s);
	}
}

CUresult CUDAAPI cuGetErrorString(CUresult e, const char **s)
{
	if (e == CUDA_ERROR_ILLEGAL_ADDRESS) {
		*s = "an illegal memory access was encountered";
		return CUDA_SUCCESS;
	}
	return REAL(cuGetErrorString)(e, s);
}

static int ndev(void)
{
	const char *e = getenv("RW_FAKE_CUDA_DEVICES");
	int n = e ? atoi(e) : 1;
	return n < 1 ? 1 : n > MAXDEV ? MAXDEV : n;
}

static int ctx_dev(CUcontext c)
{
	int *p = (int *)(void *)c;
	return p >= ctx_obj && p < ctx_obj + MAXDEV ? (int)(p - ctx_obj) : -1;
}

/* ---- regions ---- */

static void region_add(uintptr_t lo, size_t n, int dev)
{
	pthread_mutex_lock(&mu);
	for (unsigned i = 0; i < n_regions; i++)
		if (regions[i].lo == lo) { /* the driver handed back a mapping it already had */
			pthread_mutex_unlock(&mu);
			return;
		}
	if (n_regions < NREGIONS)
		regions[n_regions++] = (struct region){ lo, lo + n, dev };
	else
		fprintf(stderr, "fake cuda mgpu: more than %d regions: not tracked\n", NREGIONS);
	pthread_mutex_unlock(&mu);
}

static void region_del(uintptr_t lo)
{
	pthread_mutex_lock(&mu);
	for (unsigned i = 0; i < n_regions; i++)
		if (regions[i].lo == lo) {
			regions[i] = regions[--n_regions];
			break;
		}
	pthread_mutex_unlock(&mu);
}

/* The region holding [p, p + n), or NULL. */
static const struct region *region_of(uintptr_t p, size_t n)
{
	const struct region *r = NULL;
	pthread_mutex_lock(&mu);
	for (unsigned i = 0; i < n_regions && !r; i++)
		if (p >= regions[i].lo && n <= regions[i].hi - p && p < regions[i].hi)
			r = &regions[i];
	pthread_mutex_unlock(&mu);
	return r;
}

/* ---- contexts and peers ---- */

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
	if (d < 0 || d >= ndev())
		return CUDA_ERROR_INVALID_DEVICE;
	CUresult res = REAL(cuDevicePrimaryCtxRetain)(c, d);
	if (res == CUDA_SUCCESS) {
		const char *e = getenv("RW_FAKE_CUDA_PEERS");
		if (e && strcmp(e, "all") == 0 && !getenv("RW_FAKE_CUDA_NO_P2P"))
			for (int b = 0; b < ndev(); b++)
				peer[d][b] = b != d;
		*c = (CUcontext)(void *)&ctx_obj[d];
	}
	return res;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext c)
{
	if (c && ctx_dev(c) < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	cur = c ? ctx_dev(c) : -1;
	return REAL(cuCtxSetCurrent)(c);
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *c)
{
	*c = cur >= 0 ? (CUcontext)(void *)&ctx_obj[cur] : NULL;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice other);
CUresult CUDAAPI cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice other)
{
	if (dev < 0 || dev >= ndev() || other < 0 || other >= ndev())
		return CUDA_ERROR_INVALID_DEVICE;
	*can = dev != other && !getenv("RW_FAKE_CUDA_NO_P2P");
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext other, unsigned int flags);
CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext other, unsigned int flags)
{
	int b = ctx_dev(other), can = 0;
	if (cur < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (b < 0 || flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (cuDeviceCanAccessPeer(&can, cur, b) != CUDA_SUCCESS || !can)
		return b == cur ? CUDA_ERROR_INVALID_DEVICE : CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
	if (peer[cur][b])
		return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
	peer[cur][b] = 1;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxDisablePeerAccess(CUcontext other);
CUresult CUDAAPI cuCtxDisablePeerAccess(CUcontext other)
{
	int b = ctx_dev(other);
	if (cur < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (b < 0 || !peer[cur][b])
		return CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
	peer[cur][b] = 0;
	return CUDA_SUCCESS;
}

/* ---- memory ---- */

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *p, size_t n)
{
	if (cur < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	CUresult res = REAL(cuMemAlloc)(p, n);
	if (res == CUDA_SUCCESS)
		region_add((uintptr_t)*p, n, cur);
	return res;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr p)
{
	CUresult res = REAL(cuMemFree)(p);
	if (res == CUDA_SUCCESS)
		region_del((uintptr_t)p);
	return res;
}

CUresult CUDAAPI cuMemHostAlloc(void **p, size_t n, unsigned int flags)
{
	CUresult res = REAL(cuMemHostAlloc)(p, n, flags);
	if (res == CUDA_SUCCESS)
		region_add((uintptr_t)*p, n, HOST);
	return res;
}

CUresult CUDAAPI cuMemFreeHost(void *p)
{
	region_del((uintptr_t)p);
	return REAL(cuMemFreeHost)(p);
}

CUresult CUDAAPI cuMemHostRegister(void *p, size_t n, unsigned int flags)
{
	CUresult res = REAL(cuMemHostRegister)(p, n, flags);
	if (res == CUDA_SUCCESS)
		region_add((uintptr_t)p, n, HOST);
	return res;
}

CUresult CUDAAPI cuMemHostUnregister(void *p)
{
	region_del((uintptr_t)p);
	return REAL(cuMemHostUnregister)(p);
}

CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p)
{
	const struct region *r = region_of((uintptr_t)p, 1);
	if (a == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL && r && r->dev != HOST) {
		*(int *)data = r->dev;
		return CUDA_SUCCESS;
	}
	return REAL(cuPointerGetAttribute)(data, a, p);
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
	CUresult res = REAL(cuIpcGetMemHandle)(h, p);
	const struct region *r = region_of((uintptr_t)p, 1);
	if (res == CUDA_SUCCESS && r && r->dev != HOST) {
		h->reserved[HANDLE_TAG] = 'D';
		h->reserved[HANDLE_TAG + 1] = (char)r->dev;
	}
	return res;
}

/* The mapping belongs to the exporter's device. Opened in a context of another device with
 * CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, that context gets peer access to it (cuda.h: "as if the
 * user called cuCtxEnablePeerAccess"); opened in the memory's own device's context, nothing. */
CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags)
{
	if (cur < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	int dev = h.reserved[HANDLE_TAG] == 'D' ? h.reserved[HANDLE_TAG + 1] : cur;
	if (dev < 0 || dev >= ndev())
		return CUDA_ERROR_INVALID_DEVICE;
	CUresult res = REAL(cuIpcOpenMemHandle)(p, h, flags);
	if (res != CUDA_SUCCESS)
		return res;
	size_t n = 0;
	if (REAL(cuMemGetAddressRange)(NULL, &n, *p) == CUDA_SUCCESS)
		region_add((uintptr_t)*p, n, dev);
	if (dev != cur && (flags & CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) && !getenv("RW_FAKE_CUDA_NO_P2P"))
		peer[cur][dev] = 1;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr p)
{
	CUresult res = REAL(cuIpcCloseMemHandle)(p);
	if (res == CUDA_SUCCESS && REAL(cuMemGetAddressRange)(NULL, NULL, p) != CUDA_SUCCESS)
		region_del((uintptr_t)p); /* the last open of it */
	return res;
}

/* ---- streams ---- */

static struct stream *stream_of(CUstream s) { return (struct stream *)(void *)s; }

CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned int flags)
{
	if (cur < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	struct stream *st = calloc(1, sizeof(*st));
	if (!st)
		return CUDA_ERROR_OUT_OF_MEMORY;
	CUresult res = REAL(cuStreamCreate)(&st->real, flags);
	if (res != CUDA_SUCCESS) {
		free(st);
		return res;
	}
	st->dev = cur;
	*s = (CUstream)(void *)st;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamDestroy(CUstream s)
{
	CUresult res = REAL(cuStreamDestroy)(stream_of(s)->real);
	free(stream_of(s));
	return res;
}

CUresult CUDAAPI cuStreamQuery(CUstream s)
{
	return fault[stream_of(s)->dev] ? fault[stream_of(s)->dev] : REAL(cuStreamQuery)(stream_of(s)->real);
}

CUresult CUDAAPI cuStreamSynchronize(CUstream s)
{
	if (!s) /* the legacy stream (the blocking copies and memsets wait for it) */
		return REAL(cuStreamSynchronize)(NULL);
	CUresult res = REAL(cuStreamSynchronize)(stream_of(s)->real);
	return fault[stream_of(s)->dev] ? fault[stream_of(s)->dev] : res;
}

/* Work on a stream: refused once its context faulted (a faulted context runs nothing more). */
CUresult CUDAAPI cuLaunchHostFunc(CUstream s, CUhostFn fn, void *arg)
{
	struct stream *st = stream_of(s);
	return fault[st->dev] ? fault[st->dev] : REAL(cuLaunchHostFunc)(st->real, fn, arg);
}

CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr d, const void *src, size_t n, CUstream s)
{
	struct stream *st = stream_of(s);
	return fault[st->dev] ? fault[st->dev] : REAL(cuMemcpyHtoDAsync)(d, src, n, st->real);
}

CUresult CUDAAPI cuMemcpyDtoHAsync(void *d, CUdeviceptr src, size_t n, CUstream s)
{
	struct stream *st = stream_of(s);
	return fault[st->dev] ? fault[st->dev] : REAL(cuMemcpyDtoHAsync)(d, src, n, st->real);
}

CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s)
{
	struct stream *st = stream_of(s);
	return fault[st->dev] ? fault[st->dev] : REAL(cuMemcpyDtoDAsync)(d, src, n, st->real);
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s)
{
	struct stream *st = stream_of(s);
	return fault[st->dev] ? fault[st->dev] : REAL(cuMemsetD8Async)(d, v, n, st->real);
}

/* ---- modules and launches ---- */

CUresult CUDAAPI cuModuleLoadData(CUmodule *m, const void *image)
{
	if (cur < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	struct module *mod = calloc(1, sizeof(*mod));
	if (!mod)
		return CUDA_ERROR_OUT_OF_MEMORY;
	CUresult res = REAL(cuModuleLoadData)(&mod->real, image);
	if (res != CUDA_SUCCESS) {
		free(mod);
		return res;
	}
	mod->dev = cur;
	*m = (CUmodule)(void *)mod;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleUnload(CUmodule m)
{
	struct module *mod = (struct module *)(void *)m;
	CUresult res = REAL(cuModuleUnload)(mod->real);
	free(mod);
	return res;
}

/* Function handles are kept per (device, name) for the process's life (a reload reuses them). */
CUresult CUDAAPI cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
	struct module *mod = (struct module *)(void *)m;
	CUfunction real;
	CUresult res = REAL(cuModuleGetFunction)(&real, mod->real, name);
	if (res != CUDA_SUCCESS)
		return res;
	pthread_mutex_lock(&mu);
	unsigned i = 0;
	while (i < n_funcs && !(funcs[i].dev == mod->dev && strcmp(funcs[i].name, name) == 0))
		i++;
	if (i == n_funcs && n_funcs < NFUNCS) {
		funcs[i].dev = mod->dev;
		snprintf(funcs[i].name, sizeof(funcs[i].name), "%s", name);
		n_funcs++;
	}
	if (i < n_funcs)
		funcs[i].real = real;
	pthread_mutex_unlock(&mu);
	if (i == NFUNCS)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*f = (CUfunction)(void *)&funcs[i];
	return CUDA_SUCCESS;
}

static int report_mode(void)
{
	const char *e = getenv("RW_FAKE_CUDA_PEERS");
	return e && strcmp(e, "report") == 0;
}

/* Report mode: log (kernel, device, owner, what) the first time it is seen. */
static void report_once(const char *kernel, int dev, int owner, const char *what)
{
	static struct { char k[32]; int dev, owner; const char *what; } seen[256];
	static unsigned n_seen;
	pthread_mutex_lock(&mu);
	for (unsigned i = 0; i < n_seen; i++)
		if (seen[i].dev == dev && seen[i].owner == owner && seen[i].what == what &&
		    strcmp(seen[i].k, kernel) == 0) {
			pthread_mutex_unlock(&mu);
			return;
		}
	if (n_seen < 256) {
		snprintf(seen[n_seen].k, sizeof(seen[n_seen].k), "%s", kernel);
		seen[n_seen].dev = dev;
		seen[n_seen].owner = owner;
		seen[n_seen].what = what;
		n_seen++;
	}
	pthread_mutex_unlock(&mu);
	char whose[32] = "pageable host memory";
	if (owner != HOST)
		snprintf(whose, sizeof(whose), "device %d's memory", owner);
	fprintf(stderr, "fake cuda report: kernel %s on device %d touches %s in %s\n", kernel, dev,
		what, whose);
}

static const char *cur_kernel = "";

/* May a kernel of device `dev` touch [p, p + n)? If not: why, into `why`. */
static int reach(int dev, uint64_t p, uint64_t n, const char *what, char *why, size_t len)
{
	const struct region *r = region_of((uintptr_t)p, n ? n : 1);
	if (r && (r->dev == HOST || r->dev == dev || peer[dev][r->dev]))
		return 1;
	if (report_mode()) {
		report_once(cur_kernel, dev, r ? r->dev : HOST, what);
		return 1;
	}
	if (r)
		snprintf(why, len, "%s at 0x%llx+%llu is device %d's memory and device %d has no peer "
			 "access to it", what, (unsigned long long)p, (unsigned long long)n, r->dev, dev);
	else
		snprintf(why, len, "%s at 0x%llx+%llu is neither device memory nor page-locked host "
			 "memory", what, (unsigned long long)p, (unsigned long long)n);
	return 0;
}

struct row_copy { uint64_t src, dst; };        /* cuda/kernels.cu rw_row_copy */
struct row_sum { uint64_t dst; uint32_t first, count; }; /* rw_row_sum */

#define ARG(i, type) (*(type *)params[i])

/* Every address the RailWave list kernels will read or write (their signatures in
 * cuda/kernels.cu; the launches in cuda/kernels.c). 1: all reachable from `dev`. */
static int launch_reaches(const struct func *fn, int dev, void **params, char *why, size_t len)
{
	const char *k = fn->name;
	if (strcmp(k, "rw_copy_rows16") == 0 || strcmp(k, "rw_copy_rows1") == 0) {
		uint64_t list = ARG(0, CUdeviceptr);
		uint32_t n = ARG(1, uint32_t);
		uint64_t row = (uint64_t)ARG(2, uint32_t) * (k[12] == '1' && k[13] == '6' ? 16 : 1);
		if (!reach(dev, list, 16ull * n, "the row list", why, len))
			return 0;
		const struct row_copy *l = (const struct row_copy *)(uintptr_t)list;
		for (uint32_t i = 0; i < n; i++)
			if (!reach(dev, l[i].src, row, "a source row", why, len) ||
			    !reach(dev, l[i].dst, row, "a destination row", why, len))
				return 0;
		return 1;
	}
	if (strcmp(k, "rw_rows_acc") == 0 || strcmp(k, "rw_rows_sum") == 0) {
		uint64_t list = ARG(0, CUdeviceptr), srcs = ARG(1, CUdeviceptr);
		uint32_t n = ARG(2, uint32_t), hidden = ARG(3, uint32_t), bf16 = ARG(4, uint32_t);
		uint64_t row = (uint64_t)hidden * (bf16 ? 2 : 4);
		uint64_t dst_row = k[8] == 'a' ? 4ull * hidden : row; /* acc: fp32 sums */
		if (!reach(dev, list, 16ull * n, "the sum list", why, len))
			return 0;
		const struct row_sum *l = (const struct row_sum *)(uintptr_t)list;
		const uint64_t *src = (const uint64_t *)(uintptr_t)srcs;
		for (uint32_t i = 0; i < n; i++) {
			if (!reach(dev, l[i].dst, dst_row, "a sum's destination", why, len) ||
			    !reach(dev, srcs + 8ull * l[i].first, 8ull * l[i].count, "the source list",
				   why, len))
				return 0;
			for (uint32_t j = 0; j < l[i].count; j++)
				if (!reach(dev, src[l[i].first + j], row, "a summed row", why, len))
					return 0;
		}
		return 1;
	}
	if (strcmp(k, "rw_store_f32") == 0) {
		uint64_t n = ARG(2, uint64_t);
		return reach(dev, ARG(0, CUdeviceptr), n * (ARG(3, uint32_t) ? 2 : 4), "the output",
			     why, len) &&
		       reach(dev, ARG(1, CUdeviceptr), 4 * n, "the fp32 sums", why, len);
	}
	return 1; /* other kernels: the kernel stand-in refuses them anyway */
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
				unsigned by, unsigned bz, unsigned shared, CUstream s, void **params,
				void **extra)
{
	const struct func *fn = (const struct func *)(void *)f;
	struct stream *st = stream_of(s);
	char why[256];
	if (!st || cur != st->dev) {
		fprintf(stderr, "fake cuda: %s launched on device %d's stream with device %d's context "
			"current: CUDA_ERROR_INVALID_CONTEXT\n", fn->name, st ? st->dev : -1, cur);
		return CUDA_ERROR_INVALID_CONTEXT;
	}
	if (fn->dev != cur) {
		fprintf(stderr, "fake cuda: %s of device %d's module launched in device %d's context: "
			"CUDA_ERROR_INVALID_HANDLE\n", fn->name, fn->dev, cur);
		return CUDA_ERROR_INVALID_HANDLE;
	}
	if (fault[cur])
		return fault[cur];
	cur_kernel = fn->name;
	if (!launch_reaches(fn, cur, params, why, sizeof(why))) {
		fprintf(stderr, "fake cuda: kernel %s on device %d faulted: %s: "
			"CUDA_ERROR_ILLEGAL_ADDRESS (device %d's context is lost)\n", fn->name, cur, why, cur);
		fault[cur] = CUDA_ERROR_ILLEGAL_ADDRESS;
		return CUDA_SUCCESS; /* the fault shows on the stream, as a GPU's does */
	}
	return REAL(cuLaunchKernel)(fn->real, gx, gy, gz, bx, by, bz, shared, st->real, params, extra);
}
#endif /* RW_HAVE_CUDA_H */
