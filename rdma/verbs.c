/* The verbs rail transport: rw_rail_ops_t over rdma-core (libibverbs + librdmacm), the
 * production path. One RC QP per (peer, rail) connected through librdmacm's event channel,
 * one-sided RDMA WRITE WITH IMMEDIATE (or RDMA WRITE + SEND where the device has no immediate),
 * all driven from the caller's libev loop: the CM event channel, the completion channel and the
 * device's async fd are ev_io watchers, and nothing here blocks. See docs/rdma-verbs.md.
 * This file: a connection's teardown and failure, its queue pair and receive slots, completions
 * and the device's async events (rdma/verbs_int.h says where the rest lives). */
#include "rdma/verbs_int.h"

int vb_set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

void vb_fmt_sin(const struct sockaddr *sa, char *buf, size_t len)
{
	const struct sockaddr_in *sin = (const struct sockaddr_in *)sa;
	char ip[INET_ADDRSTRLEN] = "?";
	if (sa && sa->sa_family == AF_INET)
		inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof(ip));
	snprintf(buf, len, "%s:%u", ip, sa && sa->sa_family == AF_INET ? ntohs(sin->sin_port) : 0);
}

/* ---- connection teardown and failure --------------------------------------------------- */

void vb_conn_free(vb_conn_t *c)
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

void vb_reap_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	vb_dev_t *d = w->data;
	while (d->zombies) {
		vb_conn_t *c = d->zombies;
		LIST_UNLINK(d->zombies, c);
		vb_conn_free(c);
	}
}

/* Take c out of service: no more callbacks, resources freed by the reap timer (never inside a
 * dispatch that may still hold c). */
void vb_conn_bury(vb_conn_t *c)
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
void vb_conn_fail(vb_conn_t *c, rw_status_t st)
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
		vb_conn_bury(c);
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
		vb_conn_fail(c, c->later_err);
		return;
	}
	rw_err("verbs: rail %u peer %s: handshake timed out after %.0f s", c->dev->base.rail,
	       c->base.peer, VB_HANDSHAKE_TIMEOUT_S);
	vb_conn_fail(c, RW_ERR_TIMEOUT);
}

/* Failure decided inside an rw_rail_* call: reported from the loop, never re-entrantly. */
void vb_conn_fail_later(vb_conn_t *c, rw_status_t st)
{
	if (c->failed || c->closed || c->later_err != RW_OK)
		return;
	c->later_err = st;
	ev_timer_stop(c->dev->base.loop, &c->timer);
	ev_timer_set(&c->timer, 0., 0.);
	ev_timer_start(c->dev->base.loop, &c->timer);
}

vb_conn_t *vb_conn_new(vb_dev_t *d, const rw_rail_conn_cbs_t *cbs, void *ctx, int accepted,
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
	rw_rail_conn_init_base(&c->base, &d->base, cbs, ctx);
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

uint8_t *vb_send_slot(vb_conn_t *c, uint64_t seq)
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
rw_status_t vb_conn_setup_qp(vb_conn_t *c)
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
void vb_conn_set_ack_timeout(vb_conn_t *c)
{
	uint8_t t = c->dev->ack_timeout;
	if (t && rdma_set_option(c->id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof(t)))
		rw_warn("verbs: rail %u peer %s: cannot set the ack timeout: %m", c->dev->base.rail,
			c->base.peer);
}

void vb_conn_param_init(struct rdma_conn_param *p, const uint8_t *hello)
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

void vb_conn_up(vb_conn_t *c)
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
		vb_conn_fail_later(c, RW_ERR_LINK);
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
		vb_conn_fail(c, RW_ERR_LINK);
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
		vb_conn_fail(c, RW_ERR_LINK);
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
		vb_conn_fail(c, RW_ERR_PROTO);
		return;
	}
	/* Give the slot back before telling the caller: the peer may have more in flight. */
	if (post_recv(c, slot)) {
		rw_err("verbs: rail %u peer %s: ibv_post_recv: %m", c->dev->base.rail, c->base.peer);
		vb_conn_fail(c, RW_ERR_LINK);
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
 * (vb_cq_cb), so completions left in it raise no new event: the timer is what finds them. */
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
			vb_conn_fail(c, RW_ERR_LINK);
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
				vb_conn_fail(c, st);
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

void vb_cq_cb(struct ev_loop *loop, ev_io *w, int revents)
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
			vb_conn_fail(c, RW_ERR_LINK);
			continue;
		}
		conn_poll(c);
	}
}

/* The device's `more` timer: poll on, once each, every connection whose last poll stopped at
 * its budget (`more` 1 -> 2: due in this round; conn_poll sets it to 0, or to 1 for the next
 * round). Callbacks may close or fail connections (they leave d->conns), so the walk restarts
 * after each poll. */
void vb_more_cb(struct ev_loop *loop, ev_timer *w, int revents)
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
void vb_dev_fail_all(vb_dev_t *d, rw_status_t st)
{
	for (;;) {
		vb_conn_t *c = d->conns;
		while (c && c->failed)
			c = c->next;
		if (!c)
			return;
		vb_conn_fail(c, st);
	}
}

void vb_async_cb(struct ev_loop *loop, ev_io *w, int revents)
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
				vb_conn_fail(c, type == IBV_EVENT_QP_ACCESS_ERR ? RW_ERR_PROTO : RW_ERR_LINK);
			}
			break;
		case IBV_EVENT_PORT_ERR:
			if (port == d->port_num) {
				rw_err("verbs: rail %u: port %d of %s went down", d->base.rail, port,
				       ibv_get_device_name(d->ctx->device));
				vb_dev_fail_all(d, RW_ERR_LINK);
			}
			break;
		case IBV_EVENT_DEVICE_FATAL:
			rw_err("verbs: rail %u: device %s failed", d->base.rail,
			       ibv_get_device_name(d->ctx->device));
			vb_dev_fail_all(d, RW_ERR_LINK);
			break;
		default:
			rw_dbg("verbs: rail %u: async event %s", d->base.rail, ibv_event_type_str(type));
			break;
		}
	}
}
