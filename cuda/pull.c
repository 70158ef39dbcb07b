/* cuda/pull.c: device memory read into page-locked host memory by copies on a stream of the
 * caller's process, each batch followed by a mark that is a word, not a host function
 * (cuda/rw_cuda.h "pulls"; docs/rankpath.md "The slab areas, lent per group"): the daemon reads
 * its GPU carve-outs' record headers this way, and its loop polls the word. The copies are strided
 * (cuMemcpy2DAsync: `rows` pieces of `width` bytes `pitch` apart), so a batch of records yields
 * their headers and top-k blocks and never their rows. The mark is cuStreamWriteValue64 with the
 * default flags: the driver puts a memory barrier before the write, so a CPU that load-acquires
 * the word at n sees every byte the copies before mark n wrote. Every entry point used here is
 * optional in the driver table: absent, the call answers RW_ERR_UNSUPPORTED. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <stdatomic.h>
#include <stdlib.h>

struct rw_cuda_pull {
	int device;
	CUstream stream;
	_Atomic uint64_t *word;  /* page-locked: the marks landed, written by the stream */
	uint64_t made;           /* marks enqueued (the last one's number) */
};

rw_status_t rw_cuda_pull_create(int device, rw_cuda_pull_t **pull_p)
{
	rw_status_t st = rw_cu_enter(device);
	if (st != RW_OK)
		return st;
	if (!rw_cu.cuMemcpy2DAsync || !rw_cuda_words_supported(device))
		return RW_ERR_UNSUPPORTED;
	rw_cuda_pull_t *p = calloc(1, sizeof(*p));
	if (!p)
		return RW_ERR_NOMEM;
	p->device = device;
	void *w = NULL;
	CUresult res = rw_cu.cuMemHostAlloc(&w, 64, CU_MEMHOSTALLOC_PORTABLE |
					     CU_MEMHOSTALLOC_DEVICEMAP);
	if (res != CUDA_SUCCESS) {
		free(p);
		return rw_cu_fail(res, "cuMemHostAlloc");
	}
	p->word = w;
	atomic_store_explicit(p->word, 0, memory_order_relaxed);
	res = rw_cu.cuStreamCreate(&p->stream, CU_STREAM_NON_BLOCKING);
	if (res != CUDA_SUCCESS) {
		rw_cu.cuMemFreeHost(w);
		free(p);
		return rw_cu_fail(res, "cuStreamCreate");
	}
	*pull_p = p;
	return RW_OK;
}

void rw_cuda_pull_destroy(rw_cuda_pull_t *p)
{
	if (!p)
		return;
	if (rw_cu_enter(p->device) == RW_OK) {
		rw_cu.cuStreamSynchronize(p->stream); /* no copy lands in freed memory */
		rw_cu.cuStreamDestroy(p->stream);
		rw_cu.cuMemFreeHost((void *)p->word);
	}
	free(p);
}

void rw_cuda_pull_abandon(rw_cuda_pull_t *p)
{
	if (!p)
		return;
	/* No wait: the driver frees the stream once its work is done. The word is not freed: a
	 * mark still queued writes it. */
	if (rw_cu_enter(p->device) == RW_OK)
		rw_cu.cuStreamDestroy(p->stream);
	if (rw_cuda_pull_landed(p) == p->made)
		rw_cu.cuMemFreeHost((void *)p->word);
	free(p);
}

int rw_cuda_pull_device(const rw_cuda_pull_t *p) { return p->device; }

rw_status_t rw_cuda_pull_rows(rw_cuda_pull_t *p, void *dst, size_t dst_pitch, rw_cuda_dptr_t src,
			      size_t src_pitch, size_t width, size_t rows)
{
	if (!rows || !width)
		return RW_OK;
	if (!dst || !src || width > dst_pitch || width > src_pitch)
		return RW_ERR_INVAL;
	rw_status_t st = rw_cu_enter(p->device);
	if (st != RW_OK)
		return st;
	CUDA_MEMCPY2D c = { 0 };
	c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
	c.srcDevice = (CUdeviceptr)src;
	c.srcPitch = src_pitch;
	c.dstMemoryType = CU_MEMORYTYPE_HOST;
	c.dstHost = dst;
	c.dstPitch = dst_pitch;
	c.WidthInBytes = width;
	c.Height = rows;
	CUresult res = rw_cu.cuMemcpy2DAsync(&c, p->stream);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, RW_CU_NAME(cuMemcpy2DAsync));
}

rw_status_t rw_cuda_pull_mark(rw_cuda_pull_t *p, uint64_t *mark_p)
{
	CUdeviceptr w = 0;
	rw_status_t st = rw_cu_enter(p->device);
	if (st != RW_OK)
		return st;
	/* With unified addressing the word's host address is its device address; ask anyway. */
	if (rw_cu.cuMemHostGetDevicePointer &&
	    rw_cu.cuMemHostGetDevicePointer(&w, (void *)p->word, 0) != CUDA_SUCCESS)
		w = 0;
	if (!w)
		w = (CUdeviceptr)(uintptr_t)p->word;
	st = rw_cu_value_op(p->device, p->stream, w, p->made + 1, 64, 0);
	if (st != RW_OK)
		return st;
	*mark_p = ++p->made;
	return RW_OK;
}

uint64_t rw_cuda_pull_landed(const rw_cuda_pull_t *p)
{
	return atomic_load_explicit(p->word, memory_order_acquire);
}

rw_status_t rw_cuda_pull_fault(rw_cuda_pull_t *p)
{
	rw_status_t st = rw_cu_enter(p->device);
	if (st != RW_OK)
		return st;
	CUresult res = rw_cu.cuStreamQuery(p->stream);
	if (res == CUDA_SUCCESS || res == CUDA_ERROR_NOT_READY)
		return RW_OK;
	return rw_cu_fail(res, "cuStreamQuery");
}

#endif /* RW_HAVE_CUDA_H */
