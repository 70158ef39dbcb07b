/* A pair's stages (docs/dataflow.md "Phase executor"): their names, the table of legal changes,
 * and the one function every change goes through (exec.c, the state machine, calls it). A pair
 * runs GATHER_D -> COUNT_HOST or COUNT_MOVER -> [WAIT_SLOT ->] EXCHANGE -> RUN_D -> FLUSH_D ->
 * WAIT_C -> RUN_C -> FLUSH_C -> CLOSED, and any stage may close (a failure, an abandoned pair,
 * a dispatch that completes while the daemon drains). Anything else is a bug in the state
 * machine: refused and logged, and fatal in the sanitizer build so that the tests catch it. */
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

rw_status_t exec_stage_move(exec_pair_t *p, exec_stage_t to)
{
	if (!exec_stage_legal(p->stage, to)) {
		rw_err("layer %u step %llu: illegal stage change %s -> %s refused (executor bug)",
		       p->key.layer, (unsigned long long)p->key.step, exec_stage_name(p->stage),
		       exec_stage_name(to));
		if (RW_SANITIZE)
			abort();
		return RW_ERR_STATE;
	}
	p->stage = to;
	return RW_OK;
}
