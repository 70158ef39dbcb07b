/* Fake peer mesh and fake IPC server for tests/service/test_exec.c (see exec_fakes.h): one world
 * queue that the test pumps, link-time definitions of every rw_svc_mesh_* and rw_ipc_* function
 * the executor calls. Connections have generations: a link break (a killed node, a node declared
 * down) starts a new one, and whatever was posted on the old one is lost (messages) or fails
 * (writes), as a reset TCP connection or an RC QP in error does. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/rw_cuda.h"
#include "service/core/svc.h"
#include "ipc/proto.h"
#include "tests/service/exec_fakes.h"

fk_world_t *fk_world;

/* ---- world state ------------------------------------------------------------------------- */

struct rw_svc_mesh {
	uint32_t me;
};

struct rw_ipc_server {
	uint32_t node;
	rw_ipc_server_ops_t ops;
	void *ctx;
	rw_ipc_limits_t lim;         /* the real server's entry check runs on every submission */
};

typedef struct fk_buf {
	uint32_t id;
	int known;
	int cuda;                 /* device memory of the stand-in driver (host-addressable) */
	uint64_t size;
	uint8_t *mem;
} fk_buf_t;

#define FK_BUFS 8

struct rw_ipc_client {
	struct rw_ipc_client *next;  /* every client of the world */
	uint32_t node;
	rw_ipc_client_info_t info;
	void *data;
	fk_buf_t buf[FK_BUFS];
	uint32_t n_buf;
	rw_cqe_t *cqe;
	uint32_t n_cqe, cap_cqe;
	uint32_t owed;
	int joined, left, dropped, drop_pending, drop_error;
	char notice[128];            /* the last notice (why a submission failed) */
	uint32_t n_notices;
	unsigned keeps;              /* rw_ipc_client_keep's not yet dropped: its buffers stay */
	uint32_t event_id;           /* its one stream-order event (0: none), flag on device 0 */
	rw_cuda_dptr_t flag;
	uint32_t flags_written;      /* by rw_ipc_signal_now */
	struct rw_ipc_keep {
		struct rw_ipc_client *c;
	} keep;
};

typedef struct fk_node {
	int created, alive, silent;
	struct rw_svc_mesh mesh;
	rw_svc_mesh_cbs_t cbs;
	void *ctx;
	uint8_t *mem[RW_MAX_RAILS];
	rw_cuda_dptr_t dmem[RW_MAX_RAILS]; /* dev_slabs: the rail's slabs on device 0 */
	uint64_t area_bytes;
	uint8_t view[FK_MAX_NODES];      /* peer seen up */
	uint32_t conn_gen[FK_MAX_NODES]; /* generation of the connection it uses to each peer */
	rw_ipc_server_t *ipc;
} fk_node_t;

static fk_node_t fk_nodes[FK_MAX_NODES];
static uint32_t fk_linkgen[FK_MAX_NODES][FK_MAX_NODES]; /* symmetric */
static fk_ev_t **fk_q;
static uint32_t fk_qn, fk_qcap;
static uint64_t fk_seq;
static rw_ipc_client_t *fk_clients;

static void violation(fk_world_t *w, const char *what)
{
	if (!w->violations++)
		snprintf(w->violation, sizeof(w->violation), "%s", what);
	fprintf(stderr, "exec_fakes: contract violation: %s\n", what);
}

static uint64_t rng_next(fk_world_t *w)
{
	uint64_t z = (w->rng += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

fk_world_t *fk_world_new(struct ev_loop *loop, uint32_t nodes, uint32_t rails, int random_order,
			 uint64_t seed)
{
	fk_world_t *w = calloc(1, sizeof(*w));
	if (!w || nodes > FK_MAX_NODES || rails > RW_MAX_RAILS) {
		free(w);
		return NULL;
	}
	w->loop = loop;
	w->nodes = nodes;
	w->rails = rails;
	w->max_write = 1u << 20;
	w->random_order = random_order;
	w->rng = seed;
	memset(fk_nodes, 0, sizeof(fk_nodes));
	memset(fk_linkgen, 0, sizeof(fk_linkgen));
	fk_qn = 0;
	fk_seq = 0;
	fk_clients = NULL;
	fk_world = w;
	return w;
}

static void ev_free(fk_ev_t *ev)
{
	free(ev->payload);
	free(ev);
}

/* Free the client's host buffers, and with `cuda` its CUDA buffers and flag too (ipc.h: a keep
 * holds only the CUDA mappings past a leave; host buffers go at the leave). */
static void client_release_bufs(rw_ipc_client_t *c, int cuda)
{
	for (uint32_t i = 0; i < c->n_buf; i++) {
		if (c->buf[i].cuda && !cuda)
			continue;
		if (c->buf[i].cuda && c->buf[i].mem)
			rw_cuda_mem_free(0, (rw_cuda_dptr_t)(uintptr_t)c->buf[i].mem);
		else
			free(c->buf[i].mem);
		c->buf[i].mem = NULL;
		c->buf[i].known = 0;
	}
	if (!cuda)
		return;
	if (c->flag)
		rw_cuda_mem_free(0, c->flag);
	c->flag = 0;
	c->event_id = 0;
}

void fk_world_free(fk_world_t *w)
{
	for (uint32_t n = 0; n < FK_MAX_NODES; n++)
		if (fk_nodes[n].created || fk_nodes[n].ipc)
			violation(w, "world freed with a mesh or an IPC server still open");
	for (uint32_t i = 0; i < fk_qn; i++)
		ev_free(fk_q[i]);
	free(fk_q);
	fk_q = NULL;
	fk_qn = fk_qcap = 0;
	while (fk_clients) {
		rw_ipc_client_t *c = fk_clients;
		fk_clients = c->next;
		client_release_bufs(c, 1);
		free(c->cqe);
		free(c);
	}
	if (fk_world == w)
		fk_world = NULL;
	free(w);
}

/* ---- the queue ----------------------------------------------------------------------------- */

static void q_push(fk_ev_t *ev)
{
	if (fk_qn == fk_qcap) {
		uint32_t cap = fk_qcap ? 2 * fk_qcap : 256;
		fk_ev_t **q = realloc(fk_q, cap * sizeof(*q));
		if (!q)
			abort();
		fk_q = q;
		fk_qcap = cap;
	}
	ev->seq = ++fk_seq;
	fk_q[fk_qn++] = ev;
}

static fk_ev_t *q_take(uint32_t i)
{
	fk_ev_t *ev = fk_q[i];
	memmove(&fk_q[i], &fk_q[i + 1], (fk_qn - i - 1) * sizeof(*fk_q));
	fk_qn--;
	return ev;
}

static fk_ev_t *ev_new(fk_ev_kind_t kind, uint32_t src, uint32_t dst)
{
	fk_ev_t *ev = calloc(1, sizeof(*ev));
	if (!ev)
		abort();
	ev->kind = kind;
	ev->src = src;
	ev->dst = dst;
	return ev;
}

uint32_t fk_pending(const fk_world_t *w)
{
	(void)w;
	return fk_qn;
}

static void peer_notice(uint32_t node, uint32_t peer, fk_ev_kind_t kind)
{
	fk_ev_t *ev = ev_new(kind, peer, node);
	ev->gen = fk_linkgen[node][peer];
	q_push(ev);
}

/* Start a new connection generation between a and b. */
static void link_bump(uint32_t a, uint32_t b)
{
	fk_linkgen[a][b]++;
	fk_linkgen[b][a] = fk_linkgen[a][b];
}

/* The events of one ordered channel: control (src, dst), writes (src, dst, rail), their
 * completions (src, dst, rail), peer notices (node, peer). */
static uint32_t chan_of(const fk_ev_t *ev)
{
	uint32_t cls = ev->kind == FK_EV_CTRL ? 0 : ev->kind == FK_EV_WRITE ? 1 :
		       ev->kind == FK_EV_WDONE ? 2 : 3;
	uint32_t rail = (ev->kind == FK_EV_WRITE || ev->kind == FK_EV_WDONE) ? ev->rail : 0;
	return cls << 10 | (ev->src & 7u) << 7 | (ev->dst & 7u) << 4 | (rail & 15u);
}

static int ev_ready(const fk_ev_t *ev)
{
	const fk_node_t *d = &fk_nodes[ev->dst];
	switch (ev->kind) {
	case FK_EV_CTRL:
	case FK_EV_WRITE:
		if (!d->alive) /* writes: failed when the sender notices (or at once if silent) */
			return ev->kind == FK_EV_CTRL || d->silent ||
			       ev->gen != fk_linkgen[ev->src][ev->dst];
		if (ev->gen != fk_linkgen[ev->src][ev->dst])
			return 1; /* posted on a connection that broke: disposed of */
		/* The receiver must have this connection up (its hello comes first). */
		return d->view[ev->src] && d->conn_gen[ev->src] == ev->gen;
	default:
		return 1;
	}
}

static void deliver(fk_world_t *w, fk_ev_t *ev);

/* The client goes (ipc.h): client_left while it is "leaving" (completions discarded), then its
 * buffers are unmapped - freed here, so a touch after that is an ASan error - and its pointer
 * is dead to the service. */
static void client_leave(rw_ipc_client_t *c, rw_ipc_leave_t reason, int error)
{
	rw_ipc_server_t *s = fk_nodes[c->node].ipc;
	c->drop_pending = 1;
	if (s && c->joined && s->ops.client_left)
		s->ops.client_left(s->ctx, c, reason, error);
	c->drop_pending = 0;
	c->left = 1;
	client_release_bufs(c, !c->keeps);
}

/* ipc.h: a kept client's buffers stay mapped past its leave until the last keep is dropped */
rw_ipc_keep_t *rw_ipc_client_keep(rw_ipc_client_t *c)
{
	c->keeps++;
	c->keep.c = c;
	return &c->keep;
}

void rw_ipc_keep_drop(rw_ipc_server_t *server, rw_ipc_keep_t *k)
{
	(void)server;
	if (k && k->c->keeps && --k->c->keeps == 0 && k->c->left)
		client_release_bufs(k->c, 1);
}

unsigned fk_client_keeps(const rw_ipc_client_t *c) { return c->keeps; }

int fk_step(fk_world_t *w)
{
	/* The IPC server's deferred drops run first (the loop's next prepare phase). */
	for (rw_ipc_client_t *c = fk_clients; c; c = c->next) {
		if (!c->drop_pending || c->left)
			continue;
		client_leave(c, RW_IPC_LEFT_DROPPED, c->drop_error);
		return 1;
	}
	static uint8_t used[4096 / 8];
	memset(used, 0, sizeof(used));
	uint32_t cand[1024], n_cand = 0;
	for (uint32_t i = 0; i < fk_qn; i++) {
		const fk_ev_t *ev = fk_q[i];
		uint32_t ch = chan_of(ev);
		int first = !(used[ch >> 3] & (1u << (ch & 7)));
		used[ch >> 3] |= (uint8_t)(1u << (ch & 7));
		if (!first || (w->hold && w->hold(ev, w->hold_ctx)) || !ev_ready(ev))
			continue;
		cand[n_cand++] = i;
		if (!w->random_order || n_cand == RW_ARRAY_SIZE(cand))
			break;
	}
	if (!n_cand)
		return 0;
	uint32_t pick = w->random_order ? cand[rng_next(w) % n_cand] : cand[0];
	fk_ev_t *ev = q_take(pick);
	deliver(w, ev);
	ev_free(ev);
	return 1;
}

uint32_t fk_drop(fk_world_t *w, fk_hold_fn pred, void *ctx)
{
	(void)w;
	uint32_t n = 0;
	for (uint32_t i = 0; i < fk_qn;) {
		if (fk_q[i]->kind == FK_EV_CTRL && pred(fk_q[i], ctx)) {
			ev_free(q_take(i));
			n++;
		} else {
			i++;
		}
	}
	return n;
}

/* ---- delivery ------------------------------------------------------------------------------ */

static void write_done(fk_world_t *w, uint32_t node, uint32_t dst, uint32_t rail, void *wctx,
		       rw_status_t st)
{
	fk_node_t *s = &fk_nodes[node];
	if (!s->created || !s->alive)
		return;
	if (st != RW_OK)
		w->cnt.write_errors[node]++;
	if (s->cbs.write_done)
		s->cbs.write_done(s->ctx, dst, rail, wctx, st);
}

/* Node x learns that peer y is down: every write of x to y still queued (or whose completion
 * is) completes with an error, in post order, then peer_down (mesh.h's order). */
static void peer_down_now(fk_world_t *w, uint32_t x, uint32_t y)
{
	fk_node_t *n = &fk_nodes[x];
	if (!n->view[y])
		return;
	n->view[y] = 0;
	for (;;) {
		uint32_t i = 0;
		while (i < fk_qn && !((fk_q[i]->kind == FK_EV_WRITE || fk_q[i]->kind == FK_EV_WDONE) &&
				      fk_q[i]->src == x && fk_q[i]->dst == y))
			i++;
		if (i == fk_qn)
			break;
		fk_ev_t *ev = q_take(i);
		if (!ev->injected)
			write_done(w, x, y, ev->rail, ev->wctx, RW_ERR_PEER);
		ev_free(ev);
	}
	w->cnt.peer_down[x]++;
	if (n->created && n->alive && n->cbs.peer_down)
		n->cbs.peer_down(n->ctx, y, RW_ERR_PEER);
}

static void ctrl_deliver(fk_world_t *w, fk_ev_t *ev)
{
	fk_node_t *d = &fk_nodes[ev->dst];
	if (!d->alive || ev->gen != fk_linkgen[ev->src][ev->dst])
		return; /* lost with its connection */
	if (ev->type < 8)
		w->cnt.ctrl_delivered[ev->type][ev->src][ev->dst]++;
	rw_status_t st = RW_ERR_PROTO;
	switch (ev->type) {
	case RW_WIRE_COUNTS: {
		rw_wire_counts_t c;
		st = rw_wire_counts_unpack(ev->payload, ev->len, &c);
		if (st == RW_OK && (c.node != ev->src || c.nodes != w->nodes || c.rails != w->rails))
			st = RW_ERR_PROTO;
		if (st == RW_OK && d->cbs.counts)
			d->cbs.counts(d->ctx, ev->src, &c);
		break;
	}
	case RW_WIRE_PHASE_ERR: {
		rw_wire_phase_err_t e;
		st = rw_wire_phase_err_unpack(ev->payload, ev->len, &e);
		if (st == RW_OK && d->cbs.phase_err)
			d->cbs.phase_err(d->ctx, ev->src, &e);
		break;
	}
	case RW_WIRE_GRANT: {
		rw_wire_grant_t g;
		st = rw_wire_grant_unpack(ev->payload, ev->len, &g);
		if (st == RW_OK && g.wave >= w->nodes)
			st = RW_ERR_PROTO;
		if (st == RW_OK && d->cbs.grant)
			d->cbs.grant(d->ctx, ev->src, &g);
		break;
	}
	default:
		break;
	}
	if (st != RW_OK) /* the mesh closes a connection that says garbage: both ends see it */
		rw_svc_mesh_fail_peer(&d->mesh, ev->src, RW_ERR_PROTO, "bad control message");
}

static void write_deliver(fk_world_t *w, fk_ev_t *ev)
{
	fk_node_t *d = &fk_nodes[ev->dst], *s = &fk_nodes[ev->src];
	if (!d->alive || ev->gen != fk_linkgen[ev->src][ev->dst]) {
		/* The connection is gone: a silently dead receiver fails this write now; otherwise
		 * the sender's peer-down sweep fails it, unless its view already went down. */
		if (ev->injected) {
			/* nobody waits for it */
		} else if (d->silent || !s->view[ev->dst]) {
			write_done(w, ev->src, ev->dst, ev->rail, ev->wctx, RW_ERR_PEER);
		} else {
			fk_ev_t *fail = ev_new(FK_EV_WDONE, ev->src, ev->dst);
			fail->rail = ev->rail;
			fail->wctx = ev->wctx;
			fail->st = RW_ERR_PEER;
			fail->gen = ev->gen;
			q_push(fail);
		}
		return;
	}
	if (w->misplace_by && !ev->injected && ev->src == w->misplace_src &&
	    ev->dst == w->misplace_dst && ((ev->imm >> 17) & 1u) == 0) {
		ev->remote_off = (uint64_t)((int64_t)ev->remote_off + w->misplace_by);
		w->misplace_by = 0;
	}
	uint8_t *dst = d->mem[ev->rail] + ev->remote_off;
	if (w->dev_slabs) { /* device to device through a bounce copy, which the test's hook sees
			     * (and may change) before it lands */
		dst = malloc(ev->wlen ? ev->wlen : 1);
		if (!dst || rw_cuda_memcpy_dtoh(0, dst, s->dmem[ev->rail] + ev->local_off, ev->wlen) != RW_OK)
			violation(w, "a device slab copy failed");
		if (w->on_write && dst)
			w->on_write(ev, dst, w->on_write_ctx);
		if (dst && rw_cuda_memcpy_htod(0, d->dmem[ev->rail] + ev->remote_off, dst, ev->wlen) != RW_OK)
			violation(w, "a device slab copy failed");
		free(dst);
	} else {
		memcpy(dst, s->mem[ev->rail] + ev->local_off, ev->wlen);
		if (w->on_write)
			w->on_write(ev, dst, w->on_write_ctx);
	}
	if (!ev->injected) {
		fk_ev_t *done = ev_new(FK_EV_WDONE, ev->src, ev->dst);
		done->rail = ev->rail;
		done->wctx = ev->wctx;
		done->st = RW_OK;
		done->gen = ev->gen;
		q_push(done);
	}
	/* Like tcp and shm, the fake says where a write landed (RW_RAIL_CAP_ARRIVAL_WHERE). */
	static rw_rail_region_t region;
	rw_rail_arrival_t a = { .region = &region, .offset = ev->remote_off, .length = ev->wlen,
				.imm = ev->imm };
	if (d->cbs.arrival)
		d->cbs.arrival(d->ctx, ev->src, ev->rail, &a);
}

static void deliver(fk_world_t *w, fk_ev_t *ev)
{
	fk_node_t *d = &fk_nodes[ev->dst];
	switch (ev->kind) {
	case FK_EV_CTRL:
		ctrl_deliver(w, ev);
		break;
	case FK_EV_WRITE:
		write_deliver(w, ev);
		break;
	case FK_EV_WDONE:
		write_done(w, ev->src, ev->dst, ev->rail, ev->wctx, ev->st);
		break;
	case FK_EV_PEER_DOWN:
		if (d->created && d->alive && d->conn_gen[ev->src] < ev->gen)
			peer_down_now(w, ev->dst, ev->src);
		break;
	case FK_EV_PEER_UP:
		if (!d->created || !d->alive || !fk_nodes[ev->src].alive ||
		    ev->gen != fk_linkgen[ev->dst][ev->src])
			break; /* a connection that broke before it came up */
		d->view[ev->src] = 1;
		d->conn_gen[ev->src] = ev->gen;
		if (d->cbs.peer_up)
			d->cbs.peer_up(d->ctx, ev->src);
		break;
	default:
		break;
	}
}

/* ---- node life ------------------------------------------------------------------------------ */

/* Node n's process is gone: what it had queued dies with it; every link of it breaks. */
static void node_gone(fk_world_t *w, uint32_t n, int notify)
{
	fk_node_t *d = &fk_nodes[n];
	d->alive = 0;
	for (uint32_t i = 0; i < fk_qn;) {
		fk_ev_t *ev = fk_q[i];
		int mine = ((ev->kind == FK_EV_CTRL || ev->kind == FK_EV_WRITE || ev->kind == FK_EV_WDONE) &&
			    ev->src == n) ||
			   (ev->kind == FK_EV_CTRL && ev->dst == n) ||
			   ((ev->kind == FK_EV_PEER_DOWN || ev->kind == FK_EV_PEER_UP) && ev->dst == n);
		if (mine)
			ev_free(q_take(i));
		else
			i++;
	}
	memset(d->view, 0, sizeof(d->view));
	if (!notify)
		return;
	for (uint32_t s = 0; s < w->nodes; s++) {
		if (s == n || !fk_nodes[s].alive)
			continue;
		uint32_t old = fk_linkgen[s][n];
		link_bump(s, n);
		/* the notice ends every generation up to the one that just broke */
		fk_ev_t *ev = ev_new(FK_EV_PEER_DOWN, n, s);
		ev->gen = old + 1;
		q_push(ev);
	}
}

void fk_kill(fk_world_t *w, uint32_t n)
{
	if (fk_nodes[n].alive || fk_nodes[n].silent) {
		fk_nodes[n].silent = 0;
		node_gone(w, n, 1);
	}
}

void fk_kill_silent(fk_world_t *w, uint32_t n)
{
	node_gone(w, n, 0);
	fk_nodes[n].silent = 1;
}

int fk_alive(const fk_world_t *w, uint32_t n)
{
	(void)w;
	return fk_nodes[n].alive;
}

int fk_all_up(const fk_world_t *w)
{
	for (uint32_t i = 0; i < fk_qn; i++)
		if (fk_q[i]->kind == FK_EV_PEER_UP || fk_q[i]->kind == FK_EV_PEER_DOWN)
			return 0;
	for (uint32_t a = 0; a < w->nodes; a++)
		for (uint32_t b = 0; b < w->nodes; b++)
			if (a != b && fk_nodes[a].alive && fk_nodes[b].alive && !fk_nodes[a].view[b])
				return 0;
	return 1;
}

/* ---- the mesh (service/mesh/mesh.h) ----------------------------------------------------------- */

static void node_mem_free(fk_node_t *d)
{
	for (uint32_t r = 0; r < RW_MAX_RAILS; r++) {
		free(d->mem[r]);
		if (d->dmem[r])
			rw_cuda_mem_free(0, d->dmem[r]);
	}
	memset(d->mem, 0, sizeof(d->mem));
	memset(d->dmem, 0, sizeof(d->dmem));
}

rw_status_t rw_svc_mesh_create(struct rw_svc *svc, uint64_t area_bytes, uint64_t carve_bytes,
			       uint32_t carve_max, const rw_svc_mesh_cbs_t *cbs, void *ctx,
			       rw_svc_mesh_t **mesh_p)
{
	(void)carve_bytes, (void)carve_max; /* the fake world has the shared area only */
	fk_world_t *w = fk_world;
	uint32_t me = ((const rw_svc_t *)svc)->cfg.me;
	if (!w || me >= w->nodes || fk_nodes[me].created)
		return RW_ERR_STATE;
	fk_node_t *d = &fk_nodes[me];
	memset(d, 0, sizeof(*d));
	for (uint32_t r = 0; r < w->rails; r++) {
		d->mem[r] = calloc(1, area_bytes);
		if (!d->mem[r] || (w->dev_slabs && (rw_cuda_mem_alloc(0, area_bytes, &d->dmem[r]) != RW_OK ||
						   rw_cuda_memset_d8(0, d->dmem[r], 0, area_bytes) != RW_OK))) {
			node_mem_free(d);
			return RW_ERR_NOMEM;
		}
	}
	d->mesh.me = me;
	d->cbs = *cbs;
	d->ctx = ctx;
	d->area_bytes = area_bytes;
	d->created = d->alive = 1;
	for (uint32_t p = 0; p < w->nodes; p++) {
		if (p == me || !fk_nodes[p].alive)
			continue;
		link_bump(me, p); /* new connections, announced both ways from the loop */
		peer_notice(me, p, FK_EV_PEER_UP);
		peer_notice(p, me, FK_EV_PEER_UP);
	}
	*mesh_p = &d->mesh;
	return RW_OK;
}

void rw_svc_mesh_destroy(rw_svc_mesh_t *mesh)
{
	fk_world_t *w = fk_world;
	if (!mesh)
		return;
	uint32_t n = mesh->me;
	fk_node_t *d = &fk_nodes[n];
	memset(&d->cbs, 0, sizeof(d->cbs)); /* no callbacks during teardown (as service/mesh/mesh.c) */
	if (d->alive)
		node_gone(w, n, 1);
	for (uint32_t i = 0; i < fk_qn;) { /* its writes' completions: reclaimed silently */
		fk_ev_t *ev = fk_q[i];
		if ((ev->kind == FK_EV_WRITE || ev->kind == FK_EV_WDONE) && ev->src == n)
			ev_free(q_take(i));
		else
			i++;
	}
	node_mem_free(d);
	d->created = 0;
	d->silent = 0;
}

uint8_t *rw_svc_mesh_mem(rw_svc_mesh_t *mesh, uint32_t rail)
{
	return fk_nodes[mesh->me].mem[rail];
}

uint8_t *rw_svc_mesh_at(rw_svc_mesh_t *mesh, uint32_t rail, uint64_t off)
{
	const fk_node_t *d = &fk_nodes[mesh->me];
	return off < d->area_bytes ? d->mem[rail] + off : NULL;
}

/* Carve-outs (service/mesh/mesh_carve.c) run with the real mesh (tests/service/test_slabs.py). */
rw_status_t rw_svc_mesh_carve_take(rw_svc_mesh_t *mesh, const char *group, uint32_t *index_p)
{
	(void)mesh, (void)group, (void)index_p;
	return RW_ERR_UNSUPPORTED;
}

uint64_t rw_svc_mesh_carve_off(const rw_svc_mesh_t *mesh, uint32_t index)
{
	(void)index;
	return fk_nodes[mesh->me].area_bytes;
}

void rw_svc_mesh_carve_hold(rw_svc_mesh_t *mesh, uint32_t index) { (void)mesh, (void)index; }
void rw_svc_mesh_carve_put(rw_svc_mesh_t *mesh, uint32_t index) { (void)mesh, (void)index; }
void rw_svc_mesh_carve_leave(rw_svc_mesh_t *mesh, uint32_t index, const char *why)
{
	(void)mesh, (void)index, (void)why;
}

int rw_svc_mesh_carve_fd(const rw_svc_mesh_t *mesh, uint32_t index, uint32_t rail,
			 uint64_t *bytes_p)
{
	(void)mesh, (void)index, (void)rail, (void)bytes_p;
	return -1;
}

int rw_svc_mesh_carve_gpu(const rw_svc_mesh_t *mesh, uint32_t index, uint32_t rail,
			  uint8_t uuid_p[16])
{
	(void)mesh, (void)index, (void)rail, (void)uuid_p;
	return -1;
}

uint8_t *rw_svc_mesh_carve_shadow(const rw_svc_mesh_t *mesh, uint32_t index, uint32_t rail)
{
	(void)mesh, (void)index, (void)rail;
	return NULL;
}

int rw_svc_mesh_carve_cpu(const rw_svc_mesh_t *mesh, uint32_t index)
{
	(void)mesh, (void)index;
	return 1;
}

const char *rw_svc_mesh_carve_why(const rw_svc_mesh_t *mesh)
{
	(void)mesh;
	return ""; /* the fake lends no carve-outs (rw_svc_mesh_carve_take: off) */
}

int rw_svc_mesh_slab_dev(const rw_svc_mesh_t *mesh, uint32_t rail, uint64_t *dptr_p)
{
	const fk_node_t *d = &fk_nodes[mesh->me];
	if (!fk_world || !fk_world->dev_slabs || !d->dmem[rail])
		return -1;
	if (dptr_p)
		*dptr_p = d->dmem[rail];
	return 0;
}

int rw_svc_mesh_peer_up(const rw_svc_mesh_t *mesh, uint32_t peer)
{
	return peer == mesh->me || (peer < FK_MAX_NODES && fk_nodes[mesh->me].view[peer]);
}

/* The fake mesh has no rail faults: a peer it sees has every rail. */
uint32_t rw_svc_mesh_rail_mask(const rw_svc_mesh_t *mesh, uint32_t peer)
{
	return rw_svc_mesh_peer_up(mesh, peer) ? (uint32_t)((1ull << fk_world->rails) - 1) : 0;
}

int rw_svc_mesh_all_up(const rw_svc_mesh_t *mesh)
{
	for (uint32_t p = 0; p < fk_world->nodes; p++)
		if (!rw_svc_mesh_peer_up(mesh, p))
			return 0;
	return 1;
}

rw_status_t rw_svc_mesh_send(rw_svc_mesh_t *mesh, uint32_t peer, uint16_t type,
			     const uint8_t *payload, uint32_t len)
{
	fk_world_t *w = fk_world;
	uint32_t me = mesh->me;
	if (peer >= w->nodes || peer == me)
		return RW_ERR_INVAL;
	fk_node_t *d = &fk_nodes[me];
	if (!d->alive || !d->view[peer])
		return RW_ERR_STATE;
	if (type < 8)
		w->cnt.ctrl_posted[type][me][peer]++;
	if (w->sync_teardown && !fk_nodes[peer].alive) {
		/* service/mesh/mesh.c: the control write to a dead peer fails inside this call, and the
		 * peer is torn down right here (its queued writes complete with an error, then
		 * peer_down), before the call returns RW_ERR_STATE. */
		link_bump(me, peer);
		peer_down_now(w, me, peer);
		return RW_ERR_STATE;
	}
	fk_ev_t *ev = ev_new(FK_EV_CTRL, me, peer);
	ev->type = type;
	ev->len = len;
	ev->payload = malloc(len ? len : 1);
	if (!ev->payload)
		abort();
	memcpy(ev->payload, payload, len);
	ev->gen = d->conn_gen[peer];
	q_push(ev);
	return RW_OK;
}

rw_status_t rw_svc_mesh_write(rw_svc_mesh_t *mesh, uint32_t peer, uint32_t rail,
			      uint64_t local_off, uint64_t remote_off, uint64_t len, uint32_t imm,
			      void *write_ctx)
{
	fk_world_t *w = fk_world;
	uint32_t me = mesh->me;
	if (peer >= w->nodes || peer == me || rail >= w->rails)
		return RW_ERR_INVAL;
	fk_node_t *d = &fk_nodes[me];
	if (!d->alive || !d->view[peer])
		return RW_ERR_STATE;
	if (local_off > d->area_bytes || len > d->area_bytes - local_off ||
	    remote_off > d->area_bytes || len > d->area_bytes - remote_off ||
	    (w->max_write && len > w->max_write))
		return RW_ERR_RANGE;
	fk_ev_t *ev = ev_new(FK_EV_WRITE, me, peer);
	ev->rail = rail;
	ev->local_off = local_off;
	ev->remote_off = remote_off;
	ev->wlen = len;
	ev->imm = imm;
	ev->wctx = write_ctx;
	ev->gen = d->conn_gen[peer];
	q_push(ev);
	w->cnt.writes[(imm >> 17) & 1u][me][peer]++;
	return RW_OK;
}

uint64_t fk_area_bytes(uint32_t node) { return fk_nodes[node].area_bytes; }

void fk_inject_write(fk_world_t *w, uint32_t src, uint32_t dst, uint32_t rail, uint64_t remote_off,
		     uint64_t len, uint32_t imm)
{
	(void)w;
	fk_ev_t *ev = ev_new(FK_EV_WRITE, src, dst);
	ev->rail = rail;
	ev->remote_off = remote_off;
	ev->wlen = len;
	ev->imm = imm;
	ev->injected = 1;
	ev->gen = fk_nodes[src].conn_gen[dst];
	q_push(ev);
}

uint64_t rw_svc_mesh_max_write(const rw_svc_mesh_t *mesh, uint32_t rail)
{
	(void)mesh;
	(void)rail;
	return fk_world->max_write;
}

void rw_svc_mesh_fail_peer(rw_svc_mesh_t *mesh, uint32_t peer, rw_status_t st, const char *why)
{
	fk_world_t *w = fk_world;
	uint32_t me = mesh->me;
	(void)st;
	(void)why;
	if (peer >= w->nodes || peer == me || !fk_nodes[me].view[peer])
		return;
	w->cnt.fail_peer[me][peer]++;
	/* The connection closes: both ends see the peer down (this end within the call, as
	 * service/mesh/mesh.c does; mesh.h promises loop callbacks only, so sync_teardown decides),
	 * and the lower index reconnects at once. */
	uint32_t old = fk_linkgen[me][peer];
	link_bump(me, peer);
	fk_ev_t *ev;
	if (w->sync_teardown) {
		peer_down_now(w, me, peer);
	} else {
		ev = ev_new(FK_EV_PEER_DOWN, peer, me);
		ev->gen = old + 1;
		q_push(ev);
	}
	ev = ev_new(FK_EV_PEER_DOWN, me, peer);
	ev->gen = old + 1;
	q_push(ev);
	if (fk_nodes[peer].alive) {
		link_bump(me, peer);
		peer_notice(me, peer, FK_EV_PEER_UP);
		peer_notice(peer, me, FK_EV_PEER_UP);
	}
}

/* ---- the IPC server (ipc/ipc.h) ------------------------------------------------------------- */

const char *rw_ipc_leave_str(rw_ipc_leave_t reason)
{
	static const char *const names[] = { "goodbye", "eof", "protocol", "dropped", "shutdown" };
	return (unsigned)reason < RW_ARRAY_SIZE(names) ? names[reason] : "?";
}

rw_status_t rw_ipc_server_create(struct ev_loop *loop, const rw_ipc_server_config_t *cfg,
				 const rw_ipc_server_ops_t *ops, void *ctx,
				 rw_ipc_server_t **server_p)
{
	(void)loop;
	if (!fk_world || cfg->node < 0 || (uint32_t)cfg->node >= fk_world->nodes ||
	    fk_nodes[cfg->node].ipc || !ops->submission)
		return RW_ERR_INVAL;
	rw_ipc_server_t *s = calloc(1, sizeof(*s));
	if (!s)
		return RW_ERR_NOMEM;
	s->node = (uint32_t)cfg->node;
	s->ops = *ops;
	s->ctx = ctx;
	/* ipc/server.c's defaults for what the executor does not set */
	s->lim = (rw_ipc_limits_t){ .max_tokens = cfg->max_tokens ? cfg->max_tokens : 1u << 20,
				    .max_hidden = 65536,
				    .max_topk = cfg->max_topk ? cfg->max_topk : 64,
				    .max_experts = 1u << 20,
				    .dtypes = cfg->dtypes ? cfg->dtypes : UINT32_MAX };
	fk_nodes[s->node].ipc = s;
	*server_p = s;
	return RW_OK;
}

void rw_ipc_server_destroy(rw_ipc_server_t *server)
{
	if (!server)
		return;
	for (rw_ipc_client_t *c = fk_clients; c; c = c->next) {
		if (c->node != server->node || c->left)
			continue;
		client_leave(c, RW_IPC_LEFT_SHUTDOWN, 0);
	}
	fk_nodes[server->node].ipc = NULL;
	free(server);
}

rw_status_t rw_ipc_complete(rw_ipc_server_t *server, rw_ipc_client_t *client, const rw_cqe_t *cqe)
{
	fk_world_t *w = fk_world;
	char what[160];
	if (!server || fk_nodes[client->node].ipc != server) {
		violation(w, "completion through another node's server");
		return RW_ERR_STATE;
	}
	if (client->left) {
		snprintf(what, sizeof(what), "completion to rank %u after client_left returned",
			 client->info.rank);
		violation(w, what);
		return RW_ERR_STATE;
	}
	if (client->drop_pending)
		return RW_ERR_STATE; /* leaving: discarded */
	if (!client->owed) {
		snprintf(what, sizeof(what), "rank %u: completion (kind %u, phase %llu, status %u, "
			 "error %d) without a submission awaiting one", client->info.rank, cqe->kind,
			 (unsigned long long)cqe->phase_id, cqe->status, cqe->error);
		violation(w, what);
		return RW_ERR_STATE;
	}
	client->owed--;
	if (client->n_cqe == client->cap_cqe) {
		uint32_t cap = client->cap_cqe ? 2 * client->cap_cqe : 16;
		rw_cqe_t *q = realloc(client->cqe, cap * sizeof(*q));
		if (!q)
			abort();
		client->cqe = q;
		client->cap_cqe = cap;
	}
	client->cqe[client->n_cqe++] = *cqe;
	return RW_OK;
}

rw_status_t rw_ipc_buffer_lookup(const rw_ipc_client_t *client, uint32_t buf_id,
				 rw_ipc_buffer_t *buf_p)
{
	for (uint32_t i = 0; i < client->n_buf; i++) {
		const fk_buf_t *b = &client->buf[i];
		if (b->known && b->id == buf_id) {
			if (b->cuda)
				*buf_p = (rw_ipc_buffer_t){ .id = b->id, .kind = RW_IPC_BUF_CUDA, .size = b->size,
							    .dptr = (uint64_t)(uintptr_t)b->mem, .device = 0 };
			else
				*buf_p = (rw_ipc_buffer_t){ .id = b->id, .kind = RW_IPC_BUF_HOST, .size = b->size,
							    .host = b->mem, .device = -1 };
			return RW_OK;
		}
	}
	return RW_ERR_NOTFOUND;
}

void rw_ipc_client_drop(rw_ipc_server_t *server, rw_ipc_client_t *client, int error)
{
	(void)server;
	if (client->left || client->drop_pending)
		return;
	client->dropped = 1;
	client->drop_pending = 1;
	client->drop_error = error;
}

void rw_ipc_client_notice(rw_ipc_server_t *server, rw_ipc_client_t *client, int code,
			  const char *msg)
{
	(void)server, (void)code;
	snprintf(client->notice, sizeof(client->notice), "%s", msg);
	client->n_notices++;
}

const char *fk_client_notice(const rw_ipc_client_t *c) { return c->notice; }

/* The fake server lends no rank page (the rank path runs against real daemons: svc_rankpage). */
void *rw_ipc_client_page(const rw_ipc_client_t *client, size_t *bytes_p)
{
	(void)client;
	if (bytes_p)
		*bytes_p = 0;
	return NULL;
}
const struct rw_page_geom *rw_ipc_client_page_geom(const rw_ipc_client_t *client)
{
	(void)client;
	return NULL;
}

/* No page ranks here (rw_ipc_client_page is NULL): no rank-path phase ever runs. */
void rw_ipc_server_pages_busy(rw_ipc_server_t *server, int busy)
{
	(void)server, (void)busy;
}

int rw_ipc_log_churn(rw_ipc_server_t *server) /* the executor's join and leave lines: all */
{
	(void)server;
	return 1;
}

rw_svc_mesh_t *fk_mesh(uint32_t node) { return &fk_nodes[node].mesh; }

const rw_ipc_client_info_t *rw_ipc_client_info(const rw_ipc_client_t *client)
{
	return &client->info;
}

void rw_ipc_client_set_data(rw_ipc_client_t *client, void *data) { client->data = data; }

int rw_ipc_client_leaving(const rw_ipc_client_t *client) { return client->drop_pending; }

void *rw_ipc_client_data(const rw_ipc_client_t *client) { return client->data; }
/* Stream order: this stand-in server registers no events, so a submission naming one is refused
 * by the executor (unknown event), and there is never a flag to write. */
rw_status_t rw_ipc_event_lookup(const rw_ipc_client_t *client, uint32_t id, rw_ipc_event_t *ev_p)
{
	if (!client->event_id || id != client->event_id)
		return RW_ERR_NOTFOUND;
	*ev_p = (rw_ipc_event_t){ .id = id, .device = 0, .event = NULL, .flag_dptr = client->flag };
	return RW_OK;
}

/* As ipc/server_event.c: the flag written synchronously (the stand-in's memory), counted. The
 * real server has freed a client that left (and closed the flag's mapping): a write then is a
 * contract violation. */
void rw_ipc_signal_now(rw_ipc_client_t *client, const rw_sqe_t *sqe)
{
	if (client->left) {
		violation(fk_world, "a completion flag written for a client that left");
		return;
	}
	if (!(sqe->flags & RW_SQE_SIGNAL) || sqe->event_id != client->event_id || !client->flag)
		return;
	if (rw_cuda_write_u32(0, client->flag, sqe->output.reserved) == RW_OK)
		client->flags_written++;
}

uint32_t *fk_client_flag_event(rw_ipc_client_t *c, uint32_t id)
{
	if (!c->flag && rw_cuda_mem_alloc(0, 64, &c->flag) != RW_OK)
		return NULL;
	c->event_id = id;
	return (uint32_t *)(uintptr_t)c->flag;
}

uint32_t fk_client_flags_written(const rw_ipc_client_t *c) { return c->flags_written; }

/* ---- fake clients --------------------------------------------------------------------------- */

rw_ipc_client_t *fk_client_new(fk_world_t *w, uint32_t node, const char *group, uint32_t rank,
			       uint32_t world_size, uint32_t local_gpu)
{
	(void)w;
	rw_ipc_client_t *c = calloc(1, sizeof(*c));
	if (!c)
		abort();
	static uint32_t next_id;
	c->node = node;
	c->info.id = ++next_id;
	snprintf(c->info.group, sizeof(c->info.group), "%s", group);
	c->info.rank = rank;
	c->info.world_size = world_size;
	c->info.node = node;
	c->info.local_gpu = (int32_t)local_gpu;
	c->info.pid = 1000 + (pid_t)rank;
	c->next = fk_clients;
	fk_clients = c;
	return c;
}

void fk_client_join(rw_ipc_client_t *c)
{
	rw_ipc_server_t *s = fk_nodes[c->node].ipc;
	if (!s || c->joined)
		return;
	c->joined = 1;
	if (s->ops.client_joined)
		s->ops.client_joined(s->ctx, c);
}

uint32_t fk_client_buffer(rw_ipc_client_t *c, uint64_t size, uint8_t **mem_p)
{
	if (c->n_buf == FK_BUFS)
		abort();
	fk_buf_t *b = &c->buf[c->n_buf];
	b->id = 100 + c->n_buf;
	b->size = size;
	b->mem = calloc(1, size ? size : 1);
	if (!b->mem)
		abort();
	b->known = 1;
	c->n_buf++;
	*mem_p = b->mem;
	return b->id;
}

uint32_t fk_client_cuda_buffer(rw_ipc_client_t *c, uint64_t size, uint8_t **mem_p)
{
	rw_cuda_dptr_t dptr;
	if (c->n_buf == FK_BUFS || rw_cuda_init() != RW_OK || rw_cuda_mem_alloc(0, size, &dptr) != RW_OK)
		return 0;
	fk_buf_t *b = &c->buf[c->n_buf];
	b->id = 100 + c->n_buf;
	b->size = size;
	b->mem = (uint8_t *)(uintptr_t)dptr;
	b->cuda = 1;
	b->known = 1;
	c->n_buf++;
	*mem_p = b->mem;
	return b->id;
}

void fk_client_forget_buffer(rw_ipc_client_t *c, uint32_t id)
{
	for (uint32_t i = 0; i < c->n_buf; i++)
		if (c->buf[i].id == id)
			c->buf[i].known = 0;
}

static uint64_t buf_size_of(void *ctx, uint32_t buf_id)
{
	const rw_ipc_client_t *c = ctx;
	for (uint32_t i = 0; i < c->n_buf; i++)
		if (c->buf[i].known && c->buf[i].id == buf_id)
			return c->buf[i].size;
	return 0;
}

void fk_client_submit(rw_ipc_client_t *c, const rw_sqe_t *sqe)
{
	rw_ipc_server_t *s = fk_nodes[c->node].ipc;
	if (!s || !c->joined || c->left || c->drop_pending) {
		violation(fk_world, "test submitted for a client that is not connected");
		return;
	}
	rw_sqe_t copy = *sqe; /* the service owns it only during the call */
	c->owed++;
	const char *why;
	int code = rw_ipc_check_sqe(&copy, &s->lim, buf_size_of, c, &why);
	if (code) { /* refused at the IPC boundary, as ipc/server.c does: the service never sees it */
		rw_cqe_t cqe = { .status = RW_CQ_ERROR, .error = code, .kind = sqe->kind,
				 .phase_id = sqe->phase_id, .user_data = sqe->user_data,
				 .counts_buf = RW_BUF_NONE };
		rw_ipc_complete(s, c, &cqe);
		return;
	}
	s->ops.submission(s->ctx, c, &copy);
	memset(&copy, 0xa5, sizeof(copy));
}

void fk_client_die(rw_ipc_client_t *c)
{
	if (!c->left)
		client_leave(c, RW_IPC_LEFT_EOF, 0);
}

void fk_client_stats(const rw_ipc_client_t *c, fk_client_stats_t *s)
{
	*s = (fk_client_stats_t){ .n_cqe = c->n_cqe, .owed = c->owed, .joined = c->joined,
				  .left = c->left, .dropped = c->dropped, .drop_error = c->drop_error };
}

const rw_cqe_t *fk_client_cqe(const rw_ipc_client_t *c, uint32_t i)
{
	return i < c->n_cqe ? &c->cqe[i] : NULL;
}
