/* service/mesh/rail_health.h: a rail's outages (failovers counted once per outage, time degraded,
 * the running outage included), the reconnect back-off (50 ms doubling to 2 s, never before
 * the test hold ends), measured weights (bytes over busy time, smoothed, quantized on the
 * 2^(k/4) grid) and the test switch's parser. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "sched/sched.h"
#include "service/mesh/rail_health.h"

#define MS 1000000ull

static void test_outages(void **state)
{
	(void)state;
	rw_svc_rail_health_t h = { 0 };
	assert_int_equal(rw_svc_rail_health_up(&h, 5 * MS), 0); /* not down: nothing to end */
	assert_int_equal(rw_svc_rail_health_down(&h, 100 * MS), 1);
	assert_int_equal(rw_svc_rail_health_down(&h, 150 * MS), 0); /* a failed redial: same outage */
	assert_int_equal(h.failovers, 1);
	assert_int_equal(rw_svc_rail_health_degraded(&h, 400 * MS), 300 * MS);
	assert_int_equal(rw_svc_rail_health_up(&h, 600 * MS), 500 * MS);
	assert_int_equal(rw_svc_rail_health_degraded(&h, 900 * MS), 500 * MS);
	assert_int_equal(rw_svc_rail_health_down(&h, 1000 * MS), 1);
	assert_int_equal(h.failovers, 2);
	assert_int_equal(rw_svc_rail_health_degraded(&h, 1100 * MS), 600 * MS);
}

static void test_backoff(void **state)
{
	(void)state;
	rw_svc_rail_health_t h = { 0 };
	rw_svc_rail_health_down(&h, 0);
	const uint32_t want[] = { 50, 100, 200, 400, 800, 1600, 2000, 2000 };
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
		assert_int_equal(rw_svc_rail_health_backoff(&h, 0), want[i]);
	rw_svc_rail_health_up(&h, 10 * MS); /* back: the next outage starts at 50 ms again */
	rw_svc_rail_health_down(&h, 20 * MS);
	h.hold_until_ns = 1220 * MS; /* the test switch holds it: no redial before that */
	assert_true(rw_svc_rail_health_held(&h, 20 * MS));
	assert_int_equal(rw_svc_rail_health_backoff(&h, 20 * MS), 1201);
	assert_false(rw_svc_rail_health_held(&h, 1220 * MS));
	assert_int_equal(rw_svc_rail_health_backoff(&h, 1300 * MS), 100);
}

static void test_meter(void **state)
{
	(void)state;
	rw_svc_rail_meter_t m = { 0 };
	rw_svc_rail_meter_sample(&m, 1000, 1000); /* under RAIL_METER_MIN_BYTES: no sample */
	assert_true(m.mbit == 0);
	/* 8 MB in 160 ms of busy time = 400 Mbit/s */
	rw_svc_rail_meter_sample(&m, 8000000, 160 * MS);
	assert_true(fabs(m.mbit - 400) < 1e-6);
	/* then 8 MB in 320 ms (200 Mbit/s): 0.7 * 400 + 0.3 * 200 */
	rw_svc_rail_meter_sample(&m, 16000000, 480 * MS);
	assert_true(fabs(m.mbit - 340) < 1e-6);
	rw_svc_rail_meter_sample(&m, 5, 5); /* counters restarted: rebase, keep the estimate */
	assert_true(fabs(m.mbit - 340) < 1e-6);
	assert_int_equal(m.bytes, 5);

	assert_int_equal(rw_svc_rail_weight_quantize(0), 1);
	assert_int_equal(rw_svc_rail_weight_quantize(50), 54);   /* 2^(23/4) = 53.8 */
	assert_int_equal(rw_svc_rail_weight_quantize(25), 27);   /* half of it: 2 steps down */
	assert_int_equal(rw_svc_rail_weight_quantize(52), 54);   /* within a step: no change */
	assert_int_equal(rw_svc_rail_weight_quantize(1e12), RW_MAX_RAIL_WEIGHT);
	for (double x = 1.5; x < 1e6; x *= 1.07) { /* on the grid, within half a step */
		uint32_t w = rw_svc_rail_weight_quantize(x);
		double grid = exp2(round(log2(x) * 4) / 4); /* the nearest 2^(k/4), rounded to an integer */
		assert_true(fabs((double)w - grid) <= 0.5);
		assert_true(w >= 1 && w <= RW_MAX_RAIL_WEIGHT);
	}
}

static void test_fault_switch(void **state)
{
	(void)state;
	rw_svc_rail_fault_t f;
	unsetenv("RAILWAVE_TEST_RAIL_DOWN");
	assert_int_equal(rw_svc_rail_fault_from_env(&f, 3, 2, 0), RW_OK);
	assert_false(f.on);
	setenv("RAILWAVE_TEST_RAIL_DOWN", "1:2:300:1500", 1);
	assert_int_equal(rw_svc_rail_fault_from_env(&f, 3, 2, 0), RW_OK);
	assert_true(f.on && f.rail == 1 && f.peer == 2 && f.at_ms == 300 && f.for_ms == 1500);
	assert_false(f.at_start);
	setenv("RAILWAVE_TEST_RAIL_DOWN", "0:1:start:2500", 1); /* refused from the start */
	assert_int_equal(rw_svc_rail_fault_from_env(&f, 3, 2, 0), RW_OK);
	assert_true(f.on && f.at_start && f.rail == 0 && f.peer == 1 && f.for_ms == 2500);
	const char *bad[] = { "2:1:0:1", "1:3:0:1", "1:0:0:1" /* itself */, "1:2:3", "1:2:3:4x", "x",
			      "1:2:start", "1:2:start:5x", "1:2:begin:5", "2:1:start:5" };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		setenv("RAILWAVE_TEST_RAIL_DOWN", bad[i], 1);
		assert_int_equal(rw_svc_rail_fault_from_env(&f, 3, 2, 0), RW_ERR_INVAL);
		assert_false(f.on);
	}
	unsetenv("RAILWAVE_TEST_RAIL_DOWN");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_outages),
		cmocka_unit_test(test_backoff),
		cmocka_unit_test(test_meter),
		cmocka_unit_test(test_fault_switch),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
