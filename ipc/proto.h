/* ipc/ private: the control protocol between librailwave and railwaved (Unix SOCK_SEQPACKET: one
 * datagram = one message, boundaries preserved). Fixed-size little structs with explicit sizes,
 * compiled into both sides from this header; the daemon's parser and entry checks (proto.c) are
 * pure functions so the fuzzer can drive them. Message table and rules: docs/ipc.md §Protocol. */
#ifndef RW_IPC_PROTO_H
#define RW_IPC_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "ipc/railwave.h"

#define RW_IPC_MAGIC 0x50495752u /* "RWIP" as little-endian bytes */
#define RW_IPC_VERSION RW_PROTOCOL_VERSION /* ipc/railwave.h */
#define RW_IPC_MAX_FDS 4 /* cmsg space the daemon offers; more arrive as MSG_CTRUNC */
#define RW_IPC_ERRMSG_MAX 112
#define RW_IPC_GROUP_KEY_MIN 16 /* bytes; shorter keys are refused (guessable) */
#define RW_IPC_GROUP_KEY_MAX 64 /* bytes: 32 random bytes in hex, as deploy/slurm makes them */

enum rw_ipc_type {
	RW_IPC_HELLO = 1,      /* c→d  rw_ipc_hello_t                     → HELLO_OK | ERROR */
	RW_IPC_HELLO_OK = 2,   /* d→c  rw_ipc_hello_ok_t */
	RW_IPC_REG_HOST = 3,   /* c→d  rw_ipc_reg_host_t + 1 fd (memfd)   → REG_OK | ERROR */
	RW_IPC_REG_CUDA = 4,   /* c→d  rw_ipc_reg_cuda_t                  → REG_OK | ERROR */
	RW_IPC_REG_OK = 5,     /* d→c  rw_ipc_reg_ok_t */
	RW_IPC_DEREG = 6,      /* c→d  rw_ipc_dereg_t                     → DEREG_OK | ERROR */
	RW_IPC_DEREG_OK = 7,   /* d→c  rw_ipc_dereg_t */
	RW_IPC_RING_SETUP = 8, /* c→d  rw_ipc_ring_setup_t                → RING_OK | ERROR */
	RW_IPC_RING_OK = 9,    /* d→c  rw_ipc_ring_ok_t + 3 fds: memfd, sq eventfd, cq eventfd */
	RW_IPC_GOODBYE = 10,   /* c→d  rw_ipc_hdr_t only; the daemon closes the connection */
	RW_IPC_ERROR = 11,     /* d→c  rw_ipc_error_t */
	RW_IPC_REG_EVENT = 12, /* c→d  rw_ipc_reg_event_t                 → REG_OK (buf_id: the event
	                        *      id, size 0) | ERROR */
	RW_IPC_DEREG_EVENT = 13, /* c→d rw_ipc_dereg_t (buf_id: event id) → DEREG_OK | ERROR */
	RW_IPC_PAGE_SETUP = 14, /* c→d rw_ipc_page_setup_t                → PAGE_OK | ERROR */
	RW_IPC_PAGE_OK = 15,    /* d→c rw_ipc_page_ok_t + 1 fd: the rank page's sealed memfd */
	RW_IPC_SLAB_SETUP = 16, /* c→d rw_ipc_slab_setup_t                → SLAB_OK | ERROR */
	RW_IPC_SLAB_OK = 17,    /* d→c rw_ipc_slab_ok_t + 1 fd: the group's slab of that rail */
};

typedef struct rw_ipc_hdr {
	uint32_t magic;   /* RW_IPC_MAGIC */
	uint16_t version; /* RW_IPC_VERSION */
	uint16_t type;    /* enum rw_ipc_type */
	uint32_t seq;     /* request number chosen by the client; replies echo it */
	uint32_t reserved;
} rw_ipc_hdr_t;

typedef struct rw_ipc_hello {
	rw_ipc_hdr_t hdr;
	char group[RW_GROUP_NAME_MAX]; /* NUL-terminated inside the 64 bytes */
	uint32_t rank;
	uint32_t world_size;
	uint32_t node;
	int32_t local_gpu; /* -1: none */
	uint8_t gpu_uuid[16];
	/* Group key (docs/ipc.md "Rank authentication"), added at the end: a hello of the first
	 * form (RW_IPC_HELLO_BASE_BYTES, no key) is still accepted and means key_len 0. */
	uint32_t key_len;  /* 0: no key; else RW_IPC_GROUP_KEY_MIN .. RW_IPC_GROUP_KEY_MAX */
	uint32_t key_reserved; /* 0 */
	uint8_t key[RW_IPC_GROUP_KEY_MAX]; /* $RAILWAVE_GROUP_KEY; bytes past key_len are 0 */
} rw_ipc_hello_t;
#define RW_IPC_HELLO_BASE_BYTES offsetof(rw_ipc_hello_t, key_len) /* hello without a key */

typedef struct rw_ipc_hello_ok {
	rw_ipc_hdr_t hdr;
	uint32_t client_id;
	uint32_t max_buffers;
	uint32_t max_tokens;
	uint32_t max_hidden;
	uint32_t max_topk;
	uint32_t max_ring_entries;
	uint64_t max_buffer_bytes;
} rw_ipc_hello_ok_t;

typedef struct rw_ipc_reg_host {
	rw_ipc_hdr_t hdr;
	uint64_t size;  /* must equal fstat(fd).st_size */
	uint32_t flags; /* must be 0 */
	uint32_t reserved;
} rw_ipc_reg_host_t;

typedef struct rw_ipc_reg_cuda {
	rw_ipc_hdr_t hdr;
	uint8_t ipc_handle[64];
	uint64_t alloc_id;
	uint64_t alloc_bytes;
	uint64_t offset;
	uint64_t bytes;
	uint8_t device_uuid[16];
	int32_t device;
	uint32_t reserved;
} rw_ipc_reg_cuda_t;

/* Stream order (railwave.h "Stream-ordered submission"): an interprocess event and its flag. */
typedef struct rw_ipc_reg_event {
	rw_ipc_hdr_t hdr;
	uint8_t handle[64];    /* cuIpcGetEventHandle bytes */
	uint32_t flag_buf;     /* a CUDA buffer of this client */
	uint32_t reserved;
	uint64_t flag_offset;  /* 4-byte aligned, + 4 inside the buffer */
} rw_ipc_reg_event_t;

typedef struct rw_ipc_reg_ok {
	rw_ipc_hdr_t hdr;
	uint32_t buf_id;
	uint32_t reserved;
	uint64_t size;
} rw_ipc_reg_ok_t;

typedef struct rw_ipc_dereg {
	rw_ipc_hdr_t hdr;
	uint32_t buf_id;
	uint32_t reserved;
} rw_ipc_dereg_t;

typedef struct rw_ipc_ring_setup {
	rw_ipc_hdr_t hdr;
	uint32_t sq_entries; /* powers of two in [2, max_ring_entries] */
	uint32_t cq_entries;
} rw_ipc_ring_setup_t;

typedef struct rw_ipc_ring_ok {
	rw_ipc_hdr_t hdr;
	uint32_t sq_entries;
	uint32_t cq_entries;
	uint64_t map_bytes; /* size of the ring memfd */
	uint64_t sq_ctl_off;
	uint64_t cq_ctl_off;
	uint64_t sq_slots_off;
	uint64_t cq_slots_off;
	uint32_t sqe_size;
	uint32_t cqe_size;
} rw_ipc_ring_ok_t;

/* The rank page (ipc/page.h; docs/rankpath.md "The rank page"): the daemon makes it, sized for
 * the cluster's nodes and rails and the rank's receive bound, and lends it as a sealed memfd. */
typedef struct rw_ipc_page_setup {
	rw_ipc_hdr_t hdr;
	uint32_t max_recv;  /* records this rank may receive in one phase, 1..the daemon's bound */
	uint32_t reserved;  /* 0 */
} rw_ipc_page_setup_t;

typedef struct rw_ipc_page_ok {
	rw_ipc_hdr_t hdr;
	uint64_t bytes;     /* the memfd's size: map all of it */
	uint32_t slot0;     /* offset of slot 0 */
	uint32_t slot_bytes;
	uint32_t nodes, rails;
} rw_ipc_page_ok_t;

/* The group's slab of one rail (docs/rankpath.md "The slab areas, lent per group"): the
 * carve-out of the daemon's memory that the rank's group alone uses on that rail, lent to a
 * joined rank of that group with one fd. The request names a rail only: the group is the rank's
 * own. Offsets are bytes from the start of the slab. Two forms: form 0 (the first; a client
 * that knows host slabs only) is answered with the reply's first RW_IPC_SLAB_OK_BASE_BYTES and a
 * sealed memfd, and a GPU slab is refused to it (RW_E_STATE, named); form
 * RW_IPC_SLAB_FORM_KINDS is answered with the whole reply, whose kind says what the fd is: a
 * sealed memfd (host memory) or a CUDA allocation's POSIX fd shareable handle (GPU memory of
 * the device named, to import with cuMemImportFromShareableHandle). */
#define RW_IPC_SLAB_FORM_KINDS 1
typedef struct rw_ipc_slab_setup {
	rw_ipc_hdr_t hdr;
	uint32_t rail;      /* 0 .. rails - 1 */
	uint32_t form;      /* 0 or RW_IPC_SLAB_FORM_KINDS (was reserved: 0) */
} rw_ipc_slab_setup_t;

typedef struct rw_ipc_slab_ok {
	rw_ipc_hdr_t hdr;
	uint64_t bytes;        /* the memory's size: map all of it */
	uint32_t rail, rails;  /* this slab's rail, and the daemon's rails */
	uint64_t area_bytes;   /* each of the four record areas below (the local area: the rest) */
	uint64_t recv_off[2];  /* receive area: [0] dispatch records, [1] combine records */
	uint64_t send_off[2];  /* send area: [0] dispatch records, [1] combine records */
	uint64_t local_off;    /* the local area: records and rows that never leave the node */
	/* Form RW_IPC_SLAB_FORM_KINDS only: */
	uint32_t kind;         /* RW_CLIENT_SLAB_HOST or RW_CLIENT_SLAB_GPU (railwave.h) */
	int32_t device;        /* GPU: the device's ordinal in the daemon; host: -1 */
	uint8_t uuid[16];      /* GPU: the device's UUID (ordinals differ between processes) */
} rw_ipc_slab_ok_t;
#define RW_IPC_SLAB_OK_BASE_BYTES offsetof(rw_ipc_slab_ok_t, kind) /* the form 0 reply */

typedef struct rw_ipc_error {
	rw_ipc_hdr_t hdr;
	int32_t code;    /* RW_E_* */
	uint32_t fatal;  /* 1: the daemon closes the connection after this message */
	char message[RW_IPC_ERRMSG_MAX]; /* NUL-terminated */
} rw_ipc_error_t;

_Static_assert(sizeof(rw_ipc_hdr_t) == 16, "wire size");
_Static_assert(sizeof(rw_ipc_hello_t) == 184, "wire size");
_Static_assert(RW_IPC_HELLO_BASE_BYTES == 112, "wire size of the hello without a key");
_Static_assert(sizeof(rw_ipc_hello_ok_t) == 48, "wire size");
_Static_assert(sizeof(rw_ipc_reg_host_t) == 32, "wire size");
_Static_assert(sizeof(rw_ipc_reg_cuda_t) == 136, "wire size");
_Static_assert(sizeof(rw_ipc_reg_ok_t) == 32, "wire size");
_Static_assert(sizeof(rw_ipc_reg_event_t) == 96, "wire size");
_Static_assert(sizeof(rw_ipc_dereg_t) == 24, "wire size");
_Static_assert(sizeof(rw_ipc_ring_setup_t) == 24, "wire size");
_Static_assert(sizeof(rw_ipc_ring_ok_t) == 72, "wire size");
_Static_assert(sizeof(rw_ipc_error_t) == 136, "wire size");
_Static_assert(sizeof(rw_ipc_page_setup_t) == 24, "wire size");
_Static_assert(sizeof(rw_ipc_page_ok_t) == 40, "wire size");
_Static_assert(sizeof(rw_ipc_slab_setup_t) == 24, "wire size");
_Static_assert(sizeof(rw_ipc_slab_ok_t) == 104, "wire size");
_Static_assert(RW_IPC_SLAB_OK_BASE_BYTES == 80, "wire size of the form 0 slab reply");

/* Any message; the receive buffer is exactly this big, so a longer datagram is MSG_TRUNC. */
typedef union rw_ipc_msg {
	rw_ipc_hdr_t hdr;
	rw_ipc_hello_t hello;
	rw_ipc_hello_ok_t hello_ok;
	rw_ipc_reg_host_t reg_host;
	rw_ipc_reg_cuda_t reg_cuda;
	rw_ipc_reg_ok_t reg_ok;
	rw_ipc_reg_event_t reg_event;
	rw_ipc_dereg_t dereg;
	rw_ipc_ring_setup_t ring_setup;
	rw_ipc_ring_ok_t ring_ok;
	rw_ipc_page_setup_t page_setup;
	rw_ipc_page_ok_t page_ok;
	rw_ipc_slab_setup_t slab_setup;
	rw_ipc_slab_ok_t slab_ok;
	rw_ipc_error_t error;
} rw_ipc_msg_t;

/* Shared ring memfd layout, chosen by the daemon and announced in RING_OK. */
#define RW_IPC_RING_CTL_BYTES 256

/* Daemon limits the parser and entry checks enforce. */
typedef struct rw_ipc_limits {
	uint32_t max_buffers;      /* per client */
	uint64_t max_buffer_bytes; /* per buffer */
	uint32_t max_tokens;       /* per submission */
	uint32_t max_hidden;
	uint32_t max_topk;
	uint32_t max_ring_entries;
	uint32_t max_world;
	int32_t max_local_gpu;     /* local_gpu must be -1 or < this */
	uint32_t max_experts;      /* n_experts of a submission */
	uint32_t max_events;       /* registered events per client (stream order) */
	uint32_t dtypes;           /* bit d: dtype d is carried (RW_E_DTYPE otherwise) */
} rw_ipc_limits_t;

/* ---- daemon side: pure checks (proto.c) ----
 * Each returns 0 or an RW_E_* code and then points *why_p at a static explanation. */

/* Frame a received datagram: msg_flags from recvmsg, nfds = descriptors it carried. Checks
 * truncation, size, magic, version, type (requests only), the fd count the type needs and that
 * reserved fields are zero. On success copies the message into *msg_p. */
int rw_ipc_parse_request(const void *buf, size_t len, int msg_flags, unsigned nfds,
			 rw_ipc_msg_t *msg_p, const char **why_p);

/* Stateless hello checks: group name, world size, rank < world, local GPU, key length and
 * padding (a key shorter than RW_IPC_GROUP_KEY_MIN is RW_E_GROUP_KEY). */
int rw_ipc_check_hello(const rw_ipc_hello_t *hello, const rw_ipc_limits_t *lim,
		       const char **why_p);

/* Ring sizes: powers of two in [2, max_ring_entries]. */
int rw_ipc_check_ring_setup(const rw_ipc_ring_setup_t *setup, const rw_ipc_limits_t *lim,
			    const char **why_p);

/* Size of a registered buffer, or 0 if buf_id is unknown. */
typedef uint64_t (*rw_ipc_buf_size_fn)(void *ctx, uint32_t buf_id);

/* A submission copied out of the ring: kind, dtype, counts against limits (token_count may be
 * 0; n_experts nonzero for a dispatch, at most max_experts), every span inside its buffer with
 * overflow-checked arithmetic (a span of length 0 may be RW_BUF_NONE). Whether n_experts fits
 * the group (a multiple of its world size, the phase's E) is the service's check. */
int rw_ipc_check_sqe(const rw_sqe_t *sqe, const rw_ipc_limits_t *lim, rw_ipc_buf_size_fn size_of,
		     void *ctx, const char **why_p);

/* Bytes per element of an rw_dtype, 0 if unknown. */
unsigned rw_ipc_dtype_size(unsigned dtype);

/* 1 for codes after which the daemon drops the connection. */
int rw_ipc_error_is_fatal(int code);

#endif /* RW_IPC_PROTO_H */
