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
#define RW_PAGE_VERSION 4 /* 4: rw_page_params_t.abort (a combine that fails its pair) */
#define RW_PAGE_DEPTH 4           /* phases of one rank in flight at most (power of two) */
#define RW_PAGE_LINE 64
#define RW_PAGE_OWED_AHEAD (UINT64_C(1) << 62) /* a lost daemon's words: last k + this */
#define RW_PAGE_MAX_RECV (1u << 24) /* max_recv at most: a term ref holds a row in 24 bits */
#define RW_PAGE_MAX_GPUS 128       /* ranks per node at most: a term ref's top 8 bits */

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
	uint32_t gpus;                         /* local ranks of the node (the terms' bound) */
	uint32_t rail;                         /* this rank's native rail: the column its count
	                                          row counts in */
	uint32_t node, owner;                  /* this rank's node and local GPU index, as the
	                                          daemon knows them: its records' src_node and
	                                          owner (the daemon checks them), set at setup */
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
	uint32_t token_count;  /* dispatch: its tokens; combine: the rows it gives back (its
	                          dispatch's forward list), staged before submit */
	uint16_t path;         /* enum rw_path_request */
	uint16_t abort;        /* a combine: 0, or RW_PAGE_ABORT_*: the rank gives no combine for
	                          its dispatch's pair (its own call was refused on its host); the
	                          daemon fails that pair on every node, naming the rank and the
	                          reason, as a ring rank's RW_SQE_ABORT. A dispatch: 0 */
	uint64_t phase;        /* k: must equal the submit word it is published with */
	uint64_t step;
	uint32_t bad;          /* the count kernel's: 1 + a token with an expert id outside
	                          [0, n_experts) other than -1 (that token counted nothing), else 0;
	                          zeroed with the count row before the kernel */
	uint32_t reserved2;
} rw_page_params_t;

/* rw_page_params_t.abort: why a rank aborts its combine (rw_page_abort_str names it). */
enum rw_page_abort {
	RW_PAGE_ABORT_NONE = 0,
	RW_PAGE_ABORT_ARGUMENT = 1, /* the combine's arguments were refused (rows, dtype, shape,
	                               device, handle) */
	RW_PAGE_ABORT_ROUTING = 2,  /* a backward's routing is not its forward's */
	RW_PAGE_ABORT_COUNT
};

/* ---- the plan block: what the daemon tells one rank about phase k (published by `plan`, P2) ---
 * The block is the head, then rw_page_stage_t[gpus] (the staging table), then
 * rw_page_plan_rail_t[rails], then uint32 tag[nodes], then rw_page_plan_entry_t[nodes * rails]
 * (each part on its own cache lines; rw_page_layout gives their offsets). Offsets into slabs are bytes from the start of the group's slab of that rail
 * (the carve-out lent at join), so a kernel needs only the slab's base address per rail.
 *
 * Dispatch: the rank's records are its (token, node) pairs for every node holding one of the
 * token's experts, numbered per node in token order (record i to node d is the i-th token, in
 * token order, with an expert on d). Entry (d, e) says records first .. first + count - 1 to d
 * go on rail e, record first at byte `offset` of rail e's slab, the next ones rec_size apart.
 * A rank's records to d are never split otherwise: they keep their native rail, and only the
 * surplus RailBalance moves leaves in pieces, one per egress rail, in ascending rail order after
 * the native one — the daemon computes the pieces; the kernel only looks them up. Entries
 * (me, e) are the rank's records for this node's own ranks, written into the local area
 * (rw_page_plan_rail_t.local_off) exactly like the others; nothing of them leaves the node.
 * Each record is the wire's (service/phase/wire.h "records"): tag = tag[d], src_node = me,
 * owner = the head's owner, token, topk, ids, weights, row.
 *
 * Combine: entry (s, r) is the return range of source s on rail r: the dispatch records that
 * arrived at receive slots first .. first + count - 1 of rail r come back as combine records at
 * byte `offset` (rail r's combine send area) onwards, in slot order; the combine record of slot
 * p carries tag = tag[s], src_node = me, rail = r, slot = p - first. (me, r): this rank's copy
 * of rail r's local records, where it leaves its rows of them (the list below) for the owners'
 * reduce: first 0, count n_local(r), at the combine local area's slot h x n_local(r). */
typedef struct rw_page_plan_head {
	uint64_t phase;        /* k: the phase this block answers (a kernel checks it) */
	uint32_t kind;         /* 0 dispatch, 1 combine */
	uint32_t me;           /* this node: src_node of every record the rank writes */
	uint32_t owner;        /* the rank's local index on the node: owner of its records */
	uint32_t topk;
	uint32_t rec_size;     /* bytes of one record of this kind in a slab */
	uint32_t row_off;      /* offset of the row in such a record */
	uint32_t n_send;       /* records the rank writes for other nodes (entries d != me) */
	uint32_t n_local;      /* records the rank writes into the local area (entries me) */
	uint32_t n_stage;      /* entries of the staging table that follows (the node's local ranks) */
	uint32_t reserved;
} rw_page_plan_head_t;

/* Where local rank h's combine input is, which a gather's terms name: its row j at byte
 * off + j x (the row's bytes) of rail `rail`'s slab, room for `rows` rows. The plan block's
 * table holds one per local rank (rw_page_layout_t.plan_stage, the head's n_stage entries);
 * h's stream copies its rows there before its combine `submit` (pair P1). A rank stages in
 * its native rail's local area (the daemon lays the ranks of a rail one after another, each
 * with room for the rows the phase can give it: at most its max_recv), so that each rail's
 * carve-out holds only its own ranks' rows. A dispatch's block says it first (the rank stages
 * there before the plan of its combine comes); the combine's repeats it. */
typedef struct rw_page_stage {
	uint64_t off;
	uint32_t rail;
	uint32_t rows;
} rw_page_stage_t;

/* Per rail, where this phase's areas are in the group's slab of that rail. */
typedef struct rw_page_plan_rail {
	uint64_t send_off;     /* the areas the daemon posts from (dispatch: records; combine: returns) */
	uint64_t recv_off;     /* the area the peers' records of this kind arrive in */
	uint64_t local_off;    /* the local area (records or rows that never leave the node) */
	uint64_t slab_bytes;   /* the slab's size: every offset + its records stays below it */
} rw_page_plan_rail_t;

/* One (node, rail) entry of a plan block (see above). */
typedef struct rw_page_plan_entry {
	uint32_t first;        /* dispatch: the rank's first record to that node on this rail;
				* combine: the range's first receive slot */
	uint32_t count;        /* records */
	uint64_t offset;       /* byte offset of record `first` in this rail's slab */
} rw_page_plan_entry_t;

/* ---- the list: what the rank's kernel reads after `arrived` (P4) ---------------------------
 * The head, then rw_page_list_entry_t[max_recv].
 * Dispatch: the forward list, entry j is row j of the rank's output (recv_x, its metadata): the
 * record at (area, rail, slot), whose header the daemon checked; node and token repeat the
 * header's source node and token. The n_recv entries of the receive area come first (ascending
 * rail, then slot), then the local area's (ascending rail, then slot).
 * Combine: the owner's reduce list, entries sorted by token; a token's terms in the owner's
 * order (docs/dataflow.md "Combine"): this node's local ranks' rows one by one by local rank
 * (area LOCAL, rail 0), then the rows from other nodes by source node (area RECV, the combine
 * receive area); `token` is the owner's token, `node` where the row was computed. A rank's
 * terms beyond max_recv fail the phase (RW_E_TOKENS). A local term of rank h is at rail r,
 * slot h x n_local(r) + p of the combine's local area (p: its record's local slot).
 * The combine's local rows: a rank's row of a local entry (a record at local slot p of rail r)
 * is never summed with another rank's (the owner adds each local rank's row on its own); its
 * gather writes it alone where the combine plan's entry (me, r) says, offset + (p - first) x
 * rec_size: the daemon gives each rank a copy of the local area's records there, rank h's row
 * of local record p of rail r at local slot h x n_local(r) + p of the combine's local area. */
enum rw_page_area { RW_PAGE_AREA_RECV = 0, RW_PAGE_AREA_LOCAL = 1 };

typedef struct rw_page_list_head {
	uint64_t phase;        /* k: the phase this list answers */
	uint32_t count;        /* entries */
	uint32_t kind;         /* 0 dispatch, 1 combine */
	uint32_t n_recv;       /* dispatch: the first entries, of the receive area */
	uint32_t reserved;
} rw_page_list_head_t;

typedef struct rw_page_list_entry {
	uint32_t slot;         /* record index in the area (bytes: slot * rec_size) */
	uint16_t rail;
	uint16_t area;         /* enum rw_page_area */
	uint32_t node;         /* the node whose rank wrote the record or row */
	uint32_t token;        /* dispatch: the source's token; combine: the owner's token */
} rw_page_list_entry_t;

/* ---- the terms: what a rank's combine gather sums (published by the combine's `plan`, P2) ---
 * uint32 term_off[max_recv + 1], then uint32 term_ref[gpus x max_recv]. Entry j of the rank's
 * dispatch forward list (the dispatch this combine answers) has terms term_ref[term_off[j] ..
 * term_off[j + 1]): each RW_PAGE_TERM(g, row) = row `row` of local rank g's combine input (in
 * the group's slabs: entry g of the combine plan's staging table). The
 * combine record of entry j (where the combine plan's entries put it) is their fp32 sum in that
 * order, rounded once — one term copied as it is — the host mover's combine_pack for a record
 * several local ranks answered; an entry without terms is another rank's to write. */
#define RW_PAGE_TERM(g, row) (((uint32_t)(g) << 24) | (uint32_t)(row))
#define RW_PAGE_TERM_RANK(ref) ((ref) >> 24)
#define RW_PAGE_TERM_ROW(ref) ((ref) & 0xffffffu)

/* Where a slot's blocks are, in bytes from the slot's start, and the page's size. */
typedef struct rw_page_layout {
	uint32_t params;       /* rw_page_params_t */
	uint32_t count_row;    /* uint32[nodes * rails]: row[d * rails + r], rw_sched_count's */
	uint32_t plan;         /* rw_page_plan_head_t */
	uint32_t plan_stage;   /* rw_page_stage_t[gpus] */
	uint32_t plan_rail;    /* rw_page_plan_rail_t[rails] */
	uint32_t plan_tag;     /* uint32[nodes] */
	uint32_t plan_entry;   /* rw_page_plan_entry_t[nodes * rails] */
	uint32_t list;         /* rw_page_list_head_t */
	uint32_t list_entry;   /* rw_page_list_entry_t[max_recv] */
	uint32_t term_off;     /* uint32[max_recv + 1] */
	uint32_t term_ref;     /* uint32[gpus * max_recv] */
	uint32_t slot_bytes;
	uint32_t slot0;        /* offset of slot 0 from the page's start (RW_PAGE_SLOT0) */
	uint64_t bytes;        /* the page, rounded up to `page` */
} rw_page_layout_t;

/* Sizes for a geometry (gpus: the node's local ranks); -1 when out of range (nodes, rails or
 * gpus 0 or too many, max_recv past RW_PAGE_MAX_RECV, or the page past 1 GiB).
 * page: the host page size to round to (a power of two). */
int rw_page_layout(uint32_t nodes, uint32_t rails, uint32_t gpus, uint32_t max_recv, size_t page,
		   rw_page_layout_t *layout_p);

/* Offset of slot 0 from the page's start (the head, line-rounded), and phase k's slot. */
#define RW_PAGE_SLOT0 ((sizeof(rw_page_head_t) + RW_PAGE_LINE - 1) / RW_PAGE_LINE * RW_PAGE_LINE)
static inline uint8_t *rw_page_slot(const rw_page_head_t *pg, uint64_t k)
{
	return (uint8_t *)pg + RW_PAGE_SLOT0 + (k & (RW_PAGE_DEPTH - 1)) * (uint64_t)pg->slot_bytes;
}

/* Record i of a rank's dispatch records to node d under a plan block's entries (nodes x
 * rails, of which `rails` per node): its rail and byte offset in that rail's slab. 0, or -1
 * when no entry holds it (the rank has fewer records to d than it counted: a bad rank). */
static inline int rw_page_plan_find(const rw_page_plan_entry_t *entry, uint32_t rails,
				    uint32_t d, uint32_t i, uint32_t rec_size, uint32_t *rail_p,
				    uint64_t *offset_p)
{
	const rw_page_plan_entry_t *e = entry + (size_t)d * rails;
	for (uint32_t r = 0; r < rails; r++)
		if (i - e[r].first < e[r].count) { /* unsigned: also i >= first */
			*rail_p = r;
			*offset_p = e[r].offset + (uint64_t)(i - e[r].first) * rec_size;
			return 0;
		}
	return -1;
}

/* The geometry a page was made for, as the daemon keeps it: the rank can rewrite its page's head
 * at will, so the daemon never reads sizes back from a page; it uses these. */
typedef struct rw_page_geom {
	uint32_t nodes, rails, gpus, max_tokens, max_recv;
} rw_page_geom_t;

/* Daemon: where phase k's slot starts in a page of this layout (the daemon's copy). */
static inline uint8_t *rw_page_slot_at(void *page, const rw_page_layout_t *layout, uint64_t k)
{
	return (uint8_t *)page + layout->slot0 +
	       (k & (RW_PAGE_DEPTH - 1)) * (uint64_t)layout->slot_bytes;
}

/* Daemon: phase k's parameters and count row as the rank published them with submit = k
 * (copies the daemon took once), checked before anything else reads them: the phase is k, the
 * kind known, at most the page's max_tokens tokens; a dispatch's row counts only at the rank's
 * native rail (row[d * rails + rail]), no entry above token_count and the whole at most
 * token_count x min(topk, nodes) (a token is one record per node holding one of its experts);
 * a combine's row is zero; the count kernel found no bad top-k id (`bad`); `abort` only on a
 * combine, and a known reason. 0, or -1 with `why`
 * naming what is wrong (the caller names the phase). The executor checks the
 * rest as it checks a ring submission. */
int rw_page_submit_check(const rw_page_geom_t *geom, const rw_page_params_t *params,
			 const uint32_t *row, uint64_t k, uint32_t native_rail, char *why,
			 size_t why_len);

/* What abort reason `reason` (rw_page_params_t.abort) says, for a sentence "... aborted its
 * combine of ...: <this>". */
const char *rw_page_abort_str(unsigned reason);

/* Daemon: write the head of a fresh (zeroed) page made for `geom`, of a rank whose native rail
 * is `rail`. */
void rw_page_init(rw_page_head_t *pg, const rw_page_geom_t *geom, uint32_t rail,
		  const rw_page_layout_t *layout);

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

/* Waking the other side (ipc/page_word.c). A word stays memory a stream can write; a CPU that
 * writes one may also wake whoever waits for it, and a CPU that waits may sleep until then,
 * bounded, since a stream's store wakes no one. Both sides key a futex on the word's low 32 bits
 * (rw_page_word_futex), shared between the processes that map the page. */
uint32_t *rw_page_word_futex(const _Atomic uint64_t *word);
/* Store-release `value`, then wake every waiter of the word (one syscall, waiters or none). */
void rw_page_word_publish(_Atomic uint64_t *word, uint64_t value);
/* Sleep at most `ns` while the word still reads `seen`: RW_PAGE_NAP_WOKEN when a publish ended
 * it, RW_PAGE_NAP_MOVED when the word no longer read `seen` (no sleep), RW_PAGE_NAP_TIMEOUT at
 * the bound (or a signal, or ns <= 0). Either way the caller looks at the word again. */
enum { RW_PAGE_NAP_TIMEOUT = 0, RW_PAGE_NAP_WOKEN = 1, RW_PAGE_NAP_MOVED = 2 };
int rw_page_word_nap(const _Atomic uint64_t *word, uint64_t seen, long ns);

#endif /* RW_IPC_PAGE_H */
