/* The fluid engine of `railwave sim` (tools/sim.h): event-driven progressive filling over NIC
 * egress and ingress ports, recomputed per connected component at every completion (or batch of
 * completions), under max-min or the lossless (PFC, head-of-line) model of docs/sim.md §2. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/sim.h"

enum { FLOW_PENDING = 0, FLOW_ACTIVE = 1, FLOW_DONE = 2 };

/* A pending completion of one component allocation: valid while the component is unchanged,
 * i.e. while port_comp[root] == comp (any reallocation renumbers all of its ports). */
typedef struct sim_ev {
	double t;      /* earliest finish in the component */
	double dur;    /* scales the batching window: from that flow's start to the projected end
		        * of its rail (whole-rail components; else to its own finish) */
	uint32_t comp, root;
	uint32_t rail; /* 0: a component found from root; r + 1: the whole of rail r */
} sim_ev_t;

typedef struct sim_pk {
	double key;
	uint32_t port;
} sim_pk_t;

typedef struct sim {
	const rw_sim_fabric_t *fab;
	const rw_sim_opts_t *opts;
	rw_sim_flow_t *fl;     /* the flows sorted by (rail, src, wave, dst): port lists stay local */
	uint32_t *orig;        /* fl[f] is input flow orig[f] */
	size_t F;
	uint32_t N, R, NR, P;
	uint32_t *rail_active; /* [R] active flows per rail */
	uint32_t *rail_whole;  /* [R] id of the rail's last whole-rail allocation (0: none) */
	uint32_t *ep, *ip;     /* [F] egress / ingress port of each flow */

	/* flows */
	double *rem, *rate, *t_upd, *t_start, *fin;
	double *nrate;         /* rates being computed (-1: unfrozen); rate[] keeps the old ones */
	double *work;          /* [P] scratch: a port's remaining seconds of work */
	uint32_t *pos_e, *pos_i;
	uint8_t *state;
	double *finish_out;

	/* ports: egress (rail, node) = rail * N + node, ingress = NR + rail * N + node */
	uint32_t *port_off, *port_len, *port_list, *port_comp, *stamp, *kcnt;
	double *cap;
	uint8_t *frozen;
	uint32_t epoch;
	uint32_t *touched, *touch_stamp, touch_epoch;
	size_t n_touched;
	uint32_t *stack, *comp_ports, *comp_flows;
	uint32_t n_comp_ports, n_comp_flows;
	uint32_t next_comp;

	/* nodes: flows sorted by (src, wave, index) */
	uint32_t *order, *node_off, *node_next, *node_left, *ready;
	size_t n_ready;

	/* receiver gate (opts->wave_gate): flows into each node by wave (CSR), the first not yet
	 * finished, nodes waiting to be admitted (a list per receiver), receivers whose gate moved */
	uint32_t *in_off, *in_order, *in_ptr;
	uint32_t *wait_head, *wait_next;
	uint32_t *moved;
	uint8_t *moved_flag;
	size_t n_moved;

	/* fan-in */
	uint32_t *pair_active, *src_active;
	uint32_t max_fan_in;

	/* heaps */
	sim_ev_t *ev;
	size_t n_ev, cap_ev;
	sim_pk_t *ph;
	size_t n_ph, cap_ph;

	double delivered, end;
	double batch_end;      /* latest completion of the batch being processed */
	uint64_t violations;
} sim_t;

static inline uint32_t eport(const sim_t *s, uint32_t f) { return s->ep[f]; }
static inline uint32_t iport(const sim_t *s, uint32_t f) { return s->ip[f]; }
static inline int is_egress(const sim_t *s, uint32_t p) { return p < s->NR; }
static inline double port_rate(const sim_t *s, uint32_t p) { return s->fab->rail_Bps[(p % s->NR) / s->N]; }

/* ---- heaps (binary, min at [0]) ----------------------------------------------------------- */

static int ev_less(const sim_ev_t *a, const sim_ev_t *b)
{
	return a->t < b->t || (a->t == b->t && a->comp < b->comp); /* comp: deterministic ties */
}

static int pk_less(const sim_pk_t *a, const sim_pk_t *b)
{
	return a->key < b->key || (a->key == b->key && a->port < b->port);
}

/* NAME_up(h, i) / NAME_down(h, n, i): restore the heap order of h[0..n) after h[i] got smaller /
 * larger; typed (no comparator calls through a pointer in the simulator's inner loop). */
#define SIM_HEAP(NAME, TYPE, LESS)                                                              \
	static void NAME##_up(TYPE *h, size_t i)                                                \
	{                                                                                       \
		for (size_t up; i > 0 && LESS(&h[i], &h[up = (i - 1) / 2]); i = up) {           \
			TYPE t = h[i];                                                          \
			h[i] = h[up];                                                           \
			h[up] = t;                                                              \
		}                                                                               \
	}                                                                                       \
	static void NAME##_down(TYPE *h, size_t n, size_t i)                                    \
	{                                                                                       \
		for (;;) {                                                                      \
			size_t l = 2 * i + 1, m = i;                                            \
			if (l < n && LESS(&h[l], &h[m]))                                        \
				m = l;                                                          \
			if (l + 1 < n && LESS(&h[l + 1], &h[m]))                                \
				m = l + 1;                                                      \
			if (m == i)                                                             \
				return;                                                         \
			TYPE t = h[i];                                                          \
			h[i] = h[m];                                                            \
			h[m] = t;                                                               \
			i = m;                                                                  \
		}                                                                               \
	}
SIM_HEAP(ev_heap, sim_ev_t, ev_less)
SIM_HEAP(pk_heap, sim_pk_t, pk_less)

/* Make room for one more element in a doubling array of *cap elements of `size` bytes. */
static rw_status_t heap_reserve(void **arr, size_t n, size_t *cap, size_t size)
{
	if (n < *cap)
		return RW_OK;
	size_t nc = *cap ? 2 * *cap : 1024;
	void *p = realloc(*arr, nc * size);
	if (!p)
		return RW_ERR_NOMEM;
	*arr = p;
	*cap = nc;
	return RW_OK;
}

static int ev_valid(const sim_t *s, const sim_ev_t *e) { return s->port_comp[e->root] == e->comp; }

/* Drop stale entries (components reallocated since) and rebuild the heap: O(n), amortised by
 * running only when stale entries outnumber the live bound (one per port) by far. */
static void ev_compact(sim_t *s)
{
	size_t n = 0;
	for (size_t i = 0; i < s->n_ev; i++)
		if (ev_valid(s, &s->ev[i]))
			s->ev[n++] = s->ev[i];
	s->n_ev = n;
	for (size_t i = n / 2; i-- > 0;)
		ev_heap_down(s->ev, n, i);
}

static rw_status_t ev_push(sim_t *s, sim_ev_t e)
{
	if (s->n_ev == s->cap_ev && s->n_ev > 2 * (size_t)s->P + 1024)
		ev_compact(s);
	void *arr = s->ev;
	rw_status_t st = heap_reserve(&arr, s->n_ev, &s->cap_ev, sizeof(sim_ev_t));
	s->ev = arr;
	if (st != RW_OK)
		return st;
	s->ev[s->n_ev] = e;
	ev_heap_up(s->ev, s->n_ev++);
	return RW_OK;
}

static void ev_pop(sim_t *s)
{
	s->ev[0] = s->ev[--s->n_ev];
	ev_heap_down(s->ev, s->n_ev, 0);
}

/* Pop stale entries off the top; 1 if a valid one is left on top. */
static int ev_top_valid(sim_t *s)
{
	while (s->n_ev > 0 && !ev_valid(s, &s->ev[0]))
		ev_pop(s);
	return s->n_ev > 0;
}

static rw_status_t pk_push(sim_t *s, double key, uint32_t port)
{
	void *arr = s->ph;
	rw_status_t st = heap_reserve(&arr, s->n_ph, &s->cap_ph, sizeof(sim_pk_t));
	s->ph = arr;
	if (st != RW_OK)
		return st;
	s->ph[s->n_ph] = (sim_pk_t){ key, port };
	pk_heap_up(s->ph, s->n_ph++);
	return RW_OK;
}

static sim_pk_t pk_pop(sim_t *s)
{
	sim_pk_t top = s->ph[0];
	s->ph[0] = s->ph[--s->n_ph];
	pk_heap_down(s->ph, s->n_ph, 0);
	return top;
}

/* ---- flows, ports and nodes --------------------------------------------------------------- */

static void touch(sim_t *s, uint32_t p)
{
	if (s->touch_stamp[p] != s->touch_epoch) {
		s->touch_stamp[p] = s->touch_epoch;
		s->touched[s->n_touched++] = p;
	}
}

static void flow_start(sim_t *s, uint32_t f, double t)
{
	uint32_t e = eport(s, f), i = iport(s, f);
	s->state[f] = FLOW_ACTIVE;
	s->rem[f] = s->fl[f].bytes;
	s->rate[f] = 0;
	s->t_upd[f] = t;
	s->t_start[f] = t;
	s->pos_e[f] = s->port_len[e];
	s->port_list[s->port_off[e] + s->port_len[e]++] = f;
	s->pos_i[f] = s->port_len[i];
	s->port_list[s->port_off[i] + s->port_len[i]++] = f;
	s->rail_active[s->fl[f].rail]++;
	touch(s, e);
	touch(s, i);
	size_t pair = (size_t)s->fl[f].src * s->N + s->fl[f].dst;
	if (s->pair_active[pair]++ == 0) {
		uint32_t d = s->fl[f].dst;
		if (++s->src_active[d] > s->max_fan_in)
			s->max_fan_in = s->src_active[d];
	}
}

static void list_remove(sim_t *s, uint32_t p, uint32_t pos, uint32_t *pos_arr)
{
	uint32_t *list = s->port_list + s->port_off[p];
	uint32_t last = list[--s->port_len[p]];
	list[pos] = last;
	pos_arr[last] = pos;
}

/* Flow f completes at tf (its predicted finish under the rates it had since t_upd). */
static void flow_finish(sim_t *s, uint32_t f, double tf)
{
	uint32_t e = eport(s, f), i = iport(s, f);
	s->delivered += s->rem[f]; /* = rate * (tf - t_upd): the last piece of its integral */
	s->rem[f] = 0;
	s->state[f] = FLOW_DONE;
	if (s->finish_out)
		s->finish_out[s->orig[f]] = tf;
	if (tf > s->end)
		s->end = tf;
	if (tf > s->batch_end)
		s->batch_end = tf;
	list_remove(s, e, s->pos_e[f], s->pos_e);
	list_remove(s, i, s->pos_i[f], s->pos_i);
	s->rail_active[s->fl[f].rail]--;
	touch(s, e);
	touch(s, i);
	size_t pair = (size_t)s->fl[f].src * s->N + s->fl[f].dst;
	if (--s->pair_active[pair] == 0)
		s->src_active[s->fl[f].dst]--;
	if (s->opts->wave_gate) {
		uint32_t d = s->fl[f].dst, a = s->in_ptr[d];
		while (s->in_ptr[d] < s->in_off[d + 1] && s->state[s->in_order[s->in_ptr[d]]] == FLOW_DONE)
			s->in_ptr[d]++;
		if (s->in_ptr[d] != a && s->wait_head[d] != UINT32_MAX && !s->moved_flag[d]) {
			s->moved_flag[d] = 1;
			s->moved[s->n_moved++] = d;
		}
	}
	uint32_t src = s->fl[f].src;
	if (--s->node_left[src] == 0)
		s->ready[s->n_ready++] = src;
}

/* Receiver d admits a flow of wave w: every flow into d of a lower wave has finished. */
static int gate_open(const sim_t *s, uint32_t d, uint32_t w)
{
	return s->in_ptr[d] == s->in_off[d + 1] || s->fl[s->in_order[s->in_ptr[d]]].wave >= w;
}

/* Receivers whose gate moved: their waiting senders try again (node_start_next). */
static void gate_wake(sim_t *s)
{
	for (size_t j = 0; j < s->n_moved; j++) {
		uint32_t d = s->moved[j];
		s->moved_flag[d] = 0;
		for (uint32_t n = s->wait_head[d]; n != UINT32_MAX; n = s->wait_next[n])
			s->ready[s->n_ready++] = n;
		s->wait_head[d] = UINT32_MAX;
	}
	s->n_moved = 0;
}

/* Start node n's next group of equal-wave flows at t (nothing when it has sent everything). */
static void node_start_next(sim_t *s, uint32_t n, double t)
{
	uint32_t a = s->node_next[n], end = s->node_off[n + 1], b = a;
	if (a == end)
		return;
	uint32_t wave = s->fl[s->order[a]].wave;
	while (b < end && s->fl[s->order[b]].wave == wave)
		b++;
	for (uint32_t j = a; j < b && s->opts->wave_gate; j++) {
		uint32_t d = s->fl[s->order[j]].dst;
		if (!gate_open(s, d, wave)) { /* wait for d; gate_wake puts n back */
			s->wait_next[n] = s->wait_head[d];
			s->wait_head[d] = n;
			return;
		}
	}
	for (uint32_t j = a; j < b; j++)
		flow_start(s, s->order[j], t);
	s->node_next[n] = b;
	s->node_left[n] = b - a;
}

/* ---- components and rates ----------------------------------------------------------------- */

/* Collect root's connected component (ports joined by active flows) into comp_ports /
 * comp_flows (each flow once, from its egress port). */
static void component(sim_t *s, uint32_t root)
{
	uint32_t top = 0;
	s->n_comp_ports = s->n_comp_flows = 0;
	s->stamp[root] = s->epoch;
	s->stack[top++] = root;
	while (top > 0) {
		uint32_t p = s->stack[--top];
		s->comp_ports[s->n_comp_ports++] = p;
		const uint32_t *list = s->port_list + s->port_off[p];
		int eg = is_egress(s, p);
		for (uint32_t j = 0; j < s->port_len[p]; j++) {
			uint32_t f = list[j], q;
			if (eg) {
				s->comp_flows[s->n_comp_flows++] = f;
				q = iport(s, f);
			} else {
				q = eport(s, f);
			}
			if (s->stamp[q] != s->epoch) {
				s->stamp[q] = s->epoch;
				s->stack[top++] = q;
			}
		}
	}
}

/* The whole of rail r as one "component": a union of components gets the same rates as each
 * one alone, and on a dense rail (all-to-all: nearly one component anyway) listing it port by
 * port is cheaper than a search. */
static void component_rail(sim_t *s, uint32_t r)
{
	s->n_comp_ports = s->n_comp_flows = 0;
	for (int side = 0; side < 2; side++)
		for (uint32_t n = 0; n < s->N; n++) {
			uint32_t p = side * s->NR + r * s->N + n;
			s->stamp[p] = s->epoch;
			s->comp_ports[s->n_comp_ports++] = p;
			if (side)
				continue;
			const uint32_t *list = s->port_list + s->port_off[p];
			for (uint32_t j = 0; j < s->port_len[p]; j++)
				s->comp_flows[s->n_comp_flows++] = list[j];
		}
}

/* Rails with more active flows than this are reallocated whole (component_rail). A waved path
 * has at most one flow per egress port and rail, so it stays below and uses small components. */
static int rail_dense(const sim_t *s, uint32_t r) { return s->rail_active[r] > 2 * s->N; }

/* Max-min fair rates by progressive filling (docs/sim.md §2.1): raise every unfrozen flow's
 * rate together; when a port fills, freeze its flows at the level reached. Keys (remaining
 * capacity / unfrozen flows) only grow as other ports freeze flows below them, so a popped
 * entry whose key grew is pushed back with the new key instead of being updated in place. */
/* A port entry just popped, whose key is updated lazily: 1 when its fill level *cur (remaining
 * capacity / unfrozen flows) is the key it was pushed with, so it fills now; 0 when the port is
 * done, or its level grew and it went back in with the new key; -1 when that push failed. */
static int pk_settled(sim_t *s, sim_pk_t top, double *cur)
{
	uint32_t p = top.port;
	if (s->kcnt[p] == 0)
		return 0;
	*cur = (s->cap[p] > 0 ? s->cap[p] : 0) / s->kcnt[p];
	if (*cur > top.key * (1 + 1e-12))
		return pk_push(s, *cur, p) == RW_OK ? 0 : -1;
	return 1;
}

static rw_status_t fill_maxmin(sim_t *s)
{
	s->n_ph = 0;
	for (uint32_t j = 0; j < s->n_comp_flows; j++)
		s->nrate[s->comp_flows[j]] = -1.0;
	for (uint32_t j = 0; j < s->n_comp_ports; j++) {
		uint32_t p = s->comp_ports[j];
		s->cap[p] = port_rate(s, p);
		s->kcnt[p] = s->port_len[p];
		if (s->kcnt[p] && pk_push(s, s->cap[p] / s->kcnt[p], p) != RW_OK)
			return RW_ERR_NOMEM;
	}
	while (s->n_ph > 0) {
		sim_pk_t top = pk_pop(s);
		uint32_t p = top.port;
		double cur;
		int st = pk_settled(s, top, &cur);
		if (st <= 0) {
			if (st < 0)
				return RW_ERR_NOMEM;
			continue;
		}
		const uint32_t *list = s->port_list + s->port_off[p];
		int eg = is_egress(s, p);
		for (uint32_t j = 0; j < s->port_len[p]; j++) {
			uint32_t f = list[j];
			if (s->nrate[f] >= 0)
				continue;
			s->nrate[f] = cur;
			uint32_t q = eg ? iport(s, f) : eport(s, f);
			s->cap[q] -= cur;
			s->kcnt[q]--;
		}
		s->kcnt[p] = 0;
	}
	return RW_OK;
}

static void freeze_egress(sim_t *s, uint32_t e, double level)
{
	const uint32_t *list = s->port_list + s->port_off[e];
	s->frozen[e] = 1;
	for (uint32_t j = 0; j < s->port_len[e]; j++) {
		uint32_t f = list[j], i = iport(s, f);
		s->nrate[f] = level;
		s->cap[i] -= level;
		s->kcnt[i]--;
	}
}

/* Lossless rates (docs/sim.md §2.2). Fluid level: a NIC serves its flows round-robin and a PFC
 * pause stops the whole NIC, so all flows of one egress port move at one per-flow rate y_e;
 * progressive filling over those port rates: egress e fills at y_e = C / n_e, ingress i when the
 * unfrozen ports feeding it reach (remaining capacity / unfrozen flows), and it freezes every one
 * of them at that level, with all of their other flows (congestion spreading). Burst level: an
 * ingress port with k >= 2 active senders is PFC-paced and, with head-of-line blocked senders,
 * delivers C (1 - hol (1 - h(k))). */
static rw_status_t fill_lossless(sim_t *s)
{
	s->n_ph = 0;
	const double hol = s->opts->hol;
	for (uint32_t j = 0; j < s->n_comp_ports; j++) {
		uint32_t p = s->comp_ports[j];
		s->cap[p] = port_rate(s, p);
		s->kcnt[p] = s->port_len[p];
		s->frozen[p] = 0;
	}
	for (uint32_t j = 0; j < s->n_comp_ports; j++) {
		uint32_t p = s->comp_ports[j];
		if (s->kcnt[p] == 0)
			continue;
		if (!is_egress(s, p) && hol > 0 && s->port_len[p] > 1) {
			/* distinct sender NICs: frozen[] is clear on every egress port here and is
			 * used as a mark, then cleared again */
			const uint32_t *list = s->port_list + s->port_off[p];
			uint32_t k = 0;
			for (uint32_t q = 0; q < s->port_len[p]; q++) {
				uint32_t e = eport(s, list[q]);
				k += !s->frozen[e];
				s->frozen[e] = 1;
			}
			for (uint32_t q = 0; q < s->port_len[p]; q++)
				s->frozen[eport(s, list[q])] = 0;
			s->cap[p] *= 1 - hol * (1 - rw_sim_hol_throughput(k));
		}
		if (pk_push(s, s->cap[p] / s->kcnt[p], p) != RW_OK)
			return RW_ERR_NOMEM;
	}
	while (s->n_ph > 0) {
		sim_pk_t top = pk_pop(s);
		uint32_t p = top.port;
		if (is_egress(s, p)) {
			if (!s->frozen[p])
				freeze_egress(s, p, top.key); /* C / n_e: its key never changes */
			continue;
		}
		double cur;
		int st = pk_settled(s, top, &cur);
		if (st <= 0) {
			if (st < 0)
				return RW_ERR_NOMEM;
			continue;
		}
		const uint32_t *list = s->port_list + s->port_off[p];
		for (uint32_t j = 0; j < s->port_len[p]; j++) {
			uint32_t e = eport(s, list[j]);
			if (!s->frozen[e])
				freeze_egress(s, e, cur);
		}
	}
	return RW_OK;
}

static void verify(sim_t *s)
{
	for (uint32_t j = 0; j < s->n_comp_ports; j++) {
		uint32_t p = s->comp_ports[j];
		const uint32_t *list = s->port_list + s->port_off[p];
		double sum = 0;
		int bad = 0;
		for (uint32_t k = 0; k < s->port_len[p]; k++) {
			double r = s->nrate[list[k]];
			bad |= !(r > 0);
			sum += r;
		}
		if (bad || sum > port_rate(s, p) * (1 + 1e-9))
			s->violations++;
	}
}

/* Reallocate the component just collected (comp_ports / comp_flows) at time t: bring its
 * flows' remaining bytes to t, compute the rates, and queue its earliest completion. */
static rw_status_t allocate(sim_t *s, uint32_t root, uint32_t rail, double t)
{
	uint32_t id = s->next_comp++;
	for (uint32_t j = 0; j < s->n_comp_ports; j++)
		s->port_comp[s->comp_ports[j]] = id;
	if (s->n_comp_flows == 0)
		return RW_OK;
	rw_status_t st = s->opts->model == RW_SIM_MAXMIN ? fill_maxmin(s) : fill_lossless(s);
	if (st != RW_OK)
		return st;
	if (s->opts->verify)
		verify(s);
	/* One pass: bytes moved since the last allocation at the old rate, then the new rate
	 * and the predicted finish. On a whole rail also each port's remaining work, whose
	 * maximum projects when the rail will be done: the scale of its batching window. */
	sim_ev_t ev = { .t = INFINITY, .comp = id, .root = root, .rail = rail };
	uint32_t first = 0;
	double delivered = 0;
	if (rail)
		for (uint32_t j = 0; j < s->n_comp_ports; j++)
			s->work[s->comp_ports[j]] = 0;
	for (uint32_t j = 0; j < s->n_comp_flows; j++) {
		uint32_t f = s->comp_flows[j];
		double moved = s->rate[f] * (t - s->t_upd[f]);
		if (moved > s->rem[f])
			moved = s->rem[f]; /* rounding: it was due by t */
		delivered += moved;
		double rem = s->rem[f] - moved;
		s->rem[f] = rem;
		s->t_upd[f] = t;
		s->rate[f] = s->nrate[f];
		double fin = t + rem / s->rate[f];
		s->fin[f] = fin;
		if (fin < ev.t) {
			ev.t = fin;
			first = f;
		}
		if (rail) {
			s->work[s->ep[f]] += rem;
			s->work[s->ip[f]] += rem;
		}
	}
	s->delivered += delivered;
	double end = ev.t;
	if (rail)
		for (uint32_t j = 0; j < s->n_comp_ports; j++) {
			uint32_t p = s->comp_ports[j];
			double e = t + s->work[p] / port_rate(s, p);
			end = e > end ? e : end;
		}
	ev.dur = end - s->t_start[first];
	return ev_push(s, ev);
}

static uint32_t port_rail(const sim_t *s, uint32_t p) { return (p % s->NR) / s->N; }

/* Reallocate every component that holds a port touched since the last round. */
static rw_status_t allocate_touched(sim_t *s, double t)
{
	s->epoch++;
	for (size_t j = 0; j < s->n_touched; j++) {
		uint32_t p = s->touched[j], r = port_rail(s, p);
		if (s->stamp[p] == s->epoch)
			continue; /* already in a component reallocated this round */
		/* Once a rail is allocated whole, it stays whole: a search from one port would
		 * leave the rest of that allocation without a pending event. */
		uint32_t whole = rail_dense(s, r) || (s->rail_whole[r] && s->port_comp[p] == s->rail_whole[r]);
		if (whole)
			component_rail(s, r);
		else
			component(s, p);
		rw_status_t st = allocate(s, p, whole ? r + 1 : 0, t);
		if (st != RW_OK)
			return st;
		if (whole)
			s->rail_whole[r] = s->next_comp - 1;
	}
	s->n_touched = 0;
	s->touch_epoch++;
	return RW_OK;
}

/* Complete every flow of e's (unchanged) component that finishes by h. */
static void complete_by(sim_t *s, const sim_ev_t *e, double h)
{
	s->epoch++;
	if (e->rail)
		component_rail(s, e->rail - 1);
	else
		component(s, e->root);
	for (uint32_t j = 0; j < s->n_comp_flows; j++) {
		uint32_t f = s->comp_flows[j];
		if (s->fin[f] <= h)
			flow_finish(s, f, s->fin[f]);
	}
}

/* ---- setup and the event loop ------------------------------------------------------------- */

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* Group the flows by their source node (by_dst = 0) or destination node (1), each group in
 * (wave, flow index) order: off[] gets the CSR offsets (N + 1 entries, zeroed by the caller),
 * order[] the flow indices, and ptr[] a copy of off[] (each group's cursor). keys holds n_flows
 * entries of scratch. */
static void group_by_wave(const rw_sim_flow_t *fl, uint32_t n_flows, uint32_t nodes, int by_dst,
			  uint64_t *keys, uint32_t *off, uint32_t *ptr, uint32_t *order)
{
	for (uint32_t f = 0; f < n_flows; f++)
		off[(by_dst ? fl[f].dst : fl[f].src) + 1]++;
	for (uint32_t n = 0; n < nodes; n++)
		off[n + 1] += off[n];
	memcpy(ptr, off, nodes * sizeof(uint32_t));
	for (uint32_t f = 0; f < n_flows; f++)
		keys[ptr[by_dst ? fl[f].dst : fl[f].src]++] = (uint64_t)fl[f].wave << 32 | f;
	for (uint32_t n = 0; n < nodes; n++) {
		uint32_t a = off[n], b = off[n + 1];
		qsort(keys + a, b - a, sizeof(uint64_t), cmp_u64);
		for (uint32_t j = a; j < b; j++)
			order[j] = (uint32_t)keys[j];
	}
	memcpy(ptr, off, nodes * sizeof(uint32_t));
}

typedef struct sim_tag {
	rw_sim_flow_t fl;
	uint32_t idx;
} sim_tag_t;

static int cmp_tag(const void *a, const void *b)
{
	const sim_tag_t *x = a, *y = b;
	uint32_t kx[5] = { x->fl.rail, x->fl.src, x->fl.wave, x->fl.dst, x->idx };
	uint32_t ky[5] = { y->fl.rail, y->fl.src, y->fl.wave, y->fl.dst, y->idx };
	for (int i = 0; i < 4; i++)
		if (kx[i] != ky[i])
			return kx[i] < ky[i] ? -1 : 1;
	if (x->fl.bytes != y->fl.bytes) /* then equal flows are interchangeable: the input */
		return x->fl.bytes < y->fl.bytes ? -1 : 1; /* order cannot change the result */
	return kx[4] < ky[4] ? -1 : kx[4] > ky[4];
}

static void sim_free(sim_t *s)
{
	free(s->fl); free(s->orig); free(s->rail_active); free(s->rail_whole); free(s->ep); free(s->ip);
	free(s->rem); free(s->rate); free(s->nrate); free(s->work); free(s->t_upd); free(s->t_start); free(s->fin);
	free(s->pos_e); free(s->pos_i); free(s->state);
	free(s->port_off); free(s->port_len); free(s->port_list); free(s->port_comp);
	free(s->stamp); free(s->kcnt); free(s->cap); free(s->frozen);
	free(s->touched); free(s->touch_stamp); free(s->stack); free(s->comp_ports);
	free(s->comp_flows); free(s->order); free(s->node_off); free(s->node_next);
	free(s->node_left); free(s->ready); free(s->pair_active); free(s->src_active);
	free(s->in_off); free(s->in_order); free(s->in_ptr); free(s->wait_head); free(s->wait_next);
	free(s->moved); free(s->moved_flag);
	free(s->ev); free(s->ph);
}

/* The engine on one set of flows (already checked). */
static rw_status_t engine_run(const rw_sim_fabric_t *fab, const rw_sim_opts_t *opts,
			      const rw_sim_flow_t *flows, size_t n_flows, double *finish,
			      rw_sim_result_t *res)
{
	sim_t s;
	memset(&s, 0, sizeof(s));
	s.fab = fab;
	s.opts = opts;
	s.F = n_flows;
	s.N = fab->nodes;
	s.R = fab->rails;
	s.NR = s.N * s.R;
	s.P = 2 * s.NR;
	s.finish_out = finish;
	const size_t F = n_flows ? n_flows : 1, N = s.N, P = s.P;
	uint64_t *keys = NULL;
	rw_status_t st = RW_ERR_NOMEM;
	s.fl = malloc(F * sizeof(rw_sim_flow_t));
	s.orig = malloc(F * sizeof(uint32_t));
	s.rail_active = calloc(s.R, sizeof(uint32_t));
	s.rail_whole = calloc(s.R, sizeof(uint32_t));
	s.ep = malloc(F * sizeof(uint32_t));
	s.ip = malloc(F * sizeof(uint32_t));
	s.rem = malloc(F * sizeof(double));
	s.rate = calloc(F, sizeof(double));
	s.nrate = calloc(F, sizeof(double));
	s.work = calloc(P, sizeof(double));
	s.t_upd = malloc(F * sizeof(double));
	s.t_start = malloc(F * sizeof(double));
	s.fin = malloc(F * sizeof(double));
	s.pos_e = malloc(F * sizeof(uint32_t));
	s.pos_i = malloc(F * sizeof(uint32_t));
	s.state = calloc(F, 1);
	s.port_off = calloc(P + 1, sizeof(uint32_t));
	s.port_len = calloc(P, sizeof(uint32_t));
	s.port_list = malloc(2 * F * sizeof(uint32_t));
	s.port_comp = calloc(P, sizeof(uint32_t));
	s.stamp = calloc(P, sizeof(uint32_t));
	s.kcnt = calloc(P, sizeof(uint32_t));
	s.cap = calloc(P, sizeof(double));
	s.frozen = calloc(P, 1);
	s.touched = malloc(P * sizeof(uint32_t));
	s.touch_stamp = calloc(P, sizeof(uint32_t));
	s.stack = malloc(P * sizeof(uint32_t));
	s.comp_ports = malloc(P * sizeof(uint32_t));
	s.comp_flows = malloc(F * sizeof(uint32_t));
	s.order = malloc(F * sizeof(uint32_t));
	s.node_off = calloc(N + 1, sizeof(uint32_t));
	s.node_next = calloc(N, sizeof(uint32_t));
	s.node_left = calloc(N, sizeof(uint32_t));
	s.ready = malloc(N * sizeof(uint32_t));
	s.pair_active = calloc(N * N, sizeof(uint32_t));
	s.src_active = calloc(N, sizeof(uint32_t));
	s.in_off = calloc(N + 1, sizeof(uint32_t));
	s.in_order = malloc(F * sizeof(uint32_t));
	s.in_ptr = calloc(N, sizeof(uint32_t));
	s.wait_head = malloc(N * sizeof(uint32_t));
	s.wait_next = malloc(N * sizeof(uint32_t));
	s.moved = malloc(N * sizeof(uint32_t));
	s.moved_flag = calloc(N, 1);
	keys = malloc(F * sizeof(uint64_t));
	if (!s.nrate || !s.work || !s.fl || !s.orig || !s.rail_active || !s.rail_whole || !s.ep || !s.ip || !s.rem || !s.rate || !s.t_upd || !s.t_start ||
	    !s.fin || !s.pos_e || !s.pos_i || !s.state || !s.port_off || !s.port_len ||
	    !s.port_list || !s.port_comp || !s.stamp || !s.kcnt || !s.cap || !s.frozen ||
	    !s.touched || !s.touch_stamp || !s.stack || !s.comp_ports || !s.comp_flows ||
	    !s.order || !s.node_off || !s.node_next || !s.node_left || !s.ready ||
	    !s.pair_active || !s.src_active || !keys || !s.in_off || !s.in_order || !s.in_ptr ||
	    !s.wait_head || !s.wait_next || !s.moved || !s.moved_flag)
		goto cleanup;
	for (uint32_t n = 0; n < N; n++)
		s.wait_head[n] = UINT32_MAX;

	/* Internal order (rail, src, wave, dst, bytes, input index): a port's flows sit together
	 * in memory, and the result does not depend on the order the caller listed them in. */
	{
		sim_tag_t *tag = malloc(F * sizeof(sim_tag_t));
		if (!tag)
			goto cleanup;
		for (uint32_t f = 0; f < n_flows; f++)
			tag[f] = (sim_tag_t){ flows[f], f };
		qsort(tag, n_flows, sizeof(sim_tag_t), cmp_tag);
		for (uint32_t f = 0; f < n_flows; f++) {
			s.orig[f] = tag[f].idx;
			s.fl[f] = tag[f].fl;
			s.ep[f] = s.fl[f].rail * s.N + s.fl[f].src;
			s.ip[f] = s.NR + s.fl[f].rail * s.N + s.fl[f].dst;
		}
		free(tag);
	}

	/* Port lists: capacity = every flow that ever uses the port (CSR). */
	for (uint32_t f = 0; f < n_flows; f++) {
		s.port_off[eport(&s, f) + 1]++;
		s.port_off[iport(&s, f) + 1]++;
	}
	for (uint32_t p = 0; p < P; p++)
		s.port_off[p + 1] += s.port_off[p];
	/* Per-node send order and flows into each node, both by (wave, index). */
	group_by_wave(s.fl, (uint32_t)n_flows, (uint32_t)N, 0, keys, s.node_off, s.node_next, s.order);
	group_by_wave(s.fl, (uint32_t)n_flows, (uint32_t)N, 1, keys, s.in_off, s.in_ptr, s.in_order);
	s.epoch = s.touch_epoch = 1;
	s.next_comp = 1; /* port_comp 0 = never allocated */

	for (uint32_t n = 0; n < N; n++)
		node_start_next(&s, n, 0.0);
	if ((st = allocate_touched(&s, 0.0)) != RW_OK)
		goto cleanup;
	uint64_t events = 0;
	while (ev_top_valid(&s)) {
		sim_ev_t first = s.ev[0];
		ev_pop(&s);
		/* Batching only where it saves work: a dense rail (whole-rail allocation, cost
		 * O(flows on the rail)); small components are simulated exactly. */
		double window = first.rail ? opts->batch_eps * first.dur : 0;
		double h = first.t + window;
		double h_tol = h + h * 1e-12; /* completions equal up to rounding happen together */
		s.batch_end = first.t;
		complete_by(&s, &first, h_tol);
		while (ev_top_valid(&s) && s.ev[0].t <= h_tol) {
			sim_ev_t e = s.ev[0];
			ev_pop(&s);
			complete_by(&s, &e, h_tol);
		}
		/* Exact: the rates change when the last of these completions happens; batched: at
		 * the end of the window. */
		double t = window > 0 && h > s.batch_end ? h : s.batch_end;
		gate_wake(&s);
		for (size_t j = 0; j < s.n_ready; j++)
			node_start_next(&s, s.ready[j], t);
		s.n_ready = 0;
		if ((st = allocate_touched(&s, t)) != RW_OK)
			goto cleanup;
		events++;
	}
	for (uint32_t f = 0; f < n_flows; f++) {
		if (s.state[f] != FLOW_DONE) { /* cannot happen: every started flow completes */
			st = RW_ERR_STATE;
			goto cleanup;
		}
	}
	*res = (rw_sim_result_t){ .time = s.end, .bytes = s.delivered, .events = events,
				   .max_fan_in = s.max_fan_in, .violations = s.violations };
	st = RW_OK;
cleanup:
	free(keys);
	sim_free(&s);
	return st;
}

/* ---- independent rails: one simulation per rail, in parallel ------------------------------ */

typedef struct rail_job {
	const rw_sim_fabric_t *fab;
	const rw_sim_opts_t *opts;
	const rw_sim_flow_t *flows;
	size_t n_flows;
	double *finish;
	uint32_t *rail_off;      /* [R + 1]: by_rail[rail_off[r] ..] are rail r's input indices */
	uint32_t *by_rail;
	atomic_uint next;
	rw_sim_result_t res[RW_MAX_RAILS];
	rw_status_t st[RW_MAX_RAILS];
} rail_job_t;

static rw_status_t run_one_rail(rail_job_t *job, uint32_t r)
{
	uint32_t a = job->rail_off[r], n = job->rail_off[r + 1] - a;
	rw_sim_fabric_t one = { .nodes = job->fab->nodes, .rails = 1, .rail_Bps = { job->fab->rail_Bps[r] } };
	rw_sim_flow_t *fl = calloc(n ? n : 1, sizeof(*fl));
	double *fin = job->finish ? malloc((n ? n : 1) * sizeof(double)) : NULL;
	rw_status_t st = RW_ERR_NOMEM;
	if (!fl || (job->finish && !fin))
		goto cleanup;
	for (uint32_t j = 0; j < n; j++) {
		fl[j] = job->flows[job->by_rail[a + j]];
		fl[j].rail = 0;
	}
	st = engine_run(&one, job->opts, fl, n, fin, &job->res[r]);
	if (st == RW_OK && fin)
		for (uint32_t j = 0; j < n; j++)
			job->finish[job->by_rail[a + j]] = fin[j];
cleanup:
	free(fl);
	free(fin);
	return st;
}

static void *rail_worker(void *arg)
{
	rail_job_t *job = arg;
	for (;;) {
		uint32_t r = atomic_fetch_add(&job->next, 1);
		if (r >= job->fab->rails)
			return NULL;
		job->st[r] = run_one_rail(job, r);
	}
}

static rw_status_t run_by_rail(const rw_sim_fabric_t *fab, const rw_sim_opts_t *opts,
			       const rw_sim_flow_t *flows, size_t n_flows, double *finish,
			       rw_sim_result_t *res)
{
	const uint32_t R = fab->rails, N = fab->nodes;
	rail_job_t *job = calloc(1, sizeof(*job));
	uint32_t *fan = calloc(N, sizeof(uint32_t));
	uint8_t *pair = calloc((size_t)N * N, 1);
	rw_status_t st = RW_ERR_NOMEM;
	if (!job || !fan || !pair)
		goto cleanup;
	*job = (rail_job_t){ .fab = fab, .opts = opts, .flows = flows, .n_flows = n_flows, .finish = finish };
	job->rail_off = calloc(R + 1, sizeof(uint32_t));
	job->by_rail = malloc((n_flows ? n_flows : 1) * sizeof(uint32_t));
	if (!job->rail_off || !job->by_rail)
		goto cleanup;
	for (size_t f = 0; f < n_flows; f++)
		job->rail_off[flows[f].rail + 1]++;
	for (uint32_t r = 0; r < R; r++)
		job->rail_off[r + 1] += job->rail_off[r];
	{
		uint32_t cur[RW_MAX_RAILS];
		memcpy(cur, job->rail_off, R * sizeof(uint32_t));
		for (size_t f = 0; f < n_flows; f++)
			job->by_rail[cur[flows[f].rail]++] = (uint32_t)f;
	}
	atomic_init(&job->next, 0);
	uint32_t threads = opts->threads;
	if (threads == 0) {
		long cpus = sysconf(_SC_NPROCESSORS_ONLN);
		threads = cpus > 0 ? (uint32_t)cpus : 1;
	}
	if (threads > R)
		threads = R;
	pthread_t tid[RW_MAX_RAILS];
	uint32_t started = 0;
	for (uint32_t i = 1; i < threads; i++) {
		if (pthread_create(&tid[started], NULL, rail_worker, job) != 0)
			break; /* fewer helpers: the work is shared out all the same */
		started++;
	}
	rail_worker(job);
	for (uint32_t i = 0; i < started; i++)
		pthread_join(tid[i], NULL);
	rw_sim_result_t sum = { 0 };
	for (uint32_t r = 0; r < R; r++) {
		if (job->st[r] != RW_OK) {
			st = job->st[r];
			goto cleanup;
		}
		if (job->res[r].time > sum.time)
			sum.time = job->res[r].time;
		sum.bytes += job->res[r].bytes;
		sum.events += job->res[r].events;
		sum.violations += job->res[r].violations;
	}
	/* Every flow starts at t = 0 here, so the most senders at once is the static fan-in. */
	for (size_t f = 0; f < n_flows; f++) {
		size_t k = (size_t)flows[f].src * N + flows[f].dst;
		if (!pair[k]) {
			pair[k] = 1;
			if (++fan[flows[f].dst] > sum.max_fan_in)
				sum.max_fan_in = fan[flows[f].dst];
		}
	}
	*res = sum;
	st = RW_OK;
cleanup:
	if (job) {
		free(job->rail_off);
		free(job->by_rail);
	}
	free(job);
	free(fan);
	free(pair);
	return st;
}

static rw_status_t check_input(const rw_sim_fabric_t *fab, const rw_sim_opts_t *opts,
			       const rw_sim_flow_t *flows, size_t n)
{
	if (!fab || !opts || (n && !flows) || fab->nodes == 0 || fab->nodes > RW_MAX_NODES ||
	    fab->rails == 0 || fab->rails > RW_MAX_RAILS || n > UINT32_MAX / 2)
		return RW_ERR_INVAL;
	if ((unsigned)opts->model >= RW_SIM_MODEL_COUNT || !(opts->hol >= 0 && opts->hol <= 1) ||
	    !(opts->batch_eps >= 0 && opts->batch_eps < 1e6))
		return RW_ERR_INVAL;
	for (uint32_t r = 0; r < fab->rails; r++)
		if (!(fab->rail_Bps[r] > 0 && isfinite(fab->rail_Bps[r])))
			return RW_ERR_INVAL;
	for (size_t f = 0; f < n; f++) {
		const rw_sim_flow_t *x = &flows[f];
		if (x->src >= fab->nodes || x->dst >= fab->nodes || x->src == x->dst ||
		    x->rail >= fab->rails || !(x->bytes > 0 && isfinite(x->bytes)))
			return RW_ERR_INVAL;
	}
	return RW_OK;
}

/* Rails are independent when no flow starts after t = 0: every node's flows share one wave
 * (with the receiver gate: every flow has the same wave, or a gate couples the rails). */
static int rails_independent(const rw_sim_fabric_t *fab, const rw_sim_flow_t *flows, size_t n,
			     int gate)
{
	for (size_t f = 1; f < n && gate; f++)
		if (flows[f].wave != flows[0].wave)
			return 0;
	uint32_t *wave = malloc(fab->nodes * sizeof(uint32_t));
	uint8_t *seen = calloc(fab->nodes, 1);
	int indep = wave && seen;
	for (size_t f = 0; f < n && indep; f++) {
		uint32_t s = flows[f].src;
		if (!seen[s]) {
			seen[s] = 1;
			wave[s] = flows[f].wave;
		}
		indep = wave[s] == flows[f].wave;
	}
	free(wave);
	free(seen);
	return indep;
}

rw_status_t rw_sim_run(const rw_sim_fabric_t *fab, const rw_sim_opts_t *opts,
		       const rw_sim_flow_t *flows, size_t n_flows, double *finish,
		       rw_sim_result_t *res)
{
	rw_status_t st = check_input(fab, opts, flows, n_flows);
	if (st != RW_OK || !res)
		return st != RW_OK ? st : RW_ERR_INVAL;
	if (fab->rails > 1 && rails_independent(fab, flows, n_flows, opts->wave_gate))
		return run_by_rail(fab, opts, flows, n_flows, finish, res);
	return engine_run(fab, opts, flows, n_flows, finish, res);
}

/* ---- options ------------------------------------------------------------------------------ */

void rw_sim_opts_default(rw_sim_opts_t *opts)
{
	*opts = (rw_sim_opts_t){ .model = RW_SIM_LOSSLESS, .hol = 1.0, .batch_eps = 1e-3,
				 .wave_gate = 1 };
}

double rw_sim_hol_throughput(uint32_t k)
{
	/* Karol, Hluchyj, Morgan, "Input versus output queueing on a space-division packet
	 * switch", IEEE Trans. Commun. 35(12), 1987, Table I; beyond 8 the gap to 2 - sqrt(2)
	 * shrinks as 1/k, as it does from 6 to 8. */
	static const double table[9] = { 1.0, 1.0, 0.75, 0.6825, 0.6553, 0.6399, 0.6302, 0.6234, 0.6184 };
	if (k <= 8)
		return table[k];
	return 0.5858 + (0.6184 - 0.5858) * 8.0 / k;
}

static const char *const model_names[RW_SIM_MODEL_COUNT] = { "lossless", "maxmin" };

const char *rw_sim_model_name(rw_sim_model_t model)
{
	return (unsigned)model < RW_SIM_MODEL_COUNT ? model_names[model] : "?";
}

rw_status_t rw_sim_model_parse(const char *name, rw_sim_model_t *model_p)
{
	for (int m = 0; m < RW_SIM_MODEL_COUNT; m++)
		if (name && strcmp(name, model_names[m]) == 0) {
			*model_p = (rw_sim_model_t)m;
			return RW_OK;
		}
	return RW_ERR_INVAL;
}
