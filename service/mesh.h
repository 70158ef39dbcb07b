/* railwaved's peer mesh, private to service/ (docs/dataflow.md "Peer mesh"): per peer node one
 * control channel (framed messages of service/wire.h over TCP) and one rail connection per rail
 * through rdma/rail.h, the receive/send memory of each rail, heartbeats, failure detection and
 * reconnection with bounded exponential back-off. The lower node index always connects.
 * Runs on the daemon's loop; callbacks are made from the loop, never from inside a mesh call. */
#ifndef RW_SVC_MESH_H
#define RW_SVC_MESH_H

#include <stdint.h>

#include "common/common.h"
#include "rdma/rail.h"
#include "service/wire.h"

typedef struct rw_svc_mesh rw_svc_mesh_t;
struct rw_svc;

typedef struct rw_svc_mesh_cbs {
	/* Control channel and every rail of `peer` are up (first time or after a reconnect). */
	void (*peer_up)(void *ctx, uint32_t peer);
	/* `peer` went down (reset, garbage, heartbeat timeout, restart). Every write to it already
	 * got write_done(error) before this call. */
	void (*peer_down)(void *ctx, uint32_t peer, rw_status_t st);
	/* A validated COUNTS message (c->row_le points into a buffer valid during the call). */
	void (*counts)(void *ctx, uint32_t peer, const rw_wire_counts_t *c);
	void (*phase_err)(void *ctx, uint32_t peer, const rw_wire_phase_err_t *e);
	/* A validated GRANT (wave < N). */
	void (*grant)(void *ctx, uint32_t peer, const rw_wire_grant_t *g);
	/* A peer's write landed in our memory of `rail`. */
	void (*arrival)(void *ctx, uint32_t peer, uint32_t rail, const rw_rail_arrival_t *a);
	/* A write posted with rw_svc_mesh_write() finished (RW_OK: the data is remote). */
	void (*write_done)(void *ctx, void *write_ctx, rw_status_t st);
} rw_svc_mesh_cbs_t;

/* Open every rail device, allocate and register `area_bytes` of host memory per rail, listen
 * on the control and rail addresses and start connecting. */
rw_status_t rw_svc_mesh_create(struct rw_svc *svc, uint64_t area_bytes,
			       const rw_svc_mesh_cbs_t *cbs, void *ctx, rw_svc_mesh_t **mesh_p);
void rw_svc_mesh_destroy(rw_svc_mesh_t *mesh);

/* This node's memory of `rail` (area_bytes, registered on that rail). */
uint8_t *rw_svc_mesh_mem(rw_svc_mesh_t *mesh, uint32_t rail);
/* 1 when `peer` is UP (control and every rail). */
int rw_svc_mesh_peer_up(const rw_svc_mesh_t *mesh, uint32_t peer);
/* 1 when every peer is UP. */
int rw_svc_mesh_all_up(const rw_svc_mesh_t *mesh);

/* Queue one control message to `peer` (copied). RW_ERR_STATE when the peer's control channel is
 * not up; RW_ERR_NOMEM. */
rw_status_t rw_svc_mesh_send(rw_svc_mesh_t *mesh, uint32_t peer, uint16_t type,
			     const uint8_t *payload, uint32_t len);
/* Queue one write of [local_off, +len) of our `rail` memory to [remote_off, +len) of the peer's
 * `rail` memory with immediate `imm`. Never returns RW_ERR_AGAIN (the mesh queues). RW_OK:
 * write_done(write_ctx) follows exactly once. RW_ERR_STATE (peer down) / RW_ERR_RANGE: no
 * callback follows. */
rw_status_t rw_svc_mesh_write(rw_svc_mesh_t *mesh, uint32_t peer, uint32_t rail,
			      uint64_t local_off, uint64_t remote_off, uint64_t len, uint32_t imm,
			      void *write_ctx);
/* Largest single write on `rail`. */
uint64_t rw_svc_mesh_max_write(const rw_svc_mesh_t *mesh, uint32_t rail);
/* The transport's own counters of `rail`'s device (rdma/rail.h: failures by cause, writes
 * refused for a full queue, ...), live: read on the loop thread. NULL without that rail. */
const rw_rail_dev_stats_t *rw_svc_mesh_rail_stats(const rw_svc_mesh_t *mesh, uint32_t rail);
/* Declare `peer` down now (e.g. it sent a bad record): closes everything of it; it reconnects. */
void rw_svc_mesh_fail_peer(rw_svc_mesh_t *mesh, uint32_t peer, rw_status_t st, const char *why);

#endif /* RW_SVC_MESH_H */
