/* In-process test of railwaved's phase executor (docs/dataflow.md "Tests"): N executors, each
 * with its own rw_svc_t (config from rw_svc_config_load_text, metrics), run in this one process on
 * one libev loop, over the fake mesh and fake IPC server of tests/service/exec_fakes.c. The test
 * plays every rank (submissions through the executor's IPC callbacks, host buffers) and decides
 * what the network delivers and when. It pins today's behaviour so that a refactor of service/
 * can be run against it: every path and the selector, checked exactly (every dispatched row, its
 * metadata and per-expert counts, every combined sum; tests/integration/rw_rank.c's workload);
 * the receiver grants; early and late count rows; tombstones, timeouts, relayed PHASE_ERR and
 * same-key retries; a peer and a rank lost in every stage; bad input from ranks and peers;
 * several groups and the receive slots; the drain. Every case ends by stopping every node, and
 * the fakes check the executor's contracts (one completion per submission, none after a rank
 * left); under ASan nothing may leak.
 *
 * The second cmocka group (svc_exec_fixed_bugs) reproduces bugs of the executor before the split
 * (each case says what failed then); they pass now and stay as regression tests.
 *
 * Run: build/test/svc_exec. RW_EXEC_SEED=n replays the seeded delivery orders and workloads
 * (printed first); RW_EXEC_ONLY=pattern runs some cases (cmocka filter, e.g. "test_peer*");
 * RW_EXEC_LOG=warn|info|debug shows the executors' logs. Deterministic in what the network does
 * for a seed; the executors' own timers (phase timeout, slot tick) run on the real clock.
 *
 * The executor's entry points are called from node_start()/node_stop()/node_drain() only: the
 * place to change when they are renamed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda/rw_cuda.h"
#include "ipc/railwave.h"
#include "service/exec/exec.h"
#include "service/mover/mover.h"
#include "service/core/svc.h"
#include "service/phase/phase.h"
#include "tests/service/exec_fakes.h"

/* ---- the daemon's side -------------------------------------------------------------------------
 * rw_svc_stop (svc.h) sets svc->stopping once: a drain that ended shows there. */

extern char **environ;

/* ---- workload (tests/integration/rw_rank.c's, byte for byte) ----------------------------------- */

enum { TOPK = 4, MAX_TOKENS = 48, MAX_ROWS = 3 * MAX_TOKENS, MAX_RANKS = FK_MAX_NODES * 4,
       MAX_GROUPS = 3 };

typedef struct work {
	uint32_t n;
	int32_t ids[MAX_ROWS][TOPK];
	float w[MAX_ROWS][TOPK];
	float *x; /* [MAX_ROWS][hidden] */
} work_t;

static uint64_t mix(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

typedef struct rng { uint64_t s; } rng_t;
static uint32_t next(rng_t *r) { r->s = mix(r->s); return (uint32_t)(r->s >> 32); }

static float factor(int32_t e) { return (float)(e % 3 + 1); }

static uint16_t to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t v)
{
	uint32_t u = (uint32_t)v << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* ---- the cluster --------------------------------------------------------------------------------- */

typedef struct opts {
	uint32_t nodes, gpus, rails;
	const char *path;          /* "auto", "native", "rail-only", "perm-only", "joint" */
	uint32_t experts;          /* 0: nodes * gpus * 2 */
	uint32_t hidden;           /* 0: 24 */
	uint32_t timeout_ms;       /* 0: 20000 (never reached unless a test waits for it) */
	uint32_t recv_mib;         /* 0: 4 */
	uint32_t tokens;           /* every rank dispatches exactly this many (rw_rank --tokens) */
	int empty;                 /* rw_rank --empty */
	int fifo;                  /* deliver in post order instead of seeded random order */
	uint64_t max_write;        /* 0: 1 MiB */
	uint32_t stay_home;        /* bit n: node n's ranks pick only experts of node n */
	int cuda_mover;            /* list the CUDA mover first, as main.c does (kernel stand-in) */
	int dev_slabs;             /* every rail's slabs in device memory (fk_world_t.dev_slabs) */
} opts_t;

typedef struct trank {
	rw_ipc_client_t *c;
	uint32_t rank, node, local;
	uint32_t buf;
	uint8_t *mem;              /* what the test writes and reads (a CUDA rank's host mirror) */
	rw_cuda_dptr_t dptr;       /* a CUDA rank's buffer (0: host memory, mem itself) */
	uint8_t *mirror;           /* owned by the rank slot, freed with the cluster */
	uint32_t seen;             /* completions consumed */
	rw_sqe_t ds;               /* the last dispatch submitted */
	rw_cqe_t dq;               /* its completion */
} trank_t;

typedef struct cl {
	opts_t o;
	uint32_t N, G, R, W, E, per_rank, hidden;
	uint64_t seed, seed0;      /* seed: the current group's (seed0 for group 0) */
	struct ev_loop *loop;
	fk_world_t *w;
	rw_svc_t svc[FK_MAX_NODES];
	int running[FK_MAX_NODES];
	trank_t rks[MAX_GROUPS][MAX_RANKS];
	char groups[MAX_GROUPS][32];
	trank_t *rk;               /* the current group's ranks (use_group) */
	char *group;
	work_t mine, other;
	uint8_t *seen;
	uint32_t *ecount;
	float *outv;
	size_t in_bytes, out_cap, comb_in, comb_out, total;
	uint64_t off_tok, off_ids, off_w, off_out, off_cin, off_cout;
} cl_t;

static uint64_t base_seed;

#define CHECK(cond, ...)                                                                       \
	do {                                                                                   \
		if (!(cond)) {                                                                 \
			print_error("%s:%d: ", __FILE__, __LINE__);                            \
			print_error(__VA_ARGS__);                                              \
			print_error("\n");                                                     \
			fail();                                                                \
		}                                                                              \
	} while (0)

static void gen(const cl_t *c, uint32_t step, uint32_t layer, uint32_t rank, work_t *wk)
{
	rng_t r = { mix(c->seed ^ ((uint64_t)step << 40) ^ ((uint64_t)layer << 20) ^ rank) };
	uint32_t base = 1 + next(&r) % MAX_TOKENS;
	wk->n = rank % c->G == 0 ? base * 3 : base;
	if (c->o.tokens)
		wk->n = c->o.tokens;
	if (c->o.empty) {
		uint64_t ph = mix(c->seed ^ 0x5eedull ^ ((uint64_t)step << 40) ^ ((uint64_t)layer << 20));
		if (ph % 5 == 1 || (step == 0 && layer == 1) || next(&r) % 4 == 0)
			wk->n = 0;
	}
	uint32_t experts = c->E;
	uint32_t hot = experts / 4 ? experts / 4 : 1, shift = (rank * 7 + layer) % experts;
	for (uint32_t t = 0; t < wk->n; t++) {
		for (uint32_t k = 0; k < TOPK; k++) {
			int32_t e;
			for (;;) {
				uint32_t u = next(&r);
				if (u % 8 == 0) {
					e = -1;
					break;
				}
				e = (int32_t)(u % 2 ? (shift + next(&r) % hot) % experts : next(&r) % experts);
				uint32_t node = rank / c->G, per_node = c->G * c->per_rank;
				if (c->o.stay_home >> node & 1)
					e = (int32_t)(node * per_node + (uint32_t)e % per_node);
				int dup = 0;
				for (uint32_t j = 0; j < k; j++)
					dup |= wk->ids[t][j] == e;
				if (!dup)
					break;
			}
			wk->ids[t][k] = e;
			wk->w[t][k] = next(&r) % 2 ? 0.5f : 1.0f;
		}
		for (uint32_t h = 0; h < c->hidden; h++)
			wk->x[(size_t)t * c->hidden + h] = (float)((int)(next(&r) % 9) - 4);
	}
}

static void put_row(const cl_t *c, uint8_t *dst, int bf16, const float *v)
{
	for (uint32_t h = 0; h < c->hidden; h++) {
		if (bf16) {
			uint16_t b = to_bf16(v[h]);
			memcpy(dst + 2 * h, &b, 2);
		} else {
			memcpy(dst + 4 * h, &v[h], 4);
		}
	}
}

static float get_elem(const uint8_t *src, int bf16, uint32_t h)
{
	if (bf16) {
		uint16_t b;
		memcpy(&b, src + 2 * h, 2);
		return from_bf16(b);
	}
	float f;
	memcpy(&f, src + 4 * h, 4);
	return f;
}

/* ---- pumping ------------------------------------------------------------------------------------ */

#define CEILING_NS (20ull * 1000000000ull) /* turns a hang into a failure; nothing asserts on time */

/* One loop iteration without blocking (timers, idle slices), then one network event. */
static int pump_once(cl_t *c)
{
	ev_run(c->loop, EVRUN_NOWAIT);
	return fk_step(c->w);
}

/* Deliver until nothing is deliverable for a while (held events stay queued). */
static void settle(cl_t *c)
{
	for (uint32_t quiet = 0; quiet < 64;)
		quiet = pump_once(c) ? 0 : quiet + 1;
}

typedef int (*pred_fn)(cl_t *c, const void *arg);

static void pump_until(cl_t *c, pred_fn pred, const void *arg, const char *what)
{
	uint64_t t0 = rw_now_ns();
	while (!pred(c, arg)) {
		if (!pump_once(c) && !pred(c, arg))
			ev_run(c->loop, EVRUN_ONCE); /* time must pass: the executors' tick wakes it */
		if (rw_now_ns() - t0 > CEILING_NS) {
			print_error("waited 20 s for %s (%u events queued)\n", what, fk_pending(c->w));
			fail();
		}
	}
}

static uint32_t n_cqe(const trank_t *t)
{
	fk_client_stats_t s;
	fk_client_stats(t->c, &s);
	return s.n_cqe;
}

static int has_cqe(cl_t *c, const void *arg)
{
	const trank_t *t = &c->rk[*(const uint32_t *)arg];
	return n_cqe(t) > t->seen;
}

/* The next completion of rank r (pumping until it comes). */
static rw_cqe_t next_cqe(cl_t *c, uint32_t r)
{
	char what[64];
	snprintf(what, sizeof(what), "a completion for rank %u", r);
	pump_until(c, has_cqe, &r, what);
	trank_t *t = &c->rk[r];
	return *fk_client_cqe(t->c, t->seen++);
}

static void expect_no_cqe(cl_t *c, uint32_t r)
{
	CHECK(n_cqe(&c->rk[r]) == c->rk[r].seen, "rank %u got a completion it should not have (error %d)",
	      r, fk_client_cqe(c->rk[r].c, c->rk[r].seen)->error);
}

static void expect_err(cl_t *c, uint32_t r, int err, const char *when)
{
	rw_cqe_t q = next_cqe(c, r);
	CHECK(q.status == RW_CQ_ERROR && q.error == err,
	      "%s: rank %u: status %u error %d, expected error %d", when, r, q.status, q.error, err);
}

/* The completion must already be there (answered inside the submission, no network, no time). */
static void expect_err_now(cl_t *c, uint32_t r, int err, const char *when)
{
	CHECK(n_cqe(&c->rk[r]) > c->rk[r].seen, "%s: rank %u was not answered at once", when, r);
	expect_err(c, r, err, when);
}

/* ---- nodes ---------------------------------------------------------------------------------------- */

static void node_start(cl_t *c, uint32_t n)
{
	char json[8192], *p = json, *end = json + sizeof(json);
	p += snprintf(p, (size_t)(end - p),
		      "{\"cluster\": \"exec\", \"gpus_per_node\": %u, \"phase_timeout_ms\": %u, "
		      "\"heartbeat_interval_ms\": 1, \"heartbeat_timeout_ms\": 20, \"recv_region_mib\": %u, "
		      "\"http\": \"0\", \"nodes\": [",
		      c->G, c->o.timeout_ms ? c->o.timeout_ms : 20000, c->o.recv_mib ? c->o.recv_mib : 4);
	for (uint32_t i = 0; i < c->N; i++) {
		p += snprintf(p, (size_t)(end - p), "%s{\"name\": \"n%u\", \"control\": \"127.0.0.%u:7400\", \"rails\": [",
			      i ? "," : "", i, i + 1);
		for (uint32_t r = 0; r < c->R; r++)
			p += snprintf(p, (size_t)(end - p), "%s\"127.0.%u.%u\"", r ? "," : "", r, i + 1);
		p += snprintf(p, (size_t)(end - p), "]}");
	}
	snprintf(p, (size_t)(end - p), "]}");
	char node[16], err[512];
	snprintf(node, sizeof(node), "%u", n);
	const rw_svc_kv_t flags[] = { { "node", node }, { "path", c->o.path ? c->o.path : "auto" } };
	rw_svc_t *svc = &c->svc[n];
	memset(svc, 0, sizeof(*svc));
	rw_status_t st = rw_svc_config_load_text(json, NULL, flags, 2, &svc->cfg, err, sizeof(err));
	CHECK(st == RW_OK, "config: %s", err);
	rw_svc_config_topo(&svc->cfg, &svc->topo);
	assert_int_equal(rw_svc_metrics_init(&svc->metrics, svc->cfg.rails, svc->cfg.n_nodes), RW_OK);
	svc->metrics.peer[n].state = RW_SVC_PEER_SELF;
	svc->loop = c->loop;
	/* The executor's entry points, as main.c calls them. */
	static const rw_svc_mover_ops_t *const movers[] = { &rw_svc_mover_cuda, &rw_svc_mover_host };
	rw_svc_exec_hooks_t hooks;
	rw_svc_exec_hooks_from_env(environ, &hooks);
	assert_int_equal(rw_svc_exec_create(svc, movers + !c->o.cuda_mover, 2 - !c->o.cuda_mover,
					    &hooks, &svc->exec), RW_OK);
	assert_int_equal(rw_svc_exec_ipc_start(svc->exec), RW_OK);
	c->running[n] = 1;
}

static void node_drain(cl_t *c, uint32_t n)
{
	c->svc[n].draining = 1;
	rw_svc_exec_drain(c->svc[n].exec);
}

static void node_stop(cl_t *c, uint32_t n)
{
	if (!c->running[n])
		return;
	rw_svc_t *svc = &c->svc[n];
	rw_svc_exec_ipc_stop(svc->exec);
	rw_svc_exec_destroy(svc->exec);
	svc->exec = NULL;
	rw_svc_metrics_fini(&svc->metrics);
	rw_svc_config_free(&svc->cfg);
	c->running[n] = 0;
}

static void rank_connect(cl_t *c, uint32_t r)
{
	trank_t *t = &c->rk[r];
	t->rank = r;
	t->node = r / c->G;
	t->local = r % c->G;
	t->seen = 0;
	t->c = fk_client_new(c->w, t->node, c->group, r, c->W, t->local);
	fk_client_join(t->c);
	t->buf = fk_client_buffer(t->c, c->total, &t->mem);
	t->dptr = 0;
}

/* A CUDA rank's bytes between its host mirror and its buffer: what the test wrote goes up
 * before a submission, what the daemon wrote comes down before the test reads it. (The stand-in's
 * device memory is host memory, the real driver's is not: with the mirror both run.) */
static void rank_push(cl_t *c, const trank_t *t, uint64_t off, uint64_t len)
{
	CHECK(!t->dptr || rw_cuda_memcpy_htod(0, t->dptr + off, t->mem + off, len) == RW_OK,
	      "rank %u: copy to its CUDA buffer failed", t->rank);
	(void)c;
}

static void rank_pull(cl_t *c, const trank_t *t, uint64_t off, uint64_t len)
{
	CHECK(!t->dptr || rw_cuda_memcpy_dtoh(0, t->mem + off, t->dptr + off, len) == RW_OK,
	      "rank %u: copy from its CUDA buffer failed", t->rank);
	(void)c;
}

/* The same rank with its one buffer in CUDA memory (the stand-in's, or the GPU's when svc_exec
 * runs on the real driver): the executor stages it, the test reads and writes a host mirror. */
static void rank_connect_cuda(cl_t *c, uint32_t r)
{
	trank_t *t = &c->rk[r];
	t->rank = r;
	t->node = r / c->G;
	t->local = r % c->G;
	t->seen = 0;
	t->c = fk_client_new(c->w, t->node, c->group, r, c->W, t->local);
	fk_client_join(t->c);
	uint8_t *dmem = NULL;
	t->buf = fk_client_cuda_buffer(t->c, c->total, &dmem);
	CHECK(t->buf, "rank %u: no CUDA buffer", r);
	if (!t->mirror)
		t->mirror = calloc(1, c->total);
	CHECK(t->mirror, "rank %u: no memory for its mirror", r);
	t->dptr = (rw_cuda_dptr_t)(uintptr_t)dmem;
	t->mem = t->mirror;
}

static void node_ranks_connect(cl_t *c, uint32_t n)
{
	for (uint32_t g = 0; g < c->G; g++)
		rank_connect(c, n * c->G + g);
}

static int mesh_up(cl_t *c, const void *arg)
{
	(void)arg;
	return fk_all_up(c->w);
}

static cl_t *cl_new(const opts_t *o, uint64_t seed_salt)
{
	cl_t *c = calloc(1, sizeof(*c));
	assert_non_null(c);
	c->o = *o;
	c->N = o->nodes;
	c->G = o->gpus ? o->gpus : 2;
	c->R = o->rails ? o->rails : 2;
	c->W = c->N * c->G;
	c->E = o->experts ? o->experts : c->W * 2;
	c->per_rank = c->E / c->W;
	c->hidden = o->hidden ? o->hidden : 24;
	c->seed = c->seed0 = mix(base_seed ^ seed_salt);
	for (uint32_t g = 0; g < MAX_GROUPS; g++)
		snprintf(c->groups[g], sizeof(c->groups[g]), g ? "g.exec%u" : "g.exec", g);
	c->rk = c->rks[0];
	c->group = c->groups[0];
	c->loop = ev_loop_new(EVFLAG_AUTO);
	assert_non_null(c->loop);
	c->w = fk_world_new(c->loop, c->N, c->R, !o->fifo, c->seed);
	assert_non_null(c->w);
	if (o->max_write)
		c->w->max_write = o->max_write;
	c->w->dev_slabs = o->dev_slabs;
	c->mine.x = malloc(sizeof(float) * MAX_ROWS * c->hidden);
	c->other.x = malloc(sizeof(float) * MAX_ROWS * c->hidden);
	c->seen = malloc((size_t)c->W * MAX_ROWS);
	c->ecount = malloc(sizeof(uint32_t) * c->E);
	c->outv = malloc(sizeof(float) * c->hidden);
	assert_true(c->mine.x && c->other.x && c->seen && c->ecount && c->outv);
	/* One buffer per rank, laid out as rw_rank's. */
	c->in_bytes = (size_t)MAX_ROWS * (c->hidden * 4 + TOPK * 8);
	c->out_cap = (size_t)c->W * MAX_ROWS * (c->hidden * 4 + 16 + TOPK * 8) + 4 * c->E + 64;
	c->comb_in = (size_t)c->W * MAX_ROWS * c->hidden * 4;
	c->comb_out = (size_t)MAX_ROWS * c->hidden * 4;
	c->total = c->in_bytes + c->out_cap + c->comb_in + c->comb_out;
	c->off_tok = 0;
	c->off_ids = (uint64_t)MAX_ROWS * c->hidden * 4;
	c->off_w = c->off_ids + MAX_ROWS * TOPK * 4;
	c->off_out = c->in_bytes;
	c->off_cin = c->off_out + c->out_cap;
	c->off_cout = c->off_cin + c->comb_in;
	for (uint32_t n = 0; n < c->N; n++)
		node_start(c, n);
	pump_until(c, mesh_up, NULL, "the mesh");
	for (uint32_t r = 0; r < c->W; r++)
		rank_connect(c, r);
	settle(c);
	return c;
}

/* The ranks, group name and workload seed of group g (several groups share the nodes). */
static void use_group(cl_t *c, uint32_t g)
{
	c->rk = c->rks[g];
	c->group = c->groups[g];
	c->seed = g ? mix(c->seed0 + g) : c->seed0;
}

/* Stop every node (everything must be freed: ASan's leak check runs at exit) and check that the
 * fakes saw no contract violation. */
static void cl_free(cl_t *c)
{
	for (uint32_t n = 0; n < c->N; n++)
		node_stop(c, n);
	uint32_t v = c->w->violations;
	char what[256];
	snprintf(what, sizeof(what), "%s", c->w->violation);
	fk_world_free(c->w);
	ev_loop_destroy(c->loop);
	for (uint32_t g = 0; g < MAX_GROUPS; g++)
		for (uint32_t r = 0; r < MAX_RANKS; r++)
			free(c->rks[g][r].mirror);
	free(c->mine.x);
	free(c->other.x);
	free(c->seen);
	free(c->ecount);
	free(c->outv);
	free(c);
	CHECK(v == 0, "%u contract violations, the first: %s", v, what);
}

/* ---- one rank's dispatch and combine, checked exactly (rw_rank's checks) ------------------------ */

typedef struct sub_opts {
	uint32_t n_experts;        /* 0: the cluster's */
	uint8_t dtype;             /* 0: the phase's */
	uint32_t tokens_buf;       /* 0: the rank's buffer */
	int32_t bad_id;            /* != 0: token 0's first id becomes this */
	uint64_t output_capacity;  /* 0: all of it */
	int local_only;            /* every id moved to an expert of the rank's own node */
} sub_opts_t;

static int phase_bf16(uint32_t step, uint32_t layer) { return (int)((layer + step) % 2); }

static void dispatch_submit(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const sub_opts_t *so)
{
	trank_t *t = &c->rk[r];
	int bf16 = phase_bf16(step, layer);
	uint32_t row = c->hidden * (bf16 ? 2 : 4);
	gen(c, step, layer, r, &c->mine);
	if (so && so->local_only) {
		uint32_t per_node = c->G * c->per_rank;
		for (uint32_t i = 0; i < c->mine.n; i++)
			for (uint32_t k = 0; k < TOPK; k++)
				c->mine.ids[i][k] = (int32_t)(t->node * per_node + (uint32_t)i % per_node);
	}
	for (uint32_t i = 0; i < c->mine.n; i++) {
		put_row(c, t->mem + c->off_tok + (uint64_t)i * row, bf16, c->mine.x + (size_t)i * c->hidden);
		memcpy(t->mem + c->off_ids + (uint64_t)i * TOPK * 4, c->mine.ids[i], TOPK * 4);
		memcpy(t->mem + c->off_w + (uint64_t)i * TOPK * 4, c->mine.w[i], TOPK * 4);
	}
	if (so && so->bad_id && c->mine.n)
		memcpy(t->mem + c->off_ids, &so->bad_id, 4);
	rank_push(c, t, 0, c->in_bytes);
	rw_span_t none = { RW_BUF_NONE, 0, 0 };
	uint32_t b = so && so->tokens_buf ? so->tokens_buf : t->buf;
	rw_sqe_t s = { .kind = RW_KIND_DISPATCH, .dtype = bf16 ? RW_DTYPE_BF16 : RW_DTYPE_FP32,
		       .topk = TOPK, .layer = layer, .phase_id = step * 1000 + layer, .step = step,
		       .user_data = 7, .token_count = c->mine.n, .hidden = c->hidden,
		       .tokens = { b, 0, c->off_tok }, .topk_ids = { t->buf, 0, c->off_ids },
		       .topk_weights = { t->buf, 0, c->off_w }, .output = { t->buf, 0, c->off_out },
		       .output_capacity = c->out_cap, .n_experts = c->E };
	if (c->mine.n == 0 && (step + layer + r) % 2)
		s.tokens = s.topk_ids = s.topk_weights = none;
	if (so && so->n_experts)
		s.n_experts = so->n_experts;
	if (so && so->dtype)
		s.dtype = so->dtype;
	if (so && so->output_capacity)
		s.output_capacity = so->output_capacity;
	t->ds = s;
	fk_client_submit(t->c, &s);
}

/* Check rank r's dispatch completion exactly and write its combine input (expert outputs). */
static void dispatch_check(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const rw_cqe_t *cq)
{
	trank_t *t = &c->rk[r];
	const uint32_t me = r;
	int bf16 = phase_bf16(step, layer);
	uint32_t row = c->hidden * (bf16 ? 2 : 4);
	CHECK(cq->status == RW_CQ_OK, "rank %u step %u layer %u dispatch failed: error %d", me, step,
	      layer, cq->error);
	rank_pull(c, t, c->off_out, c->out_cap);
	CHECK(cq->kind == RW_KIND_DISPATCH && cq->phase_id == t->ds.phase_id && cq->user_data == 7,
	      "rank %u: completion ids", me);
	uint32_t expect_total = 0;
	memset(c->seen, 0, (size_t)c->W * MAX_ROWS);
	memset(c->ecount, 0, sizeof(uint32_t) * c->E);
	for (uint32_t q = 0; q < c->W; q++) {
		gen(c, step, layer, q, &c->other);
		for (uint32_t i = 0; i < c->other.n; i++) {
			int hit = 0;
			for (uint32_t k = 0; k < TOPK; k++)
				if (c->other.ids[i][k] >= 0 && (uint32_t)c->other.ids[i][k] / c->per_rank == me) {
					hit = 1;
					c->ecount[c->other.ids[i][k]]++;
				}
			expect_total += hit;
		}
	}
	CHECK(cq->recv_tokens == expect_total, "rank %u step %u layer %u: received %u rows, expected %u",
	      me, step, layer, cq->recv_tokens, expect_total);
	CHECK(cq->n_experts == c->E, "rank %u: n_experts %u", me, cq->n_experts);
	const uint32_t *counts;
	if (c->E <= RW_CQE_INLINE_COUNTS) {
		CHECK(cq->n_inline == c->E && cq->counts_buf == RW_BUF_NONE, "rank %u: inline counts", me);
		counts = cq->counts;
	} else {
		CHECK(cq->n_inline == 0 && cq->counts_buf == t->buf && cq->counts_offset == c->off_out,
		      "rank %u: counts in the output (buf %u offset %llu)", me, cq->counts_buf,
		      (unsigned long long)cq->counts_offset);
		counts = (const uint32_t *)(const void *)(t->mem + cq->counts_offset);
	}
	for (uint32_t e = 0; e < c->E; e++)
		CHECK(counts[e] == c->ecount[e], "rank %u: expert %u count %u, expected %u", me, e,
		      counts[e], c->ecount[e]);
	uint64_t cbytes = c->E > RW_CQE_INLINE_COUNTS ? ((4ull * c->E + 15) & ~15ull) : 0;
	uint64_t meta_bytes = 16 + 8 * TOPK;
	uint64_t cap = (c->out_cap - cbytes) / (row + meta_bytes);
	const uint8_t *rows = t->mem + c->off_out + cbytes, *metas = rows + cap * row;
	for (uint32_t j = 0; j < cq->recv_tokens; j++) {
		const uint8_t *m = metas + j * meta_bytes;
		uint32_t src_node, src_rank, token, zero;
		memcpy(&src_node, m, 4);
		memcpy(&src_rank, m + 4, 4);
		memcpy(&token, m + 8, 4);
		memcpy(&zero, m + 12, 4);
		CHECK(src_rank < c->W && src_rank / c->G == src_node && zero == 0, "rank %u row %u: bad source", me, j);
		gen(c, step, layer, src_rank, &c->other);
		CHECK(token < c->other.n, "rank %u row %u: bad token %u", me, j, token);
		uint8_t *sn = &c->seen[src_rank * MAX_ROWS + token];
		CHECK(!*sn, "rank %u row %u: rank %u token %u delivered twice", me, j, src_rank, token);
		*sn = 1;
		CHECK(memcmp(m + 16, c->other.ids[token], TOPK * 4) == 0, "rank %u row %u: ids differ", me, j);
		CHECK(memcmp(m + 16 + 4 * TOPK, c->other.w[token], TOPK * 4) == 0, "rank %u row %u: weights differ", me, j);
		const float *xt = c->other.x + (size_t)token * c->hidden;
		for (uint32_t h = 0; h < c->hidden; h++)
			CHECK(get_elem(rows + (uint64_t)j * row, bf16, h) == xt[h],
			      "rank %u row %u (rank %u token %u): data differs at %u", me, j, src_rank, token, h);
		int mine = 0;
		for (uint32_t h = 0; h < c->hidden; h++)
			c->outv[h] = 0;
		for (uint32_t k = 0; k < TOPK; k++) {
			int32_t e = c->other.ids[token][k];
			if (e >= 0 && (uint32_t)e / c->per_rank == me) {
				mine = 1;
				for (uint32_t h = 0; h < c->hidden; h++)
					c->outv[h] += c->other.w[token][k] * factor(e) * xt[h];
			}
		}
		CHECK(mine, "rank %u row %u: rank %u token %u has no expert here", me, j, src_rank, token);
		put_row(c, t->mem + c->off_cin + (uint64_t)j * row, bf16, c->outv);
	}
	rank_push(c, t, c->off_cin, c->comb_in);
	t->dq = *cq;
}

static rw_sqe_t combine_sqe(cl_t *c, uint32_t r, uint32_t step, uint32_t layer)
{
	trank_t *t = &c->rk[r];
	rw_span_t none = { RW_BUF_NONE, 0, 0 };
	gen(c, step, layer, r, &c->mine);
	rw_sqe_t cs = { .kind = RW_KIND_COMBINE, .dtype = t->ds.dtype, .topk = TOPK, .layer = layer,
			.phase_id = t->ds.phase_id + 500, .step = step, .user_data = 8,
			.token_count = t->dq.recv_tokens, .hidden = c->hidden, .handle_id = t->dq.handle_id,
			.tokens = { t->buf, 0, c->off_cin }, .topk_ids = none, .topk_weights = none,
			.output = { t->buf, 0, c->off_cout }, .output_capacity = c->comb_out,
			.n_experts = (step + layer) % 2 ? c->E : 0 };
	if (t->dq.recv_tokens == 0 && (step + layer + r) % 2)
		cs.tokens = none;
	if (c->mine.n == 0 && (step + layer + r) % 2) {
		cs.output = none;
		cs.output_capacity = 0;
	}
	return cs;
}

static void combine_submit(cl_t *c, uint32_t r, uint32_t step, uint32_t layer)
{
	rw_sqe_t cs = combine_sqe(c, r, step, layer);
	fk_client_submit(c->rk[r].c, &cs);
}

static void combine_check(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const rw_cqe_t *cq)
{
	trank_t *t = &c->rk[r];
	int bf16 = phase_bf16(step, layer);
	uint32_t row = c->hidden * (bf16 ? 2 : 4);
	CHECK(cq->status == RW_CQ_OK, "rank %u step %u layer %u combine failed: error %d", r, step,
	      layer, cq->error);
	rank_pull(c, t, c->off_cout, c->comb_out);
	gen(c, step, layer, r, &c->mine);
	CHECK(cq->kind == RW_KIND_COMBINE && cq->phase_id == t->ds.phase_id + 500 && cq->user_data == 8,
	      "rank %u: combine completion ids", r);
	CHECK(cq->recv_tokens == c->mine.n && cq->handle_id == t->dq.handle_id,
	      "rank %u: combine returned %u rows, expected %u", r, cq->recv_tokens, c->mine.n);
	for (uint32_t i = 0; i < c->mine.n; i++)
		for (uint32_t h = 0; h < c->hidden; h++) {
			float ref = 0;
			for (uint32_t k = 0; k < TOPK; k++)
				if (c->mine.ids[i][k] >= 0)
					ref += c->mine.w[i][k] * factor(c->mine.ids[i][k]) *
					       c->mine.x[(size_t)i * c->hidden + h];
			float got = get_elem(t->mem + c->off_cout + (uint64_t)i * row, bf16, h);
			CHECK(got == ref, "rank %u step %u layer %u token %u elem %u: combine %g, expected %g",
			      r, step, layer, i, h, got, ref);
		}
}

/* A few network events between two submissions, so submissions interleave with the exchange. */
static void jiggle(cl_t *c, uint32_t salt)
{
	uint32_t n = (uint32_t)(mix(c->seed ^ salt) % 4);
	for (uint32_t i = 0; i < n; i++)
		pump_once(c);
}

/* Ranks in a seeded order. */
static void rank_order(cl_t *c, uint32_t salt, uint32_t *order)
{
	for (uint32_t i = 0; i < c->W; i++)
		order[i] = i;
	for (uint32_t i = c->W; i > 1; i--) {
		uint32_t j = (uint32_t)(mix(c->seed ^ salt ^ i) % i);
		uint32_t tmp = order[i - 1];
		order[i - 1] = order[j];
		order[j] = tmp;
	}
}

/* Every rank's dispatch completion, checked exactly. */
static void dispatch_collect(cl_t *c, uint32_t step, uint32_t layer)
{
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		dispatch_check(c, r, step, layer, &q);
	}
}

/* Every rank's combine, submitted and checked exactly. */
static void combine_all(cl_t *c, uint32_t step, uint32_t layer)
{
	for (uint32_t r = 0; r < c->W; r++)
		combine_submit(c, r, step, layer);
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		combine_check(c, r, step, layer, &q);
	}
}

/* Every rank dispatches and combines (step, layer); everything checked exactly. */
static void run_pair(cl_t *c, uint32_t step, uint32_t layer)
{
	uint32_t order[MAX_RANKS];
	rank_order(c, step * 131 + layer, order);
	for (uint32_t i = 0; i < c->W; i++) {
		dispatch_submit(c, order[i], step, layer, NULL);
		jiggle(c, step * 7 + layer * 3 + i);
	}
	dispatch_collect(c, step, layer);
	rank_order(c, step * 131 + layer + 77, order);
	for (uint32_t i = 0; i < c->W; i++) {
		combine_submit(c, order[i], step, layer);
		jiggle(c, step * 5 + layer + i * 11);
	}
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		combine_check(c, r, step, layer, &q);
	}
}

/* Dispatch of every rank of `ranks` (bitmask of global ranks), completions collected. */
static void dispatch_all(cl_t *c, uint32_t step, uint32_t layer)
{
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, step, layer, NULL);
	dispatch_collect(c, step, layer);
}


/* ---- after a failure ---------------------------------------------------------------------------- */

/* Every rank retries the failed key (step, layer) at once, as a trainer does once the failure
 * has reached every node: the retry must pass at once on every node, with no refusal and no
 * timer (a late PHASE_ERR of the failed attempt names that attempt - its cause, and the epoch of
 * the receiver's row it had - so it cannot fail or poison the retry; docs/dataflow.md
 * "Failures"). Everything is checked exactly. */
static void retry_key(cl_t *c, uint32_t step, uint32_t layer)
{
	settle(c);
	uint64_t timeouts[FK_MAX_NODES];
	for (uint32_t n = 0; n < c->N; n++)
		timeouts[n] = c->svc[n].metrics.errors[-RW_ERR_TIMEOUT];
	run_pair(c, step, layer);
	for (uint32_t n = 0; n < c->N; n++)
		CHECK(!c->running[n] || c->svc[n].metrics.errors[-RW_ERR_TIMEOUT] == timeouts[n],
		      "node %u: the retry of step %u layer %u timed out", n, step, layer);
}

/* Node n's process dies: peers see it down; its executor is torn down here. Its ranks are
 * dropped first, each failing its pair on its own: rw_svc_ipc_stop's loop over open pairs frees
 * a pair under itself (see test_bug_stop_with_open_pair), so a node is never stopped with a pair
 * open in the main group. */
static void node_crash(cl_t *c, uint32_t n)
{
	fk_kill(c->w, n);
	for (uint32_t g = 0; g < c->G; g++)
		fk_client_die(c->rk[n * c->G + g].c);
	node_stop(c, n);
}

/* No failure under test may have needed a phase timeout. */
static void expect_no_timeouts(cl_t *c)
{
	for (uint32_t n = 0; n < c->N; n++)
		if (c->running[n])
			CHECK(c->svc[n].metrics.errors[-RW_ERR_TIMEOUT] == 0, "node %u: a phase timed out", n);
}

/* ---- holding events back ------------------------------------------------------------------------ */

typedef struct match {
	int kind;                  /* fk_ev_kind_t or -1 */
	int type;                  /* control type or -1 */
	int src, dst;              /* -1: any */
	int wkind;                 /* writes: immediate kind 0/1, or -1 */
} match_t;

#define ANY -1
static match_t held[8];
static uint32_t n_held;

static int match_one(const match_t *m, const fk_ev_t *ev)
{
	return (m->kind < 0 || (int)ev->kind == m->kind) &&
	       (m->type < 0 || (ev->kind == FK_EV_CTRL && ev->type == m->type)) &&
	       (m->src < 0 || (int)ev->src == m->src) && (m->dst < 0 || (int)ev->dst == m->dst) &&
	       (m->wkind < 0 || (ev->kind == FK_EV_WRITE && (int)((ev->imm >> 17) & 1u) == m->wkind));
}

static int hold_fn(const fk_ev_t *ev, void *ctx)
{
	(void)ctx;
	for (uint32_t i = 0; i < n_held; i++)
		if (match_one(&held[i], ev))
			return 1;
	return 0;
}

static void hold(cl_t *c, match_t m)
{
	held[n_held++] = m;
	c->w->hold = hold_fn;
}

static void release_all(cl_t *c)
{
	n_held = 0;
	c->w->hold = NULL;
}

static match_t m_ctrl(int type, int src, int dst) { return (match_t){ FK_EV_CTRL, type, src, dst, -1 }; }
static match_t m_write(int src, int dst, int wkind) { return (match_t){ FK_EV_WRITE, -1, src, dst, wkind }; }
static match_t m_wdone(int src) { return (match_t){ FK_EV_WDONE, -1, src, -1, -1 }; }

/* ================================================================================================
 * Paths
 * ================================================================================================ */

static const char *const path_names[] = { "native", "rail-only", "perm-only", "joint", "auto" };

/* Every forced path and the selector over several layers and steps (fp32/bf16 alternating),
 * with empty phases; the forced path shows in the metrics; the waved paths keep one wave source
 * at a time at every receiver (wave_fanin_max 1). */
static void paths_case(uint32_t N, uint32_t G, uint32_t R, uint32_t experts, int empty, uint64_t salt)
{
	for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names); pi++) {
		opts_t o = { .nodes = N, .gpus = G, .rails = R, .path = path_names[pi], .experts = experts,
			     .empty = empty };
		cl_t *c = cl_new(&o, salt * 16 + pi);
		for (uint32_t step = 0; step < 2; step++)
			for (uint32_t layer = 0; layer < 3; layer++)
				run_pair(c, step, layer);
		for (uint32_t n = 0; n < N; n++) {
			const rw_svc_metrics_t *m = &c->svc[n].metrics;
			uint64_t ok = 0;
			for (uint32_t p = 0; p < RW_PATH_COUNT; p++)
				ok += m->phase[p][RW_SVC_DISPATCH].ok;
			CHECK(ok == 6, "node %u: %llu dispatches ok", n, (unsigned long long)ok);
			if (pi < RW_PATH_COUNT) /* forced: every phase on that path, said so */
				CHECK(m->phase[pi][RW_SVC_DISPATCH].ok == 6 && m->phase[pi][RW_SVC_COMBINE].ok == 6 &&
				      m->selected[pi][RW_SELECT_FORCED] == 6,
				      "node %u: path %s not used for every phase", n, path_names[pi]);
			else /* the selector without an anchor table: Joint, or Native when nothing is remote */
				CHECK(m->selected[RW_PATH_JOINT][RW_SELECT_NO_TABLE] +
				      m->selected[RW_PATH_NATIVE][RW_SELECT_NO_REMOTE] == 6,
				      "node %u: the selector chose otherwise", n);
			if (pi < RW_PATH_COUNT && rw_path_waved((rw_path_t)pi) && N > 2 && !empty)
				CHECK(m->wave_fanin_max == 1, "node %u: wave_fanin_max %u under the receiver gate",
				      n, m->wave_fanin_max);
		}
		cl_free(c);
	}
}

static void test_paths_n2(void **state)
{
	(void)state;
	paths_case(2, 2, 2, 0, 1, 1);
	paths_case(2, 1, 1, 0, 0, 2);
}

static void test_paths_n3(void **state)
{
	(void)state;
	paths_case(3, 2, 2, 0, 0, 3);
	paths_case(3, 1, 2, 24, 1, 4); /* E > 16: counts in the output buffer */
}

static void test_paths_n4(void **state)
{
	(void)state;
	paths_case(4, 2, 2, 0, 0, 5);
	paths_case(4, 2, 1, 32, 1, 6);
}

/* The selector with an anchor table (DESIGN §4.5): one anchor that every phase is near (huge
 * size ratio, shape tolerance 1) selects Perm-only, so every phase with remote data runs on it
 * (reason "anchor"), identically on every node, and checks exactly. */
static void test_selector_anchor(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "auto" };
	cl_t *c = cl_new(&o, 60);
	rw_anchor_t anchor = { .case_id = 7, .feat = { 10.0, 0.5, 0.5 }, .selected = RW_PATH_PERM_ONLY };
	rw_anchor_table_t table = { .schema_version = RW_ANCHOR_SCHEMA, .max_size_ratio = 1e12,
				    .shape_tolerance = 1.0, .n_anchors = 1, .anchors = &anchor };
	for (uint32_t n = 0; n < c->N; n++)
		c->svc[n].anchors = &table;
	for (uint32_t layer = 0; layer < 4; layer++)
		run_pair(c, 0, layer);
	for (uint32_t n = 0; n < c->N; n++) {
		const rw_svc_metrics_t *m = &c->svc[n].metrics;
		CHECK(m->selected[RW_PATH_PERM_ONLY][RW_SELECT_ANCHOR] >= 1 &&
		      m->selected[RW_PATH_PERM_ONLY][RW_SELECT_ANCHOR] +
		      m->selected[RW_PATH_NATIVE][RW_SELECT_NO_REMOTE] == 4 &&
		      m->phase[RW_PATH_PERM_ONLY][RW_SVC_COMBINE].ok == m->selected[RW_PATH_PERM_ONLY][RW_SELECT_ANCHOR],
		      "node %u: the anchor's path was not used", n);
		c->svc[n].anchors = NULL;
	}
	cl_free(c);
}

/* A dispatch's tokens are counted in idle slices, so a limit-sized submission cannot hold the
 * loop (issue 15 point 5): with one token per slice, the last local rank's submission and a few
 * loop iterations do not yet send the node's count row (the old executor counted inside the
 * submission call and sent it at once); it goes once every token is counted, and the phase's
 * results are exact. */
static int row_sent_0_1(cl_t *c, const void *arg)
{
	(void)arg;
	return c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] > 0;
}

static void test_count_sliced(void **state)
{
	(void)state;
	setenv("RAILWAVE_TEST_LOCAL_SLICE", "1", 1);
	opts_t o = { .nodes = 2, .gpus = 2, .path = "rail-only", .tokens = 24 };
	cl_t *c = cl_new(&o, 906);
	for (uint32_t r = 0; r < c->G; r++) /* node 0's ranks */
		dispatch_submit(c, r, 0, 0, NULL);
	for (int i = 0; i < 4; i++)
		ev_run(c->loop, EVRUN_NOWAIT);
	CHECK(c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] == 0,
	      "node 0 sent its count row before its tokens were counted slice by slice");
	unsetenv("RAILWAVE_TEST_LOCAL_SLICE"); /* read at node start: the nodes keep 1 */
	pump_until(c, row_sent_0_1, NULL, "node 0's count row");
	CHECK(c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] == 1, "node 0 sent its count row twice");
	for (uint32_t r = c->G; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* The count row leaves before the records are built (issue 11): with one token per idle slice,
 * the row goes to the peer as soon as the count pass is done and the records pass runs after it.
 * The observable is the records pass itself: rank 0's ids, changed right after the row was
 * posted, are what the records pass reads, and it refuses the ids that no longer give the counted
 * records - fewer (every id dropped: the count row's segments are not filled), or more (every
 * token also sent to node 1, which the row said got nothing from it) - naming that in the ranks'
 * notices. Were the records built before the row left, the change would come too late for them.
 * Every rank fails; the same key then passes. */
static int row_posted_0_1(cl_t *c, const void *arg)
{
	return c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] > *(const uint32_t *)arg;
}

static void test_row_before_records(void **state)
{
	(void)state;
	setenv("RAILWAVE_TEST_LOCAL_SLICE", "1", 1);
	opts_t o = { .nodes = 2, .gpus = 2, .rails = 2, .path = "native", .tokens = 24, .fifo = 1 };
	cl_t *c = cl_new(&o, 907);
	unsetenv("RAILWAVE_TEST_LOCAL_SLICE"); /* read at node start: the nodes keep 1 */
	const char *want[2] = { "fewer records", "more records" };
	for (uint32_t layer = 0; layer < 2; layer++) {
		sub_opts_t home = { .local_only = 1 };
		uint32_t before = c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1];
		for (uint32_t r = 0; r < c->G; r++) /* node 0's ranks */
			dispatch_submit(c, r, 0, layer, layer ? &home : NULL);
		pump_until(c, row_posted_0_1, &before, "node 0's count row");
		trank_t *t = &c->rk[0];
		for (uint32_t i = 0; i < c->o.tokens; i++) {
			int32_t ids[TOPK] = { -1, -1, -1, -1 };
			if (layer) { /* node 0 and node 1 */
				ids[0] = (int32_t)(i % (c->E / 2));
				ids[1] = (int32_t)(c->E / 2 + i % (c->E / 2));
			}
			memcpy(t->mem + c->off_ids + (uint64_t)i * TOPK * 4, ids, sizeof(ids));
		}
		for (uint32_t r = c->G; r < c->W; r++)
			dispatch_submit(c, r, 0, layer, NULL);
		for (uint32_t r = 0; r < c->W; r++) {
			rw_cqe_t q = next_cqe(c, r);
			CHECK(q.status == RW_CQ_ERROR, "layer %u: rank %u's dispatch passed", layer, r);
			if (r < c->G)
				CHECK(strstr(fk_client_notice(c->rk[r].c), want[layer]),
				      "layer %u: rank %u was told '%s', not that the ids give %s", layer, r,
				      fk_client_notice(c->rk[r].c), want[layer]);
		}
		expect_no_timeouts(c);
		retry_key(c, 0, layer);
	}
	CHECK(c->svc[0].metrics.counts_host == 4 && c->svc[0].metrics.counts_gpu == 0,
	      "node 0 counted %llu rows on the host, %llu on a GPU", (unsigned long long)
	      c->svc[0].metrics.counts_host, (unsigned long long)c->svc[0].metrics.counts_gpu);
	cl_free(c);
}

/* Slabs cut into many writes (1 KiB each), local work one record per idle slice... the same
 * exact results (the executor's resumable send loop and chunking). */
/* A rail device that names no largest write (max_write_length 0): the executor writes in its own
 * largest pieces (EXEC_CHUNK_MAX) instead of dividing by zero, on every path. */
static void test_paths_no_write_limit(void **state)
{
	(void)state;
	for (uint32_t pi = 0; pi < RW_PATH_COUNT; pi++) {
		opts_t o = { .nodes = 3, .path = path_names[pi], .tokens = 40 };
		cl_t *c = cl_new(&o, 60 + pi);
		c->w->max_write = 0;
		run_pair(c, 0, 0);
		run_pair(c, 0, 1);
		cl_free(c);
	}
}

static void test_paths_small_writes(void **state)
{
	(void)state;
	setenv("RAILWAVE_TEST_LOCAL_SLICE", "1", 1);
	for (uint32_t pi = 0; pi < RW_PATH_COUNT; pi++) {
		opts_t o = { .nodes = 3, .gpus = 2, .rails = 2, .path = path_names[pi], .max_write = 1024 };
		cl_t *c = cl_new(&o, 40 + pi);
		run_pair(c, 0, 0);
		run_pair(c, 0, 1);
		cl_free(c);
	}
	unsetenv("RAILWAVE_TEST_LOCAL_SLICE");
}

/* ================================================================================================
 * The receiver gate of the waved paths
 * ================================================================================================ */

/* Records (tokens with an expert there) from node s to node d in (step, layer). */
static uint32_t flow(cl_t *c, uint32_t step, uint32_t layer, uint32_t s, uint32_t d)
{
	uint32_t n = 0;
	for (uint32_t g = 0; g < c->G; g++) {
		gen(c, step, layer, s * c->G + g, &c->other);
		for (uint32_t t = 0; t < c->other.n; t++) {
			int hit = 0;
			for (uint32_t k = 0; k < TOPK; k++)
				hit |= c->other.ids[t][k] >= 0 &&
				       (uint32_t)c->other.ids[t][k] / c->per_rank / c->G == d;
			n += hit;
		}
	}
	return n;
}

/* docs/dataflow.md "Send": s waits for wave k's grant when it has data for d = s + k and some
 * earlier wave brings d data. */
static int needs_grant(cl_t *c, uint32_t step, uint32_t layer, uint32_t k, uint32_t s)
{
	uint32_t n = c->N, d = (s + k) % n;
	if (k < 2 || !flow(c, step, layer, s, d))
		return 0;
	for (uint32_t j = 1; j < k; j++)
		if (flow(c, step, layer, (d + n - j) % n, d))
			return 1;
	return 0;
}

/* With every GRANT held back, no sender posts a wave that needs one: each stops at its first
 * gated wave, having posted the waves before it; released, every rank verifies. */
static void grants_case(const char *path, uint32_t N, uint64_t salt)
{
	opts_t o = { .nodes = N, .gpus = 2, .rails = 2, .path = path, .tokens = 24 };
	cl_t *c = cl_new(&o, salt);
	hold(c, m_ctrl(RW_WIRE_GRANT, ANY, ANY));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	uint32_t gated = 0;
	for (uint32_t s = 0; s < N; s++) {
		int blocked = 0;
		for (uint32_t k = 1; k < N; k++) {
			uint32_t d = (s + k) % N;
			blocked |= needs_grant(c, 0, 0, k, s);
			uint32_t posted = c->w->cnt.writes[0][s][d];
			if (blocked)
				CHECK(posted == 0, "%s N=%u: node %u wrote wave %u (to %u) without its grant", path, N, s, k, d);
			else
				CHECK(posted > 0 || !flow(c, 0, 0, s, d), "%s N=%u: node %u did not post ungated wave %u",
				      path, N, s, k);
		}
		gated += blocked;
		/* the grants themselves were sent (and are held) */
	}
	CHECK(gated > 0, "%s N=%u: the workload gates no wave", path, N);
	uint32_t grants = 0;
	for (uint32_t a = 0; a < N; a++)
		for (uint32_t b = 0; b < N; b++)
			grants += c->w->cnt.ctrl_posted[RW_WIRE_GRANT][a][b];
	CHECK(grants > 0, "%s N=%u: no grant was sent", path, N);
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	release_all(c);
	dispatch_collect(c, 0, 0);
	/* Combine is gated the same way (flows reversed). */
	hold(c, m_ctrl(RW_WIRE_GRANT, ANY, ANY));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = 0; r < c->W; r++)
		combine_submit(c, r, 0, 0);
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	uint32_t cgrants = 0;
	for (uint32_t a = 0; a < N; a++)
		for (uint32_t b = 0; b < N; b++)
			cgrants += c->w->cnt.ctrl_posted[RW_WIRE_GRANT][a][b];
	CHECK(cgrants > 0, "%s N=%u: no combine grant", path, N);
	release_all(c);
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		combine_check(c, r, 0, 0, &q);
	}
	for (uint32_t n = 0; n < N; n++)
		CHECK(c->svc[n].metrics.wave_fanin_max == 1, "node %u: wave_fanin_max %u", n,
		      c->svc[n].metrics.wave_fanin_max);
	run_pair(c, 1, 0);
	cl_free(c);
}

static void test_grants_held(void **state)
{
	(void)state;
	grants_case("perm-only", 3, 100);
	grants_case("perm-only", 4, 101);
	grants_case("joint", 4, 102);
}

/* A grant that arrives before the sender got to that wave is kept: node 0's write completions
 * are held, so its wave-1 writes stay outstanding while its wave-2 destination grants; then the
 * completions go and node 0 posts wave 2 on the kept grant. */
static void test_grant_before_wave(void **state)
{
	(void)state;
	opts_t o = { .nodes = 4, .gpus = 2, .rails = 2, .path = "perm-only", .tokens = 24 };
	cl_t *c = cl_new(&o, 103);
	hold(c, m_wdone(0));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(needs_grant(c, 0, 0, 2, 0), "workload: node 0's wave 2 is not gated");
	CHECK(c->w->cnt.ctrl_delivered[RW_WIRE_GRANT][2][0] == 1, "node 2 did not grant node 0 wave 2 yet (%u)",
	      c->w->cnt.ctrl_delivered[RW_WIRE_GRANT][2][0]);
	CHECK(c->w->cnt.writes[0][0][1] > 0 && c->w->cnt.writes[0][0][2] == 0,
	      "node 0 posted wave 2 before its wave-1 writes completed");
	release_all(c);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* A sender waiting for a grant is an open phase like any other: the grantor dies and the ranks
 * of every survivor still in the dispatch fail at once (no timeout); a node whose dispatch had
 * completed (it needed none of the held grants) loses its pair while waiting for the combine
 * (its ranks' combines find no handle). The same key then passes with the node back. */
static void test_grant_wait_peer_lost(void **state)
{
	(void)state;
	opts_t o = { .nodes = 4, .path = "joint", .tokens = 24 };
	cl_t *c = cl_new(&o, 104);
	hold(c, m_ctrl(RW_WIRE_GRANT, 2, ANY));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(needs_grant(c, 0, 0, 2, 0) && c->w->cnt.writes[0][0][2] == 0,
	      "node 0 is not waiting for node 2's grant");
	int done[MAX_RANKS] = { 0 };
	for (uint32_t r = 0; r < c->W; r++)
		if (n_cqe(&c->rk[r]) > c->rk[r].seen) {
			rw_cqe_t q = next_cqe(c, r);
			dispatch_check(c, r, 0, 0, &q);
			done[r] = 1;
		}
	CHECK(!done[0], "node 0 completed without its grant");
	node_crash(c, 2);
	release_all(c);
	for (uint32_t r = 0; r < c->W; r++)
		if (r / c->G != 2 && !done[r])
			expect_err(c, r, RW_E_PHASE, "the grantor died");
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		if (r / c->G != 2 && done[r]) {
			combine_submit(c, r, 0, 0); /* its pair failed while it computed */
			expect_err_now(c, r, RW_E_PHASE, "combine after the peer died");
		}
	expect_no_timeouts(c);
	node_start(c, 2);
	pump_until(c, mesh_up, NULL, "node 2 back");
	node_ranks_connect(c, 2);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * Count rows: early and late
 * ================================================================================================ */

/* Nodes 1 and 2's rows reach node 0 before any of node 0's ranks submit (kept as early rows);
 * then node 0's ranks come and the phase completes exactly. */
static void test_rows_early(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "joint" };
	cl_t *c = cl_new(&o, 200);
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = c->G; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(c->w->cnt.ctrl_delivered[RW_WIRE_COUNTS][1][0] == 1 &&
	      c->w->cnt.ctrl_delivered[RW_WIRE_COUNTS][2][0] == 1, "rows did not reach node 0 early");
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	for (uint32_t r = 0; r < c->G; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* Node 2's row reaches node 0 last: node 0 posts nothing until it has it (it cannot decide),
 * while node 1, which has every row, already writes. */
static void test_rows_late(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "native", .tokens = 12 };
	cl_t *c = cl_new(&o, 201);
	hold(c, m_ctrl(RW_WIRE_COUNTS, 2, 0));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(c->w->cnt.writes[0][0][1] == 0 && c->w->cnt.writes[0][0][2] == 0,
	      "node 0 wrote before it had every row");
	CHECK(c->w->cnt.writes[0][1][0] > 0, "node 1 (every row in) did not write");
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	release_all(c);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* Writes that come before the receiver has every row (it cannot know the layout yet) are
 * counted and taken once it decides: node 0 gets node 1's data before node 2's row. */
static void test_data_before_layout(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "rail-only", .tokens = 12 };
	cl_t *c = cl_new(&o, 202);
	hold(c, m_ctrl(RW_WIRE_COUNTS, 2, 0));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(c->w->cnt.writes[0][1][0] > 0, "node 1 wrote nothing to node 0");
	release_all(c);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * Failures: tombstones, timeouts, same-key retry, relayed PHASE_ERR
 * ================================================================================================ */

/* Node 1's ranks never come: node 0's phase times out (RW_E_PHASE), PHASE_ERR tells node 1,
 * which has no pair and keeps a tombstone: its ranks, submitting that key later, fail at once
 * (inside the submission). Then every rank retries the same key at once and it passes. */
static void test_timeout_tombstone_retry(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native", .timeout_ms = 1000 };
	cl_t *c = cl_new(&o, 300);
	for (uint32_t r = 0; r < c->G; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	for (uint32_t r = 0; r < c->G; r++)
		expect_err(c, r, RW_E_PHASE, "timeout");
	settle(c);
	for (uint32_t r = c->G; r < c->W; r++) {
		dispatch_submit(c, r, 0, 0, NULL);
		expect_err_now(c, r, RW_E_PHASE, "tombstone");
	}
	run_pair(c, 0, 0); /* the same key */
	run_pair(c, 0, 1);
	cl_free(c);
}

/* A count row lost on the way (the fake drops it): node 0 waits in the exchange until its phase
 * timeout, fails the phase (RW_E_PHASE) and tells the others, which had every row and were
 * already moving data; the key then passes. */
static int is_counts_1_0(const fk_ev_t *ev, void *ctx)
{
	(void)ctx;
	return ev->kind == FK_EV_CTRL && ev->type == RW_WIRE_COUNTS && ev->src == 1 && ev->dst == 0;
}

static void test_timeout_lost_row(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "joint", .timeout_ms = 1000, .fifo = 1 };
	cl_t *c = cl_new(&o, 305);
	hold(c, m_ctrl(RW_WIRE_COUNTS, 1, 0));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(fk_drop(c->w, is_counts_1_0, NULL) == 1, "node 1's row to node 0 was not queued");
	release_all(c);
	for (uint32_t r = 0; r < c->W; r++)
		expect_err(c, r, RW_E_PHASE, "a lost count row");
	CHECK(c->svc[0].metrics.errors[-RW_ERR_TIMEOUT] == 1, "node 0 did not fail by its timeout");
	retry_key(c, 0, 0);
	cl_free(c);
}

/* Both nodes time out on their own (integration "timeout" on a loaded machine): node 1 waits in
 * its gather for a local rank that never submits (node 0's row waits there as an early row),
 * node 0 waits for node 1's row, and both PHASE_ERRs are held until both have failed. Node 1's
 * report must name node 0's attempt by the epoch of that early row ("Failures" 5): with 0 ("no
 * row"), node 0 cannot tell it from a failure of a retry and plants a tomb that fails its
 * ranks' retries at once. Then every rank retries the key at once (retry_key). */
static void test_timeout_both_sides(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native", .timeout_ms = 1000 };
	cl_t *c = cl_new(&o, 307);
	hold(c, m_ctrl(RW_WIRE_PHASE_ERR, ANY, ANY));
	for (uint32_t r = 0; r < c->G + 1; r++) /* node 1's second rank never comes */
		dispatch_submit(c, r, 0, 0, NULL);
	for (uint32_t r = 0; r < c->G + 1; r++)
		expect_err(c, r, RW_E_PHASE, "both sides' timeouts");
	CHECK(c->svc[0].metrics.errors[-RW_ERR_TIMEOUT] == 1 &&
	      c->svc[1].metrics.errors[-RW_ERR_TIMEOUT] == 1, "each node did not time out on its own");
	dispatch_submit(c, c->G + 1, 0, 0, NULL); /* late: node 1's tomb answers it */
	expect_err_now(c, c->G + 1, RW_E_PHASE, "node 1's tombstone");
	release_all(c);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* A timeout in the combine: node 1's ranks dispatch but never combine. */
static void test_timeout_combine(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "joint", .timeout_ms = 1000 };
	cl_t *c = cl_new(&o, 301);
	dispatch_all(c, 0, 0);
	for (uint32_t r = 0; r < c->G; r++)
		combine_submit(c, r, 0, 0);
	for (uint32_t r = 0; r < c->G; r++)
		expect_err(c, r, RW_E_PHASE, "combine timeout");
	settle(c);
	/* node 1's pair failed by node 0's PHASE_ERR while its ranks computed: their combines get
	 * the phase's error at once, with node 0's reason */
	for (uint32_t r = c->G; r < c->W; r++) {
		combine_submit(c, r, 0, 0);
		expect_err_now(c, r, RW_E_PHASE, "combine after the peer failed it");
		CHECK(strstr(fk_client_notice(c->rk[r].c), "timed out"),
		      "rank %u was not told why: '%s'", r, fk_client_notice(c->rk[r].c));
	}
	run_pair(c, 0, 0);
	cl_free(c);
}

/* Nodes 0 and 1 dispatch and exchange rows; node 2's PHASE_ERR (or node 1's, `held_src`) to
 * node 0 is held; node 2's first rank gives a bad E and is refused at once, and the failure
 * reaches every rank of nodes 0 and 1; node 2's other rank then hits the tombstone. */
static void node2_refuses(cl_t *c, uint32_t held_src, const char *how)
{
	for (uint32_t r = 0; r < 2 * c->G; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c); /* nodes 0 and 1 exchanged rows, wait for node 2 */
	hold(c, m_ctrl(RW_WIRE_PHASE_ERR, (int)held_src, 0));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	sub_opts_t bad = { .n_experts = c->E + 1 };
	dispatch_submit(c, 2 * c->G, 0, 0, &bad);
	expect_err_now(c, 2 * c->G, RW_E_EXPERTS, "E not a multiple of W");
	for (uint32_t r = 0; r < 2 * c->G; r++)
		expect_err(c, r, RW_E_PHASE, how);
	dispatch_submit(c, 2 * c->G + 1, 0, 0, NULL);
	expect_err_now(c, 2 * c->G + 1, RW_E_PHASE, "node 2's tombstone");
}

/* The relayed PHASE_ERR (docs/dataflow.md "Failures" 2): node 2 refuses a rank's E and tells
 * nodes 0 and 1 (origin, no pair: a fresh cause id); its message to node 0 is held, so node 0
 * fails only by node 1's relay, which names node 1's row that node 0 took. Node 2's other rank
 * hits the tombstone. Then node 2's origin reaches node 0, which has no pair, and every rank
 * retries the key at once (retry_key: no refusal, no timeout). Issue 15 point 6: before failures
 * carried their cause ("Failures" 4), node 0 could not tell that origin from a failure of a new
 * attempt and planted a tomb no rank would answer: its ranks' retries failed at once without
 * telling anyone and nodes 1 and 2 waited for their phase timeout. */
static void test_relay_fails_taker(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "native", .fifo = 1 };
	cl_t *c = cl_new(&o, 302);
	node2_refuses(c, 2, "failed by the relay");
	CHECK(c->w->cnt.ctrl_delivered[RW_WIRE_PHASE_ERR][2][0] == 0, "the origin reached node 0");
	CHECK(c->w->cnt.ctrl_posted[RW_WIRE_PHASE_ERR][1][0] == 1, "node 1 relayed %u times",
	      c->w->cnt.ctrl_posted[RW_WIRE_PHASE_ERR][1][0]);
	expect_no_timeouts(c);
	release_all(c);
	retry_key(c, 0, 0);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* A relay about an attempt that a node has already left does not fail its retry: node 0 fails by
 * node 2's origin; node 1's relay to node 0 is held while everyone retries the key; released,
 * it is recognised as the dead attempt's and the retry completes. */
static void test_relay_spares_retry(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "joint", .fifo = 1 };
	cl_t *c = cl_new(&o, 303);
	node2_refuses(c, 1, "failed by the origin");
	/* everyone retries the key while node 1's relay to node 0 is still held */
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	release_all(c);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* A PHASE_ERR for a key no pair has yet leaves a tombstone: each local rank's first dispatch of
 * that key fails at once; its next one runs. (A peer can poison a key this way; peers are
 * trusted today.) Also a PHASE_ERR for a combine kind with no pair does nothing. */
static void test_phase_err_before_pair(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native" };
	cl_t *c = cl_new(&o, 304);
	rw_wire_phase_err_t e = { .key = { .group = rw_wire_group_hash(c->group), .layer = 3, .step = 9 },
				  .kind = 0, .status = RW_ERR_INVAL, .node = 1, .epoch = 5,
				  .cause_node = 1, .cause_id = 5 };
	snprintf(e.msg, sizeof(e.msg), "injected");
	uint8_t buf[RW_WIRE_PHASE_ERR_SIZE];
	size_t n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
	assert_int_equal(rw_svc_mesh_send(fk_mesh(1), 0, RW_WIRE_PHASE_ERR, buf, (uint32_t)n), RW_OK);
	e.key.layer = 4;
	e.kind = 1;
	n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
	assert_int_equal(rw_svc_mesh_send(fk_mesh(1), 0, RW_WIRE_PHASE_ERR, buf, (uint32_t)n), RW_OK);
	settle(c);
	for (uint32_t r = 0; r < c->G; r++) {
		dispatch_submit(c, r, 9, 3, NULL);
		expect_err_now(c, r, RW_E_PHASE, "tombstone of an injected PHASE_ERR");
	}
	run_pair(c, 9, 3);
	run_pair(c, 9, 4);
	cl_free(c);
}

/* ================================================================================================
 * Bad input
 * ================================================================================================ */

/* Expert id out of range: RW_E_TOKENS to that rank, RW_E_PHASE to the others on every node. */
static void test_bad_expert_id(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "auto", .tokens = 8 };
	cl_t *c = cl_new(&o, 400);
	for (uint32_t r = 0; r < c->W; r++) {
		sub_opts_t bad = { .bad_id = (int32_t)c->E };
		dispatch_submit(c, r, 0, 0, r == 3 ? &bad : NULL);
	}
	for (uint32_t r = 0; r < c->W; r++)
		expect_err(c, r, r == 3 ? RW_E_TOKENS : RW_E_PHASE, "expert id out of range");
	expect_no_timeouts(c);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* n_experts: not a multiple of W (the rank, at once), differing between local ranks (the second
 * one), differing between nodes (every rank, RW_E_EXPERTS, decided on each node); each time every
 * other rank fails at once, and the same key then passes. */
static void test_bad_experts(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "perm-only", .fifo = 1 };
	cl_t *c = cl_new(&o, 401);
	/* not a multiple of W */
	sub_opts_t bad = { .n_experts = c->E + 1 };
	dispatch_submit(c, 0, 0, 0, &bad);
	expect_err_now(c, 0, RW_E_EXPERTS, "E not a multiple");
	for (uint32_t r = 1; r < c->W; r++) {
		dispatch_submit(c, r, 0, 0, NULL);
		expect_err(c, r, RW_E_PHASE, "E not a multiple (others)");
	}
	run_pair(c, 0, 0);
	/* local ranks disagree */
	sub_opts_t other = { .n_experts = 2 * c->E };
	dispatch_submit(c, 0, 0, 1, NULL);
	dispatch_submit(c, 1, 0, 1, &other);
	expect_err_now(c, 1, RW_E_EXPERTS, "local ranks disagree on E");
	expect_err(c, 0, RW_E_PHASE, "local ranks disagree on E (the other)");
	for (uint32_t r = 2; r < c->W; r++) {
		dispatch_submit(c, r, 0, 1, NULL);
		expect_err(c, r, RW_E_PHASE, "local ranks disagree on E (node 1)");
	}
	run_pair(c, 0, 1);
	/* nodes disagree: every node fails it itself */
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 2, r >= c->G ? &other : NULL);
	for (uint32_t r = 0; r < c->W; r++)
		expect_err(c, r, RW_E_EXPERTS, "nodes disagree on E");
	run_pair(c, 0, 2);
	cl_free(c);
}

/* Unknown buffer, unknown dtype, an output too small, unknown kind; combine with a wrong handle,
 * a wrong row count, twice; a dispatch of another key while a phase runs. Each is refused with
 * its own code, the others keep going, and the next phases pass. */
static void test_bad_submissions(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "rail-only", .tokens = 10 };
	cl_t *c = cl_new(&o, 402);
	/* unknown buffer: refused at the IPC boundary (ipc/server.c's entry check, which the fake
	 * server runs too) before the executor sees it; the rank submits again and the phase runs */
	sub_opts_t nobuf = { .tokens_buf = 999 };
	dispatch_submit(c, 1, 0, 0, &nobuf);
	expect_err_now(c, 1, RW_E_BUF_ID, "unknown buffer");
	run_pair(c, 0, 0);
	/* unknown dtype: only that submission is refused; the rank submits again and it runs */
	sub_opts_t fp16 = { .dtype = RW_DTYPE_FP16 };
	dispatch_submit(c, 2, 0, 1, &fp16);
	expect_err_now(c, 2, RW_E_DTYPE, "fp16");
	/* a combine before its dispatch completed: no handle yet */
	rw_sqe_t early = combine_sqe(c, 3, 0, 1);
	fk_client_submit(c->rk[3].c, &early);
	expect_err_now(c, 3, RW_E_HANDLE, "combine before any dispatch");
	/* unknown kind */
	rw_sqe_t k = c->rk[2].ds;
	k.kind = 9;
	fk_client_submit(c->rk[2].c, &k);
	expect_err_now(c, 2, RW_E_KIND, "kind 9");
	run_pair(c, 0, 1);
	/* combine: wrong handle, wrong row count, twice */
	dispatch_all(c, 0, 2);
	rw_sqe_t cs = combine_sqe(c, 0, 0, 2);
	cs.handle_id ^= 0x5555;
	fk_client_submit(c->rk[0].c, &cs);
	expect_err_now(c, 0, RW_E_HANDLE, "wrong handle");
	cs = combine_sqe(c, 0, 0, 2);
	cs.token_count += 1;
	fk_client_submit(c->rk[0].c, &cs);
	expect_err_now(c, 0, RW_E_TOKENS, "wrong row count");
	cs = combine_sqe(c, 0, 0, 2);
	cs.n_experts = c->E * 2;
	fk_client_submit(c->rk[0].c, &cs);
	expect_err_now(c, 0, RW_E_EXPERTS, "combine with another E");
	combine_submit(c, 0, 0, 2);
	combine_submit(c, 0, 0, 2);
	expect_err_now(c, 0, RW_E_STATE, "combine twice");
	/* a dispatch of another key while the pair runs */
	dispatch_submit(c, 1, 5, 5, NULL);
	expect_err_now(c, 1, RW_E_STATE, "another key mid-pair");
	for (uint32_t r = 1; r < c->W; r++)
		combine_submit(c, r, 0, 2);
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		combine_check(c, r, 0, 2, &q);
	}
	/* output too small for what arrives: RW_E_RANGE on that node, RW_E_PHASE on the peer */
	sub_opts_t small = { .output_capacity = 200 };
	/* node 0 decides before node 1's rows come, and keeps writes outstanding until the
	 * overflow (otherwise: test_bug_output_full_writes_done, test_bug_bad_record_before_layout) */
	hold(c, m_write(1, 0, 0));
	hold(c, m_wdone(ANY));
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 1, 0, r == 0 ? &small : NULL);
	settle(c);
	CHECK(c->w->cnt.writes[0][0][1] > 0, "node 0 did not decide");
	release_all(c);
	hold(c, m_wdone(ANY));
	for (uint32_t r = 0; r < c->W; r++)
		expect_err(c, r, r < c->G ? RW_E_RANGE : RW_E_PHASE, "output too small");
	release_all(c);
	run_pair(c, 1, 0);
	/* a new key after a dispatch whose combine never came: the trainer moved on */
	dispatch_all(c, 1, 1);
	run_pair(c, 1, 2);
	cl_free(c);
}

/* Ranks that do not fit: a world size other than N*G, a node other than this one, a rank twice. */
static void test_bad_ranks(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native" };
	cl_t *c = cl_new(&o, 403);
	fk_client_stats_t s;
	rw_ipc_client_t *wrong = fk_client_new(c->w, 0, "g.other", 0, c->W + 2, 0);
	fk_client_join(wrong);
	rw_ipc_client_t *far = fk_client_new(c->w, 0, "g.other", c->G, c->W, 0); /* node 1's rank */
	fk_client_join(far);
	rw_ipc_client_t *dup = fk_client_new(c->w, 0, c->group, 1, c->W, 1);
	fk_client_join(dup);
	settle(c);
	fk_client_stats(wrong, &s);
	CHECK(s.left && s.dropped && s.drop_error == RW_E_WORLD_MISMATCH, "world mismatch: dropped %d error %d",
	      s.dropped, s.drop_error);
	fk_client_stats(far, &s);
	CHECK(s.left && s.dropped && s.drop_error == RW_E_WORLD_MISMATCH, "rank of another node: error %d",
	      s.drop_error);
	fk_client_stats(dup, &s);
	CHECK(s.left && s.dropped && s.drop_error == RW_E_RANK_DUP, "duplicate rank: error %d", s.drop_error);
	run_pair(c, 0, 0);
	cl_free(c);
}

/* A peer's bad data: a dispatch record whose header names another phase. The receiver declares
 * that peer down (protocol error) and fails the phase; the peer sees the link drop and fails it
 * too; the link comes back and the same key passes. Then a write whose immediate names another
 * rail, and a grant from a node that is not that wave's destination: same. */
static int corrupt_once;
static void corrupt_tag(const fk_ev_t *ev, uint8_t *dst, void *ctx)
{
	(void)ctx;
	if (corrupt_once && ev->src == 1 && ev->dst == 0 && ((ev->imm >> 17) & 1u) == 0) {
		corrupt_once = 0;
		dst[0] ^= 0xff; /* the first record's tag */
	}
}

static void test_peer_bad_data(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native", .tokens = 16 };
	cl_t *c = cl_new(&o, 404);
	corrupt_once = 1;
	c->w->on_write = corrupt_tag;
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	/* The bad record arrives after node 0 decided (before: test_bug_bad_record_before_layout)
	 * and while node 0's own writes are outstanding (none: test_bug_bad_record_writes_done). */
	hold(c, m_write(1, 0, 0));
	hold(c, m_wdone(0));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(c->w->cnt.writes[0][0][1] > 0, "node 0 did not decide");
	release_all(c);
	hold(c, m_wdone(0));
	for (uint32_t r = 0; r < c->W; r++)
		expect_err(c, r, RW_E_PHASE, "bad record from node 1");
	release_all(c);
	CHECK(!corrupt_once, "no write was corrupted");
	CHECK(c->w->cnt.fail_peer[0][1] == 1, "node 0 did not declare node 1 down");
	c->w->on_write = NULL;
	pump_until(c, mesh_up, NULL, "the link back");
	run_pair(c, 0, 0);

	/* a write whose immediate names another rail than the one it came on */
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	fk_inject_write(c->w, 1, 0, 0, 0, 64, rw_wire_imm_pack(1, 0, 1, 1, 1));
	settle(c);
	CHECK(c->w->cnt.fail_peer[0][1] == 1, "a wrong immediate did not fail the peer");
	pump_until(c, mesh_up, NULL, "the link back");
	/* a write of a phase that is not running here: dropped (counted), nothing fails */
	fk_inject_write(c->w, 1, 0, 0, 0, 64, rw_wire_imm_pack(0x1234, 0, 1, 1, 0));
	settle(c);
	CHECK(c->w->cnt.fail_peer[0][1] == 1, "a stale write failed the peer");
	CHECK(c->svc[0].metrics.errors[-RW_ERR_STATE] >= 1, "a stale write was not counted");
	run_pair(c, 0, 1);
	cl_free(c);

	/* a GRANT from a node that is not that wave's destination (N=3: wave 2 to node 0 is
	 * node 2's to give, not node 1's) */
	o.nodes = 3;
	c = cl_new(&o, 405);
	rw_wire_grant_t g = { .key = { .group = rw_wire_group_hash(c->group), .layer = 7, .step = 0 },
			      .kind = 0, .wave = 2 };
	uint8_t buf[RW_WIRE_GRANT_SIZE];
	size_t n = rw_wire_grant_pack(&g, buf, sizeof(buf));
	assert_int_equal(rw_svc_mesh_send(fk_mesh(1), 0, RW_WIRE_GRANT, buf, (uint32_t)n), RW_OK);
	settle(c);
	CHECK(c->w->cnt.fail_peer[0][1] == 1, "a stranger's grant did not fail the peer");
	pump_until(c, mesh_up, NULL, "the link back");
	run_pair(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * A peer lost in every stage
 * ================================================================================================ */

enum stage_at { AT_GATHER, AT_EXCHANGE, AT_DISPATCH_WRITES, AT_WAIT_COMBINE, AT_COMBINE_WRITES };
static const char *const stage_names[] = { "gather", "exchange", "dispatch writes in flight",
					    "waiting for combine", "combine writes in flight" };

/* Node `victim` dies; survivors' ranks get their errors (no timeout: 20 s phase timeout);
 * the victim restarts, its ranks reconnect, and the same key passes everywhere. */
static void peer_lost_case(const char *path, uint32_t N, enum stage_at at, uint64_t salt)
{
	opts_t o = { .nodes = N, .path = path, .tokens = 20, .max_write = 512 };
	cl_t *c = cl_new(&o, salt);
	const uint32_t victim = N - 1, vr0 = victim * c->G;
	char what[96];
	snprintf(what, sizeof(what), "%s N=%u peer lost in %s", path, N, stage_names[at]);
	switch (at) {
	case AT_GATHER:
		/* only node 0's first rank is in */
		dispatch_submit(c, 0, 0, 0, NULL);
		settle(c);
		break;
	case AT_EXCHANGE:
		for (uint32_t r = 0; r < vr0; r++)
			dispatch_submit(c, r, 0, 0, NULL);
		settle(c);
		break;
	case AT_DISPATCH_WRITES:
		hold(c, m_write(ANY, 0, 0));
		hold(c, m_wdone(ANY));
		for (uint32_t r = 0; r < c->W; r++)
			dispatch_submit(c, r, 0, 0, NULL);
		settle(c);
		uint32_t in_flight = 0;
		for (uint32_t s = 1; s < N; s++)
			in_flight += c->w->cnt.writes[0][s][0];
		CHECK(in_flight > 0, "%s: no write in flight", what);
		break;
	case AT_WAIT_COMBINE:
	case AT_COMBINE_WRITES:
		dispatch_all(c, 0, 0);
		if (at == AT_COMBINE_WRITES) {
			hold(c, m_write(ANY, ANY, 1));
			memset(&c->w->cnt, 0, sizeof(c->w->cnt));
			for (uint32_t r = 0; r < c->W; r++)
				combine_submit(c, r, 0, 0);
			settle(c);
			CHECK(c->w->cnt.writes[1][0][1] > 0, "%s: no combine write in flight", what);
		} else {
			combine_submit(c, 0, 0, 0); /* one rank is in, the others not yet */
			settle(c);
		}
		break;
	}
	node_crash(c, victim);
	release_all(c);
	switch (at) {
	case AT_GATHER:
		/* a gathering pair is not failed by a peer loss; once the second rank is in (and the
		 * tokens are counted, in an idle slice) the exchange finds the peer gone and fails
		 * the phase; the survivors' ranks that come later hit the tombstone its PHASE_ERR
		 * left */
		settle(c);
		expect_no_cqe(c, 0);
		dispatch_submit(c, 1, 0, 0, NULL);
		expect_err(c, 1, RW_E_PHASE, what);
		expect_err(c, 0, RW_E_PHASE, what);
		settle(c);
		for (uint32_t r = c->G; r < vr0; r++) {
			dispatch_submit(c, r, 0, 0, NULL);
			expect_err_now(c, r, RW_E_PHASE, what);
		}
		break;
	case AT_EXCHANGE:
	case AT_DISPATCH_WRITES:
		for (uint32_t r = 0; r < vr0; r++)
			expect_err(c, r, RW_E_PHASE, what);
		break;
	case AT_WAIT_COMBINE:
		expect_err(c, 0, RW_E_PHASE, what);
		settle(c);
		for (uint32_t r = 1; r < vr0; r++) { /* the pair failed while they computed */
			combine_submit(c, r, 0, 0);
			expect_err_now(c, r, RW_E_PHASE, what);
			CHECK(strstr(fk_client_notice(c->rk[r].c), "went down"),
			      "%s: rank %u was not told why: '%s'", what, r, fk_client_notice(c->rk[r].c));
		}
		break;
	case AT_COMBINE_WRITES:
		for (uint32_t r = 0; r < vr0; r++)
			expect_err(c, r, RW_E_PHASE, what);
		break;
	}
	settle(c);
	for (uint32_t r = 0; r < vr0; r++)
		expect_no_cqe(c, r);
	expect_no_timeouts(c);
	node_start(c, victim);
	pump_until(c, mesh_up, NULL, "the victim back");
	node_ranks_connect(c, victim);
	retry_key(c, 0, 0);
	cl_free(c);
}

static void test_peer_lost(void **state)
{
	(void)state;
	for (uint32_t at = AT_GATHER; at <= AT_COMBINE_WRITES; at++) {
		peer_lost_case("native", 3, (enum stage_at)at, 500 + at);
		peer_lost_case("joint", 4, (enum stage_at)at, 510 + at);
	}
}

/* A peer that dies silently (no notice; today's survivors learn from the failed rail writes):
 * the mesh honours its contract (no callback inside a call), every survivor rank fails, the
 * peer is declared down later, comes back, and the same key passes. */
static void test_peer_dies_silently(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "native", .tokens = 20, .max_write = 512 };
	cl_t *c = cl_new(&o, 520);
	hold(c, m_write(ANY, 2, 0));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	fk_kill_silent(c->w, 2);
	release_all(c);
	for (uint32_t r = 0; r < 2 * c->G; r++)
		expect_err(c, r, RW_E_PHASE, "silent peer death");
	expect_no_timeouts(c);
	node_crash(c, 2);
	settle(c);
	node_start(c, 2);
	pump_until(c, mesh_up, NULL, "node 2 back");
	node_ranks_connect(c, 2);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * A rank lost in every stage
 * ================================================================================================ */

static void rank_lost_case(const char *path, uint32_t N, enum stage_at at, uint64_t salt)
{
	opts_t o = { .nodes = N, .path = path, .tokens = 20, .max_write = 512 };
	cl_t *c = cl_new(&o, salt);
	const uint32_t victim = c->G + 1; /* node 1, local 1 */
	char what[96];
	snprintf(what, sizeof(what), "%s N=%u rank lost in %s", path, N, stage_names[at]);
	switch (at) {
	case AT_GATHER:
		for (uint32_t r = 0; r < c->W; r++)
			if (r != victim)
				dispatch_submit(c, r, 0, 0, NULL);
		settle(c);
		break;
	case AT_EXCHANGE:
		hold(c, m_ctrl(RW_WIRE_COUNTS, 0, 1));
		for (uint32_t r = 0; r < c->W; r++)
			dispatch_submit(c, r, 0, 0, NULL);
		settle(c);
		break;
	case AT_DISPATCH_WRITES:
		hold(c, m_write(ANY, 1, 0));
		for (uint32_t r = 0; r < c->W; r++)
			dispatch_submit(c, r, 0, 0, NULL);
		settle(c);
		break;
	case AT_WAIT_COMBINE:
	case AT_COMBINE_WRITES:
		dispatch_all(c, 0, 0);
		if (at == AT_COMBINE_WRITES) {
			hold(c, m_write(ANY, 1, 1));
			for (uint32_t r = 0; r < c->W; r++)
				combine_submit(c, r, 0, 0);
		} else {
			combine_submit(c, 0, 0, 0);
		}
		settle(c);
		break;
	}
	fk_client_die(c->rk[victim].c);
	release_all(c);
	if (at == AT_WAIT_COMBINE) {
		/* node 1's pair fails as a combine with no submission yet; PHASE_ERR fails the
		 * others' pairs: rank 0's combine gets RW_E_PHASE, and so do later combines (the
		 * failed phase's tomb answers them, naming the rank that left) */
		expect_err(c, 0, RW_E_PHASE, what);
		settle(c);
		for (uint32_t r = 1; r < c->W; r++) {
			if (r == victim)
				continue;
			combine_submit(c, r, 0, 0);
			expect_err_now(c, r, RW_E_PHASE, what);
			CHECK(strstr(fk_client_notice(c->rk[r].c), "left"),
			      "%s: rank %u was not told why: '%s'", what, r, fk_client_notice(c->rk[r].c));
		}
	} else {
		for (uint32_t r = 0; r < c->W; r++)
			if (r != victim)
				expect_err(c, r, RW_E_PHASE, what);
	}
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		if (r != victim)
			expect_no_cqe(c, r);
	expect_no_timeouts(c);
	rank_connect(c, victim);
	retry_key(c, 0, 0);
	cl_free(c);
}

static void test_rank_lost(void **state)
{
	(void)state;
	for (uint32_t at = AT_GATHER; at <= AT_COMBINE_WRITES; at++) {
		rank_lost_case("native", 2, (enum stage_at)at, 600 + at);
		rank_lost_case("perm-only", 3, (enum stage_at)at, 610 + at);
	}
}

/* What a node's combine waits for (docs/dataflow.md "Combine"): its own ranks' combines - a rank
 * that received no rows too - and the combine rows of every node its tokens went to; never a
 * node that got none of its tokens. Here node 0's ranks keep their tokens at home, and node 1's
 * local rank 1 leaves after the dispatch, so node 1's pair fails and says so. If node 0's ranks
 * combine while that PHASE_ERR is on its way (held), node 0's combine needs nothing from node 1
 * and completes exactly; the late report then fails nothing. If the report comes first, node 0's
 * pair is still open and fails with it: its ranks' combines get RW_E_PHASE naming the rank that
 * left. With node 0's tokens going to both nodes (home = 0), node 0 needs node 1's rows and its
 * combines fail in either order. Then the key passes. */
static void combine_sources_case(uint32_t home, int report_first, uint64_t salt)
{
	opts_t o = { .nodes = 2, .path = "joint", .stay_home = home, .fifo = 1 };
	cl_t *c = cl_new(&o, salt);
	const uint32_t victim = c->G + 1;
	dispatch_all(c, 0, 0);
	if (!report_first)
		hold(c, m_ctrl(RW_WIRE_PHASE_ERR, 1, 0));
	fk_client_die(c->rk[victim].c);
	settle(c);
	for (uint32_t r = 0; r < c->G; r++)
		combine_submit(c, r, 0, 0);
	settle(c);
	release_all(c);
	for (uint32_t r = 0; r < c->G; r++) {
		rw_cqe_t q = next_cqe(c, r);
		if (home && !report_first) {
			combine_check(c, r, 0, 0, &q);
			continue;
		}
		CHECK(q.status == RW_CQ_ERROR && q.error == RW_E_PHASE,
		      "home %u report first %d: rank %u: status %u error %d", home, report_first, r,
		      q.status, q.error);
		CHECK(strstr(fk_client_notice(c->rk[r].c), "local rank 3 left"),
		      "rank %u's reason does not name the rank that left: %s", r,
		      fk_client_notice(c->rk[r].c));
	}
	combine_submit(c, c->G, 0, 0); /* node 1's other rank: the failed phase's tomb */
	expect_err(c, c->G, RW_E_PHASE, "node 1's combine after its rank left");
	settle(c);
	rank_connect(c, victim);
	retry_key(c, 0, 0);
	cl_free(c);
}

static void test_combine_waits_for_sources(void **state)
{
	(void)state;
	combine_sources_case(1u << 0, 0, 630);
	combine_sources_case(1u << 0, 1, 631);
	combine_sources_case(0, 0, 632);
	combine_sources_case(0, 1, 633);
}

/* Ranks that leave between pairs fail nothing; when a node's ranks of the group have all left,
 * the group goes, and it forms again when they reconnect. */
static void test_rank_leaves_between_pairs(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "joint" };
	cl_t *c = cl_new(&o, 620);
	run_pair(c, 0, 0);
	for (uint32_t r = 0; r < c->G; r++)
		fk_client_die(c->rk[r].c);
	settle(c);
	for (uint32_t r = 0; r < c->G; r++)
		rank_connect(c, r);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* ================================================================================================
 * Several groups: receive slots
 * ================================================================================================ */

/* Two groups' pairs run at once, each in its own receive slot (SLOTS = 2); a third group's
 * gathered pair waits for a slot (it sends no count row) until a pair ends, then runs. Every
 * group's data is distinct and checked exactly, so a record taken by the wrong pair shows. */
static void test_slots(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "rail-only" };
	cl_t *c = cl_new(&o, 800);
	for (uint32_t g = 1; g < 3; g++) {
		use_group(c, g);
		for (uint32_t r = 0; r < c->W; r++)
			rank_connect(c, r);
	}
	settle(c);
	use_group(c, 0);
	dispatch_all(c, 0, 0);
	use_group(c, 1);
	dispatch_all(c, 0, 0);
	uint32_t rows_before = c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1];
	use_group(c, 2);
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	CHECK(c->w->cnt.ctrl_posted[RW_WIRE_COUNTS][0][1] == rows_before,
	      "a third pair sent its count row without a free slot");
	use_group(c, 0);
	combine_all(c, 0, 0);
	use_group(c, 2);
	dispatch_collect(c, 0, 0);
	/* groups 1 and 2 combine interleaved */
	for (uint32_t r = 0; r < c->W; r++) {
		use_group(c, 1);
		combine_submit(c, r, 0, 0);
		use_group(c, 2);
		combine_submit(c, r, 0, 0);
		pump_once(c);
	}
	for (uint32_t g = 1; g < 3; g++) {
		use_group(c, g);
		for (uint32_t r = 0; r < c->W; r++) {
			rw_cqe_t q = next_cqe(c, r);
			combine_check(c, r, 0, 0, &q);
		}
	}
	use_group(c, 0);
	run_pair(c, 0, 1);
	cl_free(c);
}

/* ================================================================================================
 * CUDA buffers (staging through pinned host memory, docs/dataflow.md "CUDA buffers")
 * ================================================================================================ */

static void (*fake_cuda_hold)(int);
static unsigned (*fake_gdr_flushes)(void); /* the stand-in's count of GPUDirect flushes */

/* Ranks 0 and 3 keep their buffers in CUDA memory of the stand-in driver
 * (tests/cuda/libfakecuda.so): inputs are staged in, outputs copied back after async marks that
 * complete through the loop; every path checks exactly as with host buffers, with empty phases. */
static void test_cuda_ranks(void **state)
{
	(void)state;
	if (rw_cuda_init() != RW_OK || !fake_cuda_hold)
		skip();
	for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names); pi += 2) {
		opts_t o = { .nodes = 2, .path = path_names[pi], .empty = 1, .experts = 24 };
		cl_t *c = cl_new(&o, 850 + pi);
		fk_client_die(c->rk[0].c);
		fk_client_die(c->rk[3].c);
		settle(c);
		rank_connect_cuda(c, 0);
		rank_connect_cuda(c, 3);
		for (uint32_t layer = 0; layer < 3; layer++)
			run_pair(c, 1, layer);
		cl_free(c);
	}
}

/* A CUDA rank dies while its input copies' marks are still pending (the stand-in driver holds
 * them): its node's pair waits for the copies (rw_svc_stage_sync) before the ranks get
 * RW_E_PHASE, every other rank fails too, the late marks find no pair, and the key passes. */
static void test_cuda_rank_lost(void **state)
{
	(void)state;
	if (rw_cuda_init() != RW_OK || !fake_cuda_hold)
		skip();
	opts_t o = { .nodes = 2, .path = "native", .tokens = 20 };
	cl_t *c = cl_new(&o, 860);
	fk_client_die(c->rk[3].c);
	settle(c);
	rank_connect_cuda(c, 3);
	run_pair(c, 0, 1);
	fake_cuda_hold(1);
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	fk_client_die(c->rk[3].c);
	fake_cuda_hold(0);
	for (uint32_t r = 0; r < 3; r++)
		expect_err(c, r, RW_E_PHASE, "a CUDA rank died with copies pending");
	settle(c);
	expect_no_timeouts(c);
	rank_connect_cuda(c, 3);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * The count row on the GPU (docs/dataflow.md "Count on the GPU"): the CUDA mover listed first, as
 * main.c lists it, on the kernel stand-in (tests/integration/libfakecuda_kern.so, whose kernels
 * run on the CPU; tests/service/svc_exec_gpu.sh runs these cases with it, at once and with a
 * lagging stream). Elsewhere, or in a build without kernels, they skip.
 * ================================================================================================ */

static int gpu_mover_ready(void)
{
	return rw_cuda_init() == RW_OK && rw_cuda_kernels_available(0);
}

/* A cluster whose ranks in `cuda` (bit r: global rank r) keep their buffers in CUDA memory. */
static cl_t *gpu_cluster(opts_t *o, uint64_t salt, uint32_t cuda)
{
	o->cuda_mover = 1;
	cl_t *c = cl_new(o, salt);
	for (uint32_t r = 0; r < c->W; r++)
		if (cuda >> r & 1)
			fk_client_die(c->rk[r].c);
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		if (cuda >> r & 1)
			rank_connect_cuda(c, r);
	settle(c);
	return c;
}

/* The CUDA ranks submit first, so the CUDA mover takes every node's pair (the first submission
 * picks the mover); bad: per rank, the sub_opts (NULL: none). */
static void gpu_dispatch(cl_t *c, uint32_t cuda, uint32_t step, uint32_t layer,
			 const sub_opts_t *const *bad)
{
	for (int host = 0; host < 2; host++)
		for (uint32_t r = 0; r < c->W; r++)
			if (((cuda >> r) & 1) == (uint32_t)!host)
				dispatch_submit(c, r, step, layer, bad ? bad[r] : NULL);
}

static void expect_counts(cl_t *c, uint32_t n, uint64_t gpu, uint64_t host, const char *when)
{
	const rw_svc_metrics_t *m = &c->svc[n].metrics;
	CHECK(m->counts_gpu == gpu && m->counts_host == host, "%s: node %u counted %llu rows on the "
	      "GPU and %llu on the host, expected %llu and %llu", when, n,
	      (unsigned long long)m->counts_gpu, (unsigned long long)m->counts_host,
	      (unsigned long long)gpu, (unsigned long long)host);
}

/* Every CUDA rank: each forced path and the selector over fp32/bf16 layers, exact; every row
 * came from the GPU. Then with empty phases: a node whose ranks route nothing is counted on the
 * host (nothing to launch), the others on the GPU, every phase exact. */
static void test_gpu_count_paths(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names); pi++) {
		opts_t o = { .nodes = 2, .path = path_names[pi], .experts = 24, .empty = pi == 4 };
		cl_t *c = gpu_cluster(&o, 870 + pi, 0xf);
		for (uint32_t layer = 0; layer < 3; layer++) {
			gpu_dispatch(c, 0xf, 1, layer, NULL);
			dispatch_collect(c, 1, layer);
			combine_all(c, 1, layer);
		}
		for (uint32_t n = 0; n < c->N; n++) {
			const rw_svc_metrics_t *m = &c->svc[n].metrics;
			if (o.empty)
				CHECK(m->counts_gpu >= 1 && m->counts_gpu + m->counts_host == 3,
				      "node %u: %llu rows from the GPU, %llu from the host", n,
				      (unsigned long long)m->counts_gpu, (unsigned long long)m->counts_host);
			else
				expect_counts(c, n, 3, 0, path_names[pi]);
		}
		cl_free(c);
	}
}

/* Mixed nodes: rank 0 (node 0) and rank 3 (node 1) on the GPU, ranks 1 and 2 in host memory:
 * the CUDA mover counts its CUDA rank on the GPU and the host-memory one on the CPU, and the
 * sum is the row (every result exact); with RAILWAVE_CUDA_MOVER=check the daemon counts every
 * rank on the host too and the two agree (a difference would fail the phase). */
static void test_gpu_count_mixed(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	for (int check = 0; check < 2; check++) {
		if (check)
			setenv("RAILWAVE_CUDA_MOVER", "check", 1); /* read when the mover is created */
		opts_t o = { .nodes = 2, .path = check ? "joint" : "auto" };
		cl_t *c = gpu_cluster(&o, 880 + (uint64_t)check, 0x9);
		unsetenv("RAILWAVE_CUDA_MOVER");
		for (uint32_t layer = 0; layer < 3; layer++) {
			gpu_dispatch(c, 0x9, 0, layer, NULL);
			dispatch_collect(c, 0, layer);
			combine_all(c, 0, layer);
		}
		for (uint32_t n = 0; n < c->N; n++)
			expect_counts(c, n, 3, 0, check ? "mixed, check" : "mixed");
		cl_free(c);
	}
}

/* An expert id out of range on a CUDA rank, found by the count kernel: that rank gets
 * RW_E_TOKENS and is named, every other rank RW_E_PHASE, on both nodes, without a timeout; the
 * same key then passes. Rank 0 keeps host memory: when it and CUDA rank 1 both hold a bad id,
 * rank 0 is named (the lowest, as the host count pass names it). */
static void test_gpu_count_bad_id(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	opts_t o = { .nodes = 2, .path = "native", .tokens = 16 };
	const uint32_t cuda = 0xe;
	cl_t *c = gpu_cluster(&o, 890, cuda);
	sub_opts_t bad = { .bad_id = (int32_t)c->E };
	const sub_opts_t *one[4] = { NULL, &bad, NULL, NULL }, *two[4] = { &bad, &bad, NULL, NULL };
	for (uint32_t layer = 0; layer < 2; layer++) {
		uint32_t culprit = layer ? 0 : 1;
		char name[32];
		snprintf(name, sizeof(name), "local rank %u:", culprit);
		gpu_dispatch(c, cuda, 0, layer, layer ? two : one);
		for (uint32_t r = 0; r < c->W; r++)
			expect_err(c, r, r == culprit ? RW_E_TOKENS : RW_E_PHASE, "bad id on a CUDA rank");
		CHECK(strstr(fk_client_notice(c->rk[culprit].c), name), "layer %u: rank %u was told '%s'",
		      layer, culprit, fk_client_notice(c->rk[culprit].c));
		expect_counts(c, 0, 2 * layer + 1, 0, "bad id");
		expect_no_timeouts(c);
		settle(c);
		gpu_dispatch(c, cuda, 0, layer, NULL); /* the retry of the same key */
		dispatch_collect(c, 0, layer);
		combine_all(c, 0, layer);
		expect_counts(c, 0, 2 * layer + 2, 0, "retry");
	}
	cl_free(c);
}

/* Slabs on a GPU (service/mover.h "Where the slabs are"; GPUDirect RDMA with the NIC played by
 * the fakes): every node's rail memory is device memory, each write is copied device to device
 * and nothing lands in the host shadow, so a header the CPU wrote and did not copy over, or one
 * it read without copying it back, breaks the phase. Over every forced path and the selector,
 * fp32 and bf16 layers, exact: every rank CUDA (the CUDA mover: headers copied with the pieces,
 * arrived headers pulled), CUDA and host-memory ranks mixed (the CUDA mover), and every rank in
 * host memory (the host mover: whole slabs pushed and pulled). The stand-in orders no NIC
 * write, so the movers must have flushed before reading. */
static void test_gpu_dev_slabs(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	static const uint32_t cuda_sets[] = { 0xf, 0x9, 0x0 };
	for (uint32_t ci = 0; ci < RW_ARRAY_SIZE(cuda_sets); ci++)
		for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names); pi++) {
			const uint32_t cuda = cuda_sets[ci];
			opts_t o = { .nodes = 2, .path = path_names[pi], .dev_slabs = 1, .max_write = 4096 };
			cl_t *c = gpu_cluster(&o, 940 + 8 * ci + pi, cuda);
			const unsigned flushes = fake_gdr_flushes ? fake_gdr_flushes() : 0;
			for (uint32_t layer = 0; layer < 2; layer++) {
				gpu_dispatch(c, cuda, 2, layer, NULL);
				dispatch_collect(c, 2, layer);
				combine_all(c, 2, layer);
			}
			CHECK(!fake_gdr_flushes || fake_gdr_flushes() > flushes, "ranks %#x, %s: no "
			      "GPUDirect flush before reading the slabs", cuda, path_names[pi]);
			cl_free(c);
		}
}

/* A peer's bad record into a slab on a GPU: the CUDA mover reads the headers after a pull, so it
 * refuses the range asynchronously (RW_MV_OP_REFUSED). The receiver still declares the peer
 * down and fails the phase on both nodes, without a timeout; the link comes back and the same
 * key passes. */
static void test_gpu_dev_slabs_bad_record(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	opts_t o = { .nodes = 2, .path = "native", .tokens = 16, .dev_slabs = 1 };
	cl_t *c = gpu_cluster(&o, 960, 0xf);
	corrupt_once = 1;
	c->w->on_write = corrupt_tag;
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	gpu_dispatch(c, 0xf, 0, 0, NULL);
	for (uint32_t r = 0; r < c->W; r++)
		expect_err(c, r, RW_E_PHASE, "bad record from node 1 into a GPU slab");
	CHECK(!corrupt_once, "no write was corrupted");
	CHECK(c->w->cnt.fail_peer[0][1] == 1, "node 0 did not declare node 1 down");
	expect_no_timeouts(c);
	c->w->on_write = NULL;
	pump_until(c, mesh_up, NULL, "the link back");
	gpu_dispatch(c, 0xf, 0, 0, NULL);
	dispatch_collect(c, 0, 0);
	combine_all(c, 0, 0);
	cl_free(c);
}

/* ================================================================================================
 * Drain
 * ================================================================================================ */

/* SIGTERM with a pair in flight: new pairs are refused (RW_E_STATE); the running dispatch
 * completes, and today the pair then closes without its combine (RW_E_HANDLE) and the daemon
 * stops (rw_svc_stop). The peer's combine then fails when the draining node goes; the node
 * restarts and the same key passes. Without a phase in flight the drain stops at once. */
static void test_drain(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native", .tokens = 12 };
	cl_t *c = cl_new(&o, 700);
	hold(c, m_write(ANY, 0, 0));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	node_drain(c, 0);
	CHECK(c->svc[0].stopping == 0, "stopped with a phase in flight");
	rw_ipc_client_t *other = fk_client_new(c->w, 0, "g.late", 0, c->W, 0);
	fk_client_join(other);
	uint8_t *mem;
	uint32_t b = fk_client_buffer(other, 4096, &mem);
	rw_span_t none = { RW_BUF_NONE, 0, 0 };
	rw_sqe_t s = { .kind = RW_KIND_DISPATCH, .dtype = RW_DTYPE_FP32, .topk = TOPK, .layer = 0, .step = 0,
		       .token_count = 0, .hidden = c->hidden, .tokens = none, .topk_ids = none,
		       .topk_weights = none, .output = { b, 0, 0 }, .output_capacity = 4096, .n_experts = c->E };
	fk_client_submit(other, &s);
	fk_client_stats_t st;
	fk_client_stats(other, &st);
	CHECK(st.n_cqe == 1 && fk_client_cqe(other, 0)->error == RW_E_STATE, "draining: a new pair was not refused");
	release_all(c);
	dispatch_collect(c, 0, 0);
	CHECK(c->svc[0].stopping == 1, "drain finished but the daemon was not stopped");
	for (uint32_t r = 0; r < c->G; r++) {
		combine_submit(c, r, 0, 0);
		expect_err_now(c, r, RW_E_HANDLE, "combine after the drain closed the pair");
	}
	for (uint32_t r = c->G; r < c->W; r++)
		combine_submit(c, r, 0, 0);
	settle(c);
	fk_kill(c->w, 0); /* the drained daemon exits */
	node_stop(c, 0);
	for (uint32_t r = c->G; r < c->W; r++)
		expect_err(c, r, RW_E_PHASE, "peer exited after its drain");
	node_start(c, 0);
	pump_until(c, mesh_up, NULL, "node 0 back");
	node_ranks_connect(c, 0);
	run_pair(c, 0, 0);
	node_drain(c, 1);
	CHECK(c->svc[1].stopping == 1, "an idle drain did not stop at once");
	cl_free(c);
}

/* ================================================================================================
 * Bugs of the executor before the split, reproduced first (svc_exec_fixed_bugs)
 * ================================================================================================ */

/* Issue 15 point 1: with service/mesh.c's real behaviour - a control write to a dead peer tears
 * the peer down inside rw_svc_mesh_send, completing its other queued writes with errors - a
 * survivor frees a pair under its own pair_fail: a rail write to the (silently) dead node fails ->
 * pair_fail -> tell_peers_failed -> mesh_send to that node -> its other writes of the same pair
 * complete with errors inside the send -> nested pair_fail -> pair_close -> the last outstanding
 * write frees the pair -> the outer pair_fail's pair_close reads freed memory. ASan reports a
 * heap-use-after-free in pair_close (service/phase.c). */
static void test_bug_issue15_uaf(void **state)
{
	(void)state;
	opts_t o = { .nodes = 3, .path = "native", .tokens = 20, .max_write = 256, .fifo = 1 };
	cl_t *c = cl_new(&o, 900);
	c->w->sync_teardown = 1;
	hold(c, m_write(ANY, 2, 0));
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c); /* every write but those to node 2 done */
	fk_kill_silent(c->w, 2);
	release_all(c);
	for (uint32_t r = 0; r < 2 * c->G; r++)
		expect_err(c, r, RW_E_PHASE, "issue 15");
	fk_kill(c->w, 2);
	node_stop(c, 2);
	settle(c);
	cl_free(c);
}

/* The daemon stops (SIGTERM with no phase running: rw_svc_shutdown_begin stops at once) while a
 * pair waits for its combine: rw_svc_ipc_stop fails every open pair in a loop that reads
 * p->next after pair_fail -> pair_close freed p (no write outstanding), and rw_svc_mesh_stop has
 * the same loop. ASan: heap-use-after-free in rw_svc_ipc_stop (service/phase.c); a release build
 * follows a freed pointer (the segfault this test first showed). Expected once fixed: node 0
 * stops cleanly and node 1's ranks' combines fail with RW_E_PHASE when it goes. */
static void test_bug_stop_with_open_pair(void **state)
{
	(void)state;
	opts_t o = { .nodes = 2, .path = "native" };
	cl_t *c = cl_new(&o, 901);
	dispatch_all(c, 0, 0);
	node_drain(c, 0);
	CHECK(c->svc[0].stopping == 1, "an idle drain did not stop at once");
	fk_kill(c->w, 0);
	node_stop(c, 0); /* the use-after-free */
	for (uint32_t r = c->G; r < c->W; r++) {
		combine_submit(c, r, 0, 0);
		expect_err(c, r, RW_E_PHASE, "peer stopped");
	}
	cl_free(c);
}

/* A peer's bad record that arrived before this node could decide (it lacked a count row) is
 * found when the layout is known: pair_send_wave -> pair_scan_ranges -> pair_range_arrived ->
 * pair_fail frees the pair (no write outstanding yet), and pair_scan_ranges' loop condition
 * (!p->dead) then reads it; pair_send_wave reads p->dead again after the scan. ASan:
 * heap-use-after-free in pair_scan_ranges (service/phase.c). The same holds for "more data than
 * expected" found by the scan. Expected once fixed: every rank gets RW_E_PHASE, the link comes
 * back and the key passes. */
/* Node 1's first dispatch write to node 0 is corrupted while `hold_back` is held; released, every
 * rank's dispatch fails (node 0 drops node 1 for its bad data), the link comes back, the key
 * passes. `early`: the corrupted write has arrived before the release. */
static void bad_record_case(match_t hold_back, int early, uint64_t salt, const char *what)
{
	opts_t o = { .nodes = 2, .path = "native", .tokens = 16, .fifo = 1 };
	cl_t *c = cl_new(&o, salt);
	corrupt_once = 1;
	c->w->on_write = corrupt_tag;
	hold(c, hold_back);
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, NULL);
	settle(c);
	CHECK(!early || !corrupt_once, "node 1's write did not arrive before node 0 decided");
	release_all(c);
	for (uint32_t r = 0; r < c->W; r++)
		expect_err(c, r, RW_E_PHASE, what);
	c->w->on_write = NULL;
	pump_until(c, mesh_up, NULL, "the link back");
	run_pair(c, 0, 0);
	cl_free(c);
}

static void test_bug_bad_record_before_layout(void **state)
{
	(void)state;
	/* node 0 cannot decide; node 1 can and writes. Released, node 0 decides and scans the
	 * early range: the use-after-free */
	bad_record_case(m_ctrl(RW_WIRE_COUNTS, 1, 0), 1, 902, "bad early record");
}

/* The same bad record as test_peer_bad_data, but node 0's own writes have all completed, so
 * pair_fail (from pair_range_arrived, inside mesh_arrival) frees the pair and mesh_arrival then
 * calls pair_check_done on it. ASan: heap-use-after-free in pair_check_done (service/phase.c).
 * Expected once fixed: every rank gets RW_E_PHASE, the link comes back, the key passes. */
static void test_bug_bad_record_writes_done(void **state)
{
	(void)state;
	/* held until node 0's own writes to node 1 are done */
	bad_record_case(m_write(1, 0, 0), 0, 903, "bad record, no write outstanding");
}

/* A rank's output too small, found by the local-node work (forward_local, in an idle slice)
 * when the pair has no write outstanding (node 0's ranks route only to their own node, so node
 * 0 sends nothing): pair_fail frees the pair and bg_cb then reads p->dead. ASan:
 * heap-use-after-free in bg_cb (service/phase.c). Expected once fixed: node 0's ranks get
 * RW_E_RANGE, node 1's RW_E_PHASE, and the key passes. */
static void test_bug_output_full_writes_done(void **state)
{
	(void)state;
	setenv("RAILWAVE_TEST_LOCAL_SLICE", "1", 1);
	opts_t o = { .nodes = 2, .path = "native", .tokens = 40, .fifo = 1 };
	cl_t *c = cl_new(&o, 904);
	unsetenv("RAILWAVE_TEST_LOCAL_SLICE");
	hold(c, m_write(1, 0, 0)); /* node 0 overflows on its local rows, not on node 1's */
	sub_opts_t small = { .output_capacity = 200, .local_only = 1 }, local = { .local_only = 1 };
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, r == 0 ? &small : r < c->G ? &local : NULL);
	for (uint32_t r = 0; r < c->G; r++)
		expect_err(c, r, RW_E_RANGE, "output full");
	release_all(c);
	for (uint32_t r = c->G; r < c->W; r++)
		expect_err(c, r, RW_E_PHASE, "output full at the peer");
	retry_key(c, 0, 0);
	cl_free(c);
}

/* ---- main ----------------------------------------------------------------------------------------- */

int main(void)
{
	const char *seed = getenv("RW_EXEC_SEED");
	base_seed = seed && *seed ? strtoull(seed, NULL, 10) : (uint64_t)rw_now_ns();
	printf("seed %llu (RW_EXEC_SEED=%llu reproduces)\n", (unsigned long long)base_seed,
	       (unsigned long long)base_seed);
	const char *lv = getenv("RW_EXEC_LOG");
	rw_log_set_level(!lv ? RW_LOG_ERROR : !strcmp(lv, "debug") ? RW_LOG_DEBUG :
			 !strcmp(lv, "info") ? RW_LOG_INFO : RW_LOG_WARN);
	/* CUDA buffers run on the stand-in driver next to this program (build/test/svc_exec ->
	 * build/tests/cuda/libfakecuda.so) unless RW_CUDA_DRIVER names another. */
	if (!getenv("RW_CUDA_DRIVER")) {
		char self[1024], fake[1100];
		ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
		if (n > 0) {
			self[n] = 0;
			snprintf(fake, sizeof(fake), "%s/../tests/cuda/libfakecuda.so", dirname(self));
			setenv("RW_CUDA_DRIVER", fake, 1);
		}
	}
	if (rw_cuda_init() == RW_OK) {
		void *h = dlopen(getenv("RW_CUDA_DRIVER"), RTLD_NOW | RTLD_NOLOAD);
		if (h) {
			*(void **)&fake_cuda_hold = dlsym(h, "rw_fake_cuda_hold");
			*(void **)&fake_gdr_flushes = dlsym(h, "rw_fake_cuda_gdr_flushes");
			dlclose(h);
		}
	}
	const char *only = getenv("RW_EXEC_ONLY"); /* a cmocka filter: "test_drain", "test_paths*" */
	if (only && *only)
		cmocka_set_test_filter(only);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_paths_n2),
		cmocka_unit_test(test_paths_n3),
		cmocka_unit_test(test_paths_n4),
		cmocka_unit_test(test_paths_small_writes),
		cmocka_unit_test(test_paths_no_write_limit),
		cmocka_unit_test(test_count_sliced),
		cmocka_unit_test(test_row_before_records),
		cmocka_unit_test(test_selector_anchor),
		cmocka_unit_test(test_grants_held),
		cmocka_unit_test(test_grant_before_wave),
		cmocka_unit_test(test_grant_wait_peer_lost),
		cmocka_unit_test(test_rows_early),
		cmocka_unit_test(test_rows_late),
		cmocka_unit_test(test_data_before_layout),
		cmocka_unit_test(test_timeout_tombstone_retry),
		cmocka_unit_test(test_timeout_combine),
		cmocka_unit_test(test_timeout_lost_row),
		cmocka_unit_test(test_timeout_both_sides),
		cmocka_unit_test(test_relay_fails_taker),
		cmocka_unit_test(test_relay_spares_retry),
		cmocka_unit_test(test_phase_err_before_pair),
		cmocka_unit_test(test_bad_expert_id),
		cmocka_unit_test(test_bad_experts),
		cmocka_unit_test(test_bad_submissions),
		cmocka_unit_test(test_bad_ranks),
		cmocka_unit_test(test_peer_bad_data),
		cmocka_unit_test(test_peer_lost),
		cmocka_unit_test(test_peer_dies_silently),
		cmocka_unit_test(test_rank_lost),
		cmocka_unit_test(test_rank_leaves_between_pairs),
		cmocka_unit_test(test_combine_waits_for_sources),
		cmocka_unit_test(test_slots),
		cmocka_unit_test(test_cuda_ranks),
		cmocka_unit_test(test_cuda_rank_lost),
		cmocka_unit_test(test_gpu_count_paths),
		cmocka_unit_test(test_gpu_count_mixed),
		cmocka_unit_test(test_gpu_count_bad_id),
		cmocka_unit_test(test_gpu_dev_slabs),
		cmocka_unit_test(test_gpu_dev_slabs_bad_record),
		cmocka_unit_test(test_drain),
	};
	/* Bugs of the executor before the split (phase.c), each reproduced first; fixed by the
	 * split (a failed pair is closed before anyone is told; closed pairs are reaped outside
	 * every callback chain) and kept as regression tests. */
	const struct CMUnitTest fixed[] = {
		cmocka_unit_test(test_bug_issue15_uaf),
		cmocka_unit_test(test_bug_stop_with_open_pair),
		cmocka_unit_test(test_bug_bad_record_before_layout),
		cmocka_unit_test(test_bug_bad_record_writes_done),
		cmocka_unit_test(test_bug_output_full_writes_done),
	};
	int rc = cmocka_run_group_tests_name("svc_exec", tests, NULL, NULL);
	rc += cmocka_run_group_tests_name("svc_exec_fixed_bugs", fixed, NULL, NULL);
	return rc ? 1 : 0;
}
