/* The per-phase path selector (docs/selector.md §1) and the calibration rule that decides what
 * each anchor of the table says (§2 there). Pure: no I/O, no allocation; docs/selector.md explains
 * the rules and why they are conservative. */
#include <math.h>
#include <string.h>

#include "sched/sched.h"

static const char *const path_names[RW_PATH_COUNT] = {
	[RW_PATH_NATIVE] = "native",
	[RW_PATH_RAIL_ONLY] = "rail-only",
	[RW_PATH_PERM_ONLY] = "perm-only",
	[RW_PATH_JOINT] = "joint",
};

const char *rw_sched_path_name(rw_path_t path)
{
	if ((unsigned)path >= RW_PATH_COUNT)
		return "unknown";
	return path_names[path];
}

rw_status_t rw_sched_path_parse(const char *name, rw_path_t *path_p)
{
	if (!name)
		return RW_ERR_INVAL;
	for (unsigned p = 0; p < RW_PATH_COUNT; p++) {
		if (strcmp(name, path_names[p]) == 0) {
			*path_p = (rw_path_t)p;
			return RW_OK;
		}
	}
	return RW_ERR_INVAL;
}

const char *rw_sched_reason_name(rw_select_reason_t reason)
{
	switch (reason) {
	case RW_SELECT_NO_REMOTE: return "no-remote-payload";
	case RW_SELECT_ANCHOR: return "anchor";
	case RW_SELECT_NO_ANCHOR: return "no-eligible-anchor";
	case RW_SELECT_NO_TABLE: return "no-table";
	case RW_SELECT_FORCED: return "forced";
	}
	return "unknown";
}

/* docs/selector.md §1. The comparisons are written as !(x <= bound) so that a NaN feature (a
 * corrupt count matrix) makes an anchor ineligible rather than eligible: the fallback is Joint. */
void rw_sched_select(const rw_anchor_table_t *table, const rw_features_t *feat,
		     rw_selection_t *sel)
{
	sel->case_id = -1;
	sel->distance2 = 0.0;
	if (feat->remote_bytes == 0) {
		sel->path = RW_PATH_NATIVE;
		sel->reason = RW_SELECT_NO_REMOTE;
		return;
	}
	sel->path = RW_PATH_JOINT;
	if (!table) {
		sel->reason = RW_SELECT_NO_TABLE;
		return;
	}
	sel->reason = RW_SELECT_NO_ANCHOR;

	const double size_tol = log2(table->max_size_ratio);
	const double shape_tol = table->shape_tolerance;
	const rw_anchor_t *best = NULL;
	double best_d2 = 0.0;
	for (uint32_t i = 0; i < table->n_anchors; i++) {
		const rw_anchor_t *a = &table->anchors[i];
		double d0 = fabs(feat->f[0] - a->feat[0]);
		double d1 = fabs(feat->f[1] - a->feat[1]);
		double d2 = fabs(feat->f[2] - a->feat[2]);
		if (!(d0 <= size_tol) || !(d1 <= shape_tol) || !(d2 <= shape_tol))
			continue;
		double dist2 = d0 * d0 + d1 * d1 + d2 * d2;
		if (!best || dist2 < best_d2 || (dist2 == best_d2 && a->case_id < best->case_id)) {
			best = a;
			best_d2 = dist2;
		}
	}
	if (!best)
		return;
	sel->path = best->selected;
	sel->reason = RW_SELECT_ANCHOR;
	sel->case_id = best->case_id;
	sel->distance2 = best_d2;
}

/* ---------------------------------------------------------------------------------------------
 * Calibration rule (docs/selector.md §2)
 * ------------------------------------------------------------------------------------------- */

/* In-place heapsort: O(n log n), no allocation, deterministic. The order of repeated
 * measurements carries no meaning, so rw_sched_anchor_decide() sorts the caller's arrays. */
static void sift_down(double *v, size_t root, size_t n)
{
	for (;;) {
		size_t child = 2 * root + 1;
		if (child >= n)
			return;
		if (child + 1 < n && v[child + 1] > v[child])
			child++;
		if (!(v[child] > v[root]))
			return;
		double t = v[root];
		v[root] = v[child];
		v[child] = t;
		root = child;
	}
}

static void sort_samples(double *v, size_t n)
{
	if (n < 2)
		return;
	for (size_t i = n / 2; i-- > 0;)
		sift_down(v, i, n);
	for (size_t end = n - 1; end > 0; end--) {
		double t = v[0];
		v[0] = v[end];
		v[end] = t;
		sift_down(v, 0, end);
	}
}

/* Quantile q of sorted v[0..n) with linear interpolation between closest ranks (the common
 * "type 7" definition), so that p10 <= median <= p90 always holds. */
static double quantile(const double *v, uint32_t n, double q)
{
	double pos = q * (double)(n - 1);
	uint32_t lo = (uint32_t)pos;
	if (lo + 1 >= n)
		return v[n - 1];
	double frac = pos - (double)lo;
	return v[lo] + (v[lo + 1] - v[lo]) * frac;
}

/* Coefficient of variation (sample standard deviation / mean). Fewer than two samples, a
 * non-positive mean or a non-finite value cannot show stability: +inf. */
static double coeff_var(const double *v, uint32_t n)
{
	if (n < 2)
		return INFINITY;
	double sum = 0.0;
	for (uint32_t i = 0; i < n; i++)
		sum += v[i];
	double mean = sum / n;
	if (!(mean > 0.0) || !isfinite(mean))
		return INFINITY;
	double ss = 0.0;
	for (uint32_t i = 0; i < n; i++)
		ss += (v[i] - mean) * (v[i] - mean);
	return sqrt(ss / (n - 1)) / mean;
}

/* docs/selector.md §2. samples[p] may be NULL when n_samples[p] == 0 (path not measured). Each
 * non-empty samples[p] is sorted in place. An alternative path qualifies only when both it and
 * Joint are stable (CV < cv_bound) and its p90 * (1 + margin) is below Joint's p10; among
 * qualifying alternatives the lowest median wins (ties: lower path id). Otherwise Joint. */
void rw_sched_anchor_decide(const rw_calib_rule_t *rule, double *const samples[RW_PATH_COUNT],
			    const uint32_t n_samples[RW_PATH_COUNT], rw_anchor_t *anchor)
{
	double cv[RW_PATH_COUNT];

	for (unsigned p = 0; p < RW_PATH_COUNT; p++) {
		rw_path_samples_t *out = &anchor->samples[p];
		uint32_t n = samples[p] ? n_samples[p] : 0;
		memset(out, 0, sizeof(*out));
		cv[p] = INFINITY;
		if (n == 0)
			continue;
		sort_samples(samples[p], n);
		out->median = quantile(samples[p], n, 0.5);
		out->p10 = quantile(samples[p], n, 0.1);
		out->p90 = quantile(samples[p], n, 0.9);
		out->n = n;
		cv[p] = coeff_var(samples[p], n);
	}

	anchor->selected = RW_PATH_JOINT;
	const rw_path_samples_t *joint = &anchor->samples[RW_PATH_JOINT];
	if (!(cv[RW_PATH_JOINT] < rule->cv_bound))
		return;
	double best_median = 0.0;
	for (unsigned p = 0; p < RW_PATH_COUNT; p++) {
		if (p == RW_PATH_JOINT || !(cv[p] < rule->cv_bound))
			continue;
		const rw_path_samples_t *alt = &anchor->samples[p];
		if (!(alt->p90 * (1.0 + rule->margin) < joint->p10))
			continue;
		if (anchor->selected == RW_PATH_JOINT || alt->median < best_median) {
			anchor->selected = (rw_path_t)p;
			best_median = alt->median;
		}
	}
}
