/* A peer control connection's bytes (docs/dataflow.md "Peer mesh"): framed messages queued and
 * flushed without blocking, frames read back as untrusted input, a BYE looked for without
 * consuming. These functions return what happened; mesh.c decides what it means for the peer. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "service/mesh/mesh_int.h"

mesh_ctl_t *mesh_ctl_new(rw_svc_mesh_t *m, int fd, int peer, mesh_io_cb_t io_cb)
{
	mesh_ctl_t *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->mesh = m;
	c->fd = fd;
	c->peer = peer;
	c->opened_ns = rw_now_ns();
	ev_io_init(&c->io, io_cb, fd, EV_READ);
	c->io.data = c;
	return c;
}

void mesh_ctl_free(mesh_ctl_t *c)
{
	if (!c)
		return;
	ev_io_stop(c->mesh->loop, &c->io);
	if (c->fd >= 0)
		close(c->fd);
	free(c->rx);
	free(c->tx);
	free(c);
}

void mesh_unknown_remove(rw_svc_mesh_t *m, mesh_ctl_t *c)
{
	for (mesh_ctl_t **pp = &m->unknown; *pp; pp = &(*pp)->next)
		if (*pp == c) {
			*pp = c->next;
			c->next = NULL;
			if (!c->member_src)
				m->n_unknown--;
			return;
		}
}

void mesh_ctl_update_events(mesh_ctl_t *c)
{
	int ev = EV_READ | (c->connecting || c->tx_off < c->tx_len ? EV_WRITE : 0);
	if (!ev_is_active(&c->io) || (c->io.events & (EV_READ | EV_WRITE)) != ev) {
		ev_io_stop(c->mesh->loop, &c->io);
		ev_io_set(&c->io, c->fd, ev);
		ev_io_start(c->mesh->loop, &c->io);
	}
}

int mesh_ctl_flush(mesh_ctl_t *c)
{
	while (c->tx_off < c->tx_len) {
		ssize_t n = send(c->fd, c->tx + c->tx_off, c->tx_len - c->tx_off, MSG_NOSIGNAL);
		if (n < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK)
				break;
			if (errno == EINTR)
				continue;
			return -1;
		}
		c->tx_off += (size_t)n;
	}
	if (c->tx_off == c->tx_len)
		c->tx_off = c->tx_len = 0;
	mesh_ctl_update_events(c);
	return 0;
}

rw_status_t mesh_ctl_queue(mesh_ctl_t *c, uint16_t type, const uint8_t *payload, uint32_t len)
{
	size_t need = c->tx_len + RW_WIRE_HDR_SIZE + len;
	if (need > CTL_TX_MAX)
		return RW_ERR_AGAIN;
	if (need > c->tx_cap) {
		if (c->tx_off > 0) { /* compact first */
			memmove(c->tx, c->tx + c->tx_off, c->tx_len - c->tx_off);
			c->tx_len -= c->tx_off;
			c->tx_off = 0;
			need = c->tx_len + RW_WIRE_HDR_SIZE + len;
		}
		if (need > c->tx_cap) {
			size_t cap = c->tx_cap ? c->tx_cap : 512; /* a handshake's worth first */
			while (cap < need)
				cap *= 2;
			uint8_t *tx = realloc(c->tx, cap);
			if (!tx)
				return RW_ERR_NOMEM;
			c->tx = tx;
			c->tx_cap = cap;
		}
	}
	rw_wire_hdr_t h = { .type = type, .length = len, .seq = ++c->mesh->tx_seq };
	rw_wire_hdr_pack(&h, c->tx + c->tx_len);
	if (len)
		memcpy(c->tx + c->tx_len + RW_WIRE_HDR_SIZE, payload, len);
	c->tx_len += RW_WIRE_HDR_SIZE + len;
	return RW_OK;
}

/* Whether a BYE frame waits unread in c's socket, looked at without consuming anything (no
 * message is handled here, so no callback runs). Only between messages, which is where a
 * peer that stops is. */
int mesh_ctl_bye_pending(const mesh_ctl_t *c)
{
	uint8_t buf[4096];
	if (c->connecting || c->hdr_have) /* hdr_have = 0: no message half read */
		return 0;
	ssize_t n = recv(c->fd, buf, sizeof(buf), MSG_PEEK | MSG_DONTWAIT);
	for (ssize_t off = 0; n > 0 && off + RW_WIRE_HDR_SIZE <= n;) {
		rw_wire_hdr_t h;
		if (rw_wire_hdr_unpack(buf + off, &h) != RW_OK)
			return 0;
		if (h.type == RW_WIRE_BYE)
			return 1;
		off += RW_WIRE_HDR_SIZE + (ssize_t)h.length;
	}
	return 0;
}

int mesh_ctl_peer_closed(const mesh_ctl_t *c)
{
	if (c->connecting)
		return 0;
	struct pollfd pfd = { .fd = c->fd, .events = POLLIN | POLLRDHUP };
	return poll(&pfd, 1, 0) == 1 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* One recv into buf[0..want) (want > 0). Returns the bytes received; 0 when nothing is there
 * now (EAGAIN; EINTR is retried); -1 when the connection ended (*why_p says how). */
static ssize_t ctl_recv(mesh_ctl_t *c, void *buf, size_t want, const char **why_p)
{
	for (;;) {
		ssize_t n = recv(c->fd, buf, want, 0);
		if (n > 0)
			return n;
		if (n == 0) {
			*why_p = "connection closed";
			return -1;
		}
		if (errno == EINTR)
			continue;
		if (errno == EAGAIN || errno == EWOULDBLOCK)
			return 0;
		*why_p = "read error";
		return -1;
	}
}

int mesh_ctl_read_frame(mesh_ctl_t *c, rw_wire_hdr_t *h_p, uint8_t **payload_p, rw_status_t *st_p,
		   const char **why_p)
{
	*st_p = RW_ERR_PEER;
	for (;;) {
		if (c->hdr_have < RW_WIRE_HDR_SIZE) {
			ssize_t n = ctl_recv(c, c->hdr + c->hdr_have, RW_WIRE_HDR_SIZE - c->hdr_have, why_p);
			if (n <= 0)
				return (int)n;
			c->hdr_have += (uint32_t)n;
			if (c->hdr_have < RW_WIRE_HDR_SIZE)
				continue;
			if (rw_wire_hdr_unpack(c->hdr, &c->cur) != RW_OK) {
				*st_p = RW_ERR_PROTO;
				*why_p = "bad frame header (magic, version, type or length)";
				if (rw_wire_get32(c->hdr) == RW_WIRE_MAGIC &&
				    rw_wire_get16(c->hdr + 4) != RW_WIRE_VERSION) {
					snprintf(c->why, sizeof(c->why), "it speaks wire version %u, this "
						 "daemon %u: upgrade every node together",
						 rw_wire_get16(c->hdr + 4), RW_WIRE_VERSION);
					*why_p = c->why;
				}
				return -1;
			}
			/* Before it has proven the key a connection is nobody's: nothing but a
			 * HELLO and an AUTH of their fixed sizes is read, into the connection's own
			 * small buffer, so a stranger costs no allocation beyond its struct. */
			free(c->rx);
			c->rx = NULL;
			c->rx_have = 0;
			if (!c->authed) {
				if (!((c->cur.type == RW_WIRE_HELLO && c->cur.length == RW_WIRE_HELLO_SIZE) ||
				      (c->cur.type == RW_WIRE_AUTH && c->cur.length == RW_WIRE_AUTH_SIZE))) {
					*st_p = RW_ERR_PROTO;
					*why_p = "a frame other than a hello or a proof before authentication";
					return -1;
				}
			} else if (c->cur.length) {
				c->rx = malloc(c->cur.length);
				if (!c->rx) {
					*st_p = RW_ERR_NOMEM;
					*why_p = "out of memory";
					return -1;
				}
			}
		}
		uint8_t *into = c->rx ? c->rx : c->pre;
		if (c->rx_have < c->cur.length) {
			ssize_t n = ctl_recv(c, into + c->rx_have, c->cur.length - c->rx_have, why_p);
			if (n <= 0)
				return (int)n;
			c->rx_have += (uint32_t)n;
			if (c->rx_have < c->cur.length)
				continue;
		}
		c->hdr_have = 0;
		*h_p = c->cur;
		*payload_p = c->cur.length ? into : NULL;
		return 1;
	}
}
