/* Seeded, reproducible randomness for the unit tests: splitmix64, seed from RW_TEST_SEED or a
 * fixed default, printed so that a failing run can be replayed. Header-only (static). */
#ifndef RW_TEST_RNG_H
#define RW_TEST_RNG_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static uint64_t rng_state;

static inline uint64_t rng_next(void) /* splitmix64 */
{
	uint64_t z = (rng_state += UINT64_C(0x9e3779b97f4a7c15));
	z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
	return z ^ (z >> 31);
}

static inline uint32_t rng_below(uint32_t n) { return n ? (uint32_t)(rng_next() % n) : 0; }

static inline void seed_rng(const char *test)
{
	const char *env = getenv("RW_TEST_SEED");
	uint64_t seed = env ? strtoull(env, NULL, 0) : UINT64_C(20240611);
	rng_state = seed;
	printf("%s: seed %" PRIu64 " (RW_TEST_SEED=%" PRIu64 " reproduces)\n", test, seed, seed);
}

#endif /* RW_TEST_RNG_H */
