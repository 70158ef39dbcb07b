/* railwaved's phase executor as the daemon sees it (docs/dataflow.md "Phase executor"): created
 * and destroyed by main.c with plain calls. It owns the peer mesh, the node IPC server for the
 * trainer ranks and the data movers, and runs every dispatch/combine pair on the daemon's loop. */
#ifndef RW_SVC_EXEC_H
#define RW_SVC_EXEC_H

#include <stdint.h>

#include "common/common.h"

struct rw_svc;
struct rw_svc_mover_ops;
typedef struct rw_svc_exec rw_svc_exec_t;

/* Test hooks (docs/dataflow.md "Tests"), read in one place by main.c from the environment
 * (RAILWAVE_TEST_CHUNK_KIB, RAILWAVE_TEST_WRITE_GAP_MS, RAILWAVE_TEST_LOCAL_SLICE,
 * RAILWAVE_TEST_DONE_DEAF). Zero: off.
 * They let a test act while writes are in flight, and resume local work record by record. */
typedef struct rw_svc_exec_hooks {
	uint64_t chunk_bytes;        /* cap every rail write at this many bytes */
	double write_gap_s;          /* post one write per this many seconds per pair */
	uint32_t local_slice;        /* local-node records per idle slice */
	/* RAILWAVE_TEST_DONE_DEAF=STEP: 1 + STEP; the loop takes no page rank's done of the
	 * dispatch of layer 0 step STEP (as if the poller's reports came after whatever fails the
	 * pair): the pair waits for them until it fails, the ranks' done in their pages. */
	uint64_t done_deaf_step;
	/* The in-process test's attempt epochs for this node's pairs (0: a random one), so that
	 * it can offer a pair the immediate tag of another; NULL: random. Not from the
	 * environment. */
	uint32_t (*epoch)(void *ctx);
	void *epoch_ctx;
} rw_svc_exec_hooks_t;

/* Parse the hooks from the environment (envp: NULL-terminated "NAME=value"); logs a warning
 * when any is on. */
void rw_svc_exec_hooks_from_env(char *const *envp, rw_svc_exec_hooks_t *hooks_p);

/* Start the mesh (connections complete on the loop) and the executor, with `movers` (tried in
 * order for every pair; the last must accept anything, e.g. the host mover). */
rw_status_t rw_svc_exec_create(struct rw_svc *svc, const struct rw_svc_mover_ops *const *movers,
			       uint32_t n_movers, const rw_svc_exec_hooks_t *hooks,
			       rw_svc_exec_t **exec_p);
/* Open the IPC socket (cfg.ipc_socket): trainer ranks may connect from now on. */
rw_status_t rw_svc_exec_ipc_start(rw_svc_exec_t *x);
/* Fail what is open, close every rank and the socket (before the ranks' buffers go). */
void rw_svc_exec_ipc_stop(rw_svc_exec_t *x);
/* SIGTERM: refuse new phases, let the running ones finish or time out, then rw_svc_stop(). */
void rw_svc_exec_drain(rw_svc_exec_t *x);
/* After the loop returned: fail what is left, tear down the mesh and movers, free. NULL ok. */
void rw_svc_exec_destroy(rw_svc_exec_t *x);

#endif /* RW_SVC_EXEC_H */
