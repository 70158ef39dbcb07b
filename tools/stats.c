/* `railwave stats` and `railwave wait`: talk to a running railwaved over its stats socket.
 *   railwave stats [--node NAME | --socket PATH] [--timeout MS] [COMMAND ...]
 *   railwave wait  [--node NAME | --socket PATH] [--timeout SECONDS] [--quiet]
 * stats sends one of the daemon's commands ("stats", "stats rails", "ready", "help", ...;
 * default "stats") and prints the reply without its terminating blank line; exit 1 when the
 * daemon is not there or answers with an error line. wait polls "ready" until the daemon says
 * every peer is up on every rail (exit 0) or the timeout passes (exit 1, naming the peers it
 * still waits for, or why the daemon could not be asked). The socket is --socket, else
 * /run/railwave/NAME.stats for --node NAME (the loopback layout), else $RAILWAVE_STATS_SOCKET,
 * else /run/railwave/stats.sock (the systemd unit's and the DaemonSet's). */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/common.h"
#include "tools/tools.h"

#define RUN_DIR "/run/railwave"
#define WAIT_POLL_MS 100

static const char socket_help[] =
	"  --socket PATH  the daemon's stats socket (its stats_socket)\n"
	"  --node NAME    the socket of the loopback layout, " RUN_DIR "/NAME.stats\n"
	"                 (default: $RAILWAVE_STATS_SOCKET, else " RUN_DIR "/stats.sock)\n";

static int stats_usage(int rc)
{
	fprintf(rc ? stderr : stdout,
		"usage: railwave stats [--node NAME | --socket PATH] [--timeout MS] [COMMAND ...]\n"
		"Asks a running railwaved over its stats socket and prints the reply.\n"
		"%s"
		"  --timeout MS   give up after MS milliseconds without a reply (2000)\n"
		"  COMMAND        stats | stats rails | stats peers | stats phases | stats selector |\n"
		"                 stats clients | ready | health | help (default: stats)\n", socket_help);
	return rc;
}

static int wait_usage(int rc)
{
	fprintf(rc ? stderr : stdout,
		"usage: railwave wait [--node NAME | --socket PATH] [--timeout SECONDS] [--quiet]\n"
		"Blocks until railwaved answers and has every peer up on every rail (its /ready).\n"
		"%s"
		"  --timeout S    give up after S seconds (default 60; fractions allowed)\n"
		"  --quiet        print nothing on success\n"
		"Exit status: 0 ready, 1 not ready within the timeout (the reason is printed),\n"
		"2 bad usage.\n", socket_help);
	return rc;
}

/* One command on a fresh connection. The reply (without its blank line) goes to reply, NUL
 * terminated, cut to fit. Returns 0 on a reply, -1 when the socket cannot be reached (errno
 * kept), -2 on a send failure, a timeout or a connection closed before the reply's end; err
 * says which. */
static int query(const char *path, const char *command, int timeout_ms, char *reply,
		 size_t reply_len, char *err, size_t err_len)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	if (strlen(path) >= sizeof(sa.sun_path)) {
		snprintf(err, err_len, "socket path too long: %s", path);
		return -2;
	}
	memcpy(sa.sun_path, path, strlen(path) + 1);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int e = errno;
		/* The sockets are mode 0660 for the daemon's group (docs/install.md): EACCES is a
		 * missing group membership, not a daemon that is down. */
		snprintf(err, err_len, "cannot connect to %s: %s (%s)", path, strerror(e),
			 e == EACCES ? "join group railwave, the sockets' group: usermod -aG railwave "
			 "USER, then log in again" : "is railwaved running?");
		if (fd >= 0)
			close(fd);
		errno = e;
		return -1;
	}
	char line[512];
	int n = snprintf(line, sizeof(line), "%s\n", command);
	if (n < 0 || (size_t)n >= sizeof(line) || write(fd, line, (size_t)n) != n) {
		snprintf(err, err_len, "cannot send the command to %s", path);
		close(fd);
		return -2;
	}
	size_t have = 0;
	int rc = -2;
	reply[0] = '\0';
	for (;;) {
		struct pollfd pfd = { .fd = fd, .events = POLLIN };
		if (poll(&pfd, 1, timeout_ms) <= 0) {
			snprintf(err, err_len, "no reply from %s within %d ms", path, timeout_ms);
			break;
		}
		char buf[4096];
		ssize_t got = read(fd, buf, sizeof(buf));
		if (got <= 0) {
			snprintf(err, err_len, "%s closed the connection before the reply ended", path);
			break;
		}
		size_t copy = RW_MIN((size_t)got, reply_len - 1 - have);
		memcpy(reply + have, buf, copy);
		have += copy;
		reply[have] = '\0';
		/* The reply ends with an empty line: "\n\n" (or a lone "\n" for an empty reply). */
		char *end = strstr(reply, "\n\n");
		if (end || !strcmp(reply, "\n")) {
			if (end)
				end[1] = '\0';
			else
				reply[0] = '\0';
			rc = 0;
			break;
		}
		if (have == reply_len - 1) {
			snprintf(err, err_len, "reply from %s longer than %zu bytes", path, reply_len);
			break;
		}
	}
	close(fd);
	return rc;
}

/* Parse the socket options shared by stats and wait; returns 1 if opt was one of them. */
static int socket_opt(int opt, const char *arg, char *path, size_t len)
{
	if (opt == 'n')
		snprintf(path, len, RUN_DIR "/%s.stats", arg);
	else if (opt == 's')
		snprintf(path, len, "%s", arg);
	else
		return 0;
	return 1;
}

static void socket_default(char *path, size_t len)
{
	const char *env = getenv("RAILWAVE_STATS_SOCKET");
	snprintf(path, len, "%s", env && *env ? env : RUN_DIR "/stats.sock");
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
	char path[256];
	socket_default(path, sizeof(path));
	unsigned long long timeout = 2000;
	int opt;
	optind = 1;
	while ((opt = getopt_long(argc, argv, "+n:s:t:h", opts, NULL)) != -1) {
		if (socket_opt(opt, optarg, path, sizeof(path)))
			continue;
		switch (opt) {
		case 't':
			if (rw_tool_parse_u64("stats", "--timeout", optarg, &timeout) || timeout > 600000)
				return stats_usage(2);
			break;
		case 'h':
			return stats_usage(0);
		default:
			return stats_usage(2);
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
	static char reply[1 << 20];
	char err[512];
	if (query(path, command, (int)timeout, reply, sizeof(reply), err, sizeof(err)) != 0) {
		fprintf(stderr, "railwave stats: %s\n", err);
		return 1;
	}
	fputs(reply, stdout);
	return strncmp(reply, "error", 5) == 0 ? 1 : 0;
}

static double now_s(void) { return (double)rw_now_ns() * 1e-9; }

int rw_tool_wait(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "node", required_argument, NULL, 'n' },
		{ "socket", required_argument, NULL, 's' },
		{ "timeout", required_argument, NULL, 't' },
		{ "quiet", no_argument, NULL, 'q' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	char path[256];
	socket_default(path, sizeof(path));
	double timeout = 60;
	int quiet = 0, opt;
	optind = 1;
	while ((opt = getopt_long(argc, argv, "+n:s:t:qh", opts, NULL)) != -1) {
		if (socket_opt(opt, optarg, path, sizeof(path)))
			continue;
		switch (opt) {
		case 't':
			if (rw_tool_parse_double("wait", "--timeout", optarg, &timeout))
				return wait_usage(2);
			if (!(timeout >= 0 && timeout <= 86400)) {
				fprintf(stderr, "railwave wait: --timeout %s: expected 0 to 86400 seconds\n",
					optarg);
				return 2;
			}
			break;
		case 'q':
			quiet = 1;
			break;
		case 'h':
			return wait_usage(0);
		default:
			return wait_usage(2);
		}
	}
	if (optind < argc) {
		fprintf(stderr, "railwave wait: unexpected argument '%s'\n", argv[optind]);
		return wait_usage(2);
	}
	double deadline = now_s() + timeout;
	char reply[16384], err[512] = "";
	for (;;) {
		double left = deadline - now_s();
		int ask_ms = (int)RW_MIN(2000.0, RW_MAX(left * 1e3, 100.0));
		int rc = query(path, "ready", ask_ms, reply, sizeof(reply), err, sizeof(err));
		if (rc == 0 && !strncmp(reply, "ready yes\n", 10)) {
			if (!quiet)
				printf("railwave wait: %s ready after %.1f s\n", path,
				       timeout - (deadline - now_s()));
			return 0;
		}
		if (rc == 0 && strncmp(reply, "ready no\n", 9) != 0) {
			fprintf(stderr, "railwave wait: unexpected reply from %s:\n%s", path, reply);
			return 1;
		}
		/* A missing or refused socket is a daemon still starting: keep trying. */
		if (now_s() >= deadline)
			break;
		struct timespec ts = { 0, WAIT_POLL_MS * 1000000L };
		nanosleep(&ts, NULL);
	}
	if (reply[0] && !strncmp(reply, "ready no\n", 9))
		fprintf(stderr, "railwave wait: %s not ready after %g s:\n%s", path, timeout,
			reply + 9);
	else
		fprintf(stderr, "railwave wait: not ready after %g s: %s\n", timeout, err);
	return 1;
}
