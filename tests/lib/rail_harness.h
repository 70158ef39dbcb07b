/* tests/lib/rail_harness.h: the rail conformance suite's harness (tests/rdma/conformance.c holds
 * the cases). A driver (role a, cmocka) steers a responder (role b: a thread, a child process it
 * can SIGKILL, or a process on another machine) over a small control channel; both derive the
 * same write plan from a seed, so the target verifies every write when its arrival is reported.
 * Endpoints wrap a rail device, its regions, one connection, a writer and a verifier; run_until
 * runs a loop until a predicate holds, with a watchdog that turns a hang into a failure.
 * docs/rdma.md "Conformance suite". */
#ifndef RW_TEST_LIB_RAIL_HARNESS_H
#define RW_TEST_LIB_RAIL_HARNESS_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <sys/types.h>

#include "rdma/rail.h"

#define WATCHDOG_S 60.0 /* hang guard only: generous even under ASan on a busy machine */
#define MAX_REGIONS 8
#define RH_MAX_TESTS 64

typedef struct rh_opts {
	const char *transport;
	const char *role;   /* "a" (driver, default) or "b" (responder) */
	unsigned rail;
	const char *local;  /* this side's rail address */
	const char *peer;   /* role a: the responder's control address; NULL = responder thread */
	const char *ctl;    /* role b: where to listen for the driver's control connection */
	int ctl_fd;         /* role b: inherited control socket (child responder) */
	const char *peer_local; /* role a, thread mode: the responder's rail address */
	const char *child_local;
	uint64_t seed;
	uint64_t pace_bps;  /* --pace=BPS: pace every device of the suite (a stress run) */
	const char *tests;  /* --tests=a,b: only tests whose names contain one of these */
} rh_opts_t;

extern rh_opts_t opt;

enum ctl_op {
	OP_HELLO = 1, /* b -> a: s = b's rail listener address */
	OP_REGION,    /* a0 = size, a1 = fill byte -> desc, a0 = region index */
	OP_EXPECT,    /* plan in a0..a6, a7 = region index, drop_after in status -> ack, and
	               * a verdict once the plan has arrived */
	OP_CHECK,     /* plan, a7 = region index, status = how many items -> a0 = bad items */
	OP_WRITE_TO,  /* plan, desc, s = address to connect to -> writer verdict when done */
	OP_RESET,     /* close the connection, free regions -> ack */
	OP_DEREG,     /* a0 = region index: deregister it (memory kept) -> ack */
	OP_QUIT,
	OP_VERDICT,
};

enum { LENS_UNIFORM = 0, LENS_LADDER = 1 };

typedef struct plan_params {
	uint64_t seed, count, region_size, min_len, max_len, src_shift, lens_kind;
} plan_params_t;

typedef struct plan_item {
	uint64_t off, len;
	uint32_t imm;
} plan_item_t;

typedef struct region_buf {
	rw_rail_region_t *region;
	uint8_t *mem;
	uint64_t size;
} region_buf_t;

typedef struct endpoint {
	struct ev_loop *loop;
	rw_rail_dev_t *dev;
	rw_rail_listener_t *listener;
	rw_rail_conn_t *conn;  /* newest connection (accepted or connected) */
	region_buf_t regions[MAX_REGIONS];

	/* connection events */
	int connected, errors;
	rw_status_t last_error;
	uint64_t accepted_tag;

	/* writer: posts plan items from a source region */
	plan_params_t wp;
	plan_item_t *witems;
	region_buf_t *wsrc;
	rw_rail_remote_t wremote;
	uint64_t posted, done, done_ok, done_err, again, writable, order_bad, post_err;
	uint64_t post_limit;   /* stop posting at this many (UINT64_MAX = all) */
	int writing;

	/* verifier: checks arrivals against a plan */
	plan_params_t vp;
	plan_item_t *vitems;
	region_buf_t *vdst;
	uint64_t arrivals, bad_data, bad_imm, bad_len, bad_where, extra;
	uint64_t drop_after;   /* close the connection after this many arrivals (0 = never) */
	uint64_t dereg_after;  /* deregister vdst after this many arrivals (0 = never) */
	pid_t kill_after_pid;  /* SIGKILL this process at the first on_write_done or arrival */
	int verifying;
} endpoint_t;

typedef struct ctl_msg {
	uint32_t op, status;
	uint64_t a[8];
	uint8_t desc[RW_RAIL_DESC_SIZE];
	char s[RW_RAIL_ADDR_MAX];
} ctl_msg_t;

typedef struct peer {
	int ctl_fd;
	char rail_addr[RW_RAIL_ADDR_MAX]; /* its listener */
	pthread_t thread;
	int is_thread;
	pid_t pid;
} peer_t;

typedef struct fixture {
	struct ev_loop *loop;
	endpoint_t ep;
	peer_t peer;
	int remote; /* responder on another machine */
} fixture_t;

typedef int (*pred_fn)(endpoint_t *ep);

static const uint64_t ladder[] = {
	1, 2, 3, 7, 8, 9, 63, 64, 65, 511, 4095, 4096, 4097, 65535, 65536, 65537,
	(1u << 20) - 1, 1u << 20, (1u << 20) + 1, (4u << 20) + 7, 0 /* immediate only */,
};

extern const rw_rail_conn_cbs_t cbs;
extern uint64_t pred_threshold;

void writer_pump(endpoint_t *ep);
rw_status_t ep_open(endpoint_t *ep, struct ev_loop *loop, const char *local,
			   uint32_t max_writes, uint64_t pace_bps);
region_buf_t *ep_region(endpoint_t *ep, uint64_t size, int fill);
void ep_region_free(region_buf_t *rb);
void ep_reset(endpoint_t *ep);
void ep_close(endpoint_t *ep);
int writer_start(endpoint_t *ep, const plan_params_t *p, rw_rail_remote_t remote);
int verifier_start(endpoint_t *ep, const plan_params_t *p, region_buf_t *dst);
void watchdog_cb(struct ev_loop *loop, ev_timer *w, int revents);
int run_until(endpoint_t *ep, pred_fn pred);
int pred_connected(endpoint_t *ep);
int pred_errored(endpoint_t *ep);
int pred_writes_done(endpoint_t *ep);
int pred_failed_and_drained(endpoint_t *ep);
int pred_posted_done(endpoint_t *ep);
int pred_done_ge(endpoint_t *ep);
int pred_arrivals_ge(endpoint_t *ep);
int pred_arrivals_done(endpoint_t *ep);
int ctl_send(int fd, const ctl_msg_t *m);
void plan_to_msg(const plan_params_t *p, ctl_msg_t *m);
int peer_start_child(peer_t *pr, const char *local);
void peer_stop(peer_t *pr);
int peer_call(peer_t *pr, ctl_msg_t *m);
int test_teardown(void **state);
void connect_peer(fixture_t *f, peer_t *pr);
rw_rail_remote_t peer_region(peer_t *pr, uint64_t size, uint64_t *index_p);
void peer_expect(peer_t *pr, const plan_params_t *p, uint64_t index, uint32_t drop_after);
ctl_msg_t peer_verdict(peer_t *pr);
void write_plan_and_verify(fixture_t *f, const plan_params_t *p);

/* The suite's main: parse the options (default transport given), run role b or the chosen cases
 * of `tests` (at most RH_MAX_TESTS). Exit status as cmocka's, 77 when the transport cannot run. */
int rh_main(int argc, char **argv, const char *default_transport, const struct CMUnitTest *tests,
	    size_t n_tests);

#endif /* RW_TEST_LIB_RAIL_HARNESS_H */
