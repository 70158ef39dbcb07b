/* A listening socket's answer to running out of descriptors or memory: accept() fails with
 * EMFILE/ENFILE/ENOBUFS/ENOMEM while the connection stays pending, so a level-triggered watcher
 * would fire again at once and spin the loop (and the log) for as long as the shortage lasts.
 * Instead the listener's watcher is stopped for a pause and started again by a timer; the
 * shortage is logged at most once per interval. libev-based; used by every accept loop. */
#ifndef RW_COMMON_LISTEN_PAUSE_H
#define RW_COMMON_LISTEN_PAUSE_H

#include <stdint.h>

#include <ev.h>

#define RW_LISTEN_PAUSE_S 0.1         /* how long a listener rests after a shortage */
#define RW_LISTEN_PAUSE_LOG_NS 10000000000ull /* one log line per 10 s at most */

typedef struct rw_listen_pause {
	struct ev_loop *loop;
	ev_io *io;                   /* the listener's watcher */
	ev_timer timer;
	const char *what;            /* names the listener in the log */
	uint64_t last_log_ns;
	uint64_t pauses;             /* shortages met so far */
} rw_listen_pause_t;

void rw_listen_pause_init(rw_listen_pause_t *lp, struct ev_loop *loop, ev_io *io,
			  const char *what);
/* accept() failed with `err`: 1 when it is a shortage and the listener now rests; 0 when it is
 * not (EAGAIN and the like: the caller just returns). */
int rw_listen_pause_on(rw_listen_pause_t *lp, int err);
/* Stop the timer (the listener is going away). */
void rw_listen_pause_stop(rw_listen_pause_t *lp);

/* Waiting room at accept (docs/security.md "Peer authentication"): a connection that has not
 * proven itself yet waits in a budget. Strangers share one; a connection whose source is one of
 * `members` (IPv4, network order: the cluster file's addresses of the nodes that dial this
 * listener) waits in that address's own, which strangers cannot fill. 1: src is a member's
 * address (0.0.0.0 never is). */
int rw_listen_member(const uint32_t *members, uint32_t n_members, uint32_t src);

#endif /* RW_COMMON_LISTEN_PAUSE_H */
