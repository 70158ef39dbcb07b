// cuda/rank_kernels.cu: the rank path's data kernels, a second image (rw_cuda_rank_fatbin) that
// librailwave loads in the rank's own process and launches on the caller's stream
// (cuda/rank_kernels.c). Contracts: cuda/rw_cuda.h "rank kernels"; argument blocks:
// cuda/rank_abi.h; record layout: common/wire_rec.h. Every kernel takes its block by value.
//
// Memory order: each kernel runs after the stream's wait on the daemon's word (plan or arrived,
// pairs P2 and P4 of docs/rankpath.md), so the plan entries, lists and slabs it reads were
// published before it started; what it writes is published by the stream's later word write
// (packed or done: cuStreamWriteValue64 puts a memory barrier before the word). Within a
// phase no two blocks write the same byte, so no kernel needs a fence of its own.
#include <stdint.h>

#include "common/wire_rec.h"
#include "cuda/rank_abi.h"

static_assert(sizeof(rw_cuda_plan_entry_t) == 16, "plan entry layout");
static_assert(sizeof(rw_cuda_list_entry_t) == 16, "list entry layout");
static_assert(sizeof(rw_cuda_rank_pack_t) == 240, "pack block layout");
static_assert(sizeof(rw_cuda_rank_forward_t) == 376, "forward block layout");
static_assert(sizeof(rw_cuda_rank_gather_t) == 368, "gather block layout");
static_assert(sizeof(rw_cuda_rank_ctl_t) == 208, "ctl block layout");
static_assert(sizeof(rw_cuda_rank_tail_t) == 128, "shadow tail layout");
static_assert(sizeof(rw_cuda_rank_reduce_t) == 456, "reduce block layout");

// ---- common pieces -------------------------------------------------------------------------

// The phase failed (P6): the int32 at `status` is nonzero. Read once per block.
__device__ __forceinline__ bool failed(uint64_t status)
{
	return status && *reinterpret_cast<const volatile int32_t *>(status) != 0;
}

// Set the device error word once: the first code wins, its detail with it.
__device__ __forceinline__ void set_err(uint64_t err, uint32_t code, uint32_t detail)
{
	uint32_t *e = reinterpret_cast<uint32_t *>(err);
	if (atomicCAS(e, 0u, code) == 0u)
		e[1] = detail;
}

// The entry (node, r) whose range [first, first + count) holds index i, over the node's rails
// (ipc/page.h rw_page_plan_find), or NULL.
__device__ __forceinline__ const rw_cuda_plan_entry_t *entry_of(const rw_cuda_plan_entry_t *e,
								 uint32_t rails, uint32_t node,
								 uint32_t i, uint32_t *rail_p)
{
	const rw_cuda_plan_entry_t *pe = e + (uint64_t)node * rails;
	for (uint32_t r = 0; r < rails; r++)
		if (i - pe[r].first < pe[r].count) { // unsigned: also i >= first
			*rail_p = r;
			return &pe[r];
		}
	return nullptr;
}

// Where a list entry's record is: its area's base on its rail + slot x size, or 0.
__device__ __forceinline__ uint64_t list_addr(const uint64_t (&area)[RW_CUDA_AREAS][RW_CUDA_RANK_RAILS],
					      uint32_t rails, const rw_cuda_list_entry_t &le,
					      uint32_t size)
{
	if (le.area >= RW_CUDA_AREAS || le.rail >= rails || !area[le.area][le.rail])
		return 0;
	return area[le.area][le.rail] + (uint64_t)le.slot * size;
}

// 16-byte vectors a thread loads before it stores any (block_copy, sum_rows): with one load in
// flight per thread, a block reading host memory over PCIe waits a round trip (~1-2 us) per
// 16 bytes x threads, which a capped grid (the SM budget) cannot hide with other blocks.
#define RW_RK_UNROLL 4

// Copy `bytes` from s to d (not overlapping) with the block's threads: 16-byte vectors when both
// addresses and the length allow (RW_RK_UNROLL loads in flight per thread), 4-byte words when
// they allow that, bytes otherwise.
__device__ __forceinline__ void block_copy(uint8_t *d, const uint8_t *s, uint32_t bytes)
{
	if (((uintptr_t)d | (uintptr_t)s | bytes) % 16 == 0) {
		const uint4 *s4 = reinterpret_cast<const uint4 *>(s);
		uint4 *d4 = reinterpret_cast<uint4 *>(d);
		const uint32_t n = bytes / 16;
		for (uint32_t i = threadIdx.x; i < n; i += RW_RK_UNROLL * blockDim.x) {
			uint4 v[RW_RK_UNROLL];
#pragma unroll
			for (uint32_t k = 0; k < RW_RK_UNROLL; k++)
				if (i + k * blockDim.x < n)
					v[k] = s4[i + k * blockDim.x];
#pragma unroll
			for (uint32_t k = 0; k < RW_RK_UNROLL; k++)
				if (i + k * blockDim.x < n)
					d4[i + k * blockDim.x] = v[k];
		}
	} else if (((uintptr_t)d | (uintptr_t)s | bytes) % 4 == 0) {
		for (uint32_t i = threadIdx.x; i < bytes / 4; i += blockDim.x)
			reinterpret_cast<uint32_t *>(d)[i] = reinterpret_cast<const uint32_t *>(s)[i];
	} else {
		for (uint32_t i = threadIdx.x; i < bytes; i += blockDim.x)
			d[i] = s[i];
	}
}

__device__ __forceinline__ void block_zero(uint8_t *d, uint32_t bytes)
{
	for (uint32_t i = threadIdx.x; i < bytes; i += blockDim.x)
		d[i] = 0;
}

__device__ __forceinline__ uint32_t dtype_size(uint32_t dtype) { return dtype == 0 ? 2 : 4; } // 0 bf16

// ---- pack ----------------------------------------------------------------------------------
// Two launches. rw_rank_pack_index: ONE block walks the tokens in chunks of blockDim.x, one
// token per thread, and gives each (token, destination) record its index among the rank's
// records for that destination — the count of earlier tokens with a record there — then maps
// that index onto the plan entries. Within a chunk the index is the warp ballot's popcount over
// lower lanes plus the lower warps' totals (a prefix over warps in shared memory) plus the
// running count of earlier chunks: the same numbers every run, no atomics. Destinations are
// taken 64 at a time (a window), so any node count works with bounded shared memory. Each
// record's send address and destination go to scratch[token * topk + u] (u: the token's u-th
// destination in id order; address 0: none). rw_rank_pack_rows: one block per token writes its records.

// A record's place, from the index kernel to the rows kernel (RW_CUDA_RANK_PACK_SLOT bytes).
struct rw_pack_slot {
	uint64_t addr;  // where the record goes in a send slab; 0: nowhere
	uint32_t dest;  // its destination node (the header's tag is tags[dest])
	uint32_t pad;
};
static_assert(sizeof(rw_pack_slot) == RW_CUDA_RANK_PACK_SLOT, "pack scratch entry");

#define PACK_THREADS 512
#define PACK_WARPS (PACK_THREADS / 32)
#define PACK_MAX_NODES 4096
#define PACK_PLAN_SHARED 1024 // plan entries (16 bytes each) staged in shared memory at most

extern "C" __global__ void __launch_bounds__(PACK_THREADS) rw_rank_pack_index(const rw_cuda_rank_pack_t a)
{
	__shared__ uint32_t running[PACK_MAX_NODES]; // records of earlier chunks per destination
	__shared__ uint32_t wsum[PACK_WARPS][64];    // per warp, per window column; then its prefix
	__shared__ rw_cuda_plan_entry_t splan[PACK_PLAN_SHARED]; // the plan, when it fits
	if (failed(a.status))
		return;
	const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
	const uint32_t per_node = a.n_experts / a.nodes;
	const uint32_t windows = (a.nodes + 63) / 64;
	// The plan entries (in the slot's mirror or shadow): read once into shared memory when
	// they fit, rather than once for every record.
	const uint32_t cells = a.nodes * a.rails;
	const rw_cuda_plan_entry_t *plan = reinterpret_cast<const rw_cuda_plan_entry_t *>(a.entry);
	if (cells <= PACK_PLAN_SHARED) {
		for (uint32_t i = threadIdx.x; i < cells; i += blockDim.x)
			splan[i] = plan[i];
		plan = splan;
	}
	rw_pack_slot *scratch = reinterpret_cast<rw_pack_slot *>(a.scratch);
	for (uint32_t i = threadIdx.x; i < a.nodes; i += blockDim.x)
		running[i] = 0;
	__syncthreads();
	for (uint32_t c = 0; c < a.n_tokens; c += blockDim.x) {
		const uint32_t t = c + threadIdx.x;
		uint32_t dest[32], idx[32], n = 0;
		if (t < a.n_tokens) {
			bool ok = true;
			for (uint32_t k = 0; k < a.topk && ok; k++) {
				int64_t e = a.ids_int64 ? reinterpret_cast<const int64_t *>(a.ids)[(uint64_t)t * a.topk + k]
							: reinterpret_cast<const int32_t *>(a.ids)[(uint64_t)t * a.topk + k];
				if (e == -1)
					continue;
				if (e < 0 || e >= (int64_t)a.n_experts) {
					ok = false;
					break;
				}
				uint32_t d = (uint32_t)e / per_node, u = 0;
				while (u < n && dest[u] != d)
					u++;
				if (u == n)
					dest[n++] = d;
			}
			if (!ok) {
				set_err(a.err, RW_CUDA_RANK_E_ID, t + 1);
				n = 0; // the count kernel counted nothing for this token
			}
		}
		for (uint32_t w = 0; w < windows; w++) {
			const uint32_t lo = w * 64, cols = min(64u, a.nodes - lo);
			uint64_t mask = 0;
			for (uint32_t u = 0; u < n; u++)
				if (dest[u] - lo < 64u)
					mask |= 1ull << (dest[u] - lo);
			// Each column's within-warp rank of this lane, kept in idx[u] of its destination.
			for (uint32_t j = 0; j < cols; j++) {
				const bool has = (mask >> j) & 1u;
				const uint32_t bal = __ballot_sync(0xffffffffu, has);
				if (lane == 0)
					wsum[warp][j] = __popc(bal);
				if (has) {
					uint32_t u = 0;
					while (dest[u] != lo + j)
						u++;
					idx[u] = __popc(bal & ((1u << lane) - 1u));
				}
			}
			__syncthreads();
			// Column j: the warps' totals become exclusive prefixes, after the earlier chunks.
			if (threadIdx.x < cols) {
				const uint32_t j = threadIdx.x;
				uint32_t run = running[lo + j];
				for (uint32_t v = 0; v < PACK_WARPS; v++) {
					uint32_t x = wsum[v][j];
					wsum[v][j] = run;
					run += x;
				}
				running[lo + j] = run;
			}
			__syncthreads();
			for (uint32_t u = 0; u < n; u++)
				if (dest[u] - lo < 64u)
					idx[u] += wsum[warp][dest[u] - lo];
			__syncthreads(); // wsum is rewritten by the next window
		}
		if (t >= a.n_tokens)
			continue;
		// The index onto its destination's entries (the plan's pieces, looked up).
		for (uint32_t u = 0; u < a.topk; u++) {
			uint64_t addr = 0;
			if (u < n) {
				uint32_t r;
				const rw_cuda_plan_entry_t *pe = entry_of(plan, a.rails, dest[u], idx[u], &r);
				if (pe)
					addr = a.slab[r] + pe->offset + (uint64_t)(idx[u] - pe->first) * a.rec_size;
				else
					set_err(a.err, RW_CUDA_RANK_E_PLAN, dest[u] + 1);
			}
			scratch[(uint64_t)t * a.topk + u] = rw_pack_slot{ addr, u < n ? dest[u] : 0u, 0u };
		}
	}
}

// One block per token (grid-stride): each of its records gets the 16-byte header, the top-k
// block (ids as int32, weights) zero-padded to the row, and the row zero-padded to rec_size.
extern "C" __global__ void rw_rank_pack_rows(const rw_cuda_rank_pack_t a)
{
	if (failed(a.status))
		return;
	const uint32_t row_bytes = a.hidden * dtype_size(a.dtype);
	const uint32_t row_off = (uint32_t)rw_wire_rec_row_off(a.topk);
	const rw_pack_slot *scratch = reinterpret_cast<const rw_pack_slot *>(a.scratch);
	for (uint32_t t = blockIdx.x; t < a.n_tokens; t += gridDim.x) {
		const uint8_t *row = reinterpret_cast<const uint8_t *>(a.x) + (uint64_t)t * row_bytes;
		for (uint32_t u = 0; u < a.topk; u++) {
			const rw_pack_slot sl = scratch[(uint64_t)t * a.topk + u];
			if (!sl.addr)
				continue; // no record (or one the plan had no slot for)
			uint8_t *rec = reinterpret_cast<uint8_t *>(sl.addr);
			uint32_t *w = reinterpret_cast<uint32_t *>(rec); // records are 16-byte aligned
			for (uint32_t i = threadIdx.x; i < row_off / 4; i += blockDim.x) {
				const uint32_t k = i - RW_WIRE_REC_HDR / 4; // top-k block word (wraps below)
				const uint64_t tk = (uint64_t)t * a.topk;
				uint32_t v = 0; // padding up to the row
				if (i == RW_WIRE_REC_TAG / 4)
					v = reinterpret_cast<const uint32_t *>(a.tags)[sl.dest];
				else if (i == RW_WIRE_REC_SRC / 4)
					v = (a.me & 0xffffu) | (a.owner << 16);
				else if (i == RW_WIRE_REC_TOKEN / 4)
					v = t;
				else if (i == RW_WIRE_REC_TOPK / 4)
					v = a.topk & 0xffffu;
				else if (k < a.topk)
					v = a.ids_int64 ? (uint32_t)(int32_t)reinterpret_cast<const int64_t *>(a.ids)[tk + k]
							: reinterpret_cast<const uint32_t *>(a.ids)[tk + k];
				else if (k - a.topk < a.topk)
					v = reinterpret_cast<const uint32_t *>(a.weights)[tk + k - a.topk];
				w[i] = v;
			}
			block_copy(rec + row_off, row, row_bytes);
			block_zero(rec + row_off + row_bytes, a.rec_size - row_off - row_bytes);
		}
	}
}

// ---- forward -------------------------------------------------------------------------------
// One block per listed record (grid-stride over the list): its header checked for the phase's
// top-k and owner, then the metadata entry and the row. Block 0 also writes recv_n and overflow,
// and counts this rank's experts in a shared-memory histogram (sums: the order of the shared
// atomics cannot change them) before it writes every expert's count. The list's length is read
// from memory: the daemon wrote it before `arrived`.

#define FWD_THREADS 256

extern "C" __global__ void __launch_bounds__(FWD_THREADS) rw_rank_forward(const rw_cuda_rank_forward_t a)
{
	extern __shared__ uint32_t hist[]; // this rank's experts (per_rank entries)
	const uint32_t listed = failed(a.status) ? 0 : *reinterpret_cast<const volatile uint32_t *>(a.list_n);
	const uint32_t n = min(listed, a.cap);
	const uint32_t per_rank = a.n_experts / (a.nodes * a.gpus);
	const uint32_t mine = (a.me * a.gpus + a.g) * per_rank; // this rank's first expert
	const rw_cuda_list_entry_t *list = reinterpret_cast<const rw_cuda_list_entry_t *>(a.list);
	const uint32_t row_bytes = a.hidden * dtype_size(a.dtype);
	const uint32_t row_off = (uint32_t)rw_wire_rec_row_off(a.topk);
	const uint32_t meta_bytes = 16 + 8 * a.topk;
	if (blockIdx.x == 0) {
		if (threadIdx.x == 0) {
			*reinterpret_cast<uint32_t *>(a.recv_n) = n;
			*reinterpret_cast<uint32_t *>(a.overflow) = listed - n;
		}
		for (uint32_t e = threadIdx.x; e < per_rank; e += blockDim.x)
			hist[e] = 0;
		__syncthreads();
		for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
			const uint64_t at = list_addr(a.area, a.rails, list[i], a.rec_size);
			if (!at)
				continue; // E_REF: set by the block that copies it
			const uint8_t *rec = reinterpret_cast<const uint8_t *>(at);
			if (*reinterpret_cast<const uint16_t *>(rec + RW_WIRE_REC_TOPK) != a.topk ||
			    *reinterpret_cast<const uint16_t *>(rec + RW_WIRE_REC_OWNER) >= a.gpus)
				continue; // E_RECORD: likewise
			const int32_t *ids = reinterpret_cast<const int32_t *>(rec + RW_WIRE_REC_HDR);
			for (uint32_t k = 0; k < a.topk; k++)
				if (ids[k] >= 0 && (uint32_t)ids[k] - mine < per_rank)
					atomicAdd(&hist[ids[k] - mine], 1u);
		}
		__syncthreads();
		uint32_t *counts = reinterpret_cast<uint32_t *>(a.counts);
		for (uint32_t e = threadIdx.x; e < a.n_experts; e += blockDim.x)
			counts[e] = e - mine < per_rank ? hist[e - mine] : 0;
	}
	for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
		const uint64_t at = list_addr(a.area, a.rails, list[i], a.rec_size);
		if (!at) {
			if (threadIdx.x == 0)
				set_err(a.err, RW_CUDA_RANK_E_REF, i + 1);
			continue;
		}
		const uint8_t *rec = reinterpret_cast<const uint8_t *>(at);
		const uint32_t topk = *reinterpret_cast<const uint16_t *>(rec + RW_WIRE_REC_TOPK);
		const uint32_t owner = *reinterpret_cast<const uint16_t *>(rec + RW_WIRE_REC_OWNER);
		if (topk != a.topk || owner >= a.gpus) {
			if (threadIdx.x == 0)
				set_err(a.err, RW_CUDA_RANK_E_RECORD, i + 1);
			continue;
		}
		uint32_t *meta = reinterpret_cast<uint32_t *>(a.meta + (uint64_t)i * meta_bytes);
		const uint32_t *w = reinterpret_cast<const uint32_t *>(rec);
		const uint32_t src_node = *reinterpret_cast<const uint16_t *>(rec + RW_WIRE_REC_SRC);
		for (uint32_t j = threadIdx.x; j < meta_bytes / 4; j += blockDim.x) {
			uint32_t v;
			if (j == 0)
				v = src_node;
			else if (j == 1)
				v = src_node * a.gpus + owner;
			else if (j == 2)
				v = w[RW_WIRE_REC_TOKEN / 4];
			else if (j == 3)
				v = 0;
			else // ids then weights: the record's top-k block as it is
				v = w[RW_WIRE_REC_HDR / 4 + j - 4];
			meta[j] = v;
		}
		block_copy(reinterpret_cast<uint8_t *>(a.rows) + (uint64_t)i * row_bytes, rec + row_off,
			   row_bytes);
	}
}

// ---- gather and reduce ---------------------------------------------------------------------
// One block per entry (gather) or per token (reduce), grid-stride. The terms' row addresses
// are found first (shared memory), then each thread sums its elements over the terms in order
// in fp32 (__fadd_rn: never contracted) and stores once, rounded as the host does:
// service/phase/forward.c's arithmetic bit for bit (a NaN's payload aside: the GPU's adds return
// the canonical NaN).

#define SUM_THREADS 256

// A gather's or reduce's list length: what list_n says, at most cap (more: E_REF, once).
__device__ __forceinline__ uint32_t list_count(uint64_t list_n, uint32_t cap, uint64_t err)
{
	const uint32_t listed = *reinterpret_cast<const volatile uint32_t *>(list_n);
	if (listed > cap && blockIdx.x == 0 && threadIdx.x == 0)
		set_err(err, RW_CUDA_RANK_E_REF, cap + 1);
	return min(listed, cap);
}

__device__ __forceinline__ float elem_f32(uint64_t row, uint32_t h, bool bf16)
{
	if (bf16)
		return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(row)[h] << 16);
	return reinterpret_cast<const float *>(row)[h];
}

__device__ __forceinline__ uint16_t f32_bf16_host(float f) // = common/bf16.h rw_bf16_round_bits
{
	uint32_t u = __float_as_uint(f);
	uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
	uint32_t quiet = (u >> 16) | 0x40u;
	return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

// dst = the sum of cnt rows at taddr[] (shared), in order. from_zero: the sum starts at +0 (the
// owner's; a -0 first term becomes +0); else the first term's value (a combine record's), and
// one term is copied as it is. No terms: a +0 row.
__device__ __forceinline__ void sum_rows(uint8_t *dst, const uint64_t *taddr, uint32_t cnt,
					 uint32_t hidden, uint32_t dtype, bool from_zero)
{
	const bool bf16 = dtype == 0;
	const uint32_t row_bytes = hidden * dtype_size(dtype);
	if (cnt == 0) {
		block_zero(dst, row_bytes);
		return;
	}
	if (cnt == 1 && !from_zero) {
		block_copy(dst, reinterpret_cast<const uint8_t *>(taddr[0]), row_bytes);
		return;
	}
	// 16 bytes per thread and term (8 bf16 or 4 fp32 elements) when the row and every address
	// allow: a warp then reads 512 contiguous bytes of a term at once (over PCIe for the combine
	// rows in host slabs) rather than 64 or 128. Each element's sum is the same adds in the same
	// order as the loop below, so the same bits.
	bool vec = row_bytes % 16 == 0 && (uintptr_t)dst % 16 == 0;
	for (uint32_t k = 0; k < cnt && vec; k++)
		vec = taddr[k] % 16 == 0;
	if (vec) {
		const uint32_t per = bf16 ? 8 : 4;
		for (uint32_t v = threadIdx.x; v < row_bytes / 16; v += blockDim.x) {
			float acc[8];
			for (uint32_t k0 = 0; k0 < cnt; k0 += RW_RK_UNROLL) {
				uint4 t[RW_RK_UNROLL];
#pragma unroll
				for (uint32_t k = 0; k < RW_RK_UNROLL; k++)
					if (k0 + k < cnt)
						t[k] = reinterpret_cast<const uint4 *>(taddr[k0 + k])[v];
#pragma unroll
				for (uint32_t k = 0; k < RW_RK_UNROLL; k++) {
					if (k0 + k >= cnt)
						break;
					const uint32_t w[4] = { t[k].x, t[k].y, t[k].z, t[k].w };
					float f[8];
#pragma unroll
					for (uint32_t i = 0; i < 4; i++) {
						if (bf16) {
							f[2 * i] = __uint_as_float(w[i] << 16);
							f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
						} else {
							f[i] = __uint_as_float(w[i]);
						}
					}
#pragma unroll
					for (uint32_t e = 0; e < 8; e++) {
						if (e >= per)
							break;
						if (k0 + k == 0)
							acc[e] = from_zero ? __fadd_rn(0.0f, f[e]) : f[e];
						else
							acc[e] = __fadd_rn(acc[e], f[e]);
					}
				}
			}
			uint4 o;
			if (bf16) {
				o.x = f32_bf16_host(acc[0]) | (uint32_t)f32_bf16_host(acc[1]) << 16;
				o.y = f32_bf16_host(acc[2]) | (uint32_t)f32_bf16_host(acc[3]) << 16;
				o.z = f32_bf16_host(acc[4]) | (uint32_t)f32_bf16_host(acc[5]) << 16;
				o.w = f32_bf16_host(acc[6]) | (uint32_t)f32_bf16_host(acc[7]) << 16;
			} else {
				o = make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]),
					       __float_as_uint(acc[2]), __float_as_uint(acc[3]));
			}
			reinterpret_cast<uint4 *>(dst)[v] = o;
		}
		return;
	}
	for (uint32_t h = threadIdx.x; h < hidden; h += blockDim.x) {
		float acc = elem_f32(taddr[0], h, bf16);
		if (from_zero)
			acc = __fadd_rn(0.0f, acc);
		for (uint32_t k = 1; k < cnt; k++)
			acc = __fadd_rn(acc, elem_f32(taddr[k], h, bf16));
		if (bf16)
			reinterpret_cast<uint16_t *>(dst)[h] = f32_bf16_host(acc);
		else
			reinterpret_cast<float *>(dst)[h] = acc;
	}
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS) rw_rank_gather(const rw_cuda_rank_gather_t a)
{
	__shared__ uint64_t taddr[RW_CUDA_RANK_TERMS_MAX];
	if (failed(a.status))
		return;
	const uint32_t n = list_count(a.list_n, a.cap, a.err);
	const rw_cuda_list_entry_t *list = reinterpret_cast<const rw_cuda_list_entry_t *>(a.list);
	const rw_cuda_plan_entry_t *plan = reinterpret_cast<const rw_cuda_plan_entry_t *>(a.entry);
	const uint32_t *toff = reinterpret_cast<const uint32_t *>(a.term_off);
	const uint32_t *terms = reinterpret_cast<const uint32_t *>(a.terms);
	const uint32_t row_bytes = a.hidden * dtype_size(a.dtype);
	// Static mode: the staging areas from the dispatch's plan (its shadow copy), read after the
	// combine's plan wait; else the rows[] the call gave.
	const rw_cuda_page_stage_t *stage = reinterpret_cast<const rw_cuda_page_stage_t *>(a.stage);
	for (uint32_t j = blockIdx.x; j < n; j += gridDim.x) {
		const rw_cuda_list_entry_t le = list[j];
		// The entry's terms: [j0, j1) of terms, or rows[g] row j alone.
		const uint32_t j0 = toff ? toff[j] : 0, j1 = toff ? toff[j + 1] : 1;
		if (toff && (j1 < j0 || j1 > a.n_terms || j1 - j0 > RW_CUDA_RANK_TERMS_MAX)) {
			if (threadIdx.x == 0)
				set_err(a.err, RW_CUDA_RANK_E_REF, j + 1);
			continue;
		}
		if (j1 == j0)
			continue; // another local rank writes this record
		// The return range of (node, rail) must hold the slot (slots count per rail).
		const uint32_t r = le.rail;
		const rw_cuda_plan_entry_t *pe = le.node < a.nodes && r < a.rails
			? plan + (uint64_t)le.node * a.rails + r : nullptr;
		if (!pe || le.slot - pe->first >= pe->count) {
			if (threadIdx.x == 0)
				set_err(a.err, RW_CUDA_RANK_E_PLAN, j + 1);
			continue;
		}
		bool bad = false;
		for (uint32_t k = j0 + threadIdx.x; k < j1; k += blockDim.x) {
			uint64_t at = 0;
			if (!toff) {
				at = a.rows[a.g] + (uint64_t)j * row_bytes;
			} else {
				const uint32_t ref = terms[k], g = ref >> 24;
				const uint64_t base = stage ? rw_cuda_rank_stage_rows(stage, a.stage_gpus,
										      a.slab, a.rails, g)
							    : g < RW_CUDA_RANK_GPUS ? a.rows[g] : 0;
				if (base)
					at = base + (uint64_t)(ref & 0xffffffu) * row_bytes;
			}
			taddr[k - j0] = at;
			bad |= !at;
		}
		if (__syncthreads_or(bad)) {
			if (threadIdx.x == 0)
				set_err(a.err, RW_CUDA_RANK_E_REF, j + 1);
			continue;
		}
		// The combine record of receive slot p = le.slot on rail r from node le.node.
		uint8_t *rec = reinterpret_cast<uint8_t *>(a.slab[r] + pe->offset +
							   (uint64_t)(le.slot - pe->first) * a.crec_size);
		if (threadIdx.x == 0) {
			uint32_t *w = reinterpret_cast<uint32_t *>(rec);
			w[RW_WIRE_CREC_TAG / 4] = reinterpret_cast<const uint32_t *>(a.tags)[le.node];
			w[RW_WIRE_CREC_SRC / 4] = (a.me & 0xffffu) | (r << 16);
			w[RW_WIRE_CREC_SLOT / 4] = le.slot - pe->first;
			w[RW_WIRE_CREC_SLOT / 4 + 1] = 0;
		}
		sum_rows(rec + RW_WIRE_CREC_HDR, taddr, j1 - j0, a.hidden, a.dtype, false);
		block_zero(rec + RW_WIRE_CREC_HDR + row_bytes, a.crec_size - RW_WIRE_CREC_HDR - row_bytes);
		__syncthreads(); // taddr is rewritten by the block's next entry
	}
}

// A reduce list entry's combine record: a LOCAL one where the combine plan's rail areas put the
// combine's local area (read from the slot's mirror or shadow, after the stream's copy), when
// the block names them.
__device__ __forceinline__ uint64_t reduce_addr(const rw_cuda_rank_reduce_t &a,
						const rw_cuda_list_entry_t &le)
{
	if (!a.plan_rail)
		return list_addr(a.area, a.rails, le, a.crec_size);
	if (le.area >= RW_CUDA_AREAS || le.rail >= a.rails)
		return 0;
	const rw_cuda_plan_rail_t &pr = reinterpret_cast<const rw_cuda_plan_rail_t *>(a.plan_rail)[le.rail];
	return a.slab[le.rail] + (le.area == RW_CUDA_AREA_LOCAL ? pr.local_off : pr.recv_off) +
	       (uint64_t)le.slot * a.crec_size;
}

// The reduce: one block per owner token. The list is sorted by token, so token t's terms are
// the range a binary search finds; block 0 also checks the order (a list out of order: E_REF).
extern "C" __global__ void __launch_bounds__(SUM_THREADS) rw_rank_reduce(const rw_cuda_rank_reduce_t a)
{
	__shared__ uint64_t taddr[SUM_THREADS];
	__shared__ uint32_t range[2];
	if (failed(a.status))
		return;
	const uint32_t n = list_count(a.list_n, a.cap, a.err);
	const rw_cuda_list_entry_t *list = reinterpret_cast<const rw_cuda_list_entry_t *>(a.list);
	const uint32_t row_bytes = a.hidden * dtype_size(a.dtype);
	if (blockIdx.x == 0)
		for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
			if (list[i].token >= a.n_tokens || (i + 1 < n && list[i + 1].token < list[i].token))
				set_err(a.err, RW_CUDA_RANK_E_REF, i + 1);
	for (uint32_t t = blockIdx.x; t < a.n_tokens; t += gridDim.x) {
		if (threadIdx.x < 2) { // [lower bound of t, lower bound of t + 1)
			uint32_t lo = 0, hi = n, key = t + threadIdx.x;
			while (lo < hi) {
				uint32_t mid = (lo + hi) / 2;
				if (list[mid].token < key)
					lo = mid + 1;
				else
					hi = mid;
			}
			range[threadIdx.x] = lo;
		}
		__syncthreads();
		const uint32_t j0 = range[0], j1 = max(range[0], range[1]);
		uint8_t *dst = reinterpret_cast<uint8_t *>(a.out) + (uint64_t)t * row_bytes;
		// A token's terms fit one batch of addresses: at most one per node it sent to plus one
		// per local rank, far below SUM_THREADS; more set E_REF.
		if (j1 - j0 > SUM_THREADS) {
			if (threadIdx.x == 0)
				set_err(a.err, RW_CUDA_RANK_E_REF, j0 + 1);
			__syncthreads();
			continue;
		}
		bool bad = false;
		for (uint32_t k = j0 + threadIdx.x; k < j1; k += blockDim.x) {
			const uint64_t at = reduce_addr(a, list[k]);
			taddr[k - j0] = at ? at + RW_WIRE_CREC_HDR : 0;
			bad |= !at;
		}
		if (__syncthreads_or(bad)) {
			if (threadIdx.x == 0)
				set_err(a.err, RW_CUDA_RANK_E_REF, j0 + 1);
			continue;
		}
		sum_rows(dst, taddr, j1 - j0, a.hidden, a.dtype, true);
		__syncthreads(); // taddr and range are rewritten by the block's next token
	}
}

// ---- static mode: the stream's own hand-offs ---------------------------------------------------
// One kernel, one operation per launch (cuda/rank_abi.h RW_CUDA_RANK_OP_*): the phase number k
// lives in the control block and each phase's blocks in its shadow slot, so a replayed graph
// takes a new k every time. Memory order (docs/rankpath.md "Static mode and CUDA graphs"):
//  * a word the daemon reads (submit, packed, done) is written by thread 0 after the block's
//    barrier, a __threadfence_system() and then a st.release.sys: every store of this phase
//    before it (this kernel's, and earlier kernels' of the stream, which happen before this
//    launch) is visible to the daemon's CPU before the word (pairs P1, P3, P5);
//  * a word the daemon writes (plan, arrived) is read by thread 0 with ld.acquire.sys in a loop
//    (__nanosleep between reads, growing to 2 us); the block's barrier then orders every
//    thread's reads of the slot after it (pairs P2, P4), and what the copies wrote into the
//    shadow is seen by later kernels of the stream (kernel boundaries order device memory).
// The wait costs one block of one SM while it spins and a PCIe read per poll.

__device__ __forceinline__ uint64_t load_acquire_sys(uint64_t addr)
{
	uint64_t v;
	asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
	return v;
}

__device__ __forceinline__ void store_release_sys(uint64_t addr, uint64_t v)
{
	asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}

__device__ __forceinline__ rw_cuda_page_params_t *shadow_params(const rw_cuda_rank_ctl_t &a, uint64_t sh)
{
	return reinterpret_cast<rw_cuda_page_params_t *>(sh + a.o_params);
}

__device__ __forceinline__ rw_cuda_rank_tail_t *shadow_tail(const rw_cuda_rank_ctl_t &a, uint64_t sh)
{
	return reinterpret_cast<rw_cuda_rank_tail_t *>(sh + a.slot_bytes);
}

__device__ __forceinline__ uint64_t page_slot(const rw_cuda_rank_ctl_t &a, uint64_t k)
{
	return a.page + a.slot0 + (k % a.depth) * (uint64_t)a.slot_bytes;
}

__device__ __forceinline__ uint64_t page_word(const rw_cuda_rank_ctl_t &a, uint32_t w)
{
	return a.page + a.word_off + 64ull * w;
}

// Thread 0 publishes `word` = k after the block's stores (and the stream's earlier ones).
__device__ __forceinline__ void publish(const rw_cuda_rank_ctl_t &a, uint32_t w, uint64_t k)
{
	__syncthreads();
	if (threadIdx.x == 0) {
		__threadfence_system();
		store_release_sys(page_word(a, w), k);
	}
}

__device__ void ctl_submit(const rw_cuda_rank_ctl_t &a)
{
	__shared__ uint64_t k_s;
	rw_cuda_page_params_t *sp = shadow_params(a, a.shadow);
	if (threadIdx.x == 0) {
		rw_cuda_rank_ctlblk_t *c = reinterpret_cast<rw_cuda_rank_ctlblk_t *>(a.ctl);
		const uint64_t k = c->k + 1;
		c->k = k;
		const rw_cuda_page_params_t p = rw_cuda_rank_params(&a, c, k, sp, shadow_params(a, a.ref),
								    shadow_tail(a, a.ref));
		*sp = p;
		*reinterpret_cast<rw_cuda_page_params_t *>(page_slot(a, k) + a.o_params) = p;
		k_s = k;
	}
	__syncthreads();
	const uint64_t k = k_s;
	block_copy(reinterpret_cast<uint8_t *>(page_slot(a, k) + a.o_count_row),
		   reinterpret_cast<const uint8_t *>(a.shadow + a.o_count_row), a.cells * 4u);
	publish(a, 0, k); // submit (P1)
}

// Copy `bytes` with the whole grid (16-byte pieces where everything is aligned).
__device__ __forceinline__ void grid_copy(uint8_t *d, const uint8_t *s, uint64_t bytes)
{
	const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
	const uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	if ((((uintptr_t)d | (uintptr_t)s | bytes) & 15) == 0) {
		for (uint64_t i = first; i < bytes / 16; i += stride)
			reinterpret_cast<uint4 *>(d)[i] = reinterpret_cast<const uint4 *>(s)[i];
	} else {
		for (uint64_t i = first; i < bytes; i += stride)
			d[i] = s[i];
	}
}

// Page slot `sk` (a phase number mod depth) into the shadow (static mode) or the mirror (eager
// mode, SNAP): the status into the tail, then the plan (plan word; a combine's terms too) or the
// list (arrived). The sizes of what is copied are read by each block's thread 0 (at most 16
// blocks read the same words: each such read of host memory is a PCIe round trip, and reads of
// one address queue behind each other), after the word came.
__device__ void ctl_copy(const rw_cuda_rank_ctl_t &a, uint32_t sk)
{
	__shared__ uint32_t n_s, nterm_s;
	const uint64_t slot = a.page + a.slot0 + (uint64_t)sk * a.slot_bytes;
	if (threadIdx.x == 0) {
		if (blockIdx.x == 0)
			shadow_tail(a, a.shadow)->status = *reinterpret_cast<const volatile int32_t *>(
				a.page + a.status_off + 64ull * sk);
		if (a.word == 1 && a.kind == 1) { // the terms of the dispatch's list entries
			const uint32_t n = min(*reinterpret_cast<const uint32_t *>(a.ref + a.o_list + 8),
					       a.max_recv);
			n_s = n;
			nterm_s = min(*reinterpret_cast<const volatile uint32_t *>(slot + a.o_term_off +
										   4ull * n),
				      a.gpus * a.max_recv);
		} else if (a.word != 1) { // the list's entries
			n_s = min(*reinterpret_cast<const volatile uint32_t *>(slot + a.o_list + 8),
				  a.max_recv);
		}
	}
	__syncthreads();
	if (a.word == 1) { // plan: the head, rails, tags, entries; a combine's terms too
		grid_copy(reinterpret_cast<uint8_t *>(a.shadow + a.o_plan),
			  reinterpret_cast<const uint8_t *>(slot + a.o_plan), a.o_list - a.o_plan);
		if (a.kind == 1) { // rounded up to 16 bytes (16-byte pieces): the slot's regions
				   // are line-aligned and line-padded, so the rest stays inside them
			grid_copy(reinterpret_cast<uint8_t *>(a.shadow + a.o_term_off),
				  reinterpret_cast<const uint8_t *>(slot + a.o_term_off),
				  (4ull * (n_s + 1) + 15) & ~15ull);
			grid_copy(reinterpret_cast<uint8_t *>(a.shadow + a.o_term_ref),
				  reinterpret_cast<const uint8_t *>(slot + a.o_term_ref),
				  (4ull * nterm_s + 15) & ~15ull);
		}
	} else { // arrived: the list head and its entries (at most max_recv)
		grid_copy(reinterpret_cast<uint8_t *>(a.shadow + a.o_list),
			  reinterpret_cast<const uint8_t *>(slot + a.o_list), a.o_list_entry - a.o_list);
		grid_copy(reinterpret_cast<uint8_t *>(a.shadow + a.o_list_entry),
			  reinterpret_cast<const uint8_t *>(slot + a.o_list_entry), 16ull * n_s);
	}
}

// Every block's thread 0 waits for the word (a block copies only after it saw it itself), then
// the block copies its share of the slot.
__device__ void ctl_wait(const rw_cuda_rank_ctl_t &a)
{
	const uint64_t k = shadow_params(a, a.shadow)->phase;
	if (threadIdx.x == 0) {
		uint32_t nap = 32;
		while ((int64_t)(load_acquire_sys(page_word(a, a.word)) - k) < 0) {
			__nanosleep(nap);
			nap = nap < 2048 ? nap * 2 : nap;
		}
	}
	__syncthreads();
	ctl_copy(a, (uint32_t)(k % a.depth));
}

__device__ void ctl_done(const rw_cuda_rank_ctl_t &a)
{
	if (threadIdx.x != 0)
		return;
	const rw_cuda_page_params_t *sp = shadow_params(a, a.shadow);
	const rw_cuda_rank_tail_t *t = shadow_tail(a, a.shadow);
	rw_cuda_rank_report_t *rep = reinterpret_cast<rw_cuda_rank_report_t *>(a.report);
	const uint64_t k = sp->phase;
	if (a.out)
		*reinterpret_cast<uint32_t *>(a.out) = t->recv_n;
	rw_cuda_rank_report_add(rep, a.kind, sp, t);
	__threadfence_system();
	store_release_sys(page_word(a, 4), k); // done (P5)
}

// The caller's rows into this rank's staging area (where the dispatch's plan's staging table,
// copied into its shadow at its plan, says), then a +0 row for each row the dispatch dropped past its
// capacity (the combine gives back every row the daemon listed: a dropped row adds nothing):
// before the combine's submit (P1). Grid-stride, 16 bytes a thread where everything is aligned.
__device__ void ctl_stage(const rw_cuda_rank_ctl_t &a)
{
	const rw_cuda_page_stage_t *e =
		reinterpret_cast<const rw_cuda_page_stage_t *>(a.ref + a.o_plan_stage) + a.owner;
	const rw_cuda_rank_tail_t *dt = shadow_tail(a, a.ref);
	const uint64_t copy = (uint64_t)dt->recv_n * a.row_bytes;
	const uint64_t bytes = ((uint64_t)dt->recv_n + dt->overflow) * a.row_bytes;
	uint8_t *dst = reinterpret_cast<uint8_t *>(rw_cuda_rank_stage_dst(&a, e, bytes));
	if (!dst) {
		if (blockIdx.x == 0 && threadIdx.x == 0)
			set_err(reinterpret_cast<uint64_t>(shadow_tail(a, a.shadow)->err),
				RW_CUDA_RANK_E_STAGE, dt->recv_n + dt->overflow);
		return;
	}
	const uint8_t *src = reinterpret_cast<const uint8_t *>(a.src);
	const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
	const uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	if ((((uintptr_t)dst | (uintptr_t)src | copy | bytes) & 15) == 0) {
		for (uint64_t i = first; i < bytes / 16; i += stride)
			reinterpret_cast<uint4 *>(dst)[i] = i < copy / 16 ? reinterpret_cast<const uint4 *>(src)[i]
									  : make_uint4(0, 0, 0, 0);
	} else {
		for (uint64_t i = first; i < bytes; i += stride)
			dst[i] = i < copy ? src[i] : 0;
	}
}

extern "C" __global__ void __launch_bounds__(256) rw_rank_ctl(const rw_cuda_rank_ctl_t a)
{
	switch (a.op) {
	case RW_CUDA_RANK_OP_BEGIN:
		block_zero(reinterpret_cast<uint8_t *>(a.shadow + a.o_count_row), a.cells * 4u);
		block_zero(reinterpret_cast<uint8_t *>(shadow_tail(a, a.shadow)), sizeof(rw_cuda_rank_tail_t));
		if (threadIdx.x == 0)
			shadow_params(a, a.shadow)->bad = 0;
		break;
	case RW_CUDA_RANK_OP_SUBMIT: ctl_submit(a); break;
	case RW_CUDA_RANK_OP_WAIT: ctl_wait(a); break;
	case RW_CUDA_RANK_OP_WORD:
		publish(a, a.word, shadow_params(a, a.shadow)->phase);
		break;
	case RW_CUDA_RANK_OP_DONE: ctl_done(a); break;
	case RW_CUDA_RANK_OP_STAGE: ctl_stage(a); break;
	case RW_CUDA_RANK_OP_SNAP: ctl_copy(a, a.slot_k); break;
	}
}
