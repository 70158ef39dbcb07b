/* The dispatch/combine data-path math of docs/dataflow.md, end to end without I/O: N simulated
 * nodes compute their count rows, every node derives the same receive layout from the full matrix,
 * senders place every record at (egress rail, slot) with rw_sched_map_rail, receivers forward by
 * expert ownership, combine returns each row along the same (rail, slot) and the owner recovers
 * (rank, token) with rw_sched_unmap and sums in fp32. Checked against an independent reference,
 * for all four paths and both dtypes over many random, skewed workloads. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "service/phase/phase.h"

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static uint32_t rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (uint32_t)(rng_state >> 11);
}

enum { HIDDEN = 6 };

typedef struct sim_rank {
	uint32_t n_tokens;
	int32_t *ids;    /* n_tokens * topk */
	float *w;        /* n_tokens * topk */
	float *x;        /* n_tokens * HIDDEN, small integers */
	float *out;      /* combine result at the owner, fp32 accumulators */
} sim_rank_t;

typedef struct sim_node {
	sim_rank_t *rank;               /* [G] */
	rw_rank_tokens_t *rt;           /* [G] */
	uint32_t *row;                  /* [N*R] */
	uint32_t *offset;               /* [N*R+1] */
	rw_record_t *rec;
	rw_svc_layout_t layout;
	/* receive area per rail: record refs (src node, rank, token) or src = UINT32_MAX (empty) */
	uint32_t *area[RW_MAX_RAILS];   /* 3 entries per slot */
	float *area_out[RW_MAX_RAILS];  /* HIDDEN floats per slot: the reduced row sent back */
} sim_node_t;

/* What expert e does to a row: multiply by (e % 3 + 1). */
static float expert_factor(int32_t e) { return (float)(e % 3 + 1); }

static void run_case(uint32_t N, uint32_t G, uint32_t R, uint32_t topk, uint32_t E, rw_path_t path,
		     uint32_t dtype, uint32_t max_tokens)
{
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, N, G, R), RW_OK);
	const uint32_t W = N * G, per_rank = E / W;
	sim_node_t *node = calloc(N, sizeof(*node));
	uint32_t *counts = calloc((size_t)N * N * R, sizeof(uint32_t));
	assert_non_null(node);
	assert_non_null(counts);

	/* Workload: skewed experts (a hot third) and skewed sources (GPU 0 owns more tokens). */
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &node[n];
		sn->rank = calloc(G, sizeof(sim_rank_t));
		sn->rt = calloc(G, sizeof(rw_rank_tokens_t));
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &sn->rank[g];
			rk->n_tokens = rnd() % (max_tokens + 1);
			if (g == 0)
				rk->n_tokens += max_tokens;
			rk->ids = calloc((size_t)rk->n_tokens * topk + 1, sizeof(int32_t));
			rk->w = calloc((size_t)rk->n_tokens * topk + 1, sizeof(float));
			rk->x = calloc((size_t)rk->n_tokens * HIDDEN + 1, sizeof(float));
			rk->out = calloc((size_t)rk->n_tokens * HIDDEN + 1, sizeof(float));
			for (uint32_t t = 0; t < rk->n_tokens; t++) {
				for (uint32_t k = 0; k < topk; k++) {
					int32_t e;
					do {
						e = (rnd() % 4 == 0) ? -1 :
						    (rnd() % 2 ? (int32_t)(rnd() % (E / 3 + 1)) : (int32_t)(rnd() % E));
						for (uint32_t j = 0; j < k && e >= 0; j++)
							if (rk->ids[t * topk + j] == e)
								e = -2;
					} while (e == -2);
					rk->ids[t * topk + k] = e;
					rk->w[t * topk + k] = (rnd() % 2) ? 0.5f : 1.0f;
				}
				for (uint32_t h = 0; h < HIDDEN; h++)
					rk->x[t * HIDDEN + h] = (float)((int)(rnd() % 9) - 4);
			}
			sn->rt[g] = (rw_rank_tokens_t){ .local_gpu = g, .n_tokens = rk->n_tokens,
							.topk = topk, .expert_ids = rk->ids };
		}
		sn->row = calloc((size_t)N * R, sizeof(uint32_t));
		sn->offset = calloc((size_t)N * R + 1, sizeof(uint32_t));
		assert_int_equal(rw_sched_count(&topo, E, n, sn->rt, G, sn->row, NULL), RW_OK);
		rw_sched_prefix(sn->row, N * R, sn->offset);
		sn->rec = calloc((size_t)sn->offset[N * R] + 1, sizeof(rw_record_t));
		assert_int_equal(rw_sched_records(&topo, E, n, sn->rt, G, sn->offset, sn->rec), RW_OK);
		memcpy(counts + (size_t)n * N * R, sn->row, (size_t)N * R * sizeof(uint32_t));
	}

	/* Every node derives its layout; sender and receiver agree on every quota. */
	for (uint32_t n = 0; n < N; n++) {
		assert_int_equal(rw_svc_layout_alloc(&node[n].layout, N, R), RW_OK);
		assert_int_equal(rw_svc_layout_build(&node[n].layout, &topo, path, n, counts), RW_OK);
	}
	uint64_t max_in = 0, max_out = 0, seen_in = 0, seen_out = 0;
	rw_svc_layout_max(&topo, path, counts, &max_in, &max_out);
	for (uint32_t s = 0; s < N; s++)
		for (uint32_t d = 0; d < N; d++)
			for (uint32_t r = 0; r < R; r++) {
				uint32_t q_in = node[d].layout.in_quota[s * R + r];
				uint32_t q_out = s == d ? 0 : node[s].layout.out_pairs[d].quota[r];
				assert_int_equal(q_in, q_out);
				if (s != d) { /* each side knows where it writes in the other's memory */
					assert_int_equal(node[s].layout.peer_in_first[d * R + r],
							 node[d].layout.in_first[s * R + r]);
					assert_int_equal(node[d].layout.peer_ret_first[s * R + r],
							 node[s].layout.out_first[d * R + r]);
				}
				if (s != d && !rw_path_balanced(path))
					assert_int_equal(q_in, counts[((size_t)s * N + d) * R + r]);
			}
	for (uint32_t n = 0; n < N; n++)
		for (uint32_t r = 0; r < R; r++) {
			seen_in = RW_MAX(seen_in, node[n].layout.in_total[r]);
			seen_out = RW_MAX(seen_out, node[n].layout.out_total[r]);
			node[n].area[r] = malloc(((size_t)node[n].layout.in_total[r] * 3 + 1) * sizeof(uint32_t));
			memset(node[n].area[r], 0xff, ((size_t)node[n].layout.in_total[r] * 3 + 1) * sizeof(uint32_t));
			node[n].area_out[r] = calloc((size_t)node[n].layout.in_total[r] * HIDDEN + 1, sizeof(float));
		}
	assert_true(seen_in == max_in);
	assert_true(seen_out == max_out);

	/* Send: every record of (d, owner rail) goes to (egress, slot) inside d's range for me. */
	uint8_t egress[4096];
	uint32_t slot[4096];
	for (uint32_t s = 0; s < N; s++) {
		sim_node_t *sn = &node[s];
		for (uint32_t d = 0; d < N; d++) {
			if (d == s)
				continue;
			const rw_pair_plan_t *pp = &sn->layout.out_pairs[d];
			for (uint32_t r = 0; r < R; r++) {
				uint32_t cnt = sn->row[d * R + r];
				assert_true(cnt <= 4096);
				rw_sched_map_rail(pp, r, egress, slot);
				for (uint32_t i = 0; i < cnt; i++) {
					uint32_t e = egress[i];
					assert_true(e < R);
					assert_true(slot[i] < pp->quota[e]);
					uint32_t pos = node[d].layout.in_first[s * R + e] + slot[i];
					assert_true(pos < node[d].layout.in_total[e]);
					uint32_t *ref = &node[d].area[e][3 * (size_t)pos];
					assert_int_equal(ref[0], UINT32_MAX); /* no two records share a slot */
					const rw_record_t *rec = &sn->rec[sn->offset[d * R + r] + i];
					ref[0] = s;
					ref[1] = rec->rank;
					ref[2] = rec->token;
					/* The unmap of (egress, slot) is this record. */
					uint32_t or, ord;
					rw_sched_unmap(pp, e, slot[i], &or, &ord);
					assert_int_equal(or, r);
					assert_int_equal(ord, i);
				}
			}
		}
	}

	/* Receive + forward + expert compute + per-record reduction (the daemon's sum of copies). */
	float acc[HIDDEN], row32[HIDDEN];
	uint16_t row16[HIDDEN];
	for (uint32_t d = 0; d < N; d++)
		for (uint32_t r = 0; r < R; r++)
			for (uint32_t pos = 0; pos < node[d].layout.in_total[r]; pos++) {
				uint32_t *ref = &node[d].area[r][3 * (size_t)pos];
				assert_int_not_equal(ref[0], UINT32_MAX); /* every slot filled */
				const sim_rank_t *rk = &node[ref[0]].rank[ref[1]];
				const int32_t *ids = rk->ids + (size_t)ref[2] * topk;
				uint32_t mask = rw_svc_fwd_mask(E, N, G, d, ids, topk), expect = 0;
				for (uint32_t k = 0; k < topk; k++)
					if (ids[k] >= 0 && (uint32_t)ids[k] / per_rank / G == d)
						expect |= 1u << ((uint32_t)ids[k] / per_rank % G);
				assert_int_equal(mask, expect);
				assert_int_not_equal(mask, 0);
				memset(acc, 0, sizeof(acc));
				for (uint32_t g = 0; g < G; g++) {
					if (!(mask & (1u << g)))
						continue;
					/* Rank (d, g) reduces over its own experts, in the phase dtype. */
					float part[HIDDEN] = { 0 };
					for (uint32_t k = 0; k < topk; k++)
						if (ids[k] >= 0 && (uint32_t)ids[k] / per_rank == d * G + g)
							for (uint32_t h = 0; h < HIDDEN; h++)
								part[h] += rk->w[(size_t)ref[2] * topk + k] *
									   expert_factor(ids[k]) * rk->x[(size_t)ref[2] * HIDDEN + h];
					if (dtype == RW_WIRE_BF16) {
						rw_svc_row_store(row16, dtype, part, HIDDEN);
						rw_svc_row_acc(acc, row16, dtype, HIDDEN);
					} else {
						rw_svc_row_acc(acc, part, dtype, HIDDEN);
					}
				}
				memcpy(node[d].area_out[r] + (size_t)pos * HIDDEN, acc, sizeof(acc));
			}

	/* Combine: d returns each reduced row at the same (rail, slot); the owner unmaps and sums. */
	for (uint32_t s = 0; s < N; s++) {
		sim_node_t *sn = &node[s];
		for (uint32_t d = 0; d < N; d++) {
			if (d == s)
				continue;
			const rw_pair_plan_t *pp = &sn->layout.out_pairs[d];
			for (uint32_t e = 0; e < R; e++)
				for (uint32_t k = 0; k < pp->quota[e]; k++) {
					uint32_t pos = node[d].layout.in_first[s * R + e] + k;
					rw_svc_row_store(dtype == RW_WIRE_BF16 ? (void *)row16 : (void *)row32,
							 dtype, node[d].area_out[e] + (size_t)pos * HIDDEN, HIDDEN);
					uint32_t or, ord;
					rw_sched_unmap(pp, e, k, &or, &ord);
					assert_true(or < R && ord < sn->row[d * R + or]);
					const rw_record_t *rec = &sn->rec[sn->offset[d * R + or] + ord];
					rw_svc_row_acc(sn->rank[rec->rank].out + (size_t)rec->token * HIDDEN,
						       dtype == RW_WIRE_BF16 ? (void *)row16 : (void *)row32,
						       dtype, HIDDEN);
				}
		}
		/* Local-node experts: added by the owner's daemon directly. */
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &sn->rank[g];
			for (uint32_t t = 0; t < rk->n_tokens; t++)
				for (uint32_t k = 0; k < topk; k++) {
					int32_t id = rk->ids[t * topk + k];
					if (id >= 0 && (uint32_t)id / per_rank / G == s)
						for (uint32_t h = 0; h < HIDDEN; h++)
							rk->out[t * HIDDEN + h] += rk->w[t * topk + k] *
								expert_factor(id) * rk->x[t * HIDDEN + h];
				}
		}
	}

	/* Reference: sum over all top-k experts, computed directly. Exact (small dyadic values). */
	for (uint32_t s = 0; s < N; s++)
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &node[s].rank[g];
			for (uint32_t t = 0; t < rk->n_tokens; t++)
				for (uint32_t h = 0; h < HIDDEN; h++) {
					float ref = 0;
					for (uint32_t k = 0; k < topk; k++) {
						int32_t id = rk->ids[t * topk + k];
						if (id >= 0)
							ref += rk->w[t * topk + k] * expert_factor(id) *
							       rk->x[t * HIDDEN + h];
					}
					assert_true(rk->out[t * HIDDEN + h] == ref);
				}
		}

	for (uint32_t n = 0; n < N; n++) {
		for (uint32_t g = 0; g < G; g++) {
			free(node[n].rank[g].ids);
			free(node[n].rank[g].w);
			free(node[n].rank[g].x);
			free(node[n].rank[g].out);
		}
		for (uint32_t r = 0; r < R; r++) {
			free(node[n].area[r]);
			free(node[n].area_out[r]);
		}
		free(node[n].rank);
		free(node[n].rt);
		free(node[n].row);
		free(node[n].offset);
		free(node[n].rec);
		rw_svc_layout_free(&node[n].layout);
	}
	free(node);
	free(counts);
}

static void test_random_all_paths(void **state)
{
	(void)state;
	for (int it = 0; it < 300; it++) {
		uint32_t N = 2 + rnd() % 4, G = 1 + rnd() % 3, R = 1 + rnd() % 4;
		uint32_t topk = 1 + rnd() % 4, E = N * G * (1 + rnd() % 3);
		rw_path_t path = (rw_path_t)(it % RW_PATH_COUNT);
		uint32_t dtype = (it / RW_PATH_COUNT) % 2 ? RW_WIRE_BF16 : RW_WIRE_F32;
		run_case(N, G, R, topk, E, path, dtype, 1 + rnd() % 40);
	}
}

static void test_fwd_mask_rejects(void **state)
{
	(void)state;
	int32_t ids[3] = { 5, -1, 16 };
	/* E = 16, N = 2, G = 2: expert 16 is out of range -> 0 (the caller fails the phase). */
	assert_int_equal(rw_svc_fwd_mask(16, 2, 2, 1, ids, 3), 0);
	ids[2] = 15; /* rank 3 = node 1 gpu 1; expert 5 -> rank 1 = node 0 gpu 1 */
	assert_int_equal(rw_svc_fwd_mask(16, 2, 2, 1, ids, 3), 2);
	assert_int_equal(rw_svc_fwd_mask(16, 2, 2, 0, ids, 3), 2);
	ids[2] = 12; /* rank 3 -> node 1 gpu 1 */
	assert_int_equal(rw_svc_fwd_mask(16, 2, 2, 1, ids, 3), 2);
	ids[0] = 8;  /* rank 2 -> node 1 gpu 0 */
	assert_int_equal(rw_svc_fwd_mask(16, 2, 2, 1, ids, 3), 3);
	/* E not a multiple of W. */
	assert_int_equal(rw_svc_fwd_mask(15, 2, 2, 1, ids, 3), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_random_all_paths),
		cmocka_unit_test(test_fwd_mask_rejects),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
