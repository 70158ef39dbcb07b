/* svc_exec, CUDA: ranks whose buffers are CUDA memory of the stand-in driver (staged through
 * pinned host memory), and the count row on the GPU with the CUDA mover listed first (run by
 * tests/service/svc_exec_gpu.sh on the kernel stand-in; skipped elsewhere). Harness:
 * exec_harness.h. */
#include "tests/service/test_exec.h"

#include "service/exec/exec_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ================================================================================================
 * CUDA buffers (staging through pinned host memory, docs/dataflow.md "CUDA buffers")
 * ================================================================================================ */

/* The in-process CUDA stand-in is loaded, with its hold switch (else these cases skip). */
static int cuda_stand_in(void)
{
	return rw_cuda_init() == RW_OK && fake_cuda_hold;
}

/* Ranks 0 and 3 keep their buffers in CUDA memory of the stand-in driver
 * (tests/cuda/libfakecuda.so): inputs are staged in, outputs copied back after async marks that
 * complete through the loop; every path checks exactly as with host buffers, with empty phases. */
static void test_cuda_ranks(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names); pi += 2) {
		opts_t o = { .nodes = 2, .path = path_names[pi], .empty = 1, .experts = 24 };
		cl_t *c = cl_new(&o, 850 + pi);
		fk_client_die(c->rk[0].c);
		fk_client_die(c->rk[3].c);
		settle(c);
		rank_connect_cuda(c, 0);
		rank_connect_cuda(c, 3);
		for (uint32_t layer = 0; layer < 3; layer++)
			run_pair(c, 1, layer);
		cl_free(c);
	}
}

/* Two nodes, rank 3 reconnected with its buffer in CUDA memory, one pair passed; flag_p not
 * NULL: rank 3's flag of event 5, cleared. */
static cl_t *cuda_rank3(uint64_t salt, volatile uint32_t **flag_p)
{
	opts_t o = { .nodes = 2, .path = "native", .tokens = 20 };
	cl_t *c = cl_new(&o, salt);
	fk_client_die(c->rk[3].c);
	settle(c);
	rank_connect_cuda(c, 3);
	run_pair(c, 0, 1);
	if (flag_p) {
		*flag_p = fk_client_flag_event(c->rk[3].c, 5);
		assert_non_null(*flag_p);
		**flag_p = 0;
	}
	return c;
}

/* Two nodes, rank 3's buffer in CUDA memory; one pair passes, then (with the stall bound at
 * stall_ms when not 0) the stand-in holds every stream's work and every rank submits the
 * dispatch of step 0 layer 0: rank 3's input copies are queued and do not land. flag_p not NULL:
 * rank 3's submission asks for its stream-ordered flag (event 5, *flag_p, cleared) to be 9. */
static cl_t *cuda_copies_held(uint64_t salt, uint32_t stall_ms, volatile uint32_t **flag_p)
{
	cl_t *c = cuda_rank3(salt, flag_p);
	if (stall_ms)
		rw_svc_gpu_stall_set(stall_ms);
	fake_cuda_hold(1);
	const sub_opts_t so = { .signal_event = 5, .flag_value = 9 };
	for (uint32_t r = 0; r < c->W; r++)
		dispatch_submit(c, r, 0, 0, r == 3 && flag_p ? &so : NULL);
	settle(c);
	return c;
}

/* A stall case's end: the bound back to its default, no phase timed out, the key of step 0
 * layer 0 passes (every rank connected again), the cluster freed. */
static void stall_case_end(cl_t *c)
{
	rw_svc_gpu_stall_set(0);
	expect_no_timeouts(c);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* A CUDA rank dies while its input copies' marks are still pending (the stand-in driver holds
 * them): its node's pair fails at once without waiting for them (docs/rankpath.md "A hung
 * GPU"): the other (host) ranks get RW_E_PHASE while the copies are still held, the staging they
 * write is held by the stage (not freed with the dead rank's member) and the dead rank's CUDA
 * buffer stays mapped (kept: the stand-in frees it at the last keep's drop, so a copy after
 * that is an ASan error) until they land, the late marks find no pair, and the key passes. */
static void test_cuda_rank_lost(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	cl_t *c = cuda_copies_held(860, 0, NULL);
	for (uint32_t r = 0; r < c->W; r++)
		expect_no_cqe(c, r);
	rw_ipc_client_t *gone = c->rk[3].c;
	fk_client_die(gone);
	for (uint32_t r = 0; r < 3; r++) /* answered while the copies are still held */
		expect_err(c, r, RW_E_PHASE, "a CUDA rank died with copies pending");
	int dev[4];
	uint64_t held = 0;
	rw_svc_gpu_stalled_list(dev, 4, &held);
	assert_true(held > 0); /* the dead rank's staging, kept for the copies into it */
	assert_int_equal(fk_client_keeps(gone), 1); /* its CUDA buffer, which they read */
	fake_cuda_hold(0);
	settle(c);
	rw_svc_gpu_stalled_list(dev, 4, &held);
	assert_int_equal(held, 0); /* freed once they landed */
	assert_int_equal(fk_client_keeps(gone), 0);
	expect_no_timeouts(c);
	rank_connect_cuda(c, 3);
	retry_key(c, 0, 0);
	cl_free(c);
}

/* A failed pair's CUDA rank with copies pending gets its error once they landed, never before
 * (a retry would reuse its buffers, a leave unmap them: docs/rankpath.md "A hung GPU"). Host
 * rank 2 dies while rank 3's input copies are held by the stand-in: node 0's ranks and nothing
 * else are answered; rank 3's error comes once the copies land, naming the leave, not a stall;
 * the key passes. Then rank 3 leaves while its answer is held: its CUDA buffer stays mapped
 * (kept) until its copies landed (the stand-in frees it at the last keep's drop: a copy after
 * that is an ASan error), and the key passes with both ranks back. */
static void test_cuda_answer_late(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	cl_t *c = cuda_copies_held(875, 0, NULL);
	fk_client_die(c->rk[2].c);
	expect_err(c, 0, RW_E_PHASE, "a peer's pair failed");
	expect_err(c, 1, RW_E_PHASE, "a peer's pair failed");
	settle(c);
	expect_no_cqe(c, 3); /* its input copies have not landed */
	assert_int_equal(fk_client_keeps(c->rk[3].c), 1);
	fake_cuda_hold(0);
	expect_err(c, 3, RW_E_PHASE, "its copies landed");
	assert_non_null(strstr(fk_client_notice(c->rk[3].c), "local rank 2 left"));
	assert_null(strstr(fk_client_notice(c->rk[3].c), "stalled"));
	settle(c);
	assert_int_equal(fk_client_keeps(c->rk[3].c), 0);
	rank_connect(c, 2);
	retry_key(c, 0, 0);

	fake_cuda_hold(1);
	dispatch_submit_all(c, 1, 0);
	fk_client_die(c->rk[2].c);
	expect_err(c, 0, RW_E_PHASE, "a peer's pair failed");
	expect_err(c, 1, RW_E_PHASE, "a peer's pair failed");
	settle(c);
	expect_no_cqe(c, 3);
	rw_ipc_client_t *gone = c->rk[3].c;
	fk_client_die(gone); /* leaves before its answer */
	settle(c);
	assert_int_equal(fk_client_keeps(gone), 1); /* its buffer still mapped for the copies */
	fake_cuda_hold(0);
	settle(c);
	assert_int_equal(fk_client_keeps(gone), 0);
	expect_no_timeouts(c);
	rank_connect(c, 2);
	rank_connect_cuda(c, 3);
	retry_key(c, 1, 0);
	cl_free(c);
}

/* A GPU whose copies stop landing (docs/rankpath.md "A hung GPU"): with the stall bound at 50 ms
 * and the stand-in holding every stream's work, CUDA rank 3's input copies never land; its
 * node's pair fails on its own once the bound passed (no rank died, no phase timeout), every
 * rank answered, GPU 0 listed stalled and the pair's staging held; a retry meanwhile is
 * refused at once on node 1 (GPU 0 is stalled), without queueing a copy. Once the copies land,
 * GPU 0 moves again, the staging is freed and the key passes. */
static void test_cuda_stall(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	cl_t *c = cuda_copies_held(870, 50, NULL);
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		CHECK(q.status == RW_CQ_ERROR && (q.error == RW_E_CUDA || q.error == RW_E_PHASE),
		      "stalled: rank %u: status %u error %d", r, q.status, q.error);
	}
	/* Rank 3 is answered once its GPU is declared stalled, told its copies may still land;
	 * its buffer stays mapped for them */
	assert_non_null(strstr(fk_client_notice(c->rk[3].c),
			       "GPU 0 stalled, copies into this rank may still land"));
	assert_int_equal(fk_client_keeps(c->rk[3].c), 1);
	int dev[4];
	uint64_t held = 0;
	assert_int_equal(rw_svc_gpu_stalled_list(dev, 4, &held), 1);
	assert_int_equal(dev[0], 0);
	assert_true(held > 0); /* rank 3's staging, kept for the copies into it */
	char why[160];
	assert_true(rw_svc_gpu_stalled(0, why, sizeof(why)));
	assert_non_null(strstr(why, "GPU 0 is stalled: copies queued"));
	fake_cuda_hold(0);
	settle(c);
	assert_int_equal(rw_svc_gpu_stalled_list(dev, 4, &held), 0);
	assert_int_equal(held, 0); /* freed once they landed */
	assert_int_equal(fk_client_keeps(c->rk[3].c), 0);
	stall_case_end(c);
}

/* A stream-ordered CUDA rank (RW_SQE_SIGNAL) whose GPU stalls with its copies queued: its error
 * goes out once the stall is declared, but its flag, a synchronous write on that GPU that would
 * hold the loop, is not written then; it is written once the copies landed (docs/rankpath.md
 * "A hung GPU"). */
static void test_cuda_stall_flag(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	volatile uint32_t *flag;
	cl_t *c = cuda_copies_held(890, 50, &flag);
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		CHECK(q.status == RW_CQ_ERROR, "stalled: rank %u: status %u", r, q.status);
	}
	assert_non_null(strstr(fk_client_notice(c->rk[3].c), "GPU 0 stalled, copies"));
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 0); /* not on the stalled GPU */
	assert_int_equal(*flag, 0);
	fake_cuda_hold(0);
	settle(c);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 1); /* once its copies landed */
	assert_int_equal(*flag, 9);
	stall_case_end(c);
}

/* Rank 3 submits a stream-ordered combine (event 5, value `value`) that is refused at once: no
 * dispatch of step 5 is open. */
static void refused_signalled(cl_t *c, uint32_t value)
{
	rw_sqe_t s = combine_sqe(c, 3, 5, 0);
	s.flags = RW_SQE_SIGNAL;
	s.event_id = 5;
	s.output.reserved = value;
	fk_client_submit(c->rk[3].c, &s);
	expect_err_now(c, 3, RW_E_HANDLE, "a combine with no dispatch open");
}

/* GPU 0 stalled (cuda_copies_held with the bound at 50 ms: every rank answered, GPU 0 listed),
 * then rank 3's refused_signalled: its flag, a synchronous write on the stalled GPU that would
 * hold the loop, is not written with the error. */
static void refused_on_stalled(cl_t *c, uint32_t value)
{
	for (uint32_t r = 0; r < c->W; r++) {
		rw_cqe_t q = next_cqe(c, r);
		CHECK(q.status == RW_CQ_ERROR, "stalled: rank %u: status %u", r, q.status);
	}
	assert_true(rw_svc_gpu_stalled(0, NULL, 0));
	const uint32_t before = fk_client_flags_written(c->rk[3].c);
	refused_signalled(c, value);
	settle(c);
	assert_true(rw_svc_gpu_stalled(0, NULL, 0));
	assert_int_equal(fk_client_flags_written(c->rk[3].c), before); /* not during the stall */
}

/* A stream-ordered submission refused while its GPU is stalled: its flag is not written then,
 * and is written exactly once when the GPU moves again (before, never: the rank's stream that
 * waits on it waited forever after the GPU recovered). */
static void test_cuda_stall_refused_flag(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	cl_t *c = cuda_copies_held(892, 50, NULL);
	volatile uint32_t *flag = fk_client_flag_event(c->rk[3].c, 5);
	assert_non_null(flag);
	*flag = 0;
	refused_on_stalled(c, 11);
	assert_int_equal(*flag, 0);
	fake_cuda_hold(0);
	settle(c);
	assert_false(rw_svc_gpu_stalled(0, NULL, 0));
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 1);
	assert_int_equal(*flag, 11);
	settle(c);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 1); /* once */
	stall_case_end(c);
}

/* Two flags of one event owed across the stall: the held answer's (value 9, its copies queued)
 * and a refused submission's (value 10). Once the GPU moves, the event's flag is written once,
 * with the newer value (the rank's stream waits GEQ on increasing values: 10 releases both
 * waits; 9 written after 10 would hold the second). */
static void test_cuda_stall_flags_one_event(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	volatile uint32_t *flag;
	cl_t *c = cuda_copies_held(893, 50, &flag);
	refused_on_stalled(c, 10);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 0);
	fake_cuda_hold(0);
	settle(c);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 1);
	assert_int_equal(*flag, 10);
	stall_case_end(c);
}

/* An older value never written over a newer one: rank 3's answer held for its copies (a host
 * rank left, no stall declared) owes value 9 of event 5; a refusal meanwhile writes 10 at once
 * (its GPU is not stalled). Once the copies land the held answer goes out and its 9 is not
 * written (before: it was, and a stream waiting for 10 would have waited forever). */
static void test_cuda_flag_held_older(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	volatile uint32_t *flag;
	cl_t *c = cuda_copies_held(896, 600000, &flag); /* a stall never declared in the case */
	fk_client_die(c->rk[2].c);
	expect_err(c, 0, RW_E_PHASE, "a peer's pair failed");
	expect_err(c, 1, RW_E_PHASE, "a peer's pair failed");
	settle(c);
	expect_no_cqe(c, 3); /* held for its copies */
	refused_signalled(c, 10);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 1);
	assert_int_equal(*flag, 10);
	fake_cuda_hold(0);
	expect_err(c, 3, RW_E_PHASE, "its copies landed");
	settle(c);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 1);
	assert_int_equal(*flag, 10);
	rank_connect(c, 2);
	stall_case_end(c);
}

/* A rank leaves while its refused submission's flag is owed on the stalled GPU: the flag goes
 * with it, never written after (the fake IPC counts a write for a client that left as a
 * violation: the real server has freed it); its buffer kept for the copies is freed once they
 * landed; the rank comes back and the key passes. */
static void test_cuda_stall_flag_leave(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	cl_t *c = cuda_copies_held(894, 50, NULL);
	assert_non_null(fk_client_flag_event(c->rk[3].c, 5));
	refused_on_stalled(c, 12);
	rw_ipc_client_t *gone = c->rk[3].c;
	fk_client_die(gone);
	settle(c);
	fake_cuda_hold(0);
	settle(c);
	assert_false(rw_svc_gpu_stalled(0, NULL, 0));
	assert_int_equal(fk_client_flags_written(gone), 0);
	assert_int_equal(fk_client_keeps(gone), 0);
	rank_connect_cuda(c, 3);
	stall_case_end(c);
}

/* The daemon stops with a refused submission's flag owed on a GPU still stalled: dropped, logged
 * (rw_svc_exec_ipc_stop's flush), never written after, even once the GPU moves. */
static void test_cuda_stall_flag_stop(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	cl_t *c = cuda_copies_held(895, 50, NULL);
	volatile uint32_t *flag = fk_client_flag_event(c->rk[3].c, 5);
	assert_non_null(flag);
	*flag = 0;
	refused_on_stalled(c, 13);
	exec_answer_late_flush(c->svc[c->rk[3].node].exec);
	fake_cuda_hold(0);
	settle(c);
	assert_false(rw_svc_gpu_stalled(0, NULL, 0));
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 0);
	assert_int_equal(*flag, 0);
	rw_svc_gpu_stall_set(0);
	cl_free(c);
}

/* Shutdown stopped waiting (its drain cap) while a CUDA rank's copies are still queued on a GPU
 * not declared stalled: the held answer says the copies may still land, and the rank's
 * stream-ordered flag, a synchronous write to that busy GPU, is not written — neither then nor
 * once the copies land after. rw_svc_exec_ipc_stop's steps (exec_fail_open, then
 * exec_answer_late_flush) without its wait, which would run out only at gpu_stall_ms + 2 s. */
static void test_cuda_flush_unlanded(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	volatile uint32_t *flag;
	cl_t *c = cuda_copies_held(891, 600000, &flag); /* a stall never declared in the case */
	exec_t *x = c->svc[c->rk[3].node].exec;
	exec_fail_open(x, "daemon stopping"); /* rw_svc_exec_ipc_stop's steps, the drain's wait out */
	settle(c);
	expect_no_cqe(c, 3); /* held for its copies */
	exec_answer_late_flush(x);
	rw_cqe_t q = next_cqe(c, 3);
	assert_int_equal(q.status, RW_CQ_ERROR);
	assert_non_null(strstr(fk_client_notice(c->rk[3].c), "GPU 0 busy at shutdown, copies "
							     "into this rank may still land"));
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 0);
	fake_cuda_hold(0);
	settle(c);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 0); /* the answer is gone: no flag */
	assert_int_equal(*flag, 0);
	rw_svc_gpu_stall_set(0);
	cl_free(c);
}

/* ================================================================================================
 * The count row on the GPU (docs/dataflow.md "Count on the GPU"): the CUDA mover listed first, as
 * main.c lists it, on the kernel stand-in (tests/integration/libfakecuda_kern.so, whose kernels
 * run on the CPU; tests/service/svc_exec_gpu.sh runs these cases with it, at once and with a
 * lagging stream). Elsewhere, or in a build without kernels, they skip.
 * ================================================================================================ */

static int gpu_mover_ready(void)
{
	return rw_cuda_init() == RW_OK && rw_cuda_kernels_available(0);
}

/* A cluster whose ranks in `cuda` (bit r: global rank r) keep their buffers in CUDA memory. */
static cl_t *gpu_cluster(opts_t *o, uint64_t salt, uint32_t cuda)
{
	o->cuda_mover = 1;
	cl_t *c = cl_new(o, salt);
	for (uint32_t r = 0; r < c->W; r++)
		if (cuda >> r & 1)
			fk_client_die(c->rk[r].c);
	settle(c);
	for (uint32_t r = 0; r < c->W; r++)
		if (cuda >> r & 1)
			rank_connect_cuda(c, r);
	settle(c);
	return c;
}

/* The CUDA ranks submit first, so the CUDA mover takes every node's pair (the first submission
 * picks the mover); bad: per rank, the sub_opts (NULL: none). */
static void gpu_dispatch(cl_t *c, uint32_t cuda, uint32_t step, uint32_t layer,
			 const sub_opts_t *const *bad)
{
	for (int host = 0; host < 2; host++)
		for (uint32_t r = 0; r < c->W; r++)
			if (((cuda >> r) & 1) == (uint32_t)!host)
				dispatch_submit(c, r, step, layer, bad ? bad[r] : NULL);
}

static void expect_counts(cl_t *c, uint32_t n, uint64_t gpu, uint64_t host, const char *when)
{
	const rw_svc_metrics_t *m = &c->svc[n].metrics;
	CHECK(m->counts_gpu == gpu && m->counts_host == host, "%s: node %u counted %llu rows on the "
	      "GPU and %llu on the host, expected %llu and %llu", when, n,
	      (unsigned long long)m->counts_gpu, (unsigned long long)m->counts_host,
	      (unsigned long long)gpu, (unsigned long long)host);
}

/* Every CUDA rank: each forced path and the selector over fp32/bf16 layers, exact; every row
 * came from the GPU. Then with empty phases: a node whose ranks route nothing is counted on the
 * host (nothing to launch), the others on the GPU, every phase exact. */
static void test_gpu_count_paths(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names); pi++) {
		opts_t o = { .nodes = 2, .path = path_names[pi], .experts = 24, .empty = pi == 4 };
		cl_t *c = gpu_cluster(&o, 870 + pi, 0xf);
		for (uint32_t layer = 0; layer < 3; layer++) {
			gpu_dispatch(c, 0xf, 1, layer, NULL);
			dispatch_collect(c, 1, layer);
			combine_all(c, 1, layer);
		}
		for (uint32_t n = 0; n < c->N; n++) {
			const rw_svc_metrics_t *m = &c->svc[n].metrics;
			if (o.empty)
				CHECK(m->counts_gpu >= 1 && m->counts_gpu + m->counts_host == 3,
				      "node %u: %llu rows from the GPU, %llu from the host", n,
				      (unsigned long long)m->counts_gpu, (unsigned long long)m->counts_host);
			else
				expect_counts(c, n, 3, 0, path_names[pi]);
		}
		cl_free(c);
	}
}

/* Mixed nodes: rank 0 (node 0) and rank 3 (node 1) on the GPU, ranks 1 and 2 in host memory:
 * the CUDA mover counts its CUDA rank on the GPU and the host-memory one on the CPU, and the
 * sum is the row (every result exact); with RAILWAVE_CUDA_MOVER=check the daemon counts every
 * rank on the host too and the two agree (a difference would fail the phase). */
static void test_gpu_count_mixed(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	for (int check = 0; check < 2; check++) {
		if (check)
			setenv("RAILWAVE_CUDA_MOVER", "check", 1); /* read when the mover is created */
		opts_t o = { .nodes = 2, .path = check ? "joint" : "auto" };
		cl_t *c = gpu_cluster(&o, 880 + (uint64_t)check, 0x9);
		unsetenv("RAILWAVE_CUDA_MOVER");
		for (uint32_t layer = 0; layer < 3; layer++) {
			gpu_dispatch(c, 0x9, 0, layer, NULL);
			dispatch_collect(c, 0, layer);
			combine_all(c, 0, layer);
		}
		for (uint32_t n = 0; n < c->N; n++)
			expect_counts(c, n, 3, 0, check ? "mixed, check" : "mixed");
		cl_free(c);
	}
}

/* An expert id out of range on a CUDA rank, found by the count kernel: that rank gets
 * RW_E_TOKENS and is named, every other rank RW_E_PHASE, on both nodes, without a timeout; the
 * same key then passes. Rank 0 keeps host memory: when it and CUDA rank 1 both hold a bad id,
 * rank 0 is named (the lowest, as the host count pass names it). */
static void test_gpu_count_bad_id(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	opts_t o = { .nodes = 2, .path = "native", .tokens = 16 };
	const uint32_t cuda = 0xe;
	cl_t *c = gpu_cluster(&o, 890, cuda);
	sub_opts_t bad = { .bad_id = (int32_t)c->E };
	const sub_opts_t *one[4] = { NULL, &bad, NULL, NULL }, *two[4] = { &bad, &bad, NULL, NULL };
	for (uint32_t layer = 0; layer < 2; layer++) {
		uint32_t culprit = layer ? 0 : 1;
		char name[32];
		snprintf(name, sizeof(name), "local rank %u:", culprit);
		gpu_dispatch(c, cuda, 0, layer, layer ? two : one);
		for (uint32_t r = 0; r < c->W; r++)
			expect_err(c, r, r == culprit ? RW_E_TOKENS : RW_E_PHASE, "bad id on a CUDA rank");
		CHECK(strstr(fk_client_notice(c->rk[culprit].c), name), "layer %u: rank %u was told '%s'",
		      layer, culprit, fk_client_notice(c->rk[culprit].c));
		expect_counts(c, 0, 2 * layer + 1, 0, "bad id");
		expect_no_timeouts(c);
		settle(c);
		gpu_dispatch(c, cuda, 0, layer, NULL); /* the retry of the same key */
		dispatch_collect(c, 0, layer);
		combine_all(c, 0, layer);
		expect_counts(c, 0, 2 * layer + 2, 0, "retry");
	}
	cl_free(c);
}

/* Slabs on a GPU (service/mover/mover.h "Where the slabs are"; GPUDirect RDMA with the NIC played by
 * the fakes): every node's rail memory is device memory, each write is copied device to device
 * and nothing lands in the host shadow, so a header the CPU wrote and did not copy over, or one
 * it read without copying it back, breaks the phase. Over every forced path and the selector,
 * fp32 and bf16 layers, exact: every rank CUDA (the CUDA mover: headers copied with the pieces,
 * arrived headers pulled), CUDA and host-memory ranks mixed (the CUDA mover), and every rank in
 * host memory (the host mover: whole slabs pushed and pulled). The stand-in orders no NIC
 * write, so the movers must have flushed before reading. */
static void test_gpu_dev_slabs(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	static const uint32_t cuda_sets[] = { 0xf, 0x9, 0x0 };
	for (uint32_t ci = 0; ci < RW_ARRAY_SIZE(cuda_sets); ci++)
		for (uint32_t pi = 0; pi < RW_ARRAY_SIZE(path_names); pi++) {
			const uint32_t cuda = cuda_sets[ci];
			opts_t o = { .nodes = 2, .path = path_names[pi], .dev_slabs = 1, .max_write = 4096 };
			cl_t *c = gpu_cluster(&o, 940 + 8 * ci + pi, cuda);
			const unsigned flushes = fake_gdr_flushes ? fake_gdr_flushes() : 0;
			for (uint32_t layer = 0; layer < 2; layer++) {
				gpu_dispatch(c, cuda, 2, layer, NULL);
				dispatch_collect(c, 2, layer);
				combine_all(c, 2, layer);
			}
			CHECK(!fake_gdr_flushes || fake_gdr_flushes() > flushes, "ranks %#x, %s: no "
			      "GPUDirect flush before reading the slabs", cuda, path_names[pi]);
			cl_free(c);
		}
}

/* A peer's bad record into a slab on a GPU: the CUDA mover reads the headers after a pull, so it
 * refuses the range asynchronously (RW_MV_OP_REFUSED). The receiver still declares the peer
 * down and fails the phase on both nodes, without a timeout; the link comes back and the same
 * key passes. */
static void test_gpu_dev_slabs_bad_record(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	opts_t o = { .nodes = 2, .path = "native", .tokens = 16, .dev_slabs = 1 };
	cl_t *c = gpu_cluster(&o, 960, 0xf);
	corrupt_once = 1;
	c->w->on_write = corrupt_tag;
	memset(&c->w->cnt, 0, sizeof(c->w->cnt));
	gpu_dispatch(c, 0xf, 0, 0, NULL);
	/* Node 0 took the bad record: its ranks' dispatch fails. Node 1 may have had every row it
	 * needed before node 0 dropped it (on a real GPU it often has): its ranks' dispatch passes
	 * and their combine fails, or their dispatch fails. */
	for (uint32_t r = 0; r < c->G; r++)
		expect_err(c, r, RW_E_PHASE, "bad record from node 1 into a GPU slab");
	for (uint32_t r = c->G; r < c->W; r++)
		expect_phase_err(c, r, 0, 0, "bad record from node 1 into a GPU slab (node 1)");
	CHECK(!corrupt_once, "no write was corrupted");
	CHECK(c->w->cnt.fail_peer[0][1] == 1, "node 0 did not declare node 1 down");
	expect_no_timeouts(c);
	c->w->on_write = NULL;
	pump_until(c, mesh_up, NULL, "the link back");
	gpu_dispatch(c, 0xf, 1, 0, NULL);
	dispatch_collect(c, 1, 0);
	combine_all(c, 1, 0);
	cl_free(c);
}

/* The owner's sum in the documented order (combine_order_check) with CUDA ranks: the host mover
 * staging ranks 0 and 3 (their sums written into pinned staging, then copied up), and the CUDA
 * mover (every rank on the GPU; then ranks 0 and 3 only: host-memory owners' sums go through
 * their staging; then every rank with the slabs in device memory: the rows that come back are
 * read from the GPU slab), node 1's rows reaching node 0 before its ranks submit and after. */
static void test_cuda_combine_order(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	for (int rows_first = 1; rows_first >= 0; rows_first--) {
		opts_t o = { .nodes = 2, .path = "native", .tokens = 24 };
		cl_t *c = cl_new(&o, 855 + (uint32_t)rows_first);
		fk_client_die(c->rk[0].c);
		fk_client_die(c->rk[3].c);
		settle(c);
		rank_connect_cuda(c, 0);
		rank_connect_cuda(c, 3);
		for (uint32_t layer = 0; layer < 2; layer++) {
			dispatch_all(c, 0, layer);
			CHECK(combine_order_check(c, 0, layer, rows_first) > 0, "no token to tell orders apart");
		}
		cl_free(c);
	}
}

static void test_gpu_combine_order(void **state)
{
	(void)state;
	if (!gpu_mover_ready())
		skip();
	static const uint32_t masks[] = { 0xf, 0x9, 0xf };
	for (size_t mi = 0; mi < RW_ARRAY_SIZE(masks); mi++)
		for (int rows_first = 1; rows_first >= 0; rows_first--) {
			opts_t o = { .nodes = 2, .path = mi == 1 ? "joint" : "native", .tokens = 24,
				     .dev_slabs = mi == 2 };
			cl_t *c = gpu_cluster(&o, 895 + mi * 2 + (uint32_t)rows_first, masks[mi]);
			for (uint32_t layer = 0; layer < 2; layer++) {
				gpu_dispatch(c, masks[mi], 0, layer, NULL);
				dispatch_collect(c, 0, layer);
				CHECK(combine_order_check(c, 0, layer, rows_first) > 0,
				      "no token to tell orders apart");
			}
			cl_free(c);
		}
}

/* The older value of a submission still in a pair is not written over a newer one: rank 3's
 * dispatch (event 5, value 9) waits in its pair for the other ranks; its combine (value 10) is
 * refused at once and writes 10; then the pair fails (rank 2 dies): its error answer's 9 is not
 * written over the 10 (before, it was, and a stream not yet at its wait for 10 waited forever). */
static void test_cuda_flag_open_older(void **state)
{
	(void)state;
	if (!cuda_stand_in())
		skip();
	volatile uint32_t *flag;
	cl_t *c = cuda_rank3(897, &flag);
	const sub_opts_t so = { .signal_event = 5, .flag_value = 9 };
	dispatch_submit(c, 3, 0, 0, &so); /* its pair waits for the other ranks */
	settle(c);
	rw_sqe_t s = combine_sqe(c, 3, 5, 0);
	s.flags = RW_SQE_SIGNAL;
	s.event_id = 5;
	s.output.reserved = 10;
	fk_client_submit(c->rk[3].c, &s);
	settle(c);
	assert_int_equal(*flag, 10);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 1);
	fk_client_die(c->rk[2].c); /* the pair fails: rank 3's dispatch is answered with an error */
	settle(c);
	assert_int_equal(*flag, 10);
	assert_int_equal(fk_client_flags_written(c->rk[3].c), 1);
	cl_free(c);
}

int exec_gpu_run(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_cuda_flag_open_older),
		cmocka_unit_test(test_cuda_ranks),
		cmocka_unit_test(test_cuda_rank_lost),
		cmocka_unit_test(test_cuda_answer_late),
		cmocka_unit_test(test_cuda_stall),
		cmocka_unit_test(test_cuda_stall_flag),
		cmocka_unit_test(test_cuda_stall_refused_flag),
		cmocka_unit_test(test_cuda_stall_flags_one_event),
		cmocka_unit_test(test_cuda_flag_held_older),
		cmocka_unit_test(test_cuda_stall_flag_leave),
		cmocka_unit_test(test_cuda_stall_flag_stop),
		cmocka_unit_test(test_cuda_flush_unlanded),
		cmocka_unit_test(test_cuda_combine_order),
		cmocka_unit_test(test_gpu_count_paths),
		cmocka_unit_test(test_gpu_count_mixed),
		cmocka_unit_test(test_gpu_count_bad_id),
		cmocka_unit_test(test_gpu_dev_slabs),
		cmocka_unit_test(test_gpu_dev_slabs_bad_record),
		cmocka_unit_test(test_gpu_combine_order),
	};
	return cmocka_run_group_tests_name("svc_exec_gpu", tests, NULL, NULL);
}
