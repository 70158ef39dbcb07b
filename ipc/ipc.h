/* ipc/ daemon face: the node-local IPC server railwaved runs on its libev loop. It accepts trainer
 * ranks on a Unix SOCK_SEQPACKET socket, validates every control message, maps their host
 * buffers (memfd) and imports their CUDA buffers (cuda/), owns each client's shared-memory rings,
 * and hands validated submissions to the service through callbacks. The client face of the same
 * module is ipc/railwave.h (librailwave); docs/ipc.md explains why there are two.
 *
 * Threads: everything here runs on the loop's thread; nothing blocks it. Callbacks are made from
 * the loop. Clients are never freed inside a callback: rw_ipc_client_drop() marks the client,
 * and it is torn down (client_left, then buffers, rings, fds, CUDA imports) from the loop's next
 * prepare phase, after the current callback returned. */
#ifndef RW_IPC_H
#define RW_IPC_H

#include <stdint.h>
#include <sys/types.h>

#include "common/common.h"
#include "ipc/railwave.h"

struct ev_loop;

typedef struct rw_ipc_server rw_ipc_server_t;
typedef struct rw_ipc_client rw_ipc_client_t; /* daemon-side view of one connected rank */

/* Why a client left (client_left's `reason`). */
typedef enum rw_ipc_leave {
	RW_IPC_LEFT_GOODBYE = 0,  /* it said goodbye */
	RW_IPC_LEFT_EOF = 1,      /* its socket closed or reset (process died) */
	RW_IPC_LEFT_PROTOCOL = 2, /* it broke the protocol; `error` holds the RW_E_* code */
	RW_IPC_LEFT_DROPPED = 3,  /* the service called rw_ipc_client_drop() */
	RW_IPC_LEFT_SHUTDOWN = 4, /* rw_ipc_server_destroy() */
} rw_ipc_leave_t;

const char *rw_ipc_leave_str(rw_ipc_leave_t reason);

/* A group key's fingerprint: a keyed hash (BLAKE2b) of the group's name under the key, zeros for
 * a rank without one. Ranks of one job share it; it tells other nodes which key a node's ranks
 * hold without telling anyone the key. */
#define RW_IPC_KEY_FP_SIZE 16

/* Identity from the hello, plus the peer's credentials from SO_PEERCRED. */
typedef struct rw_ipc_client_info {
	uint32_t id;        /* connection id, unique while the daemon runs */
	char group[RW_GROUP_NAME_MAX];
	uint32_t rank;
	uint32_t world_size;
	uint32_t node;
	int32_t local_gpu;
	uint8_t gpu_uuid[16];
	uint8_t key_fp[RW_IPC_KEY_FP_SIZE]; /* its group key's fingerprint (zeros: none) */
	pid_t pid;
	uid_t uid;
	gid_t gid;
} rw_ipc_client_info_t;

typedef enum rw_ipc_buf_kind { RW_IPC_BUF_HOST = 1, RW_IPC_BUF_CUDA = 2 } rw_ipc_buf_kind_t;

/* A registered buffer as the daemon sees it. Valid until the client deregisters it (refused while
 * it has submissions in flight) or leaves (after client_left returned). */
typedef struct rw_ipc_buffer {
	uint32_t id;
	rw_ipc_buf_kind_t kind;
	uint64_t size;
	void *host;        /* HOST: the daemon's mapping (MAP_SHARED, read/write) */
	uint64_t dptr;     /* CUDA: the range's device address in this process */
	int device;        /* CUDA: device ordinal in this process; HOST: -1 */
} rw_ipc_buffer_t;

/* One rail's slab of a group (docs/rankpath.md "The slab areas, lent per group"), as the
 * service gives it for lending: the fd stays the service's (the server sends a copy). */
typedef struct rw_ipc_slab {
	int fd;                /* HOST: a sealed memfd of `bytes`; GPU: the allocation's POSIX fd */
	uint32_t kind;         /* RW_CLIENT_SLAB_HOST (or 0) or RW_CLIENT_SLAB_GPU */
	int32_t device;        /* GPU: the device's ordinal in the daemon; HOST: -1 */
	uint8_t uuid[16];      /* GPU: that device's UUID */
	uint64_t bytes;
	uint32_t rails;
	uint64_t area_bytes;   /* each of the four record areas (the local area: the rest) */
	uint64_t recv_off[2];  /* [0] dispatch, [1] combine */
	uint64_t send_off[2];
	uint64_t local_off;    /* the rank path's local area */
} rw_ipc_slab_t;

/* Callbacks (all optional except submission). `ctx` is the pointer given at creation.
 * The client pointer stays valid until client_left returns. */
typedef struct rw_ipc_server_ops {
	/* A rank completed hello (identity validated and unique in its group). */
	void (*client_joined)(void *ctx, rw_ipc_client_t *client);
	/* A joined rank is going away; after this returns its buffers are unmapped and its pointer
	 * is dead. Stop using its buffers before returning. error: RW_E_* or 0. */
	void (*client_left)(void *ctx, rw_ipc_client_t *client, rw_ipc_leave_t reason, int error);
	/* A submission passed every check (copied out of shared memory: the service owns *sqe only
	 * during the call). Each one must be answered by exactly one rw_ipc_complete() — from this
	 * callback or later. Invalid submissions never get here: the server completes them itself
	 * with RW_CQ_ERROR. */
	void (*submission)(void *ctx, rw_ipc_client_t *client, const rw_sqe_t *sqe);
	/* A buffer was registered (after the daemon mapped/imported it). */
	void (*buffer_registered)(void *ctx, rw_ipc_client_t *client, const rw_ipc_buffer_t *buf);
	/* Optional. A word the rank writes in its rank page (ipc/page.h: RW_PW_SUBMIT, _PACKED or
	 * _DONE) moved forward to `value`, 1 to RW_PAGE_DEPTH phases past the last one reported
	 * (the poller may skip values). A word that went back or further is the rank's protocol
	 * error: the server drops it (RW_E_RING_INDEX) and this is not called. */
	void (*page_word)(void *ctx, rw_ipc_client_t *client, unsigned word, uint64_t value);
	/* Optional. A well-formed hello for rank `rank` (of `world`) of `group`, whose key has
	 * the fingerprint key_fp, was refused: its key, its node, its world or its seat (code: the
	 * RW_E_* the client got, why: its sentence). That rank does not join here now; the
	 * connection is being dropped. */
	void (*hello_refused)(void *ctx, const char *group, uint32_t rank, uint32_t world,
			      const uint8_t key_fp[RW_IPC_KEY_FP_SIZE], int code, const char *why);
	/* Optional. A joined rank asks for its own group's slab of `rail`: fill *slab_p and return
	 * 0, or return an RW_E_* code with *why_p set (RW_E_INVAL: no such rail; RW_E_STATE: this
	 * daemon lends no slabs; RW_E_LIMIT: the group has none, the pool was spent). The server
	 * lends each rail's slab once per connection. NULL: RW_E_STATE. */
	int (*group_slab)(void *ctx, rw_ipc_client_t *client, uint32_t rail, rw_ipc_slab_t *slab_p,
			  const char **why_p);
} rw_ipc_server_ops_t;

typedef struct rw_ipc_server_config {
	const char *socket_path;    /* required; a stale socket file there is replaced */
	unsigned mode;              /* socket file mode; 0 = 0660 */
	const char *group;          /* chown the socket to this group (name); NULL: leave it */
	int32_t node;               /* this daemon's node; hellos must match; -1: take the first */
	uint32_t world_size;        /* ranks of every group (the cluster's nodes x GPUs per node):
	                             * a hello with another world size is refused naming the cluster
	                             * file (RW_E_WORLD_MISMATCH); 0: any (the first rank sets it) */
	uint32_t gpus_per_node;     /* with world_size and node: rank / gpus_per_node must be node */
	uint32_t max_clients;       /* 0 = 256 */
	uint32_t max_buffers;       /* per client; 0 = 64 */
	uint64_t max_buffer_bytes;  /* 0 = 1 TiB */
	uint32_t max_tokens;        /* per submission; 0 = 1 << 20 */
	uint32_t max_hidden;        /* 0 = 65536 */
	uint32_t max_topk;          /* 0 = 64 */
	uint32_t max_ring_entries;  /* 0 = 4096 */
	uint32_t max_world;         /* 0 = 1 << 20 */
	int32_t max_local_gpu;      /* 0 = 64 */
	uint32_t max_experts;       /* n_experts of a submission; 0 = 1 << 20 */
	uint32_t max_events;        /* registered events per client (stream order); 0 = 16, <= 64 */
	uint32_t dtypes;            /* bit d: submissions of dtype d are carried; 0 = every dtype */
	/* After ring activity, keep polling every client's submission ring for this long before
	 * arming the eventfds and sleeping (an ev_idle watcher; the loop still serves its other
	 * watchers between polls). 0: never poll, always sleep on the eventfds. */
	uint32_t busy_poll_us;
	/* Rank authentication (docs/ipc.md "Rank authentication"). */
	int require_group_key;      /* 1: a hello without a group key is refused (RW_E_GROUP_KEY);
	                             * 0: a group opened without a key stays open to any rank */
	uint32_t max_per_uid;       /* connections one uid may hold (joined or not); 0 = 64 */
	uint32_t hello_timeout_ms;  /* a connection that has not joined by then is closed; 0 = 5000 */
	/* The rank page (docs/rankpath.md): lent to a rank that asks, sized for the cluster's nodes
	 * (world_size / gpus_per_node, both needed) and page_rails rails. 0: no page is lent
	 * (RW_E_STATE). page_max_recv bounds a rank's max_recv; 0 = max_tokens. With page_rails
	 * the server runs a word poller (below) over every page's rank-written words. */
	uint32_t page_rails;
	uint32_t page_max_recv;
	/* With page_rails: the word poller's schedule (max_watches is the server's), read at
	 * create; NULL: the RW_IPC_POLLER_* defaults below. */
	const struct rw_ipc_poller_config *poller;
	/* Each local rank's native rail, written into its page (the column its count row counts
	 * in): gpus_per_node entries, each < page_rails, indexed by the rank's place on its node
	 * (rank % gpus_per_node, never the hello's local GPU); NULL: local rank g on rail
	 * g % page_rails. */
	const uint8_t *page_gpu_rail;
} rw_ipc_server_config_t;

/* Create the folder of a socket path if it is missing: mode 0755, or 0750 and owned by `group`
 * (a name; NULL or "" = none). A folder that exists is left as it is, with a warning when others
 * may write it without the sticky bit (they could replace the socket). RW_ERR_INVAL for an
 * unknown group, RW_ERR_SYS if mkdir/chown fails (logged). The stats socket uses it too. */
rw_status_t rw_ipc_socket_dir(const char *socket_path, const char *group);

/* Bind and listen on cfg->socket_path (mode, then group via chown), start accepting on `loop`.
 * Errors: RW_ERR_INVAL (bad config, path too long, unknown group), RW_ERR_EXISTS (a live
 * daemon answers on that path), RW_ERR_SYS (socket/bind/listen/chmod/chown failed; logged). */
rw_status_t rw_ipc_server_create(struct ev_loop *loop, const rw_ipc_server_config_t *cfg,
				 const rw_ipc_server_ops_t *ops, void *ctx,
				 rw_ipc_server_t **server_p);

/* Drop every client (client_left with RW_IPC_LEFT_SHUTDOWN), stop the watchers, close and
 * unlink the socket. Not from inside one of this server's callbacks. NULL is a no-op. */
void rw_ipc_server_destroy(rw_ipc_server_t *server);

/* Answer one submission of `client`. Staged in the completion ring; published (one index store
 * and at most one eventfd write) when the server finishes the current batch of submissions, in
 * the loop's next prepare phase, or at rw_ipc_server_flush(). Never blocks, never fails for lack
 * of room: the server only takes a submission off the ring when a completion slot is reserved
 * for it. RW_ERR_STATE if the client has no submission awaiting completion (or is leaving: the
 * completion is discarded). */
rw_status_t rw_ipc_complete(rw_ipc_server_t *server, rw_ipc_client_t *client, const rw_cqe_t *cqe);

/* Publish every staged completion now. */
void rw_ipc_server_flush(rw_ipc_server_t *server);

/* Look a client's buffer up. RW_ERR_NOTFOUND for an unknown id. */
rw_status_t rw_ipc_buffer_lookup(const rw_ipc_client_t *client, uint32_t buf_id,
				 rw_ipc_buffer_t *buf_p);

/* Stream order (railwave.h "Stream-ordered submission"): a client's registered event, imported
 * on `device`, and its completion flag's device address. Valid while the client has submissions
 * in flight (deregistration is refused then) and until client_left returns. */
struct rw_cuda_event;
typedef struct rw_ipc_event {
	uint32_t id;
	int device;
	struct rw_cuda_event *event;
	uint64_t flag_dptr;
} rw_ipc_event_t;
/* RW_ERR_NOTFOUND for an unknown id (the server refuses such submissions itself). */
rw_status_t rw_ipc_event_lookup(const rw_ipc_client_t *client, uint32_t id, rw_ipc_event_t *ev_p);
/* For a submission with RW_SQE_SIGNAL whose outputs the mover will not write (refused, failed):
 * write its flag value now, synchronously, once nothing of the daemon touches the rank's memory
 * for it any more; before its completion. No-op without RW_SQE_SIGNAL. */
void rw_ipc_signal_now(rw_ipc_client_t *client, const rw_sqe_t *sqe);

/* Drop a client (deferred: safe from any callback, including its own). Its pending completions
 * are discarded; client_left follows with RW_IPC_LEFT_DROPPED and `error`. */
void rw_ipc_client_drop(rw_ipc_server_t *server, rw_ipc_client_t *client, int error);
/* 1 when one more connect/join/leave/refusal line may be logged now: at most a few a second,
 * the rest counted and reported (rw_log_budget_t); the service's own join and leave lines ask
 * too, so a process that opens and abandons groups in a loop cannot fill the disk. */
int rw_ipc_log_churn(rw_ipc_server_t *server);
/* Tell a client why one of its submissions failed, before its error completion: a non-fatal
 * ERROR message with seq 0 (a notice) that the client keeps as rw_client_last_message(). */
void rw_ipc_client_notice(rw_ipc_server_t *server, rw_ipc_client_t *client, int code,
			  const char *msg);

const rw_ipc_client_info_t *rw_ipc_client_info(const rw_ipc_client_t *client);

/* Keep the client's CUDA buffers mapped in the daemon past its leave (copies the daemon queued
 * on a GPU may still read or write them: docs/rankpath.md "A hung GPU") until every keep taken
 * is dropped; the client itself goes as always (client_left, its socket, its host buffers).
 * Each keep is dropped once with rw_ipc_keep_drop; a server destroyed while a keep is still
 * taken closes no CUDA mapping (the copies it was taken for may still run: the process's exit
 * unmaps them, rw_cuda_ipc_cache_leave), else it closes every one. NULL: out of memory. */
typedef struct rw_ipc_keep rw_ipc_keep_t;
rw_ipc_keep_t *rw_ipc_client_keep(rw_ipc_client_t *client);
void rw_ipc_keep_drop(rw_ipc_server_t *server, rw_ipc_keep_t *keep);

/* A rank-path phase starts running (busy 1) or stops (0): while any runs, the server's word
 * poller spins instead of sleeping between scans (rw_ipc_poller_busy; counted, so each 1 is
 * matched by one 0). No-op on a server without page rails. */
void rw_ipc_server_pages_busy(rw_ipc_server_t *server, int busy);

/* The client's rank page (ipc/page.h layout: an rw_page_head_t at its start), mapped in the
 * daemon; NULL until the rank set it up. *bytes_p: its size. Valid until client_left returns
 * (the server unmaps it once its poller stopped reading it). */
void *rw_ipc_client_page(const rw_ipc_client_t *client, size_t *bytes_p);
/* The geometry the daemon made that page for (NULL: none): what the service sizes its reads of
 * the page by, never the page's own head, which the rank can rewrite. */
struct rw_page_geom;
const struct rw_page_geom *rw_ipc_client_page_geom(const rw_ipc_client_t *client);
void rw_ipc_client_set_data(rw_ipc_client_t *client, void *data); /* service's per-client data */
void *rw_ipc_client_data(const rw_ipc_client_t *client);

/* Counters (the stats socket and the tests read them). */
typedef struct rw_ipc_server_stats {
	uint32_t clients;        /* connections open (joined or not) */
	uint32_t groups;         /* groups with at least one joined member */
	uint32_t buffers;        /* buffers registered, all clients */
	uint32_t rings;          /* clients with rings set up */
	uint64_t accepted;       /* connections ever accepted */
	uint64_t submissions;    /* submissions handed to the service */
	uint64_t rejected;       /* submissions completed with an error by the server */
	uint64_t completions;    /* completions published */
	uint64_t errors_sent;    /* control-message error replies */
	uint64_t dropped;        /* clients dropped for a protocol violation or by the service */
	uint64_t wakeups;        /* eventfd writes to clients */
	uint64_t refused_key;    /* hellos refused for their group key (RW_E_GROUP_KEY) */
	uint64_t refused_uid;    /* connections refused at the per-uid cap */
	uint64_t groups_claimed; /* groups opened without a key that a keyed rank took over */
	uint64_t hello_timeouts; /* connections closed for not joining in hello_timeout_ms */
	uint32_t events;         /* interprocess events registered, all clients */
	uint64_t flags_written;  /* completion flags written by rw_ipc_signal_now (errors) */
} rw_ipc_server_stats_t;
void rw_ipc_server_stats(const rw_ipc_server_t *server, rw_ipc_server_stats_t *stats_p);

/* Walk the open connections (joined or not, not those being torn down): NULL gives the first,
 * then the one after `prev`; NULL at the end. Only on the loop's thread, not across callbacks. */
const rw_ipc_client_t *rw_ipc_server_next_client(const rw_ipc_server_t *server,
						 const rw_ipc_client_t *prev);
/* 1 once the client's hello was accepted (its info's group and rank are set). */
int rw_ipc_client_joined(const rw_ipc_client_t *client);
/* 1 once the client is being dropped: its client_left is still to come (from the loop's next
 * prepare phase), but it holds its seat for nothing (a rank that joins in its place may take
 * it now). */
int rw_ipc_client_leaving(const rw_ipc_client_t *client);

/* ---------------------------------------------------------------------------------------------
 * The word poller (ipc/poller.c; docs/rankpath.md "The poller"): one thread that watches 64-bit
 * words in memory shared with ranks (their rank pages: written by a rank's stream or CPU) and
 * tells the loop when one moved. It reads the words and nothing else; the loop decides what a
 * value means (it trusts none). Adaptive, after the last move it saw: it spins for spin_us,
 * then gives the CPU away between looks (sched_yield) for yield_us more, then sleeps in steps
 * doubling from sleep_min_us up to a bound: busy_sleep_max_us while the loop says a phase is in
 * flight, sleep_max_us otherwise. A stream can only write memory (nothing can wake the thread),
 * so that bound is what a backed-off poller adds to a hand-off at worst (plus the kernel's
 * scheduling delay; the thread's timer slack is 1 µs). A CPU that writes a word with
 * rw_page_word_publish (a host rank) ends the sleep at once: the thread sleeps on the watched
 * words' futexes too (futex_waitv, at most 127 words; beyond, or before Linux 5.16, on the kick
 * alone), and once every watched word's writer has woken it, it sleeps right after a move
 * instead of spinning, where the host has fewer than RW_IPC_POLLER_WAKER_SPIN_CPUS online CPUs.
 * The loop can: rw_ipc_poller_kick() ends
 * a sleep and restarts the spin window (the loop did its part; a rank's word is likely next).
 * busy_sleep_max_us 0: spin the whole time a phase is in flight. With nothing watched it waits
 * for a watch and costs nothing.
 *
 * With loop_waits, the loop waits on the words itself as well (docs/rankpath.md "The poller"):
 * a publishing writer's wake ends the loop's own block, and the thread keeps the words no one
 * wakes for (a stream's). A kick does nothing while every watched word wakes a sleeper and the
 * thread would not spin (fewer than RW_IPC_POLLER_WAKER_SPIN_CPUS CPUs).
 *
 * Every call below is made from the loop's thread; the callback runs on it too (from the loop's
 * watchers: its ev_async, and with loop_waits an ev_io and an ev_prepare), never inside a call
 * of this API. A value is never handed on twice in a row (the loop's own look and the thread's
 * notice may both see a move).
 * ------------------------------------------------------------------------------------------- */

/* The daemon's defaults (docs/service.md "Top-level fields", poller_*; measured: docs/perf/shm.md
 * "The word poller's back-off"). */
#define RW_IPC_POLLER_SPIN_US 50
#define RW_IPC_POLLER_YIELD_US 0
#define RW_IPC_POLLER_SLEEP_MIN_US 20
#define RW_IPC_POLLER_SLEEP_MAX_US 1000
#define RW_IPC_POLLER_BUSY_SLEEP_MAX_US 100
/* Words whose writer wakes the thread (rw_page_word_publish: host ranks; learnt at its first
 * wake) skip the spin and yield windows, the thread sleeping until the wake for up to
 * sleep_max_us even while a phase is in flight, on a host with fewer online CPUs than this (the
 * ranks' spin rule, docs/ipc.md): there a spin takes the CPU the writer needs. */
#define RW_IPC_POLLER_WAKER_SPIN_CPUS 8
/* With loop_waits, while the loop's own wait covers every watched word and each has woken a
 * sleeper, the thread has nothing to look for but a watch or an unwatch, which wake it: its
 * sleeps are bounded by this (or sleep_max_us if longer), a safety net only. */
#define RW_IPC_POLLER_COVERED_SLEEP_US 100000

typedef struct rw_ipc_poller rw_ipc_poller_t;

typedef struct rw_ipc_poller_config {
	uint32_t max_watches;  /* table size, 1..65536 */
	uint32_t spin_us;      /* keep spinning this long after the last move (0: never spin) */
	uint32_t yield_us;     /* then look between sched_yield()s this long (0: no yield step) */
	uint32_t sleep_min_us; /* first sleep once backed off, >= 1 */
	uint32_t sleep_max_us; /* bound on a sleep with no phase in flight, >= min */
	uint32_t busy_sleep_max_us; /* bound on a sleep while a phase is in flight, >= min, <= max;
	                             * 0: no sleep while one is (spin) */
	uint32_t waker_spin_cpus;   /* words whose writers wake the thread keep the spin window
	                             * (and the busy bound) on a host with this many online CPUs
	                             * or more; 0: RW_IPC_POLLER_WAKER_SPIN_CPUS */
	uint32_t loop_waits;        /* 1: the loop waits on the words itself too (an io_uring
	                             * FUTEX_WAITV, Linux 6.7+; where the kernel or the host's
	                             * policy refuses it, as 0): a writer's wake reaches the loop
	                             * directly, and the thread then sleeps on its kick alone */
} rw_ipc_poller_config_t;

/* What the loop hears: the word `id` now reads `value` (every change is reported at least by
 * its latest value; intermediate values may be skipped), or, with retired set, the watch is gone
 * for good: the poller will not read the word again, so its memory may be unmapped now. */
typedef void (*rw_ipc_poller_cb)(void *ctx, uint32_t id, uint64_t value, int retired);

/* Starts the thread. RW_ERR_INVAL for a bad config, RW_ERR_NOMEM, RW_ERR_SYS (thread). */
rw_status_t rw_ipc_poller_create(struct ev_loop *loop, const rw_ipc_poller_config_t *cfg,
				 rw_ipc_poller_cb cb, void *ctx, rw_ipc_poller_t **poller_p);
/* Stops and joins the thread, then frees; no callback after it returns (watches left are
 * dropped without a retired report). */
void rw_ipc_poller_destroy(rw_ipc_poller_t *poller);

/* Watch the 8-byte aligned word (it must stay mapped until the retired report). Its current
 * value is the baseline: only later changes are reported. RW_ERR_AGAIN when the table is full
 * (every slot live or not yet retired); RW_ERR_INVAL for NULL or an unaligned word. */
rw_status_t rw_ipc_poller_watch(rw_ipc_poller_t *poller, const void *word, uint32_t *id_p);
/* Stop watching: a retired report follows (changes seen before it may still be reported). */
void rw_ipc_poller_unwatch(rw_ipc_poller_t *poller, uint32_t id);
/* Look closely again: the thread's spin window restarts as after a move, and a sleep ends now
 * (a futex wake, made only while it sleeps). For the loop's own progress in a phase (it wrote
 * a word, or sent what a peer answers) after which a rank's word moves soon. */
void rw_ipc_poller_kick(rw_ipc_poller_t *poller);
/* Phases are in flight (busy 1): sleeps are bounded by busy_sleep_max_us; none (0): by
 * sleep_max_us. Counted, so nested phases each call it with 1 and later 0. */
void rw_ipc_poller_busy(rw_ipc_poller_t *poller, int busy);

typedef struct rw_ipc_poller_stats {
	uint64_t scans;       /* passes over the table */
	uint64_t sleeps;      /* times the thread slept */
	uint64_t yields;      /* sched_yield() calls between looks */
	uint64_t kicks;       /* kicks that ended a sleep (a futex wake) */
	uint64_t moves;       /* word changes reported */
	uint64_t wakeups;     /* ev_async sends to the loop */
	uint64_t parks;       /* times the thread waited, nothing watched, for a watch */
	uint64_t word_wakes;  /* sleeps a watched word's writer ended (rw_page_word_publish) */
	uint64_t loop_wakes;  /* the loop's own waits a word's writer ended (loop_waits) */
	uint32_t loop_waits;  /* 1 while the loop's wait covers every watched word */
	uint64_t cpu_ns;      /* the thread's CPU time so far (CLOCK_THREAD_CPUTIME_ID) */
} rw_ipc_poller_stats_t;
void rw_ipc_poller_stats(const rw_ipc_poller_t *poller, rw_ipc_poller_stats_t *stats_p);

#endif /* RW_IPC_H */
