/* cuda/words.c: 64-bit words in shared memory written and waited on by a stream
 * (cuStreamWriteValue64 / cuStreamWaitValue64), on a stream of the caller's or one of ours: the
 * hand-offs between a rank's stream and railwaved (docs/rankpath.md "The rank page"). The 32-bit
 * flags of stream-ordered submission (cuda/event.c) go through the same function. Every entry
 * point used here is optional in the driver table: absent, the call answers RW_ERR_UNSUPPORTED. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H

int rw_cuda_words_supported(int device)
{
	int yes = 0;
	if (rw_cuda_init() != RW_OK || device < 0 || device >= rw_cu_ndevices ||
	    !rw_cu.cuStreamWriteValue64 || !rw_cu.cuStreamWaitValue64)
		return 0;
	if (rw_cu.cuDeviceGetAttribute(&yes, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
				       rw_cu_devices[device].dev) != CUDA_SUCCESS)
		return 0;
	return yes != 0;
}

rw_status_t rw_cu_value_op(int device, CUstream h, rw_cuda_dptr_t addr, uint64_t value, int bits,
			   int wait)
{
	CUresult res;
	const char *what;
	if (addr == 0 || (addr & (uint64_t)(bits / 8 - 1)) != 0)
		return RW_ERR_INVAL;
	rw_status_t st = rw_cu_enter(device);
	if (st != RW_OK)
		return st;
	if (bits == 32 && wait) {
		if (!rw_cu.cuStreamWaitValue32)
			return RW_ERR_UNSUPPORTED;
		what = "cuStreamWaitValue32";
		res = rw_cu.cuStreamWaitValue32(h, (CUdeviceptr)addr, (cuuint32_t)value,
						CU_STREAM_WAIT_VALUE_GEQ);
	} else if (bits == 32) {
		if (!rw_cu.cuStreamWriteValue32)
			return RW_ERR_UNSUPPORTED;
		what = "cuStreamWriteValue32";
		res = rw_cu.cuStreamWriteValue32(h, (CUdeviceptr)addr, (cuuint32_t)value,
						 CU_STREAM_WRITE_VALUE_DEFAULT);
	} else if (wait) {
		if (!rw_cu.cuStreamWaitValue64)
			return RW_ERR_UNSUPPORTED;
		what = "cuStreamWaitValue64";
		res = rw_cu.cuStreamWaitValue64(h, (CUdeviceptr)addr, value, CU_STREAM_WAIT_VALUE_GEQ);
	} else {
		if (!rw_cu.cuStreamWriteValue64)
			return RW_ERR_UNSUPPORTED;
		what = "cuStreamWriteValue64";
		/* The default flags put a memory barrier before the write: what the stream wrote
		 * before it is visible to whoever reads the word (docs/rankpath.md pairs P1, P3, P5). */
		res = rw_cu.cuStreamWriteValue64(h, (CUdeviceptr)addr, value,
						 CU_STREAM_WRITE_VALUE_DEFAULT);
	}
	if (res == CUDA_SUCCESS)
		return RW_OK;
	return res == CUDA_ERROR_INVALID_VALUE ? RW_ERR_INVAL : rw_cu_fail(res, what);
}

rw_status_t rw_cuda_ext_stream_of(rw_cuda_stream_t *stream, rw_cuda_ext_stream_t *ext_p)
{
	ext_p->device = rw_cuda_stream_device(stream);
	ext_p->handle = (uint64_t)(uintptr_t)rw_cu_stream_handle(stream);
	return RW_OK;
}

rw_status_t rw_cuda_word_write(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t addr, uint64_t value)
{
	return rw_cu_value_op(s->device, (CUstream)(uintptr_t)s->handle, addr, value, 64, 0);
}

rw_status_t rw_cuda_word_wait(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t addr, uint64_t value)
{
	return rw_cu_value_op(s->device, (CUstream)(uintptr_t)s->handle, addr, value, 64, 1);
}
#endif /* RW_HAVE_CUDA_H */
