/* Rail transport registry and the caller-facing wrappers: argument checks common to every
 * transport, then dispatch through the device's rw_rail_ops_t. Also the region descriptor
 * wire format used for the out-of-band key exchange, and the rail address syntax. */
#include "rdma/rail.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

/* The verbs transport joins the registry when its objects are built (rdma/build.ninja sets
 * -DRW_RAIL_WITH_VERBS together with adding them to librdma.a). */
static const rw_rail_ops_t *const transports[] = {
	&rw_rail_tcp_ops,
	&rw_rail_shm_ops,
#if defined(RW_RAIL_WITH_VERBS) && RW_HAVE_VERBS
	&rw_rail_verbs_ops,
#endif
};

const rw_rail_ops_t *rw_rail_transport_find(const char *name)
{
	if (!name)
		return NULL;
	for (size_t i = 0; i < RW_ARRAY_SIZE(transports); i++)
		if (strcmp(transports[i]->name, name) == 0)
			return transports[i];
	return NULL;
}

const char *rw_rail_transport_names(void)
{
#if defined(RW_RAIL_WITH_VERBS) && RW_HAVE_VERBS
	return "tcp shm verbs";
#else
	return "tcp shm";
#endif
}

rw_status_t rw_rail_dev_init_base(rw_rail_dev_t *dev, const rw_rail_ops_t *ops,
				  const rw_rail_config_t *cfg, struct ev_loop *loop,
				  uint32_t default_max_writes)
{
	if (!cfg->local || strlen(cfg->local) >= sizeof(dev->local))
		return RW_ERR_INVAL;
	dev->ops = ops;
	dev->loop = loop;
	dev->rail = cfg->rail;
	dev->port = cfg->port;
	dev->max_writes = cfg->max_writes ? cfg->max_writes : default_max_writes;
	dev->pace_bps = cfg->pace_bps;
	snprintf(dev->transport, sizeof(dev->transport), "%s", ops->name);
	snprintf(dev->local, sizeof(dev->local), "%s", cfg->local);
	return RW_OK;
}

rw_status_t rw_rail_range_check(uint64_t region_length, uint64_t offset, uint64_t length)
{
	if (offset > region_length || length > region_length - offset)
		return RW_ERR_RANGE;
	return RW_OK;
}

void rw_rail_report_failure(rw_rail_conn_t *conn, uint64_t *acked_p, uint64_t posted,
			    void *(*ctx_of)(const rw_rail_conn_t *conn, uint64_t k),
			    const int *closed_p, rw_status_t st)
{
	while (*acked_p < posted) {
		void *write_ctx = ctx_of(conn, (*acked_p)++);
		if (conn->cbs.on_write_done)
			conn->cbs.on_write_done(conn, conn->ctx, write_ctx, st);
		if (*closed_p)
			return;
	}
	if (conn->cbs.on_error)
		conn->cbs.on_error(conn, conn->ctx, st);
}

rw_status_t rw_rail_dev_open(const rw_rail_config_t *cfg, struct ev_loop *loop,
			     rw_rail_dev_t **dev_p)
{
	if (!cfg || !loop || !dev_p || !cfg->local)
		return RW_ERR_INVAL;
	const rw_rail_ops_t *ops = rw_rail_transport_find(cfg->transport);
	if (!ops) {
		rw_err("rail %u: unknown transport '%s' (built: %s)", cfg->rail,
		       cfg->transport ? cfg->transport : "(null)", rw_rail_transport_names());
		return RW_ERR_NOTFOUND;
	}
	return ops->dev_open(cfg, loop, dev_p);
}

void rw_rail_dev_close(rw_rail_dev_t *dev)
{
	if (dev)
		dev->ops->dev_close(dev);
}

rw_status_t rw_rail_reg_host(rw_rail_dev_t *dev, void *addr, uint64_t length,
			     rw_rail_region_t **region_p)
{
	if (!dev || !addr || length == 0 || !region_p)
		return RW_ERR_INVAL;
	return dev->ops->reg_host(dev, addr, length, region_p);
}

rw_status_t rw_rail_reg_dmabuf(rw_rail_dev_t *dev, int fd, uint64_t fd_offset, uint64_t length,
			       uint64_t iova, rw_rail_region_t **region_p)
{
	if (!dev || fd < 0 || length == 0 || !region_p)
		return RW_ERR_INVAL;
	return dev->ops->reg_dmabuf(dev, fd, fd_offset, length, iova, region_p);
}

void rw_rail_dereg(rw_rail_region_t *region)
{
	if (region)
		region->dev->ops->dereg(region);
}

rw_status_t rw_rail_listen(rw_rail_dev_t *dev, const rw_rail_conn_cbs_t *cbs, void *ctx,
			   rw_rail_listener_t **listener_p)
{
	if (!dev || !cbs || !listener_p)
		return RW_ERR_INVAL;
	return dev->ops->listen(dev, cbs, ctx, listener_p);
}

void rw_rail_listener_close(rw_rail_listener_t *listener)
{
	if (listener)
		listener->dev->ops->listener_close(listener);
}

rw_status_t rw_rail_connect(rw_rail_dev_t *dev, const char *peer_addr, uint64_t tag,
			    const rw_rail_conn_cbs_t *cbs, void *ctx, rw_rail_conn_t **conn_p)
{
	if (!dev || !peer_addr || !cbs || !conn_p)
		return RW_ERR_INVAL;
	return dev->ops->connect(dev, peer_addr, tag, cbs, ctx, conn_p);
}

rw_status_t rw_rail_write(rw_rail_conn_t *conn, const rw_rail_write_t *write)
{
	if (!conn || !write || !write->local)
		return RW_ERR_INVAL;
	if (write->local->dev != conn->dev)
		return RW_ERR_INVAL;
	if (conn->state != RW_RAIL_CONN_UP)
		return RW_ERR_STATE;
	if (write->length > conn->dev->caps.max_write_length)
		return RW_ERR_RANGE;
	if (rw_rail_range_check(write->local->length, write->local_offset, write->length) ||
	    rw_rail_range_check(write->remote.length, write->remote_offset, write->length))
		return RW_ERR_RANGE;
	return conn->dev->ops->write(conn, write);
}

void rw_rail_conn_close(rw_rail_conn_t *conn)
{
	if (conn)
		conn->dev->ops->conn_close(conn);
}

void rw_rail_conn_set_ctx(rw_rail_conn_t *conn, void *ctx)
{
	conn->ctx = ctx;
}

/* Rail addresses: one syntax for every transport (rail.h). */
rw_status_t rw_rail_addr_parse(const char *s, uint32_t *addr_be_p, uint16_t *port_p)
{
	char host[INET_ADDRSTRLEN];
	const char *colon = s ? strrchr(s, ':') : NULL;
	if (!colon || (size_t)(colon - s) >= sizeof(host) || colon == s)
		return RW_ERR_INVAL;
	memcpy(host, s, (size_t)(colon - s));
	host[colon - s] = '\0';
	struct in_addr a;
	if (inet_pton(AF_INET, host, &a) != 1)
		return RW_ERR_INVAL;
	const char *ps = colon + 1;
	if (*ps < '0' || *ps > '9')
		return RW_ERR_INVAL;
	char *end;
	unsigned long port = strtoul(ps, &end, 10);
	if (*end != '\0' || port == 0 || port > 65535)
		return RW_ERR_INVAL;
	*addr_be_p = a.s_addr;
	*port_p = (uint16_t)port;
	return RW_OK;
}

/* Descriptor wire format (little-endian):
 *   0 u32 magic "RWRD"   4 u16 version   6 u16 reserved (0)
 *   8 u64 key           16 u64 length   24 u64 base */
#define DESC_MAGIC 0x44525752u /* "RWRD" read as little-endian */
#define DESC_VERSION 1

rw_rail_remote_t rw_rail_region_remote(const rw_rail_region_t *region)
{
	rw_rail_remote_t r = {.key = region->key, .length = region->length, .base = region->base};
	return r;
}

void rw_rail_region_desc_pack(const rw_rail_region_t *region, uint8_t out[RW_RAIL_DESC_SIZE])
{
	memset(out, 0, RW_RAIL_DESC_SIZE);
	rw_put_le(out + 0, DESC_MAGIC, 4);
	rw_put_le(out + 4, DESC_VERSION, 2);
	rw_put_le(out + 8, region->key, 8);
	rw_put_le(out + 16, region->length, 8);
	rw_put_le(out + 24, region->base, 8);
}

rw_status_t rw_rail_remote_unpack(const uint8_t *in, size_t len, rw_rail_remote_t *remote_p)
{
	if (!in || !remote_p || len != RW_RAIL_DESC_SIZE)
		return RW_ERR_PARSE;
	if (rw_get_le(in + 0, 4) != DESC_MAGIC || rw_get_le(in + 4, 2) != DESC_VERSION ||
	    rw_get_le(in + 6, 2) != 0)
		return RW_ERR_PARSE;
	remote_p->key = rw_get_le(in + 8, 8);
	remote_p->length = rw_get_le(in + 16, 8);
	remote_p->base = rw_get_le(in + 24, 8);
	return RW_OK;
}
