/* tests/lib/rail_harness.c: the rail conformance suite's harness (rail_harness.h says what it
 * is); the cases are in tests/rdma/conformance.c. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <ev.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/common.h"
#include "rdma/rail.h"
#include "tests/lib/rail_harness.h"

typedef struct rng { uint64_t s; } rng_t;
typedef struct responder {
	endpoint_t ep;
	int ctl_fd;
	ev_io ctl_io;
	ev_prepare prep;
	int pending;      /* 0, OP_EXPECT or OP_WRITE_TO: a verdict is owed when it finishes */
	int started;      /* OP_WRITE_TO: writing began (after on_connected) */
	int quit;
} responder_t;

typedef struct thread_arg {
	int fd;
	const char *local;
} thread_arg_t;

rh_opts_t opt = {.role = "a", .rail = 1, .ctl_fd = -1};

/* ---- options ------------------------------------------------------------------------------ */

static char local_buf[3][RW_RAIL_ADDR_MAX];

/* ---- deterministic plan and data pattern --------------------------------------------------- */

static uint64_t splitmix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static uint64_t rng_next(rng_t *r) { return splitmix(r->s++); }
static uint64_t rng_range(rng_t *r, uint64_t lo, uint64_t hi) /* [lo, hi] */
{
	return lo + rng_next(r) % (hi - lo + 1);
}

/* Disjoint ranges inside [0, region_size), posted in a shuffled order, so every write can be
 * verified when its arrival is reported whatever a transport does with later writes. */
static plan_item_t *plan_make(const plan_params_t *p)
{
	plan_item_t *items = calloc(p->count ? p->count : 1, sizeof(*items));
	rng_t r = {p->seed};
	uint64_t total = 0;
	if (!items)
		return NULL;
	for (uint64_t k = 0; k < p->count; k++) {
		items[k].len = p->lens_kind == LENS_LADDER ? ladder[k % RW_ARRAY_SIZE(ladder)]
							    : rng_range(&r, p->min_len, p->max_len);
		total += items[k].len;
	}
	if (total > p->region_size) {
		free(items);
		return NULL;
	}
	uint64_t slack = p->region_size - total, off = 0;
	for (uint64_t k = 0; k < p->count; k++) {
		uint64_t gap = rng_range(&r, 0, slack / (p->count - k));
		slack -= gap;
		items[k].off = off + gap;
		off += gap + items[k].len;
	}
	for (uint64_t k = p->count; k > 1; k--) { /* Fisher-Yates: random posting order */
		uint64_t j = rng_next(&r) % k;
		plan_item_t t = items[k - 1];
		items[k - 1] = items[j];
		items[j] = t;
	}
	for (uint64_t k = 0; k < p->count; k++)
		items[k].imm = k == 0 ? 0 : k == 1 ? 0xffffffffu : (uint32_t)splitmix(p->seed ^ k);
	return items;
}

static uint8_t pattern_byte(uint64_t seed, uint64_t k, uint64_t i)
{
	return (uint8_t)(splitmix((seed * 1000003u) ^ (k << 40) ^ (i >> 3)) >> (8 * (i & 7)));
}

static void pattern_fill(uint8_t *dst, uint64_t seed, uint64_t k, uint64_t len)
{
	uint64_t i = 0;
	for (; i < len && (i & 7); i++)
		dst[i] = pattern_byte(seed, k, i);
	for (; i + 8 <= len; i += 8) {
		uint64_t w = splitmix((seed * 1000003u) ^ (k << 40) ^ (i >> 3));
		memcpy(dst + i, &w, 8); /* little-endian: byte j of w is pattern_byte(i + j) */
	}
	for (; i < len; i++)
		dst[i] = pattern_byte(seed, k, i);
}

static int pattern_ok(const uint8_t *src, uint64_t seed, uint64_t k, uint64_t len)
{
	uint64_t i = 0;
	for (; i < len && (i & 7); i++)
		if (src[i] != pattern_byte(seed, k, i))
			return 0;
	for (; i + 8 <= len; i += 8) {
		uint64_t w = splitmix((seed * 1000003u) ^ (k << 40) ^ (i >> 3));
		if (memcmp(src + i, &w, 8) != 0)
			return 0;
	}
	for (; i < len; i++)
		if (src[i] != pattern_byte(seed, k, i))
			return 0;
	return 1;
}

/* ---- endpoint: a device, its regions, one connection, a writer and a verifier --------------- */

static void on_connected(rw_rail_conn_t *conn, void *ctx)
{
	endpoint_t *ep = ctx;
	if (conn->accepted) {
		if (ep->conn && ep->conn != conn)
			rw_rail_conn_close(ep->conn); /* one live connection per test */
		ep->conn = conn;
		ep->accepted_tag = conn->tag;
	}
	ep->connected++;
}

static void on_error(rw_rail_conn_t *conn, void *ctx, rw_status_t st)
{
	endpoint_t *ep = ctx;
	(void)conn;
	ep->errors++;
	ep->last_error = st;
}

static void on_write_done(rw_rail_conn_t *conn, void *ctx, void *write_ctx, rw_status_t st)
{
	endpoint_t *ep = ctx;
	(void)conn;
	if ((uint64_t)(uintptr_t)write_ctx != ep->done)
		ep->order_bad++;
	ep->done++;
	if (ep->kill_after_pid > 0) {
		kill(ep->kill_after_pid, SIGKILL);
		ep->kill_after_pid = 0;
	}
	if (st == RW_OK)
		ep->done_ok++;
	else
		ep->done_err++;
}

static void on_arrival(rw_rail_conn_t *conn, void *ctx, const rw_rail_arrival_t *a)
{
	endpoint_t *ep = ctx;
	if (!ep->verifying || ep->arrivals >= ep->vp.count) {
		ep->extra++;
		return;
	}
	uint64_t k = ep->arrivals++;
	const plan_item_t *it = &ep->vitems[k];
	if (a->imm != it->imm)
		ep->bad_imm++;
	if (a->length != it->len)
		ep->bad_len++;
	if ((conn->dev->caps.flags & RW_RAIL_CAP_ARRIVAL_WHERE) &&
	    (a->region != ep->vdst->region || a->offset != it->off))
		ep->bad_where++;
	if (!pattern_ok(ep->vdst->mem + it->off, ep->vp.seed, k, it->len))
		ep->bad_data++;
	if (ep->kill_after_pid > 0) {
		kill(ep->kill_after_pid, SIGKILL); /* from inside the callback: mid-transfer */
		ep->kill_after_pid = 0;
	}
	if (ep->dereg_after && ep->arrivals == ep->dereg_after) {
		/* Later writes are still landing, landed but not reported, or not sent yet:
		 * none of their bytes may reach the region from here on. */
		rw_rail_dereg(ep->vdst->region);
		ep->vdst->region = NULL;
		memset(ep->vdst->mem, 0xee, ep->vdst->size);
		ep->verifying = 0;
	}
	if (ep->drop_after && ep->arrivals == ep->drop_after) {
		rw_rail_conn_close(conn); /* abrupt close from inside the callback */
		ep->conn = NULL;
	}
}

static void on_writable(rw_rail_conn_t *conn, void *ctx)
{
	endpoint_t *ep = ctx;
	(void)conn;
	ep->writable++;
	writer_pump(ep);
}

const rw_rail_conn_cbs_t cbs = {
	.on_connected = on_connected,
	.on_error = on_error,
	.on_write_done = on_write_done,
	.on_arrival = on_arrival,
	.on_writable = on_writable,
};

void writer_pump(endpoint_t *ep)
{
	while (ep->writing && ep->posted < ep->wp.count && ep->posted < ep->post_limit && ep->conn) {
		const plan_item_t *it = &ep->witems[ep->posted];
		rw_rail_write_t w = {
			.local = ep->wsrc->region,
			.local_offset = it->off + ep->wp.src_shift,
			.length = it->len,
			.remote = ep->wremote,
			.remote_offset = it->off,
			.imm = it->imm,
			.ctx = (void *)(uintptr_t)ep->posted,
		};
		rw_status_t st = rw_rail_write(ep->conn, &w);
		if (st == RW_ERR_AGAIN) {
			ep->again++;
			return; /* on_writable() resumes */
		}
		if (st != RW_OK) {
			ep->post_err++;
			ep->writing = 0;
			return;
		}
		ep->posted++;
	}
}

rw_status_t ep_open(endpoint_t *ep, struct ev_loop *loop, const char *local,
			   uint32_t max_writes, uint64_t pace_bps)
{
	memset(ep, 0, sizeof(*ep));
	ep->loop = loop;
	ep->post_limit = UINT64_MAX;
	/* Several copiers (shm; others ignore it), paced too: chunks of one connection's writes
	 * land out of order and must still be published, and reported, in posting order. */
	rw_rail_config_t cfg = {.transport = opt.transport, .local = local, .rail = opt.rail,
				.max_writes = max_writes, .pace_bps = pace_bps, .copy_threads = 3};
	return rw_rail_dev_open(&cfg, loop, &ep->dev);
}

region_buf_t *ep_region(endpoint_t *ep, uint64_t size, int fill)
{
	for (int i = 0; i < MAX_REGIONS; i++) {
		region_buf_t *rb = &ep->regions[i];
		if (rb->region)
			continue;
		rb->mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (rb->mem == MAP_FAILED) {
			rb->mem = NULL;
			return NULL;
		}
		memset(rb->mem, fill, size);
		rb->size = size;
		if (rw_rail_reg_host(ep->dev, rb->mem, size, &rb->region) != RW_OK) {
			munmap(rb->mem, size);
			rb->mem = NULL;
			return NULL;
		}
		return rb;
	}
	return NULL;
}

void ep_region_free(region_buf_t *rb)
{
	if (!rb->region)
		return;
	rw_rail_dereg(rb->region);
	munmap(rb->mem, rb->size);
	memset(rb, 0, sizeof(*rb));
}

void ep_reset(endpoint_t *ep)
{
	if (ep->conn)
		rw_rail_conn_close(ep->conn);
	ep->conn = NULL;
	for (int i = 0; i < MAX_REGIONS; i++)
		ep_region_free(&ep->regions[i]);
	free(ep->witems);
	free(ep->vitems);
	struct ev_loop *loop = ep->loop;
	rw_rail_dev_t *dev = ep->dev;
	rw_rail_listener_t *l = ep->listener;
	memset(ep, 0, sizeof(*ep));
	ep->loop = loop;
	ep->dev = dev;
	ep->listener = l;
	ep->post_limit = UINT64_MAX;
}

void ep_close(endpoint_t *ep)
{
	ep_reset(ep);
	rw_rail_listener_close(ep->listener);
	rw_rail_dev_close(ep->dev);
	ep->dev = NULL;
	ep->listener = NULL;
}

/* Start writing plan p from a fresh source region to the remote region. */
int writer_start(endpoint_t *ep, const plan_params_t *p, rw_rail_remote_t remote)
{
	ep->wp = *p;
	free(ep->witems);
	ep->witems = plan_make(p);
	ep->wsrc = ep_region(ep, p->region_size + p->src_shift, 0);
	if (!ep->witems || !ep->wsrc)
		return -1;
	for (uint64_t k = 0; k < p->count; k++)
		pattern_fill(ep->wsrc->mem + ep->witems[k].off + p->src_shift, p->seed, k,
			     ep->witems[k].len);
	ep->wremote = remote;
	ep->posted = ep->done = ep->done_ok = ep->done_err = 0;
	ep->again = ep->writable = ep->order_bad = ep->post_err = 0;
	ep->writing = 1;
	writer_pump(ep);
	return 0;
}

int verifier_start(endpoint_t *ep, const plan_params_t *p, region_buf_t *dst)
{
	ep->vp = *p;
	free(ep->vitems);
	ep->vitems = plan_make(p);
	ep->vdst = dst;
	ep->arrivals = ep->bad_data = ep->bad_imm = ep->bad_len = ep->bad_where = ep->extra = 0;
	ep->verifying = ep->vitems != NULL;
	return ep->verifying ? 0 : -1;
}

/* ---- running the loop until something happens, with a hang guard ------------------------- */

void watchdog_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	*(int *)w->data = 1;
}

/* Returns 1 when pred became true, 0 when the watchdog fired (a hang). */
int run_until(endpoint_t *ep, pred_fn pred)
{
	int fired = 0;
	ev_timer wd;
	ev_timer_init(&wd, watchdog_cb, WATCHDOG_S, 0.);
	wd.data = &fired;
	ev_timer_start(ep->loop, &wd);
	while (!pred(ep) && !fired)
		ev_run(ep->loop, EVRUN_ONCE);
	ev_timer_stop(ep->loop, &wd);
	return !fired;
}

int pred_connected(endpoint_t *ep) { return ep->connected > 0 || ep->errors > 0; }
int pred_errored(endpoint_t *ep) { return ep->errors > 0; }
int pred_writes_done(endpoint_t *ep)
{
	return ep->errors > 0 || ep->post_err > 0 || ep->done == ep->wp.count;
}
int pred_failed_and_drained(endpoint_t *ep)
{
	return ep->errors > 0 && ep->done == ep->posted;
}
uint64_t pred_threshold;
int pred_posted_done(endpoint_t *ep) { return ep->errors > 0 || ep->done == ep->posted; }
int pred_done_ge(endpoint_t *ep) { return ep->errors > 0 || ep->done >= pred_threshold; }
int pred_arrivals_ge(endpoint_t *ep)
{
	return ep->errors > 0 || ep->arrivals >= pred_threshold;
}
int pred_arrivals_done(endpoint_t *ep)
{
	return ep->errors > 0 || ep->arrivals >= ep->vp.count ||
	       (ep->drop_after && ep->arrivals >= ep->drop_after);
}

/* ---- control channel ---------------------------------------------------------------------- */

/* Move one whole message: send it, or receive it; each wait is bounded by the watchdog's time.
 * 0, or -1 on EOF, error or that timeout. */
static int ctl_xfer(int fd, ctl_msg_t *m, int out)
{
	uint8_t *p = (uint8_t *)m;
	for (size_t left = sizeof(*m); left;) {
		struct pollfd pfd = {.fd = fd, .events = out ? POLLOUT : POLLIN};
		if (poll(&pfd, 1, (int)(WATCHDOG_S * 1000)) <= 0)
			return -1;
		ssize_t n = out ? send(fd, p, left, MSG_NOSIGNAL) : recv(fd, p, left, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		p += n;
		left -= (size_t)n;
	}
	return 0;
}

int ctl_send(int fd, const ctl_msg_t *m)
{
	ctl_msg_t copy = *m;
	return ctl_xfer(fd, &copy, 1);
}

static int ctl_recv(int fd, ctl_msg_t *m)
{
	return ctl_xfer(fd, m, 0);
}

void plan_to_msg(const plan_params_t *p, ctl_msg_t *m)
{
	m->a[0] = p->seed, m->a[1] = p->count, m->a[2] = p->region_size, m->a[3] = p->min_len;
	m->a[4] = p->max_len, m->a[5] = p->src_shift, m->a[6] = p->lens_kind;
}

static plan_params_t plan_from_msg(const ctl_msg_t *m)
{
	plan_params_t p = {.seed = m->a[0], .count = m->a[1], .region_size = m->a[2],
			   .min_len = m->a[3], .max_len = m->a[4], .src_shift = m->a[5],
			   .lens_kind = m->a[6]};
	return p;
}

/* ---- responder (role b): event-driven, steered by control messages ------------------------ */

static void responder_reply_verdict(responder_t *r)
{
	endpoint_t *ep = &r->ep;
	ctl_msg_t m = {.op = OP_VERDICT};
	if (r->pending == OP_EXPECT) {
		m.a[0] = ep->arrivals, m.a[1] = ep->bad_data, m.a[2] = ep->bad_imm;
		m.a[3] = ep->bad_len, m.a[4] = ep->bad_where, m.a[5] = ep->extra;
		m.a[6] = (uint64_t)ep->errors;
		ep->verifying = 0;
	} else {
		m.a[0] = ep->done, m.a[1] = ep->done_ok, m.a[2] = ep->done_err;
		m.a[3] = ep->order_bad, m.a[4] = ep->post_err, m.a[6] = (uint64_t)ep->errors;
		ep->writing = 0;
	}
	m.status = (uint32_t)-ep->last_error;
	r->pending = 0;
	ctl_send(r->ctl_fd, &m);
}

/* Before every loop iteration: is the owed verdict ready? */
static void responder_prepare(struct ev_loop *loop, ev_prepare *w, int revents)
{
	(void)loop;
	(void)revents;
	responder_t *r = w->data;
	endpoint_t *ep = &r->ep;
	if (r->pending == OP_EXPECT && pred_arrivals_done(ep)) {
		responder_reply_verdict(r);
	} else if (r->pending == OP_WRITE_TO) {
		if (!r->started && ep->connected && !ep->errors) {
			r->started = 1;
			if (writer_start(ep, &ep->wp, ep->wremote) < 0)
				ep->post_err++;
		}
		if (ep->errors || (r->started && pred_writes_done(ep)))
			responder_reply_verdict(r);
	}
}

static void responder_ctl(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	responder_t *r = w->data;
	endpoint_t *ep = &r->ep;
	ctl_msg_t m, reply = {.op = 0};
	if (ctl_recv(r->ctl_fd, &m) < 0 || m.op == OP_QUIT) {
		r->quit = 1;
		ev_break(loop, EVBREAK_ALL);
		return;
	}
	reply.op = m.op;
	switch (m.op) {
	case OP_REGION: {
		region_buf_t *rb = ep_region(ep, m.a[0], (int)m.a[1]);
		if (!rb) {
			reply.status = 1;
			break;
		}
		rw_rail_region_desc_pack(rb->region, reply.desc);
		reply.a[0] = (uint64_t)(rb - ep->regions);
		break;
	}
	case OP_EXPECT: {
		plan_params_t p = plan_from_msg(&m);
		ep->errors = 0;
		ep->drop_after = m.status;
		if (m.a[7] >= MAX_REGIONS || verifier_start(ep, &p, &ep->regions[m.a[7]]) < 0) {
			reply.status = 1;
			break;
		}
		r->pending = OP_EXPECT;
		break; /* armed before the driver starts writing; the verdict follows */
	}
	case OP_CHECK: {
		plan_params_t p = plan_from_msg(&m);
		plan_item_t *items = plan_make(&p);
		region_buf_t *rb = m.a[7] < MAX_REGIONS ? &ep->regions[m.a[7]] : NULL;
		if (!items || !rb || !rb->mem) {
			free(items);
			reply.status = 1;
			break;
		}
		for (uint64_t k = 0; k < m.status && k < p.count; k++)
			if (!pattern_ok(rb->mem + items[k].off, p.seed, k, items[k].len))
				reply.a[0]++;
		free(items);
		break;
	}
	case OP_WRITE_TO: {
		plan_params_t p = plan_from_msg(&m);
		rw_rail_remote_t remote;
		if (rw_rail_remote_unpack(m.desc, sizeof(m.desc), &remote) != RW_OK ||
		    rw_rail_connect(ep->dev, m.s, 7, &cbs, ep, &ep->conn) != RW_OK) {
			reply.status = 1;
			break;
		}
		ep->errors = 0;
		ep->connected = 0;
		ep->wp = p; /* started once connected: see responder_prepare() */
		ep->wremote = remote;
		r->pending = OP_WRITE_TO;
		r->started = 0;
		return; /* the verdict is the reply */
	}
	case OP_DEREG: {
		region_buf_t *rb = m.a[0] < MAX_REGIONS ? &ep->regions[m.a[0]] : NULL;
		if (!rb || !rb->region) {
			reply.status = 1;
			break;
		}
		rw_rail_dereg(rb->region);
		rb->region = NULL;
		munmap(rb->mem, rb->size);
		memset(rb, 0, sizeof(*rb));
		break;
	}
	case OP_RESET:
		r->pending = 0; /* a verdict still owed is dropped: the driver moved on */
		ep_reset(ep);
		break;
	default:
		reply.status = 1;
	}
	ctl_send(r->ctl_fd, &reply);
}

/* Run a responder on loop with local rail address local until the driver says quit. */
static int responder_main(int ctl_fd, const char *local)
{
	responder_t r = {.ctl_fd = ctl_fd};
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	int rc = 1;
	if (!loop)
		return 1;
	if (ep_open(&r.ep, loop, local, 0, opt.pace_bps) != RW_OK)
		goto out_loop;
	if (rw_rail_listen(r.ep.dev, &cbs, &r.ep, &r.ep.listener) != RW_OK)
		goto out_ep;
	ctl_msg_t hello = {.op = OP_HELLO};
	snprintf(hello.s, sizeof(hello.s), "%s", r.ep.listener->addr);
	if (ctl_send(ctl_fd, &hello) < 0)
		goto out_ep;
	ev_io_init(&r.ctl_io, responder_ctl, ctl_fd, EV_READ);
	r.ctl_io.data = &r;
	ev_io_start(loop, &r.ctl_io);
	ev_prepare_init(&r.prep, responder_prepare);
	r.prep.data = &r;
	ev_prepare_start(loop, &r.prep);
	while (!r.quit)
		ev_run(loop, 0);
	ev_prepare_stop(loop, &r.prep);
	ev_io_stop(loop, &r.ctl_io);
	rc = 0;
out_ep:
	ep_close(&r.ep);
out_loop:
	ev_loop_destroy(loop);
	return rc;
}

/* ---- the driver's view of a responder ----------------------------------------------------- */

static void *responder_thread(void *p)
{
	thread_arg_t *a = p;
	responder_main(a->fd, a->local);
	close(a->fd);
	free(a);
	return NULL;
}

static int peer_hello(peer_t *pr)
{
	ctl_msg_t m;
	if (ctl_recv(pr->ctl_fd, &m) < 0 || m.op != OP_HELLO)
		return -1;
	snprintf(pr->rail_addr, sizeof(pr->rail_addr), "%s", m.s);
	return 0;
}

static int peer_start_thread(peer_t *pr, const char *local)
{
	int sv[2];
	memset(pr, 0, sizeof(*pr));
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		return -1;
	thread_arg_t *a = malloc(sizeof(*a));
	a->fd = sv[1];
	a->local = local;
	pr->ctl_fd = sv[0];
	pr->is_thread = 1;
	if (pthread_create(&pr->thread, NULL, responder_thread, a) != 0) {
		free(a);
		close(sv[0]);
		close(sv[1]);
		return -1;
	}
	return peer_hello(pr);
}

/* A responder in a child process (exec of this program), so that it can be killed. */
int peer_start_child(peer_t *pr, const char *local)
{
	int sv[2];
	memset(pr, 0, sizeof(*pr));
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		return -1;
	pid_t pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		char fdarg[32], localarg[96], transportarg[64], railarg[32], pacearg[48];
		int fd = dup(sv[1]); /* without CLOEXEC */
		snprintf(fdarg, sizeof(fdarg), "--ctl-fd=%d", fd);
		snprintf(localarg, sizeof(localarg), "--local=%s", local);
		snprintf(transportarg, sizeof(transportarg), "--transport=%s", opt.transport);
		snprintf(railarg, sizeof(railarg), "--rail=%u", opt.rail);
		snprintf(pacearg, sizeof(pacearg), "--pace=%llu", (unsigned long long)opt.pace_bps);
		execl("/proc/self/exe", "rail_conformance", "--role=b", fdarg, localarg,
		      transportarg, railarg, pacearg, (char *)NULL);
		_exit(127);
	}
	close(sv[1]);
	pr->ctl_fd = sv[0];
	pr->pid = pid;
	return peer_hello(pr);
}

static int peer_start_remote(peer_t *pr, const char *ctl_addr)
{
	char ip[64];
	const char *colon = strrchr(ctl_addr, ':');
	struct sockaddr_in sa = {.sin_family = AF_INET};
	memset(pr, 0, sizeof(*pr));
	if (!colon || (size_t)(colon - ctl_addr) >= sizeof(ip))
		return -1;
	memcpy(ip, ctl_addr, (size_t)(colon - ctl_addr));
	ip[colon - ctl_addr] = '\0';
	if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1)
		return -1;
	sa.sin_port = htons((uint16_t)atoi(colon + 1));
	for (int attempt = 0; attempt < 100; attempt++) { /* the peer may still be starting */
		pr->ctl_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (connect(pr->ctl_fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
			return peer_hello(pr);
		close(pr->ctl_fd);
		usleep(100 * 1000);
	}
	return -1;
}

void peer_stop(peer_t *pr)
{
	ctl_msg_t m = {.op = OP_QUIT};
	if (pr->pid > 0) {
		kill(pr->pid, SIGKILL);
		waitpid(pr->pid, NULL, 0);
	} else {
		ctl_send(pr->ctl_fd, &m);
	}
	if (pr->is_thread)
		pthread_join(pr->thread, NULL);
	close(pr->ctl_fd);
	pr->ctl_fd = -1;
}

int peer_call(peer_t *pr, ctl_msg_t *m)
{
	uint32_t op = m->op;
	if (ctl_send(pr->ctl_fd, m) < 0)
		return -1;
	do { /* skip a verdict left over from a failed test */
		if (ctl_recv(pr->ctl_fd, m) < 0)
			return -1;
	} while (m->op == OP_VERDICT && op != OP_VERDICT);
	return m->op == op && m->status == 0 ? 0 : -1;
}

/* ---- fixtures ------------------------------------------------------------------------------ */

static int group_setup(void **state)
{
	fixture_t *f = calloc(1, sizeof(*f));
	f->loop = ev_loop_new(EVFLAG_AUTO);
	if (ep_open(&f->ep, f->loop, opt.local, 0, opt.pace_bps) != RW_OK) {
		fprintf(stderr, "cannot open %s rail device at %s: skipping\n", opt.transport,
			opt.local);
		ev_loop_destroy(f->loop);
		free(f);
		return -1;
	}
	if (rw_rail_listen(f->ep.dev, &cbs, &f->ep, &f->ep.listener) != RW_OK)
		return -1;
	f->remote = opt.peer != NULL;
	if (f->remote ? peer_start_remote(&f->peer, opt.peer)
		      : peer_start_thread(&f->peer, opt.peer_local) < 0)
		return -1;
	*state = f;
	return 0;
}

static int group_teardown(void **state)
{
	fixture_t *f = *state;
	if (!f)
		return 0;
	peer_stop(&f->peer);
	ep_close(&f->ep);
	ev_loop_destroy(f->loop);
	free(f);
	return 0;
}

int test_teardown(void **state)
{
	fixture_t *f = *state;
	ctl_msg_t m = {.op = OP_RESET};
	ep_reset(&f->ep);
	if (f->peer.ctl_fd >= 0)
		peer_call(&f->peer, &m);
	return 0;
}

/* Connect the driver to the responder (fresh connection per test). */
void connect_peer(fixture_t *f, peer_t *pr)
{
	endpoint_t *ep = &f->ep;
	ep->connected = ep->errors = 0;
	assert_int_equal(rw_rail_connect(ep->dev, pr->rail_addr, 42, &cbs, ep, &ep->conn), RW_OK);
	assert_int_equal(ep->conn->state, RW_RAIL_CONN_CONNECTING);
	assert_true(run_until(ep, pred_connected));
	assert_int_equal(ep->errors, 0);
	assert_int_equal(ep->conn->state, RW_RAIL_CONN_UP);
}

rw_rail_remote_t peer_region(peer_t *pr, uint64_t size, uint64_t *index_p)
{
	ctl_msg_t m = {.op = OP_REGION, .a = {size, 0x5a}};
	rw_rail_remote_t remote = {0};
	assert_int_equal(peer_call(pr, &m), 0);
	assert_int_equal(rw_rail_remote_unpack(m.desc, sizeof(m.desc), &remote), RW_OK);
	assert_int_equal(remote.length, size);
	*index_p = m.a[0];
	return remote;
}

void peer_expect(peer_t *pr, const plan_params_t *p, uint64_t index, uint32_t drop_after)
{
	ctl_msg_t m = {.op = OP_EXPECT, .status = drop_after};
	plan_to_msg(p, &m);
	m.a[7] = index;
	assert_int_equal(peer_call(pr, &m), 0); /* armed: writes may start */
}

ctl_msg_t peer_verdict(peer_t *pr)
{
	ctl_msg_t m;
	assert_int_equal(ctl_recv(pr->ctl_fd, &m), 0);
	assert_int_equal(m.op, OP_VERDICT);
	return m;
}

/* The core scenario: write plan p to a fresh responder region; everything verified. */
void write_plan_and_verify(fixture_t *f, const plan_params_t *p)
{
	endpoint_t *ep = &f->ep;
	uint64_t index;
	connect_peer(f, &f->peer);
	rw_rail_remote_t remote = peer_region(&f->peer, p->region_size, &index);
	peer_expect(&f->peer, p, index, 0);
	assert_int_equal(writer_start(ep, p, remote), 0);
	assert_true(run_until(ep, pred_writes_done));
	assert_int_equal(ep->errors, 0);
	assert_int_equal(ep->post_err, 0);
	assert_int_equal(ep->done, p->count);
	assert_int_equal(ep->done_ok, p->count);
	assert_int_equal(ep->order_bad, 0); /* on_write_done in posting order */
	ctl_msg_t v = peer_verdict(&f->peer);
	assert_int_equal(v.a[0], p->count); /* arrivals */
	assert_int_equal(v.a[1], 0);        /* data in place when the arrival was reported */
	assert_int_equal(v.a[2], 0);        /* immediates, in posting order */
	assert_int_equal(v.a[3], 0);        /* lengths */
	assert_int_equal(v.a[4], 0);        /* region and offset */
	assert_int_equal(v.a[5], 0);        /* no extra arrivals */
	assert_int_equal(v.a[6], 0);        /* no connection errors at the target */
}

/* ---- main --------------------------------------------------------------------------------- */

static void usage(void)
{
	fprintf(stderr,
		"usage: rail_conformance [--transport=tcp|shm|verbs] [--rail=R]\n"
		"  one machine (default): --local=127.0.R.1, responder thread on 127.0.R.2\n"
		"    (--peer-local=ADDR), killable responder/writer child on 127.0.R.3\n"
		"    (--child-local=ADDR); all three may be one address\n"
		"  two machines: on B: --role=b --local=RAIL_ADDR_B --ctl=IP:PORT\n"
		"                on A: --role=a --local=RAIL_ADDR_A --peer=IP_OF_B:PORT\n"
		"  --seed=N  plan seed (printed)\n"
		"  --pace=BPS  pace every device at BPS bits/s (stress run; default unpaced)\n"
		"  --tests=SUB[,SUB...]  run only the tests whose names contain one of these\n");
}

static int ctl_listen_accept(const char *addr)
{
	char ip[64];
	const char *colon = strrchr(addr, ':');
	struct sockaddr_in sa = {.sin_family = AF_INET};
	if (!colon || (size_t)(colon - addr) >= sizeof(ip))
		return -1;
	memcpy(ip, addr, (size_t)(colon - addr));
	ip[colon - addr] = '\0';
	if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1)
		return -1;
	sa.sin_port = htons((uint16_t)atoi(colon + 1));
	int one = 1, l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(l, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(l, 1) < 0) {
		perror("ctl listen");
		close(l);
		return -1;
	}
	int fd = accept(l, NULL, NULL);
	close(l);
	return fd;
}

int rh_main(int argc, char **argv, const char *default_transport, const struct CMUnitTest *tests,
	    size_t n_tests)
{
	opt.transport = default_transport;
	opt.seed = 20240601;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strncmp(a, "--transport=", 12)) opt.transport = a + 12;
		else if (!strncmp(a, "--role=", 7)) opt.role = a + 7;
		else if (!strncmp(a, "--rail=", 7)) opt.rail = (unsigned)atoi(a + 7);
		else if (!strncmp(a, "--local=", 8)) opt.local = a + 8;
		else if (!strncmp(a, "--peer=", 7)) opt.peer = a + 7;
		else if (!strncmp(a, "--ctl=", 6)) opt.ctl = a + 6;
		else if (!strncmp(a, "--ctl-fd=", 9)) opt.ctl_fd = atoi(a + 9);
		else if (!strncmp(a, "--seed=", 7)) opt.seed = strtoull(a + 7, NULL, 0);
		else if (!strncmp(a, "--peer-local=", 13)) opt.peer_local = a + 13;
		else if (!strncmp(a, "--child-local=", 14)) opt.child_local = a + 14;
		else if (!strncmp(a, "--pace=", 7)) opt.pace_bps = strtoull(a + 7, NULL, 0);
		else if (!strncmp(a, "--tests=", 8)) opt.tests = a + 8;
		else { usage(); return 2; }
	}
	if (getenv("RW_RAIL_DEBUG"))
		rw_log_set_level(RW_LOG_DEBUG);
	else
		rw_log_set_level(RW_LOG_ERROR);
	signal(SIGPIPE, SIG_IGN);
	snprintf(local_buf[0], sizeof(local_buf[0]), "127.0.%u.1", opt.rail);
	snprintf(local_buf[1], sizeof(local_buf[1]), "127.0.%u.2", opt.rail);
	snprintf(local_buf[2], sizeof(local_buf[2]), "127.0.%u.3", opt.rail);
	if (!strcmp(opt.role, "b")) {
		rw_log_set_ident("conformance[b]");
		int fd = opt.ctl_fd >= 0 ? opt.ctl_fd : opt.ctl ? ctl_listen_accept(opt.ctl) : -1;
		if (fd < 0) {
			usage();
			return 2;
		}
		int rc = responder_main(fd, opt.local ? opt.local : local_buf[1]);
		close(fd);
		return rc;
	}
	rw_log_set_ident("conformance[a]");
	if (!opt.local)
		opt.local = local_buf[0];
	if (!opt.peer_local)
		opt.peer_local = local_buf[1];
	if (!opt.child_local)
		opt.child_local = local_buf[2];
	printf("rail conformance: transport %s, rail %u, local %s, peer %s, seed %llu%s\n",
	       opt.transport, opt.rail, opt.local, opt.peer ? opt.peer : opt.peer_local,
	       (unsigned long long)opt.seed, opt.pace_bps ? ", paced" : "");
	if (!rw_rail_transport_find(opt.transport)) {
		printf("transport %s not built (have: %s): skipping\n", opt.transport,
		       rw_rail_transport_names());
		return 77;
	}
	{ /* no device for this transport here (e.g. verbs without an RDMA NIC): skip */
		struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
		rw_rail_config_t cfg = {.transport = opt.transport, .local = opt.local,
					.rail = opt.rail};
		rw_rail_dev_t *dev = NULL;
		rw_status_t st = rw_rail_dev_open(&cfg, loop, &dev);
		rw_rail_dev_close(dev);
		ev_loop_destroy(loop);
		if (st != RW_OK) {
			printf("no %s device at %s (%s): skipping\n", opt.transport, opt.local,
			       rw_status_str(st));
			return 77;
		}
	}
	struct CMUnitTest chosen[RH_MAX_TESTS];
	if (n_tests > RH_MAX_TESTS)
		return 2;
	size_t n_chosen = 0;
	for (size_t i = 0; i < n_tests; i++) {
		int keep = !opt.tests;
		char list[256];
		snprintf(list, sizeof(list), "%s", opt.tests ? opt.tests : "");
		for (char *save, *t = strtok_r(list, ",", &save); t && !keep;
		     t = strtok_r(NULL, ",", &save))
			keep = strstr(tests[i].name, t) != NULL;
		if (keep)
			chosen[n_chosen++] = tests[i];
	}
	if (n_chosen == 0) {
		fprintf(stderr, "--tests=%s matches no test\n", opt.tests);
		return 2;
	}
	char name[64];
	snprintf(name, sizeof(name), "rail_conformance_%s", opt.transport);
	return _cmocka_run_group_tests(name, chosen, n_chosen, group_setup, group_teardown);
}
