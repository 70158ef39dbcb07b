/* rw_rank's diagnostic of a wrong dispatch (tests/integration/rw_rank.c, rw_rank_diff.c); the
 * workload is tests/lib/workload.h's. */
#ifndef RW_TEST_RW_RANK_DIFF_H
#define RW_TEST_RW_RANK_DIFF_H

#include <stdint.h>

#include "ipc/railwave.h"
#include "tests/lib/workload.h"

/* What the diagnostic needs of the rank: who it is, the geometry, every rank's workload of the
 * phase (all[world]) and a scratch of world * max_rows bytes. */
typedef struct rw_rank_diff {
	uint32_t me, world, per_rank, hidden, experts, max_rows;
	const rw_wl_work_t *all;
	uint8_t *seen;
} rw_rank_diff_t;

/* A dispatch that delivered the wrong set of rows: which rows came that should not have (with
 * the ids their metadata carries and the ids the workload gives that token) and which are
 * missing, on stderr before the check fails (bring-up of failures seen only on a real GPU). */
void rw_rank_dispatch_diff(const rw_rank_diff_t *dc, const rw_cqe_t *cq, const uint8_t *out,
			   uint64_t out_cap, int bf16);

#endif /* RW_TEST_RW_RANK_DIFF_H */
