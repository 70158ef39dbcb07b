/* ipc/ring.c: empty/full, wraparound of the free-running indices, corrupt-index detection, the
 * armed wake-up handshakes both ways, and a two-thread stress run that checks every entry's
 * content and order while both sides sleep and wake through eventfds. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "ipc/ring.h"

typedef struct entry {
	uint64_t seq;
	uint64_t check[7];
} entry_t;

static void fill(entry_t *e, uint64_t seq)
{
	e->seq = seq;
	for (int i = 0; i < 7; i++)
		e->check[i] = seq * 0x9e3779b97f4a7c15ull + (uint64_t)i;
}

static int valid(const entry_t *e, uint64_t seq)
{
	if (e->seq != seq)
		return 0;
	for (int i = 0; i < 7; i++)
		if (e->check[i] != seq * 0x9e3779b97f4a7c15ull + (uint64_t)i)
			return 0;
	return 1;
}

typedef struct shm {
	rw_ring_ctl_t ctl;
	entry_t slots[];
} shm_t;

static shm_t *shm_new(uint32_t size, uint32_t start)
{
	shm_t *s = aligned_alloc(64, sizeof(shm_t) + size * sizeof(entry_t));
	assert_non_null(s);
	memset(s, 0, sizeof(shm_t) + size * sizeof(entry_t));
	atomic_store(&s->ctl.head, start);
	atomic_store(&s->ctl.tail, start);
	return s;
}

static uint64_t efd_read(int efd)
{
	uint64_t v = 0;
	if (read(efd, &v, sizeof(v)) != sizeof(v))
		return 0;
	return v;
}

static void test_empty_full(void **state)
{
	(void)state;
	shm_t *s = shm_new(8, 0);
	rw_ring_t p, c;
	rw_ring_init(&p, &s->ctl, s->slots, 8, sizeof(entry_t), -1, 1);
	rw_ring_init(&c, &s->ctl, s->slots, 8, sizeof(entry_t), -1, 0);

	assert_int_equal(rw_ring_cons_avail(&c), 0);
	assert_int_equal(rw_ring_prod_space(&p, 1), 8);
	for (uint64_t i = 0; i < 8; i++) {
		fill(rw_ring_prod_next(&p), i);
		rw_ring_prod_push(&p);
	}
	assert_int_equal(rw_ring_prod_space(&p, 1), 0);
	/* Staged but unpublished entries are invisible. */
	assert_int_equal(rw_ring_cons_avail(&c), 0);
	assert_int_equal(rw_ring_prod_publish(&p), 0);
	assert_int_equal(rw_ring_cons_avail(&c), 8);
	for (uint32_t i = 0; i < 8; i++)
		assert_true(valid(rw_ring_cons_peek(&c, i), i));
	/* Space comes back only when the consumer releases. */
	assert_int_equal(rw_ring_prod_space(&p, 1), 0);
	rw_ring_cons_release(&c, 3);
	assert_int_equal(rw_ring_prod_space(&p, 1), 3);
	rw_ring_cons_release(&c, 5);
	assert_int_equal(rw_ring_cons_avail(&c), 0);
	assert_int_equal(rw_ring_prod_space(&p, 8), 8);
	free(s);
}

/* Indices start just below 2^32 so both wrap several times; content must survive. */
static void test_wraparound(void **state)
{
	(void)state;
	const uint32_t size = 16;
	shm_t *s = shm_new(size, UINT32_MAX - 37);
	rw_ring_t p, c;
	rw_ring_init(&p, &s->ctl, s->slots, size, sizeof(entry_t), -1, 1);
	rw_ring_init(&c, &s->ctl, s->slots, size, sizeof(entry_t), -1, 0);
	uint64_t next_write = 0, next_read = 0;
	unsigned r = 12345;
	for (int round = 0; round < 200; round++) {
		r = r * 1103515245u + 12345u;
		int space = rw_ring_prod_space(&p, 0);
		assert_true(space >= 0 && space <= (int)size);
		uint32_t n = (r >> 16) % (uint32_t)(space + 1);
		for (uint32_t i = 0; i < n; i++) {
			fill(rw_ring_prod_next(&p), next_write++);
			rw_ring_prod_push(&p);
		}
		rw_ring_prod_publish(&p);
		int avail = rw_ring_cons_avail(&c);
		assert_int_equal(avail, (int)(next_write - next_read));
		uint32_t take = (r >> 8) % (uint32_t)(avail + 1);
		for (uint32_t i = 0; i < take; i++)
			assert_true(valid(rw_ring_cons_peek(&c, i), next_read + i));
		rw_ring_cons_release(&c, take);
		next_read += take;
	}
	/* The indices really wrapped. */
	assert_true(atomic_load(&s->ctl.head) < UINT32_MAX - 37);
	assert_true(next_write > 100);
	free(s);
}

static void test_corrupt_indices(void **state)
{
	(void)state;
	shm_t *s = shm_new(8, 100);
	rw_ring_t p, c;
	rw_ring_init(&p, &s->ctl, s->slots, 8, sizeof(entry_t), -1, 1);
	rw_ring_init(&c, &s->ctl, s->slots, 8, sizeof(entry_t), -1, 0);

	/* Producer claims more than a ring of entries: head - tail = 9 > 8. */
	atomic_store(&s->ctl.head, 109);
	assert_int_equal(rw_ring_cons_avail(&c), RW_RING_CORRUPT);
	/* Head behind the consumer's tail (wraps to a huge count). */
	atomic_store(&s->ctl.head, 99);
	assert_int_equal(rw_ring_cons_avail(&c), RW_RING_CORRUPT);
	/* Exactly full is legal. */
	atomic_store(&s->ctl.head, 108);
	assert_int_equal(rw_ring_cons_avail(&c), 8);

	/* Consumer tail ahead of what the producer published. */
	shm_t *s2 = shm_new(8, 0);
	rw_ring_init(&p, &s2->ctl, s2->slots, 8, sizeof(entry_t), -1, 1);
	atomic_store(&s2->ctl.tail, 5);
	assert_int_equal(rw_ring_prod_space(&p, 0), RW_RING_CORRUPT);
	/* Consumer tail more than a ring behind. */
	atomic_store(&s2->ctl.tail, (uint32_t)-9);
	assert_int_equal(rw_ring_prod_space(&p, 0), RW_RING_CORRUPT);
	atomic_store(&s2->ctl.tail, 0);
	assert_int_equal(rw_ring_prod_space(&p, 0), 8);
	free(s);
	free(s2);
}

static void test_armed_wakeup(void **state)
{
	(void)state;
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	assert_true(efd >= 0);
	shm_t *s = shm_new(4, 0);
	rw_ring_t p, c;
	rw_ring_init(&p, &s->ctl, s->slots, 4, sizeof(entry_t), efd, 1);
	rw_ring_init(&c, &s->ctl, s->slots, 4, sizeof(entry_t), -1, 0);

	/* Consumer not armed: publishing makes no system call. */
	fill(rw_ring_prod_next(&p), 0);
	rw_ring_prod_push(&p);
	assert_int_equal(rw_ring_prod_publish(&p), 0);
	assert_int_equal(efd_read(efd), 0);

	/* Arming with an entry ready: do not sleep, flag cleared again. */
	assert_int_equal(rw_ring_cons_arm(&c), 1);
	assert_int_equal(atomic_load(&s->ctl.armed), 0);
	rw_ring_cons_release(&c, 1);

	/* Armed on an empty ring: the next publish writes the eventfd once and clears armed. */
	assert_int_equal(rw_ring_cons_arm(&c), 0);
	assert_int_equal(atomic_load(&s->ctl.armed), 1);
	fill(rw_ring_prod_next(&p), 1);
	rw_ring_prod_push(&p);
	assert_int_equal(rw_ring_prod_publish(&p), 1);
	assert_int_equal(atomic_load(&s->ctl.armed), 0);
	assert_int_equal(efd_read(efd), 1);
	/* Publishing with nothing new does nothing. */
	assert_int_equal(rw_ring_prod_publish(&p), 0);
	fill(rw_ring_prod_next(&p), 2);
	rw_ring_prod_push(&p);
	assert_int_equal(rw_ring_prod_publish(&p), 0);
	assert_int_equal(efd_read(efd), 0);
	free(s);
	close(efd);
}

static void test_space_wakeup(void **state)
{
	(void)state;
	int prod_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	assert_true(prod_efd >= 0);
	shm_t *s = shm_new(2, 0);
	rw_ring_t p, c;
	rw_ring_init(&p, &s->ctl, s->slots, 2, sizeof(entry_t), -1, 1);
	rw_ring_init(&c, &s->ctl, s->slots, 2, sizeof(entry_t), -1, 0);
	rw_ring_set_prod_efd(&c, prod_efd);

	for (int i = 0; i < 2; i++) {
		fill(rw_ring_prod_next(&p), (uint64_t)i);
		rw_ring_prod_push(&p);
	}
	rw_ring_prod_publish(&p);
	/* Full: the producer arms and must wait. */
	assert_int_equal(rw_ring_prod_arm_space(&p), 0);
	assert_int_equal(atomic_load(&s->ctl.space_armed), 1);
	assert_int_equal(rw_ring_cons_avail(&c), 2);
	rw_ring_cons_release(&c, 1);
	assert_int_equal(efd_read(prod_efd), 1);
	assert_int_equal(atomic_load(&s->ctl.space_armed), 0);
	/* Not armed: releasing writes nothing. */
	rw_ring_cons_release(&c, 1);
	assert_int_equal(efd_read(prod_efd), 0);
	/* Arming with space available does not wait. */
	assert_int_equal(rw_ring_prod_arm_space(&p), 2);
	assert_int_equal(atomic_load(&s->ctl.space_armed), 0);
	free(s);
	close(prod_efd);
}

/* ---- two-thread stress ---- */

typedef struct stress {
	shm_t *shm;
	uint32_t size;
	uint64_t count;
	int cons_efd; /* wakes the consumer */
	int prod_efd; /* wakes the producer */
	int failed;
	uint64_t sleeps;
} stress_t;

/* A side that must sleep gives up after 10 s without a wake-up: that is a lost wake-up bug,
 * not slowness (the other side is never more than one publish away from writing the fd). */
static int sleep_on(int efd)
{
	struct pollfd pfd = {.fd = efd, .events = POLLIN};
	int r;
	do
		r = poll(&pfd, 1, 10000);
	while (r < 0 && errno == EINTR);
	if (r <= 0)
		return -1;
	efd_read(efd);
	return 0;
}

static void *producer(void *arg)
{
	stress_t *st = arg;
	rw_ring_t p;
	rw_ring_init(&p, &st->shm->ctl, st->shm->slots, st->size, sizeof(entry_t), st->cons_efd, 1);
	uint64_t seq = 0;
	uint32_t r = 7;
	while (seq < st->count) {
		r ^= r << 13, r ^= r >> 17, r ^= r << 5;
		uint32_t batch = 1 + r % 32;
		if (batch > st->count - seq)
			batch = (uint32_t)(st->count - seq);
		int space = rw_ring_prod_space(&p, batch);
		if (space < 0) {
			st->failed = 1;
			return NULL;
		}
		if ((uint32_t)space < batch) {
			if (space == 0) {
				space = rw_ring_prod_arm_space(&p);
				if (space == 0 && sleep_on(st->prod_efd) < 0) {
					st->failed = 2;
					return NULL;
				}
				continue;
			}
			batch = (uint32_t)space;
		}
		for (uint32_t i = 0; i < batch; i++) {
			fill(rw_ring_prod_next(&p), seq++);
			rw_ring_prod_push(&p);
		}
		rw_ring_prod_publish(&p);
	}
	return NULL;
}

static void test_two_thread_stress(void **state)
{
	(void)state;
	/* Millions of entries in the release build; fewer under ASan (10x slower) to stay fast. */
	uint64_t count = 4000000;
	if (RW_SANITIZE || getenv("RW_SANITIZE"))
		count = 1000000;
	stress_t st = {.size = 64, .count = count};
	st.shm = shm_new(st.size, 0);
	st.cons_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	st.prod_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	assert_true(st.cons_efd >= 0 && st.prod_efd >= 0);

	pthread_t th;
	assert_int_equal(pthread_create(&th, NULL, producer, &st), 0);
	rw_ring_t c;
	rw_ring_init(&c, &st.shm->ctl, st.shm->slots, st.size, sizeof(entry_t), -1, 0);
	rw_ring_set_prod_efd(&c, st.prod_efd);
	uint64_t next = 0, bad = 0;
	uint32_t r = 99;
	while (next < count && !st.failed) {
		int avail = rw_ring_cons_avail(&c);
		if (avail < 0) {
			bad++;
			break;
		}
		if (avail == 0) {
			avail = rw_ring_cons_arm(&c);
			if (avail == 0) {
				st.sleeps++;
				if (sleep_on(st.cons_efd) < 0) {
					bad++;
					break;
				}
				rw_ring_cons_disarm(&c);
			}
			continue;
		}
		/* Release in uneven pieces so the producer sees many different tails. */
		r ^= r << 13, r ^= r >> 17, r ^= r << 5;
		uint32_t take = 1 + r % (uint32_t)avail;
		for (uint32_t i = 0; i < take; i++)
			if (!valid(rw_ring_cons_peek(&c, i), next + i))
				bad++;
		rw_ring_cons_release(&c, take);
		next += take;
	}
	pthread_join(th, NULL);
	assert_int_equal(st.failed, 0);
	assert_int_equal(bad, 0);
	assert_int_equal(next, count);
	print_message("stress: %llu entries, consumer slept %llu times\n",
		      (unsigned long long)count, (unsigned long long)st.sleeps);
	close(st.cons_efd);
	close(st.prod_efd);
	free(st.shm);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_empty_full),
		cmocka_unit_test(test_wraparound),
		cmocka_unit_test(test_corrupt_indices),
		cmocka_unit_test(test_armed_wakeup),
		cmocka_unit_test(test_space_wakeup),
		cmocka_unit_test(test_two_thread_stress),
	};
	return cmocka_run_group_tests_name("ipc_ring", tests, NULL, NULL);
}
