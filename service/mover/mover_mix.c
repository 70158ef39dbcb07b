/* A ring rank in a rank-path pair (docs/rankpath.md "Ring and page ranks in one group"): where a
 * node's ranks of one group mix the ring (host buffers, rw_client_submit) and the page, the rank
 * mover carries the whole pair and the daemon's CPU plays each ring rank's stream under the plan
 * block and lists a page rank's kernels get — its records packed where its plan entries say, its
 * rows forwarded from its list, its combine gather's returns and local copies written, its owner
 * sums made from its reduce list. The places and the fixed fp32 order are the kernels', so every
 * record and term lands where the page ranks look for it and a token's sum has the same bits
 * whatever kind of rank each term came from. Pure: no allocation, no system call; the caller
 * owns every buffer. A leaf of service/mover/. */
#include <stdio.h>
#include <string.h>

#include "service/mover/mover.h"
#include "service/phase/phase.h"

rw_status_t rw_svc_ring_pack(const rw_svc_phase_t *ph, uint32_t g, const uint32_t *tags,
			     const rw_page_plan_entry_t *entry, uint8_t *const *slab, uint32_t *next,
			     char *why)
{
	const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
	const uint64_t row_off = rw_wire_rec_row_off(ph->topk);
	memset(next, 0, ph->nodes * sizeof(*next));
	for (uint32_t t = 0; t < io->n_tokens; t++) {
		const int32_t *ids = io->ids + (size_t)t * ph->topk;
		for (uint32_t k = 0; k < ph->topk; k++) {
			if (ids[k] < 0)
				continue;
			const uint32_t d = rw_sched_expert_node(ph->n_experts, ph->nodes, (uint32_t)ids[k]);
			uint32_t q = 0; /* one record per (token, node): its first expert there */
			while (q < k && (ids[q] < 0 ||
					 rw_sched_expert_node(ph->n_experts, ph->nodes, (uint32_t)ids[q]) != d))
				q++;
			if (q < k)
				continue;
			uint32_t rail;
			uint64_t off;
			if (rw_page_plan_find(entry, ph->rails, d, next[d]++, (uint32_t)ph->rec_size, &rail,
					      &off)) {
				snprintf(why, RW_SVC_WHY_MAX, "local rank %u: its token %u has no place "
					 "in its plan to node %u", ph->me * ph->gpus + g, t, d);
				return RW_ERR_INVAL;
			}
			uint8_t *rec = slab[rail] + off;
			const rw_wire_rec_hdr_t h = { .tag = tags[d], .src_node = ph->me, .owner = g,
						      .token = t, .topk = ph->topk };
			rw_wire_rec_pack(rec, &h, ids, io->weights + (size_t)t * ph->topk);
			memcpy(rec + row_off, io->tokens + (size_t)t * ph->row_bytes, ph->row_bytes);
		}
	}
	return RW_OK;
}

/* The record list entry e names: in a receive or a local area of the dispatch. */
static const uint8_t *list_rec(const rw_svc_phase_t *ph, const rw_svc_rank_lists_t *ls,
			       const rw_page_list_entry_t *e)
{
	const uint8_t *area = e->area == RW_PAGE_AREA_RECV ? ls->recv[e->rail] : ls->local[e->rail];
	return area + (uint64_t)e->slot * ph->rec_size;
}

rw_status_t rw_svc_ring_forward(const rw_svc_phase_t *ph, uint32_t g, const rw_svc_rank_lists_t *ls,
				uint8_t *rows, uint8_t *meta, uint32_t *counts, char *why)
{
	const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
	rw_svc_out_layout_t o;
	rw_svc_out_layout(io->out_cap, ph->n_experts, ph->topk, ph->row_bytes, RW_CQE_INLINE_COUNTS,
			  &o);
	memset(counts, 0, ph->n_experts * sizeof(*counts));
	if (ls->n[g] > o.rows_cap) {
		snprintf(why, RW_SVC_WHY_MAX, "local rank %u's dispatch output holds %llu rows; it "
			 "receives %u", ph->me * ph->gpus + g, (unsigned long long)o.rows_cap,
			 ls->n[g]);
		return RW_ERR_SUB_SPACE;
	}
	const uint64_t row_off = rw_wire_rec_row_off(ph->topk);
	int32_t ids[RW_MAX_TOPK];
	float w[RW_MAX_TOPK];
	for (uint32_t j = 0; j < ls->n[g]; j++) {
		const uint8_t *rec = list_rec(ph, ls, &ls->list[g][j]);
		rw_wire_rec_hdr_t h;
		(void)rw_wire_rec_unpack(rec, ph->topk, &h); /* checked: the list was made from it */
		for (uint32_t k = 0; k < ph->topk; k++) {
			ids[k] = rw_wire_rec_id(rec, k);
			w[k] = rw_wire_rec_weight(rec, ph->topk, k);
		}
		rw_svc_mover_meta_put(ph, meta + (uint64_t)j * o.meta_bytes, h.src_node,
				      h.src_node * ph->gpus + h.owner, h.token, ids, w, g, counts);
		memcpy(rows + (uint64_t)j * ph->row_bytes, rec + row_off, ph->row_bytes);
	}
	return RW_OK;
}

rw_status_t rw_svc_ring_gather(const rw_svc_phase_t *ph, uint32_t w, const rw_svc_rank_lists_t *ls,
			       const uint32_t *tags, const rw_page_plan_entry_t *entry,
			       uint8_t *const *slab, const uint8_t *const *staged, float *acc,
			       char *why)
{
	for (uint32_t j = 0; j < ls->n[w]; j++) {
		const uint32_t t0 = ls->term_off[w][j], t1 = ls->term_off[w][j + 1];
		if (t0 == t1)
			continue; /* another local rank writes this one */
		const rw_page_list_entry_t *e = &ls->list[w][j];
		const rw_page_plan_entry_t *pe = &entry[(size_t)e->node * ph->rails + e->rail];
		const uint32_t p = e->slot - pe->first;
		if (p >= pe->count) {
			snprintf(why, RW_SVC_WHY_MAX, "local rank %u: row %u has no place in its "
				 "combine plan", ph->me * ph->gpus + w, j);
			return RW_ERR_INVAL;
		}
		uint8_t *rec = slab[e->rail] + pe->offset + (uint64_t)p * ph->crec_size;
		const rw_wire_crec_hdr_t h = { .tag = tags[e->node], .src_node = ph->me,
					       .rail = e->rail, .slot = p };
		rw_wire_crec_pack(rec, &h);
		uint8_t *out = rec + RW_WIRE_CREC_HDR;
		/* The local ranks' rows of the record, by rank: one is sent as it is, several are
		 * summed in fp32 from the first and rounded once (as the gather kernel). */
		for (uint32_t k = t0; k < t1; k++) {
			const uint32_t ref = ls->term_ref[w][k];
			const uint8_t *row = staged[RW_PAGE_TERM_RANK(ref)] +
					     (uint64_t)RW_PAGE_TERM_ROW(ref) * ph->row_bytes;
			if (t1 - t0 == 1)
				memcpy(out, row, ph->row_bytes);
			else if (k == t0)
				rw_svc_row_load(acc, row, ph->dtype, ph->hidden);
			else
				rw_svc_row_acc(acc, row, ph->dtype, ph->hidden);
		}
		if (t1 - t0 > 1)
			rw_svc_row_store(out, ph->dtype, acc, ph->hidden);
	}
	return RW_OK;
}

void rw_svc_ring_reduce(const rw_svc_phase_t *ph, uint32_t g, const rw_page_list_entry_t *list,
			uint32_t n, const uint8_t *const *local, const void **rows, uint8_t *out)
{
	const uint32_t n_tokens = ph->io[RW_SVC_DISPATCH][g].n_tokens;
	uint32_t i = 0;
	for (uint32_t t = 0; t < n_tokens; t++) {
		uint32_t cnt = 0;
		for (; i < n && list[i].token == t; i++) {
			const rw_page_list_entry_t *e = &list[i];
			const uint8_t *area = e->area == RW_PAGE_AREA_RECV ?
				ph->recv_area[RW_SVC_COMBINE][e->rail] : local[e->rail];
			rows[cnt++] = area + (uint64_t)e->slot * ph->crec_size + RW_WIRE_CREC_HDR;
		}
		rw_svc_rows_reduce(out + (uint64_t)t * ph->row_bytes, ph->dtype, rows, cnt, ph->hidden);
	}
}
