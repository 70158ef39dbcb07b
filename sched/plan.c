/* Path plans (DESIGN §4.3, §4.4; docs/algorithms.md §3-§4): per destination, the wave it is sent
 * in and the rail split of its records, for the four paths; and the busiest-NIC load of a phase
 * under a path, whose RailBalance value is the lower bound of §6. */
#include <string.h>

#include "sched/sched.h"

/* Slice 0 of pair (s, d) uses rotation d (callers splitting a pair pass d + slice), so one
 * source's remainders rotate across its destinations. Receivers use the same rule for (s, me). */
static inline uint32_t pair_rotation(uint32_t d) { return d; }

rw_status_t rw_sched_plan_build(const rw_topo_t *topo, rw_path_t path, uint32_t me,
				const uint32_t *counts, rw_phase_plan_t *plan)
{
	if (rw_sched_topo_check(topo) != RW_OK || (unsigned)path >= RW_PATH_COUNT ||
	    me >= topo->nodes || !counts || !plan || !plan->pairs)
		return RW_ERR_INVAL;
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	const int balanced = rw_path_balanced(path);

	plan->path = path;
	plan->me = me;
	plan->nodes = nodes;
	plan->n_waves = rw_path_waved(path) ? nodes - 1 : 1;
	memset(plan->egress, 0, sizeof(plan->egress));
	for (uint32_t d = 0; d < nodes; d++) {
		rw_pair_plan_t *pp = &plan->pairs[d];
		const uint32_t *count = counts + ((size_t)me * nodes + d) * rails;
		if (d == me) { /* local records never touch a NIC */
			memset(pp, 0, sizeof(*pp));
			pp->rails = rails;
			continue;
		}
		if (balanced)
			rw_sched_balance(topo, count, pair_rotation(d), pp);
		else
			rw_sched_balance_native(topo, count, pp);
		for (uint32_t r = 0; r < rails; r++)
			plan->egress[r] += pp->quota[r];
	}
	return RW_OK;
}

/* The per-rail egress records of pair (s, d) under the path: native counts, or quotas. */
static inline void pair_load(const rw_topo_t *topo, int balanced, const uint32_t *counts,
			     uint32_t s, uint32_t d, rw_pair_plan_t *pp)
{
	const uint32_t *count = counts + ((size_t)s * topo->nodes + d) * topo->rails;
	if (balanced)
		rw_sched_balance(topo, count, pair_rotation(d), pp);
	else
		rw_sched_balance_native(topo, count, pp);
}

/* Rails are symmetric (§1): a record leaving s on egress rail r arrives at d on ingress rail r.
 * Egress loads are summed over a source's row, ingress loads over a destination's column, so
 * only R accumulators are live at a time. Waves change when bytes move, not how many each NIC
 * carries, so only whether the path balances matters here. */
uint64_t rw_sched_busiest_nic(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts)
{
	if (rw_sched_topo_check(topo) != RW_OK || !counts)
		return 0;
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	const int balanced = rw_path_balanced(path);
	uint64_t busiest = 0;
	rw_pair_plan_t pp;

	for (uint32_t s = 0; s < nodes; s++) {
		uint64_t load[RW_MAX_RAILS] = { 0 };
		for (uint32_t d = 0; d < nodes; d++) {
			if (d == s)
				continue;
			pair_load(topo, balanced, counts, s, d, &pp);
			for (uint32_t r = 0; r < rails; r++)
				load[r] += pp.quota[r];
		}
		for (uint32_t r = 0; r < rails; r++)
			busiest = RW_MAX(busiest, load[r]);
	}
	for (uint32_t d = 0; d < nodes; d++) {
		uint64_t load[RW_MAX_RAILS] = { 0 };
		for (uint32_t s = 0; s < nodes; s++) {
			if (s == d)
				continue;
			pair_load(topo, balanced, counts, s, d, &pp);
			for (uint32_t r = 0; r < rails; r++)
				load[r] += pp.quota[r];
		}
		for (uint32_t r = 0; r < rails; r++)
			busiest = RW_MAX(busiest, load[r]);
	}
	return busiest;
}

uint64_t rw_sched_lower_bound(const rw_topo_t *topo, const uint32_t *counts)
{
	return rw_sched_busiest_nic(topo, RW_PATH_RAIL_ONLY, counts);
}
