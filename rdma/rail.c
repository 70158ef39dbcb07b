/* Rail transport registry and the caller-facing wrappers: argument checks common to every
 * transport, then dispatch through the device's rw_rail_ops_t. Also the region descriptor
 * wire format used for the out-of-band key exchange. What the transports themselves share is
 * in rail_base.c, below this file and them. */
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

int rw_rail_region_fd(const rw_rail_region_t *region)
{
	if (!region || !region->dev->ops->region_fd)
		return -1;
	return region->dev->ops->region_fd(region);
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
