/* The executor's stage machine (service/exec/exec_stage.c): the tables of legal changes of a
 * pair's stage and of its sender's state against oracles written out here edge by edge, every
 * legal change made and every other one refused (the stage stays; the sanitizer build aborts,
 * seen from a child process), and the shape of the machines: every stage reachable from
 * GATHER_D, every open stage able to close, CLOSED final, the kind a pair runs following from its
 * stage; every sender state reachable from IDLE and able to reach DONE. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "config.h"
#include "service/exec/exec_int.h"

/* The stage changes the executor makes, one line each, as docs/dataflow.md "Phase executor"
 * tells them; any other is a bug. */
static const struct { exec_stage_t from, to; } legal_edges[] = {
	{ ST_GATHER_D, ST_COUNT_HOST },   /* every rank's ids readable: the host counts */
	{ ST_GATHER_D, ST_COUNT_MOVER },  /* every rank submitted: the mover counts */
	{ ST_COUNT_HOST, ST_WAIT_SLOT },  /* counted, both receive slots held by other groups */
	{ ST_COUNT_HOST, ST_EXCHANGE },   /* counted, row sent in a free slot */
	{ ST_COUNT_MOVER, ST_WAIT_SLOT },
	{ ST_COUNT_MOVER, ST_EXCHANGE },
	{ ST_WAIT_SLOT, ST_EXCHANGE },    /* the tick found a slot */
	{ ST_EXCHANGE, ST_RUN_D },        /* every row here, records built: decided */
	{ ST_RUN_D, ST_FLUSH_D },         /* every dispatch byte here and sent */
	{ ST_FLUSH_D, ST_WAIT_C },        /* outputs written: the dispatch completes */
	{ ST_WAIT_C, ST_RUN_C },          /* every combine input readable */
	{ ST_RUN_C, ST_FLUSH_C },
	/* closing: a failure anywhere, an abandoned pair, a dispatch done while draining */
	{ ST_GATHER_D, ST_CLOSED }, { ST_COUNT_HOST, ST_CLOSED }, { ST_COUNT_MOVER, ST_CLOSED },
	{ ST_WAIT_SLOT, ST_CLOSED }, { ST_EXCHANGE, ST_CLOSED }, { ST_RUN_D, ST_CLOSED },
	{ ST_FLUSH_D, ST_CLOSED }, { ST_WAIT_C, ST_CLOSED }, { ST_RUN_C, ST_CLOSED },
	{ ST_FLUSH_C, ST_CLOSED },
};
#define N_LEGAL (sizeof(legal_edges) / sizeof(legal_edges[0]))

/* The sender's changes (exec_send.c). */
static const struct { exec_send_state_t from, to; } send_edges[] = {
	{ SEND_IDLE, SEND_POSTING },        /* the first wave */
	{ SEND_IDLE, SEND_WAIT_GRANT },     /* its destination has not admitted us */
	{ SEND_IDLE, SEND_DONE },           /* no wave at all (one node) */
	{ SEND_WAIT_GRANT, SEND_POSTING },  /* granted */
	{ SEND_POSTING, SEND_DRAINING },    /* the wave's writes are out */
	{ SEND_POSTING, SEND_PACED },       /* the write-gap hook's budget ran out */
	{ SEND_POSTING, SEND_WAIT_PACK },   /* the mover's bytes are not written yet */
	{ SEND_PACED, SEND_POSTING },       /* the pace timer */
	{ SEND_WAIT_PACK, SEND_POSTING },   /* RW_MV_OP_PACKED */
	{ SEND_DRAINING, SEND_POSTING },    /* writes done: the next wave */
	{ SEND_DRAINING, SEND_WAIT_GRANT }, /* writes done, the next destination not ready */
	{ SEND_DRAINING, SEND_DONE },       /* writes done after the last wave */
	{ SEND_DONE, SEND_IDLE },           /* the combine's sender starts */
};
#define N_SEND (sizeof(send_edges) / sizeof(send_edges[0]))

static int send_oracle(exec_send_state_t from, exec_send_state_t to)
{
	for (size_t i = 0; i < N_SEND; i++)
		if (send_edges[i].from == from && send_edges[i].to == to)
			return 1;
	return 0;
}

static int oracle(exec_stage_t from, exec_stage_t to)
{
	for (size_t i = 0; i < N_LEGAL; i++)
		if (legal_edges[i].from == from && legal_edges[i].to == to)
			return 1;
	return 0;
}

static exec_pair_t *pair_at(exec_stage_t s)
{
	exec_pair_t *p = calloc(1, sizeof(*p));
	assert_non_null(p);
	p->key = (rw_wire_key_t){ .group = 7, .layer = 3, .step = 11 };
	p->stage = s;
	return p;
}

/* The table says exactly what the oracle says, for every ordered pair of stages. */
static void test_table_matches_oracle(void **state)
{
	(void)state;
	unsigned legal = 0;
	for (int from = 0; from < EXEC_STAGES; from++)
		for (int to = 0; to < EXEC_STAGES; to++) {
			int want = oracle((exec_stage_t)from, (exec_stage_t)to);
			if (exec_stage_legal((exec_stage_t)from, (exec_stage_t)to) != want)
				fail_msg("%s -> %s: table says %d, oracle %d",
					 exec_stage_name((exec_stage_t)from), exec_stage_name((exec_stage_t)to),
					 !want, want);
			legal += (unsigned)want;
		}
	assert_int_equal(legal, N_LEGAL);
	/* Out of range is never legal. */
	assert_false(exec_stage_legal(EXEC_STAGES, ST_CLOSED));
	assert_false(exec_stage_legal(ST_GATHER_D, EXEC_STAGES));
	assert_false(exec_stage_legal((exec_stage_t)-1, ST_CLOSED));
}

/* Every legal edge is taken by exec_stage_move: RW_OK and the pair is in the new stage. */
static void test_every_legal_edge_moves(void **state)
{
	(void)state;
	for (size_t i = 0; i < N_LEGAL; i++) {
		exec_pair_t *p = pair_at(legal_edges[i].from);
		assert_int_equal(exec_stage_move(p, legal_edges[i].to), RW_OK);
		assert_int_equal(p->stage, legal_edges[i].to);
		free(p);
	}
}

/* An illegal edge, run in a child: refused with RW_ERR_STATE and the stage kept (exit 0), or,
 * in the sanitizer build, an abort. Returns what the child did as the test expects it. */
static int illegal_in_child(exec_stage_t from, exec_stage_t to)
{
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		exec_pair_t *p = pair_at(from);
		rw_status_t st = exec_stage_move(p, to);
		_exit(st == RW_ERR_STATE && p->stage == from ? 0 : 1);
	}
	int status = 0;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	if (RW_SANITIZE)
		return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
	return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static void test_illegal_edges_refused(void **state)
{
	(void)state;
	/* A few by hand: skipping the count, running the combine before the dispatch completed,
	 * going back, leaving CLOSED, staying put. */
	static const struct { exec_stage_t from, to; } bad[] = {
		{ ST_GATHER_D, ST_EXCHANGE }, { ST_RUN_D, ST_RUN_C }, { ST_RUN_D, ST_WAIT_C },
		{ ST_WAIT_C, ST_GATHER_D }, { ST_CLOSED, ST_GATHER_D }, { ST_EXCHANGE, ST_EXCHANGE },
		{ ST_FLUSH_C, ST_WAIT_C },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		assert_false(oracle(bad[i].from, bad[i].to));
		if (!illegal_in_child(bad[i].from, bad[i].to))
			fail_msg("%s -> %s was not refused", exec_stage_name(bad[i].from),
				 exec_stage_name(bad[i].to));
	}
	/* And every other illegal edge, in the build that refuses without aborting. */
	if (RW_SANITIZE)
		return;
	for (int from = 0; from < EXEC_STAGES; from++)
		for (int to = 0; to < EXEC_STAGES; to++) {
			if (oracle((exec_stage_t)from, (exec_stage_t)to))
				continue;
			exec_pair_t *p = pair_at((exec_stage_t)from);
			assert_int_equal(exec_stage_move(p, (exec_stage_t)to), RW_ERR_STATE);
			assert_int_equal(p->stage, from);
			free(p);
		}
}

/* Every stage is reachable from GATHER_D, every open stage can close, CLOSED goes nowhere, and
 * every stage has its own name. */
static void test_machine_shape(void **state)
{
	(void)state;
	int seen[EXEC_STAGES] = { 0 };
	exec_stage_t todo[EXEC_STAGES];
	int n = 0;
	todo[n++] = ST_GATHER_D;
	seen[ST_GATHER_D] = 1;
	while (n > 0) {
		exec_stage_t s = todo[--n];
		for (int to = 0; to < EXEC_STAGES; to++)
			if (exec_stage_legal(s, (exec_stage_t)to) && !seen[to]) {
				seen[to] = 1;
				todo[n++] = (exec_stage_t)to;
			}
	}
	for (int s = 0; s < EXEC_STAGES; s++) {
		if (!seen[s])
			fail_msg("%s is not reachable from GATHER_D", exec_stage_name((exec_stage_t)s));
		if (s != ST_CLOSED)
			assert_true(exec_stage_legal((exec_stage_t)s, ST_CLOSED));
		assert_false(exec_stage_legal(ST_CLOSED, (exec_stage_t)s));
		const char *name = exec_stage_name((exec_stage_t)s);
		assert_string_not_equal(name, "?");
		for (int t = 0; t < s; t++)
			assert_string_not_equal(name, exec_stage_name((exec_stage_t)t));
	}
	assert_string_equal(exec_stage_name(EXEC_STAGES), "?");
}

/* The running kind follows from the stage: dispatch through FLUSH_D, combine from WAIT_C. */
static void test_kind_from_stage(void **state)
{
	(void)state;
	static const exec_stage_t path[] = { ST_GATHER_D, ST_COUNT_MOVER, ST_WAIT_SLOT,
					     ST_EXCHANGE, ST_RUN_D, ST_FLUSH_D, ST_WAIT_C,
					     ST_RUN_C, ST_FLUSH_C, ST_CLOSED };
	exec_pair_t *p = pair_at(ST_GATHER_D);
	for (size_t i = 0; i < sizeof(path) / sizeof(path[0]); i++) {
		if (i > 0)
			assert_int_equal(exec_stage_move(p, path[i]), RW_OK);
		assert_int_equal(exec_kind(p), path[i] < ST_WAIT_C ? RW_SVC_DISPATCH : RW_SVC_COMBINE);
		assert_int_equal(exec_open(p), path[i] != ST_CLOSED);
	}
	free(p);
}

/* The sender's table is the oracle's; its legal changes are made, the others refused (in the
 * build that refuses without aborting; the sanitizer build's abort is seen from a child). */
static void test_send_table(void **state)
{
	(void)state;
	unsigned legal = 0;
	for (int from = 0; from < EXEC_SEND_STATES; from++)
		for (int to = 0; to < EXEC_SEND_STATES; to++) {
			const int want = send_oracle((exec_send_state_t)from, (exec_send_state_t)to);
			if (exec_send_legal((exec_send_state_t)from, (exec_send_state_t)to) != want)
				fail_msg("send %s -> %s: table says %d, oracle %d",
					 exec_send_state_name((exec_send_state_t)from),
					 exec_send_state_name((exec_send_state_t)to), !want, want);
			legal += (unsigned)want;
			if (RW_SANITIZE && !want)
				continue;
			exec_pair_t *p = pair_at(ST_RUN_D);
			p->send.state = (exec_send_state_t)from;
			assert_int_equal(exec_send_move(p, (exec_send_state_t)to),
					 want ? RW_OK : RW_ERR_STATE);
			assert_int_equal(p->send.state, want ? to : from);
			free(p);
		}
	assert_int_equal(legal, N_SEND);
	assert_false(exec_send_legal(EXEC_SEND_STATES, SEND_IDLE));
	if (RW_SANITIZE) { /* one illegal change, in a child: it aborts */
		pid_t pid = fork();
		assert_true(pid >= 0);
		if (pid == 0) {
			exec_pair_t *p = pair_at(ST_RUN_D);
			p->send.state = SEND_DRAINING;
			exec_send_move(p, SEND_PACED);
			_exit(0);
		}
		int status = 0;
		assert_int_equal(waitpid(pid, &status, 0), pid);
		assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
	}
	/* Every state is reachable from IDLE, and DONE from every state. */
	for (int s = 0; s < EXEC_SEND_STATES; s++) {
		int reach = 0, seen[EXEC_SEND_STATES] = { 0 };
		exec_send_state_t todo[EXEC_SEND_STATES];
		int n = 0;
		todo[n++] = (exec_send_state_t)s;
		seen[s] = 1;
		while (n > 0) {
			exec_send_state_t at = todo[--n];
			reach |= at == SEND_DONE;
			for (int to = 0; to < EXEC_SEND_STATES; to++)
				if (exec_send_legal(at, (exec_send_state_t)to) && !seen[to]) {
					seen[to] = 1;
					todo[n++] = (exec_send_state_t)to;
				}
		}
		if (!reach)
			fail_msg("send %s cannot reach DONE", exec_send_state_name((exec_send_state_t)s));
		if (s == SEND_IDLE)
			for (int t = 0; t < EXEC_SEND_STATES; t++)
				assert_true(seen[t]);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_table_matches_oracle),
		cmocka_unit_test(test_every_legal_edge_moves),
		cmocka_unit_test(test_illegal_edges_refused),
		cmocka_unit_test(test_machine_shape),
		cmocka_unit_test(test_kind_from_stage),
		cmocka_unit_test(test_send_table),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
