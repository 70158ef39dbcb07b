/* The executor's answers to the trainer ranks (docs/dataflow.md "Dispatch output", "Failures"):
 * completion entries, and the one place where an internal rw_status_t becomes the client's
 * RW_E_* code (exec_client_code, and exec_drop_client for a rank refused at joining). A failed submission's reason travels first as a notice on the rank's control
 * socket, so rw_client_last_message() names what failed when the error completion is read. */
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

void exec_answer_err(exec_t *x, rw_ipc_client_t *client, const rw_sqe_t *sqe, rw_status_t st,
		     int remote, const char *msg)
{
	if (!x->ipc)
		return;
	int code = exec_client_code(st, remote);
	rw_ipc_client_notice(x->ipc, client, code, msg && msg[0] ? msg : rw_status_str(st));
	rw_ipc_signal_now(client, sqe); /* stream order: the flag before the CQE, errors too */
	rw_cqe_t c = cqe_for(sqe, RW_CQ_ERROR);
	c.error = code;
	rw_ipc_complete(x->ipc, client, &c);
}

void exec_answer_sub_err(exec_t *x, const exec_sub_t *s, rw_status_t st, int remote,
			 const char *msg)
{
	if (!s->page_k)
		return exec_answer_err(x, s->client, &s->sqe, st, remote, msg);
	rw_page_head_t *pg = x->ipc ? rw_ipc_client_page(s->client, NULL) : NULL;
	if (!pg)
		return;
	const int code = exec_client_code(st, remote);
	rw_ipc_client_notice(x->ipc, s->client, code, msg && msg[0] ? msg : rw_status_str(st));
	rw_page_fail(pg, s->page_k, code); /* P6: the status, then the words its stream waits on */
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
