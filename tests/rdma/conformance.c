/* Rail transport conformance suite: the contract of rdma/rail.h, checked against one transport
 * (RW_CONF_TRANSPORT at build time, --transport= at run time). docs/rdma.md explains the modes.
 * This file holds the cases, by family (registration and argument checks, data movement,
 * failures, what worker threads make new, rate pacing, hostile peers per wire format); the
 * harness they run on (endpoints, the responder it steers over a control channel, the seeded
 * write plans, the watchdog, main) is tests/lib/rail_harness.[ch]. Nothing here measures time. */
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
#include "rdma/shm_priv.h"
#include "rdma/tcp_wire.h"
#include "tests/lib/rail_harness.h"

#ifndef RW_CONF_TRANSPORT
#define RW_CONF_TRANSPORT "tcp"
#endif

/* ---- tests: registration and argument checks ----------------------------------------------- */

static void test_registry(void **state)
{
	(void)state;
	assert_non_null(rw_rail_transport_find("tcp"));
	assert_non_null(rw_rail_transport_find(opt.transport));
	assert_null(rw_rail_transport_find("carrier-pigeon"));
	rw_rail_dev_t *dev = NULL;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_rail_config_t cfg = {.transport = "carrier-pigeon", .local = "127.0.0.1"};
	assert_int_equal(rw_rail_dev_open(&cfg, loop, &dev), RW_ERR_NOTFOUND);
	assert_null(dev);
	if (strcmp(opt.transport, "tcp") == 0) {
		cfg.transport = "tcp";
		cfg.local = "192.0.2.1"; /* TEST-NET-1: not an address of this host */
		assert_int_equal(rw_rail_dev_open(&cfg, loop, &dev), RW_ERR_NOTFOUND);
		cfg.local = "not-an-address";
		assert_int_equal(rw_rail_dev_open(&cfg, loop, &dev), RW_ERR_INVAL);
		assert_null(dev);
	}
	ev_loop_destroy(loop);
}

/* One address syntax for every transport (rdma/rail.c). */
static void test_addr_parse(void **state)
{
	(void)state;
	uint32_t ip = 0;
	uint16_t port = 0;
	assert_int_equal(rw_rail_addr_parse("169.254.2.1:18515", &ip, &port), RW_OK);
	assert_int_equal(ip, inet_addr("169.254.2.1"));
	assert_int_equal(port, 18515);
	static const char *bad[] = {
		"", ":1", "169.254.2.1", "169.254.2.1:", "169.254.2.1:0", "169.254.2.1:65536",
		"169.254.2.1:12x", "169.254.2.1:-1", "169.254.2.1:+80", "169.254.2.1: 80",
		"host:80", "1.2.3:80", "[::1]:80", "1.2.3.4:5:6",
		"definitely not an address",
	};
	for (size_t i = 0; i < RW_ARRAY_SIZE(bad); i++)
		assert_int_equal(rw_rail_addr_parse(bad[i], &ip, &port), RW_ERR_INVAL);
	assert_int_equal(rw_rail_addr_parse(NULL, &ip, &port), RW_ERR_INVAL);
	assert_int_equal(port, 18515); /* untouched on failure */
}

static void test_registration(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	region_buf_t *a = ep_region(ep, 4096, 0), *b = ep_region(ep, 1 << 20, 0);
	assert_non_null(a);
	assert_non_null(b);
	assert_ptr_equal(a->region->addr, a->mem);
	assert_int_equal(a->region->length, 4096);
	assert_ptr_equal(a->region->dev, ep->dev);
	assert_true(a->region->key != b->region->key);

	uint8_t desc[RW_RAIL_DESC_SIZE];
	rw_rail_remote_t remote = {0};
	rw_rail_region_desc_pack(b->region, desc);
	assert_int_equal(rw_rail_remote_unpack(desc, sizeof(desc), &remote), RW_OK);
	assert_int_equal(remote.key, b->region->key);
	assert_int_equal(remote.length, 1 << 20);
	assert_int_equal(remote.base, b->region->base);
	/* Untrusted descriptors: wrong size, magic, version; output untouched on failure. */
	rw_rail_remote_t untouched = {.key = 99};
	assert_int_equal(rw_rail_remote_unpack(desc, sizeof(desc) - 1, &untouched), RW_ERR_PARSE);
	desc[0] ^= 1;
	assert_int_equal(rw_rail_remote_unpack(desc, sizeof(desc), &untouched), RW_ERR_PARSE);
	desc[0] ^= 1;
	desc[4] = 77;
	assert_int_equal(rw_rail_remote_unpack(desc, sizeof(desc), &untouched), RW_ERR_PARSE);
	assert_int_equal(untouched.key, 99);

	/* Bad arguments. */
	rw_rail_region_t *r = NULL;
	assert_int_equal(rw_rail_reg_host(ep->dev, a->mem, 0, &r), RW_ERR_INVAL);
	assert_int_equal(rw_rail_reg_host(ep->dev, NULL, 10, &r), RW_ERR_INVAL);
	assert_null(r);
	if (strcmp(opt.transport, "shm") == 0) { /* shm shares pages: none may be in two regions */
		assert_int_equal(rw_rail_reg_host(ep->dev, b->mem + 4096, 4096, &r), RW_ERR_INVAL);
		assert_int_equal(rw_rail_reg_host(ep->dev, b->mem + 100, 16, &r), RW_ERR_INVAL);
		assert_null(r);
	}

	/* dmabuf: a memfd is not a dmabuf; tcp cannot register dmabufs at all. */
	int fd = memfd_create("not-a-dmabuf", MFD_CLOEXEC);
	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, 4096), 0);
	rw_status_t st = rw_rail_reg_dmabuf(ep->dev, fd, 0, 4096, 0, &r);
	assert_int_not_equal(st, RW_OK);
	assert_null(r);
	if (!(ep->dev->caps.flags & RW_RAIL_CAP_DMABUF))
		assert_int_equal(st, RW_ERR_UNSUPPORTED);
	close(fd);
	assert_int_equal(rw_rail_reg_dmabuf(ep->dev, -1, 0, 4096, 0, &r), RW_ERR_INVAL);
}

static void test_write_checks(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	uint64_t index;
	region_buf_t *src = ep_region(ep, 4096, 1);
	rw_rail_remote_t remote = peer_region(&f->peer, 4096, &index);
	rw_rail_write_t w = {.local = src->region, .length = 16, .remote = remote};

	/* Not connected yet: a CONNECTING connection refuses writes. */
	assert_int_equal(rw_rail_connect(ep->dev, f->peer.rail_addr, 1, &cbs, ep, &ep->conn),
			 RW_OK);
	assert_int_equal(rw_rail_write(ep->conn, &w), RW_ERR_STATE);
	assert_true(run_until(ep, pred_connected));
	assert_int_equal(ep->conn->state, RW_RAIL_CONN_UP);

	w.local_offset = 4090;
	assert_int_equal(rw_rail_write(ep->conn, &w), RW_ERR_RANGE);
	w.local_offset = 0;
	w.remote_offset = 4081;
	assert_int_equal(rw_rail_write(ep->conn, &w), RW_ERR_RANGE);
	w.remote_offset = UINT64_MAX - 4;
	assert_int_equal(rw_rail_write(ep->conn, &w), RW_ERR_RANGE);
	w.length = ep->dev->caps.max_write_length + 1;
	w.remote_offset = 0;
	assert_int_equal(rw_rail_write(ep->conn, &w), RW_ERR_RANGE);
	assert_int_equal(ep->done, 0); /* nothing was queued */
	assert_true(rw_rail_connect(ep->dev, "definitely not an address", 1, &cbs, ep,
				    &ep->conn) != RW_OK);
}

/* ---- tests: data movement ------------------------------------------------------------------ */

static void test_sizes_ladder(void **state)
{
	plan_params_t p = {.seed = opt.seed + 1, .count = 2 * RW_ARRAY_SIZE(ladder),
			   .region_size = 24u << 20, .src_shift = 13, .lens_kind = LENS_LADDER};
	write_plan_and_verify(*state, &p);
}

static void test_size_64mib(void **state)
{
	plan_params_t p = {.seed = opt.seed + 2, .count = 1, .region_size = (64u << 20) + 4099,
			   .min_len = 64u << 20, .max_len = 64u << 20, .src_shift = 5};
	write_plan_and_verify(*state, &p);
}

static void test_random_sizes_offsets(void **state)
{
	plan_params_t p = {.seed = opt.seed + 3, .count = 300, .region_size = 24u << 20,
			   .min_len = 1, .max_len = 65536, .src_shift = 4097};
	write_plan_and_verify(*state, &p);
}

/* Thousands of writes in flight on the default queue, then more than the queue holds. */
static void test_many_in_flight(void **state)
{
	fixture_t *f = *state;
	uint32_t max = f->ep.dev->caps.max_writes;
	assert_true(max >= 1024);
	plan_params_t p = {.seed = opt.seed + 4, .count = 4 * (uint64_t)max + 17,
			   .region_size = 8u << 20, .min_len = 0, .max_len = 512};
	write_plan_and_verify(f, &p);
	assert_true(f->ep.again > 0);                  /* the bound was hit ... */
	assert_true(f->ep.writable >= f->ep.again - 1); /* ... and on_writable resumed */
}

/* The queue bound itself: exactly max_writes accepted, then RW_ERR_AGAIN. */
static void test_backpressure_bound(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	uint32_t max = ep->dev->caps.max_writes;
	plan_params_t p = {.seed = opt.seed + 5, .count = max + 100, .region_size = 4u << 20,
			   .min_len = 1, .max_len = 64};
	uint64_t index;
	connect_peer(f, &f->peer);
	rw_rail_remote_t remote = peer_region(&f->peer, p.region_size, &index);
	peer_expect(&f->peer, &p, index, 0);
	/* Posting happens synchronously inside writer_start: no loop ran, nothing completed. */
	assert_int_equal(writer_start(ep, &p, remote), 0);
	assert_int_equal(ep->posted, max);
	assert_int_equal(ep->again, 1);
	assert_int_equal(ep->done, 0); /* no callback from inside rw_rail_write() */
	assert_true(run_until(ep, pred_writes_done));
	assert_int_equal(ep->done_ok, p.count);
	assert_int_equal(ep->order_bad, 0);
	assert_true(ep->writable >= 1);
	ctl_msg_t v = peer_verdict(&f->peer);
	assert_int_equal(v.a[0], p.count);
	assert_int_equal(v.a[1] + v.a[2] + v.a[3] + v.a[4] + v.a[5], 0);
}

/* Ordering rule 3: on_write_done(RW_OK) means the data is already in the remote region. */
static void test_done_means_placed(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	plan_params_t p = {.seed = opt.seed + 6, .count = 24, .region_size = 16u << 20,
			   .min_len = 1, .max_len = 512u << 10};
	uint64_t index;
	connect_peer(f, &f->peer);
	rw_rail_remote_t remote = peer_region(&f->peer, p.region_size, &index);
	ep->post_limit = 0;
	assert_int_equal(writer_start(ep, &p, remote), 0);
	for (uint64_t k = 0; k < p.count; k++) {
		ep->post_limit = k + 1;
		writer_pump(ep);
		assert_int_equal(ep->posted, k + 1);
		assert_true(run_until(ep, pred_posted_done));
		assert_int_equal(ep->done_ok, k + 1);
		ctl_msg_t m = {.op = OP_CHECK, .status = (uint32_t)(k + 1)};
		plan_to_msg(&p, &m);
		m.a[7] = index;
		assert_int_equal(peer_call(&f->peer, &m), 0);
		assert_int_equal(m.a[0], 0); /* every completed write is in place */
	}
}

/* Both directions on one connection at once: the responder writes back while we write. */
static void test_bidirectional(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	plan_params_t out = {.seed = opt.seed + 7, .count = 400, .region_size = 8u << 20,
			     .min_len = 1, .max_len = 32768};
	plan_params_t in = {.seed = opt.seed + 8, .count = 400, .region_size = 8u << 20,
			    .min_len = 1, .max_len = 32768};
	uint64_t index;
	rw_rail_remote_t remote = peer_region(&f->peer, out.region_size, &index);
	region_buf_t *dst = ep_region(ep, in.region_size, 0);
	assert_non_null(dst);
	assert_int_equal(verifier_start(ep, &in, dst), 0);
	/* The responder connects to our listener and writes `in`; we write `out` back on the
	 * connection it opened (we hold the accepted end). */
	ctl_msg_t m = {.op = OP_WRITE_TO};
	plan_to_msg(&in, &m);
	rw_rail_region_desc_pack(dst->region, m.desc);
	snprintf(m.s, sizeof(m.s), "%s", ep->listener->addr);
	assert_int_equal(ctl_send(f->peer.ctl_fd, &m), 0);
	assert_true(run_until(ep, pred_connected));
	assert_non_null(ep->conn);
	assert_true(ep->conn->accepted);
	assert_int_equal(ep->accepted_tag, 7);
	/* The responder's writes target us; ours go to its region over the same connection.
	 * It does not verify ours (its verifier is idle): we check with OP_CHECK afterwards. */
	assert_int_equal(writer_start(ep, &out, remote), 0);
	assert_true(run_until(ep, pred_writes_done));
	assert_int_equal(ep->done_ok, out.count);
	assert_true(run_until(ep, pred_arrivals_done));
	ctl_msg_t v = peer_verdict(&f->peer);
	assert_int_equal(v.a[1], in.count); /* its writes all completed OK */
	assert_int_equal(v.a[3], 0);
	assert_int_equal(ep->arrivals, in.count);
	assert_int_equal(ep->bad_data + ep->bad_imm + ep->bad_len + ep->bad_where, 0);
	ctl_msg_t c = {.op = OP_CHECK, .status = (uint32_t)out.count};
	plan_to_msg(&out, &c);
	c.a[7] = index;
	assert_int_equal(peer_call(&f->peer, &c), 0);
	assert_int_equal(c.a[0], 0);
}

/* ---- tests: failures ----------------------------------------------------------------------- */

/* The peer closes abruptly mid-transfer: we get every write back (posting order), then one
 * on_error, no hang; the connection then refuses writes. */
static void test_peer_close_mid_transfer(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	plan_params_t p = {.seed = opt.seed + 9, .count = 3000, .region_size = 32u << 20,
			   .min_len = 4096, .max_len = 8192};
	uint64_t index;
	connect_peer(f, &f->peer);
	rw_rail_remote_t remote = peer_region(&f->peer, p.region_size, &index);
	peer_expect(&f->peer, &p, index, 50);
	assert_int_equal(writer_start(ep, &p, remote), 0);
	assert_true(run_until(ep, pred_failed_and_drained));
	assert_int_equal(ep->errors, 1);
	assert_true(rw_status_is_peer(ep->last_error));
	assert_int_equal(ep->done, ep->posted);
	assert_int_equal(ep->order_bad, 0);
	assert_true(ep->done_err > 0);
	assert_int_equal(ep->conn->state, RW_RAIL_CONN_DOWN);
	ep->writing = 1;
	writer_pump(ep);
	assert_int_equal(ep->post_err, 1); /* RW_ERR_STATE */
	ctl_msg_t v = peer_verdict(&f->peer);
	assert_int_equal(v.a[0], 50);
	assert_int_equal(v.a[1], 0);
}

/* Writing to a region the peer has deregistered (a stale key) fails that connection: the write
 * comes back with an error and on_error follows; nothing hangs. */
static void test_stale_remote_key(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	plan_params_t p = {.seed = opt.seed + 13, .count = 4, .region_size = 65536,
			   .min_len = 1, .max_len = 4096};
	uint64_t index;
	connect_peer(f, &f->peer);
	rw_rail_remote_t remote = peer_region(&f->peer, p.region_size, &index);
	ctl_msg_t m = {.op = OP_DEREG, .a = {index}};
	assert_int_equal(peer_call(&f->peer, &m), 0);
	assert_int_equal(writer_start(ep, &p, remote), 0);
	assert_true(run_until(ep, pred_failed_and_drained));
	assert_int_equal(ep->errors, 1);
	assert_int_not_equal(ep->last_error, RW_OK);
	assert_int_equal(ep->done, ep->posted);
	assert_true(ep->done_err >= 1);
	assert_int_equal(ep->order_bad, 0);
}

static int verdict_fd; /* pred_peer_verdict_ready: the control socket to poll */

/* ---- tests: what worker threads make new (close, dereg, dev_close with writes in flight) ---- */

/* Run the loop for about `seconds` (for "no callback comes any more" checks). */
static void run_for(struct ev_loop *loop, double seconds)
{
	int fired = 0;
	ev_timer t;
	ev_timer_init(&t, watchdog_cb, seconds, 0.);
	t.data = &fired;
	ev_timer_start(loop, &t);
	while (!fired)
		ev_run(loop, EVRUN_ONCE);
}

/* The responder connects to our listener and writes plan `in` into dst; returns when the
 * connection is up on our side (we hold the accepted end in ep->conn). */
static void peer_writes_to_us(fixture_t *f, peer_t *pr, const plan_params_t *in,
			      region_buf_t *dst)
{
	endpoint_t *ep = &f->ep;
	assert_int_equal(verifier_start(ep, in, dst), 0);
	ep->connected = 0;
	ctl_msg_t m = {.op = OP_WRITE_TO};
	plan_to_msg(in, &m);
	rw_rail_region_desc_pack(dst->region, m.desc);
	snprintf(m.s, sizeof(m.s), "%s", ep->listener->addr);
	assert_int_equal(ctl_send(pr->ctl_fd, &m), 0);
	assert_true(run_until(ep, pred_connected));
	assert_non_null(ep->conn);
	assert_true(ep->conn->accepted);
}

/* A responder process SIGKILLed while we write plan p to it: after `after` completions, or
 * (after == 0) from inside our first on_write_done. One on_error(RW_ERR_PEER), every write back
 * in posting order. */
static void peer_killed_case(fixture_t *f, const plan_params_t *p, uint64_t after)
{
	endpoint_t *ep = &f->ep;
	peer_t child;
	uint64_t index;
	assert_int_equal(peer_start_child(&child, opt.child_local), 0);
	connect_peer(f, &child);
	rw_rail_remote_t remote = peer_region(&child, p->region_size, &index);
	peer_expect(&child, p, index, 0);
	ep->kill_after_pid = after ? 0 : child.pid;
	assert_int_equal(writer_start(ep, p, remote), 0);
	if (after) {
		pred_threshold = after;
		assert_true(run_until(ep, pred_done_ge));
		assert_int_equal(kill(child.pid, SIGKILL), 0);
	}
	assert_true(run_until(ep, pred_failed_and_drained));
	assert_int_equal(ep->errors, 1);
	/* verbs (Soft-RoCE): the killed process's memory registration can go before its queue
	 * pair, so a large write landing in between is refused by the dying target (a remote
	 * access error: RW_ERR_PROTO) rather than left unacknowledged; either way one failure. */
	if (ep->last_error != RW_ERR_PEER)
		assert_true(strcmp(opt.transport, "verbs") == 0 && ep->last_error == RW_ERR_PROTO);
	assert_int_equal(ep->done, ep->posted);
	assert_int_equal(ep->order_bad, 0);
	peer_stop(&child);
}

/* A writer process SIGKILLed while it writes plan p to us: after `after` arrivals, or
 * (after == 0) from inside our first on_arrival. Our accepted connection reports the error,
 * and what was reported as arrived is intact. */
static void writer_killed_case(fixture_t *f, const plan_params_t *p, uint64_t after)
{
	endpoint_t *ep = &f->ep;
	peer_t child;
	assert_int_equal(peer_start_child(&child, opt.child_local), 0);
	region_buf_t *dst = ep_region(ep, p->region_size, 0);
	assert_non_null(dst);
	ep->kill_after_pid = after ? 0 : child.pid;
	peer_writes_to_us(f, &child, p, dst);
	if (after) {
		pred_threshold = after;
		assert_true(run_until(ep, pred_arrivals_ge));
		assert_int_equal(kill(child.pid, SIGKILL), 0);
	}
	assert_true(run_until(ep, pred_errored));
	assert_int_equal(ep->errors, 1);
	assert_int_equal(ep->last_error, RW_ERR_PEER);
	assert_true(ep->arrivals >= 1);
	assert_int_equal(ep->bad_data + ep->bad_imm + ep->bad_len + ep->bad_where, 0);
	peer_stop(&child);
}

/* A responder process SIGKILLed while we write to it. */
static void test_peer_killed_while_writing(void **state)
{
	fixture_t *f = *state;
	if (f->remote)
		skip();
	plan_params_t p = {.seed = opt.seed + 10, .count = 20000, .region_size = 64u << 20,
			   .min_len = 1024, .max_len = 3000};
	peer_killed_case(f, &p, 100);
}

/* A writer process SIGKILLed while it writes to us: our accepted connection reports the error
 * and the region outside the writer's planned ranges is untouched. */
static void test_writer_killed(void **state)
{
	fixture_t *f = *state;
	if (f->remote)
		skip();
	plan_params_t in = {.seed = opt.seed + 11, .count = 20000, .region_size = 64u << 20,
			    .min_len = 1024, .max_len = 3000};
	writer_killed_case(f, &in, 100);
}

/* Large writes in flight both ways on one connection, then rw_rail_conn_close() on our end:
 * no callback afterwards, our regions can be unmapped at once (a transport thread still
 * sending from or receiving into them would fault or, under ASan, be caught), the peer gets
 * every write back and one on_error, and the device goes on working. */
static void test_close_mid_large_write(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	plan_params_t in = {.seed = opt.seed + 20, .count = 12, .region_size = 64u << 20,
			    .min_len = 4u << 20, .max_len = 5u << 20};
	plan_params_t out = {.seed = opt.seed + 21, .count = 12, .region_size = 64u << 20,
			     .min_len = 4u << 20, .max_len = 5u << 20};
	uint64_t index;
	rw_rail_remote_t remote = peer_region(&f->peer, out.region_size, &index);
	region_buf_t *dst = ep_region(ep, in.region_size, 0);
	assert_non_null(dst);
	peer_writes_to_us(f, &f->peer, &in, dst);
	assert_int_equal(writer_start(ep, &out, remote), 0);
	pred_threshold = 1;
	assert_true(run_until(ep, pred_arrivals_ge)); /* its writes are landing, ours are going */
	assert_int_equal(ep->errors, 0);
	uint64_t done = ep->done, arrivals = ep->arrivals;
	rw_rail_conn_close(ep->conn);
	ep->conn = NULL;
	for (int i = 0; i < MAX_REGIONS; i++)
		ep_region_free(&ep->regions[i]); /* dereg + munmap: nothing of ours may touch them */
	ctl_msg_t v = peer_verdict(&f->peer);
	assert_int_equal(v.a[0], in.count);          /* every write came back, */
	assert_int_equal(v.a[3], 0);                 /* in posting order, then on_error; or a
						      * slow loop let them all land first */
	assert_true(v.a[6] == 1 ? rw_status_is_peer((rw_status_t)-(int)v.status)
				: v.a[1] == in.count);
	run_for(ep->loop, 0.05);
	assert_int_equal(ep->done, done);            /* no callback after close */
	assert_int_equal(ep->arrivals, arrivals);
	assert_int_equal(ep->errors, 0);
	assert_int_equal(ep->bad_data + ep->bad_imm + ep->bad_len + ep->bad_where, 0);
	ctl_msg_t reset = {.op = OP_RESET};
	assert_int_equal(peer_call(&f->peer, &reset), 0);
	ep_reset(ep);
	plan_params_t again = {.seed = opt.seed + 22, .count = 50, .region_size = 4u << 20,
			       .min_len = 1, .max_len = 65536};
	write_plan_and_verify(f, &again);
}

/* dereg of a region, from inside the first arrival's callback, while the peer's other large
 * writes are landing in it or queued behind: once dereg returns, not one byte of the region
 * changes any more; tcp and shm fail that connection (RW_ERR_PROTO, from the loop, reporting
 * no arrival of the dead region), and the writer gets its writes back with an error. */
static void test_dereg_while_landing(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	plan_params_t in = {.seed = opt.seed + 23, .count = 12, .region_size = 64u << 20,
			    .min_len = 4u << 20, .max_len = 5u << 20};
	region_buf_t *dst = ep_region(ep, in.region_size, 0);
	assert_non_null(dst);
	ep->dereg_after = 1;
	peer_writes_to_us(f, &f->peer, &in, dst);
	pred_threshold = 1;
	assert_true(run_until(ep, pred_arrivals_ge));
	assert_null(dst->region);
	ctl_msg_t v = peer_verdict(&f->peer);
	if (strcmp(opt.transport, "verbs") != 0) { /* tcp, shm */
		assert_true(run_until(ep, pred_errored));
		assert_int_equal(ep->errors, 1);
		assert_int_equal(ep->last_error, RW_ERR_PROTO);
		assert_int_equal(ep->arrivals, 1);
		assert_int_equal(ep->extra, 0); /* nothing of the dead region reported */
		assert_int_equal(v.a[6], 1);    /* the writer's on_error */
		assert_true(v.a[2] >= 1);       /* with failed writes, */
		assert_int_equal(v.a[3], 0);    /* in posting order */
	}
	run_for(ep->loop, 0.05);
	for (uint64_t i = 0; i < dst->size; i++)
		if (dst->mem[i] != 0xee)
			fail_msg("byte %llu of a deregistered region changed",
				 (unsigned long long)i);
	munmap(dst->mem, dst->size);
	memset(dst, 0, sizeof(*dst));
}

static int pred_peer_verdict_ready(endpoint_t *ep)
{
	(void)ep;
	struct pollfd pfd = {.fd = verdict_fd, .events = POLLIN};
	return poll(&pfd, 1, 0) == 1;
}

/* Wakes the loop when the verdict arrives: pred_peer_verdict_ready is looked at only between
 * loop iterations, and with every other watcher of the loop stopped (verbs, after dev_close)
 * only the watchdog would end the wait: a failure, or a pass a moment before it fired. */
static void verdict_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	ev_io_stop(loop, w);
}

/* rw_rail_dev_close() with large writes in flight both ways and regions still registered:
 * returns (no hang), makes no callback, and the regions can be unmapped at once. */
static void test_dev_close_in_flight(void **state)
{
	fixture_t *f = *state;
	endpoint_t a;
	plan_params_t in = {.seed = opt.seed + 24, .count = 12, .region_size = 64u << 20,
			    .min_len = 4u << 20, .max_len = 5u << 20};
	plan_params_t out = {.seed = opt.seed + 25, .count = 12, .region_size = 64u << 20,
			     .min_len = 4u << 20, .max_len = 5u << 20};
	uint64_t index;
	assert_int_equal(ep_open(&a, f->loop, opt.local, 0, opt.pace_bps), RW_OK);
	assert_int_equal(rw_rail_listen(a.dev, &cbs, &a, &a.listener), RW_OK);
	rw_rail_remote_t remote = peer_region(&f->peer, out.region_size, &index);
	region_buf_t *dst = ep_region(&a, in.region_size, 0);
	assert_non_null(dst);
	assert_int_equal(verifier_start(&a, &in, dst), 0);
	ctl_msg_t m = {.op = OP_WRITE_TO};
	plan_to_msg(&in, &m);
	rw_rail_region_desc_pack(dst->region, m.desc);
	snprintf(m.s, sizeof(m.s), "%s", a.listener->addr);
	assert_int_equal(ctl_send(f->peer.ctl_fd, &m), 0);
	assert_true(run_until(&a, pred_connected));
	assert_int_equal(writer_start(&a, &out, remote), 0); /* back on its connection */
	pred_threshold = 1;
	assert_true(run_until(&a, pred_arrivals_ge));
	uint64_t done = a.done, arrivals = a.arrivals;
	int errors = a.errors;
	rw_rail_dev_close(a.dev); /* connection, listener and both regions still open */
	for (int i = 0; i < MAX_REGIONS; i++) {
		if (a.regions[i].mem)
			munmap(a.regions[i].mem, a.regions[i].size);
	}
	assert_int_equal(a.done, done);
	assert_int_equal(a.arrivals, arrivals);
	assert_int_equal(a.errors, errors);
	verdict_fd = f->peer.ctl_fd;
	ev_io verdict_io;
	ev_io_init(&verdict_io, verdict_io_cb, verdict_fd, EV_READ);
	ev_io_start(f->loop, &verdict_io);
	int verdict_ready = run_until(&f->ep, pred_peer_verdict_ready);
	ev_io_stop(f->loop, &verdict_io);
	assert_true(verdict_ready);
	ctl_msg_t v = peer_verdict(&f->peer);
	/* The peer saw the connection go, or (a slow loop let every write of it land and be
	 * acknowledged in one turn) finished cleanly first; either way in posting order. */
	assert_true(v.a[6] == 1 || (v.a[1] == in.count && v.a[2] == 0));
	assert_int_equal(v.a[3], 0);
	free(a.witems);
	free(a.vitems);
}

/* The write queue's bound with large writes and a small max_writes: RW_ERR_AGAIN, then
 * on_writable, over and over while the threads move megabytes; all verified. */
static void test_backpressure_large(void **state)
{
	fixture_t *f = *state;
	endpoint_t a;
	plan_params_t p = {.seed = opt.seed + 26, .count = 40, .region_size = 64u << 20,
			   .min_len = 1u << 20, .max_len = (1u << 20) + 4096};
	uint64_t index;
	assert_int_equal(ep_open(&a, f->loop, opt.local, 4, opt.pace_bps), RW_OK);
	assert_int_equal(a.dev->caps.max_writes, 4);
	assert_int_equal(rw_rail_connect(a.dev, f->peer.rail_addr, 45, &cbs, &a, &a.conn), RW_OK);
	assert_true(run_until(&a, pred_connected));
	rw_rail_remote_t remote = peer_region(&f->peer, p.region_size, &index);
	peer_expect(&f->peer, &p, index, 0);
	assert_int_equal(writer_start(&a, &p, remote), 0);
	assert_int_equal(a.posted, 4);
	assert_int_equal(a.again, 1);
	assert_int_equal(a.done, 0);
	assert_true(run_until(&a, pred_writes_done));
	assert_int_equal(a.errors, 0);
	assert_int_equal(a.done_ok, p.count);
	assert_int_equal(a.order_bad, 0);
	assert_true(a.again >= p.count / 4 - 1);
	assert_true(a.writable >= a.again - 1);
	ctl_msg_t v = peer_verdict(&f->peer);
	assert_int_equal(v.a[0], p.count);
	assert_int_equal(v.a[1] + v.a[2] + v.a[3] + v.a[4] + v.a[5] + v.a[6], 0);
	ep_close(&a);
}

/* SIGKILL of the target process in the middle of 4 MiB writes, and of a writer sending 4 MiB
 * writes to us: the same outcome as with small writes (one on_error(RW_ERR_PEER), every write
 * back in posting order; what was reported as arrived is intact). */
static void test_killed_mid_large_write(void **state)
{
	fixture_t *f = *state;
	if (f->remote)
		skip();
	plan_params_t p = {.seed = opt.seed + 27, .count = 24, .region_size = 128u << 20,
			   .min_len = 4u << 20, .max_len = 5u << 20};
	peer_killed_case(f, &p, 0);
	ep_reset(&f->ep);
	writer_killed_case(f, &p, 0);
}

/* ---- tests: rate pacing -------------------------------------------------------------------- */

static endpoint_t *pace_other;
static int pred_either_done(endpoint_t *ep)
{
	return ep->errors > 0 || pace_other->errors > 0 || ep->done == ep->wp.count ||
	       pace_other->done == pace_other->wp.count;
}

/* rw_rail_config_t.pace_bps: a paced device still delivers every byte, on two connections at
 * once that share its bucket, and pacing really engages (the transport counts the sends that
 * waited for its refill timer), while an unpaced device never waits. No timing is asserted:
 * the achieved rate is measured by rail_bench --pace (docs/perf/rail-tcp.md). verbs ignores
 * pacing (pace_bps reads back 0) and must still pass the data checks. */
static void test_paced_writes(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	const int tcp = strcmp(opt.transport, "tcp") == 0;
	const int paces = strcmp(opt.transport, "verbs") != 0; /* tcp, shm */
	const uint64_t rate = 400000000; /* bits/s: the ~1.6 MiB below take ~30 ms */
	plan_params_t p0 = {.seed = opt.seed + 14, .count = 64, .region_size = 4u << 20,
			    .min_len = 1, .max_len = 32768};
	plan_params_t pa = {.seed = opt.seed + 15, .count = 100, .region_size = 4u << 20,
			    .min_len = 1, .max_len = 16384};
	plan_params_t pb = {.seed = opt.seed + 16, .count = 100, .region_size = 4u << 20,
			    .min_len = 1, .max_len = 16384};
	uint64_t index;

	/* A paced device with two connections: a -> the responder, b -> our own listener. */
	endpoint_t a, b;
	assert_int_equal(ep_open(&a, ep->loop, opt.local, 0, rate), RW_OK);
	assert_int_equal(a.dev->pace_bps, paces ? rate : 0);
	memset(&b, 0, sizeof(b));
	b.loop = ep->loop;
	b.dev = a.dev; /* a second connection on the same device */
	b.post_limit = UINT64_MAX;
	assert_int_equal(rw_rail_connect(a.dev, f->peer.rail_addr, 43, &cbs, &a, &a.conn), RW_OK);
	assert_true(run_until(&a, pred_connected));
	assert_int_equal(a.errors, 0);
	rw_rail_remote_t remote = peer_region(&f->peer, pa.region_size, &index);
	peer_expect(&f->peer, &pa, index, 0);
	region_buf_t *dst = NULL;
	if (paces) {
		dst = ep_region(ep, pb.region_size, 0);
		assert_non_null(dst);
		assert_int_equal(verifier_start(ep, &pb, dst), 0);
		ep->connected = 0;
		assert_int_equal(rw_rail_connect(b.dev, ep->listener->addr, 44, &cbs, &b, &b.conn),
				 RW_OK);
		assert_true(run_until(&b, pred_connected));
		assert_true(run_until(ep, pred_connected));
		assert_int_equal(b.errors + ep->errors, 0);
		assert_int_equal(writer_start(&b, &pb, rw_rail_region_remote(dst->region)), 0);
	}
	assert_int_equal(writer_start(&a, &pa, remote), 0);
	if (paces) {
		/* Round robin between the device's connections: when the first one has all its
		 * writes back, the other has had turns too (no connection hogs the bucket): some
		 * of its writes completed or at least landed (its completions take more thread
		 * hops than a's, which a slow build, e.g. under TSan, makes visible). */
		pace_other = &b;
		assert_true(run_until(&a, pred_either_done));
		assert_true(a.done >= 1 && (b.done >= 1 || ep->arrivals >= 1));
		assert_true(run_until(&b, pred_writes_done));
		assert_int_equal(b.errors, 0);
		assert_int_equal(b.done_ok, pb.count);
		assert_int_equal(b.order_bad, 0);
		assert_true(run_until(ep, pred_arrivals_done));
		assert_int_equal(ep->arrivals, pb.count);
		assert_int_equal(ep->bad_data + ep->bad_imm + ep->bad_len + ep->bad_where, 0);
	}
	assert_true(run_until(&a, pred_writes_done));
	assert_int_equal(a.errors, 0);
	assert_int_equal(a.done_ok, pa.count);
	assert_int_equal(a.order_bad, 0);
	ctl_msg_t v = peer_verdict(&f->peer);
	assert_int_equal(v.a[0], pa.count);
	assert_int_equal(v.a[1] + v.a[2] + v.a[3] + v.a[4] + v.a[5] + v.a[6], 0);

	if (paces) {
		uint64_t payload = 0;
		for (uint64_t k = 0; k < pa.count; k++)
			payload += a.witems[k].len + b.witems[k].len;
		assert_true(a.dev->stats.pace_waits > 0); /* pacing engaged */
		/* tcp counts its headers too; shm copies payload only */
		assert_true(a.dev->stats.tx_bytes >=
			    payload + (tcp ? (pa.count + pb.count) * RW_TCP_HDR_SIZE : 0));
	} else {
		assert_int_equal(a.dev->stats.pace_waits, 0);
	}
	ep_reset(&b); /* b's connection and source region, on a's device */
	ep_close(&a);

	/* Unpaced: the fixture's device, which has sent plenty in earlier tests, never waited. */
	ctl_msg_t reset = {.op = OP_RESET};
	assert_int_equal(peer_call(&f->peer, &reset), 0); /* its end of a's connection */
	rw_rail_conn_close(ep->conn); /* b's, accepted */
	ep->conn = NULL;
	write_plan_and_verify(f, &p0);
	if (!opt.pace_bps) {
		assert_int_equal(ep->dev->pace_bps, 0);
		assert_true(ep->dev->stats.tx_bytes > 0 || !paces);
		assert_int_equal(ep->dev->stats.pace_waits, 0);
	}
}

/* Paced and threaded: two connections share a slow device's bucket; closing one while its
 * sender waits for its turn (mid-frame) leaves the other one's turns intact: all its writes
 * complete and verify; then dev_close. tcp and shm (verbs does not pace). */
static void test_paced_close_in_flight(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	if (strcmp(opt.transport, "verbs") == 0)
		skip();
	const uint64_t rate = 40000000; /* 5 MB/s: the first plan needs ~3 s, we close at once */
	plan_params_t pa = {.seed = opt.seed + 28, .count = 64, .region_size = 32u << 20,
			    .min_len = 256u << 10, .max_len = 260u << 10};
	plan_params_t pb = {.seed = opt.seed + 29, .count = 40, .region_size = 4u << 20,
			    .min_len = 1, .max_len = 16384};
	uint64_t index;
	endpoint_t a, b;
	assert_int_equal(ep_open(&a, ep->loop, opt.local, 0, rate), RW_OK);
	memset(&b, 0, sizeof(b));
	b.loop = ep->loop;
	b.dev = a.dev;
	b.post_limit = UINT64_MAX;
	assert_int_equal(rw_rail_connect(a.dev, f->peer.rail_addr, 46, &cbs, &a, &a.conn), RW_OK);
	assert_true(run_until(&a, pred_connected));
	rw_rail_remote_t remote = peer_region(&f->peer, pa.region_size, &index);
	region_buf_t *dst = ep_region(ep, pb.region_size, 0);
	assert_non_null(dst);
	assert_int_equal(verifier_start(ep, &pb, dst), 0);
	ep->connected = 0;
	assert_int_equal(rw_rail_connect(b.dev, ep->listener->addr, 47, &cbs, &b, &b.conn), RW_OK);
	assert_true(run_until(&b, pred_connected));
	assert_true(run_until(ep, pred_connected));
	assert_int_equal(writer_start(&a, &pa, remote), 0);
	assert_int_equal(writer_start(&b, &pb, rw_rail_region_remote(dst->region)), 0);
	pred_threshold = 1;
	assert_true(run_until(&a, pred_done_ge));
	assert_true(a.done < pa.count); /* at 5 MB/s most of 16 MiB is still to go */
	uint64_t done = a.done;
	rw_rail_conn_close(a.conn);
	a.conn = NULL;
	assert_true(run_until(&b, pred_writes_done));
	assert_int_equal(b.errors, 0);
	assert_int_equal(b.done_ok, pb.count);
	assert_int_equal(b.order_bad, 0);
	assert_true(run_until(ep, pred_arrivals_done));
	assert_int_equal(ep->arrivals, pb.count);
	assert_int_equal(ep->bad_data + ep->bad_imm + ep->bad_len + ep->bad_where, 0);
	assert_int_equal(a.done, done); /* nothing after the close */
	assert_true(a.dev->stats.pace_waits > 0);
	rw_rail_dev_close(a.dev); /* b's connection still open on it */
	for (int i = 0; i < MAX_REGIONS; i++) {
		if (a.regions[i].mem)
			munmap(a.regions[i].mem, a.regions[i].size);
		if (b.regions[i].mem)
			munmap(b.regions[i].mem, b.regions[i].size);
	}
	free(a.witems);
	free(b.witems);
}

/* Connecting to nothing reports on_error from the loop, never from inside connect(). */
static void test_connect_refused(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	if (strcmp(opt.transport, "verbs") == 0 || f->remote)
		skip();
	char addr[RW_RAIL_ADDR_MAX];
	/* A port that was just free: bind, read it, close. */
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET};
	socklen_t len = sizeof(sa);
	inet_pton(AF_INET, opt.peer_local, &sa.sin_addr);
	assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
	close(fd);
	/* shm listeners take ports from 20000 up; 1 is never one of them */
	unsigned port = strcmp(opt.transport, "shm") == 0 ? 1u : (unsigned)ntohs(sa.sin_port);
	snprintf(addr, sizeof(addr), "%s:%u", opt.peer_local, port);
	assert_int_equal(rw_rail_connect(ep->dev, addr, 1, &cbs, ep, &ep->conn), RW_OK);
	assert_int_equal(ep->errors, 0);
	assert_true(run_until(ep, pred_connected));
	assert_int_equal(ep->connected, 0);
	assert_int_equal(ep->errors, 1);
	assert_int_equal(ep->last_error, RW_ERR_PEER);
}

/* ---- tests: hostile peers (tcp wire format) ------------------------------------------------ */

typedef struct raw_peer {
	int fd;
	ev_io io;
	int eof;
} raw_peer_t;

static void raw_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	raw_peer_t *rp = w->data;
	uint8_t buf[512];
	ssize_t n = recv(rp->fd, buf, sizeof(buf), MSG_DONTWAIT);
	if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
		rp->eof = 1;
		ev_io_stop(loop, w);
	}
}

static raw_peer_t *hostile_rp;
static int pred_raw_eof(endpoint_t *ep)
{
	(void)ep;
	return hostile_rp->eof;
}

static void raw_send_hdr(int fd, uint8_t type, uint64_t key, uint64_t offset, uint64_t length,
			 uint64_t seq)
{
	uint8_t b[RW_TCP_HDR_SIZE];
	rw_tcp_hdr_t h = {.type = type, .key = key, .offset = offset, .length = length, .seq = seq};
	rw_tcp_hdr_encode(&h, b);
	assert_int_equal(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
}

/* A well-behaved writer on its own connection to our listener, before and after the attacks:
 * open it (returns our accepted end), then check that a full plan still lands and verifies. */
static rw_rail_conn_t *hostile_good_open(endpoint_t *ep, endpoint_t *writer)
{
	assert_int_equal(ep_open(writer, ep->loop, opt.child_local, 0, 0), RW_OK);
	writer->connected = 0;
	assert_int_equal(rw_rail_connect(writer->dev, ep->listener->addr, 5, &cbs, writer,
					 &writer->conn), RW_OK);
	assert_true(run_until(writer, pred_connected));
	assert_true(run_until(ep, pred_connected));
	rw_rail_conn_t *good_conn = ep->conn;
	ep->conn = NULL;
	return good_conn;
}

static void hostile_good_check(endpoint_t *ep, endpoint_t *writer, rw_rail_conn_t *good_conn,
			       region_buf_t *dst)
{
	plan_params_t good = {.seed = opt.seed + 12, .count = 64, .region_size = dst->size / 2,
			      .min_len = 1, .max_len = 256};
	ep->conn = good_conn;
	ep->errors = 0;
	assert_int_equal(verifier_start(ep, &good, dst), 0);
	assert_int_equal(writer_start(writer, &good, rw_rail_region_remote(dst->region)), 0);
	assert_true(run_until(writer, pred_writes_done));
	assert_int_equal(writer->done_ok, good.count);
	assert_true(run_until(ep, pred_arrivals_done));
	assert_int_equal(ep->arrivals, good.count);
	assert_int_equal(ep->bad_data + ep->bad_imm + ep->bad_len + ep->bad_where, 0);
	assert_int_equal(ep->errors, 0);
	ep_close(writer);
}

/* The transport drops the raw peer rp: wait for its end to see EOF, then for the connection's
 * failure (expect, after on_connected) or for nothing at all (never announced: expect RW_OK). */
static void hostile_wait_drop(endpoint_t *ep, raw_peer_t *rp, rw_status_t expect)
{
	rp->io.data = rp;
	ev_io_init(&rp->io, raw_cb, rp->fd, EV_READ);
	ev_io_start(ep->loop, &rp->io);
	hostile_rp = rp;
	assert_true(run_until(ep, pred_raw_eof)); /* the transport dropped us */
	ev_io_stop(ep->loop, &rp->io);
	close(rp->fd);
	if (expect == RW_OK) {
		assert_int_equal(ep->connected, 0); /* never announced, silently dropped */
		assert_int_equal(ep->errors, 0);
		return;
	}
	assert_true(run_until(ep, pred_errored));
	assert_int_equal(ep->connected, 1);
	assert_int_equal(ep->errors, 1);
	assert_int_equal(ep->last_error, expect);
	assert_int_equal(ep->conn->state, RW_RAIL_CONN_DOWN);
	rw_rail_conn_close(ep->conn);
	ep->conn = NULL;
}

enum hostile_case {
	H_GARBAGE_FIRST, H_BAD_MAGIC, H_BAD_VERSION, H_BAD_TYPE, H_UNKNOWN_KEY, H_OFFSET_OOB,
	H_LENGTH_OOB, H_OFFSET_OVERFLOW, H_BAD_SEQ, H_TRUNCATED_HDR, H_TRUNCATED_PAYLOAD,
	H_ACK_UNSENT, H_WRONG_RAIL, H_COUNT,
};

static void test_hostile_headers(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	if (strcmp(opt.transport, "tcp") != 0 || f->remote)
		skip();
	const uint64_t size = 65536;
	region_buf_t *dst = ep_region(ep, size, 0xaa);
	assert_non_null(dst);
	uint64_t key = dst->region->key;
	struct sockaddr_in lsa = {.sin_family = AF_INET};
	{
		char ip[64];
		const char *colon = strrchr(ep->listener->addr, ':');
		memcpy(ip, ep->listener->addr, (size_t)(colon - ep->listener->addr));
		ip[colon - ep->listener->addr] = '\0';
		inet_pton(AF_INET, ip, &lsa.sin_addr);
		lsa.sin_port = htons((uint16_t)atoi(colon + 1));
	}
	endpoint_t writer;
	rw_rail_conn_t *good_conn = hostile_good_open(ep, &writer);

	for (int hc = 0; hc < H_COUNT; hc++) {
		raw_peer_t rp = {.fd = socket(AF_INET, SOCK_STREAM, 0)};
		assert_true(rp.fd >= 0);
		assert_int_equal(connect(rp.fd, (struct sockaddr *)&lsa, sizeof(lsa)), 0);
		ep->connected = ep->errors = 0;
		ep->last_error = RW_OK;
		int announced = hc != H_GARBAGE_FIRST && hc != H_WRONG_RAIL;
		if (hc == H_GARBAGE_FIRST) {
			uint8_t junk[RW_TCP_HDR_SIZE];
			memset(junk, 0x41, sizeof(junk));
			assert_int_equal(send(rp.fd, junk, sizeof(junk), MSG_NOSIGNAL),
					 (ssize_t)sizeof(junk));
		} else {
			raw_send_hdr(rp.fd, RW_TCP_HELLO, 99,
				     hc == H_WRONG_RAIL ? opt.rail + 1 : opt.rail, 0, 0);
		}
		uint8_t b[RW_TCP_HDR_SIZE];
		rw_tcp_hdr_t h = {.type = RW_TCP_WRITE, .key = key, .offset = 0, .length = 16,
				  .seq = 1};
		uint8_t payload[256];
		memset(payload, 0x55, sizeof(payload));
		switch (hc) {
		case H_BAD_MAGIC:
		case H_BAD_VERSION:
		case H_BAD_TYPE:
			rw_tcp_hdr_encode(&h, b);
			if (hc == H_BAD_MAGIC)
				b[0] ^= 0xff;
			else if (hc == H_BAD_VERSION)
				b[4] = RW_TCP_VERSION + 1;
			else
				b[5] = 99;
			send(rp.fd, b, sizeof(b), MSG_NOSIGNAL);
			send(rp.fd, payload, 16, MSG_NOSIGNAL);
			break;
		case H_UNKNOWN_KEY:
			raw_send_hdr(rp.fd, RW_TCP_WRITE, key ^ 0x100000000ull, 0, 16, 1);
			send(rp.fd, payload, 16, MSG_NOSIGNAL);
			break;
		case H_OFFSET_OOB:
			raw_send_hdr(rp.fd, RW_TCP_WRITE, key, size, 16, 1);
			send(rp.fd, payload, 16, MSG_NOSIGNAL);
			break;
		case H_LENGTH_OOB:
			raw_send_hdr(rp.fd, RW_TCP_WRITE, key, size - 100, 256, 1);
			send(rp.fd, payload, 256, MSG_NOSIGNAL);
			break;
		case H_OFFSET_OVERFLOW:
			raw_send_hdr(rp.fd, RW_TCP_WRITE, key, UINT64_MAX - 7, 16, 1);
			send(rp.fd, payload, 16, MSG_NOSIGNAL);
			break;
		case H_BAD_SEQ:
			raw_send_hdr(rp.fd, RW_TCP_WRITE, key, size - 16, 16, 5);
			send(rp.fd, payload, 16, MSG_NOSIGNAL);
			break;
		case H_TRUNCATED_HDR:
			rw_tcp_hdr_encode(&h, b);
			send(rp.fd, b, 20, MSG_NOSIGNAL);
			shutdown(rp.fd, SHUT_WR);
			break;
		case H_TRUNCATED_PAYLOAD:
			/* Valid range (the last 256 bytes), but only half the payload arrives. */
			raw_send_hdr(rp.fd, RW_TCP_WRITE, key, size - 256, 256, 1);
			send(rp.fd, payload, 128, MSG_NOSIGNAL);
			shutdown(rp.fd, SHUT_WR);
			break;
		case H_ACK_UNSENT:
			raw_send_hdr(rp.fd, RW_TCP_ACK, 0, 0, 0, 3);
			break;
		default:
			break;
		}
		hostile_wait_drop(ep, &rp, !announced ? RW_OK
					   : hc == H_TRUNCATED_HDR || hc == H_TRUNCATED_PAYLOAD
					   ? RW_ERR_PEER : RW_ERR_PROTO);
		/* Nothing landed outside a valid range; only the truncated-payload case may have
		 * touched its own (valid) last 256 bytes. */
		uint64_t check = hc == H_TRUNCATED_PAYLOAD ? size - 256 : size;
		for (uint64_t i = 0; i < check; i++)
			if (dst->mem[i] != 0xaa)
				fail_msg("case %d: byte %llu changed", hc, (unsigned long long)i);
		memset(dst->mem, 0xaa, size);
	}
	hostile_good_check(ep, &writer, good_conn, dst);
}

/* ---- tests: hostile peers (shm control messages and outbox) -------------------------------- */

enum shm_hostile_case {
	S_GARBAGE_FIRST, S_BAD_MAGIC, S_WRONG_RAIL, S_FD_ON_HELLO, S_RING_UNSEALED, S_RING_SIZE,
	S_UNKNOWN_KEY, S_OFFSET_OOB, S_TAIL_JUMP, S_KEY_UNASKED, S_HEAD_UNSENT, S_COUNT,
};

static void shm_raw_send(int fd, uint8_t type, uint64_t a, uint64_t b, int pass_fd)
{
	assert_int_equal(shm_msg_send(fd, &(shm_msg_t){.type = type, .a = a, .b = b}, pass_fd), 0);
}

static int shm_raw_fd; /* pred_raw_readable: the raw peer's socket */
static int pred_raw_readable(endpoint_t *ep)
{
	(void)ep;
	struct pollfd pfd = {.fd = shm_raw_fd, .events = POLLIN};
	return poll(&pfd, 1, 0) == 1;
}

/* Run our loop until the acceptor answered, then take its message (and fd, if any). */
static shm_msg_t shm_raw_recv(endpoint_t *ep, int fd, int *fd_p)
{
	shm_raw_fd = fd;
	assert_true(run_until(ep, pred_raw_readable));
	uint8_t raw[SHM_MSG_SIZE];
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} ctl;
	struct iovec iov = {raw, sizeof(raw)};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
			    .msg_controllen = sizeof(ctl.buf)};
	assert_int_equal(recvmsg(fd, &mh, MSG_CMSG_CLOEXEC), (ssize_t)sizeof(raw));
	shm_msg_t m;
	assert_int_equal(shm_msg_decode(raw, &m), 0);
	*fd_p = -1;
	struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
	if (cm && cm->cmsg_type == SCM_RIGHTS)
		memcpy(fd_p, CMSG_DATA(cm), sizeof(int));
	return m;
}

/* An outbox of `entries` (sealed unless told not to) of `bytes`, mapped at *ring_p. */
static int shm_raw_ring(uint64_t entries, uint64_t bytes, int seal, shm_ring_t **ring_p)
{
	int fd = memfd_create("hostile-outbox", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, (off_t)bytes), 0);
	if (seal)
		assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
	*ring_p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	assert_true(*ring_p != MAP_FAILED);
	(void)entries;
	return fd;
}

/* A raw peer on the shm control socket: bad messages before, during and after the handshake,
 * bad outboxes, descriptors naming what is not ours, indices that cannot be true. Each is
 * dropped (unannounced, or RW_ERR_PROTO after on_connected), our region keeps every byte, and a
 * well-behaved connection alongside still works. */
static void test_hostile_shm(void **state)
{
	fixture_t *f = *state;
	endpoint_t *ep = &f->ep;
	if (strcmp(opt.transport, "shm") != 0 || f->remote)
		skip();
	const uint64_t size = 65536, entries = 16;
	region_buf_t *dst = ep_region(ep, size, 0xaa);
	assert_non_null(dst);
	const uint64_t key = dst->region->key;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int n = snprintf(sa.sun_path + 1, sizeof(sa.sun_path) - 1, "railwave-shm/%s",
			 ep->listener->addr);
	const socklen_t salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
	endpoint_t writer;
	rw_rail_conn_t *good_conn = hostile_good_open(ep, &writer);

	for (int hc = 0; hc < S_COUNT; hc++) {
		raw_peer_t rp = {.fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)};
		assert_int_equal(connect(rp.fd, (struct sockaddr *)&sa, salen), 0);
		ep->connected = ep->errors = 0;
		ep->last_error = RW_OK;
		const int announced = hc >= S_UNKNOWN_KEY;
		shm_ring_t *ring = NULL, *theirs = NULL;
		uint64_t ring_bytes = shm_ring_bytes(entries), their_bytes = 0;
		int fd = -1, got_fd = -1;
		if (hc == S_GARBAGE_FIRST) {
			assert_int_equal(send(rp.fd, "garbage", 7, MSG_NOSIGNAL), 7);
		} else if (hc == S_BAD_MAGIC) {
			uint8_t raw[SHM_MSG_SIZE];
			shm_msg_encode(&(shm_msg_t){.type = SHM_HELLO, .b = opt.rail}, raw);
			raw[0] ^= 0xff;
			assert_int_equal(send(rp.fd, raw, sizeof(raw), MSG_NOSIGNAL), (ssize_t)sizeof(raw));
		} else if (hc == S_FD_ON_HELLO) {
			shm_raw_send(rp.fd, SHM_HELLO, 99, opt.rail, STDIN_FILENO);
		} else {
			shm_raw_send(rp.fd, SHM_HELLO, 99, hc == S_WRONG_RAIL ? opt.rail + 1 : opt.rail, -1);
		}
		if (hc >= S_RING_UNSEALED) {
			shm_msg_t m = shm_raw_recv(ep, rp.fd, &got_fd);
			assert_int_equal(m.type, SHM_HELLO_ACK);
			fd = shm_raw_ring(entries, hc == S_RING_SIZE ? ring_bytes - 64 : ring_bytes,
					  hc != S_RING_UNSEALED, &ring);
			if (hc == S_RING_SIZE)
				ring_bytes -= 64;
			shm_raw_send(rp.fd, SHM_RING, entries, 0, fd);
		}
		if (announced) {
			shm_msg_t m = shm_raw_recv(ep, rp.fd, &got_fd);
			assert_int_equal(m.type, SHM_RING);
			assert_true(got_fd >= 0);
			their_bytes = shm_ring_bytes(m.a);
			theirs = mmap(NULL, their_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, got_fd, 0);
			assert_true(theirs != MAP_FAILED);
			assert_true(run_until(ep, pred_connected));
			shm_entry_t e = {.key = key, .offset = 0, .length = 16};
			if (hc == S_UNKNOWN_KEY)
				e.key ^= 0x100000000ull;
			if (hc == S_OFFSET_OOB)
				e.offset = size - 8;
			ring->entries[0] = e;
			if (hc == S_UNKNOWN_KEY || hc == S_OFFSET_OOB || hc == S_TAIL_JUMP) {
				atomic_store(&ring->tail, hc == S_TAIL_JUMP ? entries + 5 : 1);
				shm_raw_send(rp.fd, SHM_TAIL, 0, 0, -1);
			} else if (hc == S_KEY_UNASKED) {
				shm_raw_send(rp.fd, SHM_KEY, key, size, fd);
			} else {
				atomic_store(&theirs->head, 3); /* it published nothing */
				shm_raw_send(rp.fd, SHM_HEAD, 0, 0, -1);
			}
		}
		hostile_wait_drop(ep, &rp, announced ? RW_ERR_PROTO : RW_OK);
		for (uint64_t i = 0; i < size; i++)
			if (dst->mem[i] != 0xaa)
				fail_msg("case %d: byte %llu changed", hc, (unsigned long long)i);
		if (ring)
			munmap(ring, ring_bytes);
		if (theirs)
			munmap(theirs, their_bytes);
		if (fd >= 0)
			close(fd);
		if (got_fd >= 0)
			close(got_fd);
	}
	hostile_good_check(ep, &writer, good_conn, dst);
}

/* ---- main --------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_registry),
		cmocka_unit_test(test_addr_parse),
		cmocka_unit_test_teardown(test_registration, test_teardown),
		cmocka_unit_test_teardown(test_write_checks, test_teardown),
		cmocka_unit_test_teardown(test_sizes_ladder, test_teardown),
		cmocka_unit_test_teardown(test_size_64mib, test_teardown),
		cmocka_unit_test_teardown(test_random_sizes_offsets, test_teardown),
		cmocka_unit_test_teardown(test_many_in_flight, test_teardown),
		cmocka_unit_test_teardown(test_backpressure_bound, test_teardown),
		cmocka_unit_test_teardown(test_done_means_placed, test_teardown),
		cmocka_unit_test_teardown(test_bidirectional, test_teardown),
		cmocka_unit_test_teardown(test_peer_close_mid_transfer, test_teardown),
		cmocka_unit_test_teardown(test_stale_remote_key, test_teardown),
		cmocka_unit_test_teardown(test_peer_killed_while_writing, test_teardown),
		cmocka_unit_test_teardown(test_writer_killed, test_teardown),
		cmocka_unit_test_teardown(test_close_mid_large_write, test_teardown),
		cmocka_unit_test_teardown(test_dereg_while_landing, test_teardown),
		cmocka_unit_test_teardown(test_dev_close_in_flight, test_teardown),
		cmocka_unit_test_teardown(test_backpressure_large, test_teardown),
		cmocka_unit_test_teardown(test_killed_mid_large_write, test_teardown),
		cmocka_unit_test_teardown(test_paced_writes, test_teardown),
		cmocka_unit_test_teardown(test_paced_close_in_flight, test_teardown),
		cmocka_unit_test_teardown(test_connect_refused, test_teardown),
		cmocka_unit_test_teardown(test_hostile_headers, test_teardown),
		cmocka_unit_test_teardown(test_hostile_shm, test_teardown),
	};
	return rh_main(argc, argv, RW_CONF_TRANSPORT, tests, RW_ARRAY_SIZE(tests));
}
