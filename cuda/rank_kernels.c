/* cuda/rank_kernels.c: the rank kernels' host side (cuda/rw_cuda.h "rank kernels"): the second
 * embedded image (rw_cuda_rank_fatbin, empty without nvcc: cuda/kernels_none.c), loaded into a
 * device's primary context on first use, and one wrapper per kernel that checks its argument
 * block and launches on the caller's stream. Nothing here waits or reads device memory. */
#include "cuda/cuda_int.h"
#include "cuda/rw_cuda.h"

size_t rw_cuda_rank_pack_scratch(uint32_t n_tokens, uint32_t topk)
{
	return (size_t)n_tokens * topk * RW_CUDA_RANK_PACK_SLOT;
}

#if RW_HAVE_CUDA_H
#include <stddef.h>

#include "common/wire_rec.h"

extern const unsigned char rw_cuda_rank_fatbin[];
extern const size_t rw_cuda_rank_fatbin_len;

_Static_assert(sizeof(rw_cuda_plan_entry_t) == 16, "plan entry layout");
_Static_assert(sizeof(rw_cuda_list_entry_t) == 16, "list entry layout");
_Static_assert(sizeof(rw_cuda_rank_pack_t) == 240, "pack block layout");
_Static_assert(sizeof(rw_cuda_rank_forward_t) == 376, "forward block layout");
_Static_assert(sizeof(rw_cuda_rank_gather_t) == 368, "gather block layout");
_Static_assert(sizeof(rw_cuda_rank_ctl_t) == 208, "ctl block layout");
_Static_assert(sizeof(rw_cuda_rank_tail_t) == 128, "shadow tail layout");
_Static_assert(sizeof(rw_cuda_rank_reduce_t) == 456, "reduce block layout");

static const char *const rank_names[RW_RK_COUNT] = {
	[RW_RK_PACK_INDEX] = "rw_rank_pack_index", [RW_RK_PACK_ROWS] = "rw_rank_pack_rows",
	[RW_RK_FORWARD] = "rw_rank_forward",       [RW_RK_GATHER] = "rw_rank_gather",
	[RW_RK_REDUCE] = "rw_rank_reduce",         [RW_RK_CTL] = "rw_rank_ctl",
};

static int rank_load(int device)
{
	const rw_cu_image_t img = {
		.data = rw_cuda_rank_fatbin, .len = rw_cuda_rank_fatbin_len, .what = "rank kernels",
		.load = "cuModuleLoadData(rank kernels: sm_90 code + compute_90 PTX)",
		.names = rank_names, .n = RW_RK_COUNT,
	};
	if (rw_cu_enter(device) != RW_OK)
		return -1;
	return rw_cu_image_load(device, &img, &rw_cu_devices[device].rank,
				rw_cu_devices[device].rank_fn);
}

int rw_cuda_rank_kernels_available(int device)
{
	return rank_load(device) == 0;
}

int rw_cuda_device_sms(int device)
{
	int sms = 0;
	if (rw_cuda_init() != RW_OK || device < 0 || device >= rw_cu_ndevices ||
	    rw_cu.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
				       rw_cu_devices[device].dev) != CUDA_SUCCESS || sms < 0)
		return 0;
	return sms;
}

/* Launch kernel k with its argument block (copied by the driver at the call), on at most the
 * stream's budget of blocks (every rank kernel is grid-stride: any grid is correct). */
static rw_status_t rank_launch(const rw_cuda_ext_stream_t *s, int k, unsigned grid, unsigned block,
			       unsigned shared, const void *args)
{
	void *params[] = { (void *)args };
	CUresult res;

	if (s->max_blocks && grid > s->max_blocks)
		grid = s->max_blocks;
	if (rank_load(s->device) != 0)
		return RW_ERR_UNSUPPORTED;
	/* rank_load() left the device's context current. */
	res = rw_cu.cuLaunchKernel(rw_cu_devices[s->device].rank_fn[k], grid, 1, 1, block, 1, 1,
				   shared, (CUstream)(uintptr_t)s->handle, params, NULL);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, rank_names[k]);
}

static int dtype_ok(uint32_t dtype)
{
	return dtype == RW_CUDA_BF16 || dtype == RW_CUDA_FP32;
}

static uint32_t dtype_bytes(uint32_t dtype)
{
	return dtype == RW_CUDA_BF16 ? 2 : 4;
}

static int aligned(uint64_t addr, uint64_t to)
{
	return addr % to == 0;
}

/* Enough blocks to fill an H200 (132 SMs) several times over, fewer for little work: the
 * kernels loop over their items, so any grid is correct (rank_launch caps it at the stream's
 * SM budget, rw_cuda_ext_stream_t.max_blocks). */
static unsigned grid_for(uint64_t items)
{
	return items == 0 ? 1 : items < 2048 ? (unsigned)items : 2048;
}

static uint32_t rec_bytes(uint32_t topk, uint32_t hidden, uint32_t dtype)
{
	return (uint32_t)(rw_wire_rec_row_off(topk) + rw_wire_align16((uint64_t)hidden * dtype_bytes(dtype)));
}

static uint32_t crec_bytes(uint32_t hidden, uint32_t dtype)
{
	return RW_WIRE_CREC_HDR + (uint32_t)rw_wire_align16((uint64_t)hidden * dtype_bytes(dtype));
}

/* Every rail below `rails` has a 16-byte aligned base; addresses for the others are ignored. */
static int rails_ok(const uint64_t *base, uint32_t rails)
{
	for (uint32_t r = 0; r < rails; r++)
		if (base[r] == 0 || !aligned(base[r], 16))
			return 0;
	return 1;
}

/* A forward's or reduce's areas: each present one (0: that area is not used on the rail)
 * 16-byte aligned. */
static int areas_ok(const uint64_t (*area)[RW_CUDA_RANK_RAILS], uint32_t rails)
{
	for (uint32_t a = 0; a < RW_CUDA_AREAS; a++)
		for (uint32_t r = 0; r < rails; r++)
			if (!aligned(area[a][r], 16))
				return 0;
	return 1;
}

rw_status_t rw_cuda_rank_pack(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_pack_t *a)
{
	if (s == NULL || a == NULL || a->topk == 0 || a->topk > 32 || a->nodes == 0 ||
	    a->nodes > 4096 || a->rails == 0 || a->rails > RW_CUDA_RANK_RAILS ||
	    a->n_experts == 0 || a->n_experts % a->nodes != 0 || a->me >= a->nodes ||
	    a->owner > 0xffff || a->hidden == 0 || !dtype_ok(a->dtype) || a->entry == 0 ||
	    !aligned(a->entry, 8) || a->tags == 0 || !aligned(a->tags, 4) || a->err == 0 ||
	    !aligned(a->err, 4) || !aligned(a->status, 4) || !rails_ok(a->slab, a->rails))
		return RW_ERR_INVAL;
	if (a->n_tokens && (a->x == 0 || !aligned(a->x, dtype_bytes(a->dtype)) || a->ids == 0 ||
			    !aligned(a->ids, a->ids_int64 ? 8 : 4) || a->weights == 0 ||
			    !aligned(a->weights, 4) || a->scratch == 0 || !aligned(a->scratch, 16)))
		return RW_ERR_INVAL;
	if (a->n_tokens == 0)
		return RW_OK;
	rw_cuda_rank_pack_t b = *a;
	b.rec_size = rec_bytes(a->topk, a->hidden, a->dtype);
	b.reserved = 0;
	rw_status_t st = rank_launch(s, RW_RK_PACK_INDEX, 1, 512, 0, &b);
	if (st == RW_OK)
		st = rank_launch(s, RW_RK_PACK_ROWS, grid_for(a->n_tokens), 128, 0, &b);
	return st;
}

rw_status_t rw_cuda_rank_forward(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_forward_t *a)
{
	if (s == NULL || a == NULL || a->topk == 0 || a->topk > 32 || a->hidden == 0 ||
	    !dtype_ok(a->dtype) || a->nodes == 0 || a->gpus == 0 || a->gpus > RW_CUDA_RANK_GPUS ||
	    a->rails == 0 || a->rails > RW_CUDA_RANK_RAILS || a->me >= a->nodes || a->g >= a->gpus)
		return RW_ERR_INVAL;
	uint32_t world = a->nodes * a->gpus;
	if (a->n_experts == 0 || a->n_experts % world != 0 ||
	    a->n_experts / world > RW_CUDA_RANK_EXPERTS_MAX || a->list_n == 0 ||
	    !aligned(a->list_n, 4) || a->recv_n == 0 || !aligned(a->recv_n, 4) ||
	    a->overflow == 0 || !aligned(a->overflow, 4) || a->counts == 0 ||
	    !aligned(a->counts, 4) || a->err == 0 || !aligned(a->err, 4) ||
	    !aligned(a->status, 4) || !areas_ok(a->area, a->rails))
		return RW_ERR_INVAL;
	if (a->cap && (a->list == 0 || !aligned(a->list, 4) || a->rows == 0 ||
		       !aligned(a->rows, dtype_bytes(a->dtype)) || a->meta == 0 || !aligned(a->meta, 4)))
		return RW_ERR_INVAL;
	rw_cuda_rank_forward_t b = *a;
	b.rec_size = rec_bytes(a->topk, a->hidden, a->dtype);
	b.reserved = 0;
	return rank_launch(s, RW_RK_FORWARD, grid_for(a->cap), 256, 4u * (a->n_experts / world), &b);
}

rw_status_t rw_cuda_rank_gather(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_gather_t *a)
{
	if (s == NULL || a == NULL || a->hidden == 0 || !dtype_ok(a->dtype) || a->nodes == 0 ||
	    a->rails == 0 || a->rails > RW_CUDA_RANK_RAILS || a->me >= a->nodes || a->me > 0xffff ||
	    a->g >= RW_CUDA_RANK_GPUS || a->list_n == 0 || !aligned(a->list_n, 4) ||
	    a->entry == 0 || !aligned(a->entry, 8) || a->tags == 0 || !aligned(a->tags, 4) ||
	    a->err == 0 || !aligned(a->err, 4) || !aligned(a->status, 4) ||
	    !rails_ok(a->slab, a->rails) || (a->term_off == 0) != (a->terms == 0) ||
	    !aligned(a->term_off, 4) || !aligned(a->terms, 4) || !aligned(a->stage, 8) ||
	    (a->stage && (a->term_off == 0 || a->stage_gpus > RW_CUDA_RANK_GPUS)))
		return RW_ERR_INVAL;
	for (uint32_t g = 0; g < RW_CUDA_RANK_GPUS; g++)
		if (!aligned(a->rows[g], dtype_bytes(a->dtype)))
			return RW_ERR_INVAL;
	if (a->cap && (a->list == 0 || !aligned(a->list, 4) || (a->term_off == 0 && a->rows[a->g] == 0)))
		return RW_ERR_INVAL;
	rw_cuda_rank_gather_t b = *a;
	b.crec_size = crec_bytes(a->hidden, a->dtype);
	return rank_launch(s, RW_RK_GATHER, grid_for(a->cap), 256, 0, &b);
}

rw_status_t rw_cuda_rank_reduce(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_reduce_t *a)
{
	if (s == NULL || a == NULL || a->hidden == 0 || !dtype_ok(a->dtype) || a->rails == 0 ||
	    a->rails > RW_CUDA_RANK_RAILS || a->list_n == 0 || !aligned(a->list_n, 4) ||
	    a->err == 0 || !aligned(a->err, 4) || !aligned(a->status, 4) ||
	    !areas_ok(a->area, a->rails) || (a->cap && (a->list == 0 || !aligned(a->list, 4))) ||
	    (a->n_tokens && (a->out == 0 || !aligned(a->out, dtype_bytes(a->dtype)))) ||
	    (a->plan_rail && (!aligned(a->plan_rail, 8) || !rails_ok(a->slab, a->rails))))
		return RW_ERR_INVAL;
	if (a->n_tokens == 0)
		return RW_OK;
	rw_cuda_rank_reduce_t b = *a;
	b.crec_size = crec_bytes(a->hidden, a->dtype);
	return rank_launch(s, RW_RK_REDUCE, grid_for(a->n_tokens), 256, 0, &b);
}

rw_status_t rw_cuda_rank_ctl(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_ctl_t *a)
{
	if (s == NULL || a == NULL)
		return RW_ERR_INVAL;
	/* SNAP (eager mode) uses neither the control block nor the report. */
	const int copy = a->op == RW_CUDA_RANK_OP_WAIT || a->op == RW_CUDA_RANK_OP_SNAP;
	if (a->op > RW_CUDA_RANK_OP_SNAP ||
	    (a->op != RW_CUDA_RANK_OP_SNAP && (a->ctl == 0 || !aligned(a->ctl, 8) ||
					       a->report == 0 || !aligned(a->report, 8))) ||
	    a->page == 0 || !aligned(a->page, 64) || a->shadow == 0 || !aligned(a->shadow, 64) ||
	    a->kind > 1 || a->depth == 0 || a->slot_bytes % 64 || a->word > 4 ||
	    a->o_term_ref < a->o_term_off ||
	    (a->kind == 1 && (a->ref == 0 || !aligned(a->ref, 64))) || !aligned(a->out, 4) ||
	    (copy && a->word != 1 && a->word != 3) ||
	    (a->op == RW_CUDA_RANK_OP_SNAP && a->slot_k >= a->depth) ||
	    (a->op == RW_CUDA_RANK_OP_STAGE && (a->kind != 1 || a->slab == 0 || a->row_bytes == 0 ||
						(a->src == 0 && a->token_count))))
		return RW_ERR_INVAL;
	/* STAGE: enough blocks to copy every row the dispatch may deliver, in 16-byte pieces.
	 * WAIT and SNAP: a block per 64 KiB a full list (max_recv entries of 16 bytes) would take,
	 * at most 16: each copies its share (a list or terms read over PCIe by one block would
	 * take a round trip per 4 KiB). The others: one block. */
	unsigned grid = 1;
	if (a->op == RW_CUDA_RANK_OP_STAGE)
		grid = grid_for(((uint64_t)a->max_recv * a->row_bytes / 16 + 255) / 256);
	else if (copy)
		grid = 1 + (a->max_recv > 16 * 4096 ? 15 : a->max_recv / 4096);
	return rank_launch(s, RW_RK_CTL, grid, 256, 0, a);
}

#endif /* RW_HAVE_CUDA_H */
