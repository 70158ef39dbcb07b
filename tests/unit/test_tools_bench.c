/* The bench ranks' row generator and checker (tools/bench_common.c): every element of a row is
 * the workload's value, and a single wrong element anywhere is found and named. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "tools/bench.h"

static float bf16_value(uint16_t v)
{
	uint32_t u = (uint32_t)v << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static void test_rows_hold_the_workload_values(void **state)
{
	(void)state;
	static const uint32_t hs[] = { 1, 5, 9, 10, 17, 18, 100, 4096 };
	static uint16_t row[4096];
	for (size_t t = 0; t < sizeof(hs) / sizeof(hs[0]); t++)
		for (uint32_t token = 0; token < 20; token++) {
			rw_bench_tok_t tk = rw_bench_tok(7, 3, 2, token);
			float c = token % 2 ? 1.0f : 2.5f;
			rw_bench_put_row(row, &tk, c, hs[t]);
			for (uint32_t h = 0; h < hs[t]; h++)
				assert_true(bf16_value(row[h]) == c * (float)rw_bench_x(&tk, h));
			uint32_t bad = 12345;
			assert_int_equal(rw_bench_row_equals(row, &tk, c, hs[t], &bad), 1);
		}
}

static void test_one_wrong_element_is_found(void **state)
{
	(void)state;
	static uint16_t row[4096];
	const uint32_t H = 4096;
	static const uint32_t at[] = { 0, 1, 8, 9, 10, 17, 18, 2047, 4095 };
	rw_bench_tok_t tk = rw_bench_tok(1, 0, 0, 5);
	for (size_t i = 0; i < sizeof(at) / sizeof(at[0]); i++) {
		rw_bench_put_row(row, &tk, 1.0f, H);
		row[at[i]] ^= 0x0080; /* a different bf16 value */
		uint32_t bad = 0;
		assert_int_equal(rw_bench_row_equals(row, &tk, 1.0f, H, &bad), 0);
		assert_int_equal(bad, at[i]);
	}
	/* The same row checked against another token or scale fails in the first period. */
	rw_bench_put_row(row, &tk, 1.0f, H);
	rw_bench_tok_t other = rw_bench_tok(1, 0, 0, 6);
	uint32_t bad = H;
	if (other.a != tk.a || other.b != tk.b) {
		assert_int_equal(rw_bench_row_equals(row, &other, 1.0f, H, &bad), 0);
		assert_true(bad < RW_BENCH_ROW_PERIOD);
	}
	assert_int_equal(rw_bench_row_equals(row, &tk, 2.0f, H, &bad), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_rows_hold_the_workload_values),
		cmocka_unit_test(test_one_wrong_element_is_found),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
