/* cuda/rank_abi.h: the argument blocks of the rank kernels (cuda/rank_kernels.cu), the one
 * definition every side compiles: the host wrappers (cuda/rank_kernels.c, through cuda/rw_cuda.h
 * "rank kernels", where each block's meaning is stated), nvcc, and the kernels' CPU versions
 * (cuda/rank_cpu.c: host ranks, the daemon's ring ranks, the stand-in). Plain C that C++ reads
 * the same: fixed-width fields, every 64-bit field 8-byte aligned, explicit padding, sizes
 * checked on both sides. A block is passed to its kernel by value (one kernel parameter).
 *
 * The kernels read the rank page slot's plan entries and list entries from its device copy (eager
 * mode's mirror, static mode's shadow: rw_rank_ctl WAIT and SNAP): the two entry types
 * below have ipc/page.h's layouts (rw_page_plan_entry_t, rw_page_list_entry_t; the library
 * that passes a page's addresses, and service/mover/mover_mix.c that passes the daemon's own,
 * check the sizes and offsets), restated here because cuda/ sits below ipc/. */
#ifndef RW_CUDA_RANK_ABI_H
#define RW_CUDA_RANK_ABI_H

#include <stdint.h>

#define RW_CUDA_RANK_RAILS 16     /* rails at most (RW_MAX_RAILS) */
#define RW_CUDA_RANK_GPUS 16      /* local ranks at most (RW_MAX_GPUS) */
#define RW_CUDA_RANK_PACK_SLOT 16 /* scratch bytes of a pack per (token, top-k slot) */
#define RW_CUDA_RANK_TERMS_MAX 128 /* terms of one gather entry at most (E_REF past it) */
#define RW_CUDA_RANK_EXPERTS_MAX 8192 /* experts of one rank a forward counts at most */

/* The device error word: u32[2], code then detail. The first failing thread's code wins (the
 * code is set with a compare-and-swap from 0); the detail is that thread's. */
enum {
	RW_CUDA_RANK_E_ID = 1,     /* pack: a top-k id outside [0, n_experts) other than -1; detail
	                            * 1 + token */
	RW_CUDA_RANK_E_PLAN = 2,   /* pack: no plan entry holds a record; detail 1 + node. gather: no
	                            * return range holds a listed slot; detail 1 + list index */
	RW_CUDA_RANK_E_REF = 3,    /* a list entry names no area or rail, or a term list runs past
	                            * its bounds; detail 1 + list index */
	RW_CUDA_RANK_E_RECORD = 4, /* forward: a record's header does not match the phase (top-k,
	                            * owner); detail 1 + list index */
};

/* A (node, rail) entry of a plan block (ipc/page.h rw_page_plan_entry_t, 16 bytes). Dispatch:
 * the rank's records first .. first + count - 1 to that node go on that rail, record `first` at
 * byte `offset` of the rail's slab. Combine: the dispatch records that arrived at receive slots
 * first .. first + count - 1 of the rail from that node come back at byte `offset` onwards. */
typedef struct rw_cuda_plan_entry {
	uint32_t first;
	uint32_t count;
	uint64_t offset;
} rw_cuda_plan_entry_t;

/* An entry of a list (ipc/page.h rw_page_list_entry_t, 16 bytes): the record (or combine row)
 * at `slot` of area `area` (0 receive, 1 local) on `rail`; node and token as the daemon read
 * them (dispatch: the source's; combine: the owner's token). */
typedef struct rw_cuda_list_entry {
	uint32_t slot;
	uint16_t rail;
	uint16_t area;
	uint32_t node;
	uint32_t token;
} rw_cuda_list_entry_t;

enum { RW_CUDA_AREA_RECV = 0, RW_CUDA_AREA_LOCAL = 1, RW_CUDA_AREAS = 2 };

/* One rail's areas in a plan block (ipc/page.h rw_page_plan_rail_t, 32 bytes): byte offsets from
 * the start of the group's slab of that rail. */
typedef struct rw_cuda_plan_rail {
	uint64_t send_off, recv_off, local_off, slab_bytes;
} rw_cuda_plan_rail_t;

/* rw_cuda_rank_pack */
typedef struct rw_cuda_rank_pack {
	uint64_t x, ids, weights;   /* the rank's tokens, top-k ids (int32 or int64), f32 weights */
	uint64_t entry;             /* rw_cuda_plan_entry_t[nodes * rails], (d, r) at d * rails + r */
	uint64_t tags;              /* u32[nodes]: the header tag of records for node d */
	uint64_t slab[RW_CUDA_RANK_RAILS]; /* each rail's slab (the entries' offsets start there) */
	uint64_t scratch;           /* device memory, rw_cuda_rank_pack_scratch() bytes */
	uint64_t status;            /* 0, or an int32: nonzero, the kernels write nothing */
	uint64_t err;               /* u32[2], the device error word */
	uint32_t n_tokens, topk, hidden, dtype; /* dtype: rw_cuda_dtype_t */
	uint32_t ids_int64;         /* 1: ids are int64 */
	uint32_t n_experts, nodes, rails;
	uint32_t me, owner;         /* this node; this rank's local GPU index (the header's owner) */
	uint32_t rec_size;          /* set by the wrapper: bytes of a record */
	uint32_t reserved;
} rw_cuda_rank_pack_t;

/* rw_cuda_rank_forward */
typedef struct rw_cuda_rank_forward {
	uint64_t list;              /* rw_cuda_list_entry_t[], entry j = output row j */
	uint64_t list_n;            /* u32: entries in list (read by the kernel) */
	uint64_t area[RW_CUDA_AREAS][RW_CUDA_RANK_RAILS]; /* each area's base on each rail */
	uint64_t rows, meta, counts; /* outputs: rows[cap], meta[cap], u32 counts[n_experts] */
	uint64_t recv_n, overflow;  /* u32 each: rows written; listed records beyond cap */
	uint64_t status, err;
	uint32_t cap, topk, hidden, dtype;
	uint32_t n_experts, nodes, gpus, rails, me, g; /* g: this rank's local GPU index */
	uint32_t rec_size;          /* set by the wrapper */
	uint32_t reserved;
} rw_cuda_rank_forward_t;

/* rw_cuda_rank_gather */
typedef struct rw_cuda_rank_gather {
	uint64_t list;              /* the rank's dispatch forward list (entry j: its row j) */
	uint64_t list_n;            /* u32: entries (read by the kernel) */
	uint64_t entry;             /* the combine plan's entries (s, r), nodes * rails */
	uint64_t tags;              /* u32[nodes]: the combine header's tag for source node s */
	uint64_t slab[RW_CUDA_RANK_RAILS];
	uint64_t rows[RW_CUDA_RANK_GPUS]; /* local rank g's rows (hidden x dtype each) */
	uint64_t term_off, terms;   /* 0: entry j's one term is rows[g][j]; else CSR u32[cap + 1]
	                             * and u32 refs (g' << 24 | row) into rows[] */
	uint64_t status, err;
	uint32_t cap;               /* entries list_n may say at most (past it: E_REF) */
	uint32_t n_terms;           /* refs in terms at most */
	uint32_t hidden, dtype, nodes, rails, me, g;
	uint32_t crec_size;         /* set by the wrapper */
	uint32_t stage_gpus;        /* with `stage`: the local ranks whose rows are staged */
	/* 0, or the address of a dispatch plan's staging table (rw_cuda_page_stage_t[stage_gpus]),
	 * read by the kernel: rows[] is then unused and local rank g < stage_gpus has its rows at
	 * slab[its entry's rail] + its entry's off (static mode: the staging areas are known only
	 * once the dispatch's plan came, after the call) */
	uint64_t stage;
} rw_cuda_rank_gather_t;

/* rw_cuda_rank_reduce */
typedef struct rw_cuda_rank_reduce {
	uint64_t list;              /* the reduce list: entries sorted by token, each token's terms in
	                             * summation order */
	uint64_t list_n;            /* u32: entries (read by the kernel) */
	uint64_t area[RW_CUDA_AREAS][RW_CUDA_RANK_RAILS];
	uint64_t out;               /* n_tokens rows */
	uint64_t status, err;
	/* 0, or the combine plan block's rw_cuda_plan_rail_t[rails] (in the slot's mirror or
	 * shadow, read after the stream's copy, as the list is): an entry on rail r is then at
	 * slab[r] + that rail's local_off (LOCAL) or recv_off (RECV) + slot x crec_size, area[]
	 * unused — the combine's local areas are decided by the daemon after the caller enqueued
	 * the kernel. */
	uint64_t plan_rail;
	uint64_t slab[RW_CUDA_RANK_RAILS];
	uint32_t cap;               /* entries list_n may say at most */
	uint32_t n_tokens, hidden, dtype, rails;
	uint32_t crec_size;         /* set by the wrapper: a combine row sits at slot x crec_size +
	                             * 16 of its area */
} rw_cuda_rank_reduce_t;

/* ---- static mode (docs/rankpath.md "Static mode and CUDA graphs") -------------------------------
 * Every per-phase value lives in memory the stream reads: the phase number k and the per-layer
 * step counters in the rank's control block (device memory), a phase's blocks in a shadow slot
 * of its own (device memory with the rank page's slot layout, then a tail), and the failures
 * the host is told later in a report (page-locked host memory). rw_rank_ctl's operations move
 * them between the shadow and the rank page's slot k mod depth, so the data kernels take fixed
 * addresses and a replayed CUDA graph drives a new phase each time. The restated page types
 * below have ipc/page.h's layouts (rank/ checks the sizes and offsets). */
#define RW_CUDA_RANK_LAYERS 1024  /* step counters: layer mod this */

/* ipc/page.h rw_page_params_t (48 bytes). */
typedef struct rw_cuda_page_params {
	uint8_t kind, dtype;
	uint16_t topk;
	uint32_t layer, hidden, n_experts, token_count;
	uint16_t path, abort;
	uint64_t phase, step;
	uint32_t bad, reserved2;
} rw_cuda_page_params_t;

/* ipc/page.h rw_page_stage_t (16 bytes): where local rank g's combine input is staged. */
typedef struct rw_cuda_page_stage {
	uint64_t off;
	uint32_t rail, rows;
} rw_cuda_page_stage_t;

/* The control block (device memory, zeroed at open; only the stream writes it). */
typedef struct rw_cuda_rank_ctlblk {
	uint64_t k;                 /* the last phase number the stream took (0: none yet) */
	uint64_t pad[7];
	uint64_t step[RW_CUDA_RANK_LAYERS]; /* dispatches of layer l (mod LAYERS) so far */
} rw_cuda_rank_ctlblk_t;

/* A shadow slot's tail, after the slot layout's bytes: the phase's status as read after each
 * wait, then the kernels' line (error word, the forward's row counts). */
typedef struct rw_cuda_rank_tail {
	int32_t status;
	uint32_t pad0[15];
	uint32_t err[2];            /* RW_CUDA_RANK_E_* code, detail */
	uint32_t recv_n, overflow;
	uint32_t pad1[12];
} rw_cuda_rank_tail_t;

/* What the stream tells the host (page-locked host memory; the host reads it once the stream's
 * work is done and clears it). The first failed phase is kept with what failed it. */
typedef struct rw_cuda_rank_report {
	uint64_t done;              /* the last phase the stream finished */
	uint64_t fail_phase;        /* the first failed phase (0: none) */
	int32_t status;             /* its status (the daemon's, or the rank CPU's on a daemon loss) */
	uint32_t bad;               /* its count kernel's bad word (1 + token) */
	uint32_t err[2];            /* its kernels' error word */
	uint32_t fail_kind;         /* 0 dispatch, 1 combine */
	uint32_t over_n;            /* dispatches that had rows past their capacity */
	uint64_t over_phase;        /* the first of them */
	uint32_t over_rows;         /* rows dropped, over all of them */
	uint32_t need;              /* the most rows one of them was listed (written + dropped) */
	uint32_t pad[4];
} rw_cuda_rank_report_t;

enum {
	RW_CUDA_RANK_OP_BEGIN = 0,  /* zero the shadow's count row, bad word and tail */
	RW_CUDA_RANK_OP_SUBMIT = 1, /* k = ++ctl.k; the phase's parameters (and step) into the
	                             * shadow and slot k mod depth, its count row; submit = k. A
	                             * combine gives back every row its dispatch was listed (those
	                             * dropped past the capacity as +0 rows) */
	RW_CUDA_RANK_OP_WAIT = 2,   /* wait for word >= k, then copy the status and the slot's plan
	                             * (plan word; a combine's terms: those of its dispatch's
	                             * list) or list (arrived: its entries) into the shadow; every
	                             * block waits, then copies its share */
	RW_CUDA_RANK_OP_WORD = 3,   /* word = k (packed) */
	RW_CUDA_RANK_OP_DONE = 4,   /* the report, the caller's row count; done = k */
	RW_CUDA_RANK_OP_STAGE = 5,  /* combine: the caller's rows into this rank's staging area,
	                             * a +0 row for each row its dispatch dropped */
	RW_CUDA_RANK_OP_SNAP = 6,   /* eager mode: WAIT's copy of page slot `slot_k` into the
	                             * mirror `shadow`, without the wait (the stream waited on the
	                             * word with cuStreamWaitValue): the kernels after it read
	                             * device memory, not the page (docs/rankpath.md "Eager mode's
	                             * mirrors"); ctl and report unused */
};

#define RW_CUDA_RANK_E_STAGE 5    /* static combine: its dispatch's staging area does not hold
                                   * the rows; detail: the rows */

/* rw_cuda_rank_ctl */
typedef struct rw_cuda_rank_ctl {
	uint64_t ctl;               /* rw_cuda_rank_ctlblk_t */
	uint64_t report;            /* rw_cuda_rank_report_t */
	uint64_t page;              /* the rank page (its head) */
	uint64_t shadow;            /* this phase's shadow slot */
	uint64_t ref;               /* combine: its dispatch's shadow slot */
	uint64_t src;               /* STAGE: the caller's rows */
	uint64_t slab;              /* STAGE: the slab of the rank's native rail, where it stages */
	uint64_t slab_bytes;
	uint64_t out;               /* DONE of a dispatch: 0, or a u32 the row count goes to */
	uint64_t step;              /* SUBMIT of a dispatch: the caller's base step */
	uint32_t op, word;          /* word: the page word (ipc/page.h enum rw_page_word) */
	uint32_t kind;              /* 0 dispatch, 1 combine */
	uint32_t dtype, topk, layer, hidden, n_experts, token_count, path; /* dispatch's parameters */
	uint32_t depth, slot0, slot_bytes; /* the page's slots */
	uint32_t word_off, status_off;     /* offsetof the page head's word[] and status[] (64 apart) */
	uint32_t o_params, o_count_row, o_plan, o_list, o_list_entry, o_term_off; /* slot offsets */
	uint32_t cells;             /* nodes x rails: the count row */
	uint32_t max_recv, gpus, owner;
	uint32_t row_bytes;         /* STAGE: hidden x the dtype's size */
	uint32_t page_kind;         /* the parameters' kind (ipc/railwave.h enum rw_kind) */
	uint32_t o_term_ref;        /* the slot offset of the terms' refs */
	uint32_t o_plan_stage;      /* STAGE: the slot offset of the plan's staging table */
	uint32_t rail;              /* STAGE: the rank's native rail (its staging table entry's) */
	uint32_t abort;             /* SUBMIT of a combine: 0, or the parameters' abort reason (the
	                             * rank gives no combine: ipc/page.h rw_page_params_t.abort) */
	uint32_t slot_k;            /* SNAP: the phase's page slot (its number mod depth) */
} rw_cuda_rank_ctl_t;

/* What rw_rank_ctl computes, written once for the kernel and the CPU stand-in
 * (tests/integration/fake_cuda_rank.c) alike. */
#ifdef __CUDACC__
#define RW_CUDA_RANK_HD static __host__ __device__ __forceinline__
#else
#define RW_CUDA_RANK_HD static inline
#endif

/* SUBMIT: phase k's parameters. A dispatch: the block's, its step the caller's base plus the
 * layer's counter (advanced), the count kernel's bad word from its shadow; a combine: its
 * dispatch's (layer and step too), giving back every row the dispatch was listed, with the
 * block's abort reason. */
RW_CUDA_RANK_HD rw_cuda_page_params_t rw_cuda_rank_params(const rw_cuda_rank_ctl_t *a,
							   rw_cuda_rank_ctlblk_t *c, uint64_t k,
							   const rw_cuda_page_params_t *own,
							   const rw_cuda_page_params_t *ref,
							   const rw_cuda_rank_tail_t *ref_tail)
{
	rw_cuda_page_params_t p = { 0 };
	if (a->kind == 1) {
		p = *ref;
		p.token_count = ref_tail->recv_n + ref_tail->overflow;
		p.bad = 0;
		p.abort = (uint16_t)a->abort;
	} else {
		p.dtype = (uint8_t)a->dtype;
		p.topk = (uint16_t)a->topk;
		p.layer = a->layer;
		p.hidden = a->hidden;
		p.n_experts = a->n_experts;
		p.token_count = a->token_count;
		p.path = (uint16_t)a->path;
		p.step = a->step + c->step[a->layer % RW_CUDA_RANK_LAYERS]++;
		p.bad = own->bad;
	}
	p.kind = (uint8_t)a->page_kind;
	p.phase = k;
	return p;
}

/* STAGE: where this rank's `bytes` of combine input go, from its entry of the dispatch plan's
 * staging table (its shadow copy): the entry names the rank's own rail, and its room (rows x
 * row_bytes) holds them inside the slab. 0 when it does not (the kernel reports E_STAGE). */
RW_CUDA_RANK_HD uint64_t rw_cuda_rank_stage_dst(const rw_cuda_rank_ctl_t *a,
						const rw_cuda_page_stage_t *e, uint64_t bytes)
{
	const uint64_t room = (uint64_t)e->rows * a->row_bytes;
	if (e->rail != a->rail || bytes > room || e->off > a->slab_bytes ||
	    room > a->slab_bytes - e->off)
		return 0;
	return a->slab + e->off;
}

/* The gather's rows of local rank g in static mode: at its staging table entry (the dispatch
 * plan's, read after the wait), in its rail's slab; 0 for a rank or rail past the table. */
RW_CUDA_RANK_HD uint64_t rw_cuda_rank_stage_rows(const rw_cuda_page_stage_t *tab, uint32_t n,
						 const uint64_t *slab, uint32_t rails, uint32_t g)
{
	return g < n && tab[g].rail < rails && slab[tab[g].rail] ? slab[tab[g].rail] + tab[g].off : 0;
}

/* DONE: phase k's end into the report (the first failure kept, overflows added up). */
RW_CUDA_RANK_HD void rw_cuda_rank_report_add(rw_cuda_rank_report_t *rep, uint32_t kind,
					     const rw_cuda_page_params_t *p,
					     const rw_cuda_rank_tail_t *t)
{
	if ((t->status || p->bad || t->err[0]) && rep->fail_phase == 0) {
		rep->fail_phase = p->phase;
		rep->status = t->status;
		rep->bad = p->bad;
		rep->err[0] = t->err[0];
		rep->err[1] = t->err[1];
		rep->fail_kind = kind;
	}
	if (t->overflow) {
		if (rep->over_n++ == 0)
			rep->over_phase = p->phase;
		rep->over_rows += t->overflow;
		if (t->recv_n + t->overflow > rep->need)
			rep->need = t->recv_n + t->overflow;
	}
	rep->done = p->phase;
}

#endif /* RW_CUDA_RANK_ABI_H */
