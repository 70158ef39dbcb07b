/* Topology of a rail-optimized cluster (docs/architecture.md §1, §3): N nodes of G GPUs and R rail
 * NICs, which rail each GPU sits next to, and the relative capacity of each rail (0 = failed or
 * masked). Everything else in sched/ takes a topology that passed rw_sched_topo_check(). */
#include <string.h>

#include "sched/sched.h"

rw_status_t rw_sched_topo_init(rw_topo_t *topo, uint32_t nodes, uint32_t gpus_per_node,
			       uint32_t rails)
{
	if (!topo || nodes < 1 || nodes > RW_MAX_NODES || gpus_per_node < 1 ||
	    gpus_per_node > RW_MAX_GPUS || rails < 1 || rails > RW_MAX_RAILS)
		return RW_ERR_INVAL;
	memset(topo, 0, sizeof(*topo));
	topo->nodes = nodes;
	topo->gpus_per_node = gpus_per_node;
	topo->rails = rails;
	for (uint32_t g = 0; g < gpus_per_node; g++)
		topo->gpu_rail[g] = (uint8_t)(g % rails);
	for (uint32_t r = 0; r < rails; r++)
		topo->rail_weight[r] = 1;
	return RW_OK;
}

rw_status_t rw_sched_topo_check(const rw_topo_t *topo)
{
	if (!topo || topo->nodes < 1 || topo->nodes > RW_MAX_NODES || topo->gpus_per_node < 1 ||
	    topo->gpus_per_node > RW_MAX_GPUS || topo->rails < 1 || topo->rails > RW_MAX_RAILS)
		return RW_ERR_INVAL;
	for (uint32_t g = 0; g < topo->gpus_per_node; g++)
		if (topo->gpu_rail[g] >= topo->rails)
			return RW_ERR_INVAL;
	for (uint32_t r = 0; r < topo->rails; r++)
		if (topo->rail_weight[r] > RW_MAX_RAIL_WEIGHT)
			return RW_ERR_INVAL;
	return rw_sched_topo_eligible(topo) > 0 ? RW_OK : RW_ERR_INVAL;
}

uint32_t rw_sched_topo_eligible(const rw_topo_t *topo)
{
	uint32_t n = 0;
	for (uint32_t r = 0; r < topo->rails && r < RW_MAX_RAILS; r++)
		n += topo->rail_weight[r] > 0;
	return n;
}
