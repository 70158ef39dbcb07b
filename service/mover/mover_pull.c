/* The header pull (service/mover/mover.h "pulls"; docs/rankpath.md "The slab areas, lent per
 * group"): where a group's carve-out is GPU memory, the daemon reads the records' headers a check
 * needs out of it by copies into the carve-out's page-locked host shadow, at the same offsets,
 * and the check reads the shadow. The copies go on a stream of the daemon's per device
 * (cuda/pull.c: cuMemcpy2DAsync, a record's header and top-k block without its row), each batch
 * followed by a mark that is a word the stream writes; while a mark is outstanding an ev_idle
 * watcher polls the words from the loop (the loop does not sleep then: a pull is a few
 * microseconds of copies), and reports each batch once every device's mark of it landed, or a
 * copy faulted (asked of the driver at most once a millisecond). No host function, no kernel,
 * no eventfd.
 * A hung GPU (docs/rankpath.md "A hung GPU"): a device whose marks have not advanced for the
 * stall bound is stalled (rw_svc_gpu_stall): the batches waiting on it fail at once
 * (RW_ERR_TIMEOUT), new pulls from it are refused, named, and a slower timer watches its word
 * until it lands again. Its stream is kept, never replaced: a pair that ended (forget) leaves its
 * copies queued, and each later pull of the same carve-out goes on the same stream behind them,
 * so no late copy lands in a shadow after a later pull's mark — the shadow a check reads is
 * always its own pull's. Nothing here waits, except destroy for a device that is not stalled. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"

#define PULL_DEVS 16
#define FAULT_EVERY_NS 1000000ull
#define NEED_GONE UINT64_MAX           /* the device's stream was given up: the batch failed */
#define NEED_STALLED (UINT64_MAX - 1)  /* the device stalled: the batch failed */

typedef struct pull_batch {
	uint64_t token;
	uint64_t need[PULL_DEVS]; /* the mark of each device it waits for; 0: none */
} pull_batch_t;

typedef struct pull_dev {
	rw_cuda_pull_t *cp;       /* NULL until first used (or after it faulted) */
	uint64_t made;            /* its last mark */
	uint64_t seen;            /* its word when last looked at */
	uint64_t moved_at;        /* when the word last moved, or the first mark of an idle stream */
	int stalled;
} pull_dev_t;

struct rw_svc_pull {
	struct ev_loop *loop;
	rw_svc_pull_fn fn;
	void *ctx;
	pull_dev_t dev[PULL_DEVS];
	uint32_t dirty;           /* devices with copies since their last mark */
	pull_batch_t *q;          /* batches not reported yet */
	uint32_t n, cap;
	uint64_t fault_at;        /* when the streams were last asked for a fault */
	ev_idle idle;
	ev_timer watch;           /* while a mark is outstanding: the stall bound, a stall's end */
};

static void idle_cb(struct ev_loop *loop, ev_idle *w, int revents);
static void watch_cb(struct ev_loop *loop, ev_timer *w, int revents);

rw_status_t rw_svc_pull_create(struct ev_loop *loop, rw_svc_pull_fn fn, void *ctx,
			       rw_svc_pull_t **pull_p)
{
	rw_svc_pull_t *p = calloc(1, sizeof(*p));
	if (!p)
		return RW_ERR_NOMEM;
	p->loop = loop;
	p->fn = fn;
	p->ctx = ctx;
	ev_idle_init(&p->idle, idle_cb);
	p->idle.data = p;
	ev_init(&p->watch, watch_cb);
	p->watch.data = p;
	*pull_p = p;
	return RW_OK;
}

static int dev_busy(const pull_dev_t *pd)
{
	return pd->cp && rw_cuda_pull_landed(pd->cp) < pd->made;
}

void rw_svc_pull_destroy(rw_svc_pull_t *p)
{
	if (!p)
		return;
	ev_idle_stop(p->loop, &p->idle);
	ev_timer_stop(p->loop, &p->watch);
	for (int d = 0; d < PULL_DEVS; d++) {
		pull_dev_t *pd = &p->dev[d];
		if (pd->stalled && dev_busy(pd)) {
			rw_warn("header pull: GPU %d's stream abandoned with its copies queued", d);
			rw_cuda_pull_abandon(pd->cp);
		} else {
			rw_cuda_pull_destroy(pd->cp); /* waits for its copies */
		}
		if (pd->stalled)
			rw_svc_gpu_moved(d, 0);
	}
	free(p->q);
	free(p);
}

/* Device d's stream given up (it faulted, or a mark could not be made): it waits for its copies
 * as it goes (a faulted stream runs none), and every batch still waiting on it fails; the next
 * pull makes a new one. */
static void drop_dev(rw_svc_pull_t *p, int d)
{
	pull_dev_t *pd = &p->dev[d];
	rw_cuda_pull_destroy(pd->cp);
	if (pd->stalled)
		rw_svc_gpu_moved(d, 0);
	memset(pd, 0, sizeof(*pd));
	p->dirty &= ~(1u << d);
	for (uint32_t i = 0; i < p->n; i++)
		if (p->q[i].need[d])
			p->q[i].need[d] = NEED_GONE;
	if (p->n)
		ev_idle_start(p->loop, &p->idle);
}

/* Device d's word looked at: moved (and no longer stalled), or stalled now (every batch waiting
 * on it fails). */
static void dev_watch(rw_svc_pull_t *p, int d, uint64_t now)
{
	pull_dev_t *pd = &p->dev[d];
	if (!pd->cp)
		return;
	const uint64_t landed = rw_cuda_pull_landed(pd->cp);
	if (landed != pd->seen) {
		pd->seen = landed;
		pd->moved_at = now;
		if (pd->stalled) {
			pd->stalled = 0;
			rw_svc_gpu_moved(d, 1);
		}
	}
	if (pd->stalled || landed >= pd->made || now - pd->moved_at < rw_svc_gpu_stall_ns())
		return;
	pd->stalled = 1;
	rw_svc_gpu_stall(d, pd->moved_at);
	for (uint32_t i = 0; i < p->n; i++)
		if (p->q[i].need[d] && p->q[i].need[d] < NEED_STALLED)
			p->q[i].need[d] = NEED_STALLED;
	if (p->n)
		ev_idle_start(p->loop, &p->idle);
}

/* The slow watch runs while a device has a mark outstanding (a batch's, or a forgotten one's). */
static void watch_arm(rw_svc_pull_t *p)
{
	int need = 0;
	for (int d = 0; d < PULL_DEVS && !need; d++)
		need = dev_busy(&p->dev[d]);
	rw_svc_stage_watch(p->loop, &p->watch, need);
}

static void watch_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	rw_svc_pull_t *p = w->data;
	const uint64_t now = rw_now_ns();
	for (int d = 0; d < PULL_DEVS; d++)
		dev_watch(p, d, now);
	watch_arm(p);
}

void rw_svc_pull_forget(rw_svc_pull_t *p, uint32_t serial)
{
	for (int d = 0; d < PULL_DEVS; d++) { /* copies with no mark yet: one, so they are watched */
		pull_dev_t *pd = &p->dev[d];
		uint64_t m;
		if (!(p->dirty & (1u << d)))
			continue;
		const int idle = rw_cuda_pull_landed(pd->cp) >= pd->made;
		if (rw_cuda_pull_mark(pd->cp, &m) == RW_OK) {
			pd->moved_at = idle ? rw_now_ns() : pd->moved_at;
			pd->made = m;
			p->dirty &= ~(1u << d);
		}
	}
	uint32_t k = 0;
	for (uint32_t i = 0; i < p->n; i++)
		if ((uint32_t)(p->q[i].token >> 32) != serial)
			p->q[k++] = p->q[i];
	p->n = k;
	if (!p->n)
		ev_idle_stop(p->loop, &p->idle);
	watch_arm(p); /* its copies' marks are still watched */
}

int rw_svc_pull_settled(const rw_svc_pull_t *p, const rw_svc_phase_t *ph)
{
	for (uint32_t r = 0; r < ph->rails; r++) {
		const int d = ph->slab_gpu[r];
		if (ph->slab_shadow[r] && d >= 0 && d < PULL_DEVS &&
		    (dev_busy(&p->dev[d]) || (p->dirty & (1u << d))))
			return 0;
	}
	return 1;
}

rw_status_t rw_svc_pull_rows(rw_svc_pull_t *p, const rw_svc_phase_t *ph, uint32_t rail,
			     uint64_t off, uint64_t pitch, uint64_t width, uint32_t rows, char *why)
{
	if (!rows)
		return RW_OK;
	const int dev = ph->slab_gpu[rail];
	rw_status_t st = RW_OK;
	if (dev < 0 || dev >= PULL_DEVS || !ph->slab_shadow[rail] ||
	    off + (uint64_t)(rows - 1) * pitch + width > ph->slab_bytes) {
		snprintf(why, RW_SVC_WHY_MAX, "rail %u: a header pull of %u records at byte %llu lies "
			 "outside the group's GPU slab", rail, rows, (unsigned long long)off);
		return RW_ERR_INVAL;
	}
	if (rw_svc_gpu_stalled(dev, why, RW_SVC_WHY_MAX))
		return RW_ERR_DEVICE; /* named: refused until it moves again */
	if (!p->dev[dev].cp && (st = rw_cuda_pull_create(dev, &p->dev[dev].cp)) != RW_OK) {
		p->dev[dev].cp = NULL;
		snprintf(why, RW_SVC_WHY_MAX, "rail %u: no stream on GPU %d to pull the records' "
			 "headers with (%s)", rail, dev, rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	st = rw_cuda_pull_rows(p->dev[dev].cp, ph->slab_shadow[rail] + off, pitch,
			       (rw_cuda_dptr_t)(uintptr_t)(ph->slab[rail] + off), pitch, width, rows);
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "rail %u: pulling %u records' headers from GPU %d "
			 "failed: cuMemcpy2DAsync: %s", rail, rows, dev, rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	p->dirty |= 1u << dev;
	return RW_OK;
}

rw_status_t rw_svc_pull_mark(rw_svc_pull_t *p, uint64_t token, char *why)
{
	if (p->n == p->cap) {
		uint32_t cap = p->cap ? 2 * p->cap : 16;
		pull_batch_t *q = realloc(p->q, cap * sizeof(*q));
		if (!q) {
			snprintf(why, RW_SVC_WHY_MAX, "out of memory for a header pull");
			return RW_ERR_NOMEM;
		}
		p->q = q;
		p->cap = cap;
	}
	pull_batch_t *b = &p->q[p->n];
	memset(b, 0, sizeof(*b));
	b->token = token;
	for (int d = 0; d < PULL_DEVS; d++) {
		if (!(p->dirty & (1u << d)))
			continue;
		pull_dev_t *pd = &p->dev[d];
		const int idle = rw_cuda_pull_landed(pd->cp) >= pd->made;
		rw_status_t st = rw_cuda_pull_mark(pd->cp, &b->need[d]);
		if (st == RW_OK) {
			if (idle)
				pd->moved_at = rw_now_ns(); /* an idle stream's wait starts now */
			pd->made = b->need[d];
		} else {
			snprintf(why, RW_SVC_WHY_MAX, "the header pull's mark on GPU %d failed: "
				 "cuStreamWriteValue64: %s", d, rw_status_str(st));
			drop_dev(p, d);
			return RW_ERR_DEVICE;
		}
		p->dirty &= ~(1u << d);
	}
	p->n++;
	ev_idle_start(p->loop, &p->idle);
	watch_arm(p);
	return RW_OK;
}

/* Batch i's answer: RW_OK landed, RW_ERR_AGAIN not yet, RW_ERR_TIMEOUT its device stalled, else
 * the copies failed. */
static rw_status_t batch_state(rw_svc_pull_t *p, const pull_batch_t *b, int ask)
{
	rw_status_t res = RW_OK;
	for (int d = 0; d < PULL_DEVS; d++) {
		if (!b->need[d])
			continue;
		if (b->need[d] == NEED_STALLED)
			return RW_ERR_TIMEOUT;
		if (b->need[d] == NEED_GONE || !p->dev[d].cp)
			return RW_ERR_DEVICE; /* its stream was given up (drop_dev) */
		if (rw_cuda_pull_landed(p->dev[d].cp) >= b->need[d])
			continue;
		if (ask && rw_cuda_pull_fault(p->dev[d].cp) != RW_OK) {
			drop_dev(p, d);
			return RW_ERR_DEVICE;
		}
		res = RW_ERR_AGAIN;
	}
	return res;
}

static void idle_cb(struct ev_loop *loop, ev_idle *w, int revents)
{
	(void)revents;
	rw_svc_pull_t *p = w->data;
	const uint64_t now = rw_now_ns();
	const int ask = now - p->fault_at >= FAULT_EVERY_NS;
	if (ask) {
		p->fault_at = now;
		for (int d = 0; d < PULL_DEVS; d++)
			dev_watch(p, d, now);
	}
	for (uint32_t i = 0; i < p->n;) {
		rw_status_t st = batch_state(p, &p->q[i], ask);
		if (st == RW_ERR_AGAIN) {
			i++;
			continue;
		}
		const uint64_t token = p->q[i].token;
		memmove(&p->q[i], &p->q[i + 1], (p->n - i - 1) * sizeof(*p->q));
		p->n--;
		if (st != RW_OK && st != RW_ERR_TIMEOUT) /* a stall is logged once, by the table */
			rw_err("header pull: a copy out of a group's GPU slab failed (%s): its pair "
			       "fails", rw_status_str(st));
		p->fn(p->ctx, token, st); /* may pull and mark again: the queue only grows */
	}
	if (!p->n)
		ev_idle_stop(loop, w);
	watch_arm(p);
}
