/* railwaved's peer mesh, private to service/ (docs/dataflow.md "Peer mesh"): per peer node one
 * control channel (framed messages of service/phase/wire.h over TCP) and one rail connection per rail
 * through rdma/rail.h, the receive/send memory of each rail, heartbeats, failure detection and
 * reconnection with bounded exponential back-off. The lower node index always connects.
 * Runs on the daemon's loop; callbacks are made from the loop, never from inside a mesh call. */
#ifndef RW_SVC_MESH_H
#define RW_SVC_MESH_H

#include <stdint.h>

#include "common/common.h"
#include "rdma/rail.h"
#include "service/mesh/rail_health.h"
#include "service/phase/phase.h"

typedef struct rw_svc_mesh rw_svc_mesh_t;
struct rw_svc;

typedef struct rw_svc_mesh_cbs {
	/* Control channel and every rail of `peer` are up (first time or after a reconnect). */
	void (*peer_up)(void *ctx, uint32_t peer);
	/* `peer` went down (reset, garbage, heartbeat timeout, restart). Every write to it already
	 * got write_done(error) before this call. */
	void (*peer_down)(void *ctx, uint32_t peer, rw_status_t st);
	/* Rail `rail` to `peer` went down while the peer stays up (docs/dataflow.md "Rail health"):
	 * called before the writes queued on it complete with errors. It reconnects in the
	 * background; rw_svc_mesh_rail_mask says when it is back. */
	void (*rail_down)(void *ctx, uint32_t peer, uint32_t rail, rw_status_t st);
	/* A validated COUNTS message (c->row_le points into a buffer valid during the call). */
	void (*counts)(void *ctx, uint32_t peer, const rw_wire_counts_t *c);
	void (*phase_err)(void *ctx, uint32_t peer, const rw_wire_phase_err_t *e);
	/* A validated GRANT (wave < N). */
	void (*grant)(void *ctx, uint32_t peer, const rw_wire_grant_t *g);
	/* A peer's write landed in our memory of `rail`. */
	void (*arrival)(void *ctx, uint32_t peer, uint32_t rail, const rw_rail_arrival_t *a);
	/* A write posted with rw_svc_mesh_write() to `peer` on `rail` finished (RW_OK: the data
	 * is remote; else the peer and rail say where it failed). */
	void (*write_done)(void *ctx, uint32_t peer, uint32_t rail, void *write_ctx, rw_status_t st);
} rw_svc_mesh_cbs_t;

/* Open every rail device, allocate and register `area_bytes` of host memory per rail, listen
 * on the control and rail addresses and start connecting. With carve_bytes, a pool of carve_max
 * group carve-outs of carve_bytes per rail is there to take (below); 0: none. */
rw_status_t rw_svc_mesh_create(struct rw_svc *svc, uint64_t area_bytes, uint64_t carve_bytes,
			       uint32_t carve_max, const rw_svc_mesh_cbs_t *cbs, void *ctx,
			       rw_svc_mesh_t **mesh_p);
void rw_svc_mesh_destroy(rw_svc_mesh_t *mesh);

/* This node's memory of `rail` (area_bytes): registered on that rail, or the host shadow of
 * the GPU memory that is (rw_svc_mesh_slab_dev). */
uint8_t *rw_svc_mesh_mem(rw_svc_mesh_t *mesh, uint32_t rail);
/* Where `rail`'s slabs are (docs/cuda.md "Where the slabs live"): -1, host memory
 * (rw_svc_mesh_mem, registered with the NIC); else the CUDA device whose memory at *dptr_p
 * (area_bytes, same offsets) is registered with the NIC through a dmabuf (GPUDirect RDMA). */
int rw_svc_mesh_slab_dev(const rw_svc_mesh_t *mesh, uint32_t rail, uint64_t *dptr_p);
/* ---- carve-outs per group (docs/rankpath.md "The slab areas, lent per group") ------------
 * The mesh's memory on a rail, as offsets: [0, area_bytes) is the shared area, and carve-out i
 * is [area_bytes + i * carve_bytes, + carve_bytes), on every node alike, so an offset names the
 * same place in a peer's memory as in ours (rw_svc_mesh_write). A carve-out is one group's
 * own memory: on each rail a separate sealed memfd, registered with the rail and announced to
 * every peer (CARVE), so that it can be lent to that group's ranks and to nobody else. */

/* Take a free carve-out of the pool for `group` (one reference held). RW_ERR_UNSUPPORTED:
 * carve-outs are off; RW_ERR_AGAIN: the pool is spent; RW_ERR_NOMEM, RW_ERR_SYS (logged). */
rw_status_t rw_svc_mesh_carve_take(rw_svc_mesh_t *mesh, const char *group, uint32_t *index_p);
void rw_svc_mesh_carve_hold(rw_svc_mesh_t *mesh, uint32_t index);
/* Drop a reference; the last one deregisters, unmaps and closes the carve-out's memfds. A rank
 * that still maps one keeps pages that nothing else uses any more (the next take makes fresh
 * ones). */
void rw_svc_mesh_carve_put(rw_svc_mesh_t *mesh, uint32_t index);
/* Shutdown, for a carve-out that a copy queued on a GPU may still read or write (a header pull
 * on a hung GPU: docs/rankpath.md "A hung GPU"); `why` says which. When it goes (its last
 * reference, or rw_svc_mesh_destroy) it is deregistered from its rails as usual, but its memory
 * — on each rail the GPU mapping with its export, the page-locked shadow, the host mapping and
 * memfd — is left to the process's exit, logged by name, never unmapped, freed or closed under
 * that copy. Not live: nothing. */
void rw_svc_mesh_carve_leave(rw_svc_mesh_t *mesh, uint32_t index, const char *why);
/* Carve-out `index`'s memfd on `rail` (what is lent; it stays the mesh's) and its bytes; -1
 * when it is not live. */
int rw_svc_mesh_carve_fd(const rw_svc_mesh_t *mesh, uint32_t index, uint32_t rail,
			 uint64_t *bytes_p);
/* The device whose memory carve-out `index` is on `rail` (its UUID in uuid_p when not NULL),
 * or -1 for host memory (or not live). A GPU carve-out's fd is a CUDA allocation's POSIX fd
 * shareable handle, its bytes the allocation's (carve_bytes rounded up to the granularity). */
int rw_svc_mesh_carve_gpu(const rw_svc_mesh_t *mesh, uint32_t index, uint32_t rail,
			  uint8_t uuid_p[16]);
/* A GPU carve-out's page-locked host shadow on `rail` (carve_bytes, laid out as the carve-out:
 * the daemon pulls the records' headers there and checks them there), or NULL (host memory, or
 * not live). */
uint8_t *rw_svc_mesh_carve_shadow(const rw_svc_mesh_t *mesh, uint32_t index, uint32_t rail);
/* 1 when the daemon's CPU reads and writes carve-out `index` in place on every rail (host
 * memory, or GPU memory mapped for the CPU: a coherent platform, the stand-in), 0 when not (a
 * discrete GPU's: only the pulls read it, so no pair whose ranks the daemon plays on the CPU may
 * use it). */
int rw_svc_mesh_carve_cpu(const rw_svc_mesh_t *mesh, uint32_t index);
/* Why the last rw_svc_mesh_carve_take failed for a reason other than the pool ("" if none). */
const char *rw_svc_mesh_carve_why(const rw_svc_mesh_t *mesh);
/* Offset of carve-out `index` in the mesh's memory (area_bytes + index * carve_bytes). */
uint64_t rw_svc_mesh_carve_off(const rw_svc_mesh_t *mesh, uint32_t index);
/* Our memory at offset `off` on `rail` (the shared area or a live carve-out), or NULL. */
uint8_t *rw_svc_mesh_at(rw_svc_mesh_t *mesh, uint32_t rail, uint64_t off);

/* 1 when `peer` is UP: control channel and, once it came up with every rail, at least one rail
 * (a rail that fails alone leaves the peer up, see rail_down). */
int rw_svc_mesh_peer_up(const rw_svc_mesh_t *mesh, uint32_t peer);
/* The rails whose connection to `peer` is up now (bit r); every rail for this node itself. */
uint32_t rw_svc_mesh_rail_mask(const rw_svc_mesh_t *mesh, uint32_t peer);
/* 1 when every peer is UP. */
int rw_svc_mesh_all_up(const rw_svc_mesh_t *mesh);

/* Queue one control message to `peer` (copied). RW_ERR_STATE when the peer's control channel is
 * not up, or when the send failed: the peer is then failed from the loop right after (its
 * callbacks never run inside this call, nor inside rw_svc_mesh_write's); RW_ERR_NOMEM. */
rw_status_t rw_svc_mesh_send(rw_svc_mesh_t *mesh, uint32_t peer, uint16_t type,
			     const uint8_t *payload, uint32_t len);
/* Queue one write of [local_off, +len) of our `rail` memory to [remote_off, +len) of the peer's
 * `rail` memory with immediate `imm` (offsets as above: each range inside the shared area or
 * one carve-out, the peer's known from its CARVE). Never returns RW_ERR_AGAIN (the mesh queues). RW_OK:
 * write_done(write_ctx) follows exactly once. RW_ERR_STATE (peer down) / RW_ERR_RANGE: no
 * callback follows. */
rw_status_t rw_svc_mesh_write(rw_svc_mesh_t *mesh, uint32_t peer, uint32_t rail,
			      uint64_t local_off, uint64_t remote_off, uint64_t len, uint32_t imm,
			      void *write_ctx);
/* Largest single write on `rail`. */
uint64_t rw_svc_mesh_max_write(const rw_svc_mesh_t *mesh, uint32_t rail);
/* Declare `peer` down (e.g. it sent a bad record): from the loop, right after this call returns,
 * everything of it is closed (write_done errors, then peer_down); it reconnects. Sends and writes
 * to it fail (RW_ERR_STATE) from now on. A send or write that finds the peer broken does the same:
 * no callback ever runs inside a mesh call. */
void rw_svc_mesh_fail_peer(rw_svc_mesh_t *mesh, uint32_t peer, rw_status_t st, const char *why);

#endif /* RW_SVC_MESH_H */
