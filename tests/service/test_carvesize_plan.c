/* tests/service/test_carvesize_plan.c: a group carve-out's arithmetic (service/phase/phase_carve.c)
 * over many random geometries: the split into four record areas and the local area, the local
 * area's layout (local records, the combine's local copies, each rank's staging on its native
 * rail) against a brute-force sum of its parts, and `railwave size`'s answer being the smallest
 * that holds the largest phase. RW_TEST_SEED repeats a run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include <cmocka.h>

#include "service/phase/phase.h"

#define MIB (UINT64_C(1) << 20)

static uint64_t rng;
static uint64_t next_u64(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}
static uint64_t pick(uint64_t lo, uint64_t hi) { return lo + next_u64() % (hi - lo + 1); }
static uint64_t line_up(uint64_t x) { return (x + 63) / 64 * 64; }

static int seeded(void **state)
{
	(void)state;
	const char *seed = getenv("RW_TEST_SEED");
	rng = seed ? strtoull(seed, NULL, 0) | 1 : ((uint64_t)time(NULL) << 1) | 1;
	print_message("seed 0x%llx (RW_TEST_SEED repeats it)\n", (unsigned long long)rng);
	return 0;
}

/* The four record areas and the local area: inside the carve-out, 64-byte aligned, the local
 * area at least what was asked; no local asked: five equal areas. */
static void test_split(void **state)
{
	(void)state;
	for (int it = 0; it < 100000; it++) {
		const uint64_t carve = pick(1, 65536) * MIB;
		const uint64_t local = next_u64() % 2 ? pick(1, carve / MIB - 1 + (carve == MIB)) * MIB : 0;
		const uint64_t sub = rw_svc_carve_sub(carve, local);
		assert_int_equal(sub % 64, 0);
		if (local >= carve) {
			assert_int_equal(sub, 0);
			continue;
		}
		assert_true(4 * sub + local <= carve);
		if (!local)
			assert_int_equal(sub, (carve / 5) & ~(uint64_t)63);
		else
			assert_true(4 * (sub + 64) + local > carve); /* the record areas take the rest */
	}
}

/* The local area of every rail: its parts in order, disjoint, aligned, each rank's staging on
 * its native rail with its rows' room, and the area's end the sum of its parts. */
static void test_local_plan(void **state)
{
	(void)state;
	for (int it = 0; it < 20000; it++) {
		const uint32_t R = (uint32_t)pick(1, 8), G = (uint32_t)pick(1, RW_MAX_GPUS);
		uint8_t gpu_rail[RW_MAX_GPUS];
		uint32_t local_n[RW_MAX_RAILS] = { 0 };
		for (uint32_t g = 0; g < G; g++)
			gpu_rail[g] = (uint8_t)(next_u64() % 3 ? g % R : pick(0, R - 1));
		for (uint32_t r = 0; r < R; r++)
			local_n[r] = (uint32_t)pick(0, 5000);
		const uint64_t rec = pick(24, 70000), crec = pick(16, 70000), row = pick(2, 65536);
		const uint64_t rows = pick(0, 100000);
		rw_svc_local_plan_t lp;
		rw_svc_local_plan(R, G, gpu_rail, rec, crec, row, rows, local_n, &lp);
		for (uint32_t r = 0; r < R; r++) {
			uint32_t ranks = 0;
			for (uint32_t g = 0; g < G; g++)
				ranks += gpu_rail[g] == r;
			assert_int_equal(lp.comb_off[r], line_up(local_n[r] * rec));
			const uint64_t stage0 = lp.comb_off[r] + line_up((uint64_t)G * local_n[r] * crec);
			assert_int_equal(lp.end[r], stage0 + ranks * line_up(rows * row));
			uint64_t prev = stage0; /* the rail's ranks in rank order, back to back */
			for (uint32_t g = 0; g < G; g++) {
				if (gpu_rail[g] != r)
					continue;
				assert_int_equal(lp.stage_at[g] % 64, 0);
				assert_int_equal(lp.stage_at[g], prev);
				prev = lp.stage_at[g] + line_up(rows * row);
				assert_true(prev <= lp.end[r]);
			}
			assert_int_equal(prev, lp.end[r]);
		}
	}
}

/* `railwave size`: the printed sizes hold the largest phase, one MiB less of either does not;
 * the local area is its parts; a rank's max_recv bounds its staging, not the record areas. */
static void test_size_is_smallest(void **state)
{
	(void)state;
	for (int it = 0; it < 300; it++) {
		rw_topo_t topo;
		const uint32_t N = (uint32_t)pick(1, 16), G = (uint32_t)pick(1, 8);
		const uint32_t R = (uint32_t)pick(1, G);
		assert_int_equal(rw_sched_topo_init(&topo, N, G, R), RW_OK);
		const uint32_t hidden = (uint32_t)pick(1, 8192), topk = (uint32_t)pick(1, 8);
		const uint32_t tokens = (uint32_t)pick(1, 512);
		const uint32_t dtype = next_u64() % 2 ? RW_WIRE_BF16 : RW_WIRE_F32;
		const uint32_t max_recv = next_u64() % 2 ? (uint32_t)pick(1, (uint64_t)N * G * tokens) : 0;
		rw_svc_carve_need_t need;
		assert_int_equal(rw_svc_carve_size(&topo, topk, hidden, dtype, tokens, max_recv, 65536,
						   &need), RW_OK);
		const uint64_t world = (uint64_t)N * G * tokens;
		assert_int_equal(need.rank_rows, max_recv ? max_recv : world);
		assert_true(need.local_need > (uint64_t)(need.local_mib - 1) * MIB);
		assert_true(need.local_need <= (uint64_t)need.local_mib * MIB);
		if (!need.area_mib)
			continue;
		const uint64_t area = (uint64_t)need.area_mib * MIB, local = need.local_mib * MIB;
		assert_true(rw_svc_carve_fits(area, local, &need));
		assert_false(rw_svc_carve_fits(area - MIB, local, &need));
		if (need.local_mib > 1) /* (0 asks for five equal areas) */
			assert_false(rw_svc_carve_fits(area, local - MIB, &need));
		assert_true(rw_svc_carve_sub(area, local) >= need.sub_need);
		/* the local area's parts: its records, its copies, its ranks' staging */
		assert_true(need.local_need >= need.local_records + need.local_copies +
						       need.local_staging);
		assert_true(need.local_need < need.local_records + need.local_copies +
						      need.local_staging + 3 * 64);
		/* a smaller max_recv never needs more */
		rw_svc_carve_need_t less;
		assert_int_equal(rw_svc_carve_size(&topo, topk, hidden, dtype, tokens,
						   (uint32_t)RW_MAX(1, need.rank_rows / 2), 65536, &less),
				 RW_OK);
		assert_true(less.local_need <= need.local_need);
		assert_int_equal(less.sub_need, need.sub_need);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_split),
		cmocka_unit_test(test_local_plan),
		cmocka_unit_test(test_size_is_smallest),
	};
	return cmocka_run_group_tests(tests, seeded, NULL);
}
