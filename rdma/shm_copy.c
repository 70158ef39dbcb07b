/* The `shm` rail transport's data path: a device's copier threads (a rail, like one NIC with
 * several DMA engines) copy the bytes of posted writes into the peers' regions. Work is handed
 * out in chunks, connection by connection in turn, so several copiers can work on one write
 * (or on consecutive writes of one connection) at once; a write is published in the
 * connection's outbox only when all its chunks are in and every earlier write of the
 * connection was published (the release half of pair (1), rdma/shm_priv.h), and the target's
 * doorbell rings if it asked.
 *
 * Pacing (pace_bps) is one token bucket in bytes per device, under the device's mutex: a
 * copier takes a chunk only while the bucket is not negative and charges it in full, so the
 * copiers together move at the chosen NIC speed; the bucket refills at the rate and holds at
 * most pace_burst (an idle rail saves up little) (docs/rdma.md "The shm transport"). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>

#include "rdma/shm_priv.h"

/* Bytes handed out per chunk: a connection waits at most this long behind another one's write,
 * and shm_copy_detach waits for at most one such copy per copier. Paced: smaller, so a turn
 * is a few µs at NIC speed. */
#define SHM_CHUNK (1u << 20)
#define SHM_PACE_CHUNK (256u << 10)
#define SHM_THREAD_STACK (256u << 10)
/* A write this small is copied by the loop that posts it (shm_copy_kick), when nothing else of
 * its connection is queued or being copied: a few µs of memcpy instead of waking a copier and
 * waiting for it to be scheduled (the 1-token phase's writes; docs/perf/shm.md "The 1-token
 * floor"). */
#define SHM_INLINE_MAX (64u << 10)

void shm_copy_stats_sync(shm_dev_t *dev)
{
	dev->base.stats.tx_bytes = atomic_load(&dev->tx_bytes);
	dev->base.stats.pace_waits = atomic_load(&dev->pace_waits);
}

/* Put c on the work list when it has bytes to hand out. Caller holds mu. */
static void work_push(shm_conn_t *c)
{
	shm_dev_t *dev = c->dev;
	if (c->on_work || c->detached || c->blocked || c->held || c->tx_issue == c->tx_posted)
		return;
	c->on_work = 1;
	c->work_next = NULL;
	if (dev->work_tail)
		dev->work_tail->work_next = c;
	else
		dev->work_head = c;
	dev->work_tail = c;
	if (dev->n_idle)
		pthread_cond_signal(&dev->work_cv);
}

static shm_conn_t *work_pop(shm_dev_t *dev)
{
	shm_conn_t *c = dev->work_head;
	if (c) {
		dev->work_head = c->work_next;
		if (!dev->work_head)
			dev->work_tail = NULL;
		c->on_work = 0;
		c->work_next = NULL;
	}
	return c;
}

static void work_unlink(shm_conn_t *c)
{
	shm_dev_t *dev = c->dev;
	if (!c->on_work)
		return;
	shm_conn_t **pp = &dev->work_head, *prev = NULL;
	while (*pp != c) {
		prev = *pp;
		pp = &(*pp)->work_next;
	}
	*pp = c->work_next;
	if (dev->work_tail == c)
		dev->work_tail = prev;
	c->on_work = 0;
}

void shm_copy_wait_idle(shm_conn_t *c)
{
	/* No new chunk of c meanwhile, so a busy connection cannot keep the loop waiting; the
	 * caller kicks it again (shm_copy_kick) once its change is made. */
	c->held++;
	work_unlink(c);
	while (c->busy)
		pthread_cond_wait(&c->dev->idle_cv, &c->dev->mu);
	c->held--;
}

void shm_copy_detach(shm_conn_t *c)
{
	pthread_mutex_lock(&c->dev->mu);
	c->detached = 1;
	shm_copy_wait_idle(c);
	pthread_mutex_unlock(&c->dev->mu);
}

/* ---- pacing (under mu) ------------------------------------------------------------------- */

static void pace_refill(shm_dev_t *dev)
{
	uint64_t now = rw_now_ns();
	dev->pace_tokens += (double)(now - dev->pace_last_ns) * 1e-9 * dev->pace_Bps;
	if (dev->pace_tokens > dev->pace_burst)
		dev->pace_tokens = dev->pace_burst;
	dev->pace_last_ns = now;
}

/* An unpaced device, or a bucket not in debt: charge n bytes and say yes (else no charge). */
static int pace_charge(shm_dev_t *dev, uint64_t n)
{
	if (dev->pace_Bps <= 0)
		return 1;
	pace_refill(dev);
	if (dev->pace_tokens < 0)
		return 0;
	dev->pace_tokens -= (double)n;
	return 1;
}

/* The bucket is in debt: sleep (without mu) until it is paid back, or a stop. */
static void pace_wait(shm_dev_t *dev)
{
	uint64_t ns = (uint64_t)(-dev->pace_tokens / dev->pace_Bps * 1e9) + 1;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	ns += (uint64_t)ts.tv_nsec;
	ts.tv_sec += (time_t)(ns / 1000000000u);
	ts.tv_nsec = (long)(ns % 1000000000u);
	atomic_fetch_add(&dev->pace_waits, 1);
	pthread_cond_timedwait(&dev->pace_cv, &dev->mu, &ts);
}

/* ---- the copiers ----------------------------------------------------------------------------- */

/* Publish c's writes whose bytes are all in, in posting order; returns 1 when the target asked
 * for a doorbell. Caller holds mu; c is not detached (its outbox is mapped). */
static int publish(shm_conn_t *c)
{
	uint64_t from = c->tx_copied;
	while (c->tx_copied < c->tx_issue) {
		const shm_tx_t *t = &c->tx[c->tx_copied & c->out_mask];
		if (t->done != t->length)
			break;
		c->out->entries[c->tx_copied & c->out_mask] = (shm_entry_t){
			.key = t->key, .offset = t->remote_offset, .length = t->length, .imm = t->imm};
		c->tx_copied++;
	}
	if (c->tx_copied == from)
		return 0;
	/* Pair (1), release: the bytes and the entries before tail. */
	atomic_store_explicit(&c->out->tail, c->tx_copied, memory_order_release);
	atomic_thread_fence(memory_order_seq_cst); /* tail before rx_armed (doorbell pair) */
	return atomic_exchange(&c->out->rx_armed, 0) != 0;
}

/* A chunk handed out: where to copy what. */
typedef struct chunk {
	shm_conn_t *c;
	shm_tx_t *t;
	uint8_t *dst;       /* NULL: no copy (an empty write, or a region the target dropped) */
	const uint8_t *src;
	uint64_t n;
} chunk_t;

/* Hand out c's next chunk (c popped off the work list; it goes back if more is left), or
 * return 0 when its next write waits for the region's fd. Caller holds mu. */
static int chunk_take(shm_conn_t *c, uint64_t max, chunk_t *k)
{
	shm_tx_t *t = &c->tx[c->tx_issue & c->out_mask];
	const shm_map_t *m = t->length ? shm_map_find(c, t->key) : NULL;
	if (m && m->state == SHM_MAP_ASKED) {
		c->blocked = 1; /* the loop kicks it again when KEY or NO_KEY comes */
		return 0;
	}
	const uint64_t off = c->issue_off;
	*k = (chunk_t){.c = c, .t = t, .n = RW_MIN(max, t->length - off),
		       .src = (const uint8_t *)t->local->addr + t->local_offset + off};
	if (m && m->state == SHM_MAP_READY &&
	    rw_rail_range_check(m->length, t->remote_offset, t->length) == RW_OK)
		k->dst = m->addr + t->remote_offset + off;
	/* else: the target has no such region (any more); the entry goes out without a copy
	 * and the target refuses it (RW_ERR_PROTO on its side, as on tcp). */
	c->issue_off += k->n;
	if (c->issue_off == t->length) {
		c->tx_issue++;
		c->issue_off = 0;
	}
	c->busy++;
	work_push(c);
	return 1;
}

/* The chunk is in: publish what is complete, ring, and let a detach go on. Caller holds mu. */
static void chunk_done(shm_dev_t *dev, const chunk_t *k)
{
	shm_conn_t *c = k->c;
	k->t->done += k->n;
	if (!c->detached && publish(c)) {
		uint8_t raw[SHM_MSG_SIZE];
		shm_msg_encode(&(shm_msg_t){.type = SHM_TAIL}, raw);
		pthread_mutex_unlock(&dev->mu);
		/* Non-blocking: a full socket means the target has unread messages and will look at
		 * tail after reading them; a dead one is the loop's to find. c->busy keeps the
		 * socket open meanwhile. */
		send(c->fd, raw, sizeof(raw), MSG_DONTWAIT | MSG_NOSIGNAL);
		pthread_mutex_lock(&dev->mu);
	}
	if (--c->busy == 0)
		pthread_cond_broadcast(&dev->idle_cv);
}

/* Copy a chunk handed out (mu released meanwhile), then chunk_done. Caller holds mu. */
static void chunk_copy(shm_dev_t *dev, const chunk_t *k)
{
	pthread_mutex_unlock(&dev->mu);
	if (k->dst && k->n)
		memcpy(k->dst, k->src, k->n);
	atomic_fetch_add(&dev->tx_bytes, k->n);
	pthread_mutex_lock(&dev->mu);
	chunk_done(dev, k);
}

/* c's one queued write is small and nothing of c is on the work list or being copied (so it
 * publishes as soon as it is in), nor held back. Caller holds mu. */
static int inline_ok(const shm_conn_t *c)
{
	if (c->on_work || c->busy || c->detached || c->blocked || c->held ||
	    c->tx_issue + 1 != c->tx_posted || c->issue_off || c->tx_copied != c->tx_issue)
		return 0;
	return c->tx[c->tx_issue & c->out_mask].length <= SHM_INLINE_MAX;
}

void shm_copy_kick(shm_conn_t *c)
{
	shm_dev_t *dev = c->dev;
	chunk_t k;
	pthread_mutex_lock(&dev->mu);
	if (inline_ok(c) && pace_charge(dev, c->tx[c->tx_issue & c->out_mask].length) &&
	    chunk_take(c, SHM_INLINE_MAX, &k)) {
		chunk_copy(dev, &k); /* the loop is this chunk's copier */
	}
	work_push(c);
	pthread_mutex_unlock(&dev->mu);
}

static void *copier_main(void *arg)
{
	shm_dev_t *dev = arg;
	const int paced = dev->pace_Bps > 0;
	const uint64_t max = paced ? SHM_PACE_CHUNK : SHM_CHUNK;
	prctl(PR_SET_TIMERSLACK, 1000UL); /* pacing waits of a few µs */
	pthread_mutex_lock(&dev->mu);
	while (!dev->stop) {
		if (!dev->work_head) {
			dev->n_idle++;
			pthread_cond_wait(&dev->work_cv, &dev->mu);
			dev->n_idle--;
			continue;
		}
		if (paced) {
			pace_refill(dev);
			if (dev->pace_tokens < 0) {
				pace_wait(dev);
				continue;
			}
		}
		chunk_t k;
		if (!chunk_take(work_pop(dev), max, &k))
			continue;
		if (paced)
			dev->pace_tokens -= (double)k.n;
		chunk_copy(dev, &k);
	}
	pthread_mutex_unlock(&dev->mu);
	return NULL;
}

rw_status_t shm_copy_start(shm_dev_t *dev, unsigned n)
{
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, SHM_THREAD_STACK);
	int rc = 0;
	for (dev->n_copiers = 0; dev->n_copiers < n && rc == 0; dev->n_copiers++) {
		rc = pthread_create(&dev->copiers[dev->n_copiers], &attr, copier_main, dev);
		if (rc != 0)
			break;
	}
	pthread_attr_destroy(&attr);
	if (rc != 0) {
		shm_copy_stop(dev);
		errno = rc;
		rw_err("rail %u: cannot start the shm copier threads: %m", dev->base.rail);
		return rc == EAGAIN ? RW_ERR_NOMEM : RW_ERR_SYS;
	}
	return RW_OK;
}

void shm_copy_stop(shm_dev_t *dev)
{
	pthread_mutex_lock(&dev->mu);
	dev->stop = 1;
	pthread_cond_broadcast(&dev->work_cv);
	pthread_cond_broadcast(&dev->pace_cv);
	pthread_mutex_unlock(&dev->mu);
	for (unsigned i = 0; i < dev->n_copiers; i++)
		pthread_join(dev->copiers[i], NULL);
	dev->n_copiers = 0;
}
