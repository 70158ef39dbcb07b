/* tests/ipc/test_poller.c: the word poller (ipc/poller.c) with a real thread, a real libev loop
 * and words written by other threads, by a CPU store that releases a waiting stream, and by that
 * stream (cuStreamWriteValue64 on the stand-in driver, tests/cuda/libfakecuda.so): every change
 * is reported by its latest value, values never go back, a baseline is not a change, a retired
 * watch is reported once and never read again, a full notice queue loses nothing; while a phase
 * is in flight the thread backs off (spin, yield, sleep) and still sees the next move, or spins
 * the whole phase when told to; a word published by another process (rw_page_word_publish, a
 * host rank's store) ends the thread's sleep, and the daemon's publish ends a rank's nap; with
 * loop_waits, such a store wakes the loop itself, blocked in ev_run, while the thread sleeps on,
 * and a word no one wakes for is still reported, each value once. */
#include <ev.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "cuda/rw_cuda.h"
#include "ipc/ipc.h"
#include "ipc/page.h"
#include "tests/lib/fake_driver.h"

#define NW 16
#define LINE 64

/* Words, one per cache line, in a shared mapping (as a rank page). */
static _Atomic uint64_t *words;
static uint8_t *page;

struct seen {
	uint64_t last[NW * 4];
	unsigned reports[NW * 4];
	unsigned retired[NW * 4];
	int backwards;            /* a value lower than one reported before for the same id */
	uint32_t id_of[NW * 4];   /* test index -> poller id */
};
static struct seen seen;

static _Atomic uint64_t *word(unsigned i) { return (_Atomic uint64_t *)(void *)(page + (size_t)i * LINE); }

static void on_word(void *ctx, uint32_t id, uint64_t value, int retired)
{
	struct seen *s = ctx;
	if (retired) {
		s->retired[id]++;
		return;
	}
	if (s->reports[id] && value <= s->last[id])
		s->backwards++;
	s->last[id] = value;
	s->reports[id]++;
}

static int setup(void **state)
{
	(void)state;
	page = mmap(NULL, 4 * NW * LINE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	words = (_Atomic uint64_t *)(void *)page;
	memset(&seen, 0, sizeof(seen));
	return page == MAP_FAILED ? -1 : 0;
}

static int teardown(void **state)
{
	(void)state;
	munmap(page, 4 * NW * LINE);
	return 0;
}

static const rw_ipc_poller_config_t cfg = {
	.max_watches = NW * 4, .spin_us = 100, .sleep_min_us = 20, .sleep_max_us = 1000,
};

/* cfg with no spin and every sleep sleep_us long: nothing but a wake ends one soon. */
static rw_ipc_poller_config_t sleepy(uint32_t sleep_us)
{
	rw_ipc_poller_config_t c = cfg;
	c.spin_us = 0;
	c.sleep_min_us = c.sleep_max_us = sleep_us;
	return c;
}

/* Run the loop until done(arg) or 10 s (then the case fails on its own assertions). */
static void run_until(struct ev_loop *loop, int (*done)(void *), void *arg)
{
	for (int i = 0; i < 10000 && !done(arg); i++) {
		ev_run(loop, EVRUN_NOWAIT);
		if (!done(arg))
			usleep(1000);
	}
}

static int all_at(void *arg)
{
	uint64_t want = *(uint64_t *)arg;
	for (unsigned i = 0; i < NW; i++)
		if (seen.last[seen.id_of[i]] != want)
			return 0;
	return 1;
}

/* Words first .. n_words-1 written 1..last: stored as a stream writes (no wake), or published
 * as a host rank's CPU does. */
struct writer_args {
	unsigned n_words;
	uint64_t last;
	unsigned first;
	int publish;
};

static void *writer(void *arg)
{
	const struct writer_args *a = arg;
	for (uint64_t k = 1; k <= a->last; k++) {
		for (unsigned i = a->first; i < a->n_words; i++)
			if (a->publish)
				rw_page_word_publish(word(i), k);
			else
				atomic_store_explicit(word(i), k, memory_order_release);
		if (k % 64 == 0)
			usleep(200); /* idle gaps: the poller goes from spinning to sleeping and back */
	}
	return NULL;
}

/* Every word written 1..2000 by another thread: the last value reported for each, in order. */
static void test_reports_every_word_in_order(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_t *p;
	assert_int_equal(rw_ipc_poller_create(loop, &cfg, on_word, &seen, &p), RW_OK);
	for (unsigned i = 0; i < NW; i++)
		assert_int_equal(rw_ipc_poller_watch(p, word(i), &seen.id_of[i]), RW_OK);
	struct writer_args a = { NW, 2000, 0, 0 };
	pthread_t t;
	assert_int_equal(pthread_create(&t, NULL, writer, &a), 0);
	run_until(loop, all_at, &a.last);
	pthread_join(t, NULL);
	for (unsigned i = 0; i < NW; i++) {
		assert_int_equal(seen.last[seen.id_of[i]], 2000);
		assert_true(seen.reports[seen.id_of[i]] >= 1);
	}
	assert_int_equal(seen.backwards, 0);
	rw_ipc_poller_stats_t st;
	rw_ipc_poller_stats(p, &st);
	assert_true(st.moves >= NW);
	assert_true(st.scans > 0);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

static int retired_one(void *arg) { return seen.retired[*(uint32_t *)arg] == 1; }
static int reported(void *arg) { return seen.reports[*(uint32_t *)arg] > 0; }

/* The value at watch time is the baseline; a retired watch is reported once and its word is
 * not read again (it is unmapped right after the report, which ASan would catch a read of). */
static void test_baseline_and_retire(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_t *p;
	uint32_t a, b;
	assert_int_equal(rw_ipc_poller_create(loop, &cfg, on_word, &seen, &p), RW_OK);
	atomic_store(word(0), 5);
	assert_int_equal(rw_ipc_poller_watch(p, word(0), &a), RW_OK);
	usleep(20000); /* the thread scans the table many times meanwhile */
	ev_run(loop, EVRUN_NOWAIT);
	assert_int_equal(seen.reports[a], 0); /* the baseline is no change */
	atomic_store(word(0), 6);
	run_until(loop, reported, &a);
	assert_int_equal(seen.last[a], 6);

	/* retire a watch the thread has read many times */
	rw_ipc_poller_unwatch(p, a);
	rw_ipc_poller_unwatch(p, a); /* twice: still one report */
	run_until(loop, retired_one, &a);
	assert_int_equal(seen.retired[a], 1);
	/* a separate mapping for b, unmapped once retired */
	uint8_t *own = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	assert_true(own != MAP_FAILED);
	assert_int_equal(rw_ipc_poller_watch(p, own, &b), RW_OK);
	rw_ipc_poller_unwatch(p, b); /* perhaps before the thread ever looked at it */
	run_until(loop, retired_one, &b);
	assert_int_equal(seen.retired[b], 1);
	munmap(own, 4096);
	unsigned before = seen.reports[b];
	usleep(20000);
	ev_run(loop, EVRUN_NOWAIT);
	assert_int_equal(seen.reports[b], before);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

static rw_ipc_poller_t *park_p;
static int parked(void *arg) /* the thread has gone to wait *arg times */
{
	rw_ipc_poller_stats_t st;
	rw_ipc_poller_stats(park_p, &st);
	return st.parks >= *(uint64_t *)arg;
}

/* With nothing watched the thread waits for a watch: no scan at all (a daemon without rank
 * pages pays nothing); a watch wakes it and its word is reported; once the last watch retired
 * it waits again; destroying it while it waits returns. */
static void test_parks_with_nothing_watched(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_t *p;
	rw_ipc_poller_stats_t st0, st1;
	assert_int_equal(rw_ipc_poller_create(loop, &cfg, on_word, &seen, &p), RW_OK);
	park_p = p;
	uint64_t times = 1;
	run_until(loop, parked, &times); /* it scans nothing once it counted the wait */
	rw_ipc_poller_stats(p, &st0);
	usleep(30000); /* 30 ms: a sleeping poller (1 ms at most) would scan dozens of times */
	rw_ipc_poller_stats(p, &st1);
	assert_true(st0.parks >= 1);
	assert_int_equal(st1.scans, st0.scans);
	uint32_t a;
	assert_int_equal(rw_ipc_poller_watch(p, word(0), &a), RW_OK);
	atomic_store(word(0), 7);
	run_until(loop, reported, &a);
	assert_int_equal(seen.last[a], 7);
	rw_ipc_poller_unwatch(p, a);
	run_until(loop, retired_one, &a);
	times = 2;
	run_until(loop, parked, &times);
	rw_ipc_poller_stats(p, &st0);
	assert_true(st0.parks >= 2);
	usleep(30000);
	rw_ipc_poller_stats(p, &st1);
	assert_int_equal(st1.scans, st0.scans);
	rw_ipc_poller_destroy(p); /* while it waits */
	ev_loop_destroy(loop);
}

/* The thread's counters have reached *arg (scans, sleeps, yields: 0 = any). */
struct at_least {
	rw_ipc_poller_t *p;
	uint64_t scans, sleeps, yields;
};
static int counted(void *arg)
{
	const struct at_least *w = arg;
	rw_ipc_poller_stats_t st;
	rw_ipc_poller_stats(w->p, &st);
	return st.scans >= w->scans && st.sleeps >= w->sleeps && st.yields >= w->yields;
}

/* A poller on a new loop with schedule (spin, yield, busy bound), word 0 watched (its id in *a)
 * and a phase in flight (busy); end_busy() ends it all. */
static rw_ipc_poller_t *busy_poller(struct ev_loop **loop, uint32_t spin_us, uint32_t yield_us,
				    uint32_t busy_sleep_max_us, uint32_t *a)
{
	*loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_config_t c = cfg;
	c.spin_us = spin_us;
	c.yield_us = yield_us;
	c.busy_sleep_max_us = busy_sleep_max_us;
	rw_ipc_poller_t *p;
	assert_int_equal(rw_ipc_poller_create(*loop, &c, on_word, &seen, &p), RW_OK);
	assert_int_equal(rw_ipc_poller_watch(p, word(0), a), RW_OK);
	rw_ipc_poller_busy(p, 1);
	return p;
}

static void end_busy(rw_ipc_poller_t *p, struct ev_loop *loop)
{
	rw_ipc_poller_busy(p, 0);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

/* While a phase is in flight (busy) and no word moves, the poller goes from spinning to yielding
 * to sleeping (it no longer holds a core for the whole phase), and a word that moves while it
 * sleeps is still reported, by its latest value, in order; then it backs off again and the next
 * move is reported too. No time is asserted: only that it slept and then saw each move. */
static void test_backs_off_while_busy_and_sees_the_next_move(void **state)
{
	(void)state;
	struct ev_loop *loop;
	uint32_t a;
	/* a yield window of 100 ms: a thread kept off the CPU across the whole of it (a loaded
	 * host) would go straight to its sleeps and never yield */
	rw_ipc_poller_t *p = busy_poller(&loop, 50, 100000, 100, &a);
	rw_ipc_poller_stats_t st;
	for (uint64_t v = 1; v <= 3; v++) {
		rw_ipc_poller_stats(p, &st);
		struct at_least backed_off = { p, 0, st.sleeps + 3, 0 };
		run_until(loop, counted, &backed_off); /* asleep (after spinning and yielding) */
		assert_true(counted(&backed_off));
		const unsigned before = seen.reports[a];
		atomic_store_explicit(word(0), 10 * v, memory_order_release);
		atomic_store_explicit(word(0), 10 * v + 1, memory_order_release); /* latest wins */
		for (int i = 0; i < 10000 && seen.last[a] != 10 * v + 1; i++) {
			ev_run(loop, EVRUN_NOWAIT);
			usleep(1000);
		}
		assert_int_equal(seen.last[a], 10 * v + 1);
		assert_true(seen.reports[a] > before);
	}
	assert_int_equal(seen.backwards, 0);
	rw_ipc_poller_stats(p, &st);
	assert_true(st.yields >= 1);
	end_busy(p, loop);
}

static rw_ipc_poller_t *kick_p;
static int kicked(void *arg) /* kick until a kick ended a sleep */
{
	(void)arg;
	rw_ipc_poller_stats_t st;
	rw_ipc_poller_kick(kick_p);
	rw_ipc_poller_stats(kick_p, &st);
	return st.kicks >= 1;
}

/* A kick from the loop ends the thread's sleep (a futex wake, counted) and a word that moves
 * after it is reported. */
static void test_kick_ends_a_sleep(void **state)
{
	(void)state;
	struct ev_loop *loop;
	uint32_t a;
	/* long sleeps while busy: a kick is what ends them */
	rw_ipc_poller_t *p = busy_poller(&loop, 0, 0, cfg.sleep_max_us, &a);
	struct at_least asleep = { p, 0, 2, 0 };
	run_until(loop, counted, &asleep);
	assert_true(counted(&asleep));
	kick_p = p;
	run_until(loop, kicked, NULL);
	assert_true(kicked(NULL));
	atomic_store_explicit(word(0), 4, memory_order_release);
	run_until(loop, reported, &a);
	assert_int_equal(seen.last[a], 4);
	end_busy(p, loop);
}

/* busy_sleep_max_us 0: while busy the thread spins (no sleep, no yield) however long no word
 * moves (kicks find no sleep to end), and still reports a move; once not busy it backs off and
 * sleeps. */
static void test_spins_while_busy_when_told(void **state)
{
	(void)state;
	struct ev_loop *loop;
	uint32_t a;
	rw_ipc_poller_t *p = busy_poller(&loop, 0, 0, 0, &a);
	rw_ipc_poller_stats_t st0, st1;
	rw_ipc_poller_stats(p, &st0);
	struct at_least seen_busy = { p, st0.scans + 3, 0, 0 }; /* passes that began after busy */
	run_until(loop, counted, &seen_busy);
	rw_ipc_poller_stats(p, &st0);
	struct at_least many = { p, st0.scans + 20000, 0, 0 };
	run_until(loop, counted, &many);
	rw_ipc_poller_stats(p, &st1);
	assert_true(counted(&many));
	assert_int_equal(st1.sleeps, st0.sleeps);
	assert_int_equal(st1.yields, st0.yields);
	for (int i = 0; i < 100; i++)
		rw_ipc_poller_kick(p); /* it never sleeps: no kick has a sleep to end */
	rw_ipc_poller_stats(p, &st1);
	assert_int_equal(st1.kicks, 0);
	atomic_store_explicit(word(0), 9, memory_order_release);
	run_until(loop, reported, &a);
	assert_int_equal(seen.last[a], 9);
	rw_ipc_poller_busy(p, 0);
	struct at_least sleeps = { p, 0, st1.sleeps + 1, 0 };
	run_until(loop, counted, &sleeps);
	assert_true(counted(&sleeps));
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

/* A full table refuses, and a slot comes back only with its retired report; bad arguments. */
static void test_table_full_and_bad_arguments(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_t *p;
	rw_ipc_poller_config_t small = cfg, bad = cfg;
	small.max_watches = 4;
	uint32_t id[4], extra;
	bad.sleep_max_us = bad.sleep_min_us - 1;
	assert_int_equal(rw_ipc_poller_create(loop, &bad, on_word, &seen, &p), RW_ERR_INVAL);
	bad = cfg;
	bad.max_watches = 0;
	assert_int_equal(rw_ipc_poller_create(loop, &bad, on_word, &seen, &p), RW_ERR_INVAL);
	bad = cfg;
	bad.busy_sleep_max_us = bad.sleep_min_us - 1; /* a busy bound below the first sleep */
	assert_int_equal(rw_ipc_poller_create(loop, &bad, on_word, &seen, &p), RW_ERR_INVAL);
	bad.busy_sleep_max_us = bad.sleep_max_us + 1; /* or above the idle one */
	assert_int_equal(rw_ipc_poller_create(loop, &bad, on_word, &seen, &p), RW_ERR_INVAL);
	assert_int_equal(rw_ipc_poller_create(loop, &small, on_word, &seen, &p), RW_OK);
	for (unsigned i = 0; i < 4; i++)
		assert_int_equal(rw_ipc_poller_watch(p, word(i), &id[i]), RW_OK);
	assert_int_equal(rw_ipc_poller_watch(p, word(4), &extra), RW_ERR_AGAIN);
	assert_int_equal(rw_ipc_poller_watch(p, NULL, &extra), RW_ERR_INVAL);
	assert_int_equal(rw_ipc_poller_watch(p, page + 4, &extra), RW_ERR_INVAL);
	rw_ipc_poller_unwatch(p, id[2]);
	assert_int_equal(rw_ipc_poller_watch(p, word(4), &extra), RW_ERR_AGAIN); /* not retired yet */
	run_until(loop, retired_one, &id[2]);
	assert_int_equal(rw_ipc_poller_watch(p, word(4), &extra), RW_OK);
	assert_int_equal(extra, id[2]);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

static int all_four_x(void *arg)
{
	uint64_t want = *(uint64_t *)arg;
	for (unsigned i = 0; i < NW * 4; i++)
		if (seen.last[seen.id_of[i]] != want)
			return 0;
	return 1;
}

/* Many more changes than the notice queue holds while the loop does not drain it: nothing is
 * lost, each word's last value arrives. */
static void test_full_queue_loses_nothing(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_t *p;
	rw_ipc_poller_config_t c = cfg;
	c.max_watches = NW * 4; /* queue: 128 notices */
	assert_int_equal(rw_ipc_poller_create(loop, &c, on_word, &seen, &p), RW_OK);
	for (unsigned i = 0; i < NW * 4; i++)
		assert_int_equal(rw_ipc_poller_watch(p, word(i), &seen.id_of[i]), RW_OK);
	struct writer_args a = { NW * 4, 500, 0, 0 };
	writer(&a); /* here, with the loop not running: the queue fills and stays full */
	uint64_t last = 500;
	run_until(loop, all_four_x, &last);
	for (unsigned i = 0; i < NW * 4; i++)
		assert_int_equal(seen.last[seen.id_of[i]], 500);
	assert_int_equal(seen.backwards, 0);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

/* The protocol's hand-off on the stand-in driver: a stream waits on "plan >= 1" and then writes
 * "packed = 42" (cuStreamWriteValue64); the CPU publishes plan; the poller reports packed. */
static void test_stream_written_word(void **state)
{
	(void)state;
	if (rw_cuda_init() != RW_OK) {
		print_message("skipped: no CUDA driver: %s\n", rw_cuda_unavailable_reason());
		skip();
	}
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_t *p;
	rw_cuda_dptr_t dev;
	rw_cuda_stream_t *s;
	rw_cuda_ext_stream_t e;
	uint32_t id;
	assert_int_equal(rw_cuda_host_register_mapped(page, 4 * NW * LINE, &dev), RW_OK);
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_ext_stream_of(s, &e), RW_OK);
	assert_int_equal(rw_ipc_poller_create(loop, &cfg, on_word, &seen, &p), RW_OK);
	assert_int_equal(rw_ipc_poller_watch(p, word(1), &id), RW_OK);
	assert_int_equal(rw_cuda_word_wait(&e, dev, 1), RW_OK);          /* word 0: plan */
	assert_int_equal(rw_cuda_word_write(&e, dev + LINE, 42), RW_OK); /* word 1: packed */
	usleep(20000);
	ev_run(loop, EVRUN_NOWAIT);
	assert_int_equal(seen.reports[id], 0); /* the stream still waits */
	atomic_store_explicit(word(0), 1, memory_order_release);
	run_until(loop, reported, &id);
	assert_int_equal(seen.last[id], 42);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	rw_ipc_poller_destroy(p);
	rw_cuda_stream_destroy(s);
	rw_cuda_host_unregister(page);
	ev_loop_destroy(loop);
}

/* Until process `pid` sleeps (its state in /proc/PID/stat is S), at most 10 s. */
static int wait_sleeping(pid_t pid)
{
	char path[64], buf[256];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	for (int i = 0; i < 10000; i++) {
		FILE *f = fopen(path, "r");
		size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
		if (f)
			fclose(f);
		buf[n] = 0;
		const char *close = strrchr(buf, ')'); /* "pid (comm) S ..." */
		if (close && close[1] == ' ' && close[2] == 'S')
			return 1;
		usleep(1000);
	}
	return 0;
}

/* Publish `value` into word i from a child process, as a host rank does. */
static void publish_from_child(unsigned i, uint64_t value)
{
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		rw_page_word_publish(word(i), value);
		_exit(0);
	}
	int status;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* A word published by another process while the thread sleeps (sleeps of 1 s: nothing else ends
 * them this soon) ends the sleep through the word's own futex (counted as a word wake-up, not a
 * kick), and the value is reported. The thread may be between two sleeps when a value comes:
 * then the next value is tried, each after it is seen asleep again. */
static void test_published_word_ends_a_sleep(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	const rw_ipc_poller_config_t c = sleepy(1000000);
	rw_ipc_poller_t *p;
	uint32_t a, b;
	assert_int_equal(rw_ipc_poller_create(loop, &c, on_word, &seen, &p), RW_OK);
	assert_int_equal(rw_ipc_poller_watch(p, word(0), &a), RW_OK);
	assert_int_equal(rw_ipc_poller_watch(p, word(3), &b), RW_OK); /* watched, never moves */
	rw_ipc_poller_stats_t st = { 0 };
	for (uint64_t v = 1; v <= 20 && st.word_wakes == 0; v++) {
		rw_ipc_poller_stats(p, &st);
		struct at_least asleep = { p, 0, st.sleeps + 1, 0 };
		run_until(loop, counted, &asleep); /* one sleep over: the next has likely begun */
		publish_from_child(0, v);
		run_until(loop, reported, &a);
		assert_int_equal(seen.last[a], v);
		seen.reports[a] = 0;
		rw_ipc_poller_stats(p, &st);
	}
	assert_true(st.word_wakes >= 1);
	assert_int_equal(st.kicks, 0);
	assert_int_equal(seen.reports[b], 0);
	assert_int_equal(seen.backwards, 0);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

/* Once every watched word has woken the thread, a phase in flight no longer bounds its sleeps
 * by busy_sleep_max_us (100 µs: about 3000 sleeps in 0.3 s) but by sleep_max_us (1 ms: about
 * 300): the words' writers end a sleep themselves. A sleep is never shorter than its bound unless
 * something ends it, and nothing does here, so the count can only come out below the limit. */
static void test_wakers_sleep_long_while_busy(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_config_t c = cfg;
	c.spin_us = 0;
	c.busy_sleep_max_us = 100;
	c.waker_spin_cpus = 1u << 20; /* as on a host short of CPUs, whatever this one has */
	rw_ipc_poller_t *p;
	uint32_t a;
	assert_int_equal(rw_ipc_poller_create(loop, &c, on_word, &seen, &p), RW_OK);
	assert_int_equal(rw_ipc_poller_watch(p, word(0), &a), RW_OK);
	rw_ipc_poller_stats_t st = { 0 };
	for (uint64_t v = 1; v <= 200 && st.word_wakes == 0; v++) { /* until word 0 woke it */
		rw_ipc_poller_stats(p, &st);
		struct at_least asleep = { p, 0, st.sleeps + 1, 0 };
		run_until(loop, counted, &asleep);
		publish_from_child(0, v);
		run_until(loop, reported, &a);
		seen.reports[a] = 0;
		rw_ipc_poller_stats(p, &st);
	}
	assert_true(st.word_wakes >= 1);
	rw_ipc_poller_busy(p, 1);
	rw_ipc_poller_stats(p, &st);
	const uint64_t before = st.sleeps;
	usleep(300000);
	rw_ipc_poller_stats(p, &st);
	assert_true(st.sleeps - before <= 600);
	assert_true(st.sleeps - before >= 1);
	end_busy(p, loop);
}

/* Run the loop blocking (EVRUN_ONCE: it sleeps in its own wait until something is ready) until
 * done(arg), or until a 10 s guard timer fires (then the case fails on its own assertions). */
static void guard_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop; (void)revents;
	*(int *)w->data = 1;
}
static void run_blocking_until(struct ev_loop *loop, int (*done)(void *), void *arg)
{
	int fired = 0;
	ev_timer guard;
	ev_timer_init(&guard, guard_cb, 10.0, 0.0);
	guard.data = &fired;
	ev_timer_start(loop, &guard);
	while (!done(arg) && !fired)
		ev_run(loop, EVRUN_ONCE);
	ev_timer_stop(loop, &guard);
}

/* A poller on `loop` whose loop waits on the words itself, word(0) watched (id in *a), the
 * wait armed; NULL (the case then skips, saying why) where the kernel or the host's policy
 * refuses the loop's wait (io_uring FUTEX_WAITV: Linux 6.7+). */
static rw_ipc_poller_t *loop_waiting_poller(struct ev_loop *loop, rw_ipc_poller_config_t c,
					    uint32_t *a)
{
	rw_ipc_poller_t *p;
	c.loop_waits = 1;
	assert_int_equal(rw_ipc_poller_create(loop, &c, on_word, &seen, &p), RW_OK);
	assert_int_equal(rw_ipc_poller_watch(p, word(0), a), RW_OK);
	ev_run(loop, EVRUN_NOWAIT); /* its prepare arms the loop's wait */
	rw_ipc_poller_stats_t st;
	rw_ipc_poller_stats(p, &st);
	if (st.loop_waits)
		return p;
	print_message("skipped: the loop cannot wait on words here (io_uring FUTEX_WAITV: Linux "
		      "6.7+, not refused by the host's policy)\n");
	rw_ipc_poller_destroy(p);
	return NULL;
}

static uint32_t kick_retired_id;
static int kick_until_retired(void *arg) /* the thread naps on its kick: kick it to look */
{
	(void)arg;
	rw_ipc_poller_kick(kick_p);
	return seen.retired[kick_retired_id] == 1;
}

/* With loop_waits, a word published by another process wakes the loop, blocked in ev_run, while
 * the thread sleeps on (30 s sleeps on its kick alone: had the loop not woken by itself, the
 * 10 s guard would end the wait first); no word ever wakes the thread. The loop's wait follows
 * the table: a word watched after it was armed (a cancel, then a new arm) wakes it too, and a
 * word retired and unmapped meanwhile harms nothing (ASan). */
static void test_loop_waits_on_published_words(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	uint32_t a, b, d;
	rw_ipc_poller_t *p = loop_waiting_poller(loop, sleepy(30000000), &a);
	if (!p) {
		ev_loop_destroy(loop);
		skip();
	}
	kick_p = p;
	run_until(loop, kicked, NULL); /* the nap it began before the arm ends: from now on it
					* naps on its kick alone */
	for (uint64_t v = 1; v <= 5; v++) {
		ev_run(loop, EVRUN_NOWAIT); /* armed again before the store (else its look sees it) */
		publish_from_child(0, v);
		run_blocking_until(loop, reported, &a);
		assert_int_equal(seen.last[a], v);
		seen.reports[a] = 0;
	}
	/* d, on a mapping of its own, is watched and armed; then b comes and d goes */
	uint8_t *own = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	assert_true(own != MAP_FAILED);
	assert_int_equal(rw_ipc_poller_watch(p, own, &d), RW_OK);
	ev_run(loop, EVRUN_NOWAIT); /* cancel the wait over a alone, arm it over a and d */
	ev_run(loop, EVRUN_NOWAIT);
	assert_int_equal(rw_ipc_poller_watch(p, word(3), &b), RW_OK);
	rw_ipc_poller_unwatch(p, d);
	kick_retired_id = d;
	run_until(loop, kick_until_retired, NULL);
	assert_int_equal(seen.retired[d], 1);
	munmap(own, 4096);
	for (uint64_t v = 1; v <= 3; v++) {
		ev_run(loop, EVRUN_NOWAIT);
		publish_from_child(3, v);
		run_blocking_until(loop, reported, &b);
		assert_int_equal(seen.last[b], v);
		seen.reports[b] = 0;
	}
	rw_ipc_poller_stats_t st;
	rw_ipc_poller_stats(p, &st);
	assert_true(st.loop_wakes >= 8);
	assert_int_equal(st.word_wakes, 0);
	assert_int_equal(seen.reports[d], 0);
	assert_int_equal(seen.backwards, 0);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

/* With loop_waits, once the loop's wait covers every watched word and each has woken it, the
 * thread sleeps long (RW_IPC_POLLER_COVERED_SLEEP_US, 100 ms: at most a few sleeps in 0.3 s
 * where its 1 ms bound would give about 300): nothing is left for it to look at. A watch wakes
 * it (a word only stored, as a stream writes, is reported), and so does an unwatch (the
 * retirement is reported without a kick). */
static void test_loop_waits_thread_sleeps_long(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	uint32_t a, b;
	rw_ipc_poller_config_t c = cfg;
	c.waker_spin_cpus = 1u << 20; /* as on a host short of CPUs, whatever this one has */
	rw_ipc_poller_t *p = loop_waiting_poller(loop, c, &a);
	if (!p) {
		ev_loop_destroy(loop);
		skip();
	}
	ev_run(loop, EVRUN_NOWAIT);
	publish_from_child(0, 1);
	run_blocking_until(loop, reported, &a);
	assert_int_equal(seen.last[a], 1);
	rw_ipc_poller_stats_t st;
	rw_ipc_poller_stats(p, &st);
	assert_true(st.loop_wakes >= 1);
	usleep(20000); /* the thread's next scans find no word that never woke anyone */
	rw_ipc_poller_stats(p, &st);
	const uint64_t before = st.sleeps;
	usleep(300000);
	rw_ipc_poller_stats(p, &st);
	assert_true(st.sleeps - before <= 10);
	assert_int_equal(rw_ipc_poller_watch(p, word(4), &b), RW_OK);
	atomic_store_explicit(word(4), 3, memory_order_release);
	run_until(loop, reported, &b);
	assert_int_equal(seen.last[b], 3);
	rw_ipc_poller_unwatch(p, b);
	run_until(loop, retired_one, &b);
	assert_int_equal(seen.retired[b], 1);
	assert_int_equal(seen.backwards, 0);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

/* With loop_waits, words published (the loop's wait sees them) beside words only stored (as a
 * stream writes: only the thread's scan sees them), 1..2000 each from two threads: every word's
 * last value arrives, and no value is handed on twice or goes back, though the loop's own look
 * and the thread's notices both carry the published ones. */
static void test_loop_waits_beside_silent_words(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	uint32_t a;
	rw_ipc_poller_t *p = loop_waiting_poller(loop, cfg, &a);
	if (!p) {
		ev_loop_destroy(loop);
		skip();
	}
	seen.id_of[0] = a;
	for (unsigned i = 1; i < NW; i++)
		assert_int_equal(rw_ipc_poller_watch(p, word(i), &seen.id_of[i]), RW_OK);
	struct writer_args pub = { NW / 2, 2000, 0, 1 }, silent = { NW, 2000, NW / 2, 0 };
	pthread_t t1, t2;
	assert_int_equal(pthread_create(&t1, NULL, writer, &pub), 0);
	assert_int_equal(pthread_create(&t2, NULL, writer, &silent), 0);
	run_until(loop, all_at, &pub.last);
	pthread_join(t1, NULL);
	pthread_join(t2, NULL);
	for (unsigned i = 0; i < NW; i++)
		assert_int_equal(seen.last[seen.id_of[i]], 2000);
	assert_int_equal(seen.backwards, 0);
	rw_ipc_poller_stats_t st;
	rw_ipc_poller_stats(p, &st);
	assert_true(st.loop_wakes >= 1);
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
}

/* The other direction: a process napping on a word (a host rank waiting for plan, 30 s bound)
 * is woken by the publish of another (the daemon's), and a nap on a word that already moved does
 * not sleep at all. */
static void test_publish_ends_a_nap(void **state)
{
	(void)state;
	atomic_store_explicit(word(5), 0x100000000ull, memory_order_relaxed); /* high half: 1 */
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		int r = rw_page_word_nap(word(5), 0x100000000ull, 30000000000L);
		uint64_t v = atomic_load_explicit(word(5), memory_order_acquire);
		_exit(r == RW_PAGE_NAP_WOKEN && v == 0x100000007ull ? 0 : 10 + r);
	}
	assert_true(wait_sleeping(pid));
	rw_page_word_publish(word(5), 0x100000007ull);
	int status;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	assert_int_equal(rw_page_word_nap(word(5), 0x100000000ull, 30000000000L), RW_PAGE_NAP_MOVED);
	assert_int_equal(rw_page_word_nap(word(5), 0x100000007ull, 1000), RW_PAGE_NAP_TIMEOUT);
}

int main(int argc, char **argv)
{
	(void)argc;
	rw_test_use_fake_cuda(argv[0]);
	rw_log_set_level(RW_LOG_WARN);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_reports_every_word_in_order, setup, teardown),
		cmocka_unit_test_setup_teardown(test_baseline_and_retire, setup, teardown),
		cmocka_unit_test_setup_teardown(test_table_full_and_bad_arguments, setup, teardown),
		cmocka_unit_test_setup_teardown(test_full_queue_loses_nothing, setup, teardown),
		cmocka_unit_test_setup_teardown(test_stream_written_word, setup, teardown),
		cmocka_unit_test_setup_teardown(test_parks_with_nothing_watched, setup, teardown),
		cmocka_unit_test_setup_teardown(test_backs_off_while_busy_and_sees_the_next_move, setup,
						teardown),
		cmocka_unit_test_setup_teardown(test_spins_while_busy_when_told, setup, teardown),
		cmocka_unit_test_setup_teardown(test_kick_ends_a_sleep, setup, teardown),
		cmocka_unit_test_setup_teardown(test_published_word_ends_a_sleep, setup, teardown),
		cmocka_unit_test_setup_teardown(test_publish_ends_a_nap, setup, teardown),
		cmocka_unit_test_setup_teardown(test_wakers_sleep_long_while_busy, setup, teardown),
		cmocka_unit_test_setup_teardown(test_loop_waits_on_published_words, setup, teardown),
		cmocka_unit_test_setup_teardown(test_loop_waits_beside_silent_words, setup, teardown),
		cmocka_unit_test_setup_teardown(test_loop_waits_thread_sleeps_long, setup, teardown),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	rw_cuda_shutdown();
	return rc;
}
