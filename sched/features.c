/* Phase features of DESIGN §4.5 (docs/algorithms.md §5) from the full N x N x R count matrix
 * under the native assignment. Integer sums first, then one floating division per feature, so
 * every node holding the same counts derives bit-identical features (and the same path). */
#include <math.h>
#include <string.h>

#include "sched/sched.h"

/* Destinations per block of the column pass: block * R accumulators of 8 bytes stay on the
 * stack (8 KiB) however large N is. */
#define COLUMN_ACC 1024

typedef struct column_stats {
	uint64_t max_ingress;      /* records into the busiest destination */
	uint32_t max_fan_in;
	double busiest_rail_share; /* max over d of max_r ingress(d, r) / ingress(d) */
} column_stats_t;

/* Row pass: native egress per (s, r) summed over d != s; returns the total of remote records
 * and the largest (s, r) egress. */
static uint64_t row_pass(const uint32_t *counts, uint32_t nodes, uint32_t rails,
			 uint64_t *max_egress_p)
{
	uint64_t total = 0, max_egress = 0;
	for (uint32_t s = 0; s < nodes; s++) {
		uint64_t load[RW_MAX_RAILS] = { 0 };
		const uint32_t *row = counts + (size_t)s * nodes * rails;
		for (uint32_t d = 0; d < nodes; d++, row += rails) {
			if (d == s)
				continue;
			for (uint32_t r = 0; r < rails; r++)
				load[r] += row[r];
		}
		for (uint32_t r = 0; r < rails; r++) {
			total += load[r];
			max_egress = RW_MAX(max_egress, load[r]);
		}
	}
	*max_egress_p = max_egress;
	return total;
}

/* Column pass: per destination its ingress per rail (rails are symmetric, so the native
 * egress rail is the ingress rail) and its fan-in, a block of destinations at a time so that
 * the matrix is still read in contiguous runs. */
static void column_pass(const uint32_t *counts, uint32_t nodes, uint32_t rails,
			column_stats_t *cs)
{
	uint64_t acc[COLUMN_ACC];
	uint32_t fan[COLUMN_ACC];
	const uint32_t block = COLUMN_ACC / rails;
	memset(cs, 0, sizeof(*cs));
	for (uint32_t d0 = 0; d0 < nodes; d0 += block) {
		uint32_t d1 = RW_MIN(nodes, d0 + block), nd = d1 - d0;
		memset(acc, 0, (size_t)nd * rails * sizeof(acc[0]));
		memset(fan, 0, (size_t)nd * sizeof(fan[0]));
		for (uint32_t s = 0; s < nodes; s++) {
			const uint32_t *run = counts + ((size_t)s * nodes + d0) * rails;
			for (uint32_t i = 0; i < nd; i++, run += rails) {
				if (d0 + i == s)
					continue;
				uint64_t *a = acc + (size_t)i * rails;
				uint32_t pair = 0;
				for (uint32_t r = 0; r < rails; r++) {
					a[r] += run[r];
					pair |= run[r];
				}
				fan[i] += pair != 0;
			}
		}
		for (uint32_t i = 0; i < nd; i++) {
			const uint64_t *a = acc + (size_t)i * rails;
			uint64_t in = 0, top = 0;
			for (uint32_t r = 0; r < rails; r++) {
				in += a[r];
				top = RW_MAX(top, a[r]);
			}
			cs->max_ingress = RW_MAX(cs->max_ingress, in);
			cs->max_fan_in = RW_MAX(cs->max_fan_in, fan[i]);
			if (in > 0) {
				double share = (double)top / (double)in;
				if (share > cs->busiest_rail_share)
					cs->busiest_rail_share = share;
			}
		}
	}
}

void rw_sched_features(const rw_topo_t *topo, const uint32_t *counts, uint64_t record_bytes,
		       rw_features_t *feat)
{
	const uint32_t nodes = topo->nodes, rails = topo->rails;
	const double world = (double)nodes * topo->gpus_per_node;

	memset(feat, 0, sizeof(*feat));
	feat->rho_g = 1.0; /* neutral values: what a phase without remote bytes reports */
	feat->kappa = 1.0;

	uint64_t max_egress;
	uint64_t total = row_pass(counts, nodes, rails, &max_egress);
	feat->remote_bytes = total * record_bytes;
	if (feat->remote_bytes == 0)
		return;

	column_stats_t cs;
	column_pass(counts, nodes, rails, &cs);

	/* Byte ratios equal record ratios (one record size per phase): mean egress per
	 * (node, rail) is total / (N R), mean ingress per node is total / N. */
	feat->B = (double)feat->remote_bytes / world;
	feat->rho_g = (double)max_egress * ((double)nodes * rails) / (double)total;
	feat->kappa = (double)cs.max_ingress * (double)nodes / (double)total;
	feat->f[0] = log2(feat->B);
	feat->f[1] = rails > 1 ? RW_MIN(1.0, (feat->rho_g - 1.0) / (double)(rails - 1)) : 0.0;
	feat->f[2] = nodes > 1 ? RW_MIN(1.0, (feat->kappa - 1.0) / (double)(nodes - 1)) : 0.0;
	feat->max_fan_in = cs.max_fan_in;
	feat->busiest_dst_rail_share = cs.busiest_rail_share;
}
