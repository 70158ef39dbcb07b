/* The CUDA data mover's private header (service/mover/mover_cuda.c is the mover as the executor sees
 * it; service/mover/mover_cuda_run.c holds what it launches and keeps): its types and what the two
 * files share. mover_cuda.c calls mover_cuda_run.c, never the other way. */
#ifndef RW_SVC_MOVER_CUDA_INT_H
#define RW_SVC_MOVER_CUDA_INT_H

#include <ev.h>

#include "common/arena.h"
#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"
#include "service/phase/phase.h"

#define CM_DEVICES 32   /* device ordinals this mover drives (bitmasks below) */
#define CM_REGS (2 * RW_MAX_RAILS * 4) /* mapped slot areas: slots x rails, with room */
#define CM_BLOCKS 64    /* pooled device blocks (zero rows, count rows) */
#define CM_TABS 4       /* pooled pinned row-list buffers (a pair holds one from plan to close) */

typedef struct cuda_mover cuda_mover_t;

/* A GPU set (rw_svc_phase_devs, rw_svc_rank_io_devs) cut to the devices this mover drives. */
static inline uint32_t cm_devs(uint64_t devs)
{
	return (uint32_t)(devs & ((1ull << CM_DEVICES) - 1));
}

/* quiesce holds each device's zero row and count block (rw_svc_held_t) */
_Static_assert(2 * CM_DEVICES <= RW_SVC_HELD_BLOCKS, "a pair's device blocks fit a held entry");

/* A row list of one device: entries are appended, [launched, n) not yet launched. Copy lists
 * use `copy`; sum lists `sum` with their source addresses in `src`. */
typedef struct cm_list {
	rw_cuda_row_copy_t *copy;
	rw_cuda_row_sum_t *sum;
	uint64_t *src;
	uint32_t cap, n, launched, src_cap, n_src;
	uint64_t addr_bits;          /* OR of the addresses since the last launch (alignment) */
	uint32_t row;                /* a copy list's bytes per entry (0: the phase's row_bytes) */
} cm_list_t;

/* One header pull out of a GPU slab (mover_cuda_slab.c): the range's records up to `upto`. */
typedef struct cm_pull {
	uint32_t src, rail, upto;
	int8_t kind, dev;
} cm_pull_t;

typedef struct cm_pair {
	cuda_mover_t *m;
	struct cm_pair *next;
	uint32_t serial, gpus;
	const rw_svc_phase_t *ph;    /* the executor's view of the pair (lives longer than cp) */
	rw_arena_t mem;
	int home;                    /* runs host-memory ranks' work: the pair's first CUDA device */
	int xdev[RW_MAX_GPUS];       /* the device whose stream writes rank g's memory */
	uint32_t devs;               /* devices with work of this pair ever enqueued */
	uint32_t reach;              /* devices made to reach each other's memory for this pair */
	uint32_t dirty;              /* devices with work enqueued after their last mark */
	uint32_t pending;            /* marks not yet completed */
	int loose;                   /* marks given up (a stalled or faulted device): work of the
	                                pair may still land */
	uint32_t marks_d[RW_MAX_GPUS]; /* dispatch staging marks per rank */
	uint32_t marks_c;            /* marks of the combine's slab and fold kernels */
	uint32_t c_staged;           /* ranks whose combine rows are in (bit g) */
	/* device-readable inputs: token rows, combine rows */
	rw_cuda_dptr_t tok[RW_MAX_GPUS], crow[RW_MAX_GPUS];
	/* the plan */
	uint32_t n_local, n_total;
	uint32_t *local_ref;         /* [2 * n_local]: (rank, token) of each local-node record */
	int local_kind;
	uint32_t bg_i;
	rw_svc_rank_out_t rank_out;  /* what the forwarding gave each local rank */
	uint8_t *counts_st[RW_MAX_GPUS], *rows_st[RW_MAX_GPUS];
	rw_cuda_dptr_t rows_d[RW_MAX_GPUS];
	/* combine: each owner token summed once its terms are in (rw_svc_owner_t), by a kernel on
	 * its rank's device straight into its output row; a zero row first in every sum, so the
	 * kernel (which loads the first row) adds to +0 as the definition does */
	rw_svc_owner_t own;
	rw_cuda_dptr_t *back_at;     /* [record]: where its row came back (0: not yet) */
	uint64_t *terms;             /* [G + N]: one token's terms */
	rw_cuda_dptr_t c_out[RW_MAX_GPUS]; /* rank g's combined rows (its output or its staging) */
	int c_ready;                 /* every rank's combine rows are readable, c_out set */
	int zero_blk[CM_DEVICES];    /* 1 + the pool block of a device's zero row (0: none) */
	rw_cuda_dptr_t send_d[2][RW_MAX_RAILS], recv_d[2][RW_MAX_RAILS];
	/* Slabs on a GPU (mover_cuda_slab.c): the host shadow's device addresses (where the CPU's
	 * headers are; the same as send_d/recv_d on a host-memory rail), the header copy lists
	 * (dispatch and combine slabs; arrived headers), and per dispatch record its egress rail's
	 * slab device (-1: host) and its header's shadow and slab addresses. */
	rw_cuda_dptr_t sh_send_d[2][RW_MAX_RAILS], sh_recv_d[2][RW_MAX_RAILS];
	cm_list_t pk_hl, cs_hl, pull;
	int8_t *pk_hdev;
	uint64_t *pk_hsrc, *pk_hdst;
	/* Header pulls out of GPU slabs, in issue order: each device's are done in its order
	 * (pull_next: its oldest not done); rx_pulled, per kind [N*R], the records of each range
	 * pulled or being pulled; fin_wait, 1 + the kind of a finish() waiting for the pulls. */
	cm_pull_t *pulls;
	uint32_t n_pulls, pulls_cap, pulls_left, pull_next[CM_DEVICES];
	uint32_t pull_devs;          /* devices whose pull lane has work of this pair */
	uint32_t *rx_pulled[2];
	int fin_wait;
	int tab;                     /* pool index of the pinned row lists (-1: none) */
	rw_svc_held_t *spare;        /* quiesce's held entry, taken at open: holding never fails */
	cm_list_t fwd[CM_DEVICES], sums[CM_DEVICES]; /* per device: forwards; owner-sum adds */
	cm_list_t pack, cslab;       /* the dispatch slabs' rows; the combine slabs' sums */
	uint8_t **pk_hdr;            /* [n_rec]: where each dispatch record's header goes */
	/* The dispatch slabs in pieces: records ordered by (destination in posting order, piece of
	 * its slab), a launch and a mark per piece and device; once a piece's marks (and every
	 * earlier piece's) are done, the CPU writes its headers and ready() offers its bytes. */
	uint64_t pk_piece;           /* bytes of a slab per piece */
	uint32_t pk_per_dst, pk_keys, pk_next; /* pieces per destination, in all; first not done */
	uint32_t *pk_left;           /* [keys]: its marks not yet completed */
	uint32_t *pk_first, *pk_order; /* [keys + 1] into [records]: each piece's records */
	uint32_t *pk_fifo[CM_DEVICES]; /* per device, the pieces of its marks in launch order */
	uint32_t pk_fifo_h[CM_DEVICES];
	uint64_t *pk_ready;          /* [N*R]: bytes of (destination, rail)'s slab written */
	uint32_t *rx_done[2];        /* per kind, [N*R]: records of each (source, rail) range already
	                                forwarded (dispatch) or added into the sums (combine) */
	uint32_t marks_pk;           /* marks of the dispatch slabs' kernels not yet completed */
	int packed;                  /* the dispatch slabs are complete (kernels done, headers written) */
	int pk_waiting;              /* ready() answered short: report RW_MV_OP_PACKED as pieces come */
	uint32_t ev_waited[2][RW_MAX_GPUS]; /* stream order: devices whose stream waits on rank g's
	                                       event (bit d), per kind */
	/* The count row on the GPU (mover_cuda_run.c launches, mover_cuda_count.c answers) */
	uint32_t d_staged;           /* ranks whose dispatch stage() was called (bit g) */
	uint32_t cnt_ranks, cnt_devs; /* ranks counted on a GPU; devices with their rows */
	int cnt_blk[CM_DEVICES];     /* 1 + the pool block of a device's row and bad words (0: none) */
	const uint32_t *cnt_host[CM_DEVICES]; /* where a device's row lands (pinned) */
	uint32_t marks_cnt;          /* OP_COUNT marks not yet completed */
	int cnt_off;                 /* a count launch failed: count() declines, the host counts */
	int cnt_sent;                /* the rows' copies are enqueued */
	uint32_t *cnt_row;           /* the executor's row, once count() asked (the report is due) */
	uint32_t *cnt_part;          /* [N*R]: the host-memory ranks' part */
	uint32_t cnt_bad;            /* 1 + the lowest host-memory rank with a bad id (0: none) */
} cm_pair_t;

struct cuda_mover {
	struct ev_loop *loop;
	rw_svc_mover_done_fn done;
	void *ctx;
	int off;                     /* RAILWAVE_CUDA_MOVER=0: decline every pair */
	int check;                   /* RAILWAVE_CUDA_MOVER=check: verify every row copy */
	int said_pack;               /* how pack() waits was logged */
	uint32_t peer_ok[CM_DEVICES]; /* bit b of [a]: kernels on a may touch b's memory (enabled) */
	int said_count;              /* that count rows come from the GPU was logged */
	int kernels[CM_DEVICES];     /* 0 unknown, 1 loaded, -1 absent (logged once) */
	/* The lanes, one stream per device each (service/mover/stage.c: marks on an eventfd watched
	 * by the loop, the stall bound, fences): the kernels and copies of the pairs; the header
	 * pulls out of GPU slabs, so a pull never queues behind pack and forwards. */
	rw_svc_stage_t *st, *pst;
	cm_pair_t *pairs;
	struct { uint8_t *base; uint64_t bytes; rw_cuda_dptr_t dptr; } reg[CM_REGS];
	uint32_t n_reg;
	struct { int dev; rw_cuda_dptr_t ptr; size_t size; int busy; } blk[CM_BLOCKS];
	struct { rw_svc_pinned_t buf; int busy; } tabs[CM_TABS];
	uint64_t slab_pulls;         /* header pulls out of GPU slabs */
};

enum { OP_STAGE_D = 0, OP_STAGE_C = 1, OP_FLUSH_D = 2, OP_FLUSH_C = 3, OP_PACK = 4, OP_COUNT = 5,
       OP_PULL = 6, OP_QUIET = 7 /* quiesce's own mark behind a failed pair's last work */ };

/* A mark's token: the pair, the op, and a local rank or a device. */
static inline uint64_t cm_token(const cm_pair_t *cp, uint32_t op, uint32_t g)
{
	return (uint64_t)cp->serial << 32 | (uint64_t)op << 8 | g;
}
int cm_dev_kernels(cuda_mover_t *m, int dev);
rw_cuda_dptr_t cm_hptr(const void *p);
cm_pair_t *cm_pair_find(cuda_mover_t *m, uint32_t serial);
rw_status_t cm_pair_stream(cm_pair_t *cp, int device, rw_cuda_stream_t **s_p);
rw_status_t cm_pair_mark(cm_pair_t *cp, int device, uint32_t op, uint32_t g);
rw_status_t cm_map_areas(cuda_mover_t *m, cm_pair_t *cp, const rw_svc_phase_t *ph, char *why);
int cm_blk_take(cuda_mover_t *m, int dev, size_t size);
int cm_span_dev_ok(cuda_mover_t *m, const rw_svc_span_mem_t *s);
rw_status_t cm_stage_dispatch(cm_pair_t *cp, rw_svc_phase_t *ph, uint32_t g, int *pending_p,
				  char *why);
void cm_combine_headers(cm_pair_t *cp, const rw_svc_phase_t *ph, int gpu);
rw_status_t cm_stage_combine(cm_pair_t *cp, rw_svc_phase_t *ph, uint32_t g, int *pending_p,
				 char *why);
void cm_list_copy(cm_list_t *l, rw_cuda_dptr_t src, rw_cuda_dptr_t dst);
void cm_list_sum(cm_list_t *l, rw_cuda_dptr_t dst);
void cm_list_src(cm_list_t *l, rw_cuda_dptr_t src);
void cm_check_read(cm_pair_t *cp, int dev, uint64_t addr, uint8_t *buf, size_t n);
void cm_check_copies(cm_pair_t *cp, const rw_svc_phase_t *ph, const cm_list_t *l, int dev,
			 uint32_t from, uint32_t to, const char *what);
rw_status_t cm_list_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, cm_list_t *l, int dev,
			       int kind);
void cm_list_carve(cm_list_t *l, uint8_t *base, size_t *off, uint32_t n, uint32_t srcs, int sum);
void cm_lists_carve(cm_pair_t *cp, const rw_svc_phase_t *ph, uint8_t *base, size_t *off,
			const uint32_t *ranks_on, const uint32_t *recs_on, const uint32_t *local_on,
			const uint32_t *own_on);
/* mover_cuda_pack.c: the dispatch pack in pieces; an OP_PACK mark of device dev completed. */
void cm_pack_piece_done(cm_pair_t *cp, int dev);
rw_status_t cm_dispatch_pack_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why);
int cm_forward_one(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t ref, uint32_t src_node,
		       uint32_t src_rank, uint32_t token, const int32_t *ids, const float *weights,
		       rw_cuda_dptr_t row);
rw_status_t cm_launch_all(cm_pair_t *cp, const rw_svc_phase_t *ph, int sums, char *why);
rw_status_t cm_forward_range(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t src,
				 uint32_t rail, uint32_t upto, char *why);
rw_status_t cm_forward_local(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t budget,
				 int *done_p, char *why);
rw_status_t cm_combine_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why);
rw_status_t cm_combine_range(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t d, uint32_t e,
				 uint32_t upto, char *why);
/* The same, on headers that are in the shadow: validate and launch (the *_range ops take them
 * now from host-memory slabs, after a pull from GPU slabs). */
rw_status_t cm_forward_take(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t src,
				uint32_t rail, uint32_t upto, char *why);
rw_status_t cm_combine_take(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t d, uint32_t e,
				uint32_t upto, char *why);

void cm_host_copy_out(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind, uint32_t g);
/* mover_cuda_slab.c: slabs on a GPU. Any rail's; the slabs' device addresses
 * (after the shadows are mapped); the header lists carved from the pair's pinned buffer; an
 * arrived range's headers up to record `upto` pulled into the shadow (asynchronously: an OP_PULL
 * mark, and mover_cuda.c takes them when it is done). */
int cm_slab_any(const rw_svc_phase_t *ph);
rw_status_t cm_slab_map(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why);
void cm_slab_carve(cm_pair_t *cp, const rw_svc_phase_t *ph, uint8_t *base, size_t *off);
rw_status_t cm_slab_pull(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind, uint32_t src,
			 uint32_t rail, uint32_t upto, char *why);
/* mover_cuda_count.c: the count() op; an OP_COUNT mark completed; the pair's count blocks back
 * to the pool (close). */
rw_status_t cm_count(void *mover, void *state, const rw_svc_phase_t *ph, uint32_t *row,
		     int *pending_p, uint32_t *bad_p, char *why);
void cm_count_done(cm_pair_t *cp);
void cm_count_release(cm_pair_t *cp);

#endif /* RW_SVC_MOVER_CUDA_INT_H */
