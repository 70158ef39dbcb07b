/* Permutation waves and path plans (docs/algorithms.md §3, §4): waves are
 * permutations covering every ordered pair once; the four paths' pair plans, egress totals and
 * wave counts; busiest NIC and lower bound against a recomputation; and the documented
 * counter-example: per-pair balance does not give aggregate balance.
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

/* Every wave of N = 2..64 nodes is a permutation without fixed points (one sender and one
 * receiver per node), src/dst/wave_of agree, and waves 1..N-1 cover every ordered pair once. */
static void test_waves(void **state)
{
	(void)state;
	static uint8_t covered[64][64];
	for (uint32_t n = 2; n <= 64; n++) {
		memset(covered, 0, sizeof(covered));
		for (uint32_t k = 1; k < n; k++) {
			uint32_t senders[64] = { 0 }, receivers[64] = { 0 };
			for (uint32_t s = 0; s < n; s++) {
				uint32_t d = rw_sched_wave_dst(n, s, k);
				assert_true(d < n);
				assert_int_not_equal(d, s);
				senders[s]++;
				receivers[d]++;
				assert_int_equal(rw_sched_wave_src(n, d, k), s);
				assert_int_equal(rw_sched_wave_of(n, s, d), k);
				covered[s][d]++;
			}
			for (uint32_t v = 0; v < n; v++) {
				assert_int_equal(senders[v], 1);
				assert_int_equal(receivers[v], 1);
			}
		}
		for (uint32_t s = 0; s < n; s++)
			for (uint32_t d = 0; d < n; d++)
				assert_int_equal(covered[s][d], s != d);
	}
}

#define MAXN 12

/* Per-pair weights of the random topologies (rail health: a rail down for some pairs, unequal
 * capacities); one buffer, the topology points at it. */
static uint32_t pair_w[MAXN * MAXN * 8];

static void random_topo(rw_topo_t *t)
{
	uint32_t nodes = 1 + rng_below(MAXN), rails = 1 + rng_below(8);
	assert_int_equal(rw_sched_topo_init(t, nodes, rails, rails), RW_OK);
	if (rng_below(3) == 0) { /* some pairs lose rails (even all of them), some weigh them */
		for (uint32_t i = 0; i < nodes * nodes * rails; i++)
			pair_w[i] = rng_below(5) == 0 ? 0 : 1 + rng_below(4) * rng_below(2);
		t->pair_weight = pair_w;
		return;
	}
	if (rng_below(3) == 0) {
		uint32_t eligible = 0;
		while (eligible == 0) {
			eligible = 0;
			for (uint32_t r = 0; r < rails; r++) {
				t->rail_weight[r] = rng_below(4) == 0 ? 0 : 1 + rng_below(3) * rng_below(2);
				eligible += t->rail_weight[r] > 0;
			}
		}
	}
}

static void random_counts(const rw_topo_t *t, uint32_t *counts)
{
	const uint32_t n = t->nodes, rails = t->rails;
	uint32_t cap = 1 + rng_below(50);
	for (uint32_t i = 0; i < n * n * rails; i++)
		counts[i] = rng_below(3) == 0 ? 0 : rng_below(cap + 1);
	for (uint32_t i = 0; i < n * n; i++) /* some pairs without any record */
		if (rng_below(6) == 0)
			memset(counts + i * rails, 0, rails * sizeof(*counts));
}

/* The plan of pair (s, d) built independently of sched/plan.c: the pair's weights (its own or
 * the topology's) as a plain topology; balanced paths: RailBalance with rotation s + d; native
 * paths: every eligible rail keeps its records and the records of ineligible rails are balanced
 * over the eligible ones as a pair of their own (counts zero on the eligible rails, so none is
 * "above" its share); no eligible rail at all: native. Fills quota[], returns records moved. */
static uint32_t ref_pair(const rw_topo_t *t, int balanced, uint32_t s, uint32_t d,
			 const uint32_t *cnt, uint32_t *quota)
{
	const uint32_t rails = t->rails;
	rw_topo_t w = *t;
	w.pair_weight = NULL;
	uint32_t eligible = 0, stranded[RW_MAX_RAILS] = { 0 }, n_stranded = 0;
	for (uint32_t r = 0; r < rails; r++) {
		if (t->pair_weight)
			w.rail_weight[r] = t->pair_weight[(s * t->nodes + d) * rails + r];
		eligible += w.rail_weight[r] > 0;
	}
	for (uint32_t r = 0; r < rails; r++)
		quota[r] = cnt[r];
	if (eligible == 0)
		return 0;
	rw_pair_plan_t p;
	if (balanced) {
		rw_sched_balance(&w, cnt, rw_sched_pair_rotation(s, d, 0), &p);
		memcpy(quota, p.quota, rails * sizeof(*quota));
		return p.moved;
	}
	for (uint32_t r = 0; r < rails; r++)
		if (w.rail_weight[r] == 0) {
			stranded[r] = cnt[r];
			n_stranded += cnt[r];
			quota[r] = 0;
		}
	if (n_stranded == 0)
		return 0;
	rw_sched_balance(&w, stranded, rw_sched_pair_rotation(s, d, 0), &p);
	for (uint32_t r = 0; r < rails; r++)
		quota[r] += p.quota[r];
	return n_stranded;
}

/* Independent loads: egress[s][r] and ingress[d][r] from every pair's quota, then the max. */
static uint64_t recompute_busiest(const rw_topo_t *t, int balanced, const uint32_t *counts)
{
	const uint32_t n = t->nodes, rails = t->rails;
	uint64_t egress[MAXN][RW_MAX_RAILS] = { { 0 } }, ingress[MAXN][RW_MAX_RAILS] = { { 0 } };
	for (uint32_t s = 0; s < n; s++)
		for (uint32_t d = 0; d < n; d++) {
			if (s == d)
				continue;
			const uint32_t *c = counts + (s * n + d) * rails;
			uint32_t quota[RW_MAX_RAILS];
			ref_pair(t, balanced, s, d, c, quota);
			for (uint32_t r = 0; r < rails; r++) {
				uint32_t q = quota[r];
				egress[s][r] += q;
				ingress[d][r] += q; /* rail-symmetric: egress rail r -> ingress rail r */
			}
		}
	uint64_t best = 0;
	for (uint32_t v = 0; v < n; v++)
		for (uint32_t r = 0; r < rails; r++)
			best = RW_MAX(best, RW_MAX(egress[v][r], ingress[v][r]));
	return best;
}

/* Every record of the pair maps to a distinct slot within its egress rail's quota, on a rail
 * eligible for the pair (when it has one), and unmaps back to itself. */
static void check_map(const rw_topo_t *t, uint32_t s, uint32_t d, const rw_pair_plan_t *pp)
{
	static uint8_t used[RW_MAX_RAILS][64 * MAXN];
	uint32_t eligible = 0;
	const uint32_t *w = t->pair_weight ? t->pair_weight + (s * t->nodes + d) * t->rails : t->rail_weight;
	for (uint32_t r = 0; r < t->rails; r++) {
		eligible += w[r] > 0;
		memset(used[r], 0, sizeof(used[r]));
	}
	for (uint32_t o = 0; o < t->rails; o++)
		for (uint32_t i = 0; i < pp->count[o]; i++) {
			uint32_t e, slot, o2, i2;
			rw_sched_map(pp, o, i, &e, &slot);
			assert_true(e < t->rails && slot < pp->quota[e] && slot < sizeof(used[0]));
			assert_true(eligible == 0 || w[e] > 0);
			assert_false(used[e][slot]);
			used[e][slot] = 1;
			rw_sched_unmap(pp, e, slot, &o2, &i2);
			assert_int_equal(o2, o);
			assert_int_equal(i2, i);
		}
}

/* Random clusters, every node, every path: pair plans are native or RailBalance with rotation
 * s + d (rw_sched_pair_rotation), identical to what the receiver computes for (s, me); egress
 * totals; waves. */
static void test_plan_build_random(void **state)
{
	(void)state;
	seed_rng("plan_build_random");
	static uint32_t counts[MAXN * MAXN * 8];
	rw_pair_plan_t pairs[MAXN];
	for (uint32_t c = 0; c < 400; c++) {
		rw_topo_t t;
		random_topo(&t);
		random_counts(&t, counts);
		const uint32_t n = t.nodes, rails = t.rails;
		for (uint32_t p = 0; p < RW_PATH_COUNT; p++) {
			for (uint32_t me = 0; me < n; me++) {
				rw_phase_plan_t plan = { .pairs = pairs };
				assert_int_equal(rw_sched_plan_build(&t, (rw_path_t)p, me, counts, &plan), RW_OK);
				assert_int_equal(plan.path, p);
				assert_int_equal(plan.me, me);
				assert_int_equal(plan.nodes, n);
				assert_int_equal(plan.n_waves, rw_path_waved((rw_path_t)p) ? n - 1 : 1);
				uint64_t egress[RW_MAX_RAILS] = { 0 };
				assert_int_equal(pairs[me].total, 0);
				for (uint32_t d = 0; d < n; d++) {
					if (d == me)
						continue;
					const uint32_t *cnt = counts + (me * n + d) * rails;
					uint32_t quota[RW_MAX_RAILS], total = 0;
					uint32_t moved = ref_pair(&t, rw_path_balanced((rw_path_t)p), me, d, cnt, quota);
					for (uint32_t r = 0; r < rails; r++) {
						assert_int_equal(pairs[d].count[r], cnt[r]);
						assert_int_equal(pairs[d].quota[r], quota[r]);
						total += cnt[r];
					}
					assert_int_equal(pairs[d].total, total);
					assert_int_equal(pairs[d].moved, moved);
					check_map(&t, me, d, &pairs[d]);
					for (uint32_t r = 0; r < rails; r++)
						egress[r] += pairs[d].quota[r];
				}
				for (uint32_t r = 0; r < RW_MAX_RAILS; r++)
					assert_int_equal(plan.egress[r], egress[r]);
			}
			uint64_t busiest = rw_sched_busiest_nic(&t, (rw_path_t)p, counts);
			assert_int_equal(busiest, recompute_busiest(&t, rw_path_balanced((rw_path_t)p), counts));
		}
		assert_int_equal(rw_sched_lower_bound(&t, counts), recompute_busiest(&t, 1, counts));
	}
}

/* Both ends agree: the receive side (rw_sched_plan_build_recv for me, rw_sched_plan_pair for
 * (s, me)) equals what each sender s put in its own send plan for me, on random clusters
 * (weights, masks, empty pairs), every path and every node. */
static void test_recv_matches_send(void **state)
{
	(void)state;
	seed_rng("recv_matches_send");
	static uint32_t counts[MAXN * MAXN * 8];
	static rw_pair_plan_t send[MAXN][MAXN];
	rw_pair_plan_t recv[MAXN], one;
	for (uint32_t c = 0; c < 300; c++) {
		rw_topo_t t;
		random_topo(&t);
		random_counts(&t, counts);
		const uint32_t n = t.nodes, rails = t.rails;
		for (uint32_t p = 0; p < RW_PATH_COUNT; p++) {
			for (uint32_t s = 0; s < n; s++) {
				rw_phase_plan_t plan = { .pairs = send[s] };
				assert_int_equal(rw_sched_plan_build(&t, (rw_path_t)p, s, counts, &plan), RW_OK);
			}
			for (uint32_t me = 0; me < n; me++) {
				memset(recv, 0xa5, sizeof(recv));
				assert_int_equal(rw_sched_plan_build_recv(&t, (rw_path_t)p, me, counts, recv),
						 RW_OK);
				for (uint32_t s = 0; s < n; s++) {
					assert_memory_equal(&recv[s], &send[s][me], sizeof(recv[s]));
					rw_sched_plan_pair(&t, (rw_path_t)p, s, me,
							   counts + (s * n + me) * rails, &one);
					if (s != me)
						assert_memory_equal(&one, &send[s][me], sizeof(one));
				}
				assert_int_equal(recv[me].total, 0);
				assert_int_equal(recv[me].rails, rails);
			}
		}
	}
	assert_int_equal(rw_sched_plan_build_recv(NULL, RW_PATH_JOINT, 0, counts, recv), RW_ERR_INVAL);
}

/* Per-pair balance is not aggregate balance. N = 5, R = 4; every pair that exists carries
 * counts [2,1,1,1] (T = 5: base 1, remainder 1). The count-aware rule gives the extra record to
 * rail 0 (the only rail above base) whatever the rotation, so every pair is balanced within one
 * ([2,1,1,1]) while the sums over pairs are not:
 *   - node 0 sending to nodes 1..4: egress rails [8,4,4,4];
 *   - nodes 1..4 sending to node 0: ingress rails of node 0 [8,4,4,4].
 * A global assignment could give 5 per rail (20 records over 4 rails); RailBalance, being per
 * pair and move-minimal, keeps 8 on rail 0. docs/algorithms.md §2.4 discusses it. */
static void test_aggregate_not_balanced(void **state)
{
	(void)state;
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 5, 4, 4), RW_OK);
	static uint32_t counts[5 * 5 * 4];
	const uint32_t pair[4] = { 2, 1, 1, 1 };
	for (uint32_t v = 1; v < 5; v++) {
		memcpy(counts + (0 * 5 + v) * 4, pair, sizeof(pair)); /* 0 -> v */
		memcpy(counts + (v * 5 + 0) * 4, pair, sizeof(pair)); /* v -> 0 */
	}
	rw_pair_plan_t pairs[5];
	rw_phase_plan_t plan = { .pairs = pairs };
	assert_int_equal(rw_sched_plan_build(&t, RW_PATH_JOINT, 0, counts, &plan), RW_OK);
	for (uint32_t d = 1; d < 5; d++) {
		uint32_t qmin = UINT32_MAX, qmax = 0;
		for (uint32_t r = 0; r < 4; r++) {
			qmin = RW_MIN(qmin, pairs[d].quota[r]);
			qmax = RW_MAX(qmax, pairs[d].quota[r]);
		}
		assert_true(qmax - qmin <= 1); /* every pair balanced within one */
	}
	const uint64_t egress[4] = { 8, 4, 4, 4 };
	assert_memory_equal(plan.egress, egress, sizeof(egress)); /* aggregate: differ by 4 */

	uint64_t ingress[4] = { 0 };
	for (uint32_t s = 1; s < 5; s++) { /* as receiver 0 builds them */
		rw_pair_plan_t p;
		rw_sched_plan_pair(&t, RW_PATH_JOINT, s, 0, counts + (s * 5 + 0) * 4, &p);
		for (uint32_t r = 0; r < 4; r++)
			ingress[r] += p.quota[r];
	}
	assert_memory_equal(ingress, egress, sizeof(egress));
	assert_int_equal(rw_sched_lower_bound(&t, counts), 8); /* not 5 */

	/* Rotation decides only among equally good rails, so it can spread but not balance. Nodes
	 * 1..4 send node 0 [0,0,0,3]: T = 3, base 0, rem 3; rail 3 wins one extra by count, the
	 * other two go to the next rails in rotation order. Rotation s + d = s gives the sources
	 * [0,1,1,1], [1,0,1,1], [1,1,0,1], [1,1,0,1]: node 0's ingress [3,3,2,4], within one per
	 * pair, but 4 on rail 3 where 3 per rail is possible. A rotation by destination only
	 * (every source rotation 0 here) would have stacked them: [1,1,0,1] each, ingress
	 * [4,4,0,4] with rail 2 idle. */
	memset(counts, 0, sizeof(counts));
	const uint32_t late[4] = { 0, 0, 0, 3 };
	for (uint32_t s = 1; s < 5; s++)
		memcpy(counts + (s * 5 + 0) * 4, late, sizeof(late));
	const uint32_t pair_q[5][4] = {
		[1] = { 0, 1, 1, 1 }, [2] = { 1, 0, 1, 1 }, [3] = { 1, 1, 0, 1 }, [4] = { 1, 1, 0, 1 },
	};
	uint64_t by_dst_only[4] = { 0 };
	memset(ingress, 0, sizeof(ingress));
	for (uint32_t s = 1; s < 5; s++) {
		assert_int_equal(rw_sched_plan_build(&t, RW_PATH_JOINT, s, counts, &plan), RW_OK);
		assert_memory_equal(pairs[0].quota, pair_q[s], sizeof(pair_q[s]));
		rw_pair_plan_t p;
		rw_sched_balance(&t, late, 0, &p);
		for (uint32_t r = 0; r < 4; r++) {
			ingress[r] += pairs[0].quota[r];
			by_dst_only[r] += p.quota[r];
		}
	}
	const uint64_t spread[4] = { 3, 3, 2, 4 }, stacked[4] = { 4, 4, 0, 4 };
	assert_memory_equal(ingress, spread, sizeof(spread));
	assert_memory_equal(by_dst_only, stacked, sizeof(stacked));
	assert_int_equal(rw_sched_lower_bound(&t, counts), 4); /* not 3 */
}

/* Where one GPU owns every remote token, RailBalance spreads it: the busiest NIC falls from
 * all records to a 1/R share, and the lower bound says so. */
static void test_lower_bound_hot_rail(void **state)
{
	(void)state;
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 2, 8, 8), RW_OK);
	uint32_t counts[2 * 2 * 8] = { 0 };
	counts[(0 * 2 + 1) * 8 + 3] = 800; /* node 0 -> node 1, all on rail 3 */
	assert_int_equal(rw_sched_busiest_nic(&t, RW_PATH_NATIVE, counts), 800);
	assert_int_equal(rw_sched_busiest_nic(&t, RW_PATH_PERM_ONLY, counts), 800);
	assert_int_equal(rw_sched_busiest_nic(&t, RW_PATH_RAIL_ONLY, counts), 100);
	assert_int_equal(rw_sched_busiest_nic(&t, RW_PATH_JOINT, counts), 100);
	assert_int_equal(rw_sched_lower_bound(&t, counts), 100);
	/* A failed rail: 7 eligible rails, 800 = 7 * 114 + 2. */
	t.rail_weight[5] = 0;
	assert_int_equal(rw_sched_lower_bound(&t, counts), 115);
	/* Local records never count. */
	counts[(1 * 2 + 1) * 8 + 0] = 100000;
	assert_int_equal(rw_sched_lower_bound(&t, counts), 115);
}

static void test_plan_bad_args(void **state)
{
	(void)state;
	rw_topo_t t;
	assert_int_equal(rw_sched_topo_init(&t, 3, 2, 2), RW_OK);
	uint32_t counts[3 * 3 * 2] = { 0 };
	rw_pair_plan_t pairs[3];
	rw_phase_plan_t plan = { .pairs = pairs };
	assert_int_equal(rw_sched_plan_build(&t, RW_PATH_JOINT, 3, counts, &plan), RW_ERR_INVAL);
	assert_int_equal(rw_sched_plan_build(&t, RW_PATH_COUNT, 0, counts, &plan), RW_ERR_INVAL);
	assert_int_equal(rw_sched_plan_build(&t, RW_PATH_JOINT, 0, NULL, &plan), RW_ERR_INVAL);
	plan.pairs = NULL;
	assert_int_equal(rw_sched_plan_build(&t, RW_PATH_JOINT, 0, counts, &plan), RW_ERR_INVAL);
	plan.pairs = pairs;
	t.gpu_rail[0] = 5;
	assert_int_equal(rw_sched_plan_build(&t, RW_PATH_JOINT, 0, counts, &plan), RW_ERR_INVAL);
	t.gpu_rail[0] = 0;
	assert_int_equal(rw_sched_plan_build(&t, RW_PATH_JOINT, 0, counts, &plan), RW_OK);
	assert_int_equal(plan.n_waves, 2);
	/* One node: nothing to send, no waves. */
	assert_int_equal(rw_sched_topo_init(&t, 1, 2, 2), RW_OK);
	assert_int_equal(rw_sched_plan_build(&t, RW_PATH_JOINT, 0, counts, &plan), RW_OK);
	assert_int_equal(plan.n_waves, 0);
	assert_int_equal(plan.egress[0] + plan.egress[1], 0);
	assert_int_equal(rw_sched_lower_bound(&t, counts), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_waves),
		cmocka_unit_test(test_plan_build_random),
		cmocka_unit_test(test_recv_matches_send),
		cmocka_unit_test(test_aggregate_not_balanced),
		cmocka_unit_test(test_lower_bound_hot_rail),
		cmocka_unit_test(test_plan_bad_args),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
