/* The row lists the CUDA mover's kernels follow (service/mover/mover_cuda_int.h cm_list_t): carved
 * from a pair's pinned buffer, which the kernels read mapped, and filled entry by entry. The
 * leaf every other file of the mover calls. */
#include "service/mover/mover_cuda_int.h"

rw_cuda_dptr_t cm_hptr(const void *p) { return (rw_cuda_dptr_t)(uintptr_t)p; }

/* Carve a list of `n` entries (`srcs` sum sources) from the pair's pinned buffer at *off; with
 * base NULL only count the bytes (the sizing pass). */
void cm_list_carve(cm_list_t *l, uint8_t *base, size_t *off, uint32_t n, uint32_t srcs, int sum)
{
	const size_t n_bytes = ((size_t)n * 16 + 63) & ~(size_t)63;
	const size_t src_bytes = sum ? ((size_t)srcs * 8 + 63) & ~(size_t)63 : 0;
	if (base) {
		*l = (cm_list_t){ .cap = n, .src_cap = srcs };
		if (sum)
			l->sum = (rw_cuda_row_sum_t *)(void *)(base + *off);
		else
			l->copy = (rw_cuda_row_copy_t *)(void *)(base + *off);
		l->src = (uint64_t *)(void *)(base + *off + n_bytes);
	}
	*off += n_bytes + src_bytes;
}

void cm_list_copy(cm_list_t *l, rw_cuda_dptr_t src, rw_cuda_dptr_t dst)
{
	l->copy[l->n++] = (rw_cuda_row_copy_t){ .src = src, .dst = dst };
	l->addr_bits |= src | dst;
}

/* Open a sum entry for dst; cm_list_src() adds its rows in order. */
void cm_list_sum(cm_list_t *l, rw_cuda_dptr_t dst)
{
	l->sum[l->n++] = (rw_cuda_row_sum_t){ .dst = dst, .first = l->n_src, .count = 0 };
	l->addr_bits |= dst;
}

void cm_list_src(cm_list_t *l, rw_cuda_dptr_t src)
{
	l->src[l->n_src++] = src;
	l->sum[l->n - 1].count++;
	l->addr_bits |= src;
}
