/* Creating and destroying the peer mesh (service/mesh/mesh.h): rail devices, per-rail registered
 * memory and listeners, the control listener and the timers; on destroy a goodbye to every peer
 * first, then everything closed in reverse. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "service/mesh/mesh_int.h"

/* "; RDMA devices here: mlx5_0, mlx5_1" (or none) for an error about a verbs rail: the names
 * the kernel lists in /sys/class/infiniband, where rdma-core finds them too. */
static void rdma_devices_here(char *buf, size_t len)
{
	DIR *d = opendir("/sys/class/infiniband");
	size_t n = (size_t)snprintf(buf, len, "; RDMA devices here:");
	int any = 0;
	struct dirent *e;
	while (d && (e = readdir(d)) != NULL && n < len) {
		if (e->d_name[0] == '.')
			continue;
		n += (size_t)snprintf(buf + n, len - n, "%s %s", any ? "," : "", e->d_name);
		any = 1;
	}
	if (d)
		closedir(d);
	if (!any && n < len)
		snprintf(buf + n, len - n, " none (no RDMA NIC, or its driver is not loaded: "
			 "ibv_devices lists them)");
}

static uint64_t random_u64(void)
{
	uint64_t v = 0;
	int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		if (read(fd, &v, sizeof(v)) != sizeof(v))
			v = 0;
		close(fd);
	}
	return v ^ rw_now_ns() ^ ((uint64_t)getpid() << 32);
}

rw_status_t rw_svc_mesh_create(rw_svc_t *svc, uint64_t area_bytes, uint64_t carve_bytes,
			       uint32_t carve_max, const rw_svc_mesh_cbs_t *cbs, void *ctx,
			       rw_svc_mesh_t **mesh_p)
{
	const rw_svc_config_t *cfg = &svc->cfg;
	rw_status_t st = RW_ERR_NOMEM;
	uint32_t *members = NULL; /* the rail addresses of the nodes that dial us, per rail */
	rw_svc_mesh_t *m = calloc(1, sizeof(*m));
	if (!m)
		return RW_ERR_NOMEM;
	m->svc = svc;
	for (uint32_t r = 0; r < RW_MAX_RAILS; r++)
		m->slab_dev[r] = m->slab_fd[r] = -1;
	m->loop = svc->loop;
	m->cbs = *cbs;
	m->ctx = ctx;
	m->nodes = cfg->n_nodes;
	m->rails = cfg->rails;
	m->me = cfg->me;
	m->area_bytes = area_bytes;
	m->listen_fd = -1;
	m->boot_id = random_u64();
	const char *transport = rw_svc_transport_name(cfg->transport);
	m->fingerprint = rw_wire_fingerprint(cfg->cluster, &svc->topo, transport, area_bytes);
	if (carve_bytes) /* every node must number and size its carve-outs alike */
		m->fingerprint ^= rw_wire_fingerprint("carve-outs", &svc->topo, transport,
						      carve_bytes ^ ((uint64_t)carve_max << 48));
	if (carve_bytes && cfg->group_local_mib) /* and split them alike */
		m->fingerprint ^= rw_wire_fingerprint("carve-outs' local area", &svc->topo, transport,
						      cfg->group_local_mib);
	if (mesh_auth_init() != RW_OK) {
		rw_err("mesh: cannot initialise libsodium");
		st = RW_ERR_SYS;
		goto fail;
	}
	if (cfg->key_file[0]) {
		char why[RW_SVC_PATH_MAX + 128];
		st = mesh_auth_key_load(cfg->key_file, m->key, why, sizeof(why));
		if (st != RW_OK) {
			rw_err("mesh: %s", why);
			goto fail;
		}
		m->keyed = 1;
		rw_info("mesh: peers authenticate with the cluster key in %s", cfg->key_file);
	} else {
		rw_warn("mesh: AUTH NONE: no key_file is configured, so peers are NOT authenticated: "
			"any host that reaches the control and rail ports can join this cluster and "
			"write into its memory (docs/security.md; railwave keygen makes a key)");
	}
	m->peer = calloc(m->nodes, sizeof(*m->peer));
	members = calloc(m->nodes, sizeof(*members));
	m->ctl_members = calloc(m->nodes, sizeof(*m->ctl_members));
	if (!m->peer || !members || !m->ctl_members)
		goto fail;
	for (uint32_t i = 0; i < m->me; i++)
		m->ctl_members[i] = cfg->nodes[i].control.sin.sin_addr.s_addr;
	for (uint32_t i = 0; i < m->nodes; i++) {
		mesh_peer_t *p = &m->peer[i];
		p->mesh = m;
		p->idx = i;
		for (uint32_t r = 0; r < m->rails; r++) {
			p->rail[r].is_rail = 1;
			p->rail[r].peer = p;
			p->rail[r].rail = r;
			ev_timer_init(&p->rail[r].retry, mesh_rail_retry_cb, 0., 0.);
			p->rail[r].retry.data = &p->rail[r];
		}
		ev_timer_init(&p->retry, mesh_retry_cb, 0., 0.);
		p->retry.data = p;
		ev_timer_init(&p->join, mesh_peer_join_cb, 0., 0.);
		p->join.data = p;
		ev_timer_init(&p->settle, mesh_settle_cb, 0., 0.);
		p->settle.data = p;
		mesh_peer_set_state(p, i == m->me ? RW_SVC_PEER_SELF : RW_SVC_PEER_DOWN);
	}
	if ((st = mesh_carve_init(m, carve_bytes, carve_max)) != RW_OK)
		goto fail;

	for (uint32_t r = 0; r < m->rails; r++) {
		const rw_svc_rail_cfg_t *rc = &cfg->nodes[m->me].rails[r];
		char local[RW_RAIL_ADDR_MAX];
		if (rc->has_addr)
			snprintf(local, sizeof(local), "%s", rc->addr.text);
		else
			snprintf(local, sizeof(local), "%s:%u", rc->device, rc->device_port);
		/* pace (tcp only, config.c checks): the rail sends at its configured rate, so a
		 * loopback cluster behaves like one with NICs of that speed (docs/rdma.md). */
		/* The lower nodes dial our rails, from their rail addresses: theirs wait in their own
		 * budget at accept (docs/security.md). */
		uint32_t n_members = 0;
		for (uint32_t i = 0; i < m->me; i++)
			if (cfg->nodes[i].rails[r].has_addr)
				members[n_members++] = cfg->nodes[i].rails[r].addr.sin.sin_addr.s_addr;
		rw_rail_config_t rcfg = { .transport = transport, .local = local, .rail = r,
					  .port = rc->has_addr ? rc->addr.port : 0,
					  .pace_bps = cfg->pace ? (uint64_t)(rc->rate_gbps * 1e9) : 0,
					  .members = members, .n_members = n_members };
		st = rw_rail_dev_open(&rcfg, m->loop, &m->dev[r]);
		if (st != RW_OK) {
			char devs[256] = "";
			if (cfg->transport == RW_SVC_TRANSPORT_VERBS)
				rdma_devices_here(devs, sizeof(devs));
			rw_err("rail=%u: cannot open the %s rail at %s %s (nodes[%u].rails[%u]): %s%s", r,
			       transport, rc->has_addr ? "address" : "device", local, m->me, r,
			       rw_status_str(st), devs);
			goto fail;
		}
		void *mem = mmap(NULL, area_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (mem == MAP_FAILED) {
			rw_err("rail=%u: cannot map %llu bytes: %m", r, (unsigned long long)area_bytes);
			m->mem[r] = NULL;
			st = RW_ERR_NOMEM;
			goto fail;
		}
		m->mem[r] = mem;
		if ((st = mesh_slabs_place(m, r)) != RW_OK)
			goto fail;
		st = rw_rail_listen(m->dev[r], &mesh_rail_cbs, m, &m->listener[r]);
		if (st != RW_OK) {
			/* The transport logged the system call; errno is still its (logging keeps it). */
			if (st == RW_ERR_SYS && (errno == EADDRINUSE || errno == EADDRNOTAVAIL))
				st = errno == EADDRINUSE ? RW_ERR_EXISTS : RW_ERR_NOTFOUND;
			rw_err("rail=%u: cannot listen on %s (nodes[%u].rails[%u]): %s", r, local, m->me, r,
			       st == RW_ERR_EXISTS ? "the port is in use (another railwaved, or another "
			       "job's daemons on the same ports?)" : st == RW_ERR_NOTFOUND ?
			       "not an address of this host" : rw_status_str(st));
			goto fail;
		}
	}

	mesh_slabs_summary(m);

	const rw_svc_endpoint_t *ep = &cfg->nodes[m->me].control;
	m->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	int one = 1;
	if (m->listen_fd < 0 ||
	    setsockopt(m->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
	    bind(m->listen_fd, (const struct sockaddr *)&ep->sin, sizeof(ep->sin)) < 0 ||
	    listen(m->listen_fd, 64) < 0) {
		/* In use or not this host's: a configuration-class error (railwaved exits 2). */
		st = errno == EADDRINUSE ? RW_ERR_EXISTS : errno == EADDRNOTAVAIL ? RW_ERR_NOTFOUND :
		     RW_ERR_SYS;
		rw_err("control: cannot listen on %s:%u (nodes[%u].control): %m", ep->text, ep->port,
		       m->me);
		goto fail;
	}
	ev_io_init(&m->listen_io, mesh_listen_cb, m->listen_fd, EV_READ);
	m->listen_io.data = m;
	rw_listen_pause_init(&m->listen_pause, m->loop, &m->listen_io, "control listener");
	ev_io_start(m->loop, &m->listen_io);

	double hb = cfg->heartbeat_interval_ms / 1000.0;
	ev_timer_init(&m->hb_timer, mesh_hb_cb, hb, hb);
	m->hb_timer.data = m;
	ev_timer_init(&m->fail_timer, mesh_fail_cb, 0., 0.);
	m->fail_timer.data = m;
	m->dial = mesh_rail_dial;
	ev_timer_init(&m->fault_timer, mesh_rail_fault_cb, 0., 0.);
	m->fault_timer.data = m;
	if ((st = rw_svc_rail_fault_from_env(&m->fault, m->nodes, m->rails, m->me)) != RW_OK)
		goto fail;
	if (m->fault.on && m->fault.at_start) { /* a NIC dead before the peers meet */
		m->fault.fired = 1;
		m->peer[m->fault.peer].rail[m->fault.rail].health.hold_until_ns =
			rw_now_ns() + (uint64_t)m->fault.for_ms * 1000000ull;
	}
	m->hb_last_ns = rw_now_ns(); /* the first tick's lateness counts from here (mesh_hb_cb) */
	ev_timer_start(m->loop, &m->hb_timer);

	for (uint32_t i = m->me + 1; i < m->nodes; i++)
		mesh_peer_connect(&m->peer[i]);
	rw_info("mesh: node %u of %u, %u rails over %s%s, control %s:%u", m->me, m->nodes, m->rails,
		transport, cfg->pace ? " (paced at each rail's rate_gbps)" : "", ep->text, ep->port);
	free(members);
	*mesh_p = m;
	return RW_OK;
fail:
	free(members);
	rw_svc_mesh_destroy(m);
	return st;
}

void rw_svc_mesh_destroy(rw_svc_mesh_t *m)
{
	if (!m)
		return;
	rw_svc_mesh_cbs_t none = { 0 };
	m->cbs = none; /* no callbacks during teardown */
	if (m->peer) {
		/* Goodbye to every peer before closing anything, so that each logs a clean stop
		 * rather than a failure. Best effort: one non-blocking send after what is queued;
		 * a peer whose channel is backed up sees a plain close. */
		for (uint32_t i = 0; i < m->nodes; i++) {
			mesh_ctl_t *c = m->peer[i].ctl;
			if (c && m->peer[i].hello_ok && !c->connecting &&
			    mesh_ctl_queue(c, RW_WIRE_BYE, NULL, 0) == RW_OK)
				mesh_ctl_flush(c);
		}
		for (uint32_t i = 0; i < m->nodes; i++) {
			mesh_peer_t *p = &m->peer[i];
			ev_timer_stop(m->loop, &p->retry);
			ev_timer_stop(m->loop, &p->join);
			ev_timer_stop(m->loop, &p->settle);
			mesh_ctl_free(p->ctl);
			p->ctl = NULL;
			for (uint32_t r = 0; r < m->rails; r++) {
				mesh_rail_reset(&p->rail[r]);
				mesh_rail_close(&p->rail[r], RW_ERR_PEER);
			}
		}
	}
	while (m->unknown) {
		mesh_ctl_t *c = m->unknown;
		m->unknown = c->next;
		m->n_unknown -= !c->member_src;
		mesh_ctl_free(c);
	}
	ev_timer_stop(m->loop, &m->hb_timer);
	ev_timer_stop(m->loop, &m->fail_timer);
	ev_timer_stop(m->loop, &m->fault_timer);
	rw_listen_pause_stop(&m->listen_pause);
	if (m->listen_fd >= 0) {
		ev_io_stop(m->loop, &m->listen_io);
		close(m->listen_fd);
	}
	mesh_carve_fini(m); /* deregistered before the devices close */
	for (uint32_t r = 0; r < m->rails; r++) {
		if (m->listener[r])
			rw_rail_listener_close(m->listener[r]);
		if (m->region[r])
			rw_rail_dereg(m->region[r]);
		mesh_slabs_free(m, r);
		if (m->dev[r]) {
			mesh_rail_dev_sample(m, r); /* the final counts, for the last publish */
			rw_rail_dev_close(m->dev[r]);
		}
		if (m->mem[r])
			munmap(m->mem[r], m->area_bytes);
	}
	free(m->peer);
	free(m->ctl_members);
	mesh_auth_wipe(m->key, sizeof(m->key));
	free(m);
}
