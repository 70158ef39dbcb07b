/* The `tcp` rail transport's data path: once a connection's handshake is done (tcp.c), two
 * threads of its own move its bytes with blocking system calls on its socket.
 *
 *  - The sender takes the queued writes (the loop's ring) and hands header + payload iovecs of
 *    up to TCP_BATCH_BYTES of whole frames to one blocking sendmsg, straight from the registered
 *    regions; it puts an ACK for the arrivals the loop has reported in front of each batch.
 *  - The receiver reads a 64-byte header (validated as untrusted input), then the payload with
 *    one blocking recv straight into the region, and notes it in the arrival ring; an ACK from
 *    the peer advances peer_acked.
 *  - Both hand their news to the loop: the connection goes on the device's FIFO and the device's
 *    ev_async fires; tcp.c (which this file never calls) reports arrivals, completions and
 *    failures from the loop, in order, as rdma/rail.h promises. The loop's reporting of arrivals is what lets the next
 *    ACK go out, so on_write_done(RW_OK) still means "in the remote region".
 *
 * Pacing (pace_bps) is one token bucket per device shared by its senders: a sender queues for
 * its turn (FIFO, so the connections of a rail share it round robin), the head of the queue
 * sleeps until half the bucket has refilled, takes what the bucket holds (up to what it wants to
 * send), and goes to the back of the queue for the rest of its frame. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "rdma/tcp_priv.h"

#define TCP_IOV_MAX 64
/* Bytes of whole write frames per sendmsg (at least one frame): an ACK owed to the peer waits
 * at most this long behind our own data (the wire puts ACKs between whole frames). */
#define TCP_BATCH_BYTES (4u << 20)
#define TCP_THREAD_STACK (256u << 10)
/* A payload's last bytes (up to this many) are read together with whatever of the next header
 * is already there: a stream of writes costs one or two receive calls per write, not three. */
#define TCP_RX_TAIL (64u << 10)

/* ---- hand-back to the loop -------------------------------------------------------------- */

static void news_post(tcp_conn_t *c)
{
	tcp_dev_t *dev = c->dev;
	pthread_mutex_lock(&dev->mu);
	if (!c->news_queued) {
		c->news_queued = 1;
		c->news_next = NULL;
		if (dev->news_tail)
			dev->news_tail->news_next = c;
		else
			dev->news_head = c;
		dev->news_tail = c;
	}
	pthread_mutex_unlock(&dev->mu);
	ev_async_send(dev->base.loop, &dev->news);
}

tcp_conn_t *tcp_io_news_pop(tcp_dev_t *dev)
{
	pthread_mutex_lock(&dev->mu);
	tcp_conn_t *c = dev->news_head;
	if (c) {
		dev->news_head = c->news_next;
		if (!dev->news_head)
			dev->news_tail = NULL;
		c->news_queued = 0;
		c->news_next = NULL;
	}
	pthread_mutex_unlock(&dev->mu);
	return c;
}

static void news_unlink(tcp_conn_t *c)
{
	tcp_dev_t *dev = c->dev;
	pthread_mutex_lock(&dev->mu);
	if (c->news_queued) {
		tcp_conn_t **pp = &dev->news_head, *prev = NULL;
		while (*pp != c) {
			prev = *pp;
			pp = &(*pp)->news_next;
		}
		*pp = c->news_next;
		if (dev->news_tail == c)
			dev->news_tail = prev;
		c->news_queued = 0;
	}
	pthread_mutex_unlock(&dev->mu);
}

void tcp_stats_sync(tcp_dev_t *dev)
{
	dev->base.stats.tx_bytes = atomic_load(&dev->tx_bytes);
	dev->base.stats.pace_waits = atomic_load(&dev->pace_waits);
}

/* A thread's failure: the first one wins and is logged (not while stopping: that is ours);
 * the socket is shut so the other thread leaves its system call too; the loop reports it. */
static void thread_fail(tcp_conn_t *c, rw_status_t st, const char *what, int err)
{
	int first = 0;
	pthread_mutex_lock(&c->mu);
	if (c->err == RW_OK && !atomic_load(&c->stop)) {
		c->err = st;
		first = 1;
	}
	pthread_mutex_unlock(&c->mu);
	if (first && what) {
		errno = err;
		if (err)
			rw_err("rail %u peer %s: %s: %m", c->dev->base.rail, c->base.peer, what);
		else
			rw_warn("rail %u peer %s: %s", c->dev->base.rail, c->base.peer, what);
	}
	shutdown(c->fd, SHUT_RDWR);
	news_post(c);
}

static void proto_fail(tcp_conn_t *c, const char *why, const rw_tcp_hdr_t *h)
{
	if (atomic_load(&c->stop))
		return;
	if (h)
		rw_err("rail %u peer %s: protocol violation: %s (type %u key %#llx offset %llu "
		       "length %llu seq %llu); dropping connection", c->dev->base.rail, c->base.peer,
		       why, h->type, (unsigned long long)h->key, (unsigned long long)h->offset,
		       (unsigned long long)h->length, (unsigned long long)h->seq);
	else
		rw_err("rail %u peer %s: protocol violation: %s; dropping connection",
		       c->dev->base.rail, c->base.peer, why);
	thread_fail(c, RW_ERR_PROTO, NULL, 0);
}

void tcp_io_fail(tcp_conn_t *c, rw_status_t st)
{
	pthread_mutex_lock(&c->mu);
	if (c->err == RW_OK)
		c->err = st;
	pthread_mutex_unlock(&c->mu);
	shutdown(c->fd, SHUT_RDWR);
	news_post(c);
}

/* ---- rate pacing ------------------------------------------------------------------------ */

/* cap: an idle link saves up at most a small burst; a waiting sender is credited the time a
 * late wake-up lost, up to pace_backlog (a real NIC keeps draining its queue meanwhile). */
static void pace_refill(tcp_dev_t *dev, double cap)
{
	uint64_t now = rw_now_ns();
	dev->pace_tokens += (double)(now - dev->pace_last_ns) * 1e-9 * dev->pace_Bps;
	if (dev->pace_tokens > cap)
		dev->pace_tokens = cap;
	dev->pace_last_ns = now;
}

void tcp_pace_charge(tcp_dev_t *dev, size_t bytes)
{
	if (dev->pace_Bps <= 0 || bytes == 0)
		return;
	pthread_mutex_lock(&dev->pace_mu);
	dev->pace_tokens -= (double)bytes;
	pthread_mutex_unlock(&dev->pace_mu);
}

/* Wait for this sender's turn and for half a bucket; take up to want bytes. 0 = stopping. */
static size_t pace_take(tcp_conn_t *c, size_t want)
{
	tcp_dev_t *dev = c->dev;
	size_t grant = 0;
	int waited = 0;
	pthread_mutex_lock(&dev->pace_mu);
	c->pace_next = NULL;
	if (dev->pace_tail)
		dev->pace_tail->pace_next = c;
	else
		dev->pace_head = c;
	dev->pace_tail = c;
	while (!atomic_load(&c->stop)) {
		if (dev->pace_head != c) {
			waited = 1;
			pthread_cond_wait(&dev->pace_cv, &dev->pace_mu);
			continue;
		}
		pace_refill(dev, waited ? dev->pace_backlog : dev->pace_burst);
		if (dev->pace_tokens >= dev->pace_wake) {
			grant = RW_MIN(want, (size_t)dev->pace_tokens);
			dev->pace_tokens -= (double)grant;
			break;
		}
		waited = 1;
		uint64_t ns = (uint64_t)((dev->pace_wake - dev->pace_tokens) / dev->pace_Bps * 1e9) + 1;
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		ns += (uint64_t)ts.tv_nsec;
		ts.tv_sec += (time_t)(ns / 1000000000u);
		ts.tv_nsec = (long)(ns % 1000000000u);
		pthread_cond_timedwait(&dev->pace_cv, &dev->pace_mu, &ts);
	}
	tcp_conn_t **pp = &dev->pace_head, *prev = NULL;
	while (*pp != c) {
		prev = *pp;
		pp = &(*pp)->pace_next;
	}
	*pp = c->pace_next;
	if (dev->pace_tail == c)
		dev->pace_tail = prev;
	pthread_cond_broadcast(&dev->pace_cv); /* the next head takes over */
	pthread_mutex_unlock(&dev->pace_mu);
	if (waited)
		atomic_fetch_add(&dev->pace_waits, 1);
	return grant;
}

/* ---- sender ----------------------------------------------------------------------------- */

/* Send exactly len bytes from iov[*at..n) with blocking sendmsg; sent iovecs are advanced in
 * place. Returns 0, or -1 with errno. */
static int send_exact(int fd, struct iovec *iov, int n, int *at, size_t len)
{
	while (len > 0) {
		int end = *at;
		size_t sum = 0;
		while (end < n && sum + iov[end].iov_len <= len)
			sum += iov[end++].iov_len;
		size_t saved = 0;
		int cut = end < n && sum < len;
		if (cut) { /* the allowance ends inside iov[end] */
			saved = iov[end].iov_len;
			iov[end++].iov_len = len - sum;
		}
		struct msghdr msg = {.msg_iov = iov + *at, .msg_iovlen = (size_t)(end - *at)};
		ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
		if (cut)
			iov[end - 1].iov_len = saved;
		if (sent < 0 && errno == EINTR)
			continue;
		if (sent <= 0) {
			if (sent == 0)
				errno = EPIPE;
			return -1;
		}
		len -= (size_t)sent;
		for (size_t left = (size_t)sent; left > 0;) {
			struct iovec *v = &iov[*at];
			size_t take = RW_MIN(left, v->iov_len);
			v->iov_base = (uint8_t *)v->iov_base + take;
			v->iov_len -= take;
			left -= take;
			if (v->iov_len == 0)
				(*at)++;
		}
	}
	return 0;
}

static void *sender_main(void *arg)
{
	tcp_conn_t *c = arg;
	tcp_dev_t *dev = c->dev;
	const int paced = dev->pace_Bps > 0;
	uint8_t ctl[RW_TCP_HDR_SIZE];
	uint8_t hdrs[TCP_IOV_MAX / 2][RW_TCP_HDR_SIZE]; /* our copies: the ring slot may be reused
							  * once the peer ACKed, before we return */
	for (;;) {
		struct iovec iov[TCP_IOV_MAX];
		int n = 0, at = 0;
		size_t ctl_bytes = 0, data = 0;
		pthread_mutex_lock(&c->mu);
		while (!atomic_load(&c->stop) && c->ctl_off >= c->ctl_len &&
		       c->tx_sent == c->tx_posted && c->rx_done == c->ack_sent) {
			c->tx_idle = 1;
			pthread_cond_wait(&c->tx_cv, &c->mu);
			c->tx_idle = 0;
		}
		if (atomic_load(&c->stop)) {
			pthread_mutex_unlock(&c->mu);
			break;
		}
		uint64_t ack_to = c->ack_sent;
		if (c->ctl_off < c->ctl_len) { /* the handshake's HELLO_ACK, not wholly sent */
			memcpy(ctl, c->ctl + c->ctl_off, c->ctl_len - c->ctl_off);
			iov[n].iov_base = ctl;
			ctl_bytes = iov[n++].iov_len = c->ctl_len - c->ctl_off;
			c->ctl_off = c->ctl_len; /* an ACK, if owed, goes in the next round */
		} else if (c->rx_done > c->ack_sent) {
			rw_tcp_hdr_t h = {.type = RW_TCP_ACK, .seq = c->rx_done};
			rw_tcp_hdr_encode(&h, ctl);
			iov[n].iov_base = ctl;
			ctl_bytes = iov[n++].iov_len = RW_TCP_HDR_SIZE;
			ack_to = c->rx_done;
		}
		uint64_t k = c->tx_sent;
		uint64_t kmax = paced ? k + 1 : c->tx_posted; /* paced: frame by frame, ACKs between */
		for (int f = 0; k < c->tx_posted && k < kmax && n + 2 <= TCP_IOV_MAX &&
		     f < (int)RW_ARRAY_SIZE(hdrs) &&
		     (f == 0 || data < TCP_BATCH_BYTES); k++, f++) {
			const tx_entry_t *e = &c->ring[k & c->ring_mask];
			memcpy(hdrs[f], e->hdr, RW_TCP_HDR_SIZE);
			iov[n].iov_base = hdrs[f];
			iov[n++].iov_len = RW_TCP_HDR_SIZE;
			if (e->length) {
				iov[n].iov_base = (uint8_t *)e->local->addr + e->local_offset;
				iov[n++].iov_len = e->length;
			}
			data += RW_TCP_HDR_SIZE + e->length;
		}
		c->tx_sending = k; /* the peer may ACK any of these before sendmsg returns */
		pthread_mutex_unlock(&c->mu);

		/* Counted before the bytes go: the peer's ACK, whose report syncs the loop's copy,
		 * cannot come before them. */
		atomic_fetch_add(&dev->tx_bytes, ctl_bytes + data);
		int rc = 0;
		if (paced) {
			tcp_pace_charge(dev, ctl_bytes); /* control frames are charged, not held */
			rc = send_exact(c->fd, iov, n, &at, ctl_bytes);
			for (size_t left = data; rc == 0 && left > 0;) {
				size_t grant = pace_take(c, left);
				if (grant == 0)
					goto out; /* stopping */
				rc = send_exact(c->fd, iov, n, &at, grant);
				left -= grant;
			}
		} else {
			rc = send_exact(c->fd, iov, n, &at, ctl_bytes + data);
		}
		if (rc != 0) {
			thread_fail(c, RW_ERR_PEER, "send", errno);
			break;
		}
		pthread_mutex_lock(&c->mu);
		c->tx_sent = k;
		c->ack_sent = ack_to;
		pthread_mutex_unlock(&c->mu);
	}
out:
	return NULL;
}

/* ---- receiver --------------------------------------------------------------------------- */

/* Receive exactly len bytes (blocking). 1 = done, 0 = the peer closed first, -1 = error. */
static int recv_exact(int fd, void *buf, size_t len)
{
	uint8_t *p = buf;
	while (len > 0) {
		ssize_t got = recv(fd, p, len, MSG_WAITALL);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			return got == 0 ? 0 : -1;
		p += got;
		len -= (size_t)got;
	}
	return 1;
}

static void rx_lost(tcp_conn_t *c, int rc, int mid_frame)
{
	if (rc < 0)
		thread_fail(c, RW_ERR_PEER, "receive", errno);
	else
		thread_fail(c, RW_ERR_PEER, mid_frame ? "connection closed by peer mid-frame"
						      : "connection closed by peer", 0);
}

/* Receive a payload of len bytes into dst: all but its tail with one blocking MSG_WAITALL
 * receive, the tail with readv into [tail, next header], which returns as soon as the tail is
 * complete (it never waits for the next header) and keeps what came of that header in
 * next[0..*have_p). 1 = done, 0 = the peer closed first, -1 = error. */
static int recv_payload(int fd, uint8_t *dst, uint64_t len, uint8_t next[RW_TCP_HDR_SIZE],
			uint32_t *have_p)
{
	uint64_t tail = RW_MIN(len, (uint64_t)TCP_RX_TAIL), got = 0;
	if (len > tail) {
		int rc = recv_exact(fd, dst, len - tail);
		if (rc <= 0)
			return rc;
	}
	while (got < tail) {
		struct iovec iov[2] = {{dst + len - tail + got, tail - got},
				       {next, RW_TCP_HDR_SIZE}};
		ssize_t n = readv(fd, iov, 2);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n == 0 ? 0 : -1;
		if ((uint64_t)n > tail - got)
			*have_p = (uint32_t)((uint64_t)n - (tail - got));
		got = RW_MIN(tail, got + (uint64_t)n);
	}
	return 1;
}

/* One WRITE frame whose header is valid so far: find its region, wait for room in the
 * arrival ring, receive the payload into place (and maybe the start of the next header into
 * next), note the arrival. Returns 0 or -1 (failed). */
static int rx_write(tcp_conn_t *c, const rw_tcp_hdr_t *h, uint8_t next[RW_TCP_HDR_SIZE],
		    uint32_t *have_p)
{
	tcp_dev_t *dev = c->dev;
	pthread_mutex_lock(&c->mu);
	while (!atomic_load(&c->stop) && c->rx_landed - c->rx_done > c->ring_mask) {
		c->rx_full = 1;
		pthread_cond_wait(&c->rx_cv, &c->mu);
		c->rx_full = 0;
	}
	uint64_t landed = c->rx_landed;
	pthread_mutex_unlock(&c->mu);
	if (atomic_load(&c->stop))
		return -1;
	pthread_mutex_lock(&dev->reg_mu);
	rw_rail_region_t *r = tcp_region_find(dev, h->key);
	const char *bad = NULL;
	if (!r)
		bad = "unknown region key";
	else if (h->length > TCP_MAX_WRITE_LENGTH ||
		 rw_rail_range_check(r->length, h->offset, h->length) != RW_OK)
		bad = "range outside the region";
	else if (h->seq != landed + 1)
		bad = "out-of-order sequence number";
	else
		c->rx_busy = r; /* dereg waits for us to leave it */
	pthread_mutex_unlock(&dev->reg_mu);
	if (bad) {
		proto_fail(c, bad, h);
		return -1;
	}
	int rc = 1;
	if (h->length)
		rc = recv_payload(c->fd, (uint8_t *)r->addr + h->offset, h->length, next, have_p);
	pthread_mutex_lock(&dev->reg_mu);
	c->rx_busy = NULL;
	if (rc > 0) { /* under reg_mu: dereg sees either the receive or the arrival */
		pthread_mutex_lock(&c->mu);
		c->arrivals[landed & c->ring_mask] = (rx_entry_t){
			.region = r, .offset = h->offset, .length = h->length, .imm = h->imm};
		c->rx_landed = landed + 1;
		pthread_mutex_unlock(&c->mu);
	}
	pthread_cond_broadcast(&dev->reg_cv);
	pthread_mutex_unlock(&dev->reg_mu);
	if (rc <= 0) {
		rx_lost(c, rc, 1);
		return -1;
	}
	news_post(c);
	return 0;
}

static void *receiver_main(void *arg)
{
	tcp_conn_t *c = arg;
	uint8_t raw[RW_TCP_HDR_SIZE];
	uint32_t have = 0; /* bytes of raw that came with the previous payload */
	for (;;) {
		int rc = have < sizeof(raw) ? recv_exact(c->fd, raw + have, sizeof(raw) - have) : 1;
		if (rc <= 0) {
			rx_lost(c, rc, have > 0);
			break;
		}
		have = 0;
		rw_tcp_hdr_t h;
		if (rw_tcp_hdr_decode(raw, &h) != 0) {
			proto_fail(c, "bad magic, version or frame type", NULL);
			break;
		}
		if (h.type == RW_TCP_WRITE) {
			if (rx_write(c, &h, raw, &have) < 0)
				break;
			continue;
		}
		if (h.type != RW_TCP_ACK) {
			proto_fail(c, h.type == RW_TCP_HELLO ? "unexpected HELLO"
							     : "unexpected HELLO_ACK", &h);
			break;
		}
		pthread_mutex_lock(&c->mu);
		int ok = h.seq >= c->peer_acked && h.seq <= c->tx_sending;
		if (ok)
			c->peer_acked = h.seq;
		pthread_mutex_unlock(&c->mu);
		if (!ok) {
			proto_fail(c, "ACK for writes never sent", &h);
			break;
		}
		news_post(c);
	}
	return NULL;
}

/* ---- the loop's side -------------------------------------------------------------------- */

rw_status_t tcp_io_start(tcp_conn_t *c)
{
	uint64_t ring_size = 1;
	while (ring_size < c->dev->base.max_writes)
		ring_size <<= 1;
	c->ring = calloc(ring_size, sizeof(*c->ring));
	c->arrivals = calloc(ring_size, sizeof(*c->arrivals));
	if (!c->ring || !c->arrivals)
		return RW_ERR_NOMEM;
	c->ring_mask = ring_size - 1;
	c->rx_cut = UINT64_MAX;
	int flags = fcntl(c->fd, F_GETFL);
	if (flags < 0 || fcntl(c->fd, F_SETFL, flags & ~O_NONBLOCK) < 0)
		return RW_ERR_SYS;
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, TCP_THREAD_STACK);
	int rc = pthread_create(&c->sender, &attr, sender_main, c);
	if (rc == 0) {
		rc = pthread_create(&c->receiver, &attr, receiver_main, c);
		if (rc != 0) {
			atomic_store(&c->stop, 1);
			pthread_mutex_lock(&c->mu);
			pthread_cond_signal(&c->tx_cv);
			pthread_mutex_unlock(&c->mu);
			pthread_join(c->sender, NULL);
		}
	}
	pthread_attr_destroy(&attr);
	if (rc != 0) {
		errno = rc;
		rw_err("rail %u peer %s: cannot start the connection's threads: %m",
		       c->dev->base.rail, c->base.peer);
		return rc == EAGAIN ? RW_ERR_NOMEM : RW_ERR_SYS;
	}
	c->threads = 1;
	if (c->dev->n_threaded++ == 0)
		ev_ref(c->dev->base.loop); /* the device's ev_async keeps the loop running */
	return RW_OK;
}

void tcp_io_stop(tcp_conn_t *c)
{
	if (!c->threads)
		return;
	tcp_dev_t *dev = c->dev;
	pthread_mutex_lock(&c->mu);
	atomic_store(&c->stop, 1);
	pthread_cond_signal(&c->tx_cv);
	pthread_cond_signal(&c->rx_cv);
	pthread_mutex_unlock(&c->mu);
	pthread_mutex_lock(&dev->pace_mu);
	pthread_cond_broadcast(&dev->pace_cv);
	pthread_mutex_unlock(&dev->pace_mu);
	shutdown(c->fd, SHUT_RDWR); /* blocking send/recv return now */
	pthread_join(c->sender, NULL);
	pthread_join(c->receiver, NULL);
	c->threads = 0;
	news_unlink(c);
	if (--dev->n_threaded == 0)
		ev_unref(dev->base.loop);
}

void tcp_io_post(tcp_conn_t *c)
{
	pthread_mutex_lock(&c->mu);
	c->tx_posted++;
	if (c->tx_idle)
		pthread_cond_signal(&c->tx_cv);
	pthread_mutex_unlock(&c->mu);
}
