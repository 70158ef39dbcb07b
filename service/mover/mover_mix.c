/* A ring rank in a rank-path pair (docs/rankpath.md "Ring and page ranks in one group"): where a
 * node's ranks of one group mix the ring (host buffers, rw_client_submit) and the page, the rank
 * mover carries the whole pair and the daemon's CPU plays each ring rank's stream under the plan
 * block and lists a page rank's kernels get — its records packed where its plan entries say, its
 * rows forwarded from its list, its combine gather's returns and local copies written, its owner
 * sums made from its reduce list. It runs the kernels' own CPU versions (cuda/rank_cpu.c, what
 * host ranks run) on the argument blocks a page rank's kernels take, so every record and term
 * lands where the page ranks look for it and a token's sum has the same bits whatever kind of
 * rank each term came from. This file only fills the blocks from the phase and names a failure.
 * No allocation, no system call; the caller owns every buffer. A leaf of service/mover/. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"
#include "service/phase/phase.h"

/* The kernels read ipc/page.h's plan and list entries in place, in cuda/rank_abi.h's words. */
_Static_assert(sizeof(rw_page_plan_entry_t) == sizeof(rw_cuda_plan_entry_t) &&
	       offsetof(rw_page_plan_entry_t, first) == offsetof(rw_cuda_plan_entry_t, first) &&
	       offsetof(rw_page_plan_entry_t, count) == offsetof(rw_cuda_plan_entry_t, count) &&
	       offsetof(rw_page_plan_entry_t, offset) == offsetof(rw_cuda_plan_entry_t, offset),
	       "plan entry layouts");
_Static_assert(sizeof(rw_page_list_entry_t) == sizeof(rw_cuda_list_entry_t) &&
	       offsetof(rw_page_list_entry_t, slot) == offsetof(rw_cuda_list_entry_t, slot) &&
	       offsetof(rw_page_list_entry_t, rail) == offsetof(rw_cuda_list_entry_t, rail) &&
	       offsetof(rw_page_list_entry_t, area) == offsetof(rw_cuda_list_entry_t, area) &&
	       offsetof(rw_page_list_entry_t, node) == offsetof(rw_cuda_list_entry_t, node) &&
	       offsetof(rw_page_list_entry_t, token) == offsetof(rw_cuda_list_entry_t, token),
	       "list entry layouts");
_Static_assert(RW_MAX_RAILS <= RW_CUDA_RANK_RAILS && RW_MAX_GPUS <= RW_CUDA_RANK_GPUS &&
	       RW_MAX_TOPK <= 32 && (int)RW_PAGE_AREA_RECV == (int)RW_CUDA_AREA_RECV &&
	       (int)RW_PAGE_AREA_LOCAL == (int)RW_CUDA_AREA_LOCAL, "the kernels' bounds");

/* The daemon's CPU: one thread (the event loop's), any split. */
static const rw_cuda_cpu_par_t one_thread = { .threads = 1 };

static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }

static uint32_t cuda_dtype(const rw_svc_phase_t *ph)
{
	return ph->dtype == RW_WIRE_BF16 ? RW_CUDA_BF16 : RW_CUDA_FP32;
}

/* The step's error word as a sentence naming local rank g: RW_OK when it is clear. The lists
 * and plans are the daemon's own, so a code here is a plan that does not hold a rank's rows. */
static rw_status_t step_failed(const rw_svc_phase_t *ph, uint32_t g, const char *step,
			       const uint32_t err[2], char *why)
{
	const uint32_t rank = ph->me * ph->gpus + g, at = err[1] - 1;
	switch (err[0]) {
	case 0:
		return RW_OK;
	case RW_CUDA_RANK_E_ID:
		snprintf(why, RW_SVC_WHY_MAX, "local rank %u: its token %u names an expert outside "
			 "[0, %u)", rank, at, ph->n_experts);
		break;
	case RW_CUDA_RANK_E_PLAN: /* the pack's detail names a node, the gather's a row */
		if (!strcmp(step, "pack"))
			snprintf(why, RW_SVC_WHY_MAX, "local rank %u: a record of its to node %u has "
				 "no place in its plan", rank, at);
		else
			snprintf(why, RW_SVC_WHY_MAX, "local rank %u: row %u has no place in its "
				 "combine plan", rank, at);
		break;
	default: /* E_REF, E_RECORD */
		snprintf(why, RW_SVC_WHY_MAX, "local rank %u: its %s found entry %u of its list "
			 "naming no %s", rank, step, at,
			 err[0] == RW_CUDA_RANK_E_RECORD ? "record of this phase" : "place");
		break;
	}
	return RW_ERR_INVAL;
}

rw_status_t rw_svc_ring_pack(const rw_svc_phase_t *ph, uint32_t g, const uint32_t *tags,
			     const rw_page_plan_entry_t *entry, uint8_t *const *slab, uint32_t *next,
			     char *why)
{
	const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
	uint32_t err[2] = { 0, 0 };
	rw_cuda_rank_pack_t a = {
		.x = addr(io->tokens), .ids = addr(io->ids), .weights = addr(io->weights),
		.entry = addr(entry), .tags = addr(tags), .err = addr(err),
		.n_tokens = io->n_tokens, .topk = ph->topk, .hidden = ph->hidden,
		.dtype = cuda_dtype(ph), .n_experts = ph->n_experts, .nodes = ph->nodes,
		.rails = ph->rails, .me = ph->me, .owner = g, .rec_size = (uint32_t)ph->rec_size,
	};
	for (uint32_t r = 0; r < ph->rails; r++)
		a.slab[r] = addr(slab[r]);
	rw_cuda_cpu_pack(&a, next);
	return step_failed(ph, g, "pack", err, why);
}

rw_status_t rw_svc_ring_forward(const rw_svc_phase_t *ph, uint32_t g, const rw_svc_rank_lists_t *ls,
				uint8_t *rows, uint8_t *meta, uint32_t *counts, char *why)
{
	const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
	rw_svc_out_layout_t o;
	rw_svc_out_layout(io->out_cap, ph->n_experts, ph->topk, ph->row_bytes, RW_CQE_INLINE_COUNTS,
			  &o);
	if (ls->n[g] > o.rows_cap) {
		snprintf(why, RW_SVC_WHY_MAX, "local rank %u's dispatch output holds %llu rows; it "
			 "receives %u", ph->me * ph->gpus + g, (unsigned long long)o.rows_cap,
			 ls->n[g]);
		return RW_ERR_SUB_SPACE;
	}
	uint32_t err[2] = { 0, 0 }, recv_n = 0, overflow = 0;
	rw_cuda_rank_forward_t a = {
		.list = addr(ls->list[g]), .list_n = addr(&ls->n[g]), .rows = addr(rows),
		.meta = addr(meta), .counts = addr(counts), .recv_n = addr(&recv_n),
		.overflow = addr(&overflow), .err = addr(err), .cap = ls->n[g], .topk = ph->topk,
		.hidden = ph->hidden, .dtype = cuda_dtype(ph), .n_experts = ph->n_experts,
		.nodes = ph->nodes, .gpus = ph->gpus, .rails = ph->rails, .me = ph->me, .g = g,
		.rec_size = (uint32_t)ph->rec_size,
	};
	for (uint32_t r = 0; r < ph->rails; r++) {
		a.area[RW_CUDA_AREA_RECV][r] = addr(ls->recv[r]);
		a.area[RW_CUDA_AREA_LOCAL][r] = addr(ls->local[r]);
	}
	rw_cuda_cpu_forward(&a, one_thread);
	return step_failed(ph, g, "forward", err, why);
}

rw_status_t rw_svc_ring_gather(const rw_svc_phase_t *ph, uint32_t w, const rw_svc_rank_lists_t *ls,
			       const uint32_t *tags, const rw_page_plan_entry_t *entry,
			       uint8_t *const *slab, const uint8_t *const *staged, char *why)
{
	uint32_t err[2] = { 0, 0 };
	rw_cuda_rank_gather_t a = {
		.list = addr(ls->list[w]), .list_n = addr(&ls->n[w]), .entry = addr(entry),
		.tags = addr(tags), .term_off = addr(ls->term_off[w]),
		.terms = addr(ls->term_ref[w]), .err = addr(err), .cap = ls->n[w],
		.n_terms = ls->n_terms[w], .hidden = ph->hidden, .dtype = cuda_dtype(ph),
		.nodes = ph->nodes, .rails = ph->rails, .me = ph->me, .g = w,
		.crec_size = (uint32_t)ph->crec_size,
	};
	for (uint32_t r = 0; r < ph->rails; r++)
		a.slab[r] = addr(slab[r]);
	for (uint32_t h = 0; h < ph->gpus; h++)
		a.rows[h] = addr(staged[h]);
	rw_cuda_cpu_gather(&a, one_thread);
	return step_failed(ph, w, "gather", err, why);
}

rw_status_t rw_svc_ring_reduce(const rw_svc_phase_t *ph, uint32_t g, const rw_page_list_entry_t *list,
			       uint32_t n, const uint8_t *const *local, uint8_t *out, char *why)
{
	uint32_t err[2] = { 0, 0 };
	rw_cuda_rank_reduce_t a = {
		.list = addr(list), .list_n = addr(&n), .out = addr(out), .err = addr(err), .cap = n,
		.n_tokens = ph->io[RW_SVC_DISPATCH][g].n_tokens, .hidden = ph->hidden,
		.dtype = cuda_dtype(ph), .rails = ph->rails, .crec_size = (uint32_t)ph->crec_size,
	};
	for (uint32_t r = 0; r < ph->rails; r++) {
		a.area[RW_CUDA_AREA_RECV][r] = addr(ph->recv_area[RW_SVC_COMBINE][r]);
		a.area[RW_CUDA_AREA_LOCAL][r] = addr(local[r]);
	}
	rw_cuda_cpu_reduce(&a, one_thread);
	return step_failed(ph, g, "reduce", err, why);
}
