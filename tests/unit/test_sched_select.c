/* Selector and calibration rule (docs/selector.md §1, §2): eligibility bounds just inside and just
 * outside, nearest anchor, tie by case id, the Native / Joint fallbacks, and anchor_decide. */
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <string.h>
#include <cmocka.h>

#include "sched/sched.h"

/* max_size_ratio 2 -> size tolerance log2(2) = 1 exactly; shape tolerance 0.125 is exact in
 * binary, so "on the bound" and "one ulp-ish past it" are well defined. */
static rw_anchor_t anchors[4];
static rw_anchor_table_t table;

static void setup_table(uint32_t n)
{
	memset(&table, 0, sizeof(table));
	memset(anchors, 0, sizeof(anchors));
	table.schema_version = RW_ANCHOR_SCHEMA;
	table.max_size_ratio = 2.0;
	table.shape_tolerance = 0.125;
	table.n_anchors = n;
	table.anchors = anchors;
}

static void set_anchor(uint32_t i, uint32_t case_id, double f0, double f1, double f2, rw_path_t p)
{
	anchors[i].case_id = case_id;
	anchors[i].feat[0] = f0;
	anchors[i].feat[1] = f1;
	anchors[i].feat[2] = f2;
	anchors[i].selected = p;
}

static rw_features_t feat_of(double f0, double f1, double f2)
{
	rw_features_t f;
	memset(&f, 0, sizeof(f));
	f.remote_bytes = 1 << 20;
	f.f[0] = f0;
	f.f[1] = f1;
	f.f[2] = f2;
	return f;
}

static rw_selection_t select_at(double f0, double f1, double f2)
{
	rw_features_t f = feat_of(f0, f1, f2);
	rw_selection_t sel;
	rw_sched_select(&table, &f, &sel);
	return sel;
}

static void test_path_names(void **state)
{
	(void)state;
	for (unsigned p = 0; p < RW_PATH_COUNT; p++) {
		rw_path_t back = RW_PATH_COUNT;
		assert_int_equal(rw_sched_path_parse(rw_sched_path_name((rw_path_t)p), &back), RW_OK);
		assert_int_equal(back, p);
	}
	assert_string_equal(rw_sched_path_name(RW_PATH_NATIVE), "native");
	assert_string_equal(rw_sched_path_name(RW_PATH_RAIL_ONLY), "rail-only");
	assert_string_equal(rw_sched_path_name(RW_PATH_PERM_ONLY), "perm-only");
	assert_string_equal(rw_sched_path_name(RW_PATH_JOINT), "joint");
	assert_string_equal(rw_sched_path_name(RW_PATH_COUNT), "unknown");
	rw_path_t p = RW_PATH_NATIVE;
	assert_int_equal(rw_sched_path_parse("Joint", &p), RW_ERR_INVAL);
	assert_int_equal(rw_sched_path_parse("", &p), RW_ERR_INVAL);
	assert_int_equal(rw_sched_path_parse(NULL, &p), RW_ERR_INVAL);
	assert_int_equal(p, RW_PATH_NATIVE); /* untouched on error */
	/* Reason names are distinct. */
	for (int a = 0; a <= RW_SELECT_FORCED; a++)
		for (int b = a + 1; b <= RW_SELECT_FORCED; b++)
			assert_string_not_equal(rw_sched_reason_name((rw_select_reason_t)a),
						rw_sched_reason_name((rw_select_reason_t)b));
}

static void test_size_bound(void **state)
{
	(void)state;
	setup_table(1);
	set_anchor(0, 7, 20.0, 0.5, 0.25, RW_PATH_RAIL_ONLY);
	const double eps = 1e-9;
	rw_selection_t sel;

	sel = select_at(21.0, 0.5, 0.25); /* exactly on the bound: eligible */
	assert_int_equal(sel.path, RW_PATH_RAIL_ONLY);
	assert_int_equal(sel.reason, RW_SELECT_ANCHOR);
	assert_int_equal(sel.case_id, 7);
	assert_true(fabs(sel.distance2 - 1.0) < 1e-12);
	sel = select_at(21.0 - eps, 0.5, 0.25);
	assert_int_equal(sel.reason, RW_SELECT_ANCHOR);
	sel = select_at(21.0 + eps, 0.5, 0.25);
	assert_int_equal(sel.path, RW_PATH_JOINT);
	assert_int_equal(sel.reason, RW_SELECT_NO_ANCHOR);
	assert_int_equal(sel.case_id, -1);
	sel = select_at(19.0, 0.5, 0.25);
	assert_int_equal(sel.reason, RW_SELECT_ANCHOR);
	sel = select_at(19.0 + eps, 0.5, 0.25);
	assert_int_equal(sel.reason, RW_SELECT_ANCHOR);
	sel = select_at(19.0 - eps, 0.5, 0.25);
	assert_int_equal(sel.reason, RW_SELECT_NO_ANCHOR);

	/* A wider ratio widens the window: ratio 8 -> 3 in log2 units. */
	table.max_size_ratio = 8.0;
	sel = select_at(23.0 - eps, 0.5, 0.25);
	assert_int_equal(sel.reason, RW_SELECT_ANCHOR);
	sel = select_at(23.0 + 1e-6, 0.5, 0.25);
	assert_int_equal(sel.reason, RW_SELECT_NO_ANCHOR);
}

static void test_shape_bounds(void **state)
{
	(void)state;
	setup_table(1);
	set_anchor(0, 3, 20.0, 0.5, 0.25, RW_PATH_PERM_ONLY);
	const double eps = 1e-9;

	/* f1 */
	assert_int_equal(select_at(20.0, 0.625, 0.25).reason, RW_SELECT_ANCHOR);
	assert_int_equal(select_at(20.0, 0.625 - eps, 0.25).reason, RW_SELECT_ANCHOR);
	assert_int_equal(select_at(20.0, 0.625 + eps, 0.25).reason, RW_SELECT_NO_ANCHOR);
	assert_int_equal(select_at(20.0, 0.375, 0.25).reason, RW_SELECT_ANCHOR);
	assert_int_equal(select_at(20.0, 0.375 - eps, 0.25).reason, RW_SELECT_NO_ANCHOR);
	/* f2 */
	assert_int_equal(select_at(20.0, 0.5, 0.375).reason, RW_SELECT_ANCHOR);
	assert_int_equal(select_at(20.0, 0.5, 0.375 + eps).reason, RW_SELECT_NO_ANCHOR);
	assert_int_equal(select_at(20.0, 0.5, 0.125).reason, RW_SELECT_ANCHOR);
	assert_int_equal(select_at(20.0, 0.5, 0.125 - eps).reason, RW_SELECT_NO_ANCHOR);
	/* The shape bound is a max, not a sum: both at the bound is still eligible. */
	rw_selection_t sel = select_at(20.0, 0.625, 0.375);
	assert_int_equal(sel.reason, RW_SELECT_ANCHOR);
	assert_int_equal(sel.path, RW_PATH_PERM_ONLY);
	assert_true(fabs(sel.distance2 - 2 * 0.125 * 0.125) < 1e-15);
	/* Zero tolerance: only an exact shape match is eligible. */
	table.shape_tolerance = 0.0;
	assert_int_equal(select_at(20.5, 0.5, 0.25).reason, RW_SELECT_ANCHOR);
	assert_int_equal(select_at(20.0, 0.5 + eps, 0.25).reason, RW_SELECT_NO_ANCHOR);
}

static void test_nearest_anchor(void **state)
{
	(void)state;
	setup_table(3);
	set_anchor(0, 10, 20.0, 0.5, 0.25, RW_PATH_RAIL_ONLY);
	set_anchor(1, 11, 20.5, 0.55, 0.25, RW_PATH_PERM_ONLY);
	set_anchor(2, 12, 30.0, 0.5, 0.25, RW_PATH_NATIVE); /* not eligible: too far in size */
	rw_selection_t sel = select_at(20.4, 0.54, 0.25);
	assert_int_equal(sel.case_id, 11);
	assert_int_equal(sel.path, RW_PATH_PERM_ONLY);
	sel = select_at(20.1, 0.51, 0.25);
	assert_int_equal(sel.case_id, 10);
	assert_int_equal(sel.path, RW_PATH_RAIL_ONLY);
	/* The anchor that differs in shape but is nearer overall wins. */
	sel = select_at(20.45, 0.5, 0.25);
	assert_int_equal(sel.case_id, 11);
	sel = select_at(30.0, 0.5, 0.25);
	assert_int_equal(sel.case_id, 12);
	assert_int_equal(sel.path, RW_PATH_NATIVE);
}

static void test_tie_by_case_id(void **state)
{
	(void)state;
	setup_table(3);
	/* Identical features, so equal distances; larger ids come first in the array. */
	set_anchor(0, 9, 20.0, 0.5, 0.25, RW_PATH_NATIVE);
	set_anchor(1, 4, 20.0, 0.5, 0.25, RW_PATH_PERM_ONLY);
	set_anchor(2, 6, 20.0, 0.5, 0.25, RW_PATH_RAIL_ONLY);
	rw_selection_t sel = select_at(20.25, 0.5, 0.25);
	assert_int_equal(sel.case_id, 4);
	assert_int_equal(sel.path, RW_PATH_PERM_ONLY);

	/* Mirror images around the query. */
	set_anchor(0, 9, 20.5, 0.5, 0.25, RW_PATH_NATIVE);
	set_anchor(1, 8, 20.0, 0.5, 0.25, RW_PATH_PERM_ONLY);
	set_anchor(2, 30, 25.0, 0.5, 0.25, RW_PATH_RAIL_ONLY);
	sel = select_at(20.25, 0.5, 0.25);
	assert_int_equal(sel.case_id, 8);
}

static void test_joint_fallback(void **state)
{
	(void)state;
	setup_table(2);
	set_anchor(0, 1, 20.0, 0.0, 0.0, RW_PATH_NATIVE);
	set_anchor(1, 2, 24.0, 1.0, 1.0, RW_PATH_RAIL_ONLY);
	rw_selection_t sel = select_at(22.0, 0.5, 0.5);
	assert_int_equal(sel.path, RW_PATH_JOINT);
	assert_int_equal(sel.reason, RW_SELECT_NO_ANCHOR);
	assert_int_equal(sel.case_id, -1);

	/* An empty table: no anchor can be eligible. */
	setup_table(0);
	sel = select_at(22.0, 0.5, 0.5);
	assert_int_equal(sel.path, RW_PATH_JOINT);
	assert_int_equal(sel.reason, RW_SELECT_NO_ANCHOR);

	/* NaN features (corrupt counts) never match an anchor. */
	setup_table(1);
	set_anchor(0, 1, 20.0, 0.5, 0.5, RW_PATH_NATIVE);
	sel = select_at(NAN, 0.5, 0.5);
	assert_int_equal(sel.reason, RW_SELECT_NO_ANCHOR);
	sel = select_at(20.0, NAN, 0.5);
	assert_int_equal(sel.reason, RW_SELECT_NO_ANCHOR);
	assert_int_equal(sel.path, RW_PATH_JOINT);
}

static void test_no_table_and_no_remote(void **state)
{
	(void)state;
	rw_features_t f = feat_of(20.0, 0.5, 0.5);
	rw_selection_t sel;
	rw_sched_select(NULL, &f, &sel);
	assert_int_equal(sel.path, RW_PATH_JOINT);
	assert_int_equal(sel.reason, RW_SELECT_NO_TABLE);
	assert_int_equal(sel.case_id, -1);

	/* No remote payload: Native, with or without a table, even when an anchor would match. */
	f.remote_bytes = 0;
	rw_sched_select(NULL, &f, &sel);
	assert_int_equal(sel.path, RW_PATH_NATIVE);
	assert_int_equal(sel.reason, RW_SELECT_NO_REMOTE);
	setup_table(1);
	set_anchor(0, 1, 20.0, 0.5, 0.5, RW_PATH_RAIL_ONLY);
	rw_sched_select(&table, &f, &sel);
	assert_int_equal(sel.path, RW_PATH_NATIVE);
	assert_int_equal(sel.reason, RW_SELECT_NO_REMOTE);
	assert_int_equal(sel.case_id, -1);
}

/* ---- calibration rule ---- */

static const rw_calib_rule_t rule = { .cv_bound = 0.10, .margin = 0.05 };

/* Fill v with n samples around `center` spread +-spread (deterministic, shuffled order). */
static void fill(double *v, uint32_t n, double center, double spread)
{
	for (uint32_t i = 0; i < n; i++) {
		uint32_t k = (i * 11 + 3) % n; /* a permutation of 0..n-1 (gcd(11, n) = 1 here) */
		v[k] = center + spread * (2.0 * i / (n - 1) - 1.0);
	}
}

static void test_decide_stats(void **state)
{
	(void)state;
	double v[11] = { 6, 11, 1, 3, 9, 2, 10, 4, 8, 5, 7 };
	double *s[RW_PATH_COUNT] = { NULL, NULL, NULL, v };
	uint32_t n[RW_PATH_COUNT] = { 0, 0, 0, 11 };
	rw_anchor_t a;
	memset(&a, 0xff, sizeof(a));
	rw_sched_anchor_decide(&rule, s, n, &a);
	assert_int_equal(a.samples[RW_PATH_JOINT].n, 11);
	assert_true(a.samples[RW_PATH_JOINT].median == 6.0);
	assert_true(a.samples[RW_PATH_JOINT].p10 == 2.0);
	assert_true(a.samples[RW_PATH_JOINT].p90 == 10.0);
	for (unsigned p = 0; p < RW_PATH_JOINT; p++) {
		assert_int_equal(a.samples[p].n, 0);
		assert_true(a.samples[p].median == 0.0);
	}
	assert_int_equal(a.selected, RW_PATH_JOINT);

	/* Interpolated quantiles on an even count: 1..4 -> median 2.5, p10 1.3, p90 3.7. */
	double w[4] = { 4, 1, 3, 2 };
	s[RW_PATH_JOINT] = w;
	n[RW_PATH_JOINT] = 4;
	rw_sched_anchor_decide(&rule, s, n, &a);
	assert_true(fabs(a.samples[RW_PATH_JOINT].median - 2.5) < 1e-12);
	assert_true(fabs(a.samples[RW_PATH_JOINT].p10 - 1.3) < 1e-12);
	assert_true(fabs(a.samples[RW_PATH_JOINT].p90 - 3.7) < 1e-12);
}

static void test_decide_stable_better(void **state)
{
	(void)state;
	double joint[20], native[20], rail[20], perm[20];
	fill(joint, 20, 10.0, 0.3);
	fill(native, 20, 6.0, 0.2);
	fill(rail, 20, 7.0, 0.2);
	fill(perm, 20, 9.0, 0.2);
	double *s[RW_PATH_COUNT] = { native, rail, perm, joint };
	uint32_t n[RW_PATH_COUNT] = { 20, 20, 20, 20 };
	rw_anchor_t a;
	memset(&a, 0, sizeof(a));
	rw_sched_anchor_decide(&rule, s, n, &a);
	/* All three beat Joint conservatively; the lowest median (native) wins. */
	assert_int_equal(a.selected, RW_PATH_NATIVE);
	for (unsigned p = 0; p < RW_PATH_COUNT; p++) {
		assert_int_equal(a.samples[p].n, 20);
		assert_true(a.samples[p].p10 <= a.samples[p].median);
		assert_true(a.samples[p].median <= a.samples[p].p90);
	}

	/* Without native measurements the next best (rail-only) wins. */
	n[RW_PATH_NATIVE] = 0;
	rw_sched_anchor_decide(&rule, s, n, &a);
	assert_int_equal(a.selected, RW_PATH_RAIL_ONLY);
	assert_int_equal(a.samples[RW_PATH_NATIVE].n, 0);
}

static void test_decide_unstable(void **state)
{
	(void)state;
	double joint[20], alt[20];
	fill(joint, 20, 10.0, 0.3);
	fill(alt, 20, 5.0, 0.3);
	alt[4] = 12.0; /* one wild repetition: CV of alt well above 10% */
	double *s[RW_PATH_COUNT] = { NULL, alt, NULL, joint };
	uint32_t n[RW_PATH_COUNT] = { 0, 20, 0, 20 };
	rw_anchor_t a;
	memset(&a, 0, sizeof(a));
	rw_sched_anchor_decide(&rule, s, n, &a);
	assert_int_equal(a.selected, RW_PATH_JOINT);

	/* Stable alt but unstable Joint: still Joint. */
	fill(alt, 20, 5.0, 0.3);
	joint[0] = 40.0;
	rw_sched_anchor_decide(&rule, s, n, &a);
	assert_int_equal(a.selected, RW_PATH_JOINT);

	/* A single sample cannot show stability. */
	fill(joint, 20, 10.0, 0.3);
	double one = 1.0;
	s[RW_PATH_RAIL_ONLY] = &one;
	n[RW_PATH_RAIL_ONLY] = 1;
	rw_sched_anchor_decide(&rule, s, n, &a);
	assert_int_equal(a.selected, RW_PATH_JOINT);
	assert_int_equal(a.samples[RW_PATH_RAIL_ONLY].n, 1);
	assert_true(a.samples[RW_PATH_RAIL_ONLY].median == 1.0);
}

static void test_decide_overlap(void **state)
{
	(void)state;
	double joint[21], alt[21];
	/* Joint 10 +- 0.5 -> p10 = 9.6; alt 9 +- 0.2 -> p90 = 9.16; 9.16 * 1.05 = 9.618 > 9.6. */
	fill(joint, 21, 10.0, 0.5);
	fill(alt, 21, 9.0, 0.2);
	double *s[RW_PATH_COUNT] = { NULL, NULL, alt, joint };
	uint32_t n[RW_PATH_COUNT] = { 0, 0, 21, 21 };
	rw_anchor_t a;
	memset(&a, 0, sizeof(a));
	rw_sched_anchor_decide(&rule, s, n, &a);
	assert_true(fabs(a.samples[RW_PATH_JOINT].p10 - 9.6) < 1e-9);
	assert_true(fabs(a.samples[RW_PATH_PERM_ONLY].p90 - 9.16) < 1e-9);
	assert_int_equal(a.selected, RW_PATH_JOINT);
	/* With no margin the same numbers qualify: the margin is what kept Joint. */
	rw_calib_rule_t no_margin = { .cv_bound = 0.10, .margin = 0.0 };
	rw_sched_anchor_decide(&no_margin, s, n, &a);
	assert_int_equal(a.selected, RW_PATH_PERM_ONLY);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_path_names),
		cmocka_unit_test(test_size_bound),
		cmocka_unit_test(test_shape_bounds),
		cmocka_unit_test(test_nearest_anchor),
		cmocka_unit_test(test_tie_by_case_id),
		cmocka_unit_test(test_joint_fallback),
		cmocka_unit_test(test_no_table_and_no_remote),
		cmocka_unit_test(test_decide_stats),
		cmocka_unit_test(test_decide_stable_better),
		cmocka_unit_test(test_decide_unstable),
		cmocka_unit_test(test_decide_overlap),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
