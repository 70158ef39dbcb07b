/* tests/cuda/fake_cuda_vmm.c: the driver's virtual memory management calls on the stand-ins
 * (linked into every stand-in libcuda.so.1 beside fake_cuda_base.c), so that memory lent by fd
 * (cuda/vmm.c: the groups' GPU slabs) runs in CI. An allocation is a memfd named after its device
 * ("rw-fake-vmm-d<N>") of a multiple of the granularity (2 MiB, a Hopper GPU's); its export is a
 * copy of that fd, which any process can import (the name and size are checked: any other fd is
 * CUDA_ERROR_INVALID_VALUE, as the driver refuses an fd that is no export). A reservation is an
 * inaccessible range of the address space; cuMemMap puts the memfd's pages there still
 * inaccessible, and cuMemSetAccess opens them read-write: a kernel (the CPU stand-ins) touching
 * memory before its access is set faults, as a GPU's would. Access for a device other than the
 * allocation's is refused with $RW_FAKE_CUDA_NO_P2P=1 (no peer access between them). Switches:
 * $RW_FAKE_CUDA_VMM=0 (no VMM support on any device), $RW_FAKE_CUDA_VMM_FAIL=export|import|access
 * (that call fails: CUDA_ERROR_OUT_OF_MEMORY, INVALID_VALUE, INVALID_DEVICE) or =copy (a
 * cuMemcpy2DAsync out of a mapping answers CUDA_ERROR_ILLEGAL_ADDRESS);
 * $RW_FAKE_CUDA_VMM_NOCPU=1: this process's CPU cannot read or write the mappings, as a discrete
 * GPU's memory behind PCIe (cuMemSetAccess grants the device and leaves the pages PROT_NONE):
 * only the driver's copies reach them (cuMemcpy2DAsync reads through the allocation's fd), so a
 * CPU load or store there faults. The daemon runs with it; the ranks (whose kernels are the CPU
 * stand-ins) without. Another mapping of the exported fd (what a NIC's dmabuf would reach) is
 * not the driver's and stays readable. */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cuda.h>

#include "tests/cuda/fake_cuda_base.h"

#define GRAN ((size_t)2 << 20)
#define NMAP 64
#define MAGIC 0x564d4d46u /* "FMMV" */

struct alloc {
	unsigned magic;
	int fd;
	size_t size;
	int device;
	int refs; /* the handle and each mapping */
};
static struct { uintptr_t va; size_t size; } resv[NMAP];
static struct { uintptr_t va; size_t size; size_t offset; struct alloc *a; int access; } maps[NMAP];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static int failing(const char *what)
{
	const char *e = getenv("RW_FAKE_CUDA_VMM_FAIL");
	return e && strcmp(e, what) == 0;
}

static int devices(void)
{
	int n = 1;
	cuDeviceGetCount(&n);
	return n;
}

static int prop_ok(const CUmemAllocationProp *p)
{
	const char *off = getenv("RW_FAKE_CUDA_VMM");
	return p && !(off && strcmp(off, "0") == 0) && p->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
	       p->location.type == CU_MEM_LOCATION_TYPE_DEVICE && p->location.id >= 0 &&
	       p->location.id < devices() &&
	       (p->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

static void alloc_put(struct alloc *a)
{
	if (--a->refs == 0) {
		close(a->fd);
		a->magic = 0;
		free(a);
	}
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p,
					       CUmemAllocationGranularity_flags o)
{
	(void)o;
	if (!prop_ok(p))
		return CUDA_ERROR_INVALID_VALUE;
	*g = GRAN;
	return CUDA_SUCCESS;
}

static struct alloc *alloc_new(int fd, size_t size, int device)
{
	struct alloc *a = calloc(1, sizeof(*a));
	if (a)
		*a = (struct alloc){ .magic = MAGIC, .fd = fd, .size = size, .device = device,
				     .refs = 1 };
	return a;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
			     const CUmemAllocationProp *p, unsigned long long flags)
{
	if (!prop_ok(p) || flags || size == 0 || size % GRAN)
		return CUDA_ERROR_INVALID_VALUE;
	char name[32];
	snprintf(name, sizeof(name), "rw-fake-vmm-d%d", p->location.id);
	int fd = memfd_create(name, MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
		if (fd >= 0)
			close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	struct alloc *a = alloc_new(fd, size, p->location.id);
	if (!a) {
		close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*h = (CUmemGenericAllocationHandle)(uintptr_t)a;
	return CUDA_SUCCESS;
}

static struct alloc *handle_alloc(CUmemGenericAllocationHandle h)
{
	struct alloc *a = (struct alloc *)(uintptr_t)h;
	return a && a->magic == MAGIC ? a : NULL;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle h)
{
	pthread_mutex_lock(&mu);
	struct alloc *a = handle_alloc(h);
	if (a)
		alloc_put(a);
	pthread_mutex_unlock(&mu);
	return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h,
					      CUmemAllocationHandleType type,
					      unsigned long long flags)
{
	struct alloc *a = handle_alloc(h);
	if (!a || flags || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		return CUDA_ERROR_INVALID_VALUE;
	if (failing("export"))
		return CUDA_ERROR_OUT_OF_MEMORY;
	int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*(int *)out = fd;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os,
						CUmemAllocationHandleType type)
{
	const int fd = (int)(uintptr_t)os;
	if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fd < 0 || failing("import"))
		return CUDA_ERROR_INVALID_VALUE;
	/* An export of ours: a memfd named after its device, of a multiple of the granularity. */
	char link[64], target[128];
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	ssize_t n = readlink(link, target, sizeof(target) - 1);
	int device = -1;
	struct stat st;
	if (n <= 0 || fstat(fd, &st) != 0)
		return CUDA_ERROR_INVALID_VALUE;
	target[n] = 0;
	if (sscanf(target, "/memfd:rw-fake-vmm-d%d", &device) != 1 || device < 0 ||
	    device >= devices() || st.st_size <= 0 || (size_t)st.st_size % GRAN)
		return CUDA_ERROR_INVALID_VALUE;
	int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	struct alloc *a = mine >= 0 ? alloc_new(mine, (size_t)st.st_size, device) : NULL;
	if (!a) {
		if (mine >= 0)
			close(mine);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*h = (CUmemGenericAllocationHandle)(uintptr_t)a;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
				     unsigned long long flags)
{
	(void)addr;
	if (size == 0 || size % GRAN || flags || (align && (align & (align - 1))))
		return CUDA_ERROR_INVALID_VALUE;
	if (align < GRAN)
		align = GRAN;
	/* Over-reserve and trim to an aligned range. */
	unsigned char *m = mmap(NULL, size + align, PROT_NONE,
				MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (m == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	uintptr_t va = ((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1);
	if (va > (uintptr_t)m)
		munmap(m, va - (uintptr_t)m);
	if ((uintptr_t)m + size + align > va + size)
		munmap((void *)(va + size), (uintptr_t)m + size + align - (va + size));
	pthread_mutex_lock(&mu);
	int i = 0;
	while (i < NMAP && resv[i].va)
		i++;
	if (i < NMAP) {
		resv[i].va = va;
		resv[i].size = size;
	}
	pthread_mutex_unlock(&mu);
	if (i == NMAP) {
		munmap((void *)va, size);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*p = (CUdeviceptr)va;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr p, size_t size)
{
	pthread_mutex_lock(&mu);
	CUresult res = CUDA_ERROR_INVALID_VALUE;
	for (int i = 0; i < NMAP; i++)
		if (resv[i].va == (uintptr_t)p && resv[i].size == size) {
			int busy = 0;
			for (int k = 0; k < NMAP; k++)
				busy |= maps[k].va >= p && maps[k].va < p + size;
			if (busy)
				break; /* still mapped: unmap first */
			munmap((void *)(uintptr_t)p, size);
			resv[i].va = 0;
			res = CUDA_SUCCESS;
			break;
		}
	pthread_mutex_unlock(&mu);
	return res;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr p, size_t size, size_t offset,
			  CUmemGenericAllocationHandle h, unsigned long long flags)
{
	pthread_mutex_lock(&mu);
	struct alloc *a = handle_alloc(h);
	int in = 0, k = -1;
	for (int i = 0; i < NMAP; i++) {
		in |= resv[i].va && p >= resv[i].va && p + size <= resv[i].va + resv[i].size;
		if (k < 0 && !maps[i].va)
			k = i;
	}
	CUresult res = CUDA_ERROR_INVALID_VALUE;
	if (a && in && !flags && size && size % GRAN == 0 && offset % GRAN == 0 &&
	    offset + size <= a->size && k >= 0 &&
	    mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd,
		 (off_t)offset) != MAP_FAILED) {
		maps[k].va = p;
		maps[k].size = size;
		maps[k].offset = offset;
		maps[k].a = a;
		maps[k].access = 0;
		a->refs++;
		res = CUDA_SUCCESS;
	}
	pthread_mutex_unlock(&mu);
	return res;
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr p, size_t size)
{
	const unsigned queued = rw_fake_cuda_copies_naming((uintptr_t)p, size);
	if (queued) /* a GPU would fault on them: said for the tests */
		fprintf(stderr, "fake cuda: VMM mapping of %zu bytes unmapped under %u queued copies\n",
			size, queued);
	pthread_mutex_lock(&mu);
	CUresult res = CUDA_ERROR_INVALID_VALUE;
	for (int i = 0; i < NMAP; i++)
		if (maps[i].va == p && maps[i].size == size) {
			/* Back to an inaccessible reservation. */
			mmap((void *)(uintptr_t)p, size, PROT_NONE,
			     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
			alloc_put(maps[i].a);
			maps[i].va = 0;
			maps[i].a = NULL;
			res = CUDA_SUCCESS;
			break;
		}
	pthread_mutex_unlock(&mu);
	return res;
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc,
				size_t count)
{
	if (!desc || !count || failing("access"))
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&mu);
	CUresult res = CUDA_ERROR_INVALID_VALUE;
	for (int i = 0; i < NMAP; i++) {
		if (maps[i].va != p || maps[i].size != size)
			continue;
		res = CUDA_SUCCESS;
		for (size_t j = 0; j < count && res == CUDA_SUCCESS; j++) {
			const CUmemLocation *l = &desc[j].location;
			if (l->type != CU_MEM_LOCATION_TYPE_DEVICE || l->id < 0 || l->id >= devices())
				res = CUDA_ERROR_INVALID_DEVICE;
			else if (l->id != maps[i].a->device && getenv("RW_FAKE_CUDA_NO_P2P"))
				res = CUDA_ERROR_INVALID_DEVICE; /* no peer access between them */
			else if (desc[j].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
				maps[i].access |= 1 << l->id;
		}
		const char *nocpu = getenv("RW_FAKE_CUDA_VMM_NOCPU");
		if (res == CUDA_SUCCESS && maps[i].access && !(nocpu && strcmp(nocpu, "1") == 0) &&
		    mprotect((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE) != 0)
			res = CUDA_ERROR_OUT_OF_MEMORY;
		break;
	}
	pthread_mutex_unlock(&mu);
	return res;
}

/* A strided copy out of device memory into host memory (the daemon's header pulls, cuda/pull.c),
 * as stream work: each row read through the allocation's fd where it lies in a mapping here
 * (which the CPU may not be allowed to read: $RW_FAKE_CUDA_VMM_NOCPU), else copied as it is. */
struct copy2d {
	unsigned char *dst;
	const unsigned char *src;
	size_t dpitch, spitch, width, height;
};

/* Rows of [p, p + n) through the fd of the mapping holding it: 1 done, 0 not a mapping. */
static int vmm_read(void *dst, uintptr_t p, size_t n)
{
	pthread_mutex_lock(&mu);
	int done = 0;
	for (int i = 0; i < NMAP && !done; i++)
		if (maps[i].va && p >= maps[i].va && p + n <= maps[i].va + maps[i].size) {
			const off_t at = (off_t)(maps[i].offset + (p - maps[i].va));
			done = pread(maps[i].a->fd, dst, n, at) == (ssize_t)n ? 1 : -1;
		}
	pthread_mutex_unlock(&mu);
	if (done < 0)
		abort(); /* a short read of a memfd we hold: the stand-in is broken */
	return done;
}

static void copy2d_run(const void *arg)
{
	const struct copy2d *c = arg;
	for (size_t i = 0; i < c->height; i++) {
		unsigned char *d = c->dst + i * c->dpitch;
		const unsigned char *s = c->src + i * c->spitch;
		if (!vmm_read(d, (uintptr_t)s, c->width))
			memcpy(d, s, c->width);
	}
}

static int in_mapping(uintptr_t p)
{
	pthread_mutex_lock(&mu);
	int in = 0;
	for (int i = 0; i < NMAP && !in; i++)
		in = maps[i].va && p >= maps[i].va && p < maps[i].va + maps[i].size;
	pthread_mutex_unlock(&mu);
	return in;
}

CUresult CUDAAPI cuMemcpy2DAsync(const CUDA_MEMCPY2D *c, CUstream stream)
{
	if (!c || c->srcMemoryType != CU_MEMORYTYPE_DEVICE || c->dstMemoryType != CU_MEMORYTYPE_HOST ||
	    c->srcXInBytes || c->srcY || c->dstXInBytes || c->dstY)
		return CUDA_ERROR_NOT_SUPPORTED; /* what the daemon's pulls use, nothing else */
	if (!c->srcDevice || !c->dstHost || c->WidthInBytes > c->srcPitch ||
	    c->WidthInBytes > c->dstPitch)
		return CUDA_ERROR_INVALID_VALUE;
	if (failing("copy") && in_mapping(c->srcDevice))
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	if (!c->WidthInBytes || !c->Height)
		return CUDA_SUCCESS;
	struct copy2d a = { c->dstHost, (const unsigned char *)(uintptr_t)c->srcDevice, c->dstPitch,
			    c->srcPitch, c->WidthInBytes, c->Height };
	rw_fake_cuda_submit_copy(stream, copy2d_run, &a, sizeof(a), (uintptr_t)c->dstHost,
				 c->dstPitch * (c->Height - 1) + c->WidthInBytes, (uintptr_t)c->srcDevice,
				 c->srcPitch * (c->Height - 1) + c->WidthInBytes);
	return CUDA_SUCCESS;
}

/* Test hook (found with dlsym): allocations still held by a handle or a mapping here. */
int rw_fake_cuda_vmm_live(void);
int rw_fake_cuda_vmm_live(void)
{
	pthread_mutex_lock(&mu);
	int n = 0;
	for (int i = 0; i < NMAP; i++)
		n += maps[i].va != 0;
	pthread_mutex_unlock(&mu);
	return n;
}
#endif /* RW_HAVE_CUDA_H */
