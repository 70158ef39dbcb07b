/* memcpy_ceiling: the plain-memcpy ceiling of the shm benchmark (docs/perf/shm.md). One thread
 * per byte count given (the shm transport copies with one thread per rail of each daemon, so
 * the benchmark passes one count per (node, rail): the bytes that rail sent in a phase); every
 * thread copies its bytes between two buffers of its own (touched beforehand, as a daemon's slabs
 * are), all start together, and the time is from the first one's start to the last one's end. Prints
 * the median over --reps runs in microseconds.
 *
 *   memcpy_ceiling [--reps N] BYTES [BYTES ...] */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/common.h"

#define MAX_THREADS 256
#define MAX_REPS 101

typedef struct copier {
	pthread_t thread;
	uint8_t *src, *dst;
	uint64_t bytes;
	uint64_t t0, t1; /* this copy's start and end (ns) */
} copier_t;

static pthread_barrier_t start;

static void *copy_main(void *arg)
{
	copier_t *c = arg;
	pthread_barrier_wait(&start);
	c->t0 = rw_now_ns();
	memcpy(c->dst, c->src, c->bytes);
	c->t1 = rw_now_ns();
	return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	copier_t c[MAX_THREADS];
	unsigned n = 0, reps = 5;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
			reps = (unsigned)atoi(argv[++i]);
			continue;
		}
		if (n == MAX_THREADS) {
			fprintf(stderr, "memcpy_ceiling: at most %d threads\n", MAX_THREADS);
			return 2;
		}
		c[n++].bytes = strtoull(argv[i], NULL, 10);
	}
	if (n == 0 || reps == 0 || reps > MAX_REPS) {
		fprintf(stderr, "usage: memcpy_ceiling [--reps 1..%d] BYTES [BYTES ...]\n", MAX_REPS);
		return 2;
	}
	for (unsigned i = 0; i < n; i++) {
		uint64_t len = c[i].bytes ? c[i].bytes : 1;
		c[i].src = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		c[i].dst = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (c[i].src == MAP_FAILED || c[i].dst == MAP_FAILED) {
			perror("memcpy_ceiling: mmap");
			return 1;
		}
		memset(c[i].src, 0x5a, len);
		memset(c[i].dst, 0, len);
	}
	uint64_t us[MAX_REPS];
	for (unsigned r = 0; r < reps; r++) {
		pthread_barrier_init(&start, NULL, n + 1);
		for (unsigned i = 0; i < n; i++)
			pthread_create(&c[i].thread, NULL, copy_main, &c[i]);
		pthread_barrier_wait(&start);
		uint64_t t0 = UINT64_MAX, t1 = 0;
		for (unsigned i = 0; i < n; i++) {
			pthread_join(c[i].thread, NULL);
			t0 = RW_MIN(t0, c[i].t0);
			t1 = RW_MAX(t1, c[i].t1);
		}
		us[r] = (t1 - t0) / 1000;
		pthread_barrier_destroy(&start);
	}
	qsort(us, reps, sizeof(us[0]), cmp_u64);
	printf("%llu\n", (unsigned long long)us[reps / 2]);
	return 0;
}
