/* Private to the `tcp` rail transport: the objects shared by tcp.c (the vtable, devices,
 * regions, listeners, connection setup, the handshake, and the delivery of what the threads did,
 * all on the loop) and tcp_io.c (the per-connection sender and receiver threads, the rate pacing
 * they share, and the hand-back list they fill). tcp.c calls tcp_io.c, never the other way.
 * Not part of the module's public face (that is rdma/rail.h).
 *
 * Threads and locks (docs/rdma.md "Threads"):
 *  - the loop thread makes every rw_rail_* call and every callback;
 *  - once a connection's handshake is done, its socket turns blocking and two threads of its own
 *    move the bytes: the sender (write frames and ACKs out) and the receiver (headers, payloads
 *    straight into regions, ACKs in). They report to the loop through the device's ev_async.
 * Lock order: dev->reg_mu, then conn->mu, then dev->mu (the hand-back list) or dev->pace_mu.
 * No lock is held across a blocking system call. */
#ifndef RW_RDMA_TCP_PRIV_H
#define RW_RDMA_TCP_PRIV_H

#include <ev.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "common/listen_pause.h"
#include "rdma/rail.h"
#include "rdma/tcp_wire.h"

#define TCP_DEFAULT_MAX_WRITES 1024
#define TCP_MAX_WRITE_LENGTH (1ull << 30)

typedef struct tcp_conn tcp_conn_t;
typedef struct tcp_listener tcp_listener_t;

typedef struct tcp_dev {
	rw_rail_dev_t base;
	struct sockaddr_in local_sa;
	uint32_t key_salt, key_counter;
	tcp_conn_t *conns;          /* every connection not yet freed (loop thread only) */
	tcp_listener_t *listeners;
	unsigned n_threaded;        /* connections whose threads run: they keep the loop alive */
	uint32_t n_pending;         /* strangers' accepted, HELLO not taken yet (TCP_PENDING_MAX) */
	uint32_t *members;          /* rw_rail_config_t.members (a copy) */
	uint32_t n_members;
	uint64_t refused, refused_logged_ns; /* refused handshakes since the last log line */

	/* Registered regions: written by the loop, searched by receiver threads (reg_mu). */
	pthread_mutex_t reg_mu;
	pthread_cond_t reg_cv;      /* a receiver left a region (dereg waits for that) */
	rw_rail_region_t **regions; /* few per device, searched linearly */
	size_t nregions, cap_regions;

	/* Hand-back to the loop: connections with news, and the watcher that wakes the loop. */
	pthread_mutex_t mu;
	tcp_conn_t *news_head;      /* FIFO, linked through news_next */
	tcp_conn_t *news_tail;
	ev_async news;

	/* Counters the threads add to; the loop copies them into base.stats. */
	_Atomic uint64_t tx_bytes, pace_waits;

	/* Rate pacing (docs/rdma.md "Rate pacing"); pace_Bps == 0: off. The bucket holds bytes;
	 * control frames (ACK, HELLO) are never held back but are charged, so it may go below 0.
	 * pace_mu guards every field below; senders queue for their turn in FIFO order. */
	pthread_mutex_t pace_mu;
	pthread_cond_t pace_cv;     /* CLOCK_MONOTONIC: the head of the queue sleeps on it */
	double pace_Bps;            /* bytes per second */
	double pace_tokens;         /* bytes that may be sent now, <= pace_burst (idle) */
	double pace_burst;          /* bucket depth */
	double pace_backlog;        /* depth while connections wait: late wake-ups catch up */
	double pace_wake;           /* a turn starts once the bucket holds this much */
	uint64_t pace_last_ns;      /* last refill */
	tcp_conn_t *pace_head;      /* FIFO of senders waiting for their turn (pace_next) */
	tcp_conn_t *pace_tail;
} tcp_dev_t;

struct tcp_listener {
	rw_rail_listener_t base;
	int fd;
	ev_io io;
	rw_listen_pause_t pause;    /* rests the listener when descriptors run out */
	tcp_listener_t *next, **pprev;
};

typedef struct tx_entry {
	rw_rail_region_t *local;
	uint64_t local_offset, length;
	void *ctx;
	uint8_t hdr[RW_TCP_HDR_SIZE];
} tx_entry_t;

typedef struct rx_entry {
	rw_rail_region_t *region;
	uint64_t offset, length;
	uint32_t imm;
} rx_entry_t;

enum hs_state {
	HS_CONNECTING,     /* connector: waiting for connect() to finish */
	HS_WAIT_HELLO_ACK, /* connector: HELLO sent */
	HS_WAIT_HELLO,     /* acceptor: waiting for the peer's HELLO */
	HS_DONE,           /* threads run the socket */
};

struct tcp_conn {
	rw_rail_conn_t base;
	tcp_dev_t *dev;
	int fd;
	int closed;              /* rw_rail_conn_close() called: free when cb_depth drops to 0 */

	/* ---- loop thread only ---- */
	ev_io rio, wio;          /* handshake only */
	ev_timer timer;          /* handshake timeout, or a deferred failure (after 0 s) */
	enum hs_state hs;
	rw_status_t pending_fail; /* set by conn_fail_later(); reported from the timer */
	int user_known;          /* the user holds this conn (connector, or accept announced) */
	int cb_depth;            /* > 0 while inside one of our ev callbacks */
	int want_writable;       /* rw_rail_write() said AGAIN: on_writable() owed */
	int pending;             /* accepted, HELLO not taken yet */
	int member_src;          /* accepted from a member's address: not in dev->n_pending */
	uint32_t src;            /* accepted: the source IPv4 address (network order) */
	int threads;             /* sender and receiver started (joined by tcp_io_stop) */
	pthread_t sender, receiver;
	uint64_t tx_acked;       /* on_write_done reported */
	uint8_t hs_hdr[RW_TCP_HDR_SIZE]; /* handshake frame being received */
	uint32_t hs_have;
	tcp_conn_t *next, **pprev;

	/* ---- shared with the threads, under mu ---- */
	pthread_mutex_t mu;
	pthread_cond_t tx_cv;    /* sender: work arrived or stop */
	pthread_cond_t rx_cv;    /* receiver: room in the arrival ring or stop */
	_Atomic int stop;        /* threads: leave now (also read without mu while pacing) */
	int tx_idle, rx_full;    /* the thread sleeps on its cv: signal it */
	rw_status_t err;         /* first failure a thread (or dereg) saw; RW_OK while healthy */
	/* Outgoing writes: ring of max_writes (rounded up to a power of two) entries; entry k
	 * carries seq k + 1. acked <= peer_acked <= sent <= sending <= posted. */
	tx_entry_t *ring;
	uint64_t ring_mask;
	uint64_t tx_posted;      /* loop: writes queued */
	uint64_t tx_sending;     /* sender: writes handed to sendmsg (an ACK may come before it
	                          * returns), the bound an ACK is checked against */
	uint64_t tx_sent;        /* sender: writes wholly sent */
	uint64_t peer_acked;     /* receiver: the peer's cumulative ACK */
	/* Incoming writes that landed: ring of the same size; rx_done <= rx_landed. */
	rx_entry_t *arrivals;
	uint64_t rx_landed;      /* receiver: writes wholly in their region */
	uint64_t rx_done;        /* loop: arrivals reported (what the next ACK says) */
	uint64_t rx_cut;         /* dereg: arrivals from here on are never reported */
	uint64_t ack_sent;       /* sender: highest rx_done put into an ACK frame */
	/* Handshake control frame left over for the sender (HELLO_ACK not wholly sent). */
	uint8_t ctl[RW_TCP_HDR_SIZE];
	uint32_t ctl_len, ctl_off;

	/* ---- receiver thread, under dev->reg_mu ---- */
	rw_rail_region_t *rx_busy; /* region the receiver is writing into now */

	/* ---- hand-back list and pacing queue (dev->mu, dev->pace_mu) ---- */
	int news_queued;
	tcp_conn_t *news_next;
	int pace_waiting;
	tcp_conn_t *pace_next;
};

/* tcp_io.c: the threads. */
/* Start the connection's sender and receiver on its (now blocking) socket. RW_ERR_NOMEM or
 * RW_ERR_SYS when a thread cannot start (nothing is left running then). Loop thread. */
rw_status_t tcp_io_start(tcp_conn_t *c);
/* Stop and join the connection's threads (no-op when none run): shuts the socket down so any
 * blocking call returns, wakes every wait, joins. Bounded: no thread waits on the peer after
 * shutdown. Then takes the connection off the hand-back list. Loop thread. */
void tcp_io_stop(tcp_conn_t *c);
/* rw_rail_write's queueing half: the entry is filled, publish it and wake the sender. */
void tcp_io_post(tcp_conn_t *c);
/* Record a failure decided outside the threads (dereg) and shut the socket so they stop. */
void tcp_io_fail(tcp_conn_t *c, rw_status_t st);
/* The next connection the threads have news of (FIFO), taken off the list; NULL when none.
 * The loop's ev_async (tcp.c) delivers it: arrivals, completions, failures. */
tcp_conn_t *tcp_io_news_pop(tcp_dev_t *dev);
/* Charge bytes sent outside the threads (handshake frames) to the device's pacing bucket. */
void tcp_pace_charge(tcp_dev_t *dev, size_t bytes);
/* Copy the threads' counters into dev->base.stats (loop thread). */
void tcp_stats_sync(tcp_dev_t *dev);

/* The region registered under key, or NULL; caller holds dev->reg_mu (receiver threads). */
static inline rw_rail_region_t *tcp_region_find(tcp_dev_t *dev, uint64_t key)
{
	for (size_t i = 0; i < dev->nregions; i++)
		if (dev->regions[i]->key == key)
			return dev->regions[i];
	return NULL;
}

#endif /* RW_RDMA_TCP_PRIV_H */
