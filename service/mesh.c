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

#include "service/mesh_int.h"

/* Logs name peers as key=value by their configured name, as the stats and metrics do. */
static const char *peer_name(const rw_svc_mesh_t *m, uint32_t idx)
{
	return m->svc->cfg.nodes[idx].name;
}
static void peer_fail(mesh_peer_t *p, rw_status_t st, const char *why);
static void ctl_send_hello(mesh_ctl_t *c);
static void ctl_io_cb(struct ev_loop *loop, ev_io *w, int revents);

/* ---- control connections ---------------------------------------------------------------- */

/* Close a control connection that failed: an identified one takes its peer down. */
static void ctl_drop(mesh_ctl_t *c, rw_status_t st, const char *why)
{
	rw_svc_mesh_t *m = c->mesh;
	if (c->peer >= 0 && m->peer[c->peer].ctl == c) {
		peer_fail(&m->peer[c->peer], st, why);
		return;
	}
	if (c->peer >= 0)
		rw_warn("peer=%s: control connection closed: %s", peer_name(m, (uint32_t)c->peer), why);
	else
		rw_warn("control connection (fd %d, before hello) closed: %s", c->fd, why);
	rw_svc_metrics_error(&m->svc->metrics, st);
	mesh_unknown_remove(m, c);
	mesh_ctl_free(c);
}

/* ---- peers ------------------------------------------------------------------------------- */

void mesh_peer_set_state(mesh_peer_t *p, rw_svc_peer_state_t s)
{
	p->state = s;
	rw_svc_metrics_peer_state(&p->mesh->svc->metrics, p->idx, s);
}

static void peer_check_up(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	uint32_t up = mesh_rails_up(p);
	mesh_rails_publish(p);
	if (p->state == RW_SVC_PEER_UP || !p->ctl || !p->hello_ok || up != m->rails)
		return;
	mesh_peer_set_state(p, RW_SVC_PEER_UP);
	p->backoff_ms = 0;
	mesh_rail_fault_arm(p);
	rw_info("peer=%s: up (control and %u rails)", peer_name(m, p->idx), m->rails);
	if (m->cbs.peer_up)
		m->cbs.peer_up(m->ctx, p->idx);
}

void mesh_retry_cb(struct ev_loop *loop, ev_timer *w, int revents);

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
	int was_up = p->state == RW_SVC_PEER_UP, bye = p->said_bye;
	p->said_bye = 0;
	if (bye) { /* a clean stop: it said so before closing; not an error */
		rw_info("peer=%s: left (clean shutdown); reconnecting when it is back",
			peer_name(m, p->idx));
	} else if (p->ctl || was_up || mesh_rails_up(p)) {
		rw_warn("peer=%s: down (%s): %s", peer_name(m, p->idx), rw_status_str(st), why);
		rw_svc_metrics_error(&m->svc->metrics, st);
		m->svc->metrics.peer[p->idx].errors++;
	}
	if (p->ctl) {
		mesh_ctl_free(p->ctl);
		p->ctl = NULL;
	}
	p->hello_ok = 0;
	for (uint32_t r = 0; r < m->rails; r++) {
		mesh_rail_reset(&p->rail[r]);
		mesh_rail_close(&p->rail[r], RW_ERR_PEER);
	}
	mesh_rails_publish(p);
	mesh_peer_set_state(p, bye ? RW_SVC_PEER_DOWN : RW_SVC_PEER_FAILED);
	if (was_up && m->cbs.peer_down)
		m->cbs.peer_down(m->ctx, p->idx, st);
	peer_schedule_retry(p);
}

/* Fail the peer from the loop, not from inside the mesh call that found the failure. */
static void peer_fail_soon(mesh_peer_t *p, rw_status_t st, const char *why)
{
	rw_svc_mesh_t *m = p->mesh;
	if (p->failing)
		return;
	p->failing = 1;
	p->fail_st = st;
	snprintf(p->fail_why, sizeof(p->fail_why), "%s", why);
	if (p->ctl) /* it reads nothing more until it is failed */
		ev_io_stop(m->loop, &p->ctl->io);
	ev_timer_start(m->loop, &m->fail_timer);
}

/* The transport refused a write of rail mr: from the loop, that rail fails alone when another
 * rail lives (rail health), else its peer does. */
static void rail_fail_soon(mesh_rail_t *mr)
{
	mr->fail_soon = 1;
	ev_timer_start(mr->peer->mesh->loop, &mr->peer->mesh->fail_timer);
}

void mesh_fail_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	rw_svc_mesh_t *m = w->data;
	for (uint32_t i = 0; i < m->nodes; i++) {
		mesh_peer_t *p = &m->peer[i];
		for (uint32_t r = 0; r < m->rails && !p->failing; r++) {
			mesh_rail_t *mr = &p->rail[r];
			if (!mr->fail_soon)
				continue;
			mr->fail_soon = 0;
			if (p->state == RW_SVC_PEER_UP && mesh_rails_up(p) > (uint32_t)mr->up)
				mesh_rail_fail(mr, RW_ERR_LINK, "rail write refused");
			else if (p->state == RW_SVC_PEER_UP)
				peer_fail(p, RW_ERR_LINK, "rail write refused");
		}
		if (p->failing) {
			p->failing = 0;
			for (uint32_t r = 0; r < m->rails; r++)
				p->rail[r].fail_soon = 0;
			peer_fail(p, p->fail_st, p->fail_why);
		}
	}
}

void mesh_peer_connect(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	const rw_svc_endpoint_t *ep = &m->svc->cfg.nodes[p->idx].control;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		rw_err("peer=%s: socket: %m", peer_name(m, p->idx));
		peer_schedule_retry(p);
		return;
	}
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (connect(fd, (const struct sockaddr *)&ep->sin, sizeof(ep->sin)) < 0 &&
	    errno != EINPROGRESS) {
		rw_dbg("peer=%s: connect %s:%u: %m", peer_name(m, p->idx), ep->text, ep->port);
		close(fd);
		peer_schedule_retry(p);
		return;
	}
	mesh_ctl_t *c = mesh_ctl_new(m, fd, (int)p->idx, ctl_io_cb);
	if (!c) {
		close(fd);
		peer_schedule_retry(p);
		return;
	}
	c->connecting = 1;
	p->ctl = c;
	mesh_peer_set_state(p, RW_SVC_PEER_CONNECTING);
	mesh_ctl_update_events(c);
}

void mesh_retry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	mesh_peer_t *p = w->data;
	if (!p->ctl)
		mesh_peer_connect(p);
}

/* ---- rail connections -------------------------------------------------------------------- */

static void rail_on_connected(rw_rail_conn_t *conn, void *ctx)
{
	rw_svc_mesh_t *m;
	mesh_rail_t *mr;
	if (conn->accepted) {
		m = ctx; /* the listener's context */
		uint64_t tag = conn->tag;
		uint32_t rail = conn->dev->rail;
		if (tag >= m->me || rail >= m->rails) { /* only lower nodes connect to us */
			rw_warn("rail=%u: refusing connection from %s (tag %llu)", rail, conn->peer,
				(unsigned long long)tag);
			rw_rail_conn_close(conn);
			return;
		}
		mr = &m->peer[tag].rail[rail];
		if (rw_svc_rail_health_held(&mr->health, rw_now_ns())) { /* the test switch */
			rw_dbg("peer=%s rail=%u: refused (test switch)", peer_name(m, (uint32_t)tag), rail);
			rw_rail_conn_close(conn);
			return;
		}
		if (mr->conn && mr->up && mr->peer->state == RW_SVC_PEER_UP) /* stale: it redialed */
			mesh_rail_fail(mr, RW_ERR_LINK, "the peer connected it anew");
		else if (mr->conn)
			mesh_rail_close(mr, RW_ERR_PEER);
		mr->conn = conn;
		rw_rail_conn_set_ctx(conn, mr);
	} else {
		mr = mesh_rail_of(conn, ctx);
		if (!mr)
			return;
		m = mr->peer->mesh;
	}
	mr->up = 1;
	rw_dbg("peer=%s rail=%u: connected (%s)", peer_name(m, mr->peer->idx), mr->rail, conn->peer);
	mesh_rail_joined(mr);
	peer_check_up(mr->peer);
}

static void rail_on_error(rw_rail_conn_t *conn, void *ctx, rw_status_t st)
{
	mesh_rail_t *mr = mesh_rail_of(conn, ctx);
	if (!mr)
		return;
	rw_svc_mesh_t *m = mr->peer->mesh;
	mesh_peer_t *p = mr->peer;
	/* A peer that stops cleanly says BYE on its control channel before closing its rails,
	 * but the rail's close may be seen first. */
	if (p->ctl && p->hello_ok && mesh_ctl_bye_pending(p->ctl)) {
		p->said_bye = 1;
		peer_fail(p, RW_ERR_PEER, "said goodbye");
		return;
	}
	char why[64];
	snprintf(why, sizeof(why), "rail %u connection failed", mr->rail);
	/* Rail health: a rail that fails while the control channel and another rail live (or that
	 * was already down and failed to reconnect) takes only itself down. */
	if (p->state == RW_SVC_PEER_UP && p->ctl && p->hello_ok && !p->failing &&
	    !m->svc->stopping && (mr->health.down || mesh_rails_up(p) > (uint32_t)mr->up)) {
		mesh_rail_fail(mr, st, why);
		return;
	}
	m->svc->metrics.rail[mr->rail].errors++;
	peer_fail(p, st, why);
}

static void rail_on_write_done(rw_rail_conn_t *conn, void *ctx, void *write_ctx, rw_status_t st)
{
	mesh_rail_t *mr = mesh_rail_of(conn, ctx);
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
	mr->progress_ns = rw_now_ns();
	void *wctx = q->w.ctx;
	(void)write_ctx;
	free(q);
	/* A failed write of a rail that is about to fail alone (its on_error follows): the executor
	 * hears which rail it was before the write's error (rail health). */
	if (st != RW_OK && mr->up && !mr->health.down && mr->peer->state == RW_SVC_PEER_UP &&
	    mesh_rails_up(mr->peer) > 1 && m->cbs.rail_down)
		m->cbs.rail_down(m->ctx, mr->peer->idx, mr->rail, st);
	mesh_busy_end(m, mr->rail);
	mesh_rail_dev_sample(m, mr->rail);
	if (m->cbs.write_done)
		m->cbs.write_done(m->ctx, wctx, st);
	if (mesh_rail_pump(mr) != RW_OK)
		rail_fail_soon(mr);
}

static void rail_on_arrival(rw_rail_conn_t *conn, void *ctx, const rw_rail_arrival_t *a)
{
	mesh_rail_t *mr = mesh_rail_of(conn, ctx);
	if (!mr)
		return;
	rw_svc_mesh_t *m = mr->peer->mesh;
	mr->peer->last_rx_ns = rw_now_ns();
	if (m->cbs.arrival)
		m->cbs.arrival(m->ctx, mr->peer->idx, mr->rail, a);
}

static void rail_on_writable(rw_rail_conn_t *conn, void *ctx)
{
	mesh_rail_t *mr = mesh_rail_of(conn, ctx);
	if (!mr)
		return;
	mr->blocked = 0;
	if (mesh_rail_pump(mr) != RW_OK)
		rail_fail_soon(mr);
}

const rw_rail_conn_cbs_t mesh_rail_cbs = {
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
		rw_status_t st = rw_rail_connect(m->dev[r], p->rail_addr[r], m->me, &mesh_rail_cbs, mr, &conn);
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
	if (mesh_ctl_queue(c, RW_WIRE_HELLO, buf, (uint32_t)n) != RW_OK || mesh_ctl_flush(c) < 0)
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
		mesh_unknown_remove(m, c);
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
		rw_info("peer=%s: restarted (new boot id)", peer_name(m, p->idx));
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
	case RW_WIRE_BYE:
		/* The close that follows is a clean stop; fail the peer now so that phases with it
		 * end at once rather than at their timeout. */
		if (h->length)
			break;
		p->said_bye = 1;
		peer_fail(p, RW_ERR_PEER, "said goodbye");
		return -1;
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

/* Read what is there and handle every complete message. -1: c was dropped. */
static int ctl_read(mesh_ctl_t *c)
{
	for (;;) {
		rw_wire_hdr_t h;
		uint8_t *payload = NULL;
		rw_status_t st;
		const char *why;
		int rc = mesh_ctl_read_frame(c, &h, &payload, &st, &why);
		if (rc < 0)
			ctl_drop(c, st, why);
		if (rc <= 0)
			return rc;
		rc = ctl_on_message(c, &h, payload);
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
			rw_dbg("peer=%s: connect: %s", peer_name(c->mesh, (uint32_t)c->peer),
			       strerror(err));
			p->ctl = NULL;
			mesh_ctl_free(c);
			mesh_peer_set_state(p, RW_SVC_PEER_CONNECTING);
			peer_schedule_retry(p);
			return;
		}
		c->connecting = 0;
		ctl_send_hello(c);
		return;
	}
	if (revents & EV_WRITE) {
		if (mesh_ctl_flush(c) < 0) {
			ctl_drop(c, RW_ERR_PEER, "write error");
			return;
		}
	}
	if (revents & EV_READ)
		ctl_read(c);
}

void mesh_listen_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_mesh_t *m = w->data;
	for (;;) {
		int fd = accept4(m->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (!rw_listen_pause_on(&m->listen_pause, errno) && errno != EAGAIN &&
			    errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
				rw_warn("control accept: %m");
			return;
		}
		if (m->n_unknown >= UNKNOWN_MAX) { /* strangers get a bounded budget */
			close(fd);
			m->svc->metrics.errors[-RW_ERR_PEER]++;
			continue;
		}
		int one = 1;
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		mesh_ctl_t *c = mesh_ctl_new(m, fd, -1, ctl_io_cb);
		if (!c) {
			close(fd);
			continue;
		}
		c->next = m->unknown;
		m->unknown = c;
		m->n_unknown++;
		mesh_ctl_update_events(c);
	}
}

/* ---- heartbeats and timeouts ------------------------------------------------------------- */

/* A rail whose posted writes made no progress for `stall` ns is dead even if its connection
 * says nothing (a link that went down under TCP). Returns 1 when that took the peer down. */
static int rail_stalled(mesh_peer_t *p, uint64_t now, uint64_t stall)
{
	rw_svc_mesh_t *m = p->mesh;
	for (uint32_t r = 0; r < m->rails; r++) {
		mesh_rail_t *mr = &p->rail[r];
		if (!mr->up || !mr->posted || now - mr->progress_ns <= stall)
			continue;
		char why[96];
		snprintf(why, sizeof(why), "rail %u: no write completed for %llu ms", r,
			 (unsigned long long)((now - mr->progress_ns) / 1000000u));
		if (p->state == RW_SVC_PEER_UP && mesh_rails_up(p) > 1) {
			mesh_rail_fail(mr, RW_ERR_TIMEOUT, why);
			continue;
		}
		peer_fail(p, RW_ERR_TIMEOUT, why);
		return 1;
	}
	return 0;
}

void mesh_hb_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_mesh_t *m = w->data;
	uint64_t now = rw_now_ns();
	uint64_t timeout = (uint64_t)m->svc->cfg.heartbeat_timeout_ms * 1000000ull;
	char why[96];
	for (uint32_t r = 0; r < m->rails; r++)
		mesh_rail_dev_sample(m, r); /* also while a long write is in flight, and on a pure receiver */
	for (uint32_t i = 0; i < m->nodes; i++) {
		mesh_peer_t *p = &m->peer[i];
		if (i == m->me || !p->ctl || p->ctl->connecting)
			continue;
		if (!p->hello_ok) {
			if (now - p->ctl->opened_ns > timeout) {
				snprintf(why, sizeof(why), "no hello within %u ms (heartbeat_timeout_ms)",
					 m->svc->cfg.heartbeat_timeout_ms);
				peer_fail(p, RW_ERR_TIMEOUT, why);
			}
			continue;
		}
		if (now - p->last_rx_ns > timeout) {
			snprintf(why, sizeof(why), "nothing heard for %u ms (heartbeat_timeout_ms)",
				 m->svc->cfg.heartbeat_timeout_ms);
			peer_fail(p, RW_ERR_TIMEOUT, why);
			continue;
		}
		if (rail_stalled(p, now, 2 * timeout))
			continue;
		uint8_t buf[RW_WIRE_HEARTBEAT_SIZE];
		rw_wire_heartbeat_t hb = { .stamp = now, .echo = p->last_stamp,
					   .hold = p->last_stamp ? now - p->last_stamp_rx_ns : 0 };
		rw_wire_heartbeat_pack(&hb, buf, sizeof(buf));
		rw_svc_mesh_send(m, i, RW_WIRE_HEARTBEAT, buf, sizeof(buf));
	}
	for (mesh_ctl_t *c = m->unknown, *next; c; c = next) {
		next = c->next;
		if (now - c->opened_ns > timeout) {
			snprintf(why, sizeof(why), "no hello within %u ms (heartbeat_timeout_ms)",
				 m->svc->cfg.heartbeat_timeout_ms);
			ctl_drop(c, RW_ERR_TIMEOUT, why);
		}
	}
}

/* ---- public -------------------------------------------------------------------------------- */

uint8_t *rw_svc_mesh_mem(rw_svc_mesh_t *mesh, uint32_t rail) { return mesh->mem[rail]; }

int rw_svc_mesh_peer_up(const rw_svc_mesh_t *mesh, uint32_t peer)
{
	if (peer < mesh->nodes && peer != mesh->me && mesh->peer[peer].failing)
		return 0;
	return peer < mesh->nodes && (peer == mesh->me || mesh->peer[peer].state == RW_SVC_PEER_UP);
}

uint32_t rw_svc_mesh_rail_mask(const rw_svc_mesh_t *mesh, uint32_t peer)
{
	uint32_t all = (uint32_t)((1ull << mesh->rails) - 1), mask = 0;
	if (peer == mesh->me)
		return all;
	if (!rw_svc_mesh_peer_up(mesh, peer))
		return 0;
	for (uint32_t r = 0; r < mesh->rails; r++) /* a reconnected rail counts once it settled */
		mask |= (uint32_t)(mesh->peer[peer].rail[r].up && !mesh->peer[peer].rail[r].health.down) << r;
	return mask;
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
	if (!p->ctl || !p->hello_ok || p->failing)
		return RW_ERR_STATE;
	mesh_ctl_t *c = p->ctl;
	rw_status_t st = mesh_ctl_queue(c, type, payload, len);
	if (st != RW_OK) {
		peer_fail_soon(p, RW_ERR_PEER, "control channel backed up");
		return RW_ERR_STATE;
	}
	if (mesh_ctl_flush(c) < 0) {
		peer_fail_soon(p, RW_ERR_PEER, "control write error");
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
	if (p->state != RW_SVC_PEER_UP || !mr->up || p->failing)
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
	mesh_busy_begin(m, rail);
	if (mesh_rail_pump(mr) != RW_OK) /* this write is queued: its write_done follows the failure */
		rail_fail_soon(mr);
	return RW_OK;
}

void rw_svc_mesh_fail_peer(rw_svc_mesh_t *mesh, uint32_t peer, rw_status_t st, const char *why)
{
	if (peer < mesh->nodes && peer != mesh->me)
		peer_fail_soon(&mesh->peer[peer], st, why);
}

