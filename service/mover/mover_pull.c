/* The header pull (service/mover/mover.h "pulls"; docs/rankpath.md "The slab areas, lent per
 * group"): where a group's carve-out is GPU memory, the daemon reads the records' headers a check
 * needs out of it by copies into the carve-out's page-locked host shadow, at the same offsets,
 * and the check reads the shadow. The copies go on a stream of the daemon's per device
 * (cuda/pull.c: cuMemcpy2DAsync, a record's header and top-k block without its row), each batch
 * followed by a mark that is a word the stream writes; while a mark is outstanding an ev_idle
 * watcher polls the words from the loop (the loop does not sleep then: a pull is a few
 * microseconds of copies), and reports each batch once every device's mark of it landed, or a
 * copy faulted (asked of the driver at most once a millisecond). No host function, no kernel,
 * no eventfd. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"

#define PULL_DEVS 16
#define FAULT_EVERY_NS 1000000ull

typedef struct pull_batch {
	uint64_t token;
	uint64_t need[PULL_DEVS]; /* the mark of each device it waits for; 0: none */
} pull_batch_t;

struct rw_svc_pull {
	struct ev_loop *loop;
	rw_svc_pull_fn fn;
	void *ctx;
	rw_cuda_pull_t *dev[PULL_DEVS];
	uint32_t dirty;           /* devices with copies since their last mark */
	pull_batch_t *q;          /* batches not reported yet */
	uint32_t n, cap;
	uint64_t fault_at;        /* when the streams were last asked for a fault */
	ev_idle idle;
};

static void idle_cb(struct ev_loop *loop, ev_idle *w, int revents);

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
	*pull_p = p;
	return RW_OK;
}

void rw_svc_pull_destroy(rw_svc_pull_t *p)
{
	if (!p)
		return;
	ev_idle_stop(p->loop, &p->idle);
	for (int d = 0; d < PULL_DEVS; d++)
		rw_cuda_pull_destroy(p->dev[d]); /* waits for its copies */
	free(p->q);
	free(p);
}

/* Device d's stream given up (it faulted, or a mark could not be made): it waits for its copies
 * as it goes, and every batch still waiting on it fails; the next pull makes a new one. */
static void drop_dev(rw_svc_pull_t *p, int d)
{
	rw_cuda_pull_destroy(p->dev[d]);
	p->dev[d] = NULL;
	p->dirty &= ~(1u << d);
	for (uint32_t i = 0; i < p->n; i++)
		if (p->q[i].need[d])
			p->q[i].need[d] = UINT64_MAX;
	if (p->n)
		ev_idle_start(p->loop, &p->idle);
}

void rw_svc_pull_sync(rw_svc_pull_t *p)
{
	for (int d = 0; d < PULL_DEVS; d++) {
		uint64_t m = 0;
		if (!p->dev[d])
			continue;
		rw_status_t st = rw_cuda_pull_mark(p->dev[d], &m);
		while (st == RW_OK && rw_cuda_pull_landed(p->dev[d]) < m) {
			st = rw_cuda_pull_fault(p->dev[d]);
			const struct timespec ts = { 0, 20000 };
			nanosleep(&ts, NULL);
		}
		if (st != RW_OK)
			drop_dev(p, d);
		else
			p->dirty &= ~(1u << d);
	}
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
	if (!p->dev[dev] && (st = rw_cuda_pull_create(dev, &p->dev[dev])) != RW_OK) {
		p->dev[dev] = NULL;
		snprintf(why, RW_SVC_WHY_MAX, "rail %u: no stream on GPU %d to pull the records' "
			 "headers with (%s)", rail, dev, rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	st = rw_cuda_pull_rows(p->dev[dev], ph->slab_shadow[rail] + off, pitch,
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
		rw_status_t st = rw_cuda_pull_mark(p->dev[d], &b->need[d]);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "the header pull's mark on GPU %d failed: "
				 "cuStreamWriteValue64: %s", d, rw_status_str(st));
			drop_dev(p, d);
			return RW_ERR_DEVICE;
		}
		p->dirty &= ~(1u << d);
	}
	p->n++;
	ev_idle_start(p->loop, &p->idle);
	return RW_OK;
}

/* Batch i's answer: RW_OK landed, RW_ERR_AGAIN not yet, else the copies failed. */
static rw_status_t batch_state(rw_svc_pull_t *p, const pull_batch_t *b, int ask)
{
	rw_status_t res = RW_OK;
	for (int d = 0; d < PULL_DEVS; d++) {
		if (!b->need[d])
			continue;
		if (b->need[d] == UINT64_MAX || !p->dev[d])
			return RW_ERR_DEVICE; /* its stream was given up (drop_dev) */
		if (rw_cuda_pull_landed(p->dev[d]) >= b->need[d])
			continue;
		if (ask && rw_cuda_pull_fault(p->dev[d]) != RW_OK) {
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
	if (ask)
		p->fault_at = now;
	for (uint32_t i = 0; i < p->n;) {
		rw_status_t st = batch_state(p, &p->q[i], ask);
		if (st == RW_ERR_AGAIN) {
			i++;
			continue;
		}
		const uint64_t token = p->q[i].token;
		memmove(&p->q[i], &p->q[i + 1], (p->n - i - 1) * sizeof(*p->q));
		p->n--;
		if (st != RW_OK)
			rw_err("header pull: a copy out of a group's GPU slab failed (%s): its pair "
			       "fails", rw_status_str(st));
		p->fn(p->ctx, token, st); /* may pull and mark again: the queue only grows */
	}
	if (!p->n)
		ev_idle_stop(loop, w);
}
