/* What every data mover does the same way with an arrived dispatch record: check its header
 * against the pair (tag, source, owner) and read its top-k, refusing a record with no expert on
 * this node; with an arrived combine record: check its header and find the record it answers;
 * write the metadata of a row forwarded to a local rank. A leaf shared by service/mover/mover_host.c and service/mover/mover_cuda_run.c. */
#include <stdio.h>
#include <string.h>

#include "service/mover/mover.h"
#include "service/phase/phase.h"

rw_status_t rw_svc_mover_rec_read(const rw_svc_phase_t *ph, const uint8_t *rec, uint32_t src,
				  uint32_t rail, uint32_t slot, rw_wire_rec_hdr_t *h_p,
				  int32_t *ids, float *weights, char *why)
{
	if (rw_wire_rec_unpack(rec, ph->topk, h_p) != RW_OK || h_p->tag != ph->tag_in ||
	    h_p->src_node != src || h_p->owner >= ph->gpus) {
		snprintf(why, RW_SVC_WHY_MAX, "bad record header from node %u rail %u slot %u", src,
			 rail, slot);
		return RW_ERR_PROTO;
	}
	for (uint32_t t = 0; t < ph->topk; t++) {
		ids[t] = rw_wire_rec_id(rec, t);
		weights[t] = rw_wire_rec_weight(rec, ph->topk, t);
	}
	if (!rw_svc_fwd_mask(ph->n_experts, ph->nodes, ph->gpus, ph->me, ids, ph->topk)) {
		snprintf(why, RW_SVC_WHY_MAX, "record from node %u rail %u slot %u has no expert on "
			 "this node", src, rail, slot);
		return RW_ERR_PROTO;
	}
	return RW_OK;
}

rw_status_t rw_svc_mover_crec_read(const rw_svc_phase_t *ph, const uint8_t *rec, uint32_t d,
				   uint32_t rail, uint32_t slot, const rw_record_t **r_p, char *why)
{
	rw_wire_crec_hdr_t h;
	rw_wire_crec_unpack(rec, &h);
	if (h.tag != ph->tag_in || h.src_node != d || h.rail != rail || h.slot != slot) {
		snprintf(why, RW_SVC_WHY_MAX, "bad combine record from node %u rail %u slot %u", d,
			 rail, slot);
		return RW_ERR_PROTO;
	}
	const rw_pair_plan_t *pp = &ph->layout->out_pairs[d];
	uint32_t owner_rail, ord;
	rw_sched_unmap(pp, rail, slot, &owner_rail, &ord);
	*r_p = &ph->rec[ph->row_off[d * ph->rails + owner_rail] + ord];
	return RW_OK;
}

void rw_svc_mover_meta_put(const rw_svc_phase_t *ph, uint8_t *meta, uint32_t src_node,
			   uint32_t src_rank, uint32_t token, const int32_t *ids, const float *weights,
			   uint32_t g, uint32_t *expert_counts)
{
	const uint32_t per_rank = ph->n_experts / (ph->nodes * ph->gpus);
	rw_wire_put32(meta, src_node);
	rw_wire_put32(meta + 4, src_rank);
	rw_wire_put32(meta + 8, token);
	rw_wire_put32(meta + 12, 0);
	memcpy(meta + 16, ids, 4u * ph->topk);
	memcpy(meta + 16 + 4u * ph->topk, weights, 4u * ph->topk);
	for (uint32_t k = 0; k < ph->topk; k++)
		if (ids[k] >= 0 && (uint32_t)ids[k] / per_rank == ph->me * ph->gpus + g)
			expert_counts[ids[k]]++;
}

int64_t rw_svc_rank_out_add(rw_svc_rank_out_t *ro, const rw_svc_phase_t *ph, uint32_t ref,
			    uint32_t src_node, uint32_t src_rank, uint32_t token,
			    const int32_t *ids, const float *weights, uint32_t *rows_p)
{
	uint32_t mask = rw_svc_phase_fwd_mask(ph, ids);
	for (uint32_t g = 0; g < ph->gpus; g++) {
		if (!(mask & (1u << g)))
			continue;
		const rw_svc_out_layout_t *o = &ro->layout[g];
		uint32_t j = ro->n[g];
		if (j >= o->rows_cap)
			return -1;
		rw_svc_mover_meta_put(ph, ro->meta[g] + (uint64_t)j * o->meta_bytes, src_node,
				      src_rank, token, ids, weights, g, ro->expert_counts[g]);
		ro->ref[g][j] = ref;
		if (ref < ro->n_contrib)
			ro->contrib[(size_t)ref * ph->gpus + g] = j + 1;
		ro->n[g] = j + 1;
		rows_p[g] = j;
	}
	return mask;
}
