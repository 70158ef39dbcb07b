/* tests/cuda/words_contract.c: the words' contract (tests/cuda/words_contract.h). The words live
 * where the rank page puts them: a shared memfd mapping page-locked with
 * rw_cuda_host_register_mapped; the "daemon" is this process's CPU, storing and loading them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifdef RW_MINI_CMOCKA
#include "tests/cuda/mini_cmocka.h"
#else
#include <cmocka.h>
#endif

#include "cuda/rw_cuda.h"
#include "tests/cuda/words_contract.h"

#define PAGE_BYTES 4096
#define LINE 64 /* one word per cache line, as the rank page lays them out */

struct page {
	uint8_t *host;
	rw_cuda_dptr_t dev;
	int fd;
};

static void page_map(struct page *pg)
{
	pg->fd = memfd_create("rw-words-test", MFD_CLOEXEC);
	assert_true(pg->fd >= 0);
	assert_int_equal(ftruncate(pg->fd, PAGE_BYTES), 0);
	pg->host = mmap(NULL, PAGE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, pg->fd, 0);
	assert_true(pg->host != MAP_FAILED);
	assert_int_equal(rw_cuda_host_register_mapped(pg->host, PAGE_BYTES, &pg->dev), RW_OK);
}

static void page_unmap(struct page *pg)
{
	rw_cuda_host_unregister(pg->host);
	munmap(pg->host, PAGE_BYTES);
	close(pg->fd);
}

static _Atomic uint64_t *word(const struct page *pg, unsigned i)
{
	return (_Atomic uint64_t *)(void *)(pg->host + (size_t)i * LINE);
}

static rw_cuda_dptr_t word_dev(const struct page *pg, unsigned i)
{
	return pg->dev + (rw_cuda_dptr_t)i * LINE;
}

/* A page and one stream, seen as a caller's. */
struct rig {
	struct page pg;
	rw_cuda_stream_t *a;
	rw_cuda_ext_stream_t ea;
};

static void rig_up(struct rig *r)
{
	page_map(&r->pg);
	assert_int_equal(rw_cuda_stream_create(0, &r->a), RW_OK);
	assert_int_equal(rw_cuda_ext_stream_of(r->a, &r->ea), RW_OK);
}

static void rig_down(struct rig *r)
{
	assert_int_equal(rw_cuda_stream_sync(r->a), RW_OK);
	rw_cuda_stream_destroy(r->a);
	page_unmap(&r->pg);
}

/* Wait (bounded: 10 s, so a broken driver fails the case instead of hanging it) until the word
 * reads `want`; the verdict is the value, never the time it took. */
static uint64_t settle(_Atomic uint64_t *w, uint64_t want)
{
	const struct timespec tick = { 0, 100000 };
	uint64_t v = atomic_load_explicit(w, memory_order_acquire);
	for (int i = 0; i < 100000 && v != want; i++) {
		nanosleep(&tick, NULL);
		v = atomic_load_explicit(w, memory_order_acquire);
	}
	return v;
}

static void pause_ms(long ms)
{
	const struct timespec t = { ms / 1000, (ms % 1000) * 1000000L };
	nanosleep(&t, NULL);
}

/* A wait returns at once and holds the later work of its own stream only: a write behind it
 * lands only after a CPU store satisfies it, while another stream runs on. */
void rw_words_case_wait_holds_its_stream_only(void)
{
	struct rig r;
	rw_cuda_stream_t *b;
	rw_cuda_ext_stream_t eb;
	assert_int_equal(rw_cuda_words_supported(0), 1);
	rig_up(&r);
	const struct page *pg = &r.pg;
	assert_int_equal(rw_cuda_stream_create(0, &b), RW_OK);
	assert_int_equal(rw_cuda_ext_stream_of(b, &eb), RW_OK);

	/* stream A: wait plan >= 1, then packed = 7 (as a rank's stream between two hand-offs) */
	assert_int_equal(rw_cuda_word_wait(&r.ea, word_dev(pg, 0), 1), RW_OK);
	assert_int_equal(rw_cuda_word_write(&r.ea, word_dev(pg, 1), 7), RW_OK);
	/* stream B is not held by A's wait */
	assert_int_equal(rw_cuda_word_write(&eb, word_dev(pg, 2), 9), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(b), RW_OK);
	assert_int_equal(atomic_load(word(pg, 2)), 9);
	pause_ms(50); /* time for a wrong implementation to let A's write through */
	assert_int_equal(atomic_load(word(pg, 1)), 0);

	/* the "daemon" publishes plan = 1 with a CPU store: A's write follows */
	atomic_store_explicit(word(pg, 0), 1, memory_order_release);
	assert_int_equal(settle(word(pg, 1), 7), 7);
	assert_int_equal(rw_cuda_stream_sync(r.a), RW_OK);

	/* a wait already satisfied holds nothing */
	assert_int_equal(rw_cuda_word_wait(&r.ea, word_dev(pg, 0), 1), RW_OK);
	assert_int_equal(rw_cuda_word_write(&r.ea, word_dev(pg, 1), 8), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(r.a), RW_OK);
	assert_int_equal(atomic_load(word(pg, 1)), 8);

	rw_cuda_stream_destroy(b);
	rig_down(&r);
}

/* GEQ is cyclic on 64 bits: a value "ahead" by less than 2^63 passes; and the owed-word rule of
 * a daemon loss (docs/rankpath.md "Failure": every wait passes once the word is k + 2^62). */
void rw_words_case_cyclic_geq_and_owed_words(void)
{
	struct rig r;
	rig_up(&r);
	const struct page *pg = &r.pg;

	/* 1 is "after" UINT64_MAX cyclically: no hold */
	atomic_store(word(pg, 0), 1);
	assert_int_equal(rw_cuda_word_wait(&r.ea, word_dev(pg, 0), UINT64_MAX), RW_OK);
	assert_int_equal(rw_cuda_word_write(&r.ea, word_dev(pg, 1), 1), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(r.a), RW_OK);
	assert_int_equal(atomic_load(word(pg, 1)), 1);

	/* waits for phases 3, 4 and 5 queued while the word is at 2 (the daemon died at phase 2):
	 * the rank's CPU writes 2 + 2^62 and every one passes */
	atomic_store(word(pg, 0), 2);
	for (uint64_t k = 3; k <= 5; k++) {
		assert_int_equal(rw_cuda_word_wait(&r.ea, word_dev(pg, 0), k), RW_OK);
		assert_int_equal(rw_cuda_word_write(&r.ea, word_dev(pg, 1), k), RW_OK);
	}
	pause_ms(50);
	assert_int_equal(atomic_load(word(pg, 1)), 1);
	atomic_store_explicit(word(pg, 0), 2 + (UINT64_C(1) << 62), memory_order_release);
	assert_int_equal(settle(word(pg, 1), 5), 5);
	rig_down(&r);
}

/* Refused at the call, nothing enqueued: address 0 and a word not 8-byte aligned. */
void rw_words_case_bad_addresses(void)
{
	struct rig r;
	rig_up(&r);
	const struct page *pg = &r.pg;
	assert_int_equal(rw_cuda_word_write(&r.ea, 0, 1), RW_ERR_INVAL);
	assert_int_equal(rw_cuda_word_wait(&r.ea, 0, 1), RW_ERR_INVAL);
	assert_int_equal(rw_cuda_word_write(&r.ea, word_dev(pg, 0) + 4, 1), RW_ERR_INVAL);
	assert_int_equal(rw_cuda_word_wait(&r.ea, word_dev(pg, 0) + 4, 1), RW_ERR_INVAL);
	assert_int_equal(rw_cuda_stream_sync(r.a), RW_OK);
	assert_int_equal(atomic_load(word(pg, 0)), 0);
	rig_down(&r);
}
