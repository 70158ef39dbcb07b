/* cuda/rank_abi.h: the argument blocks of the rank kernels (cuda/rank_kernels.cu), the one
 * definition both sides compile: the host wrappers (cuda/rank_kernels.c, through cuda/rw_cuda.h
 * "rank kernels", where each block's meaning is stated) and nvcc. Plain C that C++ reads the same:
 * fixed-width fields, every 64-bit field 8-byte aligned, explicit padding, sizes checked on both
 * sides. A block is passed to its kernel by value (one kernel parameter).
 *
 * The kernels read the rank page's plan entries and list entries in place: the two entry types
 * below have ipc/page.h's layouts (rw_page_plan_entry_t, rw_page_list_entry_t; the library
 * that passes a page's addresses checks the sizes), restated here because cuda/ sits below ipc/. */
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
	uint32_t reserved;
} rw_cuda_rank_gather_t;

/* rw_cuda_rank_reduce */
typedef struct rw_cuda_rank_reduce {
	uint64_t list;              /* the reduce list: entries sorted by token, each token's terms in
	                             * summation order */
	uint64_t list_n;            /* u32: entries (read by the kernel) */
	uint64_t area[RW_CUDA_AREAS][RW_CUDA_RANK_RAILS];
	uint64_t out;               /* n_tokens rows */
	uint64_t status, err;
	/* 0, or the combine plan block's rw_cuda_plan_rail_t[rails] (read in place, after the
	 * caller's wait, as the list is): an entry on rail r is then at slab[r] + that rail's
	 * local_off (LOCAL) or recv_off (RECV) + slot x crec_size, area[] unused — the combine's
	 * local areas are decided by the daemon after the caller enqueued the kernel. */
	uint64_t plan_rail;
	uint64_t slab[RW_CUDA_RANK_RAILS];
	uint32_t cap;               /* entries list_n may say at most */
	uint32_t n_tokens, hidden, dtype, rails;
	uint32_t crec_size;         /* set by the wrapper: a combine row sits at slot x crec_size +
	                             * 16 of its area */
} rw_cuda_rank_reduce_t;

#endif /* RW_CUDA_RANK_ABI_H */
