/* Receive-region layout of a phase (docs/dataflow.md "Receive-region layout"): from the full
 * count matrix every node derives, without another message, where each (source, rail) range
 * lies in its receive area and where each (destination, rail) slab lies in its send area. */
#include <stdlib.h>
#include <string.h>

#include "service/phase/phase.h"

rw_status_t rw_svc_layout_alloc(rw_svc_layout_t *l, uint32_t nodes, uint32_t rails)
{
	memset(l, 0, sizeof(*l));
	size_t nr = (size_t)nodes * rails;
	l->out_pairs = calloc(nodes, sizeof(*l->out_pairs));
	l->in_quota = calloc(nr, sizeof(uint32_t));
	l->in_first = calloc(nr, sizeof(uint32_t));
	l->out_first = calloc(nr, sizeof(uint32_t));
	l->peer_in_first = calloc(nr, sizeof(uint32_t));
	l->peer_ret_first = calloc(nr, sizeof(uint32_t));
	if (!l->out_pairs || !l->in_quota || !l->in_first || !l->out_first || !l->peer_in_first ||
	    !l->peer_ret_first) {
		rw_svc_layout_free(l);
		return RW_ERR_NOMEM;
	}
	l->nodes = nodes;
	l->rails = rails;
	return RW_OK;
}

void rw_svc_layout_free(rw_svc_layout_t *l)
{
	free(l->out_pairs);
	free(l->in_quota);
	free(l->in_first);
	free(l->out_first);
	free(l->peer_in_first);
	free(l->peer_ret_first);
	memset(l, 0, sizeof(*l));
}

/* quota(s -> d, r) exactly as sender s computes it in rw_sched_plan_build. */
static void pair_quota(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts, uint32_t s,
		       uint32_t d, rw_pair_plan_t *pp)
{
	const uint32_t *count = counts + ((size_t)s * topo->nodes + d) * topo->rails;
	rw_sched_plan_pair(topo, path, s, d, count, pp);
}

rw_status_t rw_svc_layout_build(rw_svc_layout_t *l, const rw_topo_t *topo, rw_path_t path,
				uint32_t me, const uint32_t *counts)
{
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	if (l->nodes != nodes || l->rails != rails || me >= nodes)
		return RW_ERR_INVAL;
	rw_phase_plan_t plan = { .pairs = l->out_pairs };
	rw_status_t st = rw_sched_plan_build(topo, path, me, counts, &plan);
	if (st != RW_OK)
		return st;
	l->me = me;
	l->path = path;
	memset(l->in_total, 0, sizeof(l->in_total));
	memset(l->out_total, 0, sizeof(l->out_total));
	rw_pair_plan_t pp;
	for (uint32_t s = 0; s < nodes; s++) {
		uint32_t *q = l->in_quota + (size_t)s * rails;
		uint32_t *first = l->in_first + (size_t)s * rails;
		if (s == me) {
			memset(q, 0, rails * sizeof(uint32_t));
		} else {
			pair_quota(topo, path, counts, s, me, &pp);
			memcpy(q, pp.quota, rails * sizeof(uint32_t));
		}
		for (uint32_t r = 0; r < rails; r++) {
			first[r] = l->in_total[r];
			l->in_total[r] += q[r];
		}
	}
	for (uint32_t d = 0; d < nodes; d++) {
		uint32_t *first = l->out_first + (size_t)d * rails;
		for (uint32_t r = 0; r < rails; r++) {
			first[r] = l->out_total[r];
			l->out_total[r] += d == me ? 0 : l->out_pairs[d].quota[r];
		}
	}
	/* The peers' views: my range in d's receive area is after every source s' < me sending to
	 * d; my combine range in s's combine area is after every destination d' < me of s. This is
	 * O(N * me) pair balances, done once per phase. */
	for (uint32_t p = 0; p < nodes; p++) {
		uint32_t *in_first = l->peer_in_first + (size_t)p * rails;
		uint32_t *ret_first = l->peer_ret_first + (size_t)p * rails;
		memset(in_first, 0, rails * sizeof(uint32_t));
		memset(ret_first, 0, rails * sizeof(uint32_t));
		if (p == me)
			continue;
		for (uint32_t x = 0; x < me; x++) {
			if (x == p)
				continue;
			pair_quota(topo, path, counts, x, p, &pp); /* x -> p: before me in p's area */
			for (uint32_t r = 0; r < rails; r++)
				in_first[r] += pp.quota[r];
			pair_quota(topo, path, counts, p, x, &pp); /* p -> x: before me in p's send order */
			for (uint32_t r = 0; r < rails; r++)
				ret_first[r] += pp.quota[r];
		}
	}
	return RW_OK;
}

void rw_svc_layout_max(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts,
		       uint64_t *max_in_p, uint64_t *max_out_p)
{
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	uint64_t max_in = 0, max_out = 0;
	rw_pair_plan_t pp;
	for (uint32_t x = 0; x < nodes; x++) {
		uint64_t in[RW_MAX_RAILS] = { 0 }, out[RW_MAX_RAILS] = { 0 };
		for (uint32_t y = 0; y < nodes; y++) {
			if (y == x)
				continue;
			pair_quota(topo, path, counts, y, x, &pp);
			for (uint32_t r = 0; r < rails; r++)
				in[r] += pp.quota[r];
			pair_quota(topo, path, counts, x, y, &pp);
			for (uint32_t r = 0; r < rails; r++)
				out[r] += pp.quota[r];
		}
		for (uint32_t r = 0; r < rails; r++) {
			max_in = RW_MAX(max_in, in[r]);
			max_out = RW_MAX(max_out, out[r]);
		}
	}
	*max_in_p = max_in;
	*max_out_p = max_out;
}
