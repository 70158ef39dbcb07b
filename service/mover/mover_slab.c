/* What a mover does with slabs that are GPU memory (service/mover/mover.h "Where the slabs are"): the
 * byte ranges of a pair's slabs, and the copies between the host shadow and the GPU that keep
 * its two rules for a mover that writes and reads slabs with the CPU (the host mover): a packed
 * slab goes to the GPU before it is posted, an arrived range comes from the GPU after a
 * GPUDirect flush. The CUDA mover copies only headers (service/mover/mover_cuda_slab.c). */
#include <stdio.h>

#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"

void rw_svc_slab_range(const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, int send, uint32_t peer,
		       uint32_t rail, uint64_t *off_p, uint64_t *len_p)
{
	const rw_svc_layout_t *l = ph->layout;
	const size_t i = (size_t)peer * ph->rails + rail;
	const uint64_t rec = kind == RW_SVC_COMBINE ? ph->crec_size : ph->rec_size;
	/* Our dispatch records to peer and its combine rows back use the out side of the layout;
	 * peer's dispatch records to us and our combine rows back to it, the in side. */
	if ((kind == RW_SVC_DISPATCH) == (send != 0)) {
		*off_p = (uint64_t)l->out_first[i] * rec;
		*len_p = (uint64_t)l->out_pairs[peer].quota[rail] * rec;
	} else {
		*off_p = (uint64_t)l->in_first[i] * rec;
		*len_p = (uint64_t)l->in_quota[i] * rec;
	}
}

rw_status_t rw_svc_slab_push(const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, uint32_t d,
			     char *why)
{
	for (uint32_t r = 0; r < ph->rails; r++) {
		uint64_t off, len;
		if (ph->slab_dev[r] < 0)
			continue;
		rw_svc_slab_range(ph, kind, 1, d, r, &off, &len);
		rw_status_t st = len ? rw_cuda_memcpy_htod(ph->slab_dev[r], ph->send_dptr[kind][r] + off,
							   ph->send_area[kind][r] + off, len) : RW_OK;
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot copy the %s slab for node %u on rail %u to GPU "
				 "%d: %s", rw_svc_kind_name(kind), d, r, ph->slab_dev[r],
				 rw_status_str(st));
			return RW_ERR_DEVICE;
		}
	}
	return RW_OK;
}

rw_status_t rw_svc_slab_pull(const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, uint32_t src,
			     uint32_t rail, char *why)
{
	const int dev = ph->slab_dev[rail];
	uint64_t off, len;
	if (dev < 0)
		return RW_OK;
	rw_svc_slab_range(ph, kind, 0, src, rail, &off, &len);
	rw_status_t st = rw_cuda_gdr_flush(dev, 0);
	if (st == RW_OK && len)
		st = rw_cuda_memcpy_dtoh(dev, (uint8_t *)(uintptr_t)ph->recv_area[kind][rail] + off,
					 ph->recv_dptr[kind][rail] + off, len);
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "cannot read the %s range from node %u on rail %u from GPU "
			 "%d: %s", rw_svc_kind_name(kind), src, rail, dev, rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	return RW_OK;
}
