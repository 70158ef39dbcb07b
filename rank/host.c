/* rank/host.c: the rank path for a rank whose buffers are host memory (rw_client_rank_open with
 * device RW_RANK_HOST): no CUDA. The rank's own calls play its stream: dispatch and combine do
 * what the stream would do before submit (the count row, the staged rows) and store submit;
 * rw_client_rank_wait then drives the phases in order — wait for plan, pack (or gather) with
 * this process's threads straight into the group's slabs, packed, wait for arrived, forward (or
 * reduce) into the caller's buffers, done (docs/rankpath.md "Host ranks"). The daemon only posts
 * and tracks: it touches no payload byte of this rank's phase.
 *
 * Ordering pairs (docs/rankpath.md "The acquire/release pairs"), the stream's part played by
 * this CPU: P1 the slot, the count row and staged rows, then store-release submit = k; P2 the
 * daemon's store-release plan, load-acquired here before the plan block and status are read;
 * P3 the records, then store-release packed = k; P4 load-acquire arrived, then the list and the
 * slabs are read; P5 the last read of phase k, then store-release done = k. */
#include "rank/rank.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define D RW_PAGE_DEPTH

/* How long a wait spins before it sleeps (the ring's rw_client_wait default, on a host with
 * SPIN_MIN_CPUS online CPUs; none on a smaller one), and the longest sleep: the daemon's store of
 * the word ends a sleep (rw_page_word_publish), so SLEEP_MAX_NS bounds only what nothing wakes (a
 * failed phase's owed words, a daemon gone): at most 5000 wake-ups a second, each a few µs. */
#define SPIN_US_DEFAULT 200
#define SPIN_US_MAX 10000
#define SPIN_MIN_CPUS 8
#define SLEEP_MAX_NS 200000
/* Below this many row bytes a thread costs more than it saves: its start and join are some tens
 * of microseconds, in which one core copies ~256 KiB. */
#define PAR_MIN_BYTES (256u * 1024u)

typedef struct host_phase {
	uint8_t kind;                  /* RW_KIND_DISPATCH or RW_KIND_COMBINE */
	union {
		struct {
			rw_cuda_rank_pack_t pk;
			rw_cuda_rank_forward_t fw;
		} d;
		struct {
			rw_cuda_rank_gather_t ga;
			rw_cuda_rank_reduce_t re;
		} c;
	} u;
} host_phase_t;

struct rw_rank_host {
	uint32_t threads;              /* RAILWAVE_RANK_THREADS */
	uint32_t spin_ns;              /* RAILWAVE_RANK_SPIN_US */
	uint64_t driven;               /* the last phase whose done this CPU wrote */
	int stage;                     /* of phase driven + 1: 0 waits for plan, 1 for arrived */
	host_phase_t ph[D];            /* phase k's blocks at k mod D */
	void *scratch[D];              /* each slot's pack numbering */
	uint32_t *next;                /* [nodes]: the numbering's records to each node so far */
	uint32_t nodes;                /* the page's nodes at open: next's size */
};

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* An unsigned setting from the environment, `dflt` when unset or not a number up to `max`. */
static unsigned long setting(const char *name, unsigned long dflt, unsigned long max)
{
	const char *v = getenv(name);
	char *end;
	if (!v || !*v)
		return dflt;
	unsigned long x = strtoul(v, &end, 10);
	return *end || x > max ? dflt : x;
}

int rw_rank_host_open(rw_client_rank_t *r)
{
	struct rw_rank_host *h = calloc(1, sizeof(*h));
	if (!h)
		return RW_E_NOMEM;
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	if (cpus < 1)
		cpus = 1;
	/* Default: the node's CPUs shared by its local ranks (each runs its copies at once). */
	unsigned long per_rank = (unsigned long)cpus / (r->pg->gpus ? r->pg->gpus : 1);
	h->threads = (uint32_t)setting("RAILWAVE_RANK_THREADS", per_rank ? per_rank : 1,
				       RW_CUDA_CPU_THREADS_MAX);
	if (h->threads == 0)
		h->threads = 1;
	h->spin_ns = 1000u * (uint32_t)setting("RAILWAVE_RANK_SPIN_US",
					      cpus >= SPIN_MIN_CPUS ? SPIN_US_DEFAULT : 0,
					      SPIN_US_MAX);
	const size_t scratch = rw_cuda_rank_pack_scratch(r->pg->max_tokens ? r->pg->max_tokens : 1, 32);
	for (unsigned i = 0; i < D; i++)
		if (!(h->scratch[i] = malloc(scratch)))
			goto fail;
	h->nodes = r->pg->nodes;
	if (!(h->next = calloc(h->nodes ? h->nodes : 1, sizeof(*h->next))))
		goto fail;
	if (!(r->lines = calloc(D, sizeof(rw_rank_line_t))))
		goto fail;
	r->host = h;
	return 0;
fail:
	for (unsigned i = 0; i < D; i++)
		free(h->scratch[i]);
	free(h->next);
	free(h);
	snprintf(r->msg, RW_RANK_MSG_MAX, "rank path: out of memory for the pack's numbering "
		 "(%zu bytes a slot)", scratch);
	return RW_E_NOMEM;
}

void rw_rank_host_close(rw_client_rank_t *r)
{
	if (!r->host)
		return;
	for (unsigned i = 0; i < D; i++)
		free(r->host->scratch[i]);
	free(r->host->next);
	free(r->host);
	free(r->lines);
	r->host = NULL;
	r->lines = NULL;
}

uint32_t rw_rank_host_threads(const rw_client_rank_t *r)
{
	return r->host ? r->host->threads : 0;
}

/* The rank's words: stored, then the daemon's poller woken if it sleeps on them (a futex wake
 * per store, a few hundred ns; ipc/page.h "Waking the other side"). */
static void word_store(rw_client_rank_t *r, unsigned w, uint64_t k)
{
	rw_page_word_publish(&r->pg->word[w].v, k);
}

/* Until the daemon's word w reaches k (cyclic >=): spin, then sleep on the word itself, each
 * sleep at most SLEEP_MAX_NS and ended by the daemon's store of the word. deadline: an absolute
 * CLOCK_MONOTONIC time in ns, 0 look once, -1 forever. 1 reached, 0 not by the deadline. */
static int wait_word(rw_client_rank_t *r, unsigned w, uint64_t k, int64_t deadline)
{
	const _Atomic uint64_t *word = &r->pg->word[w].v;
	uint64_t v = atomic_load_explicit(word, memory_order_acquire);
	if ((int64_t)(v - k) >= 0)
		return 1;
	if (deadline == 0)
		return 0;
	const int64_t start = now_ns();
	while (now_ns() - start < (int64_t)r->host->spin_ns) {
		v = atomic_load_explicit(word, memory_order_acquire);
		if ((int64_t)(v - k) >= 0)
			return 1;
	}
	for (;;) {
		long nap = SLEEP_MAX_NS;
		if (deadline > 0) {
			const int64_t left = deadline - now_ns();
			if (left <= 0)
				return 0;
			if (left < nap)
				nap = (long)left;
		}
		(void)rw_page_word_nap(word, v, nap);
		v = atomic_load_explicit(word, memory_order_acquire);
		if ((int64_t)(v - k) >= 0)
			return 1;
	}
}

int rw_rank_host_dispatch(rw_client_rank_t *r, uint64_t k, const rw_client_rank_dispatch_t *d,
			  const rw_cuda_rank_pack_t *pk, const rw_cuda_rank_forward_t *fw)
{
	struct rw_rank_host *h = r->host;
	host_phase_t *ph = &h->ph[k % D];
	uint8_t *slot = rw_page_slot_at(r->pg, &r->layout, k);
	rw_page_params_t *p = (rw_page_params_t *)(slot + r->layout.params);
	const uint32_t nodes = r->pg->nodes;
	if (nodes != h->nodes || pk->nodes != h->nodes) { /* the page's head rewritten since open */
		snprintf(r->msg, RW_RANK_MSG_MAX, "dispatch: the rank page says %u nodes; it was "
			 "opened for %u", nodes, h->nodes);
		return RW_E_INVAL;
	}
	/* The count kernel's work: the slot's row and bad word were zeroed by the caller. */
	rw_cuda_cpu_count((const int32_t *)(uintptr_t)d->topk_ids, d->token_count, d->topk,
			   d->n_experts, nodes, r->pg->rails, r->pg->rail,
			   (uint32_t *)(slot + r->layout.count_row), &p->bad);
	ph->kind = RW_KIND_DISPATCH;
	ph->u.d.pk = *pk;
	ph->u.d.fw = *fw;
	ph->u.d.pk.scratch = (uint64_t)(uintptr_t)h->scratch[k % D];
	ph->u.d.pk.rec_size = ph->u.d.fw.rec_size = rw_cuda_cpu_rec_size(d->topk, d->hidden,
									  pk->dtype);
	word_store(r, RW_PW_SUBMIT, k); /* P1 */
	r->next = k + 1;
	return 0;
}

int rw_rank_host_combine(rw_client_rank_t *r, uint64_t k, uint64_t rows, uint64_t staged,
			 const rw_cuda_rank_gather_t *ga, const rw_cuda_rank_reduce_t *re)
{
	host_phase_t *ph = &r->host->ph[k % D];
	ph->kind = RW_KIND_COMBINE;
	ph->u.c.ga = *ga;
	ph->u.c.re = *re;
	ph->u.c.ga.crec_size = ph->u.c.re.crec_size = rw_cuda_cpu_crec_size(ga->hidden, ga->dtype);
	if (staged) /* this rank's rows into its staging area, before submit (P1) */
		memcpy((void *)(uintptr_t)ga->rows[r->pg->owner], (const void *)(uintptr_t)rows,
		       staged);
	word_store(r, RW_PW_SUBMIT, k); /* P1 */
	r->next = k + 1;
	return 0;
}

int rw_rank_host_drive(rw_client_rank_t *r, uint64_t target, int timeout_ms)
{
	struct rw_rank_host *h = r->host;
	const int64_t deadline = timeout_ms < 0 ? -1 : timeout_ms == 0 ? 0 :
				 now_ns() + (int64_t)timeout_ms * 1000000;
	while ((int64_t)(target - h->driven) > 0 && h->driven + 1 < r->next) {
		const uint64_t k = h->driven + 1;
		host_phase_t *ph = &h->ph[k % D];
		const rw_cuda_cpu_par_t par = { .threads = h->threads, .min_bytes = PAR_MIN_BYTES };
		if (h->stage == 0) {
			if (!wait_word(r, RW_PW_PLAN, k, deadline))
				return RW_E_TIMEOUT;
			if (ph->kind == RW_KIND_DISPATCH) { /* P2 read: the plan's entries and tags */
				rw_cuda_cpu_pack_index(&ph->u.d.pk, h->next);
				rw_cuda_cpu_pack_rows(&ph->u.d.pk, par);
			} else {
				rw_cuda_cpu_gather(&ph->u.c.ga, par);
			}
			word_store(r, RW_PW_PACKED, k); /* P3 */
			h->stage = 1;
		}
		if (!wait_word(r, RW_PW_ARRIVED, k, deadline))
			return RW_E_TIMEOUT;
		if (ph->kind == RW_KIND_DISPATCH) /* P4 read: the list, the slabs */
			rw_cuda_cpu_forward(&ph->u.d.fw, par);
		else
			rw_cuda_cpu_reduce(&ph->u.c.re, par);
		word_store(r, RW_PW_DONE, k); /* P5 */
		/* Before the status read that follows (rw_client_rank_wait): the daemon stores a
		 * failure's status and then reads done (exec.c, page_rows_taken), so one of the two
		 * sees the other's store. The futex wake's syscall orders it too, but not by contract. */
		atomic_thread_fence(memory_order_seq_cst);
		h->driven = k;
		h->stage = 0;
	}
	return 0;
}
