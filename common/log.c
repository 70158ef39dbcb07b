/* Minimal thread-safe line logger: "<time> <ident> <LEVEL> message". One write(2) per line so
 * lines from several threads or processes sharing a terminal do not interleave. */
#include "common/common.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static _Atomic int log_level = RW_LOG_INFO;
static char log_ident[64] = "railwave";

void rw_log_set_level(rw_log_level_t level) { atomic_store(&log_level, (int)level); }
rw_log_level_t rw_log_get_level(void) { return (rw_log_level_t)atomic_load(&log_level); }

void rw_log_set_ident(const char *ident)
{
	snprintf(log_ident, sizeof(log_ident), "%s", ident);
}

void rw_vlog(rw_log_level_t level, const char *fmt, va_list ap)
{
	static const char *const names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
	int saved_errno = errno;
	if ((int)level > atomic_load(&log_level))
		return;
	char line[1024];
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	struct tm tm;
	localtime_r(&ts.tv_sec, &tm);
	int n = snprintf(line, sizeof(line), "%02d:%02d:%02d.%03ld %s %s ", tm.tm_hour, tm.tm_min,
			 tm.tm_sec, ts.tv_nsec / 1000000, log_ident, names[level]);
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
