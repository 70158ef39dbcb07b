/* A group's carve-out: how the daemon cuts it, what a page-rank phase's local area needs of it,
 * and the carve-out the largest phase of a shape needs (service/phase/phase.h). */
#include <stdlib.h>

#include "service/phase/phase.h"

#define LINE_UP(x) (((x) + 63) & ~(uint64_t)63)

uint64_t rw_svc_carve_sub(uint64_t carve_bytes, uint64_t local_bytes)
{
	if (!local_bytes)
		return (carve_bytes / 5) & ~(uint64_t)63;
	return local_bytes < carve_bytes ? ((carve_bytes - local_bytes) / 4) & ~(uint64_t)63 : 0;
}

void rw_svc_local_plan(uint32_t rails, uint32_t gpus, const uint8_t *gpu_rail, uint64_t rec,
		       uint64_t crec, uint64_t row_bytes, uint64_t rank_rows,
		       const uint32_t *local_n, rw_svc_local_plan_t *lp)
{
	const uint64_t stride = LINE_UP(rank_rows * row_bytes);
	for (uint32_t r = 0; r < rails; r++) {
		lp->comb_off[r] = LINE_UP(local_n[r] * rec);
		lp->end[r] = lp->comb_off[r] + LINE_UP(gpus * local_n[r] * crec);
	}
	for (uint32_t g = 0; g < gpus; g++) { /* each rank's rows on its own rail, in rank order */
		lp->stage_at[g] = lp->end[gpu_rail[g]];
		lp->end[gpu_rail[g]] += stride;
	}
}

int rw_svc_carve_fits(uint64_t carve_bytes, uint64_t local_bytes, const rw_svc_carve_need_t *need)
{
	if (local_bytes >= carve_bytes) /* the config's rule: the record areas get the rest */
		return 0;
	const uint64_t sub = rw_svc_carve_sub(carve_bytes, local_bytes);
	return sub >= need->sub_need && carve_bytes - 4 * sub >= need->local_need;
}

rw_status_t rw_svc_carve_size(const rw_topo_t *topo, uint32_t topk, uint32_t hidden,
			      uint32_t dtype, uint32_t tokens, uint32_t max_recv, uint32_t max_mib,
			      rw_svc_carve_need_t *need)
{
	if (rw_sched_topo_check(topo) != RW_OK || !tokens || !hidden || !topk)
		return RW_ERR_INVAL;
	const uint32_t N = topo->nodes, R = topo->rails, G = topo->gpus_per_node;
	uint32_t *counts = calloc((size_t)N * N * R, sizeof(uint32_t));
	if (!counts)
		return RW_ERR_NOMEM;
	/* Every cell at its most: each rank's tokens, one record each, at the rank's native rail.
	 * A node's receive side depends only on the pairs into it, so any one node's worst case is
	 * reached by a routing that sends every token there (any top-k >= 1). */
	uint32_t local_n[RW_MAX_RAILS] = { 0 };
	for (uint32_t g = 0; g < G; g++)
		local_n[topo->gpu_rail[g]] += tokens;
	for (uint32_t s = 0; s < N; s++)
		for (uint32_t d = 0; d < N; d++)
			for (uint32_t r = 0; r < R; r++)
				counts[((size_t)s * N + d) * R + r] = s == d ? 0 : local_n[r];
	uint64_t max_rec = 0;
	for (int p = 0; p < RW_PATH_COUNT; p++) {
		uint64_t in, out;
		rw_svc_layout_max(topo, (rw_path_t)p, counts, &in, &out);
		max_rec = RW_MAX(max_rec, RW_MAX(in, out));
	}
	free(counts);
	const uint64_t rec = rw_wire_rec_size(topk, hidden, dtype);
	need->max_records = max_rec;
	need->sub_need = max_rec * rec;
	/* A rank receives at most one row per record into its node: every token of the world,
	 * and at most its page's max_recv. */
	const uint64_t world = (uint64_t)N * G * tokens;
	need->rank_rows = max_recv ? RW_MIN(world, (uint64_t)max_recv) : world;
	const uint64_t crec = rw_wire_crec_size(hidden, dtype), row = rw_wire_row_bytes(hidden, dtype);
	rw_svc_local_plan_t lp;
	rw_svc_local_plan(R, G, topo->gpu_rail, rec, crec, row, need->rank_rows, local_n, &lp);
	uint32_t big = 0;
	for (uint32_t r = 1; r < R; r++)
		if (lp.end[r] > lp.end[big])
			big = r;
	need->local_need = lp.end[big];
	need->local_records = local_n[big] * rec;
	need->local_copies = (uint64_t)G * local_n[big] * crec;
	need->local_staging = lp.end[big] - LINE_UP(need->local_copies) - lp.comb_off[big];
	need->local_mib = (uint32_t)RW_MIN((need->local_need + (1u << 20) - 1) >> 20, UINT32_MAX);
	need->area_mib = 0;
	for (uint64_t m = need->local_mib + 1; m <= max_mib; m++)
		if (rw_svc_carve_fits(m << 20, (uint64_t)need->local_mib << 20, need)) {
			need->area_mib = (uint32_t)m;
			break;
		}
	return RW_OK;
}
