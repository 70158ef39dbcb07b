/* ipc/bench/poller_bench.c: what the word poller (ipc/poller.c) costs and how fast it sees a
 * word move, in one run, against a baseline of the same poller held spinning (busy) the whole
 * time: the poller's thread CPU per second of wall time, and the latency from a writer thread's
 * store to the loop's callback (p50, p99), for three regimes: phases in flight (busy: spin),
 * moves 50 µs apart (inside the spin window), moves 5 ms apart (asleep between them).
 * Usage: poller_bench [watches (64)] [seconds per regime (2)]. Not a test: it prints numbers. */
#include <ev.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ipc/ipc.h"

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
static double regime(struct run *r, int busy, uint64_t gap_ns, double secs, double *p50, double *p99)
{
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	const rw_ipc_poller_config_t cfg = { .max_watches = r->n_words, .spin_us = 200,
					     .sleep_min_us = 20, .sleep_max_us = 1000 };
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
	printf("    scans %llu sleeps %llu moves %llu wakeups %llu\n",
	       (unsigned long long)(s1.scans - s0.scans), (unsigned long long)(s1.sleeps - s0.sleeps),
	       (unsigned long long)(s1.moves - s0.moves), (unsigned long long)(s1.wakeups - s0.wakeups));
	rw_ipc_poller_destroy(p);
	ev_loop_destroy(loop);
	return (double)(s1.cpu_ns - s0.cpu_ns) / wall;
}

int main(int argc, char **argv)
{
	struct run *r = calloc(1, sizeof(*r));
	r->n_words = argc > 1 ? (unsigned)atoi(argv[1]) : 64;
	double secs = argc > 2 ? atof(argv[2]) : 2.0;
	if (!r || r->n_words == 0 || r->n_words > 4096 || secs <= 0)
		return 2;
	r->words = aligned_alloc(64, (size_t)r->n_words * 64);
	memset((void *)r->words, 0, (size_t)r->n_words * 64);
	printf("word poller: %u watched words, %.1f s per regime, spin window 200 us, sleeps 20..1000 us\n",
	       r->n_words, secs);
	struct { const char *name; int busy; uint64_t gap; } rs[] = {
		{ "idle (no moves), adaptive", 0, 0 },
		{ "idle (no moves), held spinning (baseline)", 1, 0 },
		{ "moves every 50 us, adaptive", 0, 50000 },
		{ "moves every 50 us, held spinning (baseline)", 1, 50000 },
		{ "moves every 5 ms, adaptive", 0, 5000000 },
		{ "moves every 5 ms, held spinning (baseline)", 1, 5000000 },
	};
	double cpu[6], p50[6], p99[6];
	for (int i = 0; i < 6; i++) {
		printf("%s\n", rs[i].name);
		cpu[i] = regime(r, rs[i].busy, rs[i].gap, secs, &p50[i], &p99[i]);
		printf("    poller CPU %.2f%% of a core", 100 * cpu[i]);
		if (rs[i].gap)
			printf(", store -> callback p50 %.1f us p99 %.1f us", p50[i], p99[i]);
		printf("\n");
	}
	printf("ratios adaptive / spinning: idle CPU %.4f; 50 us moves CPU %.3f p50 %.2f; 5 ms moves CPU %.4f p50 %.2f\n",
	       cpu[0] / cpu[1], cpu[2] / cpu[3], p50[2] / p50[3], cpu[4] / cpu[5], p50[4] / p50[5]);
	free((void *)r->words);
	free(r);
	return 0;
}
