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

// ---- the daemon's CUDA data mover (service/mover/mover_cuda.c) ----------------------------------
// Row lists instead of index arrays: every entry names its own source and destination address,
// which may be device memory, a peer device's memory or pinned host memory mapped into the GPU
// (the mesh's slabs). Lists themselves sit in mapped pinned host memory. Arithmetic matches the
// host mover bit for bit (service/phase/forward.c): fp32 adds in the listed order (__fadd_rn: never
// contracted), bf16 rounded to nearest even with NaN kept quiet by the same bit formula.

struct rw_row_copy { uint64_t src, dst; };
struct rw_row_sum { uint64_t dst; uint32_t first, count; };

// One block per entry (grid-stride); 16-byte vectors when every address and the row length
// allow it (the host checks), bytes otherwise.
template <typename V>
__device__ __forceinline__ void copy_rows(const rw_row_copy *__restrict__ list, uint32_t n, uint32_t nvec)
{
	for (uint32_t e = blockIdx.x; e < n; e += gridDim.x) {
		const V *s = reinterpret_cast<const V *>(list[e].src);
		V *d = reinterpret_cast<V *>(list[e].dst);
		for (uint32_t base = threadIdx.x; base < nvec; base += RW_UNROLL * blockDim.x) {
			V v[RW_UNROLL];
#pragma unroll
			for (int k = 0; k < RW_UNROLL; k++) {
				uint32_t i = base + k * blockDim.x;
				if (i < nvec)
					v[k] = s[i];
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

extern "C" __global__ void rw_copy_rows16(const rw_row_copy *list, uint32_t n, uint32_t nvec)
{
	copy_rows<uint4>(list, n, nvec);
}

extern "C" __global__ void rw_copy_rows1(const rw_row_copy *list, uint32_t n, uint32_t nbytes)
{
	copy_rows<uint8_t>(list, n, nbytes);
}

__device__ __forceinline__ float elem_f32(const uint8_t *p, uint64_t i, bool bf16)
{
	if (bf16)
		return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(p)[i] << 16);
	return reinterpret_cast<const float *>(p)[i];
}

__device__ __forceinline__ uint16_t f32_bf16_host(float f) // = service/phase/forward.c bf16_round
{
	uint32_t u = __float_as_uint(f);
	uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
	uint32_t quiet = (u >> 16) | 0x40u;
	return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

// ACC: dst is an fp32 row and every listed row is added into it, in order (owner sums).
// !ACC: dst is a row of the phase dtype: one listed row is copied as it is, several are summed
// in fp32 in order (the first loaded, the others added) and rounded once (combine slabs).
template <bool ACC>
__device__ __forceinline__ void sum_rows(const rw_row_sum *__restrict__ list, const uint64_t *__restrict__ srcs,
					 uint32_t n, uint32_t hidden, bool bf16, bool vec16)
{
	const uint32_t esz = bf16 ? 2 : 4;
	for (uint32_t e = blockIdx.x; e < n; e += gridDim.x) {
		const rw_row_sum s = list[e];
		uint8_t *dst = reinterpret_cast<uint8_t *>(s.dst);
		if (!ACC && s.count == 1) {
			const uint8_t *src = reinterpret_cast<const uint8_t *>(srcs[s.first]);
			if (vec16) {
				for (uint32_t i = threadIdx.x; i < hidden * esz / 16; i += blockDim.x)
					reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
			} else {
				for (uint32_t i = threadIdx.x; i < hidden * esz; i += blockDim.x)
					dst[i] = src[i];
			}
			continue;
		}
		for (uint32_t h = threadIdx.x; h < hidden; h += blockDim.x) {
			float acc;
			uint32_t k = 0;
			if (ACC) {
				acc = reinterpret_cast<float *>(dst)[h];
			} else {
				acc = elem_f32(reinterpret_cast<const uint8_t *>(srcs[s.first]), h, bf16);
				k = 1;
			}
			for (; k < s.count; k++)
				acc = __fadd_rn(acc, elem_f32(reinterpret_cast<const uint8_t *>(srcs[s.first + k]), h, bf16));
			if (ACC || !bf16)
				reinterpret_cast<float *>(dst)[h] = acc;
			else
				reinterpret_cast<uint16_t *>(dst)[h] = f32_bf16_host(acc);
		}
	}
}

extern "C" __global__ void rw_rows_acc(const rw_row_sum *list, const uint64_t *srcs, uint32_t n,
				       uint32_t hidden, uint32_t bf16, uint32_t vec16)
{
	sum_rows<true>(list, srcs, n, hidden, bf16 != 0, vec16 != 0);
}

extern "C" __global__ void rw_rows_sum(const rw_row_sum *list, const uint64_t *srcs, uint32_t n,
				       uint32_t hidden, uint32_t bf16, uint32_t vec16)
{
	sum_rows<false>(list, srcs, n, hidden, bf16 != 0, vec16 != 0);
}

// The count row of one rank's tokens on the GPU (sched/counts.c's pass 1): each token's distinct
// destination nodes (expert e lives on node e / per_node), one record each, counted into
// row[d * rails + rail] (rail: the rank's native rail), so a node's row is the sum over its
// ranks' launches and only the N x R row goes to the host. An id of -1 is a dropped slot; any
// other id outside [0, n_experts) counts nothing for its token and sets *bad to 1 + the token.
// Counts go through a block-local copy of the row in shared memory when it fits (nodes * rails
// <= shared_n), then one atomic add per nonzero entry per block.
extern "C" __global__ void rw_route_count(const int32_t *ids, uint32_t n_tokens, uint32_t topk,
					  uint32_t n_experts, uint32_t per_node, uint32_t rails,
					  uint32_t rail, uint32_t *row, uint32_t *bad, uint32_t shared_n)
{
	extern __shared__ uint32_t part[];
	for (uint32_t i = threadIdx.x; i < shared_n; i += blockDim.x)
		part[i] = 0;
	__syncthreads();
	for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n_tokens; t += gridDim.x * blockDim.x) {
		const int32_t *id = ids + (uint64_t)t * topk;
		uint32_t uniq[32];
		uint32_t n = 0;
		bool ok = true;
		for (uint32_t k = 0; k < topk && ok; k++) {
			int32_t e = id[k];
			if (e == -1)
				continue;
			if (e < 0 || (uint32_t)e >= n_experts) {
				ok = false;
				break;
			}
			uint32_t d = (uint32_t)e / per_node, u = 0;
			while (u < n && uniq[u] != d)
				u++;
			if (u == n)
				uniq[n++] = d;
		}
		if (!ok) {
			atomicExch(bad, t + 1);
			continue;
		}
		for (uint32_t u = 0; u < n; u++) {
			uint32_t i = uniq[u] * rails + rail;
			if (shared_n)
				atomicAdd(&part[i], 1u);
			else
				atomicAdd(&row[i], 1u);
		}
	}
	__syncthreads();
	for (uint32_t i = threadIdx.x; i < shared_n; i += blockDim.x)
		if (part[i])
			atomicAdd(&row[i], part[i]);
}

// dst[i] = src[i] for i < n fp32 sums, stored as bf16 (rounded as the host does) or fp32. dst
// may be mapped host memory (a host-memory rank's staging), which a D2D copy cannot address.
extern "C" __global__ void rw_store_f32(void *dst, const float *src, uint64_t n, uint32_t bf16)
{
	for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (uint64_t)gridDim.x * blockDim.x) {
		if (bf16)
			static_cast<uint16_t *>(dst)[i] = f32_bf16_host(src[i]);
		else
			static_cast<float *>(dst)[i] = src[i];
	}
}
