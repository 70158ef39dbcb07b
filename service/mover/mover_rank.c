/* The rank path's arithmetic on the daemon's side (docs/rankpath.md "A phase"): what a rank's
 * plan block says (where each of its records goes: the same (egress rail, slot) the host
 * mover's pack gives it), the check of the records a rank's pack kernel wrote before any byte
 * of them is posted, and a rank's forward list. Pure: no allocation, no system call; the caller
 * owns every buffer. A leaf of service/mover/. */
#include <stdio.h>
#include <string.h>

#include "service/mover/mover.h"
#include "service/phase/phase.h"

/* Rank g's first ordinal in segment (d, its rail): the records of the lower local ranks of the
 * same native rail come first (rw_sched_records: rank order, then token order). */
static uint32_t rank_base(const rw_svc_phase_t *ph, uint32_t g, const uint32_t *const *rows,
			  uint32_t d)
{
	const uint32_t r = ph->topo->gpu_rail[g];
	uint32_t base = 0;
	for (uint32_t h = 0; h < g; h++)
		if (ph->topo->gpu_rail[h] == r && rows[h])
			base += rows[h][(size_t)d * ph->rails + r];
	return base;
}

void rw_svc_rank_plan(const rw_svc_phase_t *ph, uint32_t g, const uint32_t *const *rows,
		      const rw_page_plan_rail_t *areas, uint64_t k, rw_page_plan_head_t *head,
		      uint32_t *tags, rw_page_plan_entry_t *entry)
{
	const uint32_t R = ph->rails, r = ph->topo->gpu_rail[g];
	const rw_svc_layout_t *l = ph->layout;
	*head = (rw_page_plan_head_t){ .phase = k, .kind = 0, .me = ph->me, .owner = g,
				       .topk = ph->topk, .rec_size = (uint32_t)ph->rec_size,
				       .row_off = (uint32_t)rw_wire_rec_row_off(ph->topk) };
	memset(entry, 0, (size_t)ph->nodes * R * sizeof(*entry));
	for (uint32_t d = 0; d < ph->nodes; d++) {
		tags[d] = d == ph->me ? ph->tag_in : ph->tag_to[d];
		const uint32_t n = rows[g] ? rows[g][(size_t)d * R + r] : 0;
		if (!n)
			continue;
		const uint32_t base = rank_base(ph, g, rows, d);
		rw_page_plan_entry_t *e = &entry[(size_t)d * R];
		if (d == ph->me) { /* the local area holds segment (me, r) in ordinal order */
			e[r] = (rw_page_plan_entry_t){ .first = 0, .count = n,
						       .offset = areas[r].local_off +
								 (uint64_t)base * ph->rec_size };
			head->n_local += n;
			continue;
		}
		head->n_send += n;
		/* rw_sched_map: ordinals below the rail's quota stay (slot = ordinal); the rest are
		 * the rail's surplus, which fills the deficit rails' slots in rail order. */
		const rw_pair_plan_t *pp = &l->out_pairs[d];
		const uint32_t keep = pp->quota[r];
		uint32_t i = 0; /* the rank's records placed so far */
		if (base < keep) {
			uint32_t kept = RW_MIN(n, keep - base);
			e[r] = (rw_page_plan_entry_t){
				.first = 0, .count = kept,
				.offset = areas[r].send_off +
					  ((uint64_t)l->out_first[(size_t)d * R + r] + base) * ph->rec_size };
			i = kept;
		}
		uint32_t j = pp->surplus_prefix[r] + (base + i - keep); /* its global surplus index */
		for (uint32_t q = 0; q < R && i < n; q++) {
			if (j >= pp->deficit_prefix[q + 1] || j < pp->deficit_prefix[q])
				continue;
			uint32_t take = RW_MIN(n - i, pp->deficit_prefix[q + 1] - j);
			uint32_t slot = pp->count[q] + (j - pp->deficit_prefix[q]);
			e[q] = (rw_page_plan_entry_t){
				.first = i, .count = take,
				.offset = areas[q].send_off +
					  ((uint64_t)l->out_first[(size_t)d * R + q] + slot) * ph->rec_size };
			i += take;
			j += take;
		}
	}
}

rw_status_t rw_svc_rank_records_check(const rw_svc_phase_t *ph, uint32_t g, uint32_t n_tokens,
				      const uint32_t *tags, const rw_page_plan_entry_t *entry,
				      const uint8_t *const *slab, char *why)
{
	const uint32_t R = ph->rails, rank = ph->me * ph->gpus + g;
	for (uint32_t d = 0; d < ph->nodes; d++) {
		const rw_page_plan_entry_t *e = &entry[(size_t)d * R];
		uint32_t n = 0;
		for (uint32_t q = 0; q < R; q++)
			n += e[q].count;
		int64_t last = -1; /* records to d come in token order, one per token */
		for (uint32_t i = 0; i < n; i++) {
			uint32_t rail;
			uint64_t off;
			if (rw_page_plan_find(entry, R, d, i, (uint32_t)ph->rec_size, &rail, &off)) {
				snprintf(why, RW_SVC_WHY_MAX, "rank %u: its plan to node %u has a gap at "
					 "record %u", rank, d, i);
				return RW_ERR_INVAL;
			}
			const uint8_t *rec = slab[rail] + off;
			rw_wire_rec_hdr_t h;
			const char *bad = NULL;
			if (rw_wire_rec_unpack(rec, ph->topk, &h) != RW_OK)
				bad = "its top-k count is not the phase's";
			else if (h.tag != tags[d])
				bad = "its tag is not this phase's";
			else if (h.src_node != ph->me)
				bad = "it names another source node";
			else if (h.owner != g)
				bad = "it names another local rank as its owner";
			else if (h.token >= n_tokens)
				bad = "its token is past the rank's tokens";
			else if ((int64_t)h.token <= last)
				bad = "its token is out of order (each token once per node, ascending)";
			if (!bad) {
				int to_d = 0;
				for (uint32_t t = 0; t < ph->topk && !bad; t++) {
					int32_t id = rw_wire_rec_id(rec, t);
					if (id < -1 || (id >= 0 && (uint32_t)id >= ph->n_experts))
						bad = "a top-k id is out of range";
					else if (id >= 0 &&
						 rw_sched_expert_node(ph->n_experts, ph->nodes,
								      (uint32_t)id) == d)
						to_d = 1;
				}
				if (!bad && !to_d)
					bad = "none of its experts lives on the node it goes to";
			}
			if (bad) {
				snprintf(why, RW_SVC_WHY_MAX, "rank %u: record %u to node %u (rail %u, "
					 "byte %llu): %s", rank, i, d, rail, (unsigned long long)off,
					 bad);
				return RW_ERR_INVAL;
			}
			last = h.token;
		}
	}
	return RW_OK;
}
