/* libFuzzer target for every parser a peer, a file or an operator feeds railwaved
 * (docs/perf/fuzz.md): the peer control channel's decoders (service/phase/wire.c: frame header,
 * HELLO, COUNTS, PHASE_ERR, GRANT, HEARTBEAT, REGIONS, dispatch and combine record headers), the
 * tcp rail header (rdma/tcp_wire.h), the cluster configuration (service/core/config*.c) and the
 * anchor table (sched/anchors.c). The first byte picks the parser, the rest is its input.
 * Invariants beyond "no crash, no leak" (ASan, UBSan, LSan): a message that decodes re-encodes to
 * bytes that decode to the same fields; a configuration that loads dumps to JSON that loads again;
 * an anchor table that parses formats to text that parses again with as many anchors. Seeds:
 * tests/fuzz/corpus (tests/fuzz/make_corpus.py). RW_FUZZ_PARSER=0xNN holds the first byte at NN, so
 * one parser gets every execution (tests/fuzz/run_long.sh, docs/perf/fuzz.md). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "rdma/tcp_wire.h"
#include "sched/sched.h"
#include "service/core/svc.h"
#include "service/phase/phase.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
	do {                                                                                       \
		if (!(c))                                                                          \
			__builtin_trap();                                                          \
	} while (0)

static int forced = -1; /* RW_FUZZ_PARSER, or -1: the input's first byte picks */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc, (void)argv;
	rw_log_set_level((rw_log_level_t)-1); /* refusals are the point: keep them quiet */
	const char *p = getenv("RW_FUZZ_PARSER");
	if (p && *p)
		forced = (int)(strtoul(p, NULL, 0) & 0xff);
	return 0;
}

static void fuzz_wire(uint8_t which, const uint8_t *in, size_t len)
{
	uint8_t buf[RW_WIRE_MAX_PAYLOAD < 8192 ? RW_WIRE_MAX_PAYLOAD : 8192];
	switch (which % 8) {
	case 0: {
		rw_wire_hdr_t h, h2;
		if (len < RW_WIRE_HDR_SIZE || rw_wire_hdr_unpack(in, &h) != RW_OK)
			return;
		rw_wire_hdr_pack(&h, buf);
		CHECK(rw_wire_hdr_unpack(buf, &h2) == RW_OK && h2.type == h.type &&
		      h2.length == h.length && h2.seq == h.seq);
		return;
	}
	case 1: {
		static rw_wire_hello_t h, h2;
		if (rw_wire_hello_unpack(in, len, &h) != RW_OK)
			return;
		size_t n = rw_wire_hello_pack(&h, buf, sizeof(buf));
		CHECK(n == len && rw_wire_hello_unpack(buf, n, &h2) == RW_OK);
		CHECK(h2.node == h.node && h2.nodes == h.nodes && h2.rails == h.rails &&
		      h2.fingerprint == h.fingerprint && !strcmp(h2.cluster, h.cluster) &&
		      h2.flags == h.flags && !memcmp(h2.nonce, h.nonce, RW_WIRE_NONCE_SIZE));
		return;
	}
	case 2: {
		rw_wire_counts_t c;
		if (rw_wire_counts_unpack(in, len, &c) != RW_OK)
			return;
		CHECK(c.node < c.nodes && len == rw_wire_counts_size(c.nodes, c.rails));
		uint64_t sum = 0; /* every entry of the row is readable */
		for (uint32_t i = 0; i < c.nodes * c.rails; i++)
			sum += rw_wire_counts_row(&c, i);
		(void)sum;
		return;
	}
	case 3: {
		rw_wire_phase_err_t e, e2;
		if (rw_wire_phase_err_unpack(in, len, &e) != RW_OK)
			return;
		size_t n = rw_wire_phase_err_pack(&e, buf, sizeof(buf));
		CHECK(n == len && rw_wire_phase_err_unpack(buf, n, &e2) == RW_OK);
		CHECK(e2.status == e.status && e2.kind == e.kind && e2.relay == e.relay &&
		      e2.epoch == e.epoch && !strcmp(e2.msg, e.msg));
		return;
	}
	case 4: {
		rw_wire_grant_t g, g2;
		if (rw_wire_grant_unpack(in, len, &g) != RW_OK)
			return;
		size_t n = rw_wire_grant_pack(&g, buf, sizeof(buf));
		CHECK(n == len && rw_wire_grant_unpack(buf, n, &g2) == RW_OK);
		CHECK(g2.kind == g.kind && g2.wave == g.wave && rw_wire_key_eq(&g2.key, &g.key));
		return;
	}
	case 5: {
		rw_wire_heartbeat_t hb;
		(void)rw_wire_heartbeat_unpack(in, len, &hb);
		return;
	}
	case 6: {
		static rw_wire_regions_t r, r2;
		if (rw_wire_regions_unpack(in, len, &r) != RW_OK)
			return;
		size_t n = rw_wire_regions_pack(&r, buf, sizeof(buf));
		CHECK(n == len && rw_wire_regions_unpack(buf, n, &r2) == RW_OK && r2.rails == r.rails);
		for (uint32_t i = 0; i < r.rails; i++)
			CHECK(!memcmp(r2.desc[i], r.desc[i], RW_WIRE_DESC_SIZE) &&
			      !strcmp(r2.rail_addr[i], r.rail_addr[i]));
		return;
	}
	default: { /* record headers read straight out of a receive area */
		if (len < 1)
			return;
		uint32_t topk = 1 + in[0] % RW_MAX_TOPK;
		if (len - 1 < rw_wire_rec_row_off(topk) || len - 1 < RW_WIRE_CREC_HDR)
			return;
		rw_wire_rec_hdr_t h;
		if (rw_wire_rec_unpack(in + 1, topk, &h) == RW_OK)
			CHECK(h.topk == topk);
		rw_wire_crec_hdr_t ch;
		rw_wire_crec_unpack(in + 1, &ch);
		return;
	}
	}
}

static void fuzz_tcp(const uint8_t *in, size_t len)
{
	rw_tcp_hdr_t h, h2;
	uint8_t buf[RW_TCP_HDR_SIZE];
	if (len < RW_TCP_HDR_SIZE || rw_tcp_hdr_decode(in, &h) != 0)
		return;
	rw_tcp_hdr_encode(&h, buf);
	CHECK(rw_tcp_hdr_decode(buf, &h2) == 0 && h2.type == h.type && h2.imm == h.imm &&
	      h2.key == h.key && h2.offset == h.offset && h2.length == h.length && h2.seq == h.seq &&
	      !memcmp(h2.proof, h.proof, RW_TCP_PROOF_SIZE));
}

static void fuzz_config(const uint8_t *in, size_t len)
{
	char *text = malloc(len + 1);
	if (!text)
		return;
	memcpy(text, in, len);
	text[len] = '\0';
	static const rw_svc_kv_t flags[] = { { "node", "0" } };
	rw_svc_config_t cfg, cfg2;
	char err[256];
	if (rw_svc_config_load_text(text, NULL, flags, 1, &cfg, err, sizeof(err)) == RW_OK) {
		char *dump = rw_svc_config_dump(&cfg);
		if (dump) {
			CHECK(rw_svc_config_load_text(dump, NULL, flags, 1, &cfg2, err, sizeof(err)) == RW_OK);
			CHECK(cfg2.n_nodes == cfg.n_nodes && cfg2.rails == cfg.rails && cfg2.me == cfg.me);
			rw_svc_config_free(&cfg2);
			free(dump);
		}
		rw_svc_config_free(&cfg);
	}
	free(text);
}

static void fuzz_anchors(const uint8_t *in, size_t len)
{
	rw_anchor_table_t t, t2;
	char err[256];
	memset(&t, 0, sizeof(t));
	if (rw_sched_anchors_parse((const char *)in, len, &t, err, sizeof(err)) != RW_OK)
		return;
	size_t need = rw_sched_anchors_format(&t, NULL, 0);
	char *text = malloc(need + 1);
	if (text) {
		rw_sched_anchors_format(&t, text, need + 1);
		memset(&t2, 0, sizeof(t2));
		CHECK(rw_sched_anchors_parse(text, need, &t2, err, sizeof(err)) == RW_OK);
		CHECK(t2.n_anchors == t.n_anchors);
		rw_sched_anchors_free(&t2);
		free(text);
	}
	rw_sched_anchors_free(&t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	const uint8_t which = forced >= 0 ? (uint8_t)forced : data[0];
	switch (which >> 4) {
	case 0: fuzz_wire(which & 15, data + 1, size - 1); break;
	case 1: fuzz_tcp(data + 1, size - 1); break;
	case 2: fuzz_config(data + 1, size - 1); break;
	case 3: fuzz_anchors(data + 1, size - 1); break;
	default: break;
	}
	return 0;
}
