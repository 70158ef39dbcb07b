/* The verbs transport's pure parts (rdma/verbs_priv.h): the connection hello and the SEND
 * notification codecs, device-spec and count parsing, the work-completion status mapping. No
 * rdma-core objects: unit-tested on machines without an RDMA device (tests/rdma/test_verbs.c). */
#include "rdma/verbs_priv.h"

#include <infiniband/verbs.h> /* IBV_WC_* (constants only) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void rw_vb_hello_pack(const rw_vb_hello_t *hello, uint8_t out[RW_VB_HELLO_SIZE])
{
	rw_put_le(out + 0, RW_VB_HELLO_MAGIC, 4);
	rw_put_le(out + 4, RW_VB_HELLO_VERSION, 2);
	rw_put_le(out + 6, hello->flags, 2);
	rw_put_le(out + 8, hello->tag, 8);
	rw_put_le(out + 16, hello->max_writes, 4);
	rw_put_le(out + 20, hello->rail, 4);
	memcpy(out + 24, hello->proof, RW_VB_PROOF_SIZE);
}

rw_status_t rw_vb_hello_unpack(const void *in, size_t len, rw_vb_hello_t *hello_p)
{
	const uint8_t *p = in;
	if (!p || len < RW_VB_HELLO_SIZE)
		return RW_ERR_PROTO;
	if (rw_get_le(p + 0, 4) != RW_VB_HELLO_MAGIC || rw_get_le(p + 4, 2) != RW_VB_HELLO_VERSION)
		return RW_ERR_PROTO;
	uint16_t flags = (uint16_t)rw_get_le(p + 6, 2);
	if (flags & ~RW_VB_HELLO_IMM)
		return RW_ERR_PROTO;
	hello_p->flags = flags;
	hello_p->tag = rw_get_le(p + 8, 8);
	hello_p->max_writes = (uint32_t)rw_get_le(p + 16, 4);
	hello_p->rail = (uint32_t)rw_get_le(p + 20, 4);
	memcpy(hello_p->proof, p + 24, RW_VB_PROOF_SIZE);
	return RW_OK;
}

void rw_vb_sendmsg_pack(uint32_t imm, uint64_t length, uint8_t out[RW_VB_SENDMSG_SIZE])
{
	rw_put_le(out + 0, RW_VB_SENDMSG_MAGIC, 4);
	rw_put_le(out + 4, imm, 4);
	rw_put_le(out + 8, length, 8);
}

rw_status_t rw_vb_sendmsg_unpack(const void *in, size_t len, uint32_t *imm_p, uint64_t *length_p)
{
	const uint8_t *p = in;
	if (!p || len != RW_VB_SENDMSG_SIZE || rw_get_le(p, 4) != RW_VB_SENDMSG_MAGIC)
		return RW_ERR_PROTO;
	*imm_p = (uint32_t)rw_get_le(p + 4, 4);
	*length_p = rw_get_le(p + 8, 8);
	return RW_OK;
}

rw_status_t rw_vb_parse_dev_port(const char *s, char name_p[64], uint8_t *port_p)
{
	if (!s || !*s)
		return RW_ERR_INVAL;
	const char *colon = strchr(s, ':');
	size_t n = colon ? (size_t)(colon - s) : strlen(s);
	if (n == 0 || n >= 64)
		return RW_ERR_INVAL;
	unsigned long port = 1;
	if (colon) {
		const char *ps = colon + 1;
		if (*ps < '0' || *ps > '9')
			return RW_ERR_INVAL;
		char *end;
		port = strtoul(ps, &end, 10);
		if (*end != '\0' || port == 0 || port > 255)
			return RW_ERR_INVAL;
	}
	memcpy(name_p, s, n);
	name_p[n] = '\0';
	*port_p = (uint8_t)port;
	return RW_OK;
}

uint64_t rw_vb_parse_count(const char *s)
{
	if (!s || !*s)
		return 0;
	uint64_t x = 0;
	for (; *s; s++) {
		if (*s < '0' || *s > '9' || x > (UINT64_MAX - 9) / 10)
			return 0;
		x = x * 10 + (uint64_t)(*s - '0');
	}
	return x;
}

int rw_vb_rail_listed(const char *list, unsigned rail)
{
	while (list && *list) {
		const char *end = strchr(list, ',');
		size_t n = end ? (size_t)(end - list) : strlen(list);
		char item[16];
		if (n > 0 && n < sizeof(item)) {
			memcpy(item, list, n);
			item[n] = '\0';
			if (strspn(item, "0123456789") == n && rw_vb_parse_count(item) == rail)
				return 1;
		}
		list = end ? end + 1 : NULL;
	}
	return 0;
}

rw_status_t rw_vb_wc_status_to_rw(int wc_status)
{
	switch (wc_status) {
	case IBV_WC_SUCCESS:
		return RW_OK;
	case IBV_WC_REM_ACCESS_ERR:
	case IBV_WC_REM_INV_REQ_ERR:
	case IBV_WC_REM_OP_ERR:
	case IBV_WC_REM_INV_RD_REQ_ERR:
	case IBV_WC_BAD_RESP_ERR:
		return RW_ERR_PROTO;
	case IBV_WC_RETRY_EXC_ERR:
	case IBV_WC_RNR_RETRY_EXC_ERR:
	case IBV_WC_REM_ABORT_ERR:
	case IBV_WC_RESP_TIMEOUT_ERR:
	case IBV_WC_WR_FLUSH_ERR: /* the QP went to error first; its cause was reported then */
		return RW_ERR_PEER;
	default: /* local length/protection/QP errors, fatal, general */
		return RW_ERR_LINK;
	}
}
