/* svc_exec, failures: tombstones, phase timeouts (on either side, lost rows, combine), same-key
 * retries, PHASE_ERR relayed through a node that has no pair. Harness: exec_harness.h. */
#include "tests/service/test_exec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================================================
 * Failures: tombstones, timeouts, same-key retry, relayed PHASE_ERR
 * ================================================================================================ */

/* Node 1's ranks never come: node 0's phase times out (RW_E_PHASE), PHASE_ERR tells node 1,
 * which has no pair and keeps a tombstone: its ranks, submitting that key later, fail at once
 * (inside the submission). Then every rank retries the same key at once and it passes. */
static cl_t *node1_never_comes(uint64_t seed)
{
	opts_t o = { .nodes = 2, .path = "native", .timeout_ms = 1000 };
	cl_t *c = cl_new(&o, seed);
	for (uint32_t r = 0; r < c->G; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	for (uint32_t r = 0; r < c->G; r++)
		expect_err(c, r, RW_E_PHASE, "timeout");
	settle(c);
	return c;
}

static void test_timeout_tombstone_retry(void **state)
{
	(void)state;
	cl_t *c = node1_never_comes(300);
	for (uint32_t r = c->G; r < c->W; r++) {
		dispatch_submit(c, r, 0, 0, NULL);
		expect_err_now(c, r, RW_E_PHASE, "tombstone");
	}
	run_pair(c, 0, 0); /* the same key */
	run_pair(c, 0, 1);
	cl_free(c);
}

/* The same, but node 0's ranks retry at once, before node 1's ranks have come: node 0's row of
 * the retry reaches node 1 while the key is still a tomb there (its ranks owe their answer to
 * the failed phase), so the retry cannot complete. Node 1 says so at once (a PHASE_ERR naming
 * node 0's new attempt): node 0's ranks fail without a phase timeout, node 1's ranks get the
 * tomb's answer when they come, and the next retry of everyone passes. Before, node 1 dropped
 * the row silently and node 0 waited out its timeout, again and again. */
static void test_retry_meets_tomb(void **state)
{
	(void)state;
	cl_t *c = node1_never_comes(310);
	uint64_t timeouts = c->svc[0].metrics.errors[-RW_ERR_TIMEOUT];
	for (uint32_t r = 0; r < c->G; r++) /* node 0's retry, at once */
		dispatch_submit(c, r, 0, 0, NULL);
	for (uint32_t r = 0; r < c->G; r++)
		expect_err(c, r, RW_E_PHASE, "node 0's retry met node 1's tomb");
	CHECK(c->svc[0].metrics.errors[-RW_ERR_TIMEOUT] == timeouts,
	      "node 0's retry waited out a phase timeout");
	CHECK(strstr(fk_client_notice(c->rk[0].c), "failed there before this attempt"),
	      "rank 0 was not told why: '%s'", fk_client_notice(c->rk[0].c));
	for (uint32_t r = c->G; r < c->W; r++) {
		dispatch_submit(c, r, 0, 0, NULL);
		expect_err_now(c, r, RW_E_PHASE, "tombstone");
	}
	retry_key(c, 0, 0);
	cl_free(c);
}

/* A count row lost on the way (the fake drops it): node 0 waits in the exchange until its phase
 * timeout, fails the phase (RW_E_PHASE) and tells the others, which had every row and were
 * already moving data; the key then passes. */
static int is_counts_1_0(const fk_ev_t *ev, void *ctx)
{
	(void)ctx;
	return ev->kind == FK_EV_CTRL && ev->type == RW_WIRE_COUNTS && ev->src == 1 && ev->dst == 0;
}

static void test_timeout_lost_row(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "joint", .timeout_ms = 1000, .fifo = 1 };
	cl_t *c = cl_new(&o, 305);
	hold(c, m_ctrl(RW_WIRE_COUNTS, 1, 0));
	dispatch_submit_all(c, 0, 0);
	CHECK(fk_drop(c->w, is_counts_1_0, NULL) == 1, "node 1's row to node 0 was not queued");
	release_all(c);
	for (uint32_t r = 0; r < c->W; r++)
		expect_err(c, r, RW_E_PHASE, "a lost count row");
	CHECK(c->svc[0].metrics.errors[-RW_ERR_TIMEOUT] == 1, "node 0 did not fail by its timeout");
	retry_key(c, 0, 0);
	cl_free(c);
}

/* Both nodes time out on their own (integration "timeout" on a loaded machine): node 1 waits in
 * its gather for a local rank that never submits (node 0's row waits there as an early row),
 * node 0 waits for node 1's row, and both PHASE_ERRs are held until both have failed. Node 1's
 * report must name node 0's attempt by the epoch of that early row ("Failures" 5): with 0 ("no
 * row"), node 0 cannot tell it from a failure of a retry and plants a tomb that fails its
 * ranks' retries at once. Then every rank retries the key at once (retry_key). */
static int row_0_at_1(cl_t *c, const void *arg)
{
	(void)arg;
	return c->w->cnt.ctrl_delivered[RW_WIRE_COUNTS][0][1] > 0;
}

static void test_timeout_both_sides(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native", .timeout_ms = 1000 };
	cl_t *c = cl_new(&o, 307);
	hold(c, m_ctrl(RW_WIRE_PHASE_ERR, ANY, ANY));
	/* Node 0's row reaches node 1 before node 1's ranks submit, so node 1's timer, started by
	 * its first rank, cannot fire before the row is there however slowly this process runs. */
	for (uint32_t r = 0; r < c->G; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	pump_until(c, row_0_at_1, NULL, "node 0's count row at node 1");
	dispatch_submit(c, c->G, 0, 0, NULL); /* node 1's second rank never comes */
	for (uint32_t r = 0; r < c->G + 1; r++)
		expect_err(c, r, RW_E_PHASE, "both sides' timeouts");
	CHECK(c->svc[0].metrics.errors[-RW_ERR_TIMEOUT] == 1 &&
	      c->svc[1].metrics.errors[-RW_ERR_TIMEOUT] == 1, "each node did not time out on its own");
	dispatch_submit(c, c->G + 1, 0, 0, NULL); /* late: node 1's tomb answers it */
	expect_err_now(c, c->G + 1, RW_E_PHASE, "node 1's tombstone");
	release_all(c);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* A timeout in the combine: node 1's ranks dispatch but never combine. */
static void test_timeout_combine(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "joint", .timeout_ms = 1000 };
	cl_t *c = cl_new(&o, 301);
	dispatch_all(c, 0, 0);
	for (uint32_t r = 0; r < c->G; r++)
		combine_submit(c, r, 0, 0);
	for (uint32_t r = 0; r < c->G; r++)
		expect_err(c, r, RW_E_PHASE, "combine timeout");
	settle(c);
	/* node 1's pair failed by node 0's PHASE_ERR while its ranks computed: their combines get
	 * the phase's error at once, with node 0's reason */
	for (uint32_t r = c->G; r < c->W; r++) {
		combine_submit(c, r, 0, 0);
		expect_err_now(c, r, RW_E_PHASE, "combine after the peer failed it");
		CHECK(strstr(fk_client_notice(c->rk[r].c), "timed out"),
		      "rank %u was not told why: '%s'", r, fk_client_notice(c->rk[r].c));
	}
	run_pair(c, 0, 0);
	cl_free(c);
}

/* Nodes 0 and 1 dispatch and exchange rows; node 2's PHASE_ERR (or node 1's, `held_src`) to
 * node 0 is held; node 2's first rank gives a bad E and is refused at once, and the failure
 * reaches every rank of nodes 0 and 1; node 2's other rank then hits the tombstone. */
static void node2_refuses(cl_t *c, uint32_t held_src, const char *how)
{
	for (uint32_t r = 0; r < 2 * c->G; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c); /* nodes 0 and 1 exchanged rows, wait for node 2 */
	hold(c, m_ctrl(RW_WIRE_PHASE_ERR, (int)held_src, 0));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	sub_opts_t bad = { .n_experts = c->E + 1 };
	dispatch_submit(c, 2 * c->G, 0, 0, &bad);
	expect_err_now(c, 2 * c->G, RW_E_EXPERTS, "E not a multiple of W");
	for (uint32_t r = 0; r < 2 * c->G; r++)
		expect_err(c, r, RW_E_PHASE, how);
	dispatch_submit(c, 2 * c->G + 1, 0, 0, NULL);
	expect_err_now(c, 2 * c->G + 1, RW_E_PHASE, "node 2's tombstone");
}

/* The relayed PHASE_ERR (docs/dataflow.md "Failures" 2): node 2 refuses a rank's E and tells
 * nodes 0 and 1 (origin, no pair: a fresh cause id); its message to node 0 is held, so node 0
 * fails only by node 1's relay, which names node 1's row that node 0 took. Node 2's other rank
 * hits the tombstone. Then node 2's origin reaches node 0, which has no pair, and every rank
 * retries the key at once (retry_key: no refusal, no timeout). Before failures
 * carried their cause ("Failures" 4), node 0 could not tell that origin from a failure of a new
 * attempt and planted a tomb no rank would answer: its ranks' retries failed at once without
 * telling anyone and nodes 1 and 2 waited for their phase timeout. */
static void test_relay_fails_taker(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "native", .fifo = 1 };
	cl_t *c = cl_new(&o, 302);
	node2_refuses(c, 2, "failed by the relay");
	CHECK(c->w->cnt.ctrl_delivered[RW_WIRE_PHASE_ERR][2][0] == 0, "the origin reached node 0");
	CHECK(c->w->cnt.ctrl_posted[RW_WIRE_PHASE_ERR][1][0] == 1, "node 1 relayed %u times",
	      c->w->cnt.ctrl_posted[RW_WIRE_PHASE_ERR][1][0]);
	expect_no_timeouts(c);
	release_all(c);
	retry_key(c, 0, 0);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* A relay about an attempt that a node has already left does not fail its retry: node 0 fails by
 * node 2's origin; node 1's relay to node 0 is held while everyone retries the key; released,
 * it is recognised as the dead attempt's and the retry completes. */
static void test_relay_spares_retry(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "joint", .fifo = 1 };
	cl_t *c = cl_new(&o, 303);
	node2_refuses(c, 1, "failed by the origin");
	/* everyone retries the key while node 1's relay to node 0 is still held */
	dispatch_submit_all(c, 0, 0);
	release_all(c);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* A PHASE_ERR for a key no pair has yet leaves a tombstone: each local rank's first dispatch of
 * that key fails at once; its next one runs. (A peer can poison a key this way; peers are
 * trusted today.) Also a PHASE_ERR for a combine kind with no pair does nothing. */
static void test_phase_err_before_pair(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native" };
	cl_t *c = cl_new(&o, 304);
	rw_wire_phase_err_t e = { .key = { .group = rw_wire_group_hash(c->group), .layer = 3, .step = 9 },
				  .kind = 0, .status = RW_ERR_INVAL, .node = 1, .epoch = 5,
				  .cause_node = 1, .cause_id = 5 };
	snprintf(e.msg, sizeof(e.msg), "injected");
	uint8_t buf[RW_WIRE_PHASE_ERR_SIZE];
	size_t n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
	assert_int_equal(rw_svc_mesh_send(fk_mesh(1), 0, RW_WIRE_PHASE_ERR, buf, (uint32_t)n), RW_OK);
	e.key.layer = 4;
	e.kind = 1;
	n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
	assert_int_equal(rw_svc_mesh_send(fk_mesh(1), 0, RW_WIRE_PHASE_ERR, buf, (uint32_t)n), RW_OK);
	settle(c);
	for (uint32_t r = 0; r < c->G; r++) {
		dispatch_submit(c, r, 9, 3, NULL);
		expect_err_now(c, r, RW_E_PHASE, "tombstone of an injected PHASE_ERR");
	}
	run_pair(c, 9, 3);
	run_pair(c, 9, 4);
	cl_free(c);
}

int exec_failures_run(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_timeout_tombstone_retry),
		cmocka_unit_test(test_retry_meets_tomb),
		cmocka_unit_test(test_timeout_combine),
		cmocka_unit_test(test_timeout_lost_row),
		cmocka_unit_test(test_timeout_both_sides),
		cmocka_unit_test(test_relay_fails_taker),
		cmocka_unit_test(test_relay_spares_retry),
		cmocka_unit_test(test_phase_err_before_pair),
	};
	return cmocka_run_group_tests_name("svc_exec_failures", tests, NULL, NULL);
}
