/* `railwave calibrate` (docs/tools.md "Calibrating the anchor table"): starting rank programs,
 * timing them and signalling daemons is glue, done by tools/calibrate.py (tools/pyexec.c); the
 * retention rule it applies is sched/'s, through `railwave bench-workload calibrate`. */
#include "tools/tools.h"

int rw_tool_calibrate(int argc, char **argv)
{
	return rw_tool_exec_python("calibrate.py", "calibrate", argc, argv);
}
