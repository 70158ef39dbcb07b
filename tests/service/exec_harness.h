/* The harness of the in-process executor test (svc_exec; its cases are tests/service/test_exec_*.c,
 * its runner tests/service/test_exec.c): N executors, each with its own rw_svc_t (config from
 * rw_svc_config_load_text, metrics), in this one process on one libev loop, over the fake mesh
 * and fake IPC server of tests/service/exec_fakes.c. The test plays every rank (submissions
 * through the executor's IPC callbacks, host or CUDA buffers) and decides what the network
 * delivers and when; every dispatched row, its metadata and per-expert counts and every combined
 * sum are checked exactly against tests/lib/workload.h (what tests/integration/rw_rank.c runs).
 *
 * The executor's entry points are called from node_start()/node_stop()/node_drain() only
 * (exec_harness.c): the place to change when they are renamed. */
#ifndef RW_TEST_EXEC_HARNESS_H
#define RW_TEST_EXEC_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "cuda/rw_cuda.h"
#include "ipc/railwave.h"
#include "service/exec/exec.h"
#include "service/mover/mover.h"
#include "service/core/svc.h"
#include "service/phase/phase.h"
#include "tests/lib/workload.h"
#include "tests/service/exec_fakes.h"

enum { TOPK = RW_WL_TOPK, MAX_ROWS = 3 * RW_WL_MAX_TOKENS, MAX_RANKS = FK_MAX_NODES * 4,
       MAX_GROUPS = 3 };

/* A failed check: file, line and message through cmocka, then the case fails. */
#define CHECK(cond, ...)                                                                       \
	do {                                                                                   \
		if (!(cond)) {                                                                 \
			print_error("%s:%d: ", __FILE__, __LINE__);                            \
			print_error(__VA_ARGS__);                                              \
			print_error("\n");                                                     \
			fail();                                                                \
		}                                                                              \
	} while (0)

/* ---- the cluster --------------------------------------------------------------------------------- */

typedef struct opts {
	uint32_t nodes, gpus, rails;
	const char *path;          /* "auto", "native", "rail-only", "perm-only", "joint" */
	uint32_t experts;          /* 0: nodes * gpus * 2 */
	uint32_t hidden;           /* 0: 24 */
	uint32_t timeout_ms;       /* 0: 20000 (never reached unless a test waits for it) */
	uint32_t recv_mib;         /* 0: 4 */
	uint32_t tokens;           /* every rank dispatches exactly this many (rw_rank --tokens) */
	int empty;                 /* rw_rank --empty */
	int fifo;                  /* deliver in post order instead of seeded random order */
	uint64_t max_write;        /* 0: 1 MiB */
	uint32_t stay_home;        /* bit n: node n's ranks pick only experts of node n */
	int cuda_mover;            /* list the CUDA mover first, as main.c does (kernel stand-in) */
	int dev_slabs;             /* every rail's slabs in device memory (fk_world_t.dev_slabs) */
} opts_t;

typedef struct trank {
	rw_ipc_client_t *c;
	uint32_t rank, node, local;
	uint32_t buf;
	uint8_t *mem;              /* what the test writes and reads (a CUDA rank's host mirror) */
	rw_cuda_dptr_t dptr;       /* a CUDA rank's buffer (0: host memory, mem itself) */
	uint8_t *mirror;           /* owned by the rank slot, freed with the cluster */
	uint32_t seen;             /* completions consumed */
	rw_sqe_t ds;               /* the last dispatch submitted */
	rw_cqe_t dq;               /* its completion */
} trank_t;

typedef struct cl {
	opts_t o;
	uint32_t N, G, R, W, E, per_rank, hidden;
	uint64_t seed, seed0;      /* seed: the current group's (seed0 for group 0) */
	struct ev_loop *loop;
	fk_world_t *w;
	rw_svc_t svc[FK_MAX_NODES];
	int running[FK_MAX_NODES];
	trank_t rks[MAX_GROUPS][MAX_RANKS];
	char groups[MAX_GROUPS][32];
	trank_t *rk;               /* the current group's ranks (use_group) */
	char *group;
	rw_wl_work_t mine, other;
	uint8_t *seen;
	uint32_t *ecount;
	float *outv;
	size_t in_bytes, out_cap, comb_in, comb_out, total;
	uint64_t off_tok, off_ids, off_w, off_out, off_cin, off_cout;
	/* Node n's attempt epochs come from epoch_fn[n](epoch_ctx[n]) while it is set (0 from it:
	 * a random one); set before the pairs it should choose for open. */
	uint32_t (*epoch_fn[FK_MAX_NODES])(void *ctx);
	void *epoch_ctx[FK_MAX_NODES];
} cl_t;

/* The forced paths in rw_path_t order, then the selector ("auto"). */
extern const char *const path_names[5];

/* The stand-in driver's test hooks, when it is the driver loaded (else NULL): hold(1) keeps every
 * stream's work pending until hold(0); the count of GPUDirect flushes. */
extern void (*fake_cuda_hold)(int);
extern unsigned (*fake_gdr_flushes)(void);

/* Before any case: the seed (RW_EXEC_SEED, printed), the log level (RW_EXEC_LOG), the CUDA
 * stand-in next to the program unless RW_CUDA_DRIVER names another, and its hooks. */
void exec_harness_init(void);

/* A cluster of o->nodes executors, the mesh up, every rank of group 0 connected (host buffers).
 * seed_salt: the case's own salt, so each case's workload and delivery order differ. */
cl_t *cl_new(const opts_t *o, uint64_t seed_salt);
/* Stop every node (everything must be freed: ASan's leak check runs at exit) and check that the
 * fakes saw no contract violation. */
void cl_free(cl_t *c);
/* The ranks, group name and workload seed of group g (several groups share the nodes). */
void use_group(cl_t *c, uint32_t g);
/* The workload of `rank` at (step, layer) in the current group. */
void cl_gen(const cl_t *c, uint32_t step, uint32_t layer, uint32_t rank, rw_wl_work_t *wk);

/* ---- pumping ------------------------------------------------------------------------------------ */

/* One loop iteration without blocking (timers, idle slices), then one network event. */
int pump_once(cl_t *c);
/* Deliver until nothing is deliverable for a while (held events stay queued). */
void settle(cl_t *c);
typedef int (*pred_fn)(cl_t *c, const void *arg);
/* Pump until pred holds; 20 s without it fails the case (a hang; nothing asserts on time). */
void pump_until(cl_t *c, pred_fn pred, const void *arg, const char *what);
int mesh_up(cl_t *c, const void *arg); /* every node sees every other */

uint32_t n_cqe(const trank_t *t); /* completions rank t has received */
/* The next completion of rank r (pumping until it comes). */
rw_cqe_t next_cqe(cl_t *c, uint32_t r);
void expect_no_cqe(cl_t *c, uint32_t r);
void expect_err(cl_t *c, uint32_t r, int err, const char *when);
/* The completion must already be there (answered inside the submission, no network, no time). */
void expect_err_now(cl_t *c, uint32_t r, int err, const char *when);

/* ---- nodes and ranks ----------------------------------------------------------------------------- */

void node_start(cl_t *c, uint32_t n);
void node_drain(cl_t *c, uint32_t n);
void node_stop(cl_t *c, uint32_t n);
void rank_connect(cl_t *c, uint32_t r);
/* The same rank with its one buffer in CUDA memory (the stand-in's, or the GPU's when svc_exec
 * runs on the real driver): the executor stages it, the test reads and writes a host mirror. */
void rank_connect_cuda(cl_t *c, uint32_t r);
void node_ranks_connect(cl_t *c, uint32_t n);
/* Node n's process dies: peers see it down; its executor is torn down here. Its ranks are
 * dropped first, each failing its pair on its own: rw_svc_ipc_stop's loop over open pairs frees
 * a pair under itself (see test_bug_stop_with_open_pair), so a node is never stopped with a pair
 * open in the main group. */
void node_crash(cl_t *c, uint32_t n);

/* ---- one rank's dispatch and combine, checked exactly (rw_rank's checks) ------------------------ */

typedef struct sub_opts {
	uint32_t n_experts;        /* 0: the cluster's */
	uint8_t dtype;             /* 0: the phase's */
	uint32_t tokens_buf;       /* 0: the rank's buffer */
	int32_t bad_id;            /* != 0: token 0's first id becomes this */
	uint64_t output_capacity;  /* 0: all of it */
	int local_only;            /* every id moved to an expert of the rank's own node */
	uint32_t wait_event;       /* != 0: stream-ordered (RW_SQE_WAIT_EVENT) on this event id */
	uint32_t signal_event;     /* != 0: RW_SQE_SIGNAL, flag_value into this event's flag */
	uint32_t flag_value;
} sub_opts_t;

void dispatch_submit(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const sub_opts_t *so);
/* Check rank r's dispatch completion exactly and write its combine input (expert outputs). */
void dispatch_check(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const rw_cqe_t *cq);
rw_sqe_t combine_sqe(cl_t *c, uint32_t r, uint32_t step, uint32_t layer);
void combine_submit(cl_t *c, uint32_t r, uint32_t step, uint32_t layer);
/* Rank r gives up its combine of (step, layer): that combine with RW_SQE_ABORT and no data
 * (ipc/railwave.h "Failing a pair by its key"). */
void abort_submit(cl_t *c, uint32_t r, uint32_t step, uint32_t layer);
void combine_check(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const rw_cqe_t *cq);
/* Every rank's dispatch completion, checked exactly. */
void dispatch_collect(cl_t *c, uint32_t step, uint32_t layer);
/* Every rank's combine, submitted and checked exactly. */
void combine_all(cl_t *c, uint32_t step, uint32_t layer);
/* Every rank dispatches and combines (step, layer) in seeded orders, submissions interleaved
 * with network events; everything checked exactly. */
void run_pair(cl_t *c, uint32_t step, uint32_t layer);
/* Every rank's dispatch, completions collected and checked. */
void dispatch_all(cl_t *c, uint32_t step, uint32_t layer);
/* Every rank submits its dispatch of (step, layer), then settle: held events stay queued and
 * nothing is collected (the case decides what each rank gets). */
void dispatch_submit_all(cl_t *c, uint32_t step, uint32_t layer);

/* After dispatch_collect of (step, layer): every rank's combine rows rewritten so that an owner
 * token's sum depends on the order of its terms (+-2^30 from two ranks of its own node, +-2^27
 * from the first two other nodes when there are more, small ones from the rest), then every
 * rank's combine, with the last node's rows reaching node 0 before node 0's ranks submit and
 * before the other nodes' rows (rows_first), or after node 0's local work, in node order; every
 * result checked against the order docs/dataflow.md "Combine" defines. Returns the owner tokens
 * another order would sum differently: on two nodes, those with two terms at home and one away;
 * on more, those sent to three other nodes or more. */
uint32_t combine_order_check(cl_t *c, uint32_t step, uint32_t layer, int rows_first);

/* ---- after a failure ---------------------------------------------------------------------------- */

/* Every rank retries the failed key (step, layer) at once, as a trainer does once the failure
 * has reached every node: the retry must pass at once on every node, with no refusal and no
 * timer (a late PHASE_ERR of the failed attempt names that attempt - its cause, and the epoch of
 * the receiver's row it had - so it cannot fail or poison the retry; docs/dataflow.md
 * "Failures"). Everything is checked exactly. */
void retry_key(cl_t *c, uint32_t step, uint32_t layer);
/* Rank r's phase (step, layer) failed elsewhere: its dispatch gets RW_E_PHASE, or - its node had
 * every byte of its part before the failure reached it - completes (checked exactly) and its
 * combine gets RW_E_PHASE. */
void expect_phase_err(cl_t *c, uint32_t r, uint32_t step, uint32_t layer, const char *when);
/* No failure under test may have needed a phase timeout. */
void expect_no_timeouts(cl_t *c);
/* After a failure that took ranks [gone, gone_end) away (a lost node's, or one rank) and answered
 * every other rank: settle; no other rank has a completion left over, and no node needed a phase
 * timeout. */
void expect_quiet_but(cl_t *c, uint32_t gone, uint32_t gone_end);

/* ---- holding events back ------------------------------------------------------------------------ */

typedef struct match {
	int kind;                  /* fk_ev_kind_t or -1 */
	int type;                  /* control type or -1 */
	int src, dst;              /* -1: any */
	int wkind;                 /* writes: immediate kind 0/1, or -1 */
} match_t;

#define ANY -1
/* Hold back every event that matches m (up to 8 patterns) until release_all. */
void hold(cl_t *c, match_t m);
void release_all(cl_t *c);
match_t m_ctrl(int type, int src, int dst);
match_t m_write(int src, int dst, int wkind);
match_t m_wdone(int src);

/* ---- corrupting a write ------------------------------------------------------------------------- */

/* With c->w->on_write = corrupt_tag and corrupt_once = 1: the first dispatch write from node 1 to
 * node 0 arrives with its first record's tag flipped; corrupt_once is 0 once it has. With
 * c->w->on_write_ctx pointing at a uint32_t 1, the first combine write instead. */
extern int corrupt_once;
void corrupt_tag(const fk_ev_t *ev, uint8_t *dst, void *ctx);

#endif /* RW_TEST_EXEC_HARNESS_H */
