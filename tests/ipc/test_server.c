/* ipc/ against a real server on a real socket: the server runs on its libev loop in a second
 * thread of this process (one case runs it in a forked process); clients are librailwave or a
 * raw socket speaking ipc/proto.h directly, so every bad input the daemon must reject can be
 * sent. Each case checks the specific error code, that the offender is (or is not) dropped, that
 * other clients are unaffected, and that fds and buffers return to their baseline. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <dlfcn.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <ev.h>

#include "common/common.h"
#include "common/fdpass.h"
#include "config.h"
#include "cuda/rw_cuda.h"
#include "ipc/ipc.h"
#include "ipc/page.h"
#include "ipc/proto.h"
#include "ipc/railwave.h"
#include "ipc/ring.h"

/* ---------------------------------------------------------------------------------------------
 * Harness: a server in a loop thread, calls into it through an ev_async
 * ------------------------------------------------------------------------------------------- */

typedef struct harness harness_t;
typedef void (*call_fn)(harness_t *h, void *arg);

struct harness {
	char dir[64];
	char path[96];
	struct ev_loop *loop;
	rw_ipc_server_t *srv;
	pthread_t thread;
	ev_async wake;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	call_fn fn;
	void *arg;
	int pending;
	int stop;
	/* Service state: touched only on the loop thread (read it through h_call). */
	int echo;           /* complete every submission at once */
	int drop_in_submit; /* drop the client from inside its submission callback */
	int left_hook;      /* in client_left: complete and drop every other client's held work */
	int joined, left;
	rw_ipc_leave_t last_reason;
	int last_error;
	uint64_t submissions;
	rw_ipc_client_t *last_client;
	rw_sqe_t last_sqe;
	int registered;
	rw_ipc_buffer_t last_buf;
	unsigned page_moves;   /* page_word reports */
	unsigned page_last_word;
	uint64_t page_last_value[RW_PW_COUNT];
	rw_ipc_client_t *held_client[256];
	rw_sqe_t held_sqe[256];
	unsigned nheld;
};

static harness_t H;

static void echo_complete(harness_t *h, rw_ipc_client_t *c, const rw_sqe_t *sqe);

static void on_joined(void *ctx, rw_ipc_client_t *c)
{
	harness_t *h = ctx;
	h->joined++;
	h->last_client = c;
}

static void on_left(void *ctx, rw_ipc_client_t *c, rw_ipc_leave_t reason, int error)
{
	harness_t *h = ctx;
	h->left++;
	h->last_reason = reason;
	h->last_error = error;
	/* Forget the client's held submissions: its pointer dies after this returns. */
	unsigned k = 0;
	for (unsigned i = 0; i < h->nheld; i++)
		if (h->held_client[i] != c) {
			h->held_client[k] = h->held_client[i];
			h->held_sqe[k++] = h->held_sqe[i];
		}
	h->nheld = k;
	if (h->last_client == c)
		h->last_client = NULL;
	if (h->left_hook) {
		h->left_hook = 0;
		for (unsigned i = 0; i < h->nheld; i++) {
			echo_complete(h, h->held_client[i], &h->held_sqe[i]);
			rw_ipc_client_drop(h->srv, h->held_client[i], RW_E_PHASE);
		}
		h->nheld = 0;
	}
}

static void echo_complete(harness_t *h, rw_ipc_client_t *c, const rw_sqe_t *sqe)
{
	rw_cqe_t cqe;
	memset(&cqe, 0, sizeof(cqe));
	cqe.status = RW_CQ_OK;
	cqe.kind = sqe->kind;
	cqe.phase_id = sqe->phase_id;
	cqe.user_data = sqe->user_data;
	cqe.recv_tokens = sqe->token_count;
	cqe.handle_id = sqe->kind == RW_KIND_DISPATCH ? (uint32_t)sqe->phase_id + 1 : 0;
	cqe.counts_buf = RW_BUF_NONE;
	cqe.n_inline = 2;
	cqe.counts[0] = sqe->token_count;
	cqe.counts[1] = sqe->topk;
	assert_int_equal(rw_ipc_complete(h->srv, c, &cqe), RW_OK);
}

static void on_submission(void *ctx, rw_ipc_client_t *c, const rw_sqe_t *sqe)
{
	harness_t *h = ctx;
	h->submissions++;
	h->last_client = c;
	h->last_sqe = *sqe;
	if (h->drop_in_submit) {
		rw_ipc_client_drop(h->srv, c, RW_E_PHASE);
		return;
	}
	if (h->echo) {
		echo_complete(h, c, sqe);
		return;
	}
	assert_true(h->nheld < 256);
	h->held_client[h->nheld] = c;
	h->held_sqe[h->nheld++] = *sqe;
}

static void on_registered(void *ctx, rw_ipc_client_t *c, const rw_ipc_buffer_t *buf)
{
	harness_t *h = ctx;
	(void)c;
	h->registered++;
	h->last_buf = *buf;
}

static void on_page_word(void *ctx, rw_ipc_client_t *c, unsigned word, uint64_t value)
{
	harness_t *h = ctx;
	(void)c;
	h->page_moves++;
	h->page_last_word = word;
	h->page_last_value[word] = value;
}

static const rw_ipc_server_ops_t ops = {
	.client_joined = on_joined,
	.client_left = on_left,
	.submission = on_submission,
	.buffer_registered = on_registered,
	.page_word = on_page_word,
};

static void async_cb(struct ev_loop *loop, ev_async *w, int revents)
{
	(void)revents;
	harness_t *h = w->data;
	pthread_mutex_lock(&h->mu);
	if (h->pending) {
		h->fn(h, h->arg);
		h->pending = 0;
		pthread_cond_broadcast(&h->cv);
	}
	if (h->stop)
		ev_break(loop, EVBREAK_ALL);
	pthread_mutex_unlock(&h->mu);
}

static void *loop_thread(void *arg)
{
	harness_t *h = arg;
	ev_run(h->loop, 0);
	return NULL;
}

/* Run fn(h, arg) on the loop thread and wait for it. */
static void h_call(harness_t *h, call_fn fn, void *arg)
{
	pthread_mutex_lock(&h->mu);
	h->fn = fn;
	h->arg = arg;
	h->pending = 1;
	ev_async_send(h->loop, &h->wake);
	while (h->pending)
		pthread_cond_wait(&h->cv, &h->mu);
	pthread_mutex_unlock(&h->mu);
}

static void base_config(rw_ipc_server_config_t *cfg, const char *path)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->socket_path = path;
	cfg->node = -1;
	cfg->max_buffers = 4;
	cfg->max_tokens = 4096;
	cfg->max_hidden = 8192;
	cfg->max_topk = 16;
	cfg->max_ring_entries = 1024;
	cfg->max_world = 1024;
	cfg->max_local_gpu = 8;
}

static void h_start_cfg(harness_t *h, const rw_ipc_server_config_t *over)
{
	memset(h, 0, sizeof(*h));
	snprintf(h->dir, sizeof(h->dir), "/tmp/rw-ipc-test.XXXXXX");
	assert_non_null(mkdtemp(h->dir));
	snprintf(h->path, sizeof(h->path), "%s/rw.sock", h->dir);
	h->loop = ev_loop_new(EVFLAG_AUTO);
	assert_non_null(h->loop);
	rw_ipc_server_config_t cfg;
	base_config(&cfg, h->path);
	if (over) {
		cfg = *over;
		cfg.socket_path = h->path;
	}
	h->echo = 1;
	assert_int_equal(rw_ipc_server_create(h->loop, &cfg, &ops, h, &h->srv), RW_OK);
	pthread_mutex_init(&h->mu, NULL);
	pthread_cond_init(&h->cv, NULL);
	ev_async_init(&h->wake, async_cb);
	h->wake.data = h;
	ev_async_start(h->loop, &h->wake);
	assert_int_equal(pthread_create(&h->thread, NULL, loop_thread, h), 0);
}

static void h_start(harness_t *h) { h_start_cfg(h, NULL); }

static void noop(harness_t *h, void *arg) { (void)h; (void)arg; }

static void h_stop(harness_t *h)
{
	pthread_mutex_lock(&h->mu);
	h->stop = 1;
	pthread_mutex_unlock(&h->mu);
	h_call(h, noop, NULL);
	pthread_join(h->thread, NULL);
	rw_ipc_server_destroy(h->srv);
	ev_async_stop(h->loop, &h->wake);
	ev_loop_destroy(h->loop);
	pthread_mutex_destroy(&h->mu);
	pthread_cond_destroy(&h->cv);
	rmdir(h->dir);
}

static void get_stats(harness_t *h, void *arg) { rw_ipc_server_stats(h->srv, arg); }

static rw_ipc_server_stats_t h_stats(harness_t *h)
{
	rw_ipc_server_stats_t st;
	h_call(h, get_stats, &st);
	return st;
}

typedef struct snapshot {
	int joined, left, registered;
	rw_ipc_leave_t last_reason;
	int last_error;
	uint64_t submissions;
	unsigned nheld;
} snapshot_t;

static void get_snapshot(harness_t *h, void *arg)
{
	snapshot_t *s = arg;
	s->joined = h->joined;
	s->left = h->left;
	s->registered = h->registered;
	s->last_reason = h->last_reason;
	s->last_error = h->last_error;
	s->submissions = h->submissions;
	s->nheld = h->nheld;
}

static snapshot_t h_snap(harness_t *h)
{
	snapshot_t s;
	h_call(h, get_snapshot, &s);
	return s;
}

/* Wait (liveness bound, not a timing assertion) until the server has `clients` connections. */
static void h_wait_clients(harness_t *h, uint32_t clients)
{
	for (int i = 0; i < 10000; i++) {
		if (h_stats(h).clients == clients)
			return;
		usleep(1000);
	}
	fail_msg("server never reached %u clients", clients);
}

static int count_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	assert_non_null(d);
	int n = 0;
	while (readdir(d))
		n++;
	closedir(d);
	return n;
}

/* The daemon closes the descriptors clients pass on a thread of its own (ipc/server_close.c):
 * the count comes back to `base` once that thread got to them (a bound, not a timing). */
static int fds_back_to(int base)
{
	int n = count_fds();
	for (int i = 0; i < 10000 && n != base; i++) {
		usleep(1000);
		n = count_fds();
	}
	return n;
}

/* ---------------------------------------------------------------------------------------------
 * Raw protocol client
 * ------------------------------------------------------------------------------------------- */

static int raw_connect(const char *path)
{
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	assert_true(fd >= 0);
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
	assert_int_equal(connect(fd, (struct sockaddr *)&addr, sizeof(addr)), 0);
	return fd;
}

static void raw_send(int fd, const void *msg, size_t len, const int *fds, unsigned nfds)
{
	assert_int_equal(rw_fdpass_send(fd, msg, len, fds, nfds, MSG_NOSIGNAL), (ssize_t)len);
}

/* Receive one reply (5 s liveness bound). Returns its length, 0 at EOF. */
static int raw_recv(int fd, rw_ipc_msg_t *msg, int *fds, unsigned *nfds_p)
{
	struct pollfd pfd = {.fd = fd, .events = POLLIN};
	assert_int_equal(poll(&pfd, 1, 5000), 1);
	char cbuf[CMSG_SPACE(sizeof(int) * 8)];
	struct iovec iov = {.iov_base = msg, .iov_len = sizeof(*msg)};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			    .msg_controllen = sizeof(cbuf)};
	ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	if (n < 0 && errno == ECONNRESET) /* reported once, before any queued message */
		n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	if (n < 0 && (errno == ECONNRESET || errno == EAGAIN))
		n = 0;
	assert_true(n >= 0);
	unsigned nfds = 0;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
		size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k; i++) {
			int f;
			memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
			if (fds)
				fds[nfds] = f;
			else
				close(f);
			nfds++;
		}
	}
	if (nfds_p)
		*nfds_p = nfds;
	return (int)n;
}

static void hdr(rw_ipc_hdr_t *h, uint16_t type, uint32_t seq)
{
	memset(h, 0, sizeof(*h));
	h->magic = RW_IPC_MAGIC;
	h->version = RW_IPC_VERSION;
	h->type = type;
	h->seq = seq;
}

static rw_ipc_hello_t make_hello(const char *group, uint32_t rank, uint32_t world, uint32_t node,
				 int32_t gpu)
{
	rw_ipc_hello_t m;
	memset(&m, 0, sizeof(m));
	hdr(&m.hdr, RW_IPC_HELLO, 1);
	snprintf(m.group, sizeof(m.group), "%s", group);
	m.rank = rank;
	m.world_size = world;
	m.node = node;
	m.local_gpu = gpu;
	return m;
}

/* Expect an ERROR reply with `code`; if fatal, the connection must then be closed. */
static void expect_error(int fd, int code, int fatal)
{
	rw_ipc_msg_t msg;
	int n = raw_recv(fd, &msg, NULL, NULL);
	assert_int_equal(n, sizeof(rw_ipc_error_t));
	assert_int_equal(msg.hdr.type, RW_IPC_ERROR);
	if (msg.error.code != code)
		fail_msg("expected %s, got %s (%s)", rw_client_strerror(code),
			 rw_client_strerror(msg.error.code), msg.error.message);
	assert_int_equal(msg.error.fatal, fatal);
	assert_true(strlen(msg.error.message) > 0);
	if (fatal)
		assert_int_equal(raw_recv(fd, &msg, NULL, NULL), 0);
}

static void expect_reply(int fd, uint16_t type, rw_ipc_msg_t *msg)
{
	int n = raw_recv(fd, msg, NULL, NULL);
	assert_true(n >= (int)sizeof(rw_ipc_hdr_t));
	if (msg->hdr.type == RW_IPC_ERROR)
		fail_msg("unexpected error %s: %s", rw_client_strerror(msg->error.code),
			 msg->error.message);
	assert_int_equal(msg->hdr.type, type);
}

static int raw_joined(const char *path, const char *group, uint32_t rank)
{
	int fd = raw_connect(path);
	rw_ipc_hello_t m = make_hello(group, rank, 8, 0, -1);
	raw_send(fd, &m, sizeof(m), NULL, 0);
	rw_ipc_msg_t reply;
	expect_reply(fd, RW_IPC_HELLO_OK, &reply);
	return fd;
}

static int sealed_memfd(size_t size, int seals)
{
	int fd = memfd_create("test-buf", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, (off_t)size), 0);
	if (seals)
		assert_int_equal(fcntl(fd, F_ADD_SEALS, seals), 0);
	return fd;
}

static void send_reg_host(int fd, uint64_t size, int memfd)
{
	rw_ipc_reg_host_t m;
	memset(&m, 0, sizeof(m));
	hdr(&m.hdr, RW_IPC_REG_HOST, 2);
	m.size = size;
	raw_send(fd, &m, sizeof(m), memfd >= 0 ? &memfd : NULL, memfd >= 0 ? 1 : 0);
}

static uint32_t raw_reg_host(int fd, uint64_t size)
{
	int memfd = sealed_memfd(size, F_SEAL_SHRINK);
	send_reg_host(fd, size, memfd);
	close(memfd);
	rw_ipc_msg_t reply;
	expect_reply(fd, RW_IPC_REG_OK, &reply);
	return reply.reg_ok.buf_id;
}

typedef struct raw_rings {
	void *map;
	size_t bytes;
	int sq_efd, cq_efd;
	rw_ring_t sq, cq;
} raw_rings_t;

static void raw_ring_setup(int fd, uint32_t sq, uint32_t cq, raw_rings_t *r)
{
	rw_ipc_ring_setup_t m;
	memset(&m, 0, sizeof(m));
	hdr(&m.hdr, RW_IPC_RING_SETUP, 3);
	m.sq_entries = sq;
	m.cq_entries = cq;
	raw_send(fd, &m, sizeof(m), NULL, 0);
	rw_ipc_msg_t reply;
	int fds[8];
	unsigned nfds;
	assert_int_equal(raw_recv(fd, &reply, fds, &nfds), sizeof(rw_ipc_ring_ok_t));
	assert_int_equal(reply.hdr.type, RW_IPC_RING_OK);
	assert_int_equal(nfds, 3);
	r->bytes = reply.ring_ok.map_bytes;
	r->map = mmap(NULL, r->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	assert_true(r->map != MAP_FAILED);
	/* The daemon sealed the ring memfd: the client cannot shrink it under the daemon. */
	assert_int_equal(ftruncate(fds[0], 0), -1);
	close(fds[0]);
	r->sq_efd = fds[1];
	r->cq_efd = fds[2];
	uint8_t *b = r->map;
	rw_ring_init(&r->sq, (rw_ring_ctl_t *)(b + reply.ring_ok.sq_ctl_off),
		     b + reply.ring_ok.sq_slots_off, sq, sizeof(rw_sqe_t), r->sq_efd, 1);
	rw_ring_init(&r->cq, (rw_ring_ctl_t *)(b + reply.ring_ok.cq_ctl_off),
		     b + reply.ring_ok.cq_slots_off, cq, sizeof(rw_cqe_t), -1, 0);
}

static void raw_rings_free(raw_rings_t *r)
{
	munmap(r->map, r->bytes);
	close(r->sq_efd);
	close(r->cq_efd);
}

/* ---------------------------------------------------------------------------------------------
 * librailwave helpers
 * ------------------------------------------------------------------------------------------- */

static rw_client_opts_t opts_for(const char *group, uint32_t rank)
{
	rw_client_opts_t o;
	memset(&o, 0, sizeof(o));
	o.socket_path = H.path;
	o.group = group;
	o.rank = rank;
	o.world_size = 8;
	o.node = 0;
	o.local_gpu = -1;
	o.sq_entries = 16;
	o.timeout_ms = 5000;
	return o;
}

static rw_client_t *connect_rank(const char *group, uint32_t rank)
{
	rw_client_opts_t o = opts_for(group, rank);
	rw_client_t *c = NULL;
	int rc = rw_client_connect(&o, &c);
	if (rc)
		fail_msg("connect: %s", rw_client_strerror(rc));
	return c;
}

/* A valid dispatch over one 64 KiB buffer: 16 tokens × 64 bf16, topk 2. */
static rw_sqe_t valid_sqe(uint32_t buf, uint64_t phase)
{
	rw_sqe_t e;
	memset(&e, 0, sizeof(e));
	e.kind = RW_KIND_DISPATCH;
	e.dtype = RW_DTYPE_BF16;
	e.topk = 2;
	e.layer = 3;
	e.phase_id = phase;
	e.step = 7;
	e.user_data = phase * 10;
	e.token_count = 16;
	e.hidden = 64;
	e.tokens = (rw_span_t){.buf_id = buf, .offset = 0};
	e.topk_ids = (rw_span_t){.buf_id = buf, .offset = 4096};
	e.topk_weights = (rw_span_t){.buf_id = buf, .offset = 8192};
	e.output = (rw_span_t){.buf_id = buf, .offset = 16384};
	e.output_capacity = 4096;
	e.n_experts = 8;
	return e;
}

static rw_cqe_t wait_one(rw_client_t *c)
{
	rw_cqe_t cqe;
	int n = rw_client_wait(c, &cqe, 1, 5000);
	if (n != 1)
		fail_msg("wait: %d (%s)", n, n < 0 ? rw_client_strerror(n) : "timeout");
	return cqe;
}

/* ---------------------------------------------------------------------------------------------
 * Cases: lifecycle
 * ------------------------------------------------------------------------------------------- */

static void test_socket_mode_and_group(void **state)
{
	(void)state;
	/* The group option chowns the socket: use our own primary group (always allowed). */
	struct group *g = getgrgid(getgid());
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.mode = 0660;
	cfg.group = g ? g->gr_name : NULL;
	h_start_cfg(&H, &cfg);
	struct stat st;
	assert_int_equal(stat(H.path, &st), 0);
	assert_true(S_ISSOCK(st.st_mode));
	assert_int_equal(st.st_mode & 0777, 0660);
	assert_int_equal(st.st_gid, getgid());
	h_stop(&H);
	/* destroy unlinks it */
	assert_int_equal(stat(H.path, &st), -1);

	/* An unknown group is a configuration error, not a silent world-writable socket. */
	char dir[] = "/tmp/rw-ipc-test.XXXXXX";
	assert_non_null(mkdtemp(dir));
	char path[96];
	snprintf(path, sizeof(path), "%s/rw.sock", dir);
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_server_t *srv = NULL;
	base_config(&cfg, path);
	cfg.group = "no-such-group-railwave";
	assert_int_equal(rw_ipc_server_create(loop, &cfg, &ops, NULL, &srv), RW_ERR_INVAL);
	assert_int_equal(stat(path, &st), -1);
	ev_loop_destroy(loop);
	rmdir(dir);
}

static void test_stale_and_live_socket(void **state)
{
	(void)state;
	h_start(&H);
	/* A second server on a live daemon's path is refused. */
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_server_config_t cfg;
	base_config(&cfg, H.path);
	rw_ipc_server_t *srv = NULL;
	assert_int_equal(rw_ipc_server_create(loop, &cfg, &ops, NULL, &srv), RW_ERR_EXISTS);
	h_stop(&H);

	/* A stale socket file (nobody listening) is replaced. */
	char dir[] = "/tmp/rw-ipc-test.XXXXXX";
	assert_non_null(mkdtemp(dir));
	char path[96];
	snprintf(path, sizeof(path), "%s/rw.sock", dir);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
	assert_int_equal(bind(fd, (struct sockaddr *)&addr, sizeof(addr)), 0);
	close(fd);
	base_config(&cfg, path);
	assert_int_equal(rw_ipc_server_create(loop, &cfg, &ops, NULL, &srv), RW_OK);
	rw_ipc_server_destroy(srv);

	/* A regular file is never deleted. */
	fd = open(path, O_CREAT | O_WRONLY, 0600);
	close(fd);
	assert_int_equal(rw_ipc_server_create(loop, &cfg, &ops, NULL, &srv), RW_ERR_EXISTS);
	unlink(path);
	rmdir(dir);
	ev_loop_destroy(loop);
}

static void test_hello_goodbye_peercred(void **state)
{
	(void)state;
	h_start(&H);
	int base = count_fds();
	rw_client_t *c = connect_rank("moe.a", 3);
	snapshot_t s = h_snap(&H);
	assert_int_equal(s.joined, 1);
	rw_ipc_server_stats_t st = h_stats(&H);
	assert_int_equal(st.clients, 1);
	assert_int_equal(st.groups, 1);
	assert_int_equal(st.rings, 1);
	assert_true(rw_client_id(c) > 0);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	s = h_snap(&H);
	assert_int_equal(s.left, 1);
	assert_int_equal(s.last_reason, RW_IPC_LEFT_GOODBYE);
	st = h_stats(&H);
	assert_int_equal(st.groups, 0);
	assert_int_equal(st.rings, 0);
	assert_int_equal(fds_back_to(base), base);
	h_stop(&H);
}

static void get_last_info(harness_t *h, void *arg)
{
	*(rw_ipc_client_info_t *)arg = *rw_ipc_client_info(h->last_client);
}

static void test_info_from_hello_and_peercred(void **state)
{
	(void)state;
	h_start(&H);
	rw_client_opts_t o = opts_for("grp", 5);
	o.local_gpu = 2;
	o.node = 0;
	memset(o.gpu_uuid, 0xab, 16);
	rw_client_t *c = NULL;
	assert_int_equal(rw_client_connect(&o, &c), 0);
	rw_ipc_client_info_t info;
	h_call(&H, get_last_info, &info);
	assert_string_equal(info.group, "grp");
	assert_int_equal(info.rank, 5);
	assert_int_equal(info.world_size, 8);
	assert_int_equal(info.local_gpu, 2);
	assert_int_equal(info.gpu_uuid[15], 0xab);
	assert_int_equal(info.pid, getpid());
	assert_int_equal(info.uid, getuid());
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* ---------------------------------------------------------------------------------------------
 * Cases: framing
 * ------------------------------------------------------------------------------------------- */

static void test_version_mismatch(void **state)
{
	(void)state;
	h_start(&H);
	int fd = raw_connect(H.path);
	rw_ipc_hello_t m = make_hello("g", 0, 2, 0, -1);
	m.hdr.version = RW_IPC_VERSION + 1;
	raw_send(fd, &m, sizeof(m), NULL, 0);
	expect_error(fd, RW_E_VERSION, 1);
	close(fd);
	h_wait_clients(&H, 0);
	assert_int_equal(h_stats(&H).dropped, 1);
	h_stop(&H);
}

static void test_bad_magic_type_size(void **state)
{
	(void)state;
	h_start(&H);
	int fd = raw_connect(H.path);
	rw_ipc_hello_t m = make_hello("g", 0, 2, 0, -1);
	m.hdr.magic ^= 1;
	raw_send(fd, &m, sizeof(m), NULL, 0);
	expect_error(fd, RW_E_MAGIC, 1);
	close(fd);

	/* After hello, an unknown type and a wrong size are still fatal: the stream is garbage. */
	fd = raw_joined(H.path, "g", 0);
	rw_ipc_hdr_t h;
	hdr(&h, 77, 9);
	raw_send(fd, &h, sizeof(h), NULL, 0);
	expect_error(fd, RW_E_MSG_TYPE, 1);
	close(fd);

	fd = raw_joined(H.path, "g", 0);
	rw_ipc_dereg_t d;
	memset(&d, 0, sizeof(d));
	hdr(&d.hdr, RW_IPC_DEREG, 4);
	raw_send(fd, &d, sizeof(d) - 1, NULL, 0);
	expect_error(fd, RW_E_MSG_SIZE, 1);
	close(fd);

	/* Shorter than a header. */
	fd = raw_connect(H.path);
	raw_send(fd, "abc", 3, NULL, 0);
	expect_error(fd, RW_E_MSG_SIZE, 1);
	close(fd);

	/* A daemon-to-client type sent to the daemon. */
	fd = raw_connect(H.path);
	hdr(&h, RW_IPC_HELLO_OK, 1);
	raw_send(fd, &h, sizeof(h), NULL, 0);
	expect_error(fd, RW_E_MSG_TYPE, 1);
	close(fd);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void test_truncated_message(void **state)
{
	(void)state;
	h_start(&H);
	int fd = raw_joined(H.path, "g", 0);
	char big[4096];
	memset(big, 0, sizeof(big));
	rw_ipc_hdr_t h;
	hdr(&h, RW_IPC_HELLO, 1);
	memcpy(big, &h, sizeof(h));
	raw_send(fd, big, sizeof(big), NULL, 0);
	expect_error(fd, RW_E_TRUNC, 1);
	close(fd);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void test_too_many_fds_all_closed(void **state)
{
	(void)state;
	h_start(&H);
	int base = count_fds();
	int fd = raw_joined(H.path, "g", 0);
	int fds[6];
	for (int i = 0; i < 6; i++)
		fds[i] = sealed_memfd(4096, F_SEAL_SHRINK);
	rw_ipc_reg_host_t m;
	memset(&m, 0, sizeof(m));
	hdr(&m.hdr, RW_IPC_REG_HOST, 2);
	m.size = 4096;
	raw_send(fd, &m, sizeof(m), fds, 6); /* more than the daemon's cmsg space: MSG_CTRUNC */
	expect_error(fd, RW_E_FDS, 0);
	/* Two fds on a register (needs exactly one). */
	raw_send(fd, &m, sizeof(m), fds, 2);
	expect_error(fd, RW_E_FDS, 0);
	/* No fd on a register. */
	send_reg_host(fd, 4096, -1);
	expect_error(fd, RW_E_FDS, 0);
	/* An fd on a message that carries none. */
	rw_ipc_dereg_t d;
	memset(&d, 0, sizeof(d));
	hdr(&d.hdr, RW_IPC_DEREG, 5);
	d.buf_id = 1;
	raw_send(fd, &d, sizeof(d), fds, 1);
	expect_error(fd, RW_E_FDS, 0);
	for (int i = 0; i < 6; i++)
		close(fds[i]);
	/* Still connected and serving. */
	uint32_t id = raw_reg_host(fd, 8192);
	assert_true(id != 0);
	close(fd);
	h_wait_clients(&H, 0);
	/* Every fd the daemon received was closed (ours are closed too). */
	assert_int_equal(fds_back_to(base), base);
	assert_int_equal(h_stats(&H).buffers, 0);
	h_stop(&H);
}

/* Regression (found by the fuzzer): an empty datagram reads as end-of-file on SOCK_SEQPACKET,
 * and the fd it carried was never closed. */
static void test_empty_datagram_with_fd(void **state)
{
	(void)state;
	h_start(&H);
	int base = count_fds();
	int fd = raw_joined(H.path, "g", 0);
	int memfd = sealed_memfd(4096, F_SEAL_SHRINK);
	raw_send(fd, "", 0, &memfd, 1);
	close(memfd);
	rw_ipc_msg_t msg;
	assert_int_equal(raw_recv(fd, &msg, NULL, NULL), 0); /* dropped */
	close(fd);
	h_wait_clients(&H, 0);
	assert_int_equal(fds_back_to(base), base);
	h_stop(&H);
}

static void test_reserved_fields(void **state)
{
	(void)state;
	h_start(&H);
	int fd = raw_joined(H.path, "g", 0);
	rw_ipc_dereg_t d;
	memset(&d, 0, sizeof(d));
	hdr(&d.hdr, RW_IPC_DEREG, 5);
	d.reserved = 1;
	raw_send(fd, &d, sizeof(d), NULL, 0);
	expect_error(fd, RW_E_FIELD, 0);
	int memfd = sealed_memfd(4096, F_SEAL_SHRINK);
	rw_ipc_reg_host_t m;
	memset(&m, 0, sizeof(m));
	hdr(&m.hdr, RW_IPC_REG_HOST, 2);
	m.size = 4096;
	m.flags = 2;
	raw_send(fd, &m, sizeof(m), &memfd, 1);
	close(memfd);
	expect_error(fd, RW_E_FIELD, 0);
	close(fd);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* ---------------------------------------------------------------------------------------------
 * Cases: hello and groups
 * ------------------------------------------------------------------------------------------- */

static void test_state_errors(void **state)
{
	(void)state;
	h_start(&H);
	/* Anything before hello drops the connection. */
	int fd = raw_connect(H.path);
	rw_ipc_ring_setup_t r;
	memset(&r, 0, sizeof(r));
	hdr(&r.hdr, RW_IPC_RING_SETUP, 1);
	r.sq_entries = r.cq_entries = 8;
	raw_send(fd, &r, sizeof(r), NULL, 0);
	expect_error(fd, RW_E_STATE, 1);
	close(fd);
	/* Hello twice is an error but not fatal. */
	fd = raw_joined(H.path, "g", 0);
	rw_ipc_hello_t m = make_hello("g", 0, 8, 0, -1);
	raw_send(fd, &m, sizeof(m), NULL, 0);
	expect_error(fd, RW_E_STATE, 0);
	raw_send(fd, &r, sizeof(r), NULL, 0);
	rw_ipc_msg_t reply;
	int fds[8];
	unsigned nfds;
	assert_int_equal(raw_recv(fd, &reply, fds, &nfds), sizeof(rw_ipc_ring_ok_t));
	assert_int_equal(nfds, 3);
	for (unsigned i = 0; i < nfds; i++)
		close(fds[i]);
	close(fd);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void hello_expect(const char *group, uint32_t rank, uint32_t world, uint32_t node,
			 int32_t gpu, int code)
{
	int fd = raw_connect(H.path);
	rw_ipc_hello_t m = make_hello(group, rank, world, node, gpu);
	raw_send(fd, &m, sizeof(m), NULL, 0);
	expect_error(fd, code, 1);
	close(fd);
}

static void test_hello_field_errors(void **state)
{
	(void)state;
	h_start(&H);
	hello_expect("", 0, 8, 0, -1, RW_E_GROUP_NAME);
	hello_expect("bad name", 0, 8, 0, -1, RW_E_GROUP_NAME);
	hello_expect("g/x", 0, 8, 0, -1, RW_E_GROUP_NAME);
	/* Unterminated: 64 non-NUL bytes. */
	int fd = raw_connect(H.path);
	rw_ipc_hello_t m = make_hello("g", 0, 8, 0, -1);
	memset(m.group, 'a', sizeof(m.group));
	raw_send(fd, &m, sizeof(m), NULL, 0);
	expect_error(fd, RW_E_GROUP_NAME, 1);
	close(fd);
	/* Garbage after the NUL. */
	fd = raw_connect(H.path);
	m = make_hello("g", 0, 8, 0, -1);
	m.group[10] = 'x';
	raw_send(fd, &m, sizeof(m), NULL, 0);
	expect_error(fd, RW_E_GROUP_NAME, 1);
	close(fd);
	hello_expect("g", 8, 8, 0, -1, RW_E_RANK_RANGE);
	hello_expect("g", 0, 0, 0, -1, RW_E_RANK_RANGE);
	hello_expect("g", 0, 100000, 0, -1, RW_E_RANK_RANGE); /* above max_world */
	hello_expect("g", 0, 8, 0, 8, RW_E_GPU);              /* max_local_gpu 8 */
	hello_expect("g", 0, 8, 0, -2, RW_E_GPU);
	h_wait_clients(&H, 0);
	assert_int_equal(h_stats(&H).groups, 0);
	assert_int_equal(h_snap(&H).joined, 0);
	h_stop(&H);
}

static void test_group_consistency(void **state)
{
	(void)state;
	h_start(&H);
	rw_client_t *first = connect_rank("moe", 1);
	rw_client_opts_t o = opts_for("moe", 2);
	o.local_gpu = 1;
	rw_client_t *second = NULL;
	assert_int_equal(rw_client_connect(&o, &second), 0);

	hello_expect("moe", 1, 8, 0, -1, RW_E_RANK_DUP);
	hello_expect("moe", 3, 16, 0, -1, RW_E_WORLD_MISMATCH);
	hello_expect("moe", 3, 8, 1, -1, RW_E_NODE_MISMATCH);
	hello_expect("moe", 3, 8, 0, 1, RW_E_GPU); /* GPU 1 is rank 2's */
	/* librailwave reports the same codes. */
	rw_client_opts_t dup = opts_for("moe", 1);
	rw_client_t *x = NULL;
	assert_int_equal(rw_client_connect(&dup, &x), RW_E_RANK_DUP);
	assert_null(x);
	/* Another group is independent: same rank, other world size. */
	rw_client_opts_t other = opts_for("other", 1);
	other.world_size = 4;
	assert_int_equal(rw_client_connect(&other, &x), 0);
	rw_client_close(x);

	/* The earlier members were not affected. */
	uint32_t buf;
	void *addr;
	assert_int_equal(rw_client_register_host(first, 65536, &buf, &addr), 0);
	rw_sqe_t e = valid_sqe(buf, 1);
	assert_int_equal(rw_client_submit(first, &e, 1), 0);
	rw_cqe_t cqe = wait_one(first);
	assert_int_equal(cqe.status, RW_CQ_OK);
	rw_client_close(first);
	rw_client_close(second);
	h_wait_clients(&H, 0);
	/* After everyone left, the rank is free again. */
	first = connect_rank("moe", 1);
	rw_client_close(first);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void test_daemon_node_enforced(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.node = 2;
	h_start_cfg(&H, &cfg);
	hello_expect("g", 0, 8, 1, -1, RW_E_NODE_MISMATCH);
	int fd = raw_connect(H.path);
	rw_ipc_hello_t m = make_hello("g", 0, 8, 2, -1);
	raw_send(fd, &m, sizeof(m), NULL, 0);
	rw_ipc_msg_t reply;
	expect_reply(fd, RW_IPC_HELLO_OK, &reply);
	close(fd);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* ---- the rank page (ipc/server_page.c; docs/rankpath.md "The rank page") ---- */

struct page_probe {
	uint64_t submit;  /* what the daemon's mapping reads */
	size_t bytes;
	int have;
};

/* On the loop: read the rank's submit word through the daemon's mapping, publish plan = 7. */
static void page_probe_fn(harness_t *h, void *arg)
{
	struct page_probe *p = arg;
	rw_page_head_t *pg = h->last_client ? rw_ipc_client_page(h->last_client, &p->bytes) : NULL;
	p->have = pg != NULL;
	if (!pg)
		return;
	p->submit = atomic_load_explicit(&pg->word[RW_PW_SUBMIT].v, memory_order_acquire);
	atomic_store_explicit(&pg->word[RW_PW_PLAN].v, 7, memory_order_release);
}

static rw_ipc_server_config_t page_config(uint32_t rails)
{
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.world_size = 8;
	cfg.gpus_per_node = 4; /* two nodes */
	cfg.page_rails = rails;
	cfg.page_max_recv = 1024;
	return cfg;
}

/* Start the harness lending pages over two rails, connect rank 0 of `group`, get its page. */
static rw_client_t *page_rank_start(const char *group, uint32_t max_recv, rw_page_head_t **pg_p,
				    size_t *bytes_p)
{
	rw_ipc_server_config_t cfg = page_config(2);
	h_start_cfg(&H, &cfg);
	rw_client_t *c = connect_rank(group, 0);
	void *page = NULL;
	assert_int_equal(rw_client_rank_page(c, max_recv, &page, bytes_p), 0);
	*pg_p = page;
	return c;
}

/* Close the rank and stop the harness. */
static void page_rank_stop(rw_client_t *c)
{
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* A joined rank gets a page sized for the cluster and its max_recv; both processes' mappings
 * are the same memory (a word the rank writes, the daemon reads, and back); one per rank. */
static void test_rank_page_lent(void **state)
{
	(void)state;
	rw_page_head_t *pg;
	size_t bytes = 0;
	rw_client_t *c = page_rank_start("g", 512, &pg, &bytes);
	rw_page_layout_t l;
	assert_int_equal(rw_page_layout(2, 2, 4, 512, (size_t)sysconf(_SC_PAGESIZE), &l), 0);
	assert_int_equal(bytes, l.bytes);
	assert_int_equal(pg->magic, RW_PAGE_MAGIC);
	assert_int_equal(pg->nodes, 2);
	assert_int_equal(pg->rails, 2);
	assert_int_equal(pg->gpus, 4);
	assert_int_equal(pg->rail, 0); /* local GPU 0, no gpu_rail table: g % rails */
	assert_int_equal(pg->max_recv, 512);
	assert_int_equal(pg->slot_bytes, l.slot_bytes);
	atomic_store_explicit(&pg->word[RW_PW_SUBMIT].v, 1, memory_order_release);
	struct page_probe probe = { 0 };
	h_call(&H, page_probe_fn, &probe);
	assert_true(probe.have);
	assert_int_equal(probe.bytes, bytes);
	assert_int_equal(probe.submit, 1);
	assert_int_equal(atomic_load_explicit(&pg->word[RW_PW_PLAN].v, memory_order_acquire), 7);
	/* one page per rank */
	void *again;
	assert_int_equal(rw_client_rank_page(c, 512, &again, &bytes), RW_E_STATE);
	/* the connection is still good */
	uint32_t id;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 4096, &id, &addr), 0);
	page_rank_stop(c);
}

/* Refused, named, and the rank stays: max_recv 0 or above the bound, a daemon that lends none. */
static void test_rank_page_refused(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg = page_config(2);
	h_start_cfg(&H, &cfg);
	rw_client_t *c = connect_rank("g", 0);
	void *page;
	size_t bytes;
	assert_int_equal(rw_client_rank_page(c, 0, &page, &bytes), RW_E_TOKENS);
	assert_int_equal(rw_client_rank_page(c, 1025, &page, &bytes), RW_E_TOKENS);
	assert_non_null(strstr(rw_client_last_message(c), "max_recv"));
	assert_int_equal(rw_client_rank_page(c, 1024, &page, &bytes), 0);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);

	cfg = page_config(0); /* no rails configured for pages */
	h_start_cfg(&H, &cfg);
	c = connect_rank("g", 0);
	assert_int_equal(rw_client_rank_page(c, 16, &page, &bytes), RW_E_STATE);
	assert_non_null(strstr(rw_client_last_message(c), "lends no rank page"));
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void get_page_word(harness_t *h, void *arg)
{
	uint64_t *v = arg;
	*v = h->page_last_value[*v];
}

/* The value the service last heard for `word`, waiting (liveness bound) until it is `want`. */
static uint64_t page_word_heard(unsigned word, uint64_t want)
{
	uint64_t v = 0;
	for (int i = 0; i < 10000; i++) {
		v = word;
		h_call(&H, get_page_word, &v);
		if (v == want)
			break;
		usleep(1000);
	}
	return v;
}

/* The words the rank writes reach the service through the server's poller: each move forward
 * (several phases at once too), the words the daemon writes never. */
static void test_rank_page_words_reported(void **state)
{
	(void)state;
	rw_page_head_t *pg;
	size_t bytes;
	rw_client_t *c = page_rank_start("g", 64, &pg, &bytes);
	atomic_store_explicit(&pg->word[RW_PW_SUBMIT].v, 1, memory_order_release);
	assert_int_equal(page_word_heard(RW_PW_SUBMIT, 1), 1);
	atomic_store_explicit(&pg->word[RW_PW_PACKED].v, 1, memory_order_release);
	assert_int_equal(page_word_heard(RW_PW_PACKED, 1), 1);
	atomic_store_explicit(&pg->word[RW_PW_DONE].v, 1, memory_order_release);
	assert_int_equal(page_word_heard(RW_PW_DONE, 1), 1);
	atomic_store_explicit(&pg->word[RW_PW_SUBMIT].v, 3, memory_order_release); /* two phases */
	assert_int_equal(page_word_heard(RW_PW_SUBMIT, 3), 3);
	atomic_store_explicit(&pg->word[RW_PW_PLAN].v, 9, memory_order_release); /* the daemon's */
	usleep(20000);
	assert_int_equal(page_word_heard(RW_PW_PLAN, 0), 0);
	snapshot_t s = h_snap(&H);
	assert_int_equal(s.left, 0);
	page_rank_stop(c);
}

/* A rank that moves a word back, or further than it may have phases in flight, broke the
 * protocol: dropped with RW_E_RING_INDEX, named in the log; another rank's page goes on. */
static void test_rank_page_word_jump_drops(void **state)
{
	(void)state;
	rw_page_head_t *pg, *pg2;
	size_t bytes;
	rw_client_t *bad = page_rank_start("g", 64, &pg, &bytes), *good = connect_rank("h", 0);
	void *page2;
	assert_int_equal(rw_client_rank_page(good, 64, &page2, &bytes), 0);
	pg2 = page2;
	atomic_store_explicit(&pg->word[RW_PW_SUBMIT].v, 2 + RW_PAGE_DEPTH, memory_order_release);
	snapshot_t s;
	for (int i = 0; i < 10000; i++) {
		s = h_snap(&H);
		if (s.left == 1)
			break;
		usleep(1000);
	}
	assert_int_equal(s.left, 1);
	assert_int_equal(s.last_reason, RW_IPC_LEFT_PROTOCOL);
	assert_int_equal(s.last_error, RW_E_RING_INDEX);
	atomic_store_explicit(&pg2->word[RW_PW_SUBMIT].v, 1, memory_order_release);
	assert_int_equal(page_word_heard(RW_PW_SUBMIT, 1), 1);
	rw_client_close(bad);
	page_rank_stop(good);
}

/* The daemon goes away while the rank's stream waits on its page (stand-in driver): librailwave's
 * watcher writes the owed words from the rank's CPU and the stream runs through; the status says
 * why. The rank is a child process, so this program's other cases keep their own CUDA state
 * (test_cuda_without_driver forks a daemon that must not inherit a loaded driver). */
static int page_lost_rank(int go)
{
	rw_client_t *c = connect_rank("g", 0);
	void *page;
	size_t bytes;
	rw_cuda_dptr_t dev;
	rw_cuda_stream_t *s;
	rw_cuda_ext_stream_t e;
	if (rw_cuda_init() != RW_OK)
		return 77;
	if (rw_client_rank_page(c, 64, &page, &bytes) || rw_cuda_host_register_mapped(page, bytes, &dev) ||
	    rw_cuda_stream_create(0, &s) || rw_cuda_ext_stream_of(s, &e))
		return 2;
	rw_page_head_t *pg = page;
	/* phase 1 submitted by the stream; it waits for plan and arrived, then writes done */
	if (rw_cuda_word_write(&e, dev + offsetof(rw_page_head_t, word[RW_PW_SUBMIT]), 1) ||
	    rw_cuda_word_wait(&e, dev + offsetof(rw_page_head_t, word[RW_PW_PLAN]), 1) ||
	    rw_cuda_word_wait(&e, dev + offsetof(rw_page_head_t, word[RW_PW_ARRIVED]), 1) ||
	    rw_cuda_word_write(&e, dev + offsetof(rw_page_head_t, word[RW_PW_DONE]), 1))
		return 3;
	usleep(20000);
	if (atomic_load(&pg->word[RW_PW_DONE].v) != 0)
		return 4; /* not held: nobody planned */
	char x = 'w';
	if (write(go, &x, 1) != 1)
		return 5;
	if (rw_cuda_stream_sync(s) != RW_OK) /* hangs (then fails) without the watcher */
		return 6;
	if (atomic_load(&pg->word[RW_PW_DONE].v) != 1 ||
	    (int32_t)atomic_load(&pg->status[1 % RW_PAGE_DEPTH].v) != RW_E_CLOSED ||
	    atomic_load(&pg->word[RW_PW_PLAN].v) < 1 + RW_PAGE_OWED_AHEAD)
		return 7;
	rw_cuda_stream_destroy(s);
	rw_cuda_host_unregister(page);
	rw_client_close(c);
	return 0;
}

static void test_rank_page_daemon_lost(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg = page_config(1);
	h_start_cfg(&H, &cfg);
	int go[2], status = 0;
	assert_int_equal(pipe(go), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		close(go[0]);
		_exit(page_lost_rank(go[1]));
	}
	close(go[1]);
	char x = 0;
	ssize_t n = read(go[0], &x, 1); /* the rank's stream waits on its page */
	close(go[0]);
	h_stop(&H); /* the daemon's connections close */
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	if (WEXITSTATUS(status) == 77) {
		print_message("skipped: no CUDA driver in the rank\n");
		skip();
	}
	assert_int_equal(n, 1);
	assert_int_equal(WEXITSTATUS(status), 0);
}

static void test_client_limit(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.max_clients = 1;
	h_start_cfg(&H, &cfg);
	rw_client_t *a = connect_rank("g", 0);
	h_wait_clients(&H, 1);
	rw_client_opts_t o = opts_for("g", 1);
	rw_client_t *b = NULL;
	assert_int_equal(rw_client_connect(&o, &b), RW_E_LIMIT);
	rw_client_close(a);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* ---------------------------------------------------------------------------------------------
 * Cases: buffers
 * ------------------------------------------------------------------------------------------- */

typedef struct peek_arg {
	uint32_t buf_id;
	size_t off;
	uint8_t value;
	int write;
	rw_status_t st;
} peek_arg_t;

/* Read or write one byte of the last client's host buffer through the daemon's mapping. */
static void peek_buf(harness_t *h, void *arg)
{
	peek_arg_t *p = arg;
	rw_ipc_buffer_t b;
	p->st = rw_ipc_buffer_lookup(h->last_client, p->buf_id, &b);
	if (p->st != RW_OK)
		return;
	assert_int_equal(b.kind, RW_IPC_BUF_HOST);
	uint8_t *mem = b.host;
	if (p->write)
		mem[p->off] = p->value;
	else
		p->value = mem[p->off];
}

static void test_host_buffer_shared_both_ways(void **state)
{
	(void)state;
	h_start(&H);
	int base = count_fds();
	rw_client_t *c = connect_rank("g", 0);
	uint32_t id;
	uint8_t *addr;
	assert_int_equal(rw_client_register_host(c, 1 << 20, &id, (void **)&addr), 0);
	snapshot_t s = h_snap(&H);
	assert_int_equal(s.registered, 1);
	addr[12345] = 0x5a;
	peek_arg_t p = {.buf_id = id, .off = 12345};
	h_call(&H, peek_buf, &p);
	assert_int_equal(p.st, RW_OK);
	assert_int_equal(p.value, 0x5a);
	p = (peek_arg_t){.buf_id = id, .off = 999, .value = 0xc3, .write = 1};
	h_call(&H, peek_buf, &p);
	assert_int_equal(addr[999], 0xc3);
	/* Unknown id through the daemon API. */
	p = (peek_arg_t){.buf_id = id + 1, .off = 0};
	h_call(&H, peek_buf, &p);
	assert_int_equal(p.st, RW_ERR_NOTFOUND);

	assert_int_equal(rw_client_deregister(c, id), 0);
	assert_int_equal(h_stats(&H).buffers, 0);
	p = (peek_arg_t){.buf_id = id, .off = 0};
	h_call(&H, peek_buf, &p);
	assert_int_equal(p.st, RW_ERR_NOTFOUND);
	/* Twice: unknown now. */
	assert_int_equal(rw_client_deregister(c, id), RW_E_BUF_ID);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	assert_int_equal(fds_back_to(base), base);
	h_stop(&H);
}

static void test_register_errors(void **state)
{
	(void)state;
	h_start(&H);
	int base = count_fds();
	int fd = raw_joined(H.path, "g", 0);
	/* Size does not match fstat. */
	int memfd = sealed_memfd(8192, F_SEAL_SHRINK);
	send_reg_host(fd, 4096, memfd);
	expect_error(fd, RW_E_BUF_SIZE, 0);
	send_reg_host(fd, 16384, memfd);
	expect_error(fd, RW_E_BUF_SIZE, 0);
	send_reg_host(fd, 0, memfd);
	expect_error(fd, RW_E_BUF_SIZE, 0);
	close(memfd);
	/* Not sealed against shrinking: the daemon would SIGBUS after an ftruncate. */
	memfd = sealed_memfd(4096, 0);
	send_reg_host(fd, 4096, memfd);
	expect_error(fd, RW_E_BUF_SEAL, 0);
	close(memfd);
	/* Not a memfd at all. */
	int pipefd[2];
	assert_int_equal(pipe(pipefd), 0);
	send_reg_host(fd, 4096, pipefd[0]);
	expect_error(fd, RW_E_BUF_FD, 0);
	close(pipefd[0]);
	close(pipefd[1]);
	/* A regular file that cannot be sealed. */
	char tmpl[] = "/tmp/rw-ipc-file.XXXXXX";
	int file = mkstemp(tmpl);
	assert_true(file >= 0);
	unlink(tmpl);
	assert_int_equal(ftruncate(file, 4096), 0);
	send_reg_host(fd, 4096, file);
	expect_error(fd, RW_E_BUF_FD, 0);
	close(file);
	/* Write-sealed: cannot be mapped writable. */
	memfd = sealed_memfd(4096, F_SEAL_SHRINK | F_SEAL_WRITE);
	send_reg_host(fd, 4096, memfd);
	expect_error(fd, RW_E_BUF_FD, 0);
	close(memfd);
	/* Too many: max_buffers is 4. */
	for (int i = 0; i < 4; i++)
		raw_reg_host(fd, 4096);
	memfd = sealed_memfd(4096, F_SEAL_SHRINK);
	send_reg_host(fd, 4096, memfd);
	close(memfd);
	expect_error(fd, RW_E_BUF_LIMIT, 0);
	/* Unknown id. */
	rw_ipc_dereg_t d;
	memset(&d, 0, sizeof(d));
	hdr(&d.hdr, RW_IPC_DEREG, 5);
	d.buf_id = 0xdead;
	raw_send(fd, &d, sizeof(d), NULL, 0);
	expect_error(fd, RW_E_BUF_ID, 0);
	d.buf_id = RW_BUF_NONE;
	raw_send(fd, &d, sizeof(d), NULL, 0);
	expect_error(fd, RW_E_BUF_ID, 0);
	assert_int_equal(h_stats(&H).buffers, 4);
	close(fd);
	h_wait_clients(&H, 0);
	assert_int_equal(h_stats(&H).buffers, 0);
	assert_int_equal(fds_back_to(base), base);
	h_stop(&H);
}

static void test_stale_buffer_id_after_reuse(void **state)
{
	(void)state;
	h_start(&H);
	rw_client_t *c = connect_rank("g", 0);
	uint32_t a, b;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &a, &addr), 0);
	assert_int_equal(rw_client_deregister(c, a), 0);
	/* Same slot reused, new generation: the old id stays unknown. */
	assert_int_equal(rw_client_register_host(c, 65536, &b, &addr), 0);
	assert_int_not_equal(a, b);
	rw_sqe_t e = valid_sqe(a, 1);
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	rw_cqe_t cqe = wait_one(c);
	assert_int_equal(cqe.status, RW_CQ_ERROR);
	assert_int_equal(cqe.error, RW_E_BUF_ID);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void set_echo(harness_t *h, void *arg) { h->echo = *(int *)arg; }

static void complete_held(harness_t *h, void *arg)
{
	(void)arg;
	for (unsigned i = 0; i < h->nheld; i++)
		echo_complete(h, h->held_client[i], &h->held_sqe[i]);
	h->nheld = 0;
}

/* Start the harness holding submissions (no echo); one rank with a host buffer `id`. */
static rw_client_t *start_holding(uint32_t *id)
{
	h_start(&H);
	int off = 0;
	h_call(&H, set_echo, &off);
	rw_client_t *c = connect_rank("g", 0);
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, id, &addr), 0);
	return c;
}

static void test_deregister_busy(void **state)
{
	(void)state;
	uint32_t id;
	rw_client_t *c = start_holding(&id);
	rw_sqe_t e = valid_sqe(id, 1);
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	for (int i = 0; i < 5000 && h_snap(&H).nheld == 0; i++)
		usleep(1000);
	assert_int_equal(h_snap(&H).nheld, 1);
	assert_int_equal(rw_client_deregister(c, id), RW_E_BUF_BUSY);
	h_call(&H, complete_held, NULL);
	rw_cqe_t cqe = wait_one(c);
	assert_int_equal(cqe.status, RW_CQ_OK);
	assert_int_equal(rw_client_deregister(c, id), 0);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* ---------------------------------------------------------------------------------------------
 * Cases: rings and submissions
 * ------------------------------------------------------------------------------------------- */

static void test_ring_setup_errors(void **state)
{
	(void)state;
	h_start(&H);
	int fd = raw_joined(H.path, "g", 0);
	rw_ipc_ring_setup_t r;
	memset(&r, 0, sizeof(r));
	hdr(&r.hdr, RW_IPC_RING_SETUP, 3);
	r.sq_entries = 12;
	r.cq_entries = 16;
	raw_send(fd, &r, sizeof(r), NULL, 0);
	expect_error(fd, RW_E_RING_SIZE, 0);
	r.sq_entries = 2048; /* above max_ring_entries 1024 */
	raw_send(fd, &r, sizeof(r), NULL, 0);
	expect_error(fd, RW_E_RING_SIZE, 0);
	r.sq_entries = 1;
	raw_send(fd, &r, sizeof(r), NULL, 0);
	expect_error(fd, RW_E_RING_SIZE, 0);
	raw_rings_t rings;
	raw_ring_setup(fd, 8, 16, &rings);
	r.sq_entries = 8;
	raw_send(fd, &r, sizeof(r), NULL, 0);
	expect_error(fd, RW_E_RING_STATE, 0);
	raw_rings_free(&rings);
	close(fd);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void test_submission_round_trip(void **state)
{
	(void)state;
	h_start(&H);
	rw_client_t *c = connect_rank("g", 0);
	uint32_t id;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &id, &addr), 0);
	rw_sqe_t e[3] = {valid_sqe(id, 10), valid_sqe(id, 11), valid_sqe(id, 12)};
	e[2].kind = RW_KIND_COMBINE;
	e[2].handle_id = 11;
	e[2].topk_ids = (rw_span_t){.buf_id = RW_BUF_NONE};
	e[2].topk_weights = (rw_span_t){.buf_id = RW_BUF_NONE};
	assert_int_equal(rw_client_submit(c, e, 3), 0);
	assert_int_equal(rw_client_inflight(c), 3);
	rw_cqe_t got[3];
	int n = 0;
	while (n < 3) {
		int k = rw_client_wait(c, got + n, (unsigned)(3 - n), 5000);
		assert_true(k > 0);
		n += k;
	}
	for (int i = 0; i < 3; i++) {
		assert_int_equal(got[i].status, RW_CQ_OK);
		assert_int_equal(got[i].phase_id, 10 + i);
		assert_int_equal(got[i].user_data, (10 + i) * 10);
		assert_int_equal(got[i].recv_tokens, 16);
		assert_int_equal(got[i].n_inline, 2);
	}
	assert_int_equal(got[2].kind, RW_KIND_COMBINE);
	assert_int_equal(rw_client_inflight(c), 0);
	assert_int_equal(h_stats(&H).submissions, 3);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* Each hostile entry gets an error completion with its code; the client stays connected. */
static void test_bad_entries_rejected(void **state)
{
	(void)state;
	h_start(&H);
	rw_client_t *c = connect_rank("g", 0);
	uint32_t id;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &id, &addr), 0);
	struct {
		rw_sqe_t e;
		int code;
	} cases[40];
	int n = 0;
	rw_sqe_t e;
#define CASE(mutation, want)                        \
	do {                                        \
		e = valid_sqe(id, (uint64_t)n + 100); \
		mutation;                           \
		cases[n].e = e;                     \
		cases[n++].code = (want);           \
	} while (0)
	CASE(e.kind = 0, RW_E_KIND);
	CASE(e.kind = 9, RW_E_KIND);
	CASE(e.dtype = 0, RW_E_DTYPE);
	CASE(e.dtype = 77, RW_E_DTYPE);
	CASE(e.flags = 1, RW_E_FIELD);
	CASE(e.event_id = 1, RW_E_FIELD); /* an event id without a stream-order flag */
	CASE(e.flags = RW_SQE_SIGNAL, RW_E_FIELD); /* a stream-order flag without an event id */
	CASE(e.flags = RW_SQE_ABORT, RW_E_FIELD); /* a dispatch cannot abort */
	CASE(e.flags = 8, RW_E_FIELD);
	/* an abort is a combine's flag, alone, and carries no data */
	CASE((e.kind = RW_KIND_COMBINE, e.handle_id = 1, e.flags = RW_SQE_ABORT), RW_E_FIELD);
	CASE((e.kind = RW_KIND_COMBINE, e.handle_id = 1, e.token_count = 0,
	      e.tokens = e.topk_ids = e.topk_weights = e.output = (rw_span_t){ .buf_id = RW_BUF_NONE },
	      e.output_capacity = 0, e.flags = RW_SQE_ABORT | RW_SQE_WAIT_EVENT),
	     RW_E_FIELD);
	CASE(e.path = RW_PATH_REQ_JOINT + 1, RW_E_FIELD); /* docs/ipc.md "Path requests" */
	CASE(e.n_experts = 0, RW_E_EXPERTS); /* a dispatch must say E */
	CASE(e.n_experts = (1u << 20) + 1, RW_E_EXPERTS);
	CASE((e.token_count = 0, e.tokens.buf_id = RW_BUF_NONE, e.tokens.offset = 8), RW_E_FIELD);
	CASE((e.kind = RW_KIND_COMBINE, e.handle_id = 1, e.output.buf_id = RW_BUF_NONE), RW_E_BUF_ID);
	CASE((e.kind = RW_KIND_COMBINE, e.handle_id = 1, e.output_capacity = 0), RW_E_RANGE);
	CASE(e.token_count = 4097, RW_E_TOKENS);
	CASE(e.hidden = 0, RW_E_TOKENS);
	CASE(e.hidden = 100000, RW_E_TOKENS);
	CASE(e.topk = 17, RW_E_TOKENS);
	CASE(e.tokens.buf_id = id + 256, RW_E_BUF_ID);
	CASE(e.output.buf_id = RW_BUF_NONE, RW_E_BUF_ID);
	CASE(e.tokens.offset = 65536 - 2047, RW_E_RANGE);
	CASE(e.topk_ids.offset = 65536, RW_E_RANGE);
	CASE(e.output_capacity = 65536, RW_E_RANGE);
	CASE(e.output_capacity = 0, RW_E_RANGE);
	CASE(e.topk_weights.offset = UINT64_MAX - 10, RW_E_OVERFLOW);
	CASE(e.output.offset = UINT64_MAX, RW_E_OVERFLOW);
	CASE(e.tokens.reserved = 1, RW_E_FIELD);
	CASE(e.handle_id = 5, RW_E_FIELD); /* dispatch with a handle */
	CASE((e.kind = RW_KIND_COMBINE, e.handle_id = 0), RW_E_HANDLE);
	CASE(e.topk_ids.buf_id = RW_BUF_NONE, RW_E_BUF_ID); /* dispatch needs topk ids */
#undef CASE
	assert_int_equal(rw_client_submit(c, &cases[0].e, 1), 0);
	for (int i = 0; i < n; i++) {
		if (i > 0)
			assert_int_equal(rw_client_submit(c, &cases[i].e, 1), 0);
		rw_cqe_t cqe = wait_one(c);
		assert_int_equal(cqe.status, RW_CQ_ERROR);
		assert_int_equal(cqe.phase_id, (uint64_t)i + 100);
		if (cqe.error != cases[i].code)
			fail_msg("case %d: expected %s, got %s", i, rw_client_strerror(cases[i].code),
				 rw_client_strerror(cqe.error));
		if (cases[i].e.path) /* the reason arrives with the completion, as a notice */
			assert_non_null(strstr(rw_client_last_message(c), "submission path unknown"));
	}
	/* None reached the service; a valid one still does. */
	assert_int_equal(h_stats(&H).submissions, 0);
	assert_int_equal(h_stats(&H).rejected, (uint64_t)n);
	e = valid_sqe(id, 1);
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	assert_int_equal(wait_one(c).status, RW_CQ_OK);
	/* Empty phases reach the service: a dispatch that routes nothing (no input buffers) and
	 * a combine of nothing with no output. */
	e = valid_sqe(id, 2);
	e.token_count = 0;
	e.tokens = e.topk_ids = e.topk_weights = (rw_span_t){ .buf_id = RW_BUF_NONE };
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	assert_int_equal(wait_one(c).status, RW_CQ_OK);
	e.kind = RW_KIND_COMBINE;
	e.handle_id = 3;
	e.n_experts = 0;
	e.output = (rw_span_t){ .buf_id = RW_BUF_NONE };
	e.output_capacity = 0;
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	assert_int_equal(wait_one(c).status, RW_CQ_OK);
	e.flags = RW_SQE_ABORT; /* that combine as an abort (ipc/railwave.h) reaches the service */
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	assert_int_equal(wait_one(c).status, RW_CQ_OK);
	assert_int_equal(h_stats(&H).submissions, 4);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void test_sq_index_corruption_drops_only_that_client(void **state)
{
	(void)state;
	h_start(&H);
	int base = count_fds();
	rw_client_t *good = connect_rank("g", 1);
	int fd = raw_joined(H.path, "g", 0);
	raw_rings_t r;
	raw_ring_setup(fd, 8, 16, &r);
	/* Claim 9 entries in an 8-entry ring, then wake the daemon. */
	atomic_store(&r.sq.ctl->head, 9);
	uint64_t one = 1;
	assert_int_equal(write(r.sq_efd, &one, sizeof(one)), sizeof(one));
	expect_error(fd, RW_E_RING_INDEX, 1);
	raw_rings_free(&r);
	close(fd);
	h_wait_clients(&H, 1);
	snapshot_t s = h_snap(&H);
	assert_int_equal(s.last_reason, RW_IPC_LEFT_PROTOCOL);
	assert_int_equal(s.last_error, RW_E_RING_INDEX);
	/* The other client is unaffected. */
	uint32_t id;
	void *addr;
	assert_int_equal(rw_client_register_host(good, 65536, &id, &addr), 0);
	rw_sqe_t e = valid_sqe(id, 1);
	assert_int_equal(rw_client_submit(good, &e, 1), 0);
	assert_int_equal(wait_one(good).status, RW_CQ_OK);
	rw_client_close(good);
	h_wait_clients(&H, 0);
	assert_int_equal(fds_back_to(base), base);
	h_stop(&H);
}

static void test_cq_index_corruption(void **state)
{
	(void)state;
	h_start(&H);
	int fd = raw_joined(H.path, "g", 0);
	uint32_t id = raw_reg_host(fd, 65536);
	raw_rings_t r;
	raw_ring_setup(fd, 4, 2, &r);
	atomic_store(&r.cq.ctl->tail, 1000); /* consumed completions that never existed */
	for (int i = 0; i < 3; i++) {
		rw_sqe_t e = valid_sqe(id, (uint64_t)i);
		memcpy(rw_ring_prod_next(&r.sq), &e, sizeof(e));
		rw_ring_prod_push(&r.sq);
	}
	rw_ring_prod_publish(&r.sq);
	expect_error(fd, RW_E_RING_INDEX, 1);
	raw_rings_free(&r);
	close(fd);
	h_wait_clients(&H, 0);
	assert_int_equal(h_stats(&H).buffers, 0);
	h_stop(&H);
}

/* More submissions than completion slots, completions not reaped: the daemon must stop taking
 * submissions (never overrun the completion ring), then resume when the client reaps. */
static void test_completion_backpressure(void **state)
{
	(void)state;
	h_start(&H);
	rw_client_opts_t o = opts_for("g", 0);
	o.sq_entries = 8;
	o.cq_entries = 4;
	rw_client_t *c = NULL;
	assert_int_equal(rw_client_connect(&o, &c), 0);
	uint32_t id;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &id, &addr), 0);
	rw_sqe_t e[8];
	for (int i = 0; i < 8; i++)
		e[i] = valid_sqe(id, (uint64_t)i);
	assert_int_equal(rw_client_submit(c, e, 8), 0);
	/* The ring is full until the daemon takes some. */
	rw_sqe_t more = valid_sqe(id, 99);
	for (int i = 0; i < 5000 && h_stats(&H).submissions < 4; i++)
		usleep(1000);
	assert_int_equal(h_stats(&H).submissions, 4); /* only as many as completion slots */
	uint64_t seen[12] = {0};
	int got = 0;
	while (got < 8) {
		rw_cqe_t cqe[4];
		int k = rw_client_wait(c, cqe, 4, 5000);
		assert_true(k > 0);
		for (int i = 0; i < k; i++) {
			assert_int_equal(cqe[i].status, RW_CQ_OK);
			seen[cqe[i].phase_id]++;
		}
		got += k;
	}
	for (int i = 0; i < 8; i++)
		assert_int_equal(seen[i], 1);
	assert_int_equal(rw_client_submit(c, &more, 1), 0);
	assert_int_equal(wait_one(c).phase_id, 99);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

typedef struct submitter {
	rw_client_t *c;
	uint32_t buf;
	unsigned count;
	int rc;
} submitter_t;

static void *submit_thread(void *arg)
{
	submitter_t *st = arg;
	for (unsigned i = 0; i < st->count;) {
		rw_sqe_t e[4];
		unsigned n = RW_MIN(4u, st->count - i);
		for (unsigned k = 0; k < n; k++)
			e[k] = valid_sqe(st->buf, i + k);
		int rc = rw_client_submit(st->c, e, n);
		if (rc == RW_E_AGAIN) {
			sched_yield();
			continue;
		}
		if (rc) {
			st->rc = rc;
			return NULL;
		}
		i += n;
	}
	return NULL;
}

/* The documented split: one thread submits while another reaps (rings are SPSC each way). */
static void test_submit_and_reap_on_two_threads(void **state)
{
	(void)state;
	h_start(&H);
	rw_client_opts_t o = opts_for("g", 0);
	o.sq_entries = 8;
	o.cq_entries = 8;
	rw_client_t *c = NULL;
	assert_int_equal(rw_client_connect(&o, &c), 0);
	submitter_t st = {.c = c, .count = 20000};
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &st.buf, &addr), 0);
	uint8_t *seen = calloc(st.count, 1);
	pthread_t th;
	assert_int_equal(pthread_create(&th, NULL, submit_thread, &st), 0);
	unsigned got = 0;
	while (got < st.count) {
		rw_cqe_t cqe[8];
		int k = rw_client_wait(c, cqe, 8, 5000);
		assert_true(k > 0);
		for (int i = 0; i < k; i++) {
			assert_int_equal(cqe[i].status, RW_CQ_OK);
			assert_true(cqe[i].phase_id < st.count);
			seen[cqe[i].phase_id]++;
		}
		got += (unsigned)k;
	}
	pthread_join(th, NULL);
	assert_int_equal(st.rc, 0);
	for (unsigned i = 0; i < st.count; i++)
		assert_int_equal(seen[i], 1);
	assert_int_equal(rw_client_inflight(c), 0);
	free(seen);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* rw_client_wait spins before it sleeps (docs/ipc.md "Waiting for a completion"), but only
 * briefly: a wait with nothing coming sleeps, whatever the spin setting. The waiting thread's
 * own CPU over a 400 ms wait stays far below 400 ms (a spin without bound would use it all), and
 * a completion after such waits still reaches it (with spin 0: through the eventfd). */
static double thread_cpu_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void test_wait_spins_then_sleeps(void **state)
{
	(void)state;
	static const char *const spins[] = {"0", "200", "10000"};
	h_start(&H);
	for (size_t i = 0; i < RW_ARRAY_SIZE(spins); i++) {
		setenv("RAILWAVE_WAIT_SPIN_US", spins[i], 1);
		rw_client_t *c = connect_rank("g", 0);
		rw_cqe_t cqe;
		for (int round = 0; round < 2; round++) {
			double cpu0 = thread_cpu_ms();
			assert_int_equal(rw_client_wait(c, &cqe, 1, 400), 0);
			double used = thread_cpu_ms() - cpu0;
			if (used > 150)
				fail_msg("spin %s us: a 400 ms wait with nothing coming used %.0f ms of CPU",
					 spins[i], used);
		}
		uint32_t id;
		void *addr;
		assert_int_equal(rw_client_register_host(c, 65536, &id, &addr), 0);
		rw_sqe_t e = valid_sqe(id, 1);
		assert_int_equal(rw_client_submit(c, &e, 1), 0);
		cqe = wait_one(c);
		assert_int_equal(cqe.user_data, e.user_data);
		rw_client_close(c);
	}
	unsetenv("RAILWAVE_WAIT_SPIN_US");
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void set_drop(harness_t *h, void *arg) { h->drop_in_submit = *(int *)arg; }

static void test_drop_inside_callback(void **state)
{
	(void)state;
	h_start(&H);
	int on = 1;
	h_call(&H, set_drop, &on);
	rw_client_t *c = connect_rank("g", 0);
	uint32_t id;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &id, &addr), 0);
	rw_sqe_t e[2] = {valid_sqe(id, 1), valid_sqe(id, 2)};
	assert_int_equal(rw_client_submit(c, e, 2), 0);
	h_wait_clients(&H, 0);
	snapshot_t s = h_snap(&H);
	assert_int_equal(s.last_reason, RW_IPC_LEFT_DROPPED);
	assert_int_equal(s.last_error, RW_E_PHASE);
	assert_int_equal(s.submissions, 1); /* the second was never handed over */
	rw_cqe_t cqe;
	assert_int_equal(rw_client_wait(c, &cqe, 1, 5000), RW_E_CLOSED);
	rw_client_close(c);
	h_stop(&H);
}

/* Regression: the completions a stopping daemon posted before it closed were lost past the
 * first wait's max once the client knew of the closure (here a request saw it first): every one
 * must come, in order, and only then the closed code. */
static void test_completions_before_close_all_come(void **state)
{
	(void)state;
	uint32_t id;
	rw_client_t *c = start_holding(&id);
	enum { N = 5 };
	rw_sqe_t e[N];
	for (int i = 0; i < N; i++)
		e[i] = valid_sqe(id, 1 + i);
	assert_int_equal(rw_client_submit(c, e, N), 0);
	/* the daemon holds all N before it answers and closes */
	for (int i = 0; i < 5000 && h_snap(&H).nheld < N; i++)
		usleep(1000);
	assert_int_equal(h_snap(&H).nheld, N);
	h_call(&H, complete_held, NULL);
	h_stop(&H); /* publishes what is pending, then closes every connection */
	uint32_t id2;
	void *addr2;
	int closed = rw_client_register_host(c, 65536, &id2, &addr2);
	assert_true(closed < 0);
	rw_cqe_t cqe[2];
	int got = 0;
	while (got < N) {
		int n = rw_client_wait(c, cqe, 2, 5000);
		if (n <= 0)
			fail_msg("after %d of %d completions: %d (%s)", got, N, n,
				 n < 0 ? rw_client_strerror(n) : "timeout");
		for (int k = 0; k < n; k++, got++)
			assert_int_equal(cqe[k].user_data, e[got].user_data);
	}
	assert_int_equal(rw_client_wait(c, cqe, 2, 5000), closed);
	assert_int_equal(rw_client_poll(c, cqe, 2), closed);
	rw_client_close(c);
}

static void set_left_hook(harness_t *h, void *arg) { h->left_hook = *(int *)arg; }

/* Regression: a client_left callback that completes another client's work (putting it on the
 * flush list) and drops it made the server free it while still listed (use after free, ASan). */
static void test_drop_other_client_from_left_callback(void **state)
{
	(void)state;
	h_start(&H);
	int off = 0, on = 1;
	h_call(&H, set_echo, &off);
	rw_client_t *b = connect_rank("g", 1);
	uint32_t id;
	void *addr;
	assert_int_equal(rw_client_register_host(b, 65536, &id, &addr), 0);
	rw_sqe_t e = valid_sqe(id, 1);
	assert_int_equal(rw_client_submit(b, &e, 1), 0);
	for (int i = 0; i < 5000 && h_snap(&H).nheld == 0; i++)
		usleep(1000);
	rw_client_t *a = connect_rank("g", 0);
	h_call(&H, set_left_hook, &on);
	rw_client_close(a);
	h_wait_clients(&H, 0);
	h_call(&H, noop, NULL); /* one more loop turn: flush and reap with nothing listed */
	assert_int_equal(h_snap(&H).left, 2);
	rw_client_close(b);
	h_stop(&H);
}

static void test_busy_poll_server(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.busy_poll_us = 2000;
	h_start_cfg(&H, &cfg);
	rw_client_t *c = connect_rank("g", 0);
	uint32_t id;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &id, &addr), 0);
	for (int i = 0; i < 200; i++) {
		rw_sqe_t e = valid_sqe(id, (uint64_t)i);
		assert_int_equal(rw_client_submit(c, &e, 1), 0);
		rw_cqe_t cqe = wait_one(c);
		assert_int_equal(cqe.phase_id, (uint64_t)i);
		if (i % 50 == 0)
			usleep(5000); /* let the server stop polling and re-arm */
	}
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* ---------------------------------------------------------------------------------------------
 * Cases: a client killed mid-session
 * ------------------------------------------------------------------------------------------- */

static void test_client_killed_mid_session(void **state)
{
	(void)state;
	h_start(&H);
	int off = 0;
	h_call(&H, set_echo, &off); /* keep its submissions in flight */
	int base = count_fds();
	int ready[2];
	assert_int_equal(pipe(ready), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		close(ready[0]);
		rw_client_opts_t o = opts_for("g", 4);
		rw_client_t *c = NULL;
		uint32_t a, b;
		void *addr;
		if (rw_client_connect(&o, &c) || rw_client_register_host(c, 1 << 20, &a, &addr) ||
		    rw_client_register_host(c, 65536, &b, &addr))
			_exit(1);
		rw_sqe_t e[2] = {valid_sqe(b, 1), valid_sqe(b, 2)};
		if (rw_client_submit(c, e, 2))
			_exit(1);
		char x = 'r';
		if (write(ready[1], &x, 1) != 1)
			_exit(1);
		pause();
		_exit(0);
	}
	close(ready[1]);
	char x;
	assert_int_equal(read(ready[0], &x, 1), 1);
	close(ready[0]);
	for (int i = 0; i < 5000 && h_snap(&H).nheld < 2; i++)
		usleep(1000);
	rw_ipc_server_stats_t st = h_stats(&H);
	assert_int_equal(st.clients, 1);
	assert_int_equal(st.buffers, 2);
	assert_int_equal(st.rings, 1);
	assert_int_equal(h_snap(&H).nheld, 2);
	assert_true(count_fds() > base); /* its socket, ring eventfds */

	kill(pid, SIGKILL);
	int status;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	h_wait_clients(&H, 0);
	st = h_stats(&H);
	assert_int_equal(st.buffers, 0);
	assert_int_equal(st.rings, 0);
	assert_int_equal(st.groups, 0);
	snapshot_t s = h_snap(&H);
	assert_int_equal(s.last_reason, RW_IPC_LEFT_EOF);
	assert_int_equal(s.nheld, 0);
	assert_int_equal(fds_back_to(base), base);
	/* Its rank can join again. */
	rw_client_t *c = connect_rank("g", 4);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* ---------------------------------------------------------------------------------------------
 * Cases: CUDA registration
 * ------------------------------------------------------------------------------------------- */

static char fake_driver[PATH_MAX];

typedef struct cuda_peek {
	uint32_t buf_id;
	rw_ipc_buffer_t buf;
	rw_status_t st;
	uint8_t first, last;
} cuda_peek_t;

static void peek_cuda(harness_t *h, void *arg)
{
	cuda_peek_t *p = arg;
	p->st = rw_ipc_buffer_lookup(h->last_client, p->buf_id, &p->buf);
	if (p->st != RW_OK || p->buf.kind != RW_IPC_BUF_CUDA)
		return;
	/* Read back through the import (the fake driver's "device memory" is host memory). */
	if (rw_cuda_memcpy_dtoh(p->buf.device, &p->first, p->buf.dptr, 1) != RW_OK ||
	    rw_cuda_memcpy_dtoh(p->buf.device, &p->last, p->buf.dptr + p->buf.size - 1, 1) != RW_OK)
		p->st = RW_ERR_SYS;
}

#if RW_HAVE_CUDA_H
/* Start the harness with `alloc` bytes on the fake driver holding pattern[i] = i * mul + 1
 * (*pattern_p, the caller frees it); skips the test when the fake driver is not built. */
static rw_cuda_dptr_t cuda_harness_start(size_t alloc, unsigned mul, uint8_t **pattern_p)
{
	if (access(fake_driver, R_OK) != 0) {
		print_message("skipped: fake CUDA driver %s not built\n", fake_driver);
		skip();
	}
	h_start(&H);
	rw_cuda_dptr_t dptr;
	assert_int_equal(rw_cuda_mem_alloc(0, alloc, &dptr), RW_OK);
	uint8_t *pattern = malloc(alloc);
	assert_non_null(pattern);
	for (size_t i = 0; i < alloc; i++)
		pattern[i] = (uint8_t)(i * mul + 1);
	assert_int_equal(rw_cuda_memcpy_htod(0, dptr, pattern, alloc), RW_OK);
	*pattern_p = pattern;
	return dptr;
}

/* What librailwave sends for an exported range. */
static rw_client_cuda_desc_t client_desc(const rw_cuda_ipc_desc_t *desc)
{
	rw_client_cuda_desc_t d;
	memset(&d, 0, sizeof(d));
	memcpy(d.ipc_handle, desc->handle.bytes, 64);
	d.alloc_id = desc->buffer_id;
	d.alloc_bytes = desc->alloc_bytes;
	d.offset = desc->offset;
	d.bytes = desc->bytes;
	memcpy(d.device_uuid, desc->device_uuid, 16);
	return d;
}

/* The harness started, an allocation of `alloc` bytes filled with a pattern, and what librailwave
 * sends to register all of it. */
static rw_client_cuda_desc_t cuda_whole(size_t alloc, unsigned mul, rw_cuda_dptr_t *dptr_p,
					uint8_t **pattern_p)
{
	*dptr_p = cuda_harness_start(alloc, mul, pattern_p);
	rw_cuda_ipc_desc_t desc;
	assert_int_equal(rw_cuda_ipc_export(*dptr_p, alloc, &desc), RW_OK);
	return client_desc(&desc);
}
#endif

/* The registration path through cuda/'s import, against the fake driver (no GPU needed): a
 * range of an exported allocation is imported, readable at the right offset, and released when
 * the client leaves. Bogus handles and ranges are refused with specific codes. */
static void test_cuda_registration(void **state)
{
	(void)state;
#if !RW_HAVE_CUDA_H
	skip();
#else
	const size_t alloc = 1 << 20;
	uint8_t *pattern;
	rw_cuda_dptr_t dptr = cuda_harness_start(alloc, 7, &pattern);
	rw_cuda_ipc_desc_t desc;
	assert_int_equal(rw_cuda_ipc_export(dptr + 4096, 8192, &desc), RW_OK);

	rw_client_t *c = connect_rank("g", 0);
	rw_client_cuda_desc_t d = client_desc(&desc);
	uint32_t id;
	assert_int_equal(rw_client_register_cuda(c, &d, &id), 0);
	cuda_peek_t p = {.buf_id = id};
	h_call(&H, peek_cuda, &p);
	assert_int_equal(p.st, RW_OK);
	assert_int_equal(p.buf.kind, RW_IPC_BUF_CUDA);
	assert_int_equal(p.buf.size, 8192);
	assert_int_equal(p.first, pattern[4096]);
	assert_int_equal(p.last, pattern[4096 + 8191]);
	assert_int_equal(h_stats(&H).buffers, 1);

	/* A CUDA buffer is a normal span target. */
	uint32_t host;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &host, &addr), 0);
	rw_sqe_t e = valid_sqe(host, 5);
	e.output.buf_id = id;
	e.output.offset = 4096;
	e.output_capacity = 4096;
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	assert_int_equal(wait_one(c).status, RW_CQ_OK);
	e.output_capacity = 4097;
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	assert_int_equal(wait_one(c).error, RW_E_RANGE);

	/* Range outside its allocation; zero bytes; an unknown device UUID. */
	rw_client_cuda_desc_t bad = d;
	bad.offset = alloc - 100;
	assert_int_equal(rw_client_register_cuda(c, &bad, &id), RW_E_BUF_SIZE);
	bad = d;
	bad.bytes = 0;
	assert_int_equal(rw_client_register_cuda(c, &bad, &id), RW_E_BUF_SIZE);
	bad = d;
	memset(bad.device_uuid, 0x11, 16);
	assert_int_equal(rw_client_register_cuda(c, &bad, &id), RW_E_CUDA);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	assert_int_equal(h_stats(&H).buffers, 0);
	h_stop(&H); /* destroys the import cache: it must hold nothing now */
	rw_cuda_mem_free(0, dptr);
	free(pattern);
#endif
}

/* Stream order (ipc/railwave.h "Stream-ordered submission"): an interprocess event registered
 * with its flag word in a CUDA buffer of the rank; every bad registration refused with a reason
 * (foreign, host-memory, unaligned, out-of-range flag; bytes that are not an event; too many);
 * the flag's buffer cannot go before the event; a refused submission still gets its flag
 * written, before its CQE; an unregistered event id never leaves the library; events are freed
 * on deregistration and with the connection (the fake's event objects: ASan sees a leak). */
static void test_stream_events(void **state)
{
	(void)state;
#if !RW_HAVE_CUDA_H
	skip();
#else
	const size_t alloc = 1 << 16;
	uint8_t *pattern;
	rw_cuda_dptr_t dptr;
	rw_client_cuda_desc_t d = cuda_whole(alloc, 3, &dptr, &pattern);
	rw_client_t *c = connect_rank("g", 0);
	uint32_t cbuf, hbuf, eid, x;
	void *addr;
	assert_int_equal(rw_client_register_cuda(c, &d, &cbuf), 0);
	assert_int_equal(rw_client_register_host(c, 65536, &hbuf, &addr), 0);
	rw_cuda_event_t *ev;
	uint8_t h[RW_EVENT_HANDLE_BYTES], junk[RW_EVENT_HANDLE_BYTES];
	assert_int_equal(rw_cuda_event_export(0, &ev, h), RW_OK);
	memset(junk, 0x5a, sizeof(junk));

	assert_int_equal(rw_client_register_event(c, h, cbuf, 2, &x), RW_E_EVENT);
	assert_non_null(strstr(rw_client_last_message(c), "multiple of 4"));
	assert_int_equal(rw_client_register_event(c, h, cbuf, alloc, &x), RW_E_EVENT);
	assert_non_null(strstr(rw_client_last_message(c), "inside its buffer"));
	assert_int_equal(rw_client_register_event(c, h, cbuf + 256, 0, &x), RW_E_EVENT);
	assert_non_null(strstr(rw_client_last_message(c), "not one this rank registered"));
	assert_int_equal(rw_client_register_event(c, h, hbuf, 0, &x), RW_E_EVENT);
	assert_non_null(strstr(rw_client_last_message(c), "host memory"));
	assert_int_equal(rw_client_register_event(c, junk, cbuf, 0, &x), RW_E_EVENT);
	assert_non_null(strstr(rw_client_last_message(c), "not an interprocess event"));
	assert_int_equal(h_stats(&H).events, 0);

	assert_int_equal(rw_client_register_event(c, h, cbuf, 64, &eid), 0);
	assert_int_equal(h_stats(&H).events, 1);
	/* the flag's buffer stays while the event does */
	assert_int_equal(rw_client_deregister(c, cbuf), RW_E_BUF_BUSY);
	assert_int_equal(rw_client_deregister_event(c, eid + 1), RW_E_EVENT);

	/* a refused submission (unknown kind) that signals: the flag holds V when its CQE is read */
	rw_sqe_t e = valid_sqe(hbuf, 9);
	e.kind = 9;
	e.flags = RW_SQE_WAIT_EVENT | RW_SQE_SIGNAL;
	e.event_id = (uint16_t)eid;
	e.output.reserved = 77;
	assert_int_equal(rw_client_submit(c, &e, 1), 0);
	assert_int_equal(wait_one(c).error, RW_E_KIND);
	uint32_t flag = 0;
	assert_int_equal(rw_cuda_memcpy_dtoh(0, &flag, dptr + 64, 4), RW_OK);
	assert_int_equal(flag, 77);
	assert_true(h_stats(&H).flags_written >= 1);
	/* an id this client never registered: refused by the library, nothing queued */
	e.event_id = (uint16_t)(eid + 1);
	assert_int_equal(rw_client_submit(c, &e, 1), RW_E_INVAL);
	assert_int_equal(rw_client_inflight(c), 0);

	/* the bound per connection (16 by default), then deregistration frees one */
	uint32_t ids[16];
	int n = 1;
	while (n < 16 && rw_client_register_event(c, h, cbuf, 4u * (uint32_t)n, &ids[n]) == 0)
		n++;
	assert_int_equal(n, 16);
	assert_int_equal(rw_client_register_event(c, h, cbuf, 0, &x), RW_E_LIMIT);
	assert_int_equal(h_stats(&H).events, 16);
	assert_int_equal(rw_client_deregister_event(c, eid), 0);
	assert_int_equal(h_stats(&H).events, 15);
	/* the connection goes with 15 events registered: all freed */
	rw_client_close(c);
	h_wait_clients(&H, 0);
	assert_int_equal(h_stats(&H).events, 0);
	assert_int_equal(h_stats(&H).buffers, 0);
	h_stop(&H);
	rw_cuda_event_destroy(ev);
	rw_cuda_mem_free(0, dptr);
	free(pattern);
#endif
}

/* Two connections of one process (two railwave.Groups of a trainer) lend the same allocation:
 * the daemon maps it once for both; the first leaving keeps the second's buffer readable; the
 * mapping closes when the last leaves. Another process presenting the same handle bytes is
 * refused (RW_E_CUDA). Before the import cache shared by process, the second registration was
 * refused as stale. */
static void test_cuda_two_connections_of_one_process(void **state)
{
	(void)state;
#if !RW_HAVE_CUDA_H
	skip();
#else
	const size_t alloc = 1 << 16;
	uint8_t *pattern;
	rw_cuda_dptr_t dptr;
	rw_client_cuda_desc_t d = cuda_whole(alloc, 13, &dptr, &pattern);

	rw_client_t *c1 = connect_rank("layer0", 0);
	uint32_t id1, id2;
	assert_int_equal(rw_client_register_cuda(c1, &d, &id1), 0);

	/* another process presenting this process's handle bytes: refused, this one unharmed */
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		rw_client_opts_t o = opts_for("layer2", 0);
		rw_client_t *x = NULL;
		uint32_t idx;
		if (rw_client_connect(&o, &x) != 0)
			_exit(2);
		_exit(rw_client_register_cuda(x, &d, &idx) == RW_E_CUDA ? 0 : 1);
	}
	int status = 0;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	h_wait_clients(&H, 1);

	/* a second connection of this process: shares the mapping (the harness's last client) */
	rw_client_t *c2 = connect_rank("layer1", 0);
	assert_int_equal(rw_client_register_cuda(c2, &d, &id2), 0);
	assert_int_equal(h_stats(&H).buffers, 2);

	/* the first connection leaves; the second's buffer is still the allocation's memory */
	rw_client_close(c1);
	h_wait_clients(&H, 1);
	assert_int_equal(h_stats(&H).buffers, 1);
	cuda_peek_t p = {.buf_id = id2};
	h_call(&H, peek_cuda, &p); /* last_client is c2's connection */
	assert_int_equal(p.st, RW_OK);
	assert_int_equal(p.buf.size, alloc);
	assert_int_equal(p.first, pattern[0]);
	assert_int_equal(p.last, pattern[alloc - 1]);
	rw_client_close(c2);
	h_wait_clients(&H, 0);
	assert_int_equal(h_stats(&H).buffers, 0);
	/* the last user left: the daemon closed the mapping (the fake frees the memory only when
	 * both the exporter and every importer's open are gone) */
	rw_cuda_mem_free(0, dptr);
	void *fake = dlopen(fake_driver, RTLD_NOW | RTLD_NOLOAD);
	assert_non_null(fake);
	int (*live_blocks)(void) = (int (*)(void))dlsym(fake, "rw_fake_cuda_live_blocks");
	assert_non_null(live_blocks);
	assert_int_equal(live_blocks(), 0);
	dlclose(fake);
	h_stop(&H);
	free(pattern);
#endif
}

/* With no usable driver the daemon answers RW_E_NO_CUDA. rw_cuda_init() is once per process and
 * this process loaded the fake, so the server runs in a child with no driver. */
static void test_cuda_without_driver(void **state)
{
	(void)state;
	char dir[] = "/tmp/rw-ipc-test.XXXXXX";
	assert_non_null(mkdtemp(dir));
	char path[96];
	snprintf(path, sizeof(path), "%s/rw.sock", dir);
	int ready[2];
	assert_int_equal(pipe(ready), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		close(ready[0]);
		setenv("RW_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
		struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
		rw_ipc_server_config_t cfg;
		base_config(&cfg, path);
		rw_ipc_server_t *srv = NULL;
		harness_t local;
		memset(&local, 0, sizeof(local));
		local.echo = 1;
		if (!loop || rw_ipc_server_create(loop, &cfg, &ops, &local, &srv) != RW_OK)
			_exit(1);
		local.srv = srv;
		char x = 'r';
		if (write(ready[1], &x, 1) != 1)
			_exit(1);
		ev_run(loop, 0); /* until killed */
		_exit(0);
	}
	close(ready[1]);
	char x;
	assert_int_equal(read(ready[0], &x, 1), 1);
	close(ready[0]);
	rw_client_opts_t o = opts_for("g", 0);
	o.socket_path = path;
	rw_client_t *c = NULL;
	assert_int_equal(rw_client_connect(&o, &c), 0);
	rw_client_cuda_desc_t d;
	memset(&d, 0, sizeof(d));
	d.alloc_bytes = 1 << 20;
	d.bytes = 4096;
	uint32_t id;
	assert_int_equal(rw_client_register_cuda(c, &d, &id), RW_E_NO_CUDA);
	assert_true(strlen(rw_client_last_message(c)) > 0);
	/* no CUDA, no stream order: an event registration is refused as clearly */
	uint8_t handle[RW_EVENT_HANDLE_BYTES] = { 0 };
	assert_int_equal(rw_client_register_event(c, handle, 1, 0, &id), RW_E_NO_CUDA);
	assert_non_null(strstr(rw_client_last_message(c), "stream-ordered"));
	/* Still connected. */
	void *addr;
	assert_int_equal(rw_client_register_host(c, 4096, &id, &addr), 0);
	rw_client_close(c);
	kill(pid, SIGTERM);
	int status;
	waitpid(pid, &status, 0);
	unlink(path);
	rmdir(dir);
}

/* ---------------------------------------------------------------------------------------------
 * Cases: rank authentication (docs/ipc.md "Rank authentication")
 * ------------------------------------------------------------------------------------------- */

#define KEY_A "0123456789abcdef0123456789abcdef" /* 32 bytes */
#define KEY_B "0123456789abcdef0123456789abcdeX" /* differs in the last byte only */

static rw_ipc_hello_t keyed_hello(const char *group, uint32_t rank, const char *key)
{
	rw_ipc_hello_t m = make_hello(group, rank, 8, 0, -1);
	if (key) {
		m.key_len = (uint32_t)strlen(key);
		memcpy(m.key, key, m.key_len);
	}
	return m;
}

/* Send a hello and expect a fatal ERROR with `code`; returns its message. */
static void hello_refused(const rw_ipc_hello_t *m, size_t len, int code, char *msg_out)
{
	int fd = raw_connect(H.path);
	raw_send(fd, m, len, NULL, 0);
	rw_ipc_msg_t reply;
	assert_int_equal(raw_recv(fd, &reply, NULL, NULL), sizeof(rw_ipc_error_t));
	assert_int_equal(reply.hdr.type, RW_IPC_ERROR);
	if (reply.error.code != code)
		fail_msg("expected %s, got %s (%s)", rw_client_strerror(code),
			 rw_client_strerror(reply.error.code), reply.error.message);
	assert_int_equal(reply.error.fatal, 1);
	snprintf(msg_out, RW_IPC_ERRMSG_MAX, "%s", reply.error.message);
	assert_int_equal(raw_recv(fd, &reply, NULL, NULL), 0); /* then closed */
	close(fd);
}

static void test_group_key(void **state)
{
	(void)state;
	h_start(&H);
	int base = count_fds();
	/* The first rank sets the key (librailwave reads it from the environment), the second
	 * presents the same and joins. */
	setenv("RAILWAVE_GROUP_KEY", KEY_A, 1);
	rw_client_t *r0 = connect_rank("job.a", 0);
	rw_client_t *r1 = connect_rank("job.a", 1);
	unsetenv("RAILWAVE_GROUP_KEY");

	char msg[RW_IPC_ERRMSG_MAX];
	/* No key, a wrong key (one byte off), a key of the first form's hello (112 bytes): refused,
	 * each with a message naming the group and why. Rank 0 is taken, yet the refusal is about
	 * the key (RW_E_GROUP_KEY, not RW_E_RANK_DUP): a squatter learns nothing of the ranks. */
	rw_ipc_hello_t m = keyed_hello("job.a", 0, NULL);
	hello_refused(&m, sizeof(m), RW_E_GROUP_KEY, msg);
	assert_non_null(strstr(msg, "group job.a has a group key and this rank gave none"));
	hello_refused(&m, RW_IPC_HELLO_BASE_BYTES, RW_E_GROUP_KEY, msg);
	m = keyed_hello("job.a", 2, KEY_B);
	hello_refused(&m, sizeof(m), RW_E_GROUP_KEY, msg);
	assert_non_null(strstr(msg, "group job.a: key differs from the one its first rank set"));
	/* A key shorter than 16 bytes is refused before any group is looked at. */
	m = keyed_hello("job.new", 0, "short-key");
	hello_refused(&m, sizeof(m), RW_E_GROUP_KEY, msg);
	assert_non_null(strstr(msg, "shorter than 16 bytes"));
	/* librailwave reports the code too. */
	setenv("RAILWAVE_GROUP_KEY", KEY_B, 1);
	rw_client_opts_t o = opts_for("job.a", 3);
	rw_client_t *x = NULL;
	assert_int_equal(rw_client_connect(&o, &x), RW_E_GROUP_KEY);
	assert_null(x);
	/* A key longer than the wire's 64 bytes never leaves the library. */
	setenv("RAILWAVE_GROUP_KEY", KEY_A KEY_A "!", 1);
	assert_int_equal(rw_client_connect(&o, &x), RW_E_INVAL);
	unsetenv("RAILWAVE_GROUP_KEY");

	/* A group opened without a key yields its name to a rank with a key: whoever opened the
	 * job's group first (a squatter) is dropped and told why, its seat is free at once, and it
	 * cannot come back without the key. */
	rw_client_t *open0 = connect_rank("open", 0);
	setenv("RAILWAVE_GROUP_KEY", KEY_A, 1);
	rw_client_t *open1 = connect_rank("open", 1);
	unsetenv("RAILWAVE_GROUP_KEY");
	uint32_t obuf;
	void *oaddr;
	assert_int_not_equal(rw_client_register_host(open0, 65536, &obuf, &oaddr), 0);
	char claimed[RW_IPC_ERRMSG_MAX];
	snprintf(claimed, sizeof(claimed), "group open, opened without a key, was claimed by a "
		 "rank with one (pid %d)", (int)getpid());
	assert_string_equal(rw_client_last_message(open0), claimed);
	m = keyed_hello("open", 0, NULL);
	hello_refused(&m, sizeof(m), RW_E_GROUP_KEY, msg);
	assert_non_null(strstr(msg, "group open has a group key and this rank gave none"));
	setenv("RAILWAVE_GROUP_KEY", KEY_A, 1);
	rw_client_t *open2 = connect_rank("open", 0); /* the squatter's seat */
	unsetenv("RAILWAVE_GROUP_KEY");

	/* The keyed group was not disturbed: both ranks still carry submissions. */
	rw_ipc_server_stats_t st = h_stats(&H);
	assert_int_equal(st.refused_key, 6);
	assert_int_equal(st.groups_claimed, 1);
	assert_int_equal(st.groups, 2);
	rw_client_t *members[2] = {r0, r1};
	for (int i = 0; i < 2; i++) {
		uint32_t buf;
		void *addr;
		assert_int_equal(rw_client_register_host(members[i], 65536, &buf, &addr), 0);
		rw_sqe_t e = valid_sqe(buf, 1);
		assert_int_equal(rw_client_submit(members[i], &e, 1), 0);
		assert_int_equal(wait_one(members[i]).status, RW_CQ_OK);
	}
	rw_client_close(r0);
	rw_client_close(r1);
	rw_client_close(open0);
	rw_client_close(open1);
	rw_client_close(open2);
	h_wait_clients(&H, 0);
	/* Once every member left the group is forgotten with its key: the next job may reuse the
	 * name with its own key. */
	setenv("RAILWAVE_GROUP_KEY", KEY_B, 1);
	r0 = connect_rank("job.a", 0);
	unsetenv("RAILWAVE_GROUP_KEY");
	rw_client_close(r0);
	h_wait_clients(&H, 0);
	assert_int_equal(fds_back_to(base), base);
	h_stop(&H);
}

static void test_group_key_required(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.require_group_key = 1;
	h_start_cfg(&H, &cfg);
	char msg[RW_IPC_ERRMSG_MAX];
	rw_ipc_hello_t m = keyed_hello("job.b", 0, NULL);
	hello_refused(&m, sizeof(m), RW_E_GROUP_KEY, msg);
	assert_non_null(strstr(msg, "group job.b: this daemon requires a group key"));
	assert_int_equal(h_stats(&H).groups, 0); /* the refused rank opened nothing */
	setenv("RAILWAVE_GROUP_KEY", KEY_A, 1);
	rw_client_t *c = connect_rank("job.b", 0);
	unsetenv("RAILWAVE_GROUP_KEY");
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* In a child process: become `uid`, connect to `path` and say hello as rank `rank` of group
 * "uid.test". Exit status: 0 joined, 2 connect refused with EACCES, 3 an ERROR reply (its code
 * is written to the pipe), 1 anything else. Never returns. */
static void child_connect_as(uid_t uid, const char *path, uint32_t rank, int code_fd)
{
	if (setgroups(0, NULL) != 0 || setresgid(uid, uid, uid) != 0 ||
	    setresuid(uid, uid, uid) != 0)
		_exit(1);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0)
		_exit(errno == EACCES ? 2 : 1);
	rw_ipc_hello_t m = make_hello("uid.test", rank, 8, 0, -1);
	if (send(fd, &m, sizeof(m), MSG_NOSIGNAL) != (ssize_t)sizeof(m))
		_exit(1);
	rw_ipc_msg_t reply;
	struct pollfd pfd = {.fd = fd, .events = POLLIN};
	if (poll(&pfd, 1, 5000) != 1 || recv(fd, &reply, sizeof(reply), 0) < (ssize_t)sizeof(reply.hdr))
		_exit(1);
	if (reply.hdr.type == RW_IPC_ERROR) {
		if (write(code_fd, &reply.error.code, sizeof(int)) != sizeof(int))
			_exit(1);
		_exit(3);
	}
	_exit(reply.hdr.type == RW_IPC_HELLO_OK ? 0 : 1);
}

static int run_as(uid_t uid, const char *path, uint32_t rank, int *code_p)
{
	int p[2];
	assert_int_equal(pipe(p), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		close(p[0]);
		child_connect_as(uid, path, rank, p[1]);
	}
	close(p[1]);
	int status = 0;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	*code_p = 0;
	if (read(p[0], code_p, sizeof(int)) != sizeof(int))
		*code_p = 0;
	close(p[0]);
	return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#define NOBODY 65534

static void test_connections_per_uid(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.max_per_uid = 3;
	cfg.mode = 0666; /* so that another uid may connect at all (below) */
	h_start_cfg(&H, &cfg);
	int fds[3];
	for (int i = 0; i < 3; i++)
		fds[i] = raw_connect(H.path); /* held without a hello */
	h_wait_clients(&H, 3);
	/* The fourth connection of this uid is refused at once with a message naming the limit. */
	int fd = raw_connect(H.path);
	rw_ipc_msg_t reply;
	assert_int_equal(raw_recv(fd, &reply, NULL, NULL), sizeof(rw_ipc_error_t));
	assert_int_equal(reply.error.code, RW_E_LIMIT);
	assert_int_equal(reply.error.fatal, 1);
	char want[96];
	snprintf(want, sizeof(want), "uid %d already holds 3 connections, the per-uid limit",
		 (int)getuid());
	if (!strstr(reply.error.message, want))
		fail_msg("refusal says '%s'", reply.error.message);
	assert_int_equal(raw_recv(fd, &reply, NULL, NULL), 0);
	close(fd);
	assert_int_equal(h_stats(&H).refused_uid, 1);
	/* librailwave sees RW_E_LIMIT. */
	rw_client_opts_t o = opts_for("g", 0);
	rw_client_t *x = NULL;
	assert_int_equal(rw_client_connect(&o, &x), RW_E_LIMIT);
	/* Another uid still gets in while this one is at its cap (needs root to switch uid). */
	if (getuid() == 0) {
		assert_int_equal(chmod(H.dir, 0755), 0);
		int code;
		assert_int_equal(run_as(NOBODY, H.path, 5, &code), 0);
	} else {
		print_message("not root: the other-uid half is skipped\n");
	}
	/* A slot freed is a slot usable again. */
	close(fds[0]);
	h_wait_clients(&H, 2);
	rw_client_t *c = connect_rank("g", 0);
	rw_client_close(c);
	close(fds[1]);
	close(fds[2]);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void test_other_uid_refused_by_socket_mode(void **state)
{
	(void)state;
	if (getuid() != 0) {
		print_message("skipped: needs root to run a client as another uid\n");
		skip();
	}
	/* Mode 0660, owner and group ours: nobody (not in our group) cannot even connect. */
	h_start(&H);
	assert_int_equal(chmod(H.dir, 0755), 0); /* the folder is not what stops it */
	int code;
	assert_int_equal(run_as(NOBODY, H.path, 1, &code), 2);
	assert_int_equal(h_stats(&H).accepted, 0);
	h_stop(&H);
	/* The same uid is let in when the socket's group is its group. */
	struct group *g = getgrgid(NOBODY);
	if (!g) {
		print_message("no group %d: the ipc_group half is skipped\n", NOBODY);
		return;
	}
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.group = g->gr_name;
	h_start_cfg(&H, &cfg);
	assert_int_equal(chmod(H.dir, 0755), 0);
	assert_int_equal(run_as(NOBODY, H.path, 1, &code), 0);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void test_hello_deadline(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.hello_timeout_ms = 200;
	h_start_cfg(&H, &cfg);
	rw_client_t *c = connect_rank("g", 0);
	int fd = raw_connect(H.path); /* says nothing */
	/* It is told why and closed (raw_recv's 5 s bound is liveness only). */
	expect_error(fd, RW_E_STATE, 1);
	close(fd);
	h_wait_clients(&H, 1);
	assert_int_equal(h_stats(&H).hello_timeouts, 1);
	/* A rank that joined in time is not touched by the deadline. */
	usleep(300 * 1000);
	uint32_t buf;
	void *addr;
	assert_int_equal(rw_client_register_host(c, 65536, &buf, &addr), 0);
	rw_client_close(c);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

/* The loop held past the deadline by one long callback, with a hello sent meanwhile: the rank
 * joins. libev runs the expired timer before the read queued in the same turn; the deadline sees
 * the hello waiting and gives one more period. */
typedef struct held_hello {
	int fd;
	unsigned hold_ms;
} held_hello_t;

static void send_hello_and_hold(harness_t *h, void *arg)
{
	(void)h;
	held_hello_t *a = arg;
	rw_ipc_hello_t m = make_hello("g", 1, 8, 0, -1);
	raw_send(a->fd, &m, sizeof(m), NULL, 0);
	usleep(a->hold_ms * 1000);
}

static void test_hello_deadline_held_loop(void **state)
{
	(void)state;
	rw_ipc_server_config_t cfg;
	base_config(&cfg, "");
	cfg.hello_timeout_ms = 100;
	h_start_cfg(&H, &cfg);
	held_hello_t a = {.fd = raw_connect(H.path), .hold_ms = 300};
	h_wait_clients(&H, 1); /* accepted: its deadline runs */
	h_call(&H, send_hello_and_hold, &a);
	rw_ipc_msg_t reply;
	expect_reply(a.fd, RW_IPC_HELLO_OK, &reply);
	assert_int_equal(h_stats(&H).hello_timeouts, 0);
	/* A silent one still meets the deadline, grace or not. */
	int mute = raw_connect(H.path);
	expect_error(mute, RW_E_STATE, 1);
	close(mute);
	assert_int_equal(h_stats(&H).hello_timeouts, 1);
	close(a.fd);
	h_wait_clients(&H, 0);
	h_stop(&H);
}

static void test_socket_folder(void **state)
{
	(void)state;
	struct group *g = getgrgid(getgid());
	assert_non_null(g);
	char dir[] = "/tmp/rw-ipc-test.XXXXXX";
	assert_non_null(mkdtemp(dir));
	char sub[96], path[128];
	snprintf(sub, sizeof(sub), "%s/run", dir);
	snprintf(path, sizeof(path), "%s/rw.sock", sub);
	/* A missing folder is created 0750 and given the socket's group. */
	assert_int_equal(rw_ipc_socket_dir(path, g->gr_name), RW_OK);
	struct stat st;
	assert_int_equal(stat(sub, &st), 0);
	assert_int_equal(st.st_mode & 0777, 0750);
	assert_int_equal(st.st_gid, getgid());
	/* An existing one is left as the operator made it. */
	assert_int_equal(chmod(sub, 0711), 0);
	assert_int_equal(rw_ipc_socket_dir(path, NULL), RW_OK);
	assert_int_equal(stat(sub, &st), 0);
	assert_int_equal(st.st_mode & 0777, 0711);
	assert_int_equal(rmdir(sub), 0);
	/* Without a group: 0755. An unknown group creates nothing. */
	assert_int_equal(rw_ipc_socket_dir(path, "no-such-group-railwave"), RW_ERR_INVAL);
	assert_int_equal(stat(sub, &st), -1);
	assert_int_equal(rw_ipc_socket_dir(path, NULL), RW_OK);
	assert_int_equal(stat(sub, &st), 0);
	assert_int_equal(st.st_mode & 0777, 0755);
	rmdir(sub);
	rmdir(dir);
}

/* ---------------------------------------------------------------------------------------------
 * The example program against this server
 * ------------------------------------------------------------------------------------------- */

static char example_path[PATH_MAX];

static void test_example_program(void **state)
{
	(void)state;
	if (access(example_path, X_OK) != 0) {
		print_message("skipped: %s not built\n", example_path);
		skip();
	}
	h_start(&H);
	char cmd[PATH_MAX + 256];
	/* The harness completes phases without moving data: nothing to verify. */
	snprintf(cmd, sizeof(cmd), "%s %s --no-verify >/dev/null 2>&1", example_path, H.path);
	int rc = system(cmd);
	assert_int_equal(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, 0);
	h_wait_clients(&H, 0);
	assert_true(h_stats(&H).submissions >= 2);
	h_stop(&H);
}

int main(int argc, char **argv)
{
	(void)argc;
	char self[PATH_MAX];
	snprintf(self, sizeof(self), "%s", argv[0]);
	const char *dir = dirname(self);
	/* build/test/ipc_server -> build/tests/cuda/libfakecuda.so, build/examples/ipc_example */
	snprintf(fake_driver, sizeof(fake_driver), "%s/../tests/cuda/libfakecuda.so", dir);
	snprintf(example_path, sizeof(example_path), "%s/../examples/ipc_example", dir);
	setenv("RW_CUDA_DRIVER", fake_driver, 1);
	rw_log_set_level(getenv("RW_TEST_VERBOSE") ? RW_LOG_DEBUG : RW_LOG_ERROR);
	signal(SIGPIPE, SIG_IGN);

	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_socket_mode_and_group),
		cmocka_unit_test(test_stale_and_live_socket),
		cmocka_unit_test(test_hello_goodbye_peercred),
		cmocka_unit_test(test_info_from_hello_and_peercred),
		cmocka_unit_test(test_version_mismatch),
		cmocka_unit_test(test_bad_magic_type_size),
		cmocka_unit_test(test_truncated_message),
		cmocka_unit_test(test_too_many_fds_all_closed),
		cmocka_unit_test(test_empty_datagram_with_fd),
		cmocka_unit_test(test_reserved_fields),
		cmocka_unit_test(test_state_errors),
		cmocka_unit_test(test_hello_field_errors),
		cmocka_unit_test(test_group_consistency),
		cmocka_unit_test(test_daemon_node_enforced),
		cmocka_unit_test(test_rank_page_lent),
		cmocka_unit_test(test_rank_page_refused),
		cmocka_unit_test(test_rank_page_daemon_lost),
		cmocka_unit_test(test_rank_page_words_reported),
		cmocka_unit_test(test_rank_page_word_jump_drops),
		cmocka_unit_test(test_client_limit),
		cmocka_unit_test(test_host_buffer_shared_both_ways),
		cmocka_unit_test(test_register_errors),
		cmocka_unit_test(test_stale_buffer_id_after_reuse),
		cmocka_unit_test(test_deregister_busy),
		cmocka_unit_test(test_ring_setup_errors),
		cmocka_unit_test(test_submission_round_trip),
		cmocka_unit_test(test_bad_entries_rejected),
		cmocka_unit_test(test_sq_index_corruption_drops_only_that_client),
		cmocka_unit_test(test_cq_index_corruption),
		cmocka_unit_test(test_completion_backpressure),
		cmocka_unit_test(test_submit_and_reap_on_two_threads),
		cmocka_unit_test(test_drop_inside_callback),
		cmocka_unit_test(test_completions_before_close_all_come),
		cmocka_unit_test(test_wait_spins_then_sleeps),
		cmocka_unit_test(test_drop_other_client_from_left_callback),
		cmocka_unit_test(test_busy_poll_server),
		cmocka_unit_test(test_client_killed_mid_session),
		/* Before test_cuda_registration: a forked child must not inherit a loaded driver. */
		cmocka_unit_test(test_cuda_without_driver),
		cmocka_unit_test(test_cuda_registration),
		cmocka_unit_test(test_cuda_two_connections_of_one_process),
		cmocka_unit_test(test_stream_events),
		cmocka_unit_test(test_example_program),
		cmocka_unit_test(test_group_key),
		cmocka_unit_test(test_group_key_required),
		cmocka_unit_test(test_connections_per_uid),
		cmocka_unit_test(test_other_uid_refused_by_socket_mode),
		cmocka_unit_test(test_hello_deadline),
		cmocka_unit_test(test_hello_deadline_held_loop),
		cmocka_unit_test(test_socket_folder),
	};
	return cmocka_run_group_tests_name("ipc_server", tests, NULL, NULL);
}
