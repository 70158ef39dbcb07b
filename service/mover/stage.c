/* Staging between ranks' CUDA buffers and railwaved's host memory (docs/dataflow.md "CUDA
 * buffers"): one rw_cuda stream per device, its completion eventfd watched by an ev_io on the
 * daemon's loop, so async copies never block the loop; and growable pinned host buffers for the
 * executor to stage into. */
#include <stdlib.h>

#include <ev.h>

#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"
#include "service/mover/stage.h"

#define STAGE_MAX_DEVICES 64
#define STAGE_POLL_BATCH 64

typedef struct stage_dev {
	rw_cuda_stream_t *stream; /* NULL until first used (or after it failed) */
	ev_io io;
	uint32_t pending;         /* marks made, not yet delivered */
	struct rw_svc_stage *st;
} stage_dev_t;

struct rw_svc_stage {
	struct ev_loop *loop;
	rw_svc_stage_done_fn done;
	void *ctx;
	stage_dev_t dev[STAGE_MAX_DEVICES];
	int used;
};

rw_status_t rw_svc_stage_create(struct ev_loop *loop, rw_svc_stage_done_fn done, void *ctx,
				rw_svc_stage_t **stage_p)
{
	rw_svc_stage_t *s = calloc(1, sizeof(*s));
	if (!s)
		return RW_ERR_NOMEM;
	s->loop = loop;
	s->done = done;
	s->ctx = ctx;
	for (int d = 0; d < STAGE_MAX_DEVICES; d++)
		s->dev[d].st = s;
	*stage_p = s;
	return RW_OK;
}

static void dev_close(rw_svc_stage_t *s, stage_dev_t *d)
{
	if (!d->stream)
		return;
	ev_io_stop(s->loop, &d->io);
	rw_cuda_stream_destroy(d->stream); /* waits for what is still enqueued */
	d->stream = NULL;
	d->pending = 0;
}

void rw_svc_stage_destroy(rw_svc_stage_t *s)
{
	if (!s)
		return;
	for (int d = 0; d < STAGE_MAX_DEVICES; d++)
		dev_close(s, &s->dev[d]);
	if (s->used)
		rw_cuda_shutdown(); /* after the IPC cache (rw_svc_ipc_stop) and the streams */
	free(s);
}

static void dev_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	stage_dev_t *d = w->data;
	rw_svc_stage_t *s = d->st;
	int device = (int)(d - s->dev);
	uint64_t tokens[STAGE_POLL_BATCH];
	for (;;) {
		if (!d->stream)
			return;
		int n = rw_cuda_stream_poll(d->stream, tokens, STAGE_POLL_BATCH);
		if (n < 0) {
			/* A faulted stream never completes its marks: report every pending one as
			 * failed, then drop the stream (the next use makes a new one). */
			rw_err("stage: CUDA stream of device %d failed: %s", device,
			       rw_status_str((rw_status_t)n));
			ev_io_stop(s->loop, &d->io);
			rw_cuda_stream_destroy(d->stream);
			d->stream = NULL;
			d->pending = 0;
			s->done(s->ctx, RW_SVC_STAGE_ALL, (rw_status_t)n);
			return;
		}
		for (int i = 0; i < n; i++) {
			d->pending--;
			s->done(s->ctx, tokens[i], RW_OK);
		}
		if (n < STAGE_POLL_BATCH)
			return;
	}
}

static rw_status_t dev_get(rw_svc_stage_t *s, int device, stage_dev_t **d_p)
{
	if (device < 0 || device >= STAGE_MAX_DEVICES)
		return RW_ERR_INVAL;
	stage_dev_t *d = &s->dev[device];
	if (!d->stream) {
		rw_status_t st = rw_cuda_stream_create(device, &d->stream);
		if (st != RW_OK)
			return st;
		ev_io_init(&d->io, dev_io_cb, rw_cuda_stream_fd(d->stream), EV_READ);
		d->io.data = d;
		ev_io_start(s->loop, &d->io);
		s->used = 1;
	}
	*d_p = d;
	return RW_OK;
}

rw_status_t rw_svc_stage_d2h(rw_svc_stage_t *s, int device, void *dst, uint64_t src, size_t n)
{
	stage_dev_t *d;
	rw_status_t st = dev_get(s, device, &d);
	return st != RW_OK || n == 0 ? st : rw_cuda_copy_dtoh_async(d->stream, dst, src, n);
}

rw_status_t rw_svc_stage_h2d(rw_svc_stage_t *s, int device, uint64_t dst, const void *src, size_t n)
{
	stage_dev_t *d;
	rw_status_t st = dev_get(s, device, &d);
	return st != RW_OK || n == 0 ? st : rw_cuda_copy_htod_async(d->stream, dst, src, n);
}

rw_status_t rw_svc_stage_mark(rw_svc_stage_t *s, int device, uint64_t token)
{
	stage_dev_t *d;
	rw_status_t st = dev_get(s, device, &d);
	if (st == RW_OK)
		st = rw_cuda_stream_mark(d->stream, token);
	if (st == RW_OK)
		d->pending++;
	return st;
}

void rw_svc_stage_sync(rw_svc_stage_t *s)
{
	for (int i = 0; i < STAGE_MAX_DEVICES; i++)
		if (s->dev[i].stream && s->dev[i].pending)
			rw_cuda_stream_sync(s->dev[i].stream);
}

rw_status_t rw_svc_pinned_reserve(rw_svc_pinned_t *b, size_t bytes)
{
	if (bytes <= b->size)
		return RW_OK;
	size_t size = 64u << 10;
	while (size < bytes)
		size *= 2;
	void *p;
	rw_status_t st = rw_cuda_host_alloc(size, &p);
	if (st != RW_OK)
		return st;
	rw_svc_pinned_free(b);
	b->ptr = p;
	b->size = size;
	return RW_OK;
}

void rw_svc_pinned_free(rw_svc_pinned_t *b)
{
	if (b->ptr)
		rw_cuda_host_free(b->ptr);
	b->ptr = NULL;
	b->size = 0;
}

void rw_svc_stage_flushed(rw_svc_mover_done_fn done, void *ctx, uint32_t serial, uint32_t g,
			  const rw_svc_rank_io_t **flag_io, rw_status_t st)
{
	if (st == RW_OK && *flag_io)
		st = rw_svc_stage_flag(*flag_io);
	*flag_io = NULL;
	done(ctx, serial, RW_MV_OP_FINISH, g, st);
}

rw_status_t rw_svc_stage_flag(const struct rw_svc_rank_io *io)
{
	rw_status_t st = rw_cuda_write_u32(io->flag_dev, io->flag_dptr, io->flag_value);
	if (st != RW_OK)
		rw_warn("cannot write a completion flag on GPU %d: %s", io->flag_dev,
			rw_status_str(st));
	return st;
}
