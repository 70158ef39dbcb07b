/* The CUDA data mover (service/mover/mover.h; docs/dataflow.md "CUDA buffers"): for pairs whose ranks
 * gave CUDA memory, kernels on the daemon's own stream per device move every payload byte —
 * token rows into the send slabs, arrived rows into the ranks' outputs, combine rows summed into
 * the return slabs and, per owner token, into its output row — and the loop's CPU only writes record
 * headers, metadata and the row lists the kernels follow. The slabs are the mesh's host memory,
 * registered and mapped into the GPUs, so kernels read and write them directly (no staging
 * copy). Its streams are two stages' (service/mover/stage.c: marks on an eventfd watched by the
 * loop, the stall bound, fences), so nothing here waits for a GPU. The arithmetic
 * is the host mover's (service/mover/mover_host.c, service/phase/forward.c): fp32 sums in the same order
 * (service/mover/mover_owner.c), bf16 rounded by the same formula. RAILWAVE_CUDA_MOVER=0 turns it off, =check verifies every
 * row it copies (docs/dataflow.md "Test hooks"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "service/mover/mover_cuda_int.h"

/* ---- streams ---------------------------------------------------------------------------------- */

static void finish_run(cm_pair_t *cp);

/* The oldest pull of `dev` is done: its headers are in the shadow. Checked and taken as a range
 * arriving on a host-memory rail is; a bad one is said in the log and reported (the executor
 * blames its source). Then a finish() that waited for the pulls runs. A report may end the pair:
 * cp is not touched after one. */
static void slab_pulled(cm_pair_t *cp, int dev)
{
	const rw_svc_phase_t *ph = cp->ph;
	uint32_t i = dev >= 0 && dev < CM_DEVICES ? cp->pull_next[dev] : cp->n_pulls;
	while (i < cp->n_pulls && cp->pulls[i].dev != dev)
		i++;
	if (i == cp->n_pulls)
		return;
	cp->pull_next[dev] = i + 1;
	const cm_pull_t pl = cp->pulls[i];
	cp->pulls_left--;
	char why[RW_SVC_WHY_MAX];
	rw_status_t st = pl.kind ? cm_combine_take(cp, ph, pl.src, pl.rail, pl.upto, why)
				 : cm_forward_take(cp, ph, pl.src, pl.rail, pl.upto, why);
	if (st != RW_OK) {
		rw_warn("cuda mover: pair %u: %s", cp->serial, why);
		cp->m->done(cp->m->ctx, cp->serial, RW_MV_OP_REFUSED, pl.src, st);
		return;
	}
	if (!cp->pulls_left && cp->fin_wait)
		finish_run(cp); /* may report */
}

/* A mark completed: route it to its pair. Host-memory ranks' outputs are copied out of their
 * pinned staging here, once the kernels that wrote it are done. */
static void mark_done(cuda_mover_t *m, uint64_t token)
{
	uint32_t serial = (uint32_t)(token >> 32), op = (uint32_t)(token >> 8) & 0xffu,
		 g = (uint32_t)token & 0xffu;
	cm_pair_t *cp = cm_pair_find(m, serial);
	if (!cp || !cp->pending || g >= RW_MAX_GPUS)
		return; /* a pair that ended meanwhile (it waited for its work then) */
	cp->pending--;
	if (op == OP_STAGE_D) {
		if (cp->marks_d[g] && --cp->marks_d[g] == 0)
			m->done(m->ctx, serial, RW_MV_OP_STAGE_D, g, RW_OK);
	} else if (op == OP_PACK) {
		/* A piece of the dispatch slabs is in on device g: the CPU writes its headers (never
		 * while a kernel writes the same cache lines), and a waiting executor posts it. */
		if (cp->marks_pk) {
			cp->marks_pk--;
			cm_pack_piece_done(cp, (int)g); /* may report: cp untouched after */
		}
	} else if (op == OP_COUNT) {
		cm_count_done(cp); /* mover_cuda_count.c */
	} else if (op == OP_PULL) {
		slab_pulled(cp, (int)g); /* may report: cp untouched after */
	} else if (op == OP_STAGE_C) {
		if (cp->marks_c && --cp->marks_c == 0) {
			cm_combine_headers(cp, cp->ph, 0); /* host-memory rails' (mover_cuda_slab.c) */
			/* A report may end the pair: nothing of cp is touched after the first. */
			const uint32_t gpus = cp->gpus;
			for (uint32_t r = 0; r < gpus; r++)
				m->done(m->ctx, serial, RW_MV_OP_STAGE_C, r, RW_OK);
		}
	} else {
		int kind = op == OP_FLUSH_C;
		if (cp->ph->io[kind][g].out.dev < 0)
			cm_host_copy_out(cp, cp->ph, kind, g);
		m->done(m->ctx, serial, RW_MV_OP_FINISH, g, RW_OK);
	}
}

/* The next pair with marks pending on a lane of a stalled device: given up (its marks, if they
 * land, are reported to nobody; what it may still touch is held at quiesce), its serial and a
 * local rank with memory there (the executor names the device from the rank's spans). */
static int stalled_pair(cuda_mover_t *m, int device, uint32_t *serial_p, uint32_t *g_p)
{
	for (cm_pair_t *cp = m->pairs; cp; cp = cp->next) {
		if (!cp->pending || !((cp->devs | cp->pull_devs) >> device & 1))
			continue;
		cp->pending = cp->marks_c = cp->marks_pk = 0;
		cp->pulls_left = 0;
		cp->fin_wait = 0;
		memset(cp->marks_d, 0, sizeof(cp->marks_d));
		cp->loose = 1;
		*serial_p = cp->serial;
		*g_p = 0;
		for (uint32_t g = 0; g < cp->gpus && g < RW_MAX_GPUS; g++)
			if ((rw_svc_rank_io_devs(&cp->ph->io[0][g]) |
			     rw_svc_rank_io_devs(&cp->ph->io[1][g])) >> device & 1) {
				*g_p = g;
				return 1;
			}
		return 1;
	}
	return 0;
}

/* A lane's report (service/mover/stage.c, from the loop): a mark landed, a device's marks
 * stopped for the stall bound, or a stream faulted. */
static void lane_done(void *ctx, uint64_t token, rw_status_t st)
{
	cuda_mover_t *m = ctx;
	const int stalled = rw_svc_stage_dev_of(token);
	if (token == RW_SVC_STAGE_ALL) {
		/* A faulted stream never completes its marks: every pending op fails. */
		rw_err("cuda mover: a stream failed: %s", rw_status_str(st));
		for (cm_pair_t *cp = m->pairs; cp; cp = cp->next) {
			cp->loose |= cp->pending != 0;
			cp->pending = cp->marks_c = cp->marks_pk = 0;
			cp->pulls_left = 0;
			cp->fin_wait = 0;
			memset(cp->marks_d, 0, sizeof(cp->marks_d));
		}
		m->done(m->ctx, 0, RW_MV_OP_ALL, 0, st);
	} else if (stalled >= 0) {
		/* Each pair with marks pending on it fails, named (a report may end a pair: the
		 * search starts over each time). */
		uint32_t serial, g;
		while (stalled_pair(m, stalled, &serial, &g))
			m->done(m->ctx, serial, RW_MV_OP_FINISH, g, st);
	} else {
		mark_done(m, token);
	}
	rw_svc_stage_sweep(m->st); /* what quiesce held, fenced on both lanes */
}

/* ---- pools: mapped slab areas, device blocks, pinned row lists ---------------------------------- */

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
	rw_status_t st = rw_svc_stage_create(loop, lane_done, m, &m->st);
	if (st == RW_OK)
		st = rw_svc_stage_create(loop, lane_done, m, &m->pst);
	if (st != RW_OK) {
		rw_svc_stage_destroy(m->st);
		free(m);
		return st;
	}
	/* The host mover, destroyed after this one, may still hold streams and the ranks' pinned
	 * staging in the same primary contexts: its stage shuts CUDA down. */
	rw_svc_stage_keep_cuda(m->st);
	rw_svc_stage_keep_cuda(m->pst);
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

/* Waits for the lanes of every device that is not stalled; a stalled device's streams are
 * abandoned (service/mover/stage.c), and what its queued work may still touch — held memory (the
 * main lane's destroy, after the pull lane's), pooled blocks, the mapped slab areas — is left to
 * the process's exit, never freed under it. */
static void cm_destroy(void *mover)
{
	cuda_mover_t *m = mover;
	uint64_t stuck = 0;
	for (int d = 0; d < CM_DEVICES; d++)
		if (rw_svc_gpu_stalled(d, NULL, 0))
			stuck |= 1ull << d;
	rw_svc_stage_fence_t f[2];
	uint64_t busy = rw_svc_stage_fence(m->st, UINT64_MAX, &f[0]) ? f[0].devs : 0;
	busy |= rw_svc_stage_fence(m->pst, UINT64_MAX, &f[1]) ? f[1].devs : 0;
	stuck &= busy;
	rw_svc_stage_destroy(m->pst);
	rw_svc_stage_destroy(m->st);
	if (stuck) {
		rw_warn("cuda mover: the pools and mapped slab areas left to a stalled GPU's kernels");
		free(m);
		return;
	}
	for (int i = 0; i < CM_BLOCKS; i++)
		if (m->blk[i].ptr)
			rw_cuda_mem_free(m->blk[i].dev, m->blk[i].ptr);
	for (int i = 0; i < CM_TABS; i++)
		rw_svc_pinned_free(&m->tabs[i].buf);
	for (uint32_t i = 0; i < m->n_reg; i++)
		rw_cuda_host_unregister(m->reg[i].base);
	free(m);
}

/* A pair is ours when its first submission gave CUDA memory on a device with kernels; once
 * ours, every later rank of it is (host-memory ranks too). */
static int cm_accepts(void *mover, const rw_svc_phase_t *ph, rw_svc_phase_kind_t kind, uint32_t g)
{
	cuda_mover_t *m = mover;
	if (cm_pair_find(m, ph->serial))
		return 1;
	if (m->off)
		return 0;
	const rw_svc_rank_io_t *io = &ph->io[kind][g];
	for (int i = 0; i < 4; i++) {
		const rw_svc_span_mem_t *s = i < 3 ? &io->in[i] : &io->out;
		if (s->dev >= 0)
			return cm_dev_kernels(m, s->dev);
	}
	return 0;
}

static rw_status_t cm_open(void *mover, const rw_svc_phase_t *ph, void **state_p)
{
	cuda_mover_t *m = mover;
	cm_pair_t *cp = calloc(1, sizeof(*cp));
	rw_svc_held_t *spare = calloc(1, sizeof(*spare));
	if (!cp || !spare) {
		free(cp);
		free(spare);
		return RW_ERR_NOMEM;
	}
	cp->spare = spare;
	cp->m = m;
	cp->serial = ph->serial;
	cp->gpus = ph->gpus;
	cp->ph = ph;
	cp->home = -1;
	cp->tab = -1;
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

/* Whether work of cp may not have landed: marks pending or given up, or work with no mark. */
static int cm_unsettled(const cm_pair_t *cp)
{
	return cp->pending || cp->loose || cp->dirty;
}

/* The ranks whose memory the pair's kernels and copies may touch: every rank with CUDA memory,
 * against every device the pair used (a kernel on one reads other devices' memory, peer
 * access); a host-memory rank's bytes only ever pass through its pinned staging. */
static void cm_rank_devs(const cm_pair_t *cp, uint64_t *devs, int cuda_only)
{
	for (uint32_t g = 0; g < RW_MAX_GPUS; g++) {
		int cuda = 0;
		for (int k = 0; k < 2 && g < cp->gpus; k++) {
			const rw_svc_rank_io_t *io = &cp->ph->io[k][g];
			cuda |= io->in[0].dev >= 0 || io->in[1].dev >= 0 || io->in[2].dev >= 0 ||
				io->out.dev >= 0;
		}
		devs[g] = g < cp->gpus && (cuda || !cuda_only) ? cp->devs : 0;
	}
}

/* Nothing here waits for a GPU (docs/rankpath.md "A hung GPU"): where the pair's work may not
 * have landed, a mark of quiesce's own goes behind it on each device that has none (reported to
 * nobody: the held memory is looked at when a mark of that lane lands or at its stall watch's
 * next tick, so entries fenced on the pull lane alone wait for the main lane's tick, at most
 * a second), the ranks' pinned staging is handed to the
 * stage, and the pair's row lists and device blocks leave the pools for the main lane's held
 * list (rw_svc_stage_hold, fenced on both lanes); all of it is freed once every mark made on the
 * pair's devices up to now has landed. The executor answers a CUDA rank once its own memory is
 * out of reach (cm_fence). */
static void cm_quiesce(void *mover, void *state)
{
	cuda_mover_t *m = mover;
	cm_pair_t *cp = state;
	if (cm_unsettled(cp)) {
		for (int d = 0; d < CM_DEVICES; d++)
			if (cp->dirty >> d & 1) /* refused on a stalled GPU: the fence marks it */
				(void)rw_svc_stage_mark(m->st, d, cm_token(cp, OP_QUIET, (uint32_t)d));
		uint64_t devs[RW_MAX_GPUS];
		cm_rank_devs(cp, devs, 0);
		rw_svc_stage_retire_pair(m->st, cp->ph, devs, 1);
		rw_svc_stage_fence_t f[2];
		const int busy = rw_svc_stage_fence(m->st, cp->devs, &f[0]) |
				 rw_svc_stage_fence(m->pst, cp->pull_devs, &f[1]);
		rw_svc_held_t *h = busy ? cp->spare : NULL;
		if (h) {
			cp->spare = NULL;
			h->serial = cp->serial;
			h->tagged = 1;
			h->f[0] = f[0];
			h->f[1] = f[1];
			if (cp->tab >= 0) { /* the buffer moves out: the pool's next reserve gets new memory */
				h->host = m->tabs[cp->tab].buf;
				m->tabs[cp->tab].buf = (rw_svc_pinned_t){ 0 };
				m->tabs[cp->tab].busy = 0;
				cp->tab = -1;
			}
			for (int d = 0; d < CM_DEVICES; d++)
				for (int k = 0; k < 2; k++) {
					int *b = k ? &cp->cnt_blk[d] : &cp->zero_blk[d];
					if (!*b)
						continue;
					h->blk[h->n_blk].dev = m->blk[*b - 1].dev;
					h->blk[h->n_blk++].ptr = m->blk[*b - 1].ptr;
					memset(&m->blk[*b - 1], 0, sizeof(m->blk[0])); /* a new one next */
					*b = 0;
				}
			if (h->host.ptr || h->n_blk)
				rw_info("cuda mover: pair %u given up with its work queued: %zu bytes of row "
					"lists and %u device blocks held until it lands", cp->serial,
					h->host.size, h->n_blk);
			rw_svc_stage_hold(m->st, h);
		}
		cp->pending = cp->marks_c = cp->marks_pk = 0;
		memset(cp->marks_d, 0, sizeof(cp->marks_d));
		cp->loose = 0;
		cp->dirty = 0;
		rw_svc_stage_sweep(m->st);
	}
	cp->pulls_left = 0; /* what a pull brought is not taken any more */
	cp->fin_wait = 0;
}

/* Whether the kernels and copies of the (closed) pair ph may no longer write its slot's areas:
 * nothing of it is held (cm_quiesce holds what a failed pair's queued work may touch until
 * every mark made on its devices by then has landed). The executor keeps the slot out of use
 * until then, so late pack or sum kernels never write a later pair's slabs. */
static int cm_settled(void *mover, const rw_svc_phase_t *ph)
{
	const cuda_mover_t *m = mover;
	return !rw_svc_stage_holds(m->st, ph->serial);
}

/* A failed pair's rank g whose CUDA memory the pair's work may still read or write (its answer
 * waits for it, or for the stall bound). */
static int cm_fence(void *mover, void *state, uint32_t g, rw_svc_stage_fence_t *f)
{
	cuda_mover_t *m = mover;
	const cm_pair_t *cp = state;
	uint64_t devs[RW_MAX_GPUS];
	cm_rank_devs(cp, devs, 1);
	return rw_svc_stage_rank_fence(m->st, devs, cm_unsettled(cp), g, f);
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
	for (int d = 0; d < CM_DEVICES; d++)
		if (cp->zero_blk[d])
			m->blk[cp->zero_blk[d] - 1].busy = 0;
	if (cp->tab >= 0)
		m->tabs[cp->tab].busy = 0;
	cm_count_release(cp);
	rw_arena_free(&cp->mem);
	free(cp->spare);
	free(cp);
}

/* ---- inputs --------------------------------------------------------------------------------- */

/* Stream order (docs/cuda.md "Stream-ordered submission"): no stream may read a rank's inputs
 * before its event. Any device's stream may read them (the pack, the local forwards, the combine
 * sums run on the stream of the device that writes each destination rank), and those devices
 * are the pair's ranks' and its home: at each stage, every device seen so far waits on the event
 * of every rank staged so far that it has not waited on yet. Kernels start only once every rank
 * is staged (the plan, the combine launch), so by then every stream they use waits on every
 * event. Waits are enqueued, never blocking the loop. */
static rw_status_t cm_wait_events(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind, uint32_t g,
				  char *why)
{
	uint32_t devs = 1u << cp->home, any = 0;
	for (uint32_t r = 0; r < ph->gpus; r++) {
		const rw_svc_rank_io_t *io = &ph->io[kind][r];
		any |= io->wait_ev != NULL;
		for (int i = 0; i < 4; i++) {
			const rw_svc_span_mem_t *s = i < 3 ? &io->in[i] : &io->out;
			if (s->buf != 0 && s->buf != RW_BUF_NONE && s->dev >= 0 && s->dev < CM_DEVICES)
				devs |= 1u << s->dev;
		}
	}
	if (!any)
		return RW_OK;
	for (uint32_t r = 0; r < ph->gpus; r++) {
		const rw_svc_rank_io_t *io = &ph->io[kind][r];
		if (!io->wait_ev || (r != g && !cp->ev_waited[kind][r]))
			continue; /* no event, or not staged yet (its own stage waits) */
		for (int d = 0; d < CM_DEVICES; d++) {
			if (!(devs & ~cp->ev_waited[kind][r] & (1u << d)))
				continue;
			rw_cuda_stream_t *s;
			rw_status_t st = cm_pair_stream(cp, d, &s);
			if (st == RW_OK)
				st = rw_cuda_stream_wait_event(s, io->wait_ev);
			if (st != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "cannot make GPU %d wait for local rank %u's "
					 "event: %s", d, r, rw_status_str(st));
				return RW_ERR_DEVICE;
			}
			cp->ev_waited[kind][r] |= 1u << d;
		}
	}
	return RW_OK;
}

/* Kernels on one device read other local ranks' rows on theirs (forwards of local-node records,
 * combine sums over several ranks' rows, docs/cuda.md "Several GPUs"): every two devices in
 * `used` get peer access both ways, once per mover. Two GPUs without a peer path fail the pair
 * with both named (staging such rows through the host is not built). */
static rw_status_t cm_peer_reach(cuda_mover_t *m, uint32_t used, char *why)
{
	for (int a = 0; a < CM_DEVICES; a++)
		for (int b = 0; b < CM_DEVICES; b++) {
			if (a == b || !(used >> a & 1) || !(used >> b & 1) || (m->peer_ok[a] >> b & 1))
				continue;
			rw_status_t st = rw_cuda_peer_enable(a, b);
			if (st != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "GPU %d cannot reach GPU %d's memory (peer "
					 "access: %s): local ranks on these GPUs need a peer path", a, b,
					 rw_status_str(st));
				return RW_ERR_DEVICE;
			}
			m->peer_ok[a] |= 1u << b;
			rw_info("cuda mover: GPU %d reads and writes GPU %d's memory (peer access on)", a, b);
		}
	return RW_OK;
}

static rw_status_t cm_stage(void *mover, void *state, rw_svc_phase_t *ph,
			    rw_svc_phase_kind_t kind, uint32_t g, int *pending_p, char *why)
{
	cm_pair_t *cp = state;
	const uint32_t on = cm_devs(rw_svc_rank_io_devs(&ph->io[kind][g])) | 1u << cp->home;
	if (rw_svc_gpus_stalled(on, why, RW_SVC_WHY_MAX)) /* named: refused until it moves again */
		return RW_ERR_DEVICE;
	if (kind == 1 && (cm_devs(rw_svc_rank_io_devs(&ph->io[1][g])) & ~cp->reach)) {
		/* combine rows on a device the dispatch did not use: it and the pair's reach
		 * each other too */
		uint32_t used = cp->reach | cm_devs(rw_svc_rank_io_devs(&ph->io[1][g]));
		rw_status_t pst = cm_peer_reach(mover, used, why);
		if (pst != RW_OK)
			return pst;
		cp->reach = used;
	}
	rw_status_t st = cm_wait_events(state, ph, kind, g, why);
	if (st != RW_OK)
		return st;
	return kind == 0 ? cm_stage_dispatch(state, ph, g, pending_p, why)
			 : cm_stage_combine(state, ph, g, pending_p, why);
}

/* ---- row lists -------------------------------------------------------------------------------- */

/* ---- plan ------------------------------------------------------------------------------------- */

/* Outputs, forwarding tables, the owner sums' order and zero rows, the mapped slabs and the row
 * lists; then the dispatch slabs' kernels start (their marks complete the pack). */
static rw_status_t cm_plan(void *mover, void *state, const rw_svc_phase_t *ph, char *why)
{
	cuda_mover_t *m = mover;
	cm_pair_t *cp = state;
	const uint32_t G = ph->gpus;
	if (!m->said_pack) {
		m->said_pack = 1;
		rw_info("cuda mover: the dispatch pack is asynchronous (the executor posts on the "
			"kernels' completion report)");
	}
	rw_status_t st = cm_map_areas(m, cp, ph, why);
	if (st != RW_OK)
		return st;
	uint32_t n_local = 0;
	for (uint32_t g = 0; g < G; g++)
		for (uint32_t t = 0; t < ph->rt[g].n_tokens; t++)
			n_local += rw_svc_phase_fwd_mask(ph, ph->rt[g].expert_ids + (size_t)t * ph->topk) != 0;
	cp->n_local = n_local;
	cp->n_total = ph->n_in + n_local;
	const uint32_t n_rec = ph->row_off[(size_t)ph->nodes * ph->rails];
	cp->local_ref = rw_arena_alloc(&cp->mem, 2 * (size_t)n_local + 1, sizeof(uint32_t));
	cp->rank_out.contrib = rw_arena_alloc(&cp->mem, (size_t)cp->n_total * G + 1,
					      sizeof(uint32_t));
	cp->rank_out.n_contrib = cp->n_total;
	for (int k = 0; k < 2; k++)
		cp->rx_done[k] = rw_arena_alloc(&cp->mem, (size_t)ph->nodes * ph->rails, sizeof(uint32_t));
	cp->back_at = rw_arena_alloc(&cp->mem, (size_t)n_rec + 1, sizeof(rw_cuda_dptr_t));
	cp->terms = rw_arena_alloc(&cp->mem, (size_t)G + ph->nodes, sizeof(uint64_t));
	int oom = !cp->local_ref || !cp->rank_out.contrib || !cp->rx_done[0] || !cp->rx_done[1] ||
		  !cp->back_at || !cp->terms;
	/* Which device writes each rank's memory: its output's, else its inputs', else home. */
	uint32_t ranks_on[CM_DEVICES] = { 0 }, recs_on[CM_DEVICES] = { 0 }, local_on[CM_DEVICES] = { 0 };
	uint32_t own_on[CM_DEVICES] = { 0 };
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
		own_on[d] += ph->rt[g].n_tokens;
	}
	uint32_t used = 0;
	for (uint32_t g = 0; g < G; g++)
		used |= 1u << cp->xdev[g] | cm_devs(rw_svc_rank_io_devs(&ph->io[0][g]));
	used |= cm_devs(rw_svc_phase_devs(ph, RW_SVC_DEVS_SLABS)); /* kernels use GPU slabs too */
	if ((st = cm_peer_reach(m, used, why)) != RW_OK)
		return st;
	cp->reach = used;
	for (uint32_t i = 0; i < n_rec; i++)
		recs_on[cp->xdev[ph->rec[i].rank]]++;
	for (uint32_t g = 0; g < G && !oom; g++) {
		const rw_svc_rank_io_t *io = &ph->io[0][g];
		rw_svc_out_layout_t *o = &cp->rank_out.layout[g];
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
		cp->rank_out.meta[g] = (uint8_t *)so->ptr + meta_at;
		cp->rows_d[g] = host ? cm_hptr(cp->rows_st[g]) : io->out.dptr + o->rows_off;
		cp->rank_out.ref[g] = rw_arena_alloc(&cp->mem, n_max + 1, sizeof(uint32_t));
		cp->rank_out.expert_counts[g] = rw_arena_alloc(&cp->mem, ph->n_experts,
							       sizeof(uint32_t));
		oom |= !cp->rank_out.ref[g] || !cp->rank_out.expert_counts[g];
	}
	for (int d = 0; d < CM_DEVICES && !oom; d++) { /* each owner device's zero row */
		rw_cuda_stream_t *s;
		int b;
		if (!own_on[d])
			continue;
		if ((b = cm_blk_take(m, d, ph->row_bytes)) < 0) {
			snprintf(why, RW_SVC_WHY_MAX, "out of GPU %d memory for a row of zeros", d);
			return RW_ERR_NOMEM;
		}
		cp->zero_blk[d] = b + 1;
		st = cm_pair_stream(cp, d, &s);
		if (st == RW_OK)
			st = rw_cuda_memset_async(s, m->blk[b].ptr, 0, ph->row_bytes);
		if (st != RW_OK) {
			snprintf(why, RW_SVC_WHY_MAX, "cannot clear a row on GPU %d: %s", d,
				 rw_status_str(st));
			return RW_ERR_DEVICE;
		}
	}
	if (oom) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	n_local = 0;
	for (uint32_t g = 0; g < G; g++)
		for (uint32_t t = 0; t < ph->rt[g].n_tokens; t++)
			if (rw_svc_phase_fwd_mask(ph, ph->rt[g].expert_ids + (size_t)t * ph->topk)) {
				cp->local_ref[2 * n_local] = g;
				cp->local_ref[2 * n_local + 1] = t;
				local_on[cp->xdev[g]]++;
				n_local++;
			}
	if (rw_svc_owner_plan(&cp->own, &cp->mem, ph, cp->local_ref, n_local) != RW_OK) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	size_t bytes = 0;
	cm_lists_carve(cp, ph, NULL, &bytes, ranks_on, recs_on, local_on, own_on);
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
	cm_lists_carve(cp, ph, m->tabs[cp->tab].buf.ptr, &bytes, ranks_on, recs_on, local_on, own_on);
	return cm_dispatch_pack_launch(cp, ph, why);
}

/* ---- dispatch ------------------------------------------------------------------------------- */

/* ---- combine -------------------------------------------------------------------------------- */

/* ---- the ops -------------------------------------------------------------------------------- */

/* The slabs were written ahead (dispatch: kernels launched at plan in pieces, each piece's
 * headers written when its marks complete; combine: with the ranks' staging), but a write may be
 * posted only once its bytes are there: the executor (which waits for RW_MV_OP_PACKED) posts
 * what ready() offers and gets an RW_MV_OP_PACKED report as each further piece is in; the loop
 * never waits for the kernels. */
static rw_status_t cm_pack(void *mover, void *state, const rw_svc_phase_t *ph,
			   rw_svc_phase_kind_t kind, uint32_t d, char *why)
{
	(void)mover, (void)state, (void)ph, (void)kind, (void)d, (void)why;
	return RW_OK;
}

/* Bytes of d's dispatch slab on `rail` whose pieces are in; an executor that wants more is
 * owed an RW_MV_OP_PACKED report. */
static uint64_t cm_ready(void *mover, void *state, const rw_svc_phase_t *ph,
			 rw_svc_phase_kind_t kind, uint32_t d, uint32_t rail, uint64_t want)
{
	(void)mover;
	cm_pair_t *cp = state;
	if (kind != 0 || cp->packed)
		return UINT64_MAX;
	const uint64_t have = cp->pk_ready[d * ph->rails + rail];
	if (have < want)
		cp->pk_waiting = 1;
	return have;
}

/* A range as it arrives (part) and once complete (arrived): its records from where the last
 * call stopped, so the CPU's header pass and the kernels run while the rest is on the wire. */
static rw_status_t cm_part(void *mover, void *state, const rw_svc_phase_t *ph,
			   rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail, uint32_t upto,
			   char *why)
{
	(void)mover;
	return kind == 0 ? cm_forward_range(state, ph, src, rail, upto, why)
			 : cm_combine_range(state, ph, src, rail, upto, why);
}

static rw_status_t cm_arrived(void *mover, void *state, const rw_svc_phase_t *ph,
			      rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail, char *why)
{
	return cm_part(mover, state, ph, kind, src, rail, UINT32_MAX, why);
}

static rw_status_t cm_local(void *mover, void *state, const rw_svc_phase_t *ph,
			    rw_svc_phase_kind_t kind, uint32_t budget, int *done_p, char *why)
{
	(void)mover;
	cm_pair_t *cp = state;
	if (cp->local_kind != (int)kind + 1) {
		cp->local_kind = (int)kind + 1;
		cp->bg_i = 0;
	}
	if (kind == 0)
		return cm_forward_local(cp, ph, budget, done_p, why);
	*done_p = 1; /* folded with the combine's staging (cm_combine_launch) */
	return RW_OK;
}

/* Every rank's results of `kind` written behind what the pair's kernels do, a mark each. */
static rw_status_t finish_marks(cm_pair_t *cp, const rw_svc_phase_t *ph, int kind,
				uint32_t *pending_p, char *why)
{
	uint32_t pending = 0;
	if (cp->m->check && kind == 0)
		for (int d = 0; d < CM_DEVICES; d++)
			if (cp->fwd[d].n)
				cm_check_copies(cp, ph, &cp->fwd[d], d, 0, cp->fwd[d].n, "forward (at finish)");
	for (uint32_t g = 0; g < ph->gpus; g++) {
		const rw_svc_rank_io_t *io = &ph->io[kind][g];
		const int dev = cp->xdev[g];
		rw_cuda_stream_t *s;
		rw_status_t st = cm_pair_stream(cp, dev, &s);
		if (kind == 0 && st == RW_OK) {
			const rw_svc_out_layout_t *o = &cp->rank_out.layout[g];
			uint64_t counts = ph->n_experts > RW_CQE_INLINE_COUNTS ? 4ull * ph->n_experts : 0;
			if (counts)
				memcpy(cp->counts_st[g], cp->rank_out.expert_counts[g], counts);
			if (io->out.dev >= 0) {
				st = counts ? rw_cuda_copy_htod_async(s, io->out.dptr + o->counts_off,
								      cp->counts_st[g], counts) : RW_OK;
				if (st == RW_OK && cp->rank_out.n[g])
					st = rw_cuda_copy_htod_async(
						s, io->out.dptr + o->meta_off, cp->rank_out.meta[g],
						(uint64_t)cp->rank_out.n[g] * o->meta_bytes);
			}
		}
		/* Combine: every owner token's sum is on this stream already (listed when its last
		 * term came in, or at the combine launch). Stream order: the flag after the outputs, on the stream that wrote them, before
		 * the mark that reports them (so the CQE always follows the flag). */
		if (st == RW_OK && io->signal)
			st = rw_cuda_stream_write_u32(s, io->flag_dptr, io->flag_value);
		if (st == RW_OK)
			st = cm_pair_mark(cp, dev, kind ? OP_FLUSH_C : OP_FLUSH_D, g);
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

/* Header pulls out of GPU slabs still in flight take their records when they are done: the
 * results wait for them (finish_run). One RW_MV_OP_FINISH per rank follows either way. */
static rw_status_t cm_finish(void *mover, void *state, const rw_svc_phase_t *ph,
			     rw_svc_phase_kind_t kind, uint32_t *pending_p, char *why)
{
	(void)mover;
	cm_pair_t *cp = state;
	if (cp->pulls_left) {
		cp->fin_wait = 1 + kind;
		*pending_p = ph->gpus;
		return RW_OK;
	}
	return finish_marks(cp, ph, kind, pending_p, why);
}

static void finish_run(cm_pair_t *cp)
{
	const int kind = cp->fin_wait - 1;
	char why[RW_SVC_WHY_MAX];
	uint32_t pending = 0;
	cp->fin_wait = 0;
	if (finish_marks(cp, cp->ph, kind, &pending, why) != RW_OK) {
		rw_warn("cuda mover: pair %u: %s", cp->serial, why);
		cp->m->done(cp->m->ctx, cp->serial, RW_MV_OP_FINISH, 0, RW_ERR_DEVICE);
	}
}

static void cm_result(void *state, uint32_t g, uint32_t *recv_rows_p, const uint32_t **counts_p)
{
	const cm_pair_t *cp = state;
	*recv_rows_p = cp->rank_out.n[g];
	*counts_p = cp->rank_out.expert_counts[g];
}

const rw_svc_mover_ops_t rw_svc_mover_cuda = {
	.name = "cuda",
	.areas_fixed = 1, /* cm_map_areas registers a slot once and keeps it */
	.create = cm_create,
	.destroy = cm_destroy,
	.accepts = cm_accepts,
	.open = cm_open,
	.stage = cm_stage,
	.plan = cm_plan,
	.pack = cm_pack,
	.ready = cm_ready,
	.arrived = cm_arrived,
	.part = cm_part,
	.local = cm_local,
	.finish = cm_finish,
	.result = cm_result,
	.quiesce = cm_quiesce,
	.settled = cm_settled,
	.fence = cm_fence,
	.close = cm_close,
	.count = cm_count,
};
