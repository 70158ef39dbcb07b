/* tests/cuda/fake_cuda_base.c: the driver entry points both stand-in libcuda.so.1 builds answer
 * the same way (tests/cuda/fake_libcuda.c, in-process IPC; tests/integration/fake_cuda_ipc.c,
 * cross-process IPC): devices ($RW_FAKE_CUDA_DEVICES, default 1) with fixed names and UUIDs, a
 * refcounted primary context, and copies, since "device memory" is host-addressable in both.
 * What differs between them (allocation, IPC handles, pointer lookup, streams) stays in each.
 * The stream work queue ($RW_FAKE_CUDA_LAG_MS: a slow GPU; $RW_FAKE_CUDA_HANG=file: a hung one)
 * is here too (fake_cuda_base.h), and
 * stream order across processes: interprocess events (a shared page of two counters, opened by
 * another process through /proc/<pid>/fd) and 32- and 64-bit stream memory operations, all as
 * stream work, so a wait holds every later item of its stream as a GPU's would, and no other.
 * And the per-process counts of what was asked of the GPU ($RW_FAKE_CUDA_COUNTS). */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>

#include "tests/cuda/fake_cuda_base.h"

/* ---- counts ---- */

/* The counters: a page of this process's <folder>/<pid> mapped shared (a reader sees each
 * 64-bit word whole), else a private page. */
static _Atomic uint64_t *counts;
static pthread_once_t counts_once = PTHREAD_ONCE_INIT;
static _Atomic uint64_t counts_private[RW_FAKE_N_END];

static void counts_open(void)
{
	counts = counts_private;
	const char *dir = getenv("RW_FAKE_CUDA_COUNTS");
	if (!dir)
		return;
	char path[512];
	snprintf(path, sizeof(path), "%s/%d", dir, (int)getpid());
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	void *m = MAP_FAILED;
	if (fd >= 0 && ftruncate(fd, RW_FAKE_N_END * sizeof(uint64_t)) == 0)
		m = mmap(NULL, RW_FAKE_N_END * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED,
			 fd, 0);
	if (fd >= 0)
		close(fd);
	if (m == MAP_FAILED)
		fprintf(stderr, "fake cuda: cannot map the counts at %s\n", path);
	else
		counts = m;
}

void rw_fake_cuda_count(enum rw_fake_count what)
{
	pthread_once(&counts_once, counts_open);
	atomic_fetch_add(&counts[what], 1);
}

/* ---- the stream work queues ---- */

/* One item of stream work runs; counted once it did (what it wrote is there to be read). */
static void work_run(rw_fake_work_fn fn, const void *arg)
{
	fn(arg);
	rw_fake_cuda_count(RW_FAKE_N_WORK_RUN);
}

#define QMAX 4096
/* What a queued copy writes and reads (zero for other work): rw_fake_cuda_copies_naming. */
struct span {
	uintptr_t dst, src;
	size_t dst_n, src_n;
};
struct work {
	rw_fake_work_fn fn;
	struct span span;
	int (*hold)(const void *); /* recorded in a graph: its launch queues behind it */
	size_t len;
	unsigned char arg[RW_FAKE_WORK_ARG];
};
struct rw_fake_graph;
/* One stream: its queue and (with the lag) its worker thread. Streams are independent, as a
 * GPU's are: a wait held on one holds none of the others. The legacy stream (NULL) is one too. */
struct rw_fake_stream {
	struct rw_fake_stream *next;
	struct work queue[QMAX];
	unsigned head, tail; /* head advances once an item has run */
	pthread_cond_t more, ran;
	pthread_t thread;
	int worker_up, dying;
	int orphan; /* destroyed with its work held by the hang: the worker frees it when done */
	struct rw_fake_graph *capture; /* being captured: work is recorded here, not run */
};
static pthread_mutex_t q_mu = PTHREAD_MUTEX_INITIALIZER;
static struct rw_fake_stream legacy = { .more = PTHREAD_COND_INITIALIZER, .ran = PTHREAD_COND_INITIALIZER };
static struct rw_fake_stream *streams = &legacy; /* every live stream, legacy last */
static int lag_ms = -1;

static int lag(void)
{
	if (lag_ms < 0) {
		const char *e = getenv("RW_FAKE_CUDA_LAG_MS");
		lag_ms = e ? atoi(e) : 0;
	}
	return lag_ms;
}

/* $RW_FAKE_CUDA_HANG=file: while the file exists, no work item of any stream but the legacy one
 * runs (a hung GPU: a kernel that never ends, a wedged copy engine): copies never land, marks
 * never come, a synchronization waits; once the file is removed the queued work runs in order.
 * A test turns it on and off in a running process by creating and removing the file. */
static int hung(void)
{
	static const char *file;
	static int looked;
	if (!looked) {
		file = getenv("RW_FAKE_CUDA_HANG");
		looked = 1;
	}
	return file && file[0] && access(file, F_OK) == 0;
}

/* The stream s names, or the legacy one (NULL, or a handle this file did not make). Locked. */
static struct rw_fake_stream *stream_find(const void *s)
{
	for (struct rw_fake_stream *q = streams; q; q = q->next)
		if (q == s)
			return q;
	return &legacy;
}

static void *worker(void *arg)
{
	struct rw_fake_stream *q = arg;
	/* The legacy stream may be slower still ($RW_FAKE_CUDA_LEGACY_LAG_MS): its work then lands
	 * well after the caller's next steps on its own streams, unless the caller waits for it. */
	const char *e = q == &legacy ? getenv("RW_FAKE_CUDA_LEGACY_LAG_MS") : NULL;
	const int ms = e && atoi(e) > 0 ? atoi(e) : lag_ms;
	const struct timespec nap = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L };
	pthread_mutex_lock(&q_mu);
	for (;;) {
		while (q->head == q->tail && !q->dying)
			pthread_cond_wait(&q->more, &q_mu);
		if (q->head == q->tail)
			break;
		struct work w = q->queue[q->head % QMAX];
		pthread_mutex_unlock(&q_mu);
		while (q != &legacy && hung()) {
			const struct timespec hang_nap = { 0, 5000000 };
			nanosleep(&hang_nap, NULL);
		}
		nanosleep(&nap, NULL);
		work_run(w.fn, w.arg);
		pthread_mutex_lock(&q_mu);
		q->head++;
		pthread_cond_broadcast(&q->ran);
	}
	const int orphan = q->orphan;
	pthread_mutex_unlock(&q_mu);
	if (orphan) {
		pthread_cond_destroy(&q->more);
		pthread_cond_destroy(&q->ran);
		free(q);
	}
	return NULL;
}

void *rw_fake_cuda_stream_create(void)
{
	struct rw_fake_stream *q = calloc(1, sizeof(*q));
	if (!q)
		return NULL;
	pthread_cond_init(&q->more, NULL);
	pthread_cond_init(&q->ran, NULL);
	pthread_mutex_lock(&q_mu);
	q->next = streams;
	streams = q;
	pthread_mutex_unlock(&q_mu);
	return q;
}

void rw_fake_cuda_stream_destroy(void *s)
{
	/* cuStreamDestroy does not wait: a stream destroyed with work still queued is released by
	 * the driver once that work is done. The stand-in waits for it, unless the hang holds it:
	 * then its worker runs it once the hang ends and frees the stream. */
	if (!hung() || !rw_fake_cuda_busy(s))
		rw_fake_cuda_drain(s);
	pthread_mutex_lock(&q_mu);
	struct rw_fake_stream *q = stream_find(s);
	if (q == &legacy) {
		pthread_mutex_unlock(&q_mu);
		return;
	}
	for (struct rw_fake_stream **pp = &streams; *pp; pp = &(*pp)->next)
		if (*pp == q) {
			*pp = q->next;
			break;
		}
	q->dying = 1;
	pthread_cond_signal(&q->more);
	int up = q->worker_up;
	if (up && q->head != q->tail) {
		q->orphan = 1;
		pthread_detach(q->thread);
		pthread_mutex_unlock(&q_mu);
		return;
	}
	pthread_mutex_unlock(&q_mu);
	if (up)
		pthread_join(q->thread, NULL);
	pthread_cond_destroy(&q->more);
	pthread_cond_destroy(&q->ran);
	free(q);
}

/* Run fn(arg) as the stream's next item: at once on this thread when there is no lag, nothing is
 * queued on the stream and `hold` (if given) is already satisfied; else queued behind what is. */
static int capture_record(struct rw_fake_stream *q, rw_fake_work_fn fn, const void *arg, size_t len,
			  int (*hold)(const void *));

static void submit(const void *s, rw_fake_work_fn fn, const void *arg, size_t len,
		   int (*hold)(const void *), const struct span *span)
{
	rw_fake_cuda_count(RW_FAKE_N_WORK);
	if (len > sizeof(legacy.queue[0].arg)) {
		work_run(fn, arg);
		return;
	}
	pthread_mutex_lock(&q_mu);
	struct rw_fake_stream *q = stream_find(s);
	if (q->capture && capture_record(q, fn, arg, len, hold) == 0) {
		pthread_mutex_unlock(&q_mu);
		return;
	}
	if (lag() <= 0 && q->head == q->tail && (!hold || hold(arg)) && (q == &legacy || !hung())) {
		pthread_mutex_unlock(&q_mu);
		work_run(fn, arg);
		return;
	}
	if (!q->worker_up) {
		if (pthread_create(&q->thread, NULL, worker, q) != 0) {
			pthread_mutex_unlock(&q_mu);
			work_run(fn, arg);
			return;
		}
		if (q == &legacy)
			pthread_detach(q->thread); /* lives as long as the process */
		q->worker_up = 1;
	}
	while (q->tail - q->head == QMAX)
		pthread_cond_wait(&q->ran, &q_mu);
	q->queue[q->tail % QMAX].fn = fn;
	q->queue[q->tail % QMAX].span = span ? *span : (struct span){ 0 };
	memcpy(q->queue[q->tail % QMAX].arg, arg, len);
	q->tail++;
	pthread_cond_signal(&q->more);
	pthread_mutex_unlock(&q_mu);
}

void rw_fake_cuda_submit(const void *s, rw_fake_work_fn fn, const void *arg, size_t len)
{
	submit(s, fn, arg, len, NULL, NULL);
}

void rw_fake_cuda_submit_copy(const void *s, rw_fake_work_fn fn, const void *arg, size_t len,
			      uintptr_t dst, size_t dst_n, uintptr_t src, size_t src_n)
{
	const struct span span = { dst, src, dst_n, src_n };
	submit(s, fn, arg, len, NULL, &span);
}

void rw_fake_cuda_submit_held(const void *s, rw_fake_work_fn fn, const void *arg, size_t len,
			      int (*hold)(const void *))
{
	submit(s, fn, arg, len, hold, NULL);
}

unsigned rw_fake_cuda_busy(const void *s)
{
	pthread_mutex_lock(&q_mu);
	struct rw_fake_stream *q = stream_find(s);
	unsigned n = q->tail - q->head;
	pthread_mutex_unlock(&q_mu);
	return n;
}

/* Wait for one queue; NULL: every stream's (the legacy stream synchronizes with all). */
unsigned rw_fake_cuda_drain(const void *s)
{
	unsigned n = 0;
	pthread_mutex_lock(&q_mu);
	for (struct rw_fake_stream *q = streams; q; q = q->next) {
		if (s && q != stream_find(s))
			continue;
		n += q->tail - q->head;
		while (q->head != q->tail)
			pthread_cond_wait(&q->ran, &q_mu);
	}
	pthread_mutex_unlock(&q_mu);
	return n;
}

static int overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn)
{
	return a < b + bn && b < a + an;
}

unsigned rw_fake_cuda_copies_naming(uintptr_t p, size_t n)
{
	unsigned found = 0;
	pthread_mutex_lock(&q_mu);
	for (const struct rw_fake_stream *q = streams; q; q = q->next)
		for (unsigned i = q->head; i != q->tail; i++) {
			const struct span *c = &q->queue[i % QMAX].span;
			found += (c->dst_n && overlaps(c->dst, c->dst_n, p, n)) ||
				 (c->src_n && overlaps(c->src, c->src_n, p, n));
		}
	pthread_mutex_unlock(&q_mu);
	return found;
}

struct host_fn_args {
	CUhostFn fn;
	void *arg;
};
static void host_fn_run(const void *a)
{
	const struct host_fn_args *h = a;
	h->fn(h->arg);
}
void rw_fake_cuda_host_fn(const void *stream, CUhostFn fn, void *arg)
{
	struct host_fn_args h = { fn, arg };
	rw_fake_cuda_count(RW_FAKE_N_HOST_FN);
	rw_fake_cuda_submit(stream, host_fn_run, &h, sizeof(h));
}

/* ---- the driver ---- */

static int ctx_refs;

/* Test hook (found with dlsym): primary-context retains not yet released. */
int rw_fake_cuda_ctx_refs(void);
int rw_fake_cuda_ctx_refs(void) { return ctx_refs; }

/* GPUDirect RDMA flushes asked for (cuDeviceGetAttribute says every ordering is NONE, so a
 * mover reading NIC-written device memory must flush first; tests check that it did). */
static unsigned gdr_flushes;
CUresult CUDAAPI cuFlushGPUDirectRDMAWrites(CUflushGPUDirectRDMAWritesTarget t,
					    CUflushGPUDirectRDMAWritesScope s)
{
	(void)t; (void)s;
	__atomic_add_fetch(&gdr_flushes, 1, __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}
unsigned rw_fake_cuda_gdr_flushes(void);
unsigned rw_fake_cuda_gdr_flushes(void) { return __atomic_load_n(&gdr_flushes, __ATOMIC_RELAXED); }

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
	(void)d;
	/* dmabuf export only with RW_FAKE_CUDA_DMABUF=1; 64-bit stream memory operations yes; 132
	 * SMs; VMM with POSIX fds (below); every other attribute asked is 0 (the GPUDirect write ordering among them: NONE, so
	 * a reader must flush) */
	const char *dmabuf = getenv("RW_FAKE_CUDA_DMABUF");
	*v = a == CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED && dmabuf && strcmp(dmabuf, "1") == 0;
	if (a == CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS) /* as every GPU since Volta */
		*v = 1;
	if (a == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) /* an H200's (and an H100 SXM's) */
		*v = 132;
	/* memory lent by fd (tests/cuda/fake_cuda_vmm.c), unless RW_FAKE_CUDA_VMM=0 */
	const char *vmm = getenv("RW_FAKE_CUDA_VMM");
	if ((a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
	     a == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) &&
	    !(vmm && strcmp(vmm, "0") == 0))
		*v = 1;
	return CUDA_SUCCESS;
}

/* RW_FAKE_CUDA_DMABUF=1: a "dmabuf" of a device range is a memfd of its size. No NIC here can
 * register it (tcp refuses every dmabuf, Soft-RoCE has none): it exists so that the daemon's
 * placement goes as far as the registration's answer and its fallback, and closes what it got. */
CUresult CUDAAPI cuMemGetHandleForAddressRange(void *handle, CUdeviceptr dptr, size_t size,
					       CUmemRangeHandleType type, unsigned long long flags)
{
	(void)dptr; (void)flags;
	if (type != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)
		return CUDA_ERROR_INVALID_VALUE;
	int fd = memfd_create("fake-cuda-dmabuf", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
		if (fd >= 0)
			close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*(int *)handle = fd;
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

/* Copies: the synchronous ones at once, the async ones through the stream work queue. */
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr d, const void *s, size_t n)
{
	if (rw_fake_cuda_capture_refuses(NULL))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	memcpy((void *)(uintptr_t)d, s, n);
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n)
{
	if (rw_fake_cuda_capture_refuses(NULL))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	memcpy(d, (const void *)(uintptr_t)s, n);
	return CUDA_SUCCESS;
}
struct fill_args {
	void *dst;
	size_t n;
	unsigned char v;
};
static void fill_run(const void *a)
{
	const struct fill_args *f = a;
	memset(f->dst, f->v, f->n);
}
void rw_fake_cuda_fill(const void *stream, void *dst, unsigned char v, size_t n)
{
	struct fill_args f = { dst, n, v };
	rw_fake_cuda_submit(stream, fill_run, &f, sizeof(f));
}
/* Asynchronous with respect to the host on device memory, on the legacy stream, as the driver
 * does it ("API synchronization behavior"): a caller that then writes the memory on a stream of
 * its own without waiting for the legacy stream may see the fill land on top (with the lag). */
CUresult CUDAAPI cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n)
{
	rw_fake_cuda_fill(NULL, (void *)(uintptr_t)d, v, n);
	return CUDA_SUCCESS;
}

/* Page-locked host memory, as the driver would know it: the ranges cuMemHostAlloc gave and
 * cuMemHostRegister took. An asynchronous copy from the device into any other (pageable) host
 * memory returns only once it is done, as on the real driver ("API synchronization behavior"):
 * a caller that queued such a copy behind a stream wait blocks here as it would on a GPU. */
#define PINNED_MAX 1024
static struct { uintptr_t p; size_t n; } pinned[PINNED_MAX];
static unsigned n_pinned;
static int pinned_lost; /* the table overflowed: no copy is taken for pageable */
static pthread_mutex_t pin_mu = PTHREAD_MUTEX_INITIALIZER;

static void pin_add(uintptr_t p, size_t n)
{
	pthread_mutex_lock(&pin_mu);
	if (n_pinned < PINNED_MAX) {
		pinned[n_pinned].p = p;
		pinned[n_pinned++].n = n;
	} else {
		pinned_lost = 1;
	}
	pthread_mutex_unlock(&pin_mu);
}

static void pin_drop(uintptr_t p)
{
	pthread_mutex_lock(&pin_mu);
	for (unsigned i = 0; i < n_pinned; i++)
		if (pinned[i].p == p) {
			pinned[i] = pinned[--n_pinned];
			break;
		}
	pthread_mutex_unlock(&pin_mu);
}

static int pinned_at(uintptr_t c, size_t n)
{
	int yes = pinned_lost;
	pthread_mutex_lock(&pin_mu);
	for (unsigned i = 0; i < n_pinned && !yes; i++)
		yes = c >= pinned[i].p && c + n <= pinned[i].p + pinned[i].n;
	pthread_mutex_unlock(&pin_mu);
	return yes;
}

CUresult CUDAAPI cuMemHostAlloc(void **p, size_t n, unsigned int f)
{
	(void)f;
	void *m = malloc(n);
	if (!m)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pin_add((uintptr_t)m, n);
	*p = m;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemFreeHost(void *p)
{
	size_t n = 0;
	pthread_mutex_lock(&pin_mu);
	for (unsigned i = 0; i < n_pinned; i++)
		if (pinned[i].p == (uintptr_t)p)
			n = pinned[i].n;
	pthread_mutex_unlock(&pin_mu);
	const unsigned queued = n ? rw_fake_cuda_copies_naming((uintptr_t)p, n) : 0;
	if (queued) /* a copy that lands later writes freed memory: said for the tests */
		fprintf(stderr, "fake cuda: page-locked memory of %zu bytes freed under %u queued "
			"copies\n", n, queued);
	pin_drop((uintptr_t)p);
	free(p);
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemHostRegister(void *p, size_t n, unsigned int f) { (void)f; pin_add((uintptr_t)p, n); return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemHostUnregister(void *p) { pin_drop((uintptr_t)p); return CUDA_SUCCESS; }
struct copy_args {
	void *dst;
	const void *src;
	size_t n;
};
static void copy_run(const void *a)
{
	const struct copy_args *c = a;
	memmove(c->dst, c->src, c->n);
}
static CUresult copy_async(CUstream st, void *d, const void *s, size_t n)
{
	struct copy_args c = { d, s, n };
	rw_fake_cuda_submit_copy(st, copy_run, &c, sizeof(c), (uintptr_t)d, n, (uintptr_t)s, n);
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr d, const void *s, size_t n, CUstream st) { return copy_async(st, (void *)(uintptr_t)d, s, n); }
CUresult CUDAAPI cuMemcpyDtoHAsync(void *d, CUdeviceptr s, size_t n, CUstream st)
{
	CUresult res = copy_async(st, d, (const void *)(uintptr_t)s, n);
	if (res == CUDA_SUCCESS && !pinned_at((uintptr_t)d, n))
		rw_fake_cuda_drain(st); /* into pageable memory: done when it returns */
	return res;
}
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
	return copy_async(st, (void *)(uintptr_t)d, (const void *)(uintptr_t)s, n);
}

/* ---- stream order across processes ----
 * An event is a shared page: `recorded` counts records made (host side, at the call), `done`
 * the records whose preceding stream work has run. A record enqueues "done = n"; a wait reads
 * the record count at the call (the most recent record made before it, as the driver promises)
 * and enqueues "hold the stream until done >= n". A value write enqueues the store; a value
 * wait enqueues "hold until (int32_t)(*addr - v) >= 0". Holds give up after
 * $RW_FAKE_CUDA_WAIT_S (default 20) seconds with a line on stderr, so a broken test fails
 * instead of hanging. Without the lag, stream work runs on the calling thread while its stream
 * has nothing queued; a wait that is not yet satisfied is queued instead (the call returns at
 * once, as the driver's does) and every later item of that stream queues behind it until the
 * queue is empty again. */
struct fake_event_page {
	_Atomic unsigned long long recorded, done;
};
int rw_fake_open_peer_fd(int pid, int fd)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/fd/%d", pid, fd);
	return open(path, O_RDWR | O_CLOEXEC);
}

struct CUevent_st {
	struct fake_event_page *pg;
	int fd;       /* the creator's memfd; -1 for an opened one */
};
struct event_handle_bytes {
	char magic[8]; /* "RWFKEVT" */
	int pid;
	int fd;
};

int rw_fake_cuda_wait_until(int (*ready)(const void *), const void *arg, const char *what)
{
	static int limit_s = -1;
	if (limit_s < 0) {
		const char *e = getenv("RW_FAKE_CUDA_WAIT_S");
		limit_s = e ? atoi(e) : 20;
	}
	const struct timespec tick = { .tv_sec = 0, .tv_nsec = 200000 };
	for (long i = 0; !ready(arg); i++) {
		if (i > (long)limit_s * 5000) {
			fprintf(stderr, "fake cuda: %s still not satisfied after %d s: giving up\n", what,
				limit_s);
			return -1;
		}
		nanosleep(&tick, NULL);
	}
	return 0;
}

CUresult CUDAAPI cuEventCreate(CUevent *e, unsigned int flags)
{
	(void)flags;
	int fd = memfd_create("fake-cuda-event", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, 4096) < 0) {
		if (fd >= 0)
			close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	void *pg = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	struct CUevent_st *ev = pg == MAP_FAILED ? NULL : calloc(1, sizeof(*ev));
	if (!ev) {
		if (pg != MAP_FAILED)
			munmap(pg, 4096);
		close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	ev->pg = pg;
	ev->fd = fd;
	*e = ev;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent e)
{
	if (!e)
		return CUDA_ERROR_INVALID_HANDLE;
	munmap(e->pg, 4096);
	if (e->fd >= 0)
		close(e->fd);
	free(e);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e)
{
	struct event_handle_bytes b = { .magic = "RWFKEVT", .pid = getpid(), .fd = e->fd };
	if (e->fd < 0)
		return CUDA_ERROR_INVALID_VALUE;
	memset(h, 0, sizeof(*h));
	memcpy(h->reserved, &b, sizeof(b));
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle h)
{
	struct event_handle_bytes b;
	memcpy(&b, h.reserved, sizeof(b));
	if (memcmp(b.magic, "RWFKEVT", 8) != 0)
		return CUDA_ERROR_INVALID_VALUE;
	int fd = rw_fake_open_peer_fd(b.pid, b.fd);
	if (fd < 0)
		return CUDA_ERROR_INVALID_HANDLE;
	void *pg = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	struct CUevent_st *ev = pg == MAP_FAILED ? NULL : calloc(1, sizeof(*ev));
	if (!ev) {
		if (pg != MAP_FAILED)
			munmap(pg, 4096);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	ev->pg = pg;
	ev->fd = -1;
	*e = ev;
	return CUDA_SUCCESS;
}

struct ev_args {
	struct fake_event_page *pg;
	unsigned long long n;
};
static void record_run(const void *a)
{
	const struct ev_args *r = a;
	atomic_store(&r->pg->done, r->n);
}
static int event_ready(const void *a)
{
	const struct ev_args *r = a;
	return atomic_load(&r->pg->done) >= r->n;
}
static void event_wait_run(const void *a)
{
	rw_fake_cuda_wait_until(event_ready, a, "cuStreamWaitEvent");
}

CUresult CUDAAPI cuEventRecord(CUevent e, CUstream s)
{
	struct ev_args r = { e->pg, atomic_fetch_add(&e->pg->recorded, 1) + 1 };
	rw_fake_cuda_submit(s, record_run, &r, sizeof(r));
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags)
{
	(void)flags;
	struct ev_args r = { e->pg, atomic_load(&e->pg->recorded) };
	submit(s, event_wait_run, &r, sizeof(r), event_ready, NULL);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventSynchronize(CUevent e)
{
	struct ev_args r = { e->pg, atomic_load(&e->pg->recorded) };
	return rw_fake_cuda_wait_until(event_ready, &r, "cuEventSynchronize") ? CUDA_ERROR_LAUNCH_TIMEOUT
								 : CUDA_SUCCESS;
}

/* Stream memory operations, 32 and 64 bits. The driver takes device memory, or host memory that
 * was page-locked and mapped (cuMemHostRegister / cuMemHostAlloc), at an address aligned to the
 * word; anything else is CUDA_ERROR_INVALID_VALUE at the call, as here. */
struct value_args {
	void *addr;
	uint64_t v;
	int bits;
};
static void value_write_run(const void *a)
{
	const struct value_args *w = a;
	if (w->bits == 32)
		atomic_store((_Atomic uint32_t *)w->addr, (uint32_t)w->v);
	else
		atomic_store((_Atomic uint64_t *)w->addr, w->v);
}
static int value_ready(const void *a)
{
	const struct value_args *w = a;
	if (w->bits == 32)
		return (int32_t)(atomic_load((_Atomic uint32_t *)w->addr) - (uint32_t)w->v) >= 0;
	return (int64_t)(atomic_load((_Atomic uint64_t *)w->addr) - w->v) >= 0;
}
static void value_wait_run(const void *a)
{
	const struct value_args *w = a;
	rw_fake_cuda_wait_until(value_ready, a, w->bits == 32 ? "cuStreamWaitValue32" : "cuStreamWaitValue64");
}

/* Whether the device reaches [p, p + n) as device memory: each stand-in's own allocations and
 * IPC mappings (a strong definition in its file); this default takes every address for one. */
__attribute__((weak)) int rw_fake_cuda_is_device_mem(uintptr_t p, size_t n);
__attribute__((weak)) int rw_fake_cuda_is_device_mem(uintptr_t p, size_t n)
{
	(void)p; (void)n;
	return 1;
}

static CUresult value_op(CUstream s, CUdeviceptr addr, uint64_t v, int bits, int wait,
			 unsigned int flags)
{
	const uintptr_t p = (uintptr_t)addr;
	const size_t n = (size_t)bits / 8;
	if (p == 0 || p % n != 0 || !(rw_fake_cuda_is_device_mem(p, n) || pinned_at(p, n)))
		return CUDA_ERROR_INVALID_VALUE;
	if (wait && (flags & ~(unsigned)CU_STREAM_WAIT_VALUE_FLUSH) != CU_STREAM_WAIT_VALUE_GEQ)
		return CUDA_ERROR_NOT_SUPPORTED;
	struct value_args w = { (void *)p, v, bits };
	if (bits == 64)
		rw_fake_cuda_count(wait ? RW_FAKE_N_WORD_WAIT : RW_FAKE_N_WORD_WRITE);
	/* A wait returns at once, as the driver's: only later work of its own stream is held. */
	submit(s, wait ? value_wait_run : value_write_run, &w, sizeof(w), wait ? value_ready : NULL,
	       NULL);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamWriteValue32(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
{
	return value_op(s, addr, value, 32, 0, flags);
}
CUresult CUDAAPI cuStreamWaitValue32(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
{
	return value_op(s, addr, value, 32, 1, flags);
}
CUresult CUDAAPI cuStreamWriteValue64(CUstream s, CUdeviceptr addr, cuuint64_t value, unsigned int flags)
{
	return value_op(s, addr, value, 64, 0, flags);
}
CUresult CUDAAPI cuStreamWaitValue64(CUstream s, CUdeviceptr addr, cuuint64_t value, unsigned int flags)
{
	return value_op(s, addr, value, 64, 1, flags);
}

/* ---- graphs ----
 * A capture records each item a stream is given (its function, its copied argument, and for a
 * wait its hold) instead of running it; a launch submits the recorded items to a stream in order,
 * each as if it had just been enqueued there: a kernel's block as copied at capture, a wait
 * judged when its turn comes. What the driver refuses during a global-mode capture is refused
 * here too: a host synchronization (cuStreamSynchronize, a synchronous copy)
 * answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and spoils the capture, whose end then answers
 * CUDA_ERROR_STREAM_CAPTURE_INVALIDATED; the legacy stream cannot be captured. */
struct rw_fake_graph {
	struct work *items;
	unsigned n, cap;
	int spoilt;
};
struct rw_fake_graph_exec {
	struct rw_fake_graph *g;
};

/* Locked. */
static int capture_record(struct rw_fake_stream *q, rw_fake_work_fn fn, const void *arg, size_t len,
			  int (*hold)(const void *))
{
	struct rw_fake_graph *g = q->capture;
	if (g->n == g->cap) {
		unsigned cap = g->cap ? 2 * g->cap : 64;
		struct work *w = realloc(g->items, cap * sizeof(*w));
		if (!w) {
			g->spoilt = 1;
			return 0; /* nothing recorded: the end says so */
		}
		g->items = w;
		g->cap = cap;
	}
	struct work *w = &g->items[g->n++];
	w->fn = fn;
	w->hold = hold;
	w->len = len;
	memcpy(w->arg, arg, len);
	return 0;
}

int rw_fake_cuda_capture_refuses(const void *s)
{
	pthread_mutex_lock(&q_mu);
	int refuse = 0;
	for (struct rw_fake_stream *q = streams; q; q = q->next)
		if (q->capture && (!s || q == stream_find(s))) {
			q->capture->spoilt = 1;
			refuse = 1;
		}
	pthread_mutex_unlock(&q_mu);
	return refuse;
}

CUresult CUDAAPI cuStreamBeginCapture(CUstream s, CUstreamCaptureMode mode)
{
	(void)mode;
	pthread_mutex_lock(&q_mu);
	struct rw_fake_stream *q = stream_find(s);
	CUresult res = CUDA_SUCCESS;
	struct rw_fake_graph *g = NULL;
	if (q == &legacy)
		res = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	else if (q->capture)
		res = CUDA_ERROR_ILLEGAL_STATE;
	else if (!(g = calloc(1, sizeof(*g))))
		res = CUDA_ERROR_OUT_OF_MEMORY;
	if (res == CUDA_SUCCESS) {
		q->capture = g;
	}
	pthread_mutex_unlock(&q_mu);
	return res;
}

static void graph_free(struct rw_fake_graph *g)
{
	if (g)
		free(g->items);
	free(g);
}

CUresult CUDAAPI cuStreamEndCapture(CUstream s, CUgraph *graph_p)
{
	pthread_mutex_lock(&q_mu);
	struct rw_fake_stream *q = stream_find(s);
	struct rw_fake_graph *g = q->capture;
	if (g) {
		q->capture = NULL;
	}
	pthread_mutex_unlock(&q_mu);
	*graph_p = NULL;
	if (!g)
		return CUDA_ERROR_ILLEGAL_STATE;
	if (g->spoilt) {
		graph_free(g);
		return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
	}
	*graph_p = (CUgraph)g;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status)
{
	pthread_mutex_lock(&q_mu);
	struct rw_fake_stream *q = stream_find(s);
	*status = !q->capture ? CU_STREAM_CAPTURE_STATUS_NONE
		  : q->capture->spoilt ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
				       : CU_STREAM_CAPTURE_STATUS_ACTIVE;
	pthread_mutex_unlock(&q_mu);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGraphInstantiate(CUgraphExec *exec_p, CUgraph graph, unsigned long long flags)
{
	(void)flags;
	struct rw_fake_graph_exec *e = calloc(1, sizeof(*e));
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->g = (struct rw_fake_graph *)graph;
	*exec_p = (CUgraphExec)e;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGraphLaunch(CUgraphExec exec, CUstream s)
{
	const struct rw_fake_graph *g = ((struct rw_fake_graph_exec *)exec)->g;
	for (unsigned i = 0; i < g->n; i++)
		submit(s, g->items[i].fn, g->items[i].arg, g->items[i].len, g->items[i].hold, NULL);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec exec)
{
	free(exec);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGraphDestroy(CUgraph graph)
{
	graph_free((struct rw_fake_graph *)graph);
	return CUDA_SUCCESS;
}
#endif /* RW_HAVE_CUDA_H */
