/* RailWave common definitions: the one status type every module returns, logging, whole-file
 * reads and little-endian field access.
 * Errors are grouped by blast radius: a peer error drops one peer,
 * a client error drops one client, a fatal error stops the daemon. */
#ifndef RW_COMMON_H
#define RW_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

typedef enum rw_status {
	RW_OK = 0,

	/* Caller/programming errors: bad arguments, state misuse (-1 .. -19). */
	RW_ERR_INVAL = -1,         /* an argument or input field is out of range */
	RW_ERR_NOMEM = -2,         /* allocation failed */
	RW_ERR_UNSUPPORTED = -3,   /* operation not supported by this transport/device */
	RW_ERR_AGAIN = -4,         /* resource busy (queue full); retry after progress */
	RW_ERR_RANGE = -5,         /* offset/length outside a registered region */
	RW_ERR_NOTFOUND = -6,      /* unknown id, key or name */
	RW_ERR_EXISTS = -7,        /* duplicate id (rank, region, ...) */
	RW_ERR_STATE = -8,         /* operation not valid in the object's current state */
	RW_ERR_TIMEOUT = -9,       /* a bounded wait expired */
	RW_ERR_PARSE = -10,        /* malformed text or JSON input */

	/* Peer/link errors: drop one peer connection (-20 .. -39). */
	RW_ERR_PEER = -20,         /* peer closed, reset, or sent garbage */
	RW_ERR_PROTO = -21,        /* wire protocol violation (magic, version, bounds) */
	RW_ERR_LINK = -22,         /* local rail/link failure (QP error, interface down) */

	/* Client errors: drop one local client (-40 .. -59). */
	RW_ERR_CLIENT = -40,       /* a local trainer rank misbehaved or went away */
	/* A rank's submission was refused (the rank stays; its phase may fail, docs/ipc.md). */
	RW_ERR_SUB_KIND = -41,     /* unknown submission kind */
	RW_ERR_SUB_DTYPE = -42,    /* unknown or unsupported dtype */
	RW_ERR_SUB_TOKENS = -43,   /* token count, top-k, hidden or an expert id out of range */
	RW_ERR_SUB_EXPERTS = -44,  /* n_experts not a multiple of the world, or not the phase's */
	RW_ERR_SUB_FIELD = -45,    /* local ranks disagree on top-k, hidden or dtype */
	RW_ERR_SUB_BUFFER = -46,   /* a span names an unknown buffer, or a needed one is absent */
	RW_ERR_SUB_HANDLE = -47,   /* combine: not the handle of the group's open dispatch */
	RW_ERR_SUB_STATE = -48,    /* not valid now (duplicate, another key is running, draining) */
	RW_ERR_SUB_SPACE = -49,    /* an output span is too small for what the phase delivers */
	RW_ERR_DEVICE = -50,       /* a copy to or from a rank's GPU memory failed */

	/* Fatal: stop the daemon (-60 ..). */
	RW_ERR_SYS = -60,          /* unexpected system call failure */
	RW_ERR_FATAL = -61,
} rw_status_t;

/* Static, human-readable description of a status code. Never NULL. */
const char *rw_status_str(rw_status_t st);

static inline int rw_status_is_peer(rw_status_t st) { return st <= -20 && st > -40; }
static inline int rw_status_is_client(rw_status_t st) { return st <= -40 && st > -60; }
static inline int rw_status_is_fatal(rw_status_t st) { return st <= -60; }

/* Logging: one line per event on stderr, "<ISO-8601 UTC ms> <ident> <LEVEL> message" (under
 * journald "<syslog priority>ident message": journald stamps lines itself). Messages carry their
 * context as key=value words first ("peer=node2 rail=1: ...", "group=g layer=3 step=7: ...").
 * errno is preserved across the call so that "%m" keeps working. */
typedef enum rw_log_level {
	RW_LOG_ERROR = 0,
	RW_LOG_WARN = 1,
	RW_LOG_INFO = 2,
	RW_LOG_DEBUG = 3,
} rw_log_level_t;

void rw_log_set_level(rw_log_level_t level);
rw_log_level_t rw_log_get_level(void);
void rw_log_set_ident(const char *ident); /* e.g. "railwaved node=node2"; copied */
void rw_log(rw_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void rw_vlog(rw_log_level_t level, const char *fmt, va_list ap);
/* A start-up error line as written ("railwaved: configuration: ..."), before the log has an
 * ident: under journald with the error priority in front, so `journalctl -p err` shows it. */
void rw_log_early_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
struct timespec;
/* ts as "2026-12-03T07:44:04.123Z" (UTC, milliseconds) into buf; returns the length written. */
size_t rw_log_format_time(char *buf, size_t len, const struct timespec *ts);

/* A budget for the log lines that one party can cause in bulk (a local process that opens and
 * abandons groups, a flood of refused connections): at most `per_s` a second pass, the rest are
 * counted, and the first line of a later second says how many were left out. Loop thread only;
 * zero-initialised. 1: log this line. */
typedef struct rw_log_budget {
	uint64_t window_ns;          /* when this second began */
	uint32_t used;               /* lines passed in it */
	uint64_t dropped;            /* lines left out since the last report */
} rw_log_budget_t;
int rw_log_budget_take(rw_log_budget_t *b, uint32_t per_s, const char *what);

#define rw_err(...) rw_log(RW_LOG_ERROR, __VA_ARGS__)
#define rw_warn(...) rw_log(RW_LOG_WARN, __VA_ARGS__)
#define rw_info(...) rw_log(RW_LOG_INFO, __VA_ARGS__)
#define rw_dbg(...) \
	do { if (rw_log_get_level() >= RW_LOG_DEBUG) rw_log(RW_LOG_DEBUG, __VA_ARGS__); } while (0)

/* Read the whole file at path into a malloc'd buffer with a NUL after the last byte; the caller
 * frees *text_p. A file of more than max_bytes bytes is refused (RW_ERR_PARSE, "PATH is larger
 * than 64 MiB"). With len_p the byte count is returned there and the text may hold NUL bytes;
 * without it the text is meant as a C string, so a NUL byte inside is refused (RW_ERR_PARSE).
 * Errors: RW_ERR_NOTFOUND (no such file), RW_ERR_SYS (cannot open or read), RW_ERR_NOMEM; each
 * writes a message naming the path into err (may be NULL). Outputs are set only on success. */
rw_status_t rw_read_file(const char *path, size_t max_bytes, char **text_p, size_t *len_p,
			 char *err, size_t err_len);

/* Little-endian fields of every wire format (rail descriptors, verbs and tcp handshakes, the
 * daemon's peer messages): the low `bytes` (1..8) bytes of v at p, whatever the host order and
 * alignment. Unrolled, so that with a constant `bytes` GCC (-O2) merges each into one load or
 * store; without the pragma it keeps an 8-byte read as a loop of byte loads. */
static inline void rw_put_le(uint8_t *p, uint64_t v, unsigned bytes)
{
#pragma GCC unroll 8
	for (unsigned i = 0; i < bytes; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t rw_get_le(const uint8_t *p, unsigned bytes)
{
	uint64_t v = 0;
#pragma GCC unroll 8
	for (unsigned i = 0; i < bytes; i++)
		v |= (uint64_t)p[i] << (8 * i);
	return v;
}

/* Monotonic clock in nanoseconds. */
uint64_t rw_now_ns(void);

/* qsort's comparison of doubles, ascending (the benchmarks' medians). */
static inline int rw_cmp_double(const void *a, const void *b)
{
	const double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* xorshift64*: the next of a reproducible sequence from *state (never 0), for tests' and
 * benchmarks' data drawn from a printed seed. */
static inline uint64_t rw_xorshift64s(uint64_t *state)
{
	uint64_t x = *state;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	*state = x;
	return x * 2685821657736338717ull;
}

#define RW_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define RW_MIN(a, b) ((a) < (b) ? (a) : (b))
#define RW_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif /* RW_COMMON_H */
