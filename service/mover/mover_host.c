/* The host data mover (service/mover/mover.h; docs/dataflow.md "Send", "Receive and forward",
 * "Combine", "CUDA buffers"): the loop's CPU packs slabs, forwards arrived records, and sums each
 * owner token's combine rows once, in fp32 in a fixed order, into its output row. Ranks with
 * CUDA buffers are staged through pinned host memory by asynchronous copies on one stream per
 * device (service/mover/stage.c); their completions come back through the loop as the mover's
 * reports. Accepts every pair: the fallback of every daemon. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/arena.h"
#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"
#include "service/phase/phase.h"

typedef struct host_mover host_mover_t;

/* One pair's forwarding and combine state. */
typedef struct host_pair {
	host_mover_t *m;
	struct host_pair *next;      /* m->pairs: open states, for the stage's reports */
	uint32_t serial;
	rw_arena_t mem;
	const rw_svc_phase_t *ph;    /* the executor's, while the pair is open */
	uint32_t marks[RW_SVC_KIND_COUNT][RW_MAX_GPUS]; /* staging marks not done, per kind, rank */
	uint32_t pending;            /* marks of any kind not yet done */
	uint64_t devs[RW_MAX_GPUS];  /* the devices rank g's copies went to (bit d) */
	int loose;                   /* copies that may not have landed with no mark pending: a
				      * failed enqueue, or marks a stall gave up on */
	/* local-node records: (rank, token) of every token with an expert on this node */
	uint32_t n_local;
	uint32_t *local_ref;         /* [2 * n_local] */
	int local_kind;              /* kind + 1 of the local work under way (0: none yet) */
	uint32_t bg_g, bg_i;         /* where it resumes */
	rw_svc_rank_out_t rank_out;  /* what the forwarding gave each local rank */
	uint8_t *counts_dst[RW_MAX_GPUS], *rows_dst[RW_MAX_GPUS];
	/* combine: each owner token summed once its terms are in (rw_svc_owner_t) */
	rw_svc_owner_t own;
	uint64_t *back_at;           /* [record]: where its row came back (0: not yet) */
	uint64_t *terms;             /* [G + N]: one token's terms */
	const void **rows;           /* [G + N]: the same, as pointers */
	uint64_t row_at[RW_MAX_GPUS]; /* rank g's combine rows */
	uint8_t *c_out[RW_MAX_GPUS]; /* rank g's combined rows: its output, or its CUDA staging */
	int c_ready;                 /* the local ranks' rows are readable, c_out set */
	float *crow;                 /* one fp32 row for summing copies */
	/* stream order: rank g's flag, written with a driver call when its outputs' mark completes */
	const rw_svc_rank_io_t *flag_io[RW_MAX_GPUS];
	uint8_t *pack_egress;        /* rw_sched_map_rail's output for one dispatch slab */
	uint32_t *pack_slot;
	uint32_t *rx_done[RW_SVC_KIND_COUNT]; /* [N*R]: records of each (source, rail) range taken */
} host_pair_t;

struct host_mover {
	rw_svc_stage_t *stage;
	rw_svc_mover_done_fn done;
	void *ctx;
	host_pair_t *pairs;
};

enum { OP_FLUSH = RW_SVC_KIND_COUNT }; /* stage token ops: the kind for inputs, OP_FLUSH outputs */

static uint64_t stage_token(const host_pair_t *hp, uint32_t op, uint32_t g)
{
	return rw_svc_stage_token(hp->serial, op, g);
}

/* The next open pair with copies pending on a stalled device: given up (its marks, if they land,
 * are reported to nobody; its staging retired at quiesce), its serial and first rank there. */
static int stalled_pair(host_mover_t *m, int device, uint32_t *serial_p, int *g_p)
{
	for (host_pair_t *hp = m->pairs; hp; hp = hp->next)
		if (hp->pending && (*g_p = rw_svc_stage_rank_on(hp->devs, device)) >= 0) {
			hp->pending = 0;
			hp->loose = 1;
			memset(hp->marks, 0, sizeof(hp->marks));
			*serial_p = hp->serial;
			return 1;
		}
	return 0;
}

/* A staging mark completed (the loop's ev_io on the stream's eventfd). */
static void stage_done(void *ctx, uint64_t token, rw_status_t st)
{
	host_mover_t *m = ctx;
	if (token == RW_SVC_STAGE_ALL) { /* a stream faulted: every pending op failed */
		for (host_pair_t *hp = m->pairs; hp; hp = hp->next)
			hp->pending = 0;
		m->done(m->ctx, 0, RW_MV_OP_ALL, 0, st);
		return;
	}
	const int stalled = rw_svc_stage_dev_of(token);
	uint32_t serial, op, g;
	int on;
	/* a device stalled: each pair with copies pending on it fails (a report may end a pair:
	 * the search starts over each time) */
	while (stalled >= 0 && stalled_pair(m, stalled, &serial, &on))
		m->done(m->ctx, serial, RW_MV_OP_FINISH, (uint32_t)on, st);
	if (stalled >= 0)
		return;
	rw_svc_stage_token_split(token, &serial, &op, &g);
	host_pair_t *hp = m->pairs;
	while (hp && hp->serial != serial)
		hp = hp->next;
	if (!hp || g >= RW_MAX_GPUS || !hp->pending)
		return; /* a pair that ended or failed meanwhile (its staging retired then) */
	hp->pending--;
	if (op == OP_FLUSH) {
		rw_svc_stage_flushed(m->done, m->ctx, serial, g, &hp->flag_io[g], st);
	} else if (op < RW_SVC_KIND_COUNT && hp->marks[op][g] && --hp->marks[op][g] == 0) {
		m->done(m->ctx, serial, op == RW_SVC_DISPATCH ? RW_MV_OP_STAGE_D : RW_MV_OP_STAGE_C, g,
			st);
	}
}

static rw_status_t host_create(struct ev_loop *loop, rw_svc_mover_done_fn done, void *ctx,
			       void **mover_p)
{
	host_mover_t *m = calloc(1, sizeof(*m));
	if (!m)
		return RW_ERR_NOMEM;
	m->done = done;
	m->ctx = ctx;
	rw_status_t st = rw_svc_stage_create(loop, stage_done, m, &m->stage);
	if (st != RW_OK) {
		free(m);
		return st;
	}
	*mover_p = m;
	return RW_OK;
}

static void host_destroy(void *mover)
{
	host_mover_t *m = mover;
	rw_svc_stage_destroy(m->stage); /* waits for every copy */
	free(m);
}

static int host_accepts(void *mover, const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind,
			uint32_t g)
{
	(void)mover;
	return ph->io[kind][g].page == NULL; /* a page rank's data never reaches the daemon */
}

static rw_status_t host_open(void *mover, const rw_svc_phase_t *ph, void **state_p)
{
	host_mover_t *m = mover;
	host_pair_t *hp = calloc(1, sizeof(*hp));
	if (!hp)
		return RW_ERR_NOMEM;
	hp->m = m;
	hp->ph = ph;
	hp->serial = ph->serial;
	hp->next = m->pairs;
	m->pairs = hp;
	*state_p = hp;
	return RW_OK;
}

/* Nothing here waits for a GPU (docs/rankpath.md "A hung GPU"): where a rank's copies may not
 * have landed, its staging is handed to the stage, which frees it once they did (a copy never
 * lands in freed memory); the executor answers the rank once they did (host_fence). */
static void host_quiesce(void *mover, void *state)
{
	host_mover_t *m = mover;
	host_pair_t *hp = state;
	rw_svc_stage_retire_pair(m->stage, hp->ph, hp->devs, hp->pending || hp->loose);
	hp->pending = 0;
	hp->loose = 0;
	memset(hp->marks, 0, sizeof(hp->marks));
}

/* A failed pair's rank g whose copies may not have landed (its answer waits for them). */
static int host_fence(void *mover, void *state, uint32_t g, rw_svc_stage_fence_t *f)
{
	host_mover_t *m = mover;
	const host_pair_t *hp = state;
	return rw_svc_stage_rank_fence(m->stage, hp->devs, hp->pending || hp->loose, g, f);
}

static void host_close(void *mover, void *state)
{
	host_mover_t *m = mover;
	host_pair_t *hp = state;
	host_quiesce(mover, state);
	for (host_pair_t **pp = &m->pairs; *pp; pp = &(*pp)->next)
		if (*pp == hp) {
			*pp = hp->next;
			break;
		}
	rw_arena_free(&hp->mem);
	free(hp);
}

/* ---- inputs --------------------------------------------------------------------------------- */

/* Make rank g's inputs host-readable: host spans are used in place; CUDA ones are copied (async)
 * into consecutive 64-byte aligned pieces of the rank's pinned staging, one mark per device. */
static rw_status_t host_stage(void *mover, void *state, rw_svc_phase_t *ph,
			      rw_svc_phase_kind_t kind, uint32_t g, int *pending_p, char *why)
{
	host_mover_t *m = mover;
	host_pair_t *hp = state;
	rw_svc_rank_io_t *io = &ph->io[kind][g];
	const uint64_t n = io->n_tokens;
	uint64_t len[3] = { n * ph->row_bytes, n * ph->topk * 4, n * ph->topk * 4 };
	const uint8_t *host[3] = { NULL, NULL, NULL };
	unsigned n_in = kind == RW_SVC_DISPATCH ? 3 : 1;
	/* A combine reads only the rows it received (not a protocol-1 client's one ignored row). */
	if (kind == RW_SVC_COMBINE)
		len[0] = (uint64_t)hp->rank_out.n[g] * ph->row_bytes;
	uint64_t need = 0;
	for (unsigned i = 0; i < n_in; i++) {
		host[i] = io->in[i].host;
		if (io->in[i].dev >= 0)
			need += (len[i] + 63) & ~(uint64_t)63;
	}
	*pending_p = 0;
	if (need) {
		rw_svc_pinned_t *stage = ph->stage_in[g];
		rw_status_t st = rw_svc_pinned_reserve(stage, need);
		uint64_t off = 0;
		int devs[3];
		unsigned ndev = 0;
		for (unsigned i = 0; i < n_in && st == RW_OK; i++) {
			if (io->in[i].dev < 0)
				continue;
			if (rw_svc_gpu_stalled(io->in[i].dev, why, RW_SVC_WHY_MAX))
				return RW_ERR_DEVICE; /* named: refused until it moves again */
			if (io->in[i].dev < 64)
				hp->devs[g] |= 1ull << io->in[i].dev;
			unsigned k = 0;
			while (k < ndev && devs[k] != io->in[i].dev)
				k++;
			if (k == ndev) {
				devs[ndev++] = io->in[i].dev;
				/* Stream order: the copies wait on the GPU for the rank's event (never
				 * the loop: a rank's kernel that never ends stalls the device, named) */
				if (io->wait_ev)
					st = rw_svc_stage_wait_event(m->stage, io->in[i].dev, io->wait_ev);
			}
			uint8_t *dst = (uint8_t *)stage->ptr + off;
			if (st == RW_OK)
				st = rw_svc_stage_d2h(m->stage, io->in[i].dev, dst, io->in[i].dptr,
						      len[i]);
			host[i] = dst;
			off += (len[i] + 63) & ~(uint64_t)63;
		}
		for (unsigned k = 0; k < ndev && st == RW_OK; k++) {
			st = rw_svc_stage_mark(m->stage, devs[k], stage_token(hp, (uint32_t)kind, g));
			if (st == RW_OK) {
				hp->marks[kind][g]++;
				hp->pending++;
			}
		}
		if (st != RW_OK) {
			hp->loose = 1;
			snprintf(why, RW_SVC_WHY_MAX, "cannot stage local rank %u's CUDA %s: %s", g,
				 kind == RW_SVC_COMBINE ? "combine rows" : "inputs", rw_status_str(st));
			return RW_ERR_DEVICE;
		}
		*pending_p = hp->marks[kind][g] != 0;
	}
	if (kind == 0 && io->in[1].dev < 0 && len[1]) {
		/* The rank's routing is read once: the count and records passes, pack and the local
		 * forwarding all read this copy, never the rank's memory, which it may rewrite after
		 * submitting. Records then always agree with the count rows the peers were sent, so
		 * a rewrite changes nothing a peer sees (docs/security.md). A CUDA span is copied
		 * into the staging above, which is the daemon's, already. */
		void *copy = rw_arena_alloc(&hp->mem, len[1] / 4, 4);
		if (!copy) {
			snprintf(why, RW_SVC_WHY_MAX, "out of memory copying local rank %u's top-k ids", g);
			return RW_ERR_NOMEM;
		}
		memcpy(copy, host[1], len[1]);
		host[1] = copy;
	}
	io->tokens = host[0];
	io->ids = (const int32_t *)(const void *)host[1];
	io->weights = (const float *)(const void *)host[2];
	return RW_OK;
}

/* ---- plan ----------------------------------------------------------------------------------- */

static rw_status_t host_plan(void *mover, void *state, const rw_svc_phase_t *ph, char *why)
{
	(void)mover;
	host_pair_t *hp = state;
	/* Local records: the plan's CSR segments (me, r) hold every token with an expert on this
	 * node, so no pass over the tokens is needed here. */
	const uint32_t *lo = &ph->row_off[(size_t)ph->me * ph->rails];
	uint32_t n_local = lo[ph->rails] - lo[0];
	hp->n_local = n_local;
	hp->local_ref = rw_arena_alloc(&hp->mem, 2 * (size_t)n_local + 1, sizeof(uint32_t));
	const uint64_t total = (uint64_t)ph->n_in + n_local;
	/* every record's rows per rank: the combine sums its local ranks' rows of local records */
	hp->rank_out.contrib = rw_arena_alloc(&hp->mem, (size_t)total * ph->gpus + 1,
					      sizeof(uint32_t));
	hp->rank_out.n_contrib = (uint32_t)total;
	hp->crow = rw_arena_alloc(&hp->mem, (size_t)ph->hidden + 1, sizeof(float));
	uint32_t n_rec = ph->row_off[(size_t)ph->nodes * ph->rails];
	hp->pack_egress = rw_arena_alloc(&hp->mem, RW_MAX(1u, n_rec), 1);
	hp->pack_slot = rw_arena_alloc(&hp->mem, RW_MAX(1u, n_rec), sizeof(uint32_t));
	hp->back_at = rw_arena_alloc(&hp->mem, RW_MAX(1u, n_rec), sizeof(uint64_t));
	hp->terms = rw_arena_alloc(&hp->mem, (size_t)ph->gpus + ph->nodes, sizeof(uint64_t));
	hp->rows = rw_arena_alloc(&hp->mem, (size_t)ph->gpus + ph->nodes, sizeof(void *));
	for (int k = 0; k < RW_SVC_KIND_COUNT; k++)
		hp->rx_done[k] = rw_arena_alloc(&hp->mem, (size_t)ph->nodes * ph->rails, sizeof(uint32_t));
	int oom = !hp->local_ref || !hp->rank_out.contrib || !hp->crow || !hp->pack_egress ||
		  !hp->pack_slot || !hp->back_at || !hp->terms || !hp->rows || !hp->rx_done[0] ||
		  !hp->rx_done[1];
	for (uint32_t g = 0; g < ph->gpus && !oom; g++) {
		const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
		rw_svc_out_layout_t *o = &hp->rank_out.layout[g];
		rw_svc_out_layout(io->out_cap, ph->n_experts, ph->topk, ph->row_bytes,
				  RW_CQE_INLINE_COUNTS, o);
		if (io->out.dev < 0) {
			hp->counts_dst[g] = io->out.host + o->counts_off;
			hp->rows_dst[g] = io->out.host + o->rows_off;
			hp->rank_out.meta[g] = io->out.host + o->meta_off;
		} else {
			/* A CUDA output is assembled in the rank's pinned staging, compactly (at most
			 * every record of the phase arrives), and copied out when the phase is done. */
			uint64_t n_max = RW_MIN(total, o->rows_cap);
			uint64_t bytes = o->rows_off + n_max * (ph->row_bytes + o->meta_bytes);
			rw_svc_pinned_t *st = ph->stage_out[g];
			if (rw_svc_pinned_reserve(st, bytes) != RW_OK) {
				oom = 1;
				break;
			}
			hp->counts_dst[g] = st->ptr;
			hp->rows_dst[g] = (uint8_t *)st->ptr + o->rows_off;
			hp->rank_out.meta[g] = hp->rows_dst[g] + n_max * ph->row_bytes;
		}
		hp->rank_out.ref[g] = rw_arena_alloc(&hp->mem, RW_MIN(total, o->rows_cap) + 1,
						     sizeof(uint32_t));
		hp->rank_out.expert_counts[g] = rw_arena_alloc(&hp->mem, ph->n_experts,
							       sizeof(uint32_t));
		oom |= !hp->rank_out.ref[g] || !hp->rank_out.expert_counts[g];
	}
	if (oom) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	for (uint32_t i = 0; i < n_local; i++) {
		const rw_record_t *r = &ph->rec[lo[0] + i];
		hp->local_ref[2 * i] = r->rank;
		hp->local_ref[2 * i + 1] = r->token;
	}
	if (rw_svc_owner_plan(&hp->own, &hp->mem, ph, hp->local_ref, n_local) != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	return RW_OK;
}

/* ---- dispatch ------------------------------------------------------------------------------- */

/* Pack the dispatch slabs for node d, each (egress rail) slab in slot order: records keep their
 * owner's order; only RailBalance's surplus records change rail (rw_sched_map_rail). */
static void dispatch_pack(host_pair_t *hp, const rw_svc_phase_t *ph, uint32_t d)
{
	const rw_svc_layout_t *l = ph->layout;
	for (uint32_t r = 0; r < ph->rails; r++) {
		uint32_t first = ph->row_off[d * ph->rails + r];
		uint32_t cnt = ph->row_off[d * ph->rails + r + 1] - first;
		if (!cnt)
			continue;
		rw_sched_map_rail(&l->out_pairs[d], r, hp->pack_egress, hp->pack_slot);
		for (uint32_t i = 0; i < cnt; i++) {
			const rw_record_t *rec = &ph->rec[first + i];
			const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][rec->rank];
			uint32_t e = hp->pack_egress[i];
			uint8_t *dst = ph->send_area[RW_SVC_DISPATCH][e] +
				       ((uint64_t)l->out_first[d * ph->rails + e] + hp->pack_slot[i]) * ph->rec_size;
			rw_wire_rec_hdr_t h = { .tag = ph->tag_to[d], .src_node = ph->me, .owner = rec->rank,
						.token = rec->token, .topk = ph->topk };
			rw_wire_rec_pack(dst, &h, io->ids + (size_t)rec->token * ph->topk,
					 io->weights + (size_t)rec->token * ph->topk);
			memcpy(dst + rw_wire_rec_row_off(ph->topk),
			       io->tokens + (size_t)rec->token * ph->row_bytes, ph->row_bytes);
		}
	}
}

/* Forward one record to every local rank hosting one of its experts. row/ids/weights are the
 * record's; ref is its id in this pair (combine sums per id). -1: a rank's output is full. */
static int forward_one(host_pair_t *hp, const rw_svc_phase_t *ph, uint32_t ref, uint32_t src_node,
		       uint32_t src_rank, uint32_t token, const int32_t *ids, const float *weights,
		       const uint8_t *row)
{
	uint32_t rows[RW_MAX_GPUS];
	int64_t to = rw_svc_rank_out_add(&hp->rank_out, ph, ref, src_node, src_rank, token, ids,
					 weights, rows);
	if (to < 0)
		return -1;
	for (uint32_t g = 0; g < ph->gpus; g++)
		if (to & (1u << g))
			memcpy(hp->rows_dst[g] + (uint64_t)rows[g] * ph->row_bytes, row,
			       ph->row_bytes);
	return 0;
}

/* Records [from, upto) of a dispatch range from `src` on `rail`: validate and forward each. */
static rw_status_t forward_range(host_pair_t *hp, const rw_svc_phase_t *ph, uint32_t src,
				 uint32_t rail, uint32_t from, uint32_t upto, char *why)
{
	const rw_svc_layout_t *l = ph->layout;
	size_t i = (size_t)src * ph->rails + rail;
	uint32_t first = l->in_first[i];
	int32_t ids[RW_MAX_TOPK];
	float w[RW_MAX_TOPK];
	for (uint32_t k = from; k < upto; k++) {
		const uint8_t *rec = ph->recv_area[RW_SVC_DISPATCH][rail] + ((uint64_t)first + k) * ph->rec_size;
		rw_wire_rec_hdr_t h;
		rw_status_t st = rw_svc_mover_rec_read(ph, rec, src, rail, k, &h, ids, w, why);
		if (st != RW_OK)
			return st;
		if (forward_one(hp, ph, ph->rail_base[rail] + first + k, src, src * ph->gpus + h.owner,
				h.token, ids, w, rec + rw_wire_rec_row_off(ph->topk)) < 0) {
			snprintf(why, RW_SVC_WHY_MAX, "a local rank's dispatch output is full");
			return RW_ERR_SUB_SPACE;
		}
	}
	return RW_OK;
}

/* Forward up to `budget` local-node records (from bg_i on) to their local ranks. */
static rw_status_t forward_local(host_pair_t *hp, const rw_svc_phase_t *ph, uint32_t budget,
				 int *done_p, char *why)
{
	for (; hp->bg_i < hp->n_local && budget; hp->bg_i++, budget--) {
		uint32_t g = hp->local_ref[2 * hp->bg_i], t = hp->local_ref[2 * hp->bg_i + 1];
		const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
		if (forward_one(hp, ph, ph->n_in + hp->bg_i, ph->me, ph->me * ph->gpus + g, t,
				io->ids + (size_t)t * ph->topk, io->weights + (size_t)t * ph->topk,
				io->tokens + (size_t)t * ph->row_bytes) < 0) {
			snprintf(why, RW_SVC_WHY_MAX, "a local rank's dispatch output is full");
			return RW_ERR_SUB_SPACE;
		}
	}
	*done_p = hp->bg_i >= hp->n_local;
	return RW_OK;
}

/* ---- combine -------------------------------------------------------------------------------- */

/* Pack the combine records node d gets back, each at the (rail, slot) it came in on. A record
 * computed by one local rank is that rank's row as it is (bf16 -> fp32 -> bf16 is exact); one
 * computed by several is their fp32 sum, rounded once. */
static void combine_pack(host_pair_t *hp, const rw_svc_phase_t *ph, uint32_t d)
{
	const rw_svc_layout_t *l = ph->layout;
	const uint64_t row_bytes = ph->row_bytes;
	for (uint32_t r = 0; r < ph->rails; r++) {
		size_t i = (size_t)d * ph->rails + r;
		for (uint32_t k = 0; k < l->in_quota[i]; k++) {
			uint32_t pos = l->in_first[i] + k, ref = ph->rail_base[r] + pos;
			uint8_t *dst = ph->send_area[RW_SVC_COMBINE][r] + (uint64_t)pos * ph->crec_size;
			rw_wire_crec_hdr_t h = { .tag = ph->tag_to[d], .src_node = ph->me, .rail = r,
						 .slot = k };
			rw_wire_crec_pack(dst, &h);
			uint8_t *out = dst + RW_WIRE_CREC_HDR;
			const uint32_t *c = &hp->rank_out.contrib[(size_t)ref * ph->gpus];
			const uint8_t *first = NULL;
			uint32_t n = 0;
			for (uint32_t g = 0; g < ph->gpus; g++) {
				if (!c[g])
					continue;
				const uint8_t *row = ph->io[RW_SVC_COMBINE][g].tokens + (uint64_t)(c[g] - 1) * row_bytes;
				if (n++ == 0) {
					first = row;
					continue;
				}
				if (n == 2)
					rw_svc_row_load(hp->crow, first, ph->dtype, ph->hidden);
				rw_svc_row_acc(hp->crow, row, ph->dtype, ph->hidden);
			}
			if (n == 1)
				memcpy(out, first, row_bytes);
			else if (n >= 2)
				rw_svc_row_store(out, ph->dtype, hp->crow, ph->hidden);
			else /* never: every received record went to a local rank */
				memset(out, 0, row_bytes);
		}
	}
}

/* The local ranks' combine rows are readable (every rank staged: the combine is packing or
 * running its local work), so a token whose terms are all in can be summed: the rows' places,
 * and each rank's output (a CUDA rank's pinned staging, copied out by finish). */
static rw_status_t combine_begin(host_pair_t *hp, const rw_svc_phase_t *ph, char *why)
{
	if (hp->c_ready)
		return RW_OK;
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[RW_SVC_COMBINE][g];
		const uint64_t n = ph->rt[g].n_tokens;
		hp->row_at[g] = (uint64_t)(uintptr_t)io->tokens;
		hp->c_out[g] = io->out.host;
		if (n == 0 || io->out.dev < 0)
			continue;
		rw_status_t st = rw_svc_pinned_reserve(ph->stage_out[g], n * ph->row_bytes);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot stage local rank %u's combined rows: %s",
				 g, rw_status_str(st));
			return st;
		}
		hp->c_out[g] = ph->stage_out[g]->ptr;
	}
	hp->c_ready = 1;
	return RW_OK;
}

/* Owner token t of local rank g, every term in: its row of the output, summed in the fixed
 * order (rw_svc_owner_terms; a token with none gets zeros). */
static void owner_sum(host_pair_t *hp, const rw_svc_phase_t *ph, uint32_t g, uint32_t t)
{
	const uint32_t u = hp->own.base[g] + t;
	if (hp->own.done[u])
		return;
	uint32_t n = rw_svc_owner_terms(&hp->own, ph, &hp->rank_out, u, hp->row_at, hp->back_at,
					hp->terms);
	for (uint32_t k = 0; k < n; k++)
		hp->rows[k] = (const void *)(uintptr_t)hp->terms[k];
	rw_svc_rows_reduce(hp->c_out[g] + (uint64_t)t * ph->row_bytes, ph->dtype, hp->rows, n,
			   ph->hidden);
	hp->own.done[u] = 1;
}

/* Records [from, upto) of a combine range from `d` on egress rail `e`: note where each row is;
 * a token whose last row this was is summed now, if the local ranks' rows are readable (else by
 * the local work). */
static rw_status_t combine_range(host_pair_t *hp, const rw_svc_phase_t *ph, uint32_t d,
				 uint32_t e, uint32_t from, uint32_t upto, char *why)
{
	const rw_svc_layout_t *l = ph->layout;
	uint32_t first = l->out_first[d * ph->rails + e];
	for (uint32_t k = from; k < upto; k++) {
		const uint8_t *rec = ph->recv_area[RW_SVC_COMBINE][e] + ((uint64_t)first + k) * ph->crec_size;
		const rw_record_t *r;
		rw_status_t st = rw_svc_mover_crec_read(ph, rec, d, e, k, &r, why);
		if (st != RW_OK)
			return st;
		const uint32_t j = (uint32_t)(r - ph->rec);
		uint32_t u;
		hp->back_at[j] = (uint64_t)(uintptr_t)(rec + RW_WIRE_CREC_HDR);
		if (rw_svc_owner_back(&hp->own, ph, j, &u) && hp->c_ready)
			owner_sum(hp, ph, r->rank, r->token);
	}
	return RW_OK;
}

/* Up to `budget` owner tokens (from rank bg_g, token bg_i on) whose terms are all in, summed;
 * those still waiting for a row are summed when it comes. */
static rw_status_t combine_local(host_pair_t *hp, const rw_svc_phase_t *ph, uint32_t budget,
				 int *done_p, char *why)
{
	*done_p = 0;
	rw_status_t st = combine_begin(hp, ph, why);
	if (st != RW_OK)
		return st;
	for (; hp->bg_g < ph->gpus; hp->bg_g++, hp->bg_i = 0)
		for (; hp->bg_i < ph->rt[hp->bg_g].n_tokens; hp->bg_i++) {
			const uint32_t u = hp->own.base[hp->bg_g] + hp->bg_i;
			if (hp->own.done[u] || hp->own.left[u])
				continue;
			if (!budget--)
				return RW_OK;
			owner_sum(hp, ph, hp->bg_g, hp->bg_i);
		}
	*done_p = 1;
	return RW_OK;
}

/* ---- the ops -------------------------------------------------------------------------------- */

static rw_status_t host_pack(void *mover, void *state, const rw_svc_phase_t *ph,
			     rw_svc_phase_kind_t kind, uint32_t d, char *why)
{
	(void)mover;
	if (d == ph->me) /* a group on one node: its own records are the local work's */
		return RW_OK;
	if (kind == RW_SVC_DISPATCH) {
		dispatch_pack(state, ph, d);
	} else {
		rw_status_t st = combine_begin(state, ph, why);
		if (st != RW_OK)
			return st;
		combine_pack(state, ph, d);
	}
	return rw_svc_slab_push(ph, kind, d, why); /* slabs on a GPU: the packed bytes go there */
}

/* Records [done, upto) of a range from src on rail (a prefix while it arrives; all of it once
 * complete): forwarded or noted while the rest is on the wire. Slabs on a GPU are pulled whole
 * once the range is complete (the prefixes wait for that). */
static rw_status_t host_take(host_pair_t *hp, const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind,
			     uint32_t src, uint32_t rail, uint32_t upto, char *why)
{
	const size_t i = (size_t)src * ph->rails + rail;
	const uint32_t quota = kind == RW_SVC_DISPATCH ? ph->layout->in_quota[i]
						       : ph->layout->out_pairs[src].quota[rail];
	uint32_t *done = &hp->rx_done[kind][i];
	upto = RW_MIN(upto, quota);
	if (*done >= upto)
		return RW_OK;
	rw_status_t st = kind == RW_SVC_DISPATCH ? forward_range(hp, ph, src, rail, *done, upto, why)
						 : combine_range(hp, ph, src, rail, *done, upto, why);
	if (st == RW_OK)
		*done = upto;
	return st;
}

static rw_status_t host_part(void *mover, void *state, const rw_svc_phase_t *ph,
			     rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail, uint32_t upto,
			     char *why)
{
	(void)mover;
	if (ph->slab_dev[rail] >= 0)
		return RW_OK;
	return host_take(state, ph, kind, src, rail, upto, why);
}

static rw_status_t host_arrived(void *mover, void *state, const rw_svc_phase_t *ph,
				rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail, char *why)
{
	(void)mover;
	rw_status_t st = rw_svc_slab_pull(ph, kind, src, rail, why); /* slabs on a GPU */
	if (st != RW_OK)
		return st;
	return host_take(state, ph, kind, src, rail, UINT32_MAX, why);
}

static rw_status_t host_local(void *mover, void *state, const rw_svc_phase_t *ph,
			      rw_svc_phase_kind_t kind, uint32_t budget, int *done_p, char *why)
{
	(void)mover;
	host_pair_t *hp = state;
	if (hp->local_kind != (int)kind + 1) { /* each kind's work starts from the beginning */
		hp->local_kind = (int)kind + 1;
		hp->bg_g = hp->bg_i = 0;
	}
	if (kind == RW_SVC_DISPATCH)
		return forward_local(hp, ph, budget, done_p, why);
	return combine_local(hp, ph, budget, done_p, why);
}

/* Every byte of the phase is here: write the ranks' outputs (host memory directly; CUDA memory
 * from the pinned staging by async copies, one mark per CUDA rank). */
static rw_status_t host_finish(void *mover, void *state, const rw_svc_phase_t *ph,
			       rw_svc_phase_kind_t kind, uint32_t *pending_p, char *why)
{
	host_mover_t *m = mover;
	host_pair_t *hp = state;
	uint32_t pending = 0;
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[kind][g];
		rw_status_t st = RW_OK;
		if (kind == RW_SVC_DISPATCH) {
			const rw_svc_out_layout_t *o = &hp->rank_out.layout[g];
			uint64_t counts = ph->n_experts > RW_CQE_INLINE_COUNTS ? 4ull * ph->n_experts : 0;
			if (counts)
				memcpy(hp->counts_dst[g], hp->rank_out.expert_counts[g], counts);
			if (io->out.dev < 0)
				continue;
			if (rw_svc_gpu_stalled(io->out.dev, why, RW_SVC_WHY_MAX)) {
				*pending_p = pending;
				return RW_ERR_DEVICE; /* named: refused until it moves again */
			}
			hp->devs[g] |= io->out.dev < 64 ? 1ull << io->out.dev : 0;
			uint64_t n = hp->rank_out.n[g];
			st = rw_svc_stage_h2d(m->stage, io->out.dev, io->out.dptr + o->counts_off,
					      hp->counts_dst[g], counts);
			if (st == RW_OK)
				st = rw_svc_stage_h2d(m->stage, io->out.dev, io->out.dptr + o->rows_off,
						      hp->rows_dst[g], n * ph->row_bytes);
			if (st == RW_OK)
				st = rw_svc_stage_h2d(m->stage, io->out.dev, io->out.dptr + o->meta_off,
						      hp->rank_out.meta[g], n * o->meta_bytes);
		} else {
			uint64_t n = ph->rt[g].n_tokens;
			if (n == 0 && io->signal && (st = rw_svc_stage_flag(io)) != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "cannot write local rank %u's completion "
					 "flag: %s", g, rw_status_str(st));
				*pending_p = pending;
				return RW_ERR_DEVICE;
			}
			if (n == 0)
				continue;
			/* Every token is summed in place by now: when its last term came in, or by
			 * the local work, which ran to the end before this. */
			if (io->out.dev < 0)
				continue;
			if (rw_svc_gpu_stalled(io->out.dev, why, RW_SVC_WHY_MAX)) {
				*pending_p = pending;
				return RW_ERR_DEVICE; /* named: refused until it moves again */
			}
			hp->devs[g] |= io->out.dev < 64 ? 1ull << io->out.dev : 0;
			st = rw_svc_stage_h2d(m->stage, io->out.dev, io->out.dptr, hp->c_out[g],
					      n * ph->row_bytes);
		}
		if (st == RW_OK)
			st = rw_svc_stage_mark(m->stage, io->out.dev, stage_token(hp, OP_FLUSH, g));
		hp->flag_io[g] = st == RW_OK && io->signal ? io : NULL;
		if (st != RW_OK) {
			hp->loose = 1;
			snprintf(why, RW_SVC_WHY_MAX, "cannot copy results into local rank %u's CUDA "
				 "memory: %s", g, rw_status_str(st));
			*pending_p = pending;
			return RW_ERR_DEVICE;
		}
		pending++;
		hp->pending++;
	}
	*pending_p = pending;
	return RW_OK;
}

static void host_result(void *state, uint32_t g, uint32_t *recv_rows_p, const uint32_t **counts_p)
{
	const host_pair_t *hp = state;
	*recv_rows_p = hp->rank_out.n[g];
	*counts_p = hp->rank_out.expert_counts[g];
}

const rw_svc_mover_ops_t rw_svc_mover_host = {
	.name = "host",
	.create = host_create,
	.destroy = host_destroy,
	.accepts = host_accepts,
	.open = host_open,
	.stage = host_stage,
	.plan = host_plan,
	.pack = host_pack,
	.arrived = host_arrived,
	.part = host_part,
	.local = host_local,
	.finish = host_finish,
	.result = host_result,
	.quiesce = host_quiesce,
	.fence = host_fence,
	.close = host_close,
};
