/* `railwave stats`: ask a running railwaved over its stats socket and print the reply.
 *   railwave stats [--node NAME | --socket PATH] [--timeout MS] [COMMAND ...]
 * COMMAND is one of the daemon's stats commands ("stats", "stats rails", "stats peers",
 * "stats phases", "stats selector", "help"); without one, "stats". The daemon ends each reply
 * with a blank line; the tool prints the reply without it. Exit 1 when the daemon is not there
 * or answers with an error line. */
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "tools/tools.h"

static int usage(int rc)
{
	fprintf(rc ? stderr : stdout,
		"usage: railwave stats [--node NAME | --socket PATH] [--timeout MS] [COMMAND ...]\n"
		"  --node NAME    the socket of the default layout, /tmp/railwave/NAME.stats (node0)\n"
		"  --socket PATH  a stats socket path (the daemon's stats_socket)\n"
		"  --timeout MS   give up after MS milliseconds without a reply (2000)\n"
		"  COMMAND        stats | stats rails | stats peers | stats phases | stats selector | help\n");
	return rc;
}

/* Send one command line and copy the reply to stdout up to its terminating blank line. */
static int ask(const char *path, const char *command, int timeout_ms)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	if (strlen(path) >= sizeof(sa.sun_path)) {
		fprintf(stderr, "railwave stats: socket path too long: %s\n", path);
		return 1;
	}
	memcpy(sa.sun_path, path, strlen(path) + 1);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		fprintf(stderr, "railwave stats: cannot connect to %s: %s (is railwaved running?)\n",
			path, strerror(errno));
		if (fd >= 0)
			close(fd);
		return 1;
	}
	char line[512];
	int n = snprintf(line, sizeof(line), "%s\n", command);
	if (n < 0 || (size_t)n >= sizeof(line) || write(fd, line, (size_t)n) != n) {
		fprintf(stderr, "railwave stats: cannot send the command\n");
		close(fd);
		return 1;
	}
	/* Print line by line; a line that is empty ends the reply. */
	char buf[8192];
	size_t have = 0;
	int rc = 1;
	for (;;) {
		struct pollfd pfd = { .fd = fd, .events = POLLIN };
		if (poll(&pfd, 1, timeout_ms) <= 0) {
			fprintf(stderr, "railwave stats: no reply within %d ms\n", timeout_ms);
			break;
		}
		ssize_t got = read(fd, buf + have, sizeof(buf) - 1 - have);
		if (got <= 0) {
			fprintf(stderr, "railwave stats: the daemon closed the connection\n");
			break;
		}
		have += (size_t)got;
		char *start = buf, *nl;
		int done = 0;
		while ((nl = memchr(start, '\n', have - (size_t)(start - buf)))) {
			*nl = '\0';
			if (*start == '\0') {
				done = 1;
				break;
			}
			if (rc == 1)
				rc = strncmp(start, "error", 5) == 0 ? 1 : 0;
			puts(start);
			start = nl + 1;
		}
		if (done)
			break;
		have -= (size_t)(start - buf);
		memmove(buf, start, have);
		if (have == sizeof(buf) - 1) { /* a line longer than the buffer: print it as is */
			fwrite(buf, 1, have, stdout);
			have = 0;
		}
	}
	close(fd);
	return rc;
}

int rw_tool_stats(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "node", required_argument, NULL, 'n' },
		{ "socket", required_argument, NULL, 's' },
		{ "timeout", required_argument, NULL, 't' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	char path[256] = "/tmp/railwave/node0.stats";
	unsigned long long timeout = 2000;
	int opt;
	optind = 1;
	while ((opt = getopt_long(argc, argv, "+n:s:t:h", opts, NULL)) != -1) {
		switch (opt) {
		case 'n':
			snprintf(path, sizeof(path), "/tmp/railwave/%s.stats", optarg);
			break;
		case 's':
			snprintf(path, sizeof(path), "%s", optarg);
			break;
		case 't':
			if (rw_tool_parse_u64("stats", "--timeout", optarg, &timeout) || timeout > 600000)
				return usage(2);
			break;
		case 'h':
			return usage(0);
		default:
			return usage(2);
		}
	}
	char command[256] = "stats";
	if (optind < argc) {
		size_t len = 0;
		command[0] = '\0';
		for (int i = optind; i < argc; i++) {
			int n = snprintf(command + len, sizeof(command) - len, "%s%s", i > optind ? " " : "", argv[i]);
			if (n < 0 || (size_t)n >= sizeof(command) - len) {
				fprintf(stderr, "railwave stats: command too long\n");
				return 2;
			}
			len += (size_t)n;
		}
	}
	return ask(path, command, (int)timeout);
}
