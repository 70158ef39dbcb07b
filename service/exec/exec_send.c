/* Sending a phase (docs/dataflow.md "Send"): the writes of each (destination, rail) slab, all
 * destinations at once on the non-waved paths, one destination per permutation wave on the
 * waved ones; the next wave starts when this one's writes are all done and, under the receiver
 * gate, when its destination has granted it. Also the gate's arithmetic, which the receive
 * side shares: every node computes the same answers from the count matrix. */
#include <string.h>

#include "service/exec/exec_int.h"

int exec_gated(const exec_pair_t *p)
{
	return rw_path_waved(p->plan.path) && p->x->nodes > 2;
}

/* Records of `kind` that node src writes to node dst in this pair, from the count matrix
 * (rail-independent, so the same on every node): dispatch carries src's records for dst, and
 * combine returns dst's records that src hosted. */
static uint64_t pair_flow(const exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src,
			  uint32_t dst)
{
	const exec_t *x = p->x;
	size_t nr = (size_t)x->nodes * x->rails;
	const int back = exec_kind_desc(kind)->returns;
	uint32_t a = back ? dst : src, b = back ? src : dst;
	uint64_t t = 0;
	for (uint32_t r = 0; r < x->rails; r++)
		t += p->xchg.counts[a * nr + (size_t)b * x->rails + r];
	return t;
}

/* Whether node s must wait for d = (s + k) mod N to grant wave k: it has data for d, and some
 * earlier wave brings d data (if none does, d would grant at once: the round is skipped). */
int exec_needs_grant(const exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t k, uint32_t s)
{
	uint32_t n = p->x->nodes, d = (s + k) % n;
	if (k < 2 || !pair_flow(p, kind, s, d))
		return 0;
	for (uint32_t j = 1; j < k; j++)
		if (pair_flow(p, kind, (d + n - j) % n, d))
			return 1;
	return 0;
}

void exec_send_begin(exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	p->send.kind = kind;
	if (p->send.state != SEND_IDLE) /* the dispatch's sender is DONE */
		exec_send_move(p, SEND_IDLE);
	p->send.wave = p->send.pending = p->send.waves_posted = 0;
}

/* d's slabs of `kind`, packed once, just before d's wave is posted: later waves' packing
 * overlaps earlier waves' sending. RW_ERR_AGAIN: the mover writes them asynchronously and
 * reports RW_MV_OP_PACKED; pack() is asked again then. */
static rw_status_t pack_dst(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t d)
{
	if (p->send.packed[kind][d])
		return RW_OK;
	char why[RW_SVC_WHY_MAX];
	rw_status_t st = p->mv->pack(p->mv_mover, p->mv_state, &p->ph, kind, d, why);
	if (st == RW_ERR_AGAIN)
		return st;
	p->send.packed[kind][d] = 1;
	return st == RW_OK ? RW_OK : exec_err(p, st, "%s", why);
}

/* A group on one node posts no wave, but its pack step runs as a wave's does, for the node's own
 * records (d = me): a wave of no writes. The mover's wait for them (a page rank's `packed`) and
 * its checks are the same step, resumed the same way (WAIT_PACK), and the local work starts
 * only once the sender is DONE. */
static rw_status_t pack_alone(exec_pair_t *p)
{
	exec_send_move(p, SEND_POSTING);
	rw_status_t st = pack_dst(p, p->send.kind, p->x->me);
	if (st == RW_ERR_AGAIN)
		return exec_send_move(p, SEND_WAIT_PACK);
	if (st != RW_OK)
		return p->err.st;
	exec_send_move(p, SEND_DRAINING);
	return exec_send_move(p, SEND_DONE);
}

/* The largest write on rail r. */
static uint64_t write_chunk(const exec_pair_t *p, uint32_t r)
{
	const uint64_t dev_max = rw_svc_mesh_max_write(p->x->mesh, r); /* 0: no limit said */
	uint64_t chunk = dev_max ? RW_MIN((uint64_t)EXEC_CHUNK_MAX, dev_max) : EXEC_CHUNK_MAX;
	return p->x->hooks.chunk_bytes ? RW_MIN(chunk, p->x->hooks.chunk_bytes) : chunk;
}

/* Bytes of d's slab of `kind` on rail r. */
static uint64_t slab_len(const exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t d, uint32_t r)
{
	const struct exec_flow *f = &p->flow[kind];
	return (uint64_t)f->send_quota[(size_t)d * p->x->rails + r] * f->rec;
}

/* Post the slab writes of the wave being posted, from the cursor on: per destination, rounds
 * of one write per rail (write c of every rail, then c + 1), so every rail starts at once and a
 * mover that packs in pieces (ready()) has the first piece of each on the wire while it writes
 * the next. RW_OK with state PACED when the write-gap hook's budget ran out, WAIT_PACK when the
 * next write's bytes are not written yet. */
static rw_status_t post_wave(exec_pair_t *p, int *budget)
{
	exec_t *x = p->x;
	const rw_svc_phase_kind_t kind = p->send.kind;
	const struct exec_flow *f = &p->flow[kind];
	const exec_kind_desc_t *kd = exec_kind_desc(kind);
	const uint64_t rsz = f->rec;
	for (; p->send.cur_k <= p->send.k_hi; p->send.cur_k++, p->send.cur_c = 0, p->send.cur_r = 0) {
		uint32_t d = rw_sched_wave_dst(x->nodes, x->me, p->send.cur_k);
		rw_status_t pst = pack_dst(p, kind, d);
		if (pst == RW_ERR_AGAIN) {
			exec_send_move(p, SEND_WAIT_PACK);
			return RW_OK;
		}
		if (pst != RW_OK)
			return p->err.st;
		if (p->send.rounds_k != p->send.cur_k) { /* once per destination, not per resume */
			p->send.rounds_k = p->send.cur_k;
			p->send.rounds = 0;
			for (uint32_t r = 0; r < x->rails; r++) {
				uint64_t len = slab_len(p, kind, d, r), chunk = write_chunk(p, r);
				p->send.rounds = RW_MAX(p->send.rounds, (len + chunk - 1) / chunk);
				p->send.wave_slab_max = RW_MAX(p->send.wave_slab_max, len);
			}
		}
		for (; p->send.cur_c < p->send.rounds; p->send.cur_c++, p->send.cur_r = 0)
			for (; p->send.cur_r < x->rails; p->send.cur_r++) {
				uint32_t r = p->send.cur_r;
				size_t i = (size_t)d * x->rails + r;
				uint64_t len = slab_len(p, kind, d, r), chunk = write_chunk(p, r);
				uint64_t off = p->send.cur_c * chunk;
				if (off >= len)
					continue;
				uint64_t n = RW_MIN(chunk, len - off);
				if (p->mv->ready && off + n > p->mv->ready(p->mv_mover, p->mv_state, &p->ph,
									   kind, d, r, off + n)) {
					x->svc->metrics.tx_piece_waits++;
					exec_send_move(p, SEND_WAIT_PACK);
					return RW_OK;
				}
				if (*budget == 0) {
					exec_send_move(p, SEND_PACED);
					return RW_OK;
				}
				uint64_t local = exec_sub_off(x, p->xchg.slot, kd->sub_send) +
						 (uint64_t)f->send_first[i] * rsz;
				uint64_t remote = exec_sub_off(x, (int)p->xchg.peer_slot[d], kd->sub_recv) +
						  (uint64_t)f->peer_first[i] * rsz;
				uint32_t imm = rw_wire_imm_pack(p->xchg.tag_to[d], (uint32_t)kind, off + n == len,
								x->me, r);
				rw_status_t st = rw_svc_mesh_write(x->mesh, d, r, local + off, remote + off, n,
								   imm, p);
				if (st != RW_OK)
					return exec_err(p, RW_ERR_PEER, "cannot write to node %u (%s) rail %u: %s",
							d, x->svc->cfg.nodes[d].name, r, rw_status_str(st));
				p->outstanding++;
				p->send.pending++;
				rw_svc_metrics_tx(&x->svc->metrics, r, n,
						  off + n == len ? (uint32_t)(len / rsz) : 0, 0);
				EXEC_TRACE(p, exec_trace_tx_(p, r, n));
				if (*budget > 0)
					(*budget)--;
			}
	}
	return RW_OK;
}

rw_status_t exec_send_progress(exec_pair_t *p)
{
	exec_t *x = p->x;
	const rw_svc_phase_kind_t kind = p->send.kind;
	const int waved = exec_gated(p);
	int budget = x->hooks.write_gap_s > 0 ? 1 : -1; /* writes we may post now; -1: all */
	if (x->nodes == 1)
		return pack_alone(p);
	for (;;) {
		if (p->send.state != SEND_PACED && p->send.state != SEND_WAIT_PACK) {
			/* Start the next wave, if there is one and we may. */
			if (!waved) {
				if (p->send.wave > 0)
					break;
				p->send.cur_k = 1;
				p->send.k_hi = x->nodes - 1;
			} else {
				if (p->send.wave >= x->nodes - 1)
					break;
				if (exec_needs_grant(p, kind, p->send.wave + 1, x->me) &&
				    !p->send.granted[kind][p->send.wave + 1]) {
					exec_send_move(p, SEND_WAIT_GRANT);
					EXEC_TRACE(p, exec_trace_grant_wait_(p, kind, p->send.wave + 1));
					return RW_OK;
				}
				p->send.cur_k = p->send.k_hi = p->send.wave + 1;
			}
			p->send.wave++;
			PTRACE(p, "post wave %u", p->send.wave);
			EXEC_TRACE(p, exec_trace_wave_post_(p));
			p->send.wave_t0 = rw_now_ns();
			p->send.wave_slab_max = 0;
			p->send.rounds_k = 0; /* destinations are counted from 1 */
			p->send.cur_r = 0;
			p->send.cur_c = 0;
		}
		exec_send_move(p, SEND_POSTING);
		if (post_wave(p, &budget) != RW_OK)
			return p->err.st;
		if (p->send.state == SEND_PACED || p->send.state == SEND_WAIT_PACK)
			return RW_OK;
		exec_send_move(p, SEND_DRAINING);
		p->send.waves_posted++;
		/* While these writes drain: pack the next wave's slabs. */
		if (waved && p->send.wave + 1 < x->nodes &&
		    pack_dst(p, kind, rw_sched_wave_dst(x->nodes, x->me, p->send.wave + 1)) != RW_OK &&
		    p->err.st != RW_OK)
			return p->err.st; /* RW_ERR_AGAIN: asked again when that wave is posted */
		if (p->send.pending)
			return RW_OK; /* the next wave starts when these writes are done */
	}
	exec_send_move(p, SEND_DONE);
	return RW_OK;
}
