/* tests/cuda/test_cuda.c: cuda/ on a real driver and GPU. Without one (CI), the first case checks
 * that the module says so cleanly and every GPU case skips with the reason. On the GPU machine
 * tests/cuda/gpu_run.sh builds this with plain gcc (mini_cmocka.h when libcmocka is absent).
 * The IPC case runs the exporter as a second process (this program re-executed with
 * --ipc-exporter FD), the stream-order case its trainer (--order-peer FD): a CUDA context never
 * crosses a fork. */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef RW_MINI_CMOCKA
#include "common/common.h"
#include "tests/cuda/mini_cmocka.h"
#else
#include <cmocka.h>
#endif

#include "common/bf16.h"
#include "cuda/rw_cuda.h"
#include "tests/cuda/vmm_contract.h"
#include "tests/cuda/words_contract.h"
#include "sched/sched.h"

static const char *self_path;

#define NEED_GPU() \
	do { \
		if (rw_cuda_init() != RW_OK) { \
			print_message("skipped: no GPU: %s\n", rw_cuda_unavailable_reason()); \
			skip(); \
		} \
	} while (0)

#define NEED_KERNELS() \
	do { \
		NEED_GPU(); \
		if (!rw_cuda_kernels_available(0)) { \
			print_message("skipped: kernels not built (no nvcc) or not loadable here\n"); \
			skip(); \
		} \
	} while (0)

/* xorshift64*: fresh data per run is drawn from the seed printed in main() */
static uint64_t rng_state = 88172645463325252ull;
static uint64_t rng(void) { return rw_xorshift64s(&rng_state); }
static float rng_unit(void) { return (float)((rng() >> 40) / 16777216.0) * 2.0f - 1.0f; }


static void *xmalloc(size_t n)
{
	void *p = malloc(n);
	assert_non_null(p);
	return p;
}

/* ---- without a GPU ------------------------------------------------------------------------ */

static void test_init_reports_state(void **state)
{
	rw_cuda_dptr_t d = 0;
	rw_cuda_stream_t *s = NULL;
	rw_cuda_ipc_cache_t *c = NULL;
	char name[128];
	int version = 0;

	(void)state;
	if (rw_cuda_init() != RW_OK) {
		/* CPU-only node: one clear reason, every entry point refuses the same way */
		assert_int_equal(rw_cuda_init(), RW_ERR_UNSUPPORTED);
		assert_true(strlen(rw_cuda_unavailable_reason()) > 10);
		print_message("no CUDA here (expected on CPU-only nodes): %s\n", rw_cuda_unavailable_reason());
		assert_int_equal(rw_cuda_device_count(), 0);
		assert_int_equal(rw_cuda_mem_alloc(0, 4096, &d), RW_ERR_UNSUPPORTED);
		assert_int_equal(rw_cuda_stream_create(0, &s), RW_ERR_UNSUPPORTED);
		assert_int_equal(rw_cuda_dmabuf_supported(0), 0);
		assert_int_equal(rw_cuda_kernels_available(0), 0);
		if (rw_cuda_ipc_cache_create(&c) == RW_OK)
			rw_cuda_ipc_cache_destroy(c);
		return;
	}
	assert_true(rw_cuda_device_count() > 0);
	assert_int_equal(rw_cuda_device_name(0, name, sizeof(name)), RW_OK);
	assert_int_equal(rw_cuda_driver_version(&version), RW_OK);
	print_message("GPU 0: %s, driver API %d, %d device(s), kernels %s, dmabuf %s\n", name, version,
		      rw_cuda_device_count(), rw_cuda_kernels_available(0) ? "loaded" : "absent",
		      rw_cuda_dmabuf_supported(0) ? "supported" : "unsupported");
}

/* ---- memory and streams ------------------------------------------------------------------- */

static void test_memory_roundtrip(void **state)
{
	const size_t n = 3u << 20;
	uint8_t *a, *b;
	rw_cuda_dptr_t d;

	(void)state;
	NEED_GPU();
	a = xmalloc(n);
	b = xmalloc(n);
	for (size_t i = 0; i < n; i++)
		a[i] = (uint8_t)rng();
	assert_int_equal(rw_cuda_mem_alloc(0, n, &d), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d, a, n), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, b, d, n), RW_OK);
	assert_memory_equal(a, b, n);
	assert_int_equal(rw_cuda_memset_d8(0, d + 100, 0x5a, 1000), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, b, d, n), RW_OK);
	memset(a + 100, 0x5a, 1000);
	assert_memory_equal(a, b, n);
	rw_cuda_mem_free(0, d);
	free(a);
	free(b);
}

/* Wait (bounded) for the stream's fd as an event loop would, then collect `want` tokens. */
static void wait_tokens(rw_cuda_stream_t *s, uint64_t *tok, int want)
{
	int got = 0;
	for (int tries = 0; got < want && tries < 1000; tries++) {
		struct pollfd p = { .fd = rw_cuda_stream_fd(s), .events = POLLIN };
		int n;
		poll(&p, 1, 100);
		n = rw_cuda_stream_poll(s, tok + got, want - got);
		assert_true(n >= 0);
		got += n;
	}
	assert_int_equal(got, want);
}

static void test_stream_async_staging(void **state)
{
	const size_t n = 64u << 20;
	rw_cuda_stream_t *s;
	uint8_t *pin_a, *pin_b;
	rw_cuda_dptr_t d;
	uint64_t tok[2];

	(void)state;
	NEED_GPU();
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_host_alloc(n, (void **)&pin_a), RW_OK);
	assert_int_equal(rw_cuda_host_alloc(n, (void **)&pin_b), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, n, &d), RW_OK);
	for (size_t i = 0; i < n; i += 8) {
		uint64_t v = rng();
		memcpy(pin_a + i, &v, 8);
	}
	memset(pin_b, 0xee, n);
	assert_int_equal(rw_cuda_copy_htod_async(s, d, pin_a, n), RW_OK);
	assert_int_equal(rw_cuda_stream_mark(s, 41), RW_OK);
	assert_int_equal(rw_cuda_copy_dtoh_async(s, pin_b, d, n), RW_OK);
	assert_int_equal(rw_cuda_stream_mark(s, 42), RW_OK);
	wait_tokens(s, tok, 2);
	assert_int_equal(tok[0], 41);
	assert_int_equal(tok[1], 42);
	assert_memory_equal(pin_a, pin_b, n);
	rw_cuda_mem_free(0, d);
	rw_cuda_host_free(pin_a);
	rw_cuda_host_free(pin_b);
	rw_cuda_stream_destroy(s);
}

/* ---- kernels ------------------------------------------------------------------------------ */

static void check_move(int gather, uint32_t row_bytes, uint32_t nsrc, uint32_t nrows, uint32_t misalign)
{
	size_t src_bytes = (size_t)nsrc * row_bytes + misalign, slab_bytes = (size_t)nrows * row_bytes + misalign;
	uint8_t *src = xmalloc(src_bytes), *out = xmalloc(gather ? slab_bytes : src_bytes);
	uint8_t *ref = xmalloc(gather ? slab_bytes : src_bytes);
	uint32_t *idx = xmalloc(nrows * sizeof(uint32_t));
	rw_cuda_dptr_t d_src, d_dst, d_idx;
	rw_cuda_stream_t *s;
	size_t dst_bytes = gather ? slab_bytes : src_bytes;
	size_t in_bytes = gather ? src_bytes : slab_bytes;

	for (size_t i = 0; i < src_bytes; i++)
		src[i] = (uint8_t)rng();
	if (gather) {
		for (uint32_t i = 0; i < nrows; i++)
			idx[i] = (uint32_t)(rng() % nsrc); /* repeats allowed: a token to several rails */
	} else {
		for (uint32_t i = 0; i < nsrc; i++) /* distinct destinations: a partial permutation */
			if (i < nrows)
				idx[i] = i;
		for (uint32_t i = nrows; i < nsrc; i++) {
			uint32_t j = (uint32_t)(rng() % (i + 1));
			if (j < nrows)
				idx[j] = i;
		}
	}
	/* reference; the poisoned output must be fully rewritten where the kernel writes */
	memset(ref, 0xcd, dst_bytes);
	for (uint32_t i = 0; i < nrows; i++) {
		if (gather)
			memcpy(ref + misalign + (size_t)i * row_bytes, src + misalign + (size_t)idx[i] * row_bytes, row_bytes);
		else
			memcpy(ref + misalign + (size_t)idx[i] * row_bytes, src + misalign + (size_t)i * row_bytes, row_bytes);
	}
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, in_bytes, &d_src), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, dst_bytes, &d_dst), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, nrows * sizeof(uint32_t), &d_idx), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d_src, src, in_bytes), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d_idx, idx, nrows * sizeof(uint32_t)), RW_OK);
	assert_int_equal(rw_cuda_memset_d8(0, d_dst, 0xcd, dst_bytes), RW_OK);
	if (gather)
		assert_int_equal(rw_cuda_pack(s, d_dst + misalign, d_src + misalign, d_idx, nrows, row_bytes), RW_OK);
	else
		assert_int_equal(rw_cuda_unpack(s, d_dst + misalign, d_src + misalign, d_idx, nrows, row_bytes), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, out, d_dst, dst_bytes), RW_OK);
	if (memcmp(out, ref, dst_bytes) != 0)
		fail_msg("%s row_bytes %u rows %u misalign %u: mismatch", gather ? "pack" : "unpack",
			 row_bytes, nrows, misalign);
	rw_cuda_mem_free(0, d_src);
	rw_cuda_mem_free(0, d_dst);
	rw_cuda_mem_free(0, d_idx);
	rw_cuda_stream_destroy(s);
	free(src);
	free(out);
	free(ref);
	free(idx);
}

static void test_kernels_pack_unpack(void **state)
{
	(void)state;
	NEED_KERNELS();
	check_move(1, 4096 * 2, 3000, 2000, 0); /* bf16 hidden 4096: 16-byte path */
	check_move(1, 7168 * 2, 1000, 1500, 0); /* bf16 hidden 7168 */
	check_move(1, 4096 * 4, 500, 700, 0);   /* fp32 hidden 4096 */
	check_move(1, 198, 333, 517, 0);        /* odd rows: byte path */
	check_move(1, 4096, 100, 100, 3);       /* misaligned base: byte path */
	check_move(1, 64, 5, 1, 0);
	check_move(0, 4096 * 2, 3000, 2000, 0);
	check_move(0, 7168 * 2, 1500, 1500, 0);
	check_move(0, 198, 600, 517, 0);
	check_move(0, 4096, 100, 60, 5);
}

/* The CUDA mover's row lists over host memory mapped into the GPU (rw_cuda_host_register_mapped
 * of an anonymous mmap, like the mesh's slabs): rows copied device -> mapped host and mapped host
 * -> device must read back exactly, whether the pages were touched before the registration or
 * not, and whether the CPU writes after it. `touch`: 0 untouched, 1 written before registering. */
static void check_mapped(int touch, uint32_t row_bytes, uint32_t nrows)
{
	size_t bytes = (size_t)row_bytes * nrows, map_bytes = (bytes + 4095) & ~(size_t)4095;
	uint8_t *host = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	uint8_t *want = xmalloc(bytes), *got = xmalloc(bytes);
	rw_cuda_dptr_t mapped, dev, list_d;
	rw_cuda_row_copy_t *list;
	rw_cuda_stream_t *s;

	assert_true(host != MAP_FAILED);
	if (touch)
		memset(host, 0x5a, map_bytes);
	assert_int_equal(rw_cuda_host_register_mapped(host, map_bytes, &mapped), RW_OK);
	assert_int_equal(rw_cuda_host_alloc(sizeof(*list) * nrows, (void **)&list), RW_OK);
	list_d = (rw_cuda_dptr_t)(uintptr_t)list;
	assert_int_equal(rw_cuda_mem_alloc(0, bytes, &dev), RW_OK);
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	for (size_t i = 0; i < bytes; i++)
		want[i] = (uint8_t)rng();
	/* device -> mapped host, rows reversed (the pack and the combine slabs) */
	assert_int_equal(rw_cuda_memcpy_htod(0, dev, want, bytes), RW_OK);
	for (uint32_t i = 0; i < nrows; i++)
		list[i] = (rw_cuda_row_copy_t){ .src = dev + (uint64_t)i * row_bytes,
						.dst = mapped + (uint64_t)(nrows - 1 - i) * row_bytes };
	assert_int_equal(rw_cuda_copy_rows(s, list_d, nrows, row_bytes, row_bytes % 16 == 0), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	for (uint32_t i = 0; i < nrows; i++)
		assert_memory_equal(host + (size_t)(nrows - 1 - i) * row_bytes, want + (size_t)i * row_bytes,
				    row_bytes);
	/* the CPU writes new rows, mapped host -> device (the forward of an arrived range) */
	for (size_t i = 0; i < bytes; i++)
		want[i] = host[i] = (uint8_t)rng();
	for (uint32_t i = 0; i < nrows; i++)
		list[i] = (rw_cuda_row_copy_t){ .src = mapped + (uint64_t)i * row_bytes,
						.dst = dev + (uint64_t)i * row_bytes };
	assert_int_equal(rw_cuda_copy_rows(s, list_d, nrows, row_bytes, row_bytes % 16 == 0), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, got, dev, bytes), RW_OK);
	assert_memory_equal(got, want, bytes);
	rw_cuda_stream_destroy(s);
	rw_cuda_mem_free(0, dev);
	rw_cuda_host_free(list);
	rw_cuda_host_unregister(host);
	munmap(host, map_bytes);
	free(want);
	free(got);
}

static void test_kernels_mapped_rows(void **state)
{
	(void)state;
	NEED_KERNELS();
	check_mapped(0, 96, 333);       /* fp32 hidden 24: 16-byte path, pages untouched */
	check_mapped(1, 96, 333);       /* pages written before the registration */
	check_mapped(0, 14, 1000);      /* bf16 hidden 7: byte path */
	check_mapped(0, 14336, 300);    /* bf16 hidden 7168 */
}

/* out[t] += sum_j w[j] * rows[row_idx[j]] against a CPU reference in the same order (fmaf). */
static void check_combine(rw_cuda_dtype_t out_t, rw_cuda_dtype_t row_t, uint32_t hidden, uint32_t ntok,
			  uint32_t nrows)
{
	size_t osz = out_t == RW_CUDA_BF16 ? 2 : 4, rsz = row_t == RW_CUDA_BF16 ? 2 : 4;
	size_t out_bytes = (size_t)ntok * hidden * osz, row_bytes = (size_t)nrows * hidden * rsz;
	uint8_t *rows = xmalloc(row_bytes), *out0 = xmalloc(out_bytes), *out = xmalloc(out_bytes);
	uint32_t *off = xmalloc((ntok + 1) * sizeof(uint32_t));
	uint32_t *ri, nnz = 0;
	float *w;
	double err2 = 0, ref2 = 0;
	size_t exact = 0, bad = 0;
	rw_cuda_dptr_t d_rows, d_out, d_off, d_ri, d_w;
	rw_cuda_stream_t *s;

	for (uint32_t t = 0; t < ntok; t++) {
		off[t] = nnz;
		nnz += (uint32_t)(rng() % 9); /* 0..8 copies per token, as top-8 */
	}
	off[ntok] = nnz;
	ri = xmalloc((nnz + 1) * sizeof(uint32_t));
	w = xmalloc((nnz + 1) * sizeof(float));
	for (uint32_t j = 0; j < nnz; j++) {
		ri[j] = (uint32_t)(rng() % nrows);
		w[j] = rng_unit();
	}
	for (size_t i = 0; i < (size_t)nrows * hidden; i++) {
		float v = rng_unit() * 4.0f;
		if (rsz == 2) { uint16_t h = rw_bf16_from_f32(v); memcpy(rows + i * 2, &h, 2); }
		else memcpy(rows + i * 4, &v, 4);
	}
	for (size_t i = 0; i < (size_t)ntok * hidden; i++) {
		float v = rng_unit();
		if (osz == 2) { uint16_t h = rw_bf16_from_f32(v); memcpy(out0 + i * 2, &h, 2); }
		else memcpy(out0 + i * 4, &v, 4);
	}
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, row_bytes, &d_rows), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, out_bytes, &d_out), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (ntok + 1) * 4, &d_off), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (nnz + 1) * 4, &d_ri), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (nnz + 1) * 4, &d_w), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d_rows, rows, row_bytes), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d_out, out0, out_bytes), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d_off, off, (ntok + 1) * 4), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d_ri, ri, (nnz + 1) * 4), RW_OK);
	assert_int_equal(rw_cuda_memcpy_htod(0, d_w, w, (nnz + 1) * 4), RW_OK);
	assert_int_equal(rw_cuda_combine(s, d_out, out_t, d_rows, row_t, hidden, ntok, d_off, d_ri, d_w), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, out, d_out, out_bytes), RW_OK);
	for (uint32_t t = 0; t < ntok; t++) {
		for (uint32_t h = 0; h < hidden; h++) {
			size_t o = (size_t)t * hidden + h;
			float acc = 0.0f, base, got, refv;
			for (uint32_t j = off[t]; j < off[t + 1]; j++) {
				size_t r = (size_t)ri[j] * hidden + h;
				float x;
				if (rsz == 2) { uint16_t v; memcpy(&v, rows + r * 2, 2); x = rw_bf16_to_f32(v); }
				else memcpy(&x, rows + r * 4, 4);
				acc = fmaf(w[j], x, acc);
			}
			if (osz == 2) {
				uint16_t v;
				memcpy(&v, out0 + o * 2, 2);
				base = rw_bf16_to_f32(v);
				refv = rw_bf16_to_f32(rw_bf16_from_f32(base + acc));
				memcpy(&v, out + o * 2, 2);
				got = rw_bf16_to_f32(v);
			} else {
				memcpy(&base, out0 + o * 4, 4);
				refv = base + acc;
				memcpy(&got, out + o * 4, 4);
			}
			exact += got == refv;
			if (!(fabsf(got - refv) <= 1e-5f * (1.0f + fabsf(refv))) && !(osz == 2 &&
			    fabsf(got - refv) <= fabsf(refv) / 128.0f)) /* one bf16 ulp */
				bad++;
			err2 += (double)(got - refv) * (got - refv);
			ref2 += (double)refv * refv;
		}
	}
	print_message("combine out %s rows %s hidden %u tokens %u copies %u: %zu/%zu bit-exact, rel err %.2e\n",
		      osz == 2 ? "bf16" : "fp32", rsz == 2 ? "bf16" : "fp32", hidden, ntok, nnz, exact,
		      (size_t)ntok * hidden, ref2 > 0 ? sqrt(err2 / ref2) : 0.0);
	assert_int_equal(bad, 0);
	assert_true(sqrt(err2 / (ref2 > 0 ? ref2 : 1)) < 1e-6);
	rw_cuda_mem_free(0, d_rows);
	rw_cuda_mem_free(0, d_out);
	rw_cuda_mem_free(0, d_off);
	rw_cuda_mem_free(0, d_ri);
	rw_cuda_mem_free(0, d_w);
	rw_cuda_stream_destroy(s);
	free(rows);
	free(out0);
	free(out);
	free(off);
	free(ri);
	free(w);
}

static void test_kernels_combine(void **state)
{
	const rw_cuda_dtype_t t[2] = { RW_CUDA_BF16, RW_CUDA_FP32 };

	(void)state;
	NEED_KERNELS();
	for (int o = 0; o < 2; o++)
		for (int r = 0; r < 2; r++) {
			check_combine(t[o], t[r], 4096, 300, 900); /* vector path */
			check_combine(t[o], t[r], 100, 77, 150);   /* bf16: scalar, fp32: vector */
			check_combine(t[o], t[r], 7, 50, 40);      /* scalar */
		}
}

/* ---- routing counts on the GPU ---------------------------------------------------------------- *
 * rw_cuda_route_count, once per local rank into one row, against the executor's own pass 1
 * (rw_sched_count): random top-k with repeated nodes and dropped slots, several shapes (the
 * shared-memory row and, with N * R > 4096, the global one); then a bad id is reported. */

static void route_count_case(uint32_t N, uint32_t R, uint32_t G, uint32_t E, uint32_t K, uint32_t T,
			     uint32_t me)
{
	rw_topo_t topo = { .nodes = N, .gpus_per_node = G, .rails = R };
	for (uint32_t g = 0; g < G; g++)
		topo.gpu_rail[g] = (uint8_t)(g % R);
	for (uint32_t r = 0; r < R; r++)
		topo.rail_weight[r] = 1;
	int32_t *ids = xmalloc((size_t)G * T * K * 4);
	rw_rank_tokens_t rk[RW_MAX_GPUS];
	for (uint32_t g = 0; g < G; g++) {
		for (size_t i = 0; i < (size_t)T * K; i++) {
			uint64_t x = rng();
			ids[(size_t)g * T * K + i] = x % 13 == 0 ? -1 : (int32_t)((x >> 8) % E);
		}
		rk[g] = (rw_rank_tokens_t){ .local_gpu = g, .n_tokens = T, .topk = K,
					    .expert_ids = ids + (size_t)g * T * K };
	}
	uint32_t *want = xmalloc((size_t)N * R * 4), *got = xmalloc((size_t)N * R * 4), bad = 7;
	assert_int_equal(rw_sched_count(&topo, E, me, rk, G, want, NULL), RW_OK);
	rw_cuda_stream_t *s;
	rw_cuda_dptr_t d_ids, d_row, d_bad;
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)G * T * K * 4, &d_ids), RW_OK);
	assert_int_equal(rw_cuda_mem_alloc(0, (size_t)N * R * 4 + 4, &d_row), RW_OK);
	d_bad = d_row + (size_t)N * R * 4;
	assert_int_equal(rw_cuda_memcpy_htod(0, d_ids, ids, (size_t)G * T * K * 4), RW_OK);
	assert_int_equal(rw_cuda_memset_d8(0, d_row, 0, (size_t)N * R * 4 + 4), RW_OK);
	for (uint32_t g = 0; g < G; g++)
		assert_int_equal(rw_cuda_route_count(s, d_ids + (uint64_t)g * T * K * 4, T, K, E, N, R,
						     topo.gpu_rail[g], d_row, d_bad), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, got, d_row, (size_t)N * R * 4), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, &bad, d_bad, 4), RW_OK);
	assert_int_equal(bad, 0);
	assert_memory_equal(got, want, (size_t)N * R * 4);
	/* a bad id in token 5 of rank 0: reported, the token counts nothing */
	if (T > 5) {
		ids[5 * K + K / 2] = (int32_t)E;
		assert_int_equal(rw_cuda_memcpy_htod(0, d_ids, ids, (size_t)T * K * 4), RW_OK);
		assert_int_equal(rw_cuda_route_count(s, d_ids, T, K, E, N, R, 0, d_row, d_bad), RW_OK);
		assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
		assert_int_equal(rw_cuda_memcpy_dtoh(0, &bad, d_bad, 4), RW_OK);
		assert_int_equal(bad, 6);
	}
	print_message("route count N=%u R=%u G=%u E=%u top-%u T=%u: equals rw_sched_count\n", N, R,
		      G, E, K, T);
	rw_cuda_mem_free(0, d_ids);
	rw_cuda_mem_free(0, d_row);
	rw_cuda_stream_destroy(s);
	free(ids);
	free(want);
	free(got);
}

static void test_kernels_route_count(void **state)
{
	(void)state;
	NEED_KERNELS();
	route_count_case(2, 2, 4, 256, 8, 4096, 0);   /* DeepSeek-V3's routing, 2 x 4 ranks */
	route_count_case(3, 4, 8, 96, 8, 1000, 1);
	route_count_case(16, 8, 8, 1024, 32, 777, 5);
	route_count_case(1024, 8, 1, 8192, 8, 3000, 3); /* 8192 counters: the global-row path */
	rw_cuda_stream_t *s;
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_route_count(s, 0, 0, 8, 256, 2, 2, 2, 64, 64), RW_ERR_INVAL); /* rail */
	assert_int_equal(rw_cuda_route_count(s, 0, 0, 8, 255, 2, 2, 0, 64, 64), RW_ERR_INVAL); /* E % N */
	rw_cuda_stream_destroy(s);
}

/* ---- CUDA IPC across two processes ------------------------------------------------------- */

#define IPC_BYTES (4u << 20)

struct ipc_msg {
	char cmd;              /* 'D' desc follows, 'V' verify pattern, 'R' reallocate, 'Q' quit, 'Y'/'N' */
	uint8_t seed;
	rw_cuda_ipc_desc_t desc;
};

static int fill_check(uint8_t *buf, uint8_t seed, int check)
{
	for (size_t i = 0; i < IPC_BYTES; i++) {
		uint8_t v = (uint8_t)(seed ^ (i * 131) ^ (i >> 9));
		if (check && buf[i] != v)
			return 0;
		buf[i] = v;
	}
	return 1;
}

static int send_msg(int fd, const struct ipc_msg *m)
{
	return send(fd, m, sizeof(*m), 0) == (ssize_t)sizeof(*m) ? 0 : -1;
}

static int recv_msg(int fd, struct ipc_msg *m)
{
	return recv(fd, m, sizeof(*m), MSG_WAITALL) == (ssize_t)sizeof(*m) ? 0 : -1;
}

/* The client side, in its own process: allocate, fill, export; verify what the daemon wrote. */
static int ipc_exporter(int fd)
{
	uint8_t *buf = malloc(IPC_BYTES);
	struct ipc_msg m = { 0 };
	rw_cuda_dptr_t d = 0;

	if (buf == NULL || rw_cuda_init() != RW_OK || rw_cuda_mem_alloc(0, IPC_BYTES, &d) != RW_OK)
		return 2;
	fill_check(buf, 0x11, 0);
	if (rw_cuda_memcpy_htod(0, d, buf, IPC_BYTES) != RW_OK || rw_cuda_ipc_export(d, IPC_BYTES, &m.desc) != RW_OK)
		return 3;
	m.cmd = 'D';
	send_msg(fd, &m);
	while (recv_msg(fd, &m) == 0) {
		if (m.cmd == 'V') {
			int ok = rw_cuda_memcpy_dtoh(0, buf, d, IPC_BYTES) == RW_OK && fill_check(buf, m.seed, 1);
			m.cmd = ok ? 'Y' : 'N';
			send_msg(fd, &m);
		} else if (m.cmd == 'R') {
			/* free while the daemon still maps it, then allocate the same size again */
			rw_cuda_dptr_t d2 = 0;
			rw_cuda_mem_free(0, d);
			if (rw_cuda_mem_alloc(0, IPC_BYTES, &d2) != RW_OK)
				return 4;
			fprintf(stderr, "exporter: realloc %s the address (0x%llx -> 0x%llx)\n",
				d2 == d ? "reused" : "did not reuse", (unsigned long long)d,
				(unsigned long long)d2);
			d = d2;
			fill_check(buf, m.seed, 0);
			if (rw_cuda_memcpy_htod(0, d, buf, IPC_BYTES) != RW_OK ||
			    rw_cuda_ipc_export(d, IPC_BYTES, &m.desc) != RW_OK)
				return 5;
			m.cmd = 'D';
			send_msg(fd, &m);
		} else {
			break;
		}
	}
	rw_cuda_mem_free(0, d);
	free(buf);
	rw_cuda_shutdown();
	return 0;
}

static void read_import(rw_cuda_dptr_t p, uint8_t *buf, uint8_t seed, int expect_ok)
{
	assert_int_equal(rw_cuda_memcpy_dtoh(0, buf, p, IPC_BYTES), RW_OK);
	assert_int_equal(fill_check(buf, seed, 1), expect_ok);
}

/* Connection `n` of the exporting child (the daemon's view: SO_PEERCRED pid, start time). */
#define CONN_OF(n, p) (&(rw_cuda_ipc_owner_t){ .conn = (n), .pid = (p), .start_time = 1 })

static void test_ipc_two_processes(void **state)
{
	int sv[2], status = 0;
	pid_t pid;
	struct ipc_msg m = { 0 }, reply;
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *m1, *m2, *m3 = NULL, *mx = NULL;
	rw_cuda_ipc_stats_t st;
	rw_cuda_ipc_desc_t desc1;
	rw_cuda_dptr_t p1 = 0, p2 = 0, p3 = 0, px = 0;
	uint8_t *buf;
	char fdarg[16];
	rw_status_t rs;

	(void)state;
	NEED_GPU();
	buf = xmalloc(IPC_BYTES);
	assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		close(sv[0]);
		snprintf(fdarg, sizeof(fdarg), "%d", sv[1]);
		execl(self_path, self_path, "--ipc-exporter", fdarg, (char *)NULL);
		_exit(127);
	}
	close(sv[1]);
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);

	/* 1. import, read the client's pattern, write ours, the client sees it */
	assert_int_equal(recv_msg(sv[0], &m), 0);
	assert_int_equal(m.cmd, 'D');
	desc1 = m.desc;
	assert_int_equal(rw_cuda_ipc_import(cache, &desc1, CONN_OF(1, pid), &m1, &p1), RW_OK);
	read_import(p1, buf, 0x11, 1);
	fill_check(buf, 0x22, 0);
	assert_int_equal(rw_cuda_memcpy_htod(0, p1, buf, IPC_BYTES), RW_OK);
	m.cmd = 'V';
	m.seed = 0x22;
	assert_int_equal(send_msg(sv[0], &m), 0);
	assert_int_equal(recv_msg(sv[0], &reply), 0);
	assert_int_equal(reply.cmd, 'Y');

	/* 2. cache hit: same mapping, two references; released twice, the next import is a miss */
	assert_int_equal(rw_cuda_ipc_import(cache, &desc1, CONN_OF(1, pid), &m2, &p2), RW_OK);
	assert_ptr_equal(m1, m2);
	assert_int_equal(p1, p2);
	assert_int_equal(rw_cuda_ipc_map_refs(m1), 2);
	/* a second connection of the exporter (a second Group) shares it; another process
	 * presenting the same handle bytes gets the driver's existing address and is refused */
	assert_int_equal(rw_cuda_ipc_import(cache, &desc1, CONN_OF(2, pid), &mx, &px), RW_OK);
	assert_ptr_equal(mx, m1);
	assert_int_equal(px, p1);
	assert_int_equal(rw_cuda_ipc_map_users(m1), 2);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc1, CONN_OF(3, pid + 1), &m3, &p3),
			 RW_ERR_EXISTS);
	assert_int_equal(rw_cuda_ipc_release_owner(cache, 1), 2);
	read_import(px, buf, 0x22, 1); /* connection 2 still reads the client's memory */
	rw_cuda_ipc_release(cache, mx, 2);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.hits, 2);
	assert_int_equal(st.shared, 1);
	assert_int_equal(st.refused_stale, 1);
	assert_int_equal(st.opens, 1);
	assert_int_equal(st.closes, 1);
	assert_int_equal(rw_cuda_ipc_import(cache, &desc1, CONN_OF(1, pid), &m1, &p1), RW_OK);
	rw_cuda_ipc_cache_stats(cache, &st);
	assert_int_equal(st.opens, 2);
	read_import(p1, buf, 0x22, 1);

	/* 3. the client frees the buffer (still mapped here) and allocates a new one */
	m.cmd = 'R';
	m.seed = 0x33;
	assert_int_equal(send_msg(sv[0], &m), 0);
	assert_int_equal(recv_msg(sv[0], &m), 0);
	assert_int_equal(m.cmd, 'D');
	print_message("ipc: realloc handle bytes %s, buffer id %llu -> %llu\n",
		      memcmp(desc1.handle.bytes, m.desc.handle.bytes, RW_CUDA_IPC_HANDLE_BYTES) == 0 ?
		      "IDENTICAL" : "differ", (unsigned long long)desc1.buffer_id,
		      (unsigned long long)m.desc.buffer_id);
	assert_int_not_equal(desc1.buffer_id, m.desc.buffer_id);
	rs = rw_cuda_ipc_import(cache, &m.desc, CONN_OF(1, pid), &m3, &p3);
	if (rs == RW_OK) {
		print_message("ipc: new allocation imported while the old one is mapped (fresh mapping)\n");
		assert_true(m3 != m1);
		read_import(p3, buf, 0x33, 1); /* never the old data */
		rw_cuda_ipc_release(cache, m3, 1);
	} else {
		print_message("ipc: import refused while the old mapping is held (%s)\n", rw_status_str(rs));
		assert_int_equal(rs, RW_ERR_EXISTS);
	}
	read_import(p1, buf, 0x22, 1); /* the old registration keeps its (freed-by-client) memory */
	rw_cuda_ipc_release(cache, m1, 1);
	assert_int_equal(rw_cuda_ipc_import(cache, &m.desc, CONN_OF(1, pid), &m3, &p3), RW_OK);
	read_import(p3, buf, 0x33, 1);
	rw_cuda_ipc_release(cache, m3, 1);
	rw_cuda_ipc_cache_stats(cache, &st);
	print_message("ipc cache: hits %llu opens %llu closes %llu refused_stale %llu live %llu\n",
		      (unsigned long long)st.hits, (unsigned long long)st.opens,
		      (unsigned long long)st.closes, (unsigned long long)st.refused_stale,
		      (unsigned long long)st.live);
	assert_int_equal(st.live, 0);

	m.cmd = 'Q';
	send_msg(sv[0], &m);
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	rw_cuda_ipc_cache_destroy(cache);
	close(sv[0]);
	free(buf);
}

/* ---- stream order across two processes (cuda/event.c) ---------------------------------------- *
 * The trainer (this program re-executed with --order-peer) writes region A of its buffer with 64
 * queued copies, records an IPC event behind them and at once (no host wait) hands the event
 * and the buffer to the "daemon" (this process), then enqueues a wait for the flag to reach 1
 * and a read of region B. The daemon's stream waits on the event and reads A: it must see every
 * byte of the trainer's last copy. After a pause (the trainer's stream is really waiting by
 * then) the daemon writes B and then the flag on its stream; the trainer must read B as the
 * daemon wrote it. */

#define ORDER_FLAG (2 * (size_t)IPC_BYTES) /* A = [0, 4 MiB), B = [4, 8 MiB), the flag after */
#define ORDER_BYTES (ORDER_FLAG + 4096)

struct order_msg {
	char cmd; /* 'D': desc + event follow; 'Y'/'N': the trainer's verdict on B */
	uint8_t event[RW_CUDA_IPC_HANDLE_BYTES];
	rw_cuda_ipc_desc_t desc;
};

static int order_peer(int fd)
{
	struct order_msg m = { .cmd = 'D' };
	rw_cuda_dptr_t d = 0;
	rw_cuda_stream_t *s = NULL;
	rw_cuda_event_t *ev = NULL;
	void *a = NULL, *b = NULL;
	if (rw_cuda_init() != RW_OK || rw_cuda_mem_alloc(0, ORDER_BYTES, &d) != RW_OK ||
	    rw_cuda_memset_d8(0, d, 0, ORDER_BYTES) != RW_OK || rw_cuda_stream_create(0, &s) != RW_OK ||
	    rw_cuda_host_alloc(IPC_BYTES, &a) != RW_OK || rw_cuda_host_alloc(IPC_BYTES, &b) != RW_OK ||
	    rw_cuda_event_export(0, &ev, m.event) != RW_OK || rw_cuda_ipc_export(d, ORDER_BYTES, &m.desc) != RW_OK)
		return 2;
	for (int i = 0; i < 64; i++) { /* A: the last copy writes seed 0x44 */
		fill_check(a, i == 63 ? 0x44 : (uint8_t)i, 0);
		if (rw_cuda_copy_htod_async(s, d, a, IPC_BYTES) != RW_OK)
			return 3;
		if (i < 63 && rw_cuda_stream_sync(s) != RW_OK) /* the pinned source is reused */
			return 3;
	}
	if (rw_cuda_event_record(ev, s) != RW_OK || send(fd, &m, sizeof(m), 0) != (ssize_t)sizeof(m))
		return 4;
	if (rw_cuda_stream_wait_u32(s, d + ORDER_FLAG, 1) != RW_OK ||
	    rw_cuda_copy_dtoh_async(s, b, d + IPC_BYTES, IPC_BYTES) != RW_OK || rw_cuda_stream_sync(s) != RW_OK)
		return 5;
	m.cmd = fill_check(b, 0x55, 1) ? 'Y' : 'N';
	send(fd, &m, sizeof(m), 0);
	rw_cuda_event_destroy(ev);
	rw_cuda_stream_destroy(s);
	rw_cuda_host_free(a);
	rw_cuda_host_free(b);
	rw_cuda_mem_free(0, d);
	rw_cuda_shutdown();
	return 0;
}

static void test_stream_order_two_processes(void **state)
{
	(void)state;
	NEED_GPU();
	int sv[2], status = 0;
	assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		char fdarg[16];
		close(sv[0]);
		snprintf(fdarg, sizeof(fdarg), "%d", sv[1]);
		execl(self_path, self_path, "--order-peer", fdarg, (char *)NULL);
		_exit(127);
	}
	close(sv[1]);
	struct order_msg m;
	assert_int_equal(recv(sv[0], &m, sizeof(m), MSG_WAITALL), (ssize_t)sizeof(m));
	assert_int_equal(m.cmd, 'D');
	rw_cuda_ipc_cache_t *cache;
	rw_cuda_ipc_map_t *map;
	rw_cuda_dptr_t d;
	rw_cuda_event_t *ev;
	rw_cuda_stream_t *s;
	void *h;
	assert_int_equal(rw_cuda_ipc_cache_create(&cache), RW_OK);
	assert_int_equal(rw_cuda_ipc_import(cache, &m.desc, CONN_OF(1, pid), &map, &d), RW_OK);
	assert_int_equal(rw_cuda_event_import(0, m.event, &ev), RW_OK);
	assert_int_equal(rw_cuda_stream_create(0, &s), RW_OK);
	assert_int_equal(rw_cuda_host_alloc(IPC_BYTES, &h), RW_OK);
	/* A, read behind the trainer's event: its last copy, never an earlier one or zeros */
	assert_int_equal(rw_cuda_stream_wait_event(s, ev), RW_OK);
	assert_int_equal(rw_cuda_copy_dtoh_async(s, h, d, IPC_BYTES), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(fill_check(h, 0x44, 1), 1);
	/* B, then the flag, on our stream; the trainer's stream has been waiting for it */
	usleep(50000);
	fill_check(h, 0x55, 0);
	assert_int_equal(rw_cuda_copy_htod_async(s, d + IPC_BYTES, h, IPC_BYTES), RW_OK);
	assert_int_equal(rw_cuda_stream_write_u32(s, d + ORDER_FLAG, 1), RW_OK);
	assert_int_equal(rw_cuda_stream_sync(s), RW_OK);
	assert_int_equal(recv(sv[0], &m, sizeof(m), MSG_WAITALL), (ssize_t)sizeof(m));
	assert_int_equal(m.cmd, 'Y');
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	print_message("stream order: the importer's stream waited on the trainer's IPC event; the "
		      "trainer's stream waited on the flag the importer's stream wrote\n");
	rw_cuda_host_free(h);
	rw_cuda_stream_destroy(s);
	rw_cuda_event_destroy(ev);
	rw_cuda_ipc_release(cache, map, 1);
	rw_cuda_ipc_cache_destroy(cache);
	close(sv[0]);
}

/* ---- words on streams (cuda/words.c): the contract the stand-in is held to ------------------- */

static void test_words_wait_holds_its_stream_only(void **state)
{
	(void)state;
	NEED_GPU();
	rw_words_case_wait_holds_its_stream_only();
}

static void test_words_cyclic_geq_and_owed_words(void **state)
{
	(void)state;
	NEED_GPU();
	rw_words_case_cyclic_geq_and_owed_words();
}

static void test_words_bad_addresses(void **state)
{
	(void)state;
	NEED_GPU();
	rw_words_case_bad_addresses();
}

/* ---- GPU memory lent by fd (cuda/vmm.c): the contract the stand-in is held to -------------- */

static void test_vmm_export_import_same_memory(void **state)
{
	(void)state;
	NEED_GPU();
	rw_vmm_case_export_import_same_memory();
}

static void test_vmm_refusals(void **state)
{
	(void)state;
	NEED_GPU();
	rw_vmm_case_refusals();
}

static void test_vmm_pull_rows(void **state)
{
	(void)state;
	NEED_GPU();
	rw_vmm_case_pull_rows();
}

/* ---- dmabuf ----------------------------------------------------------------------------- */

static void test_dmabuf_probe(void **state)
{
	const size_t page = (size_t)sysconf(_SC_PAGESIZE), n = 8u << 20;
	rw_cuda_dptr_t d, a;
	int fd = -1, supported;
	rw_status_t st;

	(void)state;
	NEED_GPU();
	supported = rw_cuda_dmabuf_supported(0);
	assert_int_equal(rw_cuda_mem_alloc(0, n, &d), RW_OK);
	a = (d + page - 1) / page * page;
	st = rw_cuda_dmabuf_export(0, a, 4u << 20, &fd);
	print_message("dmabuf: attribute says %s; export of 4 MiB: %s (fd %d)\n",
		      supported ? "supported" : "unsupported", rw_status_str(st), fd);
	if (st == RW_OK) {
		char link[64], target[128] = "";
		ssize_t len;
		snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
		len = readlink(link, target, sizeof(target) - 1);
		if (len > 0)
			target[len] = '\0';
		print_message("dmabuf: fd %d is %s\n", fd, target);
		assert_true(supported);
		assert_true(fd >= 0);
		close(fd);
	} else {
		/* the attribute can promise more than a VM's PCIe topology delivers: report, allow */
		assert_int_equal(st, RW_ERR_UNSUPPORTED);
	}
	assert_int_equal(rw_cuda_dmabuf_export(0, a + 1, page, &fd), supported ? RW_ERR_INVAL : RW_ERR_UNSUPPORTED);
	rw_cuda_mem_free(0, d);
}

static void test_shutdown(void **state)
{
	(void)state;
	rw_cuda_shutdown(); /* releases the primary contexts; harmless without a driver */
}

int main(int argc, char **argv)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_init_reports_state),
		cmocka_unit_test(test_memory_roundtrip),
		cmocka_unit_test(test_stream_async_staging),
		cmocka_unit_test(test_kernels_pack_unpack),
		cmocka_unit_test(test_kernels_combine),
		cmocka_unit_test(test_kernels_mapped_rows),
		cmocka_unit_test(test_kernels_route_count),
		cmocka_unit_test(test_ipc_two_processes),
		cmocka_unit_test(test_stream_order_two_processes),
		cmocka_unit_test(test_words_wait_holds_its_stream_only),
		cmocka_unit_test(test_words_cyclic_geq_and_owed_words),
		cmocka_unit_test(test_words_bad_addresses),
		cmocka_unit_test(test_vmm_export_import_same_memory),
		cmocka_unit_test(test_vmm_refusals),
		cmocka_unit_test(test_vmm_pull_rows),
		cmocka_unit_test(test_dmabuf_probe),
		cmocka_unit_test(test_shutdown),
	};
	const char *seed = getenv("RW_TEST_SEED");

	self_path = argv[0];
	if (argc == 3 && strcmp(argv[1], "--ipc-exporter") == 0)
		return ipc_exporter(atoi(argv[2]));
	if (argc == 3 && strcmp(argv[1], "--order-peer") == 0)
		return order_peer(atoi(argv[2]));
	rng_state = seed ? strtoull(seed, NULL, 0) : (uint64_t)getpid() * 0x9E3779B97F4A7C15ull;
	if (rng_state == 0)
		rng_state = 1;
	printf("cuda test seed 0x%llx (RW_TEST_SEED=0x%llx repeats it)\n", (unsigned long long)rng_state,
	       (unsigned long long)rng_state);
	rw_log_set_level(RW_LOG_WARN);
	return cmocka_run_group_tests(tests, NULL, NULL);
}
