/* RailBalance (docs/algorithms.md §2): per (source, destination) pair, quotas that
 * differ by at most one record (or follow rail weights), a count-aware rotated remainder that
 * moves the fewest records, and the owner -> proxy map that surplus -> deficit matching by prefix
 * sums defines, with its inverse. Pure, O(R) per pair, O(log R) per mapped record. */
#include <string.h>

#include "sched/sched.h"
#include "sched/sched_priv.h"

void rw_sched_rail_set(const rw_topo_t *topo, rw_rail_set_t *set)
{
	rw_sched_rail_set_w(topo->rails, topo->rail_weight, set);
}

const rw_rail_set_t *rw_sched_pair_set(const rw_topo_t *topo, const rw_rail_set_t *base, uint32_t s,
				       uint32_t d, rw_rail_set_t *tmp)
{
	if (!topo->pair_weight)
		return base;
	const size_t at = ((size_t)s * topo->nodes + d) * topo->rails;
	rw_sched_rail_set_w(topo->rails, topo->pair_weight + at, tmp);
	return tmp;
}

void rw_sched_rail_set_w(uint32_t rails, const uint32_t *weight, rw_rail_set_t *set)
{
	uint32_t m = 0, w0 = 0, unequal = 0;
	uint64_t weight_sum = 0;
	for (uint32_t r = 0; r < rails; r++) {
		const uint32_t w = weight[r];
		if (w == 0)
			continue;
		w0 = m == 0 ? w : w0;
		unequal |= w ^ w0;
		set->eligible[m++] = (uint8_t)r;
		weight_sum += w;
	}
	set->rails = rails;
	set->m = m;
	set->equal = !unequal;
	set->plain = m == rails && !unequal;
	set->weight_sum = weight_sum;
	set->rail_weight = weight;
}

/* The lowest n set bits of x (all of them if x has fewer); *taken_p = how many that is. */
static inline uint32_t lowest_bits(uint32_t x, uint32_t n, uint32_t *taken_p)
{
	uint32_t rest = x, taken = 0;
	while (taken < n && rest) {
		rest &= rest - 1;
		taken++;
	}
	*taken_p = taken;
	return x & ~rest;
}

/* Rotate an m-bit mask right by `start` (< m <= 16): bit `start` becomes bit 0. */
static inline uint32_t rotate_right(uint32_t x, uint32_t start, uint32_t m)
{
	return ((x >> start) | (x << (m - start))) & ((UINT32_C(1) << m) - 1);
}

/* The count-aware remainder (docs/algorithms.md §2.1) over m eligible indices: which `rem` of the
 * candidates get one extra record. Walking the indices in rotation order from `start`, the first
 * pass takes candidates above their base quota, the second the remaining candidates, until rem is
 * spent. With the masks rotated so that `start` is bit 0, "the first n in rotation order" is "the
 * lowest n set bits": no per-rail branches. Returns the winners' mask (index space). */
static uint32_t remainder_winners(uint32_t above, uint32_t other, uint32_t rem, uint32_t start,
				  uint32_t m)
{
	uint32_t taken, taken_other;
	uint32_t win = lowest_bits(rotate_right(above, start, m), rem, &taken);
	win |= lowest_bits(rotate_right(other, start, m), rem - taken, &taken_other);
	return rotate_right(win, (m - start) % m, m); /* back: rotate left by start */
}

/* Quotas (docs/algorithms.md §2.1) into quota[0..R) for a pair of T = total > 0 records, any rail
 * set. Base quota floor(T w_r / W) (floor(T / |S|) with equal weights), masked rails 0, then the
 * count-aware rotated remainder (remainder_winners) over the candidates: rails whose exact share T
 * w_r / W is not an integer (so every quota stays strictly within one of its share; with equal
 * weights every eligible rail whenever there is a remainder). */
static void compute_quotas(const rw_rail_set_t *set, const uint32_t *count, uint64_t total,
			   uint32_t rotation, uint32_t *quota)
{
	const uint32_t m = set->m;
	uint32_t candidate = 0, above = 0;
	uint64_t given = 0;

	for (uint32_t r = 0; r < set->rails; r++)
		quota[r] = 0;
	for (uint32_t k = 0; k < m; k++) {
		const uint32_t r = set->eligible[k];
		uint32_t q;
		if (set->equal) {
			q = (uint32_t)total / m; /* total < 2^32 */
			candidate |= UINT32_C(1) << k;
		} else {
			/* total < 2^32 and w <= RW_MAX_RAIL_WEIGHT (2^24): fits 64 bits. */
			const uint64_t share = total * set->rail_weight[r];
			q = (uint32_t)(share / set->weight_sum);
			candidate |= (uint32_t)(share % set->weight_sum != 0) << k;
		}
		quota[r] = q;
		given += q;
		above |= (uint32_t)(count[r] > q) << k;
	}
	/* rem < number of candidates: the fractional parts (each < 1, non-zero exactly for the
	 * candidates) sum to rem. */
	const uint32_t rem = (uint32_t)(total - given);
	if (rem == 0)
		return;
	above &= candidate;
	const uint32_t win = remainder_winners(above, candidate & ~above, rem, rotation % m, m);
	for (uint32_t k = 0; k < m; k++)
		quota[set->eligible[k]] += (win >> k) & 1;
}

/* Fill the plan: quota[r] from `quota`, or, when quota is NULL, base + bit r of `extra`; then
 * count, the prefixes and `moved`. One pass over the rails, no per-rail branches. */
static inline __attribute__((always_inline)) void fill_plan(uint32_t rails, const uint32_t *count,
							    uint64_t total, const uint32_t *quota,
							    uint32_t base, uint32_t extra,
							    rw_pair_plan_t *plan)
{
	uint32_t sur = 0, def = 0;
	plan->rails = rails;
	plan->total = (uint32_t)total;
	for (uint32_t r = 0; r < rails; r++) {
		const uint32_t c = count[r], q = quota ? quota[r] : base + ((extra >> r) & 1);
		const uint32_t over = -(uint32_t)(c > q); /* all ones when c > q */
		plan->count[r] = c;
		plan->quota[r] = q;
		plan->surplus_prefix[r] = sur;
		plan->deficit_prefix[r] = def;
		sur += (c - q) & over;
		def += (q - c) & ~over; /* 0 when c == q */
	}
	for (uint32_t r = rails; r < RW_MAX_RAILS; r++) {
		plan->count[r] = 0;
		plan->quota[r] = 0;
	}
	for (uint32_t r = rails; r <= RW_MAX_RAILS; r++) {
		plan->surplus_prefix[r] = sur;
		plan->deficit_prefix[r] = def;
	}
	plan->moved = sur; /* == def: both sum to T */
}

/* The plan of a pair without records: everything zero. */
static void empty_plan(uint32_t rails, rw_pair_plan_t *plan)
{
	memset(plan, 0, sizeof(*plan));
	plan->rails = rails;
}

/* Every rail eligible, equal weights (the common case): index space is rail space and every
 * rail is a candidate. Same rule as compute_quotas, fewer passes. */
static inline __attribute__((always_inline)) void balance_plain(uint32_t rails,
								const uint32_t *count,
								uint64_t total, uint32_t rotation,
								rw_pair_plan_t *plan)
{
	const uint32_t base = (uint32_t)total / rails, rem = (uint32_t)total - base * rails;
	uint32_t win = 0;
	if (rem) {
		uint32_t above = 0;
		for (uint32_t r = 0; r < rails; r++)
			above |= (uint32_t)(count[r] > base) << r;
		win = remainder_winners(above, ~above & ((UINT32_C(1) << rails) - 1), rem,
					rotation % rails, rails);
	}
	fill_plan(rails, count, total, NULL, base, win, plan);
}

/* R = 8, the usual shape, with the rail count a constant: the divisions become shifts and the
 * tails straight stores (about 10% less per pair; docs/perf/sched-decision.md). */
static void balance_plain_8(const uint32_t *count, uint64_t total, uint32_t rotation,
			    rw_pair_plan_t *plan)
{
	balance_plain(8, count, total, rotation, plan);
}

void rw_sched_balance_set(const rw_rail_set_t *set, const uint32_t *count, uint32_t rotation,
			  rw_pair_plan_t *plan)
{
	const uint32_t rails = set->rails;
	uint64_t total = 0;
	for (uint32_t r = 0; r < rails; r++)
		total += count[r];
	if (total == 0) {
		empty_plan(rails, plan);
		return;
	}
	if (set->plain) {
		if (rails == 8)
			balance_plain_8(count, total, rotation, plan);
		else
			balance_plain(rails, count, total, rotation, plan);
		return;
	}
	uint32_t quota[RW_MAX_RAILS];
	if (set->m == 0) /* no eligible rail (topo_check rejects this): keep native */
		memcpy(quota, count, rails * sizeof(*count));
	else
		compute_quotas(set, count, total, rotation, quota);
	fill_plan(rails, count, total, quota, 0, 0, plan);
}

void rw_sched_balance(const rw_topo_t *topo, const uint32_t *count, uint32_t rotation,
		      rw_pair_plan_t *plan)
{
	rw_rail_set_t set;
	rw_sched_rail_set(topo, &set);
	rw_sched_balance_set(&set, count, rotation, plan);
}

void rw_sched_balance_native_set(const rw_rail_set_t *set, const uint32_t *count,
				 uint32_t rotation, rw_pair_plan_t *plan)
{
	const uint32_t rails = set->rails;
	uint64_t total = 0, stranded = 0;
	for (uint32_t r = 0; r < rails; r++)
		total += count[r];
	for (uint32_t k = 0, r = 0; r < rails; r++) { /* records of rails outside the set */
		if (k < set->m && set->eligible[k] == r)
			k++;
		else
			stranded += count[r];
	}
	if (stranded == 0 || set->m == 0) {
		empty_plan(rails, plan); /* quota = count: no surplus, no deficit, prefixes zero */
		for (uint32_t r = 0; r < rails; r++) {
			plan->count[r] = count[r];
			plan->quota[r] = count[r];
		}
		plan->total = (uint32_t)total;
		return;
	}
	/* docs/algorithms.md §2.5: the eligible rails keep their records and share the stranded
	 * ones by the weighted rule (no rail is "above" a share of records it does not own). */
	static const uint32_t none[RW_MAX_RAILS];
	uint32_t quota[RW_MAX_RAILS];
	compute_quotas(set, none, stranded, rotation, quota);
	for (uint32_t k = 0; k < set->m; k++)
		quota[set->eligible[k]] += count[set->eligible[k]];
	fill_plan(rails, count, total, quota, 0, 0, plan);
}

void rw_sched_balance_native(const rw_topo_t *topo, const uint32_t *count, rw_pair_plan_t *plan)
{
	rw_rail_set_t set;
	rw_sched_rail_set(topo, &set);
	rw_sched_balance_native_set(&set, count, 0, plan);
}

/* The rail i with prefix[i] <= j < prefix[i + 1], for j < prefix[rails]: the last i whose
 * prefix is <= j (rails with an empty range share their prefix with the next one). */
static inline uint32_t find_range(const uint32_t *prefix, uint32_t rails, uint32_t j)
{
	uint32_t lo = 0, hi = rails - 1;
	while (lo < hi) {
		uint32_t mid = (lo + hi + 1) / 2;
		if (prefix[mid] <= j)
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

void rw_sched_map(const rw_pair_plan_t *plan, uint32_t owner_rail, uint32_t ordinal,
		  uint32_t *egress_rail_p, uint32_t *slot_p)
{
	uint32_t quota = plan->quota[owner_rail];
	if (ordinal < quota) { /* kept: ordinal < min(count, quota) */
		*egress_rail_p = owner_rail;
		*slot_p = ordinal;
		return;
	}
	/* The (ordinal - quota)-th surplus record of this rail is global surplus j, which fills
	 * global deficit slot j: the deficit rail keeps its own count records, then takes these. */
	uint32_t j = plan->surplus_prefix[owner_rail] + (ordinal - quota);
	uint32_t e = find_range(plan->deficit_prefix, plan->rails, j);
	*egress_rail_p = e;
	*slot_p = plan->count[e] + (j - plan->deficit_prefix[e]);
}

void rw_sched_unmap(const rw_pair_plan_t *plan, uint32_t egress_rail, uint32_t slot,
		    uint32_t *owner_rail_p, uint32_t *ordinal_p)
{
	uint32_t count = plan->count[egress_rail];
	if (slot < count) { /* kept: slot < min(count, quota) */
		*owner_rail_p = egress_rail;
		*ordinal_p = slot;
		return;
	}
	uint32_t j = plan->deficit_prefix[egress_rail] + (slot - count);
	uint32_t o = find_range(plan->surplus_prefix, plan->rails, j);
	*owner_rail_p = o;
	*ordinal_p = plan->quota[o] + (j - plan->surplus_prefix[o]);
}

void rw_sched_map_rail(const rw_pair_plan_t *plan, uint32_t owner_rail, uint8_t *egress,
		       uint32_t *slot)
{
	uint32_t count = plan->count[owner_rail];
	uint32_t kept = RW_MIN(count, plan->quota[owner_rail]);
	memset(egress, (int)owner_rail, kept);
	for (uint32_t i = 0; i < kept; i++)
		slot[i] = i;
	if (kept == count)
		return;
	/* Surplus records walk the deficit slots in order: find the first deficit rail once,
	 * then hand out consecutive runs. */
	uint32_t j = plan->surplus_prefix[owner_rail];
	uint32_t e = find_range(plan->deficit_prefix, plan->rails, j);
	uint32_t i = kept;
	while (i < count) {
		uint32_t room = plan->deficit_prefix[e + 1] - j;
		uint32_t n = RW_MIN(count - i, room);
		uint32_t first = plan->count[e] + (j - plan->deficit_prefix[e]);
		memset(egress + i, (int)e, n);
		for (uint32_t k = 0; k < n; k++)
			slot[i + k] = first + k;
		i += n;
		j += n;
		e++;
	}
}
