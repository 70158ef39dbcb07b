/* rank/ (librailwave's rank path, docs/rankpath.md) against a real IPC server, on the kernel
 * stand-in driver (tests/integration/libfakecuda_kern.so: streams are real queues, waits hold
 * their own stream, the count kernel runs on the CPU with the arithmetic cuda/kernels.cu states),
 * or on a GPU with RW_CUDA_DRIVER=libcuda.so.1.
 * The server runs in a forked child (its own process, as railwaved would be) lending rank pages
 * and reporting each word move it judged through a pipe; this process is the rank. Until the
 * executor consumes the words, this process also plays the daemon's part on the page: it writes
 * plan, arrived and the status lines through its own mapping of the same memory, as the daemon's
 * CPU does. A case checks what the stream wrote and what the daemon's side saw. */
#include <dlfcn.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <ev.h>

#include "common/common.h"
#include "common/wire_rec.h"
#include "config.h"
#include "cuda/rw_cuda.h"
#include "ipc/ipc.h"
#include "ipc/page.h"
#include "ipc/railwave.h"
#include "rank/rank.h"
#include "sched/sched.h"

#define EXPERTS 64
#define MAX_TOKENS 512

static char fake_driver[PATH_MAX];
/* On the stand-in: its per-process counts of what this process asked of the GPU
 * ($RW_FAKE_CUDA_COUNTS, tests/cuda/fake_cuda_base.h), read by the graph case. */
static char counts_dir[64];
enum { C_HOST_FN, C_KERNEL, C_WORK, C_WORD_WRITE, C_WORD_WAIT, C_END };

/* This process's counts; 0 when not on the stand-in. */
static int fake_counts(uint64_t c[C_END])
{
	if (!counts_dir[0])
		return 0;
	char path[128];
	snprintf(path, sizeof(path), "%s/%d", counts_dir, (int)getpid());
	FILE *f = fopen(path, "rb");
	assert_non_null(f);
	assert_int_equal(fread(c, sizeof(uint64_t), C_END, f), C_END);
	fclose(f);
	return 1;
}

/* ---------------------------------------------------------------------------------------------
 * The server: a child process with the IPC server on its loop, lending pages
 * ------------------------------------------------------------------------------------------- */

typedef struct report {
	uint32_t word;
	uint64_t value;
} report_t;

typedef struct server {
	char dir[64], path[96];
	pid_t pid;
	int reports;           /* read end: the page words the server judged and passed on */
	uint32_t nodes, gpus, rails;
	uint8_t gpu_rail[RW_MAX_GPUS];
	uint64_t heard[RW_PW_COUNT];
} server_t;

static int report_fd = -1; /* the child's write end */
static server_t servers[2]; /* a case's servers (pid 0: free); a failed case's are killed by
			       its teardown */

static void child_page_word(void *ctx, rw_ipc_client_t *c, unsigned word, uint64_t value)
{
	(void)ctx, (void)c;
	report_t r = { .word = word, .value = value };
	if (write(report_fd, &r, sizeof(r)) != (ssize_t)sizeof(r))
		_exit(3);
}

static void child_ignore(void *ctx, rw_ipc_client_t *c, const rw_sqe_t *sqe)
{
	(void)ctx, (void)c, (void)sqe;
}

/* The group's slab of each rail, as railwaved's carve-out lends it: a sealed memfd of five
 * areas (dispatch and combine receive, dispatch and combine send, local). One group here. */
#define AREA (2u << 20)
static int child_slab_fd[RW_CUDA_RANK_RAILS];
static uint32_t child_rails;

static int child_group_slab(void *ctx, rw_ipc_client_t *c, uint32_t rail, rw_ipc_slab_t *sl,
			    const char **why)
{
	(void)ctx, (void)c;
	if (rail >= child_rails) {
		*why = "no such rail";
		return RW_E_INVAL;
	}
	if (child_slab_fd[rail] <= 0) {
		int fd = memfd_create("rw-test-slab", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		if (fd < 0 || ftruncate(fd, 5 * (off_t)AREA) < 0 ||
		    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
			_exit(4);
		child_slab_fd[rail] = fd;
	}
	*sl = (rw_ipc_slab_t){ .fd = child_slab_fd[rail], .bytes = 5 * (uint64_t)AREA,
			       .rails = child_rails, .area_bytes = AREA,
			       .recv_off = { 0, AREA }, .send_off = { 2 * AREA, 3 * AREA },
			       .local_off = 4 * (uint64_t)AREA };
	return 0;
}

static void child_run(const server_t *s, int ready, int page_rails)
{
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	rw_ipc_server_config_t cfg;
	memset(&cfg, 0, sizeof(cfg));
	cfg.socket_path = s->path;
	cfg.node = -1;
	cfg.max_buffers = 4;
	cfg.max_tokens = MAX_TOKENS;
	cfg.max_hidden = 8192;
	cfg.max_topk = 32;
	cfg.max_world = 1024;
	cfg.max_local_gpu = RW_MAX_GPUS;
	cfg.world_size = s->nodes * s->gpus;
	cfg.gpus_per_node = s->gpus;
	cfg.page_rails = page_rails ? s->rails : 0;
	cfg.page_max_recv = 1024;
	cfg.page_gpu_rail = s->gpu_rail;
	child_rails = s->rails;
	const rw_ipc_server_ops_t ops = { .submission = child_ignore, .page_word = child_page_word,
					  .group_slab = page_rails == 1 ? child_group_slab : NULL };
	rw_ipc_server_t *srv = NULL;
	if (!loop || rw_ipc_server_create(loop, &cfg, &ops, NULL, &srv) != RW_OK)
		_exit(1);
	char x = 'r';
	if (write(ready, &x, 1) != 1)
		_exit(1);
	ev_run(loop, 0); /* until killed */
	_exit(0);
}

/* Start a server for nodes x gpus ranks over `rails` rails (GPU g on rail gpu_rail[g]); with
 * page_rails 0 it lends no page, 1 pages and group slabs, 2 pages and no slabs. Call before this process loads the driver, or from a case that
 * did: the child never touches CUDA. */
static server_t *server_start(uint32_t nodes, uint32_t gpus, uint32_t rails,
			      const uint8_t *gpu_rail, int page_rails)
{
	server_t *s = &servers[servers[0].pid != 0];
	assert_int_equal(s->pid, 0);
	memset(s, 0, sizeof(*s));
	s->nodes = nodes;
	s->gpus = gpus;
	s->rails = rails;
	for (uint32_t g = 0; g < gpus; g++)
		s->gpu_rail[g] = gpu_rail ? gpu_rail[g] : (uint8_t)(g % rails);
	char dir[sizeof(s->dir)] = "/tmp/rw-rank-test.XXXXXX";
	assert_non_null(mkdtemp(dir));
	memcpy(s->dir, dir, sizeof(dir));
	snprintf(s->path, sizeof(s->path), "%s/rw.sock", dir);
	int ready[2], rep[2];
	assert_int_equal(pipe(ready), 0);
	assert_int_equal(pipe(rep), 0);
	s->pid = fork();
	assert_true(s->pid >= 0);
	if (s->pid == 0) {
		close(ready[0]);
		close(rep[0]);
		report_fd = rep[1];
		child_run(s, ready[1], page_rails);
	}
	close(ready[1]);
	close(rep[1]);
	s->reports = rep[0];
	char x;
	assert_int_equal(read(ready[0], &x, 1), 1);
	close(ready[0]);
	return s;
}

static void server_kill(server_t *s)
{
	if (s->pid <= 0)
		return;
	kill(s->pid, SIGKILL);
	int status;
	waitpid(s->pid, &status, 0);
	s->pid = 0;
	close(s->reports);
	unlink(s->path);
	rmdir(s->dir);
}

/* The last value the server passed on for `word`, reading its reports until it is at least
 * `want` (liveness bound of 10 s, not a timing assertion). */
static uint64_t server_heard(server_t *s, unsigned word, uint64_t want)
{
	for (int i = 0; i < 1000 && (int64_t)(s->heard[word] - want) < 0; i++) {
		struct pollfd p = { .fd = s->reports, .events = POLLIN };
		if (poll(&p, 1, 10) <= 0)
			continue;
		report_t r;
		assert_int_equal(read(s->reports, &r, sizeof(r)), (ssize_t)sizeof(r));
		assert_true(r.word < RW_PW_COUNT);
		s->heard[r.word] = r.value;
	}
	return s->heard[word];
}

/* ---------------------------------------------------------------------------------------------
 * The rank: a client, its rank path, a stream
 * ------------------------------------------------------------------------------------------- */

typedef struct rank {
	rw_client_t *client;
	rw_client_rank_t *rp;
	rw_cuda_stream_t *stream;
	rw_client_stream_t cs;
	uint32_t local_gpu;
	rw_cuda_dptr_t ids;    /* device buffers: the top-k ids, weights, rows */
	rw_cuda_dptr_t w, x;
	rw_cuda_dptr_t recv_x, recv_meta, recv_counts; /* the dispatch's outputs */
} rank_t;

#define HIDDEN_MAX 128
#define RECV_CAP 1024

static rw_client_t *connect_to(const server_t *s, uint32_t local_gpu)
{
	rw_client_opts_t o;
	memset(&o, 0, sizeof(o));
	o.socket_path = s->path;
	o.group = "g";
	o.rank = local_gpu;
	o.world_size = s->nodes * s->gpus;
	o.node = 0;
	o.local_gpu = (int32_t)local_gpu;
	o.timeout_ms = 5000;
	rw_client_t *c = NULL;
	int rc = rw_client_connect(&o, &c);
	if (rc)
		fail_msg("connect: %s", rw_client_strerror(rc));
	return c;
}

/* Connect and open the rank path (static: in static mode) with an SM budget (0: none; 2: set
 * after the open with rw_client_rank_set_sms, any other through rw_client_rank_open_opts);
 * skips the case where this build has no kernel image. */
static void rank_open_sms(rank_t *rk, const server_t *s, uint32_t local_gpu, int static_mode,
			  int32_t max_sms)
{
	memset(rk, 0, sizeof(*rk));
	rk->local_gpu = local_gpu;
	rk->client = connect_to(s, local_gpu);
	const rw_client_rank_opts_t o = { .max_recv = 256, .max_sms = max_sms,
					  .flags = static_mode ? RW_RANK_OPEN_STATIC : 0 };
	int rc = max_sms && max_sms != 2 ? rw_client_rank_open_opts(rk->client, 0, &o, &rk->rp)
		 : static_mode		  ? rw_client_rank_open_static(rk->client, 0, 256, &rk->rp)
					  : rw_client_rank_open(rk->client, 0, 256, &rk->rp);
	if (rc == 0 && max_sms == 2)
		rc = rw_client_rank_set_sms(rk->rp, 2);
	if (rc == RW_E_NO_CUDA && !rw_cuda_kernels_available(0)) {
		rw_client_close(rk->client);
		print_message("skipped: %s\n", rw_client_rank_message(NULL));
		skip();
	}
	if (rc)
		fail_msg("rank open: %s: %s", rw_client_strerror(rc), rw_client_rank_message(NULL));
	assert_int_equal(rw_cuda_stream_create(0, &rk->stream), RW_OK);
	rw_cuda_ext_stream_t e;
	assert_int_equal(rw_cuda_ext_stream_of(rk->stream, &e), RW_OK);
	rk->cs = (rw_client_stream_t){ .device = e.device, .handle = e.handle };
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)MAX_TOKENS * 32 * 4, &rk->ids), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)MAX_TOKENS * 32 * 4, &rk->w), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)MAX_TOKENS * HIDDEN_MAX * 4, &rk->x), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)RECV_CAP * HIDDEN_MAX * 4, &rk->recv_x),
			 RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)RECV_CAP * (16 + 8 * 32), &rk->recv_meta),
			 RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)EXPERTS * 4, &rk->recv_counts), RW_OK);
}

static void rank_open_mode(rank_t *rk, const server_t *s, uint32_t local_gpu, int static_mode)
{
	rank_open_sms(rk, s, local_gpu, static_mode, 0);
}

static void rank_open(rank_t *rk, const server_t *s, uint32_t local_gpu)
{
	rank_open_mode(rk, s, local_gpu, 0);
}

/* On the stand-in: the largest grid (blocks) this process launched since the last look
 * (tests/integration/fake_cuda_rank.h rw_fake_cuda_grid_take); -1 on another driver. */
static long long grid_take(void)
{
	if (strcmp(getenv("RW_CUDA_DRIVER"), fake_driver) != 0)
		return -1;
	void *h = dlopen(fake_driver, RTLD_NOLOAD | RTLD_LAZY);
	assert_non_null(h);
	unsigned long long (*take)(void);
	*(void **)&take = dlsym(h, "rw_fake_cuda_grid_take");
	assert_non_null(take);
	const long long g = (long long)take();
	dlclose(h);
	return g;
}

static void rank_close(rank_t *rk)
{
	rw_cuda_stream_destroy(rk->stream);
	rw_cuda_mem_free(0, rk->ids);
	rw_cuda_mem_free(0, rk->w);
	rw_cuda_mem_free(0, rk->x);
	rw_cuda_mem_free(0, rk->recv_x);
	rw_cuda_mem_free(0, rk->recv_meta);
	rw_cuda_mem_free(0, rk->recv_counts);
	rw_client_rank_close(rk->rp);
	rw_client_close(rk->client);
}

static rw_page_head_t *page_of(const rank_t *rk) { return rk->rp->pg; }

static uint64_t word(const rank_t *rk, unsigned w)
{
	return atomic_load_explicit(&page_of(rk)->word[w].v, memory_order_acquire);
}

static uint8_t *slot(const rank_t *rk, uint64_t k)
{
	const rw_page_layout_t *l = &rk->rp->layout;
	return (uint8_t *)page_of(rk) + l->slot0 + (size_t)(k % RW_PAGE_DEPTH) * l->slot_bytes;
}

static const uint32_t *count_row(const rank_t *rk, uint64_t k)
{
	return (const uint32_t *)(slot(rk, k) + rk->rp->layout.count_row);
}

static const rw_page_params_t *params(const rank_t *rk, uint64_t k)
{
	return (const rw_page_params_t *)(slot(rk, k) + rk->rp->layout.params);
}

static const rw_page_layout_t *lay(const rank_t *rk) { return &rk->rp->layout; }

/* The daemon's plan for dispatch phase k as the simplest plan would place it: every record on
 * the rank's native rail, each node's records consecutive in that rail's send area (this node's
 * in its local area), from the slot's parameters and count row; status 0, then plan = k (P2). */
static void daemon_plan(const rank_t *rk, uint64_t k)
{
	rw_page_head_t *pg = page_of(rk);
	uint8_t *sl = slot(rk, k);
	const rw_page_params_t *p = params(rk, k);
	const uint32_t nodes = pg->nodes, rails = pg->rails, rail = pg->rail;
	const uint32_t eb = p->dtype == RW_DTYPE_BF16 ? 2 : 4;
	rw_page_plan_head_t *h = (rw_page_plan_head_t *)(sl + lay(rk)->plan);
	rw_page_plan_rail_t *pr = (rw_page_plan_rail_t *)(sl + lay(rk)->plan_rail);
	uint32_t *tags = (uint32_t *)(sl + lay(rk)->plan_tag);
	rw_page_plan_entry_t *ent = (rw_page_plan_entry_t *)(sl + lay(rk)->plan_entry);
	*h = (rw_page_plan_head_t){ .phase = k, .kind = 0, .me = pg->node, .owner = pg->owner,
				    .topk = p->topk,
				    .rec_size = (uint32_t)rw_sched_rec_bytes(p->topk, p->hidden, eb),
				    .row_off = (uint32_t)rw_wire_rec_row_off(p->topk) };
	for (uint32_t e = 0; e < rails; e++) {
		const rw_client_slab_t *sb = &rk->rp->slab[e].lent;
		pr[e] = (rw_page_plan_rail_t){ .send_off = sb->send_off[0], .recv_off = sb->recv_off[0],
					       .local_off = sb->local_off, .slab_bytes = sb->bytes };
	}
	const uint32_t *row = count_row(rk, k);
	uint64_t sent = 0;
	for (uint32_t d = 0; d < nodes; d++) {
		tags[d] = 0x7a000000u | d;
		for (uint32_t e = 0; e < rails; e++) {
			const uint32_t n = e == rail ? row[d * rails + e] : 0;
			const uint64_t at = d == pg->node ? pr[e].local_off : pr[e].send_off + sent;
			ent[d * rails + e] = (rw_page_plan_entry_t){ .first = 0, .count = n,
								     .offset = at };
			if (d == pg->node)
				h->n_local += n;
			else
				h->n_send += n, sent += (uint64_t)n * h->rec_size;
		}
	}
	/* where the combine's inputs are staged: the second half of each rank's native rail's
	 * local area (g % rails), the ranks of a rail one after another */
	rw_page_stage_t *st = (rw_page_stage_t *)(sl + lay(rk)->plan_stage);
	const uint64_t stride = ((uint64_t)pg->max_recv * p->hidden * eb + 63) / 64 * 64;
	h->n_stage = pg->gpus;
	for (uint32_t g = 0; g < pg->gpus; g++)
		st[g] = (rw_page_stage_t){ .off = pr[g % rails].local_off + AREA / 2 +
						  (g / rails) * stride,
					   .rail = g % rails, .rows = pg->max_recv };
	atomic_store_explicit(&pg->status[k % RW_PAGE_DEPTH].v, 0, memory_order_relaxed);
	atomic_store_explicit(&pg->word[RW_PW_PLAN].v, k, memory_order_release);
}

/* The daemon's forward list for phase k (n entries), then arrived = k (P4). */
static void daemon_arrive(const rank_t *rk, uint64_t k, const rw_page_list_entry_t *list,
			  uint32_t n)
{
	uint8_t *sl = slot(rk, k);
	*(rw_page_list_head_t *)(sl + lay(rk)->list) =
		(rw_page_list_head_t){ .phase = k, .count = n, .kind = 0 };
	if (n)
		memcpy(sl + lay(rk)->list_entry, list, n * sizeof(*list));
	atomic_store_explicit(&page_of(rk)->word[RW_PW_ARRIVED].v, k, memory_order_release);
}

/* The daemon's part of a good phase k that brings this rank nothing. */
static void daemon_release(const rank_t *rk, uint64_t k)
{
	daemon_plan(rk, k);
	daemon_arrive(rk, k, NULL, 0);
}

/* The daemon's plan for combine phase k of dispatch kd (one node of one rank, its n rows given
 * back): this rank's copy of rail 0's local records a quarter into the local area, record j's one
 * term its own row j, staged where the dispatch's plan said; then plan = k. Returns where the
 * combine's local area starts in rail 0's slab. */
static uint64_t daemon_plan_combine(const rank_t *rk, uint64_t k, uint64_t kd, uint32_t n)
{
	uint8_t *sl = slot(rk, k);
	const rw_page_params_t *p = params(rk, k);
	const rw_page_plan_head_t *dh = (const rw_page_plan_head_t *)(slot(rk, kd) + lay(rk)->plan);
	const uint32_t eb = p->dtype == RW_DTYPE_BF16 ? 2 : 4;
	const uint32_t crec = (uint32_t)rw_sched_crec_bytes(p->hidden, eb);
	rw_page_plan_head_t *h = (rw_page_plan_head_t *)(sl + lay(rk)->plan);
	rw_page_plan_rail_t *pr = (rw_page_plan_rail_t *)(sl + lay(rk)->plan_rail);
	uint32_t *tags = (uint32_t *)(sl + lay(rk)->plan_tag);
	rw_page_plan_entry_t *ent = (rw_page_plan_entry_t *)(sl + lay(rk)->plan_entry);
	uint32_t *term_off = (uint32_t *)(sl + lay(rk)->term_off);
	uint32_t *term_ref = (uint32_t *)(sl + lay(rk)->term_ref);
	*h = (rw_page_plan_head_t){ .phase = k, .kind = 1, .me = 0, .owner = 0, .rec_size = crec,
				    .row_off = 16, .n_stage = dh->n_stage };
	memcpy(sl + lay(rk)->plan_stage, slot(rk, kd) + lay(rk)->plan_stage,
	       dh->n_stage * sizeof(rw_page_stage_t));
	const rw_client_slab_t *sl0 = &rk->rp->slab[0].lent;
	const uint64_t comb_local = sl0->local_off + AREA / 4;
	for (uint32_t e = 0; e < page_of(rk)->rails; e++) {
		const rw_client_slab_t *se = &rk->rp->slab[e].lent;
		pr[e] = (rw_page_plan_rail_t){ .send_off = se->send_off[1], .recv_off = se->recv_off[1],
					       .local_off = comb_local, .slab_bytes = se->bytes };
		ent[e] = (rw_page_plan_entry_t){ .first = 0, .count = e == 0 ? n : 0,
						 .offset = comb_local };
	}
	tags[0] = 0x7b000000u;
	for (uint32_t j = 0; j <= n; j++)
		term_off[j] = j;
	for (uint32_t j = 0; j < n; j++)
		term_ref[j] = RW_PAGE_TERM(0, j);
	atomic_store_explicit(&page_of(rk)->status[k % RW_PAGE_DEPTH].v, 0, memory_order_relaxed);
	atomic_store_explicit(&page_of(rk)->word[RW_PW_PLAN].v, k, memory_order_release);
	return comb_local;
}

/* A server for 2 nodes x 4 GPUs over 2 rails, and rank `local_gpu` on it with its rank path. */
static server_t *rank_setup(rank_t *rk, uint32_t local_gpu)
{
	server_t *s = server_start(2, 4, 2, NULL, 1);
	rank_open(rk, s, local_gpu);
	return s;
}

static void rank_teardown(rank_t *rk, server_t *s)
{
	rank_close(rk);
	server_kill(s);
}

/* The daemon's part of a good phase k, then the eager completion answers 0. */
static void phase_finish(rank_t *rk, uint64_t k)
{
	daemon_release(rk, k);
	assert_int_equal(rw_client_rank_wait(rk->rp, k, 10000, NULL), 0);
}

/* A phase's routing: n tokens x topk ids in [0, EXPERTS) with some -1 slots, from `seed`. */
typedef struct routing {
	uint32_t n, topk;
	int32_t ids[MAX_TOKENS * 32];
} routing_t;

static uint64_t mix(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static void routing_gen(routing_t *rt, uint64_t seed, uint32_t n, uint32_t topk)
{
	rt->n = n;
	rt->topk = topk;
	for (uint32_t i = 0; i < n * topk; i++) {
		uint64_t z = mix(seed * 1000003u + i);
		rt->ids[i] = z % 11 == 0 ? -1 : (int32_t)((z >> 32) % EXPERTS);
	}
}

/* Token t's row element h, weight j: small integers and halves, exact in bf16 and fp32. */
static float x_val(uint32_t t, uint32_t h) { return (float)((int)((t * 7 + h * 3) % 201) - 100); }
static float w_val(uint32_t t, uint32_t j) { return (float)((t + j) % 4) * 0.5f; }

/* Token t's row into dst as bf16 (the top half of the fp32: exact for these values) or fp32. */
static void put_row(uint8_t *dst, uint32_t t, int bf16, uint32_t hidden)
{
	for (uint32_t h = 0; h < hidden; h++) {
		float v = x_val(t, h);
		uint32_t u;
		memcpy(&u, &v, 4);
		if (bf16) {
			uint16_t b = (uint16_t)(u >> 16);
			memcpy(dst + 2 * h, &b, 2);
		} else {
			memcpy(dst + 4 * h, &u, 4);
		}
	}
}

/* The rows and weights of the routing's tokens into the rank's device buffers. */
static void load_rows(rank_t *rk, const routing_t *rt, int bf16, uint32_t hidden)
{
	static uint8_t rows[MAX_TOKENS * HIDDEN_MAX * 4];
	static float w[MAX_TOKENS * 32];
	for (uint32_t t = 0; t < rt->n; t++) {
		put_row(rows + (size_t)t * hidden * (bf16 ? 2 : 4), t, bf16, hidden);
		for (uint32_t j = 0; j < rt->topk; j++)
			w[t * rt->topk + j] = w_val(t, j);
	}
	if (rt->n) {
		assert_int_equal(rw_cuda_memcpy_htod(0, rk->x, rows,
						     (size_t)rt->n * hidden * (bf16 ? 2 : 4)), RW_OK);
		assert_int_equal(rw_cuda_memcpy_htod(0, rk->w, w, (size_t)rt->n * rt->topk * 4),
				 RW_OK);
	}
}

/* Copy the ids into the rank's device buffer (a blocking copy: before any stream is held). */
static void load_ids(rank_t *rk, const routing_t *rt)
{
	if (rt->n)
		assert_int_equal(rw_cuda_memcpy_htod(0, rk->ids, rt->ids, (size_t)rt->n * rt->topk * 4),
				 RW_OK);
	load_rows(rk, rt, 1, 128);
}

/* A dispatch call of the routing in the rank's buffers. */
static rw_client_rank_dispatch_t dispatch_args(const rank_t *rk, const routing_t *rt, int bf16,
					       uint32_t hidden, uint32_t layer)
{
	return (rw_client_rank_dispatch_t){
		.dtype = bf16 ? RW_DTYPE_BF16 : RW_DTYPE_FP32, .topk = (uint16_t)rt->topk,
		.layer = layer, .step = 5, .token_count = rt->n, .hidden = hidden,
		.n_experts = EXPERTS, .tokens = rk->x, .topk_ids = rk->ids, .topk_weights = rk->w,
		.recv_x = rk->recv_x, .recv_meta = rk->recv_meta, .recv_counts = rk->recv_counts,
		.recv_cap = RECV_CAP };
}

/* Dispatch the routing already in the rank's id buffer. */
static uint64_t dispatch_loaded(rank_t *rk, const routing_t *rt, uint32_t layer)
{
	rw_client_rank_dispatch_t d = dispatch_args(rk, rt, 1, 128, layer);
	uint64_t k = 0;
	int rc = rw_client_rank_dispatch(rk->rp, &rk->cs, &d, &k);
	if (rc)
		fail_msg("dispatch: %s: %s", rw_client_strerror(rc), rw_client_rank_message(rk->rp));
	return k;
}

static uint64_t dispatch(rank_t *rk, const routing_t *rt, uint32_t layer)
{
	load_ids(rk, rt);
	return dispatch_loaded(rk, rt, layer);
}

/* sched/'s host count of this rank's routing: what the daemon counts for a host rank. */
static void host_row(const server_t *s, const rank_t *rk, const routing_t *rt, uint32_t *row)
{
	rw_topo_t topo;
	assert_int_equal(rw_sched_topo_init(&topo, s->nodes, s->gpus, s->rails), RW_OK);
	memcpy(topo.gpu_rail, s->gpu_rail, sizeof(topo.gpu_rail));
	rw_rank_tokens_t t = { .local_gpu = rk->local_gpu, .n_tokens = rt->n, .topk = rt->topk,
			       .expert_ids = rt->ids };
	assert_int_equal(rw_sched_count(&topo, EXPERTS, 0, &t, 1, row, NULL), RW_OK);
}

/* ---------------------------------------------------------------------------------------------
 * Cases
 * ------------------------------------------------------------------------------------------- */

/* Over two geometries and several phases each: the count row the rank's stream wrote into the
 * phase's slot equals sched/'s host count for the same ids, the parameters are the call's, the
 * server saw submit move to k, and once the daemon's words come the stream writes done = k and
 * the eager completion answers 0. */
static void test_count_row_is_the_host_count(void **state)
{
	(void)state;
	static const uint8_t odd_rails[] = { 2, 0, 1, 2 };
	const struct { uint32_t nodes, gpus, rails, local_gpu; const uint8_t *gpu_rail; } geo[] = {
		{ 2, 4, 2, 1, NULL }, { 4, 4, 3, 0, odd_rails }, { 8, 2, 1, 1, NULL } };
	static routing_t rt;
	for (unsigned gi = 0; gi < sizeof(geo) / sizeof(geo[0]); gi++) {
		rank_t rk;
		server_t *s = server_start(geo[gi].nodes, geo[gi].gpus, geo[gi].rails, geo[gi].gpu_rail, 1);
		rank_open(&rk, s, geo[gi].local_gpu);
		assert_int_equal(page_of(&rk)->rail, s->gpu_rail[geo[gi].local_gpu]);
		const size_t cells = (size_t)s->nodes * s->rails;
		for (uint32_t ph = 0; ph < 6; ph++) {
			uint32_t n = ph == 2 ? 0 : (uint32_t)(mix(gi * 31 + ph) % MAX_TOKENS) + 1;
			routing_gen(&rt, gi * 100 + ph, n, 1 + ph % 8);
			uint64_t k = dispatch(&rk, &rt, ph);
			assert_int_equal(k, ph + 1);
			assert_int_equal(server_heard(s, RW_PW_SUBMIT, k), k);
			uint32_t want[64];
			host_row(s, &rk, &rt, want);
			assert_memory_equal(count_row(&rk, k), want, cells * sizeof(uint32_t));
			const rw_page_params_t *p = params(&rk, k);
			assert_int_equal(p->phase, k);
			assert_int_equal(p->kind, RW_KIND_DISPATCH);
			assert_int_equal(p->token_count, n);
			assert_int_equal(p->topk, rt.topk);
			assert_int_equal(p->layer, ph);
			assert_int_equal(p->n_experts, EXPERTS);
			assert_int_equal(p->bad, 0);
			assert_int_equal(rw_client_rank_wait(rk.rp, k, 0, NULL), RW_E_TIMEOUT);
			phase_finish(&rk, k);
			assert_int_equal(word(&rk, RW_PW_DONE), k);
			assert_int_equal(server_heard(s, RW_PW_DONE, k), k);
		}
		rank_teardown(&rk, s);
	}
}

/* A record's header: u32 tag | u16 | u16 | u32 (dispatch: source node, owner, token; combine:
 * source node, rail, slot; common/wire_rec.h). */
static void expect_header(const uint8_t *rec, uint32_t tag, uint16_t a, uint16_t b, uint32_t c)
{
	uint32_t t32, c32;
	uint16_t a16, b16;
	memcpy(&t32, rec + RW_WIRE_REC_TAG, 4);
	memcpy(&a16, rec + RW_WIRE_REC_SRC, 2);
	memcpy(&b16, rec + RW_WIRE_REC_OWNER, 2);
	memcpy(&c32, rec + RW_WIRE_REC_TOKEN, 4);
	assert_int_equal(t32, tag);
	assert_int_equal(a16, a);
	assert_int_equal(b16, b);
	assert_int_equal(c32, c);
}

/* On the stand-in: no launch since the last look took more blocks than the budget, and
 * without one the largest took more than 3 (the budget cases then test something). */
static void expect_grids(int32_t max_sms)
{
	const long long g = grid_take();
	if (g < 0)
		return;
	if (max_sms)
		assert_in_range(g, 1, max_sms);
	else
		assert_true(g > 3);
}

/* A whole dispatch through the rank's stream, one node of two ranks, this rank (local GPU 1,
 * rail 1) playing against the daemon's plan and list: the pack writes a record per token with an
 * expert (all for this node: the local area of rail 1, in token order) with the wire's header,
 * top-k block and row; the forward copies the listed records (those naming this rank's experts)
 * into the outputs: rows, metadata and per-expert counts as the host mover writes them. fp32 and
 * bf16; then a capacity too small: RW_E_OVERFLOW, the rows that fit written, the rest counted. */
static void dispatch_whole(int32_t max_sms)
{
	rank_t rk;
	static routing_t rt;
	server_t *s = server_start(1, 2, 2, NULL, 1);
	rank_open_sms(&rk, s, 1, 0, max_sms);
	grid_take();
	const uint32_t per_rank = EXPERTS / 2, mine = per_rank; /* rank 1: experts 32..63 */
	for (uint32_t ph = 0; ph < 3; ph++) {
		const int bf16 = ph == 1;
		const uint32_t hidden = bf16 ? 128 : 24, eb = bf16 ? 2 : 4, topk = 4;
		routing_gen(&rt, 900 + ph, 60, topk);
		assert_int_equal(rw_cuda_memcpy_htod(0, rk.ids, rt.ids, (size_t)rt.n * topk * 4), RW_OK);
		load_rows(&rk, &rt, bf16, hidden);
		rw_client_rank_dispatch_t d = dispatch_args(&rk, &rt, bf16, hidden, ph);
		if (ph == 2)
			d.recv_cap = 5;
		uint64_t k = 0;
		assert_int_equal(rw_client_rank_dispatch(rk.rp, &rk.cs, &d, &k), 0);
		assert_int_equal(server_heard(s, RW_PW_SUBMIT, k), k);
		daemon_plan(&rk, k);
		assert_int_equal(server_heard(s, RW_PW_PACKED, k), k);
		/* the records, where the plan put them */
		const uint32_t rec_size = (uint32_t)rw_sched_rec_bytes(topk, hidden, eb);
		const uint64_t row_off = rw_wire_rec_row_off(topk);
		const rw_client_slab_t *sl1 = &rk.rp->slab[1].lent;
		const uint8_t *local = (const uint8_t *)sl1->base + sl1->local_off;
		static rw_page_list_entry_t list[MAX_TOKENS];
		static uint8_t want_row[HIDDEN_MAX * 4];
		uint32_t n_rec = 0, m = 0, want_counts[EXPERTS] = { 0 };
		for (uint32_t t = 0; t < rt.n; t++) {
			const int32_t *ids = &rt.ids[t * topk];
			int any = 0, hit = 0;
			for (uint32_t j = 0; j < topk; j++) {
				any |= ids[j] >= 0;
				hit |= ids[j] >= (int32_t)mine;
			}
			if (!any)
				continue;
			const uint8_t *rec = local + (size_t)n_rec * rec_size;
			uint16_t k16;
			expect_header(rec, 0x7a000000u, 0, 1, t); /* tag, source, owner, token */
			memcpy(&k16, rec + RW_WIRE_REC_TOPK, 2);
			assert_int_equal(k16, topk);
			assert_memory_equal(rec + RW_WIRE_REC_HDR, ids, topk * 4);
			put_row(want_row, t, bf16, hidden);
			assert_memory_equal(rec + row_off, want_row, (size_t)hidden * eb);
			if (hit) {
				list[m++] = (rw_page_list_entry_t){ .slot = n_rec, .rail = 1,
								    .area = RW_PAGE_AREA_LOCAL,
								    .node = 0, .token = t };
				if (m <= d.recv_cap)
					for (uint32_t j = 0; j < topk; j++)
						want_counts[ids[j] >= 0 ? ids[j] : 0] +=
							ids[j] >= (int32_t)mine;
			}
			n_rec++;
		}
		assert_int_equal(n_rec, count_row(&rk, k)[1]);
		assert_true(m > 5);
		daemon_arrive(&rk, k, list, m);
		rw_client_rank_done_t done;
		const uint32_t got = m < d.recv_cap ? m : d.recv_cap;
		assert_int_equal(rw_client_rank_wait(rk.rp, k, 10000, &done),
				 ph == 2 ? RW_E_OVERFLOW : 0);
		assert_int_equal(done.recv_tokens, got);
		assert_int_equal(done.overflow, m - got);
		/* the outputs, as the host mover writes them */
		static uint8_t rows[RECV_CAP * HIDDEN_MAX * 4], meta[RECV_CAP * (16 + 8 * 32)];
		uint32_t counts[EXPERTS];
		const uint32_t meta_bytes = 16 + 8 * topk;
		assert_int_equal(rw_cuda_memcpy_dtoh(0, rows, rk.recv_x, (size_t)got * hidden * eb),
				 RW_OK);
		assert_int_equal(rw_cuda_memcpy_dtoh(0, meta, rk.recv_meta, (size_t)got * meta_bytes),
				 RW_OK);
		assert_int_equal(rw_cuda_memcpy_dtoh(0, counts, rk.recv_counts, sizeof(counts)), RW_OK);
		assert_memory_equal(counts, want_counts, sizeof(counts));
		for (uint32_t j = 0; j < got; j++) {
			const uint8_t *rec = local + (size_t)list[j].slot * rec_size;
			assert_memory_equal(rows + (size_t)j * hidden * eb, rec + row_off,
					    (size_t)hidden * eb);
			const uint32_t head[4] = { 0, 1, list[j].token, 0 };
			assert_memory_equal(meta + (size_t)j * meta_bytes, head, 16);
			assert_memory_equal(meta + (size_t)j * meta_bytes + 16, rec + RW_WIRE_REC_HDR,
					    8 * topk);
		}
		if (ph == 2)
			assert_non_null(strstr(rw_client_rank_message(rk.rp), "recv_cap"));
	}
	expect_grids(max_sms);
	rank_teardown(&rk, s);
}

static void test_dispatch_whole(void **state)
{
	(void)state;
	dispatch_whole(0);
}

/* A whole combine after a whole dispatch, one node of one rank (every expert its own), the test
 * playing the daemon: the rank's rows are staged where the dispatch's plan said before its
 * combine submit; the gather writes each received record's combine record (tag, node, rail,
 * slot, the one term's row) where the combine plan puts this rank's copy of the local records;
 * the reduce sums each token's terms from the owner's list, reading the combine's local area
 * from the plan block in place (the daemon decides it after the call), rounded once. fp32, bf16;
 * a second combine of one dispatch, or of a phase that is no dispatch, is refused. */
static void combine_whole(int32_t max_sms)
{
	rank_t rk;
	static routing_t rt;
	server_t *s = server_start(1, 1, 2, NULL, 1);
	rank_open_sms(&rk, s, 0, 0, max_sms);
	grid_take();
	static uint8_t rows[RECV_CAP * HIDDEN_MAX * 4], want[HIDDEN_MAX * 4];
	for (uint32_t ph = 0; ph < 2; ph++) {
		const int bf16 = ph == 1;
		const uint32_t hidden = bf16 ? 64 : 24, eb = bf16 ? 2 : 4, topk = 3;
		const uint64_t row_bytes = (uint64_t)hidden * eb;
		routing_gen(&rt, 700 + ph, 50, topk);
		assert_int_equal(rw_cuda_memcpy_htod(0, rk.ids, rt.ids, (size_t)rt.n * topk * 4), RW_OK);
		load_rows(&rk, &rt, bf16, hidden);
		rw_client_rank_dispatch_t d = dispatch_args(&rk, &rt, bf16, hidden, ph);
		uint64_t kd = 0;
		assert_int_equal(rw_client_rank_dispatch(rk.rp, &rk.cs, &d, &kd), 0);
		assert_int_equal(server_heard(s, RW_PW_SUBMIT, kd), kd);
		daemon_plan(&rk, kd);
		assert_int_equal(server_heard(s, RW_PW_PACKED, kd), kd);
		/* every record is this node's (rail 0's local area, token order) and this rank's */
		static rw_page_list_entry_t list[MAX_TOKENS];
		static uint32_t token_of[MAX_TOKENS];
		uint32_t n = 0;
		for (uint32_t t = 0; t < rt.n; t++) {
			int any = 0;
			for (uint32_t j = 0; j < topk; j++)
				any |= rt.ids[t * topk + j] >= 0;
			if (any) {
				list[n] = (rw_page_list_entry_t){ .slot = n, .rail = 0,
								  .area = RW_PAGE_AREA_LOCAL,
								  .node = 0, .token = t };
				token_of[n++] = t;
			}
		}
		daemon_arrive(&rk, kd, list, n);
		rw_client_rank_done_t done;
		assert_int_equal(rw_client_rank_wait(rk.rp, kd, 10000, &done), 0);
		assert_int_equal(done.recv_tokens, n);
		/* the experts: row j doubled (exact in bf16 and fp32) */
		for (uint32_t j = 0; j < n; j++) {
			put_row(want, token_of[j], 0, hidden);
			for (uint32_t h = 0; h < hidden; h++) {
				float v;
				memcpy(&v, want + 4 * h, 4);
				v *= 2;
				uint32_t u;
				memcpy(&u, &v, 4);
				if (bf16) {
					uint16_t b = (uint16_t)(u >> 16);
					memcpy(rows + (size_t)j * row_bytes + 2 * h, &b, 2);
				} else {
					memcpy(rows + (size_t)j * row_bytes + 4 * h, &u, 4);
				}
			}
		}
		assert_int_equal(rw_cuda_memcpy_htod(0, rk.recv_x, rows, n * row_bytes), RW_OK);
		rw_client_rank_combine_t cb = { .dispatch = kd, .rows = rk.recv_x, .out = rk.x };
		uint64_t k = 0;
		assert_int_equal(rw_client_rank_combine(rk.rp, &rk.cs, &cb, &k), 0);
		assert_int_equal(k, kd + 1);
		assert_int_equal(rw_client_rank_combine(rk.rp, &rk.cs, &cb, &k), RW_E_STATE);
		assert_int_equal(server_heard(s, RW_PW_SUBMIT, k), k);
		/* staged before submit, where the dispatch's plan said */
		const rw_page_stage_t *own = (const rw_page_stage_t *)(slot(&rk, kd) +
								      lay(&rk)->plan_stage) +
					     page_of(&rk)->owner;
		assert_int_equal(own->rail, page_of(&rk)->rail);
		const rw_client_slab_t *sl0 = &rk.rp->slab[0].lent;
		assert_memory_equal((const uint8_t *)rk.rp->slab[own->rail].lent.base + own->off, rows,
				    n * row_bytes);
		/* the daemon's combine plan: rank 0's copy of rail 0's local records after them,
		 * each record's one term its own row j, the combine records' size */
		const uint32_t crec = (uint32_t)rw_sched_crec_bytes(hidden, eb);
		const uint64_t comb_local = daemon_plan_combine(&rk, k, kd, n);
		assert_int_equal(server_heard(s, RW_PW_PACKED, k), k);
		const uint8_t *cl = (const uint8_t *)sl0->base + comb_local;
		for (uint32_t j = 0; j < n; j++) {
			const uint8_t *rec = cl + (size_t)j * crec;
			expect_header(rec, 0x7b000000u, 0, 0, j); /* tag, source, rail, slot */
			assert_memory_equal(rec + RW_WIRE_CREC_HDR, rows + (size_t)j * row_bytes,
					    row_bytes);
		}
		/* the owner's reduce list: each token's one term, local slot j of rail 0 */
		for (uint32_t j = 0; j < n; j++)
			list[j] = (rw_page_list_entry_t){ .slot = j, .rail = 0,
							  .area = RW_PAGE_AREA_LOCAL, .node = 0,
							  .token = token_of[j] };
		daemon_arrive(&rk, k, list, n);
		assert_int_equal(rw_client_rank_wait(rk.rp, k, 10000, NULL), 0);
		static uint8_t out[MAX_TOKENS * HIDDEN_MAX * 4];
		assert_int_equal(rw_cuda_memcpy_dtoh(0, out, rk.x, rt.n * row_bytes), RW_OK);
		uint32_t j = 0;
		for (uint32_t t = 0; t < rt.n; t++) {
			static const uint8_t zero[HIDDEN_MAX * 4];
			const uint8_t *got = out + (size_t)t * row_bytes;
			if (j < n && token_of[j] == t)
				assert_memory_equal(got, rows + (size_t)j++ * row_bytes, row_bytes);
			else
				assert_memory_equal(got, zero, row_bytes); /* no record: +0 */
		}
	}
	rw_client_rank_combine_t cb = { .dispatch = 2, .rows = rk.recv_x, .out = rk.x };
	uint64_t k = 0;
	assert_int_equal(rw_client_rank_combine(rk.rp, &rk.cs, &cb, &k), RW_E_STATE);
	assert_non_null(strstr(rw_client_rank_message(rk.rp), "not a dispatch"));
	expect_grids(max_sms);
	rank_teardown(&rk, s);
}

static void test_combine_whole(void **state)
{
	(void)state;
	combine_whole(0);
}

/* The SM budget (rw_client_rank_opts_t.max_sms): the whole dispatch and the whole combine above,
 * every byte checked as there, with every launch of the rank path capped at 1, 2 (set after the
 * open) and 3 blocks; on the stand-in, which plays each launch block by block with the
 * grid-stride items of each, no launch took more (without a budget the same phases launch 50 and
 * more). On a GPU (RW_CUDA_DRIVER=libcuda.so.1) the same runs rank_kernels.cu at those grids. */
static void test_sms_budget_exact(void **state)
{
	(void)state;
	for (int32_t sms = 1; sms <= 3; sms++) {
		dispatch_whole(sms);
		combine_whole(sms);
	}
}

/* dispatch returns without waiting for the GPU, and submit follows the count kernel in stream
 * order: with the stream held by earlier work, neither the row nor submit moves; released, both
 * do. */
static void test_submit_after_the_kernel(void **state)
{
	(void)state;
	rank_t rk;
	static routing_t rt;
	server_t *s = rank_setup(&rk, 2);
	/* the caller's earlier work: a wait on a gate word in pinned memory */
	void *gate_host;
	rw_cuda_dptr_t gate;
	assert_int_equal(rw_cuda_host_alloc(64, &gate_host), RW_OK);
	memset(gate_host, 0, 64);
	gate = (rw_cuda_dptr_t)(uintptr_t)gate_host;
	routing_gen(&rt, 7, 300, 8);
	load_ids(&rk, &rt);
	rw_cuda_ext_stream_t e = { .device = rk.cs.device, .handle = rk.cs.handle };
	assert_int_equal(rw_cuda_word_wait(&e, gate, 1), RW_OK);
	uint64_t k = dispatch_loaded(&rk, &rt, 0);
	usleep(20000);
	assert_int_equal(word(&rk, RW_PW_SUBMIT), 0);
	const uint32_t zero[64] = { 0 };
	assert_memory_equal(count_row(&rk, k), zero, 4 * sizeof(uint32_t));
	atomic_store_explicit((_Atomic uint64_t *)gate_host, 1, memory_order_release);
	assert_int_equal(server_heard(s, RW_PW_SUBMIT, k), k);
	uint32_t want[64];
	host_row(s, &rk, &rt, want);
	assert_memory_equal(count_row(&rk, k), want, 4 * sizeof(uint32_t));
	phase_finish(&rk, k);
	assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
	rank_close(&rk);
	rw_cuda_host_free(gate_host);
	server_kill(s);
}

/* A top-k id outside [0, E) other than -1: that token counts nothing (the row is the host count
 * of the other tokens), the slot's bad word names it, and the eager completion answers
 * RW_E_TOKENS naming the token. The next phase is clean again. */
static void test_bad_id_named(void **state)
{
	(void)state;
	rank_t rk;
	static routing_t rt, rest;
	server_t *s = rank_setup(&rk, 0);
	const int32_t bad_ids[] = { EXPERTS, -5, INT32_MAX };
	for (unsigned b = 0; b < 3; b++) {
		routing_gen(&rt, 40 + b, 20, 4);
		rt.ids[17 * 4 + 2] = bad_ids[b];
		uint64_t k = dispatch(&rk, &rt, b);
		assert_int_equal(server_heard(s, RW_PW_SUBMIT, k), k);
		assert_int_equal(params(&rk, k)->bad, 18);
		rest = rt;
		memmove(&rest.ids[17 * 4], &rest.ids[18 * 4], 2 * 4 * sizeof(int32_t));
		rest.n = 19;
		uint32_t want[64];
		host_row(s, &rk, &rest, want);
		assert_memory_equal(count_row(&rk, k), want, 4 * sizeof(uint32_t));
		daemon_release(&rk, k);
		assert_int_equal(rw_client_rank_wait(rk.rp, k, 10000, NULL), RW_E_TOKENS);
		assert_non_null(strstr(rw_client_rank_message(rk.rp), "token 17 "));
	}
	routing_gen(&rt, 50, 20, 4);
	uint64_t k = dispatch(&rk, &rt, 9);
	phase_finish(&rk, k);
	assert_int_equal(params(&rk, k)->bad, 0);
	rank_teardown(&rk, s);
}

/* At most D phases in flight: the next one is refused with RW_E_AGAIN until the oldest is done,
 * and a refused call spends no phase number. Phases answer in any order, also once their slot
 * was taken by a later phase; a failed phase (the daemon's P6) answers with its status. */
static void test_slot_busy(void **state)
{
	(void)state;
	rank_t rk;
	static routing_t rt;
	server_t *s = rank_setup(&rk, 1);
	routing_gen(&rt, 3, 64, 2);
	load_ids(&rk, &rt); /* once: a blocking copy would wait for the held stream */
	for (uint64_t k = 1; k <= RW_PAGE_DEPTH; k++)
		assert_int_equal(dispatch_loaded(&rk, &rt, 0), k);
	rw_client_rank_dispatch_t d = dispatch_args(&rk, &rt, 0, 8, 0);
	uint64_t k = 0;
	assert_int_equal(rw_client_rank_dispatch(rk.rp, &rk.cs, &d, &k), RW_E_AGAIN);
	assert_non_null(strstr(rw_client_rank_message(rk.rp), "in flight"));
	assert_int_equal(rw_client_rank_wait(rk.rp, RW_PAGE_DEPTH + 1, 0, NULL), RW_E_INVAL);
	/* phase 1 fails on the daemon's side: its status, then the owed words (P6) */
	rw_page_fail(page_of(&rk), 1, RW_E_PHASE);
	assert_int_equal(rw_client_rank_wait(rk.rp, 1, 10000, NULL), RW_E_PHASE);
	assert_int_equal(rw_client_rank_dispatch(rk.rp, &rk.cs, &d, &k), 0);
	assert_int_equal(k, RW_PAGE_DEPTH + 1);
	for (uint64_t j = 2; j <= k; j++) { /* each planned once its count row is in */
		assert_int_equal(server_heard(s, RW_PW_SUBMIT, j), j);
		daemon_release(&rk, j);
	}
	assert_int_equal(rw_client_rank_wait(rk.rp, k, 10000, NULL), 0);
	for (uint64_t j = 2; j < k; j++)
		assert_int_equal(rw_client_rank_wait(rk.rp, j, 0, NULL), 0);
	/* phase 1's slot is phase 5's now; its answer was kept */
	assert_int_equal(rw_client_rank_wait(rk.rp, 1, 0, NULL), RW_E_PHASE);
	rank_teardown(&rk, s);
}

/* The daemon fails phase k after its plan (the pack ran, `packed` came), with a list already in
 * the slot (a half-written one, or slot k - D's): P6's status, then the owed words. The stream's
 * second copy of the slot (arrived) takes the failed status into the mirror, so the forward
 * writes nothing: recv_x keeps its bytes, the phase answers RW_E_PHASE with no rows. */
static void test_failed_after_plan_writes_nothing(void **state)
{
	(void)state;
	rank_t rk;
	static routing_t rt;
	static uint8_t before[RECV_CAP * 2 * 128], after[RECV_CAP * 2 * 128];
	server_t *s = rank_setup(&rk, 1);
	routing_gen(&rt, 23, 64, 4);
	for (size_t i = 0; i < sizeof(before); i++)
		before[i] = (uint8_t)(0xa5 ^ i);
	assert_int_equal(rw_cuda_memcpy_htod(0, rk.recv_x, before, sizeof(before)), RW_OK);
	const uint64_t k = dispatch(&rk, &rt, 0);
	assert_int_equal(server_heard(s, RW_PW_SUBMIT, k), k);
	daemon_plan(&rk, k);
	assert_int_equal(server_heard(s, RW_PW_PACKED, k), k);
	/* a list of this rank's own local records, as a good phase would have had */
	static rw_page_list_entry_t list[8];
	const uint32_t rail = page_of(&rk)->rail;
	for (uint32_t j = 0; j < 8; j++)
		list[j] = (rw_page_list_entry_t){ .slot = j, .rail = (uint16_t)rail,
						  .area = RW_PAGE_AREA_LOCAL, .node = 0, .token = j };
	uint8_t *sl = slot(&rk, k);
	*(rw_page_list_head_t *)(sl + lay(&rk)->list) =
		(rw_page_list_head_t){ .phase = k, .count = 8, .kind = 0 };
	memcpy(sl + lay(&rk)->list_entry, list, sizeof(list));
	rw_page_fail(page_of(&rk), k, RW_E_PHASE);
	rw_client_rank_done_t done;
	memset(&done, 0xff, sizeof(done));
	assert_int_equal(rw_client_rank_wait(rk.rp, k, 10000, &done), RW_E_PHASE);
	assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, after, rk.recv_x, sizeof(after)), RW_OK);
	assert_memory_equal(after, before, sizeof(before));
	assert_int_equal(rk.rp->lines[k % RW_PAGE_DEPTH].recv_n, 0);
	rank_teardown(&rk, s);
}

/* The daemon dies with phases on the stream: librailwave's watcher writes the owed words, the
 * stream runs through (done written), every phase answers RW_E_CLOSED and so does the next
 * dispatch. */
static void test_daemon_lost_releases_the_stream(void **state)
{
	(void)state;
	rank_t rk;
	static routing_t rt;
	server_t *s = rank_setup(&rk, 3);
	routing_gen(&rt, 11, 100, 4);
	uint64_t k1 = dispatch(&rk, &rt, 0);
	phase_finish(&rk, k1);
	uint64_t k2 = dispatch_loaded(&rk, &rt, 1), k3 = dispatch_loaded(&rk, &rt, 2);
	assert_int_equal(server_heard(s, RW_PW_SUBMIT, k2), k2);
	assert_int_equal(rw_client_rank_wait(rk.rp, k3, 0, NULL), RW_E_TIMEOUT);
	kill(s->pid, SIGKILL);
	assert_int_equal(rw_client_rank_wait(rk.rp, k3, 10000, NULL), RW_E_CLOSED);
	assert_int_equal(rw_client_rank_wait(rk.rp, k2, 0, NULL), RW_E_CLOSED);
	assert_int_equal(rw_client_rank_wait(rk.rp, k1, 0, NULL), 0);
	assert_int_equal(word(&rk, RW_PW_DONE), k3);
	assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
	rw_client_rank_dispatch_t d = dispatch_args(&rk, &rt, 1, 8, 0);
	uint64_t k = 0;
	assert_int_equal(rw_client_rank_dispatch(rk.rp, &rk.cs, &d, &k), RW_E_CLOSED);
	rank_teardown(&rk, s);
}

/* Bad calls are refused, named, before anything is enqueued (the next good call gets phase 1);
 * a second rank path on one client and a daemon that lends no page are refused too. */
/* The SM budget's refusals, each named and nothing opened: a budget below 0, one above the
 * device's SMs (the stand-in has an H200's 132), one for a host rank (no SMs), one with static
 * mode's flag; options NULL, with an unknown flag or a reserved word set. The device's own count
 * opens (static mode with the flag); rw_client_rank_set_sms refuses the same, keeping the
 * budget, and takes 0. */
static void test_sms_refusals(void **state)
{
	(void)state;
	server_t *s = server_start(1, 2, 2, NULL, 1);
	rw_client_t *c = connect_to(s, 0);
	rw_client_rank_t *rp = NULL;
	assert_int_equal(rw_cuda_init(), RW_OK);
	const int sms = rw_cuda_device_sms(0);
	if (grid_take() >= 0)
		assert_int_equal(sms, 132);
	assert_true(sms > 0);
	const struct { rw_client_rank_opts_t o; int32_t device; const char *says; } bad[] = {
		{ { .max_recv = 256, .max_sms = -1 }, 0, "max_sms -1 is outside 1.." },
		{ { .max_recv = 256, .max_sms = sms + 1 }, 0, "SMs (0: the kernels' own choice)" },
		{ { .max_recv = 256, .max_sms = 1 }, RW_RANK_HOST, "for CUDA ranks" },
		{ { .max_recv = 256, .max_sms = -5, .flags = RW_RANK_OPEN_STATIC }, 0, "max_sms -5" },
		{ { .max_recv = 256, .max_sms = 1, .flags = 6 }, 0, "unknown flags 0x6" },
		{ { .max_recv = 256, .reserved = { 0, 0, 1 } }, 0, "reserved word 2" },
	};
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		assert_int_equal(rw_client_rank_open_opts(c, bad[i].device, &bad[i].o, &rp), RW_E_INVAL);
		if (!strstr(rw_client_rank_message(NULL), bad[i].says))
			fail_msg("case %u: '%s' does not say '%s'", i, rw_client_rank_message(NULL),
				 bad[i].says);
		assert_null(rp);
	}
	assert_int_equal(rw_client_rank_open_opts(c, 0, NULL, &rp), RW_E_INVAL);
	assert_non_null(strstr(rw_client_rank_message(NULL), "no options"));
	const rw_client_rank_opts_t all = { .max_recv = 256, .max_sms = sms,
					    .flags = RW_RANK_OPEN_STATIC };
	assert_int_equal(rw_client_rank_open_opts(c, 0, &all, &rp), 0);
	assert_non_null(rp->st);
	assert_int_equal(rp->max_sms, sms);
	assert_int_equal(rw_client_rank_set_sms(rp, sms + 1), RW_E_INVAL);
	assert_non_null(strstr(rw_client_rank_message(rp), "SMs"));
	assert_int_equal(rw_client_rank_set_sms(rp, -1), RW_E_INVAL);
	assert_int_equal(rp->max_sms, sms);
	assert_int_equal(rw_client_rank_set_sms(rp, 0), 0);
	assert_int_equal(rp->max_sms, 0);
	assert_int_equal(rw_client_rank_set_sms(NULL, 1), RW_E_INVAL);
	rw_client_rank_close(rp);
	rw_client_close(c);
	server_kill(s);
}

static void test_refusals(void **state)
{
	(void)state;
	rank_t rk;
	static routing_t rt;
	server_t *s = rank_setup(&rk, 0);
	rw_client_rank_t *again = NULL;
	assert_int_equal(rw_client_rank_open(rk.client, 0, 256, &again), RW_E_STATE);
	assert_int_equal(rw_client_rank_open(rk.client, 99, 256, &again), RW_E_INVAL);
	assert_non_null(strstr(rw_client_rank_message(NULL), "device 99"));
	routing_gen(&rt, 1, 10, 4);
	const rw_client_rank_dispatch_t good = dispatch_args(&rk, &rt, 1, 8, 0);
	enum { NBAD = 11 };
	struct { rw_client_rank_dispatch_t d; rw_client_stream_t st; int want; const char *says; }
		bad[NBAD];
	for (int i = 0; i < NBAD; i++) {
		bad[i].d = good;
		bad[i].st = rk.cs;
	}
	bad[0].d.dtype = 9, bad[0].want = RW_E_DTYPE, bad[0].says = "dtype";
	bad[1].d.topk = 33, bad[1].want = RW_E_TOKENS, bad[1].says = "topk";
	bad[2].d.token_count = MAX_TOKENS + 1, bad[2].want = RW_E_TOKENS, bad[2].says = "token_count";
	bad[3].d.n_experts = EXPERTS + 1, bad[3].want = RW_E_EXPERTS, bad[3].says = "n_experts";
	bad[4].d.topk_ids = rk.ids + 2, bad[4].want = RW_E_INVAL, bad[4].says = "aligned";
	bad[5].st.device = 1, bad[5].want = RW_E_INVAL, bad[5].says = "device 1";
	bad[6].d.reserved1 = 1, bad[6].want = RW_E_INVAL, bad[6].says = "reserved";
	bad[7].d.path = RW_PATH_REQ_JOINT + 1, bad[7].want = RW_E_FIELD, bad[7].says = "path";
	bad[8].d.dtype = RW_DTYPE_FP16, bad[8].want = RW_E_DTYPE, bad[8].says = "bf16 and fp32";
	bad[9].d.recv_x = rk.recv_x + 4, bad[9].want = RW_E_INVAL, bad[9].says = "recv_x";
	bad[10].d.n_experts = 10, bad[10].want = RW_E_EXPERTS, bad[10].says = "world"; /* 2 x 4 */
	for (int i = 0; i < NBAD; i++) {
		uint64_t k = 0;
		assert_int_equal(rw_client_rank_dispatch(rk.rp, &bad[i].st, &bad[i].d, &k),
				 bad[i].want);
		assert_non_null(strstr(rw_client_rank_message(rk.rp), bad[i].says));
		assert_int_equal(k, 0);
	}
	assert_int_equal(rw_client_rank_wait(rk.rp, 1, 0, NULL), RW_E_INVAL);
	assert_int_equal(word(&rk, RW_PW_SUBMIT), 0);
	uint64_t k = dispatch(&rk, &rt, 0);
	assert_int_equal(k, 1);
	phase_finish(&rk, k);
	rank_teardown(&rk, s);

	s = server_start(2, 4, 2, NULL, 2); /* pages, no group slabs: nothing to pack into */
	rank_open(&rk, s, 0);
	uint64_t k2 = 0;
	rw_client_rank_dispatch_t d = dispatch_args(&rk, &rt, 1, 8, 0);
	assert_int_equal(rw_client_rank_dispatch(rk.rp, &rk.cs, &d, &k2), RW_E_STATE);
	assert_non_null(strstr(rw_client_rank_message(rk.rp), "no group slabs"));
	assert_int_equal(word(&rk, RW_PW_SUBMIT), 0);
	rank_teardown(&rk, s);

	s = server_start(2, 4, 2, NULL, 0); /* no page rails */
	rw_client_t *c = connect_to(s, 0);
	assert_int_equal(rw_client_rank_open(c, 0, 256, &again), RW_E_STATE);
	assert_non_null(strstr(rw_client_rank_message(NULL), "lends no rank page"));
	rw_client_close(c);
	server_kill(s);
}

/* A rank with no CUDA driver (a CPU-only node): the rank path is refused with RW_E_NO_CUDA and
 * a reason, and the client goes on with the ring. Run in a child that never loaded a driver. */
static void test_cpu_only_rank(void **state)
{
	(void)state;
	server_t *s = server_start(2, 4, 2, NULL, 1);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		setenv("RW_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
		rw_client_t *c = connect_to(s, 0);
		rw_client_rank_t *rp = NULL;
		int rc = rw_client_rank_open(c, 0, 256, &rp);
		int ok = rc == RW_E_NO_CUDA && rp == NULL &&
			 strstr(rw_client_rank_message(NULL), "no CUDA driver") != NULL;
		uint32_t id;
		void *addr;
		ok = ok && rw_client_register_host(c, 4096, &id, &addr) == 0;
		rw_client_close(c);
		_exit(ok ? 0 : 1);
	}
	int status = 0;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	server_kill(s);
}

/* A host rank sizes its pack's numbering (records to each node) at open from its page's nodes:
 * a page head rewritten since (the rank's own memory) refuses the dispatch, named, before the
 * CPU counts or numbers anything; the head put back, the same dispatch is taken. */
static void test_host_head_rewritten(void **state)
{
	(void)state;
	server_t *s = server_start(2, 4, 2, NULL, 1);
	rw_client_t *c = connect_to(s, 0);
	rw_client_rank_t *rp = NULL;
	if (rw_client_rank_open(c, RW_RANK_HOST, 256, &rp) != 0)
		fail_msg("host rank open: %s", rw_client_rank_message(NULL));
	static routing_t rt;
	routing_gen(&rt, 77, 20, 4);
	static float w[MAX_TOKENS * 32], x[MAX_TOKENS * HIDDEN_MAX];
	static uint8_t recv_x[RECV_CAP * HIDDEN_MAX * 4], recv_meta[RECV_CAP * (16 + 8 * 32)];
	static uint32_t recv_counts[EXPERTS];
	const rw_client_rank_dispatch_t d = {
		.dtype = RW_DTYPE_FP32, .topk = (uint16_t)rt.topk, .layer = 0, .step = 5,
		.token_count = rt.n, .hidden = 16, .n_experts = EXPERTS, .tokens = (uintptr_t)x,
		.topk_ids = (uintptr_t)rt.ids, .topk_weights = (uintptr_t)w, .recv_x = (uintptr_t)recv_x,
		.recv_meta = (uintptr_t)recv_meta, .recv_counts = (uintptr_t)recv_counts,
		.recv_cap = RECV_CAP };
	const uint32_t nodes = rp->pg->nodes;
	uint64_t k = 0;
	rp->pg->nodes = nodes * 2; /* the experts still divide among the ranks it would mean */
	assert_int_equal(rw_client_rank_dispatch(rp, NULL, &d, &k), RW_E_INVAL);
	assert_non_null(strstr(rw_client_rank_message(rp), "the rank page says 4 nodes; it was "
						 "opened for 2"));
	assert_int_equal(word(&(rank_t){ .rp = rp }, RW_PW_SUBMIT), 0);
	rp->pg->nodes = nodes;
	assert_int_equal(rw_client_rank_dispatch(rp, NULL, &d, &k), 0);
	assert_int_equal(k, 1);
	assert_int_equal(word(&(rank_t){ .rp = rp }, RW_PW_SUBMIT), 1);
	rw_client_rank_close(rp);
	rw_client_close(c);
	server_kill(s);
}

/* ---------------------------------------------------------------------------------------------
 * Static mode and CUDA graphs: the daemon played by a thread of this process
 * ------------------------------------------------------------------------------------------- */

/* The daemon's part for one node of one rank (every expert its own, every record in rail 0's
 * local area), phase after phase as the words come: a dispatch gets the simplest plan and the
 * list of the records it packed (read from their headers, as the daemon reads them); its combine
 * (the next phase) the plan of daemon_plan_combine and a reduce list of the rows it gave back.
 * Each phase's (layer, step) is kept for the case to check. */
#define PLAY_MAX 512
typedef struct play {
	const rank_t *rk;
	server_t *s;              /* its reports are this thread's while it runs */
	pthread_t thread;
	_Atomic int stop;         /* answer nothing more */
	_Atomic uint64_t served;  /* phases answered whole */
	rw_page_params_t seen[PLAY_MAX]; /* phase k's parameters at k - 1 */
	rw_page_list_entry_t list[MAX_TOKENS]; /* the last dispatch's list */
	uint32_t listed;
} play_t;

/* Wait until `w` >= k; -1 once told to stop. */
static int play_reach(play_t *pl, unsigned w, uint64_t k)
{
	while ((int64_t)(word(pl->rk, w) - k) < 0) {
		if (atomic_load(&pl->stop))
			return -1;
		usleep(50);
	}
	return 0;
}

static void *play_run(void *arg)
{
	play_t *pl = arg;
	const rank_t *rk = pl->rk;
	const rw_client_slab_t *sl0 = &rk->rp->slab[0].lent;
	for (uint64_t k = 1; k <= PLAY_MAX; k++) {
		if (play_reach(pl, RW_PW_SUBMIT, k))
			break;
		/* the IPC server judges every word it sees move by at most D phases: answer no
		 * phase it has not seen submitted, as railwaved (whose poller it is) never does */
		if (server_heard(pl->s, RW_PW_SUBMIT, k) != k)
			break;
		const rw_page_params_t p = *params(rk, k);
		pl->seen[k - 1] = p;
		const uint32_t eb = p.dtype == RW_DTYPE_BF16 ? 2 : 4;
		if (p.kind == RW_KIND_DISPATCH) {
			daemon_plan(rk, k);
			if (play_reach(pl, RW_PW_PACKED, k))
				break;
			const uint32_t n = count_row(rk, k)[0];
			const uint32_t rec_size = (uint32_t)rw_sched_rec_bytes(p.topk, p.hidden, eb);
			const uint8_t *local = (const uint8_t *)sl0->base + sl0->local_off;
			for (uint32_t j = 0; j < n; j++) {
				uint32_t token;
				memcpy(&token, local + (size_t)j * rec_size + RW_WIRE_REC_TOKEN, 4);
				pl->list[j] = (rw_page_list_entry_t){ .slot = j, .rail = 0,
								      .area = RW_PAGE_AREA_LOCAL,
								      .node = 0, .token = token };
			}
			pl->listed = n;
			daemon_arrive(rk, k, pl->list, n);
		} else if (p.abort) { /* no combine comes: the pair fails (P6), as the daemon's */
			rw_page_fail(page_of(rk), k, RW_E_PHASE);
		} else {
			/* the rows given back: every row the dispatch was listed */
			const uint32_t n = p.token_count;
			daemon_plan_combine(rk, k, k - 1, n);
			if (play_reach(pl, RW_PW_PACKED, k))
				break;
			daemon_arrive(rk, k, pl->list, n < pl->listed ? n : pl->listed);
		}
		atomic_store(&pl->served, k);
	}
	return NULL;
}

static play_t *play_running; /* stopped by a failed case's teardown too */

static void play_start(play_t *pl, const rank_t *rk, server_t *s)
{
	memset(pl, 0, sizeof(*pl));
	pl->rk = rk;
	pl->s = s;
	assert_int_equal(pthread_create(&pl->thread, NULL, play_run, pl), 0);
	play_running = pl;
}

static void play_stop(play_t *pl)
{
	atomic_store(&pl->stop, 1);
	pthread_join(pl->thread, NULL);
	play_running = NULL;
}

/* A MoE layer's buffers on the device: inputs the graph reads, outputs it writes, the expert's
 * rows in between; and page-locked copies of the inputs (the fresh ones of each replay). */
#define LAYER_TOKENS 200
#define LAYER_HIDDEN 64
typedef struct layer {
	rw_cuda_dptr_t tokens;      /* 0: the rank's x (the inputs copied there) */
	uint32_t layer;
	rw_cuda_dptr_t recv_n, rows, out;
	void *ids_h, *x_h, *w_h;    /* page-locked */
	uint32_t hidden, eb;
} layer_t;

static void layer_alloc(layer_t *L, int bf16)
{
	memset(L, 0, sizeof(*L));
	L->layer = 3;
	L->hidden = LAYER_HIDDEN;
	L->eb = bf16 ? 2 : 4;
	assert_int_equal(rw_cuda_mem_alloc(0, 64, &L->recv_n), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)RECV_CAP * HIDDEN_MAX * 4, &L->rows), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)MAX_TOKENS * HIDDEN_MAX * 4, &L->out), RW_OK);
	assert_int_equal(rw_cuda_host_alloc((size_t)MAX_TOKENS * 32 * 4, &L->ids_h), RW_OK);
	assert_int_equal(rw_cuda_host_alloc((size_t)MAX_TOKENS * HIDDEN_MAX * 4, &L->x_h), RW_OK);
	assert_int_equal(rw_cuda_host_alloc((size_t)MAX_TOKENS * 32 * 4, &L->w_h), RW_OK);
}

static void layer_free(layer_t *L)
{
	rw_cuda_mem_free(0, L->recv_n);
	rw_cuda_mem_free(0, L->rows);
	rw_cuda_mem_free(0, L->out);
	rw_cuda_host_free(L->ids_h);
	rw_cuda_host_free(L->x_h);
	rw_cuda_host_free(L->w_h);
}

/* A server for one node of one rank over one rail, the rank's path (static mode or eager), a
 * layer's buffers and, with pl, the daemon's part played by a thread. */
static server_t *layer_setup_sms(rank_t *rk, layer_t *L, play_t *pl, int static_mode, int bf16,
				 int32_t max_sms)
{
	server_t *s = server_start(1, 1, 1, NULL, 1);
	rank_open_sms(rk, s, 0, static_mode, max_sms);
	layer_alloc(L, bf16);
	if (pl)
		play_start(pl, rk, s);
	return s;
}

static server_t *layer_setup(rank_t *rk, layer_t *L, play_t *pl, int static_mode, int bf16)
{
	return layer_setup_sms(rk, L, pl, static_mode, bf16, 0);
}

static void layer_teardown(rank_t *rk, layer_t *L, play_t *pl, server_t *s)
{
	if (pl)
		play_stop(pl);
	layer_free(L);
	rank_teardown(rk, s);
}

/* Replay i's inputs: routing from seed i (some tokens without any expert), row t of token t
 * shifted by i, into the page-locked copies; then copied to the rank's device inputs on the
 * stream (the copies stay outside any graph, and the stream orders them before the replay). */
static void layer_inputs(const layer_t *L, rank_t *rk, routing_t *rt, uint32_t i)
{
	routing_gen(rt, 5000 + i, LAYER_TOKENS, 4);
	for (uint32_t t = 0; t < rt->n; t += 9)
		for (uint32_t j = 0; j < rt->topk; j++)
			rt->ids[t * rt->topk + j] = -1;
	memcpy(L->ids_h, rt->ids, (size_t)rt->n * rt->topk * 4);
	for (uint32_t t = 0; t < rt->n; t++) {
		put_row((uint8_t *)L->x_h + (size_t)t * L->hidden * L->eb, (t + i * 13) % 1000,
			L->eb == 2, L->hidden);
		for (uint32_t j = 0; j < rt->topk; j++)
			((float *)L->w_h)[t * rt->topk + j] = w_val(t, j);
	}
	const rw_cuda_ext_stream_t es = { .device = rk->cs.device, .handle = rk->cs.handle };
	assert_int_equal(rw_cuda_copy_ext(&es, rk->ids, (uintptr_t)L->ids_h, (size_t)rt->n * rt->topk * 4),
			 RW_OK);
	assert_int_equal(rw_cuda_copy_ext(&es, rk->x, (uintptr_t)L->x_h, (size_t)rt->n * L->hidden * L->eb),
			 RW_OK);
	assert_int_equal(rw_cuda_copy_ext(&es, rk->w, (uintptr_t)L->w_h, (size_t)rt->n * rt->topk * 4),
			 RW_OK);
}

/* What one run of the layer gave: the combined rows, the received rows' count and per-expert
 * counts. */
typedef struct layer_out {
	uint8_t out[LAYER_TOKENS * LAYER_HIDDEN * 4];
	uint32_t recv_n;
	uint32_t counts[EXPERTS];
} layer_out_t;

static void layer_read(const layer_t *L, const rank_t *rk, layer_out_t *o, int with_recv_n)
{
	assert_int_equal(rw_cuda_memcpy_dtoh(0, o->out, L->out, (size_t)LAYER_TOKENS * L->hidden * L->eb),
			 RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, o->counts, rk->recv_counts, sizeof(o->counts)), RW_OK);
	if (with_recv_n)
		assert_int_equal(rw_cuda_memcpy_dtoh(0, &o->recv_n, L->recv_n, 4), RW_OK);
}

/* The layer's dispatch arguments (recv_cap rows of room). */
static rw_client_rank_dispatch_t layer_dispatch(const layer_t *L, const rank_t *rk, uint32_t cap)
{
	return (rw_client_rank_dispatch_t){
		.dtype = L->eb == 2 ? RW_DTYPE_BF16 : RW_DTYPE_FP32, .topk = 4, .layer = L->layer,
		.step = 100, .token_count = LAYER_TOKENS, .hidden = L->hidden, .n_experts = EXPERTS,
		.tokens = L->tokens ? L->tokens : rk->x, .topk_ids = rk->ids, .topk_weights = rk->w, .recv_x = rk->recv_x,
		.recv_meta = rk->recv_meta, .recv_counts = rk->recv_counts, .recv_cap = cap };
}

/* The layer in static mode on the rank's stream: dispatch, the expert (its rows are the received
 * rows: a device copy, no kernel of its own), combine. Captured or not. */
static void layer_enqueue(const layer_t *L, rank_t *rk, uint32_t cap)
{
	const rw_client_rank_dispatch_t d = layer_dispatch(L, rk, cap);
	uint64_t cd = 0, cc = 0;
	int rc = rw_client_rank_dispatch_static(rk->rp, &rk->cs, &d, L->recv_n, &cd);
	if (rc)
		fail_msg("static dispatch: %s", rw_client_rank_message(rk->rp));
	const rw_cuda_ext_stream_t es = { .device = rk->cs.device, .handle = rk->cs.handle };
	assert_int_equal(rw_cuda_copy_ext(&es, L->rows, rk->recv_x, (size_t)cap * L->hidden * L->eb),
			 RW_OK);
	const rw_client_rank_combine_t c = { .dispatch = cd, .rows = L->rows, .out = L->out };
	rc = rw_client_rank_combine_static(rk->rp, &rk->cs, &c, &cc);
	if (rc)
		fail_msg("static combine: %s", rw_client_rank_message(rk->rp));
	assert_int_equal(cc, cd + 1);
}

/* What the layer must give for routing rt: each token with an expert gets its own row back (one
 * record, one term: the expert is the identity), a token without one +0; the counts are the
 * routing's over the rows written. */
static void layer_expect(const layer_t *L, const routing_t *rt, const layer_out_t *o)
{
	static uint8_t want[LAYER_HIDDEN * 4];
	const size_t row_bytes = (size_t)L->hidden * L->eb;
	uint32_t n = 0, counts[EXPERTS] = { 0 };
	for (uint32_t t = 0; t < rt->n; t++) {
		int any = 0;
		for (uint32_t j = 0; j < rt->topk; j++) {
			const int32_t e = rt->ids[t * rt->topk + j];
			any |= e >= 0;
			counts[e >= 0 ? e : 0] += e >= 0;
		}
		n += any;
		memset(want, 0, row_bytes);
		if (any)
			memcpy(want, (const uint8_t *)L->x_h + t * row_bytes, row_bytes);
		if (memcmp(o->out + t * row_bytes, want, row_bytes))
		assert_memory_equal(o->out + t * row_bytes, want, row_bytes);
	}
	assert_int_equal(o->recv_n, n);
	assert_memory_equal(o->counts, counts, sizeof(counts));
}

/* One MoE layer (dispatch -> expert -> combine) captured once in a CUDA graph and replayed 100
 * times ($RW_RANK_REPLAYS), fresh inputs copied into the captured buffers before each replay: every replay is two
 * new phases (the stream takes k, the daemon sees steps 100, 101, ... of layer 3), its outputs
 * equal, byte for byte, an eager run of the same inputs and what the routing says; the capture
 * itself ran nothing (no submit). fp32, then bf16. */
static void test_graph_replays_a_layer(void **state)
{
	(void)state;
	static routing_t rt;
	static layer_out_t eager[2][100], got;
	/* $RW_RANK_REPLAYS (1..100, default 100): fewer under compute-sanitizer on a GPU */
	const char *env = getenv("RW_RANK_REPLAYS");
	const uint32_t REPLAYS = env && atoi(env) > 0 && atoi(env) < 100 ? (uint32_t)atoi(env) : 100;
	for (int bf16 = 0; bf16 < 2; bf16++) {
		/* the eager runs, for the reference */
		rank_t rk;
		layer_t L;
		play_t pl;
		server_t *s = layer_setup(&rk, &L, &pl, 0, bf16);
		const rw_cuda_ext_stream_t es = { .device = rk.cs.device, .handle = rk.cs.handle };
		for (uint32_t i = 0; i < REPLAYS; i++) {
			layer_inputs(&L, &rk, &rt, i);
			rw_client_rank_dispatch_t d = layer_dispatch(&L, &rk, RECV_CAP);
			uint64_t kd = 0, kc = 0;
			rw_client_rank_done_t done;
			assert_int_equal(rw_client_rank_dispatch(rk.rp, &rk.cs, &d, &kd), 0);
			assert_int_equal(rw_client_rank_wait(rk.rp, kd, 10000, &done), 0);
			assert_int_equal(rw_cuda_copy_ext(&es, L.rows, rk.recv_x,
							  (size_t)done.recv_tokens * L.hidden * L.eb), RW_OK);
			rw_client_rank_combine_t c = { .dispatch = kd, .rows = L.rows, .out = L.out };
			assert_int_equal(rw_client_rank_combine(rk.rp, &rk.cs, &c, &kc), 0);
			assert_int_equal(rw_client_rank_wait(rk.rp, kc, 10000, NULL), 0);
			layer_read(&L, &rk, &eager[bf16][i], 0);
			eager[bf16][i].recv_n = done.recv_tokens;
			layer_expect(&L, &rt, &eager[bf16][i]);
		}
		layer_teardown(&rk, &L, &pl, s);

		/* static mode: captured once, replayed */
		s = layer_setup(&rk, &L, &pl, 1, bf16);
		const rw_cuda_ext_stream_t gs = { .device = rk.cs.device, .handle = rk.cs.handle };
		rw_cuda_graph_t *g = NULL;
		assert_int_equal(rw_cuda_graph_begin(&gs), RW_OK);
		layer_enqueue(&L, &rk, RECV_CAP);
		assert_int_equal(rw_cuda_graph_end(&gs, &g), RW_OK);
		usleep(20000);
		assert_int_equal(word(&rk, RW_PW_SUBMIT), 0); /* captured, not run */
		uint64_t c0[C_END], c1[C_END];
		const int counted = fake_counts(c0);
		for (uint32_t i = 0; i < REPLAYS; i++) {
			layer_inputs(&L, &rk, &rt, i);
			assert_int_equal(rw_cuda_graph_launch(g, &gs), RW_OK);
			assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
			rw_client_rank_check_t chk;
			int rc = rw_client_rank_check(rk.rp, &chk);
			if (rc)
				fail_msg("replay %u: %s", i, rw_client_rank_message(rk.rp));
			assert_int_equal(chk.done, 2 * (i + 1));
			assert_int_equal(chk.phase, 0);
			layer_read(&L, &rk, &got, 1);
			layer_expect(&L, &rt, &got);
			assert_int_equal(got.recv_n, eager[bf16][i].recv_n);
			assert_memory_equal(got.out, eager[bf16][i].out,
					    (size_t)LAYER_TOKENS * L.hidden * L.eb);
			assert_memory_equal(got.counts, eager[bf16][i].counts, sizeof(got.counts));
			/* the daemon saw a new pair each replay: dispatch then its combine */
			const rw_page_params_t *pd = &pl.seen[2 * i], *pc = &pl.seen[2 * i + 1];
			assert_int_equal(pd->kind, RW_KIND_DISPATCH);
			assert_int_equal(pd->phase, 2 * i + 1);
			assert_int_equal(pd->layer, 3);
			assert_int_equal(pd->step, 100 + i);
			assert_int_equal(pd->token_count, LAYER_TOKENS);
			assert_int_equal(pc->kind, RW_KIND_COMBINE);
			assert_int_equal(pc->phase, 2 * i + 2);
			assert_int_equal(pc->step, 100 + i);
			assert_int_equal(pc->token_count, got.recv_n);
		}
		/* The replays asked the GPU for no launch, no stream memory operation (whose value a
		 * graph would fix) and no host function: per replay the 3 input copies and the graph's
		 * 20 items (dispatch 10, the expert's copy, combine 9) ran as stream work. */
		if (counted && fake_counts(c1)) {
			assert_int_equal(c1[C_KERNEL] - c0[C_KERNEL], 0);
			assert_int_equal(c1[C_WORD_WRITE] - c0[C_WORD_WRITE], 0);
			assert_int_equal(c1[C_WORD_WAIT] - c0[C_WORD_WAIT], 0);
			assert_int_equal(c1[C_HOST_FN] - c0[C_HOST_FN], 0);
			assert_int_equal(c1[C_WORK] - c0[C_WORK], 23 * REPLAYS);
		}
		rw_cuda_graph_destroy(g);
		play_stop(&pl);
		assert_int_equal(server_heard(s, RW_PW_DONE, 2 * REPLAYS), 2 * REPLAYS);
		layer_teardown(&rk, &L, NULL, s);
	}
}

/* Static mode under an SM budget: the graph case's layer (fp32, then bf16) captured with every
 * launch capped at 1 block, then at 3 (rw_rank_ctl's WAIT and STAGE included, which take up to 16
 * and thousands of blocks without one), replayed 10 times: each replay's rows, counts and
 * combined rows as the routing says; on the stand-in no launch of the capture took more. */
static void test_sms_budget_static(void **state)
{
	(void)state;
	static routing_t rt;
	static layer_out_t got;
	for (int32_t sms = 1; sms <= 3; sms += 2) {
		rank_t rk;
		layer_t L;
		play_t pl;
		server_t *s = layer_setup_sms(&rk, &L, &pl, 1, sms == 3, sms);
		const rw_cuda_ext_stream_t gs = { .device = rk.cs.device, .handle = rk.cs.handle };
		rw_cuda_graph_t *g = NULL;
		grid_take();
		assert_int_equal(rw_cuda_graph_begin(&gs), RW_OK);
		layer_enqueue(&L, &rk, RECV_CAP);
		assert_int_equal(rw_cuda_graph_end(&gs, &g), RW_OK);
		expect_grids(sms);
		for (uint32_t i = 0; i < 10; i++) {
			layer_inputs(&L, &rk, &rt, i);
			assert_int_equal(rw_cuda_graph_launch(g, &gs), RW_OK);
			assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
			rw_client_rank_check_t chk;
			if (rw_client_rank_check(rk.rp, &chk))
				fail_msg("budget %d, replay %u: %s", sms, i, rw_client_rank_message(rk.rp));
			assert_int_equal(chk.done, 2 * (i + 1));
			layer_read(&L, &rk, &got, 1);
			layer_expect(&L, &rt, &got);
		}
		rw_cuda_graph_destroy(g);
		play_stop(&pl);
		layer_teardown(&rk, &L, NULL, s);
	}
}

/* The layer's forward and its backward in one graph: the combine's backward is a dispatch of
 * the output gradients along the same routing (here the forward's combined rows, layer 4), the
 * expert's backward the identity again, the dispatch's backward that dispatch's combine. Four
 * phases a replay, two pair keys (layers 3 and 4, step 100 + i each); after 20 replays with fresh
 * inputs, each replay's gradient equals its forward output (identity twice) and its inputs' rows
 * for every token with an expert. */
static void test_graph_forward_backward(void **state)
{
	(void)state;
	rank_t rk;
	layer_t F, B;
	play_t pl;
	static routing_t rt;
	static layer_out_t fwd, bwd;
	server_t *s = layer_setup(&rk, &F, &pl, 1, 0);
	layer_alloc(&B, 0);
	B.tokens = F.out;
	B.layer = 4;
	rw_cuda_host_free(B.x_h);
	B.x_h = F.x_h; /* the rows layer_expect compares with: the forward's inputs */
	const rw_cuda_ext_stream_t gs = { .device = rk.cs.device, .handle = rk.cs.handle };
	rw_cuda_graph_t *g = NULL;
	assert_int_equal(rw_cuda_graph_begin(&gs), RW_OK);
	layer_enqueue(&F, &rk, RECV_CAP);
	layer_enqueue(&B, &rk, RECV_CAP);
	assert_int_equal(rw_cuda_graph_end(&gs, &g), RW_OK);
	for (uint32_t i = 0; i < 20; i++) {
		layer_inputs(&F, &rk, &rt, 40 + i);
		assert_int_equal(rw_cuda_graph_launch(g, &gs), RW_OK);
		assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
		rw_client_rank_check_t chk;
		assert_int_equal(rw_client_rank_check(rk.rp, &chk), 0);
		assert_int_equal(chk.done, 4 * (i + 1));
		layer_read(&F, &rk, &fwd, 1);
		layer_read(&B, &rk, &bwd, 1);
		layer_expect(&F, &rt, &fwd);
		layer_expect(&B, &rt, &bwd);
		for (uint32_t j = 0; j < 4; j++) {
			const rw_page_params_t *p = &pl.seen[4 * i + j];
			assert_int_equal(p->phase, 4 * i + j + 1);
			assert_int_equal(p->layer, j < 2 ? 3 : 4);
			assert_int_equal(p->step, 100 + i);
			assert_int_equal(p->kind, j % 2 ? RW_KIND_COMBINE : RW_KIND_DISPATCH);
		}
	}
	rw_cuda_graph_destroy(g);
	B.x_h = NULL;
	layer_free(&B);
	layer_teardown(&rk, &F, &pl, s);
}

/* Static mode refuses what it cannot do and what eager mode owns; a host synchronization while
 * the stream is captured fails and spoils the capture, as the driver's does. */
static void test_static_refusals(void **state)
{
	(void)state;
	rank_t rk;
	layer_t L;
	server_t *s = layer_setup(&rk, &L, NULL, 1, 0);
	rw_client_rank_dispatch_t d = layer_dispatch(&L, &rk, RECV_CAP);
	uint64_t k = 0;
	assert_int_equal(rw_client_rank_dispatch(rk.rp, &rk.cs, &d, &k), RW_E_STATE);
	assert_non_null(strstr(rw_client_rank_message(rk.rp), "static"));
	assert_int_equal(rw_client_rank_wait(rk.rp, 1, 0, NULL), RW_E_STATE);
	rw_client_rank_combine_t c = { .dispatch = 1, .rows = L.rows, .out = L.out };
	assert_int_equal(rw_client_rank_combine_static(rk.rp, &rk.cs, &c, &k), RW_E_STATE);
	d.topk = 33;
	assert_int_equal(rw_client_rank_dispatch_static(rk.rp, &rk.cs, &d, L.recv_n, &k), RW_E_TOKENS);
	d.topk = 4;
	assert_int_equal(rw_client_rank_dispatch_static(rk.rp, &rk.cs, &d, L.recv_n + 2, &k),
			 RW_E_INVAL);
	rw_client_rank_check_t chk;
	assert_int_equal(rw_client_rank_check(rk.rp, &chk), 0);
	assert_int_equal(chk.done, 0);
	const rw_cuda_ext_stream_t gs = { .device = rk.cs.device, .handle = rk.cs.handle };
	rw_cuda_graph_t *g = NULL;
	assert_int_equal(rw_cuda_graph_begin(&gs), RW_OK);
	assert_int_not_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
	assert_int_not_equal(rw_cuda_graph_end(&gs, &g), RW_OK);
	assert_null(g);
	assert_int_equal(word(&rk, RW_PW_SUBMIT), 0);
	rw_client_rank_t *none = NULL;
	assert_int_equal(rw_client_rank_open_static(rk.client, RW_RANK_HOST, 256, &none), RW_E_INVAL);
	assert_non_null(strstr(rw_client_rank_message(NULL), "CUDA ranks"));
	layer_teardown(&rk, &L, NULL, s);

	/* an eager rank path has no static calls */
	s = server_start(1, 1, 1, NULL, 1);
	rank_open(&rk, s, 0);
	assert_int_equal(rw_client_rank_check(rk.rp, &chk), RW_E_STATE);
	assert_int_equal(rw_client_rank_dispatch_static(rk.rp, &rk.cs, &d, 0, &k), RW_E_STATE);
	rank_teardown(&rk, s);
}

/* The layer once more in static mode, eager, on routing i with room enough: it passes, every
 * combined row, received count and per-expert count as the routing says. */
static void layer_passes(layer_t *L, rank_t *rk, uint32_t i)
{
	static routing_t rt;
	static layer_out_t got;
	layer_inputs(L, rk, &rt, i);
	layer_enqueue(L, rk, RECV_CAP);
	assert_int_equal(rw_cuda_stream_sync(rk->stream), RW_OK);
	assert_int_equal(rw_client_rank_check(rk->rp, NULL), 0);
	layer_read(L, rk, &got, 1);
	layer_expect(L, &rt, &got);
}

/* Rows past recv_cap in static mode: the rows that fit are written and counted in the caller's
 * row count, the rest dropped and counted on the device; the stream runs on (the combine gives
 * back what was written), and the next check says how much room was needed, once. */
static void test_static_overflow(void **state)
{
	(void)state;
	rank_t rk;
	layer_t L;
	play_t pl;
	static routing_t rt;
	static layer_out_t got;
	server_t *s = layer_setup(&rk, &L, &pl, 1, 1);
	layer_inputs(&L, &rk, &rt, 7);
	layer_enqueue(&L, &rk, 5);
	assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
	rw_client_rank_check_t chk;
	assert_int_equal(rw_client_rank_check(rk.rp, &chk), RW_E_OVERFLOW);
	assert_non_null(strstr(rw_client_rank_message(rk.rp), "recv_cap"));
	layer_read(&L, &rk, &got, 1);
	assert_int_equal(got.recv_n, 5);
	assert_int_equal(chk.over_phase, 1);
	assert_int_equal(chk.need, pl.listed);
	assert_int_equal(chk.overflow, pl.listed - 5);
	assert_int_equal(chk.done, 2);
	assert_int_equal(chk.phase, 0); /* the combine passed */
	/* it gave back a row for every listed record: the 5 written, +0 for the dropped ones */
	assert_int_equal(pl.seen[1].token_count, pl.listed);
	const size_t row_bytes = (size_t)L.hidden * L.eb;
	static uint8_t want[LAYER_HIDDEN * 4];
	for (uint32_t t = 0; t < rt.n; t++) {
		memset(want, 0, row_bytes);
		for (uint32_t j = 0; j < 5; j++)
			if (pl.list[j].token == t)
				memcpy(want, (const uint8_t *)L.x_h + t * row_bytes, row_bytes);
		assert_memory_equal(got.out + t * row_bytes, want, row_bytes);
	}
	assert_int_equal(rw_client_rank_check(rk.rp, &chk), 0); /* told once */
	layer_passes(&L, &rk, 8); /* room enough again */
	layer_teardown(&rk, &L, &pl, s);
}

/* The daemon killed while a replay's stream waits for its plan: librailwave's watcher writes
 * the owed words, the stream runs through the rest of the graph, and the next check names the
 * loss; so does the next call. */
static void test_static_daemon_lost(void **state)
{
	(void)state;
	rank_t rk;
	layer_t L;
	play_t pl;
	static routing_t rt;
	server_t *s = layer_setup(&rk, &L, &pl, 1, 0);
	const rw_cuda_ext_stream_t gs = { .device = rk.cs.device, .handle = rk.cs.handle };
	rw_cuda_graph_t *g = NULL;
	assert_int_equal(rw_cuda_graph_begin(&gs), RW_OK);
	layer_enqueue(&L, &rk, RECV_CAP);
	assert_int_equal(rw_cuda_graph_end(&gs, &g), RW_OK);
	layer_inputs(&L, &rk, &rt, 1);
	assert_int_equal(rw_cuda_graph_launch(g, &gs), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
	assert_int_equal(rw_client_rank_check(rk.rp, NULL), 0);
	play_stop(&pl); /* the daemon answers nothing more */
	layer_inputs(&L, &rk, &rt, 2);
	assert_int_equal(rw_cuda_graph_launch(g, &gs), RW_OK);
	assert_int_equal(server_heard(s, RW_PW_SUBMIT, 3), 3); /* the replay waits for plan 3 */
	kill(s->pid, SIGKILL);
	assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
	rw_client_rank_check_t chk;
	assert_int_equal(rw_client_rank_check(rk.rp, &chk), RW_E_CLOSED);
	assert_int_equal(chk.phase, 3);
	assert_int_equal(chk.done, 4);
	assert_int_equal(word(&rk, RW_PW_DONE), 4);
	assert_int_equal(rw_client_rank_check(rk.rp, &chk), RW_E_CLOSED);
	uint64_t k = 0;
	const rw_client_rank_dispatch_t d = layer_dispatch(&L, &rk, RECV_CAP);
	assert_int_equal(rw_client_rank_dispatch_static(rk.rp, &rk.cs, &d, L.recv_n, &k), RW_E_CLOSED);
	rw_cuda_graph_destroy(g);
	layer_teardown(&rk, &L, NULL, s);
}

/* A combine's abort captured in the combine's place (rw_client_rank_abort in static mode: its
 * arguments refused at capture, where shapes are fixed, so every replay would refuse them) and
 * replayed: each replay's stream takes the dispatch's key and the abort's phase number from its
 * counters, writes a combine slot of that key marked abort and runs through the daemon's
 * failure; the check names the abort's phase (RW_E_PHASE), every replay's dispatch has its own
 * step, and an eager static layer after the replays passes with its keys in step. */
static void test_static_abort_captured(void **state)
{
	(void)state;
	rank_t rk;
	layer_t L;
	play_t pl;
	server_t *s = layer_setup(&rk, &L, &pl, 1, 0);
	static routing_t rt;
	const rw_cuda_ext_stream_t gs = { .device = rk.cs.device, .handle = rk.cs.handle };
	rw_cuda_graph_t *g = NULL;
	uint64_t cd = 0, ca = 0;
	const rw_client_rank_dispatch_t d = layer_dispatch(&L, &rk, RECV_CAP);
	assert_int_equal(rw_cuda_graph_begin(&gs), RW_OK);
	assert_int_equal(rw_client_rank_dispatch_static(rk.rp, &rk.cs, &d, L.recv_n, &cd), 0);
	assert_int_equal(rw_client_rank_abort(rk.rp, &rk.cs, cd, RW_RANK_ABORT_ARGUMENT, &ca), 0);
	assert_int_equal(rw_cuda_graph_end(&gs, &g), RW_OK);
	assert_int_equal(ca, cd + 1);
	assert_int_equal(word(&rk, RW_PW_SUBMIT), 0); /* captured, not run */
	uint64_t again = 0; /* its dispatch has its combine (the abort) */
	assert_int_equal(rw_client_rank_abort(rk.rp, &rk.cs, cd, RW_RANK_ABORT_ARGUMENT, &again),
			 RW_E_STATE);
	assert_int_equal(rw_client_rank_abort(rk.rp, &rk.cs, cd, 0, &again), RW_E_INVAL);
	enum { REPLAYS = 5 };
	for (uint32_t i = 0; i < REPLAYS; i++) {
		layer_inputs(&L, &rk, &rt, i);
		assert_int_equal(rw_cuda_graph_launch(g, &gs), RW_OK);
		assert_int_equal(rw_cuda_stream_sync(rk.stream), RW_OK);
		rw_client_rank_check_t chk;
		assert_int_equal(rw_client_rank_check(rk.rp, &chk), RW_E_PHASE);
		assert_int_equal(chk.phase, 2 * i + 2);
		assert_int_equal(chk.done, 2 * i + 2);
		const rw_page_params_t *dp = &pl.seen[2 * i], *ap = &pl.seen[2 * i + 1];
		assert_int_equal(dp->kind, RW_KIND_DISPATCH);
		assert_int_equal(dp->step, 100 + i);
		assert_int_equal(ap->kind, RW_KIND_COMBINE);
		assert_int_equal(ap->abort, RW_RANK_ABORT_ARGUMENT);
		assert_int_equal(ap->layer, dp->layer);
		assert_int_equal(ap->step, dp->step);
	}
	rw_cuda_graph_destroy(g);
	layer_passes(&L, &rk, REPLAYS); /* an eager static layer: its keys in step */
	assert_int_equal(pl.seen[2 * REPLAYS].step, 100 + REPLAYS);
	assert_int_equal(pl.seen[2 * REPLAYS + 1].abort, 0);
	layer_teardown(&rk, &L, &pl, s);
}

/* After every case: a server it left (a failed assertion skips its own cleanup). */
static int kill_left(void **state)
{
	(void)state;
	if (play_running)
		play_stop(play_running);
	for (unsigned i = 0; i < 2; i++)
		server_kill(&servers[i]);
	return 0;
}

#define CASE(f) cmocka_unit_test_teardown(f, kill_left)

int main(int argc, char **argv)
{
	(void)argc;
	char self[PATH_MAX];
	snprintf(self, sizeof(self), "%s", argv[0]);
	/* build/test/rank -> build/tests/integration/libfakecuda_kern.so (the kernel stand-in) */
	snprintf(fake_driver, sizeof(fake_driver), "%s/../tests/integration/libfakecuda_kern.so",
		 dirname(self));
	setenv("RW_CUDA_DRIVER", fake_driver, 0);
	rw_log_set_level(getenv("RW_TEST_VERBOSE") ? RW_LOG_DEBUG : RW_LOG_ERROR);
	signal(SIGPIPE, SIG_IGN);
	const char *driver = getenv("RW_CUDA_DRIVER"); /* a path, or a name such as libcuda.so.1 */
	if (!RW_HAVE_CUDA_H || (strchr(driver, '/') && access(driver, R_OK) != 0)) {
		printf("skip: no driver %s\n", driver);
		return 77;
	}
	if (strcmp(driver, fake_driver) == 0) {
		char dir[] = "/tmp/rw-rank-counts.XXXXXX";
		if (mkdtemp(dir)) {
			memcpy(counts_dir, dir, sizeof(dir));
			setenv("RW_FAKE_CUDA_COUNTS", counts_dir, 1);
		}
	}
	const struct CMUnitTest tests[] = {
		/* first: its child must not inherit a loaded driver */
		CASE(test_cpu_only_rank),
		CASE(test_host_head_rewritten),
		CASE(test_static_refusals),
		CASE(test_graph_replays_a_layer),
		CASE(test_graph_forward_backward),
		CASE(test_sms_budget_static),
		CASE(test_static_overflow),
		CASE(test_static_daemon_lost),
		CASE(test_static_abort_captured),
		CASE(test_count_row_is_the_host_count),
		CASE(test_submit_after_the_kernel),
		CASE(test_dispatch_whole),
		CASE(test_combine_whole),
		CASE(test_sms_budget_exact),
		CASE(test_sms_refusals),
		CASE(test_bad_id_named),
		CASE(test_slot_busy),
		CASE(test_failed_after_plan_writes_nothing),
		CASE(test_daemon_lost_releases_the_stream),
		CASE(test_refusals),
	};
	const int rc = cmocka_run_group_tests_name("rank", tests, NULL, NULL);
	if (counts_dir[0]) {
		char path[128];
		snprintf(path, sizeof(path), "%s/%d", counts_dir, (int)getpid());
		unlink(path);
		rmdir(counts_dir);
	}
	return rc;
}
