/* The `shm` rail transport: several railwaved on ONE host, each rail a shared-memory "NIC".
 * A registered region is the caller's own pages, remapped in place onto a memfd; a peer that
 * proved the cluster key (the same handshake as tcp: HELLO and HELLO_ACK carry proofs) asks for
 * a region's fd over the connection's control socket (abstract AF_UNIX, SOCK_SEQPACKET, named
 * after the rail's address and port) and maps it. A one-sided write is a memcpy into that
 * mapping by the writer's copier threads (shm_copy.c), then a descriptor published in the
 * writer's outbox with a release store; the target's loop reads it with acquire and reports the
 * arrival; the target's head store tells the writer its write is done (shm_priv.h names the
 * pairs; shm_conn.c is the connections' side). This file is the vtable, devices, regions,
 * listeners, connect and write.
 * For development and benchmarks on one machine; it is not a transport between hosts. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "rdma/shm_priv.h"

#define SHM_PENDING_MAX 64        /* accepted connections still in their handshake */
#define SHM_PORT_TRIES 256        /* ephemeral ports tried by a listener on port 0 */
/* Bucket depth: two paced chunks or 50 µs at the rate, whichever is larger. */
#define SHM_PACE_BURST_S 50e-6
#define SHM_PACE_MIN_BURST (512u << 10)
/* Copiers by default: the pace over what one thread's memcpy moved on the H200 machine
 * (6-7 GB/s, docs/perf/shm.md), at most SHM_MAX_COPIERS; unpaced, SHM_UNPACED_COPIERS. */
#define SHM_COPIER_BPS 6e9
#define SHM_UNPACED_COPIERS 4

/* ---- helpers ---------------------------------------------------------------------------- */

static long page_size(void) { return sysconf(_SC_PAGESIZE); }

/* The abstract socket name of (device address, port): "railwave-shm/127.0.1.2:40001". */
static socklen_t sock_name(struct sockaddr_un *sa, const char *prefix, unsigned port)
{
	memset(sa, 0, sizeof(*sa));
	sa->sun_family = AF_UNIX;
	int n = snprintf(sa->sun_path + 1, sizeof(sa->sun_path) - 1, "%s:%u", prefix, port);
	return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* ---- listener --------------------------------------------------------------------------- */

static void accept_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	shm_listener_t *l = w->data;
	shm_dev_t *dev = (shm_dev_t *)l->base.dev;
	for (int i = 0; i < 64; i++) {
		int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
			    errno != ECONNABORTED)
				rw_err("rail %u: accept on %s: %m", dev->base.rail, l->base.addr);
			return;
		}
		shm_conn_t *c = dev->n_pending < SHM_PENDING_MAX
					? shm_conn_new(dev, fd, &l->base.cbs, l->base.ctx) : NULL;
		if (!c) { /* strangers get a bounded budget */
			close(fd);
			continue;
		}
		struct ucred cred;
		socklen_t len = sizeof(cred);
		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0)
			snprintf(c->base.peer, sizeof(c->base.peer), "shm pid %d", (int)cred.pid);
		else
			snprintf(c->base.peer, sizeof(c->base.peer), "shm peer");
		c->base.accepted = 1;
		c->pending = 1;
		dev->n_pending++;
		c->hs = SHM_HS_WAIT_HELLO;
		ev_io_start(loop, &c->rio);
		ev_timer_start(loop, &c->timer);
	}
}

static rw_status_t shm_listen(rw_rail_dev_t *base, const rw_rail_conn_cbs_t *cbs, void *ctx,
			      rw_rail_listener_t **listener_p)
{
	shm_dev_t *dev = (shm_dev_t *)base;
	shm_listener_t *l = calloc(1, sizeof(*l));
	if (!l)
		return RW_ERR_NOMEM;
	l->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (l->fd < 0) {
		rw_err("rail %u: socket: %m", base->rail);
		free(l);
		return RW_ERR_SYS;
	}
	unsigned port = base->port, first = 0;
	if (port == 0) { /* ephemeral: a random start in 20000..59999, then the next ones */
		if (getrandom(&first, sizeof(first), GRND_NONBLOCK) != sizeof(first))
			first = (unsigned)rw_now_ns();
		first = 20000 + first % 40000;
	}
	int rc = -1;
	for (unsigned k = 0; k < (port ? 1u : SHM_PORT_TRIES) && rc < 0; k++) {
		unsigned p = port ? port : first + k;
		struct sockaddr_un sa;
		socklen_t salen = sock_name(&sa, dev->sock_prefix, p);
		rc = bind(l->fd, (struct sockaddr *)&sa, salen);
		if (rc == 0)
			snprintf(l->base.addr, sizeof(l->base.addr), "%.15s:%u", base->local, p);
		else if (errno != EADDRINUSE || port)
			break;
	}
	if (rc < 0 || listen(l->fd, 128) < 0) {
		rw_err("rail %u: shm listen on %s port %u: %m", base->rail, base->local, port);
		close(l->fd);
		free(l);
		return RW_ERR_SYS;
	}
	l->base.dev = base;
	l->base.cbs = *cbs;
	l->base.ctx = ctx;
	ev_io_init(&l->io, accept_cb, l->fd, EV_READ);
	l->io.data = l;
	ev_io_start(base->loop, &l->io);
	rw_list_add(&dev->listeners, &l->link);
	*listener_p = &l->base;
	return RW_OK;
}

static void shm_listener_close(rw_rail_listener_t *base)
{
	shm_listener_t *l = (shm_listener_t *)base;
	ev_io_stop(base->dev->loop, &l->io);
	close(l->fd);
	rw_list_del(&l->link);
	free(l);
}

/* ---- connect / write / close ------------------------------------------------------------ */

static rw_status_t shm_connect(rw_rail_dev_t *base, const char *peer_addr, uint64_t tag,
			       const rw_rail_conn_cbs_t *cbs, void *ctx, rw_rail_conn_t **conn_p)
{
	shm_dev_t *dev = (shm_dev_t *)base;
	uint32_t ip;
	uint16_t port;
	char ipstr[INET_ADDRSTRLEN], prefix[sizeof(dev->sock_prefix)];
	if (rw_rail_addr_parse(peer_addr, &ip, &port) != RW_OK) {
		rw_err("rail %u: bad peer address '%s' (want a.b.c.d:port)", base->rail, peer_addr);
		return RW_ERR_INVAL;
	}
	inet_ntop(AF_INET, &ip, ipstr, sizeof(ipstr));
	snprintf(prefix, sizeof(prefix), "railwave-shm/%s", ipstr);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		rw_err("rail %u: socket: %m", base->rail);
		return RW_ERR_SYS;
	}
	shm_conn_t *c = shm_conn_new(dev, fd, cbs, ctx);
	if (!c) {
		close(fd);
		return RW_ERR_NOMEM;
	}
	c->base.tag = tag;
	c->user_known = 1;
	c->hs = SHM_HS_CONNECTING;
	snprintf(c->base.peer, sizeof(c->base.peer), "%s", peer_addr);
	ev_timer_start(base->loop, &c->timer);
	struct sockaddr_un sa;
	socklen_t salen = sock_name(&sa, prefix, port);
	if (connect(fd, (struct sockaddr *)&sa, salen) < 0 && errno != EINPROGRESS) {
		rw_err("rail %u peer %s: connect: %m", base->rail, peer_addr);
		shm_conn_fail_later(c, RW_ERR_PEER); /* on_error() from the loop, as promised */
	} else {
		ev_io_start(base->loop, &c->wio); /* HELLO from the loop: the proof comes next */
	}
	*conn_p = &c->base;
	return RW_OK;
}

static rw_status_t shm_write(rw_rail_conn_t *base, const rw_rail_write_t *w)
{
	shm_conn_t *c = (shm_conn_t *)base;
	shm_dev_t *dev = c->dev;
	if (base->state != RW_RAIL_CONN_UP || c->closed || c->fd < 0 || c->pending_fail)
		return RW_ERR_STATE;
	if (c->tx_posted - c->tx_acked >= dev->base.max_writes) {
		c->want_writable = 1;
		return RW_ERR_AGAIN;
	}
	int ask = 0;
	pthread_mutex_lock(&dev->mu);
	if (w->length && !shm_map_find(c, w->remote.key)) {
		if (c->nmaps == c->cap_maps) {
			size_t cap = c->cap_maps ? 2 * c->cap_maps : 8;
			shm_map_t *grown = realloc(c->maps, cap * sizeof(*grown));
			if (!grown) {
				pthread_mutex_unlock(&dev->mu);
				return RW_ERR_NOMEM;
			}
			c->maps = grown;
			c->cap_maps = cap;
		}
		c->maps[c->nmaps++] = (shm_map_t){.key = w->remote.key, .state = SHM_MAP_ASKED};
		ask = 1;
	}
	c->tx[c->tx_posted & c->out_mask] = (shm_tx_t){
		.local = w->local, .local_offset = w->local_offset, .length = w->length,
		.key = w->remote.key, .remote_offset = w->remote_offset, .imm = w->imm,
		.ctx = w->ctx};
	c->tx_posted++;
	pthread_mutex_unlock(&dev->mu);
	if (ask && shm_conn_send(c, &(shm_msg_t){.type = SHM_KEY_REQ, .a = w->remote.key}, -1) != 0)
		shm_conn_fail_later(c, RW_ERR_PEER); /* queued all the same: it comes back failed */
	shm_copy_kick(c);
	return RW_OK;
}

static void shm_conn_close(rw_rail_conn_t *base)
{
	shm_conn_destroy((shm_conn_t *)base);
}

/* ---- regions ---------------------------------------------------------------------------- */

/* Swap the pages under [addr, addr + span) for the mapping at p (its contents already copied
 * from them): one mremap, so no moment leaves the range unmapped. */
static int pages_swap(void *addr, void *p, uint64_t span)
{
	if (mremap(p, span, span, MREMAP_MAYMOVE | MREMAP_FIXED, addr) != MAP_FAILED)
		return 0;
	munmap(p, span);
	return -1;
}

static rw_status_t shm_reg_host(rw_rail_dev_t *base, void *addr, uint64_t length,
				rw_rail_region_t **region_p)
{
	shm_dev_t *dev = (shm_dev_t *)base;
	const uint64_t page = (uint64_t)page_size();
	if ((uintptr_t)addr % page) {
		rw_err("rail %u: an shm region must start on a page boundary (%p)", base->rail, addr);
		return RW_ERR_INVAL;
	}
	/* Pages are what is shared: a second region on pages of a first would map a new memfd
	 * over them, and peers writing into the first would write into pages nobody reads. */
	const uintptr_t lo = (uintptr_t)addr, hi = lo + ((length + page - 1) & ~(page - 1));
	for (size_t i = 0; i < dev->nregions; i++) {
		const uintptr_t b = (uintptr_t)dev->regions[i]->base.addr;
		if (lo < b + dev->regions[i]->span && b < hi) {
			rw_err("rail %u: shm regions may not share pages (%p+%llu overlaps region %#llx)",
			       base->rail, addr, (unsigned long long)length,
			       (unsigned long long)dev->regions[i]->base.key);
			return RW_ERR_INVAL;
		}
	}
	if (dev->nregions == dev->cap_regions) {
		size_t cap = dev->cap_regions ? 2 * dev->cap_regions : 16;
		shm_region_t **grown = realloc(dev->regions, cap * sizeof(*grown));
		if (!grown)
			return RW_ERR_NOMEM;
		dev->regions = grown;
		dev->cap_regions = cap;
	}
	shm_region_t *r = calloc(1, sizeof(*r));
	if (!r)
		return RW_ERR_NOMEM;
	r->span = (length + page - 1) & ~(page - 1);
	/* The caller's pages become the memfd's: copy them in, then map the memfd in their
	 * place. Sealed before any peer can see it, so no peer can shrink it under us. */
	r->fd = shm_memfd_sealed("railwave-shm-region", r->span);
	void *p = r->fd >= 0 ? mmap(NULL, r->span, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0)
			     : MAP_FAILED;
	if (p == MAP_FAILED) {
		rw_err("rail %u: cannot make a %llu-byte shared region: %m", base->rail,
		       (unsigned long long)r->span);
		goto free_region;
	}
	memcpy(p, addr, r->span);
	if (pages_swap(addr, p, r->span) != 0) {
		rw_err("rail %u: cannot map the shared region over %p: %m", base->rail, addr);
		goto free_region;
	}
	r->base.dev = base;
	r->base.addr = addr;
	r->base.length = length;
	r->base.key = ((uint64_t)dev->key_salt << 32) | ++dev->key_counter;
	dev->regions[dev->nregions++] = r;
	*region_p = &r->base;
	return RW_OK;

free_region:
	if (r->fd >= 0)
		close(r->fd);
	free(r);
	return RW_ERR_SYS;
}

static rw_status_t shm_reg_dmabuf(rw_rail_dev_t *dev, int fd, uint64_t fd_offset,
				  uint64_t length, uint64_t iova, rw_rail_region_t **region_p)
{
	(void)dev, (void)fd, (void)fd_offset, (void)length, (void)iova, (void)region_p;
	return RW_ERR_UNSUPPORTED; /* host memory only (docs/rdma.md: GPU memory over shm) */
}

/* Give the caller back private pages with the region's contents: a peer still holding the
 * memfd writes into pages nobody uses any more, never into memory the caller reuses. */
static void region_unshare(shm_dev_t *dev, shm_region_t *r)
{
	void *p = mmap(NULL, r->span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p != MAP_FAILED) {
		memcpy(p, r->base.addr, r->span);
		if (pages_swap(r->base.addr, p, r->span) == 0)
			p = NULL;
	}
	if (p) /* the pages stay shared: peers that have the fd could still write into them */
		rw_err("rail %u: region %#llx: cannot give back private pages (%m); its memory "
		       "stays writable by the peers that mapped it", dev->base.rail,
		       (unsigned long long)r->base.key);
	close(r->fd);
	free(r);
}

/* After dereg returns no byte of the region changes: its pages are private again. Writes of
 * peers into it that were not reported yet, and later ones, fail their connection on our side
 * (RW_ERR_PROTO: an unknown key), as on tcp; peers hear UNREG and drop their mapping. */
static void shm_dereg(rw_rail_region_t *base)
{
	shm_dev_t *dev = (shm_dev_t *)base->dev;
	shm_region_t *r = (shm_region_t *)base;
	for (size_t i = 0; i < dev->nregions; i++) {
		if (dev->regions[i] == r) {
			dev->regions[i] = dev->regions[--dev->nregions];
			break;
		}
	}
	shm_msg_t m = {.type = SHM_UNREG, .a = base->key};
	shm_conn_t *c;
	rw_list_for_each(&dev->conns, c, link)
		if (c->hs == SHM_HS_DONE && shm_conn_live(c) && shm_conn_send(c, &m, -1) != 0)
			shm_conn_fail_later(c, RW_ERR_PEER);
	region_unshare(dev, r);
}

/* ---- device ----------------------------------------------------------------------------- */

static rw_status_t shm_dev_open(const rw_rail_config_t *cfg, struct ev_loop *loop,
				rw_rail_dev_t **dev_p)
{
	rw_status_t st;
	struct in_addr ip;
	shm_dev_t *dev = calloc(1, sizeof(*dev));
	if (!dev)
		return RW_ERR_NOMEM;
	st = rw_rail_dev_init_base(&dev->base, &rw_rail_shm_ops, cfg, loop, SHM_DEFAULT_MAX_WRITES);
	if (st != RW_OK)
		goto free_dev;
	if (!cfg->local || inet_pton(AF_INET, cfg->local, &ip) != 1) {
		rw_err("rail %u: shm names a rail by an IPv4 address (any, not only this host's), "
		       "got '%s'", cfg->rail, cfg->local);
		st = RW_ERR_INVAL;
		goto free_dev;
	}
	if (dev->base.max_writes > SHM_RING_MAX) {
		rw_err("rail %u: max_writes %u is more than shm's %u", cfg->rail,
		       dev->base.max_writes, SHM_RING_MAX);
		st = RW_ERR_INVAL;
		goto free_dev;
	}
	snprintf(dev->sock_prefix, sizeof(dev->sock_prefix), "railwave-shm/%s", cfg->local);
	if (getrandom(&dev->key_salt, sizeof(dev->key_salt), GRND_NONBLOCK) != sizeof(dev->key_salt))
		dev->key_salt = (uint32_t)(rw_now_ns() ^ (uint64_t)getpid() << 16);
	if (cfg->pace_bps) {
		dev->pace_Bps = (double)cfg->pace_bps / 8.;
		dev->pace_burst = RW_MAX((double)SHM_PACE_MIN_BURST, dev->pace_Bps * SHM_PACE_BURST_S);
		dev->pace_tokens = dev->pace_burst;
		dev->pace_last_ns = rw_now_ns();
	}
	rw_list_init(&dev->conns);
	rw_list_init(&dev->listeners);
	unsigned copiers = cfg->copy_threads;
	if (copiers == 0)
		copiers = dev->pace_Bps > 0 ? (unsigned)(dev->pace_Bps / SHM_COPIER_BPS) + 1
					    : SHM_UNPACED_COPIERS;
	copiers = RW_MIN(copiers, SHM_MAX_COPIERS);
	pthread_mutex_init(&dev->mu, NULL);
	pthread_cond_init(&dev->work_cv, NULL);
	pthread_cond_init(&dev->idle_cv, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* pace_wait's deadlines */
	pthread_cond_init(&dev->pace_cv, &ca);
	pthread_condattr_destroy(&ca);
	if ((st = shm_copy_start(dev, copiers)) != RW_OK)
		goto destroy_sync;
	dev->base.caps.flags = RW_RAIL_CAP_ARRIVAL_WHERE | RW_RAIL_CAP_PROOF;
	dev->base.caps.max_writes = dev->base.max_writes;
	dev->base.caps.max_write_length = SHM_MAX_WRITE_LENGTH;
	*dev_p = &dev->base;
	return RW_OK;

destroy_sync:
	pthread_cond_destroy(&dev->pace_cv);
	pthread_cond_destroy(&dev->idle_cv);
	pthread_cond_destroy(&dev->work_cv);
	pthread_mutex_destroy(&dev->mu);
free_dev:
	free(dev);
	return st;
}

static void shm_dev_close(rw_rail_dev_t *base)
{
	shm_dev_t *dev = (shm_dev_t *)base;
	while (!rw_list_empty(&dev->listeners))
		shm_listener_close(&rw_container_of(dev->listeners.next, shm_listener_t, link)->base);
	while (!rw_list_empty(&dev->conns)) /* each detached from the copier first */
		shm_conn_destroy(rw_container_of(dev->conns.next, shm_conn_t, link));
	shm_copy_stop(dev);
	for (size_t i = 0; i < dev->nregions; i++)
		region_unshare(dev, dev->regions[i]);
	free(dev->regions);
	pthread_cond_destroy(&dev->pace_cv);
	pthread_cond_destroy(&dev->idle_cv);
	pthread_cond_destroy(&dev->work_cv);
	pthread_mutex_destroy(&dev->mu);
	free(dev);
}

/* The memfd a region's pages were swapped onto (shm_reg_host): what peers map. */
static int shm_region_fd(const rw_rail_region_t *region)
{
	return ((const shm_region_t *)region)->fd;
}

const rw_rail_ops_t rw_rail_shm_ops = {
	.name = "shm",
	.dev_open = shm_dev_open,
	.dev_close = shm_dev_close,
	.reg_host = shm_reg_host,
	.reg_dmabuf = shm_reg_dmabuf,
	.dereg = shm_dereg,
	.listen = shm_listen,
	.listener_close = shm_listener_close,
	.connect = shm_connect,
	.write = shm_write,
	.conn_close = shm_conn_close,
	.region_fd = shm_region_fd,
};
