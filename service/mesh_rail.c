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

#include "service/mesh_int.h"

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

/* Copy the transport's counters of rail's device into the metrics (svc.h). */
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
			m->cbs.write_done(m->ctx, wctx, st);
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
	mesh_rail_reclaim(mr, st);
}

rw_status_t mesh_rail_pump(mesh_rail_t *mr)
{
	if (!mr->conn || !mr->up || mr->blocked)
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
		mr->posted++;
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
