/* Fakes for the in-process executor test (tests/service/test_exec.c): link-time definitions of
 * the peer mesh (service/mesh/mesh.h) and of the IPC server face (ipc/ipc.h) that the phase executor
 * calls, so several executors run in one process on one libev loop and the test decides, event
 * by event, what the "network" delivers. Private to tests/service/.
 *
 * The world: one queue of events (control messages, rail writes, write completions, peer up /
 * down notices). Mesh calls only enqueue; callbacks are made when the test pumps
 * (fk_step/fk_pump), never from inside a mesh call (mesh.h's contract), unless the world is put
 * in `sync_teardown` mode, which reproduces what service/mesh/mesh.c really does when a control
 * write to a dead peer fails (the peer is torn down inside rw_svc_mesh_send).
 * Ordering rules (what TCP/RC connections guarantee): control messages of one (src, dst) and
 * writes and write completions of one (src, dst, rail) are delivered in the order posted; peer
 * notices of one (node, peer) in order; everything else may be reordered (seeded random mode). */
#ifndef RW_TEST_EXEC_FAKES_H
#define RW_TEST_EXEC_FAKES_H

#include <stdint.h>

#include <ev.h>

#include "ipc/ipc.h"
#include "service/mesh/mesh.h"

#define FK_MAX_NODES 8

typedef enum fk_ev_kind {
	FK_EV_CTRL = 0,      /* control message src -> dst (type, payload) */
	FK_EV_WRITE = 1,     /* rail write src -> dst: bytes copied at delivery, then arrival */
	FK_EV_WDONE = 2,     /* write_done at src for its write to dst */
	FK_EV_PEER_DOWN = 3, /* node dst learns that peer src is down */
	FK_EV_PEER_UP = 4,   /* node dst learns that peer src is up */
	FK_EV_KINDS = 5,
} fk_ev_kind_t;

typedef struct fk_ev {
	fk_ev_kind_t kind;
	uint64_t seq;            /* post order, world-wide */
	uint32_t src, dst;
	uint32_t gen;            /* the connection generation of (src, dst) it was posted on */
	/* CTRL */
	uint16_t type;
	uint8_t *payload;
	uint32_t len;
	/* WRITE / WDONE */
	uint32_t rail;
	uint64_t local_off, remote_off, wlen;
	uint32_t imm;
	void *wctx;
	rw_status_t st;
	int injected;            /* a write the test made up: no write_done goes back */
} fk_ev_t;

/* A test's choice about one event: 1 = this one (hold it back / drop it), 0 = not. */
typedef int (*fk_hold_fn)(const fk_ev_t *ev, void *ctx);
/* Sees a write's bytes in the destination memory right after they were copied there (with
 * dev_slabs: in a bounce copy just before they land; a change lands too). */
typedef void (*fk_write_fn)(const fk_ev_t *ev, uint8_t *dst_bytes, void *ctx);

typedef struct fk_counters {
	/* writes posted per immediate kind (0 dispatch, 1 combine) and (src, dst) */
	uint32_t writes[2][FK_MAX_NODES][FK_MAX_NODES];
	/* control messages posted / delivered per type and (src, dst) */
	uint32_t ctrl_posted[8][FK_MAX_NODES][FK_MAX_NODES];
	uint32_t ctrl_delivered[8][FK_MAX_NODES][FK_MAX_NODES];
	uint32_t write_errors[FK_MAX_NODES]; /* write_done(error) delivered to a node */
	uint32_t fail_peer[FK_MAX_NODES][FK_MAX_NODES]; /* rw_svc_mesh_fail_peer(node, peer) */
	uint32_t peer_down[FK_MAX_NODES];    /* peer_down callbacks made to a node */
} fk_counters_t;

typedef struct fk_world {
	struct ev_loop *loop;
	uint32_t nodes, rails;
	uint64_t max_write;      /* rw_svc_mesh_max_write(); 0: the device names no limit */
	int random_order;        /* 0: FIFO; 1: seeded random among the deliverable events */
	uint64_t rng;
	int sync_teardown;       /* emulate the mesh's synchronous peer teardown */
	/* Slabs on a GPU (set before the executors are created): every node's rail memory is CUDA
	 * memory of device 0 (rw_svc_mesh_slab_dev says so), its host memory only the shadow, and a
	 * write is copied from the writer's device memory into the target's, as a NIC does with
	 * GPUDirect RDMA: nothing lands in the shadow. */
	int dev_slabs;
	fk_hold_fn hold;         /* events it says 1 for stay queued (and block their channel) */
	void *hold_ctx;
	fk_write_fn on_write;
	void *on_write_ctx;
	/* A hostile member: node misplace_src's next dispatch write to misplace_dst lands
	 * misplace_by bytes away from where the executor posted it (and its arrival says so).
	 * 0: off. */
	int64_t misplace_by;
	uint32_t misplace_src, misplace_dst;
	fk_counters_t cnt;
	uint32_t violations;     /* contract breaches seen by the fakes (double completions, ...) */
	char violation[256];     /* the first one, for the failure message */
} fk_world_t;

extern fk_world_t *fk_world;

/* A world of `nodes` nodes x `rails` rails on `loop`; delivery order from `seed` when random.
 * One world at a time (the fakes are link-time functions with no context): fk_world. */
fk_world_t *fk_world_new(struct ev_loop *loop, uint32_t nodes, uint32_t rails, int random_order,
			 uint64_t seed);
/* Every mesh and IPC server must have been destroyed; frees the fake clients too. */
void fk_world_free(fk_world_t *w);

/* Deliver one deliverable event (FIFO or random). Returns 0 when none is deliverable. Runs the
 * fake IPC's deferred client drops first (ipc.h: they happen in the loop's next prepare phase). */
int fk_step(fk_world_t *w);
/* Events in the queue (deliverable or held). */
uint32_t fk_pending(const fk_world_t *w);
/* Remove the events for which pred says 1 (CTRL only: a lost message; the caller's business). */
uint32_t fk_drop(fk_world_t *w, fk_hold_fn pred, void *ctx);

/* The process of node n dies: its queued messages and writes are lost, and every live peer gets
 * peer_down(n) (after write_done(error) for each of its writes to n). Its executor must then be
 * torn down by the test (nothing it does reaches anyone). */
void fk_kill(fk_world_t *w, uint32_t n);
/* Node n dies silently: no notice; each write to it fails on its own when delivered (a transport
 * error), control messages to it are lost, and in sync_teardown mode a control send to it tears
 * the peer down inside the send, as service/mesh/mesh.c does. fk_kill() later sends the notices. */
void fk_kill_silent(fk_world_t *w, uint32_t n);
int fk_alive(const fk_world_t *w, uint32_t n);
/* A write from src's memory of `rail` (offset 0) to dst's at remote_off that no executor posted
 * (a peer that misbehaves): delivered like any other, but no write_done goes back. */
/* The bytes of node's memory per rail (what the executor asked the mesh for). */
uint64_t fk_area_bytes(uint32_t node);
void fk_inject_write(fk_world_t *w, uint32_t src, uint32_t dst, uint32_t rail, uint64_t remote_off,
		     uint64_t len, uint32_t imm);
/* 1 when every live node sees every other live node up and no peer notice is queued. */
int fk_all_up(const fk_world_t *w);

/* ---- fake IPC clients ("ranks") ----------------------------------------------------------- */

typedef struct fk_client_stats {
	uint32_t n_cqe;          /* completions received */
	uint32_t owed;           /* submissions not answered yet */
	int joined, left, dropped;
	int drop_error;          /* the error of rw_ipc_client_drop */
} fk_client_stats_t;

/* A rank that connects to node `node`'s IPC server (which must exist). */
rw_ipc_client_t *fk_client_new(fk_world_t *w, uint32_t node, const char *group, uint32_t rank,
			       uint32_t world_size, uint32_t local_gpu);
/* Hello done: client_joined. */
void fk_client_join(rw_ipc_client_t *c);
/* A host buffer of `size` bytes (zeroed); returns its id, *mem_p its memory. */
uint32_t fk_client_buffer(rw_ipc_client_t *c, uint64_t size, uint8_t **mem_p);
/* A CUDA buffer of `size` bytes on device 0 of the stand-in driver ($RW_CUDA_DRIVER =
 * tests/cuda/libfakecuda.so, whose device memory is host-addressable: *mem_p is that address).
 * Returns 0 when no driver is usable. */
uint32_t fk_client_cuda_buffer(rw_ipc_client_t *c, uint64_t size, uint8_t **mem_p);
/* Forget a buffer (its id becomes unknown; memory kept until the world is freed). */
void fk_client_forget_buffer(rw_ipc_client_t *c, uint32_t id);
/* Hand a submission to the service (as if it passed the server's checks). */
void fk_client_submit(rw_ipc_client_t *c, const rw_sqe_t *sqe);
/* The process died: client_left(EOF) now. */
void fk_client_die(rw_ipc_client_t *c);
void fk_client_stats(const rw_ipc_client_t *c, fk_client_stats_t *s);
/* Completion i (0-based) received by the client. */
const rw_cqe_t *fk_client_cqe(const rw_ipc_client_t *c, uint32_t i);
/* Node's fake mesh, to inject a peer's messages as if that node had sent them. */
rw_svc_mesh_t *fk_mesh(uint32_t node);
/* The reason the executor gave with the client's last error completion ("" if none). */
const char *fk_client_notice(const rw_ipc_client_t *c);
/* Keeps of its buffers the service holds (rw_ipc_client_keep): while any is held after the
 * client left, its buffers are still allocated. */
unsigned fk_client_keeps(const rw_ipc_client_t *c);
/* Give the client stream-order event `id` whose flag is a word of the stand-in's device 0
 * memory (returned: host-addressable); rw_ipc_signal_now writes it and counts. */
uint32_t *fk_client_flag_event(rw_ipc_client_t *c, uint32_t id);
uint32_t fk_client_flags_written(const rw_ipc_client_t *c);

#endif /* RW_TEST_EXEC_FAKES_H */
