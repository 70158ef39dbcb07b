/* The groups' carve-outs (service/mesh/mesh.h "carve-outs per group"; docs/rankpath.md "The slab
 * areas, lent per group"): a pool of carve_max carve-outs of carve_bytes per rail. Each one taken
 * is, on every rail, a fresh sealed memfd mapped here and registered with the rail, so that it
 * can be lent to one group's ranks and to nobody else; its index is announced to the peers
 * (CARVE) before any count row names it, and it goes when its last reference does. Offsets past
 * the shared area name a carve-out and a place in it, on every node alike: this file turns them
 * into (region, offset) for writes and turns an arrival's (region, offset) back. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include "cuda/rw_cuda.h"
#include "service/mesh/mesh_int.h"

#define CARVE_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

rw_status_t mesh_carve_init(rw_svc_mesh_t *m, uint64_t carve_bytes, uint32_t carve_max)
{
	if (!carve_bytes || !carve_max)
		return RW_OK;
	m->carve = calloc(carve_max, sizeof(*m->carve));
	if (!m->carve)
		return RW_ERR_NOMEM;
	m->carve_bytes = carve_bytes;
	m->carve_max = carve_max;
	m->svc->metrics.carve_outs_max = carve_max;
	for (uint32_t i = 0; i < carve_max; i++)
		for (uint32_t r = 0; r < RW_MAX_RAILS; r++)
			m->carve[i].fd[r] = -1;
	for (uint32_t n = 0; n < m->nodes; n++) {
		mesh_peer_t *p = &m->peer[n];
		p->carve_remote = calloc((size_t)carve_max * m->rails, sizeof(*p->carve_remote));
		p->carve_known = calloc(carve_max, 1);
		if (!p->carve_remote || !p->carve_known)
			return RW_ERR_NOMEM; /* mesh_carve_fini frees what was made */
	}
	return RW_OK;
}

/* The memory of carve-outs left to the process's exit (carve_keep), kept reachable from here:
 * nothing frees it, whichever mesh it came from. */
typedef struct carve_kept {
	struct carve_kept *next;
	mesh_carve_t cv;
} carve_kept_t;
static carve_kept_t *carve_kept;

/* A carve-out a queued copy may still use goes (deregistered already): its memory on every rail
 * is kept as it is, named in the log. The rail's own mapping of the export (nic) is no copy's. */
static void carve_keep(rw_svc_mesh_t *m, mesh_carve_t *cv)
{
	char what[160] = "";
	size_t at = 0;
	for (uint32_t r = 0; r < m->rails && at < sizeof(what); r++) {
		const int dev = cv->vmm[r] ? rw_cuda_vmm_device(cv->vmm[r]) : -1;
		int n;
		if (dev >= 0)
			n = snprintf(what + at, sizeof(what) - at, "%srail %u: GPU %d's mapping of %zu "
				     "bytes%s", r ? "; " : "", r, dev, rw_cuda_vmm_bytes(cv->vmm[r]),
				     cv->shadow[r] ? " and its page-locked shadow" : "");
		else
			n = snprintf(what + at, sizeof(what) - at, "%srail %u: host memfd of %llu bytes",
				     r ? "; " : "", r, (unsigned long long)m->carve_bytes);
		at += n > 0 ? (size_t)n : 0;
	}
	rw_warn("group %s: carve-out %u left to the process's exit, never freed under a copy (%s): "
		"%s", cv->group, (uint32_t)(cv - m->carve), cv->left, what);
	carve_kept_t *k = malloc(sizeof(*k));
	if (k) { /* else the memory is still never freed, only no longer listed */
		*k = (carve_kept_t){ .next = carve_kept, .cv = *cv };
		carve_kept = k;
	}
}

void rw_svc_mesh_carve_leave(rw_svc_mesh_t *m, uint32_t index, const char *why)
{
	if (index < m->carve_max && m->carve[index].refs && !m->carve[index].left[0])
		snprintf(m->carve[index].left, sizeof(m->carve[index].left), "%s", why);
}

/* Deregister first (no byte of the region changes after it), then unmap and close — unless a
 * copy queued on a GPU may still use the memory (rw_svc_mesh_carve_leave): then it is kept. A
 * GPU carve-out's memory goes when no rank maps it any more either. */
static void carve_free(rw_svc_mesh_t *m, mesh_carve_t *cv)
{
	for (uint32_t r = 0; r < m->rails; r++) {
		if (cv->region[r])
			rw_rail_dereg(cv->region[r]);
		if (cv->nic[r])
			munmap(cv->nic[r], m->carve_bytes);
		cv->region[r] = NULL;
		cv->nic[r] = NULL;
	}
	if (cv->left[0])
		carve_keep(m, cv);
	for (uint32_t r = 0; r < m->rails && !cv->left[0]; r++) {
		if (cv->shadow[r])
			rw_cuda_host_free(cv->shadow[r]);
		if (cv->vmm[r])
			rw_cuda_vmm_release(cv->vmm[r]);
		else if (cv->mem[r])
			munmap(cv->mem[r], m->carve_bytes);
		if (cv->fd[r] >= 0)
			close(cv->fd[r]);
	}
	for (uint32_t r = 0; r < m->rails; r++) {
		cv->shadow[r] = cv->mem[r] = NULL;
		cv->vmm[r] = NULL;
		cv->fd[r] = -1;
	}
	cv->refs = 0;
	cv->cpu = 0;
	cv->group[0] = 0;
	cv->left[0] = 0;
}

void mesh_carve_fini(rw_svc_mesh_t *m)
{
	for (uint32_t i = 0; m->carve && i < m->carve_max; i++)
		carve_free(m, &m->carve[i]);
	free(m->carve);
	m->carve = NULL;
	for (uint32_t n = 0; m->peer && n < m->nodes; n++) {
		free(m->peer[n].carve_remote);
		free(m->peer[n].carve_known);
		m->peer[n].carve_remote = NULL;
		m->peer[n].carve_known = NULL;
	}
}

/* 1 when this process's CPU can read [p, p + n): the kernel says so for its first and last
 * byte (process_vm_readv on ourselves fails with EFAULT where nothing readable is mapped). */
static int cpu_reads(const uint8_t *p, size_t n)
{
	uint8_t b[2];
	struct iovec local[2] = { { &b[0], 1 }, { &b[1], 1 } };
	struct iovec remote[2] = { { (void *)p, 1 }, { (void *)(p + n - 1), 1 } };
	return process_vm_readv(getpid(), local, 2, remote, 2, 0) == 2;
}

/* One rail of a carve-out in GPU memory (m->carve_dev[r]): a CUDA allocation exported as a POSIX
 * fd (what the group's ranks are lent and import), mapped here, registered with the rail through
 * its dmabuf where the rail takes one, else as host memory is where the transport reads the
 * pages in place. The daemon never reads the records in it in place: it pulls their headers into
 * the carve-out's page-locked host shadow by copies and checks them there
 * (service/mover/mover_pull.c), so the memory need not be readable by its CPU (a discrete GPU's
 * is not). A rail that reads through the CPU (tcp, only under the test hook: a GPUDirect rail
 * takes the dmabuf) is then given a mapping of its own of the export, as a NIC's dmabuf would
 * reach the memory; where the export maps nowhere (a real driver's) the carve-out is refused,
 * named. The shm transport moves registered pages: no GPU carve-outs on it. */
static rw_status_t carve_rail_gpu(rw_svc_mesh_t *m, mesh_carve_t *cv, uint32_t r)
{
	const int dev = m->carve_dev[r];
	char why[112];
	rw_status_t st = rw_cuda_vmm_create(dev, m->carve_bytes, &cv->vmm[r], why, sizeof(why));
	if (st != RW_OK) {
		snprintf(m->carve_why, sizeof(m->carve_why), "rail %u: GPU %d: %s", r, dev, why);
		return st;
	}
	const rw_cuda_dptr_t dptr = rw_cuda_vmm_dptr(cv->vmm[r]);
	uint8_t *va = (uint8_t *)(uintptr_t)dptr;
	cv->mem[r] = va;
	if ((st = rw_cuda_host_alloc(m->carve_bytes, (void **)&cv->shadow[r])) != RW_OK) {
		cv->shadow[r] = NULL;
		snprintf(m->carve_why, sizeof(m->carve_why), "rail %u: no page-locked host shadow of "
			 "%llu MiB for GPU %d's carve-out (%s)", r,
			 (unsigned long long)m->carve_bytes >> 20, dev, rw_status_str(st));
		return st;
	}
	const int readable = cpu_reads(va, m->carve_bytes);
	if (!readable)
		cv->cpu = 0;
	int dfd = -1;
	st = rw_cuda_dmabuf_supported(dev) ? rw_cuda_dmabuf_export(dev, dptr, m->carve_bytes, &dfd)
					   : RW_ERR_UNSUPPORTED;
	if (st == RW_OK) {
		st = rw_rail_reg_dmabuf(m->dev[r], dfd, 0, m->carve_bytes, dptr, &cv->region[r]);
		close(dfd); /* the registration holds the dmabuf */
	}
	if (st == RW_ERR_UNSUPPORTED && m->svc->cfg.transport == RW_SVC_TRANSPORT_SHM) {
		snprintf(m->carve_why, sizeof(m->carve_why), "rail %u: shm rails take no dmabuf and "
			 "move registered pages: no GPU carve-outs on them", r);
		return st;
	}
	uint8_t *host = va;
	if (st == RW_ERR_UNSUPPORTED && !readable) {
		void *p = mmap(NULL, m->carve_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
			       rw_cuda_vmm_fd(cv->vmm[r]), 0);
		if (p == MAP_FAILED) {
			snprintf(m->carve_why, sizeof(m->carve_why), "rail %u reads memory through the "
				 "CPU and GPU %d's is not mapped for it (the export maps nowhere: %m)",
				 r, dev);
			return RW_ERR_UNSUPPORTED;
		}
		host = cv->nic[r] = p;
	}
	if (st == RW_ERR_UNSUPPORTED)
		st = rw_rail_reg_host(m->dev[r], host, m->carve_bytes, &cv->region[r]);
	if (st != RW_OK)
		snprintf(m->carve_why, sizeof(m->carve_why), "rail %u: the rail registers none of GPU "
			 "%d's memory (%s)", r, dev, rw_status_str(st));
	return st;
}

/* One rail of a carve-out: a sealed memfd, mapped, registered. Where the transport swapped the
 * pages for its own object (shm), that object is the one lent, so a rank maps what peers write. */
static rw_status_t carve_rail(rw_svc_mesh_t *m, mesh_carve_t *cv, uint32_t r)
{
	int fd = memfd_create("railwave-group-slab", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0 || ftruncate(fd, (off_t)m->carve_bytes) < 0 ||
	    fcntl(fd, F_ADD_SEALS, CARVE_SEALS) < 0) {
		rw_err("rail=%u: cannot make a %llu-byte carve-out for group %s: %m", r,
		       (unsigned long long)m->carve_bytes, cv->group);
		if (fd >= 0)
			close(fd);
		return RW_ERR_SYS;
	}
	cv->fd[r] = fd;
	void *mem = mmap(NULL, m->carve_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (mem == MAP_FAILED) {
		rw_err("rail=%u: cannot map group %s's carve-out: %m", r, cv->group);
		return RW_ERR_NOMEM;
	}
	cv->mem[r] = mem;
	rw_status_t st = rw_rail_reg_host(m->dev[r], mem, m->carve_bytes, &cv->region[r]);
	if (st != RW_OK) {
		rw_err("rail=%u: cannot register group %s's carve-out: %s", r, cv->group,
		       rw_status_str(st));
		return st;
	}
	const int theirs = rw_rail_region_fd(cv->region[r]);
	if (theirs >= 0) {
		int dup = fcntl(theirs, F_DUPFD_CLOEXEC, 0);
		if (dup < 0) {
			rw_err("rail=%u: cannot keep group %s's carve-out object: %m", r, cv->group);
			return RW_ERR_SYS;
		}
		close(cv->fd[r]);
		cv->fd[r] = dup;
	}
	return RW_OK;
}

static size_t carve_pack(const rw_svc_mesh_t *m, uint32_t index, uint8_t *buf, size_t len)
{
	rw_wire_carve_t w;
	memset(&w, 0, sizeof(w));
	w.index = index;
	w.rails = m->rails;
	for (uint32_t r = 0; r < m->rails; r++)
		rw_rail_region_desc_pack(m->carve[index].region[r], w.desc[r]);
	return rw_wire_carve_pack(&w, buf, len);
}

rw_status_t rw_svc_mesh_carve_take(rw_svc_mesh_t *m, const char *group, uint32_t *index_p)
{
	if (!m->carve_max)
		return RW_ERR_UNSUPPORTED;
	uint32_t i = 0;
	while (i < m->carve_max && m->carve[i].refs)
		i++;
	if (i == m->carve_max)
		return RW_ERR_AGAIN;
	mesh_carve_t *cv = &m->carve[i];
	snprintf(cv->group, sizeof(cv->group), "%s", group);
	m->carve_why[0] = 0;
	cv->cpu = 1; /* until a rail's GPU memory says otherwise */
	for (uint32_t r = 0; r < m->rails; r++) {
		rw_status_t st = m->carve_dev[r] >= 0 ? carve_rail_gpu(m, cv, r) : carve_rail(m, cv, r);
		if (st != RW_OK) {
			if (m->carve_why[0])
				rw_err("group %s: no carve-out: %s", group, m->carve_why);
			else
				snprintf(m->carve_why, sizeof(m->carve_why), "rail %u: %s", r,
					 rw_status_str(st));
			carve_free(m, cv);
			return st;
		}
	}
	cv->refs = 1;
	m->svc->metrics.carve_outs++;
	/* Every peer that has our REGIONS hears of it now; a peer whose handshake comes later gets
	 * it after REGIONS (mesh_carve_announce_all). Both go before any count row naming it. */
	uint8_t buf[sizeof(rw_wire_carve_t) + 8];
	const size_t n = carve_pack(m, i, buf, sizeof(buf));
	for (uint32_t k = 0; k < m->nodes; k++) {
		mesh_ctl_t *c = m->peer[k].ctl;
		if (k == m->me || !c || !c->regions_sent || m->peer[k].failing)
			continue;
		/* A channel that refuses this is broken or backed up: its next heartbeat or read
		 * fails the peer, and a count row of ours never reaches it before that. */
		if (mesh_ctl_queue(c, RW_WIRE_CARVE, buf, (uint32_t)n) != RW_OK || mesh_ctl_flush(c) < 0)
			rw_warn("peer=%s: group %s's carve-out could not be announced (control channel "
				"backed up or broken)", m->svc->cfg.nodes[k].name, group);
	}
	*index_p = i;
	return RW_OK;
}

void rw_svc_mesh_carve_hold(rw_svc_mesh_t *m, uint32_t index)
{
	if (index < m->carve_max && m->carve[index].refs)
		m->carve[index].refs++;
}

void rw_svc_mesh_carve_put(rw_svc_mesh_t *m, uint32_t index)
{
	if (index >= m->carve_max || !m->carve[index].refs)
		return;
	if (--m->carve[index].refs == 0) {
		carve_free(m, &m->carve[index]);
		m->svc->metrics.carve_outs--;
	}
}

int rw_svc_mesh_carve_fd(const rw_svc_mesh_t *m, uint32_t index, uint32_t rail, uint64_t *bytes_p)
{
	if (index >= m->carve_max || rail >= m->rails || !m->carve[index].refs)
		return -1;
	const struct rw_cuda_vmm *v = m->carve[index].vmm[rail];
	if (bytes_p)
		*bytes_p = v ? rw_cuda_vmm_bytes(v) : m->carve_bytes;
	return v ? rw_cuda_vmm_fd(v) : m->carve[index].fd[rail];
}

int rw_svc_mesh_carve_gpu(const rw_svc_mesh_t *m, uint32_t index, uint32_t rail,
			  uint8_t uuid_p[16])
{
	if (index >= m->carve_max || rail >= m->rails || !m->carve[index].refs ||
	    !m->carve[index].vmm[rail])
		return -1;
	const int dev = rw_cuda_vmm_device(m->carve[index].vmm[rail]);
	if (uuid_p && rw_cuda_device_uuid(dev, uuid_p) != RW_OK)
		return -1;
	return dev;
}

uint8_t *rw_svc_mesh_carve_shadow(const rw_svc_mesh_t *m, uint32_t index, uint32_t rail)
{
	if (index >= m->carve_max || rail >= m->rails || !m->carve[index].refs)
		return NULL;
	return m->carve[index].shadow[rail];
}

int rw_svc_mesh_carve_cpu(const rw_svc_mesh_t *m, uint32_t index)
{
	return index < m->carve_max && m->carve[index].refs && m->carve[index].cpu;
}

const char *rw_svc_mesh_carve_why(const rw_svc_mesh_t *m) { return m->carve_why; }

uint64_t rw_svc_mesh_carve_off(const rw_svc_mesh_t *m, uint32_t index)
{
	return m->area_bytes + (uint64_t)index * m->carve_bytes;
}

rw_status_t mesh_carve_announce_all(mesh_ctl_t *c)
{
	rw_svc_mesh_t *m = c->mesh;
	uint8_t buf[sizeof(rw_wire_carve_t) + 8];
	for (uint32_t i = 0; i < m->carve_max; i++) {
		if (!m->carve[i].refs)
			continue;
		const size_t n = carve_pack(m, i, buf, sizeof(buf));
		rw_status_t st = mesh_ctl_queue(c, RW_WIRE_CARVE, buf, (uint32_t)n);
		if (st != RW_OK)
			return st;
	}
	return RW_OK;
}

rw_status_t mesh_carve_on_msg(mesh_peer_t *p, const uint8_t *payload, uint32_t len)
{
	const rw_svc_mesh_t *m = p->mesh;
	rw_wire_carve_t w;
	if (rw_wire_carve_unpack(payload, len, &w) != RW_OK || w.rails != m->rails ||
	    w.index >= m->carve_max)
		return RW_ERR_PROTO;
	rw_rail_remote_t remote[RW_MAX_RAILS];
	for (uint32_t r = 0; r < m->rails; r++)
		if (rw_rail_remote_unpack(w.desc[r], RW_WIRE_DESC_SIZE, &remote[r]) != RW_OK ||
		    remote[r].length < m->carve_bytes)
			return RW_ERR_PROTO;
	memcpy(&p->carve_remote[(size_t)w.index * m->rails], remote, m->rails * sizeof(*remote));
	p->carve_known[w.index] = 1;
	return RW_OK;
}

/* Which area [off, off + len) lies in: -1 the shared one, else the carve-out's index; -2 when
 * it lies in neither or straddles. *at_p: the offset inside that area. */
static int area_of(const rw_svc_mesh_t *m, uint64_t off, uint64_t len, uint64_t *at_p)
{
	if (off < m->area_bytes) {
		*at_p = off;
		return rw_rail_range_check(m->area_bytes, off, len) == RW_OK ? -1 : -2;
	}
	if (!m->carve_bytes)
		return -2;
	const uint64_t i = (off - m->area_bytes) / m->carve_bytes;
	*at_p = (off - m->area_bytes) % m->carve_bytes;
	if (i >= m->carve_max || rw_rail_range_check(m->carve_bytes, *at_p, len) != RW_OK)
		return -2;
	return (int)i;
}

rw_status_t mesh_carve_local(const rw_svc_mesh_t *m, uint32_t rail, uint64_t off, uint64_t len,
			     rw_rail_region_t **region_p, uint64_t *at_p)
{
	const int a = area_of(m, off, len, at_p);
	if (a == -2 || (a >= 0 && !m->carve[a].refs))
		return RW_ERR_RANGE;
	*region_p = a < 0 ? m->region[rail] : m->carve[a].region[rail];
	return RW_OK;
}

rw_status_t mesh_carve_remote(const mesh_peer_t *p, uint32_t rail, uint64_t off, uint64_t len,
			      rw_rail_remote_t *remote_p, uint64_t *at_p)
{
	const rw_svc_mesh_t *m = p->mesh;
	const int a = area_of(m, off, len, at_p);
	if (a == -2 || (a >= 0 && !p->carve_known[a]))
		return RW_ERR_RANGE;
	*remote_p = a < 0 ? p->remote[rail] : p->carve_remote[(size_t)a * m->rails + rail];
	return rw_rail_range_check(remote_p->length, *at_p, len);
}

int mesh_carve_offset(const rw_svc_mesh_t *m, uint32_t rail, const rw_rail_region_t *region,
		      uint64_t offset, uint64_t *off_p)
{
	if (region == m->region[rail]) {
		*off_p = offset;
		return 1;
	}
	for (uint32_t i = 0; i < m->carve_max; i++)
		if (m->carve[i].refs && m->carve[i].region[rail] == region) {
			*off_p = rw_svc_mesh_carve_off(m, i) + offset;
			return 1;
		}
	return 0;
}

uint8_t *rw_svc_mesh_at(rw_svc_mesh_t *m, uint32_t rail, uint64_t off)
{
	uint64_t at;
	const int a = rail < m->rails ? area_of(m, off, 0, &at) : -2;
	if (a == -2 || (a >= 0 && !m->carve[a].refs))
		return NULL;
	return (a < 0 ? m->mem[rail] : m->carve[a].mem[rail]) + at;
}
