/* rw_bench_rank: one trainer rank of `railwave demo` / `railwave bench` (docs/demo.md). Connects
 * to its node's railwaved through librailwave, runs STEPS dispatch + combine pairs of one
 * synthetic MoE layer (tools/synth.c: every rank draws every rank's routing from the same seed),
 * checks every received row (source, token, ids, weights, all data), every per-expert count and
 * every combined sum against a reference it computes itself, and prints one timing line per pair:
 *
 *   pair STEP DISPATCH_SUBMIT_NS DISPATCH_DONE_NS COMBINE_SUBMIT_NS COMBINE_DONE_NS ROWS PATH
 *
 * PATH is what the step's dispatch asked for (rw_sqe_t.path): `--paths LIST` cycles through
 * LIST (native, rail-only, perm-only, joint, auto = the daemon's choice, or a raw number, which
 * the daemon range-checks) step by step, so `railwave calibrate` times every path on one set
 * of running daemons; without it every step asks for auto. A combine asks for its dispatch's
 * path, or for what `--combine-paths LIST` says (a test of the daemon's check).
 *
 * (CLOCK_MONOTONIC, which every network namespace of one machine shares, so the orchestrator can
 * compare the ranks' clocks). `--barrier` puts an empty pair (no rank routes anything; layer
 * LAYER + 1, auto path) before every timed dispatch: its dispatch completes on every node only
 * when every node's count row is in, so all nodes submit the timed dispatch within about one
 * count exchange of each other, whatever the previous step left behind (`railwave calibrate`
 * times phases per node across hosts, docs/tools.md). Exit 0 iff every check passed; a failure
 * names the first bad value.
 *
 *   rw_bench_rank --socket PATH --group NAME --rank R --steps S [--paths LIST]
 *                 [--combine-paths LIST] [--barrier] [--cuda] [workload options]
 *
 * --cuda: the buffer is CUDA device memory (registered by IPC handle, docs/cuda.md) with a host
 * mirror the checks read: inputs are copied up before a submission's clock starts and results
 * down after its completion's clock stops (the GPU-path benchmark, docs/perf/gpu-path.md).
 *
 * --rank-path: the rank path instead (docs/rankpath.md): rw_client_rank_open on the rank's GPU,
 * every dispatch and combine (the --barrier pairs too) enqueued with rw_client_rank_dispatch /
 * rw_client_rank_combine on a stream of this process, inputs already in device memory (copied
 * up before the clock starts), outputs copied down after it stops and checked as above. A
 * phase's clock stops when rw_client_rank_wait saw its done word (the stream's last work of the
 * phase) and cuStreamSynchronize of that stream returned. --priority normal|high|both: the
 * stream at the default priority, at the context's greatest (cuStreamCreateWithPriority), or
 * both streams, even steps on the normal one and odd steps on the high one. --sms LIST: the
 * rank path's SM budget (rw_client_rank_set_sms before each step, its barrier pair included;
 * 0: none) cycling through LIST, each value held for one step of each priority (with --priority
 * both, steps 2i and 2i + 1 take LIST[i mod n]), and a line per step saying which:
 *
 *   sms STEP MAX_SMS
 *
 * --host-rank-path: the rank path of a host rank (RW_RANK_HOST, docs/rankpath.md "Host ranks"):
 * no CUDA, the buffer is host memory, rw_client_rank_wait packs, forwards, gathers and reduces
 * on this process's threads (RAILWAVE_RANK_THREADS); the clock stops when the wait returns.
 *
 * --host-ns: also one line per pair with the wall time spent inside the submitting calls
 * (rw_client_submit, or rw_client_rank_dispatch / rw_client_rank_combine), and the stream's
 * priority (`-` on the ring):
 *
 *   call STEP DISPATCH_CALL_NS COMBINE_CALL_NS PRIORITY
 *
 * --gate STEP:FILE: before step STEP (its barrier pair included) wait until FILE exists (the
 * benchmark starts other work on the GPU there, docs/perf/rankpath.md). */
#include <getopt.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "cuda/rw_cuda.h"
#include "ipc/railwave.h"
#include "sched/sched.h"
#include "tools/bench.h"

static uint32_t me;

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "rank %u: ", me); \
	fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); goto out; } } while (0)

#define MAX_PATHS 16

/* --paths: names (auto = 0, the daemon's choice) or raw numbers, comma-separated. */
static int parse_paths(const char *arg, uint16_t *req, unsigned *n_p)
{
	char buf[256];
	snprintf(buf, sizeof(buf), "%s", arg);
	unsigned n = 0;
	for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		rw_path_t p;
		char *end;
		unsigned long v;
		if (n == MAX_PATHS)
			return -1;
		if (strcmp(t, "auto") == 0)
			req[n++] = RW_PATH_REQ_DAEMON;
		else if (rw_sched_path_parse(t, &p) == RW_OK)
			req[n++] = (uint16_t)(p + RW_PATH_REQ_NATIVE);
		else if ((v = strtoul(t, &end, 10)) <= 0xffff && *end == 0 && end != t)
			req[n++] = (uint16_t)v;
		else
			return -1;
	}
	*n_p = n;
	return n ? 0 : -1;
}

static const char *req_name(uint16_t req)
{
	static char num[8];
	if (req == RW_PATH_REQ_DAEMON)
		return "auto";
	if (req <= RW_PATH_REQ_JOINT)
		return rw_sched_path_name((rw_path_t)(req - RW_PATH_REQ_NATIVE));
	snprintf(num, sizeof(num), "%u", req);
	return num;
}

static int wait_one(rw_client_t *c, rw_cqe_t *cqe)
{
	return rw_client_wait(c, cqe, 1, 120000) == 1 ? 0 : -1;
}

/* --cuda: device memory and the stream its mirror copies go on (each waited for: the daemon
 * reads the inputs in its own process, so they must be complete before the submission). */
typedef struct dev_buf {
	int device;
	rw_cuda_stream_t *s;
	rw_cuda_dptr_t dptr;
} dev_buf_t;

static int mirror(const dev_buf_t *d, uint8_t *mem, uint64_t off, uint64_t len, int up)
{
	if (!d->dptr || !len)
		return 0;
	rw_status_t st = up ? rw_cuda_copy_htod_async(d->s, d->dptr + off, mem + off, len)
			    : rw_cuda_copy_dtoh_async(d->s, mem + off, d->dptr + off, len);
	return st == RW_OK && rw_cuda_stream_sync(d->s) == RW_OK ? 0 : -1;
}

/* Allocate `total` bytes on the GPU of local rank `gpu`, and the stream of the mirror copies. */
static int dev_alloc(uint32_t gpu, uint64_t total, dev_buf_t *d)
{
	if (rw_cuda_init() != RW_OK || rw_cuda_device_count() < 1) {
		fprintf(stderr, "rank %u: CUDA: %s\n", me, rw_cuda_unavailable_reason());
		return -1;
	}
	d->device = (int)(gpu % (uint32_t)rw_cuda_device_count());
	if (rw_cuda_stream_create(d->device, &d->s) != RW_OK ||
	    rw_cuda_mem_alloc(d->device, total, &d->dptr) != RW_OK) {
		fprintf(stderr, "rank %u: cannot allocate %llu bytes on GPU %d\n", me,
			(unsigned long long)total, d->device);
		return -1;
	}
	return 0;
}

/* dev_alloc, then the memory registered with the daemon by IPC handle (--cuda). */
static int dev_register(rw_client_t *cl, uint32_t gpu, uint64_t total, dev_buf_t *d, uint32_t *buf)
{
	rw_cuda_ipc_desc_t x;
	if (dev_alloc(gpu, total, d) != 0)
		return -1;
	if (rw_cuda_ipc_export(d->dptr, total, &x) != RW_OK) {
		fprintf(stderr, "rank %u: --cuda: cannot export %llu bytes on GPU %d\n", me,
			(unsigned long long)total, d->device);
		return -1;
	}
	rw_client_cuda_desc_t cd = { .alloc_id = x.buffer_id, .alloc_bytes = x.alloc_bytes,
				     .offset = x.offset, .bytes = x.bytes, .device = d->device };
	memcpy(cd.ipc_handle, x.handle.bytes, sizeof(cd.ipc_handle));
	memcpy(cd.device_uuid, x.device_uuid, sizeof(cd.device_uuid));
	int rc = rw_client_register_cuda(cl, &cd, buf);
	if (rc != 0)
		fprintf(stderr, "rank %u: register cuda: %s (%s)\n", me, rw_client_strerror(rc),
			rw_client_last_message(cl));
	return rc == 0 ? 0 : -1;
}

/* --barrier: a pair in which no rank routes anything, on the layer after the timed one. */
static int empty_pair(rw_client_t *c, const rw_sqe_t *timed, uint64_t step)
{
	rw_sqe_t s = *timed;
	s.layer = timed->layer + 1;
	s.phase_id = UINT64_MAX - 1;
	s.user_data = 3;
	s.token_count = 0;
	s.tokens = s.topk_ids = s.topk_weights = (rw_span_t){ RW_BUF_NONE, 0, 0 };
	s.path = RW_PATH_REQ_DAEMON;
	rw_cqe_t cq;
	if (rw_client_submit(c, &s, 1) != 0 || wait_one(c, &cq) != 0 || cq.status != RW_CQ_OK ||
	    cq.recv_tokens != 0)
		return -1;
	rw_sqe_t cs = { .kind = RW_KIND_COMBINE, .dtype = s.dtype, .topk = s.topk, .layer = s.layer,
			.phase_id = UINT64_MAX, .step = step, .user_data = 4, .token_count = 0,
			.hidden = s.hidden, .n_experts = s.n_experts, .handle_id = cq.handle_id,
			.tokens = { RW_BUF_NONE, 0, 0 }, .topk_ids = { RW_BUF_NONE, 0, 0 },
			.topk_weights = { RW_BUF_NONE, 0, 0 }, .output = { RW_BUF_NONE, 0, 0 },
			.output_capacity = 0, .path = RW_PATH_REQ_DAEMON };
	if (rw_client_submit(c, &cs, 1) != 0 || wait_one(c, &cq) != 0 || cq.status != RW_CQ_OK)
		return -1;
	return 0;
}

/* --rank-path: the rank path and its streams ([0] the default priority, [1] the greatest). */
#define MAX_SMS_LIST 16
typedef struct rpath {
	rw_client_rank_t *rp;
	rw_cuda_stream_t *s[2];
	rw_client_stream_t cs[2];
	int prio[2];
	int which; /* --priority: 0 normal, 1 high, 2 both (even steps normal, odd steps high) */
	int32_t sms[MAX_SMS_LIST]; /* --sms: the SM budgets in turn (n_sms 0: none set) */
	unsigned n_sms;
} rpath_t;

static const char *const prio_names[] = { "normal", "high", "both" };

static int rp_open(rw_client_t *cl, int device, uint32_t max_recv, rpath_t *p)
{
	int rc = rw_client_rank_open(cl, device, max_recv, &p->rp);
	if (rc != 0) {
		fprintf(stderr, "rank %u: --rank-path: %s: %s\n", me, rw_client_strerror(rc),
			rw_client_rank_message(NULL));
		return -1;
	}
	for (int i = 0; i < 2 && device == RW_RANK_HOST; i++) /* a host rank: no stream */
		p->cs[i] = (rw_client_stream_t){ .device = RW_RANK_HOST };
	for (int i = 0; i < 2 && device != RW_RANK_HOST; i++) {
		if (p->which != 2 && p->which != i)
			continue;
		rw_cuda_ext_stream_t e;
		rw_status_t st = rw_cuda_stream_create_prio(device, i, &p->s[i], &p->prio[i]);
		if (st == RW_OK)
			st = rw_cuda_ext_stream_of(p->s[i], &e);
		if (st != RW_OK) {
			fprintf(stderr, "rank %u: --rank-path: no stream at the %s priority: %s\n", me,
				prio_names[i], rw_status_str(st));
			return -1;
		}
		p->cs[i] = (rw_client_stream_t){ .device = e.device, .handle = e.handle };
	}
	return 0;
}

static void rp_close(rpath_t *p)
{
	rw_client_rank_close(p->rp); /* every phase was waited for */
	for (int i = 0; i < 2; i++)
		if (p->s[i])
			rw_cuda_stream_destroy(p->s[i]);
}

/* The stream step `step` enqueues on. */
static int rp_stream(const rpath_t *p, uint64_t step)
{
	return p->which == 2 ? (int)(step & 1) : p->which;
}

/* --sms: the budget of step `step` (each value for one step of each priority in use). */
static int32_t rp_sms(const rpath_t *p, uint64_t step)
{
	return p->sms[(step >> (p->which == 2)) % p->n_sms];
}

/* --sms LIST: comma-separated budgets, each 0 (none) or a count of SMs (the library refuses one
 * above the device's). 0, or -1 when LIST is not that. */
static int parse_sms(const char *list, rpath_t *p)
{
	const char *at = list;
	p->n_sms = 0;
	for (;;) {
		char *end;
		long v = strtol(at, &end, 10);
		if (end == at || v < 0 || v > 100000 || p->n_sms == MAX_SMS_LIST)
			return -1;
		p->sms[p->n_sms++] = (int32_t)v;
		if (*end == '\0')
			return 0;
		if (*end != ',')
			return -1;
		at = end + 1;
	}
}

/* Rank-path phase k is complete: rw_client_rank_wait saw its done word, then the stream has
 * nothing left of it. 0, or the phase's code. */
static int rp_wait(rpath_t *p, int w, uint64_t k, rw_client_rank_done_t *done)
{
	int rc = rw_client_rank_wait(p->rp, k, 120000, done);
	if (rc == 0 && p->s[w] && rw_cuda_stream_sync(p->s[w]) != RW_OK)
		rc = RW_E_CUDA;
	return rc;
}

/* --barrier on the rank path: a dispatch of no tokens on the next layer, and its combine. */
static int rp_empty_pair(rpath_t *p, int w, const rw_client_rank_dispatch_t *timed)
{
	rw_client_rank_dispatch_t d = *timed;
	d.layer++;
	d.token_count = 0;
	d.path = RW_PATH_REQ_DAEMON;
	d.tokens = d.topk_ids = d.topk_weights = 0;
	uint64_t kd, kc;
	rw_client_rank_done_t done;
	if (rw_client_rank_dispatch(p->rp, &p->cs[w], &d, &kd) != 0 ||
	    rp_wait(p, w, kd, &done) != 0 || done.recv_tokens != 0)
		return -1;
	const rw_client_rank_combine_t c = { .dispatch = kd };
	if (rw_client_rank_combine(p->rp, &p->cs[w], &c, &kc) != 0 || rp_wait(p, w, kc, NULL) != 0)
		return -1;
	return 0;
}

/* --gate: wait (1 ms polls, 10 minutes at most) until `file` exists. */
static int gate_wait(const char *file)
{
	const struct timespec ms = { 0, 1000000 };
	for (long i = 0; i < 600000; i++) {
		if (access(file, F_OK) == 0)
			return 0;
		nanosleep(&ms, NULL);
	}
	return -1;
}

static int cmp_u64(const void *a, const void *b)
{
	const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* p50 and p99 (nearest rank) of v[0..n), sorted in place. */
static void pcts(uint64_t *v, size_t n, uint64_t *p50, uint64_t *p99)
{
	qsort(v, n, sizeof(*v), cmp_u64);
	*p50 = n ? v[(n - 1) / 2] : 0;
	*p99 = n ? v[(n * 99 + 99) / 100 - 1] : 0;
}

int main(int argc, char **argv)
{
	static const struct option own[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "group", required_argument, NULL, 'g' },
		{ "rank", required_argument, NULL, 'r' },
		{ "steps", required_argument, NULL, 'n' },
		{ "paths", required_argument, NULL, 'p' },
		{ "combine-paths", required_argument, NULL, 'c' },
		{ "barrier", no_argument, NULL, 'b' },
		{ "help", no_argument, NULL, 'h' },
		{ "cuda", no_argument, NULL, 'u' },
		{ "rank-path", no_argument, NULL, 'P' },
		{ "host-rank-path", no_argument, NULL, 'O' },
		{ "priority", required_argument, NULL, 'q' },
		{ "host-ns", no_argument, NULL, 'H' },
		{ "gate", required_argument, NULL, 'G' },
		{ "sms", required_argument, NULL, 'S' },
	};
	enum { N_OWN = sizeof(own) / sizeof(own[0]) };
	struct option opts[RW_BENCH_WL_NOPTS + N_OWN + 1];
	memcpy(opts, own, sizeof(own));
	memcpy(opts + N_OWN, rw_bench_wl_options, sizeof(struct option) * (RW_BENCH_WL_NOPTS + 1));
	rw_bench_wl_t wl;
	rw_bench_wl_default(&wl);
	const char *sock = NULL, *group = "bench", *gate_file = NULL;
	unsigned long steps = 1, gate_step = 0;
	long rank_arg = -1;
	uint16_t paths[MAX_PATHS] = { RW_PATH_REQ_DAEMON }, cpaths[MAX_PATHS];
	unsigned n_paths = 1, n_cpaths = 0;
	int c, cuda = 0, barrier = 0, rank_path = 0, host_rank = 0, host_ns = 0;
	dev_buf_t dev = { .device = -1 };
	rpath_t rpp = { .which = -1 };
	char *end;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 's': sock = optarg; break;
		case 'g': group = optarg; break;
		case 'r': rank_arg = strtol(optarg, NULL, 10); break;
		case 'n': steps = strtoul(optarg, NULL, 10); break;
		case 'b': barrier = 1; break;
		case 'p':
		case 'c':
			if (parse_paths(optarg, c == 'p' ? paths : cpaths, c == 'p' ? &n_paths : &n_cpaths)) {
				fprintf(stderr, "rw_bench_rank: --%spaths: expected up to %d of native, "
					"rail-only, perm-only, joint, auto or a number\n",
					c == 'p' ? "" : "combine-", MAX_PATHS);
				return 2;
			}
			break;
		case 'u': cuda = 1; break;
		case 'P': rank_path = 1; break;
		case 'O': rank_path = host_rank = 1; break;
		case 'H': host_ns = 1; break;
		case 'q':
			for (int i = 0; i < 3; i++)
				if (strcmp(optarg, prio_names[i]) == 0)
					rpp.which = i;
			if (rpp.which < 0) {
				fprintf(stderr, "rw_bench_rank: --priority: normal, high or both\n");
				return 2;
			}
			break;
		case 'S':
			if (parse_sms(optarg, &rpp) != 0) {
				fprintf(stderr, "rw_bench_rank: --sms: up to %d comma-separated SM "
					"budgets (0: none)\n", MAX_SMS_LIST);
				return 2;
			}
			break;
		case 'G':
			gate_step = strtoul(optarg, &end, 10);
			if (*end != ':' || end == optarg || !end[1]) {
				fprintf(stderr, "rw_bench_rank: --gate: STEP:FILE\n");
				return 2;
			}
			gate_file = end + 1;
			break;
		case 'h':
			printf("usage: rw_bench_rank --socket PATH --group NAME --rank R --steps S "
			       "[--paths LIST] [--combine-paths LIST] [--barrier] [--cuda | --rank-path "
			       "[--priority normal|high|both] [--sms LIST] | --host-rank-path] [--host-ns] "
			       "[--gate STEP:FILE] "
			       "[workload]\n%s", rw_bench_wl_usage);
			return 0;
		default:
			if (rw_bench_wl_opt("rank", c, optarg, &wl) != 0)
				return 2;
		}
	}
	const uint32_t W = wl.nodes * wl.gpus;
	if (!sock || rank_arg < 0 || (uint32_t)rank_arg >= W || steps < 1) {
		fprintf(stderr, "rw_bench_rank: need --socket, --rank < N*G and --steps >= 1\n");
		return 2;
	}
	if ((cuda && rank_path) || ((rpp.which >= 0 || rpp.n_sms) && (!rank_path || host_rank)) ||
	    (rank_path && n_cpaths)) {
		fprintf(stderr, "rw_bench_rank: --cuda or --rank-path, not both; --priority and --sms "
			"need --rank-path, which takes no --combine-paths (a combine takes its "
			"dispatch's)\n");
		return 2;
	}
	if (rpp.which < 0)
		rpp.which = 0;
	me = (uint32_t)rank_arg;

	int ok = 0;
	rw_client_t *cl = NULL;
	rw_synth_t gen;
	memset(&gen, 0, sizeof(gen));
	int32_t *ids = NULL;
	uint32_t *want_counts = NULL;
	uint8_t *seen = NULL;
	uint64_t *call_ns = NULL;
	uint8_t *mem = NULL; /* (before the first CHECK: `out` frees it) */
	rw_synth_cfg_t scfg;
	rw_bench_wl_synth(&wl, &scfg);
	if (rw_synth_init(&gen, &scfg) != RW_OK) {
		fprintf(stderr, "rank %u: bad workload configuration\n", me);
		return 2;
	}
	const uint32_t E = gen.phys_experts, K = wl.topk, T = wl.tokens, H = wl.hidden;
	const uint32_t per_rank = E / W;
	/* Every rank's routing (the layer is fixed over the steps; the data changes per step). */
	ids = malloc((size_t)W * T * K * sizeof(int32_t));
	want_counts = calloc(E, sizeof(uint32_t));
	seen = malloc((size_t)W * T);
	call_ns = calloc(2 * steps, sizeof(uint64_t)); /* [dispatch, combine] per step */
	CHECK(ids && want_counts && seen && call_ns, "out of memory");
	for (uint32_t q = 0; q < W; q++)
		rw_synth_rank(&gen, q / wl.gpus, q % wl.gpus, ids + (size_t)q * T * K);
	uint32_t want_rows = 0;
	for (uint32_t q = 0; q < W; q++)
		for (uint32_t t = 0; t < T; t++) {
			const int32_t *id = ids + ((size_t)q * T + t) * K;
			int hit = 0;
			for (uint32_t k = 0; k < K; k++)
				if (id[k] >= 0 && (uint32_t)id[k] / per_rank == me) {
					hit = 1;
					want_counts[id[k]]++;
				}
			want_rows += hit;
		}
	/* A minute for each control reply: a group's first join carves its slabs (group_area_mib
	 * per rail), seconds for the largest shapes on a slow host. */
	rw_client_opts_t o = { .socket_path = sock, .group = group, .rank = me, .world_size = W,
			       .node = me / wl.gpus, .local_gpu = (int32_t)(me % wl.gpus),
			       .timeout_ms = 60000 };
	int rc = rw_client_connect(&o, &cl);
	CHECK(rc == 0, "connect %s: %s", sock, rw_client_strerror(rc));

	/* One buffer: tokens, ids, weights, dispatch output, combine input, combine output. The
	 * dispatch output layout is docs/dataflow.md "Dispatch output": per-expert counts (when they
	 * do not fit the completion), then rows_cap rows, then rows_cap metadata entries. The rank
	 * path's outputs are three arrays, laid out the same way here: counts always, and the
	 * metadata 16-byte aligned. */
	const uint64_t row = (uint64_t)H * 2, meta = 16 + 8ull * K;
	const uint64_t cbytes = rank_path || E > RW_CQE_INLINE_COUNTS ? ((4ull * E + 15) & ~15ull) : 0;
	const uint64_t rows_cap = (uint64_t)want_rows + 1;
	const uint64_t rows_bytes = rank_path ? (rows_cap * row + 15) & ~15ull : rows_cap * row;
	const uint64_t off_tok = 0, off_ids = off_tok + (uint64_t)T * row,
		       off_w = off_ids + (uint64_t)T * K * 4, off_out = (off_w + (uint64_t)T * K * 4 + 63) & ~63ull,
		       out_cap = cbytes + rows_bytes + rows_cap * meta,
		       off_cin = (off_out + out_cap + 63) & ~63ull,
		       off_cout = (off_cin + rows_cap * row + 63) & ~63ull, total = off_cout + (uint64_t)T * row;
	const uint64_t off_rows = off_out + cbytes, off_meta = off_rows + rows_bytes;
	uint32_t buf = 0;
	if (cuda || rank_path) {
		mem = calloc(1, total);
		CHECK(mem, "out of memory");
	}
	if (cuda) {
		CHECK(dev_register(cl, me % wl.gpus, total, &dev, &buf) == 0, "--cuda: no buffer");
	} else if (host_rank) { /* the rank path's addresses are the host buffer's */
		CHECK(rp_open(cl, RW_RANK_HOST, W * T + 1, &rpp) == 0, "--host-rank-path: not open");
		printf("rank %u: host rank path\n", me);
	} else if (rank_path) {
		/* max_recv: the daemon lists for the smallest of the node's ranks, so every rank
		 * gives the bound of all: a row per (source rank, token) it can receive, and as
		 * many reduce-list terms per token (a local rank or another node) at most. */
		CHECK(dev_alloc(me % wl.gpus, total, &dev) == 0 &&
		      rp_open(cl, dev.device, W * T + 1, &rpp) == 0,
		      "--rank-path: not open");
		printf("rank %u: rank path on device %d, stream priority %s (%d%s%d)\n", me, dev.device,
		       prio_names[rpp.which], rpp.prio[rpp.which & 1], rpp.which == 2 ? " and " : "",
		       rpp.which == 2 ? rpp.prio[1] : 0);
	} else {
		rc = rw_client_register_host(cl, total, &buf, (void **)&mem);
		CHECK(rc == 0, "register %llu bytes: %s", (unsigned long long)total, rw_client_strerror(rc));
	}
	const int32_t *my_ids = ids + (size_t)me * T * K;
	const uint64_t base = host_rank ? (uint64_t)(uintptr_t)mem : dev.dptr; /* the rank path's */
	memcpy(mem + off_ids, my_ids, (size_t)T * K * 4);

	for (uint64_t step = 0; step < steps; step++) {
		float *wt = (float *)(void *)(mem + off_w);
		for (uint32_t t = 0; t < T; t++) {
			rw_bench_tok_t tk = rw_bench_tok(wl.seed, step, me, t);
			rw_bench_put_row((uint16_t *)(void *)(mem + off_tok + t * row), &tk, 1.0f, H);
			for (uint32_t k = 0; k < K; k++)
				wt[(size_t)t * K + k] = rw_bench_w(&tk, k);
		}
		rw_sqe_t s = { .kind = RW_KIND_DISPATCH, .dtype = RW_DTYPE_BF16, .topk = (uint16_t)K,
			       .layer = wl.layer, .phase_id = step * 2, .step = step, .user_data = 1,
			       .token_count = T, .hidden = H, .tokens = { buf, 0, off_tok },
			       .topk_ids = { buf, 0, off_ids }, .topk_weights = { buf, 0, off_w },
			       .output = { buf, 0, off_out }, .output_capacity = out_cap, .n_experts = E,
			       .path = paths[step % n_paths] };
		const int w = rp_stream(&rpp, step);
		const rw_client_rank_dispatch_t rd = {
			.dtype = RW_DTYPE_BF16, .topk = (uint16_t)K, .layer = wl.layer, .step = step,
			.token_count = T, .hidden = H, .n_experts = E, .path = s.path,
			.tokens = base + off_tok, .topk_ids = base + off_ids,
			.topk_weights = base + off_w, .recv_x = base + off_rows,
			.recv_meta = base + off_meta, .recv_counts = base + off_out,
			.recv_cap = (uint32_t)rows_cap };
		CHECK(!gate_file || step != gate_step || gate_wait(gate_file) == 0,
		      "step %llu: no gate %s", (unsigned long long)step, gate_file);
		if (rpp.n_sms) {
			rc = rw_client_rank_set_sms(rpp.rp, rp_sms(&rpp, step));
			CHECK(rc == 0, "--sms: %s", rw_client_rank_message(rpp.rp));
			printf("sms %llu %d\n", (unsigned long long)step, rp_sms(&rpp, step));
		}
		CHECK(!barrier || (rank_path ? rp_empty_pair(&rpp, w, &rd) : empty_pair(cl, &s, step)) == 0,
		      "step %llu: barrier pair failed: %s", (unsigned long long)step,
		      rank_path ? rw_client_rank_message(rpp.rp) : rw_client_last_message(cl));
		CHECK(mirror(&dev, mem, 0, off_out, 1) == 0, "copy up");
		rw_cqe_t cq = { 0 };
		uint64_t kd = 0, t_ds = rw_now_ns(), t_dd;
		if (rank_path) {
			rw_client_rank_done_t done;
			rc = rw_client_rank_dispatch(rpp.rp, &rpp.cs[w], &rd, &kd);
			call_ns[2 * step] = rw_now_ns() - t_ds;
			CHECK(rc == 0, "dispatch: %s: %s", rw_client_strerror(rc), rw_client_rank_message(rpp.rp));
			rc = rp_wait(&rpp, w, kd, &done);
			t_dd = rw_now_ns();
			CHECK(rc == 0, "step %llu dispatch failed: %s (%s)", (unsigned long long)step,
			      rw_client_strerror(rc), rw_client_rank_message(rpp.rp));
			cq.recv_tokens = done.recv_tokens;
			cq.n_experts = E;
			CHECK(mirror(&dev, mem, off_out, cbytes, 0) == 0 &&
			      mirror(&dev, mem, off_rows, (uint64_t)done.recv_tokens * row, 0) == 0 &&
			      mirror(&dev, mem, off_meta, (uint64_t)done.recv_tokens * meta, 0) == 0,
			      "copy down");
		} else {
			rc = rw_client_submit(cl, &s, 1);
			call_ns[2 * step] = rw_now_ns() - t_ds;
			CHECK(rc == 0, "submit dispatch: %s", rw_client_strerror(rc));
			CHECK(wait_one(cl, &cq) == 0, "step %llu: no dispatch completion", (unsigned long long)step);
			t_dd = rw_now_ns();
			CHECK(cq.status == RW_CQ_OK, "step %llu dispatch failed: %s (%s)", (unsigned long long)step,
			      rw_client_strerror(cq.error), rw_client_last_message(cl));
			CHECK(mirror(&dev, mem, off_out, out_cap, 0) == 0, "--cuda: copy down");
		}
		CHECK(cq.recv_tokens == want_rows, "step %llu: received %u rows, expected %u",
		      (unsigned long long)step, cq.recv_tokens, want_rows);
		CHECK(cq.n_experts == E, "n_experts %u, expected %u", cq.n_experts, E);
		const uint32_t *counts = cq.n_inline ? cq.counts
			: (const uint32_t *)(const void *)(mem + (rank_path ? off_out : cq.counts_offset));
		for (uint32_t e = 0; e < E; e++)
			CHECK(counts[e] == want_counts[e], "expert %u: count %u, expected %u", e, counts[e],
			      want_counts[e]);

		/* Every row: from whom, which token, its ids, weights and data; then the expert
		 * compute (sum over my experts of w * factor(e)) into the combine input. */
		const uint8_t *rows = mem + off_rows, *metas = mem + off_meta;
		memset(seen, 0, (size_t)W * T);
		for (uint32_t j = 0; j < cq.recv_tokens; j++) {
			const uint8_t *m = metas + j * meta;
			uint32_t src_node, src_rank, token, bad_h = 0;
			memcpy(&src_node, m, 4);
			memcpy(&src_rank, m + 4, 4);
			memcpy(&token, m + 8, 4);
			CHECK(src_rank < W && src_rank / wl.gpus == src_node && token < T,
			      "row %u: bad source node %u rank %u token %u", j, src_node, src_rank, token);
			CHECK(!seen[(size_t)src_rank * T + token], "rank %u token %u delivered twice",
			      src_rank, token);
			seen[(size_t)src_rank * T + token] = 1;
			const int32_t *id = ids + ((size_t)src_rank * T + token) * K;
			rw_bench_tok_t tk = rw_bench_tok(wl.seed, step, src_rank, token);
			CHECK(memcmp(m + 16, id, 4ull * K) == 0, "rank %u token %u: ids differ", src_rank, token);
			float coef = 0;
			for (uint32_t k = 0; k < K; k++) {
				float wk;
				memcpy(&wk, m + 16 + 4ull * K + 4ull * k, 4);
				CHECK(wk == rw_bench_w(&tk, k), "rank %u token %u: weight %u differs", src_rank,
				      token, k);
				if (id[k] >= 0 && (uint32_t)id[k] / per_rank == me)
					coef += wk * rw_bench_factor(id[k]);
			}
			CHECK(rw_bench_row_equals((const uint16_t *)(const void *)(rows + j * row), &tk, 1.0f, H, &bad_h),
			      "step %llu rank %u token %u: data differs at element %u", (unsigned long long)step,
			      src_rank, token, bad_h);
			CHECK(coef != 0, "rank %u token %u has no expert here", src_rank, token);
			rw_bench_put_row((uint16_t *)(void *)(mem + off_cin + j * row), &tk, coef, H);
		}

		rw_sqe_t cs = { .kind = RW_KIND_COMBINE, .dtype = RW_DTYPE_BF16, .topk = (uint16_t)K,
				.layer = wl.layer, .phase_id = step * 2 + 1, .step = step, .user_data = 2,
				.token_count = cq.recv_tokens, .hidden = H, .n_experts = E,
				.handle_id = cq.handle_id, .tokens = { buf, 0, off_cin },
				.topk_ids = { RW_BUF_NONE, 0, 0 }, .topk_weights = { RW_BUF_NONE, 0, 0 },
				.output = { buf, 0, off_cout }, .output_capacity = (uint64_t)T * row,
				.path = n_cpaths ? cpaths[step % n_cpaths] : s.path };
		CHECK(mirror(&dev, mem, off_cin, (uint64_t)cq.recv_tokens * row, 1) == 0, "copy up");
		uint64_t t_cs = rw_now_ns(), t_cd;
		if (rank_path) {
			const rw_client_rank_combine_t rc_ = { .dispatch = kd, .rows = base + off_cin,
							       .out = base + off_cout };
			uint64_t kc;
			rc = rw_client_rank_combine(rpp.rp, &rpp.cs[w], &rc_, &kc);
			call_ns[2 * step + 1] = rw_now_ns() - t_cs;
			CHECK(rc == 0, "combine: %s: %s", rw_client_strerror(rc), rw_client_rank_message(rpp.rp));
			rc = rp_wait(&rpp, w, kc, NULL);
			t_cd = rw_now_ns();
			CHECK(rc == 0, "step %llu combine failed: %s (%s)", (unsigned long long)step,
			      rw_client_strerror(rc), rw_client_rank_message(rpp.rp));
		} else {
			rc = rw_client_submit(cl, &cs, 1);
			call_ns[2 * step + 1] = rw_now_ns() - t_cs;
			CHECK(rc == 0, "submit combine: %s", rw_client_strerror(rc));
			CHECK(wait_one(cl, &cq) == 0, "step %llu: no combine completion", (unsigned long long)step);
			t_cd = rw_now_ns();
			CHECK(cq.status == RW_CQ_OK, "step %llu combine failed: %s (%s)", (unsigned long long)step,
			      rw_client_strerror(cq.error), rw_client_last_message(cl));
		}
		CHECK(mirror(&dev, mem, off_cout, (uint64_t)T * row, 0) == 0, "copy down");
		for (uint32_t t = 0; t < T; t++) {
			rw_bench_tok_t tk = rw_bench_tok(wl.seed, step, me, t);
			float coef = 0;
			uint32_t bad_h = 0;
			for (uint32_t k = 0; k < K; k++)
				if (my_ids[(size_t)t * K + k] >= 0)
					coef += rw_bench_w(&tk, k) * rw_bench_factor(my_ids[(size_t)t * K + k]);
			CHECK(rw_bench_row_equals((const uint16_t *)(const void *)(mem + off_cout + t * row), &tk, coef, H,
					 &bad_h),
			      "step %llu token %u: combined sum differs at element %u", (unsigned long long)step,
			      t, bad_h);
		}
		printf("pair %llu %llu %llu %llu %llu %u %s\n", (unsigned long long)step,
		       (unsigned long long)t_ds, (unsigned long long)t_dd, (unsigned long long)t_cs,
		       (unsigned long long)t_cd, want_rows, req_name(s.path));
		if (host_ns)
			printf("call %llu %llu %llu %s\n", (unsigned long long)step,
			       (unsigned long long)call_ns[2 * step], (unsigned long long)call_ns[2 * step + 1],
			       rank_path ? prio_names[w] : "-");
		fflush(stdout);
	}
	if (host_ns && steps > 1) { /* step 0 loads and maps: left out */
		uint64_t p[2][2], *v = malloc(steps * sizeof(*v));
		CHECK(v, "out of memory");
		for (int k = 0; k < 2; k++) {
			for (unsigned long i = 1; i < steps; i++)
				v[i - 1] = call_ns[2 * i + k];
			pcts(v, steps - 1, &p[k][0], &p[k][1]);
		}
		free(v);
		printf("rank %u: host ns per call (steps 1..%lu, %s): dispatch p50 %llu p99 %llu, "
		       "combine p50 %llu p99 %llu\n", me, steps - 1,
		       rank_path ? "rw_client_rank_dispatch / _combine" : "rw_client_submit",
		       (unsigned long long)p[0][0], (unsigned long long)p[0][1],
		       (unsigned long long)p[1][0], (unsigned long long)p[1][1]);
	}
	printf("verified rank %u: %lu pairs, %u rows in, %u tokens out each%s\n", me, steps, want_rows, T,
	       cuda ? " (CUDA buffer)" : host_rank ? " (host rank path)" :
	       rank_path ? " (rank path)" : "");
	ok = 1;
out:
	if (rpp.rp)
		rp_close(&rpp);
	rw_client_close(cl);
	if (cuda || rank_path) {
		free(mem);
		if (dev.s)
			rw_cuda_stream_destroy(dev.s);
		if (dev.dptr)
			rw_cuda_mem_free(dev.device, dev.dptr);
		rw_cuda_shutdown();
	}
	rw_synth_free(&gen);
	free(ids);
	free(want_counts);
	free(seen);
	free(call_ns);
	return ok ? 0 : 1;
}
