/* tests/cuda/fake_libcuda.c: a stand-in for libcuda.so.1 (loaded through $RW_CUDA_DRIVER) so the
 * IPC cache and stream logic run in CI without a GPU. "Device memory" is host memory. It copies
 * the two driver behaviours the cache relies on:
 *  - cuIpcOpenMemHandle refcounts per handle bytes: opening bytes already open returns the
 *    existing address (cuda.h: "the reference count on the handle is incremented by 1 and the
 *    existing device pointer is returned");
 *  - handle bytes name an allocation *slot*, reused after cuMemFree, so a freed-and-reallocated
 *    buffer gets the same handle bytes (the worst case the cache must survive), while the old
 *    memory lives on as long as an importer keeps it open.
 * Host functions run when the stream is not held (rw_fake_cuda_hold), else on synchronize.
 * Devices, contexts and copies: tests/cuda/fake_cuda_base.c (shared with the cross-process
 * fake of tests/integration/). */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "tests/cuda/fake_cuda_base.h"

#define NSLOTS 64
#define NOPEN 64
#define NHOST 64

struct block {
	unsigned char *mem;
	size_t size;
	unsigned long long buffer_id;
	int live;      /* not freed by the exporter */
	int open_refs; /* importer opens (the memory stays until both are gone) */
};

static struct block *slots[NSLOTS]; /* the exporter's allocations; a slot is reused after free */
static struct { char bytes[CU_IPC_HANDLE_SIZE]; struct block *blk; int refs; } opens[NOPEN];
static unsigned long long next_buffer_id = 1;
static int held;
static struct { CUhostFn fn; void *arg; } queued[NHOST];
static int nqueued;

/* Test hooks (found with dlsym). */
void rw_fake_cuda_hold(int hold);
int rw_fake_cuda_live_blocks(void);

static int live_blocks;

static void run_queued(void)
{
	for (int i = 0; i < nqueued; i++)
		queued[i].fn(queued[i].arg);
	nqueued = 0;
}

void rw_fake_cuda_hold(int hold)
{
	held = hold;
	if (!held)
		run_queued();
}

int rw_fake_cuda_live_blocks(void) { return live_blocks; }

static void block_maybe_free(struct block *b)
{
	if (!b->live && b->open_refs == 0) {
		free(b->mem);
		free(b);
		live_blocks--;
	}
}

static int contains(const struct block *b, CUdeviceptr p)
{
	return b && p >= (uintptr_t)b->mem && p < (uintptr_t)b->mem + b->size;
}

static struct block *find_block(CUdeviceptr p)
{
	for (int i = 0; i < NSLOTS; i++)
		if (contains(slots[i], p))
			return slots[i];
	for (int o = 0; o < NOPEN; o++)
		if (opens[o].refs && contains(opens[o].blk, p))
			return opens[o].blk;
	return NULL;
}

int rw_fake_cuda_is_device_mem(uintptr_t p, size_t n)
{
	const struct block *b = find_block((CUdeviceptr)p);
	return b && p + n <= (uintptr_t)b->mem + b->size;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *p, size_t n)
{
	for (int i = 0; i < NSLOTS; i++) {
		struct block *b;
		if (slots[i])
			continue;
		b = calloc(1, sizeof(*b));
		if (!b || !(b->mem = calloc(1, n))) {
			free(b);
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
		b->size = n;
		b->buffer_id = next_buffer_id++;
		b->live = 1;
		slots[i] = b;
		live_blocks++;
		*p = (CUdeviceptr)(uintptr_t)b->mem;
		return CUDA_SUCCESS;
	}
	return CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult CUDAAPI cuMemFree(CUdeviceptr p)
{
	for (int i = 0; i < NSLOTS; i++) {
		struct block *b = slots[i];
		if (b && (uintptr_t)b->mem == p) {
			slots[i] = NULL;
			b->live = 0;
			block_maybe_free(b);
			return CUDA_SUCCESS;
		}
	}
	return CUDA_ERROR_INVALID_VALUE;
}
CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	struct block *b = find_block(p);
	if (!b)
		return CUDA_ERROR_NOT_FOUND;
	if (base) *base = (CUdeviceptr)(uintptr_t)b->mem;
	if (size) *size = b->size;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p)
{
	struct block *b = find_block(p);
	if (!b)
		return CUDA_ERROR_INVALID_VALUE;
	switch (a) {
	case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
	case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = 0; break;
	case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data = b->buffer_id; break;
	default: return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
	for (int i = 0; i < NSLOTS; i++) {
		if (slots[i] && (uintptr_t)slots[i]->mem == p) {
			memset(h, 0, sizeof(*h));
			memcpy(h->reserved, "FAKEIPC", 7);
			h->reserved[8] = (char)i; /* the slot: a reallocation gets the same bytes */
			return CUDA_SUCCESS;
		}
	}
	return CUDA_ERROR_INVALID_VALUE;
}
CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int f)
{
	int i, free_o = -1;
	(void)f;
	for (int o = 0; o < NOPEN; o++) {
		if (opens[o].refs && memcmp(opens[o].bytes, h.reserved, CU_IPC_HANDLE_SIZE) == 0) {
			opens[o].refs++; /* the existing mapping, even if the slot was reallocated */
			*p = (CUdeviceptr)(uintptr_t)opens[o].blk->mem;
			return CUDA_SUCCESS;
		}
		if (!opens[o].refs && free_o < 0)
			free_o = o;
	}
	if (memcmp(h.reserved, "FAKEIPC", 7) != 0)
		return CUDA_ERROR_INVALID_VALUE;
	i = (unsigned char)h.reserved[8];
	if (i >= NSLOTS || !slots[i] || free_o < 0)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(opens[free_o].bytes, h.reserved, CU_IPC_HANDLE_SIZE);
	opens[free_o].blk = slots[i];
	opens[free_o].refs = 1;
	slots[i]->open_refs++;
	*p = (CUdeviceptr)(uintptr_t)slots[i]->mem;
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr p)
{
	for (int o = 0; o < NOPEN; o++) {
		if (opens[o].refs && (uintptr_t)opens[o].blk->mem == p) {
			if (--opens[o].refs == 0) {
				opens[o].blk->open_refs--;
				block_maybe_free(opens[o].blk);
				opens[o].blk = NULL;
			}
			return CUDA_SUCCESS;
		}
	}
	return CUDA_ERROR_INVALID_VALUE;
}

/* Streams are fake_cuda_base.c's queues, so a stream memory operation's wait holds its own
 * stream's later work; host functions keep this file's hold (rw_fake_cuda_hold), and queue
 * behind a stream's waiting work so they stay in stream order. */
CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned int f)
{
	(void)f;
	*s = (CUstream)rw_fake_cuda_stream_create();
	return *s ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult CUDAAPI cuStreamDestroy(CUstream s) { rw_fake_cuda_stream_destroy(s); return CUDA_SUCCESS; }
CUresult CUDAAPI cuStreamQuery(CUstream s)
{
	return nqueued || rw_fake_cuda_busy(s) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream s)
{
	if (rw_fake_cuda_capture_refuses(s))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	rw_fake_cuda_drain(s);
	run_queued();
	return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLaunchHostFunc(CUstream s, CUhostFn fn, void *arg)
{
	if (!held) {
		rw_fake_cuda_host_fn(s, fn, arg);
		return CUDA_SUCCESS;
	}
	if (nqueued == NHOST)
		return CUDA_ERROR_OUT_OF_MEMORY;
	rw_fake_cuda_count(RW_FAKE_N_HOST_FN);
	queued[nqueued].fn = fn;
	queued[nqueued].arg = arg;
	nqueued++;
	return CUDA_SUCCESS;
}
#endif /* RW_HAVE_CUDA_H */
