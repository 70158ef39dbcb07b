/* RailWave rail transports: one one-sided write contract (docs/rdma.md) over interchangeable
 * transports (`tcp`, `verbs`), in the manner of NCCL's ncclNet_t. This is the module's only
 * public header: the daemon uses the rw_rail_* functions; a transport implements rw_rail_ops_t.
 *
 * Model. A *device* is one rail NIC of this node. On it the caller registers memory *regions*,
 * listens, and connects to the same rail of a peer node. A *connection* carries one-sided writes
 * (local region, offset, length) -> (remote region, offset) with 32 bits of immediate data. The
 * writer learns completion through on_write_done; the target learns arrival through on_arrival.
 * Region descriptors (key, length, base) travel out of band on the caller's control channel:
 * rw_rail_region_desc_pack() on the target, rw_rail_remote_unpack() on the writer.
 *
 * Threads. Every rw_rail_* call is made on the thread that runs the device's ev_loop, and every
 * callback runs on that thread from inside ev_run(). A transport may use private worker threads,
 * but reports back on the loop. No callback is ever invoked from inside an rw_rail_* call (no
 * re-entrancy): e.g. rw_rail_write() never calls on_write_done() itself.
 * (tcp runs a sender and a receiver thread per connection once its handshake is done; they
 * touch only registered regions, and rw_rail_conn_close, rw_rail_dereg and rw_rail_dev_close
 * say below what they wait for so that no thread of the transport uses memory the caller is
 * about to free. docs/rdma.md "Threads".)
 *
 * Ordering (both transports guarantee it; the conformance suite tests it):
 *  1. On one connection, on_write_done() is reported in posting order, and on_arrival() at the
 *     target is reported in posting order.
 *  2. When on_arrival() is reported, the write's data is entirely in the target region (and so
 *     is the data of every earlier write on that connection).
 *  3. on_write_done(RW_OK) means the data is in the remote region, not merely handed to the local
 *     kernel or NIC. (The target's on_arrival() for it may come before or after.)
 *  4. Nothing is promised across connections (different rails or peers), nor about the byte
 *     order in which a write's data lands while it is in flight (the target must not read the
 *     range before on_arrival()).
 *
 * Failure. Any peer or link failure is reported on that connection only: every outstanding write
 * gets on_write_done(err) in posting order, then on_error(err) once; afterwards the connection
 * makes no more callbacks and accepts only rw_rail_conn_close(). Never a crash, never a hang.
 *
 * Stability: helper transports are written against this header; change it additively only. */
#ifndef RW_RDMA_RAIL_H
#define RW_RDMA_RAIL_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct ev_loop; /* libev; the caller owns the loop */

typedef struct rw_rail_ops rw_rail_ops_t;
typedef struct rw_rail_dev rw_rail_dev_t;
typedef struct rw_rail_region rw_rail_region_t;
typedef struct rw_rail_listener rw_rail_listener_t;
typedef struct rw_rail_conn rw_rail_conn_t;

#define RW_RAIL_NAME_MAX 16   /* transport name, with NUL */
#define RW_RAIL_ADDR_MAX 64   /* printable address ("127.0.1.2:40001", "rxe0:1"), with NUL */
#define RW_RAIL_DESC_SIZE 32  /* serialized region descriptor, bytes */
#define RW_RAIL_PROOF_SIZE 32 /* a connection's handshake proof (RW_RAIL_CAP_PROOF), bytes */

/* ---- configuration and capabilities ---------------------------------------------------- */

typedef struct rw_rail_config {
	const char *transport;  /* "tcp", "shm" or "verbs" */
	const char *local;      /* tcp: the rail's local IPv4 address ("127.0.<rail>.<node>" on
	                         * loopback); shm: an IPv4 address naming the rail on this host
	                         * (need not be assigned); verbs: the rail netdev's IP (rdmacm)
	                         * or "dev:port" */
	unsigned rail;          /* rail index; a connection only joins equal rail indices */
	uint16_t port;          /* listen port; 0 = ephemeral (tests) */
	uint32_t max_writes;    /* writes in flight per connection; 0 = transport default */
	uint64_t pace_bps;      /* transmit rate of the device in bits/s, shared by all its
	                         * connections like a NIC's line rate; 0 = unpaced. tcp and shm
	                         * (emulate a NIC of that speed); verbs logs and ignores it */
	const uint32_t *members; /* tcp: IPv4 addresses (network order) the cluster's other nodes
	                         * dial this rail from; their connections wait for the handshake
	                         * in a budget of their own that strangers cannot fill (copied
	                         * at open; NULL: none). Others ignore it */
	uint32_t n_members;
	uint32_t copy_threads;  /* shm: threads copying the device's writes; 0 = enough for
	                         * pace_bps at one thread's memcpy rate (4 unpaced). Others
	                         * ignore it */
} rw_rail_config_t;

#define RW_RAIL_CAP_DMABUF (1u << 0)        /* reg_dmabuf can succeed on this device */
#define RW_RAIL_CAP_ARRIVAL_WHERE (1u << 1) /* on_arrival reports region and offset */
#define RW_RAIL_CAP_PROOF (1u << 2)         /* handshakes carry proofs (on_verify) */

typedef struct rw_rail_caps {
	uint32_t flags;            /* RW_RAIL_CAP_* */
	uint32_t max_writes;       /* writes in flight per connection (the RW_ERR_AGAIN bound) */
	uint64_t max_write_length; /* largest single write, bytes */
} rw_rail_caps_t;

/* Per-device counters, written by the transport on the loop thread (read them there too).
 * tcp: its threads count into private atomics and the loop copies them here each time it
 * hears from them; a write's bytes are counted before it is sent, so they are here by the
 * time its on_write_done is reported (ACK frames may lag by the last few). */
typedef struct rw_rail_dev_stats {
	uint64_t tx_bytes;       /* bytes handed to the wire, headers included (tcp) */
	uint64_t pace_waits;     /* times a connection with data to send waited for the pacing
	                          * timer because the device's rate budget was spent (tcp) */
	/* Failures and back-pressure (verbs; 0 with tcp). Every failed connection is counted once
	 * in conn_failures, whatever failed first (a work completion, a CM event, an async event,
	 * the handshake timer); the work-completion causes are also counted by kind. */
	uint64_t conn_failures;      /* connections that failed (on_error, or dropped unannounced) */
	uint64_t retry_exceeded;     /* a write was never acknowledged (RETRY_EXC: peer unreachable) */
	uint64_t rnr_retry_exceeded; /* the peer had no receive posted, retries ran out (RNR_RETRY) */
	uint64_t remote_errors;      /* the peer refused a write (REM_ACCESS/INV_REQ/OP: e.g. stale key) */
	uint64_t wc_errors;          /* every other failed work completion but flushes */
	uint64_t write_again;        /* rw_rail_write() answered RW_ERR_AGAIN (queue at its bound) */
	uint64_t chunked_writes;     /* writes longer than one message, sent as several */
	uint64_t poll_yields;        /* completion handling stopped at its budget to let the loop run */
} rw_rail_dev_stats_t;

/* ---- objects (transports embed these as the FIRST member of their own structs) ------------
 * Callers may read the fields; only the transport (and rail.c) writes them. */

struct rw_rail_dev {
	const rw_rail_ops_t *ops;
	struct ev_loop *loop;
	unsigned rail;
	uint16_t port;
	uint32_t max_writes;           /* resolved: never 0 */
	char transport[RW_RAIL_NAME_MAX];
	char local[RW_RAIL_ADDR_MAX];  /* copy of config.local */
	rw_rail_caps_t caps;
	uint64_t pace_bps;             /* the rate being enforced; 0 = unpaced (or not supported) */
	rw_rail_dev_stats_t stats;
};

struct rw_rail_region {
	rw_rail_dev_t *dev;
	void *addr;       /* host address; NULL for dmabuf regions */
	uint64_t length;  /* bytes */
	uint64_t key;     /* what a peer names this region by; unique per device while registered */
	uint64_t base;    /* transport data the peer also needs (verbs: iova/VA; tcp: 0) */
};

/* A peer's region as the writer knows it: a plain value, no registration, no lifetime. */
typedef struct rw_rail_remote {
	uint64_t key;
	uint64_t length;
	uint64_t base;
} rw_rail_remote_t;

/* What on_arrival() reports about one completed incoming write. */
typedef struct rw_rail_arrival {
	rw_rail_region_t *region; /* target region; NULL without RW_RAIL_CAP_ARRIVAL_WHERE */
	uint64_t offset;          /* offset in region; 0 without RW_RAIL_CAP_ARRIVAL_WHERE */
	uint64_t length;          /* bytes written (0 is a valid immediate-only write) */
	uint32_t imm;             /* the writer's immediate, unchanged */
} rw_rail_arrival_t;

/* Connection callbacks. ctx is the connection's context (rw_rail_conn_set_ctx()). Any callback
 * may call any rw_rail_* function, including rw_rail_conn_close() on its own connection. */
typedef struct rw_rail_conn_cbs {
	/* Handshake done; writes may be posted. For an accepted connection this is the accept
	 * notification (set a per-connection context here: arrivals come only after it returns). */
	void (*on_connected)(rw_rail_conn_t *conn, void *ctx);
	/* Terminal failure (RW_ERR_PEER: peer closed/reset/unreachable; RW_ERR_PROTO: peer broke
	 * the protocol; RW_ERR_LINK: local rail failure; RW_ERR_TIMEOUT: handshake timed out;
	 * RW_ERR_NOMEM: no memory for the connection's queues).
	 * Reported once, after every outstanding write got on_write_done(err). */
	void (*on_error)(rw_rail_conn_t *conn, void *ctx, rw_status_t st);
	/* One posted write finished: RW_OK = its data is in the remote region; else it failed and
	 * the remote range is undefined. write_ctx is rw_rail_write_t.ctx. Posting order. */
	void (*on_write_done)(rw_rail_conn_t *conn, void *ctx, void *write_ctx, rw_status_t st);
	/* A peer's write landed in one of our regions (ordering rules 1-2 above). */
	void (*on_arrival)(rw_rail_conn_t *conn, void *ctx, const rw_rail_arrival_t *arrival);
	/* After rw_rail_write() returned RW_ERR_AGAIN: the queue has room again. Once per AGAIN. */
	void (*on_writable)(rw_rail_conn_t *conn, void *ctx);
	/* Optional; only on devices with RW_RAIL_CAP_PROOF (NULL: every handshake is accepted).
	 * Called once per handshake, before on_connected and before any write is taken in.
	 * Acceptor: `proof` is the connector's (rw_rail_conn_set_proof), conn->tag is set and ctx
	 * is the listener's; return 0 and fill reply_p to accept, non-zero to refuse: the
	 * connection is then closed unannounced and nothing of it reaches a region.
	 * Connector: `proof` is the acceptor's reply, reply_p is NULL; non-zero fails the
	 * connection (on_error(RW_ERR_PROTO)). */
	int (*on_verify)(rw_rail_conn_t *conn, void *ctx, const uint8_t proof[RW_RAIL_PROOF_SIZE],
			 uint8_t *reply_p);
} rw_rail_conn_cbs_t;

typedef enum rw_rail_conn_state {
	RW_RAIL_CONN_CONNECTING = 0, /* handshake in progress */
	RW_RAIL_CONN_UP = 1,         /* on_connected() reported */
	RW_RAIL_CONN_DOWN = 2,       /* on_error() reported (or about to be) */
} rw_rail_conn_state_t;

struct rw_rail_conn {
	rw_rail_dev_t *dev;
	rw_rail_conn_cbs_t cbs;
	void *ctx;
	rw_rail_conn_state_t state;
	uint64_t tag;                /* connector's tag (e.g. its node id), known on both sides */
	int accepted;                /* 1 on the listening side */
	char peer[RW_RAIL_ADDR_MAX]; /* printable peer address, for logs */
	uint8_t proof[RW_RAIL_PROOF_SIZE]; /* connector: what its handshake presents */
};

struct rw_rail_listener {
	rw_rail_dev_t *dev;
	rw_rail_conn_cbs_t cbs;      /* inherited by accepted connections */
	void *ctx;                   /* inherited by accepted connections */
	char addr[RW_RAIL_ADDR_MAX]; /* what a peer passes to rw_rail_connect() */
};

/* One write request; read during rw_rail_write() only (the transport copies what it needs). */
typedef struct rw_rail_write {
	rw_rail_region_t *local;  /* source region, registered on the connection's device */
	uint64_t local_offset;
	uint64_t length;          /* bytes; 0 = immediate only; <= caps.max_write_length */
	rw_rail_remote_t remote;  /* target region, from rw_rail_remote_unpack() */
	uint64_t remote_offset;
	uint32_t imm;             /* delivered unchanged in the target's on_arrival() */
	void *ctx;                /* returned in on_write_done() */
} rw_rail_write_t;

/* ---- the transport vtable ----------------------------------------------------------------
 * Built with designated initializers; an operation a transport cannot do returns
 * RW_ERR_UNSUPPORTED (never NULL). Callers use the rw_rail_* wrappers below, which validate
 * arguments common to all transports before dispatching. */
struct rw_rail_ops {
	const char *name;
	/* Open the rail device named by cfg (copied); may do short blocking setup (socket, ibv
	 * open), never network waits. RW_ERR_NOTFOUND: no such address/device; RW_ERR_SYS. */
	rw_status_t (*dev_open)(const rw_rail_config_t *cfg, struct ev_loop *loop,
				rw_rail_dev_t **dev_p);
	/* Free the device and whatever is still open on it (regions, listeners, connections),
	 * without callbacks. Non-blocking. Not from inside one of the device's callbacks.
	 * A transport's worker threads are stopped and joined first (as conn_close): when it
	 * returns, none of them touches any region's memory. */
	void (*dev_close)(rw_rail_dev_t *dev);
	/* Register host memory [addr, addr+length) as source and remote-writable target. The
	 * caller keeps ownership of the memory and must keep it mapped until dereg. May block
	 * briefly (pinning). RW_ERR_NOMEM, RW_ERR_SYS. */
	rw_status_t (*reg_host)(rw_rail_dev_t *dev, void *addr, uint64_t length,
				rw_rail_region_t **region_p);
	/* Register [fd_offset, fd_offset+length) of a dmabuf (GPU memory), at device address iova.
	 * The fd stays the caller's. RW_ERR_UNSUPPORTED where the device/driver cannot. */
	rw_status_t (*reg_dmabuf)(rw_rail_dev_t *dev, int fd, uint64_t fd_offset, uint64_t length,
				  uint64_t iova, rw_rail_region_t **region_p);
	/* Deregister. The caller guarantees no write of its own uses the region any more; writes
	 * from peers naming its key afterwards fail on their connection (RW_ERR_PROTO).
	 * When it returns, no byte of the region changes any more. With worker threads (tcp) it
	 * waits for that: a receiver writing a peer's write into the region is stopped (its
	 * socket shut down, so the wait is for one system call to return, never for the peer) and
	 * its connection fails with RW_ERR_PROTO, reported later from the loop; so does a
	 * connection holding writes into the region that landed but were not reported yet (they
	 * are never reported). Other connections and regions are unaffected. */
	void (*dereg)(rw_rail_region_t *region);
	/* Listen on the device's address and port (non-blocking). Accepted connections inherit
	 * cbs/ctx and announce themselves with on_connected(). Handshake failures of not-yet-
	 * announced connections are logged and dropped silently. RW_ERR_SYS (e.g. port in use). */
	rw_status_t (*listen)(rw_rail_dev_t *dev, const rw_rail_conn_cbs_t *cbs, void *ctx,
			      rw_rail_listener_t **listener_p);
	/* Stop listening; already accepted connections are unaffected. */
	void (*listener_close)(rw_rail_listener_t *listener);
	/* Start connecting to peer_addr (a peer listener's addr) from this device's local
	 * address; returns at once with the connection CONNECTING, then exactly one of
	 * on_connected()/on_error() follows. tag is shown to the acceptor. RW_ERR_INVAL: bad
	 * address. */
	rw_status_t (*connect)(rw_rail_dev_t *dev, const char *peer_addr, uint64_t tag,
			       const rw_rail_conn_cbs_t *cbs, void *ctx, rw_rail_conn_t **conn_p);
	/* Post one write; never blocks. RW_OK: queued, on_write_done() follows. RW_ERR_AGAIN:
	 * max_writes outstanding, nothing queued, on_writable() follows. RW_ERR_STATE: not UP.
	 * RW_ERR_RANGE: local or remote range outside its region (checked before queueing). The
	 * local range must stay unchanged until on_write_done(). */
	rw_status_t (*write)(rw_rail_conn_t *conn, const rw_rail_write_t *write);
	/* Close now, without callbacks (outstanding write_ctx are the caller's to reclaim); the
	 * peer sees on_error(RW_ERR_PEER). Orderly close = wait for every on_write_done, then
	 * close. Safe inside the connection's own callbacks (the free is deferred).
	 * A transport's worker threads for the connection are stopped and joined before it
	 * returns (tcp: the socket is shut down first, so this waits for at most one system call
	 * in progress, never for the peer): afterwards the local ranges of its outstanding writes
	 * and the regions its arrivals were landing in may be reused or freed. */
	void (*conn_close)(rw_rail_conn_t *conn);
	/* The descriptor whose pages a host region now is, where registering swapped the caller's
	 * pages for a shared object of the transport's (shm: its sealed memfd, which peers map);
	 * -1 where the region is the caller's pages as they were (tcp, verbs). The fd stays the
	 * transport's until dereg (dup it to keep or send it). Never blocks. */
	int (*region_fd)(const rw_rail_region_t *region);
};

/* Built-in transports (rail.c's registry). */
extern const rw_rail_ops_t rw_rail_tcp_ops;
extern const rw_rail_ops_t rw_rail_shm_ops;   /* several daemons on one host (docs/rdma.md) */
extern const rw_rail_ops_t rw_rail_verbs_ops; /* only when built with verbs */

/* ---- the caller's API (rail.c): argument checks, then dispatch through dev->ops ----------- */

/* The transport called name, or NULL. */
const rw_rail_ops_t *rw_rail_transport_find(const char *name);
/* Space-separated names of the built-in transports ("tcp verbs"), static. */
const char *rw_rail_transport_names(void);

rw_status_t rw_rail_dev_open(const rw_rail_config_t *cfg, struct ev_loop *loop,
			     rw_rail_dev_t **dev_p);
void rw_rail_dev_close(rw_rail_dev_t *dev);

rw_status_t rw_rail_reg_host(rw_rail_dev_t *dev, void *addr, uint64_t length,
			     rw_rail_region_t **region_p);
rw_status_t rw_rail_reg_dmabuf(rw_rail_dev_t *dev, int fd, uint64_t fd_offset, uint64_t length,
			       uint64_t iova, rw_rail_region_t **region_p);
void rw_rail_dereg(rw_rail_region_t *region);
/* rw_rail_ops_t.region_fd (-1 for a NULL region or a transport without the operation). */
int rw_rail_region_fd(const rw_rail_region_t *region);

rw_status_t rw_rail_listen(rw_rail_dev_t *dev, const rw_rail_conn_cbs_t *cbs, void *ctx,
			   rw_rail_listener_t **listener_p);
void rw_rail_listener_close(rw_rail_listener_t *listener);

rw_status_t rw_rail_connect(rw_rail_dev_t *dev, const char *peer_addr, uint64_t tag,
			    const rw_rail_conn_cbs_t *cbs, void *ctx, rw_rail_conn_t **conn_p);
rw_status_t rw_rail_write(rw_rail_conn_t *conn, const rw_rail_write_t *write);
void rw_rail_conn_close(rw_rail_conn_t *conn);
/* Replace the context passed to this connection's callbacks (e.g. in on_connected). */
void rw_rail_conn_set_ctx(rw_rail_conn_t *conn, void *ctx);
/* The proof a connection's handshake presents (RW_RAIL_CAP_PROOF; zeros by default). Set it
 * right after rw_rail_connect(), before returning to the loop: the handshake starts from there. */
static inline void rw_rail_conn_set_proof(rw_rail_conn_t *conn,
					  const uint8_t proof[RW_RAIL_PROOF_SIZE])
{
	for (unsigned i = 0; i < RW_RAIL_PROOF_SIZE; i++)
		conn->proof[i] = proof[i];
}

/* Parse a rail address "a.b.c.d:port" (what rw_rail_listener_t.addr holds and
 * rw_rail_connect() takes, for every transport): IPv4 only, port 1..65535 in decimal digits.
 * RW_ERR_INVAL on anything else; outputs (network-order address, host-order port) set only on
 * success. */
rw_status_t rw_rail_addr_parse(const char *s, uint32_t *addr_be_p, uint16_t *port_p);

/* Region descriptors for the out-of-band exchange: a fixed RW_RAIL_DESC_SIZE-byte,
 * little-endian record (magic, version, key, length, base). unpack treats its input as
 * untrusted: RW_ERR_PARSE on wrong size, magic or version; remote_p set only on success. */
void rw_rail_region_desc_pack(const rw_rail_region_t *region, uint8_t out[RW_RAIL_DESC_SIZE]);
rw_status_t rw_rail_remote_unpack(const uint8_t *in, size_t len, rw_rail_remote_t *remote_p);
/* The descriptor of a local region as a value (what unpack would give the peer). */
rw_rail_remote_t rw_rail_region_remote(const rw_rail_region_t *region);

/* ---- helpers for transport implementations ------------------------------------------------ */

/* Fill the common device fields from cfg (name copied, max_writes resolved against
 * default_max_writes, pace_bps copied: a transport that cannot pace sets it back to 0).
 * RW_ERR_INVAL when cfg->local does not fit. */
rw_status_t rw_rail_dev_init_base(rw_rail_dev_t *dev, const rw_rail_ops_t *ops,
				  const rw_rail_config_t *cfg, struct ev_loop *loop,
				  uint32_t default_max_writes);
/* Fill a new connection's common fields: its device, callbacks and context; state CONNECTING. */
void rw_rail_conn_init_base(rw_rail_conn_t *conn, rw_rail_dev_t *dev,
			    const rw_rail_conn_cbs_t *cbs, void *ctx);
/* Bounds check shared by transports: [offset, offset+length) within region_length, no
 * overflow. Returns RW_OK or RW_ERR_RANGE. */
rw_status_t rw_rail_range_check(uint64_t region_length, uint64_t offset, uint64_t length);
/* A connection's terminal failure as the Failure rule above says, once the transport stopped
 * it: writes *acked_p .. posted-1 come back with on_write_done(st) in posting order (*acked_p
 * advances as each is reported), then on_error(st) once. ctx_of(conn, k) is write k's
 * write_ctx; when *closed_p turns non-zero (a callback closed the connection) nothing more is
 * reported. Loop thread, from inside the transport's own callback. */
void rw_rail_report_failure(rw_rail_conn_t *conn, uint64_t *acked_p, uint64_t posted,
			    void *(*ctx_of)(const rw_rail_conn_t *conn, uint64_t k),
			    const int *closed_p, rw_status_t st);

#endif /* RW_RDMA_RAIL_H */
