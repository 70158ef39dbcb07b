/* The verbs transport's memory and devices (rdma/verbs_int.h): host and dmabuf registration,
 * opening a rail's device (its rail IP, port, limits, the dmabuf probe, the environment's
 * knobs) and closing it, and the transport's vtable. */
#include "rdma/verbs_int.h"

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
	ev_timer_init(&d->reap, vb_reap_cb, 0., 0.);
	d->reap.data = d;
	ev_timer_init(&d->more, vb_more_cb, 0., 0.);
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
	if (vb_set_nonblock(d->ec->fd) || vb_set_nonblock(d->cc->fd) || vb_set_nonblock(d->ctx->async_fd)) {
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

	ev_io_init(&d->cm_io, vb_cm_cb, d->ec->fd, EV_READ);
	ev_io_init(&d->cq_io, vb_cq_cb, d->cc->fd, EV_READ);
	ev_io_init(&d->async_io, vb_async_cb, d->ctx->async_fd, EV_READ);
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
		vb_conn_bury(d->conns);
	ev_timer_stop(loop, &d->reap);
	while (d->zombies) {
		vb_conn_t *c = d->zombies;
		LIST_UNLINK(d->zombies, c);
		vb_conn_free(c);
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

/* A registered region is the caller's own pages (rail.h). */
static int vb_region_fd(const rw_rail_region_t *region)
{
	(void)region;
	return -1;
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
	.region_fd = vb_region_fd,
};
