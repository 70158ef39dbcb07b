/* Private to the `shm` rail transport: the objects shared by shm.c (the vtable, devices,
 * regions, listeners, the handshake and the control messages, the delivery of arrivals and
 * completions, all on the loop) and shm_copy.c (the device's copier threads and their pacing).
 * shm.c calls shm_copy.c, never the other way. Not part of the module's public face (that is
 * rdma/rail.h); docs/rdma.md "The shm transport" says what it is for.
 *
 * Memory shared between the daemons of one host (all memfds, sealed against shrinking so a
 * peer can never make a mapping fault):
 *  - a registered region: the caller's pages themselves, remapped in place onto a memfd at
 *    registration and back onto private pages at dereg; its fd goes to a peer that asks for it
 *    (KEY_REQ) over the connection's control socket, only once the handshake proved the key;
 *  - a connection's outbox, one per direction, made by the writer: a ring of write descriptors
 *    (shm_ring_t) that the writer fills and the target reads.
 * Locks: dev->mu guards the copiers' work list, the pacing bucket and each connection's copy
 * state (tx_copied, tx_issue, busy, maps, on_work, blocked, detached, each write's done);
 * nothing blocking is done under it. */
#ifndef RW_RDMA_SHM_PRIV_H
#define RW_RDMA_SHM_PRIV_H

#include <ev.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "common/list.h"
#include "rdma/rail.h"

#define SHM_DEFAULT_MAX_WRITES 1024
#define SHM_MAX_WRITE_LENGTH (1ull << 30)
#define SHM_RING_MAX (1u << 20) /* outbox entries a peer may offer */
#define SHM_MAX_COPIERS 8       /* copier threads per device (rw_rail_config_t.copy_threads) */

/* ---- control messages: one SOCK_SEQPACKET message each, 64 bytes, little-endian -----------
 *   0 u32 magic   4 u8 version   5 u8 type   6 u16 0   8 u64 a   16 u64 b   24 u64 0
 *  32..63 proof (HELLO, HELLO_ACK) or 0.
 * HELLO (connector): a = tag, b = rail, proof. HELLO_ACK: b = rail, proof (the reply).
 * RING + fd: a = entries of the sender's outbox (after the proofs: connector first).
 * KEY_REQ: a = key. KEY + fd: a = key, b = region length. NO_KEY, UNREG: a = key.
 * TAIL, HEAD: doorbells (the outbox's tail or head moved and the other side asked to hear). */
#define SHM_MSG_MAGIC 0x4d535752u /* "RWSM" */
#define SHM_MSG_VERSION 1
#define SHM_MSG_SIZE 64
#define SHM_PROOF_OFF 32

enum shm_msg_type {
	SHM_HELLO = 1,
	SHM_HELLO_ACK,
	SHM_RING,
	SHM_KEY_REQ,
	SHM_KEY,
	SHM_NO_KEY,
	SHM_UNREG,
	SHM_TAIL,
	SHM_HEAD,
	SHM_MSG_LAST = SHM_HEAD,
};

typedef struct shm_msg {
	uint8_t type;
	uint64_t a, b;
	uint8_t proof[RW_RAIL_PROOF_SIZE];
} shm_msg_t;

static inline void shm_msg_encode(const shm_msg_t *m, uint8_t out[SHM_MSG_SIZE])
{
	memset(out, 0, SHM_MSG_SIZE);
	rw_put_le(out + 0, SHM_MSG_MAGIC, 4);
	out[4] = SHM_MSG_VERSION;
	out[5] = m->type;
	rw_put_le(out + 8, m->a, 8);
	rw_put_le(out + 16, m->b, 8);
	memcpy(out + SHM_PROOF_OFF, m->proof, RW_RAIL_PROOF_SIZE);
}

/* 0, or -1 on a bad magic, version, type or reserved field (untrusted input). */
static inline int shm_msg_decode(const uint8_t in[SHM_MSG_SIZE], shm_msg_t *m)
{
	if (rw_get_le(in, 4) != SHM_MSG_MAGIC || in[4] != SHM_MSG_VERSION)
		return -1;
	if (in[5] < SHM_HELLO || in[5] > SHM_MSG_LAST || in[6] || in[7] || rw_get_le(in + 24, 8))
		return -1;
	int hello = in[5] == SHM_HELLO || in[5] == SHM_HELLO_ACK;
	for (int i = SHM_PROOF_OFF; i < SHM_MSG_SIZE && !hello; i++)
		if (in[i])
			return -1;
	m->type = in[5];
	m->a = rw_get_le(in + 8, 8);
	m->b = rw_get_le(in + 16, 8);
	memcpy(m->proof, in + SHM_PROOF_OFF, RW_RAIL_PROOF_SIZE);
	return 0;
}

/* ---- the outbox: a writer's ring of descriptors, in a memfd both sides map ----------------
 * Acquire/release pairs (each side reads the other's words as untrusted and checks them):
 *  (1) tail: the copier copies a write's bytes into the target's region, fills its entry,
 *      then stores tail with release; the target loads tail with acquire before it reads the
 *      entry or reports the arrival, so it never reports bytes it could not see yet.
 *  (2) head: the target stores head with release after reporting the arrivals below it; the
 *      writer loads head with acquire before reporting on_write_done(RW_OK) for them.
 * Doorbells (rx_armed, tx_armed): the sleeping side stores 1, a seq_cst fence, re-reads the
 * index; the moving side stores the index, a seq_cst fence, exchanges the flag with 0 and sends
 * one message only if it was 1 (a store-load pair on both sides: no wake-up is lost, at most
 * one doorbell is in flight per flag, so the socket never fills with them). */
typedef struct shm_entry {
	uint64_t key, offset, length;
	uint32_t imm, reserved;
} shm_entry_t;

typedef struct shm_ring {
	_Alignas(64) _Atomic uint64_t tail; /* writer: descriptors published (data in place) */
	_Alignas(64) _Atomic uint32_t rx_armed; /* target: send TAIL when tail moves */
	_Alignas(64) _Atomic uint64_t head; /* target: arrivals reported */
	_Alignas(64) _Atomic uint32_t tx_armed; /* writer: send HEAD when head moves */
	_Alignas(64) shm_entry_t entries[];
} shm_ring_t;

static inline uint64_t shm_ring_bytes(uint64_t entries)
{
	return sizeof(shm_ring_t) + entries * sizeof(shm_entry_t);
}

/* ---- objects -------------------------------------------------------------------------------- */

typedef struct shm_conn shm_conn_t;
typedef struct shm_listener shm_listener_t;

typedef struct shm_region {
	rw_rail_region_t base;
	int fd;           /* the memfd now backing [addr, addr + span) */
	uint64_t span;    /* length rounded up to whole pages */
} shm_region_t;

typedef struct shm_dev {
	rw_rail_dev_t base;
	char sock_prefix[48];       /* abstract socket name without the port */
	uint32_t key_salt, key_counter;
	rw_list_t conns;            /* every connection not yet freed (loop thread only) */
	rw_list_t listeners;
	uint32_t n_pending;         /* accepted, handshake not done */
	uint64_t refused, refused_logged_ns;
	shm_region_t **regions;     /* loop thread only */
	size_t nregions, cap_regions;

	/* The copiers (shm_copy.c) and what they share with the loop, under mu. */
	pthread_mutex_t mu;
	pthread_cond_t work_cv;     /* copiers: work arrived or stop */
	pthread_cond_t idle_cv;     /* loop: a connection's last chunk in flight finished */
	pthread_cond_t pace_cv;     /* copiers waiting for the bucket (CLOCK_MONOTONIC), or stop */
	shm_conn_t *work_head, *work_tail; /* connections with bytes to hand out, round robin */
	int stop;
	unsigned n_copiers, n_idle; /* threads started; threads waiting for work */
	pthread_t copiers[SHM_MAX_COPIERS];
	/* Pacing (pace_Bps == 0: off): a token bucket in bytes, under mu. */
	double pace_Bps, pace_tokens, pace_burst;
	uint64_t pace_last_ns;
	_Atomic uint64_t tx_bytes, pace_waits; /* copied into base.stats on the loop */
} shm_dev_t;

struct shm_listener {
	rw_rail_listener_t base;
	int fd;
	ev_io io;
	rw_list_t link;
};

enum shm_map_state {
	SHM_MAP_ASKED, /* KEY_REQ sent; writes to it wait */
	SHM_MAP_READY, /* mapped */
	SHM_MAP_GONE,  /* the target has no such region (NO_KEY) or dropped it (UNREG): writes
	                * to it are published without a copy, and the target refuses them */
};

typedef struct shm_map {
	uint64_t key;
	uint8_t *addr;
	uint64_t length;
	enum shm_map_state state;
} shm_map_t;

/* The peer's region under key as this connection knows it, or NULL. Caller holds dev->mu. */
static inline shm_map_t *shm_map_find(shm_conn_t *c, uint64_t key);

typedef struct shm_tx {
	const rw_rail_region_t *local;
	uint64_t local_offset, length, key, remote_offset;
	uint64_t done;           /* bytes copied (dev->mu): published once all, in order */
	uint32_t imm;
	void *ctx;
} shm_tx_t;

enum shm_hs {
	SHM_HS_CONNECTING, /* connector: HELLO goes when the socket is writable */
	SHM_HS_WAIT_HELLO_ACK,
	SHM_HS_WAIT_HELLO, /* acceptor */
	SHM_HS_WAIT_RING,  /* proofs done, waiting for the peer's outbox */
	SHM_HS_DONE,
};

struct shm_conn {
	rw_rail_conn_t base;
	shm_dev_t *dev;
	int fd;                  /* control socket */
	int closed, cb_depth, user_known, pending, want_writable;
	ev_io rio, wio;
	ev_timer timer;          /* handshake timeout, or a deferred failure (after 0 s) */
	rw_status_t pending_fail;
	enum shm_hs hs;
	rw_list_t link;             /* in dev->conns */

	/* Our outbox (we write) and the peer's (we read). */
	shm_ring_t *out, *in;
	uint64_t out_mask, in_mask, out_bytes, in_bytes;
	uint64_t rx_done;        /* loop: arrivals reported, what we store into in->head */

	/* Writes: loop posts and reports; the copier copies (tx_copied, under dev->mu). */
	shm_tx_t *tx;
	uint64_t tx_posted, tx_acked;

	/* ---- under dev->mu (copiers and loop) ---- */
	uint64_t tx_copied;      /* published into out->tail (<= tx_issue <= tx_posted) */
	uint64_t tx_issue, issue_off; /* the next chunk to hand out: write, offset in it */
	unsigned busy;           /* chunks of this connection being copied now */
	unsigned held;           /* > 0: no new chunk is handed out (shm_copy_wait_idle) */
	shm_map_t *maps;         /* the peer's regions we know of */
	size_t nmaps, cap_maps;
	int on_work, blocked, detached;
	shm_conn_t *work_next;
};

static inline shm_map_t *shm_map_find(shm_conn_t *c, uint64_t key)
{
	for (size_t i = 0; i < c->nmaps; i++)
		if (c->maps[i].key == key)
			return &c->maps[i];
	return NULL;
}

static inline shm_region_t *shm_region_find(shm_dev_t *dev, uint64_t key)
{
	for (size_t i = 0; i < dev->nregions; i++)
		if (dev->regions[i]->base.key == key)
			return dev->regions[i];
	return NULL;
}

static inline int shm_conn_live(const shm_conn_t *c)
{
	return !c->closed && c->base.state != RW_RAIL_CONN_DOWN;
}

/* shm_conn.c: connections, on the loop. */
/* A new connection on socket fd (the caller sets it up: accepted or connecting), in the
 * device's list. NULL without memory. */
shm_conn_t *shm_conn_new(shm_dev_t *dev, int fd, const rw_rail_conn_cbs_t *cbs, void *ctx);
/* Unlink, detach from the copier, close; freed now or when its callback returns. */
void shm_conn_destroy(shm_conn_t *c);
/* A failure found where no callback may run (inside rw_rail_* calls): reported from the loop. */
void shm_conn_fail_later(shm_conn_t *c, rw_status_t st);
/* Send a control message (with fd when >= 0); -1 (logged) when the peer does not take it. */
int shm_conn_send(shm_conn_t *c, const shm_msg_t *m, int fd);
/* Send one control message on socket sock, with fd attached when fd >= 0 (never blocks).
 * 0, or -1 with errno. */
int shm_msg_send(int sock, const shm_msg_t *m, int fd);
/* A memfd of `bytes`, sealed against any change of size; -1 with errno. */
int shm_memfd_sealed(const char *name, uint64_t bytes);

/* shm_copy.c: the device's copier threads. */
/* Start n of them (dev_open). RW_ERR_NOMEM/RW_ERR_SYS when one cannot start (none is left). */
rw_status_t shm_copy_start(shm_dev_t *dev, unsigned n);
/* Stop and join them (dev_close), after every connection was detached. */
void shm_copy_stop(shm_dev_t *dev);
/* The connection has writes to copy (posted, or unblocked): put it on the work list. */
void shm_copy_kick(shm_conn_t *c);
/* Take the connection off the work list and wait until no copier touches it (at most one
 * chunk's copy per copier): afterwards nothing of the copiers reads its regions, writes its
 * peer's mappings or uses its socket. Loop thread. */
void shm_copy_detach(shm_conn_t *c);
/* Wait until no chunk of c is being copied (a mapping of c is about to go). Caller holds mu;
 * chunks handed out after it returns see what the caller changes before unlocking. */
void shm_copy_wait_idle(shm_conn_t *c);
/* Copy the copier's counters into dev->base.stats (loop thread). */
void shm_copy_stats_sync(shm_dev_t *dev);

#endif /* RW_RDMA_SHM_PRIV_H */
