/* The face of service/phase/: the pure per-phase math of railwaved — the receive layout both
 * ends of a phase derive from the same counts, the dispatch output span, the forwarding targets
 * of a record, combine accumulation and dtype conversion — and the wire formats every message
 * and record between nodes is encoded in (wire.h, included below). No I/O, no allocation on a
 * hot path. docs/dataflow.md is the full description; the section names cited below are its
 * headings. */
#ifndef RW_SVC_PHASE_H
#define RW_SVC_PHASE_H

#include <stdint.h>

#include "common/bf16.h"
#include "common/common.h"
#include "sched/sched.h"
#include "service/phase/wire.h"

/* ---- receive layout ("Receive-region layout") ------------------------------------------------
 * For a phase at node `me`, from the full N x N x R count matrix: on every rail r, my dispatch
 * area holds, for each source s in ascending order, a contiguous range of quota(s -> me, r)
 * records; my send area (and, for the returning combine, my combine area) holds for each
 * destination d in ascending order quota(me -> d, r) records. Both ends derive the same numbers
 * from the same counts, so no offsets travel on the wire. Slots are record indices; byte offset =
 * slot * record size. */
typedef struct rw_svc_layout {
	uint32_t nodes, rails, me;
	rw_path_t path;
	rw_pair_plan_t *out_pairs; /* [N]: me -> d (RailBalance or native); [me] is empty */
	uint32_t *in_quota;        /* [N*R]: quota(s -> me, r); the s == me row is 0 */
	uint32_t *in_first;        /* [N*R]: first slot of source s on rail r in my receive area */
	uint32_t *out_first;       /* [N*R]: first slot of destination d on rail r in my send area */
	uint32_t *peer_in_first;   /* [N*R]: where my range starts in d's receive area on rail r */
	uint32_t *peer_ret_first;  /* [N*R]: where my combine range starts in s's combine area */
	uint32_t in_total[RW_MAX_RAILS];  /* records arriving on rail r */
	uint32_t out_total[RW_MAX_RAILS]; /* records leaving on rail r */
} rw_svc_layout_t;

/* Allocate the arrays for N nodes x R rails. RW_ERR_NOMEM. */
rw_status_t rw_svc_layout_alloc(rw_svc_layout_t *l, uint32_t nodes, uint32_t rails);
void rw_svc_layout_free(rw_svc_layout_t *l);
/* Fill the layout of `me` for `path` from counts[(s*N + d)*R + r]. Deterministic: every node
 * computes quota(s -> d, r) exactly as the sender s does (rw_sched_plan_build for the sender's
 * own pairs, rw_sched_balance with rotation = destination for the others). */
rw_status_t rw_svc_layout_build(rw_svc_layout_t *l, const rw_topo_t *topo, rw_path_t path,
				uint32_t me, const uint32_t *counts);
/* Dispatch output span of one rank (docs/dataflow.md "Dispatch output"): per-expert counts
 * first when they do not fit the completion inline (n_experts > RW_CQE_INLINE_COUNTS: u32 each,
 * area padded to 16 bytes), then rows_cap rows (hidden x dtype each), then rows_cap metadata
 * entries: u32 src_node | u32 src_rank (global) | u32 token | u32 reserved | i32 ids[topk] |
 * f32 weights[topk]. rows_cap = what fits. */
typedef struct rw_svc_out_layout {
	uint64_t counts_off, rows_off, meta_off;
	uint64_t rows_cap;
	uint64_t meta_bytes;
} rw_svc_out_layout_t;

static inline void rw_svc_out_layout(uint64_t capacity, uint32_t n_experts, uint32_t topk,
				     uint64_t row_bytes, uint32_t inline_max,
				     rw_svc_out_layout_t *o)
{
	uint64_t counts = n_experts > inline_max ? rw_wire_align16(4ull * n_experts) : 0;
	o->meta_bytes = 16 + 8ull * topk;
	o->counts_off = 0;
	o->rows_off = counts;
	o->rows_cap = capacity > counts ? (capacity - counts) / (row_bytes + o->meta_bytes) : 0;
	o->meta_off = counts + o->rows_cap * row_bytes;
}

/* The most records any node receives on any rail, and sends on any rail, under this layout's
 * counts and path: every node checks the same bound before a phase starts (identical verdict
 * everywhere, "Region sizing"). */
void rw_svc_layout_max(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts,
		       uint64_t *max_in_p, uint64_t *max_out_p);

/* ---- a group's carve-out (the rank path's slabs) ------------------------------------------------
 * A carve-out of carve_bytes per rail is cut into five: the receive and send areas of dispatch
 * and combine records (rw_svc_carve_sub bytes each, in that order) and, last, the local area
 * (what is left, at least local_bytes: group_local_mib; 0 asks for five equal areas). The
 * daemon splits it so, and checks a phase against it in two places: the layout's largest rail
 * against one record area (rw_svc_layout_max x record size), and the page mover's local area
 * (rw_svc_local_plan). `railwave size` asks the same two for the largest phase of a shape
 * (rw_svc_carve_size). */
uint64_t rw_svc_carve_sub(uint64_t carve_bytes, uint64_t local_bytes);

/* The local area of each rail in a page-rank phase, as offsets from its start: the dispatch's
 * local records (local_n[r] records of rec bytes), then the combine's local copies (gpus x
 * local_n[r] of crec), then the staged combine inputs of the local ranks whose native rail is
 * r (gpu_rail[g] == r), one after another in rank order, each with room for rank_rows rows of
 * row_bytes (64-byte lines): rank g's at stage_at[g] of its native rail's local area. end[r]:
 * the bytes rail r's local area must hold. */
typedef struct rw_svc_local_plan {
	uint64_t comb_off[RW_MAX_RAILS];
	uint64_t stage_at[RW_MAX_GPUS];
	uint64_t end[RW_MAX_RAILS];
} rw_svc_local_plan_t;

void rw_svc_local_plan(uint32_t rails, uint32_t gpus, const uint8_t *gpu_rail, uint64_t rec,
		       uint64_t crec, uint64_t row_bytes, uint64_t rank_rows,
		       const uint32_t *local_n, rw_svc_local_plan_t *lp);

/* The largest phase of a shape: every rank's `tokens` tokens each naming every node (one
 * record per (token, node), at the rank's native rail), so every node receives all it can on
 * every rail and keeps all its own; under each of the four paths; a rank receives at most
 * max_recv rows (its page's bound; 0: every token of the world). What it needs of a
 * carve-out: sub_need bytes in each record area, local_need in the local area (its largest
 * rail's), and the smallest group_local_mib and group_area_mib holding both (0: none up to
 * max_mib); the parts of the local area on that rail too. */
typedef struct rw_svc_carve_need {
	uint64_t sub_need, local_need;
	uint64_t max_records;         /* the most records of any node on any rail */
	uint64_t local_records, local_copies, local_staging; /* the local area's parts */
	uint64_t rank_rows;           /* the rows a rank's staging has room for */
	uint32_t area_mib, local_mib;
} rw_svc_carve_need_t;

/* RW_ERR_INVAL: the topology fails rw_sched_topo_check, tokens or hidden 0, topk 0;
 * RW_ERR_NOMEM. dtype: RW_WIRE_BF16 or RW_WIRE_F32. */
rw_status_t rw_svc_carve_size(const rw_topo_t *topo, uint32_t topk, uint32_t hidden,
			      uint32_t dtype, uint32_t tokens, uint32_t max_recv, uint32_t max_mib,
			      rw_svc_carve_need_t *need);
/* Whether a carve-out of carve_bytes, local_bytes of it asked for the local area, holds what
 * `need` asks (both checks above). */
int rw_svc_carve_fits(uint64_t carve_bytes, uint64_t local_bytes, const rw_svc_carve_need_t *need);

/* ---- forwarding ("Receive and forward") ------------------------------------------------------
 * Expert e lives on global rank e / (E / W), W = N * G; the record goes to every local rank of
 * `me` that hosts one of its top-k experts. Returns the bitmask of local GPU indices (bit g);
 * 0 when no expert of the record lives on `me` (a peer bug: the caller fails the phase).
 * Ids of -1 (no expert) are skipped; any other negative id, or one >= E, makes it return 0. */
uint32_t rw_svc_fwd_mask(uint32_t n_experts, uint32_t nodes, uint32_t gpus, uint32_t me,
			 const int32_t *ids, uint32_t topk);
/* Same from a dispatch record's top-k block. */
uint32_t rw_svc_fwd_mask_rec(uint32_t n_experts, uint32_t nodes, uint32_t gpus, uint32_t me,
			     const uint8_t *rec, uint32_t topk);

/* ---- dtype and accumulation ("Combine") ------------------------------------------------------
 * fp32 accumulation for both dtypes; bf16 stores round to nearest even, NaN stays NaN
 * (common/bf16.h). */
/* acc[i] += row[i] for i < hidden, row of dtype (rw_wire_dtype_t). */
void rw_svc_row_acc(float *acc, const void *row, uint32_t dtype, uint32_t hidden);
/* acc[i] = row[i] for i < hidden: the first copy of a sum. */
void rw_svc_row_load(float *acc, const void *row, uint32_t dtype, uint32_t hidden);
/* dst[i] = (dtype) acc[i]. */
void rw_svc_row_store(void *dst, uint32_t dtype, const float *acc, uint32_t hidden);
/* The owner's sum of a token ("Combine"): dst[i] = (dtype)(((+0 + rows[0][i]) + rows[1][i]) +
 * ... + rows[n-1][i]), added in fp32 in this order and rounded once; n = 0 gives zeros. rows
 * and dst are rows of the phase dtype; no sum is kept in memory beyond a block on the stack. */
void rw_svc_rows_reduce(void *dst, uint32_t dtype, const void *const *rows, uint32_t n,
			uint32_t hidden);

#endif /* RW_SVC_PHASE_H */
