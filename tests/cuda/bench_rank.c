/* tests/cuda/bench_rank.c (built as cuda/bench_rank): the rank kernels alone (cuda/rw_cuda.h "rank kernels"), in one process
 * on one GPU, against a copy of the same bytes measured in the same run (docs/perf/rankpath.md
 * "The kernels alone").
 *
 * One phase as the daemon lays it out for rank 0 of node 0 in a world of 2 nodes x 4 ranks (one
 * rail per local rank): every rank's T tokens (random top-8 routing, distinct experts, fixed
 * seed), the records of all eight ranks that reach node 0 in host slabs (one memfd per rail,
 * MAP_SHARED, registered and mapped as rank/slabs.c does), the lists as the daemon writes them
 * (forward: the local area's records, then the received ones, each naming an expert of rank 0;
 * reduce: rank 0's tokens in order, one term per local rank answering a local record, one per
 * record that went to node 1). The rank's own tensors (x, ids, weights, forward outputs, reduce
 * output) are device memory, as a trainer's are. Then, on one stream (max_blocks: --blocks):
 *   pack     rw_cuda_rank_pack of rank 0's tokens (index + rows): records into the slab, D2H
 *   forward  rw_cuda_rank_forward of rank 0's list: records out of the slabs into rows, H2D
 *   gather   rw_cuda_rank_gather of the forward's rows: combine records into the slabs, D2H
 *   reduce   rw_cuda_rank_reduce of the owner's terms: combine rows out of the slabs, H2D
 * each timed over --reps launches (median, CUDA events; a host clock around a stream sync where
 * the driver has no cuEventElapsedTime, as on the stand-in), with the bytes it moves over PCIe
 * (records or rows between the GPU and host memory; lists and headers not counted), and two
 * ceilings moving the same bytes the same way in the same run: copy16 (cuda/kernels.cu
 * rw_copy_rows16: one 16-byte zero-copy load and store per element, a list entry per record at
 * the record stride between a device buffer and a registered memfd) and memcpy (one
 * cuMemcpyAsync of all the bytes). ratio = ceiling's us / kernel's us; --blocks caps the rank
 * kernels only (the ceilings keep their own grids). --variant adds copy16 at
 * the record stride rounded up to 128 bytes: whether the records' 16-byte (not 128-byte)
 * alignment costs the copy itself bandwidth.
 * After the timing each kernel's output is checked byte for byte against the kernels' CPU
 * versions (cuda/rank_cpu.c, which tests/integration/test_rank_kernels.c holds to the host
 * mover) run on the same inputs, and the device error word must be 0; a mismatch exits 1.
 *   bench_rank [--shapes deepseek,glm] [--tokens 1,128,512,4096] [--reps 20] [--blocks N]
 *              [--variant] [--slabs host|gpu] [--page dev|host] [--seed S]
 * --slabs gpu puts the slabs in device memory (a GPU carve-out of the rank's own device: the
 * kernels and the ceilings then move the bytes device to device, D2D). --page host has the
 * kernels read the lists, plan entries, tags and list counts from the registered page (host
 * memory) as eager mode did before its mirrors; the default, dev, from a copy in device memory
 * (what eager mode's mirrors and static mode's shadows give them).
 * Exits 0 when every case verified, 1 on a mismatch or a failed call, 77 without a GPU (or the
 * rank image). RW_CUDA_DRIVER picks the driver (the smoke test: the kernel stand-in). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "config.h"
#include "common/common.h"
#include "cuda/rw_cuda.h"

#if RW_HAVE_CUDA_H && RW_HAVE_NVCC
#include <cuda.h>

#define NODES 2
#define GPUS 4
#define RAILS GPUS
#define TOPK 8
#define WARM 3
#define MAXREPS 1000

typedef struct shape {
	const char *name;
	uint32_t hidden, experts;
} shape_t;

static const shape_t shapes[] = { { "deepseek", 7168, 256 }, { "glm", 4096, 128 } };

static uint64_t rng_state;
static uint64_t rng(void) { return rw_xorshift64s(&rng_state); }

/* Random finite bf16 values (exponent below the top), never zeros alone. */
static void fill_bf16(void *p, size_t bytes)
{
	uint8_t *b = p;
	for (size_t i = 0; i < bytes; i += 8) {
		uint64_t v = rng() & 0x3fff3fff3fff3fffull;
		memcpy(b + i, &v, RW_MIN(8, bytes - i));
	}
}

/* ---- timing: CUDA events through the loaded driver, else the host clock ---- */

#define RW_B_STR_(x) #x
#define RW_B_STR(x) RW_B_STR_(x) /* cuda.h's versioned name (cuEventElapsedTime_v2, ...) */

static struct {
	CUresult (*create)(CUevent *, unsigned);
	CUresult (*record)(CUevent, CUstream);
	CUresult (*sync)(CUevent);
	CUresult (*elapsed)(float *, CUevent, CUevent);
	CUresult (*destroy)(CUevent);
	int on;
} ev;

static void events_load(void)
{
	const char *drv = getenv("RW_CUDA_DRIVER");
	void *h = dlopen(drv && *drv ? drv : "libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
	if (!h)
		return;
	*(void **)&ev.create = dlsym(h, RW_B_STR(cuEventCreate));
	*(void **)&ev.record = dlsym(h, RW_B_STR(cuEventRecord));
	*(void **)&ev.sync = dlsym(h, RW_B_STR(cuEventSynchronize));
	*(void **)&ev.elapsed = dlsym(h, RW_B_STR(cuEventElapsedTime));
	if (!ev.elapsed)
		*(void **)&ev.elapsed = dlsym(h, "cuEventElapsedTime");
	*(void **)&ev.destroy = dlsym(h, RW_B_STR(cuEventDestroy));
	ev.on = ev.create && ev.record && ev.sync && ev.elapsed && ev.destroy;
	/* the handle stays open: the driver is rw_cuda's, loaded for the process's life */
}

typedef rw_status_t (*op_fn)(void *ctx);

static int reps = 20;
static int variant;   /* --variant: copy16 at the 128-byte-rounded stride too */
static int dev_page = 1; /* --page dev (default) | host */
static int gpu_slabs; /* --slabs gpu: the slabs in device memory (a GPU carve-out), the memfds
		       * their host mirrors for the setup and the checks */

/* Median microseconds of one launch of op on stream st (its CUstream: h); -1 on a failed call. */
static double time_op(rw_cuda_stream_t *st, CUstream h, op_fn op, void *ctx)
{
	static double t[MAXREPS];
	static CUevent e[2 * MAXREPS];
	for (int i = 0; i < WARM; i++)
		if (op(ctx) != RW_OK)
			return -1;
	if (rw_cuda_stream_sync(st) != RW_OK)
		return -1;
	if (ev.on) {
		for (int i = 0; i < 2 * reps; i++)
			if (ev.create(&e[i], CU_EVENT_DEFAULT) != CUDA_SUCCESS)
				return -1;
		int bad = 0;
		for (int i = 0; i < reps && !bad; i++)
			bad = ev.record(e[2 * i], h) != CUDA_SUCCESS || op(ctx) != RW_OK ||
			      ev.record(e[2 * i + 1], h) != CUDA_SUCCESS;
		bad |= ev.sync(e[2 * reps - 1]) != CUDA_SUCCESS;
		for (int i = 0; i < reps && !bad; i++) {
			float ms = 0;
			bad = ev.elapsed(&ms, e[2 * i], e[2 * i + 1]) != CUDA_SUCCESS;
			t[i] = ms * 1e3;
		}
		for (int i = 0; i < 2 * reps; i++)
			ev.destroy(e[i]);
		if (bad)
			return -1;
	} else {
		for (int i = 0; i < reps; i++) {
			uint64_t t0 = rw_now_ns();
			if (op(ctx) != RW_OK || rw_cuda_stream_sync(st) != RW_OK)
				return -1;
			t[i] = (double)(rw_now_ns() - t0) / 1e3;
		}
	}
	qsort(t, (size_t)reps, sizeof(double), rw_cmp_double);
	return t[reps / 2];
}

/* ---- memory: host areas in registered memfds, device buffers ---- */

typedef struct hmem {
	uint8_t *p;          /* host address */
	uint64_t d;          /* device address (rw_cuda_host_register_mapped) */
	size_t bytes;
} hmem_t;

static int hmem_map(hmem_t *m, size_t bytes)
{
	bytes = (bytes + 4095) & ~(size_t)4095;
	int fd = memfd_create("rw-bench-slab", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
		perror("bench_rank: memfd");
		if (fd >= 0)
			close(fd);
		return -1;
	}
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED) {
		perror("bench_rank: mmap");
		return -1;
	}
	m->p = p;
	m->bytes = bytes;
	if (rw_cuda_host_register_mapped(p, bytes, &m->d) != RW_OK) {
		fprintf(stderr, "bench_rank: registering %zu bytes of a memfd failed\n", bytes);
		munmap(p, bytes);
		m->p = NULL;
		return -1;
	}
	return 0;
}

static void hmem_unmap(hmem_t *m)
{
	if (!m->p)
		return;
	rw_cuda_host_unregister(m->p);
	munmap(m->p, m->bytes);
	m->p = NULL;
}

#define NDEV 32
static rw_cuda_dptr_t devs[NDEV];
static unsigned n_devs;

static rw_cuda_dptr_t dev_alloc(size_t bytes)
{
	rw_cuda_dptr_t d = 0;
	if (n_devs == NDEV || rw_cuda_mem_alloc(0, bytes ? bytes : 16, &d) != RW_OK)
		return 0;
	rw_cuda_memset_d8(0, d, 0, bytes ? bytes : 16);
	devs[n_devs++] = d;
	return d;
}

static void dev_free_all(void)
{
	while (n_devs)
		rw_cuda_mem_free(0, devs[--n_devs]);
}

static uint64_t up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* ---- one phase ---- */

typedef struct rank_in {
	uint8_t *x;            /* T rows */
	int32_t *ids;          /* T x TOPK, distinct experts */
	float *w;
	uint32_t cnt[NODES];   /* records to each node */
	uint32_t *slot[NODES]; /* per token: its record's index among those to the node, or ~0 */
} rank_in_t;

typedef struct phase {
	const shape_t *sh;
	uint32_t T, row_bytes, rec, crec;
	rank_in_t rk[NODES][GPUS];
	hmem_t slab[RAILS];
	/* areas of slab r (byte offsets): see layout() */
	uint64_t send0, local[RAILS], recv[RAILS], junk[RAILS], cgather[RAILS], cret0, ccopy[RAILS];
	hmem_t page;           /* lists, plan entries, tags, list counts (the rank page's part) */
	rw_cuda_dptr_t page_d; /* --page dev: the page's copy in device memory the kernels read */
	size_t page_bytes;
	rw_cuda_plan_entry_t *pent, *cent;
	uint32_t *tags, *ctags, *nfl, *nrl;
	rw_cuda_list_entry_t *fl, *rl;
	/* device memory: rank 0's tensors */
	rw_cuda_dptr_t x, ids, w, scratch, rows, meta, counts, recv_n, over, out, err;
	rw_cuda_rank_pack_t pack;
	rw_cuda_rank_forward_t fwd;
	rw_cuda_rank_gather_t gat;
	rw_cuda_rank_reduce_t red;
	rw_cuda_stream_t *st;
	rw_cuda_ext_stream_t es;
	/* ceilings */
	hmem_t chost;
	rw_cuda_dptr_t cdev;
	rw_cuda_row_copy_t *clist; /* in page-locked host memory */
	uint64_t clist_d;
} phase_t;

static uint32_t node_of(const phase_t *p, int32_t e) { return (uint32_t)e / (p->sh->experts / NODES); }
static uint32_t grank_of(const phase_t *p, int32_t e)
{
	return (uint32_t)e / (p->sh->experts / (NODES * GPUS));
}

static int gen_tokens(phase_t *p)
{
	const uint32_t T = p->T, E = p->sh->experts;
	for (int n = 0; n < NODES; n++)
		for (int g = 0; g < GPUS; g++) {
			rank_in_t *r = &p->rk[n][g];
			r->x = malloc((size_t)T * p->row_bytes + 16);
			r->ids = malloc((size_t)T * TOPK * 4 + 16);
			r->w = malloc((size_t)T * TOPK * 4 + 16);
			if (!r->x || !r->ids || !r->w)
				return -1;
			fill_bf16(r->x, (size_t)T * p->row_bytes);
			for (uint32_t t = 0; t < T; t++)
				for (int k = 0; k < TOPK; k++) {
					int32_t e;
					int dup;
					do {
						e = (int32_t)(rng() % E);
						dup = 0;
						for (int j = 0; j < k; j++)
							dup |= r->ids[t * TOPK + j] == e;
					} while (dup);
					r->ids[t * TOPK + k] = e;
					r->w[t * TOPK + k] = (float)(rng() % 1000) / 997.0f;
				}
			for (int d = 0; d < NODES; d++) {
				r->slot[d] = malloc((size_t)T * 4 + 4);
				if (!r->slot[d])
					return -1;
				r->cnt[d] = 0;
				for (uint32_t t = 0; t < T; t++) {
					int hit = 0;
					for (int k = 0; k < TOPK; k++)
						hit |= node_of(p, r->ids[t * TOPK + k]) == (uint32_t)d;
					r->slot[d][t] = hit ? r->cnt[d]++ : ~0u;
				}
			}
		}
	return 0;
}

/* Slab r: rank (0,0)'s records to node 1 (r = 0), rank (0,r)'s to node 0 (the local area), rank
 * (1,r)'s to node 0 (the receive area: as the rail carried them), a junk area for the records
 * this phase does not read (to node 1 from the other ranks), the gather's combine records (for
 * node 0's records, then node 1's), the combine rows returned for rank 0's records to node 1
 * (r = 0) and local rank r's combine rows of rank 0's local records. Areas 4096-aligned. */
static int layout(phase_t *p)
{
	for (int r = 0; r < RAILS; r++) {
		uint64_t o = 0;
		uint32_t junk = p->rk[1][r].cnt[1];
		if (r)
			junk = RW_MAX(junk, p->rk[0][r].cnt[1]);
		if (r == 0) {
			p->send0 = o;
			o = up(o + (uint64_t)p->rk[0][0].cnt[1] * p->rec, 4096);
		}
		p->local[r] = o;
		o = up(o + (uint64_t)p->rk[0][r].cnt[0] * p->rec, 4096);
		p->recv[r] = o;
		o = up(o + (uint64_t)p->rk[1][r].cnt[0] * p->rec, 4096);
		p->junk[r] = o;
		o = up(o + (uint64_t)junk * p->rec, 4096);
		p->cgather[r] = o;
		o = up(o + (uint64_t)(p->rk[0][r].cnt[0] + p->rk[1][r].cnt[0]) * p->crec, 4096);
		if (r == 0) {
			p->cret0 = o;
			o = up(o + (uint64_t)p->rk[0][0].cnt[1] * p->crec, 4096);
		}
		p->ccopy[r] = o;
		o = up(o + (uint64_t)p->rk[0][0].cnt[0] * p->crec, 4096);
		if (hmem_map(&p->slab[r], o + 4096) != 0)
			return -1;
		if (gpu_slabs && !(p->slab[r].d = dev_alloc(p->slab[r].bytes)))
			return -1;
	}
	return 0;
}

/* The device address the kernels read a page byte at: the page's copy in device memory with
 * --page dev (what eager mode's mirrors and static mode's shadows give the kernels), else the
 * registered page itself (host memory, over PCIe). */
static uint64_t page_dev(const phase_t *p, const void *host)
{
	return (p->page_d ? p->page_d : p->page.d) + (uint64_t)((const uint8_t *)host - p->page.p);
}

/* Rank (n,g)'s pack block: its records to node 0 where node 0 holds them, the rest to junk,
 * except rank (0,0)'s to node 1 (its send area). dev: device addresses, else host ones. */
static void pack_block(phase_t *p, int n, int g, int dev, rw_cuda_plan_entry_t *ent,
		       rw_cuda_rank_pack_t *a)
{
	memset(ent, 0, sizeof(*ent) * NODES * RAILS);
	ent[0 * RAILS + g] = (rw_cuda_plan_entry_t){ 0, p->rk[n][g].cnt[0],
						     n == 0 ? p->local[g] : p->recv[g] };
	ent[1 * RAILS + g] = (rw_cuda_plan_entry_t){ 0, p->rk[n][g].cnt[1],
						     n == 0 && g == 0 ? p->send0 : p->junk[g] };
	*a = (rw_cuda_rank_pack_t){
		.entry = dev ? page_dev(p, ent) : (uint64_t)(uintptr_t)ent,
		.tags = dev ? page_dev(p, p->tags) : (uint64_t)(uintptr_t)p->tags,
		.n_tokens = p->T, .topk = TOPK, .hidden = p->sh->hidden, .dtype = RW_CUDA_BF16,
		.n_experts = p->sh->experts, .nodes = NODES, .rails = RAILS, .me = (uint32_t)n,
		.owner = (uint32_t)g,
	};
	for (int r = 0; r < RAILS; r++)
		a->slab[r] = dev ? p->slab[r].d : (uint64_t)(uintptr_t)p->slab[r].p;
}

static int build(phase_t *p)
{
	const uint32_t T = p->T, H = p->sh->hidden, E = p->sh->experts;
	uint32_t maxfl = 0, maxrl = 0;
	for (int n = 0; n < NODES; n++)
		for (int g = 0; g < GPUS; g++)
			maxfl += p->rk[n][g].cnt[0];
	maxrl = T * (GPUS + 1);
	size_t pb = 4096 + 2 * NODES * RAILS * sizeof(rw_cuda_plan_entry_t) +
		    (size_t)(maxfl + maxrl + 2) * sizeof(rw_cuda_list_entry_t);
	if (hmem_map(&p->page, pb) != 0 || (dev_page && !(p->page_d = dev_alloc(pb))))
		return -1;
	p->page_bytes = pb;
	uint8_t *q = p->page.p;
	p->tags = (uint32_t *)q;
	p->ctags = p->tags + 4;
	p->nfl = p->tags + 8;
	p->nrl = p->tags + 9;
	p->pent = (rw_cuda_plan_entry_t *)(q + 64);
	p->cent = p->pent + NODES * RAILS;
	p->fl = (rw_cuda_list_entry_t *)(q + 4096);
	p->rl = p->fl + maxfl + 1;
	for (int d = 0; d < NODES; d++) {
		p->tags[d] = 0x5100 + (uint32_t)d;
		p->ctags[d] = 0x6200 + (uint32_t)d;
	}

	/* every other rank's records, where node 0 holds them (the CPU pack: setup, not timed) */
	for (int n = 0; n < NODES; n++)
		for (int g = 0; g < GPUS; g++) {
			if (n == 0 && g == 0)
				continue;
			rw_cuda_plan_entry_t ent[NODES * RAILS];
			rw_cuda_rank_pack_t a;
			uint32_t next[NODES] = { 0 };
			uint32_t err[2] = { 0, 0 };
			pack_block(p, n, g, 0, ent, &a);
			a.x = (uint64_t)(uintptr_t)p->rk[n][g].x;
			a.ids = (uint64_t)(uintptr_t)p->rk[n][g].ids;
			a.weights = (uint64_t)(uintptr_t)p->rk[n][g].w;
			a.err = (uint64_t)(uintptr_t)err;
			a.entry = (uint64_t)(uintptr_t)ent;
			a.rec_size = p->rec;
			rw_cuda_cpu_pack(&a, next);
			if (err[0]) {
				fprintf(stderr, "bench_rank: CPU pack of rank (%d,%d): error %u/%u\n", n, g,
					err[0], err[1]);
				return -1;
			}
		}

	/* the forward list of rank (0,0): local records, then received, naming one of its experts */
	uint32_t nf = 0;
	for (int area = 0; area < 2; area++)
		for (int r = 0; r < RAILS; r++) {
			const rank_in_t *s = &p->rk[area == 0 ? 0 : 1][r];
			for (uint32_t t = 0; t < T; t++) {
				if (s->slot[0][t] == ~0u)
					continue;
				int hit = 0;
				for (int k = 0; k < TOPK; k++)
					hit |= grank_of(p, s->ids[t * TOPK + k]) == 0;
				if (hit)
					p->fl[nf++] = (rw_cuda_list_entry_t){
						.slot = s->slot[0][t], .rail = (uint16_t)r,
						.area = area == 0 ? RW_CUDA_AREA_LOCAL : RW_CUDA_AREA_RECV,
						.node = (uint32_t)area, .token = t };
			}
		}
	*p->nfl = nf;
	/* the reduce list of rank (0,0), the owner: token order; a term per local rank g' holding
	 * one of the token's experts (its copy of the local record's combine row), and the combine
	 * row node 1 returned */
	uint32_t nr = 0;
	const rank_in_t *me = &p->rk[0][0];
	for (uint32_t t = 0; t < T; t++) {
		if (me->slot[0][t] != ~0u)
			for (uint32_t g = 0; g < GPUS; g++) {
				int hit = 0;
				for (int k = 0; k < TOPK; k++)
					hit |= grank_of(p, me->ids[t * TOPK + k]) == g;
				if (hit)
					p->rl[nr++] = (rw_cuda_list_entry_t){ .slot = me->slot[0][t],
						.rail = (uint16_t)g, .area = RW_CUDA_AREA_LOCAL, .node = 0, .token = t };
			}
		if (me->slot[1][t] != ~0u)
			p->rl[nr++] = (rw_cuda_list_entry_t){ .slot = me->slot[1][t], .rail = 0,
				.area = RW_CUDA_AREA_RECV, .node = 1, .token = t };
	}
	*p->nrl = nr;
	/* the combine rows the reduce reads (written by other ranks and node 1 in a real phase) */
	fill_bf16(p->slab[0].p + p->cret0, (size_t)me->cnt[1] * p->crec);
	for (int r = 0; r < RAILS; r++)
		fill_bf16(p->slab[r].p + p->ccopy[r], (size_t)me->cnt[0] * p->crec);
	/* the combine plan: node s's records on rail r come back in the gather area's part s */
	for (int s = 0; s < NODES; s++)
		for (int r = 0; r < RAILS; r++)
			p->cent[s * RAILS + r] = (rw_cuda_plan_entry_t){
				0, p->rk[s][r].cnt[0],
				p->cgather[r] + (s ? (uint64_t)p->rk[0][r].cnt[0] * p->crec : 0) };

	/* rank (0,0)'s tensors in device memory */
	const size_t xb = (size_t)T * p->row_bytes, ib = (size_t)T * TOPK * 4;
	const uint32_t cap = nf ? nf : 1;
	p->x = dev_alloc(xb);
	p->ids = dev_alloc(ib);
	p->w = dev_alloc(ib);
	p->scratch = dev_alloc(rw_cuda_rank_pack_scratch(T, TOPK));
	p->rows = dev_alloc((size_t)cap * p->row_bytes);
	p->meta = dev_alloc((size_t)cap * (16 + 8 * TOPK));
	p->counts = dev_alloc((size_t)E * 4);
	p->recv_n = dev_alloc(4);
	p->over = dev_alloc(4);
	p->out = dev_alloc(xb);
	p->err = dev_alloc(8);
	if (!p->x || !p->ids || !p->w || !p->scratch || !p->rows || !p->meta || !p->counts ||
	    !p->recv_n || !p->over || !p->out || !p->err)
		return -1;
	if (rw_cuda_memcpy_htod(0, p->x, me->x, xb) != RW_OK ||
	    rw_cuda_memcpy_htod(0, p->ids, me->ids, ib) != RW_OK ||
	    rw_cuda_memcpy_htod(0, p->w, me->w, ib) != RW_OK)
		return -1;

	pack_block(p, 0, 0, 1, p->pent, &p->pack);
	p->pack.x = p->x;
	p->pack.ids = p->ids;
	p->pack.weights = p->w;
	p->pack.scratch = p->scratch;
	p->pack.err = p->err;

	p->fwd = (rw_cuda_rank_forward_t){
		.list = page_dev(p, p->fl), .list_n = page_dev(p, p->nfl), .rows = p->rows,
		.meta = p->meta, .counts = p->counts, .recv_n = p->recv_n, .overflow = p->over,
		.err = p->err, .cap = nf, .topk = TOPK, .hidden = H, .dtype = RW_CUDA_BF16,
		.n_experts = E, .nodes = NODES, .gpus = GPUS, .rails = RAILS, .me = 0, .g = 0,
	};
	for (int r = 0; r < RAILS; r++) {
		p->fwd.area[RW_CUDA_AREA_LOCAL][r] = p->slab[r].d + p->local[r];
		p->fwd.area[RW_CUDA_AREA_RECV][r] = p->slab[r].d + p->recv[r];
	}
	p->gat = (rw_cuda_rank_gather_t){
		.list = page_dev(p, p->fl), .list_n = page_dev(p, p->nfl), .entry = page_dev(p, p->cent),
		.tags = page_dev(p, p->ctags), .rows = { p->rows }, .err = p->err, .cap = nf,
		.hidden = H, .dtype = RW_CUDA_BF16, .nodes = NODES, .rails = RAILS, .me = 0, .g = 0,
	};
	for (int r = 0; r < RAILS; r++)
		p->gat.slab[r] = p->slab[r].d;
	p->red = (rw_cuda_rank_reduce_t){
		.list = page_dev(p, p->rl), .list_n = page_dev(p, p->nrl), .out = p->out, .err = p->err,
		.cap = nr, .n_tokens = T, .hidden = H, .dtype = RW_CUDA_BF16, .rails = RAILS,
	};
	for (int r = 0; r < RAILS; r++) {
		p->red.area[RW_CUDA_AREA_LOCAL][r] = p->slab[r].d + p->ccopy[r];
		p->red.area[RW_CUDA_AREA_RECV][r] = p->slab[r].d + p->cret0; /* rail 0's only used */
	}
	if (p->page_d && rw_cuda_memcpy_htod(0, p->page_d, p->page.p, pb) != RW_OK)
		return -1;
	return 0;
}

/* ---- the ops ---- */

static rw_status_t op_pack(void *c) { phase_t *p = c; return rw_cuda_rank_pack(&p->es, &p->pack); }
static rw_status_t op_forward(void *c) { phase_t *p = c; return rw_cuda_rank_forward(&p->es, &p->fwd); }
static rw_status_t op_gather(void *c) { phase_t *p = c; return rw_cuda_rank_gather(&p->es, &p->gat); }
static rw_status_t op_reduce(void *c) { phase_t *p = c; return rw_cuda_rank_reduce(&p->es, &p->red); }

typedef struct ceil_ctx {
	phase_t *p;
	uint32_t n, unit;
	uint64_t bytes;
	int d2h;
} ceil_ctx_t;

static rw_status_t op_copy16(void *c)
{
	ceil_ctx_t *k = c;
	return rw_cuda_copy_rows(k->p->st, k->p->clist_d, k->n, k->unit, 1);
}

static rw_status_t op_memcpy(void *c)
{
	ceil_ctx_t *k = c;
	rw_cuda_dptr_t h = k->p->chost.d, d = k->p->cdev;
	return rw_cuda_copy_ext(&k->p->es, k->d2h ? h : d, k->d2h ? d : h, k->bytes);
}

/* The copy16 list: n units from the device buffer (packed) to the host buffer at `stride`, or
 * back. */
static void ceil_list(phase_t *p, uint32_t n, uint32_t unit, uint64_t stride, int d2h)
{
	for (uint32_t i = 0; i < n; i++) {
		uint64_t d = p->cdev + (uint64_t)i * unit, h = p->chost.d + i * stride;
		p->clist[i] = (rw_cuda_row_copy_t){ .src = d2h ? d : h, .dst = d2h ? h : d };
	}
}


static void gbps(char *buf, size_t len, double us, uint64_t bytes)
{
	if (us > 0)
		snprintf(buf, len, "%9.2f us %7.2f GB/s", us, (double)bytes / us / 1e3);
	else
		snprintf(buf, len, "%9s us %7s GB/s", "-", "-");
}

/* Time one kernel and its ceilings; print its line. */
static int measure(phase_t *p, const char *kname, op_fn op, uint32_t n, uint32_t unit, int d2h)
{
	CUstream h = (CUstream)(uintptr_t)p->es.handle;
	const uint64_t bytes = (uint64_t)n * unit;
	char k[64], c1[64], c2[64], c3[128] = "";
	double us = time_op(p->st, h, op, p);
	if (us < 0) {
		fprintf(stderr, "bench_rank: %s: a launch failed\n", kname);
		return -1;
	}
	ceil_ctx_t cc = { .p = p, .n = n, .unit = unit, .bytes = bytes, .d2h = d2h };
	double cu = -1, mu = -1, vu = -1;
	if (n) {
		ceil_list(p, n, unit, unit, d2h);
		cu = time_op(p->st, h, op_copy16, &cc);
		mu = time_op(p->st, h, op_memcpy, &cc);
		if (variant) {
			ceil_list(p, n, unit, up(unit, 128), d2h);
			vu = time_op(p->st, h, op_copy16, &cc);
		}
		if (cu < 0 || mu < 0 || (variant && vu < 0)) {
			fprintf(stderr, "bench_rank: %s: a ceiling's copy failed\n", kname);
			return -1;
		}
	}
	gbps(k, sizeof(k), us, bytes);
	gbps(c1, sizeof(c1), cu, bytes);
	gbps(c2, sizeof(c2), mu, bytes);
	if (variant) {
		char v[64];
		gbps(v, sizeof(v), vu, bytes);
		snprintf(c3, sizeof(c3), " | copy16@128 %s x%.2f", v, vu > 0 ? vu / us : 0);
	}
	printf("%-8s T=%-5u %-7s %s %8.3f MB %s | copy16 %s x%.2f | memcpy %s x%.2f%s\n",
	       p->sh->name, p->T, kname, gpu_slabs ? "D2D" : d2h ? "D2H" : "H2D", (double)bytes / 1e6, k, c1,
	       cu > 0 ? cu / us : 0, c2, mu > 0 ? mu / us : 0, c3);
	fflush(stdout);
	return 0;
}

/* ---- checks against the CPU versions ---- */

/* The slabs' contents into their host mirrors (slabs in device memory), or back. */
static int slabs_sync(phase_t *p, int to_host)
{
	for (int r = 0; r < RAILS && gpu_slabs; r++)
		if ((to_host ? rw_cuda_memcpy_dtoh(0, p->slab[r].p, p->slab[r].d, p->slab[r].bytes)
			     : rw_cuda_memcpy_htod(0, p->slab[r].d, p->slab[r].p, p->slab[r].bytes)) != RW_OK)
			return -1;
	return 0;
}

/* Before a kernel's check: the device error word must be 0; the slabs as the kernel left them
 * in the host mirrors. */
static int err_clear(phase_t *p, const char *kname)
{
	uint32_t e[2];
	if (slabs_sync(p, 1) != 0)
		return -1;
	if (rw_cuda_memcpy_dtoh(0, e, p->err, 8) != RW_OK)
		return -1;
	if (e[0]) {
		fprintf(stderr, "bench_rank: %s set the device error word: %u/%u\n", kname, e[0], e[1]);
		return -1;
	}
	return 0;
}

static int same(const char *what, const void *a, const void *b, size_t n)
{
	if (memcmp(a, b, n) == 0)
		return 0;
	const uint8_t *x = a, *y = b;
	size_t i = 0;
	while (x[i] == y[i])
		i++;
	fprintf(stderr, "bench_rank: %s differs from the CPU version at byte %zu of %zu\n", what, i, n);
	return -1;
}

static const rw_cuda_cpu_par_t one = { .threads = 1 };

/* Host addresses for the CPU versions: every slab, page and device address translated. */
static uint64_t hslab(const phase_t *p, uint64_t d)
{
	for (int r = 0; r < RAILS; r++)
		if (d >= p->slab[r].d && d < p->slab[r].d + p->slab[r].bytes)
			return (uint64_t)(uintptr_t)(p->slab[r].p + (d - p->slab[r].d));
	if (d >= p->page.d && d < p->page.d + p->page.bytes)
		return (uint64_t)(uintptr_t)(p->page.p + (d - p->page.d));
	if (p->page_d && d >= p->page_d && d < p->page_d + p->page_bytes) /* --page dev's copy */
		return (uint64_t)(uintptr_t)(p->page.p + (d - p->page_d));
	return d;
}

/* A block's list, its length and (area: not NULL) its areas, as host addresses. */
static void host_lists(const phase_t *p, uint64_t *list, uint64_t *list_n,
		       uint64_t (*area)[RW_CUDA_RANK_RAILS])
{
	*list = hslab(p, *list);
	*list_n = hslab(p, *list_n);
	for (int ar = 0; area && ar < RW_CUDA_AREAS; ar++)
		for (int r = 0; r < RAILS; r++)
			area[ar][r] = hslab(p, area[ar][r]);
}

static int check_pack(phase_t *p)
{
	const rank_in_t *me = &p->rk[0][0];
	const size_t nl = (size_t)me->cnt[0] * p->rec, ns = (size_t)me->cnt[1] * p->rec;
	uint8_t *gl = malloc(nl + ns + 1);
	uint32_t err[2] = { 0, 0 }, next[NODES] = { 0 };
	int rc = -1;
	if (!gl || err_clear(p, "pack") != 0)
		goto out;
	memcpy(gl, p->slab[0].p + p->local[0], nl);
	memcpy(gl + nl, p->slab[0].p + p->send0, ns);
	memset(p->slab[0].p + p->local[0], 0, nl);
	memset(p->slab[0].p + p->send0, 0, ns);
	rw_cuda_rank_pack_t a = p->pack;
	a.x = (uint64_t)(uintptr_t)me->x;
	a.ids = (uint64_t)(uintptr_t)me->ids;
	a.weights = (uint64_t)(uintptr_t)me->w;
	a.entry = hslab(p, a.entry);
	a.tags = hslab(p, a.tags);
	for (int r = 0; r < RAILS; r++)
		a.slab[r] = (uint64_t)(uintptr_t)p->slab[r].p;
	a.scratch = 0;
	a.err = (uint64_t)(uintptr_t)err;
	a.rec_size = p->rec;
	rw_cuda_cpu_pack(&a, next);
	if (err[0] == 0 && same("pack: the local records", gl, p->slab[0].p + p->local[0], nl) == 0 &&
	    same("pack: the records to node 1", gl + nl, p->slab[0].p + p->send0, ns) == 0)
		rc = 0;
out:
	free(gl);
	return rc;
}

/* The forward's outputs; the CPU version's rows stay in *ref_rows for the gather's check. */
static int check_forward(phase_t *p, uint8_t **ref_rows)
{
	const uint32_t nf = *p->nfl, cap = nf ? nf : 1, E = p->sh->experts;
	const size_t rb = (size_t)cap * p->row_bytes, mb = (size_t)cap * (16 + 8 * TOPK);
	uint8_t *g = calloc(1, 2 * (rb + mb + 4ull * E) + 64);
	uint32_t err[2] = { 0, 0 };
	int rc = -1;
	*ref_rows = NULL;
	if (!g || err_clear(p, "forward") != 0)
		goto out;
	uint8_t *grows = g, *gmeta = g + rb, *gcounts = gmeta + mb, *r = gcounts + 4ull * E;
	uint8_t *rrows = r, *rmeta = r + rb, *rcounts = rmeta + mb;
	uint32_t gn[2], rn[2] = { ~0u, ~0u };
	if (rw_cuda_memcpy_dtoh(0, grows, p->rows, rb) != RW_OK ||
	    rw_cuda_memcpy_dtoh(0, gmeta, p->meta, mb) != RW_OK ||
	    rw_cuda_memcpy_dtoh(0, gcounts, p->counts, 4ull * E) != RW_OK ||
	    rw_cuda_memcpy_dtoh(0, &gn[0], p->recv_n, 4) != RW_OK ||
	    rw_cuda_memcpy_dtoh(0, &gn[1], p->over, 4) != RW_OK)
		goto out;
	rw_cuda_rank_forward_t a = p->fwd;
	host_lists(p, &a.list, &a.list_n, a.area);
	a.rows = (uint64_t)(uintptr_t)rrows;
	a.meta = (uint64_t)(uintptr_t)rmeta;
	a.counts = (uint64_t)(uintptr_t)rcounts;
	a.recv_n = (uint64_t)(uintptr_t)&rn[0];
	a.overflow = (uint64_t)(uintptr_t)&rn[1];
	a.err = (uint64_t)(uintptr_t)err;
	a.rec_size = p->rec;
	rw_cuda_cpu_forward(&a, one);
	if (err[0] == 0 && gn[0] == nf && gn[1] == 0 && rn[0] == nf && rn[1] == 0 &&
	    same("forward: rows", grows, rrows, (size_t)nf * p->row_bytes) == 0 &&
	    same("forward: metadata", gmeta, rmeta, (size_t)nf * (16 + 8 * TOPK)) == 0 &&
	    same("forward: counts", gcounts, rcounts, 4ull * E) == 0) {
		rc = 0;
		*ref_rows = malloc(rb);
		if (*ref_rows)
			memcpy(*ref_rows, rrows, rb);
		else
			rc = -1;
	} else if (err[0] == 0 && (gn[0] != nf || gn[1] != 0)) {
		fprintf(stderr, "bench_rank: forward: recv_n %u overflow %u, %u listed\n", gn[0], gn[1], nf);
	}
out:
	free(g);
	return rc;
}

static int check_gather(phase_t *p, const uint8_t *ref_rows)
{
	size_t len[RAILS], tot = 0;
	for (int r = 0; r < RAILS; r++)
		tot += len[r] = (size_t)(p->rk[0][r].cnt[0] + p->rk[1][r].cnt[0]) * p->crec;
	uint8_t *g = malloc(tot + 1);
	uint32_t err[2] = { 0, 0 };
	int rc = -1;
	if (!g || err_clear(p, "gather") != 0)
		goto out;
	size_t o = 0;
	for (int r = 0; r < RAILS; r++) {
		memcpy(g + o, p->slab[r].p + p->cgather[r], len[r]);
		memset(p->slab[r].p + p->cgather[r], 0, len[r]);
		o += len[r];
	}
	rw_cuda_rank_gather_t a = p->gat;
	host_lists(p, &a.list, &a.list_n, NULL);
	a.entry = hslab(p, a.entry);
	a.tags = hslab(p, a.tags);
	for (int r = 0; r < RAILS; r++)
		a.slab[r] = (uint64_t)(uintptr_t)p->slab[r].p;
	a.rows[0] = (uint64_t)(uintptr_t)ref_rows;
	a.err = (uint64_t)(uintptr_t)err;
	a.crec_size = p->crec;
	rw_cuda_cpu_gather(&a, one);
	if (err[0])
		goto out;
	o = 0;
	for (int r = 0; r < RAILS; r++) {
		if (same("gather: combine records", g + o, p->slab[r].p + p->cgather[r], len[r]) != 0)
			goto out;
		o += len[r];
	}
	rc = 0;
out:
	free(g);
	return rc;
}

static int check_reduce(phase_t *p)
{
	const size_t xb = (size_t)p->T * p->row_bytes;
	uint8_t *g = malloc(2 * xb + 16);
	uint32_t err[2] = { 0, 0 };
	int rc = -1;
	if (!g || err_clear(p, "reduce") != 0 || rw_cuda_memcpy_dtoh(0, g, p->out, xb) != RW_OK)
		goto out;
	rw_cuda_rank_reduce_t a = p->red;
	host_lists(p, &a.list, &a.list_n, a.area);
	a.out = (uint64_t)(uintptr_t)(g + xb);
	a.err = (uint64_t)(uintptr_t)err;
	a.crec_size = p->crec;
	rw_cuda_cpu_reduce(&a, one);
	if (err[0] == 0 && same("reduce: the owner's rows", g, g + xb, xb) == 0)
		rc = 0;
out:
	free(g);
	return rc;
}

static void phase_free(phase_t *p)
{
	for (int n = 0; n < NODES; n++)
		for (int g = 0; g < GPUS; g++) {
			free(p->rk[n][g].x);
			free(p->rk[n][g].ids);
			free(p->rk[n][g].w);
			for (int d = 0; d < NODES; d++)
				free(p->rk[n][g].slot[d]);
		}
	for (int r = 0; r < RAILS; r++)
		hmem_unmap(&p->slab[r]);
	hmem_unmap(&p->page);
	hmem_unmap(&p->chost);
	if (p->clist)
		rw_cuda_host_free(p->clist);
	dev_free_all();
}

static int run_case(const shape_t *sh, uint32_t T, rw_cuda_stream_t *st, uint32_t blocks)
{
	phase_t *p = calloc(1, sizeof(*p));
	int rc = -1;
	if (!p)
		return -1;
	p->sh = sh;
	p->T = T;
	p->row_bytes = sh->hidden * 2;
	p->rec = rw_cuda_cpu_rec_size(TOPK, sh->hidden, RW_CUDA_BF16);
	p->crec = rw_cuda_cpu_crec_size(sh->hidden, RW_CUDA_BF16);
	p->st = st;
	if (rw_cuda_ext_stream_of(st, &p->es) != RW_OK)
		goto out;
	p->es.max_blocks = blocks;
	if (gen_tokens(p) != 0 || layout(p) != 0 || build(p) != 0 || slabs_sync(p, 0) != 0) {
		fprintf(stderr, "bench_rank: %s T=%u: setting up the phase failed\n", sh->name, T);
		goto out;
	}
	const rank_in_t *me = &p->rk[0][0];
	const uint32_t npack = me->cnt[0] + me->cnt[1], nf = *p->nfl, nr = *p->nrl;
	/* ceiling buffers: the largest of the four at the 128-rounded stride */
	uint64_t most = 0, mostn = 1;
	const uint64_t units[4][2] = { { npack, p->rec }, { nf, p->rec }, { nf, p->crec },
				       { nr, p->row_bytes } };
	for (int i = 0; i < 4; i++) {
		most = RW_MAX(most, units[i][0] * up(units[i][1], 128));
		mostn = RW_MAX(mostn, units[i][0]);
	}
	void *cl = NULL;
	if (hmem_map(&p->chost, most + 4096) != 0 || !(p->cdev = dev_alloc(most + 16)) ||
	    (gpu_slabs && !(p->chost.d = dev_alloc(most + 4096))) ||
	    rw_cuda_host_alloc(mostn * sizeof(rw_cuda_row_copy_t), &cl) != RW_OK)
		goto out;
	p->clist = cl;
	p->clist_d = (uint64_t)(uintptr_t)cl; /* unified addressing: pinned memory's own address */
	fill_bf16(p->chost.p, most);
	printf("%-8s T=%-5u hidden %u bf16, %u experts, top-%d, %d nodes x %d ranks: records to nodes "
	       "0/1 %u/%u, forward rows %u, reduce terms %u; rec_size %u (mod 128 = %u), crec_size %u "
	       "(mod 128 = %u), row %u (mod 128 = %u); slabs in %s; page in %s; blocks %s\n",
	       sh->name, T, sh->hidden, sh->experts, TOPK, NODES, GPUS, me->cnt[0], me->cnt[1], nf,
	       nr, p->rec, p->rec % 128, p->crec, p->crec % 128, p->row_bytes, p->row_bytes % 128,
	       gpu_slabs ? "device memory" : "host memory", dev_page ? "device memory" : "host memory",
	       blocks ? "capped" : "the wrappers'");
	if (blocks)
		printf("%-8s T=%-5u max_blocks %u\n", sh->name, T, blocks);
	uint8_t *ref_rows = NULL;
	if (measure(p, "pack", op_pack, npack, p->rec, 1) != 0 || check_pack(p) != 0 ||
	    measure(p, "forward", op_forward, nf, p->rec, 0) != 0 ||
	    check_forward(p, &ref_rows) != 0 ||
	    measure(p, "gather", op_gather, nf, p->crec, 1) != 0 ||
	    check_gather(p, ref_rows) != 0 ||
	    measure(p, "reduce", op_reduce, nr, p->row_bytes, 0) != 0 || check_reduce(p) != 0) {
		free(ref_rows);
		fprintf(stderr, "bench_rank: %s T=%u FAILED\n", sh->name, T);
		goto out;
	}
	free(ref_rows);
	printf("%-8s T=%-5u verified: pack forward gather reduce (against cuda/rank_cpu.c)\n",
	       sh->name, T);
	rc = 0;
out:
	phase_free(p);
	free(p);
	return rc;
}

static int parse_list(const char *s, uint32_t *v, int max)
{
	int n = 0;
	char *end;
	while (*s && n < max) {
		unsigned long x = strtoul(s, &end, 10);
		if (end == s || x == 0 || x > 1u << 20)
			return -1;
		v[n++] = (uint32_t)x;
		s = *end == ',' ? end + 1 : end;
		if (*end && *end != ',')
			return -1;
	}
	return n;
}

static void usage(void)
{
	fprintf(stderr, "usage: bench_rank [--shapes deepseek,glm] [--tokens 1,128,512,4096] "
			"[--reps N] [--blocks N] [--variant] [--slabs host|gpu] [--page dev|host] [--seed S]\n");
}

int main(int argc, char **argv)
{
	uint32_t tokens[16] = { 1, 128, 512, 4096 }, blocks = 0;
	int ntok = 4, want[2] = { 1, 1 };
	uint64_t seed = 7;
	for (int i = 1; i < argc; i++) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (strcmp(argv[i], "--variant") == 0) {
			variant = 1;
		} else if (strcmp(argv[i], "--tokens") == 0 && v) {
			ntok = parse_list(v, tokens, 16);
			i++;
			if (ntok <= 0) {
				usage();
				return 2;
			}
		} else if (strcmp(argv[i], "--shapes") == 0 && v) {
			want[0] = strstr(v, "deepseek") != NULL;
			want[1] = strstr(v, "glm") != NULL;
			i++;
			if (!want[0] && !want[1]) {
				usage();
				return 2;
			}
		} else if (strcmp(argv[i], "--reps") == 0 && v) {
			reps = atoi(v);
			i++;
			if (reps < 1 || reps > MAXREPS) {
				usage();
				return 2;
			}
		} else if (strcmp(argv[i], "--blocks") == 0 && v) {
			blocks = (uint32_t)strtoul(v, NULL, 10);
			i++;
		} else if ((strcmp(argv[i], "--slabs") == 0 || strcmp(argv[i], "--page") == 0) && v) {
			/* where the slabs (gpu|host) or the page's words (dev|host) live */
			int *on = argv[i][2] == 's' ? &gpu_slabs : &dev_page;
			*on = strcmp(v, argv[i][2] == 's' ? "gpu" : "dev") == 0;
			i++;
			if (!*on && strcmp(v, "host") != 0) {
				usage();
				return 2;
			}
		} else if (strcmp(argv[i], "--seed") == 0 && v) {
			seed = strtoull(v, NULL, 0);
			i++;
		} else {
			usage();
			return 2;
		}
	}
	rng_state = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
	rw_log_set_level(RW_LOG_WARN);
	if (rw_cuda_init() != RW_OK || rw_cuda_device_count() < 1) {
		printf("bench_rank: no GPU (%s)\n", rw_cuda_unavailable_reason());
		return 77;
	}
	if (!rw_cuda_rank_kernels_available(0)) {
		printf("bench_rank: the rank kernels do not load on device 0\n");
		return 77;
	}
	char name[128] = "?";
	int ver = 0;
	rw_cuda_device_name(0, name, sizeof(name));
	rw_cuda_driver_version(&ver);
	events_load();
	printf("bench_rank: %s, driver %d, %d SMs; %d reps (median) after %d warm-up; timer: %s\n",
	       name, ver, rw_cuda_device_sms(0), reps, WARM,
	       ev.on ? "CUDA events" : "host clock around a stream sync (no cuEventElapsedTime)");
	rw_cuda_stream_t *st;
	if (rw_cuda_stream_create(0, &st) != RW_OK) {
		fprintf(stderr, "bench_rank: no stream\n");
		return 1;
	}
	int rc = 0;
	for (int s = 0; s < 2; s++)
		for (int i = 0; i < ntok && want[s]; i++)
			if (run_case(&shapes[s], tokens[i], st, blocks) != 0)
				rc = 1;
	rw_cuda_stream_destroy(st);
	rw_cuda_shutdown();
	return rc;
}
#else
int main(void)
{
	printf("bench_rank: built without cuda.h or nvcc (no rank image); skipped\n");
	return 77;
}
#endif
