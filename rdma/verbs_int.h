/* Private to the verbs transport (rdma/verbs*.c): its objects and what its files share. One
 * transport in four files: verbs.c (connections: teardown, queue pairs, completions, async
 * events), verbs_cm.c (librdmacm's events and the connection half of the vtable), verbs_dev.c
 * (memory registration, device open and close, the vtable), verbs_codec.c (the pure parts of
 * verbs_priv.h, unit-tested without a device). Everything runs on the caller's loop thread. */
#ifndef RW_RDMA_VERBS_INT_H
#define RW_RDMA_VERBS_INT_H

#include "rdma/rail.h"
#include "rdma/verbs_priv.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ev.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <rdma/rdma_cma.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define VB_DEFAULT_MAX_WRITES 1024
#define VB_HANDSHAKE_TIMEOUT_S 30.0
#define VB_RESOLVE_TIMEOUT_MS 5000
#define VB_LISTEN_BACKLOG 64
#define VB_POLL_BATCH 32
#define VB_MIN_RNR_TIMER 12 /* IB code for 0.64 ms (0 is 655 ms) */
#define VB_POLL_BUDGET 512 /* completions handled per connection before the loop runs again */
#define VB_WRITE_BIT (1ull << 63) /* wr_id of the unsignaled RDMA WRITE before a SEND */

typedef struct vb_dev vb_dev_t;
typedef struct vb_conn vb_conn_t;
typedef struct vb_listener vb_listener_t;

/* What a cm_id's context points at: CM events are dispatched by kind. */
enum { VB_KIND_ANCHOR = 1, VB_KIND_LISTENER, VB_KIND_CONN };
typedef struct vb_owner {
	int kind;
	void *obj;
} vb_owner_t;

/* One posted write, until its signaled completion. */
typedef struct vb_pending {
	void *ctx;     /* the caller's write ctx */
	uint32_t wqes; /* send queue entries it holds (chunks + SEND, or 1) */
} vb_pending_t;

typedef struct vb_region {
	rw_rail_region_t base;
	struct ibv_mr *mr;
	uint64_t sge_base; /* address the local sge names: host VA, or the dmabuf region's iova */
	struct vb_region *prev, *next;
} vb_region_t;

struct vb_listener {
	rw_rail_listener_t base;
	vb_owner_t owner;
	struct rdma_cm_id *id;
	vb_listener_t *prev, *next;
};

struct vb_conn {
	rw_rail_conn_t base;
	vb_dev_t *dev;
	vb_owner_t owner;
	struct rdma_cm_id *id;
	struct ibv_cq *cq;           /* per connection: destroying it discards stale completions */
	struct ibv_mr *slots_mr;
	uint8_t *slots;              /* recv_depth receive slots, then max_writes send slots */
	uint32_t recv_depth;
	uint32_t max_writes;
	uint32_t window;             /* writes in flight allowed: max_writes, or fewer where the
	                              * peer posts fewer receives (its hello's max_writes), so that
	                              * notifications do not meet RNR NAKs as a rule */
	int write_send;              /* negotiated: 1 = RDMA WRITE + SEND carrying the immediate */
	int announced;               /* on_connected() reported */
	int failed;                  /* on_error() reported (or a silent drop before announce) */
	int closed;                  /* rw_rail_conn_close() called; memory reaped later */
	int want_writable;           /* an RW_ERR_AGAIN is waiting for on_writable() */
	int more;                    /* the last poll stopped at its budget (the `more` timer);
	                              * 2 while vb_more_cb is due to poll it */
	vb_pending_t *pend;          /* ring [max_writes], posting order */
	uint64_t head, tail;         /* next seq to complete, next seq to post */
	uint32_t sq_depth, sq_used;  /* send queue entries: size, held by pending writes */
	ev_timer timer;              /* handshake timeout, or a deferred failure (after 0 s) */
	rw_status_t later_err;       /* failure to report from the timer */
	vb_conn_t *prev, *next;
};

struct vb_dev {
	rw_rail_dev_t base;
	struct rdma_event_channel *ec;
	struct rdma_cm_id *anchor;   /* bound to the rail's IP while open: pins ctx (librdmacm's) */
	vb_owner_t anchor_owner;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct sockaddr_in addr;     /* the rail's IPv4 address, port 0 */
	uint8_t port_num;
	uint16_t hello_flags;        /* what this device offers (RW_VB_HELLO_IMM) */
	uint32_t max_qp_wr, max_cqe;
	uint32_t chunk;              /* largest single RDMA message (port max_msg_sz) */
	uint8_t ack_timeout;         /* RW_VERBS_ACK_TIMEOUT (IB code); 0 = the CM's */
	uint32_t poll_budget;        /* completions per connection per poll call (conn_poll) */
	ev_io cm_io, cq_io, async_io;
	ev_timer reap;               /* frees closed connections outside any dispatch */
	ev_timer more;               /* polls on where a poll stopped at its budget (conn_poll) */
	vb_conn_t *conns;            /* open (not closed) connections */
	vb_conn_t *zombies;          /* closed, awaiting reap */
	vb_listener_t *listeners;
	vb_region_t *regions;
};

#define LIST_PUSH(head, x)                                \
	do {                                              \
		(x)->prev = NULL;                         \
		(x)->next = (head);                       \
		if (head)                                 \
			(head)->prev = (x);               \
		(head) = (x);                             \
	} while (0)
#define LIST_UNLINK(head, x)                              \
	do {                                              \
		if ((x)->prev)                            \
			(x)->prev->next = (x)->next;      \
		else                                      \
			(head) = (x)->next;               \
		if ((x)->next)                            \
			(x)->next->prev = (x)->prev;      \
		(x)->prev = (x)->next = NULL;             \
	} while (0)

/* ---- verbs.c: connections ------------------------------------------------------------- */
int vb_set_nonblock(int fd);
void vb_fmt_sin(const struct sockaddr *sa, char *buf, size_t len);  /* "ip:port" for logs */
vb_conn_t *vb_conn_new(vb_dev_t *d, const rw_rail_conn_cbs_t *cbs, void *ctx, int accepted,
		       uint64_t tag);
void vb_conn_free(vb_conn_t *c);
/* Out of service: no more callbacks; freed by the reap timer, never inside a dispatch. */
void vb_conn_bury(vb_conn_t *c);
/* Terminal failure: every outstanding write gets on_write_done(st) in posting order, then
 * on_error(st) once; an accepted connection not yet announced is dropped silently. */
void vb_conn_fail(vb_conn_t *c, rw_status_t st);
/* A failure decided inside an rw_rail_* call: reported from the loop, never re-entrantly. */
void vb_conn_fail_later(vb_conn_t *c, rw_status_t st);
uint8_t *vb_send_slot(vb_conn_t *c, uint64_t seq);   /* the SEND notification's slot */
rw_status_t vb_conn_setup_qp(vb_conn_t *c);          /* CQ, QP, slots, receives posted */
void vb_conn_set_ack_timeout(vb_conn_t *c);          /* RW_VERBS_ACK_TIMEOUT on the cm_id */
void vb_conn_param_init(struct rdma_conn_param *p, const uint8_t *hello);
void vb_conn_up(vb_conn_t *c);                       /* established: announce it */
void vb_dev_fail_all(vb_dev_t *d, rw_status_t st);   /* a port or the device went away */
/* The device's watchers (verbs_dev.c starts them). */
void vb_reap_cb(struct ev_loop *loop, ev_timer *w, int revents);
void vb_more_cb(struct ev_loop *loop, ev_timer *w, int revents);
void vb_cq_cb(struct ev_loop *loop, ev_io *w, int revents);
void vb_async_cb(struct ev_loop *loop, ev_io *w, int revents);

/* ---- verbs_cm.c: librdmacm's events and the connection half of the vtable ---------------- */
void vb_cm_cb(struct ev_loop *loop, ev_io *w, int revents);
rw_status_t vb_listen(rw_rail_dev_t *base, const rw_rail_conn_cbs_t *cbs, void *ctx,
		      rw_rail_listener_t **listener_p);
void vb_listener_close(rw_rail_listener_t *base);
rw_status_t vb_connect(rw_rail_dev_t *base, const char *peer_addr, uint64_t tag,
		       const rw_rail_conn_cbs_t *cbs, void *ctx, rw_rail_conn_t **conn_p);
rw_status_t vb_write(rw_rail_conn_t *base, const rw_rail_write_t *w);
void vb_conn_close(rw_rail_conn_t *base);

#endif /* RW_RDMA_VERBS_INT_H */
