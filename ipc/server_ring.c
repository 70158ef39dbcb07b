/* The daemon side of node-local IPC, the rings (docs/ipc.md "Rings"): a client's submission and
 * completion rings set up in shared memory, submissions drained and checked entry by entry (a
 * bad entry gets an error completion; a corrupt index drops the client), completions published,
 * and the polling that picks up submissions between eventfd kicks. Part of ipc/server.c's
 * server (ipc/server_int.h). */
#include "ipc/server_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#define DRAIN_BATCH 64 /* submissions taken per pass before the ring's tail is stored */

static void sq_cb(struct ev_loop *loop, ev_io *w, int revents);

void ipc_rings_free(rw_ipc_client_t *c)
{
	if (!c->rings_up)
		return;
	ev_io_stop(c->srv->loop, &c->sq_io);
	munmap(c->ring_map, c->ring_bytes);
	close(c->sq_efd);
	close(c->cq_efd);
	c->rings_up = 0;
	c->srv->stats.rings--;
}

/* The daemon makes the ring memory, so the client can neither size it wrong nor shrink it:
 * the memfd is sealed (no shrink, no grow, no new seals) before the client ever sees it. */
int ipc_ring_setup(rw_ipc_client_t *c, const rw_ipc_ring_setup_t *req)
{
	uint32_t seq = req->hdr.seq;
	rw_ipc_server_t *srv = c->srv;
	const char *why;
	if (c->rings_up)
		return ipc_send_error(c, seq, RW_E_RING_STATE, "rings already set up", 0);
	int code = rw_ipc_check_ring_setup(req, &srv->lim, &why);
	if (code)
		return ipc_send_error(c, seq, code, why, 0);

	rw_ipc_ring_ok_t ok;
	memset(&ok, 0, sizeof(ok));
	ipc_hdr_init(&ok.hdr, RW_IPC_RING_OK, seq);
	ok.sq_entries = req->sq_entries;
	ok.cq_entries = req->cq_entries;
	ok.sq_ctl_off = 0;
	ok.cq_ctl_off = RW_IPC_RING_CTL_BYTES;
	ok.sq_slots_off = 2 * RW_IPC_RING_CTL_BYTES;
	ok.cq_slots_off = ok.sq_slots_off + rw_ring_slots_bytes(req->sq_entries, sizeof(rw_sqe_t));
	ok.map_bytes = ok.cq_slots_off + rw_ring_slots_bytes(req->cq_entries, sizeof(rw_cqe_t));
	ok.sqe_size = sizeof(rw_sqe_t);
	ok.cqe_size = sizeof(rw_cqe_t);

	int memfd = -1, sq_efd = -1, cq_efd = -1;
	void *map = MAP_FAILED;
	memfd = memfd_create("railwave-rings", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (memfd < 0)
		goto fail;
	if (ftruncate(memfd, (off_t)ok.map_bytes) < 0 ||
	    fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
		goto fail;
	map = mmap(NULL, ok.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
	if (map == MAP_FAILED)
		goto fail;
	sq_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	cq_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (sq_efd < 0 || cq_efd < 0)
		goto fail;

	uint8_t *base = map;
	rw_ring_init(&c->sq, (rw_ring_ctl_t *)(base + ok.sq_ctl_off), base + ok.sq_slots_off,
		     ok.sq_entries, sizeof(rw_sqe_t), -1, 0);
	rw_ring_init(&c->cq, (rw_ring_ctl_t *)(base + ok.cq_ctl_off), base + ok.cq_slots_off,
		     ok.cq_entries, sizeof(rw_cqe_t), cq_efd, 1);
	/* The daemon starts asleep on the submission ring: the first submit wakes it. */
	atomic_store_explicit(&c->sq.ctl->armed, 1, memory_order_relaxed);

	int fds[3] = {memfd, sq_efd, cq_efd};
	c->ring_map = map;
	c->ring_bytes = ok.map_bytes;
	c->sq_efd = sq_efd;
	c->cq_efd = cq_efd;
	c->rings_up = 1;
	srv->stats.rings++;
	ev_io_init(&c->sq_io, sq_cb, sq_efd, EV_READ);
	c->sq_io.data = c;
	ev_io_start(srv->loop, &c->sq_io);
	ipc_send_msg(c, &ok, sizeof(ok), fds, 3);
	close(memfd); /* the mapping and the client's copy keep it */
	return 0;
fail:
	rw_err("ipc client %u: ring setup: %m", c->info.id);
	if (map != MAP_FAILED)
		munmap(map, ok.map_bytes);
	if (memfd >= 0)
		close(memfd);
	if (sq_efd >= 0)
		close(sq_efd);
	if (cq_efd >= 0)
		close(cq_efd);
	return ipc_send_error(c, seq, RW_E_INTERNAL, "daemon could not create the rings", 0);
}

void ipc_flush_client(rw_ipc_client_t *c)
{
	if (!c->rings_up || c->dying)
		return;
	uint32_t n = c->cq.local - c->cq.published;
	if (n == 0)
		return;
	c->srv->stats.completions += n;
	c->srv->stats.wakeups += (uint64_t)rw_ring_prod_publish(&c->cq);
}

void ipc_push_cqe(rw_ipc_client_t *c, const rw_cqe_t *cqe)
{
	memcpy(rw_ring_prod_next(&c->cq), cqe, sizeof(*cqe));
	rw_ring_prod_push(&c->cq);
	if (!c->on_flush_list) {
		c->on_flush_list = 1;
		c->flush_next = c->srv->flush;
		c->srv->flush = c;
	}
}

static void ring_corrupt(rw_ipc_client_t *c, const char *which)
{
	char why[96];
	snprintf(why, sizeof(why), "%s ring indices corrupted", which);
	ipc_send_error(c, 0, RW_E_RING_INDEX, why, 1);
	ipc_client_kill(c, RW_IPC_LEFT_PROTOCOL, RW_E_RING_INDEX); /* also if the send failed */
}

/* Take submissions off the ring while completion slots can be reserved for them. Returns the
 * number taken (>= 0), or -1 if the client was dropped. Sets cq_blocked when it stopped for lack
 * of completion slots with submissions still waiting. */
static int drain(rw_ipc_client_t *c)
{
	rw_ipc_server_t *srv = c->srv;
	int taken_total = 0;
	c->cq_blocked = 0;
	while (!c->dying) {
		int avail = rw_ring_cons_avail(&c->sq);
		if (avail < 0)
			return ring_corrupt(c, "submission"), -1;
		if (avail == 0)
			break;
		int space = rw_ring_prod_space(&c->cq, (uint32_t)c->reserved + 1);
		if (space < 0)
			return ring_corrupt(c, "completion"), -1;
		int room = space - (int)c->reserved;
		if (room <= 0) {
			c->cq_blocked = 1;
			break;
		}
		uint32_t take = (uint32_t)RW_MIN(RW_MIN(avail, room), DRAIN_BATCH);
		uint32_t i;
		for (i = 0; i < take && !c->dying; i++) {
			rw_sqe_t sqe; /* copy first: the client can rewrite the slot at any time */
			memcpy(&sqe, rw_ring_cons_peek(&c->sq, i), sizeof(sqe));
			const char *why;
			int code = rw_ipc_check_sqe(&sqe, &srv->lim, ipc_buf_size_of, c, &why);
			if (!code && (sqe.flags & (RW_SQE_WAIT_EVENT | RW_SQE_SIGNAL)) &&
			    !ipc_event_find(c, sqe.event_id)) {
				code = RW_E_EVENT;
				why = "stream-ordered submission names an event id this rank has not "
				      "registered";
			}
			if (code) {
				rw_ipc_signal_now(c, &sqe); /* the flag before the CQE, errors too */
				/* The reason first, as a notice (rw_client_last_message), then the
				 * completion, as the service answers a refused submission. */
				rw_ipc_client_notice(srv, c, code, why);
				rw_cqe_t cqe;
				memset(&cqe, 0, sizeof(cqe));
				cqe.status = RW_CQ_ERROR;
				cqe.error = code;
				cqe.kind = sqe.kind;
				cqe.phase_id = sqe.phase_id;
				cqe.user_data = sqe.user_data;
				cqe.counts_buf = RW_BUF_NONE;
				ipc_push_cqe(c, &cqe);
				srv->stats.rejected++;
				rw_dbg("ipc client %u: submission rejected: %s: %s", c->info.id,
				       rw_client_strerror(code), why);
				continue;
			}
			c->reserved++;
			srv->stats.submissions++;
			srv->ops.submission(srv->ctx, c, &sqe);
		}
		if (c->dying)
			return -1;
		rw_ring_cons_release(&c->sq, i);
		taken_total += (int)i;
	}
	if (c->dying)
		return -1;
	ipc_flush_client(c);
	return taken_total;
}

/* Drain, then either keep the client in the server's poll rotation or arm its eventfd. Returns
 * submissions taken, or -1 if the client was dropped. */
static int pump(rw_ipc_client_t *c)
{
	int total = 0;
	for (;;) {
		int n = drain(c);
		if (n < 0)
			return -1;
		total += n;
		if (c->cq_blocked) {
			/* Sleep until the client frees completion slots (it writes sq_efd). */
			int space = rw_ring_prod_arm_space(&c->cq);
			if (space < 0)
				return ring_corrupt(c, "completion"), -1;
			if (space > (int)c->reserved)
				continue;
			return total;
		}
		if (c->srv->polling)
			return total;
		int ready = rw_ring_cons_arm(&c->sq);
		if (ready < 0)
			return ring_corrupt(c, "submission"), -1;
		if (ready == 0)
			return total;
	}
}

static void start_polling(rw_ipc_server_t *srv)
{
	if (!srv->cfg.busy_poll_us)
		return;
	srv->poll_deadline_ns = rw_now_ns() + (uint64_t)srv->cfg.busy_poll_us * 1000u;
	if (!srv->polling) {
		srv->polling = 1;
		ev_idle_start(srv->loop, &srv->idle);
	}
}

static void sq_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_ipc_client_t *c = w->data;
	uint64_t count;
	while (read(c->sq_efd, &count, sizeof(count)) > 0) {
	}
	rw_ring_cons_disarm(&c->sq);
	start_polling(c->srv);
	pump(c);
}

/* Busy-poll phase: every client's submission ring, until none had work for busy_poll_us. Each
 * call spins a few rounds before returning to the loop, which then serves its other watchers
 * (without sleeping: an active idle watcher makes the loop poll with a zero timeout). */
void ipc_ring_idle_cb(struct ev_loop *loop, ev_idle *w, int revents)
{
	(void)revents;
	rw_ipc_server_t *srv = w->data;
	for (int spin = 0; spin < 64; spin++) {
		int progress = 0;
		for (rw_ipc_client_t *c = srv->clients; c; c = c->next)
			if (c->rings_up && !c->dying && pump(c) > 0)
				progress = 1;
		uint64_t now = rw_now_ns();
		if (progress) {
			srv->poll_deadline_ns = now + (uint64_t)srv->cfg.busy_poll_us * 1000u;
			return;
		}
		if (now >= srv->poll_deadline_ns)
			break;
	}
	if (rw_now_ns() < srv->poll_deadline_ns)
		return;
	srv->polling = 0;
	ev_idle_stop(loop, &srv->idle);
	for (rw_ipc_client_t *c = srv->clients; c; c = c->next)
		if (c->rings_up && !c->dying && pump(c) > 0)
			start_polling(srv); /* work arrived while arming: keep polling */
}

