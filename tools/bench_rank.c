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
 * down after its completion's clock stops (the GPU-path benchmark, docs/perf/gpu-path.md). */
#include <getopt.h>
#include <stdio.h>
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

/* Allocate `total` bytes on the GPU of local rank `gpu` and register them by IPC handle. */
static int dev_register(rw_client_t *cl, uint32_t gpu, uint64_t total, dev_buf_t *d, uint32_t *buf)
{
	if (rw_cuda_init() != RW_OK || rw_cuda_device_count() < 1) {
		fprintf(stderr, "rank %u: --cuda: %s\n", me, rw_cuda_unavailable_reason());
		return -1;
	}
	d->device = (int)(gpu % (uint32_t)rw_cuda_device_count());
	rw_cuda_ipc_desc_t x;
	if (rw_cuda_stream_create(d->device, &d->s) != RW_OK ||
	    rw_cuda_mem_alloc(d->device, total, &d->dptr) != RW_OK ||
	    rw_cuda_ipc_export(d->dptr, total, &x) != RW_OK) {
		fprintf(stderr, "rank %u: --cuda: cannot allocate and export %llu bytes on GPU %d\n", me,
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
	};
	enum { N_OWN = sizeof(own) / sizeof(own[0]) };
	struct option opts[RW_BENCH_WL_NOPTS + N_OWN + 1];
	memcpy(opts, own, sizeof(own));
	memcpy(opts + N_OWN, rw_bench_wl_options, sizeof(struct option) * (RW_BENCH_WL_NOPTS + 1));
	rw_bench_wl_t wl;
	rw_bench_wl_default(&wl);
	const char *sock = NULL, *group = "bench";
	unsigned long steps = 1;
	long rank_arg = -1;
	uint16_t paths[MAX_PATHS] = { RW_PATH_REQ_DAEMON }, cpaths[MAX_PATHS];
	unsigned n_paths = 1, n_cpaths = 0;
	int c, cuda = 0, barrier = 0;
	dev_buf_t dev = { .device = -1 };
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
		case 'h':
			printf("usage: rw_bench_rank --socket PATH --group NAME --rank R --steps S "
			       "[--paths LIST] [--combine-paths LIST] [--barrier] [--cuda] [workload]\n%s",
			       rw_bench_wl_usage);
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
	me = (uint32_t)rank_arg;

	int ok = 0;
	rw_client_t *cl = NULL;
	rw_synth_t gen;
	memset(&gen, 0, sizeof(gen));
	int32_t *ids = NULL;
	uint32_t *want_counts = NULL;
	uint8_t *seen = NULL;
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
	CHECK(ids && want_counts && seen, "out of memory");
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

	rw_client_opts_t o = { .socket_path = sock, .group = group, .rank = me, .world_size = W,
			       .node = me / wl.gpus, .local_gpu = (int32_t)(me % wl.gpus) };
	int rc = rw_client_connect(&o, &cl);
	CHECK(rc == 0, "connect %s: %s", sock, rw_client_strerror(rc));

	/* One buffer: tokens, ids, weights, dispatch output, combine input, combine output. The
	 * dispatch output layout is docs/dataflow.md "Dispatch output": per-expert counts (when they
	 * do not fit the completion), then rows_cap rows, then rows_cap metadata entries. */
	const uint64_t row = (uint64_t)H * 2, meta = 16 + 8ull * K;
	const uint64_t cbytes = E > RW_CQE_INLINE_COUNTS ? ((4ull * E + 15) & ~15ull) : 0;
	const uint64_t rows_cap = (uint64_t)want_rows + 1;
	const uint64_t off_tok = 0, off_ids = off_tok + (uint64_t)T * row,
		       off_w = off_ids + (uint64_t)T * K * 4, off_out = (off_w + (uint64_t)T * K * 4 + 63) & ~63ull,
		       out_cap = cbytes + rows_cap * (row + meta),
		       off_cin = (off_out + out_cap + 63) & ~63ull,
		       off_cout = off_cin + rows_cap * row, total = off_cout + (uint64_t)T * row;
	uint32_t buf;
	uint8_t *mem = NULL;
	if (cuda) {
		mem = calloc(1, total);
		CHECK(mem && dev_register(cl, me % wl.gpus, total, &dev, &buf) == 0, "--cuda: no buffer");
	} else {
		rc = rw_client_register_host(cl, total, &buf, (void **)&mem);
		CHECK(rc == 0, "register %llu bytes: %s", (unsigned long long)total, rw_client_strerror(rc));
	}
	const int32_t *my_ids = ids + (size_t)me * T * K;
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
		CHECK(!barrier || empty_pair(cl, &s, step) == 0, "step %llu: barrier pair failed: %s",
		      (unsigned long long)step, rw_client_last_message(cl));
		CHECK(mirror(&dev, mem, 0, off_out, 1) == 0, "--cuda: copy up");
		uint64_t t_ds = rw_now_ns();
		rc = rw_client_submit(cl, &s, 1);
		CHECK(rc == 0, "submit dispatch: %s", rw_client_strerror(rc));
		rw_cqe_t cq;
		CHECK(wait_one(cl, &cq) == 0, "step %llu: no dispatch completion", (unsigned long long)step);
		uint64_t t_dd = rw_now_ns();
		CHECK(cq.status == RW_CQ_OK, "step %llu dispatch failed: %s (%s)", (unsigned long long)step,
		      rw_client_strerror(cq.error), rw_client_last_message(cl));
		CHECK(mirror(&dev, mem, off_out, out_cap, 0) == 0, "--cuda: copy down");
		CHECK(cq.recv_tokens == want_rows, "step %llu: received %u rows, expected %u",
		      (unsigned long long)step, cq.recv_tokens, want_rows);
		CHECK(cq.n_experts == E, "n_experts %u, expected %u", cq.n_experts, E);
		const uint32_t *counts = cq.n_inline ? cq.counts
			: (const uint32_t *)(const void *)(mem + cq.counts_offset);
		for (uint32_t e = 0; e < E; e++)
			CHECK(counts[e] == want_counts[e], "expert %u: count %u, expected %u", e, counts[e],
			      want_counts[e]);

		/* Every row: from whom, which token, its ids, weights and data; then the expert
		 * compute (sum over my experts of w * factor(e)) into the combine input. */
		const uint8_t *rows = mem + off_out + cbytes, *metas = rows + rows_cap * row;
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
				float w;
				memcpy(&w, m + 16 + 4ull * K + 4ull * k, 4);
				CHECK(w == rw_bench_w(&tk, k), "rank %u token %u: weight %u differs", src_rank,
				      token, k);
				if (id[k] >= 0 && (uint32_t)id[k] / per_rank == me)
					coef += w * rw_bench_factor(id[k]);
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
		CHECK(mirror(&dev, mem, off_cin, (uint64_t)cq.recv_tokens * row, 1) == 0, "--cuda: copy up");
		uint64_t t_cs = rw_now_ns();
		rc = rw_client_submit(cl, &cs, 1);
		CHECK(rc == 0, "submit combine: %s", rw_client_strerror(rc));
		CHECK(wait_one(cl, &cq) == 0, "step %llu: no combine completion", (unsigned long long)step);
		uint64_t t_cd = rw_now_ns();
		CHECK(cq.status == RW_CQ_OK, "step %llu combine failed: %s (%s)", (unsigned long long)step,
		      rw_client_strerror(cq.error), rw_client_last_message(cl));
		CHECK(mirror(&dev, mem, off_cout, (uint64_t)T * row, 0) == 0, "--cuda: copy down");
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
		fflush(stdout);
	}
	printf("verified rank %u: %lu pairs, %u rows in, %u tokens out each%s\n", me, steps, want_rows, T,
	       cuda ? " (CUDA buffer)" : "");
	ok = 1;
out:
	rw_client_close(cl);
	if (cuda) {
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
	return ok ? 0 : 1;
}
