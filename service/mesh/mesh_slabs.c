/* Where each rail's slabs live (service/mesh/mesh.h rw_svc_mesh_slab_dev; docs/cuda.md "Where the
 * slabs live"), decided once per rail at start, logged once per rail and summed up in `stats`
 * (metrics.slabs).
 *
 * GPU memory (GPUDirect RDMA) where the rail is verbs and every step below says yes: the rail's
 * device registers dmabufs, a CUDA driver runs, the GPU beside the rail exports its memory as a
 * dmabuf and can order (or flush) the NIC's writes into it, and ibv_reg_dmabuf_mr takes it. The
 * NIC then reads and writes the GPU's memory; the host memory of the rail stays as the shadow
 * the CPU writes and checks headers in (service/mover/mover.h). Otherwise host memory, registered
 * with the NIC, which the CUDA mover maps into the GPUs: the first "no" is the reason given.
 *
 * The GPU beside rail r is the one of the lowest local rank whose native rail is r (topology
 * gpu_rail), as CUDA device ordinal local rank mod device count: the usual one-GPU-per-rank
 * launch (cuda:LOCAL_RANK) with NIC r next to GPU r on a rail-optimized node. RAILWAVE_GPUDIRECT=0
 * keeps every rail in host memory. The test hook RAILWAVE_TEST_GPUDIRECT=1 skips the first two
 * steps (the transport and the NIC's capability), so that a machine without such a NIC runs
 * every later step up to the registration's answer and the fallback. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda/rw_cuda.h"
#include "service/mesh/mesh_int.h"

static int rail_gpu(const rw_svc_mesh_t *m, uint32_t r)
{
	const rw_topo_t *t = &m->svc->topo;
	int n = rw_cuda_device_count();
	for (uint32_t g = 0; g < t->gpus_per_node && n > 0; g++)
		if (t->gpu_rail[g] == r)
			return (int)(g % (uint32_t)n);
	return -1;
}

static rw_status_t slabs_shared(rw_svc_mesh_t *m, uint32_t r);

/* GPU memory for rail r, registered with its NIC; RW_ERR_UNSUPPORTED with the reason in why
 * (nothing kept) where one step says no. */
static rw_status_t slabs_gpu(rw_svc_mesh_t *m, uint32_t r, char *why, size_t cap)
{
	const char *off = getenv("RAILWAVE_GPUDIRECT"), *test = getenv("RAILWAVE_TEST_GPUDIRECT");
	const int pretend = test && strcmp(test, "1") == 0;
	if (pretend && r == 0)
		rw_warn("test hook RAILWAVE_TEST_GPUDIRECT=1: every rail is taken for a NIC that "
			"registers dmabufs; the registration itself answers as the transport does");
	if (!pretend && m->svc->cfg.transport != RW_SVC_TRANSPORT_VERBS) {
		snprintf(why, cap, "%s rails are sockets", rw_svc_transport_name(m->svc->cfg.transport));
		return RW_ERR_UNSUPPORTED;
	}
	if (!pretend && !(m->dev[r]->caps.flags & RW_RAIL_CAP_DMABUF)) {
		snprintf(why, cap, "the NIC registers no dmabufs (ibv_reg_dmabuf_mr unsupported)");
		return RW_ERR_UNSUPPORTED;
	}
	if (off && strcmp(off, "0") == 0) {
		snprintf(why, cap, "turned off (RAILWAVE_GPUDIRECT=0)");
		return RW_ERR_UNSUPPORTED;
	}
	if (rw_cuda_init() != RW_OK) {
		snprintf(why, cap, "no CUDA driver (%s)", rw_cuda_unavailable_reason());
		return RW_ERR_UNSUPPORTED;
	}
	const int dev = rail_gpu(m, r);
	if (dev < 0) {
		snprintf(why, cap, "no local GPU has rail %u as its native rail", r);
		return RW_ERR_UNSUPPORTED;
	}
	if (!rw_cuda_dmabuf_supported(dev)) {
		snprintf(why, cap, "GPU %d exports no dmabuf", dev);
		return RW_ERR_UNSUPPORTED;
	}
	/* Kernels of every local GPU may read what the NIC wrote (forwards through peer access):
	 * the device must order the NIC's writes for all of them, or flush them (rw_cuda_gdr_flush,
	 * before each read of an arrived range). Ask once here, so a pair never finds out. */
	rw_status_t st = rw_cuda_gdr_flush(dev, 1);
	if (st != RW_OK) {
		snprintf(why, cap, "GPU %d can neither order nor flush a NIC's writes for other GPUs (%s)",
			 dev, rw_status_str(st));
		return RW_ERR_UNSUPPORTED;
	}
	long page = sysconf(_SC_PAGESIZE);
	uint64_t bytes = (m->area_bytes + (uint64_t)page - 1) & ~((uint64_t)page - 1);
	rw_cuda_dptr_t dptr = 0;
	int fd = -1;
	if ((st = rw_cuda_mem_alloc(dev, bytes, &dptr)) != RW_OK) {
		snprintf(why, cap, "GPU %d has no %llu MiB for the slabs (%s)", dev,
			 (unsigned long long)bytes >> 20, rw_status_str(st));
		return RW_ERR_UNSUPPORTED;
	}
	if ((st = rw_cuda_dmabuf_export(dev, dptr, bytes, &fd)) != RW_OK) {
		snprintf(why, cap, "GPU %d's dmabuf export failed (%s)", dev, rw_status_str(st));
	} else if ((st = rw_rail_reg_dmabuf(m->dev[r], fd, 0, bytes, dptr, &m->region[r])) != RW_OK) {
		snprintf(why, cap, "ibv_reg_dmabuf_mr refused GPU %d's memory (%s)", dev,
			 rw_status_str(st));
	} else {
		m->slab_dev[r] = dev;
		m->slab_dptr[r] = dptr;
		m->slab_fd[r] = fd;
		return RW_OK;
	}
	if (fd >= 0)
		close(fd);
	rw_cuda_mem_free(dev, dptr);
	return RW_ERR_UNSUPPORTED;
}

/* Where rail r's group carve-outs go (mesh_carve.c): on the GPU of the rail's GPU slabs; under
 * the test hook also on the GPU beside a rail whose slabs stayed in host memory, so that a
 * machine without a GPUDirect NIC runs GPU carve-outs as far as its transport lets it (the
 * stand-in driver's GPU memory is host memory the CPU and tcp reach); -1: host memory. */
static int carve_dev(rw_svc_mesh_t *m, uint32_t r)
{
	if (!m->carve_bytes)
		return -1;
	if (m->slab_dev[r] >= 0)
		return m->slab_dev[r];
	const char *off = getenv("RAILWAVE_GPUDIRECT"), *test = getenv("RAILWAVE_TEST_GPUDIRECT");
	if (!test || strcmp(test, "1") != 0 || (off && strcmp(off, "0") == 0) ||
	    rw_cuda_init() != RW_OK)
		return -1;
	const int dev = rail_gpu(m, r);
	return dev >= 0 && rw_cuda_vmm_supported(dev) ? dev : -1;
}

rw_status_t mesh_slabs_place(rw_svc_mesh_t *m, uint32_t r)
{
	rw_status_t st = slabs_shared(m, r);
	m->carve_dev[r] = carve_dev(m, r);
	if (m->carve_dev[r] >= 0)
		rw_info("rail=%u: the groups' carve-outs in GPU %d's memory, lent by fd", r,
			m->carve_dev[r]);
	return st;
}

/* The rail's shared slabs: on its GPU where every step says yes, else in host memory. */
static rw_status_t slabs_shared(rw_svc_mesh_t *m, uint32_t r)
{
	char why[128];
	m->slab_dev[r] = -1;
	m->slab_fd[r] = -1;
	if (slabs_gpu(m, r, why, sizeof(why)) == RW_OK) {
		rw_info("rail=%u: slabs in GPU %d's memory (%llu MiB), registered with the NIC through a "
			"dmabuf: GPUDirect RDMA", r, m->slab_dev[r],
			(unsigned long long)m->area_bytes >> 20);
		return RW_OK;
	}
	rw_info("rail=%u: slabs in host memory, mapped into the GPUs by the CUDA mover (no GPUDirect "
		"RDMA: %s)", r, why);
	if (!m->host_why[0])
		snprintf(m->host_why, sizeof(m->host_why), "%s", why);
	rw_status_t st = rw_rail_reg_host(m->dev[r], m->mem[r], m->area_bytes, &m->region[r]);
	if (st != RW_OK)
		rw_err("rail=%u: cannot register memory: %s", r, rw_status_str(st));
	return st;
}

/* The summary `stats` shows ("slabs ..."), once every rail is placed. */
void mesh_slabs_summary(rw_svc_mesh_t *m)
{
	char *out = m->svc->metrics.slabs;
	const size_t cap = sizeof(m->svc->metrics.slabs);
	char gpu[64] = "";
	size_t len = 0;
	uint32_t n_gpu = 0;
	for (uint32_t r = 0; r < m->rails; r++)
		if (m->slab_dev[r] >= 0 && len < sizeof(gpu)) {
			len += (size_t)snprintf(gpu + len, sizeof(gpu) - len, " %u", r);
			n_gpu++;
		}
	int at;
	if (n_gpu == m->rails)
		at = snprintf(out, cap, "gpu (GPUDirect RDMA on every rail)");
	else if (n_gpu)
		at = snprintf(out, cap, "gpu on rail(s)%s, host on the others (", gpu);
	else
		at = snprintf(out, cap, "host, mapped into the GPUs (no GPUDirect: ");
	if (n_gpu < m->rails && at > 0 && (size_t)at + 2 < cap) { /* the reason, cut to what fits */
		size_t n = strnlen(m->host_why, cap - (size_t)at - 2);
		memcpy(out + at, m->host_why, n);
		memcpy(out + at + n, ")", 2);
	}
}

void mesh_slabs_free(rw_svc_mesh_t *m, uint32_t r)
{
	if (m->slab_dev[r] < 0)
		return;
	if (m->slab_fd[r] >= 0)
		close(m->slab_fd[r]);
	rw_cuda_mem_free(m->slab_dev[r], m->slab_dptr[r]);
	m->slab_dev[r] = -1;
	m->slab_fd[r] = -1;
}

int rw_svc_mesh_slab_dev(const rw_svc_mesh_t *mesh, uint32_t rail, uint64_t *dptr_p)
{
	if (rail >= mesh->rails || mesh->slab_dev[rail] < 0)
		return -1;
	if (dptr_p)
		*dptr_p = mesh->slab_dptr[rail];
	return mesh->slab_dev[rail];
}
