/* RailBalance (docs/algorithms.md §2): a brute-force oracle over every small case
 * (quotas within one, sum T, moved records minimal over every valid quota vector, for equal
 * weights, every rail mask and small weights), the documented counter-example to the plain
 * rotation, the exact remainder rule against a literal two-pass transcription of it (both ends of
 * a pair must pick the same rails), and randomised properties of the owner -> proxy map and its
 * inverse.
 * Random cases are seeded: RW_TEST_SEED=<n> reproduces a run; the seed is printed. */
#include <inttypes.h>
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

static rw_topo_t topo_of(uint32_t rails, const uint32_t *weight)
{
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 2, rails, rails), RW_OK);
	if (weight)
		for (uint32_t r = 0; r < rails; r++)
			t.rail_weight[r] = weight[r];
	return t;
}

static uint32_t moved_by(uint32_t rails, const uint32_t *count, const uint32_t *quota)
{
	uint32_t moved = 0;
	for (uint32_t r = 0; r < rails; r++)
		moved += count[r] > quota[r] ? count[r] - quota[r] : 0;
	return moved;
}

/* Minimum moved records over every quota vector the rule allows, by enumeration. lo[r]: the
 * smallest quota rail r may get (hi = lo + 1 for eligible rails, masked rails lo = hi = 0).
 * Equal weights: lo is every value 0..T for all eligible rails at once (max - min <= 1 means
 * every quota is in {lo, lo + 1} for lo = the minimum); weighted: lo = floor(T w / W), and
 * lo + 1 only where T w / W is not an integer (|q - T w / W| < 1). */
static uint32_t brute_min_moved(uint32_t rails, const uint32_t *count, const uint32_t *weight,
				int equal)
{
	uint32_t total = 0, wsum = 0, best = UINT32_MAX;
	for (uint32_t r = 0; r < rails; r++) {
		total += count[r];
		wsum += weight[r];
	}
	for (uint32_t lo = 0; lo <= total; lo++) {
		uint32_t base[RW_MAX_RAILS];
		for (uint32_t r = 0; r < rails; r++)
			base[r] = weight[r] == 0 ? 0 : equal ? lo : (uint32_t)((uint64_t)total * weight[r] / wsum);
		for (uint32_t bits = 0; bits < (1u << rails); bits++) {
			uint32_t q[RW_MAX_RAILS], sum = 0, ok = 1;
			for (uint32_t r = 0; r < rails; r++) {
				uint32_t extra = (bits >> r) & 1;
				/* weighted: only a rail with a fractional share may round up */
				if (extra && (weight[r] == 0 ||
					      (!equal && (uint64_t)total * weight[r] % wsum == 0)))
					ok = 0;
				q[r] = base[r] + extra;
				sum += q[r];
			}
			if (!ok || sum != total)
				continue;
			best = RW_MIN(best, moved_by(rails, count, q));
		}
		if (!equal)
			break; /* weighted: the floors are fixed */
	}
	return best;
}

/* Every check of one plan: quota rule, sum, moved minimal, and the map as a bijection. */
static void check_plan_small(const rw_topo_t *t, const uint32_t *count, const rw_pair_plan_t *p,
			     uint32_t expect_min)
{
	const uint32_t rails = t->rails;
	uint32_t total = 0, qsum = 0;
	for (uint32_t r = 0; r < rails; r++) {
		total += count[r];
		qsum += p->quota[r];
		if (t->rail_weight[r] == 0)
			assert_int_equal(p->quota[r], 0);
	}
	assert_int_equal(qsum, total);
	assert_int_equal(p->total, total);
	assert_int_equal(p->moved, moved_by(rails, count, p->quota));
	assert_int_equal(p->moved, expect_min);

	/* Records that leave their owner rail, counted through the map itself. */
	uint32_t moved = 0, hit[RW_MAX_RAILS][32] = { { 0 } };
	for (uint32_t o = 0; o < rails; o++)
		for (uint32_t i = 0; i < count[o]; i++) {
			uint32_t e, s;
			rw_sched_map(p, o, i, &e, &s);
			assert_true(e < rails && s < p->quota[e]);
			hit[e][s]++;
			moved += e != o;
		}
	assert_int_equal(moved, p->moved);
	for (uint32_t e = 0; e < rails; e++)
		for (uint32_t s = 0; s < p->quota[e]; s++)
			assert_int_equal(hit[e][s], 1);
}

/* Every count vector with entries 0..6 on R <= 4 rails, every rotation, every non-empty rail
 * mask: quotas differ by at most one on the eligible rails and the moves are minimal. */
static void test_oracle_equal_weights(void **state)
{
	(void)state;
	uint64_t cases = 0;
	for (uint32_t rails = 1; rails <= 4; rails++) {
		uint32_t n_vec = 1;
		for (uint32_t r = 0; r < rails; r++)
			n_vec *= 7;
		for (uint32_t mask = 1; mask < (1u << rails); mask++) {
			uint32_t weight[RW_MAX_RAILS];
			for (uint32_t r = 0; r < rails; r++)
				weight[r] = (mask >> r) & 1;
			rw_topo_t t = topo_of(rails, weight);
			for (uint32_t v = 0; v < n_vec; v++) {
				uint32_t count[RW_MAX_RAILS], x = v;
				for (uint32_t r = 0; r < rails; r++, x /= 7)
					count[r] = x % 7;
				uint32_t expect = brute_min_moved(rails, count, weight, 1);
				for (uint32_t rot = 0; rot < 2 * rails; rot++) {
					rw_pair_plan_t p;
					rw_sched_balance(&t, count, rot, &p);
					uint32_t qmin = UINT32_MAX, qmax = 0;
					for (uint32_t r = 0; r < rails; r++)
						if (weight[r]) {
							qmin = RW_MIN(qmin, p.quota[r]);
							qmax = RW_MAX(qmax, p.quota[r]);
						}
					assert_true(qmax - qmin <= 1);
					check_plan_small(&t, count, &p, expect);
					cases++;
				}
			}
		}
	}
	printf("oracle (equal weights, all masks): %" PRIu64 " cases\n", cases);
}

/* Weighted quotas (weights 0..3 on R <= 3 rails, counts 0..6): every quota is strictly within
 * one of T w_r / W (a rail whose share is an integer gets exactly it) and the moves are minimal
 * over every quota vector with that property. */
static void test_oracle_weighted(void **state)
{
	(void)state;
	uint64_t cases = 0;
	for (uint32_t rails = 1; rails <= 3; rails++) {
		uint32_t n_w = 1, n_vec = 1;
		for (uint32_t r = 0; r < rails; r++) {
			n_w *= 4;
			n_vec *= 7;
		}
		for (uint32_t wv = 0; wv < n_w; wv++) {
			uint32_t weight[RW_MAX_RAILS], x = wv, wsum = 0;
			for (uint32_t r = 0; r < rails; r++, x /= 4) {
				weight[r] = x % 4;
				wsum += weight[r];
			}
			if (wsum == 0)
				continue;
			rw_topo_t t = topo_of(rails, weight);
			for (uint32_t v = 0; v < n_vec; v++) {
				uint32_t count[RW_MAX_RAILS], y = v, total = 0;
				for (uint32_t r = 0; r < rails; r++, y /= 7) {
					count[r] = y % 7;
					total += count[r];
				}
				uint32_t expect = brute_min_moved(rails, count, weight, 0);
				for (uint32_t rot = 0; rot < rails; rot++) {
					rw_pair_plan_t p;
					rw_sched_balance(&t, count, rot, &p);
					for (uint32_t r = 0; r < rails; r++) {
						/* |q - T w / W| < 1  <=>  |q W - T w| < W */
						int64_t diff = (int64_t)p.quota[r] * wsum - (int64_t)total * weight[r];
						assert_true(diff > -(int64_t)wsum && diff < (int64_t)wsum);
					}
					check_plan_small(&t, count, &p, expect);
					cases++;
				}
			}
		}
	}
	printf("oracle (weighted): %" PRIu64 " cases\n", cases);
}

/* docs/algorithms.md §2.1 written out literally: bases, candidates, then pass 1 (candidates
 * above base) and pass 2 (remaining candidates), each walking the eligible rails cyclically from
 * index rotation mod m while the remainder lasts. */
static void rule_quotas(const rw_topo_t *t, const uint32_t *count, uint32_t rotation,
			uint32_t *quota)
{
	const uint32_t rails = t->rails;
	uint32_t eligible[RW_MAX_RAILS], m = 0;
	uint64_t total = 0, wsum = 0, given = 0;
	int candidate[RW_MAX_RAILS] = { 0 };
	for (uint32_t r = 0; r < rails; r++) {
		total += count[r];
		quota[r] = 0;
		if (t->rail_weight[r]) {
			eligible[m++] = r;
			wsum += t->rail_weight[r];
		}
	}
	for (uint32_t k = 0; k < m; k++) {
		uint64_t share = total * t->rail_weight[eligible[k]];
		quota[eligible[k]] = (uint32_t)(share / wsum);
		given += quota[eligible[k]];
		candidate[k] = share % wsum != 0;
	}
	uint64_t rem = total - given;
	for (uint32_t pass = 0; pass < 2; pass++)
		for (uint32_t i = 0; i < m && rem > 0; i++) {
			uint32_t k = (rotation % m + i) % m, r = eligible[k];
			if (!candidate[k] || (pass == 0 && count[r] <= quota[r]))
				continue;
			quota[r]++;
			candidate[k] = 0;
			rem--;
		}
}

/* The quotas are exactly the documented rule for random counts, weights, masks and rotations:
 * a faster implementation must not pick different rails, or the two ends of a pair (built by
 * different code paths: the sender's plan, the receiver's pair plans) could disagree. */
static void test_rule_exact(void **state)
{
	(void)state;
	seed_rng("rule_exact");
	for (uint32_t c = 0; c < 200000; c++) {
		uint32_t rails = 1 + rng_below(RW_MAX_RAILS);
		uint32_t count[RW_MAX_RAILS] = { 0 }, weight[RW_MAX_RAILS];
		uint32_t shape = rng_below(4), cap = shape == 0 ? 3 : shape == 1 ? 40 : 100000;
		for (uint32_t r = 0; r < rails; r++)
			count[r] = rng_below(4) == 0 ? 0 : rng_below(cap);
		uint32_t eligible = 0;
		while (eligible == 0) {
			eligible = 0;
			for (uint32_t r = 0; r < rails; r++) {
				weight[r] = shape == 3 ? 1 + rng_below(5) : 1;
				if (rng_below(5) == 0 && c % 2)
					weight[r] = 0;
				eligible += weight[r] > 0;
			}
		}
		rw_topo_t t = topo_of(rails, weight);
		uint32_t rot = rng_below(3) == 0 ? (uint32_t)rng_next() : rng_below(64);
		uint32_t want[RW_MAX_RAILS];
		rule_quotas(&t, count, rot, want);
		rw_pair_plan_t p;
		rw_sched_balance(&t, count, rot, &p);
		assert_memory_equal(p.quota, want, rails * sizeof(want[0]));
		for (uint32_t r = rails; r < RW_MAX_RAILS; r++)
			assert_int_equal(p.quota[r], 0);
	}
}

/* The plain rotation: base to every rail, the remainder to rails in rotation order, counts
 * ignored. Kept here only to show it is not move-minimal. */
static void plain_rotation_quotas(uint32_t rails, const uint32_t *count, uint32_t rotation,
				  uint32_t *quota)
{
	uint32_t total = 0;
	for (uint32_t r = 0; r < rails; r++)
		total += count[r];
	for (uint32_t r = 0; r < rails; r++)
		quota[r] = total / rails;
	for (uint32_t i = 0; i < total % rails; i++)
		quota[(rotation + i) % rails]++;
}

/* Counts [4,0,0]: T = 4, base 1, one extra record. The plain rotation gives the extra to the
 * rotation's rail; unless that is rail 0, rail 0 keeps 1 and moves 3. Count-aware gives it to
 * rail 0 (the only rail above base): 2 kept, 2 moved, which is the minimum. */
static void test_plain_rotation_not_minimal(void **state)
{
	(void)state;
	const uint32_t count[3] = { 4, 0, 0 };
	rw_topo_t t = topo_of(3, NULL);
	for (uint32_t rot = 1; rot <= 2; rot++) {
		uint32_t plain[3];
		plain_rotation_quotas(3, count, rot, plain);
		assert_int_equal(moved_by(3, count, plain), 3);
		rw_pair_plan_t p;
		rw_sched_balance(&t, count, rot, &p);
		assert_int_equal(p.quota[0], 2);
		assert_int_equal(p.moved, 2);
		assert_int_equal(brute_min_moved(3, count, (const uint32_t[]){ 1, 1, 1 }, 1), 2);
	}
}

/* Rotation decides who gets the remainder among rails at or below base, and it rotates. */
static void test_rotation_spreads_remainder(void **state)
{
	(void)state;
	const uint32_t count[4] = { 1, 1, 1, 1 }; /* T = 4: base 1, no remainder */
	const uint32_t uneven[4] = { 0, 0, 0, 1 }; /* T = 1: rail 3 is above base, wins anyway */
	const uint32_t zero_rem[4] = { 2, 1, 1, 1 }; /* T = 5: rail 0 wins (count > base) */
	rw_topo_t t = topo_of(4, NULL);
	rw_pair_plan_t p;
	for (uint32_t rot = 0; rot < 8; rot++) {
		rw_sched_balance(&t, count, rot, &p);
		assert_int_equal(p.moved, 0);
		rw_sched_balance(&t, uneven, rot, &p);
		assert_int_equal(p.quota[3], 1);
		rw_sched_balance(&t, zero_rem, rot, &p);
		assert_int_equal(p.quota[0], 2);
	}
	/* All records on rail 0, T = 6 on 4 rails: base 1, remainder 2; rail 0 takes one, the
	 * other goes to the first rail after it in rotation order. */
	const uint32_t hot[4] = { 6, 0, 0, 0 };
	const uint32_t expect_extra[4] = { 1, 1, 2, 3 }; /* rot 0: rail 0 used -> rail 1 */
	for (uint32_t rot = 0; rot < 4; rot++) {
		rw_sched_balance(&t, hot, rot, &p);
		assert_int_equal(p.quota[0], 2);
		assert_int_equal(p.quota[expect_extra[rot]], 2);
		assert_int_equal(p.moved, 4);
	}
}

/* A masked rail (weight 0) gets no quota and every one of its records moves. */
static void test_masked_rail(void **state)
{
	(void)state;
	const uint32_t count[4] = { 5, 9, 0, 2 };
	const uint32_t weight[4] = { 1, 0, 1, 1 };
	rw_topo_t t = topo_of(4, weight);
	rw_pair_plan_t p;
	rw_sched_balance(&t, count, 0, &p);
	assert_int_equal(p.quota[1], 0);
	assert_int_equal(p.quota[0] + p.quota[2] + p.quota[3], 16);
	for (uint32_t i = 0; i < count[1]; i++) {
		uint32_t e, s;
		rw_sched_map(&p, 1, i, &e, &s);
		assert_int_not_equal(e, 1);
	}
	assert_int_equal(rw_sched_topo_eligible(&t), 3);
}

/* Native plan: quota = count, nothing moves, the map is the identity. */
static void test_native(void **state)
{
	(void)state;
	const uint32_t count[3] = { 7, 0, 3 };
	rw_topo_t t = topo_of(3, NULL);
	rw_pair_plan_t p;
	rw_sched_balance_native(&t, count, &p);
	assert_int_equal(p.moved, 0);
	assert_int_equal(p.total, 10);
	for (uint32_t o = 0; o < 3; o++) {
		assert_int_equal(p.quota[o], count[o]);
		for (uint32_t i = 0; i < count[o]; i++) {
			uint32_t e, s;
			rw_sched_map(&p, o, i, &e, &s);
			assert_int_equal(e, o);
			assert_int_equal(s, i);
		}
	}
}

/* Random rail counts of a few shapes: uniform, one hot rail, sparse, all zero. */
static void random_counts(uint32_t rails, uint32_t *count)
{
	uint32_t shape = rng_below(4), cap = 1 + rng_below(300);
	for (uint32_t r = 0; r < rails; r++) {
		switch (shape) {
		case 0: count[r] = rng_below(cap + 1); break;
		case 1: count[r] = r == 0 ? rng_below(4 * cap) : rng_below(4); break;
		case 2: count[r] = rng_below(3) == 0 ? rng_below(cap + 1) : 0; break;
		default: count[r] = rng_below(20) == 0 ? rng_below(3) : 0; break;
		}
	}
}

static void random_weights(uint32_t rails, uint32_t *weight)
{
	uint32_t kind = rng_below(3), eligible;
	do {
		eligible = 0;
		for (uint32_t r = 0; r < rails; r++) {
			if (kind == 0)
				weight[r] = 1;
			else if (kind == 1)
				weight[r] = rng_below(4) == 0 ? 0 : 1; /* masked rails */
			else
				weight[r] = rng_below(4) == 0 ? 0 : 1 + rng_below(400); /* capacities */
			eligible += weight[r] > 0;
		}
	} while (eligible == 0);
}

/* Thousands of random pairs: per-rail loads equal quotas; egress slots are a bijection onto
 * [0, quota) per rail; kept records keep their slot; unmap(map(x)) == x and map(unmap(y)) == y;
 * map_rail equals map; weighted quotas within one of proportional; masked rails get 0. */
static void test_random_properties(void **state)
{
	(void)state;
	seed_rng("random_properties");
	static uint8_t hit[RW_MAX_RAILS][16 * 1200];
	static uint8_t bulk_egress[16 * 1200];
	static uint32_t bulk_slot[16 * 1200];
	uint64_t records = 0;
	for (uint32_t c = 0; c < 3000; c++) {
		uint32_t rails = 1 + rng_below(RW_MAX_RAILS);
		uint32_t count[RW_MAX_RAILS] = { 0 }, weight[RW_MAX_RAILS] = { 0 };
		random_counts(rails, count);
		random_weights(rails, weight);
		rw_topo_t t = topo_of(rails, weight);
		rw_pair_plan_t p;
		uint32_t rot = (uint32_t)rng_next();
		rw_sched_balance(&t, count, rot, &p);

		uint64_t total = 0, wsum = 0;
		uint32_t qmin = UINT32_MAX, qmax = 0, qsum = 0, first_w = 0;
		int equal = 1; /* all eligible weights equal: quotas within one of each other */
		for (uint32_t r = 0; r < rails; r++) {
			total += count[r];
			wsum += weight[r];
			qsum += p.quota[r];
			if (weight[r] == 0) {
				assert_int_equal(p.quota[r], 0);
				continue;
			}
			first_w = first_w ? first_w : weight[r];
			equal = equal && weight[r] == first_w;
			qmin = RW_MIN(qmin, p.quota[r]);
			qmax = RW_MAX(qmax, p.quota[r]);
		}
		assert_int_equal(qsum, total);
		for (uint32_t r = 0; r < rails; r++) {
			int64_t diff = (int64_t)p.quota[r] * (int64_t)wsum - (int64_t)total * weight[r];
			assert_true(diff > -(int64_t)wsum && diff < (int64_t)wsum);
		}
		if (equal)
			assert_true(qmax - qmin <= 1);

		/* Forward map: bijection onto [0, quota_e) per rail, kept records fixed. */
		for (uint32_t r = 0; r < rails; r++)
			memset(hit[r], 0, p.quota[r]);
		uint32_t load[RW_MAX_RAILS] = { 0 }, moved = 0;
		for (uint32_t o = 0; o < rails; o++) {
			rw_sched_map_rail(&p, o, bulk_egress, bulk_slot);
			for (uint32_t i = 0; i < count[o]; i++) {
				uint32_t e, s, o2, i2;
				rw_sched_map(&p, o, i, &e, &s);
				assert_int_equal(bulk_egress[i], e);
				assert_int_equal(bulk_slot[i], s);
				assert_true(e < rails);
				assert_true(s < p.quota[e]);
				assert_int_equal(hit[e][s], 0);
				hit[e][s] = 1;
				load[e]++;
				if (i < RW_MIN(count[o], p.quota[o])) {
					assert_int_equal(e, o);
					assert_int_equal(s, i);
				}
				moved += e != o;
				rw_sched_unmap(&p, e, s, &o2, &i2);
				assert_int_equal(o2, o);
				assert_int_equal(i2, i);
			}
			records += count[o];
		}
		assert_int_equal(moved, p.moved);
		/* Inverse direction: every egress slot maps back to itself. */
		for (uint32_t e = 0; e < rails; e++) {
			assert_int_equal(load[e], p.quota[e]);
			for (uint32_t s = 0; s < p.quota[e]; s++) {
				uint32_t o, i, e2, s2;
				rw_sched_unmap(&p, e, s, &o, &i);
				assert_true(o < rails && i < count[o]);
				rw_sched_map(&p, o, i, &e2, &s2);
				assert_int_equal(e2, e);
				assert_int_equal(s2, s);
			}
		}
	}
	printf("random_properties: %" PRIu64 " records mapped\n", records);
}

/* Topology checks that guard the quota arithmetic. */
static void test_topo_checks(void **state)
{
	(void)state;
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 4, 8, 8), RW_OK);
	assert_int_equal(rw_sched_topo_check(&t), RW_OK);
	assert_int_equal(t.gpu_rail[7], 7);
	assert_int_equal(rw_sched_topo_eligible(&t), 8);
	assert_int_equal(rw_sched_topo_init(&t, 4, 8, 4), RW_OK);
	assert_int_equal(t.gpu_rail[5], 1);
	assert_int_equal(rw_sched_topo_init(&t, 0, 8, 8), RW_ERR_INVAL);
	assert_int_equal(rw_sched_topo_init(&t, 4, 8, RW_MAX_RAILS + 1), RW_ERR_INVAL);
	assert_int_equal(rw_sched_topo_init(&t, RW_MAX_NODES + 1, 8, 8), RW_ERR_INVAL);
	assert_int_equal(rw_sched_topo_init(&t, 4, 8, 8), RW_OK);
	t.gpu_rail[3] = 8;
	assert_int_equal(rw_sched_topo_check(&t), RW_ERR_INVAL);
	assert_int_equal(rw_sched_topo_init(&t, 4, 8, 8), RW_OK);
	memset(t.rail_weight, 0, sizeof(t.rail_weight));
	assert_int_equal(rw_sched_topo_check(&t), RW_ERR_INVAL); /* no eligible rail */
	t.rail_weight[2] = RW_MAX_RAIL_WEIGHT + 1;
	assert_int_equal(rw_sched_topo_check(&t), RW_ERR_INVAL);
	t.rail_weight[2] = RW_MAX_RAIL_WEIGHT;
	assert_int_equal(rw_sched_topo_check(&t), RW_OK);
}

/* Largest weights and counts: the weighted quota must not overflow. */
static void test_weighted_extremes(void **state)
{
	(void)state;
	const uint32_t weight[3] = { RW_MAX_RAIL_WEIGHT, 1, RW_MAX_RAIL_WEIGHT - 1 };
	const uint32_t count[3] = { UINT32_MAX / 3, UINT32_MAX / 3, UINT32_MAX / 3 };
	rw_topo_t t = topo_of(3, weight);
	rw_pair_plan_t p;
	rw_sched_balance(&t, count, 1, &p);
	uint64_t total = 3ull * (UINT32_MAX / 3), wsum = 2ull * RW_MAX_RAIL_WEIGHT;
	assert_int_equal((uint64_t)p.quota[0] + p.quota[1] + p.quota[2], total);
	for (uint32_t r = 0; r < 3; r++) {
		double exact = (double)total * weight[r] / (double)wsum;
		assert_true((double)p.quota[r] > exact - 1.0 && (double)p.quota[r] < exact + 1.0);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_topo_checks),
		cmocka_unit_test(test_oracle_equal_weights),
		cmocka_unit_test(test_oracle_weighted),
		cmocka_unit_test(test_rule_exact),
		cmocka_unit_test(test_plain_rotation_not_minimal),
		cmocka_unit_test(test_rotation_spreads_remainder),
		cmocka_unit_test(test_masked_rail),
		cmocka_unit_test(test_native),
		cmocka_unit_test(test_random_properties),
		cmocka_unit_test(test_weighted_extremes),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
