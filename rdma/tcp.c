/* The `tcp` rail transport: rw_rail_ops_t's one-sided writes over one TCP connection per
 * (peer, rail), bound to the rail's local address so traffic leaves through that rail's NIC.
 * Single-threaded on the caller's libev loop (docs/rdma.md says why that is enough).
 *
 * A write travels as a 64-byte header (rdma/tcp_wire.h) plus payload; the target validates the
 * header as untrusted input, then receives the payload straight into the registered region at
 * the declared offset (readv into place, no staging copy). The target acknowledges with a
 * cumulative ACK frame once the data is in place, batched per read wake-up; the writer reports
 * on_write_done only then, so completion means "in the remote region", as on an RC QP.
 *
 * Optional rate pacing (rw_rail_config_t.pace_bps): a token bucket per device limits the bytes
 * all its connections hand to their sockets, so a loopback "NIC" behaves like a slower one.
 * A connection that finds the bucket empty waits in the device's FIFO; a timer refills the
 * bucket and gives each waiter a turn, round robin. Nothing blocks the loop. */
#include "rdma/rail.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ev.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/listen_pause.h"
#include "rdma/tcp_wire.h"

#define TCP_DEFAULT_MAX_WRITES 1024
#define TCP_MAX_WRITE_LENGTH (1ull << 30)
#define TCP_HANDSHAKE_TIMEOUT_S 10.0
#define TCP_IOV_MAX 64
#define TCP_IO_BUDGET (8u << 20) /* bytes per wake-up and direction: keep other rails fair */
/* Accepted connections whose HELLO has not been taken yet, per device: strangers get this many
 * (a struct each, no queue) for TCP_HANDSHAKE_TIMEOUT_S; more are closed at once. */
#define TCP_PENDING_MAX 64
#define TCP_REFUSED_LOG_NS 1000000000ull /* refused handshakes: one log line per second at most */
/* Bucket depth: the larger of 64 KiB and 2 ms at the rate. Not less than 2 ms: libev's epoll
 * backend sleeps in whole milliseconds, so a refill timer can fire ~1 ms late, and a shallower
 * bucket would overflow while waiting (the rate falls short: 0.81 of 1 Gb/s with 1 ms). A
 * waiting connection gets its turn once half the bucket has refilled. */
#define PACE_MIN_BURST (64u << 10)
#define PACE_BURST_S 2e-3
#define PACE_BACKLOG_S 20e-3 /* credit kept for waiting connections when the timer is late */

typedef struct tcp_conn tcp_conn_t;
typedef struct tcp_listener tcp_listener_t;

typedef struct tcp_dev {
	rw_rail_dev_t base;
	struct sockaddr_in local_sa;
	rw_rail_region_t **regions; /* registered regions; few per device, searched linearly */
	size_t nregions, cap_regions;
	uint32_t key_salt, key_counter;
	tcp_conn_t *conns;          /* every connection not yet freed */
	tcp_listener_t *listeners;
	uint32_t n_pending;         /* accepted, HELLO not taken yet (TCP_PENDING_MAX) */
	uint64_t refused, refused_logged_ns; /* refused handshakes since the last log line */

	/* Rate pacing (docs/rdma.md "Rate pacing"); pace_Bps == 0: off. The bucket holds bytes;
	 * control frames (ACK, HELLO) are never held back but are charged, so it may go below 0. */
	double pace_Bps;            /* bytes per second */
	double pace_tokens;         /* bytes that may be sent now, <= pace_burst (idle) */
	double pace_burst;          /* bucket depth */
	double pace_backlog;        /* depth while connections wait: late timers catch up */
	double pace_wake;           /* waiters are served once the bucket holds this much */
	uint64_t pace_last_ns;      /* last refill */
	ev_timer pace_timer;
	tcp_conn_t *pace_head;      /* FIFO of connections waiting for tokens (pace_next) */
	tcp_conn_t *pace_tail;
	size_t pace_n;
} tcp_dev_t;

struct tcp_listener {
	rw_rail_listener_t base;
	int fd;
	ev_io io;
	rw_listen_pause_t pause;    /* rests the listener when descriptors run out */
	tcp_listener_t *next, **pprev;
};

typedef struct tx_entry {
	rw_rail_region_t *local;
	uint64_t local_offset, length;
	void *ctx;
	uint8_t hdr[RW_TCP_HDR_SIZE];
} tx_entry_t;

enum hs_state {
	HS_CONNECTING,     /* connector: waiting for connect() to finish */
	HS_WAIT_HELLO_ACK, /* connector: HELLO sent */
	HS_WAIT_HELLO,     /* acceptor: waiting for the peer's HELLO */
	HS_DONE,
};

struct tcp_conn {
	rw_rail_conn_t base;
	tcp_dev_t *dev;
	int fd;
	ev_io rio, wio;
	ev_timer timer;          /* handshake timeout, or a deferred failure (after 0 s) */
	enum hs_state hs;
	rw_status_t pending_fail; /* set by fail_later(); reported from the timer */
	int user_known;          /* the user holds this conn (connector, or accept announced) */
	int cb_depth;            /* > 0 while inside one of our ev callbacks */
	int closed;              /* rw_rail_conn_close() called: free when cb_depth drops to 0 */
	int want_writable;       /* rw_rail_write() said AGAIN: on_writable() owed */
	int pace_waiting;        /* in the device's pacing FIFO (write watcher stopped) */
	int pace_turn;           /* being served by the pacing timer: may pass the FIFO */
	int pending;             /* counted in dev->n_pending */
	tcp_conn_t *pace_next;

	/* Outgoing writes: ring of max_writes (rounded up to a power of two) entries. Counters are
	 * free-running; entry k carries seq k + 1. acked <= sent <= posted. */
	tx_entry_t *ring;
	uint64_t ring_mask;
	uint64_t tx_acked, tx_sent, tx_posted;
	uint64_t tx_off; /* bytes of entry tx_sent (header + payload) already sent */

	/* Control frame being sent (HELLO, HELLO_ACK, ACK): only between whole write frames. */
	uint8_t ctl[RW_TCP_HDR_SIZE];
	uint32_t ctl_len, ctl_off;
	uint64_t rx_done;  /* incoming writes in place and reported */
	uint64_t ack_sent; /* highest rx_done put into an ACK frame */

	/* Incoming frame. */
	uint8_t rx_hdr[RW_TCP_HDR_SIZE];
	uint32_t rx_hdr_have;
	int rx_in_payload;
	rw_tcp_hdr_t rx_cur;
	rw_rail_region_t *rx_region;
	uint64_t rx_have;

	tcp_conn_t *next, **pprev;
};

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

static rw_rail_region_t *region_find(tcp_dev_t *dev, uint64_t key)
{
	for (size_t i = 0; i < dev->nregions; i++)
		if (dev->regions[i]->key == key)
			return dev->regions[i];
	return NULL;
}

/* ---- rate pacing ------------------------------------------------------------------------ */

static void pace_refill(tcp_dev_t *dev)
{
	uint64_t now = rw_now_ns();
	dev->pace_tokens += (double)(now - dev->pace_last_ns) * 1e-9 * dev->pace_Bps;
	/* An idle link saves up at most a small burst. While connections wait, the time a late
	 * timer (a busy loop, a descheduled process) lost is credited, up to pace_backlog: a real
	 * NIC keeps draining its queue whatever the host CPU is doing. */
	double cap = dev->pace_head ? dev->pace_backlog : dev->pace_burst;
	if (dev->pace_tokens > cap)
		dev->pace_tokens = cap;
	dev->pace_last_ns = now;
}

/* Arm the refill timer for when the bucket reaches pace_wake (at once if it already has). */
static void pace_arm(tcp_dev_t *dev)
{
	if (ev_is_active(&dev->pace_timer))
		return;
	pace_refill(dev);
	double wait = (dev->pace_wake - dev->pace_tokens) / dev->pace_Bps;
	ev_timer_set(&dev->pace_timer, wait > 0 ? wait : 0., 0.);
	ev_timer_start(dev->base.loop, &dev->pace_timer);
}

static void pace_enqueue(tcp_conn_t *c)
{
	tcp_dev_t *dev = c->dev;
	if (c->pace_waiting)
		return;
	c->pace_waiting = 1;
	c->pace_next = NULL;
	if (dev->pace_tail)
		dev->pace_tail->pace_next = c;
	else
		dev->pace_head = c;
	dev->pace_tail = c;
	dev->pace_n++;
	dev->base.stats.pace_waits++;
	pace_arm(dev);
}

static void pace_unlink(tcp_conn_t *c)
{
	tcp_dev_t *dev = c->dev;
	if (!c->pace_waiting)
		return;
	tcp_conn_t **pp = &dev->pace_head, *prev = NULL;
	while (*pp != c) {
		prev = *pp;
		pp = &(*pp)->pace_next;
	}
	*pp = c->pace_next;
	if (dev->pace_tail == c)
		dev->pace_tail = prev;
	dev->pace_n--;
	c->pace_waiting = 0;
	c->pace_next = NULL;
}

/* ---- connection lifetime ---------------------------------------------------------------- */

static void conn_stop_io(tcp_conn_t *c)
{
	struct ev_loop *loop = c->dev->base.loop;
	pace_unlink(c);
	ev_io_stop(loop, &c->rio);
	ev_io_stop(loop, &c->wio);
	if (c->fd >= 0) {
		close(c->fd);
		c->fd = -1;
	}
}

static void conn_free(tcp_conn_t *c)
{
	free(c->ring);
	free(c);
}

/* Unlink, stop everything; free now or, inside one of its callbacks, when that returns. */
static void conn_unpend(tcp_conn_t *c)
{
	if (c->pending) {
		c->pending = 0;
		c->dev->n_pending--;
	}
}

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

static void cb_enter(tcp_conn_t *c) { c->cb_depth++; }

/* Returns 0 when the connection was freed (the caller must not touch it). */
static int cb_leave(tcp_conn_t *c)
{
	if (--c->cb_depth == 0 && c->closed) {
		conn_free(c);
		return 0;
	}
	return 1;
}

/* Terminal failure, reported from inside an ev callback (cb_depth > 0). */
static void conn_fail(tcp_conn_t *c, rw_status_t st)
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
	while (c->tx_acked < c->tx_posted) {
		tx_entry_t *e = &c->ring[c->tx_acked & c->ring_mask];
		c->tx_acked++;
		if (c->base.cbs.on_write_done)
			c->base.cbs.on_write_done(&c->base, c->base.ctx, e->ctx, st);
		if (c->closed)
			return;
	}
	if (c->base.cbs.on_error)
		c->base.cbs.on_error(&c->base, c->base.ctx, st);
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
	cb_enter(c);
	if (c->pending_fail != RW_OK) {
		conn_fail(c, c->pending_fail);
	} else {
		if (c->user_known)
			rw_err("rail %u peer %s: handshake timed out", c->dev->base.rail, c->base.peer);
		else
			log_refused(c, "no handshake within 10 s");
		conn_fail(c, RW_ERR_TIMEOUT);
	}
	cb_leave(c);
}

/* Failure decided outside a callback (inside an rw_rail_* call): stop the I/O now so nothing
 * more lands, report from the loop. */
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
	c->base.dev = &dev->base;
	c->base.cbs = *cbs;
	c->base.ctx = ctx;
	c->base.state = RW_RAIL_CONN_CONNECTING;
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

/* ---- sending ---------------------------------------------------------------------------- */

/* proof: HELLO and HELLO_ACK only (NULL = zeros). */
static void ctl_queue(tcp_conn_t *c, uint8_t type, uint64_t key, uint64_t offset, uint64_t seq,
		      const uint8_t *proof)
{
	rw_tcp_hdr_t h = {.type = type, .key = key, .offset = offset, .seq = seq};
	if (proof)
		memcpy(h.proof, proof, RW_TCP_PROOF_SIZE);
	rw_tcp_hdr_encode(&h, c->ctl);
	c->ctl_len = RW_TCP_HDR_SIZE;
	c->ctl_off = 0;
}

static int tx_pending(const tcp_conn_t *c)
{
	return c->ctl_off < c->ctl_len || c->tx_sent < c->tx_posted ||
	       (c->hs == HS_DONE && c->rx_done > c->ack_sent);
}

/* Send as much as the socket (and, when paced, the device's bucket) takes: control frame first
 * (only at a write-frame boundary), then queued writes as header+payload iovecs. Returns 0, or
 * -1 after conn_fail(). */
static int tx_flush(tcp_conn_t *c)
{
	tcp_dev_t *dev = c->dev;
	size_t budget = TCP_IO_BUDGET;
	int sock_full = 0, pace_blocked = 0, pace_granted = 0;
	if (c->fd < 0) /* failing (fail_later) */
		return 0;
	if (dev->pace_Bps > 0)
		pace_refill(dev);
	while (budget > 0) {
		struct iovec iov[TCP_IOV_MAX];
		int n = 0;
		size_t total = 0;
		if (c->ctl_off >= c->ctl_len && c->tx_off == 0 && c->hs == HS_DONE &&
		    c->rx_done > c->ack_sent) {
			ctl_queue(c, RW_TCP_ACK, 0, 0, c->rx_done, NULL);
			c->ack_sent = c->rx_done;
		}
		if (c->ctl_off < c->ctl_len) {
			iov[n].iov_base = c->ctl + c->ctl_off;
			iov[n].iov_len = c->ctl_len - c->ctl_off;
			total += iov[n++].iov_len;
		}
		/* Write-frame bytes allowed now. Paced: a send starts only with pace_wake bytes in
		 * the bucket (no slivers) and, while others wait, only in this connection's turn
		 * (FIFO: the connections of a rail share it fairly); then it may use the bucket. */
		size_t allow = SIZE_MAX;
		if (dev->pace_Bps > 0 && c->tx_sent < c->tx_posted) {
			if (!pace_granted && !(dev->pace_head && !c->pace_turn) &&
			    dev->pace_tokens >= dev->pace_wake)
				pace_granted = 1;
			allow = pace_granted && dev->pace_tokens >= 1. ? (size_t)dev->pace_tokens : 0;
			if (allow == 0)
				pace_blocked = 1;
		}
		/* An ACK waiting behind a half-sent write goes right after that write. */
		int stop_after_first = c->tx_off > 0 && c->rx_done > c->ack_sent;
		uint64_t off = c->tx_off;
		size_t data = 0;
		for (uint64_t k = c->tx_sent; k < c->tx_posted && n + 2 <= TCP_IOV_MAX && data < allow;
		     k++) {
			tx_entry_t *e = &c->ring[k & c->ring_mask];
			if (off < RW_TCP_HDR_SIZE) {
				iov[n].iov_base = e->hdr + off;
				iov[n].iov_len = RW_MIN((size_t)(RW_TCP_HDR_SIZE - off), allow - data);
				data += iov[n].iov_len;
				off += iov[n].iov_len;
				total += iov[n++].iov_len;
				if (off < RW_TCP_HDR_SIZE)
					break; /* allowance ends inside the header */
			}
			uint64_t done = off - RW_TCP_HDR_SIZE;
			if (done < e->length && data < allow) {
				iov[n].iov_base = (uint8_t *)e->local->addr + e->local_offset + done;
				iov[n].iov_len = (size_t)RW_MIN(e->length - done, (uint64_t)(allow - data));
				data += iov[n].iov_len;
				total += iov[n++].iov_len;
			}
			off = 0;
			if (stop_after_first || total >= budget)
				break;
		}
		if (n == 0)
			break;
		struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
		ssize_t sent = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (sent < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK) {
				sock_full = 1;
				break;
			}
			rw_err("rail %u peer %s: send: %m", c->dev->base.rail, c->base.peer);
			conn_fail(c, RW_ERR_PEER);
			return -1;
		}
		size_t left = (size_t)sent;
		budget = left >= budget ? 0 : budget - left;
		dev->base.stats.tx_bytes += (uint64_t)sent;
		if (dev->pace_Bps > 0)
			dev->pace_tokens -= (double)sent;
		if (c->ctl_off < c->ctl_len) {
			size_t take = RW_MIN(left, (size_t)(c->ctl_len - c->ctl_off));
			c->ctl_off += (uint32_t)take;
			left -= take;
		}
		while (left > 0) {
			tx_entry_t *e = &c->ring[c->tx_sent & c->ring_mask];
			uint64_t frame = RW_TCP_HDR_SIZE + e->length;
			uint64_t take = RW_MIN((uint64_t)left, frame - c->tx_off);
			c->tx_off += take;
			left -= take;
			if (c->tx_off == frame) {
				c->tx_sent++;
				c->tx_off = 0;
			}
		}
		if ((size_t)sent < total) {
			sock_full = 1;
			break; /* socket buffer full */
		}
	}
	struct ev_loop *loop = c->dev->base.loop;
	if (pace_blocked && !sock_full && c->ctl_off >= c->ctl_len && c->tx_sent < c->tx_posted) {
		ev_io_stop(loop, &c->wio); /* the pacing timer resumes us, not the socket */
		pace_enqueue(c);
	} else if (tx_pending(c)) {
		ev_io_start(loop, &c->wio);
	} else {
		ev_io_stop(loop, &c->wio);
	}
	return 0;
}

/* The pacing timer: refill, then give each connection that was waiting one turn, in FIFO
 * order, while the bucket holds pace_wake bytes; whoever is still short goes to the back of
 * the queue. */
static void pace_timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	tcp_dev_t *dev = w->data;
	pace_refill(dev);
	for (size_t k = 0, n = dev->pace_n; k < n && dev->pace_head &&
	     dev->pace_tokens >= dev->pace_wake; k++) {
		tcp_conn_t *c = dev->pace_head;
		pace_unlink(c);
		cb_enter(c);
		c->pace_turn = 1;
		tx_flush(c); /* may fail the connection (callbacks) or queue it again */
		c->pace_turn = 0;
		cb_leave(c);
	}
	if (dev->pace_head)
		pace_arm(dev);
}

/* The handshake is done: allocate the write queue (only now, so that unauthenticated sockets
 * cost little) and tell the user. Returns -1 when the connection failed. */
static int announce_up(tcp_conn_t *c)
{
	uint64_t ring_size = 1;
	while (ring_size < c->dev->base.max_writes)
		ring_size <<= 1;
	c->ring = calloc(ring_size, sizeof(*c->ring));
	if (!c->ring) {
		rw_err("rail %u peer %s: out of memory for the write queue", c->dev->base.rail,
		       c->base.peer);
		conn_fail(c, RW_ERR_NOMEM);
		return -1;
	}
	c->ring_mask = ring_size - 1;
	conn_unpend(c);
	ev_timer_stop(c->dev->base.loop, &c->timer);
	c->hs = HS_DONE;
	c->base.state = RW_RAIL_CONN_UP;
	c->user_known = 1;
	if (c->base.cbs.on_connected)
		c->base.cbs.on_connected(&c->base, c->base.ctx);
	return 0;
}

static void wio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	tcp_conn_t *c = w->data;
	cb_enter(c);
	if (c->hs == HS_CONNECTING) {
		int err = 0;
		socklen_t len = sizeof(err);
		if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
			err = errno;
		if (err) {
			errno = err;
			rw_err("rail %u peer %s: connect: %m", c->dev->base.rail, c->base.peer);
			conn_fail(c, RW_ERR_PEER);
			goto out;
		}
		ctl_queue(c, RW_TCP_HELLO, c->base.tag, c->dev->base.rail, 0, c->base.proof);
		c->hs = HS_WAIT_HELLO_ACK;
		ev_io_start(loop, &c->rio);
	}
	tx_flush(c);
out:
	cb_leave(c);
}

/* ---- receiving -------------------------------------------------------------------------- */

static void proto_fail(tcp_conn_t *c, const char *why, const rw_tcp_hdr_t *h)
{
	if (h)
		rw_err("rail %u peer %s: protocol violation: %s (type %u key %#llx offset %llu "
		       "length %llu seq %llu); dropping connection", c->dev->base.rail, c->base.peer,
		       why, h->type, (unsigned long long)h->key, (unsigned long long)h->offset,
		       (unsigned long long)h->length, (unsigned long long)h->seq);
	else
		rw_err("rail %u peer %s: protocol violation: %s; dropping connection",
		       c->dev->base.rail, c->base.peer, why);
	conn_fail(c, RW_ERR_PROTO);
}


static void arrival(tcp_conn_t *c)
{
	rw_rail_arrival_t a = {.region = c->rx_region, .offset = c->rx_cur.offset,
			       .length = c->rx_cur.length, .imm = c->rx_cur.imm};
	c->rx_in_payload = 0;
	c->rx_region = NULL;
	c->rx_done++;
	if (c->base.cbs.on_arrival)
		c->base.cbs.on_arrival(&c->base, c->base.ctx, &a);
}

/* Handle one complete header in rx_hdr. Returns 0 to go on, -1 when the conn failed/closed. */
static int rx_frame(tcp_conn_t *c)
{
	rw_tcp_hdr_t h;
	c->rx_hdr_have = 0;
	if (rw_tcp_hdr_decode(c->rx_hdr, &h) != 0) {
		proto_fail(c, "bad magic, version or frame type", NULL);
		return -1;
	}
	switch (h.type) {
	case RW_TCP_HELLO:
		if (c->hs != HS_WAIT_HELLO) {
			proto_fail(c, "unexpected HELLO", &h);
			return -1;
		}
		if (h.offset != c->dev->base.rail) {
			proto_fail(c, "peer is on another rail", &h);
			return -1;
		}
		c->base.tag = h.key;
		uint8_t reply[RW_RAIL_PROOF_SIZE] = {0};
		/* The user's check comes before anything of this connection is taken in: a
		 * refused one is closed unannounced, and no region sees a byte of it. */
		if (c->base.cbs.on_verify &&
		    c->base.cbs.on_verify(&c->base, c->base.ctx, h.proof, reply) != 0) {
			log_refused(c, "no valid proof");
			conn_fail(c, RW_ERR_PROTO);
			return -1;
		}
		ctl_queue(c, RW_TCP_HELLO_ACK, 0, c->dev->base.rail, 0, reply);
		if (tx_flush(c) < 0)
			return -1;
		if (announce_up(c) < 0)
			return -1;
		return c->closed || c->base.state != RW_RAIL_CONN_UP ? -1 : 0;
	case RW_TCP_HELLO_ACK:
		if (c->hs != HS_WAIT_HELLO_ACK || h.offset != c->dev->base.rail) {
			proto_fail(c, "unexpected HELLO_ACK", &h);
			return -1;
		}
		if (c->base.cbs.on_verify &&
		    c->base.cbs.on_verify(&c->base, c->base.ctx, h.proof, NULL) != 0) {
			proto_fail(c, "the acceptor's proof is not valid", &h);
			return -1;
		}
		if (announce_up(c) < 0)
			return -1;
		return c->closed || c->base.state != RW_RAIL_CONN_UP ? -1 : 0;
	case RW_TCP_WRITE: {
		if (c->hs != HS_DONE) {
			proto_fail(c, "WRITE before handshake", &h);
			return -1;
		}
		rw_rail_region_t *r = region_find(c->dev, h.key);
		if (!r) {
			proto_fail(c, "unknown region key", &h);
			return -1;
		}
		if (h.length > TCP_MAX_WRITE_LENGTH ||
		    rw_rail_range_check(r->length, h.offset, h.length) != RW_OK) {
			proto_fail(c, "range outside the region", &h);
			return -1;
		}
		if (h.seq != c->rx_done + 1) {
			proto_fail(c, "out-of-order sequence number", &h);
			return -1;
		}
		c->rx_cur = h;
		c->rx_region = r;
		c->rx_have = 0;
		c->rx_in_payload = 1;
		if (h.length == 0) {
			arrival(c);
			return c->closed || c->base.state != RW_RAIL_CONN_UP ? -1 : 0;
		}
		return 0;
	}
	case RW_TCP_ACK: {
		if (c->hs != HS_DONE || h.seq < c->tx_acked || h.seq > c->tx_sent) {
			proto_fail(c, "ACK for writes never sent", &h);
			return -1;
		}
		while (c->tx_acked < h.seq) {
			tx_entry_t *e = &c->ring[c->tx_acked & c->ring_mask];
			c->tx_acked++;
			if (c->base.cbs.on_write_done)
				c->base.cbs.on_write_done(&c->base, c->base.ctx, e->ctx, RW_OK);
			if (c->closed || c->base.state != RW_RAIL_CONN_UP)
				return -1;
		}
		if (c->want_writable && c->tx_posted - c->tx_acked < c->dev->base.max_writes) {
			c->want_writable = 0;
			if (c->base.cbs.on_writable)
				c->base.cbs.on_writable(&c->base, c->base.ctx);
			if (c->closed || c->base.state != RW_RAIL_CONN_UP)
				return -1;
		}
		return 0;
	}
	}
	return 0;
}

static void rio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	tcp_conn_t *c = w->data;
	size_t budget = TCP_IO_BUDGET;
	cb_enter(c);
	while (budget > 0 && c->fd >= 0) {
		struct iovec iov[2];
		int n = 0;
		if (c->rx_in_payload) {
			/* Payload straight into the region; the next header rides along. */
			iov[n].iov_base = (uint8_t *)c->rx_region->addr + c->rx_cur.offset + c->rx_have;
			iov[n++].iov_len = c->rx_cur.length - c->rx_have;
		}
		iov[n].iov_base = c->rx_hdr + c->rx_hdr_have;
		iov[n++].iov_len = RW_TCP_HDR_SIZE - c->rx_hdr_have;
		ssize_t got = readv(c->fd, iov, n);
		if (got < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK)
				break;
			rw_err("rail %u peer %s: receive: %m", c->dev->base.rail, c->base.peer);
			conn_fail(c, RW_ERR_PEER);
			goto out;
		}
		if (got == 0) {
			if (c->user_known)
				rw_warn("rail %u peer %s: connection closed by peer%s", c->dev->base.rail,
					c->base.peer,
					c->rx_in_payload || c->rx_hdr_have ? " mid-frame" : "");
			conn_fail(c, RW_ERR_PEER);
			goto out;
		}
		size_t left = (size_t)got;
		budget = left >= budget ? 0 : budget - left;
		if (c->rx_in_payload) {
			size_t take = RW_MIN(left, (size_t)(c->rx_cur.length - c->rx_have));
			c->rx_have += take;
			left -= take;
			if (c->rx_have == c->rx_cur.length) {
				arrival(c);
				if (c->closed || c->base.state != RW_RAIL_CONN_UP)
					goto out;
			}
		}
		c->rx_hdr_have += (uint32_t)left;
		if (c->rx_hdr_have == RW_TCP_HDR_SIZE && rx_frame(c) < 0)
			goto out;
	}
	if (c->hs == HS_DONE && c->rx_done > c->ack_sent && c->fd >= 0)
		tx_flush(c); /* the batched ACK for everything that landed in this wake-up */
out:
	cb_leave(c);
}

/* ---- listener --------------------------------------------------------------------------- */

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
		if (dev->n_pending >= TCP_PENDING_MAX) { /* strangers get a bounded budget */
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
		dev->n_pending++;
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
	c->tx_posted++;
	if (!c->pace_waiting) /* a waiting connection is resumed by the pacing timer */
		ev_io_start(c->dev->base.loop, &c->wio); /* sent from the loop: no callbacks here */
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
	if (dev->nregions == dev->cap_regions) {
		size_t cap = dev->cap_regions ? 2 * dev->cap_regions : 16;
		rw_rail_region_t **grown = realloc(dev->regions, cap * sizeof(*grown));
		if (!grown)
			return RW_ERR_NOMEM;
		dev->regions = grown;
		dev->cap_regions = cap;
	}
	rw_rail_region_t *r = calloc(1, sizeof(*r));
	if (!r)
		return RW_ERR_NOMEM;
	r->dev = base;
	r->addr = addr;
	r->length = length;
	/* Salted per device so that a stale or foreign key is very unlikely to name a live one. */
	r->key = ((uint64_t)dev->key_salt << 32) | ++dev->key_counter;
	r->base = 0;
	dev->regions[dev->nregions++] = r;
	*region_p = r;
	return RW_OK;
}

static rw_status_t tcp_reg_dmabuf(rw_rail_dev_t *dev, int fd, uint64_t fd_offset,
				  uint64_t length, uint64_t iova, rw_rail_region_t **region_p)
{
	(void)dev, (void)fd, (void)fd_offset, (void)length, (void)iova, (void)region_p;
	return RW_ERR_UNSUPPORTED; /* sockets need a CPU mapping: stage through host memory */
}

static void tcp_dereg(rw_rail_region_t *r)
{
	tcp_dev_t *dev = (tcp_dev_t *)r->dev;
	for (size_t i = 0; i < dev->nregions; i++) {
		if (dev->regions[i] == r) {
			dev->regions[i] = dev->regions[--dev->nregions];
			break;
		}
	}
	/* A peer's write still landing in it: stop receiving and fail that connection. */
	for (tcp_conn_t *c = dev->conns; c; c = c->next) {
		if (c->rx_in_payload && c->rx_region == r) {
			rw_err("rail %u peer %s: region %#llx deregistered while a write was landing",
			       dev->base.rail, c->base.peer, (unsigned long long)r->key);
			c->rx_in_payload = 0;
			c->rx_region = NULL;
			conn_fail_later(c, RW_ERR_PROTO);
		}
	}
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
	ev_timer_init(&dev->pace_timer, pace_timer_cb, 0., 0.);
	dev->pace_timer.data = dev;
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
		conn_destroy(dev->conns);
	ev_timer_stop(base->loop, &dev->pace_timer);
	for (size_t i = 0; i < dev->nregions; i++)
		free(dev->regions[i]);
	free(dev->regions);
	free(dev);
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
};
