/* The synthetic routing generator of tools/ (tools/synth.h): reproducible from its seed and
 * independent of drawing order, ids in range and distinct per token, group-limited routing
 * keeps a token inside its groups, replicas appear when the group has more ranks than experts,
 * and each knob moves the quantity it is meant to move. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "tools/synth.h"

static rw_synth_cfg_t base_cfg(void)
{
	return (rw_synth_cfg_t){ .nodes = 4, .gpus_per_node = 8, .n_experts = 128, .topk = 8,
				 .tokens_per_rank = 512, .seed = 42, .zipf_s = 0.8,
				 .dirichlet = 50.0, .rail_skew = 0.0 };
}

static int32_t *draw(const rw_synth_cfg_t *cfg, uint32_t node, uint32_t gpu, uint32_t *phys_p)
{
	rw_synth_t gen;
	assert_int_equal(rw_synth_init(&gen, cfg), RW_OK);
	int32_t *ids = malloc(sizeof(int32_t) * cfg->tokens_per_rank * cfg->topk);
	assert_non_null(ids);
	rw_synth_rank(&gen, node, gpu, ids);
	if (phys_p)
		*phys_p = gen.phys_experts;
	rw_synth_free(&gen);
	return ids;
}

static void test_reproducible(void **state)
{
	(void)state;
	rw_synth_cfg_t cfg = base_cfg();
	size_t len = sizeof(int32_t) * cfg.tokens_per_rank * cfg.topk;
	int32_t *a = draw(&cfg, 2, 5, NULL);
	/* Same rank drawn after other ranks, by another generator: same ids. */
	rw_synth_t gen;
	assert_int_equal(rw_synth_init(&gen, &cfg), RW_OK);
	int32_t *b = malloc(len);
	assert_non_null(b);
	rw_synth_rank(&gen, 0, 0, b);
	rw_synth_rank(&gen, 3, 7, b);
	rw_synth_rank(&gen, 2, 5, b);
	rw_synth_free(&gen);
	assert_memory_equal(a, b, len);
	/* Another seed or layer: different ids. */
	cfg.seed = 43;
	int32_t *c = draw(&cfg, 2, 5, NULL);
	assert_memory_not_equal(a, c, len);
	cfg.seed = 42;
	cfg.layer = 1;
	int32_t *d = draw(&cfg, 2, 5, NULL);
	assert_memory_not_equal(a, d, len);
	free(a);
	free(b);
	free(c);
	free(d);
}

static void check_tokens(const rw_synth_cfg_t *cfg, const int32_t *ids, uint32_t phys)
{
	for (uint32_t t = 0; t < cfg->tokens_per_rank; t++) {
		const int32_t *tok = ids + (size_t)t * cfg->topk;
		for (uint32_t i = 0; i < cfg->topk; i++) {
			assert_true(tok[i] >= 0 && (uint32_t)tok[i] < phys);
			for (uint32_t j = 0; j < i; j++) /* distinct logical experts */
				assert_true(tok[i] % cfg->n_experts != tok[j] % cfg->n_experts);
		}
	}
}

static void test_ranges_and_groups(void **state)
{
	(void)state;
	rw_synth_cfg_t cfg = base_cfg();
	uint32_t phys;
	int32_t *ids = draw(&cfg, 1, 3, &phys);
	assert_int_equal(phys, 128);
	check_tokens(&cfg, ids, phys);
	free(ids);

	/* DeepSeek-V3 shape: 256 experts in 8 groups, a token uses at most 4 groups. */
	cfg.n_experts = 256;
	cfg.n_groups = 8;
	cfg.topk_groups = 4;
	ids = draw(&cfg, 0, 0, &phys);
	check_tokens(&cfg, ids, phys);
	for (uint32_t t = 0; t < cfg.tokens_per_rank; t++) {
		uint32_t groups = 0;
		for (uint32_t i = 0; i < cfg.topk; i++)
			groups |= 1u << ((ids[t * cfg.topk + i] % 256) / 32);
		assert_true(__builtin_popcount(groups) <= 4);
	}
	free(ids);

	/* More ranks than experts (N = 32, W = 256 > 128): replicas, ids still distinct experts. */
	cfg = base_cfg();
	cfg.nodes = 32;
	ids = draw(&cfg, 31, 7, &phys);
	assert_int_equal(phys, 256);
	check_tokens(&cfg, ids, phys);
	int high = 0;
	for (uint32_t i = 0; i < cfg.tokens_per_rank * cfg.topk; i++)
		high |= ids[i] >= 128;
	assert_true(high); /* the second replica is used */
	free(ids);

	/* Bad knobs are refused. */
	rw_synth_t gen;
	cfg = base_cfg();
	cfg.rail_skew = 1.5;
	assert_int_equal(rw_synth_init(&gen, &cfg), RW_ERR_INVAL);
	cfg = base_cfg();
	cfg.topk = 0;
	assert_int_equal(rw_synth_init(&gen, &cfg), RW_ERR_INVAL);
	cfg = base_cfg();
	cfg.n_groups = 8;
	cfg.topk_groups = 9;
	assert_int_equal(rw_synth_init(&gen, &cfg), RW_ERR_INVAL);
}

/* Native egress records of node 0 per rail, summed over remote destinations. */
static void node0_egress(const rw_synth_cfg_t *cfg, uint64_t *egress)
{
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, cfg->nodes, cfg->gpus_per_node, 8), RW_OK);
	rw_synth_t gen;
	assert_int_equal(rw_synth_init(&gen, cfg), RW_OK);
	uint32_t *counts = calloc((size_t)cfg->nodes * cfg->nodes * 8, sizeof(uint32_t));
	int32_t *ids = malloc(sizeof(int32_t) * cfg->gpus_per_node * cfg->tokens_per_rank * cfg->topk);
	assert_non_null(counts);
	assert_non_null(ids);
	assert_int_equal(rw_synth_counts(&gen, &topo, ids, counts), RW_OK);
	memset(egress, 0, sizeof(uint64_t) * 8);
	for (uint32_t d = 1; d < cfg->nodes; d++)
		for (uint32_t r = 0; r < 8; r++)
			egress[r] += counts[d * 8 + r];
	free(ids);
	free(counts);
	rw_synth_free(&gen);
}

static void test_rail_skew_knob(void **state)
{
	(void)state;
	rw_synth_cfg_t cfg = base_cfg();
	uint64_t flat[8], skewed[8];
	node0_egress(&cfg, flat);
	cfg.rail_skew = 0.75;
	node0_egress(&cfg, skewed);
	/* Node 0's hot GPU is GPU 0 (rail 0): its share of remote records rises towards
	 * 1 / (1 + 7 * 0.25) = 0.36 from about 1/8. */
	uint64_t tf = 0, ts = 0;
	for (int r = 0; r < 8; r++) {
		tf += flat[r];
		ts += skewed[r];
	}
	double share_flat = (double)flat[0] / tf, share_skew = (double)skewed[0] / ts;
	assert_true(share_flat < 0.2);
	assert_true(share_skew > 0.3 && share_skew < 0.45);
	for (int r = 1; r < 8; r++)
		assert_true(skewed[r] < flat[r]);
}

static void test_zipf_knob(void **state)
{
	(void)state;
	/* Zipf 0 and no Dirichlet: every expert about equally loaded; Zipf 1.2: a few hot ones. */
	rw_synth_cfg_t cfg = base_cfg();
	cfg.dirichlet = 0.0;
	cfg.tokens_per_rank = 4096;
	uint32_t load[128];
	for (int pass = 0; pass < 2; pass++) {
		cfg.zipf_s = pass ? 1.2 : 0.0;
		int32_t *ids = draw(&cfg, 0, 0, NULL);
		memset(load, 0, sizeof(load));
		for (uint32_t i = 0; i < cfg.tokens_per_rank * cfg.topk; i++)
			load[ids[i]]++;
		uint32_t max = 0;
		for (int e = 0; e < 128; e++)
			max = load[e] > max ? load[e] : max;
		double mean = (double)cfg.tokens_per_rank * cfg.topk / 128;
		if (pass == 0)
			assert_true(max < 1.3 * mean);
		else
			assert_true(max > 3.0 * mean);
		free(ids);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_reproducible),
		cmocka_unit_test(test_ranges_and_groups),
		cmocka_unit_test(test_rail_skew_knob),
		cmocka_unit_test(test_zipf_knob),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
