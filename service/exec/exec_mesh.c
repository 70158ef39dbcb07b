/* The executor's adapter for the peers (service/mesh/mesh.h; docs/dataflow.md "Count exchange",
 * "Send", "Failures"): count rows, phase errors, grants, arrived writes and write completions,
 * each matched to its pair and handed to the state machine (exec.c). What no open pair owns —
 * an early row, a failure before our ranks got there, a late write of an ended attempt — is
 * kept or dropped here. Everything from a peer is untrusted: a message that names the wrong
 * node or rail drops that peer. */
#include <stdlib.h>
#include <string.h>

#include "service/exec/exec_int.h"

static void mesh_counts(void *ctx, uint32_t peer, const rw_wire_counts_t *c)
{
	exec_t *x = ctx;
	exec_pair_t *p = exec_pair_by_key(x, &c->key);
	if (p && p->g && strcmp(p->g->name, c->group_name) == 0 && p->stage == ST_EXCHANGE) {
		if (exec_sub_bytes(x, c->slot)) /* a slot of the shared area or a carve-out */
			exec_on_counts(p, peer, c);
		return;
	}
	if (!exec_sub_bytes(x, c->slot))
		return;
	if (exec_tomb_exists(x, &c->key)) { /* that phase already failed here */
		if (c->params.epoch && !exec_ended_find(x, &c->key, peer, c->params.epoch)) {
			exec_ended_add(x, &c->key, peer, c->params.epoch);
			exec_tomb_tell(x, &c->key, peer, c->params.epoch);
		}
		return;
	}
	/* early: kept until our own ranks get there (or it ages out) */
	exec_row_keep(x, c, peer, p && p->g && strcmp(p->g->name, c->group_name) == 0);
	exec_refused_rows(x, c->group_name); /* a local rank of it was refused: it ends now */
}

static void mesh_phase_err(void *ctx, uint32_t peer, const rw_wire_phase_err_t *e)
{
	exec_t *x = ctx;
	exec_pair_t *p = exec_pair_by_key(x, &e->key);
	if (e->cause_node >= x->nodes) {
		rw_svc_mesh_fail_peer(x->mesh, peer, RW_ERR_PROTO, "phase error names a node that does not exist");
		return;
	}
	char msg[RW_WIRE_ERRMSG_MAX];
	snprintf(msg, sizeof(msg), "%s", e->msg); /* "node N (name): why", from the node that failed */
	/* The peer's count row of the failed attempt is dead wherever it is; an attempt that
	 * already ended here has nothing more to fail. */
	if (e->epoch) {
		exec_rows_drop(x, NULL, &e->key, (int)peer, e->epoch);
		if (exec_ended_find(x, &e->key, peer, e->epoch))
			return;
	}
	if (e->relay) {
		/* The peer passed on another node's failure after its row had gone out: only a pair
		 * that took that row belongs to the failed attempt (a retry here that took it would
		 * write with a dead epoch and wait for data that never comes). */
		if (p && p->xchg.have_row[peer] && p->xchg.peer_params[peer].epoch == e->epoch)
			exec_pair_fail_peer(p, e, msg);
		return;
	}
	/* The peer names our attempt it failed (it had our row): the open pair's, or one that has
	 * already ended here, whose ranks had their answers. */
	if (e->dst_epoch && !(p && p->xchg.params.epoch == e->dst_epoch)) {
		/* ... but if the open pair (a retry here) took the peer's row of that failed attempt
		 * (it came after our attempt ended), that row is dead: a pair that kept it would
		 * write with the dead epoch, which the peer's next attempt drops, and wait for the
		 * peer forever. Still waiting for rows: the peer's next row (it follows this message
		 * on the same channel) takes its place. Already decided: our writes to the peer
		 * went astray, so the pair fails here, and the peer's retry with it (told with the
		 * row dropped, so that the peer does not take this for news of the dead attempt). */
		if (p && e->epoch && p->xchg.have_row && p->xchg.have_row[peer] &&
		    p->xchg.peer_params[peer].epoch == e->epoch) {
			const int deciding = p->stage == ST_EXCHANGE;
			exec_plan_drop_row(p, peer);
			if (!deciding)
				exec_pair_fail(p, RW_ERR_PEER,
					       "node %u (%s)'s count row in this attempt was of its attempt that failed (%s)",
					       peer, x->svc->cfg.nodes[peer].name, msg);
		}
		return;
	}
	/* A failure that already ended an attempt here (it reached us first through another
	 * node): the pair open now, or the ranks still to come, belong to a retry. */
	if (exec_ended_find(x, &e->key, e->cause_node, e->cause_id))
		return;
	if (p) {
		exec_pair_fail_peer(p, e, msg);
	} else if (e->kind == RW_SVC_DISPATCH) {
		/* Failed before our ranks got there: they fail at once when they come. */
		exec_key_end(x, &(exec_key_end_t){ .key = &e->key, .kind = RW_SVC_DISPATCH,
						   .st = (rw_status_t)e->status, .msg = msg,
						   .cause_node = e->cause_node, .cause_id = e->cause_id,
						   .tell = EXEC_TELL_NONE });
	}
}

static void mesh_arrival(void *ctx, uint32_t peer, uint32_t rail, const rw_rail_arrival_t *a)
{
	exec_t *x = ctx;
	rw_wire_imm_t imm;
	rw_wire_imm_unpack(a->imm, &imm);
	rw_svc_metrics_rx(&x->svc->metrics, rail, a->length, 0, 0);
	if (imm.src != peer || imm.rail != rail) {
		rw_svc_mesh_fail_peer(x->mesh, peer, RW_ERR_PROTO, "immediate names another node/rail");
		return;
	}
	/* Where it landed, when the transport says (tcp, shm): peers write only into receive
	 * sub-areas, never into our send staging. */
	const uint64_t at = a->region ? a->offset : EXEC_AT_UNKNOWN;
	const int sub = at == EXEC_AT_UNKNOWN ? SUB_RD : exec_at_sub(x, at);
	if (sub != SUB_RD && sub != SUB_RC) {
		rw_svc_mesh_fail_peer(x->mesh, peer, RW_ERR_PROTO, "a write into this node's send area");
		return;
	}
	exec_pair_t *p = exec_pair_by_tag(x, imm.tag14);
	if (!p) { /* a write of a phase (or an earlier attempt at it) that already ended here */
		rw_svc_metrics_error(&x->svc->metrics, RW_ERR_STATE);
		return;
	}
	exec_on_data(p, (rw_svc_phase_kind_t)imm.kind, peer, rail, a->length, (int)imm.last, at);
}

static void mesh_write_done(void *ctx, uint32_t peer, uint32_t rail, void *write_ctx,
			    rw_status_t st)
{
	(void)ctx;
	exec_on_write_done(write_ctx, peer, rail, st);
}

/* Our wave-`wave` destination admits us. Kept in the pair until the sender gets to that wave;
 * a grant always finds its pair (the grantor had our count row, which we send only with the
 * pair open), unless the pair already ended here: then it is dropped. */
static void mesh_grant(void *ctx, uint32_t peer, const rw_wire_grant_t *gr)
{
	exec_t *x = ctx;
	if (peer != (x->me + gr->wave) % x->nodes) {
		rw_svc_mesh_fail_peer(x->mesh, peer, RW_ERR_PROTO, "grant from a node that is not that wave's");
		return;
	}
	exec_pair_t *p = exec_pair_by_key(x, &gr->key);
	if (p)
		exec_on_grant(p, (rw_svc_phase_kind_t)gr->kind, gr->wave); /* the wire's 0/1 */
}

static void mesh_peer_up(void *ctx, uint32_t peer)
{
	(void)ctx, (void)peer;
}

static void mesh_peer_down(void *ctx, uint32_t peer, rw_status_t st)
{
	exec_on_peer_down(ctx, peer, st);
}

static void mesh_rail_down(void *ctx, uint32_t peer, uint32_t rail, rw_status_t st)
{
	exec_on_rail_down(ctx, peer, rail, st);
}

const rw_svc_mesh_cbs_t exec_mesh_cbs = {
	.peer_up = mesh_peer_up,
	.peer_down = mesh_peer_down,
	.rail_down = mesh_rail_down,
	.counts = mesh_counts,
	.phase_err = mesh_phase_err,
	.grant = mesh_grant,
	.arrival = mesh_arrival,
	.write_done = mesh_write_done,
};
