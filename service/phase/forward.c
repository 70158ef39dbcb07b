/* Forwarding targets and combine arithmetic (docs/dataflow.md "Receive and forward",
 * "Combine"): which local ranks a record goes to, and fp32 accumulation of fp32/bf16 rows. */
#include <string.h>

#include "common/bf16.h"
#include "service/phase/phase.h"

uint32_t rw_svc_fwd_mask(uint32_t n_experts, uint32_t nodes, uint32_t gpus, uint32_t me,
			 const int32_t *ids, uint32_t topk)
{
	const uint32_t world = nodes * gpus;
	if (world == 0 || n_experts == 0 || n_experts % world != 0)
		return 0;
	const uint32_t per_rank = n_experts / world;
	uint32_t mask = 0;
	for (uint32_t i = 0; i < topk; i++) {
		if (ids[i] == -1)
			continue;
		if (ids[i] < 0)
			return 0; /* only -1 means "no expert" */
		uint32_t e = (uint32_t)ids[i];
		if (e >= n_experts)
			return 0;
		uint32_t rank = e / per_rank;
		if (rank / gpus == me)
			mask |= 1u << (rank % gpus);
	}
	return mask;
}

uint32_t rw_svc_fwd_mask_rec(uint32_t n_experts, uint32_t nodes, uint32_t gpus, uint32_t me,
			     const uint8_t *rec, uint32_t topk)
{
	int32_t ids[RW_MAX_TOPK];
	if (topk > RW_MAX_TOPK)
		return 0;
	for (uint32_t i = 0; i < topk; i++)
		ids[i] = rw_wire_rec_id(rec, i);
	return rw_svc_fwd_mask(n_experts, nodes, gpus, me, ids, topk);
}

/* The row arithmetic is common/rows.c's (shared with the rank path's CPU kernels). */
void rw_svc_row_acc(float *acc, const void *row, uint32_t dtype, uint32_t hidden)
{
	rw_row_acc(acc, row, dtype == RW_WIRE_BF16, hidden);
}

void rw_svc_row_load(float *acc, const void *row, uint32_t dtype, uint32_t hidden)
{
	rw_row_load(acc, row, dtype == RW_WIRE_BF16, hidden);
}

void rw_svc_row_store(void *dst, uint32_t dtype, const float *acc, uint32_t hidden)
{
	rw_row_store(dst, dtype == RW_WIRE_BF16, acc, hidden);
}

void rw_svc_rows_reduce(void *dst, uint32_t dtype, const void *const *rows, uint32_t n,
			uint32_t hidden)
{
	rw_rows_sum(dst, dtype == RW_WIRE_BF16, rows, n, hidden, 1);
}
