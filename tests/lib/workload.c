/* tests/lib/workload.c: the seeded MoE workload of the executor and integration tests
 * (workload.h). Any change here changes what every one of those tests sends and checks. */
#include "tests/lib/workload.h"

#include <string.h>

#include "common/bf16.h"

uint64_t rw_wl_mix(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint32_t next(uint64_t *s)
{
	*s = rw_wl_mix(*s);
	return (uint32_t)(*s >> 32);
}

void rw_wl_gen(const rw_wl_shape_t *sh, uint32_t step, uint32_t layer, uint32_t rank,
	       rw_wl_work_t *wk)
{
	uint64_t r = rw_wl_mix(sh->seed ^ ((uint64_t)step << 40) ^ ((uint64_t)layer << 20) ^ rank);
	uint32_t base = 1 + next(&r) % RW_WL_MAX_TOKENS;
	wk->n = rank % sh->gpus == 0 ? base * 3 : base;
	if (sh->tokens)
		wk->n = sh->tokens;
	if (sh->empty) {
		uint64_t ph = rw_wl_mix(sh->seed ^ 0x5eedull ^ ((uint64_t)step << 40) ^
					((uint64_t)layer << 20));
		if (ph % 5 == 1 || (step == 0 && layer == 1) || next(&r) % 4 == 0)
			wk->n = 0;
	}
	uint32_t experts = sh->experts;
	uint32_t hot = experts / 4 ? experts / 4 : 1, shift = (rank * 7 + layer) % experts;
	uint32_t node = rank / sh->gpus, per_node = sh->gpus * sh->per_rank;
	for (uint32_t t = 0; t < wk->n; t++) {
		for (uint32_t k = 0; k < RW_WL_TOPK; k++) {
			int32_t e;
			for (;;) {
				uint32_t u = next(&r);
				if (u % 8 == 0) {
					e = -1;
					break;
				}
				e = (int32_t)(u % 2 ? (shift + next(&r) % hot) % experts : next(&r) % experts);
				if (sh->stay_home >> node & 1)
					e = (int32_t)(node * per_node + (uint32_t)e % per_node);
				int dup = 0;
				for (uint32_t j = 0; j < k; j++)
					dup |= wk->ids[t][j] == e;
				if (!dup)
					break;
			}
			wk->ids[t][k] = e;
			wk->w[t][k] = next(&r) % 2 ? 0.5f : 1.0f;
		}
		for (uint32_t h = 0; h < sh->hidden; h++)
			wk->x[(size_t)t * sh->hidden + h] = (float)((int)(next(&r) % 9) - 4);
	}
}

static float factor(int32_t e) { return (float)(e % 3 + 1); }

void rw_wl_put_row(uint8_t *dst, int bf16, const float *v, uint32_t hidden)
{
	for (uint32_t h = 0; h < hidden; h++) {
		if (bf16) {
			uint16_t b = rw_bf16_from_f32(v[h]);
			memcpy(dst + 2 * h, &b, 2);
		} else {
			memcpy(dst + 4 * h, &v[h], 4);
		}
	}
}

float rw_wl_get_elem(const uint8_t *src, int bf16, uint32_t h)
{
	if (bf16) {
		uint16_t b;
		memcpy(&b, src + 2 * h, 2);
		return rw_bf16_to_f32(b);
	}
	float f;
	memcpy(&f, src + 4 * h, 4);
	return f;
}

uint32_t rw_wl_hits(const rw_wl_work_t *wk, uint32_t me, uint32_t per_rank, uint32_t *ecount)
{
	uint32_t hits = 0;
	for (uint32_t t = 0; t < wk->n; t++) {
		int hit = 0;
		for (uint32_t k = 0; k < RW_WL_TOPK; k++)
			if (wk->ids[t][k] >= 0 && (uint32_t)wk->ids[t][k] / per_rank == me) {
				hit = 1;
				ecount[wk->ids[t][k]]++;
			}
		hits += hit;
	}
	return hits;
}

int rw_wl_expert_row(const rw_wl_work_t *wk, uint32_t token, uint32_t me, uint32_t per_rank,
		     uint32_t hidden, float *out)
{
	const float *xt = wk->x + (size_t)token * hidden;
	int mine = 0;
	for (uint32_t h = 0; h < hidden; h++)
		out[h] = 0;
	for (uint32_t k = 0; k < RW_WL_TOPK; k++) {
		int32_t e = wk->ids[token][k];
		if (e >= 0 && (uint32_t)e / per_rank == me) {
			mine = 1;
			for (uint32_t h = 0; h < hidden; h++)
				out[h] += wk->w[token][k] * factor(e) * xt[h];
		}
	}
	return mine;
}

float rw_wl_combined(const rw_wl_work_t *wk, uint32_t t, uint32_t h, uint32_t hidden)
{
	float ref = 0;
	for (uint32_t k = 0; k < RW_WL_TOPK; k++)
		if (wk->ids[t][k] >= 0)
			ref += wk->w[t][k] * factor(wk->ids[t][k]) * wk->x[(size_t)t * hidden + h];
	return ref;
}
