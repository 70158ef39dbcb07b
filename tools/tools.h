/* The `railwave` front end's subcommands (tools/railwave.c holds the table). Each subcommand
 * takes argc/argv starting at its own name and returns the process exit status (0 ok, 1 failed,
 * 2 usage error). Private to tools/. */
#ifndef RW_TOOLS_H
#define RW_TOOLS_H

#include <stddef.h>

#include "sched/sched.h"

typedef int (*rw_tool_main_t)(int argc, char **argv);

typedef struct rw_tool_cmd {
	const char *name;
	const char *summary; /* one line for `railwave help` */
	rw_tool_main_t main;
} rw_tool_cmd_t;

int rw_tool_plan(int argc, char **argv);       /* tools/plan.c */
int rw_tool_bench_plan(int argc, char **argv); /* tools/bench_plan.c */
int rw_tool_bench_workload(int argc, char **argv); /* tools/bench_workload.c */
int rw_tool_demo(int argc, char **argv);        /* tools/demo.c */
int rw_tool_keygen(int argc, char **argv);      /* tools/keygen.c */
int rw_tool_size(int argc, char **argv);        /* tools/size.c */
int rw_tool_bench(int argc, char **argv);       /* tools/demo.c */
int rw_tool_stats(int argc, char **argv);       /* tools/stats.c */
int rw_tool_wait(int argc, char **argv);        /* tools/stats.c */
int rw_tool_sim(int argc, char **argv);         /* tools/sim_cmd.c */
int rw_tool_trace(int argc, char **argv);       /* tools/observe.c */
int rw_tool_analyze(int argc, char **argv);     /* tools/observe.c */
int rw_tool_top(int argc, char **argv);         /* tools/observe.c */
int rw_tool_calibrate(int argc, char **argv);   /* tools/calibrate.c */
int rw_tool_sim_replay(int argc, char **argv);  /* tools/sim_replay.c */
int rw_tool_trace_synth(int argc, char **argv); /* tools/trace_synth.c */

/* Exec `python3 -u <source>/tools/SCRIPT MODE --build <build dir> argv[1..]` (tools/pyexec.c);
 * returns 1 (with a message) only when that cannot be done. */
int rw_tool_exec_python(const char *script, const char *mode, int argc, char **argv);

/* Shared option helpers (tools/railwave.c): parse a whole decimal / floating argument or
 * print "railwave CMD: bad value for OPT" and return -1. */
int rw_tool_parse_u64(const char *cmd, const char *opt, const char *arg, unsigned long long *out);
int rw_tool_parse_double(const char *cmd, const char *opt, const char *arg, double *out);

/* Read and parse an anchor table file (tools/plan.c). On error writes a message naming PATH
 * (for a parse error "PATH: reason", the parser's message naming the bad field) into err and
 * leaves *table empty. */
rw_status_t rw_tool_load_anchors(const char *path, rw_anchor_table_t *table, char *err,
				 size_t err_len);

#endif /* RW_TOOLS_H */
