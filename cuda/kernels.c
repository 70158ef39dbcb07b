/* cuda/kernels.c: load the embedded kernel fatbin into each device's primary context on first
 * use and launch pack / unpack / combine on a stream. Builds without nvcc embed an empty image
 * (cuda/kernels_none.c): then rw_cuda_kernels_available() is 0 and callers use host paths. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <stddef.h>

extern const unsigned char rw_cuda_kernels_fatbin[];
extern const size_t rw_cuda_kernels_fatbin_len;

static const char *const kernel_names[RW_K_COUNT] = {
	[RW_K_PACK16] = "rw_pack16",         [RW_K_UNPACK16] = "rw_unpack16",
	[RW_K_PACK1] = "rw_pack1",           [RW_K_UNPACK1] = "rw_unpack1",
	[RW_K_COMB_BB_V] = "rw_combine_bb_v", [RW_K_COMB_BF_V] = "rw_combine_bf_v",
	[RW_K_COMB_FB_V] = "rw_combine_fb_v", [RW_K_COMB_FF_V] = "rw_combine_ff_v",
	[RW_K_COMB_BB_S] = "rw_combine_bb_s", [RW_K_COMB_BF_S] = "rw_combine_bf_s",
	[RW_K_COMB_FB_S] = "rw_combine_fb_s", [RW_K_COMB_FF_S] = "rw_combine_ff_s",
	[RW_K_COPY_ROWS16] = "rw_copy_rows16", [RW_K_COPY_ROWS1] = "rw_copy_rows1",
	[RW_K_ROWS_ACC] = "rw_rows_acc",     [RW_K_ROWS_SUM] = "rw_rows_sum",
	[RW_K_STORE_F32] = "rw_store_f32", [RW_K_ROUTE_COUNT] = "rw_route_count",
};

int rw_cu_image_load(int device, const rw_cu_image_t *img, rw_cu_module_t *m, CUfunction *fn)
{
	CUresult res;
	int state;

	if (rw_cu_enter(device) != RW_OK)
		return -1;
	pthread_mutex_lock(&rw_cu_lock);
	if (m->state != 0)
		goto out;
	m->state = -1;
	if (img->len == 0) {
		rw_info("cuda: built without nvcc: no %s (host paths will be used)", img->what);
		goto out;
	}
	if (!rw_cu.cuModuleLoadData || !rw_cu.cuModuleGetFunction || !rw_cu.cuLaunchKernel) {
		rw_info("cuda: driver lacks the module API: no %s", img->what);
		goto out;
	}
	res = rw_cu.cuModuleLoadData(&m->module, img->data);
	if (res != CUDA_SUCCESS) {
		rw_cu_fail(res, img->load);
		goto out;
	}
	for (int k = 0; k < img->n; k++) {
		res = rw_cu.cuModuleGetFunction(&fn[k], m->module, img->names[k]);
		if (res != CUDA_SUCCESS) {
			rw_cu_fail(res, img->names[k]);
			rw_cu.cuModuleUnload(m->module);
			m->module = NULL;
			goto out;
		}
	}
	m->state = 1;
out:
	state = m->state;
	pthread_mutex_unlock(&rw_cu_lock);
	return state == 1 ? 0 : -1;
}

int rw_cu_kernels_load(int device)
{
	const rw_cu_image_t img = {
		.data = rw_cuda_kernels_fatbin, .len = rw_cuda_kernels_fatbin_len,
		.what = "GPU kernels", .load = "cuModuleLoadData(kernels: sm_90 code + compute_90 PTX)",
		.names = kernel_names, .n = RW_K_COUNT,
	};
	if (rw_cu_enter(device) != RW_OK)
		return -1;
	return rw_cu_image_load(device, &img, &rw_cu_devices[device].kern, rw_cu_devices[device].fn);
}

int rw_cuda_kernels_available(int device)
{
	return rw_cu_kernels_load(device) == 0;
}

/* Launch kernel k on stream h of `device`: one of ours, or a caller's (librailwave's rank path). */
static rw_status_t launch_on(int device, CUstream h, int k, unsigned grid, unsigned block,
			     unsigned shared, void **args)
{
	CUresult res;

	if (rw_cu_kernels_load(device) != 0)
		return RW_ERR_UNSUPPORTED;
	/* rw_cu_kernels_load() left the device's context current. */
	res = rw_cu.cuLaunchKernel(rw_cu_devices[device].fn[k], grid, 1, 1, block, 1, 1, shared, h,
				   args, NULL);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, kernel_names[k]);
}

static rw_status_t launch_shared(rw_cuda_stream_t *s, int k, unsigned grid, unsigned block,
				 unsigned shared, void **args)
{
	return launch_on(rw_cuda_stream_device(s), rw_cu_stream_handle(s), k, grid, block, shared,
			 args);
}

static rw_status_t launch(rw_cuda_stream_t *s, int k, unsigned grid, unsigned block, void **args)
{
	return launch_shared(s, k, grid, block, 0, args);
}

/* Enough blocks to fill the chip several times over (132 SMs on an H200), fewer for few rows:
 * the kernels loop over rows, so any grid size is correct. */
static unsigned grid_for(uint32_t nrows)
{
	return nrows < 4096 ? nrows : 4096;
}

static rw_status_t move_rows(rw_cuda_stream_t *s, int gather, rw_cuda_dptr_t dst, rw_cuda_dptr_t src,
			     rw_cuda_dptr_t idx, uint32_t nrows, uint32_t row_bytes)
{
	CUdeviceptr d = dst, sr = src, ix = idx;
	uint32_t n = nrows, len = row_bytes;
	void *args[] = { &d, &sr, &ix, &n, &len };
	unsigned block;
	int k;

	if (s == NULL || dst == 0 || src == 0 || idx == 0 || idx % 4 != 0)
		return RW_ERR_INVAL;
	if (nrows == 0 || row_bytes == 0)
		return RW_OK;
	if ((dst | src) % 16 == 0 && row_bytes % 16 == 0) {
		len = row_bytes / 16;
		k = gather ? RW_K_PACK16 : RW_K_UNPACK16;
		block = len >= 1024 ? 256 : 128;
	} else {
		k = gather ? RW_K_PACK1 : RW_K_UNPACK1;
		block = 256;
	}
	return launch(s, k, grid_for(nrows), block, args);
}

rw_status_t rw_cuda_pack(rw_cuda_stream_t *stream, rw_cuda_dptr_t slab, rw_cuda_dptr_t src,
			 rw_cuda_dptr_t idx, uint32_t nrows, uint32_t row_bytes)
{
	return move_rows(stream, 1, slab, src, idx, nrows, row_bytes);
}

rw_status_t rw_cuda_unpack(rw_cuda_stream_t *stream, rw_cuda_dptr_t dst, rw_cuda_dptr_t slab,
			   rw_cuda_dptr_t idx, uint32_t nrows, uint32_t row_bytes)
{
	return move_rows(stream, 0, dst, slab, idx, nrows, row_bytes);
}

rw_status_t rw_cuda_combine(rw_cuda_stream_t *stream, rw_cuda_dptr_t out, rw_cuda_dtype_t out_dtype,
			    rw_cuda_dptr_t rows, rw_cuda_dtype_t row_dtype, uint32_t hidden,
			    uint32_t ntokens, rw_cuda_dptr_t offsets, rw_cuda_dptr_t row_idx,
			    rw_cuda_dptr_t weights)
{
	CUdeviceptr o = out, r = rows, off = offsets, ri = row_idx, w = weights;
	uint32_t h = hidden, nt = ntokens;
	void *args[] = { &o, &r, &h, &nt, &off, &ri, &w };
	unsigned vec, block;
	int pair, k, out_b, row_b;

	if (stream == NULL || out == 0 || rows == 0 || offsets == 0 || row_idx == 0 || weights == 0 ||
	    (out_dtype != RW_CUDA_BF16 && out_dtype != RW_CUDA_FP32) ||
	    (row_dtype != RW_CUDA_BF16 && row_dtype != RW_CUDA_FP32) ||
	    (offsets | row_idx | weights) % 4 != 0)
		return RW_ERR_INVAL;
	if (ntokens == 0 || hidden == 0)
		return RW_OK;
	out_b = out_dtype == RW_CUDA_BF16;
	row_b = row_dtype == RW_CUDA_BF16;
	if (out % (out_b ? 2 : 4) != 0 || rows % (row_b ? 2 : 4) != 0)
		return RW_ERR_INVAL;
	pair = out_b ? (row_b ? 0 : 1) : (row_b ? 2 : 3); /* bb, bf, fb, ff */
	vec = (out_b && row_b) ? 8 : 4;
	if (hidden % vec == 0 && (out | rows) % 16 == 0) {
		k = RW_K_COMB_BB_V + pair;
	} else {
		k = RW_K_COMB_BB_S + pair;
		vec = 1;
	}
	block = hidden / vec >= 256 ? 256 : 128;
	return launch(stream, k, grid_for(ntokens), block, args);
}

/* ---- row lists (the daemon's CUDA mover) ---- */

rw_status_t rw_cuda_copy_rows(rw_cuda_stream_t *stream, rw_cuda_dptr_t list, uint32_t n,
			      uint32_t row_bytes, int aligned16)
{
	CUdeviceptr l = list;
	uint32_t cnt = n, len = row_bytes;
	void *args[] = { &l, &cnt, &len };
	int k = RW_K_COPY_ROWS1;
	unsigned block = 256;

	if (stream == NULL || list == 0 || list % 16 != 0)
		return RW_ERR_INVAL;
	if (n == 0 || row_bytes == 0)
		return RW_OK;
	if (aligned16 && row_bytes % 16 == 0) {
		k = RW_K_COPY_ROWS16;
		len = row_bytes / 16;
		block = len >= 1024 ? 256 : 128;
	}
	return launch(stream, k, grid_for(n), block, args);
}

static rw_status_t sum_rows(rw_cuda_stream_t *stream, int k, rw_cuda_dptr_t list,
			    rw_cuda_dptr_t srcs, uint32_t n, uint32_t hidden, rw_cuda_dtype_t dtype,
			    int aligned16)
{
	CUdeviceptr l = list, sr = srcs;
	uint32_t cnt = n, h = hidden, bf16 = dtype == RW_CUDA_BF16, vec = aligned16 != 0;
	void *args[] = { &l, &sr, &cnt, &h, &bf16, &vec };

	if (stream == NULL || list == 0 || srcs == 0 || list % 16 != 0 || srcs % 8 != 0 ||
	    (dtype != RW_CUDA_BF16 && dtype != RW_CUDA_FP32))
		return RW_ERR_INVAL;
	if (n == 0 || hidden == 0)
		return RW_OK;
	if ((uint64_t)hidden * (bf16 ? 2 : 4) % 16 != 0)
		vec = 0;
	return launch(stream, k, grid_for(n), hidden >= 1024 ? 256 : 128, args);
}

rw_status_t rw_cuda_rows_sum(rw_cuda_stream_t *stream, rw_cuda_dptr_t list, rw_cuda_dptr_t srcs,
			     uint32_t n, uint32_t hidden, rw_cuda_dtype_t dtype, int aligned16)
{
	return sum_rows(stream, RW_K_ROWS_SUM, list, srcs, n, hidden, dtype, aligned16);
}

rw_status_t rw_cuda_rows_acc(rw_cuda_stream_t *stream, rw_cuda_dptr_t list, rw_cuda_dptr_t srcs,
			     uint32_t n, uint32_t hidden, rw_cuda_dtype_t dtype)
{
	return sum_rows(stream, RW_K_ROWS_ACC, list, srcs, n, hidden, dtype, 0);
}

rw_status_t rw_cuda_store_f32(rw_cuda_stream_t *stream, rw_cuda_dptr_t dst, rw_cuda_dtype_t dtype,
			      rw_cuda_dptr_t src, uint64_t n)
{
	CUdeviceptr d = dst, s = src;
	uint64_t cnt = n;
	uint32_t bf16 = dtype == RW_CUDA_BF16;
	void *args[] = { &d, &s, &cnt, &bf16 };

	if (stream == NULL || dst == 0 || src == 0 || src % 4 != 0 ||
	    (dtype != RW_CUDA_BF16 && dtype != RW_CUDA_FP32) || dst % (bf16 ? 2 : 4) != 0)
		return RW_ERR_INVAL;
	if (n == 0)
		return RW_OK;
	return launch(stream, RW_K_STORE_F32, 4096, 256, args);
}

/* max_blocks: 0, or the most blocks the launch takes (the kernel is grid-stride). */
static rw_status_t route_count_on(int device, CUstream h, unsigned max_blocks, rw_cuda_dptr_t ids,
				  uint32_t n_tokens, uint32_t topk, uint32_t n_experts,
				  uint32_t nodes, uint32_t rails, uint32_t rail, rw_cuda_dptr_t row,
				  rw_cuda_dptr_t bad)
{
	CUdeviceptr i = ids, r = row, b = bad;
	uint32_t nt = n_tokens, k = topk, e = n_experts, per = nodes ? n_experts / nodes : 0, nr = rails,
		 ra = rail, shared_n = nodes * rails <= 4096 ? nodes * rails : 0;
	void *args[] = { &i, &nt, &k, &e, &per, &nr, &ra, &r, &b, &shared_n };

	if (row == 0 || bad == 0 || row % 4 != 0 || bad % 4 != 0 || topk == 0 ||
	    topk > 32 || nodes == 0 || rails == 0 || rail >= rails || per == 0 ||
	    n_experts % nodes != 0 || (n_tokens && (ids == 0 || ids % 4 != 0)))
		return RW_ERR_INVAL;
	if (n_tokens == 0)
		return RW_OK;
	unsigned grid = (n_tokens + 255) / 256;
	if (grid > 1024)
		grid = 1024;
	if (max_blocks && grid > max_blocks)
		grid = max_blocks;
	return launch_on(device, h, RW_K_ROUTE_COUNT, grid, 256, shared_n * 4u, args);
}

rw_status_t rw_cuda_route_count(rw_cuda_stream_t *stream, rw_cuda_dptr_t ids, uint32_t n_tokens,
				uint32_t topk, uint32_t n_experts, uint32_t nodes, uint32_t rails,
				uint32_t rail, rw_cuda_dptr_t row, rw_cuda_dptr_t bad)
{
	if (stream == NULL)
		return RW_ERR_INVAL;
	return route_count_on(rw_cuda_stream_device(stream), rw_cu_stream_handle(stream), 0, ids,
			      n_tokens, topk, n_experts, nodes, rails, rail, row, bad);
}

rw_status_t rw_cuda_route_count_ext(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t ids,
				    uint32_t n_tokens, uint32_t topk, uint32_t n_experts,
				    uint32_t nodes, uint32_t rails, uint32_t rail, rw_cuda_dptr_t row,
				    rw_cuda_dptr_t bad)
{
	if (s == NULL || s->device < 0 || rw_cuda_init() != RW_OK || s->device >= rw_cu_ndevices)
		return RW_ERR_INVAL;
	return route_count_on(s->device, (CUstream)(uintptr_t)s->handle, s->max_blocks, ids,
			      n_tokens, topk, n_experts, nodes, rails, rail, row, bad);
}

#endif /* RW_HAVE_CUDA_H */
