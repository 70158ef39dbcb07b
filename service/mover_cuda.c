/* The CUDA data mover (service/mover.h; docs/dataflow.md "CUDA buffers"): for pairs whose ranks
 * gave CUDA memory, kernels on the daemon's own stream per device move every payload byte —
 * token rows into the send slabs, arrived rows into the ranks' outputs, combine rows summed into
 * the return slabs and into the owners' fp32 sums — and the loop's CPU only writes record
 * headers, metadata and the row lists the kernels follow. The slabs are the mesh's host memory,
 * registered and mapped into the GPUs, so kernels read and write them directly (no staging
 * copy). Completions come back as stream marks on an eventfd watched by the loop. The arithmetic
 * is the host mover's (service/mover_host.c, service/forward.c): fp32 sums in the same order,
 * bf16 rounded by the same formula. RAILWAVE_CUDA_MOVER=0 turns it off, =check verifies every
 * row it copies (docs/dataflow.md "Test hooks"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ev.h>

#include "common/arena.h"
#include "cuda/rw_cuda.h"
#include "service/mover.h"
#include "service/wire.h"

#define CM_DEVICES 32   /* device ordinals this mover drives (bitmasks below) */
#define CM_REGS (2 * RW_MAX_RAILS * 4) /* mapped slot areas: slots x rails, with room */
#define CM_BLOCKS 64    /* pooled device blocks (owner sums) */
#define CM_TABS 4       /* pooled pinned row-list buffers (a pair holds one from plan to close) */
#define CM_POLL_BATCH 64

typedef struct cuda_mover cuda_mover_t;

/* One device's stream; its completion eventfd is an ev_io on the loop. */
typedef struct cm_dev {
	rw_cuda_stream_t *stream;
	ev_io io;
	cuda_mover_t *m;
	int kernels;                 /* 0 unknown, 1 loaded, -1 absent (logged once) */
} cm_dev_t;

/* A row list of one device: entries are appended, [launched, n) not yet launched. Copy lists
 * use `copy`; sum lists `sum` with their source addresses in `src`. */
typedef struct cm_list {
	rw_cuda_row_copy_t *copy;
	rw_cuda_row_sum_t *sum;
	uint64_t *src;
	uint32_t cap, n, launched, src_cap, n_src;
	uint64_t addr_bits;          /* OR of the addresses since the last launch (alignment) */
} cm_list_t;

typedef struct cm_pair {
	cuda_mover_t *m;
	struct cm_pair *next;
	uint32_t serial, gpus;
	const rw_svc_phase_t *ph;    /* the executor's view of the pair (lives longer than cp) */
	rw_arena_t mem;
	int home;                    /* runs host-memory ranks' work: the pair's first CUDA device */
	int xdev[RW_MAX_GPUS];       /* the device whose stream writes rank g's memory */
	uint32_t devs;               /* devices with work of this pair ever enqueued */
	uint32_t dirty;              /* devices with work enqueued after their last mark */
	uint32_t pending;            /* marks not yet completed */
	uint32_t marks_d[RW_MAX_GPUS]; /* dispatch staging marks per rank */
	uint32_t marks_c;            /* marks of the combine's slab and fold kernels */
	uint32_t c_staged;           /* ranks whose combine rows are in (bit g) */
	/* device-readable inputs: token rows, combine rows */
	rw_cuda_dptr_t tok[RW_MAX_GPUS], crow[RW_MAX_GPUS];
	/* the plan */
	uint32_t n_local, n_total;
	uint32_t *local_ref;         /* [2 * n_local]: (rank, token) of each local-node record */
	int local_kind;
	uint32_t bg_i;
	rw_svc_out_layout_t out[RW_MAX_GPUS];
	uint8_t *counts_st[RW_MAX_GPUS], *rows_st[RW_MAX_GPUS], *meta_st[RW_MAX_GPUS];
	rw_cuda_dptr_t rows_d[RW_MAX_GPUS];
	uint32_t *fwd_ref[RW_MAX_GPUS];
	uint32_t fwd_n[RW_MAX_GPUS];
	uint32_t *expert_counts[RW_MAX_GPUS];
	uint32_t *contrib;           /* [n_total * G]: 1 + row of record ref in rank g's combine input */
	int acc_blk[RW_MAX_GPUS];    /* pool block of rank g's fp32 owner sums (-1: none) */
	rw_cuda_dptr_t acc[RW_MAX_GPUS];
	rw_cuda_dptr_t send_d[2][RW_MAX_RAILS], recv_d[2][RW_MAX_RAILS];
	int tab;                     /* pool index of the pinned row lists (-1: none) */
	cm_list_t fwd[CM_DEVICES], sums[CM_DEVICES]; /* per device: forwards; owner-sum adds */
	cm_list_t pack, cslab;       /* the dispatch slabs' rows; the combine slabs' sums */
	uint8_t **pk_hdr;            /* [n_rec]: where each dispatch record's header goes */
	int packed;                  /* the dispatch slabs' kernels are known done */
} cm_pair_t;

struct cuda_mover {
	struct ev_loop *loop;
	rw_svc_mover_done_fn done;
	void *ctx;
	int off;                     /* RAILWAVE_CUDA_MOVER=0: decline every pair */
	int check;                   /* RAILWAVE_CUDA_MOVER=check: verify every row copy */
	cm_dev_t dev[CM_DEVICES];
	cm_pair_t *pairs;
	struct { uint8_t *base; uint64_t bytes; rw_cuda_dptr_t dptr; } reg[CM_REGS];
	uint32_t n_reg;
	struct { int dev; rw_cuda_dptr_t ptr; size_t size; int busy; } blk[CM_BLOCKS];
	struct { rw_svc_pinned_t buf; int busy; } tabs[CM_TABS];
};

enum { OP_STAGE_D = 0, OP_STAGE_C = 1, OP_FLUSH_D = 2, OP_FLUSH_C = 3 };

static uint64_t cm_token(const cm_pair_t *cp, uint32_t op, uint32_t g)
{
	return (uint64_t)cp->serial << 32 | (uint64_t)op << 8 | g;
}

static rw_cuda_dptr_t hptr(const void *p) { return (rw_cuda_dptr_t)(uintptr_t)p; }

static cm_pair_t *pair_find(cuda_mover_t *m, uint32_t serial)
{
	cm_pair_t *cp = m->pairs;
	while (cp && cp->serial != serial)
		cp = cp->next;
	return cp;
}

/* ---- streams ---------------------------------------------------------------------------------- */

static void dev_drop(cuda_mover_t *m, cm_dev_t *d)
{
	if (!d->stream)
		return;
	ev_io_stop(m->loop, &d->io);
	rw_cuda_stream_destroy(d->stream); /* waits for what is still enqueued */
	d->stream = NULL;
}

static void host_copy_out(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind, uint32_t g);
static void combine_headers(cm_pair_t *cp, const rw_svc_phase_t *ph);

/* A mark completed: route it to its pair. Host-memory ranks' outputs are copied out of their
 * pinned staging here, once the kernels that wrote it are done. */
static void mark_done(cuda_mover_t *m, uint64_t token)
{
	uint32_t serial = (uint32_t)(token >> 32), op = (uint32_t)(token >> 8) & 0xffu,
		 g = (uint32_t)token & 0xffu;
	cm_pair_t *cp = pair_find(m, serial);
	if (!cp || !cp->pending || g >= RW_MAX_GPUS)
		return; /* a pair that ended meanwhile (it waited for its work then) */
	cp->pending--;
	if (op == OP_STAGE_D) {
		if (cp->marks_d[g] && --cp->marks_d[g] == 0)
			m->done(m->ctx, serial, RW_MV_OP_STAGE_D, g, RW_OK);
	} else if (op == OP_STAGE_C) {
		if (cp->marks_c && --cp->marks_c == 0) {
			combine_headers(cp, cp->ph);
			/* A report may end the pair: nothing of cp is touched after the first. */
			const uint32_t gpus = cp->gpus;
			for (uint32_t r = 0; r < gpus; r++)
				m->done(m->ctx, serial, RW_MV_OP_STAGE_C, r, RW_OK);
		}
	} else {
		int kind = op == OP_FLUSH_C;
		if (cp->ph->io[kind][g].out.dev < 0)
			host_copy_out(cp, cp->ph, kind, g);
		m->done(m->ctx, serial, RW_MV_OP_FINISH, g, RW_OK);
	}
}

static void dev_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop, (void)revents;
	cm_dev_t *d = w->data;
	cuda_mover_t *m = d->m;
	uint64_t tokens[CM_POLL_BATCH];
	for (;;) {
		if (!d->stream)
			return;
		int n = rw_cuda_stream_poll(d->stream, tokens, CM_POLL_BATCH);
		if (n < 0) {
			/* A faulted stream never completes its marks: every pending op fails. */
			rw_err("cuda mover: stream of device %d failed: %s", (int)(d - m->dev),
			       rw_status_str((rw_status_t)n));
			dev_drop(m, d);
			for (cm_pair_t *cp = m->pairs; cp; cp = cp->next) {
				cp->pending = cp->marks_c = 0;
				memset(cp->marks_d, 0, sizeof(cp->marks_d));
			}
			m->done(m->ctx, 0, RW_MV_OP_ALL, 0, (rw_status_t)n);
			return;
		}
		for (int i = 0; i < n; i++)
			mark_done(m, tokens[i]);
		if (n < CM_POLL_BATCH)
			return;
	}
}

static rw_status_t dev_stream(cuda_mover_t *m, int device, rw_cuda_stream_t **s_p)
{
	if (device < 0 || device >= CM_DEVICES)
		return RW_ERR_INVAL;
	cm_dev_t *d = &m->dev[device];
	if (!d->stream) {
		rw_status_t st = rw_cuda_stream_create(device, &d->stream);
		if (st != RW_OK)
			return st;
		ev_io_init(&d->io, dev_io_cb, rw_cuda_stream_fd(d->stream), EV_READ);
		d->io.data = d;
		ev_io_start(m->loop, &d->io);
	}
	*s_p = d->stream;
	return RW_OK;
}

/* Work of cp is about to be enqueued on `device`: its stream, noted for quiesce. */
static rw_status_t pair_stream(cm_pair_t *cp, int device, rw_cuda_stream_t **s_p)
{
	rw_status_t st = dev_stream(cp->m, device, s_p);
	if (st == RW_OK) {
		cp->devs |= 1u << device;
		cp->dirty |= 1u << device;
	}
	return st;
}

static rw_status_t pair_mark(cm_pair_t *cp, int device, uint32_t op, uint32_t g)
{
	rw_cuda_stream_t *s;
	rw_status_t st = pair_stream(cp, device, &s);
	if (st == RW_OK)
		st = rw_cuda_stream_mark(s, cm_token(cp, op, g));
	if (st != RW_OK)
		return st;
	cp->dirty &= ~(1u << device);
	cp->pending++;
	return RW_OK;
}

/* Block until every stream cp used is idle (failure paths, and the dispatch slabs: pack()). */
static rw_status_t pair_sync(cm_pair_t *cp)
{
	rw_status_t res = RW_OK;
	for (int d = 0; d < CM_DEVICES; d++)
		if ((cp->devs & (1u << d)) && cp->m->dev[d].stream) {
			rw_status_t st = rw_cuda_stream_sync(cp->m->dev[d].stream);
			if (st != RW_OK)
				res = st;
		}
	cp->dirty = 0;
	return res;
}

/* ---- pools: mapped slab areas, device blocks, pinned row lists ---------------------------------- */

/* The device address of the pair's slot areas on every rail. The executor carves a slot of each
 * rail's memory into four equal consecutive areas (receive dispatch, receive combine, send
 * dispatch, send combine: exec_sub_off); the whole slot is registered once and stays so. */
static rw_status_t map_areas(cuda_mover_t *m, cm_pair_t *cp, const rw_svc_phase_t *ph, char *why)
{
	for (uint32_t r = 0; r < ph->rails; r++) {
		uint8_t *base = (uint8_t *)(uintptr_t)ph->recv_area[0][r];
		uint64_t sub = (uint64_t)(ph->recv_area[1][r] - ph->recv_area[0][r]);
		if (ph->recv_area[1][r] <= ph->recv_area[0][r] || ph->send_area[0][r] != base + 2 * sub ||
		    ph->send_area[1][r] != base + 3 * sub) {
			snprintf(why, RW_SVC_WHY_MAX, "rail %u's areas are not one slot of four", r);
			return RW_ERR_STATE;
		}
		uint32_t i = 0;
		while (i < m->n_reg && m->reg[i].base != base)
			i++;
		if (i == m->n_reg) {
			if (m->n_reg == CM_REGS) {
				snprintf(why, RW_SVC_WHY_MAX, "too many slab areas to map into the GPU");
				return RW_ERR_NOMEM;
			}
			rw_status_t st = rw_cuda_host_register_mapped(base, 4 * sub, &m->reg[i].dptr);
			if (st != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "cannot map rail %u's slabs into the GPU: %s",
					 r, rw_status_str(st));
				return RW_ERR_DEVICE;
			}
			m->reg[i].base = base;
			m->reg[i].bytes = 4 * sub;
			m->n_reg++;
			rw_info("cuda mover: rail %u slot area (%llu MiB of host memory) mapped into the GPUs%s",
				r, (unsigned long long)(4 * sub) >> 20,
				m->reg[i].dptr == hptr(base) ? "" : " (at another device address)");
		}
		for (int k = 0; k < 2; k++) {
			cp->recv_d[k][r] = m->reg[i].dptr + (uint64_t)(ph->recv_area[k][r] - base);
			cp->send_d[k][r] = m->reg[i].dptr + (uint64_t)(ph->send_area[k][r] - base);
		}
	}
	return RW_OK;
}

static int blk_take(cuda_mover_t *m, int dev, size_t size)
{
	int freed = -1;
	for (int i = 0; i < CM_BLOCKS; i++)
		if (!m->blk[i].busy && m->blk[i].ptr && m->blk[i].dev == dev) {
			if (m->blk[i].size >= size) {
				m->blk[i].busy = 1;
				return i;
			}
			freed = i;
		}
	if (freed < 0)
		for (int i = 0; i < CM_BLOCKS && freed < 0; i++)
			if (!m->blk[i].ptr)
				freed = i;
	if (freed < 0)
		return -1;
	if (m->blk[freed].ptr) /* too small: replace it (its last user is quiesced) */
		rw_cuda_mem_free(m->blk[freed].dev, m->blk[freed].ptr);
	m->blk[freed].ptr = 0;
	if (rw_cuda_mem_alloc(dev, size, &m->blk[freed].ptr) != RW_OK)
		return -1;
	m->blk[freed].dev = dev;
	m->blk[freed].size = size;
	m->blk[freed].busy = 1;
	return freed;
}

/* ---- the ops ----------------------------------------------------------------------------------- */

static rw_status_t cm_create(struct ev_loop *loop, rw_svc_mover_done_fn done, void *ctx,
			     void **mover_p)
{
	cuda_mover_t *m = calloc(1, sizeof(*m));
	if (!m)
		return RW_ERR_NOMEM;
	m->loop = loop;
	m->done = done;
	m->ctx = ctx;
	for (int d = 0; d < CM_DEVICES; d++)
		m->dev[d].m = m;
	const char *e = getenv("RAILWAVE_CUDA_MOVER");
	if (e && strcmp(e, "0") == 0) {
		m->off = 1;
		rw_warn("test hook RAILWAVE_CUDA_MOVER=0: the CUDA mover is off; the host mover stages "
			"CUDA ranks through pinned host memory");
	} else if (e && strcmp(e, "check") == 0) {
		m->check = 1;
		rw_warn("test hook RAILWAVE_CUDA_MOVER=check: every row the CUDA mover's kernels copy is "
			"read back and compared (slow: bring-up only)");
	}
	*mover_p = m;
	return RW_OK;
}

static void cm_destroy(void *mover)
{
	cuda_mover_t *m = mover;
	for (int d = 0; d < CM_DEVICES; d++)
		dev_drop(m, &m->dev[d]);
	for (int i = 0; i < CM_BLOCKS; i++)
		if (m->blk[i].ptr)
			rw_cuda_mem_free(m->blk[i].dev, m->blk[i].ptr);
	for (int i = 0; i < CM_TABS; i++)
		rw_svc_pinned_free(&m->tabs[i].buf);
	for (uint32_t i = 0; i < m->n_reg; i++)
		rw_cuda_host_unregister(m->reg[i].base);
	/* No rw_cuda_shutdown() here: the host mover (destroyed after us) may still hold streams
	 * and the ranks' pinned staging in the same primary contexts; its stage releases them. */
	free(m);
}

/* Kernels on `dev`: loaded once per device; a device without them is said once. */
static int dev_kernels(cuda_mover_t *m, int dev)
{
	if (dev < 0 || dev >= CM_DEVICES)
		return 0;
	cm_dev_t *d = &m->dev[dev];
	if (d->kernels == 0) {
		d->kernels = rw_cuda_kernels_available(dev) ? 1 : -1;
		if (d->kernels < 0)
			rw_info("cuda mover: no kernels on device %d: the host mover stages its ranks", dev);
		else
			rw_info("cuda mover: kernels loaded on device %d: its ranks' bytes move on the GPU",
				dev);
	}
	return d->kernels > 0;
}

/* A pair is ours when its first submission gave CUDA memory on a device with kernels; once
 * ours, every later rank of it is (host-memory ranks too). */
static int cm_accepts(void *mover, const rw_svc_phase_t *ph, int kind, uint32_t g)
{
	cuda_mover_t *m = mover;
	if (pair_find(m, ph->serial))
		return 1;
	if (m->off)
		return 0;
	const rw_svc_rank_io_t *io = &ph->io[kind][g];
	for (int i = 0; i < 4; i++) {
		const rw_svc_span_mem_t *s = i < 3 ? &io->in[i] : &io->out;
		if (s->dev >= 0)
			return dev_kernels(m, s->dev);
	}
	return 0;
}

static rw_status_t cm_open(void *mover, const rw_svc_phase_t *ph, void **state_p)
{
	cuda_mover_t *m = mover;
	cm_pair_t *cp = calloc(1, sizeof(*cp));
	if (!cp)
		return RW_ERR_NOMEM;
	cp->m = m;
	cp->serial = ph->serial;
	cp->gpus = ph->gpus;
	cp->ph = ph;
	cp->home = -1;
	cp->tab = -1;
	for (uint32_t g = 0; g < RW_MAX_GPUS; g++)
		cp->acc_blk[g] = -1;
	for (uint32_t g = 0; g < ph->gpus && cp->home < 0; g++)
		for (int i = 0; i < 4 && cp->home < 0; i++) {
			const rw_svc_span_mem_t *s = i < 3 ? &ph->io[0][g].in[i] : &ph->io[0][g].out;
			if (s->dev >= 0 && s->dev < CM_DEVICES)
				cp->home = s->dev;
		}
	if (cp->home < 0)
		cp->home = 0;
	cp->next = m->pairs;
	m->pairs = cp;
	*state_p = cp;
	return RW_OK;
}

static void cm_quiesce(void *mover, void *state)
{
	(void)mover;
	cm_pair_t *cp = state;
	if (cp->pending || cp->dirty) {
		/* Kernels or copies touching ranks' memory (or pooled blocks) may still run: wait
		 * (failure path; on success every device's last work is marked and done). */
		pair_sync(cp);
		cp->pending = cp->marks_c = 0;
		memset(cp->marks_d, 0, sizeof(cp->marks_d));
	}
}

static void cm_close(void *mover, void *state)
{
	cuda_mover_t *m = mover;
	cm_pair_t *cp = state;
	cm_quiesce(mover, state);
	for (cm_pair_t **pp = &m->pairs; *pp; pp = &(*pp)->next)
		if (*pp == cp) {
			*pp = cp->next;
			break;
		}
	for (uint32_t g = 0; g < RW_MAX_GPUS; g++)
		if (cp->acc_blk[g] >= 0)
			m->blk[cp->acc_blk[g]].busy = 0;
	if (cp->tab >= 0)
		m->tabs[cp->tab].busy = 0;
	rw_arena_free(&cp->mem);
	free(cp);
}

/* ---- inputs --------------------------------------------------------------------------------- */

static int span_dev_ok(cuda_mover_t *m, const rw_svc_span_mem_t *s)
{
	return s->dev < 0 || dev_kernels(m, s->dev);
}

/* Dispatch: token rows stay where they are (CUDA) or are copied into the rank's pinned staging
 * (host memory, which kernels read mapped); top-k ids and weights must be host-readable for the
 * count pass and the record headers: CUDA ones are copied down (a few bytes per token). */
static rw_status_t stage_dispatch(cm_pair_t *cp, rw_svc_phase_t *ph, uint32_t g, int *pending_p,
				  char *why)
{
	cuda_mover_t *m = cp->m;
	rw_svc_rank_io_t *io = &ph->io[0][g];
	const uint64_t n = io->n_tokens;
	const uint64_t len[3] = { n * ph->row_bytes, n * ph->topk * 4, n * ph->topk * 4 };
	const uint8_t *host[3] = { NULL, NULL, NULL };
	uint64_t need = 0;
	for (int i = 0; i < 3; i++)
		if ((i == 0) != (io->in[i].dev >= 0) && len[i])
			need += (len[i] + 63) & ~(uint64_t)63;
	rw_status_t st = RW_OK;
	rw_svc_pinned_t *stage = ph->stage_in[g];
	if (need)
		st = rw_svc_pinned_reserve(stage, need);
	uint64_t off = 0;
	uint32_t devs = 0;
	for (int i = 0; i < 3 && st == RW_OK; i++) {
		const rw_svc_span_mem_t *s = &io->in[i];
		if (!span_dev_ok(m, s)) {
			snprintf(why, RW_SVC_WHY_MAX, "local rank %u's buffer is on GPU %d, which has no "
				 "kernels", g, s->dev);
			return RW_ERR_DEVICE;
		}
		if (i == 0) {
			if (s->dev >= 0) {
				cp->tok[g] = s->dptr;
			} else if (len[0]) {
				uint8_t *dst = (uint8_t *)stage->ptr + off;
				memcpy(dst, s->host, len[0]);
				cp->tok[g] = hptr(dst);
				off += (len[0] + 63) & ~(uint64_t)63;
			}
			host[0] = s->host;
		} else if (s->dev >= 0 && len[i]) {
			rw_cuda_stream_t *str;
			uint8_t *dst = (uint8_t *)stage->ptr + off;
			st = pair_stream(cp, s->dev, &str);
			if (st == RW_OK)
				st = rw_cuda_copy_dtoh_async(str, dst, s->dptr, len[i]);
			host[i] = dst;
			off += (len[i] + 63) & ~(uint64_t)63;
			devs |= 1u << s->dev;
		} else {
			host[i] = s->host;
		}
	}
	*pending_p = 0;
	for (int d = 0; d < CM_DEVICES && st == RW_OK; d++)
		if (devs & (1u << d)) {
			st = pair_mark(cp, d, OP_STAGE_D, g);
			if (st == RW_OK)
				cp->marks_d[g]++;
		}
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "cannot stage local rank %u's top-k ids: %s", g,
			 rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	*pending_p = cp->marks_d[g] != 0;
	io->tokens = host[0];
	io->ids = (const int32_t *)(const void *)host[1];
	io->weights = (const float *)(const void *)host[2];
	return RW_OK;
}

static rw_status_t combine_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why);

/* The combine slabs' record headers, written by the CPU once the slab kernels are done (see
 * dispatch_headers); a record no local rank computed (never: each went to one) gets a zero row. */
static void combine_headers(cm_pair_t *cp, const rw_svc_phase_t *ph)
{
	const rw_svc_layout_t *l = ph->layout;
	for (uint32_t d = 0; d < ph->nodes; d++)
		for (uint32_t r = 0; r < ph->rails; r++) {
			size_t i = (size_t)d * ph->rails + r;
			for (uint32_t k = 0; k < l->in_quota[i]; k++) {
				uint32_t pos = l->in_first[i] + k, ref = ph->rail_base[r] + pos, n = 0;
				uint8_t *dst = ph->send_area[1][r] + (uint64_t)pos * ph->crec_size;
				rw_wire_crec_hdr_t h = { .tag = ph->tag_to[d], .src_node = ph->me, .rail = r,
							 .slot = k };
				rw_wire_crec_pack(dst, &h);
				for (uint32_t g = 0; g < ph->gpus; g++)
					n += cp->contrib[(size_t)ref * ph->gpus + g] != 0;
				if (!n)
					memset(dst + RW_WIRE_CREC_HDR, 0, ph->row_bytes);
			}
		}
}

/* Combine: rows stay on the GPU (CUDA) or are copied into pinned staging (host memory). Once
 * every local rank is in, one launch per device writes every return slab and folds the
 * local-node records into the owners' sums; the ranks count as staged when those kernels are
 * done, so pack() has nothing left to do. */
static rw_status_t stage_combine(cm_pair_t *cp, rw_svc_phase_t *ph, uint32_t g, int *pending_p,
				 char *why)
{
	rw_svc_rank_io_t *io = &ph->io[1][g];
	const rw_svc_span_mem_t *s = &io->in[0];
	const uint64_t len = (uint64_t)cp->fwd_n[g] * ph->row_bytes;
	if (!span_dev_ok(cp->m, s)) {
		snprintf(why, RW_SVC_WHY_MAX, "local rank %u's combine rows are on GPU %d, which has no "
			 "kernels", g, s->dev);
		return RW_ERR_DEVICE;
	}
	if (s->dev >= 0) {
		cp->crow[g] = s->dptr;
	} else if (len) {
		rw_svc_pinned_t *stage = ph->stage_in[g];
		if (rw_svc_pinned_reserve(stage, len) != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "out of pinned memory for local rank %u's rows", g);
			return RW_ERR_NOMEM;
		}
		memcpy(stage->ptr, s->host, len);
		cp->crow[g] = hptr(stage->ptr);
	}
	io->tokens = s->host;
	cp->c_staged |= 1u << g;
	*pending_p = 1;
	if (cp->c_staged != (uint32_t)((1ull << ph->gpus) - 1))
		return RW_OK;
	return combine_launch(cp, ph, why);
}

static rw_status_t cm_stage(void *mover, void *state, rw_svc_phase_t *ph, int kind, uint32_t g,
			    int *pending_p, char *why)
{
	(void)mover;
	return kind == 0 ? stage_dispatch(state, ph, g, pending_p, why)
			 : stage_combine(state, ph, g, pending_p, why);
}

/* ---- row lists -------------------------------------------------------------------------------- */

static void list_copy(cm_list_t *l, rw_cuda_dptr_t src, rw_cuda_dptr_t dst)
{
	l->copy[l->n++] = (rw_cuda_row_copy_t){ .src = src, .dst = dst };
	l->addr_bits |= src | dst;
}

/* Open a sum entry for dst; list_src() adds its rows in order. */
static void list_sum(cm_list_t *l, rw_cuda_dptr_t dst)
{
	l->sum[l->n++] = (rw_cuda_row_sum_t){ .dst = dst, .first = l->n_src, .count = 0 };
	l->addr_bits |= dst;
}

static void list_src(cm_list_t *l, rw_cuda_dptr_t src)
{
	l->src[l->n_src++] = src;
	l->sum[l->n - 1].count++;
	l->addr_bits |= src;
}

/* RAILWAVE_CUDA_MOVER=check: read `n` bytes at a kernel-visible address from the CPU: a mapped
 * slab area through its host mapping, device memory by a blocking copy, anything else (pinned
 * host memory, whose device address is its host address) in place. */
static void check_read(cm_pair_t *cp, int dev, uint64_t addr, uint8_t *buf, size_t n)
{
	cuda_mover_t *m = cp->m;
	for (uint32_t i = 0; i < m->n_reg; i++)
		if (addr >= m->reg[i].dptr && addr + n <= m->reg[i].dptr + m->reg[i].bytes) {
			memcpy(buf, m->reg[i].base + (addr - m->reg[i].dptr), n);
			return;
		}
	if (rw_cuda_memcpy_dtoh(dev, buf, addr, n) != RW_OK)
		memcpy(buf, (const void *)(uintptr_t)addr, n);
}

/* Compare entries [from, to) of a copy list with their sources (after waiting for `dev`). */
static void check_copies(cm_pair_t *cp, const rw_svc_phase_t *ph, const cm_list_t *l, int dev,
			 uint32_t from, uint32_t to, const char *what)
{
	uint8_t a[4096], b[4096];
	uint32_t bad = 0, first = 0, at = 0;
	const size_t rb = ph->row_bytes;
	if (dev >= 0 && cp->m->dev[dev].stream)
		rw_cuda_stream_sync(cp->m->dev[dev].stream);
	for (uint32_t i = from; i < to; i++)
		for (size_t off = 0; off < rb; off += sizeof(a)) {
			size_t n = RW_MIN(sizeof(a), rb - off);
			check_read(cp, dev, l->copy[i].src + off, a, n);
			check_read(cp, dev, l->copy[i].dst + off, b, n);
			if (memcmp(a, b, n) != 0) {
				if (!bad++) {
					first = i;
					while (a[at] == b[at])
						at++;
					at += (uint32_t)off;
				}
				break;
			}
		}
	if (bad)
		rw_err("cuda mover check: pair %u %s on GPU %d: %u of %u rows differ from their source "
		       "(first: entry %u at byte %u, src 0x%llx dst 0x%llx)", cp->serial, what, dev, bad,
		       to - from, first, at, (unsigned long long)l->copy[first].src,
		       (unsigned long long)l->copy[first].dst);
	else
		rw_info("cuda mover check: pair %u %s on GPU %d: %u rows equal their source", cp->serial,
			what, dev, to - from);
}

/* Launch what device `dev`'s list holds beyond what was launched. kind: 0 copy, 1 owner sums
 * (fp32 accumulate), 2 combine slab sums. */
static rw_status_t list_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, cm_list_t *l, int dev,
			       int kind)
{
	if (l->n == l->launched)
		return RW_OK;
	rw_cuda_stream_t *s;
	rw_status_t st = pair_stream(cp, dev, &s);
	const uint32_t n = l->n - l->launched, from = l->launched;
	const int aligned = (l->addr_bits & 15) == 0;
	const rw_cuda_dtype_t dt = ph->dtype == RW_WIRE_BF16 ? RW_CUDA_BF16 : RW_CUDA_FP32;
	if (st == RW_OK && kind == 0)
		st = rw_cuda_copy_rows(s, hptr(l->copy + l->launched), n, (uint32_t)ph->row_bytes, aligned);
	else if (st == RW_OK && kind == 1)
		st = rw_cuda_rows_acc(s, hptr(l->sum + l->launched), hptr(l->src), n, ph->hidden, dt);
	else if (st == RW_OK)
		st = rw_cuda_rows_sum(s, hptr(l->sum + l->launched), hptr(l->src), n, ph->hidden, dt,
				      aligned);
	l->launched = l->n;
	l->addr_bits = 0;
	if (st == RW_OK && kind == 0 && cp->m->check)
		check_copies(cp, ph, l, dev, from, l->n, l == &cp->pack ? "dispatch pack" : "forward");
	return st;
}

/* Carve a list of `n` entries (`srcs` sum sources) from the pair's pinned buffer at *off; with
 * base NULL only count the bytes (the sizing pass). */
static void list_carve(cm_list_t *l, uint8_t *base, size_t *off, uint32_t n, uint32_t srcs, int sum)
{
	const size_t n_bytes = ((size_t)n * 16 + 63) & ~(size_t)63;
	const size_t src_bytes = sum ? ((size_t)srcs * 8 + 63) & ~(size_t)63 : 0;
	if (base) {
		*l = (cm_list_t){ .cap = n, .src_cap = srcs };
		if (sum)
			l->sum = (rw_cuda_row_sum_t *)(void *)(base + *off);
		else
			l->copy = (rw_cuda_row_copy_t *)(void *)(base + *off);
		l->src = (uint64_t *)(void *)(base + *off + n_bytes);
	}
	*off += n_bytes + src_bytes;
}

/* Every row list of the pair, in one pinned buffer the kernels read mapped: the dispatch slabs'
 * rows (one per record), the combine slabs' sums (one per received record, up to G rows each),
 * and per device the forwards (each record at most once per rank there) and the owner-sum adds
 * (returned records and local-node records owned there). */
static void lists_carve(cm_pair_t *cp, const rw_svc_phase_t *ph, uint8_t *base, size_t *off,
			const uint32_t *ranks_on, const uint32_t *recs_on, const uint32_t *local_on)
{
	const uint32_t G = ph->gpus;
	list_carve(&cp->pack, base, off, ph->row_off[(size_t)ph->nodes * ph->rails], 0, 0);
	list_carve(&cp->cslab, base, off, ph->n_in, ph->n_in * G, 1);
	for (int d = 0; d < CM_DEVICES; d++) {
		if (!ranks_on[d] && !recs_on[d] && !local_on[d])
			continue;
		list_carve(&cp->fwd[d], base, off, cp->n_total * ranks_on[d], 0, 0);
		list_carve(&cp->sums[d], base, off, recs_on[d] + local_on[d],
			   recs_on[d] + local_on[d] * G, 1);
	}
}

/* ---- plan ------------------------------------------------------------------------------------- */

static uint32_t fwd_mask(const rw_svc_phase_t *ph, const int32_t *ids)
{
	return rw_svc_fwd_mask(ph->n_experts, ph->nodes, ph->gpus, ph->me, ids, ph->topk);
}

static rw_status_t dispatch_pack_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why);

/* Outputs, forwarding tables, owner sums (zeroed on the GPU), the mapped slabs and the row
 * lists; then the dispatch slabs' kernels start (pack() waits for them). */
static rw_status_t cm_plan(void *mover, void *state, const rw_svc_phase_t *ph, char *why)
{
	cuda_mover_t *m = mover;
	cm_pair_t *cp = state;
	const uint32_t G = ph->gpus;
	rw_status_t st = map_areas(m, cp, ph, why);
	if (st != RW_OK)
		return st;
	uint32_t n_local = 0;
	for (uint32_t g = 0; g < G; g++)
		for (uint32_t t = 0; t < ph->rt[g].n_tokens; t++)
			n_local += fwd_mask(ph, ph->rt[g].expert_ids + (size_t)t * ph->topk) != 0;
	cp->n_local = n_local;
	cp->n_total = ph->n_in + n_local;
	const uint32_t n_rec = ph->row_off[(size_t)ph->nodes * ph->rails];
	cp->local_ref = rw_arena_alloc(&cp->mem, 2 * (size_t)n_local + 1, sizeof(uint32_t));
	cp->contrib = rw_arena_alloc(&cp->mem, (size_t)cp->n_total * G + 1, sizeof(uint32_t));
	int oom = !cp->local_ref || !cp->contrib;
	/* Which device writes each rank's memory: its output's, else its inputs', else home. */
	uint32_t ranks_on[CM_DEVICES] = { 0 }, recs_on[CM_DEVICES] = { 0 }, local_on[CM_DEVICES] = { 0 };
	for (uint32_t g = 0; g < G; g++) {
		const rw_svc_rank_io_t *io = &ph->io[0][g];
		int d = io->out.dev >= 0 ? io->out.dev : io->in[0].dev >= 0 ? io->in[0].dev : cp->home;
		if (d >= CM_DEVICES) {
			snprintf(why, RW_SVC_WHY_MAX, "local rank %u is on GPU %d (at most %d)", g, d,
				 CM_DEVICES - 1);
			return RW_ERR_DEVICE;
		}
		cp->xdev[g] = d;
		ranks_on[d]++;
	}
	for (uint32_t i = 0; i < n_rec; i++)
		recs_on[cp->xdev[ph->rec[i].rank]]++;
	for (uint32_t g = 0; g < G && !oom; g++) {
		const rw_svc_rank_io_t *io = &ph->io[0][g];
		rw_svc_out_layout_t *o = &cp->out[g];
		rw_svc_out_layout(io->out_cap, ph->n_experts, ph->topk, ph->row_bytes,
				  RW_CQE_INLINE_COUNTS, o);
		const uint64_t n_max = RW_MIN((uint64_t)cp->n_total, o->rows_cap);
		const int host = io->out.dev < 0;
		/* Counts and metadata are written by the CPU into the rank's pinned staging (and
		 * copied up at the end); rows go straight to a CUDA output, or through the staging
		 * of a host-memory one (in 64-byte aligned pieces: the CPU and the GPU never write
		 * one cache line). */
		const uint64_t rows_at = (o->rows_off + 63) & ~(uint64_t)63;
		const uint64_t meta_at = host ? (rows_at + n_max * ph->row_bytes + 63) & ~(uint64_t)63 : rows_at;
		uint64_t bytes = meta_at + n_max * o->meta_bytes;
		rw_svc_pinned_t *so = ph->stage_out[g];
		if (rw_svc_pinned_reserve(so, RW_MAX(bytes, 64u)) != RW_OK) {
			oom = 1;
			break;
		}
		cp->counts_st[g] = so->ptr;
		cp->rows_st[g] = (uint8_t *)so->ptr + rows_at;
		cp->meta_st[g] = (uint8_t *)so->ptr + meta_at;
		cp->rows_d[g] = host ? hptr(cp->rows_st[g]) : io->out.dptr + o->rows_off;
		cp->fwd_ref[g] = rw_arena_alloc(&cp->mem, n_max + 1, sizeof(uint32_t));
		cp->expert_counts[g] = rw_arena_alloc(&cp->mem, ph->n_experts, sizeof(uint32_t));
		oom |= !cp->fwd_ref[g] || !cp->expert_counts[g];
		const uint64_t acc_bytes = (uint64_t)ph->rt[g].n_tokens * ph->hidden * 4;
		if (!oom && acc_bytes) {
			rw_cuda_stream_t *s;
			cp->acc_blk[g] = blk_take(m, cp->xdev[g], acc_bytes);
			if (cp->acc_blk[g] < 0) {
				snprintf(why, RW_SVC_WHY_MAX, "out of GPU %d memory for local rank %u's "
					 "combine sums", cp->xdev[g], g);
				return RW_ERR_NOMEM;
			}
			cp->acc[g] = m->blk[cp->acc_blk[g]].ptr;
			st = pair_stream(cp, cp->xdev[g], &s);
			if (st == RW_OK)
				st = rw_cuda_memset_async(s, cp->acc[g], 0, acc_bytes);
			if (st != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "cannot clear local rank %u's combine sums: %s",
					 g, rw_status_str(st));
				return RW_ERR_DEVICE;
			}
		}
	}
	if (oom) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	n_local = 0;
	for (uint32_t g = 0; g < G; g++)
		for (uint32_t t = 0; t < ph->rt[g].n_tokens; t++)
			if (fwd_mask(ph, ph->rt[g].expert_ids + (size_t)t * ph->topk)) {
				cp->local_ref[2 * n_local] = g;
				cp->local_ref[2 * n_local + 1] = t;
				local_on[cp->xdev[g]]++;
				n_local++;
			}
	size_t bytes = 0;
	lists_carve(cp, ph, NULL, &bytes, ranks_on, recs_on, local_on);
	for (int i = 0; i < CM_TABS && cp->tab < 0; i++)
		if (!m->tabs[i].busy && rw_svc_pinned_reserve(&m->tabs[i].buf, RW_MAX(bytes, 64u)) == RW_OK) {
			m->tabs[i].busy = 1;
			cp->tab = i;
		}
	if (cp->tab < 0) {
		snprintf(why, RW_SVC_WHY_MAX, "out of pinned memory for the row lists");
		return RW_ERR_NOMEM;
	}
	bytes = 0;
	lists_carve(cp, ph, m->tabs[cp->tab].buf.ptr, &bytes, ranks_on, recs_on, local_on);
	return dispatch_pack_launch(cp, ph, why);
}

/* ---- dispatch ------------------------------------------------------------------------------- */

/* Every dispatch slab at once: a kernel per device copies the token rows into the mapped slabs,
 * each record at the host mover's (egress rail, slot) (rw_sched_map_rail); the CPU writes the
 * headers and top-k blocks once the kernels are done (dispatch_headers): a header shares a cache
 * line with its row's first bytes, and a line is never written by the CPU and the GPU at once. */
static void dispatch_headers(cm_pair_t *cp, const rw_svc_phase_t *ph)
{
	for (uint32_t d = 0; d < ph->nodes; d++)
		for (uint32_t i = ph->row_off[d * ph->rails]; i < ph->row_off[(d + 1) * ph->rails] && d != ph->me; i++) {
			const rw_record_t *rec = &ph->rec[i];
			const rw_svc_rank_io_t *io = &ph->io[0][rec->rank];
			rw_wire_rec_hdr_t h = { .tag = ph->tag_to[d], .src_node = ph->me,
						.owner = rec->rank, .token = rec->token, .topk = ph->topk };
			rw_wire_rec_pack(cp->pk_hdr[i], &h, io->ids + (size_t)rec->token * ph->topk,
					 io->weights + (size_t)rec->token * ph->topk);
		}
}

static rw_status_t dispatch_pack_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why)
{
	cm_list_t *pk = &cp->pack;
	const rw_svc_layout_t *l = ph->layout;
	const uint32_t n_rec = ph->row_off[(size_t)ph->nodes * ph->rails];
	uint8_t *egress = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), 1);
	uint32_t *slot = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint32_t));
	uint64_t *dst = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint64_t));
	cp->pk_hdr = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint8_t *));
	if (!egress || !slot || !dst || !cp->pk_hdr) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	const uint64_t row_off = rw_wire_rec_row_off(ph->topk);
	/* The CSR holds this node's own records too (d == me): they never travel. */
	for (uint32_t d = 0; d < ph->nodes; d++)
		for (uint32_t r = 0; r < ph->rails && d != ph->me; r++) {
			uint32_t first = ph->row_off[d * ph->rails + r];
			uint32_t cnt = ph->row_off[d * ph->rails + r + 1] - first;
			if (!cnt)
				continue;
			rw_sched_map_rail(&l->out_pairs[d], r, egress, slot);
			for (uint32_t i = 0; i < cnt; i++) {
				uint32_t e = egress[i];
				uint64_t pos = ((uint64_t)l->out_first[d * ph->rails + e] + slot[i]) * ph->rec_size;
				cp->pk_hdr[first + i] = ph->send_area[0][e] + pos;
				dst[first + i] = cp->send_d[0][e] + pos + row_off;
			}
		}
	const uint32_t own_lo = ph->row_off[ph->me * ph->rails], own_hi = ph->row_off[(ph->me + 1) * ph->rails];
	for (int dev = 0; dev < CM_DEVICES; dev++) {
		for (uint32_t i = 0; i < n_rec; i++) {
			const rw_record_t *rec = &ph->rec[i];
			if (cp->xdev[rec->rank] == dev && (i < own_lo || i >= own_hi))
				list_copy(pk, cp->tok[rec->rank] + (uint64_t)rec->token * ph->row_bytes, dst[i]);
		}
		rw_status_t st = list_launch(cp, ph, pk, dev, 0);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot launch the dispatch pack on GPU %d: %s", dev,
				 rw_status_str(st));
			return RW_ERR_DEVICE;
		}
	}
	return RW_OK;
}

/* Forward one record to every local rank hosting one of its experts: the CPU writes its
 * metadata and counts, the row is listed for rank g's device (src: the record's row in the
 * mapped receive area, or the owner's token row). -1: a rank's output is full. */
static int forward_one(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t ref, uint32_t src_node,
		       uint32_t src_rank, uint32_t token, const int32_t *ids, const float *weights,
		       rw_cuda_dptr_t row)
{
	uint32_t mask = fwd_mask(ph, ids);
	uint32_t per_rank = ph->n_experts / (ph->nodes * ph->gpus);
	for (uint32_t g = 0; g < ph->gpus; g++) {
		if (!(mask & (1u << g)))
			continue;
		const rw_svc_out_layout_t *o = &cp->out[g];
		uint32_t j = cp->fwd_n[g];
		if (j >= o->rows_cap)
			return -1;
		list_copy(&cp->fwd[cp->xdev[g]], row, cp->rows_d[g] + (uint64_t)j * ph->row_bytes);
		uint8_t *meta = cp->meta_st[g] + (uint64_t)j * o->meta_bytes;
		rw_wire_put32(meta, src_node);
		rw_wire_put32(meta + 4, src_rank);
		rw_wire_put32(meta + 8, token);
		rw_wire_put32(meta + 12, 0);
		memcpy(meta + 16, ids, 4u * ph->topk);
		memcpy(meta + 16 + 4u * ph->topk, weights, 4u * ph->topk);
		for (uint32_t k = 0; k < ph->topk; k++)
			if (ids[k] >= 0 && (uint32_t)ids[k] / per_rank == ph->me * ph->gpus + g)
				cp->expert_counts[g][ids[k]]++;
		cp->fwd_ref[g][j] = ref;
		cp->contrib[(size_t)ref * ph->gpus + g] = j + 1;
		cp->fwd_n[g] = j + 1;
	}
	return 0;
}

static rw_status_t launch_all(cm_pair_t *cp, const rw_svc_phase_t *ph, int sums, char *why)
{
	for (int d = 0; d < CM_DEVICES; d++) {
		rw_status_t st = list_launch(cp, ph, sums ? &cp->sums[d] : &cp->fwd[d], d, sums);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot launch a %s kernel on GPU %d: %s",
				 sums ? "combine" : "forward", d, rw_status_str(st));
			return RW_ERR_DEVICE;
		}
	}
	return RW_OK;
}

/* A complete dispatch range: headers validated on the CPU (as the host mover does), rows
 * scattered by the kernels. */
static rw_status_t forward_range(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t src,
				 uint32_t rail, char *why)
{
	const rw_svc_layout_t *l = ph->layout;
	size_t i = (size_t)src * ph->rails + rail;
	uint32_t first = l->in_first[i];
	int32_t ids[RW_MAX_TOPK];
	float w[RW_MAX_TOPK];
	const uint64_t row_off = rw_wire_rec_row_off(ph->topk);
	for (uint32_t k = 0; k < l->in_quota[i]; k++) {
		const uint64_t pos = ((uint64_t)first + k) * ph->rec_size;
		const uint8_t *rec = ph->recv_area[0][rail] + pos;
		rw_wire_rec_hdr_t h;
		if (rw_wire_rec_unpack(rec, ph->topk, &h) != RW_OK || h.tag != ph->tag_in ||
		    h.src_node != src || h.owner >= ph->gpus) {
			snprintf(why, RW_SVC_WHY_MAX, "bad record header from node %u rail %u slot %u",
				 src, rail, k);
			return RW_ERR_PROTO;
		}
		for (uint32_t t = 0; t < ph->topk; t++) {
			ids[t] = rw_wire_rec_id(rec, t);
			w[t] = rw_wire_rec_weight(rec, ph->topk, t);
		}
		if (!fwd_mask(ph, ids)) {
			snprintf(why, RW_SVC_WHY_MAX, "record from node %u rail %u slot %u has no expert "
				 "on this node", src, rail, k);
			return RW_ERR_PROTO;
		}
		if (forward_one(cp, ph, ph->rail_base[rail] + first + k, src, src * ph->gpus + h.owner,
				h.token, ids, w, cp->recv_d[0][rail] + pos + row_off) < 0) {
			snprintf(why, RW_SVC_WHY_MAX, "a local rank's dispatch output is full");
			return RW_ERR_SUB_SPACE;
		}
	}
	return launch_all(cp, ph, 0, why);
}

/* Up to `budget` local-node records listed per call; launched when all are (or with the next
 * arrived range). */
static rw_status_t forward_local(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t budget,
				 int *done_p, char *why)
{
	for (; cp->bg_i < cp->n_local && budget; cp->bg_i++, budget--) {
		uint32_t g = cp->local_ref[2 * cp->bg_i], t = cp->local_ref[2 * cp->bg_i + 1];
		const rw_svc_rank_io_t *io = &ph->io[0][g];
		if (forward_one(cp, ph, ph->n_in + cp->bg_i, ph->me, ph->me * ph->gpus + g, t,
				io->ids + (size_t)t * ph->topk, io->weights + (size_t)t * ph->topk,
				cp->tok[g] + (uint64_t)t * ph->row_bytes) < 0) {
			snprintf(why, RW_SVC_WHY_MAX, "a local rank's dispatch output is full");
			return RW_ERR_SUB_SPACE;
		}
	}
	*done_p = cp->bg_i >= cp->n_local;
	return *done_p ? launch_all(cp, ph, 0, why) : RW_OK;
}

/* ---- combine -------------------------------------------------------------------------------- */

/* Every return slab and the local-node fold, once every rank's combine rows are in: a record
 * one local rank computed goes back as that rank's row as it is; several: their fp32 sum in rank
 * order, rounded once (the host mover's combine_pack). Local-node records are added into their
 * owners' fp32 sums in rank order. One mark per device used; the ranks are reported staged when
 * all are done. */
static rw_status_t combine_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why)
{
	const rw_svc_layout_t *l = ph->layout;
	const uint32_t G = ph->gpus;
	cm_list_t *cs = &cp->cslab;
	uint32_t marks_on = 0;
	for (int dev = 0; dev < CM_DEVICES; dev++) {
		for (uint32_t d = 0; d < ph->nodes; d++)
			for (uint32_t r = 0; r < ph->rails; r++) {
				size_t i = (size_t)d * ph->rails + r;
				for (uint32_t k = 0; k < l->in_quota[i]; k++) {
					uint32_t pos = l->in_first[i] + k, ref = ph->rail_base[r] + pos;
					const uint32_t *c = &cp->contrib[(size_t)ref * G];
					uint32_t g0 = 0;
					while (g0 < G && !c[g0])
						g0++;
					if (g0 == G) /* never: every received record went to a local rank */
						continue;   /* (combine_headers zeroes its row) */
					if (cp->xdev[g0] != dev)
						continue;
					list_sum(cs, cp->send_d[1][r] + (uint64_t)pos * ph->crec_size +
						 RW_WIRE_CREC_HDR);
					for (uint32_t g = g0; g < G; g++)
						if (c[g])
							list_src(cs, cp->crow[g] + (uint64_t)(c[g] - 1) * ph->row_bytes);
				}
			}
		if (cs->n > cs->launched)
			marks_on |= 1u << dev;
		rw_status_t st = list_launch(cp, ph, cs, dev, 2);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot launch the combine pack on GPU %d: %s", dev,
				 rw_status_str(st));
			return RW_ERR_DEVICE;
		}
	}
	for (uint32_t i = 0; i < cp->n_local; i++) {
		uint32_t g0 = cp->local_ref[2 * i], t = cp->local_ref[2 * i + 1];
		const uint32_t *c = &cp->contrib[(size_t)(ph->n_in + i) * G];
		cm_list_t *sl = &cp->sums[cp->xdev[g0]];
		list_sum(sl, cp->acc[g0] + (uint64_t)t * ph->hidden * 4);
		for (uint32_t g = 0; g < G; g++)
			if (c[g])
				list_src(sl, cp->crow[g] + (uint64_t)(c[g] - 1) * ph->row_bytes);
		marks_on |= 1u << cp->xdev[g0];
	}
	rw_status_t st = launch_all(cp, ph, 1, why);
	if (st != RW_OK)
		return st;
	marks_on |= 1u << cp->home; /* at least one mark, so the reports come */
	for (int d = 0; d < CM_DEVICES; d++)
		if (marks_on & (1u << d)) {
			if ((st = pair_mark(cp, d, OP_STAGE_C, 0)) != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "cannot mark GPU %d's combine work: %s", d,
					 rw_status_str(st));
				return RW_ERR_DEVICE;
			}
			cp->marks_c++;
		}
	return RW_OK;
}

/* A complete combine range from `d` on egress rail `e`: headers checked on the CPU, each row
 * added into its owner token's fp32 sum by a kernel on the owner's device. */
static rw_status_t combine_range(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t d, uint32_t e,
				 char *why)
{
	const rw_svc_layout_t *l = ph->layout;
	const rw_pair_plan_t *pp = &l->out_pairs[d];
	uint32_t first = l->out_first[d * ph->rails + e];
	for (uint32_t k = 0; k < pp->quota[e]; k++) {
		const uint64_t pos = ((uint64_t)first + k) * ph->crec_size;
		rw_wire_crec_hdr_t h;
		rw_wire_crec_unpack(ph->recv_area[1][e] + pos, &h);
		if (h.tag != ph->tag_in || h.src_node != d || h.rail != e || h.slot != k) {
			snprintf(why, RW_SVC_WHY_MAX, "bad combine record from node %u rail %u slot %u",
				 d, e, k);
			return RW_ERR_PROTO;
		}
		uint32_t owner_rail, ord;
		rw_sched_unmap(pp, e, k, &owner_rail, &ord);
		const rw_record_t *r = &ph->rec[ph->row_off[d * ph->rails + owner_rail] + ord];
		cm_list_t *sl = &cp->sums[cp->xdev[r->rank]];
		list_sum(sl, cp->acc[r->rank] + (uint64_t)r->token * ph->hidden * 4);
		list_src(sl, cp->recv_d[1][e] + pos + RW_WIRE_CREC_HDR);
	}
	return launch_all(cp, ph, 1, why);
}

/* ---- the ops -------------------------------------------------------------------------------- */

/* The slabs were written ahead (dispatch: at plan; combine: with the ranks' staging), but a
 * write may be posted only once its bytes are there: the first dispatch pack waits for the
 * dispatch slabs' kernels. This is the one place the loop blocks (for the pack kernels' time);
 * an asynchronous pack needs the executor to wait for a report before posting. */
static rw_status_t cm_pack(void *mover, void *state, const rw_svc_phase_t *ph, int kind,
			   uint32_t d, char *why)
{
	(void)mover, (void)ph, (void)d;
	cm_pair_t *cp = state;
	if (kind != 0 || cp->packed)
		return RW_OK;
	cp->packed = 1;
	rw_status_t st = pair_sync(cp);
	if (st != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "the dispatch pack kernels failed: %s", rw_status_str(st));
		return RW_ERR_DEVICE;
	}
	dispatch_headers(cp, ph);
	return RW_OK;
}

static rw_status_t cm_arrived(void *mover, void *state, const rw_svc_phase_t *ph, int kind,
			      uint32_t src, uint32_t rail, char *why)
{
	(void)mover;
	return kind == 0 ? forward_range(state, ph, src, rail, why)
			 : combine_range(state, ph, src, rail, why);
}

static rw_status_t cm_local(void *mover, void *state, const rw_svc_phase_t *ph, int kind,
			    uint32_t budget, int *done_p, char *why)
{
	(void)mover;
	cm_pair_t *cp = state;
	if (cp->local_kind != kind + 1) {
		cp->local_kind = kind + 1;
		cp->bg_i = 0;
	}
	if (kind == 0)
		return forward_local(cp, ph, budget, done_p, why);
	*done_p = 1; /* folded with the combine's staging (combine_launch) */
	return RW_OK;
}

/* Host-memory ranks' outputs leave their pinned staging once the kernels that wrote it are done
 * (mark_done); CUDA ranks get the CPU-written counts and metadata by async copies. */
static void host_copy_out(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind, uint32_t g)
{
	const rw_svc_rank_io_t *io = &ph->io[kind][g];
	if (!io->out.host)
		return;
	if (kind == 1) {
		memcpy(io->out.host, ph->stage_out[g]->ptr, (size_t)ph->rt[g].n_tokens * ph->row_bytes);
		return;
	}
	const rw_svc_out_layout_t *o = &cp->out[g];
	uint64_t n = cp->fwd_n[g];
	if (ph->n_experts > RW_CQE_INLINE_COUNTS)
		memcpy(io->out.host + o->counts_off, cp->counts_st[g], 4ull * ph->n_experts);
	memcpy(io->out.host + o->rows_off, cp->rows_st[g], n * ph->row_bytes);
	memcpy(io->out.host + o->meta_off, cp->meta_st[g], n * o->meta_bytes);
}

static rw_status_t cm_finish(void *mover, void *state, const rw_svc_phase_t *ph, int kind,
			     uint32_t *pending_p, char *why)
{
	(void)mover;
	cm_pair_t *cp = state;
	uint32_t pending = 0;
	if (cp->m->check && kind == 0)
		for (int d = 0; d < CM_DEVICES; d++)
			if (cp->fwd[d].n)
				check_copies(cp, ph, &cp->fwd[d], d, 0, cp->fwd[d].n, "forward (at finish)");
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[kind][g];
		const int dev = cp->xdev[g];
		rw_cuda_stream_t *s;
		rw_status_t st = pair_stream(cp, dev, &s);
		if (kind == 0 && st == RW_OK) {
			const rw_svc_out_layout_t *o = &cp->out[g];
			uint64_t counts = ph->n_experts > RW_CQE_INLINE_COUNTS ? 4ull * ph->n_experts : 0;
			if (counts)
				memcpy(cp->counts_st[g], cp->expert_counts[g], counts);
			if (io->out.dev >= 0) {
				st = counts ? rw_cuda_copy_htod_async(s, io->out.dptr + o->counts_off,
								      cp->counts_st[g], counts) : RW_OK;
				if (st == RW_OK && cp->fwd_n[g])
					st = rw_cuda_copy_htod_async(s, io->out.dptr + o->meta_off, cp->meta_st[g],
								     (uint64_t)cp->fwd_n[g] * o->meta_bytes);
			}
		} else if (st == RW_OK && ph->rt[g].n_tokens) {
			const uint64_t n = ph->rt[g].n_tokens;
			rw_cuda_dptr_t dst = io->out.dptr;
			if (io->out.dev < 0) {
				st = rw_svc_pinned_reserve(ph->stage_out[g], n * ph->row_bytes);
				dst = hptr(ph->stage_out[g]->ptr);
			}
			if (st == RW_OK)
				st = rw_cuda_store_f32(s, dst, ph->dtype == RW_WIRE_BF16 ? RW_CUDA_BF16
											: RW_CUDA_FP32,
						       cp->acc[g], n * ph->hidden);
		}
		if (st == RW_OK)
			st = pair_mark(cp, dev, kind ? OP_FLUSH_C : OP_FLUSH_D, g);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot write local rank %u's results on GPU %d: %s",
				 g, dev, rw_status_str(st));
			*pending_p = pending;
			return RW_ERR_DEVICE;
		}
		pending++;
	}
	*pending_p = pending;
	return RW_OK;
}

static void cm_result(void *state, uint32_t g, uint32_t *recv_rows_p, const uint32_t **counts_p)
{
	const cm_pair_t *cp = state;
	*recv_rows_p = cp->fwd_n[g];
	*counts_p = cp->expert_counts[g];
}

const rw_svc_mover_ops_t rw_svc_mover_cuda = {
	.name = "cuda",
	.create = cm_create,
	.destroy = cm_destroy,
	.accepts = cm_accepts,
	.open = cm_open,
	.stage = cm_stage,
	.plan = cm_plan,
	.pack = cm_pack,
	.arrived = cm_arrived,
	.local = cm_local,
	.finish = cm_finish,
	.result = cm_result,
	.quiesce = cm_quiesce,
	.close = cm_close,
};
