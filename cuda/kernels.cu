// cuda/kernels.cu: the data-path kernels the daemon launches through the driver API
// (cuModuleLoadData on the fatbin embedded by the bin2c rule; entry points are extern "C").
// pack = gather rows into a slab, unpack = scatter slab rows, combine = weighted CSR reduce in fp32.
// Contracts: cuda/rw_cuda.h. Built with the nvcc_fatbin rule: sm_90 code + compute_90 PTX.
#include <cuda_bf16.h>
#include <stdint.h>

// ---- pack / unpack -------------------------------------------------------------------------
// One block per row in a grid-stride loop; each thread moves up to UNROLL 16-byte vectors with
// all loads issued before the stores, so several loads are in flight per thread.

#define RW_UNROLL 4

template <bool GATHER>
__device__ __forceinline__ void move_rows16(uint4 *__restrict__ dst, const uint4 *__restrict__ src,
					    const uint32_t *__restrict__ idx, uint32_t nrows, uint32_t nvec)
{
	for (uint32_t r = blockIdx.x; r < nrows; r += gridDim.x) {
		const uint64_t row = idx[r];
		const uint4 *s = GATHER ? src + row * nvec : src + (uint64_t)r * nvec;
		uint4 *d = GATHER ? dst + (uint64_t)r * nvec : dst + row * nvec;
		for (uint32_t base = threadIdx.x; base < nvec; base += RW_UNROLL * blockDim.x) {
			uint4 v[RW_UNROLL];
#pragma unroll
			for (int k = 0; k < RW_UNROLL; k++) {
				uint32_t i = base + k * blockDim.x;
				if (i < nvec)
					v[k] = __ldg(s + i);
			}
#pragma unroll
			for (int k = 0; k < RW_UNROLL; k++) {
				uint32_t i = base + k * blockDim.x;
				if (i < nvec)
					d[i] = v[k];
			}
		}
	}
}

template <bool GATHER>
__device__ __forceinline__ void move_rows1(uint8_t *__restrict__ dst, const uint8_t *__restrict__ src,
					   const uint32_t *__restrict__ idx, uint32_t nrows, uint32_t row_bytes)
{
	for (uint32_t r = blockIdx.x; r < nrows; r += gridDim.x) {
		const uint64_t row = idx[r];
		const uint8_t *s = GATHER ? src + row * row_bytes : src + (uint64_t)r * row_bytes;
		uint8_t *d = GATHER ? dst + (uint64_t)r * row_bytes : dst + row * row_bytes;
		for (uint32_t i = threadIdx.x; i < row_bytes; i += blockDim.x)
			d[i] = s[i];
	}
}

extern "C" __global__ void rw_pack16(uint4 *dst, const uint4 *src, const uint32_t *idx, uint32_t nrows,
				     uint32_t nvec)
{
	move_rows16<true>(dst, src, idx, nrows, nvec);
}

extern "C" __global__ void rw_unpack16(uint4 *dst, const uint4 *src, const uint32_t *idx, uint32_t nrows,
				       uint32_t nvec)
{
	move_rows16<false>(dst, src, idx, nrows, nvec);
}

extern "C" __global__ void rw_pack1(uint8_t *dst, const uint8_t *src, const uint32_t *idx, uint32_t nrows,
				    uint32_t row_bytes)
{
	move_rows1<true>(dst, src, idx, nrows, row_bytes);
}

extern "C" __global__ void rw_unpack1(uint8_t *dst, const uint8_t *src, const uint32_t *idx,
				      uint32_t nrows, uint32_t row_bytes)
{
	move_rows1<false>(dst, src, idx, nrows, row_bytes);
}

// ---- combine -------------------------------------------------------------------------------
// out[t] += sum_j w[j] * rows[row_idx[j]], j over the token's CSR range, in a fixed order, fp32
// accumulation. One block per token (grid-stride); VEC consecutive elements per thread step,
// loaded as one 16-byte vector when VEC > 1.

__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }

template <typename T, int N>
__device__ __forceinline__ void load_n(float (&acc)[N], const T *p)
{
	if (N * sizeof(T) == 16) {
		uint4 raw = __ldg(reinterpret_cast<const uint4 *>(p));
		const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
		for (int k = 0; k < N; k++)
			acc[k] = to_f32(e[k]);
	} else {
#pragma unroll
		for (int k = 0; k < N; k++)
			acc[k] = to_f32(p[k]);
	}
}

template <typename T, int N>
__device__ __forceinline__ void store_n(T *p, const float (&v)[N])
{
	if (N * sizeof(T) == 16) {
		uint4 raw;
		T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
		for (int k = 0; k < N; k++)
			e[k] = from_f32<T>(v[k]);
		*reinterpret_cast<uint4 *>(p) = raw;
	} else {
#pragma unroll
		for (int k = 0; k < N; k++)
			p[k] = from_f32<T>(v[k]);
	}
}

template <typename OUT, typename ROW, int VEC>
__device__ __forceinline__ void combine_impl(OUT *__restrict__ out, const ROW *__restrict__ rows,
					     uint32_t hidden, uint32_t ntokens,
					     const uint32_t *__restrict__ offsets,
					     const uint32_t *__restrict__ row_idx,
					     const float *__restrict__ weights)
{
	for (uint32_t t = blockIdx.x; t < ntokens; t += gridDim.x) {
		const uint32_t j0 = offsets[t], j1 = offsets[t + 1];
		for (uint32_t h = threadIdx.x * VEC; h < hidden; h += blockDim.x * VEC) {
			float acc[VEC], x[VEC];
#pragma unroll
			for (int k = 0; k < VEC; k++)
				acc[k] = 0.0f;
			for (uint32_t j = j0; j < j1; j++) {
				const float w = weights[j];
				load_n<ROW, VEC>(x, rows + (uint64_t)row_idx[j] * hidden + h);
#pragma unroll
				for (int k = 0; k < VEC; k++)
					acc[k] = fmaf(w, x[k], acc[k]);
			}
			OUT *o = out + (uint64_t)t * hidden + h;
			load_n<OUT, VEC>(x, o);
#pragma unroll
			for (int k = 0; k < VEC; k++)
				x[k] += acc[k];
			store_n<OUT, VEC>(o, x);
		}
	}
}

#define RW_COMBINE(name, OUT, ROW, VEC) \
	extern "C" __global__ void name(OUT *out, const ROW *rows, uint32_t hidden, uint32_t ntokens, \
					const uint32_t *offsets, const uint32_t *row_idx, \
					const float *weights) \
	{ \
		combine_impl<OUT, ROW, VEC>(out, rows, hidden, ntokens, offsets, row_idx, weights); \
	}

// Vector forms: VEC = 16 bytes of the narrower type (8 for bf16) only when both sides allow a
// 16-byte access: bf16 out/rows use 8, fp32 both use 4; mixed pairs use 4 (fp32 side 16 bytes,
// bf16 side 8 bytes, loaded element-wise).
RW_COMBINE(rw_combine_bb_v, __nv_bfloat16, __nv_bfloat16, 8)
RW_COMBINE(rw_combine_bf_v, __nv_bfloat16, float, 4)
RW_COMBINE(rw_combine_fb_v, float, __nv_bfloat16, 4)
RW_COMBINE(rw_combine_ff_v, float, float, 4)
RW_COMBINE(rw_combine_bb_s, __nv_bfloat16, __nv_bfloat16, 1)
RW_COMBINE(rw_combine_bf_s, __nv_bfloat16, float, 1)
RW_COMBINE(rw_combine_fb_s, float, __nv_bfloat16, 1)
RW_COMBINE(rw_combine_ff_s, float, float, 1)
