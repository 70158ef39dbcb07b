/* The C side of the Python-overhead benchmark (python/bench/overhead.py, docs/perf/python.md):
 * one rank runs N dispatch+combine pairs through librailwave exactly as the railwave Python
 * package does them — same buffers layout, same sizes, identity "experts" (each received row is
 * combined back as is), same wait policy (busy-poll spin_us, then sleep on the eventfd) — and
 * prints the per-pair time. Not a test.
 *   pair_bench SOCKET --rank R --world W --node N --group NAME --tokens T --hidden H --topk K
 *              --experts E --iters I --spin-us S
 * Output: one line "pairs I p50_us X mean_us Y cpu_us Z" (Z: this process's CPU time per pair,
 * which a loaded machine distorts less than wall time). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/common.h"
#include "ipc/railwave.h"

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static double cpu_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Reap the completion of one submission: spin, then sleep (as railwave.Group._reap). */
static int reap(rw_client_t *c, rw_cqe_t *cqe, double spin_us)
{
	double end = now_us() + spin_us;
	for (;;) {
		int n = rw_client_poll(c, cqe, 1);
		if (n == 0 && now_us() >= end)
			n = rw_client_wait(c, cqe, 1, 1000);
		if (n < 0)
			return n;
		if (n == 1)
			return cqe->status == RW_CQ_OK ? 0 : cqe->error;
	}
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: %s SOCKET [--rank R --world W --node N --group NAME --tokens T "
			"--hidden H --topk K --experts E --iters I --spin-us S]\n", argv[0]);
		return 2;
	}
	long rank = 0, world = 1, node = 0, tokens = 16, hidden = 256, topk = 2, experts = 8;
	long iters = 2000, spin_us = 50;
	const char *group = "bench";
	for (int i = 2; i + 1 < argc; i += 2) {
		const char *a = argv[i];
		long v = strtol(argv[i + 1], NULL, 10);
		if (!strcmp(a, "--rank")) rank = v;
		else if (!strcmp(a, "--world")) world = v;
		else if (!strcmp(a, "--node")) node = v;
		else if (!strcmp(a, "--group")) group = argv[i + 1];
		else if (!strcmp(a, "--tokens")) tokens = v;
		else if (!strcmp(a, "--hidden")) hidden = v;
		else if (!strcmp(a, "--topk")) topk = v;
		else if (!strcmp(a, "--experts")) experts = v;
		else if (!strcmp(a, "--iters")) iters = v;
		else if (!strcmp(a, "--spin-us")) spin_us = v;
		else {
			fprintf(stderr, "unknown option %s\n", a);
			return 2;
		}
	}
	if (tokens < 1 || hidden < 1 || topk < 1 || topk > experts || iters < 1) {
		fprintf(stderr, "bad sizes\n");
		return 2;
	}
	rw_client_opts_t opts = {.socket_path = argv[1], .group = group, .rank = (uint32_t)rank,
				 .world_size = (uint32_t)world, .node = (uint32_t)node,
				 .local_gpu = -1};
	rw_client_t *c;
	int rc = rw_client_connect(&opts, &c);
	if (rc) {
		fprintf(stderr, "connect: %s\n", rw_client_strerror(rc));
		return 1;
	}
	/* The Python package's layout: inputs in one buffer (rows | ids | weights, 16-aligned),
	 * dispatch output and combine output in another. */
	const size_t T = (size_t)tokens, K = (size_t)topk, row = (size_t)hidden * 4;
	const size_t ids_off = (T * row + 15) & ~(size_t)15;
	const size_t w_off = ids_off + ((T * K * 4 + 15) & ~(size_t)15);
	const size_t cap = ((size_t)world * T + 7) & ~(size_t)7;
	const size_t counts = experts > RW_CQE_INLINE_COUNTS ? ((4 * (size_t)experts + 15) & ~15ul) : 0;
	const size_t out_bytes = counts + cap * (row + 16 + 8 * K);
	uint32_t in_id, out_id;
	void *in, *out;
	size_t in_bytes = w_off + T * K * 4 > cap * row ? w_off + T * K * 4 : cap * row;
	if ((rc = rw_client_register_host(c, in_bytes, &in_id, &in)) ||
	    (rc = rw_client_register_host(c, out_bytes, &out_id, &out))) {
		fprintf(stderr, "register: %s\n", rw_client_strerror(rc));
		rw_client_close(c);
		return 1;
	}
	double *pair_us = calloc((size_t)iters, sizeof(double));
	rw_cqe_t cqe;
	double cpu0 = 0;
	for (long it = 0; it < iters + 100 && pair_us; it++) { /* 100 warm-up pairs */
		float *x = in;
		int32_t *ids = (int32_t *)((char *)in + ids_off);
		float *w = (float *)((char *)in + w_off);
		for (size_t t = 0; t < T; t++) {
			for (size_t h = 0; h < (size_t)hidden; h++)
				x[t * hidden + h] = (float)t;
			for (size_t k = 0; k < K; k++) {
				ids[t * K + k] = (int32_t)((t + k * (experts / K) + it) % experts);
				w[t * K + k] = 1.0f;
			}
		}
		if (it == 100)
			cpu0 = cpu_us();
		double t0 = now_us();
		rw_sqe_t d = {.kind = RW_KIND_DISPATCH, .dtype = RW_DTYPE_FP32, .topk = (uint16_t)K,
			      .step = (uint64_t)it, .phase_id = 2 * (uint64_t)it + 1,
			      .token_count = (uint32_t)T, .hidden = (uint32_t)hidden,
			      .tokens = {.buf_id = in_id}, .topk_ids = {.buf_id = in_id, .offset = ids_off},
			      .topk_weights = {.buf_id = in_id, .offset = w_off},
			      .output = {.buf_id = out_id}, .output_capacity = out_bytes,
			      .n_experts = (uint32_t)experts};
		if ((rc = rw_client_submit(c, &d, 1)) || (rc = reap(c, &cqe, (double)spin_us))) {
			fprintf(stderr, "dispatch %ld: %s\n", it, rw_client_strerror(rc));
			break;
		}
		uint32_t n = cqe.recv_tokens;
		memcpy(in, (char *)out + counts, n * row); /* the "experts": identity */
		rw_sqe_t m = {.kind = RW_KIND_COMBINE, .dtype = RW_DTYPE_FP32, .topk = (uint16_t)K,
			      .step = (uint64_t)it, .phase_id = 2 * (uint64_t)it + 2,
			      .token_count = n, .hidden = (uint32_t)hidden, .handle_id = cqe.handle_id,
			      .tokens = {.buf_id = n ? in_id : RW_BUF_NONE},
			      .topk_ids = {.buf_id = RW_BUF_NONE}, .topk_weights = {.buf_id = RW_BUF_NONE},
			      .output = {.buf_id = out_id}, .output_capacity = out_bytes,
			      .n_experts = (uint32_t)experts};
		if ((rc = rw_client_submit(c, &m, 1)) || (rc = reap(c, &cqe, (double)spin_us))) {
			fprintf(stderr, "combine %ld: %s\n", it, rw_client_strerror(rc));
			break;
		}
		if (it >= 100)
			pair_us[it - 100] = now_us() - t0;
	}
	double cpu = (cpu_us() - cpu0) / (double)iters;
	rw_client_close(c);
	if (rc || !pair_us)
		return 1;
	double sum = 0;
	for (long i = 0; i < iters; i++)
		sum += pair_us[i];
	qsort(pair_us, (size_t)iters, sizeof(double), rw_cmp_double);
	printf("pairs %ld p50_us %.2f mean_us %.2f cpu_us %.2f\n", iters, pair_us[iters / 2],
	       sum / iters, cpu);
	free(pair_us);
	return 0;
}
