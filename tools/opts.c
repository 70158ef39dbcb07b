/* Option-value helpers shared by the `railwave` subcommands (declared in tools/tools.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "tools/tools.h"

int rw_tool_parse_u64(const char *cmd, const char *opt, const char *arg, unsigned long long *out)
{
	char *end;
	errno = 0;
	unsigned long long v = arg ? strtoull(arg, &end, 0) : 0;
	if (!arg || errno || end == arg || *end || arg[0] == '-') {
		fprintf(stderr, "railwave %s: bad value for %s: '%s'\n", cmd, opt, arg ? arg : "");
		return -1;
	}
	*out = v;
	return 0;
}

int rw_tool_parse_double(const char *cmd, const char *opt, const char *arg, double *out)
{
	char *end;
	errno = 0;
	double v = arg ? strtod(arg, &end) : 0.0;
	if (!arg || errno || end == arg || *end) {
		fprintf(stderr, "railwave %s: bad value for %s: '%s'\n", cmd, opt, arg ? arg : "");
		return -1;
	}
	*out = v;
	return 0;
}
