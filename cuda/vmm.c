/* cuda/vmm.c: GPU memory lent to other processes by file descriptor (cuda/rw_cuda.h "GPU memory
 * lent by fd"; docs/rankpath.md "The slab areas, lent per group"). The owner makes a physical
 * allocation on one device with the POSIX-fd handle type (cuMemCreate), exports it once
 * (cuMemExportToShareableHandle) and maps it into its own address space (cuMemAddressReserve,
 * cuMemMap, cuMemSetAccess); another process that holds a copy of the fd imports the allocation
 * (cuMemImportFromShareableHandle), maps it the same way and grants its own devices access,
 * each one that is not the allocation's own only where the two devices reach each other
 * (cuDeviceCanAccessPeer). Not cuIpcGetMemHandle: its 64 bytes are a bearer token any process
 * of the node could open, where an fd is a capability only its holder has. Every entry point is
 * optional in the driver table: absent, the answer is RW_ERR_UNSUPPORTED. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct rw_cuda_vmm {
	int device;                         /* the allocation's device, an ordinal here */
	int fd;                             /* the owner's export (-1 for an import) */
	size_t bytes;                       /* the allocation, a multiple of the granularity */
	CUmemGenericAllocationHandle handle;
	CUdeviceptr va;                     /* reserved, 0 when none */
	int mapped;
};

static void say(char *why, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(char *why, size_t cap, const char *fmt, ...)
{
	if (!why || !cap)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(why, cap, fmt, ap);
	va_end(ap);
}

/* The driver's name for a failure, for a reason given to a caller. */
static const char *cu_name(CUresult res)
{
	const char *s = NULL;
	if (!rw_cu.cuGetErrorName || rw_cu.cuGetErrorName(res, &s) != CUDA_SUCCESS || !s)
		return "unknown CUDA error";
	return s;
}

static int have_vmm(void)
{
	return rw_cu.cuMemCreate && rw_cu.cuMemRelease && rw_cu.cuMemExportToShareableHandle &&
	       rw_cu.cuMemImportFromShareableHandle && rw_cu.cuMemAddressReserve &&
	       rw_cu.cuMemAddressFree && rw_cu.cuMemMap && rw_cu.cuMemUnmap &&
	       rw_cu.cuMemSetAccess && rw_cu.cuMemGetAllocationGranularity;
}

static void prop_init(CUmemAllocationProp *p, int device)
{
	memset(p, 0, sizeof(*p));
	p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p->location.id = rw_cu_devices[device].dev;
	p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

int rw_cuda_vmm_supported(int device)
{
	int vmm = 0, posix = 0;
	if (rw_cuda_init() != RW_OK || device < 0 || device >= rw_cu_ndevices || !have_vmm())
		return 0;
	const CUdevice d = rw_cu_devices[device].dev;
	if (rw_cu.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
				       d) != CUDA_SUCCESS ||
	    rw_cu.cuDeviceGetAttribute(&posix,
				       CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
				       d) != CUDA_SUCCESS)
		return 0;
	return vmm && posix;
}

rw_status_t rw_cuda_vmm_granularity(int device, size_t *gran_p)
{
	rw_status_t st = rw_cu_enter(device);
	if (st != RW_OK)
		return st;
	if (!rw_cuda_vmm_supported(device))
		return RW_ERR_UNSUPPORTED;
	CUmemAllocationProp prop;
	prop_init(&prop, device);
	size_t g = 0;
	CUresult res = rw_cu.cuMemGetAllocationGranularity(&g, &prop,
							   CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuMemGetAllocationGranularity");
	if (g == 0 || (g & (g - 1)))
		return RW_ERR_UNSUPPORTED; /* a driver answer nothing here can round to */
	*gran_p = g;
	return RW_OK;
}

static rw_cuda_vmm_t *vmm_new(int device, size_t bytes)
{
	rw_cuda_vmm_t *v = calloc(1, sizeof(*v));
	if (v) {
		v->device = device;
		v->fd = -1;
		v->bytes = bytes;
	}
	return v;
}

/* Map v's allocation at a fresh reservation and grant access to devices[0..n); the reason in
 * why when it fails (v keeps what it got: rw_cuda_vmm_release undoes it). */
static rw_status_t map_access(rw_cuda_vmm_t *v, size_t gran, const int *devices, unsigned n,
			      char *why, size_t cap)
{
	CUresult res = rw_cu.cuMemAddressReserve(&v->va, v->bytes, gran, 0, 0);
	if (res != CUDA_SUCCESS) {
		v->va = 0;
		say(why, cap, "cuMemAddressReserve of %zu bytes failed (%s)", v->bytes, cu_name(res));
		return rw_cu_status(res);
	}
	if ((res = rw_cu.cuMemMap(v->va, v->bytes, 0, v->handle, 0)) != CUDA_SUCCESS) {
		say(why, cap, "cuMemMap failed (%s)", cu_name(res));
		return rw_cu_status(res);
	}
	v->mapped = 1;
	CUmemAccessDesc acc[RW_CUDA_VMM_DEVICES];
	if (n == 0 || n > RW_CUDA_VMM_DEVICES) {
		say(why, cap, "access for %u devices asked (1 to %d)", n, RW_CUDA_VMM_DEVICES);
		return RW_ERR_INVAL;
	}
	for (unsigned i = 0; i < n; i++) {
		const int d = devices[i];
		if (d < 0 || d >= rw_cu_ndevices) {
			say(why, cap, "device %d does not exist here (%d visible)", d, rw_cu_ndevices);
			return RW_ERR_INVAL;
		}
		if (d != v->device) { /* the peer-access rule for another GPU's memory */
			int can = 0;
			if (!rw_cu.cuDeviceCanAccessPeer ||
			    rw_cu.cuDeviceCanAccessPeer(&can, rw_cu_devices[d].dev,
							rw_cu_devices[v->device].dev) != CUDA_SUCCESS ||
			    !can) {
				say(why, cap, "device %d cannot reach device %d's memory (no peer "
				    "access between them)", d, v->device);
				return RW_ERR_UNSUPPORTED;
			}
		}
		memset(&acc[i], 0, sizeof(acc[i]));
		acc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		acc[i].location.id = rw_cu_devices[d].dev;
		acc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	}
	if ((res = rw_cu.cuMemSetAccess(v->va, v->bytes, acc, n)) != CUDA_SUCCESS) {
		say(why, cap, "cuMemSetAccess for %u device(s) failed (%s)", n, cu_name(res));
		return rw_cu_status(res);
	}
	return RW_OK;
}

rw_status_t rw_cuda_vmm_create(int device, size_t bytes, rw_cuda_vmm_t **vmm_p, char *why,
			       size_t cap)
{
	size_t gran = 0;
	rw_status_t st = rw_cuda_vmm_granularity(device, &gran);
	if (st != RW_OK) {
		say(why, cap, "GPU %d makes no memory shareable by fd (cuMemCreate with a POSIX fd "
		    "handle: %s)", device, rw_status_str(st));
		return st;
	}
	if (bytes == 0 || bytes > SIZE_MAX - gran) {
		say(why, cap, "%zu bytes asked", bytes);
		return RW_ERR_INVAL;
	}
	rw_cuda_vmm_t *v = vmm_new(device, (bytes + gran - 1) / gran * gran);
	if (!v)
		return RW_ERR_NOMEM;
	CUmemAllocationProp prop;
	prop_init(&prop, device);
	CUresult res = rw_cu.cuMemCreate(&v->handle, v->bytes, &prop, 0);
	if (res != CUDA_SUCCESS) {
		say(why, cap, "cuMemCreate of %zu bytes on GPU %d failed (%s)", v->bytes, device,
		    cu_name(res));
		free(v);
		return rw_cu_status(res);
	}
	int fd = -1;
	res = rw_cu.cuMemExportToShareableHandle(&fd, v->handle,
						 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (res != CUDA_SUCCESS || fd < 0) {
		say(why, cap, "cuMemExportToShareableHandle failed (%s)",
		    res != CUDA_SUCCESS ? cu_name(res) : "no fd");
		st = res != CUDA_SUCCESS ? rw_cu_status(res) : RW_ERR_UNSUPPORTED;
	} else {
		v->fd = fd;
		st = map_access(v, gran, &device, 1, why, cap);
	}
	if (st != RW_OK) {
		rw_cuda_vmm_release(v);
		return st;
	}
	*vmm_p = v;
	return RW_OK;
}

rw_status_t rw_cuda_vmm_import(int fd, size_t bytes, int device, const int *devices, unsigned n,
			       rw_cuda_vmm_t **vmm_p, char *why, size_t cap)
{
	size_t gran = 0;
	rw_status_t st = rw_cuda_init();
	if (st != RW_OK) {
		say(why, cap, "no CUDA driver (%s)", rw_cuda_unavailable_reason());
		return st;
	}
	if (device < 0 || device >= rw_cu_ndevices) {
		say(why, cap, "the memory's device %d does not exist here (%d visible)", device,
		    rw_cu_ndevices);
		return RW_ERR_INVAL;
	}
	if ((st = rw_cuda_vmm_granularity(device, &gran)) != RW_OK) {
		say(why, cap, "GPU %d maps no memory shared by fd (%s)", device, rw_status_str(st));
		return st;
	}
	if (fd < 0 || bytes == 0 || bytes % gran) {
		say(why, cap, "a bad fd (%d) or size (%zu bytes, granularity %zu)", fd, bytes, gran);
		return RW_ERR_INVAL;
	}
	rw_cuda_vmm_t *v = vmm_new(device, bytes);
	if (!v)
		return RW_ERR_NOMEM;
	CUresult res = rw_cu.cuMemImportFromShareableHandle(&v->handle, (void *)(uintptr_t)fd,
							    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (res != CUDA_SUCCESS) {
		say(why, cap, "cuMemImportFromShareableHandle refused the fd (%s)", cu_name(res));
		free(v);
		return res == CUDA_ERROR_INVALID_VALUE ? RW_ERR_INVAL : rw_cu_status(res);
	}
	if ((st = map_access(v, gran, devices, n, why, cap)) != RW_OK) {
		rw_cuda_vmm_release(v);
		return st;
	}
	*vmm_p = v;
	return RW_OK;
}

void rw_cuda_vmm_release(rw_cuda_vmm_t *v)
{
	if (!v)
		return;
	if (rw_cu_enter(v->device) == RW_OK) { /* the unmap waits for nothing of ours */
		if (v->mapped)
			rw_cu.cuMemUnmap(v->va, v->bytes);
		if (v->va)
			rw_cu.cuMemAddressFree(v->va, v->bytes);
		rw_cu.cuMemRelease(v->handle); /* the memory goes with its last mapping anywhere */
	}
	if (v->fd >= 0)
		close(v->fd);
	free(v);
}

int rw_cuda_vmm_fd(const rw_cuda_vmm_t *v) { return v->fd; }
rw_cuda_dptr_t rw_cuda_vmm_dptr(const rw_cuda_vmm_t *v) { return (rw_cuda_dptr_t)v->va; }
size_t rw_cuda_vmm_bytes(const rw_cuda_vmm_t *v) { return v->bytes; }
int rw_cuda_vmm_device(const rw_cuda_vmm_t *v) { return v->device; }

#endif /* RW_HAVE_CUDA_H */
