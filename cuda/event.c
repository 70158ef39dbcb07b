/* cuda/event.c: stream order across processes (docs/cuda.md "Stream-ordered submission"): CUDA
 * IPC events a trainer records after producing a submission's inputs and the daemon's streams
 * wait on, and 32-bit flags in device memory the daemon writes on its stream after the outputs
 * (cuStreamWriteValue32) and a trainer's stream waits on (cuStreamWaitValue32), so dispatch ->
 * experts -> combine can be enqueued without a host synchronization (the value operations
 * themselves: cuda/words.c). Every entry point here is optional in the driver table: absent, the
 * call answers RW_ERR_UNSUPPORTED. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <stdlib.h>
#include <string.h>

struct rw_cuda_event {
	int device;
	CUevent ev;
};

static int have_events(void)
{
	return rw_cu.cuEventCreate && rw_cu.cuEventRecord && rw_cu.cuEventDestroy &&
	       rw_cu.cuIpcGetEventHandle && rw_cu.cuIpcOpenEventHandle && rw_cu.cuStreamWaitEvent;
}

static rw_status_t event_new(int device, rw_cuda_event_t **ev_p)
{
	if (!have_events())
		return RW_ERR_UNSUPPORTED;
	rw_status_t st = rw_cu_enter(device);
	if (st != RW_OK)
		return st;
	*ev_p = calloc(1, sizeof(**ev_p));
	if (!*ev_p)
		return RW_ERR_NOMEM;
	(*ev_p)->device = device;
	return RW_OK;
}

rw_status_t rw_cuda_event_export(int device, rw_cuda_event_t **ev_p,
				 uint8_t handle[RW_CUDA_IPC_HANDLE_BYTES])
{
	rw_status_t st = event_new(device, ev_p);
	if (st != RW_OK)
		return st;
	rw_cuda_event_t *e = *ev_p;
	CUresult res = rw_cu.cuEventCreate(&e->ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
	if (res != CUDA_SUCCESS) {
		free(e);
		*ev_p = NULL;
		return rw_cu_fail(res, "cuEventCreate(interprocess)");
	}
	CUipcEventHandle h;
	res = rw_cu.cuIpcGetEventHandle(&h, e->ev);
	if (res != CUDA_SUCCESS) {
		rw_cuda_event_destroy(e);
		*ev_p = NULL;
		return rw_cu_fail(res, "cuIpcGetEventHandle");
	}
	memcpy(handle, h.reserved, RW_CUDA_IPC_HANDLE_BYTES);
	return RW_OK;
}

rw_status_t rw_cuda_event_import(int device, const uint8_t handle[RW_CUDA_IPC_HANDLE_BYTES],
				 rw_cuda_event_t **ev_p)
{
	rw_status_t st = event_new(device, ev_p);
	if (st != RW_OK)
		return st;
	CUipcEventHandle h;
	memcpy(h.reserved, handle, RW_CUDA_IPC_HANDLE_BYTES);
	CUresult res = rw_cu.cuIpcOpenEventHandle(&(*ev_p)->ev, h);
	if (res != CUDA_SUCCESS) {
		free(*ev_p);
		*ev_p = NULL;
		return res == CUDA_ERROR_INVALID_VALUE || res == CUDA_ERROR_INVALID_HANDLE
			       ? RW_ERR_INVAL : rw_cu_fail(res, "cuIpcOpenEventHandle");
	}
	return RW_OK;
}

void rw_cuda_event_destroy(rw_cuda_event_t *e)
{
	if (!e)
		return;
	if (rw_cu_enter(e->device) == RW_OK)
		rw_cu.cuEventDestroy(e->ev);
	free(e);
}

rw_status_t rw_cuda_event_record(rw_cuda_event_t *e, rw_cuda_stream_t *s)
{
	rw_status_t st = rw_cu_enter(e->device);
	if (st != RW_OK)
		return st;
	CUresult res = rw_cu.cuEventRecord(e->ev, rw_cu_stream_handle(s));
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuEventRecord");
}

rw_status_t rw_cuda_event_sync(rw_cuda_event_t *e)
{
	if (!rw_cu.cuEventSynchronize)
		return RW_ERR_UNSUPPORTED;
	rw_status_t st = rw_cu_enter(e->device);
	if (st != RW_OK)
		return st;
	CUresult res = rw_cu.cuEventSynchronize(e->ev);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuEventSynchronize");
}

rw_status_t rw_cuda_write_u32(int device, rw_cuda_dptr_t addr, uint32_t value)
{
	rw_status_t st = rw_cu_enter(device);
	if (st != RW_OK)
		return st;
	CUresult res = rw_cu.cuMemcpyHtoD((CUdeviceptr)addr, &value, sizeof(value));
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuMemcpyHtoD(flag)");
}

rw_status_t rw_cuda_stream_wait_event(rw_cuda_stream_t *s, rw_cuda_event_t *e)
{
	rw_status_t st = rw_cu_enter(rw_cuda_stream_device(s));
	if (st != RW_OK)
		return st;
	CUresult res = rw_cu.cuStreamWaitEvent(rw_cu_stream_handle(s), e->ev, 0);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuStreamWaitEvent");
}

rw_status_t rw_cuda_stream_write_u32(rw_cuda_stream_t *s, rw_cuda_dptr_t addr, uint32_t value)
{
	return rw_cu_value_op(rw_cuda_stream_device(s), rw_cu_stream_handle(s), addr, value, 32, 0);
}

rw_status_t rw_cuda_stream_wait_u32(rw_cuda_stream_t *s, rw_cuda_dptr_t addr, uint32_t value)
{
	return rw_cu_value_op(rw_cuda_stream_device(s), rw_cu_stream_handle(s), addr, value, 32, 1);
}
#endif /* RW_HAVE_CUDA_H */
