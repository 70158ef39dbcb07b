/* tests/cuda/test_cuda_fake.c: the IPC import cache, streams and driver loading of cuda/, run
 * against tests/cuda/fake_libcuda.c (loaded through $RW_CUDA_DRIVER), so they run in CI with no
 * GPU. The fake reuses handle bytes after a free, the worst case for the cache. */
#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "cuda/rw_cuda.h"
#include "tests/cuda/vmm_contract.h"
#include "tests/cuda/words_contract.h"

#if RW_HAVE_CUDA_H
static char fake_path[PATH_MAX];
static void (*fake_hold)(int);
static int (*fake_ctx_refs)(void);
static int (*fake_live_blocks)(void);

static int setup(void **state)
{
	void *h;

	(void)state;
	if (rw_cuda_init() != RW_OK) {
		fprintf(stderr, "fake driver did not load: %s\n", rw_cuda_unavailable_reason());
		return -1;
	}
	h = dlopen(fake_path, RTLD_NOW | RTLD_NOLOAD);
	if (h == NULL)
		return -1;
	fake_hold = (void (*)(int))dlsym(h, "rw_fake_cuda_hold");
	fake_ctx_refs = (int (*)(void))dlsym(h, "rw_fake_cuda_ctx_refs");
	fake_live_blocks = (int (*)(void))dlsym(h, "rw_fake_cuda_live_blocks");
	dlclose(h); /* drops the NOLOAD reference only */
	return fake_hold && fake_ctx_refs && fake_live_blocks ? 0 : -1;
}

static int teardown(void **state)
{
	(void)state;
	rw_cuda_shutdown();
	return 0;
}

/* Importers as the daemon names them: connection `conn` of process (pid, start time). PROC(n) is
 * connection n of a process of its own; CONN(n, p, t) connection n of process p started at t. */
#define CONN(n, p, t) (&(rw_cuda_ipc_owner_t){ .conn = (n), .pid = (p), .start_time = (t) })
#define PROC(n) CONN(n, 1000 + (n), 5000)

/* Allocate `bytes` on the fake device and fill it with `seed`-derived bytes. */
static rw_cuda_dptr_t alloc_filled(size_t bytes, uint8_t seed)
{
	rw_cuda_dptr_t d = 0;
	uint8_t *buf = malloc(bytes);

	assert_non_null(buf);
	for (size_t i = 0; i < bytes; i++)
		buf[i] = (uint8_t)(seed + i * 7);
	assert_int_equal(rw_cuda_mem_alloc(0, bytes, &d), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d, buf, bytes), RW_OK);
	free(buf);
	return d;
}

static void assert_reads(rw_cuda_dptr_t d, size_t bytes, uint8_t seed)
{
	uint8_t *buf = malloc(bytes);

	assert_non_null(buf);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, buf, d, bytes), RW_OK);
	for (size_t i = 0; i < bytes; i++)
		assert_int_equal(buf[i], (uint8_t)(seed + i * 7));
	free(buf);
}

static void test_devices(void **state)
{
	uint8_t uuid[16];
	char name[64];
	int dev = -1;

	(void)state;
	assert_int_equal(rw_cuda_device_count(), 1);
	assert_string_equal(rw_cuda_unavailable_reason(), "");
	assert_int_equal(rw_cuda_device_name(0, name, sizeof(name)), RW_OK);
	assert_string_equal(name, "RailWave fake GPU");
	assert_int_equal(rw_cuda_device_uuid(0, uuid), RW_OK);
	assert_int_equal(rw_cuda_device_by_uuid(uuid, &dev), RW_OK);
	assert_int_equal(dev, 0);
	uuid[0] ^= 1;
	assert_int_equal(rw_cuda_device_by_uuid(uuid, &dev), RW_ERR_NOTFOUND);
	assert_int_equal(rw_cuda_device_uuid(1, uuid), RW_ERR_INVAL);
}

static void test_export_describes_range(void **state)
{
	rw_cuda_dptr_t d = alloc_filled(4096, 1);
	rw_cuda_ipc_desc_t desc, desc2;
	uint8_t uuid[16];

	(void)state;
	assert_int_equal(rw_cuda_ipc_export(d + 256, 1024, &desc), RW_OK);
	assert_int_equal(desc.offset, 256);
	assert_int_equal(desc.bytes, 1024);
	assert_int_equal(desc.alloc_bytes, 4096);
	assert_int_not_equal(desc.buffer_id, 0);
	assert_int_equal(rw_cuda_device_uuid(0, uuid), RW_OK);
	assert_memory_equal(desc.device_uuid, uuid, 16);
	/* past the end of the allocation, or empty: refused */
	assert_int_equal(rw_cuda_ipc_export(d + 4000, 200, &desc2), RW_ERR_INVAL);
	assert_int_equal(rw_cuda_ipc_export(d, 0, &desc2), RW_ERR_INVAL);
	rw_cuda_mem_free(0, d);
}

static void test_import_hit_refcount_and_close(void **state)
{
	rw_cuda_dptr_t d = alloc_filled(8192, 3), p1 = 0, p2 = 0, p3 = 0;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m1, *m2, *m3;
	rw_cuda_ipc_desc_t desc, half;
	rw_cuda_ipc_stats_t st;

	(void)state;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(d, 8192, &desc), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, PROC(7), &m1, &p1), RW_OK);
	assert_reads(p1, 8192, 3);
	/* same allocation again (another range of it): the same mapping, one more reference */
	assert_int_equal(rw_cuda_ipc_export(d + 4096, 4096, &half), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &half, PROC(7), &m2, &p2), RW_OK);
	assert_ptr_equal(m1, m2);
	assert_int_equal(p2, p1 + 4096);
	assert_int_equal(rw_cuda_ipc_map_refs(m1), 2);
	assert_int_equal(rw_cuda_ipc_map_bytes(m1), 8192);
	assert_int_equal(rw_cuda_ipc_map_device(m1), 0);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.opens, 1);
	assert_int_equal(st.hits, 1);
	assert_int_equal(st.live, 1);
	rw_cuda_ipc_release(cache, m2, 7);
	assert_int_equal(rw_cuda_ipc_map_refs(m1), 1);
	rw_cuda_ipc_release(cache, m1, 7); /* last reference: closed */
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.closes, 1);
	assert_int_equal(st.live, 0);
	/* after release: a miss that opens again */
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, PROC(7), &m3, &p3), RW_OK);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.opens, 2);
	assert_int_equal(st.hits, 1);
	assert_reads(p3, 8192, 3);
	rw_cuda_ipc_release(cache, m3, 7);
	rw_cuda_ipc_cache_destroy(cache);
	rw_cuda_mem_free(0, d);
}

/* The exporter frees a buffer that the daemon still maps and allocates a new one that gets the
 * same handle bytes. The driver would return the old mapping: the cache must refuse, and serve
 * the new buffer once the old registration is released. */
static void test_freed_and_reallocated_not_stale(void **state)
{
	rw_cuda_dptr_t d1 = alloc_filled(4096, 10), d2, p1 = 0, p2 = 0;
	rw_cuda_ipc_desc_t desc1, desc2;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m1, *m2 = NULL;
	rw_cuda_ipc_stats_t st;

	(void)state;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(d1, 4096, &desc1), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc1, PROC(7), &m1, &p1), RW_OK);
	rw_cuda_mem_free(0, d1); /* the client frees without deregistering */
	d2 = alloc_filled(4096, 99);
	assert_int_equal(rw_cuda_ipc_export(d2, 4096, &desc2), RW_OK);
	/* the scenario: identical handle bytes, a different allocation */
	assert_memory_equal(desc1.handle.bytes, desc2.handle.bytes, RW_CUDA_IPC_HANDLE_BYTES);
	assert_int_not_equal(desc1.buffer_id, desc2.buffer_id);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc2, PROC(7), &m2, &p2), RW_ERR_EXISTS);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.refused_stale, 1);
	assert_int_equal(st.live, 1);
	assert_reads(p1, 4096, 10); /* the old registration still sees its own memory */
	rw_cuda_ipc_release(cache, m1, 7);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc2, PROC(7), &m2, &p2), RW_OK);
	assert_reads(p2, 4096, 99);
	/* and the stale descriptor no longer hits: its buffer id is not the mapping's */
	rw_cuda_ipc_release(cache, m2, 7);
	rw_cuda_ipc_cache_destroy(cache);
	rw_cuda_mem_free(0, d2);
}

static void test_reallocated_after_release_is_fresh(void **state)
{
	rw_cuda_dptr_t d1 = alloc_filled(2048, 5), d2, p = 0;
	rw_cuda_ipc_desc_t desc1, desc2;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m;
	rw_cuda_ipc_stats_t st;

	(void)state;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(d1, 2048, &desc1), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc1, PROC(1), &m, &p), RW_OK);
	rw_cuda_ipc_release(cache, m, 1);
	rw_cuda_mem_free(0, d1);
	d2 = alloc_filled(2048, 77);
	assert_int_equal(rw_cuda_ipc_export(d2, 2048, &desc2), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc2, PROC(1), &m, &p), RW_OK);
	assert_reads(p, 2048, 77);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.hits, 0);
	assert_int_equal(st.opens, 2);
	rw_cuda_ipc_release(cache, m, 1);
	rw_cuda_ipc_cache_destroy(cache);
	rw_cuda_mem_free(0, d2);
}

static void test_import_rejects_bad_descriptors(void **state)
{
	rw_cuda_dptr_t d = alloc_filled(4096, 2), p = 0;
	rw_cuda_ipc_desc_t desc, bad;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m = NULL;
	rw_cuda_ipc_stats_t st;

	(void)state;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(d, 4096, &desc), RW_OK);
	bad = desc;
	bad.bytes = 0;
	assert_int_equal(rw_cuda_ipc_import(cache, &bad, PROC(1), &m, &p), RW_ERR_INVAL);
	bad = desc;
	bad.offset = 1;
	assert_int_equal(rw_cuda_ipc_import(cache, &bad, PROC(1), &m, &p), RW_ERR_INVAL);
	bad = desc;
	bad.offset = UINT64_MAX - 10;
	bad.bytes = 100;
	assert_int_equal(rw_cuda_ipc_import(cache, &bad, PROC(1), &m, &p), RW_ERR_INVAL);
	/* a client claiming a larger allocation than the driver maps */
	bad = desc;
	bad.alloc_bytes = 1 << 20;
	bad.bytes = 8192;
	assert_int_equal(rw_cuda_ipc_import(cache, &bad, PROC(1), &m, &p), RW_ERR_INVAL);
	bad = desc;
	bad.device_uuid[3] ^= 0xff;
	assert_int_equal(rw_cuda_ipc_import(cache, &bad, PROC(1), &m, &p), RW_ERR_NOTFOUND);
	bad = desc;
	memcpy(bad.handle.bytes, "garbage", 7);
	assert_int_equal(rw_cuda_ipc_import(cache, &bad, PROC(1), &m, &p), RW_ERR_CLIENT);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.live, 0);
	/* a hit that lies about the allocation size is refused too */
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, PROC(1), &m, &p), RW_OK);
	bad = desc;
	bad.alloc_bytes = 8192;
	assert_int_equal(rw_cuda_ipc_import(cache, &bad, PROC(1), &m, &p), RW_ERR_INVAL);
	assert_int_equal(rw_cuda_ipc_map_refs(m), 1);
	rw_cuda_ipc_release(cache, m, 1);
	rw_cuda_ipc_cache_destroy(cache);
	rw_cuda_mem_free(0, d);
}

static void test_owners_are_separate(void **state)
{
	rw_cuda_dptr_t a = alloc_filled(4096, 1), b = alloc_filled(4096, 2), p = 0;
	rw_cuda_ipc_desc_t da, db;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m1, *m2, *m3, *mx = NULL;
	rw_cuda_ipc_stats_t st;

	(void)state;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(a, 4096, &da), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(b, 4096, &db), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &da, PROC(7), &m1, &p), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &da, PROC(7), &m2, &p), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &db, PROC(8), &m3, &p), RW_OK);
	/* another owner presenting owner 7's live handle is not given owner 7's mapping */
	assert_int_equal(rw_cuda_ipc_import(cache, &da, PROC(8), &mx, &p), RW_ERR_EXISTS);
	assert_int_equal(rw_cuda_ipc_release_owner(cache, 7), 2);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.live, 1);
	assert_int_equal(rw_cuda_ipc_map_refs(m3), 1);
	assert_int_equal(rw_cuda_ipc_release_owner(cache, 7), 0);
	(void)m1;
	(void)m2;
	/* destroy closes what owner 8 still holds */
	rw_cuda_ipc_cache_destroy(cache);
	rw_cuda_mem_free(0, a);
	rw_cuda_mem_free(0, b);
	assert_int_equal(fake_live_blocks(), 0);
}

/* Two connections of one process (two Groups of a trainer) register the same allocation: one
 * mapping, references counted per connection; one connection leaving keeps the other's working;
 * the last reference of the last connection closes it. Before the fix the second connection was
 * refused as stale (RW_ERR_EXISTS). */
static void test_connections_of_one_process_share(void **state)
{
	rw_cuda_dptr_t d = alloc_filled(8192, 21), p1 = 0, p2 = 0, p3 = 0;
	rw_cuda_ipc_desc_t desc, tail;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m1, *m2, *m3;
	rw_cuda_ipc_stats_t st;

	(void)state;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(d, 8192, &desc), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(d + 4096, 4096, &tail), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, CONN(1, 300, 77), &m1, &p1), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &tail, CONN(1, 300, 77), &m2, &p2), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, CONN(2, 300, 77), &m3, &p3), RW_OK);
	assert_ptr_equal(m1, m3);
	assert_ptr_equal(m2, m3);
	assert_int_equal(p3, p1);
	assert_int_equal(p2, p1 + 4096);
	assert_int_equal(rw_cuda_ipc_map_refs(m1), 3);
	assert_int_equal(rw_cuda_ipc_map_users(m1), 2);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.opens, 1);
	assert_int_equal(st.hits, 2);
	assert_int_equal(st.shared, 1);
	assert_int_equal(st.refused_stale, 0);
	/* a release by a connection that holds nothing is ignored */
	rw_cuda_ipc_release(cache, m1, 9);
	assert_int_equal(rw_cuda_ipc_map_refs(m1), 3);
	/* connection 1 leaves: its two references go, connection 2's mapping stays and reads */
	assert_int_equal(rw_cuda_ipc_release_owner(cache, 1), 2);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.live, 1);
	assert_int_equal(st.closes, 0);
	assert_int_equal(rw_cuda_ipc_map_refs(m3), 1);
	assert_int_equal(rw_cuda_ipc_map_users(m3), 1);
	assert_reads(p3, 8192, 21);
	/* a third connection of the process joins the survivor, then both go one by one */
	assert_int_equal(rw_cuda_ipc_import(cache, &tail, CONN(3, 300, 77), &m2, &p2), RW_OK);
	assert_ptr_equal(m2, m3);
	rw_cuda_ipc_release(cache, m3, 2);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.live, 1);
	assert_reads(p2, 4096, (uint8_t)(21 + 4096 * 7));
	rw_cuda_ipc_release(cache, m2, 3); /* the last user: closed */
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.live, 0);
	assert_int_equal(st.closes, 1);
	assert_int_equal(rw_cuda_ipc_release_owner(cache, 2), 0);
	rw_cuda_ipc_cache_destroy(cache);
	rw_cuda_mem_free(0, d);
	assert_int_equal(fake_live_blocks(), 0); /* every driver open was closed */
}

/* The handle bytes of a mapping presented by another process — a different pid, the same pid
 * reused by a process that started later, or a connection whose process is unknown — are
 * refused, and the driver's extra reference is undone. Within the process, a freed and
 * reallocated buffer with the same handle bytes is refused from another connection too. */
static void test_other_process_refused(void **state)
{
	rw_cuda_dptr_t d = alloc_filled(4096, 40), d2, p = 0, px = 0;
	rw_cuda_ipc_desc_t desc, desc2;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m, *mx = NULL;
	rw_cuda_ipc_stats_t st;

	(void)state;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(d, 4096, &desc), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, CONN(1, 300, 77), &m, &p), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, CONN(2, 301, 77), &mx, &px), RW_ERR_EXISTS);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, CONN(3, 300, 78), &mx, &px), RW_ERR_EXISTS);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, CONN(4, 300, 0), &mx, &px), RW_ERR_EXISTS);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, CONN(5, 0, 77), &mx, &px), RW_ERR_EXISTS);
	assert_null(mx);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.refused_stale, 4);
	assert_int_equal(st.live, 1);
	assert_int_equal(rw_cuda_ipc_map_refs(m), 1);
	assert_int_equal(rw_cuda_ipc_map_users(m), 1);
	/* the process frees the buffer without deregistering; a new one gets the same bytes */
	rw_cuda_mem_free(0, d);
	d2 = alloc_filled(4096, 41);
	assert_int_equal(rw_cuda_ipc_export(d2, 4096, &desc2), RW_OK);
	assert_memory_equal(desc.handle.bytes, desc2.handle.bytes, RW_CUDA_IPC_HANDLE_BYTES);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc2, CONN(6, 300, 77), &mx, &px), RW_ERR_EXISTS);
	assert_reads(p, 4096, 40); /* connection 1 still sees its own memory */
	/* once the old registration's last user leaves, the new buffer imports cleanly */
	assert_int_equal(rw_cuda_ipc_release_owner(cache, 1), 1);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc2, CONN(6, 300, 77), &mx, &px), RW_OK);
	assert_reads(px, 4096, 41);
	rw_cuda_ipc_release(cache, mx, 6);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.live, 0);
	rw_cuda_ipc_cache_destroy(cache);
	rw_cuda_mem_free(0, d2);
	assert_int_equal(fake_live_blocks(), 0);
}

/* A driver that gives one allocation different handle bytes on different exports still returns
 * the existing address on open: the same process and buffer id share that mapping. */
static void test_same_allocation_other_bytes_shares(void **state)
{
	rw_cuda_dptr_t d = alloc_filled(4096, 50), p1 = 0, p2 = 0;
	rw_cuda_ipc_desc_t desc, other;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m1, *m2 = NULL;
	rw_cuda_ipc_stats_t st;

	(void)state;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_export(d, 4096, &desc), RW_OK);
	other = desc;
	other.handle.bytes[40] ^= 0x5a; /* the fake reads only its magic and the slot */
	assert_int_equal(rw_cuda_ipc_import(cache, &desc, CONN(1, 300, 77), &m1, &p1), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &other, CONN(2, 300, 77), &m2, &p2), RW_OK);
	assert_ptr_equal(m1, m2);
	assert_int_equal(p1, p2);
	/* ... but another buffer id behind that address is stale */
	other.buffer_id++;
	other.handle.bytes[41] ^= 0x5a;
	assert_int_equal(rw_cuda_ipc_import(cache, &other, CONN(2, 300, 77), &m2, &p2), RW_ERR_EXISTS);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.opens, 1);
	assert_int_equal(st.hits, 1);
	assert_int_equal(st.refused_stale, 1);
	assert_int_equal(rw_cuda_ipc_release_owner(cache, 1), 1);
	assert_reads(p2, 4096, 50);
	assert_int_equal(rw_cuda_ipc_release_owner(cache, 2), 1);
	rw_cuda_ipc_cache_destroy(cache);
	rw_cuda_mem_free(0, d);
	assert_int_equal(fake_live_blocks(), 0);
}

static int fd_readable(int fd)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	return poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

static void test_stream_marks_in_order_and_wake_fd(void **state)
{
	rw_cuda_stream_t *s;
	uint64_t tok[8];
	uint8_t *host;
	rw_cuda_dptr_t d = alloc_filled(256, 4);

	(void)state;
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_host_alloc(256, (void **)&host), RW_OK);
	assert_true(rw_cuda_stream_fd(s) >= 0);
	assert_int_equal(rw_cuda_stream_device(s), 0);
	fake_hold(1);
	assert_int_equal(rw_cuda_copy_dtoh_async(s, host, d, 256), RW_OK);
	for (uint64_t t = 1; t <= 3; t++)
		assert_int_equal(rw_cuda_stream_mark(s, t * 100), RW_OK);
	assert_false(fd_readable(rw_cuda_stream_fd(s)));
	assert_int_equal(rw_cuda_stream_poll(s, tok, 8), 0);
	fake_hold(0); /* the "GPU" reaches the marks */
	assert_true(fd_readable(rw_cuda_stream_fd(s)));
	assert_int_equal(rw_cuda_stream_poll(s, tok, 2), 2);
	assert_int_equal(tok[0], 100);
	assert_int_equal(tok[1], 200);
	assert_int_equal(rw_cuda_stream_poll(s, tok, 8), 1);
	assert_int_equal(tok[0], 300);
	assert_false(fd_readable(rw_cuda_stream_fd(s)));
	assert_int_equal(rw_cuda_stream_poll(s, tok, 8), 0);
	for (int i = 0; i < 256; i++)
		assert_int_equal(host[i], (uint8_t)(4 + i * 7));
	rw_cuda_host_free(host);
	rw_cuda_stream_destroy(s);
	rw_cuda_mem_free(0, d);
}

static void test_stream_mark_queue_bounded(void **state)
{
	rw_cuda_stream_t *s;
	uint64_t tok[64];
	uint64_t next = 0;
	int n;

	(void)state;
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	fake_hold(1);
	for (int i = 0; i < 60; i++) /* the fake queues 64 host functions at most */
		assert_int_equal(rw_cuda_stream_mark(s, (uint64_t)i), RW_OK);
	fake_hold(0);
	while ((n = rw_cuda_stream_poll(s, tok, 7)) > 0)
		for (int i = 0; i < n; i++)
			assert_int_equal(tok[i], next++);
	assert_int_equal(next, 60);
	/* marks never completed block new ones only at RW_CUDA_STREAM_MAX_MARKS outstanding */
	for (int i = 0; i < RW_CUDA_STREAM_MAX_MARKS; i++)
		assert_int_equal(rw_cuda_stream_mark(s, (uint64_t)i), RW_OK);
	for (int i = 0; i < RW_CUDA_STREAM_MAX_MARKS; i++)
		assert_int_equal(rw_cuda_stream_poll(s, tok, 1), 1);
	fake_hold(1);
	for (int i = 0; i < 64; i++)
		assert_int_equal(rw_cuda_stream_mark(s, (uint64_t)i), RW_OK);
	fake_hold(0);
	next = 0;
	while ((n = rw_cuda_stream_poll(s, tok, 64)) > 0)
		next += (uint64_t)n;
	assert_int_equal(next, 64);
	rw_cuda_stream_destroy(s);
}

static void test_stream_mark_again_when_full(void **state)
{
	rw_cuda_stream_t *s;
	uint64_t tok[RW_CUDA_STREAM_MAX_MARKS];

	(void)state;
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	/* completed but not yet polled marks count as outstanding */
	for (int i = 0; i < RW_CUDA_STREAM_MAX_MARKS; i++)
		assert_int_equal(rw_cuda_stream_mark(s, (uint64_t)i), RW_OK);
	assert_int_equal(rw_cuda_stream_mark(s, 9999), RW_ERR_AGAIN);
	assert_int_equal(rw_cuda_stream_poll(s, tok, RW_CUDA_STREAM_MAX_MARKS), RW_CUDA_STREAM_MAX_MARKS);
	assert_int_equal(tok[RW_CUDA_STREAM_MAX_MARKS - 1], RW_CUDA_STREAM_MAX_MARKS - 1);
	assert_int_equal(rw_cuda_stream_mark(s, 9999), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(rw_cuda_stream_poll(s, tok, 4), 1);
	assert_int_equal(tok[0], 9999);
	rw_cuda_stream_destroy(s);
}

static void test_dmabuf_and_kernels_report_unsupported(void **state)
{
	rw_cuda_dptr_t d = alloc_filled(8192, 0);
	int fd = -1;

	(void)state;
	assert_int_equal(rw_cuda_dmabuf_supported(0), 0);
	assert_int_equal(rw_cuda_dmabuf_export(0, d, 4096, &fd), RW_ERR_UNSUPPORTED);
	assert_int_equal(fd, -1);
	/* the fake has no module API: kernels absent, launches refused */
	assert_int_equal(rw_cuda_kernels_available(0), 0);
	rw_cuda_mem_free(0, d);
}

/* The rank kernels' wrappers: a block the kernels could not run is refused before any launch
 * (RW_ERR_INVAL), a good one reaches the launch, which this fake (no module API) cannot do. */
static void test_rank_kernels_check_their_blocks(void **state)
{
	rw_cuda_dptr_t d = alloc_filled(1 << 16, 0);
	rw_cuda_ext_stream_t s = { .device = 0, .handle = 0 };
	rw_cuda_rank_pack_t p = {
		.x = d, .ids = d + 4096, .weights = d + 8192, .entry = d + 12288, .tags = d + 16384,
		.scratch = d + 20480, .err = d + 24576, .n_tokens = 4, .topk = 2, .hidden = 8,
		.dtype = RW_CUDA_BF16, .n_experts = 8, .nodes = 2, .rails = 2, .me = 0, .owner = 1,
	};
	rw_cuda_rank_forward_t f = {
		.list = d, .list_n = d + 4096, .rows = d + 12288, .meta = d + 16384,
		.counts = d + 20480, .recv_n = d + 24576, .overflow = d + 24580, .err = d + 24584,
		.cap = 4, .topk = 2, .hidden = 8, .dtype = RW_CUDA_FP32, .n_experts = 8, .nodes = 2,
		.gpus = 2, .rails = 2, .me = 1, .g = 1,
	};
	rw_cuda_rank_gather_t g = {
		.list = d, .list_n = d + 4096, .entry = d + 8192, .tags = d + 12288, .err = d + 16384,
		.cap = 4, .hidden = 8, .dtype = RW_CUDA_BF16, .nodes = 2, .rails = 2, .me = 1, .g = 0,
	};
	rw_cuda_rank_reduce_t r = {
		.list = d, .list_n = d + 4096, .out = d + 8192, .err = d + 16384, .cap = 4,
		.n_tokens = 3, .hidden = 8, .dtype = RW_CUDA_FP32, .rails = 2,
	};

	(void)state;
	assert_int_equal(rw_cuda_rank_kernels_available(0), 0);
	assert_int_equal(rw_cuda_rank_pack_scratch(4, 2), 4 * 2 * RW_CUDA_RANK_PACK_SLOT);
	for (uint32_t i = 0; i < 2; i++) {
		p.slab[i] = g.slab[i] = d + 32768 + 4096 * i;
		f.area[RW_CUDA_AREA_RECV][i] = r.area[RW_CUDA_AREA_RECV][i] = d + 32768 + 4096 * i;
	}
	g.rows[0] = d + 40960;
	assert_int_equal(rw_cuda_rank_pack(&s, &p), RW_ERR_UNSUPPORTED);
	assert_int_equal(rw_cuda_rank_forward(&s, &f), RW_ERR_UNSUPPORTED);
	assert_int_equal(rw_cuda_rank_gather(&s, &g), RW_ERR_UNSUPPORTED);
	assert_int_equal(rw_cuda_rank_reduce(&s, &r), RW_ERR_UNSUPPORTED);

	rw_cuda_rank_pack_t bp = p;
	bp.slab[1] = 0; /* a rail without its slab */
	assert_int_equal(rw_cuda_rank_pack(&s, &bp), RW_ERR_INVAL);
	bp = p;
	bp.slab[1] += 8; /* a slab not 16-byte aligned */
	assert_int_equal(rw_cuda_rank_pack(&s, &bp), RW_ERR_INVAL);
	bp = p;
	bp.n_experts = 9; /* not a multiple of the nodes */
	assert_int_equal(rw_cuda_rank_pack(&s, &bp), RW_ERR_INVAL);
	bp = p;
	bp.topk = 33;
	assert_int_equal(rw_cuda_rank_pack(&s, &bp), RW_ERR_INVAL);
	bp = p;
	bp.ids_int64 = 1;
	bp.ids = d + 4100; /* int64 ids 4-byte aligned only */
	assert_int_equal(rw_cuda_rank_pack(&s, &bp), RW_ERR_INVAL);

	rw_cuda_rank_forward_t bf = f;
	bf.g = 2; /* not a local rank */
	assert_int_equal(rw_cuda_rank_forward(&s, &bf), RW_ERR_INVAL);
	bf = f;
	bf.list_n = 0; /* the list's length must be readable */
	assert_int_equal(rw_cuda_rank_forward(&s, &bf), RW_ERR_INVAL);
	bf = f;
	bf.n_experts = 6; /* not a multiple of the world */
	assert_int_equal(rw_cuda_rank_forward(&s, &bf), RW_ERR_INVAL);
	bf = f;
	bf.area[RW_CUDA_AREA_LOCAL][1] = d + 4; /* an area not 16-byte aligned */
	assert_int_equal(rw_cuda_rank_forward(&s, &bf), RW_ERR_INVAL);

	rw_cuda_rank_gather_t bg = g;
	bg.dtype = 7;
	assert_int_equal(rw_cuda_rank_gather(&s, &bg), RW_ERR_INVAL);
	bg = g;
	bg.term_off = d + 20480; /* a term list without its refs */
	assert_int_equal(rw_cuda_rank_gather(&s, &bg), RW_ERR_INVAL);
	bg = g;
	bg.rows[0] = 0; /* its own rows, the default terms */
	assert_int_equal(rw_cuda_rank_gather(&s, &bg), RW_ERR_INVAL);
	rw_cuda_rank_reduce_t br = r;
	br.out = 0;
	assert_int_equal(rw_cuda_rank_reduce(&s, &br), RW_ERR_INVAL);
	rw_cuda_mem_free(0, d);
}

/* The words' contract (tests/cuda/words_contract.c), the same cases test/cuda runs on a GPU. */
static void test_words_wait_holds_its_stream_only(void **state)
{
	(void)state;
	rw_words_case_wait_holds_its_stream_only();
}

static void test_words_cyclic_geq_and_owed_words(void **state)
{
	(void)state;
	rw_words_case_cyclic_geq_and_owed_words();
}

static void test_words_bad_addresses(void **state)
{
	(void)state;
	rw_words_case_bad_addresses();
}

/* GPU memory lent by fd (tests/cuda/vmm_contract.c), the same cases test/cuda runs on a GPU;
 * then what only the stand-in shows: nothing left mapped, a mapping faults until its access is
 * set, and each of export, import and access failing says which call failed. */
static void test_vmm_export_import_same_memory(void **state)
{
	(void)state;
	rw_vmm_case_export_import_same_memory();
}

static void test_vmm_refusals(void **state)
{
	(void)state;
	rw_vmm_case_refusals();
	void *h = dlopen(fake_path, RTLD_NOW | RTLD_NOLOAD);
	assert_non_null(h);
	int (*live)(void) = (int (*)(void))dlsym(h, "rw_fake_cuda_vmm_live");
	dlclose(h);
	assert_non_null(live);
	assert_int_equal(live(), 0); /* every mapping of both cases undone */
	char why[160];
	rw_cuda_vmm_t *v = NULL;
	const struct { const char *fail, *named; } f[] = {
		{ "export", "cuMemExportToShareableHandle" },
		{ "access", "cuMemSetAccess" },
	};
	for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++) {
		setenv("RW_FAKE_CUDA_VMM_FAIL", f[i].fail, 1);
		why[0] = 0;
		assert_int_not_equal(rw_cuda_vmm_create(0, 1, &v, why, sizeof(why)), RW_OK);
		assert_non_null(strstr(why, f[i].named));
	}
	setenv("RW_FAKE_CUDA_VMM_FAIL", "import", 1);
	assert_int_equal(rw_cuda_vmm_create(0, 1, &v, why, sizeof(why)), RW_OK);
	const int dev = 0;
	rw_cuda_vmm_t *imp = NULL;
	assert_int_not_equal(rw_cuda_vmm_import(rw_cuda_vmm_fd(v), rw_cuda_vmm_bytes(v), 0, &dev, 1,
						&imp, why, sizeof(why)), RW_OK);
	assert_non_null(strstr(why, "cuMemImportFromShareableHandle"));
	unsetenv("RW_FAKE_CUDA_VMM_FAIL");
	rw_cuda_vmm_release(v);
	assert_int_equal(live(), 0); /* the failed ones kept nothing */
	setenv("RW_FAKE_CUDA_VMM", "0", 1); /* a device without VMM: refused, named */
	assert_int_equal(rw_cuda_vmm_supported(0), 0);
	assert_int_equal(rw_cuda_vmm_create(0, 1, &v, why, sizeof(why)), RW_ERR_UNSUPPORTED);
	assert_non_null(strstr(why, "POSIX fd"));
	unsetenv("RW_FAKE_CUDA_VMM");
}

/* The header pull (tests/cuda/vmm_contract.c), then the stand-in's discrete GPU
 * ($RW_FAKE_CUDA_VMM_NOCPU=1): the CPU cannot read the mapping (the kernel says EFAULT), a mapping
 * of the exported fd (a NIC's view) writes it, and the pull reads what was written; a copy the
 * driver refuses ($RW_FAKE_CUDA_VMM_FAIL=copy) is named. */
static void test_vmm_pull_rows(void **state)
{
	(void)state;
	rw_vmm_case_pull_rows();
	setenv("RW_FAKE_CUDA_VMM_NOCPU", "1", 1);
	char why[160];
	rw_cuda_vmm_t *v = NULL;
	assert_int_equal(rw_cuda_vmm_create(0, 1, &v, why, sizeof(why)), RW_OK);
	unsetenv("RW_FAKE_CUDA_VMM_NOCPU");
	const rw_cuda_dptr_t d = rw_cuda_vmm_dptr(v);
	uint8_t b[64];
	struct iovec local = { b, sizeof(b) }, remote = { (void *)(uintptr_t)d, sizeof(b) };
	assert_int_equal(process_vm_readv(getpid(), &local, 1, &remote, 1, 0), -1);
	uint8_t *nic = mmap(NULL, rw_cuda_vmm_bytes(v), PROT_READ | PROT_WRITE, MAP_SHARED,
			    rw_cuda_vmm_fd(v), 0);
	assert_true(nic != MAP_FAILED);
	for (int i = 0; i < 256; i++)
		nic[1000 + i] = (uint8_t)(255 - i);
	uint8_t *h = NULL;
	assert_int_equal(rw_cuda_host_alloc(256, (void **)&h), RW_OK);
	rw_cuda_pull_t *p = NULL;
	uint64_t m = 0;
	assert_int_equal(rw_cuda_pull_create(0, &p), RW_OK);
	assert_int_equal(rw_cuda_pull_rows(p, h, 16, d + 1000, 32, 16, 8), RW_OK);
	assert_int_equal(rw_cuda_pull_mark(p, &m), RW_OK);
	assert_int_equal(rw_cuda_pull_landed(p), m); /* no lag: stream work runs at once */
	for (int r = 0; r < 8; r++)
		assert_memory_equal(h + 16 * r, nic + 1000 + 32 * r, 16);
	setenv("RW_FAKE_CUDA_VMM_FAIL", "copy", 1);
	assert_int_not_equal(rw_cuda_pull_rows(p, h, 16, d, 16, 16, 1), RW_OK);
	unsetenv("RW_FAKE_CUDA_VMM_FAIL");
	rw_cuda_pull_destroy(p);
	rw_cuda_host_free(h);
	munmap(nic, rw_cuda_vmm_bytes(v));
	rw_cuda_vmm_release(v);
}

/* The stand-in is stricter than a driver with HMM: a word in pageable host memory (the rank page
 * not registered) is refused, so a path that forgets cuMemHostRegister fails here; device
 * memory is taken. */
static void test_words_need_registered_memory(void **state)
{
	(void)state;
	rw_cuda_stream_t *s;
	rw_cuda_ext_stream_t e;
	uint64_t *pageable = aligned_alloc(64, 64);
	rw_cuda_dptr_t d = 0;
	assert_non_null(pageable);
	pageable[0] = 0;
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_ext_stream_of(s, &e), RW_OK);
	assert_int_equal(rw_cuda_word_write(&e, (rw_cuda_dptr_t)(uintptr_t)pageable, 3), RW_ERR_INVAL);
	assert_int_equal(rw_cuda_mem_alloc(0, 64, &d), RW_OK);
	assert_int_equal(rw_cuda_word_write(&e, d, 3), RW_OK);
	assert_int_equal(rw_cuda_word_wait(&e, d, 3), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(*(uint64_t *)(uintptr_t)d, 3);
	assert_int_equal(pageable[0], 0);
	rw_cuda_stream_destroy(s);
	rw_cuda_mem_free(0, d);
	free(pageable);
}

static void test_shutdown_releases_contexts(void **state)
{
	(void)state;
	assert_true(fake_ctx_refs() > 0);
	rw_cuda_shutdown();
	assert_int_equal(fake_ctx_refs(), 0);
	assert_int_equal(fake_live_blocks(), 0);
}

int main(int argc, char **argv)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_devices),
		cmocka_unit_test(test_export_describes_range),
		cmocka_unit_test(test_import_hit_refcount_and_close),
		cmocka_unit_test(test_freed_and_reallocated_not_stale),
		cmocka_unit_test(test_reallocated_after_release_is_fresh),
		cmocka_unit_test(test_import_rejects_bad_descriptors),
		cmocka_unit_test(test_owners_are_separate),
		cmocka_unit_test(test_connections_of_one_process_share),
		cmocka_unit_test(test_other_process_refused),
		cmocka_unit_test(test_same_allocation_other_bytes_shares),
		cmocka_unit_test(test_stream_marks_in_order_and_wake_fd),
		cmocka_unit_test(test_stream_mark_queue_bounded),
		cmocka_unit_test(test_stream_mark_again_when_full),
		cmocka_unit_test(test_dmabuf_and_kernels_report_unsupported),
		cmocka_unit_test(test_rank_kernels_check_their_blocks),
		cmocka_unit_test(test_words_wait_holds_its_stream_only),
		cmocka_unit_test(test_words_cyclic_geq_and_owed_words),
		cmocka_unit_test(test_words_bad_addresses),
		cmocka_unit_test(test_words_need_registered_memory),
		cmocka_unit_test(test_vmm_export_import_same_memory),
		cmocka_unit_test(test_vmm_refusals),
		cmocka_unit_test(test_vmm_pull_rows),
		cmocka_unit_test(test_shutdown_releases_contexts),
	};
	char self[PATH_MAX];

	(void)argc;
	/* build/test/cuda_fake -> build/tests/cuda/libfakecuda.so */
	snprintf(self, sizeof(self), "%s", argv[0]);
	snprintf(fake_path, sizeof(fake_path), "%s/../tests/cuda/libfakecuda.so", dirname(self));
	setenv("RW_CUDA_DRIVER", fake_path, 1);
	rw_log_set_level(RW_LOG_WARN);
	return cmocka_run_group_tests(tests, setup, teardown);
}
#else
int main(void)
{
	printf("cuda_fake: built without cuda.h; skipped\n");
	return 77;
}
#endif
