/* A pair's stages (docs/dataflow.md "Phase executor"): their names, the table of legal changes,
 * and the one function every change goes through (exec.c, the state machine, calls it). A pair
 * runs GATHER_D -> COUNT_HOST or COUNT_MOVER -> [WAIT_SLOT ->] EXCHANGE -> RUN_D -> FLUSH_D ->
 * WAIT_C -> RUN_C -> FLUSH_C -> CLOSED, and any stage may close (a failure, an abandoned pair,
 * a dispatch that completes while the daemon drains). The sender of the running kind has states
 * of its own (exec_send.c changes them), checked the same way. Anything else is a bug in the
 * state machine: refused and logged, and fatal in the sanitizer build so that the tests catch
 * it. */
#include <stdlib.h>

#include "config.h"
#include "service/exec/exec_int.h"

static const char *const stage_names[EXEC_STAGES] = {
	[ST_GATHER_D] = "GATHER_D", [ST_COUNT_HOST] = "COUNT_HOST", [ST_COUNT_MOVER] = "COUNT_MOVER",
	[ST_WAIT_SLOT] = "WAIT_SLOT", [ST_EXCHANGE] = "EXCHANGE", [ST_RUN_D] = "RUN_D",
	[ST_FLUSH_D] = "FLUSH_D", [ST_WAIT_C] = "WAIT_C", [ST_RUN_C] = "RUN_C",
	[ST_FLUSH_C] = "FLUSH_C", [ST_CLOSED] = "CLOSED",
};

#define TO(s) (1u << (s))

/* next[from]: the stages `from` may move to. */
static const uint32_t next[EXEC_STAGES] = {
	/* every rank's dispatch is in: the mover counts (asked at once), or the host (once every
	 * rank's ids are readable) */
	[ST_GATHER_D] = TO(ST_COUNT_HOST) | TO(ST_COUNT_MOVER) | TO(ST_CLOSED),
	/* counted: our row goes out in a free slot, or waits for one */
	[ST_COUNT_HOST] = TO(ST_WAIT_SLOT) | TO(ST_EXCHANGE) | TO(ST_CLOSED),
	[ST_COUNT_MOVER] = TO(ST_WAIT_SLOT) | TO(ST_EXCHANGE) | TO(ST_CLOSED),
	[ST_WAIT_SLOT] = TO(ST_EXCHANGE) | TO(ST_CLOSED),
	/* every row is here and the records are built: decided */
	[ST_EXCHANGE] = TO(ST_RUN_D) | TO(ST_CLOSED),
	[ST_RUN_D] = TO(ST_FLUSH_D) | TO(ST_CLOSED),
	/* the outputs are written: the dispatch completes (closing while the daemon drains) */
	[ST_FLUSH_D] = TO(ST_WAIT_C) | TO(ST_CLOSED),
	[ST_WAIT_C] = TO(ST_RUN_C) | TO(ST_CLOSED),
	[ST_RUN_C] = TO(ST_FLUSH_C) | TO(ST_CLOSED),
	[ST_FLUSH_C] = TO(ST_CLOSED),
	[ST_CLOSED] = 0,
};

const char *exec_stage_name(exec_stage_t s)
{
	return (unsigned)s < EXEC_STAGES ? stage_names[s] : "?";
}

int exec_stage_legal(exec_stage_t from, exec_stage_t to)
{
	return (unsigned)from < EXEC_STAGES && (unsigned)to < EXEC_STAGES && (next[from] & TO(to));
}

/* An illegal change: the executor's bug, named, refused. */
static rw_status_t refused(const exec_pair_t *p, const char *what, const char *from, const char *to)
{
	rw_err("layer %u step %llu: illegal %s change %s -> %s refused (executor bug)", p->key.layer,
	       (unsigned long long)p->key.step, what, from, to);
	if (RW_SANITIZE)
		abort();
	return RW_ERR_STATE;
}

rw_status_t exec_stage_move(exec_pair_t *p, exec_stage_t to)
{
	if (!exec_stage_legal(p->stage, to))
		return refused(p, "stage", exec_stage_name(p->stage), exec_stage_name(to));
	p->stage = to;
	return RW_OK;
}

/* ---- the sender (exec_send.c) ------------------------------------------------------------- */

static const char *const send_names[EXEC_SEND_STATES] = {
	[SEND_IDLE] = "IDLE", [SEND_WAIT_GRANT] = "WAIT_GRANT", [SEND_POSTING] = "POSTING",
	[SEND_PACED] = "PACED", [SEND_WAIT_PACK] = "WAIT_PACK", [SEND_DRAINING] = "DRAINING",
	[SEND_DONE] = "DONE",
};

/* send_next[from]: the states `from` may move to. A wave is started from IDLE or from the last
 * wave's DRAINING (once its destination granted, WAIT_GRANT), posted (POSTING) until its writes
 * are out (DRAINING) or it must wait for the pace timer (PACED) or the mover's bytes (WAIT_PACK);
 * after the last wave the kind is DONE, and the next kind starts from IDLE. */
static const uint32_t send_next[EXEC_SEND_STATES] = {
	[SEND_IDLE] = TO(SEND_WAIT_GRANT) | TO(SEND_POSTING) | TO(SEND_DONE),
	[SEND_WAIT_GRANT] = TO(SEND_POSTING),
	[SEND_POSTING] = TO(SEND_PACED) | TO(SEND_WAIT_PACK) | TO(SEND_DRAINING),
	[SEND_PACED] = TO(SEND_POSTING),
	[SEND_WAIT_PACK] = TO(SEND_POSTING),
	[SEND_DRAINING] = TO(SEND_WAIT_GRANT) | TO(SEND_POSTING) | TO(SEND_DONE),
	[SEND_DONE] = TO(SEND_IDLE),
};

const char *exec_send_state_name(exec_send_state_t s)
{
	return (unsigned)s < EXEC_SEND_STATES ? send_names[s] : "?";
}

int exec_send_legal(exec_send_state_t from, exec_send_state_t to)
{
	return (unsigned)from < EXEC_SEND_STATES && (unsigned)to < EXEC_SEND_STATES &&
	       (send_next[from] & TO(to));
}

rw_status_t exec_send_move(exec_pair_t *p, exec_send_state_t to)
{
	if (!exec_send_legal(p->send.state, to))
		return refused(p, "send state", exec_send_state_name(p->send.state),
			       exec_send_state_name(to));
	p->send.state = to;
	return RW_OK;
}
