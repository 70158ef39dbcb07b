/* `railwave plan` (the interim main job) and its example anchor table: the table in deploy/
 * parses, matches the example cluster and says what the calibration rule says for its samples;
 * the subcommand selects through an anchor with it, falls back to Joint without it or with a
 * broken one, and prints the seed. Run from the repository root (as tests/run does). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "tools/tools.h"
#include "tests/unit/test_capture.h"

#define EXAMPLE_TABLE "deploy/anchors/example-4x8x8.json"

static void test_example_table(void **state)
{
	(void)state;
	rw_anchor_table_t t;
	char err[320];
	assert_int_equal(rw_tool_load_anchors(EXAMPLE_TABLE, &t, err, sizeof(err)), RW_OK);
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, 4, 8, 8), RW_OK);
	assert_true(rw_sched_anchors_match(&t, &topo, 400.0, "verbs"));
	assert_true(t.n_anchors > 0);
	/* Each anchor's path is the one the rule of docs/selector.md §2 keeps (margin 5%) from its
	 * samples: the lowest-median alternative whose p90 * 1.05 beats Joint's p10, else Joint. */
	for (uint32_t i = 0; i < t.n_anchors; i++) {
		const rw_anchor_t *a = &t.anchors[i];
		const rw_path_samples_t *joint = &a->samples[RW_PATH_JOINT];
		rw_path_t want = RW_PATH_JOINT;
		for (unsigned p = 0; p < RW_PATH_JOINT; p++) {
			const rw_path_samples_t *s = &a->samples[p];
			if (s->n == 0 || joint->n == 0 || !(s->p90 * 1.05 < joint->p10))
				continue;
			if (want == RW_PATH_JOINT || s->median < a->samples[want].median)
				want = (rw_path_t)p;
		}
		if (a->selected != want)
			fail_msg("anchor case %u says %s, its samples say %s", a->case_id,
				 rw_sched_path_name(a->selected), rw_sched_path_name(want));
	}
	rw_sched_anchors_free(&t);

	assert_int_equal(rw_tool_load_anchors("deploy/anchors/no-such-table.json", &t, err, sizeof(err)),
			 RW_ERR_NOTFOUND);
	assert_non_null(strstr(err, "no-such-table.json"));
	assert_int_equal(t.n_anchors, 0);
}

static char *run_plan(int *rc_p, int argc, char **argv)
{
	return run_captured(rw_tool_plan, rc_p, argc, argv);
}

static void test_plan_with_table(void **state)
{
	(void)state;
	int rc;
	char *argv[] = { "plan", NULL };
	char *out = run_plan(&rc, 1, argv);
	assert_int_equal(rc, 0);
	assert_non_null(strstr(out, "seed 1,"));
	assert_non_null(strstr(out, "4 nodes x 8 GPUs x 8 rails"));
	assert_non_null(strstr(out, "decision: rail-only   (reason: anchor, anchor case 4"));
	/* Each path's loads and its ratio to the lower bound; balanced paths reach it. */
	assert_non_null(strstr(out, "-> rail-only"));
	assert_non_null(strstr(out, "busiest / lower bound = 1.000"));
	assert_non_null(strstr(out, "perm-only: native rails, N-1 permutation waves"));
	free(out);
}

static void test_plan_fallbacks(void **state)
{
	(void)state;
	int rc;
	char *none[] = { "plan", "--anchors", "none", "--seed", "7", NULL };
	char *out = run_plan(&rc, 5, none);
	assert_int_equal(rc, 0);
	assert_non_null(strstr(out, "seed 7,"));
	assert_non_null(strstr(out, "decision: joint   (reason: no-table)"));
	free(out);

	char path[] = "/tmp/rw-test-anchors-XXXXXX";
	int fd = mkstemp(path);
	assert_true(fd >= 0);
	const char *bad = "{\"schema_version\": 1, \"fingerprint\": {\"nodes\": 4}}";
	assert_int_equal(write(fd, bad, strlen(bad)), (ssize_t)strlen(bad));
	close(fd);
	char *broken[] = { "plan", "--anchors", path, "--tokens", "256", NULL };
	out = run_plan(&rc, 5, broken);
	unlink(path);
	assert_int_equal(rc, 0);
	assert_non_null(strstr(out, "rejected"));
	assert_non_null(strstr(out, "fingerprint.gpus_per_node: missing"));
	assert_non_null(strstr(out, "decision: joint   (reason: no-table)"));
	free(out);

	char *usage_err[] = { "plan", "--tokens", "0", NULL };
	out = run_plan(&rc, 3, usage_err);
	assert_int_equal(rc, 2);
	free(out);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_example_table),
		cmocka_unit_test(test_plan_with_table),
		cmocka_unit_test(test_plan_fallbacks),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
