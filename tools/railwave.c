/* `railwave`: the one front end for RailWave's tools. A subcommand is one row of the table
 * below (name, one-line summary, entry point declared in tools/tools.h); `railwave help` lists
 * them. Later subcommands (demo, bench, sim, analyze, calibrate, stats, top) add a row. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/tools.h"

#include "config.h"

static int cmd_help(int argc, char **argv);

static const rw_tool_cmd_t commands[] = {
	{ "help", "list the subcommands (railwave help CMD: that subcommand's options)", cmd_help },
	{ "plan", "plan one phase on the built-in example cluster and print the chosen path", rw_tool_plan },
	{ "bench-plan", "time counts, features, selection, RailBalance, mapping vs. Birkhoff", rw_tool_bench_plan },
	{ "demo", "run the main job on the rail test bed: every path and the selector, verified", rw_tool_demo },
	{ "bench", "sweep skew, size and fan-in: four paths, selector and MPI_Alltoallv side by side", rw_tool_bench },
	{ "stats", "ask a running railwaved over its stats socket (rails, peers, phases, selector)", rw_tool_stats },
	{ "wait", "block until the local railwaved has every peer up on every rail (--timeout S)", rw_tool_wait },
	{ "sim", "simulate one phase of the four paths at scale (lossless PFC and max-min fabric models)", rw_tool_sim },
	{ "calibrate", "time every path on the running daemons, write and hot-load the anchor table; --check", rw_tool_calibrate },
	{ "bench-workload", "a test-bed workload as JSON (counts, features, loads, lower bound); calibrate", rw_tool_bench_workload },
	{ "trace", "phase traces: export to Chrome/Perfetto JSON, or find who was late (trace --help)", rw_tool_trace },
	{ "analyze", "over phase traces: expert vs rail imbalance, features, time / lower bound, other paths", rw_tool_analyze },
	{ "trace-synth", "phase records of synthetic routing (GLM-4.5-Air-shaped) for analyze", rw_tool_trace_synth },
	{ "sim-replay", "recorded count matrices (JSON lines) through the simulator, every path", rw_tool_sim_replay },
	{ "top", "live view of running railwaved daemons over their stats sockets", rw_tool_top },
	{ "size", "the group_area_mib / group_pool_mib the rank path needs for a model's shape", rw_tool_size },
	{ "keygen", "write a new cluster key for peer authentication (mode 0600)", rw_tool_keygen },
};

static const rw_tool_cmd_t *find(const char *name)
{
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		if (strcmp(commands[i].name, name) == 0)
			return &commands[i];
	return NULL;
}

static int cmd_help(int argc, char **argv)
{
	if (argc > 1) {
		const rw_tool_cmd_t *c = find(argv[1]);
		if (!c || c->main == cmd_help) {
			fprintf(stderr, "railwave: no subcommand '%s'\n", argv[1]);
			return 2;
		}
		char *sub[] = { argv[1], "--help", NULL };
		return c->main(2, sub);
	}
	printf("usage: railwave COMMAND [OPTIONS]\n       railwave --version\n\ncommands:\n");
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		printf("  %-12s %s\n", commands[i].name, commands[i].summary);
	printf("\n'railwave COMMAND --help' shows a command's options.\n");
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		cmd_help(1, argv);
		return 2;
	}
	if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)
		return cmd_help(1, argv);
	if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "-V") == 0) {
		printf("railwave %s\n", RW_VERSION);
		return 0;
	}
	const rw_tool_cmd_t *c = find(argv[1]);
	if (!c) {
		fprintf(stderr, "railwave: unknown command '%s' (try 'railwave help')\n", argv[1]);
		return 2;
	}
	return c->main(argc - 1, argv + 1);
}
