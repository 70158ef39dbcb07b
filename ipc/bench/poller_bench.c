/* ipc/bench/poller_bench.c: what the word poller (ipc/poller.c) costs and how fast it sees a
 * word move, in one run: the daemon's schedule (the RW_IPC_POLLER_* defaults: spin, yield,
 * sleeps bounded lower while a phase is in flight) against a baseline of the former schedule
 * (spin 200 µs after a move and the whole time a phase is in flight: busy_sleep_max_us 0),
 * alternating, each regime `reps` times: the poller's thread CPU per second of wall time, and the
 * latency from a writer thread's store to the loop's callback (p50, p99). Regimes: no phase and
 * no move (idle), a phase in flight and no move, a phase with moves 50 µs apart (a 1-token
 * phase's hand-offs) and 1 ms apart (a long phase's: a host rank copying between its words).
 * Last, what rw_page_word_publish (a store and a futex wake) costs its writer when no one sleeps.
 * Usage: poller_bench [watches (64)] [seconds per regime (1)] [reps (3)]. Not a test: it prints
 * numbers (medians over the reps, and new / old). */
#include <ev.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "ipc/ipc.h"
#include "ipc/page.h"

#define MAXLAT 400000

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

struct run {
	_Atomic uint64_t *words; /* one per 64 bytes */
	unsigned n_words;
	uint64_t gap_ns;         /* between two stores of the writer (0: no writer) */
	uint64_t end_ns;
	_Atomic int stop;
	uint64_t lat[MAXLAT];
	unsigned n_lat;
};

static void on_word(void *ctx, uint32_t id, uint64_t value, int retired)
{
	struct run *r = ctx;
	(void)id;
	if (!retired && value && r->n_lat < MAXLAT)
		r->lat[r->n_lat++] = now_ns() - value;
}

static void *writer(void *arg)
{
	struct run *r = arg;
	unsigned i = 0;
	while (!atomic_load(&r->stop)) {
		uint64_t t0 = now_ns();
		atomic_store_explicit(&r->words[(size_t)(i++ % r->n_words) * 8], t0, memory_order_release);
		while (now_ns() - t0 < r->gap_ns && !atomic_load(&r->stop))
			if (r->gap_ns > 200000)
				usleep(100);
	}
	return NULL;
}

static void on_end(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)w; (void)revents;
	ev_break(loop, EVBREAK_ALL);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* One regime: returns the poller's CPU share of one core; fills p50/p99 (µs) when there was a
 * writer. */
static double regime(struct run *r, const rw_ipc_poller_config_t *sched, int busy, uint64_t gap_ns,
		     double secs, double *p50, double *p99)
{
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_poller_config_t cfg = *sched;
	cfg.max_watches = r->n_words;
	rw_ipc_poller_t *p;
	if (rw_ipc_poller_create(loop, &cfg, on_word, r, &p) != RW_OK)
		exit(1);
	for (unsigned i = 0; i < r->n_words; i++) {
		uint32_t id;
		atomic_store(&r->words[(size_t)i * 8], 0);
		if (rw_ipc_poller_watch(p, (const void *)&r->words[(size_t)i * 8], &id) != RW_OK)
			exit(1);
	}
	if (busy)
		rw_ipc_poller_busy(p, 1);
	r->n_lat = 0;
	r->gap_ns = gap_ns;
	atomic_store(&r->stop, 0);
	usleep(50000); /* the poller settles (asleep unless busy) */
	rw_ipc_poller_stats_t s0, s1;
	rw_ipc_poller_stats(p, &s0);
	uint64_t t0 = now_ns();
	pthread_t w;
	if (gap_ns && pthread_create(&w, NULL, writer, r) != 0)
		exit(1);
	ev_timer end;
	ev_timer_init(&end, on_end, secs, 0.);
	ev_timer_start(loop, &end);
	ev_run(loop, 0);
	atomic_store(&r->stop, 1);
	if (gap_ns)
		pthread_join(w, NULL);
	rw_ipc_poller_stats(p, &s1);
	double wall = (double)(now_ns() - t0);
	*p50 = *p99 = 0;
	if (r->n_lat) {
		qsort(r->lat, r->n_lat, sizeof(r->lat[0]), cmp_u64);
		*p50 = (double)r->lat[r->n_lat / 2] / 1000.;
		*p99 = (double)r->lat[(size_t)r->n_lat * 99 / 100] / 1000.;
	}
	printf("    scans %llu yields %llu sleeps %llu moves %llu wakeups %llu\n",
	       (unsigned long long)(s1.scans - s0.scans), (unsigned long long)(s1.yields - s0.yields),
	       (unsigned long long)(s1.sleeps - s0.sleeps),
	       (unsigned long long)(s1.moves - s0.moves), (unsigned long long)(s1.wakeups - s0.wakeups));
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
	return (double)(s1.cpu_ns - s0.cpu_ns) / wall;
}

static double median(double *x, int n)
{
	double y[16];
	memcpy(y, x, (size_t)n * sizeof(*x));
	for (int i = 1; i < n; i++)
		for (int j = i; j > 0 && y[j - 1] > y[j]; j--) {
			double t = y[j];
			y[j] = y[j - 1];
			y[j - 1] = t;
		}
	return n % 2 ? y[n / 2] : (y[n / 2 - 1] + y[n / 2]) / 2;
}

int main(int argc, char **argv)
{
	struct run *r = calloc(1, sizeof(*r));
	if (!r)
		return 2;
	r->n_words = argc > 1 ? (unsigned)atoi(argv[1]) : 64;
	double secs = argc > 2 ? atof(argv[2]) : 1.0;
	int reps = argc > 3 ? atoi(argv[3]) : 3;
	if (r->n_words == 0 || r->n_words > 4096 || secs <= 0 || reps < 1 || reps > 16)
		return 2;
	r->words = aligned_alloc(64, (size_t)r->n_words * 64);
	memset((void *)r->words, 0, (size_t)r->n_words * 64);
	const rw_ipc_poller_config_t sched[2] = {
		{ .spin_us = 200, .sleep_min_us = 20, .sleep_max_us = 1000 }, /* old: spin while busy */
		{ .spin_us = RW_IPC_POLLER_SPIN_US, .yield_us = RW_IPC_POLLER_YIELD_US,
		  .sleep_min_us = RW_IPC_POLLER_SLEEP_MIN_US, .sleep_max_us = RW_IPC_POLLER_SLEEP_MAX_US,
		  .busy_sleep_max_us = RW_IPC_POLLER_BUSY_SLEEP_MAX_US },
	};
	printf("word poller: %u watched words, %.1f s per regime, %d reps alternating; old: spin 200 "
	       "us, spin while busy, sleeps 20..1000 us; new: spin %u us, yield %u us, sleeps %u..%u "
	       "us (%u us while busy)\n", r->n_words, secs, reps, sched[1].spin_us,
	       sched[1].yield_us, sched[1].sleep_min_us, sched[1].sleep_max_us,
	       sched[1].busy_sleep_max_us);
	const struct { const char *name; int busy; uint64_t gap; } rs[] = {
		{ "no phase, no moves", 0, 0 },
		{ "phase in flight, no moves", 1, 0 },
		{ "phase in flight, moves every 50 us", 1, 50000 },
		{ "phase in flight, moves every 1 ms", 1, 1000000 },
	};
	for (size_t i = 0; i < sizeof(rs) / sizeof(rs[0]); i++) {
		double cpu[2][16], p50[2][16], p99[2][16];
		for (int k = 0; k < reps; k++)
			for (int s = 0; s < 2; s++) {
				printf("%s, %s (rep %d)\n", rs[i].name, s ? "new" : "old", k + 1);
				cpu[s][k] = regime(r, &sched[s], rs[i].busy, rs[i].gap, secs, &p50[s][k],
						   &p99[s][k]);
			}
		for (int s = 0; s < 2; s++) {
			double lo = cpu[s][0], hi = cpu[s][0];
			for (int k = 1; k < reps; k++) {
				lo = cpu[s][k] < lo ? cpu[s][k] : lo;
				hi = cpu[s][k] > hi ? cpu[s][k] : hi;
			}
			printf("  %s: poller CPU %.2f%% of a core (reps %.2f..%.2f)\n", s ? "new" : "old",
			       100 * median(cpu[s], reps), 100 * lo, 100 * hi);
		}
		double c0 = median(cpu[0], reps), c1 = median(cpu[1], reps);
		printf("= %-36s CPU old %.2f%% new %.2f%% (new/old %.3f)", rs[i].name, 100 * c0, 100 * c1,
		       c0 > 0 ? c1 / c0 : 0);
		if (rs[i].gap)
			printf("; store -> callback p50 old %.1f us new %.1f us, p99 old %.1f new %.1f",
			       median(p50[0], reps), median(p50[1], reps), median(p99[0], reps),
			       median(p99[1], reps));
		printf("\n");
	}
	/* What a published word costs its writer when no one sleeps on it (the daemon's plan and
	 * arrived for a CUDA rank; a host rank's words while the poller spins), against a plain
	 * store-release, on a memfd mapping as a rank page is. */
	const int fd = memfd_create("poller_bench", 0);
	_Atomic uint64_t *pw = fd >= 0 && ftruncate(fd, 4096) == 0 ?
			       mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
	if (pw != MAP_FAILED) {
		const unsigned n = 200000;
		for (int k = 0; k < 3; k++) {
			uint64_t t0 = now_ns();
			for (unsigned i = 0; i < n; i++)
				rw_page_word_publish(pw, i);
			uint64_t t1 = now_ns();
			for (unsigned i = 0; i < n; i++)
				atomic_store_explicit(pw, i, memory_order_release);
			uint64_t t2 = now_ns();
			printf("= publish with no sleeper (rep %d): %.0f ns a word; a store alone %.1f ns\n",
			       k + 1, (double)(t1 - t0) / n, (double)(t2 - t1) / n);
		}
		munmap((void *)pw, 4096);
	}
	if (fd >= 0)
		close(fd);
	free((void *)r->words);
	free(r);
	return 0;
}
