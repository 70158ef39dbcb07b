/* railwaved's private wire formats (docs/dataflow.md): the peer control channel's framed
 * messages, the 32-bit immediate of every rail write, and the record layouts written into a
 * peer's receive region. Everything that crosses a node boundary is encoded here, explicitly
 * little-endian, and every decoder treats its input as untrusted (bounds, magic, version, ranges).
 * Pure: no I/O, no allocation. */
#ifndef RW_SVC_WIRE_H
#define RW_SVC_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "common/wire_rec.h"
#include "sched/sched.h"

/* ---- control channel framing ------------------------------------------------------------------
 * Every message: a 16-byte header then `length` payload bytes.
 *   u32 magic "RWMC" | u16 version | u16 type | u32 length | u32 seq (sender's message counter) */

#define RW_WIRE_MAGIC 0x434d5752u   /* "RWMC" read as little-endian bytes R W M C */
/* 5: the hello carries a nonce instead of region descriptors; AUTH proves the cluster key and
 * REGIONS follows it (docs/security.md "Peer authentication"). PHASE_ERR names
 * its cause and the receiver's attempt (docs/dataflow.md "Failures"). COUNTS carries
 * the sender's view of its rails (docs/dataflow.md "Rail health"). 6: COUNTS carries the
 * group key's fingerprint (docs/security.md). 7: CARVE announces a group's own areas
 * (docs/rankpath.md "The slab areas, lent per group"). A peer speaking another version is refused. */
#define RW_WIRE_VERSION 7
#define RW_WIRE_HDR_SIZE 16
#define RW_WIRE_MAX_PAYLOAD (1u << 20) /* a count row of 4096 nodes x 16 rails is 256 KiB */
#define RW_WIRE_CLUSTER_MAX 64         /* cluster name field, NUL-padded */
#define RW_WIRE_ADDR_MAX 64            /* rail listener address field, NUL-padded */
#define RW_WIRE_DESC_SIZE 32           /* region descriptor (RW_RAIL_DESC_SIZE) */
#define RW_WIRE_ERRMSG_MAX 128
#define RW_WIRE_GROUP_MAX 64           /* group name field, NUL-padded */
#define RW_WIRE_MAX_SLOTS 64           /* receive-area slots a node may announce */
#define RW_WIRE_NONCE_SIZE 32          /* hello challenge, fresh random per connection */
#define RW_WIRE_PROOF_SIZE 32          /* AUTH proof: crypto_auth (HMAC-SHA512-256) tag */
#define RW_WIRE_KEY_FP_SIZE 16         /* a group key's fingerprint (RW_IPC_KEY_FP_SIZE) */

typedef enum rw_wire_type {
	RW_WIRE_HELLO = 1,     /* identity, fingerprint, auth mode, challenge nonce */
	RW_WIRE_COUNTS = 2,    /* one node's count row for one dispatch phase */
	RW_WIRE_PHASE_ERR = 3, /* a node failed a phase: everyone fails it */
	RW_WIRE_HEARTBEAT = 4, /* liveness (and RTT: echo = the peer's stamp being answered) */
	RW_WIRE_GRANT = 5,     /* a receiver admits its wave-k source (docs/dataflow.md "Send") */
	RW_WIRE_BYE = 6,       /* no payload: the sender is stopping cleanly (not a crash) */
	RW_WIRE_AUTH = 7,      /* proof of the cluster key over both hellos' nonces */
	RW_WIRE_REGIONS = 8,   /* rail addresses and receive-region descriptors (after AUTH only) */
	RW_WIRE_CARVE = 9,     /* a group carve-out's regions, one per rail (after REGIONS only) */
	RW_WIRE_TYPE_MAX = 9,
} rw_wire_type_t;

typedef struct rw_wire_hdr {
	uint16_t type;
	uint32_t length;
	uint32_t seq;
} rw_wire_hdr_t;

void rw_wire_hdr_pack(const rw_wire_hdr_t *h, uint8_t out[RW_WIRE_HDR_SIZE]);
/* RW_ERR_PROTO on bad magic/version, unknown type or length > RW_WIRE_MAX_PAYLOAD. */
rw_status_t rw_wire_hdr_unpack(const uint8_t in[RW_WIRE_HDR_SIZE], rw_wire_hdr_t *h_p);

/* HELLO: the connector sends it as soon as the control connection opens; the acceptor answers
 * with its own HELLO and its AUTH. A mismatch of cluster, node count, rails, GPUs, fingerprint
 * or auth mode makes the receiver refuse the peer. Nothing secret travels in it.
 * Layout: cluster[64] | node nodes gpus rails (u32) | fingerprint boot_id (u64) | flags (u32) |
 *         reserved (u32, 0) | nonce[32] */
#define RW_WIRE_HELLO_KEYED 1u /* flags: the sender holds a cluster key (else "auth none") */
typedef struct rw_wire_hello {
	char cluster[RW_WIRE_CLUSTER_MAX]; /* NUL-terminated after unpack */
	uint32_t node, nodes, gpus, rails;
	uint64_t fingerprint;              /* rw_wire_fingerprint() of the sender's config */
	uint64_t boot_id;                  /* random per daemon start: a change = the peer restarted */
	uint32_t flags;                    /* RW_WIRE_HELLO_* */
	uint8_t nonce[RW_WIRE_NONCE_SIZE]; /* the sender's challenge to the receiver */
} rw_wire_hello_t;

#define RW_WIRE_HELLO_SIZE (RW_WIRE_CLUSTER_MAX + 16 + 16 + 8 + RW_WIRE_NONCE_SIZE)
/* Returns RW_WIRE_HELLO_SIZE, or 0 if buf_len is too small. */
size_t rw_wire_hello_pack(const rw_wire_hello_t *h, uint8_t *buf, size_t buf_len);
/* RW_ERR_PROTO: wrong size, rails 0 or > RW_MAX_RAILS, node >= nodes, unknown flags, reserved
 * bytes set, unterminated cluster name. */
rw_status_t rw_wire_hello_unpack(const uint8_t *in, size_t len, rw_wire_hello_t *h_p);

/* AUTH: proof[32], the sender's crypto_auth tag over both nonces and both node ids (what it
 * covers: service/mesh/mesh_auth.c). The acceptor's goes with its hello, the connector's once it has
 * checked the acceptor's; each side sends REGIONS only after the other's proof checked out. */
#define RW_WIRE_AUTH_SIZE RW_WIRE_PROOF_SIZE

/* REGIONS: rails (u32) | reserved (u32, 0) | rails x (desc[32] addr[64]): the sender's rail
 * listener addresses and receive-region descriptors. */
typedef struct rw_wire_regions {
	uint32_t rails;
	uint8_t desc[RW_MAX_RAILS][RW_WIRE_DESC_SIZE];  /* receive region per rail */
	char rail_addr[RW_MAX_RAILS][RW_WIRE_ADDR_MAX]; /* rail listener addresses (port 0 allowed) */
} rw_wire_regions_t;

size_t rw_wire_regions_size(uint32_t rails);
/* Returns bytes written (rw_wire_regions_size(r->rails)) or 0 if buf_len is too small. */
size_t rw_wire_regions_pack(const rw_wire_regions_t *r, uint8_t *buf, size_t buf_len);
/* RW_ERR_PROTO: wrong size for its rail count, rails 0 or > RW_MAX_RAILS, reserved bytes set,
 * unterminated addresses. */
rw_status_t rw_wire_regions_unpack(const uint8_t *in, size_t len, rw_wire_regions_t *r_p);

/* CARVE: index (u32) | rails (u32) | rails x desc[32]: the sender's carve-out `index` (a group's
 * own receive and send areas, docs/rankpath.md "The slab areas, lent per group") is now these
 * regions; a later CARVE of the same index replaces it. Sent after REGIONS, and before any
 * COUNTS whose slot names it (the control channel keeps the order). */
typedef struct rw_wire_carve {
	uint32_t index;
	uint32_t rails;
	uint8_t desc[RW_MAX_RAILS][RW_WIRE_DESC_SIZE];
} rw_wire_carve_t;

size_t rw_wire_carve_size(uint32_t rails);
/* Returns bytes written or 0 if buf_len is too small or rails is out of range. */
size_t rw_wire_carve_pack(const rw_wire_carve_t *c, uint8_t *buf, size_t buf_len);
/* RW_ERR_PROTO: wrong size for its rail count, rails 0 or > RW_MAX_RAILS. The index is the
 * caller's to check against what it keeps. */
rw_status_t rw_wire_carve_unpack(const uint8_t *in, size_t len, rw_wire_carve_t *c_p);

/* The identity of a phase pair: (group, layer, step). kind travels separately. */
typedef struct rw_wire_key {
	uint32_t group;
	uint32_t layer;
	uint64_t step;
} rw_wire_key_t;

/* 32-bit id of a group name (FNV-1a); names are compared too where both are at hand. */
uint32_t rw_wire_group_hash(const char *name);

/* 32-bit tag of a key (FNV-1a over its little-endian bytes): written into every record header
 * and (its low 14 bits) into every immediate, so stale writes of another phase are detected. */
uint32_t rw_wire_key_tag(const rw_wire_key_t *key);
/* The tag of writes into a node: the key's tag mixed with the receiver's epoch. */
static inline uint32_t rw_wire_tag_for(uint32_t key_tag, uint32_t epoch)
{
	uint32_t h = key_tag ^ (epoch * 0x9e3779b1u);
	return h ^ (h >> 15);
}
static inline int rw_wire_key_eq(const rw_wire_key_t *a, const rw_wire_key_t *b)
{
	return a->group == b->group && a->layer == b->layer && a->step == b->step;
}

/* Per-phase parameters every node must agree on (checked when the rows meet). */
typedef struct rw_wire_phase_params {
	uint32_t n_experts;
	uint32_t topk;
	uint32_t hidden;
	uint32_t dtype;          /* rw_wire_dtype_t */
	uint32_t requested_path; /* an rw_path_t forced by this node, or RW_WIRE_PATH_AUTO; with
	                          * RW_WIRE_PATH_BY_RANKS: the path its ranks asked for (rw_sqe_t.path) */
	/* This node's attempt at the pair (random, never 0). Every write INTO this node for the
	 * pair carries rw_wire_tag_for(key tag, epoch), so a late write of an earlier attempt with
	 * the same key is told apart and dropped (docs/dataflow.md "Failures"). */
	uint32_t epoch;
	/* The fingerprint of the group key the node's ranks joined with (zeros: none; docs/
	 * security.md "Group names"): nodes whose ranks hold different keys run different jobs. */
	uint8_t key_fp[RW_WIRE_KEY_FP_SIZE];
} rw_wire_phase_params_t;

#define RW_WIRE_PATH_AUTO 0xffu
/* Set in requested_path when the node's ranks asked for the path in their submissions (not its
 * configured `path`): every node of the phase must then carry the same value. */
#define RW_WIRE_PATH_BY_RANKS 0x100u
static inline uint32_t rw_wire_path_by_ranks(uint32_t path) /* path: an rw_path_t */
{
	return path | RW_WIRE_PATH_BY_RANKS;
}

/* COUNTS: key(16) | group_name[64] | node nodes rails slot | n_experts topk hidden dtype path |
 * epoch | key_fp[16] | row[nodes * rails] | rail_weight[rails] | rail_up[nodes], all u32 but the
 * key's step (u64) and the fingerprint's bytes.
 * Node `node`'s row for the dispatch of `key`: row[d * rails + r] (rw_sched_count()), and its
 * view of its rails when it sent the row (docs/dataflow.md "Rail health"): the capacity weight
 * of each of its rails (1..RW_MAX_RAIL_WEIGHT, 0 = not usable) and, per node n, the mask of its
 * rails whose connection to n is up (bit r; its own entry: the rails it can use at all).
 * Sending it also promises that the sender's receive area of this group is free for the phase
 * (docs/dataflow.md "region reuse"). */
typedef struct rw_wire_counts {
	rw_wire_key_t key;               /* key.group = rw_wire_group_hash(group_name) */
	char group_name[RW_WIRE_GROUP_MAX]; /* NUL-terminated after unpack */
	uint32_t node, nodes, rails;
	uint32_t slot;                   /* the sender's receive-area slot for this pair */
	rw_wire_phase_params_t params;
	const uint32_t *row;     /* pack: nodes * rails entries (unpack leaves it NULL) */
	const uint32_t *rail_weight; /* pack: rails entries */
	const uint32_t *rail_up;     /* pack: nodes entries */
	const uint8_t *row_le;   /* unpack: the row inside the input, little-endian */
	const uint8_t *view_le;  /* unpack: rail_weight then rail_up, inside the input */
} rw_wire_counts_t;

size_t rw_wire_counts_size(uint32_t nodes, uint32_t rails);
size_t rw_wire_counts_pack(const rw_wire_counts_t *c, uint8_t *buf, size_t buf_len);
/* RW_ERR_PROTO on size mismatch or out-of-range fields. The row stays in the input buffer
 * (little-endian); read entries with rw_wire_counts_row(). */
rw_status_t rw_wire_counts_unpack(const uint8_t *in, size_t len, rw_wire_counts_t *c_p);
uint32_t rw_wire_counts_row(const rw_wire_counts_t *c, uint32_t i);
uint32_t rw_wire_counts_weight(const rw_wire_counts_t *c, uint32_t rail);
uint32_t rw_wire_counts_up(const rw_wire_counts_t *c, uint32_t node);

/* PHASE_ERR: node `node` failed (key, kind) with status; the receiver fails it too. `epoch` is
 * the sender's epoch for the key (the one in its count row; 0 = it had none). A `relay` says
 * the sender only passed on someone else's failure after its count row had gone out: receivers
 * drop that row wherever they hold it, and fail only a pair that had taken it
 * (docs/dataflow.md "Failures"). */
typedef struct rw_wire_phase_err {
	rw_wire_key_t key;
	uint32_t kind;           /* 0 dispatch, 1 combine */
	int32_t status;          /* an rw_status_t */
	uint32_t node;
	uint32_t epoch;
	uint32_t relay;          /* 0 or 1 */
	uint32_t cause_node;     /* the failure this message passes on: the node where it began */
	uint32_t cause_id;       /* and its id there (that node's epoch for the attempt; never 0) */
	uint32_t dst_epoch;      /* the receiver's epoch in the failed attempt, from its count row
	                          * the sender took; 0: the sender had no row of the receiver */
	char msg[RW_WIRE_ERRMSG_MAX];
} rw_wire_phase_err_t;

#define RW_WIRE_PHASE_ERR_SIZE (16 + 28 + RW_WIRE_ERRMSG_MAX)
size_t rw_wire_phase_err_pack(const rw_wire_phase_err_t *e, uint8_t *buf, size_t buf_len);
rw_status_t rw_wire_phase_err_unpack(const uint8_t *in, size_t len, rw_wire_phase_err_t *e_p);

/* GRANT: the sender, node d, lets its wave-`wave` source (d - wave) mod N write (key, kind) to it
 * now: d has received all its data of the earlier waves of that phase. wave >= 2. */
typedef struct rw_wire_grant {
	rw_wire_key_t key;
	uint32_t kind;           /* 0 dispatch, 1 combine */
	uint32_t wave;
} rw_wire_grant_t;

#define RW_WIRE_GRANT_SIZE 24
size_t rw_wire_grant_pack(const rw_wire_grant_t *g, uint8_t *buf, size_t buf_len);
/* RW_ERR_PROTO on a wrong size, kind > 1 or wave < 2 (the caller checks wave < N). */
rw_status_t rw_wire_grant_unpack(const uint8_t *in, size_t len, rw_wire_grant_t *g_p);

/* HEARTBEAT: stamp = sender's rw_now_ns(); echo = the last stamp received from the peer (0 =
 * none) and hold = how long the sender held it before this reply, so the peer measures the
 * round trip as now - echo - hold. */
typedef struct rw_wire_heartbeat {
	uint64_t stamp;
	uint64_t echo;
	uint64_t hold;
} rw_wire_heartbeat_t;

#define RW_WIRE_HEARTBEAT_SIZE 24
size_t rw_wire_heartbeat_pack(const rw_wire_heartbeat_t *hb, uint8_t *buf, size_t buf_len);
rw_status_t rw_wire_heartbeat_unpack(const uint8_t *in, size_t len, rw_wire_heartbeat_t *hb_p);

/* Fingerprint of what every node must share: cluster name, N, G, R, gpu_rail, transport, and the
 * receive-region size. FNV-1a 64. */
uint64_t rw_wire_fingerprint(const char *cluster, const rw_topo_t *topo, const char *transport,
			     uint64_t region_bytes);

/* ---- immediates ------------------------------------------------------------------------------
 * 32 bits on every rail write:  tag14 (bits 31..18) | kind (17) | last (16) | src12 (15..4) |
 * rail4 (3..0). The receiver checks tag against the phase it expects, src against the node the
 * connection belongs to, rail against the connection's rail; `last` marks a slab's final chunk. */

typedef struct rw_wire_imm {
	uint32_t tag14;
	uint32_t kind;
	uint32_t last;
	uint32_t src;
	uint32_t rail;
} rw_wire_imm_t;

/* The bits of a tag an immediate carries. */
static inline uint32_t rw_wire_imm_tag(uint32_t tag) { return tag & 0x3fffu; }
static inline uint32_t rw_wire_imm_pack(uint32_t tag, uint32_t kind, uint32_t last, uint32_t src,
					uint32_t rail)
{
	return (rw_wire_imm_tag(tag) << 18) | ((kind & 1u) << 17) | ((last & 1u) << 16) |
	       ((src & 0xfffu) << 4) | (rail & 0xfu);
}

static inline void rw_wire_imm_unpack(uint32_t imm, rw_wire_imm_t *i)
{
	i->tag14 = imm >> 18;
	i->kind = (imm >> 17) & 1u;
	i->last = (imm >> 16) & 1u;
	i->src = (imm >> 4) & 0xfffu;
	i->rail = imm & 0xfu;
}

/* ---- records -------------------------------------------------------------------------------
 * Dispatch record (one per (token, remote node)) and combine record (one per dispatch record,
 * returned along the same (egress rail, slot)): the layout is common/wire_rec.h's, shared with
 * the rank's kernels. Rows are hidden elements of the phase dtype, host byte order (clusters
 * are little-endian). */

typedef enum rw_wire_dtype {
	RW_WIRE_F32 = 0,
	RW_WIRE_BF16 = 1,
	RW_WIRE_DTYPE_COUNT = 2,
} rw_wire_dtype_t;

static inline uint32_t rw_wire_dtype_size(uint32_t dtype) { return dtype == RW_WIRE_BF16 ? 2 : 4; }

static inline uint64_t rw_wire_row_bytes(uint32_t hidden, uint32_t dtype)
{
	return (uint64_t)hidden * rw_wire_dtype_size(dtype);
}
/* The sizes are sched/'s (rw_sched_rec_bytes), the arithmetic the tools share; the layout's
 * constants above must match it (checked in tests/unit/test_svc_wire.c). */
static inline uint64_t rw_wire_rec_size(uint32_t topk, uint32_t hidden, uint32_t dtype)
{
	return rw_sched_rec_bytes(topk, hidden, rw_wire_dtype_size(dtype));
}
static inline uint64_t rw_wire_crec_size(uint32_t hidden, uint32_t dtype)
{
	return rw_sched_crec_bytes(hidden, rw_wire_dtype_size(dtype));
}

typedef struct rw_wire_rec_hdr {
	uint32_t tag;
	uint32_t src_node;
	uint32_t owner;
	uint32_t token;
	uint32_t topk;
} rw_wire_rec_hdr_t;

/* Write a dispatch record's header and top-k block (ids, weights: topk entries each). */
void rw_wire_rec_pack(uint8_t *rec, const rw_wire_rec_hdr_t *h, const int32_t *ids,
		      const float *weights);
/* Read a dispatch record's header; RW_ERR_PROTO when topk differs from `topk`. ids/weights are
 * read with rw_wire_rec_id()/rw_wire_rec_weight(). */
rw_status_t rw_wire_rec_unpack(const uint8_t *rec, uint32_t topk, rw_wire_rec_hdr_t *h_p);
int32_t rw_wire_rec_id(const uint8_t *rec, uint32_t i);
float rw_wire_rec_weight(const uint8_t *rec, uint32_t topk, uint32_t i);

typedef struct rw_wire_crec_hdr {
	uint32_t tag;
	uint32_t src_node;
	uint32_t rail;
	uint32_t slot;
} rw_wire_crec_hdr_t;

void rw_wire_crec_pack(uint8_t *rec, const rw_wire_crec_hdr_t *h);
void rw_wire_crec_unpack(const uint8_t *rec, rw_wire_crec_hdr_t *h_p);

/* ---- little-endian fields, typed (common/common.h rw_put_le / rw_get_le) ---- */
static inline void rw_wire_put16(uint8_t *p, uint16_t v) { rw_put_le(p, v, 2); }
static inline void rw_wire_put32(uint8_t *p, uint32_t v) { rw_put_le(p, v, 4); }
static inline void rw_wire_put64(uint8_t *p, uint64_t v) { rw_put_le(p, v, 8); }
static inline uint16_t rw_wire_get16(const uint8_t *p) { return (uint16_t)rw_get_le(p, 2); }
static inline uint32_t rw_wire_get32(const uint8_t *p) { return (uint32_t)rw_get_le(p, 4); }
static inline uint64_t rw_wire_get64(const uint8_t *p) { return rw_get_le(p, 8); }

#endif /* RW_SVC_WIRE_H */
