/* Running the Python half of a subcommand: process glue (starting daemons, reading traces,
 * drawing plots) lives in Python scripts under tools/, which the C entry points exec with the build directory
 * this binary lives in. The script is found in the source tree next to the build directory, or
 * under $RAILWAVE_SRC. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/tools.h"

int rw_tool_exec_python(const char *script_name, const char *mode, int argc, char **argv)
{
	char exe[PATH_MAX], build[PATH_MAX], script[PATH_MAX + 64];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (n <= 0) {
		fprintf(stderr, "railwave %s: cannot find my own binary: %m\n", mode);
		return 1;
	}
	exe[n] = 0;
	/* exe = <root>/<build>/tools/railwave */
	snprintf(build, sizeof(build), "%s", exe);
	for (int up = 0; up < 2; up++) {
		char *slash = strrchr(build, '/');
		if (!slash) {
			fprintf(stderr, "railwave %s: unexpected binary path %s\n", mode, exe);
			return 1;
		}
		*slash = 0;
	}
	const char *src = getenv("RAILWAVE_SRC");
	if (src && *src) {
		snprintf(script, sizeof(script), "%s/tools/%s", src, script_name);
	} else {
		char root[PATH_MAX];
		snprintf(root, sizeof(root), "%s", build);
		char *slash = strrchr(root, '/');
		if (slash)
			*slash = 0;
		snprintf(script, sizeof(script), "%s/tools/%s", root, script_name);
	}
	if (access(script, R_OK) != 0) {
		fprintf(stderr, "railwave %s: %s: %m (set RAILWAVE_SRC to the source tree)\n", mode, script);
		return 1;
	}
	char **args = calloc((size_t)argc + 6, sizeof(char *));
	if (!args)
		return 1;
	int i = 0;
	args[i++] = "python3";
	args[i++] = "-u";
	args[i++] = script;
	args[i++] = (char *)mode;
	args[i++] = "--build";
	args[i++] = build;
	for (int a = 1; a < argc; a++)
		args[i++] = argv[a];
	args[i] = NULL;
	fflush(stdout);
	execvp("python3", args);
	fprintf(stderr, "railwave %s: cannot run python3: %s\n", mode, strerror(errno));
	free(args);
	return 1;
}
