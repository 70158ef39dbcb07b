/* The harness of svc_exec, the in-process executor test (contract: exec_harness.h): the cluster
 * of executors on the fakes, its ranks, pumping the loop and the fake network, one rank's
 * dispatch and combine checked exactly against tests/lib/workload.h, holding events back. */
#include "tests/service/exec_harness.h"

#include <dlfcn.h>
#include <math.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* rw_svc_stop (service/core/svc.h) sets svc->stopping once: a drain that ended shows there. */

extern char **environ;

static uint64_t base_seed;
const char *const path_names[5] = { "native", "rail-only", "perm-only", "joint", "auto" };
void (*fake_cuda_hold)(int);
unsigned (*fake_gdr_flushes)(void);

/* ---- setup ----------------------------------------------------------------------------------------- */

void exec_harness_init(void)
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
}

void cl_gen(const cl_t *c, uint32_t step, uint32_t layer, uint32_t rank, rw_wl_work_t *wk)
{
	const rw_wl_shape_t sh = { .seed = c->seed, .gpus = c->G, .experts = c->E,
				   .per_rank = c->per_rank, .hidden = c->hidden, .tokens = c->o.tokens,
				   .empty = c->o.empty, .stay_home = c->o.stay_home };
	rw_wl_gen(&sh, step, layer, rank, wk);
}

/* ---- pumping ------------------------------------------------------------------------------------ */

#define CEILING_NS (20ull * 1000000000ull) /* turns a hang into a failure; nothing asserts on time */

/* One loop iteration without blocking (timers, idle slices), then one network event. */
int pump_once(cl_t *c)
{
	ev_run(c->loop, EVRUN_NOWAIT);
	return fk_step(c->w);
}

/* Deliver until nothing is deliverable for a while (held events stay queued). */
void settle(cl_t *c)
{
	for (uint32_t quiet = 0; quiet < 64;)
		quiet = pump_once(c) ? 0 : quiet + 1;
}

void pump_until(cl_t *c, pred_fn pred, const void *arg, const char *what)
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

uint32_t n_cqe(const trank_t *t)
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
rw_cqe_t next_cqe(cl_t *c, uint32_t r)
{
	char what[64];
	snprintf(what, sizeof(what), "a completion for rank %u", r);
	pump_until(c, has_cqe, &r, what);
	trank_t *t = &c->rk[r];
	return *fk_client_cqe(t->c, t->seen++);
}

void expect_no_cqe(cl_t *c, uint32_t r)
{
	CHECK(n_cqe(&c->rk[r]) == c->rk[r].seen, "rank %u got a completion it should not have (error %d)",
	      r, fk_client_cqe(c->rk[r].c, c->rk[r].seen)->error);
}

void expect_err(cl_t *c, uint32_t r, int err, const char *when)
{
	rw_cqe_t q = next_cqe(c, r);
	CHECK(q.status == RW_CQ_ERROR && q.error == err,
	      "%s: rank %u: status %u error %d, expected error %d", when, r, q.status, q.error, err);
}

void expect_phase_err(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const char *when)
{
	rw_cqe_t q = next_cqe(c, r);
	if (q.status == RW_CQ_OK) {
		dispatch_check(c, r, step, layer, &q);
		combine_submit(c, r, step, layer);
		q = next_cqe(c, r);
	}
	CHECK(q.status == RW_CQ_ERROR && q.error == RW_E_PHASE,
	      "%s: rank %u: status %u error %d, expected error %d", when, r, q.status, q.error,
	      RW_E_PHASE);
}

/* The completion must already be there (answered inside the submission, no network, no time). */
void expect_err_now(cl_t *c, uint32_t r, int err, const char *when)
{
	CHECK(n_cqe(&c->rk[r]) > c->rk[r].seen, "%s: rank %u was not answered at once", when, r);
	expect_err(c, r, err, when);
}

/* ---- nodes ---------------------------------------------------------------------------------------- */

/* The executors' epoch hook: node n's draws go to the case's c->epoch_fn[n] while it is set. */
typedef struct node_ref {
	cl_t *c;
	uint32_t n;
} node_ref_t;
static node_ref_t node_refs[FK_MAX_NODES];

static uint32_t node_epoch(void *ctx)
{
	const node_ref_t *ref = ctx;
	return ref->c->epoch_fn[ref->n] ? ref->c->epoch_fn[ref->n](ref->c->epoch_ctx[ref->n]) : 0;
}

void node_start(cl_t *c, uint32_t n)
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
	node_ref_t *ref = &node_refs[n];
	*ref = (node_ref_t){ .c = c, .n = n };
	hooks.epoch = node_epoch;
	hooks.epoch_ctx = ref;
	assert_int_equal(rw_svc_exec_create(svc, movers + !c->o.cuda_mover, 2 - !c->o.cuda_mover,
					    &hooks, &svc->exec), RW_OK);
	assert_int_equal(rw_svc_exec_ipc_start(svc->exec), RW_OK);
	c->running[n] = 1;
}

void node_drain(cl_t *c, uint32_t n)
{
	c->svc[n].draining = 1;
	rw_svc_exec_drain(c->svc[n].exec);
}

void node_stop(cl_t *c, uint32_t n)
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

/* Global rank r of the current group connects to its node and joins (no buffer yet). */
static trank_t *rank_join(cl_t *c, uint32_t r)
{
	trank_t *t = &c->rk[r];
	t->rank = r;
	t->node = r / c->G;
	t->local = r % c->G;
	t->seen = 0;
	t->c = fk_client_new(c->w, t->node, c->group, r, c->W, t->local);
	fk_client_join(t->c);
	return t;
}

void rank_connect(cl_t *c, uint32_t r)
{
	trank_t *t = rank_join(c, r);
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
void rank_connect_cuda(cl_t *c, uint32_t r)
{
	trank_t *t = rank_join(c, r);
	uint8_t *dmem = NULL;
	t->buf = fk_client_cuda_buffer(t->c, c->total, &dmem);
	CHECK(t->buf, "rank %u: no CUDA buffer", r);
	if (!t->mirror)
		t->mirror = calloc(1, c->total);
	CHECK(t->mirror, "rank %u: no memory for its mirror", r);
	t->dptr = (rw_cuda_dptr_t)(uintptr_t)dmem;
	t->mem = t->mirror;
}

void node_ranks_connect(cl_t *c, uint32_t n)
{
	for (uint32_t g = 0; g < c->G; g++)
		rank_connect(c, n * c->G + g);
}

int mesh_up(cl_t *c, const void *arg)
{
	(void)arg;
	return fk_all_up(c->w);
}

cl_t *cl_new(const opts_t *o, uint64_t seed_salt)
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
	c->seed = c->seed0 = rw_wl_mix(base_seed ^ seed_salt);
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
	rw_wl_work_t *const works[] = { &c->mine, &c->other };
	for (uint32_t i = 0; i < 2; i++) {
		rw_wl_work_t *wk = works[i];
		wk->x = malloc(sizeof(float) * MAX_ROWS * c->hidden);
		wk->ids = malloc(sizeof(*wk->ids) * MAX_ROWS);
		wk->w = malloc(sizeof(*wk->w) * MAX_ROWS);
		assert_true(wk->x && wk->ids && wk->w);
	}
	c->seen = malloc((size_t)c->W * MAX_ROWS);
	c->ecount = malloc(sizeof(uint32_t) * c->E);
	c->outv = malloc(sizeof(float) * c->hidden);
	assert_true(c->seen && c->ecount && c->outv);
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
void use_group(cl_t *c, uint32_t g)
{
	c->rk = c->rks[g];
	c->group = c->groups[g];
	c->seed = g ? rw_wl_mix(c->seed0 + g) : c->seed0;
}

/* Stop every node (everything must be freed: ASan's leak check runs at exit) and check that the
 * fakes saw no contract violation. */
void cl_free(cl_t *c)
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
	rw_wl_work_t *const works[] = { &c->mine, &c->other };
	for (uint32_t i = 0; i < 2; i++) {
		free(works[i]->x);
		free(works[i]->ids);
		free(works[i]->w);
	}
	free(c->seen);
	free(c->ecount);
	free(c->outv);
	free(c);
	CHECK(v == 0, "%u contract violations, the first: %s", v, what);
}

/* ---- one rank's dispatch and combine, checked exactly (rw_rank's checks) ------------------------ */

void dispatch_submit(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const sub_opts_t *so)
{
	trank_t *t = &c->rk[r];
	int bf16 = rw_wl_bf16(step, layer);
	uint32_t row = c->hidden * (bf16 ? 2 : 4);
	cl_gen(c, step, layer, r, &c->mine);
	if (so && so->local_only) {
		uint32_t per_node = c->G * c->per_rank;
		for (uint32_t i = 0; i < c->mine.n; i++)
			for (uint32_t k = 0; k < TOPK; k++)
				c->mine.ids[i][k] = (int32_t)(t->node * per_node + (uint32_t)i % per_node);
	}
	for (uint32_t i = 0; i < c->mine.n; i++) {
		rw_wl_put_row(t->mem + c->off_tok + (uint64_t)i * row, bf16, c->mine.x + (size_t)i * c->hidden, c->hidden);
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
	if (so && so->wait_event) {
		s.flags = RW_SQE_WAIT_EVENT;
		s.event_id = so->wait_event;
	}
	if (so && so->signal_event) {
		s.flags |= RW_SQE_SIGNAL;
		s.event_id = so->signal_event;
		s.output.reserved = so->flag_value;
	}
	t->ds = s;
	fk_client_submit(t->c, &s);
}

/* Check rank r's dispatch completion exactly and write its combine input (expert outputs). */
void dispatch_check(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const rw_cqe_t *cq)
{
	trank_t *t = &c->rk[r];
	const uint32_t me = r;
	int bf16 = rw_wl_bf16(step, layer);
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
		cl_gen(c, step, layer, q, &c->other);
		expect_total += rw_wl_hits(&c->other, me, c->per_rank, c->ecount);
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
		cl_gen(c, step, layer, src_rank, &c->other);
		CHECK(token < c->other.n, "rank %u row %u: bad token %u", me, j, token);
		uint8_t *sn = &c->seen[src_rank * MAX_ROWS + token];
		CHECK(!*sn, "rank %u row %u: rank %u token %u delivered twice", me, j, src_rank, token);
		*sn = 1;
		CHECK(memcmp(m + 16, c->other.ids[token], TOPK * 4) == 0, "rank %u row %u: ids differ", me, j);
		CHECK(memcmp(m + 16 + 4 * TOPK, c->other.w[token], TOPK * 4) == 0, "rank %u row %u: weights differ", me, j);
		const float *xt = c->other.x + (size_t)token * c->hidden;
		for (uint32_t h = 0; h < c->hidden; h++)
			CHECK(rw_wl_get_elem(rows + (uint64_t)j * row, bf16, h) == xt[h],
			      "rank %u row %u (rank %u token %u): data differs at %u", me, j, src_rank, token, h);
		int mine = rw_wl_expert_row(&c->other, token, me, c->per_rank, c->hidden, c->outv);
		CHECK(mine, "rank %u row %u: rank %u token %u has no expert here", me, j, src_rank, token);
		rw_wl_put_row(t->mem + c->off_cin + (uint64_t)j * row, bf16, c->outv, c->hidden);
	}
	rank_push(c, t, c->off_cin, c->comb_in);
	t->dq = *cq;
}

rw_sqe_t combine_sqe(cl_t *c, uint32_t r, uint32_t step, uint32_t layer)
{
	trank_t *t = &c->rk[r];
	rw_span_t none = { RW_BUF_NONE, 0, 0 };
	cl_gen(c, step, layer, r, &c->mine);
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

void combine_submit(cl_t *c, uint32_t r, uint32_t step, uint32_t layer)
{
	rw_sqe_t cs = combine_sqe(c, r, step, layer);
	fk_client_submit(c->rk[r].c, &cs);
}

void abort_submit(cl_t *c, uint32_t r, uint32_t step, uint32_t layer)
{
	rw_sqe_t as = combine_sqe(c, r, step, layer);
	const rw_span_t none = { RW_BUF_NONE, 0, 0 };
	as.flags = RW_SQE_ABORT;
	as.token_count = 0;
	as.tokens = as.output = none;
	as.output_capacity = 0;
	fk_client_submit(c->rk[r].c, &as);
}

void combine_check(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const rw_cqe_t *cq)
{
	trank_t *t = &c->rk[r];
	int bf16 = rw_wl_bf16(step, layer);
	uint32_t row = c->hidden * (bf16 ? 2 : 4);
	CHECK(cq->status == RW_CQ_OK, "rank %u step %u layer %u combine failed: error %d", r, step,
	      layer, cq->error);
	rank_pull(c, t, c->off_cout, c->comb_out);
	cl_gen(c, step, layer, r, &c->mine);
	CHECK(cq->kind == RW_KIND_COMBINE && cq->phase_id == t->ds.phase_id + 500 && cq->user_data == 8,
	      "rank %u: combine completion ids", r);
	CHECK(cq->recv_tokens == c->mine.n && cq->handle_id == t->dq.handle_id,
	      "rank %u: combine returned %u rows, expected %u", r, cq->recv_tokens, c->mine.n);
	for (uint32_t i = 0; i < c->mine.n; i++)
		for (uint32_t h = 0; h < c->hidden; h++) {
			float ref = rw_wl_combined(&c->mine, i, h, c->hidden);
			float got = rw_wl_get_elem(t->mem + c->off_cout + (uint64_t)i * row, bf16, h);
			CHECK(got == ref, "rank %u step %u layer %u token %u elem %u: combine %g, expected %g",
			      r, step, layer, i, h, got, ref);
		}
}

/* A few network events between two submissions, so submissions interleave with the exchange. */
static void jiggle(cl_t *c, uint32_t salt)
{
	uint32_t n = (uint32_t)(rw_wl_mix(c->seed ^ salt) % 4);
	for (uint32_t i = 0; i < n; i++)
		pump_once(c);
}

/* Ranks in a seeded order. */
static void rank_order(cl_t *c, uint32_t salt, uint32_t *order)
{
	for (uint32_t i = 0; i < c->W; i++)
		order[i] = i;
	for (uint32_t i = c->W; i > 1; i--) {
		uint32_t j = (uint32_t)(rw_wl_mix(c->seed ^ salt ^ i) % i);
		uint32_t tmp = order[i - 1];
		order[i - 1] = order[j];
		order[j] = tmp;
	}
}

/* Every rank's dispatch completion, checked exactly. */
void dispatch_collect(cl_t *c, uint32_t step, uint32_t layer)
{
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		dispatch_check(c, r, step, layer, &q);
	}
}

/* Every rank's combine, submitted and checked exactly. */
void combine_all(cl_t *c, uint32_t step, uint32_t layer)
{
	for (uint32_t r = 0; r < c->W; r++)
		combine_submit(c, r, step, layer);
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		combine_check(c, r, step, layer, &q);
	}
}

static void run_pair_(cl_t *c, uint32_t step, uint32_t layer);

/* Every rank dispatches and combines (step, layer); everything checked exactly. A pair that
 * must pass runs with the harness's 20 s ceiling as its phase timeout, also in a case that set a
 * short one for the timeouts it provokes: on a loaded machine this process can be off the CPU
 * for over a second, and the retry after those timeouts then timed out for real (4 of 240 runs
 * of test_timeout_* at a load of 30). A pair that never completes still fails, at the harness's 20 s wait. */
void run_pair(cl_t *c, uint32_t step, uint32_t layer)
{
	uint32_t timeout_ms[FK_MAX_NODES];
	for (uint32_t n = 0; n < c->N; n++) {
		timeout_ms[n] = c->svc[n].cfg.phase_timeout_ms;
		c->svc[n].cfg.phase_timeout_ms = 20000;
	}
	run_pair_(c, step, layer);
	for (uint32_t n = 0; n < c->N; n++)
		c->svc[n].cfg.phase_timeout_ms = timeout_ms[n];
}

static void run_pair_(cl_t *c, uint32_t step, uint32_t layer)
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
void dispatch_all(cl_t *c, uint32_t step, uint32_t layer)
{
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, step, layer, NULL);
	dispatch_collect(c, step, layer);
}

void dispatch_submit_all(cl_t *c, uint32_t step, uint32_t layer)
{
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, step, layer, NULL);
	settle(c);
}

/* ---- the owner's order of a combine sum ----------------------------------------------------- */

/* Whether global rank q hosts one of token i's experts (wk: its owner's workload). */
static int hosts(const cl_t *c, const rw_wl_work_t *wk, uint32_t i, uint32_t q)
{
	for (uint32_t k = 0; k < TOPK; k++)
		if (wk->ids[i][k] >= 0 && (uint32_t)wk->ids[i][k] / c->per_rank == q)
			return 1;
	return 0;
}

/* The nodes other than o's hosting owner rank o's token i: how many, and how many before node. */
static uint32_t away_nodes(const cl_t *c, const rw_wl_work_t *wk, uint32_t o, uint32_t i,
			   uint32_t node, uint32_t *before_p)
{
	uint32_t n_away = 0;
	*before_p = 0;
	for (uint32_t n = 0; n < c->N; n++)
		for (uint32_t p = n * c->G; n != o / c->G && p < (n + 1) * c->G; p++)
			if (hosts(c, wk, i, p)) {
				n_away++;
				*before_p += n < node;
				break;
			}
	return n_away;
}

/* What rank q returns for owner rank o's token i, element h, in combine_order_check. On o's
 * node the first rank hosting it gives +2^30, the second -2^30; when two or more other nodes
 * host it, the first of them (ascending) gives +2^27 from its first hosting rank, the second
 * -2^27; every other rank 1 + h % 3. In the documented order the big terms cancel pairwise
 * before a small one comes; where a small term comes first a big one absorbs it. */
static float order_term(const cl_t *c, const rw_wl_work_t *wk, uint32_t o, uint32_t i, uint32_t q,
			uint32_t h)
{
	const uint32_t node = q / c->G;
	uint32_t k = 0, m;
	for (uint32_t p = node * c->G; p < q; p++)
		k += (uint32_t)hosts(c, wk, i, p);
	if (node == o / c->G)
		return k == 0 ? 1073741824.0f : k == 1 ? -1073741824.0f : 0.0f;
	if (away_nodes(c, wk, o, i, node, &m) >= 2 && k == 0 && m < 2)
		return m == 0 ? 134217728.0f : -134217728.0f;
	return 1.0f + (float)(h % 3);
}

static float as_dtype(float v, int bf16)
{
	return bf16 ? rw_bf16_to_f32(rw_bf16_from_f32(v)) : v;
}

/* docs/dataflow.md "Combine", element h of owner rank o's token i: +0, then its own node's ranks'
 * rows by rank, then each other node's row (its ranks' fp32 sum, rounded once) by node, added
 * in fp32 in that order and rounded once. */
static float order_sum(const cl_t *c, const rw_wl_work_t *wk, uint32_t o, uint32_t i, uint32_t h,
		       int bf16)
{
	const uint32_t home = o / c->G;
	float acc = 0.0f;
	for (uint32_t q = home * c->G; q < (home + 1) * c->G; q++)
		if (hosts(c, wk, i, q))
			acc += order_term(c, wk, o, i, q, h);
	for (uint32_t n = 0; n < c->N; n++) {
		if (n == home)
			continue;
		float row = 0.0f;
		uint32_t terms = 0;
		for (uint32_t q = n * c->G; q < (n + 1) * c->G; q++)
			if (hosts(c, wk, i, q))
				row = terms++ ? row + order_term(c, wk, o, i, q, h) : order_term(c, wk, o, i, q, h);
		if (terms)
			acc += as_dtype(row, bf16);
	}
	return as_dtype(acc, bf16);
}

uint32_t combine_order_check(cl_t *c, uint32_t step, uint32_t layer, int rows_first)
{
	const int bf16 = rw_wl_bf16(step, layer);
	const uint32_t row = c->hidden * (bf16 ? 2 : 4);
	const uint64_t cbytes = c->E > RW_CQE_INLINE_COUNTS ? ((4ull * c->E + 15) & ~15ull) : 0;
	const uint64_t meta_bytes = 16 + 8 * TOPK;
	const uint64_t cap = (c->out_cap - cbytes) / (row + meta_bytes);

	for (uint32_t q = 0; q < c->W; q++) { /* every rank's combine rows: order_term's */
		trank_t *t = &c->rk[q];
		const uint8_t *metas = t->mem + c->off_out + cbytes + cap * row;
		for (uint32_t j = 0; j < t->dq.recv_tokens; j++) {
			uint32_t o, i;
			memcpy(&o, metas + j * meta_bytes + 4, 4);
			memcpy(&i, metas + j * meta_bytes + 8, 4);
			cl_gen(c, step, layer, o, &c->other);
			for (uint32_t h = 0; h < c->hidden; h++)
				c->outv[h] = order_term(c, &c->other, o, i, q, h);
			rw_wl_put_row(t->mem + c->off_cin + (uint64_t)j * row, bf16, c->outv, c->hidden);
		}
		rank_push(c, t, c->off_cin, c->comb_in);
	}
	if (rows_first) { /* the last node's rows reach node 0 first, before its ranks submit */
		for (uint32_t n = 1; n + 1 < c->N; n++)
			hold(c, m_write((int)n, 0, 1));
		for (uint32_t r = c->G; r < c->W; r++)
			combine_submit(c, r, step, layer);
		settle(c);
		for (uint32_t r = 0; r < c->G; r++)
			combine_submit(c, r, step, layer);
		settle(c);
		release_all(c);
	} else { /* ... or after node 0's local work, in node order */
		for (uint32_t n = 1; n < c->N; n++)
			hold(c, m_write((int)n, 0, 1));
		for (uint32_t r = 0; r < c->W; r++)
			combine_submit(c, r, step, layer);
		settle(c);
		release_all(c);
	}
	uint32_t mixed = 0;
	for (uint32_t o = 0; o < c->W; o++) {
		trank_t *t = &c->rk[o];
		rw_cqe_t cq = next_cqe(c, o);
		CHECK(cq.status == RW_CQ_OK, "rank %u combine failed: error %d", o, cq.error);
		rank_pull(c, t, c->off_cout, c->comb_out);
		cl_gen(c, step, layer, o, &c->mine);
		for (uint32_t i = 0; i < c->mine.n; i++) {
			uint32_t home = 0, away = 0, before;
			for (uint32_t q = 0; q < c->W; q++)
				*(q / c->G == o / c->G ? &home : &away) += (uint32_t)hosts(c, &c->mine, i, q);
			const uint32_t nodes = away_nodes(c, &c->mine, o, i, c->N, &before);
			mixed += c->N == 2 ? home >= 2 && away >= 1 : nodes >= 3;
			for (uint32_t h = 0; h < c->hidden; h++) {
				float want = order_sum(c, &c->mine, o, i, h, bf16);
				float got = rw_wl_get_elem(t->mem + c->off_cout + (uint64_t)i * row, bf16, h);
				CHECK(got == want && !signbit(got) == !signbit(want),
				      "rank %u token %u elem %u (%u terms at home, %u away; the other "
				      "nodes' rows %s): combine %g, in the documented order %g", o, i, h,
				      home, away,
				      rows_first ? "first" : "last", got, want);
			}
		}
	}
	return mixed;
}

/* ---- after a failure ---------------------------------------------------------------------------- */

/* Every rank retries the failed key (step, layer) at once, as a trainer does once the failure
 * has reached every node: the retry must pass at once on every node, with no refusal and no
 * timer (a late PHASE_ERR of the failed attempt names that attempt - its cause, and the epoch of
 * the receiver's row it had - so it cannot fail or poison the retry; docs/dataflow.md
 * "Failures"). Everything is checked exactly. */
void retry_key(cl_t *c, uint32_t step, uint32_t layer)
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
void node_crash(cl_t *c, uint32_t n)
{
	fk_kill(c->w, n);
	for (uint32_t g = 0; g < c->G; g++)
		fk_client_die(c->rk[n * c->G + g].c);
	node_stop(c, n);
}

/* No failure under test may have needed a phase timeout. */
void expect_no_timeouts(cl_t *c)
{
	for (uint32_t n = 0; n < c->N; n++)
		if (c->running[n])
			CHECK(c->svc[n].metrics.errors[-RW_ERR_TIMEOUT] == 0, "node %u: a phase timed out", n);
}

void expect_quiet_but(cl_t *c, uint32_t gone, uint32_t gone_end)
{
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		if (r < gone || r >= gone_end)
			expect_no_cqe(c, r);
	expect_no_timeouts(c);
}

/* ---- holding events back ------------------------------------------------------------------------ */

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

void hold(cl_t *c, match_t m)
{
	held[n_held++] = m;
	c->w->hold = hold_fn;
}

void release_all(cl_t *c)
{
	n_held = 0;
	c->w->hold = NULL;
}

match_t m_ctrl(int type, int src, int dst) { return (match_t){ FK_EV_CTRL, type, src, dst, -1 }; }
match_t m_write(int src, int dst, int wkind) { return (match_t){ FK_EV_WRITE, -1, src, dst, wkind }; }
match_t m_wdone(int src) { return (match_t){ FK_EV_WDONE, -1, src, -1, -1 }; }

/* ---- corrupting a write ------------------------------------------------------------------------- */

int corrupt_once;

void corrupt_tag(const fk_ev_t *ev, uint8_t *dst, void *ctx)
{
	const uint32_t kind = ctx ? *(const uint32_t *)ctx : 0;
	if (corrupt_once && ev->src == 1 && ev->dst == 0 && ((ev->imm >> 17) & 1u) == kind) {
		corrupt_once = 0;
		dst[0] ^= 0xff; /* the first record's tag */
	}
}
