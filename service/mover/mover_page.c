/* The rank path's mover (docs/rankpath.md "A phase"): the executor's state machine runs a pair
 * of page ranks as it runs any other, and each mover operation is answered from the ranks'
 * words and the daemon's arithmetic (mover_rank.c) instead of moving bytes: plan writes each
 * rank's plan block, then `plan = k` (P2); pack waits until every rank's `packed` reached k (P3)
 * and checks the records they wrote before a byte is posted; arrived checks each range's
 * headers as the host mover does; finish writes each rank's forward list, then `arrived = k`
 * (P4), and is pending until each rank's `done` (P5, the executor reports it). The combine
 * mirrors it: its plans once every rank's combine submit came (their inputs staged), the returns
 * checked before one is posted, each owner's reduce list then arrived. Failed phases
 * owe their words through the executor's answers (P6), so quiesce has nothing to stop: the
 * ranks' kernels, not this file, touch the payload.
 * A ring rank of the pair (a group whose ranks on this node mix the ring and the page) gets the
 * same plan block and lists, kept here, and the daemon's CPU plays its stream at once where a
 * page rank's kernels would run (mover_mix.c): its count at count, its records packed at plan,
 * its rows forwarded at finish; its combine rows staged at its submit, its gather at the combine's
 * plan, its reduce at finish. It has no words: nothing waits for its packed or done. A ring
 * rank's CUDA buffers are staged through its pinned host memory by asynchronous copies
 * (service/mover/stage.c), as the host mover stages them: its inputs before it counts or its
 * rows are staged, its outputs after they are written; those copies' completions come back
 * through the loop as this mover's reports.
 * A pair on a GPU carve-out (ph->slab_shadow) reads no record in place: every check, and the
 * lists made from the checked headers, read the carve-out's host shadow, into which the header
 * pull (mover_pull.c) copies exactly what they read — each rank's records after its packed
 * (header and top-k block, gathered; pack answers RW_ERR_AGAIN until they land), each received
 * range after its arrival (rw_cuda_gdr_flush first; the range is checked when its pull lands, a
 * bad one refused as RW_MV_OP_REFUSED, and finish waits for every such check), and the combine
 * returns before they are posted. No ring rank is played there (the daemon's CPU may not reach
 * the memory): such a pair fails, named. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"
#include "service/phase/phase.h"

#define LINE_UP(x) (((x) + 63) & ~(uint64_t)63)

/* What the daemon told rank g at plan: its own copy, which the checks read (the rank may rewrite
 * the block in its page at will). */
typedef struct page_rank {
	rw_page_plan_head_t head;
	uint32_t *tags;                /* [N] */
	rw_page_plan_entry_t *entries; /* [N*R] */
} page_rank_t;

typedef struct page_mover page_mover_t;

typedef struct page_pair {
	rw_svc_mover_done_fn done;
	void *ctx;
	page_mover_t *m;
	struct page_pair *older;       /* m->pairs: open pairs, for the stage's reports */
	const rw_svc_phase_t *ph;      /* the executor's, for as long as the pair is open */
	page_rank_t rk[RW_MAX_GPUS];
	int checked;                   /* every rank's records passed the check */
	rw_svc_rank_lists_t lists;     /* the dispatch's forward lists and terms */
	/* The combine (docs/rankpath.md "A phase", Combine): where its local copies (per rail) and
	 * the ranks' staged inputs (rail 0) lie in the local area, fixed at the dispatch's plan
	 * (offsets in the slabs); the ranks whose combine submit came (bit g); its plans written,
	 * its returns checked; each owner's reduce list, made at its plan. */
	uint64_t comb_local_off[RW_MAX_RAILS];
	rw_page_stage_t stage[RW_MAX_GPUS];
	uint32_t c_staged;
	int c_planned, c_checked;
	rw_page_list_entry_t *reduce[RW_MAX_GPUS];
	uint32_t n_reduce[RW_MAX_GPUS];
	/* The ring ranks (mover_mix.c): the daemon's copy of each one's top-k ids, its count row, its
	 * per-expert counts; scratch for their packs. */
	int32_t *ring_ids[RW_MAX_GPUS];
	uint32_t *ring_row[RW_MAX_GPUS];
	uint32_t *ring_counts[RW_MAX_GPUS];
	uint32_t *next;                /* [N] */
	/* CUDA ring ranks' copies: marks not done per kind (inputs) and rank, all marks not done
	 * (outputs too), each rank's flag to write once its outputs are copied (stream order), and
	 * the node's row when count() waits for the ids' copies. */
	uint32_t marks[RW_SVC_KIND_COUNT][RW_MAX_GPUS];
	uint32_t pending;
	uint64_t devs[RW_MAX_GPUS];    /* the devices rank g's copies went to (bit d) */
	int loose;                     /* copies that may not have landed with no mark pending:
					* a failed enqueue, or marks a stall gave up on */
	const rw_svc_rank_io_t *flag_io[RW_MAX_GPUS];
	uint32_t *count_row;
	/* The header pull (a GPU carve-out): per kind, the records' pull before the check (0 not
	 * asked, 1 in flight, 2 landed with pull_st); the received ranges' pulls in flight, a bad one
	 * met, finish waiting for them (its work done once the last lands). */
	int pulled[RW_SVC_KIND_COUNT];
	rw_status_t pull_st[RW_SVC_KIND_COUNT];
	uint32_t rx_pulls[RW_SVC_KIND_COUNT];
	int rx_bad, fin_wait[RW_SVC_KIND_COUNT];
} page_pair_t;

struct page_mover {
	rw_svc_mover_done_fn done;
	void *ctx;
	rw_svc_stage_t *stage;
	rw_svc_pull_t *pull;
	page_pair_t *pairs;
};

/* A pull's token: the pair, what it was for, the kind, and for a range its (source, rail). */
enum { PULL_PACK = 1, PULL_RANGE = 2 };
static uint64_t pull_token(uint32_t serial, uint32_t what, rw_svc_phase_kind_t kind, uint32_t arg)
{
	return (uint64_t)serial << 32 | (uint64_t)what << 28 | (uint64_t)kind << 24 | (arg & 0xffffff);
}

static void pull_landed(void *ctx, uint64_t token, rw_status_t st);

enum { OP_FLUSH = RW_SVC_KIND_COUNT }; /* stage token ops: the kind for inputs, OP_FLUSH outputs */

static void stage_done(void *ctx, uint64_t token, rw_status_t st);

static rw_status_t pm_create(struct ev_loop *loop, rw_svc_mover_done_fn done, void *ctx,
			     void **mover_p)
{
	page_mover_t *m = calloc(1, sizeof(*m));
	if (!m)
		return RW_ERR_NOMEM;
	m->done = done;
	m->ctx = ctx;
	rw_status_t st = rw_svc_stage_create(loop, stage_done, m, &m->stage);
	if (st != RW_OK) {
		free(m);
		return st;
	}
	if ((st = rw_svc_pull_create(loop, pull_landed, m, &m->pull)) != RW_OK) {
		rw_svc_stage_destroy(m->stage);
		free(m);
		return st;
	}
	*mover_p = m;
	return RW_OK;
}

static void pm_destroy(void *mover)
{
	page_mover_t *m = mover;
	rw_svc_stage_destroy(m->stage); /* waits for every copy */
	rw_svc_pull_destroy(m->pull);
	free(m);
}

/* A ring rank beside page ranks: the daemon's CPU plays its stream, whatever its buffers. */
static int pm_accepts(void *mover, const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, uint32_t g)
{
	(void)mover;
	return ph->io[kind][g].page != NULL || ph->page_members != 0;
}

static void pair_free(page_pair_t *pp, uint32_t gpus)
{
	if (pp->m) { /* off the mover's list: no report reaches it any more */
		page_pair_t **at = &pp->m->pairs;
		while (*at && *at != pp)
			at = &(*at)->older;
		if (*at)
			*at = pp->older;
	}
	for (uint32_t g = 0; g < gpus; g++) {
		free(pp->rk[g].tags);
		free(pp->rk[g].entries);
		free(pp->lists.list[g]);
		free(pp->lists.term_off[g]);
		free(pp->lists.term_ref[g]);
		free(pp->reduce[g]);
		free(pp->ring_ids[g]);
		free(pp->ring_row[g]);
		free(pp->ring_counts[g]);
	}
	free(pp->next);
	free(pp);
}

static rw_status_t pm_open(void *mover, const rw_svc_phase_t *ph, void **state_p)
{
	page_mover_t *m = mover;
	page_pair_t *pp = calloc(1, sizeof(*pp));
	if (!pp)
		return RW_ERR_NOMEM;
	pp->done = m->done;
	pp->ctx = m->ctx;
	pp->ph = ph;
	pp->next = calloc(ph->nodes, sizeof(uint32_t));
	if (!pp->next) {
		pair_free(pp, ph->gpus);
		return RW_ERR_NOMEM;
	}
	for (uint32_t g = 0; g < ph->gpus; g++) {
		pp->rk[g].tags = calloc(ph->nodes, sizeof(uint32_t));
		pp->rk[g].entries = calloc((size_t)ph->nodes * ph->rails, sizeof(rw_page_plan_entry_t));
		if (!pp->rk[g].tags || !pp->rk[g].entries) {
			pair_free(pp, ph->gpus);
			return RW_ERR_NOMEM;
		}
	}
	pp->m = m;
	pp->older = m->pairs;
	m->pairs = pp;
	*state_p = pp;
	return RW_OK;
}

static rw_status_t combine_plan(page_pair_t *pp, const rw_svc_phase_t *ph, char *why);

/* Local rank h's staged combine rows in its native rail's slab (ipc/page.h rw_page_stage_t). */
static uint8_t *staged_at(const page_pair_t *pp, const rw_svc_phase_t *ph, uint32_t h)
{
	return ph->slab[pp->stage[h].rail] + pp->stage[h].off;
}

static uint64_t stage_token(const page_pair_t *pp, uint32_t op, uint32_t g)
{
	return rw_svc_stage_token(pp->ph->serial, op, g);
}

/* Ring rank g's `kind` inputs (len[i] bytes of in[i]) readable at at[i]: host memory as it is,
 * CUDA memory copied into its pinned staging, one mark per device; pp->marks[kind][g] counts
 * the marks still to come. */
static rw_status_t ring_fetch(page_pair_t *pp, const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind,
			      uint32_t g, const uint64_t *len, unsigned n_in, const uint8_t **at,
			      char *why)
{
	const rw_svc_rank_io_t *io = &ph->io[kind][g];
	uint64_t need = 0, off = 0, devs = 0;
	for (unsigned i = 0; i < n_in; i++) {
		need += io->in[i].dev >= 0 ? LINE_UP(len[i]) : 0;
		if (io->in[i].dev >= 0 && rw_svc_gpu_stalled(io->in[i].dev, why, RW_SVC_WHY_MAX))
			return RW_ERR_DEVICE; /* named: refused until it moves again */
	}
	rw_status_t st = need ? rw_svc_pinned_reserve(ph->stage_in[g], need) : RW_OK;
	for (unsigned i = 0; i < n_in && st == RW_OK; i++) {
		at[i] = io->in[i].host;
		if (io->in[i].dev < 0)
			continue;
		if (io->in[i].dev >= 64) {
			st = RW_ERR_INVAL;
			break;
		}
		/* Stream order: the copies wait on the GPU for the rank's event (never the loop) */
		if (io->wait_ev && !(devs >> io->in[i].dev & 1))
			st = rw_svc_stage_wait_event(pp->m->stage, io->in[i].dev, io->wait_ev);
		uint8_t *dst = (uint8_t *)ph->stage_in[g]->ptr + off;
		if (st == RW_OK)
			st = rw_svc_stage_d2h(pp->m->stage, io->in[i].dev, dst, io->in[i].dptr,
					      len[i]);
		at[i] = dst;
		off += LINE_UP(len[i]);
		devs |= 1ull << io->in[i].dev;
	}
	pp->devs[g] |= devs;
	for (int d = 0; d < 64 && st == RW_OK; d++)
		if ((devs >> d & 1) &&
		    (st = rw_svc_stage_mark(pp->m->stage, d, stage_token(pp, kind, g))) == RW_OK) {
			pp->marks[kind][g]++;
			pp->pending++;
		}
	if (st != RW_OK) {
		pp->loose = 1;
		snprintf(why, RW_SVC_WHY_MAX, "cannot copy local rank %u's CUDA %s to the host: %s",
			 ph->me * ph->gpus + g, kind == RW_SVC_COMBINE ? "combine rows" : "inputs",
			 rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	return RW_OK;
}

/* A ring rank's inputs as its stream would have them, once its CUDA buffers are copied (stream
 * order: the copies wait on the GPU for its event, ring_fetch): its dispatch's ids
 * read once (the pack and the count read the daemon's copy, never the rank's memory, which it
 * may rewrite after submitting: what the peers were counted is what is sent), its rows and
 * weights, its count row to come; its combine rows, to be staged beside the page ranks'.
 * *pending_p: the copies' reports follow. */
static rw_status_t ring_stage(page_pair_t *pp, rw_svc_phase_t *ph, rw_svc_phase_kind_t kind,
			      uint32_t g, int *pending_p, char *why)
{
	rw_svc_rank_io_t *io = &ph->io[kind][g];
	const uint8_t *at[3];
	if (kind == RW_SVC_COMBINE) {
		const uint64_t len = (uint64_t)(pp->lists.list[g] ? pp->lists.n[g] : 0) * ph->row_bytes;
		rw_status_t st = ring_fetch(pp, ph, kind, g, &len, 1, at, why);
		io->tokens = at[0];
		*pending_p = pp->marks[kind][g] != 0;
		return st;
	}
	const uint64_t n = io->n_tokens, n_ids = n * ph->topk;
	pp->ring_ids[g] = malloc(n_ids * sizeof(int32_t) + 1);
	pp->ring_row[g] = calloc((size_t)ph->nodes * ph->rails, sizeof(uint32_t));
	pp->ring_counts[g] = calloc(ph->n_experts + 1, sizeof(uint32_t));
	if (!pp->ring_ids[g] || !pp->ring_row[g] || !pp->ring_counts[g]) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory for local rank %u's ring submission",
			 ph->me * ph->gpus + g);
		return RW_ERR_NOMEM;
	}
	const uint64_t len[3] = { n * ph->row_bytes, n_ids * 4, n_ids * 4 };
	rw_status_t st = ring_fetch(pp, ph, kind, g, len, 3, at, why);
	if (st != RW_OK)
		return st;
	if (io->in[1].dev < 0 && n_ids) /* a CUDA span's copy is the daemon's already */
		memcpy(pp->ring_ids[g], at[1], n_ids * sizeof(int32_t));
	io->tokens = at[0];
	io->ids = io->in[1].dev < 0 ? pp->ring_ids[g] : (const int32_t *)(const void *)at[1];
	io->weights = (const float *)(const void *)at[2];
	io->page_row = pp->ring_row[g]; /* counted at count */
	*pending_p = pp->marks[kind][g] != 0;
	return RW_OK;
}

/* Local rank g's combine input is staged (a ring rank's rows copied into its staging area, P1
 * holding: the daemon wrote them): once every local rank's is, the combine's plans go out (P2). */
static rw_status_t combine_staged(page_pair_t *pp, const rw_svc_phase_t *ph, uint32_t g,
				  char *why)
{
	const rw_svc_rank_io_t *io = &ph->io[RW_SVC_COMBINE][g];
	if (!io->page && pp->lists.list[g] && pp->lists.n[g])
		memcpy(staged_at(pp, ph, g), io->tokens, pp->lists.n[g] * ph->row_bytes);
	pp->c_staged |= 1u << g;
	if (pp->c_staged != (uint32_t)((1ull << ph->gpus) - 1) || pp->c_planned)
		return RW_OK;
	return combine_plan(pp, ph, why);
}

/* A page rank's inputs are in its GPU's memory, which the daemon never reads. */
static rw_status_t pm_stage(void *mover, void *state, rw_svc_phase_t *ph, rw_svc_phase_kind_t kind,
			    uint32_t g, int *pending_p, char *why)
{
	(void)mover;
	page_pair_t *pp = state;
	*pending_p = 0;
	if (!ph->io[kind][g].page) {
		rw_status_t st = ring_stage(pp, ph, kind, g, pending_p, why);
		if (st != RW_OK || *pending_p)
			return st; /* a combine's rows are staged when the copies' report comes */
	}
	return kind == RW_SVC_COMBINE ? combine_staged(pp, ph, g, why) : RW_OK;
}

/* Whether a ring rank's dispatch inputs are still being copied. */
static int ring_fetching(const page_pair_t *pp)
{
	for (uint32_t g = 0; g < RW_MAX_GPUS; g++)
		if (pp->marks[RW_SVC_DISPATCH][g])
			return 1;
	return 0;
}

/* The node's row: every rank's count row (each counts at its native rail only); a ring rank's
 * counted here from its ids, as its count kernel would (a bad id fails the pair, *bad_p the
 * rank). */
static rw_status_t count_row(page_pair_t *pp, const rw_svc_phase_t *ph, uint32_t *row,
			     uint32_t *bad_p)
{
	const size_t nr = (size_t)ph->nodes * ph->rails;
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
		if (io->page)
			continue;
		const rw_rank_tokens_t rt = { .local_gpu = g, .n_tokens = io->n_tokens,
					      .topk = ph->topk, .expert_ids = io->ids };
		if (rw_sched_count(ph->topo, ph->n_experts, ph->me, &rt, 1, pp->ring_row[g], NULL) !=
		    RW_OK) {
			*bad_p = g;
			return RW_ERR_SUB_TOKENS;
		}
	}
	memset(row, 0, nr * sizeof(*row));
	for (uint32_t g = 0; g < ph->gpus; g++)
		for (size_t i = 0; i < nr; i++)
			row[i] += ph->io[RW_SVC_DISPATCH][g].page_row[i];
	return RW_OK;
}

/* The node's row now, or (a ring rank's ids still being copied) once they are: COUNTED. */
static rw_status_t pm_count(void *mover, void *state, const rw_svc_phase_t *ph, uint32_t *row,
			    int *pending_p, uint32_t *bad_p, char *why)
{
	(void)mover, (void)why;
	page_pair_t *pp = state;
	*pending_p = ring_fetching(pp);
	if (*pending_p) {
		pp->count_row = row;
		return RW_OK;
	}
	return count_row(pp, ph, row, bad_p);
}

static page_pair_t *pair_of(const page_mover_t *m, uint32_t serial)
{
	page_pair_t *pp = m->pairs;
	while (pp && pp->ph->serial != serial)
		pp = pp->older;
	return pp;
}

/* The next open pair with copies pending on a stalled device: given up (its marks, if they land,
 * are reported to nobody; its staging retired at quiesce), its serial and first rank there. */
static int stalled_pair(page_mover_t *m, int device, uint32_t *serial_p, int *g_p)
{
	page_pair_t *pp = m->pairs;
	while (pp && (!pp->pending || (*g_p = rw_svc_stage_rank_on(pp->devs, device)) < 0))
		pp = pp->older;
	if (!pp)
		return 0;
	pp->pending = 0;
	pp->loose = 1;
	memset(pp->marks, 0, sizeof(pp->marks));
	*serial_p = pp->ph->serial;
	return 1;
}

/* A copy of a ring rank's CUDA buffers completed (the loop's ev_io on the stream's eventfd):
 * its inputs are readable (a combine's rows go to its staging area, and the combine may plan),
 * or its outputs are in its memory (its flag written, stream order); a count that waited for the
 * ids' copies is made once the last is in. */
static void stage_done(void *ctx, uint64_t token, rw_status_t st)
{
	page_mover_t *m = ctx;
	if (token == RW_SVC_STAGE_ALL) { /* a stream faulted: every pending copy failed */
		for (page_pair_t *pp = m->pairs; pp; pp = pp->older) {
			pp->pending = 0;
			memset(pp->marks, 0, sizeof(pp->marks));
		}
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
	page_pair_t *pp = pair_of(m, serial);
	if (!pp || g >= RW_MAX_GPUS || !pp->pending)
		return; /* a pair that ended or failed meanwhile (its staging retired then) */
	pp->pending--;
	if (op == OP_FLUSH) { /* its outputs are in its memory */
		rw_svc_stage_flushed(m->done, m->ctx, serial, g, &pp->flag_io[g], st);
		return;
	}
	if (op >= RW_SVC_KIND_COUNT || !pp->marks[op][g] || --pp->marks[op][g])
		return;
	char why[RW_SVC_WHY_MAX] = "";
	if (st == RW_OK && op == RW_SVC_COMBINE && (st = combine_staged(pp, pp->ph, g, why)) != RW_OK)
		rw_warn("rank path: %s", why);
	m->done(m->ctx, serial, op == RW_SVC_DISPATCH ? RW_MV_OP_STAGE_D : RW_MV_OP_STAGE_C, g, st);
	pp = pair_of(m, serial); /* the report may have ended the pair */
	if (op != RW_SVC_DISPATCH || st != RW_OK || !pp || !pp->count_row || ring_fetching(pp))
		return;
	uint32_t *row = pp->count_row, bad = 0;
	pp->count_row = NULL;
	st = count_row(pp, pp->ph, row, &bad);
	m->done(m->ctx, serial, RW_MV_OP_COUNTED, st == RW_ERR_SUB_TOKENS ? bad : 0, st);
}

static uint8_t *slot_of(const rw_svc_rank_io_t *io)
{
	return rw_page_slot_at(io->page, &io->page_layout, io->page_k);
}

/* Whether the pair's slabs are (on some rail) GPU memory whose headers are pulled. */
static int pulls(const rw_svc_phase_t *ph)
{
	for (uint32_t r = 0; r < ph->rails; r++)
		if (ph->slab_shadow[r])
			return 1;
	return 0;
}

/* What the checks read for byte p of rail r's slab: its shadow's copy on a GPU carve-out, else
 * p itself (host memory). */
static const uint8_t *view(const rw_svc_phase_t *ph, uint32_t r, const uint8_t *p)
{
	return ph->slab_shadow[r] ? ph->slab_shadow[r] + (p - ph->slab[r]) : p;
}

/* The dispatch's areas of rail r, as offsets in the group's slab of that rail. */
static rw_page_plan_rail_t rail_areas(const rw_svc_phase_t *ph, uint32_t r)
{
	return (rw_page_plan_rail_t){
		.send_off = (uint64_t)(ph->send_area[RW_SVC_DISPATCH][r] - ph->slab[r]),
		.recv_off = (uint64_t)(ph->recv_area[RW_SVC_DISPATCH][r] - ph->slab[r]),
		.local_off = (uint64_t)(ph->local_area[r] - ph->slab[r]),
		.slab_bytes = ph->slab_bytes };
}

/* Records of rail r's local area: segment (me, r) of the node's row, every rank of that rail. */
static uint32_t local_n(const rw_svc_phase_t *ph, uint32_t r)
{
	uint32_t n = 0;
	for (uint32_t g = 0; g < ph->gpus; g++)
		n += ph->io[RW_SVC_DISPATCH][g].page_row[(size_t)ph->me * ph->rails + r];
	return n;
}

/* The rows a local rank can receive in the phase: one per record the node holds at most, and at
 * most the smallest max_recv of the ranks' pages (a bound for a ring rank's list too: its
 * output's room is checked at its forward): the forward lists' length and each rank's room in
 * the staging. */
static uint32_t rows_bound(const rw_svc_phase_t *ph)
{
	uint64_t rows_max = ph->n_in;
	for (uint32_t r = 0; r < ph->rails; r++)
		rows_max += local_n(ph, r);
	uint32_t max = (uint32_t)RW_MIN((uint64_t)RW_PAGE_MAX_RECV, rows_max);
	for (uint32_t g = 0; g < ph->gpus; g++)
		if (ph->io[RW_SVC_DISPATCH][g].page)
			max = RW_MIN(max, ph->io[RW_SVC_DISPATCH][g].page_max_recv);
	return max;
}

/* Rank g's plan block (the daemon's copy in rk, the staging table, the areas of each rail)
 * into its slot. */
static void plan_write(const rw_svc_phase_t *ph, const rw_svc_rank_io_t *io, const page_rank_t *rk,
		       const rw_page_stage_t *stage, const rw_page_plan_rail_t *areas)
{
	uint8_t *slot = slot_of(io);
	const rw_page_layout_t *l = &io->page_layout;
	memcpy(slot + l->plan, &rk->head, sizeof(rk->head));
	memcpy(slot + l->plan_stage, stage, ph->gpus * sizeof(stage[0]));
	memcpy(slot + l->plan_rail, areas, ph->rails * sizeof(areas[0]));
	memcpy(slot + l->plan_tag, rk->tags, ph->nodes * sizeof(uint32_t));
	memcpy(slot + l->plan_entry, rk->entries,
	       (size_t)ph->nodes * ph->rails * sizeof(rw_page_plan_entry_t));
}

/* Phase k of the rank goes ahead: its status line, which a failed phase D earlier left set, is
 * 0 again before its plan word (the store-release publishes both; ipc/page.h). */
static void plan_publish(const rw_svc_rank_io_t *io)
{
	atomic_store_explicit(&io->page->status[io->page_k & (RW_PAGE_DEPTH - 1)].v, 0,
			      memory_order_relaxed);
	rw_page_word_publish(&io->page->word[RW_PW_PLAN].v, io->page_k); /* a host rank wakes */
}

/* The decision is known: each rank's plan block into its slot, then plan = k (P2). */
static rw_status_t pm_plan(void *mover, void *state, const rw_svc_phase_t *ph, char *why)
{
	(void)mover;
	page_pair_t *pp = state;
	const uint32_t R = ph->rails;
	rw_page_plan_rail_t areas[RW_MAX_RAILS];
	/* The local area of each rail: the dispatch's local records, the combine's local copies,
	 * the staged combine inputs of the rail's ranks, each with room for the rows a rank can
	 * receive (rw_svc_local_plan; ipc/page.h rw_page_stage_t); `railwave size` sizes
	 * group_area_mib and group_local_mib by the same arithmetic. */
	uint32_t n[RW_MAX_RAILS] = { 0 };
	for (uint32_t r = 0; r < R; r++)
		n[r] = local_n(ph, r);
	const uint32_t rows_room = rows_bound(ph);
	rw_svc_local_plan_t lp;
	rw_svc_local_plan(R, ph->gpus, ph->topo->gpu_rail, ph->rec_size, ph->crec_size,
			  ph->row_bytes, rows_room, n, &lp);
	for (uint32_t r = 0; r < R; r++) {
		if (!ph->slab[r]) {
			snprintf(why, RW_SVC_WHY_MAX, "the group has no slabs of its own (the daemon's "
				 "group_pool_mib was spent, or group_area_mib is 0): its page ranks' "
				 "kernels have nowhere to write");
			return RW_ERR_STATE;
		}
		areas[r] = rail_areas(ph, r);
		pp->comb_local_off[r] = areas[r].local_off + lp.comb_off[r];
		const uint64_t end = areas[r].local_off + lp.end[r];
		if (end > ph->slab_bytes) { /* the local area is the slab's last */
			snprintf(why, RW_SVC_WHY_MAX, "rail %u: local records, combine copies, staging "
				 "(%u rows per rank): %llu bytes; the group's local area holds %llu "
				 "(group_area_mib, group_local_mib)", r, rows_room,
				 (unsigned long long)(end - areas[r].local_off),
				 (unsigned long long)(ph->slab_bytes - areas[r].local_off));
			return RW_ERR_RANGE;
		}
	}
	for (uint32_t g = 0; g < ph->gpus && pulls(ph); g++)
		if (!ph->io[RW_SVC_DISPATCH][g].page) {
			snprintf(why, RW_SVC_WHY_MAX, "local rank %u is a ring rank: the group's slabs "
				 "are GPU memory the daemon does not write (a group mixing ring and rank-path "
				 "ranks needs host slabs)", ph->me * ph->gpus + g);
			return RW_ERR_STATE;
		}
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const uint32_t r = ph->topo->gpu_rail[g];
		pp->stage[g] = (rw_page_stage_t){ .off = areas[r].local_off + lp.stage_at[g],
						  .rail = r, .rows = rows_room };
	}
	const uint32_t *rows[RW_MAX_GPUS];
	for (uint32_t g = 0; g < ph->gpus; g++)
		rows[g] = ph->io[RW_SVC_DISPATCH][g].page_row;
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
		page_rank_t *rk = &pp->rk[g];
		rw_svc_rank_plan(ph, g, rows, areas, io->page_k, &rk->head, rk->tags, rk->entries);
		if (!io->page) { /* a ring rank: its records packed now, as its kernel would */
			rw_status_t st = rw_svc_ring_pack(ph, g, rk->tags, rk->entries, ph->slab,
							  pp->next, why);
			if (st != RW_OK)
				return st;
			continue;
		}
		plan_write(ph, io, rk, pp->stage, areas);
		plan_publish(io); /* P2: the block before the word */
	}
	return RW_OK;
}

/* A stalled GPU one of the pair's GPU slabs lies on, named in why: 1; else 0. */
static int stalled_slab(const rw_svc_phase_t *ph, char *why)
{
	for (uint32_t r = 0; r < ph->rails; r++)
		if (ph->slab_shadow[r] && rw_svc_gpu_stalled(ph->slab_gpu[r], why, RW_SVC_WHY_MAX))
			return 1;
	return 0;
}

/* Rank g's packed reached its phase (P3: the load-acquire before its records are read); a ring
 * rank's records were packed by the daemon. */
static int packed(const rw_svc_rank_io_t *io)
{
	if (!io->page)
		return 1;
	uint64_t v = atomic_load_explicit(&io->page->word[RW_PW_PACKED].v, memory_order_acquire);
	return (int64_t)(v - io->page_k) >= 0;
}

/* The pull before the pack's check (a GPU carve-out): every rank's records of the dispatch —
 * header and top-k block of each, at the places its plan block gives, never the rows — or the
 * combine's returns, one header per slot of the receive layout; then the mark. */
static rw_status_t pull_records(page_pair_t *pp, const rw_svc_phase_t *ph,
				rw_svc_phase_kind_t kind, char *why)
{
	const uint32_t R = ph->rails;
	const size_t nr = (size_t)ph->nodes * R;
	rw_status_t st = RW_OK;
	for (uint32_t g = 0; kind == RW_SVC_DISPATCH && g < ph->gpus && st == RW_OK; g++)
		for (size_t i = 0; i < nr && st == RW_OK; i++) {
			const rw_page_plan_entry_t *e = &pp->rk[g].entries[i];
			if (ph->slab_shadow[i % R])
				st = rw_svc_pull_rows(pp->m->pull, ph, (uint32_t)(i % R), e->offset,
						      ph->rec_size, rw_wire_rec_row_off(ph->topk),
						      e->count, why);
		}
	for (size_t i = 0; kind == RW_SVC_COMBINE && i < nr && st == RW_OK; i++) {
		const uint32_t r = (uint32_t)(i % R);
		const uint64_t area = (uint64_t)(ph->send_area[kind][r] - ph->slab[r]);
		if (ph->slab_shadow[r])
			st = rw_svc_pull_rows(pp->m->pull, ph, r,
					      area + (uint64_t)ph->layout->in_first[i] * ph->crec_size,
					      ph->crec_size, RW_WIRE_CREC_HDR, ph->layout->in_quota[i], why);
	}
	if (st == RW_OK)
		st = rw_svc_pull_mark(pp->m->pull, pull_token(ph->serial, PULL_PACK, kind, 0), why);
	return st;
}

/* Once every rank packed: every record checked before the first byte is posted. A lie fails the
 * pair here, before any wave: nothing of it leaves the node. */
static rw_status_t pm_pack(void *mover, void *state, const rw_svc_phase_t *ph,
			   rw_svc_phase_kind_t kind, uint32_t d, char *why)
{
	(void)mover, (void)d;
	page_pair_t *pp = state;
	if (kind == RW_SVC_DISPATCH ? pp->checked : pp->c_checked)
		return RW_OK;
	for (uint32_t g = 0; g < ph->gpus; g++)
		if (!packed(&ph->io[kind][g])) {
			why[0] = '\0';
			return RW_ERR_AGAIN; /* the executor passes the word on (RW_MV_OP_PACKED) */
		}
	if (pulls(ph)) { /* what the check reads, pulled first (reported as RW_MV_OP_PACKED) */
		if (pp->pulled[kind] == 0) {
			rw_status_t st = pull_records(pp, ph, kind, why);
			if (st != RW_OK)
				return st;
			pp->pulled[kind] = 1;
		}
		if (pp->pulled[kind] == 1) {
			why[0] = '\0';
			return RW_ERR_AGAIN;
		}
		if (pp->pull_st[kind] != RW_OK) {
			if (pp->pull_st[kind] == RW_ERR_TIMEOUT && stalled_slab(ph, why))
				return RW_ERR_DEVICE; /* named: the GPU that stopped */
			snprintf(why, RW_SVC_WHY_MAX, "pulling the %s records' headers out of the group's "
				 "GPU slabs failed (%s)", rw_svc_kind_name(kind),
				 rw_status_str(pp->pull_st[kind]));
			return RW_ERR_DEVICE;
		}
	}
	if (kind == RW_SVC_COMBINE) { /* every return the gathers wrote, before one is posted */
		const uint8_t *ret[RW_MAX_RAILS];
		for (uint32_t r = 0; r < ph->rails; r++)
			ret[r] = view(ph, r, ph->send_area[kind][r]);
		rw_status_t st = rw_svc_rank_crecords_check(ph, &pp->lists, ret, why);
		if (st != RW_OK)
			return st;
		pp->c_checked = 1;
		return RW_OK;
	}
	const uint8_t *slab[RW_MAX_RAILS];
	for (uint32_t r = 0; r < ph->rails; r++)
		slab[r] = view(ph, r, ph->slab[r]);
	for (uint32_t g = 0; g < ph->gpus; g++) {
		if (!ph->io[kind][g].page)
			continue; /* the daemon packed them from its own copy of the ids */
		rw_status_t st = rw_svc_rank_records_check(ph, g, ph->io[kind][g].n_tokens,
							   pp->rk[g].tags, pp->rk[g].entries, slab,
							   why);
		if (st != RW_OK)
			return st;
	}
	pp->checked = 1;
	return RW_OK;
}

/* A complete range's headers at `area` (its receive area, or that area's shadow), checked as the
 * host mover checks them (a bad one is the sender's fault: RW_ERR_PROTO). */
static rw_status_t range_check(const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, uint32_t src,
			       uint32_t rail, const uint8_t *area, char *why)
{
	if (kind == RW_SVC_COMBINE) { /* returns: tag, source, rail and slot (the owner's reduce
				       * reads them where the reduce list says) */
		const uint32_t first = ph->layout->out_first[(size_t)src * ph->rails + rail];
		for (uint32_t k = 0; k < ph->layout->out_pairs[src].quota[rail]; k++) {
			const uint8_t *rec = area + ((uint64_t)first + k) * ph->crec_size;
			const rw_record_t *r;
			rw_status_t st = rw_svc_mover_crec_read(ph, rec, src, rail, k, &r, why);
			if (st != RW_OK)
				return st;
		}
		return RW_OK;
	}
	const size_t i = (size_t)src * ph->rails + rail;
	const uint32_t first = ph->layout->in_first[i];
	int32_t ids[RW_MAX_TOPK];
	float w[RW_MAX_TOPK];
	for (uint32_t k = 0; k < ph->layout->in_quota[i]; k++) {
		const uint8_t *rec = area + ((uint64_t)first + k) * ph->rec_size;
		rw_wire_rec_hdr_t h;
		rw_status_t st = rw_svc_mover_rec_read(ph, rec, src, rail, k, &h, ids, w, why);
		if (st != RW_OK)
			return st;
	}
	return RW_OK;
}

/* A complete range: checked now, or — on a GPU carve-out — once its headers are pulled (after a
 * GPUDirect flush where the GPU does not order the NIC's writes for its own copies): a bad one
 * then comes as RW_MV_OP_REFUSED, and finish waits for every such pull. */
static rw_status_t pm_arrived(void *mover, void *state, const rw_svc_phase_t *ph,
			      rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail, char *why)
{
	page_mover_t *m = mover;
	page_pair_t *pp = state;
	const uint8_t *area = ph->recv_area[kind][rail];
	if (!ph->slab_shadow[rail])
		return range_check(ph, kind, src, rail, area, why);
	const size_t i = (size_t)src * ph->rails + rail;
	const int dispatch = kind == RW_SVC_DISPATCH;
	const uint64_t size = dispatch ? ph->rec_size : ph->crec_size;
	const uint64_t first = dispatch ? ph->layout->in_first[i] : ph->layout->out_first[i];
	const uint32_t n = dispatch ? ph->layout->in_quota[i] : ph->layout->out_pairs[src].quota[rail];
	rw_status_t st = rw_cuda_gdr_flush(ph->slab_gpu[rail], 0);
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "rail %u: GPU %d cannot make the NIC's writes visible "
			 "to its copies (%s)", rail, ph->slab_gpu[rail], rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	st = rw_svc_pull_rows(m->pull, ph, rail, (uint64_t)(area - ph->slab[rail]) + first * size,
			      size, dispatch ? rw_wire_rec_row_off(ph->topk) : RW_WIRE_CREC_HDR, n, why);
	if (st == RW_OK)
		st = rw_svc_pull_mark(m->pull, pull_token(ph->serial, PULL_RANGE, kind, (uint32_t)i),
				      why);
	if (st == RW_OK)
		pp->rx_pulls[kind]++;
	return st;
}

/* The ranks wrote the node's own records into the local area: the pack step before it (the
 * first wave's, or a group on one node's for d = me) waited for every rank's packed and checked
 * every record. Nothing is left to do. */
static rw_status_t pm_local(void *mover, void *state, const rw_svc_phase_t *ph,
			    rw_svc_phase_kind_t kind, uint32_t budget, int *done_p, char *why)
{
	(void)mover, (void)ph, (void)budget;
	const page_pair_t *pp = state;
	*done_p = 1;
	if (kind == RW_SVC_DISPATCH ? pp->checked : pp->c_checked)
		return RW_OK;
	snprintf(why, RW_SVC_WHY_MAX, "the %s local step came before its pack step",
		 rw_svc_kind_name(kind));
	return RW_ERR_STATE;
}

/* The forward lists' arrays, rows_bound entries each. */
static rw_status_t lists_alloc(page_pair_t *pp, const rw_svc_phase_t *ph)
{
	rw_svc_rank_lists_t *ls = &pp->lists;
	const uint32_t max = rows_bound(ph);
	ls->max_recv = max;
	for (uint32_t g = 0; g < ph->gpus; g++) {
		if (!ls->list[g])
			ls->list[g] = calloc(max + 1, sizeof(rw_page_list_entry_t));
		if (!ls->term_off[g])
			ls->term_off[g] = calloc(max + 1, sizeof(uint32_t));
		if (!ls->term_ref[g])
			ls->term_ref[g] = calloc((size_t)ph->gpus * max + 1, sizeof(uint32_t));
		if (!ls->list[g] || !ls->term_off[g] || !ls->term_ref[g])
			return RW_ERR_NOMEM;
	}
	for (uint32_t r = 0; r < ph->rails; r++) { /* the headers as checked (pulled, on a GPU) */
		ls->recv[r] = view(ph, r, ph->recv_area[RW_SVC_DISPATCH][r]);
		ls->local[r] = view(ph, r, ph->local_area[r]);
		ls->local_n[r] = local_n(ph, r);
	}
	return RW_OK;
}

/* The page ranks of the pair: each one's done is a FINISH to come. */
static uint32_t page_ranks(const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind)
{
	uint32_t n = 0;
	for (uint32_t g = 0; g < ph->gpus; g++)
		n += ph->io[kind][g].page != NULL;
	return n;
}

/* A ring rank's outputs as its forward or reduce kernel would write them: into its host memory,
 * or, for CUDA memory, assembled in its pinned staging (the dispatch's compactly: counts, rows,
 * metadata) and copied out, a FINISH following the copies (its flag written then: stream
 * order). *pending_p: 1 when a FINISH follows. */
static rw_status_t ring_out(page_pair_t *pp, const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind,
			    uint32_t g, uint32_t *pending_p, char *why)
{
	const rw_svc_rank_io_t *io = &ph->io[kind][g];
	const int dev = io->out.dev;
	uint8_t *out = io->out.host;
	rw_status_t st = RW_OK;
	if (dev >= 0 && rw_svc_gpu_stalled(dev, why, RW_SVC_WHY_MAX))
		return RW_ERR_DEVICE; /* named: refused until it moves again */
	if (dev >= 0 && dev < 64)
		pp->devs[g] |= 1ull << dev;
	if (kind == RW_SVC_COMBINE) {
		const uint64_t bytes = (uint64_t)ph->io[RW_SVC_DISPATCH][g].n_tokens * ph->row_bytes;
		if (dev >= 0 && (st = rw_svc_pinned_reserve(ph->stage_out[g], bytes)) == RW_OK)
			out = ph->stage_out[g]->ptr;
		const uint8_t *local[RW_MAX_RAILS] = { 0 };
		for (uint32_t r = 0; r < ph->rails; r++)
			local[r] = ph->slab[r] + pp->comb_local_off[r];
		if (st == RW_OK) {
			rw_status_t rst = rw_svc_ring_reduce(ph, g, pp->reduce[g], pp->n_reduce[g],
							     local, out, why);
			if (rst != RW_OK)
				return rst;
		}
		if (st == RW_OK && dev >= 0)
			st = rw_svc_stage_h2d(pp->m->stage, dev, io->out.dptr, out, bytes);
	} else {
		rw_svc_out_layout_t o;
		rw_svc_out_layout(io->out_cap, ph->n_experts, ph->topk, ph->row_bytes,
				  RW_CQE_INLINE_COUNTS, &o);
		const uint64_t n = pp->lists.n[g];
		const uint64_t counts = ph->n_experts > RW_CQE_INLINE_COUNTS ? 4ull * ph->n_experts : 0;
		uint64_t rows_at = o.rows_off, meta_at = o.meta_off; /* in out: the output's layout */
		if (dev >= 0) { /* compact: n rows where the output holds rows_cap */
			rows_at = LINE_UP(counts);
			meta_at = rows_at + n * ph->row_bytes;
			st = rw_svc_pinned_reserve(ph->stage_out[g], meta_at + n * o.meta_bytes);
			out = ph->stage_out[g]->ptr;
		}
		if (st == RW_OK) {
			rw_status_t fst = rw_svc_ring_forward(ph, g, &pp->lists, out + rows_at,
							      out + meta_at, pp->ring_counts[g], why);
			if (fst != RW_OK)
				return fst;
			memcpy(out + o.counts_off, pp->ring_counts[g], counts);
		}
		if (st == RW_OK && dev >= 0)
			st = rw_svc_stage_h2d(pp->m->stage, dev, io->out.dptr + o.counts_off, out, counts);
		if (st == RW_OK && dev >= 0)
			st = rw_svc_stage_h2d(pp->m->stage, dev, io->out.dptr + o.rows_off, out + rows_at,
					      n * ph->row_bytes);
		if (st == RW_OK && dev >= 0)
			st = rw_svc_stage_h2d(pp->m->stage, dev, io->out.dptr + o.meta_off, out + meta_at,
					      n * o.meta_bytes);
	}
	if (st == RW_OK && dev >= 0)
		st = rw_svc_stage_mark(pp->m->stage, dev, stage_token(pp, OP_FLUSH, g));
	if (st != RW_OK) {
		pp->loose = 1;
		snprintf(why, RW_SVC_WHY_MAX, "cannot copy results into local rank %u's CUDA memory: "
			 "%s", ph->me * ph->gpus + g, rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	if (dev >= 0) {
		pp->flag_io[g] = io->signal ? io : NULL;
		pp->pending++;
		(*pending_p)++;
	}
	return RW_OK;
}

/* Every record is here and checked: each rank's forward list into its slot, then arrived = k
 * (P4); a FINISH per page rank follows its done (the executor's page words). A ring rank's
 * outputs are written now (ring_out). */
static rw_status_t finish_now(page_pair_t *pp, const rw_svc_phase_t *ph,
			      rw_svc_phase_kind_t kind, uint32_t *pending_p, char *why);

static rw_status_t pm_finish(void *mover, void *state, const rw_svc_phase_t *ph,
			     rw_svc_phase_kind_t kind, uint32_t *pending_p, char *why)
{
	(void)mover;
	page_pair_t *pp = state;
	*pending_p = page_ranks(ph, kind);
	if (pp->rx_pulls[kind]) { /* a range's headers still being pulled: once they are checked */
		pp->fin_wait[kind] = 1;
		(*pending_p)++; /* its RW_MV_OP_FINISH (pull_landed) */
		return RW_OK;
	}
	return finish_now(pp, ph, kind, pending_p, why);
}

static rw_status_t finish_now(page_pair_t *pp, const rw_svc_phase_t *ph,
			      rw_svc_phase_kind_t kind, uint32_t *pending_p, char *why)
{
	if (kind == RW_SVC_COMBINE) { /* each owner's reduce list, then arrived = k (P4) */
		for (uint32_t g = 0; g < ph->gpus; g++) {
			const rw_svc_rank_io_t *io = &ph->io[kind][g];
			if (!io->page) {
				rw_status_t st = ring_out(pp, ph, kind, g, pending_p, why);
				if (st != RW_OK)
					return st;
				continue;
			}
			uint8_t *slot = slot_of(io);
			const rw_page_layout_t *l = &io->page_layout;
			const rw_page_list_head_t head = { .phase = io->page_k, .count = pp->n_reduce[g],
							   .kind = 1 };
			memcpy(slot + l->list, &head, sizeof(head));
			memcpy(slot + l->list_entry, pp->reduce[g],
			       (size_t)pp->n_reduce[g] * sizeof(rw_page_list_entry_t));
			rw_page_word_publish(&io->page->word[RW_PW_ARRIVED].v, io->page_k);
		}
		return RW_OK;
	}
	rw_status_t st = lists_alloc(pp, ph);
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory for the forward lists");
		return st;
	}
	rw_svc_rank_lists_t *ls = &pp->lists;
	if ((st = rw_svc_rank_fwd_lists(ph, ls, why)) != RW_OK)
		return st;
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[kind][g];
		if (!io->page) {
			if ((st = ring_out(pp, ph, kind, g, pending_p, why)) != RW_OK)
				return st;
			continue;
		}
		uint8_t *slot = slot_of(io);
		const rw_page_layout_t *l = &io->page_layout;
		const rw_page_list_head_t head = { .phase = io->page_k, .count = ls->n[g], .kind = 0,
						   .n_recv = ls->n_recv[g] };
		memcpy(slot + l->list, &head, sizeof(head));
		memcpy(slot + l->list_entry, ls->list[g], (size_t)ls->n[g] * sizeof(ls->list[g][0]));
		rw_page_word_publish(&io->page->word[RW_PW_ARRIVED].v, io->page_k);
	}
	return RW_OK;
}

/* Every local rank's combine input is staged: each rank's combine plan block (its returns' and
 * local copies' places, the staging), its gather's terms (the dispatch's, kept since), then
 * plan = k (P2); each owner's reduce list is made now, while the dispatch's send headers — the
 * records' owners and tokens, checked before they left — are intact. */
static rw_status_t combine_plan(page_pair_t *pp, const rw_svc_phase_t *ph, char *why)
{
	const uint32_t R = ph->rails;
	const rw_svc_rank_lists_t *ls = &pp->lists;
	rw_page_plan_rail_t areas[RW_MAX_RAILS];
	const uint8_t *sent[RW_MAX_RAILS];
	for (uint32_t r = 0; r < R; r++) {
		areas[r] = (rw_page_plan_rail_t){
			.send_off = (uint64_t)(ph->send_area[RW_SVC_COMBINE][r] - ph->slab[r]),
			.recv_off = (uint64_t)(ph->recv_area[RW_SVC_COMBINE][r] - ph->slab[r]),
			.local_off = pp->comb_local_off[r], .slab_bytes = ph->slab_bytes };
		sent[r] = view(ph, r, ph->send_area[RW_SVC_DISPATCH][r]);
	}
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[RW_SVC_COMBINE][g];
		const uint32_t n_tokens = ph->io[RW_SVC_DISPATCH][g].n_tokens;
		/* a ring rank's list is the daemon's alone: room for every term its tokens can have */
		const uint32_t max = io->page ? io->page_max_recv :
			(uint32_t)RW_MIN((uint64_t)n_tokens * (ph->gpus + ph->nodes), UINT32_MAX - 1);
		uint32_t *cursor = calloc((size_t)n_tokens + 1, sizeof(uint32_t));
		if (!pp->reduce[g])
			pp->reduce[g] = calloc((size_t)max + 1, sizeof(rw_page_list_entry_t));
		if (!cursor || !pp->reduce[g]) {
			free(cursor);
			snprintf(why, RW_SVC_WHY_MAX, "out of memory for the reduce lists");
			return RW_ERR_NOMEM;
		}
		rw_status_t st = rw_svc_rank_reduce_list(ph, ls, sent, g, n_tokens, cursor,
							 pp->reduce[g], max, &pp->n_reduce[g], why);
		free(cursor);
		if (st != RW_OK)
			return st;
	}
	const uint8_t *staged[RW_MAX_GPUS];
	for (uint32_t h = 0; h < ph->gpus; h++)
		staged[h] = staged_at(pp, ph, h);
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[RW_SVC_COMBINE][g];
		page_rank_t *rk = &pp->rk[g];
		rw_svc_rank_plan_combine(ph, g, ls->local_n, areas, io->page_k, &rk->head, rk->tags,
					 rk->entries);
		if (!io->page) { /* a ring rank: its gather now, as its kernel would */
			rw_status_t st = rw_svc_ring_gather(ph, g, ls, rk->tags, rk->entries, ph->slab,
							    staged, why);
			if (st != RW_OK)
				return st;
			continue;
		}
		plan_write(ph, io, rk, pp->stage, areas);
		uint8_t *slot = slot_of(io);
		const rw_page_layout_t *l = &io->page_layout;
		memcpy(slot + l->term_off, ls->term_off[g], ((size_t)ls->n[g] + 1) * sizeof(uint32_t));
		memcpy(slot + l->term_ref, ls->term_ref[g], (size_t)ls->n_terms[g] * sizeof(uint32_t));
		plan_publish(io);
	}
	pp->c_planned = 1;
	return RW_OK;
}

/* A pull landed (the loop, mover_pull.c): a pack's records are there to check (the executor
 * calls pack again), or a range's headers, checked now; finish's work once the last range's
 * pull of a kind landed. Nothing of pp is touched after a report: it may end the pair. */
static void pull_landed(void *ctx, uint64_t token, rw_status_t st)
{
	page_mover_t *m = ctx;
	const uint32_t serial = (uint32_t)(token >> 32), what = (uint32_t)(token >> 28) & 0xf;
	const rw_svc_phase_kind_t kind = (rw_svc_phase_kind_t)((token >> 24) & 0xf);
	page_pair_t *pp = pair_of(m, serial);
	if (!pp || kind >= RW_SVC_KIND_COUNT)
		return; /* a pair that ended meanwhile */
	const rw_svc_phase_t *ph = pp->ph;
	if (what == PULL_PACK) {
		pp->pulled[kind] = 2;
		pp->pull_st[kind] = st;
		m->done(m->ctx, serial, RW_MV_OP_PACKED, 0, RW_OK); /* pack answers */
		return;
	}
	const uint32_t i = (uint32_t)(token & 0xffffff), src = i / ph->rails, rail = i % ph->rails;
	char why[RW_SVC_WHY_MAX] = "";
	if (pp->rx_pulls[kind])
		pp->rx_pulls[kind]--;
	if (st == RW_ERR_TIMEOUT && rw_svc_gpu_stalled(ph->slab_gpu[rail], why, sizeof(why)))
		st = RW_ERR_DEVICE; /* named: the GPU that stopped; not node src's fault */
	else if (st != RW_OK)
		snprintf(why, sizeof(why), "pulling the headers of node %u's range on rail %u out of "
			 "the group's GPU slab failed (%s)", src, rail, rw_status_str(st));
	else
		st = range_check(ph, kind, src, rail, view(ph, rail, ph->recv_area[kind][rail]), why);
	if (st != RW_OK) {
		pp->rx_bad = 1;
		rw_warn("rank path: %s", why);
		m->done(m->ctx, serial, RW_MV_OP_REFUSED, src, st);
		return;
	}
	if (pp->rx_pulls[kind] || !pp->fin_wait[kind] || pp->rx_bad)
		return;
	pp->fin_wait[kind] = 0;
	uint32_t more = 0;
	st = finish_now(pp, ph, kind, &more, why);
	if (st != RW_OK)
		rw_warn("rank path: %s", why);
	m->done(m->ctx, serial, RW_MV_OP_FINISH, 0, st);
}

static void pm_result(void *state, uint32_t g, uint32_t *recv_rows_p, const uint32_t **counts_p)
{
	const page_pair_t *pp = state;
	*recv_rows_p = pp->lists.list[g] ? pp->lists.n[g] : 0;
	/* a page rank's forward kernel counts its experts (no completion); a ring rank's, here */
	*counts_p = pp->ring_counts[g];
}

/* The page ranks' kernels are theirs to stop (the executor owes their words). Nothing here waits
 * for a GPU (docs/rankpath.md "A hung GPU"): the pair's header pulls are forgotten (their copies
 * stay queued on the device's one pull stream, ahead of any later pull of the shadow), and where
 * a ring rank's copies may not have landed, its staging is handed to the stage, which frees it
 * once they did; the executor answers the rank once they did (pm_fence). */
static void pm_quiesce(void *mover, void *state)
{
	page_mover_t *m = mover;
	page_pair_t *pp = state;
	rw_svc_pull_forget(m->pull, pp->ph->serial);
	memset(pp->pulled, 0, sizeof(pp->pulled));
	memset(pp->rx_pulls, 0, sizeof(pp->rx_pulls));
	memset(pp->fin_wait, 0, sizeof(pp->fin_wait));
	rw_svc_stage_retire_pair(m->stage, pp->ph, pp->devs, pp->pending || pp->loose);
	pp->pending = 0;
	pp->loose = 0;
	memset(pp->marks, 0, sizeof(pp->marks));
}

/* A failed pair's rank g whose copies may not have landed (its answer waits for them). */
static int pm_fence(void *mover, void *state, uint32_t g, rw_svc_stage_fence_t *f)
{
	page_mover_t *m = mover;
	const page_pair_t *pp = state;
	return rw_svc_stage_rank_fence(m->stage, pp->devs, pp->pending || pp->loose, g, f);
}

static void pm_close(void *mover, void *state)
{
	pm_quiesce(mover, state);
	pair_free(state, RW_MAX_GPUS);
}

/* A closed pair's carve-out stays the executor's until no pull out of it may still land: a late
 * copy then never reads memory the pool gave back, nor writes a shadow another group got. */
static int pm_settled(void *mover, const rw_svc_phase_t *ph)
{
	const page_mover_t *m = mover;
	return rw_svc_pull_settled(m->pull, ph);
}

const rw_svc_mover_ops_t rw_svc_mover_rank = {
	.name = "rank path",
	.areas_fixed = 0,
	.no_records = 1,
	.create = pm_create,
	.destroy = pm_destroy,
	.accepts = pm_accepts,
	.open = pm_open,
	.stage = pm_stage,
	.plan = pm_plan,
	.pack = pm_pack,
	.arrived = pm_arrived,
	.local = pm_local,
	.finish = pm_finish,
	.result = pm_result,
	.quiesce = pm_quiesce,
	.fence = pm_fence,
	.close = pm_close,
	.settled = pm_settled,
	.count = pm_count,
};
