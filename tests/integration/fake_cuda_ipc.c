/* tests/integration/fake_cuda_ipc.c: a stand-in libcuda.so.1 whose IPC works across processes,
 * so the integration test runs railwaved's CUDA staging path and rw_rank --cuda on machines
 * without a GPU (loaded through $RW_CUDA_DRIVER by cuda/'s run-time loader). "Device memory" is
 * a memfd mapped shared; an IPC handle names (pid, fd, allocation id, size) and the importer
 * opens /proc/<pid>/fd/<fd> and maps the same pages, so a rank's writes and the daemon's copies
 * meet in the same memory, as with the real driver. Stream work (async copies, host functions,
 * the kernel stand-in's launches) runs at once on the calling thread (the daemon still learns of
 * it only through the stream's eventfd, on its next loop iteration), or with
 * $RW_FAKE_CUDA_LAG_MS late and in order on a worker thread, as a slow GPU would. One device, no
 * kernels (the optional entry points are absent). The rest is not thread-safe: each process calls
 * it from one thread. Devices, contexts, copies and the work queue:
 * tests/cuda/fake_cuda_base.c (shared with the in-process fake). */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cuda.h>

#include "tests/cuda/fake_cuda_base.h"

#define NBLOCKS 256

struct block {
	unsigned char *mem;
	size_t size;
	int fd;                  /* exporter: the memfd; importer: -1 */
	unsigned long long id;   /* the exporter's allocation id */
	int imported;
	int refs;                /* importer: opens of this handle */
	char handle[CU_IPC_HANDLE_SIZE];
};

static struct block blocks[NBLOCKS];
static unsigned long long next_id = 1;

struct handle_bytes {
	char magic[8]; /* "RWFKIPC" */
	int pid;
	int fd;
	unsigned long long id;
	unsigned long long size;
};

static struct block *find(CUdeviceptr p)
{
	for (int i = 0; i < NBLOCKS; i++)
		if (blocks[i].mem && p >= (uintptr_t)blocks[i].mem &&
		    p < (uintptr_t)blocks[i].mem + blocks[i].size)
			return &blocks[i];
	return NULL;
}

int rw_fake_cuda_is_device_mem(uintptr_t p, size_t n)
{
	const struct block *b = find((CUdeviceptr)p);
	return b && p + n <= (uintptr_t)b->mem + b->size;
}

static struct block *slot(void)
{
	for (int i = 0; i < NBLOCKS; i++)
		if (!blocks[i].mem)
			return &blocks[i];
	return NULL;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *p, size_t n)
{
	struct block *b = slot();
	if (!b || n == 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	int fd = memfd_create("rw-fake-cuda", MFD_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	void *m = MAP_FAILED;
	if (ftruncate(fd, (off_t)n) == 0)
		m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED) {
		close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*b = (struct block){ .mem = m, .size = n, .fd = fd, .id = next_id++ };
	*p = (CUdeviceptr)(uintptr_t)m;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemFree(CUdeviceptr p)
{
	struct block *b = find(p);
	if (!b || b->imported || (uintptr_t)b->mem != p)
		return CUDA_ERROR_INVALID_VALUE;
	munmap(b->mem, b->size);
	close(b->fd);
	memset(b, 0, sizeof(*b));
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	struct block *b = find(p);
	if (!b)
		return CUDA_ERROR_NOT_FOUND;
	if (base)
		*base = (CUdeviceptr)(uintptr_t)b->mem;
	if (size)
		*size = b->size;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p)
{
	struct block *b = find(p);
	if (!b)
		return CUDA_ERROR_INVALID_VALUE;
	switch (a) {
	case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
	case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = 0; break;
	case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data = b->id; break;
	default: return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
	struct block *b = find(p);
	if (!b || b->imported || (uintptr_t)b->mem != p)
		return CUDA_ERROR_INVALID_VALUE;
	struct handle_bytes hb = { .magic = "RWFKIPC", .pid = getpid(), .fd = b->fd, .id = b->id,
				   .size = b->size };
	memset(h, 0, sizeof(*h));
	memcpy(h->reserved, &hb, sizeof(hb));
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int f)
{
	(void)f;
	for (int i = 0; i < NBLOCKS; i++) /* the driver's rule: an open handle maps once */
		if (blocks[i].imported && memcmp(blocks[i].handle, h.reserved, CU_IPC_HANDLE_SIZE) == 0) {
			blocks[i].refs++;
			*p = (CUdeviceptr)(uintptr_t)blocks[i].mem;
			return CUDA_SUCCESS;
		}
	struct handle_bytes hb;
	memcpy(&hb, h.reserved, sizeof(hb));
	if (memcmp(hb.magic, "RWFKIPC", 8) != 0 || hb.size == 0)
		return CUDA_ERROR_INVALID_VALUE;
	struct block *b = slot();
	if (!b)
		return CUDA_ERROR_OUT_OF_MEMORY;
	int fd = rw_fake_open_peer_fd(hb.pid, hb.fd);
	if (fd < 0)
		return CUDA_ERROR_INVALID_VALUE;
	struct stat stt;
	void *m = MAP_FAILED;
	if (fstat(fd, &stt) == 0 && (unsigned long long)stt.st_size == hb.size)
		m = mmap(NULL, hb.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED)
		return CUDA_ERROR_INVALID_VALUE;
	*b = (struct block){ .mem = m, .size = hb.size, .fd = -1, .id = 1000000 + next_id++,
			     .imported = 1, .refs = 1 };
	memcpy(b->handle, h.reserved, CU_IPC_HANDLE_SIZE);
	*p = (CUdeviceptr)(uintptr_t)m;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr p)
{
	struct block *b = find(p);
	if (!b || !b->imported || (uintptr_t)b->mem != p)
		return CUDA_ERROR_INVALID_VALUE;
	if (--b->refs == 0) {
		/* A GPU would fault (or the driver wait) on a copy into a closed mapping: said on
		 * stderr for the tests (svc_drainstop), and the copy then faults here too. */
		const unsigned queued = rw_fake_cuda_copies_naming((uintptr_t)b->mem, b->size);
		if (queued)
			fprintf(stderr, "fake cuda: IPC mapping of %zu bytes closed under %u queued "
				"copies\n", b->size, queued);
		munmap(b->mem, b->size);
		memset(b, 0, sizeof(*b));
	}
	return CUDA_SUCCESS;
}

/* Streams are fake_cuda_base.c's queues (at once, or in order on a worker thread per stream with
 * $RW_FAKE_CUDA_LAG_MS). A synchronize that found work queued says so on stderr (the
 * integration tests count the daemon's blocking waits). */
CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned int f)
{
	(void)f;
	*s = (CUstream)rw_fake_cuda_stream_create();
	return *s ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
/* Priorities as a Hopper GPU reports them (least 0, greatest -5); the stand-in's queues run every
 * stream alike, so a priority changes nothing here (tools/bench_rank.c --priority). */
CUresult CUDAAPI cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
	if (least)
		*least = 0;
	if (greatest)
		*greatest = -5;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *s, unsigned int f, int priority)
{
	return priority < -5 || priority > 0 ? CUDA_ERROR_INVALID_VALUE : cuStreamCreate(s, f);
}
CUresult CUDAAPI cuStreamDestroy(CUstream s) { rw_fake_cuda_stream_destroy(s); return CUDA_SUCCESS; }
CUresult CUDAAPI cuStreamQuery(CUstream s) { return rw_fake_cuda_busy(s) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS; }
CUresult CUDAAPI cuStreamSynchronize(CUstream s)
{
	if (rw_fake_cuda_capture_refuses(s))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	unsigned n = rw_fake_cuda_drain(s);
	if (n)
		fprintf(stderr, "fake cuda: cuStreamSynchronize blocked for %u queued items\n", n);
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLaunchHostFunc(CUstream s, CUhostFn fn, void *arg)
{
	rw_fake_cuda_host_fn(s, fn, arg);
	return CUDA_SUCCESS;
}
#endif /* RW_HAVE_CUDA_H */
