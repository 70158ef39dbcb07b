/* common/listen_pause.h: stop the listener's watcher, restart it from a timer. */
#include "common/listen_pause.h"

#include <errno.h>
#include <string.h>

#include "common/common.h"

static void resume_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)revents;
	rw_listen_pause_t *lp = w->data;
	ev_io_start(loop, lp->io);
}

void rw_listen_pause_init(rw_listen_pause_t *lp, struct ev_loop *loop, ev_io *io, const char *what)
{
	memset(lp, 0, sizeof(*lp));
	lp->loop = loop;
	lp->io = io;
	lp->what = what;
	ev_timer_init(&lp->timer, resume_cb, RW_LISTEN_PAUSE_S, 0.);
	lp->timer.data = lp;
}

int rw_listen_pause_on(rw_listen_pause_t *lp, int err)
{
	if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM)
		return 0;
	lp->pauses++;
	uint64_t now = rw_now_ns();
	if (!lp->last_log_ns || now - lp->last_log_ns >= RW_LISTEN_PAUSE_LOG_NS) {
		rw_warn("%s: cannot accept: %s; not accepting for %.0f ms (%llu times so far)", lp->what,
			strerror(err), RW_LISTEN_PAUSE_S * 1e3, (unsigned long long)lp->pauses);
		lp->last_log_ns = now;
	}
	ev_io_stop(lp->loop, lp->io);
	ev_timer_stop(lp->loop, &lp->timer);
	ev_timer_set(&lp->timer, RW_LISTEN_PAUSE_S, 0.); /* a fired timer keeps no delay of its own */
	ev_timer_start(lp->loop, &lp->timer);
	return 1;
}

void rw_listen_pause_stop(rw_listen_pause_t *lp)
{
	if (lp->loop)
		ev_timer_stop(lp->loop, &lp->timer);
}

int rw_listen_member(const uint32_t *members, uint32_t n_members, uint32_t src)
{
	for (uint32_t i = 0; src != 0 && i < n_members; i++)
		if (members[i] == src)
			return 1;
	return 0;
}
