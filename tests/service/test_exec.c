/* In-process test of railwaved's phase executor (docs/dataflow.md "Tests"): N executors in this
 * one process on one libev loop, over the fake mesh and fake IPC server of
 * tests/service/exec_fakes.c (harness: exec_harness.h). The test plays every rank and decides
 * what the network delivers and when. It pins today's behaviour so that a refactor of service/
 * can be run against it: every path and the selector, checked exactly (every dispatched row, its
 * metadata and per-expert counts, every combined sum; the workload of tests/lib/workload.h, which
 * tests/integration/rw_rank.c runs too); the receiver grants; early and late count rows;
 * tombstones, timeouts, relayed PHASE_ERR and same-key retries; a peer and a rank lost in every
 * stage; bad input from ranks and peers; several groups and the receive slots; the drain. Every
 * case ends by stopping every node, and the fakes check the executor's contracts (one completion
 * per submission, none after a rank left); under ASan nothing may leak.
 *
 * The cases, by family, one cmocka group each: test_exec_paths.c, test_exec_failures.c,
 * test_exec_bad_input.c, test_exec_leave.c, test_exec_groups.c, test_exec_gpu.c, and
 * test_exec_bugs.c (svc_exec_fixed_bugs: bugs of the executor before the split, reproduced first,
 * kept as regression tests).
 *
 * Run: build/test/svc_exec. RW_EXEC_SEED=n replays the seeded delivery orders and workloads
 * (printed first); RW_EXEC_ONLY=pattern runs some cases (cmocka filter over every group, e.g.
 * "test_peer*"); RW_EXEC_LOG=warn|info|debug shows the executors' logs. Deterministic in what the
 * network does for a seed; the executors' own timers (phase timeout, slot tick) run on the real
 * clock. */
#include "tests/service/test_exec.h"

#include <stdlib.h>

int main(void)
{
	exec_harness_init();
	const char *only = getenv("RW_EXEC_ONLY"); /* a cmocka filter: "test_drain", "test_paths*" */
	if (only && *only)
		cmocka_set_test_filter(only);
	int rc = exec_paths_run();
	rc += exec_failures_run();
	rc += exec_bad_input_run();
	rc += exec_leave_run();
	rc += exec_groups_run();
	rc += exec_gpu_run();
	rc += exec_bugs_run();
	return rc ? 1 : 0;
}
