/* Verbs transport checks that need no RDMA device: the connection hello and WRITE + SEND
 * message codecs (untrusted input), write-mode negotiation, device-spec parsing, completion status
 * mapping, and a clean, leak-free failure of rw_rail_dev_open() where the configured address or
 * device does not exist (which, on a machine without RDMA, is every address). The data path
 * itself is tested for real by the conformance suite inside Soft-RoCE guests (rdma_softroce). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <ev.h>
#include <infiniband/verbs.h>
#include <string.h>

#include "common/common.h"
#include "rdma/rail.h"
#include "rdma/verbs_priv.h"

static void test_hello_round_trip(void **state)
{
	(void)state;
	rw_vb_hello_t h = {.flags = RW_VB_HELLO_IMM, .tag = 0x0123456789abcdefull,
			   .max_writes = 4096, .rail = 7};
	for (int i = 0; i < RW_VB_PROOF_SIZE; i++)
		h.proof[i] = (uint8_t)(3 * i + 1);
	_Static_assert(RW_VB_HELLO_SIZE <= 56, "an IB/RoCE connect request carries 56 bytes");
	uint8_t buf[RW_VB_HELLO_SIZE + 8];
	memset(buf, 0xee, sizeof(buf));
	rw_vb_hello_pack(&h, buf);
	/* Fixed little-endian layout: magic "RWVB" first. */
	assert_memory_equal(buf, "RWVB", 4);
	assert_int_equal(buf[8], 0xef);
	assert_int_equal(buf[15], 0x01);
	rw_vb_hello_t out;
	assert_int_equal(rw_vb_hello_unpack(buf, RW_VB_HELLO_SIZE, &out), RW_OK);
	assert_int_equal(out.flags, h.flags);
	assert_int_equal(out.tag, h.tag);
	assert_int_equal(out.max_writes, h.max_writes);
	assert_int_equal(out.rail, h.rail);
	assert_memory_equal(out.proof, h.proof, RW_VB_PROOF_SIZE);
	/* The CM pads private data: longer input is fine. */
	assert_int_equal(rw_vb_hello_unpack(buf, sizeof(buf), &out), RW_OK);
}

static void test_hello_untrusted(void **state)
{
	(void)state;
	rw_vb_hello_t h = {.flags = 0, .tag = 1, .max_writes = 2, .rail = 3}, out = {.tag = 99};
	uint8_t buf[RW_VB_HELLO_SIZE];
	rw_vb_hello_pack(&h, buf);
	assert_int_equal(rw_vb_hello_unpack(buf, RW_VB_HELLO_SIZE - 1, &out), RW_ERR_PROTO);
	assert_int_equal(rw_vb_hello_unpack(NULL, 100, &out), RW_ERR_PROTO);
	for (int i = 0; i < 8; i++) { /* every byte of magic, version and flags matters */
		uint8_t bad[RW_VB_HELLO_SIZE];
		memcpy(bad, buf, sizeof(bad));
		bad[i] ^= i < 6 ? 0x01 : 0x80;
		assert_int_equal(rw_vb_hello_unpack(bad, sizeof(bad), &out), RW_ERR_PROTO);
	}
	assert_int_equal(out.tag, 99); /* untouched on failure */
}

static void test_write_mode_negotiation(void **state)
{
	(void)state;
	/* Write with immediate only when both ends offer it (iWARP or a forced fallback on
	 * either side means RDMA WRITE + SEND). */
	assert_false(rw_vb_use_write_send(RW_VB_HELLO_IMM, RW_VB_HELLO_IMM));
	assert_true(rw_vb_use_write_send(RW_VB_HELLO_IMM, 0));
	assert_true(rw_vb_use_write_send(0, RW_VB_HELLO_IMM));
	assert_true(rw_vb_use_write_send(0, 0));
}

static void test_sendmsg(void **state)
{
	(void)state;
	uint8_t buf[RW_VB_SENDMSG_SIZE];
	uint32_t imm = 0;
	uint64_t len = 0;
	rw_vb_sendmsg_pack(0xfeedf00du, 64ull << 20, buf);
	assert_int_equal(rw_vb_sendmsg_unpack(buf, sizeof(buf), &imm, &len), RW_OK);
	assert_int_equal(imm, 0xfeedf00du);
	assert_int_equal(len, 64ull << 20);
	/* The SEND's byte count must be exactly the message; the magic must match. */
	imm = 5;
	assert_int_equal(rw_vb_sendmsg_unpack(buf, sizeof(buf) - 1, &imm, &len), RW_ERR_PROTO);
	assert_int_equal(rw_vb_sendmsg_unpack(buf, sizeof(buf) + 1, &imm, &len), RW_ERR_PROTO);
	buf[1] ^= 1;
	assert_int_equal(rw_vb_sendmsg_unpack(buf, sizeof(buf), &imm, &len), RW_ERR_PROTO);
	assert_int_equal(imm, 5);
}

static void test_parse_dev_port(void **state)
{
	(void)state;
	char name[64];
	uint8_t port = 0;
	assert_int_equal(rw_vb_parse_dev_port("mlx5_0:1", name, &port), RW_OK);
	assert_string_equal(name, "mlx5_0");
	assert_int_equal(port, 1);
	assert_int_equal(rw_vb_parse_dev_port("rxe1", name, &port), RW_OK);
	assert_string_equal(name, "rxe1");
	assert_int_equal(port, 1);
	assert_int_equal(rw_vb_parse_dev_port("mlx5_3:2", name, &port), RW_OK);
	assert_int_equal(port, 2);
	char long_name[80];
	memset(long_name, 'x', sizeof(long_name) - 1);
	long_name[sizeof(long_name) - 1] = '\0';
	static const char *bad[] = {"", ":1", "rxe0:", "rxe0:0", "rxe0:256", "rxe0:1:2", "a:b"};
	for (size_t i = 0; i < RW_ARRAY_SIZE(bad); i++)
		assert_int_equal(rw_vb_parse_dev_port(bad[i], name, &port), RW_ERR_INVAL);
	assert_int_equal(rw_vb_parse_dev_port(long_name, name, &port), RW_ERR_INVAL);
}

static void test_knobs_and_window(void **state)
{
	(void)state;
	assert_int_equal(rw_vb_parse_count("65536"), 65536);
	assert_int_equal(rw_vb_parse_count("0"), 0);
	static const char *bad[] = {"", "-1", " 4", "4 ", "4k", "0x10", "99999999999999999999999"};
	for (size_t i = 0; i < RW_ARRAY_SIZE(bad); i++)
		assert_int_equal(rw_vb_parse_count(bad[i]), 0);
	assert_int_equal(rw_vb_parse_count(NULL), 0);

	assert_true(rw_vb_rail_listed("0", 0));
	assert_false(rw_vb_rail_listed("0", 1));
	assert_true(rw_vb_rail_listed("0,2", 2));
	assert_false(rw_vb_rail_listed("0,2", 1));
	assert_true(rw_vb_rail_listed("10,1", 1));
	assert_false(rw_vb_rail_listed("10", 1));
	assert_false(rw_vb_rail_listed("1x", 1));
	assert_false(rw_vb_rail_listed("x", 0)); /* not a number: names no rail, not rail 0 */
	assert_false(rw_vb_rail_listed("", 0));
	assert_false(rw_vb_rail_listed(",,", 0));
	assert_true(rw_vb_rail_listed(",3", 3));
	assert_false(rw_vb_rail_listed(NULL, 0));

	assert_int_equal(rw_vb_window(1024, 2), 2);     /* a peer with 2 receives posted */
	assert_int_equal(rw_vb_window(4, 1024), 4);
	assert_int_equal(rw_vb_window(1024, 0), 1);     /* a hello saying 0 */
}

static void test_wc_status_blast_radius(void **state)
{
	(void)state;
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_SUCCESS), RW_OK);
	/* The peer broke the rules (bad rkey/range): a protocol error on that connection. */
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_REM_ACCESS_ERR), RW_ERR_PROTO);
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_REM_INV_REQ_ERR), RW_ERR_PROTO);
	/* The peer is gone. */
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_RETRY_EXC_ERR), RW_ERR_PEER);
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_RNR_RETRY_EXC_ERR), RW_ERR_PEER);
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_WR_FLUSH_ERR), RW_ERR_PEER);
	/* Local failures. */
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_LOC_PROT_ERR), RW_ERR_LINK);
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_LOC_QP_OP_ERR), RW_ERR_LINK);
	assert_int_equal(rw_vb_wc_status_to_rw(IBV_WC_FATAL_ERR), RW_ERR_LINK);
	/* Every failure is a peer-class error: it drops one connection, never the daemon. */
	for (int s = IBV_WC_LOC_LEN_ERR; s <= IBV_WC_TM_RNDV_INCOMPLETE; s++)
		assert_true(rw_status_is_peer(rw_vb_wc_status_to_rw(s)));
}

/* Whatever this machine has, these never name an RDMA device: opening them fails cleanly
 * (a clear log line, an error status, nothing allocated: LSan checks the last part). */
static void test_dev_open_fails_cleanly(void **state)
{
	(void)state;
	struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
	assert_non_null(rw_rail_transport_find("verbs"));
	assert_non_null(strstr(rw_rail_transport_names(), "verbs"));
	rw_rail_config_t cfg = {.transport = "verbs", .rail = 0};
	rw_rail_dev_t *dev = NULL;
	cfg.local = "192.0.2.1"; /* TEST-NET-1: never an address of this host */
	assert_int_equal(rw_rail_dev_open(&cfg, loop, &dev), RW_ERR_NOTFOUND);
	cfg.local = "no_such_rdma_dev:1";
	assert_int_equal(rw_rail_dev_open(&cfg, loop, &dev), RW_ERR_NOTFOUND);
	cfg.local = "rxe0:1:2";
	assert_int_equal(rw_rail_dev_open(&cfg, loop, &dev), RW_ERR_INVAL);
	cfg.local = "";
	assert_int_equal(rw_rail_dev_open(&cfg, loop, &dev), RW_ERR_INVAL);
	assert_null(dev);
	/* Nothing was left on the loop either. */
	assert_int_equal(ev_run(loop, EVRUN_NOWAIT), 0);
	ev_loop_destroy(loop);
}

int main(void)
{
	rw_log_set_level(RW_LOG_ERROR);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hello_round_trip),
		cmocka_unit_test(test_hello_untrusted),
		cmocka_unit_test(test_write_mode_negotiation),
		cmocka_unit_test(test_sendmsg),
		cmocka_unit_test(test_parse_dev_port),
		cmocka_unit_test(test_knobs_and_window),
		cmocka_unit_test(test_wc_status_blast_radius),
		cmocka_unit_test(test_dev_open_fails_cleanly),
	};
	return cmocka_run_group_tests_name("rdma_verbs", tests, NULL, NULL);
}
