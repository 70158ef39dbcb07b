/* The executor's answers to the trainer ranks (docs/dataflow.md "Dispatch output", "Failures"):
 * completion entries, and the one place where an internal rw_status_t becomes the client's
 * RW_E_* code (exec_client_code, and exec_drop_client for a rank refused at joining). A failed submission's reason travels first as a notice on the rank's control
 * socket, so rw_client_last_message() names what failed when the error completion is read. */
#include <stdlib.h>
#include <string.h>

#include "service/exec/exec_int.h"

int exec_client_code(rw_status_t st, int remote)
{
	if (remote)
		return RW_E_PHASE; /* a peer failed it: nothing the rank sent was wrong */
	switch (st) {
	case RW_ERR_SUB_KIND: return RW_E_KIND;
	case RW_ERR_SUB_DTYPE: return RW_E_DTYPE;
	case RW_ERR_SUB_TOKENS: return RW_E_TOKENS;
	case RW_ERR_SUB_EXPERTS: return RW_E_EXPERTS;
	case RW_ERR_SUB_FIELD: return RW_E_FIELD;
	case RW_ERR_SUB_BUFFER: return RW_E_BUF_ID;
	case RW_ERR_SUB_HANDLE: return RW_E_HANDLE;
	case RW_ERR_SUB_STATE: return RW_E_STATE;
	case RW_ERR_SUB_SPACE: return RW_E_RANGE;
	case RW_ERR_DEVICE: return RW_E_CUDA;
	case RW_ERR_NOMEM:
	case RW_ERR_SYS:
	case RW_ERR_FATAL: return RW_E_INTERNAL;
	default: return RW_E_PHASE; /* peer lost, timeout, protocol, a rank left, stopping */
	}
}

void exec_drop_client(exec_t *x, rw_ipc_client_t *client, rw_status_t st)
{
	int code = st == RW_ERR_EXISTS ? RW_E_RANK_DUP :
		   st == RW_ERR_NOMEM ? RW_E_INTERNAL : RW_E_WORLD_MISMATCH;
	rw_ipc_client_drop(x->ipc, client, code);
}

/* The completion of submission sqe with what every completion carries (kind, phase id and
 * user data copied from it; no counts buffer); the caller fills in the rest. */
static rw_cqe_t cqe_for(const rw_sqe_t *sqe, uint8_t status)
{
	rw_cqe_t c;
	memset(&c, 0, sizeof(c));
	c.status = status;
	c.kind = sqe->kind;
	c.phase_id = sqe->phase_id;
	c.user_data = sqe->user_data;
	c.counts_buf = RW_BUF_NONE;
	return c;
}

/* ---- stream-ordered flags of error answers (docs/rankpath.md "A hung GPU") ----------------
 * The flag is a synchronous write (rw_ipc_signal_now, a cuMemcpyHtoD): never on a stalled GPU,
 * where it would hold the loop. Such a flag is owed by the rank's member (exec_member_t.flag,
 * one entry per event: bounded by the 64 events a client may register) and written by the
 * loop's sweep once the GPU moves again; a leave drops it with the member. */

/* Cyclic, as the rank's stream compares (ipc/railwave.h: (int32_t)(flag - V) >= 0). */
static int flag_newer(uint32_t a, uint32_t b) { return (int32_t)(a - b) > 0; }

static void flag_write(rw_ipc_client_t *client, uint16_t event_id, uint32_t value)
{
	rw_sqe_t s;
	memset(&s, 0, sizeof(s));
	s.flags = RW_SQE_SIGNAL;
	s.event_id = event_id;
	s.output.reserved = value;
	rw_ipc_signal_now(client, &s);
}

/* Member mb's entry for event id, else a new one (*fresh_p 1) in a free entry, else in one whose
 * event is no longer registered (its flag has nowhere to go), else in one that only records a
 * value written; NULL when each of the 64 owes the flag of a registered event, which a
 * client's at most 64 events never reach. */
static exec_flag_t *flag_entry(exec_member_t *mb, uint16_t id, int *fresh_p)
{
	exec_flag_t *free_e = NULL, *gone = NULL, *written = NULL;
	for (unsigned i = 0; i < EXEC_FLAG_EVENTS; i++) {
		exec_flag_t *e = &mb->flag[i];
		if (e->event_id == id) {
			*fresh_p = 0;
			return e;
		}
		if (!e->event_id)
			free_e = free_e ? free_e : e;
		else if (!e->owed)
			written = written ? written : e;
	}
	for (unsigned i = 0; !free_e && i < EXEC_FLAG_EVENTS && !gone; i++) {
		rw_ipc_event_t ev;
		if (rw_ipc_event_lookup(mb->client, mb->flag[i].event_id, &ev) != RW_OK)
			gone = &mb->flag[i];
	}
	exec_flag_t *e = free_e ? free_e : gone ? gone : written;
	*fresh_p = 1;
	return e;
}

static int late_owes(const exec_t *x, const rw_ipc_client_t *client, uint16_t event_id);

/* A submission of the rank on that event not answered yet, in a pair still gathering or
 * running: its error answer, if it fails, would come after a newer value written now. */
static int pair_owes(const exec_t *x, const rw_ipc_client_t *client, uint16_t event_id)
{
	const exec_pair_t *p;
	rw_list_for_each(&x->pairs, p, link)
		for (unsigned k = 0; k < RW_SVC_KIND_COUNT; k++)
			for (uint32_t g = 0; g < RW_MAX_GPUS; g++) {
				const exec_sub_t *u = &p->in[k].sub[g];
				if (u->have && u->client == client && !u->page_k &&
				    (u->sqe.flags & RW_SQE_SIGNAL) && u->sqe.event_id == event_id)
					return 1;
			}
	return 0;
}

/* Entry e was written: it stays as a record of its value while an answer of the rank on that
 * event may still come with an older one (a held answer, or a submission in a pair not done
 * yet), which then is not written over it; kept longer, a record would outlive the 2^31 values
 * the cyclic comparison can tell apart. */
static void flag_written(const exec_t *x, const rw_ipc_client_t *client, exec_flag_t *e)
{
	e->owed = 0;
	if (!late_owes(x, client, e->event_id) && !pair_owes(x, client, e->event_id))
		e->event_id = 0;
}

/* The flag of a failed stream-ordered submission (before its CQE): written now unless its GPU
 * is stalled, then owed; per event the newest value wins, so no error answer writes an older
 * value over a newer one owed or written before. */
static void flag_answer(exec_t *x, rw_ipc_client_t *client, const rw_sqe_t *sqe)
{
	rw_ipc_event_t ev;
	if (!(sqe->flags & RW_SQE_SIGNAL))
		return;
	if (rw_ipc_event_lookup(client, sqe->event_id, &ev) != RW_OK || ev.device < 0 ||
	    ev.device >= 64) {
		rw_ipc_signal_now(client, sqe); /* the server's to refuse */
		return;
	}
	exec_member_t *mb = rw_ipc_client_data(client);
	const uint32_t rank = rw_ipc_client_info(client)->rank;
	const int stalled = rw_svc_gpu_stalled(ev.device, NULL, 0);
	int fresh = 1;
	exec_flag_t *e = mb ? flag_entry(mb, sqe->event_id, &fresh) : NULL;
	uint32_t v = sqe->output.reserved;
	if (e && !fresh) {
		if (!flag_newer(v, e->value) && !e->owed) {
			flag_written(x, client, e); /* that value or a newer one is written already */
			return;
		}
		if (flag_newer(e->value, v))
			v = e->value;
	}
	if (e)
		*e = (exec_flag_t){ .event_id = sqe->event_id, .owed = (uint8_t)stalled,
				    .dev = (int8_t)ev.device, .value = v };
	if (!stalled) {
		flag_write(client, sqe->event_id, v);
		if (e)
			flag_written(x, client, e);
	} else if (e) {
		x->flag_devs |= 1ull << ev.device;
		rw_warn("local rank %u: the completion flag of a failed submission (event %u, value "
			"%u) is not written now: GPU %d is stalled; it is written once it moves again",
			rank, sqe->event_id, v, ev.device);
	} else { /* not a member (the IPC server is dropping it), or no entry left */
		rw_err("local rank %u: the completion flag of a failed submission (event %u, value "
		       "%u) is not written: GPU %d is stalled and %s", rank, sqe->event_id, v,
		       ev.device, mb ? "every entry owes a flag" : "the rank is leaving");
	}
}

/* Member mb's owed flag e in a sweep: written once its GPU is not in `stalled` (dropped where the
 * rank deregistered its event), dropped at a stop while it still is; its GPU's bit while it
 * stays owed, else 0. */
static uint64_t flag_sweep_one(exec_t *x, exec_member_t *mb, exec_flag_t *e, uint64_t stalled,
			       int stopping)
{
	const uint32_t rank = rw_ipc_client_info(mb->client)->rank;
	rw_ipc_event_t ev;
	if (stalled >> e->dev & 1) {
		if (!stopping)
			return 1ull << e->dev;
		rw_warn("local rank %u: daemon stopping with GPU %d stalled: the completion flag of "
			"a failed submission (event %u, value %u) is never written", rank, e->dev,
			e->event_id, e->value);
		e->event_id = 0;
	} else if (rw_ipc_event_lookup(mb->client, e->event_id, &ev) != RW_OK) {
		rw_info("local rank %u: GPU %d moves again: the completion flag of a failed "
			"submission (event %u, value %u) has nowhere to go: the rank deregistered "
			"the event", rank, e->dev, e->event_id, e->value);
		e->event_id = 0;
	} else {
		flag_write(mb->client, e->event_id, e->value);
		rw_info("local rank %u: GPU %d moves again: the completion flag of a failed "
			"submission written (event %u, value %u)", rank, e->dev, e->event_id,
			e->value);
		flag_written(x, mb->client, e);
	}
	return 0;
}

/* The owed flags whose GPU is not stalled now are written; with `stopping` those whose GPU is
 * are dropped, logged. Cheap while every GPU an owed flag waits on is still stalled. */
static void flags_sweep(exec_t *x, int stopping)
{
	if (!x->flag_devs || !x->ipc)
		return;
	int list[64];
	const unsigned n = rw_svc_gpu_stalled_list(list, 64, NULL);
	uint64_t stalled = 0, devs = 0;
	for (unsigned i = 0; i < n; i++)
		stalled |= 1ull << list[i];
	if (!stopping && !(x->flag_devs & ~stalled))
		return;
	exec_group_t *g;
	rw_list_for_each(&x->groups, g, link)
		for (uint32_t l = 0; l < x->gpus; l++)
			for (unsigned i = 0; g->member[l] && i < EXEC_FLAG_EVENTS; i++) {
				exec_flag_t *e = &g->member[l]->flag[i];
				if (e->event_id && e->owed)
					devs |= flag_sweep_one(x, g->member[l], e, stalled, stopping);
			}
	x->flag_devs = devs;
}

/* exec_answer_err; `held` >= 0: copies into the rank may still be queued on GPU `held`, so its
 * stream-ordered flag is not written now: 1 is returned when it has one, for the caller to
 * write once they landed (late_flag). */
static int answer_err(exec_t *x, rw_ipc_client_t *client, const rw_sqe_t *sqe, rw_status_t st,
		      int remote, const char *msg, int held)
{
	if (!x->ipc)
		return 0;
	int code = exec_client_code(st, remote);
	rw_ipc_client_notice(x->ipc, client, code, msg && msg[0] ? msg : rw_status_str(st));
	if (held < 0)
		flag_answer(x, client, sqe); /* stream order: the flag before the CQE, errors too */
	rw_cqe_t c = cqe_for(sqe, RW_CQ_ERROR);
	c.error = code;
	rw_ipc_complete(x->ipc, client, &c);
	return held >= 0 && (sqe->flags & RW_SQE_SIGNAL);
}

void exec_answer_err(exec_t *x, rw_ipc_client_t *client, const rw_sqe_t *sqe, rw_status_t st,
		     int remote, const char *msg)
{
	answer_err(x, client, sqe, st, remote, msg, -1);
}

static int sub_err(exec_t *x, const exec_sub_t *s, rw_status_t st, int remote, const char *msg,
		   int held)
{
	if (!s->page_k)
		return answer_err(x, s->client, &s->sqe, st, remote, msg, held);
	rw_page_head_t *pg = x->ipc ? rw_ipc_client_page(s->client, NULL) : NULL;
	if (!pg)
		return 0;
	const int code = exec_client_code(st, remote);
	rw_ipc_client_notice(x->ipc, s->client, code, msg && msg[0] ? msg : rw_status_str(st));
	rw_page_fail(pg, s->page_k, code); /* P6: the status, then the words its stream waits on */
	return 0;
}

void exec_answer_sub_err(exec_t *x, const exec_sub_t *s, rw_status_t st, int remote,
			 const char *msg)
{
	sub_err(x, s, st, remote, msg, -1);
}

void exec_answer_dispatch(exec_t *x, exec_pair_t *p, uint32_t g)
{
	exec_sub_t *s = &p->in[RW_SVC_DISPATCH].sub[g];
	if (++x->next_handle == 0)
		x->next_handle = 1;
	p->out.handle[g] = x->next_handle;
	if (s->page_k) { /* the rank's stream had its answer: arrived, then its own done */
		s->have = 0;
		return;
	}
	rw_cqe_t c = cqe_for(&s->sqe, RW_CQ_OK);
	const uint32_t *counts = NULL;
	p->mv->result(p->mv_state, g, &c.recv_tokens, &counts);
	c.handle_id = p->out.handle[g];
	c.n_experts = p->ph.n_experts;
	if (p->ph.n_experts <= RW_CQE_INLINE_COUNTS) {
		c.n_inline = (uint8_t)p->ph.n_experts;
		memcpy(c.counts, counts, 4u * p->ph.n_experts);
	} else { /* the mover wrote them at the head of the output span */
		c.counts_buf = p->ph.io[RW_SVC_DISPATCH][g].out.buf;
		c.counts_offset = p->ph.io[RW_SVC_DISPATCH][g].out_offset;
	}
	rw_ipc_complete(x->ipc, s->client, &c);
	s->have = 0;
}

void exec_answer_combine(exec_t *x, exec_pair_t *p, uint32_t g)
{
	exec_sub_t *s = &p->in[RW_SVC_COMBINE].sub[g];
	if (s->page_k) { /* answered by its words */
		s->have = 0;
		return;
	}
	rw_cqe_t c = cqe_for(&s->sqe, RW_CQ_OK);
	c.recv_tokens = p->plan.rt[g].n_tokens;
	c.handle_id = p->out.handle[g];
	rw_ipc_complete(x->ipc, s->client, &c);
	s->have = 0;
}

/* A failed pair's answer held until the copies into or out of its rank's CUDA memory landed,
 * and the rank's mappings kept until then (past its answer when its GPU stalled, past its
 * leave). */
struct exec_late {
	struct exec_late *next;
	exec_sub_t sub;              /* sub.client NULL once the rank left */
	int owed;                    /* its answer not sent yet */
	int flag_owed;               /* answered before the copies landed, without its
				      * stream-ordered flag: written (flag_answer) once they did */
	rw_svc_stage_fence_t fence;
	rw_ipc_keep_t *keep;         /* its CUDA mappings */
	rw_status_t st;
	int remote;
	char msg[RW_SVC_WHY_MAX];
};

/* The answer; with `dev` >= 0 it says the copies may still land on that GPU, declared stalled
 * (`stalled`) or still busy when shutdown stopped waiting, and keeps a stream-ordered flag
 * for when they landed (the rank's sentence is short: the GPU first; the daemon's log has the
 * whole line). */
static void late_answer(exec_t *x, struct exec_late *l, int dev, int stalled)
{
	const int owed = l->owed;
	l->owed = 0;
	if (!owed || !l->sub.client)
		return;
	if (dev < 0) {
		exec_answer_sub_err(x, &l->sub, l->st, l->remote, l->msg);
		return;
	}
	const char *state = stalled ? "stalled" : "busy at shutdown";
	char why[2 * RW_SVC_WHY_MAX];
	snprintf(why, sizeof(why), "GPU %d %s, copies into this rank may still land: %s", dev,
		 state, l->msg);
	rw_warn("local rank %u answered with its copies still queued on %s GPU %d: %s",
		rw_ipc_client_info(l->sub.client)->rank, state, dev, l->msg);
	l->flag_owed = sub_err(x, &l->sub, l->st, l->remote, why, dev);
}

/* Answer what the copies not landed allow (checked at once): the declared stalled GPU, else the
 * first the fence covers, busy; the flag stays with the entry either way. */
static void late_answer_unlanded(exec_t *x, struct exec_late *l, int stalled)
{
	if (stalled >= 0)
		late_answer(x, l, stalled, 1);
	else
		late_answer(x, l, l->fence.devs ? __builtin_ctzll(l->fence.devs) : 0, 0);
}

/* The copies landed: the flag its answer went without, if its rank stayed (owed by its member
 * instead while the flag's GPU is still stalled). */
static void late_flag(exec_t *x, struct exec_late *l)
{
	const int owed = l->flag_owed;
	l->flag_owed = 0; /* before: flag_answer keeps a record only for the others owed */
	if (owed && l->sub.client && x->ipc)
		flag_answer(x, l->sub.client, &l->sub.sqe);
}

/* Whether a held entry of the client will still write a flag of that event (with its answer,
 * or after it once its copies landed). */
static int late_owes(const exec_t *x, const rw_ipc_client_t *client, uint16_t event_id)
{
	for (const struct exec_late *l = x->late; l; l = l->next)
		if ((l->owed || l->flag_owed) && l->sub.client == client && !l->sub.page_k &&
		    (l->sub.sqe.flags & RW_SQE_SIGNAL) && l->sub.sqe.event_id == event_id)
			return 1;
	return 0;
}

/* The daemon stops before the copies landed: the flag stays unwritten, named. */
static void late_flag_lost(struct exec_late *l, const char *why)
{
	if (l->flag_owed && l->sub.client)
		rw_err("local rank %u: %s: the completion flag of its failed submission (event %u, "
		       "value %u) is never written", rw_ipc_client_info(l->sub.client)->rank, why,
		       l->sub.sqe.event_id, l->sub.sqe.output.reserved);
	l->flag_owed = 0;
}

/* Answer what is owed once landed or stalled; 1 once the copies landed (the entry can go). */
static int late_check(exec_t *x, struct exec_late *l)
{
	int stalled = -1;
	const int landed = rw_svc_stage_fenced(&l->fence, &stalled);
	if (landed)
		late_answer(x, l, -1, 0);
	else if (stalled >= 0)
		late_answer(x, l, stalled, 1);
	return landed;
}

static void late_hold(exec_t *x, struct exec_late *l, rw_ipc_client_t *client)
{
	if (late_check(x, l)) {
		free(l);
		return;
	}
	if (x->ipc && client && (l->keep = rw_ipc_client_keep(client))) {
		l->next = x->late;
		x->late = l;
		return;
	}
	/* nothing to hold it with: answered now, as copies that may still land unless they did */
	int stalled = -1;
	if (rw_svc_stage_fenced(&l->fence, &stalled)) {
		late_answer(x, l, -1, 0);
		late_flag(x, l);
	} else {
		late_answer_unlanded(x, l, stalled);
		late_flag_lost(l, "out of memory holding a failed submission until its copies land");
	}
	free(l);
}

void exec_answer_late(exec_t *x, const exec_sub_t *s, const rw_svc_stage_fence_t *f,
		      rw_status_t st, int remote, const char *msg)
{
	struct exec_late *l = calloc(1, sizeof(*l));
	if (!l) {
		exec_answer_sub_err(x, s, st, remote, msg);
		return;
	}
	*l = (struct exec_late){ .sub = *s, .owed = 1, .fence = *f, .st = st, .remote = remote };
	snprintf(l->msg, sizeof(l->msg), "%s", msg);
	late_hold(x, l, s->client);
}

void exec_answer_late_keep(exec_t *x, rw_ipc_client_t *client, const rw_svc_stage_fence_t *f)
{
	struct exec_late *l = calloc(1, sizeof(*l));
	if (!l) {
		rw_err("exec: out of memory keeping the CUDA mappings of a leaving rank whose copies "
		       "are still queued");
		return;
	}
	*l = (struct exec_late){ .fence = *f };
	late_hold(x, l, client);
}

void exec_answer_late_sweep(exec_t *x)
{
	for (struct exec_late **lp = &x->late; *lp;) {
		struct exec_late *l = *lp;
		if (!late_check(x, l)) {
			lp = &l->next;
			continue;
		}
		*lp = l->next;
		late_flag(x, l);
		rw_ipc_keep_drop(x->ipc, l->keep);
		free(l);
	}
	flags_sweep(x, 0);
}

void exec_answer_late_gone(exec_t *x, const rw_ipc_client_t *client)
{
	for (struct exec_late *l = x->late; l; l = l->next)
		if (l->sub.client == client)
			l->sub.client = NULL;
	exec_member_t *mb = rw_ipc_client_data(client);
	unsigned owed = 0;
	for (unsigned i = 0; mb && i < EXEC_FLAG_EVENTS; i++) {
		owed += mb->flag[i].event_id && mb->flag[i].owed;
		mb->flag[i] = (exec_flag_t){ 0 };
	}
	if (owed) /* its stream is gone with it, or waits on the hung GPU anyway */
		rw_warn("local rank %u left with %u completion flags of failed submissions owed on "
			"a stalled GPU: dropped", rw_ipc_client_info(client)->rank, owed);
}

unsigned exec_answer_late_moving(exec_t *x, unsigned *held_p, uint64_t *devs_p)
{
	unsigned moving = 0, held = 0;
	uint64_t devs = 0;
	for (const struct exec_late *l = x->late; l; l = l->next) {
		int stalled;
		if (rw_svc_stage_fenced(&l->fence, &stalled))
			continue;
		held++;
		moving += stalled < 0;
		devs |= stalled >= 0 ? 1ull << stalled : l->fence.devs;
	}
	*held_p = held;
	*devs_p = devs;
	return moving;
}

void exec_answer_late_flush(exec_t *x)
{
	while (x->late) {
		struct exec_late *l = x->late;
		x->late = l->next;
		int stalled = -1;
		const int landed = rw_svc_stage_fenced(&l->fence, &stalled);
		if (landed) {
			late_answer(x, l, -1, 0);
			late_flag(x, l);
			rw_ipc_keep_drop(x->ipc, l->keep);
		} else { /* its keep stays the IPC server's, whose destroy leaves the mappings open */
			late_answer_unlanded(x, l, stalled);
			late_flag_lost(l, "daemon stopping with copies into it queued");
		}
		free(l);
	}
	flags_sweep(x, 1);
}
