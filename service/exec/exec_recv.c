/* Receiving a phase (docs/dataflow.md "Receive and forward", "Send"): bytes arrive per
 * (source, rail) range; a range is complete when its bytes match the counts, and then the mover
 * forwards (dispatch) or reduces (combine) it. Bytes can come before this node knows the layout
 * (a fast peer); they are counted and checked once it does. As a receiver on a gated path this
 * node grants wave k once every earlier wave's data is here, so it has one sender at a time. */
#include <string.h>

#include "service/exec/exec_int.h"

rw_status_t exec_recv_init(exec_pair_t *p)
{
	exec_t *x = p->x;
	size_t n = x->nodes, nr = (size_t)x->nodes * x->rails;
	for (int k = 0; k < RW_SVC_KIND_COUNT; k++) {
		p->recv[k].arrived = rw_arena_alloc(&p->mem, nr, sizeof(uint64_t));
		p->recv[k].at1 = rw_arena_alloc(&p->mem, nr, sizeof(uint64_t));
		p->recv[k].parted = rw_arena_alloc(&p->mem, nr, sizeof(uint32_t));
		p->recv[k].range_done = rw_arena_alloc(&p->mem, nr, 1);
		p->recv[k].src_active = rw_arena_alloc(&p->mem, n, 1);
		p->send.granted[k] = rw_arena_alloc(&p->mem, n, 1);
		p->send.packed[k] = rw_arena_alloc(&p->mem, n, 1);
		p->recv[k].in_lo = 1;
		p->recv[k].grant_hi = 1;
		if (!p->recv[k].arrived || !p->recv[k].at1 || !p->recv[k].parted || !p->recv[k].range_done || !p->recv[k].src_active ||
		    !p->send.granted[k] || !p->send.packed[k])
			return exec_err(p, RW_ERR_NOMEM, "out of memory");
	}
	return RW_OK;
}

/* Records of `kind` that src sends us on rail r under the layout. */
static uint32_t range_quota(const exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src,
			    uint32_t r)
{
	return p->flow[kind].recv_quota[(size_t)src * p->x->rails + r];
}

/* Every range of `kind` from src has arrived (or has nothing to bring). */
static int src_done(const exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src)
{
	for (uint32_t r = 0; r < p->x->rails; r++)
		if (range_quota(p, kind, src, r) && !p->recv[kind].range_done[(size_t)src * p->x->rails + r])
			return 0;
	return 1;
}

/* Grant every wave whose earlier waves have all arrived here. */
static void grant(exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	exec_t *x = p->x;
	uint32_t n = x->nodes;
	if (!exec_gated(p) || !p->plan.have_layout)
		return;
	while (p->recv[kind].in_lo < n && src_done(p, kind, (x->me + n - p->recv[kind].in_lo) % n))
		p->recv[kind].in_lo++;
	for (uint32_t k = p->recv[kind].grant_hi + 1; k <= p->recv[kind].in_lo && k < n; k++) {
		uint32_t s = (x->me + n - k) % n;
		p->recv[kind].grant_hi = k;
		if (!exec_needs_grant(p, kind, k, s))
			continue;
		PTRACE(p, "grant wave %u to node %u", k, s);
		EXEC_TRACE(p, exec_trace_grant_sent_(p, kind, k));
		rw_wire_grant_t gr = { .key = p->key, .kind = (uint32_t)kind, .wave = k };
		uint8_t buf[RW_WIRE_GRANT_SIZE];
		size_t len = rw_wire_grant_pack(&gr, buf, sizeof(buf));
		/* A failed send means s is down: the peer-down event fails the phase. */
		(void)rw_svc_mesh_send(x->mesh, s, RW_WIRE_GRANT, buf, (uint32_t)len);
	}
}

/* Fan-in bookkeeping: src is sending to us (bytes arrived, its ranges not all complete). */
static void src_note(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src, int arrived)
{
	exec_t *x = p->x;
	const int known = p->plan.have_layout;
	if (!exec_gated(p) && known)
		return;
	if (arrived && !p->recv[kind].src_active[src] && !(known && src_done(p, kind, src))) {
		p->recv[kind].src_active[src] = 1;
		p->recv[kind].n_active++;
		if (known && exec_gated(p) && p->recv[kind].n_active > x->svc->metrics.wave_fanin_max)
			x->svc->metrics.wave_fanin_max = p->recv[kind].n_active;
	} else if (!arrived && p->recv[kind].src_active[src] && src_done(p, kind, src)) {
		p->recv[kind].src_active[src] = 0;
		p->recv[kind].n_active--;
	}
}

/* A mover's answer about src's bytes: a bad record blames src — unless the records passed
 * through a group's carve-out, src's send area or our receive area (slots past the shared ones):
 * memory the group's own ranks map and may write while the daemons post and read it
 * (docs/rankpath.md "The slab areas, lent per group"). Then the group's phase fails, told to
 * every node, and no node is dropped, so a bad or racing rank hurts its own job only. Writes
 * that land in the wrong place are the daemon's (it chose the offsets) and are blamed anyway
 * (misplaced). */
static rw_status_t mover_failed(exec_pair_t *p, rw_status_t st, uint32_t src, const char *why)
{
	const int lent = p->xchg.peer_slot[src] >= EXEC_SLOTS || p->xchg.slot >= EXEC_SLOTS;
	if (st == RW_ERR_PROTO && lent)
		exec_err(p, st, "%s (through the group's slabs, which its ranks may write: node %u is "
			 "not dropped)", why, src);
	else
		exec_err(p, st, "%s", why);
	if (st == RW_ERR_PROTO && !lent)
		p->err.blame_peer = (int)src + 1;
	return st;
}

void exec_recv_refused(exec_pair_t *p, uint32_t src, rw_status_t st)
{
	char why[RW_SVC_WHY_MAX];
	snprintf(why, sizeof(why), "the data mover refused %s data from node %u (%s): %s (the "
		 "daemon's log names the record)", rw_svc_kind_name(exec_kind(p)), src,
		 p->x->svc->cfg.nodes[src].name, rw_status_str(st));
	mover_failed(p, st, src, why);
}

static rw_status_t range_complete(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src,
				  uint32_t rail)
{
	char why[RW_SVC_WHY_MAX];
	rw_status_t st = p->mv->arrived(p->mv_mover, p->mv_state, &p->ph, kind, src, rail, why);
	if (st != RW_OK)
		return mover_failed(p, st, src, why);
	p->recv[kind].range_done[(size_t)src * p->x->rails + rail] = 1;
	p->recv[kind].ranges_left--;
	EXEC_TRACE(p, exec_trace_range_done_(p, kind, src, rail));
	PTRACE(p, "range from node %u rail %u complete, %u left", src, rail, p->recv[kind].ranges_left);
	src_note(p, kind, src, 0);
	grant(p, kind);
	return RW_OK;
}

/* A write of src that landed where it was not granted: the pair fails, and src is dropped
 * once it has (the writer is at fault, not the node whose range it hit). */
static rw_status_t misplaced(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src,
			     uint32_t rail, uint64_t at, uint64_t len, uint64_t want)
{
	exec_err(p, RW_ERR_PROTO, "node %u (%s) wrote %llu bytes of %s data at %llu on rail %u, "
		 "where its range is at %llu", src, p->x->svc->cfg.nodes[src].name,
		 (unsigned long long)len, rw_svc_kind_name(kind), (unsigned long long)at, rail,
		 (unsigned long long)want);
	p->err.blame_peer = (int)src + 1;
	return RW_ERR_PROTO;
}

/* Where src's range of `kind` on `rail` starts in the rail's memory, under the layout. */
static uint64_t range_at(const exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src,
			 uint32_t rail)
{
	const size_t i = (size_t)src * p->x->rails + rail;
	return exec_sub_off(p->x, p->xchg.slot, exec_kind_desc(kind)->sub_recv) +
	       (uint64_t)p->flow[kind].recv_first[i] * p->flow[kind].rec;
}

/* One range's bytes against the layout: in place, complete, still coming, or too many. */
static rw_status_t range_check(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src,
			       uint32_t rail, int last)
{
	size_t i = (size_t)src * p->x->rails + rail;
	uint64_t want = (uint64_t)range_quota(p, kind, src, rail) * p->flow[kind].rec;
	uint64_t got = p->recv[kind].arrived[i];
	if (p->recv[kind].at1[i] && p->recv[kind].at1[i] - 1 != range_at(p, kind, src, rail))
		return misplaced(p, kind, src, rail, p->recv[kind].at1[i] - 1, got,
				 range_at(p, kind, src, rail));
	if (got > want || (last && got != want))
		return exec_err(p, RW_ERR_PROTO, "%s data from node %u rail %u: %llu bytes where the counts "
				"say %llu", rw_svc_kind_name(kind), src, rail,
				(unsigned long long)got, (unsigned long long)want);
	if (got == want) {
		p->x->svc->metrics.rail[rail].rx_records += range_quota(p, kind, src, rail);
		return range_complete(p, kind, src, rail);
	}
	/* Not complete: the whole records of the prefix that is here, to a mover that takes them
	 * early (its work overlaps the rest of the range's transfer), when there are new ones. */
	const uint32_t upto = (uint32_t)(got / p->flow[kind].rec);
	if (p->mv->part && upto > p->recv[kind].parted[i]) {
		char why[RW_SVC_WHY_MAX];
		p->recv[kind].parted[i] = upto;
		rw_status_t st = p->mv->part(p->mv_mover, p->mv_state, &p->ph, kind, src, rail, upto,
					     why);
		if (st != RW_OK)
			return mover_failed(p, st, src, why);
		p->x->svc->metrics.rx_prefixes++;
	}
	return RW_OK;
}

rw_status_t exec_recv_begin(exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	exec_t *x = p->x;
	p->recv[kind].ranges_left = 0;
	for (uint32_t s = 0; s < x->nodes; s++)
		for (uint32_t r = 0; r < x->rails; r++) {
			uint32_t q = range_quota(p, kind, s, r);
			p->recv[kind].range_done[(size_t)s * x->rails + r] = q == 0;
			p->recv[kind].ranges_left += q != 0;
		}
	return RW_OK;
}

rw_status_t exec_recv_scan(exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	exec_t *x = p->x;
	for (uint32_t s = 0; s < x->nodes; s++)
		for (uint32_t r = 0; r < x->rails; r++)
			if (!p->recv[kind].range_done[(size_t)s * x->rails + r] &&
			    range_check(p, kind, s, r, 0) != RW_OK)
				return p->err.st;
	return RW_OK;
}

rw_status_t exec_recv_data(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t peer, uint32_t rail,
			   uint64_t len, int last, uint64_t at)
{
	const exec_t *x = p->x;
	size_t i = (size_t)peer * x->rails + rail;
	if (p->recv[kind].range_done[i] && p->plan.have_layout) {
		exec_err(p, RW_ERR_PROTO, "node %u rail %u sent data for a range already complete",
			 peer, rail);
		return RW_ERR_PROTO;
	}
	if (at != EXEC_AT_UNKNOWN) {
		/* In this pair's receive sub-area of the kind, and right after the range's last
		 * write (a range travels in order on its rail's connection). */
		const uint64_t lo = exec_sub_off(x, p->xchg.slot, exec_kind_desc(kind)->sub_recv);
		const uint64_t arrived = p->recv[kind].arrived[i], at1 = p->recv[kind].at1[i];
		const uint64_t want = at1 ? at1 - 1 + arrived : p->plan.have_layout ?
				      range_at(p, kind, peer, rail) : at;
		if (at != want || at < lo || len > lo + exec_sub_bytes(x, (uint32_t)p->xchg.slot) - at)
			return misplaced(p, kind, peer, rail, at, len, want);
		if (!at1 && !arrived)
			p->recv[kind].at1[i] = at + 1;
	}
	p->recv[kind].arrived[i] += len;
	EXEC_TRACE(p, exec_trace_rx_(p, kind, peer, rail, len));
	src_note(p, kind, peer, 1);
	if (!p->plan.have_layout)
		return RW_OK;
	return range_check(p, kind, peer, rail, last);
}

void exec_recv_waiting(const exec_pair_t *p, rw_svc_phase_kind_t kind, char *buf, size_t len)
{
	const exec_t *x = p->x;
	size_t used = 0;
	buf[0] = '\0';
	for (uint32_t s = 0; s < x->nodes && used + 40 < len; s++) {
		if (!p->plan.have_layout || src_done(p, kind, s))
			continue;
		for (uint32_t r = 0; r < x->rails; r++) {
			size_t i = (size_t)s * x->rails + r;
			if (!range_quota(p, kind, s, r) || p->recv[kind].range_done[i])
				continue;
			used += (size_t)snprintf(buf + used, len - used, "%snode %u (%s) rail %u",
						 used ? ", " : "", s, x->svc->cfg.nodes[s].name, r);
			break;
		}
	}
}
