/* tests/cuda/mini_cmocka.h: the few cmocka calls test_cuda.c uses, for machines without
 * libcmocka (the GPU machine: tests/cuda/gpu_run.sh builds with -DRW_MINI_CMOCKA). Prints the
 * same summary lines as cmocka so tests/run and people read it the same way. */
#ifndef RW_MINI_CMOCKA_H
#define RW_MINI_CMOCKA_H

#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

struct CMUnitTest {
	const char *name;
	void (*fn)(void **state);
};

static jmp_buf mini_jmp;
static int mini_outcome; /* 0 ok, 1 failed, 2 skipped */

#define cmocka_unit_test(f) { #f, f }
#define print_message(...) printf(__VA_ARGS__)
#define mini_fail(...) \
	do { printf("[  ERROR   ] %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); \
	     mini_outcome = 1; longjmp(mini_jmp, 1); } while (0)
#define skip() do { mini_outcome = 2; longjmp(mini_jmp, 1); } while (0)
#define fail_msg(...) mini_fail(__VA_ARGS__)
#define assert_true(c) do { if (!(c)) mini_fail("%s is false", #c); } while (0)
#define assert_false(c) do { if (c) mini_fail("%s is true", #c); } while (0)
#define assert_non_null(p) assert_true((p) != NULL)
#define assert_ptr_equal(a, b) assert_true((const void *)(a) == (const void *)(b))
#define assert_int_equal(a, b) \
	do { long long a_ = (long long)(a), b_ = (long long)(b); \
	     if (a_ != b_) mini_fail("%lld != %lld (%s, %s)", a_, b_, #a, #b); } while (0)
#define assert_int_not_equal(a, b) \
	do { long long a_ = (long long)(a), b_ = (long long)(b); \
	     if (a_ == b_) mini_fail("%lld == %lld (%s, %s)", a_, b_, #a, #b); } while (0)
#define assert_memory_equal(a, b, n) assert_true(memcmp((a), (b), (n)) == 0)

static int mini_run_one(const struct CMUnitTest *t)
{
	mini_outcome = 0;
	if (setjmp(mini_jmp) == 0)
		t->fn(NULL);
	return mini_outcome;
}

static int mini_run(const struct CMUnitTest *t, size_t n)
{
	int passed = 0, failed = 0, skipped = 0;

	printf("[==========] Running %zu test(s).\n", n);
	for (size_t i = 0; i < n; i++) {
		printf("[ RUN      ] %s\n", t[i].name);
		fflush(stdout);
		mini_run_one(&t[i]);
		if (mini_outcome == 0) { passed++; printf("[       OK ] %s\n", t[i].name); }
		else if (mini_outcome == 1) { failed++; printf("[  FAILED  ] %s\n", t[i].name); }
		else { skipped++; printf("[  SKIPPED ] %s\n", t[i].name); }
		fflush(stdout);
	}
	printf("[==========] %zu test(s) run.\n", n);
	printf("[  PASSED  ] %d test(s).\n", passed);
	if (skipped)
		printf("[  SKIPPED ] %d test(s).\n", skipped);
	if (failed)
		printf("[  FAILED  ] %d test(s).\n", failed);
	return failed;
}
#define cmocka_run_group_tests(t, setup, teardown) mini_run((t), sizeof(t) / sizeof((t)[0]))

#endif /* RW_MINI_CMOCKA_H */
