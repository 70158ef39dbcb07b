/* The `shm` rail transport's data path: one copier thread per device (a rail, like one NIC)
 * copies the bytes of posted writes into the peers' regions, chunk by chunk and connection by
 * connection in turn, then publishes each whole write in the connection's outbox (the release
 * half of pair (1), rdma/shm_priv.h) and rings the target's doorbell if it asked.
 *
 * Pacing (pace_bps) is a token bucket in bytes in this thread: a chunk is copied once the
 * bucket holds it; the bucket refills at the rate and holds at most pace_burst (an idle rail
 * saves up little), so a busy rail moves at the chosen NIC speed (docs/rdma.md "Rate pacing"). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>

#include "rdma/shm_priv.h"

/* Bytes copied per turn: a connection waits at most this long behind another one's write, and
 * shm_copy_detach waits for at most one such copy. Paced: smaller, so a turn is a few µs. */
#define SHM_CHUNK (1u << 20)
#define SHM_PACE_CHUNK (256u << 10)
#define SHM_THREAD_STACK (256u << 10)

void shm_copy_stats_sync(shm_dev_t *dev)
{
	dev->base.stats.tx_bytes = atomic_load(&dev->tx_bytes);
	dev->base.stats.pace_waits = atomic_load(&dev->pace_waits);
}

/* Caller holds mu. */
static void work_push(shm_conn_t *c)
{
	shm_dev_t *dev = c->dev;
	if (c->on_work || c->detached || c->blocked || c->tx_copied == c->tx_posted)
		return;
	c->on_work = 1;
	c->work_next = NULL;
	if (dev->work_tail)
		dev->work_tail->work_next = c;
	else
		dev->work_head = c;
	dev->work_tail = c;
	if (dev->copier_idle)
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

void shm_copy_kick(shm_conn_t *c)
{
	pthread_mutex_lock(&c->dev->mu);
	work_push(c);
	pthread_mutex_unlock(&c->dev->mu);
}

void shm_copy_wait_idle(shm_conn_t *c)
{
	while (c->dev->busy == c)
		pthread_cond_wait(&c->dev->idle_cv, &c->dev->mu);
}

void shm_copy_detach(shm_conn_t *c)
{
	pthread_mutex_lock(&c->dev->mu);
	c->detached = 1;
	work_unlink(c);
	shm_copy_wait_idle(c);
	pthread_mutex_unlock(&c->dev->mu);
}

/* ---- pacing ----------------------------------------------------------------------------- */

static void pace_refill(shm_dev_t *dev)
{
	uint64_t now = rw_now_ns();
	dev->pace_tokens += (double)(now - dev->pace_last_ns) * 1e-9 * dev->pace_Bps;
	if (dev->pace_tokens > dev->pace_burst)
		dev->pace_tokens = dev->pace_burst;
	dev->pace_last_ns = now;
}

/* Wait until the bucket holds `want` bytes (want <= pace_burst). Sleeps without mu; a stop
 * ends the wait at the next wake-up (at most one chunk's time at the rate). */
static void pace_wait(shm_dev_t *dev, uint64_t want)
{
	int waited = 0;
	for (;;) {
		pace_refill(dev);
		if (dev->pace_tokens >= (double)want || dev->stop)
			break;
		waited = 1;
		uint64_t ns = (uint64_t)(((double)want - dev->pace_tokens) / dev->pace_Bps * 1e9) + 1;
		struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u),
				      .tv_nsec = (long)(ns % 1000000000u)};
		while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
			;
	}
	if (waited)
		atomic_fetch_add(&dev->pace_waits, 1);
}

/* ---- the copier ----------------------------------------------------------------------------- */

/* Publish the connection's next write (its bytes are in place); returns 1 when the target
 * asked for a doorbell. Caller holds mu. */
static int publish(shm_conn_t *c, const shm_tx_t *t)
{
	shm_entry_t *e = &c->out->entries[c->tx_copied & c->out_mask];
	*e = (shm_entry_t){.key = t->key, .offset = t->remote_offset, .length = t->length,
			   .imm = t->imm};
	c->tx_copied++;
	/* Pair (1), release: the bytes and the entry before tail. */
	atomic_store_explicit(&c->out->tail, c->tx_copied, memory_order_release);
	atomic_thread_fence(memory_order_seq_cst); /* tail before rx_armed (doorbell pair) */
	return atomic_exchange(&c->out->rx_armed, 0) != 0;
}

static void *copier_main(void *arg)
{
	shm_dev_t *dev = arg;
	const int paced = dev->pace_Bps > 0;
	const uint64_t chunk = paced ? SHM_PACE_CHUNK : SHM_CHUNK;
	prctl(PR_SET_TIMERSLACK, 1000UL); /* pacing sleeps of a few µs */
	pthread_mutex_lock(&dev->mu);
	for (;;) {
		while (!dev->stop && !dev->work_head) {
			dev->copier_idle = 1;
			pthread_cond_wait(&dev->work_cv, &dev->mu);
			dev->copier_idle = 0;
			if (paced)
				pace_refill(dev); /* an idle rail saves up at most a burst */
		}
		if (dev->stop)
			break;
		if (paced) { /* for the next turn's bytes (the head's, if it is still the head) */
			const shm_conn_t *h = dev->work_head;
			const shm_tx_t *ht = &h->tx[h->tx_copied & h->out_mask];
			uint64_t want = RW_MIN(chunk, ht->length - ht->copied);
			pthread_mutex_unlock(&dev->mu);
			if (want)
				pace_wait(dev, want);
			pthread_mutex_lock(&dev->mu);
		}
		shm_conn_t *c = work_pop(dev);
		if (!c)
			continue;
		shm_tx_t *t = &c->tx[c->tx_copied & c->out_mask];
		const shm_map_t *m = t->length ? shm_map_find(c, t->key) : NULL;
		if (m && m->state == SHM_MAP_ASKED) {
			c->blocked = 1; /* the loop kicks it again when KEY or NO_KEY comes */
			continue;
		}
		uint64_t n = RW_MIN(chunk, t->length - t->copied);
		uint8_t *dst = NULL;
		const uint8_t *src = (const uint8_t *)t->local->addr + t->local_offset + t->copied;
		if (m && m->state == SHM_MAP_READY &&
		    rw_rail_range_check(m->length, t->remote_offset, t->length) == RW_OK)
			dst = m->addr + t->remote_offset + t->copied;
		/* else: the target has no such region (any more); the entry goes out without a
		 * copy and the target refuses it (RW_ERR_PROTO on its side, as on tcp). */
		dev->busy = c;
		pthread_mutex_unlock(&dev->mu);
		if (dst && n)
			memcpy(dst, src, n);
		if (paced)
			dev->pace_tokens -= (double)n;
		atomic_fetch_add(&dev->tx_bytes, n);
		pthread_mutex_lock(&dev->mu);
		int bell = 0;
		t->copied += n;
		if (!c->detached && t->copied == t->length)
			bell = publish(c, t);
		if (bell) {
			uint8_t raw[SHM_MSG_SIZE];
			shm_msg_encode(&(shm_msg_t){.type = SHM_TAIL}, raw);
			pthread_mutex_unlock(&dev->mu);
			/* Non-blocking: a full socket means the target has unread messages and will
			 * look at tail after reading them; a dead one is the loop's to find. */
			send(c->fd, raw, sizeof(raw), MSG_DONTWAIT | MSG_NOSIGNAL);
			pthread_mutex_lock(&dev->mu);
		}
		dev->busy = NULL;
		pthread_cond_broadcast(&dev->idle_cv);
		work_push(c);
	}
	pthread_mutex_unlock(&dev->mu);
	return NULL;
}

rw_status_t shm_copy_start(shm_dev_t *dev)
{
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, SHM_THREAD_STACK);
	int rc = pthread_create(&dev->copier, &attr, copier_main, dev);
	pthread_attr_destroy(&attr);
	if (rc != 0) {
		errno = rc;
		rw_err("rail %u: cannot start the shm copier thread: %m", dev->base.rail);
		return rc == EAGAIN ? RW_ERR_NOMEM : RW_ERR_SYS;
	}
	dev->copier_running = 1;
	return RW_OK;
}

void shm_copy_stop(shm_dev_t *dev)
{
	if (!dev->copier_running)
		return;
	pthread_mutex_lock(&dev->mu);
	dev->stop = 1;
	pthread_cond_signal(&dev->work_cv);
	pthread_mutex_unlock(&dev->mu);
	pthread_join(dev->copier, NULL);
	dev->copier_running = 0;
}
