/* ipc/ private: the rank page, the memory a CUDA rank and railwaved share for the rank path
 * (docs/rankpath.md "The rank page"): a header line, five words each alone on a cache line, a
 * status line per in-flight phase, then D slots of per-phase blocks. Both faces compile it, as
 * they do ring.h; a page is made by the daemon (a sealed memfd) and mapped by one rank.
 *
 * Who writes what (every word has one writer; values are the group's phase numbers k):
 *   submit, packed, done   the rank's stream (cuStreamWriteValue64, after a memory barrier)
 *   plan, arrived          the daemon's CPU (store-release), or on a daemon loss the rank's CPU
 *   status[k mod D]        the daemon before it publishes plan or arrived for k (0 or RW_E_*)
 * Trust: the daemon reads a rank's words and blocks as it reads ring indices: once, validated
 * (rw_page_word_step), never re-read for a decision. */
#ifndef RW_IPC_PAGE_H
#define RW_IPC_PAGE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define RW_PAGE_MAGIC 0x45475052u /* "RPGE" as little-endian bytes */
#define RW_PAGE_VERSION 1
#define RW_PAGE_DEPTH 4           /* phases of one rank in flight at most (power of two) */
#define RW_PAGE_LINE 64
#define RW_PAGE_OWED_AHEAD (UINT64_C(1) << 62) /* a lost daemon's words: last k + this */

enum rw_page_word {
	RW_PW_SUBMIT = 0,  /* rank: phase k's parameters and count row are in its slot */
	RW_PW_PLAN = 1,    /* daemon: phase k's plan block (or its failure) is written */
	RW_PW_PACKED = 2,  /* rank: its records of phase k are in the send slabs */
	RW_PW_ARRIVED = 3, /* daemon: every record for this rank is in and checked */
	RW_PW_DONE = 4,    /* rank: it no longer reads phase k's receive slabs */
	RW_PW_COUNT
};

typedef struct rw_page_line {
	_Alignas(RW_PAGE_LINE) _Atomic uint64_t v;
} rw_page_line_t;

/* The fixed head of a page; the slots follow at rw_page_layout_t.slot0. */
typedef struct rw_page_head {
	_Alignas(RW_PAGE_LINE) uint32_t magic; /* RW_PAGE_MAGIC, written once by the daemon */
	uint32_t version;                      /* RW_PAGE_VERSION */
	uint32_t depth;                        /* RW_PAGE_DEPTH */
	uint32_t nodes, rails;                 /* the geometry the slots are sized for */
	uint32_t max_tokens;                   /* a rank's dispatch tokens at most */
	uint32_t max_recv;                     /* records a rank may receive in one phase at most */
	uint32_t slot_bytes;                   /* bytes of one slot (a multiple of RW_PAGE_LINE) */
	uint64_t bytes;                        /* the whole page */
	rw_page_line_t word[RW_PW_COUNT];
	rw_page_line_t status[RW_PAGE_DEPTH];  /* int32 RW_E_* (0: ok) of phase k at k mod D */
} rw_page_head_t;

/* A phase's parameters, written into its slot by the rank (host call) or its count kernel. */
typedef struct rw_page_params {
	uint8_t kind;          /* enum rw_kind */
	uint8_t dtype;         /* enum rw_dtype */
	uint16_t topk;
	uint32_t layer;
	uint32_t hidden;
	uint32_t n_experts;
	uint32_t token_count;
	uint16_t path;         /* enum rw_path_request */
	uint16_t reserved;
	uint64_t phase;        /* k: must equal the submit word it is published with */
	uint64_t step;
} rw_page_params_t;

/* One (destination node, rail) entry of a rank's plan block: where its records go. */
typedef struct rw_page_plan_entry {
	uint32_t first_slot;   /* first record slot on that rail's receive area at the destination */
	uint32_t quota;        /* records of this rank there */
	uint64_t send_offset;  /* byte offset of the first in this rail's send slab */
} rw_page_plan_entry_t;

/* Where a slot's blocks are, in bytes from the slot's start, and the page's size. */
typedef struct rw_page_layout {
	uint32_t params;       /* rw_page_params_t */
	uint32_t count_row;    /* uint32[nodes * rails] */
	uint32_t plan;         /* rw_page_plan_entry_t[nodes * rails] */
	uint32_t fwd_list;     /* uint32 record references [max_recv] */
	uint32_t slot_bytes;
	uint32_t slot0;        /* offset of slot 0 from the page's start */
	uint64_t bytes;        /* the page, rounded up to `page` */
} rw_page_layout_t;

/* Sizes for a geometry; -1 when out of range (nodes or rails 0, or the page past 1 GiB).
 * page: the host page size to round to (a power of two). */
int rw_page_layout(uint32_t nodes, uint32_t rails, uint32_t max_recv, size_t page,
		   rw_page_layout_t *layout_p);

/* Daemon: write the head of a fresh (zeroed) page. */
void rw_page_init(rw_page_head_t *pg, uint32_t nodes, uint32_t rails, uint32_t max_tokens,
		  uint32_t max_recv, const rw_page_layout_t *layout);

/* Daemon: judge a rank-written word it last saw at `seen` and now reads `now` (the poller may
 * skip values in between): RW_PAGE_SAME (unchanged), RW_PAGE_NEXT (moved forward by 1 to
 * RW_PAGE_DEPTH phases: a rank never has more in flight), or RW_PAGE_BAD (back, or further: the
 * rank wrote what the protocol never writes). */
enum { RW_PAGE_SAME = 0, RW_PAGE_NEXT = 1, RW_PAGE_BAD = -1 };
int rw_page_word_step(uint64_t seen, uint64_t now);

/* Daemon: phase k failed with `err` (RW_E_*): its status, then plan and arrived moved to at
 * least k (never back), each with a store-release, so the rank's stream runs through and its
 * kernels, reading the status after their wait, write empty outputs (pair P6). */
void rw_page_fail(rw_page_head_t *pg, uint64_t k, int32_t err);

/* Rank, once the daemon is gone: every status `err`, then plan and arrived moved
 * RW_PAGE_OWED_AHEAD past the highest phase any word has seen, so every wait queued on them —
 * now or later — passes (the page stays mapped in the rank, so these CPU stores land). */
void rw_page_daemon_lost(rw_page_head_t *pg, int32_t err);

#endif /* RW_IPC_PAGE_H */
