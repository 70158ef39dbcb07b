/* Minimal thread-safe line logger. On a terminal or a file a line is
 *   2026-12-03T07:44:04.123Z railwaved node=node0 INFO peer=node2: up (control and 4 rails)
 * (ISO-8601 UTC with milliseconds, then the ident, the level and the message). Under journald
 * (stderr is the stream named by $JOURNAL_STREAM) the line is "<N>ident message" instead:
 * journald stamps each line itself and reads the syslog priority N from the prefix, so
 * `journalctl -p warning` works. One write(2) per line so that lines from several threads or
 * processes sharing a terminal do not interleave. */
#include "common/common.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static _Atomic int log_level = RW_LOG_INFO;
static char log_ident[64] = "railwave";
/* -1: not decided yet; 0: plain lines; 1: journald prefixes. Decided once, on the first line
 * (stderr does not change under a running daemon); a race decides the same value twice. */
static _Atomic int log_journal = -1;

void rw_log_set_level(rw_log_level_t level) { atomic_store(&log_level, (int)level); }
rw_log_level_t rw_log_get_level(void) { return (rw_log_level_t)atomic_load(&log_level); }

void rw_log_set_ident(const char *ident)
{
	snprintf(log_ident, sizeof(log_ident), "%s", ident);
}

/* systemd sets JOURNAL_STREAM=DEV:INODE for a service whose stderr is connected to journald; it
 * only counts if stderr is still that stream (a child may have redirected it). */
static int stderr_is_journal(void)
{
	const char *js = getenv("JOURNAL_STREAM");
	unsigned long long dev, ino;
	struct stat st;
	if (!js || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) != 0)
		return 0;
	return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

size_t rw_log_format_time(char *buf, size_t len, const struct timespec *ts)
{
	struct tm tm;
	gmtime_r(&ts->tv_sec, &tm);
	int n = snprintf(buf, len, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900,
			 tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
			 ts->tv_nsec / 1000000);
	return n < 0 ? 0 : (size_t)n < len ? (size_t)n : len - 1;
}

void rw_vlog(rw_log_level_t level, const char *fmt, va_list ap)
{
	static const char *const names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
	static const int syslog_prio[] = {3, 4, 6, 7}; /* err, warning, info, debug */
	int saved_errno = errno;
	if ((int)level > atomic_load(&log_level))
		return;
	int journal = atomic_load(&log_journal);
	if (journal < 0) {
		journal = stderr_is_journal();
		atomic_store(&log_journal, journal);
	}
	char line[1024];
	int n;
	if (journal) {
		n = snprintf(line, sizeof(line), "<%d>%s ", syslog_prio[level], log_ident);
	} else {
		struct timespec ts;
		char stamp[40];
		clock_gettime(CLOCK_REALTIME, &ts);
		rw_log_format_time(stamp, sizeof(stamp), &ts);
		n = snprintf(line, sizeof(line), "%s %s %s ", stamp, log_ident, names[level]);
	}
	errno = saved_errno; /* for %m */
	if (n > 0 && (size_t)n < sizeof(line))
		n += vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
	if (n < 0)
		return;
	if ((size_t)n >= sizeof(line) - 1)
		n = (int)sizeof(line) - 2;
	line[n++] = '\n';
	ssize_t w = write(STDERR_FILENO, line, (size_t)n);
	(void)w;
	errno = saved_errno;
}

void rw_log_early_error(const char *fmt, ...)
{
	char line[1024];
	int n = stderr_is_journal() ? snprintf(line, sizeof(line), "<3>") : 0;
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
	va_end(ap);
	if (m < 0)
		return;
	n += m;
	if ((size_t)n >= sizeof(line) - 1)
		n = (int)sizeof(line) - 2;
	line[n++] = '\n';
	ssize_t w = write(STDERR_FILENO, line, (size_t)n);
	(void)w;
}

void rw_log(rw_log_level_t level, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	rw_vlog(level, fmt, ap);
	va_end(ap);
}

uint64_t rw_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int rw_log_budget_take(rw_log_budget_t *b, uint32_t per_s, const char *what)
{
	uint64_t now = rw_now_ns();
	if (!b->window_ns || now - b->window_ns >= 1000000000ull) {
		if (b->dropped)
			rw_warn("%llu %s line(s) left out of the log since the last report (at most %u "
				"a second)", (unsigned long long)b->dropped, what, per_s);
		b->window_ns = now;
		b->used = 0;
		b->dropped = 0;
	}
	if (b->used < per_s) {
		b->used++;
		return 1;
	}
	b->dropped++;
	return 0;
}
