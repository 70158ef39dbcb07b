/* tests/integration/fake_cuda_rank.c: the rank kernels (cuda/rank_kernels.cu) on the CPU, joined
 * to the kernel stand-in (fake_cuda_kernels.c hands their names and launches here), so the rank
 * path runs without a GPU. Each one does what cuda/rw_cuda.h "rank kernels" states, written
 * plainly: the pack numbers a rank's records to each node with a running count in token order
 * (what the GPU's prefix count computes), the sums add in fp32 in list order and round once
 * (bf16 to nearest even, NaN kept quiet). Device memory here is host-addressable, so every
 * address a block names is dereferenced as is. A launch copies its block (as the driver does)
 * and runs as stream work: at once, or late and in order with $RW_FAKE_CUDA_LAG_MS. This checks
 * the bytes the contract promises against the host mover's (tests/integration/test_rank_kernels.c),
 * not the GPU code: test/cuda runs that on a GPU. */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "common/bf16.h"
#include "common/wire_rec.h"
#include "cuda/rank_abi.h"
#include "tests/cuda/fake_cuda_base.h"
#include "tests/integration/fake_cuda_rank.h"

enum { K_PACK_INDEX = 1, K_PACK_ROWS, K_FORWARD, K_GATHER, K_REDUCE, K_END };
#define HANDLE_BASE 100 /* fake_cuda_kernels.c's own handles are small numbers */

static const char *const names[K_END] = {
	[K_PACK_INDEX] = "rw_rank_pack_index", [K_PACK_ROWS] = "rw_rank_pack_rows",
	[K_FORWARD] = "rw_rank_forward",       [K_GATHER] = "rw_rank_gather",
	[K_REDUCE] = "rw_rank_reduce",
};

static void *at(uint64_t addr) { return (void *)(uintptr_t)addr; }

static void set_err(uint64_t err, uint32_t code, uint32_t detail)
{
	uint32_t *e = at(err);
	if (e[0] == 0) {
		e[0] = code;
		e[1] = detail;
	}
}

static int failed(uint64_t status)
{
	int32_t v = 0;
	if (status)
		memcpy(&v, at(status), 4);
	return v != 0;
}

static uint32_t dtype_size(uint32_t dtype) { return dtype == 0 ? 2 : 4; } /* 0: bf16 */

static int64_t id_at(const rw_cuda_rank_pack_t *a, uint64_t i)
{
	if (a->ids_int64)
		return ((const int64_t *)at(a->ids))[i];
	return ((const int32_t *)at(a->ids))[i];
}

/* Token t's distinct destination nodes in id order; -1 when an id is out of range. */
static int token_nodes(const rw_cuda_rank_pack_t *a, uint32_t t, uint32_t *dest)
{
	const uint32_t per_node = a->n_experts / a->nodes;
	int n = 0;
	for (uint32_t k = 0; k < a->topk; k++) {
		int64_t e = id_at(a, (uint64_t)t * a->topk + k);
		if (e == -1)
			continue;
		if (e < 0 || e >= (int64_t)a->n_experts)
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

struct slot { uint64_t addr; uint32_t dest, pad; };
_Static_assert(sizeof(struct slot) == RW_CUDA_RANK_PACK_SLOT, "pack scratch entry");

static void pack_index(const rw_cuda_rank_pack_t *a)
{
	const rw_cuda_plan_entry_t *entry = at(a->entry);
	struct slot *scratch = at(a->scratch);
	if (failed(a->status))
		return;
	uint32_t *next = calloc(a->nodes, sizeof(uint32_t)); /* records to each node so far */
	if (!next)
		abort();
	for (uint32_t t = 0; t < a->n_tokens; t++) {
		uint32_t dest[32];
		int n = token_nodes(a, t, dest);
		if (n < 0) {
			set_err(a->err, RW_CUDA_RANK_E_ID, t + 1);
			n = 0;
		}
		for (uint32_t u = 0; u < a->topk; u++) {
			struct slot s = { 0, 0, 0 };
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
			scratch[(uint64_t)t * a->topk + u] = s;
		}
	}
	free(next);
}

static void pack_rows(const rw_cuda_rank_pack_t *a)
{
	const uint32_t row_bytes = a->hidden * dtype_size(a->dtype);
	const uint64_t row_off = rw_wire_rec_row_off(a->topk);
	const struct slot *scratch = at(a->scratch);
	if (failed(a->status))
		return;
	for (uint32_t t = 0; t < a->n_tokens; t++)
		for (uint32_t u = 0; u < a->topk; u++) {
			const struct slot s = scratch[(uint64_t)t * a->topk + u];
			if (!s.addr)
				continue;
			uint8_t *rec = at(s.addr);
			memset(rec, 0, a->rec_size);
			uint32_t w[4] = { ((const uint32_t *)at(a->tags))[s.dest],
					  (a->me & 0xffffu) | a->owner << 16, t, a->topk & 0xffffu };
			memcpy(rec, w, 16);
			for (uint32_t k = 0; k < a->topk; k++) {
				int32_t id = (int32_t)id_at(a, (uint64_t)t * a->topk + k);
				memcpy(rec + RW_WIRE_REC_HDR + 4 * k, &id, 4);
				memcpy(rec + RW_WIRE_REC_HDR + 4 * (a->topk + k),
				       (const float *)at(a->weights) + (uint64_t)t * a->topk + k, 4);
			}
			memcpy(rec + row_off, (const uint8_t *)at(a->x) + (uint64_t)t * row_bytes, row_bytes);
		}
}

static uint64_t list_addr(const uint64_t area[RW_CUDA_AREAS][RW_CUDA_RANK_RAILS], uint32_t rails,
			  const rw_cuda_list_entry_t *le, uint32_t size)
{
	if (le->area >= RW_CUDA_AREAS || le->rail >= rails || !area[le->area][le->rail])
		return 0;
	return area[le->area][le->rail] + (uint64_t)le->slot * size;
}

static void forward(const rw_cuda_rank_forward_t *a)
{
	uint32_t listed = 0;
	if (!failed(a->status))
		memcpy(&listed, at(a->list_n), 4);
	const uint32_t n = listed < a->cap ? listed : a->cap;
	const uint32_t per_rank = a->n_experts / (a->nodes * a->gpus);
	const uint32_t mine = (a->me * a->gpus + a->g) * per_rank;
	const uint32_t row_bytes = a->hidden * dtype_size(a->dtype);
	const uint32_t meta_bytes = 16 + 8 * a->topk;
	const uint64_t row_off = rw_wire_rec_row_off(a->topk);
	const rw_cuda_list_entry_t *list = at(a->list);
	uint32_t *counts = at(a->counts);
	memcpy(at(a->recv_n), &n, 4);
	uint32_t over = listed - n;
	memcpy(at(a->overflow), &over, 4);
	memset(counts, 0, 4ull * a->n_experts);
	for (uint32_t i = 0; i < n; i++) {
		uint64_t addr = list_addr(a->area, a->rails, &list[i], a->rec_size);
		if (!addr) {
			set_err(a->err, RW_CUDA_RANK_E_REF, i + 1);
			continue;
		}
		const uint8_t *rec = at(addr);
		uint16_t src, owner, topk;
		memcpy(&src, rec + RW_WIRE_REC_SRC, 2);
		memcpy(&owner, rec + RW_WIRE_REC_OWNER, 2);
		memcpy(&topk, rec + RW_WIRE_REC_TOPK, 2);
		if (topk != a->topk || owner >= a->gpus) {
			set_err(a->err, RW_CUDA_RANK_E_RECORD, i + 1);
			continue;
		}
		uint8_t *meta = (uint8_t *)at(a->meta) + (uint64_t)i * meta_bytes;
		uint32_t head[4] = { src, (uint32_t)src * a->gpus + owner, 0, 0 };
		memcpy(&head[2], rec + RW_WIRE_REC_TOKEN, 4);
		memcpy(meta, head, 16);
		memcpy(meta + 16, rec + RW_WIRE_REC_HDR, 8ull * a->topk);
		memcpy((uint8_t *)at(a->rows) + (uint64_t)i * row_bytes, rec + row_off, row_bytes);
		for (uint32_t k = 0; k < a->topk; k++) {
			int32_t e;
			memcpy(&e, rec + RW_WIRE_REC_HDR + 4 * k, 4);
			if (e >= 0 && (uint32_t)e - mine < per_rank)
				counts[e]++;
		}
	}
}

static float elem(uint64_t row, uint32_t h, uint32_t dtype)
{
	if (dtype == 0) {
		uint16_t v;
		memcpy(&v, at(row + 2ull * h), 2);
		return rw_bf16_to_f32(v);
	}
	float f;
	memcpy(&f, at(row + 4ull * h), 4);
	return f;
}

/* dst = the sum of cnt rows, in order: from +0 (from_zero) or from the first term (then one
 * term is copied as it is); no terms: +0. */
static void sum_rows(uint8_t *dst, const uint64_t *rows, uint32_t cnt, uint32_t hidden,
		     uint32_t dtype, int from_zero)
{
	const uint32_t row_bytes = hidden * dtype_size(dtype);
	if (cnt == 0) {
		memset(dst, 0, row_bytes);
		return;
	}
	if (cnt == 1 && !from_zero) {
		memcpy(dst, at(rows[0]), row_bytes);
		return;
	}
	for (uint32_t h = 0; h < hidden; h++) {
		float acc = from_zero ? 0.0f + elem(rows[0], h, dtype) : elem(rows[0], h, dtype);
		for (uint32_t k = 1; k < cnt; k++)
			acc += elem(rows[k], h, dtype);
		if (dtype == 0) {
			uint16_t v = rw_bf16_from_f32(acc);
			memcpy(dst + 2ull * h, &v, 2);
		} else {
			memcpy(dst + 4ull * h, &acc, 4);
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

static void gather(const rw_cuda_rank_gather_t *a)
{
	if (failed(a->status))
		return;
	const uint32_t n = list_count(a->list_n, a->cap, a->err);
	const rw_cuda_list_entry_t *list = at(a->list);
	const rw_cuda_plan_entry_t *entry = at(a->entry);
	const uint32_t *toff = at(a->term_off), *terms = at(a->terms);
	const uint32_t row_bytes = a->hidden * dtype_size(a->dtype);
	uint64_t rows[RW_CUDA_RANK_TERMS_MAX];
	for (uint32_t j = 0; j < n; j++) {
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
				uint32_t g = terms[k] >> 24;
				if (g < RW_CUDA_RANK_GPUS && a->rows[g])
					addr = a->rows[g] + (uint64_t)(terms[k] & 0xffffffu) * row_bytes;
			}
			rows[k - j0] = addr;
			bad |= !addr;
		}
		if (bad) {
			set_err(a->err, RW_CUDA_RANK_E_REF, j + 1);
			continue;
		}
		uint8_t *rec = at(a->slab[le->rail] + pe->offset +
				  (uint64_t)(le->slot - pe->first) * a->crec_size);
		uint32_t w[4] = { ((const uint32_t *)at(a->tags))[le->node],
				  (a->me & 0xffffu) | (uint32_t)le->rail << 16, le->slot - pe->first, 0 };
		memset(rec, 0, a->crec_size);
		memcpy(rec, w, 16);
		sum_rows(rec + RW_WIRE_CREC_HDR, rows, j1 - j0, a->hidden, a->dtype, 0);
	}
}

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

static void reduce(const rw_cuda_rank_reduce_t *a)
{
	if (failed(a->status))
		return;
	const uint32_t n = list_count(a->list_n, a->cap, a->err);
	const rw_cuda_list_entry_t *list = at(a->list);
	const uint32_t row_bytes = a->hidden * dtype_size(a->dtype);
	uint64_t *rows = malloc((n + 1) * sizeof(uint64_t));
	if (!rows)
		abort();
	for (uint32_t i = 0; i < n; i++)
		if (list[i].token >= a->n_tokens || (i + 1 < n && list[i + 1].token < list[i].token))
			set_err(a->err, RW_CUDA_RANK_E_REF, i + 1);
	uint32_t i = 0;
	for (uint32_t t = 0; t < a->n_tokens; t++) {
		while (i < n && list[i].token < t) /* (out of order: skipped, E_REF set above) */
			i++;
		uint32_t cnt = 0;
		int bad = 0;
		for (; i < n && list[i].token == t; i++) {
			uint64_t addr = reduce_addr(a, &list[i]);
			rows[cnt++] = addr + RW_WIRE_CREC_HDR;
			bad |= !addr;
		}
		if (bad) {
			set_err(a->err, RW_CUDA_RANK_E_REF, i);
			continue;
		}
		sum_rows((uint8_t *)at(a->out) + (uint64_t)t * row_bytes, rows, cnt, a->hidden, a->dtype, 1);
	}
	free(rows);
}

uintptr_t rw_fake_rank_function(const char *name)
{
	for (int k = 1; k < K_END; k++)
		if (strcmp(name, names[k]) == 0)
			return HANDLE_BASE + (uintptr_t)k;
	return 0;
}

int rw_fake_rank_function_of(uintptr_t f)
{
	return f > HANDLE_BASE && f < HANDLE_BASE + K_END;
}

/* A launch as stream work: which kernel, and its block (copied; freed once it ran). */
struct launch {
	int k;
	void *block;
};

static void run(const void *arg)
{
	const struct launch *L = arg;
	switch (L->k) {
	case K_PACK_INDEX: pack_index(L->block); break;
	case K_PACK_ROWS: pack_rows(L->block); break;
	case K_FORWARD: forward(L->block); break;
	case K_GATHER: gather(L->block); break;
	default: reduce(L->block); break;
	}
	free(L->block);
}

CUresult rw_fake_rank_launch(uintptr_t f, CUstream s, void **params)
{
	static const size_t size[K_END] = {
		[K_PACK_INDEX] = sizeof(rw_cuda_rank_pack_t), [K_PACK_ROWS] = sizeof(rw_cuda_rank_pack_t),
		[K_FORWARD] = sizeof(rw_cuda_rank_forward_t), [K_GATHER] = sizeof(rw_cuda_rank_gather_t),
		[K_REDUCE] = sizeof(rw_cuda_rank_reduce_t),
	};
	struct launch L = { .k = (int)(f - HANDLE_BASE) };
	if (!rw_fake_rank_function_of(f))
		return CUDA_ERROR_INVALID_HANDLE;
	L.block = malloc(size[L.k]);
	if (!L.block)
		return CUDA_ERROR_OUT_OF_MEMORY;
	memcpy(L.block, params[0], size[L.k]);
	rw_fake_cuda_submit(s, run, &L, sizeof(L));
	return CUDA_SUCCESS;
}
#endif /* RW_HAVE_CUDA_H */
