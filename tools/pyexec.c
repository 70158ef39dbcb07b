/* Running the Python half of a subcommand: process glue (starting daemons, reading traces,
 * drawing plots) lives in Python scripts under tools/, which the C entry points exec with the
 * folder of the programs they run (--build). Two layouts: a build tree (<src>/<build>/tools/
 * railwave, the scripts in <src>/tools/) and an install (<prefix>/bin/railwave, the scripts and
 * the programs in <prefix>/libexec/railwave, laid out like a build folder: scripts/install).
 * $RAILWAVE_SRC names another source tree for the scripts. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/tools.h"

/* Cut the last path component off path (in place); 0 when there is none. */
static int path_up(char *path)
{
	char *slash = strrchr(path, '/');
	if (!slash || slash == path)
		return 0;
	*slash = 0;
	return 1;
}

int rw_tool_exec_python(const char *script_name, const char *mode, int argc, char **argv)
{
	char exe[PATH_MAX], build[PATH_MAX], root[PATH_MAX], script[PATH_MAX + 64];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (n <= 0) {
		fprintf(stderr, "railwave %s: cannot find my own binary: %m\n", mode);
		return 1;
	}
	exe[n] = 0;
	/* A build tree: exe = <root>/<build>/tools/railwave, the scripts in <root>/tools. */
	snprintf(build, sizeof(build), "%s", exe);
	if (!path_up(build) || !path_up(build)) {
		fprintf(stderr, "railwave %s: unexpected binary path %s\n", mode, exe);
		return 1;
	}
	snprintf(root, sizeof(root), "%s", build);
	path_up(root);
	snprintf(script, sizeof(script), "%s/tools/%s", root, script_name);
	if (access(script, R_OK) != 0) {
		/* An install: exe = <prefix>/bin/railwave, helpers in <prefix>/libexec/railwave. */
		char installed[PATH_MAX], helpers[PATH_MAX];
		snprintf(installed, sizeof(installed), "%s", exe);
		path_up(installed);
		size_t len = strlen(installed);
		snprintf(installed + len, sizeof(installed) - len, "/../libexec/railwave");
		if (realpath(installed, helpers) != NULL) {
			snprintf(build, sizeof(build), "%s", helpers);
			snprintf(script, sizeof(script), "%s/tools/%s", build, script_name);
		}
	}
	const char *src = getenv("RAILWAVE_SRC");
	if (src && *src)
		snprintf(script, sizeof(script), "%s/tools/%s", src, script_name);
	if (access(script, R_OK) != 0) {
		fprintf(stderr, "railwave %s: no %s next to %s (a build tree, or ../libexec/railwave of an "
			"install: scripts/install), nor under $RAILWAVE_SRC/tools: set RAILWAVE_SRC to the "
			"source tree\n", mode, script_name, exe);
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
