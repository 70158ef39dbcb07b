/* Forwarding targets and combine arithmetic (docs/dataflow.md "Receive and forward",
 * "Combine"): which local ranks a record goes to, and fp32 accumulation of fp32/bf16 rows. */
#include <string.h>

#include "service/phase.h"

uint32_t rw_svc_fwd_mask(uint32_t n_experts, uint32_t nodes, uint32_t gpus, uint32_t me,
			 const int32_t *ids, uint32_t topk)
{
	const uint32_t world = nodes * gpus;
	if (world == 0 || n_experts == 0 || n_experts % world != 0)
		return 0;
	const uint32_t per_rank = n_experts / world;
	uint32_t mask = 0;
	for (uint32_t i = 0; i < topk; i++) {
		if (ids[i] < 0)
			continue;
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

uint16_t rw_svc_f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a (quiet) NaN */
		return (uint16_t)((u >> 16) | 0x40u);
	u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
	return (uint16_t)(u >> 16);
}

void rw_svc_row_acc(float *acc, const void *row, uint32_t dtype, uint32_t hidden)
{
	if (dtype == RW_WIRE_BF16) {
		const uint8_t *p = row;
		for (uint32_t i = 0; i < hidden; i++) {
			uint16_t v;
			memcpy(&v, p + 2 * (size_t)i, 2);
			acc[i] += rw_svc_bf16_to_f32(v);
		}
	} else {
		const uint8_t *p = row;
		for (uint32_t i = 0; i < hidden; i++) {
			float v;
			memcpy(&v, p + 4 * (size_t)i, 4);
			acc[i] += v;
		}
	}
}

void rw_svc_row_store(void *dst, uint32_t dtype, const float *acc, uint32_t hidden)
{
	uint8_t *p = dst;
	if (dtype == RW_WIRE_BF16) {
		for (uint32_t i = 0; i < hidden; i++) {
			uint16_t v = rw_svc_f32_to_bf16(acc[i]);
			memcpy(p + 2 * (size_t)i, &v, 2);
		}
	} else {
		memcpy(p, acc, (size_t)hidden * 4);
	}
}
