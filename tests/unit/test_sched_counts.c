/* Demand counts and records (docs/algorithms.md §1): rw_sched_count and
 * rw_sched_records against a straightforward recomputation on random routing, per-node
 * de-duplication, local-node records, dropped (negative) slots, the expert -> node division at
 * its exactness bound, and bad input rejected with the rank named.
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

/* Independent reference: node of expert e is floor(e * N / E) (equal to e / (E / N) because N
 * divides E); a token makes one record per distinct node among its valid experts. */
static int token_goes_to(const int32_t *ids, uint32_t topk, uint32_t n_experts, uint32_t nodes,
			 uint32_t d)
{
	for (uint32_t k = 0; k < topk; k++)
		if (ids[k] >= 0 && (uint64_t)ids[k] * nodes / n_experts == d)
			return 1;
	return 0;
}

#define MAX_RANKS 16
#define MAX_TOKENS 300

typedef struct routing {
	rw_topo_t topo;
	uint32_t n_experts, me, n_ranks;
	rw_rank_tokens_t ranks[MAX_RANKS];
	int32_t ids[MAX_RANKS][MAX_TOKENS * 8];
} routing_t;

static void random_routing(routing_t *rt)
{
	uint32_t nodes = 1 + rng_below(9), gpus = 1 + rng_below(8), rails = 1 + rng_below(gpus);
	assert_int_equal(rw_sched_topo_init(&rt->topo, nodes, gpus, rails), RW_OK);
	if (rng_below(2)) /* arbitrary GPU -> rail map */
		for (uint32_t g = 0; g < gpus; g++)
			rt->topo.gpu_rail[g] = (uint8_t)rng_below(rails);
	rt->n_experts = nodes * gpus * (1 + rng_below(4));
	rt->me = rng_below(nodes);
	rt->n_ranks = rng_below(MAX_RANKS + 1); /* any number, GPUs repeated or absent */
	uint32_t hot = rng_below(nodes);
	for (uint32_t i = 0; i < rt->n_ranks; i++) {
		rw_rank_tokens_t *rk = &rt->ranks[i];
		rk->local_gpu = rng_below(gpus);
		rk->n_tokens = rng_below(MAX_TOKENS + 1);
		rk->topk = 1 + rng_below(8);
		rk->expert_ids = rt->ids[i];
		for (uint32_t j = 0; j < rk->n_tokens * rk->topk; j++) {
			uint32_t roll = rng_below(20);
			if (roll == 0)
				rt->ids[i][j] = -1; /* dropped slot */
			else if (roll < 8) /* concentrate on one node: many duplicates */
				rt->ids[i][j] = (int32_t)(hot * (rt->n_experts / nodes) +
							  rng_below(rt->n_experts / nodes));
			else
				rt->ids[i][j] = (int32_t)rng_below(rt->n_experts);
		}
	}
}

/* Random routing: the row and the CSR records equal the recomputation, record by record in
 * native order (ranks in array order, tokens ascending). */
static void test_counts_and_records_random(void **state)
{
	(void)state;
	seed_rng("counts_and_records_random");
	static routing_t rt;
	static uint32_t row[9 * RW_MAX_RAILS], ref[9 * RW_MAX_RAILS], offset[9 * RW_MAX_RAILS + 1];
	static rw_record_t rec[MAX_RANKS * MAX_TOKENS * 8];
	uint64_t records = 0;
	for (uint32_t c = 0; c < 600; c++) {
		random_routing(&rt);
		const uint32_t nodes = rt.topo.nodes, rails = rt.topo.rails;
		uint32_t bad = 12345;
		assert_int_equal(rw_sched_count(&rt.topo, rt.n_experts, rt.me, rt.ranks, rt.n_ranks,
						row, &bad), RW_OK);
		assert_int_equal(bad, 12345); /* untouched on success */
		memset(ref, 0, sizeof(ref));
		for (uint32_t i = 0; i < rt.n_ranks; i++) {
			const rw_rank_tokens_t *rk = &rt.ranks[i];
			for (uint32_t t = 0; t < rk->n_tokens; t++)
				for (uint32_t d = 0; d < nodes; d++)
					ref[d * rails + rt.topo.gpu_rail[rk->local_gpu]] +=
						token_goes_to(rk->expert_ids + t * rk->topk, rk->topk,
							      rt.n_experts, nodes, d);
		}
		assert_memory_equal(row, ref, nodes * rails * sizeof(row[0]));

		rw_sched_prefix(row, nodes * rails, offset);
		assert_int_equal(offset[0], 0);
		for (uint32_t j = 0; j < nodes * rails; j++)
			assert_int_equal(offset[j + 1] - offset[j], row[j]);
		memset(rec, 0xff, sizeof(rec[0]) * offset[nodes * rails]);
		assert_int_equal(rw_sched_records(&rt.topo, rt.n_experts, rt.me, rt.ranks, rt.n_ranks,
						  offset, rec), RW_OK);
		/* Walk the native order independently and compare segment by segment. */
		for (uint32_t d = 0; d < nodes; d++)
			for (uint32_t r = 0; r < rails; r++) {
				uint32_t at = offset[d * rails + r];
				for (uint32_t i = 0; i < rt.n_ranks; i++) {
					const rw_rank_tokens_t *rk = &rt.ranks[i];
					if (rt.topo.gpu_rail[rk->local_gpu] != r)
						continue;
					for (uint32_t t = 0; t < rk->n_tokens; t++) {
						if (!token_goes_to(rk->expert_ids + t * rk->topk, rk->topk,
								   rt.n_experts, nodes, d))
							continue;
						assert_int_equal(rec[at].rank, i);
						assert_int_equal(rec[at].token, t);
						at++;
					}
				}
				assert_int_equal(at, offset[d * rails + r + 1]);
			}
		records += offset[nodes * rails];
	}
	printf("counts_and_records_random: %" PRIu64 " records\n", records);
}

/* The sliced passes (any budget, from 1 token on) give exactly the one-shot results, and a bad
 * id found in a later slice still names its rank and leaves the row zero. */
static void test_sliced_passes(void **state)
{
	(void)state;
	seed_rng("sliced_passes");
	static routing_t rt;
	static uint32_t row[9 * RW_MAX_RAILS], ref[9 * RW_MAX_RAILS], offset[9 * RW_MAX_RAILS + 1];
	static rw_record_t rec[MAX_RANKS * MAX_TOKENS * 8], rec_ref[MAX_RANKS * MAX_TOKENS * 8];
	static rw_sched_records_iter_t rit;
	uint64_t calls = 0;
	for (uint32_t c = 0; c < 300; c++) {
		random_routing(&rt);
		const uint32_t nr = rt.topo.nodes * rt.topo.rails;
		assert_int_equal(rw_sched_count(&rt.topo, rt.n_experts, rt.me, rt.ranks, rt.n_ranks,
						ref, NULL), RW_OK);
		const uint32_t budget = 1 + rng_below(c % 3 ? 5 : 40);
		rw_sched_count_iter_t it = { 0 };
		int done = 0;
		memset(row, 0xee, sizeof(row)); /* the first slice zeroes it */
		while (!done) {
			assert_int_equal(rw_sched_count_step(&rt.topo, rt.n_experts, rt.me, rt.ranks,
							     rt.n_ranks, row, &it, budget, &done, NULL), RW_OK);
			calls++;
		}
		assert_memory_equal(row, ref, nr * sizeof(row[0]));
		rw_sched_prefix(row, nr, offset);
		assert_int_equal(rw_sched_records(&rt.topo, rt.n_experts, rt.me, rt.ranks, rt.n_ranks,
						  offset, rec_ref), RW_OK);
		memset(&rit, 0, sizeof(rit));
		memset(rec, 0xff, sizeof(rec[0]) * offset[nr]);
		done = 0;
		while (!done)
			assert_int_equal(rw_sched_records_step(&rt.topo, rt.n_experts, rt.me, rt.ranks,
							       rt.n_ranks, offset, rec, &rit, budget,
							       &done), RW_OK);
		assert_memory_equal(rec, rec_ref, sizeof(rec[0]) * offset[nr]);
	}
	/* A bad id in the last token of the second rank, found by a later slice. */
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, 2, 2, 2), RW_OK);
	const int32_t good[8] = { 0, 1, 4, 7, 2, 3, 5, 6 }, bad[8] = { 0, 1, 4, 7, 2, 3, 5, 8 };
	rw_rank_tokens_t rk[2] = {
		{ .local_gpu = 0, .n_tokens = 4, .topk = 2, .expert_ids = good },
		{ .local_gpu = 1, .n_tokens = 4, .topk = 2, .expert_ids = bad },
	};
	uint32_t small[4], bad_rank = 99;
	rw_sched_count_iter_t it = { 0 };
	int done = 0;
	rw_status_t st = RW_OK;
	while (!done && st == RW_OK)
		st = rw_sched_count_step(&topo, 8, 0, rk, 2, small, &it, 3, &done, &bad_rank);
	assert_int_equal(st, RW_ERR_INVAL);
	assert_int_equal(bad_rank, 1);
	for (uint32_t i = 0; i < 4; i++)
		assert_int_equal(small[i], 0);
	printf("sliced_passes: %" PRIu64 " count slices\n", calls);
}

/* One rank, hand-written tokens: de-duplication by node, local records, dropped slots. */
static void test_dedup_and_local(void **state)
{
	(void)state;
	rw_topo_t topo;
	/* N = 4 nodes, G = 2, R = 2, E = 16: node n hosts experts 4n .. 4n+3. */
	assert_int_equal(rw_sched_topo_init(&topo, 4, 2, 2), RW_OK);
	const int32_t ids[] = {
		4, 5, 6, 7,     /* all on node 1: one record */
		0, 8, 9, 13,    /* node 0 (local), node 2 twice, node 3 */
		-1, -1, -1, -1, /* dropped: nothing */
		15, -1, 12, 1,  /* node 3 twice with a hole, node 0 */
	};
	rw_rank_tokens_t rk = { .local_gpu = 1, .n_tokens = 4, .topk = 4, .expert_ids = ids };
	uint32_t row[4 * 2], offset[4 * 2 + 1];
	assert_int_equal(rw_sched_count(&topo, 16, 0, &rk, 1, row, NULL), RW_OK);
	const uint32_t expect[4 * 2] = { 0, 2, 0, 1, 0, 1, 0, 2 }; /* rail 1 = GPU 1's rail */
	assert_memory_equal(row, expect, sizeof(expect));
	rw_sched_prefix(row, 8, offset);
	rw_record_t rec[6];
	assert_int_equal(rw_sched_records(&topo, 16, 0, &rk, 1, offset, rec), RW_OK);
	/* (0,1): tokens 1, 3; (1,1): token 0; (2,1): token 1; (3,1): tokens 1, 3 */
	const uint32_t tokens[6] = { 1, 3, 0, 1, 1, 3 };
	for (uint32_t i = 0; i < 6; i++) {
		assert_int_equal(rec[i].rank, 0);
		assert_int_equal(rec[i].token, tokens[i]);
	}
}

/* The expert -> node division: reciprocal multiply when exact, hardware divide beyond. Every
 * expert at the exactness bound E * (E / N) == 2^32, and samples of larger E, land on
 * e / (E / N). */
static void check_node_of(uint32_t nodes, uint32_t n_experts, uint32_t e)
{
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, nodes, 1, 1), RW_OK);
	static uint32_t row[RW_MAX_NODES];
	int32_t id = (int32_t)e;
	rw_rank_tokens_t rk = { .local_gpu = 0, .n_tokens = 1, .topk = 1, .expert_ids = &id };
	assert_int_equal(rw_sched_count(&topo, n_experts, 0, &rk, 1, row, NULL), RW_OK);
	uint32_t d = rw_sched_expert_node(n_experts, nodes, e);
	assert_int_equal(row[d], 1);
}

static void test_expert_node_division(void **state)
{
	(void)state;
	seed_rng("expert_node_division");
	/* E = 2^17, N = 4: E / N = 2^15, E * (E / N) = 2^32 (the last exact case). */
	for (uint32_t e = 0; e < (1u << 17); e += 1 + (e & 7))
		check_node_of(4, 1u << 17, e);
	for (uint32_t e = (1u << 17) - 64; e < (1u << 17); e++)
		check_node_of(4, 1u << 17, e);
	/* Non-power-of-two per-node counts and the divide fallback (E * E/N > 2^32). */
	const uint32_t shapes[][2] = { { 3, 3 * 21845 }, { 7, 7 * 9363 }, { 4096, 4096 * 16 },
				       { 2, 1u << 30 }, { 3, 3 * 715827882u }, { 1, 2147483647u } };
	for (uint32_t s = 0; s < RW_ARRAY_SIZE(shapes); s++) {
		uint32_t n = shapes[s][0], E = shapes[s][1];
		for (uint32_t i = 0; i < 2000; i++)
			check_node_of(n, E, rng_below(RW_MIN(E, (uint32_t)INT32_MAX)));
		check_node_of(n, E, RW_MIN(E - 1, (uint32_t)INT32_MAX));
		for (uint32_t b = 1; b < n && b < 64; b++) { /* both sides of node boundaries */
			check_node_of(n, E, b * (E / n) - 1);
			check_node_of(n, E, b * (E / n));
		}
	}
}

/* Bad input: an out-of-range expert id names the rank and leaves the row zero; bad topk,
 * local GPU, E not a multiple of W, and offsets that do not match the routing are refused. */
static void test_bad_input(void **state)
{
	(void)state;
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, 2, 2, 2), RW_OK);
	const int32_t good[4] = { 0, 1, 4, 7 };
	const int32_t bad[4] = { 0, 8, 1, 2 }; /* 8 >= E */
	rw_rank_tokens_t rk[3] = {
		{ .local_gpu = 0, .n_tokens = 2, .topk = 2, .expert_ids = good },
		{ .local_gpu = 1, .n_tokens = 2, .topk = 2, .expert_ids = good },
		{ .local_gpu = 1, .n_tokens = 2, .topk = 2, .expert_ids = bad },
	};
	uint32_t row[4], bad_rank = 99, offset[5];
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, &bad_rank), RW_ERR_INVAL);
	assert_int_equal(bad_rank, 2);
	for (uint32_t i = 0; i < 4; i++)
		assert_int_equal(row[i], 0);
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, NULL), RW_ERR_INVAL);
	/* Only -1 means "no expert": -5 and INT_MIN are refused, naming the rank. */
	const int32_t minus5[4] = { 0, -5, 1, 2 }, intmin[4] = { INT32_MIN, 1, -1, -1 };
	const int32_t minus1[4] = { -1, 1, -1, -1 };
	rk[2].expert_ids = minus5;
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, &bad_rank), RW_ERR_INVAL);
	assert_int_equal(bad_rank, 2);
	rk[2].expert_ids = intmin;
	bad_rank = 99;
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, &bad_rank), RW_ERR_INVAL);
	assert_int_equal(bad_rank, 2);
	rk[2].expert_ids = minus1;
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, NULL), RW_OK);

	rk[2].expert_ids = good;
	rk[1].topk = RW_MAX_TOPK + 1;
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, &bad_rank), RW_ERR_INVAL);
	assert_int_equal(bad_rank, 1);
	rk[1].topk = 2;
	rk[0].local_gpu = 2;
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, &bad_rank), RW_ERR_INVAL);
	assert_int_equal(bad_rank, 0);
	rk[0].local_gpu = 0;
	rk[2].expert_ids = NULL;
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, &bad_rank), RW_ERR_INVAL);
	assert_int_equal(bad_rank, 2);
	rk[2].expert_ids = good;

	assert_int_equal(rw_sched_count(&topo, 6, 0, rk, 3, row, NULL), RW_ERR_INVAL); /* W = 4 */
	assert_int_equal(rw_sched_count(&topo, 0, 0, rk, 3, row, NULL), RW_ERR_INVAL);
	assert_int_equal(rw_sched_count(&topo, 8, 2, rk, 3, row, NULL), RW_ERR_INVAL); /* me */
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 3, row, NULL), RW_OK);

	/* Offsets from fewer ranks than the records pass sees: refused, nothing written past
	 * the segment ends (ASan would see it). */
	rw_sched_prefix(row, 4, offset);
	uint32_t short_row[4];
	assert_int_equal(rw_sched_count(&topo, 8, 0, rk, 1, short_row, NULL), RW_OK);
	uint32_t short_offset[5];
	rw_sched_prefix(short_row, 4, short_offset);
	rw_record_t *rec = malloc(sizeof(*rec) * short_offset[4]);
	assert_non_null(rec);
	assert_int_equal(rw_sched_records(&topo, 8, 0, rk, 3, short_offset, rec), RW_ERR_INVAL);
	free(rec);
	rk[2].expert_ids = bad;
	rw_record_t full[16];
	assert_int_equal(rw_sched_records(&topo, 8, 0, rk, 3, offset, full), RW_ERR_INVAL);
}

/* Empty inputs: no ranks, ranks without tokens. */
static void test_empty(void **state)
{
	(void)state;
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, 3, 2, 2), RW_OK);
	uint32_t row[6] = { 1, 1, 1, 1, 1, 1 }, offset[7];
	assert_int_equal(rw_sched_count(&topo, 6, 1, NULL, 0, row, NULL), RW_OK);
	for (uint32_t i = 0; i < 6; i++)
		assert_int_equal(row[i], 0);
	rw_rank_tokens_t rk = { .local_gpu = 1, .n_tokens = 0, .topk = 0, .expert_ids = NULL };
	assert_int_equal(rw_sched_count(&topo, 6, 1, &rk, 1, row, NULL), RW_OK);
	rw_sched_prefix(row, 6, offset);
	assert_int_equal(offset[6], 0);
	assert_int_equal(rw_sched_records(&topo, 6, 1, &rk, 1, offset, NULL), RW_OK);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_dedup_and_local),
		cmocka_unit_test(test_counts_and_records_random),
		cmocka_unit_test(test_sliced_passes),
		cmocka_unit_test(test_expert_node_division),
		cmocka_unit_test(test_bad_input),
		cmocka_unit_test(test_empty),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
