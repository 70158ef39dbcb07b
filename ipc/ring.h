/* ipc/ private: single-producer/single-consumer rings in shared memory (a memfd mapped by the
 * daemon and one client), with an armed wake-up through an eventfd. Used by both faces of the
 * module: the client produces submissions and consumes completions, the daemon the reverse.
 *
 * Layout in shared memory: one rw_ring_ctl_t (three cache lines) per ring, then the slots.
 * Indices are free-running uint32_t counts: `head` = entries ever published by the producer,
 * `tail` = entries ever consumed by the consumer; the slot of index i is i & mask. A correct pair
 * always has head - tail <= size (unsigned arithmetic), so a side that reads an index breaking
 * that rule knows the other side is corrupt or hostile (rw_ring_* return RW_RING_CORRUPT).
 *
 * Trust: everything in rw_ring_ctl_t can be scribbled on by the other process. Size, mask, slot
 * base and this side's own index live in the private rw_ring_t and are never re-read from shared
 * memory; the shared index of the other side is loaded once per call and validated. */
#ifndef RW_IPC_RING_H
#define RW_IPC_RING_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define RW_RING_CACHELINE 64
#define RW_RING_CORRUPT (-1)

/* Shared control block. Each index sits alone on its cache line so the producer's stores to
 * head never invalidate the line the consumer writes tail to (no false sharing). */
typedef struct rw_ring_ctl {
	_Alignas(RW_RING_CACHELINE) _Atomic uint32_t head;  /* written by the producer only */
	_Alignas(RW_RING_CACHELINE) _Atomic uint32_t tail;  /* written by the consumer only */
	_Alignas(RW_RING_CACHELINE) _Atomic uint32_t armed; /* consumer sets 1 before sleeping on
	                                                       "not empty"; the producer clears it
	                                                       when it writes the eventfd */
	_Alignas(RW_RING_CACHELINE) _Atomic uint32_t space_armed; /* producer sets 1 before sleeping
	                                                       on "not full"; the consumer clears it
	                                                       when it writes the producer's fd */
} rw_ring_ctl_t;

_Static_assert(sizeof(rw_ring_ctl_t) == 4 * RW_RING_CACHELINE, "ring control block layout");

/* One side's private view of a ring. */
typedef struct rw_ring {
	rw_ring_ctl_t *ctl;
	uint8_t *slots;
	uint32_t size;       /* entries, power of two */
	uint32_t mask;       /* size - 1 */
	uint32_t entry_size; /* bytes per slot */
	uint32_t local;      /* producer: next index to fill (staged, maybe unpublished);
	                        consumer: next index to read */
	uint32_t published;  /* producer: last head value stored */
	uint32_t cached;     /* producer: last tail seen; consumer: last head seen */
	int efd;             /* producer's view: eventfd that wakes the consumer (-1: none) */
	int prod_efd;        /* consumer's view: eventfd that wakes a producer waiting for
	                        space (-1: the producer never waits for space) */
} rw_ring_t;

/* Bind a view to shared memory. ctl and slots must stay mapped while the view is used.
 * `size` must be a power of two. The producer's view starts from the ctl's current indices
 * (0 for a fresh memfd). Does not touch shared memory beyond reading the indices. */
void rw_ring_init(rw_ring_t *ring, rw_ring_ctl_t *ctl, void *slots, uint32_t size,
		  uint32_t entry_size, int efd, int producer);

/* Consumer view only: also wake the producer through prod_efd when it armed space_armed. */
static inline void rw_ring_set_prod_efd(rw_ring_t *ring, int prod_efd) { ring->prod_efd = prod_efd; }

static inline void *rw_ring_slot(const rw_ring_t *ring, uint32_t index)
{
	return ring->slots + (size_t)(index & ring->mask) * ring->entry_size;
}

/* ---- producer ---- */

/* Free slots. Reloads the consumer's tail only when the cached value shows fewer than `want`
 * free (want = 0: always reload). RW_RING_CORRUPT if the consumer's tail is not within [published - size, published]. */
int rw_ring_prod_space(rw_ring_t *ring, uint32_t want);

/* Slot to fill next (caller checked space). */
static inline void *rw_ring_prod_next(rw_ring_t *ring) { return rw_ring_slot(ring, ring->local); }

/* Count the slot just filled (not yet visible to the consumer). */
static inline void rw_ring_prod_push(rw_ring_t *ring) { ring->local++; }

/* About to wait for space (the ring is full): set space_armed, then re-check. Returns the free
 * slots (> 0: do not wait; space_armed is cleared again), 0 (wait: the consumer will write
 * prod_efd after its next release), or RW_RING_CORRUPT. */
int rw_ring_prod_arm_space(rw_ring_t *ring);

/* Make every pushed slot visible with one store, then wake the consumer if it is armed.
 * Returns 1 if it wrote the eventfd, 0 if not, never an error (it only writes). */
int rw_ring_prod_publish(rw_ring_t *ring);

/* ---- consumer ---- */

/* Entries ready to read (loads the producer's head). RW_RING_CORRUPT if head - local > size. */
int rw_ring_cons_avail(rw_ring_t *ring);

/* Slot of the i-th ready entry (i < avail). Copy it out before validating it: the producer may
 * rewrite it at any time, so validate the copy, never the shared bytes. */
static inline const void *rw_ring_cons_peek(const rw_ring_t *ring, uint32_t i)
{
	return rw_ring_slot(ring, ring->local + i);
}

/* Hand n read slots back to the producer with one store; wake it if it waits for space. */
void rw_ring_cons_release(rw_ring_t *ring, uint32_t n);

/* About to sleep: set armed, then re-check. Returns entries available (> 0: do not sleep; the
 * armed flag is cleared again), 0 (sleep on the eventfd now: the producer will write it), or
 * RW_RING_CORRUPT. */
int rw_ring_cons_arm(rw_ring_t *ring);

/* Clear the armed flag (the consumer woke up or decided to keep polling). */
void rw_ring_cons_disarm(rw_ring_t *ring);

/* Bytes of shared memory a ring of `size` entries of `entry_size` bytes needs for its slots. */
static inline size_t rw_ring_slots_bytes(uint32_t size, uint32_t entry_size)
{
	return (size_t)size * entry_size;
}

#endif /* RW_IPC_RING_H */
