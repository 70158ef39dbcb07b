/* service/phase/wire.h: every peer message and record format round-trips, and the decoders reject
 * malformed input (wrong sizes, magic, version, out-of-range fields, random bytes) without
 * touching their outputs. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "service/phase/phase.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (uint32_t)(rng_state >> 11);
}

static void test_hdr_roundtrip_and_reject(void **state)
{
	(void)state;
	uint8_t b[RW_WIRE_HDR_SIZE];
	rw_wire_hdr_t h = { .type = RW_WIRE_COUNTS, .length = 1234, .seq = 77 }, o;
	rw_wire_hdr_pack(&h, b);
	assert_int_equal(rw_wire_hdr_unpack(b, &o), RW_OK);
	assert_int_equal(o.type, RW_WIRE_COUNTS);
	assert_int_equal(o.length, 1234);
	assert_int_equal(o.seq, 77);

	uint8_t bad[RW_WIRE_HDR_SIZE];
	memcpy(bad, b, sizeof(b));
	bad[0] ^= 1; /* magic */
	assert_int_equal(rw_wire_hdr_unpack(bad, &o), RW_ERR_PROTO);
	memcpy(bad, b, sizeof(b));
	rw_wire_put16(bad + 4, RW_WIRE_VERSION + 1);
	assert_int_equal(rw_wire_hdr_unpack(bad, &o), RW_ERR_PROTO);
	memcpy(bad, b, sizeof(b));
	rw_wire_put16(bad + 6, 0);
	assert_int_equal(rw_wire_hdr_unpack(bad, &o), RW_ERR_PROTO);
	rw_wire_put16(bad + 6, RW_WIRE_TYPE_MAX + 1);
	assert_int_equal(rw_wire_hdr_unpack(bad, &o), RW_ERR_PROTO);
	memcpy(bad, b, sizeof(b));
	rw_wire_put32(bad + 8, RW_WIRE_MAX_PAYLOAD + 1);
	assert_int_equal(rw_wire_hdr_unpack(bad, &o), RW_ERR_PROTO);
	/* "GET / HTTP/1.1" and the like are refused at the first header. */
	memcpy(bad, "GET / HTTP/1.1\r\n", 16);
	assert_int_equal(rw_wire_hdr_unpack(bad, &o), RW_ERR_PROTO);
}

static void test_hello_roundtrip(void **state)
{
	(void)state;
	rw_wire_hello_t h;
	memset(&h, 0, sizeof(h));
	strcpy(h.cluster, "lab");
	h.node = 2;
	h.nodes = 4;
	h.gpus = 2;
	h.rails = 3;
	h.fingerprint = 0x1122334455667788ull;
	h.boot_id = 99;
	h.flags = RW_WIRE_HELLO_KEYED;
	for (int i = 0; i < RW_WIRE_NONCE_SIZE; i++)
		h.nonce[i] = (uint8_t)(i * 7 + 1);
	uint8_t buf[4096];
	size_t n = rw_wire_hello_pack(&h, buf, sizeof(buf));
	assert_int_equal(n, RW_WIRE_HELLO_SIZE);
	assert_int_equal(rw_wire_hello_pack(&h, buf, n - 1), 0);
	rw_wire_hello_t o;
	assert_int_equal(rw_wire_hello_unpack(buf, n, &o), RW_OK);
	assert_string_equal(o.cluster, "lab");
	assert_int_equal(o.node, 2);
	assert_int_equal(o.nodes, 4);
	assert_int_equal(o.gpus, 2);
	assert_int_equal(o.rails, 3);
	assert_true(o.fingerprint == h.fingerprint);
	assert_true(o.boot_id == 99);
	assert_int_equal(o.flags, RW_WIRE_HELLO_KEYED);
	assert_memory_equal(o.nonce, h.nonce, RW_WIRE_NONCE_SIZE);
	/* Wrong lengths, node >= nodes, unterminated strings, unknown flags, reserved bytes. */
	assert_int_equal(rw_wire_hello_unpack(buf, n - 1, &o), RW_ERR_PROTO);
	assert_int_equal(rw_wire_hello_unpack(buf, n + 1, &o), RW_ERR_PROTO);
	uint8_t bad[4096];
	memcpy(bad, buf, n);
	rw_wire_put32(bad + RW_WIRE_CLUSTER_MAX, 4);
	assert_int_equal(rw_wire_hello_unpack(bad, n, &o), RW_ERR_PROTO);
	memcpy(bad, buf, n);
	memset(bad, 'x', RW_WIRE_CLUSTER_MAX);
	assert_int_equal(rw_wire_hello_unpack(bad, n, &o), RW_ERR_PROTO);
	memcpy(bad, buf, n);
	rw_wire_put32(bad + RW_WIRE_CLUSTER_MAX + 12, RW_MAX_RAILS + 1);
	assert_int_equal(rw_wire_hello_unpack(bad, n, &o), RW_ERR_PROTO);
	memcpy(bad, buf, n);
	rw_wire_put32(bad + RW_WIRE_CLUSTER_MAX + 32, 2);
	assert_int_equal(rw_wire_hello_unpack(bad, n, &o), RW_ERR_PROTO);
	memcpy(bad, buf, n);
	rw_wire_put32(bad + RW_WIRE_CLUSTER_MAX + 36, 1);
	assert_int_equal(rw_wire_hello_unpack(bad, n, &o), RW_ERR_PROTO);
}

static void test_regions_roundtrip(void **state)
{
	(void)state;
	rw_wire_regions_t r;
	memset(&r, 0, sizeof(r));
	r.rails = 3;
	for (uint32_t i = 0; i < r.rails; i++) {
		memset(r.desc[i], (int)(i + 1), RW_WIRE_DESC_SIZE);
		snprintf(r.rail_addr[i], RW_WIRE_ADDR_MAX, "127.0.%u.3:%u", i, 4000 + i);
	}
	uint8_t buf[4096];
	size_t n = rw_wire_regions_pack(&r, buf, sizeof(buf));
	assert_int_equal(n, rw_wire_regions_size(3));
	assert_int_equal(rw_wire_regions_pack(&r, buf, n - 1), 0);
	rw_wire_regions_t o;
	assert_int_equal(rw_wire_regions_unpack(buf, n, &o), RW_OK);
	assert_int_equal(o.rails, 3);
	for (uint32_t i = 0; i < 3; i++) {
		assert_memory_equal(o.desc[i], r.desc[i], RW_WIRE_DESC_SIZE);
		assert_string_equal(o.rail_addr[i], r.rail_addr[i]);
	}
	assert_int_equal(rw_wire_regions_unpack(buf, n - 1, &o), RW_ERR_PROTO);
	assert_int_equal(rw_wire_regions_unpack(buf, n + 1, &o), RW_ERR_PROTO);
	uint8_t bad[4096];
	memcpy(bad, buf, n);
	memset(bad + n - RW_WIRE_ADDR_MAX, 'x', RW_WIRE_ADDR_MAX);
	assert_int_equal(rw_wire_regions_unpack(bad, n, &o), RW_ERR_PROTO);
	memcpy(bad, buf, n);
	rw_wire_put32(bad, 0);
	assert_int_equal(rw_wire_regions_unpack(bad, n, &o), RW_ERR_PROTO);
	memcpy(bad, buf, n);
	rw_wire_put32(bad + 4, 1);
	assert_int_equal(rw_wire_regions_unpack(bad, n, &o), RW_ERR_PROTO);
}

/* Where the row starts in a COUNTS message (rw_wire_counts_pack): key 16, group name, ten
 * 32-bit fields, then the group key's fingerprint. */
#define COUNTS_ROW_OFF (16 + RW_WIRE_GROUP_MAX + 40 + RW_WIRE_KEY_FP_SIZE)

static void test_counts_roundtrip(void **state)
{
	(void)state;
	uint32_t row[3 * 4], weight[4] = { 100, 50, 0, RW_MAX_RAIL_WEIGHT }, up[3] = { 0xd, 0xf, 0x1 };
	for (uint32_t i = 0; i < 12; i++)
		row[i] = rnd() >> 4; /* the row's records add up to less than 2^32 */
	rw_wire_counts_t c = {
		.key = { .group = rw_wire_group_hash("moe.ep0"), .layer = 7, .step = 1ull << 40 },
		.node = 1, .nodes = 3, .rails = 4, .slot = 1,
		.params = { .n_experts = 48, .topk = 4, .hidden = 64, .dtype = RW_WIRE_BF16,
			    .requested_path = RW_WIRE_PATH_AUTO, .epoch = 0xdeadbeef },
		.row = row, .rail_weight = weight, .rail_up = up,
	};
	for (uint32_t i = 0; i < RW_WIRE_KEY_FP_SIZE; i++)
		c.params.key_fp[i] = (uint8_t)(0xa0 + i);
	strcpy(c.group_name, "moe.ep0");
	uint8_t buf[1024];
	size_t n = rw_wire_counts_pack(&c, buf, sizeof(buf));
	assert_int_equal(n, rw_wire_counts_size(3, 4));
	rw_wire_counts_t o;
	assert_int_equal(rw_wire_counts_unpack(buf, n, &o), RW_OK);
	assert_true(rw_wire_key_eq(&o.key, &c.key));
	assert_string_equal(o.group_name, "moe.ep0");
	assert_int_equal(o.node, 1);
	assert_int_equal(o.slot, 1);
	assert_int_equal(o.params.n_experts, 48);
	assert_int_equal(o.params.dtype, RW_WIRE_BF16);
	assert_int_equal(o.params.requested_path, RW_WIRE_PATH_AUTO);
	assert_int_equal(o.params.epoch, 0xdeadbeef);
	assert_memory_equal(o.params.key_fp, c.params.key_fp, RW_WIRE_KEY_FP_SIZE);
	for (uint32_t i = 0; i < 12; i++)
		assert_int_equal(rw_wire_counts_row(&o, i), row[i]);
	for (uint32_t r = 0; r < 4; r++) /* the sender's view of its rails (rail health) */
		assert_int_equal(rw_wire_counts_weight(&o, r), weight[r]);
	for (uint32_t d = 0; d < 3; d++)
		assert_int_equal(rw_wire_counts_up(&o, d), up[d]);

	uint8_t bad[1024];
	assert_int_equal(rw_wire_counts_unpack(buf, n - 4, &o), RW_ERR_PROTO);
	struct { size_t off; uint32_t v; } cases[] = {
		{ RW_WIRE_GROUP_MAX + 16, 3 },      /* node >= nodes */
		{ RW_WIRE_GROUP_MAX + 24, 2 },      /* nodes: size no longer matches */
		{ RW_WIRE_GROUP_MAX + 24, 0 },      /* rails 0 */
		{ RW_WIRE_GROUP_MAX + 28, RW_WIRE_MAX_SLOTS }, /* slot */
		{ 0, 12345 },                       /* group hash does not match the name */
		{ RW_WIRE_GROUP_MAX + 36, 0 },      /* topk 0 */
		{ RW_WIRE_GROUP_MAX + 36, RW_MAX_TOPK + 1 },
		{ RW_WIRE_GROUP_MAX + 44, RW_WIRE_DTYPE_COUNT },
		{ RW_WIRE_GROUP_MAX + 48, RW_PATH_COUNT },
		{ RW_WIRE_GROUP_MAX + 48, RW_PATH_COUNT | RW_WIRE_PATH_BY_RANKS },
		{ RW_WIRE_GROUP_MAX + 48, RW_WIRE_PATH_AUTO | RW_WIRE_PATH_BY_RANKS },
		{ RW_WIRE_GROUP_MAX + 52, 0 },      /* epoch 0 */
		{ n - 16 - 4 * 4 + 4, RW_MAX_RAIL_WEIGHT + 1 }, /* rail 1's weight out of range */
		{ n - 4, 0x10 },                    /* node 2's up mask names rail 4 of 4 */
		/* records to node 2 of 2^32 - 1 on rail 0, with the rest: 2^32 or more in the row
		 * (a pair's total and the row's CSR are 32-bit) */
		{ COUNTS_ROW_OFF + 4 * 8, UINT32_MAX },
	};
	for (size_t i = 0; i < RW_ARRAY_SIZE(cases); i++) {
		memcpy(bad, buf, n);
		rw_wire_put32(bad + cases[i].off, cases[i].v);
		assert_int_equal(rw_wire_counts_unpack(bad, n, &o), RW_ERR_PROTO);
	}
	/* A path the ranks asked for (docs/ipc.md "Path requests") travels as is. */
	memcpy(bad, buf, n);
	rw_wire_put32(bad + RW_WIRE_GROUP_MAX + 48, RW_PATH_JOINT | RW_WIRE_PATH_BY_RANKS);
	assert_int_equal(rw_wire_counts_unpack(bad, n, &o), RW_OK);
	assert_int_equal(o.params.requested_path, RW_PATH_JOINT | RW_WIRE_PATH_BY_RANKS);
	memcpy(bad, buf, n);
	memset(bad + 16, 'g', RW_WIRE_GROUP_MAX); /* unterminated group name */
	assert_int_equal(rw_wire_counts_unpack(bad, n, &o), RW_ERR_PROTO);
}

static void test_phase_err_and_heartbeat(void **state)
{
	(void)state;
	rw_wire_phase_err_t e = { .key = { 1, 2, 3 }, .kind = 1, .status = RW_ERR_TIMEOUT, .node = 3,
				  .epoch = 0xdeadbeef, .relay = 1, .cause_node = 2, .cause_id = 0x1234,
				  .dst_epoch = 0x77 };
	strcpy(e.msg, "node 3: phase timed out");
	uint8_t buf[512];
	size_t n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
	assert_int_equal(n, RW_WIRE_PHASE_ERR_SIZE);
	rw_wire_phase_err_t o;
	assert_int_equal(rw_wire_phase_err_unpack(buf, n, &o), RW_OK);
	assert_int_equal(o.status, RW_ERR_TIMEOUT);
	assert_int_equal(o.kind, 1);
	assert_int_equal(o.relay, 1);
	assert_true(o.epoch == 0xdeadbeef);
	assert_int_equal(o.cause_node, 2);
	assert_int_equal(o.cause_id, 0x1234);
	assert_int_equal(o.dst_epoch, 0x77);
	assert_string_equal(o.msg, e.msg);
	rw_wire_put32(buf + 36, 0); /* a failure always has an id */
	assert_int_equal(rw_wire_phase_err_unpack(buf, n, &o), RW_ERR_PROTO);
	rw_wire_put32(buf + 36, 0x1234);
	buf[18] = 2; /* relay is 0 or 1 */
	assert_int_equal(rw_wire_phase_err_unpack(buf, n, &o), RW_ERR_PROTO);
	buf[18] = 0;
	assert_int_equal(rw_wire_phase_err_unpack(buf, n, &o), RW_OK);
	assert_int_equal(o.relay, 0);
	buf[20] = 5; /* a positive status is not an error */
	buf[21] = buf[22] = buf[23] = 0;
	assert_int_equal(rw_wire_phase_err_unpack(buf, n, &o), RW_ERR_PROTO);

	rw_wire_heartbeat_t hb = { .stamp = 123456789012ull, .echo = 42, .hold = 7 }, hbo;
	assert_int_equal(rw_wire_heartbeat_pack(&hb, buf, sizeof(buf)), RW_WIRE_HEARTBEAT_SIZE);
	assert_int_equal(rw_wire_heartbeat_unpack(buf, RW_WIRE_HEARTBEAT_SIZE, &hbo), RW_OK);
	assert_true(hbo.stamp == hb.stamp && hbo.echo == 42 && hbo.hold == 7);
	assert_int_equal(rw_wire_heartbeat_unpack(buf, RW_WIRE_HEARTBEAT_SIZE - 1, &hbo), RW_ERR_PROTO);
}

static void test_grant(void **state)
{
	(void)state;
	rw_wire_grant_t g = { .key = { 7, 8, 9 }, .kind = 1, .wave = 5 }, o;
	uint8_t buf[64];
	assert_int_equal(rw_wire_grant_pack(&g, buf, RW_WIRE_GRANT_SIZE - 1), 0);
	size_t n = rw_wire_grant_pack(&g, buf, sizeof(buf));
	assert_int_equal(n, RW_WIRE_GRANT_SIZE);
	assert_int_equal(rw_wire_grant_unpack(buf, n, &o), RW_OK);
	assert_true(rw_wire_key_eq(&o.key, &g.key) && o.kind == 1 && o.wave == 5);
	assert_int_equal(rw_wire_grant_unpack(buf, n - 1, &o), RW_ERR_PROTO);
	assert_int_equal(rw_wire_grant_unpack(buf, n + 1, &o), RW_ERR_PROTO);
	rw_wire_put32(buf + 16, 2); /* no such kind */
	assert_int_equal(rw_wire_grant_unpack(buf, n, &o), RW_ERR_PROTO);
	rw_wire_put32(buf + 16, 0);
	rw_wire_put32(buf + 20, 1); /* wave 1 is never granted */
	assert_int_equal(rw_wire_grant_unpack(buf, n, &o), RW_ERR_PROTO);
}

/* Random bytes of random lengths never crash a decoder, and a decoder that accepts them
 * produced in-range fields. */
static void test_decoders_random_input(void **state)
{
	(void)state;
	uint8_t buf[2048];
	for (int it = 0; it < 20000; it++) {
		size_t len = rnd() % sizeof(buf);
		for (size_t i = 0; i < len; i++)
			buf[i] = (uint8_t)rnd();
		if (it % 8 == 1) { /* a plausible regions message: right size, terminated addresses */
			uint32_t rails = 1 + rnd() % 4;
			len = rw_wire_regions_size(rails);
			rw_wire_put32(buf, rails);
			rw_wire_put32(buf + 4, 0);
			for (uint32_t r = 0; r < rails && rnd() % 8; r++)
				buf[8 + (r + 1) * (RW_WIRE_DESC_SIZE + RW_WIRE_ADDR_MAX) - 1] = 0;
		}
		if (it % 4 == 0 && len >= RW_WIRE_CLUSTER_MAX + 32) { /* plausible hello prefix */
			rw_wire_put32(buf + RW_WIRE_CLUSTER_MAX, rnd() % 4);
			rw_wire_put32(buf + RW_WIRE_CLUSTER_MAX + 4, 4);
			rw_wire_put32(buf + RW_WIRE_CLUSTER_MAX + 8, 2);
			rw_wire_put32(buf + RW_WIRE_CLUSTER_MAX + 12, 1 + rnd() % 4);
		}
		rw_wire_hello_t h;
		if (rw_wire_hello_unpack(buf, len, &h) == RW_OK) {
			assert_true(h.node < h.nodes && h.rails >= 1 && h.rails <= RW_MAX_RAILS);
			assert_true(strlen(h.cluster) < RW_WIRE_CLUSTER_MAX);
		}
		rw_wire_regions_t rg;
		if (rw_wire_regions_unpack(buf, len, &rg) == RW_OK)
			assert_true(rg.rails >= 1 && len == rw_wire_regions_size(rg.rails) &&
				    strlen(rg.rail_addr[rg.rails - 1]) < RW_WIRE_ADDR_MAX);
		rw_wire_counts_t c;
		if (rw_wire_counts_unpack(buf, len, &c) == RW_OK)
			assert_true(c.node < c.nodes && len == rw_wire_counts_size(c.nodes, c.rails));
		rw_wire_phase_err_t e;
		if (rw_wire_phase_err_unpack(buf, len, &e) == RW_OK)
			assert_true(e.status < 0 && strlen(e.msg) < RW_WIRE_ERRMSG_MAX);
		rw_wire_grant_t gr;
		if (rw_wire_grant_unpack(buf, len, &gr) == RW_OK)
			assert_true(len == RW_WIRE_GRANT_SIZE && gr.kind <= 1 && gr.wave >= 2);
		rw_wire_hdr_t hdr;
		if (len >= RW_WIRE_HDR_SIZE && rw_wire_hdr_unpack(buf, &hdr) == RW_OK)
			assert_true(hdr.length <= RW_WIRE_MAX_PAYLOAD);
	}
}

static void test_imm_and_records(void **state)
{
	(void)state;
	for (int it = 0; it < 1000; it++) {
		uint32_t tag = rnd(), kind = rnd() & 1, last = rnd() & 1, src = rnd() % 4096,
			 rail = rnd() % 16;
		rw_wire_imm_t i;
		rw_wire_imm_unpack(rw_wire_imm_pack(tag, kind, last, src, rail), &i);
		assert_int_equal(i.tag14, tag & 0x3fff);
		assert_int_equal(i.kind, kind);
		assert_int_equal(i.last, last);
		assert_int_equal(i.src, src);
		assert_int_equal(i.rail, rail);
	}
	/* Tags differ for neighbouring keys (layer, step, group). */
	rw_wire_key_t a = { 1, 5, 10 }, b = { 1, 5, 11 }, c = { 1, 6, 10 }, d = { 2, 5, 10 };
	assert_int_not_equal(rw_wire_key_tag(&a), rw_wire_key_tag(&b));
	assert_int_not_equal(rw_wire_key_tag(&a), rw_wire_key_tag(&c));
	assert_int_not_equal(rw_wire_key_tag(&a), rw_wire_key_tag(&d));

	const uint32_t topk = 5;
	assert_int_equal(rw_wire_rec_row_off(topk) % 16, 0);
	assert_int_equal(rw_wire_rec_size(topk, 7, RW_WIRE_BF16) % 16, 0);
	assert_true(rw_wire_rec_size(topk, 7, RW_WIRE_BF16) >= 16 + topk * 8 + 14);
	/* The sizes the tools take from sched/ are the layout the daemon packs. */
	for (uint32_t k = 1; k <= 9; k++)
		for (uint32_t hid = 1; hid <= 40; hid += 3)
			for (uint32_t dt = 0; dt < 2; dt++) { /* RW_WIRE_F32, RW_WIRE_BF16 */
				uint64_t row = rw_wire_align16(rw_wire_row_bytes(hid, dt));
				assert_int_equal(rw_wire_rec_size(k, hid, dt), rw_wire_rec_row_off(k) + row);
				assert_int_equal(rw_wire_crec_size(hid, dt), RW_WIRE_CREC_HDR + row);
			}
	uint8_t rec[256];
	int32_t ids[5] = { 3, -1, 17, 0, 40 };
	float w[5] = { 0.5f, 0.0f, 0.25f, 1.0f, -2.0f };
	rw_wire_rec_hdr_t h = { .tag = 0xdeadbeef, .src_node = 3, .owner = 1, .token = 999,
				.topk = topk }, o;
	rw_wire_rec_pack(rec, &h, ids, w);
	assert_int_equal(rw_wire_rec_unpack(rec, topk, &o), RW_OK);
	assert_true(o.tag == 0xdeadbeef && o.src_node == 3 && o.owner == 1 && o.token == 999);
	for (uint32_t i = 0; i < topk; i++) {
		assert_int_equal(rw_wire_rec_id(rec, i), ids[i]);
		assert_true(rw_wire_rec_weight(rec, topk, i) == w[i]);
	}
	assert_int_equal(rw_wire_rec_unpack(rec, topk + 1, &o), RW_ERR_PROTO);
	/* The field offsets the rank's kernels write by (common/wire_rec.h) are where the host
	 * packs them. */
	assert_int_equal(rw_wire_get32(rec + RW_WIRE_REC_TAG), 0xdeadbeef);
	assert_int_equal(rw_wire_get16(rec + RW_WIRE_REC_SRC), 3);
	assert_int_equal(rw_wire_get16(rec + RW_WIRE_REC_OWNER), 1);
	assert_int_equal(rw_wire_get32(rec + RW_WIRE_REC_TOKEN), 999);
	assert_int_equal(rw_wire_get16(rec + RW_WIRE_REC_TOPK), topk);
	assert_int_equal(rw_wire_get32(rec + RW_WIRE_REC_HDR + 8), 17); /* ids[2] */

	rw_wire_crec_hdr_t ch = { .tag = 5, .src_node = 2, .rail = 3, .slot = 70000 }, co;
	rw_wire_crec_pack(rec, &ch);
	rw_wire_crec_unpack(rec, &co);
	assert_true(co.tag == 5 && co.src_node == 2 && co.rail == 3 && co.slot == 70000);
	assert_int_equal(rw_wire_get32(rec + RW_WIRE_CREC_TAG), 5);
	assert_int_equal(rw_wire_get16(rec + RW_WIRE_CREC_SRC), 2);
	assert_int_equal(rw_wire_get16(rec + RW_WIRE_CREC_RAIL), 3);
	assert_int_equal(rw_wire_get32(rec + RW_WIRE_CREC_SLOT), 70000);
}

static void test_bf16(void **state)
{
	(void)state;
	/* Exact values survive; ties round to even; NaN stays NaN. */
	float exact[] = { 0.0f, 1.0f, -2.5f, 256.0f, 1.0f / 1024, -65536.0f };
	for (size_t i = 0; i < RW_ARRAY_SIZE(exact); i++)
		assert_true(rw_bf16_to_f32(rw_bf16_from_f32(exact[i])) == exact[i]);
	assert_true(rw_bf16_to_f32(rw_bf16_from_f32(1.0f + 1.0f / 256)) == 1.0f); /* tie: even */
	assert_true(rw_bf16_to_f32(rw_bf16_from_f32(1.0f + 3.0f / 256)) == 1.0f + 4.0f / 256);
	float nan = __builtin_nanf("");
	float back = rw_bf16_to_f32(rw_bf16_from_f32(nan));
	assert_true(back != back);

	float acc[4] = { 1, 2, 3, 4 };
	uint16_t row16[4];
	for (int i = 0; i < 4; i++)
		row16[i] = rw_bf16_from_f32((float)(i * 10));
	rw_svc_row_acc(acc, row16, RW_WIRE_BF16, 4);
	assert_true(acc[0] == 1 && acc[1] == 12 && acc[2] == 23 && acc[3] == 34);
	float row32[4] = { 0.5f, 0.5f, 0.5f, 0.5f };
	rw_svc_row_acc(acc, row32, RW_WIRE_F32, 4);
	assert_true(acc[3] == 34.5f);
	uint16_t out16[4];
	rw_svc_row_store(out16, RW_WIRE_BF16, acc, 4);
	assert_true(rw_bf16_to_f32(out16[1]) == 12.5f);
}

/* The blocked row loops against one element at a time, for every tail length around the block
 * size and at unaligned row addresses (rows sit inside records at any 2-byte offset). */
static void test_row_loops_match_scalar(void **state)
{
	(void)state;
	enum { MAXH = 70 };
	static const uint32_t hs[] = { 1, 2, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, MAXH };
	static const uint32_t special[] = { 0x80000000u, 0x00000000u, 0x7fc00000u, 0xffc00000u,
					    0x7f800000u, 0xff800000u, 0x00010000u, 0x80010000u };
	uint32_t seed = 12345;
	for (size_t t = 0; t < RW_ARRAY_SIZE(hs); t++) {
		uint32_t h = hs[t];
		for (uint32_t dtype = 0; dtype < 2; dtype++) {
			uint32_t wire = dtype ? RW_WIRE_F32 : RW_WIRE_BF16;
			uint8_t raw[MAXH * 4 + 2];
			uint8_t *row = raw + 2; /* 2-byte aligned only */
			float acc[MAXH], ref[MAXH], vals[MAXH];
			for (uint32_t i = 0; i < h; i++) {
				seed = seed * 1103515245u + 12345u;
				vals[i] = (float)((int)(seed >> 16) % 2001 - 1000) / 8.0f; /* exact in bf16 */
				if (dtype) {
					memcpy(row + 4 * i, &vals[i], 4);
				} else {
					uint16_t b = rw_bf16_from_f32(vals[i]);
					memcpy(row + 2 * i, &b, 2);
					vals[i] = rw_bf16_to_f32(b);
				}
				acc[i] = ref[i] = (float)i * 0.25f;
			}
			rw_svc_row_acc(acc, row, wire, h);
			for (uint32_t i = 0; i < h; i++)
				assert_true(acc[i] == ref[i] + vals[i]);
			rw_svc_row_load(acc, row, wire, h);
			for (uint32_t i = 0; i < h; i++)
				assert_true(acc[i] == vals[i]);
			/* The owner's sum of one term: bit for bit zeroing a sum, adding the row and
			 * storing it, -0 (which becomes +0), NaN and infinities included. */
			float zeroed[MAXH] = { 0 };
			for (uint32_t i = 0; i < h && i < RW_ARRAY_SIZE(special); i++) {
				uint16_t b = (uint16_t)(special[i] >> 16); /* the same value in bf16 */
				if (dtype)
					memcpy(row + 4 * i, &special[i], 4);
				else
					memcpy(row + 2 * i, &b, 2);
			}
			rw_svc_row_acc(zeroed, row, wire, h);
			uint8_t one[MAXH * 4], stored[MAXH * 4];
			const void *terms[1] = { row };
			rw_svc_rows_reduce(one, wire, terms, 1, h);
			rw_svc_row_store(stored, wire, zeroed, h);
			assert_memory_equal(one, stored, (size_t)h * rw_wire_dtype_size(wire));
			assert_true(zeroed[0] == 0.0f && !signbit(zeroed[0])); /* -0 + nothing: +0 */
			for (uint32_t i = 0; i < h; i++)
				acc[i] = vals[i] + 1.0f / 512; /* not representable: rounds */
			uint8_t out[MAXH * 4 + 2];
			rw_svc_row_store(out + 2, wire, acc, h);
			for (uint32_t i = 0; i < h; i++) {
				if (dtype) {
					float f;
					memcpy(&f, out + 2 + 4 * i, 4);
					assert_true(f == acc[i]);
				} else {
					uint16_t b;
					memcpy(&b, out + 2 + 2 * i, 2);
					assert_int_equal(b, rw_bf16_from_f32(acc[i]));
				}
			}
		}
	}
}

/* The bf16 store against rw_bf16_round_bits element by element over arbitrary bit patterns:
 * ties to even at every kept bit, NaNs (quiet and signalling, either sign), infinities,
 * subnormals, the largest finite values (which round to infinity) and random words, at every
 * tail length around the vector width and a 2-byte aligned destination. */
static void test_row_store_every_pattern(void **state)
{
	(void)state;
	enum { N = 4096 };
	static const uint32_t edge[] = { 0x00000000u, 0x80000000u, 0x00008000u, 0x00018000u,
					 0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x7f7fffffu,
					 0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7f800001u,
					 0xff800001u, 0x7fc00000u, 0xffffffffu, 0x7fbfffffu,
					 0x00000001u, 0x807fffffu };
	static uint32_t in[N];
	static float acc[N]; /* the same bits */
	static uint8_t out[2 * N + 4];
	uint32_t seed = 99;
	for (uint32_t i = 0; i < N; i++) {
		seed = seed * 1103515245u + 12345u;
		in[i] = i < RW_ARRAY_SIZE(edge) ? edge[i] : (seed & 0xffff0000u) | ((seed >> 3) & 0xffffu);
	}
	memcpy(acc, in, sizeof(acc));
	for (uint32_t h = 1; h <= N; h = h < 40 ? h + 1 : N) { /* every tail, then all of it */
		memset(out, 0xa5, sizeof(out));
		rw_svc_row_store(out + 2, RW_WIRE_BF16, acc, h);
		for (uint32_t i = 0; i < h; i++) {
			uint16_t b;
			memcpy(&b, out + 2 + 2 * i, 2);
			assert_int_equal(b, rw_bf16_round_bits(in[i]));
		}
		assert_int_equal(out[2 + 2 * h], 0xa5); /* nothing past the row */
		if (h == N)
			break;
	}
}

/* The owner's sum (rw_svc_rows_reduce) against its definition, one element at a time: +0, then
 * every row added in order in fp32, rounded once. Rows of random words (finite values of every
 * size, so sums cancel and round differently in another order; -0, infinities, NaN) at 2-byte
 * aligned addresses, 0 to 7 rows, widths around the block of 512 and its vector tails. NaN
 * results compare as NaN (which NaN two NaNs give is the hardware's). */
static void test_rows_reduce_matches_definition(void **state)
{
	(void)state;
	enum { MAXH = 1100, MAXN = 7 };
	static const uint32_t hs[] = { 1, 7, 16, 17, 511, 512, 513, 1024, 1031, MAXH };
	static const uint32_t special[] = { 0x80000000u, 0x00000000u, 0x7f800000u, 0xff800000u,
					    0x7fc00000u, 0x4e800000u, 0xce800000u, 0x3f800000u };
	static uint8_t raw[MAXN][MAXH * 4 + 2];
	static uint8_t out[MAXH * 4 + 4];
	const void *rows[MAXN];
	uint32_t seed = 777;
	for (size_t t = 0; t < RW_ARRAY_SIZE(hs); t++) {
		const uint32_t h = hs[t];
		for (uint32_t wire = 0; wire < 2; wire++) {
			const uint32_t esz = wire == RW_WIRE_BF16 ? 2 : 4;
			for (uint32_t n = 0; n <= MAXN; n++) {
				for (uint32_t k = 0; k < n; k++) {
					rows[k] = raw[k] + 2;
					for (uint32_t i = 0; i < h; i++) {
						seed = seed * 1103515245u + 12345u;
						uint32_t u = seed % 16 == 0 ? special[(seed >> 8) % 8]
							   : (rnd() & 0x8fffffffu) | 0x30000000u;
						if (wire == RW_WIRE_BF16) {
							uint16_t b = (uint16_t)(u >> 16);
							memcpy(raw[k] + 2 + 2 * i, &b, 2);
						} else {
							memcpy(raw[k] + 2 + 4 * i, &u, 4);
						}
					}
				}
				memset(out, 0xa5, sizeof(out));
				rw_svc_rows_reduce(out + 2, wire, rows, n, h);
				for (uint32_t i = 0; i < h; i++) {
					float acc = 0.0f;
					for (uint32_t k = 0; k < n; k++) {
						float v;
						if (wire == RW_WIRE_BF16) {
							uint16_t b;
							memcpy(&b, (const uint8_t *)rows[k] + 2 * i, 2);
							v = rw_bf16_to_f32(b);
						} else {
							memcpy(&v, (const uint8_t *)rows[k] + 4 * i, 4);
						}
						acc = acc + v;
					}
					float got;
					if (wire == RW_WIRE_BF16) {
						uint16_t b, want = rw_bf16_from_f32(acc);
						memcpy(&b, out + 2 + 2 * i, 2);
						got = rw_bf16_to_f32(b);
						if (!isnan(acc))
							assert_int_equal(b, want);
					} else {
						memcpy(&got, out + 2 + 4 * i, 4);
						if (!isnan(acc))
							assert_memory_equal(&got, &acc, 4);
					}
					assert_int_equal(!!isnan(got), !!isnan(acc));
					if (n == 0)
						assert_true(got == 0.0f && !signbit(got));
				}
				assert_int_equal(out[2 + h * esz], 0xa5); /* nothing past the row */
			}
		}
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hdr_roundtrip_and_reject),
		cmocka_unit_test(test_hello_roundtrip),
		cmocka_unit_test(test_regions_roundtrip),
		cmocka_unit_test(test_counts_roundtrip),
		cmocka_unit_test(test_phase_err_and_heartbeat),
		cmocka_unit_test(test_grant),
		cmocka_unit_test(test_decoders_random_input),
		cmocka_unit_test(test_imm_and_records),
		cmocka_unit_test(test_bf16),
		cmocka_unit_test(test_row_loops_match_scalar),
		cmocka_unit_test(test_row_store_every_pattern),
		cmocka_unit_test(test_rows_reduce_matches_definition),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
