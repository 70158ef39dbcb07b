/* Private to the verbs transport (rdma/verbs*.c; these functions live in rdma/verbs_codec.c) and
 * its unit test: the connection hello carried in librdmacm's private data, write-mode
 * negotiation, device-spec parsing and the mapping of work completion statuses to rail errors. Pure functions, no rdma-core objects, so they are tested
 * on machines without an RDMA device. */
#ifndef RW_RDMA_VERBS_PRIV_H
#define RW_RDMA_VERBS_PRIV_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

/* Hello (connect request and accept reply private data), little-endian, 56 bytes: exactly the
 * 56 an IB/RoCE REQ allows, within iWARP's MPA limit:
 *   0 u32 magic "RWVB"  4 u16 version  6 u16 flags  8 u64 tag  16 u32 max_writes  20 u32 rail
 *  24 proof[32] (rw_rail_conn_cbs_t.on_verify: the connector's, or the acceptor's reply)
 * Version 2 added the proof; a version-1 hello is refused. */
#define RW_VB_HELLO_SIZE 56
#define RW_VB_HELLO_MAGIC 0x42565752u /* "RWVB" read as little-endian */
#define RW_VB_HELLO_VERSION 2
#define RW_VB_PROOF_SIZE 32
#define RW_VB_HELLO_IMM (1u << 0) /* sender can and will use RDMA WRITE WITH IMMEDIATE */

typedef struct rw_vb_hello {
	uint16_t flags;      /* RW_VB_HELLO_* */
	uint64_t tag;        /* connector's tag (0 in the reply) */
	uint32_t max_writes; /* sender's writes in flight per connection */
	uint32_t rail;       /* rail index; both ends must agree */
	uint8_t proof[RW_VB_PROOF_SIZE]; /* see the layout above; zeros when nobody checks */
} rw_vb_hello_t;

void rw_vb_hello_pack(const rw_vb_hello_t *hello, uint8_t out[RW_VB_HELLO_SIZE]);
/* Untrusted input (a peer's private data; may be padded by the CM, so len >= size is
 * accepted). RW_ERR_PROTO on short input, wrong magic/version or unknown flags. */
rw_status_t rw_vb_hello_unpack(const void *in, size_t len, rw_vb_hello_t *hello_p);

/* The connection uses RDMA WRITE WITH IMMEDIATE only when both ends offer it; otherwise RDMA
 * WRITE followed by a SEND that carries the immediate (iWARP has no write with immediate). */
static inline int rw_vb_use_write_send(uint16_t local_flags, uint16_t peer_flags)
{
	return !((local_flags & RW_VB_HELLO_IMM) && (peer_flags & RW_VB_HELLO_IMM));
}

/* Message of the WRITE + SEND mode, the SEND's whole payload, little-endian, 16 bytes:
 *   0 u32 magic "RWVS"  4 u32 imm  8 u64 length (bytes of the preceding RDMA WRITE) */
#define RW_VB_SENDMSG_SIZE 16
#define RW_VB_SENDMSG_MAGIC 0x53565752u
void rw_vb_sendmsg_pack(uint32_t imm, uint64_t length, uint8_t out[RW_VB_SENDMSG_SIZE]);
rw_status_t rw_vb_sendmsg_unpack(const void *in, size_t len, uint32_t *imm_p, uint64_t *length_p);

/* Parse a device spec "name:port" (port 1..255, name 1..63 chars without ':') or a bare
 * "name" (port 1). RW_ERR_INVAL on anything else. name_p must hold 64 bytes. */
rw_status_t rw_vb_parse_dev_port(const char *s, char name_p[64], uint8_t *port_p);

/* Blast radius of a failed work completion (enum ibv_wc_status value): the peer broke a rule
 * (remote access/invalid request: RW_ERR_PROTO), the peer is gone (retries exhausted:
 * RW_ERR_PEER), or the local side failed (RW_ERR_LINK). */
rw_status_t rw_vb_wc_status_to_rw(int wc_status);

/* Writes a connection keeps in flight: ours, or the peer's max_writes from its hello when that
 * is smaller (one receive is posted per write it may get); at least 1 (a hello saying 0). */
static inline uint32_t rw_vb_window(uint32_t own, uint32_t peer_max_writes)
{
	uint32_t w = peer_max_writes < own ? peer_max_writes : own;
	return w ? w : 1;
}

/* The test knobs' values (docs/rdma-verbs.md "Configuration"): a count in plain decimal digits
 * (anything else, or NULL, gives 0 = unset), and whether a comma-separated list of rail indices
 * ("0", "0,2") names `rail` (entries that are not plain numbers name no rail). */
uint64_t rw_vb_parse_count(const char *s);
int rw_vb_rail_listed(const char *list, unsigned rail);

#endif /* RW_RDMA_VERBS_PRIV_H */
