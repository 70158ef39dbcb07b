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

static int say(char *buf, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int say(char *buf, int code, const char *fmt, ...)
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

int rw_client_rank_open(rw_client_t *client, int32_t device, uint32_t max_recv,
			rw_client_rank_t **rank_p)
{
	open_msg[0] = '\0';
	if (!client || !rank_p)
		return say(open_msg, RW_E_INVAL, "rank path: no client");
	if (rw_cuda_init() != RW_OK)
		return say(open_msg, RW_E_NO_CUDA, "rank path: %s", rw_cuda_unavailable_reason());
	if (device < 0 || device >= rw_cuda_device_count())
		return say(open_msg, RW_E_INVAL, "rank path: no CUDA device %d here (%d visible)",
			   device, rw_cuda_device_count());
	if (!rw_cuda_words_supported(device))
		return say(open_msg, RW_E_NO_CUDA, "rank path: device %d runs no 64-bit stream "
			   "memory operations (cuStreamWriteValue64 / cuStreamWaitValue64)", device);
	if (!rw_cuda_kernels_available(device))
		return say(open_msg, RW_E_NO_CUDA, "rank path: the kernels do not load on device %d "
			   "(built without nvcc, or no sm_90 code or PTX the driver takes)", device);
	rw_client_rank_t *r = calloc(1, sizeof(*r));
	if (!r)
		return say(open_msg, RW_E_NOMEM, "rank path: out of memory");
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
	    r->layout.slot_bytes != r->pg->slot_bytes || r->pg->rail >= r->pg->rails) {
		rc = say(open_msg, RW_E_BADREPLY, "rank path: the daemon's page does not have the "
			 "layout its head describes");
		goto fail_free; /* the client unmaps the page at close */
	}
	if (rw_cuda_host_register_mapped(page, r->bytes, &r->dptr) != RW_OK) {
		rc = say(open_msg, RW_E_CUDA, "rank path: cuMemHostRegister of the rank page (%zu "
			 "bytes) failed", r->bytes);
		goto fail_free;
	}
	if ((rc = rw_rank_slabs_open(r)) != 0) { /* the group's slabs (rank/slabs.c) */
		snprintf(open_msg, sizeof(open_msg), "%s", r->msg);
		rw_cuda_host_unregister(page);
		goto fail_free;
	}
	*rank_p = r;
	return 0;
fail_free:
	free(r);
	return rc;
}

void rw_client_rank_close(rw_client_rank_t *r)
{
	if (!r)
		return;
	rw_rank_slabs_close(r);
	rw_cuda_host_unregister(r->pg);
	free(r);
}

const char *rw_client_rank_message(const rw_client_rank_t *r)
{
	return r ? r->msg : open_msg;
}

/* How phase k ended, once done >= k: the count kernel's bad word first (this rank's own input),
 * then the status line the daemon (or this CPU, when the daemon was lost) wrote for it. */
static rw_rank_result_t result_of(const rw_client_rank_t *r, uint64_t k)
{
	rw_rank_result_t res = { .phase = k };
	res.bad = slot_params(r, k)->bad;
	res.error = (int32_t)(uint32_t)atomic_load_explicit(&r->pg->status[k % D].v,
							    memory_order_relaxed);
	if (res.bad)
		res.error = RW_E_TOKENS;
	return res;
}

static int answer(rw_client_rank_t *r, const rw_rank_result_t *res)
{
	if (res->bad)
		return say(r->msg, RW_E_TOKENS, "phase %llu: token %u has a top-k expert id outside "
			   "[0, n_experts) other than -1 (it counted nothing)",
			   (unsigned long long)res->phase, res->bad - 1);
	if (res->error)
		return say(r->msg, res->error, "phase %llu failed: %s", (unsigned long long)res->phase,
			   rw_client_strerror(res->error));
	return 0;
}

static int check_dispatch(rw_client_rank_t *r, const rw_client_stream_t *s,
			  const rw_client_rank_dispatch_t *d)
{
	if (s->reserved || d->reserved0 || d->reserved1)
		return say(r->msg, RW_E_INVAL, "dispatch: a reserved field is not 0");
	if (s->device != r->device)
		return say(r->msg, RW_E_INVAL, "dispatch: the stream is on device %d, the rank path "
			   "on device %d", s->device, r->device);
	if (d->dtype < RW_DTYPE_BF16 || d->dtype > RW_DTYPE_FP32)
		return say(r->msg, RW_E_DTYPE, "dispatch: unknown dtype %u", d->dtype);
	if (d->topk == 0 || d->topk > 32 || d->hidden == 0 || d->token_count > r->pg->max_tokens)
		return say(r->msg, RW_E_TOKENS, "dispatch: topk %u (1..32), hidden %u (>= 1) or "
			   "token_count %u (<= %u) out of range", d->topk, d->hidden, d->token_count,
			   r->pg->max_tokens);
	if (d->n_experts == 0 || d->n_experts % r->pg->nodes != 0)
		return say(r->msg, RW_E_EXPERTS, "dispatch: n_experts %u is not a nonzero multiple "
			   "of the %u nodes", d->n_experts, r->pg->nodes);
	if (d->path > RW_PATH_REQ_JOINT)
		return say(r->msg, RW_E_FIELD, "dispatch: unknown path request %u", d->path);
	if (d->token_count && (d->topk_ids == 0 || d->topk_ids % 4 != 0))
		return say(r->msg, RW_E_INVAL, "dispatch: topk_ids is not a 4-byte aligned device "
			   "address");
	return 0;
}

/* Is slot k mod D free (the phase before in it, k - D, is done)? Keep that phase's result. */
static int take_slot(rw_client_rank_t *r, uint64_t k)
{
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

int rw_client_rank_dispatch(rw_client_rank_t *r, const rw_client_stream_t *s,
			    const rw_client_rank_dispatch_t *d, uint64_t *phase_p)
{
	if (!r)
		return RW_E_INVAL;
	if (!s || !d || !phase_p)
		return say(r->msg, RW_E_INVAL, "dispatch: NULL argument");
	if (r->broken)
		return say(r->msg, r->broken, "dispatch: the rank path is broken (an enqueue failed "
			   "after a submit)");
	const uint64_t k = r->next;
	/* Only a lost daemon's owed words (rw_page_daemon_lost) put plan this far past every
	 * phase submitted. */
	if ((int64_t)(word_load(r, RW_PW_PLAN) - (k - 1)) >= (int64_t)(RW_PAGE_OWED_AHEAD / 2))
		return say(r->msg, RW_E_CLOSED, "dispatch: the daemon is gone");
	int rc = check_dispatch(r, s, d);
	if (rc == 0)
		rc = take_slot(r, k);
	if (rc)
		return rc;

	const uint32_t nodes = r->pg->nodes, rails = r->pg->rails;
	uint8_t *slot = (uint8_t *)r->pg + slot_off(r, k);
	const rw_cuda_dptr_t slot_dev = r->dptr + slot_off(r, k);
	rw_page_params_t *p = (rw_page_params_t *)(slot + r->layout.params);
	*p = (rw_page_params_t){ .kind = RW_KIND_DISPATCH, .dtype = d->dtype, .topk = d->topk,
				 .layer = d->layer, .hidden = d->hidden, .n_experts = d->n_experts,
				 .token_count = d->token_count, .path = d->path, .phase = k,
				 .step = d->step };
	memset(slot + r->layout.count_row, 0, (size_t)nodes * rails * sizeof(uint32_t));
	atomic_thread_fence(memory_order_release); /* P1: the slot before the enqueue */

	const rw_cuda_ext_stream_t es = { .device = s->device, .handle = s->handle };
	rw_status_t st = rw_cuda_route_count_ext(&es, d->topk_ids, d->token_count, d->topk,
						 d->n_experts, nodes, rails, r->pg->rail,
						 slot_dev + r->layout.count_row,
						 slot_dev + r->layout.params +
							 offsetof(rw_page_params_t, bad));
	if (st == RW_OK)
		st = rw_cuda_word_write(&es, word_dev(r, RW_PW_SUBMIT), k);
	if (st != RW_OK)
		return say(r->msg, RW_E_CUDA, "dispatch: enqueueing the count kernel or submit failed "
			   "(%s)", rw_status_str(st));
	r->next = k + 1; /* submitted: k is spent whatever follows */
	/* The daemon plans; the pack kernel and packed come here; it forwards; the forward
	 * kernel comes here; then this rank is done with phase k's receive slabs. */
	st = rw_cuda_word_wait(&es, word_dev(r, RW_PW_PLAN), k);
	if (st == RW_OK)
		st = rw_cuda_word_wait(&es, word_dev(r, RW_PW_ARRIVED), k);
	if (st == RW_OK)
		st = rw_cuda_word_write(&es, word_dev(r, RW_PW_DONE), k);
	if (st != RW_OK) {
		r->broken = RW_E_CUDA;
		return say(r->msg, RW_E_CUDA, "dispatch: phase %llu was submitted but enqueueing its "
			   "waits failed (%s): the rank path is broken", (unsigned long long)k,
			   rw_status_str(st));
	}
	*phase_p = k;
	return 0;
}

static int64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int rw_client_rank_wait(rw_client_rank_t *r, uint64_t k, int timeout_ms)
{
	if (!r)
		return RW_E_INVAL;
	const uint64_t last = r->next - 1;
	if (k == 0 || k > last)
		return say(r->msg, RW_E_INVAL, "wait: phase %llu was not dispatched (last %llu)",
			   (unsigned long long)k, (unsigned long long)last);
	rw_rank_result_t *kept = &r->kept[k % RW_RANK_KEPT];
	if (kept->phase == k)
		return answer(r, kept);
	if (k + D <= last)
		return say(r->msg, RW_E_INVAL, "wait: phase %llu is too old to answer for",
			   (unsigned long long)k);
	int64_t deadline = timeout_ms > 0 ? now_us() + (int64_t)timeout_ms * 1000 : 0;
	for (unsigned spins = 0;; spins++) {
		if (reached(word_load(r, RW_PW_DONE), k)) {
			/* The first answer stands: a lost daemon later rewrites every status line. */
			*kept = result_of(r, k);
			return answer(r, kept);
		}
		if (timeout_ms == 0 || (timeout_ms > 0 && (spins & 63) == 0 && now_us() >= deadline))
			return say(r->msg, RW_E_TIMEOUT, "wait: phase %llu is not done",
				   (unsigned long long)k);
		if (spins >= 1024)
			sched_yield();
	}
}
