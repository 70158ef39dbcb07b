/* Phase features of DESIGN §4.5 (docs/algorithms.md §5) from the full N x N x R count matrix
 * under the native assignment. Integer sums first, then one floating division per feature, so
 * every node holding the same counts derives bit-identical features (and the same path).
 *
 * Cost: one pass over the matrix (N^2 R counts) when N * R <= COLUMN_ACC, which covers N = 128
 * at R = 8; larger clusters add a row pass and read the matrix in destination blocks. The inner
 * loops are instantiated for the usual rail counts so that the compiler keeps the per-rail sums
 * in registers and vectorises the column adds. */
#include <math.h>
#include <string.h>

#include "sched/sched.h"

/* Destinations per block: block * R column accumulators (4 + 8 bytes each) and a fan-in
 * counter per destination stay on the stack (16 KiB) however large N is. */
#define COLUMN_ACC 1024

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* x86-64 GCC: also build an AVX2 clone of the vector kernels, picked at load time (ifunc), and
 * keep the fan-in test in scalar registers (the SLP vectoriser would move it to vector
 * registers and back through the stack, doubling the pass). Elsewhere: plain code. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VEC_ATTRS __attribute__((target_clones("avx2", "default"), optimize("no-tree-slp-vectorize")))
#else
#define VEC_ATTRS
#endif

typedef struct feature_sums {
	uint64_t total;            /* remote records */
	uint64_t max_egress;       /* largest (s, r) native egress */
	uint64_t max_ingress;      /* records into the busiest destination */
	uint32_t max_fan_in;
	double busiest_rail_share; /* max over d of max_r ingress(d, r) / ingress(d) */
} feature_sums_t;

/* Row pass: native egress per (s, r) summed over d != s. */
static ALWAYS_INLINE void row_pass_core(const uint32_t *counts, uint32_t nodes, uint32_t rails,
					feature_sums_t *fs)
{
	for (uint32_t s = 0; s < nodes; s++) {
		uint64_t lane[RW_MAX_RAILS] = { 0 };
		const uint32_t *row = counts + (size_t)s * nodes * rails;
		for (uint32_t d = 0; d < nodes; d++, row += rails) {
			if (d == s)
				continue;
			for (uint32_t r = 0; r < rails; r++)
				lane[r] += row[r];
		}
		for (uint32_t r = 0; r < rails; r++) {
			fs->total += lane[r];
			fs->max_egress = RW_MAX(fs->max_egress, lane[r]);
		}
	}
}

/* acc32 += the segment (sign = 1) or -= it (sign = -1), diagonal skipped. Modular arithmetic
 * makes the subtraction exact even after a wrap. */
static void segment_add(uint32_t *acc32, const uint32_t *seg, uint32_t n, uint32_t skip_lo,
			uint32_t skip_hi, int sign)
{
	for (uint32_t j = 0; j < n; j++)
		if (j < skip_lo || j >= skip_hi)
			acc32[j] = sign > 0 ? acc32[j] + seg[j] : acc32[j] - seg[j];
}

static void flush(uint64_t *acc64, uint32_t *acc32, uint32_t n)
{
	for (uint32_t j = 0; j < n; j++) {
		acc64[j] += acc32[j];
		acc32[j] = 0;
	}
}

/* Per-rail sums of one source's segment in 64 bits (the rare case where 32 might wrap). */
static void lanes64(const uint32_t *seg, uint32_t nd, uint32_t skip, uint32_t rails,
		    uint64_t *lane)
{
	for (uint32_t r = 0; r < rails; r++)
		lane[r] = 0;
	for (uint32_t i = 0; i < nd; i++, seg += rails)
		if (i != skip)
			for (uint32_t r = 0; r < rails; r++)
				lane[r] += seg[r];
}

/* Per-destination results of a column block: ingress, fan-in, busiest rail share. */
static void column_results(const uint64_t *acc64, const uint32_t *fan, uint32_t nd,
			   uint32_t rails, feature_sums_t *fs)
{
	for (uint32_t i = 0; i < nd; i++) {
		const uint64_t *a = acc64 + (size_t)i * rails;
		uint64_t in = 0, top = 0;
		for (uint32_t r = 0; r < rails; r++) {
			in += a[r];
			top = RW_MAX(top, a[r]);
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

/* Column pass over destinations [d0, d1): per destination its ingress per rail (rails are
 * symmetric: the native egress rail is the ingress rail) and its fan-in. The per-(d, r) sums
 * run in 32 bits and are flushed to 64 bits before the sources summed since the last flush
 * could total 2^32 (they never do in practice: one flush at the end). When the block is the
 * whole row the same loop also yields each source's egress per rail. */
static ALWAYS_INLINE void column_pass_core(const uint32_t *counts, uint32_t nodes,
					   uint32_t rails, uint32_t d0, uint32_t d1,
					   feature_sums_t *fs)
{
	uint32_t acc32[COLUMN_ACC];
	uint64_t acc64[COLUMN_ACC];
	uint32_t fan[COLUMN_ACC];
	const uint32_t nd = d1 - d0, n = nd * rails;
	const int whole_row = d0 == 0 && d1 == nodes;
	uint64_t chunk = 0;

	memset(acc32, 0, n * sizeof(acc32[0]));
	memset(acc64, 0, n * sizeof(acc64[0]));
	memset(fan, 0, nd * sizeof(fan[0]));
	for (uint32_t s = 0; s < nodes; s++) {
		const uint32_t *seg = counts + ((size_t)s * nodes + d0) * rails;
		const uint32_t skip = s >= d0 && s < d1 ? s - d0 : UINT32_MAX;
		uint32_t lane32[RW_MAX_RAILS] = { 0 }, bits = 0;
		const uint32_t *p = seg;
		uint32_t *a = acc32;
		for (uint32_t i = 0; i < nd; i++, p += rails, a += rails) {
			if (i == skip)
				continue;
			uint32_t any = 0;
			for (uint32_t r = 0; r < rails; r++) {
				lane32[r] += p[r];
				a[r] += p[r];
				any |= p[r];
			}
			bits |= any;
			fan[i] += any != 0;
		}
		uint64_t lane[RW_MAX_RAILS];
		for (uint32_t r = 0; r < rails; r++)
			lane[r] = lane32[r];
		if ((uint64_t)nd * bits > UINT32_MAX) /* a lane might have wrapped: redo in 64 bits */
			lanes64(seg, nd, skip, rails, lane);
		uint64_t seg_total = 0;
		for (uint32_t r = 0; r < rails; r++)
			seg_total += lane[r];
		if (chunk > 0 && chunk + seg_total > UINT32_MAX) {
			/* Take this source back out, bank the earlier ones, start a new chunk. */
			uint32_t lo = skip == UINT32_MAX ? n : skip * rails;
			segment_add(acc32, seg, n, lo, lo + rails, -1);
			flush(acc64, acc32, n);
			segment_add(acc32, seg, n, lo, lo + rails, 1);
			chunk = 0;
		}
		chunk += seg_total;
		if (whole_row) {
			fs->total += seg_total;
			for (uint32_t r = 0; r < rails; r++)
				fs->max_egress = RW_MAX(fs->max_egress, lane[r]);
		}
	}
	flush(acc64, acc32, n);
	column_results(acc64, fan, nd, rails, fs);
}

/* The column pass for R = 8 * VR written with 8-lane vectors (GCC/Clang vector extensions:
 * two SSE2 registers each on a baseline x86-64, one AVX2 register in the avx2 clone), so one
 * (s, d) pair is VR loads, VR adds into the column sums, VR adds into the row lanes and one
 * zero test for the fan-in. Same results as column_pass_core. */
typedef uint32_t v8u_t __attribute__((vector_size(32)));

static ALWAYS_INLINE void column_pass_vec(const uint32_t *counts, uint32_t nodes, uint32_t vr,
					  uint32_t d0, uint32_t d1, feature_sums_t *fs)
{
	const uint32_t rails = 8 * vr;
	uint32_t acc32[COLUMN_ACC] __attribute__((aligned(32)));
	uint64_t acc64[COLUMN_ACC];
	uint32_t fan[COLUMN_ACC];
	const uint32_t nd = d1 - d0, n = nd * rails;
	const int whole_row = d0 == 0 && d1 == nodes;
	uint64_t chunk = 0;

	memset(acc32, 0, n * sizeof(acc32[0]));
	memset(acc64, 0, n * sizeof(acc64[0]));
	memset(fan, 0, nd * sizeof(fan[0]));
	for (uint32_t s = 0; s < nodes; s++) {
		const uint32_t *seg = counts + ((size_t)s * nodes + d0) * rails;
		const uint32_t skip = s >= d0 && s < d1 ? s - d0 : UINT32_MAX;
		v8u_t lane[2] = { { 0 }, { 0 } }, bits = { 0 };
		const uint32_t *p = seg;
		uint32_t *a = acc32;
		for (uint32_t i = 0; i < nd; i++, p += rails, a += rails) {
			if (i == skip)
				continue;
			v8u_t any = { 0 };
			for (uint32_t k = 0; k < vr; k++) {
				v8u_t v, sum; /* memcpy: unaligned loads, no aliasing games */
				memcpy(&v, p + 8 * k, sizeof(v));
				memcpy(&sum, a + 8 * k, sizeof(sum));
				sum += v;
				memcpy(a + 8 * k, &sum, sizeof(sum));
				lane[k] += v;
				any |= v;
			}
			bits |= any;
			/* Pair non-empty: OR of its counts as 64-bit scalars (integer ports; cheaper
			 * than folding the vector across lanes). */
			uint64_t nz = 0;
			for (uint32_t k = 0; k < rails / 2; k++) {
				uint64_t w;
				memcpy(&w, p + 2 * k, sizeof(w));
				nz |= w;
			}
			fan[i] += nz != 0;
		}
		uint64_t lane64[RW_MAX_RAILS];
		uint32_t max_bits = 0;
		for (uint32_t r = 0; r < rails; r++) {
			lane64[r] = lane[r / 8][r % 8];
			max_bits |= bits[r % 8];
		}
		if ((uint64_t)nd * max_bits > UINT32_MAX) /* a lane might have wrapped */
			lanes64(seg, nd, skip, rails, lane64);
		uint64_t seg_total = 0;
		for (uint32_t r = 0; r < rails; r++)
			seg_total += lane64[r];
		if (chunk > 0 && chunk + seg_total > UINT32_MAX) {
			uint32_t lo = skip == UINT32_MAX ? n : skip * rails;
			segment_add(acc32, seg, n, lo, lo + rails, -1);
			flush(acc64, acc32, n);
			segment_add(acc32, seg, n, lo, lo + rails, 1);
			chunk = 0;
		}
		chunk += seg_total;
		if (whole_row) {
			fs->total += seg_total;
			for (uint32_t r = 0; r < rails; r++)
				fs->max_egress = RW_MAX(fs->max_egress, lane64[r]);
		}
	}
	flush(acc64, acc32, n);
	column_results(acc64, fan, nd, rails, fs);
}

/* One instantiation per usual rail count (constant R), one generic. */
#define RAIL_CASES(CALL) \
	CALL(1) CALL(2) CALL(4) CALL(8) CALL(16)

#define ROW_FN(R) \
	static void row_pass_##R(const uint32_t *c, uint32_t n, feature_sums_t *fs) \
	{ row_pass_core(c, n, R, fs); }
#define COL_FN(R) \
	static void column_pass_##R(const uint32_t *c, uint32_t n, uint32_t d0, uint32_t d1, \
				    feature_sums_t *fs) \
	{ column_pass_core(c, n, R, d0, d1, fs); }
#define VEC_FN(R) \
	VEC_ATTRS \
	static void column_pass_##R(const uint32_t *c, uint32_t n, uint32_t d0, uint32_t d1, \
				    feature_sums_t *fs) \
	{ column_pass_vec(c, n, R / 8, d0, d1, fs); }
RAIL_CASES(ROW_FN)
COL_FN(1) COL_FN(2) COL_FN(4) VEC_FN(8) VEC_FN(16)

static void row_pass(const uint32_t *counts, uint32_t nodes, uint32_t rails, feature_sums_t *fs)
{
	switch (rails) {
#define ROW_CASE(R) case R: row_pass_##R(counts, nodes, fs); return;
		RAIL_CASES(ROW_CASE)
#undef ROW_CASE
	default: row_pass_core(counts, nodes, rails, fs); return;
	}
}

static void column_pass(const uint32_t *counts, uint32_t nodes, uint32_t rails, uint32_t d0,
			uint32_t d1, feature_sums_t *fs)
{
	switch (rails) {
#define COL_CASE(R) case R: column_pass_##R(counts, nodes, d0, d1, fs); return;
		RAIL_CASES(COL_CASE)
#undef COL_CASE
	default: column_pass_core(counts, nodes, rails, d0, d1, fs); return;
	}
}

void rw_sched_features(const rw_topo_t *topo, const uint32_t *counts, uint64_t record_bytes,
		       rw_features_t *feat)
{
	feature_sums_t fs;

	memset(&fs, 0, sizeof(fs));
	memset(feat, 0, sizeof(*feat));
	feat->rho_g = 1.0; /* neutral values: what a phase without remote bytes reports */
	feat->kappa = 1.0;
	if (rw_sched_topo_check(topo) != RW_OK || !counts)
		return; /* contract violation: report "no remote payload" rather than crash */

	const uint32_t nodes = topo->nodes, rails = topo->rails;
	const uint32_t block = COLUMN_ACC / rails;
	if (nodes <= block) {
		column_pass(counts, nodes, rails, 0, nodes, &fs);
	} else {
		row_pass(counts, nodes, rails, &fs);
		for (uint32_t d0 = 0; d0 < nodes; d0 += block)
			column_pass(counts, nodes, rails, d0, RW_MIN(nodes, d0 + block), &fs);
	}

	feat->remote_bytes = fs.total * record_bytes;
	if (feat->remote_bytes == 0)
		return;

	/* Byte ratios equal record ratios (one record size per phase): mean egress per
	 * (node, rail) is total / (N R), mean ingress per node is total / N. */
	const double world = (double)nodes * topo->gpus_per_node;
	feat->B = (double)feat->remote_bytes / world;
	feat->rho_g = (double)fs.max_egress * ((double)nodes * rails) / (double)fs.total;
	feat->kappa = (double)fs.max_ingress * (double)nodes / (double)fs.total;
	feat->f[0] = log2(feat->B);
	feat->f[1] = rails > 1 ? RW_MIN(1.0, (feat->rho_g - 1.0) / (double)(rails - 1)) : 0.0;
	feat->f[2] = nodes > 1 ? RW_MIN(1.0, (feat->kappa - 1.0) / (double)(nodes - 1)) : 0.0;
	feat->max_fan_in = fs.max_fan_in;
	feat->busiest_dst_rail_share = fs.busiest_rail_share;
}
