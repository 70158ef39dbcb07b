/* Run a `railwave` subcommand in-process with its stdout captured, for the tools' tests.
 * Header-only (static); include after <cmocka.h>. Returns the output (malloc'd, NUL-terminated)
 * and the subcommand's exit status in *rc_p. */
#ifndef RW_TEST_CAPTURE_H
#define RW_TEST_CAPTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tools/tools.h"

static inline char *run_captured(rw_tool_main_t cmd, int *rc_p, int argc, char **argv)
{
	char path[] = "/tmp/rw-test-out-XXXXXX";
	int fd = mkstemp(path);
	assert_true(fd >= 0);
	unlink(path);
	fflush(stdout);
	int saved = dup(1);
	assert_true(saved >= 0);
	assert_true(dup2(fd, 1) == 1);
	*rc_p = cmd(argc, argv);
	fflush(stdout);
	assert_true(dup2(saved, 1) == 1);
	close(saved);
	off_t len = lseek(fd, 0, SEEK_END);
	assert_true(len >= 0);
	char *text = malloc((size_t)len + 1);
	assert_non_null(text);
	assert_int_equal(pread(fd, text, (size_t)len, 0), len);
	text[len] = '\0';
	close(fd);
	return text;
}

#endif /* RW_TEST_CAPTURE_H */
