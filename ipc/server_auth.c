/* ipc/server_auth.c: rank authentication for the daemon side of node-local IPC (docs/ipc.md
 * "Rank authentication"): admission by peer credentials (SO_PEERCRED, the process start time)
 * under the client and per-uid caps, the hello timeout, and the hello itself: groups, their
 * keys (a keyed hash, compared in constant time), rank, world, node and GPU checks. */
#include "ipc/server_int.h"

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
 * Hello and groups
 * ------------------------------------------------------------------------------------------- */

static ipc_group_t *group_find(rw_ipc_server_t *srv, const char *name)
{
	for (ipc_group_t *g = srv->groups; g; g = g->next)
		if (strcmp(g->name, name) == 0)
			return g;
	return NULL;
}

void ipc_group_leave(rw_ipc_client_t *c)
{
	ipc_group_t *g = c->group;
	if (!g)
		return;
	for (rw_ipc_client_t **pp = &g->members; *pp; pp = &(*pp)->group_next)
		if (*pp == c) {
			*pp = c->group_next;
			break;
		}
	c->group = NULL;
	if (g->members)
		return;
	rw_ipc_server_t *srv = c->srv;
	for (ipc_group_t **pp = &srv->groups; *pp; pp = &(*pp)->next)
		if (*pp == g) {
			*pp = g->next;
			break;
		}
	free(g);
	srv->stats.groups--;
}

/* The fingerprint of the hello's group key (ipc/ipc.h RW_IPC_KEY_FP_SIZE); zeros without one. */
static void key_fp(const rw_ipc_hello_t *req, uint8_t fp[RW_IPC_KEY_FP_SIZE])
{
	_Static_assert(RW_IPC_GROUP_KEY_MIN >= crypto_generichash_KEYBYTES_MIN &&
		       RW_IPC_GROUP_KEY_MAX <= crypto_generichash_KEYBYTES_MAX &&
		       RW_IPC_KEY_FP_SIZE >= crypto_generichash_BYTES_MIN, "a group key keys BLAKE2b");
	memset(fp, 0, RW_IPC_KEY_FP_SIZE);
	if (req->key_len >= RW_IPC_GROUP_KEY_MIN)
		crypto_generichash(fp, RW_IPC_KEY_FP_SIZE, (const uint8_t *)req->group,
				   strlen(req->group), req->key, req->key_len);
}

/* A hello refused after it was found well formed: the rank is told (and dropped), and the
 * service hears that this rank of the group will not join (its peers need not wait for it). */
static int refuse_hello(rw_ipc_client_t *c, const rw_ipc_hello_t *req, int code, const char *why)
{
	rw_ipc_server_t *srv = c->srv;
	ipc_send_error(c, req->hdr.seq, code, why, 1);
	if (srv->ops.hello_refused) {
		uint8_t fp[RW_IPC_KEY_FP_SIZE];
		key_fp(req, fp);
		srv->ops.hello_refused(srv->ctx, req->group, req->rank, req->world_size, fp, code,
				       why);
	}
	return 0;
}

/* A group opened without a key yields its name to a rank that presents one (docs/ipc.md "Rank
 * authentication"): whoever holds it — a process that took a launched job's name first, or a
 * keyless job that shares it — is told and dropped, and the group is the newcomer's, keyed,
 * from then on, so none of them gets back in without the key. Their seats are free at once:
 * dropped members are skipped by the seat checks (rw_ipc_client_leaving for the service). */
static void group_claim(rw_ipc_client_t *c, const rw_ipc_hello_t *req, ipc_group_t *g,
			const uint8_t hash[crypto_generichash_BYTES])
{
	rw_ipc_server_t *srv = c->srv;
	char why[RW_IPC_ERRMSG_MAX];
	snprintf(why, sizeof(why), "group %.32s, opened without a key, was claimed by a rank "
		 "with one (pid %d)", req->group, (int)c->info.pid);
	if (rw_ipc_log_churn(srv))
		rw_warn("ipc: group %s, opened without a key, is claimed by pid %d uid %d with a "
			"group key: its members are dropped", g->name, (int)c->info.pid,
			(int)c->info.uid);
	for (rw_ipc_client_t *m = g->members; m; m = m->group_next)
		if (!m->dying)
			ipc_send_error(m, 0, RW_E_GROUP_KEY, why, 1);
	g->keyed = 1;
	memcpy(g->key_hash, hash, crypto_generichash_BYTES);
	g->world_size = req->world_size;
	g->node = req->node;
	srv->stats.groups_claimed++;
}

/* The group key (docs/ipc.md "Rank authentication"): the first rank of a group sets it (or opens
 * the group without one, where the daemon allows that), every later rank must present the same;
 * a rank with a key claims a group opened without one (group_claim). Only a keyed hash is
 * kept, compared in constant time; the check comes before any other group check so a refused
 * rank learns nothing about the group's ranks. Refusal drops the client and leaves the group as
 * it was. Returns 0 (hash in *hash_p) or -1 (refused). */
static int check_group_key(rw_ipc_client_t *c, const rw_ipc_hello_t *req, ipc_group_t *g,
			   uint8_t hash_p[crypto_generichash_BYTES])
{
	rw_ipc_server_t *srv = c->srv;
	char why[RW_IPC_ERRMSG_MAX];
	memset(hash_p, 0, crypto_generichash_BYTES);
	if (req->key_len)
		crypto_generichash(hash_p, crypto_generichash_BYTES, req->key, req->key_len,
				   srv->key_salt, sizeof(srv->key_salt));
	if (!req->key_len && srv->cfg.require_group_key)
		snprintf(why, sizeof(why), "group %.48s: this daemon requires a group key, none "
			 "was given", req->group);
	else if (!g)
		return 0;
	else if (g->keyed && !req->key_len)
		snprintf(why, sizeof(why), "group %.48s has a group key and this rank gave none",
			 req->group);
	else if (!g->keyed && req->key_len) {
		group_claim(c, req, g, hash_p);
		return 0;
	} else if (g->keyed && sodium_memcmp(hash_p, g->key_hash, crypto_generichash_BYTES) != 0)
		snprintf(why, sizeof(why), "group %.48s: key differs from the one its first rank set",
			 req->group);
	else
		return 0;
	srv->stats.refused_key++;
	refuse_hello(c, req, RW_E_GROUP_KEY, why);
	return -1;
}

int ipc_handle_hello(rw_ipc_client_t *c, const rw_ipc_hello_t *req)
{
	rw_ipc_server_t *srv = c->srv;
	uint32_t seq = req->hdr.seq;
	const char *why;
	int code = rw_ipc_check_hello(req, &srv->lim, &why);
	if (code == RW_E_GROUP_KEY) /* too short */
		srv->stats.refused_key++;
	if (code)
		return ipc_send_error(c, seq, code, why, 1);
	c->bufs = calloc(srv->lim.max_buffers, sizeof(*c->bufs));
	if (!c->bufs)
		return ipc_send_error(c, seq, RW_E_INTERNAL, "daemon out of memory", 1);
	if (srv->node >= 0 && req->node != (uint32_t)srv->node)
		return refuse_hello(c, req, RW_E_NODE_MISMATCH, "node differs from this daemon's node");
	/* A group spans the whole cluster: its world size and where each rank lives come from the
	 * cluster file, so a rank that disagrees is told what the file says. */
	uint32_t world = srv->cfg.world_size, per = srv->cfg.gpus_per_node;
	char shape[192];
	if (world && per && req->world_size != world) {
		snprintf(shape, sizeof(shape), "world size %u, but the cluster file has %u nodes x %u "
			 "GPUs per node = %u ranks in every group", req->world_size, world / per, per,
			 world);
		return refuse_hello(c, req, RW_E_WORLD_MISMATCH, shape);
	}
	if (world && per && srv->node >= 0 && req->rank / per != (uint32_t)srv->node) {
		snprintf(shape, sizeof(shape), "rank %u is on node %u of the cluster file (%u GPUs per "
			 "node), and this daemon is node %d", req->rank, req->rank / per, per, srv->node);
		return refuse_hello(c, req, RW_E_NODE_MISMATCH, shape);
	}
	uint8_t key_hash[crypto_generichash_BYTES];
	ipc_group_t *g = group_find(srv, req->group);
	if (check_group_key(c, req, g, key_hash) < 0)
		return 0;
	if (g) {
		if (g->world_size != req->world_size)
			return refuse_hello(c, req, RW_E_WORLD_MISMATCH,
					    "world size differs from the group's earlier members");
		if (g->node != req->node)
			return refuse_hello(c, req, RW_E_NODE_MISMATCH,
					    "node differs from the group's earlier members");
		for (rw_ipc_client_t *m = g->members; m; m = m->group_next) {
			if (m->dying) /* dropped: its seat is free (it leaves at the next prepare) */
				continue;
			if (m->info.rank == req->rank)
				return refuse_hello(c, req, RW_E_RANK_DUP,
						    "this rank of this group is already connected");
			if (req->local_gpu >= 0 && m->info.local_gpu == req->local_gpu)
				return refuse_hello(c, req, RW_E_GPU,
						    "local GPU already used by another rank of the group");
		}
	} else {
		g = calloc(1, sizeof(*g));
		if (!g)
			return ipc_send_error(c, seq, RW_E_INTERNAL, "daemon out of memory", 1);
		memcpy(g->name, req->group, sizeof(g->name));
		g->keyed = req->key_len != 0;
		memcpy(g->key_hash, key_hash, sizeof(g->key_hash));
		if (!g->keyed && rw_ipc_log_churn(srv))
			rw_info("ipc: group %s opened without a group key by client %u (pid %d uid %d): "
				"any process that can open the socket may take its other ranks",
				g->name, c->info.id, (int)c->info.pid, (int)c->info.uid);
		g->world_size = req->world_size;
		g->node = req->node;
		g->next = srv->groups;
		srv->groups = g;
		srv->stats.groups++;
	}
	memcpy(c->info.group, req->group, sizeof(c->info.group));
	c->info.rank = req->rank;
	c->info.world_size = req->world_size;
	c->info.node = req->node;
	c->info.local_gpu = req->local_gpu;
	memcpy(c->info.gpu_uuid, req->gpu_uuid, sizeof(c->info.gpu_uuid));
	key_fp(req, c->info.key_fp);
	c->group = g;
	c->group_next = g->members;
	g->members = c;
	c->joined = 1;
	ev_timer_stop(srv->loop, &c->hello_timer);

	rw_ipc_hello_ok_t ok;
	memset(&ok, 0, sizeof(ok));
	ipc_hdr_init(&ok.hdr, RW_IPC_HELLO_OK, seq);
	ok.client_id = c->info.id;
	ok.max_buffers = srv->lim.max_buffers;
	ok.max_tokens = srv->lim.max_tokens;
	ok.max_hidden = srv->lim.max_hidden;
	ok.max_topk = srv->lim.max_topk;
	ok.max_ring_entries = srv->lim.max_ring_entries;
	ok.max_buffer_bytes = srv->lim.max_buffer_bytes;
	if (ipc_send_msg(c, &ok, sizeof(ok), NULL, 0) < 0)
		return 0;
	if (rw_ipc_log_churn(srv))
		rw_info("ipc client %u joined: group %s rank %u/%u node %u gpu %d (pid %d uid %d "
			"gid %d, %s)", c->info.id, c->info.group, c->info.rank, c->info.world_size,
			c->info.node, c->info.local_gpu, (int)c->info.pid, (int)c->info.uid,
			(int)c->info.gid, g->keyed ? "keyed group" : "group without a key");
	if (srv->ops.client_joined)
		srv->ops.client_joined(srv->ctx, c);
	return 0;
}

/* A connection turned away at accept: one fatal ERROR (best effort), then closed. */
static void refuse(int fd, int code, const char *msg)
{
	rw_ipc_error_t err;
	memset(&err, 0, sizeof(err));
	ipc_hdr_init(&err.hdr, RW_IPC_ERROR, 0);
	err.code = code;
	err.fatal = 1;
	snprintf(err.message, sizeof(err.message), "%s", msg);
	ssize_t n = send(fd, &err, sizeof(err), MSG_DONTWAIT | MSG_NOSIGNAL);
	(void)n;
	close(fd);
}

static uint32_t connections_of(const rw_ipc_server_t *srv, uid_t uid)
{
	uint32_t n = 0;
	for (const rw_ipc_client_t *c = srv->clients; c; c = c->next)
		n += !c->dying && c->info.uid == uid;
	return n;
}

/* At the per-uid limit: connections of uid that the process has closed already but whose end
 * the loop has not read yet (it comes after this accept) are ended now, so a process that
 * closes and reconnects at once is not refused for connections it no longer holds. */
static uint32_t connections_held(rw_ipc_server_t *srv, uid_t uid)
{
	uint32_t n = connections_of(srv, uid);
	if (n < srv->cfg.max_per_uid)
		return n;
	for (rw_ipc_client_t *c = srv->clients; c; c = c->next) {
		if (c->dying || c->info.uid != uid)
			continue;
		struct pollfd pfd = { .fd = c->fd, .events = POLLIN | POLLRDHUP };
		if (poll(&pfd, 1, 0) == 1 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
			ipc_client_kill(c, RW_IPC_LEFT_EOF, 0);
			n--;
		}
	}
	return n;
}

/* A connection that has not joined within hello_timeout_ms holds a slot for nothing. Unless its
 * hello is waiting unread: the loop was held past the deadline (a rank's large buffers mapped in
 * one callback) and libev runs the expired timer before the read it queued in the same turn. Such
 * a connection gets one more period, once, for the read to take the hello (a message arrives
 * whole on the seqpacket socket, so a waiting one is a whole hello or a refusal, never a part). */
void ipc_hello_timeout_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)revents;
	rw_ipc_client_t *c = w->data;
	struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
	if (!c->hello_grace && poll(&pfd, 1, 0) == 1 && (pfd.revents & POLLIN)) {
		c->hello_grace = 1;
		ev_timer_set(w, (double)c->srv->cfg.hello_timeout_ms / 1000.0, 0.);
		ev_timer_start(loop, w);
		return;
	}
	char why[RW_IPC_ERRMSG_MAX];
	snprintf(why, sizeof(why), "no hello within %u ms of connecting",
		 c->srv->cfg.hello_timeout_ms);
	c->srv->stats.hello_timeouts++;
	ipc_send_error(c, 0, RW_E_STATE, why, 1);
}

/* The start time of process `pid` (clock ticks after boot, /proc/<pid>/stat field 22), 0 when
 * unreadable. With the pid it names one process for the machine's uptime, so a later process
 * that reuses the pid is never taken for the one that exported a CUDA mapping
 * (docs/cuda.md "IPC import cache"). */
static uint64_t proc_start_time(pid_t pid)
{
	char path[48], buf[1024];
	if (pid <= 0)
		return 0;
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	/* "pid (comm) state ppid ...": comm may hold spaces and ')', so count from the last ')' */
	char *p = strrchr(buf, ')');
	if (!p)
		return 0;
	p++;
	for (int field = 3; field < 22 && p; field++)
		p = strchr(p + 1, ' ');
	if (!p)
		return 0;
	char *end;
	unsigned long long t = strtoull(p + 1, &end, 10);
	return end != p + 1 ? (uint64_t)t : 0;
}

/* SO_PEERCRED at accept: who is connecting decides the per-uid cap and, with the process start
 * time, the identity of its CUDA imports. */
rw_ipc_client_t *ipc_admit(rw_ipc_server_t *srv, int fd)
{
	struct ucred cred = {.pid = 0, .uid = (uid_t)-1, .gid = (gid_t)-1};
	socklen_t clen = sizeof(cred);
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) < 0) {
		rw_warn("ipc: SO_PEERCRED: %m (refusing the connection)");
		refuse(fd, RW_E_INTERNAL, "daemon could not read the connection's credentials");
		return NULL;
	}
	char why[RW_IPC_ERRMSG_MAX];
	uint32_t held = connections_held(srv, cred.uid);
	rw_ipc_client_t *c = NULL;
	if (srv->nclients >= srv->cfg.max_clients)
		snprintf(why, sizeof(why), "daemon client limit reached (%u connections)",
			 srv->cfg.max_clients);
	else if (held >= srv->cfg.max_per_uid)
		snprintf(why, sizeof(why), "uid %d already holds %u connections, the per-uid "
			 "limit (ipc_max_per_uid)", (int)cred.uid, held);
	else if (!(c = calloc(1, sizeof(*c))))
		snprintf(why, sizeof(why), "daemon out of memory");
	if (!c) {
		if (rw_ipc_log_churn(srv))
			rw_warn("ipc: refusing connection from pid %d uid %d gid %d: %s",
				(int)cred.pid, (int)cred.uid, (int)cred.gid, why);
		if (srv->nclients < srv->cfg.max_clients && held >= srv->cfg.max_per_uid)
			srv->stats.refused_uid++;
		refuse(fd, RW_E_LIMIT, why);
		return NULL;
	}
	c->srv = srv;
	c->fd = fd;
	c->sq_efd = c->cq_efd = -1;
	c->info.id = ++srv->next_id;
	c->info.pid = cred.pid;
	c->start_time = proc_start_time(cred.pid);
	c->info.uid = cred.uid;
	c->info.gid = cred.gid;
	c->info.local_gpu = -1;
	return c;
}
