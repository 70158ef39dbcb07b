/* railwaved stats, metrics and Prometheus endpoint, over real sockets:
 *  - metrics: histogram buckets and percentiles, reconnect counting, the decision ring;
 *  - the stats server on a real libev loop in a thread: every command answers; unknown commands
 *    keep the connection; binary, overlong and stalled (slowloris) clients get an error and a
 *    disconnect while other clients keep being served; the client limit; stale/live sockets;
 *  - HTTP: a real GET on 127.0.0.1 with an ephemeral port, the exposition format parsed and
 *    checked (a counter's value and labels, a histogram's cumulative buckets), 404 and 405;
 *  - the real railwaved binary: stats over its socket, SIGHUP anchor reload (a bad table is
 *    refused and the old one kept), SIGTERM exits 0 and removes the socket.
 * Waits have a 10 s ceiling only to turn a hang into a failure; nothing asserts on time. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "service/core/svc.h"
#include "service/mover/mover.h"

static char railwaved_path[512];

#define CEILING_MS 10000

/* ---------------------------------------------------------------------------------------------
 * Socket helpers
 * ------------------------------------------------------------------------------------------- */

static void set_ceiling(int fd)
{
	struct timeval tv = {CEILING_MS / 1000, 0};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

static int connect_unix(const char *path)
{
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	assert_true(fd >= 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		close(fd);
		return -1;
	}
	set_ceiling(fd);
	return fd;
}

static void send_all(int fd, const void *data, size_t len)
{
	const char *p = data;
	while (len) {
		ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		assert_true(n > 0);
		p += n;
		len -= (size_t)n;
	}
}

static void send_str(int fd, const char *s) { send_all(fd, s, strlen(s)); }

static size_t count_terminators(const char *s, size_t len)
{
	size_t n = 0;
	for (size_t i = 0; i + 1 < len; i++)
		if (s[i] == '\n' && s[i + 1] == '\n') {
			n++;
			i++;
		}
	return n;
}

/* Read until `replies` replies (each ends with an empty line) have arrived, or EOF. Returns a
 * malloc'd NUL-terminated string; *eof_p (may be NULL) says whether the server closed. */
static char *read_replies(int fd, size_t replies, int *eof_p)
{
	size_t cap = 1 << 16, len = 0;
	char *buf = malloc(cap);
	assert_non_null(buf);
	int eof = 0;
	while (count_terminators(buf, len) < replies || replies == 0) {
		if (len + 4096 > cap) {
			cap *= 2;
			buf = realloc(buf, cap);
			assert_non_null(buf);
		}
		ssize_t n = recv(fd, buf + len, cap - len - 1, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			buf[len] = '\0';
			print_error("no reply within %d ms; got so far: \"%s\"\n", CEILING_MS, buf);
			fail();
		}
		if (n <= 0) { /* EOF, or a reset after the server closed with unread input */
			eof = 1;
			break;
		}
		len += (size_t)n;
	}
	buf[len] = '\0';
	if (eof_p)
		*eof_p = eof;
	return buf;
}

static char *ask(int fd, const char *cmd)
{
	send_str(fd, cmd);
	int eof = 0;
	char *r = read_replies(fd, 1, &eof);
	assert_false(eof);
	return r;
}

/* Wait (with the ceiling) until the server closes the connection; returns what came first. */
static char *read_to_eof(int fd) { return read_replies(fd, 0, NULL); }

static void sleep_ms(long ms)
{
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Metrics
 * ------------------------------------------------------------------------------------------- */

static void test_hist_buckets(void **state)
{
	(void)state;
	/* Buckets tile the line: each value lies in [upper(b-1), upper(b)), widths <= 25%. */
	uint64_t prev_upper = 0;
	for (uint32_t b = 0; b + 1 < RW_SVC_HIST_BUCKETS; b++) {
		uint64_t up = rw_svc_hist_upper(b);
		assert_true(up > prev_upper);
		if (b > 0)
			assert_true((double)up <= (double)prev_upper * 1.25 + 1e-9);
		prev_upper = up;
	}
	assert_true(rw_svc_hist_upper(RW_SVC_HIST_BUCKETS - 1) == UINT64_MAX);
	uint64_t x = 88172645463325252ull;
	for (int i = 0; i < 100000; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		uint64_t v = x >> (x % 40); /* spread over many magnitudes */
		uint32_t b = rw_svc_hist_bucket(v);
		assert_true(b < RW_SVC_HIST_BUCKETS);
		assert_true(v < rw_svc_hist_upper(b));
		if (b > 0)
			assert_true(v >= rw_svc_hist_upper(b - 1));
	}
	assert_int_equal(rw_svc_hist_bucket(0), 0);
	assert_int_equal(rw_svc_hist_bucket(1023), 0);
	assert_int_equal(rw_svc_hist_bucket(1024), 1);
	assert_int_equal(rw_svc_hist_bucket(UINT64_MAX), RW_SVC_HIST_BUCKETS - 1);
}

static void test_hist_quantiles(void **state)
{
	(void)state;
	rw_svc_hist_t h;
	memset(&h, 0, sizeof(h));
	assert_true(rw_svc_hist_quantile(&h, 0.5) == 0);
	for (uint64_t us = 1; us <= 100; us++)
		rw_svc_hist_add(&h, us * 1000);
	assert_int_equal(h.count, 100);
	assert_int_equal(h.sum_ns, 5050 * 1000);
	assert_int_equal(h.max_ns, 100000);
	/* The q-quantile sample is v = q*100 us; the estimate is its bucket's upper bound: never
	 * below v, at most 25% above, and never above the maximum. */
	const double qs[] = {0.01, 0.5, 0.9, 0.99, 1.0};
	for (size_t i = 0; i < RW_ARRAY_SIZE(qs); i++) {
		double v = qs[i] * 100 * 1000;
		uint64_t est = rw_svc_hist_quantile(&h, qs[i]);
		assert_true((double)est >= v);
		assert_true((double)est <= v * 1.25);
		assert_true(est <= h.max_ns);
	}
	assert_int_equal(rw_svc_hist_quantile(&h, 1.0), 100000);
}

static void test_metrics_helpers(void **state)
{
	(void)state;
	rw_svc_metrics_t m;
	assert_int_equal(rw_svc_metrics_init(&m, 4, 3), RW_OK);
	/* First UP is not a reconnect; UP after a loss is. */
	rw_svc_metrics_peer_state(&m, 1, RW_SVC_PEER_CONNECTING);
	rw_svc_metrics_peer_state(&m, 1, RW_SVC_PEER_UP);
	assert_int_equal(m.peer[1].reconnects, 0);
	rw_svc_metrics_peer_state(&m, 1, RW_SVC_PEER_FAILED);
	rw_svc_metrics_peer_state(&m, 1, RW_SVC_PEER_CONNECTING);
	rw_svc_metrics_peer_state(&m, 1, RW_SVC_PEER_UP);
	rw_svc_metrics_peer_state(&m, 1, RW_SVC_PEER_UP); /* repeated: no change */
	assert_int_equal(m.peer[1].reconnects, 1);
	rw_svc_metrics_peer_state(&m, 9, RW_SVC_PEER_UP); /* out of range: ignored */
	rw_svc_metrics_tx(&m, 9, 1, 1, 1);                /* likewise */
	rw_svc_metrics_rail_dev(&m, 9, 1, 1);             /* likewise */
	/* The device counters are the transport's totals: stored, not added. */
	rw_svc_metrics_rail_dev(&m, 2, 100, 1);
	rw_svc_metrics_rail_dev(&m, 2, 250, 3);
	assert_int_equal(m.rail[2].wire_tx_bytes, 250);
	assert_int_equal(m.rail[2].pace_waits, 3);
	assert_int_equal(m.rail[1].wire_tx_bytes, 0);

	rw_svc_metrics_error(&m, RW_ERR_PEER);
	rw_svc_metrics_error(&m, RW_ERR_PEER);
	rw_svc_metrics_error(&m, RW_ERR_FATAL);
	rw_svc_metrics_error(&m, (rw_status_t)-1000);
	assert_int_equal(m.errors[20], 2);
	assert_int_equal(m.errors[61], 1);
	assert_int_equal(m.errors[RW_SVC_ERR_KINDS - 1], 1);

	/* The decision ring keeps the newest RW_SVC_DECISIONS. */
	rw_features_t f;
	memset(&f, 0, sizeof(f));
	rw_selection_t sel = {RW_PATH_JOINT, RW_SELECT_NO_TABLE, -1, 0};
	for (uint32_t i = 0; i < 100; i++) {
		f.f[0] = i;
		rw_svc_metrics_decision(&m, 0, i, 0, &f, &sel);
	}
	assert_int_equal(m.n_decisions, 100);
	assert_int_equal(m.selected[RW_PATH_JOINT][RW_SELECT_NO_TABLE], 100);
	const rw_svc_decision_t *newest = &m.decision[(100 - 1) % RW_SVC_DECISIONS];
	assert_int_equal(newest->seq, 100);
	assert_int_equal(newest->layer, 99);
	assert_true(newest->feat.f[0] == 99);

	/* Publishing: a reader sees the state as of the last publish, not the live one. */
	rw_svc_metrics_pub_t pub;
	rw_svc_metrics_t out;
	assert_int_equal(rw_svc_metrics_pub_init(&pub, 4, 3), RW_OK);
	assert_int_equal(rw_svc_metrics_init(&out, 4, 3), RW_OK);
	assert_int_equal(rw_svc_metrics_read(&pub, &out), 0);
	rw_svc_metrics_tx(&m, 2, 100, 1, 5);
	rw_svc_metrics_publish(&pub, &m);
	rw_svc_metrics_tx(&m, 2, 50, 1, 5);
	assert_int_equal(rw_svc_metrics_read(&pub, &out), 1);
	assert_int_equal(out.rail[2].tx_bytes, 100);
	assert_int_equal(out.peer[1].reconnects, 1);
	assert_true(out.peer != m.peer);
	rw_svc_metrics_fini(&out);
	rw_svc_metrics_pub_fini(&pub);
	rw_svc_metrics_fini(&m);
}

/* ---------------------------------------------------------------------------------------------
 * A daemon object with known metrics, and a stats server on a loop thread
 * ------------------------------------------------------------------------------------------- */

typedef struct fixture {
	rw_svc_t svc;
	char dir[64];
	char sock[100];
	pthread_t thread;
	ev_async stop;
} fixture_t;

static void fill_metrics(rw_svc_metrics_t *m)
{
	rw_svc_metrics_tx(m, 1, 12345, 10, 1000000);
	rw_svc_metrics_rx(m, 1, 777, 3, 2000000);
	rw_svc_metrics_rail_dev(m, 1, 12345 + 64 * 10 + 48, 6); /* + frame headers and acks */
	rw_svc_metrics_peer_state(m, 1, RW_SVC_PEER_UP);
	rw_svc_metrics_peer_state(m, 1, RW_SVC_PEER_FAILED);
	rw_svc_metrics_peer_state(m, 1, RW_SVC_PEER_UP);
	m->peer[1].rails_up = 2;
	rw_svc_metrics_peer_state(m, 2, RW_SVC_PEER_CONNECTING);
	for (uint64_t us = 1; us <= 100; us++)
		rw_svc_metrics_phase(m, RW_PATH_JOINT, RW_SVC_DISPATCH, 1, us * 1000);
	rw_svc_metrics_phase(m, RW_PATH_JOINT, RW_SVC_DISPATCH, 0, 0);
	rw_svc_metrics_phase(m, RW_PATH_NATIVE, RW_SVC_COMBINE, 0, 0);
	rw_features_t f;
	memset(&f, 0, sizeof(f));
	f.f[0] = 3.5;
	f.f[1] = 0.25;
	f.f[2] = 0.5;
	f.max_fan_in = 2;
	rw_selection_t sel = {RW_PATH_JOINT, RW_SELECT_ANCHOR, 7, 0.125};
	rw_svc_metrics_decision(m, 1, 3, 42, &f, &sel);
	for (int i = 0; i < 3; i++)
		rw_svc_metrics_error(m, RW_ERR_PEER);
	rw_svc_metrics_error(m, RW_ERR_TIMEOUT);
	m->clients = 2;
}

static const char cluster3[] =
	"{\"cluster\": \"unit\", \"http\": \"127.0.0.1:0\", \"nodes\": ["
	"{\"name\": \"a\", \"rails\": [\"127.0.0.1\", \"127.0.1.1\"]},"
	"{\"name\": \"b\", \"rails\": [\"127.0.0.2\", \"127.0.1.2\"]},"
	"{\"name\": \"c\", \"rails\": [\"127.0.0.3\", \"127.0.1.3\"]}]}";

static void svc_init(fixture_t *f, const char *timeout_ms)
{
	memset(f, 0, sizeof(*f));
	snprintf(f->dir, sizeof(f->dir), "/tmp/rw_stats_XXXXXX");
	assert_non_null(mkdtemp(f->dir));
	snprintf(f->sock, sizeof(f->sock), "%s/stats.sock", f->dir);
	rw_svc_kv_t flags[] = {{"node", "a"}, {"stats_socket", f->sock},
			       {"stats_timeout_ms", timeout_ms}};
	char err[256];
	assert_int_equal(rw_svc_config_load_text(cluster3, NULL, flags, RW_ARRAY_SIZE(flags),
						 &f->svc.cfg, err, sizeof(err)), RW_OK);
	assert_int_equal(rw_svc_metrics_init(&f->svc.metrics, f->svc.cfg.rails, f->svc.cfg.n_nodes),
			 RW_OK);
	assert_int_equal(rw_svc_metrics_pub_init(&f->svc.pub, f->svc.cfg.rails, f->svc.cfg.n_nodes),
			 RW_OK);
	fill_metrics(&f->svc.metrics);
}

static void svc_fini(fixture_t *f)
{
	rw_svc_metrics_pub_fini(&f->svc.pub);
	rw_svc_metrics_fini(&f->svc.metrics);
	rw_svc_config_free(&f->svc.cfg);
	rmdir(f->dir);
}

static void stop_cb(struct ev_loop *loop, ev_async *w, int revents)
{
	(void)w;
	(void)revents;
	ev_break(loop, EVBREAK_ALL);
}

static void *loop_main(void *arg)
{
	fixture_t *f = arg;
	ev_run(f->svc.loop, 0);
	return NULL;
}

static fixture_t *server_start(const char *timeout_ms)
{
	fixture_t *f = calloc(1, sizeof(*f));
	assert_non_null(f);
	svc_init(f, timeout_ms);
	f->svc.loop = ev_loop_new(EVFLAG_AUTO);
	assert_non_null(f->svc.loop);
	ev_async_init(&f->stop, stop_cb);
	ev_async_start(f->svc.loop, &f->stop);
	assert_int_equal(rw_svc_stats_start(&f->svc, &f->svc.stats), RW_OK);
	assert_non_null(f->svc.stats);
	assert_int_equal(pthread_create(&f->thread, NULL, loop_main, f), 0);
	return f;
}

static void server_stop(fixture_t *f)
{
	ev_async_send(f->svc.loop, &f->stop);
	pthread_join(f->thread, NULL);
	rw_svc_stats_stop(f->svc.stats);
	struct stat sb;
	assert_true(stat(f->sock, &sb) != 0); /* the socket file is removed */
	ev_async_stop(f->svc.loop, &f->stop);
	ev_loop_destroy(f->svc.loop);
	svc_fini(f);
	free(f);
}

/* Parse "key=value" out of a reply line that starts with `prefix`. */
static double field_of(const char *reply, const char *prefix, const char *key)
{
	const char *line = strstr(reply, prefix);
	if (!line) {
		print_error("no line starting with \"%s\" in:\n%s\n", prefix, reply);
		fail();
	}
	const char *end = strchr(line, '\n');
	char pat[64];
	snprintf(pat, sizeof(pat), " %s=", key);
	const char *p = strstr(line, pat);
	assert_true(p && (!end || p < end));
	return strtod(p + strlen(pat), NULL);
}

static void test_stats_commands(void **state)
{
	(void)state;
	fixture_t *f = server_start("10000");
	int fd = connect_unix(f->sock);
	assert_true(fd >= 0);

	char *r = ask(fd, "stats\n");
	assert_non_null(strstr(r, "cluster unit\n"));
	assert_non_null(strstr(r, "node a\n"));
	assert_non_null(strstr(r, "peers_up 1/2\n"));
	assert_non_null(strstr(r, "clients 2\n"));
	assert_non_null(strstr(r, "stats_clients 1\n"));
	assert_non_null(strstr(r, "phases_ok 100\n"));
	assert_non_null(strstr(r, "phases_failed 2\n"));
	assert_non_null(strstr(r, "decisions 1\n"));
	assert_non_null(strstr(r, "anchors none\n"));
	assert_non_null(strstr(r, "error_peer 3\n"));
	assert_non_null(strstr(r, "error_timeout 1\n"));
	assert_non_null(strstr(r, "errors 4\n"));
	free(r);

	r = ask(fd, "stats rails\n");
	assert_true(field_of(r, "rail=1 ", "tx_bytes") == 12345);
	assert_true(field_of(r, "rail=1 ", "tx_records") == 10);
	assert_true(field_of(r, "rail=1 ", "rx_bytes") == 777);
	assert_true(field_of(r, "rail=1 ", "tx_busy_s") == 0.001);
	assert_true(field_of(r, "rail=0 ", "tx_bytes") == 0);
	assert_true(field_of(r, "rail=1 ", "wire_tx_bytes") == 12345 + 64 * 10 + 48);
	assert_true(field_of(r, "rail=1 ", "pace_waits") == 6);
	assert_true(field_of(r, "rail=0 ", "wire_tx_bytes") == 0);
	assert_true(field_of(r, "rail=0 ", "pace_waits") == 0);
	free(r);

	r = ask(fd, "  stats   peers \r\n"); /* extra blanks and CRLF are fine */
	assert_non_null(strstr(r, "peer=0 name=a state=self"));
	assert_non_null(strstr(r, "peer=1 name=b state=up rails_up=2 reconnects=1"));
	assert_non_null(strstr(r, "peer=2 name=c state=connecting"));
	free(r);

	r = ask(fd, "stats phases\n");
	assert_true(field_of(r, "path=joint kind=dispatch", "ok") == 100);
	assert_true(field_of(r, "path=joint kind=dispatch", "failed") == 1);
	double p50 = field_of(r, "path=joint kind=dispatch", "p50_us");
	double p99 = field_of(r, "path=joint kind=dispatch", "p99_us");
	assert_true(p50 >= 50 && p50 <= 62.5);
	assert_true(p99 >= 99 && p99 <= 100);
	assert_true(field_of(r, "path=joint kind=dispatch", "mean_us") == 50.5);
	assert_true(field_of(r, "path=native kind=combine", "failed") == 1);
	free(r);

	r = ask(fd, "stats selector\n");
	assert_non_null(strstr(r, "mode auto\n"));
	assert_non_null(strstr(r, "selected path=joint reason=anchor count=1\n"));
	assert_true(field_of(r, "decision seq=1", "case") == 7);
	assert_true(field_of(r, "decision seq=1", "layer") == 3);
	assert_true(field_of(r, "decision seq=1", "f1") == 0.25);
	assert_true(field_of(r, "decision seq=1", "fan_in") == 2);
	free(r);

	r = ask(fd, "help\n");
	assert_non_null(strstr(r, "stats selector"));
	free(r);

	/* Unknown commands: an error line, and the connection stays usable. */
	const char *unknown[] = {"bogus\n", "stats nope\n", "stats rails extra\n", "HELP\n"};
	for (size_t i = 0; i < RW_ARRAY_SIZE(unknown); i++) {
		r = ask(fd, unknown[i]);
		assert_true(!strncmp(r, "error unknown command", 21));
		free(r);
	}
	/* A line of exactly the limit (4095 bytes + newline) is still a line. */
	char *longline = malloc(RW_SVC_STATS_LINE_MAX + 1);
	memset(longline, 'x', RW_SVC_STATS_LINE_MAX - 1);
	longline[RW_SVC_STATS_LINE_MAX - 1] = '\n';
	longline[RW_SVC_STATS_LINE_MAX] = '\0';
	r = ask(fd, longline);
	assert_true(!strncmp(r, "error unknown command", 21));
	free(r);
	free(longline);
	r = ask(fd, "stats\n");
	assert_non_null(strstr(r, "node a\n"));
	free(r);

	/* Pipelined commands in one write, blank lines ignored: replies in order. */
	send_str(fd, "help\n\nstats rails\nstats peers\n");
	int eof = 0;
	r = read_replies(fd, 3, &eof);
	assert_false(eof);
	char *h = strstr(r, "stats selector"), *ra = strstr(r, "rail=0"), *pe = strstr(r, "peer=0");
	assert_true(h && ra && pe && h < ra && ra < pe);
	free(r);

	/* Many small commands without reading in between: all answered, in order. */
	char batch[200 * 5 + 1];
	for (int i = 0; i < 200; i++)
		memcpy(batch + i * 5, "help\n", 5);
	batch[sizeof(batch) - 1] = '\0';
	send_str(fd, batch);
	r = read_replies(fd, 200, &eof);
	assert_false(eof);
	free(r);

	close(fd);
	server_stop(f);
}

/* GPU sets as the logs and the stats name them: "0,2" (rw_svc_gpu_list), whether one of a set
 * is stalled (rw_svc_gpus_stalled, naming the first), and the stats' "gpus_stalled" line. */
static void test_gpu_sets(void **state)
{
	(void)state;
	char list[16], why[160];
	rw_svc_gpu_list(0, list, sizeof(list));
	assert_string_equal(list, "");
	rw_svc_gpu_list(1ull << 0 | 1ull << 2 | 1ull << 63, list, sizeof(list));
	assert_string_equal(list, "0,2,63");
	rw_svc_gpu_list(0x3ffull, list, 8); /* cut to the buffer, terminated */
	assert_string_equal(list, "0,1,2,3");

	/* A pair's sets: its ranks' CUDA spans (both kinds), its GPU slabs, its GPU carve-out; host
	 * memory (-1) and ordinals past 63 are no bit, nor ranks and rails past the pair's. */
	static rw_svc_phase_t ph;
	ph.gpus = 2;
	ph.rails = 2;
	for (int k = 0; k < RW_SVC_KIND_COUNT; k++)
		for (int g = 0; g < RW_MAX_GPUS; g++) {
			rw_svc_rank_io_t *io = &ph.io[k][g];
			io->in[0].dev = io->in[1].dev = io->in[2].dev = io->out.dev = -1;
		}
	for (int r = 0; r < RW_MAX_RAILS; r++)
		ph.slab_dev[r] = ph.slab_gpu[r] = -1;
	ph.io[0][0].in[1].dev = 3;
	ph.io[1][1].out.dev = 4;
	ph.io[1][1].in[0].dev = 70;
	ph.io[0][2].out.dev = 9; /* rank 2: not the pair's */
	ph.slab_dev[1] = 6;
	ph.slab_gpu[0] = 7;
	ph.slab_gpu[2] = 8; /* rail 2: not the pair's */
	assert_int_equal(rw_svc_rank_io_devs(&ph.io[1][1]), 1ull << 4);
	assert_int_equal(rw_svc_phase_devs(&ph, RW_SVC_DEVS_RANKS), 1ull << 3 | 1ull << 4);
	assert_int_equal(rw_svc_phase_devs(&ph, RW_SVC_DEVS_RANKS | RW_SVC_DEVS_SLABS),
			 1ull << 3 | 1ull << 4 | 1ull << 6);
	assert_int_equal(rw_svc_phase_devs(&ph, RW_SVC_DEVS_CARVE), 1ull << 7);
	rw_svc_gpu_list(rw_svc_phase_devs(&ph, RW_SVC_DEVS_RANKS | RW_SVC_DEVS_SLABS |
					  RW_SVC_DEVS_CARVE), list, sizeof(list));
	assert_string_equal(list, "3,4,6,7");

	assert_false(rw_svc_gpus_stalled(1ull << 2 | 1ull << 5, why, sizeof(why)));
	rw_svc_gpu_stall(5, rw_now_ns());
	rw_svc_gpu_stall(2, rw_now_ns());
	assert_false(rw_svc_gpus_stalled(1ull << 0 | 1ull << 3, why, sizeof(why)));
	assert_true(rw_svc_gpus_stalled(1ull << 0 | 1ull << 5 | 1ull << 2, why, sizeof(why)));
	assert_non_null(strstr(why, "GPU 2 is stalled")); /* the first of the set */
	assert_true(rw_svc_gpus_stalled(1ull << 5, NULL, 0));

	for (int moved = 0; moved < 2; moved++) {
		if (moved) {
			rw_svc_gpu_moved(5, 1);
			rw_svc_gpu_moved(2, 1);
			assert_false(rw_svc_gpus_stalled(UINT64_MAX, NULL, 0));
		}
		fixture_t *f = server_start("10000"); /* the table is the loop's: set before it runs */
		int fd = connect_unix(f->sock);
		assert_true(fd >= 0);
		char *r = ask(fd, "stats\n");
		assert_non_null(strstr(r, moved ? "\ngpus_stalled 0\ngpu_held_bytes 0\n"
						: "\ngpus_stalled 2 2,5\ngpu_held_bytes 0\n"));
		free(r);
		close(fd);
		server_stop(f);
	}
}

static void test_stats_garbage(void **state)
{
	(void)state;
	fixture_t *f = server_start("10000");
	int good = connect_unix(f->sock);
	assert_true(good >= 0);
	char *r = ask(good, "stats\n");
	free(r);

	/* Binary input: error and disconnect. */
	int bad = connect_unix(f->sock);
	const unsigned char bin[] = {'s', 't', 0x00, 0xff, 0x13, 0x37, '\n'};
	send_all(bad, bin, sizeof(bin));
	r = read_to_eof(bad);
	assert_string_equal(r, "error binary input, closing\n\n");
	free(r);
	close(bad);

	/* A TLS ClientHello-ish blob (high bytes, no newline). */
	bad = connect_unix(f->sock);
	const unsigned char tls[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc};
	send_all(bad, tls, sizeof(tls));
	r = read_to_eof(bad);
	assert_non_null(strstr(r, "error binary input"));
	free(r);
	close(bad);

	/* Overlong line: error and disconnect; the server never buffers more than one line. */
	bad = connect_unix(f->sock);
	char big[RW_SVC_STATS_LINE_MAX + 100];
	memset(big, 'a', sizeof(big));
	send_all(bad, big, sizeof(big));
	r = read_to_eof(bad);
	assert_string_equal(r, "error line too long (limit 4096 bytes), closing\n\n");
	free(r);
	close(bad);

	/* A client that connects and vanishes mid-line. */
	bad = connect_unix(f->sock);
	send_str(bad, "stat");
	close(bad);

	/* The well-behaved client was served all along. */
	r = ask(good, "stats\n");
	assert_non_null(strstr(r, "node a\n"));
	free(r);
	close(good);
	server_stop(f);
}

static void test_stats_slowloris(void **state)
{
	(void)state;
	fixture_t *f = server_start("200"); /* a line must be finished within 200 ms */
	int slow = connect_unix(f->sock);
	int idle = connect_unix(f->sock);
	int good = connect_unix(f->sock);
	assert_true(slow >= 0 && idle >= 0 && good >= 0);
	send_str(slow, "sta"); /* ... and never the rest */
	char *r = read_to_eof(slow);
	assert_string_equal(r, "error timeout, closing\n\n");
	free(r);
	r = read_to_eof(idle); /* a silent client is dropped the same way */
	assert_string_equal(r, "error timeout, closing\n\n");
	free(r);
	close(slow);
	close(idle);
	/* A fresh client is still served (retried: under heavy load even a prompt client could
	 * miss a 200 ms deadline, which is not what this checks). */
	close(good);
	for (int tries = 0;; tries++) {
		good = connect_unix(f->sock);
		r = ask(good, "help\n");
		int ok = strstr(r, "stats rails") != NULL;
		free(r);
		if (ok)
			break;
		close(good);
		assert_true(tries < 20);
	}
	close(good);
	server_stop(f);
}

static void test_stats_many_clients(void **state)
{
	(void)state;
	fixture_t *f = server_start("10000");
	int fds[RW_SVC_STATS_CLIENTS_MAX];
	for (int i = 0; i < RW_SVC_STATS_CLIENTS_MAX; i++) {
		fds[i] = connect_unix(f->sock);
		assert_true(fds[i] >= 0);
	}
	/* Every one of them is served, interleaved. */
	for (int i = 0; i < RW_SVC_STATS_CLIENTS_MAX; i++)
		send_str(fds[i], "stats\n");
	for (int i = RW_SVC_STATS_CLIENTS_MAX - 1; i >= 0; i--) {
		int eof = 0;
		char *r = read_replies(fds[i], 1, &eof);
		assert_false(eof);
		assert_non_null(strstr(r, "node a\n"));
		free(r);
	}
	char *r = ask(fds[0], "stats\n"); /* every one has been accepted by now */
	assert_non_null(strstr(r, "stats_clients 64\n"));
	free(r);
	/* One more is served: the one that has waited longest (not fds[0], which just asked) is
	 * told why and closed to make room. */
	int extra = connect_unix(f->sock);
	assert_true(extra >= 0);
	r = ask(extra, "help\n");
	assert_non_null(strstr(r, "stats rails"));
	free(r);
	close(extra);
	int told = -1;
	for (int i = 0; i < RW_SVC_STATS_CLIENTS_MAX; i++) {
		char buf[128];
		ssize_t n = recv(fds[i], buf, sizeof(buf) - 1, MSG_DONTWAIT);
		if (n <= 0)
			continue;
		buf[n] = '\0';
		assert_int_equal(told, -1);
		assert_string_equal(buf, "error too many clients: the one waiting longest is closed\n\n");
		told = i;
	}
	assert_true(told > 0);
	for (int i = 0; i < RW_SVC_STATS_CLIENTS_MAX; i++)
		close(fds[i]);
	server_stop(f);
}

/* A slowloris that holds every slot with half a line (within its deadline) does not keep
 * prompt clients out: each new one is served, the longest waiting slow one makes room. */
static void test_stats_slowloris_full(void **state)
{
	(void)state;
	fixture_t *f = server_start("10000");
	int slow[RW_SVC_STATS_CLIENTS_MAX];
	for (int i = 0; i < RW_SVC_STATS_CLIENTS_MAX; i++) {
		slow[i] = connect_unix(f->sock);
		assert_true(slow[i] >= 0);
		send_str(slow[i], "sta");
	}
	int good = connect_unix(f->sock); /* by the time it is answered, every slow one is in */
	char *r = ask(good, "stats\n");
	free(r);
	close(good);
	for (int k = 0; k < 20; k++) {
		good = connect_unix(f->sock);
		assert_true(good >= 0);
		r = ask(good, "help\n");
		assert_non_null(strstr(r, "stats rails"));
		free(r);
		close(good);
	}
	for (int i = 0; i < RW_SVC_STATS_CLIENTS_MAX; i++)
		close(slow[i]);
	server_stop(f);
}

static void test_stats_socket_file(void **state)
{
	(void)state;
	fixture_t f;
	svc_init(&f, "10000");
	f.svc.loop = ev_loop_new(EVFLAG_AUTO);

	/* A stale socket (its owner died without unlinking) is replaced. */
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f.sock);
	assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	close(fd);
	rw_svc_stats_t *s1 = NULL, *s2 = NULL;
	assert_int_equal(rw_svc_stats_start(&f.svc, &s1), RW_OK);
	/* A live one is not stolen. */
	assert_int_equal(rw_svc_stats_start(&f.svc, &s2), RW_ERR_EXISTS);
	assert_null(s2);
	rw_svc_stats_stop(s1);

	/* A regular file is not touched. */
	FILE *file = fopen(f.sock, "w");
	assert_non_null(file);
	fclose(file);
	assert_int_equal(rw_svc_stats_start(&f.svc, &s2), RW_ERR_EXISTS);
	assert_int_equal(access(f.sock, F_OK), 0);
	unlink(f.sock);

	/* An empty path disables the socket. */
	f.svc.cfg.stats_socket[0] = '\0';
	assert_int_equal(rw_svc_stats_start(&f.svc, &s2), RW_OK);
	assert_null(s2);
	ev_loop_destroy(f.svc.loop);
	svc_fini(&f);
}

/* ---------------------------------------------------------------------------------------------
 * Prometheus exposition format
 * ------------------------------------------------------------------------------------------- */

static int count_fds(void)
{
	int n = 0;
	DIR *d = opendir("/proc/self/fd");
	if (!d)
		return -1;
	while (readdir(d))
		n++;
	closedir(d);
	return n;
}

static int valid_name(const char *s, size_t n)
{
	if (!n)
		return 0;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
			 (i > 0 && c >= '0' && c <= '9');
		if (!ok)
			return 0;
	}
	return 1;
}

/* Validate text exposition format 0.0.4: comments, families declared before their samples,
 * well-formed labels, numeric values, histogram buckets cumulative with +Inf == _count. */
static void check_exposition(const char *body)
{
	char types[256][96];
	char kinds[256][16];
	size_t n_types = 0;
	char *copy = strdup(body);
	char *save = NULL;
	double last_bucket = -1;
	char last_series[512] = "";
	for (char *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		if (!strncmp(line, "# HELP ", 7))
			continue;
		if (!strncmp(line, "# TYPE ", 7)) {
			char name[96], kind[16];
			assert_int_equal(sscanf(line + 7, "%95s %15s", name, kind), 2);
			assert_true(valid_name(name, strlen(name)));
			for (size_t i = 0; i < n_types; i++)
				assert_string_not_equal(types[i], name); /* declared once */
			assert_true(!strcmp(kind, "counter") || !strcmp(kind, "gauge") ||
				    !strcmp(kind, "histogram"));
			assert_true(n_types < 256);
			snprintf(types[n_types], sizeof(types[0]), "%s", name);
			snprintf(kinds[n_types], sizeof(kinds[0]), "%s", kind);
			n_types++;
			continue;
		}
		assert_true(line[0] != '#');
		size_t nlen = strcspn(line, "{ ");
		assert_true(valid_name(line, nlen));
		char name[96];
		snprintf(name, sizeof(name), "%.*s", (int)nlen, line);
		/* Its family: the name, or the name without a histogram suffix. */
		const char *kind = NULL;
		for (size_t i = 0; i < n_types && !kind; i++) {
			size_t tl = strlen(types[i]);
			if (!strcmp(types[i], name))
				kind = kinds[i];
			else if (!strncmp(types[i], name, tl) && !strcmp(kinds[i], "histogram") &&
				 (!strcmp(name + tl, "_bucket") || !strcmp(name + tl, "_sum") ||
				  !strcmp(name + tl, "_count")))
				kind = kinds[i];
		}
		if (!kind) {
			print_error("sample before its # TYPE: %s\n", line);
			fail();
		}
		const char *p = line + nlen;
		char labels[512] = "";
		if (*p == '{') {
			const char *end = strchr(p, '}');
			assert_non_null(end);
			snprintf(labels, sizeof(labels), "%.*s", (int)(end - p - 1), p + 1);
			/* k="v" pairs separated by commas */
			const char *q = labels;
			while (*q) {
				size_t kl = strcspn(q, "=");
				assert_true(valid_name(q, kl));
				q += kl;
				assert_true(q[0] == '=' && q[1] == '"');
				q += 2;
				while (*q && *q != '"') {
					if (*q == '\\')
						q++;
					q++;
				}
				assert_int_equal(*q, '"');
				q++;
				if (*q == ',')
					q++;
				else
					assert_int_equal(*q, '\0');
			}
			p = end + 1;
		}
		assert_int_equal(*p, ' ');
		char *vend = NULL;
		double v = strtod(p + 1, &vend);
		assert_true(vend != p + 1 && *vend == '\0');
		if (strstr(name, "_bucket")) {
			/* series = labels without le; cumulative within a series */
			char series[512];
			snprintf(series, sizeof(series), "%s", labels);
			char *le = strstr(series, ",le=");
			assert_non_null(le);
			*le = '\0';
			if (strcmp(series, last_series)) {
				snprintf(last_series, sizeof(last_series), "%s", series);
				last_bucket = -1;
			}
			assert_true(v >= last_bucket);
			last_bucket = v;
		}
	}
	free(copy);
}

/* The value of the sample written exactly as `series` (name plus labels). */
static double sample(const char *body, const char *series)
{
	size_t n = strlen(series);
	for (const char *p = body; (p = strstr(p, series)); p += n)
		if ((p == body || p[-1] == '\n') && p[n] == ' ')
			return strtod(p + n + 1, NULL);
	print_error("no sample %s\n", series);
	fail();
	return -1;
}

static void test_prometheus_text(void **state)
{
	(void)state;
	fixture_t f;
	svc_init(&f, "10000");
	/* The transport's failure counters of a rail, as the mesh samples them (verbs). */
	rw_rail_dev_stats_t dev = { .retry_exceeded = 3, .rnr_retry_exceeded = 1, .conn_failures = 4,
				    .remote_errors = 2, .wc_errors = 5, .write_again = 7 };
	rw_svc_metrics_rail_transport(&f.svc.metrics, 1, &dev);
	rw_svc_buf_t out = {0};
	rw_svc_metrics_prometheus(&f.svc.cfg, &f.svc.metrics, &out);
	assert_false(out.oom);
	check_exposition(out.data);
	const char *b = out.data;
	assert_true(sample(b, "railwave_rail_retry_exceeded_total{rail=\"1\"}") == 3);
	assert_true(sample(b, "railwave_rail_rnr_retry_exceeded_total{rail=\"1\"}") == 1);
	assert_true(sample(b, "railwave_rail_conn_failures_total{rail=\"1\"}") == 4);
	assert_true(sample(b, "railwave_rail_remote_errors_total{rail=\"1\"}") == 2);
	assert_true(sample(b, "railwave_rail_wc_errors_total{rail=\"1\"}") == 5);
	assert_true(sample(b, "railwave_rail_write_again_total{rail=\"1\"}") == 7);
	assert_true(sample(b, "railwave_rail_retry_exceeded_total{rail=\"0\"}") == 0);
	assert_true(sample(b, "railwave_rail_tx_bytes_total{rail=\"1\"}") == 12345);
	assert_true(sample(b, "railwave_rail_tx_busy_seconds_total{rail=\"1\"}") == 0.001);
	assert_true(sample(b, "railwave_rail_wire_tx_bytes_total{rail=\"1\"}") == 12345 + 64 * 10 + 48);
	assert_true(sample(b, "railwave_rail_pace_waits_total{rail=\"1\"}") == 6);
	assert_true(sample(b, "railwave_rail_pace_waits_total{rail=\"0\"}") == 0);
	assert_true(sample(b, "railwave_peer_state{peer=\"b\"}") == RW_SVC_PEER_UP);
	assert_true(sample(b, "railwave_peer_state{peer=\"a\"}") == RW_SVC_PEER_SELF);
	assert_true(sample(b, "railwave_peer_reconnects_total{peer=\"b\"}") == 1);
	assert_true(sample(b, "railwave_phases_total{path=\"joint\",kind=\"dispatch\"}") == 100);
	assert_true(sample(b, "railwave_phase_failures_total{path=\"joint\",kind=\"dispatch\"}") == 1);
	/* 1..100 us: 65 samples <= 2^16 ns, all 100 <= 2^17 ns. */
	assert_true(sample(b, "railwave_phase_duration_seconds_bucket{path=\"joint\",kind=\"dispatch\","
			   "le=\"6.5536e-05\"}") == 65);
	assert_true(sample(b, "railwave_phase_duration_seconds_bucket{path=\"joint\",kind=\"dispatch\","
			   "le=\"0.000131072\"}") == 100);
	assert_true(sample(b, "railwave_phase_duration_seconds_bucket{path=\"joint\",kind=\"dispatch\","
			   "le=\"+Inf\"}") == 100);
	assert_true(sample(b, "railwave_phase_duration_seconds_count{path=\"joint\",kind=\"dispatch\"}") == 100);
	assert_true(sample(b, "railwave_phase_duration_seconds_sum{path=\"joint\",kind=\"dispatch\"}") == 0.00505);
	assert_true(sample(b, "railwave_selector_decisions_total{path=\"joint\",reason=\"anchor\"}") == 1);
	assert_true(sample(b, "railwave_selector_last_feature{feature=\"f1\"}") == 0.25);
	assert_true(sample(b, "railwave_errors_total{kind=\"peer\"}") == 3);
	assert_true(sample(b, "railwave_errors_total{kind=\"timeout\"}") == 1);
	assert_true(sample(b, "railwave_clients") == 2);
	assert_true(sample(b, "railwave_info{cluster=\"unit\",node=\"a\",transport=\"tcp\"}") == 1);
	rw_svc_buf_free(&out);
	svc_fini(&f);
}

/* A minimal HTTP/1.0 client: returns the status code, *body_p = malloc'd body. */
static int http_get(uint16_t port, const char *method, const char *path, char **body_p)
{
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	assert_true(fd >= 0);
	set_ceiling(fd);
	struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(port)};
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	assert_int_equal(connect(fd, (struct sockaddr *)&sin, sizeof(sin)), 0);
	char req[256];
	snprintf(req, sizeof(req), "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", method, path);
	send_str(fd, req);
	char *resp = read_to_eof(fd);
	close(fd);
	int status = 0;
	assert_int_equal(sscanf(resp, "HTTP/1.%*d %d", &status), 1);
	char *body = strstr(resp, "\r\n\r\n");
	assert_non_null(body);
	*body_p = strdup(body + 4);
	free(resp);
	return status;
}

static void test_http(void **state)
{
	(void)state;
#if !RW_HAVE_MHD
	skip();
#endif
	fixture_t f;
	svc_init(&f, "10000");
	int fds_before = count_fds();
	assert_true(f.svc.cfg.http_enabled);
	assert_int_equal(f.svc.cfg.http.port, 0); /* ephemeral */
	rw_svc_metrics_tx(&f.svc.metrics, 0, 4242, 1, 1);
	rw_svc_metrics_publish(&f.svc.pub, &f.svc.metrics);
	rw_svc_metrics_tx(&f.svc.metrics, 0, 1000, 1, 1); /* not published: not visible */
	assert_int_equal(rw_svc_http_start(&f.svc, &f.svc.http), RW_OK);
	uint16_t port = rw_svc_http_port(f.svc.http);
	assert_true(port != 0);

	char *body = NULL;
	assert_int_equal(http_get(port, "GET", "/metrics", &body), 200);
	check_exposition(body);
	assert_true(sample(body, "railwave_rail_tx_bytes_total{rail=\"0\"}") == 4242);
	assert_true(sample(body, "railwave_rail_tx_bytes_total{rail=\"1\"}") == 12345);
	assert_true(sample(body, "railwave_rail_pace_waits_total{rail=\"1\"}") == 6);
	assert_true(sample(body, "railwave_phase_duration_seconds_count{path=\"joint\",kind=\"dispatch\"}") == 100);
	free(body);

	rw_svc_metrics_publish(&f.svc.pub, &f.svc.metrics);
	assert_int_equal(http_get(port, "GET", "/metrics", &body), 200);
	assert_true(sample(body, "railwave_rail_tx_bytes_total{rail=\"0\"}") == 5242);
	free(body);

	assert_int_equal(http_get(port, "GET", "/", &body), 404);
	free(body);
	assert_int_equal(http_get(port, "GET", "/metrics/x", &body), 404);
	free(body);
	assert_int_equal(http_get(port, "POST", "/metrics", &body), 405);
	free(body);

	rw_svc_http_stop(f.svc.http);
	assert_int_equal(count_fds(), fds_before); /* listening socket and connections closed */

	/* Disabled: nothing listens. */
	f.svc.cfg.http_enabled = 0;
	rw_svc_http_t *none = (rw_svc_http_t *)&f;
	assert_int_equal(rw_svc_http_start(&f.svc, &none), RW_OK);
	assert_null(none);
	svc_fini(&f);
}

/* ---------------------------------------------------------------------------------------------
 * The real daemon
 * ------------------------------------------------------------------------------------------- */

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	assert_non_null(f);
	assert_int_equal(fputs(text, f) >= 0, 1);
	fclose(f);
}

static void anchors_json(char *buf, size_t len, int n_anchors)
{
	int n = snprintf(buf, len,
			 "{\"schema_version\": 1, \"fingerprint\": {\"nodes\": 1, \"gpus_per_node\": 2,"
			 " \"rails\": 2, \"nic_gbps\": 100, \"transport\": \"tcp\"},"
			 " \"max_size_ratio\": 2.0, \"shape_tolerance\": 0.2, \"anchors\": [");
	for (int i = 0; i < n_anchors; i++)
		n += snprintf(buf + n, len - (size_t)n,
			      "%s{\"case_id\": %d, \"features\": [20, 0.1, 0.1], \"selected\": \"joint\","
			      " \"samples\": {}}", i ? "," : "", i);
	snprintf(buf + n, len - (size_t)n, "]}");
}

/* The daemon under test: its pid and its log, printed when a check on it fails. */
static pid_t daemon_pid;
static const char *daemon_log;

static void print_daemon_log(void)
{
	FILE *f = fopen(daemon_log, "r");
	if (!f)
		return;
	char line[512];
	print_error("railwaved's log (%s):\n", daemon_log);
	while (fgets(line, sizeof(line), f))
		print_error("  | %s", line);
	fclose(f);
}

/* Ask the daemon until `want` appears in the reply to `cmd` (ceiling, or the daemon gone: fail,
 * with its log). */
static char *ask_until(const char *sock, const char *cmd, const char *want)
{
	for (int tries = 0; tries < CEILING_MS / 10; tries++) {
		int fd = connect_unix(sock);
		if (fd >= 0) {
			char *r = ask(fd, cmd);
			close(fd);
			if (strstr(r, want))
				return r;
			free(r);
		}
		int status = 0;
		if (waitpid(daemon_pid, &status, WNOHANG) == daemon_pid) {
			print_error("railwaved exited (status 0x%x) before '%s' answered with '%s'\n",
				    status, cmd, want);
			print_daemon_log();
			fail();
		}
		sleep_ms(10);
	}
	print_error("'%s' never answered with '%s'\n", cmd, want);
	print_daemon_log();
	fail();
	return NULL;
}

/* Ports the kernel calls free on ip just now: all bound at once (so they differ), then released.
 * Another process may take one before the daemon binds it; the daemon then exits naming it. */
static void free_ports(const char *ip, unsigned *ports, int n)
{
	int fds[4];
	assert_true(n <= 4);
	for (int i = 0; i < n; i++) {
		fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		assert_true(fds[i] >= 0);
		struct sockaddr_in sa = {.sin_family = AF_INET};
		assert_int_equal(inet_pton(AF_INET, ip, &sa.sin_addr), 1);
		assert_int_equal(bind(fds[i], (struct sockaddr *)&sa, sizeof(sa)), 0);
		socklen_t len = sizeof(sa);
		assert_int_equal(getsockname(fds[i], (struct sockaddr *)&sa, &len), 0);
		ports[i] = ntohs(sa.sin_port);
	}
	for (int i = 0; i < n; i++)
		close(fds[i]);
}

static void test_daemon_process(void **state)
{
	(void)state;
	char dir[] = "/tmp/rw_daemon_XXXXXX";
	assert_non_null(mkdtemp(dir));
	char cfg_path[128], sock[128], anchors[128], log_path[128];
	snprintf(cfg_path, sizeof(cfg_path), "%s/cluster.json", dir);
	snprintf(sock, sizeof(sock), "%s/stats.sock", dir);
	snprintf(anchors, sizeof(anchors), "%s/anchors.json", dir);
	snprintf(log_path, sizeof(log_path), "%s/railwaved.log", dir);
	/* Ports the kernel picks (a fixed range collided with other tests' ephemeral ports);
	 * everything else lives in the temporary folder. */
	char cluster[768];
	unsigned ctl[2], rail1;
	free_ports("127.0.0.1", ctl, 2);
	free_ports("127.0.1.1", &rail1, 1);
	snprintf(cluster, sizeof(cluster),
		 "{\"cluster\": \"solo\", \"gpus_per_node\": 2, \"http\": 0,"
		 " \"ipc_socket\": \"%s/ipc.sock\", \"nodes\": [{\"name\": \"only\","
		 " \"control\": \"127.0.0.1:%u\", \"rails\": [{\"address\": \"127.0.0.1\", \"port\": %u},"
		 " {\"address\": \"127.0.1.1\", \"port\": %u}]}]}",
		 dir, ctl[0], ctl[1], rail1);
	write_file(cfg_path, cluster);
	char table[4096];
	anchors_json(table, sizeof(table), 2);
	write_file(anchors, table);

	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		int lfd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
		dup2(lfd, STDERR_FILENO);
		dup2(lfd, STDOUT_FILENO);
		execl(railwaved_path, "railwaved", "--config", cfg_path, "--node", "only",
		      "--stats-socket", sock, "--anchors", anchors, "--phase-timeout-ms", "500",
		      (char *)NULL);
		_exit(127);
	}
	daemon_pid = pid;
	daemon_log = log_path;
	char *r = ask_until(sock, "stats\n", "node only\n");
	assert_non_null(strstr(r, "cluster solo\n"));
	assert_non_null(strstr(r, "anchors 2\n"));
	free(r);

	/* Garbage on one connection does not disturb the next. */
	int bad = connect_unix(sock);
	send_all(bad, "\x01\x02\x03\n", 4);
	r = read_to_eof(bad);
	assert_non_null(strstr(r, "error binary input"));
	free(r);
	close(bad);

	/* SIGHUP with a broken table: refused, the old table stays. */
	write_file(anchors, "{\"schema_version\": 1, \"fingerprint\": ");
	kill(pid, SIGHUP);
	r = ask_until(sock, "stats\n", "anchor_reloads_refused 1\n");
	assert_non_null(strstr(r, "anchors 2\n"));
	free(r);
	/* A table for another cluster: refused too. */
	anchors_json(table, sizeof(table), 5);
	char *two = strstr(table, "\"nodes\": 1");
	assert_non_null(two);
	two[9] = '4';
	write_file(anchors, table);
	kill(pid, SIGHUP);
	r = ask_until(sock, "stats\n", "anchor_reloads_refused 2\n");
	assert_non_null(strstr(r, "anchors 2\n"));
	free(r);
	/* A good one replaces it. */
	anchors_json(table, sizeof(table), 3);
	write_file(anchors, table);
	kill(pid, SIGHUP);
	r = ask_until(sock, "stats\n", "anchors 3\n");
	assert_non_null(strstr(r, "anchor_reloads 1\n"));
	free(r);

	/* SIGTERM: clean exit, socket removed. */
	kill(pid, SIGTERM);
	int status = 0, waited = 0;
	for (int tries = 0; tries < CEILING_MS / 10 && !waited; tries++) {
		waited = waitpid(pid, &status, WNOHANG) == pid;
		if (!waited)
			sleep_ms(10);
	}
	if (!waited) {
		kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
	}
	if (!waited || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		char cmd[256];
		snprintf(cmd, sizeof(cmd), "cat %s >&2", log_path);
		int rc = system(cmd);
		(void)rc;
		fail_msg("railwaved did not exit cleanly (status 0x%x)", status);
	}
	assert_true(access(sock, F_OK) != 0);

	/* Bad configuration: exit status 2 and a message naming the field. */
	write_file(cfg_path, "{\"nodes\": [{\"name\": \"only\", \"rails\": [\"127.0.0.999\"]}]}");
	pid = fork();
	if (pid == 0) {
		int lfd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
		dup2(lfd, STDERR_FILENO);
		execl(railwaved_path, "railwaved", "--config", cfg_path, (char *)NULL);
		_exit(127);
	}
	waitpid(pid, &status, 0);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 2);
	FILE *lf = fopen(log_path, "r");
	char msg[512] = "";
	assert_non_null(fgets(msg, sizeof(msg), lf));
	fclose(lf);
	assert_non_null(strstr(msg, "nodes[0].rails[0]: '127.0.0.999' is not an IPv4 address"));

	unlink(log_path);
	unlink(anchors);
	unlink(cfg_path);
	assert_int_equal(rmdir(dir), 0);
}

int main(int argc, char **argv)
{
	(void)argc;
	/* $b/test/svc_stats -> $b/railwaved */
	char self[512];
	snprintf(self, sizeof(self), "%s", argv[0]);
	snprintf(railwaved_path, sizeof(railwaved_path), "%s/../railwaved", dirname(self));
	signal(SIGPIPE, SIG_IGN);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hist_buckets),
		cmocka_unit_test(test_hist_quantiles),
		cmocka_unit_test(test_metrics_helpers),
		cmocka_unit_test(test_stats_commands),
		cmocka_unit_test(test_gpu_sets),
		cmocka_unit_test(test_stats_garbage),
		cmocka_unit_test(test_stats_slowloris),
		cmocka_unit_test(test_stats_many_clients),
		cmocka_unit_test(test_stats_slowloris_full),
		cmocka_unit_test(test_stats_socket_file),
		cmocka_unit_test(test_prometheus_text),
		cmocka_unit_test(test_http),
		cmocka_unit_test(test_daemon_process),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
