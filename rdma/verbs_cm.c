/* The verbs transport's connection management (rdma/verbs_int.h): librdmacm's events on the
 * loop (connect requests, established, rejected, disconnected), and the connection half of the
 * vtable: listen, connect, write, close. */
#include "rdma/verbs_int.h"

/* ---- connection management (librdmacm events on the loop) -------------------------------- */

static void on_connect_request(vb_listener_t *l, struct rdma_cm_id *id, const void *pdata,
			       size_t pdata_len)
{
	vb_dev_t *d = (vb_dev_t *)l->base.dev;
	char peer[RW_RAIL_ADDR_MAX];
	vb_fmt_sin(rdma_get_peer_addr(id), peer, sizeof(peer));
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
	vb_conn_t *c = vb_conn_new(d, &l->base.cbs, l->base.ctx, 1, hello.tag);
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
		vb_conn_bury(c); /* frees id with c */
		return;
	}
	c->write_send = rw_vb_use_write_send(d->hello_flags, hello.flags);
	c->window = rw_vb_window(c->max_writes, hello.max_writes);
	st = vb_conn_setup_qp(c);
	if (st != RW_OK) {
		rdma_reject(id, NULL, 0);
		vb_conn_bury(c); /* frees id with c */
		return;
	}
	vb_conn_set_ack_timeout(c);
	reply.max_writes = c->max_writes;
	uint8_t buf[RW_VB_HELLO_SIZE];
	rw_vb_hello_pack(&reply, buf);
	struct rdma_conn_param param;
	vb_conn_param_init(&param, buf);
	if (rdma_accept(id, &param)) {
		rw_err("verbs: rail %u: rdma_accept(%s): %m", d->base.rail, peer);
		vb_conn_bury(c);
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
		st = vb_conn_setup_qp(c);
		if (st != RW_OK) {
			vb_conn_fail(c, st);
			return;
		}
		if (rdma_resolve_route(c->id, VB_RESOLVE_TIMEOUT_MS)) {
			rw_err("verbs: rail %u peer %s: rdma_resolve_route: %m", d->base.rail,
			       c->base.peer);
			vb_conn_fail(c, RW_ERR_PEER);
		}
		return;
	case RDMA_CM_EVENT_ROUTE_RESOLVED: {
		rw_vb_hello_t hello = {.flags = d->hello_flags, .tag = c->base.tag,
				       .max_writes = c->max_writes, .rail = d->base.rail};
		memcpy(hello.proof, c->base.proof, RW_VB_PROOF_SIZE);
		uint8_t buf[RW_VB_HELLO_SIZE];
		rw_vb_hello_pack(&hello, buf);
		struct rdma_conn_param param;
		vb_conn_param_init(&param, buf);
		vb_conn_set_ack_timeout(c);
		if (rdma_connect(c->id, &param)) {
			rw_err("verbs: rail %u peer %s: rdma_connect: %m", d->base.rail, c->base.peer);
			vb_conn_fail(c, RW_ERR_PEER);
		}
		return;
	}
	case RDMA_CM_EVENT_ESTABLISHED:
		if (!c->base.accepted) {
			rw_vb_hello_t reply;
			if (rw_vb_hello_unpack(pdata, pdata_len, &reply) != RW_OK) {
				rw_err("verbs: rail %u peer %s: accepted without a valid hello",
				       d->base.rail, c->base.peer);
				vb_conn_fail(c, RW_ERR_PROTO);
				return;
			}
			if (c->base.cbs.on_verify &&
			    c->base.cbs.on_verify(&c->base, c->base.ctx, reply.proof, NULL) != 0) {
				rw_err("verbs: rail %u peer %s: the acceptor's proof is not valid",
				       d->base.rail, c->base.peer);
				vb_conn_fail(c, RW_ERR_PROTO);
				return;
			}
			c->write_send = rw_vb_use_write_send(d->hello_flags, reply.flags);
			c->window = rw_vb_window(c->max_writes, reply.max_writes);
		}
		vb_conn_up(c);
		return;
	case RDMA_CM_EVENT_ADDR_ERROR:
	case RDMA_CM_EVENT_ROUTE_ERROR:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
	case RDMA_CM_EVENT_REJECTED:
		rw_err("verbs: rail %u peer %s: %s (status %d)", d->base.rail, c->base.peer,
		       rdma_event_str(type), status);
		vb_conn_fail(c, RW_ERR_PEER);
		return;
	case RDMA_CM_EVENT_DISCONNECTED:
		rw_info("verbs: rail %u peer %s: disconnected", d->base.rail, c->base.peer);
		vb_conn_fail(c, RW_ERR_PEER);
		return;
	case RDMA_CM_EVENT_DEVICE_REMOVAL:
		rw_err("verbs: rail %u peer %s: RDMA device removed", d->base.rail, c->base.peer);
		vb_conn_fail(c, RW_ERR_LINK);
		return;
	default:
		rw_dbg("verbs: rail %u peer %s: %s", d->base.rail, c->base.peer, rdma_event_str(type));
		return;
	}
}

void vb_cm_cb(struct ev_loop *loop, ev_io *w, int revents)
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
				vb_dev_fail_all(d, RW_ERR_LINK);
			}
			break;
		}
	}
}

/* ---- vtable: connections ---------------------------------------------------------------- */

rw_status_t vb_listen(rw_rail_dev_t *base, const rw_rail_conn_cbs_t *cbs, void *ctx,
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
	vb_fmt_sin((struct sockaddr *)&sin, l->base.addr, sizeof(l->base.addr));
	LIST_PUSH(d->listeners, l);
	*listener_p = &l->base;
	return RW_OK;
destroy_id:
	rdma_destroy_id(l->id);
free_l:
	free(l);
	return st;
}

void vb_listener_close(rw_rail_listener_t *base)
{
	vb_dev_t *d = (vb_dev_t *)base->dev;
	vb_listener_t *l = (vb_listener_t *)base;
	LIST_UNLINK(d->listeners, l);
	rdma_destroy_id(l->id); /* pending, unclaimed requests die with it (the kernel's job) */
	free(l);
}

rw_status_t vb_connect(rw_rail_dev_t *base, const char *peer_addr, uint64_t tag,
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
	vb_conn_t *c = vb_conn_new(d, cbs, ctx, 0, tag);
	if (!c)
		return RW_ERR_NOMEM;
	snprintf(c->base.peer, sizeof(c->base.peer), "%s", peer_addr);
	if (rdma_create_id(d->ec, &c->id, &c->owner, RDMA_PS_TCP)) {
		rw_err("verbs: rail %u: rdma_create_id: %m", base->rail);
		c->id = NULL;
		LIST_UNLINK(d->conns, c);
		vb_conn_free(c);
		return RW_ERR_SYS;
	}
	struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons(port)};
	dst.sin_addr.s_addr = ip;
	struct sockaddr_in src = d->addr; /* leave through this rail's device */
	ev_timer_start(base->loop, &c->timer);
	if (rdma_resolve_addr(c->id, (struct sockaddr *)&src, (struct sockaddr *)&dst,
			      VB_RESOLVE_TIMEOUT_MS)) {
		rw_err("verbs: rail %u: rdma_resolve_addr(%s): %m", base->rail, peer_addr);
		vb_conn_fail_later(c, RW_ERR_PEER);
	}
	*conn_p = &c->base;
	return RW_OK;
}

#define VB_POST_BATCH 16 /* send WRs chained into one ibv_post_send (one doorbell) */

rw_status_t vb_write(rw_rail_conn_t *base, const rw_rail_write_t *w)
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
		uint8_t *slot = vb_send_slot(c, seq);
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
		vb_conn_fail_later(c, RW_ERR_LINK); /* this write is reported failed with the rest */
	}
	return RW_OK;
}

void vb_conn_close(rw_rail_conn_t *base)
{
	vb_conn_t *c = (vb_conn_t *)base;
	if (c->closed)
		return;
	if (!c->failed && c->id && c->id->qp)
		rdma_disconnect(c->id);
	c->base.state = RW_RAIL_CONN_DOWN;
	vb_conn_bury(c);
}
