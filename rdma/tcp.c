/* The `tcp` rail transport: rw_rail_ops_t's one-sided writes over one TCP connection per
 * (peer, rail), bound to the rail's local address so traffic leaves through that rail's NIC.
 * This file is the vtable, the devices, regions and listeners, and connection setup: the
 * handshake runs on the caller's libev loop, non-blocking. Once it is done the connection's own
 * sender and receiver threads move the bytes (tcp_io.c; docs/rdma.md "Threads").
 *
 * A write travels as a 64-byte header (rdma/tcp_wire.h) plus payload; the target validates the
 * header as untrusted input, then receives the payload straight into the registered region at
 * the declared offset (no staging copy). The target acknowledges with a cumulative ACK frame
 * once the data is in place and its arrival reported; the writer reports on_write_done only
 * then, so completion means "in the remote region", as on an RC QP. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rdma/tcp_priv.h"

#define TCP_HANDSHAKE_TIMEOUT_S 10.0
/* Accepted connections whose HELLO has not been taken yet, per device: strangers get this many
 * (a struct each, no queue) for TCP_HANDSHAKE_TIMEOUT_S; more are closed at once. */
#define TCP_PENDING_MAX 64
#define TCP_MEMBER_WAIT_MAX 4 /* waiting connections per member address (their own budget) */
#define TCP_NEWS_BUDGET 64 /* connections served per loop wake-up before other watchers run */
#define TCP_REFUSED_LOG_NS 1000000000ull /* refused handshakes: one log line per second at most */
/* Bucket depth: the larger of 64 KiB and 2 ms at the rate; a sender's turn starts once half
 * the bucket has refilled (docs/rdma.md "Rate pacing", docs/perf/rail-tcp.md). */
#define PACE_MIN_BURST (64u << 10)
#define PACE_BURST_S 2e-3
#define PACE_BACKLOG_S 20e-3 /* credit kept for waiting senders when a wake-up is late */

/* ---- helpers ---------------------------------------------------------------------------- */

static void fmt_sa(const struct sockaddr_in *sa, char *buf, size_t len)
{
	char ip[INET_ADDRSTRLEN];
	inet_ntop(AF_INET, &sa->sin_addr, ip, sizeof(ip));
	snprintf(buf, len, "%s:%u", ip, (unsigned)ntohs(sa->sin_port));
}

static void set_nodelay(int fd)
{
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* ---- connection lifetime ---------------------------------------------------------------- */

/* Stop the threads (joined: nothing of ours touches a region afterwards), the handshake
 * watchers, and close the socket. */
static void conn_stop_io(tcp_conn_t *c)
{
	struct ev_loop *loop = c->dev->base.loop;
	tcp_io_stop(c);
	ev_io_stop(loop, &c->rio);
	ev_io_stop(loop, &c->wio);
	if (c->fd >= 0) {
		close(c->fd);
		c->fd = -1;
	}
}

static void conn_free(tcp_conn_t *c)
{
	pthread_cond_destroy(&c->rx_cv);
	pthread_cond_destroy(&c->tx_cv);
	pthread_mutex_destroy(&c->mu);
	free(c->arrivals);
	free(c->ring);
	free(c);
}

static void conn_unpend(tcp_conn_t *c)
{
	if (c->pending) {
		c->pending = 0;
		c->dev->n_pending -= !c->member_src;
	}
}

/* Unlink, stop everything; free now or, inside one of its callbacks, when that returns. */
static void conn_destroy(tcp_conn_t *c)
{
	conn_unpend(c);
	conn_stop_io(c);
	ev_timer_stop(c->dev->base.loop, &c->timer);
	if (c->pprev) {
		*c->pprev = c->next;
		if (c->next)
			c->next->pprev = c->pprev;
		c->pprev = NULL;
	}
	c->closed = 1;
	if (c->cb_depth == 0)
		conn_free(c);
}

static void tcp_cb_enter(tcp_conn_t *c) { c->cb_depth++; }

/* Returns 0 when the connection was freed (the caller must not touch it). */
static int tcp_cb_leave(tcp_conn_t *c)
{
	if (--c->cb_depth == 0 && c->closed) {
		conn_free(c);
		return 0;
	}
	return 1;
}

static void *write_ctx_of(const rw_rail_conn_t *conn, uint64_t k)
{
	const tcp_conn_t *c = (const tcp_conn_t *)conn;
	return c->ring[k & c->ring_mask].ctx;
}

/* Terminal failure reported on the loop (inside an ev callback: cb_depth > 0). */
static void tcp_conn_fail(tcp_conn_t *c, rw_status_t st)
{
	if (c->closed || c->base.state == RW_RAIL_CONN_DOWN)
		return;
	conn_stop_io(c);
	ev_timer_stop(c->dev->base.loop, &c->timer);
	c->base.state = RW_RAIL_CONN_DOWN;
	if (!c->user_known) { /* an accepted connection that never got announced */
		conn_destroy(c);
		return;
	}
	rw_rail_report_failure(&c->base, &c->tx_acked, c->tx_posted, write_ctx_of, &c->closed, st);
}

/* An accepted connection dropped before its handshake was taken (refused proof, silence):
 * counted, logged at most once per TCP_REFUSED_LOG_NS, so strangers cannot flood the log. */
static void log_refused(tcp_conn_t *c, const char *why)
{
	tcp_dev_t *dev = c->dev;
	uint64_t now = rw_now_ns();
	dev->refused++;
	if (dev->refused_logged_ns && now - dev->refused_logged_ns < TCP_REFUSED_LOG_NS)
		return;
	rw_warn("rail %u: dropped %llu incoming connection(s) before their handshake (latest from "
		"%s: %s); live connections are unaffected", dev->base.rail,
		(unsigned long long)dev->refused, c->base.peer, why);
	dev->refused = 0;
	dev->refused_logged_ns = now;
}

static void timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	tcp_conn_t *c = w->data;
	tcp_cb_enter(c);
	if (c->pending_fail != RW_OK) {
		tcp_conn_fail(c, c->pending_fail);
	} else {
		if (c->user_known)
			rw_err("rail %u peer %s: handshake timed out", c->dev->base.rail, c->base.peer);
		else
			log_refused(c, "no handshake within 10 s");
		tcp_conn_fail(c, RW_ERR_TIMEOUT);
	}
	tcp_cb_leave(c);
}

/* Failure decided inside rw_rail_connect (no callbacks there): report it from the loop. */
static void conn_fail_later(tcp_conn_t *c, rw_status_t st)
{
	struct ev_loop *loop = c->dev->base.loop;
	conn_stop_io(c);
	if (c->pending_fail == RW_OK)
		c->pending_fail = st;
	ev_timer_stop(loop, &c->timer);
	ev_timer_set(&c->timer, 0., 0.);
	ev_timer_start(loop, &c->timer);
}

static void rio_cb(struct ev_loop *loop, ev_io *w, int revents);
static void wio_cb(struct ev_loop *loop, ev_io *w, int revents);

static tcp_conn_t *conn_new(tcp_dev_t *dev, int fd, const rw_rail_conn_cbs_t *cbs, void *ctx)
{
	tcp_conn_t *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->dev = dev;
	c->fd = fd;
	rw_rail_conn_init_base(&c->base, &dev->base, cbs, ctx);
	pthread_mutex_init(&c->mu, NULL);
	pthread_cond_init(&c->tx_cv, NULL);
	pthread_cond_init(&c->rx_cv, NULL);
	ev_io_init(&c->rio, rio_cb, fd, EV_READ);
	ev_io_init(&c->wio, wio_cb, fd, EV_WRITE);
	ev_timer_init(&c->timer, timer_cb, TCP_HANDSHAKE_TIMEOUT_S, 0.);
	c->rio.data = c->wio.data = c->timer.data = c;
	c->next = dev->conns;
	if (c->next)
		c->next->pprev = &c->next;
	dev->conns = c;
	c->pprev = &dev->conns;
	return c;
}

/* ---- handshake (on the loop) ------------------------------------------------------------ */

/* Send what is left of the handshake frame in ctl, as far as the socket takes it; the rest
 * goes when the socket is writable (or, once the threads run, first thing from the sender).
 * Returns 0, or -1 after tcp_conn_fail(). */
static int ctl_flush(tcp_conn_t *c)
{
	while (c->ctl_off < c->ctl_len) {
		ssize_t sent = send(c->fd, c->ctl + c->ctl_off, c->ctl_len - c->ctl_off,
				    MSG_NOSIGNAL | MSG_DONTWAIT);
		if (sent < 0 && errno == EINTR)
			continue;
		if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			ev_io_start(c->dev->base.loop, &c->wio);
			return 0;
		}
		if (sent < 0) {
			rw_err("rail %u peer %s: send: %m", c->dev->base.rail, c->base.peer);
			tcp_conn_fail(c, RW_ERR_PEER);
			return -1;
		}
		c->ctl_off += (uint32_t)sent;
		atomic_fetch_add(&c->dev->tx_bytes, (uint64_t)sent);
		tcp_pace_charge(c->dev, (size_t)sent); /* charged, never held back */
	}
	tcp_stats_sync(c->dev);
	ev_io_stop(c->dev->base.loop, &c->wio);
	return 0;
}

/* Queue HELLO (key = tag) or HELLO_ACK with its proof, and start sending it. */
static int hello_send(tcp_conn_t *c, uint8_t type, uint64_t key, const uint8_t *proof)
{
	rw_tcp_hdr_t h = {.type = type, .key = key, .offset = c->dev->base.rail};
	memcpy(h.proof, proof, RW_TCP_PROOF_SIZE);
	rw_tcp_hdr_encode(&h, c->ctl);
	c->ctl_len = RW_TCP_HDR_SIZE;
	c->ctl_off = 0;
	return ctl_flush(c);
}

/* The handshake is done: the threads take the socket over (allocating the queues only now, so
 * that unauthenticated sockets cost little), then the user is told. -1 when it failed. */
static int announce_up(tcp_conn_t *c)
{
	struct ev_loop *loop = c->dev->base.loop;
	ev_io_stop(loop, &c->rio);
	ev_io_stop(loop, &c->wio);
	conn_unpend(c);
	ev_timer_stop(loop, &c->timer);
	c->hs = HS_DONE;
	rw_status_t st = tcp_io_start(c);
	if (st != RW_OK) { /* a connector hears of it; an unannounced acceptor is dropped */
		tcp_conn_fail(c, st);
		return -1;
	}
	c->user_known = 1;
	c->base.state = RW_RAIL_CONN_UP;
	if (c->base.cbs.on_connected)
		c->base.cbs.on_connected(&c->base, c->base.ctx);
	return 0;
}

static void wio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	tcp_conn_t *c = w->data;
	tcp_cb_enter(c);
	if (c->hs == HS_CONNECTING) {
		int err = 0;
		socklen_t len = sizeof(err);
		if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
			err = errno;
		if (err) {
			errno = err;
			rw_err("rail %u peer %s: connect: %m", c->dev->base.rail, c->base.peer);
			tcp_conn_fail(c, RW_ERR_PEER);
			goto out;
		}
		c->hs = HS_WAIT_HELLO_ACK;
		ev_io_start(loop, &c->rio);
		hello_send(c, RW_TCP_HELLO, c->base.tag, c->base.proof);
		goto out;
	}
	ctl_flush(c);
out:
	tcp_cb_leave(c);
}

static void hs_fail(tcp_conn_t *c, const char *why, const rw_tcp_hdr_t *h)
{
	if (h)
		rw_err("rail %u peer %s: protocol violation: %s (type %u key %#llx offset %llu); "
		       "dropping connection", c->dev->base.rail, c->base.peer, why, h->type,
		       (unsigned long long)h->key, (unsigned long long)h->offset);
	else
		rw_err("rail %u peer %s: protocol violation: %s; dropping connection",
		       c->dev->base.rail, c->base.peer, why);
	tcp_conn_fail(c, RW_ERR_PROTO);
}

/* One whole handshake frame in hs_hdr. */
static void hs_frame(tcp_conn_t *c)
{
	rw_tcp_hdr_t h;
	if (rw_tcp_hdr_decode(c->hs_hdr, &h) != 0) {
		hs_fail(c, "bad magic, version or frame type", NULL);
		return;
	}
	if (h.type == RW_TCP_HELLO && c->hs == HS_WAIT_HELLO) {
		if (h.offset != c->dev->base.rail) {
			hs_fail(c, "peer is on another rail", &h);
			return;
		}
		c->base.tag = h.key;
		uint8_t reply[RW_RAIL_PROOF_SIZE] = {0};
		/* The user's check comes before anything of this connection is taken in: a
		 * refused one is closed unannounced, and no region sees a byte of it. */
		if (c->base.cbs.on_verify &&
		    c->base.cbs.on_verify(&c->base, c->base.ctx, h.proof, reply) != 0) {
			log_refused(c, "no valid proof");
			tcp_conn_fail(c, RW_ERR_PROTO);
			return;
		}
		if (hello_send(c, RW_TCP_HELLO_ACK, 0, reply) == 0)
			announce_up(c);
		return;
	}
	if (h.type == RW_TCP_HELLO_ACK && c->hs == HS_WAIT_HELLO_ACK &&
	    c->ctl_off == c->ctl_len) {
		if (h.offset != c->dev->base.rail) {
			hs_fail(c, "unexpected HELLO_ACK", &h);
			return;
		}
		if (c->base.cbs.on_verify &&
		    c->base.cbs.on_verify(&c->base, c->base.ctx, h.proof, NULL) != 0) {
			hs_fail(c, "the acceptor's proof is not valid", &h);
			return;
		}
		announce_up(c);
		return;
	}
	hs_fail(c, h.type == RW_TCP_WRITE ? "WRITE before handshake"
		   : h.type == RW_TCP_ACK ? "ACK for writes never sent"
		   : h.type == RW_TCP_HELLO ? "unexpected HELLO" : "unexpected HELLO_ACK", &h);
}

/* Handshake frames only: reads never go past one header (what follows is the threads'). */
static void rio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	tcp_conn_t *c = w->data;
	tcp_cb_enter(c);
	while (c->fd >= 0 && c->hs != HS_DONE && !c->closed &&
	       c->base.state != RW_RAIL_CONN_DOWN) {
		ssize_t got = recv(c->fd, c->hs_hdr + c->hs_have, RW_TCP_HDR_SIZE - c->hs_have,
				   MSG_DONTWAIT);
		if (got < 0 && errno == EINTR)
			continue;
		if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			break;
		if (got < 0) {
			rw_err("rail %u peer %s: receive: %m", c->dev->base.rail, c->base.peer);
			tcp_conn_fail(c, RW_ERR_PEER);
			break;
		}
		if (got == 0) {
			if (c->user_known)
				rw_warn("rail %u peer %s: connection closed by peer during the handshake",
					c->dev->base.rail, c->base.peer);
			tcp_conn_fail(c, RW_ERR_PEER);
			break;
		}
		c->hs_have += (uint32_t)got;
		if (c->hs_have == RW_TCP_HDR_SIZE) {
			c->hs_have = 0;
			hs_frame(c);
		}
	}
	tcp_cb_leave(c);
}

/* ---- delivery of what the threads did (on the loop) ------------------------------------ */

/* Report what the threads did: arrivals (then let the next ACK say so), completions, room,
 * and finally a failure. Inside cb_enter/cb_leave. */
static void conn_news(tcp_conn_t *c)
{
	if (c->closed || c->base.state != RW_RAIL_CONN_UP)
		return;
	pthread_mutex_lock(&c->mu);
	uint64_t landed = RW_MIN(c->rx_landed, c->rx_cut);
	uint64_t acked = c->peer_acked;
	rw_status_t err = c->err;
	uint64_t done = c->rx_done;
	pthread_mutex_unlock(&c->mu);
	/* Entry rx_done stays put until rx_done moves past it; rx_done moves before each report,
	 * so a dereg from inside on_arrival sees only the arrivals not reported yet. */
	while (done < RW_MIN(landed, c->rx_cut)) {
		const rx_entry_t *e = &c->arrivals[done & c->ring_mask];
		rw_rail_arrival_t a = {.region = e->region, .offset = e->offset,
				       .length = e->length, .imm = e->imm};
		pthread_mutex_lock(&c->mu);
		c->rx_done = ++done;
		pthread_mutex_unlock(&c->mu);
		if (c->base.cbs.on_arrival)
			c->base.cbs.on_arrival(&c->base, c->base.ctx, &a);
		if (c->closed || c->base.state != RW_RAIL_CONN_UP)
			return;
	}
	pthread_mutex_lock(&c->mu); /* one ACK covers every arrival of this wake-up */
	if (c->tx_idle && c->ack_sent < c->rx_done)
		pthread_cond_signal(&c->tx_cv);
	if (c->rx_full)
		pthread_cond_signal(&c->rx_cv);
	pthread_mutex_unlock(&c->mu);
	while (c->tx_acked < acked) {
		tx_entry_t *e = &c->ring[c->tx_acked & c->ring_mask];
		c->tx_acked++;
		if (c->base.cbs.on_write_done)
			c->base.cbs.on_write_done(&c->base, c->base.ctx, e->ctx, RW_OK);
		if (c->closed || c->base.state != RW_RAIL_CONN_UP)
			return;
	}
	if (c->want_writable && c->tx_posted - c->tx_acked < c->dev->base.max_writes) {
		c->want_writable = 0;
		if (c->base.cbs.on_writable)
			c->base.cbs.on_writable(&c->base, c->base.ctx);
		if (c->closed || c->base.state != RW_RAIL_CONN_UP)
			return;
	}
	if (err != RW_OK)
		tcp_conn_fail(c, err);
}

/* The device's ev_async: deliver what the threads reported. */
static void news_cb(struct ev_loop *loop, ev_async *w, int revents)
{
	(void)revents;
	tcp_dev_t *dev = w->data;
	tcp_stats_sync(dev);
	for (int k = 0; k < TCP_NEWS_BUDGET; k++) {
		tcp_conn_t *c = tcp_io_news_pop(dev);
		if (!c)
			return;
		tcp_cb_enter(c);
		conn_news(c);
		tcp_cb_leave(c);
	}
	ev_async_send(loop, w); /* more news: after the loop's other watchers had a turn */
}

/* ---- listener --------------------------------------------------------------------------- */

/* Room for one more waiting connection from a member's address: when TCP_MEMBER_WAIT_MAX from
 * it wait already, the oldest gives way (a restarted node's new dial beats its stale ones). */
static void member_make_room(tcp_dev_t *dev, uint32_t src)
{
	tcp_conn_t *oldest = NULL;
	uint32_t n = 0;
	for (tcp_conn_t *c = dev->conns; c; c = c->next)
		if (c->pending && c->member_src && c->src == src) {
			oldest = c; /* the list is newest first */
			n++;
		}
	if (n >= TCP_MEMBER_WAIT_MAX) {
		log_refused(oldest, "gave way to a newer connection from the same address");
		conn_destroy(oldest); /* unannounced, not inside its own callback: freed now */
	}
}

/* Strangers get a bounded budget (TCP_PENDING_MAX waiting for their HELLO; the rest are closed
 * at accept). A connection from a member's address (rw_rail_config_t.members) waits in that
 * address's own budget, so strangers that keep theirs full cannot keep a node's rail out. */
static void accept_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	tcp_listener_t *l = w->data;
	tcp_dev_t *dev = (tcp_dev_t *)l->base.dev;
	for (int i = 0; i < 64; i++) {
		struct sockaddr_in sa;
		socklen_t salen = sizeof(sa);
		int fd = accept4(l->fd, (struct sockaddr *)&sa, &salen, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (!rw_listen_pause_on(&l->pause, errno) && errno != EAGAIN &&
			    errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
				rw_err("rail %u: accept on %s: %m", dev->base.rail, l->base.addr);
			return;
		}
		int member = rw_listen_member(dev->members, dev->n_members, sa.sin_addr.s_addr);
		if (member) {
			member_make_room(dev, sa.sin_addr.s_addr);
		} else if (dev->n_pending >= TCP_PENDING_MAX) {
			close(fd);
			continue;
		}
		set_nodelay(fd);
		tcp_conn_t *c = conn_new(dev, fd, &l->base.cbs, l->base.ctx);
		if (!c) {
			rw_err("rail %u: out of memory accepting a connection", dev->base.rail);
			close(fd);
			continue;
		}
		c->base.accepted = 1;
		c->pending = 1;
		c->member_src = member;
		c->src = sa.sin_addr.s_addr;
		dev->n_pending += !member;
		fmt_sa(&sa, c->base.peer, sizeof(c->base.peer));
		c->hs = HS_WAIT_HELLO;
		ev_io_start(loop, &c->rio);
		ev_timer_start(loop, &c->timer);
	}
}

static rw_status_t tcp_listen(rw_rail_dev_t *base, const rw_rail_conn_cbs_t *cbs, void *ctx,
			      rw_rail_listener_t **listener_p)
{
	tcp_dev_t *dev = (tcp_dev_t *)base;
	rw_status_t st = RW_ERR_SYS;
	tcp_listener_t *l = calloc(1, sizeof(*l));
	if (!l)
		return RW_ERR_NOMEM;
	l->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (l->fd < 0) {
		rw_err("rail %u: socket: %m", base->rail);
		goto free_listener;
	}
	int one = 1;
	setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	struct sockaddr_in sa = dev->local_sa;
	sa.sin_port = htons(base->port);
	if (bind(l->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		rw_err("rail %u: bind %s port %u: %m", base->rail, base->local, base->port);
		goto close_fd;
	}
	if (listen(l->fd, 128) < 0) {
		rw_err("rail %u: listen: %m", base->rail);
		goto close_fd;
	}
	socklen_t salen = sizeof(sa);
	if (getsockname(l->fd, (struct sockaddr *)&sa, &salen) < 0)
		goto close_fd;
	fmt_sa(&sa, l->base.addr, sizeof(l->base.addr));
	l->base.dev = base;
	l->base.cbs = *cbs;
	l->base.ctx = ctx;
	ev_io_init(&l->io, accept_cb, l->fd, EV_READ);
	l->io.data = l;
	rw_listen_pause_init(&l->pause, base->loop, &l->io, "tcp rail listener");
	ev_io_start(base->loop, &l->io);
	l->next = dev->listeners;
	if (l->next)
		l->next->pprev = &l->next;
	dev->listeners = l;
	l->pprev = &dev->listeners;
	*listener_p = &l->base;
	return RW_OK;

close_fd:
	close(l->fd);
free_listener:
	free(l);
	return st;
}

static void tcp_listener_close(rw_rail_listener_t *base)
{
	tcp_listener_t *l = (tcp_listener_t *)base;
	ev_io_stop(base->dev->loop, &l->io);
	rw_listen_pause_stop(&l->pause);
	close(l->fd);
	*l->pprev = l->next;
	if (l->next)
		l->next->pprev = l->pprev;
	free(l);
}

/* ---- connect / write / close ------------------------------------------------------------ */

static rw_status_t tcp_connect(rw_rail_dev_t *base, const char *peer_addr, uint64_t tag,
			       const rw_rail_conn_cbs_t *cbs, void *ctx, rw_rail_conn_t **conn_p)
{
	tcp_dev_t *dev = (tcp_dev_t *)base;
	struct sockaddr_in peer = {.sin_family = AF_INET};
	uint16_t peer_port;
	if (rw_rail_addr_parse(peer_addr, &peer.sin_addr.s_addr, &peer_port) != RW_OK) {
		rw_err("rail %u: bad peer address '%s' (want a.b.c.d:port)", base->rail, peer_addr);
		return RW_ERR_INVAL;
	}
	peer.sin_port = htons(peer_port);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		rw_err("rail %u: socket: %m", base->rail);
		return RW_ERR_SYS;
	}
	/* Bind to the rail's address: the route out follows the source on a rail-per-subnet
	 * setup, and the peer sees which rail we are. */
	struct sockaddr_in local = dev->local_sa;
	local.sin_port = 0;
	if (bind(fd, (struct sockaddr *)&local, sizeof(local)) < 0) {
		rw_err("rail %u: bind %s: %m", base->rail, base->local);
		close(fd);
		return RW_ERR_SYS;
	}
	set_nodelay(fd);
	tcp_conn_t *c = conn_new(dev, fd, cbs, ctx);
	if (!c) {
		close(fd);
		return RW_ERR_NOMEM;
	}
	c->base.tag = tag;
	c->user_known = 1;
	c->hs = HS_CONNECTING;
	snprintf(c->base.peer, sizeof(c->base.peer), "%s", peer_addr);
	ev_timer_start(base->loop, &c->timer);
	if (connect(fd, (struct sockaddr *)&peer, sizeof(peer)) < 0 && errno != EINPROGRESS) {
		rw_err("rail %u peer %s: connect: %m", base->rail, peer_addr);
		conn_fail_later(c, RW_ERR_PEER); /* on_error() from the loop, as promised */
	} else {
		ev_io_start(base->loop, &c->wio);
	}
	*conn_p = &c->base;
	return RW_OK;
}

static rw_status_t tcp_write(rw_rail_conn_t *base, const rw_rail_write_t *w)
{
	tcp_conn_t *c = (tcp_conn_t *)base;
	if (base->state != RW_RAIL_CONN_UP || c->closed || c->fd < 0)
		return RW_ERR_STATE; /* fd < 0: a failure is about to be reported */
	if (c->tx_posted - c->tx_acked >= c->dev->base.max_writes) {
		c->want_writable = 1;
		return RW_ERR_AGAIN;
	}
	tx_entry_t *e = &c->ring[c->tx_posted & c->ring_mask];
	e->local = w->local;
	e->local_offset = w->local_offset;
	e->length = w->length;
	e->ctx = w->ctx;
	rw_tcp_hdr_t h = {.type = RW_TCP_WRITE, .imm = w->imm, .key = w->remote.key,
			  .offset = w->remote_offset, .length = w->length, .seq = c->tx_posted + 1};
	rw_tcp_hdr_encode(&h, e->hdr);
	tcp_io_post(c); /* the sender thread takes it: no callbacks from here */
	return RW_OK;
}

static void tcp_conn_close(rw_rail_conn_t *base)
{
	conn_destroy((tcp_conn_t *)base);
}

/* ---- regions ---------------------------------------------------------------------------- */

static rw_status_t tcp_reg_host(rw_rail_dev_t *base, void *addr, uint64_t length,
				rw_rail_region_t **region_p)
{
	tcp_dev_t *dev = (tcp_dev_t *)base;
	rw_rail_region_t *r = calloc(1, sizeof(*r));
	if (!r)
		return RW_ERR_NOMEM;
	r->dev = base;
	r->addr = addr;
	r->length = length;
	/* Salted per device so that a stale or foreign key is very unlikely to name a live one. */
	r->key = ((uint64_t)dev->key_salt << 32) | ++dev->key_counter;
	r->base = 0;
	pthread_mutex_lock(&dev->reg_mu); /* receiver threads search the table */
	if (dev->nregions == dev->cap_regions) {
		size_t cap = dev->cap_regions ? 2 * dev->cap_regions : 16;
		rw_rail_region_t **grown = realloc(dev->regions, cap * sizeof(*grown));
		if (!grown) {
			pthread_mutex_unlock(&dev->reg_mu);
			free(r);
			return RW_ERR_NOMEM;
		}
		dev->regions = grown;
		dev->cap_regions = cap;
	}
	dev->regions[dev->nregions++] = r;
	pthread_mutex_unlock(&dev->reg_mu);
	*region_p = r;
	return RW_OK;
}

static rw_status_t tcp_reg_dmabuf(rw_rail_dev_t *dev, int fd, uint64_t fd_offset,
				  uint64_t length, uint64_t iova, rw_rail_region_t **region_p)
{
	(void)dev, (void)fd, (void)fd_offset, (void)length, (void)iova, (void)region_p;
	return RW_ERR_UNSUPPORTED; /* sockets need a CPU mapping: stage through host memory */
}

/* After dereg returns no thread of ours touches the region: a receiver writing into it has
 * left it (its connection fails with RW_ERR_PROTO: the socket is shut, so this waits for one
 * system call to return, never for the peer), and a connection holding landed but unreported
 * arrivals into it fails too, without reporting them. Our own writes from it are the caller's
 * business (rail.h: none may use it any more). */
static void tcp_dereg(rw_rail_region_t *r)
{
	tcp_dev_t *dev = (tcp_dev_t *)r->dev;
	pthread_mutex_lock(&dev->reg_mu);
	for (size_t i = 0; i < dev->nregions; i++) {
		if (dev->regions[i] == r) {
			dev->regions[i] = dev->regions[--dev->nregions];
			break;
		}
	}
	int busy = 0;
	for (tcp_conn_t *c = dev->conns; c; c = c->next) {
		if (c->rx_busy == r) {
			rw_err("rail %u peer %s: region %#llx deregistered while a write was landing",
			       dev->base.rail, c->base.peer, (unsigned long long)r->key);
			tcp_io_fail(c, RW_ERR_PROTO);
			busy = 1;
		}
	}
	while (busy) {
		pthread_cond_wait(&dev->reg_cv, &dev->reg_mu);
		busy = 0;
		for (tcp_conn_t *c = dev->conns; c; c = c->next)
			busy |= c->rx_busy == r;
	}
	for (tcp_conn_t *c = dev->conns; c; c = c->next) {
		if (!c->threads)
			continue;
		pthread_mutex_lock(&c->mu);
		uint64_t k = c->rx_done;
		while (k < c->rx_landed && c->arrivals[k & c->ring_mask].region != r)
			k++;
		int cut = k < c->rx_landed && k < c->rx_cut;
		if (cut)
			c->rx_cut = k;
		pthread_mutex_unlock(&c->mu);
		if (cut) {
			rw_err("rail %u peer %s: region %#llx deregistered before a write into it was "
			       "reported", dev->base.rail, c->base.peer, (unsigned long long)r->key);
			tcp_io_fail(c, RW_ERR_PROTO);
		}
	}
	pthread_mutex_unlock(&dev->reg_mu);
	free(r);
}

/* ---- device ----------------------------------------------------------------------------- */

static rw_status_t tcp_dev_open(const rw_rail_config_t *cfg, struct ev_loop *loop,
				rw_rail_dev_t **dev_p)
{
	rw_status_t st;
	tcp_dev_t *dev = calloc(1, sizeof(*dev));
	if (!dev)
		return RW_ERR_NOMEM;
	st = rw_rail_dev_init_base(&dev->base, &rw_rail_tcp_ops, cfg, loop, TCP_DEFAULT_MAX_WRITES);
	if (st != RW_OK)
		goto free_dev;
	dev->local_sa.sin_family = AF_INET;
	if (!cfg->local || inet_pton(AF_INET, cfg->local, &dev->local_sa.sin_addr) != 1) {
		rw_err("rail %u: tcp wants an IPv4 address for the rail, got '%s'", cfg->rail,
		       cfg->local);
		st = RW_ERR_INVAL;
		goto free_dev;
	}
	/* Probe that the address is ours (EADDRNOTAVAIL otherwise). */
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		st = RW_ERR_SYS;
		goto free_dev;
	}
	int rc = bind(fd, (struct sockaddr *)&dev->local_sa, sizeof(dev->local_sa));
	int saved = errno;
	close(fd);
	if (rc < 0) {
		errno = saved;
		rw_err("rail %u: address %s is not usable here: %m", cfg->rail, cfg->local);
		st = saved == EADDRNOTAVAIL ? RW_ERR_NOTFOUND : RW_ERR_SYS;
		goto free_dev;
	}
	if (cfg->n_members) {
		dev->members = malloc(cfg->n_members * sizeof(*dev->members));
		if (!dev->members) {
			st = RW_ERR_NOMEM;
			goto free_dev;
		}
		memcpy(dev->members, cfg->members, cfg->n_members * sizeof(*dev->members));
		dev->n_members = cfg->n_members;
	}
	if (getrandom(&dev->key_salt, sizeof(dev->key_salt), GRND_NONBLOCK) != sizeof(dev->key_salt))
		dev->key_salt = (uint32_t)(rw_now_ns() ^ (uint64_t)getpid() << 16);
	if (cfg->pace_bps) {
		dev->pace_Bps = (double)cfg->pace_bps / 8.;
		dev->pace_burst = RW_MAX((double)PACE_MIN_BURST, dev->pace_Bps * PACE_BURST_S);
		dev->pace_wake = dev->pace_burst / 2.;
		dev->pace_backlog = RW_MAX(dev->pace_burst, dev->pace_Bps * PACE_BACKLOG_S);
		dev->pace_tokens = dev->pace_burst;
		dev->pace_last_ns = rw_now_ns();
	}
	pthread_mutex_init(&dev->reg_mu, NULL);
	pthread_cond_init(&dev->reg_cv, NULL);
	pthread_mutex_init(&dev->mu, NULL);
	pthread_mutex_init(&dev->pace_mu, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* pace_take's deadlines */
	pthread_cond_init(&dev->pace_cv, &ca);
	pthread_condattr_destroy(&ca);
	ev_async_init(&dev->news, news_cb);
	dev->news.data = dev;
	ev_async_start(loop, &dev->news);
	ev_unref(loop); /* only connections with running threads keep the loop alive */
	dev->base.caps.flags = RW_RAIL_CAP_ARRIVAL_WHERE | RW_RAIL_CAP_PROOF;
	dev->base.caps.max_writes = dev->base.max_writes;
	dev->base.caps.max_write_length = TCP_MAX_WRITE_LENGTH;
	*dev_p = &dev->base;
	return RW_OK;

free_dev:
	free(dev);
	return st;
}

static void tcp_dev_close(rw_rail_dev_t *base)
{
	tcp_dev_t *dev = (tcp_dev_t *)base;
	while (dev->listeners)
		tcp_listener_close(&dev->listeners->base);
	while (dev->conns)
		conn_destroy(dev->conns); /* joins their threads */
	ev_ref(base->loop); /* undo dev_open's ev_unref before stopping the watcher */
	ev_async_stop(base->loop, &dev->news);
	for (size_t i = 0; i < dev->nregions; i++)
		free(dev->regions[i]);
	free(dev->regions);
	free(dev->members);
	pthread_cond_destroy(&dev->pace_cv);
	pthread_mutex_destroy(&dev->pace_mu);
	pthread_mutex_destroy(&dev->mu);
	pthread_cond_destroy(&dev->reg_cv);
	pthread_mutex_destroy(&dev->reg_mu);
	free(dev);
}

/* A registered region is the caller's own pages (rail.h). */
static int tcp_region_fd(const rw_rail_region_t *region)
{
	(void)region;
	return -1;
}

const rw_rail_ops_t rw_rail_tcp_ops = {
	.name = "tcp",
	.dev_open = tcp_dev_open,
	.dev_close = tcp_dev_close,
	.reg_host = tcp_reg_host,
	.reg_dmabuf = tcp_reg_dmabuf,
	.dereg = tcp_dereg,
	.listen = tcp_listen,
	.listener_close = tcp_listener_close,
	.connect = tcp_connect,
	.write = tcp_write,
	.conn_close = tcp_conn_close,
	.region_fd = tcp_region_fd,
};
