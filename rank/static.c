/* rank/static.c: the rank path's static mode (ipc/railwave.h "Static mode"; docs/rankpath.md
 * "Static mode and CUDA graphs"): a phase whose number, parameters and words the stream itself
 * takes and writes, so that a CUDA graph of dispatch -> experts -> combine drives new phases on
 * every replay. This CPU checks the call's arguments and enqueues; it keeps no phase number.
 *
 * Each call owns a shadow slot (device memory, the page slot's layout, then the tail of
 * cuda/rank_abi.h): the data kernels of rank_kernels.cu take its fixed addresses, and rw_rank_ctl
 * moves its blocks to and from the page's slot k mod D around the words:
 *   dispatch: BEGIN, count (into the shadow), SUBMIT, WAIT plan, pack, WORD packed,
 *             WAIT arrived, forward, DONE
 *   combine:  BEGIN, STAGE, SUBMIT, WAIT plan, gather, WORD packed, WAIT arrived, reduce, DONE
 * The ordering pairs are eager mode's (P1-P6); who fences what is in rank_kernels.cu. Slot k mod D
 * is free when SUBMIT writes it: the calls run on one stream in order, so phase k - 1 (and with
 * it k - D) wrote done before. */
#include "rank/rank.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(rw_cuda_page_params_t) == sizeof(rw_page_params_t), "params restated");
_Static_assert(offsetof(rw_cuda_page_params_t, bad) == offsetof(rw_page_params_t, bad),
	       "params restated");
_Static_assert(offsetof(rw_cuda_page_params_t, phase) == offsetof(rw_page_params_t, phase),
	       "params restated");
_Static_assert(offsetof(rw_cuda_page_params_t, abort) == offsetof(rw_page_params_t, abort),
	       "params restated");
_Static_assert(RW_RANK_ABORT_ARGUMENT == RW_PAGE_ABORT_ARGUMENT &&
		       RW_RANK_ABORT_ROUTING == RW_PAGE_ABORT_ROUTING &&
		       RW_PAGE_ABORT_COUNT == RW_RANK_ABORT_ROUTING + 1, "abort reasons restated");
_Static_assert(sizeof(rw_cuda_page_stage_t) == sizeof(rw_page_stage_t) &&
		       offsetof(rw_cuda_page_stage_t, rail) == offsetof(rw_page_stage_t, rail) &&
		       offsetof(rw_cuda_page_stage_t, rows) == offsetof(rw_page_stage_t, rows),
	       "staging table restated");
_Static_assert(offsetof(rw_page_list_head_t, count) == 8, "the list's count (rw_rank_ctl reads it)");
_Static_assert(sizeof(rw_cuda_rank_tail_t) == 2 * RW_PAGE_LINE &&
		       offsetof(rw_cuda_rank_tail_t, err) == RW_PAGE_LINE +
							     offsetof(rw_rank_line_t, err) &&
		       offsetof(rw_cuda_rank_tail_t, recv_n) == RW_PAGE_LINE +
								offsetof(rw_rank_line_t, recv_n),
	       "a shadow's tail: its status line, then a line as rw_rank_line_t");

static int open_static(rw_client_t *client, int32_t device, uint32_t max_recv, int32_t max_sms,
		       rw_client_rank_t **rank_p)
{
	rw_client_rank_t *r = NULL;
	if (device == RW_RANK_HOST) /* its phases need this CPU's calls: no graph holds them */
		return rw_rank_say(rw_rank_open_msg(), RW_E_INVAL, "rank path: "
				   "static mode is for CUDA ranks, not RW_RANK_HOST");
	int rc = rw_rank_open(client, device, max_recv, max_sms, 0, &r);
	if (rc)
		return rc;
	rw_rank_static_t *st = calloc(1, sizeof(*st));
	const size_t shadow = r->layout.slot_bytes + sizeof(rw_cuda_rank_tail_t);
	rc = st ? RW_OK : RW_ERR_NOMEM;
	r->st = st; /* rw_client_rank_close frees what was made */
	if (rc == RW_OK)
		rc = rw_cuda_mem_alloc(device, sizeof(rw_cuda_rank_ctlblk_t), &st->ctl);
	if (rc == RW_OK)
		rc = rw_cuda_memset_d8(device, st->ctl, 0, sizeof(rw_cuda_rank_ctlblk_t));
	for (unsigned i = 0; i < RW_RANK_SHADOWS && rc == RW_OK; i++) {
		rc = rw_cuda_mem_alloc(device, shadow, &st->shadow[i]);
		if (rc == RW_OK)
			rc = rw_cuda_memset_d8(device, st->shadow[i], 0, shadow);
	}
	if (rc == RW_OK)
		rc = rw_cuda_host_alloc(sizeof(rw_cuda_rank_report_t), (void **)&st->report);
	if (rc != RW_OK) {
		rw_client_rank_close(r);
		return rw_rank_say(rw_rank_open_msg(), RW_E_CUDA, "rank path: no "
				   "device memory for static mode (%u shadow slots of %zu bytes)",
				   RW_RANK_SHADOWS, shadow);
	}
	memset(st->report, 0, sizeof(*st->report));
	*rank_p = r;
	return 0;
}

int rw_client_rank_open_static(rw_client_t *client, int32_t device, uint32_t max_recv,
			       rw_client_rank_t **rank_p)
{
	return open_static(client, device, max_recv, 0, rank_p);
}

/* Here, not in rank.c: it picks the mode, and rank.c never calls static mode. */
int rw_client_rank_open_opts(rw_client_t *client, int32_t device, const rw_client_rank_opts_t *o,
			     rw_client_rank_t **rank_p)
{
	if (!o)
		return rw_rank_say(rw_rank_open_msg(), RW_E_INVAL, "rank path: no options");
	for (unsigned i = 0; i < sizeof(o->reserved) / sizeof(o->reserved[0]); i++)
		if (o->reserved[i])
			return rw_rank_say(rw_rank_open_msg(), RW_E_INVAL, "rank path: options: "
					   "reserved word %u is not 0", i);
	if (o->flags & ~RW_RANK_OPEN_STATIC)
		return rw_rank_say(rw_rank_open_msg(), RW_E_INVAL, "rank path: options: unknown "
				   "flags 0x%x", o->flags & ~RW_RANK_OPEN_STATIC);
	if (o->flags & RW_RANK_OPEN_STATIC)
		return open_static(client, device, o->max_recv, o->max_sms, rank_p);
	return rw_rank_open(client, device, o->max_recv, o->max_sms, 1, rank_p);
}

/* Where a call's blocks are: its shadow (the status line and line in its tail). */
static rw_rank_where_t where_of(const rw_client_rank_t *r, rw_cuda_dptr_t shadow)
{
	const rw_cuda_dptr_t tail = shadow + r->layout.slot_bytes;
	return (rw_rank_where_t){ .slot = shadow, .status = tail + offsetof(rw_cuda_rank_tail_t, status),
				  .line = tail + RW_PAGE_LINE, .scratch = r->scratch[0] };
}

/* What both calls check first: their arguments there, static mode, the stream's device, the
 * daemon there. */
static int call_open(rw_client_rank_t *r, const char *what, const rw_client_stream_t *s,
		     const void *args, const uint64_t *call_p)
{
	if (!s || !args || !call_p)
		return rw_rank_say(r->msg, RW_E_INVAL, "%s: NULL argument", what);
	if (!r->st)
		return rw_rank_say(r->msg, RW_E_STATE, "%s: the rank path is not in static mode "
				   "(rw_client_rank_open_static)", what);
	if (s->reserved || s->device != r->device)
		return rw_rank_say(r->msg, RW_E_INVAL, "%s: a reserved field is not 0, or the stream "
				   "is not on the rank path's device %d", what, r->device);
	/* the daemon gone: plan far past what the stream submitted */
	return rw_rank_phase_open(r, what, atomic_load_explicit(&r->pg->word[RW_PW_SUBMIT].v,
								memory_order_acquire) + 1);
}

/* From SUBMIT on (`pre`: the status of what came before it): the phase's words and kernels
 * (none when `first` is NULL: an abort, which the daemon fails whatever it holds).
 * A failure after SUBMIT was enqueued breaks the rank path (the stream took a phase number the
 * daemon will wait on). */
static int phase_enqueue(rw_client_rank_t *r, const rw_cuda_ext_stream_t *es, rw_status_t pre,
			 rw_cuda_rank_ctl_t *b, const void *first, const void *second)
{
	/* After SUBMIT, in stream order; op KERNEL: the data kernel (records, then outputs). */
	enum { KERNEL = 100 };
	static const struct { uint32_t op, word; } step[] = {
		{ RW_CUDA_RANK_OP_WAIT, RW_PW_PLAN }, { KERNEL, 0 },
		{ RW_CUDA_RANK_OP_WORD, RW_PW_PACKED }, { RW_CUDA_RANK_OP_WAIT, RW_PW_ARRIVED },
		{ KERNEL, 1 }, { RW_CUDA_RANK_OP_DONE, RW_PW_DONE },
	};
	const char *what = b->kind ? "combine" : "dispatch";
	rw_status_t st = pre;
	b->op = RW_CUDA_RANK_OP_SUBMIT;
	if (st == RW_OK)
		st = rw_cuda_rank_ctl(es, b);
	if (st != RW_OK)
		return rw_rank_say(r->msg, RW_E_CUDA, "%s: enqueueing its first work or submit failed "
				   "(%s)", what, rw_status_str(st));
	for (unsigned i = 0; i < sizeof(step) / sizeof(step[0]) && st == RW_OK; i++) {
		if (step[i].op == KERNEL && !first) /* an abort: its words only */
			continue;
		if (step[i].op != KERNEL) {
			b->op = step[i].op, b->word = step[i].word;
			st = rw_cuda_rank_ctl(es, b);
		} else if (step[i].word == 0) { /* the records: pack, or gather */
			st = b->kind ? rw_cuda_rank_gather(es, first) : rw_cuda_rank_pack(es, first);
		} else { /* the outputs: forward, or reduce */
			st = b->kind ? rw_cuda_rank_reduce(es, second) : rw_cuda_rank_forward(es, second);
		}
	}
	if (st != RW_OK) {
		r->broken = RW_E_CUDA;
		return rw_rank_say(r->msg, RW_E_CUDA, "%s: submitted, but enqueueing its kernels "
				   "failed (%s): the rank path is broken", what, rw_status_str(st));
	}
	return 0;
}

/* Take call number c and its shadow. */
static rw_rank_call_t *call_take(rw_client_rank_t *r, uint64_t *c_p, rw_cuda_dptr_t *shadow_p)
{
	const uint64_t c = ++r->st->calls;
	rw_rank_call_t *call = &r->st->call[c % RW_RANK_SHADOWS];
	memset(call, 0, sizeof(*call));
	call->call = c;
	*c_p = c;
	*shadow_p = r->st->shadow[c % RW_RANK_SHADOWS];
	return call;
}

int rw_client_rank_dispatch_static(rw_client_rank_t *r, const rw_client_stream_t *s,
				   const rw_client_rank_dispatch_t *d, uint64_t recv_n,
				   uint64_t *call_p)
{
	if (!r)
		return RW_E_INVAL;
	int rc = call_open(r, "dispatch", s, d, call_p);
	if (rc == 0)
		rc = rw_rank_check_dispatch(r, s, d);
	if (rc == 0 && recv_n % 4)
		rc = rw_rank_say(r->msg, RW_E_INVAL, "dispatch: recv_n is not a 4-byte aligned "
				 "device address");
	if (rc)
		return rc;
	uint64_t c;
	rw_cuda_dptr_t shadow;
	rw_rank_call_t *call = call_take(r, &c, &shadow);
	call->kind = RW_KIND_DISPATCH;
	call->p = (rw_page_params_t){ .kind = RW_KIND_DISPATCH, .dtype = d->dtype, .topk = d->topk,
				      .layer = d->layer, .hidden = d->hidden,
				      .n_experts = d->n_experts, .token_count = d->token_count,
				      .path = d->path, .step = d->step };
	const rw_cuda_ext_stream_t es = rw_rank_stream(r, s);
	rw_cuda_rank_ctl_t b = rw_rank_ctl_block(r, RW_CUDA_RANK_OP_BEGIN, 0, shadow);
	b.dtype = d->dtype, b.topk = d->topk, b.layer = d->layer, b.hidden = d->hidden;
	b.n_experts = d->n_experts, b.token_count = d->token_count, b.path = d->path;
	b.step = d->step, b.out = recv_n;
	rw_status_t st = rw_cuda_rank_ctl(&es, &b);
	if (st == RW_OK)
		st = rw_cuda_route_count_ext(&es, d->topk_ids, d->token_count, d->topk, d->n_experts,
					     r->pg->nodes, r->pg->rails, r->pg->rail,
					     shadow + r->layout.count_row,
					     shadow + r->layout.params +
						     offsetof(rw_page_params_t, bad));
	rw_cuda_rank_pack_t pk;
	rw_cuda_rank_forward_t fw;
	const rw_rank_where_t w = where_of(r, shadow);
	rw_rank_dispatch_blocks(r, &w, d, &pk, &fw);
	rc = phase_enqueue(r, &es, st, &b, &pk, &fw);
	if (rc == 0)
		*call_p = c;
	return rc;
}

/* The static dispatch call cd whose combine is due (a static dispatch among the last calls,
 * not combined yet), or NULL with the error in r->msg. */
static rw_rank_call_t *combine_due(rw_client_rank_t *r, const char *what, uint64_t cd)
{
	rw_rank_call_t *dc = &r->st->call[cd % RW_RANK_SHADOWS];
	if (cd == 0 || cd > r->st->calls || r->st->calls - cd >= RW_RANK_SHADOWS - 1 ||
	    dc->call != cd || dc->kind != RW_KIND_DISPATCH || dc->combined) {
		rw_rank_say(r->msg, RW_E_STATE, "%s: call %llu is not a static dispatch of this "
			    "rank path among its last %u calls, not combined yet", what,
			    (unsigned long long)cd, RW_RANK_SHADOWS - 2);
		return NULL;
	}
	return dc;
}

/* The combine call of dispatch call dc: its number (*cc_p) and shadow taken, dc marked
 * combined; its BEGIN block, naming dc's shadow. */
static rw_cuda_rank_ctl_t combine_call(rw_client_rank_t *r, rw_rank_call_t *dc, uint64_t *cc_p)
{
	rw_cuda_dptr_t shadow;
	rw_rank_call_t *call = call_take(r, cc_p, &shadow);
	call->kind = RW_KIND_COMBINE;
	dc->combined = 1;
	rw_cuda_rank_ctl_t b = rw_rank_ctl_block(r, RW_CUDA_RANK_OP_BEGIN, 1, shadow);
	b.ref = r->st->shadow[dc->call % RW_RANK_SHADOWS];
	return b;
}

int rw_client_rank_combine_static(rw_client_rank_t *r, const rw_client_stream_t *s,
				  const rw_client_rank_combine_t *c, uint64_t *call_p)
{
	if (!r)
		return RW_E_INVAL;
	int rc = call_open(r, "combine", s, c, call_p);
	if (rc)
		return rc;
	const uint64_t cd = c->dispatch;
	rw_rank_call_t *dc = combine_due(r, "combine", cd);
	if (!dc)
		return RW_E_STATE;
	const rw_page_params_t dp = dc->p;
	if (c->rows % 16 || (dp.token_count && (c->out == 0 || c->out % 16)) ||
	    (r->pg->max_recv && c->rows == 0))
		return rw_rank_say(r->msg, RW_E_INVAL, "combine: rows or out is not a 16-byte "
				   "aligned device address");
	if (r->n_slabs < r->pg->rails)
		return rw_rank_say(r->msg, RW_E_STATE, "combine: the rank path holds no group slabs");
	const rw_cuda_dptr_t dshadow = r->st->shadow[cd % RW_RANK_SHADOWS];
	uint64_t cc;
	rw_cuda_rank_ctl_t b = combine_call(r, dc, &cc);
	const rw_cuda_dptr_t shadow = b.shadow;
	const rw_cuda_ext_stream_t es = rw_rank_stream(r, s);
	b.src = c->rows; /* it stages in its native rail's slab */
	b.slab = r->pg->rail < r->n_slabs ? r->slab[r->pg->rail].dptr : 0;
	b.slab_bytes = r->pg->rail < r->n_slabs ? r->slab[r->pg->rail].lent.bytes : 0;
	b.row_bytes = dp.hidden * (dp.dtype == RW_DTYPE_BF16 ? 2u : 4u);
	rw_status_t st = rw_cuda_rank_ctl(&es, &b);
	b.op = RW_CUDA_RANK_OP_STAGE; /* this rank's rows staged before submit (P1) */
	if (st == RW_OK)
		st = rw_cuda_rank_ctl(&es, &b);
	rw_cuda_rank_gather_t ga;
	rw_cuda_rank_reduce_t re;
	const rw_rank_where_t w = where_of(r, shadow);
	rw_rank_combine_blocks(r, &w, dshadow, &dp, NULL,
			       dshadow + r->layout.plan_stage,
			       c, &ga, &re);
	rc = phase_enqueue(r, &es, st, &b, &ga, &re);
	if (rc == 0)
		*call_p = cc;
	return rc;
}

/* Static mode's abort: BEGIN, SUBMIT of a combine of call cd marked `reason` (the stream takes
 * its number and its dispatch's key from device memory, as a combine), the waits and words, no
 * kernel; the daemon fails it (and the pair on every node while it waits for this rank). */
static int abort_static(rw_client_rank_t *r, const rw_client_stream_t *s, uint64_t cd,
			uint32_t reason, uint64_t *call_p)
{
	int rc = call_open(r, "abort", s, &cd, call_p);
	if (rc)
		return rc;
	rw_rank_call_t *dc = combine_due(r, "abort", cd);
	if (!dc)
		return RW_E_STATE;
	uint64_t cc;
	rw_cuda_rank_ctl_t b = combine_call(r, dc, &cc);
	const rw_cuda_ext_stream_t es = rw_rank_stream(r, s);
	b.abort = reason;
	rc = phase_enqueue(r, &es, rw_cuda_rank_ctl(&es, &b), &b, NULL, NULL);
	if (rc == 0)
		*call_p = cc;
	return rc;
}

/* Here, not in rank.c: it picks the mode, as rw_client_rank_open_opts. */
int rw_client_rank_abort(rw_client_rank_t *r, const rw_client_stream_t *s, uint64_t dispatch,
			 uint32_t reason, uint64_t *phase_p)
{
	if (!r)
		return RW_E_INVAL;
	if (reason == RW_PAGE_ABORT_NONE || reason >= RW_PAGE_ABORT_COUNT)
		return rw_rank_say(r->msg, RW_E_INVAL, "abort: reason %u (1..%u)", reason,
				   RW_PAGE_ABORT_COUNT - 1);
	if (r->st)
		return abort_static(r, s, dispatch, reason, phase_p);
	return rw_rank_abort_eager(r, s, dispatch, reason, phase_p);
}

int rw_client_rank_check(rw_client_rank_t *r, rw_client_rank_check_t *check_p)
{
	if (!r)
		return RW_E_INVAL;
	rw_client_rank_check_t chk = { 0 };
	if (!r->st) {
		if (check_p)
			*check_p = chk;
		return rw_rank_say(r->msg, RW_E_STATE, "check: the rank path is not in static mode");
	}
	/* the stream wrote the report before its done word: acquire that word first (P5) */
	(void)atomic_load_explicit(&r->pg->word[RW_PW_DONE].v, memory_order_acquire);
	const rw_cuda_rank_report_t rep = *r->st->report;
	memset(r->st->report, 0, sizeof(*r->st->report));
	r->st->report->done = rep.done;
	chk = (rw_client_rank_check_t){ .done = rep.done, .phase = rep.fail_phase,
					.over_phase = rep.over_phase, .overflow = rep.over_rows,
					.need = rep.need };
	if (check_p)
		*check_p = chk;
	const unsigned long long k = rep.fail_phase;
	const char *kind = rep.fail_kind ? "combine" : "dispatch";
	if (rep.over_n && (k == 0 || rep.over_phase <= k)) /* the first cause first */
		return rw_rank_say(r->msg, RW_E_OVERFLOW, "%u dispatches from phase %llu had rows "
				   "past recv_cap: %u rows dropped (their combine added +0 for them); "
				   "recv_cap %u would have held them%s", rep.over_n,
				   (unsigned long long)rep.over_phase, rep.over_rows, rep.need,
				   k ? "; a later phase failed too" : "");
	if (k && (rep.bad || rep.err[0] == RW_CUDA_RANK_E_ID))
		return rw_rank_say(r->msg, RW_E_TOKENS, "phase %llu (%s): token %u has a top-k expert "
				   "id outside [0, n_experts) other than -1 (it counted nothing)", k,
				   kind, (rep.bad ? rep.bad : rep.err[1]) - 1);
	if (k && rep.status)
		return rw_rank_say(r->msg, rep.status, "phase %llu (%s) failed: %s", k, kind,
				   rw_client_strerror(rep.status));
	if (k && rep.err[0] == RW_CUDA_RANK_E_STAGE)
		return rw_rank_say(r->msg, RW_E_BADREPLY, "phase %llu (combine): its dispatch's plan "
				   "names no staging area that holds its %u rows", k, rep.err[1]);
	if (k)
		return rw_rank_say(r->msg, RW_E_BADREPLY, "phase %llu (%s): the daemon's plan or list "
				   "does not fit this rank's records (kernel error %u, detail %u)",
				   k, kind, rep.err[0], rep.err[1]);
	return rw_rank_phase_open(r, "check", rep.done + 1); /* 0, or the daemon gone, or broken */
}
