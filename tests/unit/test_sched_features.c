/* Features (docs/algorithms.md §5): rw_sched_features equals a straightforward
 * double-loop recomputation on random matrices (including matrices large enough for the
 * blocked column pass), the neutral values when there is no remote payload, the clamps, and the
 * R == 1 / N == 1 guards; the row accumulator (rw_sched_feat_*) gives bit-identical features
 * whatever the row order, rejects a duplicate row and refuses to finish early.
 * Random cases are seeded: RW_TEST_SEED=<n> reproduces a run. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <setjmp.h>
#include <string.h>
#include <cmocka.h>

#include "sched/sched.h"

#include "tests/unit/test_rng.h"

static size_t at(uint32_t n, uint32_t rails, uint32_t s, uint32_t d, uint32_t r)
{
	return ((size_t)s * n + d) * rails + r;
}

/* The definitions of docs/algorithms.md §5 written out directly, in bytes and doubles. */
static void reference(const rw_topo_t *t, const uint32_t *counts, uint64_t rb, rw_features_t *f)
{
	const uint32_t n = t->nodes, rails = t->rails;
	double total = 0, max_egress = 0, max_ingress = 0, share = 0;
	uint32_t fan = 0;
	for (uint32_t s = 0; s < n; s++)
		for (uint32_t r = 0; r < rails; r++) {
			double e = 0;
			for (uint32_t d = 0; d < n; d++)
				if (d != s)
					e += (double)counts[at(n, rails, s, d, r)] * (double)rb;
			total += e;
			if (e > max_egress)
				max_egress = e;
		}
	for (uint32_t d = 0; d < n; d++) {
		double in = 0, top = 0;
		uint32_t senders = 0;
		for (uint32_t s = 0; s < n; s++) {
			if (s == d)
				continue;
			int any = 0;
			for (uint32_t r = 0; r < rails; r++)
				any |= counts[at(n, rails, s, d, r)] != 0;
			senders += any;
		}
		for (uint32_t r = 0; r < rails; r++) {
			double rail_in = 0;
			for (uint32_t s = 0; s < n; s++)
				if (s != d)
					rail_in += (double)counts[at(n, rails, s, d, r)] * (double)rb;
			in += rail_in;
			if (rail_in > top)
				top = rail_in;
		}
		if (in > max_ingress)
			max_ingress = in;
		if (in > 0 && top / in > share)
			share = top / in;
		if (senders > fan)
			fan = senders;
	}
	memset(f, 0, sizeof(*f));
	f->remote_bytes = (uint64_t)total;
	f->rho_g = 1;
	f->kappa = 1;
	if (total == 0)
		return;
	f->B = total / ((double)n * t->gpus_per_node);
	f->rho_g = max_egress / (total / ((double)n * rails));
	f->kappa = max_ingress / (total / n);
	f->f[0] = log2(f->B);
	f->f[1] = rails == 1 ? 0 : fmin(1.0, (f->rho_g - 1) / (rails - 1));
	f->f[2] = n == 1 ? 0 : fmin(1.0, (f->kappa - 1) / (n - 1));
	f->max_fan_in = fan;
	f->busiest_dst_rail_share = share;
}

static void assert_close(double got, double want)
{
	double tol = 1e-12 * fmax(1.0, fabs(want));
	if (fabs(got - want) > tol) {
		print_error("got %.17g want %.17g\n", got, want);
		fail();
	}
}

static void assert_features_equal(const rw_features_t *got, const rw_features_t *want)
{
	assert_int_equal(got->remote_bytes, want->remote_bytes);
	assert_close(got->B, want->B);
	assert_close(got->rho_g, want->rho_g);
	assert_close(got->kappa, want->kappa);
	for (int i = 0; i < 3; i++)
		assert_close(got->f[i], want->f[i]);
	assert_int_equal(got->max_fan_in, want->max_fan_in);
	assert_close(got->busiest_dst_rail_share, want->busiest_dst_rail_share);
}

/* Features through the accumulator, rows added in a random order. */
static void features_by_rows(const rw_topo_t *t, const uint32_t *counts, uint64_t rb,
			     rw_features_t *f)
{
	const uint32_t n = t->nodes, rails = t->rails;
	size_t len = rw_sched_feat_workspace(n, rails);
	uint64_t *ws = malloc(len);
	uint32_t *order = malloc(n * sizeof(*order));
	assert_non_null(ws);
	assert_non_null(order);
	for (uint32_t i = 0; i < n; i++)
		order[i] = i;
	for (uint32_t i = n; i > 1; i--) { /* Fisher-Yates */
		uint32_t j = rng_below(i), tmp = order[i - 1];
		order[i - 1] = order[j];
		order[j] = tmp;
	}
	rw_sched_feat_acc_t acc;
	assert_int_equal(rw_sched_feat_begin(&acc, t, ws, len), RW_OK);
	for (uint32_t i = 0; i < n; i++) {
		if (i > 0) /* not all rows in yet */
			assert_int_equal(rw_sched_feat_finish(&acc, rb, f), RW_ERR_STATE);
		assert_int_equal(rw_sched_feat_add_row(&acc, order[i], counts + (size_t)order[i] * n * rails),
				 RW_OK);
	}
	assert_int_equal(acc.rows, n);
	assert_int_equal(rw_sched_feat_finish(&acc, rb, f), RW_OK);
	free(order);
	free(ws);
}

/* Random matrices of several shapes; some with N * R above the column pass's block so the
 * blocked path is exercised. Two calls give bit-identical results (every node agrees). */
static void test_features_random(void **state)
{
	(void)state;
	seed_rng("features_random");
	static uint32_t counts[300 * 300 * 4];
	for (uint32_t c = 0; c < 400; c++) {
		rw_topo_t t;
		uint32_t n, rails = 1 + rng_below(RW_MAX_RAILS), gpus = 1 + rng_below(8);
		n = 1 + rng_below(24);
		if (c % 40 == 0) { /* N R > 1024: the column pass runs in blocks of 256 nodes */
			n = 260 + rng_below(40);
			rails = 4;
		}
		assert_int_equal(rw_sched_topo_init(&t, n, gpus, rails), RW_OK);
		uint32_t shape = rng_below(5), cap = 1 + rng_below(1000);
		uint32_t hot_s = rng_below(n), hot_d = rng_below(n), hot_r = rng_below(rails);
		for (uint32_t s = 0; s < n; s++)
			for (uint32_t d = 0; d < n; d++)
				for (uint32_t r = 0; r < rails; r++) {
					uint32_t v;
					switch (shape) {
					case 0: v = rng_below(cap + 1); break;               /* uniform */
					case 1: v = d == hot_d ? rng_below(cap) : rng_below(3); break; /* incast */
					case 2: v = r == hot_r ? rng_below(cap) : rng_below(3); break; /* hot rail */
					case 3: v = s == hot_s ? rng_below(cap) : 0; break;  /* one sender */
					default: v = rng_below(10) == 0 ? rng_below(cap) : 0; break; /* sparse */
					}
					counts[at(n, rails, s, d, r)] = v;
				}
		uint64_t rb = 1 + rng_below(3) * (uint64_t)rng_below(1 << 16);
		rw_features_t got, again, want;
		rw_sched_features(&t, counts, rb, &got);
		reference(&t, counts, rb, &want);
		assert_features_equal(&got, &want);
		rw_sched_features(&t, counts, rb, &again);
		assert_memory_equal(&got, &again, sizeof(got));
		/* Row by row in a random order: the same bits as the one-shot pass. */
		rw_features_t by_rows;
		features_by_rows(&t, counts, rb, &by_rows);
		assert_memory_equal(&by_rows, &got, sizeof(got));
	}
}

/* Counts near 2^32: every sum must be carried in 64 bits; results still equal the
 * recomputation (exact in doubles below 2^53), one-shot and row by row. R = 8 runs the
 * constant-rail kernel, 16 and 3 the generic one; N = 300 at R = 8 also runs the blocks. */
static void test_large_counts(void **state)
{
	(void)state;
	seed_rng("large_counts");
	static uint32_t counts[300 * 300 * 8];
	const uint32_t shapes[][2] = { { 5, 8 }, { 17, 16 }, { 9, 3 }, { 40, 8 }, { 300, 8 } };
	for (uint32_t c = 0; c < 40; c++) {
		uint32_t n = shapes[c % 5][0], rails = shapes[c % 5][1];
		rw_topo_t t;
		assert_int_equal(rw_sched_topo_init(&t, n, 8, rails), RW_OK);
		for (uint32_t i = 0; i < n * n * rails; i++) {
			uint32_t roll = rng_below(4);
			counts[i] = roll == 0 ? UINT32_MAX - rng_below(3)
				  : roll == 1 ? (uint32_t)rng_next() : roll == 2 ? rng_below(9) : 0;
		}
		rw_features_t got, want, by_rows;
		rw_sched_features(&t, counts, 1, &got);
		reference(&t, counts, 1, &want);
		assert_features_equal(&got, &want);
		features_by_rows(&t, counts, 1, &by_rows);
		assert_memory_equal(&by_rows, &got, sizeof(got));
	}
}

/* No remote payload (only local records, or nothing): f0 = 0 and everything neutral. */
static void test_no_remote_is_neutral(void **state)
{
	(void)state;
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 3, 8, 8), RW_OK);
	uint32_t counts[3 * 3 * 8] = { 0 };
	for (uint32_t v = 0; v < 3; v++)
		counts[at(3, 8, v, v, v)] = 1000; /* local only */
	rw_features_t f;
	rw_sched_features(&t, counts, 8192, &f);
	assert_int_equal(f.remote_bytes, 0);
	assert_true(f.B == 0 && f.f[0] == 0 && f.f[1] == 0 && f.f[2] == 0);
	assert_true(f.rho_g == 1 && f.kappa == 1);
	assert_int_equal(f.max_fan_in, 0);
	assert_true(f.busiest_dst_rail_share == 0);
	/* N = 1: there is no remote node at all. */
	assert_int_equal(rw_sched_topo_init(&t, 1, 8, 8), RW_OK);
	rw_sched_features(&t, counts, 8192, &f);
	assert_int_equal(f.remote_bytes, 0);
	assert_true(f.f[0] == 0 && f.f[1] == 0 && f.f[2] == 0);
	/* A topology that fails rw_sched_topo_check gets the neutral answer, not a crash. */
	t.rails = 0;
	rw_sched_features(&t, counts, 8192, &f);
	assert_int_equal(f.remote_bytes, 0);
	assert_true(f.rho_g == 1 && f.kappa == 1);
}

/* One (node, rail) sends everything to one node: rho_g = N R and kappa = N, both clamped to
 * f = 1; fan-in 1; the destination's busiest rail carries it all. */
static void test_extremes_and_guards(void **state)
{
	(void)state;
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 4, 8, 8), RW_OK);
	uint32_t counts[4 * 4 * 8] = { 0 };
	counts[at(4, 8, 2, 1, 5)] = 64;
	rw_features_t f;
	rw_sched_features(&t, counts, 1024, &f);
	assert_int_equal(f.remote_bytes, 64 * 1024);
	assert_close(f.B, 64.0 * 1024 / 32);
	assert_close(f.f[0], log2(64.0 * 1024 / 32));
	assert_close(f.rho_g, 32);
	assert_close(f.kappa, 4);
	assert_close(f.f[1], 1);
	assert_close(f.f[2], 1);
	assert_int_equal(f.max_fan_in, 1);
	assert_close(f.busiest_dst_rail_share, 1);

	/* Perfectly even: every pair the same on every rail -> rho = kappa = 1, f1 = f2 = 0,
	 * fan-in N - 1, busiest rail share 1/R. */
	for (uint32_t s = 0; s < 4; s++)
		for (uint32_t d = 0; d < 4; d++)
			for (uint32_t r = 0; r < 8; r++)
				counts[at(4, 8, s, d, r)] = 3;
	rw_sched_features(&t, counts, 100, &f);
	assert_close(f.rho_g, 1);
	assert_close(f.kappa, 1);
	assert_close(f.f[1], 0);
	assert_close(f.f[2], 0);
	assert_int_equal(f.max_fan_in, 3);
	assert_close(f.busiest_dst_rail_share, 1.0 / 8);

	/* R = 1: f1 is 0 (no rail skew is possible), not 0/0. */
	assert_int_equal(rw_sched_topo_init(&t, 3, 2, 1), RW_OK);
	uint32_t one[3 * 3] = { 0, 5, 0, 0, 0, 0, 1, 0, 0 };
	rw_sched_features(&t, one, 10, &f);
	assert_true(f.f[1] == 0);
	assert_close(f.rho_g, 3.0 * 5 / 6);
	assert_close(f.kappa, 3.0 * 5 / 6);
	assert_close(f.f[2], (2.5 - 1) / 2);
	assert_false(isnan(f.f[0]) || isnan(f.f[1]) || isnan(f.f[2]));
}

/* The same row twice is refused (a peer's duplicate) and leaves the accumulator as it was; so
 * do out-of-range rows and bad arguments. finish is repeatable and does not consume. */
static void test_acc_errors(void **state)
{
	(void)state;
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 70, 8, 8), RW_OK); /* 70 > 64: two bitmap words */
	static uint32_t counts[70 * 70 * 8];
	for (uint32_t i = 0; i < 70 * 70 * 8; i++)
		counts[i] = (i * 2654435761u) >> 26;
	const size_t len = rw_sched_feat_workspace(70, 8);
	uint64_t *ws = malloc(len + 8), *copy = malloc(len);
	assert_non_null(ws);
	assert_non_null(copy);
	rw_sched_feat_acc_t acc, acc_copy;

	assert_int_equal(rw_sched_feat_begin(&acc, &t, ws, len - 1), RW_ERR_INVAL);
	assert_int_equal(rw_sched_feat_begin(&acc, &t, (char *)ws + 4, len), RW_ERR_INVAL);
	assert_int_equal(rw_sched_feat_begin(&acc, &t, NULL, len), RW_ERR_INVAL);
	t.rails = 0;
	assert_int_equal(rw_sched_feat_begin(&acc, &t, ws, len), RW_ERR_INVAL);
	t.rails = 8;
	assert_int_equal(rw_sched_feat_begin(&acc, &t, ws, len), RW_OK);

	for (uint32_t s = 0; s < 70; s += 2)
		assert_int_equal(rw_sched_feat_add_row(&acc, s, counts + (size_t)s * 70 * 8), RW_OK);
	memcpy(copy, ws, len);
	acc_copy = acc;
	for (uint32_t s = 0; s < 70; s += 2) /* every duplicate, including rows past bit 63 */
		assert_int_equal(rw_sched_feat_add_row(&acc, s, counts + (size_t)s * 70 * 8),
				 RW_ERR_EXISTS);
	assert_int_equal(rw_sched_feat_add_row(&acc, 70, counts), RW_ERR_INVAL);
	assert_int_equal(rw_sched_feat_add_row(&acc, 1, NULL), RW_ERR_INVAL);
	assert_memory_equal(ws, copy, len);
	assert_memory_equal(&acc, &acc_copy, sizeof(acc));

	rw_features_t f, sentinel;
	memset(&f, 0x5a, sizeof(f));
	sentinel = f;
	assert_int_equal(rw_sched_feat_finish(&acc, 64, &f), RW_ERR_STATE);
	assert_memory_equal(&f, &sentinel, sizeof(f)); /* untouched on error */
	for (uint32_t s = 1; s < 70; s += 2)
		assert_int_equal(rw_sched_feat_add_row(&acc, s, counts + (size_t)s * 70 * 8), RW_OK);
	rw_features_t want, again;
	assert_int_equal(rw_sched_feat_finish(&acc, 64, &f), RW_OK);
	rw_sched_features(&t, counts, 64, &want);
	assert_memory_equal(&f, &want, sizeof(f));
	assert_int_equal(rw_sched_feat_finish(&acc, 64, &again), RW_OK);
	assert_memory_equal(&again, &want, sizeof(f));

	/* begin resets: a new phase starts from nothing. */
	assert_int_equal(rw_sched_feat_begin(&acc, &t, ws, len), RW_OK);
	assert_int_equal(acc.rows, 0);
	assert_int_equal(rw_sched_feat_add_row(&acc, 0, counts), RW_OK);
	rw_sched_feat_acc_t blank;
	memset(&blank, 0, sizeof(blank));
	assert_int_equal(rw_sched_feat_add_row(&blank, 0, counts), RW_ERR_INVAL);
	assert_int_equal(rw_sched_feat_finish(&blank, 64, &f), RW_ERR_INVAL);
	free(copy);
	free(ws);
}

/* N = 1: the single row is all local; the accumulator answers neutral like the one-shot. */
static void test_acc_single_node(void **state)
{
	(void)state;
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 1, 8, 8), RW_OK);
	uint32_t row[8] = { 5, 0, 0, 0, 0, 0, 0, 9 };
	uint64_t ws[32];
	assert_true(rw_sched_feat_workspace(1, 8) <= sizeof(ws));
	rw_sched_feat_acc_t acc;
	assert_int_equal(rw_sched_feat_begin(&acc, &t, ws, sizeof(ws)), RW_OK);
	assert_int_equal(rw_sched_feat_add_row(&acc, 0, row), RW_OK);
	rw_features_t f, want;
	assert_int_equal(rw_sched_feat_finish(&acc, 100, &f), RW_OK);
	rw_sched_features(&t, row, 100, &want);
	assert_memory_equal(&f, &want, sizeof(f));
	assert_int_equal(f.remote_bytes, 0);
	assert_true(f.rho_g == 1 && f.kappa == 1);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_features_random),
		cmocka_unit_test(test_large_counts),
		cmocka_unit_test(test_no_remote_is_neutral),
		cmocka_unit_test(test_extremes_and_guards),
		cmocka_unit_test(test_acc_errors),
		cmocka_unit_test(test_acc_single_node),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
