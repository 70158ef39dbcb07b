/* Round-trip latency of the IPC per-phase path: submit → daemon observes → completion → client
 * wakes, against a Unix-socket ping-pong measured in the same run (the baseline the rings must
 * beat). The daemon is a real rw_ipc_server_t on a libev loop in a forked process whose service
 * completes every submission at once. Results and the exact command: docs/perf/ipc.md.
 *   ipc_bench [-n ROUND_TRIPS]        (default 100000)
 *   ipc_bench --serve PATH            run the echo daemon in the foreground (for the example) */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ev.h>

#include "common/common.h"
#include "ipc/ipc.h"
#include "ipc/railwave.h"

static rw_ipc_server_t *echo_server;

static void echo_submission(void *ctx, rw_ipc_client_t *c, const rw_sqe_t *sqe)
{
	(void)ctx;
	rw_cqe_t cqe;
	memset(&cqe, 0, sizeof(cqe));
	cqe.status = RW_CQ_OK;
	cqe.kind = sqe->kind;
	cqe.phase_id = sqe->phase_id;
	cqe.user_data = sqe->user_data;
	cqe.recv_tokens = sqe->token_count;
	cqe.handle_id = sqe->kind == RW_KIND_DISPATCH ? 1 : 0;
	cqe.counts_buf = RW_BUF_NONE;
	rw_ipc_complete(echo_server, c, &cqe);
}

static void stop_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
	(void)w;
	(void)revents;
	ev_break(loop, EVBREAK_ALL);
}

/* Run an echo daemon until SIGTERM/SIGINT; writes one byte to ready_fd once listening. */
static int serve(const char *path, uint32_t busy_poll_us, int ready_fd)
{
	struct ev_loop *loop = ev_default_loop(0);
	rw_ipc_server_config_t cfg = {.socket_path = path, .node = -1, .busy_poll_us = busy_poll_us};
	rw_ipc_server_ops_t ops = {.submission = echo_submission};
	if (rw_ipc_server_create(loop, &cfg, &ops, NULL, &echo_server) != RW_OK)
		return 1;
	ev_signal term, intr;
	ev_signal_init(&term, stop_cb, SIGTERM);
	ev_signal_init(&intr, stop_cb, SIGINT);
	ev_signal_start(loop, &term);
	ev_signal_start(loop, &intr);
	if (ready_fd >= 0) {
		char x = 'r';
		if (write(ready_fd, &x, 1) != 1)
			return 1;
		close(ready_fd);
	}
	ev_run(loop, 0);
	rw_ipc_server_destroy(echo_server);
	return 0;
}

static pid_t spawn_daemon(const char *path, uint32_t busy_poll_us)
{
	int ready[2];
	if (pipe(ready) < 0)
		return -1;
	pid_t pid = fork();
	if (pid == 0) {
		close(ready[0]);
		_exit(serve(path, busy_poll_us, ready[1]));
	}
	close(ready[1]);
	char x;
	if (pid < 0 || read(ready[0], &x, 1) != 1) {
		close(ready[0]);
		return -1;
	}
	close(ready[0]);
	return pid;
}

static void stop_daemon(pid_t pid)
{
	int status;
	kill(pid, SIGTERM);
	waitpid(pid, &status, 0);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

typedef struct result {
	const char *name;
	double p50_us, p99_us;
} result_t;

static void summarize(result_t *r, const char *name, uint64_t *lat, unsigned n)
{
	qsort(lat, n, sizeof(*lat), cmp_u64);
	r->name = name;
	r->p50_us = (double)lat[n / 2] / 1000.0;
	r->p99_us = (double)lat[(size_t)n * 99 / 100] / 1000.0;
}

/* Baseline: 128-byte request/reply over a SOCK_SEQPACKET socketpair, both sides blocking. */
static int socket_pingpong(unsigned warmup, unsigned n, uint64_t *lat)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		return -1;
	pid_t pid = fork();
	if (pid == 0) {
		close(sv[0]);
		char buf[128];
		for (;;) {
			ssize_t k = recv(sv[1], buf, sizeof(buf), 0);
			if (k <= 0 || send(sv[1], buf, (size_t)k, MSG_NOSIGNAL) != k)
				_exit(0);
		}
	}
	close(sv[1]);
	char msg[128];
	memset(msg, 1, sizeof(msg));
	for (unsigned i = 0; i < warmup + n; i++) {
		uint64_t t0 = rw_now_ns();
		if (send(sv[0], msg, sizeof(msg), 0) != sizeof(msg) ||
		    recv(sv[0], msg, sizeof(msg), 0) != sizeof(msg))
			return -1;
		if (i >= warmup)
			lat[i - warmup] = rw_now_ns() - t0;
	}
	close(sv[0]);
	int status;
	waitpid(pid, &status, 0);
	return 0;
}

/* Rings: submit one dispatch, reap its completion (busy-poll or eventfd sleep). */
static int ring_round_trips(const char *path, int busy, unsigned warmup, unsigned n, uint64_t *lat)
{
	rw_client_opts_t o = {.socket_path = path, .group = "bench", .world_size = 1,
			      .local_gpu = -1, .sq_entries = 64};
	rw_client_t *c;
	int rc = rw_client_connect(&o, &c);
	if (rc) {
		fprintf(stderr, "connect: %s\n", rw_client_strerror(rc));
		return -1;
	}
	uint32_t buf;
	void *mem;
	if ((rc = rw_client_register_host(c, 1 << 20, &buf, &mem))) {
		fprintf(stderr, "register: %s\n", rw_client_strerror(rc));
		rw_client_close(c);
		return -1;
	}
	rw_sqe_t e;
	memset(&e, 0, sizeof(e));
	e.kind = RW_KIND_DISPATCH;
	e.dtype = RW_DTYPE_BF16;
	e.topk = 8;
	e.token_count = 128;
	e.hidden = 1024;
	e.tokens = (rw_span_t){.buf_id = buf, .offset = 0};
	e.topk_ids = (rw_span_t){.buf_id = buf, .offset = 262144};
	e.topk_weights = (rw_span_t){.buf_id = buf, .offset = 266240};
	e.output = (rw_span_t){.buf_id = buf, .offset = 524288};
	e.output_capacity = 262144;
	e.n_experts = 64;
	for (unsigned i = 0; i < warmup + n; i++) {
		e.phase_id = i;
		rw_cqe_t cqe;
		uint64_t t0 = rw_now_ns();
		if ((rc = rw_client_submit(c, &e, 1)))
			break;
		do
			rc = busy ? rw_client_poll(c, &cqe, 1) : rw_client_wait(c, &cqe, 1, 5000);
		while (rc == 0 && busy);
		if (rc != 1 || cqe.status != RW_CQ_OK || cqe.phase_id != i) {
			fprintf(stderr, "round trip %u: %s\n", i,
				rc < 0 ? rw_client_strerror(rc) : rc == 0 ? "timed out" : "bad completion");
			rw_client_close(c);
			return -1;
		}
		if (i >= warmup)
			lat[i - warmup] = rw_now_ns() - t0;
	}
	rw_client_close(c);
	return rc < 0 ? -1 : 0;
}

int main(int argc, char **argv)
{
	unsigned n = 100000;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "-n") == 0 && i + 1 < argc)
			n = (unsigned)strtoul(argv[++i], NULL, 10);
		else if (strcmp(argv[i], "--serve") == 0 && i + 1 < argc)
			return serve(argv[++i], 0, -1);
		else {
			fprintf(stderr, "usage: %s [-n ROUND_TRIPS] | --serve PATH\n", argv[0]);
			return 2;
		}
	}
	if (n < 100)
		n = 100;
	rw_log_set_level(RW_LOG_WARN);
	signal(SIGPIPE, SIG_IGN);
	unsigned warmup = n / 10;
	uint64_t *lat = malloc(sizeof(*lat) * n);
	char dir[] = "/tmp/rw-ipc-bench.XXXXXX";
	if (!lat || !mkdtemp(dir))
		return 1;
	char path[96];
	snprintf(path, sizeof(path), "%s/rw.sock", dir);

	result_t res[4];
	int nres = 0;
	if (socket_pingpong(warmup, n, lat) < 0)
		return 1;
	summarize(&res[nres++], "unix socket ping-pong (baseline)", lat, n);

	/* Daemon busy-polls its submission rings, client busy-polls its completion ring. */
	pid_t d = spawn_daemon(path, 1000000);
	if (d < 0 || ring_round_trips(path, 1, warmup, n, lat) < 0)
		return 1;
	stop_daemon(d);
	summarize(&res[nres++], "rings, busy-poll both sides", lat, n);

	/* Daemon sleeps on the submission eventfd, client busy-polls. */
	d = spawn_daemon(path, 0);
	if (d < 0 || ring_round_trips(path, 1, warmup, n, lat) < 0)
		return 1;
	summarize(&res[nres++], "rings, daemon eventfd, client poll", lat, n);

	/* Both sleep on eventfds (armed wake-ups each way). */
	if (ring_round_trips(path, 0, warmup, n, lat) < 0)
		return 1;
	stop_daemon(d);
	summarize(&res[nres++], "rings, eventfd both sides", lat, n);
	rmdir(dir);

	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	printf("ipc_bench: %u round trips per mode (after %u warm-up), %ld online CPUs\n", n, warmup,
	       cpus);
	printf("%-38s %10s %10s %14s\n", "mode", "p50 (us)", "p99 (us)", "socket/p50");
	for (int i = 0; i < nres; i++)
		printf("%-38s %10.2f %10.2f %13.1fx\n", res[i].name, res[i].p50_us, res[i].p99_us,
		       res[0].p50_us / res[i].p50_us);
	free(lat);
	return 0;
}
