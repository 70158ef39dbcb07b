/* `railwave trace`, `railwave analyze`, `railwave top` (docs/tools.md "Seeing what the fabric
 * does"): reading JSON-lines phase traces, the stats sockets and drawing plots is glue, done by
 * tools/observe.py, which these entry points run (tools/pyexec.c). */
#include "tools/tools.h"

int rw_tool_trace(int argc, char **argv) { return rw_tool_exec_python("observe.py", "trace", argc, argv); }
int rw_tool_analyze(int argc, char **argv) { return rw_tool_exec_python("observe.py", "analyze", argc, argv); }
int rw_tool_top(int argc, char **argv) { return rw_tool_exec_python("observe.py", "top", argc, argv); }
