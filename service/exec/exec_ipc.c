/* The executor's adapter for the trainer ranks (ipc/ipc.h; docs/dataflow.md "Groups, ranks,
 * experts", "Gather"): ranks join groups, submit dispatches and combines, and leave. Every
 * submission is checked here against the phase it joins — the IPC server has already checked
 * it against the daemon's limits and the rank's buffers — and is refused with an error that
 * names what is wrong; an accepted one is handed to the state machine (exec.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "service/exec/exec_int.h"

static exec_group_t *group_find(exec_t *x, const char *name)
{
	exec_group_t *g;
	rw_list_for_each(&x->groups, g, link)
		if (strcmp(g->name, name) == 0)
			return g;
	return NULL;
}

static void client_joined(void *ctx, rw_ipc_client_t *client)
{
	exec_t *x = ctx;
	const rw_ipc_client_info_t *info = rw_ipc_client_info(client);
	x->svc->metrics.clients++;
	if (info->world_size != x->nodes * x->gpus || info->rank / x->gpus != x->me) {
		rw_warn("rank %u of group %s: world %u / node does not fit this cluster (N=%u G=%u me=%u)",
			info->rank, info->group, info->world_size, x->nodes, x->gpus, x->me);
		exec_drop_client(x, client, RW_ERR_INVAL);
		return;
	}
	exec_group_t *g = group_find(x, info->group);
	if (!g) {
		g = calloc(1, sizeof(*g));
		if (!g) {
			exec_drop_client(x, client, RW_ERR_NOMEM);
			return;
		}
		snprintf(g->name, sizeof(g->name), "%s", info->group);
		g->hash = rw_wire_group_hash(g->name);
		g->world = info->world_size;
		rw_list_add(&x->groups, &g->link);
	}
	uint32_t local = info->rank % x->gpus;
	if (g->member[local]) {
		exec_drop_client(x, client, RW_ERR_EXISTS);
		return;
	}
	exec_member_t *mb = calloc(1, sizeof(*mb));
	if (!mb) {
		exec_drop_client(x, client, RW_ERR_NOMEM);
		return;
	}
	mb->g = g;
	mb->client = client;
	mb->local = local;
	g->member[local] = mb;
	g->n_members++;
	rw_ipc_client_set_data(client, mb);
	rw_info("rank %u of group %s joined (local %u, pid %d)", info->rank, g->name, local,
		(int)info->pid);
}

/* No copy touches a member's staging once its pairs ended (a failed pair quiesces its mover). */
void exec_member_free(exec_member_t *mb)
{
	rw_svc_pinned_free(&mb->in);
	rw_svc_pinned_free(&mb->out);
	free(mb);
}

static void client_left(void *ctx, rw_ipc_client_t *client, rw_ipc_leave_t reason, int error)
{
	exec_t *x = ctx;
	exec_member_t *mb = rw_ipc_client_data(client);
	if (x->svc->metrics.clients)
		x->svc->metrics.clients--;
	if (!mb)
		return;
	rw_ipc_client_set_data(client, NULL);
	exec_group_t *g = mb->g;
	uint32_t rank = rw_ipc_client_info(client)->rank;
	rw_info("rank %u of group %s left (%s, %d)", rank, g->name, rw_ipc_leave_str(reason), error);
	if (g->pair) /* the pair may use this rank's buffers: fail it everywhere */
		exec_on_rank_left(g->pair, client, rank);
	g->member[mb->local] = NULL;
	g->n_members--;
	exec_tomb_left(x, g->hash, mb->local);
	exec_member_free(mb);
	if (g->n_members == 0) {
		rw_list_del(&g->link);
		free(g);
	}
}

/* 0: resolved; 1: absent (RW_BUF_NONE, allowed where the length is 0); -1: unknown buffer
 * (deregistration is refused while submissions are in flight, so not expected). */
static int span_resolve(rw_ipc_client_t *client, const rw_span_t *span, rw_svc_span_mem_t *m)
{
	rw_ipc_buffer_t b;
	*m = (rw_svc_span_mem_t){ .dev = -1, .buf = RW_BUF_NONE };
	if (span->buf_id == RW_BUF_NONE)
		return 1;
	if (rw_ipc_buffer_lookup(client, span->buf_id, &b) != RW_OK)
		return -1;
	m->buf = b.id;
	if (b.kind == RW_IPC_BUF_CUDA) {
		m->dev = b.device;
		m->dptr = b.dptr + span->offset;
		return 0;
	}
	if (!b.host)
		return -1;
	m->host = (uint8_t *)b.host + span->offset;
	return 0;
}

/* A dispatch that cannot join its phase: answer it and fail the phase on every node (the open
 * pair, or, when there is none yet, a tomb here and PHASE_ERR to the peers), so no rank waits
 * for a phase timeout. */
static void dispatch_refuse(exec_t *x, exec_group_t *g, uint32_t local, rw_ipc_client_t *client,
			    const rw_sqe_t *sqe, const rw_wire_key_t *key, rw_status_t st,
			    const char *msg)
{
	rw_warn("group %s layer %u step %llu: local rank %u: %s", g->name, key->layer,
		(unsigned long long)key->step, local, msg);
	exec_answer_err(x, client, sqe, st, 0, msg);
	exec_pair_t *p = g->pair;
	if (p && rw_wire_key_eq(&p->key, key) && p->stage < ST_WAIT_C) {
		p->answered |= 1u << local;
		exec_pair_fail(p, RW_ERR_INVAL, 0, 1, "local rank %u: %s", x->me * x->gpus + local, msg);
		return;
	}
	/* No pair, so no epoch: the failure gets an id of its own, which the peers that pass it on
	 * repeat, so a node that hears of it twice acts once. */
	uint32_t id = exec_epoch_new(++x->next_serial);
	exec_tomb_add(x, g->name, key, RW_MV_DISPATCH, 1u << local, msg);
	exec_ended_add(x, key, x->me, id); /* it may come back, passed on by a peer */
	exec_tell_peers(x, &(exec_failure_t){ .key = key, .kind = RW_MV_DISPATCH, .st = RW_ERR_INVAL,
					     .msg = msg, .epoch = id, .cause_node = x->me,
					     .cause_id = id });
}

static void io_set(exec_pair_t *p, int kind, exec_member_t *mb, const rw_sqe_t *sqe,
		   const rw_svc_span_mem_t *in, unsigned n_in, const rw_svc_span_mem_t *out,
		   const rw_svc_rank_io_t *order)
{
	rw_svc_rank_io_t *io = &p->ph.io[kind][mb->local];
	memset(io, 0, sizeof(*io));
	io->wait_ev = order->wait_ev;
	io->signal = order->signal;
	io->flag_dev = order->flag_dev;
	io->flag_dptr = order->flag_dptr;
	io->flag_value = order->flag_value;
	io->n_tokens = sqe->token_count;
	for (unsigned i = 0; i < n_in; i++)
		io->in[i] = in[i];
	io->out = *out;
	io->out_offset = sqe->output.offset;
	io->out_cap = sqe->output_capacity;
	p->ph.stage_in[mb->local] = &mb->in;
	p->ph.stage_out[mb->local] = &mb->out;
}

/* Stream order (ipc/railwave.h): the rank's event and flag into its io. Every span given must
 * be CUDA memory (the event orders device work only, and the flag is written on the stream that
 * wrote the outputs), and the output's GPU the flag's. 0, or -1 with why set. */
static int stream_order_set(rw_ipc_client_t *client, const rw_sqe_t *sqe, rw_svc_rank_io_t *io,
			    unsigned n_in, char *why)
{
	if (!sqe->flags)
		return 0;
	rw_ipc_event_t ev;
	if (rw_ipc_event_lookup(client, sqe->event_id, &ev) != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "event %u is not registered", sqe->event_id);
		return -1;
	}
	for (unsigned i = 0; i <= n_in; i++) {
		const rw_svc_span_mem_t *m = i < n_in ? &io->in[i] : &io->out;
		if (m->buf != RW_BUF_NONE && m->dev < 0) {
			snprintf(why, RW_SVC_WHY_MAX, "stream-ordered submission (flags 0x%x) with a "
				 "host-memory span: every span must be CUDA memory", sqe->flags);
			return -1;
		}
	}
	if ((sqe->flags & RW_SQE_SIGNAL) && io->out.buf != RW_BUF_NONE && io->out.dev != ev.device) {
		snprintf(why, RW_SVC_WHY_MAX, "the output is on GPU %d and event %u's flag on GPU %d: "
			 "they must be one", io->out.dev, sqe->event_id, ev.device);
		return -1;
	}
	io->wait_ev = (sqe->flags & RW_SQE_WAIT_EVENT) ? ev.event : NULL;
	io->signal = (sqe->flags & RW_SQE_SIGNAL) != 0;
	io->flag_dev = ev.device;
	io->flag_dptr = ev.flag_dptr;
	io->flag_value = sqe->output.reserved;
	return 0;
}

static void submit_dispatch(exec_t *x, exec_member_t *mb, rw_ipc_client_t *client,
			    const rw_sqe_t *sqe)
{
	exec_group_t *g = mb->g;
	rw_wire_key_t key = { .group = g->hash, .layer = sqe->layer, .step = sqe->step };
	char why[RW_SVC_WHY_MAX];
	const char *failed = exec_tomb_hit(x, &key, RW_MV_DISPATCH, mb->local);
	if (failed) {
		exec_answer_err(x, client, sqe, RW_ERR_STATE, 1, failed);
		return;
	}
	exec_pair_t *p = g->pair;
	if (p && !rw_wire_key_eq(&p->key, &key)) {
		if (p->stage == ST_WAIT_C && p->in[RW_MV_COMBINE].n_sub == 0) {
			exec_pair_abandon(p); /* the trainer moved on without a combine */
			p = NULL;
		} else {
			snprintf(why, sizeof(why), "layer %u step %llu is still running in this group",
				 p->key.layer, (unsigned long long)p->key.step);
			exec_answer_err(x, client, sqe, RW_ERR_SUB_STATE, 0, why);
			return;
		}
	}
	if (p && (p->stage != ST_GATHER_D || p->in[RW_MV_DISPATCH].sub[mb->local].have)) {
		exec_answer_err(x, client, sqe, RW_ERR_SUB_STATE, 0,
				"this rank already submitted this dispatch");
		return;
	}
	/* E: the group's experts, evenly over its W ranks, the same for every rank of the phase
	 * (docs/dataflow.md "Groups, ranks, experts"). */
	if (sqe->n_experts % g->world != 0) {
		snprintf(why, sizeof(why), "n_experts %u is not a multiple of the world size %u",
			 sqe->n_experts, g->world);
		dispatch_refuse(x, g, mb->local, client, sqe, &key, RW_ERR_SUB_EXPERTS, why);
		return;
	}
	rw_status_t st;
	if (p && (st = exec_plan_fits(p, sqe, why, sizeof(why))) != RW_OK) {
		dispatch_refuse(x, g, mb->local, client, sqe, &key, st, why);
		return;
	}
	if (!p) {
		if (x->svc->draining) {
			exec_answer_err(x, client, sqe, RW_ERR_SUB_STATE, 0, "the daemon is draining");
			return;
		}
		p = exec_pair_open(x, g, &key, sqe);
		if (!p) {
			exec_answer_err(x, client, sqe, RW_ERR_NOMEM, 0, "out of memory");
			return;
		}
	}
	rw_svc_span_mem_t m[4];
	int absent = 0, unknown = 0;
	const rw_span_t *spans[4] = { &sqe->tokens, &sqe->topk_ids, &sqe->topk_weights, &sqe->output };
	for (int i = 0; i < 4; i++) {
		int rc = span_resolve(client, spans[i], &m[i]);
		absent |= (rc == 1) << i;
		unknown |= rc < 0;
	}
	/* A rank that routes nothing may omit its inputs (0-byte spans); the output is needed. */
	if (unknown || (absent & 8) || (sqe->token_count && (absent & 7))) {
		dispatch_refuse(x, g, mb->local, client, sqe, &key, RW_ERR_SUB_BUFFER,
				"a local rank's buffer is gone");
		return;
	}
	rw_svc_rank_io_t io;
	memset(&io, 0, sizeof(io));
	memcpy(io.in, m, 3 * sizeof(m[0]));
	io.out = m[3];
	if (stream_order_set(client, sqe, &io, 3, why) < 0) {
		dispatch_refuse(x, g, mb->local, client, sqe, &key, RW_ERR_SUB_FIELD, why);
		return;
	}
	exec_sub_t *s = &p->in[RW_MV_DISPATCH].sub[mb->local];
	s->sqe = *sqe;
	s->client = client;
	s->have = 1;
	p->in[RW_MV_DISPATCH].n_sub++;
	io_set(p, RW_MV_DISPATCH, mb, sqe, m, 3, &m[3], &io);
	exec_on_submit(p, RW_MV_DISPATCH, mb->local);
}

static void submit_combine(exec_t *x, exec_member_t *mb, rw_ipc_client_t *client,
			   const rw_sqe_t *sqe)
{
	exec_pair_t *p = mb->g->pair;
	uint32_t g = mb->local;
	char why[RW_SVC_WHY_MAX];
	rw_wire_key_t key = { .group = mb->g->hash, .layer = sqe->layer, .step = sqe->step };
	const char *failed = p ? NULL : exec_tomb_hit(x, &key, RW_MV_COMBINE, g);
	if (failed) { /* its pair failed while the rank computed the combine */
		exec_answer_err(x, client, sqe, RW_ERR_STATE, 1, failed);
		return;
	}
	if (p && p->stage == ST_GATHER_D && rw_wire_key_eq(&p->key, &key) &&
	    !p->in[RW_MV_DISPATCH].sub[g].have) {
		/* Its pair failed and a sibling's retry of the same key took the tomb with it. */
		exec_answer_err(x, client, sqe, RW_ERR_STATE, 1, "the phase failed and another local "
				"rank already retries it: retry the dispatch");
		return;
	}
	if (!p || p->stage != ST_WAIT_C || p->out.handle[g] != sqe->handle_id) {
		snprintf(why, sizeof(why), "handle %u is not this rank's open dispatch", sqe->handle_id);
		exec_answer_err(x, client, sqe, RW_ERR_SUB_HANDLE, 0, why);
		return;
	}
	if (p->in[RW_MV_COMBINE].sub[g].have) {
		exec_answer_err(x, client, sqe, RW_ERR_SUB_STATE, 0,
				"this rank already submitted this combine");
		return;
	}
	uint32_t rows = 0;
	const uint32_t *counts;
	p->mv->result(p->mv_state, g, &rows, &counts);
	/* token_count = rows received, 0 when none. Protocol-1 clients sent one ignored row
	 * instead of an empty combine: still accepted. */
	if ((sqe->token_count != rows && !(rows == 0 && sqe->token_count == 1)) ||
	    sqe->hidden != p->ph.hidden || exec_wire_dtype(sqe->dtype) != p->ph.dtype) {
		snprintf(why, sizeof(why), "combine of %u rows of %u x dtype %u; the dispatch delivered "
			 "%u rows of %u", sqe->token_count, sqe->hidden, sqe->dtype, rows, p->ph.hidden);
		exec_answer_err(x, client, sqe, RW_ERR_SUB_TOKENS, 0, why);
		return;
	}
	if (sqe->n_experts != 0 && sqe->n_experts != p->ph.n_experts) {
		snprintf(why, sizeof(why), "n_experts %u is not the dispatch's %u", sqe->n_experts,
			 p->ph.n_experts);
		exec_answer_err(x, client, sqe, RW_ERR_SUB_EXPERTS, 0, why);
		return;
	}
	if (sqe->path != RW_PATH_REQ_DAEMON && sqe->path != p->plan.path + RW_PATH_REQ_NATIVE) {
		snprintf(why, sizeof(why), "path %u: a combine runs its dispatch's path (%s): ask for "
			 "0 or %u", sqe->path, rw_sched_path_name(p->plan.path),
			 p->plan.path + RW_PATH_REQ_NATIVE);
		exec_answer_err(x, client, sqe, RW_ERR_SUB_FIELD, 0, why);
		return;
	}
	if (sqe->output_capacity < (uint64_t)p->plan.rt[g].n_tokens * p->ph.row_bytes) {
		snprintf(why, sizeof(why), "output holds %llu bytes, the combine writes %llu",
			 (unsigned long long)sqe->output_capacity,
			 (unsigned long long)p->plan.rt[g].n_tokens * p->ph.row_bytes);
		exec_answer_err(x, client, sqe, RW_ERR_SUB_SPACE, 0, why);
		return;
	}
	rw_svc_span_mem_t m[2];
	int rt = span_resolve(client, &sqe->tokens, &m[0]), ro = span_resolve(client, &sqe->output, &m[1]);
	if (rt < 0 || ro < 0 || (ro == 1 && p->plan.rt[g].n_tokens) || (rt == 1 && rows)) {
		exec_answer_err(x, client, sqe, RW_ERR_SUB_BUFFER, 0, "a local rank's buffer is gone");
		return;
	}
	rw_svc_rank_io_t io;
	memset(&io, 0, sizeof(io));
	io.in[0] = m[0];
	io.out = m[1];
	if (stream_order_set(client, sqe, &io, 1, why) < 0) {
		exec_answer_err(x, client, sqe, RW_ERR_SUB_FIELD, 0, why);
		return;
	}
	exec_sub_t *s = &p->in[RW_MV_COMBINE].sub[g];
	s->sqe = *sqe;
	s->client = client;
	s->have = 1;
	p->in[RW_MV_COMBINE].n_sub++;
	io_set(p, RW_MV_COMBINE, mb, sqe, m, 1, &m[1], &io);
	exec_on_submit(p, RW_MV_COMBINE, g);
}

static void submission(void *ctx, rw_ipc_client_t *client, const rw_sqe_t *sqe)
{
	exec_t *x = ctx;
	exec_member_t *mb = rw_ipc_client_data(client);
	if (!mb)
		exec_answer_err(x, client, sqe, RW_ERR_SUB_STATE, 0, "this rank is not in a group");
	else if (sqe->kind == RW_KIND_DISPATCH)
		submit_dispatch(x, mb, client, sqe);
	else if (sqe->kind == RW_KIND_COMBINE)
		submit_combine(x, mb, client, sqe);
	else
		exec_answer_err(x, client, sqe, RW_ERR_SUB_KIND, 0, "unknown submission kind");
}

const rw_ipc_server_ops_t exec_ipc_ops = {
	.client_joined = client_joined,
	.client_left = client_left,
	.submission = submission,
};
