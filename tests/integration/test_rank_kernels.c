/* The rank kernels (cuda/rw_cuda.h "rank kernels") against the host mover, byte for byte: N
 * simulated nodes of G ranks each run a whole dispatch and combine through the real host mover
 * (service/mover/mover_host.c: stage, plan, pack, arrived, local, finish; the slabs carried from
 * node to node as the rails would), and the same inputs go through the rank kernels on the
 * stand-in driver (tests/integration/fake_cuda_rank.c, through librailwave's launch wrappers and
 * the stand-in's stream): each rank's pack writes the records the host mover wrote into the send
 * slabs (and the node's own records into the local area), its forward writes the dispatch
 * output the host mover wrote (rows, metadata, per-expert counts, row count), its gather the
 * combine records, and the owner's reduce the combined rows. The plan, list and term entries are
 * built here as the daemon writes them into the rank page (ipc/page.h): from the host mover's
 * layout, its forwarding order, and the owner's fixed summation order (docs/dataflow.md "The
 * owner's sum"; rows of full mantissas, so another order gives other bits). Random workloads over the four paths (the balanced ones move records
 * off their native rail in pieces), both dtypes, int32 and int64 ids. Then the device error word:
 * a plan short of a record, an id out of range, a failed phase's status; and every launch
 * capped at 1, 2 and 3 blocks (the SM budget). The daemon's one-pass CPU pack (its ring ranks')
 * writes the same slabs as the pack kernel. Every buffer a kernel
 * touches is page-locked host memory, so with RW_CUDA_DRIVER=libcuda.so.1 the same cases run
 * the real kernels on a GPU. */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>

#include <cmocka.h>

#include "config.h"
#include "cuda/rw_cuda.h"
#include "service/mover/mover.h"
#include "service/phase/phase.h"
#include "tests/unit/test_rng.h"

#define MAXN 6
#define MAXG 4
#define MAXR 3

static uint32_t rnd(void) { return (uint32_t)rng_next(); }

/* Zeroed page-locked host memory (rw_cuda_host_alloc: with unified addressing a kernel reads
 * and writes it at its host address, on a GPU as on the stand-in), all freed at the end of a
 * case. */
static void *allocs[4096];
static unsigned n_allocs;

static void *zalloc(size_t n)
{
	void *p = NULL;
	assert_int_equal(rw_cuda_host_alloc(n + 64, &p), RW_OK);
	assert_true((uintptr_t)p % 16 == 0);
	memset(p, 0, n + 64);
	assert_true(n_allocs < 4096);
	allocs[n_allocs++] = p;
	return p;
}

static void free_all(void)
{
	while (n_allocs)
		rw_cuda_host_free(allocs[--n_allocs]);
}

static uint64_t A(const void *p) { return (uint64_t)(uintptr_t)p; }

/* One list entry (ipc/page.h rw_page_list_entry_t's layout, as the kernels read it). */
static rw_cuda_list_entry_t entry(uint32_t slot, uint32_t rail, uint32_t area, uint32_t node,
				  uint32_t token)
{
	return (rw_cuda_list_entry_t){ .slot = slot, .rail = (uint16_t)rail, .area = (uint16_t)area,
				       .node = node, .token = token };
}

typedef struct sim_rank {
	uint32_t n;                   /* tokens */
	uint8_t *x;                   /* rows */
	int32_t *ids;
	int64_t *ids64;
	float *w;
	uint8_t *out;                 /* host mover: dispatch output */
	uint64_t out_cap;
	uint8_t *y;                   /* combine input: a row per received row */
	uint8_t *cout;                /* host mover: combined rows */
	/* the rank path */
	rw_cuda_list_entry_t *fl;     /* forward list */
	uint32_t nfl;
	rw_cuda_list_entry_t *rl;     /* reduce list (as the owner) */
	uint32_t nrl;
	uint8_t *rows, *meta;         /* forward outputs */
	uint32_t *counts, recv_n, overflow;
	uint8_t *red;                 /* reduce output */
} sim_rank_t;

typedef struct sim_node {
	rw_svc_phase_t ph;
	rw_svc_layout_t layout;
	rw_rank_tokens_t rt[MAXG];
	uint32_t row[MAXN * MAXR], row_off[MAXN * MAXR + 1];
	rw_record_t *rec;
	void *state;
	sim_rank_t rank[MAXG];
	uint8_t *area[2][2][MAXR];    /* host mover: [kind][send/recv][rail] */
	uint8_t *slab[MAXR];          /* rank path, dispatch: send area, then the local area */
	uint64_t local_off[MAXR];
	uint8_t *cslab[MAXR];         /* rank path, combine: returns, then each rank's local rows */
	uint64_t cstage_off[MAXR];
	uint32_t nloc[MAXR];          /* the node's own records on each rail */
} sim_node_t;

typedef struct sim {
	uint32_t N, G, R, E, topk, hidden, dtype; /* dtype: rw_wire_dtype_t */
	int ids64;
	rw_path_t path;
	rw_topo_t topo;
	uint32_t tag[MAXN];
	uint32_t *counts;
	sim_node_t node[MAXN];
	void *mover;
	rw_cuda_stream_t *stream;
	rw_cuda_ext_stream_t es;
	uint32_t err[2];
} sim_t;

static uint32_t cuda_dtype(const sim_t *s)
{
	return s->dtype == RW_WIRE_BF16 ? RW_CUDA_BF16 : RW_CUDA_FP32;
}

static void mover_done(void *ctx, uint32_t serial, rw_svc_mover_op_t op, uint32_t g, rw_status_t st)
{
	(void)ctx, (void)serial, (void)op, (void)g, (void)st;
	fail_msg("the host mover reported asynchronously for host memory");
}

/* A random row: full mantissas over 24 binades, so a sum of three or more terms rounds
 * differently in another order (the owner's fixed order is checked, not only its terms); some
 * negative zeros. */
static void fill_row(const sim_t *s, uint8_t *row)
{
	for (uint32_t h = 0; h < s->hidden; h++) {
		float f = ldexpf((float)(int32_t)rnd() / 2147483648.0f, (int)(rnd() % 24) - 12);
		if (rnd() % 50 == 0)
			f = -0.0f;
		if (s->dtype == RW_WIRE_BF16) {
			uint16_t v = rw_bf16_from_f32(f);
			memcpy(row + 2 * h, &v, 2);
		} else {
			memcpy(row + 4 * h, &f, 4);
		}
	}
}

/* ---- the host mover's run ---- */

static void host_setup(sim_t *s)
{
	const uint32_t N = s->N, G = s->G, R = s->R;
	assert_int_equal(rw_sched_topo_init(&s->topo, N, G, R), RW_OK);
	s->counts = calloc((size_t)N * N * R, sizeof(uint32_t));
	assert_non_null(s->counts);
	for (uint32_t n = 0; n < N; n++)
		s->tag[n] = rnd() | 1u;
	const uint64_t row_bytes = rw_wire_row_bytes(s->hidden, s->dtype);
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &sn->rank[g];
			rk->n = rnd() % 24 + (rnd() % 4 == 0 ? 60 : 0);
			rk->x = zalloc(rk->n * row_bytes);
			rk->ids = zalloc((size_t)rk->n * s->topk * 4);
			rk->ids64 = zalloc((size_t)rk->n * s->topk * 8);
			rk->w = zalloc((size_t)rk->n * s->topk * 4);
			for (uint32_t t = 0; t < rk->n; t++) {
				fill_row(s, rk->x + t * row_bytes);
				for (uint32_t k = 0; k < s->topk; k++) {
					uint32_t i = t * s->topk + k;
					/* a hot third of the experts, some dropped slots */
					int32_t e = rnd() % 3 ? (int32_t)(rnd() % (s->E / 3 + 1)) : (int32_t)(rnd() % s->E);
					if (rnd() % 10 == 0)
						e = -1;
					rk->ids[i] = e;
					rk->ids64[i] = e;
					rk->w[i] = (float)(rnd() % 1000) / 997.0f;
				}
			}
			sn->rt[g] = (rw_rank_tokens_t){ .local_gpu = g, .n_tokens = rk->n, .topk = s->topk,
							.expert_ids = rk->ids };
		}
		assert_int_equal(rw_sched_count(&s->topo, s->E, n, sn->rt, G, sn->row, NULL), RW_OK);
		for (uint32_t i = 0; i < N * R; i++)
			s->counts[(size_t)n * N * R + i] = sn->row[i];
	}
	assert_int_equal(rw_svc_mover_host.create(NULL, mover_done, s, &s->mover), RW_OK);
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		rw_svc_phase_t *ph = &sn->ph;
		assert_int_equal(rw_svc_layout_alloc(&sn->layout, N, R), RW_OK);
		assert_int_equal(rw_svc_layout_build(&sn->layout, &s->topo, s->path, n, s->counts), RW_OK);
		rw_sched_prefix(sn->row, N * R, sn->row_off);
		sn->rec = zalloc((sn->row_off[N * R] + 1) * sizeof(rw_record_t));
		assert_int_equal(rw_sched_records(&s->topo, s->E, n, sn->rt, G, sn->row_off, sn->rec), RW_OK);
		*ph = (rw_svc_phase_t){ .serial = n + 1, .nodes = N, .rails = R, .gpus = G, .me = n,
					.n_experts = s->E, .topk = s->topk, .hidden = s->hidden,
					.dtype = s->dtype, .row_bytes = row_bytes,
					.rec_size = rw_wire_rec_size(s->topk, s->hidden, s->dtype),
					.crec_size = rw_wire_crec_size(s->hidden, s->dtype),
					.tag_in = s->tag[n], .tag_to = s->tag, .layout = &sn->layout,
					.row_off = sn->row_off, .rec = sn->rec, .rt = sn->rt,
					.topo = &s->topo };
		for (uint32_t r = 0; r < R; r++) {
			ph->rail_base[r + 1] = ph->rail_base[r] + sn->layout.in_total[r];
			ph->slab_dev[r] = -1;
			const uint64_t out = sn->layout.out_total[r], in = sn->layout.in_total[r];
			sn->area[0][0][r] = zalloc(out * ph->rec_size);
			sn->area[0][1][r] = zalloc(in * ph->rec_size);
			sn->area[1][0][r] = zalloc(in * ph->crec_size);
			sn->area[1][1][r] = zalloc(out * ph->crec_size);
			for (int k = 0; k < 2; k++) {
				ph->send_area[k][r] = sn->area[k][0][r];
				ph->recv_area[k][r] = sn->area[k][1][r];
			}
		}
		ph->n_in = ph->rail_base[R];
		const uint64_t total = ph->n_in + (sn->row_off[(n + 1) * R] - sn->row_off[n * R]);
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &sn->rank[g];
			rw_svc_out_layout_t o;
			rk->out_cap = rw_wire_align16(4ull * s->E) + (total + 1) * (row_bytes + 16 + 8ull * s->topk);
			rw_svc_out_layout(rk->out_cap, s->E, s->topk, row_bytes, RW_CQE_INLINE_COUNTS, &o);
			assert_true(o.rows_cap >= total);
			rk->out = zalloc(rk->out_cap);
			rw_svc_rank_io_t *io = &ph->io[RW_SVC_DISPATCH][g];
			io->n_tokens = rk->n;
			io->in[0] = (rw_svc_span_mem_t){ .host = rk->x, .dev = -1 };
			io->in[1] = (rw_svc_span_mem_t){ .host = (uint8_t *)rk->ids, .dev = -1 };
			io->in[2] = (rw_svc_span_mem_t){ .host = (uint8_t *)rk->w, .dev = -1 };
			io->out = (rw_svc_span_mem_t){ .host = rk->out, .dev = -1 };
			io->out_cap = rk->out_cap;
		}
	}
}

/* Every node packs; the rails carry each slab to its destination. */
static void host_dispatch_send(sim_t *s)
{
	char why[RW_SVC_WHY_MAX];
	int pending;
	for (uint32_t n = 0; n < s->N; n++) {
		sim_node_t *sn = &s->node[n];
		assert_int_equal(rw_svc_mover_host.open(s->mover, &sn->ph, &sn->state), RW_OK);
		for (uint32_t g = 0; g < s->G; g++) {
			assert_int_equal(rw_svc_mover_host.stage(s->mover, sn->state, &sn->ph, RW_SVC_DISPATCH,
								 g, &pending, why), RW_OK);
			assert_int_equal(pending, 0);
		}
		assert_int_equal(rw_svc_mover_host.plan(s->mover, sn->state, &sn->ph, why), RW_OK);
		for (uint32_t d = 0; d < s->N; d++)
			if (d != n)
				assert_int_equal(rw_svc_mover_host.pack(s->mover, sn->state, &sn->ph,
									RW_SVC_DISPATCH, d, why), RW_OK);
	}
}

/* The rails: kind's range from src to dst on every rail, sender's send area to receiver's. */
static void carry(sim_t *s, rw_svc_phase_kind_t kind, uint32_t src, uint32_t dst)
{
	for (uint32_t r = 0; r < s->R; r++) {
		uint64_t so, sl, ro, rl;
		rw_svc_slab_range(&s->node[src].ph, kind, 1, dst, r, &so, &sl);
		rw_svc_slab_range(&s->node[dst].ph, kind, 0, src, r, &ro, &rl);
		assert_int_equal(sl, rl);
		memcpy(s->node[dst].area[kind][1][r] + ro, s->node[src].area[kind][0][r] + so, sl);
	}
}

/* A random order of the (source, rail) ranges a node takes in. */
static uint32_t arrival_order(const sim_t *s, uint32_t me, uint32_t *order)
{
	uint32_t n = 0;
	for (uint32_t src = 0; src < s->N; src++)
		for (uint32_t r = 0; r < s->R; r++)
			if (src != me)
				order[n++] = src * s->R + r;
	for (uint32_t i = n; i > 1; i--) {
		uint32_t j = rnd() % i, t = order[i - 1];
		order[i - 1] = order[j];
		order[j] = t;
	}
	return n;
}

/* ---- the rank path: plans and lists as the daemon writes them ---- */

/* Rank g of node n: where its records go (the plan block's entries, dispatch): for d != n its
 * records keep their native rail up to the pair plan's quota, the surplus in pieces — read off
 * rw_sched_map_rail over the (d, native rail) segment, where its records are one run in token
 * order; for n itself the local area, at their place in the segment. */
static void dispatch_entries(const sim_t *s, uint32_t n, uint32_t g, rw_cuda_plan_entry_t *ent)
{
	const sim_node_t *sn = &s->node[n];
	const uint32_t R = s->R, rn = s->topo.gpu_rail[g];
	memset(ent, 0, sizeof(*ent) * s->N * R);
	uint8_t egress[4096];
	uint32_t slot[4096];
	for (uint32_t d = 0; d < s->N; d++) {
		const uint32_t first = sn->row_off[d * R + rn], cnt = sn->row_off[d * R + rn + 1] - first;
		uint32_t o = 0, k = 0;
		while (o < cnt && sn->rec[first + o].rank != g)
			o++;
		while (o + k < cnt && sn->rec[first + o + k].rank == g)
			k++;
		if (k == 0)
			continue;
		if (d == n) {
			ent[d * R + rn] = (rw_cuda_plan_entry_t){ 0, k, sn->local_off[rn] + (uint64_t)o * sn->ph.rec_size };
			continue;
		}
		assert_true(cnt <= 4096);
		rw_sched_map_rail(&sn->layout.out_pairs[d], rn, egress, slot);
		for (uint32_t j = 0; j < k;) {
			uint32_t e = egress[o + j], run = 1;
			while (j + run < k && egress[o + j + run] == e && slot[o + j + run] == slot[o + j] + run)
				run++;
			assert_int_equal(ent[d * R + e].count, 0); /* one piece per rail */
			ent[d * R + e] = (rw_cuda_plan_entry_t){
				j, run, ((uint64_t)sn->layout.out_first[d * R + e] + slot[o + j]) * sn->ph.rec_size };
			j += run;
		}
	}
}

/* The forward lists of node n's ranks in the order the host mover forwarded (local records
 * first, then the ranges in `order`). */
static void forward_lists(sim_t *s, uint32_t n, const uint32_t *order, uint32_t norder)
{
	sim_node_t *sn = &s->node[n];
	const uint32_t R = s->R;
	for (uint32_t g = 0; g < s->G; g++) {
		sn->rank[g].fl = zalloc((sn->ph.n_in + sn->row_off[(n + 1) * R] - sn->row_off[n * R] + 1) *
					sizeof(rw_cuda_list_entry_t));
		sn->rank[g].nfl = 0;
	}
	for (uint32_t r = 0; r < R; r++)
		for (uint32_t p = 0; p < sn->nloc[r]; p++) {
			const rw_record_t *rec = &sn->rec[sn->row_off[n * R + r] + p];
			const int32_t *ids = sn->rank[rec->rank].ids + (size_t)rec->token * s->topk;
			uint32_t mask = rw_svc_fwd_mask(s->E, s->N, s->G, n, ids, s->topk);
			for (uint32_t g = 0; g < s->G; g++)
				if (mask >> g & 1)
					sn->rank[g].fl[sn->rank[g].nfl++] =
						entry(p, r, RW_CUDA_AREA_LOCAL, n, rec->token);
		}
	for (uint32_t i = 0; i < norder; i++) {
		uint32_t src = order[i] / R, r = order[i] % R, q = src * R + r;
		for (uint32_t k = 0; k < sn->layout.in_quota[q]; k++) {
			uint32_t slot = sn->layout.in_first[q] + k;
			const uint8_t *rec = sn->area[0][1][r] + (uint64_t)slot * sn->ph.rec_size;
			uint32_t mask = rw_svc_fwd_mask_rec(s->E, s->N, s->G, n, rec, s->topk);
			rw_wire_rec_hdr_t h;
			assert_int_equal(rw_wire_rec_unpack(rec, s->topk, &h), RW_OK);
			for (uint32_t g = 0; g < s->G; g++)
				if (mask >> g & 1)
					sn->rank[g].fl[sn->rank[g].nfl++] =
						entry(slot, r, RW_CUDA_AREA_RECV, src, h.token);
		}
	}
}

/* The terms of each forward-list entry of rank g (the gather's CSR): a received record's
 * combine record is written by the lowest local rank it went to, as the fp32 sum of every such
 * rank's row in rank order (host: combine_pack); a local record's row by every rank into its
 * own copy of the local area (the owner adds each, as the host's combine_local does). */
static void gather_terms(const sim_t *s, uint32_t n, uint32_t g, uint32_t **row_of,
			 uint32_t *off, uint32_t *terms)
{
	const sim_node_t *sn = &s->node[n];
	const sim_rank_t *rk = &sn->rank[g];
	uint32_t nt = 0;
	for (uint32_t j = 0; j < rk->nfl; j++) {
		const rw_cuda_list_entry_t *le = &rk->fl[j];
		off[j] = nt;
		if (le->area == RW_CUDA_AREA_LOCAL) {
			terms[nt++] = g << 24 | j;
			continue;
		}
		uint32_t ref = sn->ph.rail_base[le->rail] + le->slot, lead = s->G;
		for (uint32_t h = 0; h < s->G && lead == s->G; h++)
			if (row_of[h][ref])
				lead = h;
		if (lead != g)
			continue;
		for (uint32_t h = 0; h < s->G; h++)
			if (row_of[h][ref])
				terms[nt++] = h << 24 | (row_of[h][ref] - 1);
	}
	off[rk->nfl] = nt;
}

static void append(sim_rank_t *rk, rw_cuda_list_entry_t e)
{
	rk->rl[rk->nrl++] = e;
}

/* A reduce term's place in its token's sum (docs/dataflow.md "The owner's sum"): the node's
 * ranks' rows by local rank ascending (a local term's slot is h x nloc + its record's slot, in
 * rank h's copy of the local area), then the returned rows by source node ascending. */
static uint64_t term_key(const sim_node_t *sn, const rw_cuda_list_entry_t *e)
{
	uint64_t k = (uint64_t)e->token << 32;
	if (e->area == RW_CUDA_AREA_LOCAL)
		return k | e->slot / sn->nloc[e->rail];
	return k | 1u << 31 | e->node;
}

/* Sort a reduce list into the summation order: by token, each token's terms as above. */
static void sort_terms(const sim_node_t *sn, rw_cuda_list_entry_t *l, uint32_t n)
{
	for (uint32_t i = 1; i < n; i++) {
		rw_cuda_list_entry_t e = l[i];
		uint32_t j = i;
		while (j > 0 && term_key(sn, &l[j - 1]) > term_key(sn, &e)) {
			l[j] = l[j - 1];
			j--;
		}
		l[j] = e;
	}
}

static void sync_and_check(sim_t *s, uint32_t code)
{
	assert_int_equal(rw_cuda_stream_sync(s->stream), RW_OK);
	assert_int_equal(s->err[0], code);
}

static void pack_block(const sim_t *s, uint32_t n, uint32_t g, rw_cuda_plan_entry_t *ent,
		       void *scratch, rw_cuda_rank_pack_t *b)
{
	const sim_node_t *sn = &s->node[n];
	const sim_rank_t *rk = &sn->rank[g];
	*b = (rw_cuda_rank_pack_t){
		.x = A(rk->x), .ids = s->ids64 ? A(rk->ids64) : A(rk->ids), .weights = A(rk->w),
		.entry = A(ent), .tags = A(s->tag), .scratch = A(scratch), .err = A(s->err),
		.n_tokens = rk->n, .topk = s->topk, .hidden = s->hidden, .dtype = cuda_dtype(s),
		.ids_int64 = (uint32_t)s->ids64, .n_experts = s->E, .nodes = s->N, .rails = s->R,
		.me = n, .owner = g,
	};
	for (uint32_t r = 0; r < s->R; r++)
		b->slab[r] = A(sn->slab[r]);
}

/* The same phase through the daemon's own lists (rw_svc_rank_fwd_lists: its forwarding order,
 * the gather's terms; rw_svc_rank_plan_combine; rw_svc_rank_reduce_list): the forward gives each
 * rank the same rows in the daemon's order (each row, its metadata, the counts), the gather —
 * each rank's combine input reordered to match, on the daemon's combine plan blocks — the host
 * mover's combine records, and the reduce lists are the ones the owner's order gives above. */
static void daemon_lists(sim_t *s, uint32_t n, rw_cuda_plan_entry_t *ent)
{
	sim_node_t *sn = &s->node[n];
	const uint32_t G = s->G, R = s->R, topk = s->topk;
	const uint64_t row_bytes = sn->ph.row_bytes, crec = sn->ph.crec_size, meta_bytes = 16 + 8ull * topk;
	const uint32_t max = sn->ph.n_in + (sn->row_off[(n + 1) * R] - sn->row_off[n * R]) + 1;
	rw_svc_rank_lists_t ls = { .max_recv = max };
	char why[RW_SVC_WHY_MAX];
	for (uint32_t r = 0; r < R; r++) {
		ls.recv[r] = sn->area[0][1][r];
		ls.local[r] = sn->slab[r] + sn->local_off[r];
		ls.local_n[r] = sn->nloc[r];
	}
	for (uint32_t g = 0; g < G; g++) {
		ls.list[g] = zalloc(max * sizeof(rw_page_list_entry_t));
		ls.term_off[g] = zalloc((max + 1) * 4);
		ls.term_ref[g] = zalloc((size_t)G * max * 4);
	}
	assert_int_equal(rw_svc_rank_fwd_lists(&sn->ph, &ls, why), RW_OK);
	uint8_t *y2[MAXG];
	for (uint32_t g = 0; g < G; g++) {
		sim_rank_t *rk = &sn->rank[g];
		assert_int_equal(ls.n[g], rk->nfl);
		/* the daemon's entry j2 is this test's entry mine[j2] */
		uint32_t *mine = zalloc(rk->nfl * 4ull + 4);
		const rw_cuda_list_entry_t *dl = (const rw_cuda_list_entry_t *)ls.list[g];
		for (uint32_t j2 = 0; j2 < rk->nfl; j2++) {
			uint32_t j = 0;
			while (j < rk->nfl && (rk->fl[j].area != dl[j2].area || rk->fl[j].rail != dl[j2].rail ||
					       rk->fl[j].slot != dl[j2].slot))
				j++;
			assert_true(j < rk->nfl);
			assert_true(dl[j2].node == rk->fl[j].node && dl[j2].token == rk->fl[j].token);
			mine[j2] = j;
		}
		uint8_t *rows = zalloc(rk->nfl * row_bytes), *meta = zalloc(rk->nfl * meta_bytes);
		uint32_t *counts = zalloc(4ull * s->E), *nl = zalloc(12);
		nl[0] = rk->nfl;
		rw_cuda_rank_forward_t b = {
			.list = A(dl), .list_n = A(&nl[0]), .rows = A(rows), .meta = A(meta),
			.counts = A(counts), .recv_n = A(&nl[1]), .overflow = A(&nl[2]), .err = A(s->err),
			.cap = rk->nfl, .topk = topk, .hidden = s->hidden, .dtype = cuda_dtype(s),
			.n_experts = s->E, .nodes = s->N, .gpus = G, .rails = R, .me = n, .g = g,
		};
		for (uint32_t r = 0; r < R; r++) {
			b.area[RW_CUDA_AREA_RECV][r] = A(sn->area[0][1][r]);
			b.area[RW_CUDA_AREA_LOCAL][r] = A(sn->slab[r] + sn->local_off[r]);
		}
		assert_int_equal(rw_cuda_rank_forward(&s->es, &b), RW_OK);
		sync_and_check(s, 0);
		assert_true(nl[1] == rk->nfl && nl[2] == 0);
		assert_memory_equal(counts, rk->counts, 4ull * s->E);
		y2[g] = zalloc(rk->nfl * row_bytes);
		for (uint32_t j2 = 0; j2 < rk->nfl; j2++) {
			assert_memory_equal(rows + j2 * row_bytes, rk->rows + mine[j2] * row_bytes, row_bytes);
			assert_memory_equal(meta + j2 * meta_bytes, rk->meta + mine[j2] * meta_bytes, meta_bytes);
			memcpy(y2[g] + j2 * row_bytes, rk->y + mine[j2] * row_bytes, row_bytes);
		}
	}
	uint8_t *cslab[MAXR];
	rw_page_plan_rail_t areas[MAXR];
	rw_page_plan_head_t head;
	uint32_t tags[MAXN];
	for (uint32_t r = 0; r < R; r++) {
		cslab[r] = zalloc(sn->cstage_off[r] + (uint64_t)G * sn->nloc[r] * crec);
		areas[r] = (rw_page_plan_rail_t){ .send_off = 0, .local_off = sn->cstage_off[r],
						  .slab_bytes = sn->cstage_off[r] + (uint64_t)G * sn->nloc[r] * crec };
	}
	for (uint32_t g = 0; g < G; g++) {
		/* the daemon's combine plan block: the return ranges, and rank g's copy of the
		 * local records */
		rw_svc_rank_plan_combine(&sn->ph, g, sn->nloc, areas, 2, &head, tags,
					 (rw_page_plan_entry_t *)ent); /* (rows staged by the test) */
		for (uint32_t a = 0; a < s->N; a++)
			for (uint32_t r = 0; r < R; r++) {
				const uint32_t q = a * R + r;
				rw_cuda_plan_entry_t want = a != n
					? (rw_cuda_plan_entry_t){ sn->layout.in_first[q], sn->layout.in_quota[q],
								  (uint64_t)sn->layout.in_first[q] * crec }
					: (rw_cuda_plan_entry_t){ 0, sn->nloc[r],
								  sn->cstage_off[r] + (uint64_t)g * sn->nloc[r] * crec };
				assert_memory_equal(&ent[q], &want, sizeof(want));
			}
		assert_memory_equal(tags, s->tag, 4ull * s->N);
		uint32_t *nl = zalloc(4);
		nl[0] = ls.n[g];
		rw_cuda_rank_gather_t b = {
			.list = A(ls.list[g]), .list_n = A(nl), .entry = A(ent), .tags = A(s->tag),
			.term_off = A(ls.term_off[g]), .terms = A(ls.term_ref[g]), .err = A(s->err),
			.cap = ls.n[g], .n_terms = ls.n_terms[g], .hidden = s->hidden,
			.dtype = cuda_dtype(s), .nodes = s->N, .rails = R, .me = n, .g = g,
		};
		for (uint32_t r = 0; r < R; r++)
			b.slab[r] = A(cslab[r]);
		for (uint32_t h = 0; h < G; h++)
			b.rows[h] = A(y2[h]);
		assert_int_equal(rw_cuda_rank_gather(&s->es, &b), RW_OK);
		sync_and_check(s, 0);
	}
	for (uint32_t r = 0; r < R; r++)
		assert_memory_equal(cslab[r], sn->area[1][0][r], sn->cstage_off[r]);
	/* The reduce lists: where each record left (the dispatch send areas) and the local rows. */
	const uint8_t *sent[MAXR];
	for (uint32_t r = 0; r < R; r++)
		sent[r] = sn->area[0][0][r];
	for (uint32_t g = 0; g < G; g++) {
		sim_rank_t *rk = &sn->rank[g];
		uint32_t *cursor = zalloc((rk->n + 1) * 4ull), nr = 0;
		rw_page_list_entry_t *rl = zalloc((rk->nrl + 1) * sizeof(*rl));
		assert_int_equal(rw_svc_rank_reduce_list(&sn->ph, &ls, sent, g, rk->n, cursor, rl,
							 rk->nrl, &nr, why), RW_OK);
		assert_int_equal(nr, rk->nrl);
		assert_memory_equal(rl, rk->rl, nr * sizeof(*rl));
	}
}

/* The most blocks each launch of run_case takes (rw_cuda_ext_stream_t.max_blocks; 0: the
 * wrappers' own grids). */
static uint32_t budget;

static void run_case(uint32_t N, uint32_t G, uint32_t R, uint32_t topk, uint32_t E, uint32_t hidden,
		     rw_path_t path, uint32_t dtype, int ids64)
{
	sim_t *s = zalloc(sizeof(*s));
	char why[RW_SVC_WHY_MAX];
	uint32_t pending, order[MAXN][MAXN * MAXR], norder[MAXN];
	int done;
	assert_non_null(s);
	*s = (sim_t){ .N = N, .G = G, .R = R, .E = E, .topk = topk, .hidden = hidden, .dtype = dtype,
		      .ids64 = ids64, .path = path };
	assert_int_equal(rw_cuda_stream_create(0, &s->stream), RW_OK);
	assert_int_equal(rw_cuda_ext_stream_of(s->stream, &s->es), RW_OK);
	s->es.max_blocks = budget;
	host_setup(s);
	const uint64_t row_bytes = s->node[0].ph.row_bytes, rec = s->node[0].ph.rec_size,
		       crec = s->node[0].ph.crec_size, meta_bytes = 16 + 8ull * topk;
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		for (uint32_t r = 0; r < R; r++) {
			sn->nloc[r] = sn->row_off[n * R + r + 1] - sn->row_off[n * R + r];
			sn->local_off[r] = sn->layout.out_total[r] * rec;
			sn->slab[r] = zalloc(sn->local_off[r] + sn->nloc[r] * rec);
			sn->cstage_off[r] = sn->layout.in_total[r] * crec;
			sn->cslab[r] = zalloc(sn->cstage_off[r] + (uint64_t)G * sn->nloc[r] * crec);
		}
	}
	host_dispatch_send(s);

	/* Pack: every rank's records, where the plan says. The plan block is the daemon's
	 * (rw_svc_rank_plan), the same as this test derives from the host mover's placement; what
	 * the kernel wrote passes the daemon's check of a rank's records. */
	rw_cuda_plan_entry_t *ent = zalloc(sizeof(*ent) * N * R);
	rw_page_plan_entry_t *dent = zalloc(sizeof(*dent) * N * R);
	_Static_assert(sizeof(*ent) == sizeof(*dent), "the kernels read the page's plan entries");
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		uint32_t rows[MAXG][MAXN * MAXR], dtags[MAXN];
		const uint32_t *rowp[MAXG];
		rw_page_plan_rail_t areas[MAXR];
		rw_page_plan_head_t head;
		for (uint32_t g = 0; g < G; g++) {
			assert_int_equal(rw_sched_count(&s->topo, E, n, &sn->rt[g], 1, rows[g], NULL), RW_OK);
			rowp[g] = rows[g];
		}
		for (uint32_t r = 0; r < R; r++)
			areas[r] = (rw_page_plan_rail_t){ .send_off = 0, .local_off = sn->local_off[r],
							  .slab_bytes = sn->local_off[r] + sn->nloc[r] * rec };
		for (uint32_t g = 0; g < G; g++) {
			rw_cuda_rank_pack_t b;
			const uint8_t *slabs[MAXR];
			void *scratch = zalloc(rw_cuda_rank_pack_scratch(sn->rank[g].n, topk));
			dispatch_entries(s, n, g, ent);
			rw_svc_rank_plan(&sn->ph, g, rowp, areas, 1, &head, dtags, dent);
			assert_memory_equal(dent, ent, sizeof(*ent) * N * R);
			assert_memory_equal(dtags, s->tag, 4ull * N);
			pack_block(s, n, g, (rw_cuda_plan_entry_t *)dent, scratch, &b);
			assert_int_equal(rw_cuda_rank_pack(&s->es, &b), RW_OK);
			sync_and_check(s, 0);
			for (uint32_t r = 0; r < R; r++)
				slabs[r] = sn->slab[r];
			assert_int_equal(rw_svc_rank_records_check(&sn->ph, g, sn->rank[g].n, dtags, dent,
								   slabs, why), RW_OK);
		}
		/* The one-pass CPU pack the daemon runs for its ring ranks (service/mover/mover_mix.c)
		 * writes the same bytes into clean slabs, rank after rank. */
		uint8_t *again[MAXR];
		uint32_t next[MAXN];
		for (uint32_t r = 0; r < R; r++)
			again[r] = zalloc(sn->local_off[r] + sn->nloc[r] * rec);
		for (uint32_t g = 0; g < G; g++) {
			rw_cuda_rank_pack_t b;
			dispatch_entries(s, n, g, ent);
			pack_block(s, n, g, ent, NULL, &b);
			b.rec_size = (uint32_t)rec;
			for (uint32_t r = 0; r < R; r++)
				b.slab[r] = A(again[r]);
			rw_cuda_cpu_pack(&b, next);
			assert_int_equal(s->err[0], 0);
		}
		for (uint32_t r = 0; r < R; r++)
			assert_memory_equal(again[r], sn->slab[r], sn->local_off[r] + sn->nloc[r] * rec);
		for (uint32_t r = 0; r < R; r++) {
			/* the send slabs: the host mover's bytes */
			assert_memory_equal(sn->slab[r], sn->area[0][0][r], sn->layout.out_total[r] * rec);
			/* the local area: the node's own records, in the wire's format */
			uint8_t *want = zalloc(rec);
			for (uint32_t p = 0; p < sn->nloc[r]; p++) {
				const rw_record_t *rr = &sn->rec[sn->row_off[n * R + r] + p];
				const sim_rank_t *rk = &sn->rank[rr->rank];
				rw_wire_rec_hdr_t h = { .tag = s->tag[n], .src_node = n, .owner = rr->rank,
							.token = rr->token, .topk = topk };
				memset(want, 0, rec);
				rw_wire_rec_pack(want, &h, rk->ids + (size_t)rr->token * topk,
						 rk->w + (size_t)rr->token * topk);
				memcpy(want + rw_wire_rec_row_off(topk), rk->x + rr->token * row_bytes, row_bytes);
				assert_memory_equal(sn->slab[r] + sn->local_off[r] + p * rec, want, rec);
			}
		}
	}

	/* The rails, then every node takes in: its own records first, the ranges in random order. */
	for (uint32_t a = 0; a < N; a++)
		for (uint32_t d = 0; d < N; d++)
			if (a != d)
				carry(s, RW_SVC_DISPATCH, a, d);
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		assert_int_equal(rw_svc_mover_host.local(s->mover, sn->state, &sn->ph, RW_SVC_DISPATCH,
							 UINT32_MAX, &done, why), RW_OK);
		assert_true(done);
		norder[n] = arrival_order(s, n, order[n]);
		for (uint32_t i = 0; i < norder[n]; i++)
			assert_int_equal(rw_svc_mover_host.arrived(s->mover, sn->state, &sn->ph, RW_SVC_DISPATCH,
								   order[n][i] / R, order[n][i] % R, why), RW_OK);
		assert_int_equal(rw_svc_mover_host.finish(s->mover, sn->state, &sn->ph, RW_SVC_DISPATCH,
							  &pending, why), RW_OK);
		assert_int_equal(pending, 0);
		forward_lists(s, n, order[n], norder[n]);
	}

	/* Forward: each rank's output is the host mover's. */
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &sn->rank[g];
			uint32_t host_n;
			const uint32_t *host_counts;
			rw_svc_out_layout_t o;
			rw_svc_mover_host.result(sn->state, g, &host_n, &host_counts);
			assert_int_equal(host_n, rk->nfl);
			rw_svc_out_layout(rk->out_cap, E, topk, row_bytes, RW_CQE_INLINE_COUNTS, &o);
			rk->rows = zalloc(rk->nfl * row_bytes);
			rk->meta = zalloc(rk->nfl * meta_bytes);
			rk->counts = zalloc(4ull * E);
			memset(rk->counts, 0xff, 4ull * E); /* every count is written */
			rw_cuda_rank_forward_t b = {
				.list = A(rk->fl), .list_n = A(&rk->nfl), .rows = A(rk->rows),
				.meta = A(rk->meta), .counts = A(rk->counts), .recv_n = A(&rk->recv_n),
				.overflow = A(&rk->overflow), .err = A(s->err), .cap = rk->nfl,
				.topk = topk, .hidden = hidden, .dtype = cuda_dtype(s), .n_experts = E,
				.nodes = N, .gpus = G, .rails = R, .me = n, .g = g,
			};
			for (uint32_t r = 0; r < R; r++) {
				b.area[RW_CUDA_AREA_RECV][r] = A(sn->area[0][1][r]);
				b.area[RW_CUDA_AREA_LOCAL][r] = A(sn->slab[r] + sn->local_off[r]);
			}
			assert_int_equal(rw_cuda_rank_forward(&s->es, &b), RW_OK);
			sync_and_check(s, 0);
			assert_int_equal(rk->recv_n, host_n);
			assert_int_equal(rk->overflow, 0);
			assert_memory_equal(rk->rows, rk->out + o.rows_off, host_n * row_bytes);
			assert_memory_equal(rk->meta, rk->out + o.meta_off, host_n * meta_bytes);
			assert_memory_equal(rk->counts, host_counts, 4ull * E);
		}
	}

	/* Combine: each rank answers every row it got; the host mover packs the returns. */
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		int pend;
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &sn->rank[g];
			rk->y = zalloc(rk->nfl * row_bytes);
			for (uint32_t j = 0; j < rk->nfl; j++)
				fill_row(s, rk->y + j * row_bytes);
			rk->cout = zalloc(rk->n * row_bytes);
			rw_svc_rank_io_t *io = &sn->ph.io[RW_SVC_COMBINE][g];
			io->n_tokens = rk->nfl;
			io->in[0] = (rw_svc_span_mem_t){ .host = rk->y, .dev = -1 };
			io->out = (rw_svc_span_mem_t){ .host = rk->cout, .dev = -1 };
			io->out_cap = rk->n * row_bytes;
			assert_int_equal(rw_svc_mover_host.stage(s->mover, sn->state, &sn->ph, RW_SVC_COMBINE,
								 g, &pend, why), RW_OK);
		}
		for (uint32_t d = 0; d < N; d++)
			if (d != n)
				assert_int_equal(rw_svc_mover_host.pack(s->mover, sn->state, &sn->ph,
									RW_SVC_COMBINE, d, why), RW_OK);
	}

	/* Gather: each rank's combine records (the lowest of several ranks sums), and its rows of
	 * the node's own records into its copy of the local area. */
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		uint32_t *row_of[MAXG];
		for (uint32_t g = 0; g < G; g++) {
			row_of[g] = zalloc((sn->ph.n_in + 1) * sizeof(uint32_t));
			for (uint32_t j = 0; j < sn->rank[g].nfl; j++) {
				const rw_cuda_list_entry_t *le = &sn->rank[g].fl[j];
				if (le->area == RW_CUDA_AREA_RECV)
					row_of[g][sn->ph.rail_base[le->rail] + le->slot] = j + 1;
			}
		}
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &sn->rank[g];
			uint32_t *off = zalloc((rk->nfl + 1) * 4), *terms = zalloc((rk->nfl * G + 1) * 4);
			gather_terms(s, n, g, row_of, off, terms);
			for (uint32_t a = 0; a < N; a++)
				for (uint32_t r = 0; r < R; r++) {
					const uint32_t q = a * R + r;
					ent[q] = a != n
						? (rw_cuda_plan_entry_t){ sn->layout.in_first[q], sn->layout.in_quota[q],
									  (uint64_t)sn->layout.in_first[q] * crec }
						: (rw_cuda_plan_entry_t){ 0, sn->nloc[r],
									  sn->cstage_off[r] + (uint64_t)g * sn->nloc[r] * crec };
				}
			rw_cuda_rank_gather_t b = {
				.list = A(rk->fl), .list_n = A(&rk->nfl), .entry = A(ent), .tags = A(s->tag),
				.term_off = A(off), .terms = A(terms), .err = A(s->err), .cap = rk->nfl,
				.n_terms = off[rk->nfl], .hidden = hidden, .dtype = cuda_dtype(s), .nodes = N,
				.rails = R, .me = n, .g = g,
			};
			for (uint32_t r = 0; r < R; r++)
				b.slab[r] = A(sn->cslab[r]);
			for (uint32_t h = 0; h < G; h++)
				b.rows[h] = A(sn->rank[h].y);
			assert_int_equal(rw_cuda_rank_gather(&s->es, &b), RW_OK);
			sync_and_check(s, 0);
		}
		for (uint32_t r = 0; r < R; r++)
			assert_memory_equal(sn->cslab[r], sn->area[1][0][r], sn->cstage_off[r]);
	}

	/* The owners take the returns in: local rows first, then the ranges in random order (the
	 * host mover's sums must not depend on it); each owner's reduce list holds every term of
	 * its tokens, sorted into the fixed summation order. */
	for (uint32_t a = 0; a < N; a++)
		for (uint32_t d = 0; d < N; d++)
			if (a != d)
				carry(s, RW_SVC_COMBINE, a, d);
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		for (uint32_t g = 0; g < G; g++) {
			sn->rank[g].rl = zalloc((sn->ph.n_in + sn->rank[g].n * (size_t)(N + G) + 1) *
						sizeof(rw_cuda_list_entry_t));
			sn->rank[g].nrl = 0;
		}
		assert_int_equal(rw_svc_mover_host.local(s->mover, sn->state, &sn->ph, RW_SVC_COMBINE,
							 UINT32_MAX, &done, why), RW_OK);
		assert_true(done);
		for (uint32_t h = 0; h < G; h++)
			for (uint32_t j = 0; j < sn->rank[h].nfl; j++) {
				const rw_cuda_list_entry_t *le = &sn->rank[h].fl[j];
				if (le->area != RW_CUDA_AREA_LOCAL)
					continue;
				const rw_record_t *rr = &sn->rec[sn->row_off[n * R + le->rail] + le->slot];
				append(&sn->rank[rr->rank], entry(h * sn->nloc[le->rail] + le->slot, le->rail,
								  RW_CUDA_AREA_LOCAL, n, rr->token));
			}
		norder[n] = arrival_order(s, n, order[n]);
		for (uint32_t i = 0; i < norder[n]; i++) {
			const uint32_t d = order[n][i] / R, e = order[n][i] % R;
			assert_int_equal(rw_svc_mover_host.arrived(s->mover, sn->state, &sn->ph, RW_SVC_COMBINE,
								   d, e, why), RW_OK);
			const rw_pair_plan_t *pp = &sn->layout.out_pairs[d];
			for (uint32_t k = 0; k < pp->quota[e]; k++) {
				uint32_t orail, ord;
				rw_sched_unmap(pp, e, k, &orail, &ord);
				const rw_record_t *rr = &sn->rec[sn->row_off[d * R + orail] + ord];
				append(&sn->rank[rr->rank], entry(sn->layout.out_first[d * R + e] + k, e,
								  RW_CUDA_AREA_RECV, d, rr->token));
			}
		}
		assert_int_equal(rw_svc_mover_host.finish(s->mover, sn->state, &sn->ph, RW_SVC_COMBINE,
							  &pending, why), RW_OK);
		assert_int_equal(pending, 0);
	}

	/* Reduce: each owner's combined rows are the host mover's. */
	for (uint32_t n = 0; n < N; n++) {
		sim_node_t *sn = &s->node[n];
		for (uint32_t g = 0; g < G; g++) {
			sim_rank_t *rk = &sn->rank[g];
			sort_terms(sn, rk->rl, rk->nrl);
			rk->red = zalloc(rk->n * row_bytes);
			memset(rk->red, 0xa5, rk->n * row_bytes); /* a token without terms is written too */
			rw_cuda_rank_reduce_t b = {
				.list = A(rk->rl), .list_n = A(&rk->nrl), .out = A(rk->red), .err = A(s->err),
				.cap = rk->nrl, .n_tokens = rk->n, .hidden = hidden, .dtype = cuda_dtype(s),
				.rails = R,
			};
			for (uint32_t r = 0; r < R; r++) {
				b.area[RW_CUDA_AREA_RECV][r] = A(sn->area[1][1][r]);
				b.area[RW_CUDA_AREA_LOCAL][r] = A(sn->cslab[r] + sn->cstage_off[r]);
			}
			assert_int_equal(rw_cuda_rank_reduce(&s->es, &b), RW_OK);
			sync_and_check(s, 0);
			assert_memory_equal(rk->red, rk->cout, rk->n * row_bytes);
		}
	}

	for (uint32_t n = 0; n < N; n++)
		daemon_lists(s, n, ent);

	for (uint32_t n = 0; n < N; n++) {
		rw_svc_mover_host.close(s->mover, s->node[n].state);
		rw_svc_layout_free(&s->node[n].layout);
	}
	rw_svc_mover_host.destroy(s->mover);
	rw_cuda_stream_destroy(s->stream);
	free(s->counts);
	free_all();
}

/* On the stand-in: the largest grid this process launched since the last look
 * (tests/integration/fake_cuda_rank.h), -1 on another driver. */
static long long grid_take(void)
{
	void *h = dlopen(getenv("RW_CUDA_DRIVER"), RTLD_NOLOAD | RTLD_LAZY);
	if (!h)
		return -1;
	unsigned long long (*take)(void);
	*(void **)&take = dlsym(h, "rw_fake_cuda_grid_take");
	const long long g = take ? (long long)take() : -1;
	dlclose(h);
	return g;
}

/* `cases` random workloads over the four paths, both dtypes, int32 and int64 ids, against the
 * host mover. With budgets: every launch capped at c mod 4 blocks in case c (0: the wrappers'
 * own grids), and on the stand-in no launch of the case took more. */
static void random_cases(int cases, int budgets)
{
	static const rw_path_t paths[] = { RW_PATH_NATIVE, RW_PATH_RAIL_ONLY, RW_PATH_PERM_ONLY,
					   RW_PATH_JOINT };
	for (int c = 0; c < cases; c++) {
		uint32_t N = 2 + rnd() % (MAXN - 1), G = 1 + rnd() % MAXG, R = 1 + rnd() % MAXR;
		uint32_t topk = 1 + rnd() % 8, E = N * G * (1 + rnd() % 6);
		uint32_t hidden = 1 + rnd() % 40, dtype = c % 2 ? RW_WIRE_BF16 : RW_WIRE_F32;
		if (c % 5 == 0)
			E = N * G * 12; /* more experts than the completion holds inline */
		budget = budgets ? (uint32_t)(c % 4) : 0;
		grid_take();
		run_case(N, G, R, topk, E, hidden, paths[c % 4], dtype, c % 3 == 0);
		const long long g = grid_take();
		if (g >= 0 && budget)
			assert_in_range(g, 1, budget);
	}
	budget = 0;
}

static void test_random_against_host_mover(void **state)
{
	(void)state;
	random_cases(24, 0);
}

/* The device error word and the failed-phase status, on a hand-made phase: node 0 of 2, one
 * rail, three tokens of top-2 over 4 experts (2 per node), fp32 rows of 4. */
/* The same against the host mover with the rows split over 3 threads however small (the split
 * cuda/rank_cpu.c makes for a host rank's big phases): the same bytes. */
static void test_random_threaded(void **state)
{
	(void)state;
	setenv("RW_FAKE_CUDA_RANK_THREADS", "3", 1);
	random_cases(12, 0);
	unsetenv("RW_FAKE_CUDA_RANK_THREADS");
}

/* The same against the host mover with every launch capped at 1, 2 and 3 blocks (the rank
 * path's SM budget): the same bytes. The stand-in plays each launch block by block, each block
 * its grid-stride items, and no launch took more than the cap; on a GPU the kernels of
 * rank_kernels.cu run at those grids. */
static void test_random_budgets(void **state)
{
	(void)state;
	random_cases(16, 1);
}

static void test_device_errors(void **state)
{
	rw_cuda_stream_t *st;
	rw_cuda_ext_stream_t es;
	/* everything a kernel reads or writes, in page-locked memory */
	struct {
		uint32_t err[2], tags[2];
		int32_t status;
		float x[3][4];
		int32_t ids[3][2];
		float w[3][2];
		rw_cuda_plan_entry_t ent[2], cent[2];
		rw_cuda_list_entry_t fl[3], rl[2], gl[1];
		uint32_t nfl, recv_n, over, counts[4], nrl, ngl;
		float rows[2][4], out[2][4];
		uint8_t meta[2][32];
	} *m = zalloc(sizeof(*m));
	const float x0[3][4] = { { 1, 2, 3, 4 }, { 5, 6, 7, 8 }, { 9, 10, 11, 12 } };
	const int32_t ids0[3][2] = { { 0, 2 }, { 1, -1 }, { 3, 3 } };
	const float w0[3][2] = { { 0.5f, 0.5f }, { 1, 0 }, { 0.25f, 0.75f } };
	memcpy(m->x, x0, sizeof(x0));
	memcpy(m->ids, ids0, sizeof(ids0));
	memcpy(m->w, w0, sizeof(w0));
	m->tags[0] = 0x1111;
	m->tags[1] = 0x2222;
	const uint32_t rec = (uint32_t)rw_wire_rec_size(2, 4, RW_WIRE_F32);
	uint8_t *slab = zalloc(8 * rec), *scratch = zalloc(rw_cuda_rank_pack_scratch(3, 2));
	/* to node 0 (the local area, slots 0-1): tokens 0, 1; to node 1 (slots 2-3): tokens 0, 2 */
	m->ent[0] = (rw_cuda_plan_entry_t){ 0, 2, 0 };
	m->ent[1] = (rw_cuda_plan_entry_t){ 0, 2, 2ull * rec };
	rw_cuda_rank_pack_t p = {
		.x = A(m->x), .ids = A(m->ids), .weights = A(m->w), .entry = A(m->ent), .tags = A(m->tags),
		.slab = { A(slab) }, .scratch = A(scratch), .status = A(&m->status), .err = A(m->err),
		.n_tokens = 3, .topk = 2, .hidden = 4, .dtype = RW_CUDA_FP32, .n_experts = 4, .nodes = 2,
		.rails = 1, .me = 0, .owner = 1,
	};
	(void)state;
	assert_int_equal(rw_cuda_stream_create(0, &st), RW_OK);
	assert_int_equal(rw_cuda_ext_stream_of(st, &es), RW_OK);
	rw_wire_rec_hdr_t h;
	const uint32_t tok[4] = { 0, 1, 0, 2 }, tag[4] = { 0x1111, 0x1111, 0x2222, 0x2222 };
	assert_int_equal(rw_cuda_rank_pack(&es, &p), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_int_equal(m->err[0], 0);
	for (int i = 0; i < 4; i++) {
		assert_int_equal(rw_wire_rec_unpack(slab + i * rec, 2, &h), RW_OK);
		assert_true(h.token == tok[i] && h.tag == tag[i] && h.src_node == 0 && h.owner == 1);
	}

	/* A plan one slot short for node 1: its second record is not written, named. */
	memset(slab, 0xee, 8 * rec);
	m->ent[1].count = 1;
	assert_int_equal(rw_cuda_rank_pack(&es, &p), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_int_equal(m->err[0], RW_CUDA_RANK_E_PLAN);
	assert_int_equal(m->err[1], 1 + 1);
	assert_int_equal(rw_wire_get32(slab + 3 * rec), 0xeeeeeeee);
	assert_int_equal(rw_wire_rec_unpack(slab + 2 * rec, 2, &h), RW_OK);
	m->ent[1].count = 2;

	/* An id out of range: that token gets no record, named; the others keep their places. */
	memset(slab, 0xee, 8 * rec);
	m->err[0] = m->err[1] = 0;
	m->ids[1][0] = 4;
	assert_int_equal(rw_cuda_rank_pack(&es, &p), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_int_equal(m->err[0], RW_CUDA_RANK_E_ID);
	assert_int_equal(m->err[1], 1 + 1);
	assert_int_equal(rw_wire_get32(slab + 1 * rec), 0xeeeeeeee); /* token 1's record */
	assert_int_equal(rw_wire_rec_unpack(slab + 3 * rec, 2, &h), RW_OK);
	assert_int_equal(h.token, 2);
	m->ids[1][0] = 1;

	/* A failed phase: nothing is written, no error. */
	memset(slab, 0xee, 8 * rec);
	m->err[0] = m->err[1] = 0;
	m->status = -7;
	assert_int_equal(rw_cuda_rank_pack(&es, &p), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_int_equal(m->err[0], 0);
	for (uint32_t i = 0; i < 8 * rec; i++)
		assert_int_equal(slab[i], 0xee);
	m->status = 0;
	assert_int_equal(rw_cuda_rank_pack(&es, &p), RW_OK); /* the records, for the forward */
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);

	/* Forward: two of the three listed fit; the third is counted as overflow. Then an entry
	 * naming no area, then a failed phase (empty outputs). */
	m->fl[0] = entry(2, 0, RW_CUDA_AREA_LOCAL, 0, 0);
	m->fl[1] = entry(0, 0, RW_CUDA_AREA_LOCAL, 0, 0);
	m->fl[2] = entry(1, 0, RW_CUDA_AREA_LOCAL, 0, 1);
	m->nfl = 3;
	m->recv_n = m->over = 99;
	memset(m->counts, 0xff, sizeof(m->counts));
	rw_cuda_rank_forward_t f = {
		.list = A(m->fl), .list_n = A(&m->nfl), .rows = A(m->rows), .meta = A(m->meta), .counts = A(m->counts),
		.recv_n = A(&m->recv_n), .overflow = A(&m->over), .status = A(&m->status), .err = A(m->err), .cap = 2,
		.topk = 2, .hidden = 4, .dtype = RW_CUDA_FP32, .n_experts = 4, .nodes = 2, .gpus = 2,
		.rails = 1, .me = 1, .g = 1,
	};
	f.area[RW_CUDA_AREA_LOCAL][0] = A(slab);
	assert_int_equal(rw_cuda_rank_forward(&es, &f), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_int_equal(m->err[0], 0);
	assert_true(m->recv_n == 2 && m->over == 1);
	assert_memory_equal(m->rows[0], m->x[0], 16);
	assert_memory_equal(m->rows[1], m->x[0], 16);
	/* node 1, rank 1 holds expert 3: token 0's records name experts 0 and 2 only */
	assert_true(m->counts[0] == 0 && m->counts[1] == 0 && m->counts[2] == 0 && m->counts[3] == 0);
	assert_int_equal(rw_wire_get32(m->meta[0] + 4), 0 * 2 + 1); /* src_rank: node 0, owner 1 */
	m->fl[1].area = 2;
	assert_int_equal(rw_cuda_rank_forward(&es, &f), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_true(m->err[0] == RW_CUDA_RANK_E_REF && m->err[1] == 2);
	m->err[0] = m->err[1] = 0;
	m->status = 3;
	memset(m->counts, 0xff, sizeof(m->counts));
	assert_int_equal(rw_cuda_rank_forward(&es, &f), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_true(m->err[0] == 0 && m->recv_n == 0 && m->over == 0);
	assert_true(m->counts[0] == 0 && m->counts[1] == 0 && m->counts[2] == 0 && m->counts[3] == 0);
	m->status = 0;

	/* Reduce: a list out of token order is named. */
	m->rl[0] = entry(2, 0, RW_CUDA_AREA_RECV, 1, 1);
	m->rl[1] = entry(3, 0, RW_CUDA_AREA_RECV, 1, 0);
	m->nrl = 2;
	rw_cuda_rank_reduce_t r = {
		.list = A(m->rl), .list_n = A(&m->nrl), .out = A(m->out), .err = A(m->err), .cap = 2, .n_tokens = 2,
		.hidden = 4, .dtype = RW_CUDA_FP32, .rails = 1,
	};
	r.area[RW_CUDA_AREA_RECV][0] = A(slab);
	assert_int_equal(rw_cuda_rank_reduce(&es, &r), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_true(m->err[0] == RW_CUDA_RANK_E_REF && m->err[1] == 1);
	m->err[0] = m->err[1] = 0;

	/* Gather: a listed slot outside its node's return range on that rail is named. */
	m->cent[0] = (rw_cuda_plan_entry_t){ 0, 0, 0 };
	m->cent[1] = (rw_cuda_plan_entry_t){ 5, 1, 4ull * rec };
	m->gl[0] = entry(4, 0, RW_CUDA_AREA_RECV, 1, 0);
	m->ngl = 1;
	rw_cuda_rank_gather_t gb = {
		.list = A(m->gl), .list_n = A(&m->ngl), .entry = A(m->cent), .tags = A(m->tags), .slab = { A(slab) },
		.rows = { A(m->x) }, .err = A(m->err), .cap = 1, .hidden = 4, .dtype = RW_CUDA_FP32, .nodes = 2,
		.rails = 1, .me = 0, .g = 0,
	};
	assert_int_equal(rw_cuda_rank_gather(&es, &gb), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_true(m->err[0] == RW_CUDA_RANK_E_PLAN && m->err[1] == 1);
	rw_cuda_stream_destroy(st);
	free_all();
}

/* The pack's numbering at scale: 1300 tokens (several chunks of the index kernel's block) to
 * 130 nodes (three windows of 64), each node's records split over two rails at a random point:
 * record i to node d is the i-th token, in token order, with an expert on d, and lands where
 * its piece says. */
static void test_pack_numbering_at_scale(void **state)
{
	enum { NT = 1300, NN = 130, K = 8, E = 2 * NN, H = 8 };
	(void)state;
	rw_cuda_stream_t *st;
	rw_cuda_ext_stream_t es;
	struct {
		uint32_t err[2], tags[NN], want[NN];
		int32_t ids[NT][K];
		float w[NT][K], x[NT][H];
		rw_cuda_plan_entry_t ent[NN][2];
	} *m = zalloc(sizeof(*m));
	const uint32_t rec = (uint32_t)rw_wire_rec_size(K, H, RW_WIRE_F32);
	uint64_t total = 0;
	for (uint32_t t = 0; t < NT; t++)
		for (uint32_t k = 0; k < K; k++) {
			m->ids[t][k] = rnd() % 9 == 0 ? -1 : (int32_t)(rnd() % E);
			m->w[t][k] = (float)k;
		}
	for (uint32_t t = 0; t < NT; t++)
		for (uint32_t h = 0; h < H; h++)
			m->x[t][h] = (float)(t * H + h);
	/* the reference numbering: per node, tokens in order */
	uint32_t (*seq)[NT] = zalloc(sizeof(uint32_t) * NN * NT);
	for (uint32_t t = 0; t < NT; t++) {
		uint8_t seen[NN] = { 0 };
		for (uint32_t k = 0; k < K; k++)
			if (m->ids[t][k] >= 0 && !seen[m->ids[t][k] / 2]) {
				uint32_t d = (uint32_t)m->ids[t][k] / 2;
				seen[d] = 1;
				seq[d][m->want[d]++] = t;
			}
	}
	uint8_t *slab[2];
	uint64_t off[2] = { 0, 0 };
	for (uint32_t d = 0; d < NN; d++)
		total += m->want[d];
	slab[0] = zalloc(total * rec);
	slab[1] = zalloc(total * rec);
	for (uint32_t d = 0; d < NN; d++) {
		uint32_t cut = m->want[d] ? rnd() % (m->want[d] + 1) : 0;
		m->tags[d] = 0x100 + d;
		m->ent[d][1] = (rw_cuda_plan_entry_t){ 0, cut, off[1] }; /* the first piece on rail 1 */
		m->ent[d][0] = (rw_cuda_plan_entry_t){ cut, m->want[d] - cut, off[0] };
		off[1] += (uint64_t)cut * rec;
		off[0] += (uint64_t)(m->want[d] - cut) * rec;
	}
	void *scratch = zalloc(rw_cuda_rank_pack_scratch(NT, K));
	rw_cuda_rank_pack_t p = {
		.x = A(m->x), .ids = A(m->ids), .weights = A(m->w), .entry = A(m->ent), .tags = A(m->tags),
		.slab = { A(slab[0]), A(slab[1]) }, .scratch = A(scratch), .err = A(m->err),
		.n_tokens = NT, .topk = K, .hidden = H, .dtype = RW_CUDA_FP32, .n_experts = E,
		.nodes = NN, .rails = 2, .me = 7, .owner = 3,
	};
	assert_int_equal(rw_cuda_stream_create(0, &st), RW_OK);
	assert_int_equal(rw_cuda_ext_stream_of(st, &es), RW_OK);
	assert_int_equal(rw_cuda_rank_pack(&es, &p), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(st), RW_OK);
	assert_int_equal(m->err[0], 0);
	for (uint32_t d = 0; d < NN; d++)
		for (uint32_t i = 0; i < m->want[d]; i++) {
			const rw_cuda_plan_entry_t *e = i < m->ent[d][1].count ? &m->ent[d][1] : &m->ent[d][0];
			const uint8_t *r = (e == &m->ent[d][1] ? slab[1] : slab[0]) + e->offset +
					   (uint64_t)(i - e->first) * rec;
			rw_wire_rec_hdr_t h;
			assert_int_equal(rw_wire_rec_unpack(r, K, &h), RW_OK);
			assert_true(h.token == seq[d][i] && h.tag == 0x100 + d && h.src_node == 7 && h.owner == 3);
			float row0;
			memcpy(&row0, r + rw_wire_rec_row_off(K), 4);
			assert_true(row0 == (float)(seq[d][i] * H));
		}
	rw_cuda_stream_destroy(st);
	free_all();
}

static int setup(void **state)
{
	(void)state;
	seed_rng("rank_kernels");
	if (rw_cuda_init() != RW_OK || !rw_cuda_rank_kernels_available(0)) {
		printf("rank_kernels: the rank kernels do not load on the stand-in driver (%s); "
		       "built without nvcc?\n", rw_cuda_unavailable_reason());
		return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
#if !RW_HAVE_CUDA_H || !RW_HAVE_NVCC
	(void)argc, (void)argv;
	printf("rank_kernels: built without cuda.h or nvcc (no rank image); skipped\n");
	return 77;
#else
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_random_against_host_mover),
		cmocka_unit_test(test_random_threaded),
		cmocka_unit_test(test_random_budgets),
		cmocka_unit_test(test_device_errors),
		cmocka_unit_test(test_pack_numbering_at_scale),
	};
	char self[PATH_MAX], driver[PATH_MAX + 64];
	(void)argc;
	/* build/test/rank_kernels -> build/tests/integration/libfakecuda_kern.so, unless
	 * $RW_CUDA_DRIVER names a driver (RW_CUDA_DRIVER=libcuda.so.1: the real kernels on a GPU) */
	snprintf(self, sizeof(self), "%s", argv[0]);
	snprintf(driver, sizeof(driver), "%s/../tests/integration/libfakecuda_kern.so", dirname(self));
	setenv("RW_CUDA_DRIVER", driver, 0);
	/* The kernels' contracts hold wherever their blocks' words live; these tests keep lists and
	 * plan entries in page-locked host memory, which the stand-in refuses for the rank path's
	 * own launches (fake_cuda_rank.c host_read) unless told. */
	setenv("RW_FAKE_RANK_HOST_READS", "1", 0);
	rw_log_set_level(RW_LOG_WARN);
	return cmocka_run_group_tests(tests, setup, NULL);
#endif
}
