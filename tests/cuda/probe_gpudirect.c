/* tests/cuda/probe_gpudirect.c: how far GPUDirect RDMA gets on this machine (docs/cuda.md
 * "Where the slabs live"). Each step prints one line with the call's answer:
 *   1. the device's dmabuf support (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED + the driver entry),
 *      and how far it orders a NIC's writes (the flush the movers would need, its answer);
 *   2. a dmabuf fd exported for 4 MiB of device memory (cuMemGetHandleForAddressRange);
 *   3. every RDMA device's answer to ibv_reg_dmabuf_mr on that fd (none: said so);
 *   4. the fallback the CUDA mover uses on tcp (and on a NIC without dmabuf): host memory
 *      page-locked with DEVICEMAP, written by the mover's row-copy kernel, checked by the CPU;
 *   5. what a header pull out of a GPU slab costs the daemon's loop (timed).
 * Exit 0 when every step ran (whatever the answers), 1 when one broke, 77 without a GPU.
 *   probe_gpudirect */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "common/common.h"
#include "cuda/rw_cuda.h"

#define BYTES (4u << 20)

static void try_devices(int fd, uint64_t bytes)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n == 0) {
		printf("3. RDMA devices: none (ibv_get_device_list: %d%s%s): no NIC to register the "
		       "dmabuf with; the slabs stay in pinned host memory\n", n, list ? "" : ", ",
		       list ? "" : strerror(errno));
		if (list)
			ibv_free_device_list(list);
		return;
	}
	for (int i = 0; i < n; i++) {
		const char *name = ibv_get_device_name(list[i]);
		struct ibv_context *ctx = ibv_open_device(list[i]);
		struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
		if (!pd) {
			printf("3. %s: cannot open it or allocate a protection domain: %s\n", name,
			       strerror(errno));
		} else {
			struct ibv_mr *mr = ibv_reg_dmabuf_mr(pd, 0, bytes, 0, fd,
							      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
			if (mr) {
				printf("3. %s: ibv_reg_dmabuf_mr registered %llu bytes of GPU memory (lkey 0x%x): "
				       "GPUDirect RDMA possible\n", name, (unsigned long long)bytes, mr->lkey);
				ibv_dereg_mr(mr);
			} else {
				int e = errno;
				printf("3. %s: ibv_reg_dmabuf_mr: %s (errno %d)%s\n", name, strerror(e), e,
				       e == EOPNOTSUPP || e == EPROTONOSUPPORT ? ": this device has no dmabuf "
				       "MRs (Soft-RoCE has none); the slabs stay in pinned host memory" : "");
			}
		}
		if (pd)
			ibv_dealloc_pd(pd);
		if (ctx)
			ibv_close_device(ctx);
	}
	ibv_free_device_list(list);
}

/* The fallback: the mover's kernel writes rows into mapped host memory; the CPU reads them. */
static int fallback(void)
{
	const uint32_t rows = 64, row = 1024;
	uint8_t *host = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	rw_cuda_dptr_t mapped, dev;
	rw_cuda_stream_t *s = NULL;
	void *list = NULL;
	uint8_t *want = malloc((size_t)rows * row);
	if (host == MAP_FAILED || !want || rw_cuda_host_register_mapped(host, BYTES, &mapped) != RW_OK ||
	    rw_cuda_mem_alloc(0, (size_t)rows * row, &dev) != RW_OK || rw_cuda_stream_create(0, &s) != RW_OK ||
	    rw_cuda_host_alloc((size_t)rows * 16, &list) != RW_OK) {
		printf("4. fallback: cannot set up mapped host memory\n");
		return -1;
	}
	for (size_t i = 0; i < (size_t)rows * row; i++)
		want[i] = (uint8_t)(i * 7 + 3);
	rw_cuda_row_copy_t *l = list;
	for (uint32_t i = 0; i < rows; i++) /* reversed: row i of dev to row rows-1-i of the host */
		l[i] = (rw_cuda_row_copy_t){ .src = dev + (uint64_t)i * row,
					     .dst = mapped + (uint64_t)(rows - 1 - i) * row };
	int bad = rw_cuda_memcpy_htod(0, dev, want, (size_t)rows * row) != RW_OK ||
		  rw_cuda_copy_rows(s, (rw_cuda_dptr_t)(uintptr_t)list, rows, row, 1) != RW_OK ||
		  rw_cuda_stream_sync(s) != RW_OK;
	for (uint32_t i = 0; i < rows && !bad; i++)
		bad = memcmp(host + (size_t)(rows - 1 - i) * row, want + (size_t)i * row, row) != 0;
	printf("4. fallback: %u rows written by the row-copy kernel into page-locked host memory "
	       "(DEVICEMAP, device address %s the host's): %s\n", rows,
	       mapped == (rw_cuda_dptr_t)(uintptr_t)host ? "=" : "!=", bad ? "WRONG BYTES" : "read back exact");
	rw_cuda_stream_destroy(s);
	rw_cuda_host_free(list);
	rw_cuda_mem_free(0, dev);
	rw_cuda_host_unregister(host);
	munmap(host, BYTES);
	free(want);
	return bad ? -1 : 0;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* What a header pull costs the daemon's loop with slabs in GPU memory
 * (service/mover/mover_cuda_slab.c): n dispatch headers (80 bytes, top-8) at the DeepSeek-V3 record
 * stride (14 416 bytes) copied from device memory into mapped host memory by the row-copy kernel on
 * a stream of their own, after a flush, and waited for; the median of 200 pulls per n. */
static int pull_cost(void)
{
	const uint32_t hdr = 80, stride = 14416, nmax = 1024, reps = 200;
	const size_t slab = (size_t)nmax * stride;
	uint8_t *host = mmap(NULL, slab, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	rw_cuda_dptr_t mapped, dev;
	rw_cuda_stream_t *s = NULL;
	void *list = NULL;
	uint64_t *t = malloc(sizeof(uint64_t) * reps);
	if (host == MAP_FAILED || !t || rw_cuda_host_register_mapped(host, slab, &mapped) != RW_OK ||
	    rw_cuda_mem_alloc(0, slab, &dev) != RW_OK || rw_cuda_stream_create(0, &s) != RW_OK ||
	    rw_cuda_host_alloc((size_t)nmax * 16, &list) != RW_OK) {
		printf("5. header pull: cannot set up\n");
		return -1;
	}
	rw_cuda_row_copy_t *l = list;
	for (uint32_t i = 0; i < nmax; i++)
		l[i] = (rw_cuda_row_copy_t){ .src = dev + (uint64_t)i * stride,
					     .dst = mapped + (uint64_t)i * stride };
	int bad = 0;
	static const uint32_t ns[] = { 1, 64, 1024 };
	for (size_t k = 0; k < sizeof(ns) / sizeof(ns[0]) && !bad; k++) {
		for (uint32_t i = 0; i < reps && !bad; i++) {
			uint64_t t0 = rw_now_ns();
			bad = rw_cuda_gdr_flush(0, 0) != RW_OK ||
			      rw_cuda_copy_rows(s, (rw_cuda_dptr_t)(uintptr_t)list, ns[k], hdr, 1) != RW_OK ||
			      rw_cuda_stream_sync(s) != RW_OK;
			t[i] = rw_now_ns() - t0;
		}
		qsort(t, reps, sizeof(*t), cmp_u64);
		printf("5. header pull of %4u headers (flush + row-copy kernel + wait): median %.1f us, "
		       "p90 %.1f us\n", ns[k], t[reps / 2] / 1e3, t[reps * 9 / 10] / 1e3);
	}
	rw_cuda_stream_destroy(s);
	rw_cuda_host_free(list);
	rw_cuda_mem_free(0, dev);
	rw_cuda_host_unregister(host);
	munmap(host, slab);
	free(t);
	return bad ? -1 : 0;
}

int main(void)
{
	if (rw_cuda_init() != RW_OK || rw_cuda_device_count() < 1) {
		printf("probe_gpudirect: skipped: %s\n", rw_cuda_unavailable_reason());
		return 77;
	}
	char name[128] = "";
	rw_cuda_device_name(0, name, sizeof(name));
	int sup = rw_cuda_dmabuf_supported(0);
	printf("1. %s: dmabuf export %s\n", name, sup ? "supported" : "not supported");
	/* The consistency rule the movers keep (docs/cuda.md "Consistency"): how far this GPU
	 * orders a NIC's writes by itself, and what a flush for each scope answers. */
	printf("1b. GPUDirect RDMA writes ordering %d (0 none, 100 the owning GPU, 200 every GPU); "
	       "flush for the owner: %s, for every GPU: %s\n", rw_cuda_gdr_ordering(0),
	       rw_status_str(rw_cuda_gdr_flush(0, 0)), rw_status_str(rw_cuda_gdr_flush(0, 1)));
	rw_cuda_dptr_t d = 0;
	int fd = -1, rc = 0;
	if (rw_cuda_mem_alloc(0, BYTES, &d) != RW_OK) {
		printf("2. cannot allocate %u bytes of device memory\n", BYTES);
		return 1;
	}
	rw_status_t st = sup ? rw_cuda_dmabuf_export(0, d, BYTES, &fd) : RW_ERR_UNSUPPORTED;
	printf("2. cuMemGetHandleForAddressRange(4 MiB of device memory): %s%s\n", rw_status_str(st),
	       st == RW_OK ? " (a dmabuf fd)" : "");
	if (st == RW_OK) {
		try_devices(fd, BYTES);
		close(fd);
	} else {
		printf("3. no dmabuf to register: skipped\n");
	}
	rw_cuda_mem_free(0, d);
	rc = fallback();
	rc |= pull_cost();
	rw_cuda_shutdown();
	return rc ? 1 : 0;
}
