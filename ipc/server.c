/* The daemon side of node-local IPC (contract in ipc/ipc.h, protocol and design in docs/ipc.md):
 * accept trainer ranks on a Unix SOCK_SEQPACKET socket, validate every control message, own
 * each client's buffers and rings, drain submission rings (checking each entry), publish
 * completions. Every client input is hostile: a bad one gets an error reply or an error
 * completion and, where the connection cannot continue, that one client is dropped; every fd
 * received is closed on every path; nothing here can be made to crash or to block the loop.
 * Rank authentication (admission, groups, keys, the hello) is ipc/server_auth.c, registered
 * events (stream order) ipc/server_event.c, the rings (setup, draining, completions)
 * ipc/server_ring.c; what all of them do to one connection (replies, error replies, the kill,
 * the buffer lookup) is ipc/server_conn.c, which calls none of them. They share
 * ipc/server_int.h. */
#include "ipc/server_int.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <sodium.h>

#define RECV_BURST 16  /* control messages handled per readable event (fairness) */

const char *rw_ipc_leave_str(rw_ipc_leave_t reason)
{
	switch (reason) {
	case RW_IPC_LEFT_GOODBYE: return "goodbye";
	case RW_IPC_LEFT_EOF: return "connection closed";
	case RW_IPC_LEFT_PROTOCOL: return "protocol violation";
	case RW_IPC_LEFT_DROPPED: return "dropped by the service";
	case RW_IPC_LEFT_SHUTDOWN: return "daemon shutdown";
	}
	return "unknown";
}

/* ---------------------------------------------------------------------------------------------
 * Buffers
 * ------------------------------------------------------------------------------------------- */

static buf_slot_t *buf_alloc_slot(rw_ipc_client_t *c)
{
	for (uint32_t i = 0; i < c->srv->lim.max_buffers; i++) {
		if (c->bufs[i].id)
			continue;
		c->buf_gen = c->buf_gen % 0xfffffeu + 1; /* 1 .. 0xfffffe: never 0, never NONE */
		memset(&c->bufs[i], 0, sizeof(c->bufs[i]));
		c->bufs[i].pub.id = (c->buf_gen << 8) | i;
		return &c->bufs[i];
	}
	return NULL;
}

/* A client's CUDA mappings kept past its leave: its connection's references in the import
 * cache, released together once the last keep is dropped. */
struct rw_ipc_keep {
	struct rw_ipc_keep *next;
	rw_ipc_client_t *client;     /* NULL once it left */
	uint64_t conn;
	unsigned refs;
	rw_cuda_ipc_map_t **maps;    /* its buffers deregistered while it stays */
	unsigned n_maps;
};

rw_ipc_keep_t *rw_ipc_client_keep(rw_ipc_client_t *c)
{
	if (!c->keep) {
		rw_ipc_keep_t *k = calloc(1, sizeof(*k));
		if (!k)
			return NULL;
		k->client = c;
		k->conn = c->info.id;
		k->next = c->srv->keeps;
		c->srv->keeps = k;
		c->keep = k;
	}
	c->keep->refs++;
	return c->keep;
}

void rw_ipc_keep_drop(rw_ipc_server_t *srv, rw_ipc_keep_t *k)
{
	if (!srv || !k || --k->refs)
		return;
	for (rw_ipc_keep_t **kp = &srv->keeps; *kp; kp = &(*kp)->next)
		if (*kp == k) {
			*kp = k->next;
			break;
		}
	if (k->client)
		k->client->keep = NULL;
	for (unsigned i = 0; k->client && i < k->n_maps; i++)
		rw_cuda_ipc_release(srv->cuda, k->maps[i], k->conn);
	if (!k->client) /* it left: every reference its connection held */
		rw_cuda_ipc_release_owner(srv->cuda, k->conn);
	free(k->maps);
	free(k);
}

static void buf_release(rw_ipc_client_t *c, buf_slot_t *b)
{
	if (b->pub.kind == RW_IPC_BUF_HOST && b->map)
		munmap(b->map, b->pub.size);
	/* Kept: its reference goes with the keep's last drop (rw_ipc_keep_drop); one that cannot
	 * be noted stays until the import cache closes, never closed under a copy */
	rw_ipc_keep_t *k = c->keep;
	if (b->pub.kind == RW_IPC_BUF_CUDA && b->cuda_map && !k)
		rw_cuda_ipc_release(c->srv->cuda, b->cuda_map, c->info.id);
	if (b->pub.kind == RW_IPC_BUF_CUDA && b->cuda_map && k && k->client) {
		rw_cuda_ipc_map_t **m = realloc(k->maps, (k->n_maps + 1) * sizeof(*m));
		if (m) {
			m[k->n_maps++] = b->cuda_map;
			k->maps = m;
		}
	}
	memset(b, 0, sizeof(*b));
	c->nbufs--;
	c->srv->stats.buffers--;
}

static void reply_reg_ok(rw_ipc_client_t *c, uint32_t seq, buf_slot_t *b)
{
	rw_ipc_reg_ok_t ok;
	memset(&ok, 0, sizeof(ok));
	ipc_hdr_init(&ok.hdr, RW_IPC_REG_OK, seq);
	ok.buf_id = b->pub.id;
	ok.size = b->pub.size;
	if (ipc_send_msg(c, &ok, sizeof(ok), NULL, 0) == 0 && c->srv->ops.buffer_registered)
		c->srv->ops.buffer_registered(c->srv->ctx, c, &b->pub);
}

/* The memfd in *fd_p is the client's: checked (regular, sealable, sealed against shrinking so a
 * later ftruncate cannot turn our mapping into SIGBUS, size equal to what it claims), mapped,
 * then closed by the caller (the mapping keeps the memory). */
static int handle_reg_host(rw_ipc_client_t *c, const rw_ipc_reg_host_t *req, int fd)
{
	uint32_t seq = req->hdr.seq;
	rw_ipc_server_t *srv = c->srv;
	if (c->nbufs >= srv->lim.max_buffers)
		return ipc_send_error(c, seq, RW_E_BUF_LIMIT, "too many buffers registered", 0);
	if (req->size == 0 || req->size > srv->lim.max_buffer_bytes || req->size > SIZE_MAX)
		return ipc_send_error(c, seq, RW_E_BUF_SIZE, "buffer size zero or above the limit", 0);
	struct stat st;
	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))
		return ipc_send_error(c, seq, RW_E_BUF_FD, "fd is not a regular file (memfd)", 0);
	int seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0)
		return ipc_send_error(c, seq, RW_E_BUF_FD, "fd is not a sealable memfd", 0);
	if (!(seals & F_SEAL_SHRINK))
		return ipc_send_error(c, seq, RW_E_BUF_SEAL, "memfd not sealed with F_SEAL_SHRINK", 0);
	if ((uint64_t)st.st_size != req->size)
		return ipc_send_error(c, seq, RW_E_BUF_SIZE, "size does not match the memfd (fstat)", 0);
	void *map = mmap(NULL, req->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED)
		return ipc_send_error(c, seq, RW_E_BUF_FD, "memfd cannot be mapped read/write", 0);
	buf_slot_t *b = buf_alloc_slot(c);
	b->pub.kind = RW_IPC_BUF_HOST;
	b->pub.size = req->size;
	b->pub.host = map;
	b->pub.device = -1;
	b->map = map;
	b->id = b->pub.id;
	c->nbufs++;
	srv->stats.buffers++;
	reply_reg_ok(c, seq, b);
	return 0;
}

static int handle_reg_cuda(rw_ipc_client_t *c, const rw_ipc_reg_cuda_t *req)
{
	uint32_t seq = req->hdr.seq;
	rw_ipc_server_t *srv = c->srv;
	if (c->nbufs >= srv->lim.max_buffers)
		return ipc_send_error(c, seq, RW_E_BUF_LIMIT, "too many buffers registered", 0);
	uint64_t end;
	if (req->bytes == 0 || req->bytes > srv->lim.max_buffer_bytes ||
	    __builtin_add_overflow(req->offset, req->bytes, &end) || end > req->alloc_bytes)
		return ipc_send_error(c, seq, RW_E_BUF_SIZE,
				  "cuda range empty, above the limit or outside its allocation", 0);
	if (!ipc_cuda_ready(srv))
		return ipc_send_error(c, seq, RW_E_NO_CUDA, "the daemon has no usable CUDA driver", 0);
	rw_cuda_ipc_desc_t desc;
	memset(&desc, 0, sizeof(desc));
	memcpy(desc.handle.bytes, req->ipc_handle, sizeof(desc.handle.bytes));
	desc.buffer_id = req->alloc_id;
	desc.alloc_bytes = req->alloc_bytes;
	desc.offset = req->offset;
	desc.bytes = req->bytes;
	memcpy(desc.device_uuid, req->device_uuid, sizeof(desc.device_uuid));
	rw_cuda_ipc_map_t *map = NULL;
	rw_cuda_dptr_t dptr = 0;
	/* Connections of one process share its imports (two Groups lending one allocator segment) */
	rw_cuda_ipc_owner_t owner = {
		.conn = c->info.id, .pid = (int32_t)c->info.pid, .start_time = c->start_time};
	rw_status_t st = rw_cuda_ipc_import(srv->cuda, &desc, &owner, &map, &dptr);
	switch (st) {
	case RW_OK: break;
	case RW_ERR_INVAL:
		return ipc_send_error(c, seq, RW_E_BUF_SIZE, "cuda sizes disagree with the driver", 0);
	case RW_ERR_NOTFOUND:
		return ipc_send_error(c, seq, RW_E_CUDA, "no device with that UUID on this node", 0);
	case RW_ERR_EXISTS:
		return ipc_send_error(c, seq, RW_E_CUDA, "handle still mapped for another allocation "
				  "or another process (stale)", 0);
	case RW_ERR_UNSUPPORTED:
		return ipc_send_error(c, seq, RW_E_NO_CUDA, "the daemon has no usable CUDA driver", 0);
	case RW_ERR_NOMEM:
		return ipc_send_error(c, seq, RW_E_CUDA, "daemon out of memory importing the handle", 0);
	default:
		return ipc_send_error(c, seq, RW_E_CUDA, "the driver refused the IPC handle", 0);
	}
	buf_slot_t *b = buf_alloc_slot(c);
	b->pub.kind = RW_IPC_BUF_CUDA;
	b->pub.size = req->bytes;
	b->pub.dptr = dptr;
	b->pub.device = rw_cuda_ipc_map_device(map);
	b->cuda_map = map;
	b->id = b->pub.id;
	c->nbufs++;
	srv->stats.buffers++;
	reply_reg_ok(c, seq, b);
	return 0;
}

static int handle_dereg(rw_ipc_client_t *c, const rw_ipc_dereg_t *req)
{
	buf_slot_t *b = ipc_buf_find(c, req->buf_id);
	if (!b)
		return ipc_send_error(c, req->hdr.seq, RW_E_BUF_ID, "deregister: unknown buffer id", 0);
	if (c->reserved)
		return ipc_send_error(c, req->hdr.seq, RW_E_BUF_BUSY,
				  "deregister while submissions are in flight", 0);
	if (ipc_event_of_buf(c, req->buf_id))
		return ipc_send_error(c, req->hdr.seq, RW_E_BUF_BUSY, "deregister: the buffer holds a "
				      "registered event's completion flag (deregister the event first)", 0);
	buf_release(c, b);
	return ipc_reply_dereg_ok(c, req);
}

/* ---------------------------------------------------------------------------------------------
 * Control messages
 * ------------------------------------------------------------------------------------------- */

/* One received datagram. fds[] are owned by the caller, which closes every entry still >= 0
 * afterwards: handlers never need to close one on an error path. */
static int handle_message(rw_ipc_client_t *c, const void *buf, size_t len, int flags, int *fds,
			   unsigned nfds, int bad_cmsg)
{
	rw_ipc_msg_t msg;
	const char *why;
	uint32_t seq = 0;
	if (len >= sizeof(rw_ipc_hdr_t))
		memcpy(&seq, (const uint8_t *)buf + offsetof(rw_ipc_hdr_t, seq), sizeof(seq));
	if (bad_cmsg)
		return ipc_send_error(c, seq, RW_E_FDS, "control data other than SCM_RIGHTS", !c->joined);
	int code = rw_ipc_parse_request(buf, len, flags, nfds, &msg, &why);
	if (code)
		return ipc_send_error(c, seq, code, why, !c->joined || rw_ipc_error_is_fatal(code));
	if (!c->joined && msg.hdr.type != RW_IPC_HELLO && msg.hdr.type != RW_IPC_GOODBYE)
		return ipc_send_error(c, seq, RW_E_STATE, "first message must be hello", 1);
	switch (msg.hdr.type) {
	case RW_IPC_HELLO:
		if (c->joined)
			return ipc_send_error(c, seq, RW_E_STATE, "hello twice", 0);
		return ipc_handle_hello(c, &msg.hello);
	case RW_IPC_REG_HOST: return handle_reg_host(c, &msg.reg_host, fds[0]);
	case RW_IPC_REG_CUDA: return handle_reg_cuda(c, &msg.reg_cuda);
	case RW_IPC_DEREG: return handle_dereg(c, &msg.dereg);
	case RW_IPC_REG_EVENT: return ipc_handle_reg_event(c, &msg.reg_event);
	case RW_IPC_DEREG_EVENT: return ipc_handle_dereg_event(c, &msg.dereg);
	case RW_IPC_RING_SETUP: return ipc_ring_setup(c, &msg.ring_setup);
	case RW_IPC_PAGE_SETUP: return ipc_page_setup(c, &msg.page_setup);
	case RW_IPC_SLAB_SETUP: return ipc_slab_setup(c, &msg.slab_setup);
	case RW_IPC_GOODBYE: ipc_client_kill(c, RW_IPC_LEFT_GOODBYE, 0); return 0;
	}
	return 0;
}

static void client_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_ipc_client_t *c = w->data;
	for (int burst = 0; burst < RECV_BURST && !c->dying; burst++) {
		rw_ipc_msg_t raw;
		union {
			char buf[CMSG_SPACE(sizeof(int) * RW_IPC_MAX_FDS)];
			struct cmsghdr align;
		} cbuf;
		struct iovec iov = {.iov_base = &raw, .iov_len = sizeof(raw)};
		struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.buf,
				    .msg_controllen = sizeof(cbuf.buf)};
		ssize_t n = recvmsg(c->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (n < 0) {
			if (errno != ECONNRESET)
				rw_warn("ipc client %u: recv: %m", c->info.id);
			ipc_client_kill(c, RW_IPC_LEFT_EOF, 0);
			return;
		}
		int fds[RW_IPC_MAX_FDS];
		unsigned nfds = 0;
		int bad_cmsg = 0;
		for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
			if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) {
				bad_cmsg = 1;
				continue;
			}
			size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			for (size_t i = 0; i < k; i++) {
				int fd;
				memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(fd));
				if (nfds < RW_IPC_MAX_FDS)
					fds[nfds++] = fd;
				else /* cannot happen with our cmsg space; be safe */
					ipc_fd_discard(c->srv, fd);
			}
		}
		/* 0 bytes is end-of-file, or an empty datagram that SOCK_SEQPACKET cannot tell from
		 * it: either way the connection ends (after closing any fds the datagram carried). */
		if (n == 0)
			ipc_client_kill(c, RW_IPC_LEFT_EOF, 0);
		else
			handle_message(c, &raw, (size_t)n, mh.msg_flags, fds, nfds, bad_cmsg);
		for (unsigned i = 0; i < nfds; i++) /* never close() here: server_close.c */
			if (fds[i] >= 0)
				ipc_fd_discard(c->srv, fds[i]);
	}
}

/* ---------------------------------------------------------------------------------------------
 * Connections
 * ------------------------------------------------------------------------------------------- */

/* Free everything a client holds. Only from the prepare watcher or destroy: never while a
 * callback for this client is on the stack. */
static void client_free(rw_ipc_client_t *c)
{
	rw_ipc_server_t *srv = c->srv;
	if (c->joined) {
		if (srv->ops.client_left)
			srv->ops.client_left(srv->ctx, c, c->leave_reason, c->leave_error);
		if (rw_ipc_log_churn(srv))
			rw_info("ipc client %u left: group %s rank %u (pid %d uid %d gid %d): %s%s%s",
				c->info.id, c->info.group, c->info.rank, (int)c->info.pid, (int)c->info.uid,
				(int)c->info.gid, rw_ipc_leave_str(c->leave_reason),
				c->leave_error ? ": " : "",
				c->leave_error ? rw_client_strerror(c->leave_error) : "");
	}
	ipc_group_leave(c);
	if (c->on_flush_list) /* e.g. completed, then dropped, by another client's client_left */
		for (rw_ipc_client_t **pp = &srv->flush; *pp; pp = &(*pp)->flush_next)
			if (*pp == c) {
				*pp = c->flush_next;
				break;
			}
	if (c->keep) /* its CUDA references stay the keep's */
		c->keep->client = NULL;
	if (c->bufs) {
		for (uint32_t i = 0; i < srv->lim.max_buffers; i++)
			if (c->bufs[i].id)
				buf_release(c, &c->bufs[i]);
		free(c->bufs);
	}
	ipc_events_free(c);
	ipc_rings_free(c);
	ipc_page_free(c);
	close(c->fd);
	if (c->prev)
		c->prev->next = c->next;
	else
		srv->clients = c->next;
	if (c->next)
		c->next->prev = c->prev;
	srv->nclients--;
	srv->stats.clients--;
	free(c);
}

static void reap(rw_ipc_server_t *srv)
{
	while (srv->reap) {
		rw_ipc_client_t *c = srv->reap;
		srv->reap = c->reap_next;
		client_free(c); /* client_left may drop others: they join srv->reap */
	}
}

void rw_ipc_server_flush(rw_ipc_server_t *srv)
{
	while (srv->flush) {
		rw_ipc_client_t *c = srv->flush;
		srv->flush = c->flush_next;
		c->on_flush_list = 0;
		ipc_flush_client(c);
	}
}

static void prepare_cb(struct ev_loop *loop, ev_prepare *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_ipc_server_t *srv = w->data;
	rw_ipc_server_flush(srv);
	reap(srv);
	ipc_pages_prepare(srv);
}

static void accept_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	rw_ipc_server_t *srv = w->data;
	for (;;) {
		int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (!rw_listen_pause_on(&srv->accept_pause, errno) && errno != EAGAIN &&
			    errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
				rw_warn("ipc: accept: %m");
			return;
		}
		rw_ipc_client_t *c = ipc_admit(srv, fd);
		if (!c)
			continue;
		c->next = srv->clients;
		if (srv->clients)
			srv->clients->prev = c;
		srv->clients = c;
		srv->nclients++;
		srv->stats.clients++;
		srv->stats.accepted++;
		if (rw_ipc_log_churn(srv))
			rw_info("ipc client %u connected: pid %d uid %d gid %d", c->info.id,
				(int)c->info.pid, (int)c->info.uid, (int)c->info.gid);
		ev_io_init(&c->io, client_cb, fd, EV_READ);
		c->io.data = c;
		ev_io_start(loop, &c->io);
		ev_timer_init(&c->hello_timer, ipc_hello_timeout_cb,
			      (double)srv->cfg.hello_timeout_ms / 1000.0, 0.);
		c->hello_timer.data = c;
		ev_timer_start(loop, &c->hello_timer);
	}
}

/* ---------------------------------------------------------------------------------------------
 * Server
 * ------------------------------------------------------------------------------------------- */

/* A socket file already at `path`: refuse if a daemon answers there, replace it if stale, and
 * never delete something that is not a socket. */
static rw_status_t clear_stale_socket(const struct sockaddr_un *addr)
{
	struct stat st;
	if (lstat(addr->sun_path, &st) < 0)
		return errno == ENOENT ? RW_OK : RW_ERR_SYS;
	if (!S_ISSOCK(st.st_mode)) {
		rw_err("ipc: %s exists and is not a socket", addr->sun_path);
		return RW_ERR_EXISTS;
	}
	int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (probe < 0)
		return RW_ERR_SYS;
	int live = connect(probe, (const struct sockaddr *)addr, sizeof(*addr)) == 0;
	close(probe);
	if (live) {
		rw_err("ipc: a daemon already listens on %s", addr->sun_path);
		return RW_ERR_EXISTS;
	}
	if (unlink(addr->sun_path) < 0 && errno != ENOENT)
		return RW_ERR_SYS;
	return RW_OK;
}

static rw_status_t group_id(const char *group, gid_t *gid_p)
{
	struct group grp, *found = NULL;
	char buf[4096];
	if (getgrnam_r(group, &grp, buf, sizeof(buf), &found) != 0 || !found) {
		rw_err("ipc: group %s (ipc_group) does not exist on this host", group);
		return RW_ERR_INVAL;
	}
	*gid_p = found->gr_gid;
	return RW_OK;
}

rw_status_t rw_ipc_socket_dir(const char *socket_path, const char *group)
{
	char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
	if (!socket_path || strlen(socket_path) >= sizeof(dir))
		return RW_ERR_INVAL;
	strcpy(dir, socket_path);
	char *slash = strrchr(dir, '/');
	if (!slash || slash == dir)
		return RW_OK; /* relative name or a file in / : nothing to create */
	*slash = '\0';
	gid_t gid = (gid_t)-1;
	rw_status_t st;
	if (group && *group && (st = group_id(group, &gid)) != RW_OK)
		return st;
	struct stat sb;
	if (stat(dir, &sb) == 0) {
		if ((sb.st_mode & S_IWOTH) && !(sb.st_mode & S_ISVTX))
			rw_warn("ipc: %s is writable by every user without the sticky bit: anyone "
				"can replace the sockets in it", dir);
		return RW_OK;
	}
	if (mkdir(dir, gid == (gid_t)-1 ? 0755 : 0750) != 0 && errno != EEXIST) {
		rw_err("ipc: cannot create %s: %m", dir);
		return RW_ERR_SYS;
	}
	/* chown, then chmod: mkdir's mode went through the umask. */
	if ((gid != (gid_t)-1 && chown(dir, (uid_t)-1, gid) != 0) ||
	    chmod(dir, gid == (gid_t)-1 ? 0755 : 0750) != 0) {
		rw_err("ipc: chown/chmod %s%s%s: %m", dir, gid == (gid_t)-1 ? "" : " to group ",
		       gid == (gid_t)-1 ? "" : group);
		return RW_ERR_SYS;
	}
	return RW_OK;
}

static rw_status_t listen_socket(rw_ipc_server_t *srv)
{
	const rw_ipc_server_config_t *cfg = &srv->cfg;
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	if (strlen(cfg->socket_path) >= sizeof(addr.sun_path)) {
		rw_err("ipc: socket path too long: %s", cfg->socket_path);
		return RW_ERR_INVAL;
	}
	strcpy(addr.sun_path, cfg->socket_path);
	gid_t gid = (gid_t)-1;
	rw_status_t st;
	if (cfg->group && *cfg->group && (st = group_id(cfg->group, &gid)) != RW_OK)
		return st;
	if ((st = rw_ipc_socket_dir(cfg->socket_path, cfg->group)) != RW_OK)
		return st;
	st = clear_stale_socket(&addr);
	if (st != RW_OK)
		return st;
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		rw_err("ipc: socket: %m");
		return RW_ERR_SYS;
	}
	/* Create the file owner-only, so nobody can connect between bind and chmod. umask is
	 * process-wide: the daemon creates its server before it starts other threads. */
	mode_t old = umask(0177);
	int rc = bind(fd, (struct sockaddr *)&addr, sizeof(addr));
	umask(old);
	if (rc < 0) {
		rw_err("ipc: bind %s: %m", addr.sun_path);
		goto fail_close;
	}
	if (gid != (gid_t)-1 && chown(addr.sun_path, (uid_t)-1, gid) < 0) {
		rw_err("ipc: chown %s to group %s: %m", addr.sun_path, cfg->group);
		goto fail_unlink;
	}
	if (chmod(addr.sun_path, cfg->mode) < 0) {
		rw_err("ipc: chmod %s: %m", addr.sun_path);
		goto fail_unlink;
	}
	if (listen(fd, 128) < 0) {
		rw_err("ipc: listen %s: %m", addr.sun_path);
		goto fail_unlink;
	}
	srv->listen_fd = fd;
	return RW_OK;
fail_unlink:
	unlink(addr.sun_path);
fail_close:
	close(fd);
	return RW_ERR_SYS;
}

#define DEFAULT(field, value) \
	do { if (!cfg.field) cfg.field = (value); } while (0)

rw_status_t rw_ipc_server_create(struct ev_loop *loop, const rw_ipc_server_config_t *config,
				 const rw_ipc_server_ops_t *ops, void *ctx,
				 rw_ipc_server_t **server_p)
{
	if (!loop || !config || !config->socket_path || !ops || !ops->submission || !server_p)
		return RW_ERR_INVAL;
	rw_ipc_server_config_t cfg = *config;
	DEFAULT(mode, 0660);
	DEFAULT(max_clients, 256);
	DEFAULT(max_buffers, 64);
	DEFAULT(max_buffer_bytes, 1ull << 40);
	DEFAULT(max_tokens, 1u << 20);
	DEFAULT(max_hidden, 65536);
	DEFAULT(max_topk, 64);
	DEFAULT(max_ring_entries, 4096);
	DEFAULT(max_world, 1u << 20);
	DEFAULT(max_local_gpu, 64);
	DEFAULT(max_experts, 1u << 20);
	DEFAULT(max_events, 16);
	DEFAULT(max_per_uid, 64);
	DEFAULT(hello_timeout_ms, 5000);
	if (cfg.max_buffers > MAX_BUFFER_SLOTS || cfg.max_events > MAX_EVENT_SLOTS || cfg.max_ring_entries > (1u << 20) ||
	    cfg.max_topk > 0xffff || cfg.mode > 0777) {
		rw_err("ipc: server limits out of range");
		return RW_ERR_INVAL;
	}
	rw_ipc_server_t *srv = calloc(1, sizeof(*srv));
	if (!srv)
		return RW_ERR_NOMEM;
	if (sodium_init() < 0) { /* idempotent; fails only without a randomness source */
		rw_err("ipc: libsodium could not initialise");
		free(srv);
		return RW_ERR_SYS;
	}
	randombytes_buf(srv->key_salt, sizeof(srv->key_salt));
	srv->socket_path = strdup(cfg.socket_path);
	if (!srv->socket_path) {
		free(srv);
		return RW_ERR_NOMEM;
	}
	cfg.socket_path = srv->socket_path;
	cfg.group = NULL; /* used only while binding */
	srv->loop = loop;
	srv->cfg = cfg;
	srv->ops = *ops;
	srv->ctx = ctx;
	srv->node = cfg.node;
	srv->listen_fd = -1;
	srv->lim = (rw_ipc_limits_t){
		.max_buffers = cfg.max_buffers,
		.max_buffer_bytes = cfg.max_buffer_bytes,
		.max_tokens = cfg.max_tokens,
		.max_hidden = cfg.max_hidden,
		.max_topk = cfg.max_topk,
		.max_ring_entries = cfg.max_ring_entries,
		.max_world = cfg.max_world,
		.max_local_gpu = cfg.max_local_gpu,
		.max_experts = cfg.max_experts,
		.max_events = cfg.max_events,
		.dtypes = cfg.dtypes ? cfg.dtypes : UINT32_MAX,
	};
	rw_status_t st = ipc_closer_start(srv);
	if (st == RW_OK && (st = ipc_pages_start(srv)) != RW_OK)
		ipc_closer_stop(srv);
	if (st != RW_OK) {
		free(srv->socket_path);
		free(srv);
		return st;
	}
	srv->cfg.group = config->group;
	st = listen_socket(srv);
	srv->cfg.group = NULL;
	if (st != RW_OK) {
		ipc_pages_stop(srv);
		ipc_closer_stop(srv);
		free(srv->socket_path);
		free(srv);
		return st;
	}
	ev_io_init(&srv->accept_io, accept_cb, srv->listen_fd, EV_READ);
	srv->accept_io.data = srv;
	rw_listen_pause_init(&srv->accept_pause, loop, &srv->accept_io, "ipc socket");
	ev_io_start(loop, &srv->accept_io);
	ev_prepare_init(&srv->prepare, prepare_cb);
	srv->prepare.data = srv;
	ev_prepare_start(loop, &srv->prepare);
	ev_idle_init(&srv->idle, ipc_ring_idle_cb);
	srv->idle.data = srv;
	rw_info("ipc: listening on %s (mode %04o%s%s; group keys %s, at most %u connections per "
		"uid, hello within %u ms)", srv->socket_path, cfg.mode,
		config->group ? ", group " : "", config->group ? config->group : "",
		cfg.require_group_key ? "required" : "optional", cfg.max_per_uid,
		cfg.hello_timeout_ms);
	*server_p = srv;
	return RW_OK;
}

void rw_ipc_server_destroy(rw_ipc_server_t *srv)
{
	if (!srv)
		return;
	rw_ipc_server_flush(srv); /* the last answers (the daemon's "stopping") reach the ranks */
	for (rw_ipc_client_t *c = srv->clients; c; c = c->next)
		ipc_client_kill(c, RW_IPC_LEFT_SHUTDOWN, 0);
	reap(srv);
	ev_io_stop(srv->loop, &srv->accept_io);
	rw_listen_pause_stop(&srv->accept_pause);
	ev_prepare_stop(srv->loop, &srv->prepare);
	ev_idle_stop(srv->loop, &srv->idle);
	close(srv->listen_fd);
	unlink(srv->socket_path);
	ipc_pages_stop(srv);
	ipc_closer_stop(srv);
	unsigned kept = 0; /* keeps never dropped: their copies may still run */
	for (rw_ipc_keep_t *k = srv->keeps, *nx; k; k = nx) {
		nx = k->next;
		kept++;
		free(k->maps);
		free(k);
	}
	if (srv->cuda && kept) /* every client is gone: what the cache maps is the keeps' */
		rw_cuda_ipc_cache_leave(srv->cuda);
	else if (srv->cuda)
		rw_cuda_ipc_cache_destroy(srv->cuda);
	free(srv->socket_path);
	free(srv);
}

/* ---------------------------------------------------------------------------------------------
 * Service-facing calls
 * ------------------------------------------------------------------------------------------- */

rw_status_t rw_ipc_complete(rw_ipc_server_t *srv, rw_ipc_client_t *c, const rw_cqe_t *cqe)
{
	if (c->dying || !c->rings_up || c->reserved == 0)
		return RW_ERR_STATE;
	c->reserved--;
	ipc_push_cqe(c, cqe);
	(void)srv;
	return RW_OK;
}

rw_status_t rw_ipc_buffer_lookup(const rw_ipc_client_t *c, uint32_t buf_id, rw_ipc_buffer_t *buf_p)
{
	const buf_slot_t *b = ipc_buf_find(c, buf_id);
	if (!b)
		return RW_ERR_NOTFOUND;
	*buf_p = b->pub;
	return RW_OK;
}

void rw_ipc_client_drop(rw_ipc_server_t *srv, rw_ipc_client_t *c, int error)
{
	if (c->dying)
		return;
	srv->stats.dropped++;
	ipc_client_kill(c, RW_IPC_LEFT_DROPPED, error);
}

const rw_ipc_client_info_t *rw_ipc_client_info(const rw_ipc_client_t *c) { return &c->info; }
void rw_ipc_client_set_data(rw_ipc_client_t *c, void *data) { c->data = data; }
void *rw_ipc_client_data(const rw_ipc_client_t *c) { return c->data; }

void rw_ipc_server_stats(const rw_ipc_server_t *srv, rw_ipc_server_stats_t *stats_p)
{
	*stats_p = srv->stats;
}

const rw_ipc_client_t *rw_ipc_server_next_client(const rw_ipc_server_t *srv,
						 const rw_ipc_client_t *prev)
{
	const rw_ipc_client_t *c = prev ? prev->next : srv->clients;
	while (c && c->dying)
		c = c->next;
	return c;
}

int rw_ipc_client_joined(const rw_ipc_client_t *c) { return c->joined; }
int rw_ipc_client_leaving(const rw_ipc_client_t *c) { return c->dying; }
