/* cuda/rank_cpu.c: the rank kernels (cuda/rank_kernels.cu) on the CPU, one implementation for
 * every CPU that plays a rank's stream: host ranks (rank/host.c), the daemon playing a ring rank
 * of a rank-path pair (service/mover/mover_mix.c), and the CUDA stand-in driver
 * (tests/integration/fake_cuda_rank.c). Each does exactly what cuda/rw_cuda.h "rank kernels"
 * states and the kernel does, on the same argument blocks (cuda/rank_abi.h) with every address a
 * plain pointer of this process: the pack numbers a rank's records to each node with a running
 * count in token order (what the GPU's prefix count computes), the sums add in fp32 in list
 * order and round once (bf16 to nearest even, NaN kept quiet: common/rows.c). The bytes written
 * are the host mover's. No allocation: the caller owns every buffer.
 *
 * Threads: pack rows, forward, gather and reduce split their items (tokens or list entries) into
 * contiguous ranges, one per thread, when the rows are big enough to pay for a thread; each item
 * writes bytes no other item writes, so the result is the same bytes for any thread count. The
 * numbering (pack index) and the per-expert counts stay on the calling thread: they are small. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "common/bf16.h"
#include "common/wire_rec.h"
#include "cuda/rw_cuda.h"

static void *at(uint64_t addr) { return (void *)(uintptr_t)addr; }

/* The device error word: the first failing item's code wins (compare-and-swap from 0), with
 * that item's detail; concurrent items may race for it as GPU threads do. */
static void set_err(uint64_t err, uint32_t code, uint32_t detail)
{
	_Atomic uint32_t *e = at(err);
	uint32_t zero = 0;
	if (atomic_compare_exchange_strong_explicit(&e[0], &zero, code, memory_order_relaxed,
						    memory_order_relaxed))
		atomic_store_explicit(&e[1], detail, memory_order_relaxed);
}

static int failed(uint64_t status)
{
	int32_t v = 0;
	if (status)
		memcpy(&v, at(status), 4);
	return v != 0;
}

static uint32_t dtype_size(uint32_t dtype) { return dtype == RW_CUDA_BF16 ? 2 : 4; }

uint32_t rw_cuda_cpu_rec_size(uint32_t topk, uint32_t hidden, uint32_t dtype)
{
	return (uint32_t)(rw_wire_rec_row_off(topk) +
			  rw_wire_align16((uint64_t)hidden * dtype_size(dtype)));
}

uint32_t rw_cuda_cpu_crec_size(uint32_t hidden, uint32_t dtype)
{
	return RW_WIRE_CREC_HDR + (uint32_t)rw_wire_align16((uint64_t)hidden * dtype_size(dtype));
}

/* ---- items split over threads ------------------------------------------------------------ */

typedef void (*range_fn)(const void *ctx, uint32_t lo, uint32_t hi);

typedef struct par_part {
	range_fn fn;
	const void *ctx;
	uint32_t lo, hi;
} par_part_t;

static void *par_main(void *arg)
{
	const par_part_t *p = arg;
	p->fn(p->ctx, p->lo, p->hi);
	return NULL;
}

/* fn over [0, n) in up to par.threads contiguous ranges, the first on this thread; fewer when
 * a range would move under par.min_bytes (items of item_bytes each); a range whose thread cannot
 * start runs here. With par.blocks: that grid's blocks on this thread (cuda/rw_cuda.h). */
static void par_for(rw_cuda_cpu_par_t par, uint32_t n, uint64_t item_bytes, range_fn fn,
		    const void *ctx)
{
	if (par.blocks) { /* a grid's blocks in turn, each its grid-stride items */
		for (uint32_t b = 0; b < par.blocks; b++)
			for (uint64_t i = b; i < n; i += par.blocks)
				fn(ctx, (uint32_t)i, (uint32_t)i + 1);
		return;
	}
	uint64_t by_size = par.min_bytes ? (uint64_t)n * item_bytes / par.min_bytes : n;
	uint32_t t = par.threads < RW_CUDA_CPU_THREADS_MAX ? par.threads : RW_CUDA_CPU_THREADS_MAX;
	if (by_size < t)
		t = (uint32_t)by_size;
	if (t > n)
		t = n;
	if (t <= 1) {
		fn(ctx, 0, n);
		return;
	}
	par_part_t part[RW_CUDA_CPU_THREADS_MAX];
	pthread_t tid[RW_CUDA_CPU_THREADS_MAX];
	int started[RW_CUDA_CPU_THREADS_MAX] = { 0 };
	for (uint32_t i = 0; i < t; i++)
		part[i] = (par_part_t){ fn, ctx, (uint32_t)((uint64_t)n * i / t),
					(uint32_t)((uint64_t)n * (i + 1) / t) };
	for (uint32_t i = 1; i < t; i++)
		started[i] = pthread_create(&tid[i], NULL, par_main, &part[i]) == 0;
	fn(ctx, part[0].lo, part[0].hi);
	for (uint32_t i = 1; i < t; i++) {
		if (started[i])
			pthread_join(tid[i], NULL);
		else /* no thread: its range here */
			fn(ctx, part[i].lo, part[i].hi);
	}
}

/* ---- count and pack ------------------------------------------------------------------------ */

/* The distinct destination nodes of the token whose top-k ids start at ids[0] (int32) or
 * ids64[0] (int64), in id order, into dest; -1 when an id other than -1 is outside
 * [0, n_experts) (the token then counts and sends nothing). */
static int token_nodes(const int32_t *ids, const int64_t *ids64, uint32_t topk,
		       uint32_t n_experts, uint32_t per_node, uint32_t *dest)
{
	int n = 0;
	for (uint32_t k = 0; k < topk; k++) {
		int64_t e = ids64 ? ids64[k] : ids[k];
		if (e == -1)
			continue;
		if (e < 0 || e >= (int64_t)n_experts)
			return -1;
		uint32_t d = (uint32_t)e / per_node;
		int u = 0;
		while (u < n && dest[u] != d)
			u++;
		if (u == n)
			dest[n++] = d;
	}
	return n;
}

void rw_cuda_cpu_count(const int32_t *ids, uint32_t n_tokens, uint32_t topk, uint32_t n_experts,
			uint32_t nodes, uint32_t rails, uint32_t rail, uint32_t *row, uint32_t *bad)
{
	for (uint32_t t = 0; t < n_tokens; t++) {
		uint32_t dest[32];
		int n = token_nodes(ids + (uint64_t)t * topk, NULL, topk, n_experts, n_experts / nodes,
				    dest);
		if (n < 0)
			*bad = t + 1;
		for (int u = 0; u < n; u++)
			row[dest[u] * rails + rail]++;
	}
}

static int64_t id_at(const rw_cuda_rank_pack_t *a, uint64_t i)
{
	if (a->ids_int64)
		return ((const int64_t *)at(a->ids))[i];
	return ((const int32_t *)at(a->ids))[i];
}

/* A scratch entry: where the record of (token, its u-th node) goes, 0 for none. */
typedef struct pack_slot {
	uint64_t addr;
	uint32_t dest, pad;
} pack_slot_t;
_Static_assert(sizeof(pack_slot_t) == RW_CUDA_RANK_PACK_SLOT, "pack scratch entry");

/* Token t's slots (topk of them, in its nodes' order, then empty ones), numbered on from next[]
 * (records to each node so far). */
static void token_slots(const rw_cuda_rank_pack_t *a, uint32_t t, uint32_t *next,
			pack_slot_t *slots)
{
	const rw_cuda_plan_entry_t *entry = at(a->entry);
	uint32_t dest[32];
	const uint64_t first = (uint64_t)t * a->topk;
	int n = a->ids_int64 ? token_nodes(NULL, (const int64_t *)at(a->ids) + first, a->topk,
					   a->n_experts, a->n_experts / a->nodes, dest)
			     : token_nodes((const int32_t *)at(a->ids) + first, NULL, a->topk,
					   a->n_experts, a->n_experts / a->nodes, dest);
	if (n < 0) {
		set_err(a->err, RW_CUDA_RANK_E_ID, t + 1);
		n = 0;
	}
	for (uint32_t u = 0; u < a->topk; u++) {
		pack_slot_t s = { 0, 0, 0 };
		if ((int)u < n) {
			uint32_t d = dest[u], i = next[d]++;
			const rw_cuda_plan_entry_t *pe = entry + (uint64_t)d * a->rails;
			s.dest = d;
			for (uint32_t r = 0; r < a->rails; r++)
				if (i - pe[r].first < pe[r].count) {
					s.addr = a->slab[r] + pe[r].offset +
						 (uint64_t)(i - pe[r].first) * a->rec_size;
					break;
				}
			if (!s.addr)
				set_err(a->err, RW_CUDA_RANK_E_PLAN, d + 1);
		}
		slots[u] = s;
	}
}

/* Token t's record at slot s: header, top-k block, row, padding zeroed. */
static void record_write(const rw_cuda_rank_pack_t *a, uint32_t t, pack_slot_t s)
{
	const uint32_t row_bytes = a->hidden * dtype_size(a->dtype);
	const uint64_t row_off = rw_wire_rec_row_off(a->topk);
	const uint32_t *tags = at(a->tags);
	uint8_t *rec = at(s.addr);
	const uint32_t w[4] = { tags[s.dest], (a->me & 0xffffu) | a->owner << 16, t,
				a->topk & 0xffffu };
	memcpy(rec, w, 16);
	for (uint32_t k = 0; k < a->topk; k++) {
		int32_t id = (int32_t)id_at(a, (uint64_t)t * a->topk + k);
		memcpy(rec + RW_WIRE_REC_HDR + 4 * k, &id, 4);
	}
	memcpy(rec + RW_WIRE_REC_HDR + 4 * a->topk,
	       (const float *)at(a->weights) + (uint64_t)t * a->topk, 4ull * a->topk);
	/* the padding between the top-k block and the row, and after the row */
	memset(rec + RW_WIRE_REC_HDR + 8 * a->topk, 0, row_off - RW_WIRE_REC_HDR - 8 * a->topk);
	memcpy(rec + row_off, (const uint8_t *)at(a->x) + (uint64_t)t * row_bytes, row_bytes);
	memset(rec + row_off + row_bytes, 0, a->rec_size - row_off - row_bytes);
}

void rw_cuda_cpu_pack(const rw_cuda_rank_pack_t *a, uint32_t *next)
{
	if (failed(a->status) || a->n_tokens == 0)
		return;
	memset(next, 0, a->nodes * sizeof(*next));
	pack_slot_t slots[32];
	for (uint32_t t = 0; t < a->n_tokens; t++) {
		token_slots(a, t, next, slots);
		for (uint32_t u = 0; u < a->topk; u++)
			if (slots[u].addr)
				record_write(a, t, slots[u]);
	}
}

void rw_cuda_cpu_pack_index(const rw_cuda_rank_pack_t *a, uint32_t *next)
{
	pack_slot_t *scratch = at(a->scratch);
	if (failed(a->status) || a->n_tokens == 0)
		return;
	memset(next, 0, a->nodes * sizeof(*next));
	for (uint32_t t = 0; t < a->n_tokens; t++)
		token_slots(a, t, next, scratch + (uint64_t)t * a->topk);
}

static void pack_rows_range(const void *ctx, uint32_t lo, uint32_t hi)
{
	const rw_cuda_rank_pack_t *a = ctx;
	const pack_slot_t *scratch = at(a->scratch);
	for (uint32_t t = lo; t < hi; t++)
		for (uint32_t u = 0; u < a->topk; u++) {
			const pack_slot_t s = scratch[(uint64_t)t * a->topk + u];
			if (s.addr)
				record_write(a, t, s);
		}
}

void rw_cuda_cpu_pack_rows(const rw_cuda_rank_pack_t *a, rw_cuda_cpu_par_t par)
{
	if (failed(a->status))
		return;
	par_for(par, a->n_tokens, (uint64_t)a->hidden * dtype_size(a->dtype) * a->topk,
		pack_rows_range, a);
}

/* ---- forward ------------------------------------------------------------------------------- */

static uint64_t list_addr(const uint64_t area[RW_CUDA_AREAS][RW_CUDA_RANK_RAILS], uint32_t rails,
			  const rw_cuda_list_entry_t *le, uint32_t size)
{
	if (le->area >= RW_CUDA_AREAS || le->rail >= rails || !area[le->area][le->rail])
		return 0;
	return area[le->area][le->rail] + (uint64_t)le->slot * size;
}

/* Entry i's record, or NULL (E_REF or E_RECORD set) when the row is left as it was. */
static const uint8_t *fwd_record(const rw_cuda_rank_forward_t *a, uint32_t i)
{
	const rw_cuda_list_entry_t *list = at(a->list);
	uint64_t addr = list_addr(a->area, a->rails, &list[i], a->rec_size);
	if (!addr) {
		set_err(a->err, RW_CUDA_RANK_E_REF, i + 1);
		return NULL;
	}
	const uint8_t *rec = at(addr);
	uint16_t owner, topk;
	memcpy(&owner, rec + RW_WIRE_REC_OWNER, 2);
	memcpy(&topk, rec + RW_WIRE_REC_TOPK, 2);
	if (topk != a->topk || owner >= a->gpus) {
		set_err(a->err, RW_CUDA_RANK_E_RECORD, i + 1);
		return NULL;
	}
	return rec;
}

static void forward_range(const void *ctx, uint32_t lo, uint32_t hi)
{
	const rw_cuda_rank_forward_t *a = ctx;
	const uint32_t row_bytes = a->hidden * dtype_size(a->dtype);
	const uint32_t meta_bytes = 16 + 8 * a->topk;
	const uint64_t row_off = rw_wire_rec_row_off(a->topk);
	for (uint32_t i = lo; i < hi; i++) {
		const uint8_t *rec = fwd_record(a, i);
		if (!rec)
			continue;
		uint16_t src, owner;
		memcpy(&src, rec + RW_WIRE_REC_SRC, 2);
		memcpy(&owner, rec + RW_WIRE_REC_OWNER, 2);
		uint8_t *meta = (uint8_t *)at(a->meta) + (uint64_t)i * meta_bytes;
		uint32_t head[4] = { src, (uint32_t)src * a->gpus + owner, 0, 0 };
		memcpy(&head[2], rec + RW_WIRE_REC_TOKEN, 4);
		memcpy(meta, head, 16);
		memcpy(meta + 16, rec + RW_WIRE_REC_HDR, 8ull * a->topk);
		memcpy((uint8_t *)at(a->rows) + (uint64_t)i * row_bytes, rec + row_off, row_bytes);
	}
}

void rw_cuda_cpu_forward(const rw_cuda_rank_forward_t *a, rw_cuda_cpu_par_t par)
{
	uint32_t listed = 0;
	if (!failed(a->status))
		memcpy(&listed, at(a->list_n), 4);
	const uint32_t n = listed < a->cap ? listed : a->cap, over = listed - n;
	const uint32_t per_rank = a->n_experts / (a->nodes * a->gpus);
	const uint32_t mine = (a->me * a->gpus + a->g) * per_rank;
	uint32_t *counts = at(a->counts);
	memcpy(at(a->recv_n), &n, 4);
	memcpy(at(a->overflow), &over, 4);
	memset(counts, 0, 4ull * a->n_experts);
	par_for(par, n, (uint64_t)a->hidden * dtype_size(a->dtype), forward_range, a);
	for (uint32_t i = 0; i < n; i++) { /* the counts of the rows written (checks repeated) */
		const rw_cuda_list_entry_t *le = (const rw_cuda_list_entry_t *)at(a->list) + i;
		uint64_t addr = list_addr(a->area, a->rails, le, a->rec_size);
		if (!addr)
			continue;
		const uint8_t *rec = at(addr);
		uint16_t owner, topk;
		memcpy(&owner, rec + RW_WIRE_REC_OWNER, 2);
		memcpy(&topk, rec + RW_WIRE_REC_TOPK, 2);
		if (topk != a->topk || owner >= a->gpus)
			continue;
		for (uint32_t k = 0; k < a->topk; k++) {
			int32_t e;
			memcpy(&e, rec + RW_WIRE_REC_HDR + 4 * k, 4);
			if (e >= 0 && (uint32_t)e - mine < per_rank)
				counts[e]++;
		}
	}
}

/* A gather's or reduce's list length: what list_n says, at most cap (more: E_REF). */
static uint32_t list_count(uint64_t list_n, uint32_t cap, uint64_t err)
{
	uint32_t listed;
	memcpy(&listed, at(list_n), 4);
	if (listed <= cap)
		return listed;
	set_err(err, RW_CUDA_RANK_E_REF, cap + 1);
	return cap;
}

/* ---- gather -------------------------------------------------------------------------------- */

static void gather_range(const void *ctx, uint32_t lo, uint32_t hi)
{
	const rw_cuda_rank_gather_t *a = ctx;
	const rw_cuda_list_entry_t *list = at(a->list);
	const rw_cuda_plan_entry_t *entry = at(a->entry);
	const uint32_t *toff = at(a->term_off), *terms = at(a->terms);
	const uint32_t row_bytes = a->hidden * dtype_size(a->dtype);
	const void *rows[RW_CUDA_RANK_TERMS_MAX];
	const rw_cuda_page_stage_t *stage = at(a->stage); /* static mode: the dispatch plan's
							    * staging table, read now */
	for (uint32_t j = lo; j < hi; j++) {
		const rw_cuda_list_entry_t *le = &list[j];
		uint32_t j0 = toff ? toff[j] : 0, j1 = toff ? toff[j + 1] : 1;
		if (toff && (j1 < j0 || j1 > a->n_terms || j1 - j0 > RW_CUDA_RANK_TERMS_MAX)) {
			set_err(a->err, RW_CUDA_RANK_E_REF, j + 1);
			continue;
		}
		if (j1 == j0)
			continue;
		/* The return range of (node, rail) holds the slot (slots count per rail). */
		const rw_cuda_plan_entry_t *pe = NULL;
		if (le->node < a->nodes && le->rail < a->rails) {
			pe = entry + (uint64_t)le->node * a->rails + le->rail;
			if (le->slot - pe->first >= pe->count)
				pe = NULL;
		}
		if (!pe) {
			set_err(a->err, RW_CUDA_RANK_E_PLAN, j + 1);
			continue;
		}
		int bad = 0;
		for (uint32_t k = j0; k < j1; k++) {
			uint64_t addr = 0;
			if (!toff) {
				addr = a->rows[a->g] + (uint64_t)j * row_bytes;
			} else {
				const uint32_t g = terms[k] >> 24;
				const uint64_t base = stage ? rw_cuda_rank_stage_rows(stage, a->stage_gpus,
										      a->slab, a->rails, g)
							    : g < RW_CUDA_RANK_GPUS ? a->rows[g] : 0;
				if (base)
					addr = base + (uint64_t)(terms[k] & 0xffffffu) * row_bytes;
			}
			rows[k - j0] = at(addr);
			bad |= !addr;
		}
		if (bad) {
			set_err(a->err, RW_CUDA_RANK_E_REF, j + 1);
			continue;
		}
		uint8_t *rec = at(a->slab[le->rail] + pe->offset +
				  (uint64_t)(le->slot - pe->first) * a->crec_size);
		const uint32_t w[4] = { ((const uint32_t *)at(a->tags))[le->node],
					(a->me & 0xffffu) | (uint32_t)le->rail << 16,
					le->slot - pe->first, 0 };
		memcpy(rec, w, 16);
		rw_rows_sum(rec + RW_WIRE_CREC_HDR, a->dtype == RW_CUDA_BF16, rows, j1 - j0, a->hidden,
			    0);
		memset(rec + RW_WIRE_CREC_HDR + row_bytes, 0, a->crec_size - RW_WIRE_CREC_HDR - row_bytes);
	}
}

void rw_cuda_cpu_gather(const rw_cuda_rank_gather_t *a, rw_cuda_cpu_par_t par)
{
	if (failed(a->status))
		return;
	const uint32_t n = list_count(a->list_n, a->cap, a->err);
	par_for(par, n, (uint64_t)a->hidden * dtype_size(a->dtype), gather_range, a);
}

/* ---- reduce -------------------------------------------------------------------------------- */

/* As rank_kernels.cu's reduce_addr: a LOCAL entry in the combine plan's local area when named. */
static uint64_t reduce_addr(const rw_cuda_rank_reduce_t *a, const rw_cuda_list_entry_t *le)
{
	if (!a->plan_rail)
		return list_addr(a->area, a->rails, le, a->crec_size);
	if (le->area >= RW_CUDA_AREAS || le->rail >= a->rails)
		return 0;
	const rw_cuda_plan_rail_t *pr = (const rw_cuda_plan_rail_t *)at(a->plan_rail) + le->rail;
	return a->slab[le->rail] + (le->area == RW_CUDA_AREA_LOCAL ? pr->local_off : pr->recv_off) +
	       (uint64_t)le->slot * a->crec_size;
}

typedef struct reduce_ctx {
	const rw_cuda_rank_reduce_t *a;
	uint32_t n; /* list entries */
} reduce_ctx_t;

/* The terms of one token: entries first .. first + n - 1 of the list, every address checked. */
typedef struct reduce_terms {
	const rw_cuda_rank_reduce_t *a;
	const rw_cuda_list_entry_t *first;
} reduce_terms_t;

static const void *reduce_term(const void *ctx, uint32_t k)
{
	const reduce_terms_t *rt = ctx;
	return at(reduce_addr(rt->a, &rt->first[k]) + RW_WIRE_CREC_HDR);
}

/* Tokens lo .. hi - 1: each one's entries start at the first entry whose token is >= it (the
 * list is in token order here, or one range covers every token). */
static void reduce_range(const void *ctx, uint32_t lo, uint32_t hi)
{
	const reduce_ctx_t *c = ctx;
	const rw_cuda_rank_reduce_t *a = c->a;
	const rw_cuda_list_entry_t *list = at(a->list);
	const uint32_t row_bytes = a->hidden * dtype_size(a->dtype), n = c->n;
	uint32_t i = 0, top = n;
	while (i < top) { /* lower bound of token lo */
		uint32_t mid = i + (top - i) / 2;
		if (list[mid].token < lo)
			i = mid + 1;
		else
			top = mid;
	}
	for (uint32_t t = lo; t < hi; t++) {
		while (i < n && list[i].token < t) /* (out of order: skipped, E_REF set) */
			i++;
		uint32_t end = i;
		while (end < n && list[end].token == t)
			end++;
		int bad = 0;
		for (uint32_t e = i; e < end; e++)
			bad |= !reduce_addr(a, &list[e]);
		const reduce_terms_t rt = { a, list + i };
		const uint32_t cnt = end - i;
		i = end;
		if (bad) {
			set_err(a->err, RW_CUDA_RANK_E_REF, end);
			continue;
		}
		rw_rows_sum_by((uint8_t *)at(a->out) + (uint64_t)t * row_bytes,
			       a->dtype == RW_CUDA_BF16, reduce_term, &rt, cnt, a->hidden, 1);
	}
}

void rw_cuda_cpu_reduce(const rw_cuda_rank_reduce_t *a, rw_cuda_cpu_par_t par)
{
	if (failed(a->status) || a->n_tokens == 0)
		return;
	const uint32_t n = list_count(a->list_n, a->cap, a->err);
	const rw_cuda_list_entry_t *list = at(a->list);
	int sorted = 1;
	for (uint32_t i = 0; i < n; i++)
		if (list[i].token >= a->n_tokens || (i + 1 < n && list[i + 1].token < list[i].token)) {
			set_err(a->err, RW_CUDA_RANK_E_REF, i + 1);
			sorted = 0;
		}
	const reduce_ctx_t c = { a, n };
	/* Unsorted (E_REF set, the sums are not the list's): one range, as one GPU thread skips. */
	const rw_cuda_cpu_par_t one = { .threads = 1 };
	par_for(sorted ? par : one, a->n_tokens, (uint64_t)a->hidden * dtype_size(a->dtype),
		reduce_range, &c);
}
