/* CUDA staging (docs/dataflow.md "CUDA buffers"; service/mover/stage.c), private to
 * service/mover/ and reached through mover.h: async copies between ranks' device memory and host
 * staging, one stream per device; every stream's completion eventfd is an ev_io on the loop, and
 * a completed mark calls `done(ctx, token, RW_OK)` from the loop. A stream that faults reports
 * done(ctx, RW_SVC_STAGE_ALL, error) once: every mark still pending on any device of the stage
 * must be treated as failed by the caller. A device whose marks have not advanced for the stall
 * bound (rw_svc_gpu_stall_set) reports done(ctx, RW_SVC_STAGE_DEV(d), RW_ERR_TIMEOUT) once: every
 * mark pending on device d must be treated as failed; its copies may still land later, so the
 * memory they touch is handed to rw_svc_stage_retire(). Nothing here blocks the loop; only
 * _destroy() waits, and only for a device that is not stalled. */
#ifndef RW_SVC_STAGE_H
#define RW_SVC_STAGE_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct ev_loop;
typedef struct rw_svc_stage rw_svc_stage_t;
typedef void (*rw_svc_stage_done_fn)(void *ctx, uint64_t token, rw_status_t st);
#define RW_SVC_STAGE_ALL UINT64_MAX
/* A stall report's token (never a mark's: a mark's op is < 256 and its serial's low byte is
 * never all ones together with op 0xff). */
#define RW_SVC_STAGE_DEV(d) (RW_SVC_STAGE_ALL - 1 - (uint64_t)(d))
static inline int rw_svc_stage_dev_of(uint64_t token)
{
	return token < RW_SVC_STAGE_ALL && token >= RW_SVC_STAGE_DEV(63) ?
	       (int)(RW_SVC_STAGE_ALL - 1 - token) : -1;
}

rw_status_t rw_svc_stage_create(struct ev_loop *loop, rw_svc_stage_done_fn done, void *ctx,
				rw_svc_stage_t **stage_p);
/* Waits for every enqueued copy of a device that is not stalled and frees its stream; a stalled
 * device's stream is abandoned (cuStreamDestroy, which does not wait; its mark state and the
 * buffers retired against it are left to the driver and the process's exit, since a copy may
 * still write them). rw_cuda_shutdown() if CUDA was used, unless a stream of some stage was
 * abandoned or a GPU is stalled (rw_svc_gpu_stalled_list): then CUDA (modules, contexts) is left
 * to the process's exit, logged, never unloaded under a stalled GPU's queued work. */
void rw_svc_stage_destroy(rw_svc_stage_t *stage);
/* Enqueue a copy on `device`'s stream (created on first use). Host memory should be pinned
 * (rw_svc_pinned_t) and must stay valid until a later mark completes (or be retired). n == 0:
 * nothing. RW_ERR_TIMEOUT: the device is stalled (rw_svc_gpu_stalled names it). */
rw_status_t rw_svc_stage_d2h(rw_svc_stage_t *stage, int device, void *dst, uint64_t src, size_t n);
rw_status_t rw_svc_stage_h2d(rw_svc_stage_t *stage, int device, uint64_t dst, const void *src,
			     size_t n);
/* For a mover that enqueues work of its own (kernels, stream writes) on the stage's streams (the
 * CUDA mover): `device`'s stream, created on first use; the caller's work counts as a copy (a
 * later mark, fence or retire covers it). RW_ERR_TIMEOUT: the device is stalled. */
struct rw_cuda_stream;
rw_status_t rw_svc_stage_stream(rw_svc_stage_t *stage, int device, struct rw_cuda_stream **s_p);
/* The stage's destroy leaves rw_cuda_shutdown() to another stage destroyed later (a mover
 * destroyed before one whose stage still holds streams in the same primary contexts). */
void rw_svc_stage_keep_cuda(rw_svc_stage_t *stage);
/* Stream order: what is enqueued on `device` after this waits on the GPU for the event's most
 * recent record (a rank's, docs/cuda.md "Carried by a submission"); the loop never waits. */
struct rw_cuda_event;
rw_status_t rw_svc_stage_wait_event(rw_svc_stage_t *stage, int device, struct rw_cuda_event *ev);
/* done(token) follows once everything enqueued on `device` before it has finished. */
rw_status_t rw_svc_stage_mark(rw_svc_stage_t *stage, int device, uint64_t token);
/* A mover's mark token: its pair's serial, an op of its own (< 256) and a local rank; split back
 * when the mark's done() comes. */
static inline uint64_t rw_svc_stage_token(uint32_t serial, uint32_t op, uint32_t g)
{
	return (uint64_t)serial << 32 | (uint64_t)(op & 0xffu) << 8 | (g & 0xffu);
}
static inline void rw_svc_stage_token_split(uint64_t token, uint32_t *serial_p, uint32_t *op_p,
					    uint32_t *g_p)
{
	*serial_p = (uint32_t)(token >> 32);
	*op_p = (uint32_t)(token >> 8) & 0xffu;
	*g_p = (uint32_t)token & 0xffu;
}
/* Stream order (ipc/railwave.h, docs/cuda.md "Carried by a submission"): a rank's flag value
 * written into its 32-bit flag word (rw_svc_rank_io_t: flag_dev, flag_dptr, flag_value) once a
 * mover that copies its outputs from the host saw them complete; a failure is logged and fails
 * the rank's phase (the executor then writes the flag again and posts the error). */
struct rw_svc_rank_io;
rw_status_t rw_svc_stage_flag(const struct rw_svc_rank_io *io);
/* The first local rank g < RW_MAX_GPUS whose devs[g] (devices its copies went to, bit d) holds
 * `device`, or -1:
 * the rank a stall report names. */
int rw_svc_stage_rank_on(const uint64_t *devs, int device);
/* The stall bound's periodic timer (a quarter of gpu_stall_ms, within 10 ms..1 s): started while
 * `need`, else stopped. */
struct ev_timer;
void rw_svc_stage_watch(struct ev_loop *loop, struct ev_timer *w, int need);
/* Where a pair's copies on the devices in `devs` end: for each busy device d (bit d of devs), the
 * number of marks its stream must have landed (until[d]) for every copy enqueued on it so far to
 * have landed, on `stage`. What the executor waits for before it answers a failed pair's CUDA
 * rank (docs/rankpath.md "A hung GPU"); valid while the stage lives. */
typedef struct rw_svc_stage_fence {
	const rw_svc_stage_t *stage;
	uint64_t devs;
	uint64_t until[64];
} rw_svc_stage_fence_t;
/* Fill *f for the copies enqueued on `devs` so far (a device with copies behind its last mark
 * gets a mark of the stage's own, reported to nobody). Returns 0 when they are all idle. */
int rw_svc_stage_fence(rw_svc_stage_t *stage, uint64_t devs, rw_svc_stage_fence_t *f);
/* A pair's local rank g, whose copies went to the devices devs[g] (bit d): rw_svc_stage_fence
 * of those, where the pair still has copies that may not have landed (`unsettled`), else 0.
 * Every mover that stages a rank's copies answers its `fence` op with this. */
int rw_svc_stage_rank_fence(rw_svc_stage_t *stage, const uint64_t *devs, int unsettled, uint32_t g,
			    rw_svc_stage_fence_t *f);
/* 1 once every copy *f covers has landed (or its stream faulted: a faulted context writes
 * nothing more); 0 while some may still land, with *stalled_p the first such device declared
 * stalled (-1: none). Never waits. */
int rw_svc_stage_fenced(const rw_svc_stage_fence_t *f, int *stalled_p);
/* A pair that ends (quiesce, close) while copies it enqueued on the devices in `devs` (bit d:
 * device d) may not have landed: unless every such device is idle, each non-empty buffer of
 * bufs[0..n) is taken over by the stage (its memory moved out: the buffer is left empty, and its
 * owner's next reserve gets new memory) and freed once every mark made on those devices so far
 * has landed, or their stream faulted. The loop never waits; a copy never lands in freed memory.
 * Returns the bytes taken over (0: the devices were idle). */
struct rw_svc_pinned;
size_t rw_svc_stage_retire(rw_svc_stage_t *stage, uint64_t devs, struct rw_svc_pinned *const *bufs,
			   unsigned n);

/* A pinned host buffer that only grows (powers of two from 64 KiB). */
typedef struct rw_svc_pinned {
	void *ptr;
	size_t size;
} rw_svc_pinned_t;
rw_status_t rw_svc_pinned_reserve(rw_svc_pinned_t *b, size_t bytes);
void rw_svc_pinned_free(rw_svc_pinned_t *b);

/* Memory a pair that ended may still have GPU work queued on: page-locked memory (counted in
 * rw_svc_gpu_held) and device blocks, held by a stage until every fence in f has landed (or its
 * stream faulted), then freed. rw_svc_stage_retire holds each retired buffer in one; a mover
 * that also enqueues on a second stage (the CUDA mover's pull lane) fences that one in f[1] and
 * allocates its entry ahead, so holding never fails. f[0] is on the stage that holds it. At the
 * stage's destroy, an entry one of whose fences names a device whose stream some stage abandoned
 * (stalled, work queued) is left to the process's exit, logged; the others are freed. */
#define RW_SVC_HELD_BLOCKS 64
typedef struct rw_svc_held {
	struct rw_svc_held *next;
	uint32_t serial;             /* the pair's, where `tagged` (rw_svc_stage_holds) */
	int tagged;                  /* 0: a retired buffer, of no pair named */
	rw_svc_pinned_t host;
	struct { int dev; uint64_t ptr; } blk[RW_SVC_HELD_BLOCKS]; /* rw_cuda_mem_alloc's */
	uint32_t n_blk;
	rw_svc_stage_fence_t f[2];   /* a fence with no devs is none */
} rw_svc_held_t;
/* The stage takes h (calloc'd; freed by the stage) and frees it and its memory once its fences
 * landed. Looked at when a mark of the stage lands, by its stall timer (which runs while it holds
 * anything), and by rw_svc_stage_sweep. */
void rw_svc_stage_hold(rw_svc_stage_t *stage, rw_svc_held_t *h);
/* Free what has landed now: for a holder whose fences name another stage, whose own marks do not
 * wake this one (the CUDA mover calls it from that stage's reports). */
void rw_svc_stage_sweep(rw_svc_stage_t *stage);
/* Whether the stage still holds a tagged entry of pair `serial`. */
int rw_svc_stage_holds(const rw_svc_stage_t *stage, uint32_t serial);


#endif /* RW_SVC_STAGE_H */
