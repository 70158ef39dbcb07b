/* Demand counts and records of one node for a phase (docs/algorithms.md §1).
 * A record is one (token, destination node) pair after de-duplicating the token's top-k experts
 * by node. Two passes over the ranks' routing: count, then fill records in CSR order. No
 * allocation: the per-token de-duplication uses a node bitmap on the stack. */
#include <stddef.h>
#include <string.h>

#include "sched/sched.h"

#define NODE_WORDS ((RW_MAX_NODES + 63) / 64)

/* e / per_node without a hardware divide when the reciprocal is exact: with
 * m = floor(2^32 / d) + 1, floor(e * m / 2^32) == floor(e / d) for every e < E as long as
 * E * d <= 2^32 (the error e * (m - 2^32/d) / 2^32 < E / 2^32 <= 1/d never crosses an integer).
 * Otherwise fall back to the divide. */
typedef struct node_div {
	uint64_t mul;
	uint32_t per_node;
	int exact;
} node_div_t;

static void node_div_init(node_div_t *nd, uint32_t n_experts, uint32_t nodes)
{
	nd->per_node = n_experts / nodes;
	nd->mul = (UINT64_C(1) << 32) / nd->per_node + 1;
	nd->exact = (uint64_t)n_experts * nd->per_node <= (UINT64_C(1) << 32);
}

static inline uint32_t node_of(const node_div_t *nd, uint32_t e)
{
	if (nd->exact)
		return (uint32_t)(((uint64_t)e * nd->mul) >> 32);
	return e / nd->per_node;
}

static rw_status_t check_args(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
			      const rw_rank_tokens_t *ranks, uint32_t n_ranks)
{
	if (rw_sched_topo_check(topo) != RW_OK || me >= topo->nodes || (n_ranks && !ranks))
		return RW_ERR_INVAL;
	uint64_t world = (uint64_t)topo->nodes * topo->gpus_per_node;
	if (n_experts == 0 || n_experts % world != 0)
		return RW_ERR_INVAL;
	return RW_OK;
}

static int rank_ok(const rw_topo_t *topo, const rw_rank_tokens_t *rk)
{
	if (rk->local_gpu >= topo->gpus_per_node || rk->topk > RW_MAX_TOPK)
		return 0;
	if (rk->n_tokens > 0 && (rk->topk == 0 || !rk->expert_ids))
		return 0;
	return 1;
}

/* The distinct destination nodes of one token, in the order its experts first name them.
 * Returns their number, or -1 when an expert id is >= n_experts or negative other than -1 (the
 * one "no expert" value). `seen` (one bit per node) is
 * all zero on entry and on return: only the words this token touched are cleared. */
static inline int token_nodes(const int32_t *ids, uint32_t topk, const node_div_t *nd,
			      uint32_t n_experts, uint64_t *seen, uint32_t *uniq)
{
	int n = 0, bad = 0;
	for (uint32_t k = 0; k < topk; k++) {
		int32_t e = ids[k];
		if (e == -1)
			continue; /* dropped slot */
		if (e < 0 || (uint32_t)e >= n_experts) { /* -5, INT_MIN: not an id, not "none" */
			bad = 1;
			break;
		}
		uint32_t d = node_of(nd, (uint32_t)e);
		uint64_t bit = UINT64_C(1) << (d & 63);
		if (seen[d >> 6] & bit)
			continue;
		seen[d >> 6] |= bit;
		uniq[n++] = d;
	}
	for (int u = 0; u < n; u++)
		seen[uniq[u] >> 6] = 0;
	return bad ? -1 : n;
}

/* Count the records of tokens [t0, t1) of one rank into row (stride R, its native rail). */
static rw_status_t count_rank(const rw_rank_tokens_t *rk, uint32_t t0, uint32_t t1,
			      const node_div_t *nd, uint32_t n_experts, uint32_t rails, uint32_t rail,
			      uint32_t *row)
{
	uint64_t seen[NODE_WORDS] = { 0 };
	uint32_t uniq[RW_MAX_TOPK];
	const int32_t *ids = rk->expert_ids + (size_t)t0 * rk->topk;
	for (uint32_t t = t0; t < t1; t++, ids += rk->topk) {
		int n = token_nodes(ids, rk->topk, nd, n_experts, seen, uniq);
		if (n < 0)
			return RW_ERR_INVAL;
		for (int u = 0; u < n; u++)
			row[uniq[u] * rails + rail]++;
	}
	return RW_OK;
}

rw_status_t rw_sched_count_step(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
				const rw_rank_tokens_t *ranks, uint32_t n_ranks, uint32_t *row,
				rw_sched_count_iter_t *it, uint32_t budget, int *done_p,
				uint32_t *bad_rank_p)
{
	rw_status_t st = check_args(topo, n_experts, me, ranks, n_ranks);
	if (st != RW_OK || !row || !it || !done_p || budget == 0)
		return RW_ERR_INVAL;
	const uint32_t rails = topo->rails;
	if (it->rank == 0 && it->token == 0)
		memset(row, 0, (size_t)topo->nodes * rails * sizeof(*row));
	node_div_t nd;
	node_div_init(&nd, n_experts, topo->nodes);
	*done_p = 0;
	for (; it->rank < n_ranks; it->rank++, it->token = 0) {
		const rw_rank_tokens_t *rk = &ranks[it->rank];
		if (!rank_ok(topo, rk)) {
			st = RW_ERR_INVAL;
			break;
		}
		uint32_t t1 = it->token + RW_MIN(budget, rk->n_tokens - it->token);
		st = count_rank(rk, it->token, t1, &nd, n_experts, rails,
				topo->gpu_rail[rk->local_gpu], row);
		if (st != RW_OK)
			break;
		budget -= t1 - it->token;
		it->token = t1;
		if (t1 < rk->n_tokens)
			return RW_OK; /* the budget is spent: resume at (rank, t1) */
	}
	if (st != RW_OK) {
		/* Leave no half-counted row behind: a caller that ignores the status sees no demand
		 * rather than part of it. */
		memset(row, 0, (size_t)topo->nodes * rails * sizeof(*row));
		if (bad_rank_p)
			*bad_rank_p = it->rank;
		return st;
	}
	*done_p = 1;
	return RW_OK;
}

rw_status_t rw_sched_count(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
			   const rw_rank_tokens_t *ranks, uint32_t n_ranks, uint32_t *row,
			   uint32_t *bad_rank_p)
{
	rw_sched_count_iter_t it = { 0 };
	int done;
	return rw_sched_count_step(topo, n_experts, me, ranks, n_ranks, row, &it, UINT32_MAX, &done,
				   bad_rank_p);
}

void rw_sched_prefix(const uint32_t *row, uint32_t n, uint32_t *offset)
{
	uint32_t sum = 0;
	for (uint32_t i = 0; i < n; i++) {
		offset[i] = sum;
		sum += row[i];
	}
	offset[n] = sum;
}

/* Fill the records of one rank whose native rail is `rail`: cursor[d] is the next free index
 * of segment (d, rail); a cursor reaching the segment's end means the offsets do not match the
 * routing (the caller changed it between the passes). */
static rw_status_t fill_rank(const rw_rank_tokens_t *rk, uint32_t rank, uint32_t t0, uint32_t t1,
			     const node_div_t *nd, uint32_t n_experts, const uint32_t *offset,
			     uint32_t rails, uint32_t rail, uint32_t *cursor, rw_record_t *rec)
{
	uint64_t seen[NODE_WORDS] = { 0 };
	uint32_t uniq[RW_MAX_TOPK];
	const int32_t *ids = rk->expert_ids + (size_t)t0 * rk->topk;
	for (uint32_t t = t0; t < t1; t++, ids += rk->topk) {
		int n = token_nodes(ids, rk->topk, nd, n_experts, seen, uniq);
		if (n < 0)
			return RW_ERR_INVAL;
		for (int u = 0; u < n; u++) {
			uint32_t d = uniq[u];
			uint32_t at = cursor[d]++;
			if (at >= offset[d * rails + rail + 1])
				return RW_ERR_INVAL;
			rec[at].rank = rank;
			rec[at].token = t;
		}
	}
	return RW_OK;
}

rw_status_t rw_sched_records_step(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
				  const rw_rank_tokens_t *ranks, uint32_t n_ranks,
				  const uint32_t *offset, rw_record_t *rec, rw_sched_records_iter_t *it,
				  uint32_t budget, int *done_p)
{
	rw_status_t st = check_args(topo, n_experts, me, ranks, n_ranks);
	if (st != RW_OK || !offset || (!rec && offset[topo->nodes * topo->rails] > 0) || !it ||
	    !done_p || budget == 0)
		return RW_ERR_INVAL;
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	node_div_t nd;
	node_div_init(&nd, n_experts, nodes);
	for (uint32_t i = 0; i < n_ranks; i++)
		if (!rank_ok(topo, &ranks[i]))
			return RW_ERR_INVAL;
	*done_p = 0;
	/* Native order inside a (d, r) segment is rank order then token order, and only ranks
	 * of rail r write there: one rail at a time needs N cursors, not N * R. */
	for (; it->rail < rails; it->rail++, it->rank = 0, it->token = 0) {
		if (it->rank == 0 && it->token == 0)
			for (uint32_t d = 0; d < nodes; d++)
				it->cursor[d] = offset[d * rails + it->rail];
		for (; it->rank < n_ranks; it->rank++, it->token = 0) {
			const rw_rank_tokens_t *rk = &ranks[it->rank];
			if (topo->gpu_rail[rk->local_gpu] != it->rail)
				continue;
			uint32_t t1 = it->token + RW_MIN(budget, rk->n_tokens - it->token);
			st = fill_rank(rk, it->rank, it->token, t1, &nd, n_experts, offset, rails,
				       it->rail, it->cursor, rec);
			if (st != RW_OK)
				return st;
			budget -= t1 - it->token;
			it->token = t1;
			if (t1 < rk->n_tokens)
				return RW_OK; /* resume at (rail, rank, t1) */
		}
	}
	*done_p = 1;
	return RW_OK;
}

rw_status_t rw_sched_records(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
			     const rw_rank_tokens_t *ranks, uint32_t n_ranks,
			     const uint32_t *offset, rw_record_t *rec)
{
	rw_sched_records_iter_t it; /* the cursors are set per rail as the pass reaches it */
	memset(&it, 0, offsetof(rw_sched_records_iter_t, cursor));
	int done;
	return rw_sched_records_step(topo, n_experts, me, ranks, n_ranks, offset, rec, &it,
				     UINT32_MAX, &done);
}
