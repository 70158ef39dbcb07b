/* tests/integration/fake_cuda_rank.c: the rank kernels (cuda/rank_kernels.cu) on the CPU, joined
 * to the kernel stand-in (fake_cuda_kernels.c hands their names and launches here), so the rank
 * path runs without a GPU. Each runs the production CPU version the host ranks use
 * (cuda/rank_cpu.c: what cuda/rw_cuda.h "rank kernels" states, the host mover's bytes).
 * Device memory here is host-addressable, so every address a block names is dereferenced as is.
 * A launch copies its block (as the driver does) and runs as stream work: at once, or late and
 * in order with $RW_FAKE_CUDA_LAG_MS. rw_rank_ctl (static mode's hand-offs, eager mode's SNAP) is this file's own (below). This checks the bytes the contract promises against the
 * host mover's (tests/integration/test_rank_kernels.c), not the GPU code: test/cuda runs that
 * on a GPU. */
#include "config.h"

#if RW_HAVE_CUDA_H
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "common/common.h"
#include "cuda/rw_cuda.h"
#include "tests/cuda/fake_cuda_base.h"
#include "tests/integration/fake_cuda_rank.h"

enum { K_PACK_INDEX = 1, K_PACK_ROWS, K_FORWARD, K_GATHER, K_REDUCE, K_CTL, K_END };
#define HANDLE_BASE 100 /* fake_cuda_kernels.c's own handles are small numbers */

static const char *const names[K_END] = {
	[K_PACK_INDEX] = "rw_rank_pack_index", [K_PACK_ROWS] = "rw_rank_pack_rows",
	[K_FORWARD] = "rw_rank_forward",       [K_GATHER] = "rw_rank_gather",
	[K_REDUCE] = "rw_rank_reduce",         [K_CTL] = "rw_rank_ctl",
};

static void *at(uint64_t addr) { return (void *)(uintptr_t)addr; }

/* ---- rank_kernels.cu rw_rank_ctl: static mode's hand-offs, eager mode's SNAP, one operation a launch ---- */

static rw_cuda_page_params_t *ctl_params(const rw_cuda_rank_ctl_t *a, uint64_t sh)
{
	return at(sh + a->o_params);
}

static rw_cuda_rank_tail_t *ctl_tail(const rw_cuda_rank_ctl_t *a, uint64_t sh)
{
	return at(sh + a->slot_bytes);
}

static uint8_t *ctl_slot(const rw_cuda_rank_ctl_t *a, uint64_t k)
{
	return at(a->page + a->slot0 + (k % a->depth) * (uint64_t)a->slot_bytes);
}

static _Atomic uint64_t *ctl_word(const rw_cuda_rank_ctl_t *a, uint32_t w)
{
	return at(a->page + a->word_off + 64ull * w);
}

static void ctl_submit(const rw_cuda_rank_ctl_t *a)
{
	rw_cuda_rank_ctlblk_t *c = at(a->ctl);
	rw_cuda_page_params_t *sp = ctl_params(a, a->shadow);
	const uint64_t k = ++c->k;
	const rw_cuda_page_params_t p = rw_cuda_rank_params(a, c, k, sp,
							    a->ref ? ctl_params(a, a->ref) : NULL,
							    a->ref ? ctl_tail(a, a->ref) : NULL);
	*sp = p;
	uint8_t *slot = ctl_slot(a, k);
	memcpy(slot + a->o_params, &p, sizeof(p));
	memcpy(slot + a->o_count_row, at(a->shadow + a->o_count_row), 4ull * a->cells);
	atomic_store_explicit(ctl_word(a, 0), k, memory_order_release);
}

/* A wait operation may start once its word reached the phase (the stream holds it till then). */
static int ctl_ready(const void *arg)
{
	const rw_cuda_rank_ctl_t *a = arg;
	const uint64_t k = ctl_params(a, a->shadow)->phase;
	return (int64_t)(atomic_load_explicit(ctl_word(a, a->word), memory_order_acquire) - k) >= 0;
}

/* Page slot `sk` (a phase number mod depth) into the shadow or mirror: WAIT's copy after its
 * word, SNAP's (eager mode: the stream waited on the word itself) at once. */
static void ctl_copy(const rw_cuda_rank_ctl_t *a, uint64_t sk)
{
	const uint8_t *slot = ctl_slot(a, sk);
	uint8_t *sh = at(a->shadow);
	memcpy(&ctl_tail(a, a->shadow)->status, at(a->page + a->status_off + 64ull * (sk % a->depth)), 4);
	if (a->word == 1) {
		memcpy(sh + a->o_plan, slot + a->o_plan, a->o_list - a->o_plan);
		if (a->kind == 1) { /* the terms of the dispatch's list entries */
			uint32_t n, nterm;
			memcpy(&n, at(a->ref + a->o_list + 8), 4);
			n = n < a->max_recv ? n : a->max_recv;
			memcpy(&nterm, slot + a->o_term_off + 4ull * n, 4);
			nterm = nterm < a->gpus * a->max_recv ? nterm : a->gpus * a->max_recv;
			memcpy(sh + a->o_term_off, slot + a->o_term_off, 4ull * (n + 1));
			memcpy(sh + a->o_term_ref, slot + a->o_term_ref, 4ull * nterm);
		}
	} else {
		uint32_t listed;
		memcpy(&listed, slot + a->o_list + 8, 4);
		const uint32_t n = listed < a->max_recv ? listed : a->max_recv;
		memcpy(sh + a->o_list, slot + a->o_list, a->o_list_entry - a->o_list);
		memcpy(sh + a->o_list_entry, slot + a->o_list_entry, 16ull * n);
	}
}

static void ctl_wait(const rw_cuda_rank_ctl_t *a)
{
	if (rw_fake_cuda_wait_until(ctl_ready, a, "rw_rank_ctl wait") != 0)
		return;
	ctl_copy(a, ctl_params(a, a->shadow)->phase);
}

static void ctl_done(const rw_cuda_rank_ctl_t *a)
{
	const rw_cuda_page_params_t *sp = ctl_params(a, a->shadow);
	const rw_cuda_rank_tail_t *t = ctl_tail(a, a->shadow);
	rw_cuda_rank_report_t *rep = at(a->report);
	const uint64_t k = sp->phase;
	if (a->out)
		memcpy(at(a->out), &t->recv_n, 4);
	rw_cuda_rank_report_add(rep, a->kind, sp, t);
	atomic_store_explicit(ctl_word(a, 4), k, memory_order_release);
}

static void ctl_stage(const rw_cuda_rank_ctl_t *a)
{
	const rw_cuda_page_stage_t *e = (const rw_cuda_page_stage_t *)at(a->ref + a->o_plan_stage) +
					a->owner;
	const rw_cuda_rank_tail_t *dt = ctl_tail(a, a->ref);
	const uint64_t copy = (uint64_t)dt->recv_n * a->row_bytes;
	const uint64_t bytes = ((uint64_t)dt->recv_n + dt->overflow) * a->row_bytes;
	uint8_t *dst = at(rw_cuda_rank_stage_dst(a, e, bytes));
	if (!dst) {
		rw_cuda_rank_tail_t *t = ctl_tail(a, a->shadow); /* zeroed by BEGIN just before */
		t->err[0] = RW_CUDA_RANK_E_STAGE;
		t->err[1] = dt->recv_n + dt->overflow;
		return;
	}
	memcpy(dst, at(a->src), copy);
	memset(dst + copy, 0, bytes - copy); /* the rows dropped past the capacity: +0 */
}

static void ctl(const rw_cuda_rank_ctl_t *a)
{
	switch (a->op) {
	case RW_CUDA_RANK_OP_BEGIN:
		memset(at(a->shadow + a->o_count_row), 0, 4ull * a->cells);
		memset(ctl_tail(a, a->shadow), 0, sizeof(rw_cuda_rank_tail_t));
		ctl_params(a, a->shadow)->bad = 0;
		break;
	case RW_CUDA_RANK_OP_SUBMIT: ctl_submit(a); break;
	case RW_CUDA_RANK_OP_WAIT: ctl_wait(a); break;
	case RW_CUDA_RANK_OP_WORD:
		atomic_store_explicit(ctl_word(a, a->word), ctl_params(a, a->shadow)->phase,
				      memory_order_release);
		break;
	case RW_CUDA_RANK_OP_DONE: ctl_done(a); break;
	case RW_CUDA_RANK_OP_SNAP: ctl_copy(a, a->slot_k); break;
	default: ctl_stage(a); break;
	}
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

/* A launch as stream work: which kernel, and its block, copied into the item (as the driver
 * copies it at the call; a graph keeps the copy and replays it). */
struct launch {
	int k;
	unsigned grid;
	union {
		rw_cuda_rank_pack_t pack;
		rw_cuda_rank_forward_t forward;
		rw_cuda_rank_gather_t gather;
		rw_cuda_rank_reduce_t reduce;
		rw_cuda_rank_ctl_t ctl;
	} b;
};
_Static_assert(sizeof(struct launch) <= RW_FAKE_WORK_ARG, "a launch must fit a stream work item");

static void run(const void *arg)
{
	const struct launch *L = arg;
	/* $RW_FAKE_CUDA_RANK_THREADS: rows split over that many threads, however few (the split
	 * host ranks make for big phases, checked on small ones); unset: the launch's grid, its
	 * blocks one after another on this thread. */
	const char *v = getenv("RW_FAKE_CUDA_RANK_THREADS");
	const rw_cuda_cpu_par_t par = v && atoi(v) > 0 ? (rw_cuda_cpu_par_t){ .threads = (uint32_t)atoi(v) }
							: (rw_cuda_cpu_par_t){ .threads = 1, .blocks = L->grid };
	switch (L->k) {
	case K_PACK_INDEX: {
		uint32_t *next = calloc(L->b.pack.nodes ? L->b.pack.nodes : 1, sizeof(*next));
		if (!next)
			abort();
		rw_cuda_cpu_pack_index(&L->b.pack, next);
		free(next);
		break;
	}
	case K_PACK_ROWS: rw_cuda_cpu_pack_rows(&L->b.pack, par); break;
	case K_FORWARD: rw_cuda_cpu_forward(&L->b.forward, par); break;
	case K_GATHER: rw_cuda_cpu_gather(&L->b.gather, par); break;
	case K_REDUCE: rw_cuda_cpu_reduce(&L->b.reduce, par); break;
	default: ctl(&L->b.ctl); break;
	}
}

/* A static-mode wait holds its stream till its word comes; every other launch runs in order. */
static int launch_ready(const void *arg)
{
	const struct launch *L = arg;
	return L->k != K_CTL || L->b.ctl.op != RW_CUDA_RANK_OP_WAIT || ctl_ready(&L->b.ctl);
}

/* The words a data kernel reads in every block (its status, list length and entries, plan
 * entries, tags, terms) must be device memory: read from host memory (the rank page), each is a
 * PCIe round trip, and the reads of one address by every block queue behind each other (on an
 * H100: ~1.07 us each, milliseconds a phase; docs/rankpath.md "Eager mode's mirrors"). A launch
 * naming page memory there is refused, so every rank-path test checks the rule;
 * $RW_FAKE_RANK_HOST_READS=1 lifts it (the kernels' benchmark measures that case). */
typedef struct { const char *what; uint64_t at; } read_t;

static const char *host_read(const struct launch *L)
{
#define R(kind, f) { #f, L->b.kind.f }
	const read_t pack[] = { R(pack, status), R(pack, entry), R(pack, tags) };
	const read_t forward[] = { R(forward, status), R(forward, list), R(forward, list_n) };
	const read_t gather[] = { R(gather, status), R(gather, list), R(gather, list_n),
				  R(gather, entry), R(gather, tags), R(gather, term_off),
				  R(gather, terms), R(gather, stage) };
	const read_t reduce[] = { R(reduce, status), R(reduce, list), R(reduce, list_n),
				  R(reduce, plan_rail) };
#undef R
	const char *v = getenv("RW_FAKE_RANK_HOST_READS");
	if ((v && strcmp(v, "1") == 0) || L->k == K_CTL)
		return NULL;
	const read_t *r = pack;
	size_t n = RW_ARRAY_SIZE(pack);
	if (L->k == K_FORWARD)
		r = forward, n = RW_ARRAY_SIZE(forward);
	else if (L->k == K_GATHER)
		r = gather, n = RW_ARRAY_SIZE(gather);
	else if (L->k == K_REDUCE)
		r = reduce, n = RW_ARRAY_SIZE(reduce);
	for (size_t i = 0; i < n; i++)
		if (r[i].at && !rw_fake_cuda_is_device_mem((uintptr_t)r[i].at, 4))
			return r[i].what;
	return NULL;
}

CUresult rw_fake_rank_launch(uintptr_t f, CUstream s, unsigned grid, void **params)
{
	static const size_t size[K_END] = {
		[K_PACK_INDEX] = sizeof(rw_cuda_rank_pack_t), [K_PACK_ROWS] = sizeof(rw_cuda_rank_pack_t),
		[K_FORWARD] = sizeof(rw_cuda_rank_forward_t), [K_GATHER] = sizeof(rw_cuda_rank_gather_t),
		[K_REDUCE] = sizeof(rw_cuda_rank_reduce_t), [K_CTL] = sizeof(rw_cuda_rank_ctl_t),
	};
	struct launch L;
	if (!rw_fake_rank_function_of(f))
		return CUDA_ERROR_INVALID_HANDLE;
	memset(&L, 0, sizeof(L));
	L.k = (int)(f - HANDLE_BASE);
	L.grid = grid;
	memcpy(&L.b, params[0], size[L.k]);
	const char *bad = host_read(&L);
	if (bad) {
		fprintf(stderr, "fake_cuda_rank: %s reads %s from host memory (it must be device "
			"memory: a mirror or a shadow)\n", names[L.k], bad);
		return CUDA_ERROR_INVALID_VALUE;
	}
	rw_fake_cuda_submit_held(s, run, &L, sizeof(L), launch_ready);
	return CUDA_SUCCESS;
}
#endif /* RW_HAVE_CUDA_H */
