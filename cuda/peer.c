/* cuda/peer.c: peer access between two devices' contexts (docs/cuda.md "Several GPUs"). A kernel
 * on device A may read or write device B's memory only once A's context has peer access to B
 * (cuCtxEnablePeerAccess, where cuDeviceCanAccessPeer says the two reach each other: NVLink, or
 * PCIe under one root complex); without it the access faults and A's context is lost. Both entry
 * points are optional in the driver table: absent, the answer is RW_ERR_UNSUPPORTED. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H

rw_status_t rw_cuda_peer_enable(int device, int peer)
{
	rw_status_t st = rw_cuda_init(); /* the table is valid after it */
	if (st != RW_OK || device == peer)
		return st;
	if (!rw_cu.cuDeviceCanAccessPeer || !rw_cu.cuCtxEnablePeerAccess)
		return RW_ERR_UNSUPPORTED;
	if (peer < 0 || peer >= rw_cu_ndevices)
		return RW_ERR_INVAL;
	if ((st = rw_cu_enter(peer)) != RW_OK) /* the peer's primary context, retained */
		return st;
	if (st != RW_OK)
		return st;
	CUcontext peer_ctx = rw_cu_devices[peer].ctx;
	if ((st = rw_cu_enter(device)) != RW_OK)
		return st;
	int can = 0;
	CUresult res = rw_cu.cuDeviceCanAccessPeer(&can, rw_cu_devices[device].dev,
						   rw_cu_devices[peer].dev);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuDeviceCanAccessPeer");
	if (!can)
		return RW_ERR_UNSUPPORTED;
	res = rw_cu.cuCtxEnablePeerAccess(peer_ctx, 0);
	if (res == CUDA_SUCCESS || res == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
		return RW_OK;
	return rw_cu_fail(res, "cuCtxEnablePeerAccess");
}

#endif /* RW_HAVE_CUDA_H */
