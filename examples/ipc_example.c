/* A minimal librailwave client: one trainer rank connects to its node's railwaved, registers one
 * host buffer, submits a dispatch and its combine, and waits for both completions.
 *
 *   build/examples/ipc_example [SOCKET] [--rank R] [--world W] [--ranks-per-node G] [--node N]
 *                              [--group NAME] [--experts E] [--tokens T] [--no-verify]
 *
 * Unset options come from the environment a launcher sets: SOCKET ← $RAILWAVE_SOCKET (read by
 * the library; else /run/railwave/railwaved.sock), R ← $RANK, W ← $WORLD_SIZE, G ←
 * $LOCAL_WORLD_SIZE, N ← $RAILWAVE_NODE else R / G; defaults: rank 0 of 1, E = 2·W. Every rank
 * of the group must run it (W processes, W = nodes × gpus_per_node of the cluster file), e.g. on
 * deploy/clusters/loopback-2x2-one-ip.json (docs/python.md "C library"):
 *   for r in 0 1 2 3; do RANK=$r WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 \
 *     RAILWAVE_SOCKET=/tmp/railwave/$( [ $r -lt 2 ] && echo a || echo b ).sock \
 *     build/examples/ipc_example & done; wait
 * Build: ninja build/examples/ipc_example, or against an installed library:
 *   cc examples/ipc_example.c $(pkg-config --cflags --libs railwave)
 * Exit status 0 when both phases complete and the combine returned every token's
 * weighted sum (each expert here returns its input row, so combine = Σ weights × x);
 * --no-verify skips that check (for a test daemon that completes phases without moving data,
 * as tests/ipc/test_server.c runs it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <railwave.h>

#define HIDDEN 128
#define TOPK 2

static long env_long(const char *name, long dflt)
{
	const char *v = getenv(name);
	return v && *v ? strtol(v, NULL, 10) : dflt;
}

int main(int argc, char **argv)
{
	const char *socket_path = NULL, *group = "example";
	long rank = env_long("RANK", 0), world = env_long("WORLD_SIZE", 1);
	long per_node = env_long("LOCAL_WORLD_SIZE", 0), node = env_long("RAILWAVE_NODE", -1);
	long experts = 0, tokens = 32;
	int verify = 1;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (a[0] != '-') {
			socket_path = a;
			continue;
		}
		if (!strcmp(a, "--no-verify")) {
			verify = 0;
			continue;
		}
		if (!v) {
			fprintf(stderr, "%s: %s needs a value\n", argv[0], a);
			return 2;
		}
		i++;
		if (!strcmp(a, "--rank")) rank = strtol(v, NULL, 10);
		else if (!strcmp(a, "--world")) world = strtol(v, NULL, 10);
		else if (!strcmp(a, "--ranks-per-node")) per_node = strtol(v, NULL, 10);
		else if (!strcmp(a, "--node")) node = strtol(v, NULL, 10);
		else if (!strcmp(a, "--group")) group = v;
		else if (!strcmp(a, "--experts")) experts = strtol(v, NULL, 10);
		else if (!strcmp(a, "--tokens")) tokens = strtol(v, NULL, 10);
		else {
			fprintf(stderr, "%s: unknown option %s\n", argv[0], a);
			return 2;
		}
	}
	if (node < 0)
		node = per_node > 0 ? rank / per_node : 0;
	if (!experts)
		experts = 2 * world;
	if (world < 1 || rank < 0 || rank >= world || experts < TOPK || tokens < 0 || tokens > 4096) {
		fprintf(stderr, "%s: need 0 <= rank < world, experts >= %d, 0 <= tokens <= 4096\n",
			argv[0], TOPK);
		return 2;
	}

	rw_client_opts_t opts;
	memset(&opts, 0, sizeof(opts));
	opts.socket_path = socket_path; /* NULL: $RAILWAVE_SOCKET, else the daemon's default */
	opts.group = group;
	opts.rank = (uint32_t)rank;
	opts.world_size = (uint32_t)world;
	opts.node = (uint32_t)node;
	opts.local_gpu = -1;
	rw_client_t *c;
	int rc = rw_client_connect(&opts, &c);
	if (rc) {
		fprintf(stderr, "rank %ld: connect (group %s, world %ld, node %ld): %s\n", rank, group,
			world, node, rw_client_strerror(rc));
		return 1;
	}

	/* One buffer holds everything: fp32 token rows, top-k ids and weights, the dispatch
	 * output (counts, rows, metadata: docs/dataflow.md "Dispatch output") and the combined
	 * rows. The output has room for every token of every rank. */
	const size_t T = (size_t)tokens, row = HIDDEN * 4, meta = 16 + 8 * TOPK;
	const size_t rows = T * row, ids = T * TOPK * 4;
	const size_t out_cap = 4 * (size_t)experts + 16 + (size_t)world * T * (row + meta);
	const size_t out_off = rows + 2 * ids, sum_off = out_off + out_cap;
	uint32_t buf;
	void *mem;
	rc = rw_client_register_host(c, sum_off + rows + 64, &buf, &mem);
	if (rc) {
		fprintf(stderr, "register: %s (%s)\n", rw_client_strerror(rc), rw_client_last_message(c));
		rw_client_close(c);
		return 1;
	}
	float *x = mem;
	int32_t *topk_ids = (int32_t *)((char *)mem + rows);
	float *topk_w = (float *)((char *)mem + rows + ids);
	for (size_t t = 0; t < T; t++) {
		for (size_t h = 0; h < HIDDEN; h++)
			x[t * HIDDEN + h] = (float)(rank * 1000 + (long)t);
		for (size_t k = 0; k < TOPK; k++) { /* two distinct experts, on different ranks */
			topk_ids[t * TOPK + k] = (int32_t)((rank + (long)t + (long)k * (experts / 2)) % experts);
			topk_w[t * TOPK + k] = k ? 0.25f : 0.75f;
		}
	}

	rw_sqe_t d;
	memset(&d, 0, sizeof(d));
	d.kind = RW_KIND_DISPATCH;
	d.dtype = RW_DTYPE_FP32;
	d.topk = TOPK;
	d.phase_id = 1;
	d.token_count = (uint32_t)T;
	d.hidden = HIDDEN;
	d.tokens = (rw_span_t){.buf_id = T ? buf : RW_BUF_NONE, .offset = 0};
	d.topk_ids = (rw_span_t){.buf_id = T ? buf : RW_BUF_NONE, .offset = T ? rows : 0};
	d.topk_weights = (rw_span_t){.buf_id = T ? buf : RW_BUF_NONE, .offset = T ? rows + ids : 0};
	d.output = (rw_span_t){.buf_id = buf, .offset = out_off};
	d.output_capacity = out_cap;
	d.n_experts = (uint32_t)experts; /* the group's experts: a multiple of its world size */
	rw_cqe_t cqe;
	if ((rc = rw_client_submit(c, &d, 1)) || (rc = rw_client_wait(c, &cqe, 1, 30000)) != 1) {
		fprintf(stderr, "dispatch: %s\n", rc ? rw_client_strerror(rc) : "timed out");
		rw_client_close(c);
		return 1;
	}
	printf("rank %ld dispatch: status %u error %s, received %u tokens, handle %u\n", rank,
	       cqe.status, rw_client_strerror(cqe.error), cqe.recv_tokens, cqe.handle_id);
	int ok = cqe.status == RW_CQ_OK;
	uint32_t n = ok ? cqe.recv_tokens : 0;

	/* "Experts": each received row's output is the row times the weights of this rank's
	 * experts in its top-k (the metadata after the rows says which). Written in place. */
	const size_t counts = experts > RW_CQE_INLINE_COUNTS ? ((4 * (size_t)experts + 15) & ~15ul) : 0;
	const size_t cap = (out_cap - counts) / (row + meta);
	char *out = (char *)mem + out_off;
	long per_rank = experts / world;
	for (uint32_t j = 0; j < n; j++) {
		float *r = (float *)(out + counts + j * row);
		const char *m = out + counts + cap * row + j * meta;
		const int32_t *mid = (const int32_t *)(m + 16);
		const float *mw = (const float *)(m + 16 + 4 * TOPK);
		float s = 0;
		for (int k = 0; k < TOPK; k++)
			if (mid[k] >= 0 && mid[k] / per_rank == rank)
				s += mw[k];
		for (size_t h = 0; h < HIDDEN; h++)
			r[h] *= s;
	}

	/* Combine the expert outputs back, using the dispatch's handle. */
	rw_sqe_t m = d;
	m.kind = RW_KIND_COMBINE;
	m.phase_id = 2;
	m.handle_id = cqe.handle_id;
	m.token_count = n;
	m.tokens = (rw_span_t){.buf_id = n ? buf : RW_BUF_NONE, .offset = n ? out_off + counts : 0};
	m.topk_ids = m.topk_weights = (rw_span_t){.buf_id = RW_BUF_NONE};
	m.output = (rw_span_t){.buf_id = T ? buf : RW_BUF_NONE, .offset = T ? sum_off : 0};
	m.output_capacity = T ? rows : 0;
	if (ok && ((rc = rw_client_submit(c, &m, 1)) || (rc = rw_client_wait(c, &cqe, 1, 30000)) != 1)) {
		fprintf(stderr, "combine: %s\n", rc ? rw_client_strerror(rc) : "timed out");
		rw_client_close(c);
		return 1;
	}
	if (ok) {
		printf("rank %ld combine: status %u error %s\n", rank, cqe.status,
		       rw_client_strerror(cqe.error));
		ok = cqe.status == RW_CQ_OK;
	}
	/* Every expert returned its input, so each token comes back as Σ weights × x = x. */
	const float *sum = (const float *)((char *)mem + sum_off);
	for (size_t i = 0; ok && verify && i < T * HIDDEN; i++)
		if (sum[i] != x[i]) {
			fprintf(stderr, "rank %ld: token %zu came back as %g, sent %g\n", rank,
				i / HIDDEN, sum[i], x[i]);
			ok = 0;
		}
	rw_client_close(c);
	return ok ? 0 : 1;
}
