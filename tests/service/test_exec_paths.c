/* svc_exec, paths: every forced path and the selector checked exactly (2-4 nodes, fp32 and bf16,
 * empty phases, small and unlimited writes, count rows sliced and before the records); the
 * receiver gate of the waved paths (grants held, a grant before its wave, a peer lost while
 * waiting for one); count rows early and late. Harness: exec_harness.h. */
#include "tests/service/test_exec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================================================
 * Paths
 * ================================================================================================ */

/* Every forced path and the selector over several layers and steps (fp32/bf16 alternating),
 * with empty phases; the forced path shows in the metrics; the waved paths keep one wave source
 * at a time at every receiver (wave_fanin_max 1). */
static void paths_case(uint32_t N, uint32_t G, uint32_t R, uint32_t experts, int empty, uint64_t salt)
{
	for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names); pi++) {
		opts_t o = { .nodes = N, .gpus = G, .rails = R, .path = path_names[pi], .experts = experts,
			     .empty = empty };
		cl_t *c = cl_new(&o, salt * 16 + pi);
		for (uint32_t step = 0; step < 2; step++)
			for (uint32_t layer = 0; layer < 3; layer++)
				run_pair(c, step, layer);
		for (uint32_t n = 0; n < N; n++) {
			const rw_svc_metrics_t *m = &c->svc[n].metrics;
			uint64_t ok = 0;
			for (uint32_t p = 0; p < RW_PATH_COUNT; p++)
				ok += m->phase[p][RW_SVC_DISPATCH].ok;
			CHECK(ok == 6, "node %u: %llu dispatches ok", n, (unsigned long long)ok);
			if (pi < RW_PATH_COUNT) /* forced: every phase on that path, said so */
				CHECK(m->phase[pi][RW_SVC_DISPATCH].ok == 6 && m->phase[pi][RW_SVC_COMBINE].ok == 6 &&
				      m->selected[pi][RW_SELECT_FORCED] == 6,
				      "node %u: path %s not used for every phase", n, path_names[pi]);
			else /* the selector without an anchor table: Joint, or Native when nothing is remote */
				CHECK(m->selected[RW_PATH_JOINT][RW_SELECT_NO_TABLE] +
				      m->selected[RW_PATH_NATIVE][RW_SELECT_NO_REMOTE] == 6,
				      "node %u: the selector chose otherwise", n);
			if (pi < RW_PATH_COUNT && rw_path_waved((rw_path_t)pi) && N > 2 && !empty)
				CHECK(m->wave_fanin_max == 1, "node %u: wave_fanin_max %u under the receiver gate",
				      n, m->wave_fanin_max);
		}
		cl_free(c);
	}
}

static void test_paths_n2(void **state)
{
	(void)state;
	paths_case(2, 2, 2, 0, 1, 1);
	paths_case(2, 1, 1, 0, 0, 2);
}

static void test_paths_n3(void **state)
{
	(void)state;
	paths_case(3, 2, 2, 0, 0, 3);
	paths_case(3, 1, 2, 24, 1, 4); /* E > 16: counts in the output buffer */
}

static void test_paths_n4(void **state)
{
	(void)state;
	paths_case(4, 2, 2, 0, 0, 5);
	paths_case(4, 2, 1, 32, 1, 6);
}

/* The selector with an anchor table (docs/selector.md §1): one anchor that every phase is near (huge
 * size ratio, shape tolerance 1) selects Perm-only, so every phase with remote data runs on it
 * (reason "anchor"), identically on every node, and checks exactly. */
static void test_selector_anchor(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "auto" };
	cl_t *c = cl_new(&o, 60);
	rw_anchor_t anchor = { .case_id = 7, .feat = { 10.0, 0.5, 0.5 }, .selected = RW_PATH_PERM_ONLY };
	rw_anchor_table_t table = { .schema_version = RW_ANCHOR_SCHEMA, .max_size_ratio = 1e12,
				    .shape_tolerance = 1.0, .n_anchors = 1, .anchors = &anchor };
	for (uint32_t n = 0; n < c->N; n++)
		c->svc[n].anchors = &table;
	for (uint32_t layer = 0; layer < 4; layer++)
		run_pair(c, 0, layer);
	for (uint32_t n = 0; n < c->N; n++) {
		const rw_svc_metrics_t *m = &c->svc[n].metrics;
		CHECK(m->selected[RW_PATH_PERM_ONLY][RW_SELECT_ANCHOR] >= 1 &&
		      m->selected[RW_PATH_PERM_ONLY][RW_SELECT_ANCHOR] +
		      m->selected[RW_PATH_NATIVE][RW_SELECT_NO_REMOTE] == 4 &&
		      m->phase[RW_PATH_PERM_ONLY][RW_SVC_COMBINE].ok == m->selected[RW_PATH_PERM_ONLY][RW_SELECT_ANCHOR],
		      "node %u: the anchor's path was not used", n);
		c->svc[n].anchors = NULL;
	}
	cl_free(c);
}

/* A dispatch's tokens are counted in idle slices, so a limit-sized submission cannot hold the
 * loop: with one token per slice, the last local rank's submission and a few
 * loop iterations do not yet send the node's count row (the old executor counted inside the
 * submission call and sent it at once); it goes once every token is counted, and the phase's
 * results are exact. */
static int row_sent_0_1(cl_t *c, const void *arg)
{
	(void)arg;
	return c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] > 0;
}

static void test_count_sliced(void **state)
{
	(void)state;
	setenv("RAILWAVE_TEST_LOCAL_SLICE", "1", 1);
	opts_t o = { .nodes = 2, .gpus = 2, .path = "rail-only", .tokens = 24 };
	cl_t *c = cl_new(&o, 906);
	for (uint32_t r = 0; r < c->G; r++) /* node 0's ranks */
		dispatch_submit(c, r, 0, 0, NULL);
	for (int i = 0; i < 4; i++)
		ev_run(c->loop, EVRUN_NOWAIT);
	CHECK(c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] == 0,
	      "node 0 sent its count row before its tokens were counted slice by slice");
	unsetenv("RAILWAVE_TEST_LOCAL_SLICE"); /* read at node start: the nodes keep 1 */
	pump_until(c, row_sent_0_1, NULL, "node 0's count row");
	CHECK(c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] == 1, "node 0 sent its count row twice");
	for (uint32_t r = c->G; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* A rank's routing is read once (docs/security.md): with one token per idle slice, rank 0's
 * ids are rewritten right after node 0's count row was posted, while the records pass is still
 * to run - every id dropped (layer 0), every token also sent to node 1 (layer 1). The daemon
 * built the row from its own copy of the ids and builds the records, the packed slabs and the
 * local forwarding from that copy too, so the phase passes with exactly the routing submitted
 * (checked against the reference) and the rewrite reaches nobody. */
static int row_posted_0_1(cl_t *c, const void *arg)
{
	return c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] > *(const uint32_t *)arg;
}

static void test_ids_read_once(void **state)
{
	(void)state;
	setenv("RAILWAVE_TEST_LOCAL_SLICE", "1", 1);
	opts_t o = { .nodes = 2, .gpus = 2, .rails = 2, .path = "native", .tokens = 24, .fifo = 1 };
	cl_t *c = cl_new(&o, 907);
	unsetenv("RAILWAVE_TEST_LOCAL_SLICE"); /* read at node start: the nodes keep 1 */
	for (uint32_t layer = 0; layer < 2; layer++) {
		uint32_t before = c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1];
		for (uint32_t r = 0; r < c->G; r++) /* node 0's ranks */
			dispatch_submit(c, r, 0, layer, NULL);
		pump_until(c, row_posted_0_1, &before, "node 0's count row");
		trank_t *t = &c->rk[0];
		for (uint32_t i = 0; i < c->o.tokens; i++) {
			int32_t ids[TOPK] = { -1, -1, -1, -1 };
			if (layer) { /* node 0 and node 1 */
				ids[0] = (int32_t)(i % (c->E / 2));
				ids[1] = (int32_t)(c->E / 2 + i % (c->E / 2));
			}
			memcpy(t->mem + c->off_ids + (uint64_t)i * TOPK * 4, ids, sizeof(ids));
		}
		for (uint32_t r = c->G; r < c->W; r++)
			dispatch_submit(c, r, 0, layer, NULL);
		dispatch_collect(c, 0, layer);
		combine_all(c, 0, layer);
		expect_no_timeouts(c);
	}
	CHECK(c->svc[0].metrics.counts_host == 2 && c->svc[0].metrics.counts_gpu == 0,
	      "node 0 counted %llu rows on the host, %llu on a GPU", (unsigned long long)
	      c->svc[0].metrics.counts_host, (unsigned long long)c->svc[0].metrics.counts_gpu);
	cl_free(c);
}

/* Slabs cut into many writes (1 KiB each), local work one record per idle slice... the same
 * exact results (the executor's resumable send loop and chunking). */
/* A rail device that names no largest write (max_write_length 0): the executor writes in its own
 * largest pieces (EXEC_CHUNK_MAX) instead of dividing by zero, on every path. */
static void test_paths_no_write_limit(void **state)
{
	(void)state;
	for (uint32_t pi = 0; pi < RW_PATH_COUNT; pi++) {
		opts_t o = { .nodes = 3, .path = path_names[pi], .tokens = 40 };
		cl_t *c = cl_new(&o, 60 + pi);
		c->w->max_write = 0;
		run_pair(c, 0, 0);
		run_pair(c, 0, 1);
		cl_free(c);
	}
}

/* Ranges of many 1 KiB writes: the host mover takes every prefix as it arrives (its `part`:
 * dispatch records forwarded, combine rows noted and their tokens summed while the rest is on
 * the wire), every result exact. */
static void test_paths_small_writes(void **state)
{
	(void)state;
	setenv("RAILWAVE_TEST_LOCAL_SLICE", "1", 1);
	for (uint32_t pi = 0; pi < RW_PATH_COUNT; pi++) {
		opts_t o = { .nodes = 3, .gpus = 2, .rails = 2, .path = path_names[pi], .max_write = 1024 };
		cl_t *c = cl_new(&o, 40 + pi);
		run_pair(c, 0, 0);
		run_pair(c, 0, 1);
		for (uint32_t n = 0; n < c->N; n++)
			CHECK(c->svc[n].metrics.rx_prefixes > 0, "node %u took no range in pieces", n);
		cl_free(c);
	}
	unsetenv("RAILWAVE_TEST_LOCAL_SLICE");
}

/* ================================================================================================
 * The receiver gate of the waved paths
 * ================================================================================================ */

/* Records (tokens with an expert there) from node s to node d in (step, layer). */
static uint32_t flow(cl_t *c, uint32_t step, uint32_t layer, uint32_t s, uint32_t d)
{
	uint32_t n = 0;
	for (uint32_t g = 0; g < c->G; g++) {
		cl_gen(c, step, layer, s * c->G + g, &c->other);
		for (uint32_t t = 0; t < c->other.n; t++) {
			int hit = 0;
			for (uint32_t k = 0; k < TOPK; k++)
				hit |= c->other.ids[t][k] >= 0 &&
				       (uint32_t)c->other.ids[t][k] / c->per_rank / c->G == d;
			n += hit;
		}
	}
	return n;
}

/* docs/dataflow.md "Send": s waits for wave k's grant when it has data for d = s + k and some
 * earlier wave brings d data. */
static int needs_grant(cl_t *c, uint32_t step, uint32_t layer, uint32_t k, uint32_t s)
{
	uint32_t n = c->N, d = (s + k) % n;
	if (k < 2 || !flow(c, step, layer, s, d))
		return 0;
	for (uint32_t j = 1; j < k; j++)
		if (flow(c, step, layer, (d + n - j) % n, d))
			return 1;
	return 0;
}

/* With every GRANT held back, no sender posts a wave that needs one: each stops at its first
 * gated wave, having posted the waves before it; released, every rank verifies. */
static void grants_case(const char *path, uint32_t N, uint64_t salt)
{
	opts_t o = { .nodes = N, .gpus = 2, .rails = 2, .path = path, .tokens = 24 };
	cl_t *c = cl_new(&o, salt);
	hold(c, m_ctrl(RW_WIRE_GRANT, ANY, ANY));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	dispatch_submit_all(c, 0, 0);
	uint32_t gated = 0;
	for (uint32_t s = 0; s < N; s++) {
		int blocked = 0;
		for (uint32_t k = 1; k < N; k++) {
			uint32_t d = (s + k) % N;
			blocked |= needs_grant(c, 0, 0, k, s);
			uint32_t posted = c->w->cnt.writes[0][s][d];
			if (blocked)
				CHECK(posted == 0, "%s N=%u: node %u wrote wave %u (to %u) without its grant", path, N, s, k, d);
			else
				CHECK(posted > 0 || !flow(c, 0, 0, s, d), "%s N=%u: node %u did not post ungated wave %u",
				      path, N, s, k);
		}
		gated += blocked;
		/* the grants themselves were sent (and are held) */
	}
	CHECK(gated > 0, "%s N=%u: the workload gates no wave", path, N);
	uint32_t grants = 0;
	for (uint32_t a = 0; a < N; a++)
		for (uint32_t b = 0; b < N; b++)
			grants += c->w->cnt.ctrl_posted[RW_WIRE_GRANT][a][b];
	CHECK(grants > 0, "%s N=%u: no grant was sent", path, N);
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	release_all(c);
	dispatch_collect(c, 0, 0);
	/* Combine is gated the same way (flows reversed). */
	hold(c, m_ctrl(RW_WIRE_GRANT, ANY, ANY));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = 0; r < c->W; r++)
		combine_submit(c, r, 0, 0);
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	uint32_t cgrants = 0;
	for (uint32_t a = 0; a < N; a++)
		for (uint32_t b = 0; b < N; b++)
			cgrants += c->w->cnt.ctrl_posted[RW_WIRE_GRANT][a][b];
	CHECK(cgrants > 0, "%s N=%u: no combine grant", path, N);
	release_all(c);
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		combine_check(c, r, 0, 0, &q);
	}
	for (uint32_t n = 0; n < N; n++)
		CHECK(c->svc[n].metrics.wave_fanin_max == 1, "node %u: wave_fanin_max %u", n,
		      c->svc[n].metrics.wave_fanin_max);
	run_pair(c, 1, 0);
	cl_free(c);
}

static void test_grants_held(void **state)
{
	(void)state;
	grants_case("perm-only", 3, 100);
	grants_case("perm-only", 4, 101);
	grants_case("joint", 4, 102);
}

/* A grant that arrives before the sender got to that wave is kept: node 0's write completions
 * are held, so its wave-1 writes stay outstanding while its wave-2 destination grants; then the
 * completions go and node 0 posts wave 2 on the kept grant. */
static void test_grant_before_wave(void **state)
{
	(void)state;
	opts_t o = { .nodes = 4, .gpus = 2, .rails = 2, .path = "perm-only", .tokens = 24 };
	cl_t *c = cl_new(&o, 103);
	hold(c, m_wdone(0));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	dispatch_submit_all(c, 0, 0);
	CHECK(needs_grant(c, 0, 0, 2, 0), "workload: node 0's wave 2 is not gated");
	CHECK(c->w->cnt.ctrl_delivered[RW_WIRE_GRANT][2][0] == 1, "node 2 did not grant node 0 wave 2 yet (%u)",
	      c->w->cnt.ctrl_delivered[RW_WIRE_GRANT][2][0]);
	CHECK(c->w->cnt.writes[0][0][1] > 0 && c->w->cnt.writes[0][0][2] == 0,
	      "node 0 posted wave 2 before its wave-1 writes completed");
	release_all(c);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* A sender waiting for a grant is an open phase like any other: the grantor dies and the ranks
 * of every survivor still in the dispatch fail at once (no timeout); a node whose dispatch had
 * completed (it needed none of the held grants) loses its pair while waiting for the combine
 * (its ranks' combines find no handle). The same key then passes with the node back. */
static void test_grant_wait_peer_lost(void **state)
{
	(void)state;
	opts_t o = { .nodes = 4, .path = "joint", .tokens = 24 };
	cl_t *c = cl_new(&o, 104);
	hold(c, m_ctrl(RW_WIRE_GRANT, 2, ANY));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	dispatch_submit_all(c, 0, 0);
	CHECK(needs_grant(c, 0, 0, 2, 0) && c->w->cnt.writes[0][0][2] == 0,
	      "node 0 is not waiting for node 2's grant");
	int done[MAX_RANKS] = { 0 };
	for (uint32_t r = 0; r < c->W; r++)
		if (n_cqe(&c->rk[r]) > c->rk[r].seen) {
			rw_cqe_t q = next_cqe(c, r);
			dispatch_check(c, r, 0, 0, &q);
			done[r] = 1;
		}
	CHECK(!done[0], "node 0 completed without its grant");
	node_crash(c, 2);
	release_all(c);
	for (uint32_t r = 0; r < c->W; r++)
		if (r / c->G != 2 && !done[r])
			expect_err(c, r, RW_E_PHASE, "the grantor died");
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		if (r / c->G != 2 && done[r]) {
			combine_submit(c, r, 0, 0); /* its pair failed while it computed */
			expect_err_now(c, r, RW_E_PHASE, "combine after the peer died");
		}
	expect_no_timeouts(c);
	node_start(c, 2);
	pump_until(c, mesh_up, NULL, "node 2 back");
	node_ranks_connect(c, 2);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * Count rows: early and late
 * ================================================================================================ */

/* Nodes 1 and 2's rows reach node 0 before any of node 0's ranks submit (kept as early rows);
 * then node 0's ranks come and the phase completes exactly. */
static void test_rows_early(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "joint" };
	cl_t *c = cl_new(&o, 200);
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = c->G; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(c->w->cnt.ctrl_delivered[RW_WIRE_COUNTS][1][0] == 1 &&
	      c->w->cnt.ctrl_delivered[RW_WIRE_COUNTS][2][0] == 1, "rows did not reach node 0 early");
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	for (uint32_t r = 0; r < c->G; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* Node 2's row reaches node 0 last: node 0 posts nothing until it has it (it cannot decide),
 * while node 1, which has every row, already writes. */
static void test_rows_late(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "native", .tokens = 12 };
	cl_t *c = cl_new(&o, 201);
	hold(c, m_ctrl(RW_WIRE_COUNTS, 2, 0));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	dispatch_submit_all(c, 0, 0);
	CHECK(c->w->cnt.writes[0][0][1] == 0 && c->w->cnt.writes[0][0][2] == 0,
	      "node 0 wrote before it had every row");
	CHECK(c->w->cnt.writes[0][1][0] > 0, "node 1 (every row in) did not write");
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	release_all(c);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* Writes that come before the receiver has every row (it cannot know the layout yet) are
 * counted and taken once it decides: node 0 gets node 1's data before node 2's row. */
static void test_data_before_layout(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "rail-only", .tokens = 12 };
	cl_t *c = cl_new(&o, 202);
	hold(c, m_ctrl(RW_WIRE_COUNTS, 2, 0));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	dispatch_submit_all(c, 0, 0);
	CHECK(c->w->cnt.writes[0][1][0] > 0, "node 1 wrote nothing to node 0");
	release_all(c);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * The owner's sum: one order (docs/dataflow.md "Combine")
 * ================================================================================================ */

/* An owner token with two rows from its own node (+-2^30) and one from the other (1..3) sums to
 * 1..3 only when its own node's rows come first. Node 1's rows reach node 0 before node 0's
 * ranks submit, then after node 0's local work: both give the documented order's sum, bf16 and
 * fp32, every path. Before the fixed order, node 0 added rows as they came: a row that came
 * first went first, and the token summed to 0. On four nodes the other nodes' rows go by node
 * (+-2^27 from the first two cancel before the third's small one), node 3's arriving first. */
static void test_combine_order(void **state)
{
	(void)state;
	for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names) + 2; pi += 2)
		for (int rows_first = 1; rows_first >= 0; rows_first--) {
			const int four = pi >= RW_ARRAY_SIZE(path_names);
			opts_t o = { .nodes = four ? 4 : 2, .path = path_names[four ? 3 : pi],
				     .tokens = 24 };
			cl_t *c = cl_new(&o, 210 + pi * 2 + (uint32_t)rows_first);
			for (uint32_t layer = 0; layer < 2; layer++) {
				dispatch_all(c, 0, layer);
				uint32_t mixed = combine_order_check(c, 0, layer, rows_first);
				CHECK(mixed > 0, "layer %u: no token with two terms at home and one away",
				      layer);
			}
			cl_free(c);
		}
}

int exec_paths_run(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_paths_n2),
		cmocka_unit_test(test_paths_n3),
		cmocka_unit_test(test_paths_n4),
		cmocka_unit_test(test_paths_small_writes),
		cmocka_unit_test(test_paths_no_write_limit),
		cmocka_unit_test(test_count_sliced),
		cmocka_unit_test(test_ids_read_once),
		cmocka_unit_test(test_selector_anchor),
		cmocka_unit_test(test_grants_held),
		cmocka_unit_test(test_grant_before_wave),
		cmocka_unit_test(test_grant_wait_peer_lost),
		cmocka_unit_test(test_rows_early),
		cmocka_unit_test(test_rows_late),
		cmocka_unit_test(test_data_before_layout),
		cmocka_unit_test(test_combine_order),
	};
	return cmocka_run_group_tests_name("svc_exec_paths", tests, NULL, NULL);
}
