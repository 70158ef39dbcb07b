/* rank/: librailwave's rank path — a phase's GPU work enqueued in the rank's own process, on the
 * caller's stream, with the hand-offs to railwaved as words of the rank page (docs/rankpath.md).
 * The public calls are ipc/railwave.h's rw_client_rank_*; this header is the module's face
 * inside the tree: the state the files of rank/ share. Nothing outside rank/ touches the struct.
 *
 * Layering: rank/ sits above ipc/ (the client, the rank page's layout and rules) and cuda/ (the
 * driver loaded at run time, the words on a stream, the kernels); neither calls into it. */
#ifndef RW_RANK_H
#define RW_RANK_H

#include <stdint.h>

#include "cuda/rw_cuda.h"
#include "ipc/page.h"
#include "ipc/railwave.h"

#define RW_RANK_MSG_MAX 256
#define RW_RANK_KEPT (2 * RW_PAGE_DEPTH) /* answers kept: the phases in flight and those before */

/* How a phase of a slot ended: kept from its first answer (rw_client_rank_wait), or when the slot
 * is taken by a later phase, so that rw_client_rank_wait answers for it the same way again. */
typedef struct rw_rank_result {
	uint64_t phase;        /* 0: none kept */
	int32_t error;         /* 0 or RW_E_* */
	uint32_t bad;          /* the count kernel's bad word (1 + token), RW_E_TOKENS */
	uint32_t recv_n, overflow; /* the forward's rows written and dropped */
	uint32_t err, err_detail;  /* the kernels' error word (RW_CUDA_RANK_E_*) */
	int combined;              /* a dispatch whose combine was enqueued */
} rw_rank_result_t;

/* One rail's slab of the group as the rank path holds it (rank/slabs.c). */
typedef struct rw_rank_slab {
	rw_client_slab_t lent;  /* the client's mapping (host slabs) and the slab's areas */
	rw_cuda_dptr_t dptr;    /* the mapping as the devices address it */
	rw_cuda_vmm_t *vmm;     /* a GPU slab: the import mapped here; NULL for a host slab */
} rw_rank_slab_t;

/* Per slot, in page-locked host memory the kernels write and this CPU reads after done: the
 * device error word of the pack and forward (cuda/rank_abi.h) and the forward's row counts. */
typedef struct rw_rank_line {
	uint32_t err[2];       /* code (RW_CUDA_RANK_E_*), detail */
	uint32_t recv_n;       /* rows the forward wrote */
	uint32_t overflow;     /* listed records past the caller's capacity */
	uint8_t pad[48];
} rw_rank_line_t;

/* Where one phase's blocks are, as the kernels address them: its slot (eager mode: slot k mod D's
 * mirror, or for a host rank the page's slot itself; static mode: its shadow), its status word,
 * its line (rw_rank_line_t layout: error word, row counts) and the pack's scratch. */
typedef struct rw_rank_where {
	rw_cuda_dptr_t slot, status, line, scratch;
} rw_rank_where_t;

/* Static mode (rank/static.c; docs/rankpath.md "Static mode and CUDA graphs"): each call's
 * blocks in a shadow slot of device memory, RW_RANK_SHADOWS of them in turn; what the host
 * keeps of a call (a combine names its dispatch by call number). */
#define RW_RANK_SHADOWS 16
typedef struct rw_rank_call {
	uint64_t call;          /* 0: none */
	int kind;               /* RW_KIND_DISPATCH or RW_KIND_COMBINE */
	int combined;           /* a dispatch whose combine was enqueued */
	rw_page_params_t p;     /* a dispatch's parameters as the call gave them (step: the base) */
} rw_rank_call_t;

typedef struct rw_rank_static {
	rw_cuda_dptr_t ctl;     /* rw_cuda_rank_ctlblk_t, device memory */
	rw_cuda_rank_report_t *report; /* page-locked; the stream writes it, the host reads it */
	rw_cuda_dptr_t shadow[RW_RANK_SHADOWS]; /* device memory: slot_bytes + the tail each */
	uint64_t calls;         /* static calls made (1, 2, ...) */
	rw_rank_call_t call[RW_RANK_SHADOWS]; /* call c at c mod RW_RANK_SHADOWS */
} rw_rank_static_t;

struct rw_client_rank {
	rw_client_t *client;
	rw_page_head_t *pg;    /* the rank page, mapped by the client */
	size_t bytes;
	rw_cuda_dptr_t dptr;   /* the page as the device addresses it */
	int device;
	int32_t max_sms;       /* the SM budget: every launch's most blocks (0: the kernels' own) */
	rw_page_layout_t layout;
	uint64_t next;         /* k of the next phase (1, 2, ...) */
	int broken;            /* 0, or RW_E_CUDA once an enqueue failed after submit */
	rw_rank_result_t kept[RW_RANK_KEPT]; /* phase k at k mod RW_RANK_KEPT */
	rw_rank_line_t *lines;  /* [RW_PAGE_DEPTH], page-locked (rw_cuda_host_alloc) */
	rw_cuda_dptr_t scratch[RW_PAGE_DEPTH]; /* device memory of each slot's pack */
	/* Eager mode, device memory of each slot (slot_bytes + the tail, as a static shadow): what
	 * the stream's SNAP copies of slot k mod D after the plan and arrived waits, and what the
	 * kernels read instead of the page (docs/rankpath.md "Eager mode's mirrors"). */
	rw_cuda_dptr_t mirror[RW_PAGE_DEPTH];
	char msg[RW_RANK_MSG_MAX];
	/* The group's slabs (rank/slabs.c): rails 0 .. n_slabs - 1 mapped and registered; none
	 * when the daemon lends none (slabs_code: its answer, RW_E_STATE or RW_E_LIMIT). */
	uint32_t n_slabs;
	int slabs_code;
	rw_rank_slab_t slab[RW_CLIENT_SLAB_RAILS];
	struct rw_rank_host *host; /* device RW_RANK_HOST: the phases this CPU drives (rank/host.c) */
	rw_rank_static_t *st;   /* static mode (rw_client_rank_open_static), else NULL */
};

/* rank/rank.c, for rank/static.c (which rank.c never calls: static mode's calls are its own, and
 * so is rw_client_rank_open_opts, which picks the mode). */
int rw_rank_say(char *buf, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* rw_client_rank_open with an SM budget (checked: rw_client_rank_open_opts's errors); `eager`:
 * a CUDA rank's slots get their mirrors (static mode has its shadows instead). */
int rw_rank_open(rw_client_t *client, int32_t device, uint32_t max_recv, int32_t max_sms,
		 int eager, rw_client_rank_t **rank_p);
/* The operation block of rw_rank_ctl for op and kind on the slots' copy at `shadow` (a static
 * shadow or an eager mirror): the page's geometry and layout, static mode's control block and
 * report (0 in eager mode). */
rw_cuda_rank_ctl_t rw_rank_ctl_block(const rw_client_rank_t *r, uint32_t op, uint32_t kind,
				     rw_cuda_dptr_t shadow);
/* The stream the rank path's work of one call goes to: the caller's, with the budget. */
rw_cuda_ext_stream_t rw_rank_stream(const rw_client_rank_t *r, const rw_client_stream_t *s);
/* The calling thread's buffer for why its last open failed (rw_client_rank_message(NULL)). */
char *rw_rank_open_msg(void);
int rw_rank_check_dispatch(rw_client_rank_t *r, const rw_client_stream_t *s,
			   const rw_client_rank_dispatch_t *d);
/* RW_E_CUDA once the rank path broke, RW_E_CLOSED when the daemon is gone (plan far past k - 1). */
int rw_rank_phase_open(rw_client_rank_t *r, const char *what, uint64_t k);
void rw_rank_dispatch_blocks(const rw_client_rank_t *r, const rw_rank_where_t *w,
			     const rw_client_rank_dispatch_t *d, rw_cuda_rank_pack_t *pk,
			     rw_cuda_rank_forward_t *fw);
/* rw_client_rank_abort in eager mode (static.c picks the mode): the combine of dispatch kd
 * marked `reason`, its words enqueued without kernels (a host rank: played so); the arguments
 * and kd checked as rw_client_rank_combine's. */
int rw_rank_abort_eager(rw_client_rank_t *r, const rw_client_stream_t *s, uint64_t kd,
			uint32_t reason, uint64_t *phase_p);
void rw_rank_combine_blocks(const rw_client_rank_t *r, const rw_rank_where_t *w,
			    rw_cuda_dptr_t dslot, const rw_page_params_t *dp,
			    const rw_page_stage_t *tab, rw_cuda_dptr_t stage,
			    const rw_client_rank_combine_t *c, rw_cuda_rank_gather_t *ga,
			    rw_cuda_rank_reduce_t *re);

/* rank/slabs.c: at open, every rail's slab lent to the group, registered with CUDA (0, or none
 * lent: n_slabs 0); RW_E_CUDA, RW_E_BADREPLY or the client's error, r->msg says which (nothing
 * left registered). Close unregisters them. */
int rw_rank_slabs_open(rw_client_rank_t *r);
void rw_rank_slabs_close(rw_client_rank_t *r);

/* rank/host.c: the rank path of a host rank (device RW_RANK_HOST; docs/rankpath.md "Host
 * ranks"): no CUDA, the rank's own calls play its stream. Open: the state, each slot's pack
 * numbering and r->lines (RW_E_NOMEM, r->msg says). Dispatch and combine: what the stream does
 * before submit (the count row into slot k's zeroed row; the rows staged), the blocks kept,
 * submit = k, r->next = k + 1. Drive: phases in order up to `target`, each wait for plan, pack
 * or gather, packed, wait for arrived, forward or reduce, done; 0 once done >= target was
 * written, RW_E_TIMEOUT (timeout_ms as rw_client_rank_wait's; resumed by the next call). */
int rw_rank_host_open(rw_client_rank_t *r);
void rw_rank_host_close(rw_client_rank_t *r);
uint32_t rw_rank_host_threads(const rw_client_rank_t *r);
int rw_rank_host_dispatch(rw_client_rank_t *r, uint64_t k, const rw_client_rank_dispatch_t *d,
			  const rw_cuda_rank_pack_t *pk, const rw_cuda_rank_forward_t *fw);
int rw_rank_host_combine(rw_client_rank_t *r, uint64_t k, uint64_t rows, uint64_t staged,
			 const rw_cuda_rank_gather_t *ga, const rw_cuda_rank_reduce_t *re);
int rw_rank_host_drive(rw_client_rank_t *r, uint64_t target, int timeout_ms);

#endif /* RW_RANK_H */
