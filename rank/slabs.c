/* rank/slabs.c: the group's slabs in the rank (docs/rankpath.md "The slab areas, lent per
 * group"). At open, each rail's slab the daemon lends this rank's group (rw_client_group_slab:
 * a sealed memfd, mapped by the client) is registered with CUDA (DEVICEMAP | PORTABLE), so the
 * rank's kernels on any of its devices read and write the very pages the daemon posts from and
 * the peers' writes land in; at close they are unregistered (the client unmaps them at its
 * close). A daemon that lends none (no carve-outs, the pool spent when the group formed, GPU
 * slabs) leaves the rank path without slabs and says why: the count kernel and the words need
 * none, the kernels that move rows do. A host rank (RW_RANK_HOST) uses the mappings as they are. */
#include "rank/rank.h"

#include <stdio.h>
#include <string.h>

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
		int rc = rw_client_group_slab(r->client, k, &s->lent);
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
	for (uint32_t k = 0; k < r->n_slabs && r->device != RW_RANK_HOST; k++)
		rw_cuda_host_unregister(r->slab[k].lent.base);
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
