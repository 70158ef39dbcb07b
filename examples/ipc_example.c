/* A minimal librailwave client: connect to railwaved, register one host buffer, submit a
 * dispatch and its combine, wait for both completions. Build: ninja build/examples/ipc_example;
 * run: build/examples/ipc_example [socket path] (default $RAILWAVE_SOCKET or the daemon's path).
 * Exit status 0 when both phases complete. */
#include <stdio.h>
#include <string.h>

#include "ipc/railwave.h"

#define TOKENS 32
#define HIDDEN 128
#define TOPK 4
#define EXPERTS 8

int main(int argc, char **argv)
{
	rw_client_opts_t opts;
	memset(&opts, 0, sizeof(opts));
	opts.socket_path = argc > 1 ? argv[1] : NULL;
	opts.group = "example";
	opts.rank = 0;
	opts.world_size = 1;
	opts.node = 0;
	opts.local_gpu = -1;

	rw_client_t *c;
	int rc = rw_client_connect(&opts, &c);
	if (rc) {
		fprintf(stderr, "connect: %s\n", rw_client_strerror(rc));
		return 1;
	}

	/* One buffer holds everything: token rows, top-k ids and weights, and the output. */
	const size_t rows = (size_t)TOKENS * HIDDEN * 2; /* bf16 */
	const size_t ids = (size_t)TOKENS * TOPK * 4;
	const size_t size = 4 * rows;
	uint32_t buf;
	void *mem;
	rc = rw_client_register_host(c, size, &buf, &mem);
	if (rc) {
		fprintf(stderr, "register: %s (%s)\n", rw_client_strerror(rc), rw_client_last_message(c));
		rw_client_close(c);
		return 1;
	}
	memset(mem, 0x3f, rows); /* the trainer's tokens */

	rw_sqe_t d;
	memset(&d, 0, sizeof(d));
	d.kind = RW_KIND_DISPATCH;
	d.dtype = RW_DTYPE_BF16;
	d.topk = TOPK;
	d.layer = 0;
	d.phase_id = 1;
	d.step = 0;
	d.token_count = TOKENS;
	d.hidden = HIDDEN;
	d.tokens = (rw_span_t){.buf_id = buf, .offset = 0};
	d.topk_ids = (rw_span_t){.buf_id = buf, .offset = rows};
	d.topk_weights = (rw_span_t){.buf_id = buf, .offset = rows + ids};
	d.output = (rw_span_t){.buf_id = buf, .offset = 2 * rows};
	d.output_capacity = 2 * rows;
	d.n_experts = EXPERTS; /* the group's experts: a multiple of its world size */
	rw_cqe_t cqe;
	if ((rc = rw_client_submit(c, &d, 1)) || (rc = rw_client_wait(c, &cqe, 1, 10000)) != 1) {
		fprintf(stderr, "dispatch: %s\n", rc ? rw_client_strerror(rc) : "timed out");
		rw_client_close(c);
		return 1;
	}
	printf("dispatch: status %u error %s, received %u tokens, handle %u\n", cqe.status,
	       rw_client_strerror(cqe.error), cqe.recv_tokens, cqe.handle_id);
	int ok = cqe.status == RW_CQ_OK;

	/* Combine the expert outputs back, using the dispatch's handle. */
	rw_sqe_t m = d;
	m.kind = RW_KIND_COMBINE;
	m.phase_id = 2;
	m.handle_id = cqe.handle_id;
	m.token_count = cqe.recv_tokens ? cqe.recv_tokens : TOKENS;
	m.tokens = d.output;
	m.output = (rw_span_t){.buf_id = buf, .offset = 0};
	m.output_capacity = rows;
	if ((rc = rw_client_submit(c, &m, 1)) || (rc = rw_client_wait(c, &cqe, 1, 10000)) != 1) {
		fprintf(stderr, "combine: %s\n", rc ? rw_client_strerror(rc) : "timed out");
		rw_client_close(c);
		return 1;
	}
	printf("combine: status %u error %s\n", cqe.status, rw_client_strerror(cqe.error));
	ok = ok && cqe.status == RW_CQ_OK;
	rw_client_close(c);
	return ok ? 0 : 1;
}
