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

int exec_groups_run(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_slots),
	};
	return cmocka_run_group_tests_name("svc_exec_groups", tests, NULL, NULL);
}
