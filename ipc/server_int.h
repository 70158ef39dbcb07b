/* ipc/server_int.h: private to the daemon side of node-local IPC (ipc/server_conn.c: replies,
 * error replies, the kill and the buffer lookup, used by all the others and calling none;
 * ipc/server.c: accept, control messages, buffer registration, the reaper; ipc/server_auth.c:
 * rank authentication, i.e. admission by peer credentials and the per-uid cap, the hello
 * timeout, groups and group keys; ipc/server_event.c: registered events; ipc/server_ring.c: the
 * rings; ipc/server_close.c: the descriptors clients pass, closed off the loop). Not installed and not for service/: the daemon's face is ipc/ipc.h. */
#ifndef RW_IPC_SERVER_INT_H
#define RW_IPC_SERVER_INT_H

#include "common/listen_pause.h"
#include "ipc/ipc.h"

#include <sys/types.h>

#include <ev.h>
#include <sodium.h>

#include "cuda/rw_cuda.h"
#include "ipc/proto.h"
#include "ipc/ring.h"

/* Lines a second for connects, joins, leaves and refusals: one local process that opens and
 * abandons groups in a loop cannot fill the disk (rw_log_budget_t). */
#define IPC_CHURN_LOG_PER_S 20
#define MAX_BUFFER_SLOTS 256 /* buffer id = generation << 8 | slot */

typedef struct buf_slot {
	uint32_t id; /* 0: free */
	rw_ipc_buffer_t pub;
	void *map;                   /* HOST mapping */
	rw_cuda_ipc_map_t *cuda_map; /* CUDA import reference */
} buf_slot_t;

#define MAX_EVENT_SLOTS 64 /* event id = generation << 6 | slot, 1..65535 */

/* A registered interprocess event and the rank's completion flag (server_event.c). */
typedef struct ipc_event {
	uint32_t id;                 /* 0: free */
	rw_cuda_event_t *ev;
	int device;                  /* the flag's (and the event's) device in this process */
	uint32_t flag_buf;
	uint64_t flag_dptr;
} ipc_event_t;

typedef struct ipc_group {
	char name[RW_GROUP_NAME_MAX];
	uint32_t world_size;
	uint32_t node;
	rw_ipc_client_t *members; /* joined clients, linked by group_next */
	struct ipc_group *next;
	int keyed;                /* its first rank presented a group key */
	uint8_t key_hash[crypto_generichash_BYTES]; /* keyed hash of it (the key is not kept) */
} ipc_group_t;

struct rw_ipc_client {
	rw_ipc_server_t *srv;
	rw_ipc_client_t *prev, *next; /* server's list of connections */
	rw_ipc_client_t *group_next;
	rw_ipc_client_t *reap_next;
	rw_ipc_client_t *flush_next;
	struct rw_ipc_keep *keep;    /* its CUDA mappings kept past its leave (rw_ipc_client_keep) */
	ipc_group_t *group;
	int fd;
	ev_io io;
	ev_timer hello_timer; /* runs from accept until the hello is accepted */
	int hello_grace;      /* the deadline met a hello waiting unread: one more period given */
	rw_ipc_client_info_t info;
	uint64_t start_time; /* the peer process's, from /proc at accept (0: unknown): with the pid,
	                        the exporter identity of its CUDA imports */
	int joined;
	int dying;
	int on_flush_list;
	rw_ipc_leave_t leave_reason;
	int leave_error;
	void *data;

	buf_slot_t *bufs; /* max_buffers slots */
	uint32_t nbufs;
	uint32_t buf_gen;

	ipc_event_t *events; /* max_events slots, allocated at the first registration */
	uint32_t nevents;
	uint32_t event_gen;

	int rings_up;
	void *ring_map;
	size_t ring_bytes;
	int sq_efd; /* client writes it: "submissions ready" or "completion slots freed" */
	int cq_efd; /* daemon writes it: "completions ready" */
	ev_io sq_io;
	rw_ring_t sq; /* daemon consumes */
	rw_ring_t cq; /* daemon produces */
	struct ipc_page *page; /* the rank page (ipc/server_page.c), NULL until set up */
	uint64_t slabs_lent;   /* bit r: its group's slab of rail r was lent (ipc/server_slab.c) */
	uint32_t reserved; /* completions owed for submissions handed to the service */
	int cq_blocked;    /* stopped draining for lack of completion slots */
};

struct rw_ipc_server {
	struct ev_loop *loop;
	char *socket_path;
	rw_ipc_server_config_t cfg;
	rw_ipc_limits_t lim;
	rw_ipc_server_ops_t ops;
	void *ctx;
	int listen_fd;
	ev_io accept_io;
	rw_listen_pause_t accept_pause; /* rests the listener when descriptors run out */
	ev_prepare prepare;
	ev_idle idle;
	int polling;
	uint64_t poll_deadline_ns;
	rw_ipc_client_t *clients;
	uint32_t nclients;
	ipc_group_t *groups;
	rw_ipc_client_t *reap;
	rw_ipc_client_t *flush;
	uint32_t next_id;
	int32_t node;
	int cuda_state; /* 0 not tried, 1 ready, -1 unavailable */
	rw_cuda_ipc_cache_t *cuda;
	rw_ipc_server_stats_t stats;
	rw_log_budget_t churn_log;    /* connect, join, leave and refusal lines (IPC_CHURN_LOG_PER_S) */
	uint8_t key_salt[crypto_generichash_KEYBYTES]; /* random per server: keys the group hashes */
	rw_ipc_poller_t *poller;     /* with page_rails: watches the rank pages' words */
	struct ipc_page *pages;      /* every page still mapped (its client may be gone) */
	struct ipc_page **by_watch;  /* poller watch id -> page */
	int pages_busy;              /* rank-path phases in flight (rw_ipc_server_pages_busy) */
	struct ipc_closer *closer;   /* closes the descriptors clients pass (server_close.c) */
	struct rw_ipc_keep *keeps;   /* every keep not yet dropped (rw_ipc_client_keep) */
};

/* Sending (server_conn.c). ipc_send_msg drops a client whose socket is full (-1); ipc_send_error
 * returns 0 so handlers can `return ipc_send_error(...)`, and drops the client when fatal. */
void ipc_hdr_init(rw_ipc_hdr_t *hdr, uint16_t type, uint32_t seq);
int ipc_send_msg(rw_ipc_client_t *c, const void *msg, size_t len, const int *fds, unsigned nfds);
int ipc_send_error(rw_ipc_client_t *c, uint32_t seq, int code, const char *why, int fatal);
/* DEREG_OK echoing the request's id (buffer or event); returns 0. */
int ipc_reply_dereg_ok(rw_ipc_client_t *c, const rw_ipc_dereg_t *req);

/* Buffers and CUDA (server_conn.c). */
buf_slot_t *ipc_buf_find(const rw_ipc_client_t *c, uint32_t id);
int ipc_cuda_ready(rw_ipc_server_t *srv); /* 1: CUDA imports work in this daemon */

/* Stream order (server_event.c). */
int ipc_handle_reg_event(rw_ipc_client_t *c, const rw_ipc_reg_event_t *req);
int ipc_handle_dereg_event(rw_ipc_client_t *c, const rw_ipc_dereg_t *req);
/* The event holding buffer buf_id's flag, or NULL (such a buffer cannot be deregistered). */
const ipc_event_t *ipc_event_of_buf(const rw_ipc_client_t *c, uint32_t buf_id);
const ipc_event_t *ipc_event_find(const rw_ipc_client_t *c, uint32_t id);
void ipc_events_free(rw_ipc_client_t *c);

/* Rank authentication (server_auth.c). */
/* A freshly accepted connection: its peer credentials read (SO_PEERCRED, and the process start
 * time), the client and per-uid caps checked. Returns the new client (not yet on any list) or
 * NULL after refusing and closing fd. */
rw_ipc_client_t *ipc_admit(rw_ipc_server_t *srv, int fd);
/* Closes a connection that did not join within hello_timeout_ms (data: the client). */
void ipc_hello_timeout_cb(struct ev_loop *loop, ev_timer *w, int revents);
/* HELLO: group key, group membership checks, join, HELLO_OK. */
int ipc_handle_hello(rw_ipc_client_t *c, const rw_ipc_hello_t *req);
/* Leave the client's group (freed with its last member). */
void ipc_group_leave(rw_ipc_client_t *c);

/* server_conn.c: drop a client (its leave is reported; freed by server.c's reaper); a buffer's
 * size by id (the submission check's lookup). */
void ipc_client_kill(rw_ipc_client_t *c, rw_ipc_leave_t reason, int error);
uint64_t ipc_buf_size_of(void *ctx, uint32_t id);
/* server_page.c: the rank page. */
int ipc_page_setup(rw_ipc_client_t *c, const rw_ipc_page_setup_t *req);
/* The client leaves: its page's watches are retired, the page unmapped after them. */
void ipc_page_free(rw_ipc_client_t *c);
/* Server create / destroy: the poller (with page_rails), and every page left at the end. */
rw_status_t ipc_pages_start(rw_ipc_server_t *srv);
void ipc_pages_stop(rw_ipc_server_t *srv);
/* Before the loop blocks: while a rank-path phase is in flight, the loop has just done its part
 * of it (written a page word, sent to a peer) and a rank's word is likely next: kick the poller
 * (its spin window restarts, a sleep ends). */
void ipc_pages_prepare(rw_ipc_server_t *srv);

/* server_slab.c: the group's slab of a rail, lent once per connection and rail. */
int ipc_slab_setup(rw_ipc_client_t *c, const rw_ipc_slab_setup_t *req);

/* server_close.c: a descriptor a client passed is closed by a thread of its own, never on the
 * loop (a lingering socket's close waits), a socket's SO_LINGER turned off first. Start at
 * server create; stop at destroy (the thread ends on its own once its queue is closed). */
typedef struct ipc_closer ipc_closer_t;
rw_status_t ipc_closer_start(rw_ipc_server_t *srv);
void ipc_closer_stop(rw_ipc_server_t *srv);
void ipc_fd_discard(rw_ipc_server_t *srv, int fd);

/* server_ring.c: the rings. */
int ipc_ring_setup(rw_ipc_client_t *c, const rw_ipc_ring_setup_t *req);
void ipc_rings_free(rw_ipc_client_t *c);
void ipc_flush_client(rw_ipc_client_t *c);
void ipc_push_cqe(rw_ipc_client_t *c, const rw_cqe_t *cqe);
void ipc_ring_idle_cb(struct ev_loop *loop, ev_idle *w, int revents);

#endif /* RW_IPC_SERVER_INT_H */
