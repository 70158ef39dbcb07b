/* RailBalance (DESIGN §4.2; docs/algorithms.md §2): per (source, destination) pair, quotas that
 * differ by at most one record (or follow rail weights), a count-aware rotated remainder that
 * moves the fewest records, and the owner -> proxy map that surplus -> deficit matching by prefix
 * sums defines, with its inverse. Pure, O(R) per pair, O(log R) per mapped record. */
#include <string.h>

#include "sched/sched.h"

/* Quotas of §4.2 into quota[0..R) (masked rails get 0). Returns T. Base quota floor(T w_r / W)
 * (floor(T / |S|) with equal weights); count-aware remainder: the eligible rails are walked in
 * rotation order (starting at eligible index rotation % |S|); the first pass gives the extra
 * record to candidate rails whose native count exceeds their base quota (each such +1 saves one
 * move), the second to the remaining candidates, until the remainder is spent. */
static uint64_t compute_quotas(const rw_topo_t *topo, const uint32_t *count, uint32_t rotation,
			       uint32_t *quota)
{
	const uint32_t rails = topo->rails;
	uint32_t eligible[RW_MAX_RAILS];
	uint32_t m = 0;
	uint64_t total = 0, weight_sum = 0;
	int equal = 1;

	for (uint32_t r = 0; r < rails; r++) {
		total += count[r];
		quota[r] = 0;
		uint32_t w = topo->rail_weight[r];
		if (w == 0)
			continue;
		if (m > 0 && w != topo->rail_weight[eligible[0]])
			equal = 0;
		eligible[m++] = r;
		weight_sum += w;
	}
	if (m == 0) { /* no eligible rail (topo_check rejects this): keep records native */
		memcpy(quota, count, rails * sizeof(*quota));
		return total;
	}

	/* Candidates for the remainder, one bit per eligible index: rails whose exact share
	 * T w_r / W is not an integer (so every quota stays strictly within one of its share).
	 * With equal weights that is every rail whenever there is a remainder. */
	uint32_t candidate = 0;
	uint64_t given = 0;
	if (equal) {
		uint32_t base = (uint32_t)(total / m);
		for (uint32_t i = 0; i < m; i++)
			quota[eligible[i]] = base;
		given = (uint64_t)base * m;
		candidate = (UINT32_C(1) << m) - 1; /* m <= RW_MAX_RAILS < 32 */
	} else {
		/* total < 2^32 and w <= RW_MAX_RAIL_WEIGHT (2^24): the product fits 64 bits. */
		for (uint32_t i = 0; i < m; i++) {
			uint64_t share = total * topo->rail_weight[eligible[i]];
			quota[eligible[i]] = (uint32_t)(share / weight_sum);
			given += quota[eligible[i]];
			if (share % weight_sum)
				candidate |= UINT32_C(1) << i;
		}
	}

	/* rem < number of candidates: the fractional parts (each < 1, non-zero exactly for the
	 * candidates) sum to rem. */
	uint32_t rem = (uint32_t)(total - given);
	if (rem == 0)
		return total;
	uint32_t start = rotation % m;
	for (uint32_t i = 0, k = start; i < m && rem > 0; i++, k = (k + 1 == m) ? 0 : k + 1) {
		uint32_t r = eligible[k];
		if ((candidate & (UINT32_C(1) << k)) && count[r] > quota[r]) {
			quota[r]++;
			candidate &= ~(UINT32_C(1) << k); /* at most one extra per rail */
			rem--;
		}
	}
	for (uint32_t i = 0, k = start; i < m && rem > 0; i++, k = (k + 1 == m) ? 0 : k + 1) {
		if (!(candidate & (UINT32_C(1) << k)))
			continue;
		quota[eligible[k]]++;
		rem--;
	}
	return total;
}

/* Fill count, the prefixes and `moved` once quota is set. */
static void finish_plan(uint32_t rails, const uint32_t *count, uint64_t total,
			rw_pair_plan_t *plan)
{
	uint32_t sur = 0, def = 0;
	plan->rails = rails;
	plan->total = (uint32_t)total;
	for (uint32_t r = 0; r < rails; r++) {
		uint32_t c = count[r], q = plan->quota[r];
		plan->count[r] = c;
		plan->surplus_prefix[r] = sur;
		plan->deficit_prefix[r] = def;
		sur += c > q ? c - q : 0;
		def += q > c ? q - c : 0;
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

void rw_sched_balance(const rw_topo_t *topo, const uint32_t *count, uint32_t rotation,
		      rw_pair_plan_t *plan)
{
	uint64_t total = compute_quotas(topo, count, rotation, plan->quota);
	finish_plan(topo->rails, count, total, plan);
}

void rw_sched_balance_native(const rw_topo_t *topo, const uint32_t *count, rw_pair_plan_t *plan)
{
	uint64_t total = 0;
	for (uint32_t r = 0; r < topo->rails; r++) {
		plan->quota[r] = count[r];
		total += count[r];
	}
	finish_plan(topo->rails, count, total, plan);
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
