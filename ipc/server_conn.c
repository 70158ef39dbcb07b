/* ipc/server_conn.c: what every part of the IPC server does to one connection — send a reply
 * (with fds), send an error reply (dropping the client when fatal), a best-effort notice, mark
 * a client dying for the reaper, look up a registered buffer — and the daemon's lazy CUDA
 * import cache. ipc/server.c (control messages, buffers, accept), server_auth.c, server_event.c
 * and server_ring.c use it; it calls none of them. */
#include "ipc/server_int.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "common/fdpass.h"

_Static_assert(RW_IPC_MAX_FDS <= RW_FDPASS_MAX, "a reply's fds fit one message");

/* ---------------------------------------------------------------------------------------------
 * Sending
 * ------------------------------------------------------------------------------------------- */

void ipc_hdr_init(rw_ipc_hdr_t *hdr, uint16_t type, uint32_t seq)
{
	memset(hdr, 0, sizeof(*hdr));
	hdr->magic = RW_IPC_MAGIC;
	hdr->version = RW_IPC_VERSION;
	hdr->type = type;
	hdr->seq = seq;
}

/* One datagram, never blocking. A client whose socket buffer is full is not reading its
 * replies (one per request): it is dropped rather than allowed to stall the loop. */
int ipc_send_msg(rw_ipc_client_t *c, const void *msg, size_t len, const int *fds,
		    unsigned nfds)
{
	ssize_t n = rw_fdpass_send(c->fd, msg, len, fds, nfds, MSG_DONTWAIT | MSG_NOSIGNAL);
	if (n == (ssize_t)len)
		return 0;
	if (n < 0 && errno != EPIPE && errno != ECONNRESET)
		rw_warn("ipc client %u: send: %m (dropping it)", c->info.id);
	ipc_client_kill(c, RW_IPC_LEFT_EOF, 0);
	return -1;
}

/* Returns 0 so handlers can `return ipc_send_error(...)`. */
int ipc_send_error(rw_ipc_client_t *c, uint32_t seq, int code, const char *why, int fatal)
{
	rw_ipc_server_t *srv = c->srv;
	srv->stats.errors_sent++;
	int log = rw_ipc_log_churn(srv); /* a refused hello per abandoned group, in bulk */
	if (log && c->joined)
		rw_warn("ipc client %u (group %s rank %u pid %d): %s: %s%s", c->info.id,
			c->info.group, c->info.rank, (int)c->info.pid, rw_client_strerror(code), why,
			fatal ? " (dropping it)" : "");
	else if (log)
		rw_warn("ipc client %u (pid %d uid %d): %s: %s%s", c->info.id, (int)c->info.pid,
			(int)c->info.uid, rw_client_strerror(code), why,
			fatal ? " (dropping it)" : "");
	rw_ipc_error_t err;
	memset(&err, 0, sizeof(err));
	ipc_hdr_init(&err.hdr, RW_IPC_ERROR, seq);
	err.code = code;
	err.fatal = fatal ? 1 : 0;
	snprintf(err.message, sizeof(err.message), "%s", why);
	ipc_send_msg(c, &err, sizeof(err), NULL, 0);
	if (fatal && !c->dying) {
		srv->stats.dropped++;
		ipc_client_kill(c, RW_IPC_LEFT_PROTOCOL, code);
	}
	return 0;
}

int ipc_reply_dereg_ok(rw_ipc_client_t *c, const rw_ipc_dereg_t *req)
{
	rw_ipc_dereg_t ok;
	memset(&ok, 0, sizeof(ok));
	ipc_hdr_init(&ok.hdr, RW_IPC_DEREG_OK, req->hdr.seq);
	ok.buf_id = req->buf_id;
	ipc_send_msg(c, &ok, sizeof(ok), NULL, 0);
	return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Buffers and CUDA
 * ------------------------------------------------------------------------------------------- */

buf_slot_t *ipc_buf_find(const rw_ipc_client_t *c, uint32_t id)
{
	if (!c->bufs || id == 0 || id == RW_BUF_NONE)
		return NULL;
	uint32_t slot = id & 0xff;
	if (slot >= c->srv->lim.max_buffers || c->bufs[slot].id != id)
		return NULL;
	return &c->bufs[slot];
}

uint64_t ipc_buf_size_of(void *ctx, uint32_t id)
{
	const buf_slot_t *b = ipc_buf_find(ctx, id);
	return b ? b->pub.size : 0;
}

int ipc_cuda_ready(rw_ipc_server_t *srv)
{
	if (srv->cuda_state == 0) {
		srv->cuda_state = -1;
		if (rw_cuda_init() != RW_OK)
			rw_info("ipc: CUDA buffers unavailable: %s", rw_cuda_unavailable_reason());
		else if (rw_cuda_ipc_cache_create(&srv->cuda) == RW_OK)
			srv->cuda_state = 1;
	}
	return srv->cuda_state == 1;
}

/* ---------------------------------------------------------------------------------------------
 * Dropping a client
 * ------------------------------------------------------------------------------------------- */

/* Stops its watchers and queues it for the reaper (server.c's prepare watcher): never freed
 * while a callback for it is on the stack. */
void ipc_client_kill(rw_ipc_client_t *c, rw_ipc_leave_t reason, int error)
{
	if (c->dying)
		return;
	rw_ipc_server_t *srv = c->srv;
	c->dying = 1;
	c->leave_reason = reason;
	c->leave_error = error;
	ev_io_stop(srv->loop, &c->io);
	ev_timer_stop(srv->loop, &c->hello_timer);
	if (c->rings_up)
		ev_io_stop(srv->loop, &c->sq_io);
	c->reap_next = srv->reap;
	srv->reap = c;
}

/* Service-facing (ipc/ipc.h). */
void rw_ipc_client_notice(rw_ipc_server_t *srv, rw_ipc_client_t *c, int code, const char *msg)
{
	(void)srv;
	if (c->dying || code >= 0)
		return;
	rw_ipc_error_t err;
	memset(&err, 0, sizeof(err));
	ipc_hdr_init(&err.hdr, RW_IPC_ERROR, 0);
	err.code = code;
	snprintf(err.message, sizeof(err.message), "%s", msg);
	/* Best effort: a full socket buffer means the client reads no notices; it still gets
	 * its completion, so the notice is dropped rather than the client. */
	ssize_t n;
	do
		n = send(c->fd, &err, sizeof(err), MSG_DONTWAIT | MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
}

int rw_ipc_log_churn(rw_ipc_server_t *srv)
{
	return rw_log_budget_take(&srv->churn_log, IPC_CHURN_LOG_PER_S,
				  "ipc connect/join/leave/refusal");
}
