/* A rail connection's side of the mesh: the queue of writes waiting for the transport, each
 * rail's busy time (the union of intervals with a write outstanding) and the transport's
 * counters copied into the metrics. These functions return a status; mesh.c fails the peer. */
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

/* Per-rail busy time = the union of intervals with a write of ours outstanding. */
void mesh_busy_begin(rw_svc_mesh_t *m, uint32_t rail)
{
	if (m->inflight[rail]++ == 0)
		m->busy_since[rail] = rw_now_ns();
}

void mesh_busy_end(rw_svc_mesh_t *m, uint32_t rail)
{
	if (m->inflight[rail] && --m->inflight[rail] == 0)
		m->svc->metrics.rail[rail].tx_busy_ns += rw_now_ns() - m->busy_since[rail];
}

/* Copy the transport's counters of rail's device into the metrics (core/svc_metrics.h). */
void mesh_rail_dev_sample(rw_svc_mesh_t *m, uint32_t rail)
{
	const rw_rail_dev_t *dev = m->dev[rail];
	if (dev) {
		rw_svc_metrics_rail_dev(&m->svc->metrics, rail, dev->stats.tx_bytes,
					dev->stats.pace_waits);
		rw_svc_metrics_rail_transport(&m->svc->metrics, rail, &dev->stats);
	}
}

void mesh_rail_reclaim(mesh_rail_t *mr, rw_status_t st)
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
		mesh_busy_end(m, mr->rail);
		if (m->cbs.write_done)
			m->cbs.write_done(m->ctx, mr->peer->idx, mr->rail, wctx, st);
		q = next;
	}
}

void mesh_rail_release_held(mesh_rail_t *mr)
{
	rw_svc_mesh_t *m = mr->peer->mesh;
	mesh_wq_t *q = mr->held;
	mr->held = mr->held_tail = NULL;
	mr->settling = mr->settle_error = 0;
	while (q) {
		mesh_wq_t *next = q->next;
		void *wctx = q->w.ctx;
		rw_status_t st = q->st;
		free(q);
		if (m->cbs.write_done)
			m->cbs.write_done(m->ctx, mr->peer->idx, mr->rail, wctx, st);
		q = next;
	}
}

void mesh_rail_close(mesh_rail_t *mr, rw_status_t st)
{
	if (mr->conn) {
		rw_rail_conn_close(mr->conn);
		mr->conn = NULL;
	}
	mr->up = 0;
	mr->fail_soon = 0;
	mesh_rail_release_held(mr); /* older than what is still queued */
	mesh_rail_reclaim(mr, st);
}

rw_status_t mesh_rail_pump(mesh_rail_t *mr)
{
	if (!mr->conn || !mr->up || mr->blocked || mr->settling)
		return RW_OK;
	mesh_wq_t *q = mr->head;
	for (uint32_t i = 0; i < mr->posted && q; i++)
		q = q->next;
	while (q) {
		rw_status_t st = rw_rail_write(mr->conn, &q->w);
		if (st == RW_ERR_AGAIN) {
			mr->blocked = 1;
			return RW_OK;
		}
		if (st != RW_OK)
			return RW_ERR_LINK;
		if (mr->posted++ == 0)
			mr->progress_ns = rw_now_ns(); /* the stall clock starts (mesh_hb_cb) */
		mesh_rail_fault_arm(mr->peer); /* the test switch's clock: the first write to the peer */
		q = q->next;
	}
	return RW_OK;
}

/* The mesh_rail_t behind a connection's context, or NULL for a not-yet-adopted accept. */
mesh_rail_t *mesh_rail_of(rw_rail_conn_t *conn, void *ctx)
{
	mesh_rail_t *mr = ctx;
	if (!mr || !mr->is_rail || mr->conn != conn)
		return NULL;
	return mr;
}

/* ---- rail health (docs/dataflow.md "Rail health") ----------------------------------------- */

uint32_t mesh_rails_up(const mesh_peer_t *p)
{
	uint32_t n = 0;
	for (uint32_t r = 0; r < p->mesh->rails; r++)
		n += p->rail[r].up;
	return n;
}

void mesh_rails_publish(mesh_peer_t *p)
{
	rw_svc_peer_metrics_t *pm = &p->mesh->svc->metrics.peer[p->idx];
	uint32_t mask = 0;
	for (uint32_t r = 0; r < p->mesh->rails; r++) {
		const rw_svc_rail_health_t *h = &p->rail[r].health;
		mask |= (uint32_t)(p->rail[r].up && !h->down) << r;
		pm->rail_failovers[r] = h->failovers;
		pm->rail_degraded_ns[r] = h->degraded_ns;
		pm->rail_down_since_ns[r] = h->down ? h->down_since_ns : 0;
	}
	pm->rail_up_mask = mask;
	pm->rails_up = mesh_rails_up(p);
}

static const char *node_name(const rw_svc_mesh_t *m, uint32_t idx)
{
	return m->svc->cfg.nodes[idx].name;
}

void mesh_rail_schedule(mesh_rail_t *mr)
{
	rw_svc_mesh_t *m = mr->peer->mesh;
	if (m->me > mr->peer->idx || m->svc->stopping) /* the lower index dials */
		return;
	uint32_t ms = rw_svc_rail_health_backoff(&mr->health, rw_now_ns());
	ev_timer_stop(m->loop, &mr->retry);
	ev_timer_set(&mr->retry, ms / 1000.0, 0.);
	ev_timer_start(m->loop, &mr->retry);
}

void mesh_rail_fail(mesh_rail_t *mr, rw_status_t st, const char *why)
{
	mesh_peer_t *p = mr->peer;
	rw_svc_mesh_t *m = p->mesh;
	int was_up = mr->up && !mr->health.down; /* the executor may have planned with it */
	mr->up = 0;
	if (rw_svc_rail_health_down(&mr->health, rw_now_ns())) {
		rw_warn("peer=%s rail=%u: rail %u of node %u (%s) down (%s): %s; the peer stays up on "
			"%u of %u rails, reconnecting the rail in the background", node_name(m, p->idx),
			mr->rail, mr->rail, p->idx, node_name(m, p->idx), rw_status_str(st), why,
			mesh_rails_up(p), m->rails);
		m->svc->metrics.rail[mr->rail].errors++;
	}
	mesh_rails_publish(p);
	if (was_up && m->cbs.rail_down) /* before the writes complete: the executor names the rail */
		m->cbs.rail_down(m->ctx, p->idx, mr->rail, st);
	mesh_rail_close(mr, RW_ERR_LINK);
	mesh_rail_schedule(mr);
}

void mesh_rail_join_fail(mesh_rail_t *mr, rw_status_t st, const char *why)
{
	mesh_peer_t *p = mr->peer;
	rw_svc_mesh_t *m = p->mesh;
	mr->up = 0;
	if (rw_svc_rail_health_down(&mr->health, rw_now_ns())) {
		rw_warn("peer=%s rail=%u: rail %u to node %u (%s) failed while the peer joins (%s): %s",
			node_name(m, p->idx), mr->rail, mr->rail, p->idx, node_name(m, p->idx),
			rw_status_str(st), why);
		m->svc->metrics.rail[mr->rail].errors++;
	}
	mesh_rail_close(mr, RW_ERR_LINK);
	mesh_rails_publish(p);
}

void mesh_rail_joined(mesh_rail_t *mr)
{
	rw_svc_mesh_t *m = mr->peer->mesh;
	ev_timer_stop(m->loop, &mr->retry);
	if (mr->health.down) { /* settle first: mesh_rail_retry_cb ends the outage */
		ev_timer_set(&mr->retry, RAIL_SETTLE_MS / 1000.0, 0.);
		ev_timer_start(m->loop, &mr->retry);
		return;
	}
	mesh_rails_publish(mr->peer);
}

/* A reconnected rail stayed up for RAIL_SETTLE_MS: its outage is over. */
static void rail_settled(mesh_rail_t *mr)
{
	rw_svc_mesh_t *m = mr->peer->mesh;
	uint64_t outage = rw_svc_rail_health_up(&mr->health, rw_now_ns());
	if (outage)
		rw_info("peer=%s rail=%u: rail %u of node %u (%s) back up after %.1f s; it rejoins at "
			"the next phase", node_name(m, mr->peer->idx), mr->rail, mr->rail, mr->peer->idx,
			node_name(m, mr->peer->idx), (double)outage / 1e9);
	mesh_rails_publish(mr->peer);
}

void mesh_rail_reset(mesh_rail_t *mr)
{
	ev_timer_stop(mr->peer->mesh->loop, &mr->retry);
	rw_svc_rail_health_up(&mr->health, rw_now_ns());
}

void mesh_rail_retry_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	mesh_rail_t *mr = w->data;
	mesh_peer_t *p = mr->peer;
	rw_svc_mesh_t *m = p->mesh;
	if (p->state != RW_SVC_PEER_UP || p->failing || !mr->health.down)
		return;
	if (mr->conn) {
		if (mr->up)
			rail_settled(mr);
		return;
	}
	if (rw_svc_rail_health_held(&mr->health, rw_now_ns())) {
		mesh_rail_schedule(mr);
		return;
	}
	if (m->dial(mr) != RW_OK)
		mesh_rail_schedule(mr);
}

void mesh_rail_fault_arm(mesh_peer_t *p)
{
	rw_svc_mesh_t *m = p->mesh;
	if (!m->fault.on || m->fault.fired || m->fault.peer != p->idx || ev_is_active(&m->fault_timer))
		return;
	ev_timer_set(&m->fault_timer, m->fault.at_ms / 1000.0, 0.);
	ev_timer_start(m->loop, &m->fault_timer);
}

void mesh_rail_fault_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	rw_svc_mesh_t *m = w->data;
	mesh_peer_t *p = &m->peer[m->fault.peer];
	mesh_rail_t *mr = &p->rail[m->fault.rail];
	m->fault.fired = 1;
	mr->health.hold_until_ns = rw_now_ns() + (uint64_t)m->fault.for_ms * 1000000ull;
	if (p->state != RW_SVC_PEER_UP || !mr->up || mesh_rails_up(p) < 2) {
		rw_warn("test switch RAILWAVE_TEST_RAIL_DOWN: peer=%s rail=%u is not up beside another "
			"rail; nothing closed", node_name(m, p->idx), mr->rail);
		return;
	}
	rw_warn("test switch RAILWAVE_TEST_RAIL_DOWN: closing rail %u to node %u (%s), refusing it "
		"for %u ms", mr->rail, p->idx, node_name(m, p->idx), m->fault.for_ms);
	mesh_rail_fail(mr, RW_ERR_LINK, "closed by the test switch");
}
