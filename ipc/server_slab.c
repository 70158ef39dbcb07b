/* The daemon side of lending a group's slabs (docs/rankpath.md "The slab areas, lent per group";
 * docs/ipc.md "Protocol" SLAB_SETUP / SLAB_OK): a joined rank asks for its group's slab of one
 * rail and gets it as a sealed memfd with the offsets of the slab's four areas. The request
 * names a rail and nothing else: which group's slab is the service's answer for this client
 * (ops.group_slab), so a rank can be lent its own group's memory and never another's. Each rail's
 * slab is lent once per connection. Part of ipc/server.c's server (ipc/server_int.h). */
#include "ipc/server_int.h"

#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SLAB_SEALS (F_SEAL_SHRINK | F_SEAL_GROW)

int ipc_slab_setup(rw_ipc_client_t *c, const rw_ipc_slab_setup_t *req)
{
	const uint32_t seq = req->hdr.seq;
	rw_ipc_server_t *srv = c->srv;
	if (req->rail >= 64)
		return ipc_send_error(c, seq, RW_E_INVAL, "slab setup: no such rail", 0);
	if (c->slabs_lent >> req->rail & 1)
		return ipc_send_error(c, seq, RW_E_STATE, "slab setup: this rail's slab is already "
				      "lent to this connection", 0);
	if (!srv->ops.group_slab)
		return ipc_send_error(c, seq, RW_E_STATE, "this daemon lends no group slabs", 0);
	rw_ipc_slab_t slab;
	memset(&slab, 0, sizeof(slab));
	slab.fd = -1;
	const char *why = "slab setup refused";
	int code = srv->ops.group_slab(srv->ctx, c, req->rail, &slab, &why);
	if (code)
		return ipc_send_error(c, seq, code, why, 0);
	if (!slab.kind)
		slab.kind = RW_CLIENT_SLAB_HOST; /* a service that names no kind lends host memory */
	const int gpu = slab.kind == RW_CLIENT_SLAB_GPU;
	if (gpu && req->form != RW_IPC_SLAB_FORM_KINDS) {
		char why_gpu[RW_IPC_ERRMSG_MAX];
		snprintf(why_gpu, sizeof(why_gpu), "rail %u's slab is GPU memory: ask with slab form "
			 "%u (rw_client_group_slab_kind)", req->rail, RW_IPC_SLAB_FORM_KINDS);
		return ipc_send_error(c, seq, RW_E_STATE, why_gpu, 0);
	}
	/* What goes out is what the service says it is: a memfd of that size that cannot shrink
	 * under the rank's mapping, or an fd of a GPU allocation (opaque: only the driver can say
	 * more, and the rank's import does). */
	struct stat st;
	const int seals = gpu ? 0 : fcntl(slab.fd, F_GET_SEALS);
	if (gpu ? (slab.fd < 0 || fstat(slab.fd, &st) < 0 || slab.device < 0)
		: (slab.kind != RW_CLIENT_SLAB_HOST || fstat(slab.fd, &st) < 0 ||
		   (uint64_t)st.st_size != slab.bytes || seals < 0 ||
		   (seals & SLAB_SEALS) != SLAB_SEALS)) {
		rw_err("ipc: client=%u group=%s: rail %u's slab is not a sealed memfd of %llu bytes "
		       "nor a GPU allocation's fd", c->info.id, c->info.group, req->rail,
		       (unsigned long long)slab.bytes);
		return ipc_send_error(c, seq, RW_E_INTERNAL, "the daemon's slab is not lendable", 0);
	}
	rw_ipc_slab_ok_t ok;
	memset(&ok, 0, sizeof(ok));
	ipc_hdr_init(&ok.hdr, RW_IPC_SLAB_OK, seq);
	ok.bytes = slab.bytes;
	ok.rail = req->rail;
	ok.rails = slab.rails;
	ok.area_bytes = slab.area_bytes;
	memcpy(ok.recv_off, slab.recv_off, sizeof(ok.recv_off));
	memcpy(ok.send_off, slab.send_off, sizeof(ok.send_off));
	ok.local_off = slab.local_off;
	ok.kind = slab.kind;
	ok.device = gpu ? slab.device : -1;
	if (gpu)
		memcpy(ok.uuid, slab.uuid, sizeof(ok.uuid));
	c->slabs_lent |= 1ull << req->rail;
	const size_t len = req->form == RW_IPC_SLAB_FORM_KINDS ? sizeof(ok) : RW_IPC_SLAB_OK_BASE_BYTES;
	return ipc_send_msg(c, &ok, len, &slab.fd, 1); /* a failed send killed the client */
}
