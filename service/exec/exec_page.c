/* The executor's adapter for the words of the rank path (docs/rankpath.md "A phase"): what a
 * rank's stream writes in its rank page (ipc/page.h) — submit, packed, done — as the IPC server's
 * poller reports it. Each phase a word moved over is taken in order; its slot is read once into
 * the daemon's copies and checked before anything reads it (rw_page_submit_check, then the
 * parameters as a ring submission's are checked), so a rank that rewrites its slot later changes
 * nothing the daemon decided. A phase this daemon does not carry is failed on the rank's page
 * (status, then plan and arrived: pair P6), named in the log and in the rank's last message, so
 * the rank's stream never waits for a word that will not come. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/page.h"
#include "service/exec/exec_int.h"

/* Phase k of this rank fails with `code` (RW_E_*): the sentence goes to the log, the reason to
 * the rank (which knows its group, rank and phase: a notice holds RW_IPC_ERRMSG_MAX bytes, and
 * the prefix cut a peer's reason short), then its page owes the words (rw_page_fail). */
static void page_phase_fail(exec_t *x, exec_member_t *mb, rw_page_head_t *pg, uint64_t k,
			    int32_t code, const char *why)
{
	rw_warn("group %s rank %u phase %llu: %s", mb->g->name, x->me * x->gpus + mb->local,
		(unsigned long long)k, why);
	rw_ipc_client_notice(x->ipc, mb->client, code, why);
	rw_page_fail(pg, k, code);
	x->svc->metrics.rank_path_refused[rw_svc_err_slot(code)]++;
}

/* page_phase_fail for an admission: the submit was taken (0). */
static int page_refuse(exec_t *x, exec_member_t *mb, rw_page_head_t *pg, uint64_t k, int32_t code,
		       const char *why)
{
	page_phase_fail(x, mb, pg, k, code, why);
	return 0;
}

/* The rank's submission of `kind` of `key` was refused (why): its seat is absent from it
 * (exec_seat_absent, the rule of absences), named. A page rank has no abort and its stream went
 * on, so a refused combine is an absence too, where a ring rank's is its own to retry. */
static void page_absent(exec_t *x, exec_member_t *mb, const rw_wire_key_t *key, int kind,
			const char *why)
{
	char msg[RW_SVC_WHY_MAX + 32];
	snprintf(msg, sizeof(msg), "local rank %u: %s", x->me * x->gpus + mb->local, why);
	exec_seat_absent(x, mb->g, mb->local, key, kind, EXEC_ABSENT_REFUSED, msg);
}

/* The parameters as the executor would check a ring submission's, beyond rw_page_submit_check:
 * what the movers carry. 0, or -1 with why and *code_p set. */
static int params_check(const exec_t *x, const exec_member_t *mb, const rw_page_params_t *p,
			char *why, int32_t *code_p)
{
	if (p->kind == RW_KIND_DISPATCH &&
	    (p->topk == 0 || p->topk > RW_MAX_TOPK || p->hidden == 0 || p->n_experts == 0 ||
	     p->n_experts % mb->g->world != 0)) {
		snprintf(why, RW_SVC_WHY_MAX, "topk %u (1..%u), hidden %u, n_experts %u (a multiple "
			 "of the world size %u)", p->topk, RW_MAX_TOPK, p->hidden, p->n_experts,
			 mb->g->world);
		*code_p = p->n_experts == 0 || p->n_experts % mb->g->world ? RW_E_EXPERTS : RW_E_TOKENS;
		return -1;
	}
	if (p->path > RW_PATH_REQ_JOINT) {
		snprintf(why, RW_SVC_WHY_MAX, "path %u: at most %u (ipc/railwave.h rw_path_request)",
			 p->path, RW_PATH_REQ_JOINT);
		*code_p = RW_E_FIELD;
		return -1;
	}
	if (p->dtype != RW_DTYPE_BF16 && p->dtype != RW_DTYPE_FP32) {
		snprintf(why, RW_SVC_WHY_MAX, "dtype %u: the daemon carries bf16 and fp32 rows",
			 p->dtype);
		*code_p = RW_E_DTYPE;
		return -1;
	}
	(void)x;
	return 0;
}

/* The submission's record in its pair and the rank's io: answered by words, no buffers. */
static void page_attach(exec_member_t *mb, rw_page_head_t *pg, const rw_page_layout_t *l,
			uint64_t k, exec_pair_t *p, rw_svc_phase_kind_t kind, const rw_sqe_t *sqe,
			uint32_t n_tokens, const uint32_t *row)
{
	exec_sub_t *s = &p->in[kind].sub[mb->local];
	*s = (exec_sub_t){ .have = 1, .sqe = *sqe, .client = mb->client, .page_k = k };
	p->in[kind].n_sub++;
	rw_svc_rank_io_t *io = &p->ph.io[kind][mb->local];
	*io = (rw_svc_rank_io_t){ .n_tokens = n_tokens, .page = pg, .page_layout = *l,
				  .page_k = k, .page_row = row,
				  .page_max_recv = rw_ipc_client_page_geom(mb->client)->max_recv };
	for (int i = 0; i < 3; i++)
		io->in[i] = (rw_svc_span_mem_t){ .dev = -1, .buf = RW_BUF_NONE };
	io->out = io->in[0];
	exec_page_busy(p, 1); /* from the kind's first submit to its last done */
	exec_on_submit(p, kind, mb->local);
}

/* A checked dispatch joins its group's pair as a submission answered by words (docs/rankpath.md
 * "A phase"): the pair's open or joined as a ring rank's is (exec_ipc.c), without buffers; the
 * executor's movers then take the pair (the rank mover only takes page ranks, so a group whose
 * ranks here mix rings and pages fails, named). A phase that cannot join is failed on the page. */
static int page_admit(exec_t *x, exec_member_t *mb, rw_page_head_t *pg, const rw_page_layout_t *l,
		      uint64_t k, const rw_page_params_t *prm, const uint32_t *row)
{
	exec_group_t *g = mb->g;
	const rw_wire_key_t key = { .group = g->hash, .layer = prm->layer, .step = prm->step };
	const rw_sqe_t sqe = { .kind = RW_KIND_DISPATCH, .dtype = prm->dtype, .topk = prm->topk,
			       .path = (uint8_t)prm->path, .layer = prm->layer, .phase_id = k,
			       .step = prm->step, .token_count = prm->token_count,
			       .hidden = prm->hidden, .n_experts = prm->n_experts };
	char why[RW_SVC_WHY_MAX];
	exec_pair_t *p = g->pair;
	/* This rank's stream moved on while the group's pair of its last phase (dispatch or
	 * combine) has not ended (its own done may be reported after this submit, and other ranks
	 * may still read): the submit waits for the pair's end (page_take). */
	if (p && !rw_wire_key_eq(&p->key, &key) && p->stage != ST_WAIT_C &&
	    p->in[exec_kind(p)].sub[mb->local].page_k)
		return 1;
	const int tomb = exec_tomb_check(x, &key, RW_SVC_DISPATCH, mb->local, why, sizeof(why));
	exec_tomb_pass(x, &key, RW_SVC_DISPATCH, mb->local);
	if (tomb)
		return page_refuse(x, mb, pg, k, RW_E_PHASE, why);
	switch (exec_dispatch_skip(x, mb, p, &key, why, sizeof(why))) {
	case EXEC_SKIP_MINE: /* a rank that joined again went on past this key */
		exec_seat_absent(x, g, mb->local, &key, RW_SVC_DISPATCH, EXEC_ABSENT_REFUSED, why);
		return page_refuse(x, mb, pg, k, RW_E_PHASE, why);
	case EXEC_SKIP_DONE: /* this rank had this key's answer: its group went on */
		return page_refuse(x, mb, pg, k, RW_E_PHASE, why);
	case EXEC_SKIP_PAIR: /* this rank joined again past the pair's key: it fails first */
		exec_seat_absent(x, g, mb->local, &p->key, RW_SVC_DISPATCH, EXEC_ABSENT_GONE, why);
		p = g->pair; /* NULL: the dispatch opens its own */
		break;
	case EXEC_SKIP_NONE:
		break;
	}
	if (p && !rw_wire_key_eq(&p->key, &key)) {
		if (p->stage != ST_WAIT_C || p->in[RW_SVC_COMBINE].n_sub != 0) {
			snprintf(why, sizeof(why), "layer %u step %llu is still running in this group",
				 p->key.layer, (unsigned long long)p->key.step);
			return page_refuse(x, mb, pg, k, RW_E_STATE, why);
		}
		exec_pair_abandon(p); /* the trainer moved on without a combine */
		p = NULL;
	}
	if (p && (p->stage != ST_GATHER_D || p->in[RW_SVC_DISPATCH].sub[mb->local].have))
		return page_refuse(x, mb, pg, k, RW_E_STATE,
				   "this rank already submitted this dispatch");
	rw_status_t st;
	if (p && (st = exec_plan_fits(p, &sqe, why, sizeof(why))) != RW_OK) {
		page_phase_fail(x, mb, pg, k, exec_client_code(st, 0), why);
		page_absent(x, mb, &key, RW_SVC_DISPATCH, why);
		return 0;
	}
	if (!p && x->svc->draining)
		return page_refuse(x, mb, pg, k, RW_E_STATE, "the daemon is draining");
	if (!p && !(p = exec_pair_open(x, g, &key, &sqe)))
		return page_refuse(x, mb, pg, k, RW_E_INTERNAL, "out of memory");
	const size_t cells = (size_t)x->nodes * x->rails;
	uint32_t *kept = rw_arena_alloc(&p->mem, cells, sizeof(uint32_t));
	if (!kept) {
		exec_pair_fail(p, RW_ERR_NOMEM, "out of memory");
		return 0;
	}
	memcpy(kept, row, cells * sizeof(uint32_t));
	page_attach(mb, pg, l, k, p, RW_SVC_DISPATCH, &sqe, prm->token_count, kept);
	return 0;
}

/* A checked combine joins the pair of its dispatch (docs/rankpath.md "A phase", Combine): the
 * rank's rows are staged (P1), and once every local rank's are, the mover plans it. It must
 * give back exactly the rows its dispatch delivered; else the phase fails on every node. A
 * combine marked abort (ipc/page.h rw_page_params_t.abort: the rank's own call was refused on
 * its host) fails the pair on every node while it waits for this rank's combine, named, as a
 * ring rank's RW_SQE_ABORT; one that comes after the pair ended is answered alone. */
static int page_admit_combine(exec_t *x, exec_member_t *mb, rw_page_head_t *pg,
			      const rw_page_layout_t *l, uint64_t k, const rw_page_params_t *prm)
{
	const uint32_t h = mb->local;
	const rw_wire_key_t key = { .group = mb->g->hash, .layer = prm->layer, .step = prm->step };
	exec_pair_t *p = mb->g->pair;
	char why[RW_SVC_WHY_MAX];
	const int mine = p && rw_wire_key_eq(&p->key, &key) &&
			 p->in[RW_SVC_DISPATCH].sub[h].page_k;
	if (mine && p->stage < ST_WAIT_C)
		return 1; /* its dispatch's pair still waits for another rank's done */
	if (!mine || p->stage != ST_WAIT_C) {
		const int tomb = exec_tomb_check(x, &key, RW_SVC_COMBINE, h, why, sizeof(why));
		exec_tomb_pass(x, &key, RW_SVC_COMBINE, h);
		if (tomb)
			return page_refuse(x, mb, pg, k, RW_E_PHASE, why);
		/* The dispatch's pair failed after this rank's stream had its rows (its done came,
		 * another local rank's had not: the pair was still the dispatch's): the combine is
		 * where this rank hears of it, and its retry of the dispatch starts afresh. */
		if (exec_tomb_late(x, &key, h, why, sizeof(why))) {
			exec_tomb_pass(x, &key, RW_SVC_DISPATCH, h);
			return page_refuse(x, mb, pg, k, RW_E_PHASE, why);
		}
		snprintf(why, sizeof(why), "combine of layer %u step %llu: no dispatch of this rank "
			 "waits for it", prm->layer, (unsigned long long)prm->step);
		return page_refuse(x, mb, pg, k, RW_E_STATE, why);
	}
	if (p->in[RW_SVC_COMBINE].sub[h].have)
		return page_refuse(x, mb, pg, k, RW_E_STATE, "this rank already submitted this "
				   "combine");
	if (prm->abort) { /* it gives no combine: its pair fails on every node, named (an abort
			   * of a pair that ended was answered alone above) */
		snprintf(why, sizeof(why), "aborted its combine of layer %u step %llu: %s",
			 prm->layer, (unsigned long long)prm->step, rw_page_abort_str(prm->abort));
		page_refuse(x, mb, pg, k, RW_E_PHASE, why);
		page_absent(x, mb, &key, RW_SVC_COMBINE, why);
		return 0;
	}
	uint32_t rows = 0;
	const uint32_t *counts;
	p->mv->result(p->mv_state, h, &rows, &counts);
	if (prm->token_count != rows || prm->hidden != p->ph.hidden ||
	    exec_wire_dtype(prm->dtype) != p->ph.dtype) {
		snprintf(why, sizeof(why), "combine of %u rows of %u x dtype %u; the dispatch "
			 "delivered %u rows of %u x dtype %u", prm->token_count, prm->hidden,
			 prm->dtype, rows, p->ph.hidden, p->in[RW_SVC_DISPATCH].sub[h].sqe.dtype);
		page_refuse(x, mb, pg, k, RW_E_TOKENS, why);
		page_absent(x, mb, &key, RW_SVC_COMBINE, why);
		return 0;
	}
	const rw_sqe_t sqe = { .kind = RW_KIND_COMBINE, .dtype = prm->dtype, .layer = prm->layer,
			       .phase_id = k, .step = prm->step, .token_count = rows,
			       .hidden = prm->hidden };
	page_attach(mb, pg, l, k, p, RW_SVC_COMBINE, &sqe, rows, NULL);
	return 0;
}

/* Phase k submitted by the rank: its slot read once, checked. 1: it waits for the group's pair
 * to end (nothing was read into the daemon; it is taken again later); 0: taken. */
static int page_submit(exec_t *x, exec_member_t *mb, rw_page_head_t *pg, uint64_t k)
{
	const rw_page_geom_t *geom = rw_ipc_client_page_geom(mb->client);
	exec_carve_want(x, mb); /* a page rank's kernels write into the group's carve-out */
	if (mb->page_failed == k) { /* its packed or done came first: failed then */
		char why[RW_SVC_WHY_MAX];
		snprintf(why, sizeof(why), "%s moved to %llu before its submit was taken",
			 mb->page_failed_word == RW_PW_PACKED ? "packed" : "done",
			 (unsigned long long)k);
		return page_refuse(x, mb, pg, k, RW_E_TOKENS, why);
	}
	rw_page_layout_t l;
	if (rw_page_layout(geom->nodes, geom->rails, geom->gpus, geom->max_recv, 1, &l) != 0)
		return page_refuse(x, mb, pg, k, RW_E_INTERNAL, "the page's geometry is bad");
	const uint8_t *slot = rw_page_slot_at(pg, &l, k);
	rw_page_params_t params;
	memcpy(&params, slot + l.params, sizeof(params));
	const size_t cells = (size_t)geom->nodes * geom->rails;
	uint32_t *row = malloc(cells * sizeof(*row));
	if (!row)
		return page_refuse(x, mb, pg, k, RW_E_INTERNAL, "out of memory");
	memcpy(row, slot + l.count_row, cells * sizeof(*row));
	char why[RW_SVC_WHY_MAX];
	int32_t code = RW_E_TOKENS;
	if (rw_page_submit_check(geom, &params, row, k, x->svc->topo.gpu_rail[mb->local], why,
				 sizeof(why)) != 0 ||
	    params_check(x, mb, &params, why, &code) != 0 ||
	    exec_carve_lost(mb->g, why, sizeof(why), &code) != 0) {
		free(row);
		page_refuse(x, mb, pg, k, code, why);
		/* The rank has its answer for the slot's layer and step, whatever kind it names: an
		 * absence (a slot of no known kind, from whichever the key's pair waits for) */
		const rw_wire_key_t key = { .group = mb->g->hash, .layer = params.layer,
					    .step = params.step };
		const int kind = params.kind == RW_KIND_DISPATCH ? RW_SVC_DISPATCH :
				 params.kind == RW_KIND_COMBINE ? RW_SVC_COMBINE : EXEC_KIND_ANY;
		if (kind != RW_SVC_COMBINE)
			exec_seat_took(mb->g, mb->local, &key);
		page_absent(x, mb, &key, kind, why);
		return 0;
	}
	const int wait = params.kind == RW_KIND_COMBINE ?
		page_admit_combine(x, mb, pg, &l, k, &params) :
		page_admit(x, mb, pg, &l, k, &params, row);
	free(row);
	if (!wait && params.kind == RW_KIND_DISPATCH)
		exec_seat_took(mb->g, mb->local, &(rw_wire_key_t){ .group = mb->g->hash,
					.layer = params.layer, .step = params.step });
	return wait;
}

static void retry_cb(struct ev_loop *loop, ev_timer *w, int revents);

/* Take the rank's submits in order, up to the last its word showed. P1: the poller's report is
 * the load-acquire of submit; every phase it moved over was published before it. A submit that
 * waits for the group's pair to end stays (the retry timer, and each word of the group, try it
 * again). */
static void page_take(exec_t *x, exec_member_t *mb, rw_page_head_t *pg)
{
	while ((int64_t)(mb->page_seen[RW_PW_SUBMIT] - mb->page_taken) > 0) {
		if (page_submit(x, mb, pg, mb->page_taken + 1)) {
			if (!x->page_retry_init) {
				ev_timer_init(&x->page_retry, retry_cb, 0.002, 0.002);
				x->page_retry.data = x;
				x->page_retry_init = 1;
			}
			if (!ev_is_active(&x->page_retry))
				ev_timer_start(x->svc->loop, &x->page_retry);
			return;
		}
		mb->page_taken++;
	}
}

/* Every member's waiting submits, taken where they can be now. 1: one still waits. */
static int group_take(exec_t *x, exec_group_t *g)
{
	int waits = 0;
	for (uint32_t l = 0; l < x->gpus; l++) {
		exec_member_t *mb = g->member[l];
		rw_page_head_t *pg = mb ? rw_ipc_client_page(mb->client, NULL) : NULL;
		if (!pg)
			continue;
		page_take(x, mb, pg);
		waits |= (g->member[l] == mb) && mb->page_taken != mb->page_seen[RW_PW_SUBMIT];
	}
	return waits;
}

static void retry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)revents;
	exec_t *x = w->data;
	int waits = 0;
	exec_group_t *g, *nx;
	rw_list_for_each_safe(&x->groups, g, nx, link)
		waits |= group_take(x, g);
	if (!waits)
		ev_timer_stop(loop, w);
}

void exec_page_leave(exec_t *x, exec_member_t *mb)
{
	rw_page_head_t *pg = rw_ipc_client_page(mb->client, NULL);
	if (!pg)
		return;
	/* P1: the load-acquire of submit, as the poller's; a move past the depth it would drop the
	 * rank for is not taken */
	const uint64_t v = atomic_load_explicit(&pg->word[RW_PW_SUBMIT].v, memory_order_acquire);
	const int64_t ahead = (int64_t)(v - mb->page_seen[RW_PW_SUBMIT]);
	if (ahead > 0 && ahead <= RW_PAGE_DEPTH)
		mb->page_seen[RW_PW_SUBMIT] = v;
	page_take(x, mb, pg); /* a submit that waits for its group's pair stays (that pair ends) */
}

/* A word the daemon answers (`answer`: plan for packed, arrived for done) must never be passed
 * by the rank's (its stream waits on the answer before it writes). */
static int page_word_ahead(const rw_page_head_t *pg, unsigned answer, uint64_t value)
{
	uint64_t a = atomic_load_explicit(&pg->word[answer].v, memory_order_acquire);
	return (int64_t)(value - a) > 0;
}

void exec_page_word(void *ctx, rw_ipc_client_t *client, unsigned word, uint64_t value)
{
	exec_t *x = ctx;
	exec_member_t *mb = rw_ipc_client_data(client);
	rw_page_head_t *pg = rw_ipc_client_page(client, NULL);
	if (!mb || !pg || word >= RW_PW_COUNT)
		return; /* not a member (a rank's words count only once it joined) */
	uint64_t from = mb->page_seen[word];
	mb->page_seen[word] = value;
	switch (word) {
	case RW_PW_SUBMIT:
		(void)from;
		page_take(x, mb, pg);
		break;
	case RW_PW_PACKED:
	case RW_PW_DONE: {
		unsigned answer = word == RW_PW_PACKED ? RW_PW_PLAN : RW_PW_ARRIVED;
		exec_pair_t *q = mb->g->pair;
		/* The daemon writes arrived as its pair enters the flush: a done for the phase the
		 * pair holds before then is ahead, whatever the page's arrived says (the rank can
		 * write that word too) */
		const int early = word == RW_PW_DONE && q &&
				  q->in[exec_kind(q)].sub[mb->local].page_k == value &&
				  q->stage != ST_FLUSH_D && q->stage != ST_FLUSH_C;
		if (early || page_word_ahead(pg, answer, value)) {
			char why[RW_SVC_WHY_MAX];
			snprintf(why, sizeof(why), "%s moved to %llu, past the daemon's %s",
				 word == RW_PW_PACKED ? "packed" : "done", (unsigned long long)value,
				 answer == RW_PW_PLAN ? "plan" : "arrived");
			exec_pair_t *p = mb->g->pair;
			if (p && p->in[exec_kind(p)].sub[mb->local].page_k == value) /* its pair fails */
				exec_pair_fail(p, RW_ERR_SUB_TOKENS, "group %s rank %u: %s", mb->g->name,
					       x->me * x->gpus + mb->local, why);
			else { /* a phase the pair does not hold (not taken yet: refused when it is);
				* the word still covers the rank's phase the pair holds */
				page_phase_fail(x, mb, pg, value, RW_E_TOKENS, why);
				if ((int64_t)(value - mb->page_taken) > 0) {
					mb->page_failed = value;
					mb->page_failed_word = word;
				}
				if (p) {
					exec_on_page_word(p, mb->local, word, value);
					group_take(x, mb->g);
				}
			}
		} else if (mb->g->pair) {
			exec_group_t *g = mb->g;
			exec_on_page_word(g->pair, mb->local, word, value);
			group_take(x, g); /* the pair may have ended: waiting submits go on */
		}
		break;
	}
	default:
		break;
	}
}
