/* railwaved's peer mesh (service/mesh.h, docs/dataflow.md "Peer mesh"): control channels over
 * TCP with framed, validated messages; one rail connection per (peer, rail) through rdma/rail.h;
 * per-rail registered memory; heartbeats; failure detection; reconnect with bounded back-off.
 * Everything runs on the daemon's loop. Peer input is untrusted: a bad frame closes that peer's
 * channel (it reconnects), never anything else. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "service/mesh.h"
#include "service/svc.h"

#define BACKOFF_MIN_MS 50
#define BACKOFF_MAX_MS 2000
#define CTL_TX_MAX (64u << 20) /* a peer that lets this much control data pile up is dropped */

typedef struct mesh_wq {
	struct mesh_wq *next;
	rw_rail_write_t w;
} mesh_wq_t;

struct mesh_peer;

typedef struct mesh_rail {
	int is_rail;                  /* 1: tells a connection's context from the listener's (mesh) */
	struct mesh_peer *peer;
	uint32_t rail;
	rw_rail_conn_t *conn;
	int up;
	int blocked;                  /* rw_rail_write said AGAIN; waiting for on_writable */
	mesh_wq_t *head, *tail;       /* posted first, then queued */
	uint32_t posted;              /* the first `posted` entries are with the transport */
} mesh_rail_t;

typedef struct mesh_ctl {
	rw_svc_mesh_t *mesh;
	struct mesh_ctl *next;        /* unidentified list */
	int fd;
	int connecting;               /* outgoing connect() in progress */
	int peer;                     /* -1 until a valid HELLO */
	ev_io io;
	uint64_t opened_ns;
	uint8_t hdr[RW_WIRE_HDR_SIZE];
	uint32_t hdr_have;
	rw_wire_hdr_t cur;
	uint8_t *rx;
	uint32_t rx_have;
	uint8_t *tx;
	size_t tx_len, tx_off, tx_cap;
} mesh_ctl_t;

typedef struct mesh_peer {
	rw_svc_mesh_t *mesh;
	uint32_t idx;
	rw_svc_peer_state_t state;
	mesh_ctl_t *ctl;              /* identified control channel, or NULL */
	int hello_ok;
	uint64_t boot_id;
	rw_rail_remote_t remote[RW_MAX_RAILS];
	char rail_addr[RW_MAX_RAILS][RW_WIRE_ADDR_MAX];
	mesh_rail_t rail[RW_MAX_RAILS];
	uint64_t last_rx_ns;
	uint64_t last_stamp;          /* newest heartbeat stamp from the peer (echoed back) */
	uint64_t last_stamp_rx_ns;    /* when it came */
	ev_timer retry;
	uint32_t backoff_ms;
} mesh_peer_t;

struct rw_svc_mesh {
	int is_rail;                  /* 0 (see mesh_rail_t) */
	rw_svc_t *svc;
	struct ev_loop *loop;
	rw_svc_mesh_cbs_t cbs;
	void *ctx;
	uint32_t nodes, rails, me;
	uint64_t area_bytes;
	uint64_t boot_id, fingerprint;
	uint32_t tx_seq;
	rw_rail_dev_t *dev[RW_MAX_RAILS];
	uint8_t *mem[RW_MAX_RAILS];
	rw_rail_region_t *region[RW_MAX_RAILS];
	rw_rail_listener_t *listener[RW_MAX_RAILS];
	uint32_t inflight[RW_MAX_RAILS];   /* our writes outstanding per rail, all peers */
	uint64_t busy_since[RW_MAX_RAILS]; /* when inflight last went 0 -> 1 */
	int listen_fd;
	ev_io listen_io;
	ev_timer hb_timer;
	mesh_peer_t *peer;            /* [nodes] */
	mesh_ctl_t *unknown;          /* accepted control connections before HELLO */
};

static void ctl_io_cb(struct ev_loop *loop, ev_io *w, int revents);
static void peer_fail(mesh_peer_t *p, rw_status_t st, const char *why);
static void ctl_send_hello(mesh_ctl_t *c);

static const rw_rail_conn_cbs_t rail_cbs;

/* ---- control connections ---------------------------------------------------------------- */

static mesh_ctl_t *ctl_new(rw_svc_mesh_t *m, int fd, int peer)
{
	mesh_ctl_t *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->mesh = m;
	c->fd = fd;
	c->peer = peer;
	c->opened_ns = rw_now_ns();
	ev_io_init(&c->io, ctl_io_cb, fd, EV_READ);
	c->io.data = c;
	return c;
}

static void ctl_free(mesh_ctl_t *c)
{
	if (!c)
		return;
	ev_io_stop(c->mesh->loop, &c->io);
	if (c->fd >= 0)
		close(c->fd);
	free(c->rx);
	free(c->tx);
	free(c);
}

static void unknown_remove(rw_svc_mesh_t *m, mesh_ctl_t *c)
{
	for (mesh_ctl_t **pp = &m->unknown; *pp; pp = &(*pp)->next)
		if (*pp == c) {
			*pp = c->next;
			c->next = NULL;
			return;
		}
}

static void ctl_update_events(mesh_ctl_t *c)
{
	int ev = EV_READ | (c->connecting || c->tx_off < c->tx_len ? EV_WRITE : 0);
	if (!ev_is_active(&c->io) || (c->io.events & (EV_READ | EV_WRITE)) != ev) {
		ev_io_stop(c->mesh->loop, &c->io);
		ev_io_set(&c->io, c->fd, ev);
		ev_io_start(c->mesh->loop, &c->io);
	}
}

/* Close a control connection that failed: an identified one takes its peer down. */
static void ctl_drop(mesh_ctl_t *c, rw_status_t st, const char *why)
{
	rw_svc_mesh_t *m = c->mesh;
	if (c->peer >= 0 && m->peer[c->peer].ctl == c) {
		peer_fail(&m->peer[c->peer], st, why);
		return;
	}
	if (c->peer >= 0)
		rw_warn("peer %d: control connection closed: %s", c->peer, why);
	else
		rw_warn("control connection (fd %d, before hello) closed: %s", c->fd, why);
	rw_svc_metrics_error(&m->svc->metrics, st);
	unknown_remove(m, c);
	ctl_free(c);
}

static int ctl_flush(mesh_ctl_t *c)
{
	while (c->tx_off < c->tx_len) {
		ssize_t n = send(c->fd, c->tx + c->tx_off, c->tx_len - c->tx_off, MSG_NOSIGNAL);
		if (n < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK)
				break;
			if (errno == EINTR)
				continue;
			return -1;
		}
		c->tx_off += (size_t)n;
	}
	if (c->tx_off == c->tx_len)
		c->tx_off = c->tx_len = 0;
	ctl_update_events(c);
	return 0;
}

static rw_status_t ctl_queue(mesh_ctl_t *c, uint16_t type, const uint8_t *payload, uint32_t len)
{
	size_t need = c->tx_len + RW_WIRE_HDR_SIZE + len;
	if (need > CTL_TX_MAX)
		return RW_ERR_AGAIN;
	if (need > c->tx_cap) {
		if (c->tx_off > 0) { /* compact first */
			memmove(c->tx, c->tx + c->tx_off, c->tx_len - c->tx_off);
			c->tx_len -= c->tx_off;
			c->tx_off = 0;
			need = c->tx_len + RW_WIRE_HDR_SIZE + len;
		}
		if (need > c->tx_cap) {
			size_t cap = c->tx_cap ? c->tx_cap : 4096;
			while (cap < need)
				cap *= 2;
			uint8_t *tx = realloc(c->tx, cap);
			if (!tx)
				return RW_ERR_NOMEM;
			c->tx = tx;
			c->tx_cap = cap;
		}
	}
	rw_wire_hdr_t h = { .type = type, .length = len, .seq = ++c->mesh->tx_seq };
	rw_wire_hdr_pack(&h, c->tx + c->tx_len);
	if (len)
		memcpy(c->tx + c->tx_len + RW_WIRE_HDR_SIZE, payload, len);
	c->tx_len += RW_WIRE_HDR_SIZE + len;
	return RW_OK;
}

/* ---- peers ------------------------------------------------------------------------------- */

static void peer_set_state(mesh_peer_t *p, rw_svc_peer_state_t s)
{
	p->state = s;
	rw_svc_metrics_peer_state(&p->mesh->svc->metrics, p->idx, s);
}

static uint32_t peer_rails_up(const mesh_peer_t *p)
{
	uint32_t n = 0;
	for (uint32_t r = 0; r < p->mesh->rails; r++)
		n += p->rail[r].up;
	return n;
}

static void peer_check_up(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	uint32_t up = peer_rails_up(p);
	m->svc->metrics.peer[p->idx].rails_up = up;
	if (p->state == RW_SVC_PEER_UP || !p->ctl || !p->hello_ok || up != m->rails)
		return;
	peer_set_state(p, RW_SVC_PEER_UP);
	p->backoff_ms = 0;
	rw_info("peer %u: up (control and %u rails)", p->idx, m->rails);
	if (m->cbs.peer_up)
		m->cbs.peer_up(m->ctx, p->idx);
}

/* Per-rail busy time = the union of intervals with a write of ours outstanding. */
static void busy_begin(rw_svc_mesh_t *m, uint32_t rail)
{
	if (m->inflight[rail]++ == 0)
		m->busy_since[rail] = rw_now_ns();
}

static void busy_end(rw_svc_mesh_t *m, uint32_t rail)
{
	if (m->inflight[rail] && --m->inflight[rail] == 0)
		m->svc->metrics.rail[rail].tx_busy_ns += rw_now_ns() - m->busy_since[rail];
}

/* Copy the transport's counters of rail's device into the metrics (svc.h). */
static void rail_dev_sample(rw_svc_mesh_t *m, uint32_t rail)
{
	const rw_rail_dev_t *dev = m->dev[rail];
	if (dev)
		rw_svc_metrics_rail_dev(&m->svc->metrics, rail, dev->stats.tx_bytes,
					dev->stats.pace_waits);
}

static void rail_reclaim(mesh_rail_t *mr, rw_status_t st)
{
	rw_svc_mesh_t *m = mr->peer->mesh;
	mesh_wq_t *q = mr->head;
	mr->head = mr->tail = NULL;
	mr->posted = 0;
	mr->blocked = 0;
	while (q) {
		mesh_wq_t *next = q->next;
		void *wctx = q->w.ctx;
		free(q);
		busy_end(m, mr->rail);
		if (m->cbs.write_done)
			m->cbs.write_done(m->ctx, wctx, st);
		q = next;
	}
}

static void rail_close(mesh_rail_t *mr, rw_status_t st)
{
	if (mr->conn) {
		rw_rail_conn_close(mr->conn);
		mr->conn = NULL;
	}
	mr->up = 0;
	rail_reclaim(mr, st);
}

static void retry_cb(struct ev_loop *loop, ev_timer *w, int revents);

static void peer_schedule_retry(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	if (m->me > p->idx || m->svc->stopping) /* the lower index connects */
		return;
	p->backoff_ms = p->backoff_ms ? RW_MIN(p->backoff_ms * 2, BACKOFF_MAX_MS) : BACKOFF_MIN_MS;
	ev_timer_stop(m->loop, &p->retry);
	ev_timer_set(&p->retry, p->backoff_ms / 1000.0, 0.);
	ev_timer_start(m->loop, &p->retry);
}

static void peer_fail(mesh_peer_t *p, rw_status_t st, const char *why)
{
	rw_svc_mesh_t *m = p->mesh;
	int was_up = p->state == RW_SVC_PEER_UP;
	if (p->ctl || was_up || peer_rails_up(p)) {
		rw_warn("peer %u: down (%s): %s", p->idx, rw_status_str(st), why);
		rw_svc_metrics_error(&m->svc->metrics, st);
		m->svc->metrics.peer[p->idx].errors++;
	}
	if (p->ctl) {
		ctl_free(p->ctl);
		p->ctl = NULL;
	}
	p->hello_ok = 0;
	for (uint32_t r = 0; r < m->rails; r++)
		rail_close(&p->rail[r], RW_ERR_PEER);
	m->svc->metrics.peer[p->idx].rails_up = 0;
	peer_set_state(p, RW_SVC_PEER_FAILED);
	if (was_up && m->cbs.peer_down)
		m->cbs.peer_down(m->ctx, p->idx, st);
	peer_schedule_retry(p);
}

static void peer_connect(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	const rw_svc_endpoint_t *ep = &m->svc->cfg.nodes[p->idx].control;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		rw_err("peer %u: socket: %m", p->idx);
		peer_schedule_retry(p);
		return;
	}
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (connect(fd, (const struct sockaddr *)&ep->sin, sizeof(ep->sin)) < 0 &&
	    errno != EINPROGRESS) {
		rw_dbg("peer %u: connect %s:%u: %m", p->idx, ep->text, ep->port);
		close(fd);
		peer_schedule_retry(p);
		return;
	}
	mesh_ctl_t *c = ctl_new(m, fd, (int)p->idx);
	if (!c) {
		close(fd);
		peer_schedule_retry(p);
		return;
	}
	c->connecting = 1;
	p->ctl = c;
	peer_set_state(p, RW_SVC_PEER_CONNECTING);
	ctl_update_events(c);
}

static void retry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	mesh_peer_t *p = w->data;
	if (!p->ctl)
		peer_connect(p);
}

/* ---- rail connections -------------------------------------------------------------------- */

static void rail_pump(mesh_rail_t *mr)
{
	if (!mr->conn || !mr->up || mr->blocked)
		return;
	mesh_wq_t *q = mr->head;
	for (uint32_t i = 0; i < mr->posted && q; i++)
		q = q->next;
	while (q) {
		rw_status_t st = rw_rail_write(mr->conn, &q->w);
		if (st == RW_ERR_AGAIN) {
			mr->blocked = 1;
			return;
		}
		if (st != RW_OK) {
			peer_fail(mr->peer, RW_ERR_LINK, "rail write refused");
			return;
		}
		mr->posted++;
		q = q->next;
	}
}

/* The mesh_rail_t behind a connection's context, or NULL for a not-yet-adopted accept. */
static mesh_rail_t *rail_of(rw_rail_conn_t *conn, void *ctx)
{
	mesh_rail_t *mr = ctx;
	if (!mr || !mr->is_rail || mr->conn != conn)
		return NULL;
	return mr;
}

static void rail_on_connected(rw_rail_conn_t *conn, void *ctx)
{
	rw_svc_mesh_t *m;
	mesh_rail_t *mr;
	if (conn->accepted) {
		m = ctx; /* the listener's context */
		uint64_t tag = conn->tag;
		uint32_t rail = conn->dev->rail;
		if (tag >= m->me || rail >= m->rails) { /* only lower nodes connect to us */
			rw_warn("rail %u: refusing connection from %s (tag %llu)", rail, conn->peer,
				(unsigned long long)tag);
			rw_rail_conn_close(conn);
			return;
		}
		mr = &m->peer[tag].rail[rail];
		if (mr->conn) /* the peer reconnected this rail: the old one is stale */
			rail_close(mr, RW_ERR_PEER);
		mr->conn = conn;
		rw_rail_conn_set_ctx(conn, mr);
	} else {
		mr = rail_of(conn, ctx);
		if (!mr)
			return;
		m = mr->peer->mesh;
	}
	mr->up = 1;
	rw_dbg("peer %u rail %u: connected (%s)", mr->peer->idx, mr->rail, conn->peer);
	peer_check_up(mr->peer);
}

static void rail_on_error(rw_rail_conn_t *conn, void *ctx, rw_status_t st)
{
	mesh_rail_t *mr = rail_of(conn, ctx);
	if (!mr)
		return;
	rw_svc_mesh_t *m = mr->peer->mesh;
	m->svc->metrics.rail[mr->rail].errors++;
	char why[64];
	snprintf(why, sizeof(why), "rail %u connection failed", mr->rail);
	peer_fail(mr->peer, st, why);
}

static void rail_on_write_done(rw_rail_conn_t *conn, void *ctx, void *write_ctx, rw_status_t st)
{
	mesh_rail_t *mr = rail_of(conn, ctx);
	if (!mr)
		return;
	rw_svc_mesh_t *m = mr->peer->mesh;
	mesh_wq_t *q = mr->head;
	if (!q || mr->posted == 0)
		return;
	mr->head = q->next;
	if (!mr->head)
		mr->tail = NULL;
	mr->posted--;
	void *wctx = q->w.ctx;
	(void)write_ctx;
	free(q);
	busy_end(m, mr->rail);
	rail_dev_sample(m, mr->rail);
	if (m->cbs.write_done)
		m->cbs.write_done(m->ctx, wctx, st);
	rail_pump(mr);
}

static void rail_on_arrival(rw_rail_conn_t *conn, void *ctx, const rw_rail_arrival_t *a)
{
	mesh_rail_t *mr = rail_of(conn, ctx);
	if (!mr)
		return;
	rw_svc_mesh_t *m = mr->peer->mesh;
	mr->peer->last_rx_ns = rw_now_ns();
	if (m->cbs.arrival)
		m->cbs.arrival(m->ctx, mr->peer->idx, mr->rail, a);
}

static void rail_on_writable(rw_rail_conn_t *conn, void *ctx)
{
	mesh_rail_t *mr = rail_of(conn, ctx);
	if (!mr)
		return;
	mr->blocked = 0;
	rail_pump(mr);
}

static const rw_rail_conn_cbs_t rail_cbs = {
	.on_connected = rail_on_connected,
	.on_error = rail_on_error,
	.on_write_done = rail_on_write_done,
	.on_arrival = rail_on_arrival,
	.on_writable = rail_on_writable,
};

static void peer_connect_rails(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	for (uint32_t r = 0; r < m->rails; r++) {
		mesh_rail_t *mr = &p->rail[r];
		if (mr->conn)
			continue;
		rw_rail_conn_t *conn;
		rw_status_t st = rw_rail_connect(m->dev[r], p->rail_addr[r], m->me, &rail_cbs, mr, &conn);
		if (st != RW_OK) {
			peer_fail(p, RW_ERR_LINK, "cannot start a rail connection");
			return;
		}
		mr->conn = conn;
	}
}

/* ---- control messages -------------------------------------------------------------------- */

static void ctl_send_hello(mesh_ctl_t *c)
{
	rw_svc_mesh_t *m = c->mesh;
	rw_wire_hello_t h;
	memset(&h, 0, sizeof(h));
	snprintf(h.cluster, sizeof(h.cluster), "%s", m->svc->cfg.cluster);
	h.node = m->me;
	h.nodes = m->nodes;
	h.gpus = m->svc->cfg.gpus_per_node;
	h.rails = m->rails;
	h.fingerprint = m->fingerprint;
	h.boot_id = m->boot_id;
	for (uint32_t r = 0; r < m->rails; r++) {
		rw_rail_region_desc_pack(m->region[r], h.desc[r]);
		snprintf(h.rail_addr[r], RW_WIRE_ADDR_MAX, "%s", m->listener[r]->addr);
	}
	uint8_t buf[sizeof(rw_wire_hello_t) + 64];
	size_t n = rw_wire_hello_pack(&h, buf, sizeof(buf));
	if (ctl_queue(c, RW_WIRE_HELLO, buf, (uint32_t)n) != RW_OK || ctl_flush(c) < 0)
		ctl_drop(c, RW_ERR_PEER, "cannot send hello");
}

/* Returns 0 to keep reading, -1 when the connection was dropped (c is gone). */
static int ctl_on_hello(mesh_ctl_t *c, const uint8_t *payload, uint32_t len)
{
	rw_svc_mesh_t *m = c->mesh;
	rw_wire_hello_t h;
	char why[160];
	if (rw_wire_hello_unpack(payload, len, &h) != RW_OK) {
		ctl_drop(c, RW_ERR_PROTO, "malformed hello");
		return -1;
	}
	if (strcmp(h.cluster, m->svc->cfg.cluster) != 0 || h.nodes != m->nodes || h.rails != m->rails ||
	    h.gpus != m->svc->cfg.gpus_per_node || h.fingerprint != m->fingerprint) {
		snprintf(why, sizeof(why), "hello from node %u refused: cluster/size/fingerprint mismatch "
			 "(cluster '%s' N=%u R=%u G=%u)", h.node, h.cluster, h.nodes, h.rails, h.gpus);
		ctl_drop(c, RW_ERR_PROTO, why);
		return -1;
	}
	if (c->peer >= 0 ? h.node != (uint32_t)c->peer : h.node >= m->me) {
		snprintf(why, sizeof(why), "hello names node %u on a connection that cannot be its", h.node);
		ctl_drop(c, RW_ERR_PROTO, why);
		return -1;
	}
	rw_rail_remote_t remote[RW_MAX_RAILS];
	for (uint32_t r = 0; r < m->rails; r++)
		if (rw_rail_remote_unpack(h.desc[r], RW_WIRE_DESC_SIZE, &remote[r]) != RW_OK ||
		    remote[r].length < m->area_bytes) {
			ctl_drop(c, RW_ERR_PROTO, "hello carries a bad region descriptor");
			return -1;
		}
	mesh_peer_t *p = &m->peer[h.node];
	if (c->peer < 0) { /* accepted: adopt it, replacing whatever the peer had before */
		unknown_remove(m, c);
		if (p->ctl || p->state == RW_SVC_PEER_UP)
			peer_fail(p, RW_ERR_PEER, "peer reconnected");
		ev_timer_stop(m->loop, &p->retry);
		c->peer = (int)h.node;
		p->ctl = c;
		ctl_send_hello(c);
		if (p->ctl != c)
			return -1;
	}
	if (p->boot_id && p->boot_id != h.boot_id)
		rw_info("peer %u: restarted (new boot id)", p->idx);
	p->boot_id = h.boot_id;
	memcpy(p->remote, remote, sizeof(remote));
	for (uint32_t r = 0; r < m->rails; r++)
		memcpy(p->rail_addr[r], h.rail_addr[r], RW_WIRE_ADDR_MAX);
	p->hello_ok = 1;
	p->last_rx_ns = rw_now_ns();
	if (m->me < p->idx)
		peer_connect_rails(p);
	if (p->ctl == c)
		peer_check_up(p);
	return p->ctl == c ? 0 : -1;
}

static int ctl_on_message(mesh_ctl_t *c, const rw_wire_hdr_t *h, const uint8_t *payload)
{
	rw_svc_mesh_t *m = c->mesh;
	if (h->type == RW_WIRE_HELLO) {
		if (c->peer >= 0 && m->peer[c->peer].hello_ok) {
			ctl_drop(c, RW_ERR_PROTO, "second hello");
			return -1;
		}
		return ctl_on_hello(c, payload, h->length);
	}
	if (c->peer < 0 || !m->peer[c->peer].hello_ok) {
		ctl_drop(c, RW_ERR_PROTO, "message before hello");
		return -1;
	}
	mesh_peer_t *p = &m->peer[c->peer];
	p->last_rx_ns = rw_now_ns();
	switch (h->type) {
	case RW_WIRE_HEARTBEAT: {
		rw_wire_heartbeat_t hb;
		if (rw_wire_heartbeat_unpack(payload, h->length, &hb) != RW_OK)
			break;
		uint64_t now = rw_now_ns();
		p->last_stamp = hb.stamp;
		p->last_stamp_rx_ns = now;
		if (hb.echo && hb.echo + hb.hold <= now)
			m->svc->metrics.peer[p->idx].heartbeat_rtt_ns = now - hb.echo - hb.hold;
		return 0;
	}
	case RW_WIRE_COUNTS: {
		rw_wire_counts_t cnt;
		if (rw_wire_counts_unpack(payload, h->length, &cnt) != RW_OK || cnt.node != p->idx ||
		    cnt.nodes != m->nodes || cnt.rails != m->rails)
			break;
		if (m->cbs.counts)
			m->cbs.counts(m->ctx, p->idx, &cnt);
		return p->ctl == c ? 0 : -1; /* the callback may have failed this peer */
	}
	case RW_WIRE_PHASE_ERR: {
		rw_wire_phase_err_t e;
		if (rw_wire_phase_err_unpack(payload, h->length, &e) != RW_OK)
			break;
		if (m->cbs.phase_err)
			m->cbs.phase_err(m->ctx, p->idx, &e);
		return p->ctl == c ? 0 : -1;
	}
	case RW_WIRE_GRANT: {
		rw_wire_grant_t g;
		if (rw_wire_grant_unpack(payload, h->length, &g) != RW_OK || g.wave >= m->nodes)
			break;
		if (m->cbs.grant)
			m->cbs.grant(m->ctx, p->idx, &g);
		return p->ctl == c ? 0 : -1;
	}
	default:
		break;
	}
	char why[64];
	snprintf(why, sizeof(why), "malformed message (type %u, %u bytes)", h->type, h->length);
	ctl_drop(c, RW_ERR_PROTO, why);
	return -1;
}

/* One recv into buf[0..want) (want > 0). Returns the bytes received; 0 when nothing is there
 * now (EAGAIN; EINTR is retried); -1 when c was dropped (peer closed, or a read error). */
static ssize_t ctl_recv(mesh_ctl_t *c, void *buf, size_t want)
{
	for (;;) {
		ssize_t n = recv(c->fd, buf, want, 0);
		if (n > 0)
			return n;
		if (n == 0) {
			ctl_drop(c, RW_ERR_PEER, "connection closed");
			return -1;
		}
		if (errno == EINTR)
			continue;
		if (errno == EAGAIN || errno == EWOULDBLOCK)
			return 0;
		ctl_drop(c, RW_ERR_PEER, "read error");
		return -1;
	}
}

/* Read what is there and handle every complete message. -1: c was dropped. */
static int ctl_read(mesh_ctl_t *c)
{
	for (;;) {
		if (c->hdr_have < RW_WIRE_HDR_SIZE) {
			ssize_t n = ctl_recv(c, c->hdr + c->hdr_have, RW_WIRE_HDR_SIZE - c->hdr_have);
			if (n <= 0)
				return (int)n;
			c->hdr_have += (uint32_t)n;
			if (c->hdr_have < RW_WIRE_HDR_SIZE)
				continue;
			if (rw_wire_hdr_unpack(c->hdr, &c->cur) != RW_OK) {
				ctl_drop(c, RW_ERR_PROTO, "bad frame header (magic, version, type or length)");
				return -1;
			}
			free(c->rx);
			c->rx = c->cur.length ? malloc(c->cur.length) : NULL;
			if (c->cur.length && !c->rx) {
				ctl_drop(c, RW_ERR_NOMEM, "out of memory");
				return -1;
			}
			c->rx_have = 0;
		}
		if (c->rx_have < c->cur.length) {
			ssize_t n = ctl_recv(c, c->rx + c->rx_have, c->cur.length - c->rx_have);
			if (n <= 0)
				return (int)n;
			c->rx_have += (uint32_t)n;
			if (c->rx_have < c->cur.length)
				continue;
		}
		c->hdr_have = 0;
		rw_wire_hdr_t h = c->cur;
		uint8_t *payload = c->rx;
		c->rx = NULL;
		int rc = ctl_on_message(c, &h, payload);
		free(payload);
		if (rc < 0)
			return -1;
	}
}

static void ctl_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	mesh_ctl_t *c = w->data;
	if (c->connecting) {
		if (!(revents & EV_WRITE))
			return;
		int err = 0;
		socklen_t len = sizeof(err);
		getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
		if (err != 0) {
			mesh_peer_t *p = &c->mesh->peer[c->peer];
			rw_dbg("peer %d: connect: %s", c->peer, strerror(err));
			p->ctl = NULL;
			ctl_free(c);
			peer_set_state(p, RW_SVC_PEER_CONNECTING);
			peer_schedule_retry(p);
			return;
		}
		c->connecting = 0;
		ctl_send_hello(c);
		return;
	}
	if (revents & EV_WRITE) {
		if (ctl_flush(c) < 0) {
			ctl_drop(c, RW_ERR_PEER, "write error");
			return;
		}
	}
	if (revents & EV_READ)
		ctl_read(c);
}

static void listen_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_mesh_t *m = w->data;
	for (;;) {
		int fd = accept4(m->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
				rw_warn("control accept: %m");
			return;
		}
		int one = 1;
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		mesh_ctl_t *c = ctl_new(m, fd, -1);
		if (!c) {
			close(fd);
			continue;
		}
		c->next = m->unknown;
		m->unknown = c;
		ctl_update_events(c);
	}
}

/* ---- heartbeats and timeouts ------------------------------------------------------------- */

static void hb_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_mesh_t *m = w->data;
	uint64_t now = rw_now_ns();
	uint64_t timeout = (uint64_t)m->svc->cfg.heartbeat_timeout_ms * 1000000ull;
	for (uint32_t r = 0; r < m->rails; r++)
		rail_dev_sample(m, r); /* also while a long write is in flight, and on a pure receiver */
	for (uint32_t i = 0; i < m->nodes; i++) {
		mesh_peer_t *p = &m->peer[i];
		if (i == m->me || !p->ctl || p->ctl->connecting)
			continue;
		if (!p->hello_ok) {
			if (now - p->ctl->opened_ns > timeout)
				peer_fail(p, RW_ERR_TIMEOUT, "no hello within heartbeat_timeout");
			continue;
		}
		if (now - p->last_rx_ns > timeout) {
			peer_fail(p, RW_ERR_TIMEOUT, "silent for heartbeat_timeout");
			continue;
		}
		uint8_t buf[RW_WIRE_HEARTBEAT_SIZE];
		rw_wire_heartbeat_t hb = { .stamp = now, .echo = p->last_stamp,
					   .hold = p->last_stamp ? now - p->last_stamp_rx_ns : 0 };
		rw_wire_heartbeat_pack(&hb, buf, sizeof(buf));
		rw_svc_mesh_send(m, i, RW_WIRE_HEARTBEAT, buf, sizeof(buf));
	}
	for (mesh_ctl_t *c = m->unknown, *next; c; c = next) {
		next = c->next;
		if (now - c->opened_ns > timeout)
			ctl_drop(c, RW_ERR_TIMEOUT, "no hello within heartbeat_timeout");
	}
}

/* ---- public -------------------------------------------------------------------------------- */

uint8_t *rw_svc_mesh_mem(rw_svc_mesh_t *mesh, uint32_t rail) { return mesh->mem[rail]; }

int rw_svc_mesh_peer_up(const rw_svc_mesh_t *mesh, uint32_t peer)
{
	return peer < mesh->nodes && (peer == mesh->me || mesh->peer[peer].state == RW_SVC_PEER_UP);
}

int rw_svc_mesh_all_up(const rw_svc_mesh_t *mesh)
{
	for (uint32_t i = 0; i < mesh->nodes; i++)
		if (!rw_svc_mesh_peer_up(mesh, i))
			return 0;
	return 1;
}

uint64_t rw_svc_mesh_max_write(const rw_svc_mesh_t *mesh, uint32_t rail)
{
	return mesh->dev[rail]->caps.max_write_length;
}

rw_status_t rw_svc_mesh_send(rw_svc_mesh_t *m, uint32_t peer, uint16_t type,
			     const uint8_t *payload, uint32_t len)
{
	if (peer >= m->nodes || peer == m->me)
		return RW_ERR_INVAL;
	mesh_peer_t *p = &m->peer[peer];
	if (!p->ctl || !p->hello_ok)
		return RW_ERR_STATE;
	mesh_ctl_t *c = p->ctl;
	rw_status_t st = ctl_queue(c, type, payload, len);
	if (st != RW_OK) {
		peer_fail(p, RW_ERR_PEER, "control channel backed up");
		return RW_ERR_STATE;
	}
	if (ctl_flush(c) < 0) {
		peer_fail(p, RW_ERR_PEER, "control write error");
		return RW_ERR_STATE;
	}
	return RW_OK;
}

rw_status_t rw_svc_mesh_write(rw_svc_mesh_t *m, uint32_t peer, uint32_t rail, uint64_t local_off,
			      uint64_t remote_off, uint64_t len, uint32_t imm, void *write_ctx)
{
	if (peer >= m->nodes || peer == m->me || rail >= m->rails)
		return RW_ERR_INVAL;
	mesh_peer_t *p = &m->peer[peer];
	mesh_rail_t *mr = &p->rail[rail];
	if (p->state != RW_SVC_PEER_UP || !mr->up)
		return RW_ERR_STATE;
	if (rw_rail_range_check(m->area_bytes, local_off, len) != RW_OK ||
	    rw_rail_range_check(p->remote[rail].length, remote_off, len) != RW_OK)
		return RW_ERR_RANGE;
	mesh_wq_t *q = calloc(1, sizeof(*q));
	if (!q)
		return RW_ERR_NOMEM;
	q->w = (rw_rail_write_t){ .local = m->region[rail], .local_offset = local_off, .length = len,
				  .remote = p->remote[rail], .remote_offset = remote_off, .imm = imm,
				  .ctx = write_ctx };
	if (mr->tail)
		mr->tail->next = q;
	else
		mr->head = q;
	mr->tail = q;
	busy_begin(m, rail);
	rail_pump(mr);
	return RW_OK;
}

const rw_rail_dev_stats_t *rw_svc_mesh_rail_stats(const rw_svc_mesh_t *mesh, uint32_t rail)
{
	return mesh && rail < mesh->rails && mesh->dev[rail] ? &mesh->dev[rail]->stats : NULL;
}

void rw_svc_mesh_fail_peer(rw_svc_mesh_t *mesh, uint32_t peer, rw_status_t st, const char *why)
{
	if (peer < mesh->nodes && peer != mesh->me)
		peer_fail(&mesh->peer[peer], st, why);
}

static uint64_t random_u64(void)
{
	uint64_t v = 0;
	int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		if (read(fd, &v, sizeof(v)) != sizeof(v))
			v = 0;
		close(fd);
	}
	return v ^ rw_now_ns() ^ ((uint64_t)getpid() << 32);
}

rw_status_t rw_svc_mesh_create(rw_svc_t *svc, uint64_t area_bytes, const rw_svc_mesh_cbs_t *cbs,
			       void *ctx, rw_svc_mesh_t **mesh_p)
{
	const rw_svc_config_t *cfg = &svc->cfg;
	rw_status_t st = RW_ERR_NOMEM;
	rw_svc_mesh_t *m = calloc(1, sizeof(*m));
	if (!m)
		return RW_ERR_NOMEM;
	m->svc = svc;
	m->loop = svc->loop;
	m->cbs = *cbs;
	m->ctx = ctx;
	m->nodes = cfg->n_nodes;
	m->rails = cfg->rails;
	m->me = cfg->me;
	m->area_bytes = area_bytes;
	m->listen_fd = -1;
	m->boot_id = random_u64();
	const char *transport = rw_svc_transport_name(cfg->transport);
	m->fingerprint = rw_wire_fingerprint(cfg->cluster, &svc->topo, transport, area_bytes);
	m->peer = calloc(m->nodes, sizeof(*m->peer));
	if (!m->peer)
		goto fail;
	for (uint32_t i = 0; i < m->nodes; i++) {
		mesh_peer_t *p = &m->peer[i];
		p->mesh = m;
		p->idx = i;
		for (uint32_t r = 0; r < m->rails; r++) {
			p->rail[r].is_rail = 1;
			p->rail[r].peer = p;
			p->rail[r].rail = r;
		}
		ev_timer_init(&p->retry, retry_cb, 0., 0.);
		p->retry.data = p;
		peer_set_state(p, i == m->me ? RW_SVC_PEER_SELF : RW_SVC_PEER_DOWN);
	}

	for (uint32_t r = 0; r < m->rails; r++) {
		const rw_svc_rail_cfg_t *rc = &cfg->nodes[m->me].rails[r];
		char local[RW_RAIL_ADDR_MAX];
		if (rc->has_addr)
			snprintf(local, sizeof(local), "%s", rc->addr.text);
		else
			snprintf(local, sizeof(local), "%s:%u", rc->device, rc->device_port);
		/* pace (tcp only, config.c checks): the rail sends at its configured rate, so a
		 * loopback cluster behaves like one with NICs of that speed (docs/rdma.md). */
		rw_rail_config_t rcfg = { .transport = transport, .local = local, .rail = r,
					  .port = rc->has_addr ? rc->addr.port : 0,
					  .pace_bps = cfg->pace ? (uint64_t)(rc->rate_gbps * 1e9) : 0 };
		st = rw_rail_dev_open(&rcfg, m->loop, &m->dev[r]);
		if (st != RW_OK) {
			rw_err("rail %u: cannot open %s device %s: %s", r, transport, local, rw_status_str(st));
			goto fail;
		}
		void *mem = mmap(NULL, area_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (mem == MAP_FAILED) {
			rw_err("rail %u: cannot map %llu bytes: %m", r, (unsigned long long)area_bytes);
			m->mem[r] = NULL;
			st = RW_ERR_NOMEM;
			goto fail;
		}
		m->mem[r] = mem;
		st = rw_rail_reg_host(m->dev[r], mem, area_bytes, &m->region[r]);
		if (st != RW_OK) {
			rw_err("rail %u: cannot register memory: %s", r, rw_status_str(st));
			goto fail;
		}
		st = rw_rail_listen(m->dev[r], &rail_cbs, m, &m->listener[r]);
		if (st != RW_OK) {
			rw_err("rail %u: cannot listen on %s: %s", r, local, rw_status_str(st));
			goto fail;
		}
	}

	/* GPU memory: where a verbs rail's device cannot register a dmabuf (Soft-RoCE, older
	 * kernels or providers: the transport's probe at open), say so once; CUDA buffers then
	 * travel through the registered host memory above (the executor stages them). */
	if (cfg->transport == RW_SVC_TRANSPORT_VERBS) {
		char none[96] = "";
		size_t len = 0;
		for (uint32_t r = 0; r < m->rails && len < sizeof(none); r++)
			if (!(m->dev[r]->caps.flags & RW_RAIL_CAP_DMABUF))
				len += (size_t)snprintf(none + len, sizeof(none) - len, " %u", r);
		if (len)
			rw_info("mesh: no dmabuf registration on rail(s)%s (ibv_reg_dmabuf_mr unsupported "
				"by the device): GPU buffers are staged through registered host memory",
				none);
	}

	const rw_svc_endpoint_t *ep = &cfg->nodes[m->me].control;
	m->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	int one = 1;
	if (m->listen_fd < 0 ||
	    setsockopt(m->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
	    bind(m->listen_fd, (const struct sockaddr *)&ep->sin, sizeof(ep->sin)) < 0 ||
	    listen(m->listen_fd, 64) < 0) {
		rw_err("control: cannot listen on %s:%u: %m", ep->text, ep->port);
		st = RW_ERR_SYS;
		goto fail;
	}
	ev_io_init(&m->listen_io, listen_cb, m->listen_fd, EV_READ);
	m->listen_io.data = m;
	ev_io_start(m->loop, &m->listen_io);

	double hb = cfg->heartbeat_interval_ms / 1000.0;
	ev_timer_init(&m->hb_timer, hb_cb, hb, hb);
	m->hb_timer.data = m;
	ev_timer_start(m->loop, &m->hb_timer);

	for (uint32_t i = m->me + 1; i < m->nodes; i++)
		peer_connect(&m->peer[i]);
	rw_info("mesh: node %u of %u, %u rails over %s%s, control %s:%u", m->me, m->nodes, m->rails,
		transport, cfg->pace ? " (paced at each rail's rate_gbps)" : "", ep->text, ep->port);
	*mesh_p = m;
	return RW_OK;
fail:
	rw_svc_mesh_destroy(m);
	return st;
}

void rw_svc_mesh_destroy(rw_svc_mesh_t *m)
{
	if (!m)
		return;
	rw_svc_mesh_cbs_t none = { 0 };
	m->cbs = none; /* no callbacks during teardown */
	if (m->peer) {
		for (uint32_t i = 0; i < m->nodes; i++) {
			mesh_peer_t *p = &m->peer[i];
			ev_timer_stop(m->loop, &p->retry);
			ctl_free(p->ctl);
			p->ctl = NULL;
			for (uint32_t r = 0; r < m->rails; r++)
				rail_close(&p->rail[r], RW_ERR_PEER);
		}
	}
	while (m->unknown) {
		mesh_ctl_t *c = m->unknown;
		m->unknown = c->next;
		ctl_free(c);
	}
	ev_timer_stop(m->loop, &m->hb_timer);
	if (m->listen_fd >= 0) {
		ev_io_stop(m->loop, &m->listen_io);
		close(m->listen_fd);
	}
	for (uint32_t r = 0; r < m->rails; r++) {
		if (m->listener[r])
			rw_rail_listener_close(m->listener[r]);
		if (m->region[r])
			rw_rail_dereg(m->region[r]);
		if (m->dev[r]) {
			rail_dev_sample(m, r); /* the final counts, for the last publish */
			rw_rail_dev_close(m->dev[r]);
		}
		if (m->mem[r])
			munmap(m->mem[r], m->area_bytes);
	}
	free(m->peer);
	free(m);
}
