/* RailWave scheduling core: topology, demand counts, RailBalance, permutation waves, the four
 * path plans, features, the anchor-table selector and a Birkhoff-von Neumann baseline.
 * Pure and deterministic: no I/O, no allocation except rw_sched_anchors_parse(); the caller owns
 * every buffer. Section numbers (§) refer to docs/algorithms.md, except where docs/selector.md
 * is named. */
#ifndef RW_SCHED_H
#define RW_SCHED_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

#define RW_MAX_RAILS 16
#define RW_MAX_GPUS 16
#define RW_MAX_NODES 4096
#define RW_MAX_TOPK 32

/* ---------------------------------------------------------------------------------------------
 * Topology (§0)
 * ------------------------------------------------------------------------------------------- */

typedef struct rw_topo {
	uint32_t nodes;                     /* N */
	uint32_t gpus_per_node;             /* G */
	uint32_t rails;                     /* R */
	uint8_t gpu_rail[RW_MAX_GPUS];      /* local GPU index -> native rail */
	/* Relative capacity of each rail (e.g. its Gbit/s). 0 = failed or masked: the rail is
	 * removed from the eligible set S and receives no quota. Equal weights = plain RailBalance. */
	uint32_t rail_weight[RW_MAX_RAILS];
	/* Optional per-pair rail weights (docs/algorithms.md §2.5, rail health): NULL, or
	 * pair_weight[(s * N + d) * R + r] = the weight of rail r for pair (s, d), 0 = rail r is not
	 * eligible for that pair (down at either end). When set, every pair plan (both ends, the
	 * busiest-NIC load and the lower bound) uses it instead of rail_weight; each entry must be
	 * <= RW_MAX_RAIL_WEIGHT. Caller-owned; the topology only points at it. A pair without any
	 * eligible rail keeps its records native. */
	const uint32_t *pair_weight;
} rw_topo_t;

/* Largest rail weight rw_sched_topo_check() accepts, so that T * w_r never overflows 64 bits
 * in the weighted quota of §2.1 (T < 2^32 records per pair). */
#define RW_MAX_RAIL_WEIGHT (1u << 24)

/* Fill a rail-optimized topology: GPU g -> rail g % R, every rail weight 1. */
rw_status_t rw_sched_topo_init(rw_topo_t *topo, uint32_t nodes, uint32_t gpus_per_node,
			       uint32_t rails);
/* Check ranges (N, G, R within limits; gpu_rail < R; weights <= RW_MAX_RAIL_WEIGHT; at least
 * one rail with weight > 0). */
rw_status_t rw_sched_topo_check(const rw_topo_t *topo);
/* Number of rails with weight > 0 (|S|). */
uint32_t rw_sched_topo_eligible(const rw_topo_t *topo);

/* ---------------------------------------------------------------------------------------------
 * Counts and records (§1)
 * ------------------------------------------------------------------------------------------- */

/* One local rank's routing decisions for a phase: top-k expert ids per token. */
typedef struct rw_rank_tokens {
	uint32_t local_gpu;       /* GPU index inside the node; its native rail is gpu_rail[] */
	uint32_t n_tokens;
	uint32_t topk;            /* <= RW_MAX_TOPK */
	const int32_t *expert_ids; /* n_tokens * topk, row-major; -1 = no expert (dropped slot) */
} rw_rank_tokens_t;

/* A record: one (token, remote destination node) pair after per-node de-duplication. */
typedef struct rw_record {
	uint32_t rank;  /* index into the rw_rank_tokens_t array given to the builder */
	uint32_t token; /* token index within that rank */
} rw_record_t;

/* Bytes one record occupies in a rail slab (docs/dataflow.md "Record formats"), for the tools
 * that size phases as the daemon does. A dispatch record: a 16-byte header, then top-k ids and
 * weights (4 + 4 bytes each), padded to 16 bytes, then the row padded to 16 bytes. A combine
 * record: a 16-byte header and the padded row. elem_bytes: 2 for bf16, 4 for fp32. */
static inline uint64_t rw_sched_rec_bytes(uint32_t topk, uint32_t hidden, uint32_t elem_bytes)
{
	return ((16u + (uint64_t)topk * 8u + 15u) & ~(uint64_t)15u) +
	       (((uint64_t)hidden * elem_bytes + 15u) & ~(uint64_t)15u);
}
static inline uint64_t rw_sched_crec_bytes(uint32_t hidden, uint32_t elem_bytes)
{
	return 16u + (((uint64_t)hidden * elem_bytes + 15u) & ~(uint64_t)15u);
}

/* Expert e lives on node e / (E / N) and global rank e / (E / W), W = N * G. E must be a
 * multiple of W. */
static inline uint32_t rw_sched_expert_node(uint32_t n_experts, uint32_t nodes, uint32_t e)
{
	return e / (n_experts / nodes);
}

/* Pass 1. row[d * R + r] = number of records from node `me` to node d whose native rail is r.
 * The d == me entries count local-node records (never rail balanced; they do not touch a NIC).
 * Errors: RW_ERR_INVAL when an expert id is >= n_experts, topk is out of range, or E is not a
 * multiple of W; *bad_rank_p (may be NULL) then names the offending rank index and the row is
 * left all zero. An id of -1 is a dropped slot and skipped; any other negative id is an error. */
rw_status_t rw_sched_count(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
			   const rw_rank_tokens_t *ranks, uint32_t n_ranks, uint32_t *row,
			   uint32_t *bad_rank_p);

/* The same two passes in slices, so a caller on an event loop can do other work between them
 * (a big submission must not starve heartbeats): each call handles at most `budget` tokens and
 * resumes where the last one stopped. Zero the iterator to start; *done_p = 1 once the pass is
 * complete. The results equal rw_sched_count's and rw_sched_records' (which are these with an
 * unlimited budget); the routing must not change between the calls. */
typedef struct rw_sched_count_iter {
	uint32_t rank, token;
} rw_sched_count_iter_t;
rw_status_t rw_sched_count_step(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
				const rw_rank_tokens_t *ranks, uint32_t n_ranks, uint32_t *row,
				rw_sched_count_iter_t *it, uint32_t budget, int *done_p,
				uint32_t *bad_rank_p);
typedef struct rw_sched_records_iter {
	uint32_t rail, rank, token;
	uint32_t cursor[RW_MAX_NODES]; /* next free index of segment (d, rail); last member */
} rw_sched_records_iter_t;

/* Pass 2. Fill records in CSR order: the records of (d, r) are rec[offset[d*R + r] ...] in
 * native order (ranks in array order, tokens ascending). offset is the exclusive prefix sum of
 * the row from pass 1 (offset has N*R + 1 entries; rw_sched_prefix() computes it).
 * rw_sched_records fails with RW_ERR_INVAL on the same inputs as rw_sched_count, and when the
 * routing no longer matches offset (a segment would overflow; nothing is written past it). */
void rw_sched_prefix(const uint32_t *row, uint32_t n, uint32_t *offset);
rw_status_t rw_sched_records(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
			     const rw_rank_tokens_t *ranks, uint32_t n_ranks,
			     const uint32_t *offset, rw_record_t *rec);
rw_status_t rw_sched_records_step(const rw_topo_t *topo, uint32_t n_experts, uint32_t me,
				  const rw_rank_tokens_t *ranks, uint32_t n_ranks,
				  const uint32_t *offset, rw_record_t *rec, rw_sched_records_iter_t *it,
				  uint32_t budget, int *done_p);

/* ---------------------------------------------------------------------------------------------
 * RailBalance (§2)
 * ------------------------------------------------------------------------------------------- */

/* The balance of one (source, destination) pair (or one slice of it). Records are identified by
 * (owner rail, ordinal) with ordinal < count[owner rail]. Rail r keeps its first
 * min(count[r], quota[r]) records at slots 0..; its surplus records, in order, fill the deficit
 * slots of the other rails in rail order (prefix sums, no atomics). */
typedef struct rw_pair_plan {
	uint32_t rails;
	uint32_t total;                          /* T = sum of count */
	uint32_t moved;                          /* records whose egress rail != owner rail */
	uint32_t count[RW_MAX_RAILS];            /* native records per rail */
	uint32_t quota[RW_MAX_RAILS];            /* egress records per rail */
	uint32_t surplus_prefix[RW_MAX_RAILS + 1]; /* exclusive prefix of max(0, count - quota) */
	uint32_t deficit_prefix[RW_MAX_RAILS + 1]; /* exclusive prefix of max(0, quota - count) */
} rw_pair_plan_t;

/* Compute quotas and the surplus/deficit prefixes for one pair. count has topo->rails entries
 * whose total T is below 2^32 (a peer's row is refused when its records reach 2^32:
 * rw_wire_counts_unpack).
 * rotation selects the deterministic remainder rotation (path plans pass
 * rw_sched_pair_rotation(s, d, slice); see docs/algorithms.md §2.1). Equal weights: quotas
 * differ by at most one; the remainder goes first to rails whose count exceeds the base quota
 * (move-minimal), then in rotation order. Weighted:
 * quota_r = floor(T * w_r / sum w) plus the same count-aware remainder rule, given only to rails
 * whose exact share is not an integer (so |quota_r - T w_r / sum w| < 1). */
void rw_sched_balance(const rw_topo_t *topo, const uint32_t *count, uint32_t rotation,
		      rw_pair_plan_t *plan);

/* Plan that keeps every record on its native rail (quota = count); with per-pair weights (see
 * rw_topo_t.pair_weight) through rw_sched_plan_pair, records whose native rail is not eligible
 * for the pair are spread over the eligible rails by the weighted rule (the rest stay native). */
void rw_sched_balance_native(const rw_topo_t *topo, const uint32_t *count, rw_pair_plan_t *plan);

/* Owner -> proxy: where record (owner_rail, ordinal) travels. O(log R). */
void rw_sched_map(const rw_pair_plan_t *plan, uint32_t owner_rail, uint32_t ordinal,
		  uint32_t *egress_rail_p, uint32_t *slot_p);

/* Proxy -> owner, the inverse of rw_sched_map (used by combine). O(log R). */
void rw_sched_unmap(const rw_pair_plan_t *plan, uint32_t egress_rail, uint32_t slot,
		    uint32_t *owner_rail_p, uint32_t *ordinal_p);

/* Bulk mapping of all records of one owner rail: egress[i], slot[i] for i < count[owner_rail].
 * Kept records are the identity; only surplus records are computed. */
void rw_sched_map_rail(const rw_pair_plan_t *plan, uint32_t owner_rail, uint8_t *egress,
		       uint32_t *slot);

/* ---------------------------------------------------------------------------------------------
 * Permutation waves and path plans (§3, §4)
 * ------------------------------------------------------------------------------------------- */

typedef enum rw_path {
	RW_PATH_NATIVE = 0,
	RW_PATH_RAIL_ONLY = 1,
	RW_PATH_PERM_ONLY = 2,
	RW_PATH_JOINT = 3,
	RW_PATH_COUNT = 4,
} rw_path_t;

const char *rw_sched_path_name(rw_path_t path); /* "native", "rail-only", "perm-only", "joint" */
/* Parse a path name as printed by rw_sched_path_name(); RW_ERR_INVAL otherwise. */
rw_status_t rw_sched_path_parse(const char *name, rw_path_t *path_p);

static inline int rw_path_balanced(rw_path_t p) { return p == RW_PATH_RAIL_ONLY || p == RW_PATH_JOINT; }
static inline int rw_path_waved(rw_path_t p) { return p == RW_PATH_PERM_ONLY || p == RW_PATH_JOINT; }

/* Wave k (1 <= k <= N-1): node s sends to (s + k) mod N and receives from (s - k) mod N. */
static inline uint32_t rw_sched_wave_dst(uint32_t nodes, uint32_t s, uint32_t k) { return (s + k) % nodes; }
static inline uint32_t rw_sched_wave_src(uint32_t nodes, uint32_t d, uint32_t k) { return (d + nodes - k) % nodes; }
/* Wave in which s sends to d (d != s): (d - s) mod N. Non-waved paths use wave 0 for everyone. */
static inline uint32_t rw_sched_wave_of(uint32_t nodes, uint32_t s, uint32_t d) { return (d + nodes - s) % nodes; }

/* One node's send plan for a phase: per destination, its wave and its pair plan.
 * `pairs` is caller-owned, N entries; pairs[me] is empty. Receivers build the same structures
 * for (s, me) from the exchanged counts, so both ends agree on every slot. */
typedef struct rw_phase_plan {
	rw_path_t path;
	uint32_t me;
	uint32_t nodes;
	uint32_t n_waves;        /* 1 for Native / Rail-only, N-1 for the waved paths */
	rw_pair_plan_t *pairs;   /* [N] */
	uint64_t egress[RW_MAX_RAILS]; /* records leaving `me` on each rail under this plan */
} rw_phase_plan_t;

/* Remainder rotation (docs/algorithms.md §2.1) of slice `slice` of pair (s, d): s + d + slice.
 * It varies over a source's destinations (spreading its egress remainders) and over a
 * destination's sources (spreading its ingress remainders). Both ends of a pair derive it from
 * (s, d) alone, so they agree without exchanging the plan. Use it (or rw_sched_plan_pair) wherever
 * a pair plan is rebuilt; a different rotation gives different slots. */
static inline uint32_t rw_sched_pair_rotation(uint32_t s, uint32_t d, uint32_t slice)
{
	return s + d + slice;
}

/* The plan of pair (s, d), slice 0, under `path`: RailBalance with rw_sched_pair_rotation(s, d, 0)
 * on the balanced paths, native otherwise; count = count[s][d][0..R). rw_sched_plan_build builds
 * the sender's pairs with it, so a receiver calling it for (s, me) agrees with sender s on every
 * slot. The topology must pass rw_sched_topo_check (not re-checked here). */
void rw_sched_plan_pair(const rw_topo_t *topo, rw_path_t path, uint32_t s, uint32_t d,
			const uint32_t *count, rw_pair_plan_t *pp);

/* counts is the full N x N x R matrix (counts[(s*N + d)*R + r]); plan->pairs must point to N
 * entries. Builds the pair plans for source `me` (slice 0). Reads only row me of the matrix, so
 * a node can build its send plan from its own row while the other rows are still arriving. */
rw_status_t rw_sched_plan_build(const rw_topo_t *topo, rw_path_t path, uint32_t me,
				const uint32_t *counts, rw_phase_plan_t *plan);

/* The receive side of the same phase: pairs[s] = the plan of (s, me) exactly as sender s builds
 * it (rw_sched_plan_pair), for every source; pairs[me] empty. pairs has N entries. Reads only
 * column me (count[s][me][*] for every s). Errors as rw_sched_plan_build. A daemon receiving the
 * rows one by one can instead call rw_sched_plan_pair(topo, path, s, me, ...) as row s arrives. */
rw_status_t rw_sched_plan_build_recv(const rw_topo_t *topo, rw_path_t path, uint32_t me,
				     const uint32_t *counts, rw_pair_plan_t *pairs);

/* Busiest NIC's records under `path` (max over every node's egress and ingress rails), and the
 * lower bound: the same under the best per-pair balance (RailBalance quotas). Multiply by the
 * record size and divide by the NIC rate for seconds (§4). */
uint64_t rw_sched_busiest_nic(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts);
uint64_t rw_sched_lower_bound(const rw_topo_t *topo, const uint32_t *counts);

/* ---------------------------------------------------------------------------------------------
 * Features (§5)
 * ------------------------------------------------------------------------------------------- */

typedef struct rw_features {
	uint64_t remote_bytes;   /* total inter-node bytes */
	double B;                /* remote bytes per GPU: remote_bytes / W */
	double rho_g;            /* max (node, rail) native egress / mean over all (node, rail) */
	double kappa;            /* max destination ingress / mean destination ingress */
	double f[3];             /* f0 = log2 B, f1 = min(1,(rho_g-1)/(R-1)), f2 = min(1,(kappa-1)/(N-1)) */
	uint32_t max_fan_in;     /* most source nodes with demand into one destination */
	double busiest_dst_rail_share; /* max over d of (busiest native ingress rail of d / ingress of d) */
} rw_features_t;

/* Features of the full count matrix with records of record_bytes each. Identical on every node
 * that holds the same counts (integer sums, then one division each). An invalid topology or a
 * NULL matrix gets the neutral answer (no remote payload). Reads the matrix once: O(N^2 R). */
void rw_sched_features(const rw_topo_t *topo, const uint32_t *counts, uint64_t record_bytes,
		       rw_features_t *feat);

/* The same features, built one source row at a time as the rows arrive (the daemon folds each
 * peer's row in during the count exchange; after the last row only an O(N R) finish remains).
 * The accumulator points into a caller-owned workspace of rw_sched_feat_workspace(N, R) bytes,
 * 8-byte aligned, that must outlive it; the fields are read-only for callers. Per phase:
 *   rw_sched_feat_begin(&acc, topo, ws, len);                   O(N R): clears the workspace
 *   rw_sched_feat_add_row(&acc, s, row_s);  for every s, any order, O(N R) each
 *   rw_sched_feat_finish(&acc, record_bytes, &feat);            O(N R)
 * row_s[d * R + r] = count[s][d][r] (rw_sched_count's row of node s; the diagonal d == s is
 * ignored). finish gives exactly rw_sched_features() of the assembled matrix, bit for bit,
 * whatever the row order. No allocation, no I/O. */
typedef struct rw_sched_feat_acc {
	uint32_t nodes, rails, gpus_per_node;
	uint32_t rows;          /* rows added so far */
	uint64_t total;         /* remote records in those rows */
	uint64_t max_egress;    /* largest (s, r) native egress among those rows */
	uint64_t *ingress;      /* [N * R]: sum over added s != d of count[s][d][r] */
	uint64_t *added;        /* [ceil(N / 64)]: bit s set once row s is in */
	uint32_t *fan_in;       /* [N]: added sources with demand into d */
} rw_sched_feat_acc_t;

size_t rw_sched_feat_workspace(uint32_t nodes, uint32_t rails);
/* RW_ERR_INVAL: topology fails rw_sched_topo_check, workspace NULL, misaligned or short. */
rw_status_t rw_sched_feat_begin(rw_sched_feat_acc_t *acc, const rw_topo_t *topo, void *workspace,
				size_t workspace_len);
/* RW_ERR_INVAL: s >= N, row NULL, acc not begun; RW_ERR_EXISTS: row s was already added (a
 * duplicate from a peer). On error the accumulator is unchanged. */
rw_status_t rw_sched_feat_add_row(rw_sched_feat_acc_t *acc, uint32_t s, const uint32_t *row);
/* RW_ERR_STATE until all N rows are in (feat untouched); RW_ERR_INVAL: acc not begun. The
 * accumulator is not consumed: finish may be called again (e.g. with another record size). */
rw_status_t rw_sched_feat_finish(const rw_sched_feat_acc_t *acc, uint64_t record_bytes,
				 rw_features_t *feat);

/* ---------------------------------------------------------------------------------------------
 * Anchor table and selector (docs/selector.md)
 * ------------------------------------------------------------------------------------------- */

#define RW_ANCHOR_SCHEMA 1

typedef struct rw_path_samples {
	double median, p10, p90; /* seconds */
	uint32_t n;
} rw_path_samples_t;

typedef struct rw_anchor {
	uint32_t case_id;
	double feat[3];
	rw_path_t selected;
	rw_path_samples_t samples[RW_PATH_COUNT];
} rw_anchor_t;

typedef struct rw_anchor_table {
	uint32_t schema_version;
	struct {
		uint32_t nodes, gpus_per_node, rails;
		double nic_gbps;
		char transport[16];
	} fingerprint;
	double max_size_ratio;  /* > 1 */
	double shape_tolerance; /* epsilon, >= 0 */
	uint32_t n_anchors;
	rw_anchor_t *anchors;   /* owned; freed by rw_sched_anchors_free() */
} rw_anchor_table_t;

/* Parse and validate an anchor table (JSON text, not NUL-terminated necessarily). On error
 * returns RW_ERR_PARSE and writes a message naming the bad field into err (e.g.
 * "anchors[3].features[1]: expected a number in [0,1]"); *table is left empty. */
rw_status_t rw_sched_anchors_parse(const char *json, size_t len, rw_anchor_table_t *table,
				   char *err, size_t err_len);
void rw_sched_anchors_free(rw_anchor_table_t *table);
/* Serialise a table to JSON (for calibration output). Returns bytes needed (excluding NUL);
 * writes at most buf_len bytes, NUL-terminated when buf_len > 0. */
size_t rw_sched_anchors_format(const rw_anchor_table_t *table, char *buf, size_t buf_len);
/* Does the table's fingerprint match this cluster? 0 = mismatch. */
int rw_sched_anchors_match(const rw_anchor_table_t *table, const rw_topo_t *topo,
			   double nic_gbps, const char *transport);

typedef enum rw_select_reason {
	RW_SELECT_NO_REMOTE = 0,  /* no remote payload: Native */
	RW_SELECT_ANCHOR = 1,     /* nearest eligible anchor's path */
	RW_SELECT_NO_ANCHOR = 2,  /* no eligible anchor: Joint */
	RW_SELECT_NO_TABLE = 3,   /* no (valid) table: Joint */
	RW_SELECT_FORCED = 4,     /* operator forced a path (set by the caller) */
} rw_select_reason_t;

typedef struct rw_selection {
	rw_path_t path;
	rw_select_reason_t reason;
	int64_t case_id;   /* anchor used, -1 if none */
	double distance2;  /* squared feature distance to that anchor */
} rw_selection_t;

const char *rw_sched_reason_name(rw_select_reason_t reason);

/* Selector (docs/selector.md §1); table may be NULL. Eligible: |f0 - a0| <= log2(max_size_ratio)
 * and max(|f1 - a1|, |f2 - a2|) <= shape_tolerance; least squared distance wins, ties: case id. */
void rw_sched_select(const rw_anchor_table_t *table, const rw_features_t *feat,
		     rw_selection_t *sel);

/* Calibration rule (docs/selector.md §2) for one anchor: keep path `alt` over Joint only if both
 * paths' CV (from their sample arrays) is under cv_bound and alt's p90 * (1 + margin) < Joint's
 * p10. Fills anchor->samples from the raw samples and sets anchor->selected. */
typedef struct rw_calib_rule {
	double cv_bound;  /* e.g. 0.10 */
	double margin;    /* e.g. 0.05 */
} rw_calib_rule_t;

void rw_sched_anchor_decide(const rw_calib_rule_t *rule, double *const samples[RW_PATH_COUNT],
			    const uint32_t n_samples[RW_PATH_COUNT], rw_anchor_t *anchor);

/* ---------------------------------------------------------------------------------------------
 * Birkhoff-von Neumann baseline (FAST-style), for comparison only
 * ------------------------------------------------------------------------------------------- */

/* Decompose the N x N inter-node demand (bytes, diagonal ignored) into at most max_stages
 * weighted permutations: stage i sends perm[i*N + s] <- s for weight[i] bytes (perm value N = idle).
 * The demand is first padded to a doubly-stochastic-like matrix (row/column sums equalised), as
 * the Birkhoff-von Neumann theorem needs. workspace must hold rw_sched_bvn_workspace(N) bytes.
 * Returns the number of stages, or 0 if max_stages was too small. */
size_t rw_sched_bvn_workspace(uint32_t nodes);
uint32_t rw_sched_bvn_plan(uint32_t nodes, const uint64_t *demand, uint32_t max_stages,
			   uint32_t *perm, uint64_t *weight, void *workspace);

#endif /* RW_SCHED_H */
