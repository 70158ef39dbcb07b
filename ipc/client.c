/* librailwave (ipc/railwave.h): a trainer rank's side of node-local IPC. Control requests are
 * synchronous request/reply datagrams on the Unix socket; submissions and completions go through
 * the two shared-memory rings the daemon created, with no system call unless the other side
 * sleeps. Links libc only: CUDA buffers arrive as raw IPC handle bytes. */
#include "ipc/railwave.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/fdpass.h"
#include "ipc/page.h"
#include "ipc/proto.h"
#include "ipc/ring.h"

#define MIN_U(a, b) ((a) < (b) ? (a) : (b))

#define RW_CLIENT_MAX_EVENTS 64 /* the daemon's bound is at most this */

typedef struct host_buf {
	uint32_t id;
	void *addr;
	size_t size;
} host_buf_t;

struct rw_client {
	int fd;
	uint32_t seq;
	int timeout_ms;
	uint32_t id;
	/* The daemon is gone or dropped us: every call fails with the code stored here (0: open).
	 * Atomic because the submitting and the reaping thread may both discover it. */
	_Atomic int closed_code;
	/* Reads of the control socket: a request waits for its reply holding it; the reaping
	 * thread reads notices only when it can take it at once. */
	pthread_mutex_t sock_lock;
	char last_msg[3 * RW_IPC_ERRMSG_MAX]; /* notices read together are joined */
	void *ring_map;
	size_t ring_bytes;
	int sq_efd;
	int cq_efd;
	rw_ring_t sq; /* we produce */
	rw_ring_t cq; /* we consume */
	void *page;        /* the rank page (rw_client_rank_page), NULL until set up */
	size_t page_bytes;
	rw_client_slab_t slab[RW_CLIENT_SLAB_RAILS]; /* the group's slabs (rw_client_group_slab):
	                                                * lent once slab_gpu[rail].kind is set */
	rw_client_slab_gpu_t slab_gpu[RW_CLIENT_SLAB_RAILS]; /* kind 0: not lent yet; GPU: its fd */
	/* With a page, a watcher thread waits for the daemon to hang up and then writes the words
	 * the rank's stream may wait on (rw_page_daemon_lost); watch_efd stops it at close. */
	pthread_t watcher;
	int watch_efd;     /* -1: no watcher */
	_Atomic uint32_t submitted; /* written by the submitting thread */
	_Atomic uint32_t completed; /* written by the reaping thread */
	/* rw_client_wait's spin before it sleeps (docs/ipc.md "Waiting for a completion"), ns;
	 * touched by the reaping thread only. spin_max_ns 0: never spin. */
	uint32_t spin_max_ns, spin_ns;
	host_buf_t *bufs;
	size_t nbufs, capbufs;
	rw_ipc_hello_ok_t limits;
	/* Stream order: the registered events, and the flag values the daemon owes (one per
	 * signalling submission not yet completed; both threads touch it, under sig_lock). */
	struct { uint32_t id, flag_buf; uint64_t flag_offset; } events[RW_CLIENT_MAX_EVENTS];
	pthread_mutex_t sig_lock;
	struct owed { rw_client_lost_signal_t s; uint8_t kind; } *owed;
	size_t nowed, capowed;
};

static void debug_msg(const rw_client_t *c, int code)
{
	if (getenv("RAILWAVE_DEBUG"))
		fprintf(stderr, "librailwave: %s: %s\n", rw_client_strerror(code), c->last_msg);
}

static void hdr_init(rw_client_t *c, rw_ipc_hdr_t *hdr, uint16_t type)
{
	memset(hdr, 0, sizeof(*hdr));
	hdr->magic = RW_IPC_MAGIC;
	hdr->version = RW_IPC_VERSION;
	hdr->type = type;
	hdr->seq = ++c->seq;
}

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void close_fds(int *fds, unsigned n)
{
	for (unsigned i = 0; i < n; i++)
		if (fds[i] >= 0)
			close(fds[i]);
}

/* Receive one datagram (blocking up to deadline) with up to RW_IPC_MAX_FDS fds. Returns its
 * length, 0 when the daemon closed the connection, or a negative RW_E_*. */
static int recv_msg(rw_client_t *c, rw_ipc_msg_t *msg, int *fds, unsigned *nfds_p,
		    int64_t deadline)
{
	*nfds_p = 0;
	for (;;) {
		int wait = -1;
		if (deadline >= 0) {
			int64_t left = deadline - now_ms();
			wait = left > 0 ? (int)left : 0;
		}
		struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
		int r = poll(&pfd, 1, wait);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return RW_E_SYS;
		if (r == 0)
			return RW_E_TIMEOUT;
		union {
			char buf[CMSG_SPACE(sizeof(int) * RW_IPC_MAX_FDS)];
			struct cmsghdr align;
		} cbuf;
		struct iovec iov = {.iov_base = msg, .iov_len = sizeof(*msg)};
		struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.buf,
				    .msg_controllen = sizeof(cbuf.buf)};
		ssize_t n = recvmsg(c->fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
		/* ECONNRESET: the daemon closed with our requests unread. The error is reported
		 * (once) before the messages it queued, such as the error that explains why: read
		 * on; the socket then yields those messages, then end-of-file. */
		if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == ECONNRESET))
			continue;
		if (n < 0)
			return RW_E_SYS;
		for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
			if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
				continue;
			size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			for (size_t i = 0; i < k && *nfds_p < RW_IPC_MAX_FDS; i++)
				memcpy(&fds[(*nfds_p)++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
		}
		if (n == 0 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
			close_fds(fds, *nfds_p);
			*nfds_p = 0;
			return n == 0 ? 0 : RW_E_BADREPLY;
		}
		return (int)n;
	}
}

static int mark_closed(rw_client_t *c, int code)
{
	int open = 0;
	atomic_compare_exchange_strong(&c->closed_code, &open, code); /* the first reason wins */
	return atomic_load(&c->closed_code);
}

/* An ERROR datagram from the daemon: remember its text; a fatal one ends the connection. */
static int take_error(rw_client_t *c, const rw_ipc_msg_t *msg, int len)
{
	if (len != (int)sizeof(rw_ipc_error_t) || msg->error.code >= 0)
		return RW_E_BADREPLY;
	memcpy(c->last_msg, msg->error.message, RW_IPC_ERRMSG_MAX);
	c->last_msg[RW_IPC_ERRMSG_MAX - 1] = '\0';
	debug_msg(c, msg->error.code);
	if (msg->error.fatal)
		mark_closed(c, msg->error.code);
	return msg->error.code;
}

/* Send a request (with an optional fd) and wait for its reply of `reply_type`, exactly
 * `reply_len` bytes and `reply_nfds` fds (stored in fds_out). Returns 0 or RW_E_*. */
static int request_locked(rw_client_t *c, const void *req, size_t len, int fd,
			  uint16_t reply_type, rw_ipc_msg_t *reply, size_t reply_len, int *fds_out,
			  unsigned reply_nfds)
{
	int closed = atomic_load(&c->closed_code);
	if (closed)
		return closed;
	ssize_t n = rw_fdpass_send(c->fd, req, len, &fd, fd >= 0 ? 1 : 0, MSG_NOSIGNAL);
	if (n < 0 && errno != EPIPE && errno != ECONNRESET)
		return RW_E_SYS;
	int fds[RW_IPC_MAX_FDS];
	unsigned nfds;
	if (n < 0) {
		/* The daemon closed on us; it may have said why first (e.g. its client limit). */
		int got = recv_msg(c, reply, fds, &nfds, 0);
		close_fds(fds, nfds);
		if (got >= (int)sizeof(rw_ipc_hdr_t) && reply->hdr.magic == RW_IPC_MAGIC &&
		    reply->hdr.type == RW_IPC_ERROR && take_error(c, reply, got) < 0)
			return mark_closed(c, reply->error.code);
		return mark_closed(c, RW_E_CLOSED);
	}

	uint32_t seq = ((const rw_ipc_hdr_t *)req)->seq;
	int64_t deadline = now_ms() + c->timeout_ms;
	int got;
	for (;;) { /* a notice (an ERROR with seq 0) about a submission is not the reply */
		got = recv_msg(c, reply, fds, &nfds, deadline);
		if (got != (int)sizeof(rw_ipc_error_t) || reply->hdr.type != RW_IPC_ERROR ||
		    reply->hdr.seq != 0 || reply->error.fatal)
			break;
		close_fds(fds, nfds);
		take_error(c, reply, got);
	}
	if (got == 0)
		return mark_closed(c, RW_E_CLOSED);
	if (got < 0)
		return got;
	int rc = 0;
	if (got < (int)sizeof(rw_ipc_hdr_t) || reply->hdr.magic != RW_IPC_MAGIC ||
	    reply->hdr.version != RW_IPC_VERSION)
		rc = RW_E_BADREPLY;
	else if (reply->hdr.type == RW_IPC_ERROR)
		rc = take_error(c, reply, got);
	else if (reply->hdr.seq != seq || reply->hdr.type != reply_type ||
		 (size_t)got != reply_len || nfds != reply_nfds)
		rc = RW_E_BADREPLY;
	if (rc) {
		close_fds(fds, nfds);
		return rc;
	}
	memcpy(fds_out, fds, sizeof(int) * nfds);
	return 0;
}

static int request(rw_client_t *c, const void *req, size_t len, int fd, uint16_t reply_type,
		   rw_ipc_msg_t *reply, size_t reply_len, int *fds_out, unsigned reply_nfds)
{
	pthread_mutex_lock(&c->sock_lock);
	int rc = request_locked(c, req, len, fd, reply_type, reply, reply_len, fds_out, reply_nfds);
	pthread_mutex_unlock(&c->sock_lock);
	return rc;
}

/* Read the notices the daemon queued (why a submission failed) without waiting; only when no
 * request is reading the socket. A fatal message or end-of-file closes the client. */
void rw_client_take_notices(rw_client_t *c)
{
	if (pthread_mutex_trylock(&c->sock_lock) != 0)
		return;
	char before[sizeof(c->last_msg)];
	for (unsigned taken = 0;; taken++) {
		if (taken) /* the notices read here are joined, the first first: the first is the
			      cause (a phase failed), a later one often its sequel */
			memcpy(before, c->last_msg, sizeof(before));
		rw_ipc_msg_t msg;
		int fds[RW_IPC_MAX_FDS];
		unsigned nfds;
		int got = recv_msg(c, &msg, fds, &nfds, 0);
		close_fds(fds, nfds);
		if (got == 0) {
			mark_closed(c, RW_E_CLOSED);
			break;
		}
		if (got < 0)
			break; /* nothing more (RW_E_TIMEOUT) */
		if (got < (int)sizeof(rw_ipc_hdr_t) || msg.hdr.type != RW_IPC_ERROR) {
			mark_closed(c, RW_E_BADREPLY); /* nothing else is unsolicited */
			break;
		}
		take_error(c, &msg, got);
		if (taken) { /* "before; then: new", cut short where it does not fit */
			char now[RW_IPC_ERRMSG_MAX];
			memcpy(now, c->last_msg, sizeof(now));
			const size_t cap = sizeof(c->last_msg) - 1;
			size_t n = strnlen(before, cap);
			memcpy(c->last_msg, before, n);
			for (const char *t = "; then: "; *t && n < cap; t++)
				c->last_msg[n++] = *t;
			for (const char *t = now; *t && n < cap; t++)
				c->last_msg[n++] = *t;
			c->last_msg[n] = '\0';
		}
	}
	pthread_mutex_unlock(&c->sock_lock);
}

/* Map the daemon's rings after checking that RING_OK describes a layout that fits its memfd. */
static int map_rings(rw_client_t *c, const rw_ipc_ring_ok_t *ok, uint32_t sq_entries,
		     uint32_t cq_entries, int *fds)
{
	struct stat st;
	uint64_t sq_end = ok->sq_slots_off + (uint64_t)sq_entries * sizeof(rw_sqe_t);
	uint64_t cq_end = ok->cq_slots_off + (uint64_t)cq_entries * sizeof(rw_cqe_t);
	if (ok->sq_entries != sq_entries || ok->cq_entries != cq_entries ||
	    ok->sqe_size != sizeof(rw_sqe_t) || ok->cqe_size != sizeof(rw_cqe_t) ||
	    ok->sq_ctl_off % RW_RING_CACHELINE || ok->cq_ctl_off % RW_RING_CACHELINE ||
	    ok->sq_ctl_off + sizeof(rw_ring_ctl_t) > ok->map_bytes ||
	    ok->cq_ctl_off + sizeof(rw_ring_ctl_t) > ok->map_bytes || sq_end > ok->map_bytes ||
	    cq_end > ok->map_bytes || fstat(fds[0], &st) < 0 ||
	    (uint64_t)st.st_size != ok->map_bytes)
		return RW_E_BADREPLY;
	void *map = mmap(NULL, ok->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	if (map == MAP_FAILED)
		return RW_E_SYS;
	uint8_t *base = map;
	c->ring_map = map;
	c->ring_bytes = ok->map_bytes;
	c->sq_efd = fds[1];
	c->cq_efd = fds[2];
	fds[1] = fds[2] = -1;
	rw_ring_init(&c->sq, (rw_ring_ctl_t *)(base + ok->sq_ctl_off), base + ok->sq_slots_off,
		     sq_entries, sizeof(rw_sqe_t), c->sq_efd, 1);
	rw_ring_init(&c->cq, (rw_ring_ctl_t *)(base + ok->cq_ctl_off), base + ok->cq_slots_off,
		     cq_entries, sizeof(rw_cqe_t), -1, 0);
	/* Freeing completion slots wakes the daemon if it stopped for lack of them. */
	rw_ring_set_prod_efd(&c->cq, c->sq_efd);
	return 0;
}

/* RAILWAVE_WAIT_SPIN_US: the longest rw_client_wait spins before it sleeps (0: never). Unset,
 * it is WAIT_SPIN_US_DEFAULT on a host with at least WAIT_SPIN_MIN_CPUS online CPUs and 0 on a
 * smaller one: a spinning rank only helps when a core is free for it, which a training node's
 * dozens of cores give and a small host shared by several ranks and daemons does not
 * (docs/perf/shm.md "The control-plane floor": a fifth faster at N = 2, a quarter slower with
 * more ranks and daemons than the two vCPUs). */
#define WAIT_SPIN_US_DEFAULT 200
#define WAIT_SPIN_US_MAX 10000
#define WAIT_SPIN_MIN_CPUS 8

static uint32_t wait_spin_ns(void)
{
	const char *v = getenv("RAILWAVE_WAIT_SPIN_US");
	char *end;
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	unsigned long dflt = cpus >= WAIT_SPIN_MIN_CPUS ? WAIT_SPIN_US_DEFAULT : 0;
	unsigned long us = dflt;
	if (v && *v) {
		us = strtoul(v, &end, 10);
		if (*end || us > WAIT_SPIN_US_MAX)
			us = dflt;
	}
	return (uint32_t)us * 1000u;
}

int rw_client_connect(const rw_client_opts_t *opts, rw_client_t **client_p)
{
	if (!opts || !client_p || !opts->group)
		return RW_E_INVAL;
	uint32_t sq_entries = opts->sq_entries ? opts->sq_entries : 256;
	uint32_t cq_entries = opts->cq_entries ? opts->cq_entries : 2 * sq_entries;
	const char *path = opts->socket_path;
	if (!path)
		path = getenv("RAILWAVE_SOCKET");
	if (!path)
		path = RW_DEFAULT_SOCKET;
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	size_t glen = strlen(opts->group);
	if (strlen(path) >= sizeof(addr.sun_path) || glen == 0 || glen >= RW_GROUP_NAME_MAX)
		return RW_E_INVAL;
	strcpy(addr.sun_path, path);

	rw_client_t *c = calloc(1, sizeof(*c));
	if (!c)
		return RW_E_NOMEM;
	pthread_mutex_init(&c->sock_lock, NULL);
	pthread_mutex_init(&c->sig_lock, NULL);
	c->sq_efd = c->cq_efd = -1;
	c->watch_efd = -1;
	c->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : 10000;
	c->spin_max_ns = wait_spin_ns();
	c->spin_ns = c->spin_max_ns;
	int rc;
	c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (c->fd < 0) {
		rc = RW_E_SYS;
		goto fail_free;
	}
	if (connect(c->fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
		rc = RW_E_CONNECT;
		goto fail_close;
	}

	rw_ipc_hello_t hello;
	memset(&hello, 0, sizeof(hello));
	hdr_init(c, &hello.hdr, RW_IPC_HELLO);
	memcpy(hello.group, opts->group, glen);
	hello.rank = opts->rank;
	hello.world_size = opts->world_size;
	hello.node = opts->node;
	hello.local_gpu = opts->local_gpu;
	memcpy(hello.gpu_uuid, opts->gpu_uuid, sizeof(hello.gpu_uuid));
	/* Without a key the hello keeps its first form (112 bytes), which daemons from before group
	 * keys accept too; the key fields need a daemon that knows them. */
	size_t hello_len = RW_IPC_HELLO_BASE_BYTES;
	const char *key = getenv("RAILWAVE_GROUP_KEY"); /* the launcher's, per job */
	if (key && *key) {
		size_t klen = strlen(key);
		if (klen > RW_IPC_GROUP_KEY_MAX) {
			rc = RW_E_INVAL;
			goto fail_close;
		}
		hello.key_len = (uint32_t)klen;
		memcpy(hello.key, key, klen);
		hello_len = sizeof(hello);
	}
	rw_ipc_msg_t reply;
	int fds[RW_IPC_MAX_FDS];
	rc = request(c, &hello, hello_len, -1, RW_IPC_HELLO_OK, &reply,
		     sizeof(rw_ipc_hello_ok_t), fds, 0);
	explicit_bzero(hello.key, sizeof(hello.key));
	if (rc)
		goto fail_close;
	c->limits = reply.hello_ok;
	c->id = reply.hello_ok.client_id;

	rw_ipc_ring_setup_t setup;
	memset(&setup, 0, sizeof(setup));
	hdr_init(c, &setup.hdr, RW_IPC_RING_SETUP);
	setup.sq_entries = sq_entries;
	setup.cq_entries = cq_entries;
	rc = request(c, &setup, sizeof(setup), -1, RW_IPC_RING_OK, &reply, sizeof(rw_ipc_ring_ok_t),
		     fds, 3);
	if (rc)
		goto fail_close;
	rc = map_rings(c, &reply.ring_ok, sq_entries, cq_entries, fds);
	close_fds(fds, 3);
	if (rc)
		goto fail_close;
	*client_p = c;
	return 0;
fail_close:
	close(c->fd);
fail_free:
	pthread_mutex_destroy(&c->sock_lock);
	pthread_mutex_destroy(&c->sig_lock);
	free(c);
	return rc;
}

/* The daemon is gone (the control socket hung up): write every word the rank's stream may still
 * wait on, from this CPU, so the stream runs through (docs/rankpath.md "Failure"). The page
 * stays mapped here until rw_client_close, which stops this thread first. */
static void *page_watch(void *arg)
{
	rw_client_t *c = arg;
	struct pollfd p[2] = { { .fd = c->fd, .events = 0 }, { .fd = c->watch_efd, .events = POLLIN } };
	for (;;) {
		int n = poll(p, 2, -1);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 || p[1].revents)
			return NULL;
		if (p[0].revents & (POLLHUP | POLLERR | POLLNVAL)) {
			rw_page_daemon_lost(c->page, RW_E_CLOSED);
			return NULL;
		}
	}
}

void rw_client_close(rw_client_t *c)
{
	if (!c)
		return;
	if (c->watch_efd >= 0) {
		uint64_t one = 1;
		ssize_t n = write(c->watch_efd, &one, sizeof(one));
		(void)n;
		pthread_join(c->watcher, NULL);
		close(c->watch_efd);
	}
	if (!atomic_load(&c->closed_code)) {
		rw_ipc_hdr_t bye;
		hdr_init(c, &bye, RW_IPC_GOODBYE);
		ssize_t n = send(c->fd, &bye, sizeof(bye), MSG_NOSIGNAL | MSG_DONTWAIT);
		(void)n;
	}
	for (size_t i = 0; i < c->nbufs; i++)
		munmap(c->bufs[i].addr, c->bufs[i].size);
	free(c->bufs);
	if (c->ring_map)
		munmap(c->ring_map, c->ring_bytes);
	if (c->page)
		munmap(c->page, c->page_bytes);
	for (unsigned r = 0; r < RW_CLIENT_SLAB_RAILS; r++) {
		if (c->slab[r].base)
			munmap(c->slab[r].base, c->slab[r].bytes);
		if (c->slab_gpu[r].kind == RW_CLIENT_SLAB_GPU)
			close(c->slab_gpu[r].fd);
	}
	if (c->sq_efd >= 0)
		close(c->sq_efd);
	if (c->cq_efd >= 0)
		close(c->cq_efd);
	close(c->fd);
	pthread_mutex_destroy(&c->sock_lock);
	pthread_mutex_destroy(&c->sig_lock);
	free(c->owed);
	free(c);
}

/* A request whose reply lends one memfd (the rank page, a slab): *fd_p is the caller's. */
static int request_lent(rw_client_t *c, const void *req, size_t len, uint16_t reply_type,
			rw_ipc_msg_t *reply, size_t reply_len, int *fd_p)
{
	int fds[RW_IPC_MAX_FDS];
	int rc = request(c, req, len, -1, reply_type, reply, reply_len, fds, 1);
	if (rc == 0)
		*fd_p = fds[0];
	return rc;
}

/* Map the memfd a reply lent (the page, a slab) when it is `bytes` long, as the reply said;
 * NULL when it is not (or `ok` is 0: the reply failed a check of its own). The fd is closed
 * either way; *ino_p: its inode. */
static void *map_lent(int fd, uint64_t bytes, int ok, uint64_t *ino_p)
{
	struct stat st;
	void *map = MAP_FAILED;
	if (ok && bytes > 0 && bytes <= SIZE_MAX && fstat(fd, &st) == 0 &&
	    (uint64_t)st.st_size == bytes)
		map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (map == MAP_FAILED)
		return NULL;
	if (ino_p)
		*ino_p = (uint64_t)st.st_ino;
	return map;
}

int rw_client_rank_page(rw_client_t *c, uint32_t max_recv, void **page_p, size_t *bytes_p)
{
	if (!c || !page_p || !bytes_p)
		return RW_E_INVAL;
	rw_ipc_page_setup_t req;
	memset(&req, 0, sizeof(req));
	hdr_init(c, &req.hdr, RW_IPC_PAGE_SETUP);
	req.max_recv = max_recv;
	rw_ipc_msg_t reply;
	int fd, rc = request_lent(c, &req, sizeof(req), RW_IPC_PAGE_OK, &reply,
				  sizeof(rw_ipc_page_ok_t), &fd);
	if (rc)
		return rc;
	const rw_ipc_page_ok_t *ok = &reply.page_ok;
	void *map = map_lent(fd, ok->bytes, ok->bytes >= sizeof(rw_page_head_t), NULL);
	if (!map)
		return RW_E_BADREPLY;
	const rw_page_head_t *head = map;
	if (head->magic != RW_PAGE_MAGIC || head->version != RW_PAGE_VERSION ||
	    head->bytes != ok->bytes || head->depth != RW_PAGE_DEPTH) {
		munmap(map, ok->bytes);
		return RW_E_BADREPLY;
	}
	c->page = map; /* before the watcher, which writes it */
	c->page_bytes = (size_t)ok->bytes;
	c->watch_efd = eventfd(0, EFD_CLOEXEC);
	if (c->watch_efd < 0 || pthread_create(&c->watcher, NULL, page_watch, c) != 0) {
		if (c->watch_efd >= 0)
			close(c->watch_efd);
		c->watch_efd = -1;
		munmap(map, ok->bytes);
		c->page = NULL;
		c->page_bytes = 0;
		return RW_E_SYS;
	}
	*page_p = map;
	*bytes_p = c->page_bytes;
	return 0;
}

/* The slab request of either form (ipc/proto.h): form 0 knows host slabs only. */
static int group_slab(rw_client_t *c, uint32_t rail, uint32_t form, rw_client_slab_t *slab_p,
		      rw_client_slab_gpu_t *gpu_p)
{
	if (!c || !slab_p || rail >= RW_CLIENT_SLAB_RAILS)
		return RW_E_INVAL;
	rw_client_slab_gpu_t *g = &c->slab_gpu[rail];
	if (g->kind == RW_CLIENT_SLAB_GPU && !form) {
		snprintf(c->last_msg, sizeof(c->last_msg), "rail %u's slab is GPU memory: "
			 "rw_client_group_slab_kind lends it", rail);
		return RW_E_STATE;
	}
	if (g->kind) { /* lent once per connection: what we hold */
		*slab_p = c->slab[rail];
		if (gpu_p)
			*gpu_p = *g;
		return 0;
	}
	rw_ipc_slab_setup_t req = { .rail = rail, .form = form };
	hdr_init(c, &req.hdr, RW_IPC_SLAB_SETUP);
	rw_ipc_msg_t reply;
	int fd, rc = request_lent(c, &req, sizeof(req), RW_IPC_SLAB_OK, &reply,
				  form ? sizeof(rw_ipc_slab_ok_t) : RW_IPC_SLAB_OK_BASE_BYTES, &fd);
	if (rc)
		return rc;
	const rw_ipc_slab_ok_t *ok = &reply.slab_ok;
	const uint32_t kind = form ? ok->kind : RW_CLIENT_SLAB_HOST;
	int bad = ok->rail != rail || ok->area_bytes > ok->bytes ||
		  ok->local_off > ok->bytes ||
		  (kind != RW_CLIENT_SLAB_HOST && kind != RW_CLIENT_SLAB_GPU) ||
		  (kind == RW_CLIENT_SLAB_GPU && (ok->device < 0 || ok->bytes == 0));
	for (int k = 0; k < 2 && !bad; k++) /* every area inside the slab */
		bad = ok->recv_off[k] > ok->bytes - ok->area_bytes ||
		      ok->send_off[k] > ok->bytes - ok->area_bytes;
	uint64_t ino = 0;
	void *map = NULL;
	struct stat st;
	if (kind == RW_CLIENT_SLAB_GPU) { /* kept for the caller's import, never mapped here */
		if (bad || fstat(fd, &st) != 0) {
			close(fd);
			return RW_E_BADREPLY;
		}
		ino = (uint64_t)st.st_ino;
	} else if (!(map = map_lent(fd, ok->bytes, !bad, &ino))) {
		return RW_E_BADREPLY;
	}
	rw_client_slab_t *s = &c->slab[rail];
	memset(s, 0, sizeof(*s));
	s->base = map;
	s->bytes = (size_t)ok->bytes;
	s->rail = rail;
	s->rails = ok->rails;
	s->area_bytes = ok->area_bytes;
	memcpy(s->recv_off, ok->recv_off, sizeof(s->recv_off));
	memcpy(s->send_off, ok->send_off, sizeof(s->send_off));
	s->local_off = ok->local_off;
	s->object = ino;
	memset(g, 0, sizeof(*g));
	g->kind = (int32_t)kind;
	g->fd = kind == RW_CLIENT_SLAB_GPU ? fd : -1;
	g->device = kind == RW_CLIENT_SLAB_GPU ? ok->device : -1;
	if (kind == RW_CLIENT_SLAB_GPU)
		memcpy(g->uuid, ok->uuid, sizeof(g->uuid));
	*slab_p = *s;
	if (gpu_p)
		*gpu_p = *g;
	return 0;
}

int rw_client_group_slab(rw_client_t *c, uint32_t rail, rw_client_slab_t *slab_p)
{
	return group_slab(c, rail, 0, slab_p, NULL);
}

int rw_client_group_slab_kind(rw_client_t *c, uint32_t rail, rw_client_slab_t *slab_p,
			      rw_client_slab_gpu_t *gpu_p)
{
	if (!gpu_p)
		return RW_E_INVAL;
	return group_slab(c, rail, RW_IPC_SLAB_FORM_KINDS, slab_p, gpu_p);
}

const char *rw_client_last_message(const rw_client_t *c) { return c->last_msg; }
uint32_t rw_client_id(const rw_client_t *c) { return c->id; }
unsigned rw_client_inflight(const rw_client_t *c)
{
	return atomic_load_explicit(&c->submitted, memory_order_relaxed) -
	       atomic_load_explicit(&c->completed, memory_order_relaxed);
}

int rw_client_register_host(rw_client_t *c, size_t size, uint32_t *buf_id_p, void **addr_p)
{
	if (!c || size == 0 || !buf_id_p || !addr_p)
		return RW_E_INVAL;
	int closed = atomic_load(&c->closed_code);
	if (closed)
		return closed;
	if (c->nbufs == c->capbufs) {
		size_t cap = c->capbufs ? 2 * c->capbufs : 8;
		host_buf_t *grown = realloc(c->bufs, cap * sizeof(*grown));
		if (!grown)
			return RW_E_NOMEM;
		c->bufs = grown;
		c->capbufs = cap;
	}
	int rc = RW_E_SYS;
	void *addr = MAP_FAILED;
	int fd = memfd_create("railwave-buffer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return RW_E_SYS;
	/* Sealed so neither side can resize it under the other's mapping. */
	if (ftruncate(fd, (off_t)size) < 0 ||
	    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
		goto fail;
	addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (addr == MAP_FAILED)
		goto fail;
	rw_ipc_reg_host_t req;
	memset(&req, 0, sizeof(req));
	hdr_init(c, &req.hdr, RW_IPC_REG_HOST);
	req.size = size;
	rw_ipc_msg_t reply;
	int fds[RW_IPC_MAX_FDS];
	rc = request(c, &req, sizeof(req), fd, RW_IPC_REG_OK, &reply, sizeof(rw_ipc_reg_ok_t), fds, 0);
	if (rc)
		goto fail;
	close(fd);
	c->bufs[c->nbufs++] = (host_buf_t){.id = reply.reg_ok.buf_id, .addr = addr, .size = size};
	*buf_id_p = reply.reg_ok.buf_id;
	*addr_p = addr;
	return 0;
fail:
	if (addr != MAP_FAILED)
		munmap(addr, size);
	close(fd);
	return rc;
}

/* A registration without fds (CUDA buffer, event): the request, its REG_OK, the id it names. */
static int request_reg(rw_client_t *c, const void *req, size_t len, uint32_t *id_p)
{
	rw_ipc_msg_t reply;
	int fds[RW_IPC_MAX_FDS];
	int rc = request(c, req, len, -1, RW_IPC_REG_OK, &reply, sizeof(rw_ipc_reg_ok_t), fds, 0);
	if (rc)
		return rc;
	*id_p = reply.reg_ok.buf_id;
	return 0;
}

/* A deregistration (DEREG of a buffer, DEREG_EVENT of an event) by id. */
static int request_dereg(rw_client_t *c, uint16_t type, uint32_t id)
{
	rw_ipc_dereg_t req;
	memset(&req, 0, sizeof(req));
	hdr_init(c, &req.hdr, type);
	req.buf_id = id;
	rw_ipc_msg_t reply;
	int fds[RW_IPC_MAX_FDS];
	return request(c, &req, sizeof(req), -1, RW_IPC_DEREG_OK, &reply, sizeof(rw_ipc_dereg_t),
		       fds, 0);
}

int rw_client_register_cuda(rw_client_t *c, const rw_client_cuda_desc_t *desc, uint32_t *buf_id_p)
{
	if (!c || !desc || !buf_id_p)
		return RW_E_INVAL;
	rw_ipc_reg_cuda_t req;
	memset(&req, 0, sizeof(req));
	hdr_init(c, &req.hdr, RW_IPC_REG_CUDA);
	memcpy(req.ipc_handle, desc->ipc_handle, sizeof(req.ipc_handle));
	req.alloc_id = desc->alloc_id;
	req.alloc_bytes = desc->alloc_bytes;
	req.offset = desc->offset;
	req.bytes = desc->bytes;
	memcpy(req.device_uuid, desc->device_uuid, sizeof(req.device_uuid));
	req.device = desc->device;
	return request_reg(c, &req, sizeof(req), buf_id_p);
}

int rw_client_deregister(rw_client_t *c, uint32_t buf_id)
{
	if (!c)
		return RW_E_INVAL;
	int rc = request_dereg(c, RW_IPC_DEREG, buf_id);
	if (rc)
		return rc;
	for (size_t i = 0; i < c->nbufs; i++) {
		if (c->bufs[i].id != buf_id)
			continue;
		munmap(c->bufs[i].addr, c->bufs[i].size);
		c->bufs[i] = c->bufs[--c->nbufs];
		break;
	}
	return 0;
}

/* ---- stream order (railwave.h "Stream-ordered submission") ---- */

static int event_slot(const rw_client_t *c, uint32_t id)
{
	for (int i = 0; id && i < RW_CLIENT_MAX_EVENTS; i++)
		if (c->events[i].id == id)
			return i;
	return -1;
}

int rw_client_register_event(rw_client_t *c, const uint8_t handle[RW_EVENT_HANDLE_BYTES],
			     uint32_t flag_buf, uint64_t flag_offset, uint32_t *event_id_p)
{
	if (!c || !handle || !event_id_p)
		return RW_E_INVAL;
	int slot = event_slot(c, 0);
	for (int i = 0; i < RW_CLIENT_MAX_EVENTS && slot < 0; i++)
		if (!c->events[i].id)
			slot = i;
	if (slot < 0)
		return RW_E_LIMIT;
	rw_ipc_reg_event_t req;
	memset(&req, 0, sizeof(req));
	hdr_init(c, &req.hdr, RW_IPC_REG_EVENT);
	memcpy(req.handle, handle, sizeof(req.handle));
	req.flag_buf = flag_buf;
	req.flag_offset = flag_offset;
	uint32_t id;
	int rc = request_reg(c, &req, sizeof(req), &id);
	if (rc)
		return rc;
	if (id == 0 || id > 0xffff)
		return RW_E_BADREPLY;
	c->events[slot].id = id;
	c->events[slot].flag_buf = flag_buf;
	c->events[slot].flag_offset = flag_offset;
	*event_id_p = id;
	return 0;
}

int rw_client_deregister_event(rw_client_t *c, uint32_t event_id)
{
	if (!c)
		return RW_E_INVAL;
	int rc = request_dereg(c, RW_IPC_DEREG_EVENT, event_id);
	if (rc)
		return rc;
	int slot = event_slot(c, event_id);
	if (slot >= 0)
		c->events[slot].id = 0;
	return 0;
}

/* Before entries are queued: every event id they name is registered here, and each one that
 * signals is owed until its completion is reaped (or the connection is lost). */
static int owe_signals(rw_client_t *c, const rw_sqe_t *entries, unsigned n)
{
	unsigned signals = 0;
	for (unsigned i = 0; i < n; i++) {
		if (entries[i].flags && entries[i].event_id && event_slot(c, entries[i].event_id) < 0)
			return RW_E_INVAL; /* the daemon could not write its flag */
		signals += (entries[i].flags & RW_SQE_SIGNAL) && entries[i].event_id;
	}
	if (!signals)
		return 0;
	pthread_mutex_lock(&c->sig_lock);
	if (c->nowed + signals > c->capowed) {
		size_t cap = c->capowed ? 2 * c->capowed : 16;
		while (cap < c->nowed + signals)
			cap *= 2;
		struct owed *o = realloc(c->owed, cap * sizeof(*o));
		if (!o) {
			pthread_mutex_unlock(&c->sig_lock);
			return RW_E_NOMEM;
		}
		c->owed = o;
		c->capowed = cap;
	}
	for (unsigned i = 0; i < n; i++) {
		const rw_sqe_t *e = &entries[i];
		int slot = event_slot(c, e->event_id);
		if (!(e->flags & RW_SQE_SIGNAL) || slot < 0)
			continue; /* no flag (an id of 0 is refused by the daemon: no flag to owe) */
		c->owed[c->nowed++] = (struct owed){
			.s = { .event_id = e->event_id, .value = e->output.reserved,
			       .flag_buf = c->events[slot].flag_buf,
			       .flag_offset = c->events[slot].flag_offset, .phase_id = e->phase_id,
			       .user_data = e->user_data },
			.kind = e->kind };
	}
	pthread_mutex_unlock(&c->sig_lock);
	return 0;
}

/* A completion was reaped: its flag is written (the daemon writes it before the CQE). */
static void paid(rw_client_t *c, const rw_cqe_t *cqe)
{
	pthread_mutex_lock(&c->sig_lock);
	for (size_t i = 0; i < c->nowed; i++)
		if (c->owed[i].kind == cqe->kind && c->owed[i].s.phase_id == cqe->phase_id &&
		    c->owed[i].s.user_data == cqe->user_data) {
			memmove(&c->owed[i], &c->owed[i + 1], (c->nowed - i - 1) * sizeof(c->owed[0]));
			c->nowed--;
			break;
		}
	pthread_mutex_unlock(&c->sig_lock);
}

int rw_client_lost_signals(rw_client_t *c, rw_client_lost_signal_t *out, unsigned max)
{
	if (!c || (!out && max))
		return RW_E_INVAL;
	if (!atomic_load(&c->closed_code))
		return 0;
	pthread_mutex_lock(&c->sig_lock);
	unsigned n = (unsigned)MIN_U(c->nowed, (size_t)max);
	for (unsigned i = 0; i < n; i++)
		out[i] = c->owed[i].s;
	memmove(c->owed, c->owed + n, (c->nowed - n) * sizeof(c->owed[0]));
	c->nowed -= n;
	pthread_mutex_unlock(&c->sig_lock);
	return (int)n;
}

int rw_client_submit(rw_client_t *c, const rw_sqe_t *entries, unsigned n)
{
	if (!c || (!entries && n))
		return RW_E_INVAL;
	int closed = atomic_load(&c->closed_code);
	if (closed)
		return closed;
	if (n == 0)
		return 0;
	int space = rw_ring_prod_space(&c->sq, n);
	if (space < 0)
		return mark_closed(c, RW_E_BADREPLY);
	if ((unsigned)space < n)
		return RW_E_AGAIN;
	int rc = owe_signals(c, entries, n);
	if (rc)
		return rc;
	for (unsigned i = 0; i < n; i++) {
		memcpy(rw_ring_prod_next(&c->sq), &entries[i], sizeof(rw_sqe_t));
		rw_ring_prod_push(&c->sq);
	}
	rw_ring_prod_publish(&c->sq);
	atomic_fetch_add_explicit(&c->submitted, n, memory_order_relaxed);
	return 0;
}

/* Up to max completions out of the ring. */
static int cq_take(rw_client_t *c, rw_cqe_t *out, unsigned max)
{
	int avail = rw_ring_cons_avail(&c->cq);
	if (avail < 0)
		return mark_closed(c, RW_E_BADREPLY);
	unsigned n = MIN_U((unsigned)avail, max);
	int failed = 0;
	for (unsigned i = 0; i < n; i++) {
		memcpy(&out[i], rw_ring_cons_peek(&c->cq, i), sizeof(rw_cqe_t));
		failed |= out[i].status == RW_CQ_ERROR;
		paid(c, &out[i]);
	}
	rw_ring_cons_release(&c->cq, n);
	atomic_fetch_add_explicit(&c->completed, n, memory_order_relaxed);
	if (failed) /* the daemon said why before it posted the completion */
		rw_client_take_notices(c);
	return (int)n;
}

int rw_client_poll(rw_client_t *c, rw_cqe_t *out, unsigned max)
{
	if (!c || (!out && max))
		return RW_E_INVAL;
	/* What the daemon posted before it closed (a stopping daemon's last answers) comes
	 * first, however the closure was noticed: the closed code only once the ring is empty. */
	int closed = atomic_load(&c->closed_code);
	int n = cq_take(c, out, max);
	return n == 0 && closed ? closed : n;
}

/* The daemon wrote to our control socket while we waited: EOF, or a fatal error message. */
static int socket_event(rw_client_t *c)
{
	rw_ipc_msg_t msg;
	int fds[RW_IPC_MAX_FDS];
	unsigned nfds;
	if (pthread_mutex_trylock(&c->sock_lock) != 0)
		return 0; /* a request is reading it */
	int got = recv_msg(c, &msg, fds, &nfds, 0);
	pthread_mutex_unlock(&c->sock_lock);
	close_fds(fds, nfds);
	if (got == 0)
		return mark_closed(c, RW_E_CLOSED);
	if (got < 0)
		return got == RW_E_TIMEOUT ? 0 : got;
	if (got >= (int)sizeof(rw_ipc_hdr_t) && msg.hdr.type == RW_IPC_ERROR) {
		int rc = take_error(c, &msg, got);
		return atomic_load(&c->closed_code) ? rc : 0;
	}
	return mark_closed(c, RW_E_BADREPLY); /* nothing else is unsolicited */
}

/* Before sleeping, watch the completion ring's head for up to spin_ns, yielding the CPU
 * between looks (a daemon thread or another rank runnable on this CPU goes first; with nothing
 * else to run the yield returns at once). A completion seen here costs no eventfd write on the
 * daemon's side (the ring is not armed) and no wake-up on ours. Adaptive: a wait answered
 * within spin_max_ns keeps the full budget for the next; a longer one halves it, so a rank
 * whose phases take milliseconds spins next to nothing. The daemon's death is still seen: the
 * spin is bounded, then the sleep below polls the control socket. Returns what
 * rw_client_poll returned (0: nothing came; sleep now). */
static int wait_spin(rw_client_t *c, rw_cqe_t *out, unsigned max, int64_t start_ns,
		     int64_t deadline_ms)
{
	int64_t until = start_ns + c->spin_ns;
	if (deadline_ms >= 0 && deadline_ms * 1000000 < until)
		until = deadline_ms * 1000000;
	for (;;) {
		sched_yield();
		int n = rw_client_poll(c, out, max);
		if (n != 0)
			return n;
		if (now_ns() >= until)
			return 0;
	}
}

int rw_client_wait(rw_client_t *c, rw_cqe_t *out, unsigned max, int timeout_ms)
{
	int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
	int n = rw_client_poll(c, out, max);
	if (n != 0 || max == 0)
		return n;
	int64_t start = now_ns();
	if (c->spin_ns && timeout_ms != 0) {
		n = wait_spin(c, out, max, start, deadline);
		if (n != 0) {
			if (n > 0)
				c->spin_ns = c->spin_max_ns;
			return n;
		}
	}
	for (;;) {
		n = rw_client_poll(c, out, max);
		if (n != 0) {
			if (n > 0 && now_ns() - start > (int64_t)c->spin_max_ns)
				c->spin_ns /= 2;
			else if (n > 0)
				c->spin_ns = c->spin_max_ns;
			return n;
		}
		int ready = rw_ring_cons_arm(&c->cq);
		if (ready < 0)
			return mark_closed(c, RW_E_BADREPLY);
		if (ready > 0)
			continue;
		int wait = -1;
		if (deadline >= 0) {
			int64_t left = deadline - now_ms();
			if (left <= 0) {
				rw_ring_cons_disarm(&c->cq);
				return 0;
			}
			wait = (int)left;
		}
		struct pollfd pfd[2] = {{.fd = c->cq_efd, .events = POLLIN},
					{.fd = c->fd, .events = POLLIN}};
		int r = poll(pfd, 2, wait);
		if (r < 0 && errno != EINTR)
			return RW_E_SYS;
		if (r > 0 && (pfd[0].revents & POLLIN)) {
			uint64_t count;
			ssize_t k = read(c->cq_efd, &count, sizeof(count));
			(void)k;
		}
		if (r > 0 && (pfd[1].revents & (POLLIN | POLLHUP | POLLERR))) {
			int rc = socket_event(c);
			if (rc < 0 && !atomic_load(&c->closed_code))
				return rc;
		} /* a closure is answered by the poll above, once the ring is empty */
		rw_ring_cons_disarm(&c->cq);
	}
}
