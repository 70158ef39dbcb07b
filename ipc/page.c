/* The rank page's layout and the words' rules (contract in ipc/page.h, protocol in
 * docs/rankpath.md). Pure: no system call, no allocation. Compiled into both faces.
 *
 * Ordering pairs:
 *   P6 daemon (rw_page_fail) or rank CPU (rw_page_daemon_lost): store status, then store-release
 *      plan and arrived -> the rank's stream waits on the word; the kernels after the wait load
 *      the status. The store-release orders the status before the word for the GPU's reads too
 *      (a CPU's stores to host memory reach the GPU in order on x86 and with release on Arm). */
#include <stdio.h>

#include "ipc/page.h"
#include "ipc/railwave.h"

#define ALIGN_UP(x, a) (((x) + (a) - 1) / (a) * (a))

_Static_assert(sizeof(rw_page_params_t) == 48, "rank page ABI");
_Static_assert(sizeof(rw_page_plan_entry_t) == 16, "rank page ABI");
_Static_assert(sizeof(rw_page_plan_head_t) == 48, "rank page ABI");
_Static_assert(sizeof(rw_page_stage_t) == 16, "rank page ABI");
_Static_assert(sizeof(rw_page_plan_rail_t) == 32, "rank page ABI");
_Static_assert(sizeof(rw_page_list_head_t) == 24, "rank page ABI");
_Static_assert(sizeof(rw_page_list_entry_t) == 16, "rank page ABI");
_Static_assert(offsetof(rw_page_head_t, word) == RW_PAGE_LINE, "rank page ABI: words on line 1");
_Static_assert((RW_PAGE_DEPTH & (RW_PAGE_DEPTH - 1)) == 0, "depth is a power of two");

int rw_page_layout(uint32_t nodes, uint32_t rails, uint32_t gpus, uint32_t max_recv, size_t page,
		   rw_page_layout_t *l)
{
	if (nodes == 0 || rails == 0 || gpus == 0 || nodes > 65536 || rails > 64 ||
	    gpus > RW_PAGE_MAX_GPUS || max_recv > RW_PAGE_MAX_RECV || page == 0 ||
	    (page & (page - 1)) != 0)
		return -1;
	const uint64_t cells = (uint64_t)nodes * rails;
	uint64_t off = 0, slot;
	l->params = 0;
	off = ALIGN_UP(sizeof(rw_page_params_t), RW_PAGE_LINE);
	l->count_row = (uint32_t)off;
	off = ALIGN_UP(off + cells * sizeof(uint32_t), RW_PAGE_LINE);
	l->plan = (uint32_t)off;
	off = ALIGN_UP(off + sizeof(rw_page_plan_head_t), RW_PAGE_LINE);
	l->plan_stage = (uint32_t)off;
	off = ALIGN_UP(off + (uint64_t)gpus * sizeof(rw_page_stage_t), RW_PAGE_LINE);
	l->plan_rail = (uint32_t)off;
	off = ALIGN_UP(off + (uint64_t)rails * sizeof(rw_page_plan_rail_t), RW_PAGE_LINE);
	l->plan_tag = (uint32_t)off;
	off = ALIGN_UP(off + (uint64_t)nodes * sizeof(uint32_t), RW_PAGE_LINE);
	l->plan_entry = (uint32_t)off;
	off = ALIGN_UP(off + cells * sizeof(rw_page_plan_entry_t), RW_PAGE_LINE);
	l->list = (uint32_t)off;
	off = ALIGN_UP(off + sizeof(rw_page_list_head_t), RW_PAGE_LINE);
	l->list_entry = (uint32_t)off;
	off = ALIGN_UP(off + (uint64_t)max_recv * sizeof(rw_page_list_entry_t), RW_PAGE_LINE);
	l->term_off = (uint32_t)off;
	off = ALIGN_UP(off + ((uint64_t)max_recv + 1) * sizeof(uint32_t), RW_PAGE_LINE);
	l->term_ref = (uint32_t)off;
	off += (uint64_t)gpus * max_recv * sizeof(uint32_t);
	slot = ALIGN_UP(off, RW_PAGE_LINE);
	const uint64_t slot0 = RW_PAGE_SLOT0;
	const uint64_t bytes = ALIGN_UP(slot0 + slot * RW_PAGE_DEPTH, page);
	if (bytes > (UINT64_C(1) << 30))
		return -1;
	l->slot_bytes = (uint32_t)slot;
	l->slot0 = (uint32_t)slot0;
	l->bytes = bytes;
	return 0;
}

void rw_page_init(rw_page_head_t *pg, const rw_page_geom_t *geom, uint32_t rail,
		  const rw_page_layout_t *l)
{
	pg->magic = RW_PAGE_MAGIC;
	pg->version = RW_PAGE_VERSION;
	pg->depth = RW_PAGE_DEPTH;
	pg->nodes = geom->nodes;
	pg->rails = geom->rails;
	pg->gpus = geom->gpus;
	pg->rail = rail;
	pg->max_tokens = geom->max_tokens;
	pg->max_recv = geom->max_recv;
	pg->slot_bytes = l->slot_bytes;
	pg->bytes = l->bytes;
}

int rw_page_word_step(uint64_t seen, uint64_t now)
{
	if (now == seen)
		return RW_PAGE_SAME;
	return now - seen <= RW_PAGE_DEPTH ? RW_PAGE_NEXT : RW_PAGE_BAD;
}

/* Move a word forward to at least v (cyclically), never back; store-release (pair P6). */
static void raise_word(rw_page_line_t *w, uint64_t v)
{
	uint64_t cur = atomic_load_explicit(&w->v, memory_order_relaxed);
	if ((int64_t)(cur - v) < 0)
		atomic_store_explicit(&w->v, v, memory_order_release);
}

void rw_page_fail(rw_page_head_t *pg, uint64_t k, int32_t err)
{
	atomic_store_explicit(&pg->status[k & (RW_PAGE_DEPTH - 1)].v, (uint64_t)(uint32_t)err,
			      memory_order_relaxed);
	raise_word(&pg->word[RW_PW_PLAN], k);
	raise_word(&pg->word[RW_PW_ARRIVED], k);
}

void rw_page_daemon_lost(rw_page_head_t *pg, int32_t err)
{
	uint64_t top = 0;
	for (unsigned i = 0; i < RW_PW_COUNT; i++) {
		uint64_t v = atomic_load_explicit(&pg->word[i].v, memory_order_relaxed);
		if ((int64_t)(v - top) > 0)
			top = v;
	}
	for (unsigned d = 0; d < RW_PAGE_DEPTH; d++)
		atomic_store_explicit(&pg->status[d].v, (uint64_t)(uint32_t)err, memory_order_relaxed);
	raise_word(&pg->word[RW_PW_PLAN], top + RW_PAGE_OWED_AHEAD);
	raise_word(&pg->word[RW_PW_ARRIVED], top + RW_PAGE_OWED_AHEAD);
}

int rw_page_submit_check(const rw_page_geom_t *pg, const rw_page_params_t *params,
			 const uint32_t *row, uint64_t k, uint32_t native_rail, char *why,
			 size_t why_len)
{
	const rw_page_params_t *p = params;
	if (p->phase != k) {
		snprintf(why, why_len, "slot %llu holds phase %llu's parameters, submitted as phase "
			 "%llu", (unsigned long long)(k & (RW_PAGE_DEPTH - 1)),
			 (unsigned long long)p->phase, (unsigned long long)k);
		return -1;
	}
	if (p->kind != RW_KIND_DISPATCH && p->kind != RW_KIND_COMBINE) {
		snprintf(why, why_len, "unknown kind %u", p->kind);
		return -1;
	}
	if (p->abort && (p->kind != RW_KIND_COMBINE || p->abort >= RW_PAGE_ABORT_COUNT)) {
		snprintf(why, why_len, "abort %u on a %s (a combine's, 1..%u)", p->abort,
			 p->kind == RW_KIND_COMBINE ? "combine" : "dispatch", RW_PAGE_ABORT_COUNT - 1);
		return -1;
	}
	if (p->bad) {
		snprintf(why, why_len, "token %u has a top-k id outside [0, %u) (the count kernel "
			 "counted nothing for it)", p->bad - 1, p->n_experts);
		return -1;
	}
	/* a combine gives back the rows its dispatch received: max_recv bounds them */
	const uint32_t bound = p->kind == RW_KIND_COMBINE ? pg->max_recv : pg->max_tokens;
	if (p->token_count > bound) {
		snprintf(why, why_len, "%u %s, the page's bound is %u", p->token_count,
			 p->kind == RW_KIND_COMBINE ? "rows" : "tokens", bound);
		return -1;
	}
	const uint32_t per_token = p->topk < pg->nodes ? p->topk : pg->nodes;
	uint64_t sum = 0;
	for (uint32_t d = 0; d < pg->nodes; d++)
		for (uint32_t r = 0; r < pg->rails; r++) {
			uint32_t v = row[(size_t)d * pg->rails + r];
			if (v && (p->kind == RW_KIND_COMBINE || r != native_rail)) {
				snprintf(why, why_len, "count row entry (node %u, rail %u) is %u, "
					 "where the rank counts nothing (%s)", d, r, v,
					 p->kind == RW_KIND_COMBINE ? "a combine" : "not its rail");
				return -1;
			}
			if (v > p->token_count) {
				snprintf(why, why_len, "count row entry (node %u, rail %u) is %u, "
					 "above its %u tokens", d, r, v, p->token_count);
				return -1;
			}
			sum += v;
		}
	if (sum > (uint64_t)p->token_count * per_token) {
		snprintf(why, why_len, "the count row adds up to %llu records, above %u tokens x %u "
			 "nodes each", (unsigned long long)sum,
			 p->token_count, per_token);
		return -1;
	}
	return 0;
}

const char *rw_page_abort_str(unsigned reason)
{
	switch (reason) {
	case RW_PAGE_ABORT_ARGUMENT:
		return "its combine's arguments were refused on its host";
	case RW_PAGE_ABORT_ROUTING:
		return "its backward's routing is not its forward's";
	default:
		return "an unknown reason";
	}
}
