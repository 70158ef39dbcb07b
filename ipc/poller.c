/* ipc/poller.c: the word poller (contract in ipc/ipc.h, design in docs/rankpath.md "The
 * poller"). One thread scans a table of watched 64-bit words and hands each change to the loop
 * through a single-producer/single-consumer queue of notices, waking the loop with an ev_async.
 *
 * Ordering pairs (each release store is read by the named acquire load on the other side):
 *   W  loop (watch): store slot.base, then store-release slot.word  -> thread: load-acquire
 *      slot.word; a pointer it has not seen before starts from slot.base, so a change made
 *      between the loop's baseline read and the thread's first look is reported.
 *   R  loop (unwatch): store slot.word = NULL, then store-release slot.retire -> thread:
 *      load-acquire slot.retire; once it is set the thread never loads the word again and
 *      reports `retired`, after which the loop may unmap the memory.
 *   N  thread: fill a notice, store-release q_head -> loop: load-acquire q_head, read notices.
 *   T  loop: read notices, store-release q_tail -> thread: load-acquire q_tail, refill slots.
 *   The words themselves: the thread loads them with acquire, pairing with whatever release
 *   (a stream's barrier before cuStreamWriteValue64, or a CPU's store-release) published them.
 *   P  loop (watch): raise `watched`, then signal `park_cv` under `park_mu` -> thread: reads
 *      `watched` under `park_mu` before it waits, so a watch made while it decides to park
 *      wakes it (a daemon with no rank page costs no wake-ups at all).
 *   K  loop (kick): add 1 to `kick`, then read `sleeping` (both seq_cst) and wake the futex if
 *      set -> thread: set `sleeping`, then read `kick` (both seq_cst) and wait on the futex only
 *      if it is still the value it saw: either the loop sees `sleeping` and wakes it, or the
 *      thread sees the new `kick` (and the futex wait itself refuses a changed value).
 *   L  loop (its own wait, cfg.loop_waits): it reads the words itself (acquire) and arms one
 *      io_uring FUTEX_WAITV over them as last delivered, then raises `loop_waits` -> thread:
 *      load `loop_waits`; while set it sleeps on `kick` alone, since a publishing writer's wake
 *      reaches the loop directly (a word that moved before the arm refuses it: the loop looks
 *      again before it blocks). A stream's word wakes no one: the thread's scan still sees it.
 *   The loop hands a value on only if it differs from the last it handed on (`delivered`):
 *   the thread's notice and the loop's own look may report the same move. */
#include <ev.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>
#include <linux/futex.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ipc/ipc.h"
#include "ipc/page.h"

struct slot {
	_Atomic(const _Atomic uint64_t *) word; /* loop writes; NULL: free or retiring */
	_Atomic uint32_t retire;                 /* loop sets, thread clears after reporting */
	uint64_t base;                           /* baseline, published by the store to word */
	/* thread-private */
	const _Atomic uint64_t *cur;
	uint64_t seen;
	_Atomic int waker;  /* its writer ended a sleep, the thread's or the loop's (it publishes);
	                     * the loop clears it at watch, published by pair W */
	/* loop-private */
	int state;                               /* FREE, LIVE, RETIRING */
	uint64_t delivered;                      /* the last value handed to the callback */
};
enum { FREE = 0, LIVE = 1, RETIRING = 2 };

struct notice {
	uint32_t id;
	uint32_t retired;
	uint64_t value;
};

struct rw_ipc_poller {
	struct ev_loop *loop;
	ev_async async;
	rw_ipc_poller_cb cb;
	void *ctx;
	rw_ipc_poller_config_t cfg;
	struct slot *slots;
	_Atomic uint32_t high;       /* slots [0, high) may be in use (loop raises it) */
	struct notice *q;
	uint32_t q_mask;
	_Alignas(64) _Atomic uint32_t q_head; /* thread writes */
	_Alignas(64) _Atomic uint32_t q_tail; /* loop writes */
	_Alignas(64) _Atomic int busy;
	_Atomic int stop;
	_Atomic uint32_t watched;    /* slots the thread must still look at (live or retiring) */
	pthread_mutex_t park_mu;
	pthread_cond_t park_cv;
	pthread_t thread;
	_Alignas(64) _Atomic uint32_t kick; /* loop adds 1: look closely again (pair K) */
	_Atomic int sleeping;               /* thread: in a timed futex wait on `kick` */
	/* thread-private: the sleep's futexes, `kick` and the watched words (futex_waitv) */
	struct futex_waitv wv[FUTEX_WAITV_MAX];
	uint32_t wv_slot[FUTEX_WAITV_MAX];  /* wv[i]'s slot (i >= 1; wv[0] is `kick`) */
	int no_waitv;                       /* the kernel has no futex_waitv: `kick` alone */
	int spin_for_wakers;                /* spin after a waker's move too (cores to spare) */
	_Atomic uint32_t silent;            /* thread: watched words that never woke anyone */
	_Atomic int loop_waits;             /* loop: its futex wait covers every live word (L) */
	struct loop_wait *lw;               /* loop-private; NULL: the loop does not wait */
	_Atomic uint64_t scans, sleeps, yields, moves, wakeups, parks, kicks, word_wakes;
	uint64_t loop_wakes;                /* loop-private */
};

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

/* Thread: queue one notice; 0 when the queue is full (the caller retries on the next scan). */
static int push(rw_ipc_poller_t *p, uint32_t id, uint64_t value, int retired, uint32_t *head)
{
	uint32_t tail = atomic_load_explicit(&p->q_tail, memory_order_acquire); /* pair T */
	if (*head - tail > p->q_mask)
		return 0;
	p->q[*head & p->q_mask] = (struct notice){ .id = id, .retired = (uint32_t)retired, .value = value };
	(*head)++;
	return 1;
}

/* Thread: one pass over the table; how many notices it queued; *full_p set when one did not
 * fit (a word's change waits for the loop to drain); *silent_p: the watched words whose writer
 * has not woken the thread yet (a stream's never will). */
static unsigned scan(rw_ipc_poller_t *p, int *full_p, uint32_t *silent_p)
{
	*full_p = 0;
	*silent_p = 0;
	uint32_t head = atomic_load_explicit(&p->q_head, memory_order_relaxed);
	const uint32_t start = head, high = atomic_load_explicit(&p->high, memory_order_acquire);
	for (uint32_t i = 0; i < high; i++) {
		struct slot *s = &p->slots[i];
		if (atomic_load_explicit(&s->retire, memory_order_acquire)) { /* pair R */
			if (push(p, i, 0, 1, &head)) {
				s->cur = NULL;
				atomic_store_explicit(&s->retire, 0, memory_order_relaxed);
				atomic_fetch_sub_explicit(&p->watched, 1, memory_order_relaxed);
			} else {
				*full_p = 1;
			}
			continue;
		}
		const _Atomic uint64_t *w = atomic_load_explicit(&s->word, memory_order_acquire); /* W */
		if (!w)
			continue;
		if (w != s->cur) {
			s->cur = w;
			s->seen = s->base;
		}
		*silent_p += !atomic_load_explicit(&s->waker, memory_order_relaxed);
		uint64_t v = atomic_load_explicit(w, memory_order_acquire);
		if (v != s->seen) {
			if (push(p, i, v, 0, &head))
				s->seen = v;
			else
				*full_p = 1;
		}
	}
	if (head != start)
		atomic_store_explicit(&p->q_head, head, memory_order_release); /* pair N */
	return head - start;
}

/* Thread: sleep at most nap_us or until a kick (pair K) — or until a watched word moves, where
 * its writer wakes its futex (a host rank's CPU: rw_page_word_publish; a stream cannot, so its
 * store waits for the bound). One futex_waitv over `kick` and the words as last seen (a word
 * already moved refuses the wait at once); `kick` alone when the words are more than the call
 * takes, when a change is waiting for room in the queue (its word would refuse every wait), or
 * on a kernel without futex_waitv (Linux < 5.16). */
static void nap(rw_ipc_poller_t *p, uint32_t kick_seen, uint32_t nap_us, int full)
{
	uint32_t n = 0;
	/* The loop waits on the words itself (pair L): a wake of ours would be a second one. */
	if (!p->no_waitv && !full && !atomic_load_explicit(&p->loop_waits, memory_order_acquire)) {
		const uint32_t high = atomic_load_explicit(&p->high, memory_order_acquire);
		p->wv[n++] = (struct futex_waitv){ .val = kick_seen, .uaddr = (uintptr_t)&p->kick,
						   .flags = FUTEX_32 | FUTEX_PRIVATE_FLAG };
		for (uint32_t i = 0; i < high && n; i++) {
			const struct slot *s = &p->slots[i];
			if (!s->cur) /* free, retired, or not looked at yet (the next scan does) */
				continue;
			if (n == FUTEX_WAITV_MAX)
				n = 0;
			else
				p->wv_slot[n] = i, p->wv[n++] = (struct futex_waitv){
					.val = (uint32_t)s->seen,
					.uaddr = (uintptr_t)rw_page_word_futex(s->cur),
					.flags = FUTEX_32 }; /* shared: the writer is another process */
		}
	}
	if (n > 1) {
		struct timespec until;
		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_nsec += (long)nap_us * 1000;
		until.tv_sec += until.tv_nsec / 1000000000;
		until.tv_nsec %= 1000000000;
		long woke = syscall(SYS_futex_waitv, p->wv, n, 0, &until, CLOCK_MONOTONIC);
		if (woke > 0) {
			atomic_store_explicit(&p->slots[p->wv_slot[woke]].waker, 1, memory_order_relaxed);
			atomic_fetch_add_explicit(&p->word_wakes, 1, memory_order_relaxed);
		}
		if (woke >= 0 || errno != ENOSYS)
			return;
		p->no_waitv = 1;
	}
	const struct timespec t = { .tv_sec = nap_us / 1000000, .tv_nsec = (long)(nap_us % 1000000) * 1000 };
	(void)syscall(SYS_futex, &p->kick, FUTEX_WAIT_PRIVATE, kick_seen, &t, NULL, 0);
}

/* Thread: after the last move (or kick), spin for spin_us, then look between sched_yield()s for
 * yield_us, then sleep in doubling steps up to the bound of the moment (busy_sleep_max_us while a
 * phase is in flight, else sleep_max_us), a kick ending a sleep; with nothing watched and no
 * phase, park (pair P). */
static void *run(void *arg)
{
	rw_ipc_poller_t *p = arg;
	const rw_ipc_poller_config_t *c = &p->cfg;
	const uint64_t spin_ns = (uint64_t)c->spin_us * 1000, yield_ns = (uint64_t)c->yield_us * 1000;
	uint64_t last_move = now_ns();
	uint32_t nap_us = c->sleep_min_us, kick_seen = atomic_load(&p->kick);
	/* Sleeps as asked: the default slack (50 µs) would stretch every short one. */
	(void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
	while (!atomic_load_explicit(&p->stop, memory_order_relaxed)) {
		int full;
		uint32_t silent;
		unsigned n = scan(p, &full, &silent);
		atomic_store_explicit(&p->silent, silent, memory_order_relaxed);
		atomic_fetch_add_explicit(&p->scans, 1, memory_order_relaxed);
		uint64_t t = now_ns();
		const uint32_t k = atomic_load(&p->kick);
		if (k != kick_seen) {
			kick_seen = k;
			last_move = t;
		}
		if (n) {
			atomic_fetch_add_explicit(&p->moves, n, memory_order_relaxed);
			atomic_fetch_add_explicit(&p->wakeups, 1, memory_order_relaxed);
			ev_async_send(p->loop, &p->async);
			last_move = t;
		}
		const int busy = atomic_load_explicit(&p->busy, memory_order_relaxed) > 0;
		/* Every watched word's writer wakes the thread (host ranks): on a host without cores to
		 * spare, sleeping at once leaves the CPU to them; a wake ends the sleep. */
		const uint64_t quiet = silent || p->spin_for_wakers || full ? t - last_move : UINT64_MAX;
		if ((busy && c->busy_sleep_max_us == 0) || quiet < spin_ns) {
			nap_us = c->sleep_min_us;
			cpu_relax();
			continue;
		}
		if (quiet < spin_ns + yield_ns) {
			nap_us = c->sleep_min_us;
			sched_yield();
			atomic_fetch_add_explicit(&p->yields, 1, memory_order_relaxed);
			continue;
		}
		if (!busy && atomic_load_explicit(&p->watched, memory_order_relaxed) == 0) {
			/* nothing to look at: park until a watch (or the end), pair P */
			atomic_fetch_add_explicit(&p->parks, 1, memory_order_relaxed);
			pthread_mutex_lock(&p->park_mu);
			while (atomic_load_explicit(&p->watched, memory_order_relaxed) == 0 &&
			       !atomic_load_explicit(&p->stop, memory_order_relaxed))
				pthread_cond_wait(&p->park_cv, &p->park_mu);
			pthread_mutex_unlock(&p->park_mu);
			nap_us = c->sleep_min_us;
			continue;
		}
		/* Wakers: a move ends the sleep, so its bound is only a safety net, the idle one even
		 * while a phase is in flight (a long phase costs no 10,000 wake-ups a second). And
		 * when the loop's own wait covers them all (pair L) the thread has nothing to look
		 * at but a watch or a retirement, each of which wakes it: a longer net still. */
		uint32_t bound = busy && quiet != UINT64_MAX ? c->busy_sleep_max_us : c->sleep_max_us;
		if (quiet == UINT64_MAX && atomic_load_explicit(&p->loop_waits, memory_order_acquire))
			bound = RW_MAX(bound, RW_IPC_POLLER_COVERED_SLEEP_US);
		if (nap_us > bound || quiet == UINT64_MAX)
			nap_us = bound;
		atomic_store(&p->sleeping, 1); /* pair K */
		if (atomic_load(&p->kick) == kick_seen)
			nap(p, kick_seen, nap_us, full);
		atomic_store(&p->sleeping, 0);
		atomic_fetch_add_explicit(&p->sleeps, 1, memory_order_relaxed);
		nap_us = nap_us * 2 > bound ? bound : nap_us * 2;
	}
	return NULL;
}


/* ---------------------------------------------------------------------------------------------
 * The loop's own wait on the words (cfg.loop_waits, pair L). One io_uring holds at most one
 * FUTEX_WAITV over the live words as last delivered (and, when the watched set changed, a cancel
 * of it); a completion makes the ring's fd readable, an ev_io of the loop. So a host rank's
 * rw_page_word_publish wakes the loop, the thread that acts on the word, rather than this
 * thread, which then wakes the loop: one thread woken per hand-off instead of two.
 * ------------------------------------------------------------------------------------------- */
#ifndef IORING_OP_FUTEX_WAITV
#define IORING_OP_FUTEX_WAITV 53 /* Linux 6.7 */
#endif
enum { LW_WAIT = 1, LW_CANCEL = 2 };

struct loop_wait {
	int fd;
	ev_io io;
	ev_prepare prep;
	void *sq_map, *cq_map, *sqes_map;
	size_t sq_bytes, cq_bytes, sqes_bytes;
	struct io_uring_sqe *sqes;
	_Atomic unsigned *sq_tail, *cq_head, *cq_tail;
	unsigned *sq_array, sq_mask, cq_mask;
	const struct io_uring_cqe *cqes;
	int armed;      /* a FUTEX_WAITV is in the kernel */
	int cancelling; /* and its cancel too */
	int dirty;      /* a watch came or went since it was armed */
	int broken;     /* the kernel refused a request: the thread relays every word again */
	uint32_t n;
	struct futex_waitv wv[FUTEX_WAITV_MAX];
	uint32_t slot[FUTEX_WAITV_MAX];
};

static void lw_close(struct loop_wait *lw)
{
	if (lw->sqes_map && lw->sqes_map != MAP_FAILED)
		munmap(lw->sqes_map, lw->sqes_bytes);
	if (lw->cq_map && lw->cq_map != MAP_FAILED && lw->cq_map != lw->sq_map)
		munmap(lw->cq_map, lw->cq_bytes);
	if (lw->sq_map && lw->sq_map != MAP_FAILED)
		munmap(lw->sq_map, lw->sq_bytes);
	close(lw->fd); /* cancels what is still armed */
	free(lw);
}

/* A ring whose kernel has FUTEX_WAITV (Linux 6.7+), or NULL (older, io_uring refused by the
 * host's policy: io_uring_disabled, a container's seccomp). */
static struct loop_wait *lw_open(void)
{
	struct io_uring_params pr;
	memset(&pr, 0, sizeof(pr));
	int fd = (int)syscall(SYS_io_uring_setup, 4, &pr);
	if (fd < 0)
		return NULL;
	const size_t probe_bytes = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
	struct io_uring_probe *probe = calloc(1, probe_bytes);
	const int ok = probe && syscall(SYS_io_uring_register, fd, IORING_REGISTER_PROBE, probe, 256) == 0 &&
		       probe->last_op >= IORING_OP_FUTEX_WAITV &&
		       (probe->ops[IORING_OP_FUTEX_WAITV].flags & IO_URING_OP_SUPPORTED);
	free(probe);
	struct loop_wait *lw = ok ? calloc(1, sizeof(*lw)) : NULL;
	if (!lw) {
		close(fd);
		return NULL;
	}
	lw->fd = fd;
	lw->sq_bytes = pr.sq_off.array + pr.sq_entries * sizeof(unsigned);
	lw->cq_bytes = pr.cq_off.cqes + pr.cq_entries * sizeof(struct io_uring_cqe);
	const int single = (pr.features & IORING_FEAT_SINGLE_MMAP) != 0;
	if (single)
		lw->sq_bytes = lw->cq_bytes = RW_MAX(lw->sq_bytes, lw->cq_bytes);
	lw->sqes_bytes = pr.sq_entries * sizeof(struct io_uring_sqe);
	lw->sq_map = mmap(NULL, lw->sq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
			  IORING_OFF_SQ_RING);
	lw->cq_map = single ? lw->sq_map :
		     mmap(NULL, lw->cq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
			  IORING_OFF_CQ_RING);
	lw->sqes_map = mmap(NULL, lw->sqes_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
			    fd, IORING_OFF_SQES);
	if (lw->sq_map == MAP_FAILED || lw->cq_map == MAP_FAILED || lw->sqes_map == MAP_FAILED) {
		lw_close(lw);
		return NULL;
	}
	uint8_t *sq = lw->sq_map, *cq = lw->cq_map;
	lw->sqes = lw->sqes_map;
	lw->sq_tail = (_Atomic unsigned *)(void *)(sq + pr.sq_off.tail);
	lw->sq_mask = *(const unsigned *)(const void *)(sq + pr.sq_off.ring_mask);
	lw->sq_array = (unsigned *)(void *)(sq + pr.sq_off.array);
	lw->cq_head = (_Atomic unsigned *)(void *)(cq + pr.cq_off.head);
	lw->cq_tail = (_Atomic unsigned *)(void *)(cq + pr.cq_off.tail);
	lw->cq_mask = *(const unsigned *)(const void *)(cq + pr.cq_off.ring_mask);
	lw->cqes = (const struct io_uring_cqe *)(const void *)(cq + pr.cq_off.cqes);
	return lw;
}

/* One request, submitted now (the kernel copies a FUTEX_WAITV's array at submission); -1 when
 * the kernel refused it. Never more than two are queued, in a ring of four. */
static int lw_submit(struct loop_wait *lw, uint8_t op, uint64_t addr, uint32_t len, uint64_t data)
{
	const unsigned tail = atomic_load_explicit(lw->sq_tail, memory_order_relaxed);
	const unsigned i = tail & lw->sq_mask;
	struct io_uring_sqe *q = &lw->sqes[i];
	memset(q, 0, sizeof(*q));
	q->opcode = op;
	q->addr = addr;
	q->len = len;
	q->user_data = data;
	lw->sq_array[i] = i;
	atomic_store_explicit(lw->sq_tail, tail + 1, memory_order_release); /* the kernel's acquire */
	long r;
	do
		r = syscall(SYS_io_uring_enter, lw->fd, 1, 0, 0, NULL, 0);
	while (r < 0 && errno == EINTR);
	return r == 1 ? 0 : -1;
}

/* Loop: hand `v`, word `id`'s value, on unless it is the last one handed on (the thread's
 * notice and the loop's own look may both carry a move); a word no longer watched says nothing. */
static void deliver(rw_ipc_poller_t *p, uint32_t id, uint64_t v)
{
	struct slot *s = &p->slots[id];
	if (s->state != LIVE || v == s->delivered)
		return;
	s->delivered = v;
	p->cb(p->ctx, id, v, 0);
}

static uint64_t word_now(const struct slot *s)
{
	const _Atomic uint64_t *w = atomic_load_explicit(&s->word, memory_order_relaxed);
	return atomic_load_explicit(w, memory_order_acquire); /* the writer's release */
}

/* Loop: look at every live word itself (a callback may watch or unwatch others meanwhile). */
static void loop_look(rw_ipc_poller_t *p)
{
	for (uint32_t i = 0; i < atomic_load_explicit(&p->high, memory_order_relaxed); i++)
		if (p->slots[i].state == LIVE) /* in slot order, as the thread's scan */
			deliver(p, i, word_now(&p->slots[i]));
}

static void wake_thread(rw_ipc_poller_t *p);

/* Loop: the thread is to wait on the words again (the loop no longer can, pair L). */
static void lw_give_up(rw_ipc_poller_t *p)
{
	if (atomic_exchange_explicit(&p->loop_waits, 0, memory_order_release))
		wake_thread(p);
}

/* Loop, before it blocks: arm the wait over every live word as last delivered (a word that
 * moved since refuses it at once: the completion comes now), or cancel one armed over a table
 * that has changed since (its completion then re-arms). */
static void lw_prepare(struct ev_loop *loop, ev_prepare *w, int revents)
{
	(void)loop; (void)revents;
	rw_ipc_poller_t *p = w->data;
	struct loop_wait *lw = p->lw;
	if (lw->broken)
		return;
	if (lw->armed) {
		if (lw->dirty && !lw->cancelling) {
			if (lw_submit(lw, IORING_OP_ASYNC_CANCEL, LW_WAIT, 0, LW_CANCEL) == 0)
				lw->cancelling = 1;
			else
				lw->broken = 1, lw_give_up(p);
		}
		return;
	}
	loop_look(p);
	uint32_t n = 0, live = 0;
	const uint32_t high = atomic_load_explicit(&p->high, memory_order_relaxed);
	for (uint32_t i = 0; i < high; i++) {
		const struct slot *s = &p->slots[i];
		if (s->state != LIVE)
			continue;
		if (live++ == FUTEX_WAITV_MAX)
			break;
		lw->slot[n] = i;
		lw->wv[n++] = (struct futex_waitv){
			.val = (uint32_t)s->delivered, .flags = FUTEX_32, /* shared: another process */
			.uaddr = (uintptr_t)rw_page_word_futex(atomic_load_explicit(&s->word,
										  memory_order_relaxed)) };
	}
	if (n == 0 || live > n) { /* nothing to wait on, or more than one call takes */
		lw_give_up(p);
		return;
	}
	if (lw_submit(lw, IORING_OP_FUTEX_WAITV, (uintptr_t)lw->wv, n, LW_WAIT) != 0) {
		lw->broken = 1;
		lw_give_up(p);
		return;
	}
	lw->armed = 1;
	lw->dirty = 0;
	lw->n = n;
	atomic_store_explicit(&p->loop_waits, 1, memory_order_release); /* pair L */
}

/* Loop: the ring's completions (the wait ended: a word's wake, a word that had moved, or the
 * cancel), then a look at every word; the next prepare arms again. */
static void lw_ready(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop; (void)revents;
	rw_ipc_poller_t *p = w->data;
	struct loop_wait *lw = p->lw;
	unsigned head = atomic_load_explicit(lw->cq_head, memory_order_relaxed);
	const unsigned tail = atomic_load_explicit(lw->cq_tail, memory_order_acquire);
	for (; head != tail; head++) {
		const struct io_uring_cqe *c = &lw->cqes[head & lw->cq_mask];
		if (c->user_data == LW_CANCEL) {
			lw->cancelling = 0;
			continue;
		}
		lw->armed = 0;
		if (c->res >= 0 && (uint32_t)c->res < lw->n) {
			if (!lw->dirty) /* else its slot may hold another word by now */
				atomic_store_explicit(&p->slots[lw->slot[c->res]].waker, 1,
						      memory_order_relaxed);
			p->loop_wakes++;
		} else if (c->res != -EAGAIN && c->res != -ECANCELED) {
			rw_warn("ipc: the loop's wait on the rank pages' words failed (%s): the poller "
				"thread relays them", strerror(-c->res));
			lw->broken = 1;
			lw_give_up(p);
		}
	}
	atomic_store_explicit(lw->cq_head, head, memory_order_release); /* the kernel's acquire */
	loop_look(p);
}

/* Loop: hand every queued notice on, in the thread's order (a rank's words in the order it wrote
 * them, as far as one scan can tell): a retirement; a move, unless the loop has handed it on. */
static void drain(struct ev_loop *loop, ev_async *w, int revents)
{
	(void)loop; (void)revents;
	rw_ipc_poller_t *p = w->data;
	uint32_t tail = atomic_load_explicit(&p->q_tail, memory_order_relaxed);
	const uint32_t head = atomic_load_explicit(&p->q_head, memory_order_acquire); /* pair N */
	while (tail != head) {
		struct notice n = p->q[tail & p->q_mask];
		tail++;
		if (!n.retired) {
			/* A notice behind what the loop's own look handed on is stale: the word as it
			 * reads now, which also shows a word that really went back (the loop judges). */
			uint64_t v = n.value;
			if (p->lw && p->slots[n.id].state == LIVE &&
			    (int64_t)(v - p->slots[n.id].delivered) <= 0)
				v = word_now(&p->slots[n.id]);
			deliver(p, n.id, v);
			continue;
		}
		p->slots[n.id].state = FREE;
		p->cb(p->ctx, n.id, 0, 1);
	}
	atomic_store_explicit(&p->q_tail, tail, memory_order_release); /* pair T */
}

static void lw_stop(rw_ipc_poller_t *p)
{
	if (!p->lw)
		return;
	ev_io_stop(p->loop, &p->lw->io);
	ev_prepare_stop(p->loop, &p->lw->prep);
	lw_close(p->lw);
	p->lw = NULL;
}

rw_status_t rw_ipc_poller_create(struct ev_loop *loop, const rw_ipc_poller_config_t *cfg,
				 rw_ipc_poller_cb cb, void *ctx, rw_ipc_poller_t **poller_p)
{
	if (!loop || !cfg || !cb || cfg->max_watches == 0 || cfg->max_watches > 65536 ||
	    cfg->sleep_min_us == 0 || cfg->sleep_max_us < cfg->sleep_min_us ||
	    (cfg->busy_sleep_max_us != 0 && (cfg->busy_sleep_max_us < cfg->sleep_min_us ||
					      cfg->busy_sleep_max_us > cfg->sleep_max_us)))
		return RW_ERR_INVAL;
	rw_ipc_poller_t *p = calloc(1, sizeof(*p));
	if (!p)
		return RW_ERR_NOMEM;
	uint32_t qsize = 64;
	while (qsize < 2 * cfg->max_watches)
		qsize *= 2;
	p->slots = calloc(cfg->max_watches, sizeof(*p->slots));
	p->q = calloc(qsize, sizeof(*p->q));
	if (!p->slots || !p->q)
		goto fail_free;
	p->q_mask = qsize - 1;
	p->spin_for_wakers = sysconf(_SC_NPROCESSORS_ONLN) >=
			     (cfg->waker_spin_cpus ? cfg->waker_spin_cpus : RW_IPC_POLLER_WAKER_SPIN_CPUS);
	pthread_mutex_init(&p->park_mu, NULL);
	pthread_cond_init(&p->park_cv, NULL);
	p->loop = loop;
	p->cb = cb;
	p->ctx = ctx;
	p->cfg = *cfg;
	ev_async_init(&p->async, drain);
	p->async.data = p;
	ev_async_start(loop, &p->async);
	if (cfg->loop_waits && !(p->lw = lw_open()))
		rw_info("ipc: the loop cannot wait on the rank pages' words itself (io_uring with "
			"FUTEX_WAITV: Linux 6.7+, and not refused by the host's policy): the poller "
			"thread relays every word");
	if (p->lw) {
		ev_io_init(&p->lw->io, lw_ready, p->lw->fd, EV_READ);
		p->lw->io.data = p;
		ev_io_start(loop, &p->lw->io);
		ev_prepare_init(&p->lw->prep, lw_prepare);
		ev_set_priority(&p->lw->prep, EV_MINPRI); /* after every other prepare: none of
							    * them watches a word after the arm */
		p->lw->prep.data = p;
		ev_prepare_start(loop, &p->lw->prep);
	}
	int err = pthread_create(&p->thread, NULL, run, p);
	if (err != 0) {
		errno = err;
		rw_err("ipc: cannot start the word poller thread: %m");
		lw_stop(p);
		ev_async_stop(loop, &p->async);
		pthread_cond_destroy(&p->park_cv);
		pthread_mutex_destroy(&p->park_mu);
		free(p->q);
		free(p->slots);
		free(p);
		return RW_ERR_SYS;
	}
	*poller_p = p;
	return RW_OK;

fail_free:
	free(p->q);
	free(p->slots);
	free(p);
	return RW_ERR_NOMEM;
}

void rw_ipc_poller_destroy(rw_ipc_poller_t *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->park_mu);
	atomic_store_explicit(&p->stop, 1, memory_order_relaxed);
	pthread_cond_signal(&p->park_cv);
	pthread_mutex_unlock(&p->park_mu);
	wake_thread(p); /* a sleep ends now */
	pthread_join(p->thread, NULL);
	pthread_cond_destroy(&p->park_cv);
	pthread_mutex_destroy(&p->park_mu);
	lw_stop(p);
	ev_async_stop(p->loop, &p->async);
	free(p->q);
	free(p->slots);
	free(p);
}

rw_status_t rw_ipc_poller_watch(rw_ipc_poller_t *p, const void *word, uint32_t *id_p)
{
	if (!word || ((uintptr_t)word & 7) != 0)
		return RW_ERR_INVAL;
	for (uint32_t i = 0; i < p->cfg.max_watches; i++) {
		struct slot *s = &p->slots[i];
		if (s->state != FREE)
			continue;
		const _Atomic uint64_t *w = word;
		s->state = LIVE;
		s->base = s->delivered = atomic_load_explicit(w, memory_order_acquire);
		atomic_store_explicit(&s->waker, 0, memory_order_relaxed); /* published by pair W */
		atomic_fetch_add_explicit(&p->silent, 1, memory_order_relaxed); /* till its scan */
		if (i >= atomic_load_explicit(&p->high, memory_order_relaxed))
			atomic_store_explicit(&p->high, i + 1, memory_order_release);
		atomic_store_explicit(&s->word, w, memory_order_release); /* pair W */
		pthread_mutex_lock(&p->park_mu); /* pair P */
		atomic_fetch_add_explicit(&p->watched, 1, memory_order_relaxed);
		pthread_cond_signal(&p->park_cv);
		pthread_mutex_unlock(&p->park_mu);
		if (p->lw) { /* the loop's wait covers it at its next arm; the thread, which may sleep
			      * long while that wait covers every word, looks now (a stream's word) */
			p->lw->dirty = 1;
			wake_thread(p);
		}
		*id_p = i;
		return RW_OK;
	}
	return RW_ERR_AGAIN;
}

void rw_ipc_poller_unwatch(rw_ipc_poller_t *p, uint32_t id)
{
	if (id >= p->cfg.max_watches || p->slots[id].state != LIVE)
		return;
	struct slot *s = &p->slots[id];
	s->state = RETIRING;
	if (p->lw)
		p->lw->dirty = 1;
	atomic_store_explicit(&s->word, NULL, memory_order_relaxed);
	atomic_store_explicit(&s->retire, 1, memory_order_release); /* pair R */
	if (p->lw)
		wake_thread(p); /* it reports the retirement now, however long it meant to sleep */
}

static void wake_thread(rw_ipc_poller_t *p)
{
	atomic_fetch_add(&p->kick, 1); /* pair K */
	if (atomic_load(&p->sleeping)) {
		(void)syscall(SYS_futex, &p->kick, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
		atomic_fetch_add_explicit(&p->kicks, 1, memory_order_relaxed);
	}
}

void rw_ipc_poller_kick(rw_ipc_poller_t *p)
{
	/* Every watched word wakes a sleeper itself and the thread would not spin after the kick
	 * (a small host): waking it only costs a CPU the ranks need. */
	if (!p->spin_for_wakers && atomic_load_explicit(&p->silent, memory_order_relaxed) == 0)
		return;
	wake_thread(p);
}

void rw_ipc_poller_busy(rw_ipc_poller_t *p, int busy)
{
	atomic_fetch_add_explicit(&p->busy, busy ? 1 : -1, memory_order_relaxed);
}

void rw_ipc_poller_stats(const rw_ipc_poller_t *p, rw_ipc_poller_stats_t *st)
{
	rw_ipc_poller_t *q = (rw_ipc_poller_t *)p; /* the counters are atomics, read only */
	memset(st, 0, sizeof(*st));
	st->scans = atomic_load_explicit(&q->scans, memory_order_relaxed);
	st->sleeps = atomic_load_explicit(&q->sleeps, memory_order_relaxed);
	st->yields = atomic_load_explicit(&q->yields, memory_order_relaxed);
	st->kicks = atomic_load_explicit(&q->kicks, memory_order_relaxed);
	st->moves = atomic_load_explicit(&q->moves, memory_order_relaxed);
	st->wakeups = atomic_load_explicit(&q->wakeups, memory_order_relaxed);
	st->parks = atomic_load_explicit(&q->parks, memory_order_relaxed);
	st->word_wakes = atomic_load_explicit(&q->word_wakes, memory_order_relaxed);
	st->loop_wakes = q->loop_wakes;
	st->loop_waits = atomic_load_explicit(&q->loop_waits, memory_order_relaxed);
	clockid_t cid;
	struct timespec t;
	if (pthread_getcpuclockid(q->thread, &cid) == 0 && clock_gettime(cid, &t) == 0)
		st->cpu_ns = (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}
