/* tests/ipc/test_page.c: the rank page (ipc/page.[ch]): its layout over many random geometries
 * against the rules a reader relies on (every block on its own cache lines, inside its slot, no
 * two overlapping, the page big enough and page-rounded), the daemon's judgement of a rank's
 * words, and the owed words of a failure and of a lost daemon — the latter releasing a stream
 * that waits on them (stand-in driver, tests/cuda/libfakecuda.so). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "cuda/rw_cuda.h"
#include "ipc/page.h"
#include "ipc/railwave.h"
#include "tests/lib/fake_driver.h"

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint64_t next_u64(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static void check_block(uint64_t off, uint64_t len, uint64_t slot, uint64_t *ends, unsigned *n)
{
	assert_int_equal(off % RW_PAGE_LINE, 0);
	assert_true(off + len <= slot);
	for (unsigned i = 0; i < *n; i++)
		assert_true(off >= ends[i]); /* blocks come in order, none overlaps an earlier one */
	ends[(*n)++] = off + len;
}

static void test_layout_properties(void **state)
{
	(void)state;
	const char *seed = getenv("RW_TEST_SEED");
	rng = seed ? strtoull(seed, NULL, 0) | 1 : ((uint64_t)time(NULL) << 1) | 1;
	print_message("seed 0x%llx (RW_TEST_SEED repeats it)\n", (unsigned long long)rng);
	for (int it = 0; it < 20000; it++) {
		uint32_t nodes = 1 + (uint32_t)(next_u64() % 4096), rails = 1 + (uint32_t)(next_u64() % 16);
		uint32_t gpus = 1 + (uint32_t)(next_u64() % 16);
		uint32_t max_recv = (uint32_t)(next_u64() % 200000);
		size_t page = (size_t)4096 << (next_u64() % 3);
		rw_page_layout_t l;
		if (rw_page_layout(nodes, rails, gpus, max_recv, page, &l) != 0) {
			/* refused only past 1 GiB */
			uint64_t low = (uint64_t)RW_PAGE_DEPTH *
				       ((uint64_t)nodes * rails * 20 + max_recv * (20ull + 4 * gpus) +
					16ull * gpus);
			assert_true(low > (UINT64_C(1) << 29));
			continue;
		}
		const uint64_t cells = (uint64_t)nodes * rails;
		uint64_t ends[11];
		unsigned n = 0;
		check_block(l.params, sizeof(rw_page_params_t), l.slot_bytes, ends, &n);
		check_block(l.count_row, cells * 4, l.slot_bytes, ends, &n);
		check_block(l.plan, sizeof(rw_page_plan_head_t), l.slot_bytes, ends, &n);
		check_block(l.plan_stage, gpus * sizeof(rw_page_stage_t), l.slot_bytes, ends, &n);
		check_block(l.plan_rail, rails * sizeof(rw_page_plan_rail_t), l.slot_bytes, ends, &n);
		check_block(l.plan_tag, nodes * 4ull, l.slot_bytes, ends, &n);
		check_block(l.plan_entry, cells * sizeof(rw_page_plan_entry_t), l.slot_bytes, ends, &n);
		check_block(l.list, sizeof(rw_page_list_head_t), l.slot_bytes, ends, &n);
		check_block(l.list_entry, (uint64_t)max_recv * sizeof(rw_page_list_entry_t),
			    l.slot_bytes, ends, &n);
		check_block(l.term_off, ((uint64_t)max_recv + 1) * 4, l.slot_bytes, ends, &n);
		check_block(l.term_ref, (uint64_t)gpus * max_recv * 4, l.slot_bytes, ends, &n);
		assert_int_equal(l.slot0, RW_PAGE_SLOT0);
		assert_int_equal(l.slot_bytes % RW_PAGE_LINE, 0);
		assert_true(l.slot0 >= sizeof(rw_page_head_t));
		assert_int_equal(l.slot0 % RW_PAGE_LINE, 0);
		assert_true(l.bytes >= (uint64_t)l.slot0 + (uint64_t)l.slot_bytes * RW_PAGE_DEPTH);
		assert_int_equal(l.bytes % page, 0);
		assert_true(l.bytes - page < (uint64_t)l.slot0 + (uint64_t)l.slot_bytes * RW_PAGE_DEPTH);
	}
	rw_page_layout_t l;
	assert_int_equal(rw_page_layout(0, 1, 1, 1, 4096, &l), -1);
	assert_int_equal(rw_page_layout(1, 0, 1, 1, 4096, &l), -1);
	assert_int_equal(rw_page_layout(1, 1, 0, 1, 4096, &l), -1);
	assert_int_equal(rw_page_layout(1, 1, RW_PAGE_MAX_GPUS + 1, 1, 4096, &l), -1);
	assert_int_equal(rw_page_layout(1, 1, 1, RW_PAGE_MAX_RECV + 1, 4096, &l), -1);
	assert_int_equal(rw_page_layout(1, 1, 1, 1, 4000, &l), -1); /* page not a power of two */
	assert_int_equal(rw_page_layout(4096, 16, 8, 1u << 23, 4096, &l), -1); /* past 1 GiB */
	/* a term ref: 8 bits of rank, 24 of row */
	assert_int_equal(RW_PAGE_TERM(5, 0xabcdef), 0x05abcdefu);
	assert_int_equal(RW_PAGE_TERM_RANK(RW_PAGE_TERM(127, 3)), 127);
	assert_int_equal(RW_PAGE_TERM_ROW(RW_PAGE_TERM(127, RW_PAGE_MAX_RECV - 1)),
			 RW_PAGE_MAX_RECV - 1);
	/* the words and status lines sit each on a cache line of their own */
	for (unsigned i = 0; i < RW_PW_COUNT; i++)
		assert_int_equal(offsetof(rw_page_head_t, word) + i * sizeof(rw_page_line_t),
				 (size_t)RW_PAGE_LINE * (1 + i));
	assert_int_equal(sizeof(rw_page_line_t), RW_PAGE_LINE);
}

static void test_word_step(void **state)
{
	(void)state;
	assert_int_equal(rw_page_word_step(4, 4), RW_PAGE_SAME);
	assert_int_equal(rw_page_word_step(4, 5), RW_PAGE_NEXT);
	assert_int_equal(rw_page_word_step(4, 4 + RW_PAGE_DEPTH), RW_PAGE_NEXT); /* values skipped */
	assert_int_equal(rw_page_word_step(4, 5 + RW_PAGE_DEPTH), RW_PAGE_BAD);  /* too far ahead */
	assert_int_equal(rw_page_word_step(4, 3), RW_PAGE_BAD);                  /* went back */
	assert_int_equal(rw_page_word_step(0, UINT64_MAX), RW_PAGE_BAD);
	assert_int_equal(rw_page_word_step(UINT64_MAX, 1), RW_PAGE_NEXT);        /* wraps */
}

static rw_page_head_t *fresh_page(rw_page_layout_t *l)
{
	assert_int_equal(rw_page_layout(2, 2, 2, 64, 4096, l), 0);
	rw_page_head_t *pg = mmap(NULL, l->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
				  -1, 0);
	assert_true(pg != MAP_FAILED);
	const rw_page_geom_t geom = { .nodes = 2, .rails = 2, .gpus = 2, .max_tokens = 128,
				      .max_recv = 64 };
	rw_page_init(pg, &geom, 1, l);
	assert_int_equal(pg->rail, 1);
	assert_int_equal(pg->gpus, 2);
	assert_int_equal(pg->magic, RW_PAGE_MAGIC);
	assert_int_equal(pg->bytes, l->bytes);
	return pg;
}

/* A phase's slot is k mod D from slot 0; the submit check refuses each kind of lie, naming it. */
static void test_submit_check(void **state)
{
	(void)state;
	rw_page_layout_t l;
	rw_page_head_t *pg = fresh_page(&l); /* 2 nodes, 2 rails, 128 tokens at most */
	assert_ptr_equal(rw_page_slot(pg, 6), (uint8_t *)pg + l.slot0 + 2ull * l.slot_bytes);
	assert_ptr_equal(rw_page_slot(pg, 4), (uint8_t *)pg + l.slot0);
	assert_ptr_equal(rw_page_slot_at(pg, &l, 7), (uint8_t *)pg + l.slot0 + 3ull * l.slot_bytes);
	pg->nodes = 4096; /* the rank rewrote its head: the daemon's checks use its own geometry */
	const rw_page_geom_t geom = { .nodes = 2, .rails = 2, .gpus = 2, .max_tokens = 128,
				      .max_recv = 64 };
	rw_page_params_t p = { .kind = RW_KIND_DISPATCH, .topk = 8, .token_count = 10,
			       .phase = 6 };
	uint32_t row[4] = { 0, 7, 0, 10 }; /* native rail 1: 7 records to node 0, 10 to node 1 */
	char why[160];
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 1, why, sizeof(why)), 0);
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 2, 1, why, sizeof(why)), -1);
	assert_non_null(strstr(why, "phase 6's parameters, submitted as phase 2"));
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 0, why, sizeof(why)), -1);
	assert_non_null(strstr(why, "(node 0, rail 1) is 7, where the rank counts nothing"));
	row[3] = 11; /* more records to one node than tokens */
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 1, why, sizeof(why)), -1);
	assert_non_null(strstr(why, "is 11, above its 10 tokens"));
	row[3] = 10;
	p.topk = 1; /* one expert each: 17 records from 10 tokens cannot be */
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 1, why, sizeof(why)), -1);
	assert_non_null(strstr(why, "adds up to 17 records, above 10 tokens x 1 nodes"));
	p.topk = 8;
	p.token_count = 129;
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 1, why, sizeof(why)), -1);
	assert_non_null(strstr(why, "129 tokens, the page's bound is 128"));
	p.token_count = 10;
	p.kind = RW_KIND_COMBINE; /* a combine counts nothing */
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 1, why, sizeof(why)), -1);
	assert_non_null(strstr(why, "a combine"));
	memset(row, 0, sizeof(row));
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 1, why, sizeof(why)), 0);
	p.kind = 9;
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 1, why, sizeof(why)), -1);
	assert_non_null(strstr(why, "unknown kind 9"));
	p.kind = RW_KIND_DISPATCH;
	p.n_experts = 16;
	p.bad = 4; /* the count kernel met token 3's bad id */
	assert_int_equal(rw_page_submit_check(&geom, &p, row, 6, 1, why, sizeof(why)), -1);
	assert_non_null(strstr(why, "token 3 has a top-k id outside [0, 16)"));
	munmap(pg, l.bytes);
}

/* A rank's record i to node d is found in the one entry of d whose range holds it. */
static void test_plan_find(void **state)
{
	(void)state;
	/* 2 nodes x 3 rails; to node 1: records 0..4 on rail 1 (native), 5..6 on rail 0, 7 on 2 */
	rw_page_plan_entry_t e[6] = { { 0 } };
	e[3] = (rw_page_plan_entry_t){ .first = 5, .count = 2, .offset = 1000 };
	e[4] = (rw_page_plan_entry_t){ .first = 0, .count = 5, .offset = 64 };
	e[5] = (rw_page_plan_entry_t){ .first = 7, .count = 1, .offset = 4096 };
	const uint32_t want_rail[8] = { 1, 1, 1, 1, 1, 0, 0, 2 };
	const uint64_t want_off[8] = { 64, 96, 128, 160, 192, 1000, 1032, 4096 };
	for (uint32_t i = 0; i < 8; i++) {
		uint32_t rail = 99;
		uint64_t off = 0;
		assert_int_equal(rw_page_plan_find(e, 3, 1, i, 32, &rail, &off), 0);
		assert_int_equal(rail, want_rail[i]);
		assert_int_equal(off, want_off[i]);
	}
	uint32_t rail;
	uint64_t off;
	assert_int_equal(rw_page_plan_find(e, 3, 1, 8, 32, &rail, &off), -1);
	assert_int_equal(rw_page_plan_find(e, 3, 0, 0, 32, &rail, &off), -1); /* none to node 0 */
}

/* A failed phase k: its status, plan and arrived at least k; a word already past k stays. */
static void test_fail_owes_words_forward_only(void **state)
{
	(void)state;
	rw_page_layout_t l;
	rw_page_head_t *pg = fresh_page(&l);
	atomic_store(&pg->word[RW_PW_PLAN].v, 6); /* phase 6 planned, phase 5 fails late */
	atomic_store(&pg->word[RW_PW_ARRIVED].v, 4);
	rw_page_fail(pg, 5, RW_E_PHASE);
	assert_int_equal((int32_t)atomic_load(&pg->status[5 % RW_PAGE_DEPTH].v), RW_E_PHASE);
	assert_int_equal(atomic_load(&pg->word[RW_PW_PLAN].v), 6);
	assert_int_equal(atomic_load(&pg->word[RW_PW_ARRIVED].v), 5);
	for (unsigned d = 0; d < RW_PAGE_DEPTH; d++)
		if (d != 5 % RW_PAGE_DEPTH)
			assert_int_equal(atomic_load(&pg->status[d].v), 0);
	/* the rank's own words are never the daemon's to write */
	assert_int_equal(atomic_load(&pg->word[RW_PW_SUBMIT].v), 0);
	assert_int_equal(atomic_load(&pg->word[RW_PW_DONE].v), 0);
	munmap(pg, l.bytes);
}

/* The daemon dies at phase 2 while the rank's stream holds waits for phases 3 and 7 (7: queued
 * ahead, never submitted): the rank's CPU writes the owed words and the stream runs through. */
static void test_daemon_lost_releases_the_stream(void **state)
{
	(void)state;
	if (rw_cuda_init() != RW_OK) {
		print_message("skipped: no CUDA driver: %s\n", rw_cuda_unavailable_reason());
		skip();
	}
	rw_page_layout_t l;
	rw_page_head_t *pg = fresh_page(&l);
	rw_cuda_dptr_t dev;
	rw_cuda_stream_t *s;
	rw_cuda_ext_stream_t e;
	assert_int_equal(rw_cuda_host_register_mapped(pg, l.bytes, &dev), RW_OK);
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_ext_stream_of(s, &e), RW_OK);
	const rw_cuda_dptr_t plan = dev + offsetof(rw_page_head_t, word[RW_PW_PLAN]);
	const rw_cuda_dptr_t arrived = dev + offsetof(rw_page_head_t, word[RW_PW_ARRIVED]);
	const rw_cuda_dptr_t done = dev + offsetof(rw_page_head_t, word[RW_PW_DONE]);
	atomic_store(&pg->word[RW_PW_SUBMIT].v, 3);
	atomic_store(&pg->word[RW_PW_PLAN].v, 2);
	atomic_store(&pg->word[RW_PW_ARRIVED].v, 2);
	const uint64_t ks[] = { 3, 7 };
	for (unsigned i = 0; i < 2; i++) {
		assert_int_equal(rw_cuda_word_wait(&e, plan, ks[i]), RW_OK);
		assert_int_equal(rw_cuda_word_wait(&e, arrived, ks[i]), RW_OK);
		assert_int_equal(rw_cuda_word_write(&e, done, ks[i]), RW_OK);
	}
	usleep(20000);
	assert_int_equal(atomic_load(&pg->word[RW_PW_DONE].v), 0); /* held */
	rw_page_daemon_lost(pg, RW_E_CLOSED);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(atomic_load(&pg->word[RW_PW_DONE].v), 7);
	assert_int_equal(atomic_load(&pg->word[RW_PW_PLAN].v), 3 + RW_PAGE_OWED_AHEAD);
	for (unsigned d = 0; d < RW_PAGE_DEPTH; d++)
		assert_int_equal((int32_t)atomic_load(&pg->status[d].v), RW_E_CLOSED);
	/* a wait queued after the loss passes too */
	assert_int_equal(rw_cuda_word_wait(&e, plan, 100), RW_OK);
	assert_int_equal(rw_cuda_word_write(&e, done, 100), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(atomic_load(&pg->word[RW_PW_DONE].v), 100);
	rw_cuda_stream_destroy(s);
	rw_cuda_host_unregister(pg);
	munmap(pg, l.bytes);
}

int main(int argc, char **argv)
{
	(void)argc;
	rw_test_use_fake_cuda(argv[0]);
	rw_log_set_level(RW_LOG_WARN);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_layout_properties),
		cmocka_unit_test(test_word_step),
		cmocka_unit_test(test_submit_check),
		cmocka_unit_test(test_plan_find),
		cmocka_unit_test(test_fail_owes_words_forward_only),
		cmocka_unit_test(test_daemon_lost_releases_the_stream),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	rw_cuda_shutdown();
	return rc;
}
