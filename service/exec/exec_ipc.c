/* The executor's adapter for the trainer ranks (ipc/ipc.h; docs/dataflow.md "Groups, ranks,
 * experts", "Gather"): ranks join groups, submit dispatches and combines, and leave. Every
 * submission is checked here against the phase it joins — the IPC server has already checked
 * it against the daemon's limits and the rank's buffers — and is refused with an error that
 * names what is wrong; an accepted one is handed to the state machine (exec.c). */
#include <stdarg.h>
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

/* A rank leaves its group here: when it left (client_left), or when the IPC server dropped it
 * and another rank takes its seat before its leave comes (its client_left then finds nothing). */
static void member_leave(exec_t *x, exec_member_t *mb, rw_ipc_leave_t reason, int error)
{
	rw_ipc_client_t *client = mb->client;
	rw_ipc_client_set_data(client, NULL);
	exec_group_t *g = mb->g;
	uint32_t rank = rw_ipc_client_info(client)->rank;
	if (rw_ipc_log_churn(x->ipc))
		rw_info("rank %u of group %s left (%s, %d)", rank, g->name, rw_ipc_leave_str(reason),
			error);
	exec_page_leave(x, mb); /* what its stream submitted and the poller had not reported */
	/* A rank, ring or page, whose leave failed nothing (none open, its part of the open pair
	 * done, or the pair it ended completed) is absent from the next key that gathers here
	 * (SEAT_GAP: exec_on_submit fails that pair). One whose leave failed a pair, or holds its
	 * combine's failure, skipped nothing more. (A closed pair stays readable until the loop's
	 * reaper.) */
	int failed = 0;
	exec_pair_t *was = g->pair;
	if (was) { /* the pair may use this rank's buffers: fail it everywhere */
		exec_on_rank_left(was, client, rank);
		failed = was->err.st != RW_OK || was->held.st != RW_OK;
	}
	if (was && !g->pair) { /* its leave ended that pair: a submit that waited for its end */
		exec_page_leave(x, mb);
		exec_pair_t *next = g->pair;
		if (next) {
			exec_on_rank_left(next, client, rank);
			failed |= next->err.st != RW_OK || next->held.st != RW_OK;
		}
	}
	g->seat[mb->local].state = failed ? SEAT_WAIT : SEAT_GAP;
	g->member[mb->local] = NULL;
	g->n_members--;
	exec_tomb_left(x, g->hash, mb->local);
	exec_member_free(mb);
	if (g->n_members == 0) {
		if (g->pair) /* a page rank's dispatch that ended with its done: no combine follows */
			exec_pair_abandon(g->pair);
		exec_carve_drop(x, g); /* its pairs hold their own references */
		rw_list_del(&g->link);
		free(g);
	}
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
	_Static_assert(RW_IPC_KEY_FP_SIZE == RW_WIRE_KEY_FP_SIZE, "one fingerprint");
	exec_group_t *g = group_find(x, info->group);
	/* Members the IPC server dropped but whose leave has not come yet (a group claimed with a
	 * key: ipc/ipc.h rw_ipc_client_leaving) leave now: their seats and key are not the group's. */
	for (uint32_t l = 0; g && l < x->gpus; l++)
		if (g->member[l] && rw_ipc_client_leaving(g->member[l]->client)) {
			member_leave(x, g->member[l], RW_IPC_LEFT_DROPPED, 0);
			g = group_find(x, info->group);
		}
	uint32_t local = info->rank % x->gpus;
	if (!g) {
		g = calloc(1, sizeof(*g));
		if (!g) {
			exec_drop_client(x, client, RW_ERR_NOMEM);
			return;
		}
		snprintf(g->name, sizeof(g->name), "%s", info->group);
		g->hash = rw_wire_group_hash(g->name);
		g->world = info->world_size;
		memcpy(g->key_fp, info->key_fp, sizeof(g->key_fp));
		rw_list_add(&x->groups, &g->link);
		g->carve = -1; /* taken at its first slab request (group_slab) */
	}
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
	g->seat[local].state = SEAT_NEW;
	g->n_members++;
	exec_refused_drop(x, g->name, info->key_fp);
	rw_ipc_client_set_data(client, mb);
	if (rw_ipc_log_churn(x->ipc)) /* the IPC server's budget for join and leave lines */
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
	exec_answer_late_gone(x, client);
	if (mb)
		member_leave(x, mb, reason, error);
}

/* A rank of a group was turned away at its hello (ipc/ipc.h hello_refused): while a seat of
 * the group here is empty its phases cannot run, so they fail everywhere now instead of after a
 * phase timeout — the group's pair gathering here, and the peers' rows waiting for it (and
 * those that come, exec_mesh.c). A refusal while the group holds every seat here (a stranger's
 * try at a running job) changes nothing (exec_keys.c "ranks refused at their hello"). */
static void hello_refused(void *ctx, const char *group, uint32_t rank, uint32_t world,
			  const uint8_t key_fp[RW_IPC_KEY_FP_SIZE], int code, const char *why)
{
	exec_t *x = ctx;
	(void)code;
	if (world != x->nodes * x->gpus || rank / x->gpus != x->me)
		return; /* not a seat of this node */
	exec_refused_add(x, group, rank, key_fp, why);
	exec_group_t *g = group_find(x, group);
	char msg[RW_SVC_WHY_MAX];
	if (g && g->pair && g->pair->stage == ST_GATHER_D &&
	    exec_refused_why(x, group, g->key_fp, msg, sizeof(msg)))
		exec_pair_fail(g->pair, RW_ERR_CLIENT, "%s", msg);
	exec_refused_rows(x, group);
}

/* ---- a submission's way in (docs/dataflow.md "Gather") ---------------------------------------
 * submission() checks a submission against its group's open pair and the daemon's state without
 * changing anything (admit_dispatch, admit_combine), then acts on the verdict in one place:
 * the submission joins its pair (attach), or is refused — answered alone, answered with the
 * reason its phase already failed, or (a dispatch that cannot join) answered while its phase
 * fails on every node (dispatch_refuse), so no rank waits for a phase timeout. */

typedef enum admit_way {
	ADMIT_JOIN = 0,              /* attach it to the group's open pair */
	ADMIT_OPEN,                  /* open the phase's pair with it */
	ADMIT_ABORT,                 /* a combine with RW_SQE_ABORT: fail its pair everywhere */
	REFUSE_RANK,                 /* answer this rank alone */
	REFUSE_FAILED,               /* its phase already failed here (a tomb): that reason */
	REFUSE_PHASE,                /* a dispatch that cannot join: its phase fails everywhere */
} admit_way_t;

/* What the check found. */
typedef struct admit {
	admit_way_t way;
	rw_status_t st;              /* a refusal's status ... */
	char why[RW_SVC_WHY_MAX];    /* ... and its sentence */
	rw_wire_key_t key;
	rw_svc_phase_kind_t kind;
	exec_pair_t *pair;           /* the pair it joins, or (REFUSE_PHASE) fails; NULL: none yet */
	exec_pair_t *abandon;        /* a pair whose combine the trainer skipped: closed first */
	exec_pair_t *skipped;        /* a pair this rank, joined again, went past: failed first
				      * (exec_dispatch_skip) ... */
	char skip_why[RW_SVC_WHY_MAX]; /* ... naming the rank */
	int tomb_seen;               /* a tomb of the key was looked up (exec_tomb_pass settles it) */
	int named;                   /* REFUSE_PHASE: why names the rank the key fails for */
	rw_svc_rank_io_t io;         /* the rank's part of the phase, resolved from the submission */
} admit_t;

static void refuse(admit_t *a, admit_way_t way, rw_status_t st, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static void refuse(admit_t *a, admit_way_t way, rw_status_t st, const char *fmt, ...)
{
	a->way = way;
	a->st = st;
	if (fmt) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(a->why, sizeof(a->why), fmt, ap);
		va_end(ap);
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

/* The rank's io from its n_in input spans and its output span (spans[n_in]); `needed`: bit i,
 * span i must be given (a rank that routes nothing may omit what it would not use). 0, or -1
 * with the refusal's status and sentence in a->st and a->why (the caller refuses). */
static int admit_io(rw_ipc_client_t *client, const rw_sqe_t *sqe, const rw_span_t *const *spans,
		    unsigned n_in, unsigned needed, admit_t *a)
{
	rw_svc_rank_io_t *io = &a->io;
	for (unsigned i = 0; i <= n_in; i++) {
		int rc = span_resolve(client, spans[i], i < n_in ? &io->in[i] : &io->out);
		if (rc < 0 || (rc == 1 && (needed & (1u << i)))) {
			a->st = RW_ERR_SUB_BUFFER;
			snprintf(a->why, sizeof(a->why), "a local rank's buffer is gone");
			return -1;
		}
	}
	if (stream_order_set(client, sqe, io, n_in, a->why) < 0) {
		a->st = RW_ERR_SUB_FIELD;
		return -1;
	}
	io->n_tokens = sqe->token_count;
	io->out_offset = sqe->output.offset;
	io->out_cap = sqe->output_capacity;
	return 0;
}

static void admit_dispatch(const exec_t *x, const exec_member_t *mb, rw_ipc_client_t *client,
			   const rw_sqe_t *sqe, admit_t *a)
{
	const exec_group_t *g = mb->g;
	exec_pair_t *p = g->pair;
	a->tomb_seen = 1;
	if (exec_tomb_check(x, &a->key, RW_SVC_DISPATCH, mb->local, a->why, sizeof(a->why)))
		return refuse(a, REFUSE_FAILED, RW_ERR_STATE, NULL);
	switch (exec_dispatch_skip(x, mb, p, &a->key, a->skip_why, sizeof(a->skip_why))) {
	case EXEC_SKIP_MINE: /* a rank that joined again went on past this key */
		a->named = 1;
		return refuse(a, REFUSE_PHASE, RW_ERR_CLIENT, "%s", a->skip_why);
	case EXEC_SKIP_DONE: /* this rank had this key's answer: its group went on */
		return refuse(a, REFUSE_RANK, RW_ERR_CLIENT, "%s", a->skip_why);
	case EXEC_SKIP_PAIR: /* this rank joined again past the pair's key: it fails first */
		a->skipped = p;
		p = NULL;
		break;
	case EXEC_SKIP_NONE:
		break;
	}
	if (p && !rw_wire_key_eq(&p->key, &a->key)) {
		if (p->stage != ST_WAIT_C || p->in[RW_SVC_COMBINE].n_sub != 0)
			return refuse(a, REFUSE_RANK, RW_ERR_SUB_STATE, "layer %u step %llu is still "
				      "running in this group", p->key.layer,
				      (unsigned long long)p->key.step);
		a->abandon = p; /* the trainer moved on without a combine */
		p = NULL;
	}
	if (p && (p->stage != ST_GATHER_D || p->in[RW_SVC_DISPATCH].sub[mb->local].have))
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_STATE,
			      "this rank already submitted this dispatch");
	a->pair = p;
	if (exec_refused_why(x, g->name, g->key_fp, a->why, sizeof(a->why))) /* a seat stays empty */
		return refuse(a, REFUSE_PHASE, RW_ERR_CLIENT, NULL);
	/* E: the group's experts, evenly over its W ranks, the same for every rank of the phase
	 * (docs/dataflow.md "Groups, ranks, experts"). */
	if (sqe->n_experts % g->world != 0)
		return refuse(a, REFUSE_PHASE, RW_ERR_SUB_EXPERTS, "n_experts %u is not a multiple of "
			      "the world size %u", sqe->n_experts, g->world);
	rw_status_t st;
	if (p && (st = exec_plan_fits(p, sqe, a->why, sizeof(a->why))) != RW_OK)
		return refuse(a, REFUSE_PHASE, st, NULL);
	if (!p && x->svc->draining)
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_STATE, "the daemon is draining");
	const rw_span_t *spans[4] = { &sqe->tokens, &sqe->topk_ids, &sqe->topk_weights, &sqe->output };
	if (admit_io(client, sqe, spans, 3, 8u | (sqe->token_count ? 7u : 0u), a) < 0)
		return refuse(a, REFUSE_PHASE, a->st, NULL);
	a->way = p ? ADMIT_JOIN : ADMIT_OPEN;
}

static void admit_combine(const exec_t *x, const exec_member_t *mb, rw_ipc_client_t *client,
			  const rw_sqe_t *sqe, admit_t *a)
{
	exec_pair_t *p = mb->g->pair;
	const uint32_t g = mb->local;
	a->tomb_seen = !p;
	if (!p && exec_tomb_check(x, &a->key, RW_SVC_COMBINE, g, a->why, sizeof(a->why)))
		return refuse(a, REFUSE_FAILED, RW_ERR_STATE, NULL); /* it failed while the rank
								       * computed the combine */
	if (p && p->stage == ST_GATHER_D && rw_wire_key_eq(&p->key, &a->key) &&
	    !p->in[RW_SVC_DISPATCH].sub[g].have) /* and a sibling's retry took the tomb with it */
		return refuse(a, REFUSE_RANK, RW_ERR_STATE, "the phase failed and another local rank "
			      "already retries it: retry the dispatch");
	if (!p || p->stage != ST_WAIT_C || p->out.handle[g] != sqe->handle_id)
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_HANDLE, "handle %u is not this rank's open "
			      "dispatch", sqe->handle_id);
	if (p->in[RW_SVC_COMBINE].sub[g].have)
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_STATE,
			      "this rank already submitted this combine");
	uint32_t rows = 0;
	const uint32_t *counts;
	p->mv->result(p->mv_state, g, &rows, &counts);
	/* token_count = rows received, 0 when none. Protocol-1 clients sent one ignored row
	 * instead of an empty combine: still accepted. */
	if ((sqe->token_count != rows && !(rows == 0 && sqe->token_count == 1)) ||
	    sqe->hidden != p->ph.hidden || exec_wire_dtype(sqe->dtype) != p->ph.dtype)
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_TOKENS, "combine of %u rows of %u x dtype "
			      "%u; the dispatch delivered %u rows of %u", sqe->token_count,
			      sqe->hidden, sqe->dtype, rows, p->ph.hidden);
	if (sqe->n_experts != 0 && sqe->n_experts != p->ph.n_experts)
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_EXPERTS, "n_experts %u is not the "
			      "dispatch's %u", sqe->n_experts, p->ph.n_experts);
	if (sqe->path != RW_PATH_REQ_DAEMON && sqe->path != p->plan.path + RW_PATH_REQ_NATIVE)
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_FIELD, "path %u: a combine runs its "
			      "dispatch's path (%s): ask for 0 or %u", sqe->path,
			      rw_sched_path_name(p->plan.path), p->plan.path + RW_PATH_REQ_NATIVE);
	const uint64_t writes = (uint64_t)p->plan.rt[g].n_tokens * p->ph.row_bytes;
	if (sqe->output_capacity < writes)
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_SPACE, "output holds %llu bytes, the "
			      "combine writes %llu", (unsigned long long)sqe->output_capacity,
			      (unsigned long long)writes);
	const rw_span_t *spans[2] = { &sqe->tokens, &sqe->output };
	if (admit_io(client, sqe, spans, 1, (rows ? 1u : 0u) | (p->plan.rt[g].n_tokens ? 2u : 0u),
		     a) < 0)
		return refuse(a, REFUSE_RANK, a->st, NULL);
	a->pair = p;
	a->way = ADMIT_JOIN;
}

/* A combine with RW_SQE_ABORT (ipc/railwave.h "Failing a pair by its key"): it fails the
 * pair of its key, and only while that pair still waits for this rank's combine; an abort of a
 * pair that has ended is answered alone (a tomb of its key counts it answered), so a late one
 * never reaches the pair a sibling has opened since. */
static void admit_abort(const exec_member_t *mb, const rw_sqe_t *sqe, admit_t *a)
{
	exec_pair_t *p = mb->g->pair;
	const uint32_t g = mb->local;
	const int mine = p && rw_wire_key_eq(&p->key, &a->key);
	a->tomb_seen = !mine;
	if (!mine || p->stage != ST_WAIT_C || p->out.handle[g] != sqe->handle_id ||
	    p->in[RW_SVC_COMBINE].sub[g].have)
		return refuse(a, REFUSE_RANK, RW_ERR_SUB_STATE, "abort of layer %u step %llu handle "
			      "%u: no open pair waits for this rank's combine with that handle "
			      "(it has ended): nothing to fail", a->key.layer,
			      (unsigned long long)a->key.step, sqe->handle_id);
	a->pair = p;
	a->way = ADMIT_ABORT;
}

/* The abort's pair fails on every node; this rank is answered with the others. */
static void abort_pair(exec_t *x, exec_member_t *mb, rw_ipc_client_t *client, const rw_sqe_t *sqe,
		       exec_pair_t *p)
{
	exec_sub_t *s = &p->in[RW_SVC_COMBINE].sub[mb->local];
	s->sqe = *sqe;
	s->client = client;
	s->have = 1;
	exec_pair_fail(p, RW_ERR_CLIENT, "local rank %u aborted the pair (it gives no combine: "
		       "its own call was refused)", x->me * x->gpus + mb->local);
}

/* The one place a submission joins its pair: recorded with its io, then the state machine's. */
static void attach(exec_t *x, exec_member_t *mb, rw_ipc_client_t *client, const rw_sqe_t *sqe,
		   const admit_t *a)
{
	exec_pair_t *p = a->pair;
	if (a->way == ADMIT_OPEN && !(p = exec_pair_open(x, mb->g, &a->key, sqe))) {
		exec_answer_err(x, client, sqe, RW_ERR_NOMEM, 0, "out of memory");
		return;
	}
	exec_sub_t *s = &p->in[a->kind].sub[mb->local];
	s->sqe = *sqe;
	s->client = client;
	s->have = 1;
	p->in[a->kind].n_sub++;
	p->ph.io[a->kind][mb->local] = a->io;
	p->ph.stage_in[mb->local] = &mb->in;
	p->ph.stage_out[mb->local] = &mb->out;
	exec_on_submit(p, a->kind, mb->local);
}

/* A dispatch that cannot join its phase: answered, and the phase fails on every node (the
 * open pair; or, when there is none yet, the key ends here and the peers are told). */
static void dispatch_refuse(exec_t *x, exec_member_t *mb, rw_ipc_client_t *client,
			    const rw_sqe_t *sqe, const admit_t *a)
{
	const uint32_t local = mb->local;
	rw_warn("group %s layer %u step %llu: local rank %u: %s", mb->g->name, a->key.layer,
		(unsigned long long)a->key.step, local, a->why);
	exec_answer_err(x, client, sqe, a->st, 0, a->why);
	if (a->named) /* a skip: its sentence names the rank gone */
		return exec_seat_absent(x, mb->g, local, &a->key, RW_SVC_DISPATCH,
					EXEC_ABSENT_REFUSED, a->why);
	char msg[RW_SVC_WHY_MAX + 32];
	snprintf(msg, sizeof(msg), "local rank %u: %s", x->me * x->gpus + local, a->why);
	exec_seat_absent(x, mb->g, local, &a->key, RW_SVC_DISPATCH, EXEC_ABSENT_REFUSED, msg);
}

static void submission(void *ctx, rw_ipc_client_t *client, const rw_sqe_t *sqe)
{
	exec_t *x = ctx;
	exec_member_t *mb = rw_ipc_client_data(client);
	admit_t a;
	memset(&a, 0, sizeof(a));
	if (mb)
		a.key = (rw_wire_key_t){ .group = mb->g->hash, .layer = sqe->layer, .step = sqe->step };
	if (!mb) {
		refuse(&a, REFUSE_RANK, RW_ERR_SUB_STATE, "this rank is not in a group");
	} else if (sqe->kind == RW_KIND_DISPATCH) {
		a.kind = RW_SVC_DISPATCH;
		admit_dispatch(x, mb, client, sqe, &a);
	} else if (sqe->kind == RW_KIND_COMBINE) {
		a.kind = RW_SVC_COMBINE;
		if (sqe->flags & RW_SQE_ABORT)
			admit_abort(mb, sqe, &a);
		else
			admit_combine(x, mb, client, sqe, &a);
	} else {
		refuse(&a, REFUSE_RANK, RW_ERR_SUB_KIND, "unknown submission kind");
	}
	if (a.tomb_seen)
		exec_tomb_pass(x, &a.key, a.kind, mb->local);
	if (a.abandon)
		exec_pair_abandon(a.abandon);
	if (a.skipped) /* closed now: the dispatch opens its own pair */
		exec_seat_absent(x, mb->g, mb->local, &a.skipped->key, RW_SVC_DISPATCH,
				 EXEC_ABSENT_GONE, a.skip_why);
	switch (a.way) {
	case ADMIT_JOIN:
	case ADMIT_OPEN:
		attach(x, mb, client, sqe, &a);
		break;
	case ADMIT_ABORT:
		abort_pair(x, mb, client, sqe, a.pair);
		break;
	case REFUSE_PHASE:
		dispatch_refuse(x, mb, client, sqe, &a);
		break;
	case REFUSE_RANK:
	case REFUSE_FAILED:
		exec_answer_err(x, client, sqe, a.st, 0, a.why);
		break;
	}
	/* After its pair saw it (exec_on_submit marks a seat's first dispatch since it joined). */
	if (mb && a.kind == RW_SVC_DISPATCH)
		exec_seat_took(mb->g, mb->local, &a.key);
}

/* A rank asks for its group's slab of a rail: the group's carve-out (exec_carve.c), the one
 * memory its pairs use on that rail, with the places of its five sub-areas. */
static int group_slab(void *ctx, rw_ipc_client_t *client, uint32_t rail, rw_ipc_slab_t *slab_p,
		      const char **why_p)
{
	exec_t *x = ctx;
	const exec_member_t *mb = rw_ipc_client_data(client);
	if (rail >= x->rails) {
		*why_p = "slab setup: no such rail on this daemon";
		return RW_E_INVAL;
	}
	if (!x->carve_max) {
		*why_p = "this daemon lends no group slabs (group_area_mib is 0)";
		x->svc->metrics.slabs_refused[RW_SVC_SLAB_OFF]++;
		return RW_E_STATE;
	}
	if (!mb) {
		*why_p = "slab setup: this rank is not in a group here";
		return RW_E_STATE;
	}
	exec_carve_want(x, mb);
	const int rc = exec_carve_lend(x, mb->g, rail, slab_p, why_p);
	if (rc == RW_E_LIMIT || rc == RW_E_STATE) /* the pool spent; the carve-out not made */
		x->svc->metrics.slabs_refused[rc == RW_E_LIMIT ? RW_SVC_SLAB_POOL :
					      RW_SVC_SLAB_FAILED]++;
	return rc;
}

const rw_ipc_server_ops_t exec_ipc_ops = {
	.client_joined = client_joined,
	.client_left = client_left,
	.submission = submission,
	.page_word = exec_page_word,
	.hello_refused = hello_refused,
	.group_slab = group_slab,
};
