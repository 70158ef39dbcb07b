/* svc_exec, departures: a peer lost in every stage (and one that dies silently), a rank lost in
 * every stage or between pairs, a combine that waits for its sources, a rank that aborts its
 * pair, and the drain (a node that leaves on purpose). Harness: exec_harness.h. */
#include "tests/service/test_exec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================================================
 * A peer lost in every stage
 * ================================================================================================ */

enum stage_at { AT_GATHER, AT_EXCHANGE, AT_DISPATCH_WRITES, AT_WAIT_COMBINE, AT_COMBINE_WRITES };
static const char *const stage_names[] = { "gather", "exchange", "dispatch writes in flight",
					    "waiting for combine", "combine writes in flight" };

/* Node `victim` dies; survivors' ranks get their errors (no timeout: 20 s phase timeout);
 * the victim restarts, its ranks reconnect, and the same key passes everywhere. */
static void peer_lost_case(const char *path, uint32_t N, enum stage_at at, uint64_t salt)
{
	opts_t o = { .nodes = N, .path = path, .tokens = 20, .max_write = 512 };
	cl_t *c = cl_new(&o, salt);
	const uint32_t victim = N - 1, vr0 = victim * c->G;
	char what[96];
	snprintf(what, sizeof(what), "%s N=%u peer lost in %s", path, N, stage_names[at]);
	switch (at) {
	case AT_GATHER:
		/* only node 0's first rank is in */
		dispatch_submit(c, 0, 0, 0, NULL);
		settle(c);
		break;
	case AT_EXCHANGE:
		for (uint32_t r = 0; r < vr0; r++)
			dispatch_submit(c, r, 0, 0, NULL);
		settle(c);
		break;
	case AT_DISPATCH_WRITES:
		hold(c, m_write(ANY, 0, 0));
		hold(c, m_wdone(ANY));
		dispatch_submit_all(c, 0, 0);
		uint32_t in_flight = 0;
		for (uint32_t s = 1; s < N; s++)
			in_flight += c->w->cnt.writes[0][s][0];
		CHECK(in_flight > 0, "%s: no write in flight", what);
		break;
	case AT_WAIT_COMBINE:
	case AT_COMBINE_WRITES:
		dispatch_all(c, 0, 0);
		if (at == AT_COMBINE_WRITES) {
			hold(c, m_write(ANY, ANY, 1));
			memset(&c->w->cnt, 0, sizeof(c->w->cnt));
			for (uint32_t r = 0; r < c->W; r++)
				combine_submit(c, r, 0, 0);
			settle(c);
			CHECK(c->w->cnt.writes[1][0][1] > 0, "%s: no combine write in flight", what);
		} else {
			combine_submit(c, 0, 0, 0); /* one rank is in, the others not yet */
			settle(c);
		}
		break;
	}
	node_crash(c, victim);
	release_all(c);
	switch (at) {
	case AT_GATHER:
		/* a gathering pair is not failed by a peer loss; once the second rank is in (and the
		 * tokens are counted, in an idle slice) the exchange finds the peer gone and fails
		 * the phase; the survivors' ranks that come later hit the tombstone its PHASE_ERR
		 * left */
		settle(c);
		expect_no_cqe(c, 0);
		dispatch_submit(c, 1, 0, 0, NULL);
		expect_err(c, 1, RW_E_PHASE, what);
		expect_err(c, 0, RW_E_PHASE, what);
		settle(c);
		for (uint32_t r = c->G; r < vr0; r++) {
			dispatch_submit(c, r, 0, 0, NULL);
			expect_err_now(c, r, RW_E_PHASE, what);
		}
		break;
	case AT_EXCHANGE:
	case AT_DISPATCH_WRITES:
		for (uint32_t r = 0; r < vr0; r++)
			expect_err(c, r, RW_E_PHASE, what);
		break;
	case AT_WAIT_COMBINE:
		expect_err(c, 0, RW_E_PHASE, what);
		settle(c);
		for (uint32_t r = 1; r < vr0; r++) { /* the pair failed while they computed */
			combine_submit(c, r, 0, 0);
			expect_err_now(c, r, RW_E_PHASE, what);
			CHECK(strstr(fk_client_notice(c->rk[r].c), "went down"),
			      "%s: rank %u was not told why: '%s'", what, r, fk_client_notice(c->rk[r].c));
		}
		break;
	case AT_COMBINE_WRITES:
		for (uint32_t r = 0; r < vr0; r++)
			expect_err(c, r, RW_E_PHASE, what);
		break;
	}
	expect_quiet_but(c, vr0, c->W);
	node_start(c, victim);
	pump_until(c, mesh_up, NULL, "the victim back");
	node_ranks_connect(c, victim);
	retry_key(c, 0, 0);
	cl_free(c);
}

static void test_peer_lost(void **state)
{
	(void)state;
	for (uint32_t at = AT_GATHER; at <= AT_COMBINE_WRITES; at++) {
		peer_lost_case("native", 3, (enum stage_at)at, 500 + at);
		peer_lost_case("joint", 4, (enum stage_at)at, 510 + at);
	}
}

/* A peer that dies silently (no notice; today's survivors learn from the failed rail writes):
 * the mesh honours its contract (no callback inside a call), every survivor rank fails, the
 * peer is declared down later, comes back, and the same key passes. */
static void test_peer_dies_silently(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "native", .tokens = 20, .max_write = 512 };
	cl_t *c = cl_new(&o, 520);
	hold(c, m_write(ANY, 2, 0));
	dispatch_submit_all(c, 0, 0);
	fk_kill_silent(c->w, 2);
	release_all(c);
	for (uint32_t r = 0; r < 2 * c->G; r++)
		expect_err(c, r, RW_E_PHASE, "silent peer death");
	expect_no_timeouts(c);
	node_crash(c, 2);
	settle(c);
	node_start(c, 2);
	pump_until(c, mesh_up, NULL, "node 2 back");
	node_ranks_connect(c, 2);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * A rank lost in every stage
 * ================================================================================================ */

static void rank_lost_case(const char *path, uint32_t N, enum stage_at at, uint64_t salt)
{
	opts_t o = { .nodes = N, .path = path, .tokens = 20, .max_write = 512 };
	cl_t *c = cl_new(&o, salt);
	const uint32_t victim = c->G + 1; /* node 1, local 1 */
	char what[96];
	snprintf(what, sizeof(what), "%s N=%u rank lost in %s", path, N, stage_names[at]);
	switch (at) {
	case AT_GATHER:
		for (uint32_t r = 0; r < c->W; r++)
			if (r != victim)
				dispatch_submit(c, r, 0, 0, NULL);
		settle(c);
		break;
	case AT_EXCHANGE:
		hold(c, m_ctrl(RW_WIRE_COUNTS, 0, 1));
		dispatch_submit_all(c, 0, 0);
		break;
	case AT_DISPATCH_WRITES:
		hold(c, m_write(ANY, 1, 0));
		dispatch_submit_all(c, 0, 0);
		break;
	case AT_WAIT_COMBINE:
	case AT_COMBINE_WRITES:
		dispatch_all(c, 0, 0);
		if (at == AT_COMBINE_WRITES) {
			hold(c, m_write(ANY, 1, 1));
			for (uint32_t r = 0; r < c->W; r++)
				combine_submit(c, r, 0, 0);
		} else {
			combine_submit(c, 0, 0, 0);
		}
		settle(c);
		break;
	}
	fk_client_die(c->rk[victim].c);
	release_all(c);
	if (at == AT_WAIT_COMBINE) {
		/* node 1's pair fails as a combine with no submission yet; PHASE_ERR fails the
		 * others' pairs: rank 0's combine gets RW_E_PHASE, and so do later combines (the
		 * failed phase's tomb answers them, naming the rank that left) */
		expect_err(c, 0, RW_E_PHASE, what);
		settle(c);
		for (uint32_t r = 1; r < c->W; r++) {
			if (r == victim)
				continue;
			combine_submit(c, r, 0, 0);
			expect_err_now(c, r, RW_E_PHASE, what);
			CHECK(strstr(fk_client_notice(c->rk[r].c), "left"),
			      "%s: rank %u was not told why: '%s'", what, r, fk_client_notice(c->rk[r].c));
		}
	} else {
		for (uint32_t r = 0; r < c->W; r++)
			if (r != victim)
				expect_err(c, r, RW_E_PHASE, what);
	}
	expect_quiet_but(c, victim, victim + 1);
	rank_connect(c, victim);
	retry_key(c, 0, 0);
	cl_free(c);
}

static void test_rank_lost(void **state)
{
	(void)state;
	for (uint32_t at = AT_GATHER; at <= AT_COMBINE_WRITES; at++) {
		rank_lost_case("native", 2, (enum stage_at)at, 600 + at);
		rank_lost_case("perm-only", 3, (enum stage_at)at, 610 + at);
	}
}

/* What a node's combine waits for (docs/dataflow.md "Combine"): its own ranks' combines - a rank
 * that received no rows too - and the combine rows of every node its tokens went to; never a
 * node that got none of its tokens. Here node 0's ranks keep their tokens at home, and node 1's
 * local rank 1 leaves after the dispatch, so node 1's pair fails and says so. If node 0's ranks
 * combine while that PHASE_ERR is on its way (held), node 0's combine needs nothing from node 1
 * and completes exactly; the late report then fails nothing. If the report comes first, node 0's
 * pair is still open and fails with it: its ranks' combines get RW_E_PHASE naming the rank that
 * left. With node 0's tokens going to both nodes (home = 0), node 0 needs node 1's rows and its
 * combines fail in either order. Then the key passes. */
static void combine_sources_case(uint32_t home, int report_first, uint64_t salt)
{
	opts_t o = { .nodes = 2, .path = "joint", .stay_home = home, .fifo = 1 };
	cl_t *c = cl_new(&o, salt);
	const uint32_t victim = c->G + 1;
	dispatch_all(c, 0, 0);
	if (!report_first)
		hold(c, m_ctrl(RW_WIRE_PHASE_ERR, 1, 0));
	fk_client_die(c->rk[victim].c);
	settle(c);
	for (uint32_t r = 0; r < c->G; r++)
		combine_submit(c, r, 0, 0);
	settle(c);
	release_all(c);
	for (uint32_t r = 0; r < c->G; r++) {
		rw_cqe_t q = next_cqe(c, r);
		if (home && !report_first) {
			combine_check(c, r, 0, 0, &q);
			continue;
		}
		CHECK(q.status == RW_CQ_ERROR && q.error == RW_E_PHASE,
		      "home %u report first %d: rank %u: status %u error %d", home, report_first, r,
		      q.status, q.error);
		CHECK(strstr(fk_client_notice(c->rk[r].c), "local rank 3 left"),
		      "rank %u's reason does not name the rank that left: %s", r,
		      fk_client_notice(c->rk[r].c));
	}
	combine_submit(c, c->G, 0, 0); /* node 1's other rank: the failed phase's tomb */
	expect_err(c, c->G, RW_E_PHASE, "node 1's combine after its rank left");
	settle(c);
	rank_connect(c, victim);
	retry_key(c, 0, 0);
	cl_free(c);
}

static void test_combine_waits_for_sources(void **state)
{
	(void)state;
	combine_sources_case(1u << 0, 0, 630);
	combine_sources_case(1u << 0, 1, 631);
	combine_sources_case(0, 0, 632);
	combine_sources_case(0, 1, 633);
}

/* Ranks that leave between pairs fail nothing; when a node's ranks of the group have all left,
 * the group goes, and it forms again when they reconnect. */
static void test_rank_leaves_between_pairs(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "joint" };
	cl_t *c = cl_new(&o, 620);
	run_pair(c, 0, 0);
	for (uint32_t r = 0; r < c->G; r++)
		fk_client_die(c->rk[r].c);
	settle(c);
	for (uint32_t r = 0; r < c->G; r++)
		rank_connect(c, r);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* A ring rank that left between pairs and joined again owes none of the keys its group ran
 * meanwhile (docs/rankpath.md "Failure", the rule of absences): its first dispatch, of step 2,
 * opens its node's pair alone; its node's other rank's dispatch of step 1, the key it skipped,
 * then fails step 1 on every node at once, naming it (the other node's ranks get it from their
 * own submissions, a tomb of the key), and step 2 passes for every rank. Before, the pair did
 * not know its rank came new (a ring rank's dispatch was marked taken before its pair saw it):
 * the other rank was refused "layer 0 step 2 is still running" and the other node's pair of
 * step 1 waited for the phase timeout. */
static void test_ring_rank_rejoins_past_a_key(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "joint", .tokens = 20 };
	cl_t *c = cl_new(&o, 640);
	const char *what = "rank 1 joined again past step 1";
	run_pair(c, 0, 0);
	fk_client_die(c->rk[1].c);
	settle(c);
	rank_connect(c, 1);
	dispatch_submit(c, 1, 2, 0, NULL);
	settle(c);
	expect_no_cqe(c, 1);
	dispatch_submit(c, 0, 1, 0, NULL);
	expect_err_now(c, 0, RW_E_PHASE, what);
	CHECK(strstr(fk_client_notice(c->rk[0].c), "local rank 1 joined again"),
	      "%s: rank 0 was not told why: '%s'", what, fk_client_notice(c->rk[0].c));
	settle(c);
	for (uint32_t r = c->G; r < c->W; r++) {
		dispatch_submit(c, r, 1, 0, NULL);
		expect_err_now(c, r, RW_E_PHASE, what);
		CHECK(strstr(fk_client_notice(c->rk[r].c), "local rank 1 joined again"),
		      "%s: rank %u was not told why: '%s'", what, r, fk_client_notice(c->rk[r].c));
	}
	expect_quiet_but(c, 0, 0);
	for (uint32_t r = 0; r < c->W; r++)
		if (r != 1)
			dispatch_submit(c, r, 2, 0, NULL);
	dispatch_collect(c, 2, 0);
	combine_all(c, 2, 0);
	expect_quiet_but(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * A rank that aborts its pair (ipc/railwave.h "Failing a pair by its key")
 * ================================================================================================ */

/* A failure that begins at a node's combine is a failure of the combine everywhere
 * (docs/dataflow.md "Failures"): node 0's dispatch has completed, the other nodes' still runs
 * (their writes have landed but not reported) when node 0's rank 0 aborts the pair, or leaves.
 * Their dispatch must still complete, exactly, and their ranks' combines then get RW_E_PHASE
 * naming rank 0; before, the PHASE_ERR failed their dispatch, so a rank's error came at the
 * dispatch on one node and at the combine on another. Then the key passes. */
static void combine_failure_case(const char *path, uint32_t N, int leave, uint64_t salt)
{
	opts_t o = { .nodes = N, .path = path, .tokens = 20, .max_write = 512 };
	cl_t *c = cl_new(&o, salt);
	char what[96];
	snprintf(what, sizeof(what), "%s N=%u rank 0 %s after node 0's dispatch", path, N,
		 leave ? "left" : "aborted");
	for (uint32_t n = 1; n < N; n++)
		hold(c, m_wdone((int)n)); /* the other nodes' dispatch cannot end yet */
	dispatch_submit_all(c, 0, 0);
	for (uint32_t r = 0; r < c->G; r++) {
		rw_cqe_t q = next_cqe(c, r);
		dispatch_check(c, r, 0, 0, &q);
	}
	for (uint32_t r = c->G; r < c->W; r++)
		expect_no_cqe(c, r);
	if (leave)
		fk_client_die(c->rk[0].c);
	else
		abort_submit(c, 0, 0, 0);
	settle(c); /* node 0's PHASE_ERR reaches the others while their dispatch runs */
	if (!leave)
		expect_err_now(c, 0, RW_E_PHASE, what);
	combine_submit(c, 1, 0, 0);
	expect_err_now(c, 1, RW_E_PHASE, what);
	for (uint32_t r = c->G; r < c->W; r++)
		expect_no_cqe(c, r);
	release_all(c);
	for (uint32_t r = c->G; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		dispatch_check(c, r, 0, 0, &q);
	}
	settle(c);
	for (uint32_t r = c->G; r < c->W; r++) {
		combine_submit(c, r, 0, 0);
		expect_err_now(c, r, RW_E_PHASE, what);
		CHECK(strstr(fk_client_notice(c->rk[r].c), leave ? "local rank 0 left" :
			     "local rank 0 aborted"), "%s: rank %u was not told why: '%s'", what, r,
		      fk_client_notice(c->rk[r].c));
	}
	expect_quiet_but(c, 0, leave ? 1 : 0);
	if (leave)
		rank_connect(c, 0);
	retry_key(c, 0, 0);
	cl_free(c);
}

static void test_combine_failure_after_dispatch(void **state)
{
	(void)state;
	combine_failure_case("native", 2, 0, 640);
	combine_failure_case("native", 2, 1, 641);
	/* paths that post to every destination at once: in a wave path node 0's own data would
	 * wait behind the held reports */
	combine_failure_case("rail-only", 3, 0, 642);
	combine_failure_case("native", 3, 1, 643);
}

/* An abort names its pair: node 1's rank aborts step 0, node 0's rank 0 gets its error and
 * opens step 1, and only then does node 0's rank 1 abort step 0 too. That late abort is
 * answered alone (RW_E_STATE, nothing to fail) and step 1 passes exactly. A rank that left the
 * group at that moment instead would fail step 1, the pair open when its leave arrived: the
 * package used to fail pairs that way. */
static void test_abort_names_its_key(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "joint", .tokens = 16 };
	cl_t *c = cl_new(&o, 650);
	const uint32_t first = c->G + 1, late = 1;
	dispatch_all(c, 0, 0);
	abort_submit(c, first, 0, 0);
	expect_err(c, first, RW_E_PHASE, "the abort that failed step 0");
	combine_submit(c, 0, 0, 0);
	expect_err(c, 0, RW_E_PHASE, "rank 0's combine of the aborted step 0");
	dispatch_submit(c, 0, 1, 0, NULL); /* node 0's pair of step 1 opens */
	settle(c);
	abort_submit(c, late, 0, 0);
	expect_err_now(c, late, RW_E_STATE, "a late abort of step 0");
	CHECK(strstr(fk_client_notice(c->rk[late].c), "nothing to fail"),
	      "the late abort was not told why: '%s'", fk_client_notice(c->rk[late].c));
	combine_submit(c, c->G, 0, 0); /* node 1's other rank: the failed step's tomb */
	expect_err_now(c, c->G, RW_E_PHASE, "node 1's combine of the aborted step 0");
	for (uint32_t r = 1; r < c->W; r++)
		dispatch_submit(c, r, 1, 0, NULL);
	dispatch_collect(c, 1, 0);
	expect_quiet_but(c, 0, 0); /* and no timeout */
	combine_all(c, 1, 0);
	cl_free(c);
}

/* ================================================================================================
 * Drain
 * ================================================================================================ */

/* SIGTERM with a pair in flight: new pairs are refused (RW_E_STATE); the running dispatch
 * completes, and today the pair then closes without its combine (RW_E_HANDLE) and the daemon
 * stops (rw_svc_stop). The peer's combine then fails when the draining node goes; the node
 * restarts and the same key passes. Without a phase in flight the drain stops at once. */
static void test_drain(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native", .tokens = 12 };
	cl_t *c = cl_new(&o, 700);
	hold(c, m_write(ANY, 0, 0));
	dispatch_submit_all(c, 0, 0);
	node_drain(c, 0);
	CHECK(c->svc[0].stopping == 0, "stopped with a phase in flight");
	rw_ipc_client_t *other = fk_client_new(c->w, 0, "g.late", 0, c->W, 0);
	fk_client_join(other);
	uint8_t *mem;
	uint32_t b = fk_client_buffer(other, 4096, &mem);
	rw_span_t none = { RW_BUF_NONE, 0, 0 };
	rw_sqe_t s = { .kind = RW_KIND_DISPATCH, .dtype = RW_DTYPE_FP32, .topk = TOPK, .layer = 0, .step = 0,
		       .token_count = 0, .hidden = c->hidden, .tokens = none, .topk_ids = none,
		       .topk_weights = none, .output = { b, 0, 0 }, .output_capacity = 4096, .n_experts = c->E };
	fk_client_submit(other, &s);
	fk_client_stats_t st;
	fk_client_stats(other, &st);
	CHECK(st.n_cqe == 1 && fk_client_cqe(other, 0)->error == RW_E_STATE, "draining: a new pair was not refused");
	release_all(c);
	dispatch_collect(c, 0, 0);
	CHECK(c->svc[0].stopping == 1, "drain finished but the daemon was not stopped");
	for (uint32_t r = 0; r < c->G; r++) {
		combine_submit(c, r, 0, 0);
		expect_err_now(c, r, RW_E_HANDLE, "combine after the drain closed the pair");
	}
	for (uint32_t r = c->G; r < c->W; r++)
		combine_submit(c, r, 0, 0);
	settle(c);
	fk_kill(c->w, 0); /* the drained daemon exits */
	node_stop(c, 0);
	for (uint32_t r = c->G; r < c->W; r++)
		expect_err(c, r, RW_E_PHASE, "peer exited after its drain");
	node_start(c, 0);
	pump_until(c, mesh_up, NULL, "node 0 back");
	node_ranks_connect(c, 0);
	run_pair(c, 0, 0);
	node_drain(c, 1);
	CHECK(c->svc[1].stopping == 1, "an idle drain did not stop at once");
	cl_free(c);
}

int exec_leave_run(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_peer_lost),
		cmocka_unit_test(test_peer_dies_silently),
		cmocka_unit_test(test_rank_lost),
		cmocka_unit_test(test_rank_leaves_between_pairs),
		cmocka_unit_test(test_ring_rank_rejoins_past_a_key),
		cmocka_unit_test(test_combine_waits_for_sources),
		cmocka_unit_test(test_combine_failure_after_dispatch),
		cmocka_unit_test(test_abort_names_its_key),
		cmocka_unit_test(test_drain),
	};
	return cmocka_run_group_tests_name("svc_exec_leave", tests, NULL, NULL);
}
