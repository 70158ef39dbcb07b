/* A peer's control sessions (docs/dataflow.md "Peer mesh", docs/security.md "Peer
 * authentication"): connecting and accepting, the authenticated handshake (HELLO, AUTH,
 * REGIONS), the dispatch of every later message, and the heartbeats and handshake deadlines.
 * Strangers' connections live in the unknown list with a bounded budget until they prove the
 * cluster key; only then are they adopted as a peer's. */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "service/mesh/mesh_int.h"

static int ctl_send_hello(mesh_ctl_t *c);
static void ctl_io_cb(struct ev_loop *loop, ev_io *w, int revents);

/* ---- control connections ---------------------------------------------------------------- */

/* Close a control connection that failed: an identified one takes its peer down. One that
 * nobody has adopted (a stranger's, or a peer's before it proved the key) is counted and
 * logged at most once a second, so that a flood of strangers cannot flood the log; the peer's
 * own session is untouched. */
static void ctl_drop(mesh_ctl_t *c, rw_status_t st, const char *why)
{
	rw_svc_mesh_t *m = c->mesh;
	if (c->peer >= 0 && m->peer[c->peer].ctl == c) {
		mesh_peer_fail(&m->peer[c->peer], st, why);
		return;
	}
	uint64_t now = rw_now_ns();
	m->auth_refused++;
	if (!m->auth_log_ns || now - m->auth_log_ns >= 1000000000ull) {
		rw_warn("control: closed %llu unauthenticated connection(s) since the last report; "
			"latest (fd %d): %s", (unsigned long long)(m->auth_refused - m->auth_refused_logged),
			c->fd, why);
		m->auth_refused_logged = m->auth_refused;
		m->auth_log_ns = now;
	}
	rw_svc_metrics_error(&m->svc->metrics, st);
	mesh_unknown_remove(m, c);
	mesh_ctl_free(c);
}

void mesh_peer_connect(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	const rw_svc_endpoint_t *ep = &m->svc->cfg.nodes[p->idx].control;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		rw_err("peer=%s: socket: %m", mesh_peer_name(m, p->idx));
		mesh_peer_schedule_retry(p);
		return;
	}
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	/* Leave from our own control address: the peer knows it from the cluster file and keeps
	 * waiting room for it that strangers cannot fill (mesh_listen_cb). */
	struct sockaddr_in mine = m->svc->cfg.nodes[m->me].control.sin;
	mine.sin_port = 0;
	if (mine.sin_addr.s_addr != htonl(INADDR_ANY) &&
	    bind(fd, (const struct sockaddr *)&mine, sizeof(mine)) < 0)
		rw_dbg("peer=%s: bind %s: %m (connecting from any address)", mesh_peer_name(m, p->idx),
		       m->svc->cfg.nodes[m->me].control.text);
	if (connect(fd, (const struct sockaddr *)&ep->sin, sizeof(ep->sin)) < 0 &&
	    errno != EINPROGRESS) {
		rw_dbg("peer=%s: connect %s:%u: %m", mesh_peer_name(m, p->idx), ep->text, ep->port);
		close(fd);
		mesh_peer_schedule_retry(p);
		return;
	}
	mesh_ctl_t *c = mesh_ctl_new(m, fd, (int)p->idx, ctl_io_cb);
	if (!c) {
		close(fd);
		mesh_peer_schedule_retry(p);
		return;
	}
	c->connecting = 1;
	c->claim = p->idx;
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

/* ---- the handshake (docs/security.md "Peer authentication") ---------------------------------
 * Connector (the lower node index)        Acceptor
 *   HELLO(nonce_c)                  ->      checks identity; nothing adopted yet
 *                                   <-      HELLO(nonce_a), AUTH(acceptor proof)
 *   checks the proof; AUTH(connector proof), REGIONS  ->  checks the proof; adopts the
 *                                                         connection as the peer's; REGIONS
 * A proof is a MAC with the cluster key over both nonces and both node ids (mesh_auth.c), so
 * it cannot be replayed on another connection; region keys and rail addresses go out only
 * once the other side's proof checked out; the session key derived from the same inputs
 * binds the rail connections. Without a key_file the key is all zeros ("auth none"). */

/* A handshake that failed: our own connection takes the peer down (ctl_drop), a stranger's is
 * closed quietly. */
static void ctl_refuse(mesh_ctl_t *c, const char *why)
{
	ctl_drop(c, RW_ERR_PROTO, why);
}

static mesh_auth_role_t my_role(const rw_svc_mesh_t *m, uint32_t peer)
{
	return m->me < peer ? MESH_AUTH_CONNECTOR : MESH_AUTH_ACCEPTOR;
}

static void ctl_auth_ids(const mesh_ctl_t *c, mesh_auth_ids_t *ids)
{
	const rw_svc_mesh_t *m = c->mesh;
	int connector = my_role(m, c->claim) == MESH_AUTH_CONNECTOR;
	ids->connector = connector ? m->me : c->claim;
	ids->acceptor = connector ? c->claim : m->me;
	ids->fingerprint = m->fingerprint;
	memcpy(ids->nonce_c, connector ? c->nonce_mine : c->nonce_peer, RW_WIRE_NONCE_SIZE);
	memcpy(ids->nonce_a, connector ? c->nonce_peer : c->nonce_mine, RW_WIRE_NONCE_SIZE);
}

/* Queue one handshake frame and flush. -1: the connection was dropped (c is gone). */
static int ctl_hs_send(mesh_ctl_t *c, uint16_t type, const uint8_t *buf, size_t n, const char *what)
{
	if (n && mesh_ctl_queue(c, type, buf, (uint32_t)n) == RW_OK && mesh_ctl_flush(c) == 0)
		return 0;
	ctl_drop(c, RW_ERR_PEER, what);
	return -1;
}

static int ctl_send_hello(mesh_ctl_t *c)
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
	h.flags = m->keyed ? RW_WIRE_HELLO_KEYED : 0;
	mesh_auth_nonce(c->nonce_mine);
	memcpy(h.nonce, c->nonce_mine, RW_WIRE_NONCE_SIZE);
	uint8_t buf[RW_WIRE_HELLO_SIZE];
	size_t n = rw_wire_hello_pack(&h, buf, sizeof(buf));
	return ctl_hs_send(c, RW_WIRE_HELLO, buf, n, "cannot send hello");
}

static int ctl_send_proof(mesh_ctl_t *c)
{
	mesh_auth_ids_t ids;
	uint8_t proof[RW_WIRE_PROOF_SIZE];
	ctl_auth_ids(c, &ids);
	mesh_auth_proof(c->mesh->key, &ids, my_role(c->mesh, c->claim), proof);
	return ctl_hs_send(c, RW_WIRE_AUTH, proof, sizeof(proof), "cannot send proof");
}

static int ctl_send_regions(mesh_ctl_t *c)
{
	rw_svc_mesh_t *m = c->mesh;
	rw_wire_regions_t r;
	memset(&r, 0, sizeof(r));
	r.rails = m->rails;
	for (uint32_t i = 0; i < m->rails; i++) {
		rw_rail_region_desc_pack(m->region[i], r.desc[i]);
		snprintf(r.rail_addr[i], RW_WIRE_ADDR_MAX, "%s", m->listener[i]->addr);
	}
	uint8_t buf[sizeof(rw_wire_regions_t) + 16];
	size_t n = rw_wire_regions_pack(&r, buf, sizeof(buf));
	/* Our live carve-outs right behind REGIONS (the peer takes nothing else before it); one
	 * taken from here on is announced on c when it is made. */
	if (n && mesh_ctl_queue(c, RW_WIRE_REGIONS, buf, (uint32_t)n) == RW_OK &&
	    mesh_carve_announce_all(c) == RW_OK && mesh_ctl_flush(c) == 0) {
		c->regions_sent = 1;
		return 0;
	}
	ctl_drop(c, RW_ERR_PEER, "cannot send regions");
	return -1;
}

/* Returns 0 to keep reading, -1 when the connection was dropped (c is gone). */
static int ctl_on_hello(mesh_ctl_t *c, const uint8_t *payload, uint32_t len)
{
	rw_svc_mesh_t *m = c->mesh;
	rw_wire_hello_t h;
	if (c->hello_in) {
		ctl_refuse(c, "second hello");
		return -1;
	}
	if (rw_wire_hello_unpack(payload, len, &h) != RW_OK) {
		ctl_refuse(c, "malformed hello");
		return -1;
	}
	if (strcmp(h.cluster, m->svc->cfg.cluster) != 0 || h.nodes != m->nodes || h.rails != m->rails ||
	    h.gpus != m->svc->cfg.gpus_per_node || h.fingerprint != m->fingerprint) {
		snprintf(c->why, sizeof(c->why), "hello from node %u refused: cluster/size/fingerprint "
			 "mismatch (cluster '%.16s' N=%u R=%u G=%u)", h.node, h.cluster, h.nodes,
			 h.rails, h.gpus);
		ctl_refuse(c, c->why);
		return -1;
	}
	if (!!(h.flags & RW_WIRE_HELLO_KEYED) != m->keyed) {
		snprintf(c->why, sizeof(c->why), "hello from node %u refused: %s", h.node, m->keyed ?
			 "it has no cluster key (auth none), this daemon has one" :
			 "it has a cluster key, this daemon none (set key_file)");
		ctl_refuse(c, c->why);
		return -1;
	}
	if (c->peer >= 0 ? h.node != (uint32_t)c->peer : h.node >= m->me) {
		snprintf(c->why, sizeof(c->why), "hello names node %u on a connection that cannot be "
			 "its", h.node);
		ctl_refuse(c, c->why);
		return -1;
	}
	c->hello_in = 1;
	c->claim = h.node;
	c->claim_boot = h.boot_id;
	memcpy(c->nonce_peer, h.nonce, RW_WIRE_NONCE_SIZE);
	if (c->peer >= 0) /* we connected: the acceptor's hello and proof come together */
		return 0;
	/* Accepted: answer with our challenge and our proof over its; adopt nothing yet. */
	if (ctl_send_hello(c) < 0)
		return -1;
	return ctl_send_proof(c);
}

/* The other side's AUTH: its proof over both nonces. */
static int ctl_on_auth(mesh_ctl_t *c, const uint8_t *payload, uint32_t len)
{
	rw_svc_mesh_t *m = c->mesh;
	mesh_auth_ids_t ids;
	if (!c->hello_in || c->authed || len != RW_WIRE_AUTH_SIZE) {
		ctl_refuse(c, "proof out of turn");
		return -1;
	}
	mesh_auth_role_t theirs = my_role(m, c->claim) == MESH_AUTH_CONNECTOR ? MESH_AUTH_ACCEPTOR
									    : MESH_AUTH_CONNECTOR;
	ctl_auth_ids(c, &ids);
	if (!mesh_auth_proof_ok(m->key, &ids, theirs, payload)) {
		snprintf(c->why, sizeof(c->why), "node %u did not prove the cluster key (wrong or no "
			 "key_file, or a replayed proof)", c->claim);
		ctl_refuse(c, c->why);
		return -1;
	}
	c->authed = 1;
	mesh_peer_t *p = &m->peer[c->claim];
	if (c->peer < 0) { /* accepted and proven: adopt it, replacing the peer's old session */
		mesh_unknown_remove(m, c);
		if (p->ctl || p->state == RW_SVC_PEER_UP)
			mesh_peer_fail(p, RW_ERR_PEER, "peer reconnected");
		ev_timer_stop(m->loop, &p->retry);
		c->peer = (int)c->claim;
		p->ctl = c;
	} else if (ctl_send_proof(c) < 0) {
		return -1;
	}
	if (p->boot_id && p->boot_id != c->claim_boot)
		rw_info("peer=%s: restarted (new boot id)", mesh_peer_name(m, p->idx));
	p->boot_id = c->claim_boot;
	mesh_auth_session(m->key, &ids, p->session);
	return ctl_send_regions(c);
}

/* The other side's REGIONS (read only once it is authenticated, mesh_ctl_read_frame). */
static int ctl_on_regions(mesh_ctl_t *c, const uint8_t *payload, uint32_t len)
{
	rw_svc_mesh_t *m = c->mesh;
	rw_wire_regions_t rg;
	mesh_peer_t *p = &m->peer[c->peer];
	if (p->hello_ok) {
		ctl_drop(c, RW_ERR_PROTO, "second regions message");
		return -1;
	}
	rw_rail_remote_t remote[RW_MAX_RAILS];
	int ok = rw_wire_regions_unpack(payload, len, &rg) == RW_OK && rg.rails == m->rails;
	for (uint32_t r = 0; ok && r < m->rails; r++)
		ok = rw_rail_remote_unpack(rg.desc[r], RW_WIRE_DESC_SIZE, &remote[r]) == RW_OK &&
		     remote[r].length >= m->area_bytes;
	if (!ok) {
		ctl_drop(c, RW_ERR_PROTO, "bad regions message (rails or region descriptors)");
		return -1;
	}
	memcpy(p->remote, remote, sizeof(remote));
	if (p->carve_known) /* this session's CARVEs follow */
		memset(p->carve_known, 0, m->carve_max);
	for (uint32_t r = 0; r < m->rails; r++)
		memcpy(p->rail_addr[r], rg.rail_addr[r], RW_WIRE_ADDR_MAX);
	p->hello_ok = 1;
	p->last_rx_ns = rw_now_ns();
	if (m->me < p->idx)
		mesh_peer_connect_rails(p);
	if (p->ctl == c)
		mesh_peer_check_up(p);
	return p->ctl == c ? 0 : -1;
}

static int ctl_on_message(mesh_ctl_t *c, const rw_wire_hdr_t *h, const uint8_t *payload)
{
	rw_svc_mesh_t *m = c->mesh;
	if (h->type == RW_WIRE_HELLO)
		return ctl_on_hello(c, payload, h->length);
	if (h->type == RW_WIRE_AUTH)
		return ctl_on_auth(c, payload, h->length);
	if (h->type == RW_WIRE_REGIONS) /* authed: mesh_ctl_read_frame takes none before */
		return ctl_on_regions(c, payload, h->length);
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
		if (p->settle_stamp && hb.echo >= p->settle_stamp) /* it lives after a rail failed */
			mesh_settle_verdict(p);
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
		mesh_peer_fail(p, RW_ERR_PEER, "said goodbye");
		return -1;
	case RW_WIRE_CARVE:
		if (mesh_carve_on_msg(p, payload, h->length) != RW_OK)
			break;
		return 0;
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
		rc = ctl_on_message(c, &h, payload); /* payload is c's: gone with it */
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
			rw_dbg("peer=%s: connect: %s", mesh_peer_name(c->mesh, (uint32_t)c->peer),
			       strerror(err));
			p->ctl = NULL;
			mesh_ctl_free(c);
			mesh_peer_set_state(p, RW_SVC_PEER_CONNECTING);
			mesh_peer_schedule_retry(p);
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

/* Room for one more connection from a member's address: when MEMBER_WAIT_MAX from it already
 * wait, the oldest gives way (a restarted node's new dial beats its own stale ones). */
static void member_make_room(rw_svc_mesh_t *m, uint32_t src)
{
	mesh_ctl_t *oldest = NULL;
	uint32_t n = 0;
	for (mesh_ctl_t *c = m->unknown; c; c = c->next)
		if (c->member_src && c->src == src) {
			oldest = c; /* the list is newest first */
			n++;
		}
	if (n >= MEMBER_WAIT_MAX)
		ctl_refuse(oldest, "gave way to a newer connection from the same node address");
}

/* Strangers get a bounded budget (UNKNOWN_MAX waiting; the rest are closed at accept). A
 * connection from a configured node's control address waits in that address's own budget, so
 * a stranger that keeps the strangers' budget full cannot keep a restarted node out
 * (docs/security.md). Only the proof admits either. */
void mesh_listen_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_mesh_t *m = w->data;
	for (;;) {
		struct sockaddr_in sa;
		socklen_t salen = sizeof(sa);
		int fd = accept4(m->listen_fd, (struct sockaddr *)&sa, &salen,
				 SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (!rw_listen_pause_on(&m->listen_pause, errno) && errno != EAGAIN &&
			    errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
				rw_warn("control accept: %m");
			return;
		}
		int member = rw_listen_member(m->ctl_members, m->me, sa.sin_addr.s_addr);
		if (member) {
			member_make_room(m, sa.sin_addr.s_addr);
		} else if (m->n_unknown >= UNKNOWN_MAX) {
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
		c->src = sa.sin_addr.s_addr;
		c->member_src = member;
		c->next = m->unknown;
		m->unknown = c;
		m->n_unknown += !member;
		mesh_ctl_update_events(c);
	}
}

/* ---- heartbeats and timeouts ------------------------------------------------------------- */

static uint64_t later_by(uint64_t t, uint64_t by, uint64_t now)
{
	return t + by < now ? t + by : now;
}

/* The time this loop did not run (descheduled, stopped with its peers, a long step) is not a
 * peer's silence. A tick later than twice the interval moves every silence clock on by the part of
 * the gap past one interval: peers stopped along with us get what was left of their timeout to
 * speak again, and what peers sent meanwhile is read as usual. A peer silent while this loop ran
 * is judged as before; a loop that is always late judges silence at the pace it runs. */
static void hb_forgive_stall(rw_svc_mesh_t *m, uint64_t now)
{
	uint64_t interval = (uint64_t)m->svc->cfg.heartbeat_interval_ms * 1000000ull;
	uint64_t last = m->hb_last_ns;
	m->hb_last_ns = now;
	if (now - last <= 2 * interval)
		return;
	uint64_t stall = now - last - interval;
	rw_dbg("heartbeat tick %llu ms late (this loop did not run): not counted as the peers' "
	       "silence", (unsigned long long)(stall / 1000000u));
	for (uint32_t i = 0; i < m->nodes; i++) {
		mesh_peer_t *p = &m->peer[i];
		if (i == m->me)
			continue;
		p->last_rx_ns = later_by(p->last_rx_ns, stall, now);
		if (p->ctl)
			p->ctl->opened_ns = later_by(p->ctl->opened_ns, stall, now);
		for (uint32_t r = 0; r < m->rails; r++)
			p->rail[r].progress_ns = later_by(p->rail[r].progress_ns, stall, now);
	}
	for (mesh_ctl_t *c = m->unknown; c; c = c->next)
		c->opened_ns = later_by(c->opened_ns, stall, now);
}

void mesh_hb_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_mesh_t *m = w->data;
	uint64_t now = rw_now_ns();
	uint64_t timeout = (uint64_t)m->svc->cfg.heartbeat_timeout_ms * 1000000ull;
	char why[96];
	hb_forgive_stall(m, now);
	for (uint32_t r = 0; r < m->rails; r++)
		mesh_rail_dev_sample(m, r); /* also while a long write is in flight, and on a pure receiver */
	for (uint32_t i = 0; i < m->nodes; i++) {
		mesh_peer_t *p = &m->peer[i];
		if (i == m->me || !p->ctl || p->ctl->connecting)
			continue;
		if (!p->hello_ok) {
			if (now - p->ctl->opened_ns > timeout) {
				snprintf(why, sizeof(why), "no authenticated hello within %u ms "
					 "(heartbeat_timeout_ms)",
					 m->svc->cfg.heartbeat_timeout_ms);
				mesh_peer_fail(p, RW_ERR_TIMEOUT, why);
			}
			continue;
		}
		if (now - p->last_rx_ns > timeout) {
			snprintf(why, sizeof(why), "nothing heard for %u ms (heartbeat_timeout_ms)",
				 m->svc->cfg.heartbeat_timeout_ms);
			mesh_peer_fail(p, RW_ERR_TIMEOUT, why);
			continue;
		}
		if (mesh_rail_stalled(p, now, 2 * timeout))
			continue;
		mesh_hb_send(p, now);
	}
	for (mesh_ctl_t *c = m->unknown, *next; c; c = next) {
		next = c->next;
		if (now - c->opened_ns > timeout) {
			snprintf(why, sizeof(why), "not authenticated within %u ms (heartbeat_timeout_ms)",
				 m->svc->cfg.heartbeat_timeout_ms);
			ctl_refuse(c, why);
		}
	}
}
