/* A FAST-style Birkhoff-von Neumann wave planner, kept only as a baseline for comparison with
 * RailBalance + permutation waves (docs/selector.md, docs/perf/plan.md). It needs the whole
 * N x N demand and is rebuilt for every phase; correct and reasonably implemented, not tuned.
 *
 * 1. Pad: L = max(row sum, column sum). While some row and some column are below L, add
 *    min(row deficit, column deficit) to the entry of the row with the smallest sum and the
 *    column with the smallest sum (off the diagonal when another deficit column exists). Every
 *    row and column then sums to L; the padding is remembered per entry.
 * 2. Decompose: a matrix with equal line sums always has a perfect matching on its positive
 *    entries (Hall / Koenig). Take one, weight = its smallest entry, subtract, repeat. Each stage
 *    zeroes at least one entry, so there are at most N^2 stages. The matching is kept between
 *    stages: only the edges that reached zero are dropped and re-augmented (BFS augmenting
 *    paths on the dense support), so a stage costs O(N^2) instead of a fresh matching.
 * 3. Output: a stage entry s -> d sends real traffic first; once (s, d)'s real demand is
 *    exhausted the entry is pure padding and is written as perm = N (idle), as is every s -> s
 *    entry (padding only). Stages in which every entry is idle are dropped.
 * So for every real entry the weights of the stages that name it sum to >= its demand, and to
 * exactly its demand when no padding was added to that entry. */
#include <string.h>

#include "sched/sched.h"

/* Workspace layout (all slices of the caller's buffer, uint64_t first for alignment). */
typedef struct bvn_ws {
	uint64_t *real;     /* [N*N] remaining real demand */
	uint64_t *pad;      /* [N*N] remaining padding */
	uint64_t *row_sum;  /* [N] */
	uint64_t *col_sum;  /* [N] */
	uint32_t *match_l;  /* [N] row s -> column, or N if unmatched */
	uint32_t *match_r;  /* [N] column d -> row, or N */
	uint32_t *parent;   /* [N] BFS: column -> row it was reached from */
	uint32_t *queue;    /* [N] BFS queue of rows */
	uint32_t *seen;     /* [N] BFS visit stamp per column */
} bvn_ws_t;

size_t rw_sched_bvn_workspace(uint32_t nodes)
{
	size_t n = nodes;
	return (2 * n * n + 2 * n) * sizeof(uint64_t) + 5 * n * sizeof(uint32_t);
}

static void ws_split(uint32_t nodes, void *workspace, bvn_ws_t *ws)
{
	size_t n = nodes;
	uint64_t *u64 = workspace;
	ws->real = u64;
	ws->pad = u64 + n * n;
	ws->row_sum = u64 + 2 * n * n;
	ws->col_sum = ws->row_sum + n;
	uint32_t *u32 = (uint32_t *)(ws->col_sum + n);
	ws->match_l = u32;
	ws->match_r = u32 + n;
	ws->parent = u32 + 2 * n;
	ws->queue = u32 + 3 * n;
	ws->seen = u32 + 4 * n;
}

/* Index of the smallest sum below L, preferring any index != avoid; n when none is below L. */
static uint32_t smallest_below(const uint64_t *sum, uint32_t n, uint64_t L, uint32_t avoid)
{
	uint32_t best = n;
	for (uint32_t i = 0; i < n; i++) {
		if (sum[i] >= L || i == avoid)
			continue;
		if (best == n || sum[i] < sum[best])
			best = i;
	}
	if (best == n && avoid < n && sum[avoid] < L)
		best = avoid;
	return best;
}

static void pad_matrix(uint32_t n, bvn_ws_t *ws)
{
	uint64_t L = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (ws->row_sum[i] > L)
			L = ws->row_sum[i];
		if (ws->col_sum[i] > L)
			L = ws->col_sum[i];
	}
	/* Each step fills a row or a column to L: at most 2N steps. */
	for (;;) {
		uint32_t s = smallest_below(ws->row_sum, n, L, n);
		if (s == n)
			break; /* rows full; the column sums equal the row sums in total, so full too */
		uint32_t d = smallest_below(ws->col_sum, n, L, s);
		uint64_t row_def = L - ws->row_sum[s], col_def = L - ws->col_sum[d];
		uint64_t add = row_def < col_def ? row_def : col_def;
		ws->pad[(size_t)s * n + d] += add;
		ws->row_sum[s] += add;
		ws->col_sum[d] += add;
	}
}

static inline uint64_t residual(const bvn_ws_t *ws, uint32_t n, uint32_t s, uint32_t d)
{
	size_t i = (size_t)s * n + d;
	return ws->real[i] + ws->pad[i];
}

/* Find an augmenting path from free row `root` over positive entries (BFS) and flip it.
 * stamp distinguishes this search's visits. Returns 1 when the row got matched. */
static int augment(uint32_t n, bvn_ws_t *ws, uint32_t root, uint32_t stamp)
{
	uint32_t head = 0, tail = 0;
	ws->queue[tail++] = root;
	while (head < tail) {
		uint32_t s = ws->queue[head++];
		for (uint32_t d = 0; d < n; d++) {
			if (ws->seen[d] == stamp || residual(ws, n, s, d) == 0)
				continue;
			ws->seen[d] = stamp;
			ws->parent[d] = s;
			if (ws->match_r[d] == n) {
				/* Flip the path back to the root. */
				while (d != n) {
					uint32_t row = ws->parent[d];
					uint32_t next = ws->match_l[row];
					ws->match_l[row] = d;
					ws->match_r[d] = row;
					d = next;
				}
				return 1;
			}
			ws->queue[tail++] = ws->match_r[d];
		}
	}
	return 0;
}

uint32_t rw_sched_bvn_plan(uint32_t nodes, const uint64_t *demand, uint32_t max_stages,
			   uint32_t *perm, uint64_t *weight, void *workspace)
{
	const uint32_t n = nodes;
	bvn_ws_t ws;
	uint32_t stages = 0, stamp = 0;

	if (n == 0)
		return 0;
	ws_split(n, workspace, &ws);
	memset(ws.row_sum, 0, 2 * (size_t)n * sizeof(uint64_t));
	memset(ws.pad, 0, (size_t)n * n * sizeof(uint64_t));
	uint64_t total_real = 0;
	for (uint32_t s = 0; s < n; s++) {
		for (uint32_t d = 0; d < n; d++) {
			uint64_t v = s == d ? 0 : demand[(size_t)s * n + d];
			ws.real[(size_t)s * n + d] = v;
			ws.row_sum[s] += v;
			ws.col_sum[d] += v;
			total_real += v;
		}
	}
	if (total_real == 0)
		return 0;
	pad_matrix(n, &ws);
	uint64_t remaining = ws.row_sum[0]; /* every row (and column) still sums to this */

	for (uint32_t i = 0; i < n; i++) {
		ws.match_l[i] = n;
		ws.match_r[i] = n;
		ws.seen[i] = 0;
	}
	while (remaining > 0) {
		/* Complete the matching. The line sums stay equal (each stage takes the same weight
		 * from every row and column), so a perfect matching exists while anything remains. */
		for (uint32_t s = 0; s < n; s++) {
			if (ws.match_l[s] != n)
				continue;
			if (++stamp == 0) { /* wrapped: reset the visit stamps */
				memset(ws.seen, 0, (size_t)n * sizeof(uint32_t));
				stamp = 1;
			}
			if (!augment(n, &ws, s, stamp))
				return 0; /* cannot happen with equal line sums */
		}

		uint64_t w = UINT64_MAX;
		for (uint32_t s = 0; s < n; s++) {
			uint64_t r = residual(&ws, n, s, ws.match_l[s]);
			if (r < w)
				w = r;
		}
		int sends = 0;
		uint32_t *row = perm + (size_t)stages * n;
		if (stages < max_stages) {
			for (uint32_t s = 0; s < n; s++) {
				uint32_t d = ws.match_l[s];
				row[s] = (s != d && ws.real[(size_t)s * n + d] > 0) ? d : n;
				sends |= row[s] != n;
			}
		} else {
			for (uint32_t s = 0; s < n && !sends; s++)
				sends = s != ws.match_l[s] && ws.real[(size_t)s * n + ws.match_l[s]] > 0;
			if (sends)
				return 0; /* a stage with real traffic does not fit */
		}
		if (sends)
			weight[stages++] = w;
		remaining -= w;
		/* Subtract: real traffic first, then padding; drop edges that reached zero. */
		for (uint32_t s = 0; s < n; s++) {
			uint32_t d = ws.match_l[s];
			size_t i = (size_t)s * n + d;
			uint64_t take = ws.real[i] < w ? ws.real[i] : w;
			ws.real[i] -= take;
			ws.pad[i] -= w - take;
			if (ws.real[i] + ws.pad[i] == 0) {
				ws.match_l[s] = n;
				ws.match_r[d] = n;
			}
		}
	}
	return stages;
}
