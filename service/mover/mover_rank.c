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
				       .row_off = (uint32_t)rw_wire_rec_row_off(ph->topk),
				       .n_stage = ph->gpus };
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

void rw_svc_rank_plan_combine(const rw_svc_phase_t *ph, uint32_t g, const uint32_t *local_n,
			       const rw_page_plan_rail_t *areas, uint64_t k,
			       rw_page_plan_head_t *head, uint32_t *tags, rw_page_plan_entry_t *entry)
{
	const uint32_t R = ph->rails;
	const rw_svc_layout_t *l = ph->layout;
	*head = (rw_page_plan_head_t){ .phase = k, .kind = 1, .me = ph->me, .owner = g,
				       .topk = ph->topk, .rec_size = (uint32_t)ph->crec_size,
				       .row_off = RW_WIRE_CREC_HDR, .n_stage = ph->gpus };
	for (uint32_t s = 0; s < ph->nodes; s++) {
		tags[s] = s == ph->me ? ph->tag_in : ph->tag_to[s];
		for (uint32_t r = 0; r < R; r++) {
			const size_t i = (size_t)s * R + r;
			if (s == ph->me) /* rank g's copy of rail r's local records */
				entry[i] = (rw_page_plan_entry_t){
					.first = 0, .count = local_n[r],
					.offset = areas[r].local_off +
						  (uint64_t)g * local_n[r] * ph->crec_size };
			else /* the return area is laid out as the receive area: slot for slot */
				entry[i] = (rw_page_plan_entry_t){
					.first = l->in_first[i], .count = l->in_quota[i],
					.offset = areas[r].send_off +
						  (uint64_t)l->in_first[i] * ph->crec_size };
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

/* Entry j of rank g's list: the record at (area, rail, slot). */
static rw_status_t list_put(rw_svc_rank_lists_t *ls, uint32_t g, uint32_t area, uint32_t rail,
			    uint32_t slot, uint32_t node, uint32_t token, uint32_t *j_p, char *why)
{
	if (ls->n[g] >= ls->max_recv) {
		snprintf(why, RW_SVC_WHY_MAX, "local rank %u receives more than its %u records (its "
			 "max_recv)", g, ls->max_recv);
		return RW_ERR_SUB_SPACE;
	}
	uint32_t j = ls->n[g]++;
	ls->list[g][j] = (rw_page_list_entry_t){ .slot = slot, .rail = (uint16_t)rail,
						 .area = (uint16_t)area, .node = node,
						 .token = token };
	ls->term_off[g][j] = ls->n_terms[g];
	*j_p = j;
	return RW_OK;
}

/* The record at rec (area, rail, slot) goes to the local ranks hosting its experts. `writer`:
 * the lowest of them gets the combine terms (every one's row, by rank), the others none; a
 * local record's rank writes its own row alone. */
static rw_status_t list_record(const rw_svc_phase_t *ph, rw_svc_rank_lists_t *ls,
			       const uint8_t *rec, uint32_t area, uint32_t rail, uint32_t slot,
			       uint32_t node, char *why)
{
	rw_wire_rec_hdr_t h;
	if (rw_wire_rec_unpack(rec, ph->topk, &h) != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "record at rail %u slot %u of the %s area: bad header",
			 rail, slot, area == RW_PAGE_AREA_RECV ? "receive" : "local");
		return RW_ERR_PROTO;
	}
	uint32_t mask = rw_svc_fwd_mask_rec(ph->n_experts, ph->nodes, ph->gpus, ph->me, rec,
					    ph->topk);
	uint32_t j[RW_MAX_GPUS];
	for (uint32_t g = 0; g < ph->gpus; g++) {
		if (!(mask & (1u << g)))
			continue;
		rw_status_t st = list_put(ls, g, area, rail, slot, node, h.token, &j[g], why);
		if (st != RW_OK)
			return st;
		if (area == RW_PAGE_AREA_LOCAL)
			ls->term_ref[g][ls->n_terms[g]++] = RW_PAGE_TERM(g, j[g]);
	}
	if (area == RW_PAGE_AREA_RECV && mask) {
		uint32_t w = (uint32_t)__builtin_ctz(mask);
		for (uint32_t g = w; g < ph->gpus; g++)
			if (mask & (1u << g))
				ls->term_ref[w][ls->n_terms[w]++] = RW_PAGE_TERM(g, j[g]);
	}
	return RW_OK;
}

rw_status_t rw_svc_rank_fwd_lists(const rw_svc_phase_t *ph, rw_svc_rank_lists_t *ls, char *why)
{
	const uint32_t R = ph->rails;
	const rw_svc_layout_t *l = ph->layout;
	for (uint32_t g = 0; g < ph->gpus; g++)
		ls->n[g] = ls->n_terms[g] = 0;
	for (uint32_t r = 0; r < R; r++) /* the receive area: by rail, then slot (sources in order) */
		for (uint32_t s = 0; s < ph->nodes; s++)
			for (uint32_t k = 0; k < l->in_quota[(size_t)s * R + r]; k++) {
				uint32_t p = l->in_first[(size_t)s * R + r] + k;
				rw_status_t st = list_record(ph, ls, ls->recv[r] + (uint64_t)p * ph->rec_size,
							     RW_PAGE_AREA_RECV, r, p, s, why);
				if (st != RW_OK)
					return st;
			}
	for (uint32_t g = 0; g < ph->gpus; g++)
		ls->n_recv[g] = ls->n[g];
	for (uint32_t r = 0; r < R; r++)
		for (uint32_t p = 0; p < ls->local_n[r]; p++) {
			rw_status_t st = list_record(ph, ls, ls->local[r] + (uint64_t)p * ph->rec_size,
						     RW_PAGE_AREA_LOCAL, r, p, ph->me, why);
			if (st != RW_OK)
				return st;
		}
	for (uint32_t g = 0; g < ph->gpus; g++)
		ls->term_off[g][ls->n[g]] = ls->n_terms[g];
	return RW_OK;
}

/* One term of owner g's reduce list, placed at its token's cursor (pass 2) or counted (pass 1). */
static rw_status_t reduce_term(uint32_t *cursor, uint32_t n_tokens, rw_page_list_entry_t *out,
			       int place, rw_page_list_entry_t e, char *why)
{
	if (e.token >= n_tokens) {
		snprintf(why, RW_SVC_WHY_MAX, "a combine term names token %u of %u", e.token, n_tokens);
		return RW_ERR_INVAL;
	}
	if (place)
		out[cursor[e.token]++] = e;
	else
		cursor[e.token + 1]++;
	return RW_OK;
}

rw_status_t rw_svc_rank_reduce_list(const rw_svc_phase_t *ph, const rw_svc_rank_lists_t *ls,
				    const uint8_t *const *sent, uint32_t g, uint32_t n_tokens,
				    uint32_t *cursor, rw_page_list_entry_t *out, uint32_t max,
				    uint32_t *n_p, char *why)
{
	const uint32_t R = ph->rails;
	const rw_svc_layout_t *l = ph->layout;
	memset(cursor, 0, ((size_t)n_tokens + 1) * sizeof(*cursor));
	for (int place = 0; place < 2; place++) {
		if (place) {
			for (uint32_t t = 0; t < n_tokens; t++) /* counts -> first index per token */
				cursor[t + 1] += cursor[t];
			if (cursor[n_tokens] > max) {
				snprintf(why, RW_SVC_WHY_MAX, "local rank %u's tokens have %u combine "
					 "terms, above its %u (max_recv)", g, cursor[n_tokens], max);
				return RW_ERR_SUB_SPACE;
			}
			*n_p = cursor[n_tokens];
		}
		/* this node's ranks' rows of g's local records, by rank */
		for (uint32_t h = 0; h < ph->gpus; h++)
			for (uint32_t j = ls->n_recv[h]; j < ls->n[h]; j++) {
				const rw_page_list_entry_t *e = &ls->list[h][j];
				const uint8_t *rec = ls->local[e->rail] + (uint64_t)e->slot * ph->rec_size;
				if (rw_wire_get16(rec + 6) != g)
					continue;
				/* rank h's copy of rail e->rail's local records (ipc/page.h) */
				rw_page_list_entry_t t = { .slot = h * ls->local_n[e->rail] + e->slot,
							   .rail = e->rail, .area = RW_PAGE_AREA_LOCAL,
							   .node = ph->me, .token = e->token };
				rw_status_t st = reduce_term(cursor, n_tokens, out, place, t, why);
				if (st != RW_OK)
					return st;
			}
		/* then the rows that come back, by source node: each where its record left */
		for (uint32_t d = 0; d < ph->nodes; d++) {
			if (d == ph->me)
				continue;
			for (uint32_t e = 0; e < R; e++) {
				uint32_t first = l->out_first[(size_t)d * R + e];
				for (uint32_t k = 0; k < l->out_pairs[d].quota[e]; k++) {
					const uint8_t *rec = sent[e] + ((uint64_t)first + k) * ph->rec_size;
					if (rw_wire_get16(rec + 6) != g)
						continue;
					rw_page_list_entry_t t = { .slot = first + k, .rail = (uint16_t)e,
								   .area = RW_PAGE_AREA_RECV, .node = d,
								   .token = rw_wire_get32(rec + 8) };
					rw_status_t st = reduce_term(cursor, n_tokens, out, place, t,
								     why);
					if (st != RW_OK)
						return st;
				}
			}
		}
	}
	return RW_OK;
}

rw_status_t rw_svc_rank_crecords_check(const rw_svc_phase_t *ph, const rw_svc_rank_lists_t *ls,
				       const uint8_t *const *ret, char *why)
{
	const uint32_t R = ph->rails;
	const rw_svc_layout_t *l = ph->layout;
	for (uint32_t g = 0; g < ph->gpus; g++)
		for (uint32_t j = 0; j < ls->n_recv[g]; j++) {
			if (ls->term_off[g][j] == ls->term_off[g][j + 1])
				continue; /* another rank writes this one */
			const rw_page_list_entry_t *e = &ls->list[g][j];
			const uint32_t first = l->in_first[(size_t)e->node * R + e->rail];
			rw_wire_crec_hdr_t h;
			rw_wire_crec_unpack(ret[e->rail] + (uint64_t)e->slot * ph->crec_size, &h);
			if (h.tag != ph->tag_to[e->node] || h.src_node != ph->me || h.rail != e->rail ||
			    h.slot != e->slot - first) {
				snprintf(why, RW_SVC_WHY_MAX, "rank %u: its combine record for node %u "
					 "(rail %u, slot %u) has a wrong header", ph->me * ph->gpus + g,
					 e->node, e->rail, e->slot - first);
				return RW_ERR_INVAL;
			}
		}
	return RW_OK;
}
