/* The phase executor's private header (docs/dataflow.md "Phase executor"): the executor, its
 * groups and members, and the pair — one dispatch and its combine — built from per-concern
 * parts. Files and who may change what:
 *   exec_daemon.c  what the daemon calls (exec.h): creation and teardown, the IPC socket, drain.
 *   exec.c         the state machine: pair lifecycle, stages, failure, completion, timers. The
 *                  only file that changes a pair's stage or fails it.
 *   exec_stage.c   the names and tables of legal changes of a pair's stage and of its sender's
 *                  state, and the one function each change goes through (exec_stage_move from
 *                  exec.c, exec_send_move from exec_send.c).
 *   exec_ipc.c     adapter for the trainer ranks (ipc/): joins, leaves, and a submission's way
 *                  in: one check that changes nothing, then one place that acts on it.
 *   exec_page.c    adapter for the rank path's words (ipc/page.h): a rank's slot read once and
 *                  checked, its failed phases' words owed on its page.
 *   exec_mesh.c    adapter for the peers (service/mesh/mesh.h): rows, errors, grants, arrivals.
 *   exec_plan.c    gather/count, the count-row exchange, and the decision (path and layout).
 *   exec_send.c    posting the waves; the receiver gate's shared arithmetic.
 *   exec_recv.c    arrived bytes, complete ranges, grants to our sources.
 *   exec_keys.c    what outlives a pair: failed keys (tombs), ended attempts, early rows; and
 *                  the one place that ends a failed key (tomb, ended attempts, PHASE_ERR).
 *   exec_answer.c  completions to the ranks; the one map from rw_status_t to the client's codes.
 *   trace.c        phase traces (trace.h).
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
#include "ipc/page.h"
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
#define EXEC_QUIET_TAGS 256     /* ended pairs' tags kept from new pairs (exec_quiet_tag_t) */
#define EXEC_CARVE_IDLE_UIDS 16 /* uids whose idle carve-outs' clocks are kept (exec_carve.c) */

/* The four sub-areas of a slot in each rail's memory; a group's carve-out has a fifth, the
 * local area of the rank path (records and rows that never leave the node). */
enum { SUB_RD = 0, SUB_RC = 1, SUB_SD = 2, SUB_SC = 3, SUB_LOCAL = 4 };

/* A pair's kind: rw_svc_phase_kind_t (RW_SVC_DISPATCH, RW_SVC_COMBINE), the index of every
 * per-kind array. What differs between the two kinds, apart from the layout's numbers (the
 * pair's flows), in one place: */
typedef struct exec_kind_desc {
	int sub_send, sub_recv;      /* its sub-areas of a slot (SUB_*) */
	int returns;                 /* its records go back along the dispatch's (s, d) flows */
	rw_svc_mover_op_t staged;    /* the mover's report that a rank's inputs are readable */
} exec_kind_desc_t;

static inline const exec_kind_desc_t *exec_kind_desc(rw_svc_phase_kind_t kind)
{
	static const exec_kind_desc_t desc[RW_SVC_KIND_COUNT] = {
		[RW_SVC_DISPATCH] = { .sub_send = SUB_SD, .sub_recv = SUB_RD, .returns = 0,
				      .staged = RW_MV_OP_STAGE_D },
		[RW_SVC_COMBINE] = { .sub_send = SUB_SC, .sub_recv = SUB_RC, .returns = 1,
				     .staged = RW_MV_OP_STAGE_C },
	};
	return &desc[kind];
}

/* A pair's stage (exec_stage.c has the table of legal changes; exec.c makes them). In order:
 * a kind's stages sit before the next kind's, so the running kind follows from the stage. */
typedef enum exec_stage {
	ST_GATHER_D = 0, /* waiting for local dispatch submissions (and their staging) */
	ST_COUNT_HOST,   /* counting the ranks' tokens on the host, in idle slices */
	ST_COUNT_MOVER,  /* the mover counts them: its RW_MV_OP_COUNTED report is due */
	ST_WAIT_SLOT,    /* counted; waiting for a free receive slot (the tick retries) */
	ST_EXCHANGE,     /* our row sent; waiting for the peers' rows and our records pass */
	ST_RUN_D,        /* sending and receiving dispatch records */
	ST_FLUSH_D,      /* every dispatch byte is here: the mover writes the ranks' outputs */
	ST_WAIT_C,       /* dispatch completed; waiting for combine submissions */
	ST_RUN_C,        /* sending and receiving combine records */
	ST_FLUSH_C,      /* every combine byte is here: the mover writes the ranks' outputs */
	ST_CLOSED,       /* completed or failed; freed once no write is outstanding */
	EXEC_STAGES
} exec_stage_t;

/* Sending one kind (exec_send.c, the only file that changes it, through exec_send_move). */
typedef enum exec_send_state {
	SEND_IDLE = 0,   /* not started */
	SEND_WAIT_GRANT, /* the next wave's destination has not admitted us yet */
	SEND_POSTING,    /* posting a wave (only inside exec_send_progress) */
	SEND_PACED,      /* posting paused by the write-gap test hook; the pace timer resumes */
	SEND_WAIT_PACK,  /* the mover is writing this wave's slabs (a group on one node: its own
			  * records); its RW_MV_OP_PACKED or a page rank's `packed` resumes */
	SEND_DRAINING,   /* the wave is posted; the next starts when its writes are done */
	SEND_DONE,       /* every wave posted and done */
	EXEC_SEND_STATES
} exec_send_state_t;

/* Who hears of a failure besides the local ranks (docs/dataflow.md "Failures"). */
typedef enum exec_tell {
	EXEC_TELL_PEERS = 0,         /* found here: every peer, told which of its attempts it ends */
	EXEC_TELL_RELAY,             /* a peer's failure passed on: our row of it is out */
	EXEC_TELL_NONE,              /* every node finds it from the same rows; or the daemon stops */
} exec_tell_t;

/* The first failure recorded on a pair (exec_err); exec.c acts on it. */
typedef struct exec_error {
	rw_status_t st;              /* RW_OK: none */
	exec_tell_t tell;
	int remote;                  /* a peer's failure: every rank is told RW_E_PHASE */
	int blame_peer;              /* node + 1 whose data was bad: dropped after the pair fails */
	uint32_t cause_node;         /* a peer's failure passed on: where it began ... */
	uint32_t cause_id;           /* ... and its id there; 0: the failure began here */
	char msg[RW_SVC_WHY_MAX];
} exec_error_t;

typedef struct exec_pair exec_pair_t;
typedef struct exec_group exec_group_t;
typedef struct rw_svc_exec exec_t;

/* A local seat of a group, and what its node knows of the keys its rank answered
 * (docs/rankpath.md "Failure", the rule of absences): a group's ranks run one sequence of keys,
 * and each seat answers each key's dispatch once, by a submission or by an absence. Its state
 * says which keys the seat may still submit: */
typedef enum exec_seat_state {
	SEAT_WAIT = 0,               /* no rank, owing nothing (never held, or its gap was spent):
				      * a pair waits for a rank to take it */
	SEAT_GAP,                    /* its rank (ring or page) left and its leave failed
				      * nothing: the next key a rank that is not new since its
				      * join dispatches here is one it skipped */
	SEAT_NEW,                    /* a rank joined and no dispatch of it was taken yet: a key
				      * that gathers without it before its first is one it skipped */
	SEAT_ON,                     /* its rank's last dispatch taken (admitted, refused, or
				      * answered by a failed key's tomb) was of key `last` */
} exec_seat_state_t;

typedef struct exec_seat {
	exec_seat_state_t state;
	rw_wire_key_t last;          /* SEAT_ON */
} exec_seat_t;

/* A stream-ordered event's completion flag as the executor's error answers left it
 * (exec_answer.c): the newest value, owed (its GPU stalled), or written and kept while an error
 * answer of the rank may still come with an older one (a held answer, a submission in a pair).
 * A rank's stream waits on increasing values (cuStreamWaitValue32 GEQ, ipc/railwave.h), so the
 * newest covers every older one: no error answer writes an older value over it (a success's
 * flag, the mover's stream write, is not this table's: docs/rankpath.md "A hung GPU"). */
typedef struct exec_flag {
	uint16_t event_id;           /* 0: a free entry */
	uint8_t owed;                /* not written yet: its GPU was stalled (written once it moves) */
	int8_t dev;                  /* the flag's GPU */
	uint32_t value;
} exec_flag_t;
/* A client registers at most 64 events (ipc/ipc.h max_events), so one entry per event fits
 * (an entry whose event was deregistered is reused). */
#define EXEC_FLAG_EVENTS 64

typedef struct exec_member {
	exec_group_t *g;
	rw_ipc_client_t *client;
	uint32_t local;
	/* Pinned host staging of a rank with CUDA buffers: `in` its inputs, `out` its outputs.
	 * One pair of a group runs at a time and each use ends before the next starts. */
	rw_svc_pinned_t in, out;
	/* Rank path: the last value of each rank-written page word the executor took (ipc/page.h
	 * RW_PW_*; exec_page.c). */
	uint64_t page_seen[RW_PW_COUNT];
	uint64_t page_taken;         /* the last phase whose submit was taken (admitted or failed) */
	uint64_t page_failed;        /* a phase not taken yet whose packed or done came ahead of
					the daemon's word: failed on the page, refused when taken */
	unsigned page_failed_word;   /* which (RW_PW_PACKED or RW_PW_DONE) */
	exec_flag_t flag[EXEC_FLAG_EVENTS]; /* its error answers' stream-ordered flags */
} exec_member_t;

struct exec_group {
	rw_list_t link;              /* exec.groups */
	char name[RW_GROUP_NAME_MAX];
	uint32_t hash;
	uint32_t world;
	exec_member_t *member[RW_MAX_GPUS];
	uint32_t n_members;
	exec_pair_t *pair;           /* the open pair, or NULL */
	exec_seat_t seat[RW_MAX_GPUS]; /* by local rank */
	uint8_t key_fp[RW_WIRE_KEY_FP_SIZE]; /* its ranks' group key fingerprint (ipc/ipc.h) */
	/* Its carve-out of the mesh's pool (service/mesh/mesh.h), taken at its first slab request
	 * (a rank that will map it), tried once: its pairs' slot is EXEC_SLOTS + carve. -1: none
	 * (none asked yet, carve-outs off, or the pool was spent), its pairs take a shared slot. */
	int carve;
	int carve_tried;             /* exec_carve_want ran for it */
	uint64_t carve_free_at;      /* as slot_free_at, for its carve-out */
	int carve_code;              /* carve -1 after a try: RW_E_LIMIT (the pool spent, the
				      * per-uid bound, taken back) or RW_E_STATE (not made); 0 */
	char carve_why[256];         /* then why, as its ranks are told */
	uid_t carve_uid;             /* charged to: the uid of the rank whose request took it */
	uint64_t carve_idle_at;      /* no phase completed in it since (taken, or inherited:
				      * exec_carve.c; or its last completed phase) */
	int carve_ran;               /* a phase completed in its carve-out */
	int carve_lost;              /* its carve-out was taken back (carve_why says so) */
};

/* One local rank's submission of one kind. */
typedef struct exec_sub {
	int have;                    /* a completion is owed to this rank */
	int ready;                   /* its inputs are readable (the mover staged them) */
	rw_sqe_t sqe;
	rw_ipc_client_t *client;
	uint64_t page_k;             /* a page rank's (the rank path): the phase its words carry;
				      * it is answered by words, never by a completion. 0: a ring
				      * submission */
} exec_sub_t;

struct exec_pair {
	rw_list_t link;              /* exec.pairs: open and closed-but-draining pairs */
	exec_t *x;
	exec_group_t *g;             /* NULL once closed */
	rw_wire_key_t key;
	uint32_t tag;
	exec_stage_t stage;
	exec_error_t err;
	exec_error_t held;           /* a peer's failure of the combine that came while our
				      * dispatch still ran: acted on once it completes */
	uint32_t outstanding;        /* our rail writes not yet done (lifetime) */
	uint64_t t0, phase_t0;
	ev_timer timer;              /* phase timeout */
	ev_timer pace;               /* write-gap test hook */
	rw_arena_t mem;              /* every array of the pair (and the layout's, apart) */
	rw_svc_phase_t ph;           /* what the mover sees */
	const rw_svc_mover_ops_t *mv;
	void *mv_mover, *mv_state;
	uint32_t answered;           /* local ranks already answered with an error for this key */
	uint32_t fresh;              /* local ranks whose dispatch here was their first since they
				      * joined (SEAT_NEW when it came) */
	uint32_t serial;             /* names the pair in the mover's reports */
	int carve;                   /* the carve-out it holds a reference on until freed, or -1 */
	int slot_held;               /* closed after a failure: the shared slot it keeps out of use
				      * until its movers' work settled, or -1 */
	int page_busy;               /* its running kind has page ranks in flight: the word
				      * poller spins (exec_page_busy) */
	struct exec_trace_pair *tr;  /* phase trace (trace.h); NULL when off or closed */

	struct {                     /* gather: local submissions per kind */
		exec_sub_t sub[RW_MAX_GPUS];
		uint32_t n_sub;
		uint32_t staging;    /* staging reports still due */
	} in[RW_SVC_KIND_COUNT];

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

	/* Each kind's traffic under the layout, set with the decision (exec_plan_decide). */
	struct exec_flow {
		uint64_t rec;                /* bytes per record */
		const uint32_t *send_quota;  /* [N*R] records to node d on rail r */
		const uint32_t *recv_quota;  /* [N*R] records from node s on rail r */
		const uint32_t *send_first;  /* [N*R] d's first slot on rail r in our send area */
		const uint32_t *peer_first;  /* [N*R] our first slot in d's receive area on rail r */
		const uint32_t *recv_first;  /* [N*R] s's first slot on rail r in our receive area */
	} flow[RW_SVC_KIND_COUNT];

	struct {                     /* sending the running kind (exec_send.c) */
		rw_svc_phase_kind_t kind;
		exec_send_state_t state;
		uint32_t wave, pending, waves_posted;
		uint32_t cur_k, k_hi, cur_r;         /* where posting resumes: wave k, write */
		uint64_t cur_c;                      /* round cur_c (the c-th write of each rail) */
		uint8_t *packed[RW_SVC_KIND_COUNT];  /* [N]: d's slabs of a kind are packed */
		uint8_t *granted[RW_SVC_KIND_COUNT]; /* [N] by wave: our wave-w destination admits us */
		uint64_t wave_t0, wave_slab_max;     /* debug trace */
		uint64_t rounds;                     /* write rounds of destination cur_k ... */
		uint32_t rounds_k;                   /* ... once computed for it (0: not yet) */
	} send;

	struct {                     /* receiving, per kind (exec_recv.c) */
		uint64_t *arrived;   /* [N*R] bytes arrived per (source, rail) */
		uint64_t *at1;       /* [N*R] 1 + the offset in the rail's memory where the range's
				      * first byte landed; 0: not known (or nothing yet) */
		uint32_t *parted;    /* [N*R] whole records given to the mover's part() so far */
		uint8_t *range_done; /* [N*R] */
		uint32_t ranges_left;
		/* the receiver gate: in_lo = lowest wave whose inbound data is not all here,
		 * grant_hi = highest wave granted, src_active[s] = s is mid-range */
		uint32_t in_lo, grant_hi, n_active;
		uint8_t *src_active; /* [N] */
	} recv[RW_SVC_KIND_COUNT];

	struct {                     /* local-node work of the running kind (idle slices) */
		enum { LOCAL_IDLE, LOCAL_RUNNING, LOCAL_DONE } state[RW_SVC_KIND_COUNT];
	} local;

	struct {                     /* writing the outputs (ST_FLUSH_D, ST_FLUSH_C) */
		uint32_t pending;    /* the mover's RW_MV_OP_FINISH reports still due */
		uint32_t page_done;  /* page ranks whose `done` counted (bit g) */
		uint32_t handle[RW_MAX_GPUS];
	} out;
};

/* The immediate tag of a pair that ended holding a slot before every byte of its combine came
 * (failed, abandoned, or closed after its dispatch while draining): a peer may write with it until
 * its own pair ends, a phase timeout at most, so no new pair here takes it until then (`until`).
 * A ring: past EXEC_QUIET_TAGS such ends in a phase timeout, the oldest are forgotten. */
typedef struct exec_quiet_tag {
	uint32_t tag14;
	uint64_t until;
} exec_quiet_tag_t;

struct rw_svc_exec {
	rw_svc_t *svc;
	rw_svc_mesh_t *mesh;
	rw_ipc_server_t *ipc;
	uint32_t nodes, rails, gpus, me;
	uint64_t area_bytes, sub_bytes;
	uint64_t carve_bytes;        /* a group's carve-out per rail (group_area_mib); 0: none */
	uint64_t carve_sub;          /* each of its four record areas (rw_svc_carve_sub); the local
				      * area is the rest, group_local_mib at least */
	uint32_t carve_max;          /* carve-outs in the pool */
	uint64_t *carve_put_at;      /* [carve_max]: when a left group's carve-out goes; 0: none */
	/* Carve-outs given back with no phase run in them, by uid (exec_carve.c): the idle clock
	 * of that uid's next one taken within group_carve_idle_s starts at `since`. at 0: free. */
	struct exec_carve_idle {
		uid_t uid;
		uint64_t since, at;
	} carve_idle[EXEC_CARVE_IDLE_UIDS];
	exec_quiet_tag_t quiet[EXEC_QUIET_TAGS]; /* ring; quiet_next: the next to overwrite */
	uint32_t quiet_next;
	int slot_busy[EXEC_SLOTS];
	uint64_t slot_free_at[EXEC_SLOTS];
	int slot_held[EXEC_SLOTS];   /* kept out of use: a failed pair's GPU work may still write
				      * its areas (the pair's slot_held, exec.c) */
	rw_list_t groups;
	rw_list_t pairs;
	rw_list_t rows;              /* early count rows (exec_keys.c) */
	rw_list_t tombs;             /* failed keys */
	rw_list_t ended;             /* peers' attempts that ended here */
	rw_list_t refused;           /* local ranks refused at their hello (exec_keys.c) */
	uint32_t n_refused;
	rw_list_t *key_idx;          /* the three above hashed by key (exec_keys.c) */
	uint32_t *keys_held;         /* [N][3]: what each node makes us keep, against its bound */
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
	struct exec_late *late;      /* failed pairs' answers held for their copies (exec_answer.c) */
	uint64_t flag_devs;          /* GPUs (bit d) members' owed flags wait on (exec_answer.c) */
	rw_svc_rail_meter_t meter[RW_MAX_RAILS]; /* rail_weights: measured (rail_health.h) */
	struct rw_svc_trace *trace;  /* phase traces (trace.h); NULL when trace_dir is unset */
	ev_timer page_retry;         /* exec_page.c: retries submits that wait for the group's
				      * pair to end (running while any waits) */
	int page_retry_init;
};

/* ---- small shared helpers ---------------------------------------------------------------- */

/* The kind a pair is running (or waiting for): its dispatch up to ST_FLUSH_D, then its combine. */
static inline rw_svc_phase_kind_t exec_kind(const exec_pair_t *p)
{
	return p->stage >= ST_WAIT_C ? RW_SVC_COMBINE : RW_SVC_DISPATCH;
}
static inline int exec_open(const exec_pair_t *p) { return p->stage != ST_CLOSED; }

/* Record the pair's first failure and return st (leaves: `return exec_err(p, ...)`); exec.c
 * acts on it. exec_err: found here, the peers are told; exec_err_agreed: a verdict of the
 * decision, which every node reaches from the same rows, so nobody is told. */
static inline void exec_err_v(exec_pair_t *p, rw_status_t st, exec_tell_t tell, const char *fmt,
			      va_list ap) __attribute__((format(printf, 4, 0)));
static inline void exec_err_v(exec_pair_t *p, rw_status_t st, exec_tell_t tell, const char *fmt,
			      va_list ap)
{
	if (p->err.st != RW_OK)
		return;
	vsnprintf(p->err.msg, sizeof(p->err.msg), fmt, ap);
	p->err.st = st;
	p->err.tell = tell;
}

static inline rw_status_t exec_err_tell(exec_pair_t *p, rw_status_t st, exec_tell_t tell,
					const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static inline rw_status_t exec_err_tell(exec_pair_t *p, rw_status_t st, exec_tell_t tell,
					const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	exec_err_v(p, st, tell, fmt, ap);
	va_end(ap);
	return st;
}
#define exec_err(p, st, ...) exec_err_tell((p), (st), EXEC_TELL_PEERS, __VA_ARGS__)
#define exec_err_agreed(p, st, ...) exec_err_tell((p), (st), EXEC_TELL_NONE, __VA_ARGS__)

/* Phase milestones at debug level, ms since the phase began here (docs/dataflow.md). */
#define PTRACE(p, fmt, ...)                                                                      \
	rw_dbg("L%u s%llu %s t=%.1f +%.1f ms: " fmt, (p)->key.layer,                              \
	       (unsigned long long)(p)->key.step, rw_svc_kind_name(exec_kind(p)),                   \
	       (double)rw_now_ns() / 1e6, (double)(rw_now_ns() - (p)->phase_t0) / 1e6, __VA_ARGS__)

/* A slot's sub-areas, as offsets of the mesh's memory: slots below EXEC_SLOTS are the shared
 * area's (four sub-areas each), slot EXEC_SLOTS + i is carve-out i (service/mesh/mesh.h: four,
 * then the local area). The numbers are the same on every node (the cluster fingerprint
 * covers them). */
static inline uint64_t exec_sub_off(const exec_t *x, int slot, int sub)
{
	if (slot < EXEC_SLOTS)
		return ((uint64_t)slot * 4u + (uint64_t)sub) * x->sub_bytes;
	return x->area_bytes + (uint64_t)(slot - EXEC_SLOTS) * x->carve_bytes +
	       (uint64_t)sub * x->carve_sub;
}
/* Bytes of each sub-area of `slot`; 0 for a slot no node has. */
static inline uint64_t exec_sub_bytes(const exec_t *x, uint32_t slot)
{
	return slot < EXEC_SLOTS ? x->sub_bytes :
	       slot < EXEC_SLOTS + x->carve_max ? x->carve_sub : 0;
}
/* The sub-area (SUB_*) an offset of the mesh's memory lies in (a carve-out's local area runs
 * from its four record areas to its end). */
static inline int exec_at_sub(const exec_t *x, uint64_t at)
{
	if (at < x->area_bytes)
		return (int)((at / x->sub_bytes) % 4);
	return (int)RW_MIN(((at - x->area_bytes) % x->carve_bytes) / x->carve_sub,
			   (uint64_t)SUB_LOCAL);
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
/* Answer a submission with an error: `msg` first (rw_client_last_message), then the CQE. A
 * stream-ordered submission's flag is written before (rw_ipc_signal_now), unless its GPU is
 * stalled (that synchronous write would hold the loop): then the rank's member owes it (one
 * entry per event, the newest value), logged, and exec_answer_late_sweep writes it once that GPU
 * moves again; it is dropped if the rank leaves first or the daemon stops with the GPU still
 * stalled. Nothing is asked of the caller. */
void exec_answer_err(exec_t *x, rw_ipc_client_t *client, const rw_sqe_t *sqe, rw_status_t st,
		     int remote, const char *msg);
/* The same for a pair's submission: a page rank's phase fails on its page (the sentence, then
 * status and the owed words: ipc/page.h rw_page_fail), a ring rank's as above. */
void exec_answer_sub_err(exec_t *x, const exec_sub_t *s, rw_status_t st, int remote,
			 const char *msg);
/* A failed pair's rank whose CUDA memory copies the mover queued may still touch (mover op
 * fence, *f where they end, looked at with rw_svc_stage_fenced) gets its error once they
 * landed, never before (a retry would reuse the buffers, a leave unmap them): its CUDA mappings
 * are kept past a leave meanwhile (rw_ipc_client_keep). Once a GPU they wait on is declared stalled (gpu_stall_ms) the answer
 * goes out naming it, and the mappings stay until the copies land (a late copy never reaches
 * memory the daemon unmapped). Answered now when they already landed or the GPU is stalled. */
void exec_answer_late(exec_t *x, const exec_sub_t *s, const rw_svc_stage_fence_t *f,
		      rw_status_t st, int remote, const char *msg);
/* A rank that leaves a pair with such copies queued: its CUDA mappings kept until they landed
 * (no answer: it is gone). */
void exec_answer_late_keep(exec_t *x, rw_ipc_client_t *client, const rw_svc_stage_fence_t *f);
/* From the loop's every turn: the held answers whose copies landed or whose GPU stalled, and
 * the owed flags whose GPU moves again (written). */
void exec_answer_late_sweep(exec_t *x);
/* The client left: nothing more is sent it, its owed flags are dropped (logged); its mappings
 * stay until its copies landed. */
void exec_answer_late_gone(exec_t *x, const rw_ipc_client_t *client);
/* Shutdown's drain (rw_svc_exec_ipc_stop): of the held entries whose copies have not landed
 * (*held_p), how many wait on no stalled GPU (returned); the GPUs they wait on in *devs_p (bit
 * d: the stalled one where there is one, else every device of the entry's fence). */
unsigned exec_answer_late_moving(exec_t *x, unsigned *held_p, uint64_t *devs_p);
/* The daemon stops: every held answer goes now (naming the stalled GPU where its copies have
 * not landed). The keeps of those whose copies landed are dropped; the others' stay with the
 * IPC server, which then leaves their mappings open to the process's exit (ipc/ipc.h
 * rw_ipc_server_destroy), never closed under a copy. Owed flags whose GPU moved are written,
 * those whose GPU is still stalled dropped, logged (the rank's stream waits on it as on the
 * hung GPU). */
void exec_answer_late_flush(exec_t *x);
/* Refuse a joining rank: RW_ERR_INVAL (its world or node does not fit this cluster),
 * RW_ERR_EXISTS (its rank is taken), RW_ERR_NOMEM. */
void exec_drop_client(exec_t *x, rw_ipc_client_t *client, rw_status_t st);
void exec_answer_dispatch(exec_t *x, exec_pair_t *p, uint32_t g);
void exec_answer_combine(exec_t *x, exec_pair_t *p, uint32_t g);

/* ---- exec_keys.c: failed keys, ended attempts, early rows --------------------------------- */
/* A phase that failed here, as it ends its key (exec_key_end). */
typedef struct exec_key_end {
	const char *group;           /* the group's name; NULL: no local rank of it is here */
	const rw_wire_key_t *key;
	rw_svc_phase_kind_t kind;
	rw_status_t st;
	const char *msg;             /* why, for the ranks that come late and for the peers */
	uint32_t answered;           /* local ranks that already have their error */
	uint32_t either;             /* page ranks whose done of the failed dispatch came as the
				      * status went out: each reads either (exec.c pair_failed),
				      * so its combine is refused with msg and a dispatch of the
				      * key again is its retry */
	uint32_t epoch;              /* this node's attempt (its count row's epoch), or an id */
	uint32_t cause_node, cause_id; /* where the failure began, and its id there */
	const uint32_t *taken;       /* [N] per node: the epoch of its row the pair took, 0 none;
				      * NULL: no pair */
	exec_tell_t tell;
} exec_key_end_t;
/* The one place that ends a failed key: the peers' attempts it ends are remembered (their rows
 * the pair took, or that wait here), the key becomes a tomb (later ranks get msg at once), the
 * failure itself is remembered (it may come back, passed on), and the peers are told as
 * e->tell says. The caller has closed its pair: whatever telling triggers finds it closed. */
void exec_key_end(exec_t *x, const exec_key_end_t *e);
/* Whether a submission of `kind` by local rank `local` runs into a failed phase (a tomb that
 * applies to it): 1, with the failure's reason in why; 0 when none applies. Changes nothing. */
int exec_tomb_check(const exec_t *x, const rw_wire_key_t *key, rw_svc_phase_kind_t kind,
		    uint32_t local, char *why, size_t len);
/* A page rank's combine of `key` whose dispatch failed after its rows came (its done was in,
 * or came as it failed: an `either` rank): 1 with the failure's reason, as exec_tomb_check. */
int exec_tomb_late(const exec_t *x, const rw_wire_key_t *key, uint32_t local, char *why,
		   size_t len);
/* The submission exec_tomb_check looked at went its way: a tomb that applied counts the rank's
 * answer; one too old, or one the rank already had its answer from (its retry), goes. */
void exec_tomb_pass(exec_t *x, const rw_wire_key_t *key, rw_svc_phase_kind_t kind,
		    uint32_t local);
/* A dispatch tomb of `key` exists (its peers' count rows are dead). */
int exec_tomb_exists(exec_t *x, const rw_wire_key_t *key);
/* The count row of peer's attempt `epoch` came while key's dispatch is a tomb here: a local rank
 * still owes its answer to the failed phase, so this attempt cannot complete here. Tell that
 * peer now (a PHASE_ERR naming its attempt) instead of letting it wait for a phase timeout. */
void exec_tomb_tell(exec_t *x, const rw_wire_key_t *key, uint32_t peer, uint32_t epoch);
void exec_tomb_left(exec_t *x, uint32_t group_hash, uint32_t local);
void exec_ended_add(exec_t *x, const rw_wire_key_t *key, uint32_t node, uint32_t epoch);
int exec_ended_find(const exec_t *x, const rw_wire_key_t *key, uint32_t node, uint32_t epoch);
/* Keep a peer's row that came before our ranks (a newer one of (key, node) replaces it). A row
 * ages out a phase timeout after it came; while a local pair of its key gathers (pair_open, or
 * exec_rows_hold when the pair opens), it lives a phase timeout past the pair's start, so the
 * pair - which takes it at its exchange or ends the key, dropping it - still finds it when it
 * times out in its gather and names that attempt to the peer ("Failures" 5). */
void exec_row_keep(exec_t *x, const rw_wire_counts_t *c, uint32_t peer, int pair_open);
void exec_rows_hold(exec_t *x, const char *group, const rw_wire_key_t *key);
/* Drop early rows: of group (NULL: any) and key, of node (< 0: any), of epoch (0: any). */
void exec_rows_drop(exec_t *x, const char *group, const rw_wire_key_t *key, int node,
		    uint32_t epoch);
void exec_rows_drop_node(exec_t *x, uint32_t node);
/* Hand every early row of the pair's key to exec_plan_take_row, removing them. */
void exec_rows_take(exec_t *x, exec_pair_t *p);
/* Global rank `rank` (of this node) of `group`, whose group key has the fingerprint key_fp, was
 * refused at its hello for `why`: remembered a phase timeout, or until a rank with that key
 * joins the group here (exec_refused_drop). While a seat of the group here is empty,
 * exec_refused_why says why the phases of that key cannot run here (1; 0 when nothing
 * applies), and exec_refused_rows ends the key of every early row of the group with such a
 * refusal, telling the peers (a local pair of the group is the caller's: it fails that one). */
void exec_refused_add(exec_t *x, const char *group, uint32_t rank, const uint8_t *key_fp,
		      const char *why);
void exec_refused_drop(exec_t *x, const char *group, const uint8_t *key_fp);
int exec_refused_why(const exec_t *x, const char *group, const uint8_t *key_fp, char *why,
		     size_t len);
void exec_refused_rows(exec_t *x, const char *group);
/* The index of tombs, ended attempts and early rows (exec_keys.c). */
rw_status_t exec_keys_init(exec_t *x);
void exec_keys_expire(exec_t *x, uint64_t now, uint64_t timeout);
void exec_keys_free(exec_t *x);

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
/* ---- exec_carve.c: the groups' carve-outs --------------------------------------------------- */
/* Rank mb of a group asks for its slab or submits on its page (the first time only; a group
 * none of whose ranks maps a slab holds none of the pool): g->carve, charged to mb's uid, or
 * -1 (off, mb's uid at group_carve_per_uid, the pool spent with no carve-out idle for
 * group_carve_idle_s to take back, or the carve-out could not be made: logged, and why in
 * g->carve_why). Taking one back fails that group's later page phases and slab requests. */
void exec_carve_want(exec_t *x, const exec_member_t *mb);
/* 1 when the group's carve-out was taken back (its ranks' slabs are not what the daemon reads:
 * a page phase is refused), with why and RW_E_LIMIT; 0 otherwise. */
int exec_carve_lost(const exec_group_t *g, char *why, size_t len, int32_t *code_p);
/* A phase completed in pair p's carve-out: its group's idle clock starts again. */
void exec_carve_ran(exec_pair_t *p);
/* The group's last rank left: its reference goes now, or at carve_free_at (exec_carve_tick). */
void exec_carve_drop(exec_t *x, exec_group_t *g);
void exec_carve_tick(exec_t *x, uint64_t now);
/* A rank of the group asks for its slab of `rail` (ipc/ipc.h ops.group_slab): its carve-out's
 * fd (host or GPU memory), bytes and sub-areas; else an RW_E_* code and why (g->carve_why). */
int exec_carve_lend(exec_t *x, const exec_group_t *g, uint32_t rail, rw_ipc_slab_t *slab_p,
		    const char **why_p);
/* Whether no mover's kernel or copy of the (closed) pair p may still land (its shared slot
 * stays out of use until then). */
int exec_movers_settled(const exec_t *x, const exec_pair_t *p);
/* Whether no mover's copy out of or into pair p's carve-out may still land (a hung GPU's may
 * not for long: the pair, and so the carve-out, stays out of the pool until they do). */
int exec_carve_settled(const exec_t *x, const exec_pair_t *p);
/* Shutdown's drain (rw_svc_exec_ipc_stop): closed pairs whose carve-out a mover's copy (a header
 * pull) may still read or write (*held_p), how many of them on no stalled GPU (returned), and
 * their GPUs (*devs_p, bit d). */
unsigned exec_carves_moving(const exec_t *x, unsigned *held_p, uint64_t *devs_p);
/* Shutdown, before the mesh goes (rw_svc_exec_destroy): every carve-out such a copy may still
 * use is left to the process's exit (rw_svc_mesh_carve_leave), named with its GPUs. */
void exec_carves_leave(exec_t *x);

/* The pair's areas of `slot` on every rail (host and, for GPU slabs, device addresses). */
void exec_areas_set(exec_pair_t *p, int slot);
rw_status_t exec_plan_send_row(exec_pair_t *p);        /* COUNTS to every peer */
/* What a pair in ST_COUNT_HOST, ST_COUNT_MOVER or ST_EXCHANGE waits for, in words (a timeout
 * names it). */
void exec_plan_waiting(const exec_pair_t *p, char *buf, size_t len);
/* row: N*R counts; view: that node's rail view, R weights then N up-masks (NULL: already in
 * p->xchg.view_*). */
void exec_plan_take_row(exec_pair_t *p, uint32_t node, uint32_t slot,
			const rw_wire_phase_params_t *params, const uint32_t *row, const uint32_t *view);
/* Forget the row a peer sent for an attempt of its that has failed since (its PHASE_ERR named
 * it): its next row of the key takes the place. Only while the pair waits for rows. */
void exec_plan_drop_row(exec_pair_t *p, uint32_t node);
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
int exec_needs_grant(const exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t k, uint32_t s);
void exec_send_begin(exec_pair_t *p, rw_svc_phase_kind_t kind);
/* Post what can be posted now; the state says what it waits for. */
rw_status_t exec_send_progress(exec_pair_t *p);

/* ---- exec_recv.c ------------------------------------------------------------------------- */
rw_status_t exec_recv_init(exec_pair_t *p);
/* The layout is known: the ranges of `kind` this node waits for. */
rw_status_t exec_recv_begin(exec_pair_t *p, rw_svc_phase_kind_t kind);
/* The mover refused what it took of src's range after the fact (RW_MV_OP_REFUSED): the error,
 * blaming src for RW_ERR_PROTO; the caller fails the pair. */
void exec_recv_refused(exec_pair_t *p, uint32_t src, rw_status_t st);
/* Catch up with the bytes of `kind` that came before the layout was known. */
rw_status_t exec_recv_scan(exec_pair_t *p, rw_svc_phase_kind_t kind);
/* `len` bytes of `kind` from peer on rail landed (`last`: the writer's last of the range) at
 * offset `at` of the rail's memory (EXEC_AT_UNKNOWN: the transport does not say). Every write of
 * a range must land right after the one before, inside the range the layout grants that peer
 * in this pair's receive sub-area: anything else fails the pair and blames the writer. */
#define EXEC_AT_UNKNOWN UINT64_MAX
rw_status_t exec_recv_data(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t peer, uint32_t rail, uint64_t len,
			   int last, uint64_t at);
/* What the receiver still waits for, for a timeout message. */
void exec_recv_waiting(const exec_pair_t *p, rw_svc_phase_kind_t kind, char *buf, size_t len);

/* ---- exec_stage.c: the stages, the sender's states, and their legal changes ------------------ */
const char *exec_stage_name(exec_stage_t s);
/* Whether the table lets a pair move from `from` to `to`. */
int exec_stage_legal(exec_stage_t from, exec_stage_t to);
/* The one way a pair's stage changes (only exec.c calls it): a legal change is made; an illegal
 * one is a programming error, logged with both stages' names and refused (RW_ERR_STATE, the
 * stage stays), and the sanitizer build aborts on it. */
rw_status_t exec_stage_move(exec_pair_t *p, exec_stage_t to);
/* The same for the sender of the running kind (p->send.state; exec_send.c calls it). */
const char *exec_send_state_name(exec_send_state_t s);
int exec_send_legal(exec_send_state_t from, exec_send_state_t to);
rw_status_t exec_send_move(exec_pair_t *p, exec_send_state_t to);

/* ---- exec.c: events from the adapters and the mover --------------------------------------- */
exec_pair_t *exec_pair_open(exec_t *x, exec_group_t *g, const rw_wire_key_t *key,
			    const rw_sqe_t *sqe);
exec_pair_t *exec_pair_by_key(exec_t *x, const rw_wire_key_t *key);
exec_pair_t *exec_pair_by_tag(exec_t *x, uint32_t tag14);
/* Fail the pair with what was found here (the peers are told); a failure a leaf already
 * recorded (exec_err) wins. Every local rank with a submission of the running kind gets it. */
void exec_pair_fail(exec_pair_t *p, rw_status_t st, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* A peer's PHASE_ERR fails the pair (every rank is told RW_E_PHASE); its cause travels on in
 * what this node tells: a relayed failure of the attempt our pair took part in goes to every
 * peer, and a first-hand one is passed on (relay) while our count row of it is out. */
void exec_pair_fail_peer(exec_pair_t *p, const rw_wire_phase_err_t *e, const char *msg);
/* The trainer moved on without a combine: close quietly. */
void exec_pair_abandon(exec_pair_t *p);
/* A dispatch of `key` by member mb meets its group's pair `p` gathering another key without
 * mb's dispatch: one of the two keys can never gather every local rank here, since a group's
 * ranks run one sequence of keys. A rank that joined again (SEAT_NEW) went on past the keys its
 * group ran while it was away: the pair's key is the skipped one when mb is new, or when mb
 * already had its answer for that key (its last dispatch; a refused rank's late poison reopened
 * it) (EXEC_SKIP_PAIR: fail the pair, naming mb, then take the dispatch); mb's own when every
 * rank in the pair came new (EXEC_SKIP_MINE: mb's key fails everywhere, exec_key_fail). A
 * rank that submits again the key it last had its answer for (a refused rank's poison of the key
 * its refusal already failed) while its group went on gets that key's failure, alone
 * (EXEC_SKIP_DONE: answered RW_E_PHASE; before, "still running" made railwave's package leave
 * and join again, which failed the next key for every rank). Else
 * EXEC_SKIP_NONE (the caller refuses the dispatch alone: the pair is still running). Changes
 * nothing; why gets the sentence for a skip. */
typedef enum { EXEC_SKIP_NONE = 0, EXEC_SKIP_PAIR, EXEC_SKIP_MINE, EXEC_SKIP_DONE } exec_skip_t;
exec_skip_t exec_dispatch_skip(const exec_t *x, const exec_member_t *mb, const exec_pair_t *p,
			       const rw_wire_key_t *key, char *why, size_t len);
/* The rule of absences (docs/rankpath.md "Failure"): a group's ranks run one sequence of keys,
 * and each local seat answers each key's dispatch (and, once its dispatch is in, the combine)
 * once: by a submission that joins the key's pair, or by an absence. A pair never waits for a seat that is absent: the first absence fails
 * the key on every node at once, naming the seat. The absences:
 *   - its rank's dispatch refused: it has its answer (exec_ipc.c dispatch_refuse, exec_page.c);
 *     a page rank's combine refused or aborted, or its slot of no known kind (its stream went
 *     on; a ring rank's refused combine is its own, to retry or abort);
 *   - its rank left and its leave failed nothing: the next key that a rank not new since its
 *     join dispatches here (SEAT_GAP);
 *   - its rank submits another key while it holds no claim on the pair's: it joined since
 *     (SEAT_NEW) or had its answer for it (SEAT_ON, last) (exec_dispatch_skip, EXEC_SKIP_PAIR;
 *     and, seen from the other side, EXEC_SKIP_MINE).
 * The seat had a dispatch of `key` taken: admitted, refused, or answered by a tomb. */
void exec_seat_took(exec_group_t *g, uint32_t local, const rw_wire_key_t *key);
/* How a seat is absent: its rank's own input was refused (it has its answer: the tomb lets its
 * retry of the key by; the failure is the input's, RW_ERR_INVAL), or it is gone from the key
 * (left, or went on: RW_ERR_CLIENT). */
typedef enum { EXEC_ABSENT_REFUSED = 0, EXEC_ABSENT_GONE } exec_absence_t;
/* Seat `local` of g is absent from `kind` of `key` (why names it, and the seat;
 * EXEC_KIND_ANY: a slot of no known kind, absent from whichever the pair waits for): the key's
 * pair here fails on every node while it still waits for that of the seat — its dispatch while
 * it gathers, its combine from its dispatch on (while the dispatch still runs here, it runs to
 * its end and the pair fails at its combine, as docs/dataflow.md "Failures" has a combine
 * failure); a pair that has the seat's answer changes nothing. With no pair of the key here a
 * dispatch's absence fails the key everywhere (exec_key_fail); a combine no pair waits for is
 * the rank's alone. */
#define EXEC_KIND_ANY RW_SVC_KIND_COUNT
void exec_seat_absent(exec_t *x, exec_group_t *g, uint32_t local, const rw_wire_key_t *key,
		      int kind, exec_absence_t how, const char *why);
/* Dispatch `key` of group `group` fails on every node while no pair of it is open here: local
 * rank `local` had its answer; the key becomes a tomb (later local ranks get why), the peers
 * are told, each of them fails its pair of the key. */
void exec_key_fail(exec_t *x, const char *group, const rw_wire_key_t *key, uint32_t local,
		   const char *why);
/* Submission of local rank g recorded in p->in[kind].sub[g] with p->ph.io[kind][g] resolved. */
void exec_on_submit(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t g);
void exec_on_counts(exec_pair_t *p, uint32_t node, const rw_wire_counts_t *c);
void exec_on_data(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t peer, uint32_t rail,
		  uint64_t len, int last, uint64_t at);
void exec_on_write_done(exec_pair_t *p, uint32_t peer, uint32_t rail, rw_status_t st);
void exec_on_grant(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t wave);
void exec_on_peer_down(exec_t *x, uint32_t peer, rw_status_t st);
/* Rail `rail` to `peer` went down, the peer stays up: fail the pairs whose plan uses it. */
void exec_on_rail_down(exec_t *x, uint32_t peer, uint32_t rail, rw_status_t st);
/* The pair's running kind has page ranks in flight (on 1), or no longer (0): the IPC server's
 * word poller spins while any pair is (rw_ipc_server_pages_busy); each change counted once. */
void exec_page_busy(exec_pair_t *p, int on);
/* A page rank's word (ipc/page.h RW_PW_PACKED, RW_PW_DONE) reached `value`: local rank g of
 * the pair packed (the mover's pack may go on) or is done reading (its finish counts). */
void exec_on_page_word(exec_pair_t *p, uint32_t g, unsigned word, uint64_t value);
/* Local rank `local` of the pair's group left: its data is gone. */
void exec_on_rank_left(exec_pair_t *p, rw_ipc_client_t *client, uint32_t rank);

/* The mover's asynchronous report (rw_svc_mover_done_fn; ctx: the executor). */
void exec_on_mover_done(void *ctx, uint32_t serial, rw_svc_mover_op_t op, uint32_t g,
			rw_status_t st);
/* The executor's watchers: the tick (slot waits, ageing), the idle local work, the reaper. */
void exec_start(exec_t *x);
/* Stop the watchers, fail every open pair ("daemon stopping") and flush the held answers. */
void exec_stop(exec_t *x);
/* Fail every open pair with `why` (the peers are not told); their held answers stay held. */
void exec_fail_open(exec_t *x, const char *why);
/* After the mesh reported every outstanding write: free every pair struct. */
void exec_free_pairs(exec_t *x);
/* No phase is running (a drain may end). */
int exec_drained(exec_t *x);

/* ---- exec_ipc.c / exec_mesh.c ------------------------------------------------------------ */
extern const rw_ipc_server_ops_t exec_ipc_ops;
/* exec_page.c: a rank's page word moved (rw_ipc_server_ops_t.page_word). */
void exec_page_word(void *ctx, rw_ipc_client_t *client, unsigned word, uint64_t value);
/* exec_page.c: page rank mb leaves: the submits its page shows that the poller had not reported
 * yet are taken first, so its leave fails the pair of what it submitted (its seat is absent
 * from that key) instead of leaving its seat to look empty before that key. */
void exec_page_leave(exec_t *x, exec_member_t *mb);
void exec_member_free(exec_member_t *mb);
extern const rw_svc_mesh_cbs_t exec_mesh_cbs;

/* ---- trace.h: phase trace hooks, one branch when tracing is off ----------------------------- */
#include "service/exec/trace.h"
#define EXEC_TRACE(p, call) do { if ((p)->tr) call; } while (0)
enum { EXEC_TRACE_READY = 0, EXEC_TRACE_RUN = 1 }; /* exec_trace_mark_ */

#endif /* RW_SVC_EXEC_INT_H */
