/* One trainer rank for the multi-daemon integration tests (tests/integration/test_dataflow.py):
 * connects to its node's railwaved through librailwave, runs dispatch + combine for many layers
 * and steps, and checks every result against a reference it computes itself. The workload of
 * every rank is a pure function of (seed, step, layer, rank), so each rank knows exactly which
 * tokens of which ranks must reach it, with which data, ids and weights, and what combine must
 * return - without asking anyone.
 *
 *   rw_rank SOCKET GROUP RANK NODES GPUS EXPERTS LAYERS STEPS SEED MODE [FLAGS]
 *   MODE: ok        run everything, exit 0 iff every check passed
 *         fail      submit one dispatch, expect its pair to fail: an error completion of the dispatch, or
 *                   of its combine where the dispatch completed first (exit 0), else exit 1
 *         idle      connect, then sleep until killed (a rank that dies mid-phase)
 *         rewrite   a hostile rank (host buffers only): submit one dispatch, then rewrite its
 *                   top-k ids over and over (every id moved to the expert E/2 further, and
 *                   back) until the completion comes; print "rewrite: dispatch ok" or
 *                   "rewrite: dispatch failed: <error>: <the daemon's reason>"; after an ok
 *                   one, combine the rows that came (unchecked) as a trainer would; exit 0
 *   FLAGS (after the positional arguments; every one optional):
 *     --hidden H          elements per row (default 24)
 *     --tokens T          every rank dispatches exactly T tokens (1..8192) instead of 1..48 (x3
 *                         on local GPU 0); --empty still empties some phases
 *     --timing            print one line per phase: "timing KIND L S submit_ns done_ns rows"
 *                         (CLOCK_MONOTONIC, comparable across the ranks of one machine; rows:
 *                         rows received (dispatch) or given back (combine)), for benchmarks
 *     --submit-experts E  n_experts put in the dispatch submissions (default EXPERTS): a wrong
 *                         value must be refused (mode fail)
 *     --first-step S      number the steps S, S+1, ... (default 0): a run after a failed phase
 *                         moves on to new keys, as a trainer does
 *     --empty             some ranks route nothing in some phases and some phases route nothing
 *                         at all (0-token dispatches, 0-row combines)
 *     --retry N DIR       a phase that fails with RW_E_PHASE (a peer's failure, a rail that went
 *                         down) is retried from its dispatch, with the same key, as a trainer
 *                         would: after each (step, layer) every rank votes through files in DIR
 *                         (pass/fail), and all ranks redo it when any failed (a phase can fail
 *                         on some nodes after it completed on others); at most N failed votes
 *                         in the whole run. The last line says how many ("..., K retries")
 *     --cuda              buffers in CUDA device memory (driver loaded at run time through
 *                         cuda/rw_cuda.h, exported by IPC handle and registered with
 *                         rw_client_register_cuda); inputs are copied in and results copied back
 *                         for the same checks. Exit 77 when no CUDA driver/device is usable.
 *     --slabs R           the group's slab of each of the R rails (rw_client_group_slab), mapped
 *                         and registered with CUDA (DEVICEMAP | PORTABLE) through cuda/rw_cuda.h
 *                         as a rank's kernels would (exit 77 without a driver: the stand-in
 *                         serves); prints "slab RAIL object INODE bytes B" per rail; after each
 *                         dispatch every row this rank received from another node must lie, byte
 *                         for byte, in the dispatch receive area of one of its group's slabs (the
 *                         daemon's memory of that rail is the slab). The last line adds
 *                         "N remote rows seen in the group's slabs"
 *     --scribble          (with --slabs) a hostile rank of a job: a thread writes garbage over
 *                         the send areas of its group's slabs, over and over, from the mapping
 *                         until the rank exits (the records its node posts are then bad)
 *     --go FILE           after joining (and mapping the slabs) wait for FILE to exist before
 *                         the first dispatch (at most 60 s): a harness starts the rest of the
 *                         cluster meanwhile, e.g. a peer daemon that was not running yet
 *     --stay FILE         after the last phase, stay connected (buffers registered) until FILE
 *                         exists (at most 60 s): a harness looks at the daemon meanwhile, e.g.
 *                         while a failed phase's copies into those buffers are still queued
 *     --paths             every dispatch asks for a data path, each in turn: (step * 7 + layer)
 *                         % 5 of ipc/railwave.h's rw_path_request (the daemon's choice, native,
 *                         rail-only, permutation-only, joint), as rw_pagerank's phases do, so a
 *                         group may mix both kinds of rank over every path
 *     --stream-ordered    (with --cuda) stream order (ipc/railwave.h): one interprocess event and
 *                         one flag word (at the end of the buffer) registered; inputs are copied
 *                         in on the rank's stream WITHOUT a synchronization, the event recorded
 *                         after them, and every submission asks the daemon to wait on it and to
 *                         write the next flag value V; the stream then waits for flag >= V before
 *                         copying the outputs back (what is checked is what they held when
 *                         the flag appeared). Checks that the flag is exactly V after each
 *                         completion, errors included (mode fail). If the daemon goes away mid-phase, the owed flags
 *                         (rw_client_lost_signals) are written here, the stream must drain, and
 *                         the rank prints "daemon lost: wrote N owed flags, stream drained" and
 *                         exits 3.
 *     --rank-path         every phase through librailwave's rank path (ipc/railwave.h
 *                         rw_client_rank_*, docs/rankpath.md) instead of the ring: the count,
 *                         pack, forward, gather and reduce kernels on this rank's stream (the
 *                         driver $RW_CUDA_DRIVER names: the kernel stand-in in CI), the daemon
 *                         answering by the words of the rank page. The buffer is device memory
 *                         with a page-locked host mirror; the inputs are copied in on the rank's
 *                         stream with no synchronization (the kernels come after them in stream
 *                         order), the outputs copied back once rw_client_rank_wait said done, and
 *                         checked exactly as the ring's. A failed phase's reason is the daemon's
 *                         notice (read from the control socket). Its daemon gone mid-phase, the
 *                         stream must run through (the library writes the owed words): the rank
 *                         prints "daemon lost: the rank path's stream ran through" and exits 3.
 *                         Exit 77 where the library has no rank path (no driver, no kernels).
 *     --noisy             the expert outputs are rows of full mantissas over 24 binades (a sum of
 *                         three terms rounds differently in another order) instead of the exact
 *                         workload: each combined row is checked against the sum of its terms
 *                         within the rounding of its dtype, and the last line says how many
 *                         tokens had three or more terms and how many of them another summation
 *                         order changes
 *     --dump FILE         write every combined row, as the bytes came back, to FILE (for a
 *                         comparison bit for bit against another run of the same workload)
 *
 * The workload and its reference are tests/lib/workload.h's (the executor test runs the same):
 * rank r hosts experts [r*E/W, (r+1)*E/W); expert e's "MLP" multiplies by (e % 3 + 1).
 * With RW_RANK_STEP_DELAY_MS=N the rank waits N ms before each step after its first (a
 * harness lets another rank of the group leave between two steps).
 * Output: "rank R: S steps x L layers verified" (ok), "submitted" once its first dispatch is in
 * and then "failed as expected: <error>: <the daemon's reason>" (fail), "ready" (idle). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda/rw_cuda.h"
#include "ipc/railwave.h"
#include "tests/integration/rw_rank_diff.h"
#include "tests/lib/workload.h"

enum { TOPK = RW_WL_TOPK, MAX_FIXED = 8192 };
static uint32_t MAX_ROWS = 3 * RW_WL_MAX_TOKENS; /* rows a rank may dispatch: --tokens raises it */
static int timing;                         /* --timing */

static uint32_t nodes, gpus, world, experts, per_rank, hidden = 24;
static int empty_phases;
static uint32_t fixed_tokens; /* --tokens */
static uint32_t first_step;   /* --first-step */
static int paths;             /* --paths */
static uint32_t me;
static uint32_t retry_max, retries, attempt; /* --retry */
static const char *vote_dir;

/* Every rank says whether its (step, layer) passed, through one file per rank and attempt;
 * returns 1 when all passed, 0 when one failed, -1 when a vote never came. */
static int vote(uint32_t step, uint32_t layer, int ok, uint32_t world_size, uint32_t rank)
{
	char path[600], tmp[610];
	snprintf(path, sizeof(path), "%s/s%u_l%u_a%u_r%u", vote_dir, step, layer, attempt, rank);
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	FILE *f = fopen(tmp, "w");
	if (!f || fputc(ok ? '1' : '0', f) == EOF || fclose(f) != 0 || rename(tmp, path) != 0)
		return -1;
	int all = 1;
	for (uint32_t q = 0; q < world_size; q++) {
		snprintf(path, sizeof(path), "%s/s%u_l%u_a%u_r%u", vote_dir, step, layer, attempt, q);
		uint64_t t0 = rw_now_ns();
		while (!(f = fopen(path, "r"))) {
			if (rw_now_ns() - t0 > 60000000000ull)
				return -1;
			usleep(500);
		}
		all &= fgetc(f) == '1';
		fclose(f);
	}
	return all;
}

/* After a phase of (step, layer) failed with `cq` for the reason `why` (ok = 0) or passed every
 * check (ok = 1): 1 when the run must redo it (--retry), 0 to go on; -1 when it may not be
 * retried. */
static int redo(uint32_t step, uint32_t layer, int ok, const rw_cqe_t *cq, const char *why)
{
	if (!vote_dir)
		return ok ? 0 : -1;
	if (!ok && (cq->error != RW_E_PHASE))
		return -1;
	if (!ok)
		printf("retry step %u layer %u after: %s\n", step, layer, why);
	int v = vote(step, layer, ok, world, me);
	if (v < 0 || (v == 0 && retries >= retry_max))
		return -1;
	if (v == 1) {
		attempt = 0;
		return 0;
	}
	retries++;
	attempt++;
	return 1;
}


#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "rank %u: ", me); \
	fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); return 1; } } while (0)

/* --slabs: the group's slab of each rail, as lent by rw_client_group_slab_kind: host memory
 * mapped by the client and registered with CUDA, or GPU memory imported for device 0
 * (cuda/vmm.c), read through a copy (slab_gpu). */
static const char *go_file; /* --go */
static const char *stay_file; /* --stay */

/* Until `file` exists (at most 60 s): 0, else 1 (said). */
static int wait_file(const char *file)
{
	for (uint64_t t0 = rw_now_ns(); file && access(file, F_OK) != 0;) {
		if (rw_now_ns() - t0 > 60000000000ull) {
			fprintf(stderr, "rank %u: %s never appeared\n", me, file);
			return 1;
		}
		usleep(1000);
	}
	return 0;
}
static int scribble;        /* --scribble */
static _Atomic int scribbling;
static uint32_t slab_rails;
static rw_client_slab_t slabs[RW_CLIENT_SLAB_RAILS];
static rw_cuda_vmm_t *slab_vmm[RW_CLIENT_SLAB_RAILS]; /* GPU slabs: the import */
static uint8_t *slab_copy;                            /* GPU slabs: a receive area, copied */
static uint64_t slab_rows; /* remote rows found in a slab */

static int slabs_map(rw_client_t *c)
{
	for (uint32_t r = 0; r < slab_rails; r++) {
		rw_client_slab_gpu_t g;
		int rc = rw_client_group_slab_kind(c, r, &slabs[r], &g);
		CHECK(rc == 0, "slab of rail %u: %s (%s)", r, rw_client_strerror(rc),
		      rw_client_last_message(c));
		if (g.kind == RW_CLIENT_SLAB_GPU) {
			int dev = -1;
			const int mine = 0;
			char why[160] = "";
			CHECK(!scribble, "--scribble writes host slabs only");
			CHECK(rw_cuda_device_by_uuid(g.uuid, &dev) == RW_OK, "slab of rail %u: the "
			      "daemon's GPU %d is not visible here", r, g.device);
			rw_status_t st = rw_cuda_vmm_import(g.fd, slabs[r].bytes, dev, &mine, 1,
							    &slab_vmm[r], why, sizeof(why));
			CHECK(st == RW_OK, "slab of rail %u: import: %s", r, why);
			if (!slab_copy)
				slab_copy = malloc(slabs[r].area_bytes);
			CHECK(slab_copy, "out of memory");
			printf("slab %u gpu device %d\n", r, dev);
		} else {
			rw_cuda_dptr_t dptr = 0;
			rw_status_t st = rw_cuda_host_register_mapped(slabs[r].base, slabs[r].bytes,
								      &dptr);
			CHECK(st == RW_OK && dptr, "slab of rail %u: cuMemHostRegister: %s", r,
			      rw_status_str(st));
		}
		printf("slab %u object %llu bytes %zu\n", r, (unsigned long long)slabs[r].object,
		       slabs[r].bytes);
	}
	fflush(stdout);
	return 0;
}

static void slabs_unmap(void)
{
	for (uint32_t r = 0; r < slab_rails; r++) { /* before the close unmaps them */
		if (slab_vmm[r])
			rw_cuda_vmm_release(slab_vmm[r]);
		else
			rw_cuda_host_unregister(slabs[r].base);
		slab_vmm[r] = NULL;
	}
	free(slab_copy);
	slab_copy = NULL;
}

/* Rail r's dispatch receive area as this CPU reads it: the mapping, or a copy of GPU memory. */
static const uint8_t *slab_recv(uint32_t r)
{
	if (!slab_vmm[r])
		return (const uint8_t *)slabs[r].base + slabs[r].recv_off[0];
	const int dev = rw_cuda_vmm_device(slab_vmm[r]);
	if (rw_cuda_memcpy_dtoh(dev, slab_copy, rw_cuda_vmm_dptr(slab_vmm[r]) + slabs[r].recv_off[0],
				slabs[r].area_bytes) != RW_OK)
		memset(slab_copy, 0, slabs[r].area_bytes); /* nothing found there, said by the caller */
	return slab_copy;
}

static uint64_t row_hash(const uint8_t *p, uint32_t len)
{
	uint64_t h = 14695981039346656037ull;
	for (uint32_t i = 0; i < len; i++)
		h = (h ^ p[i]) * 1099511628211ull;
	return h;
}

/* --scribble: garbage over every send area of the slabs until told to stop. */
static void *scribbler(void *arg)
{
	(void)arg;
	for (uint8_t v = 1; atomic_load(&scribbling); v = (uint8_t)(v * 5 + 1))
		for (uint32_t r = 0; r < slab_rails; r++)
			for (int k = 0; k < 2; k++)
				memset((uint8_t *)slabs[r].base + slabs[r].send_off[k], v,
				       slabs[r].area_bytes);
	return NULL;
}

/* Which of the n rows (len bytes each) lie somewhere in a rail's dispatch receive area:
 * found[i] = 1. Records and their rows are 16-byte aligned: one pass over each area, every
 * aligned place hashed whole and looked up in a hash of the rows, compared where the hashes
 * agree (a memmem per row is quadratic on the mostly-zero areas: minutes under load). */
static void slabs_find(const uint8_t *rows, uint32_t n, uint32_t len, uint8_t *found)
{
	uint32_t cap = 64;
	while (cap < 2 * n)
		cap *= 2;
	int32_t *head = malloc(sizeof(int32_t) * cap), *next = malloc(sizeof(int32_t) * (n + 1));
	uint64_t *key = malloc(sizeof(uint64_t) * (n + 1));
	if (head && next && key) {
		memset(head, 0xff, sizeof(int32_t) * cap);
		for (uint32_t i = 0; i < n; i++) {
			key[i] = row_hash(rows + (size_t)i * len, len);
			next[i] = head[key[i] & (cap - 1)];
			head[key[i] & (cap - 1)] = (int32_t)i;
		}
		for (uint32_t r = 0; r < slab_rails; r++) {
			const uint8_t *a = slab_recv(r);
			for (uint64_t at = 0; at + len <= slabs[r].area_bytes; at += 16) {
				const uint64_t k = row_hash(a + at, len);
				for (int32_t i = head[k & (cap - 1)]; i >= 0; i = next[i])
					if (key[i] == k && !found[i] &&
					    memcmp(a + at, rows + (size_t)i * len, len) == 0)
						found[i] = 1;
			}
		}
	}
	free(head);
	free(next);
	free(key);
}

/* --noisy: rank q's expert output for token `token` of rank src at (step, layer), element h: a
 * full mantissa at a binade in [-12, 12), as a value of the phase's dtype. */
static int noisy;
static uint64_t noisy_seed;
static uint64_t noisy_tokens3, noisy_order; /* tokens of >= 3 terms; those another order changes */
static FILE *dump; /* --dump */

static float noisy_elem(uint32_t step, uint32_t layer, uint32_t q, uint32_t src, uint32_t token,
			uint32_t h, int bf16)
{
	uint64_t z = rw_wl_mix(noisy_seed + step);
	z = rw_wl_mix(z ^ layer);
	z = rw_wl_mix(z ^ ((uint64_t)q << 32 | src));
	z = rw_wl_mix(z ^ ((uint64_t)token << 32 | h));
	float f = ldexpf((float)(int32_t)(uint32_t)(z >> 32) / 2147483648.0f, (int)(z % 24) - 12);
	uint8_t v[4];
	rw_wl_put_row(v, bf16, &f, 1);
	return rw_wl_get_elem(v, bf16, 0);
}

/* --noisy: token t's combined element h (`got`) against its terms, the rows of every rank that
 * hosts one of its experts: within the rounding of the dtype of their exact sum (the order the
 * daemon sums them in is the protocol's, checked bit for bit by --dump). Counts the tokens of
 * three terms or more, and those whose bits a reversed fp32 sum changes. 0, or 1 off. */
static int noisy_check(const rw_wl_work_t *wk, uint32_t step, uint32_t layer, uint32_t t,
		       uint32_t h, int bf16, float got)
{
	float term[RW_WL_TOPK];
	uint32_t n = 0;
	double ref = 0, mag = 0;
	for (uint32_t k = 0; k < RW_WL_TOPK; k++) {
		const int32_t e = wk->ids[t][k];
		int dup = e < 0;
		for (uint32_t j = 0; j < k && !dup; j++)
			dup = wk->ids[t][j] >= 0 &&
			      (uint32_t)wk->ids[t][j] / per_rank == (uint32_t)e / per_rank;
		if (dup)
			continue;
		term[n] = noisy_elem(step, layer, (uint32_t)e / per_rank, me, t, h, bf16);
		ref += term[n];
		mag += fabs(term[n]);
		n++;
	}
	const double ulp = bf16 ? 1.0 / 128 : 1.0 / 8388608;
	if (fabs((double)got - ref) > mag * ulp * (n + 1))
		return 1;
	if (n >= 3 && h == 0) {
		float fwd = 0, rev = 0;
		for (uint32_t i = 0; i < n; i++) {
			fwd += term[i];
			rev += term[n - 1 - i];
		}
		uint8_t a[4], b[4];
		rw_wl_put_row(a, bf16, &fwd, 1);
		rw_wl_put_row(b, bf16, &rev, 1);
		noisy_tokens3++;
		noisy_order += memcmp(a, b, bf16 ? 2 : 4) != 0;
	}
	return 0;
}

static rw_wl_work_t mine;          /* scratch of run(), allocated by main() */
static rw_wl_work_t *all;          /* [world]: every rank's workload of the phase being checked */
static uint8_t *seen;
static uint32_t *ecount;
static float *outv;

/* RW_RANK_TRACE=FILE: append where the rank is to FILE (a rank that hangs in a driver call
 * shows where, even when its output pipe is never read). */
static void trace(const char *what)
{
	const char *path = getenv("RW_RANK_TRACE");
	FILE *f = path ? fopen(path, "a") : NULL;
	if (f) {
		fprintf(f, "rw_rank %d: %s\n", (int)getpid(), what);
		fclose(f);
	}
}

static int wait_one(rw_client_t *c, rw_cqe_t *cqe, int timeout_ms)
{
	trace("waiting for a completion");
	int n = rw_client_wait(c, cqe, 1, timeout_ms);
	trace(n == 1 ? "completion" : "no completion");
	return n == 1 ? 0 : n < 0 ? n : -1;
}

/* Where the rank's buffer lives: a memfd mapping the daemon shares, or device memory with a host
 * mirror that every check reads (copied in before a submission, back after a completion). */
typedef struct rank_buf {
	int cuda;
	int ordered;              /* --stream-ordered */
	rw_cuda_event_t *event;   /* recorded after the inputs' copies */
	uint32_t event_id;
	uint64_t off_flag;        /* the flag word, at the end of the buffer */
	uint32_t value;           /* the last flag value asked for */
	int device;
	rw_cuda_stream_t *stream; /* copies, each waited for (see buf_to_dev) */
	rw_cuda_dptr_t dptr;
	uint8_t *mem; /* host mapping, or the mirror */
	uint32_t id;
	rw_client_rank_t *rp;     /* --rank-path */
	rw_client_stream_t cs;    /* the stream, as the rank path takes it */
	uint64_t k_disp;          /* the rank path's phase number of the last dispatch */
} rank_buf_t;

/* The daemon reads a rank's device memory on its own stream, in its own process: whatever
 * writes the inputs must have *finished* before the submission (a trainer synchronizes its
 * stream). A plain cuMemcpyHtoD from pageable memory may return before its DMA is done, so
 * every copy here goes on a stream that is synchronized. */
static int buf_to_dev(const rank_buf_t *b, uint64_t off, uint64_t len)
{
	if (!b->cuda || len == 0)
		return 0;
	if (rw_cuda_copy_htod_async(b->stream, b->dptr + off, b->mem + off, len) != RW_OK)
		return -1;
	if (b->ordered || b->rp) /* the event, recorded next, or the rank path's kernels, which
				  * come after the copy in stream order, read it */
		return 0;
	return rw_cuda_stream_sync(b->stream) == RW_OK ? 0 : -1;
}

/* Stream order: the flag's value now (a synchronous read; the rank's stream is idle then). */
static uint32_t flag_now(const rank_buf_t *b)
{
	uint32_t v = 0;
	if (rw_cuda_copy_dtoh_async(b->stream, &v, b->dptr + b->off_flag, 4) != RW_OK ||
	    rw_cuda_stream_sync(b->stream) != RW_OK)
		return 0xdeadbeefu;
	return v;
}

/* Stream order, before submitting `e`: record the event behind the inputs' copies (not
 * synchronized) and ask for the next flag value. */
static int ordered_submit(rw_client_t *c, rank_buf_t *b, rw_sqe_t *e)
{
	if (!b->ordered)
		return rw_client_submit(c, e, 1);
	if (rw_cuda_event_record(b->event, b->stream) != RW_OK)
		return RW_E_SYS;
	e->flags = RW_SQE_WAIT_EVENT | RW_SQE_SIGNAL;
	e->event_id = (uint16_t)b->event_id;
	e->output.reserved = ++b->value;
	return rw_client_submit(c, e, 1);
}

/* Stream order, after the submission: the stream waits for the flag, then copies the outputs
 * [off, off + len) back, so what is checked is what the outputs held when the flag appeared
 * (a flag written before the outputs shows as stale rows). */
static int ordered_wait(rank_buf_t *b, uint64_t off, uint64_t len)
{
	if (!b->ordered)
		return 0;
	if (rw_cuda_stream_wait_u32(b->stream, b->dptr + b->off_flag, b->value) != RW_OK)
		return -1;
	if (len && rw_cuda_copy_dtoh_async(b->stream, b->mem + off, b->dptr + off, len) != RW_OK)
		return -1;
	return 0;
}

/* After the completion: the stream drained, and the flag holds exactly the value asked for
 * (one write per completion, errors included). */
static int ordered_check(rank_buf_t *b)
{
	if (!b->ordered)
		return 0;
	uint32_t v = flag_now(b);
	CHECK(v == b->value, "flag is %u after the completion, expected %u", v, b->value);
	return 0;
}

/* The daemon went away: write every flag it owed (so the stream does not wait forever), and
 * see the stream drain. */
static int ordered_lost(rw_client_t *c, rank_buf_t *b)
{
	rw_client_lost_signal_t lost[16];
	int n = rw_client_lost_signals(c, lost, 16), written = 0;
	/* On a stream of its own that waits for nothing (the rank's waits for this very flag): a
	 * synchronous copy on the default stream may wait behind it on a real GPU. */
	rw_cuda_stream_t *side = NULL;
	trace("daemon lost: writing the owed flags");
	if (n > 0 && rw_cuda_stream_create(b->device, &side) != RW_OK)
		return 1;
	for (int i = 0; i < n; i++) {
		uint32_t v = lost[i].value;
		if (lost[i].flag_buf != b->id || lost[i].flag_offset != b->off_flag)
			break;
		if (rw_cuda_copy_htod_async(side, b->dptr + b->off_flag, &v, sizeof(v)) == RW_OK &&
		    rw_cuda_stream_sync(side) == RW_OK)
			written++;
	}
	if (side)
		rw_cuda_stream_destroy(side);
	trace("owed flags written; draining the stream");
	if (written != n)
		return 1;
	if (rw_cuda_stream_sync(b->stream) != RW_OK)
		return 1;
	printf("daemon lost: wrote %d owed flags, stream drained\n", written);
	fflush(stdout);
	return 3;
}

static int buf_from_dev(const rank_buf_t *b, uint64_t off, uint64_t len)
{
	if (!b->cuda || len == 0)
		return 0;
	if (rw_cuda_copy_dtoh_async(b->stream, b->mem + off, b->dptr + off, len) != RW_OK)
		return -1;
	return rw_cuda_stream_sync(b->stream) == RW_OK ? 0 : -1;
}

/* ---- --rank-path: librailwave's rank path instead of the ring --------------------------------
 * The buffer keeps the ring's layout (inputs, dispatch output, combine input and output at the
 * same offsets), in device memory; a phase is enqueued on the rank's stream and answered as the
 * ring's completion would be (rank_cqe), so every check after it is the ring's. */

/* Where the dispatch outputs lie in the output area of out_cap bytes, for rows of `row` bytes:
 * the per-expert counts first (cbytes; the ring puts them there only when they do not fit the
 * completion), then cap rows, then cap metadata entries at meta_off (16-byte aligned for the
 * rank path's kernels). */
typedef struct out_layout {
	uint64_t cbytes, cap, meta_off;
} out_layout_t;

static out_layout_t out_layout(const rank_buf_t *b, uint64_t out_cap, uint32_t row)
{
	const uint64_t meta_bytes = 16 + 8 * TOPK, cb = (4ull * experts + 15) & ~15ull;
	out_layout_t o = { .cbytes = b->rp || experts > RW_CQE_INLINE_COUNTS ? cb : 0 };
	o.cap = (out_cap - o.cbytes - (b->rp ? 16 : 0)) / (row + meta_bytes);
	if (b->rp && o.cap > (uint64_t)world * MAX_ROWS) /* the page's max_recv */
		o.cap = (uint64_t)world * MAX_ROWS;
	o.meta_off = o.cbytes + o.cap * row;
	if (b->rp)
		o.meta_off = (o.meta_off + 15) & ~15ull;
	return o;
}

/* Opens the rank path on the device of this rank's local GPU (its page and its group's slabs
 * mapped and registered there) and makes the stream every phase goes on. Exits 77 where the
 * library has no rank path. */
static int rank_open(rw_client_t *c, rank_buf_t *b)
{
	int ndev = rw_cuda_device_count();
	CHECK(ndev > 0, "no CUDA device");
	b->device = (int)(me % gpus) % ndev;
	int rc = rw_client_rank_open(c, b->device, world * MAX_ROWS, &b->rp);
	if (rc == RW_E_NO_CUDA) {
		printf("skip: no rank path here: %s\n", rw_client_rank_message(NULL));
		exit(77);
	}
	CHECK(rc == 0, "rank path: %s: %s", rw_client_strerror(rc), rw_client_rank_message(NULL));
	rw_cuda_ext_stream_t e;
	CHECK(rw_cuda_stream_create(b->device, &b->stream) == RW_OK &&
	      rw_cuda_ext_stream_of(b->stream, &e) == RW_OK, "a CUDA stream");
	b->cs = (rw_client_stream_t){ .device = e.device, .handle = e.handle };
	return 0;
}

/* Why the rank path's phase failed: the library's answer, and the daemon's reason, which comes
 * as a notice on the control socket before the daemon writes the phase's status (a bounded
 * rw_client_wait takes it: no completion comes on a rank-path client's ring). */
static const char *rank_why(rw_client_t *c, const rank_buf_t *b)
{
	static char why[1024];
	rw_cqe_t none;
	for (int i = 0; i < 4 && rw_client_wait(c, &none, 1, 5) == 0; i++)
		;
	snprintf(why, sizeof(why), "%s (%s)", rw_client_last_message(c),
		 rw_client_rank_message(b->rp));
	return why;
}

/* The daemon's notice, or on the rank path rank_why's. */
static const char *last_why(rw_client_t *c, const rank_buf_t *b)
{
	return b->rp ? rank_why(c, b) : rw_client_last_message(c);
}

/* The daemon went away mid-phase: the library wrote the words the stream waited on; the stream
 * must run through. */
static int rank_lost(rank_buf_t *b)
{
	CHECK(rw_cuda_stream_sync(b->stream) == RW_OK, "daemon lost: the stream did not drain");
	printf("daemon lost: the rank path's stream ran through\n");
	fflush(stdout);
	return 3;
}

/* Phase k of the rank path waited for (a bound, never a timing criterion), then *cq as the
 * ring's completion of `e` would say it. 0, 3 when the daemon went away (rank_lost), 1 on a
 * failed check. */
static int rank_complete(rank_buf_t *b, uint64_t k, const rw_sqe_t *e, rw_cqe_t *cq)
{
	rw_client_rank_done_t done = { 0 };
	trace("waiting for the rank path's phase");
	int st = rw_client_rank_wait(b->rp, k, 30000, &done);
	trace("rank path's phase done");
	CHECK(st != RW_E_TIMEOUT, "phase %llu of the rank path not done: %s", (unsigned long long)k,
	      rw_client_rank_message(b->rp));
	if (st == RW_E_CLOSED)
		return rank_lost(b);
	memset(cq, 0, sizeof(*cq));
	cq->status = st ? RW_CQ_ERROR : RW_CQ_OK;
	cq->error = st;
	cq->phase_id = e->phase_id;
	cq->user_data = e->user_data;
	cq->recv_tokens = done.recv_tokens; /* a combine's: none (the ring's says mine.n) */
	cq->n_experts = experts;
	return 0;
}

/* The dispatch `s` (the ring's submission, its spans naming the buffer) on the rank path; after
 * it passed, its counts, rows and metadata copied back. */
static int rank_dispatch(rank_buf_t *b, const rw_sqe_t *s, uint64_t off_out, uint64_t out_cap,
			 const char *mode, rw_cqe_t *cq)
{
	const uint32_t row = hidden * (s->dtype == RW_DTYPE_BF16 ? 2 : 4);
	const out_layout_t o = out_layout(b, out_cap, row);
	const rw_cuda_dptr_t base = b->dptr;
	const rw_client_rank_dispatch_t d = {
		.dtype = s->dtype, .topk = TOPK, .layer = s->layer, .step = s->step,
		.token_count = s->token_count, .hidden = hidden, .n_experts = s->n_experts,
		.path = s->path, .tokens = base + s->tokens.offset, .topk_ids = base + s->topk_ids.offset,
		.topk_weights = base + s->topk_weights.offset, .recv_x = base + off_out + o.cbytes,
		.recv_meta = base + off_out + o.meta_off, .recv_counts = base + off_out,
		.recv_cap = (uint32_t)o.cap };
	int rc = rw_client_rank_dispatch(b->rp, &b->cs, &d, &b->k_disp);
	CHECK(rc == 0, "rank path dispatch: %s: %s", rw_client_strerror(rc),
	      rw_client_rank_message(b->rp));
	if (strcmp(mode, "fail") == 0) { /* a harness may act once every rank is in */
		printf("submitted\n");
		fflush(stdout);
	}
	rc = rank_complete(b, b->k_disp, s, cq);
	if (rc || cq->status != RW_CQ_OK)
		return rc;
	cq->counts_offset = off_out;
	const uint64_t n = cq->recv_tokens;
	CHECK(buf_from_dev(b, off_out, 4ull * experts) == 0 &&
	      buf_from_dev(b, off_out + o.cbytes, n * row) == 0 &&
	      buf_from_dev(b, off_out + o.meta_off, n * (16 + 8 * TOPK)) == 0,
	      "dispatch outputs from the device");
	return 0;
}

/* The combine `cs` on the rank path: its rows (cs->token_count of them at cs->tokens) for the
 * last dispatch, the combined rows into [off_cout, + out_len), copied back after it passed. */
static int rank_combine(rank_buf_t *b, const rw_sqe_t *cs, uint64_t off_cout, uint64_t out_len,
			rw_cqe_t *cq)
{
	const rw_client_rank_combine_t cb = { .dispatch = b->k_disp,
					      .rows = b->dptr + cs->tokens.offset,
					      .out = b->dptr + off_cout };
	uint64_t k = 0;
	int rc = rw_client_rank_combine(b->rp, &b->cs, &cb, &k);
	CHECK(rc == 0, "rank path combine: %s: %s", rw_client_strerror(rc),
	      rw_client_rank_message(b->rp));
	rc = rank_complete(b, k, cs, cq);
	if (rc || cq->status != RW_CQ_OK)
		return rc;
	CHECK(buf_from_dev(b, off_cout, out_len) == 0, "combined rows from the device");
	return 0;
}

/* Submit the combine `cs` and wait for its completion (*cq; its status is the caller's to judge).
 * When the daemon went away instead, *lost_p = 1 and the owed flags are written (ordered_lost's
 * answer is returned: the rank is done). Else 0, or 1 after a failed check. */
static int combine_wait(rw_client_t *c, rank_buf_t *b, rw_sqe_t *cs, uint64_t off_cout,
			uint64_t out_len, rw_cqe_t *cq, int *lost_p)
{
	if (b->rp) {
		int rc = rank_combine(b, cs, off_cout, out_len, cq);
		*lost_p = rc == 3;
		return rc;
	}
	int rc = ordered_submit(c, b, cs);
	CHECK(rc == 0, "submit combine: %s", rw_client_strerror(rc));
	CHECK(ordered_wait(b, off_cout, out_len) == 0, "stream wait on the flag");
	rc = wait_one(c, cq, 30000);
	if (rc == RW_E_CLOSED && b->ordered) {
		*lost_p = 1;
		return ordered_lost(c, b);
	}
	CHECK(rc == 0, "no combine completion");
	return 0;
}

/* The outputs as the checks read them: copied after the flag (stream order), or now. */
static int outputs_back(const rank_buf_t *b, uint64_t off, uint64_t len)
{
	return b->ordered || b->rp ? 0 : buf_from_dev(b, off, len); /* rank path: copied */
}

static int buf_register(rw_client_t *c, size_t total, rank_buf_t *b)
{
	if (!b->cuda) {
		int rc = rw_client_register_host(c, total, &b->id, (void **)&b->mem);
		CHECK(rc == 0, "register host: %s", rw_client_strerror(rc));
		return 0;
	}
	int ndev = rw_cuda_device_count();
	CHECK(ndev > 0, "no CUDA device");
	if (!b->rp) { /* the rank path made its stream at open */
		b->device = (int)(me % gpus) % ndev;
		CHECK(rw_cuda_stream_create(b->device, &b->stream) == RW_OK, "cuda stream");
	}
	CHECK(rw_cuda_mem_alloc(b->device, total, &b->dptr) == RW_OK, "cuda alloc %zu bytes", total);
	CHECK(rw_cuda_memset_d8(b->device, b->dptr, 0, total) == RW_OK, "cuda memset");
	/* Stream order: the host mirror is page-locked, so the copy queued behind the flag wait is
	 * asynchronous (a copy into pageable memory returns only once done: the rank would block
	 * on the daemon's flag before it ever waits for the completion, and forever if the daemon
	 * dies). The rank path's mirror too: its copies go on the stream with no synchronization. */
	if (b->ordered || b->rp) {
		void *pinned = NULL;
		CHECK(rw_cuda_host_alloc(total, &pinned) == RW_OK, "page-locked mirror");
		b->mem = pinned;
		memset(b->mem, 0, total);
	} else {
		b->mem = calloc(1, total);
	}
	CHECK(b->mem, "out of memory");
	if (b->rp) /* the rank path reads and writes it itself: nothing to lend the daemon */
		return 0;
	rw_cuda_ipc_desc_t d;
	CHECK(rw_cuda_ipc_export(b->dptr, total, &d) == RW_OK, "cuda ipc export");
	rw_client_cuda_desc_t cd;
	memset(&cd, 0, sizeof(cd));
	memcpy(cd.ipc_handle, d.handle.bytes, sizeof(cd.ipc_handle));
	cd.alloc_id = d.buffer_id;
	cd.alloc_bytes = d.alloc_bytes;
	cd.offset = d.offset;
	cd.bytes = d.bytes;
	memcpy(cd.device_uuid, d.device_uuid, sizeof(cd.device_uuid));
	cd.device = b->device;
	int rc = rw_client_register_cuda(c, &cd, &b->id);
	CHECK(rc == 0, "register cuda: %s (%s)", rw_client_strerror(rc), rw_client_last_message(c));
	if (b->ordered) {
		uint8_t h[RW_EVENT_HANDLE_BYTES];
		b->off_flag = (total - 4) & ~(uint64_t)3;
		CHECK(rw_cuda_event_export(b->device, &b->event, h) == RW_OK, "cuda event export");
		rc = rw_client_register_event(c, h, b->id, b->off_flag, &b->event_id);
		CHECK(rc == 0, "register event: %s (%s)", rw_client_strerror(rc),
		      rw_client_last_message(c));
	}
	return 0;
}

static void buf_release(rank_buf_t *b)
{
	if (!b->cuda)
		return;
	if (b->ordered || b->rp)
		rw_cuda_host_free(b->mem);
	else
		free(b->mem);
	if (b->event)
		rw_cuda_event_destroy(b->event);
	if (b->stream)
		rw_cuda_stream_destroy(b->stream);
	if (b->dptr)
		rw_cuda_mem_free(b->device, b->dptr);
	b->mem = NULL;
	b->dptr = 0;
}

/* Mode rewrite: the ids the daemon was handed change under it until the completion. */
typedef struct rewriter {
	int32_t *ids;               /* the submitted ids, in the registered buffer */
	size_t n;                   /* tokens * TOPK */
	atomic_int stop;
	uint64_t flips;
} rewriter_t;

static void *rewrite_ids(void *arg)
{
	rewriter_t *rw = arg;
	while (!atomic_load_explicit(&rw->stop, memory_order_relaxed)) {
		for (size_t i = 0; i < rw->n; i++) {
			int32_t e = rw->ids[i];
			if (e >= 0)
				rw->ids[i] = (int32_t)(((uint32_t)e + experts / 2) % experts);
		}
		rw->flips++;
	}
	return NULL;
}

/* Mode rewrite: dispatch `s` while a thread rewrites its ids, then (when it passed) the
 * combine `cs` of the rows that came, unchecked, as a trainer would. */
static int run_rewrite(rw_client_t *c, rw_sqe_t *s, rw_sqe_t *cs, int32_t *ids, uint32_t n)
{
	rewriter_t rw = { .ids = ids, .n = (size_t)n * TOPK };
	pthread_t t;
	CHECK(pthread_create(&t, NULL, rewrite_ids, &rw) == 0, "cannot start the rewriter");
	int rc = rw_client_submit(c, s, 1);
	rw_cqe_t cq;
	if (rc == 0)
		rc = wait_one(c, &cq, 30000);
	atomic_store(&rw.stop, 1);
	pthread_join(t, NULL);
	CHECK(rc == 0, "rewrite: no dispatch completion: %s", rw_client_strerror(rc));
	if (cq.status != RW_CQ_OK) {
		printf("rewrite: dispatch failed: %s: %s\n", rw_client_strerror(cq.error),
		       rw_client_last_message(c));
		return 0;
	}
	printf("rewrite: dispatch ok (%llu rewrites)\n", (unsigned long long)rw.flips);
	cs->token_count = cq.recv_tokens;
	cs->handle_id = cq.handle_id;
	rc = rw_client_submit(c, cs, 1);
	if (rc == 0)
		rc = wait_one(c, &cq, 30000);
	CHECK(rc == 0, "rewrite: no combine completion: %s", rw_client_strerror(rc));
	printf("rewrite: combine %s\n", cq.status == RW_CQ_OK ? "ok" : rw_client_last_message(c));
	return 0;
}

static int run(rw_client_t *c, rank_buf_t *b, const char *mode, uint32_t layers, uint32_t steps,
	       uint64_t seed, uint32_t submit_experts)
{
	/* One buffer: inputs, dispatch output, combine inputs and output, each part 64-byte
	 * aligned (the rank path's kernels take 16-byte aligned rows). */
#define A64(x) (((uint64_t)(x) + 63) & ~(uint64_t)63)
	const uint64_t off_tok = 0, off_ids = A64((uint64_t)MAX_ROWS * hidden * 4),
		       off_w = A64(off_ids + MAX_ROWS * TOPK * 4);
	const size_t in_bytes = A64(off_w + MAX_ROWS * TOPK * 4);
	const size_t out_cap = A64((size_t)world * MAX_ROWS * (hidden * 4 + 16 + TOPK * 8) +
				   4 * experts + 64);
	const size_t comb_in = A64((size_t)world * MAX_ROWS * hidden * 4);
	const size_t comb_out = A64((size_t)MAX_ROWS * hidden * 4);
#undef A64
	size_t total = in_bytes + out_cap + comb_in + comb_out + (b->ordered ? 64 : 0);
	if (buf_register(c, total, b))
		return 1;
	uint8_t *mem = b->mem;
	const uint32_t buf_id = b->id;
	const uint64_t off_out = in_bytes, off_cin = off_out + out_cap, off_cout = off_cin + comb_in;

	const rw_wl_shape_t sh = { .seed = seed, .gpus = gpus, .experts = experts, .per_rank = per_rank,
				   .hidden = hidden, .tokens = fixed_tokens, .empty = empty_phases };
	CHECK(mine.x && mine.ids && mine.w && all && seen && ecount && outv, "out of memory");
	for (uint32_t q = 0; q < world; q++)
		CHECK(all[q].x && all[q].ids && all[q].w, "out of memory");
	const char *step_delay = getenv("RW_RANK_STEP_DELAY_MS");
	for (uint32_t step = first_step; step < first_step + steps; step++)
		for (uint32_t layer = 0; layer < layers; layer++) {
			if (step_delay && step > first_step && layer == 0)
				usleep((useconds_t)atoi(step_delay) * 1000);
			int bf16 = rw_wl_bf16(step, layer);
			uint32_t esz = bf16 ? 2 : 4, row = hidden * esz;
			rw_wl_gen(&sh, step, layer, me, &mine);
			for (uint32_t t = 0; t < mine.n; t++) {
				rw_wl_put_row(mem + off_tok + (uint64_t)t * row, bf16, mine.x + (size_t)t * hidden,
					      hidden);
				memcpy(mem + off_ids + (uint64_t)t * TOPK * 4, mine.ids[t], TOPK * 4);
				memcpy(mem + off_w + (uint64_t)t * TOPK * 4, mine.w[t], TOPK * 4);
			}
			CHECK(buf_to_dev(b, 0, in_bytes) == 0, "copy inputs to the device");
			/* A rank that routes nothing names no input buffers (allowed for empty spans). */
			rw_span_t none = { RW_BUF_NONE, 0, 0 };
			rw_sqe_t s = { .kind = RW_KIND_DISPATCH, .dtype = bf16 ? RW_DTYPE_BF16 : RW_DTYPE_FP32,
				       .topk = TOPK, .layer = layer, .phase_id = step * 1000 + layer,
				       .step = step, .user_data = 7, .token_count = mine.n, .hidden = hidden,
				       .tokens = { buf_id, 0, off_tok }, .topk_ids = { buf_id, 0, off_ids },
				       .topk_weights = { buf_id, 0, off_w }, .output = { buf_id, 0, off_out },
				       .output_capacity = out_cap, .n_experts = submit_experts };
			if (paths)
				s.path = (uint16_t)((step * 7u + layer) % (RW_PATH_REQ_JOINT + 1));
			if (mine.n == 0 && (step + layer + me) % 2)
				s.tokens = s.topk_ids = s.topk_weights = none;
			if (strcmp(mode, "rewrite") == 0) {
				CHECK(!b->cuda, "mode rewrite takes host buffers");
				rw_sqe_t cs = { .kind = RW_KIND_COMBINE, .dtype = s.dtype, .topk = TOPK,
						.layer = layer, .phase_id = s.phase_id + 500, .step = step,
						.hidden = hidden, .tokens = { buf_id, 0, off_cin },
						.topk_ids = none, .topk_weights = none,
						.output = { buf_id, 0, off_cout }, .output_capacity = comb_out };
				return run_rewrite(c, &s, &cs, (int32_t *)(void *)(mem + off_ids), mine.n);
			}
			uint64_t t_sub = rw_now_ns();
			rw_cqe_t cq;
			int rc;
			if (b->rp) {
				rc = rank_dispatch(b, &s, off_out, out_cap, mode, &cq);
				if (rc)
					return rc;
			} else {
				rc = ordered_submit(c, b, &s);
				CHECK(rc == 0, "submit dispatch: %s", rw_client_strerror(rc));
				if (strcmp(mode, "fail") == 0) { /* a harness may act once all are in */
					printf("submitted\n");
					fflush(stdout);
				}
				CHECK(ordered_wait(b, off_out, out_cap) == 0, "stream wait on the flag");
				rc = wait_one(c, &cq, 30000);
				if (rc == RW_E_CLOSED && b->ordered)
					return ordered_lost(c, b);
				CHECK(rc == 0, "no dispatch completion");
				CHECK(ordered_check(b) == 0, "flag");
			}
			if (timing)
				printf("timing dispatch %u %u %llu %llu %u %u\n", layer, step,
				       (unsigned long long)t_sub, (unsigned long long)rw_now_ns(), cq.recv_tokens, row);
			if (strcmp(mode, "fail") == 0 && cq.status == RW_CQ_OK) {
				/* The pair may fail at its combine instead: a node that had every row it
				 * needed finishes its dispatch before a peer's failure of the pair reaches
				 * it, which then fails the combine (docs/dataflow.md "Failures"). Give the
				 * combine (its rows' contents do not matter) and require that failure. */
				rw_sqe_t fc = { .kind = RW_KIND_COMBINE, .dtype = s.dtype, .topk = TOPK,
						.layer = layer, .phase_id = s.phase_id + 500, .step = step,
						.user_data = 8, .token_count = cq.recv_tokens, .hidden = hidden,
						.handle_id = cq.handle_id, .tokens = { buf_id, 0, off_cin },
						.topk_ids = none, .topk_weights = none,
						.output = { buf_id, 0, off_cout }, .output_capacity = comb_out };
				if (cq.recv_tokens == 0)
					fc.tokens = none;
				if (mine.n == 0) {
					fc.output = none;
					fc.output_capacity = 0;
				}
				int lost = 0;
				rc = combine_wait(c, b, &fc, off_cout, (uint64_t)mine.n * row, &cq, &lost);
				if (rc || lost)
					return rc;
				CHECK(cq.status == RW_CQ_ERROR,
				      "dispatch and combine succeeded but the pair should have failed");
				printf("failed as expected: %s: %s (at the combine)\n",
				       rw_client_strerror(cq.error), last_why(c, b));
				return 0;
			}
			if (strcmp(mode, "fail") == 0) {
				CHECK(cq.status == RW_CQ_ERROR, "dispatch succeeded but should have failed");
				printf("failed as expected: %s: %s\n", rw_client_strerror(cq.error),
				       last_why(c, b));
				return 0;
			}
			if (cq.status != RW_CQ_OK &&
			    redo(step, layer, 0, &cq, vote_dir ? last_why(c, b) : "") == 1) {
				layer--; /* the same (step, layer) again; unsigned wrap-around is defined */
				continue;
			}
			CHECK(cq.status == RW_CQ_OK, "step %u layer %u dispatch failed: %s (%s)", step, layer,
			      rw_client_strerror(cq.error), last_why(c, b));
			CHECK(cq.phase_id == s.phase_id && cq.user_data == 7, "completion ids");
			CHECK(outputs_back(b, off_out, out_cap) == 0, "copy the dispatch output back");

			/* Which rows must arrive: every token of every rank with an expert on me. */
			uint32_t expect_total = 0;
			memset(seen, 0, (size_t)world * MAX_ROWS);
			memset(ecount, 0, sizeof(uint32_t) * experts);
			for (uint32_t q = 0; q < world; q++) {
				rw_wl_gen(&sh, step, layer, q, &all[q]);
				expect_total += rw_wl_hits(&all[q], me, per_rank, ecount);
			}
			const uint32_t *counts = cq.n_inline ? cq.counts :
				(const uint32_t *)(const void *)(mem + (cq.counts_offset));
			if (cq.recv_tokens != expect_total ||
			    memcmp(counts, ecount, sizeof(uint32_t) * RW_MIN(experts, cq.n_experts)) != 0) {
				rw_rank_diff_t dc = { .me = me, .world = world, .per_rank = per_rank,
						      .hidden = hidden, .experts = experts,
						      .max_rows = MAX_ROWS, .all = all, .seen = seen };
				rw_rank_dispatch_diff(&dc, &cq, mem + off_out, out_cap, bf16);
			}
			CHECK(cq.recv_tokens == expect_total, "step %u layer %u: received %u rows, expected %u",
			      step, layer, cq.recv_tokens, expect_total);
			CHECK(cq.n_experts == experts, "n_experts %u", cq.n_experts);
			for (uint32_t e = 0; e < experts; e++)
				CHECK(counts[e] == ecount[e], "expert %u count %u, expected %u", e, counts[e], ecount[e]);
			/* Output layout (docs/dataflow.md "Dispatch output"). */
			const out_layout_t ol = out_layout(b, out_cap, row);
			const uint64_t meta_bytes = 16 + 8 * TOPK;
			const uint8_t *rows = mem + off_out + ol.cbytes;
			const uint8_t *metas = mem + off_out + ol.meta_off;
			for (uint32_t j = 0; j < cq.recv_tokens; j++) {
				const uint8_t *m = metas + j * meta_bytes;
				uint32_t src_node, src_rank, token;
				memcpy(&src_node, m, 4);
				memcpy(&src_rank, m + 4, 4);
				memcpy(&token, m + 8, 4);
				CHECK(src_rank < world && src_rank / gpus == src_node, "row %u: bad source", j);
				const rw_wl_work_t *other = &all[src_rank];
				CHECK(token < other->n, "row %u: bad token %u", j, token);
				uint8_t *sn = &seen[src_rank * MAX_ROWS + token];
				CHECK(!*sn, "row %u: rank %u token %u delivered twice", j, src_rank, token);
				*sn = 1;
				CHECK(memcmp(m + 16, other->ids[token], TOPK * 4) == 0, "row %u: ids differ", j);
				CHECK(memcmp(m + 16 + 4 * TOPK, other->w[token], TOPK * 4) == 0, "row %u: weights differ", j);

				const float *xt = other->x + (size_t)token * hidden;
				for (uint32_t h = 0; h < hidden; h++)
					CHECK(rw_wl_get_elem(rows + (uint64_t)j * row, bf16, h) == xt[h],
					      "row %u (rank %u token %u): data differs at %u", j, src_rank, token, h);
				/* Expert compute: sum over my own experts of w * f(e) * x. */
				rw_wl_expert_row(other, token, me, per_rank, hidden, outv);
				for (uint32_t h = 0; noisy && h < hidden; h++)
					outv[h] = noisy_elem(step, layer, me, src_rank, token, h, bf16);
				rw_wl_put_row(mem + off_cin + (uint64_t)j * row, bf16, outv, hidden);
			}
			if (slab_rails) { /* every row from another node lies in one of the slabs */
				uint8_t *found = calloc(cq.recv_tokens + 1, 1);
				CHECK(found, "out of memory");
				trace("looking for the rows in the slabs");
				slabs_find(rows, cq.recv_tokens, row, found);
				trace("looked");
				int missing = -1;
				for (uint32_t j = 0; j < cq.recv_tokens; j++) {
					uint32_t src_node;
					memcpy(&src_node, metas + j * meta_bytes, 4);
					if (src_node == me / gpus)
						continue;
					if (!found[j] && missing < 0)
						missing = (int)j;
					slab_rows += found[j];
				}
				free(found);
				CHECK(missing < 0, "step %u layer %u: row %d from another node is in none of "
				      "the group's slabs", step, layer, missing);
			}
			CHECK(buf_to_dev(b, off_cin, (uint64_t)cq.recv_tokens * row) == 0,
			      "copy the combine input to the device");

			/* Empty combines: no rows received -> 0 rows and no input buffer; no token
			 * sent -> no output buffer either (every other phase, to cover both forms). */
			rw_sqe_t cs = { .kind = RW_KIND_COMBINE, .dtype = s.dtype, .topk = TOPK, .layer = layer,
					.phase_id = s.phase_id + 500, .step = step, .user_data = 8,
					.token_count = cq.recv_tokens, .hidden = hidden,
					.handle_id = cq.handle_id, .tokens = { buf_id, 0, off_cin },
					.topk_ids = none, .topk_weights = none,
					.output = { buf_id, 0, off_cout }, .output_capacity = comb_out,
					.n_experts = (step + layer) % 2 ? experts : 0 };
			if (cq.recv_tokens == 0 && (step + layer + me) % 2)
				cs.tokens = none;
			if (mine.n == 0 && (step + layer + me) % 2) {
				cs.output = none;
				cs.output_capacity = 0;
			}
			t_sub = rw_now_ns();
			int lost = 0;
			rc = combine_wait(c, b, &cs, off_cout, (uint64_t)mine.n * row, &cq, &lost);
			if (rc || lost)
				return rc;
			CHECK(ordered_check(b) == 0, "flag");
			if (timing)
				printf("timing combine %u %u %llu %llu %u %u\n", layer, step,
				       (unsigned long long)t_sub, (unsigned long long)rw_now_ns(), cs.token_count, row);
			if (cq.status != RW_CQ_OK &&
			    redo(step, layer, 0, &cq, vote_dir ? last_why(c, b) : "") == 1) {
				layer--;
				continue;
			}
			CHECK(cq.status == RW_CQ_OK, "step %u layer %u combine failed: %s (%s)", step, layer,
			      rw_client_strerror(cq.error), last_why(c, b));
			CHECK(b->rp || cq.recv_tokens == mine.n, "combine returned %u rows, expected %u",
			      cq.recv_tokens, mine.n);
			CHECK(outputs_back(b, off_cout, (uint64_t)mine.n * row) == 0,
			      "copy the combine output back");
			for (uint32_t t = 0; t < mine.n; t++)
				for (uint32_t h = 0; h < hidden; h++) {
					float ref = rw_wl_combined(&mine, t, h, hidden);
					float got = rw_wl_get_elem(mem + off_cout + (uint64_t)t * row, bf16, h);
					CHECK(noisy ? !noisy_check(&mine, step, layer, t, h, bf16, got) :
						      got == ref,
					      "step %u layer %u token %u elem %u: combine %g, expected %g",
					      step, layer, t, h, got, ref);
				}
			CHECK(!dump || fwrite(mem + off_cout, row, mine.n, dump) == mine.n, "--dump");
			int again = redo(step, layer, 1, &cq, ""); /* did every rank pass it? */
			CHECK(again >= 0, "step %u layer %u: the ranks' vote failed", step, layer);
			if (again)
				layer--;
		}
	printf("rank %u: %u steps x %u layers verified%s%s", me, steps, layers,
	       b->rp ? " (rank path)" : b->cuda ? " (CUDA buffers)" : "",
	       b->ordered ? " (stream-ordered)" : "");
	if (vote_dir)
		printf(", %u retries", retries);
	if (slab_rails)
		printf(", %llu remote rows seen in the group's slabs", (unsigned long long)slab_rows);
	if (noisy)
		printf(", %llu tokens of >= 3 terms, %llu of them changed by another order",
		       (unsigned long long)noisy_tokens3, (unsigned long long)noisy_order);
	printf("\n");
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 11) {
		fprintf(stderr, "usage: rw_rank SOCKET GROUP RANK NODES GPUS EXPERTS LAYERS STEPS SEED MODE "
				"[--hidden H] [--tokens T] [--first-step S] [--submit-experts E] "
				"[--retry N DIR] [--empty] [--paths] [--cuda] [--slabs R] [--scribble] "
				"[--go FILE] [--stay FILE] [--stream-ordered] [--rank-path] [--noisy] [--dump FILE]\n");
		return 2;
	}
	const char *sock = argv[1], *group = argv[2], *mode = argv[10];
	me = (uint32_t)atoi(argv[3]);
	nodes = (uint32_t)atoi(argv[4]);
	gpus = (uint32_t)atoi(argv[5]);
	experts = (uint32_t)atoi(argv[6]);
	uint32_t layers = (uint32_t)atoi(argv[7]), steps = (uint32_t)atoi(argv[8]);
	uint64_t seed = strtoull(argv[9], NULL, 10);
	uint32_t submit_experts = experts;
	rank_buf_t b = { 0 };
	int rank_path = 0;
	const char *dump_path = NULL;
	for (int i = 11; i < argc; i++) {
		if (strcmp(argv[i], "--hidden") == 0 && i + 1 < argc) {
			hidden = (uint32_t)atoi(argv[++i]);
		} else if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
			fixed_tokens = (uint32_t)atoi(argv[++i]);
			if (fixed_tokens < 1 || fixed_tokens > MAX_FIXED) {
				fprintf(stderr, "rw_rank: --tokens must be 1..%d\n", MAX_FIXED);
				return 2;
			}
			if (fixed_tokens > MAX_ROWS)
				MAX_ROWS = fixed_tokens;
		} else if (strcmp(argv[i], "--timing") == 0) {
			timing = 1;
		} else if (strcmp(argv[i], "--first-step") == 0 && i + 1 < argc) {
			first_step = (uint32_t)strtoul(argv[++i], NULL, 10);
		} else if (strcmp(argv[i], "--submit-experts") == 0 && i + 1 < argc) {
			submit_experts = (uint32_t)strtoul(argv[++i], NULL, 10);
		} else if (strcmp(argv[i], "--retry") == 0 && i + 2 < argc) {
			retry_max = (uint32_t)strtoul(argv[++i], NULL, 10);
			vote_dir = argv[++i];
		} else if (strcmp(argv[i], "--empty") == 0) {
			empty_phases = 1;
		} else if (strcmp(argv[i], "--paths") == 0) {
			paths = 1;
		} else if (strcmp(argv[i], "--cuda") == 0) {
			b.cuda = 1;
		} else if (strcmp(argv[i], "--scribble") == 0) {
			scribble = 1;
		} else if (strcmp(argv[i], "--stay") == 0 && i + 1 < argc) {
			stay_file = argv[++i];
		} else if (strcmp(argv[i], "--go") == 0 && i + 1 < argc) {
			go_file = argv[++i];
		} else if (strcmp(argv[i], "--slabs") == 0 && i + 1 < argc) {
			slab_rails = (uint32_t)strtoul(argv[++i], NULL, 10);
			if (slab_rails < 1 || slab_rails > RW_CLIENT_SLAB_RAILS) {
				fprintf(stderr, "rw_rank: --slabs takes 1..%d rails\n", RW_CLIENT_SLAB_RAILS);
				return 2;
			}
		} else if (strcmp(argv[i], "--stream-ordered") == 0) {
			b.ordered = 1;
		} else if (strcmp(argv[i], "--rank-path") == 0) {
			rank_path = 1;
		} else if (strcmp(argv[i], "--noisy") == 0) {
			noisy = 1;
		} else if (strcmp(argv[i], "--dump") == 0 && i + 1 < argc) {
			dump_path = argv[++i];
		} else {
			fprintf(stderr, "rw_rank: unknown flag %s\n", argv[i]);
			return 2;
		}
	}
	if (b.ordered && !b.cuda) {
		fprintf(stderr, "rw_rank: --stream-ordered needs --cuda\n");
		return 2;
	}
	if (rank_path && (b.cuda || slab_rails || strcmp(mode, "rewrite") == 0)) {
		fprintf(stderr, "rw_rank: --rank-path takes none of --cuda, --slabs, mode rewrite\n");
		return 2;
	}
	world = nodes * gpus;
	if (!gpus || !experts || !world || experts % world || !hidden || hidden > 65536) {
		fprintf(stderr, "rw_rank: need GPUS > 0, EXPERTS a multiple of NODES*GPUS, 0 < H <= 65536\n");
		return 2;
	}
	per_rank = experts / world;
	noisy_seed = seed;
	if ((b.cuda || slab_rails || rank_path) &&
	    (rw_cuda_init() != RW_OK || rw_cuda_device_count() < 1)) {
		printf("skip: no CUDA: %s\n", rw_cuda_unavailable_reason());
		return 77;
	}

	rw_client_opts_t o = { .socket_path = sock, .group = group, .rank = me, .world_size = world,
			       .node = me / gpus, .local_gpu = (int32_t)(me % gpus) };
	rw_client_t *c = NULL;
	int rc = rw_client_connect(&o, &c);
	CHECK(rc == 0, "connect: %s", rw_client_strerror(rc));
	if (rank_path) { /* a rank-path rank from the start: idle too, its page and slabs held */
		b.cuda = 1;
		if (rank_open(c, &b))
			return 1;
	}
	if (dump_path && !(dump = fopen(dump_path, "wb"))) {
		fprintf(stderr, "rank %u: --dump %s: cannot write it\n", me, dump_path);
		return 1;
	}
	if (strcmp(mode, "idle") == 0) {
		printf("ready\n");
		fflush(stdout);
		for (;;)
			pause();
	}
	if (slab_rails && slabs_map(c)) {
		rw_client_close(c);
		return 1;
	}
	pthread_t scribble_thread;
	if (scribble && slab_rails) {
		atomic_store(&scribbling, 1);
		CHECK(pthread_create(&scribble_thread, NULL, scribbler, NULL) == 0, "scribbler thread");
	}
	if (wait_file(go_file)) {
		rw_client_close(c);
		return 1;
	}
	mine.x = malloc(sizeof(float) * MAX_ROWS * hidden);
	mine.ids = malloc(sizeof(*mine.ids) * MAX_ROWS);
	mine.w = malloc(sizeof(*mine.w) * MAX_ROWS);
	all = calloc(world, sizeof(*all));
	for (uint32_t q = 0; all && q < world; q++) {
		all[q].x = malloc(sizeof(float) * MAX_ROWS * hidden);
		all[q].ids = malloc(sizeof(*all[q].ids) * MAX_ROWS);
		all[q].w = malloc(sizeof(*all[q].w) * MAX_ROWS);
	}
	seen = malloc((size_t)world * MAX_ROWS);
	ecount = malloc(sizeof(uint32_t) * experts);
	outv = malloc(sizeof(float) * hidden);
	rc = run(c, &b, mode, layers, steps, seed, submit_experts);
	if (wait_file(stay_file))
		rc = 1;
	free(mine.x);
	free(mine.ids);
	free(mine.w);
	for (uint32_t q = 0; all && q < world; q++) {
		free(all[q].x);
		free(all[q].ids);
		free(all[q].w);
	}
	free(all);
	free(seen);
	free(ecount);
	free(outv);
	if (scribble && slab_rails) {
		atomic_store(&scribbling, 0);
		pthread_join(scribble_thread, NULL);
	}
	slabs_unmap();
	if (dump && fclose(dump) != 0 && rc == 0)
		rc = 1;
	if (b.rp) { /* its stream drained: nothing writes the page any more */
		rw_cuda_stream_sync(b.stream);
		rw_client_rank_close(b.rp);
	}
	rw_client_close(c); /* the daemon releases its import before we free the memory */
	buf_release(&b);
	if (b.cuda || slab_rails)
		rw_cuda_shutdown();
	return rc;
}
