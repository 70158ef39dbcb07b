/* rank/slabs.c: the group's slabs in the rank (docs/rankpath.md "The slab areas, lent per
 * group"). At open, each rail's slab the daemon lends this rank's group (rw_client_group_slab_kind)
 * is made reachable from the rank's device: host memory (a sealed memfd, mapped by the client)
 * registered with CUDA (DEVICEMAP | PORTABLE), GPU memory (a CUDA allocation's POSIX fd) imported
 * and mapped here (cuda/vmm.c) with read-write access for the rank's device — where that is not
 * the slab's own device, only if the two reach each other (peer access), else refused, named. So
 * the rank's kernels read and write the very memory the daemon posts from and the peers' writes
 * land in. At close they are unregistered or unmapped (the client unmaps host slabs and closes
 * GPU slabs' fds at its close). A daemon that lends none (no carve-outs, the pool spent when the
 * group formed, its GPU carve-out could not be made) leaves the rank path without slabs and says
 * why: the count kernel and the words need none, the kernels that move rows do. A host rank
 * (RW_RANK_HOST) uses host slabs' mappings as they are and cannot use GPU slabs. */
#include "rank/rank.h"

#include <stdio.h>
#include <string.h>

/* A GPU slab into this process for the rank's device: 0, or an RW_E_* code with r->msg set. */
static int slab_import(rw_client_rank_t *r, uint32_t k, const rw_client_slab_gpu_t *g)
{
	rw_rank_slab_t *s = &r->slab[k];
	char why[160];
	int dev = -1;
	if (r->device == RW_RANK_HOST) {
		snprintf(r->msg, RW_RANK_MSG_MAX, "rank path: the group's slab of rail %u is GPU memory, "
			 "which a host rank cannot use", k);
		return RW_E_STATE;
	}
	if (rw_cuda_device_by_uuid(g->uuid, &dev) != RW_OK) {
		snprintf(r->msg, RW_RANK_MSG_MAX, "rank path: the group's slab of rail %u is on the "
			 "daemon's GPU %d, which this process does not see (CUDA_VISIBLE_DEVICES?)",
			 k, g->device);
		return RW_E_CUDA;
	}
	const int mine = r->device;
	if (rw_cuda_vmm_import(g->fd, s->lent.bytes, dev, &mine, 1, &s->vmm, why,
			       sizeof(why)) != RW_OK) {
		snprintf(r->msg, RW_RANK_MSG_MAX, "rank path: the group's slab of rail %u (GPU %d) for "
			 "device %d: %s", k, dev, mine, why);
		return RW_E_CUDA;
	}
	s->dptr = rw_cuda_vmm_dptr(s->vmm);
	return 0;
}

int rw_rank_slabs_open(rw_client_rank_t *r)
{
	r->n_slabs = 0;
	r->slabs_code = 0;
	const uint32_t rails = r->pg->rails;
	if (rails == 0 || rails > RW_CLIENT_SLAB_RAILS) {
		snprintf(r->msg, RW_RANK_MSG_MAX, "rank path: the page names %u rails", rails);
		return RW_E_BADREPLY;
	}
	for (uint32_t k = 0; k < rails; k++) {
		rw_rank_slab_t *s = &r->slab[k];
		rw_client_slab_gpu_t g;
		s->vmm = NULL;
		int rc = rw_client_group_slab_kind(r->client, k, &s->lent, &g);
		if (rc == RW_E_STATE || rc == RW_E_LIMIT) {
			if (k == 0) { /* none lent to the group: the rank path runs without */
				r->slabs_code = rc;
				snprintf(r->msg, RW_RANK_MSG_MAX, "rank path: no group slabs: %s",
					 rw_client_last_message(r->client));
				return 0;
			}
		}
		if (rc == 0 && (s->lent.rails != rails || s->lent.rail != k)) {
			rc = RW_E_BADREPLY;
		} else if (rc == 0 && g.kind == RW_CLIENT_SLAB_GPU) {
			if ((rc = slab_import(r, k, &g)) != 0) {
				rw_rank_slabs_close(r);
				return rc;
			}
		} else if (rc == 0 && r->device == RW_RANK_HOST) { /* a host rank: its own pointers */
			s->dptr = (rw_cuda_dptr_t)(uintptr_t)s->lent.base;
		} else if (rc == 0 && rw_cuda_host_register_mapped(s->lent.base, s->lent.bytes,
								      &s->dptr) != RW_OK) {
			rc = RW_E_CUDA;
		}
		if (rc) {
			snprintf(r->msg, RW_RANK_MSG_MAX, "rank path: the group's slab of rail %u: %s (%s)",
				 k, rw_client_strerror(rc), rc == RW_E_CUDA ? "cuMemHostRegister failed" :
				 rw_client_last_message(r->client));
			rw_rank_slabs_close(r);
			return rc;
		}
		r->n_slabs = k + 1;
	}
	return 0;
}

void rw_rank_slabs_close(rw_client_rank_t *r)
{
	for (uint32_t k = 0; k < r->n_slabs; k++) {
		rw_rank_slab_t *s = &r->slab[k];
		if (s->vmm) /* unmapped here; the memory goes with its last holder */
			rw_cuda_vmm_release(s->vmm);
		else if (r->device != RW_RANK_HOST)
			rw_cuda_host_unregister(s->lent.base);
		s->vmm = NULL;
	}
	r->n_slabs = 0;
}

int rw_client_rank_slab(rw_client_rank_t *r, uint32_t rail, rw_client_slab_t *slab_p,
			uint64_t *dptr_p)
{
	if (!r || !slab_p || !dptr_p)
		return RW_E_INVAL;
	if (!r->n_slabs && r->slabs_code)
		return r->slabs_code;
	if (rail >= r->n_slabs)
		return RW_E_INVAL;
	*slab_p = r->slab[rail].lent;
	*dptr_p = r->slab[rail].dptr;
	return 0;
}
