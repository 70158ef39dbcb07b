/* bf16 <-> fp32 on the host, as the GPU kernels convert (__float2bfloat16_rn): round to nearest
 * even, a NaN stays a quiet NaN. One definition for the daemon's forwarding and combine, the
 * tools' rank rows and the tests' references, so they agree bit for bit. */
#ifndef RW_COMMON_BF16_H
#define RW_COMMON_BF16_H

#include <stdint.h>
#include <string.h>

/* Branch-free so the daemon's row loops vectorize. */
static inline uint16_t rw_bf16_round_bits(uint32_t u)
{
	uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
	uint32_t quiet = (u >> 16) | 0x40u;
	return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline uint16_t rw_bf16_from_f32(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return rw_bf16_round_bits(u);
}

static inline float rw_bf16_to_f32(uint16_t v)
{
	uint32_t u = (uint32_t)v << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

#endif
