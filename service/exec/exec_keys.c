/* What the executor keeps beyond one pair (docs/dataflow.md "Failures", "Count exchange"), and
 * the one place where a failed phase ends its key (exec_key_end):
 *   tombs  a phase (key and kind) that failed here or at a peer. A local rank that submits it
 *          and was not answered yet gets its error, with the original reason, at once instead of
 *          opening a pair that would wait for a phase timeout (dispatch) or being told its
 *          handle is unknown (a combine whose pair failed while the rank computed it). Kept per node, not per group, so it outlives a group whose
 *          ranks all left and precedes one whose ranks have not joined yet. Gone once every
 *          local rank was answered (or left), when an answered rank submits the key again (a
 *          retry), or after phase_timeout_ms.
 *   ended  a peer's attempt at a key that ended here: its count row (epoch) was in a pair that
 *          failed here, or came while the key was a tomb; and every failure (cause: the node
 *          where it began and its id there) that ended an attempt here. A PHASE_ERR that names
 *          either later is about that attempt, not about a retry that may be running now.
 *   rows   a peer's count row that came before our ranks got to that phase.
 *   refused  a local rank turned away at its hello: its group's phases cannot run here while
 *          its seat is empty, so they end at once (below).
 * Everything is aged out by the executor's tick. */
#include <stdlib.h>
#include <string.h>

#include "service/exec/exec_int.h"

typedef struct exec_tomb {
	rw_list_t link;              /* x->tombs, newest first (ageing) */
	rw_list_t hlink;             /* its bucket of the index (lookups) */
	rw_wire_key_t key;           /* key.group: the group's hash */
	rw_svc_phase_kind_t kind;    /* the phase that failed: its submissions get the error */
	uint32_t answered;           /* bit g: local rank g got its error (or left) */
	uint32_t either;             /* bit g: page rank g's done of the dispatch came as it failed:
				      * it hears at its dispatch or at its combine (exec_key_end_t) */
	uint64_t t_ns;
	char msg[RW_SVC_WHY_MAX];    /* why it failed, for the ranks that come late */
} exec_tomb_t;

typedef struct exec_ended {
	rw_list_t link;
	rw_list_t hlink;
	rw_wire_key_t key;
	uint32_t node, epoch;
	uint64_t t_ns;
} exec_ended_t;

typedef struct exec_row {
	rw_list_t link;
	rw_list_t hlink;
	char group[RW_WIRE_GROUP_MAX];
	rw_wire_key_t key;
	uint32_t node, slot;
	rw_wire_phase_params_t params;
	uint64_t t_ns;
	uint64_t grace_ns;           /* extra life while a local pair of its key gathers */
	uint32_t row[];              /* N*R counts, then the rail view (R weights, N up-masks) */
} exec_row_t;

static uint64_t phase_timeout_ns(const exec_t *x)
{
	return (uint64_t)x->svc->cfg.phase_timeout_ms * 1000000ull;
}

/* ---- the index ----------------------------------------------------------------------------
 * Every lookup is by key: each kind of entry is also linked into one of KEY_BUCKETS lists by a
 * hash of its key, so a message costs a bucket, not a walk over everything kept (a member that
 * sent 40 000 PHASE_ERRs used to stall the loop for seconds). What one node makes us keep is
 * bounded: KEYS_PER_NODE early rows from it (a new one pushes its oldest out: a node that
 * floods us loses only its own rows), as many ended attempts naming it, and KEYS_TOMBS tombs in
 * all; past those a new entry is refused. Both are counted (peer_keys_refused). A lost row's
 * phase times out; a refused tomb or ended attempt costs a straggler a phase timeout or a retry
 * a late failure, never memory or the loop. */
enum { IDX_TOMB = 0, IDX_ENDED = 1, IDX_ROW = 2, IDX_KINDS = 3 };
#define KEY_BUCKETS 4096u
#define KEYS_PER_NODE 4096u
#define KEYS_TOMBS 16384u

rw_status_t exec_keys_init(exec_t *x)
{
	x->key_idx = malloc(IDX_KINDS * KEY_BUCKETS * sizeof(*x->key_idx));
	x->keys_held = calloc((size_t)x->nodes * IDX_KINDS, sizeof(*x->keys_held));
	if (!x->key_idx || !x->keys_held)
		return RW_ERR_NOMEM;
	for (uint32_t i = 0; i < IDX_KINDS * KEY_BUCKETS; i++)
		rw_list_init(&x->key_idx[i]);
	return RW_OK;
}

static rw_list_t *bucket(const exec_t *x, int idx, const rw_wire_key_t *key)
{
	uint64_t h = (uint64_t)key->group * UINT64_C(0x9e3779b97f4a7c15) ^
		     (uint64_t)key->layer * UINT64_C(0xc2b2ae3d27d4eb4f) ^
		     key->step * UINT64_C(0x165667b19e3779f9);
	h ^= h >> 31;
	return &x->key_idx[(size_t)idx * KEY_BUCKETS + (h & (KEY_BUCKETS - 1))];
}

/* Room for one more entry of kind idx charged to node (the tombs: to nobody, all share one
 * bound): 1, charged; 0, refused and counted. */
static int charge(exec_t *x, int idx, uint32_t node)
{
	uint32_t *held = node < x->nodes ?
			 &x->keys_held[(size_t)(idx == IDX_TOMB ? 0 : node) * IDX_KINDS + idx] : NULL;
	if (!held || *held >= (idx == IDX_TOMB ? KEYS_TOMBS : KEYS_PER_NODE)) {
		x->svc->metrics.peer_keys_refused++;
		return 0;
	}
	(*held)++;
	return 1;
}

static void uncharge(exec_t *x, int idx, uint32_t node)
{
	x->keys_held[(size_t)(idx == IDX_TOMB ? 0 : node) * IDX_KINDS + idx]--;
}

/* ---- tombs -------------------------------------------------------------------------------- */

static exec_tomb_t *tomb_find(const exec_t *x, const rw_wire_key_t *key, rw_svc_phase_kind_t kind)
{
	exec_tomb_t *t;
	rw_list_for_each(bucket(x, IDX_TOMB, key), t, hlink)
		if (t->kind == kind && rw_wire_key_eq(&t->key, key))
			return t;
	return NULL;
}

static void tomb_free(exec_t *x, exec_tomb_t *t)
{
	rw_list_del(&t->link);
	rw_list_del(&t->hlink);
	uncharge(x, IDX_TOMB, 0);
	free(t);
}

/* Every local rank has its answer: nothing is left to tell. */
static void tomb_settle(exec_t *x, exec_tomb_t *t)
{
	if ((t->answered & exec_all_local(x)) == exec_all_local(x))
		tomb_free(x, t);
}

static void tomb_add(exec_t *x, const char *group, const rw_wire_key_t *key,
		     rw_svc_phase_kind_t kind, uint32_t answered, uint32_t either, const char *msg)
{
	if (group && kind == RW_SVC_DISPATCH)
		exec_rows_drop(x, group, key, -1, 0);
	exec_tomb_t *t = tomb_find(x, key, kind);
	if (!t) {
		if ((answered & exec_all_local(x)) == exec_all_local(x))
			return;
		if (!charge(x, IDX_TOMB, 0))
			return; /* stragglers then wait for a phase timeout instead */
		t = calloc(1, sizeof(*t));
		if (!t) {
			uncharge(x, IDX_TOMB, 0);
			return;
		}
		t->key = *key;
		t->kind = kind;
		snprintf(t->msg, sizeof(t->msg), "%s", msg);
		rw_list_add(&x->tombs, &t->link);
		rw_list_add(bucket(x, IDX_TOMB, key), &t->hlink);
	}
	t->answered |= answered;
	t->either = (t->either | either) & ~t->answered;
	t->t_ns = rw_now_ns();
	tomb_settle(x, t);
}

/* The tomb applies to local rank `local`'s submission: not too old, and not already answered
 * for this rank (a rank that had its answer and submits again retries). */
static int tomb_applies(const exec_t *x, const exec_tomb_t *t, uint32_t local)
{
	return rw_now_ns() - t->t_ns <= phase_timeout_ns(x) &&
	       !(t->answered & (1u << local));
}

int exec_tomb_check(const exec_t *x, const rw_wire_key_t *key, rw_svc_phase_kind_t kind,
		    uint32_t local, char *why, size_t len)
{
	const exec_tomb_t *t = tomb_find(x, key, kind);
	if (!t || !tomb_applies(x, t, local) || (t->either & (1u << local)))
		return 0; /* an `either` rank that dispatches the key again heard at its dispatch */
	snprintf(why, len, "%s", t->msg);
	return 1;
}

int exec_tomb_late(const exec_t *x, const rw_wire_key_t *key, uint32_t local, char *why,
		   size_t len)
{
	const exec_tomb_t *t = tomb_find(x, key, RW_SVC_DISPATCH);
	if (!t || !tomb_applies(x, t, local))
		return 0;
	snprintf(why, len, "%s", t->msg);
	return 1;
}

void exec_tomb_pass(exec_t *x, const rw_wire_key_t *key, rw_svc_phase_kind_t kind,
		    uint32_t local)
{
	exec_tomb_t *t = tomb_find(x, key, kind);
	if (!t)
		return;
	if (!tomb_applies(x, t, local)) {
		tomb_free(x, t); /* stale, or a retry by a rank that already had its answer */
		return;
	}
	t->answered |= 1u << local;
	tomb_settle(x, t);
}

int exec_tomb_exists(exec_t *x, const rw_wire_key_t *key)
{
	return tomb_find(x, key, RW_SVC_DISPATCH) != NULL;
}

void exec_tomb_tell(exec_t *x, const rw_wire_key_t *key, uint32_t peer, uint32_t epoch)
{
	const exec_tomb_t *t = tomb_find(x, key, RW_SVC_DISPATCH);
	if (!t)
		return;
	/* A failure of its own (an id the peer has not seen), about that attempt only (dst_epoch):
	 * the peer fails the pair that sent the row, or nothing if it has ended. */
	const uint32_t id = exec_epoch_new(++x->next_serial);
	rw_wire_phase_err_t e = { .key = *key, .kind = RW_SVC_DISPATCH, .status = RW_ERR_STATE,
				  .node = x->me, .epoch = id, .dst_epoch = epoch,
				  .cause_node = x->me, .cause_id = id };
	int off = snprintf(e.msg, sizeof(e.msg), "node %u (%s): failed there before this attempt: ",
			   x->me, x->svc->cfg.nodes[x->me].name);
	if (off > 0 && (size_t)off < sizeof(e.msg)) { /* then the tomb's reason, cut to fit */
		size_t n = strnlen(t->msg, sizeof(e.msg) - (size_t)off - 1);
		memcpy(e.msg + off, t->msg, n);
		e.msg[(size_t)off + n] = '\0';
	}
	uint8_t buf[RW_WIRE_PHASE_ERR_SIZE];
	size_t n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
	(void)rw_svc_mesh_send(x->mesh, peer, RW_WIRE_PHASE_ERR, buf, (uint32_t)n);
}

void exec_tomb_left(exec_t *x, uint32_t group_hash, uint32_t local)
{
	exec_tomb_t *t, *nx;
	rw_list_for_each_safe(&x->tombs, t, nx, link)
		if (t->key.group == group_hash) {
			t->answered |= 1u << local;
			tomb_settle(x, t);
		}
}

/* ---- ended attempts ------------------------------------------------------------------------- */

static void ended_free(exec_t *x, exec_ended_t *d)
{
	rw_list_del(&d->link);
	rw_list_del(&d->hlink);
	uncharge(x, IDX_ENDED, d->node);
	free(d);
}

void exec_ended_add(exec_t *x, const rw_wire_key_t *key, uint32_t node, uint32_t epoch)
{
	if (!charge(x, IDX_ENDED, node))
		return; /* only costs a retry that a late PHASE_ERR may fail */
	exec_ended_t *d = malloc(sizeof(*d));
	if (!d) {
		uncharge(x, IDX_ENDED, node);
		return;
	}
	*d = (exec_ended_t){ .key = *key, .node = node, .epoch = epoch, .t_ns = rw_now_ns() };
	rw_list_add(&x->ended, &d->link);
	rw_list_add(bucket(x, IDX_ENDED, key), &d->hlink);
}

int exec_ended_find(const exec_t *x, const rw_wire_key_t *key, uint32_t node, uint32_t epoch)
{
	const exec_ended_t *d;
	rw_list_for_each(bucket(x, IDX_ENDED, key), d, hlink)
		if (d->node == node && d->epoch == epoch && rw_wire_key_eq(&d->key, key))
			return 1;
	return 0;
}

/* ---- early rows ----------------------------------------------------------------------------- */

static void row_free(exec_t *x, exec_row_t *r)
{
	rw_list_del(&r->link);
	rw_list_del(&r->hlink);
	uncharge(x, IDX_ROW, r->node);
	free(r);
}

void exec_rows_drop(exec_t *x, const char *group, const rw_wire_key_t *key, int node,
		    uint32_t epoch)
{
	exec_row_t *r, *nx;
	rw_list_for_each_safe(bucket(x, IDX_ROW, key), r, nx, hlink)
		if ((!group || strcmp(r->group, group) == 0) && rw_wire_key_eq(&r->key, key) &&
		    (node < 0 || r->node == (uint32_t)node) && (!epoch || r->params.epoch == epoch))
			row_free(x, r);
}

void exec_rows_drop_node(exec_t *x, uint32_t node)
{
	exec_row_t *r, *nx;
	rw_list_for_each_safe(&x->rows, r, nx, link)
		if (r->node == node)
			row_free(x, r);
}

void exec_row_keep(exec_t *x, const rw_wire_counts_t *c, uint32_t peer, int pair_open)
{
	/* A node sends one row per attempt, in order: a second row of the key replaces the first. */
	exec_rows_drop(x, c->group_name, &c->key, (int)peer, 0);
	if (peer < x->nodes && x->keys_held[(size_t)peer * IDX_KINDS + IDX_ROW] >= KEYS_PER_NODE) {
		/* its oldest row makes room: the list is newest first, its tail the oldest */
		for (rw_list_t *it = x->rows.prev; it != &x->rows; it = it->prev) {
			exec_row_t *old = rw_container_of(it, exec_row_t, link);
			if (old->node == peer) {
				row_free(x, old);
				x->svc->metrics.peer_keys_refused++;
				break;
			}
		}
	}
	if (!charge(x, IDX_ROW, peer))
		return; /* the phase then times out: counted like any lost row */
	size_t nr = (size_t)x->nodes * x->rails;
	exec_row_t *r = malloc(sizeof(*r) + (nr + x->rails + x->nodes) * sizeof(uint32_t));
	if (!r) {
		uncharge(x, IDX_ROW, peer);
		return;
	}
	snprintf(r->group, sizeof(r->group), "%s", c->group_name);
	r->key = c->key;
	r->node = peer;
	r->slot = c->slot;
	r->params = c->params;
	r->t_ns = rw_now_ns();
	r->grace_ns = pair_open ? phase_timeout_ns(x) : 0;
	for (size_t i = 0; i < nr; i++)
		r->row[i] = rw_wire_counts_row(c, (uint32_t)i);
	exec_plan_view_decode(c, r->row + nr); /* its rail view follows the row */
	rw_list_add(&x->rows, &r->link);
	rw_list_add(bucket(x, IDX_ROW, &c->key), &r->hlink);
}

void exec_rows_hold(exec_t *x, const char *group, const rw_wire_key_t *key)
{
	const uint64_t now = rw_now_ns();
	exec_row_t *r;
	rw_list_for_each(bucket(x, IDX_ROW, key), r, hlink)
		if (strcmp(r->group, group) == 0 && rw_wire_key_eq(&r->key, key))
			r->grace_ns = now - r->t_ns + phase_timeout_ns(x);
}

/* The epoch of node's early row of (group, key) waiting here; 0 when none. */
static uint32_t row_epoch(const exec_t *x, const char *group, const rw_wire_key_t *key,
			  uint32_t node)
{
	const exec_row_t *r;
	rw_list_for_each(bucket(x, IDX_ROW, key), r, hlink)
		if (r->node == node && strcmp(r->group, group) == 0 && rw_wire_key_eq(&r->key, key))
			return r->params.epoch;
	return 0;
}

void exec_rows_take(exec_t *x, exec_pair_t *p)
{
	exec_row_t *r, *nx;
	rw_list_for_each_safe(bucket(x, IDX_ROW, &p->key), r, nx, hlink)
		if (strcmp(r->group, p->g->name) == 0 && rw_wire_key_eq(&r->key, &p->key)) {
			exec_plan_take_row(p, r->node, r->slot, &r->params, r->row,
					   r->row + (size_t)x->nodes * x->rails);
			row_free(x, r);
		}
}

/* ---- ranks refused at their hello -------------------------------------------------------------
 * A local rank that the IPC server turned away at its hello (its group key, its seat: ipc/ipc.h
 * hello_refused) does not come: while a seat of its group here is empty, its job's phases
 * cannot run here, so the peers' count rows of that job end their keys at once, told the
 * refusal's reason, instead of waiting here for a phase timeout. Its job: the rows and pairs
 * whose group key has the refused hello's fingerprint — a stranger's refused try, with another
 * key or none, is not the job's and changes nothing for it. A refusal counts only while a seat is
 * empty, and only until a rank with that key joins the group here (a job started again gets
 * the usual wait for its ranks). Kept a phase timeout after the last refusal; at most
 * REFUSED_MAX (group, key) entries (a new one pushes the oldest out). */
typedef struct exec_refused {
	rw_list_t link;              /* x->refused, newest first */
	char group[RW_WIRE_GROUP_MAX];
	uint8_t key_fp[RW_WIRE_KEY_FP_SIZE];
	uint64_t t_ns;               /* the last refusal */
	char msg[RW_SVC_WHY_MAX];    /* the last refusal's reason, for the peers and the ranks */
} exec_refused_t;
#define REFUSED_MAX 64u

static exec_refused_t *refused_find(const exec_t *x, const char *group, const uint8_t *key_fp)
{
	exec_refused_t *r;
	rw_list_for_each(&x->refused, r, link)
		if (strcmp(r->group, group) == 0 && memcmp(r->key_fp, key_fp, RW_WIRE_KEY_FP_SIZE) == 0)
			return r;
	return NULL;
}

static void refused_free(exec_t *x, exec_refused_t *r)
{
	rw_list_del(&r->link);
	x->n_refused--;
	free(r);
}

void exec_refused_add(exec_t *x, const char *group, uint32_t rank, const uint8_t *key_fp,
		      const char *why)
{
	exec_refused_t *r = refused_find(x, group, key_fp);
	if (r) {
		rw_list_del(&r->link);
	} else {
		if (x->n_refused >= REFUSED_MAX) { /* the oldest goes: the list's tail */
			r = rw_container_of(x->refused.prev, exec_refused_t, link);
			rw_list_del(&r->link);
		} else if ((r = calloc(1, sizeof(*r)))) {
			x->n_refused++;
		} else {
			return; /* the peers then wait for a phase timeout, as before */
		}
		snprintf(r->group, sizeof(r->group), "%s", group);
		memcpy(r->key_fp, key_fp, RW_WIRE_KEY_FP_SIZE);
	}
	r->t_ns = rw_now_ns();
	snprintf(r->msg, sizeof(r->msg), "rank %u could not join: %s", rank, why);
	rw_list_add(&x->refused, &r->link);
}

void exec_refused_drop(exec_t *x, const char *group, const uint8_t *key_fp)
{
	exec_refused_t *r = refused_find(x, group, key_fp);
	if (r)
		refused_free(x, r);
}

static const exec_group_t *group_of(const exec_t *x, const char *group)
{
	const exec_group_t *g;
	rw_list_for_each(&x->groups, g, link)
		if (strcmp(g->name, group) == 0)
			return g;
	return NULL;
}

int exec_refused_why(const exec_t *x, const char *group, const uint8_t *key_fp, char *why,
		     size_t len)
{
	const exec_refused_t *r = refused_find(x, group, key_fp);
	if (!r || rw_now_ns() - r->t_ns > phase_timeout_ns(x))
		return 0;
	const exec_group_t *g = group_of(x, group);
	for (uint32_t l = 0; l < x->gpus; l++)
		if (!(g && g->member[l])) {
			snprintf(why, len, "%s", r->msg);
			return 1;
		}
	return 0;
}

void exec_refused_rows(exec_t *x, const char *group)
{
	const exec_group_t *g = group_of(x, group);
	const exec_pair_t *open = g ? g->pair : NULL; /* its rows are the caller's (above) */
	char why[RW_SVC_WHY_MAX];
	for (;;) { /* every key with a row of the refused rank's job waiting here */
		const exec_row_t *r = NULL, *it;
		rw_list_for_each(&x->rows, it, link)
			if (strcmp(it->group, group) == 0 &&
			    !(open && rw_wire_key_eq(&open->key, &it->key)) &&
			    exec_refused_why(x, group, it->params.key_fp, why, sizeof(why))) {
				r = it;
				break;
			}
		if (!r)
			return;
		const rw_wire_key_t key = r->key; /* ending it drops every row of the key */
		const uint32_t id = exec_epoch_new(++x->next_serial);
		exec_key_end(x, &(exec_key_end_t){ .group = group, .key = &key,
						   .kind = RW_SVC_DISPATCH, .st = RW_ERR_CLIENT,
						   .msg = why, .epoch = id, .cause_node = x->me,
						   .cause_id = id, .tell = EXEC_TELL_PEERS });
	}
}

/* ---- ageing and teardown -------------------------------------------------------------------- */

/* Ages are now - then (never now - timeout: the monotonic clock starts at boot, and a node up
 * for less than a phase timeout would find everything stale). */
void exec_keys_expire(exec_t *x, uint64_t now, uint64_t timeout)
{
	exec_tomb_t *t, *tn;
	rw_list_for_each_safe(&x->tombs, t, tn, link)
		if (now - t->t_ns > timeout)
			tomb_free(x, t);
	exec_ended_t *d, *dn;
	rw_list_for_each_safe(&x->ended, d, dn, link)
		if (now - d->t_ns > timeout)
			ended_free(x, d);
	exec_row_t *r, *rn;
	rw_list_for_each_safe(&x->rows, r, rn, link)
		if (now - r->t_ns > timeout + r->grace_ns)
			row_free(x, r);
	exec_refused_t *f, *fn;
	rw_list_for_each_safe(&x->refused, f, fn, link)
		if (now - f->t_ns > timeout)
			refused_free(x, f);
}

void exec_keys_free(exec_t *x)
{
	if (x->key_idx && x->keys_held)
		exec_keys_expire(x, UINT64_MAX, 0);
	free(x->key_idx);
	free(x->keys_held);
	x->key_idx = NULL;
	x->keys_held = NULL;
}

/* ---- ending a failed key --------------------------------------------------------------------- */

/* A PHASE_ERR to every peer: what failed, and which attempt (docs/dataflow.md "Failures"). */
static void tell_peers(exec_t *x, const exec_key_end_t *f, const uint32_t *dst_epoch)
{
	rw_wire_phase_err_t e = { .key = *f->key, .kind = (uint32_t)f->kind, .status = f->st,
				  .node = x->me, .epoch = f->epoch,
				  .relay = f->tell == EXEC_TELL_RELAY,
				  .cause_node = f->cause_node, .cause_id = f->cause_id };
	snprintf(e.msg, sizeof(e.msg), "node %u (%s): %s", x->me, x->svc->cfg.nodes[x->me].name,
		 f->msg);
	uint8_t buf[RW_WIRE_PHASE_ERR_SIZE];
	for (uint32_t peer = 0; peer < x->nodes; peer++) {
		if (peer == x->me)
			continue;
		e.dst_epoch = dst_epoch ? dst_epoch[peer] : 0;
		size_t n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
		(void)rw_svc_mesh_send(x->mesh, peer, RW_WIRE_PHASE_ERR, buf, (uint32_t)n);
	}
}

void exec_key_end(exec_t *x, const exec_key_end_t *e)
{
	/* Each peer's attempt this ends: the epoch of its row the pair took, or of its row waiting
	 * here for this phase (the tomb below drops it), so that the peer can tell this failure
	 * from one of a retry it has started since ("Failures" 5; two nodes that time out
	 * together, one still gathering its ranks, each report their own). */
	uint32_t *dst_epoch = e->tell == EXEC_TELL_PEERS ? calloc(x->nodes, sizeof(uint32_t)) : NULL;
	for (uint32_t n = 0; n < x->nodes; n++) {
		uint32_t ep = e->taken && e->taken[n] ? e->taken[n] :
			      e->group && e->kind == RW_SVC_DISPATCH ? row_epoch(x, e->group, e->key, n) : 0;
		if (n == x->me || !ep)
			continue;
		exec_ended_add(x, e->key, n, ep);
		if (dst_epoch)
			dst_epoch[n] = ep;
	}
	tomb_add(x, e->group, e->key, e->kind, e->answered, e->either, e->msg);
	exec_ended_add(x, e->key, e->cause_node, e->cause_id); /* it may reach us again, passed on */
	if (e->tell != EXEC_TELL_NONE)
		tell_peers(x, e, e->tell == EXEC_TELL_PEERS ? dst_epoch : NULL);
	free(dst_epoch);
}
