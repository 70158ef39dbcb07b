/* A group's carve-out: how the daemon cuts it, what a page-rank phase's local area needs of it,
 * and the carve-out the largest phase of a shape needs (service/phase/phase.h). */
#include <stdlib.h>

#include "service/phase/phase.h"

#define LINE_UP(x) (((x) + 63) & ~(uint64_t)63)

uint64_t rw_svc_carve_sub(uint64_t carve_bytes)
{
	return (carve_bytes / 5) & ~(uint64_t)63;
}

void rw_svc_local_plan(uint32_t rails, uint32_t gpus, uint64_t rec, uint64_t crec,
		       uint64_t row_bytes, uint64_t n_in, const uint32_t *local_n,
		       rw_svc_local_plan_t *lp)
{
	uint64_t rows_max = n_in;
	for (uint32_t r = 0; r < rails; r++)
		rows_max += local_n[r];
	lp->stage_stride = LINE_UP(rows_max * row_bytes);
	lp->stage_off = 0;
	for (uint32_t r = 0; r < rails; r++) {
		lp->comb_off[r] = LINE_UP(local_n[r] * rec);
		lp->end[r] = lp->comb_off[r] + LINE_UP(gpus * local_n[r] * crec);
		if (r == 0) {
			lp->stage_off = lp->end[0];
			lp->end[0] += gpus * lp->stage_stride;
		}
	}
}

int rw_svc_carve_fits(uint64_t carve_bytes, const rw_svc_carve_need_t *need)
{
	const uint64_t sub = rw_svc_carve_sub(carve_bytes);
	return sub >= need->sub_need && carve_bytes - 4 * sub >= need->local_need;
}

rw_status_t rw_svc_carve_size(const rw_topo_t *topo, uint32_t topk, uint32_t hidden,
			      uint32_t dtype, uint32_t tokens, uint32_t max_mib,
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
	/* n_in: every other node's every token (whatever the rails it came on) */
	rw_svc_local_plan_t lp;
	rw_svc_local_plan(R, G, rec, rw_wire_crec_size(hidden, dtype),
			  rw_wire_row_bytes(hidden, dtype), (uint64_t)(N - 1) * G * tokens, local_n,
			  &lp);
	need->local_need = 0;
	for (uint32_t r = 0; r < R; r++)
		need->local_need = RW_MAX(need->local_need, lp.end[r]);
	need->area_mib = 0;
	for (uint32_t m = 1; m <= max_mib; m++)
		if (rw_svc_carve_fits((uint64_t)m << 20, need)) {
			need->area_mib = m;
			break;
		}
	return RW_OK;
}
