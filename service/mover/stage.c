/* Staging between ranks' CUDA buffers and railwaved's host memory (docs/dataflow.md "CUDA
 * buffers"): one rw_cuda stream per device, its completion eventfd watched by an ev_io on the
 * daemon's loop, so async copies never block the loop; and growable pinned host buffers for the
 * executor to stage into. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ev.h>

#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"
#include "service/mover/stage.h"

#define STAGE_MAX_DEVICES 64
#define STAGE_POLL_BATCH 64
#define STAGE_NO_TOKEN (RW_SVC_STAGE_ALL - 100) /* a retire's own mark: reported to nobody */

typedef struct stage_dev {
	rw_cuda_stream_t *stream; /* NULL until first used (or after it failed) */
	ev_io io;
	uint32_t pending;         /* marks made, not yet delivered */
	uint64_t made, landed;    /* marks made and landed on this stream, ever */
	uint64_t moved_at;        /* when a mark last landed, or the first of an idle stream was made */
	int dirty;                /* copies enqueued since the last mark */
	int stalled;              /* declared stalled (rw_svc_gpu_stall), not landed since */
	struct rw_svc_stage *st;
} stage_dev_t;

struct rw_svc_stage {
	struct ev_loop *loop;
	rw_svc_stage_done_fn done;
	void *ctx;
	stage_dev_t dev[STAGE_MAX_DEVICES];
	rw_svc_held_t *held;      /* rw_svc_stage_hold */
	ev_timer watch;           /* while a mark is outstanding or memory held: the stall bound */
	uint64_t watch_last;      /* when the watch last ran or started (0: stopped) */
	int used;
	int keep_cuda;            /* rw_svc_stage_keep_cuda: no rw_cuda_shutdown() at destroy */
};

static void watch_cb(struct ev_loop *loop, ev_timer *w, int revents);

/* Devices whose stream some stage of this process abandoned (dev_close): their queued work may
 * still run, so CUDA is never shut down under it (rw_svc_stage_destroy). The loop's thread only. */
static uint64_t stage_abandoned;

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
	ev_init(&s->watch, watch_cb);
	s->watch.data = s;
	*stage_p = s;
	return RW_OK;
}

/* Whether memory the copies on d enqueued so far touch is still in use by the GPU. */
static int dev_busy(const stage_dev_t *d)
{
	return d->stream && (d->landed < d->made || d->dirty);
}

/* d's stream must be abandoned, not destroyed (which waits for its queued work): work is queued
 * on it and its GPU is stalled, as this stage declared it or as another did (the other lane
 * may have declared it while this one's mark is younger than the bound). */
static int dev_hung(const rw_svc_stage_t *s, const stage_dev_t *d)
{
	return dev_busy(d) && (d->stalled || rw_svc_gpu_stalled((int)(d - s->dev), NULL, 0));
}

static void held_free(rw_svc_held_t *h)
{
	rw_svc_gpu_held(-(int64_t)h->host.size);
	rw_svc_pinned_free(&h->host);
	for (uint32_t i = 0; i < h->n_blk; i++)
		rw_cuda_mem_free(h->blk[i].dev, h->blk[i].ptr);
	free(h);
}

/* Free the held memory whose fences all landed (or lost their stream: it faulted, and a
 * faulted context writes nothing more). */
static void held_sweep(rw_svc_stage_t *s)
{
	for (rw_svc_held_t **hp = &s->held; *hp;) {
		rw_svc_held_t *h = *hp;
		int landed = 1, stalled;
		for (int i = 0; i < 2 && landed; i++)
			landed = !h->f[i].devs || rw_svc_stage_fenced(&h->f[i], &stalled);
		if (!landed) {
			hp = &h->next;
			continue;
		}
		*hp = h->next;
		held_free(h);
	}
}

static void dev_unstall(stage_dev_t *d, int landed)
{
	if (!d->stalled)
		return;
	d->stalled = 0;
	rw_svc_gpu_moved((int)(d - d->st->dev), landed);
}

static void dev_close(rw_svc_stage_t *s, stage_dev_t *d)
{
	if (!d->stream)
		return;
	ev_io_stop(s->loop, &d->io);
	if (dev_hung(s, d)) {
		rw_cuda_stream_abandon(d->stream); /* a copy may still land: nothing of it freed */
		stage_abandoned |= 1ull << (d - s->dev);
	} else
		rw_cuda_stream_destroy(d->stream); /* waits for what is still enqueued */
	dev_unstall(d, 0);
	d->stream = NULL;
	d->pending = 0;
	d->dirty = 0;
	d->landed = d->made;
}

void rw_svc_stage_destroy(rw_svc_stage_t *s)
{
	if (!s)
		return;
	ev_timer_stop(s->loop, &s->watch);
	uint64_t abandoned = 0;
	for (int d = 0; d < STAGE_MAX_DEVICES; d++) {
		if (dev_hung(s, &s->dev[d]))
			abandoned |= 1ull << d;
		dev_close(s, &s->dev[d]); /* a device's copies done, or its stream abandoned */
	}
	/* f[0] is this stage's: its abandoned streams; f[1] another stage's, destroyed first (its
	 * streams closed, stage_abandoned has theirs). The driver's queued work may still name what
	 * such an entry holds: not freed. */
	for (rw_svc_held_t *h = s->held, *nx; h; h = nx) {
		nx = h->next;
		if ((h->f[0].devs & abandoned) || (h->f[1].devs & stage_abandoned)) {
			rw_warn("stage: %zu bytes of page-locked memory and %u device blocks left to a "
				"stalled GPU's queued work", h->host.size, h->n_blk);
			rw_svc_gpu_held(-(int64_t)h->host.size);
			free(h);
		} else {
			held_free(h);
		}
	}
	if (s->used && !s->keep_cuda) {
		/* A stalled GPU's queued copies and kernels (another stage's, the CUDA mover's, the
		 * header pull's) may still run: no module unloaded, no context released under them. */
		int stalled[1];
		if (stage_abandoned || rw_svc_gpu_stalled_list(stalled, 1, NULL))
			rw_warn("stage: CUDA left to the process's exit (modules, contexts): a stalled "
				"GPU's queued work may still run");
		else
			rw_cuda_shutdown(); /* after the IPC cache (rw_svc_ipc_stop) and the streams */
	}
	free(s);
}

void rw_svc_stage_watch(struct ev_loop *loop, struct ev_timer *w, int need)
{
	if (!need) {
		ev_timer_stop(loop, w);
		return;
	}
	if (ev_is_active(w))
		return;
	double every = (double)rw_svc_gpu_stall_ns() * 0.25e-9;
	every = every < 0.01 ? 0.01 : every > 1.0 ? 1.0 : every;
	ev_timer_set(w, every, every);
	ev_timer_start(loop, w);
}

int rw_svc_stage_rank_on(const uint64_t *devs, int device)
{
	for (int g = 0; g < RW_MAX_GPUS; g++)
		if (devs[g] >> device & 1)
			return g;
	return -1;
}

/* The stall bound's timer runs while some mark is outstanding or memory is held. */
static void watch_arm(rw_svc_stage_t *s)
{
	int need = s->held != NULL;
	for (int d = 0; d < STAGE_MAX_DEVICES && !need; d++)
		need = s->dev[d].stream && s->dev[d].landed < s->dev[d].made;
	if (!need)
		s->watch_last = 0;
	else if (!ev_is_active(&s->watch))
		s->watch_last = rw_now_ns();
	rw_svc_stage_watch(s->loop, &s->watch, need);
}

static void dev_poll(rw_svc_stage_t *s, stage_dev_t *d);

/* A tick later than twice its period means this loop did not run meanwhile (a stopped or starved
 * daemon): that time is not the GPUs' silence, so every outstanding wait starts later by it, as
 * the heartbeats forgive a late tick (service/mesh/mesh_session.c). */
static void watch_forgive(rw_svc_stage_t *s, uint64_t now)
{
	const uint64_t last = s->watch_last;
	const uint64_t period = (uint64_t)(s->watch.repeat * 1e9);
	s->watch_last = now;
	if (!last || now - last <= 2 * period)
		return;
	const uint64_t late = now - last - period;
	rw_dbg("stage: stall watch %llu ms late (this loop did not run): not counted as the GPUs' "
	       "silence", (unsigned long long)(late / 1000000u));
	for (int i = 0; i < STAGE_MAX_DEVICES; i++) {
		stage_dev_t *d = &s->dev[i];
		if (d->stream && d->landed < d->made)
			d->moved_at = d->moved_at + late < now ? d->moved_at + late : now;
	}
}

static void watch_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_stage_t *s = w->data;
	const uint64_t now = rw_now_ns(), bound = rw_svc_gpu_stall_ns();
	watch_forgive(s, now);
	for (int i = 0; i < STAGE_MAX_DEVICES; i++) {
		stage_dev_t *d = &s->dev[i];
		if (!d->stream || d->stalled || d->landed >= d->made || now - d->moved_at < bound)
			continue;
		/* Marks that landed while the loop did not run are read before the verdict (libev
		 * runs this timer before the stream's pending io callback in one iteration). */
		dev_poll(s, d);
		if (!d->stream || d->landed >= d->made || d->moved_at >= now ||
		    now - d->moved_at < bound)
			continue;
		/* Its marks stopped: the pairs waiting on it fail now; its copies, if they ever land,
		 * land in memory still held (rw_svc_stage_retire). */
		d->stalled = 1;
		rw_svc_gpu_stall(i, d->moved_at);
		d->pending = 0;
		s->done(s->ctx, RW_SVC_STAGE_DEV(i), RW_ERR_TIMEOUT);
	}
	held_sweep(s); /* a fence on another stage lands unseen by this one's marks */
	watch_arm(s);
}

/* Every mark of d's stream that landed: reported, d's clock moved (a faulted stream: its pending
 * marks failed, the stream dropped). */
static void dev_poll(rw_svc_stage_t *s, stage_dev_t *d)
{
	const int device = (int)(d - s->dev);
	uint64_t tokens[STAGE_POLL_BATCH];
	for (;;) {
		if (!d->stream)
			break;
		int n = rw_cuda_stream_poll(d->stream, tokens, STAGE_POLL_BATCH);
		if (n < 0) {
			/* A faulted stream never completes its marks: report every pending one as
			 * failed, then drop the stream (the next use makes a new one). */
			rw_err("stage: CUDA stream of device %d failed: %s", device,
			       rw_status_str((rw_status_t)n));
			dev_close(s, d);
			held_sweep(s);
			s->done(s->ctx, RW_SVC_STAGE_ALL, (rw_status_t)n);
			break;
		}
		if (n > 0) {
			d->landed += (uint64_t)n;
			d->moved_at = rw_now_ns();
			dev_unstall(d, 1);
		}
		for (int i = 0; i < n; i++) {
			if (tokens[i] == STAGE_NO_TOKEN)
				continue;
			if (d->pending)
				d->pending--;
			s->done(s->ctx, tokens[i], RW_OK);
		}
		if (n < STAGE_POLL_BATCH)
			break;
	}
}

static void dev_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	stage_dev_t *d = w->data;
	dev_poll(d->st, d);
	held_sweep(d->st);
	watch_arm(d->st);
}

static rw_status_t dev_get(rw_svc_stage_t *s, int device, stage_dev_t **d_p)
{
	if (device < 0 || device >= STAGE_MAX_DEVICES)
		return RW_ERR_INVAL;
	if (rw_svc_gpu_stalled(device, NULL, 0))
		return RW_ERR_TIMEOUT;
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

/* Device `device`'s stream for work about to be enqueued (`work`: it counts as a copy, a later
 * mark covers it); with no work, only whether the device may be used. */
static rw_status_t dev_use(rw_svc_stage_t *s, int device, int work, rw_cuda_stream_t **cs_p)
{
	stage_dev_t *d;
	rw_status_t st = dev_get(s, device, &d);
	if (st == RW_OK && work) {
		d->dirty = 1;
		*cs_p = d->stream;
	}
	return st;
}

rw_status_t rw_svc_stage_d2h(rw_svc_stage_t *s, int device, void *dst, uint64_t src, size_t n)
{
	rw_cuda_stream_t *cs;
	rw_status_t st = dev_use(s, device, n != 0, &cs);
	return st != RW_OK || n == 0 ? st : rw_cuda_copy_dtoh_async(cs, dst, src, n);
}

rw_status_t rw_svc_stage_h2d(rw_svc_stage_t *s, int device, uint64_t dst, const void *src, size_t n)
{
	rw_cuda_stream_t *cs;
	rw_status_t st = dev_use(s, device, n != 0, &cs);
	return st != RW_OK || n == 0 ? st : rw_cuda_copy_htod_async(cs, dst, src, n);
}

rw_status_t rw_svc_stage_stream(rw_svc_stage_t *s, int device, struct rw_cuda_stream **s_p)
{
	return dev_use(s, device, 1, s_p);
}

void rw_svc_stage_keep_cuda(rw_svc_stage_t *s)
{
	s->keep_cuda = 1;
}

rw_status_t rw_svc_stage_wait_event(rw_svc_stage_t *s, int device, struct rw_cuda_event *ev)
{
	rw_cuda_stream_t *cs;
	rw_status_t st = dev_use(s, device, 1, &cs);
	return st != RW_OK ? st : rw_cuda_stream_wait_event(cs, ev);
}

static rw_status_t dev_mark(rw_svc_stage_t *s, stage_dev_t *d, uint64_t token)
{
	rw_status_t st = rw_cuda_stream_mark(d->stream, token);
	if (st != RW_OK)
		return st;
	if (d->landed == d->made)
		d->moved_at = rw_now_ns(); /* an idle stream's wait starts now */
	d->made++;
	d->dirty = 0;
	watch_arm(s);
	return RW_OK;
}

rw_status_t rw_svc_stage_mark(rw_svc_stage_t *s, int device, uint64_t token)
{
	stage_dev_t *d;
	rw_status_t st = dev_get(s, device, &d);
	if (st == RW_OK)
		st = dev_mark(s, d, token);
	if (st == RW_OK)
		d->pending++;
	return st;
}

int rw_svc_stage_fence(rw_svc_stage_t *s, uint64_t devs, rw_svc_stage_fence_t *f)
{
	memset(f, 0, sizeof(*f));
	f->stage = s;
	for (int d = 0; d < STAGE_MAX_DEVICES; d++) {
		stage_dev_t *sd = &s->dev[d];
		if (!(devs >> d & 1) || !dev_busy(sd))
			continue;
		/* Copies with no mark behind them (a pair that failed between a copy and its mark)
		 * get one of the stage's own, so their end is known; failing that, the next mark
		 * anyone makes on the stream comes after them. */
		f->until[d] = sd->made + (uint64_t)sd->dirty;
		if (sd->dirty && dev_mark(s, sd, STAGE_NO_TOKEN) == RW_OK)
			f->until[d] = sd->made;
		f->devs |= 1ull << d;
	}
	return f->devs != 0;
}

int rw_svc_stage_rank_fence(rw_svc_stage_t *s, const uint64_t *devs, int unsettled, uint32_t g,
			    rw_svc_stage_fence_t *f)
{
	return g < RW_MAX_GPUS && devs[g] && unsettled && rw_svc_stage_fence(s, devs[g], f);
}

int rw_svc_stage_fenced(const rw_svc_stage_fence_t *f, int *stalled_p)
{
	const rw_svc_stage_t *s = f->stage;
	int busy = 0;
	*stalled_p = -1;
	for (int d = 0; d < STAGE_MAX_DEVICES; d++) {
		const stage_dev_t *sd = &s->dev[d];
		if (!(f->devs >> d & 1) || !sd->stream || sd->landed >= f->until[d])
			continue; /* landed, or its stream faulted (a faulted context writes nothing) */
		busy = 1;
		if (sd->stalled && *stalled_p < 0)
			*stalled_p = d;
	}
	return !busy;
}

size_t rw_svc_stage_retire(rw_svc_stage_t *s, uint64_t devs, rw_svc_pinned_t *const *bufs,
			   unsigned n)
{
	rw_svc_stage_fence_t f;
	const uint64_t busy = rw_svc_stage_fence(s, devs, &f) ? f.devs : 0;
	size_t taken = 0;
	for (unsigned i = 0; busy && i < n; i++) {
		if (!bufs[i] || !bufs[i]->ptr)
			continue;
		rw_svc_held_t *h = calloc(1, sizeof(*h));
		if (!h) { /* cannot track it: never freed rather than freed under a copy */
			rw_err("stage: out of memory tracking %zu bytes of staging a GPU may still "
			       "write: left allocated", bufs[i]->size);
			bufs[i]->ptr = NULL;
			bufs[i]->size = 0;
			continue;
		}
		h->host = *bufs[i];
		h->f[0] = f;
		taken += h->host.size;
		rw_svc_stage_hold(s, h);
		bufs[i]->ptr = NULL;
		bufs[i]->size = 0;
	}
	return taken;
}

void rw_svc_stage_hold(rw_svc_stage_t *s, rw_svc_held_t *h)
{
	rw_svc_gpu_held((int64_t)h->host.size);
	h->next = s->held;
	s->held = h;
	watch_arm(s);
}

void rw_svc_stage_sweep(rw_svc_stage_t *s)
{
	held_sweep(s);
	watch_arm(s);
}

int rw_svc_stage_holds(const rw_svc_stage_t *s, uint32_t serial)
{
	for (const rw_svc_held_t *h = s->held; h; h = h->next)
		if (h->tagged && h->serial == serial)
			return 1;
	return 0;
}

void rw_svc_stage_retire_pair(rw_svc_stage_t *s, const rw_svc_phase_t *ph, uint64_t *devs,
			      int unsettled)
{
	for (uint32_t g = 0; g < ph->gpus && g < RW_MAX_GPUS; g++) {
		rw_svc_pinned_t *bufs[2] = { ph->stage_in[g], ph->stage_out[g] };
		if (devs[g] && unsettled)
			rw_svc_stage_retire(s, devs[g], bufs, 2);
		devs[g] = 0;
	}
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
	/* A blocking driver copy: never on a stalled GPU, where it would hold the loop. */
	if (rw_svc_gpu_stalled(io->flag_dev, NULL, 0)) {
		rw_warn("GPU %d is stalled: a completion flag not written", io->flag_dev);
		return RW_ERR_TIMEOUT;
	}
	rw_status_t st = rw_cuda_write_u32(io->flag_dev, io->flag_dptr, io->flag_value);
	if (st != RW_OK)
		rw_warn("cannot write a completion flag on GPU %d: %s", io->flag_dev,
			rw_status_str(st));
	return st;
}
