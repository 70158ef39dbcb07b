/* Gather, count exchange and decision (docs/dataflow.md "Gather", "Count exchange (COUNTS)",
 * "Decide"): this node's count row from its ranks' top-k ids, the row sent to every peer, the
 * peers' rows folded into the features as they come, and — once every row is here — the path
 * and the receive layout, which every node derives identically from the same numbers. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "service/exec/exec_int.h"

/* The pair's areas of slot `slot` on every rail (send and receive, per kind): host addresses in
 * the mesh's memory and, where a rail's slabs are GPU memory, their device addresses. */
void exec_areas_set(exec_pair_t *p, int slot)
{
	exec_t *x = p->x;
	for (uint32_t r = 0; r < x->rails; r++) {
		uint64_t dptr = 0;
		const int gpu = rw_svc_mesh_slab_dev(x->mesh, r, &dptr) >= 0; /* no carve-outs then */
		for (int k = 0; k < RW_SVC_KIND_COUNT; k++) {
			const uint64_t send = exec_sub_off(x, slot, exec_kind_desc(k)->sub_send);
			const uint64_t recv = exec_sub_off(x, slot, exec_kind_desc(k)->sub_recv);
			p->ph.send_area[k][r] = rw_svc_mesh_at(x->mesh, r, send);
			p->ph.recv_area[k][r] = rw_svc_mesh_at(x->mesh, r, recv);
			p->ph.send_dptr[k][r] = gpu ? dptr + send : 0;
			p->ph.recv_dptr[k][r] = gpu ? dptr + recv : 0;
		}
		const int carve = slot >= EXEC_SLOTS; /* the group's slabs, lent to its ranks */
		const uint64_t base = carve ? exec_sub_off(x, slot, 0) : 0;
		p->ph.slab[r] = carve ? rw_svc_mesh_at(x->mesh, r, base) : NULL;
		p->ph.local_area[r] = carve ? rw_svc_mesh_at(x->mesh, r, exec_sub_off(x, slot, SUB_LOCAL))
					    : NULL;
		/* a GPU carve-out: its device and the host shadow its headers are pulled into */
		const uint32_t i = (uint32_t)(slot - EXEC_SLOTS);
		p->ph.slab_gpu[r] = carve ? rw_svc_mesh_carve_gpu(x->mesh, i, r, NULL) : -1;
		p->ph.slab_shadow[r] = carve ? rw_svc_mesh_carve_shadow(x->mesh, i, r) : NULL;
	}
	p->ph.slab_bytes = slot >= EXEC_SLOTS ? x->carve_bytes : 0;
}

/* An attempt's epoch: never 0, different for every pair a node opens (a reused key gets a new
 * one), so writes of an earlier attempt cannot be taken for this one's; also the id of a failure
 * refused before any pair existed. */
uint32_t exec_epoch_new(uint64_t salt)
{
	uint64_t h = rw_now_ns() ^ (salt << 32) ^ ((uint64_t)getpid() << 16);
	h ^= h >> 33;
	h *= UINT64_C(0xff51afd7ed558ccd);
	h ^= h >> 33;
	return (uint32_t)h ? (uint32_t)h : 1u;
}

/* Whether writes into this node tagged `tag` (an rw_wire_tag_for) could be taken for another
 * pair's: a write finds its pair by the immediate's 14 bits of it (exec_pair_by_tag), so no two
 * pairs here - open, closed but draining, or ended while a peer may still write with its tag
 * (exec_quiet_tag_t) - may share them. */
static int tag_taken(const exec_t *x, uint32_t tag)
{
	const uint32_t t14 = rw_wire_imm_tag(tag);
	const exec_pair_t *q;
	rw_list_for_each(&x->pairs, q, link)
		if (rw_wire_imm_tag(q->ph.tag_in) == t14)
			return 1;
	const uint64_t now = rw_now_ns();
	for (uint32_t i = 0; i < EXEC_QUIET_TAGS; i++)
		if (x->quiet[i].until > now && x->quiet[i].tag14 == t14)
			return 1;
	return 0;
}

/* The pair's epoch: a fresh one (the test hook's while it offers one) whose tag for writes into
 * this node no other pair here has. At most EXEC_QUIET_TAGS + the pairs here are taken of the
 * 16384 tags, so a draw or two finds one; the bound only guards the loop. */
static uint32_t pair_epoch(const exec_pair_t *p)
{
	const exec_t *x = p->x;
	uint32_t e = 0;
	for (uint32_t tries = 0; tries < 4096; tries++) {
		e = x->hooks.epoch ? x->hooks.epoch(x->hooks.epoch_ctx) : 0;
		if (!e)
			e = exec_epoch_new(p->serial ^ ((uint64_t)tries << 20));
		if (!tag_taken(x, rw_wire_tag_for(p->tag, e)))
			break;
	}
	return e;
}

rw_status_t exec_plan_init(exec_pair_t *p, const rw_sqe_t *sqe)
{
	exec_t *x = p->x;
	rw_svc_phase_t *ph = &p->ph;
	size_t n = x->nodes, nr = (size_t)x->nodes * x->rails;
	ph->serial = p->serial;
	ph->write_max = x->hooks.chunk_bytes ? RW_MIN((uint64_t)EXEC_CHUNK_MAX, x->hooks.chunk_bytes)
					     : EXEC_CHUNK_MAX;
	ph->nodes = x->nodes;
	ph->rails = x->rails;
	ph->gpus = x->gpus;
	ph->me = x->me;
	ph->topk = sqe->topk;
	ph->hidden = sqe->hidden;
	ph->dtype = exec_wire_dtype(sqe->dtype);
	ph->n_experts = sqe->n_experts;
	ph->row_bytes = rw_wire_row_bytes(ph->hidden, ph->dtype);
	ph->rec_size = rw_wire_rec_size(ph->topk, ph->hidden, ph->dtype);
	ph->crec_size = rw_wire_crec_size(ph->hidden, ph->dtype);
	for (uint32_t r = 0; r < x->rails; r++)
		ph->slab_dev[r] = rw_svc_mesh_slab_dev(x->mesh, r, NULL);
	int force = x->svc->cfg.force_path;
	p->xchg.params = (rw_wire_phase_params_t){
		.n_experts = ph->n_experts, .topk = ph->topk, .hidden = ph->hidden, .dtype = ph->dtype,
		.requested_path = force >= 0 && force < RW_PATH_COUNT ? (uint32_t)force : RW_WIRE_PATH_AUTO,
		.epoch = pair_epoch(p) };
	ph->tag_in = rw_wire_tag_for(p->tag, p->xchg.params.epoch);
	if (sqe->path != RW_PATH_REQ_DAEMON) /* the ranks' request wins (docs/ipc.md "Path requests") */
		p->xchg.params.requested_path = rw_wire_path_by_ranks(sqe->path - RW_PATH_REQ_NATIVE);
	p->xchg.slot = -1;
	p->xchg.peer_slot = rw_arena_alloc(&p->mem, n, sizeof(uint32_t));
	p->xchg.have_row = rw_arena_alloc(&p->mem, n, 1);
	p->xchg.counts = rw_arena_alloc(&p->mem, n * nr, sizeof(uint32_t));
	p->xchg.peer_params = rw_arena_alloc(&p->mem, n, sizeof(rw_wire_phase_params_t));
	p->xchg.tag_to = rw_arena_alloc(&p->mem, n, sizeof(uint32_t));
	p->xchg.view_w = rw_arena_alloc(&p->mem, nr, sizeof(uint32_t));
	p->xchg.view_up = rw_arena_alloc(&p->mem, n * n, sizeof(uint32_t));
	size_t ws_len = rw_sched_feat_workspace(x->nodes, x->rails);
	p->xchg.feat_ws = rw_arena_alloc(&p->mem, 1, ws_len);
	if (!p->xchg.peer_slot || !p->xchg.have_row || !p->xchg.counts || !p->xchg.peer_params ||
	    !p->xchg.tag_to || !p->xchg.view_w || !p->xchg.view_up || !p->xchg.feat_ws ||
	    rw_sched_feat_begin(&p->xchg.feat_acc, &x->svc->topo, p->xchg.feat_ws, ws_len) != RW_OK ||
	    rw_svc_layout_alloc(&p->plan.layout, x->nodes, x->rails) != RW_OK)
		return exec_err(p, RW_ERR_NOMEM, "out of memory");
	ph->tag_to = p->xchg.tag_to;
	ph->topo = &x->svc->topo;
	return RW_OK;
}

/* The path a rank asked for, as a count row carries it (rw_sqe_t.path, range-checked at the IPC
 * boundary); 0 = none, the daemon's choice (docs/ipc.md "Path requests"). */
static uint32_t ranks_request(const rw_sqe_t *sqe)
{
	return sqe->path ? rw_wire_path_by_ranks(sqe->path - RW_PATH_REQ_NATIVE) : 0;
}

/* What a count row's request means, for messages. */
static const char *request_name(uint32_t req)
{
	return req & RW_WIRE_PATH_BY_RANKS ? rw_sched_path_name((rw_path_t)(req & 0xffu))
		: "daemon's choice";
}

/* Whether a later rank's submission fits the phase the first one opened. */
rw_status_t exec_plan_fits(const exec_pair_t *p, const rw_sqe_t *sqe, char *why, size_t len)
{
	if (sqe->n_experts != p->ph.n_experts) {
		snprintf(why, len, "n_experts %u differs from the phase's %u (local ranks disagree)",
			 sqe->n_experts, p->ph.n_experts);
		return RW_ERR_SUB_EXPERTS;
	}
	if (sqe->topk != p->ph.topk || sqe->hidden != p->ph.hidden ||
	    exec_wire_dtype(sqe->dtype) != p->ph.dtype) {
		snprintf(why, len, "local ranks disagree on topk/hidden/dtype");
		return RW_ERR_SUB_FIELD;
	}
	const exec_t *x = p->x;
	uint32_t req = p->xchg.params.requested_path, ours = req & RW_WIRE_PATH_BY_RANKS ? req : 0;
	if (ranks_request(sqe) != ours) {
		uint32_t first = 0; /* the local rank whose submission opened the phase */
		while (first + 1 < x->gpus && !p->in[RW_SVC_DISPATCH].sub[first].have)
			first++;
		snprintf(why, len, "path requests differ: this rank %s, rank %u %s",
			 request_name(ranks_request(sqe)), x->me * x->gpus + first, request_name(ours));
		return RW_ERR_SUB_FIELD;
	}
	return RW_OK;
}

void exec_plan_tokens(exec_pair_t *p)
{
	const exec_t *x = p->x;
	for (uint32_t g = 0; g < x->gpus; g++)
		p->plan.rt[g] = (rw_rank_tokens_t){
			.local_gpu = g, .n_tokens = p->in[RW_SVC_DISPATCH].sub[g].sqe.token_count,
			.topk = p->ph.topk, .expert_ids = p->ph.io[RW_SVC_DISPATCH][g].ids };
}

/* Who counted this pair's row (or found its bad id), for stats. */
static void count_metric(exec_pair_t *p)
{
	rw_svc_metrics_t *m = &p->x->svc->metrics;
	if (p->stage == ST_COUNT_MOVER)
		m->counts_gpu++;
	else
		m->counts_host++;
}

rw_status_t exec_plan_bad_ids(exec_pair_t *p, uint32_t bad)
{
	exec_t *x = p->x;
	char msg[RW_SVC_WHY_MAX];
	count_metric(p);
	snprintf(msg, sizeof(msg), "local rank %u: expert id out of range (E=%u) or bad top-k",
		 x->me * x->gpus + bad, p->ph.n_experts);
	exec_sub_t *s = bad < x->gpus ? &p->in[RW_SVC_DISPATCH].sub[bad] : NULL;
	if (s && s->have) { /* the culprit hears what it did; the others that it failed */
		exec_answer_sub_err(x, s, RW_ERR_SUB_TOKENS, 0, msg);
		s->have = 0;
		p->answered |= 1u << bad; /* or its tomb would wait for it */
	}
	return exec_err(p, RW_ERR_INVAL, "%s", msg);
}

rw_status_t exec_plan_count(exec_pair_t *p, uint32_t budget, int *done_p)
{
	exec_t *x = p->x;
	size_t nr = (size_t)x->nodes * x->rails;
	*done_p = 0;
	if (p->plan.count_it.rank == 0 && p->plan.count_it.token == 0)
		exec_plan_tokens(p);
	uint32_t bad = 0;
	if (rw_sched_count_step(&x->svc->topo, p->ph.n_experts, x->me, p->plan.rt, x->gpus,
				p->xchg.counts + x->me * nr, &p->plan.count_it, budget, done_p,
				&bad) != RW_OK)
		return exec_plan_bad_ids(p, bad);
	return RW_OK;
}

rw_status_t exec_plan_counted(exec_pair_t *p)
{
	exec_t *x = p->x;
	size_t nr = (size_t)x->nodes * x->rails;
	count_metric(p);
	p->plan.row_off = rw_arena_alloc(&p->mem, nr + 1, sizeof(uint32_t));
	p->plan.rec_it = rw_arena_alloc(&p->mem, 1, sizeof(rw_sched_records_iter_t));
	if (!p->plan.row_off || !p->plan.rec_it)
		return exec_err(p, RW_ERR_NOMEM, "out of memory");
	rw_sched_prefix(p->xchg.counts + x->me * nr, (uint32_t)nr, p->plan.row_off);
	p->plan.rec = rw_arena_alloc(&p->mem, (size_t)p->plan.row_off[nr] + 1, sizeof(rw_record_t));
	if (!p->plan.rec)
		return exec_err(p, RW_ERR_NOMEM, "out of memory");
	/* The records pass fills each (destination, rail) segment from its start, in order: the
	 * segment's last entry is written exactly when the ids give as many records as the row
	 * counted. Marked here, checked at the end, so a count that said more than the ids give
	 * (a rank's ids changed, or a count kernel erred) fails instead of leaving holes. */
	for (size_t i = 0; i < nr; i++)
		if (p->plan.row_off[i + 1] > p->plan.row_off[i])
			p->plan.rec[p->plan.row_off[i + 1] - 1].rank = UINT32_MAX;
	return RW_OK;
}

rw_status_t exec_plan_records(exec_pair_t *p, uint32_t budget, int *done_p)
{
	exec_t *x = p->x;
	const uint32_t rails = x->rails;
	size_t nr = (size_t)x->nodes * rails;
	if (p->plan.rec_it->rail == 0 && p->plan.rec_it->rank == 0 && p->plan.rec_it->token == 0)
		exec_plan_tokens(p); /* every rank's ids are readable now (some were not at the count) */
	if (rw_sched_records_step(&x->svc->topo, p->ph.n_experts, x->me, p->plan.rt, x->gpus,
				  p->plan.row_off, p->plan.rec, p->plan.rec_it, budget, done_p) != RW_OK)
		return exec_err(p, RW_ERR_INVAL, "cannot build records: the ranks' ids give more "
				"records than this node's count row says (a rank's ids changed)");
	for (size_t i = 0; *done_p && i < nr; i++)
		if (p->plan.row_off[i + 1] > p->plan.row_off[i] &&
		    p->plan.rec[p->plan.row_off[i + 1] - 1].rank == UINT32_MAX)
			return exec_err(p, RW_ERR_INVAL, "cannot build records: the ranks' ids give fewer "
					"records to node %u on rail %u than this node's count row says (%u)",
					(uint32_t)(i / rails), (uint32_t)(i % rails),
					p->plan.row_off[i + 1] - p->plan.row_off[i]);
	return RW_OK;
}

void exec_plan_waiting(const exec_pair_t *p, char *buf, size_t len)
{
	const exec_t *x = p->x;
	char who[96];
	size_t used = 0;
	who[0] = '\0';
	if (p->stage == ST_COUNT_MOVER) {
		snprintf(buf, len, "the data mover's count of this node's tokens (%s)", p->mv->name);
		return;
	}
	if (p->stage == ST_COUNT_HOST) {
		snprintf(buf, len, "this node to count its ranks' tokens (rank %u, token %u)",
			 p->plan.count_it.rank, p->plan.count_it.token);
		return;
	}
	/* A node sends its row once every one of its local ranks has submitted: name the ranks
	 * it holds, so a rank that never came is narrowed down from any node's message (its own
	 * node's names the rank itself). Short: a rank's message is bounded. */
	for (uint32_t n = 0; n < x->nodes && used + 40 < sizeof(who); n++)
		if (!p->xchg.have_row[n])
			used += (size_t)snprintf(who + used, sizeof(who) - used, "%s%u (%s, ranks %u-%u)",
						 used ? ", " : "", n, x->svc->cfg.nodes[n].name,
						 n * x->gpus, n * x->gpus + x->gpus - 1);
	if (used) {
		snprintf(buf, len, "the count rows of node %s", who);
		return;
	}
	for (uint32_t g = 0; g < x->gpus && used + 16 < sizeof(who); g++)
		if (!p->in[RW_SVC_DISPATCH].sub[g].ready)
			used += (size_t)snprintf(who + used, sizeof(who) - used, "%s%u", used ? ", " : "",
						 x->me * x->gpus + g);
	if (used)
		snprintf(buf, len, "the top-k ids of local ranks %s (their staging)", who);
	else
		snprintf(buf, len, "this node to build its records (rail %u, rank %u, token %u)",
			 p->plan.rec_it ? p->plan.rec_it->rail : 0, p->plan.rec_it ? p->plan.rec_it->rank : 0,
			 p->plan.rec_it ? p->plan.rec_it->token : 0);
}

void exec_plan_view_decode(const rw_wire_counts_t *c, uint32_t *view)
{
	for (uint32_t r = 0; r < c->rails; r++)
		view[r] = rw_wire_counts_weight(c, r);
	for (uint32_t n = 0; n < c->nodes; n++)
		view[c->rails + n] = rw_wire_counts_up(c, n);
}

void exec_plan_take_row(exec_pair_t *p, uint32_t node, uint32_t slot,
			const rw_wire_phase_params_t *params, const uint32_t *row, const uint32_t *view)
{
	exec_t *x = p->x;
	if (p->xchg.have_row[node])
		return;
	size_t nr = (size_t)x->nodes * x->rails;
	uint32_t *dst = p->xchg.counts + node * nr;
	if (row != dst) /* our own row and a wire row are decoded in place */
		memcpy(dst, row, nr * sizeof(uint32_t));
	if (view) {
		memcpy(p->xchg.view_w + (size_t)node * x->rails, view, x->rails * sizeof(uint32_t));
		memcpy(p->xchg.view_up + (size_t)node * x->nodes, view + x->rails,
		       x->nodes * sizeof(uint32_t));
	}
	/* Fold the row into the features now, while the other rows are still on their way: what is
	 * left after the last row is O(N R) (docs/algorithms.md §5). */
	rw_sched_feat_add_row(&p->xchg.feat_acc, node, dst);
	p->xchg.peer_slot[node] = slot;
	p->xchg.peer_params[node] = *params;
	p->xchg.tag_to[node] = rw_wire_tag_for(p->tag, params->epoch);
	p->xchg.have_row[node] = 1;
	p->xchg.n_rows++;
}

void exec_plan_drop_row(exec_pair_t *p, uint32_t node)
{
	exec_t *x = p->x;
	if (!p->xchg.have_row[node] || node == x->me)
		return;
	p->xchg.have_row[node] = 0;
	p->xchg.n_rows--;
	/* The features fold rows in and cannot take one out: fold the others in again. */
	const size_t nr = (size_t)x->nodes * x->rails;
	(void)rw_sched_feat_begin(&p->xchg.feat_acc, &x->svc->topo, p->xchg.feat_ws,
				  rw_sched_feat_workspace(x->nodes, x->rails));
	for (uint32_t n = 0; n < x->nodes; n++)
		if (p->xchg.have_row[n])
			rw_sched_feat_add_row(&p->xchg.feat_acc, n, p->xchg.counts + n * nr);
}

void exec_plan_take_counts(exec_pair_t *p, uint32_t node, const rw_wire_counts_t *c)
{
	exec_t *x = p->x;
	if (p->xchg.have_row[node])
		return; /* one row per node and attempt; a repeat changes nothing */
	size_t nr = (size_t)x->nodes * x->rails;
	uint32_t *dst = p->xchg.counts + node * nr;
	for (size_t i = 0; i < nr; i++) /* decoded once, straight into the matrix */
		dst[i] = rw_wire_counts_row(c, (uint32_t)i);
	for (uint32_t r = 0; r < x->rails; r++)
		p->xchg.view_w[(size_t)node * x->rails + r] = rw_wire_counts_weight(c, r);
	for (uint32_t n = 0; n < x->nodes; n++)
		p->xchg.view_up[(size_t)node * x->nodes + n] = rw_wire_counts_up(c, n);
	exec_plan_take_row(p, node, c->slot, &c->params, dst, NULL);
}

rw_status_t exec_plan_send_row(exec_pair_t *p)
{
	exec_t *x = p->x;
	for (uint32_t peer = 0; peer < x->nodes; peer++)
		if (!rw_svc_mesh_peer_up(x->mesh, peer))
			return exec_err(p, RW_ERR_PEER, "peer %u (%s) is not connected", peer,
					x->svc->cfg.nodes[peer].name);
	size_t nr = (size_t)x->nodes * x->rails;
	/* Our view of our rails goes with the row (docs/dataflow.md "Rail health"). */
	uint32_t *weight = p->xchg.view_w + (size_t)x->me * x->rails;
	uint32_t *up = p->xchg.view_up + (size_t)x->me * x->nodes;
	for (uint32_t r = 0; r < x->rails; r++) {
		const rw_svc_rail_metrics_t *rm = &x->svc->metrics.rail[r];
		rw_svc_rail_meter_sample(&x->meter[r], rm->tx_bytes, rm->tx_busy_ns);
		x->svc->metrics.rail[r].weight = weight[r] = exec_rail_weight(x, r);
	}
	for (uint32_t n = 0; n < x->nodes; n++)
		up[n] = rw_svc_mesh_rail_mask(x->mesh, n);
	rw_wire_counts_t c = { .key = p->key, .node = x->me, .nodes = x->nodes, .rails = x->rails,
			       .slot = (uint32_t)p->xchg.slot, .params = p->xchg.params,
			       .row = p->xchg.counts + x->me * nr, .rail_weight = weight, .rail_up = up };
	snprintf(c.group_name, sizeof(c.group_name), "%s", p->g->name);
	size_t len = rw_wire_counts_size(x->nodes, x->rails);
	uint8_t *buf = malloc(len);
	if (!buf)
		return exec_err(p, RW_ERR_NOMEM, "out of memory");
	rw_wire_counts_pack(&c, buf, len);
	exec_plan_take_row(p, x->me, (uint32_t)p->xchg.slot, &p->xchg.params, c.row, NULL);
	rw_status_t st = RW_OK;
	for (uint32_t peer = 0; peer < x->nodes && st == RW_OK; peer++)
		if (peer != x->me &&
		    rw_svc_mesh_send(x->mesh, peer, RW_WIRE_COUNTS, buf, (uint32_t)len) != RW_OK)
			st = exec_err(p, RW_ERR_PEER, "cannot send counts to peer %u (%s)", peer,
				      x->svc->cfg.nodes[peer].name);
	free(buf);
	return st;
}

/* Every node must agree on the phase's parameters and, when any node's ranks asked for a path,
 * on that path (node 0's row is the reference, so every node names the same culprit); otherwise
 * the first configured path wins. */
static rw_status_t check_params(exec_pair_t *p, int *forced_p)
{
	const exec_t *x = p->x;
	const rw_wire_phase_params_t *ours = &p->xchg.params, *first = &p->xchg.peer_params[0];
	*forced_p = -1;
	for (uint32_t n = 0; n < x->nodes; n++) {
		const rw_wire_phase_params_t *pp = &p->xchg.peer_params[n];
		if (pp->n_experts != ours->n_experts || pp->topk != ours->topk ||
		    pp->hidden != ours->hidden || pp->dtype != ours->dtype)
			return exec_err_agreed(p, pp->n_experts != ours->n_experts ? RW_ERR_SUB_EXPERTS
					       : RW_ERR_INVAL, "node %u disagrees on E/topk/hidden/dtype "
					       "(%u/%u/%u/%u)", n, pp->n_experts, pp->topk, pp->hidden,
					       pp->dtype);
		uint32_t by_ranks = (pp->requested_path | first->requested_path) & RW_WIRE_PATH_BY_RANKS;
		if (by_ranks && pp->requested_path != first->requested_path) {
			uint32_t g = x->gpus;
			return exec_err_agreed(p, RW_ERR_INVAL, "path requests differ: ranks %u-%u (%s) "
					       "%s, ranks %u-%u (%s) %s", 0u, g - 1,
					       x->svc->cfg.nodes[0].name, request_name(first->requested_path),
					       n * g, n * g + g - 1, x->svc->cfg.nodes[n].name,
					       request_name(pp->requested_path));
		}
		/* Ranks that joined with another group key (or none) are another job's: a name
		 * squatter, or two jobs with one name. Nothing of this phase moves between them. */
		if (memcmp(pp->key_fp, ours->key_fp, sizeof(ours->key_fp)) != 0)
			return exec_err_agreed(p, RW_ERR_INVAL, "ranks %u-%u (%s) joined group %s "
					       "with another group key than ranks %u-%u here: another "
					       "job of that name", n * x->gpus, n * x->gpus + x->gpus - 1,
					       x->svc->cfg.nodes[n].name, p->g->name, x->me * x->gpus,
					       x->me * x->gpus + x->gpus - 1);
		if (*forced_p < 0 && pp->requested_path != RW_WIRE_PATH_AUTO)
			*forced_p = (int)(pp->requested_path & 0xffu);
	}
	return RW_OK;
}

/* ---- rail health (docs/dataflow.md "Rail health") ------------------------------------------ */

/* This node's capacity weight of `rail` in Mbit/s (1 .. RW_MAX_RAIL_WEIGHT): its configured
 * rate, or with `rail_weights: measured` its measured throughput once there is one, quantized
 * (rail_health.h). */
uint32_t exec_rail_weight(const exec_t *x, uint32_t rail)
{
	if (x->svc->cfg.rail_weights_measured && x->meter[rail].mbit > 0)
		return rw_svc_rail_weight_quantize(x->meter[rail].mbit);
	double mbit = x->svc->cfg.nodes[x->me].rails[rail].rate_gbps * 1000.0;
	return mbit < 1 ? 1u : mbit > RW_MAX_RAIL_WEIGHT ? RW_MAX_RAIL_WEIGHT : (uint32_t)(mbit + 0.5);
}

/* The pair's weights plan as the cluster's do: every rail eligible and the weights in the
 * cluster's proportions (w[r] * base[0] == w[0] * base[r]). */
static int weights_as_base(const uint32_t *w, const uint32_t *base, uint32_t rails)
{
	for (uint32_t r = 0; r < rails; r++)
		if (!w[r] || (uint64_t)w[r] * base[0] != (uint64_t)w[0] * base[r])
			return 0;
	return 1;
}

/* The pair's topology from every node's rail view: rail r carries (s, d) only if s says its
 * rail r to d is up and d says its rail r to s is up, with the smaller of the two ends'
 * weights. Every node holds the same rows, so every node plans with the same weights. When
 * every pair's are in the cluster's proportions the pairs plan as before (no pair weights). */
static rw_status_t plan_rails(exec_pair_t *p)
{
	exec_t *x = p->x;
	const uint32_t n = x->nodes, rails = x->rails;
	const rw_topo_t *base = &x->svc->topo;
	p->plan.topo = *base;
	p->plan.topo.pair_weight = NULL;
	uint32_t *pw = rw_arena_alloc(&p->mem, (size_t)n * n * rails, sizeof(uint32_t));
	if (!pw)
		return exec_err(p, RW_ERR_NOMEM, "out of memory");
	int differs = 0, excluded = 0;
	for (uint32_t s = 0; s < n; s++)
		for (uint32_t d = 0; d < n; d++) {
			uint32_t *w = pw + ((size_t)s * n + d) * rails;
			const uint32_t *cnt = p->xchg.counts + ((size_t)s * n + d) * rails;
			if (s == d) {
				memcpy(w, base->rail_weight, rails * sizeof(uint32_t));
				continue;
			}
			uint32_t up = p->xchg.view_up[(size_t)s * n + d] & p->xchg.view_up[(size_t)d * n + s];
			uint32_t any = 0, demand = 0;
			for (uint32_t r = 0; r < rails; r++) {
				uint32_t ws = p->xchg.view_w[(size_t)s * rails + r];
				uint32_t wd = p->xchg.view_w[(size_t)d * rails + r];
				w[r] = (up >> r) & 1 ? RW_MIN(ws, wd) : 0;
				excluded |= !((up >> r) & 1);
				any |= w[r];
				demand |= cnt[r];
			}
			differs |= !weights_as_base(w, base->rail_weight, rails);
			if (!any && demand)
				return exec_err_agreed(p, RW_ERR_LINK, "node %u (%s) and node %u (%s) "
						       "have no rail up between them: retry the phase",
						       s, x->svc->cfg.nodes[s].name, d,
						       x->svc->cfg.nodes[d].name);
		}
	if (differs)
		p->plan.topo.pair_weight = pw;
	if (excluded)
		x->svc->metrics.phases_rail_excluded++;
	return RW_OK;
}

/* The selector's features. With pair weights they describe the native load that is left: the
 * records of a rail that is down for a pair counted where that pair's native plan sends them. */
static rw_status_t plan_features(exec_pair_t *p, rw_features_t *feat)
{
	exec_t *x = p->x;
	const rw_topo_t *topo = &p->plan.topo;
	if (!topo->pair_weight) {
		if (rw_sched_feat_finish(&p->xchg.feat_acc, p->ph.rec_size, feat) != RW_OK)
			return exec_err_agreed(p, RW_ERR_SYS, "feature accumulator incomplete");
		return RW_OK;
	}
	const uint32_t n = x->nodes, rails = x->rails;
	uint32_t *eff = rw_arena_alloc(&p->mem, (size_t)n * n * rails, sizeof(uint32_t));
	if (!eff)
		return exec_err(p, RW_ERR_NOMEM, "out of memory");
	rw_pair_plan_t pp;
	for (uint32_t s = 0; s < n; s++)
		for (uint32_t d = 0; d < n; d++) {
			size_t at = ((size_t)s * n + d) * rails;
			rw_sched_plan_pair(topo, RW_PATH_NATIVE, s, d, p->xchg.counts + at, &pp);
			memcpy(eff + at, pp.quota, rails * sizeof(uint32_t));
		}
	rw_sched_features(topo, eff, p->ph.rec_size, feat);
	return RW_OK;
}

int exec_plan_uses_rail(const exec_pair_t *p, uint32_t peer, uint32_t rail)
{
	if (!p->plan.have_layout || peer == p->x->me)
		return 0;
	/* The combine retraces the dispatch's flows: the dispatch's say it all. */
	const struct exec_flow *f = &p->flow[RW_SVC_DISPATCH];
	const size_t i = (size_t)peer * p->x->rails + rail;
	return f->send_quota[i] || f->recv_quota[i];
}

/* A rail the plan uses may have gone down since the rows were sent: fail now (retriable) rather
 * than wait for data that cannot come. Told to the peers: their view may not show it yet. */
static rw_status_t plan_rails_now(exec_pair_t *p)
{
	exec_t *x = p->x;
	for (uint32_t peer = 0; peer < x->nodes; peer++) {
		uint32_t up = rw_svc_mesh_rail_mask(x->mesh, peer);
		for (uint32_t r = 0; r < x->rails; r++)
			if (!((up >> r) & 1) && exec_plan_uses_rail(p, peer, r))
				return exec_err(p, RW_ERR_LINK, "rail %u between node %u (%s) and node %u "
						"(%s) went down: retry the phase, it runs on the other rails",
						r, x->me, x->svc->cfg.nodes[x->me].name, peer,
						x->svc->cfg.nodes[peer].name);
	}
	return RW_OK;
}

/* Each kind's traffic under the layout: dispatch sends our records to their destinations and
 * receives the sources' ranges; combine returns each range to where it came from. */
static rw_status_t plan_flows(exec_pair_t *p)
{
	const exec_t *x = p->x;
	const rw_svc_layout_t *l = &p->plan.layout;
	uint32_t *out_quota = rw_arena_alloc(&p->mem, (size_t)x->nodes * x->rails, sizeof(uint32_t));
	if (!out_quota)
		return exec_err(p, RW_ERR_NOMEM, "out of memory");
	for (uint32_t d = 0; d < x->nodes; d++) /* out_pairs[me] is empty */
		for (uint32_t r = 0; r < x->rails; r++)
			out_quota[(size_t)d * x->rails + r] = d == x->me ? 0 : l->out_pairs[d].quota[r];
	p->flow[RW_SVC_DISPATCH] = (struct exec_flow){
		.rec = p->ph.rec_size, .send_quota = out_quota, .recv_quota = l->in_quota,
		.send_first = l->out_first, .peer_first = l->peer_in_first, .recv_first = l->in_first };
	p->flow[RW_SVC_COMBINE] = (struct exec_flow){
		.rec = p->ph.crec_size, .send_quota = l->in_quota, .recv_quota = out_quota,
		.send_first = l->in_first, .peer_first = l->peer_ret_first, .recv_first = l->out_first };
	return RW_OK;
}

rw_status_t exec_plan_decide(exec_pair_t *p)
{
	exec_t *x = p->x;
	rw_svc_t *svc = x->svc;
	rw_svc_phase_t *ph = &p->ph;
	/* Every node holds the same rows, so every verdict below is the same everywhere: no
	 * failure here is told to the peers (they find it themselves). */
	int forced;
	if (check_params(p, &forced) != RW_OK)
		return p->err.st;
	if (plan_rails(p) != RW_OK)
		return p->err.st;
	const rw_topo_t *topo = &p->plan.topo;
	rw_features_t feat;
	rw_selection_t sel;
	if (plan_features(p, &feat) != RW_OK)
		return p->err.st;
	if (forced >= 0)
		sel = (rw_selection_t){ .path = (rw_path_t)forced, .reason = RW_SELECT_FORCED,
					.case_id = -1 };
	else
		rw_sched_select(svc->anchors, &feat, &sel);
	p->plan.path = sel.path;
	rw_svc_metrics_decision(&svc->metrics, p->key.group, p->key.layer, p->key.step, &feat, &sel);
	rw_dbg("group %s layer %u step %llu: path %s (%s) f=[%.2f %.3f %.3f]", p->g->name,
	       p->key.layer, (unsigned long long)p->key.step, rw_sched_path_name(sel.path),
	       rw_sched_reason_name(sel.reason), feat.f[0], feat.f[1], feat.f[2]);

	uint64_t max_in, max_out;
	rw_svc_layout_max(topo, p->plan.path, p->xchg.counts, &max_in, &max_out);
	uint64_t need = RW_MAX(max_in, max_out) * ph->rec_size;
	/* Against the smallest area of the pair's slots (a node may be on a carve-out, another on
	 * the shared area): every node knows every slot, so all reach the same verdict. */
	uint64_t room = UINT64_MAX;
	uint32_t tight = 0;
	for (uint32_t n = 0; n < x->nodes; n++)
		if (exec_sub_bytes(x, p->xchg.peer_slot[n]) < room) {
			room = exec_sub_bytes(x, p->xchg.peer_slot[n]);
			tight = n;
		}
	if (need > room)
		return exec_err_agreed(p, RW_ERR_RANGE, "a rail needs %llu bytes, node %u's area for "
				       "the pair (slot %u) holds %llu (raise %s)", (unsigned long long)need,
				       tight, p->xchg.peer_slot[tight], (unsigned long long)room,
				       p->xchg.peer_slot[tight] < EXEC_SLOTS ? "recv_region_mib" :
				       "group_area_mib");
	rw_svc_layout_t *l = &p->plan.layout;
	if (rw_svc_layout_build(l, topo, p->plan.path, x->me, p->xchg.counts) != RW_OK)
		return exec_err_agreed(p, RW_ERR_SYS, "cannot build the receive layout");
	if (plan_flows(p) != RW_OK)
		return p->err.st;
	p->plan.have_layout = 1;
	if (plan_rails_now(p) != RW_OK)
		return p->err.st;
	ph->layout = l;
	ph->row_off = p->plan.row_off;
	ph->rec = p->plan.rec;
	ph->rt = p->plan.rt;
	ph->rail_base[0] = 0;
	for (uint32_t r = 0; r < x->rails; r++)
		ph->rail_base[r + 1] = ph->rail_base[r] + l->in_total[r];
	ph->n_in = ph->rail_base[x->rails];
	char why[RW_SVC_WHY_MAX];
	rw_status_t st = p->mv->plan(p->mv_mover, p->mv_state, ph, why);
	if (st != RW_OK)
		return exec_err(p, st, "%s", why);
	return RW_OK;
}
