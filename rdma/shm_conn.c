/* The `shm` rail transport's connections, on the loop: their lifetime, the handshake (the
 * proofs, then each side's outbox), the control messages (region fds asked for and given,
 * dropped regions, doorbells), and the delivery of arrivals (we are the target) and completions
 * (we are the writer). shm.c (devices, regions, listeners, the vtable) calls this file, which
 * calls only shm_copy.c (the copier threads). rdma/shm_priv.h names the shared memory's
 * acquire/release pairs. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fdpass.h"
#include "rdma/shm_priv.h"

#define SHM_HANDSHAKE_TIMEOUT_S 10.0
#define SHM_REFUSED_LOG_NS 1000000000ull
#define SHM_MSG_BUDGET 256        /* control messages read per wake-up before others run */
#define SHM_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* ---- messages and shared memory ------------------------------------------------------------ */

int shm_msg_send(int sock, const shm_msg_t *m, int fd)
{
	uint8_t raw[SHM_MSG_SIZE];
	shm_msg_encode(m, raw);
	ssize_t n = rw_fdpass_send(sock, raw, sizeof(raw), &fd, fd >= 0 ? 1 : 0,
				   MSG_DONTWAIT | MSG_NOSIGNAL);
	if (n == (ssize_t)sizeof(raw))
		return 0;
	if (n >= 0)
		errno = EMSGSIZE;
	return -1;
}

enum recv_result { RECV_MSG, RECV_NONE, RECV_EOF, RECV_ERR, RECV_BAD };

/* Receive one control message; *fd_p gets the one fd it carried or -1. Any other fds that
 * came with it are closed at once (a peer cannot fill our descriptor table). */
static enum recv_result msg_recv(int sock, shm_msg_t *m, int *fd_p)
{
	uint8_t raw[SHM_MSG_SIZE];
	struct iovec iov = {raw, sizeof(raw)};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(4 * sizeof(int))];
	} ctl;
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
			    .msg_controllen = sizeof(ctl.buf)};
	*fd_p = -1;
	ssize_t n;
	do
		n = recvmsg(sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno == EAGAIN || errno == EWOULDBLOCK ? RECV_NONE : RECV_ERR;
	int extra = 0;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < nfd; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
			if (*fd_p < 0) {
				*fd_p = fd;
			} else {
				close(fd);
				extra = 1;
			}
		}
	}
	if (n == 0)
		return RECV_EOF;
	if (extra || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || n != (ssize_t)sizeof(raw) ||
	    shm_msg_decode(raw, m) != 0)
		return RECV_BAD;
	return RECV_MSG;
}

int shm_memfd_sealed(const char *name, uint64_t bytes)
{
	int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -1;
	if (ftruncate(fd, (off_t)bytes) < 0 || fcntl(fd, F_ADD_SEALS, SHM_SEALS) < 0) {
		int saved = errno;
		close(fd);
		errno = saved;
		return -1;
	}
	return fd;
}

/* Map a peer's memfd of at least `bytes` read-write; NULL when it is smaller or could still
 * shrink (a shrink would make our accesses fault). The fd stays the caller's. */
static void *map_peer_fd(int fd, uint64_t bytes, int exact)
{
	struct stat st;
	int seals = fcntl(fd, F_GET_SEALS);
	if (fstat(fd, &st) < 0 || seals < 0 || !(seals & F_SEAL_SHRINK) || bytes == 0 ||
	    (uint64_t)st.st_size < bytes || (exact && (uint64_t)st.st_size != bytes))
		return NULL;
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
	return p == MAP_FAILED ? NULL : p;
}

/* ---- connection lifetime ---------------------------------------------------------------- */

/* Quiet the connection: out of the handshake budget, off the copier (which then touches
 * nothing of it), no watcher or timer, socket closed (the peer sees that at once). */
static void conn_quiesce(shm_conn_t *c)
{
	struct ev_loop *loop = c->dev->base.loop;
	c->dev->n_pending -= (uint32_t)c->pending;
	c->pending = 0;
	shm_copy_detach(c);
	ev_io_stop(loop, &c->rio);
	ev_io_stop(loop, &c->wio);
	ev_timer_stop(loop, &c->timer);
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
}

/* After conn_quiesce: the mappings and queues go. */
static void conn_free(shm_conn_t *c)
{
	for (size_t i = 0; i < c->nmaps; i++)
		if (c->maps[i].state == SHM_MAP_READY)
			munmap(c->maps[i].addr, c->maps[i].length);
	if (c->out)
		munmap(c->out, c->out_bytes);
	if (c->in)
		munmap(c->in, c->in_bytes);
	free(c->maps);
	free(c->tx);
	free(c);
}

void shm_conn_destroy(shm_conn_t *c)
{
	conn_quiesce(c);
	rw_list_del(&c->link);
	c->closed = 1;
	if (c->cb_depth == 0)
		conn_free(c);
}

static void cb_enter(shm_conn_t *c) { c->cb_depth++; }

static void cb_leave(shm_conn_t *c)
{
	if (--c->cb_depth == 0 && c->closed)
		conn_free(c);
}

static void *write_ctx_of(const rw_rail_conn_t *conn, uint64_t k)
{
	const shm_conn_t *c = (const shm_conn_t *)conn;
	return c->tx[k & c->out_mask].ctx;
}

/* Terminal failure, on the loop inside one of our callbacks: every outstanding write comes
 * back with st in posting order, then on_error once. */
static void conn_fail(shm_conn_t *c, rw_status_t st)
{
	if (!shm_conn_live(c))
		return;
	conn_quiesce(c);
	c->base.state = RW_RAIL_CONN_DOWN;
	if (!c->user_known) {
		shm_conn_destroy(c);
		return;
	}
	rw_rail_report_failure(&c->base, &c->tx_acked, c->tx_posted, write_ctx_of, &c->closed, st);
}

static void proto_fail(shm_conn_t *c, const char *why, const shm_msg_t *m)
{
	if (!c->user_known) {
		shm_dev_t *dev = c->dev;
		uint64_t now = rw_now_ns();
		dev->refused++;
		if (!dev->refused_logged_ns || now - dev->refused_logged_ns >= SHM_REFUSED_LOG_NS) {
			rw_warn("rail %u: dropped %llu incoming shm connection(s) in their handshake "
				"(latest from %s: %s)", dev->base.rail,
				(unsigned long long)dev->refused, c->base.peer, why);
			dev->refused = 0;
			dev->refused_logged_ns = now;
		}
	} else if (m) {
		rw_err("rail %u peer %s: protocol violation: %s (message %u a %#llx b %llu); "
		       "dropping connection", c->dev->base.rail, c->base.peer, why, m->type,
		       (unsigned long long)m->a, (unsigned long long)m->b);
	} else {
		rw_err("rail %u peer %s: protocol violation: %s; dropping connection",
		       c->dev->base.rail, c->base.peer, why);
	}
	conn_fail(c, RW_ERR_PROTO);
}

static void timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	shm_conn_t *c = w->data;
	cb_enter(c);
	if (c->pending_fail != RW_OK) {
		conn_fail(c, c->pending_fail);
	} else if (c->user_known) {
		rw_err("rail %u peer %s: handshake timed out", c->dev->base.rail, c->base.peer);
		conn_fail(c, RW_ERR_TIMEOUT);
	} else {
		proto_fail(c, "no handshake within 10 s", NULL);
	}
	cb_leave(c);
}

void shm_conn_fail_later(shm_conn_t *c, rw_status_t st)
{
	struct ev_loop *loop = c->dev->base.loop;
	if (c->pending_fail == RW_OK)
		c->pending_fail = st;
	ev_timer_stop(loop, &c->timer);
	ev_timer_set(&c->timer, 0., 0.);
	ev_timer_start(loop, &c->timer);
}

int shm_conn_send(shm_conn_t *c, const shm_msg_t *m, int fd)
{
	if (shm_msg_send(c->fd, m, fd) == 0)
		return 0;
	rw_err("rail %u peer %s: control message %u not sent: %m", c->dev->base.rail,
	       c->base.peer, m->type);
	return -1;
}

static void rio_cb(struct ev_loop *loop, ev_io *w, int revents);
static void wio_cb(struct ev_loop *loop, ev_io *w, int revents);

shm_conn_t *shm_conn_new(shm_dev_t *dev, int fd, const rw_rail_conn_cbs_t *cbs, void *ctx)
{
	shm_conn_t *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->dev = dev;
	c->fd = fd;
	rw_rail_conn_init_base(&c->base, &dev->base, cbs, ctx);
	ev_io_init(&c->rio, rio_cb, fd, EV_READ);
	ev_io_init(&c->wio, wio_cb, fd, EV_WRITE);
	ev_timer_init(&c->timer, timer_cb, SHM_HANDSHAKE_TIMEOUT_S, 0.);
	c->rio.data = c->wio.data = c->timer.data = c;
	rw_list_add(&dev->conns, &c->link);
	return c;
}

/* ---- delivery: arrivals (we are the target) and completions (we are the writer) ---------- */

/* Arrivals the peer published: report them, store head, re-arm. Returns 0 when the
 * connection failed or was closed meanwhile. */
static int rx_poll(shm_conn_t *c)
{
	shm_dev_t *dev = c->dev;
	for (;;) {
		/* Pair (1), acquire: the bytes of every write below tail are in our region. */
		uint64_t tail = atomic_load_explicit(&c->in->tail, memory_order_acquire);
		if (tail - c->rx_done > c->in_mask + 1) {
			proto_fail(c, "outbox tail outside its ring", NULL);
			return 0;
		}
		uint64_t from = c->rx_done;
		while (c->rx_done < tail) {
			shm_entry_t e; /* read once: the peer may scribble on its ring */
			memcpy(&e, &c->in->entries[c->rx_done & c->in_mask], sizeof(e));
			shm_region_t *r = shm_region_find(dev, e.key);
			const char *bad = !r ? "write into an unknown region key"
					  : rw_rail_range_check(r->base.length, e.offset, e.length)
					      ? "write outside its region" : NULL;
			if (bad) {
				char why[160];
				snprintf(why, sizeof(why), "%s (key %#llx offset %llu length %llu)", bad,
					 (unsigned long long)e.key, (unsigned long long)e.offset,
					 (unsigned long long)e.length);
				proto_fail(c, why, NULL);
				return 0;
			}
			c->rx_done++;
			rw_rail_arrival_t a = {.region = &r->base,
					       .offset = e.offset, .length = e.length, .imm = e.imm};
			if (c->base.cbs.on_arrival)
				c->base.cbs.on_arrival(&c->base, c->base.ctx, &a);
			if (!shm_conn_live(c))
				return 0;
		}
		if (c->rx_done != from) {
			/* Pair (2), release: these arrivals were reported. */
			atomic_store_explicit(&c->in->head, c->rx_done, memory_order_release);
			atomic_thread_fence(memory_order_seq_cst);
			if (atomic_exchange(&c->in->tx_armed, 0) &&
			    shm_conn_send(c, &(shm_msg_t){.type = SHM_HEAD}, -1) != 0) {
				conn_fail(c, RW_ERR_PEER);
				return 0;
			}
		}
		atomic_store(&c->in->rx_armed, 1);
		atomic_thread_fence(memory_order_seq_cst);
		if (atomic_load_explicit(&c->in->tail, memory_order_acquire) == tail)
			return 1;
	}
}

/* Completions: the peer's head says which of our writes it reported. Returns 0 when the
 * connection failed or was closed meanwhile. */
static int tx_poll(shm_conn_t *c)
{
	shm_dev_t *dev = c->dev;
	for (;;) {
		/* Pair (2), acquire: the target reported every write below head. */
		uint64_t head = atomic_load_explicit(&c->out->head, memory_order_acquire);
		pthread_mutex_lock(&dev->mu);
		uint64_t published = c->tx_copied;
		pthread_mutex_unlock(&dev->mu);
		if (head < c->tx_acked || head > published) {
			shm_msg_t m = {.type = SHM_HEAD, .a = head, .b = published};
			proto_fail(c, "outbox head outside the writes published", &m);
			return 0;
		}
		if (head != c->tx_acked)
			shm_copy_stats_sync(dev);
		while (c->tx_acked < head) {
			shm_tx_t *t = &c->tx[c->tx_acked & c->out_mask];
			c->tx_acked++;
			if (c->base.cbs.on_write_done)
				c->base.cbs.on_write_done(&c->base, c->base.ctx, t->ctx, RW_OK);
			if (!shm_conn_live(c))
				return 0;
		}
		if (c->want_writable && c->tx_posted - c->tx_acked < dev->base.max_writes) {
			c->want_writable = 0;
			if (c->base.cbs.on_writable)
				c->base.cbs.on_writable(&c->base, c->base.ctx);
			if (!shm_conn_live(c))
				return 0;
		}
		atomic_store(&c->out->tx_armed, 1);
		atomic_thread_fence(memory_order_seq_cst);
		if (atomic_load_explicit(&c->out->head, memory_order_acquire) == head)
			return 1;
	}
}

/* ---- the peer's regions, as the writer maps them ------------------------------------------ */

/* KEY, NO_KEY or UNREG for key: the writes waiting for it may go on. Loop thread. */
static void map_settle(shm_conn_t *c, const shm_msg_t *m, int fd)
{
	shm_dev_t *dev = c->dev;
	pthread_mutex_lock(&dev->mu);
	shm_map_t *mp = shm_map_find(c, m->a);
	if (m->type == SHM_KEY && (!mp || mp->state != SHM_MAP_ASKED)) {
		pthread_mutex_unlock(&dev->mu);
		proto_fail(c, "region fd nobody asked for", m);
		return;
	}
	if (!mp) { /* UNREG or NO_KEY of a region we never asked for: nothing to drop */
		pthread_mutex_unlock(&dev->mu);
		return;
	}
	if (mp->state == SHM_MAP_READY) { /* UNREG: copiers may be writing into it now */
		shm_copy_wait_idle(c);
		munmap(mp->addr, mp->length);
	}
	mp->addr = NULL;
	mp->state = SHM_MAP_GONE;
	if (m->type == SHM_KEY) {
		mp->addr = fd >= 0 ? map_peer_fd(fd, m->b, 0) : NULL;
		mp->length = m->b;
		mp->state = mp->addr ? SHM_MAP_READY : SHM_MAP_GONE;
	}
	c->blocked = 0;
	pthread_mutex_unlock(&dev->mu);
	if (m->type == SHM_KEY && mp->state != SHM_MAP_READY) {
		proto_fail(c, "region fd missing, unsealed, smaller than said, or not mappable", m);
		return;
	}
	shm_copy_kick(c);
}

/* ---- handshake and control messages (on the loop) ------------------------------------------ */

/* Our outbox: made once the proofs are through (strangers cost a socket and a struct). */
static int outbox_send(shm_conn_t *c)
{
	uint64_t entries = 1;
	while (entries < c->dev->base.max_writes)
		entries <<= 1;
	c->out_bytes = shm_ring_bytes(entries);
	c->out_mask = entries - 1;
	c->tx = calloc(entries, sizeof(*c->tx));
	int fd = shm_memfd_sealed("railwave-shm-outbox", c->out_bytes);
	void *p = fd >= 0 ? mmap(NULL, c->out_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
			  : MAP_FAILED;
	if (!c->tx || p == MAP_FAILED) {
		rw_err("rail %u peer %s: no memory for the connection's outbox: %m",
		       c->dev->base.rail, c->base.peer);
		if (fd >= 0)
			close(fd);
		conn_fail(c, RW_ERR_NOMEM);
		return -1;
	}
	c->out = p;
	int rc = shm_conn_send(c, &(shm_msg_t){.type = SHM_RING, .a = entries}, fd);
	close(fd);
	if (rc != 0)
		conn_fail(c, RW_ERR_PEER);
	return rc;
}

/* The peer's outbox arrived: map it, then the connection is up. */
static void ring_take(shm_conn_t *c, const shm_msg_t *m, int fd)
{
	uint64_t entries = m->a;
	if (fd < 0 || entries == 0 || entries > SHM_RING_MAX || (entries & (entries - 1)) ||
	    !(c->in = map_peer_fd(fd, shm_ring_bytes(entries), 1))) {
		proto_fail(c, "outbox fd missing, unsealed or of the wrong size", m);
		return;
	}
	c->in_bytes = shm_ring_bytes(entries);
	c->in_mask = entries - 1;
	if (c->base.accepted && outbox_send(c) != 0)
		return;
	c->dev->n_pending -= (uint32_t)c->pending;
	c->pending = 0;
	ev_timer_stop(c->dev->base.loop, &c->timer);
	c->hs = SHM_HS_DONE;
	c->user_known = 1;
	c->base.state = RW_RAIL_CONN_UP;
	atomic_store(&c->out->tx_armed, 1);
	if (c->base.cbs.on_connected)
		c->base.cbs.on_connected(&c->base, c->base.ctx);
	if (shm_conn_live(c))
		rx_poll(c); /* what the peer published before we were listening for doorbells */
}

static void hello_take(shm_conn_t *c, const shm_msg_t *m)
{
	if (m->b != c->dev->base.rail) {
		proto_fail(c, "peer is on another rail", m);
		return;
	}
	if (m->type == SHM_HELLO) {
		c->base.tag = m->a;
		uint8_t reply[RW_RAIL_PROOF_SIZE] = {0};
		/* The user's check comes before anything of the connection is made or mapped. */
		if (c->base.cbs.on_verify &&
		    c->base.cbs.on_verify(&c->base, c->base.ctx, m->proof, reply) != 0) {
			proto_fail(c, "no valid proof", NULL);
			return;
		}
		shm_msg_t ack = {.type = SHM_HELLO_ACK, .b = c->dev->base.rail};
		memcpy(ack.proof, reply, RW_RAIL_PROOF_SIZE);
		if (shm_conn_send(c, &ack, -1) != 0) {
			conn_fail(c, RW_ERR_PEER);
			return;
		}
		c->hs = SHM_HS_WAIT_RING;
		return;
	}
	if (c->base.cbs.on_verify &&
	    c->base.cbs.on_verify(&c->base, c->base.ctx, m->proof, NULL) != 0) {
		proto_fail(c, "the acceptor's proof is not valid", m);
		return;
	}
	c->hs = SHM_HS_WAIT_RING;
	outbox_send(c);
}

/* The peer asks for one of our regions: its fd, or NO_KEY. Only after the handshake. */
static int key_answer(shm_conn_t *c, uint64_t key)
{
	const shm_region_t *r = shm_region_find(c->dev, key);
	shm_msg_t m = {.type = r ? SHM_KEY : SHM_NO_KEY, .a = key, .b = r ? r->base.length : 0};
	return shm_conn_send(c, &m, r ? r->fd : -1);
}

/* One message on a connection; fd is the one it carried (consumed here). */
static void msg_take(shm_conn_t *c, const shm_msg_t *m, int fd)
{
	const enum shm_hs hs = c->hs;
	if (fd >= 0 && m->type != SHM_RING && m->type != SHM_KEY) {
		close(fd);
		proto_fail(c, "a file descriptor on a message that carries none", m);
		return;
	}
	if (hs == SHM_HS_WAIT_HELLO && m->type == SHM_HELLO)
		hello_take(c, m);
	else if (hs == SHM_HS_WAIT_HELLO_ACK && m->type == SHM_HELLO_ACK)
		hello_take(c, m);
	else if (hs == SHM_HS_WAIT_RING && m->type == SHM_RING)
		ring_take(c, m, fd);
	else if (hs != SHM_HS_DONE)
		proto_fail(c, "unexpected message during the handshake", m);
	else if (m->type == SHM_TAIL)
		rx_poll(c);
	else if (m->type == SHM_HEAD)
		tx_poll(c);
	else if (m->type == SHM_KEY_REQ) {
		if (key_answer(c, m->a) != 0)
			conn_fail(c, RW_ERR_PEER);
	} else if (m->type == SHM_KEY || m->type == SHM_NO_KEY || m->type == SHM_UNREG)
		map_settle(c, m, fd);
	else
		proto_fail(c, "unexpected message", m);
	if (fd >= 0)
		close(fd); /* mapped (or refused): the mapping keeps the memory */
}

static void rio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	shm_conn_t *c = w->data;
	cb_enter(c);
	for (int i = 0; i < SHM_MSG_BUDGET && shm_conn_live(c) && c->fd >= 0; i++) {
		shm_msg_t m;
		int fd;
		enum recv_result r = msg_recv(c->fd, &m, &fd);
		if (r == RECV_NONE)
			break;
		if (r == RECV_MSG) {
			msg_take(c, &m, fd);
			continue;
		}
		if (fd >= 0)
			close(fd);
		if (r == RECV_BAD) {
			proto_fail(c, "malformed control message", NULL);
		} else {
			if (c->user_known && r == RECV_ERR)
				rw_err("rail %u peer %s: receive: %m", c->dev->base.rail, c->base.peer);
			else if (c->user_known)
				rw_warn("rail %u peer %s: connection closed by peer", c->dev->base.rail,
					c->base.peer);
			conn_fail(c, RW_ERR_PEER);
		}
	}
	cb_leave(c);
}

/* Connector: the socket is connected; the HELLO (with the proof set after connect) goes now. */
static void wio_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	shm_conn_t *c = w->data;
	cb_enter(c);
	ev_io_stop(loop, &c->wio);
	shm_msg_t m = {.type = SHM_HELLO, .a = c->base.tag, .b = c->dev->base.rail};
	memcpy(m.proof, c->base.proof, RW_RAIL_PROOF_SIZE);
	if (shm_conn_send(c, &m, -1) != 0) {
		conn_fail(c, RW_ERR_PEER);
	} else {
		c->hs = SHM_HS_WAIT_HELLO_ACK;
		ev_io_start(loop, &c->rio);
	}
	cb_leave(c);
}
