/* railwaved's peer mesh (service/mesh/mesh.h, docs/dataflow.md "Peer mesh"): the peers' state,
 * failure (deferred out of mesh calls) and reconnect back-off; one rail connection per (peer,
 * rail) through rdma/rail.h, bound to the peer's authenticated session; the public API. The
 * control sessions that bring a peer up are mesh_session.c's. Everything runs on the daemon's
 * loop. Peer input is untrusted: a bad frame closes that peer's channel (it reconnects), never
 * anything else. */
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

#include "service/mesh/mesh_int.h"

/* Logs name peers as key=value by their configured name, as the stats and metrics do. */
const char *mesh_peer_name(const rw_svc_mesh_t *m, uint32_t idx)
{
	return m->svc->cfg.nodes[idx].name;
}

/* ---- peers ------------------------------------------------------------------------------- */

void mesh_peer_set_state(mesh_peer_t *p, rw_svc_peer_state_t s)
{
	p->state = s;
	rw_svc_metrics_peer_state(&p->mesh->svc->metrics, p->idx, s);
}

static void mesh_peer_up(mesh_peer_t *p);

void mesh_peer_check_up(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	uint32_t up = mesh_rails_up(p);
	mesh_rails_publish(p);
	if (p->state == RW_SVC_PEER_UP || !p->ctl || !p->hello_ok)
		return;
	if (up == m->rails) {
		rw_info("peer=%s: up (control and %u rails)", mesh_peer_name(m, p->idx), m->rails);
		mesh_peer_up(p);
	} else if (!ev_is_active(&p->join)) { /* the rails get heartbeat_timeout_ms to connect */
		ev_timer_set(&p->join, m->svc->cfg.heartbeat_timeout_ms / 1000.0, 0.);
		ev_timer_start(m->loop, &p->join);
	}
}

/* Up: the rails that are not connected count as down (the join timer marked them). */
static void mesh_peer_up(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	ev_timer_stop(m->loop, &p->join);
	mesh_peer_set_state(p, RW_SVC_PEER_UP);
	p->backoff_ms = 0;
	if (m->cbs.peer_up)
		m->cbs.peer_up(m->ctx, p->idx);
}

void mesh_peer_join_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	mesh_peer_t *p = w->data;
	rw_svc_mesh_t *m = p->mesh;
	const uint32_t ms = m->svc->cfg.heartbeat_timeout_ms;
	if (p->state == RW_SVC_PEER_UP || !p->ctl || !p->hello_ok || p->failing)
		return;
	if (mesh_rails_up(p) == 0) {
		char why[96];
		snprintf(why, sizeof(why), "no rail connected within %u ms (heartbeat_timeout_ms)", ms);
		mesh_peer_fail(p, RW_ERR_TIMEOUT, why);
		return;
	}
	char missing[4 * RW_MAX_RAILS + 1] = "";
	size_t len = 0;
	for (uint32_t r = 0; r < m->rails; r++) {
		mesh_rail_t *mr = &p->rail[r];
		if (mr->up)
			continue;
		rw_svc_rail_health_down(&mr->health, rw_now_ns()); /* a dial may still be under way */
		len += (size_t)snprintf(missing + len, sizeof(missing) - len, " %u", r);
	}
	rw_warn("peer=%s: up on %u of %u rails: rail(s)%s did not connect within %u ms "
		"(heartbeat_timeout_ms); reconnecting them in the background", mesh_peer_name(m, p->idx),
		mesh_rails_up(p), m->rails, missing, ms);
	mesh_rails_publish(p);
	mesh_peer_up(p);
	for (uint32_t r = 0; r < m->rails; r++)
		if (!p->rail[r].up && !p->rail[r].conn)
			mesh_rail_schedule(&p->rail[r]);
}

void mesh_peer_schedule_retry(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	if (m->me > p->idx || m->svc->stopping) /* the lower index connects */
		return;
	p->backoff_ms = p->backoff_ms ? RW_MIN(p->backoff_ms * 2, BACKOFF_MAX_MS) : BACKOFF_MIN_MS;
	ev_timer_stop(m->loop, &p->retry);
	ev_timer_set(&p->retry, p->backoff_ms / 1000.0, 0.);
	ev_timer_start(m->loop, &p->retry);
}

void mesh_peer_fail(mesh_peer_t *p, rw_status_t st, const char *why)
{
	rw_svc_mesh_t *m = p->mesh;
	int was_up = p->state == RW_SVC_PEER_UP, bye = p->said_bye;
	p->settle_stamp = 0; /* a rail failure waiting for its verdict was the peer's */
	ev_timer_stop(m->loop, &p->settle);
	for (uint32_t r = 0; r < m->rails; r++)
		for (mesh_wq_t *q = p->rail[r].held; q; q = q->next)
			q->st = RW_ERR_PEER;
	p->said_bye = 0;
	if (bye) { /* a clean stop: it said so before closing; not an error */
		rw_info("peer=%s: left (clean shutdown); reconnecting when it is back",
			mesh_peer_name(m, p->idx));
	} else if (p->ctl || was_up || mesh_rails_up(p)) {
		rw_warn("peer=%s: down (%s): %s", mesh_peer_name(m, p->idx), rw_status_str(st), why);
		rw_svc_metrics_error(&m->svc->metrics, st);
		m->svc->metrics.peer[p->idx].errors++;
	}
	if (p->ctl) {
		mesh_ctl_free(p->ctl);
		p->ctl = NULL;
	}
	ev_timer_stop(m->loop, &p->join);
	p->hello_ok = 0;
	mesh_auth_wipe(p->session, sizeof(p->session));
	for (uint32_t r = 0; r < m->rails; r++) {
		mesh_rail_reset(&p->rail[r]);
		mesh_rail_close(&p->rail[r], RW_ERR_PEER);
		p->rail[r].dial = 0; /* the next session numbers its rail dials afresh */
	}
	mesh_rails_publish(p);
	mesh_peer_set_state(p, bye ? RW_SVC_PEER_DOWN : RW_SVC_PEER_FAILED);
	if (was_up && m->cbs.peer_down)
		m->cbs.peer_down(m->ctx, p->idx, st);
	mesh_peer_schedule_retry(p);
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
				mesh_peer_fail(p, RW_ERR_LINK, "rail write refused");
		}
		if (p->failing) {
			p->failing = 0;
			for (uint32_t r = 0; r < m->rails; r++)
				p->rail[r].fail_soon = 0;
			mesh_peer_fail(p, p->fail_st, p->fail_why);
		}
	}
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
		mesh_peer_t *p = &m->peer[tag];
		mr = &p->rail[rail];
		/* Only once the peer has proven the key, and (transports with proofs) only a dial
		 * whose proof carried a number above the last one taken (rail_on_verify): a
		 * stranger's or a replayed handshake never gets here. */
		if (!p->ctl || !p->ctl->authed) {
			rw_warn("peer=%s rail=%u: refusing a rail connection from %s (no authenticated "
				"session)", mesh_peer_name(m, p->idx), rail, conn->peer);
			rw_rail_conn_close(conn);
			return;
		}
		if (rw_svc_rail_health_held(&mr->health, rw_now_ns())) { /* the test switch */
			rw_dbg("peer=%s rail=%u: refused (test switch)", mesh_peer_name(m, p->idx), rail);
			rw_rail_conn_close(conn);
			return;
		}
		/* The peer redialed this rail: the connection we still hold is stale (its failure
		 * has not reached us yet). */
		if (mr->conn && mr->up && p->state == RW_SVC_PEER_UP)
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
	rw_dbg("peer=%s rail=%u: connected (%s)", mesh_peer_name(m, mr->peer->idx), mr->rail, conn->peer);
	mesh_rail_joined(mr);
	mesh_peer_check_up(mr->peer);
}

void mesh_hb_send(mesh_peer_t *p, uint64_t now)
{
	uint8_t buf[RW_WIRE_HEARTBEAT_SIZE];
	rw_wire_heartbeat_t hb = { .stamp = now, .echo = p->last_stamp,
				   .hold = p->last_stamp ? now - p->last_stamp_rx_ns : 0 };
	rw_wire_heartbeat_pack(&hb, buf, sizeof(buf));
	rw_svc_mesh_send(p->mesh, p->idx, RW_WIRE_HEARTBEAT, buf, sizeof(buf));
}

/* A rail fails while its peer's control channel looks alive: a rail's own failure, or the first
 * close of a peer that died. The verdict waits for proof (mesh_peer_t.settle_stamp); the rail
 * posts nothing meanwhile. */
static void rail_settle_begin(mesh_rail_t *mr)
{
	mesh_peer_t *p = mr->peer;
	mr->settling = 1;
	if (p->settle_stamp)
		return;
	p->settle_stamp = rw_now_ns();
	ev_timer_set(&p->settle, p->mesh->svc->cfg.heartbeat_timeout_ms / 1000.0, 0.);
	ev_timer_start(p->mesh->loop, &p->settle);
	mesh_hb_send(p, p->settle_stamp);
}

/* The rail's failure, the peer being alive: the rail fails alone while another lives (rail
 * health), else the peer does, as when the rail's failure was seen (rail_on_error). Returns 1
 * when the peer failed. */
static int rail_settle_alone(mesh_rail_t *mr)
{
	mesh_peer_t *p = mr->peer;
	rw_svc_mesh_t *m = p->mesh;
	const int others = mesh_rails_up(p) > (uint32_t)mr->up;
	if (mr->settle_error && !others) { /* its last rail: the peer goes */
		m->svc->metrics.rail[mr->rail].errors++;
		mesh_peer_fail(p, mr->settle_st, mr->settle_why);
		return 1;
	}
	if (mr->settle_error) { /* the connection is gone: the rail fails, its writes with it */
		mesh_rail_fail(mr, mr->settle_st, mr->settle_why);
		return 0;
	}
	/* Only writes failed so far: the executor hears which rail it was before their errors (its
	 * on_error usually follows, and fails the rail) */
	if (others && mr->up && !mr->health.down && m->cbs.rail_down)
		m->cbs.rail_down(m->ctx, p->idx, mr->rail, mr->held ? mr->held->st : RW_ERR_LINK);
	mesh_rail_release_held(mr);
	if (mesh_rail_pump(mr) != RW_OK)
		rail_fail_soon(mr);
	return 0;
}

void mesh_settle_verdict(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	p->settle_stamp = 0;
	ev_timer_stop(m->loop, &p->settle);
	for (uint32_t r = 0; r < m->rails; r++)
		if (p->rail[r].settling && rail_settle_alone(&p->rail[r]))
			return;
}

void mesh_settle_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	mesh_peer_t *p = w->data;
	if (p->failing || !p->settle_stamp) /* fail_cb fails the peer: its rails' close delivers */
		return;
	if (p->ctl && p->hello_ok && mesh_ctl_peer_closed(p->ctl)) {
		mesh_peer_fail(p, RW_ERR_PEER, "closed its control and rail connections");
		return;
	}
	mesh_settle_verdict(p); /* nothing proves it died: heartbeats judge the peer itself */
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
		mesh_peer_fail(p, RW_ERR_PEER, "said goodbye");
		return;
	}
	char why[64];
	snprintf(why, sizeof(why), "rail %u connection failed", mr->rail);
	/* A peer that died closes its control connection with its rails; the rail's close may be
	 * seen first. That is the peer's failure, not a rail's (no "retry on the other rails"). */
	if (p->ctl && p->hello_ok && mesh_ctl_peer_closed(p->ctl)) {
		snprintf(why, sizeof(why), "closed its control and rail %u connections", mr->rail);
		mesh_peer_fail(p, RW_ERR_PEER, why);
		return;
	}
	/* Rail health: a rail that fails while the control channel and another rail live (or that
	 * was already down and failed to reconnect) takes only itself down — once the grace shows
	 * the peer's control connection lives on (rail_settle_begin). */
	if (p->state == RW_SVC_PEER_UP && p->ctl && p->hello_ok && !p->failing &&
	    !m->svc->stopping && (mr->health.down || mesh_rails_up(p) > (uint32_t)mr->up)) {
		if (mr->health.down) { /* a redial that failed: no peer failure hides behind it */
			mesh_rail_fail(mr, st, why);
			return;
		}
		mr->settle_error = 1;
		mr->settle_st = st;
		snprintf(mr->settle_why, sizeof(mr->settle_why), "%s", why);
		rail_settle_begin(mr);
		return;
	}
	/* While the peer joins, a rail that fails is down, not the peer (a node with a dead NIC
	 * joins on its other rails); the join timer decides (mesh_rail_join_cb). */
	if (p->state != RW_SVC_PEER_UP && p->ctl && p->hello_ok && !p->failing && !m->svc->stopping) {
		mesh_rail_join_fail(mr, st, why);
		mesh_peer_check_up(p);
		return;
	}
	m->svc->metrics.rail[mr->rail].errors++;
	mesh_peer_fail(p, st, why);
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
	/* A failed write while the peer looks alive on other rails: the rail's own failure, or its
	 * peer's death (rail_settle_begin). Its completion waits for the verdict, so the executor
	 * hears which it was before the write's error. */
	if (st != RW_OK && (mr->settling || (mr->up && !mr->health.down &&
	    mr->peer->state == RW_SVC_PEER_UP && !mr->peer->failing && mesh_rails_up(mr->peer) > 1 &&
	    m->cbs.rail_down && !(mr->peer->ctl && mesh_ctl_peer_closed(mr->peer->ctl))))) {
		q->next = NULL;
		q->st = st;
		if (mr->held_tail)
			mr->held_tail->next = q;
		else
			mr->held = q;
		mr->held_tail = q;
		mesh_busy_end(m, mr->rail);
		rail_settle_begin(mr);
		return;
	}
	free(q);
	mesh_busy_end(m, mr->rail);
	mesh_rail_dev_sample(m, mr->rail);
	if (m->cbs.write_done)
		m->cbs.write_done(m->ctx, mr->peer->idx, mr->rail, wctx, st);
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
	/* The place as an offset of the mesh's memory (a carve-out's past the shared area). */
	rw_rail_arrival_t at = *a;
	if (a->region && !mesh_carve_offset(m, mr->rail, a->region, a->offset, &at.offset))
		at.region = NULL, at.offset = 0;
	if (m->cbs.arrival)
		m->cbs.arrival(m->ctx, mr->peer->idx, mr->rail, &at);
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

/* The rail handshake's proofs (transports with RW_RAIL_CAP_PROOF): MACs with the peer's
 * session key, so a rail connection is bound to the authenticated control session. */
static int rail_on_verify(rw_rail_conn_t *conn, void *ctx, const uint8_t proof[RW_RAIL_PROOF_SIZE],
			  uint8_t *reply_p)
{
	uint64_t dial;
	if (!conn->accepted) { /* the acceptor's reply must answer this very dial */
		mesh_rail_t *mr = mesh_rail_of(conn, ctx);
		return mr && mesh_auth_rail_proof_ok(mr->peer->session, MESH_AUTH_ACCEPTOR, mr->rail,
						     proof, &dial) && dial == mr->dial ? 0 : -1;
	}
	rw_svc_mesh_t *m = ctx; /* the listener's context */
	uint64_t tag = conn->tag;
	uint32_t rail = conn->dev->rail;
	if (tag >= m->me || rail >= m->rails || !reply_p)
		return -1;
	mesh_peer_t *p = &m->peer[tag];
	mesh_rail_t *mr = &p->rail[rail];
	if (rw_svc_rail_health_held(&mr->health, rw_now_ns()))
		return -1; /* the test switch: like a dead NIC, no handshake completes */
	if (!p->ctl || !p->ctl->authed ||
	    !mesh_auth_rail_proof_ok(p->session, MESH_AUTH_CONNECTOR, rail, proof, &dial) ||
	    dial <= mr->dial) /* a replay, or an older dial than one already taken */
		return -1;
	mr->dial = dial;
	mesh_auth_rail_proof(p->session, MESH_AUTH_ACCEPTOR, rail, dial, reply_p);
	return 0;
}

const rw_rail_conn_cbs_t mesh_rail_cbs = {
	.on_verify = rail_on_verify,
	.on_connected = rail_on_connected,
	.on_error = rail_on_error,
	.on_write_done = rail_on_write_done,
	.on_arrival = rail_on_arrival,
	.on_writable = rail_on_writable,
};

void mesh_peer_connect_rails(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	for (uint32_t r = 0; r < m->rails; r++) {
		mesh_rail_t *mr = &p->rail[r];
		if (mr->conn)
			continue;
		if (rw_svc_rail_health_held(&mr->health, rw_now_ns()))
			mesh_rail_join_fail(mr, RW_ERR_LINK, "refused by the test switch");
		else if (mesh_rail_dial(mr) != RW_OK)
			mesh_rail_join_fail(mr, RW_ERR_LINK, "cannot start a rail connection");
	}
}

rw_status_t mesh_rail_dial(mesh_rail_t *mr)
{
	mesh_peer_t *p = mr->peer;
	rw_svc_mesh_t *m = p->mesh;
	rw_rail_conn_t *conn;
	rw_status_t st = rw_rail_connect(m->dev[mr->rail], p->rail_addr[mr->rail], m->me,
					 &mesh_rail_cbs, mr, &conn);
	if (st != RW_OK)
		return st;
	uint8_t proof[RW_RAIL_PROOF_SIZE];
	mesh_auth_rail_proof(p->session, MESH_AUTH_CONNECTOR, mr->rail, ++mr->dial, proof);
	rw_rail_conn_set_proof(conn, proof); /* before the loop runs its handshake */
	mr->conn = conn;
	return RW_OK;
}

int mesh_rail_stalled(mesh_peer_t *p, uint64_t now, uint64_t stall)
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
		mesh_peer_fail(p, RW_ERR_TIMEOUT, why);
		return 1;
	}
	return 0;
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
	rw_rail_region_t *local;
	rw_rail_remote_t remote;
	uint64_t local_at, remote_at;
	if (mesh_carve_local(m, rail, local_off, len, &local, &local_at) != RW_OK ||
	    mesh_carve_remote(p, rail, remote_off, len, &remote, &remote_at) != RW_OK)
		return RW_ERR_RANGE;
	mesh_wq_t *q = calloc(1, sizeof(*q));
	if (!q)
		return RW_ERR_NOMEM;
	q->w = (rw_rail_write_t){ .local = local, .local_offset = local_at, .length = len,
				  .remote = remote, .remote_offset = remote_at, .imm = imm,
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

