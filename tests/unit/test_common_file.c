/* rw_read_file (common/file.c): whole files back byte for byte (empty, one read, many reads),
 * the size cap at its exact boundary, a missing file, a directory, and embedded NUL bytes
 * (refused for C-string callers, kept for callers that take the length). Outputs stay untouched
 * on every failure, and each message names the path. */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <setjmp.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "common/common.h"

typedef struct fixture {
	char dir[64];
	char path[128];
} fixture_t;

static int setup(void **state)
{
	fixture_t *fx = calloc(1, sizeof(*fx));
	if (!fx)
		return -1;
	snprintf(fx->dir, sizeof(fx->dir), "/tmp/rw-test-file-XXXXXX");
	if (!mkdtemp(fx->dir)) {
		free(fx);
		return -1;
	}
	snprintf(fx->path, sizeof(fx->path), "%s/input", fx->dir);
	*state = fx;
	return 0;
}

static int teardown(void **state)
{
	fixture_t *fx = *state;
	unlink(fx->path);
	rmdir(fx->dir);
	free(fx);
	return 0;
}

static void write_file(const char *path, const void *data, size_t len)
{
	FILE *f = fopen(path, "wb");
	assert_non_null(f);
	assert_int_equal(fwrite(data, 1, len, f), len);
	assert_int_equal(fclose(f), 0);
}

/* Deterministic bytes without NULs (1..251), so C-string callers accept them. */
static char *pattern(size_t len)
{
	char *p = malloc(len ? len : 1);
	assert_non_null(p);
	for (size_t i = 0; i < len; i++)
		p[i] = (char)(1 + (i * 7919u) % 251u);
	return p;
}

static void test_round_trip(void **state)
{
	fixture_t *fx = *state;
	/* 0 bytes, less than one read, exactly the first buffer, and several doublings. */
	static const size_t sizes[] = {0, 1, 4095, 65536, 65537, 300000};
	for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
		size_t n = sizes[k];
		char *want = pattern(n);
		write_file(fx->path, want, n);

		char *text = NULL;
		size_t len = 12345;
		char err[256] = "";
		assert_int_equal(rw_read_file(fx->path, 1u << 20, &text, &len, err, sizeof(err)), RW_OK);
		assert_int_equal(len, n);
		assert_memory_equal(text, want, n);
		assert_int_equal(text[n], '\0');
		free(text);

		/* As a C string (no len_p): same text, NUL-terminated. */
		text = NULL;
		assert_int_equal(rw_read_file(fx->path, 1u << 20, &text, NULL, err, sizeof(err)), RW_OK);
		assert_int_equal(strlen(text), n);
		assert_memory_equal(text, want, n);
		free(text);
		free(want);
	}
}

static void test_size_cap(void **state)
{
	fixture_t *fx = *state;
	char *data = pattern(70000);
	char err[256];
	char *text = NULL;
	size_t len = 0;

	/* Exactly the cap is accepted; one byte more is refused, both below and above the size of
	 * the first read buffer. */
	static const size_t caps[] = {0, 10, 65536, 69999};
	for (size_t k = 0; k < sizeof(caps) / sizeof(caps[0]); k++) {
		size_t cap = caps[k];
		write_file(fx->path, data, cap);
		assert_int_equal(rw_read_file(fx->path, cap, &text, &len, err, sizeof(err)), RW_OK);
		assert_int_equal(len, cap);
		free(text);
		text = NULL;

		write_file(fx->path, data, cap + 1);
		err[0] = '\0';
		assert_int_equal(rw_read_file(fx->path, cap, &text, &len, err, sizeof(err)),
				 RW_ERR_PARSE);
		assert_null(text);
		assert_int_equal(len, cap); /* untouched */
		assert_non_null(strstr(err, fx->path));
		assert_non_null(strstr(err, "is larger than"));
	}
	/* The cap is spelled as an operator would write it. */
	write_file(fx->path, data, 65537);
	assert_int_equal(rw_read_file(fx->path, 64u << 10, &text, NULL, err, sizeof(err)),
			 RW_ERR_PARSE);
	assert_non_null(strstr(err, "is larger than 64 KiB"));
	assert_int_equal(rw_read_file(fx->path, 1000, &text, NULL, err, sizeof(err)), RW_ERR_PARSE);
	assert_non_null(strstr(err, "is larger than 1000 bytes"));
	assert_null(text);
	free(data);
}

static void test_missing_and_unreadable(void **state)
{
	fixture_t *fx = *state;
	char err[256] = "";
	char *text = NULL;
	size_t len = 7;

	assert_int_equal(rw_read_file(fx->path, 1024, &text, &len, err, sizeof(err)),
			 RW_ERR_NOTFOUND);
	assert_null(text);
	assert_int_equal(len, 7);
	assert_non_null(strstr(err, "cannot open"));
	assert_non_null(strstr(err, fx->path));
	assert_non_null(strstr(err, strerror(ENOENT)));

	/* A directory opens but cannot be read. */
	err[0] = '\0';
	assert_int_equal(rw_read_file(fx->dir, 1024, &text, &len, err, sizeof(err)), RW_ERR_SYS);
	assert_null(text);
	assert_non_null(strstr(err, "reading"));
	assert_non_null(strstr(err, fx->dir));

	/* err may be NULL (the caller only wants the status). */
	assert_int_equal(rw_read_file(fx->path, 1024, &text, &len, NULL, 0), RW_ERR_NOTFOUND);
}

static void test_embedded_nul(void **state)
{
	fixture_t *fx = *state;
	static const char data[] = {'{', '"', 'a', '\0', '"', '}'};
	write_file(fx->path, data, sizeof(data));
	char err[256] = "";
	char *text = NULL;
	size_t len = 0;

	/* A C-string caller would silently see a truncated text: refused. */
	assert_int_equal(rw_read_file(fx->path, 1024, &text, NULL, err, sizeof(err)), RW_ERR_PARSE);
	assert_null(text);
	assert_non_null(strstr(err, "contains a NUL byte"));
	assert_non_null(strstr(err, fx->path));

	/* A caller that takes the length gets every byte. */
	assert_int_equal(rw_read_file(fx->path, 1024, &text, &len, err, sizeof(err)), RW_OK);
	assert_int_equal(len, sizeof(data));
	assert_memory_equal(text, data, sizeof(data));
	free(text);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
		cmocka_unit_test_setup_teardown(test_size_cap, setup, teardown),
		cmocka_unit_test_setup_teardown(test_missing_and_unreadable, setup, teardown),
		cmocka_unit_test_setup_teardown(test_embedded_nul, setup, teardown),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
