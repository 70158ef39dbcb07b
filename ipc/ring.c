/* SPSC shared-memory ring with armed wake-ups (contract in ipc/ring.h, design in docs/ipc.md).
 *
 * Ordering pairs (each release store is read by the named acquire load on the other side):
 *   A  producer: fill slots, then store-release head   → consumer: load-acquire head, then read
 *   B  consumer: read slots, then store-release tail   → producer: load-acquire tail, then refill
 *   C  the wake-up handshake is a Dekker pattern and needs seq_cst fences on both sides:
 *        consumer: armed = 1; fence; load head        (rw_ring_cons_arm)
 *        producer: store head; fence; load armed      (rw_ring_prod_publish)
 *      so at least one of them sees the other's store: either the consumer sees the new head and
 *      does not sleep, or the producer sees armed and writes the eventfd.
 *   D  the same handshake the other way for a producer waiting for space:
 *        producer: space_armed = 1; fence; load tail   (rw_ring_prod_arm_space)
 *        consumer: store tail; fence; load space_armed (rw_ring_cons_release) */
#include "ipc/ring.h"

#include <errno.h>
#include <unistd.h>

void rw_ring_init(rw_ring_t *ring, rw_ring_ctl_t *ctl, void *slots, uint32_t size,
		  uint32_t entry_size, int efd, int producer)
{
	ring->ctl = ctl;
	ring->slots = slots;
	ring->size = size;
	ring->mask = size - 1;
	ring->entry_size = entry_size;
	ring->efd = efd;
	ring->prod_efd = -1;
	if (producer) {
		ring->local = atomic_load_explicit(&ctl->head, memory_order_relaxed);
		ring->published = ring->local;
		ring->cached = atomic_load_explicit(&ctl->tail, memory_order_acquire); /* pair B */
	} else {
		ring->local = atomic_load_explicit(&ctl->tail, memory_order_relaxed);
		ring->published = 0;
		ring->cached = ring->local;
	}
}

static int reload_tail(rw_ring_t *ring)
{
	/* Pair B: after this load the consumer is done with every slot below tail. */
	uint32_t tail = atomic_load_explicit(&ring->ctl->tail, memory_order_acquire);
	if (ring->published - tail > ring->size)
		return RW_RING_CORRUPT; /* tail ahead of head, or more than a ring behind */
	ring->cached = tail;
	return (int)(ring->size - (ring->local - tail));
}

int rw_ring_prod_space(rw_ring_t *ring, uint32_t want)
{
	uint32_t used = ring->local - ring->cached;
	if (ring->size - used >= want && want != 0)
		return (int)(ring->size - used);
	return reload_tail(ring);
}

int rw_ring_prod_arm_space(rw_ring_t *ring)
{
	atomic_store_explicit(&ring->ctl->space_armed, 1, memory_order_relaxed);
	/* Pair D: order the space_armed store before the tail load. */
	atomic_thread_fence(memory_order_seq_cst);
	int space = reload_tail(ring);
	if (space != 0)
		atomic_store_explicit(&ring->ctl->space_armed, 0, memory_order_relaxed);
	return space;
}

static void wake(int efd)
{
	uint64_t one = 1;
	ssize_t n;
	do
		n = write(efd, &one, sizeof(one));
	while (n < 0 && errno == EINTR);
	/* EAGAIN means the counter is saturated: a wake-up is pending anyway. */
}

int rw_ring_prod_publish(rw_ring_t *ring)
{
	if (ring->local == ring->published)
		return 0;
	/* Pair A: the slots filled since the last publish become visible with this store. */
	atomic_store_explicit(&ring->ctl->head, ring->local, memory_order_release);
	ring->published = ring->local;
	/* Pair C: order the head store before the armed load (store-load needs a full fence). */
	atomic_thread_fence(memory_order_seq_cst);
	if (ring->efd < 0 || !atomic_load_explicit(&ring->ctl->armed, memory_order_relaxed))
		return 0;
	if (!atomic_exchange_explicit(&ring->ctl->armed, 0, memory_order_relaxed))
		return 0; /* the consumer disarmed itself meanwhile: it is awake */
	wake(ring->efd);
	return 1;
}

int rw_ring_cons_avail(rw_ring_t *ring)
{
	/* Pair A: after this load the slots below head are fully written. */
	uint32_t head = atomic_load_explicit(&ring->ctl->head, memory_order_acquire);
	uint32_t ready = head - ring->local;
	if (ready > ring->size)
		return RW_RING_CORRUPT; /* head behind our tail or more than a ring ahead */
	ring->cached = head;
	return (int)ready;
}

void rw_ring_cons_release(rw_ring_t *ring, uint32_t n)
{
	if (n == 0)
		return;
	ring->local += n;
	/* Pair B: we are done reading every slot below the new tail. */
	atomic_store_explicit(&ring->ctl->tail, ring->local, memory_order_release);
	if (ring->prod_efd < 0)
		return;
	/* Pair D: order the tail store before the space_armed load. */
	atomic_thread_fence(memory_order_seq_cst);
	if (atomic_load_explicit(&ring->ctl->space_armed, memory_order_relaxed) &&
	    atomic_exchange_explicit(&ring->ctl->space_armed, 0, memory_order_relaxed))
		wake(ring->prod_efd);
}

int rw_ring_cons_arm(rw_ring_t *ring)
{
	atomic_store_explicit(&ring->ctl->armed, 1, memory_order_relaxed);
	/* Pair C: order the armed store before the head load. */
	atomic_thread_fence(memory_order_seq_cst);
	int ready = rw_ring_cons_avail(ring);
	if (ready != 0)
		rw_ring_cons_disarm(ring);
	return ready;
}

void rw_ring_cons_disarm(rw_ring_t *ring)
{
	atomic_store_explicit(&ring->ctl->armed, 0, memory_order_relaxed);
}
