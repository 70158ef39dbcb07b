/* ipc/server_event.c: stream order for the daemon side of node-local IPC (railwave.h
 * "Stream-ordered submission"; docs/ipc.md "Stream order"): a rank registers an interprocess
 * CUDA event with its completion flag (a 4-byte word of one of its CUDA buffers) and names it
 * by id in its submissions. Events are bounded per connection, imported on the flag's device,
 * and destroyed on deregistration or when the connection goes. The flag of a submission that
 * does not reach the mover (refused, failed) is written here, synchronously. */
#include "ipc/server_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const ipc_event_t *ipc_event_find(const rw_ipc_client_t *c, uint32_t id)
{
	uint32_t slot = id & (MAX_EVENT_SLOTS - 1);
	if (!c->events || id == 0 || slot >= c->srv->lim.max_events || c->events[slot].id != id)
		return NULL;
	return &c->events[slot];
}

const ipc_event_t *ipc_event_of_buf(const rw_ipc_client_t *c, uint32_t buf_id)
{
	for (uint32_t i = 0; c->events && i < c->srv->lim.max_events; i++)
		if (c->events[i].id && c->events[i].flag_buf == buf_id)
			return &c->events[i];
	return NULL;
}

static void event_release(rw_ipc_client_t *c, ipc_event_t *e)
{
	rw_cuda_event_destroy(e->ev);
	memset(e, 0, sizeof(*e));
	c->nevents--;
	c->srv->stats.events--;
}

void ipc_events_free(rw_ipc_client_t *c)
{
	for (uint32_t i = 0; c->events && i < c->srv->lim.max_events; i++)
		if (c->events[i].id)
			event_release(c, &c->events[i]);
	free(c->events);
	c->events = NULL;
}

/* The flag span: a CUDA buffer of this client, 4-byte aligned, the word inside it. */
static const char *flag_check(const rw_ipc_client_t *c, const rw_ipc_reg_event_t *req,
			      const buf_slot_t **b_p)
{
	const buf_slot_t *b = ipc_buf_find(c, req->flag_buf);
	if (!b)
		return "register event: the flag's buffer is not one this rank registered";
	if (b->pub.kind != RW_IPC_BUF_CUDA)
		return "register event: the flag's buffer is host memory (it must be CUDA memory, "
		       "where cuStreamWaitValue32 reads it)";
	if (req->flag_offset % 4)
		return "register event: the flag's offset is not a multiple of 4";
	if (req->flag_offset > b->pub.size || b->pub.size - req->flag_offset < 4)
		return "register event: the flag's 4 bytes are not inside its buffer";
	*b_p = b;
	return NULL;
}

int ipc_handle_reg_event(rw_ipc_client_t *c, const rw_ipc_reg_event_t *req)
{
	uint32_t seq = req->hdr.seq;
	rw_ipc_server_t *srv = c->srv;
	char why[RW_IPC_ERRMSG_MAX];
	if (!ipc_cuda_ready(srv))
		return ipc_send_error(c, seq, RW_E_NO_CUDA, "register event: the daemon has no usable "
				      "CUDA driver (stream-ordered submission needs one)", 0);
	const buf_slot_t *b = NULL;
	const char *bad = flag_check(c, req, &b);
	if (bad)
		return ipc_send_error(c, seq, RW_E_EVENT, bad, 0);
	if (c->nevents >= srv->lim.max_events) {
		snprintf(why, sizeof(why), "register event: this rank holds %u events, the limit",
			 c->nevents);
		return ipc_send_error(c, seq, RW_E_LIMIT, why, 0);
	}
	if (!c->events && !(c->events = calloc(srv->lim.max_events, sizeof(*c->events))))
		return ipc_send_error(c, seq, RW_E_INTERNAL, "daemon out of memory", 0);
	rw_cuda_event_t *ev = NULL;
	rw_status_t st = rw_cuda_event_import(b->pub.device, req->handle, &ev);
	if (st != RW_OK) {
		snprintf(why, sizeof(why), "register event: %s (GPU %d)",
			 st == RW_ERR_INVAL ? "the 64 bytes are not an interprocess event handle"
			 : st == RW_ERR_UNSUPPORTED ? "the driver has no interprocess events"
						    : "the driver could not open the event",
			 b->pub.device);
		return ipc_send_error(c, seq, st == RW_ERR_INVAL ? RW_E_EVENT : RW_E_CUDA, why, 0);
	}
	uint32_t slot = 0;
	while (c->events[slot].id)
		slot++;
	c->event_gen = c->event_gen % 1023u + 1; /* 1..1023: the id is never 0 */
	ipc_event_t *e = &c->events[slot];
	e->id = c->event_gen << 6 | slot;
	e->ev = ev;
	e->device = b->pub.device;
	e->flag_buf = b->pub.id;
	e->flag_dptr = b->pub.dptr + req->flag_offset;
	c->nevents++;
	srv->stats.events++;
	rw_ipc_reg_ok_t ok;
	memset(&ok, 0, sizeof(ok));
	ipc_hdr_init(&ok.hdr, RW_IPC_REG_OK, seq);
	ok.buf_id = e->id;
	ipc_send_msg(c, &ok, sizeof(ok), NULL, 0);
	return 0;
}

int ipc_handle_dereg_event(rw_ipc_client_t *c, const rw_ipc_dereg_t *req)
{
	ipc_event_t *e = (ipc_event_t *)ipc_event_find(c, req->buf_id);
	if (!e)
		return ipc_send_error(c, req->hdr.seq, RW_E_EVENT, "deregister event: unknown event id",
				      0);
	if (c->reserved)
		return ipc_send_error(c, req->hdr.seq, RW_E_BUF_BUSY,
				      "deregister event while submissions are in flight", 0);
	event_release(c, e);
	return ipc_reply_dereg_ok(c, req);
}

/* ---- service-facing ---- */

rw_status_t rw_ipc_event_lookup(const rw_ipc_client_t *c, uint32_t id, rw_ipc_event_t *ev_p)
{
	const ipc_event_t *e = ipc_event_find(c, id);
	if (!e)
		return RW_ERR_NOTFOUND;
	*ev_p = (rw_ipc_event_t){ .id = e->id, .device = e->device, .event = e->ev,
				  .flag_dptr = e->flag_dptr };
	return RW_OK;
}

void rw_ipc_signal_now(rw_ipc_client_t *c, const rw_sqe_t *sqe)
{
	if (!(sqe->flags & RW_SQE_SIGNAL))
		return;
	const ipc_event_t *e = ipc_event_find(c, sqe->event_id);
	if (!e)
		return; /* refused at the library (rw_client_submit): cannot happen for a good client */
	rw_status_t st = rw_cuda_write_u32(e->device, e->flag_dptr, sqe->output.reserved);
	if (st != RW_OK)
		rw_warn("ipc client %u: cannot write the completion flag of event %u (value %u): %s",
			c->info.id, e->id, sqe->output.reserved, rw_status_str(st));
	else
		c->srv->stats.flags_written++;
}
