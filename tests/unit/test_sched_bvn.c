/* Birkhoff-von Neumann baseline: on random demands (seeded) every stage is a partial
 * permutation without self-sends, the stage weights covering each (s, d) reach its demand and
 * overshoot by less than the last stage that names it, nothing is sent where there is no
 * demand, the total time equals the largest line sum (BvN's optimum), and there are at most N^2
 * stages. Balanced inputs are covered exactly. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "sched/sched.h"

static uint64_t rng_state;

static uint64_t rng_next(void)
{
	/* splitmix64: small, seeded, reproducible. */
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t rng_below(uint64_t n) { return n ? rng_next() % n : 0; }

typedef struct bvn_out {
	uint32_t stages;
	uint32_t *perm;
	uint64_t *weight;
} bvn_out_t;

static bvn_out_t run_bvn(uint32_t n, const uint64_t *demand, uint32_t max_stages)
{
	bvn_out_t o;
	void *ws = malloc(rw_sched_bvn_workspace(n));
	o.perm = malloc(sizeof(uint32_t) * ((size_t)max_stages * n + 1));
	o.weight = malloc(sizeof(uint64_t) * ((size_t)max_stages + 1));
	assert_non_null(ws);
	assert_non_null(o.perm);
	assert_non_null(o.weight);
	o.stages = rw_sched_bvn_plan(n, demand, max_stages, o.perm, o.weight, ws);
	free(ws);
	return o;
}

static void free_out(bvn_out_t *o)
{
	free(o->perm);
	free(o->weight);
}

static uint64_t max_line_sum(uint32_t n, const uint64_t *demand)
{
	uint64_t best = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t row = 0, col = 0;
		for (uint32_t j = 0; j < n; j++) {
			if (i == j)
				continue;
			row += demand[(size_t)i * n + j];
			col += demand[(size_t)j * n + i];
		}
		best = RW_MAX(best, RW_MAX(row, col));
	}
	return best;
}

/* Check every property; exact = the input has equal line sums (no padding needed). */
static void check_plan(uint32_t n, const uint64_t *demand, const bvn_out_t *o, int exact)
{
	uint64_t *covered = calloc((size_t)n * n, sizeof(uint64_t));
	uint64_t *last = calloc((size_t)n * n, sizeof(uint64_t));
	uint8_t *used = malloc(n + 1);
	assert_non_null(covered);
	assert_non_null(last);
	assert_non_null(used);
	assert_true((uint64_t)o->stages <= (uint64_t)n * n);
	uint64_t total_time = 0;
	for (uint32_t k = 0; k < o->stages; k++) {
		const uint32_t *perm = o->perm + (size_t)k * n;
		assert_true(o->weight[k] > 0);
		total_time += o->weight[k];
		memset(used, 0, n + 1);
		int sends = 0;
		for (uint32_t s = 0; s < n; s++) {
			uint32_t d = perm[s];
			assert_true(d <= n);
			if (d == n)
				continue; /* idle */
			assert_true(d != s);
			assert_false(used[d]); /* at most one sender per receiver */
			used[d] = 1;
			sends = 1;
			covered[(size_t)s * n + d] += o->weight[k];
			last[(size_t)s * n + d] = o->weight[k];
		}
		assert_true(sends); /* all-idle stages are dropped */
	}
	for (uint32_t s = 0; s < n; s++) {
		for (uint32_t d = 0; d < n; d++) {
			size_t i = (size_t)s * n + d;
			uint64_t want = s == d ? 0 : demand[i];
			if (want == 0) {
				assert_int_equal(covered[i], 0);
				continue;
			}
			assert_true(covered[i] >= want);
			/* The last stage naming (s, d) started while real demand remained. */
			assert_true(covered[i] - last[i] < want);
			if (exact)
				assert_true(covered[i] == want);
		}
	}
	assert_true(total_time == max_line_sum(n, demand));
	free(covered);
	free(last);
	free(used);
}

static void fill_random(uint32_t n, uint64_t *demand, unsigned density_pct, uint64_t max_value)
{
	for (uint32_t s = 0; s < n; s++)
		for (uint32_t d = 0; d < n; d++)
			demand[(size_t)s * n + d] =
				rng_below(100) < density_pct ? 1 + rng_below(max_value) : 0;
}

static void test_random(void **state)
{
	(void)state;
	rng_state = 20240602;
	static const unsigned density[] = { 100, 60, 25, 5 };
	for (unsigned c = 0; c < 600; c++) {
		uint32_t n = 1 + (uint32_t)rng_below(12);
		uint64_t max_value = c % 3 == 0 ? 5 : (c % 3 == 1 ? 1000000 : (1ull << 40));
		uint64_t *demand = malloc(sizeof(uint64_t) * n * n);
		assert_non_null(demand);
		fill_random(n, demand, density[c % 4], max_value);
		bvn_out_t o = run_bvn(n, demand, n * n);
		if (max_line_sum(n, demand) == 0)
			assert_int_equal(o.stages, 0);
		check_plan(n, demand, &o, 0);
		free_out(&o);
		free(demand);
	}
}

/* Sum of weighted random derangements: every line sum is equal, so no padding is added and
 * every entry is covered exactly. */
static void test_balanced_exact(void **state)
{
	(void)state;
	rng_state = 77;
	for (unsigned c = 0; c < 200; c++) {
		uint32_t n = 2 + (uint32_t)rng_below(15);
		uint64_t *demand = calloc((size_t)n * n, sizeof(uint64_t));
		uint32_t *p = malloc(sizeof(uint32_t) * n);
		assert_non_null(demand);
		assert_non_null(p);
		unsigned k = 1 + (unsigned)rng_below(6);
		for (unsigned j = 0; j < k; j++) {
			/* A random cyclic shift composed with a random relabelling has no fixed point. */
			for (uint32_t i = 0; i < n; i++)
				p[i] = i;
			for (uint32_t i = n - 1; i > 0; i--) {
				uint32_t r = (uint32_t)rng_below(i + 1), t = p[i];
				p[i] = p[r];
				p[r] = t;
			}
			uint32_t shift = 1 + (uint32_t)rng_below(n - 1);
			uint64_t w = 1 + rng_below(1000);
			for (uint32_t i = 0; i < n; i++)
				demand[(size_t)p[i] * n + p[(i + shift) % n]] += w;
		}
		bvn_out_t o = run_bvn(n, demand, n * n);
		assert_true(o.stages > 0);
		check_plan(n, demand, &o, 1);
		free_out(&o);
		free(p);
		free(demand);
	}
}

static void test_edges(void **state)
{
	(void)state;
	/* Nothing to send: zero stages (also for N = 1 and a diagonal-only demand). */
	uint64_t one = 99;
	bvn_out_t o = run_bvn(1, &one, 1);
	assert_int_equal(o.stages, 0);
	free_out(&o);
	uint64_t diag[9] = { 5, 0, 0, 0, 7, 0, 0, 0, 9 };
	o = run_bvn(3, diag, 9);
	assert_int_equal(o.stages, 0);
	free_out(&o);

	/* A single pair: one stage, everyone else idle. */
	uint64_t single[16] = { 0 };
	single[1 * 4 + 3] = 12345;
	o = run_bvn(4, single, 16);
	assert_int_equal(o.stages, 1);
	assert_true(o.weight[0] == 12345);
	assert_int_equal(o.perm[1], 3);
	assert_int_equal(o.perm[0], 4);
	assert_int_equal(o.perm[2], 4);
	assert_int_equal(o.perm[3], 4);
	check_plan(4, single, &o, 0);
	free_out(&o);

	/* Incast: three senders to one receiver must be serialised into three stages. */
	uint64_t incast[16] = { 0 };
	incast[0 * 4 + 3] = 10;
	incast[1 * 4 + 3] = 20;
	incast[2 * 4 + 3] = 30;
	o = run_bvn(4, incast, 16);
	assert_int_equal(o.stages, 3);
	check_plan(4, incast, &o, 1);
	free_out(&o);

	/* The diagonal is ignored even when it is large. */
	uint64_t mixed[4] = { 1000, 3, 4, 1000 };
	o = run_bvn(2, mixed, 4);
	check_plan(2, mixed, &o, 0);
	free_out(&o);
}

static void test_max_stages(void **state)
{
	(void)state;
	rng_state = 5;
	uint32_t n = 6;
	uint64_t demand[36];
	fill_random(n, demand, 100, 1000);
	bvn_out_t full = run_bvn(n, demand, n * n);
	assert_true(full.stages > 1);
	bvn_out_t exact = run_bvn(n, demand, full.stages);
	assert_int_equal(exact.stages, full.stages);
	assert_memory_equal(exact.perm, full.perm, sizeof(uint32_t) * n * full.stages);
	assert_memory_equal(exact.weight, full.weight, sizeof(uint64_t) * full.stages);
	bvn_out_t shorter = run_bvn(n, demand, full.stages - 1);
	assert_int_equal(shorter.stages, 0);
	free_out(&full);
	free_out(&exact);
	free_out(&shorter);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_random),
		cmocka_unit_test(test_balanced_exact),
		cmocka_unit_test(test_edges),
		cmocka_unit_test(test_max_stages),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
