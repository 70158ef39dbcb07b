/* CUDA staging (docs/dataflow.md "CUDA buffers"; service/mover/stage.c), private to
 * service/mover/ and reached through mover.h: async copies between ranks' device memory and host
 * staging, one stream per device; every stream's completion eventfd is an ev_io on the loop, and
 * a completed mark calls `done(ctx, token, RW_OK)` from the loop. A stream that faults reports
 * done(ctx, RW_SVC_STAGE_ALL, error) once: every mark still pending on any device of the stage
 * must be treated as failed by the caller. Nothing here blocks except rw_svc_stage_sync() and
 * _destroy(). */
#ifndef RW_SVC_STAGE_H
#define RW_SVC_STAGE_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct ev_loop;
typedef struct rw_svc_stage rw_svc_stage_t;
typedef void (*rw_svc_stage_done_fn)(void *ctx, uint64_t token, rw_status_t st);
#define RW_SVC_STAGE_ALL UINT64_MAX

rw_status_t rw_svc_stage_create(struct ev_loop *loop, rw_svc_stage_done_fn done, void *ctx,
				rw_svc_stage_t **stage_p);
/* Waits for every enqueued copy, frees the streams; rw_cuda_shutdown() if CUDA was used. */
void rw_svc_stage_destroy(rw_svc_stage_t *stage);
/* Enqueue a copy on `device`'s stream (created on first use). Host memory should be pinned
 * (rw_svc_pinned_t) and must stay valid until a later mark completes. n == 0: nothing. */
rw_status_t rw_svc_stage_d2h(rw_svc_stage_t *stage, int device, void *dst, uint64_t src, size_t n);
rw_status_t rw_svc_stage_h2d(rw_svc_stage_t *stage, int device, uint64_t dst, const void *src,
			     size_t n);
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
/* Block until every stream with pending marks is idle: failure paths only (a failed phase must
 * not write into a rank's memory after the rank got its error). The marks are still delivered
 * by the loop afterwards. */
void rw_svc_stage_sync(rw_svc_stage_t *stage);

/* A pinned host buffer that only grows (powers of two from 64 KiB). */
typedef struct rw_svc_pinned {
	void *ptr;
	size_t size;
} rw_svc_pinned_t;
rw_status_t rw_svc_pinned_reserve(rw_svc_pinned_t *b, size_t bytes);
void rw_svc_pinned_free(rw_svc_pinned_t *b);


#endif /* RW_SVC_STAGE_H */
