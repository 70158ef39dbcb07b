/* sched/ internals shared between its files (not part of the public face, sched/sched.h):
 * the eligible rail set of a topology, computed once per plan instead of once per pair. */
#ifndef RW_SCHED_PRIV_H
#define RW_SCHED_PRIV_H

#include "sched/sched.h"

typedef struct rw_rail_set {
	uint32_t rails;
	uint32_t m;                      /* |S|: rails with weight > 0 */
	int equal;                       /* every eligible weight the same */
	int plain;                       /* equal and m == rails: the common case */
	uint64_t weight_sum;
	const uint32_t *rail_weight;     /* the topology's rail_weight[] */
	uint8_t eligible[RW_MAX_RAILS];  /* S[0] < S[1] < ... < S[m-1] */
} rw_rail_set_t;

/* The rail set of a topology that passed rw_sched_topo_check (it points into the topology). */
void rw_sched_rail_set(const rw_topo_t *topo, rw_rail_set_t *set);
/* The rail set of `rails` weights (weight[r] <= RW_MAX_RAIL_WEIGHT; 0 = not eligible). */
void rw_sched_rail_set_w(uint32_t rails, const uint32_t *weight, rw_rail_set_t *set);
/* The set pair (s, d) plans with: `base` (the topology's), or the pair's own weights when the
 * topology has per-pair weights (filled into *tmp). */
const rw_rail_set_t *rw_sched_pair_set(const rw_topo_t *topo, const rw_rail_set_t *base, uint32_t s,
				       uint32_t d, rw_rail_set_t *tmp);
/* rw_sched_balance with the rail set already computed (identical results). */
void rw_sched_balance_set(const rw_rail_set_t *set, const uint32_t *count, uint32_t rotation,
			  rw_pair_plan_t *plan);
/* Native plan; records of rails outside the set are spread over the set by the weighted rule
 * with `rotation` (docs/algorithms.md §2.5). */
void rw_sched_balance_native_set(const rw_rail_set_t *set, const uint32_t *count,
				 uint32_t rotation, rw_pair_plan_t *plan);

#endif /* RW_SCHED_PRIV_H */
