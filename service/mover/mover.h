/* railwaved's data-mover interface, private to service/ (docs/dataflow.md "Data movers"): what
 * moves a phase's payload bytes. The executor (service/exec/exec*.c) decides what goes where and
 * when — plan, waves, grants, completions — and never touches a payload byte; a mover packs the
 * send slabs, forwards arrived dispatch ranges to the local ranks, folds combine rows and
 * writes the ranks' outputs. The host mover (service/mover/mover_host.c) does it with the loop's CPU
 * (staging CUDA ranks through pinned host memory); a CUDA mover does it with kernels on the
 * ranks' GPUs. Adding a mover means a new rw_svc_mover_ops_t and a line where the daemon lists
 * its movers (service/main.c); the state machine stays as it is. */
#ifndef RW_SVC_MOVER_H
#define RW_SVC_MOVER_H

#include <stdint.h>

#include "common/arena.h"
#include "common/common.h"
#include "ipc/page.h"
#include "ipc/railwave.h"
#include "sched/sched.h"
#include "service/core/svc.h"
#include "service/mover/stage.h"
#include "service/phase/phase.h"

struct ev_loop;
struct rw_cuda_event;

/* A pair's two phases are of the daemon's one kind type, rw_svc_phase_kind_t (RW_SVC_DISPATCH,
 * RW_SVC_COMBINE; service/core/svc_metrics.h), which indexes every per-kind array here. */

/* Where one span of a rank's memory is: host memory mapped here, or CUDA memory (device,
 * address in this process). */
typedef struct rw_svc_span_mem {
	uint8_t *host;               /* NULL for CUDA memory or an absent span */
	int dev;                     /* -1: host (or absent) */
	uint64_t dptr;
	uint32_t buf;                /* the rank's buffer id (RW_BUF_NONE: absent) */
} rw_svc_span_mem_t;

/* One local rank's part of one phase, as the executor resolved it from the submission. */
typedef struct rw_svc_rank_io {
	uint32_t n_tokens;           /* dispatch: its tokens; combine: rows it gives back */
	rw_svc_span_mem_t in[3];     /* dispatch: tokens, top-k ids, top-k weights; combine: rows */
	rw_svc_span_mem_t out;       /* dispatch: the output span; combine: the combined rows */
	uint64_t out_offset;         /* the output span's offset in its buffer (for the CQE) */
	uint64_t out_cap;            /* bytes at out */
	/* Stream order (ipc/railwave.h "Stream-ordered submission"), set by the executor from the
	 * submission: wait_ev, when set, is the rank's event: stage() makes every stream that reads
	 * the rank's inputs wait on it first (a host-side mover's staging stream too; nothing waits on
	 * the loop). With signal set,
	 * the mover writes flag_value into the 32-bit word at flag_dptr (device flag_dev, the
	 * output's) after the rank's outputs, on the stream that wrote them, before it reports
	 * RW_MV_OP_FINISH. A failed pair's flags are the executor's (after quiesce). Every span of
	 * such a rank is CUDA memory (the executor refuses others). */
	struct rw_cuda_event *wait_ev;
	int signal;
	int flag_dev;
	uint64_t flag_dptr;
	uint32_t flag_value;
	/* Filled by the mover once the inputs are readable by the CPU (host memory as is, CUDA
	 * memory staged): what the executor may read (the count pass reads ids). */
	const uint8_t *tokens;
	const int32_t *ids;
	const float *weights;
	/* The rank path (docs/rankpath.md): a page rank's part, answered by the words of its rank
	 * page instead of completions; page NULL for a ring submission. page_k: the phase number
	 * its words carry; page_layout: its page's blocks (from the geometry the daemon made it
	 * for) and page_max_recv its bound on a list; page_row: its count row as the daemon
	 * copied it at submit ([N*R], the pair's). Nothing here is read back from the page. */
	rw_page_head_t *page;
	rw_page_layout_t page_layout;
	uint32_t page_max_recv;
	uint64_t page_k;
	const uint32_t *page_row;
} rw_svc_rank_io_t;

/* A pair as a mover sees it: geometry, the phase's parameters, the plan, and where the send
 * and receive areas of this pair's slot are. Filled by the executor; read-only for the mover
 * except rank_io[].tokens/ids/weights, which the mover's stage() sets. */
typedef struct rw_svc_phase {
	uint32_t serial;             /* names the pair in the mover's asynchronous reports */
	uint32_t nodes, rails, gpus, me;
	uint32_t n_experts, topk, hidden, dtype; /* dtype: rw_wire_dtype_t */
	uint64_t row_bytes, rec_size, crec_size;
	uint32_t tag_in;             /* tag of writes into this node (docs/dataflow.md "Failures") */
	const uint32_t *tag_to;      /* [N]: tag of our writes into node d */
	/* Known from the decision on (all NULL before): */
	const rw_svc_layout_t *layout;
	const uint32_t *row_off;     /* [N*R+1]: CSR of our records by (destination, native rail) */
	const rw_record_t *rec;
	const rw_rank_tokens_t *rt;  /* [G]: our ranks' dispatch tokens */
	uint32_t rail_base[RW_MAX_RAILS + 1]; /* received record ref = rail_base[r] + slot */
	uint32_t n_in;               /* records received (all rails) */
	/* This pair's areas on each rail (send and receive, per kind), in the mesh's memory. */
	uint8_t *send_area[RW_SVC_KIND_COUNT][RW_MAX_RAILS];
	const uint8_t *recv_area[RW_SVC_KIND_COUNT][RW_MAX_RAILS];
	/* Where the slabs are, per rail (docs/cuda.md "Where the slabs live"; set from the pair's
	 * start, the addresses with the areas). slab_dev[r] < 0: the areas above are the slabs, the
	 * host memory the NIC reads and writes. >= 0: the NIC reads and writes GPU memory of that
	 * device (GPUDirect RDMA) at send_dptr/recv_dptr, laid out as the areas, and the areas are
	 * its host shadow. A mover then keeps two rules (service/mover/mover_slab.c has the copies):
	 *  - what pack() and ready() offer is on the GPU: bytes the CPU wrote into the shadow are
	 *    copied over before the executor may post them;
	 *  - bytes of an arrived range are read from the GPU after rw_cuda_gdr_flush() (the NIC's
	 *    writes made visible), never from the shadow, which nothing writes into.
	 * The host mover copies whole ranges; the CUDA mover's kernels move the rows and it copies
	 * only the headers the CPU writes and checks. */
	int slab_dev[RW_MAX_RAILS];
	/* A pair on its group's carve-out (the slabs lent to the group's ranks): each rail's slab
	 * as the daemon maps it, its bytes, and its local area (records and rows that never leave
	 * the node); slab[r] NULL for a pair on the shared area's slots. */
	uint8_t *slab[RW_MAX_RAILS];
	uint64_t slab_bytes;
	uint8_t *local_area[RW_MAX_RAILS];
	/* A pair on a GPU carve-out: slab_gpu[r] its device (-1: host memory, read in place) and
	 * slab_shadow[r] its page-locked host shadow, laid out as slab[r]. slab[r] and the areas in
	 * it are then the daemon's mapping of GPU memory (device addresses), which its CPU may not be
	 * able to read: the rank mover pulls the records' headers into the shadow and checks them
	 * there (rw_svc_pull_*, below), and no ring rank is played in it. */
	int slab_gpu[RW_MAX_RAILS];
	uint8_t *slab_shadow[RW_MAX_RAILS];
	uint64_t send_dptr[RW_SVC_KIND_COUNT][RW_MAX_RAILS];
	uint64_t recv_dptr[RW_SVC_KIND_COUNT][RW_MAX_RAILS];
	rw_svc_rank_io_t io[RW_SVC_KIND_COUNT][RW_MAX_GPUS]; /* [kind][local rank] */
	/* Each local rank's pinned host staging (grows; kept across pairs by the executor). */
	rw_svc_pinned_t *stage_in[RW_MAX_GPUS], *stage_out[RW_MAX_GPUS];
	/* The executor's largest rail write (bytes): a mover that packs a slab in pieces and
	 * offers them through ready() cuts them at multiples of it. */
	uint64_t write_max;
	/* The cluster's topology (each local rank's native rail: topo->gpu_rail[g]); what a mover's
	 * count() counts with, as the executor's host count pass does. */
	const rw_topo_t *topo;
	/* Bit g: local rank g of the pair's group holds a rank page, where the group has slabs of
	 * its own (set by the executor before it asks its movers): the rank mover then carries the
	 * group's ring ranks with host buffers beside its page ranks. */
	uint32_t page_members;
} rw_svc_phase_t;

/* The local ranks (bit g: rank g) hosting one of a record's top-k experts in this phase. */
static inline uint32_t rw_svc_phase_fwd_mask(const rw_svc_phase_t *ph, const int32_t *ids)
{
	return rw_svc_fwd_mask(ph->n_experts, ph->nodes, ph->gpus, ph->me, ids, ph->topk);
}

/* GPU sets (bit d: device d; an ordinal outside 0..63, or -1 for host memory, is no bit). A
 * rank's spans of one kind: its CUDA inputs and output. A pair's, of `which`: RW_SVC_DEVS_RANKS
 * its local ranks' spans of both kinds, RW_SVC_DEVS_SLABS its slabs in GPU memory (slab_dev),
 * RW_SVC_DEVS_CARVE its group's GPU carve-out (slab_gpu). */
static inline uint64_t rw_svc_dev_bit(int dev)
{
	return dev >= 0 && dev < 64 ? 1ull << dev : 0;
}
static inline uint64_t rw_svc_rank_io_devs(const rw_svc_rank_io_t *io)
{
	return rw_svc_dev_bit(io->in[0].dev) | rw_svc_dev_bit(io->in[1].dev) |
	       rw_svc_dev_bit(io->in[2].dev) | rw_svc_dev_bit(io->out.dev);
}
enum { RW_SVC_DEVS_RANKS = 1, RW_SVC_DEVS_SLABS = 2, RW_SVC_DEVS_CARVE = 4 };
static inline uint64_t rw_svc_phase_devs(const rw_svc_phase_t *ph, unsigned which)
{
	uint64_t devs = 0;
	for (uint32_t g = 0; (which & RW_SVC_DEVS_RANKS) && g < ph->gpus && g < RW_MAX_GPUS; g++)
		for (int k = 0; k < RW_SVC_KIND_COUNT; k++)
			devs |= rw_svc_rank_io_devs(&ph->io[k][g]);
	for (uint32_t r = 0; r < ph->rails && r < RW_MAX_RAILS; r++)
		devs |= (which & RW_SVC_DEVS_SLABS ? rw_svc_dev_bit(ph->slab_dev[r]) : 0) |
			(which & RW_SVC_DEVS_CARVE ? rw_svc_dev_bit(ph->slab_gpu[r]) : 0);
	return devs;
}

/* A mover's asynchronous report: `op` of local rank g of the pair with this serial finished.
 * Always called from the loop, never from inside a mover call. */
typedef enum rw_svc_mover_op {
	RW_MV_OP_STAGE_D = 1,        /* dispatch inputs of rank g are readable (rank_io set) */
	RW_MV_OP_STAGE_C = 2,        /* combine rows of rank g are readable */
	RW_MV_OP_FINISH = 3,         /* outputs of rank g are written */
	RW_MV_OP_PACKED = 4,         /* (g 0) the slabs a pack() answered RW_ERR_AGAIN for are written:
				      * call pack() again for the same (kind, d); it returns at once */
	RW_MV_OP_COUNTED = 5,        /* the count row a count() answered pending for is written; g: the
				      * culprit local rank when st is RW_ERR_SUB_TOKENS (see count) */
	RW_MV_OP_REFUSED = 6,        /* g: a source node. What part() or arrived() took of its range
				      * was checked later (a mover that reads the headers
				      * asynchronously) and refused: st as those ops would have
				      * answered (RW_ERR_PROTO: the source is at fault), the sentence
				      * in the daemon's log */
	RW_MV_OP_ALL = 255,          /* a device faulted: every pending op of every pair failed */
} rw_svc_mover_op_t;
typedef void (*rw_svc_mover_done_fn)(void *ctx, uint32_t serial, rw_svc_mover_op_t op,
				     uint32_t g, rw_status_t st);

/* Every operation runs on the loop thread. A `why` buffer (RW_SVC_WHY_MAX) gets a sentence
 * naming what failed whenever an operation returns an error; the error tells the executor the
 * blast radius: RW_ERR_PROTO = the peer that sent the range is at fault (the executor drops
 * it), RW_ERR_SUB_SPACE = a rank's output is too small, RW_ERR_DEVICE = a copy to or from a
 * rank's GPU failed, RW_ERR_NOMEM. A mover never fails or frees a pair itself. */
#define RW_SVC_WHY_MAX 160
typedef struct rw_svc_mover_ops {
	const char *name;
	/* 1: it maps the executor's slot areas once and keeps them mapped (the CUDA mover), so its
	 * pairs use the shared area's slots and never a group's carve-out, which comes and goes
	 * with the group (service/mesh/mesh.h); 0: the areas may differ from pair to pair. */
	int areas_fixed;
	/* 1: the ranks write the records themselves (the rank path): the executor builds none on
	 * the host (no records pass), and its pairs need the group's carve-out. */
	int no_records;
	/* Per daemon: create the mover on `loop`; done() reports asynchronous completions. */
	rw_status_t (*create)(struct ev_loop *loop, rw_svc_mover_done_fn done, void *ctx,
			      void **mover_p);
	/* Waits for everything in flight (no report follows), then frees. */
	void (*destroy)(void *mover);
	/* 1 when this mover can carry a pair whose ranks gave these buffers (kind's io). The
	 * executor asks its movers in order at the first submission and keeps the first that says
	 * yes for the whole pair; the host mover says yes to everything. */
	int (*accepts)(void *mover, const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, uint32_t g);
	/* Per pair: private state, freed by close(). */
	rw_status_t (*open)(void *mover, const rw_svc_phase_t *ph, void **state_p);
	/* Make rank g's `kind` inputs readable. *pending_p = 0: done now; 1: report
	 * RW_MV_OP_STAGE_D/C follows. */
	rw_status_t (*stage)(void *mover, void *state, rw_svc_phase_t *ph, rw_svc_phase_kind_t kind,
			     uint32_t g, int *pending_p, char *why);
	/* The decision is known (ph->layout ...): size the outputs and forwarding tables. */
	rw_status_t (*plan)(void *mover, void *state, const rw_svc_phase_t *ph, char *why);
	/* Write the slabs of `kind` for destination d into ph->send_area (every rail), each record
	 * at its (egress rail, slot). Called once per (kind, d), just before d's wave is posted; a
	 * pair that posts no wave (every rank on one node) is asked once for d = me instead, for
	 * the node's own records, before its local work (nothing to write: RW_OK). Every kind's
	 * local() comes after a pack() of that kind answered RW_OK. RW_ERR_AGAIN (why empty)
	 * means the bytes are being written asynchronously (the CUDA mover, the rank pages): post
	 * nothing for d yet; an RW_MV_OP_PACKED report follows, and pack() is called again for
	 * (kind, d). The executor always waits for that report; pack() never blocks the loop. */
	rw_status_t (*pack)(void *mover, void *state, const rw_svc_phase_t *ph,
			    rw_svc_phase_kind_t kind, uint32_t d, char *why);
	/* Optional (NULL: a slab pack() answered RW_OK for is whole). After pack(kind, d) answered
	 * RW_OK: how many bytes from the start of d's slab on `rail` are written and may be posted
	 * (a mover still writing the rest in pieces; UINT64_MAX: all). `want`: the bytes the
	 * executor would post up to; when the answer is less, an RW_MV_OP_PACKED report follows
	 * once more is written (and none when the executor did not have to wait). */
	uint64_t (*ready)(void *mover, void *state, const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind,
			  uint32_t d, uint32_t rail, uint64_t want);
	/* Every byte of `kind` from `src` on `rail` is in ph->recv_area: dispatch forwards each
	 * record to the local ranks hosting its experts; combine adds each row into its owner
	 * token's sum. Validates every record header (RW_ERR_PROTO names the slot), now or, where
	 * the headers must first be read from a GPU slab, once they are: then a bad record comes
	 * as an RW_MV_OP_REFUSED report, and finish() waits for every such check. */
	rw_status_t (*arrived)(void *mover, void *state, const rw_svc_phase_t *ph,
			       rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail, char *why);
	/* Optional (NULL: arrived() only). The first `upto` records of `kind` from `src` on `rail`
	 * are in ph->recv_area and the range is not complete yet: the mover may forward or reduce
	 * them now, so that its work overlaps the rest of the transfer. (A range is written from
	 * its start in posting order on one connection, and rdma/rail.h's rules 1-2 put every
	 * earlier write's bytes in place by an arrival, so what has arrived is a prefix.) Called
	 * as upto grows; arrived() still follows for the whole range and does the rest. The same
	 * validation as arrived(). */
	rw_status_t (*part)(void *mover, void *state, const rw_svc_phase_t *ph,
			    rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail, uint32_t upto,
			    char *why);
	/* The local-node records of `kind`: at most `budget` records per call, resumable;
	 * *done_p = 1 once all are done. Asked only once a pack() of `kind` answered RW_OK (a
	 * mover whose ranks write the local area waits for them there). */
	rw_status_t (*local)(void *mover, void *state, const rw_svc_phase_t *ph,
			     rw_svc_phase_kind_t kind, uint32_t budget, int *done_p, char *why);
	/* Every byte of `kind` is here: write the ranks' outputs. *pending_p = reports of
	 * RW_MV_OP_FINISH still to come (0: written now). */
	rw_status_t (*finish)(void *mover, void *state, const rw_svc_phase_t *ph,
			      rw_svc_phase_kind_t kind, uint32_t *pending_p, char *why);
	/* Rank g's dispatch result: rows written and per-expert counts ([n_experts]). */
	void (*result)(void *state, uint32_t g, uint32_t *recv_rows_p, const uint32_t **counts_p);
	/* The pair failed: stop it at once, never waiting for a GPU (docs/rankpath.md "A hung
	 * GPU"): no later report of it changes anything the executor counts on (reports may still
	 * follow; the executor ignores them); the daemon's memory that copies still queued may
	 * write is held by the mover until they land (rw_svc_stage_retire). A rank whose CUDA
	 * memory copies still queued may touch gets its error once they landed (fence, below). */
	void (*quiesce)(void *mover, void *state);
	void (*close)(void *mover, void *state);
	/* Optional: 0 while copies this mover enqueued out of or into the carve-out ph's slabs lie
	 * in (a closed pair's), or kernels of the failed pair ph that write its shared slot's areas,
	 * may still land; the executor keeps the carve-out, or the slot, until 1. */
	int (*settled)(void *mover, const rw_svc_phase_t *ph);
	/* Optional, asked of a failed pair just before quiesce(): 1 when copies this mover enqueued
	 * into or out of local rank g's CUDA memory may not have landed, *f where they end. The
	 * executor then holds the rank's answer until rw_svc_stage_fenced(f) says they landed,
	 * or names the stalled GPU they wait on (docs/rankpath.md "A hung GPU"). */
	int (*fence)(void *mover, void *state, uint32_t g, rw_svc_stage_fence_t *f);
	/* Optional (NULL: the executor counts on the host, rw_sched_count_step in idle slices).
	 * Called once per pair, when every local rank's dispatch stage() has been called (some may
	 * still be pending): write the node's count row — row[d * R + r], rw_sched_count's, every
	 * local rank at its native rail — into `row` (N*R, the executor's; valid until close).
	 * *pending_p = 0: written now; 1: an RW_MV_OP_COUNTED report follows. RW_ERR_UNSUPPORTED
	 * (why empty): this pair is counted on the host. RW_ERR_SUB_TOKENS, now or in the report:
	 * a rank's top-k ids hold an id outside [0, E) other than -1; *bad_p (the report's g) is
	 * the lowest such local rank, as the host count pass names it. The count needs only the
	 * ids on the GPU: the host copy stage() makes of them is not waited for. */
	rw_status_t (*count)(void *mover, void *state, const rw_svc_phase_t *ph, uint32_t *row,
			     int *pending_p, uint32_t *bad_p, char *why);
} rw_svc_mover_ops_t;

extern const rw_svc_mover_ops_t rw_svc_mover_host;

/* For movers that stage CUDA ranks (service/mover/stage.c): a pair that ends with copies that
 * may not have landed (`unsettled`: marks pending, or copies with none) hands each local rank's
 * pinned staging (ph->stage_in[g], stage_out[g]) to the stage, against the devices devs[g] its
 * copies went to (rw_svc_stage_retire); devs is cleared. */
void rw_svc_stage_retire_pair(rw_svc_stage_t *stage, const rw_svc_phase_t *ph, uint64_t *devs,
			      int unsettled);
/* For movers that copy a CUDA rank's outputs from the host (service/mover/stage.c): the mark after
 * rank g's copies completed with `st`: its flag written when *flag_io names it (stream order,
 * rw_svc_stage_flag; then cleared), and RW_MV_OP_FINISH reported. */
void rw_svc_stage_flushed(rw_svc_mover_done_fn done, void *ctx, uint32_t serial, uint32_t g,
			  const rw_svc_rank_io_t **flag_io, rw_status_t st);

/* For movers (service/mover/mover_slab.c), with slabs on a GPU (ph->slab_dev): the byte range of
 * `kind`'s slab for peer `peer` on `rail` in its area, sent (send 1: peer is the destination) or
 * received (peer is the source); copy d's send slabs of every rail from the shadow to the GPU;
 * flush and copy the received range from src on rail into the shadow. RW_ERR_DEVICE with why. */
void rw_svc_slab_range(const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, int send, uint32_t peer,
		       uint32_t rail, uint64_t *off_p, uint64_t *len_p);
rw_status_t rw_svc_slab_push(const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, uint32_t d,
			     char *why);
rw_status_t rw_svc_slab_pull(const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, uint32_t src,
			     uint32_t rail, char *why);

/* For movers (service/mover/mover_pull.c), with a pair on a GPU carve-out (ph->slab_shadow):
 * the header pull. rows(): enqueue copies of `rows` pieces of `width` bytes `pitch` apart from
 * byte `off` of rail's slab (device memory) to the same bytes of its shadow, on a stream of the
 * daemon's on the slab's GPU; mark(): after every copy enqueued so far, fn(ctx, token, st) is
 * called from the loop once they all landed (RW_OK) or one failed (RW_ERR_DEVICE, logged): the
 * copies' marks are words the streams write, polled by the loop while one is outstanding (no
 * host function, no kernel); a batch on a device that stalled (rw_svc_gpu_stall) fails with
 * RW_ERR_TIMEOUT, and rows() refuses a stalled device, named. forget(): a pair that ends drops
 * its batches (tokens whose high 32 bits are `serial`) unreported, without waiting: its copies
 * stay queued on the device's one stream, before any later pull of the same shadow.
 * RW_ERR_DEVICE / RW_ERR_INVAL with why, naming the rail and GPU. */
typedef struct rw_svc_pull rw_svc_pull_t;
typedef void (*rw_svc_pull_fn)(void *ctx, uint64_t token, rw_status_t st);
rw_status_t rw_svc_pull_create(struct ev_loop *loop, rw_svc_pull_fn fn, void *ctx,
			       rw_svc_pull_t **pull_p);
void rw_svc_pull_destroy(rw_svc_pull_t *pull);
rw_status_t rw_svc_pull_rows(rw_svc_pull_t *pull, const rw_svc_phase_t *ph, uint32_t rail,
			     uint64_t off, uint64_t pitch, uint64_t width, uint32_t rows, char *why);
rw_status_t rw_svc_pull_mark(rw_svc_pull_t *pull, uint64_t token, char *why);
void rw_svc_pull_forget(rw_svc_pull_t *pull, uint32_t serial);
/* 1 when no copy of the pull out of ph's GPU slabs may still land (their GPUs' marks all in). */
int rw_svc_pull_settled(const rw_svc_pull_t *pull, const rw_svc_phase_t *ph);

/* For movers (service/mover/mover_rec.c): check an arrived dispatch record in `slot` of src's range on
 * `rail` (tag, source, owner) and read its header and top-k. RW_ERR_PROTO, with why naming the
 * slot, when the header is wrong or no expert of the record lives on this node. */
struct rw_wire_rec_hdr;
rw_status_t rw_svc_mover_rec_read(const rw_svc_phase_t *ph, const uint8_t *rec, uint32_t src,
				  uint32_t rail, uint32_t slot, struct rw_wire_rec_hdr *h_p,
				  int32_t *ids, float *weights, char *why);
/* For movers (service/mover/mover_rec.c): check the combine record in `slot` of d's range on
 * egress rail `rail` (tag, source, rail, slot) and name the dispatch record it answers (*r_p:
 * its owner rank and token). RW_ERR_PROTO, with why naming the slot, when the header is wrong. */
rw_status_t rw_svc_mover_crec_read(const rw_svc_phase_t *ph, const uint8_t *rec, uint32_t d,
				   uint32_t rail, uint32_t slot, const rw_record_t **r_p, char *why);
/* The metadata entry of a row forwarded to local rank g (docs/dataflow.md "Dispatch output"),
 * and its experts on g counted into expert_counts[E]. */
void rw_svc_mover_meta_put(const rw_svc_phase_t *ph, uint8_t *meta, uint32_t src_node,
			   uint32_t src_rank, uint32_t token, const int32_t *ids, const float *weights,
			   uint32_t g, uint32_t *expert_counts);
/* What a mover's forwarding gave each local rank g: its output's layout, its metadata entries
 * (host memory: the output itself or a staging copy), its rows so far, the record ref of each
 * row (ref[g][j]), its per-expert counts [E]; and contrib[ref * G + g] = 1 + the row of record
 * ref in rank g's output (0: not sent to g), kept for refs below n_contrib. */
typedef struct rw_svc_rank_out {
	rw_svc_out_layout_t layout[RW_MAX_GPUS];
	uint8_t *meta[RW_MAX_GPUS];
	uint32_t n[RW_MAX_GPUS];
	uint32_t *ref[RW_MAX_GPUS];
	uint32_t *expert_counts[RW_MAX_GPUS];
	uint32_t *contrib;
	uint32_t n_contrib;
} rw_svc_rank_out_t;
/* Record ref goes to every local rank hosting one of its experts: each such rank g gives it its
 * next row, rows_p[g], with the metadata entry written, its experts counted, ref[g] and contrib
 * noted (service/mover/mover_rec.c). Returns the ranks (bit g) for the caller to copy the row to,
 * or -1 when one's output is full (the caller fails the phase). */
int64_t rw_svc_rank_out_add(rw_svc_rank_out_t *ro, const rw_svc_phase_t *ph, uint32_t ref,
			    uint32_t src_node, uint32_t src_rank, uint32_t token,
			    const int32_t *ids, const float *weights, uint32_t *rows_p);
/* The rank path (service/mover/mover_rank.c; docs/rankpath.md "The rank page"). Rank g's plan
 * block for the dispatch of ph (decided: ph->layout, ph->topo, the tags), phase k: its tags and
 * its entries[d * R + e] = its records to node d (numbered in token order) that go on rail e,
 * each at the (egress rail, slot) the host mover's pack gives it — the pair plan me -> d
 * (rw_sched_map) after the records of the lower local ranks of its native rail, rows[h] being
 * local rank h's count row (NULL: counts nothing) — at areas[e].send_off + slot x rec_size;
 * records for this node in the local area (areas[r].local_off, segment (me, r) in ordinal
 * order). The head's rail areas are the caller's (the group's slabs). */
void rw_svc_rank_plan(const rw_svc_phase_t *ph, uint32_t g, const uint32_t *const *rows,
		      const rw_page_plan_rail_t *areas, uint64_t k, rw_page_plan_head_t *head,
		      uint32_t *tags, rw_page_plan_entry_t *entries);
/* Rank g's plan block for the combine of ph, phase k (ipc/page.h "Combine"): entries (s, r), s
 * another node, = source s's return range on rail r (the dispatch receive slots it filled,
 * combine records slot for slot at areas[r].send_off); (me, r) = rank g's copy of rail r's
 * local_n[r] local records at areas[r].local_off (rank h's copy at h x local_n[r] records).
 * Both heads say n_stage = the node's ranks: the caller writes the staging table after the
 * head (ipc/page.h rw_page_stage_t, where each local rank's combine input is staged). */
void rw_svc_rank_plan_combine(const rw_svc_phase_t *ph, uint32_t g, const uint32_t *local_n,
			       const rw_page_plan_rail_t *areas, uint64_t k,
			       rw_page_plan_head_t *head, uint32_t *tags,
			       rw_page_plan_entry_t *entries);
/* Check every record rank g's pack wrote under its plan block (tags, entries; slab[r]: rail r's
 * slab as the daemon maps it, the base of the entries' offsets) before a byte of it is posted:
 * the header's top-k, tag, source (this node), owner (g), token (below n_tokens, ascending per
 * destination), every top-k id -1 or in [0, E), one of them on the node it goes to. RW_OK, or
 * RW_ERR_INVAL with why naming the rank, the record, its destination, rail and byte. */
rw_status_t rw_svc_rank_records_check(const rw_svc_phase_t *ph, uint32_t g, uint32_t n_tokens,
				      const uint32_t *tags, const rw_page_plan_entry_t *entries,
				      const uint8_t *const *slab, char *why);
/* For movers (service/mover/mover_owner.c): the owner's combine sums (docs/dataflow.md
 * "Combine"). Owner token t of local rank g is u = base[g] + t; its terms are summed in one
 * fixed order — its local ranks' rows by local rank, then the rows that came back by source
 * node — once the last is in, straight into its output row. */
typedef struct rw_svc_owner {
	uint32_t base[RW_MAX_GPUS + 1];
	uint32_t n;                  /* owner tokens, all local ranks */
	uint32_t *local;             /* [u]: 1 + i, its local-node record i (ref n_in + i); 0: none */
	uint32_t *first;             /* [u + 1]: its records whose rows come back, in recs */
	uint32_t *recs;              /* those records (indices into ph->rec), by token, node ascending */
	uint32_t *left;              /* [u]: rows still to come back */
	uint8_t *done;               /* [u]: the mover's: summed (or listed to be) */
} rw_svc_owner_t;
/* From the decided plan (ph->rec, row_off, rt) and the mover's local-node records ((rank, token)
 * of record i at local_ref[2i], [2i + 1]), in the pair's arena. RW_ERR_NOMEM. */
rw_status_t rw_svc_owner_plan(rw_svc_owner_t *o, rw_arena_t *mem, const rw_svc_phase_t *ph,
			      const uint32_t *local_ref, uint32_t n_local);
/* The row of record `rec` (an index into ph->rec) came back: *u_p its token; 1 when it was the
 * token's last. */
int rw_svc_owner_back(rw_svc_owner_t *o, const rw_svc_phase_t *ph, uint32_t rec, uint32_t *u_p);
/* Token u's terms in the order they are added, as addresses: local rank h's combine row j at
 * row_at[h] + j * row_bytes (ro->contrib must cover the local-node refs), then back_at[rec] of
 * each record whose row came back. Returns how many (at most G + N - 1; terms holds that). */
uint32_t rw_svc_owner_terms(const rw_svc_owner_t *o, const rw_svc_phase_t *ph,
			    const rw_svc_rank_out_t *ro, uint32_t u, const uint64_t *row_at,
			    const uint64_t *back_at, uint64_t *terms);
/* A node's dispatch lists for its page ranks (ipc/page.h "the list", "the terms"). In: where
 * the records are; out: per local rank its forward list and the combine gather's terms of each
 * entry. Every
 * array is the caller's: list[g] and term_off[g] of max_recv (+1) entries, term_ref[g] of
 * gpus x max_recv. */
typedef struct rw_svc_rank_lists {
	const uint8_t *recv[RW_MAX_RAILS];  /* each rail's dispatch receive area (slot 0 there) */
	const uint8_t *local[RW_MAX_RAILS]; /* each rail's dispatch local area */
	uint32_t local_n[RW_MAX_RAILS];     /* records in each local area (segment (me, r)) */
	uint32_t max_recv;
	rw_page_list_entry_t *list[RW_MAX_GPUS];
	uint32_t *term_off[RW_MAX_GPUS];
	uint32_t *term_ref[RW_MAX_GPUS];
	uint32_t n[RW_MAX_GPUS], n_recv[RW_MAX_GPUS], n_terms[RW_MAX_GPUS];
} rw_svc_rank_lists_t;
/* Every checked record of the dispatch (the receive areas by rail then slot, then the local
 * areas) into the lists of the local ranks hosting its experts; a received record's terms go
 * to the lowest of them (each such rank's row, by rank), a local record's rank writes its own
 * row alone. RW_ERR_SUB_SPACE: a rank would receive more than max_recv (why names it). */
rw_status_t rw_svc_rank_fwd_lists(const rw_svc_phase_t *ph, rw_svc_rank_lists_t *lists,
				  char *why);
/* Before the combine returns are posted: every combine record the node's ranks' gathers wrote
 * (each received record's, by the rank holding its terms) has the header the receiver checks
 * (tag of its node, this node, its rail, its slot in the node's range); ret[r]: rail r's return
 * area (slot for slot with the receive area). RW_ERR_INVAL with why naming the rank that was
 * to write it. */
rw_status_t rw_svc_rank_crecords_check(const rw_svc_phase_t *ph, const rw_svc_rank_lists_t *lists,
				       const uint8_t *const *ret, char *why);
/* Local rank g's combine reduce list (n_tokens: its dispatch's tokens), sorted by token, each
 * token's terms in the owner's order: this node's ranks' rows of its local records by rank,
 * (rank h's row of the local record at local slot p of rail r: combine local slot
 * h x local_n[r] + p of rail r), then the rows coming back by source node, each where its
 * record left (sent[e]: the dispatch
 * send area of rail e, whose checked headers name owner and token). cursor: u32[n_tokens + 1]
 * scratch. RW_ERR_SUB_SPACE above max entries. */
rw_status_t rw_svc_rank_reduce_list(const rw_svc_phase_t *ph, const rw_svc_rank_lists_t *lists,
				    const uint8_t *const *sent, uint32_t g, uint32_t n_tokens,
				    uint32_t *cursor, rw_page_list_entry_t *out, uint32_t max,
				    uint32_t *n_p, char *why);
/* A ring rank in a rank-path pair (service/mover/mover_mix.c; docs/rankpath.md "Ring and page
 * ranks in one group"): the daemon's CPU plays its stream under its plan block and lists, with
 * the page rank's kernels' own CPU versions (cuda/rank_cpu.c), reading its inputs where its io's
 * tokens, ids and weights say (host memory: its own, or a staging copy of its CUDA buffers).
 * Pack: local rank g's records, in token order, one per destination node, where its plan
 * entries say in the slabs (next: [N] scratch). Forward: its list's rows and metadata entries to
 * rows[j] and meta[j] (its output's layout), its per-expert counts to counts[E] (more rows than
 * its output holds: RW_ERR_SUB_SPACE). Gather: the returns and local copies of its list's
 * entries that hold terms (staged[h]: local rank h's staged combine rows), at its combine plan's
 * entries. Reduce: each of its tokens' sum, from +0 in the list's order, to out (local[r]: rail
 * r's combine local area). RW_ERR_INVAL, why naming the rank: a plan or list that does not hold
 * the rank's rows (the kernels' error word). */
rw_status_t rw_svc_ring_pack(const rw_svc_phase_t *ph, uint32_t g, const uint32_t *tags,
			     const rw_page_plan_entry_t *entry, uint8_t *const *slab, uint32_t *next,
			     char *why);
rw_status_t rw_svc_ring_forward(const rw_svc_phase_t *ph, uint32_t g, const rw_svc_rank_lists_t *ls,
				uint8_t *rows, uint8_t *meta, uint32_t *counts, char *why);
rw_status_t rw_svc_ring_gather(const rw_svc_phase_t *ph, uint32_t w, const rw_svc_rank_lists_t *ls,
			       const uint32_t *tags, const rw_page_plan_entry_t *entry,
			       uint8_t *const *slab, const uint8_t *const *staged, char *why);
rw_status_t rw_svc_ring_reduce(const rw_svc_phase_t *ph, uint32_t g, const rw_page_list_entry_t *list,
			       uint32_t n, const uint8_t *const *local, uint8_t *out, char *why);
/* The rank path's mover (service/mover/mover_page.c; docs/rankpath.md "A phase"): takes a pair
 * whose local ranks are page ranks (rw_svc_rank_io_t.page) — and, in a group with page members
 * (rw_svc_phase_t.page_members), its ring ranks, whose streams the daemon's CPU plays
 * (rw_svc_ring_*; CUDA buffers staged through pinned host memory) — and answers each operation
 * from the page ranks' words: plan blocks and `plan`, the records' check once every `packed`
 * came, the forward lists and `arrived`;
 * finish stays pending until each page rank's `done` (the executor takes `packed` and `done`
 * from the poller and resumes the pack or counts the finish, as for RW_MV_OP_PACKED and
 * RW_MV_OP_FINISH). It moves no payload byte of a page rank: the ranks' kernels do. */
extern const rw_svc_mover_ops_t rw_svc_mover_rank;
/* Kernels on the ranks' GPUs (service/mover/mover_cuda.c): takes a pair whose first submission gives
 * CUDA memory on a device with kernels, declines every other. */
extern const rw_svc_mover_ops_t rw_svc_mover_cuda;

#endif /* RW_SVC_MOVER_H */
