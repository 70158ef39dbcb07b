/* cuda/stream.c: streams whose completions an event loop can watch without blocking.
 * A mark is a host function (cuLaunchHostFunc) enqueued behind the work: when the stream reaches
 * it, a driver thread bumps the stream's completed-mark counter and writes the eventfd; the loop
 * sees the fd readable and rw_cuda_stream_poll() hands out the tokens in order. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

struct rw_cuda_stream {
	int device;
	CUstream stream;
	int efd;
	/* Loop-thread-only: tokens of marks made (tail) and handed out (head); free-running. */
	uint32_t head, tail;
	uint64_t tokens[RW_CUDA_STREAM_MAX_MARKS];
	/* Written by the driver's callback thread (release), read by the loop (acquire): the number
	 * of marks completed so far, so tokens[head .. done) may be handed out. */
	_Atomic uint32_t done;
};

static void CUDA_CB mark_done(void *arg)
{
	rw_cuda_stream_t *s = arg;
	uint64_t one = 1;
	ssize_t n;

	/* No CUDA calls allowed here (driver rule for host functions). */
	atomic_fetch_add_explicit(&s->done, 1, memory_order_release); /* pairs with poll's acquire */
	do {
		n = write(s->efd, &one, sizeof(one));
	} while (n < 0 && errno == EINTR);
	/* EAGAIN means the counter is saturated: the fd is readable anyway. */
}

rw_status_t rw_cuda_stream_create(int device, rw_cuda_stream_t **stream_p)
{
	return rw_cuda_stream_create_prio(device, 0, stream_p, NULL);
}

rw_status_t rw_cuda_stream_create_prio(int device, int high, rw_cuda_stream_t **stream_p,
				       int *priority_p)
{
	rw_status_t st = rw_cu_enter(device);
	rw_cuda_stream_t *s;
	CUresult res;
	int least = 0, greatest = 0;

	if (st != RW_OK)
		return st;
	if (high) {
		if (!rw_cu.cuStreamCreateWithPriority || !rw_cu.cuCtxGetStreamPriorityRange)
			return RW_ERR_UNSUPPORTED;
		res = rw_cu.cuCtxGetStreamPriorityRange(&least, &greatest);
		if (res != CUDA_SUCCESS)
			return rw_cu_fail(res, "cuCtxGetStreamPriorityRange");
	}
	s = calloc(1, sizeof(*s));
	if (s == NULL)
		return RW_ERR_NOMEM;
	s->device = device;
	s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (s->efd < 0) {
		rw_err("cuda: eventfd: %m");
		st = RW_ERR_SYS;
		goto fail_free;
	}
	res = high ? rw_cu.cuStreamCreateWithPriority(&s->stream, CU_STREAM_NON_BLOCKING, greatest)
		   : rw_cu.cuStreamCreate(&s->stream, CU_STREAM_NON_BLOCKING);
	if (res != CUDA_SUCCESS) {
		st = rw_cu_fail(res, high ? "cuStreamCreateWithPriority" : "cuStreamCreate");
		goto fail_close;
	}
	atomic_init(&s->done, 0);
	if (priority_p)
		*priority_p = high ? greatest : least;
	*stream_p = s;
	return RW_OK;

fail_close:
	close(s->efd);
fail_free:
	free(s);
	return st;
}

void rw_cuda_stream_destroy(rw_cuda_stream_t *s)
{
	if (s == NULL)
		return;
	if (rw_cu_enter(s->device) == RW_OK) {
		/* Host functions still queued reference s: let them run before freeing it. */
		rw_cu.cuStreamSynchronize(s->stream);
		rw_cu.cuStreamDestroy(s->stream);
	}
	close(s->efd);
	free(s);
}

void rw_cuda_stream_abandon(rw_cuda_stream_t *s)
{
	if (s == NULL)
		return;
	/* No wait: the driver frees the stream once its work is done. s and its eventfd stay while
	 * a mark's host function is still queued (it writes them). */
	if (rw_cu_enter(s->device) == RW_OK)
		rw_cu.cuStreamDestroy(s->stream);
	if (atomic_load_explicit(&s->done, memory_order_acquire) != s->tail)
		return;
	close(s->efd);
	free(s);
}

int rw_cuda_stream_device(const rw_cuda_stream_t *s) { return s->device; }
int rw_cuda_stream_fd(const rw_cuda_stream_t *s) { return s->efd; }

CUstream rw_cu_stream_handle(rw_cuda_stream_t *s) { return s->stream; }

rw_status_t rw_cuda_copy_dtoh_async(rw_cuda_stream_t *s, void *dst, rw_cuda_dptr_t src, size_t bytes)
{
	rw_status_t st = rw_cu_enter(s->device);
	CUresult res;

	if (st != RW_OK)
		return st;
	res = rw_cu.cuMemcpyDtoHAsync(dst, (CUdeviceptr)src, bytes, s->stream);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuMemcpyDtoHAsync");
}

rw_status_t rw_cuda_copy_htod_async(rw_cuda_stream_t *s, rw_cuda_dptr_t dst, const void *src,
				    size_t bytes)
{
	rw_status_t st = rw_cu_enter(s->device);
	CUresult res;

	if (st != RW_OK)
		return st;
	res = rw_cu.cuMemcpyHtoDAsync((CUdeviceptr)dst, src, bytes, s->stream);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuMemcpyHtoDAsync");
}

rw_status_t rw_cuda_copy_dtod_async(rw_cuda_stream_t *s, rw_cuda_dptr_t dst, rw_cuda_dptr_t src,
				    size_t bytes)
{
	rw_status_t st = rw_cu_enter(s->device);
	CUresult res;

	if (st != RW_OK)
		return st;
	res = rw_cu.cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes, s->stream);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuMemcpyDtoDAsync");
}

rw_status_t rw_cuda_copy_ext(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t dst, rw_cuda_dptr_t src,
			     size_t bytes)
{
	if (s == NULL || dst == 0 || src == 0)
		return RW_ERR_INVAL;
	rw_status_t st = rw_cu_enter(s->device);
	if (st != RW_OK)
		return st;
	CUresult res = rw_cu.cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes,
					       (CUstream)(uintptr_t)s->handle);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuMemcpyDtoDAsync");
}

rw_status_t rw_cuda_memset_async(rw_cuda_stream_t *s, rw_cuda_dptr_t dst, uint8_t value,
				 size_t bytes)
{
	rw_status_t st = rw_cu_enter(s->device);
	CUresult res;

	if (st != RW_OK)
		return st;
	if (!rw_cu.cuMemsetD8Async)
		return RW_ERR_UNSUPPORTED;
	res = rw_cu.cuMemsetD8Async((CUdeviceptr)dst, value, bytes, s->stream);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuMemsetD8Async");
}

rw_status_t rw_cuda_stream_mark(rw_cuda_stream_t *s, uint64_t token)
{
	rw_status_t st;
	CUresult res;

	if (s->tail - s->head >= RW_CUDA_STREAM_MAX_MARKS)
		return RW_ERR_AGAIN;
	st = rw_cu_enter(s->device);
	if (st != RW_OK)
		return st;
	s->tokens[s->tail % RW_CUDA_STREAM_MAX_MARKS] = token;
	res = rw_cu.cuLaunchHostFunc(s->stream, mark_done, s);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuLaunchHostFunc");
	s->tail++;
	return RW_OK;
}

int rw_cuda_stream_poll(rw_cuda_stream_t *s, uint64_t *tokens_p, int max)
{
	uint64_t counter;
	uint32_t done;
	int n = 0;
	CUresult res;

	while (read(s->efd, &counter, sizeof(counter)) == (ssize_t)sizeof(counter))
		; /* drain: the count we trust is `done` */
	done = atomic_load_explicit(&s->done, memory_order_acquire); /* pairs with mark_done */
	while (n < max && s->head != done) {
		tokens_p[n++] = s->tokens[s->head % RW_CUDA_STREAM_MAX_MARKS];
		s->head++;
	}
	if (n == 0 && s->head != s->tail) {
		/* Marks pending and none done: a faulted stream never runs them; notice it. */
		if (rw_cu_enter(s->device) != RW_OK)
			return RW_ERR_SYS;
		res = rw_cu.cuStreamQuery(s->stream);
		if (res != CUDA_SUCCESS && res != CUDA_ERROR_NOT_READY)
			return (int)rw_cu_fail(res, "stream failed");
	}
	return n;
}

rw_status_t rw_cuda_stream_sync(rw_cuda_stream_t *s)
{
	rw_status_t st = rw_cu_enter(s->device);
	CUresult res;

	if (st != RW_OK)
		return st;
	res = rw_cu.cuStreamSynchronize(s->stream);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuStreamSynchronize");
}

#endif /* RW_HAVE_CUDA_H */
