/* The CUDA mover's dispatch pack (service/mover/mover_cuda_int.h; docs/dataflow.md "Send": writes in
 * rounds, slabs in pieces): the token rows of every record that leaves the node copied by kernels
 * into the mapped send slabs, piece by piece in posting order, each piece's headers written by
 * the CPU and offered to the executor (ready()) once its stream marks complete. (Slabs on a GPU:
 * the headers are written at launch and copied by the piece's kernels, mover_cuda_slab.c.) */
#include <stdio.h>
#include <string.h>

#include "service/mover/mover_cuda_int.h"

/* The dispatch slabs in pieces (docs/dataflow.md "Send"): a kernel per piece and device copies
 * the token rows into the mapped slabs, each record at the host mover's (egress rail, slot)
 * (rw_sched_map_rail); the CPU writes a piece's headers and top-k blocks once its kernels (and
 * every earlier piece's) are done. A header shares a cache line with its row's first bytes, and
 * a line is never written by the CPU and the GPU at once: a piece's headers are written after
 * its own rows, and the rows still being written belong to later records, at least a record
 * (>= 64 bytes, else the slab is one piece) past any header written. The executor posts each
 * write as soon as its bytes are in (ready()), so the first pieces are on the wire while the
 * kernels write the next. */
#define CM_PIECES_MAX 1024u /* pieces per destination at most (the piece grows beyond) */

static void pack_header(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t i, uint32_t d)
{
	const rw_record_t *rec = &ph->rec[i];
	const rw_svc_rank_io_t *io = &ph->io[0][rec->rank];
	rw_wire_rec_hdr_t h = { .tag = ph->tag_to[d], .src_node = ph->me, .owner = rec->rank,
				.token = rec->token, .topk = ph->topk };
	rw_wire_rec_pack(cp->pk_hdr[i], &h, io->ids + (size_t)rec->token * ph->topk,
			 io->weights + (size_t)rec->token * ph->topk);
}

/* The destination of piece `key`: pieces run in posting order, wave k's destination first. */
static uint32_t piece_dst(const cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t key)
{
	return rw_sched_wave_dst(ph->nodes, ph->me, key / cp->pk_per_dst + 1);
}

/* Every piece up to the first whose marks are not all done: headers written, bytes offered; a
 * waiting executor is told. */
static void pack_advance(cm_pair_t *cp)
{
	const rw_svc_phase_t *ph = cp->ph;
	const uint32_t serial = cp->serial;
	int moved = 0;
	while (cp->pk_next < cp->pk_keys && !cp->pk_left[cp->pk_next]) {
		const uint32_t key = cp->pk_next++, d = piece_dst(cp, ph, key);
		for (uint32_t j = cp->pk_first[key]; j < cp->pk_first[key + 1]; j++)
			if (!cp->pk_hdev || cp->pk_hdev[cp->pk_order[j]] < 0) /* GPU slabs: copied already */
				pack_header(cp, ph, cp->pk_order[j], d);
		const uint64_t upto = (uint64_t)(key % cp->pk_per_dst + 1) * cp->pk_piece;
		for (uint32_t e = 0; e < ph->rails; e++) {
			uint64_t len = (uint64_t)ph->layout->out_pairs[d].quota[e] * ph->rec_size;
			cp->pk_ready[d * ph->rails + e] = RW_MIN(len, upto);
		}
		moved = 1;
	}
	if (cp->pk_next == cp->pk_keys)
		cp->packed = 1;
	if (moved && cp->pk_waiting) {
		cp->pk_waiting = 0;
		cp->m->done(cp->m->ctx, serial, RW_MV_OP_PACKED, 0, RW_OK);
	}
}

/* A pack mark of `dev` completed: its oldest piece has one mark less. */
void cm_pack_piece_done(cm_pair_t *cp, int dev)
{
	if (dev < 0 || dev >= CM_DEVICES || !cp->pk_fifo[dev])
		return;
	uint32_t key = cp->pk_fifo[dev][cp->pk_fifo_h[dev]++];
	if (key < cp->pk_keys && cp->pk_left[key])
		cp->pk_left[key]--;
	pack_advance(cp);
}

/* Piece of slab bytes: the executor's write (ph->write_max) times what keeps the pieces per
 * destination at most CM_PIECES_MAX; the whole slab where records are under a cache line. */
static uint64_t piece_bytes(const rw_svc_phase_t *ph, uint64_t slab_max)
{
	if (!slab_max)
		return 1;
	if (!ph->write_max || ph->rec_size < 64)
		return slab_max;
	uint64_t w = ph->write_max, writes = (slab_max + w - 1) / w;
	return w * ((writes + CM_PIECES_MAX - 1) / CM_PIECES_MAX);
}

rw_status_t cm_dispatch_pack_launch(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why)
{
	cm_list_t *pk = &cp->pack;
	const rw_svc_layout_t *l = ph->layout;
	const uint32_t N = ph->nodes, R = ph->rails, n_rec = ph->row_off[(size_t)N * R];
	uint64_t slab_max = 0;
	for (uint32_t d = 0; d < N; d++)
		for (uint32_t e = 0; e < R && d != ph->me; e++)
			slab_max = RW_MAX(slab_max, (uint64_t)l->out_pairs[d].quota[e] * ph->rec_size);
	cp->pk_piece = piece_bytes(ph, slab_max);
	cp->pk_per_dst = (uint32_t)((slab_max + cp->pk_piece - 1) / cp->pk_piece);
	cp->pk_per_dst = RW_MAX(cp->pk_per_dst, 1u);
	cp->pk_keys = (N - 1) * cp->pk_per_dst;
	const uint32_t keys = cp->pk_keys;
	uint8_t *egress = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), 1);
	uint32_t *slot = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint32_t));
	uint64_t *dst = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint64_t));
	uint32_t *key_of = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint32_t));
	cp->pk_hdr = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint8_t *));
	cp->pk_left = rw_arena_alloc(&cp->mem, keys + 1, sizeof(uint32_t));
	cp->pk_first = rw_arena_alloc(&cp->mem, keys + 2, sizeof(uint32_t));
	cp->pk_order = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint32_t));
	cp->pk_ready = rw_arena_alloc(&cp->mem, (size_t)N * R, sizeof(uint64_t));
	if (cm_slab_any(ph)) {
		cp->pk_hdev = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), 1);
		cp->pk_hsrc = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint64_t));
		cp->pk_hdst = rw_arena_alloc(&cp->mem, RW_MAX(1u, n_rec), sizeof(uint64_t));
		if (!cp->pk_hdev || !cp->pk_hsrc || !cp->pk_hdst)
			egress = NULL;
	}
	if (!egress || !slot || !dst || !key_of || !cp->pk_hdr || !cp->pk_left || !cp->pk_first ||
	    !cp->pk_order || !cp->pk_ready) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	const uint64_t row_off = rw_wire_rec_row_off(ph->topk);
	/* The CSR holds this node's own records too (d == me): they never travel. */
	for (uint32_t d = 0; d < N; d++)
		for (uint32_t r = 0; r < R && d != ph->me; r++) {
			uint32_t first = ph->row_off[d * R + r];
			uint32_t cnt = ph->row_off[d * R + r + 1] - first;
			if (!cnt)
				continue;
			const uint32_t wave = (d + N - ph->me) % N - 1; /* rw_sched_wave_dst's inverse */
			rw_sched_map_rail(&l->out_pairs[d], r, egress, slot);
			for (uint32_t i = 0; i < cnt; i++) {
				uint32_t e = egress[i];
				uint64_t pos = ((uint64_t)l->out_first[d * R + e] + slot[i]) * ph->rec_size;
				cp->pk_hdr[first + i] = ph->send_area[0][e] + pos;
				dst[first + i] = cp->send_d[0][e] + pos + row_off;
				if (cp->pk_hdev) { /* a GPU slab: the header now, copied with the piece */
					cp->pk_hdev[first + i] = (int8_t)ph->slab_dev[e];
					cp->pk_hsrc[first + i] = cp->sh_send_d[0][e] + pos;
					cp->pk_hdst[first + i] = cp->send_d[0][e] + pos;
					if (ph->slab_dev[e] >= 0)
						pack_header(cp, ph, first + i, d);
				}
				key_of[first + i] = wave * cp->pk_per_dst +
						    (uint32_t)((uint64_t)slot[i] * ph->rec_size / cp->pk_piece);
				cp->pk_first[key_of[first + i] + 1]++;
			}
		}
	const uint32_t own_lo = ph->row_off[ph->me * R], own_hi = ph->row_off[(ph->me + 1) * R];
	for (uint32_t k = 0; k < keys; k++)
		cp->pk_first[k + 1] += cp->pk_first[k];
	for (uint32_t i = 0, *at = cp->pk_left; i < n_rec; i++) /* pk_left: the fill cursor here */
		if (i < own_lo || i >= own_hi)
			cp->pk_order[cp->pk_first[key_of[i]] + at[key_of[i]]++] = i;
	memset(cp->pk_left, 0, (keys + 1) * sizeof(uint32_t));
	for (uint32_t k = 0; k < keys; k++)
		for (int dev = 0; dev < CM_DEVICES; dev++) {
			for (uint32_t j = cp->pk_first[k]; j < cp->pk_first[k + 1]; j++) {
				const uint32_t i = cp->pk_order[j];
				const rw_record_t *rec = &ph->rec[i];
				if (cp->xdev[rec->rank] == dev)
					cm_list_copy(pk, cp->tok[rec->rank] + (uint64_t)rec->token * ph->row_bytes,
						     dst[i]);
				if (cp->pk_hdev && cp->pk_hdev[i] == dev)
					cm_list_copy(&cp->pk_hl, cp->pk_hsrc[i], cp->pk_hdst[i]);
			}
			if (pk->n == pk->launched && cp->pk_hl.n == cp->pk_hl.launched)
				continue;
			if (!cp->pk_fifo[dev] && !(cp->pk_fifo[dev] = rw_arena_alloc(&cp->mem, keys, sizeof(uint32_t)))) {
				snprintf(why, RW_SVC_WHY_MAX, "out of memory");
				return RW_ERR_NOMEM;
			}
			rw_status_t st = cm_list_launch(cp, ph, pk, dev, 0);
			if (st == RW_OK)
				st = cm_list_launch(cp, ph, &cp->pk_hl, dev, 0);
			if (st == RW_OK && (st = cm_pair_mark(cp, dev, OP_PACK, (uint32_t)dev)) == RW_OK) {
				cp->marks_pk++;
				cp->pk_left[k]++;
				cp->pk_fifo[dev][cp->pk_fifo_h[dev]++] = k;
			}
			if (st != RW_OK) {
				snprintf(why, RW_SVC_WHY_MAX, "cannot launch the dispatch pack on GPU %d: %s",
					 dev, rw_status_str(st));
				return RW_ERR_DEVICE;
			}
		}
	memset(cp->pk_fifo_h, 0, sizeof(cp->pk_fifo_h)); /* from now on: the next mark's piece */
	pack_advance(cp); /* pieces with nothing on a GPU are done now */
	return RW_OK;
}
