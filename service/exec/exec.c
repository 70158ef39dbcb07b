/* The phase executor's state machine (docs/dataflow.md "Phase executor"): one pair per group
 * moves GATHER_D -> COUNT_* -> [WAIT_SLOT ->] EXCHANGE -> RUN_D -> FLUSH_D -> WAIT_C -> RUN_C ->
 * FLUSH_C -> CLOSED, and any stage can fail to CLOSED (exec_stage.c checks every change). Events
 * come from the adapters (exec_ipc.c, exec_mesh.c), the mover's reports and the timers; the
 * leaves do the work and return a status; only this file changes a pair's stage or fails it.
 * A closed pair's memory is freed at once, but its struct lives until
 * its last rail write has reported, and is freed by the reaper (an ev_prepare watcher) — never
 * inside a callback chain that may still hold it. Everything runs on the loop thread. */
#include <stdlib.h>
#include <string.h>

#include "service/exec/exec_int.h"

static void pair_try_decide(exec_pair_t *p);
static void pair_check_done(exec_pair_t *p);
static void pair_exchange(exec_pair_t *p);
static void pair_counted(exec_pair_t *p);
static int subs_ready(const exec_pair_t *p, rw_svc_phase_kind_t kind);

/* ---- lifetime ------------------------------------------------------------------------------ */

static void slot_release(exec_pair_t *p, int clean)
{
	exec_t *x = p->x;
	int slot = p->xchg.slot;
	if (slot < 0)
		return;
	/* After a failure a peer may still have writes in flight towards this slot; keep it idle
	 * for a heartbeat timeout (docs/dataflow.md "Region reuse"). */
	const uint64_t free_at = clean ? 0 :
		rw_now_ns() + (uint64_t)x->svc->cfg.heartbeat_timeout_ms * 1000000ull;
	if (slot < EXEC_SLOTS) {
		x->slot_busy[slot] = 0;
		x->slot_free_at[slot] = free_at;
		if (!clean) { /* until its movers' work settled (slot_hold_check) */
			x->slot_held[slot] = 1;
			p->slot_held = slot;
		}
	} else if (p->g) { /* the group's carve-out: only its own next pair uses it */
		p->g->carve_free_at = free_at;
	}
	p->xchg.slot = -1;
}

static int any_running(const exec_t *x)
{
	const exec_pair_t *q;
	rw_list_for_each(&x->pairs, q, link)
		if (exec_open(q) && q->stage != ST_WAIT_C)
			return 1;
	return 0;
}

/* A failed pair's shared slot goes back into use only once its movers' work settled: the CUDA
 * mover's pack and sum kernels write the slot's send areas, and on a hung GPU they may land
 * long after the heartbeat timeout that keeps the slot idle for the peers' writes. `closing`:
 * asked as the pair closes (a slot kept is said then, and said again when it returns). */
static void slot_hold_check(exec_pair_t *p, int closing)
{
	exec_t *x = p->x;
	const int s = p->slot_held;
	if (s < 0)
		return;
	if (!exec_movers_settled(x, p)) {
		if (closing)
			rw_info("slot %d kept out of use: failed pair %u's work on the GPU has not landed "
				"and may still write its areas", s, p->serial);
		return;
	}
	if (!closing)
		rw_info("slot %d back in use: failed pair %u's GPU work landed", s, p->serial);
	x->slot_held[s] = 0;
	p->slot_held = -1;
}

/* Close a pair (success or failure): stop using the ranks' buffers at once. */
static void pair_close(exec_pair_t *p, int clean)
{
	exec_t *x = p->x;
	if (!exec_open(p))
		return;
	/* Unless every byte of its combine came, a peer may still write with its tag until that
	 * peer's pair of it ends (a phase timeout at most): no pair here takes the tag meanwhile
	 * (exec_plan.c), or such a write would be taken for that pair's. */
	if (p->xchg.slot >= 0 && !(clean && p->stage == ST_FLUSH_C))
		x->quiet[x->quiet_next++ % EXEC_QUIET_TAGS] = (exec_quiet_tag_t){
			.tag14 = rw_wire_imm_tag(p->ph.tag_in),
			.until = rw_now_ns() + (uint64_t)x->svc->cfg.phase_timeout_ms * 1000000ull };
	exec_stage_move(p, ST_CLOSED);
	ev_timer_stop(x->svc->loop, &p->timer);
	ev_timer_stop(x->svc->loop, &p->pace);
	slot_release(p, clean);
	if (p->g && p->g->pair == p)
		p->g->pair = NULL;
	p->g = NULL;
	exec_page_busy(p, 0);
	if (p->mv_state)
		p->mv->close(p->mv_mover, p->mv_state);
	p->mv_state = NULL;
	slot_hold_check(p, 1);
	rw_svc_layout_free(&p->plan.layout);
	rw_arena_free(&p->mem);
	p->tr = NULL; /* it lived in the arena */
	if (x->svc->draining && !any_running(x))
		rw_svc_stop(x->svc);
}

static void reaper_cb(struct ev_loop *loop, ev_prepare *w, int revents)
{
	(void)loop, (void)revents;
	exec_t *x = w->data;
	exec_answer_late_sweep(x);
	exec_pair_t *p, *nx;
	rw_list_for_each_safe(&x->pairs, p, nx, link) {
		if (exec_open(p))
			continue;
		slot_hold_check(p, 0);
		if (p->outstanding == 0 && p->slot_held < 0 && exec_carve_settled(x, p)) {
			rw_list_del(&p->link);
			if (p->carve >= 0) /* none of its writes reads the carve-out any more */
				rw_svc_mesh_carve_put(x->mesh, (uint32_t)p->carve);
			free(p);
		}
	}
}

/* Page rank g of the pair's dispatch has its rows: its done of it counted, or (stored since
 * the poller's last report) in its page now, once the flush published its arrived (a done
 * before then is a lie, exec_page.c). Ordered after whatever this loop stored before (a
 * status line: pair_failed). */
static int page_rows_taken(const exec_pair_t *p, uint32_t g, const exec_sub_t *s)
{
	if (p->out.page_done & (1u << g))
		return 1;
	const rw_page_head_t *pg = p->x->ipc ? rw_ipc_client_page(s->client, NULL) : NULL;
	if (!pg || p->stage != ST_FLUSH_D)
		return 0;
	atomic_thread_fence(memory_order_seq_cst);
	const uint64_t done = atomic_load_explicit(&pg->word[RW_PW_DONE].v, memory_order_acquire);
	return (int64_t)(done - s->page_k) >= 0;
}

/* Act on the pair's recorded failure: every local rank with a submission of the running kind
 * gets its error (what failed, in its message), the pair is closed, and then its key is ended
 * (tomb, ended attempts, the peers told) and a peer that sent bad data is dropped — after the
 * close, so whatever those calls trigger finds the pair closed. */
static void pair_failed(exec_pair_t *p)
{
	exec_t *x = p->x;
	if (!exec_open(p))
		return;
	const exec_error_t e = p->err;
	const rw_svc_phase_kind_t kind = exec_kind(p);
	const rw_wire_key_t key = p->key;
	const uint32_t epoch = p->xchg.params.epoch ? p->xchg.params.epoch : exec_epoch_new(p->serial);
	char group[RW_GROUP_NAME_MAX]; /* copied: the close lets go of the group */
	snprintf(group, sizeof(group), "%s", p->g ? p->g->name : "?");
	/* A CUDA rank whose memory the mover's copies may still touch gets its error once they
	 * landed (or its GPU is declared stalled): asked before quiesce retires their staging */
	uint32_t held = 0;
	for (uint32_t g = 0; p->mv_state && p->mv->fence && g < x->gpus; g++) {
		exec_sub_t *s = &p->in[kind].sub[g];
		rw_svc_stage_fence_t f;
		if (!s->have || s->page_k || !p->mv->fence(p->mv_mover, p->mv_state, g, &f))
			continue; /* a page rank's memory is its own kernels' */
		exec_answer_late(x, s, &f, e.st, e.remote, e.msg);
		held |= 1u << g;
	}
	if (p->mv_state) /* nothing more of the pair's is enqueued on a GPU */
		p->mv->quiesce(p->mv_mover, p->mv_state);
	rw_warn("group %s layer %u step %llu: %s failed (%s): %s", group, key.layer,
		(unsigned long long)key.step, rw_svc_kind_name(kind), rw_status_str(e.st), e.msg);
	rw_svc_metrics_error(&x->svc->metrics, e.st);
	if (p->page_busy) /* page ranks in this kind: a rank-path phase */
		x->svc->metrics.rank_path_failed[rw_svc_err_slot((int)e.st)]++;
	rw_svc_metrics_phase(&x->svc->metrics, p->plan.have_layout ? p->plan.path : RW_PATH_JOINT,
			     kind, 0, 0);
	/* The peers' attempts whose rows this pair took (the key's end adds the rows waiting
	 * here). Copied out: the pair's memory goes with the close. */
	uint32_t *taken = calloc(x->nodes, sizeof(uint32_t));
	for (uint32_t n = 0; taken && n < x->nodes; n++)
		taken[n] = p->xchg.have_row && p->xchg.have_row[n] ? p->xchg.peer_params[n].epoch : 0;
	uint32_t answered = kind == RW_SVC_DISPATCH ? p->answered : 0, either = 0;
	for (uint32_t g = 0; g < x->gpus; g++) {
		exec_sub_t *s = &p->in[kind].sub[g];
		if (!s->have)
			continue;
		const int rows = kind == RW_SVC_DISPATCH && s->page_k;
		/* A page rank whose done of this dispatch is in has its rows and goes on to its
		 * combine, its status line left ok: the key's tomb waits for it there (exec_page.c,
		 * page_admit_combine), so it hears the failure as its combine's. */
		if (rows && page_rows_taken(p, g, s)) {
			s->have = 0;
			continue;
		}
		if (!(held & (1u << g)))
			exec_answer_sub_err(x, s, e.st, e.remote, e.msg);
		s->have = 0;
		/* Its done may have come after the poller's last report (the loop had not read
		 * it), or come as the status went out: its CPU may have read the status before it
		 * and gone on to its combine, or after it. Status stored, then done loaded (the
		 * rank's CPU loads done, then the status): a done not in now was not in when its
		 * CPU read the status, which it then saw failed. One that is in may go either way:
		 * its combine hears the failure, a dispatch of the key again is its retry. */
		if (rows && page_rows_taken(p, g, s))
			either |= 1u << g;
		else
			answered |= 1u << g;
	}
	EXEC_TRACE(p, exec_trace_end_(p, kind, e.st));
	pair_close(p, 0);
	/* Ranks of this phase that come later get its error at once (a dispatch retry of the key
	 * by an answered rank starts afresh). */
	exec_key_end(x, &(exec_key_end_t){ .group = group, .key = &key, .kind = kind, .st = e.st,
					   .msg = e.msg, .answered = answered, .either = either,
					   .epoch = epoch,
					   .cause_node = e.cause_id ? e.cause_node : x->me,
					   .cause_id = e.cause_id ? e.cause_id : epoch,
					   .taken = taken, .tell = e.tell });
	free(taken);
	if (e.blame_peer)
		rw_svc_mesh_fail_peer(x->mesh, (uint32_t)e.blame_peer - 1, RW_ERR_PROTO, e.msg);
}

void exec_pair_fail(exec_pair_t *p, rw_status_t st, const char *fmt, ...)
{
	if (!exec_open(p))
		return;
	va_list ap;
	va_start(ap, fmt);
	exec_err_v(p, st, EXEC_TELL_PEERS, fmt, ap);
	va_end(ap);
	pair_failed(p);
}

void exec_pair_fail_peer(exec_pair_t *p, const rw_wire_phase_err_t *e, const char *msg)
{
	if (!exec_open(p))
		return;
	/* Relayed: our pair took part in the failed attempt (it had that row), so every peer hears
	 * which of its attempts ended. First-hand: our count row of it may still be on its way to a
	 * node that has already moved on to a retry of the key: tell everyone it is dead (relay);
	 * before our row went out there is nothing to tell. */
	const int row_out = p->stage == ST_EXCHANGE || p->stage == ST_RUN_D || p->stage == ST_FLUSH_D;
	/* A failure that began at a node's combine (its dispatch had completed there: every byte
	 * it sends for the dispatch is sent) is a failure of the combine everywhere: our dispatch
	 * runs to its end, its ranks get their rows, and the pair fails then (complete), so every
	 * rank of the group sees it at the same call (docs/dataflow.md "Failures"). */
	const int hold = e->kind == RW_SVC_COMBINE && row_out && p->err.st == RW_OK;
	exec_error_t *err = hold ? &p->held : &p->err;
	if (err->st == RW_OK) {
		snprintf(err->msg, sizeof(err->msg), "%s", msg);
		err->st = (rw_status_t)e->status;
		err->tell = e->relay ? EXEC_TELL_PEERS : row_out ? EXEC_TELL_RELAY : EXEC_TELL_NONE;
		err->remote = 1;
		err->cause_node = e->cause_node;
		err->cause_id = e->cause_id;
	}
	if (!hold)
		pair_failed(p);
}

void exec_pair_abandon(exec_pair_t *p) { pair_close(p, 1); }

/* ---- timers ----------------------------------------------------------------------------------- */

static void list_missing_ranks(const exec_pair_t *p, rw_svc_phase_kind_t kind, char *buf,
			       size_t len)
{
	const exec_t *x = p->x;
	size_t used = 0;
	buf[0] = '\0';
	for (uint32_t g = 0; g < x->gpus && used + 16 < len; g++) {
		const exec_sub_t *s = &p->in[kind].sub[g];
		if (!s->have || !s->ready)
			used += (size_t)snprintf(buf + used, len - used, "%s%u", used ? ", " : "",
						 x->me * x->gpus + g);
	}
}

/* What a pair is waiting for, in words: a timeout names it. */
static void describe_wait(const exec_pair_t *p, char *buf, size_t len)
{
	const exec_t *x = p->x;
	char who[96];
	const rw_svc_phase_kind_t kind = exec_kind(p);
	switch (p->stage) {
	case ST_GATHER_D:
	case ST_WAIT_C:
		list_missing_ranks(p, kind, who, sizeof(who));
		snprintf(buf, len, "local ranks %s (their %s submission or its staging)", who,
			 rw_svc_kind_name(kind));
		return;
	case ST_COUNT_HOST:
	case ST_COUNT_MOVER:
	case ST_EXCHANGE:
		exec_plan_waiting(p, buf, len);
		return;
	case ST_WAIT_SLOT: {
		int held = 0;
		for (int s = 0; s < EXEC_SLOTS; s++)
			held += x->slot_held[s];
		snprintf(buf, len, "a free receive slot (other groups' pairs hold them%s)",
			 held ? "; failed pairs' GPU work that has not landed keeps some" : "");
		return;
	}
	case ST_FLUSH_D:
	case ST_FLUSH_C:
		snprintf(buf, len, "%u copies of the outputs into the ranks' GPU memory", p->out.pending);
		return;
	default:
		break;
	}
	uint32_t d = rw_sched_wave_dst(x->nodes, x->me, p->send.wave + (p->send.state == SEND_WAIT_GRANT));
	if (p->send.state == SEND_WAIT_GRANT) {
		snprintf(buf, len, "node %u (%s) to grant wave %u", d, x->svc->cfg.nodes[d].name,
			 p->send.wave + 1);
	} else if (p->send.state == SEND_WAIT_PACK && x->nodes == 1) {
		snprintf(buf, len, "the data mover's pack of this node's own records");
	} else if (p->send.state == SEND_WAIT_PACK) {
		snprintf(buf, len, "the data mover's pack kernels for wave %u", p->send.wave);
	} else if (p->send.state == SEND_DRAINING || p->send.state == SEND_PACED) {
		snprintf(buf, len, "%u rail writes of wave %u to be acknowledged", p->send.pending,
			 p->send.wave);
	} else if (p->recv[kind].ranges_left) {
		exec_recv_waiting(p, kind, who, sizeof(who));
		snprintf(buf, len, "data from %s", who);
	} else {
		snprintf(buf, len, "this node's local work");
	}
}

static void timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	exec_pair_t *p = w->data;
	char what[256];
	describe_wait(p, what, sizeof(what));
	exec_pair_fail(p, RW_ERR_TIMEOUT, "timed out after %u ms waiting for %s",
		       p->x->svc->cfg.phase_timeout_ms, what);
}

static void pair_arm_timer(exec_pair_t *p)
{
	ev_timer_stop(p->x->svc->loop, &p->timer);
	ev_timer_set(&p->timer, p->x->svc->cfg.phase_timeout_ms / 1000.0, 0.);
	ev_timer_start(p->x->svc->loop, &p->timer);
}

/* ---- sending and local work ----------------------------------------------------------------- */

static void local_start(exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	if (p->local.state[kind] != LOCAL_IDLE)
		return;
	p->local.state[kind] = LOCAL_RUNNING;
	ev_idle_start(p->x->svc->loop, &p->x->local_idle);
}

/* After the sender moved: arm the pace timer, start the local work once the first writes are
 * out (it then overlaps the network), and see whether the phase is done. */
static void after_send(exec_pair_t *p)
{
	exec_t *x = p->x;
	if (p->send.state == SEND_PACED) {
		ev_timer_set(&p->pace, x->hooks.write_gap_s, 0.);
		ev_timer_start(x->svc->loop, &p->pace);
	}
	if (p->send.waves_posted > 0 || p->send.state == SEND_DONE)
		local_start(p, p->send.kind);
	pair_check_done(p);
}

static void send_progress(exec_pair_t *p)
{
	if (exec_send_progress(p) != RW_OK)
		return pair_failed(p);
	after_send(p);
}

static void pace_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	exec_pair_t *p = w->data;
	if (exec_open(p) && p->send.state == SEND_PACED)
		send_progress(p);
}

/* Run one kind: bytes that came before are checked first, then the first wave is posted. */
static void pair_run(exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	EXEC_TRACE(p, exec_trace_mark_(p, kind, EXEC_TRACE_RUN));
	exec_send_begin(p, kind);
	if (exec_recv_scan(p, kind) != RW_OK)
		return pair_failed(p);
	send_progress(p);
}

/* The host count pass runs in idle slices (no mover count, or the mover declined). */
static int host_counting(const exec_pair_t *p)
{
	return p->stage == ST_COUNT_HOST;
}

/* The records pass runs in idle slices once the row is counted and every rank's ids are
 * readable: while the row travels to the peers (WAIT_SLOT, EXCHANGE). */
static int records_due(const exec_pair_t *p)
{
	return (p->stage == ST_WAIT_SLOT || p->stage == ST_EXCHANGE) && !p->plan.recs_done &&
	       subs_ready(p, RW_SVC_DISPATCH);
}

static void local_cb(struct ev_loop *loop, ev_idle *w, int revents)
{
	(void)revents;
	exec_t *x = w->data;
	exec_pair_t *p, *found = NULL;
	rw_list_for_each(&x->pairs, p, link)
		if (exec_open(p) && (host_counting(p) || records_due(p) ||
				     p->local.state[exec_kind(p)] == LOCAL_RUNNING)) {
			found = p;
			break;
		}
	if (!found) {
		ev_idle_stop(loop, w);
		return;
	}
	p = found;
	const rw_svc_phase_kind_t kind = exec_kind(p);
	int done = 0;
	char why[RW_SVC_WHY_MAX];
	const uint32_t budget = x->hooks.local_slice ? x->hooks.local_slice : EXEC_COUNT_SLICE;
	if (host_counting(p)) {
		if (exec_plan_count(p, budget, &done) != RW_OK)
			return pair_failed(p);
		if (done)
			pair_counted(p);
		return;
	}
	if (records_due(p)) {
		if (exec_plan_records(p, budget, &done) != RW_OK)
			return pair_failed(p);
		if (done) {
			p->plan.recs_done = 1;
			PTRACE(p, "%s", "records built");
			pair_try_decide(p);
		}
		return;
	}
	rw_status_t st = p->mv->local(p->mv_mover, p->mv_state, &p->ph, kind,
				      x->hooks.local_slice ? x->hooks.local_slice : EXEC_LOCAL_SLICE,
				      &done, why);
	if (st != RW_OK)
		return exec_pair_fail(p, st, "%s", why);
	if (!done)
		return;
	p->local.state[kind] = LOCAL_DONE;
	pair_check_done(p);
}

/* ---- completion ----------------------------------------------------------------------------- */

/* Every rank of the running kind gets its completion. A dispatch leaves the pair waiting for
 * its combine (or closes it while draining); a combine closes it. */
static void complete(exec_pair_t *p)
{
	exec_t *x = p->x;
	const rw_svc_phase_kind_t kind = exec_kind(p);
	for (uint32_t g = 0; g < x->gpus; g++)
		(kind == RW_SVC_COMBINE ? exec_answer_combine : exec_answer_dispatch)(x, p, g);
	rw_svc_metrics_phase(&x->svc->metrics, p->plan.path, kind, 1, rw_now_ns() - p->phase_t0);
	exec_carve_ran(p);
	EXEC_TRACE(p, exec_trace_end_(p, kind, RW_OK));
	if (kind == RW_SVC_DISPATCH && p->held.st != RW_OK) { /* exec_pair_fail_peer */
		exec_stage_move(p, ST_WAIT_C);
		p->err = p->held;
		pair_failed(p);
		return;
	}
	p->out.page_done = 0; /* the combine's page ranks count their own done */
	if (p->page_busy) { /* the rank path: until the combine's first submit, nothing runs */
		x->svc->metrics.rank_path_phases++;
		x->svc->metrics.rank_path_done[kind]++;
		exec_page_busy(p, 0);
	}
	if (kind == RW_SVC_DISPATCH && !x->svc->draining) {
		exec_stage_move(p, ST_WAIT_C);
		ev_timer_stop(x->svc->loop, &p->timer);
		return;
	}
	pair_close(p, 1);
}

/* Every byte of the running kind is here, sent, and the local work is done: the mover writes
 * the ranks' outputs (maybe asynchronously), then the ranks are answered. */
static void pair_check_done(exec_pair_t *p)
{
	const rw_svc_phase_kind_t kind = exec_kind(p);
	if ((p->stage != ST_RUN_D && p->stage != ST_RUN_C) || p->send.state != SEND_DONE ||
	    p->local.state[kind] != LOCAL_DONE || p->recv[kind].ranges_left)
		return;
	PTRACE(p, "%s", "all data here, flush");
	exec_stage_move(p, kind == RW_SVC_DISPATCH ? ST_FLUSH_D : ST_FLUSH_C);
	char why[RW_SVC_WHY_MAX];
	uint32_t pending = 0;
	rw_status_t st = p->mv->finish(p->mv_mover, p->mv_state, &p->ph, kind, &pending, why);
	p->out.pending = pending;
	if (st != RW_OK)
		return exec_pair_fail(p, st, "%s", why);
	if (pending == 0)
		complete(p);
}

/* ---- gather, exchange, decide ----------------------------------------------------------------- */

/* The pair's slot: its group's carve-out where it has one and the mover takes fresh areas per
 * pair (the CUDA mover maps the shared slots once and keeps them), and either reads it only
 * through the header pull (the rank path) or the daemon's CPU reads the carve-out in place (not
 * a discrete GPU's memory); else a free shared slot: not busy, not kept for a failed pair's GPU
 * work (slot_hold_check), idle past a failed pair's heartbeat timeout. */
static int slot_take(exec_t *x, exec_pair_t *p)
{
	uint64_t now = rw_now_ns();
	if (p->g->carve >= 0 && !p->mv->areas_fixed &&
	    (p->mv->no_records || rw_svc_mesh_carve_cpu(x->mesh, (uint32_t)p->g->carve))) {
		if (now < p->g->carve_free_at)
			return -1;
		rw_svc_mesh_carve_hold(x->mesh, (uint32_t)p->g->carve);
		p->carve = p->g->carve;
		return EXEC_SLOTS + p->g->carve;
	}
	for (int s = 0; s < EXEC_SLOTS; s++)
		if (!x->slot_busy[s] && !x->slot_held[s] && now >= x->slot_free_at[s]) {
			x->slot_busy[s] = 1;
			return s;
		}
	return -1;
}

/* Every shared slot is kept for a failed pair whose work may still land on a GPU declared
 * stalled: none frees before that GPU moves again, so a pair waiting for one is refused, named
 * (why: the first such GPU), rather than left to its phase timeout. While one of them
 * waits on a GPU not (yet) declared stalled, or a slot is only busy or idle, the pair waits. */
static int slots_stalled(const exec_t *x, char *why, size_t len)
{
	for (int s = 0; s < EXEC_SLOTS; s++)
		if (!x->slot_held[s])
			return 0; /* a slot only busy or idle: the pair waits */
	int list[64];
	unsigned n = rw_svc_gpu_stalled_list(list, 64, NULL);
	uint64_t gpus = 0;
	for (unsigned i = 0; i < n; i++)
		gpus |= 1ull << list[i];
	if (!gpus)
		return 0;
	uint64_t stalled = 0;
	for (int s = 0; s < EXEC_SLOTS; s++) {
		const exec_pair_t *q;
		uint64_t devs = 0;
		rw_list_for_each(&x->pairs, q, link)
			if (q->slot_held == s)
				devs = rw_svc_phase_devs(&q->ph, RW_SVC_DEVS_RANKS |
							 RW_SVC_DEVS_SLABS); /* its kernels' and copies' */
		if (!(devs & gpus))
			return 0;
		stalled |= devs & gpus;
	}
	int d = 0;
	while (!(stalled >> d & 1))
		d++;
	snprintf(why, len, "no receive slot is free: GPU %d is stalled, and failed pairs' kernels "
		 "queued on it may still write each of the %d slots (refused until it moves again)", d,
		 EXEC_SLOTS);
	return 1;
}

static void pair_exchange(exec_pair_t *p)
{
	exec_t *x = p->x;
	int slot = slot_take(x, p);
	char why[RW_SVC_WHY_MAX];
	if (slot < 0 && slots_stalled(x, why, sizeof(why)))
		return exec_pair_fail(p, RW_ERR_DEVICE, "%s", why);
	if (slot < 0) {
		if (p->stage != ST_WAIT_SLOT)
			exec_stage_move(p, ST_WAIT_SLOT); /* the tick retries */
		return;
	}
	p->xchg.slot = slot;
	PTRACE(p, "group %s: slot %d", p->g->name, slot);
	exec_areas_set(p, slot);
	exec_stage_move(p, ST_EXCHANGE);
	if (exec_plan_send_row(p) != RW_OK)
		return pair_failed(p);
	exec_rows_take(x, p); /* rows that came early */
	pair_try_decide(p);
}

/* Every local rank has submitted its dispatch and its inputs are readable, and the mover does
 * not count: count in idle slices (a big submission must not starve heartbeats and other
 * groups), then exchange. */
static void pair_gathered(exec_pair_t *p)
{
	PTRACE(p, "%s", "gathered");
	exec_stage_move(p, ST_COUNT_HOST);
	ev_idle_start(p->x->svc->loop, &p->x->local_idle);
}

/* Our count row is complete: it goes to the peers at once (the row is all they need), and the
 * records pass runs while their rows travel; the decision waits for both (docs/dataflow.md
 * "Count exchange"). */
static void pair_counted(exec_pair_t *p)
{
	exec_t *x = p->x;
	if (exec_plan_counted(p) != RW_OK)
		return pair_failed(p);
	if (p->mv->no_records) { /* the ranks write the records: no records pass */
		exec_plan_tokens(p);
		p->plan.recs_done = 1;
	}
	PTRACE(p, "counted (%s)", p->stage == ST_COUNT_MOVER ? p->mv->name : "host");
	pair_exchange(p);
	if (exec_open(p) && records_due(p))
		ev_idle_start(x->svc->loop, &x->local_idle);
}

/* Every local rank has submitted its dispatch: a mover that counts is asked for the row now,
 * before the ranks' ids are staged on the host (some may still be copying). */
static void pair_count_mover(exec_pair_t *p)
{
	exec_t *x = p->x;
	char why[RW_SVC_WHY_MAX] = "";
	int pending = 0;
	uint32_t bad = 0;
	size_t nr = (size_t)x->nodes * x->rails;
	rw_status_t st = p->mv->count(p->mv_mover, p->mv_state, &p->ph, p->xchg.counts + x->me * nr,
				      &pending, &bad, why);
	if (st == RW_ERR_UNSUPPORTED)
		return; /* the host counts, once every rank's ids are readable */
	exec_stage_move(p, ST_COUNT_MOVER);
	PTRACE(p, "%s", "gathered, the mover counts");
	if (st == RW_ERR_SUB_TOKENS) {
		exec_plan_bad_ids(p, bad);
		return pair_failed(p);
	}
	if (st != RW_OK)
		return exec_pair_fail(p, st, "%s", why);
	if (!pending) /* else its RW_MV_OP_COUNTED report follows */
		pair_counted(p);
}

static void pair_try_decide(exec_pair_t *p)
{
	if (p->stage != ST_EXCHANGE || p->xchg.n_rows < p->x->nodes || !p->plan.recs_done)
		return;
	if (exec_plan_decide(p) != RW_OK)
		return pair_failed(p);
	EXEC_TRACE(p, exec_trace_decided_(p));
	exec_recv_begin(p, RW_SVC_DISPATCH);
	exec_recv_begin(p, RW_SVC_COMBINE);
	exec_stage_move(p, ST_RUN_D);
	PTRACE(p, "decided %s", rw_sched_path_name(p->plan.path));
	pair_run(p, RW_SVC_DISPATCH);
}

static int subs_ready(const exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	if (p->in[kind].n_sub < p->x->gpus)
		return 0;
	for (uint32_t g = 0; g < p->x->gpus; g++)
		if (!p->in[kind].sub[g].ready)
			return 0;
	return 1;
}

/* A kind's inputs may all be in: move on. */
static void pair_inputs_moved(exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	if (!subs_ready(p, kind))
		return;
	EXEC_TRACE(p, exec_trace_mark_(p, kind, EXEC_TRACE_READY));
	if (kind == RW_SVC_DISPATCH && p->stage == ST_GATHER_D) {
		pair_gathered(p);
	} else if (kind == RW_SVC_DISPATCH && records_due(p)) { /* the mover counted first */
		ev_idle_start(p->x->svc->loop, &p->x->local_idle);
	} else if (kind == RW_SVC_COMBINE && p->stage == ST_WAIT_C) {
		PTRACE(p, "%s", "combine inputs folded");
		exec_stage_move(p, ST_RUN_C);
		p->phase_t0 = rw_now_ns();
		pair_arm_timer(p);
		pair_run(p, RW_SVC_COMBINE);
	}
}

/* ---- events from the adapters ------------------------------------------------------------------ */

exec_pair_t *exec_pair_open(exec_t *x, exec_group_t *g, const rw_wire_key_t *key,
			    const rw_sqe_t *sqe)
{
	exec_pair_t *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->x = x;
	p->key = *key;
	p->tag = rw_wire_key_tag(key);
	p->serial = ++x->next_serial;
	p->carve = -1;
	p->slot_held = -1;
	p->stage = ST_GATHER_D; /* where every pair begins: no change to check */
	p->t0 = p->phase_t0 = rw_now_ns();
	if (exec_plan_init(p, sqe) != RW_OK || exec_recv_init(p) != RW_OK) {
		rw_svc_layout_free(&p->plan.layout);
		rw_arena_free(&p->mem);
		free(p);
		return NULL;
	}
	ev_timer_init(&p->timer, timer_cb, 0., 0.);
	p->timer.data = p;
	ev_timer_init(&p->pace, pace_cb, 0., 0.);
	p->pace.data = p;
	rw_list_add(&x->pairs, &p->link);
	p->g = g;
	g->pair = p;
	memcpy(p->xchg.params.key_fp, g->key_fp, sizeof(p->xchg.params.key_fp));
	exec_rows_hold(x, g->name, key); /* peers' rows that came first wait for this pair */
	if (x->trace)
		exec_trace_open_(p);
	pair_arm_timer(p);
	return p;
}

exec_pair_t *exec_pair_by_key(exec_t *x, const rw_wire_key_t *key)
{
	exec_pair_t *p;
	rw_list_for_each(&x->pairs, p, link)
		if (exec_open(p) && rw_wire_key_eq(&p->key, key))
			return p;
	return NULL;
}

exec_pair_t *exec_pair_by_tag(exec_t *x, uint32_t tag14)
{
	exec_pair_t *p;
	rw_list_for_each(&x->pairs, p, link)
		if (exec_open(p) && p->stage >= ST_EXCHANGE && rw_wire_imm_tag(p->ph.tag_in) == tag14)
			return p;
	return NULL;
}

/* The local ranks of the pair's group that hold a rank page (bit g), where the group has slabs of
 * its own: the rank mover then carries the group's ring ranks beside them (docs/rankpath.md
 * "Ring and page ranks in one group"), whichever rank submits first. */
static uint32_t page_members(const exec_pair_t *p)
{
	const exec_t *x = p->x;
	uint32_t m = 0;
	if (!x->ipc || !p->g || p->g->carve < 0)
		return 0;
	for (uint32_t l = 0; l < x->gpus; l++)
		if (p->g->member[l] && rw_ipc_client_page(p->g->member[l]->client, NULL))
			m |= 1u << l;
	return m;
}

/* The first of the daemon's movers that takes every submission of `kind` the pair has; -1: none. */
static int mover_pick(exec_pair_t *p, rw_svc_phase_kind_t kind)
{
	const exec_t *x = p->x;
	p->ph.page_members = page_members(p);
	for (uint32_t i = 0; i < x->n_movers; i++) {
		uint32_t h = 0;
		while (h < x->gpus && (!p->in[kind].sub[h].have ||
				       x->movers[i].ops->accepts(x->movers[i].mover, &p->ph, kind, h)))
			h++;
		if (h == x->gpus)
			return (int)i;
	}
	return -1;
}

/* A later dispatch the pair's mover does not take (a page rank coming to ring ranks whose
 * submissions another mover took before the page rank had its page): while the pair gathers,
 * it moves to the first mover that takes every submission so far. The old one is quiesced
 * first (it waits for its copies of the ranks' inputs still in flight: a group's first phases
 * only) and closed, its reports ignored since; the new one stages the earlier submissions again.
 * RW_OK, or RW_ERR_SUB_BUFFER with nothing changed. */
static rw_status_t mover_move(exec_pair_t *p, uint32_t g, char *why)
{
	exec_t *x = p->x;
	const int i = p->stage == ST_GATHER_D ? mover_pick(p, RW_SVC_DISPATCH) : -1;
	if (i < 0)
		return RW_ERR_SUB_BUFFER;
	p->mv->quiesce(p->mv_mover, p->mv_state);
	p->mv->close(p->mv_mover, p->mv_state);
	p->in[RW_SVC_DISPATCH].staging = 0;
	p->mv_state = NULL;
	p->mv = x->movers[i].ops;
	p->mv_mover = x->movers[i].mover;
	if (p->mv->open(p->mv_mover, &p->ph, &p->mv_state) != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "cannot open a data mover");
		return RW_ERR_NOMEM;
	}
	PTRACE(p, "moved to the %s mover for local rank %u", p->mv->name, g);
	for (uint32_t h = 0; h < x->gpus; h++) {
		exec_sub_t *s = &p->in[RW_SVC_DISPATCH].sub[h];
		if (h == g || !s->have)
			continue;
		int pending = 0;
		rw_status_t st = p->mv->stage(p->mv_mover, p->mv_state, &p->ph, RW_SVC_DISPATCH, h,
					      &pending, why);
		if (st != RW_OK)
			return st;
		s->ready = !pending;
		p->in[RW_SVC_DISPATCH].staging += pending != 0;
	}
	return RW_OK;
}

/* ---- the rule of absences (docs/rankpath.md "Failure") ------------------------------------- */

void exec_seat_took(exec_group_t *g, uint32_t local, const rw_wire_key_t *key)
{
	g->seat[local] = (exec_seat_t){ .state = SEAT_ON, .last = *key };
}

/* What pair p still waits for from seat `local`: its dispatch while it gathers without it,
 * its combine from its dispatch on until the seat's combine came. */
static int seat_awaits(const exec_pair_t *p, uint32_t local, int kind)
{
	const int dispatch_in = p->in[RW_SVC_DISPATCH].sub[local].have;
	if (kind == RW_SVC_DISPATCH)
		return p->stage == ST_GATHER_D && !dispatch_in;
	return p->stage <= ST_WAIT_C && !p->in[RW_SVC_COMBINE].sub[local].have &&
	       (p->stage == ST_WAIT_C || dispatch_in);
}

void exec_seat_absent(exec_t *x, exec_group_t *g, uint32_t local, const rw_wire_key_t *key,
		      int kind, exec_absence_t how, const char *why)
{
	exec_pair_t *p = g->pair;
	const rw_status_t st = how == EXEC_ABSENT_REFUSED ? RW_ERR_INVAL : RW_ERR_CLIENT;
	if (!p || !rw_wire_key_eq(&p->key, key)) {
		if (kind != RW_SVC_COMBINE)
			exec_key_fail(x, g->name, key, local, why);
		return; /* a combine no pair here waits for: its rank's alone */
	}
	if (kind != RW_SVC_COMBINE && seat_awaits(p, local, RW_SVC_DISPATCH)) {
		if (how == EXEC_ABSENT_REFUSED)
			p->answered |= 1u << local;
		return exec_pair_fail(p, st, "%s", why);
	}
	if (kind == RW_SVC_DISPATCH || !seat_awaits(p, local, RW_SVC_COMBINE))
		return; /* the pair has the seat's answer */
	if (p->stage == ST_WAIT_C)
		return exec_pair_fail(p, st, "%s", why);
	/* Its dispatch still runs here: it runs to its end, every rank gets its rows, and the pair
	 * then fails as a combine failure on every node (complete), as when a rank leaves in its
	 * dispatch's flush (exec_on_rank_left). */
	if (p->held.st == RW_OK && p->err.st == RW_OK) {
		p->held = (exec_error_t){ .st = st, .tell = EXEC_TELL_PEERS };
		snprintf(p->held.msg, sizeof(p->held.msg), "%s", why);
	}
}

exec_skip_t exec_dispatch_skip(const exec_t *x, const exec_member_t *mb, const exec_pair_t *p,
			       const rw_wire_key_t *key, char *why, size_t len)
{
	if (!p || rw_wire_key_eq(&p->key, key) || p->stage != ST_GATHER_D ||
	    p->in[RW_SVC_DISPATCH].sub[mb->local].have)
		return EXEC_SKIP_NONE;
	const uint32_t rank = x->me * x->gpus + mb->local;
	const exec_seat_t *seat = &mb->g->seat[mb->local];
	if (seat->state == SEAT_NEW) {
		snprintf(why, len, "local rank %u joined again and went on to layer %u step %llu "
			 "without this dispatch", rank, key->layer, (unsigned long long)key->step);
		return EXEC_SKIP_PAIR;
	}
	if (seat->state == SEAT_ON && rw_wire_key_eq(&seat->last, &p->key)) {
		snprintf(why, len, "local rank %u had its answer for this dispatch and went on to "
			 "layer %u step %llu", rank, key->layer, (unsigned long long)key->step);
		return EXEC_SKIP_PAIR;
	}
	if (seat->state == SEAT_ON && rw_wire_key_eq(&seat->last, key)) {
		snprintf(why, len, "layer %u step %llu failed already; the group went on to layer %u "
			 "step %llu", key->layer, (unsigned long long)key->step, p->key.layer,
			 (unsigned long long)p->key.step);
		return EXEC_SKIP_DONE;
	}
	uint32_t subs = 0, g = 0;
	for (uint32_t l = 0; l < x->gpus; l++)
		if (p->in[RW_SVC_DISPATCH].sub[l].have) {
			subs |= 1u << l;
			g = l;
		}
	if (!subs || (subs & ~p->fresh) != 0)
		return EXEC_SKIP_NONE;
	snprintf(why, len, "local rank %u joined again and went on to layer %u step %llu without "
		 "this dispatch", x->me * x->gpus + g, p->key.layer, (unsigned long long)p->key.step);
	return EXEC_SKIP_MINE;
}

void exec_key_fail(exec_t *x, const char *group, const rw_wire_key_t *key, uint32_t local,
		   const char *why)
{
	/* No pair, so no epoch: the failure gets an id of its own, which the peers that pass it on
	 * repeat, so a node that hears of it twice acts once. */
	const uint32_t id = exec_epoch_new(++x->next_serial);
	exec_key_end(x, &(exec_key_end_t){ .group = group, .key = key, .kind = RW_SVC_DISPATCH,
					   .st = RW_ERR_INVAL, .msg = why, .answered = 1u << local,
					   .epoch = id, .cause_node = x->me, .cause_id = id,
					   .tell = EXEC_TELL_PEERS });
}

void exec_on_submit(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t g)
{
	exec_t *x = p->x;
	char why[RW_SVC_WHY_MAX];
	EXEC_TRACE(p, exec_trace_submit_(p, kind, g));
	exec_group_t *grp = p->g;
	if (kind == RW_SVC_DISPATCH && grp && grp->seat[g].state == SEAT_NEW)
		p->fresh |= 1u << g; /* its first dispatch since it joined */
	/* A gap is owed to the ranks that went on beside the seat: a rank new since its join (a
	 * group formed again, its ranks restarted one by one) may be ahead of the one that left
	 * only in being back first, and the seat's next rank runs this key with it. */
	for (uint32_t l = 0; kind == RW_SVC_DISPATCH && grp && !(p->fresh & (1u << g)) &&
			     l < x->gpus; l++) {
		if (grp->seat[l].state != SEAT_GAP)
			continue;
		/* the key its rank skipped; the pairs after it wait for a rank to take the seat */
		for (uint32_t m = 0; m < x->gpus; m++)
			if (grp->seat[m].state == SEAT_GAP)
				grp->seat[m].state = SEAT_WAIT;
		snprintf(why, sizeof(why), "local rank %u left before this dispatch (its seat is "
			 "empty)", x->me * x->gpus + l);
		return exec_seat_absent(x, grp, l, &p->key, RW_SVC_DISPATCH, EXEC_ABSENT_GONE, why);
	}
	if (kind == RW_SVC_COMBINE && p->in[kind].n_sub == 1) { /* the combine's clock starts */
		p->phase_t0 = rw_now_ns();
		pair_arm_timer(p);
	}
	if (!p->mv) {
		const int i = mover_pick(p, kind);
		if (i >= 0) {
			p->mv = x->movers[i].ops;
			p->mv_mover = x->movers[i].mover;
		}
		if (!p->mv || p->mv->open(p->mv_mover, &p->ph, &p->mv_state) != RW_OK)
			return exec_pair_fail(p, RW_ERR_NOMEM, "cannot open a data mover");
		PTRACE(p, "local rank %u submitted first: the %s mover", g, p->mv->name);
	} else if (!p->mv->accepts(p->mv_mover, &p->ph, kind, g)) {
		PTRACE(p, "local rank %u submitted, the %s mover does not take it", g, p->mv->name);
		rw_status_t st = kind == RW_SVC_DISPATCH ? mover_move(p, g, why) : RW_ERR_SUB_BUFFER;
		if (st == RW_ERR_SUB_BUFFER && (p->ph.io[kind][g].page || p->mv == &rw_svc_mover_rank))
			return exec_pair_fail(p, st, "local rank %u submits %s beside ranks that submit "
					      "%s: a group whose ranks on a node mix the ring and the page "
					      "runs on slabs of its own, which this group has not (the "
					      "daemon's group_pool_mib was spent, or group_area_mib is 0)",
					      x->me * x->gpus + g,
					      p->ph.io[kind][g].page ? "by its rank page" : "on its ring",
					      p->ph.io[kind][g].page ? "on their rings" : "by their pages");
		if (st == RW_ERR_SUB_BUFFER)
			return exec_pair_fail(p, st, "local rank %u's buffers need another data mover "
					      "than the phase's (%s)", x->me * x->gpus + g, p->mv->name);
		if (st != RW_OK)
			return exec_pair_fail(p, st, "%s", why);
	}
	int pending = 0;
	rw_status_t st = p->mv->stage(p->mv_mover, p->mv_state, &p->ph, kind, g, &pending, why);
	if (st != RW_OK)
		return exec_pair_fail(p, st, "%s", why);
	if (pending)
		p->in[kind].staging++; /* the mover reports */
	else
		p->in[kind].sub[g].ready = 1;
	if (kind == RW_SVC_DISPATCH && p->in[kind].n_sub == x->gpus && p->stage == ST_GATHER_D &&
	    p->mv->count) {
		pair_count_mover(p);
		if (!exec_open(p))
			return;
	}
	if (!pending)
		pair_inputs_moved(p, kind);
}

/* The stalled GPU one of local rank g's spans lies on, named in why. */
static void rank_gpu_stalled(const rw_svc_phase_t *ph, uint32_t g, char *why, size_t len)
{
	for (int k = 0; k < RW_SVC_KIND_COUNT; k++) {
		const rw_svc_rank_io_t *io = &ph->io[k][g];
		const int dev[4] = { io->in[0].dev, io->in[1].dev, io->in[2].dev, io->out.dev };
		for (int i = 0; i < 4; i++)
			if (dev[i] >= 0 && rw_svc_gpu_stalled(dev[i], why, len))
				return;
	}
}

void exec_on_mover_done(void *ctx, uint32_t serial, rw_svc_mover_op_t op, uint32_t g, rw_status_t st)
{
	exec_t *x = ctx;
	exec_pair_t *p, *nx;
	if (op == RW_MV_OP_ALL) { /* a device faulted: every pair waiting on it fails */
		rw_list_for_each_safe(&x->pairs, p, nx, link)
			if (exec_open(p) && (p->in[RW_SVC_DISPATCH].staging || p->in[RW_SVC_COMBINE].staging || p->out.pending ||
					     p->send.state == SEND_WAIT_PACK || p->stage == ST_COUNT_MOVER))
				exec_pair_fail(p, RW_ERR_DEVICE, "a CUDA copy failed: %s",
					       rw_status_str(st));
		return;
	}
	exec_pair_t *found = NULL;
	rw_list_for_each(&x->pairs, p, link)
		if (exec_open(p) && p->serial == serial) {
			found = p;
			break;
		}
	if (!found || g >= (op == RW_MV_OP_REFUSED ? x->nodes : x->gpus))
		return; /* a pair that ended meanwhile */
	p = found;
	if (op == RW_MV_OP_REFUSED) { /* g: the node whose range was refused */
		exec_recv_refused(p, g, st);
		return pair_failed(p);
	}
	if (op == RW_MV_OP_COUNTED) {
		if (p->stage != ST_COUNT_MOVER)
			return;
		if (st == RW_ERR_SUB_TOKENS) {
			exec_plan_bad_ids(p, g);
			return pair_failed(p);
		}
		if (st != RW_OK)
			return exec_pair_fail(p, st, "the data mover's count (%s) failed: %s",
					      p->mv->name, rw_status_str(st));
		return pair_counted(p);
	}
	if (st != RW_OK) {
		char stalled[RW_SVC_WHY_MAX] = "";
		if (st == RW_ERR_TIMEOUT) /* a GPU stopped: name it (the movers' stall bound) */
			rank_gpu_stalled(&p->ph, g, stalled, sizeof(stalled));
		return exec_pair_fail(p, RW_ERR_DEVICE, "a CUDA copy for local rank %u failed: %s",
				      x->me * x->gpus + g, stalled[0] ? stalled : rw_status_str(st));
	}
	if (op == RW_MV_OP_STAGE_D || op == RW_MV_OP_STAGE_C) {
		const rw_svc_phase_kind_t kind =
			op == exec_kind_desc(RW_SVC_COMBINE)->staged ? RW_SVC_COMBINE : RW_SVC_DISPATCH;
		if (p->in[kind].staging)
			p->in[kind].staging--;
		p->in[kind].sub[g].ready = 1;
		pair_inputs_moved(p, kind);
	} else if (op == RW_MV_OP_FINISH && (p->stage == ST_FLUSH_D || p->stage == ST_FLUSH_C) &&
		   p->out.pending &&
		   --p->out.pending == 0) {
		complete(p);
	} else if (op == RW_MV_OP_PACKED && (p->stage == ST_RUN_D || p->stage == ST_RUN_C) &&
		   p->send.state == SEND_WAIT_PACK) {
		send_progress(p);
	}
}

void exec_on_counts(exec_pair_t *p, uint32_t node, const rw_wire_counts_t *c)
{
	exec_plan_take_counts(p, node, c);
	pair_try_decide(p);
}

void exec_on_data(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t peer, uint32_t rail,
		  uint64_t len, int last, uint64_t at)
{
	if (exec_recv_data(p, kind, peer, rail, len, last, at) != RW_OK)
		return pair_failed(p);
	pair_check_done(p);
}

void exec_on_write_done(exec_pair_t *p, uint32_t peer, uint32_t rail, rw_status_t st)
{
	p->outstanding--;
	if (!exec_open(p))
		return; /* the reaper frees it once the last write reported */
	if (st != RW_OK)
		return exec_pair_fail(p, st, "a rail write to node %u (%s) on rail %u "
				      "failed: %s", peer, p->x->svc->cfg.nodes[peer].name, rail,
				      rw_status_str(st));
	if (--p->send.pending == 0 && p->send.state == SEND_DRAINING) {
		EXEC_TRACE(p, exec_trace_wave_done_(p));
		PTRACE(p, "wave %u writes done: largest slab %.0f kB at %.1f Mbit/s", p->send.wave,
		       p->send.wave_slab_max / 1e3,
		       p->send.wave_slab_max * 8e3 / (double)(rw_now_ns() - p->send.wave_t0));
		send_progress(p);
	}
}

void exec_on_grant(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t wave)
{
	p->send.granted[kind][wave] = 1;
	EXEC_TRACE(p, exec_trace_granted_(p, kind, wave));
	PTRACE(p, "granted wave %u", wave);
	if ((p->stage == ST_RUN_D || p->stage == ST_RUN_C) && p->send.kind == kind &&
	    p->send.state == SEND_WAIT_GRANT && p->send.wave + 1 == wave)
		send_progress(p);
}

void exec_on_peer_down(exec_t *x, uint32_t peer, rw_status_t st)
{
	exec_pair_t *p, *nx;
	/* Every open pair involves every node. */
	rw_list_for_each_safe(&x->pairs, p, nx, link)
		if (exec_open(p) && p->stage != ST_GATHER_D)
			exec_pair_fail(p, st == RW_OK ? RW_ERR_PEER : st, "peer %u (%s) went down",
				       peer, x->svc->cfg.nodes[peer].name);
	exec_rows_drop_node(x, peer);
}

void exec_on_rail_down(exec_t *x, uint32_t peer, uint32_t rail, rw_status_t st)
{
	exec_pair_t *p, *nx;
	/* Only the pairs whose plan moves records over that rail with that peer (docs/dataflow.md
	 * "Rail health"): they fail alone with a retriable error; a retry plans without the rail. */
	rw_list_for_each_safe(&x->pairs, p, nx, link)
		if (exec_open(p) && exec_plan_uses_rail(p, peer, rail))
			exec_pair_fail(p, RW_ERR_LINK, "rail %u between node %u (%s) and node %u "
				       "(%s) went down (%s): retry the phase, it runs on the other rails",
				       rail, x->me, x->svc->cfg.nodes[x->me].name, peer,
				       x->svc->cfg.nodes[peer].name, rw_status_str(st));
}

void exec_page_busy(exec_pair_t *p, int on)
{
	exec_t *x = p->x;
	if (p->page_busy == on)
		return;
	p->page_busy = on;
	if (x->ipc)
		rw_ipc_server_pages_busy(x->ipc, on);
	if (on)
		x->svc->metrics.rank_path_busy++;
	else if (x->svc->metrics.rank_path_busy)
		x->svc->metrics.rank_path_busy--;
}

void exec_on_page_word(exec_pair_t *p, uint32_t g, unsigned word, uint64_t value)
{
	const exec_sub_t *s = &p->in[exec_kind(p)].sub[g];
	if (!exec_open(p) || !s->have || !s->page_k || (int64_t)(value - s->page_k) < 0)
		return; /* not this pair's phase of that rank */
	if (word == RW_PW_DONE && exec_kind(p) == RW_SVC_DISPATCH && p->key.layer == 0 &&
	    p->key.step + 1 == p->x->hooks.done_deaf_step)
		return; /* the test switch: its report comes too late */
	if (word == RW_PW_PACKED && (p->stage == ST_RUN_D || p->stage == ST_RUN_C) &&
	    p->send.state == SEND_WAIT_PACK) {
		send_progress(p); /* the mover's pack looks at every rank's word again */
	} else if (word == RW_PW_DONE && (p->stage == ST_FLUSH_D || p->stage == ST_FLUSH_C) &&
		   p->out.pending && !(p->out.page_done & (1u << g))) {
		p->out.page_done |= 1u << g;
		if (--p->out.pending == 0)
			complete(p);
	}
}

void exec_on_rank_left(exec_pair_t *p, rw_ipc_client_t *client, uint32_t rank)
{
	/* A page rank whose stream wrote done for the running kind reads nothing of it any more:
	 * it may go (its done is read here, since the poller's report may come after the leave). */
	const rw_svc_phase_kind_t kind = exec_kind(p);
	const int flush = p->stage == ST_FLUSH_D || p->stage == ST_FLUSH_C;
	for (uint32_t g = 0; flush && g < p->x->gpus; g++) {
		exec_sub_t *s = &p->in[kind].sub[g];
		if (!s->have || s->client != client || !s->page_k)
			continue;
		const rw_page_head_t *pg = p->ph.io[kind][g].page;
		const uint64_t done = atomic_load_explicit(&pg->word[RW_PW_DONE].v,
							   memory_order_acquire);
		if ((int64_t)(done - s->page_k) < 0)
			break;
		/* Its combine will never come: the dispatch runs to its end (every rank gets its
		 * rows) and the pair then fails as a combine failure, on every node (complete). */
		if (kind == RW_SVC_DISPATCH && p->held.st == RW_OK && p->err.st == RW_OK) {
			p->held = (exec_error_t){ .st = RW_ERR_CLIENT, .tell = EXEC_TELL_PEERS };
			snprintf(p->held.msg, sizeof(p->held.msg), "local rank %u left", rank);
		}
		exec_on_page_word(p, g, RW_PW_DONE, done);
		s->have = 0; /* no answer to a rank that has gone */
		return;
	}
	/* No completions to the leaving client; its CUDA memory stays mapped until the copies the
	 * mover queued into or out of it landed (the pair's quiesce does not wait for them) */
	for (uint32_t g = 0; p->mv_state && p->mv->fence && g < p->x->gpus; g++) {
		rw_svc_stage_fence_t f;
		if (p->in[kind].sub[g].client == client && p->in[kind].sub[g].have &&
		    p->mv->fence(p->mv_mover, p->mv_state, g, &f))
			exec_answer_late_keep(p->x, client, &f);
	}
	for (int k = 0; k < RW_SVC_KIND_COUNT; k++)
		for (uint32_t g = 0; g < p->x->gpus; g++)
			if (p->in[k].sub[g].client == client)
				p->in[k].sub[g].have = 0;
	exec_pair_fail(p, RW_ERR_CLIENT, "local rank %u left", rank);
}

/* ---- the executor's own watchers ------------------------------------------------------------ */

static void tick_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	exec_t *x = w->data;
	exec_pair_t *p, *nx;
	rw_list_for_each_safe(&x->pairs, p, nx, link)
		if (p->stage == ST_WAIT_SLOT)
			pair_exchange(p);
	exec_keys_expire(x, rw_now_ns(), (uint64_t)x->svc->cfg.phase_timeout_ms * 1000000ull);
	exec_carve_tick(x, rw_now_ns());
}

void exec_start(exec_t *x)
{
	struct ev_loop *loop = x->svc->loop;
	ev_timer_init(&x->tick, tick_cb, EXEC_TICK_S, EXEC_TICK_S);
	x->tick.data = x;
	ev_timer_start(loop, &x->tick);
	ev_idle_init(&x->local_idle, local_cb);
	x->local_idle.data = x;
	ev_prepare_init(&x->reaper, reaper_cb);
	x->reaper.data = x;
	ev_prepare_start(loop, &x->reaper);
	exec_trace_start(x);
}

void exec_fail_open(exec_t *x, const char *why)
{
	exec_pair_t *p, *nx;
	rw_list_for_each_safe(&x->pairs, p, nx, link)
		if (exec_open(p)) { /* the peers are not told: the daemon's going reaches them */
			exec_err_tell(p, RW_ERR_STATE, EXEC_TELL_NONE, "%s", why);
			pair_failed(p);
		}
}

void exec_stop(exec_t *x)
{
	struct ev_loop *loop = x->svc->loop;
	ev_timer_stop(loop, &x->tick);
	ev_idle_stop(loop, &x->local_idle);
	ev_prepare_stop(loop, &x->reaper);
	ev_timer_stop(loop, &x->page_retry);
	exec_fail_open(x, "daemon stopping");
	exec_answer_late_flush(x); /* none once rw_svc_exec_ipc_stop ran: it flushed them */
	exec_trace_stop(x); /* after the failed pairs' records */
}

void exec_free_pairs(exec_t *x)
{
	exec_pair_t *p, *nx;
	rw_list_for_each_safe(&x->pairs, p, nx, link) {
		rw_list_del(&p->link);
		free(p);
	}
}

int exec_drained(exec_t *x) { return !any_running(x); }
