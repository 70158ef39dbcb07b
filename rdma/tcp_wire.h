/* Private: the `tcp` rail transport's wire format, shared by rdma/tcp.c and the conformance
 * suite's hostile-peer tests. Not part of the module's public face (that is rdma/rail.h).
 *
 * Every frame starts with one fixed 64-byte little-endian header; only WRITE carries a payload
 * (exactly `length` bytes, received straight into the target region).
 *   0 u32 magic   4 u8 version   5 u8 type   6 u16 reserved (0)
 *   8 u32 imm    12 u32 reserved (0)
 *  16 u64 key    24 u64 offset  32 u64 length  40 u64 seq   48..63 reserved (0)
 * HELLO and HELLO_ACK carry no length or seq: their bytes 32..63 hold a proof instead
 * (rw_rail_conn_cbs_t.on_verify: the daemon's MAC with its session key, docs/security.md).
 * 64 bytes, not 48: a cache-line header keeps payloads 64-byte aligned in the byte stream when
 * lengths are multiples of 64 (the daemon's records are), so the kernel's copies out of and
 * into page-aligned regions stay mutually aligned (docs/perf/rail-tcp.md).
 * HELLO (connector -> acceptor): key = tag, offset = rail index, proof. HELLO_ACK: offset =
 * rail, proof (the acceptor's reply). Version 2 added the proof; a version-1 peer is refused.
 * WRITE: key/offset/length name the target range, imm is delivered, seq = 1, 2, 3, ... per
 * direction. ACK: seq = number of writes whose data is in place (cumulative). */
#ifndef RW_RDMA_TCP_WIRE_H
#define RW_RDMA_TCP_WIRE_H

#include <stdint.h>
#include <string.h>

#include "common/common.h"

#define RW_TCP_MAGIC 0x43545752u /* "RWTC" little-endian */
#define RW_TCP_VERSION 2
#define RW_TCP_PROOF_OFF 32
#define RW_TCP_PROOF_SIZE 32
#define RW_TCP_HDR_SIZE 64

enum rw_tcp_frame_type {
	RW_TCP_HELLO = 1,
	RW_TCP_HELLO_ACK = 2,
	RW_TCP_WRITE = 3,
	RW_TCP_ACK = 4,
};

typedef struct rw_tcp_hdr {
	uint8_t type;
	uint32_t imm;
	uint64_t key, offset, length, seq;      /* length, seq: WRITE and ACK only */
	uint8_t proof[RW_TCP_PROOF_SIZE];      /* HELLO and HELLO_ACK only */
} rw_tcp_hdr_t;

static inline int rw_tcp_is_hello(uint8_t type)
{
	return type == RW_TCP_HELLO || type == RW_TCP_HELLO_ACK;
}

static inline void rw_tcp_hdr_encode(const rw_tcp_hdr_t *h, uint8_t out[RW_TCP_HDR_SIZE])
{
	memset(out, 0, RW_TCP_HDR_SIZE);
	rw_put_le(out + 0, RW_TCP_MAGIC, 4);
	out[4] = RW_TCP_VERSION;
	out[5] = h->type;
	rw_put_le(out + 8, h->imm, 4);
	rw_put_le(out + 16, h->key, 8);
	rw_put_le(out + 24, h->offset, 8);
	if (rw_tcp_is_hello(h->type)) {
		memcpy(out + RW_TCP_PROOF_OFF, h->proof, RW_TCP_PROOF_SIZE);
		return;
	}
	rw_put_le(out + 32, h->length, 8);
	rw_put_le(out + 40, h->seq, 8);
}

/* Decode and check the fixed fields; returns 0 on success, -1 on bad magic/version/reserved
 * or an unknown type (the caller drops the connection). */
static inline int rw_tcp_hdr_decode(const uint8_t in[RW_TCP_HDR_SIZE], rw_tcp_hdr_t *h)
{
	if (rw_get_le(in + 0, 4) != RW_TCP_MAGIC || in[4] != RW_TCP_VERSION)
		return -1;
	if (in[5] < RW_TCP_HELLO || in[5] > RW_TCP_ACK || in[6] || in[7])
		return -1;
	if (rw_get_le(in + 12, 4))
		return -1;
	int hello = rw_tcp_is_hello(in[5]);
	for (int i = 48; i < RW_TCP_HDR_SIZE && !hello; i++)
		if (in[i])
			return -1;
	h->type = in[5];
	h->imm = (uint32_t)rw_get_le(in + 8, 4);
	h->key = rw_get_le(in + 16, 8);
	h->offset = rw_get_le(in + 24, 8);
	h->length = hello ? 0 : rw_get_le(in + 32, 8);
	h->seq = hello ? 0 : rw_get_le(in + 40, 8);
	memset(h->proof, 0, RW_TCP_PROOF_SIZE);
	if (hello)
		memcpy(h->proof, in + RW_TCP_PROOF_OFF, RW_TCP_PROOF_SIZE);
	return 0;
}

#endif /* RW_RDMA_TCP_WIRE_H */
