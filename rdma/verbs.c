/* The verbs rail transport: rw_rail_ops_t over rdma-core (libibverbs + librdmacm), the
 * production path. One RC QP per (peer, rail) connected through librdmacm's event channel,
 * one-sided RDMA WRITE WITH IMMEDIATE (or RDMA WRITE + SEND where the device has no immediate),
 * all driven from the caller's libev loop: the CM event channel, the completion channel and the
 * device's async fd are ev_io watchers, and nothing here blocks. See docs/rdma-verbs.md. */
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

/* ---- pure parts (verbs_priv.h): codecs, parsing, status mapping; unit-tested without a device */
void rw_vb_hello_pack(const rw_vb_hello_t *hello, uint8_t out[RW_VB_HELLO_SIZE])
{
	rw_put_le(out + 0, RW_VB_HELLO_MAGIC, 4);
	rw_put_le(out + 4, RW_VB_HELLO_VERSION, 2);
	rw_put_le(out + 6, hello->flags, 2);
	rw_put_le(out + 8, hello->tag, 8);
	rw_put_le(out + 16, hello->max_writes, 4);
	rw_put_le(out + 20, hello->rail, 4);
	memcpy(out + 24, hello->proof, RW_VB_PROOF_SIZE);
}

rw_status_t rw_vb_hello_unpack(const void *in, size_t len, rw_vb_hello_t *hello_p)
{
	const uint8_t *p = in;
	if (!p || len < RW_VB_HELLO_SIZE)
		return RW_ERR_PROTO;
	if (rw_get_le(p + 0, 4) != RW_VB_HELLO_MAGIC || rw_get_le(p + 4, 2) != RW_VB_HELLO_VERSION)
		return RW_ERR_PROTO;
	uint16_t flags = (uint16_t)rw_get_le(p + 6, 2);
	if (flags & ~RW_VB_HELLO_IMM)
		return RW_ERR_PROTO;
	hello_p->flags = flags;
	hello_p->tag = rw_get_le(p + 8, 8);
	hello_p->max_writes = (uint32_t)rw_get_le(p + 16, 4);
	hello_p->rail = (uint32_t)rw_get_le(p + 20, 4);
	memcpy(hello_p->proof, p + 24, RW_VB_PROOF_SIZE);
	return RW_OK;
}

void rw_vb_sendmsg_pack(uint32_t imm, uint64_t length, uint8_t out[RW_VB_SENDMSG_SIZE])
{
	rw_put_le(out + 0, RW_VB_SENDMSG_MAGIC, 4);
	rw_put_le(out + 4, imm, 4);
	rw_put_le(out + 8, length, 8);
}

rw_status_t rw_vb_sendmsg_unpack(const void *in, size_t len, uint32_t *imm_p, uint64_t *length_p)
{
	const uint8_t *p = in;
	if (!p || len != RW_VB_SENDMSG_SIZE || rw_get_le(p, 4) != RW_VB_SENDMSG_MAGIC)
		return RW_ERR_PROTO;
	*imm_p = (uint32_t)rw_get_le(p + 4, 4);
	*length_p = rw_get_le(p + 8, 8);
	return RW_OK;
}

rw_status_t rw_vb_parse_dev_port(const char *s, char name_p[64], uint8_t *port_p)
{
	if (!s || !*s)
		return RW_ERR_INVAL;
	const char *colon = strchr(s, ':');
	size_t n = colon ? (size_t)(colon - s) : strlen(s);
	if (n == 0 || n >= 64)
		return RW_ERR_INVAL;
	unsigned long port = 1;
	if (colon) {
		const char *ps = colon + 1;
		if (*ps < '0' || *ps > '9')
			return RW_ERR_INVAL;
		char *end;
		port = strtoul(ps, &end, 10);
		if (*end != '\0' || port == 0 || port > 255)
			return RW_ERR_INVAL;
	}
	memcpy(name_p, s, n);
	name_p[n] = '\0';
	*port_p = (uint8_t)port;
	return RW_OK;
}

uint64_t rw_vb_parse_count(const char *s)
{
	if (!s || !*s)
		return 0;
	uint64_t x = 0;
	for (; *s; s++) {
		if (*s < '0' || *s > '9' || x > (UINT64_MAX - 9) / 10)
			return 0;
		x = x * 10 + (uint64_t)(*s - '0');
	}
	return x;
}

int rw_vb_rail_listed(const char *list, unsigned rail)
{
	while (list && *list) {
		const char *end = strchr(list, ',');
		size_t n = end ? (size_t)(end - list) : strlen(list);
		char item[16];
		if (n > 0 && n < sizeof(item)) {
			memcpy(item, list, n);
			item[n] = '\0';
			if (strspn(item, "0123456789") == n && rw_vb_parse_count(item) == rail)
				return 1;
		}
		list = end ? end + 1 : NULL;
	}
	return 0;
}

rw_status_t rw_vb_wc_status_to_rw(int wc_status)
{
	switch (wc_status) {
	case IBV_WC_SUCCESS:
		return RW_OK;
	case IBV_WC_REM_ACCESS_ERR:
	case IBV_WC_REM_INV_REQ_ERR:
	case IBV_WC_REM_OP_ERR:
	case IBV_WC_REM_INV_RD_REQ_ERR:
	case IBV_WC_BAD_RESP_ERR:
		return RW_ERR_PROTO;
	case IBV_WC_RETRY_EXC_ERR:
	case IBV_WC_RNR_RETRY_EXC_ERR:
	case IBV_WC_REM_ABORT_ERR:
	case IBV_WC_RESP_TIMEOUT_ERR:
	case IBV_WC_WR_FLUSH_ERR: /* the QP went to error first; its cause was reported then */
		return RW_ERR_PEER;
	default: /* local length/protection/QP errors, fatal, general */
		return RW_ERR_LINK;
	}
}

/* ---- the transport ------------------------------------------------------------------------ */

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
	                              * 2 while more_cb is due to poll it */
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

static int set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void fmt_sin(const struct sockaddr *sa, char *buf, size_t len)
{
	const struct sockaddr_in *sin = (const struct sockaddr_in *)sa;
	char ip[INET_ADDRSTRLEN] = "?";
	if (sa && sa->sa_family == AF_INET)
		inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof(ip));
	snprintf(buf, len, "%s:%u", ip, sa && sa->sa_family == AF_INET ? ntohs(sin->sin_port) : 0);
}

/* ---- connection teardown and failure --------------------------------------------------- */

static void conn_free(vb_conn_t *c)
{
	ev_timer_stop(c->dev->base.loop, &c->timer);
	if (c->id && c->id->qp)
		rdma_destroy_qp(c->id);
	if (c->cq && ibv_destroy_cq(c->cq))
		rw_warn("verbs: rail %u peer %s: ibv_destroy_cq: %m", c->dev->base.rail, c->base.peer);
	if (c->slots_mr)
		ibv_dereg_mr(c->slots_mr);
	free(c->slots);
	if (c->id)
		rdma_destroy_id(c->id);
	free(c->pend);
	free(c);
}

static void reap_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	vb_dev_t *d = w->data;
	while (d->zombies) {
		vb_conn_t *c = d->zombies;
		LIST_UNLINK(d->zombies, c);
		conn_free(c);
	}
}

/* Take c out of service: no more callbacks, resources freed by the reap timer (never inside a
 * dispatch that may still hold c). */
static void conn_bury(vb_conn_t *c)
{
	vb_dev_t *d = c->dev;
	c->closed = 1;
	ev_timer_stop(d->base.loop, &c->timer);
	LIST_UNLINK(d->conns, c);
	LIST_PUSH(d->zombies, c);
	ev_timer_stop(d->base.loop, &d->reap);
	ev_timer_set(&d->reap, 0., 0.);
	ev_timer_start(d->base.loop, &d->reap);
}

/* Terminal failure: every outstanding write gets on_write_done(st) in posting order, then
 * on_error(st) once. An accepted connection not yet announced is dropped silently. */
static void conn_fail(vb_conn_t *c, rw_status_t st)
{
	if (c->failed || c->closed)
		return;
	c->failed = 1;
	c->base.state = RW_RAIL_CONN_DOWN;
	c->dev->base.stats.conn_failures++;
	ev_timer_stop(c->dev->base.loop, &c->timer);
	if (c->id && c->id->qp)
		rdma_disconnect(c->id); /* the peer learns at once; errors here change nothing */
	if (!c->announced && c->base.accepted) {
		rw_info("verbs: rail %u: dropped incoming connection from %s before it was up: %s",
			c->dev->base.rail, c->base.peer, rw_status_str(st));
		conn_bury(c);
		return;
	}
	while (c->head != c->tail && !c->closed) {
		void *wctx = c->pend[c->head % c->max_writes].ctx;
		c->head++;
		if (c->base.cbs.on_write_done)
			c->base.cbs.on_write_done(&c->base, c->base.ctx, wctx, st);
	}
	if (!c->closed && c->base.cbs.on_error)
		c->base.cbs.on_error(&c->base, c->base.ctx, st);
}

static void timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	vb_conn_t *c = w->data;
	if (c->later_err != RW_OK) {
		conn_fail(c, c->later_err);
		return;
	}
	rw_err("verbs: rail %u peer %s: handshake timed out after %.0f s", c->dev->base.rail,
	       c->base.peer, VB_HANDSHAKE_TIMEOUT_S);
	conn_fail(c, RW_ERR_TIMEOUT);
}

/* Failure decided inside an rw_rail_* call: reported from the loop, never re-entrantly. */
static void conn_fail_later(vb_conn_t *c, rw_status_t st)
{
	if (c->failed || c->closed || c->later_err != RW_OK)
		return;
	c->later_err = st;
	ev_timer_stop(c->dev->base.loop, &c->timer);
	ev_timer_set(&c->timer, 0., 0.);
	ev_timer_start(c->dev->base.loop, &c->timer);
}

static vb_conn_t *conn_new(vb_dev_t *d, const rw_rail_conn_cbs_t *cbs, void *ctx, int accepted,
			   uint64_t tag)
{
	vb_conn_t *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->max_writes = d->base.max_writes;
	c->window = c->max_writes;
	c->recv_depth = d->base.max_writes;
	c->pend = calloc(c->max_writes, sizeof(*c->pend));
	if (!c->pend) {
		free(c);
		return NULL;
	}
	c->base.dev = &d->base;
	c->base.cbs = *cbs;
	c->base.ctx = ctx;
	c->base.state = RW_RAIL_CONN_CONNECTING;
	c->base.tag = tag;
	c->base.accepted = accepted;
	c->dev = d;
	c->owner.kind = VB_KIND_CONN;
	c->owner.obj = c;
	ev_timer_init(&c->timer, timer_cb, VB_HANDSHAKE_TIMEOUT_S, 0.);
	c->timer.data = c;
	LIST_PUSH(d->conns, c);
	return c;
}

/* ---- queue pair and receive slots ------------------------------------------------------ */

static uint8_t *recv_slot(vb_conn_t *c, uint32_t i)
{
	return c->slots + (size_t)i * RW_VB_SENDMSG_SIZE;
}

static uint8_t *send_slot(vb_conn_t *c, uint64_t seq)
{
	return c->slots + ((size_t)c->recv_depth + seq % c->max_writes) * RW_VB_SENDMSG_SIZE;
}

static int post_recv(vb_conn_t *c, uint32_t i)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)recv_slot(c, i),
		.length = RW_VB_SENDMSG_SIZE,
		.lkey = c->slots_mr->lkey,
	};
	struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1}, *bad;
	return ibv_post_recv(c->id->qp, &wr, &bad);
}

/* CQ, slots and RC QP on c->id (whose verbs context is the device's); receives posted. */
static rw_status_t conn_setup_qp(vb_conn_t *c)
{
	vb_dev_t *d = c->dev;
	if (c->id->verbs != d->ctx) {
		rw_err("verbs: rail %u peer %s: route leaves through another RDMA device (%s), not "
		       "this rail's", d->base.rail, c->base.peer,
		       c->id->verbs ? ibv_get_device_name(c->id->verbs->device) : "none");
		return RW_ERR_LINK;
	}
	uint32_t send_wr = 2 * c->max_writes; /* WRITE + SEND per write in the fallback mode */
	c->sq_depth = send_wr;
	int cqe = (int)RW_MIN((uint64_t)send_wr + c->recv_depth + 1, d->max_cqe);
	c->cq = ibv_create_cq(d->ctx, cqe, c, d->cc, 0);
	if (!c->cq) {
		rw_err("verbs: rail %u peer %s: ibv_create_cq(%d): %m", d->base.rail, c->base.peer, cqe);
		return RW_ERR_SYS;
	}
	size_t bytes = ((size_t)c->recv_depth + c->max_writes) * RW_VB_SENDMSG_SIZE;
	c->slots = calloc(1, bytes);
	if (!c->slots)
		return RW_ERR_NOMEM;
	c->slots_mr = ibv_reg_mr(d->pd, c->slots, bytes, IBV_ACCESS_LOCAL_WRITE);
	if (!c->slots_mr) {
		rw_err("verbs: rail %u peer %s: ibv_reg_mr(slots): %m", d->base.rail, c->base.peer);
		return RW_ERR_SYS;
	}
	struct ibv_qp_init_attr qa = {
		.qp_context = c,
		.send_cq = c->cq,
		.recv_cq = c->cq,
		.cap = {.max_send_wr = send_wr, .max_recv_wr = c->recv_depth,
			.max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
		.sq_sig_all = 0,
	};
	if (rdma_create_qp(c->id, d->pd, &qa)) {
		rw_err("verbs: rail %u peer %s: rdma_create_qp(send %u, recv %u): %m", d->base.rail,
		       c->base.peer, send_wr, c->recv_depth);
		return RW_ERR_SYS;
	}
	for (uint32_t i = 0; i < c->recv_depth; i++) {
		if (post_recv(c, i)) {
			rw_err("verbs: rail %u peer %s: ibv_post_recv: %m", d->base.rail, c->base.peer);
			return RW_ERR_SYS;
		}
	}
	return RW_OK;
}

/* RW_VERBS_ACK_TIMEOUT: the local ack timeout of c's QP (4.096 us x 2^code per try), set on the
 * cm_id before it connects or accepts. The CM's default on RoCE is ~2 s (code 19): a peer that
 * stops acknowledging fails writes after 7 tries, ~17 s. */
static void conn_set_ack_timeout(vb_conn_t *c)
{
	uint8_t t = c->dev->ack_timeout;
	if (t && rdma_set_option(c->id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof(t)))
		rw_warn("verbs: rail %u peer %s: cannot set the ack timeout: %m", c->dev->base.rail,
			c->base.peer);
}

static void conn_param_init(struct rdma_conn_param *p, const uint8_t *hello)
{
	memset(p, 0, sizeof(*p));
	p->private_data = hello;
	p->private_data_len = RW_VB_HELLO_SIZE;
	p->responder_resources = 0; /* writes only, no RDMA READ */
	p->initiator_depth = 0;
	/* 6, not 7: Soft-RoCE (rxe) takes a retry count of 7 as "retry forever" (the spec gives
	 * that meaning only to the RNR count), so a peer that stopped answering would never fail
	 * its writes; with 6 they fail with RETRY_EXC after 7 ack timeouts everywhere. */
	p->retry_count = 6;
	p->rnr_retry_count = 7; /* receiver briefly out of receives: wait, never fail */
}

/* ---- completions ------------------------------------------------------------------------ */

static void conn_poll(vb_conn_t *c);

static void conn_up(vb_conn_t *c)
{
	vb_dev_t *d = c->dev;
	ev_timer_stop(d->base.loop, &c->timer);
	c->base.state = RW_RAIL_CONN_UP;
	c->announced = 1;
	/* The RNR NAK timer we ask of peers when a notification finds no receive posted: the CM
	 * leaves the spec's code 0, which means 655 ms, a stall per NAK; ours repost at once. */
	struct ibv_qp_attr qa = {.min_rnr_timer = VB_MIN_RNR_TIMER};
	if (ibv_modify_qp(c->id->qp, &qa, IBV_QP_MIN_RNR_TIMER))
		rw_dbg("verbs: rail %u peer %s: cannot set the RNR timer (%m): the CM's stays",
		       d->base.rail, c->base.peer);
	rw_info("verbs: rail %u: %s %s (%s, %u writes in flight)", d->base.rail,
		c->base.accepted ? "accepted" : "connected to", c->base.peer,
		c->write_send ? "RDMA WRITE + SEND" : "RDMA WRITE WITH IMM", c->window);
	/* Completions are looked at only from now on: no arrival before on_connected(). */
	if (ibv_req_notify_cq(c->cq, 0)) {
		rw_err("verbs: rail %u peer %s: ibv_req_notify_cq: %m", d->base.rail, c->base.peer);
		conn_fail_later(c, RW_ERR_LINK);
	}
	if (c->base.cbs.on_connected)
		c->base.cbs.on_connected(&c->base, c->base.ctx);
	if (!c->closed && !c->failed)
		conn_poll(c); /* whatever completed before the CQ was armed */
}

static void write_completed(vb_conn_t *c, uint64_t wr_id)
{
	if (c->head == c->tail || wr_id != c->head) {
		rw_err("verbs: rail %u peer %s: completion %llu out of order (expected %llu)",
		       c->dev->base.rail, c->base.peer, (unsigned long long)wr_id,
		       (unsigned long long)c->head);
		conn_fail(c, RW_ERR_LINK);
		return;
	}
	vb_pending_t *pw = &c->pend[c->head % c->max_writes];
	void *wctx = pw->ctx;
	c->sq_used -= pw->wqes;
	c->head++;
	if (c->base.cbs.on_write_done)
		c->base.cbs.on_write_done(&c->base, c->base.ctx, wctx, RW_OK);
	if (!c->closed && !c->failed && c->want_writable && c->tail - c->head < c->window &&
	    c->sq_used < c->sq_depth) {
		c->want_writable = 0;
		if (c->base.cbs.on_writable)
			c->base.cbs.on_writable(&c->base, c->base.ctx);
	}
}

static void arrived(vb_conn_t *c, const struct ibv_wc *wc)
{
	rw_rail_arrival_t a = {0};
	uint32_t slot = (uint32_t)wc->wr_id;
	if (slot >= c->recv_depth) {
		conn_fail(c, RW_ERR_LINK);
		return;
	}
	/* Both notifications are valid whatever this end sends: a peer using write with
	 * immediate still sends {imm, length} after a write longer than one message. */
	if (wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM && (wc->wc_flags & IBV_WC_WITH_IMM)) {
		a.imm = ntohl(wc->imm_data);
		a.length = wc->byte_len;
	} else if (wc->opcode != IBV_WC_RECV ||
		   rw_vb_sendmsg_unpack(recv_slot(c, slot), wc->byte_len, &a.imm, &a.length)) {
		rw_err("verbs: rail %u peer %s: malformed write notification (opcode %d, %u bytes)",
		       c->dev->base.rail, c->base.peer, (int)wc->opcode, wc->byte_len);
		conn_fail(c, RW_ERR_PROTO);
		return;
	}
	/* Give the slot back before telling the caller: the peer may have more in flight. */
	if (post_recv(c, slot)) {
		rw_err("verbs: rail %u peer %s: ibv_post_recv: %m", c->dev->base.rail, c->base.peer);
		conn_fail(c, RW_ERR_LINK);
		return;
	}
	if (c->base.cbs.on_arrival)
		c->base.cbs.on_arrival(&c->base, c->base.ctx, &a);
}

/* A failed work completion, counted by kind in the device's stats (rail.h). */
static void count_wc_error(vb_dev_t *d, enum ibv_wc_status status)
{
	rw_rail_dev_stats_t *s = &d->base.stats;
	switch (status) {
	case IBV_WC_RETRY_EXC_ERR:
		s->retry_exceeded++;
		break;
	case IBV_WC_RNR_RETRY_EXC_ERR:
		s->rnr_retry_exceeded++;
		break;
	case IBV_WC_REM_ACCESS_ERR:
	case IBV_WC_REM_INV_REQ_ERR:
	case IBV_WC_REM_OP_ERR:
		s->remote_errors++;
		break;
	case IBV_WC_WR_FLUSH_ERR:
		break; /* the consequence of an error already counted */
	default:
		s->wc_errors++;
		break;
	}
}

/* Poll c's CQ until it is empty or the device's poll_budget completions were handled in this
 * call (VB_POLL_BUDGET; RW_VERBS_POLL_BUDGET lowers it); in the latter case c is marked `more` and the device's `more` timer (zero delay: the loop's other
 * watchers, control sockets and ranks, run first) polls on. The CQ is armed before polling
 * (cq_cb), so completions left in it raise no new event: the timer is what finds them. */
static void conn_poll(vb_conn_t *c)
{
	struct ibv_wc wc[VB_POLL_BATCH];
	uint32_t budget = c->dev->poll_budget;
	c->more = 0;
	while (!c->closed && !c->failed) {
		if (budget == 0) {
			vb_dev_t *d = c->dev;
			c->more = 1;
			d->base.stats.poll_yields++;
			if (!ev_is_active(&d->more))
				ev_timer_start(d->base.loop, &d->more);
			return;
		}
		int want = (int)RW_MIN(budget, (uint32_t)VB_POLL_BATCH);
		int n = ibv_poll_cq(c->cq, want, wc);
		if (n < 0) {
			rw_err("verbs: rail %u peer %s: ibv_poll_cq failed", c->dev->base.rail,
			       c->base.peer);
			conn_fail(c, RW_ERR_LINK);
			return;
		}
		budget -= (uint32_t)RW_MAX(n, 0);
		for (int i = 0; i < n; i++) {
			if (c->closed || c->failed)
				return;
			if (wc[i].status != IBV_WC_SUCCESS) {
				rw_status_t st = rw_vb_wc_status_to_rw(wc[i].status);
				count_wc_error(c->dev, wc[i].status);
				rw_err("verbs: rail %u peer %s: work completion failed: %s (%s)",
				       c->dev->base.rail, c->base.peer,
				       ibv_wc_status_str(wc[i].status), rw_status_str(st));
				conn_fail(c, st);
				return;
			}
			if (wc[i].opcode & IBV_WC_RECV)
				arrived(c, &wc[i]);
			else if (!(wc[i].wr_id & VB_WRITE_BIT))
				write_completed(c, wc[i].wr_id);
		}
		if (n < want)
			return;
	}
}

static void cq_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	vb_dev_t *d = w->data;
	struct ibv_cq *cq;
	void *cq_ctx;
	while (ibv_get_cq_event(d->cc, &cq, &cq_ctx) == 0) {
		ibv_ack_cq_events(cq, 1); /* acked at once: destroying a CQ never waits on us */
		vb_conn_t *c = cq_ctx;
		if (c->closed || c->failed || c->base.state != RW_RAIL_CONN_UP)
			continue;
		if (ibv_req_notify_cq(cq, 0)) {
			conn_fail(c, RW_ERR_LINK);
			continue;
		}
		conn_poll(c);
	}
}

/* The device's `more` timer: poll on, once each, every connection whose last poll stopped at
 * its budget (`more` 1 -> 2: due in this round; conn_poll sets it to 0, or to 1 for the next
 * round). Callbacks may close or fail connections (they leave d->conns), so the walk restarts
 * after each poll. */
static void more_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	vb_dev_t *d = w->data;
	for (vb_conn_t *c = d->conns; c; c = c->next)
		if (c->more == 1)
			c->more = 2;
	for (;;) {
		vb_conn_t *c = d->conns;
		while (c && !(c->more == 2 && !c->closed && !c->failed))
			c = c->next;
		if (!c)
			return;
		conn_poll(c);
	}
}

/* Fail every live connection of d (a port or device went away). Callbacks may close others,
 * so restart the walk after each failure. */
static void dev_fail_all(vb_dev_t *d, rw_status_t st)
{
	for (;;) {
		vb_conn_t *c = d->conns;
		while (c && c->failed)
			c = c->next;
		if (!c)
			return;
		conn_fail(c, st);
	}
}

static void async_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	vb_dev_t *d = w->data;
	struct ibv_async_event ev;
	while (ibv_get_async_event(d->ctx, &ev) == 0) {
		enum ibv_event_type type = ev.event_type;
		struct ibv_qp *qp = NULL;
		int port = 0;
		switch (type) {
		case IBV_EVENT_QP_FATAL:
		case IBV_EVENT_QP_REQ_ERR:
		case IBV_EVENT_QP_ACCESS_ERR:
		case IBV_EVENT_COMM_EST:
		case IBV_EVENT_PATH_MIG_ERR:
			qp = ev.element.qp;
			break;
		case IBV_EVENT_PORT_ERR:
		case IBV_EVENT_PORT_ACTIVE:
			port = ev.element.port_num;
			break;
		default:
			break;
		}
		ibv_ack_async_event(&ev);
		/* The QP may belong to another rail that shares this device (and so this fd):
		 * its connection knows its own device. */
		vb_conn_t *c = qp ? qp->qp_context : NULL;
		if (c && (c->closed || c->failed))
			c = NULL;
		switch (type) {
		case IBV_EVENT_COMM_EST:
			/* Data arrived before the CM's RTU: tell the CM the connection is up. */
			if (c && !c->announced)
				rdma_notify(c->id, IBV_EVENT_COMM_EST);
			break;
		case IBV_EVENT_QP_FATAL:
		case IBV_EVENT_QP_REQ_ERR:
		case IBV_EVENT_QP_ACCESS_ERR:
		case IBV_EVENT_PATH_MIG_ERR:
			if (c) {
				rw_err("verbs: rail %u peer %s: %s", c->dev->base.rail, c->base.peer,
				       ibv_event_type_str(type));
				conn_fail(c, type == IBV_EVENT_QP_ACCESS_ERR ? RW_ERR_PROTO : RW_ERR_LINK);
			}
			break;
		case IBV_EVENT_PORT_ERR:
			if (port == d->port_num) {
				rw_err("verbs: rail %u: port %d of %s went down", d->base.rail, port,
				       ibv_get_device_name(d->ctx->device));
				dev_fail_all(d, RW_ERR_LINK);
			}
			break;
		case IBV_EVENT_DEVICE_FATAL:
			rw_err("verbs: rail %u: device %s failed", d->base.rail,
			       ibv_get_device_name(d->ctx->device));
			dev_fail_all(d, RW_ERR_LINK);
			break;
		default:
			rw_dbg("verbs: rail %u: async event %s", d->base.rail, ibv_event_type_str(type));
			break;
		}
	}
}

/* ---- connection management (librdmacm events on the loop) -------------------------------- */

static void on_connect_request(vb_listener_t *l, struct rdma_cm_id *id, const void *pdata,
			       size_t pdata_len)
{
	vb_dev_t *d = (vb_dev_t *)l->base.dev;
	char peer[RW_RAIL_ADDR_MAX];
	fmt_sin(rdma_get_peer_addr(id), peer, sizeof(peer));
	rw_vb_hello_t hello;
	rw_status_t st = rw_vb_hello_unpack(pdata, pdata_len, &hello);
	if (st != RW_OK) {
		rw_warn("verbs: rail %u: rejected a connection from %s: no valid hello", d->base.rail,
			peer);
		goto reject;
	}
	if (hello.rail != d->base.rail) {
		rw_warn("verbs: rail %u: rejected a connection from %s: it is on rail %u",
			d->base.rail, peer, hello.rail);
		goto reject;
	}
	vb_conn_t *c = conn_new(d, &l->base.cbs, l->base.ctx, 1, hello.tag);
	if (!c) {
		rw_err("verbs: rail %u: out of memory accepting %s", d->base.rail, peer);
		goto reject;
	}
	c->id = id;
	id->context = &c->owner;
	snprintf(c->base.peer, sizeof(c->base.peer), "%s", peer);
	rw_vb_hello_t reply = {.flags = d->hello_flags, .rail = d->base.rail};
	/* The user's check of the connector's proof, before a QP is made for it: a refused
	 * connection costs no queue pair and is never announced. */
	if (l->base.cbs.on_verify &&
	    l->base.cbs.on_verify(&c->base, l->base.ctx, hello.proof, reply.proof) != 0) {
		rw_warn("verbs: rail %u: rejected a connection from %s (tag %llu): no valid proof",
			d->base.rail, peer, (unsigned long long)hello.tag);
		rdma_reject(id, NULL, 0);
		conn_bury(c); /* frees id with c */
		return;
	}
	c->write_send = rw_vb_use_write_send(d->hello_flags, hello.flags);
	c->window = rw_vb_window(c->max_writes, hello.max_writes);
	st = conn_setup_qp(c);
	if (st != RW_OK) {
		rdma_reject(id, NULL, 0);
		conn_bury(c); /* frees id with c */
		return;
	}
	conn_set_ack_timeout(c);
	reply.max_writes = c->max_writes;
	uint8_t buf[RW_VB_HELLO_SIZE];
	rw_vb_hello_pack(&reply, buf);
	struct rdma_conn_param param;
	conn_param_init(&param, buf);
	if (rdma_accept(id, &param)) {
		rw_err("verbs: rail %u: rdma_accept(%s): %m", d->base.rail, peer);
		conn_bury(c);
		return;
	}
	ev_timer_start(d->base.loop, &c->timer);
	return;
reject:
	rdma_reject(id, NULL, 0);
	rdma_destroy_id(id);
}

static void conn_cm_event(vb_conn_t *c, enum rdma_cm_event_type type, int status,
			  const void *pdata, size_t pdata_len)
{
	vb_dev_t *d = c->dev;
	if (c->closed || c->failed)
		return;
	rw_status_t st;
	switch (type) {
	case RDMA_CM_EVENT_ADDR_RESOLVED:
		st = conn_setup_qp(c);
		if (st != RW_OK) {
			conn_fail(c, st);
			return;
		}
		if (rdma_resolve_route(c->id, VB_RESOLVE_TIMEOUT_MS)) {
			rw_err("verbs: rail %u peer %s: rdma_resolve_route: %m", d->base.rail,
			       c->base.peer);
			conn_fail(c, RW_ERR_PEER);
		}
		return;
	case RDMA_CM_EVENT_ROUTE_RESOLVED: {
		rw_vb_hello_t hello = {.flags = d->hello_flags, .tag = c->base.tag,
				       .max_writes = c->max_writes, .rail = d->base.rail};
		memcpy(hello.proof, c->base.proof, RW_VB_PROOF_SIZE);
		uint8_t buf[RW_VB_HELLO_SIZE];
		rw_vb_hello_pack(&hello, buf);
		struct rdma_conn_param param;
		conn_param_init(&param, buf);
		conn_set_ack_timeout(c);
		if (rdma_connect(c->id, &param)) {
			rw_err("verbs: rail %u peer %s: rdma_connect: %m", d->base.rail, c->base.peer);
			conn_fail(c, RW_ERR_PEER);
		}
		return;
	}
	case RDMA_CM_EVENT_ESTABLISHED:
		if (!c->base.accepted) {
			rw_vb_hello_t reply;
			if (rw_vb_hello_unpack(pdata, pdata_len, &reply) != RW_OK) {
				rw_err("verbs: rail %u peer %s: accepted without a valid hello",
				       d->base.rail, c->base.peer);
				conn_fail(c, RW_ERR_PROTO);
				return;
			}
			if (c->base.cbs.on_verify &&
			    c->base.cbs.on_verify(&c->base, c->base.ctx, reply.proof, NULL) != 0) {
				rw_err("verbs: rail %u peer %s: the acceptor's proof is not valid",
				       d->base.rail, c->base.peer);
				conn_fail(c, RW_ERR_PROTO);
				return;
			}
			c->write_send = rw_vb_use_write_send(d->hello_flags, reply.flags);
			c->window = rw_vb_window(c->max_writes, reply.max_writes);
		}
		conn_up(c);
		return;
	case RDMA_CM_EVENT_ADDR_ERROR:
	case RDMA_CM_EVENT_ROUTE_ERROR:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
	case RDMA_CM_EVENT_REJECTED:
		rw_err("verbs: rail %u peer %s: %s (status %d)", d->base.rail, c->base.peer,
		       rdma_event_str(type), status);
		conn_fail(c, RW_ERR_PEER);
		return;
	case RDMA_CM_EVENT_DISCONNECTED:
		rw_info("verbs: rail %u peer %s: disconnected", d->base.rail, c->base.peer);
		conn_fail(c, RW_ERR_PEER);
		return;
	case RDMA_CM_EVENT_DEVICE_REMOVAL:
		rw_err("verbs: rail %u peer %s: RDMA device removed", d->base.rail, c->base.peer);
		conn_fail(c, RW_ERR_LINK);
		return;
	default:
		rw_dbg("verbs: rail %u peer %s: %s", d->base.rail, c->base.peer, rdma_event_str(type));
		return;
	}
}

static void cm_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	vb_dev_t *d = w->data;
	struct rdma_cm_event *ev;
	while (rdma_get_cm_event(d->ec, &ev) == 0) {
		/* Copy what we need and ack at once, so that destroying an id never waits. */
		enum rdma_cm_event_type type = ev->event;
		int status = ev->status;
		struct rdma_cm_id *id = ev->id;
		vb_owner_t *owner = type == RDMA_CM_EVENT_CONNECT_REQUEST ? ev->listen_id->context
									   : id->context;
		uint8_t pdata[RW_VB_HELLO_SIZE];
		size_t pdata_len = 0;
		if ((type == RDMA_CM_EVENT_CONNECT_REQUEST || type == RDMA_CM_EVENT_ESTABLISHED) &&
		    ev->param.conn.private_data) {
			pdata_len = RW_MIN((size_t)ev->param.conn.private_data_len, sizeof(pdata));
			memcpy(pdata, ev->param.conn.private_data, pdata_len);
		}
		rdma_ack_cm_event(ev);
		if (!owner)
			continue;
		switch (owner->kind) {
		case VB_KIND_LISTENER:
			if (type == RDMA_CM_EVENT_CONNECT_REQUEST)
				on_connect_request(owner->obj, id, pdata, pdata_len);
			else
				rw_dbg("verbs: rail %u: listener: %s", d->base.rail, rdma_event_str(type));
			break;
		case VB_KIND_CONN:
			conn_cm_event(owner->obj, type, status, pdata, pdata_len);
			break;
		default:
			if (type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
				rw_err("verbs: rail %u: RDMA device removed", d->base.rail);
				dev_fail_all(d, RW_ERR_LINK);
			}
			break;
		}
	}
}

/* ---- vtable: connections ---------------------------------------------------------------- */

static rw_status_t vb_listen(rw_rail_dev_t *base, const rw_rail_conn_cbs_t *cbs, void *ctx,
			     rw_rail_listener_t **listener_p)
{
	vb_dev_t *d = (vb_dev_t *)base;
	vb_listener_t *l = calloc(1, sizeof(*l));
	if (!l)
		return RW_ERR_NOMEM;
	l->base.dev = base;
	l->base.cbs = *cbs;
	l->base.ctx = ctx;
	l->owner.kind = VB_KIND_LISTENER;
	l->owner.obj = l;
	rw_status_t st = RW_ERR_SYS;
	if (rdma_create_id(d->ec, &l->id, &l->owner, RDMA_PS_TCP)) {
		rw_err("verbs: rail %u: rdma_create_id: %m", base->rail);
		goto free_l;
	}
	struct sockaddr_in sin = d->addr;
	sin.sin_port = htons(base->port);
	if (rdma_bind_addr(l->id, (struct sockaddr *)&sin)) {
		rw_err("verbs: rail %u: cannot listen on %s port %u: %m", base->rail, base->local,
		       base->port);
		goto destroy_id;
	}
	if (rdma_listen(l->id, VB_LISTEN_BACKLOG)) {
		rw_err("verbs: rail %u: rdma_listen: %m", base->rail);
		goto destroy_id;
	}
	sin.sin_port = rdma_get_src_port(l->id);
	fmt_sin((struct sockaddr *)&sin, l->base.addr, sizeof(l->base.addr));
	LIST_PUSH(d->listeners, l);
	*listener_p = &l->base;
	return RW_OK;
destroy_id:
	rdma_destroy_id(l->id);
free_l:
	free(l);
	return st;
}

static void vb_listener_close(rw_rail_listener_t *base)
{
	vb_dev_t *d = (vb_dev_t *)base->dev;
	vb_listener_t *l = (vb_listener_t *)base;
	LIST_UNLINK(d->listeners, l);
	rdma_destroy_id(l->id); /* pending, unclaimed requests die with it (the kernel's job) */
	free(l);
}

static rw_status_t vb_connect(rw_rail_dev_t *base, const char *peer_addr, uint64_t tag,
			      const rw_rail_conn_cbs_t *cbs, void *ctx, rw_rail_conn_t **conn_p)
{
	vb_dev_t *d = (vb_dev_t *)base;
	uint32_t ip;
	uint16_t port;
	if (rw_rail_addr_parse(peer_addr, &ip, &port) != RW_OK) {
		rw_err("verbs: rail %u: bad peer address '%s' (want a.b.c.d:port)", base->rail,
		       peer_addr);
		return RW_ERR_INVAL;
	}
	vb_conn_t *c = conn_new(d, cbs, ctx, 0, tag);
	if (!c)
		return RW_ERR_NOMEM;
	snprintf(c->base.peer, sizeof(c->base.peer), "%s", peer_addr);
	if (rdma_create_id(d->ec, &c->id, &c->owner, RDMA_PS_TCP)) {
		rw_err("verbs: rail %u: rdma_create_id: %m", base->rail);
		c->id = NULL;
		LIST_UNLINK(d->conns, c);
		conn_free(c);
		return RW_ERR_SYS;
	}
	struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons(port)};
	dst.sin_addr.s_addr = ip;
	struct sockaddr_in src = d->addr; /* leave through this rail's device */
	ev_timer_start(base->loop, &c->timer);
	if (rdma_resolve_addr(c->id, (struct sockaddr *)&src, (struct sockaddr *)&dst,
			      VB_RESOLVE_TIMEOUT_MS)) {
		rw_err("verbs: rail %u: rdma_resolve_addr(%s): %m", base->rail, peer_addr);
		conn_fail_later(c, RW_ERR_PEER);
	}
	*conn_p = &c->base;
	return RW_OK;
}

#define VB_POST_BATCH 16 /* send WRs chained into one ibv_post_send (one doorbell) */

static rw_status_t vb_write(rw_rail_conn_t *base, const rw_rail_write_t *w)
{
	vb_conn_t *c = (vb_conn_t *)base;
	if (c->failed || c->closed || c->later_err != RW_OK)
		return RW_ERR_STATE;
	if (w->remote.key > UINT32_MAX)
		return RW_ERR_INVAL;
	/* One WRITE WITH IMM when the connection uses it and the write fits one message;
	 * otherwise RDMA WRITEs of at most `chunk` bytes (unsignaled) and a SEND of {imm,
	 * length}: RC executes them in order, so the target's receive completion implies all
	 * the data is placed (rail.h rule 2), and our SEND completion that it was acked. */
	uint64_t chunk = c->dev->chunk;
	uint64_t nchunks = (w->length + chunk - 1) / chunk;
	int single = !c->write_send && w->length <= chunk;
	uint32_t wqes = single ? 1 : (uint32_t)nchunks + 1;
	if (c->tail - c->head >= c->window || c->sq_used + wqes > c->sq_depth) {
		c->want_writable = 1;
		c->dev->base.stats.write_again++;
		return RW_ERR_AGAIN;
	}
	const vb_region_t *lr = (const vb_region_t *)w->local;
	if (nchunks > 1)
		c->dev->base.stats.chunked_writes++;
	uint64_t seq = c->tail;
	c->pend[seq % c->max_writes] = (vb_pending_t){.ctx = w->ctx, .wqes = wqes};
	c->tail++;
	c->sq_used += wqes;

	struct ibv_send_wr wr[VB_POST_BATCH], *bad;
	struct ibv_sge sge[VB_POST_BATCH];
	int n = 0, rc = 0;
	memset(wr, 0, sizeof(wr));
	for (uint64_t k = 0; k < (single ? 1 : nchunks) && !rc; k++) {
		uint64_t off = k * chunk;
		uint64_t len = RW_MIN(chunk, w->length - off);
		sge[n] = (struct ibv_sge){.addr = lr->sge_base + w->local_offset + off,
					  .length = (uint32_t)len, .lkey = lr->mr->lkey};
		wr[n] = (struct ibv_send_wr){
			.wr_id = seq | VB_WRITE_BIT,
			.opcode = IBV_WR_RDMA_WRITE,
			.sg_list = len ? &sge[n] : NULL,
			.num_sge = len ? 1 : 0,
		};
		wr[n].wr.rdma.remote_addr = w->remote.base + w->remote_offset + off;
		wr[n].wr.rdma.rkey = (uint32_t)w->remote.key;
		if (single) {
			wr[n].wr_id = seq;
			wr[n].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
			wr[n].send_flags = IBV_SEND_SIGNALED;
			wr[n].imm_data = htonl(w->imm);
		}
		if (n > 0)
			wr[n - 1].next = &wr[n];
		if (++n == VB_POST_BATCH) {
			rc = ibv_post_send(c->id->qp, &wr[0], &bad);
			n = 0;
		}
	}
	if (!single && !rc) {
		uint8_t *slot = send_slot(c, seq);
		rw_vb_sendmsg_pack(w->imm, w->length, slot);
		sge[n] = (struct ibv_sge){.addr = (uintptr_t)slot, .length = RW_VB_SENDMSG_SIZE,
					  .lkey = c->slots_mr->lkey};
		wr[n] = (struct ibv_send_wr){.wr_id = seq, .opcode = IBV_WR_SEND,
					     .send_flags = IBV_SEND_SIGNALED, .sg_list = &sge[n],
					     .num_sge = 1};
		if (n > 0)
			wr[n - 1].next = &wr[n];
		n++;
	}
	if (n > 0 && !rc)
		rc = ibv_post_send(c->id->qp, &wr[0], &bad);
	if (rc) {
		errno = rc;
		rw_err("verbs: rail %u peer %s: ibv_post_send: %m", base->dev->rail, base->peer);
		conn_fail_later(c, RW_ERR_LINK); /* this write is reported failed with the rest */
	}
	return RW_OK;
}

static void vb_conn_close(rw_rail_conn_t *base)
{
	vb_conn_t *c = (vb_conn_t *)base;
	if (c->closed)
		return;
	if (!c->failed && c->id && c->id->qp)
		rdma_disconnect(c->id);
	c->base.state = RW_RAIL_CONN_DOWN;
	conn_bury(c);
}

/* ---- vtable: memory ------------------------------------------------------------------- */

#define VB_MR_ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)

static rw_status_t region_add(vb_dev_t *d, struct ibv_mr *mr, void *addr, uint64_t length,
			      uint64_t sge_base, rw_rail_region_t **region_p)
{
	vb_region_t *r = calloc(1, sizeof(*r));
	if (!r) {
		ibv_dereg_mr(mr);
		return RW_ERR_NOMEM;
	}
	r->base.dev = &d->base;
	r->base.addr = addr;
	r->base.length = length;
	r->base.key = mr->rkey;
	r->base.base = sge_base; /* verbs addresses remote memory by VA (or iova) + rkey */
	r->mr = mr;
	r->sge_base = sge_base;
	LIST_PUSH(d->regions, r);
	*region_p = &r->base;
	return RW_OK;
}

static rw_status_t vb_reg_host(rw_rail_dev_t *base, void *addr, uint64_t length,
			       rw_rail_region_t **region_p)
{
	vb_dev_t *d = (vb_dev_t *)base;
	struct ibv_mr *mr = ibv_reg_mr(d->pd, addr, length, VB_MR_ACCESS);
	if (!mr) {
		int e = errno;
		rw_err("verbs: rail %u: ibv_reg_mr(%llu bytes): %m%s", base->rail,
		       (unsigned long long)length,
		       e == ENOMEM ? " (RLIMIT_MEMLOCK too low?)" : "");
		return e == ENOMEM ? RW_ERR_NOMEM : RW_ERR_SYS;
	}
	return region_add(d, mr, addr, length, (uintptr_t)addr, region_p);
}

static rw_status_t vb_reg_dmabuf(rw_rail_dev_t *base, int fd, uint64_t fd_offset, uint64_t length,
				 uint64_t iova, rw_rail_region_t **region_p)
{
	vb_dev_t *d = (vb_dev_t *)base;
	if (!(base->caps.flags & RW_RAIL_CAP_DMABUF))
		return RW_ERR_UNSUPPORTED;
	struct ibv_mr *mr = ibv_reg_dmabuf_mr(d->pd, fd_offset, length, iova, fd, VB_MR_ACCESS);
	if (!mr) {
		int e = errno;
		rw_err("verbs: rail %u: ibv_reg_dmabuf_mr(fd %d, %llu bytes): %m", base->rail, fd,
		       (unsigned long long)length);
		if (e == EOPNOTSUPP || e == EBADF || e == EPROTONOSUPPORT || e == ENOSYS)
			return RW_ERR_UNSUPPORTED;
		return e == ENOMEM ? RW_ERR_NOMEM : RW_ERR_SYS;
	}
	return region_add(d, mr, NULL, length, iova, region_p);
}

static void vb_dereg(rw_rail_region_t *base)
{
	vb_dev_t *d = (vb_dev_t *)base->dev;
	vb_region_t *r = (vb_region_t *)base;
	LIST_UNLINK(d->regions, r);
	if (ibv_dereg_mr(r->mr))
		rw_warn("verbs: rail %u: ibv_dereg_mr: %m", d->base.rail);
	free(r);
}

/* ---- vtable: device ------------------------------------------------------------------- */

/* "dev:port" -> that port's IPv4 address, found in its GID table (RoCE keeps one IPv4-mapped
 * GID per address), so that every connection still goes through librdmacm. */
static rw_status_t dev_port_ipv4(const char *spec, unsigned rail, struct in_addr *ip_p)
{
	char name[64];
	uint8_t port;
	if (rw_vb_parse_dev_port(spec, name, &port) != RW_OK) {
		rw_err("verbs: rail %u: '%s' is neither an IPv4 address nor device[:port]", rail, spec);
		return RW_ERR_INVAL;
	}
	int n = 0;
	struct ibv_context **ctxs = rdma_get_devices(&n);
	if (!ctxs) {
		rw_err("verbs: rail %u: no RDMA devices: %m", rail);
		return RW_ERR_NOTFOUND;
	}
	rw_status_t st = RW_ERR_NOTFOUND;
	int i;
	for (i = 0; i < n; i++)
		if (strcmp(ibv_get_device_name(ctxs[i]->device), name) == 0)
			break;
	if (i == n) {
		rw_err("verbs: rail %u: no RDMA device named %s", rail, name);
		goto free_list;
	}
	struct ibv_port_attr pa;
	if (ibv_query_port(ctxs[i], port, &pa)) {
		rw_err("verbs: rail %u: %s has no port %u", rail, name, port);
		goto free_list;
	}
	static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	for (int g = 0; g < pa.gid_tbl_len; g++) {
		union ibv_gid gid;
		if (ibv_query_gid(ctxs[i], port, g, &gid))
			break;
		if (memcmp(gid.raw, v4mapped, sizeof(v4mapped)) == 0) {
			memcpy(&ip_p->s_addr, gid.raw + 12, 4);
			st = RW_OK;
			goto free_list;
		}
	}
	rw_err("verbs: rail %u: %s port %u has no IPv4 address (librdmacm needs one: configure the "
	       "rail by IP, or give its netdev an address)", rail, name, port);
free_list:
	rdma_free_devices(ctxs);
	return st;
}

/* Does this device/kernel register dmabufs? ibv_reg_dmabuf_mr with fd -1 fails with EBADF
 * where the path exists and EOPNOTSUPP/EPROTONOSUPPORT where it does not. */
static int dmabuf_supported(struct ibv_pd *pd)
{
	struct ibv_mr *mr = ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, VB_MR_ACCESS);
	if (mr) {
		ibv_dereg_mr(mr);
		return 1;
	}
	return errno != EOPNOTSUPP && errno != EPROTONOSUPPORT && errno != ENOSYS;
}

/* Test knobs from the environment (docs/rdma-verbs.md "Configuration"). */
static uint64_t env_u64(const char *name) { return rw_vb_parse_count(getenv(name)); }

static void vb_dev_close(rw_rail_dev_t *base);

static rw_status_t vb_dev_open(const rw_rail_config_t *cfg, struct ev_loop *loop,
			       rw_rail_dev_t **dev_p)
{
	vb_dev_t *d = calloc(1, sizeof(*d));
	if (!d)
		return RW_ERR_NOMEM;
	rw_status_t st = rw_rail_dev_init_base(&d->base, &rw_rail_verbs_ops, cfg, loop,
					       VB_DEFAULT_MAX_WRITES);
	if (st != RW_OK) {
		free(d);
		return st;
	}
	if (d->base.pace_bps) {
		/* Pacing emulates a slower NIC for tcp test beds; an RDMA NIC has its own rate. */
		static atomic_int pace_logged;
		if (!atomic_exchange(&pace_logged, 1))
			rw_warn("verbs: rail %u: pace_bps ignored (rate pacing is a tcp transport "
				"feature)", cfg->rail);
		d->base.pace_bps = 0;
	}
	d->anchor_owner.kind = VB_KIND_ANCHOR;
	d->anchor_owner.obj = d;
	ev_timer_init(&d->reap, reap_cb, 0., 0.);
	d->reap.data = d;
	ev_timer_init(&d->more, more_cb, 0., 0.);
	d->more.data = d;
	d->addr.sin_family = AF_INET;
	if (inet_pton(AF_INET, cfg->local, &d->addr.sin_addr) != 1) {
		st = dev_port_ipv4(cfg->local, cfg->rail, &d->addr.sin_addr);
		if (st != RW_OK)
			goto fail;
	}

	d->ec = rdma_create_event_channel();
	if (!d->ec) {
		rw_err("verbs: rail %u: cannot open the RDMA connection manager: %m (no RDMA device, "
		       "or rdma_ucm not loaded)", cfg->rail);
		st = RW_ERR_NOTFOUND;
		goto fail;
	}
	if (rdma_create_id(d->ec, &d->anchor, &d->anchor_owner, RDMA_PS_TCP)) {
		rw_err("verbs: rail %u: rdma_create_id: %m", cfg->rail);
		d->anchor = NULL;
		st = RW_ERR_SYS;
		goto fail;
	}
	if (rdma_bind_addr(d->anchor, (struct sockaddr *)&d->addr) || !d->anchor->verbs) {
		rw_err("verbs: rail %u: %s is not the address of an RDMA device here: %m", cfg->rail,
		       cfg->local);
		st = RW_ERR_NOTFOUND;
		goto fail;
	}
	d->ctx = d->anchor->verbs;
	d->port_num = d->anchor->port_num;
	struct ibv_device_attr da;
	struct ibv_port_attr pa;
	if (ibv_query_device(d->ctx, &da) || ibv_query_port(d->ctx, d->port_num, &pa)) {
		rw_err("verbs: rail %u: cannot query %s: %m", cfg->rail,
		       ibv_get_device_name(d->ctx->device));
		st = RW_ERR_SYS;
		goto fail;
	}
	d->max_qp_wr = (uint32_t)da.max_qp_wr;
	d->max_cqe = (uint32_t)da.max_cqe;
	/* Two send WRs per write in the fallback mode; one receive per write in flight. */
	uint32_t limit = RW_MIN(d->max_qp_wr / 2, d->max_cqe / 3);
	if (d->base.max_writes > limit) {
		rw_warn("verbs: rail %u: %u writes in flight requested, %s allows %u", cfg->rail,
			d->base.max_writes, ibv_get_device_name(d->ctx->device), limit);
		d->base.max_writes = limit;
	}
	uint64_t test_writes = env_u64("RW_VERBS_MAX_WRITES");
	if (test_writes && test_writes < d->base.max_writes) { /* test knob: shallow queues */
		rw_info("verbs: rail %u: RW_VERBS_MAX_WRITES: %llu writes in flight", cfg->rail,
			(unsigned long long)test_writes);
		d->base.max_writes = (uint32_t)test_writes;
	}
	const char *force = getenv("RW_VERBS_WRITE_SEND");
	int imm = d->ctx->device->transport_type == IBV_TRANSPORT_IB; /* IB and RoCE; not iWARP */
	if ((force && *force && strcmp(force, "0") != 0) ||
	    rw_vb_rail_listed(getenv("RW_VERBS_WRITE_SEND_RAILS"), cfg->rail))
		imm = 0; /* exercise the iWARP path on any device (all rails, or the listed ones) */
	d->hello_flags = imm ? RW_VB_HELLO_IMM : 0;

	d->pd = ibv_alloc_pd(d->ctx);
	if (!d->pd) {
		rw_err("verbs: rail %u: ibv_alloc_pd: %m", cfg->rail);
		st = RW_ERR_SYS;
		goto fail;
	}
	d->cc = ibv_create_comp_channel(d->ctx);
	if (!d->cc) {
		rw_err("verbs: rail %u: ibv_create_comp_channel: %m", cfg->rail);
		st = RW_ERR_SYS;
		goto fail;
	}
	if (set_nonblock(d->ec->fd) || set_nonblock(d->cc->fd) || set_nonblock(d->ctx->async_fd)) {
		rw_err("verbs: rail %u: O_NONBLOCK: %m", cfg->rail);
		st = RW_ERR_SYS;
		goto fail;
	}
	d->base.caps.flags = (dmabuf_supported(d->pd) ? RW_RAIL_CAP_DMABUF : 0) | RW_RAIL_CAP_PROOF;
	d->base.caps.max_writes = d->base.max_writes;
	/* Longer writes are split into max_msg_sz chunks (rxe: 8 MiB) plus the SEND that carries
	 * the immediate; one write must fit the send queue whole. */
	d->chunk = pa.max_msg_sz ? pa.max_msg_sz : 1u << 30;
	uint64_t ack = env_u64("RW_VERBS_ACK_TIMEOUT");
	if (ack >= 1 && ack <= 31) {
		d->ack_timeout = (uint8_t)ack;
		rw_info("verbs: rail %u: RW_VERBS_ACK_TIMEOUT: %llu (%.3f s per try)", cfg->rail,
			(unsigned long long)ack, 4.096e-6 * (double)(1ull << ack));
	}
	d->poll_budget = VB_POLL_BUDGET;
	uint64_t budget = env_u64("RW_VERBS_POLL_BUDGET");
	if (budget && budget < d->poll_budget) { /* test knob: yield to the loop early */
		rw_info("verbs: rail %u: RW_VERBS_POLL_BUDGET: %llu completions per poll", cfg->rail,
			(unsigned long long)budget);
		d->poll_budget = (uint32_t)budget;
	}
	uint64_t test_msg = env_u64("RW_VERBS_MAX_MSG");
	if (test_msg && test_msg < d->chunk) { /* test knob: a device with a small message limit */
		rw_info("verbs: rail %u: RW_VERBS_MAX_MSG: messages of at most %llu bytes", cfg->rail,
			(unsigned long long)test_msg);
		d->chunk = (uint32_t)test_msg;
	}
	d->base.caps.max_write_length = RW_MIN((uint64_t)d->chunk * (2 * d->base.max_writes - 1),
					       1ull << 40);

	ev_io_init(&d->cm_io, cm_cb, d->ec->fd, EV_READ);
	ev_io_init(&d->cq_io, cq_cb, d->cc->fd, EV_READ);
	ev_io_init(&d->async_io, async_cb, d->ctx->async_fd, EV_READ);
	d->cm_io.data = d->cq_io.data = d->async_io.data = d;
	ev_io_start(loop, &d->cm_io);
	ev_io_start(loop, &d->cq_io);
	ev_io_start(loop, &d->async_io);
	rw_info("verbs: rail %u: %s port %u (%s), %s, dmabuf %s, message limit %u bytes", cfg->rail,
		ibv_get_device_name(d->ctx->device), d->port_num, inet_ntoa(d->addr.sin_addr),
		imm ? "write with immediate" : "write + send",
		d->base.caps.flags & RW_RAIL_CAP_DMABUF ? "yes" : "no", d->chunk);
	*dev_p = &d->base;
	return RW_OK;
fail:
	vb_dev_close(&d->base);
	return st;
}

static void vb_dev_close(rw_rail_dev_t *base)
{
	vb_dev_t *d = (vb_dev_t *)base;
	struct ev_loop *loop = base->loop;
	if (loop) {
		ev_io_stop(loop, &d->cm_io);
		ev_io_stop(loop, &d->cq_io);
		ev_io_stop(loop, &d->async_io);
		ev_timer_stop(loop, &d->reap);
		ev_timer_stop(loop, &d->more);
	}
	while (d->listeners)
		vb_listener_close(&d->listeners->base);
	while (d->conns)
		conn_bury(d->conns);
	ev_timer_stop(loop, &d->reap);
	while (d->zombies) {
		vb_conn_t *c = d->zombies;
		LIST_UNLINK(d->zombies, c);
		conn_free(c);
	}
	while (d->regions)
		vb_dereg(&d->regions->base);
	if (d->cc && ibv_destroy_comp_channel(d->cc))
		rw_warn("verbs: rail %u: ibv_destroy_comp_channel: %m", base->rail);
	if (d->pd && ibv_dealloc_pd(d->pd))
		rw_warn("verbs: rail %u: ibv_dealloc_pd: %m", base->rail);
	if (d->anchor)
		rdma_destroy_id(d->anchor);
	if (d->ec)
		rdma_destroy_event_channel(d->ec);
	free(d);
}

const rw_rail_ops_t rw_rail_verbs_ops = {
	.name = "verbs",
	.dev_open = vb_dev_open,
	.dev_close = vb_dev_close,
	.reg_host = vb_reg_host,
	.reg_dmabuf = vb_reg_dmabuf,
	.dereg = vb_dereg,
	.listen = vb_listen,
	.listener_close = vb_listener_close,
	.connect = vb_connect,
	.write = vb_write,
	.conn_close = vb_conn_close,
};
