/* Phase features (docs/algorithms.md §5) under the native assignment, from the
 * N x N x R count matrix: incrementally, one source row at a time as the rows arrive from the
 * peers (rw_sched_feat_*), or in one call over the whole matrix (rw_sched_features). Both reduce
 * the matrix to the same integer sums and evaluate one floating-point expression per feature
 * from them, so every node holding the same counts derives bit-identical features whatever the
 * order the rows came in. */
#include <math.h>
#include <string.h>

#include "sched/sched.h"

/* The integer sums every feature is computed from (docs/algorithms.md §5). */
typedef struct feature_sums {
	uint64_t total;            /* remote records D */
	uint64_t max_egress;       /* max over (s, r) of egress(s, r) */
	uint64_t max_ingress;      /* max over d of ingress(d) */
	uint32_t max_fan_in;
	double busiest_rail_share; /* max over d of max_r ingress(d, r) / ingress(d) */
} feature_sums_t;

/* Destination columns rw_sched_features() accumulates at a time on the stack (12 KiB). */
#define COLUMN_ACC 1024

/* Add one source's counts to destinations [0, nd) of a column block, skipping the diagonal
 * (index `skip`; UINT32_MAX when the source is outside the block): ingress[i * R + r] and
 * lane_out[r] (the source's egress per rail) += count; fan[i] += (pair non-empty). All sums in
 * 64 bits, so nothing can wrap for any N <= RW_MAX_NODES. The lanes live in a local array and
 * the pointers are restrict so the compiler keeps them in registers; the R = 8 copy has a
 * constant rail count (the issue-2 shape), which halves the time of this loop. */
static inline __attribute__((always_inline)) void
add_segment(const uint32_t *restrict seg, uint32_t nd, uint32_t skip, uint32_t rails,
	    uint64_t *restrict ingress, uint32_t *restrict fan, uint64_t *restrict lane_out)
{
	uint64_t lane[RW_MAX_RAILS] = { 0 };
	for (uint32_t i = 0; i < nd; i++, seg += rails, ingress += rails) {
		if (i == skip)
			continue;
		uint32_t any = 0;
		for (uint32_t r = 0; r < rails; r++) {
			ingress[r] += seg[r];
			lane[r] += seg[r];
			any |= seg[r];
		}
		fan[i] += any != 0;
	}
	for (uint32_t r = 0; r < rails; r++)
		lane_out[r] += lane[r];
}

static void add_segment_8(const uint32_t *seg, uint32_t nd, uint32_t skip, uint64_t *ingress,
			  uint32_t *fan, uint64_t *lane)
{
	add_segment(seg, nd, skip, 8, ingress, fan, lane);
}

static void add_segment_any(const uint32_t *seg, uint32_t nd, uint32_t skip, uint32_t rails,
			    uint64_t *ingress, uint32_t *fan, uint64_t *lane)
{
	if (rails == 8)
		add_segment_8(seg, nd, skip, ingress, fan, lane);
	else
		add_segment(seg, nd, skip, rails, ingress, fan, lane);
}

/* A source's egress lanes into the row sums. */
static void add_egress(const uint64_t *lane, uint32_t rails, feature_sums_t *fs)
{
	for (uint32_t r = 0; r < rails; r++) {
		fs->total += lane[r];
		fs->max_egress = RW_MAX(fs->max_egress, lane[r]);
	}
}

/* Per-destination results of a column block: ingress, fan-in, busiest rail share. */
static void column_results(const uint64_t *ingress, const uint32_t *fan, uint32_t nd,
			   uint32_t rails, feature_sums_t *fs)
{
	for (uint32_t i = 0; i < nd; i++, ingress += rails) {
		uint64_t in = 0, top = 0;
		for (uint32_t r = 0; r < rails; r++) {
			in += ingress[r];
			top = RW_MAX(top, ingress[r]);
		}
		fs->max_ingress = RW_MAX(fs->max_ingress, in);
		fs->max_fan_in = RW_MAX(fs->max_fan_in, fan[i]);
		if (in > 0) {
			double share = (double)top / (double)in;
			if (share > fs->busiest_rail_share)
				fs->busiest_rail_share = share;
		}
	}
}

/* Neutral values: what a phase without remote bytes reports. */
static void features_neutral(rw_features_t *feat)
{
	memset(feat, 0, sizeof(*feat));
	feat->rho_g = 1.0;
	feat->kappa = 1.0;
}

/* The one place the features are evaluated from the sums (so both entry points agree bit for
 * bit). Byte ratios equal record ratios (one record size per phase): mean egress per
 * (node, rail) is D / (N R), mean ingress per node is D / N. */
static void features_from_sums(uint32_t nodes, uint32_t gpus_per_node, uint32_t rails,
			       const feature_sums_t *fs, uint64_t record_bytes, rw_features_t *feat)
{
	features_neutral(feat);
	feat->remote_bytes = fs->total * record_bytes;
	if (feat->remote_bytes == 0)
		return;
	const double world = (double)nodes * gpus_per_node;
	feat->B = (double)feat->remote_bytes / world;
	feat->rho_g = (double)fs->max_egress * ((double)nodes * rails) / (double)fs->total;
	feat->kappa = (double)fs->max_ingress * (double)nodes / (double)fs->total;
	feat->f[0] = log2(feat->B);
	feat->f[1] = rails > 1 ? RW_MIN(1.0, (feat->rho_g - 1.0) / (double)(rails - 1)) : 0.0;
	feat->f[2] = nodes > 1 ? RW_MIN(1.0, (feat->kappa - 1.0) / (double)(nodes - 1)) : 0.0;
	feat->max_fan_in = fs->max_fan_in;
	feat->busiest_dst_rail_share = fs->busiest_rail_share;
}

/* ---- incremental: one row at a time ---- */

/* Workspace layout: ingress[N R] (uint64), added bitmap[ceil(N / 64)] (uint64), fan_in[N]. */
static size_t bitmap_words(uint32_t nodes) { return ((size_t)nodes + 63) / 64; }

size_t rw_sched_feat_workspace(uint32_t nodes, uint32_t rails)
{
	return (size_t)nodes * rails * sizeof(uint64_t) + bitmap_words(nodes) * sizeof(uint64_t) +
	       (size_t)nodes * sizeof(uint32_t);
}

rw_status_t rw_sched_feat_begin(rw_sched_feat_acc_t *acc, const rw_topo_t *topo, void *workspace,
				size_t workspace_len)
{
	if (!acc || rw_sched_topo_check(topo) != RW_OK || !workspace ||
	    (uintptr_t)workspace % _Alignof(uint64_t) != 0 ||
	    workspace_len < rw_sched_feat_workspace(topo->nodes, topo->rails))
		return RW_ERR_INVAL;
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	memset(acc, 0, sizeof(*acc));
	acc->nodes = nodes;
	acc->rails = rails;
	acc->gpus_per_node = topo->gpus_per_node;
	acc->ingress = workspace;
	acc->added = acc->ingress + (size_t)nodes * rails;
	acc->fan_in = (uint32_t *)(acc->added + bitmap_words(nodes));
	memset(workspace, 0, rw_sched_feat_workspace(nodes, rails));
	return RW_OK;
}

rw_status_t rw_sched_feat_add_row(rw_sched_feat_acc_t *acc, uint32_t s, const uint32_t *row)
{
	if (!acc || !acc->ingress || !row || s >= acc->nodes)
		return RW_ERR_INVAL;
	const uint64_t bit = UINT64_C(1) << (s % 64);
	if (acc->added[s / 64] & bit)
		return RW_ERR_EXISTS;
	uint64_t lane[RW_MAX_RAILS] = { 0 };
	feature_sums_t fs = { .total = acc->total, .max_egress = acc->max_egress };
	add_segment_any(row, acc->nodes, s, acc->rails, acc->ingress, acc->fan_in, lane);
	add_egress(lane, acc->rails, &fs);
	acc->total = fs.total;
	acc->max_egress = fs.max_egress;
	acc->added[s / 64] |= bit;
	acc->rows++;
	return RW_OK;
}

rw_status_t rw_sched_feat_finish(const rw_sched_feat_acc_t *acc, uint64_t record_bytes,
				 rw_features_t *feat)
{
	if (!acc || !acc->ingress || !feat)
		return RW_ERR_INVAL;
	if (acc->rows != acc->nodes)
		return RW_ERR_STATE;
	feature_sums_t fs = { .total = acc->total, .max_egress = acc->max_egress };
	column_results(acc->ingress, acc->fan_in, acc->nodes, acc->rails, &fs);
	features_from_sums(acc->nodes, acc->gpus_per_node, acc->rails, &fs, record_bytes, feat);
	return RW_OK;
}

/* ---- one call over the whole matrix ---- */

/* The same sums, reading the matrix in blocks of COLUMN_ACC / R destinations so the column sums
 * stay on the stack however large N is: one pass when N R <= COLUMN_ACC (N = 128 at R = 8),
 * otherwise one pass per block plus a row pass for the egress lanes. */
void rw_sched_features(const rw_topo_t *topo, const uint32_t *counts, uint64_t record_bytes,
		       rw_features_t *feat)
{
	uint64_t ingress[COLUMN_ACC];
	uint32_t fan[COLUMN_ACC];
	feature_sums_t fs;

	features_neutral(feat);
	if (rw_sched_topo_check(topo) != RW_OK || !counts)
		return; /* contract violation: report "no remote payload" rather than crash */
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	const uint32_t block = COLUMN_ACC / rails;
	const int one_block = nodes <= block;

	memset(&fs, 0, sizeof(fs));
	for (uint32_t d0 = 0; d0 < nodes; d0 += block) {
		const uint32_t nd = RW_MIN(nodes - d0, block);
		memset(ingress, 0, (size_t)nd * rails * sizeof(ingress[0]));
		memset(fan, 0, nd * sizeof(fan[0]));
		for (uint32_t s = 0; s < nodes; s++) {
			uint64_t lane[RW_MAX_RAILS] = { 0 };
			const uint32_t skip = s >= d0 && s < d0 + nd ? s - d0 : UINT32_MAX;
			add_segment_any(counts + ((size_t)s * nodes + d0) * rails, nd, skip, rails,
					ingress, fan, lane);
			if (one_block)
				add_egress(lane, rails, &fs);
		}
		column_results(ingress, fan, nd, rails, &fs);
	}
	if (!one_block) {
		for (uint32_t s = 0; s < nodes; s++) {
			uint64_t lane[RW_MAX_RAILS] = { 0 };
			const uint32_t *row = counts + (size_t)s * nodes * rails;
			for (uint32_t d = 0; d < nodes; d++, row += rails)
				if (d != s)
					for (uint32_t r = 0; r < rails; r++)
						lane[r] += row[r];
			add_egress(lane, rails, &fs);
		}
	}
	features_from_sums(nodes, topo->gpus_per_node, rails, &fs, record_bytes, feat);
}
