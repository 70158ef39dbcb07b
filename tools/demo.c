/* `railwave demo` and `railwave bench`: the main job on the rail test bed (docs/demo.md).
 * The numbers come from C (railwaved, the rank program tools/bench_rank.c and sched/ through
 * `railwave bench-workload`); starting namespaces, daemons, ranks and mpirun, collecting their
 * output and drawing the plot is process glue, done by tools/bench_bed.py, which these entry
 * points run with the build directory this binary lives in. */

#include "tools/tools.h"

static int run_bed(const char *mode, int argc, char **argv)
{
	return rw_tool_exec_python("bench_bed.py", mode, argc, argv);
}

int rw_tool_demo(int argc, char **argv) { return run_bed("demo", argc, argv); }
int rw_tool_bench(int argc, char **argv) { return run_bed("bench", argc, argv); }
