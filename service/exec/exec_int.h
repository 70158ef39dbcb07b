/* The phase executor's private header (docs/dataflow.md "Phase executor"): the executor, its
 * groups and members, and the pair — one dispatch and its combine — built from per-concern
 * parts. Files and who may change what:
 *   exec_daemon.c  what the daemon calls (exec.h): creation and teardown, the IPC socket, drain.
 *   exec.c         the state machine: pair lifecycle, stages, failure, completion, timers. The
 *                  only file that changes a pair's stage or fails it.
 *   exec_ipc.c     adapter for the trainer ranks (ipc/): joins, leaves, submissions.
 *   exec_mesh.c    adapter for the peers (service/mesh.h): rows, errors, grants, arrivals.
 *   exec_plan.c    gather/count, the count-row exchange, and the decision (path and layout).
 *   exec_send.c    posting the waves; the receiver gate's shared arithmetic.
 *   exec_recv.c    arrived bytes, complete ranges, grants to our sources.
 *   exec_keys.c    what outlives a pair: failed keys (tombs), ended attempts, early rows.
 *   exec_answer.c  completions to the ranks; the one map from rw_status_t to the client's codes.
 *   mover_host.c   the host data mover (service/mover.h).
 * exec_daemon.c calls the adapters and exec.c; the adapters call exec.c; exec.c calls the
 * leaves; a leaf calls only other leaves, the mesh, the mover and ipc/, records a failure with
 * exec_err() and returns its status. No file calls back up that order. */
#ifndef RW_SVC_EXEC_INT_H
#define RW_SVC_EXEC_INT_H

#include <stdarg.h>
#include <stdio.h>

#include "common/arena.h"
#include "common/list.h"
#include "ipc/ipc.h"
#include "service/exec/exec.h"
#include "service/mesh/mesh.h"
#include "service/mover/mover.h"
#include "service/phase/phase.h"
#include "service/core/svc.h"

#define EXEC_SLOTS 2            /* pairs (of different groups) in flight at once per node */
#define EXEC_CHUNK_MAX (4u << 20) /* largest single rail write we post */
#define EXEC_TICK_S 0.05        /* slot waits, stale rows */
#define EXEC_LOCAL_SLICE 32u    /* local-node records per idle slice */
#define EXEC_COUNT_SLICE 8192u  /* tokens counted (or put into records) per idle slice */
#define EXEC_MOVERS_MAX 4
enum { EXEC_COUNT_HOST = 1, EXEC_COUNT_MOVER = 2 }; /* plan.count_src */

/* The four sub-areas of a slot in each rail's memory. */
enum { SUB_RD = 0, SUB_RC = 1, SUB_SD = 2, SUB_SC = 3 };

/* A pair's stage. Only exec.c assigns it. */
typedef enum exec_stage {
	ST_GATHER_D = 0, /* waiting for local dispatch submissions (and their staging) */
	ST_COUNT,        /* counting the ranks' tokens: in idle slices, or the mover's count() */
	ST_WAIT_SLOT,    /* counted; waiting for a free receive slot (the tick retries) */
	ST_EXCHANGE,     /* our row sent; waiting for the peers' rows and our records pass */
	ST_RUN_D,        /* sending and receiving dispatch records */
	ST_WAIT_C,       /* dispatch completed; waiting for combine submissions */
	ST_RUN_C,        /* sending and receiving combine records */
	ST_CLOSED,       /* completed or failed; freed once no write is outstanding */
} exec_stage_t;

/* Sending one kind (exec_send.c). */
typedef enum exec_send_state {
	SEND_IDLE = 0,   /* not started */
	SEND_WAIT_GRANT, /* the next wave's destination has not admitted us yet */
	SEND_POSTING,    /* posting a wave (only inside exec_send_progress) */
	SEND_PACED,      /* posting paused by the write-gap test hook; the pace timer resumes */
	SEND_WAIT_PACK,  /* the mover is writing this wave's slabs; its RW_MV_OP_PACKED resumes */
	SEND_DRAINING,   /* the wave is posted; the next starts when its writes are done */
	SEND_DONE,       /* every wave posted and done */
} exec_send_state_t;

/* The first failure recorded on a pair (exec_err); exec.c acts on it. */
typedef struct exec_error {
	rw_status_t st;              /* RW_OK: none */
	int tell;                    /* broadcast PHASE_ERR to the peers */
	int remote;                  /* a peer's failure: every rank is told RW_E_PHASE */
	int blame_peer;              /* node + 1 whose data was bad: dropped after the pair fails */
	uint32_t cause_node;         /* a peer's failure passed on: where it began ... */
	uint32_t cause_id;           /* ... and its id there; 0: the failure began here */
	char msg[RW_SVC_WHY_MAX];
} exec_error_t;

typedef struct exec_pair exec_pair_t;
typedef struct exec_group exec_group_t;
typedef struct rw_svc_exec exec_t;

typedef struct exec_member {
	exec_group_t *g;
	rw_ipc_client_t *client;
	uint32_t local;
	/* Pinned host staging of a rank with CUDA buffers: `in` its inputs, `out` its outputs.
	 * One pair of a group runs at a time and each use ends before the next starts. */
	rw_svc_pinned_t in, out;
} exec_member_t;

struct exec_group {
	rw_list_t link;              /* exec.groups */
	char name[RW_GROUP_NAME_MAX];
	uint32_t hash;
	uint32_t world;
	exec_member_t *member[RW_MAX_GPUS];
	uint32_t n_members;
	exec_pair_t *pair;           /* the open pair, or NULL */
};

/* One local rank's submission of one kind. */
typedef struct exec_sub {
	int have;                    /* a completion is owed to this rank */
	int ready;                   /* its inputs are readable (the mover staged them) */
	rw_sqe_t sqe;
	rw_ipc_client_t *client;
} exec_sub_t;

struct exec_pair {
	rw_list_t link;              /* exec.pairs: open and closed-but-draining pairs */
	exec_t *x;
	exec_group_t *g;             /* NULL once closed */
	rw_wire_key_t key;
	uint32_t tag;
	exec_stage_t stage;
	exec_error_t err;
	uint32_t outstanding;        /* our rail writes not yet done (lifetime) */
	uint64_t t0, phase_t0;
	ev_timer timer;              /* phase timeout */
	ev_timer pace;               /* write-gap test hook */
	rw_arena_t mem;              /* every array of the pair (and the layout's, apart) */
	rw_svc_phase_t ph;           /* what the mover sees */
	const rw_svc_mover_ops_t *mv;
	void *mv_mover, *mv_state;
	uint32_t answered;           /* local ranks already answered with an error for this key */
	uint32_t serial;             /* names the pair in the mover's reports */
	struct exec_trace_pair *tr;  /* phase trace (trace.h); NULL when off or closed */

	struct {                     /* gather: local submissions per kind */
		exec_sub_t sub[RW_MAX_GPUS];
		uint32_t n_sub;
		uint32_t staging;    /* staging reports still due */
	} in[2];

	struct {                     /* count-row exchange (exec_plan.c) */
		rw_wire_phase_params_t params;       /* ours */
		int slot;                            /* ours, -1 until held */
		uint32_t *peer_slot;                 /* [N] */
		uint8_t *have_row;                   /* [N] */
		uint32_t n_rows;
		uint32_t *counts;                    /* [N*N*R] */
		rw_wire_phase_params_t *peer_params; /* [N] */
		uint32_t *tag_to;                    /* [N] */
		uint32_t *view_w;                    /* [N*R] each node's rail weights (its row) */
		uint32_t *view_up;                   /* [N*N] each node's rails up, per node */
		rw_sched_feat_acc_t feat_acc;        /* rows folded in as they arrive */
		void *feat_ws;
	} xchg;

	struct {                     /* the count and the decision (exec_plan.c) */
		rw_rank_tokens_t rt[RW_MAX_GPUS];
		int counted;         /* our count row is done (and sent, or waiting for a slot) */
		int count_src;       /* who counts: 0 not decided, EXEC_COUNT_HOST, EXEC_COUNT_MOVER */
		int count_wait;      /* the mover's RW_MV_OP_COUNTED report is due */
		int recs_done;       /* the records pass is done (it runs while the rows travel) */
		rw_sched_count_iter_t count_it;
		rw_sched_records_iter_t *rec_it;
		uint32_t *row_off;   /* [N*R+1] */
		rw_record_t *rec;
		rw_svc_layout_t layout;
		int have_layout;
		rw_path_t path;
		rw_topo_t topo;      /* the cluster's, with the pair weights when rails differ */
	} plan;

	struct {                     /* sending the running kind (exec_send.c) */
		int kind;
		exec_send_state_t state;
		uint32_t wave, pending, waves_posted;
		uint32_t cur_k, k_hi, cur_r;         /* where posting resumes: wave k, write */
		uint64_t cur_c;                      /* round cur_c (the c-th write of each rail) */
		uint8_t *packed[2];                  /* [N]: d's slabs of a kind are packed */
		uint8_t *granted[2];                 /* [N] by wave: our wave-w destination admits us */
		uint64_t wave_t0, wave_slab_max;     /* debug trace */
		uint64_t rounds;                     /* write rounds of destination cur_k ... */
		uint32_t rounds_k;                   /* ... once computed for it (0: not yet) */
	} send;

	struct {                     /* receiving, per kind (exec_recv.c) */
		uint64_t *arrived;   /* [N*R] bytes arrived per (source, rail) */
		uint32_t *parted;    /* [N*R] whole records given to the mover's part() so far */
		uint8_t *range_done; /* [N*R] */
		uint32_t ranges_left;
		/* the receiver gate: in_lo = lowest wave whose inbound data is not all here,
		 * grant_hi = highest wave granted, src_active[s] = s is mid-range */
		uint32_t in_lo, grant_hi, n_active;
		uint8_t *src_active; /* [N] */
	} recv[2];

	struct {                     /* local-node work of the running kind (idle slices) */
		enum { LOCAL_IDLE, LOCAL_RUNNING, LOCAL_DONE } state[2];
	} local;

	struct {                     /* writing the outputs */
		int flushing;
		uint32_t pending;
		uint32_t handle[RW_MAX_GPUS];
	} out;
};

struct rw_svc_exec {
	rw_svc_t *svc;
	rw_svc_mesh_t *mesh;
	rw_ipc_server_t *ipc;
	uint32_t nodes, rails, gpus, me;
	uint64_t area_bytes, sub_bytes;
	int slot_busy[EXEC_SLOTS];
	uint64_t slot_free_at[EXEC_SLOTS];
	rw_list_t groups;
	rw_list_t pairs;
	rw_list_t rows;              /* early count rows (exec_keys.c) */
	rw_list_t tombs;             /* failed keys */
	rw_list_t ended;             /* peers' attempts that ended here */
	struct {
		const rw_svc_mover_ops_t *ops;
		void *mover;
	} movers[EXEC_MOVERS_MAX];
	uint32_t n_movers;
	uint32_t next_serial, next_handle;
	ev_timer tick;
	ev_idle local_idle;          /* runs pairs' local work between network events */
	ev_prepare reaper;           /* frees closed pairs outside every callback chain */
	rw_svc_exec_hooks_t hooks;
	rw_svc_rail_meter_t meter[RW_MAX_RAILS]; /* rail_weights: measured (rail_health.h) */
	struct rw_svc_trace *trace;  /* phase traces (trace.h); NULL when trace_dir is unset */
};

/* ---- small shared helpers ---------------------------------------------------------------- */

static inline int exec_kind(const exec_pair_t *p) { return p->stage >= ST_WAIT_C; }
static inline int exec_open(const exec_pair_t *p) { return p->stage != ST_CLOSED; }

/* Record the pair's first failure and return st (leaves: `return exec_err(p, ...)`). */
static inline void exec_err_v(exec_pair_t *p, rw_status_t st, int tell, const char *fmt,
			      va_list ap) __attribute__((format(printf, 4, 0)));
static inline void exec_err_v(exec_pair_t *p, rw_status_t st, int tell, const char *fmt,
			      va_list ap)
{
	if (p->err.st != RW_OK)
		return;
	vsnprintf(p->err.msg, sizeof(p->err.msg), fmt, ap);
	p->err.st = st;
	p->err.tell = tell;
}

static inline rw_status_t exec_err(exec_pair_t *p, rw_status_t st, int tell, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static inline rw_status_t exec_err(exec_pair_t *p, rw_status_t st, int tell, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	exec_err_v(p, st, tell, fmt, ap);
	va_end(ap);
	return st;
}

/* Phase milestones at debug level, ms since the phase began here (docs/dataflow.md). */
#define PTRACE(p, fmt, ...)                                                                      \
	rw_dbg("L%u s%llu %s t=%.1f +%.1f ms: " fmt, (p)->key.layer,                              \
	       (unsigned long long)(p)->key.step, exec_kind(p) ? "combine" : "dispatch",            \
	       (double)rw_now_ns() / 1e6, (double)(rw_now_ns() - (p)->phase_t0) / 1e6, __VA_ARGS__)

static inline uint64_t exec_sub_off(const exec_t *x, int slot, int sub)
{
	return ((uint64_t)slot * 4u + (uint64_t)sub) * x->sub_bytes;
}

/* The wire dtype of a submission's (the IPC server admits only bf16 and fp32, exec.c). */
static inline uint32_t exec_wire_dtype(uint8_t d)
{
	return d == RW_DTYPE_BF16 ? RW_WIRE_BF16 : RW_WIRE_F32;
}

static inline uint32_t exec_all_local(const exec_t *x) { return (uint32_t)((1ull << x->gpus) - 1); }


/* ---- exec_answer.c: completions to the ranks --------------------------------------------- */
/* The client's code for an internal status (`remote`: a peer's failure). */
int exec_client_code(rw_status_t st, int remote);
/* Answer a submission with an error: `msg` first (rw_client_last_message), then the CQE. */
void exec_answer_err(exec_t *x, rw_ipc_client_t *client, const rw_sqe_t *sqe, rw_status_t st,
		     int remote, const char *msg);
/* Refuse a joining rank: RW_ERR_INVAL (its world or node does not fit this cluster),
 * RW_ERR_EXISTS (its rank is taken), RW_ERR_NOMEM. */
void exec_drop_client(exec_t *x, rw_ipc_client_t *client, rw_status_t st);
void exec_answer_dispatch(exec_t *x, exec_pair_t *p, uint32_t g);
void exec_answer_combine(exec_t *x, exec_pair_t *p, uint32_t g);

/* ---- exec_keys.c: failed keys, ended attempts, early rows --------------------------------- */
/* Phase `kind` of `key` failed (msg: why); `answered`: local ranks that already got their error. */
void exec_tomb_add(exec_t *x, const char *group, const rw_wire_key_t *key, int kind,
		   uint32_t answered, const char *msg);
/* Why a submission of `kind` by local rank `local` must fail at once (its phase already failed
 * here), or NULL; counts the answer. The text is valid until the next call. */
const char *exec_tomb_hit(exec_t *x, const rw_wire_key_t *key, int kind, uint32_t local);
/* A dispatch tomb of `key` exists (its peers' count rows are dead). */
int exec_tomb_exists(exec_t *x, const rw_wire_key_t *key);
void exec_tomb_left(exec_t *x, uint32_t group_hash, uint32_t local);
void exec_ended_add(exec_t *x, const rw_wire_key_t *key, uint32_t node, uint32_t epoch);
int exec_ended_find(const exec_t *x, const rw_wire_key_t *key, uint32_t node, uint32_t epoch);
/* Keep a peer's row that came before our ranks (a newer one of (key, node) replaces it). */
void exec_row_keep(exec_t *x, const rw_wire_counts_t *c, uint32_t peer);
/* Drop early rows: of group (NULL: any) and key, of node (< 0: any), of epoch (0: any). */
void exec_rows_drop(exec_t *x, const char *group, const rw_wire_key_t *key, int node,
		    uint32_t epoch);
void exec_rows_drop_node(exec_t *x, uint32_t node);
/* Hand every early row of the pair's key to exec_plan_take_row, removing them. */
void exec_rows_take(exec_t *x, exec_pair_t *p);
/* The epoch of node's early row of (group, key) waiting here; 0 when none. */
uint32_t exec_row_epoch(const exec_t *x, const char *group, const rw_wire_key_t *key,
			uint32_t node);
void exec_keys_expire(exec_t *x, uint64_t now, uint64_t timeout);
void exec_keys_free(exec_t *x);
/* A PHASE_ERR to send: what failed, and which attempt (docs/dataflow.md "Failures"). */
typedef struct exec_failure {
	const rw_wire_key_t *key;
	int kind;
	rw_status_t st;
	const char *msg;
	uint32_t epoch;              /* this node's attempt (its count row's epoch) */
	int relay;                   /* passing on a peer's failure after our row went out */
	uint32_t cause_node, cause_id;
	const uint32_t *dst_epoch;   /* per node: its epoch in the attempt, 0 if we had no row; or NULL */
} exec_failure_t;

/* Tell every peer that this node failed a phase (PHASE_ERR). */
void exec_tell_peers(exec_t *x, const exec_failure_t *f);

/* ---- exec_plan.c: gather, exchange, decide ------------------------------------------------ */
/* A fresh attempt epoch (or failure id): never 0, different for every call. */
uint32_t exec_epoch_new(uint64_t salt);
/* Per-pair arrays (N-sized) and the phase's parameters from its first submission. */
rw_status_t exec_plan_init(exec_pair_t *p, const rw_sqe_t *sqe);
/* Whether a later local rank's submission fits the phase (RW_ERR_SUB_*; why says how). */
rw_status_t exec_plan_fits(const exec_pair_t *p, const rw_sqe_t *sqe, char *why, size_t len);
/* Our ranks' token lists (plan.rt) from their submissions and staged ids. */
void exec_plan_tokens(exec_pair_t *p);
/* Our count row on the host, at most `budget` tokens per call; *done_p once it is done (the
 * first call starts it). A bad id answers its rank (exec_plan_bad_ids). */
rw_status_t exec_plan_count(exec_pair_t *p, uint32_t budget, int *done_p);
/* Local rank `bad`'s ids hold an expert id out of range: it hears what it did (RW_E_TOKENS),
 * the pair's error names it; returns that error. */
rw_status_t exec_plan_bad_ids(exec_pair_t *p, uint32_t bad);
/* Our count row is complete (whoever counted): the records pass's arrays. */
rw_status_t exec_plan_counted(exec_pair_t *p);
/* The records pass (needs every rank's ids readable), at most `budget` tokens per call;
 * *done_p once every record is in place and the records match the count row. */
rw_status_t exec_plan_records(exec_pair_t *p, uint32_t budget, int *done_p);
/* The pair's areas of `slot` on every rail (host and, for GPU slabs, device addresses). */
void exec_areas_set(exec_pair_t *p, int slot);
rw_status_t exec_plan_send_row(exec_pair_t *p);        /* COUNTS to every peer */
/* What a pair in ST_COUNT or ST_EXCHANGE waits for, in words (a timeout names it). */
void exec_plan_waiting(const exec_pair_t *p, char *buf, size_t len);
/* row: N*R counts; view: that node's rail view, R weights then N up-masks (NULL: already in
 * p->xchg.view_*). */
void exec_plan_take_row(exec_pair_t *p, uint32_t node, uint32_t slot,
			const rw_wire_phase_params_t *params, const uint32_t *row, const uint32_t *view);
/* This node's capacity weight of `rail` (its count rows; docs/dataflow.md "Rail health"). */
uint32_t exec_rail_weight(const exec_t *x, uint32_t rail);
/* A COUNTS message's rail view (R weights, N up-masks) into view[R + N]. */
void exec_plan_view_decode(const rw_wire_counts_t *c, uint32_t *view);
/* The decided pair moves records between this node and `peer` on `rail` (either way). */
int exec_plan_uses_rail(const exec_pair_t *p, uint32_t peer, uint32_t rail);
/* A peer's COUNTS message for this pair. */
void exec_plan_take_counts(exec_pair_t *p, uint32_t node, const rw_wire_counts_t *c);
/* Every row is here: path, layout, receive bookkeeping, the mover's plan. */
rw_status_t exec_plan_decide(exec_pair_t *p);

/* ---- exec_send.c ------------------------------------------------------------------------- */
int exec_gated(const exec_pair_t *p);
int exec_needs_grant(const exec_pair_t *p, int kind, uint32_t k, uint32_t s);
void exec_send_begin(exec_pair_t *p, int kind);
/* Post what can be posted now; the state says what it waits for. */
rw_status_t exec_send_progress(exec_pair_t *p);

/* ---- exec_recv.c ------------------------------------------------------------------------- */
rw_status_t exec_recv_init(exec_pair_t *p);
/* The layout is known: the ranges of `kind` this node waits for. */
rw_status_t exec_recv_begin(exec_pair_t *p, int kind);
/* The mover refused what it took of src's range after the fact (RW_MV_OP_REFUSED): the error,
 * blaming src for RW_ERR_PROTO; the caller fails the pair. */
void exec_recv_refused(exec_pair_t *p, uint32_t src, rw_status_t st);
/* Catch up with the bytes of `kind` that came before the layout was known. */
rw_status_t exec_recv_scan(exec_pair_t *p, int kind);
/* `len` bytes of `kind` from peer on rail landed (`last`: the writer's last of the range). */
rw_status_t exec_recv_data(exec_pair_t *p, int kind, uint32_t peer, uint32_t rail, uint64_t len,
			   int last);
/* What the receiver still waits for, for a timeout message. */
void exec_recv_waiting(const exec_pair_t *p, int kind, char *buf, size_t len);

/* ---- exec.c: events from the adapters and the mover --------------------------------------- */
exec_pair_t *exec_pair_open(exec_t *x, exec_group_t *g, const rw_wire_key_t *key,
			    const rw_sqe_t *sqe);
exec_pair_t *exec_pair_by_key(exec_t *x, const rw_wire_key_t *key);
exec_pair_t *exec_pair_by_tag(exec_t *x, uint32_t tag14);
void exec_pair_fail(exec_pair_t *p, rw_status_t st, int remote, int tell, const char *fmt, ...)
	__attribute__((format(printf, 5, 6)));
/* A peer's PHASE_ERR fails the pair; its cause travels on in whatever this node tells. */
void exec_pair_fail_peer(exec_pair_t *p, const rw_wire_phase_err_t *e, int tell, const char *msg);
/* The trainer moved on without a combine: close quietly. */
void exec_pair_abandon(exec_pair_t *p);
/* Submission of local rank g recorded in p->in[kind].sub[g] with p->ph.io[kind][g] resolved. */
void exec_on_submit(exec_pair_t *p, int kind, uint32_t g);
void exec_on_counts(exec_pair_t *p, uint32_t node, const rw_wire_counts_t *c);
void exec_on_data(exec_pair_t *p, int kind, uint32_t peer, uint32_t rail, uint64_t len, int last);
void exec_on_write_done(exec_pair_t *p, uint32_t peer, uint32_t rail, rw_status_t st);
void exec_on_grant(exec_pair_t *p, int kind, uint32_t wave);
void exec_on_peer_down(exec_t *x, uint32_t peer, rw_status_t st);
/* Rail `rail` to `peer` went down, the peer stays up: fail the pairs whose plan uses it. */
void exec_on_rail_down(exec_t *x, uint32_t peer, uint32_t rail, rw_status_t st);
/* Local rank `local` of the pair's group left: its data is gone. */
void exec_on_rank_left(exec_pair_t *p, rw_ipc_client_t *client, uint32_t rank);

/* The mover's asynchronous report (rw_svc_mover_done_fn; ctx: the executor). */
void exec_on_mover_done(void *ctx, uint32_t serial, rw_svc_mover_op_t op, uint32_t g,
			rw_status_t st);
/* The executor's watchers: the tick (slot waits, ageing), the idle local work, the reaper. */
void exec_start(exec_t *x);
/* Stop the watchers and fail every open pair ("daemon stopping"). */
void exec_stop(exec_t *x);
void exec_fail_open(exec_t *x, const char *why);
/* After the mesh reported every outstanding write: free every pair struct. */
void exec_free_pairs(exec_t *x);
/* No phase is running (a drain may end). */
int exec_drained(exec_t *x);

/* ---- exec_ipc.c / exec_mesh.c ------------------------------------------------------------ */
extern const rw_ipc_server_ops_t exec_ipc_ops;
void exec_member_free(exec_member_t *mb);
extern const rw_svc_mesh_cbs_t exec_mesh_cbs;

/* ---- trace.h: phase trace hooks, one branch when tracing is off ----------------------------- */
#include "service/exec/trace.h"
#define EXEC_TRACE(p, call) do { if ((p)->tr) call; } while (0)
enum { EXEC_TRACE_READY = 0, EXEC_TRACE_RUN = 1 }; /* exec_trace_mark_ */

#endif /* RW_SVC_EXEC_INT_H */
