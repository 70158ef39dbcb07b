/* The CUDA mover with slabs on a GPU (service/mover/mover.h "Where the slabs are"; docs/cuda.md "Where
 * the slabs live"). The NIC reads and writes the slabs in GPU memory; the kernels write and read
 * the rows there as they do mapped host slabs. What changes is the headers, which the CPU writes
 * and checks: it keeps them in the rail's host shadow (mapped into the GPUs), and
 *  - a dispatch record's header is written into the shadow when the pack is launched (it
 *    depends only on the plan and the top-k) and copied into the slab by a kernel of the same
 *    piece, before the piece's mark, so a piece ready() offers has its headers on the GPU;
 *  - the combine slabs' headers likewise, with the combine's slab kernels;
 *  - an arrived range's headers (what part() or arrived() gives, past what was pulled before)
 *    are copied from the slab into the shadow, after a GPUDirect flush where the GPU needs one,
 *    by a kernel on a stream of their own with a mark behind it; the loop goes on, and when the
 *    mark is done they are checked and the range taken as on a host-memory rail. A bad record
 *    is reported (RW_MV_OP_REFUSED); finish() waits for every pull.
 * A rail whose slabs are host memory is unchanged (the CPU writes its headers after the rows). */
#include <stdio.h>

#include "service/mover/mover_cuda_int.h"

int cm_slab_any(const rw_svc_phase_t *ph)
{
	for (uint32_t r = 0; r < ph->rails; r++)
		if (ph->slab_dev[r] >= 0)
			return 1;
	return 0;
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
	if (!cm_slab_any(ph))
		return RW_OK;
	/* Each pull takes at least one new record: at most one per record of either kind. */
	const size_t nr = (size_t)ph->nodes * ph->rails;
	cp->pulls_cap = ph->row_off[nr] + ph->n_in + 1;
	cp->pulls = rw_arena_alloc(&cp->mem, cp->pulls_cap, sizeof(cm_pull_t));
	for (int k = 0; k < 2; k++)
		cp->rx_pulled[k] = rw_arena_alloc(&cp->mem, nr, sizeof(uint32_t));
	if (!cp->pulls || !cp->rx_pulled[0] || !cp->rx_pulled[1]) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
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
	cm_list_carve(&cp->pull, base, off, n_rec + n_in, 0, 0); /* each header is pulled once */
	if (base) {
		cp->pk_hl.row = (uint32_t)rw_wire_rec_row_off(ph->topk);
		cp->cs_hl.row = RW_WIRE_CREC_HDR;
	}
}

rw_status_t cm_slab_pull(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind, uint32_t src,
			 uint32_t rail, uint32_t upto, char *why)
{
	const int dev = ph->slab_dev[rail];
	cuda_mover_t *m = cp->m;
	const size_t i = (size_t)src * ph->rails + rail;
	const uint32_t from = cp->rx_pulled[kind][i];
	if (from >= upto)
		return RW_OK;
	const uint64_t rec = kind ? ph->crec_size : ph->rec_size;
	uint64_t range_off, range_len;
	rw_svc_slab_range(ph, kind, 0, src, rail, &range_off, &range_len);
	cm_list_t *l = &cp->pull;
	if (l->n + (upto - from) > l->cap || cp->n_pulls == cp->pulls_cap) { /* never: sized at plan */
		snprintf(why, RW_SVC_WHY_MAX, "headers from node %u rail %u exceed the pull lists", src,
			 rail);
		return RW_ERR_STATE;
	}
	l->addr_bits = 0;
	for (uint64_t k = from, pos = range_off + from * rec; k < upto; k++, pos += rec)
		cm_list_copy(l, cp->recv_d[kind][rail] + pos, cp->sh_recv_d[kind][rail] + pos);
	const uint32_t row = kind ? RW_WIRE_CREC_HDR : (uint32_t)rw_wire_rec_row_off(ph->topk);
	/* The NIC's writes must be visible to every device that reads them: the header kernel's,
	 * and the forward or sum kernels of the pair's devices launched once it is done. */
	const uint32_t readers = cp->reach | 1u << dev;
	rw_cuda_stream_t *s = NULL;
	rw_status_t st = rw_cuda_gdr_flush(dev, (readers & (readers - 1)) != 0);
	if (st == RW_OK) /* a lane of its own: a pull does not queue behind pack and forwards */
		st = rw_svc_stage_stream(m->pst, dev, &s);
	if (st == RW_OK) {
		cp->pull_devs |= 1u << dev;
		st = rw_cuda_copy_rows(s, cm_hptr(l->copy + l->launched), upto - from, row,
				       (l->addr_bits & 15) == 0);
	}
	l->launched = l->n;
	if (st == RW_OK)
		st = rw_svc_stage_mark(m->pst, dev, cm_token(cp, OP_PULL, (uint32_t)dev));
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "cannot read %u %s headers from rail %u's slab on GPU %d: %s",
			 upto - from, kind ? "combine" : "dispatch", rail, dev, rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	cp->pending++;
	cp->pulls[cp->n_pulls++] = (cm_pull_t){ .src = src, .rail = rail, .upto = upto,
					       .kind = (int8_t)kind, .dev = (int8_t)dev };
	cp->pulls_left++;
	cp->rx_pulled[kind][i] = upto;
	m->slab_pulls++;
	return RW_OK;
}
