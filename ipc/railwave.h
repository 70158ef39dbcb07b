/* librailwave: the client library a trainer rank links to talk to its node's railwaved.
 * Control (hello, buffer registration, ring setup) goes over a Unix SOCK_SEQPACKET socket; the
 * per-phase path (submit dispatch/combine, reap completions) goes over two shared-memory rings and
 * makes no system call while both sides are busy. Full contract and examples: docs/ipc.md.
 *
 * This header is self-contained (libc types only) and is the library's only public face; the
 * daemon side of the same protocol is ipc/ipc.h. The entry layouts below are the ring ABI: both
 * sides compile them from this one definition.
 *
 * Threads: an rw_client_t is not locked. One thread may submit while another thread reaps
 * completions (the rings are single-producer/single-consumer each way); every other call
 * (registration, close) must not run concurrently with any call on the same client. */
#ifndef RW_RAILWAVE_H
#define RW_RAILWAVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Error codes. Every function returns 0 or one of these (negative). The codes from -20 down are
 * decided by the daemon and travel on the wire: their values are part of the protocol.
 * ------------------------------------------------------------------------------------------- */
typedef enum rw_client_error {
	RW_E_OK = 0,
	/* Decided by the library. */
	RW_E_INVAL = -1,        /* bad argument to a library call */
	RW_E_NOMEM = -2,        /* allocation failed */
	RW_E_SYS = -3,          /* a system call failed; errno tells which */
	RW_E_CONNECT = -4,      /* cannot connect to the daemon's socket */
	RW_E_CLOSED = -5,       /* the daemon closed the connection (this client was dropped) */
	RW_E_TIMEOUT = -6,      /* a bounded wait expired */
	RW_E_AGAIN = -7,        /* submission ring full: reap completions, then retry */
	RW_E_BADREPLY = -8,     /* the daemon's reply made no sense (wrong type, size or fds) */
	/* Decided by the daemon (wire values). Those marked [drop] end the connection. */
	RW_E_VERSION = -20,         /* [drop] protocol version mismatch */
	RW_E_MAGIC = -21,           /* [drop] message header magic wrong */
	RW_E_MSG_TYPE = -22,        /* [drop] unknown message type */
	RW_E_MSG_SIZE = -23,        /* [drop] message length wrong for its type */
	RW_E_TRUNC = -24,           /* [drop] message or its fds were truncated (MSG_TRUNC/CTRUNC) */
	RW_E_FDS = -25,             /* wrong number of file descriptors for the message */
	RW_E_STATE = -26,           /* [drop if before hello] message not valid in this state */
	RW_E_FIELD = -27,           /* a reserved field or flag is not zero, or an enum is unknown */
	RW_E_GROUP_NAME = -28,      /* [drop] group name empty, unterminated or not [A-Za-z0-9._:-] */
	RW_E_RANK_RANGE = -29,      /* [drop] world size 0 or too large, or rank >= world size */
	RW_E_RANK_DUP = -30,        /* [drop] this rank of this group is already connected */
	RW_E_WORLD_MISMATCH = -31,  /* [drop] world size differs from the group's earlier members */
	RW_E_NODE_MISMATCH = -32,   /* [drop] node differs from the group's earlier members / daemon */
	RW_E_GPU = -33,             /* [drop] local GPU index out of range or taken in this group */
	RW_E_BUF_SIZE = -34,        /* buffer size 0, too large, or not what fstat says */
	RW_E_BUF_FD = -35,          /* the fd is not a sealable memfd, or cannot be mapped */
	RW_E_BUF_SEAL = -36,        /* the memfd is not sealed against shrinking (F_SEAL_SHRINK) */
	RW_E_BUF_ID = -37,          /* unknown buffer id */
	RW_E_BUF_LIMIT = -38,       /* too many buffers registered by this client */
	RW_E_BUF_BUSY = -39,        /* deregister while submissions are in flight */
	RW_E_RING_SIZE = -40,       /* ring entries not a power of two or out of range */
	RW_E_RING_STATE = -41,      /* rings already set up (or submission before setup) */
	RW_E_RING_INDEX = -42,      /* [drop] shared ring indices corrupted by the client */
	RW_E_KIND = -43,            /* submission: unknown kind */
	RW_E_DTYPE = -44,           /* submission: unknown dtype */
	RW_E_TOKENS = -45,          /* submission: token count, topk or hidden zero or too large */
	RW_E_RANGE = -46,           /* submission: data outside its registered buffer */
	RW_E_OVERFLOW = -47,        /* a span past its buffer; rows past a rank path's recv_cap */
	RW_E_HANDLE = -48,          /* combine: unknown handle id */
	RW_E_NO_CUDA = -49,         /* the daemon has no usable CUDA driver */
	RW_E_CUDA = -50,            /* CUDA failed in the daemon: importing an IPC handle, or a copy
	                               or kernel on a rank's GPU mid-phase (the message says which) */
	RW_E_LIMIT = -51,           /* daemon limit reached (clients, connections of one uid) */
	RW_E_INTERNAL = -52,        /* the daemon failed on its side (memory, fds); not your fault */
	RW_E_PHASE = -53,           /* the service failed the phase (peer loss, cancelled, ...) */
	RW_E_EXPERTS = -54,         /* n_experts 0, not a multiple of the world size, above the
	                               daemon's limit, or not the phase's (ranks/nodes disagree) */
	RW_E_GROUP_KEY = -55,       /* [drop] group key ($RAILWAVE_GROUP_KEY) missing, wrong, too
	                               short, or required by the daemon and not given */
	RW_E_EVENT = -56,           /* unknown event id, or an event registration that cannot be
	                               used (not an interprocess event, flag span not a 4-byte
	                               aligned word of this rank's CUDA buffer) */
} rw_client_error_t;

/* Static description of an error code; never NULL. */
const char *rw_client_strerror(int err);

/* ---------------------------------------------------------------------------------------------
 * Ring entries (ABI: fixed sizes, little-endian host, checked by _Static_assert below)
 * ------------------------------------------------------------------------------------------- */

/* Version of the protocol (control messages and these entries), carried in every control
 * message header; the daemon refuses any other (RW_E_VERSION). 2: rw_sqe_t.n_experts, empty
 * dispatches and combines; later rw_sqe_t.path, carved from a field that had to be 0, so the
 * version stayed (a daemon without it refuses a nonzero path with RW_E_FIELD). */
#define RW_PROTOCOL_VERSION 2

#define RW_BUF_NONE 0xffffffffu /* "no buffer" in a span */

enum rw_kind { RW_KIND_DISPATCH = 1, RW_KIND_COMBINE = 2 };
enum rw_dtype { RW_DTYPE_BF16 = 1, RW_DTYPE_FP16 = 2, RW_DTYPE_FP8 = 3, RW_DTYPE_FP32 = 4 };

/* Where a piece of a phase's data lives: a registered buffer and a byte offset inside it. */
typedef struct rw_span {
	uint32_t buf_id; /* from rw_client_register_*(), or RW_BUF_NONE */
	uint32_t reserved; /* must be 0 */
	uint64_t offset;
} rw_span_t;

/* Submission: one dispatch or one combine of one MoE layer (docs/architecture.md §3).
 * Lengths are derived, not sent: tokens = token_count × hidden × sizeof(dtype),
 * topk_ids = token_count × topk × 4 (int32), topk_weights = token_count × topk × 4 (fp32);
 * the output span has an explicit capacity. Every byte of every span must lie inside its buffer.
 * Dispatch needs tokens, topk_ids and topk_weights; combine needs tokens (the expert outputs),
 * the handle_id its dispatch completed with, and may omit topk spans (RW_BUF_NONE).
 * token_count may be 0: a dispatch that routes nothing, or the combine of a rank that received
 * nothing; a span whose length is then 0 may be RW_BUF_NONE (offset 0). A combine output span
 * may be RW_BUF_NONE with output_capacity 0 when the rank dispatched no token.
 * n_experts (protocol version 2): the group's number of experts E. Dispatch: required, a
 * multiple of the world size, the same for every rank of the phase (expert e lives on rank
 * e / (E / world)). Combine: 0 or the dispatch's E. */
typedef struct rw_sqe {
	uint8_t kind;          /* enum rw_kind */
	uint8_t dtype;         /* enum rw_dtype of the token rows */
	uint16_t topk;         /* experts per token, 1..daemon limit */
	uint32_t layer;        /* group-local MoE layer index */
	uint64_t phase_id;     /* caller's id of the phase; echoed in the completion */
	uint64_t step;         /* training step */
	uint64_t user_data;    /* opaque, echoed in the completion */
	uint32_t token_count;  /* rows in `tokens`, 0..daemon limit */
	uint32_t hidden;       /* elements per row, 1..daemon limit */
	uint32_t handle_id;    /* combine: the dispatch completion's handle_id; dispatch: 0 */
	uint32_t flags;        /* RW_SQE_WAIT_EVENT | RW_SQE_SIGNAL (stream order, below), or
	                          RW_SQE_ABORT alone (a combine that fails its pair, below), else 0 */
	rw_span_t tokens;      /* token rows (dispatch: inputs; combine: expert outputs) */
	rw_span_t topk_ids;    /* int32 [token_count][topk] */
	rw_span_t topk_weights; /* fp32 [token_count][topk] */
	rw_span_t output;      /* where received rows (dispatch) / reduced rows (combine) go;
	                          with RW_SQE_SIGNAL its `reserved` word is the flag value V */
	uint64_t output_capacity; /* bytes available at output.offset */
	uint32_t n_experts;    /* experts E of the group (see above); was reserved in version 1 */
	uint16_t event_id;     /* with RW_SQE_WAIT_EVENT or RW_SQE_SIGNAL: the event id from
	                          rw_client_register_event(); else 0 (was `reserved`) */
	uint16_t path;         /* enum rw_path_request: 0 = the daemon's choice (see below) */
} rw_sqe_t;

/* rw_sqe_t.path: the data path a dispatch asks for (docs/ipc.md "Path requests", docs/algorithms.md
 * §4). 0 leaves it to the daemon (its configured `path`, else the selector); any other value makes
 * the phase run that path, as `railwave calibrate` does to time every path without restarting a
 * daemon. Every rank of the phase (all nodes) must ask for the same value, or the phase fails on
 * every node with RW_E_PHASE and a message naming the ranks that disagree. A value above
 * RW_PATH_REQ_JOINT is refused at submission (RW_E_FIELD). A combine runs its dispatch's path: its
 * `path` must be 0 or that path. The field was reserved (0) before, so older clients ask for
 * nothing; an older daemon refuses a nonzero path with RW_E_FIELD. */
enum rw_path_request {
	RW_PATH_REQ_DAEMON = 0,    /* the daemon decides */
	RW_PATH_REQ_NATIVE = 1,    /* every record on its owner GPU's rail, all destinations at once */
	RW_PATH_REQ_RAIL_ONLY = 2, /* RailBalance over all rails, all destinations at once */
	RW_PATH_REQ_PERM_ONLY = 3, /* native rails, N-1 permutation waves */
	RW_PATH_REQ_JOINT = 4,     /* RailBalance inside each permutation wave */
};

/* ---- Stream-ordered submission and completion (docs/ipc.md "Stream order") ----------------
 * So a trainer can enqueue dispatch -> experts -> combine on its CUDA stream without a host
 * synchronization. Both bits were reserved (must be 0) before, so the protocol version stayed 2:
 * an older daemon refuses them with RW_E_FIELD.
 *
 * Registration: rw_client_register_event() gives the daemon an interprocess CUDA event (created
 * with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING; its 64 cuIpcGetEventHandle bytes) and
 * the rank's completion flag: a 4-byte aligned 32-bit word inside one of the rank's registered
 * CUDA buffers. The flag's GPU is the event's (and must hold the outputs of every submission
 * that signals it). The id (1..65535) names both in rw_sqe_t.event_id.
 *
 * RW_SQE_WAIT_EVENT: the daemon reads none of the submission's inputs before the event's most
 * recent record *as of when the daemon received the submission* has completed. So the rank
 * records the event on its stream after the work producing the inputs and BEFORE submitting,
 * and must not record it again until this submission has completed (its CQE is reaped):
 * the daemon's wait is enqueued some time after the submission is read, and a later record
 * made before that moment is the one waited for. If that later record follows, on the rank's
 * stream, a wait for this very submission's flag, the daemon waits for work that waits for the
 * daemon: a deadlock. (The client library does not check this; Python's stream-ordered mode
 * records once per submission and waits for the CQE before recording again.)
 *
 * RW_SQE_SIGNAL: once the submission's outputs are written (on the GPU stream that wrote them,
 * after them), the daemon writes V = output.reserved into the flag (cuStreamWriteValue32). The
 * rank chooses V; a stream waits with cuStreamWaitValue32(flag, V, GEQ), a cyclic comparison
 * ((int32_t)(*flag - V) >= 0), so V may wrap: use increasing values (e.g. a counter) per flag.
 * The flag is written for EVERY completion of a signalling submission, errors included (then
 * after the daemon stopped touching the rank's memory for it), so a stream never hangs on a
 * refused or failed phase; the outputs are then not valid. The CQE is still posted after the
 * flag and is the only place the status is: check it (rw_client_poll/wait) before trusting the
 * outputs, e.g. at the next layer's submission. Every span of a stream-ordered submission must
 * be CUDA memory (RW_E_FIELD otherwise), and the output's GPU must be the flag's.
 *
 * If the daemon dies or drops the connection, nothing on its side writes the flags any more:
 * rw_client_poll/wait return RW_E_CLOSED, and rw_client_lost_signals() hands the rank every
 * flag value still owed (one per signalling submission not completed), which the rank must
 * write itself (e.g. cuMemsetD32 / a copy on a stream that is not waiting on the flag) so its
 * stream does not wait forever; those submissions failed. The Python package does this. */
#define RW_SQE_WAIT_EVENT 0x1u
#define RW_SQE_SIGNAL 0x2u

/* ---- Failing a pair by its key (docs/ipc.md "Aborting a pair") ------------------------------
 * A rank that will not give the combine of its open dispatch (its own arguments were refused,
 * it received more rows than it can hold) submits that combine with flags = RW_SQE_ABORT alone:
 * kind RW_KIND_COMBINE, the dispatch's layer, step and handle_id, dtype/hidden/topk as for any
 * submission, token_count 0, every span RW_BUF_NONE, output_capacity 0, event_id 0 (anything
 * else: RW_E_FIELD). The daemon fails the pair of that key on every node if it is still open and
 * waits for this rank's combine: every other rank gets RW_E_PHASE from its combine of that pair
 * (a node still finishing the pair's dispatch finishes it first), and this rank's completion is
 * RW_E_PHASE too. When that pair has already ended (another rank failed it) nothing else is
 * touched: the completion is RW_E_STATE. Unlike leaving the group, an abort never reaches a pair
 * of another key, however late it comes. The bit was reserved, so an older daemon refuses it
 * with RW_E_FIELD. */
#define RW_SQE_ABORT 0x4u
#define RW_EVENT_HANDLE_BYTES 64

#define RW_CQE_INLINE_COUNTS 16

enum rw_cq_status { RW_CQ_OK = 0, RW_CQ_ERROR = 1 };

/* Completion: exactly one per accepted or rejected submission, in no promised order. */
typedef struct rw_cqe {
	uint8_t status;        /* enum rw_cq_status */
	uint8_t kind;          /* copied from the submission */
	uint8_t n_inline;      /* counts[] entries valid (0 when counts are in a buffer) */
	uint8_t reserved0;
	int32_t error;         /* RW_E_* when status is RW_CQ_ERROR, else 0 */
	uint64_t phase_id;     /* copied from the submission */
	uint64_t user_data;    /* copied from the submission */
	uint32_t recv_tokens;  /* dispatch: rows written to the output span */
	uint32_t handle_id;    /* dispatch: pass to the matching combine */
	uint32_t counts_buf;   /* per-expert received counts as uint32[n_experts] at */
	uint32_t n_experts;    /*   counts_buf/counts_offset, or RW_BUF_NONE and inline */
	uint64_t counts_offset;
	uint32_t counts[RW_CQE_INLINE_COUNTS]; /* inline per-expert counts (n_inline of them) */
	uint8_t reserved[16];
} rw_cqe_t;

#ifdef __cplusplus
static_assert(sizeof(rw_span_t) == 16, "rw_span_t is ABI");
static_assert(sizeof(rw_sqe_t) == 128, "rw_sqe_t is ABI");
static_assert(sizeof(rw_cqe_t) == 128, "rw_cqe_t is ABI");
static_assert(offsetof(rw_sqe_t, n_experts) == 120, "rw_sqe_t is ABI");
static_assert(offsetof(rw_sqe_t, path) == 126, "rw_sqe_t is ABI");
static_assert(offsetof(rw_sqe_t, event_id) == 124, "rw_sqe_t is ABI");
#else
_Static_assert(sizeof(rw_span_t) == 16, "rw_span_t is ABI");
_Static_assert(sizeof(rw_sqe_t) == 128, "rw_sqe_t is ABI");
_Static_assert(sizeof(rw_cqe_t) == 128, "rw_cqe_t is ABI");
_Static_assert(offsetof(rw_sqe_t, n_experts) == 120, "rw_sqe_t is ABI");
_Static_assert(offsetof(rw_sqe_t, path) == 126, "rw_sqe_t is ABI");
_Static_assert(offsetof(rw_sqe_t, event_id) == 124, "rw_sqe_t is ABI");
#endif

/* ---------------------------------------------------------------------------------------------
 * The client
 * ------------------------------------------------------------------------------------------- */

typedef struct rw_client rw_client_t;

#define RW_GROUP_NAME_MAX 64 /* including the NUL */
#define RW_DEFAULT_SOCKET "/run/railwave/railwaved.sock"

typedef struct rw_client_opts {
	const char *socket_path; /* NULL: $RAILWAVE_SOCKET, else RW_DEFAULT_SOCKET */
	const char *group;       /* expert-parallel group name, [A-Za-z0-9._:-], < 64 chars */
	uint32_t rank;           /* rank in the group, < world_size */
	uint32_t world_size;     /* ranks in the group (all nodes) */
	uint32_t node;           /* this node's index in the group */
	int32_t local_gpu;       /* local GPU index, or -1 for none */
	uint8_t gpu_uuid[16];    /* the GPU's UUID (all zero if unknown) */
	uint32_t sq_entries;     /* submission ring size, power of two; 0 = 256 */
	uint32_t cq_entries;     /* completion ring size, power of two; 0 = 2 × sq_entries */
	int timeout_ms;          /* control-reply timeout; 0 = 10000 */
} rw_client_opts_t;

/* Connect, say hello, and set up the rings. Blocks for the daemon's replies (timeout_ms each).
 * The hello carries the job's group key from $RAILWAVE_GROUP_KEY when it is set (16..64 bytes;
 * RW_E_INVAL if longer): the first rank of a group sets it, every other rank must present the
 * same (RW_E_GROUP_KEY otherwise; docs/ipc.md "Rank authentication"). On failure nothing is left open and the daemon's message (if any) is logged to stderr only
 * when $RAILWAVE_DEBUG is set; the return code says what went wrong. */
int rw_client_connect(const rw_client_opts_t *opts, rw_client_t **client_p);

/* Say goodbye and release everything (socket, rings, host buffer mappings). NULL is a no-op.
 * Submissions still in flight are abandoned: the daemon drops them. */
void rw_client_close(rw_client_t *client);

/* Message text of the last error the daemon sent this client ("" if none). */
const char *rw_client_last_message(const rw_client_t *client);

/* Read, without waiting, the notices the daemon queued on the control socket (why a phase
 * failed; a page rank's comes before the status line its stream reads), so that
 * rw_client_last_message() says them: several read by one call are joined, the first first
 * ("A; then: B": a static rank's failed dispatch, then its combine refused for it); nothing
 * while another thread reads the socket. */
void rw_client_take_notices(rw_client_t *client);

/* Daemon-assigned id of this connection (for logs). */
uint32_t rw_client_id(const rw_client_t *client);

/* Create a host buffer the daemon can read and write: a memfd of `size` bytes sealed against
 * resizing, mapped here, sent to the daemon (SCM_RIGHTS). *addr_p is its mapping, valid until
 * rw_client_deregister() or rw_client_close(). */
int rw_client_register_host(rw_client_t *client, size_t size, uint32_t *buf_id_p, void **addr_p);

/* Register device memory by its CUDA IPC handle. The library does not link CUDA: fill this from
 * cuIpcGetMemHandle / cuMemGetAddressRange / CU_POINTER_ATTRIBUTE_BUFFER_ID (cuda/rw_cuda.h's
 * rw_cuda_ipc_export() produces exactly these fields). RW_E_NO_CUDA if the daemon has no GPU.
 * Ordering: the daemon reads and writes the memory on its own streams, in its own process. Work
 * that writes a submission's inputs must have completed before rw_client_submit() (synchronize
 * the stream that wrote them; note that a cuMemcpyHtoD from pageable memory may return before
 * its DMA is done), and the outputs are complete when the completion is reaped. */
typedef struct rw_client_cuda_desc {
	uint8_t ipc_handle[64];  /* CUipcMemHandle bytes */
	uint64_t alloc_id;       /* CU_POINTER_ATTRIBUTE_BUFFER_ID of the allocation */
	uint64_t alloc_bytes;    /* size of the whole allocation */
	uint64_t offset;         /* registered range: offset inside the allocation ... */
	uint64_t bytes;          /* ... and its length */
	uint8_t device_uuid[16]; /* the allocation's device */
	int32_t device;          /* its ordinal in the caller's process (informational) */
} rw_client_cuda_desc_t;
int rw_client_register_cuda(rw_client_t *client, const rw_client_cuda_desc_t *desc,
			    uint32_t *buf_id_p);

/* Forget a buffer (host: also unmapped here). RW_E_BUF_BUSY while submissions are in flight. */
int rw_client_deregister(rw_client_t *client, uint32_t buf_id);

/* Stream order (see "Stream-ordered submission" above). Register an interprocess event by its
 * handle bytes (cuda/rw_cuda.h's rw_cuda_event_export() makes one) with the completion flag at
 * flag_offset in CUDA buffer flag_buf (registered by this client, 4-byte aligned, inside it).
 * RW_E_NO_CUDA: the daemon has no GPU; RW_E_EVENT: not an event, or a bad flag span;
 * RW_E_LIMIT: too many events on this connection. Deregistering is refused (RW_E_BUF_BUSY)
 * while submissions are in flight; closing the connection frees them all, and a buffer holding
 * a registered event's flag cannot be deregistered before the event (RW_E_BUF_BUSY). */
int rw_client_register_event(rw_client_t *client, const uint8_t handle[RW_EVENT_HANDLE_BYTES],
			     uint32_t flag_buf, uint64_t flag_offset, uint32_t *event_id_p);
int rw_client_deregister_event(rw_client_t *client, uint32_t event_id);

/* A flag value the daemon still owed when the connection was lost. */
typedef struct rw_client_lost_signal {
	uint32_t event_id;
	uint32_t value;       /* V of the submission */
	uint32_t flag_buf;    /* where the flag is: as registered */
	uint32_t reserved;
	uint64_t flag_offset;
	uint64_t phase_id;    /* the submission's */
	uint64_t user_data;
} rw_client_lost_signal_t;
/* Once rw_client_poll/wait answered RW_E_CLOSED: copy up to max owed flag writes (oldest first)
 * into out and forget them. Returns how many (0 when none, or while the connection is up). */
int rw_client_lost_signals(rw_client_t *client, rw_client_lost_signal_t *out, unsigned max);

/* The rank page (docs/rankpath.md "The rank page"): the memory this rank and the daemon share for
 * the GPU data path in the rank's stream — the words its stream writes and waits on, and the
 * per-phase blocks. Asks the daemon for it (sized for the cluster and for max_recv, the records
 * this rank may receive in one phase), maps it here and returns its address and size; its layout
 * is checked (magic, version, size) before it is handed over. The library links no CUDA: the
 * caller makes it reachable from its GPU (cuMemHostRegister with DEVICEMAP | PORTABLE, e.g.
 * cuda/rw_cuda.h's rw_cuda_host_register_mapped) and must unregister it before
 * rw_client_close(), which unmaps it. RW_E_STATE: set up already, or the daemon lends no page;
 * RW_E_TOKENS: max_recv 0 or above the daemon's bound; RW_E_BADREPLY: the daemon's page is not
 * one this library understands. */
int rw_client_rank_page(rw_client_t *client, uint32_t max_recv, void **page_p, size_t *bytes_p);

/* The group's slab of one rail (docs/rankpath.md "The slab areas, lent per group"): the part of
 * the daemon's memory that this rank's group alone uses on that rail — the records its pairs
 * send and receive there, at the offsets below — lent to the group's ranks and to no other
 * process. Mapped read-write here; the library links no CUDA: the caller makes it reachable from
 * its GPU (cuMemHostRegister with DEVICEMAP | PORTABLE) and unregisters it before
 * rw_client_close(), which unmaps it. The daemon lends a rail's slab once per connection: asked
 * again, the library gives the mapping it holds (one thread at a time). RW_E_INVAL: no such
 * rail; RW_E_STATE: the daemon lends none (group_area_mib 0), or a GPU slab (below); RW_E_LIMIT: the
 * daemon's pool was spent when the group formed, so it has no slabs of its own; RW_E_BADREPLY:
 * a reply this library does not understand. */
#define RW_CLIENT_SLAB_RAILS 64
typedef struct rw_client_slab {
	void *base;            /* the mapping, `bytes` long */
	size_t bytes;
	uint32_t rail, rails;  /* this slab's rail, the daemon's rails */
	uint64_t area_bytes;   /* each of the four record areas */
	uint64_t recv_off[2];  /* the receive areas' offsets: [0] dispatch, [1] combine records */
	uint64_t send_off[2];  /* the send areas' offsets, the same way */
	uint64_t local_off;    /* the local area's, up to the slab's end: records and rows that
	                          never leave the node (group_local_mib of it at least) */
	uint64_t object;       /* the lent object's identity (its inode): equal for one memory */
} rw_client_slab_t;
int rw_client_group_slab(rw_client_t *client, uint32_t rail, rw_client_slab_t *slab_p);

/* The same for a client that can import GPU memory (the rank path, rank/slabs.c). A host slab
 * comes mapped as rw_client_group_slab maps it (*gpu_p: kind RW_CLIENT_SLAB_HOST, fd -1). A GPU
 * slab (the daemon's carve-outs are GPU memory: docs/rankpath.md "The slab areas, lent per
 * group") is not mapped (slab_p->base NULL; bytes, areas and object as for a host slab) and
 * *gpu_p gives its fd — a CUDA allocation's POSIX fd shareable handle, to import with
 * cuMemImportFromShareableHandle; the client's until rw_client_close(), which closes it — and
 * its device's UUID (find the device in this process by it). rw_client_group_slab refuses a GPU
 * slab (RW_E_STATE, named), as a daemon refuses it to an older library. */
enum { RW_CLIENT_SLAB_HOST = 1, RW_CLIENT_SLAB_GPU = 2 };
typedef struct rw_client_slab_gpu {
	int32_t kind;          /* RW_CLIENT_SLAB_HOST or RW_CLIENT_SLAB_GPU */
	int32_t fd;            /* GPU: the allocation's fd; host: -1 */
	int32_t device;        /* GPU: the device's ordinal in the daemon (for messages); host: -1 */
	uint32_t reserved;
	uint8_t uuid[16];      /* GPU: the device's UUID */
} rw_client_slab_gpu_t;
int rw_client_group_slab_kind(rw_client_t *client, uint32_t rail, rw_client_slab_t *slab_p,
			      rw_client_slab_gpu_t *gpu_p);

/* ---- The rank path: CUDA work in the rank's own stream (docs/rankpath.md) -------------------
 * Instead of submitting on the ring and letting the daemon move the data, a CUDA rank enqueues a
 * phase on its own stream: librailwave loads the CUDA driver at run time (dlopen; a CPU-only
 * rank never needs it), launches the kernels in this process on the caller's stream and
 * hands off to the daemon through words of the rank page. Nothing here waits for the GPU or
 * makes a system call on a phase's path. Built so far (docs/rankpath.md "Status"): dispatch and
 * combine, eager mode and static mode (below: the phases started by the stream, capturable in a
 * CUDA graph).
 *
 * Threads: an rw_client_rank_t is not locked; one thread makes its calls. It keeps the
 * rw_client_t it was opened on, which must outlive it (close the rank path first). */
typedef struct rw_client_rank rw_client_rank_t;

/* A stream the library enqueues on and never owns: the CUstream as an integer (what
 * torch.cuda.Stream.cuda_stream gives; 0 is the legacy stream) on CUDA device `device` (an
 * ordinal of this process). */
typedef struct rw_client_stream {
	int32_t device;
	uint32_t reserved;     /* must be 0 */
	uint64_t handle;
} rw_client_stream_t;

/* Open the rank path on `device`: takes the client's rank page (rw_client_rank_page with
 * max_recv) and its group's slab of every rail (rw_client_group_slab), registers them with CUDA
 * (cuMemHostRegister DEVICEMAP | PORTABLE) so the stream's memory operations and kernels reach
 * them, and loads the kernels. RW_E_NO_CUDA: no usable driver, device, kernels or 64-bit stream
 * memory operations here (rw_client_rank_message(NULL) says which; nothing is left open: use
 * rw_client_submit); RW_E_INVAL: no such device; the errors of rw_client_rank_page and
 * rw_client_group_slab. A group the daemon lends no slabs opens without them
 * (rw_client_rank_slab says why) and its dispatches are refused. */
int rw_client_rank_open(rw_client_t *client, int32_t device, uint32_t max_recv,
			rw_client_rank_t **rank_p);

/* The rank path's options (rw_client_rank_open_opts). Zero the struct before filling it: a field
 * added later takes a reserved word, and 0 there means what the library did before. */
typedef struct rw_client_rank_opts {
	uint32_t max_recv;     /* as rw_client_rank_open's */
	int32_t max_sms;       /* the SM budget (docs/rankpath.md "SMs beside the trainer's
	                          compute"): every kernel the rank path enqueues takes at most this
	                          many blocks, so it runs on at most max_sms SMs at a time and leaves
	                          the others to the trainer's kernels; 0: the kernels' own choice
	                          (enough blocks to fill the GPU where the work is large) */
	uint32_t flags;        /* RW_RANK_OPEN_STATIC: static mode (rw_client_rank_open_static) */
	uint32_t reserved[5];  /* must be 0 */
} rw_client_rank_opts_t;
#define RW_RANK_OPEN_STATIC 1u

/* rw_client_rank_open (or, with RW_RANK_OPEN_STATIC, rw_client_rank_open_static) with options.
 * Their errors, and RW_E_INVAL (rw_client_rank_message(NULL) says which): opts NULL, an unknown
 * flag or a reserved word not 0; max_sms negative or above the device's SMs, or not 0 for
 * RW_RANK_HOST (a host rank runs on its CPU). */
int rw_client_rank_open_opts(rw_client_t *client, int32_t device, const rw_client_rank_opts_t *opts,
			     rw_client_rank_t **rank_p);

/* Change the SM budget (rw_client_rank_opts_t.max_sms; 0: the kernels' own choice) for the calls
 * enqueued from now on, eager or static (a CUDA graph keeps the budget it was captured with).
 * Phases already enqueued keep theirs. RW_E_INVAL as rw_client_rank_open_opts says, the budget
 * unchanged. */
int rw_client_rank_set_sms(rw_client_rank_t *rank, int32_t max_sms);

/* The device of a host rank's rank path: buffers in host memory, no CUDA. Every address is a
 * pointer of this process, the stream argument NULL (or device RW_RANK_HOST). Dispatch and
 * combine first finish the rank's earlier phases (a stream's order), then store submit and
 * return; rw_client_rank_wait does the stream's part on this CPU (pack, forward, gather,
 * reduce, with up to RAILWAVE_RANK_THREADS threads: default the online CPUs over the node's
 * local ranks), phase after phase in order (docs/rankpath.md "Host ranks"). The inputs are read
 * and the outputs written inside those calls, so they must stay valid until the wait. */
#define RW_RANK_HOST (-1)

/* Unregister the page from CUDA and free the rank path. Phases still on a stream must have
 * passed (their rw_client_rank_wait returned), or the stream may still write the page. Then
 * rw_client_close() unmaps the page. NULL is a no-op. */
void rw_client_rank_close(rw_client_rank_t *rank);

/* One dispatch of one MoE layer, eager mode. Addresses are device addresses of this process
 * reachable from the stream's device, read and written by the stream's work in stream order (so
 * the caller's earlier work on that stream may still be producing the inputs, and its later work
 * may consume the outputs). */
typedef struct rw_client_rank_dispatch {
	uint8_t dtype;         /* RW_DTYPE_BF16 or RW_DTYPE_FP32 (the kernels' row types) */
	uint8_t reserved0;     /* must be 0 */
	uint16_t topk;         /* experts per token, 1..32 */
	uint32_t layer;
	uint64_t step;
	uint32_t token_count;  /* 0..the daemon's max_tokens */
	uint32_t hidden;       /* elements per row, >= 1 */
	uint32_t n_experts;    /* E of the group: a multiple of the nodes (and of the world size,
	                          which the daemon checks) */
	uint16_t path;         /* enum rw_path_request, as rw_sqe_t.path */
	uint16_t reserved1;    /* must be 0 */
	uint64_t tokens;       /* rows [token_count][hidden] of dtype */
	uint64_t topk_ids;     /* int32 [token_count][topk]; -1 = a dropped slot */
	uint64_t topk_weights; /* fp32 [token_count][topk] */
	/* Outputs, written by the stream after the daemon's arrived (docs/dataflow.md "Dispatch
	 * output"): row j and metadata j of each record this rank received, in the daemon's order,
	 * at most recv_cap of them, and recv_counts[e] = how many received rows name expert e, for
	 * this rank's experts (0 for every other). 16-byte aligned. */
	uint64_t recv_x;       /* rows [recv_cap][hidden] of dtype */
	uint64_t recv_meta;    /* [recv_cap] entries of 16 + 8 x topk bytes */
	uint64_t recv_counts;  /* uint32 [n_experts] */
	uint32_t recv_cap;
	uint32_t reserved2;    /* must be 0 */
} rw_client_rank_dispatch_t;

/* Enqueue dispatch phase *phase_p on the stream and return without waiting: the library takes
 * the next phase number k (1, 2, ...: dispatches and combines of this rank share one sequence,
 * the same on every rank of the group), checks that page slot k mod 4 is free, writes the
 * phase's parameters there, then enqueues: the count kernel (top-k ids -> the slot's count row),
 * submit = k, a wait for the daemon's plan, the pack kernel (this rank's records into the
 * group's slabs where the plan puts them), packed = k, a wait for arrived, the forward kernel
 * (the records the daemon listed -> the outputs), done = k.
 * RW_E_AGAIN: 4 phases of this rank are in flight (the oldest's done is not written yet): wait
 * for one. RW_E_DTYPE, RW_E_TOKENS (topk, hidden, token_count out of range), RW_E_EXPERTS,
 * RW_E_INVAL (bad or unaligned addresses, reserved fields, another device's stream): nothing
 * enqueued; RW_E_STATE or RW_E_LIMIT: the rank path holds no group slabs (the daemon's answer
 * at open). RW_E_CLOSED: the daemon is gone. RW_E_CUDA: the driver refused an enqueue (the
 * message says which); when that happens after submit was enqueued the rank path is broken and
 * every later call answers RW_E_CUDA. */
int rw_client_rank_dispatch(rw_client_rank_t *rank, const rw_client_stream_t *stream,
			    const rw_client_rank_dispatch_t *d, uint64_t *phase_p);

/* The combine of one dispatch, eager mode: this rank gives back one row per row it received
 * (its expert outputs, already reduced over its own experts), and gets each of its dispatched
 * tokens' combined row: the fp32 sum of every row given back for it, rounded once (docs/dataflow.md
 * "Combine"). Addresses as for the dispatch; dtype and hidden are the dispatch's. */
typedef struct rw_client_rank_combine {
	uint64_t dispatch;     /* the phase number of the dispatch this answers */
	uint64_t rows;         /* [recv_tokens of that dispatch][hidden]: row j for received row j */
	uint64_t out;          /* [token_count of that dispatch][hidden]: the combined rows */
} rw_client_rank_combine_t;

/* Enqueue the combine of dispatch c->dispatch as phase *phase_p (the next number) and return
 * without waiting: a copy of the rows into this rank's staging area in the group's slab (where
 * the dispatch's plan said), submit = k, a wait for plan, the gather kernel (the combine records
 * of the records this rank received, several local ranks' rows summed), packed = k, a wait for
 * arrived, the reduce kernel (each token's rows from the daemon's list into out), done = k.
 * RW_E_STATE: that dispatch did not complete with 0 (rw_client_rank_wait), was combined already,
 * or is too old (its slot was reused: combine within 3 phases of it); the other errors as for
 * rw_client_rank_dispatch. */
int rw_client_rank_combine(rw_client_rank_t *rank, const rw_client_stream_t *stream,
			   const rw_client_rank_combine_t *c, uint64_t *phase_p);

/* How a completed phase ended besides its code. */
typedef struct rw_client_rank_done {
	uint32_t recv_tokens;  /* dispatch: rows written to recv_x (at most recv_cap) */
	uint32_t overflow;     /* dispatch: records the daemon listed past recv_cap (dropped) */
} rw_client_rank_done_t;

/* Eager completion of phase k: whether the stream wrote done = k, and how the phase ended. Reads
 * the page only: no system call while timeout_ms is 0 (check once); otherwise it polls, yielding
 * the CPU, until done or timeout_ms passes (-1: forever). Returns 0 (the phase completed; *done_p,
 * if given, filled), RW_E_TIMEOUT (not done yet), or the error that failed it: RW_E_TOKENS (a
 * top-k id outside [0, n_experts) other than -1: the message names the token; that token counted
 * nothing), the daemon's status for the phase (e.g. RW_E_PHASE), RW_E_CLOSED (the daemon went
 * away: the library wrote the words the stream waited on, so it ran through), RW_E_OVERFLOW
 * (more records came than recv_cap: *done_p says how many were dropped), RW_E_BADREPLY (the
 * daemon's plan or list did not fit this rank's records: the message names the kernel's
 * report). A phase answers the same each time it is asked. RW_E_INVAL: k was never dispatched,
 * or is older than the last 8 phases dispatched. */
int rw_client_rank_wait(rw_client_rank_t *rank, uint64_t phase, int timeout_ms,
			rw_client_rank_done_t *done_p);

/* ---- Static mode: phases started by the stream, a MoE layer in a CUDA graph
 * (docs/rankpath.md "Static mode and CUDA graphs") ------------------------------------------
 * In static mode nothing a phase needs is known to this CPU at the call: the stream takes the
 * phase number (a counter in device memory the rank path owns), writes the phase's parameters
 * into the page's slot and its words with kernels, and waits for the daemon's words with a
 * kernel that reads the number from memory. So the calls can be captured in a CUDA graph
 * (cuStreamBeginCapture ... cuStreamEndCapture) and every replay is new phases: each dispatch's
 * step is the call's step plus a device counter of its layer (every replay a new pair key for
 * the daemon); its combine takes the dispatch's layer and step. The outputs stay in the caller's
 * device buffers (recv_x, recv_meta, recv_counts sized for recv_cap rows; the received row count
 * in a u32 of the caller's), rows past recv_cap are dropped and counted, and what failed is
 * reported by rw_client_rank_check, never by a host wait. Rules: every static call of a rank
 * path goes to one stream (or streams ordered one after another), since the stream's order is
 * the phases' order; a graph holding a dispatch holds its combine. */

/* Open the rank path in static mode: rw_client_rank_open, then the control block and the
 * shadow slots (device memory) and the report (page-locked host memory). Its calls are the
 * _static ones and rw_client_rank_check; rw_client_rank_dispatch, _combine and _wait answer
 * RW_E_STATE. The errors of rw_client_rank_open; RW_E_CUDA: no memory for the above. */
int rw_client_rank_open_static(rw_client_t *client, int32_t device, uint32_t max_recv,
			       rw_client_rank_t **rank_p);

/* Enqueue one dispatch in static mode (capturable): BEGIN, the count kernel, the stream's submit
 * (k = its counter + 1), a wait kernel for plan >= k, pack, packed, a wait for arrived, forward,
 * done; then the received row count into the u32 at device address `recv_n` (0: none). *call_p:
 * the call's number (1, 2, ...), which its combine names. d->step is the base the stream adds
 * the layer's counter to. The argument errors of rw_client_rank_dispatch, at the call; RW_E_CUDA
 * as there. Nothing waits. */
int rw_client_rank_dispatch_static(rw_client_rank_t *rank, const rw_client_stream_t *stream,
				   const rw_client_rank_dispatch_t *d, uint64_t recv_n,
				   uint64_t *call_p);

/* Enqueue the combine of static dispatch call c->dispatch (capturable): the rows (one per row
 * that dispatch received, as its row count says when the stream gets there) copied into this
 * rank's staging area, submit, a wait for plan, gather, packed, a wait for arrived, reduce into
 * c->out (that dispatch's token_count rows), done. RW_E_STATE: c->dispatch is not a static
 * dispatch of this rank path among its last 15 calls, or was combined already. */
int rw_client_rank_combine_static(rw_client_rank_t *rank, const rw_client_stream_t *stream,
				  const rw_client_rank_combine_t *c, uint64_t *call_p);

/* Failing a pair from the rank path: the rank gives no combine for dispatch `dispatch` (eager
 * mode: its phase number, a dispatch that completed with 0 and was not combined; static mode: its
 * call number) because its own call was refused on this host (`reason`: RW_RANK_ABORT_*). It
 * takes that combine's place in the stream: phase *phase_p (eager: the next number; static:
 * *phase_p is the call's number, the stream takes the phase number), a combine of the
 * dispatch's key marked abort in its page slot, submit, the waits and words, no kernel. The
 * daemon fails the pair on every node while it waits for this rank's combine, naming the rank
 * and the reason ("local rank R: aborted its combine of layer L step S: ..."): every other
 * rank's combine of it fails (RW_E_PHASE) at once, and this phase answers RW_E_PHASE too
 * (rw_client_rank_wait, or rw_client_rank_check in static mode); an abort of a pair that has
 * ended fails nothing and answers that pair's failure or RW_E_STATE. The rank's phase numbers
 * and (static mode) its stream's counters stay in step with the others', so its next call
 * meets theirs. Capturable in static mode (a graph replays the abort each time). The errors of
 * rw_client_rank_combine (or _combine_static) for the dispatch; RW_E_INVAL: an unknown reason. */
#define RW_RANK_ABORT_ARGUMENT 1 /* the combine's arguments were refused (rows, dtype, shape,
                                    device, handle) */
#define RW_RANK_ABORT_ROUTING 2  /* a backward's routing is not its forward's */
int rw_client_rank_abort(rw_client_rank_t *rank, const rw_client_stream_t *stream,
			 uint64_t dispatch, uint32_t reason, uint64_t *phase_p);

/* What the stream reported since the last check (call it once the stream's work is done, e.g.
 * after cuStreamSynchronize or an event; the report is cleared by the call). */
typedef struct rw_client_rank_check {
	uint64_t done;         /* the last phase number the stream finished */
	uint64_t phase;        /* the first phase that failed, or 0 */
	uint64_t over_phase;   /* the first dispatch with rows past its recv_cap, or 0 */
	uint32_t overflow;     /* rows dropped over all such dispatches */
	uint32_t need;         /* the most rows one of them received (written + dropped): the
	                          recv_cap that would have held them */
} rw_client_rank_check_t;

/* 0: every phase the stream finished since the last check passed. Else the first failure, as
 * rw_client_rank_wait names it (RW_E_TOKENS, the daemon's status such as RW_E_PHASE,
 * RW_E_CLOSED, RW_E_BADREPLY), then RW_E_OVERFLOW (rows past recv_cap: the message says how many
 * rows were needed). RW_E_CLOSED also when the daemon is gone and nothing failed yet;
 * RW_E_STATE: not a static rank path. *check_p (if given) is filled in every case. */
int rw_client_rank_check(rw_client_rank_t *rank, rw_client_rank_check_t *check_p);

/* The group's slab of `rail` as the rank path mapped it at open and registered it with CUDA
 * (DEVICEMAP | PORTABLE; docs/rankpath.md "The slab areas, lent per group"): *slab_p (the
 * client's mapping and the slab's areas, as rw_client_group_slab gives them) and *dptr_p (the
 * mapping's device address). The daemon's answer when it lends the group none: RW_E_STATE (no
 * carve-outs there) or RW_E_LIMIT (the pool was spent when the group formed); RW_E_INVAL: no
 * such rail. */
int rw_client_rank_slab(rw_client_rank_t *rank, uint32_t rail, rw_client_slab_t *slab_p,
			uint64_t *dptr_p);

/* Text of the last error of the rank path ("" if none). */
const char *rw_client_rank_message(const rw_client_rank_t *rank);

/* Queue n submissions and publish them with one index store (and at most one wake-up write if
 * the daemon sleeps). All or nothing: RW_E_AGAIN if fewer than n slots are free. The daemon
 * validates every entry; a bad one comes back as an RW_CQ_ERROR completion. */
int rw_client_submit(rw_client_t *client, const rw_sqe_t *entries, unsigned n);

/* Busy-poll: copy up to max completions into out, never blocks, no system call.
 * Returns how many (0..max) or a negative error (RW_E_CLOSED once the daemon is gone). */
int rw_client_poll(rw_client_t *client, rw_cqe_t *out, unsigned max);

/* Like rw_client_poll(), but when none is ready, watch the ring briefly (RAILWAVE_WAIT_SPIN_US,
 * adaptive; docs/ipc.md "Waiting for a completion"), then sleep on the completion eventfd until
 * one is or timeout_ms passes (-1: forever). Returns how many, 0 on timeout, or a negative error. */
int rw_client_wait(rw_client_t *client, rw_cqe_t *out, unsigned max, int timeout_ms);

/* Submissions accepted by the library and not yet completed. */
unsigned rw_client_inflight(const rw_client_t *client);

#ifdef __cplusplus
}
#endif

#endif /* RW_RAILWAVE_H */
