/* Path plans (docs/algorithms.md §3-§4): per destination, the wave it is sent
 * in and the rail split of its records, for the four paths; and the busiest-NIC load of a phase
 * under a path, whose RailBalance value is the lower bound (docs/architecture.md §6). */
#include <string.h>

#include "sched/sched.h"
#include "sched/sched_priv.h"

/* Pair (s, d) under the path with the rail set computed once by the caller: the one place the
 * rotation rule is applied, so senders and receivers agree. */
static inline void pair_plan(const rw_topo_t *topo, const rw_rail_set_t *base, int balanced,
			     uint32_t s, uint32_t d, const uint32_t *count, rw_pair_plan_t *pp)
{
	rw_rail_set_t tmp;
	const rw_rail_set_t *set = rw_sched_pair_set(topo, base, s, d, &tmp);
	if (balanced)
		rw_sched_balance_set(set, count, rw_sched_pair_rotation(s, d, 0), pp);
	else
		rw_sched_balance_native_set(set, count, rw_sched_pair_rotation(s, d, 0), pp);
}

void rw_sched_plan_pair(const rw_topo_t *topo, rw_path_t path, uint32_t s, uint32_t d,
			const uint32_t *count, rw_pair_plan_t *pp)
{
	rw_rail_set_t set;
	rw_sched_rail_set(topo, &set);
	pair_plan(topo, &set, rw_path_balanced(path), s, d, count, pp);
}

static rw_status_t plan_check(const rw_topo_t *topo, rw_path_t path, uint32_t me,
			      const uint32_t *counts, const void *pairs)
{
	if (rw_sched_topo_check(topo) != RW_OK || (unsigned)path >= RW_PATH_COUNT ||
	    me >= topo->nodes || !counts || !pairs)
		return RW_ERR_INVAL;
	return RW_OK;
}

rw_status_t rw_sched_plan_build(const rw_topo_t *topo, rw_path_t path, uint32_t me,
				const uint32_t *counts, rw_phase_plan_t *plan)
{
	if (!plan || plan_check(topo, path, me, counts, plan->pairs) != RW_OK)
		return RW_ERR_INVAL;
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	const int balanced = rw_path_balanced(path);
	const uint32_t *row = counts + (size_t)me * nodes * rails;
	rw_rail_set_t set;

	rw_sched_rail_set(topo, &set);
	plan->path = path;
	plan->me = me;
	plan->nodes = nodes;
	plan->n_waves = rw_path_waved(path) ? nodes - 1 : 1;
	memset(plan->egress, 0, sizeof(plan->egress));
	for (uint32_t d = 0; d < nodes; d++) {
		rw_pair_plan_t *pp = &plan->pairs[d];
		if (d == me) { /* local records never touch a NIC */
			memset(pp, 0, sizeof(*pp));
			pp->rails = rails;
			continue;
		}
		pair_plan(topo, &set, balanced, me, d, row + (size_t)d * rails, pp);
		if (pp->total == 0)
			continue;
		for (uint32_t r = 0; r < rails; r++)
			plan->egress[r] += pp->quota[r];
	}
	return RW_OK;
}

rw_status_t rw_sched_plan_build_recv(const rw_topo_t *topo, rw_path_t path, uint32_t me,
				     const uint32_t *counts, rw_pair_plan_t *pairs)
{
	if (plan_check(topo, path, me, counts, pairs) != RW_OK)
		return RW_ERR_INVAL;
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	const int balanced = rw_path_balanced(path);
	rw_rail_set_t set;

	rw_sched_rail_set(topo, &set);
	for (uint32_t s = 0; s < nodes; s++) {
		if (s == me) {
			memset(&pairs[s], 0, sizeof(pairs[s]));
			pairs[s].rails = rails;
			continue;
		}
		pair_plan(topo, &set, balanced, s, me, counts + ((size_t)s * nodes + me) * rails, &pairs[s]);
	}
	return RW_OK;
}

/* The per-rail egress records of pair (s, d) under the path: native counts, or quotas. */
static inline void pair_load(const rw_topo_t *topo, const rw_rail_set_t *set, int balanced,
			     const uint32_t *counts, uint32_t s, uint32_t d, rw_pair_plan_t *pp)
{
	pair_plan(topo, set, balanced, s, d, counts + ((size_t)s * topo->nodes + d) * set->rails, pp);
}

/* The most records one rail of node x carries: its egress (pairs (x, y), summed over x's row)
 * or its ingress (pairs (y, x), summed over x's column). */
static uint64_t node_busiest_rail(const rw_topo_t *topo, const rw_rail_set_t *set, int balanced,
				  const uint32_t *counts, uint32_t nodes, uint32_t x, int ingress)
{
	uint64_t load[RW_MAX_RAILS] = { 0 };
	uint64_t busiest = 0;
	rw_pair_plan_t pp;
	for (uint32_t y = 0; y < nodes; y++) {
		if (y == x)
			continue;
		pair_load(topo, set, balanced, counts, ingress ? y : x, ingress ? x : y, &pp);
		for (uint32_t r = 0; r < set->rails; r++)
			load[r] += pp.quota[r];
	}
	for (uint32_t r = 0; r < set->rails; r++)
		busiest = RW_MAX(busiest, load[r]);
	return busiest;
}

/* Rails are symmetric (docs/architecture.md §1): a record leaving s on egress rail r arrives at d
 * on ingress rail r. Egress loads are summed over a source's row, ingress loads over a
 * destination's column, so only R accumulators are live at a time. Waves change when bytes move,
 * not how many each NIC carries, so only whether the path balances matters here. */
uint64_t rw_sched_busiest_nic(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts)
{
	if (rw_sched_topo_check(topo) != RW_OK || !counts)
		return 0;
	const int balanced = rw_path_balanced(path);
	uint64_t busiest = 0;
	rw_rail_set_t set;

	rw_sched_rail_set(topo, &set);
	for (uint32_t x = 0; x < topo->nodes; x++) {
		busiest = RW_MAX(busiest, node_busiest_rail(topo, &set, balanced, counts, topo->nodes, x, 0));
		busiest = RW_MAX(busiest, node_busiest_rail(topo, &set, balanced, counts, topo->nodes, x, 1));
	}
	return busiest;
}

uint64_t rw_sched_lower_bound(const rw_topo_t *topo, const uint32_t *counts)
{
	return rw_sched_busiest_nic(topo, RW_PATH_RAIL_ONLY, counts);
}
