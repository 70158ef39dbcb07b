/* Whole-file reads for the small text inputs every part loads at start-up or on a signal: the
 * daemon's config, anchor tables (daemon and tools). One loop with one size cap and one set of
 * messages, so every caller refuses an oversize or unreadable file the same way. */
#include "common/common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define READ_FIRST_CAP (64u << 10) /* most inputs fit in one read */

static void set_err(char *err, size_t err_len, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t err_len, const char *fmt, ...)
{
	if (!err || !err_len)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, err_len, fmt, ap);
	va_end(ap);
}

/* "64 MiB", "4 KiB" or "1000 bytes": the cap as an operator would write it. */
static void format_size(size_t n, char *buf, size_t buf_len)
{
	if (n && n % (1u << 20) == 0)
		snprintf(buf, buf_len, "%zu MiB", n >> 20);
	else if (n && n % (1u << 10) == 0)
		snprintf(buf, buf_len, "%zu KiB", n >> 10);
	else
		snprintf(buf, buf_len, "%zu bytes", n);
}

rw_status_t rw_read_file(const char *path, size_t max_bytes, char **text_p, size_t *len_p,
			 char *err, size_t err_len)
{
	if (max_bytes > SIZE_MAX / 4)
		max_bytes = SIZE_MAX / 4; /* keeps max_bytes + 2 and the doubling below from wrapping */
	rw_status_t st = RW_OK;
	char *text = NULL;
	size_t len = 0, cap = 0; /* cap: bytes of data the buffer holds; one more is kept for NUL */
	FILE *f = fopen(path, "rb");
	if (!f) {
		set_err(err, err_len, "cannot open %s: %m", path);
		return errno == ENOENT ? RW_ERR_NOTFOUND : RW_ERR_SYS;
	}
	for (;;) {
		if (len == cap) {
			/* The buffer may hold max_bytes + 1 bytes: a file that fills it is too big. */
			if (cap > max_bytes) {
				char limit[32];
				format_size(max_bytes, limit, sizeof(limit));
				set_err(err, err_len, "%s is larger than %s", path, limit);
				st = RW_ERR_PARSE;
				goto free_text;
			}
			size_t ncap = cap ? cap * 2 : READ_FIRST_CAP;
			if (ncap > max_bytes + 1)
				ncap = max_bytes + 1;
			char *grown = realloc(text, ncap + 1);
			if (!grown) {
				set_err(err, err_len, "%s: out of memory", path);
				st = RW_ERR_NOMEM;
				goto free_text;
			}
			text = grown;
			cap = ncap;
		}
		size_t want = cap - len;
		size_t n = fread(text + len, 1, want, f);
		len += n;
		if (n < want)
			break; /* end of file or an error; ferror() tells which */
	}
	if (ferror(f)) {
		set_err(err, err_len, "reading %s failed", path);
		st = RW_ERR_SYS;
		goto free_text;
	}
	text[len] = '\0';
	if (!len_p && memchr(text, '\0', len)) {
		set_err(err, err_len, "%s contains a NUL byte", path);
		st = RW_ERR_PARSE;
		goto free_text;
	}
	fclose(f);
	*text_p = text;
	if (len_p)
		*len_p = len;
	return RW_OK;

free_text:
	free(text);
	fclose(f);
	return st;
}
