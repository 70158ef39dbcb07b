/* railwaved's phase executor (docs/dataflow.md): gathers every local rank's dispatch of a group,
 * all-gathers count rows with the peers, decides path and plan identically on every node, packs
 * and writes each (destination, rail) slab wave by wave, forwards arriving records to the local
 * ranks hosting their experts, and runs combine back along the same (rail, slot)s, summing in
 * fp32 into the owners' token positions. Also the daemon hooks rw_svc_mesh_start/stop,
 * rw_svc_ipc_start/stop and rw_svc_shutdown_begin. Everything runs on the loop thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ipc/ipc.h"
#include "service/mesh.h"
#include "service/phase.h"
#include "service/svc.h"

#define SLOTS 2               /* pairs (of different groups) in flight at once per node */
#define SUB_RD 0              /* receive: dispatch records */
#define SUB_RC 1              /* receive: combine records */
#define SUB_SD 2              /* send: dispatch slabs */
#define SUB_SC 3              /* send: combine slabs */
#define CHUNK_MAX (4u << 20)  /* largest single rail write we post */
#define TICK_S 0.05           /* slot waits, stale rows */
#define BG_SLICE 32u          /* local-node records per idle slice (pair_local_work) */

enum stage {
	ST_GATHER_D = 0, /* waiting for local dispatch submissions */
	ST_WAIT_SLOT,    /* gathered; waiting for a free receive slot */
	ST_EXCHANGE,     /* our row sent; waiting for the peers' rows */
	ST_RUN_D,        /* sending and receiving dispatch records */
	ST_WAIT_C,       /* dispatch completed; waiting for combine submissions */
	ST_RUN_C,        /* sending and receiving combine records */
};

typedef struct exec_pair exec_pair_t;
typedef struct exec_group exec_group_t;

typedef struct exec_member {
	exec_group_t *g;
	rw_ipc_client_t *client;
	uint32_t local;
	/* Pinned host staging of a rank with CUDA buffers ("CUDA buffers"): `in` holds its
	 * dispatch inputs (tokens | ids | weights), later its combine rows; `out` its dispatch
	 * output (counts | rows | metadata), later its combine output. One pair of a group runs at
	 * a time and each use ends before the next starts, so two buffers per rank suffice. */
	rw_svc_pinned_t in, out;
} exec_member_t;

struct exec_group {
	exec_group_t *next;
	char name[RW_GROUP_NAME_MAX];
	uint32_t hash;
	uint32_t world;
	exec_member_t *member[RW_MAX_GPUS];
	uint32_t n_members;
	exec_pair_t *pair;           /* the open pair, or NULL */
};

/* A dispatch key that failed here or at a peer ("Failures": a failed phase's stragglers): a
 * local rank that submits it and was not answered yet gets RW_E_PHASE at once instead of
 * opening a pair that would wait for a phase timeout. Kept per node, not per group, so it
 * outlives a group whose ranks all left and precedes one whose ranks have not joined yet.
 * Gone once every local rank was answered (or left), when an answered rank submits the key
 * again (a retry), or after phase_timeout_ms. */
typedef struct exec_tomb {
	struct exec_tomb *next;
	rw_wire_key_t key;           /* key.group: the group's hash */
	uint32_t answered;           /* bit g: local rank g got its error (or left) */
	uint64_t t_ns;
} exec_tomb_t;

/* A peer's attempt at a key that ended here: its count row (epoch) was in a pair that failed
 * here, or came while the key was a tomb. A PHASE_ERR that names that epoch later is about that
 * attempt, not about a retry of the key that may be running now. Kept for a phase timeout. */
typedef struct exec_dead {
	struct exec_dead *next;
	rw_wire_key_t key;
	uint32_t node, epoch;
	uint64_t t_ns;
} exec_dead_t;

typedef struct exec_sub {
	int have;                    /* a completion is owed to this rank */
	int ready;                   /* its inputs are readable on the host (staged if CUDA) */
	uint32_t marks;              /* staging copies of its inputs not yet done */
	rw_sqe_t sqe;
	rw_ipc_client_t *client;
	const uint8_t *tokens;       /* host: the rank's memory, or its staging */
	const int32_t *ids;          /* dispatch only */
	const float *weights;        /* dispatch only */
	uint8_t *out;                /* host output, or NULL when it is CUDA memory: */
	int out_dev;                 /*   its device (-1: host) */
	uint64_t out_dptr;           /*   and address in this process */
	uint32_t out_buf;
	uint64_t out_cap;
	uint8_t *counts_dst, *rows_dst, *meta_dst; /* dispatch output, host side (maybe staging) */
} exec_sub_t;

typedef struct exec_row {         /* a peer's row that came before we were ready for it */
	struct exec_row *next;
	char group[RW_WIRE_GROUP_MAX];
	rw_wire_key_t key;
	uint32_t node, slot;
	rw_wire_phase_params_t params;
	uint64_t t_ns;
	uint32_t row[];
} exec_row_t;

struct exec_pair {
	exec_pair_t *next;           /* exec->pairs */
	struct rw_svc_exec *x;
	exec_group_t *g;
	rw_wire_key_t key;
	uint32_t tag;
	enum stage stage;
	int dead;                    /* failed/closed; freed when no write is outstanding */
	uint32_t outstanding;        /* our rail writes not yet done */
	uint64_t t0;
	ev_timer timer;
	rw_wire_phase_params_t params; /* ours (from local submissions) */
	uint32_t n_experts, topk, hidden, dtype;
	uint64_t row_bytes, rec_size, crec_size;
	exec_sub_t dsub[RW_MAX_GPUS], csub[RW_MAX_GPUS];
	uint32_t n_dsub, n_csub;
	uint32_t answered;           /* local ranks already answered with an error for this key */
	uint32_t serial;             /* names the pair in staging tokens */
	uint32_t cuda_pending;       /* staging marks not yet delivered */
	int flushing;                /* outputs are being copied to CUDA ranks; then complete */
	uint32_t flush_pending;
	int slot;                    /* ours, -1 until held */
	uint32_t *peer_slot;         /* [N] */
	uint8_t *have_row;           /* [N] */
	uint32_t n_rows;
	uint32_t *counts;            /* [N*N*R] */
	rw_sched_feat_acc_t feat_acc; /* features folded in row by row as rows arrive */
	void *feat_ws;
	rw_wire_phase_params_t *peer_params; /* [N] */
	rw_rank_tokens_t rt[RW_MAX_GPUS];
	uint32_t *row_off;           /* [N*R+1] CSR of our records */
	rw_record_t *rec;
	rw_svc_layout_t layout;
	int have_layout;
	rw_path_t path;
	uint64_t phase_t0;
	/* sending: the wave being posted and, while `posting`, where posting resumes */
	uint32_t wave, send_pending;
	int sends_done;
	int posting, pace_wait;
	uint32_t cur_k, k_hi, cur_r;
	int grant_wait;              /* kind + 1: waiting for the grant of wave `wave` + 1 */
	/* waved paths, per kind (docs/dataflow.md "Send"): granted[k][w] = our wave-w destination
	 * admitted us; as receiver, in_lo[k] = the lowest wave whose inbound data is not all here
	 * and grant_hi[k] the highest wave granted; src_active[k][s] = bytes of s arrived, its
	 * ranges not all complete; n_active[k] how many such sources. */
	uint8_t *granted[2];         /* [N], by wave */
	uint8_t *src_active[2];      /* [N], by source */
	uint32_t in_lo[2], grant_hi[2], n_active[2];
	uint64_t cur_off;
	uint64_t wave_t0, wave_slab_max; /* for the debug trace: when this wave was posted, and
					  * its largest single (destination, rail) slab */
	ev_timer pace;               /* test hook RAILWAVE_TEST_WRITE_GAP_MS */
	/* receiving, per kind: bytes arrived and ranges completed per (peer, rail) */
	uint64_t *arrived[2];        /* [N*R] */
	uint8_t *range_done[2];      /* [N*R] */
	uint32_t ranges_left[2];
	uint32_t rail_base[RW_MAX_RAILS + 1];
	uint32_t n_in, n_local;
	uint32_t *local_ref;         /* [n_local]: rank << 24 | token ... stored as pairs */
	uint32_t *fwd_ref[RW_MAX_GPUS];
	uint32_t fwd_n[RW_MAX_GPUS];
	rw_svc_out_layout_t out[RW_MAX_GPUS];
	uint32_t *expert_counts[RW_MAX_GPUS];
	uint32_t handle[RW_MAX_GPUS];
	float *owner_acc[RW_MAX_GPUS];
	/* combine ("Combine"): contrib[ref * G + g] = 1 + the row of received record ref in local
	 * rank g's combine input (0: not sent to g); crow: one fp32 row for summing copies. */
	uint32_t *contrib;           /* [n_in * G] */
	float *crow;                 /* [hidden] */
	/* packed[kind][d]: d's slabs of that kind are packed (each just before its wave is
	 * posted); pack_egress/pack_slot: rw_sched_map_rail's output for one dispatch slab. */
	uint8_t *packed[2];          /* [N] */
	uint8_t *pack_egress;
	uint32_t *pack_slot;
	/* local-node records' work per kind (pair_local_work), sliced on the idle watcher; the
	 * running kind resumes at local rank bg_g, row/record bg_i */
	uint8_t local[2];            /* LOCAL_* */
	uint32_t bg_g, bg_i;
};

struct rw_svc_exec {
	rw_svc_t *svc;
	rw_svc_mesh_t *mesh;
	rw_ipc_server_t *ipc;
	uint32_t nodes, rails, gpus, me;
	uint64_t area_bytes, sub_bytes;
	int slot_busy[SLOTS];
	uint64_t slot_free_at[SLOTS];
	exec_group_t *groups;
	exec_pair_t *pairs;          /* open and dead-but-draining pairs */
	exec_row_t *rows;            /* early rows */
	exec_tomb_t *tombs;          /* failed keys */
	exec_dead_t *dead;           /* peers' attempts that ended here */
	rw_svc_stage_t *stage;       /* CUDA staging streams */
	uint32_t next_serial;
	uint32_t next_handle;
	ev_timer tick;
	ev_idle bg;                  /* runs pairs' local work between network events */
	/* Test hooks (docs/dataflow.md "Tests"): cap every rail write at test_chunk bytes and post
	 * one write per test_gap_s per pair, so a test can act while writes are in flight. */
	uint64_t test_chunk;
	double test_gap_s;
	uint32_t bg_slice;           /* records per idle slice: BG_SLICE, or RAILWAVE_TEST_LOCAL_SLICE */
};

typedef struct rw_svc_exec rw_svc_exec_t;

static void pair_fail(exec_pair_t *p, rw_status_t st, int client_err, const char *msg, int tell);
static void pair_try_decide(exec_pair_t *p);
static void pair_send_wave(exec_pair_t *p, int kind);
static void pair_check_done(exec_pair_t *p);
static void pair_gathered(exec_pair_t *p);
static void pair_start_combine(exec_pair_t *p);
static void pair_maybe_gathered(exec_pair_t *p);
static void pair_maybe_start_combine(exec_pair_t *p);
static void csub_ready(exec_pair_t *p, uint32_t g);
static void combine_pack(exec_pair_t *p, uint32_t d);
static void combine_local(exec_pair_t *p, uint32_t budget);
static void complete_dispatch(exec_pair_t *p);
static void complete_combine(exec_pair_t *p);

enum { OP_DIN = 1, OP_CIN = 2, OP_FLUSH = 3 }; /* staging mark kinds */
enum { LOCAL_IDLE, LOCAL_RUNNING, LOCAL_DONE };  /* exec_pair.local[kind] */

/* The kind of the phase a pair is in: 0 dispatch, 1 combine. */
static int pair_kind(const exec_pair_t *p) { return p->stage >= ST_WAIT_C; }

static uint64_t stage_token(const exec_pair_t *p, int op, uint32_t g)
{
	return (uint64_t)p->serial << 32 | (uint64_t)op << 8 | g;
}

static uint64_t sub_off(const rw_svc_exec_t *x, int slot, int sub)
{
	return ((uint64_t)slot * 4u + (uint64_t)sub) * x->sub_bytes;
}

/* Phase milestones at debug level, in ms since the phase began here (docs/dataflow.md). */
#define PTRACE(p, fmt, ...) /* t= monotonic ms, comparable with the ranks' clocks */          \
	rw_dbg("L%u s%llu %s t=%.1f +%.1f ms: " fmt, (p)->key.layer,                              \
	       (unsigned long long)(p)->key.step, (p)->stage >= ST_RUN_C ? "combine" : "dispatch",  \
	       (double)rw_now_ns() / 1e6, (double)(rw_now_ns() - (p)->phase_t0) / 1e6, __VA_ARGS__)

static uint32_t wire_dtype(uint8_t d) { return d == RW_DTYPE_BF16 ? RW_WIRE_BF16 : RW_WIRE_F32; }

static int phase_running(const exec_pair_t *p)
{
	return !p->dead && p->stage != ST_WAIT_C;
}

/* ---- completions ------------------------------------------------------------------------- */

/* The completion of submission sqe with what every completion carries (kind, phase id and
 * user data copied from it; no counts buffer); the caller fills in the rest. */
static rw_cqe_t cqe_for(const rw_sqe_t *sqe, uint8_t status)
{
	rw_cqe_t c;
	memset(&c, 0, sizeof(c));
	c.status = status;
	c.kind = sqe->kind;
	c.phase_id = sqe->phase_id;
	c.user_data = sqe->user_data;
	c.counts_buf = RW_BUF_NONE;
	return c;
}

static void complete_err(rw_svc_exec_t *x, rw_ipc_client_t *client, const rw_sqe_t *sqe, int err)
{
	if (!x->ipc)
		return;
	rw_cqe_t c = cqe_for(sqe, RW_CQ_ERROR);
	c.error = err;
	rw_ipc_complete(x->ipc, client, &c);
}

/* ---- pair lifetime ----------------------------------------------------------------------- */

static void pair_release_slot(exec_pair_t *p, int clean)
{
	rw_svc_exec_t *x = p->x;
	if (p->slot < 0)
		return;
	x->slot_busy[p->slot] = 0;
	/* After a failure a peer may still have writes in flight towards this slot; keep it idle
	 * for a heartbeat timeout (docs/dataflow.md "Region reuse"). */
	x->slot_free_at[p->slot] = clean ? 0 :
		rw_now_ns() + (uint64_t)x->svc->cfg.heartbeat_timeout_ms * 1000000ull;
	p->slot = -1;
}

static void pair_free_mem(exec_pair_t *p)
{
	free(p->peer_slot);
	free(p->have_row);
	free(p->feat_ws);
	p->feat_ws = NULL;
	free(p->counts);
	free(p->peer_params);
	free(p->row_off);
	free(p->rec);
	rw_svc_layout_free(&p->layout);
	for (int k = 0; k < 2; k++) {
		free(p->arrived[k]);
		free(p->range_done[k]);
		p->arrived[k] = NULL;
		p->range_done[k] = NULL;
		free(p->granted[k]);
		free(p->src_active[k]);
		p->granted[k] = NULL;
		p->src_active[k] = NULL;
	}
	free(p->local_ref);
	free(p->contrib);
	free(p->crow);
	p->contrib = NULL;
	p->crow = NULL;
	for (int k = 0; k < 2; k++) {
		free(p->packed[k]);
		p->packed[k] = NULL;
	}
	free(p->pack_egress);
	free(p->pack_slot);
	p->pack_egress = NULL;
	p->pack_slot = NULL;
	for (uint32_t g = 0; g < RW_MAX_GPUS; g++) {
		free(p->fwd_ref[g]);
		free(p->expert_counts[g]);
		free(p->owner_acc[g]);
		p->fwd_ref[g] = NULL;
		p->expert_counts[g] = NULL;
		p->owner_acc[g] = NULL;
	}
	p->peer_slot = NULL;
	p->have_row = NULL;
	p->counts = NULL;
	p->peer_params = NULL;
	p->row_off = NULL;
	p->rec = NULL;
	p->local_ref = NULL;
}

static void pair_unlink(exec_pair_t *p)
{
	for (exec_pair_t **pp = &p->x->pairs; *pp; pp = &(*pp)->next)
		if (*pp == p) {
			*pp = p->next;
			return;
		}
}

/* Close a pair (success or failure): stop using client buffers at once; the struct lives until
 * its last outstanding write reports. */
static void pair_close(exec_pair_t *p, int clean)
{
	rw_svc_exec_t *x = p->x;
	if (p->dead)
		return;
	p->dead = 1;
	ev_timer_stop(x->svc->loop, &p->timer);
	ev_timer_stop(x->svc->loop, &p->pace);
	pair_release_slot(p, clean);
	if (p->g && p->g->pair == p)
		p->g->pair = NULL;
	p->g = NULL;
	pair_free_mem(p);
	if (p->outstanding == 0) {
		pair_unlink(p);
		free(p);
	}
	if (x->svc->draining) {
		int busy = 0;
		for (exec_pair_t *q = x->pairs; q; q = q->next)
			busy |= phase_running(q);
		if (!busy)
			rw_svc_stop(x->svc);
	}
}

static void timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	exec_pair_t *p = w->data;
	char msg[128];
	snprintf(msg, sizeof(msg), "phase timed out in stage %d after %u ms", (int)p->stage,
		 p->x->svc->cfg.phase_timeout_ms);
	pair_fail(p, RW_ERR_TIMEOUT, RW_E_PHASE, msg, 1);
}

static void pace_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	exec_pair_t *p = w->data;
	p->pace_wait = 0;
	pair_send_wave(p, pair_kind(p));
}

static void pair_arm_timer(exec_pair_t *p)
{
	ev_timer_stop(p->x->svc->loop, &p->timer);
	ev_timer_set(&p->timer, p->x->svc->cfg.phase_timeout_ms / 1000.0, 0.);
	ev_timer_start(p->x->svc->loop, &p->timer);
}

static exec_pair_t *pair_new(rw_svc_exec_t *x, exec_group_t *g, const rw_wire_key_t *key)
{
	exec_pair_t *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->x = x;
	p->g = g;
	p->key = *key;
	p->tag = rw_wire_key_tag(key);
	p->slot = -1;
	p->serial = ++x->next_serial;
	p->stage = ST_GATHER_D;
	p->t0 = rw_now_ns();
	size_t n = x->nodes, nr = (size_t)x->nodes * x->rails;
	p->peer_slot = calloc(n, sizeof(uint32_t));
	p->have_row = calloc(n, 1);
	p->counts = calloc(n * nr, sizeof(uint32_t));
	size_t ws_len = rw_sched_feat_workspace(x->nodes, x->rails);
	p->feat_ws = malloc(ws_len);
	if (p->feat_ws &&
	    rw_sched_feat_begin(&p->feat_acc, &x->svc->topo, p->feat_ws, ws_len) != RW_OK) {
		free(p->feat_ws);
		p->feat_ws = NULL;
	}
	p->peer_params = calloc(n, sizeof(*p->peer_params));
	for (int k = 0; k < 2; k++) {
		p->arrived[k] = calloc(nr, sizeof(uint64_t));
		p->range_done[k] = calloc(nr, 1);
		p->granted[k] = calloc(n, 1);
		p->src_active[k] = calloc(n, 1);
		p->in_lo[k] = 1;
		p->grant_hi[k] = 1;
	}
	if (!p->granted[0] || !p->granted[1] || !p->src_active[0] || !p->src_active[1] ||
	    !p->peer_slot || !p->have_row || !p->counts || !p->feat_ws || !p->peer_params || !p->arrived[0] ||
	    !p->arrived[1] || !p->range_done[0] || !p->range_done[1] ||
	    rw_svc_layout_alloc(&p->layout, x->nodes, x->rails) != RW_OK) {
		pair_free_mem(p);
		free(p);
		return NULL;
	}
	ev_timer_init(&p->timer, timer_cb, 0., 0.);
	p->timer.data = p;
	ev_timer_init(&p->pace, pace_cb, 0., 0.);
	p->pace.data = p;
	p->next = x->pairs;
	x->pairs = p;
	g->pair = p;
	pair_arm_timer(p);
	return p;
}

/* ---- failed keys ------------------------------------------------------------------------- */

/* Drop the early rows of (group, key): all of them, or (node >= 0) node's, or (node >= 0,
 * epoch != 0) node's of that epoch only. group NULL: any group. */
static void rows_drop(rw_svc_exec_t *x, const char *group, const rw_wire_key_t *key, int node,
		      uint32_t epoch)
{
	for (exec_row_t **rp = &x->rows; *rp;) {
		exec_row_t *r = *rp;
		if ((!group || strcmp(r->group, group) == 0) && rw_wire_key_eq(&r->key, key) &&
		    (node < 0 || r->node == (uint32_t)node) && (!epoch || r->params.epoch == epoch)) {
			*rp = r->next;
			free(r);
		} else {
			rp = &r->next;
		}
	}
}

static uint32_t all_local(const rw_svc_exec_t *x) { return (uint32_t)((1ull << x->gpus) - 1); }

static exec_tomb_t **tomb_find(rw_svc_exec_t *x, const rw_wire_key_t *key)
{
	for (exec_tomb_t **tp = &x->tombs; *tp; tp = &(*tp)->next)
		if (rw_wire_key_eq(&(*tp)->key, key))
			return tp;
	return NULL;
}

static void tomb_unlink(exec_tomb_t **tp)
{
	exec_tomb_t *t = *tp;
	*tp = t->next;
	free(t);
}

/* Record that `key` failed; `answered`: local ranks that already got their error. */
static void tomb_add(rw_svc_exec_t *x, const char *group, const rw_wire_key_t *key,
		     uint32_t answered)
{
	if (group)
		rows_drop(x, group, key, -1, 0);
	exec_tomb_t **tp = tomb_find(x, key);
	exec_tomb_t *t = tp ? *tp : NULL;
	if (!t) {
		if ((answered & all_local(x)) == all_local(x))
			return;
		t = calloc(1, sizeof(*t));
		if (!t)
			return; /* stragglers then wait for a phase timeout instead */
		t->key = *key;
		t->next = x->tombs;
		x->tombs = t;
		tp = &x->tombs;
	}
	t->answered |= answered;
	t->t_ns = rw_now_ns();
	if ((t->answered & all_local(x)) == all_local(x))
		tomb_unlink(tp);
}

/* 1 when a dispatch of `key` by local rank `local` must fail at once (its phase already failed
 * here); counts the answer. */
static int tomb_hit(rw_svc_exec_t *x, const rw_wire_key_t *key, uint32_t local)
{
	exec_tomb_t **tp = tomb_find(x, key);
	if (!tp)
		return 0;
	exec_tomb_t *t = *tp;
	if (rw_now_ns() - t->t_ns > (uint64_t)x->svc->cfg.phase_timeout_ms * 1000000ull ||
	    (t->answered & (1u << local))) {
		tomb_unlink(tp); /* stale, or a retry by a rank that already had its answer */
		return 0;
	}
	t->answered |= 1u << local;
	if ((t->answered & all_local(x)) == all_local(x))
		tomb_unlink(tp);
	return 1;
}

/* Local rank `local` of the group with this hash left: it will not come for its answer. */
static void tomb_left(rw_svc_exec_t *x, uint32_t group_hash, uint32_t local)
{
	for (exec_tomb_t **tp = &x->tombs; *tp;) {
		exec_tomb_t *t = *tp;
		if (t->key.group == group_hash) {
			t->answered |= 1u << local;
			if ((t->answered & all_local(x)) == all_local(x)) {
				tomb_unlink(tp);
				continue;
			}
		}
		tp = &t->next;
	}
}

static void dead_add(rw_svc_exec_t *x, const rw_wire_key_t *key, uint32_t node, uint32_t epoch)
{
	exec_dead_t *d = malloc(sizeof(*d));
	if (!d)
		return; /* only costs a retry that a late PHASE_ERR may fail */
	*d = (exec_dead_t){ .next = x->dead, .key = *key, .node = node, .epoch = epoch,
			    .t_ns = rw_now_ns() };
	x->dead = d;
}

static int dead_find(const rw_svc_exec_t *x, const rw_wire_key_t *key, uint32_t node,
		     uint32_t epoch)
{
	for (const exec_dead_t *d = x->dead; d; d = d->next)
		if (d->node == node && d->epoch == epoch && rw_wire_key_eq(&d->key, key))
			return 1;
	return 0;
}

static void tell_peers_failed(rw_svc_exec_t *x, const rw_wire_key_t *key, int kind,
			      rw_status_t st, const char *msg, uint32_t epoch, int relay)
{
	rw_wire_phase_err_t e = { .key = *key, .kind = (uint32_t)kind, .status = st, .node = x->me,
				  .epoch = epoch, .relay = (uint32_t)relay };
	snprintf(e.msg, sizeof(e.msg), "node %u: %s", x->me, msg);
	uint8_t buf[RW_WIRE_PHASE_ERR_SIZE];
	size_t n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
	for (uint32_t peer = 0; peer < x->nodes; peer++)
		if (peer != x->me)
			rw_svc_mesh_send(x->mesh, peer, RW_WIRE_PHASE_ERR, buf, (uint32_t)n);
}

/* Fail the pair on this node: every local rank with a submission of the running kind gets an
 * error completion; `tell` broadcasts PHASE_ERR so the peers fail it too. */
static void pair_fail(exec_pair_t *p, rw_status_t st, int client_err, const char *msg, int tell)
{
	rw_svc_exec_t *x = p->x;
	if (p->dead)
		return;
	int kind = p->stage >= ST_WAIT_C ? RW_SVC_COMBINE : RW_SVC_DISPATCH;
	if (p->cuda_pending) {
		/* Copies into or out of ranks' memory are still queued: wait for them (failure
		 * path only; copies take microseconds to milliseconds), so nothing touches a rank's
		 * memory after it got its error and may reuse or free it. */
		rw_svc_stage_sync(x->stage);
		p->cuda_pending = 0;
	}
	rw_warn("group %s layer %u step %llu: %s failed (%s): %s", p->g ? p->g->name : "?",
		p->key.layer, (unsigned long long)p->key.step, rw_svc_kind_name(kind),
		rw_status_str(st), msg);
	rw_svc_metrics_error(&x->svc->metrics, st);
	rw_svc_metrics_phase(&x->svc->metrics, p->have_layout ? p->path : RW_PATH_JOINT,
			     (rw_svc_phase_kind_t)kind, 0, 0);
	exec_sub_t *subs = kind == RW_SVC_COMBINE ? p->csub : p->dsub;
	uint32_t answered = 0;
	for (uint32_t g = 0; g < x->gpus; g++)
		if (subs[g].have) {
			complete_err(x, subs[g].client, &subs[g].sqe, client_err);
			subs[g].have = 0;
			answered |= 1u << g;
		}
	if (kind == RW_SVC_DISPATCH)
		tomb_add(x, p->g ? p->g->name : NULL, &p->key, answered | p->answered);
	for (uint32_t n = 0; p->have_row && n < x->nodes; n++)
		if (n != x->me && p->have_row[n] && p->peer_params[n].epoch)
			dead_add(x, &p->key, n, p->peer_params[n].epoch);
	if (tell)
		tell_peers_failed(x, &p->key, kind, st, msg, p->params.epoch, 0);
	pair_close(p, 0);
}

/* ---- groups and clients ------------------------------------------------------------------ */

static exec_group_t *group_find(rw_svc_exec_t *x, const char *name)
{
	for (exec_group_t *g = x->groups; g; g = g->next)
		if (strcmp(g->name, name) == 0)
			return g;
	return NULL;
}

static void ipc_client_joined(void *ctx, rw_ipc_client_t *client)
{
	rw_svc_exec_t *x = ctx;
	const rw_ipc_client_info_t *info = rw_ipc_client_info(client);
	x->svc->metrics.clients++;
	if (info->world_size != x->nodes * x->gpus || info->rank / x->gpus != x->me) {
		rw_warn("rank %u of group %s: world %u / node does not fit this cluster (N=%u G=%u me=%u)",
			info->rank, info->group, info->world_size, x->nodes, x->gpus, x->me);
		rw_ipc_client_drop(x->ipc, client, RW_E_WORLD_MISMATCH);
		return;
	}
	exec_group_t *g = group_find(x, info->group);
	if (!g) {
		g = calloc(1, sizeof(*g));
		if (!g) {
			rw_ipc_client_drop(x->ipc, client, RW_E_INTERNAL);
			return;
		}
		snprintf(g->name, sizeof(g->name), "%s", info->group);
		g->hash = rw_wire_group_hash(g->name);
		g->world = info->world_size;
		g->next = x->groups;
		x->groups = g;
	}
	uint32_t local = info->rank % x->gpus;
	if (g->member[local]) {
		rw_ipc_client_drop(x->ipc, client, RW_E_RANK_DUP);
		return;
	}
	exec_member_t *mb = calloc(1, sizeof(*mb));
	if (!mb) {
		rw_ipc_client_drop(x->ipc, client, RW_E_INTERNAL);
		return;
	}
	mb->g = g;
	mb->client = client;
	mb->local = local;
	g->member[local] = mb;
	g->n_members++;
	rw_ipc_client_set_data(client, mb);
	rw_info("rank %u of group %s joined (local %u, pid %d)", info->rank, g->name, local,
		(int)info->pid);
}

/* No copy touches a member's staging once its pairs ended (pair_fail waits for them). */
static void member_free(exec_member_t *mb)
{
	rw_svc_pinned_free(&mb->in);
	rw_svc_pinned_free(&mb->out);
	free(mb);
}

static void ipc_client_left(void *ctx, rw_ipc_client_t *client, rw_ipc_leave_t reason, int error)
{
	rw_svc_exec_t *x = ctx;
	exec_member_t *mb = rw_ipc_client_data(client);
	if (x->svc->metrics.clients)
		x->svc->metrics.clients--;
	if (!mb)
		return;
	rw_ipc_client_set_data(client, NULL);
	exec_group_t *g = mb->g;
	rw_info("rank %u of group %s left (%s, %d)", rw_ipc_client_info(client)->rank, g->name,
		rw_ipc_leave_str(reason), error);
	if (g->pair) {
		/* The pair may use this rank's buffers: fail it everywhere (its data is gone). */
		exec_pair_t *p = g->pair;
		for (uint32_t i = 0; i < x->gpus; i++) { /* no completions to the leaving client */
			if (p->dsub[i].client == client)
				p->dsub[i].have = 0;
			if (p->csub[i].client == client)
				p->csub[i].have = 0;
		}
		char msg[96];
		snprintf(msg, sizeof(msg), "local rank %u left", rw_ipc_client_info(client)->rank);
		pair_fail(p, RW_ERR_CLIENT, RW_E_PHASE, msg, 1);
	}
	g->member[mb->local] = NULL;
	g->n_members--;
	tomb_left(x, g->hash, mb->local);
	member_free(mb);
	if (g->n_members == 0) {
		for (exec_group_t **gp = &x->groups; *gp; gp = &(*gp)->next)
			if (*gp == g) {
				*gp = g->next;
				break;
			}
		free(g);
	}
}

/* Where a span's bytes are: host memory (a memfd mapping) or CUDA memory (device, address). */
typedef struct span_mem {
	uint8_t *host;
	int dev;                     /* -1: host (or absent) */
	uint64_t dptr;
	uint32_t buf;
} span_mem_t;

/* 0: resolved; 1: absent (RW_BUF_NONE, allowed where the length is 0); -1: unknown buffer
 * (deregistration is refused while submissions are in flight, so not expected). */
static int span_resolve(rw_ipc_client_t *client, const rw_span_t *span, span_mem_t *m)
{
	rw_ipc_buffer_t b;
	*m = (span_mem_t){ .dev = -1, .buf = RW_BUF_NONE };
	if (span->buf_id == RW_BUF_NONE)
		return 1;
	if (rw_ipc_buffer_lookup(client, span->buf_id, &b) != RW_OK)
		return -1;
	m->buf = b.id;
	if (b.kind == RW_IPC_BUF_CUDA) {
		m->dev = b.device;
		m->dptr = b.dptr + span->offset;
		return 0;
	}
	if (!b.host)
		return -1;
	m->host = (uint8_t *)b.host + span->offset;
	return 0;
}

/* Stage a rank's CUDA inputs: `n` spans with their lengths; host ones are used in place, CUDA
 * ones are copied (async) into consecutive 64-byte aligned pieces of `stage` and `*host_p[i]`
 * points there. One mark per device used; s->marks counts them. Returns RW_OK or an error
 * (nothing is left half-enqueued that matters: the pair fails and waits for the stream). */
static rw_status_t stage_inputs(exec_pair_t *p, exec_sub_t *s, rw_svc_pinned_t *stage, int op,
				uint32_t g, const span_mem_t *m, const uint64_t *len,
				const uint8_t **host_p[], unsigned n)
{
	rw_svc_exec_t *x = p->x;
	uint64_t need = 0;
	for (unsigned i = 0; i < n; i++)
		if (m[i].dev >= 0)
			need += (len[i] + 63) & ~(uint64_t)63;
	s->marks = 0;
	for (unsigned i = 0; i < n; i++)
		*host_p[i] = m[i].host;
	if (need == 0)
		return RW_OK;
	rw_status_t st = rw_svc_pinned_reserve(stage, need);
	if (st != RW_OK)
		return st;
	uint64_t off = 0;
	int devs[4];
	unsigned ndev = 0;
	for (unsigned i = 0; i < n; i++) {
		if (m[i].dev < 0)
			continue;
		uint8_t *dst = (uint8_t *)stage->ptr + off;
		st = rw_svc_stage_d2h(x->stage, m[i].dev, dst, m[i].dptr, len[i]);
		if (st != RW_OK)
			return st;
		*host_p[i] = dst;
		off += (len[i] + 63) & ~(uint64_t)63;
		unsigned k = 0;
		while (k < ndev && devs[k] != m[i].dev)
			k++;
		if (k == ndev)
			devs[ndev++] = m[i].dev;
	}
	for (unsigned k = 0; k < ndev; k++) {
		st = rw_svc_stage_mark(x->stage, devs[k], stage_token(p, op, g));
		if (st != RW_OK)
			return st;
		s->marks++;
		p->cuda_pending++;
	}
	return RW_OK;
}

/* ---- gather and count exchange ----------------------------------------------------------- */

static int slot_take(rw_svc_exec_t *x)
{
	uint64_t now = rw_now_ns();
	for (int s = 0; s < SLOTS; s++)
		if (!x->slot_busy[s] && now >= x->slot_free_at[s]) {
			x->slot_busy[s] = 1;
			return s;
		}
	return -1;
}

/* This node's attempt number for a pair: never 0, different for every pair it opens (a reused
 * key gets a new one), so writes of an earlier attempt cannot be taken for this one's. */
static uint32_t pair_epoch(const exec_pair_t *p)
{
	uint64_t h = rw_now_ns() ^ ((uint64_t)p->serial << 32) ^ ((uint64_t)getpid() << 16);
	h ^= h >> 33;
	h *= UINT64_C(0xff51afd7ed558ccd);
	h ^= h >> 33;
	return (uint32_t)h ? (uint32_t)h : 1u;
}

/* Tag of this pair's writes into node d (d's epoch), and of writes into this node. */
static uint32_t pair_tag_to(const exec_pair_t *p, uint32_t d)
{
	return rw_wire_tag_for(p->tag, p->peer_params[d].epoch);
}

static uint32_t pair_tag_in(const exec_pair_t *p)
{
	return rw_wire_tag_for(p->tag, p->params.epoch);
}

static void pair_take_row(exec_pair_t *p, uint32_t node, uint32_t slot,
			  const rw_wire_phase_params_t *params, const uint32_t *row)
{
	rw_svc_exec_t *x = p->x;
	if (p->have_row[node])
		return;
	size_t nr = (size_t)x->nodes * x->rails;
	if (row != p->counts + node * nr) /* our own row is built in place */
		memcpy(p->counts + node * nr, row, nr * sizeof(uint32_t));
	/* Fold the row into the features now, while the other rows are still on their way: what is
	 * left after the last row is O(N R) (docs/algorithms.md §5). */
	rw_sched_feat_add_row(&p->feat_acc, node, p->counts + node * nr);
	p->peer_slot[node] = slot;
	p->peer_params[node] = *params;
	p->have_row[node] = 1;
	p->n_rows++;
}

static void pair_exchange(exec_pair_t *p)
{
	rw_svc_exec_t *x = p->x;
	int slot = slot_take(x);
	if (slot < 0) {
		p->stage = ST_WAIT_SLOT; /* the tick retries */
		return;
	}
	p->slot = slot;
	p->stage = ST_EXCHANGE;
	for (uint32_t peer = 0; peer < x->nodes; peer++)
		if (!rw_svc_mesh_peer_up(x->mesh, peer)) {
			char msg[64];
			snprintf(msg, sizeof(msg), "peer %u is not connected", peer);
			pair_fail(p, RW_ERR_PEER, RW_E_PHASE, msg, 1);
			return;
		}
	size_t nr = (size_t)x->nodes * x->rails;
	rw_wire_counts_t c = { .key = p->key, .node = x->me, .nodes = x->nodes, .rails = x->rails,
			       .slot = (uint32_t)slot, .params = p->params,
			       .row = p->counts + x->me * nr };
	snprintf(c.group_name, sizeof(c.group_name), "%s", p->g->name);
	size_t len = rw_wire_counts_size(x->nodes, x->rails);
	uint8_t *buf = malloc(len);
	if (!buf) {
		pair_fail(p, RW_ERR_NOMEM, RW_E_INTERNAL, "out of memory", 1);
		return;
	}
	rw_wire_counts_pack(&c, buf, len);
	pair_take_row(p, x->me, (uint32_t)slot, &p->params, c.row);
	p->have_row[x->me] = 1;
	for (uint32_t peer = 0; peer < x->nodes; peer++)
		if (peer != x->me && rw_svc_mesh_send(x->mesh, peer, RW_WIRE_COUNTS, buf, (uint32_t)len) != RW_OK) {
			free(buf);
			pair_fail(p, RW_ERR_PEER, RW_E_PHASE, "cannot send counts", 1);
			return;
		}
	free(buf);
	/* Rows that came early. */
	for (exec_row_t **rp = &x->rows; *rp;) {
		exec_row_t *r = *rp;
		if (strcmp(r->group, p->g->name) == 0 && rw_wire_key_eq(&r->key, &p->key)) {
			pair_take_row(p, r->node, r->slot, &r->params, r->row);
			*rp = r->next;
			free(r);
		} else {
			rp = &r->next;
		}
	}
	pair_try_decide(p);
}

/* Every local rank has submitted its part of the phase (n_sub of them) and its inputs are
 * staged. */
static int subs_ready(const rw_svc_exec_t *x, const exec_sub_t *sub, uint32_t n_sub)
{
	if (n_sub < x->gpus)
		return 0;
	for (uint32_t g = 0; g < x->gpus; g++)
		if (!sub[g].ready)
			return 0;
	return 1;
}

static void pair_maybe_gathered(exec_pair_t *p)
{
	if (!p->dead && p->stage == ST_GATHER_D && subs_ready(p->x, p->dsub, p->n_dsub))
		pair_gathered(p);
}

/* All local dispatch submissions are in: count, then exchange. */
static void pair_gathered(exec_pair_t *p)
{
	rw_svc_exec_t *x = p->x;
	const rw_topo_t *topo = &x->svc->topo;
	PTRACE(p, "%s", "gathered");
	for (uint32_t g = 0; g < x->gpus; g++) {
		const exec_sub_t *s = &p->dsub[g];
		p->rt[g] = (rw_rank_tokens_t){ .local_gpu = g, .n_tokens = s->sqe.token_count,
					       .topk = p->topk, .expert_ids = s->ids };
	}
	uint32_t bad = 0;
	size_t nr = (size_t)x->nodes * x->rails;
	rw_status_t st = rw_sched_count(topo, p->n_experts, x->me, p->rt, x->gpus,
					p->counts + x->me * nr, &bad);
	if (st != RW_OK) {
		char msg[128];
		snprintf(msg, sizeof(msg), "local rank %u: expert id out of range (E=%u) or bad top-k",
			 x->me * x->gpus + bad, p->n_experts);
		if (bad < x->gpus && p->dsub[bad].have) {
			complete_err(x, p->dsub[bad].client, &p->dsub[bad].sqe, RW_E_TOKENS);
			p->dsub[bad].have = 0;
		}
		pair_fail(p, RW_ERR_INVAL, RW_E_PHASE, msg, 1);
		return;
	}
	p->row_off = calloc(nr + 1, sizeof(uint32_t));
	if (!p->row_off) {
		pair_fail(p, RW_ERR_NOMEM, RW_E_INTERNAL, "out of memory", 1);
		return;
	}
	rw_sched_prefix(p->counts + x->me * nr, (uint32_t)nr, p->row_off);
	p->rec = calloc((size_t)p->row_off[nr] + 1, sizeof(rw_record_t));
	if (!p->rec ||
	    rw_sched_records(topo, p->n_experts, x->me, p->rt, x->gpus, p->row_off, p->rec) != RW_OK) {
		pair_fail(p, RW_ERR_NOMEM, RW_E_INTERNAL, "cannot build records", 1);
		return;
	}
	pair_exchange(p);
}

/* A dispatch that cannot join its phase: answer it with `err` and fail the phase on every
 * node (the open pair, or, when there is none yet, a tombstone here and PHASE_ERR to the
 * peers), so no rank waits for a phase timeout. */
static void dispatch_refuse(rw_svc_exec_t *x, exec_group_t *g, uint32_t local,
			    rw_ipc_client_t *client, const rw_sqe_t *sqe, const rw_wire_key_t *key,
			    int err, const char *msg)
{
	rw_warn("group %s layer %u step %llu: local rank %u: %s", g->name, key->layer,
		(unsigned long long)key->step, local, msg);
	complete_err(x, client, sqe, err);
	exec_pair_t *p = g->pair;
	if (p && rw_wire_key_eq(&p->key, key) && p->stage < ST_WAIT_C) {
		p->answered |= 1u << local;
		pair_fail(p, RW_ERR_INVAL, RW_E_PHASE, msg, 1);
		return;
	}
	tomb_add(x, g->name, key, 1u << local);
	tell_peers_failed(x, key, RW_SVC_DISPATCH, RW_ERR_INVAL, msg, 0, 0);
}

static void exec_submit_dispatch(rw_svc_exec_t *x, exec_member_t *mb, rw_ipc_client_t *client,
				 const rw_sqe_t *sqe)
{
	exec_group_t *g = mb->g;
	rw_wire_key_t key = { .group = g->hash, .layer = sqe->layer, .step = sqe->step };
	if (sqe->dtype != RW_DTYPE_BF16 && sqe->dtype != RW_DTYPE_FP32) {
		complete_err(x, client, sqe, RW_E_DTYPE);
		return;
	}
	if (sqe->topk > RW_MAX_TOPK) {
		complete_err(x, client, sqe, RW_E_TOKENS);
		return;
	}
	if (tomb_hit(x, &key, mb->local)) {
		complete_err(x, client, sqe, RW_E_PHASE);
		return;
	}
	exec_pair_t *p = g->pair;
	if (p && !rw_wire_key_eq(&p->key, &key)) {
		if (p->stage == ST_WAIT_C && p->n_csub == 0) {
			pair_close(p, 1); /* the trainer moved on without a combine */
			p = NULL;
		} else {
			complete_err(x, client, sqe, RW_E_STATE);
			return;
		}
	}
	if (p && (p->stage != ST_GATHER_D || p->dsub[mb->local].have)) {
		complete_err(x, client, sqe, RW_E_STATE);
		return;
	}
	/* E: the group's experts, evenly over its W ranks, the same for every rank of the phase
	 * (docs/dataflow.md "Groups, ranks, experts"). */
	if (sqe->n_experts % g->world != 0) {
		char msg[128];
		snprintf(msg, sizeof(msg), "n_experts %u is not a multiple of the world size %u",
			 sqe->n_experts, g->world);
		dispatch_refuse(x, g, mb->local, client, sqe, &key, RW_E_EXPERTS, msg);
		return;
	}
	if (p && sqe->n_experts != p->n_experts) {
		char msg[128];
		snprintf(msg, sizeof(msg), "n_experts %u differs from the phase's %u (local ranks disagree)",
			 sqe->n_experts, p->n_experts);
		dispatch_refuse(x, g, mb->local, client, sqe, &key, RW_E_EXPERTS, msg);
		return;
	}
	if (p && (sqe->topk != p->topk || sqe->hidden != p->hidden ||
		  wire_dtype(sqe->dtype) != p->dtype)) {
		dispatch_refuse(x, g, mb->local, client, sqe, &key, RW_E_FIELD,
				"local ranks disagree on topk/hidden/dtype");
		return;
	}
	if (!p) {
		if (x->svc->draining) {
			complete_err(x, client, sqe, RW_E_STATE);
			return;
		}
		p = pair_new(x, g, &key);
		if (!p) {
			complete_err(x, client, sqe, RW_E_INTERNAL);
			return;
		}
		p->topk = sqe->topk;
		p->hidden = sqe->hidden;
		p->dtype = wire_dtype(sqe->dtype);
		p->n_experts = sqe->n_experts;
		p->row_bytes = rw_wire_row_bytes(p->hidden, p->dtype);
		p->rec_size = rw_wire_rec_size(p->topk, p->hidden, p->dtype);
		p->crec_size = rw_wire_crec_size(p->hidden, p->dtype);
		int force = x->svc->cfg.force_path;
		p->params = (rw_wire_phase_params_t){
			.n_experts = p->n_experts, .topk = p->topk, .hidden = p->hidden, .dtype = p->dtype,
			.requested_path = force >= 0 && force < RW_PATH_COUNT ? (uint32_t)force : RW_WIRE_PATH_AUTO,
			.epoch = pair_epoch(p) };
		p->phase_t0 = rw_now_ns();
	}
	exec_sub_t *s = &p->dsub[mb->local];
	s->sqe = *sqe;
	s->client = client;
	s->out_cap = sqe->output_capacity;
	span_mem_t m[4];
	int absent = 0, unknown = 0;
	const rw_span_t *spans[4] = { &sqe->tokens, &sqe->topk_ids, &sqe->topk_weights, &sqe->output };
	for (int i = 0; i < 4; i++) {
		int rc = span_resolve(client, spans[i], &m[i]);
		absent |= (rc == 1) << i;
		unknown |= rc < 0;
	}
	/* A rank that routes nothing may omit its inputs (0-byte spans); the output is needed. */
	if (unknown || (absent & 8) || (sqe->token_count && (absent & 7))) {
		dispatch_refuse(x, g, mb->local, client, sqe, &key, RW_E_BUF_ID,
				"a local rank's buffer is gone");
		return;
	}
	s->out = m[3].host;
	s->out_dev = m[3].dev;
	s->out_dptr = m[3].dptr;
	s->out_buf = m[3].buf;
	const uint64_t n = sqe->token_count;
	const uint64_t len[3] = { n * p->row_bytes, n * p->topk * 4, n * p->topk * 4 };
	const uint8_t **dst[3] = { &s->tokens, (const uint8_t **)(void *)&s->ids,
				   (const uint8_t **)(void *)&s->weights };
	s->have = 1;
	p->n_dsub++;
	rw_status_t st = stage_inputs(p, s, &mb->in, OP_DIN, mb->local, m, len, dst, 3);
	if (st != RW_OK) {
		pair_fail(p, st, RW_E_CUDA, "cannot stage a local rank's CUDA inputs", 1);
		return;
	}
	s->ready = s->marks == 0;
	if (s->ready)
		pair_maybe_gathered(p);
}

/* ---- decision and dispatch --------------------------------------------------------------- */

static void pair_try_decide(exec_pair_t *p)
{
	rw_svc_exec_t *x = p->x;
	rw_svc_t *svc = x->svc;
	if (p->dead || p->stage != ST_EXCHANGE || p->n_rows < x->nodes)
		return;
	/* Every node holds the same rows, so every verdict below is the same everywhere. */
	int forced = -1;
	for (uint32_t n = 0; n < x->nodes; n++) {
		const rw_wire_phase_params_t *pp = &p->peer_params[n];
		if (pp->n_experts != p->params.n_experts || pp->topk != p->params.topk ||
		    pp->hidden != p->params.hidden || pp->dtype != p->params.dtype) {
			char msg[128];
			snprintf(msg, sizeof(msg), "node %u disagrees on E/topk/hidden/dtype (%u/%u/%u/%u)",
				 n, pp->n_experts, pp->topk, pp->hidden, pp->dtype);
			pair_fail(p, RW_ERR_INVAL,
				  pp->n_experts != p->params.n_experts ? RW_E_EXPERTS : RW_E_PHASE, msg, 0);
			return;
		}
		if (forced < 0 && pp->requested_path != RW_WIRE_PATH_AUTO)
			forced = (int)pp->requested_path;
	}
	rw_features_t feat;
	rw_selection_t sel;
	if (rw_sched_feat_finish(&p->feat_acc, p->rec_size, &feat) != RW_OK) {
		pair_fail(p, RW_ERR_STATE, RW_E_INTERNAL, "feature accumulator incomplete", 0);
		return;
	}
	if (forced >= 0) {
		sel = (rw_selection_t){ .path = (rw_path_t)forced, .reason = RW_SELECT_FORCED,
					.case_id = -1 };
	} else {
		rw_sched_select(svc->anchors, &feat, &sel);
	}
	p->path = sel.path;
	rw_svc_metrics_decision(&svc->metrics, p->key.group, p->key.layer, p->key.step, &feat, &sel);
	rw_dbg("group %s layer %u step %llu: path %s (%s) f=[%.2f %.3f %.3f]", p->g->name,
	       p->key.layer, (unsigned long long)p->key.step, rw_sched_path_name(sel.path),
	       rw_sched_reason_name(sel.reason), feat.f[0], feat.f[1], feat.f[2]);

	uint64_t max_in, max_out;
	rw_svc_layout_max(&svc->topo, p->path, p->counts, &max_in, &max_out);
	uint64_t need = RW_MAX(max_in, max_out) * p->rec_size;
	if (need > x->sub_bytes) {
		char msg[128];
		snprintf(msg, sizeof(msg), "a rail needs %llu bytes, the region area holds %llu "
			 "(raise recv_region_mib)", (unsigned long long)need,
			 (unsigned long long)x->sub_bytes);
		pair_fail(p, RW_ERR_RANGE, RW_E_PHASE, msg, 0);
		return;
	}
	if (rw_svc_layout_build(&p->layout, &svc->topo, p->path, x->me, p->counts) != RW_OK) {
		pair_fail(p, RW_ERR_INVAL, RW_E_INTERNAL, "layout", 0);
		return;
	}
	p->have_layout = 1;
	const rw_svc_layout_t *l = &p->layout;
	p->rail_base[0] = 0;
	for (uint32_t r = 0; r < x->rails; r++)
		p->rail_base[r + 1] = p->rail_base[r] + l->in_total[r];
	p->n_in = p->rail_base[x->rails];

	/* Expected ranges (zero-size ones are done already). */
	for (int k = 0; k < 2; k++)
		p->ranges_left[k] = 0;
	for (uint32_t s = 0; s < x->nodes; s++)
		for (uint32_t r = 0; r < x->rails; r++) {
			size_t i = (size_t)s * x->rails + r;
			uint32_t qin = l->in_quota[i];
			uint32_t qret = s == x->me ? 0 : l->out_pairs[s].quota[r];
			p->range_done[0][i] = qin == 0;
			p->range_done[1][i] = qret == 0;
			p->ranges_left[0] += qin != 0;
			p->ranges_left[1] += qret != 0;
		}

	/* Local records: tokens with an expert on this node. */
	uint32_t n_local = 0;
	for (uint32_t g = 0; g < x->gpus; g++)
		for (uint32_t t = 0; t < p->rt[g].n_tokens; t++)
			n_local += rw_svc_fwd_mask(p->n_experts, x->nodes, x->gpus, x->me,
						   p->rt[g].expert_ids + (size_t)t * p->topk, p->topk) != 0;
	p->n_local = n_local;
	p->local_ref = calloc(2 * (size_t)n_local + 1, sizeof(uint32_t));
	uint64_t total = (uint64_t)p->n_in + n_local;
	p->contrib = calloc((size_t)p->n_in * x->gpus + 1, sizeof(uint32_t));
	p->crow = malloc(sizeof(float) * ((size_t)p->hidden + 1));
	int oom = !p->local_ref || !p->contrib || !p->crow;
	for (uint32_t g = 0; g < x->gpus && !oom; g++) {
		exec_sub_t *s = &p->dsub[g];
		rw_svc_out_layout_t *o = &p->out[g];
		rw_svc_out_layout(s->out_cap, p->n_experts, p->topk, p->row_bytes, RW_CQE_INLINE_COUNTS, o);
		if (s->out_dev < 0) {
			s->counts_dst = s->out + o->counts_off;
			s->rows_dst = s->out + o->rows_off;
			s->meta_dst = s->out + o->meta_off;
		} else {
			/* A CUDA output is assembled in the rank's pinned staging, compactly (at most
			 * every record of the phase arrives), and copied out when the phase is done. */
			uint64_t n_max = RW_MIN(total, o->rows_cap);
			uint64_t bytes = o->rows_off + n_max * (p->row_bytes + o->meta_bytes);
			rw_svc_pinned_t *st = &p->g->member[g]->out;
			if (rw_svc_pinned_reserve(st, bytes) != RW_OK) {
				oom = 1;
				break;
			}
			s->counts_dst = st->ptr;
			s->rows_dst = (uint8_t *)st->ptr + o->rows_off;
			s->meta_dst = s->rows_dst + n_max * p->row_bytes;
		}
		p->fwd_ref[g] = calloc(RW_MIN(total, p->out[g].rows_cap) + 1, sizeof(uint32_t));
		p->expert_counts[g] = calloc(p->n_experts, sizeof(uint32_t));
		p->owner_acc[g] = calloc((size_t)p->rt[g].n_tokens * p->hidden + 1, sizeof(float));
		oom |= !p->fwd_ref[g] || !p->expert_counts[g] || !p->owner_acc[g];
	}
	if (oom) {
		pair_fail(p, RW_ERR_NOMEM, RW_E_INTERNAL, "out of memory", 1);
		return;
	}
	n_local = 0;
	for (uint32_t g = 0; g < x->gpus; g++)
		for (uint32_t t = 0; t < p->rt[g].n_tokens; t++)
			if (rw_svc_fwd_mask(p->n_experts, x->nodes, x->gpus, x->me,
					    p->rt[g].expert_ids + (size_t)t * p->topk, p->topk)) {
				p->local_ref[2 * n_local] = g;
				p->local_ref[2 * n_local + 1] = t;
				n_local++;
			}

	uint32_t n_rec = p->row_off[(size_t)x->nodes * x->rails];
	p->pack_egress = malloc(RW_MAX(1u, n_rec));
	p->pack_slot = malloc(sizeof(uint32_t) * RW_MAX(1u, n_rec));
	for (int k = 0; k < 2; k++)
		p->packed[k] = calloc(x->nodes, 1);
	if (!p->pack_egress || !p->pack_slot || !p->packed[0] || !p->packed[1]) {
		pair_fail(p, RW_ERR_NOMEM, RW_E_INTERNAL, "out of memory", 1);
		return;
	}
	p->stage = ST_RUN_D;
	p->wave = 0;
	p->sends_done = 0;
	PTRACE(p, "decided %s", rw_sched_path_name(p->path));
	pair_send_wave(p, 0);
}

/* Forward one record to every local rank hosting one of its experts. row/ids/weights are the
 * record's; ref is its id in this pair (combine sums per id). -1: a rank's output is full. */
static int forward_one(exec_pair_t *p, uint32_t ref, uint32_t src_node, uint32_t src_rank,
		       uint32_t token, const int32_t *ids, const float *weights, const uint8_t *row)
{
	rw_svc_exec_t *x = p->x;
	uint32_t mask = rw_svc_fwd_mask(p->n_experts, x->nodes, x->gpus, x->me, ids, p->topk);
	uint32_t per_rank = p->n_experts / (x->nodes * x->gpus);
	for (uint32_t g = 0; g < x->gpus; g++) {
		if (!(mask & (1u << g)))
			continue;
		exec_sub_t *s = &p->dsub[g];
		rw_svc_out_layout_t *o = &p->out[g];
		uint32_t j = p->fwd_n[g];
		if (j >= o->rows_cap)
			return -1;
		memcpy(s->rows_dst + (uint64_t)j * p->row_bytes, row, p->row_bytes);
		uint8_t *meta = s->meta_dst + (uint64_t)j * o->meta_bytes;
		rw_wire_put32(meta, src_node);
		rw_wire_put32(meta + 4, src_rank);
		rw_wire_put32(meta + 8, token);
		rw_wire_put32(meta + 12, 0);
		memcpy(meta + 16, ids, 4u * p->topk);
		memcpy(meta + 16 + 4u * p->topk, weights, 4u * p->topk);
		for (uint32_t k = 0; k < p->topk; k++)
			if (ids[k] >= 0 && (uint32_t)ids[k] / per_rank == x->me * x->gpus + g)
				p->expert_counts[g][ids[k]]++;
		p->fwd_ref[g][j] = ref;
		if (ref < p->n_in)
			p->contrib[(size_t)ref * x->gpus + g] = j + 1;
		p->fwd_n[g] = j + 1;
	}
	return 0;
}

/* A complete dispatch range from `src` on `rail`: validate and forward each record. */
static int forward_range(exec_pair_t *p, uint32_t src, uint32_t rail, char *why, size_t why_len)
{
	rw_svc_exec_t *x = p->x;
	const rw_svc_layout_t *l = &p->layout;
	size_t i = (size_t)src * x->rails + rail;
	uint32_t first = l->in_first[i];
	int32_t ids[RW_MAX_TOPK];
	float w[RW_MAX_TOPK];
	for (uint32_t k = 0; k < l->in_quota[i]; k++) {
		const uint8_t *rec = rw_svc_mesh_mem(x->mesh, rail) + sub_off(x, p->slot, SUB_RD) +
				     ((uint64_t)first + k) * p->rec_size;
		rw_wire_rec_hdr_t h;
		if (rw_wire_rec_unpack(rec, p->topk, &h) != RW_OK || h.tag != pair_tag_in(p) ||
		    h.src_node != src || h.owner >= x->gpus) {
			snprintf(why, why_len, "bad record header from node %u rail %u slot %u", src, rail, k);
			return -1;
		}
		for (uint32_t t = 0; t < p->topk; t++) {
			ids[t] = rw_wire_rec_id(rec, t);
			w[t] = rw_wire_rec_weight(rec, p->topk, t);
		}
		if (!rw_svc_fwd_mask(p->n_experts, x->nodes, x->gpus, x->me, ids, p->topk)) {
			snprintf(why, why_len, "record from node %u has no expert on this node", src);
			return -1;
		}
		if (forward_one(p, p->rail_base[rail] + first + k, src, src * x->gpus + h.owner, h.token,
				ids, w, rec + rw_wire_rec_row_off(p->topk)) < 0) {
			snprintf(why, why_len, "a local rank's dispatch output is full");
			return -2;
		}
	}
	return 0;
}

/* Forward up to `budget` local-node records (from bg_i on) to their local ranks. */
static void forward_local(exec_pair_t *p, uint32_t budget)
{
	rw_svc_exec_t *x = p->x;
	for (; p->bg_i < p->n_local && budget; p->bg_i++, budget--) {
		uint32_t g = p->local_ref[2 * p->bg_i], t = p->local_ref[2 * p->bg_i + 1];
		const exec_sub_t *s = &p->dsub[g];
		if (forward_one(p, p->n_in + p->bg_i, x->me, x->me * x->gpus + g, t,
				s->ids + (size_t)t * p->topk, s->weights + (size_t)t * p->topk,
				s->tokens + (size_t)t * p->row_bytes) < 0) {
			pair_fail(p, RW_ERR_RANGE, RW_E_RANGE, "a local rank's dispatch output is full", 1);
			return;
		}
	}
}

/* A complete combine range from `d` on egress rail `e`: add each row into its owner token. */
static int combine_range(exec_pair_t *p, uint32_t d, uint32_t e, char *why, size_t why_len)
{
	rw_svc_exec_t *x = p->x;
	const rw_svc_layout_t *l = &p->layout;
	const rw_pair_plan_t *pp = &l->out_pairs[d];
	uint32_t first = l->out_first[d * x->rails + e];
	for (uint32_t k = 0; k < pp->quota[e]; k++) {
		const uint8_t *rec = rw_svc_mesh_mem(x->mesh, e) + sub_off(x, p->slot, SUB_RC) +
				     ((uint64_t)first + k) * p->crec_size;
		rw_wire_crec_hdr_t h;
		rw_wire_crec_unpack(rec, &h);
		if (h.tag != pair_tag_in(p) || h.src_node != d || h.rail != e || h.slot != k) {
			snprintf(why, why_len, "bad combine record from node %u rail %u slot %u", d, e, k);
			return -1;
		}
		uint32_t owner_rail, ord;
		rw_sched_unmap(pp, e, k, &owner_rail, &ord);
		const rw_record_t *r = &p->rec[p->row_off[d * x->rails + owner_rail] + ord];
		rw_svc_row_acc(p->owner_acc[r->rank] + (size_t)r->token * p->hidden,
			       rec + RW_WIRE_CREC_HDR, p->dtype, p->hidden);
	}
	return 0;
}

/* ---- the receiver gate of the waved paths (docs/dataflow.md "Send") ------------------------ */

static int pair_gated(const exec_pair_t *p)
{
	return rw_path_waved(p->path) && p->x->nodes > 2;
}

/* Records of kind `kind` that node src writes to node dst in this pair, from the count matrix
 * (rail-independent, so the same on every node): dispatch carries src's records for dst, and
 * combine returns dst's records that src hosted. */
static uint64_t pair_flow(const exec_pair_t *p, int kind, uint32_t src, uint32_t dst)
{
	const rw_svc_exec_t *x = p->x;
	size_t nr = (size_t)x->nodes * x->rails;
	uint32_t a = kind == 0 ? src : dst, b = kind == 0 ? dst : src;
	uint64_t t = 0;
	for (uint32_t r = 0; r < x->rails; r++)
		t += p->counts[a * nr + (size_t)b * x->rails + r];
	return t;
}

/* Whether node s must wait for d = (s + k) mod N to grant wave k: it has data for d, and some
 * earlier wave brings d data (if none does, d would grant at once: the round is skipped). Every
 * node computes the same answer from the matrix. */
static int pair_needs_grant(const exec_pair_t *p, int kind, uint32_t k, uint32_t s)
{
	uint32_t n = p->x->nodes, d = (s + k) % n;
	if (k < 2 || !pair_flow(p, kind, s, d))
		return 0;
	for (uint32_t j = 1; j < k; j++)
		if (pair_flow(p, kind, (d + n - j) % n, d))
			return 1;
	return 0;
}

/* Every range of kind `kind` from src has arrived (or has nothing to bring). */
static int pair_src_done(const exec_pair_t *p, int kind, uint32_t src)
{
	const rw_svc_exec_t *x = p->x;
	for (uint32_t r = 0; r < x->rails; r++) {
		size_t i = (size_t)src * x->rails + r;
		uint32_t q = kind == 0 ? p->layout.in_quota[i] : p->layout.out_pairs[src].quota[r];
		if (q && !p->range_done[kind][i])
			return 0;
	}
	return 1;
}

/* Grant every wave whose earlier waves have all arrived here. */
static void pair_grant(exec_pair_t *p, int kind)
{
	rw_svc_exec_t *x = p->x;
	uint32_t n = x->nodes;
	if (!pair_gated(p) || !p->have_layout)
		return;
	while (p->in_lo[kind] < n && pair_src_done(p, kind, (x->me + n - p->in_lo[kind]) % n))
		p->in_lo[kind]++;
	for (uint32_t k = p->grant_hi[kind] + 1; k <= p->in_lo[kind] && k < n; k++) {
		uint32_t s = (x->me + n - k) % n;
		p->grant_hi[kind] = k;
		if (!pair_needs_grant(p, kind, k, s))
			continue;
		PTRACE(p, "grant wave %u to node %u", k, s);
		rw_wire_grant_t gr = { .key = p->key, .kind = (uint32_t)kind, .wave = k };
		uint8_t buf[RW_WIRE_GRANT_SIZE];
		size_t len = rw_wire_grant_pack(&gr, buf, sizeof(buf));
		/* A failed send means s is down: the peer-down path fails the phase. */
		(void)rw_svc_mesh_send(x->mesh, s, RW_WIRE_GRANT, buf, (uint32_t)len);
	}
}

/* Fan-in bookkeeping: src is sending to us (bytes arrived, its ranges not all complete). */
static void pair_src_note(exec_pair_t *p, int kind, uint32_t src, int arrived)
{
	rw_svc_exec_t *x = p->x;
	if (!pair_gated(p) && p->have_layout)
		return;
	if (arrived && !p->src_active[kind][src] &&
	    !(p->have_layout && pair_src_done(p, kind, src))) {
		p->src_active[kind][src] = 1;
		p->n_active[kind]++;
		if (p->have_layout && pair_gated(p) &&
		    p->n_active[kind] > x->svc->metrics.wave_fanin_max)
			x->svc->metrics.wave_fanin_max = p->n_active[kind];
	} else if (!arrived && p->src_active[kind][src] && pair_src_done(p, kind, src)) {
		p->src_active[kind][src] = 0;
		p->n_active[kind]--;
	}
}

static void pair_range_arrived(exec_pair_t *p, int kind, uint32_t src, uint32_t rail)
{
	char why[128];
	int rc = kind == 0 ? forward_range(p, src, rail, why, sizeof(why))
			   : combine_range(p, src, rail, why, sizeof(why));
	if (rc == -1) {
		rw_svc_mesh_fail_peer(p->x->mesh, src, RW_ERR_PROTO, why);
		if (!p->dead)
			pair_fail(p, RW_ERR_PROTO, RW_E_PHASE, why, 1);
		return;
	}
	if (rc == -2) {
		pair_fail(p, RW_ERR_RANGE, RW_E_RANGE, why, 1);
		return;
	}
	p->range_done[kind][(size_t)src * p->x->rails + rail] = 1;
	p->ranges_left[kind]--;
	PTRACE(p, "range from node %u rail %u complete, %u left", src, rail, p->ranges_left[kind]);
	pair_src_note(p, kind, src, 0);
	pair_grant(p, kind);
}

/* Ranges whose bytes all arrived before the layout was known. */
static void pair_scan_ranges(exec_pair_t *p, int kind)
{
	rw_svc_exec_t *x = p->x;
	for (uint32_t s = 0; s < x->nodes && !p->dead; s++)
		for (uint32_t r = 0; r < x->rails && !p->dead; r++) {
			size_t i = (size_t)s * x->rails + r;
			uint64_t rsz = kind == 0 ? p->rec_size : p->crec_size;
			uint64_t q = kind == 0 ? p->layout.in_quota[i]
					       : (s == x->me ? 0 : p->layout.out_pairs[s].quota[r]);
			if (p->range_done[kind][i])
				continue;
			if (p->arrived[kind][i] > q * rsz) {
				pair_fail(p, RW_ERR_PROTO, RW_E_PHASE, "more data than expected", 1);
				return;
			}
			if (p->arrived[kind][i] == q * rsz)
				pair_range_arrived(p, kind, s, r);
		}
}

/* Pack the dispatch slabs for node d, each (egress rail) slab in slot order: records keep their
 * owner's order; only RailBalance's surplus records change rail (rw_sched_map_rail). */
static void dispatch_pack(exec_pair_t *p, uint32_t d)
{
	rw_svc_exec_t *x = p->x;
	const rw_svc_layout_t *l = &p->layout;
	for (uint32_t r = 0; r < x->rails; r++) {
		uint32_t first = p->row_off[d * x->rails + r];
		uint32_t cnt = p->row_off[d * x->rails + r + 1] - first;
		if (!cnt)
			continue;
		rw_sched_map_rail(&l->out_pairs[d], r, p->pack_egress, p->pack_slot);
		for (uint32_t i = 0; i < cnt; i++) {
			const rw_record_t *rec = &p->rec[first + i];
			const exec_sub_t *s = &p->dsub[rec->rank];
			uint32_t e = p->pack_egress[i];
			uint8_t *dst = rw_svc_mesh_mem(x->mesh, e) + sub_off(x, p->slot, SUB_SD) +
				       ((uint64_t)l->out_first[d * x->rails + e] + p->pack_slot[i]) * p->rec_size;
			rw_wire_rec_hdr_t h = { .tag = pair_tag_to(p, d), .src_node = x->me, .owner = rec->rank,
						.token = rec->token, .topk = p->topk };
			rw_wire_rec_pack(dst, &h, s->ids + (size_t)rec->token * p->topk,
					 s->weights + (size_t)rec->token * p->topk);
			memcpy(dst + rw_wire_rec_row_off(p->topk),
			       s->tokens + (size_t)rec->token * p->row_bytes, p->row_bytes);
		}
	}
}

/* The slabs of kind `kind` for node d, packed once, just before d's wave is posted: later waves'
 * packing overlaps earlier waves' sending. */
static void pack_dst(exec_pair_t *p, int kind, uint32_t d)
{
	if (p->packed[kind][d])
		return;
	p->packed[kind][d] = 1;
	if (kind == 0)
		dispatch_pack(p, d);
	else
		combine_pack(p, d);
}

/* The work on local-node records, once per kind: dispatch forwards them to their local ranks,
 * combine folds the local ranks' rows of them into their owners' sums. It starts once the first
 * writes are posted and runs in slices of BG_SLICE records on the idle watcher, between network
 * events, so the loop keeps the rail connections fed meanwhile (docs/dataflow.md "Send"). */

static void pair_local_work(exec_pair_t *p, int kind)
{
	if (p->local[kind] != LOCAL_IDLE)
		return;
	p->local[kind] = LOCAL_RUNNING;
	p->bg_g = p->bg_i = 0;
	ev_idle_start(p->x->svc->loop, &p->x->bg);
}

static void bg_cb(struct ev_loop *loop, ev_idle *w, int revents)
{
	(void)revents;
	rw_svc_exec_t *x = w->data;
	exec_pair_t *p = x->pairs;
	while (p && (p->dead || p->local[pair_kind(p)] != LOCAL_RUNNING))
		p = p->next;
	if (!p) {
		ev_idle_stop(loop, w);
		return;
	}
	int kind = pair_kind(p);
	if (kind == 0)
		forward_local(p, x->bg_slice);
	else
		combine_local(p, x->bg_slice);
	if (p->dead)
		return;
	if (kind == 0 ? p->bg_i < p->n_local : p->bg_g < x->gpus)
		return;
	p->local[kind] = LOCAL_DONE;
	pair_check_done(p);
}

/* Post the writes of the current wave (all destinations at once for non-waved paths); the next
 * wave starts when this one's writes are all done. Resumable: with the write-gap test hook only
 * one write is posted per call and the pace timer calls again (cur_k/cur_r/cur_off say where). */
static void pair_send_wave(exec_pair_t *p, int kind)
{
	rw_svc_exec_t *x = p->x;
	const rw_svc_layout_t *l = &p->layout;
	int waved = rw_path_waved(p->path) && x->nodes > 2;
	if (kind == 0 && p->wave == 0 && !p->posting) {
		pair_scan_ranges(p, 0);
		if (p->dead)
			return;
	}
	if (p->pace_wait)
		return;
	int budget = x->test_gap_s > 0 ? 1 : -1; /* writes we may post now; -1: all */
	const uint64_t rsz = kind == 0 ? p->rec_size : p->crec_size;
	for (;;) {
		if (p->dead)
			return;
		if (!p->posting) {
			if (!waved) {
				if (p->wave > 0)
					break;
				p->cur_k = 1;
				p->k_hi = x->nodes - 1;
			} else {
				if (p->wave >= x->nodes - 1)
					break;
				if (pair_needs_grant(p, kind, p->wave + 1, x->me) &&
				    !p->granted[kind][p->wave + 1]) {
					p->grant_wait = kind + 1;
					return; /* mesh_grant resumes */
				}
				p->cur_k = p->k_hi = p->wave + 1;
			}
			p->wave++;
			PTRACE(p, "post wave %u", p->wave);
			p->wave_t0 = rw_now_ns();
			p->wave_slab_max = 0;
			p->cur_r = 0;
			p->cur_off = 0;
			p->posting = 1;
		}
		for (; p->cur_k <= p->k_hi; p->cur_k++, p->cur_r = 0) {
			uint32_t d = rw_sched_wave_dst(x->nodes, x->me, p->cur_k);
			pack_dst(p, kind, d);
			for (; p->cur_r < x->rails; p->cur_r++, p->cur_off = 0) {
				uint32_t r = p->cur_r;
				size_t i = (size_t)d * x->rails + r;
				uint32_t q = kind == 0 ? l->out_pairs[d].quota[r] : l->in_quota[i];
				if (!q)
					continue;
				uint64_t local = sub_off(x, p->slot, kind == 0 ? SUB_SD : SUB_SC) +
						 (uint64_t)(kind == 0 ? l->out_first[i] : l->in_first[i]) * rsz;
				uint64_t remote = sub_off(x, (int)p->peer_slot[d], kind == 0 ? SUB_RD : SUB_RC) +
						  (uint64_t)(kind == 0 ? l->peer_in_first[i] : l->peer_ret_first[i]) * rsz;
				uint64_t len = (uint64_t)q * rsz;
				p->wave_slab_max = RW_MAX(p->wave_slab_max, len);
				uint64_t chunk = RW_MIN((uint64_t)CHUNK_MAX, rw_svc_mesh_max_write(x->mesh, r));
				if (x->test_chunk)
					chunk = RW_MIN(chunk, x->test_chunk);
				while (p->cur_off < len) {
					if (budget == 0) {
						p->pace_wait = 1;
						ev_timer_set(&p->pace, x->test_gap_s, 0.);
						ev_timer_start(x->svc->loop, &p->pace);
						return;
					}
					uint64_t off = p->cur_off, n = RW_MIN(chunk, len - off);
					uint32_t imm = rw_wire_imm_pack(pair_tag_to(p, d), (uint32_t)kind, off + n == len,
									x->me, r);
					rw_status_t st = rw_svc_mesh_write(x->mesh, d, r, local + off, remote + off,
									   n, imm, p);
					if (st != RW_OK) {
						char msg[96];
						snprintf(msg, sizeof(msg), "cannot write to node %u rail %u: %s", d, r,
							 rw_status_str(st));
						pair_fail(p, RW_ERR_PEER, RW_E_PHASE, msg, 1);
						return;
					}
					p->outstanding++;
					p->send_pending++;
					rw_svc_metrics_tx(&x->svc->metrics, r, n, off + n == len ? q : 0, 0);
					p->cur_off = off + n;
					if (budget > 0)
						budget--;
				}
			}
		}
		p->posting = 0;
		/* While these writes drain: pack the next wave's slabs, then (once) the local work. */
		if (waved && p->wave + 1 < x->nodes)
			pack_dst(p, kind, rw_sched_wave_dst(x->nodes, x->me, p->wave + 1));
		pair_local_work(p, kind);
		if (p->send_pending)
			return; /* the next wave starts when these writes are done */
	}
	pair_local_work(p, kind); /* nothing was sent */
	p->sends_done = 1;
	pair_check_done(p);
}

static void complete_dispatch(exec_pair_t *p)
{
	rw_svc_exec_t *x = p->x;
	uint64_t ns = rw_now_ns() - p->phase_t0;
	for (uint32_t g = 0; g < x->gpus; g++) {
		exec_sub_t *s = &p->dsub[g];
		rw_cqe_t c = cqe_for(&s->sqe, RW_CQ_OK);
		c.recv_tokens = p->fwd_n[g];
		if (++x->next_handle == 0)
			x->next_handle = 1;
		p->handle[g] = x->next_handle;
		c.handle_id = p->handle[g];
		c.n_experts = p->n_experts;
		if (p->n_experts <= RW_CQE_INLINE_COUNTS) {
			c.n_inline = (uint8_t)p->n_experts;
			memcpy(c.counts, p->expert_counts[g], 4u * p->n_experts);
		} else { /* written into the output by flush_outputs() */
			c.counts_buf = s->out_buf;
			c.counts_offset = s->sqe.output.offset + p->out[g].counts_off;
		}
		rw_ipc_complete(x->ipc, s->client, &c);
		s->have = 0;
	}
	rw_svc_metrics_phase(&x->svc->metrics, p->path, RW_SVC_DISPATCH, 1, ns);
	p->stage = ST_WAIT_C;
	p->flushing = 0;
	ev_timer_stop(x->svc->loop, &p->timer);
	if (x->svc->draining)
		pair_close(p, 1);
}

static void complete_combine(exec_pair_t *p)
{
	rw_svc_exec_t *x = p->x;
	uint64_t ns = rw_now_ns() - p->phase_t0;
	for (uint32_t g = 0; g < x->gpus; g++) {
		exec_sub_t *s = &p->csub[g];
		rw_cqe_t c = cqe_for(&s->sqe, RW_CQ_OK);
		c.recv_tokens = p->rt[g].n_tokens;
		c.handle_id = p->handle[g];
		rw_ipc_complete(x->ipc, s->client, &c);
		s->have = 0;
	}
	rw_svc_metrics_phase(&x->svc->metrics, p->path, RW_SVC_COMBINE, 1, ns);
	pair_close(p, 1);
}

/* Every byte of the phase is here: write the ranks' outputs (host memory directly; CUDA memory
 * from the pinned staging by async copies, one mark per CUDA rank), then complete the ranks
 * once the last copy is done (stage_done). */
static void flush_outputs(exec_pair_t *p)
{
	rw_svc_exec_t *x = p->x;
	int combine = p->stage == ST_RUN_C;
	PTRACE(p, "%s", "all data here, flush");
	p->flushing = 1;
	p->flush_pending = 0;
	for (uint32_t g = 0; g < x->gpus; g++) {
		exec_sub_t *s = combine ? &p->csub[g] : &p->dsub[g];
		rw_status_t st = RW_OK;
		if (!combine) {
			const rw_svc_out_layout_t *o = &p->out[g];
			uint64_t counts = p->n_experts > RW_CQE_INLINE_COUNTS ? 4ull * p->n_experts : 0;
			if (counts)
				memcpy(s->counts_dst, p->expert_counts[g], counts);
			if (s->out_dev < 0)
				continue;
			uint64_t n = p->fwd_n[g];
			st = rw_svc_stage_h2d(x->stage, s->out_dev, s->out_dptr + o->counts_off,
					      s->counts_dst, counts);
			if (st == RW_OK)
				st = rw_svc_stage_h2d(x->stage, s->out_dev, s->out_dptr + o->rows_off,
						      s->rows_dst, n * p->row_bytes);
			if (st == RW_OK)
				st = rw_svc_stage_h2d(x->stage, s->out_dev, s->out_dptr + o->meta_off,
						      s->meta_dst, n * o->meta_bytes);
		} else {
			uint64_t n = p->rt[g].n_tokens;
			if (n == 0)
				continue;
			uint8_t *dst = s->out;
			if (s->out_dev >= 0) {
				rw_svc_pinned_t *stage = &p->g->member[g]->out;
				st = rw_svc_pinned_reserve(stage, n * p->row_bytes);
				dst = stage->ptr;
			}
			if (st == RW_OK)
				rw_svc_row_store(dst, p->dtype, p->owner_acc[g], (uint32_t)(n * p->hidden));
			if (s->out_dev < 0)
				continue;
			if (st == RW_OK)
				st = rw_svc_stage_h2d(x->stage, s->out_dev, s->out_dptr, dst, n * p->row_bytes);
		}
		if (st == RW_OK)
			st = rw_svc_stage_mark(x->stage, s->out_dev, stage_token(p, OP_FLUSH, g));
		if (st != RW_OK) {
			pair_fail(p, st, RW_E_CUDA, "cannot copy results into a local rank's CUDA memory", 1);
			return;
		}
		p->flush_pending++;
		p->cuda_pending++;
	}
	if (p->flush_pending == 0)
		(combine ? complete_combine : complete_dispatch)(p);
}

static void pair_check_done(exec_pair_t *p)
{
	if (p->dead || !p->sends_done || p->flushing || p->local[pair_kind(p)] != LOCAL_DONE)
		return;
	if ((p->stage == ST_RUN_D && p->ranges_left[0] == 0) ||
	    (p->stage == ST_RUN_C && p->ranges_left[1] == 0))
		flush_outputs(p);
}

/* A staging mark completed (the loop's ev_io on the stream's eventfd). */
static void stage_done(void *ctx, uint64_t token, rw_status_t st)
{
	rw_svc_exec_t *x = ctx;
	if (token == RW_SVC_STAGE_ALL) { /* a stream faulted: every pair waiting on one fails */
		for (exec_pair_t *p = x->pairs, *next; p; p = next) {
			next = p->next;
			if (!p->dead && p->cuda_pending)
				pair_fail(p, st, RW_E_CUDA, "a CUDA copy failed", 1);
		}
		return;
	}
	uint32_t serial = (uint32_t)(token >> 32), op = (uint32_t)(token >> 8) & 0xffu,
		 g = (uint32_t)token & 0xffu;
	exec_pair_t *p = x->pairs;
	while (p && (p->dead || p->serial != serial))
		p = p->next;
	if (!p || g >= x->gpus || !p->cuda_pending)
		return; /* a pair that failed meanwhile (it waited for its copies then) */
	p->cuda_pending--;
	if (op == OP_DIN || op == OP_CIN) {
		exec_sub_t *s = op == OP_DIN ? &p->dsub[g] : &p->csub[g];
		if (!s->marks || --s->marks)
			return;
		if (op == OP_DIN) {
			s->ready = 1;
			pair_maybe_gathered(p);
		} else {
			csub_ready(p, g);
		}
	} else if (op == OP_FLUSH && p->flushing && --p->flush_pending == 0) {
		(p->stage == ST_RUN_C ? complete_combine : complete_dispatch)(p);
	}
}

/* ---- combine ----------------------------------------------------------------------------- */

/* Fold up to `budget` local ranks' rows of local-node records (from rank bg_g, row bg_i on)
 * into their owners' fp32 output sums. Rows of received records are read when their
 * destination is packed. */
static void combine_local(exec_pair_t *p, uint32_t budget)
{
	for (; p->bg_g < p->x->gpus; p->bg_g++, p->bg_i = 0) {
		const exec_sub_t *s = &p->csub[p->bg_g];
		for (; p->bg_i < p->fwd_n[p->bg_g]; p->bg_i++) {
			uint32_t ref = p->fwd_ref[p->bg_g][p->bg_i];
			if (ref < p->n_in)
				continue;
			if (!budget--)
				return;
			const uint32_t *lr = &p->local_ref[2 * (size_t)(ref - p->n_in)];
			rw_svc_row_acc(p->owner_acc[lr[0]] + (size_t)lr[1] * p->hidden,
				       s->tokens + (size_t)p->bg_i * p->row_bytes, p->dtype, p->hidden);
		}
	}
}

static void csub_ready(exec_pair_t *p, uint32_t g)
{
	p->csub[g].ready = 1;
	pair_maybe_start_combine(p);
}

/* Pack the combine records node d gets back, each at the (rail, slot) it came in on. A record
 * computed by one local rank is that rank's row as it is (bf16 -> fp32 -> bf16 is exact); one
 * computed by several is their fp32 sum, rounded once. */
static void combine_pack(exec_pair_t *p, uint32_t d)
{
	rw_svc_exec_t *x = p->x;
	const rw_svc_layout_t *l = &p->layout;
	const uint64_t row_bytes = p->row_bytes;
	for (uint32_t r = 0; r < x->rails; r++) {
		size_t i = (size_t)d * x->rails + r;
		for (uint32_t k = 0; k < l->in_quota[i]; k++) {
			uint32_t pos = l->in_first[i] + k, ref = p->rail_base[r] + pos;
			uint8_t *dst = rw_svc_mesh_mem(x->mesh, r) + sub_off(x, p->slot, SUB_SC) +
				       (uint64_t)pos * p->crec_size;
			rw_wire_crec_hdr_t h = { .tag = pair_tag_to(p, d), .src_node = x->me, .rail = r,
						 .slot = k };
			rw_wire_crec_pack(dst, &h);
			uint8_t *out = dst + RW_WIRE_CREC_HDR;
			const uint32_t *c = &p->contrib[(size_t)ref * x->gpus];
			const uint8_t *first = NULL;
			uint32_t n = 0;
			for (uint32_t g = 0; g < x->gpus; g++) {
				if (!c[g])
					continue;
				const uint8_t *row = p->csub[g].tokens + (uint64_t)(c[g] - 1) * row_bytes;
				if (n++ == 0) {
					first = row;
					continue;
				}
				if (n == 2)
					rw_svc_row_load(p->crow, first, p->dtype, p->hidden);
				rw_svc_row_acc(p->crow, row, p->dtype, p->hidden);
			}
			if (n == 1)
				memcpy(out, first, row_bytes);
			else if (n >= 2)
				rw_svc_row_store(out, p->dtype, p->crow, p->hidden);
			else /* never: every received record went to a local rank */
				memset(out, 0, row_bytes);
		}
	}
}

/* Every local rank's combine rows are folded in: send (packing each destination's slabs just
 * before its wave). */
static void pair_start_combine(exec_pair_t *p)
{
	PTRACE(p, "%s", "combine inputs folded");
	p->stage = ST_RUN_C;
	p->phase_t0 = rw_now_ns();
	p->wave = 0;
	p->grant_wait = 0;
	p->posting = 0;
	p->sends_done = 0;
	pair_arm_timer(p);
	pair_scan_ranges(p, 1);
	if (!p->dead)
		pair_send_wave(p, 1);
}

static void exec_submit_combine(rw_svc_exec_t *x, exec_member_t *mb, rw_ipc_client_t *client,
				const rw_sqe_t *sqe)
{
	exec_pair_t *p = mb->g->pair;
	uint32_t g = mb->local;
	if (!p || p->dead || p->stage != ST_WAIT_C || p->handle[g] != sqe->handle_id) {
		complete_err(x, client, sqe, RW_E_HANDLE);
		return;
	}
	if (p->csub[g].have) {
		complete_err(x, client, sqe, RW_E_STATE);
		return;
	}
	/* token_count = rows received, 0 when none. Protocol-1 clients sent one ignored row
	 * instead of an empty combine: still accepted. */
	if ((sqe->token_count != p->fwd_n[g] && !(p->fwd_n[g] == 0 && sqe->token_count == 1)) ||
	    sqe->hidden != p->hidden || wire_dtype(sqe->dtype) != p->dtype ||
	    (sqe->dtype != RW_DTYPE_BF16 && sqe->dtype != RW_DTYPE_FP32)) {
		complete_err(x, client, sqe, RW_E_TOKENS);
		return;
	}
	if (sqe->n_experts != 0 && sqe->n_experts != p->n_experts) {
		complete_err(x, client, sqe, RW_E_EXPERTS);
		return;
	}
	if (sqe->output_capacity < (uint64_t)p->rt[g].n_tokens * p->row_bytes) {
		complete_err(x, client, sqe, RW_E_RANGE);
		return;
	}
	exec_sub_t *s = &p->csub[g];
	span_mem_t m[2];
	int rt = span_resolve(client, &sqe->tokens, &m[0]), ro = span_resolve(client, &sqe->output, &m[1]);
	if (rt < 0 || ro < 0 || (ro == 1 && p->rt[g].n_tokens) || (rt == 1 && p->fwd_n[g])) {
		complete_err(x, client, sqe, RW_E_BUF_ID);
		return;
	}
	s->sqe = *sqe;
	s->client = client;
	s->out = m[1].host;
	s->out_dev = m[1].dev;
	s->out_dptr = m[1].dptr;
	s->out_buf = m[1].buf;
	s->out_cap = sqe->output_capacity;
	s->have = 1;
	if (p->n_csub++ == 0) {
		p->phase_t0 = rw_now_ns();
		pair_arm_timer(p);
	}
	/* Only the rows it received are read (a protocol-1 client's one ignored row is not). */
	const uint64_t len = (uint64_t)p->fwd_n[g] * p->row_bytes;
	const uint8_t **dst[1] = { &s->tokens };
	rw_status_t st = stage_inputs(p, s, &mb->in, OP_CIN, g, m, &len, dst, 1);
	if (st != RW_OK) {
		pair_fail(p, st, RW_E_CUDA, "cannot stage a local rank's CUDA combine rows", 1);
		return;
	}
	if (s->marks == 0)
		csub_ready(p, g);
}

static void pair_maybe_start_combine(exec_pair_t *p)
{
	if (!p->dead && p->stage == ST_WAIT_C && subs_ready(p->x, p->csub, p->n_csub))
		pair_start_combine(p);
}

static void ipc_submission(void *ctx, rw_ipc_client_t *client, const rw_sqe_t *sqe)
{
	rw_svc_exec_t *x = ctx;
	exec_member_t *mb = rw_ipc_client_data(client);
	if (!mb) {
		complete_err(x, client, sqe, RW_E_STATE);
		return;
	}
	if (sqe->kind == RW_KIND_DISPATCH)
		exec_submit_dispatch(x, mb, client, sqe);
	else if (sqe->kind == RW_KIND_COMBINE)
		exec_submit_combine(x, mb, client, sqe);
	else
		complete_err(x, client, sqe, RW_E_KIND);
}

/* ---- mesh callbacks ---------------------------------------------------------------------- */

static exec_pair_t *pair_by_key(rw_svc_exec_t *x, const rw_wire_key_t *key)
{
	for (exec_pair_t *p = x->pairs; p; p = p->next)
		if (!p->dead && rw_wire_key_eq(&p->key, key))
			return p;
	return NULL;
}

static void mesh_counts(void *ctx, uint32_t peer, const rw_wire_counts_t *c)
{
	rw_svc_exec_t *x = ctx;
	size_t nr = (size_t)x->nodes * x->rails;
	exec_pair_t *p = pair_by_key(x, &c->key);
	if (p && p->g && strcmp(p->g->name, c->group_name) == 0 && p->stage == ST_EXCHANGE) {
		uint32_t *row = malloc(nr * sizeof(uint32_t));
		if (!row) {
			pair_fail(p, RW_ERR_NOMEM, RW_E_INTERNAL, "out of memory", 1);
			return;
		}
		for (size_t i = 0; i < nr; i++)
			row[i] = rw_wire_counts_row(c, (uint32_t)i);
		if (c->slot < SLOTS)
			pair_take_row(p, peer, c->slot, &c->params, row);
		free(row);
		pair_try_decide(p);
		return;
	}
	if (c->slot >= SLOTS)
		return;
	if (tomb_find(x, &c->key)) { /* that phase already failed here */
		if (c->params.epoch)
			dead_add(x, &c->key, peer, c->params.epoch);
		return;
	}
	/* Early: keep it until our own ranks get there (or it goes stale). A node sends one row
	 * per attempt, in order, so a second row of the same key replaces the first. */
	rows_drop(x, c->group_name, &c->key, (int)peer, 0);
	exec_row_t *r = malloc(sizeof(*r) + nr * sizeof(uint32_t));
	if (!r)
		return;
	snprintf(r->group, sizeof(r->group), "%s", c->group_name);
	r->key = c->key;
	r->node = peer;
	r->slot = c->slot;
	r->params = c->params;
	r->t_ns = rw_now_ns();
	for (size_t i = 0; i < nr; i++)
		r->row[i] = rw_wire_counts_row(c, (uint32_t)i);
	r->next = x->rows;
	x->rows = r;
}

static void mesh_phase_err(void *ctx, uint32_t peer, const rw_wire_phase_err_t *e)
{
	rw_svc_exec_t *x = ctx;
	exec_pair_t *p = pair_by_key(x, &e->key);
	char msg[RW_WIRE_ERRMSG_MAX + 32];
	snprintf(msg, sizeof(msg), "peer %u failed it: %s", peer, e->msg);
	/* The peer's count row of the failed attempt is dead wherever it is; an attempt that
	 * already ended here has nothing more to fail. */
	if (e->epoch) {
		rows_drop(x, NULL, &e->key, (int)peer, e->epoch);
		if (dead_find(x, &e->key, peer, e->epoch))
			return;
	}
	if (e->relay) {
		/* The peer passed on another node's failure after its row had gone out: only a pair
		 * that took that row belongs to the failed attempt (a retry here that took it would
		 * write with a dead epoch and wait for data that never comes). */
		if (p && !p->dead && p->have_row && p->have_row[peer] &&
		    p->peer_params[peer].epoch == e->epoch)
			pair_fail(p, (rw_status_t)e->status, RW_E_PHASE, msg, 1);
		return;
	}
	if (!p) {
		/* Failed before our ranks got there: they fail at once when they come. */
		if (e->kind == RW_SVC_DISPATCH)
			tomb_add(x, NULL, &e->key, 0);
		return;
	}
	/* Our row of this attempt may still be on its way to a node that has already moved on
	 * to a retry of the key: tell everyone it is dead. */
	int row_out = p->stage == ST_EXCHANGE || p->stage == ST_RUN_D;
	rw_wire_key_t key = p->key;
	uint32_t epoch = p->params.epoch;
	pair_fail(p, (rw_status_t)e->status, RW_E_PHASE, msg, 0);
	if (row_out)
		tell_peers_failed(x, &key, RW_SVC_DISPATCH, (rw_status_t)e->status, msg, epoch, 1);
}

static void mesh_arrival(void *ctx, uint32_t peer, uint32_t rail, const rw_rail_arrival_t *a)
{
	rw_svc_exec_t *x = ctx;
	rw_wire_imm_t imm;
	rw_wire_imm_unpack(a->imm, &imm);
	rw_svc_metrics_rx(&x->svc->metrics, rail, a->length, 0, 0);
	if (imm.src != peer || imm.rail != rail) {
		rw_svc_mesh_fail_peer(x->mesh, peer, RW_ERR_PROTO, "immediate names another node/rail");
		return;
	}
	exec_pair_t *p = NULL;
	for (exec_pair_t *q = x->pairs; q; q = q->next)
		if (!q->dead && q->stage >= ST_EXCHANGE && (pair_tag_in(q) & 0x3fffu) == imm.tag14) {
			p = q;
			break;
		}
	if (!p) { /* a write of a phase (or an earlier attempt at it) that already ended here */
		rw_svc_metrics_error(&x->svc->metrics, RW_ERR_STATE);
		return;
	}
	int kind = (int)imm.kind;
	size_t i = (size_t)peer * x->rails + rail;
	if (p->range_done[kind][i] && p->have_layout) {
		pair_fail(p, RW_ERR_PROTO, RW_E_PHASE, "data for a range already complete", 1);
		return;
	}
	p->arrived[kind][i] += a->length;
	pair_src_note(p, kind, peer, 1);
	if (!p->have_layout)
		return;
	uint64_t rsz = kind == 0 ? p->rec_size : p->crec_size;
	uint64_t q = kind == 0 ? p->layout.in_quota[i] : p->layout.out_pairs[peer].quota[rail];
	if (p->arrived[kind][i] > q * rsz || (imm.last && p->arrived[kind][i] != q * rsz)) {
		pair_fail(p, RW_ERR_PROTO, RW_E_PHASE, "slab size differs from the counts", 1);
		return;
	}
	if (p->arrived[kind][i] == q * rsz) {
		x->svc->metrics.rail[rail].rx_records += q;
		pair_range_arrived(p, kind, peer, rail);
		pair_check_done(p);
	}
}

static void mesh_write_done(void *ctx, void *write_ctx, rw_status_t st)
{
	(void)ctx;
	exec_pair_t *p = write_ctx;
	p->outstanding--;
	if (p->dead) {
		if (p->outstanding == 0) {
			pair_unlink(p);
			free(p);
		}
		return;
	}
	if (st != RW_OK) {
		pair_fail(p, st, RW_E_PHASE, "a rail write failed", 1);
		return;
	}
	if (--p->send_pending == 0 && !p->posting) {
		PTRACE(p, "wave %u writes done: largest slab %.0f kB at %.1f Mbit/s", p->wave,
		       p->wave_slab_max / 1e3, p->wave_slab_max * 8e3 / (double)(rw_now_ns() - p->wave_t0));
		pair_send_wave(p, pair_kind(p));
	}
}

/* Our wave-`wave` destination admits us. Kept in the pair until the sender gets to that wave;
 * a grant always finds its pair (the grantor had our count row, which we send only with the
 * pair open), unless the pair already ended here: then it is dropped. */
static void mesh_grant(void *ctx, uint32_t peer, const rw_wire_grant_t *gr)
{
	rw_svc_exec_t *x = ctx;
	if (peer != (x->me + gr->wave) % x->nodes) {
		rw_svc_mesh_fail_peer(x->mesh, peer, RW_ERR_PROTO, "grant from a node that is not that wave's");
		return;
	}
	exec_pair_t *p = pair_by_key(x, &gr->key);
	if (!p)
		return;
	int kind = (int)gr->kind;
	p->granted[kind][gr->wave] = 1;
	PTRACE(p, "granted wave %u by node %u", gr->wave, peer);
	if (p->grant_wait == kind + 1 && p->wave + 1 == gr->wave) {
		p->grant_wait = 0;
		pair_send_wave(p, kind);
	}
}

static void mesh_peer_up(void *ctx, uint32_t peer)
{
	(void)ctx;
	(void)peer;
}

static void mesh_peer_down(void *ctx, uint32_t peer, rw_status_t st)
{
	rw_svc_exec_t *x = ctx;
	char msg[64];
	snprintf(msg, sizeof(msg), "peer %u went down", peer);
	/* Every open pair involves every node. */
	for (exec_pair_t *p = x->pairs, *next; p; p = next) {
		next = p->next;
		if (!p->dead && p->stage != ST_GATHER_D)
			pair_fail(p, st == RW_OK ? RW_ERR_PEER : st, RW_E_PHASE, msg, 1);
	}
	for (exec_row_t **rp = &x->rows; *rp;) {
		exec_row_t *r = *rp;
		if (r->node == peer) {
			*rp = r->next;
			free(r);
		} else {
			rp = &r->next;
		}
	}
}

static void tick_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_exec_t *x = w->data;
	for (exec_pair_t *p = x->pairs, *next; p; p = next) {
		next = p->next;
		if (!p->dead && p->stage == ST_WAIT_SLOT)
			pair_exchange(p);
	}
	/* Ages as now - then (never now - timeout: the monotonic clock starts at boot, and a node
	 * up for less than a phase timeout would find everything stale). */
	const uint64_t now = rw_now_ns(), timeout = (uint64_t)x->svc->cfg.phase_timeout_ms * 1000000ull;
	for (exec_tomb_t **tp = &x->tombs; *tp;) {
		if (now - (*tp)->t_ns > timeout)
			tomb_unlink(tp);
		else
			tp = &(*tp)->next;
	}
	for (exec_dead_t **dp = &x->dead; *dp;) {
		exec_dead_t *d = *dp;
		if (now - d->t_ns > timeout) {
			*dp = d->next;
			free(d);
		} else {
			dp = &d->next;
		}
	}
	for (exec_row_t **rp = &x->rows; *rp;) {
		exec_row_t *r = *rp;
		if (now - r->t_ns > timeout) {
			*rp = r->next;
			free(r);
		} else {
			rp = &r->next;
		}
	}
}

/* ---- daemon hooks ------------------------------------------------------------------------ */

rw_status_t rw_svc_mesh_start(rw_svc_t *svc)
{
	rw_svc_exec_t *x = calloc(1, sizeof(*x));
	if (!x)
		return RW_ERR_NOMEM;
	x->svc = svc;
	x->nodes = svc->cfg.n_nodes;
	x->rails = svc->cfg.rails;
	x->gpus = svc->cfg.gpus_per_node;
	x->me = svc->cfg.me;
	const char *hook = getenv("RAILWAVE_TEST_CHUNK_KIB");
	x->test_chunk = hook ? strtoull(hook, NULL, 10) << 10 : 0;
	hook = getenv("RAILWAVE_TEST_WRITE_GAP_MS");
	x->test_gap_s = hook ? strtod(hook, NULL) / 1000.0 : 0;
	hook = getenv("RAILWAVE_TEST_LOCAL_SLICE");
	x->bg_slice = hook && strtoul(hook, NULL, 10) ? (uint32_t)strtoul(hook, NULL, 10) : BG_SLICE;
	if (x->test_chunk || x->test_gap_s > 0 || x->bg_slice != BG_SLICE)
		rw_warn("test hooks on: rail writes of at most %llu bytes, one per %.0f ms per phase, "
			"%u local records per idle slice",
			(unsigned long long)(x->test_chunk ? x->test_chunk : CHUNK_MAX), x->test_gap_s * 1000,
			x->bg_slice);
	/* recv_region_mib is the receive memory of the node; each rail gets an equal share, and
	 * the same again for send staging: 4 sub-areas per slot. */
	uint64_t recv = (uint64_t)svc->cfg.recv_region_mib << 20;
	x->area_bytes = 2 * recv / x->rails;
	x->sub_bytes = (x->area_bytes / (4 * SLOTS)) & ~(uint64_t)63;
	x->area_bytes = x->sub_bytes * 4 * SLOTS;
	rw_svc_mesh_cbs_t cbs = { .peer_up = mesh_peer_up, .peer_down = mesh_peer_down,
				  .counts = mesh_counts, .phase_err = mesh_phase_err, .grant = mesh_grant,
				  .arrival = mesh_arrival, .write_done = mesh_write_done };
	rw_status_t st = rw_svc_stage_create(svc->loop, stage_done, x, &x->stage);
	if (st != RW_OK) {
		free(x);
		return st;
	}
	st = rw_svc_mesh_create(svc, x->area_bytes, &cbs, x, &x->mesh);
	if (st != RW_OK) {
		rw_svc_stage_destroy(x->stage);
		free(x);
		return st;
	}
	ev_timer_init(&x->tick, tick_cb, TICK_S, TICK_S);
	ev_idle_init(&x->bg, bg_cb);
	x->bg.data = x;
	x->tick.data = x;
	ev_timer_start(svc->loop, &x->tick);
	svc->exec = x;
	svc->mesh = (struct rw_svc_mesh *)x->mesh;
	return RW_OK;
}

void rw_svc_mesh_stop(rw_svc_t *svc)
{
	rw_svc_exec_t *x = svc->exec;
	if (!x)
		return;
	ev_timer_stop(svc->loop, &x->tick);
	ev_idle_stop(svc->loop, &x->bg);
	for (exec_pair_t *p = x->pairs; p; p = p->next)
		if (!p->dead)
			pair_fail(p, RW_ERR_STATE, RW_E_PHASE, "daemon stopping", 0);
	rw_svc_mesh_destroy(x->mesh); /* reclaims outstanding writes (frees dead pairs) */
	while (x->pairs) {
		exec_pair_t *p = x->pairs;
		x->pairs = p->next;
		free(p);
	}
	while (x->rows) {
		exec_row_t *r = x->rows;
		x->rows = r->next;
		free(r);
	}
	while (x->tombs)
		tomb_unlink(&x->tombs);
	while (x->dead) {
		exec_dead_t *d = x->dead;
		x->dead = d->next;
		free(d);
	}
	rw_svc_stage_destroy(x->stage); /* after the IPC server closed its CUDA imports */
	while (x->groups) {
		exec_group_t *g = x->groups;
		x->groups = g->next;
		for (uint32_t i = 0; i < RW_MAX_GPUS; i++)
			if (g->member[i])
				member_free(g->member[i]);
		free(g);
	}
	free(x);
	svc->exec = NULL;
	svc->mesh = NULL;
}

static const rw_ipc_server_ops_t ipc_ops = {
	.client_joined = ipc_client_joined,
	.client_left = ipc_client_left,
	.submission = ipc_submission,
};

rw_status_t rw_svc_ipc_start(rw_svc_t *svc)
{
	rw_svc_exec_t *x = svc->exec;
	if (!x)
		return RW_ERR_STATE;
	rw_ipc_server_config_t cfg = {
		.socket_path = svc->cfg.ipc_socket,
		.group = svc->cfg.ipc_group[0] ? svc->cfg.ipc_group : NULL,
		.node = (int32_t)svc->cfg.me,
		.max_topk = RW_MAX_TOPK,
	};
	rw_status_t st = rw_ipc_server_create(svc->loop, &cfg, &ipc_ops, x, &x->ipc);
	if (st != RW_OK)
		return st;
	svc->ipc = x->ipc;
	return RW_OK;
}

void rw_svc_ipc_stop(rw_svc_t *svc)
{
	rw_svc_exec_t *x = svc->exec;
	if (x && x->ipc) {
		/* Fail what is open before the clients' buffers go away. */
		for (exec_pair_t *p = x->pairs; p; p = p->next)
			if (!p->dead)
				pair_fail(p, RW_ERR_STATE, RW_E_PHASE, "daemon stopping", 0);
		rw_ipc_server_destroy(x->ipc);
		x->ipc = NULL;
	}
	svc->ipc = NULL;
}

void rw_svc_shutdown_begin(rw_svc_t *svc)
{
	rw_svc_exec_t *x = svc->exec;
	svc->draining = 1;
	int busy = 0;
	if (x)
		for (exec_pair_t *p = x->pairs; p; p = p->next)
			busy |= phase_running(p);
	if (!busy)
		rw_svc_stop(svc);
}
