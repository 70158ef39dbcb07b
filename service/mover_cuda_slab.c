/* The CUDA mover with slabs on a GPU (service/mover.h "Where the slabs are"; docs/cuda.md "Where
 * the slabs live"). The NIC reads and writes the slabs in GPU memory; the kernels write and read
 * the rows there as they do mapped host slabs. What changes is the headers, which the CPU writes
 * and checks: it keeps them in the rail's host shadow (mapped into the GPUs), and
 *  - a dispatch record's header is written into the shadow when the pack is launched (it
 *    depends only on the plan and the top-k) and copied into the slab by a kernel of the same
 *    piece, before the piece's mark, so a piece ready() offers has its headers on the GPU;
 *  - the combine slabs' headers likewise, with the combine's slab kernels;
 *  - an arrived range's headers are copied from the slab into the shadow (after a GPUDirect
 *    flush, where the GPU needs one) by a kernel on a stream of their own, waited for, and then
 *    checked as before. That wait blocks the loop for one small kernel per arrival taken.
 * A rail whose slabs are host memory is unchanged (the CPU writes its headers after the rows). */
#include <stdio.h>

#include "service/mover_cuda_int.h"

int cm_slab_any(const rw_svc_phase_t *ph)
{
	for (uint32_t r = 0; r < ph->rails; r++)
		if (ph->slab_dev[r] >= 0)
			return 1;
	return 0;
}

uint32_t cm_slab_devs(const rw_svc_phase_t *ph)
{
	uint32_t devs = 0;
	for (uint32_t r = 0; r < ph->rails; r++)
		if (ph->slab_dev[r] >= 0 && ph->slab_dev[r] < CM_DEVICES)
			devs |= 1u << ph->slab_dev[r];
	return devs;
}

rw_status_t cm_slab_map(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why)
{
	for (uint32_t r = 0; r < ph->rails; r++)
		for (int k = 0; k < 2; k++) {
			cp->sh_send_d[k][r] = cp->send_d[k][r];
			cp->sh_recv_d[k][r] = cp->recv_d[k][r];
			if (ph->slab_dev[r] < 0)
				continue;
			if (ph->slab_dev[r] >= CM_DEVICES || !rw_cuda_kernels_available(ph->slab_dev[r])) {
				snprintf(why, RW_SVC_WHY_MAX, "rail %u's slabs are on GPU %d, where this mover "
					 "runs no kernels", r, ph->slab_dev[r]);
				return RW_ERR_DEVICE;
			}
			cp->send_d[k][r] = ph->send_dptr[k][r];
			cp->recv_d[k][r] = ph->recv_dptr[k][r];
		}
	return RW_OK;
}

void cm_slab_carve(cm_pair_t *cp, const rw_svc_phase_t *ph, uint8_t *base, size_t *off)
{
	const int any = cm_slab_any(ph);
	const uint32_t n_rec = any ? ph->row_off[(size_t)ph->nodes * ph->rails] : 0;
	const uint32_t n_in = any ? ph->n_in : 0;
	cm_list_carve(&cp->pk_hl, base, off, n_rec, 0, 0);
	cm_list_carve(&cp->cs_hl, base, off, n_in, 0, 0);
	cm_list_carve(&cp->pull, base, off, RW_MAX(n_rec, n_in), 0, 0);
	if (base) {
		cp->pk_hl.row = (uint32_t)rw_wire_rec_row_off(ph->topk);
		cp->cs_hl.row = RW_WIRE_CREC_HDR;
	}
}

rw_status_t cm_slab_pull(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind, uint32_t rail,
			 uint64_t pos, uint32_t n, char *why)
{
	const int dev = ph->slab_dev[rail];
	if (dev < 0 || !n)
		return RW_OK;
	cuda_mover_t *m = cp->m;
	const uint64_t rec = kind ? ph->crec_size : ph->rec_size;
	cm_list_t *l = &cp->pull;
	if (n > l->cap) { /* never: a range holds at most every record of its kind */
		snprintf(why, RW_SVC_WHY_MAX, "%u headers from rail %u exceed the pull list (%u)", n,
			 rail, l->cap);
		return RW_ERR_STATE;
	}
	l->n = l->launched = 0;
	l->addr_bits = 0;
	for (uint32_t i = 0; i < n; i++)
		cm_list_copy(l, cp->recv_d[kind][rail] + pos + i * rec, cp->sh_recv_d[kind][rail] + pos + i * rec);
	const uint32_t row = kind ? RW_WIRE_CREC_HDR : (uint32_t)rw_wire_rec_row_off(ph->topk);
	/* The NIC's writes must be visible to every device that reads them: the header kernel's,
	 * and the forward or sum kernels of the pair's devices launched after this. */
	const uint32_t readers = cp->reach | 1u << dev;
	rw_status_t st = rw_cuda_gdr_flush(dev, (readers & (readers - 1)) != 0);
	if (st == RW_OK && !m->pull[dev])
		st = rw_cuda_stream_create(dev, &m->pull[dev]);
	if (st == RW_OK)
		st = rw_cuda_copy_rows(m->pull[dev], cm_hptr(l->copy), n, row, (l->addr_bits & 15) == 0);
	if (st == RW_OK)
		st = rw_cuda_stream_sync(m->pull[dev]);
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "cannot read %u %s headers from rail %u's slab on GPU %d: %s",
			 n, kind ? "combine" : "dispatch", rail, dev, rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	m->slab_pulls++;
	return RW_OK;
}

void cm_slab_close(cuda_mover_t *m)
{
	for (int d = 0; d < CM_DEVICES; d++)
		if (m->pull[d]) {
			rw_cuda_stream_destroy(m->pull[d]);
			m->pull[d] = NULL;
		}
}
