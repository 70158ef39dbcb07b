/* svc_exec, several groups on the same nodes: each pair in its own receive slot, a third group
 * waiting for one. Harness: exec_harness.h. */
#include "tests/service/test_exec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================================================
 * Several groups: receive slots
 * ================================================================================================ */

/* Two groups' pairs run at once, each in its own receive slot (SLOTS = 2); a third group's
 * gathered pair waits for a slot (it sends no count row) until a pair ends, then runs. Every
 * group's data is distinct and checked exactly, so a record taken by the wrong pair shows. */
static void test_slots(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "rail-only" };
	cl_t *c = cl_new(&o, 800);
	for (uint32_t g = 1; g < 3; g++) {
		use_group(c, g);
		for (uint32_t r = 0; r < c->W; r++)
			rank_connect(c, r);
	}
	settle(c);
	use_group(c, 0);
	dispatch_all(c, 0, 0);
	use_group(c, 1);
	dispatch_all(c, 0, 0);
	uint32_t rows_before = c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1];
	use_group(c, 2);
	dispatch_submit_all(c, 0, 0);
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	CHECK(c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] == rows_before,
	      "a third pair sent its count row without a free slot");
	use_group(c, 0);
	combine_all(c, 0, 0);
	use_group(c, 2);
	dispatch_collect(c, 0, 0);
	/* groups 1 and 2 combine interleaved */
	for (uint32_t r = 0; r < c->W; r++) {
		use_group(c, 1);
		combine_submit(c, r, 0, 0);
		use_group(c, 2);
		combine_submit(c, r, 0, 0);
		pump_once(c);
	}
	for (uint32_t g = 1; g < 3; g++) {
		use_group(c, g);
		for (uint32_t r = 0; r < c->W; r++) {
			rw_cqe_t q = next_cqe(c, r);
			combine_check(c, r, 0, 0, &q);
		}
	}
	use_group(c, 0);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* The epoch node 0 draws next (0: a random one); the executor's draw consumes it. */
static uint32_t next_epoch(void *ctx)
{
	uint32_t *next = ctx, e = *next;
	*next = 0;
	return e;
}

/* An epoch that gives writes of `key` into node 0 the immediate tag (its low 14 bits) of
 * writes of key `other` under epoch `e0`. */
static uint32_t epoch_meeting(const rw_wire_key_t *key, const rw_wire_key_t *other, uint32_t e0)
{
	const uint32_t want = rw_wire_imm_pack(rw_wire_tag_for(rw_wire_key_tag(other), e0), 0, 0, 0, 0);
	for (uint32_t e = 1;; e++)
		if (rw_wire_imm_pack(rw_wire_tag_for(rw_wire_key_tag(key), e), 0, 0, 0, 0) == want)
			return e;
}

/* Node 0's next pair, group g's at (step 0, layer 0), is offered the epoch whose tag meets that of
 * group 1 - g's pair there under epoch e0; group g is the current one. */
static void offer_meeting(cl_t *c, uint32_t *next, uint32_t g, uint32_t e0)
{
	const rw_wire_key_t k = { .group = rw_wire_group_hash(c->groups[g]) },
			    other = { .group = rw_wire_group_hash(c->groups[1 - g]) };
	*next = epoch_meeting(&k, &other, e0);
	use_group(c, g);
}

/* Node 0 drew the epoch offered for group g's pair. */
static void drew(uint32_t next, uint32_t g)
{
	CHECK(!next, "node 0 drew no epoch for group %u's pair", g);
}

/* Two nodes, groups 0 and 1 joined, the counters zeroed; node 0 draws its epochs from *next. */
static cl_t *two_groups(uint64_t salt, uint32_t *next)
{
	opts_t o = { .nodes = 2, .path = "rail-only" };
	cl_t *c = cl_new(&o, salt);
	use_group(c, 1);
	for (uint32_t r = 0; r < c->W; r++)
		rank_connect(c, r);
	settle(c);
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	c->epoch_fn[0] = next_epoch;
	c->epoch_ctx[0] = next;
	return c;
}

static void no_peer_dropped(cl_t *c)
{
	CHECK(c->w->cnt.fail_peer[0][1] == 0 && c->w->cnt.fail_peer[1][0] == 0,
	      "a node dropped its peer");
}

/* Random epochs again; group 0's next pair passes; everything stops. */
static void two_groups_end(cl_t *c)
{
	c->epoch_fn[0] = NULL;
	use_group(c, 0);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* Two groups' pairs open at once on node 0 whose writes would carry the same immediate tag: node 0
 * draws group 1's epoch so that its tag meets group 0's (a 1 in 16384 chance per pair open beside
 * another). Every write must still reach its own pair: the integration test once saw an unrelated
 * job's phase fail with "node 1 (n1) wrote 4368 bytes of combine data at 10485760 on rail 0, where
 * its range is at 2097152" (the other group's write, in the other slot, taken by the tag for this
 * group's pair) and its peer dropped. Node 0 refuses an epoch whose tag an open pair has and draws
 * another; both groups' phases are checked exactly and no peer is dropped. */
static void test_slots_tags_meet(void **state)
{
	(void)state;
	uint32_t next = 0x5eed0001u;
	cl_t *c = two_groups(801, &next);
	use_group(c, 0);
	dispatch_all(c, 0, 0);
	drew(next, 0);
	offer_meeting(c, &next, 1, 0x5eed0001u);
	dispatch_all(c, 0, 0);
	drew(next, 1);
	/* group 0's combine lands while group 1's pair is open, and then group 1's */
	use_group(c, 0);
	combine_all(c, 0, 0);
	use_group(c, 1);
	combine_all(c, 0, 0);
	no_peer_dropped(c);
	two_groups_end(c);
}

/* A pair fails on node 0 (a rank of group 1 left) while node 1, not told yet, still writes its
 * dispatch; a pair of group 0 opens on node 0 before those writes come, and node 0 offers it the
 * failed pair's tag. The late writes must be dropped as an ended attempt's, not taken for group
 * 0's pair (which blamed node 1 for writing outside its range and failed that phase): a tag stays
 * out of use for a phase timeout after its pair ended before its combine completed. */
static void test_slots_late_tag(void **state)
{
	(void)state;
	uint32_t next = 0x5eed0002u;
	cl_t *c = two_groups(802, &next);
	hold(c, m_write(1, 0, 0));
	hold(c, m_ctrl(RW_WIRE_PHASE_ERR, 0, 1));
	dispatch_submit_all(c, 0, 0);
	drew(next, 1);
	CHECK(c->w->cnt.writes[0][1][0] > 0, "node 1 posted no dispatch write to node 0");
	fk_client_die(c->rk[0].c);
	expect_err(c, 1, RW_E_PHASE, "group 1's pair on node 0 after its rank 0 left");
	settle(c); /* the ended pair is freed */
	const uint64_t stale = c->svc[0].metrics.errors[-RW_ERR_STATE];
	offer_meeting(c, &next, 0, 0x5eed0002u);
	dispatch_submit_all(c, 0, 0);
	drew(next, 0);
	release_all(c); /* node 1's writes of group 1, then the PHASE_ERR */
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	CHECK(c->svc[0].metrics.errors[-RW_ERR_STATE] > stale,
	      "node 0 counted no write of group 1's ended pair");
	no_peer_dropped(c);
	use_group(c, 1);
	for (uint32_t r = c->G; r < c->W; r++)
		expect_phase_err(c, r, 0, 0, "group 1 on node 1 after node 0's PHASE_ERR");
	two_groups_end(c);
}

int exec_groups_run(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_slots),
		cmocka_unit_test(test_slots_tags_meet),
		cmocka_unit_test(test_slots_late_tag),
	};
	return cmocka_run_group_tests_name("svc_exec_groups", tests, NULL, NULL);
}
