/* The owner's combine sums, as every data mover orders them (docs/dataflow.md "Combine"): each
 * owner token's terms in the order they are added — its local ranks' rows by local rank, then
 * the rows that came back, by source node — and how many of those are still out, so a token is
 * summed once, when its last term is in, whatever order the ranges arrive in. A leaf shared by
 * service/mover/mover_host.c and service/mover/mover_cuda_run.c. */
#include "service/mover/mover.h"

rw_status_t rw_svc_owner_plan(rw_svc_owner_t *o, rw_arena_t *mem, const rw_svc_phase_t *ph,
			      const uint32_t *local_ref, uint32_t n_local)
{
	uint32_t n = 0;
	for (uint32_t g = 0; g < ph->gpus; g++) {
		o->base[g] = n;
		n += ph->rt[g].n_tokens;
	}
	o->base[ph->gpus] = n;
	o->n = n;
	const uint32_t R = ph->rails, n_rec = ph->row_off[(size_t)ph->nodes * R];
	const uint32_t lo = ph->row_off[(size_t)ph->me * R], hi = ph->row_off[(size_t)(ph->me + 1) * R];
	o->local = rw_arena_alloc(mem, (size_t)n + 1, sizeof(uint32_t));
	o->first = rw_arena_alloc(mem, (size_t)n + 1, sizeof(uint32_t));
	o->left = rw_arena_alloc(mem, (size_t)n + 1, sizeof(uint32_t));
	o->done = rw_arena_alloc(mem, (size_t)n + 1, 1);
	o->recs = rw_arena_alloc(mem, (size_t)n_rec - (hi - lo) + 1, sizeof(uint32_t));
	if (!o->local || !o->first || !o->left || !o->done || !o->recs)
		return RW_ERR_NOMEM;
	/* Records are in (destination, rail) segments, destinations ascending, and a token has at
	 * most one per destination: filled in record order, a token's list is by node. `left`
	 * counts them first and is the fill cursor (from the end) after. */
	for (uint32_t i = 0; i < n_local; i++)
		o->local[o->base[local_ref[2 * i]] + local_ref[2 * i + 1]] = 1 + i;
	for (uint32_t j = 0; j < n_rec; j++)
		if (j < lo || j >= hi)
			o->left[o->base[ph->rec[j].rank] + ph->rec[j].token]++;
	for (uint32_t u = 0; u < n; u++)
		o->first[u + 1] = o->first[u] + o->left[u];
	for (uint32_t j = n_rec; j-- > 0;) {
		if (j >= lo && j < hi)
			continue;
		const uint32_t u = o->base[ph->rec[j].rank] + ph->rec[j].token;
		o->recs[o->first[u] + --o->left[u]] = j;
	}
	for (uint32_t u = 0; u < n; u++)
		o->left[u] = o->first[u + 1] - o->first[u];
	return RW_OK;
}

int rw_svc_owner_back(rw_svc_owner_t *o, const rw_svc_phase_t *ph, uint32_t rec, uint32_t *u_p)
{
	const uint32_t u = o->base[ph->rec[rec].rank] + ph->rec[rec].token;
	*u_p = u;
	if (!o->left[u]) /* never: each record's row comes back once */
		return 0;
	return --o->left[u] == 0;
}

uint32_t rw_svc_owner_terms(const rw_svc_owner_t *o, const rw_svc_phase_t *ph,
			    const rw_svc_rank_out_t *ro, uint32_t u, const uint64_t *row_at,
			    const uint64_t *back_at, uint64_t *terms)
{
	uint32_t n = 0;
	if (o->local[u]) {
		const uint32_t *c = &ro->contrib[(size_t)(ph->n_in + o->local[u] - 1) * ph->gpus];
		for (uint32_t h = 0; h < ph->gpus; h++)
			if (c[h])
				terms[n++] = row_at[h] + (uint64_t)(c[h] - 1) * ph->row_bytes;
	}
	for (uint32_t k = o->first[u]; k < o->first[u + 1]; k++)
		terms[n++] = back_at[o->recs[k]];
	return n;
}
