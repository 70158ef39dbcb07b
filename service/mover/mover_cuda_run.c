/* What the CUDA mover launches and keeps (service/mover/mover_cuda_int.h): its streams and pools, the
 * inputs it stages, the row lists its kernels follow, and the launches of dispatch forwarding
 * and of combine's sums (the dispatch pack: mover_cuda_pack.c). Returns statuses;
 * service/mover/mover_cuda.c reports them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "service/mover/mover_cuda_int.h"



cm_pair_t *cm_pair_find(cuda_mover_t *m, uint32_t serial)
{
	cm_pair_t *cp = m->pairs;
	while (cp && cp->serial != serial)
		cp = cp->next;
	return cp;
}

/* Work of cp is about to be enqueued on `device`: its stream (the main lane), noted for
 * quiesce. RW_ERR_TIMEOUT: the device is stalled. */
rw_status_t cm_pair_stream(cm_pair_t *cp, int device, rw_cuda_stream_t **s_p)
{
	if (device < 0 || device >= CM_DEVICES)
		return RW_ERR_INVAL;
	rw_status_t st = rw_svc_stage_stream(cp->m->st, device, s_p);
	if (st == RW_OK) {
		cp->devs |= 1u << device;
		cp->dirty |= 1u << device;
	}
	return st;
}

rw_status_t cm_pair_mark(cm_pair_t *cp, int device, uint32_t op, uint32_t g)
{
	rw_cuda_stream_t *s;
	rw_status_t st = cm_pair_stream(cp, device, &s);
	if (st == RW_OK)
		st = rw_svc_stage_mark(cp->m->st, device, cm_token(cp, op, g));
	if (st != RW_OK)
		return st;
	cp->dirty &= ~(1u << device);
	cp->pending++;
	return RW_OK;
}

/* The device address of the pair's slot areas on every rail. The executor carves a slot of each
 * rail's memory into four equal consecutive areas (receive dispatch, receive combine, send
 * dispatch, send combine: exec_sub_off); the whole slot is registered once and stays so. */
rw_status_t cm_map_areas(cuda_mover_t *m, cm_pair_t *cp, const rw_svc_phase_t *ph, char *why)
{
	for (uint32_t r = 0; r < ph->rails; r++) {
		uint8_t *base = (uint8_t *)(uintptr_t)ph->recv_area[0][r];
		uint64_t sub = (uint64_t)(ph->recv_area[1][r] - ph->recv_area[0][r]);
		if (ph->recv_area[1][r] <= ph->recv_area[0][r] || ph->send_area[0][r] != base + 2 * sub ||
		    ph->send_area[1][r] != base + 3 * sub) {
			snprintf(why, RW_SVC_WHY_MAX, "rail %u's areas are not one slot of four", r);
			return RW_ERR_STATE;
		}
		uint32_t i = 0;
		while (i < m->n_reg && m->reg[i].base != base)
			i++;
		if (i == m->n_reg) {
			if (m->n_reg == CM_REGS) {
				snprintf(why, RW_SVC_WHY_MAX, "too many slab areas to map into the GPU");
				return RW_ERR_NOMEM;
			}
			rw_status_t st = rw_cuda_host_register_mapped(base, 4 * sub, &m->reg[i].dptr);
			if (st != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "cannot map rail %u's slabs into the GPU: %s",
					 r, rw_status_str(st));
				return RW_ERR_DEVICE;
			}
			m->reg[i].base = base;
			m->reg[i].bytes = 4 * sub;
			m->n_reg++;
			rw_info("cuda mover: rail %u slot area (%llu MiB of host memory) mapped into the GPUs%s",
				r, (unsigned long long)(4 * sub) >> 20,
				m->reg[i].dptr == cm_hptr(base) ? "" : " (at another device address)");
		}
		for (int k = 0; k < 2; k++) {
			cp->recv_d[k][r] = m->reg[i].dptr + (uint64_t)(ph->recv_area[k][r] - base);
			cp->send_d[k][r] = m->reg[i].dptr + (uint64_t)(ph->send_area[k][r] - base);
		}
	}
	return cm_slab_map(cp, ph, why);
}

/* The smallest free block of `dev` that holds `size` (a count row must not hold an owner-sum
 * sized block), else a new one. */
int cm_blk_take(cuda_mover_t *m, int dev, size_t size)
{
	int freed = -1, fit = -1;
	for (int i = 0; i < CM_BLOCKS; i++)
		if (!m->blk[i].busy && m->blk[i].ptr && m->blk[i].dev == dev) {
			if (m->blk[i].size >= size && (fit < 0 || m->blk[i].size < m->blk[fit].size))
				fit = i;
			else if (m->blk[i].size < size)
				freed = i;
		}
	if (fit >= 0) {
		m->blk[fit].busy = 1;
		return fit;
	}
	if (freed < 0)
		for (int i = 0; i < CM_BLOCKS && freed < 0; i++)
			if (!m->blk[i].ptr)
				freed = i;
	if (freed < 0)
		return -1;
	if (m->blk[freed].ptr) /* too small: replace it (its last user is quiesced) */
		rw_cuda_mem_free(m->blk[freed].dev, m->blk[freed].ptr);
	m->blk[freed].ptr = 0;
	if (rw_cuda_mem_alloc(dev, size, &m->blk[freed].ptr) != RW_OK)
		return -1;
	m->blk[freed].dev = dev;
	m->blk[freed].size = size;
	m->blk[freed].busy = 1;
	return freed;
}

int cm_span_dev_ok(cuda_mover_t *m, const rw_svc_span_mem_t *s)
{
	return s->dev < 0 || cm_dev_kernels(m, s->dev);
}

/* The count row on the GPU (docs/dataflow.md "Count on the GPU"): rank g's CUDA ids counted into
 * its device's row (zeroed at the pair's first count there) by rw_cuda_route_count, its bad word
 * at row[N*R + g]. A launch that cannot be made turns the pair's GPU count off (the executor then
 * counts on the host); it is not a staging error. */
static void count_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t g,
			 const rw_svc_span_mem_t *s, rw_cuda_stream_t *str)
{
	const uint32_t nr = ph->nodes * ph->rails, dev = (uint32_t)s->dev;
	rw_status_t st = RW_OK;
	if (cp->cnt_off)
		return;
	if (!cp->cnt_blk[dev]) {
		int b = cm_blk_take(cp->m, s->dev, ((size_t)nr + ph->gpus) * 4);
		st = b < 0 ? RW_ERR_NOMEM : rw_cuda_memset_async(str, cp->m->blk[b].ptr, 0,
								 ((size_t)nr + ph->gpus) * 4);
		cp->cnt_blk[dev] = b + 1;
	}
	rw_cuda_dptr_t row = st == RW_OK ? cp->m->blk[cp->cnt_blk[dev] - 1].ptr : 0;
	if (st == RW_OK)
		st = rw_cuda_route_count(str, s->dptr, ph->io[0][g].n_tokens, ph->topk, ph->n_experts,
					 ph->nodes, ph->rails, ph->topo->gpu_rail[g], row,
					 row + ((uint64_t)nr + g) * 4);
	if (st == RW_OK) {
		cp->cnt_devs |= 1u << dev;
		cp->cnt_ranks |= 1u << g;
		return;
	}
	cp->cnt_off = 1;
	rw_warn("cuda mover: cannot count local rank %u's tokens on GPU %u (%s): pair %u is counted "
		"on the host", g, dev, rw_status_str(st), cp->serial);
}

/* Every rank's count kernels are enqueued: each device's row (and bad words) comes back into
 * pinned host memory at dst, a mark behind it (OP_COUNT). */
static rw_status_t count_rows(cm_pair_t *cp, const rw_svc_phase_t *ph, uint8_t *dst)
{
	const size_t bytes = ((size_t)ph->nodes * ph->rails + ph->gpus) * 4;
	rw_status_t st = RW_OK;
	if (cp->cnt_off || cp->cnt_sent)
		return RW_OK;
	cp->cnt_sent = 1;
	for (int d = 0; d < CM_DEVICES && st == RW_OK; d++) {
		if (!(cp->cnt_devs & (1u << d)))
			continue;
		rw_cuda_stream_t *s;
		cp->cnt_host[d] = (const uint32_t *)(const void *)dst;
		dst += (bytes + 63) & ~(size_t)63;
		st = cm_pair_stream(cp, d, &s);
		if (st == RW_OK)
			st = rw_cuda_copy_dtoh_async(s, (void *)(uintptr_t)cp->cnt_host[d],
						     cp->m->blk[cp->cnt_blk[d] - 1].ptr, bytes);
		if (st == RW_OK && (st = cm_pair_mark(cp, d, OP_COUNT, 0)) == RW_OK)
			cp->marks_cnt++;
	}
	return st;
}

/* Dispatch: token rows stay where they are (CUDA) or are copied into the rank's pinned staging
 * (host memory, which kernels read mapped); top-k ids and weights must be host-readable for the
 * records pass and the record headers: CUDA ones are copied down (a few bytes per token). CUDA
 * ids are counted on their GPU first, and the last rank's stage sends the count rows home ahead
 * of its ids (behind them with RAILWAVE_CUDA_MOVER=check, which counts on the host too). */
rw_status_t cm_stage_dispatch(cm_pair_t *cp, rw_svc_phase_t *ph, uint32_t g, int *pending_p,
				  char *why)
{
	cuda_mover_t *m = cp->m;
	rw_svc_rank_io_t *io = &ph->io[0][g];
	const uint64_t n = io->n_tokens;
	const uint64_t len[3] = { n * ph->row_bytes, n * ph->topk * 4, n * ph->topk * 4 };
	const uint8_t *host[3] = { NULL, NULL, NULL };
	uint64_t need = 0;
	/* (host-memory ids are copied too: the rank's routing is read once, docs/security.md) */
	for (int i = 0; i < 3; i++)
		if (((i == 0) != (io->in[i].dev >= 0) || (i == 1 && io->in[1].dev < 0)) && len[i])
			need += (len[i] + 63) & ~(uint64_t)63;
	/* The last rank to stage brings the count rows home: room for them after its inputs. */
	const int last = !(cp->d_staged >> g & 1) &&
			 (cp->d_staged | 1u << g) == (uint32_t)((1ull << ph->gpus) - 1);
	cp->d_staged |= 1u << g;
	const uint32_t cdevs = cp->cnt_devs | (io->in[1].dev >= 0 && len[1] ? 1u << io->in[1].dev : 0);
	const uint64_t rows_at = need;
	if (last && !cp->cnt_off && cdevs)
		need += (uint64_t)__builtin_popcount(cdevs) *
			((((uint64_t)ph->nodes * ph->rails + ph->gpus) * 4 + 63) & ~(uint64_t)63);
	rw_status_t st = RW_OK;
	rw_svc_pinned_t *stage = ph->stage_in[g];
	if (need)
		st = rw_svc_pinned_reserve(stage, need);
	uint64_t off = 0;
	uint32_t devs = 0;
	for (int i = 0; i < 3 && st == RW_OK; i++) {
		const rw_svc_span_mem_t *s = &io->in[i];
		if (!cm_span_dev_ok(m, s)) {
			snprintf(why, RW_SVC_WHY_MAX, "local rank %u's buffer is on GPU %d, which has no "
				 "kernels", g, s->dev);
			return RW_ERR_DEVICE;
		}
		if (i == 0) {
			if (s->dev >= 0) {
				cp->tok[g] = s->dptr;
			} else if (len[0]) {
				uint8_t *dst = (uint8_t *)stage->ptr + off;
				memcpy(dst, s->host, len[0]);
				cp->tok[g] = cm_hptr(dst);
				off += (len[0] + 63) & ~(uint64_t)63;
			}
			host[0] = s->host;
		} else if (s->dev >= 0 && len[i]) {
			rw_cuda_stream_t *str;
			uint8_t *dst = (uint8_t *)stage->ptr + off;
			st = cm_pair_stream(cp, s->dev, &str);
			if (st == RW_OK && i == 1)
				count_launch(cp, ph, g, s, str);
			if (st == RW_OK && i == 1 && last && !m->check)
				st = count_rows(cp, ph, (uint8_t *)stage->ptr + rows_at);
			if (st == RW_OK)
				st = rw_cuda_copy_dtoh_async(str, dst, s->dptr, len[i]);
			host[i] = dst;
			off += (len[i] + 63) & ~(uint64_t)63;
			devs |= 1u << s->dev;
		} else if (i == 1 && len[1]) {
			/* Host-memory ids: the count, the records and the headers all read this copy,
			 * never the rank's memory, which it may rewrite after submitting. */
			uint8_t *dst = (uint8_t *)stage->ptr + off;
			memcpy(dst, s->host, len[1]);
			host[i] = dst;
			off += (len[1] + 63) & ~(uint64_t)63;
		} else {
			host[i] = s->host;
		}
	}
	if (st == RW_OK && last)
		st = count_rows(cp, ph, (uint8_t *)stage->ptr + rows_at);
	*pending_p = 0;
	for (int d = 0; d < CM_DEVICES && st == RW_OK; d++)
		if (devs & (1u << d)) {
			st = cm_pair_mark(cp, d, OP_STAGE_D, g);
			if (st == RW_OK)
				cp->marks_d[g]++;
		}
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "cannot stage local rank %u's top-k ids: %s", g,
			 rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	*pending_p = cp->marks_d[g] != 0;
	io->tokens = host[0];
	io->ids = (const int32_t *)(const void *)host[1];
	io->weights = (const float *)(const void *)host[2];
	return RW_OK;
}

/* The combine slabs' record headers, written by the CPU once the slab kernels are done (see
 * cm_dispatch_headers); a record no local rank computed (never: each went to one) gets a zero row. */
void cm_combine_headers(cm_pair_t *cp, const rw_svc_phase_t *ph, int gpu)
{
	const rw_svc_layout_t *l = ph->layout;
	for (uint32_t d = 0; d < ph->nodes; d++)
		for (uint32_t r = 0; r < ph->rails; r++) {
			size_t i = (size_t)d * ph->rails + r;
			if ((ph->slab_dev[r] >= 0) != gpu)
				continue;
			for (uint32_t k = 0; k < l->in_quota[i]; k++) {
				uint32_t pos = l->in_first[i] + k, ref = ph->rail_base[r] + pos, n = 0;
				uint8_t *dst = ph->send_area[1][r] + (uint64_t)pos * ph->crec_size;
				rw_wire_crec_hdr_t h = { .tag = ph->tag_to[d], .src_node = ph->me, .rail = r,
							 .slot = k };
				rw_wire_crec_pack(dst, &h);
				for (uint32_t g = 0; g < ph->gpus; g++)
					n += cp->rank_out.contrib[(size_t)ref * ph->gpus + g] != 0;
				if (!n)
					memset(dst + RW_WIRE_CREC_HDR, 0, ph->row_bytes);
			}
		}
}

/* Combine: rows stay on the GPU (CUDA) or are copied into pinned staging (host memory). Once
 * every local rank is in, one launch per device writes every return slab and folds the
 * local-node records into the owners' sums; the ranks count as staged when those kernels are
 * done, so pack() has nothing left to do. */
rw_status_t cm_stage_combine(cm_pair_t *cp, rw_svc_phase_t *ph, uint32_t g, int *pending_p,
				 char *why)
{
	rw_svc_rank_io_t *io = &ph->io[1][g];
	const rw_svc_span_mem_t *s = &io->in[0];
	const uint64_t len = (uint64_t)cp->rank_out.n[g] * ph->row_bytes;
	if (!cm_span_dev_ok(cp->m, s)) {
		snprintf(why, RW_SVC_WHY_MAX, "local rank %u's combine rows are on GPU %d, which has no "
			 "kernels", g, s->dev);
		return RW_ERR_DEVICE;
	}
	if (s->dev >= 0) {
		cp->crow[g] = s->dptr;
	} else if (len) {
		rw_svc_pinned_t *stage = ph->stage_in[g];
		if (rw_svc_pinned_reserve(stage, len) != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "out of pinned memory for local rank %u's rows", g);
			return RW_ERR_NOMEM;
		}
		memcpy(stage->ptr, s->host, len);
		cp->crow[g] = cm_hptr(stage->ptr);
	}
	io->tokens = s->host;
	cp->c_staged |= 1u << g;
	*pending_p = 1;
	if (cp->c_staged != (uint32_t)((1ull << ph->gpus) - 1))
		return RW_OK;
	return cm_combine_launch(cp, ph, why);
}




/* RAILWAVE_CUDA_MOVER=check: read `n` bytes at a kernel-visible address from the CPU: a mapped
 * slab area through its host mapping, device memory by a blocking copy, anything else (pinned
 * host memory, whose device address is its host address) in place. */
void cm_check_read(cm_pair_t *cp, int dev, uint64_t addr, uint8_t *buf, size_t n)
{
	cuda_mover_t *m = cp->m;
	for (uint32_t i = 0; i < m->n_reg; i++)
		if (addr >= m->reg[i].dptr && addr + n <= m->reg[i].dptr + m->reg[i].bytes) {
			memcpy(buf, m->reg[i].base + (addr - m->reg[i].dptr), n);
			return;
		}
	if (rw_cuda_memcpy_dtoh(dev, buf, addr, n) != RW_OK)
		memcpy(buf, (const void *)(uintptr_t)addr, n);
}

/* Compare entries [from, to) of a copy list with their sources (after waiting for `dev`). */
void cm_check_copies(cm_pair_t *cp, const rw_svc_phase_t *ph, const cm_list_t *l, int dev,
			 uint32_t from, uint32_t to, const char *what)
{
	uint8_t a[4096], b[4096];
	uint32_t bad = 0, first = 0, at = 0;
	const size_t rb = ph->row_bytes;
	rw_cuda_stream_t *s; /* a test hook's wait (bring-up only), never on a stalled GPU */
	if (dev >= 0 && dev < CM_DEVICES && rw_svc_stage_stream(cp->m->st, dev, &s) == RW_OK)
		rw_cuda_stream_sync(s);
	for (uint32_t i = from; i < to; i++)
		for (size_t off = 0; off < rb; off += sizeof(a)) {
			size_t n = RW_MIN(sizeof(a), rb - off);
			cm_check_read(cp, dev, l->copy[i].src + off, a, n);
			cm_check_read(cp, dev, l->copy[i].dst + off, b, n);
			if (memcmp(a, b, n) != 0) {
				if (!bad++) {
					first = i;
					while (a[at] == b[at])
						at++;
					at += (uint32_t)off;
				}
				break;
			}
		}
	if (bad)
		rw_err("cuda mover check: pair %u %s on GPU %d: %u of %u rows differ from their source "
		       "(first: entry %u at byte %u, src 0x%llx dst 0x%llx)", cp->serial, what, dev, bad,
		       to - from, first, at, (unsigned long long)l->copy[first].src,
		       (unsigned long long)l->copy[first].dst);
	else
		rw_info("cuda mover check: pair %u %s on GPU %d: %u rows equal their source", cp->serial,
			what, dev, to - from);
}

/* Launch what device `dev`'s list holds beyond what was launched. kind: 0 copy, 1 sums (the
 * combine slabs', the owners'), each rounded once into the phase dtype. */
rw_status_t cm_list_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, cm_list_t *l, int dev,
			       int kind)
{
	if (l->n == l->launched)
		return RW_OK;
	rw_cuda_stream_t *s;
	rw_status_t st = cm_pair_stream(cp, dev, &s);
	const uint32_t n = l->n - l->launched, from = l->launched;
	const int aligned = (l->addr_bits & 15) == 0;
	const rw_cuda_dtype_t dt = ph->dtype == RW_WIRE_BF16 ? RW_CUDA_BF16 : RW_CUDA_FP32;
	if (st == RW_OK && kind == 0)
		st = rw_cuda_copy_rows(s, cm_hptr(l->copy + l->launched), n,
				       l->row ? l->row : (uint32_t)ph->row_bytes, aligned);
	else if (st == RW_OK)
		st = rw_cuda_rows_sum(s, cm_hptr(l->sum + l->launched), cm_hptr(l->src), n, ph->hidden, dt,
				      aligned);
	l->launched = l->n;
	l->addr_bits = 0;
	if (st == RW_OK && kind == 0 && cp->m->check && !l->row)
		cm_check_copies(cp, ph, l, dev, from, l->n, l == &cp->pack ? "dispatch pack" : "forward");
	return st;
}


/* Every row list of the pair, in one pinned buffer the kernels read mapped: the dispatch slabs'
 * rows (one per record), the combine slabs' sums (one per received record, up to G rows each),
 * and per device the forwards (each record at most once per rank there) and the owner sums
 * (one per owner token there: a zero row, its local ranks' rows, its returned records' rows). */
void cm_lists_carve(cm_pair_t *cp, const rw_svc_phase_t *ph, uint8_t *base, size_t *off,
			const uint32_t *ranks_on, const uint32_t *recs_on, const uint32_t *local_on,
			const uint32_t *own_on)
{
	const uint32_t G = ph->gpus;
	cm_list_carve(&cp->pack, base, off, ph->row_off[(size_t)ph->nodes * ph->rails], 0, 0);
	cm_list_carve(&cp->cslab, base, off, ph->n_in, ph->n_in * G, 1);
	cm_slab_carve(cp, ph, base, off);
	for (int d = 0; d < CM_DEVICES; d++) {
		if (!ranks_on[d] && !recs_on[d] && !local_on[d] && !own_on[d])
			continue;
		cm_list_carve(&cp->fwd[d], base, off, cp->n_total * ranks_on[d], 0, 0);
		cm_list_carve(&cp->sums[d], base, off, own_on[d],
			   own_on[d] + recs_on[d] + local_on[d] * G, 1);
	}
}

/* Forward one record to every local rank hosting one of its experts: the CPU writes its
 * metadata and counts, the row is listed for rank g's device (src: the record's row in the
 * mapped receive area, or the owner's token row). -1: a rank's output is full. */
int cm_forward_one(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t ref, uint32_t src_node,
		       uint32_t src_rank, uint32_t token, const int32_t *ids, const float *weights,
		       rw_cuda_dptr_t row)
{
	uint32_t rows[RW_MAX_GPUS];
	int64_t to = rw_svc_rank_out_add(&cp->rank_out, ph, ref, src_node, src_rank, token, ids,
					 weights, rows);
	if (to < 0)
		return -1;
	for (uint32_t g = 0; g < ph->gpus; g++)
		if (to & (1u << g))
			cm_list_copy(&cp->fwd[cp->xdev[g]], row,
				     cp->rows_d[g] + (uint64_t)rows[g] * ph->row_bytes);
	return 0;
}

rw_status_t cm_launch_all(cm_pair_t *cp, const rw_svc_phase_t *ph, int sums, char *why)
{
	for (int d = 0; d < CM_DEVICES; d++) {
		rw_status_t st = cm_list_launch(cp, ph, sums ? &cp->sums[d] : &cp->fwd[d], d, !!sums);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot launch a %s kernel on GPU %d: %s",
				 sums ? "combine" : "forward", d, rw_status_str(st));
			return RW_ERR_DEVICE;
		}
	}
	return RW_OK;
}

/* Records [done, upto) of a dispatch range (all of it once complete, a prefix while it
 * arrives): headers validated on the CPU (as the host mover does), rows scattered by the
 * kernels. From a slab on a GPU, once its headers are pulled into the shadow
 * (mover_cuda_slab.c). */
rw_status_t cm_forward_range(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t src,
				 uint32_t rail, uint32_t upto, char *why)
{
	upto = RW_MIN(upto, ph->layout->in_quota[(size_t)src * ph->rails + rail]);
	if (ph->slab_dev[rail] >= 0)
		return cm_slab_pull(cp, ph, 0, src, rail, upto, why);
	return cm_forward_take(cp, ph, src, rail, upto, why);
}

rw_status_t cm_forward_take(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t src,
				uint32_t rail, uint32_t upto, char *why)
{
	const rw_svc_layout_t *l = ph->layout;
	size_t i = (size_t)src * ph->rails + rail;
	uint32_t first = l->in_first[i];
	int32_t ids[RW_MAX_TOPK];
	float w[RW_MAX_TOPK];
	const uint64_t row_off = rw_wire_rec_row_off(ph->topk);
	uint32_t *done = &cp->rx_done[0][i];
	upto = RW_MIN(upto, l->in_quota[i]);
	if (*done >= upto)
		return RW_OK;
	for (uint32_t k = *done; k < upto; k++) {
		const uint64_t pos = ((uint64_t)first + k) * ph->rec_size;
		const uint8_t *rec = ph->recv_area[0][rail] + pos;
		rw_wire_rec_hdr_t h;
		rw_status_t st = rw_svc_mover_rec_read(ph, rec, src, rail, k, &h, ids, w, why);
		if (st != RW_OK)
			return st;
		if (cm_forward_one(cp, ph, ph->rail_base[rail] + first + k, src, src * ph->gpus + h.owner,
				h.token, ids, w, cp->recv_d[0][rail] + pos + row_off) < 0) {
			snprintf(why, RW_SVC_WHY_MAX, "a local rank's dispatch output is full");
			return RW_ERR_SUB_SPACE;
		}
	}
	*done = upto;
	return cm_launch_all(cp, ph, 0, why);
}

/* Up to `budget` local-node records listed per call; launched when all are (or with the next
 * arrived range). */
rw_status_t cm_forward_local(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t budget,
				 int *done_p, char *why)
{
	for (; cp->bg_i < cp->n_local && budget; cp->bg_i++, budget--) {
		uint32_t g = cp->local_ref[2 * cp->bg_i], t = cp->local_ref[2 * cp->bg_i + 1];
		const rw_svc_rank_io_t *io = &ph->io[0][g];
		if (cm_forward_one(cp, ph, ph->n_in + cp->bg_i, ph->me, ph->me * ph->gpus + g, t,
				io->ids + (size_t)t * ph->topk, io->weights + (size_t)t * ph->topk,
				cp->tok[g] + (uint64_t)t * ph->row_bytes) < 0) {
			snprintf(why, RW_SVC_WHY_MAX, "a local rank's dispatch output is full");
			return RW_ERR_SUB_SPACE;
		}
	}
	*done_p = cp->bg_i >= cp->n_local;
	return *done_p ? cm_launch_all(cp, ph, 0, why) : RW_OK;
}

/* Owner token t of local rank g, every term in: one sum on its rank's device, into its output
 * row — the device's zero row (the kernel loads its first row: the sum then starts at +0, as the
 * definition does; a token with no term gets the zeros), then its terms in the fixed order
 * (rw_svc_owner_terms). Launched with the list. */
static void owner_list(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t g, uint32_t t)
{
	const uint32_t u = cp->own.base[g] + t;
	if (cp->own.done[u])
		return;
	const uint32_t n = rw_svc_owner_terms(&cp->own, ph, &cp->rank_out, u, cp->crow, cp->back_at,
					      cp->terms);
	cm_list_t *sl = &cp->sums[cp->xdev[g]];
	cm_list_sum(sl, cp->c_out[g] + (uint64_t)t * ph->row_bytes);
	cm_list_src(sl, cp->m->blk[cp->zero_blk[cp->xdev[g]] - 1].ptr);
	for (uint32_t k = 0; k < n; k++)
		cm_list_src(sl, cp->terms[k]);
	cp->own.done[u] = 1;
}

/* Every return slab, once every rank's combine rows are in: a record one local rank computed
 * goes back as that rank's row as it is; several: their fp32 sum in rank order, rounded once
 * (the host mover's combine_pack). One mark per device used; the ranks are reported staged when
 * all are done. Then the owner tokens whose terms are all in are summed (the others when their
 * last row comes back), after the marks: the posts need not wait for them. */
rw_status_t cm_combine_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why)
{
	const rw_svc_layout_t *l = ph->layout;
	const uint32_t G = ph->gpus;
	cm_list_t *cs = &cp->cslab;
	uint32_t marks_on = 0;
	if (cm_slab_any(ph)) /* GPU slabs: headers into the shadow now, copied below */
		cm_combine_headers(cp, ph, 1);
	for (int dev = 0; dev < CM_DEVICES; dev++) {
		for (uint32_t d = 0; d < ph->nodes; d++)
			for (uint32_t r = 0; r < ph->rails; r++) {
				size_t i = (size_t)d * ph->rails + r;
				for (uint32_t k = 0; k < l->in_quota[i]; k++) {
					uint32_t pos = l->in_first[i] + k, ref = ph->rail_base[r] + pos;
					const uint32_t *c = &cp->rank_out.contrib[(size_t)ref * G];
					const uint64_t at = (uint64_t)pos * ph->crec_size;
					if (ph->slab_dev[r] == dev)
						cm_list_copy(&cp->cs_hl, cp->sh_send_d[1][r] + at, cp->send_d[1][r] + at);
					uint32_t g0 = 0;
					while (g0 < G && !c[g0])
						g0++;
					if (g0 == G) /* never: every received record went to a local rank */
						continue;   /* (cm_combine_headers zeroes its row) */
					if (cp->xdev[g0] != dev)
						continue;
					cm_list_sum(cs, cp->send_d[1][r] + (uint64_t)pos * ph->crec_size +
						 RW_WIRE_CREC_HDR);
					for (uint32_t g = g0; g < G; g++)
						if (c[g])
							cm_list_src(cs, cp->crow[g] + (uint64_t)(c[g] - 1) * ph->row_bytes);
				}
			}
		if (cs->n > cs->launched || cp->cs_hl.n > cp->cs_hl.launched)
			marks_on |= 1u << dev;
		rw_status_t st = cm_list_launch(cp, ph, cs, dev, 1);
		if (st == RW_OK)
			st = cm_list_launch(cp, ph, &cp->cs_hl, dev, 0);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot launch the combine pack on GPU %d: %s", dev,
				 rw_status_str(st));
			return RW_ERR_DEVICE;
		}
	}
	marks_on |= 1u << cp->home; /* at least one mark, so the reports come */
	for (int d = 0; d < CM_DEVICES; d++)
		if (marks_on & (1u << d)) {
			rw_status_t st = cm_pair_mark(cp, d, OP_STAGE_C, 0);
			if (st != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "cannot mark GPU %d's combine work: %s", d,
					 rw_status_str(st));
				return RW_ERR_DEVICE;
			}
			cp->marks_c++;
		}
	for (uint32_t g = 0; g < G; g++) { /* the owners' rows: their outputs, or their staging */
		const rw_svc_rank_io_t *io = &ph->io[1][g];
		const uint64_t n = ph->rt[g].n_tokens;
		cp->c_out[g] = io->out.dptr;
		if (n == 0 || io->out.dev >= 0)
			continue;
		if (rw_svc_pinned_reserve(ph->stage_out[g], n * ph->row_bytes) != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "out of pinned memory for local rank %u's combined "
				 "rows", g);
			return RW_ERR_NOMEM;
		}
		cp->c_out[g] = cm_hptr(ph->stage_out[g]->ptr);
	}
	cp->c_ready = 1;
	for (uint32_t g = 0; g < G; g++)
		for (uint32_t t = 0; t < ph->rt[g].n_tokens; t++)
			if (!cp->own.left[cp->own.base[g] + t])
				owner_list(cp, ph, g, t);
	return cm_launch_all(cp, ph, 1, why);
}

/* Records [done, upto) of a combine range from `d` on egress rail `e` (all of it once
 * complete, a prefix while it arrives): headers checked on the CPU, where each row is noted; a
 * token whose last row this was is summed by a kernel on its owner's device (once every rank's
 * combine rows are in; else at the combine launch). From a slab on a GPU, once its headers are
 * pulled into the shadow (mover_cuda_slab.c). */
rw_status_t cm_combine_range(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t d, uint32_t e,
				 uint32_t upto, char *why)
{
	upto = RW_MIN(upto, ph->layout->out_pairs[d].quota[e]);
	if (ph->slab_dev[e] >= 0)
		return cm_slab_pull(cp, ph, 1, d, e, upto, why);
	return cm_combine_take(cp, ph, d, e, upto, why);
}

rw_status_t cm_combine_take(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t d, uint32_t e,
				uint32_t upto, char *why)
{
	const rw_svc_layout_t *l = ph->layout;
	const rw_pair_plan_t *pp = &l->out_pairs[d];
	uint32_t first = l->out_first[d * ph->rails + e];
	uint32_t *done = &cp->rx_done[1][(size_t)d * ph->rails + e];
	upto = RW_MIN(upto, pp->quota[e]);
	if (*done >= upto)
		return RW_OK;
	for (uint32_t k = *done; k < upto; k++) {
		const uint64_t pos = ((uint64_t)first + k) * ph->crec_size;
		const rw_record_t *r;
		rw_status_t st = rw_svc_mover_crec_read(ph, ph->recv_area[1][e] + pos, d, e, k, &r, why);
		if (st != RW_OK)
			return st;
		const uint32_t j = (uint32_t)(r - ph->rec);
		uint32_t u;
		cp->back_at[j] = cp->recv_d[1][e] + pos + RW_WIRE_CREC_HDR;
		if (rw_svc_owner_back(&cp->own, ph, j, &u) && cp->c_ready)
			owner_list(cp, ph, r->rank, r->token);
	}
	*done = upto;
	return cm_launch_all(cp, ph, 1, why);
}

/* Host-memory ranks' outputs leave their pinned staging once the kernels that wrote it are done
 * (mark_done); CUDA ranks get the CPU-written counts and metadata by async copies. */
void cm_host_copy_out(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind, uint32_t g)
{
	const rw_svc_rank_io_t *io = &ph->io[kind][g];
	if (!io->out.host)
		return;
	if (kind == 1) {
		memcpy(io->out.host, ph->stage_out[g]->ptr, (size_t)ph->rt[g].n_tokens * ph->row_bytes);
		return;
	}
	const rw_svc_out_layout_t *o = &cp->rank_out.layout[g];
	uint64_t n = cp->rank_out.n[g];
	if (ph->n_experts > RW_CQE_INLINE_COUNTS)
		memcpy(io->out.host + o->counts_off, cp->counts_st[g], 4ull * ph->n_experts);
	memcpy(io->out.host + o->rows_off, cp->rows_st[g], n * ph->row_bytes);
	memcpy(io->out.host + o->meta_off, cp->rank_out.meta[g], n * o->meta_bytes);
}

/* Kernels on `dev`: loaded once per device; a device without them is said once. */
int cm_dev_kernels(cuda_mover_t *m, int dev)
{
	if (dev < 0 || dev >= CM_DEVICES)
		return 0;
	int *k = &m->kernels[dev];
	if (*k == 0) {
		*k = rw_cuda_kernels_available(dev) ? 1 : -1;
		if (*k < 0)
			rw_info("cuda mover: no kernels on device %d: the host mover stages its ranks", dev);
		else
			rw_info("cuda mover: kernels loaded on device %d: its ranks' bytes move on the GPU",
				dev);
	}
	return *k > 0;
}
