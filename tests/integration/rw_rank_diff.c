/* rw_rank's diagnostic of a dispatch that delivered the wrong set of rows
 * (tests/integration/rw_rank_diff.h). */
#include <stdio.h>
#include <string.h>

#include "tests/integration/rw_rank_diff.h"

void rw_rank_dispatch_diff(const rw_rank_diff_t *dc, const rw_cqe_t *cq, const uint8_t *out,
			   uint64_t out_cap, int bf16)
{
	const uint32_t me = dc->me, world = dc->world, per_rank = dc->per_rank, hidden = dc->hidden;
	const uint32_t experts = dc->experts, MAX_ROWS = dc->max_rows;
	const rw_wl_work_t *all = dc->all;
	uint8_t *seen = dc->seen;
	const uint32_t row = hidden * (bf16 ? 2 : 4);
	const uint64_t cbytes = experts > RW_CQE_INLINE_COUNTS ? ((4ull * experts + 15) & ~15ull) : 0;
	const uint64_t meta_bytes = 16 + 8 * RW_WL_TOPK;
	const uint64_t cap = (out_cap - cbytes) / (row + meta_bytes);
	const uint8_t *metas = out + cbytes + cap * row;
	unsigned said = 0;
	memset(seen, 0, (size_t)world * MAX_ROWS);
	for (uint32_t j = 0; j < cq->recv_tokens && j < cap; j++) {
		const uint8_t *m = metas + j * meta_bytes;
		uint32_t src_node, src_rank, token;
		int32_t ids[RW_WL_TOPK];
		memcpy(&src_node, m, 4);
		memcpy(&src_rank, m + 4, 4);
		memcpy(&token, m + 8, 4);
		memcpy(ids, m + 16, sizeof(ids));
		int mine_row = 0, known = src_rank < world && token < all[src_rank].n;
		for (uint32_t k = 0; known && k < RW_WL_TOPK; k++)
			mine_row |= all[src_rank].ids[token][k] >= 0 &&
				    (uint32_t)all[src_rank].ids[token][k] / per_rank == me;
		if (known && !seen[src_rank * MAX_ROWS + token] && mine_row) {
			seen[src_rank * MAX_ROWS + token] = 1;
			continue;
		}
		if (said++ < 24) {
			fprintf(stderr, "rank %u: diff: extra row %u from node %u rank %u token %u, ids",
				me, j, src_node, src_rank, token);
			for (uint32_t k = 0; k < RW_WL_TOPK; k++)
				fprintf(stderr, " %d", ids[k]);
			if (known) {
				fprintf(stderr, ", workload ids");
				for (uint32_t k = 0; k < RW_WL_TOPK; k++)
					fprintf(stderr, " %d", all[src_rank].ids[token][k]);
			}
			fprintf(stderr, "%s\n", known ? (seen[src_rank * MAX_ROWS + token] ? " (twice)" : "")
						       : " (no such token)");
		}
	}
	unsigned missing = 0;
	for (uint32_t q = 0; q < world; q++)
		for (uint32_t t = 0; t < all[q].n; t++) {
			int hit = 0;
			for (uint32_t k = 0; k < RW_WL_TOPK; k++)
				hit |= all[q].ids[t][k] >= 0 && (uint32_t)all[q].ids[t][k] / per_rank == me;
			if (!hit || seen[q * MAX_ROWS + t])
				continue;
			if (missing++ < 24) {
				fprintf(stderr, "rank %u: diff: missing rank %u token %u, ids", me, q, t);
				for (uint32_t k = 0; k < RW_WL_TOPK; k++)
					fprintf(stderr, " %d", all[q].ids[t][k]);
				fputc('\n', stderr);
			}
		}
	fprintf(stderr, "rank %u: diff: %u rows received, %u unexpected, %u missing\n", me,
		cq->recv_tokens, said, missing);
}

