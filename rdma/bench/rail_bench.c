/* rail_bench: throughput and CPU cost of the `tcp` rail transport on loopback, against the
 * plain-TCP ceiling (and iperf3 when installed) measured in the same run, with 1, 2 and 4
 * rails (rail r = 127.0.r.1 -> 127.0.r.2). Both sides of each run are separate processes. The
 * transport's side is one event loop (the transport's own threads move the bytes); the ceiling
 * is one blocking thread per connection end, send/recv of the same bytes.
 * Prints GB/s, the transport/plain ratio and CPU seconds per GB (sender + receiver processes,
 * getrusage), and the loop threads' own CPU per GB (RUSAGE_THREAD of both loops).
 * Results: docs/perf/rail-tcp.md.
 *   rail_bench [--rails=1,2,4] [--sizes=64K,256K,1M,4M,16M] [--bytes=2G] [--reps=3]
 * --pace=RATE[,RATE...] measures the transport's rate pacing instead (rw_rail_config_t.pace_bps,
 * bits/s with K/M/G suffixes): each rail device paced at RATE carries --conns connections (to
 * the same receiver, sharing the device's bucket) for about --seconds; prints achieved/requested
 * per rail, each connection's finish time relative to the run, and the unpaced rate of the same
 * setup measured in the same run.
 *   rail_bench --pace=50M,200M,1G [--rails=1,4] [--sizes=64K,4M] [--conns=2] [--seconds=2]
 * --transport=shm measures the shm transport's pacing the same way (docs/perf/shm.md); the
 * throughput mode's plain-TCP ceiling is tcp's alone. */
#include <arpa/inet.h>
#include <errno.h>
#include <ev.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/common.h"
#include "rdma/rail.h"

#define MAX_RAILS 8
#define WINDOW_BYTES (32u << 20) /* receive window per rail: writes in flight x size */

static const char *transport = "tcp"; /* --transport= */

static uint64_t parse_size(const char *s)
{
	char *end;
	double v = strtod(s, &end);
	switch (*end) {
	case 'k': case 'K': v *= 1024; break;
	case 'm': case 'M': v *= 1024 * 1024; break;
	case 'g': case 'G': v *= 1024.0 * 1024 * 1024; break;
	default: break;
	}
	return (uint64_t)v;
}

/* Rates are decimal (50M = 50e6 bits/s), like NIC speeds. */
static uint64_t parse_rate(const char *s)
{
	char *end;
	double v = strtod(s, &end);
	switch (*end) {
	case 'k': case 'K': v *= 1e3; break;
	case 'm': case 'M': v *= 1e6; break;
	case 'g': case 'G': v *= 1e9; break;
	default: break;
	}
	return (uint64_t)v;
}

static int parse_list(const char *s, uint64_t *out, int max, uint64_t (*parse)(const char *))
{
	int n = 0;
	char buf[256];
	snprintf(buf, sizeof(buf), "%s", s);
	for (char *save, *t = strtok_r(buf, ",", &save); t && n < max; t = strtok_r(NULL, ",", &save))
		out[n++] = parse(t);
	return n;
}

static double rusage_seconds(int who)
{
	struct rusage ru;
	getrusage(who, &ru);
	return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
	       ru.ru_stime.tv_usec / 1e6;
}

static double cpu_seconds(void) { return rusage_seconds(RUSAGE_SELF); }
static double thread_cpu_seconds(void) { return rusage_seconds(RUSAGE_THREAD); }

static double now_s(void) { return (double)rw_now_ns() / 1e9; }

/* Control messages between the sender (parent) and the receiver (child). */
typedef struct msg {
	uint32_t op; /* 1 = hello, 2 = start, 3 = stop/done, 4 = quit */
	uint32_t rails;
	uint64_t bytes;  /* start: bytes per rail (plain receiver waits for them) */
	double cpu;      /* done: receiver CPU seconds since start */
	double loop_cpu; /* done: of that, the receiver's loop thread */
	char addr[MAX_RAILS][RW_RAIL_ADDR_MAX];
	uint8_t desc[MAX_RAILS][RW_RAIL_DESC_SIZE];
} msg_t;

static int xsend(int fd, const msg_t *m)
{
	return send(fd, m, sizeof(*m), MSG_NOSIGNAL) == (ssize_t)sizeof(*m) ? 0 : -1;
}

static int xrecv(int fd, msg_t *m)
{
	size_t got = 0;
	while (got < sizeof(*m)) {
		ssize_t n = recv(fd, (char *)m + got, sizeof(*m) - got, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		got += (size_t)n;
	}
	return 0;
}

static void *map(uint64_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		exit(1);
	}
	memset(p, 0x11, len); /* fault the pages in before measuring */
	return p;
}

/* ---- tcp rail transport --------------------------------------------------------------------- */

typedef struct rail_side {
	struct ev_loop *loop;
	unsigned rails;
	rw_rail_dev_t *dev[MAX_RAILS];
	rw_rail_listener_t *listener[MAX_RAILS];
	rw_rail_conn_t *conn[MAX_RAILS];
	rw_rail_region_t *region[MAX_RAILS];
	void *mem[MAX_RAILS];
	rw_rail_remote_t remote[MAX_RAILS];
	/* sender state for the current run */
	uint64_t size, per_rail, depth;
	uint64_t posted[MAX_RAILS], done[MAX_RAILS];
	unsigned connected, failed;
	/* receiver */
	int ctl;
	ev_io ctl_io;
	double cpu0, loop_cpu0;
	uint64_t arrived;
} rail_side_t;

static void b_connected(rw_rail_conn_t *c, void *ctx)
{
	rail_side_t *s = ctx;
	if (c->accepted)
		s->conn[c->tag] = c;
	s->connected++;
}

static void b_error(rw_rail_conn_t *c, void *ctx, rw_status_t st)
{
	rail_side_t *s = ctx;
	fprintf(stderr, "rail_bench: connection to %s failed: %s\n", c->peer, rw_status_str(st));
	s->failed++;
}

static void pump(rail_side_t *s, unsigned r)
{
	while (s->posted[r] < s->per_rail && s->posted[r] - s->done[r] < s->depth) {
		rw_rail_write_t w = {
			.local = s->region[r],
			.local_offset = 0,
			.length = s->size,
			.remote = s->remote[r],
			.remote_offset = (s->posted[r] % s->depth) * s->size,
			.imm = (uint32_t)s->posted[r],
		};
		rw_status_t st = rw_rail_write(s->conn[r], &w);
		if (st == RW_ERR_AGAIN)
			return;
		if (st != RW_OK) {
			s->failed++;
			return;
		}
		s->posted[r]++;
	}
}

static void b_write_done(rw_rail_conn_t *c, void *ctx, void *wctx, rw_status_t st)
{
	rail_side_t *s = ctx;
	(void)wctx;
	if (st != RW_OK)
		s->failed++;
	s->done[c->tag]++;
	pump(s, (unsigned)c->tag);
}

static void b_writable(rw_rail_conn_t *c, void *ctx) { pump(ctx, (unsigned)c->tag); }

static void b_arrival(rw_rail_conn_t *c, void *ctx, const rw_rail_arrival_t *a)
{
	rail_side_t *s = ctx;
	(void)c;
	s->arrived += a->length;
}

static const rw_rail_conn_cbs_t bench_cbs = {
	.on_connected = b_connected,
	.on_error = b_error,
	.on_write_done = b_write_done,
	.on_arrival = b_arrival,
	.on_writable = b_writable,
};

static int open_rails(rail_side_t *s, unsigned rails, unsigned node, uint64_t region_len,
		      uint64_t pace_bps)
{
	s->rails = rails;
	for (unsigned r = 0; r < rails; r++) {
		char local[32];
		snprintf(local, sizeof(local), "127.0.%u.%u", r + 1, node);
		rw_rail_config_t cfg = {.transport = transport, .local = local, .rail = r + 1,
					.max_writes = 4096, .pace_bps = pace_bps};
		if (rw_rail_dev_open(&cfg, s->loop, &s->dev[r]) != RW_OK)
			return -1;
		s->mem[r] = map(region_len);
		if (rw_rail_reg_host(s->dev[r], s->mem[r], region_len, &s->region[r]) != RW_OK)
			return -1;
	}
	return 0;
}

static void close_rails(rail_side_t *s, uint64_t region_len)
{
	for (unsigned r = 0; r < s->rails; r++) {
		rw_rail_dev_close(s->dev[r]); /* conns, listeners and regions with it */
		munmap(s->mem[r], region_len);
	}
}

static void rx_ctl_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	rail_side_t *s = w->data;
	msg_t m;
	if (xrecv(s->ctl, &m) < 0 || m.op == 4) {
		ev_break(loop, EVBREAK_ALL);
		return;
	}
	if (m.op == 2) { /* acknowledged, so that no write can overtake the reset */
		s->cpu0 = cpu_seconds();
		s->loop_cpu0 = thread_cpu_seconds();
		s->arrived = 0;
		xsend(s->ctl, &m);
	} else if (m.op == 3) {
		m.cpu = cpu_seconds() - s->cpu0;
		m.loop_cpu = thread_cpu_seconds() - s->loop_cpu0;
		m.bytes = s->arrived;
		xsend(s->ctl, &m);
	}
}

static int rail_receiver(int ctl, unsigned rails)
{
	rail_side_t s = {.loop = ev_loop_new(EVFLAG_AUTO), .ctl = ctl};
	msg_t m = {.op = 1, .rails = rails};
	if (open_rails(&s, rails, 2, WINDOW_BYTES, 0) < 0)
		return 1;
	for (unsigned r = 0; r < rails; r++) {
		if (rw_rail_listen(s.dev[r], &bench_cbs, &s, &s.listener[r]) != RW_OK)
			return 1;
		snprintf(m.addr[r], sizeof(m.addr[r]), "%s", s.listener[r]->addr);
		rw_rail_region_desc_pack(s.region[r], m.desc[r]);
	}
	xsend(ctl, &m);
	ev_io_init(&s.ctl_io, rx_ctl_cb, ctl, EV_READ);
	s.ctl_io.data = &s;
	ev_io_start(s.loop, &s.ctl_io);
	ev_run(s.loop, 0);
	ev_io_stop(s.loop, &s.ctl_io);
	close_rails(&s, WINDOW_BYTES);
	ev_loop_destroy(s.loop);
	return 0;
}

typedef struct result {
	double gbps, cpu_per_gb, loop_cpu_per_gb;
} result_t;

static pid_t spawn(int (*fn)(int, unsigned), unsigned rails, int *ctl_p)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		return -1;
	pid_t pid = fork();
	if (pid == 0) {
		close(sv[0]);
		_exit(fn(sv[1], rails));
	}
	close(sv[1]);
	*ctl_p = sv[0];
	return pid;
}

typedef struct rail_sender {
	rail_side_t s;
	int ctl;
	pid_t pid;
} rail_sender_t;

/* Start the receiver process and open this side's rails; *m gets the receiver's descriptors
 * and addresses. */
static int rail_sender_start(rail_sender_t *rs, unsigned rails, uint64_t max_size,
			     uint64_t pace_bps, msg_t *m)
{
	rs->s.loop = ev_loop_new(EVFLAG_AUTO);
	rs->pid = spawn(rail_receiver, rails, &rs->ctl);
	if (rs->pid < 0 || xrecv(rs->ctl, m) < 0)
		return -1;
	return open_rails(&rs->s, rails, 1, max_size, pace_bps);
}

static int rail_sender_open(rail_sender_t *rs, unsigned rails, uint64_t max_size)
{
	msg_t m;
	memset(rs, 0, sizeof(*rs));
	if (rail_sender_start(rs, rails, max_size, 0, &m) < 0)
		return -1;
	for (unsigned r = 0; r < rails; r++) {
		if (rw_rail_remote_unpack(m.desc[r], RW_RAIL_DESC_SIZE, &rs->s.remote[r]) != RW_OK ||
		    rw_rail_connect(rs->s.dev[r], m.addr[r], r, &bench_cbs, &rs->s, &rs->s.conn[r]))
			return -1;
	}
	while (rs->s.connected < rails && !rs->s.failed)
		ev_run(rs->s.loop, EVRUN_ONCE);
	return rs->s.failed ? -1 : 0;
}

static int rail_run(rail_sender_t *rs, uint64_t size, uint64_t total, result_t *res)
{
	rail_side_t *s = &rs->s;
	msg_t m = {.op = 2};
	s->size = size;
	s->depth = RW_MAX(2, WINDOW_BYTES / size);
	s->per_rail = RW_MAX(1, total / size / s->rails);
	memset(s->posted, 0, sizeof(s->posted));
	memset(s->done, 0, sizeof(s->done));
	if (xsend(rs->ctl, &m) < 0 || xrecv(rs->ctl, &m) < 0)
		return -1;
	double cpu0 = cpu_seconds(), lcpu0 = thread_cpu_seconds(), t0 = now_s();
	for (unsigned r = 0; r < s->rails; r++)
		pump(s, r);
	for (;;) {
		unsigned finished = 0;
		for (unsigned r = 0; r < s->rails; r++)
			finished += s->done[r] == s->per_rail;
		if (finished == s->rails || s->failed)
			break;
		ev_run(s->loop, EVRUN_ONCE);
	}
	double t1 = now_s(), cpu1 = cpu_seconds(), lcpu1 = thread_cpu_seconds();
	m.op = 3;
	if (xsend(rs->ctl, &m) < 0 || xrecv(rs->ctl, &m) < 0 || s->failed)
		return -1;
	double bytes = (double)s->per_rail * s->rails * size;
	if ((double)m.bytes != bytes)
		fprintf(stderr, "rail_bench: receiver saw %llu of %.0f bytes\n",
			(unsigned long long)m.bytes, bytes);
	res->gbps = bytes / (t1 - t0) / 1e9;
	res->cpu_per_gb = (cpu1 - cpu0 + m.cpu) / (bytes / 1e9);
	res->loop_cpu_per_gb = (lcpu1 - lcpu0 + m.loop_cpu) / (bytes / 1e9);
	return 0;
}

static void rail_sender_close(rail_sender_t *rs, uint64_t max_size)
{
	msg_t m = {.op = 4};
	xsend(rs->ctl, &m);
	waitpid(rs->pid, NULL, 0);
	close(rs->ctl);
	close_rails(&rs->s, max_size);
	ev_loop_destroy(rs->s.loop);
}

/* ---- plain TCP ceiling: one blocking thread per connection end, no framing ---------------- */

static int tcp_socket(unsigned rail, unsigned node, int do_listen, struct sockaddr_in *sa_p)
{
	struct sockaddr_in sa = {.sin_family = AF_INET};
	char ip[32];
	int one = 1, fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	snprintf(ip, sizeof(ip), "127.0.%u.%u", rail, node);
	inet_pton(AF_INET, ip, &sa.sin_addr);
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || (do_listen && listen(fd, 8) < 0)) {
		perror("plain bind/listen");
		exit(1);
	}
	socklen_t len = sizeof(sa);
	getsockname(fd, (struct sockaddr *)&sa, &len);
	*sa_p = sa;
	return fd;
}

/* One connection end's share of a run: `want` bytes sent in size-byte sends from buf, or
 * received into a window of buflen bytes, slot after slot (like the transport's region). */
typedef struct plain_job {
	pthread_t thread;
	int fd, send;
	uint8_t *buf;
	uint64_t buflen, size, want;
	int failed;
} plain_job_t;

static void *plain_job_main(void *p)
{
	plain_job_t *j = p;
	for (uint64_t done = 0; done < j->want && !j->failed;) {
		ssize_t n;
		if (j->send) {
			uint64_t off = done % j->size;
			n = send(j->fd, j->buf + off, RW_MIN(j->size - off, j->want - done),
				 MSG_NOSIGNAL);
		} else {
			uint64_t off = done % j->buflen;
			n = recv(j->fd, j->buf + off, RW_MIN(j->buflen - off, j->want - done), 0);
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			j->failed = 1;
		else
			done += (uint64_t)n;
	}
	return NULL;
}

/* Run one job per rail on its own thread and wait for all. */
static int plain_jobs(plain_job_t *jobs, unsigned rails)
{
	int failed = 0;
	for (unsigned r = 0; r < rails; r++)
		if (pthread_create(&jobs[r].thread, NULL, plain_job_main, &jobs[r]) != 0)
			return -1;
	for (unsigned r = 0; r < rails; r++) {
		pthread_join(jobs[r].thread, NULL);
		failed |= jobs[r].failed;
	}
	return failed ? -1 : 0;
}

static int plain_receiver(int ctl, unsigned rails)
{
	int lfd[MAX_RAILS], fd[MAX_RAILS];
	msg_t m = {.op = 1, .rails = rails};
	/* Each rail's bytes land in its own window of the same size as the transport's receive
	 * region, slot after slot: cache behaviour like for like with the rail receiver. */
	uint64_t buflen = WINDOW_BYTES;
	uint8_t *buf[MAX_RAILS];
	for (unsigned r = 0; r < rails; r++) {
		struct sockaddr_in sa;
		lfd[r] = tcp_socket(r + 1, 2, 1, &sa);
		buf[r] = map(buflen);
		snprintf(m.addr[r], sizeof(m.addr[r]), "%u", (unsigned)ntohs(sa.sin_port));
	}
	xsend(ctl, &m);
	for (unsigned r = 0; r < rails; r++) {
		fd[r] = accept4(lfd[r], NULL, NULL, SOCK_CLOEXEC);
		close(lfd[r]);
	}
	for (;;) {
		if (xrecv(ctl, &m) < 0 || m.op == 4)
			break;
		plain_job_t jobs[MAX_RAILS];
		for (unsigned r = 0; r < rails; r++)
			jobs[r] = (plain_job_t){.fd = fd[r], .buf = buf[r], .buflen = buflen,
						.want = m.bytes};
		double cpu0 = cpu_seconds();
		if (plain_jobs(jobs, rails) < 0)
			return 1;
		m.op = 3;
		m.cpu = cpu_seconds() - cpu0;
		m.loop_cpu = 0;
		xsend(ctl, &m);
	}
	for (unsigned r = 0; r < rails; r++) {
		close(fd[r]);
		munmap(buf[r], buflen);
	}
	return 0;
}

typedef struct plain_sender {
	int fd[MAX_RAILS], ctl;
	unsigned rails;
	pid_t pid;
	uint8_t *buf;
	uint64_t buflen;
} plain_sender_t;

static int plain_open(plain_sender_t *ps, unsigned rails, uint64_t max_size)
{
	msg_t m;
	memset(ps, 0, sizeof(*ps));
	ps->rails = rails;
	ps->pid = spawn(plain_receiver, rails, &ps->ctl);
	if (ps->pid < 0 || xrecv(ps->ctl, &m) < 0)
		return -1;
	ps->buflen = max_size;
	ps->buf = map(max_size);
	for (unsigned r = 0; r < rails; r++) {
		struct sockaddr_in sa, peer;
		ps->fd[r] = tcp_socket(r + 1, 1, 0, &sa);
		peer = sa;
		char ip[32];
		snprintf(ip, sizeof(ip), "127.0.%u.2", r + 1);
		inet_pton(AF_INET, ip, &peer.sin_addr);
		peer.sin_port = htons((uint16_t)atoi(m.addr[r]));
		if (connect(ps->fd[r], (struct sockaddr *)&peer, sizeof(peer)) < 0)
			return -1;
	}
	return 0;
}

static int plain_run(plain_sender_t *ps, uint64_t size, uint64_t total, result_t *res)
{
	uint64_t per_rail = RW_MAX(1, total / size / ps->rails) * size;
	msg_t m = {.op = 2, .bytes = per_rail};
	plain_job_t jobs[MAX_RAILS];
	for (unsigned r = 0; r < ps->rails; r++)
		jobs[r] = (plain_job_t){.fd = ps->fd[r], .send = 1, .buf = ps->buf, .size = size,
					.want = per_rail};
	xsend(ps->ctl, &m);
	double cpu0 = cpu_seconds(), t0 = now_s();
	if (plain_jobs(jobs, ps->rails) < 0)
		return -1;
	if (xrecv(ps->ctl, &m) < 0) /* the receiver has every byte */
		return -1;
	double t1 = now_s(), cpu1 = cpu_seconds();
	double bytes = (double)per_rail * ps->rails;
	res->gbps = bytes / (t1 - t0) / 1e9;
	res->cpu_per_gb = (cpu1 - cpu0 + m.cpu) / (bytes / 1e9);
	res->loop_cpu_per_gb = 0;
	return 0;
}

static void plain_close(plain_sender_t *ps)
{
	msg_t m = {.op = 4};
	xsend(ps->ctl, &m);
	for (unsigned r = 0; r < ps->rails; r++)
		close(ps->fd[r]);
	waitpid(ps->pid, NULL, 0);
	close(ps->ctl);
	munmap(ps->buf, ps->buflen);
}

/* ---- iperf3 reference -------------------------------------------------------------------- */

static double iperf3_gbps(unsigned streams)
{
	char cmd[512];
	int port = 5201 + (int)(getpid() % 2000);
	snprintf(cmd, sizeof(cmd),
		 "iperf3 -s -1 -B 127.0.1.2 -p %d >/dev/null 2>&1 & sleep 0.5; "
		 "iperf3 -c 127.0.1.2 -B 127.0.1.1 -p %d -t 3 -P %u -J 2>/dev/null; wait",
		 port, port, streams);
	FILE *p = popen(cmd, "r");
	if (!p)
		return -1;
	static char out[1 << 20];
	size_t n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = '\0';
	pclose(p);
	const char *sum = strstr(out, "\"sum_received\"");
	const char *bps = sum ? strstr(sum, "\"bits_per_second\"") : NULL;
	if (!bps)
		return -1;
	return strtod(strchr(bps, ':') + 1, NULL) / 8 / 1e9;
}

/* ---- rate pacing (--pace) ------------------------------------------------------------------ */

#define MAX_CONNS 8

typedef struct pace_conn {
	struct pace_sender *ps;
	unsigned rail;
	rw_rail_conn_t *conn;
	uint64_t posted, done, count;
	double t_done;
} pace_conn_t;

typedef struct pace_sender {
	rail_sender_t rs; /* receiver process; devices, regions, the receiver's descriptors */
	pace_conn_t pc[MAX_RAILS][MAX_CONNS];
	unsigned conns, connected, failed;
	uint64_t size, depth;
} pace_sender_t;

static void p_pump(pace_conn_t *pc)
{
	pace_sender_t *ps = pc->ps;
	while (pc->posted < pc->count && pc->posted - pc->done < ps->depth) {
		rw_rail_write_t w = {
			.local = ps->rs.s.region[pc->rail],
			.length = ps->size,
			.remote = ps->rs.s.remote[pc->rail],
			.remote_offset = (pc->posted % ps->depth) * ps->size,
		};
		rw_status_t st = rw_rail_write(pc->conn, &w);
		if (st == RW_ERR_AGAIN)
			return;
		if (st != RW_OK) {
			ps->failed++;
			return;
		}
		pc->posted++;
	}
}

static void p_connected(rw_rail_conn_t *c, void *ctx)
{
	(void)c;
	((pace_conn_t *)ctx)->ps->connected++;
}

static void p_error(rw_rail_conn_t *c, void *ctx, rw_status_t st)
{
	fprintf(stderr, "rail_bench: connection to %s failed: %s\n", c->peer, rw_status_str(st));
	((pace_conn_t *)ctx)->ps->failed++;
}

static void p_write_done(rw_rail_conn_t *c, void *ctx, void *wctx, rw_status_t st)
{
	pace_conn_t *pc = ctx;
	(void)c, (void)wctx;
	if (st != RW_OK)
		pc->ps->failed++;
	if (++pc->done == pc->count)
		pc->t_done = now_s();
	p_pump(pc);
}

static void p_writable(rw_rail_conn_t *c, void *ctx)
{
	(void)c;
	p_pump(ctx);
}

static const rw_rail_conn_cbs_t pace_cbs = {
	.on_connected = p_connected,
	.on_error = p_error,
	.on_write_done = p_write_done,
	.on_writable = p_writable,
};

static int pace_open(pace_sender_t *ps, unsigned rails, unsigned conns, uint64_t max_size,
		     uint64_t pace_bps)
{
	msg_t m;
	memset(ps, 0, sizeof(*ps));
	ps->conns = conns;
	if (rail_sender_start(&ps->rs, rails, max_size, pace_bps, &m) < 0)
		return -1;
	for (unsigned r = 0; r < rails; r++) {
		if (rw_rail_remote_unpack(m.desc[r], RW_RAIL_DESC_SIZE, &ps->rs.s.remote[r]) != RW_OK)
			return -1;
		for (unsigned k = 0; k < conns; k++) {
			pace_conn_t *pc = &ps->pc[r][k];
			pc->ps = ps;
			pc->rail = r;
			if (rw_rail_connect(ps->rs.s.dev[r], m.addr[r], r, &pace_cbs, pc, &pc->conn))
				return -1;
		}
	}
	while (ps->connected < rails * conns && !ps->failed)
		ev_run(ps->rs.s.loop, EVRUN_ONCE);
	return ps->failed ? -1 : 0;
}

typedef struct pace_result {
	double gbps_min, gbps_max;  /* per rail, payload bits */
	double first_done;          /* earliest connection finish, fraction of the run */
	uint64_t waits;             /* pacing timer waits, all rails */
} pace_result_t;

/* Each connection writes `per_conn` writes of `size`; time from the first post to the last
 * completion (completion = in the receiver's region). */
static int pace_run(pace_sender_t *ps, uint64_t size, uint64_t per_conn, pace_result_t *res)
{
	rail_side_t *s = &ps->rs.s;
	msg_t m = {.op = 2};
	uint64_t waits0 = 0;
	ps->size = size;
	ps->depth = RW_MAX(2, WINDOW_BYTES / size / ps->conns);
	for (unsigned r = 0; r < s->rails; r++) {
		waits0 += s->dev[r]->stats.pace_waits;
		for (unsigned k = 0; k < ps->conns; k++) {
			pace_conn_t *pc = &ps->pc[r][k];
			pc->posted = pc->done = 0;
			pc->count = per_conn;
			pc->t_done = 0;
		}
	}
	if (xsend(ps->rs.ctl, &m) < 0 || xrecv(ps->rs.ctl, &m) < 0)
		return -1;
	double t0 = now_s();
	for (unsigned r = 0; r < s->rails; r++)
		for (unsigned k = 0; k < ps->conns; k++)
			p_pump(&ps->pc[r][k]);
	double t_rail[MAX_RAILS] = {0}, first = 0;
	for (;;) {
		unsigned finished = 0;
		for (unsigned r = 0; r < s->rails; r++)
			for (unsigned k = 0; k < ps->conns; k++)
				finished += ps->pc[r][k].done == per_conn;
		if (finished == s->rails * ps->conns || ps->failed)
			break;
		ev_run(s->loop, EVRUN_ONCE);
	}
	if (ps->failed)
		return -1;
	m.op = 3;
	if (xsend(ps->rs.ctl, &m) < 0 || xrecv(ps->rs.ctl, &m) < 0)
		return -1;
	res->waits = 0;
	for (unsigned r = 0; r < s->rails; r++) {
		res->waits += s->dev[r]->stats.pace_waits;
		for (unsigned k = 0; k < ps->conns; k++) {
			double t = ps->pc[r][k].t_done - t0;
			t_rail[r] = RW_MAX(t_rail[r], t);
			first = first == 0 ? t : RW_MIN(first, t);
		}
	}
	res->waits -= waits0;
	double last = 0;
	res->gbps_min = 1e30, res->gbps_max = 0;
	for (unsigned r = 0; r < s->rails; r++) {
		double g = (double)per_conn * ps->conns * size * 8 / t_rail[r] / 1e9;
		res->gbps_min = RW_MIN(res->gbps_min, g);
		res->gbps_max = RW_MAX(res->gbps_max, g);
		last = RW_MAX(last, t_rail[r]);
	}
	res->first_done = first / last;
	return 0;
}


static void size_label(uint64_t size, char *buf, size_t len)
{
	if (size >= (1u << 20))
		snprintf(buf, len, "%lluMiB", (unsigned long long)(size >> 20));
	else
		snprintf(buf, len, "%lluKiB", (unsigned long long)(size >> 10));
}

static int pace_main(const uint64_t *rates, int nrates, const uint64_t *rails_list, int nrails,
		     const uint64_t *sizes, int nsizes, unsigned conns, double seconds)
{
	uint64_t max_size = 0;
	for (int i = 0; i < nsizes; i++)
		max_size = RW_MAX(max_size, sizes[i]);
	printf("rail_bench --pace: %s transport rate pacing on loopback, %u connection(s) per "
	       "rail device, ~%.1f s per point, %ld CPUs online\n", transport, conns, seconds,
	       sysconf(_SC_NPROCESSORS_ONLN));
	printf("achieved = payload bits per rail / time to the last completion; first = when the "
	       "first connection finished, fraction of the run (1.00 = all together)\n");
	printf("%-5s %-8s %11s %11s %11s %7s %6s %8s %13s\n", "rails", "write", "req Gb/s",
	       "min Gb/s", "max Gb/s", "ach/req", "first", "waits", "unpaced Gb/s");
	for (int ri = 0; ri < nrails; ri++) {
		unsigned rails = (unsigned)rails_list[ri];
		if (rails < 1 || rails > MAX_RAILS || conns < 1 || conns > MAX_CONNS) {
			fprintf(stderr, "rail_bench: 1..%d rails, 1..%d conns\n", MAX_RAILS, MAX_CONNS);
			return 1;
		}
		/* The ceiling: the same setup unpaced, measured in the same run. */
		double ceiling[16] = {0};
		pace_sender_t ps;
		if (pace_open(&ps, rails, conns, max_size, 0) < 0) {
			fprintf(stderr, "rail_bench: setup for %u rails failed\n", rails);
			return 1;
		}
		for (int si = 0; si < nsizes && si < 16; si++) {
			pace_result_t res;
			uint64_t per_conn = RW_MAX(8, (256ull << 20) / conns / sizes[si]);
			if (pace_run(&ps, sizes[si], per_conn, &res) < 0)
				return 1;
			ceiling[si] = res.gbps_min;
		}
		rail_sender_close(&ps.rs, max_size);
		for (int qi = 0; qi < nrates; qi++) {
			if (pace_open(&ps, rails, conns, max_size, rates[qi]) < 0) {
				fprintf(stderr, "rail_bench: setup for %u rails failed\n", rails);
				return 1;
			}
			for (int si = 0; si < nsizes && si < 16; si++) {
				pace_result_t res;
				double bytes = (double)rates[qi] / 8 * seconds; /* per rail */
				uint64_t per_conn = RW_MAX(2, (uint64_t)(bytes / conns / (double)sizes[si]));
				if (pace_run(&ps, sizes[si], per_conn, &res) < 0)
					return 1;
				char label[32];
				size_label(sizes[si], label, sizeof(label));
				double req = (double)rates[qi] / 1e9;
				printf("%-5u %-8s %11.3f %11.3f %11.3f %7.3f %6.2f %8llu %13.2f\n", rails,
				       label, req, res.gbps_min, res.gbps_max, res.gbps_min / req,
				       res.first_done, (unsigned long long)res.waits, ceiling[si]);
				fflush(stdout);
			}
			rail_sender_close(&ps.rs, max_size);
		}
	}
	return 0;
}

/* ---- main -------------------------------------------------------------------------------- */

static double best(const double *v, int n)
{
	double m = v[0];
	for (int i = 1; i < n; i++)
		m = RW_MAX(m, v[i]);
	return m;
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(*v), rw_cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv)
{
	uint64_t rails_list[8] = {1, 2, 4}, sizes[16] = {64 << 10, 256 << 10, 1 << 20, 4 << 20,
							 16 << 20};
	int nrails = 3, nsizes = 5, reps = 3, only_rail = 0, only_plain = 0, nrates = 0;
	uint64_t total = 2ull << 30, rates[16];
	unsigned conns = 2;
	double seconds = 2;
	int sizes_given = 0;
	for (int i = 1; i < argc; i++) {
		if (!strncmp(argv[i], "--rails=", 8)) nrails = parse_list(argv[i] + 8, rails_list, 8, parse_size);
		else if (!strncmp(argv[i], "--sizes=", 8)) nsizes = parse_list(argv[i] + 8, sizes, 16, parse_size),
							       sizes_given = 1;
		else if (!strncmp(argv[i], "--pace=", 7)) nrates = parse_list(argv[i] + 7, rates, 16, parse_rate);
		else if (!strncmp(argv[i], "--conns=", 8)) conns = (unsigned)atoi(argv[i] + 8);
		else if (!strncmp(argv[i], "--seconds=", 10)) seconds = atof(argv[i] + 10);
		else if (!strncmp(argv[i], "--bytes=", 8)) total = parse_size(argv[i] + 8);
		else if (!strncmp(argv[i], "--reps=", 7)) reps = atoi(argv[i] + 7);
		else if (!strncmp(argv[i], "--transport=", 12)) transport = argv[i] + 12;
		else if (!strcmp(argv[i], "--only-rail")) only_rail = 1; /* for profiling */
		else if (!strcmp(argv[i], "--only-plain")) only_plain = 1;
		else {
			fprintf(stderr, "usage: rail_bench [--rails=1,2,4] [--sizes=64K,...,16M] "
					"[--bytes=2G] [--reps=3]\n"
					"       rail_bench --pace=50M,200M,1G [--rails=..] [--sizes=..] "
					"[--conns=2] [--seconds=2]\n");
			return 2;
		}
	}
	signal(SIGPIPE, SIG_IGN);
	rw_log_set_level(RW_LOG_WARN);
	if (nrates > 0) {
		if (!sizes_given) { /* the daemon's largest write, and a small one */
			sizes[0] = 64 << 10, sizes[1] = 4 << 20;
			nsizes = 2;
		}
		return pace_main(rates, nrates, rails_list, nrails, sizes, nsizes, conns, seconds);
	}
	uint64_t max_size = 0;
	for (int i = 0; i < nsizes; i++)
		max_size = RW_MAX(max_size, sizes[i]);
	printf("rail_bench: tcp rail transport vs plain TCP, loopback, %.2f GiB per point, "
	       "%d interleaved repetitions, %ld CPUs online\n", (double)total / (1u << 30), reps,
	       sysconf(_SC_NPROCESSORS_ONLN));
	if (only_rail || only_plain) {
		printf("iperf3: skipped (--only-rail/--only-plain)\n");
	} else if (system("command -v iperf3 >/dev/null 2>&1") == 0) {
		for (int i = 0; i < nrails; i++)
			printf("iperf3 -P %llu (3 s): %.2f GB/s\n", (unsigned long long)rails_list[i],
			       iperf3_gbps((unsigned)rails_list[i]));
	} else {
		printf("iperf3: not installed\n");
	}
	/* Throughput: best of the interleaved repetitions (on a shared machine the best run is the
	 * one least disturbed by neighbours) and the median ratio of the pairs as a check; CPU:
	 * medians (CPU time per byte is barely affected by waiting). */
	printf("%-5s %-8s %10s %10s %6s %9s %11s %11s %11s\n", "rails", "write", "plain GB/s",
	       "rail GB/s", "ratio", "med.ratio", "plain cpu/GB", "rail cpu/GB", "loop cpu/GB");
	for (int ri = 0; ri < nrails; ri++) {
		unsigned rails = (unsigned)rails_list[ri];
		rail_sender_t rs;
		plain_sender_t ps;
		if (rails < 1 || rails > MAX_RAILS ||
		    (!only_plain && rail_sender_open(&rs, rails, max_size) < 0) ||
		    (!only_rail && plain_open(&ps, rails, max_size) < 0)) {
			fprintf(stderr, "rail_bench: setup for %u rails failed\n", rails);
			return 1;
		}
		for (int si = 0; si < nsizes; si++) {
			double pg[16] = {0}, pc[16] = {0}, rg[16] = {0}, rc[16] = {0}, lc[16] = {0};
			double ratio[16] = {0};
			int n = RW_MAX(1, RW_MIN(reps, 16));
			for (int k = 0; k < n; k++) { /* interleaved, so drift hits both alike */
				result_t a = {1, 1, 0}, b = {1, 1, 0};
				if ((!only_rail && plain_run(&ps, sizes[si], total, &a) < 0) ||
				    (!only_plain && rail_run(&rs, sizes[si], total, &b) < 0)) {
					fprintf(stderr, "rail_bench: run failed\n");
					return 1;
				}
				pg[k] = a.gbps, pc[k] = a.cpu_per_gb, rg[k] = b.gbps, rc[k] = b.cpu_per_gb;
				lc[k] = b.loop_cpu_per_gb;
				ratio[k] = b.gbps / a.gbps;
			}
			double p = best(pg, n), r = best(rg, n);
			char label[32];
			if (sizes[si] >= (1u << 20))
				snprintf(label, sizeof(label), "%lluMiB",
					 (unsigned long long)(sizes[si] >> 20));
			else
				snprintf(label, sizeof(label), "%lluKiB",
					 (unsigned long long)(sizes[si] >> 10));
			printf("%-5u %-8s %10.2f %10.2f %6.2f %9.2f %10.3fs %10.3fs %10.3fs\n", rails,
			       label, p, r, r / p, median(ratio, n), median(pc, n), median(rc, n),
			       median(lc, n));
			fflush(stdout);
		}
		if (!only_rail)
			plain_close(&ps);
		if (!only_plain)
			rail_sender_close(&rs, max_size);
	}
	return 0;
}
