/* What every rail transport shares, below rail.c (the registry that lists them) and below the
 * transports: the device's common fields, the range check of a write, the failure report of a
 * connection's outstanding writes, and the rail address syntax (rdma/rail.h). Calls nothing
 * above it. */
#include "rdma/rail.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

void rw_rail_conn_init_base(rw_rail_conn_t *conn, rw_rail_dev_t *dev,
			    const rw_rail_conn_cbs_t *cbs, void *ctx)
{
	conn->dev = dev;
	conn->cbs = *cbs;
	conn->ctx = ctx;
	conn->state = RW_RAIL_CONN_CONNECTING;
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
