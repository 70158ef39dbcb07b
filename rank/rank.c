/* rank/rank.c: the rank path's calls (ipc/railwave.h "The rank path"): open (the page mapped and
 * registered with CUDA), dispatch (parameters into the phase's slot, then the count kernel and
 * the words on the caller's stream), the eager completion and close. The CPU of this process
 * never waits for the GPU and makes no system call on a phase's path.
 *
 * Ordering pairs (docs/rankpath.md "The acquire/release pairs"):
 *   P1 this CPU stores the parameters and zeroes the count row and bad word of slot k mod D,
 *      then a release fence, then enqueues the count kernel and submit = k
 *      (cuStreamWriteValue64 with its barrier) -> the daemon load-acquires submit, reads the slot.
 *   P5 the stream writes done = k after its last read of phase k -> this CPU load-acquires done
 *      (rw_client_rank_wait), then reads the phase's status line and bad word.
 *   The slot of phase k is reused by phase k + D only once done >= k: nobody reads it then. */
#include "rank/rank.h"

#include <sched.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define D RW_PAGE_DEPTH

/* Why the calling thread's last rw_client_rank_open failed (no object to hold it). */
static _Thread_local char open_msg[RW_RANK_MSG_MAX];

#define say rw_rank_say /* rank.h: rank/static.c says its errors the same way */
int rw_rank_say(char *buf, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, RW_RANK_MSG_MAX, fmt, ap);
	va_end(ap);
	return code;
}

/* Cyclic "word >= k" (docs/rankpath.md: 64 bits never wrap in practice). */
static int reached(uint64_t word, uint64_t k)
{
	return (int64_t)(word - k) >= 0;
}

static uint64_t word_load(const rw_client_rank_t *r, unsigned w)
{
	return atomic_load_explicit(&r->pg->word[w].v, memory_order_acquire);
}

static rw_cuda_dptr_t word_dev(const rw_client_rank_t *r, unsigned w)
{
	return r->dptr + offsetof(rw_page_head_t, word) + (rw_cuda_dptr_t)w * sizeof(rw_page_line_t);
}

static size_t slot_off(const rw_client_rank_t *r, uint64_t k)
{
	return r->layout.slot0 + (size_t)(k % D) * r->layout.slot_bytes;
}

static rw_page_params_t *slot_params(const rw_client_rank_t *r, uint64_t k)
{
	return (rw_page_params_t *)((uint8_t *)r->pg + slot_off(r, k) + r->layout.params);
}

/* An SM budget for `device` (CUDA initialized, the device checked): 0, or RW_E_INVAL said. */
static int sms_check(char *msg, int32_t device, int32_t max_sms)
{
	if (max_sms == 0)
		return 0;
	if (device == RW_RANK_HOST)
		return say(msg, RW_E_INVAL, "rank path: max_sms %d: an SM budget is for CUDA ranks "
			   "(RW_RANK_HOST runs on this CPU): pass 0", max_sms);
	const int sms = rw_cuda_device_sms(device);
	if (sms == 0)
		return say(msg, RW_E_INVAL, "rank path: max_sms %d: device %d does not say how many "
			   "SMs it has (0: the kernels' own choice)", max_sms, device);
	if (max_sms < 0 || max_sms > sms)
		return say(msg, RW_E_INVAL, "rank path: max_sms %d is outside 1..%d: device %d has "
			   "%d SMs (0: the kernels' own choice)", max_sms, sms, device, sms);
	return 0;
}

int rw_client_rank_open(rw_client_t *client, int32_t device, uint32_t max_recv,
			rw_client_rank_t **rank_p)
{
	return rw_rank_open(client, device, max_recv, 0, 1, rank_p);
}

int rw_client_rank_set_sms(rw_client_rank_t *r, int32_t max_sms)
{
	if (!r)
		return RW_E_INVAL;
	int rc = sms_check(r->msg, r->host ? RW_RANK_HOST : r->device, max_sms);
	if (rc == 0)
		r->max_sms = max_sms;
	return rc;
}

rw_cuda_ext_stream_t rw_rank_stream(const rw_client_rank_t *r, const rw_client_stream_t *s)
{
	return (rw_cuda_ext_stream_t){ .device = s->device, .handle = s->handle,
				       .max_blocks = (uint32_t)r->max_sms };
}

int rw_rank_open(rw_client_t *client, int32_t device, uint32_t max_recv, int32_t max_sms,
		 int eager, rw_client_rank_t **rank_p)
{
	open_msg[0] = '\0';
	if (!client || !rank_p)
		return say(open_msg, RW_E_INVAL, "rank path: no client");
	const int host = device == RW_RANK_HOST; /* rank/host.c: no CUDA */
	if (host && max_sms)
		return sms_check(open_msg, device, max_sms);
	if (host)
		goto checked;
	if (rw_cuda_init() != RW_OK)
		return say(open_msg, RW_E_NO_CUDA, "rank path: %s", rw_cuda_unavailable_reason());
	if (device < 0 || device >= rw_cuda_device_count())
		return say(open_msg, RW_E_INVAL, "rank path: no CUDA device %d here (%d visible)",
			   device, rw_cuda_device_count());
	if (!rw_cuda_words_supported(device))
		return say(open_msg, RW_E_NO_CUDA, "rank path: device %d runs no 64-bit stream "
			   "memory operations (cuStreamWriteValue64 / cuStreamWaitValue64)", device);
	if (!rw_cuda_kernels_available(device) || !rw_cuda_rank_kernels_available(device))
		return say(open_msg, RW_E_NO_CUDA, "rank path: the kernels do not load on device %d "
			   "(built without nvcc, or no sm_90 code or PTX the driver takes)", device);
	if (sms_check(open_msg, device, max_sms))
		return RW_E_INVAL;
checked:;
	rw_client_rank_t *r = calloc(1, sizeof(*r));
	if (!r)
		return say(open_msg, RW_E_NOMEM, "rank path: out of memory");
	r->max_sms = max_sms;
	void *page;
	int rc = rw_client_rank_page(client, max_recv, &page, &r->bytes);
	if (rc) {
		free(r);
		return say(open_msg, rc, "rank path: no rank page: %s (%s)", rw_client_strerror(rc),
			   rw_client_last_message(client));
	}
	r->client = client;
	r->pg = page;
	r->device = device;
	r->next = 1;
	if (rw_page_layout(r->pg->nodes, r->pg->rails, r->pg->gpus, r->pg->max_recv,
			   (size_t)sysconf(_SC_PAGESIZE), &r->layout) || r->layout.bytes != r->bytes ||
	    r->layout.slot_bytes != r->pg->slot_bytes || r->pg->rail >= r->pg->rails ||
	    r->pg->node >= r->pg->nodes || r->pg->owner >= r->pg->gpus) {
		rc = say(open_msg, RW_E_BADREPLY, "rank path: the daemon's page does not have the "
			 "layout its head describes");
		goto fail_free; /* the client unmaps the page at close */
	}
	if (host) {
		r->dptr = (rw_cuda_dptr_t)(uintptr_t)page;
	} else if (rw_cuda_host_register_mapped(page, r->bytes, &r->dptr) != RW_OK) {
		rc = say(open_msg, RW_E_CUDA, "rank path: cuMemHostRegister of the rank page (%zu "
			 "bytes) failed", r->bytes);
		goto fail_free;
	}
	if ((rc = rw_rank_slabs_open(r)) != 0) { /* the group's slabs (rank/slabs.c) */
		snprintf(open_msg, sizeof(open_msg), "%s", r->msg);
		goto fail_page;
	}
	if (host) {
		if ((rc = rw_rank_host_open(r)) != 0) {
			snprintf(open_msg, sizeof(open_msg), "%s", r->msg);
			rw_rank_slabs_close(r);
			goto fail_free;
		}
		*rank_p = r;
		return 0;
	}
	/* Each slot's pack scratch (phases on different streams may pack at once) and its line. */
	const size_t scratch = rw_cuda_rank_pack_scratch(r->pg->max_tokens ? r->pg->max_tokens : 1,
							 32);
	const size_t mirror = (size_t)r->layout.slot_bytes + sizeof(rw_cuda_rank_tail_t);
	for (unsigned i = 0; i < D && rc == 0; i++)
		if (rw_cuda_mem_alloc(device, scratch, &r->scratch[i]) != RW_OK ||
		    (eager && rw_cuda_mem_alloc(device, mirror, &r->mirror[i]) != RW_OK))
			rc = RW_E_CUDA;
	if (rc == 0 && rw_cuda_host_alloc(D * sizeof(rw_rank_line_t), (void **)&r->lines) != RW_OK)
		rc = RW_E_CUDA;
	if (rc) {
		say(open_msg, rc, "rank path: no device memory for the pack's scratch and the slot's "
		    "mirror (%zu + %zu bytes a slot) or no page-locked memory", scratch, mirror);
		goto fail_mem;
	}
	memset(r->lines, 0, D * sizeof(rw_rank_line_t));
	*rank_p = r;
	return 0;
fail_mem:
	for (unsigned i = 0; i < D; i++) {
		if (r->scratch[i])
			rw_cuda_mem_free(device, r->scratch[i]);
		if (r->mirror[i])
			rw_cuda_mem_free(device, r->mirror[i]);
	}
	rw_rank_slabs_close(r);
fail_page:
	if (!host)
		rw_cuda_host_unregister(page);
fail_free:
	free(r);
	return rc;
}

void rw_client_rank_close(rw_client_rank_t *r)
{
	if (!r)
		return;
	if (r->st) { /* static mode's memory (rank/static.c made it) */
		for (unsigned i = 0; i < RW_RANK_SHADOWS; i++)
			rw_cuda_mem_free(r->device, r->st->shadow[i]);
		rw_cuda_mem_free(r->device, r->st->ctl);
		rw_cuda_host_free(r->st->report);
		free(r->st);
	}
	if (r->host) {
		rw_rank_host_close(r);
		rw_rank_slabs_close(r);
		free(r);
		return;
	}
	rw_cuda_host_free(r->lines);
	for (unsigned i = 0; i < D; i++) {
		rw_cuda_mem_free(r->device, r->scratch[i]);
		rw_cuda_mem_free(r->device, r->mirror[i]);
	}
	rw_rank_slabs_close(r);
	rw_cuda_host_unregister(r->pg);
	free(r);
}

char *rw_rank_open_msg(void)
{
	return open_msg;
}

const char *rw_client_rank_message(const rw_client_rank_t *r)
{
	return r ? r->msg : open_msg;
}

/* How phase k ended, once done >= k: the count kernel's bad word first (this rank's own input),
 * then the status line the daemon (or this CPU, when the daemon was lost) wrote for it, then
 * what the kernels reported (their error word, the rows past the capacity). */
static rw_rank_result_t result_of(const rw_client_rank_t *r, uint64_t k)
{
	const rw_rank_line_t *ln = &r->lines[k % D];
	rw_rank_result_t res = { .phase = k, .recv_n = ln->recv_n, .overflow = ln->overflow,
				 .err = ln->err[0], .err_detail = ln->err[1] };
	res.bad = slot_params(r, k)->bad;
	res.error = (int32_t)(uint32_t)atomic_load_explicit(&r->pg->status[k % D].v,
							    memory_order_relaxed);
	if (res.bad || (res.error == 0 && res.err == RW_CUDA_RANK_E_ID))
		res.error = RW_E_TOKENS;
	else if (res.error == 0 && res.err)
		res.error = RW_E_BADREPLY;
	else if (res.error == 0 && res.overflow)
		res.error = RW_E_OVERFLOW;
	return res;
}

static int answer(rw_client_rank_t *r, const rw_rank_result_t *res,
		  rw_client_rank_done_t *done_p)
{
	static const char *const kernel_err[] = { "", "a top-k id out of range", "a record no plan "
		"entry holds", "a list entry naming no area or rail", "a record whose header does not "
		"match the phase" };
	const unsigned long long k = res->phase;
	if (done_p)
		*done_p = (rw_client_rank_done_t){ .recv_tokens = res->recv_n,
						   .overflow = res->overflow };
	if (res->bad || (res->error == RW_E_TOKENS && res->err == RW_CUDA_RANK_E_ID))
		return say(r->msg, RW_E_TOKENS, "phase %llu: token %u has a top-k expert id outside "
			   "[0, n_experts) other than -1 (it counted nothing)", k,
			   (res->bad ? res->bad : res->err_detail) - 1);
	if (res->error == RW_E_BADREPLY)
		return say(r->msg, RW_E_BADREPLY, "phase %llu: the daemon's plan or list does not fit "
			   "this rank's records: the kernels found %s (detail %u)", k,
			   res->err < 5 ? kernel_err[res->err] : "an unknown error", res->err_detail);
	if (res->error == RW_E_OVERFLOW)
		return say(r->msg, RW_E_OVERFLOW, "phase %llu: %u records came past recv_cap (%u "
			   "rows written): dropped", k, res->overflow, res->recv_n);
	if (res->error) { /* the daemon's reason came on the socket before the status line */
		rw_client_take_notices(r->client);
		const char *why = rw_client_last_message(r->client);
		return say(r->msg, res->error, "phase %llu failed: %s%s%s", k,
			   rw_client_strerror(res->error), why[0] ? ": " : "", why);
	}
	return 0;
}

int rw_rank_check_dispatch(rw_client_rank_t *r, const rw_client_stream_t *s,
			   const rw_client_rank_dispatch_t *d)
{
	if (s->reserved || d->reserved0 || d->reserved1 || d->reserved2)
		return say(r->msg, RW_E_INVAL, "dispatch: a reserved field is not 0");
	if (r->n_slabs < r->pg->rails)
		return say(r->msg, r->slabs_code ? r->slabs_code : RW_E_STATE, "dispatch: the rank "
			   "path holds no group slabs (the daemon lent none: %s)",
			   rw_client_strerror(r->slabs_code));
	if (s->device != r->device)
		return say(r->msg, RW_E_INVAL, "dispatch: the stream is on device %d, the rank path "
			   "on device %d", s->device, r->device);
	if (d->dtype != RW_DTYPE_BF16 && d->dtype != RW_DTYPE_FP32)
		return say(r->msg, RW_E_DTYPE, "dispatch: dtype %u: the rank path carries bf16 and "
			   "fp32 rows", d->dtype);
	if (d->topk == 0 || d->topk > 32 || d->hidden == 0 || d->token_count > r->pg->max_tokens)
		return say(r->msg, RW_E_TOKENS, "dispatch: topk %u (1..32), hidden %u (>= 1) or "
			   "token_count %u (<= %u) out of range", d->topk, d->hidden, d->token_count,
			   r->pg->max_tokens);
	const uint32_t world = r->pg->nodes * r->pg->gpus;
	if (d->n_experts == 0 || d->n_experts % world != 0 ||
	    d->n_experts / world > RW_CUDA_RANK_EXPERTS_MAX)
		return say(r->msg, RW_E_EXPERTS, "dispatch: n_experts %u is not a nonzero multiple "
			   "of the world (%u ranks), at most %u a rank", d->n_experts, world,
			   RW_CUDA_RANK_EXPERTS_MAX);
	if (d->path > RW_PATH_REQ_JOINT)
		return say(r->msg, RW_E_FIELD, "dispatch: unknown path request %u", d->path);
	if (d->token_count && (d->topk_ids == 0 || d->topk_ids % 4 != 0 || d->tokens == 0 ||
			       d->tokens % 16 != 0 || d->topk_weights == 0 || d->topk_weights % 4))
		return say(r->msg, RW_E_INVAL, "dispatch: tokens (16-byte), topk_ids or topk_weights "
			   "(4-byte) is not an aligned device address");
	if (d->recv_x % 16 || d->recv_meta % 16 || d->recv_counts % 16 || !d->recv_counts ||
	    (d->recv_cap && (!d->recv_x || !d->recv_meta)))
		return say(r->msg, RW_E_INVAL, "dispatch: recv_x, recv_meta or recv_counts is not a "
			   "16-byte aligned device address");
	return 0;
}

/* Is slot k mod D free (the phase before in it, k - D, is done)? Keep that phase's result. */
static int take_slot(rw_client_rank_t *r, uint64_t k)
{
	if (r->host) /* as a stream's order: phase k's submit follows every earlier phase's done */
		rw_rank_host_drive(r, k - 1, -1);
	if (k > D) {
		if (!reached(word_load(r, RW_PW_DONE), k - D))
			return say(r->msg, RW_E_AGAIN, "dispatch: %u phases in flight (phase %llu is "
				   "not done)", D, (unsigned long long)(k - D));
		rw_rank_result_t *kept = &r->kept[(k - D) % RW_RANK_KEPT];
		if (kept->phase != k - D) /* else answered already: that answer stands */
			*kept = result_of(r, k - D);
	}
	return 0;
}

static uint32_t cuda_dtype(uint8_t dtype)
{
	return dtype == RW_DTYPE_BF16 ? RW_CUDA_BF16 : RW_CUDA_FP32;
}

/* Slot k's blocks as eager phase k's kernels read them: its mirror (device memory; the stream's
 * SNAP copies the slot there after each wait), or for a host rank the page's slot itself. */
static rw_cuda_dptr_t slot_read(const rw_client_rank_t *r, uint64_t k)
{
	return r->host ? r->dptr + slot_off(r, k) : r->mirror[k % D];
}

/* Where eager phase k's blocks are: slot_read's, its status (the page head's line for a host
 * rank; for a CUDA rank the status SNAP copied into the mirror's tail), its line. */
static rw_rank_where_t where_of(const rw_client_rank_t *r, uint64_t k)
{
	const rw_cuda_dptr_t status = r->host ?
		r->dptr + offsetof(rw_page_head_t, status) + (k % D) * sizeof(rw_page_line_t) :
		r->mirror[k % D] + r->layout.slot_bytes + offsetof(rw_cuda_rank_tail_t, status);
	return (rw_rank_where_t){ .slot = slot_read(r, k), .status = status,
				  .line = (rw_cuda_dptr_t)(uintptr_t)&r->lines[k % D],
				  .scratch = r->scratch[k % D] };
}

rw_cuda_rank_ctl_t rw_rank_ctl_block(const rw_client_rank_t *r, uint32_t op, uint32_t kind,
				     rw_cuda_dptr_t shadow)
{
	const rw_page_layout_t *l = &r->layout;
	return (rw_cuda_rank_ctl_t){
		.ctl = r->st ? r->st->ctl : 0,
		.report = r->st ? (rw_cuda_dptr_t)(uintptr_t)r->st->report : 0,
		.page = r->dptr, .shadow = shadow, .op = op, .kind = kind,
		.depth = RW_PAGE_DEPTH, .slot0 = l->slot0, .slot_bytes = l->slot_bytes,
		.word_off = offsetof(rw_page_head_t, word),
		.status_off = offsetof(rw_page_head_t, status), .o_params = l->params,
		.o_count_row = l->count_row, .o_plan = l->plan, .o_list = l->list,
		.o_list_entry = l->list_entry, .o_term_off = l->term_off, .o_term_ref = l->term_ref,
		.o_plan_stage = l->plan_stage, .rail = r->pg->rail,
		.cells = r->pg->nodes * r->pg->rails, .max_recv = r->pg->max_recv,
		.gpus = r->pg->gpus, .owner = r->pg->owner,
		.page_kind = kind ? RW_KIND_COMBINE : RW_KIND_DISPATCH };
}

/* The pack's and the forward's argument blocks for a dispatch whose blocks are at `w` (eager:
 * where_of; static mode: its shadow): the plan's entries and tags and the forward list in its
 * slot (read by the kernels after the waits, from `w`'s copy), the group's slabs (entry offsets from
 * each slab's start; the dispatch receive and local areas at the offsets the daemon lent them
 * with), its status line, error word and row counts. */
void rw_rank_dispatch_blocks(const rw_client_rank_t *r, const rw_rank_where_t *w,
			     const rw_client_rank_dispatch_t *d, rw_cuda_rank_pack_t *pk,
			     rw_cuda_rank_forward_t *fw)
{
	const rw_cuda_dptr_t slot = w->slot, status = w->status, line = w->line;
	const rw_page_head_t *pg = r->pg;
	*pk = (rw_cuda_rank_pack_t){
		.x = d->tokens, .ids = d->topk_ids, .weights = d->topk_weights,
		.entry = slot + r->layout.plan_entry, .tags = slot + r->layout.plan_tag,
		.scratch = w->scratch, .status = status,
		.err = line + offsetof(rw_rank_line_t, err), .n_tokens = d->token_count,
		.topk = d->topk, .hidden = d->hidden, .dtype = cuda_dtype(d->dtype),
		.n_experts = d->n_experts, .nodes = pg->nodes, .rails = pg->rails, .me = pg->node,
		.owner = pg->owner };
	*fw = (rw_cuda_rank_forward_t){
		.list = slot + r->layout.list_entry,
		.list_n = slot + r->layout.list + offsetof(rw_page_list_head_t, count),
		.rows = d->recv_x, .meta = d->recv_meta, .counts = d->recv_counts,
		.recv_n = line + offsetof(rw_rank_line_t, recv_n),
		.overflow = line + offsetof(rw_rank_line_t, overflow), .status = status,
		.err = line + offsetof(rw_rank_line_t, err), .cap = d->recv_cap, .topk = d->topk,
		.hidden = d->hidden, .dtype = cuda_dtype(d->dtype), .n_experts = d->n_experts,
		.nodes = pg->nodes, .gpus = pg->gpus, .rails = pg->rails, .me = pg->node,
		.g = pg->owner };
	for (uint32_t e = 0; e < r->n_slabs; e++) {
		const rw_rank_slab_t *sl = &r->slab[e];
		pk->slab[e] = sl->dptr;
		fw->area[RW_CUDA_AREA_RECV][e] = sl->dptr + sl->lent.recv_off[0];
		fw->area[RW_CUDA_AREA_LOCAL][e] = sl->dptr + sl->lent.local_off;
	}
}

/* What every phase checks before it takes slot k: the rank path usable, the daemon there. */
int rw_rank_phase_open(rw_client_rank_t *r, const char *what, uint64_t k)
{
	if (r->broken)
		return say(r->msg, r->broken, "%s: the rank path is broken (an enqueue failed after a "
			   "submit)", what);
	/* Only a lost daemon's owed words (rw_page_daemon_lost) put plan this far past every
	 * phase submitted. */
	if ((int64_t)(word_load(r, RW_PW_PLAN) - (k - 1)) >= (int64_t)(RW_PAGE_OWED_AHEAD / 2))
		return say(r->msg, RW_E_CLOSED, "%s: the daemon is gone", what);
	return 0;
}

/* Slot k's parameters, its count row and line cleared, ordered before the enqueue (P1). */
static void slot_write(rw_client_rank_t *r, uint64_t k, const rw_page_params_t *p)
{
	uint8_t *slot = (uint8_t *)r->pg + slot_off(r, k);
	*(rw_page_params_t *)(slot + r->layout.params) = *p;
	memset(slot + r->layout.count_row, 0, (size_t)r->pg->nodes * r->pg->rails * sizeof(uint32_t));
	memset(&r->lines[k % D], 0, sizeof(r->lines[0]));
	atomic_thread_fence(memory_order_release); /* P1: the slot before the enqueue */
}

typedef rw_status_t (*launch_fn)(const rw_cuda_ext_stream_t *s, const void *block);
static rw_status_t pack_fn(const rw_cuda_ext_stream_t *s, const void *b)
{
	return rw_cuda_rank_pack(s, b);
}
static rw_status_t forward_fn(const rw_cuda_ext_stream_t *s, const void *b)
{
	return rw_cuda_rank_forward(s, b);
}
static rw_status_t gather_fn(const rw_cuda_ext_stream_t *s, const void *b)
{
	return rw_cuda_rank_gather(s, b);
}
static rw_status_t reduce_fn(const rw_cuda_ext_stream_t *s, const void *b)
{
	return rw_cuda_rank_reduce(s, b);
}

/* After what the stream does before submit (its status `pre`): submit = k, then the daemon plans
 * (P2); `snap` (NULL: an abort, no kernels) copies the slot's status and plan into its mirror,
 * kernel `a` writes this rank's records where the plan puts them, then packed (P3); the
 * daemon posts, the peers' records arrive, it lists this rank's (P4); `snap` copies the list,
 * kernel `b` reads them out; done (P5): the slot and the receive areas are free. */
static int phase_enqueue(rw_client_rank_t *r, const rw_cuda_ext_stream_t *es, uint64_t k,
			 rw_status_t pre, const char *what, rw_cuda_rank_ctl_t *snap, launch_fn a,
			 const void *ab, launch_fn b, const void *bb)
{
	rw_status_t st = pre;
	if (st == RW_OK)
		st = rw_cuda_word_write(es, word_dev(r, RW_PW_SUBMIT), k);
	if (st != RW_OK)
		return say(r->msg, RW_E_CUDA, "%s: enqueueing its first work or submit failed (%s)",
			   what, rw_status_str(st));
	r->next = k + 1; /* submitted: k is spent whatever follows */
	st = rw_cuda_word_wait(es, word_dev(r, RW_PW_PLAN), k);
	if (st == RW_OK && snap) {
		snap->word = RW_PW_PLAN;
		st = rw_cuda_rank_ctl(es, snap);
	}
	if (st == RW_OK)
		st = a(es, ab);
	if (st == RW_OK)
		st = rw_cuda_word_write(es, word_dev(r, RW_PW_PACKED), k);
	if (st == RW_OK)
		st = rw_cuda_word_wait(es, word_dev(r, RW_PW_ARRIVED), k);
	if (st == RW_OK && snap) {
		snap->word = RW_PW_ARRIVED;
		st = rw_cuda_rank_ctl(es, snap);
	}
	if (st == RW_OK)
		st = b(es, bb);
	if (st == RW_OK)
		st = rw_cuda_word_write(es, word_dev(r, RW_PW_DONE), k);
	if (st != RW_OK) {
		r->broken = RW_E_CUDA;
		return say(r->msg, RW_E_CUDA, "%s: phase %llu was submitted but enqueueing its "
			   "kernels or words failed (%s): the rank path is broken", what,
			   (unsigned long long)k, rw_status_str(st));
	}
	return 0;
}

int rw_client_rank_dispatch(rw_client_rank_t *r, const rw_client_stream_t *s,
			    const rw_client_rank_dispatch_t *d, uint64_t *phase_p)
{
	if (!r)
		return RW_E_INVAL;
	const rw_client_stream_t host_stream = { .device = RW_RANK_HOST };
	if (!s && r->host)
		s = &host_stream;
	if (!s || !d || !phase_p)
		return say(r->msg, RW_E_INVAL, "dispatch: NULL argument");
	if (r->st)
		return say(r->msg, RW_E_STATE, "dispatch: the rank path was opened in static mode "
			   "(rw_client_rank_dispatch_static)");
	const uint64_t k = r->next;
	int rc = rw_rank_phase_open(r, "dispatch", k);
	if (rc == 0)
		rc = rw_rank_check_dispatch(r, s, d);
	if (rc == 0)
		rc = take_slot(r, k);
	if (rc)
		return rc;
	const rw_page_params_t p = { .kind = RW_KIND_DISPATCH, .dtype = d->dtype, .topk = d->topk,
				     .layer = d->layer, .hidden = d->hidden,
				     .n_experts = d->n_experts, .token_count = d->token_count,
				     .path = d->path, .phase = k, .step = d->step };
	slot_write(r, k, &p);
	rw_cuda_rank_pack_t pk;
	rw_cuda_rank_forward_t fw;
	const rw_rank_where_t w = where_of(r, k);
	rw_rank_dispatch_blocks(r, &w, d, &pk, &fw);
	if (r->host) {
		*phase_p = k;
		return rw_rank_host_dispatch(r, k, d, &pk, &fw);
	}
	const rw_cuda_ext_stream_t es = rw_rank_stream(r, s);
	const rw_cuda_dptr_t slot_dev = r->dptr + slot_off(r, k);
	rw_status_t st = rw_cuda_route_count_ext(&es, d->topk_ids, d->token_count, d->topk,
						 d->n_experts, r->pg->nodes, r->pg->rails,
						 r->pg->rail, slot_dev + r->layout.count_row,
						 slot_dev + r->layout.params +
							 offsetof(rw_page_params_t, bad));
	rw_cuda_rank_ctl_t snap = rw_rank_ctl_block(r, RW_CUDA_RANK_OP_SNAP, 0, r->mirror[k % D]);
	snap.slot_k = (uint32_t)(k % D);
	rc = phase_enqueue(r, &es, k, st, "dispatch", &snap, pack_fn, &pk, forward_fn, &fw);
	if (rc == 0)
		*phase_p = k;
	return rc;
}

/* A staging table entry names one of this rank's slabs and a room of its rows inside it, at
 * least `rows` rows. */
static int stage_fits(const rw_client_rank_t *r, const rw_page_stage_t *e, uint64_t row_bytes,
		      uint32_t rows)
{
	const uint64_t room = (uint64_t)e->rows * row_bytes;
	return e->rail < r->n_slabs && rows <= e->rows && e->off <= r->slab[e->rail].lent.bytes &&
	       room <= r->slab[e->rail].lent.bytes - e->off;
}

/* The gather's and reduce's blocks for a combine whose blocks are at `w`, of the dispatch whose
 * slot (its forward list, intact until the slot is reused) is at `dslot`: the combine's plan
 * entries, tags and terms, the local ranks' staged rows (where the dispatch's plan said: its
 * staging table `tab` read on this CPU, or with tab NULL the table at `stage` read by the gather
 * on the GPU; a rank whose entry names no slab of this rank, or a room past it, has none: a
 * term naming it fails the gather, E_REF);
 * the reduce reads the combine's receive and local areas from its plan block's rails in `w`'s
 * copy (decided after this call). */
void rw_rank_combine_blocks(const rw_client_rank_t *r, const rw_rank_where_t *w,
			    rw_cuda_dptr_t dslot, const rw_page_params_t *dp,
			    const rw_page_stage_t *tab, rw_cuda_dptr_t stage,
			    const rw_client_rank_combine_t *c, rw_cuda_rank_gather_t *ga,
			    rw_cuda_rank_reduce_t *re)
{
	const rw_page_head_t *pg = r->pg;
	const rw_cuda_dptr_t slot = w->slot, status = w->status, line = w->line;
	*ga = (rw_cuda_rank_gather_t){
		.list = dslot + r->layout.list_entry,
		.list_n = dslot + r->layout.list + offsetof(rw_page_list_head_t, count),
		.entry = slot + r->layout.plan_entry, .tags = slot + r->layout.plan_tag,
		.term_off = slot + r->layout.term_off, .terms = slot + r->layout.term_ref,
		.status = status, .err = line + offsetof(rw_rank_line_t, err), .cap = pg->max_recv,
		.n_terms = pg->gpus * pg->max_recv, .hidden = dp->hidden,
		.dtype = cuda_dtype(dp->dtype), .nodes = pg->nodes, .rails = pg->rails,
		.me = pg->node, .g = pg->owner };
	*re = (rw_cuda_rank_reduce_t){
		.list = slot + r->layout.list_entry,
		.list_n = slot + r->layout.list + offsetof(rw_page_list_head_t, count),
		.out = c->out, .status = status, .err = line + offsetof(rw_rank_line_t, err),
		.plan_rail = slot + r->layout.plan_rail, .cap = pg->max_recv,
		.n_tokens = dp->token_count, .hidden = dp->hidden, .dtype = cuda_dtype(dp->dtype),
		.rails = pg->rails };
	if (tab) {
		const uint64_t row_bytes = (uint64_t)dp->hidden * (dp->dtype == RW_DTYPE_BF16 ? 2 : 4);
		for (uint32_t g = 0; g < pg->gpus && g < RW_CUDA_RANK_GPUS; g++)
			ga->rows[g] = stage_fits(r, &tab[g], row_bytes, 0) ?
				      r->slab[tab[g].rail].dptr + tab[g].off : 0;
	} else {
		ga->stage = stage;
		ga->stage_gpus = pg->gpus;
	}
	for (uint32_t e = 0; e < r->n_slabs; e++)
		ga->slab[e] = re->slab[e] = r->slab[e].dptr;
}

/* What a combine and an abort of dispatch kd check first: the arguments, eager mode, the daemon
 * there, the stream's device, and kd a dispatch of this rank that completed with 0
 * (rw_client_rank_wait), not combined yet, within D - 1 phases. *s_p: the stream (a host rank's
 * when NULL); *kept_p, *dp_p: kd's answer and parameters. 0, or the error (r->msg says). */
static int combine_due(rw_client_rank_t *r, const rw_client_stream_t **s_p, uint64_t kd,
		       const void *args, const uint64_t *phase_p, const char *what,
		       rw_rank_result_t **kept_p, const rw_page_params_t **dp_p)
{
	static const rw_client_stream_t host_stream = { .device = RW_RANK_HOST };
	const rw_client_stream_t *s = *s_p;
	if (!s && r->host)
		s = *s_p = &host_stream;
	if (!s || !args || !phase_p)
		return say(r->msg, RW_E_INVAL, "%s: NULL argument", what);
	if (r->st)
		return say(r->msg, RW_E_STATE, "%s: the rank path was opened in static mode "
			   "(rw_client_rank_combine_static)", what);
	const uint64_t k = r->next;
	int rc = rw_rank_phase_open(r, what, k);
	if (rc)
		return rc;
	if (s->reserved || s->device != r->device)
		return say(r->msg, RW_E_INVAL, "%s: a reserved field is not 0, or the stream is "
			   "not on the rank path's device %d", what, r->device);
	rw_rank_result_t *kept = *kept_p = &r->kept[kd % RW_RANK_KEPT];
	const rw_page_params_t *dp = *dp_p = slot_params(r, kd);
	if (kd == 0 || kd >= k || k - kd >= D || kept->phase != kd || kept->error ||
	    kept->combined || dp->kind != RW_KIND_DISPATCH || dp->phase != kd)
		return say(r->msg, RW_E_STATE, "%s: phase %llu is not a dispatch of this rank "
			   "that completed with 0 (rw_client_rank_wait), not combined yet, within %u "
			   "phases", what, (unsigned long long)kd, D - 1);
	return 0;
}

/* The combine phase k of dispatch dp, as the daemon sees it (abort: its reason, else 0). */
static rw_page_params_t combine_params(const rw_page_params_t *dp, uint64_t k, uint32_t rows,
				       uint16_t abort)
{
	return (rw_page_params_t){ .kind = RW_KIND_COMBINE, .dtype = dp->dtype, .topk = dp->topk,
				   .layer = dp->layer, .hidden = dp->hidden,
				   .n_experts = dp->n_experts, .token_count = rows,
				   .path = dp->path, .abort = abort, .phase = k, .step = dp->step };
}

int rw_client_rank_combine(rw_client_rank_t *r, const rw_client_stream_t *s,
			   const rw_client_rank_combine_t *c, uint64_t *phase_p)
{
	if (!r)
		return RW_E_INVAL;
	rw_rank_result_t *kept;
	const rw_page_params_t *dp;
	int rc = combine_due(r, &s, c ? c->dispatch : 0, c, phase_p, "combine", &kept, &dp);
	if (rc)
		return rc;
	const uint64_t k = r->next, kd = c->dispatch;
	const uint8_t *dplan = (const uint8_t *)r->pg + slot_off(r, kd);
	const rw_page_plan_head_t dh = *(const rw_page_plan_head_t *)(dplan + r->layout.plan);
	rw_page_stage_t tab[RW_PAGE_MAX_GPUS]; /* read once: the daemon's, as the plan said it */
	memcpy(tab, dplan + r->layout.plan_stage, r->pg->gpus * sizeof(tab[0]));
	const uint64_t row_bytes = (uint64_t)dp->hidden * (dp->dtype == RW_DTYPE_BF16 ? 2 : 4);
	const uint64_t staged = kept->recv_n * row_bytes;
	const rw_page_stage_t *own = &tab[r->pg->owner];
	if (r->n_slabs < r->pg->rails || dh.phase != kd || dh.n_stage != r->pg->gpus ||
	    own->rail != r->pg->rail || !stage_fits(r, own, row_bytes, kept->recv_n))
		return say(r->msg, RW_E_BADREPLY, "combine: dispatch %llu's plan names no staging "
			   "area that holds this rank's %u rows in its rail's slab",
			   (unsigned long long)kd, kept->recv_n);
	if ((kept->recv_n && (c->rows == 0 || c->rows % 16)) ||
	    (dp->token_count && (c->out == 0 || c->out % 16)))
		return say(r->msg, RW_E_INVAL, "combine: rows or out is not a 16-byte aligned device "
			   "address");
	rc = take_slot(r, k);
	if (rc)
		return rc;
	const rw_page_params_t p = combine_params(dp, k, kept->recv_n, 0);
	rw_cuda_rank_gather_t ga;
	rw_cuda_rank_reduce_t re;
	const rw_rank_where_t w = where_of(r, k);
	rw_rank_combine_blocks(r, &w, slot_read(r, kd), dp, tab, 0, c, &ga, &re);
	slot_write(r, k, &p);
	if (r->host) {
		kept->combined = 1;
		*phase_p = k;
		return rw_rank_host_combine(r, k, c->rows, staged, &ga, &re);
	}
	const rw_cuda_ext_stream_t es = rw_rank_stream(r, s);
	rw_status_t st = RW_OK; /* this rank's rows into its staging area, before submit (P1) */
	if (staged)
		st = rw_cuda_copy_ext(&es, ga.rows[r->pg->owner], c->rows, staged);
	rw_cuda_rank_ctl_t snap = rw_rank_ctl_block(r, RW_CUDA_RANK_OP_SNAP, 1, r->mirror[k % D]);
	snap.slot_k = (uint32_t)(k % D);
	snap.ref = r->mirror[kd % D]; /* the dispatch's list count, for the terms */
	rc = phase_enqueue(r, &es, k, st, "combine", &snap, gather_fn, &ga, reduce_fn, &re);
	if (rc == 0) {
		kept->combined = 1;
		*phase_p = k;
	}
	return rc;
}

/* An abort runs no kernel between its words: the daemon fails it, whatever it holds. */
static rw_status_t no_kernel(const rw_cuda_ext_stream_t *s, const void *b)
{
	(void)s;
	(void)b;
	return RW_OK;
}

int rw_rank_abort_eager(rw_client_rank_t *r, const rw_client_stream_t *s, uint64_t kd,
			uint32_t reason, uint64_t *phase_p)
{
	rw_rank_result_t *kept;
	const rw_page_params_t *dp;
	int rc = combine_due(r, &s, kd, &kd, phase_p, "abort", &kept, &dp);
	if (rc == 0)
		rc = take_slot(r, r->next);
	if (rc)
		return rc;
	const uint64_t k = r->next;
	const rw_page_params_t p = combine_params(dp, k, kept->recv_n, (uint16_t)reason);
	slot_write(r, k, &p);
	kept->combined = 1;
	*phase_p = k;
	if (r->host) { /* its gather and reduce find the phase failed and touch nothing */
		rw_cuda_rank_gather_t ga;
		rw_cuda_rank_reduce_t re;
		const rw_client_rank_combine_t none = { .dispatch = kd };
		const rw_rank_where_t w = where_of(r, k);
		rw_rank_combine_blocks(r, &w, slot_read(r, kd), dp, NULL, 0, &none, &ga, &re);
		return rw_rank_host_combine(r, k, 0, 0, &ga, &re);
	}
	const rw_cuda_ext_stream_t es = rw_rank_stream(r, s);
	rc = phase_enqueue(r, &es, k, RW_OK, "abort", NULL, no_kernel, NULL, no_kernel, NULL);
	if (rc)
		kept->combined = 0;
	return rc;
}

static int64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int rw_client_rank_wait(rw_client_rank_t *r, uint64_t k, int timeout_ms,
			rw_client_rank_done_t *done_p)
{
	if (!r)
		return RW_E_INVAL;
	if (r->st)
		return say(r->msg, RW_E_STATE, "wait: the rank path is in static mode: the stream "
			   "takes the phase numbers (rw_client_rank_check)");
	const uint64_t last = r->next - 1;
	if (k == 0 || k > last)
		return say(r->msg, RW_E_INVAL, "wait: phase %llu was not dispatched (last %llu)",
			   (unsigned long long)k, (unsigned long long)last);
	rw_rank_result_t *kept = &r->kept[k % RW_RANK_KEPT];
	if (kept->phase == k)
		return answer(r, kept, done_p);
	if (k + D <= last)
		return say(r->msg, RW_E_INVAL, "wait: phase %llu is too old to answer for",
			   (unsigned long long)k);
	if (r->host && rw_rank_host_drive(r, k, timeout_ms) == RW_E_TIMEOUT)
		return say(r->msg, RW_E_TIMEOUT, "wait: phase %llu is not done",
			   (unsigned long long)k);
	int64_t deadline = timeout_ms > 0 ? now_us() + (int64_t)timeout_ms * 1000 : 0;
	for (unsigned spins = 0;; spins++) {
		if (reached(word_load(r, RW_PW_DONE), k)) {
			/* The first answer stands: a lost daemon later rewrites every status line. */
			*kept = result_of(r, k);
			return answer(r, kept, done_p);
		}
		if (timeout_ms == 0 || (timeout_ms > 0 && (spins & 63) == 0 && now_us() >= deadline))
			return say(r->msg, RW_E_TIMEOUT, "wait: phase %llu is not done",
				   (unsigned long long)k);
		if (spins >= 1024)
			sched_yield();
	}
}
