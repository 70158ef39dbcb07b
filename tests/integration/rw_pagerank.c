/* A page rank for the rank path's tests against real railwaved daemons (docs/rankpath.md "A
 * phase"; tests/service/test_rankpage.py): it joins its group, takes its rank page and its
 * group's slab of every rail, and plays its stream's part from the CPU — what the count, pack
 * and forward kernels would write, in the protocol's order: parameters and count row, submit;
 * wait plan, every record where its plan entry says, packed; wait arrived, the rows its forward
 * list names checked against the workload, done. The workload is tests/lib/workload.h's (the
 * host job's), so every row, its metadata and the per-expert counts are checked against what
 * the host mover delivers for the same phase.
 *
 *   rw_pagerank SOCKET GROUP RANK NODES GPUS EXPERTS LAYERS STEPS SEED [MODE]
 *   MODE: ok        (default) every dispatch completes and is verified; exit 0 iff all passed
 *         lie       the first phase must fail on every rank (status set, plan or arrived
 *                   raised): rank 0's pack writes a record naming a token past its tokens (a
 *                   rank whose pack lied); then the rest runs as ok
 *         clie      the first combine must fail on every rank: rank 0's gather writes a return
 *                   whose slot field is wrong (a rank whose gather lied); then the rest as ok
 *         one       run the first phase only and say how it ended (a survivor of a rank's
 *                   death: "one: phase 1 passed" or "one: phase 1 failed: CODE: MESSAGE")
 *         until     run phases until one fails, then say how ("until: phase K failed: CODE:
 *                   MESSAGE", exit 0); "until: running" once the third passed (a peer daemon
 *                   killed mid-run)
 *         die-plan  submit the first phase, then exit without packing (a rank killed between
 *                   submit and packed)
 *         die-done  run the first phase up to arrived, then exit without done
 *         die-after run the first dispatch to its done, then exit before its combine
 *         late-until  as until, its first done written 0.5 s late
 *         lib       every dispatch and its combine through librailwave's rank path
 *                   (rw_client_rank_open, rw_client_rank_dispatch, rw_client_rank_combine,
 *                   rw_client_rank_wait: the count, pack, forward, gather and reduce
 *                   kernels on a stream of the CUDA driver $RW_CUDA_DRIVER names, the kernel
 *                   stand-in in CI), its outputs (rows, metadata, per-expert counts, every
 *                   token's combined row) checked as above; exit 77 where the library has no
 *                   rank path
 *         host      the same through the rank path of a host rank (RW_RANK_HOST: no CUDA, the
 *                   buffers host memory, rw_client_rank_wait packing and forwarding on this
 *                   CPU: rank/host.c); odd layers wait by looking with timeout 0 until done
 *         host-one, host-until   as one and until, through the host rank path (host-until: a
 *                   call refused because the daemon is gone, RW_E_CLOSED, is its phase failing)
 *         host-die  dispatch the first phase (submit), then exit before its pack
 *         host-bad  rank 0's first dispatch has an id past the experts (token 1): the first
 *                   phase must fail on this rank, named; then the rest as host
 *         host-rejoin  as host, but after step 0 the rank leaves (closes its rank path and
 *                   its connection), joins again and goes on at step 2: it skips step 1
 *         host-quit as host, but after step 0 the rank leaves for good: "quit after step 0"
 *         host-skip as host, with step 1 that must fail (a rank of the group skipped it):
 *                   "host-skip: phase K failed: CODE: MESSAGE"; then the rest as host
 *         host-abort as host, but at step 1 layer 0 the rank gives no combine: it aborts
 *                   it (rw_client_rank_abort), which must answer RW_E_PHASE: "host-abort:
 *                   phase K aborted: CODE: MESSAGE"; then the rest as host
 *         host-cskip as host, with step 1 layer 0's combine that must fail (another rank
 *                   aborted it): "host-cskip: phase K failed: CODE: MESSAGE"; then the rest
 *         host-pipe as host, but each combine is left in flight (not waited for) while the
 *                   next dispatch is made (two buffer sets): that call drives the combine to
 *                   its end first, as a stream's order would; its answer is then kept and
 *                   checked
 *         fuzz      every rank of the group with the same seed ($RW_PAGERANK_FUZZ, else SEED):
 *                   LAYERS x STEPS rounds, most with one rank hostile ("mode fuzz" below);
 *                   $RW_PAGERANK_FUZZ_DIR: where the ranks meet after a round whose attacker
 *                   left; exit 0 iff every check held
 * Modes lib and host open the rank path with the SM budget $RW_PAGERANK_SMS (0 or unset: none).
 * With RW_PAGERANK_GO=FILE the rank joins its group, then waits for FILE (at most 60 s) before it
 * takes its page: a harness lets the group's ring ranks submit first (a pair a ring rank opened
 * before any rank of its node held a page).
 * With RW_PAGERANK_DELAY_MS=N a host-rejoin rank waits N ms after it joined again, a host-skip
 * rank before its step 1: a harness picks which of the two keys a node's pair opens with first.
 * With RW_PAGERANK_LEAVE_DELAY_MS=N a host-rejoin rank waits N ms before it leaves: its node's
 * pair of step 1 is open when it goes.
 * With RW_PAGERANK_SUBMIT_GO=FILE a rank of the CPU-played modes takes its page and its group's
 * slabs, then waits for FILE (at most 60 s) before its first submit: a harness acts on the
 * group's carve-out while it holds it and has submitted nothing (its idle carve-out taken back).
 * With RW_PAGERANK_HOLD=FILE a rank of the library's modes stays connected after its last phase
 * until FILE exists (at most 60 s): a harness sees what the others get while it stays.
 * Output: "rank R: S steps x L layers dispatched on the rank path, verified (N rows)"; for lie
 * also "lie: phase K failed: CODE: MESSAGE"; for die-*: "dying at ..." before it exits 3. */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "cuda/rw_cuda.h"
#include "ipc/page.h"
#include "ipc/railwave.h"
#include "service/phase/wire.h"
#include "tests/lib/workload.h"

enum { TOPK = RW_WL_TOPK, MAX_ROWS = 3 * RW_WL_MAX_TOKENS, WAIT_S = 60, MAX_EXPERTS = 1024 };

#define CHECK(c, ...)                                                                            \
	do {                                                                                     \
		if (!(c)) {                                                                      \
			fprintf(stderr, "rank %u: ", me);                                        \
			fprintf(stderr, __VA_ARGS__);                                            \
			fprintf(stderr, "\n");                                                   \
			return 1;                                                                \
		}                                                                                \
	} while (0)

static uint32_t me, nodes, gpus, world, experts, per_rank, rails;
static rw_page_head_t *pg;
static rw_page_layout_t lay;
static rw_client_slab_t slabs[RW_CLIENT_SLAB_RAILS];
static uint32_t native, max_tokens, max_recv; /* the head's rail, bounds, read at join */
static int lax;                     /* mode fuzz: this round's rows are not checked (scribbled) */
static int kill_at = -1;            /* mode fuzz: the point of the phase the rank dies at */
static int kill_leaves;             /* mode fuzz: it says goodbye there instead of dying */
static rw_wl_work_t mine, *all; /* the rank's workload, and every rank's of the phase checked */
static uint8_t *seen;           /* [world * MAX_ROWS]: rows delivered */

static uint64_t word(unsigned w) { return atomic_load_explicit(&pg->word[w].v, memory_order_acquire); }
static void word_set(unsigned w, uint64_t v)
{
	atomic_store_explicit(&pg->word[w].v, v, memory_order_release);
}

/* As the stream's cuStreamWaitValue64 GEQ: until the daemon's word reaches k. 0, or -1 past
 * the bound (never a pass/fail timing criterion: a stuck phase). */
static int wait_word(unsigned w, uint64_t k)
{
	struct timespec ts = { 0, 50000 };
	for (long i = 0; i < WAIT_S * 20000L; i++) {
		if ((int64_t)(word(w) - k) >= 0)
			return 0;
		nanosleep(&ts, NULL);
	}
	return -1;
}

/* Why a phase failed: the daemon sends its sentence to the rank's control socket before it
 * writes the status (the executor's answer to a failed page rank); librailwave reads such notices
 * while a client waits, so a short wait (no completion comes to a page rank) takes it. */
static const char *reason(rw_client_t *c)
{
	rw_cqe_t cqe;
	(void)rw_client_wait(c, &cqe, 1, 20);
	return rw_client_last_message(c);
}

/* Mode fuzz: the rank dies here, as a SIGKILL finds it (no goodbye, nothing written), or
 * (kill_leaves) closes its connection and exits. */
static uint32_t *fz_next_round; /* mode fuzz: the round the rank's next life starts in */
static uint32_t *fz_no_meet;    /* mode fuzz: its next life goes on without meeting the others */
static uint32_t *fz_elsewhere;  /* mode fuzz: 1 + the round whose attacker's next life visits */
static int64_t fz_visit_round = -1; /* mode fuzz: this round's, when it is an elsewhere attack */
static rw_client_t *fz_client;
static uint64_t fz_seed;
enum { FZ_REJOIN = 4 }; /* a life's exit code: the rank comes back */

static _Noreturn void fz_die(const char *where)
{
	if (fz_next_round) /* the next life plays the next round */
		++*fz_next_round;
	if (fz_no_meet && kill_at == 0)
		*fz_no_meet = 1;
	if (fz_elsewhere && fz_visit_round >= 0)
		*fz_elsewhere = 1 + (uint32_t)fz_visit_round;
	printf("%s %s\n", kill_leaves ? "left" : "killed", where);
	fflush(stdout);
	if (kill_leaves) {
		rw_client_close(fz_client);
		_exit(FZ_REJOIN);
	}
	raise(SIGKILL);
	_exit(9);
}

/* wait_word, then phase k's status into *st_p (0, or the RW_E_* that failed it). */
static int wait_status(unsigned w, uint64_t k, int32_t *st_p)
{
	CHECK(wait_word(w, k) == 0, "phase %llu: no %s", (unsigned long long)k,
	      w == RW_PW_PLAN ? "plan" : "arrived");
	*st_p = (int32_t)atomic_load(&pg->status[k % RW_PAGE_DEPTH].v);
	return 0;
}

/* The path every rank asks for in (step, layer): each in turn (ipc/railwave.h enum
 * rw_path_request: the daemon's choice, native, rail-only, permutation-only, joint), so a run
 * of 5 phases or more covers them all. */
static uint16_t path_of(uint32_t step, uint32_t layer)
{
	return (uint16_t)((step * 7u + layer) % (RW_PATH_REQ_JOINT + 1));
}

static uint32_t node_of(int32_t id) { return (uint32_t)id / per_rank / gpus; }

/* The count kernel's: row[d * R + rail] = tokens with an expert on node d. */
static void count_row(const rw_wl_work_t *wk, uint32_t *row)
{
	memset(row, 0, sizeof(uint32_t) * nodes * rails);
	for (uint32_t t = 0; t < wk->n; t++)
		for (uint32_t d = 0; d < nodes; d++)
			for (uint32_t q = 0; q < TOPK; q++)
				if (wk->ids[t][q] >= 0 && node_of(wk->ids[t][q]) == d) {
					row[d * rails + native]++;
					break;
				}
}

/* How a lying gather or combine submit lies (combine's `lie`): a return's slot (mode clie), tag,
 * source node or rail wrong, or never written; the submit's rows, hidden or dtype not its
 * dispatch's. clied: the lie was told. */
enum { CLIE_OK, CLIE_SLOT, CLIE_TAG, CLIE_SRC, CLIE_RAIL, CLIE_NONE, CLIE_ROWS, CLIE_HIDDEN,
       CLIE_DTYPE, CLIE_COUNT };
static int clied;
/* Mode fuzz: 1 + the randomness of a combine slot made wrong in a way its checks refuse
 * (cslot_garble), else 0; and the words its refusal must say. */
static uint64_t cgarble;
static char cgarble_want[64];

/* The combine slot's parameters or count row made wrong in one way (phase, kind, rows past the
 * page's bound, a count-row entry, dtype, path, an abort reason past the known ones), or marked
 * an abort; the words the daemon's refusal must say into cgarble_want. */
static void cslot_garble(uint8_t *slot, uint64_t r, uint64_t k)
{
	rw_page_params_t q;
	uint32_t *row = (uint32_t *)(void *)(slot + lay.count_row);
	memcpy(&q, slot + lay.params, sizeof(q));
	const uint32_t s = (uint32_t)(r >> 8);
	char *want = cgarble_want;
	const size_t len = sizeof(cgarble_want);
	switch (r % 8) {
	case 0:
		q.phase = k + 1 + s % 1000;
		snprintf(want, len, "holds phase %llu's", (unsigned long long)q.phase);
		break;
	case 6: /* an abort (rw_client_rank_abort's slot): the pair fails, named */
		q.abort = (uint16_t)(1 + s % (RW_PAGE_ABORT_COUNT - 1));
		snprintf(want, len, "aborted its combine of layer %u step %llu", q.layer,
			 (unsigned long long)q.step);
		break;
	case 7:
		q.abort = (uint16_t)(RW_PAGE_ABORT_COUNT + s % 1000);
		snprintf(want, len, "abort %u on a combine", q.abort);
		break;
	case 1:
		q.kind = (uint8_t)(s & 1 ? 0 : 3 + s % 250);
		snprintf(want, len, "unknown kind %u", q.kind);
		break;
	case 2:
		q.token_count = max_recv + 1 + s % 1000;
		snprintf(want, len, "the page's bound is %u", max_recv);
		break;
	case 3:
		row[(s % nodes) * rails + s % rails] = 1 + s % 100;
		snprintf(want, len, "a combine");
		break;
	case 4:
		q.dtype = (uint8_t)(s & 1 ? 2 + s % 2 : 5 + s % 250);
		snprintf(want, len, "dtype %u: the daemon carries", q.dtype);
		break;
	default:
		q.path = (uint16_t)(RW_PATH_REQ_JOINT + 1 + s % 1000);
		snprintf(want, len, "path %u: at most", q.path);
		break;
	}
	memcpy(slot + lay.params, &q, sizeof(q));
}

/* How a lying pack corrupts the records of token lie_token (every destination's): REC_TOKEN a
 * token past the rank's tokens (mode lie), the others mode fuzz's. */
enum { REC_OK, REC_TOKEN, REC_TAG, REC_SRC, REC_OWNER, REC_TOPK, REC_IDS_OFF, REC_IDS_RANGE,
       REC_ORDER, REC_IDS_NONE, REC_COUNT };
static uint32_t lie_token, lie_salt;
static const char *rec_lie_name(int lie)
{
	static const char *const name[REC_COUNT] = { "none", "token past", "tag", "source node",
		"owner", "topk", "ids off the node", "id out of range", "token order", "no ids" };
	return lie >= 0 && lie < REC_COUNT ? name[lie] : "?";
}

static void rec_lie(int lie, rw_wire_rec_hdr_t *rh, int32_t *ids, uint32_t d, uint32_t n,
		    uint32_t prev)
{
	const uint32_t s = lie_salt;
	switch (lie) {
	case REC_TAG: rh->tag ^= 1 + s % 0xffff; break;
	case REC_SRC: rh->src_node = (rh->src_node + 1 + s % (nodes - 1)) % nodes; break;
	case REC_OWNER: rh->owner += 1 + s % 200; break;
	case REC_TOPK: rh->topk = TOPK - 1; break;
	case REC_IDS_OFF: /* every id an expert of the next node: none on the destination */
		for (uint32_t q = 0; q < TOPK; q++)
			ids[q] = (int32_t)(((d + 1) % nodes) * gpus * per_rank + s % (gpus * per_rank));
		break;
	case REC_IDS_RANGE: ids[s % TOPK] = (int32_t)(experts + s % 1000); break;
	case REC_IDS_NONE:
		for (uint32_t q = 0; q < TOPK; q++)
			ids[q] = -1;
		break;
	case REC_ORDER: /* the previous record's token to that node again */
		if (prev != UINT32_MAX) {
			rh->token = prev;
			break;
		}
		rh->token = n + 7 + s % 100; /* the token's first record to that node */
		break;
	default: rh->token = n + 7 + s % 100; break;
	}
}

/* The pack kernel's: record i to node d (token order) where the plan entries put it; `lie`
 * (REC_*): token lie_token's records corrupted. */
static int pack(const rw_wl_work_t *wk, const uint8_t *slot, int bf16, uint32_t hidden, int lie)
{
	const rw_page_plan_head_t *h = (const void *)(slot + lay.plan);
	const uint32_t *tags = (const void *)(slot + lay.plan_tag);
	const rw_page_plan_entry_t *e = (const void *)(slot + lay.plan_entry);
	uint32_t next[64] = { 0 }, prev[64];
	memset(prev, 0xff, sizeof(prev));
	for (uint32_t t = 0; t < wk->n; t++)
		for (uint32_t d = 0; d < nodes; d++) {
			int hit = 0;
			for (uint32_t q = 0; q < TOPK; q++)
				hit |= wk->ids[t][q] >= 0 && node_of(wk->ids[t][q]) == d;
			if (!hit)
				continue;
			uint32_t rail;
			uint64_t off;
			if (lax && rw_page_plan_find(e, rails, d, next[d], h->rec_size, &rail, &off))
				continue; /* a plan made for a count row that lied: no place for it */
			CHECK(rw_page_plan_find(e, rails, d, next[d]++, h->rec_size, &rail, &off) == 0,
			      "record to node %u has no plan entry", d);
			CHECK(off + h->rec_size <= slabs[rail].bytes, "plan offset past the slab");
			uint8_t *rec = (uint8_t *)slabs[rail].base + off;
			rw_wire_rec_hdr_t rh = { .tag = tags[d], .src_node = me / gpus, .owner = h->owner,
						 .token = t, .topk = TOPK };
			int32_t ids[TOPK];
			memcpy(ids, wk->ids[t], sizeof(ids));
			if (lie && t == lie_token)
				rec_lie(lie, &rh, ids, d, wk->n, prev[d]);
			prev[d] = t;
			rw_wire_rec_pack(rec, &rh, ids, wk->w[t]);
			rw_wl_put_row(rec + h->row_off, bf16, wk->x + (size_t)t * hidden, hidden);
		}
	return 0;
}

/* What must reach this rank in (step, layer): every rank's workload generated, the rows
 * expected (returned) and each of this rank's experts' count (ecount[E]); seen cleared. */
static uint32_t expect_begin(const rw_wl_shape_t *sh, uint32_t step, uint32_t layer,
			     uint32_t *ecount)
{
	uint32_t expect = 0;
	memset(ecount, 0, sizeof(uint32_t) * experts);
	memset(seen, 0, (size_t)world * MAX_ROWS);
	for (uint32_t q = 0; q < world; q++) {
		rw_wl_gen(sh, step, layer, q, &all[q]);
		expect += rw_wl_hits(&all[q], me, per_rank, ecount);
	}
	return expect;
}

/* Row j came from (src_node, owner) token `token` with these top-k ids and weights and this
 * row: it must be that token's, delivered once; its experts on this rank counted in got[E]. */
static int row_check(const rw_wl_shape_t *sh, uint32_t j, uint32_t src_node, uint32_t owner,
		     uint32_t token, const int32_t *ids, const float *w, const uint8_t *row,
		     int bf16, uint32_t *got)
{
	const uint32_t src = src_node * gpus + owner;
	CHECK(owner < gpus && src < world, "row %u: source %u/%u", j, src_node, owner);
	const rw_wl_work_t *o = &all[src];
	CHECK(token < o->n, "row %u: token %u of rank %u", j, token, src);
	CHECK(!seen[src * MAX_ROWS + token], "row %u: rank %u token %u twice", j, src, token);
	seen[src * MAX_ROWS + token] = 1;
	for (uint32_t q = 0; q < TOPK; q++) {
		CHECK(ids[q] == o->ids[token][q] && w[q] == o->w[token][q],
		      "row %u (rank %u token %u): top-k %u differs", j, src, token, q);
		if (ids[q] >= 0 && (uint32_t)ids[q] / per_rank == me)
			got[ids[q]]++;
	}
	for (uint32_t e = 0; e < sh->hidden; e++)
		CHECK(rw_wl_get_elem(row, bf16, e) == o->x[(size_t)token * sh->hidden + e],
		      "row %u (rank %u token %u): data differs at %u", j, src, token, e);
	return 0;
}

static int counts_check(const uint32_t *got, const uint32_t *ecount)
{
	for (uint32_t e = 0; e < experts; e++)
		CHECK(got[e] == ecount[e], "expert %u: %u rows, expected %u", e, got[e], ecount[e]);
	return 0;
}

/* The forward kernel's reads, checked: every row of the list is the workload's, once each. */
static int forward(const rw_wl_shape_t *sh, const uint8_t *slot, uint32_t step, uint32_t layer,
		   int bf16, uint64_t *rows_p)
{
	const rw_page_list_head_t *lh = (const void *)(slot + lay.list);
	const rw_page_list_entry_t *le = (const void *)(slot + lay.list_entry);
	const rw_page_plan_rail_t *areas = (const void *)(slot + lay.plan_rail);
	const uint64_t rec_size = rw_wire_rec_size(TOPK, sh->hidden, bf16 ? RW_WIRE_BF16 : RW_WIRE_F32);
	uint32_t ecount[MAX_EXPERTS], got[MAX_EXPERTS] = { 0 };
	if (lax)
		return 0;
	const uint32_t expect = expect_begin(sh, step, layer, ecount);
	CHECK(lh->count == expect, "step %u layer %u: the list names %u rows, expected %u", step,
	      layer, lh->count, expect);
	for (uint32_t j = 0; j < lh->count; j++) {
		const rw_page_list_entry_t *en = &le[j];
		CHECK(en->rail < rails, "row %u: rail %u", j, en->rail);
		const uint64_t base = en->area == RW_PAGE_AREA_RECV ? areas[en->rail].recv_off
								    : areas[en->rail].local_off;
		const uint8_t *rec = (const uint8_t *)slabs[en->rail].base + base + en->slot * rec_size;
		rw_wire_rec_hdr_t h;
		CHECK(rw_wire_rec_unpack(rec, TOPK, &h) == RW_OK, "row %u: bad header", j);
		CHECK(h.src_node == en->node && h.token == en->token,
		      "row %u: source %u token %u, the list says %u, %u", j, h.src_node, h.token,
		      en->node, en->token);
		int32_t ids[TOPK];
		float w[TOPK];
		for (uint32_t q = 0; q < TOPK; q++) {
			ids[q] = rw_wire_rec_id(rec, q);
			w[q] = rw_wire_rec_weight(rec, TOPK, q);
		}
		if (row_check(sh, j, h.src_node, h.owner, h.token, ids, w,
			      rec + rw_wire_rec_row_off(TOPK), bf16, got))
			return 1;
	}
	if (counts_check(got, ecount))
		return 1;
	*rows_p += lh->count;
	return 0;
}

/* The combine that answers dispatch slot `dslot` (docs/rankpath.md "A phase", Combine), phase
 * k: the rank's expert outputs (the workload's, for each row its dispatch list names) staged
 * where the dispatch's plan head says, submit; after plan, the gather (each list entry's terms
 * summed in fp32 in order, rounded once; `lie`: the first return's slot field wrong), packed;
 * after arrived, the reduce of its own tokens in the list's order, checked against the
 * workload's combined rows; done. *st_p: the phase's status. */
static int combine(const rw_wl_shape_t *sh, const uint8_t *dslot, uint64_t k, uint32_t step,
		   uint32_t layer, int bf16, int lie, int32_t *st_p, uint64_t *tokens_p)
{
	const rw_page_plan_head_t *dh = (const void *)(dslot + lay.plan);
	const rw_page_list_head_t *dl = (const void *)(dslot + lay.list);
	const rw_page_list_entry_t *de = (const void *)(dslot + lay.list_entry);
	const rw_page_plan_rail_t *da = (const void *)(dslot + lay.plan_rail);
	const uint32_t hidden = sh->hidden, rowb = hidden * (bf16 ? 2 : 4), h = me % gpus;
	const uint64_t rec_size = rw_wire_rec_size(TOPK, hidden, bf16 ? RW_WIRE_BF16 : RW_WIRE_F32);
	const uint64_t crec = rw_wire_crec_size(hidden, bf16 ? RW_WIRE_BF16 : RW_WIRE_F32);
	float v[64], sum[64];
	const rw_page_stage_t *dst = (const void *)(dslot + lay.plan_stage);
	CHECK(hidden <= 64 && dh->n_stage == gpus && dst[h].rail == native &&
	      dst[h].rows >= dl->count &&
	      dst[h].off + (uint64_t)dst[h].rows * rowb <= slabs[native].bytes,
	      "dispatch %llu: its staging entry (rail %u, %u rows) holds its %u rows on its own rail",
	      (unsigned long long)k, dst[h].rail, dst[h].rows, dl->count);
	uint8_t *stage = (uint8_t *)slabs[native].base + dst[h].off;
	for (uint32_t j = 0; j < dl->count; j++) { /* the expert outputs, staged (P1) */
		const uint64_t base = de[j].area == RW_PAGE_AREA_RECV ? da[de[j].rail].recv_off
								      : da[de[j].rail].local_off;
		const uint8_t *rec = (const uint8_t *)slabs[de[j].rail].base + base +
				     de[j].slot * rec_size;
		rw_wire_rec_hdr_t rh;
		if (lax) /* the slabs were scribbled on: any rows will do */
			memset(v, 0, sizeof(v));
		else {
			CHECK(rw_wire_rec_unpack(rec, TOPK, &rh) == RW_OK, "combine row %u: header", j);
			rw_wl_expert_row(&all[rh.src_node * gpus + rh.owner], rh.token, me, per_rank,
					 hidden, v);
		}
		rw_wl_put_row(stage + (uint64_t)j * rowb, bf16, v, hidden);
	}
	uint8_t *slot = rw_page_slot_at(pg, &lay, k);
	const rw_page_params_t prm = { .kind = RW_KIND_COMBINE,
				       .dtype = bf16 ? RW_DTYPE_BF16 : RW_DTYPE_FP32, .layer = layer,
				       .hidden = hidden, .token_count = dl->count, .phase = k,
				       .step = step };
	memcpy(slot + lay.params, &prm, sizeof(prm));
	if (lie >= CLIE_ROWS) { /* a combine that does not answer its dispatch */
		rw_page_params_t q = prm;
		if (lie == CLIE_ROWS)
			q.token_count += 1 + lie_salt % 5;
		else if (lie == CLIE_HIDDEN)
			q.hidden += 8;
		else
			q.dtype = bf16 ? RW_DTYPE_FP32 : RW_DTYPE_BF16;
		memcpy(slot + lay.params, &q, sizeof(q));
		clied = 1;
	}
	memset(slot + lay.count_row, 0, sizeof(uint32_t) * nodes * rails);
	if (cgarble)
		cslot_garble(slot, cgarble - 1, k);
	word_set(RW_PW_SUBMIT, k);
	if (kill_at == 4)
		fz_die("after its combine's submit");
	if (wait_status(RW_PW_PLAN, k, st_p))
		return 1;
	if (*st_p)
		goto done;
	const rw_page_plan_head_t *ch = (const void *)(slot + lay.plan);
	const uint32_t *tags = (const void *)(slot + lay.plan_tag);
	const rw_page_plan_entry_t *ce = (const void *)(slot + lay.plan_entry);
	const rw_page_plan_rail_t *ca = (const void *)(slot + lay.plan_rail);
	const uint32_t *toff = (const void *)(slot + lay.term_off);
	const uint32_t *tref = (const void *)(slot + lay.term_ref);
	const rw_page_stage_t *cst = (const void *)(slot + lay.plan_stage);
	CHECK(ch->kind == 1 && ch->n_stage == gpus && ch->rec_size == crec &&
	      memcmp(cst, dst, gpus * sizeof(*cst)) == 0,
	      "combine %llu: plan head and staging table (the dispatch's)", (unsigned long long)k);
	for (uint32_t j = 0; j < dl->count; j++) { /* the gather */
		if (toff[j] == toff[j + 1])
			continue; /* another local rank writes this one */
		memset(sum, 0, sizeof(sum));
		for (uint32_t t = toff[j]; t < toff[j + 1]; t++) {
			const rw_page_stage_t *te = &cst[RW_PAGE_TERM_RANK(tref[t])];
			CHECK(RW_PAGE_TERM_RANK(tref[t]) < gpus && te->rail < rails &&
			      RW_PAGE_TERM_ROW(tref[t]) < te->rows,
			      "combine %llu: term %u names a staged row", (unsigned long long)k, t);
			const uint8_t *r = (const uint8_t *)slabs[te->rail].base + te->off +
					   (uint64_t)RW_PAGE_TERM_ROW(tref[t]) * rowb;
			for (uint32_t e = 0; e < hidden; e++)
				sum[e] += rw_wl_get_elem(r, bf16, e);
		}
		const uint32_t node = de[j].area == RW_PAGE_AREA_RECV ? de[j].node : me / gpus;
		const rw_page_plan_entry_t *pe = &ce[node * rails + de[j].rail];
		CHECK(de[j].slot - pe->first < pe->count, "combine %llu: entry %u has no place",
		      (unsigned long long)k, j);
		uint8_t *out = (uint8_t *)slabs[de[j].rail].base + pe->offset +
			       (uint64_t)(de[j].slot - pe->first) * crec;
		rw_wire_crec_hdr_t hd = { .tag = tags[node], .src_node = me / gpus,
					  .rail = de[j].rail, .slot = de[j].slot - pe->first };
		if (lie && lie < CLIE_ROWS && !clied && de[j].area == RW_PAGE_AREA_RECV) {
			clied = 1; /* a gather that lied in its first return to another node */
			if (lie == CLIE_NONE)
				continue; /* never written */
			if (lie == CLIE_TAG)
				hd.tag ^= 1 + lie_salt % 0xffff;
			else if (lie == CLIE_SRC && nodes > 1)
				hd.src_node = (hd.src_node + 1) % nodes;
			else if (lie == CLIE_RAIL && rails > 1)
				hd.rail = (hd.rail + 1) % rails;
			else
				hd.slot += 1000 + lie_salt % 1000;
		}
		rw_wire_crec_pack(out, &hd);
		rw_wl_put_row(out + ch->row_off, bf16, sum, hidden);
	}
	word_set(RW_PW_PACKED, k);
	if (kill_at == 5)
		fz_die("after its combine's packed");
	if (wait_status(RW_PW_ARRIVED, k, st_p))
		return 1;
	if (*st_p || lax)
		goto done;
	const rw_page_list_head_t *rl = (const void *)(slot + lay.list);
	const rw_page_list_entry_t *re = (const void *)(slot + lay.list_entry);
	CHECK(rl->kind == 1, "combine %llu: reduce list kind", (unsigned long long)k);
	uint32_t i = 0;
	for (uint32_t t = 0; t < mine.n; t++) { /* the reduce: from +0, in list order */
		memset(sum, 0, sizeof(sum));
		for (; i < rl->count && re[i].token == t; i++) {
			const uint64_t base = re[i].area == RW_PAGE_AREA_RECV ? ca[re[i].rail].recv_off
									     : ca[re[i].rail].local_off;
			const uint8_t *r = (const uint8_t *)slabs[re[i].rail].base + base +
					   re[i].slot * crec + RW_WIRE_CREC_HDR;
			for (uint32_t e = 0; e < hidden; e++)
				sum[e] += rw_wl_get_elem(r, bf16, e);
		}
		uint8_t out[64 * 4];
		rw_wl_put_row(out, bf16, sum, hidden);
		for (uint32_t e = 0; e < hidden; e++)
			CHECK(rw_wl_get_elem(out, bf16, e) == rw_wl_combined(&mine, t, e, hidden),
			      "step %u layer %u token %u elem %u: combine %g, expected %g", step, layer,
			      t, e, rw_wl_get_elem(out, bf16, e), rw_wl_combined(&mine, t, e, hidden));
	}
	CHECK(i == rl->count, "combine %llu: %u reduce entries past the rank's tokens",
	      (unsigned long long)k, rl->count - i);
	*tokens_p += mine.n;
done:
	word_set(RW_PW_DONE, k);
	return 0;
}

/* Wait for `path` to exist (a harness's go; at most WAIT_S seconds); NULL: no wait. 0, or 1. */
static int wait_file(const char *path)
{
	for (long i = 0; path && access(path, F_OK) != 0; i++) {
		CHECK(i < WAIT_S * 100L, "no %s", path);
		usleep(10000);
	}
	return 0;
}

/* The rank's page (lent) and its group's slab of every rail, mapped. */
static int page_maps(rw_client_t *c, void *page)
{
	int rc;
	pg = page;
	rails = pg->rails;
	native = pg->rail;
	max_tokens = pg->max_tokens;
	max_recv = pg->max_recv;
	CHECK(rails <= RW_CLIENT_SLAB_RAILS && nodes * rails <= 64 * RW_CLIENT_SLAB_RAILS,
	      "count row too big");
	CHECK(rw_page_layout(pg->nodes, pg->rails, pg->gpus, pg->max_recv, 1, &lay) == 0, "layout");
	for (uint32_t r = 0; r < rails; r++) {
		rw_client_slab_gpu_t gpu;
		rc = rw_client_group_slab_kind(c, r, &slabs[r], &gpu);
		CHECK(rc == 0, "slab of rail %u: %s: %s", r, rw_client_strerror(rc),
		      rw_client_last_message(c));
		if (gpu.kind != RW_CLIENT_SLAB_GPU)
			continue;
		/* A GPU slab (the daemons' test hook): on the stand-in drivers the allocation's fd is
		 * its memory (a memfd), which this CPU, playing the kernels, maps as they would see
		 * it. A real driver's fd maps nowhere: this player is the stand-in's only. */
		void *m = mmap(NULL, slabs[r].bytes, PROT_READ | PROT_WRITE, MAP_SHARED, gpu.fd, 0);
		CHECK(m != MAP_FAILED, "GPU slab of rail %u: the CPU player maps only the stand-in's", r);
		slabs[r].base = m;
	}
	return 0;
}

static int page_join(rw_client_t *c)
{
	void *page;
	size_t bytes;
	int rc = rw_client_rank_page(c, world * MAX_ROWS, &page, &bytes);
	CHECK(rc == 0, "rank page: %s: %s", rw_client_strerror(rc), rw_client_last_message(c));
	return page_maps(c, page);
}

/* Dispatch k of (step, layer): the parameters and count row of `mine` in its slot, as the count
 * kernel leaves them before submit. Returns the slot. */
static uint8_t *dispatch_slot(const rw_wl_shape_t *sh, uint32_t step, uint32_t layer, uint64_t k)
{
	const int bf16 = rw_wl_bf16(step, layer);
	uint8_t *slot = rw_page_slot_at(pg, &lay, k);
	const rw_page_params_t prm = { .kind = RW_KIND_DISPATCH,
				       .dtype = bf16 ? RW_DTYPE_BF16 : RW_DTYPE_FP32, .topk = TOPK,
				       .layer = layer, .hidden = sh->hidden, .n_experts = experts,
				       .token_count = mine.n, .phase = k, .step = step,
				       .path = path_of(step, layer) };
	uint32_t row[64 * RW_CLIENT_SLAB_RAILS];
	memcpy(slot + lay.params, &prm, sizeof(prm));
	count_row(&mine, row);
	memcpy(slot + lay.count_row, row, sizeof(uint32_t) * nodes * rails);
	return slot;
}

/* --- mode fuzz: a hostile rank among good ones (tests/service/test_rankfuzz.py) -------------
 * Every rank of the group runs this with the same seed ($RW_PAGERANK_FUZZ, else SEED), so each
 * knows round i's plan: which rank attacks and how (fz_plan); round i is the dispatch of (step
 * i / LAYERS, layer i % LAYERS) and its combine. The others play well and expect what the
 * attack allows: a rewritten head, or a slot refused that is no dispatch (a stray combine),
 * leaves their phase passing and every row checked; a dispatch slot refused fails the round's
 * phase on every rank at once, each other rank's reason naming the attacker ("local rank A:"),
 * and the attacker goes on to the next round without retrying the key; a combine slot refused
 * (cslot: its dispatch played well) fails the round's combine on every rank so, named; any other attack must
 * leave theirs ending, named (any reason, never a hang past the wait bound); their rows are checked whenever it passes, but in rounds where the slabs
 * were scribbled on, the daemon's words forged or the slot raced (the daemon may have copied
 * a count row that lies plausibly: it plans what it copied, and the records check then names
 * the rank). The attacker
 * checks that the daemon told it what it did (the reason's words). A rank dropped, leaving or
 * killed (SIGKILL, at a point of the phase) comes back: the process runs each life of the rank
 * as a child, and a new life joins the group again, takes a new page and slabs and plays on
 * from the next round (its leave failed the round's pair; a retry of that key would open a new
 * pair the others, gone on, never join). */
enum { FZ_NONE, FZ_SLOT, FZ_SLOT_RACE, FZ_HEAD, FZ_REC, FZ_SCRIBBLE, FZ_WORD_BACK, FZ_WORD_AHEAD,
       FZ_PACKED_EARLY, FZ_DONE_EARLY, FZ_FORGE, FZ_KILL, FZ_CSLOT, FZ_KILL2, FZ_SLOT_AFTER,
       FZ_ELSEWHERE, FZ_COUNT };
static const char *const fz_name[FZ_COUNT] = {
	"none", "slot", "slot-race", "head", "record", "scribble", "word-back", "word-ahead",
	"packed-early", "done-early", "forge", "kill", "cslot", "kill2", "slot-after",
	"elsewhere" };
typedef struct fz_shared {      /* the lives' memory (shared with the parent) */
	uint32_t round;         /* the round the last life was in */
	uint32_t attacked;      /* 1 + the last round whose attack was made */
	uint32_t attacks, passed, failed;
	uint32_t no_meet;       /* the last life left before its round's submit (fz_die) */
	uint32_t elsewhere;     /* 1 + the round of an elsewhere attack the last life died in */
} fz_shared_t;

static uint64_t fz_mix(uint64_t x) /* splitmix64's finalizer */
{
	x += UINT64_C(0x9e3779b97f4a7c15);
	x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
	return x ^ (x >> 31);
}

typedef struct fz_round {
	int kind;
	uint32_t attacker;
	uint64_t r;             /* the attack's own randomness */
} fz_round_t;

/* Round i's plan: one round in eight attacks nobody. */
static fz_round_t fz_plan(uint64_t seed, uint32_t i)
{
	const uint64_t x = fz_mix(fz_mix(seed) + i);
	return (fz_round_t){ .kind = x % 8 == 0 ? FZ_NONE : 1 + (int)((x >> 8) % (FZ_COUNT - 1)),
			     .attacker = (uint32_t)((x >> 32) % world), .r = fz_mix(x) };
}

/* Whether a round of this kind kills its attacker (or makes it leave) at a point of the phase:
 * kill2 a second rank too; elsewhere's next life first joins another group under its rank. */
static int fz_goes(int kind)
{
	return kind == FZ_KILL || kind == FZ_KILL2 || kind == FZ_ELSEWHERE;
}

/* Whether the attacker of a round of this kind leaves the group (dropped, gone, killed). */
static int fz_leaves(int kind)
{
	return kind == FZ_WORD_BACK || kind == FZ_WORD_AHEAD || kind == FZ_PACKED_EARLY ||
	       kind == FZ_DONE_EARLY || kind == FZ_FORGE || fz_goes(kind);
}

/* A kill round's second victim (kill2: another rank, anywhere), or the attacker itself. */
static uint32_t fz_second(const fz_round_t *f)
{
	return f->kind == FZ_KILL2 ? (f->attacker + 1 + (uint32_t)(f->r >> 12) % (world - 1)) % world
				   : f->attacker;
}

/* Where victim `second` (0: the attacker, 1: kill2's other) of a kill round goes: the point of
 * the phase (0 before its dispatch's submit, 1 after it, 2 after its packed, 3 after its done,
 * 4 after its combine's submit, 5 after that packed, 6 after that done), and how (*leaves: a
 * goodbye and exit, else SIGKILL). */
static int fz_kill_point(const fz_round_t *f, int second, int *leaves)
{
	const uint64_t x = second ? f->r >> 20 : f->r;
	*leaves = (int)(x >> 6 & 1);
	return (int)(x % 7);
}

/* The ways slot_garble makes a slot wrong (the last: a combine no dispatch waits for). */
#define SLOT_GARBLES 14

/* Whether a garbage slot of randomness r is a combine no dispatch waits for (slot_garble's
 * last way): refused to the attacker alone, which then makes the round's dispatch right. Every
 * other garbage slot is a dispatch the daemon refuses: that fails the round's key everywhere. */
static int fz_slot_alone(uint64_t r)
{
	return r % SLOT_GARBLES == SLOT_GARBLES - 1;
}

/* Whether the others' phase must pass in round i: an attack that its own refusal answers. */
static int fz_must_pass(uint64_t seed, uint32_t i)
{
	const fz_round_t f = fz_plan(seed, i);
	return f.kind == FZ_NONE || f.kind == FZ_HEAD || f.kind == FZ_SLOT_AFTER ||
	       (f.kind == FZ_SLOT && fz_slot_alone(f.r));
}

/* Whether round i's dispatch must fail on every other rank naming the attacker as gone: it
 * left (or was killed) before its submit, alone. */
static int fz_gone_first(uint64_t seed, uint32_t i)
{
	const fz_round_t f = fz_plan(seed, i);
	int leaves;
	return f.kind == FZ_KILL && fz_kill_point(&f, 0, &leaves) == 0;
}

/* Whether round i's dispatch must fail on every rank, named: a refused dispatch slot. */
static int fz_slot_fails(uint64_t seed, uint32_t i)
{
	const fz_round_t f = fz_plan(seed, i);
	return f.kind == FZ_SLOT && !fz_slot_alone(f.r);
}

/* Round i after a round whose attacker left: every rank of the group meets first (a file per
 * rank in $RW_PAGERANK_FUZZ_DIR), the attacker's next life once it joined again, as an elastic
 * trainer's ranks meet again after one restarted. So no rank opens round i's pair while the
 * leaver's seat is empty (its leave would fail that pair too, or a rank coming back to a
 * failed key would open a pair of it the others never join). */
static int fz_meet(uint32_t i, int nowait)
{
	const char *dir = getenv("RW_PAGERANK_FUZZ_DIR");
	char path[512];
	if (!dir || i == 0 || !fz_leaves(fz_plan(fz_seed, i - 1).kind))
		return 0;
	snprintf(path, sizeof(path), "%s/r%u.%u", dir, i, me);
	FILE *f = fopen(path, "w");
	CHECK(f && fclose(f) == 0, "%s", path);
	for (uint32_t q = 0; q < world && !nowait; q++) {
		snprintf(path, sizeof(path), "%s/r%u.%u", dir, i, q);
		for (long t = 0; access(path, F_OK) != 0; t++) {
			CHECK(t < WAIT_S * 1000L, "round %u: rank %u never came", i, q);
			usleep(1000);
		}
	}
	return 0;
}

/* Slot k's parameters or count row made wrong in one way (the rest as dispatch_slot left
 * them, the reserved word noise); returns the words the daemon's refusal must say. */
static const char *slot_garble(uint8_t *slot, uint64_t r, uint64_t k)
{
	static char want[64];
	rw_page_params_t q;
	uint32_t *row = (uint32_t *)(void *)(slot + lay.count_row);
	memcpy(&q, slot + lay.params, sizeof(q));
	q.reserved2 = (uint32_t)(r >> 30);
	const uint32_t s = (uint32_t)(r >> 8), n = q.token_count;
	unsigned v = (unsigned)(r % SLOT_GARBLES);
	if ((v == 4 && rails < 2) || (v == 6 && (n == 0 || nodes < 2)))
		v = 0;
	switch (v) {
	case 0:
		q.phase = k + 1 + s % 1000;
		snprintf(want, sizeof(want), "holds phase %llu's", (unsigned long long)q.phase);
		break;
	case 1:
		q.kind = (uint8_t)(s & 1 ? 0 : 3 + s % 250);
		snprintf(want, sizeof(want), "unknown kind %u", q.kind);
		break;
	case 2:
		q.bad = 1 + s % (n ? n : 1);
		snprintf(want, sizeof(want), "token %u has a top-k id outside", q.bad - 1);
		break;
	case 3:
		q.token_count = max_tokens + 1 + s % 1000;
		snprintf(want, sizeof(want), "the page's bound is %u", max_tokens);
		break;
	case 4:
		row[(s % nodes) * rails + (native + 1 + s % (rails - 1)) % rails] = 1;
		snprintf(want, sizeof(want), "(not its rail)");
		break;
	case 5:
		row[(s % nodes) * rails + native] = n + 1 + s % 100;
		snprintf(want, sizeof(want), "above its %u tokens", n);
		break;
	case 6: /* every node counts every token, one node each allowed */
		q.topk = 1;
		for (uint32_t d = 0; d < nodes; d++)
			row[d * rails + native] = n;
		snprintf(want, sizeof(want), "adds up to %u records", n * nodes);
		break;
	case 7:
		q.topk = (uint16_t)(RW_MAX_TOPK + 1 + s % 100);
		snprintf(want, sizeof(want), "topk %u (1..", q.topk);
		break;
	case 8:
		q.hidden = 0;
		snprintf(want, sizeof(want), "hidden 0,");
		break;
	case 9:
		q.n_experts = s & 1 ? 0 : experts + 1;
		snprintf(want, sizeof(want), "n_experts %u (a multiple", q.n_experts);
		break;
	case 10:
		q.path = (uint16_t)(RW_PATH_REQ_JOINT + 1 + s % 1000);
		snprintf(want, sizeof(want), "path %u: at most", q.path);
		break;
	case 11:
		q.dtype = (uint8_t)(s & 1 ? 2 + s % 2 : 5 + s % 250); /* neither bf16 nor fp32 */
		snprintf(want, sizeof(want), "dtype %u: the daemon carries", q.dtype);
		break;
	case 12: /* only a combine may abort */
		q.abort = (uint16_t)(1 + s % 0xfffe);
		snprintf(want, sizeof(want), "abort %u on a dispatch", q.abort);
		break;
	default: /* a combine no dispatch of this rank waits for (fz_slot_alone) */
		q.kind = RW_KIND_COMBINE;
		q.token_count = s % 4;
		memset(row, 0, sizeof(uint32_t) * nodes * rails);
		snprintf(want, sizeof(want), "no dispatch of this rank waits for it");
		break;
	}
	memcpy(slot + lay.params, &q, sizeof(q));
	return want;
}

/* Random bytes over 1 to 16 places of the group's slabs, anywhere in the rank's mapping. */
static void scribble(uint64_t r)
{
	for (uint32_t n = 1 + (uint32_t)(r % 16), i = 0; i < n; i++) {
		const uint64_t x = fz_mix(r + i);
		const uint32_t rail = (uint32_t)(x % rails);
		const uint64_t off = (x >> 8) % slabs[rail].bytes;
		const uint64_t len = RW_MIN(1 + (x >> 40) % 256, slabs[rail].bytes - off);
		uint8_t *at = (uint8_t *)slabs[rail].base + off;
		for (uint64_t b = 0; b < len; b++)
			at[b] = (uint8_t)fz_mix(x + b);
	}
}

/* The daemon dropped the rank for the word it wrote: its watcher writes the owed words, the
 * daemon's reason must say what was wrong. */
static int fz_dropped(rw_client_t *c, uint32_t i, const char *want)
{
	CHECK(wait_word(RW_PW_PLAN, RW_PAGE_OWED_AHEAD) == 0, "round %u: not dropped", i);
	const char *why = reason(c);
	printf("dropped: %s\n", why);
	CHECK(strstr(why, want), "round %u: dropped, but the reason (%s) does not say '%s'", i, why,
	      want);
	rw_client_close(c);
	return FZ_REJOIN;
}

/* The record a lying pack corrupts: a token of `mine` with a record (its first record to each
 * node); 0 when the rank has none. */
static int rec_target(uint64_t r)
{
	for (uint32_t j = 0; j < mine.n; j++) {
		const uint32_t t = (uint32_t)((r >> 16) + j) % mine.n;
		for (uint32_t q = 0; q < TOPK; q++)
			if (mine.ids[t][q] >= 0) {
				lie_token = t;
				lie_salt = (uint32_t)(r >> 24);
				return 1 + (int)((r >> 4) % (REC_COUNT - 1));
			}
	}
	return REC_OK;
}

/* A failed phase k's last words, as the rank's stream writes them (its kernels run empty):
 * packed (where it is behind), then done. */
static void phase_end(uint64_t k)
{
	if ((int64_t)(k - word(RW_PW_PACKED)) > 0)
		word_set(RW_PW_PACKED, k);
	word_set(RW_PW_DONE, k);
}

/* Round i, this rank's part; prints how it ended. 0 on, 1 a check failed, FZ_REJOIN. */
static int fuzz_round(rw_client_t *c, const rw_wl_shape_t *sh, uint64_t *k_p, uint32_t i,
		      uint32_t layers, const fz_round_t *f, int attack, fz_shared_t *shm)
{
	const uint32_t step = i / layers, layer = i % layers;
	const int kind = attack ? f->kind : FZ_NONE, bf16 = rw_wl_bf16(step, layer);
	const uint64_t r = f->r;
	uint64_t rows = 0, tokens = 0;
	/* rows not checked: scribbled slabs, a forged arrived, a racing slot (the daemon may have
	 * copied a count row that lies plausibly: its plan is not the rank's records) */
	lax = f->kind == FZ_SCRIBBLE || f->kind == FZ_SLOT_RACE || (f->kind == FZ_FORGE && (r & 256));
	kill_at = -1;
	if (fz_goes(kind))
		kill_at = fz_kill_point(f, me != f->attacker, &kill_leaves);
	fz_visit_round = kind == FZ_ELSEWHERE ? (int64_t)i : -1;
	printf("fuzz round %u %s by rank %u: rank %u ", i, fz_name[f->kind], f->attacker, me);
	rw_wl_gen(sh, step, layer, me, &mine);
	if (kill_at == 0)
		fz_die("before its submit");
	if (kind == FZ_HEAD) { /* the head's fields and the next status lines: noise */
		uint8_t *h = (uint8_t *)pg;
		for (size_t b = 0; b < offsetof(rw_page_head_t, word); b++)
			h[b] = (uint8_t)fz_mix(r + b);
		for (unsigned d = 0; d < RW_PAGE_DEPTH; d++)
			atomic_store(&pg->status[d].v, fz_mix(r + d));
	}
	uint64_t k = ++*k_p;
	uint8_t *slot = dispatch_slot(sh, step, layer, k);
	int32_t st = 0;
	if (kind == FZ_SLOT) { /* refused, named; a stray combine: then the dispatch done right */
		const char *want = slot_garble(slot, r, k);
		word_set(RW_PW_SUBMIT, k);
		if (wait_status(RW_PW_PLAN, k, &st))
			return 1;
		const char *why = reason(c);
		printf("refused (%s)", why);
		CHECK(st != 0 && strstr(why, want), "round %u: a garbage slot got status %d, '%s' "
		      "(want '%s')", i, st, why, want);
		phase_end(k);
		if (!fz_slot_alone(r)) { /* its refusal failed the round's key on every rank */
			printf("; the round failed\n");
			shm->failed++;
			return 0;
		}
		printf(", ");
		slot = dispatch_slot(sh, step, layer, k = ++*k_p);
	}
	word_set(RW_PW_SUBMIT, k); /* P1 */
	if (kind == FZ_SLOT_RACE) { /* garbage and back while the daemon copies the slot */
		uint8_t good[4096];
		const size_t n = RW_MIN(sizeof(good), (size_t)lay.plan);
		memcpy(good, slot, n);
		for (uint32_t it = 0; it < 100 + r % 2000; it++) {
			(void)slot_garble(slot, fz_mix(r + it), k);
			memcpy(slot, good, n);
		}
	}
	if (kill_at == 1)
		fz_die("after its submit");

	if (kind == FZ_DONE_EARLY) /* done before arrived: nothing was even planned */
		word_set(RW_PW_DONE, k);
	if (kind == FZ_PACKED_EARLY) /* packed with no record written */
		word_set(RW_PW_PACKED, k);
	if (wait_status(RW_PW_PLAN, k, &st))
		return 1;
	int lost = 0; /* the attack before the plan went with a dispatch the daemon refused */
	for (int tries = 0; st == RW_E_STATE && strstr(reason(c), "is still running"); tries++) {
		/* another round's pair still runs here (this rank came back after the group moved
		 * on, or moved on first): the dispatch again, as a trainer retries it */
		CHECK(tries < 1000, "round %u: refused 1000 times: %s", i, reason(c));
		phase_end(k);
		usleep(10000);
		slot = dispatch_slot(sh, step, layer, k = ++*k_p);
		word_set(RW_PW_SUBMIT, k);
		if (wait_status(RW_PW_PLAN, k, &st))
			return 1;
		lost = 1;
	}
	if (!st && (kind == FZ_WORD_BACK || kind == FZ_WORD_AHEAD)) { /* planned: in the round's pair */
			static const unsigned ws[3] = { RW_PW_SUBMIT, RW_PW_PACKED, RW_PW_DONE };
			const unsigned w = ws[r % 3];
			const uint64_t v = word(w);
			word_set(w, kind == FZ_WORD_BACK ? v - 1 - (r >> 8) % 5 :
				 (r >> 8) & 1 ? v + (UINT64_C(1) << 40) : v + RW_PAGE_DEPTH + 1 + (r >> 9) % 1000);
			return fz_dropped(c, i, "rank page word");
		}
	if (!st && kind == FZ_FORGE && !(r & 256)) {
		/* packed for the next phase, no record written, behind the daemon's plan forged to
		 * match: the records check fails the round, naming this rank */
		word_set(RW_PW_PLAN, k + 1);
		word_set(RW_PW_PACKED, k + 1);
		if (wait_status(RW_PW_ARRIVED, k, &st))
			return 1;
		const char *why = reason(c);
		printf("forged plan %llu and packed: %s: %s; leaves\n", (unsigned long long)k + 1,
		       rw_client_strerror(st), why);
		CHECK(st && strstr(why, "record"), "round %u: packed with no records is not named: "
		      "%d '%s'", i, st, why);
		rw_client_close(c);
		return FZ_REJOIN;
	}
	if (kind == FZ_SLOT_RACE && st && st != RW_E_PHASE) { /* it copied garbage: refused */
		printf("refused (%s), ", reason(c));
		phase_end(k);
		slot = dispatch_slot(sh, step, layer, k = ++*k_p);
		word_set(RW_PW_SUBMIT, k);
		if (wait_status(RW_PW_PLAN, k, &st))
			return 1;
	}
	if (!st && kind == FZ_SLOT_AFTER && r % 3 == 0) /* the daemon took it: never read again */
		(void)slot_garble(slot, fz_mix(r), k);
	int lie = REC_OK;
	if (!st && ((kind != FZ_PACKED_EARLY && kind != FZ_DONE_EARLY) || lost)) {
		lie = kind == FZ_REC && !(r >> 40 & 1) ? rec_target(r) : REC_OK;
		if (pack(&mine, slot, bf16, sh->hidden, lie))
			return 1;
		if (kind == FZ_SCRIBBLE && (r & 512))
			scribble(r);
		if (kind == FZ_FORGE) { /* the daemon's arrived written by the rank, and done, then
					 * packed: the daemon cannot have reached its own flush (where a
					 * done is due) before it sees that done */
			word_set(RW_PW_ARRIVED, k);
			word_set(RW_PW_DONE, k);
		}
		word_set(RW_PW_PACKED, k); /* P3 */
		if (kind == FZ_SLOT_AFTER && r % 3 == 1)
			(void)slot_garble(slot, fz_mix(r), k);
		if (kill_at == 2)
			fz_die("after its packed");
		if (kind == FZ_SCRIBBLE && !(r & 512)) /* while the daemon checks and posts */
			scribble(r);
		if (kind == FZ_FORGE) { /* the daemon fails the phase all the same, named */
			for (long t = 0; !(st = (int32_t)atomic_load(&pg->status[k % RW_PAGE_DEPTH].v));
			     t++) {
				CHECK(t < WAIT_S * 1000L, "round %u: done with a forged arrived passed",
				      i);
				usleep(1000);
			}
			const char *why = reason(c);
			printf("forged arrived %llu, done: %s: %s\n", (unsigned long long)k,
			       rw_client_strerror(st), why);
			shm->failed++;
			CHECK(strstr(why, "done moved"), "round %u: done with a forged arrived is not "
			      "named: '%s'", i, why);
			return 0;
		}
	}
	if (!st && wait_status(RW_PW_ARRIVED, k, &st))
		return 1;
	const int must_fail = ((kind == FZ_PACKED_EARLY || kind == FZ_DONE_EARLY) && !lost) ||
			      lie != REC_OK;
	if (st) {
		const char *why = reason(c);
		printf("failed: %s: %s\n", rw_client_strerror(st), why);
		shm->failed++;
		phase_end(k);
		CHECK(why[0], "round %u: the phase failed with no reason", i);
		CHECK((attack && kind != FZ_SLOT_AFTER) || !fz_must_pass(fz_seed, i),
		      "round %u: a %s round must pass", i, fz_name[f->kind]);
		char named[32];
		snprintf(named, sizeof(named), "local rank %u: ", f->attacker);
		CHECK(attack || !fz_slot_fails(fz_seed, i) || (st == RW_E_PHASE && strstr(why, named)),
		      "round %u: the refused slot of rank %u failed this rank's phase with %d '%s' "
		      "(want RW_E_PHASE naming '%s')", i, f->attacker, st, why, named);
		char gone[48], again[48];
		snprintf(gone, sizeof(gone), "local rank %u left", f->attacker);
		snprintf(again, sizeof(again), "local rank %u joined again", f->attacker);
		CHECK(attack || !fz_gone_first(fz_seed, i) ||
		      (st == RW_E_PHASE && (strstr(why, gone) || strstr(why, again))),
		      "round %u: rank %u went before its submit and this rank's phase failed with %d "
		      "'%s' (want RW_E_PHASE naming it gone)", i, f->attacker, st, why);
		CHECK(attack || !fz_goes(f->kind) || !strstr(why, "timed out"),
		      "round %u: a rank that went left this rank to the phase timeout: '%s'", i, why);
		/* what the attacker did is named, unless the last round's attacker left: its leave
		 * may fail this round's pair first */
		CHECK(kind != FZ_REC || strstr(why, "record"), "round %u: the lying pack (%s) "
		      "is not named: '%s'", i, rec_lie_name(lie), why);
		CHECK(kind != FZ_DONE_EARLY || lost || strstr(why, "done moved"), "round %u: done "
		      "before arrived is not named: '%s'", i, why);
		CHECK(kind != FZ_PACKED_EARLY || lost || strstr(why, "packed moved") ||
		      strstr(why, "record"),
		      "round %u: packed before the records is not named: '%s'", i, why);
		if ((kind == FZ_PACKED_EARLY || kind == FZ_DONE_EARLY) && !lost) {
			/* the rank goes, and comes back for the next round: where the daemon failed
			 * only its phase (its word came before its submit was taken), its leave ends
			 * the round's pair for the others */
			printf("leaves\n");
			rw_client_close(c);
			return FZ_REJOIN;
		}
		return 0;
	}
	CHECK(!must_fail, "round %u: the %s attack (%s) passed", i, fz_name[kind],
	      rec_lie_name(lie));
	CHECK(!fz_slot_fails(fz_seed, i), "round %u: rank %u's refused dispatch slot let this "
	      "rank's phase pass", i, f->attacker);
	CHECK(!fz_gone_first(fz_seed, i), "round %u: rank %u went before its submit and this "
	      "rank's phase passed", i, f->attacker);
	if (forward(sh, slot, step, layer, bf16, &rows))
		return 1;
	if (kind == FZ_SLOT_AFTER && r % 3 == 2)
		(void)slot_garble(slot, fz_mix(r), k);
	word_set(RW_PW_DONE, k); /* P5 */
	if (kill_at == 3)
		fz_die("after its done");
	k = ++*k_p;
	const int clie = kind == FZ_REC && (r >> 40 & 1) ? 1 + (int)((r >> 41) % (CLIE_COUNT - 1)) :
							  CLIE_OK;
	clied = 0;
	lie_salt = (uint32_t)(r >> 24);
	cgarble = kind == FZ_CSLOT ? 1 + (r >> 4) : 0;
	if (combine(sh, slot, k, step, layer, bf16, clie, &st, &tokens))
		return 1;
	if (kill_at == 6)
		fz_die("after its combine's done");
	if (st) {
		const char *why = reason(c);
		printf("combine failed: %s: %s\n", rw_client_strerror(st), why);
		shm->failed++;
		CHECK(why[0], "round %u: the combine failed with no reason", i);
		char named[32];
		snprintf(named, sizeof(named), "local rank %u: ", f->attacker);
		CHECK(!cgarble || strstr(why, cgarble_want), "round %u: the garbage combine slot was "
		      "refused with '%s' (want '%s')", i, why, cgarble_want);
		CHECK(attack || f->kind != FZ_CSLOT || (st == RW_E_PHASE && strstr(why, named)),
		      "round %u: the refused combine slot of rank %u failed this rank's combine with "
		      "%d '%s' (want RW_E_PHASE naming '%s')", i, f->attacker, st, why, named);
		CHECK(attack || !fz_goes(f->kind) || !strstr(why, "timed out"),
		      "round %u: a rank that went left this rank's combine to the phase timeout: '%s'",
		      i, why);
		CHECK(!clied || strstr(why, clie >= CLIE_ROWS ? "the dispatch delivered" :
				       "combine record"), "round %u: the lying combine (%d) is not "
		      "named: '%s'", i, clie, why);
		CHECK(!fz_must_pass(fz_seed, i), "round %u: a %s round must pass", i,
		      fz_name[f->kind]);
		return 0;
	}
	CHECK(!clied, "round %u: the lying combine (%d) passed", i, clie);
	CHECK(f->kind != FZ_CSLOT, "round %u: rank %u's refused combine slot let this rank's "
	      "combine pass", i, f->attacker);
	printf("passed (%llu rows, %llu tokens)\n", (unsigned long long)rows,
	       (unsigned long long)tokens);
	shm->passed++;
	return 0;
}

/* An elsewhere attack's next life, first: it joins group "GROUP-xI" under its rank, takes a page
 * and that group's slabs, submits round i's dispatch there (a pair that can never gather: no
 * other rank is in that group) and leaves. Its group's seat is not taken by it meanwhile, nor is
 * that group's key its group's (another group: another key). */
static int fz_visit(const rw_client_opts_t *o, const rw_wl_shape_t *sh, uint32_t i,
		    uint32_t layers)
{
	char name[RW_GROUP_NAME_MAX];
	snprintf(name, sizeof(name), "%s-x%u", o->group, i);
	rw_client_opts_t vo = *o;
	vo.group = name;
	rw_client_t *c = NULL;
	void *page = NULL;
	size_t bytes;
	int rc = rw_client_connect(&vo, &c);
	if (rc == 0)
		rc = rw_client_rank_page(c, world * MAX_ROWS, &page, &bytes);
	CHECK(rc == 0, "visit %s: %s: %s", name, rw_client_strerror(rc),
	      c ? rw_client_last_message(c) : "");
	if (page_maps(c, page))
		return 1;
	rw_wl_gen(sh, i / layers, i % layers, me, &mine);
	(void)dispatch_slot(sh, i / layers, i % layers, 1);
	word_set(RW_PW_SUBMIT, 1);
	usleep(20000);
	printf("visited group %s\n", name);
	rw_client_close(c);
	return 0;
}

/* One life: join (again: the seat of a killed rank is free once its daemon saw it go), the
 * page and the slabs, then the rounds from the one the last life was in. */
static int fuzz_life(const rw_client_opts_t *o, const rw_wl_shape_t *sh, uint64_t seed,
		     uint32_t layers, uint32_t rounds, fz_shared_t *shm)
{
	rw_client_t *c = NULL;
	void *page = NULL;
	size_t bytes;
	if (shm->elsewhere) {
		const uint32_t i = shm->elsewhere - 1;
		shm->elsewhere = 0;
		if (fz_visit(o, sh, i, layers))
			return 1;
	}
	for (int tries = 0;; tries++) {
		int rc = rw_client_connect(o, &c);
		if (rc == 0)
			rc = rw_client_rank_page(c, world * MAX_ROWS, &page, &bytes);
		if (rc == 0)
			break;
		CHECK(tries < 400, "join again: %s: %s", rw_client_strerror(rc),
		      c ? rw_client_last_message(c) : "");
		rw_client_close(c);
		c = NULL;
		usleep(25000);
	}
	if (page_maps(c, page))
		return 1;
	uint64_t k = 0;
	fz_next_round = &shm->round;
	fz_no_meet = &shm->no_meet;
	fz_elsewhere = &shm->elsewhere;
	fz_client = c;
	for (uint32_t i = shm->round; i < rounds; i++) {
		shm->round = i;
		const fz_round_t f = fz_plan(seed, i);
		const int attack = (f.attacker == me || fz_second(&f) == me) && f.kind != FZ_NONE &&
				   shm->attacked != i + 1;
		if (attack) {
			shm->attacked = i + 1;
			shm->attacks++;
		}
		/* a life whose last one left before its round's submit goes on at once, as a
		 * trainer's rank that restarted alone: the others meet without waiting for it */
		const int nowait = shm->no_meet;
		shm->no_meet = 0;
		if (fz_meet(i, nowait))
			return 1;
		const int rc = fuzz_round(c, sh, &k, i, layers, &f, attack, shm);
		fflush(stdout);
		if (rc == FZ_REJOIN) /* dropped or left: the next life plays the next round */
			shm->round = i + 1;
		if (rc)
			return rc;
	}
	rw_client_close(c);
	return 0;
}

static int fuzz_main(const rw_client_opts_t *o, const rw_wl_shape_t *sh, uint32_t layers,
		     uint32_t steps)
{
	const char *fs = getenv("RW_PAGERANK_FUZZ");
	const uint64_t seed = fs ? strtoull(fs, NULL, 10) : sh->seed;
	fz_seed = seed;
	fz_shared_t *shm = mmap(NULL, sizeof(*shm), PROT_READ | PROT_WRITE,
				MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	CHECK(shm != MAP_FAILED, "shared memory");
	uint32_t lives = 0;
	int rc;
	for (;;) {
		fflush(stdout);
		const pid_t pid = fork();
		CHECK(pid >= 0, "fork");
		if (pid == 0)
			_exit(fuzz_life(o, sh, seed, layers, layers * steps, shm));
		int ws;
		CHECK(waitpid(pid, &ws, 0) == pid, "waitpid");
		lives++;
		CHECK(WIFEXITED(ws) || (WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL),
		      "life %u ended by signal %d", lives, WIFSIGNALED(ws) ? WTERMSIG(ws) : 0);
		rc = WIFEXITED(ws) ? WEXITSTATUS(ws) : FZ_REJOIN;
		CHECK(rc != FZ_REJOIN || shm->attacked == shm->round + 1 ||
		      shm->attacked == shm->round,
		      "round %u: the rank left without attacking", shm->round);
		if (rc != FZ_REJOIN)
			break;
		CHECK(lives < 1000, "too many lives");
	}
	printf("fuzz: rank %u: seed %llu, %u rounds, %u attacks made, %u lives, %u passed, %u "
	       "failed%s\n", me, (unsigned long long)seed, layers * steps, shm->attacks, lives,
	       shm->passed, shm->failed, rc ? " (a check failed)" : "");
	return rc;
}

/* --- mode lib: librailwave's rank path (rank/) on the CUDA driver $RW_CUDA_DRIVER names --- */
typedef struct lib_rank {
	int on_host;                 /* the rank path of a host rank (RW_RANK_HOST): no CUDA */
	rw_client_rank_t *rp;
	rw_cuda_stream_t *stream;
	rw_client_stream_t cs;
	/* A dispatch's inputs and outputs (the combine's too): two sets, for two dispatches in
	 * flight (mode host-pipe); cur is the one the calls below use. */
	struct lib_bufs {
		rw_cuda_dptr_t x, ids, w, recv_x, recv_meta, recv_counts;
	} b[2], *cur;
	uint8_t *host;               /* staging of inputs and outputs */
} lib_rank_t;

enum { HIDDEN = 24, META = 16 + 8 * TOPK };
static int lib_die;
static int lib_until; /* mode host-until: a call the gone daemon refused is the phase failing */

/* Buffers the phases read and write: device memory, or a host rank's own (16-byte aligned). */
static int lib_alloc(const lib_rank_t *lr, size_t bytes, rw_cuda_dptr_t *p)
{
	if (!lr->on_host)
		return rw_cuda_mem_alloc(0, bytes, p) == RW_OK ? 0 : -1;
	void *m = aligned_alloc(64, (bytes + 63) / 64 * 64);
	*p = (rw_cuda_dptr_t)(uintptr_t)m;
	return m ? 0 : -1;
}

static int lib_put(const lib_rank_t *lr, rw_cuda_dptr_t dst, const void *src, size_t n)
{
	if (!lr->on_host)
		return rw_cuda_memcpy_htod(0, dst, src, n) == RW_OK ? 0 : -1;
	memcpy((void *)(uintptr_t)dst, src, n);
	return 0;
}

static int lib_get(const lib_rank_t *lr, void *dst, rw_cuda_dptr_t src, size_t n)
{
	if (!lr->on_host)
		return rw_cuda_memcpy_dtoh(0, dst, src, n) == RW_OK ? 0 : -1;
	memcpy(dst, (const void *)(uintptr_t)src, n);
	return 0;
}

/* Phase k's end: one blocking wait; a host rank's odd layers instead look with timeout 0 until
 * it answers (each look drives the phase as far as the daemon's words allow and keeps its place:
 * rank/host.c). The phase's code, or RW_E_TIMEOUT past WAIT_S. */
static int lib_wait(lib_rank_t *lr, uint64_t k, uint32_t layer, rw_client_rank_done_t *done)
{
	if (!lr->on_host || layer % 2 == 0)
		return rw_client_rank_wait(lr->rp, k, WAIT_S * 1000, done);
	const struct timespec nap = { 0, 20000 };
	for (long i = 0; i < WAIT_S * 50000L; i++) {
		int rc = rw_client_rank_wait(lr->rp, k, 0, done);
		if (rc != RW_E_TIMEOUT)
			return rc;
		nanosleep(&nap, NULL);
	}
	return RW_E_TIMEOUT;
}

/* $RW_PAGERANK_SMS: the rank path's SM budget (rw_client_rank_open_opts), else none. */
static int32_t lib_sms(void)
{
	const char *v = getenv("RW_PAGERANK_SMS");
	return v ? (int32_t)atoi(v) : 0;
}

static int lib_open(rw_client_t *c, lib_rank_t *lr)
{
	const uint32_t cap = world * MAX_ROWS;
	const rw_client_rank_opts_t o = { .max_recv = cap, .max_sms = lib_sms() };
	int rc = rw_client_rank_open_opts(c, lr->on_host ? RW_RANK_HOST : 0, &o, &lr->rp);
	if (rc == RW_E_NO_CUDA) {
		printf("skip: no rank path here: %s\n", rw_client_rank_message(NULL));
		exit(77);
	}
	CHECK(rc == 0, "rank open: %s: %s", rw_client_strerror(rc), rw_client_rank_message(NULL));
	if (lr->on_host) {
		lr->cs = (rw_client_stream_t){ .device = RW_RANK_HOST };
	} else {
		rw_cuda_ext_stream_t e;
		CHECK(rw_cuda_stream_create(0, &lr->stream) == RW_OK &&
		      rw_cuda_ext_stream_of(lr->stream, &e) == RW_OK, "a CUDA stream");
		lr->cs = (rw_client_stream_t){ .device = e.device, .handle = e.handle };
	}
	for (lr->cur = &lr->b[1]; !lr->host; lr->cur--) { /* once: a rank that joins again keeps them */
		CHECK(lib_alloc(lr, (size_t)MAX_ROWS * HIDDEN * 4, &lr->cur->x) == 0 &&
		      lib_alloc(lr, (size_t)MAX_ROWS * TOPK * 4, &lr->cur->ids) == 0 &&
		      lib_alloc(lr, (size_t)MAX_ROWS * TOPK * 4, &lr->cur->w) == 0 &&
		      lib_alloc(lr, (size_t)cap * HIDDEN * 4, &lr->cur->recv_x) == 0 &&
		      lib_alloc(lr, (size_t)cap * META, &lr->cur->recv_meta) == 0 &&
		      lib_alloc(lr, (size_t)MAX_EXPERTS * 4, &lr->cur->recv_counts) == 0, "buffers");
		if (lr->cur == &lr->b[0]) {
			lr->host = calloc((size_t)cap, HIDDEN * 4 + META);
			CHECK(lr->host, "out of memory");
			break;
		}
	}
	return 0;
}

/* One dispatch through rw_client_rank_dispatch (mine: this rank's workload of the layer; the
 * buffer set lr->cur), phase *k_p. 0, or 1 on a check that failed. */
static int lib_send(lib_rank_t *lr, const rw_wl_shape_t *sh, uint32_t step, uint32_t layer,
		    int bad_id, uint64_t *k_p)
{
	const int bf16 = rw_wl_bf16(step, layer);
	const uint32_t row = sh->hidden * (bf16 ? 2 : 4), cap = world * MAX_ROWS;
	for (uint32_t t = 0; t < mine.n; t++)
		rw_wl_put_row(lr->host + (size_t)t * row, bf16, mine.x + (size_t)t * sh->hidden,
			      sh->hidden);
	CHECK(!mine.n || (lib_put(lr, lr->cur->x, lr->host, (size_t)mine.n * row) == 0 &&
			  lib_put(lr, lr->cur->ids, mine.ids, (size_t)mine.n * TOPK * 4) == 0 &&
			  lib_put(lr, lr->cur->w, mine.w, (size_t)mine.n * TOPK * 4) == 0),
	      "inputs to the device");
	const int32_t past = (int32_t)experts + 3; /* mode host-bad: token 1's first id */
	CHECK(!bad_id || (mine.n > 1 && lib_put(lr, lr->cur->ids + TOPK * 4, &past, 4) == 0),
	      "a bad id needs 2 tokens");
	const rw_client_rank_dispatch_t d = {
		.dtype = bf16 ? RW_DTYPE_BF16 : RW_DTYPE_FP32, .topk = TOPK, .layer = layer,
		.step = step, .token_count = mine.n, .hidden = sh->hidden, .n_experts = experts,
		.path = path_of(step, layer),
		.tokens = lr->cur->x, .topk_ids = lr->cur->ids, .topk_weights = lr->cur->w, .recv_x = lr->cur->recv_x,
		.recv_meta = lr->cur->recv_meta, .recv_counts = lr->cur->recv_counts, .recv_cap = cap };
	int rc = rw_client_rank_dispatch(lr->rp, &lr->cs, &d, k_p);
	if (rc == RW_E_CLOSED && lib_until) /* the daemon went before this call */
		return 2;
	CHECK(rc == 0, "dispatch: %s: %s", rw_client_strerror(rc), rw_client_rank_message(lr->rp));
	if (lib_die) { /* mode host-die: killed after submit, before its pack */
		printf("dying at submit %llu\n", (unsigned long long)*k_p);
		fflush(stdout);
		_exit(3);
	}
	return 0;
}

/* Dispatch k's end, its outputs (in lr->cur) checked as the CPU path's. Returns 0 with *st_p the
 * phase's code (0 passed), or 1 on a check that failed. */
static int lib_check(lib_rank_t *lr, const rw_wl_shape_t *sh, uint32_t step, uint32_t layer,
		     const uint64_t *k_p, int *st_p, uint64_t *rows_p, uint32_t *recv_p)
{
	const int bf16 = rw_wl_bf16(step, layer);
	const uint32_t row = sh->hidden * (bf16 ? 2 : 4), cap = world * MAX_ROWS;
	rw_client_rank_done_t done;
	*st_p = lib_wait(lr, *k_p, layer, &done);
	CHECK(*st_p != RW_E_TIMEOUT, "phase %llu: not done", (unsigned long long)*k_p);
	if (*st_p)
		return 0;
	uint32_t ecount[MAX_EXPERTS], got[MAX_EXPERTS] = { 0 }, counts[MAX_EXPERTS];
	const uint32_t expect = expect_begin(sh, step, layer, ecount);
	CHECK(done.recv_tokens == expect && done.overflow == 0, "step %u layer %u: %u rows (%u "
	      "dropped), expected %u", step, layer, done.recv_tokens, done.overflow, expect);
	uint8_t *rows = lr->host, *meta = lr->host + (size_t)cap * HIDDEN * 4;
	CHECK(lib_get(lr, counts, lr->cur->recv_counts, experts * 4) == 0 &&
	      (!expect || (lib_get(lr, rows, lr->cur->recv_x, (size_t)expect * row) == 0 &&
			   lib_get(lr, meta, lr->cur->recv_meta, (size_t)expect * META) == 0)),
	      "outputs from the device");
	for (uint32_t j = 0; j < expect; j++) {
		const uint8_t *m = meta + (size_t)j * META;
		uint32_t src_node, src_rank, token;
		int32_t ids[TOPK];
		float w[TOPK];
		memcpy(&src_node, m, 4);
		memcpy(&src_rank, m + 4, 4);
		memcpy(&token, m + 8, 4);
		memcpy(ids, m + 16, sizeof(ids));
		memcpy(w, m + 16 + 4 * TOPK, sizeof(w));
		CHECK(src_rank / gpus == src_node, "row %u: rank %u is not on node %u", j, src_rank,
		      src_node);
		if (row_check(sh, j, src_node, src_rank % gpus, token, ids, w, rows + (size_t)j * row,
			      bf16, got))
			return 1;
	}
	if (counts_check(got, ecount) || counts_check(counts, ecount))
		return 1;
	*rows_p += expect;
	*recv_p = expect;
	return 0;
}

/* lib_send, then lib_check. */
static int lib_phase(lib_rank_t *lr, const rw_wl_shape_t *sh, uint32_t step, uint32_t layer,
		     int bad_id, uint64_t *k_p, int *st_p, uint64_t *rows_p, uint32_t *recv_p)
{
	const int sent = lib_send(lr, sh, step, layer, bad_id, k_p);
	if (sent == 2) { /* refused by a daemon that is gone: this phase failed */
		*st_p = RW_E_CLOSED;
		return 0;
	}
	if (sent)
		return 1;
	return lib_check(lr, sh, step, layer, k_p, st_p, rows_p, recv_p);
}

/* The combine of dispatch kd through rw_client_rank_combine: for each of its n received rows
 * (their sources in the metadata lib_phase left in lr->host) the workload's expert output, then
 * every token's combined row checked against the workload's. *st_p: the phase's code. */
static int lib_csend(lib_rank_t *lr, const rw_wl_shape_t *sh, uint32_t step, uint32_t layer,
		     uint64_t kd, uint32_t n, uint64_t *k_p)
{
	const int bf16 = rw_wl_bf16(step, layer);
	const uint32_t row = sh->hidden * (bf16 ? 2 : 4), cap = world * MAX_ROWS;
	const uint8_t *meta = lr->host + (size_t)cap * HIDDEN * 4;
	float v[64];
	CHECK(sh->hidden <= 64, "hidden");
	for (uint32_t j = 0; j < n; j++) {
		uint32_t src_rank, token;
		memcpy(&src_rank, meta + (size_t)j * META + 4, 4);
		memcpy(&token, meta + (size_t)j * META + 8, 4);
		rw_wl_expert_row(&all[src_rank], token, me, per_rank, sh->hidden, v);
		rw_wl_put_row(lr->host + (size_t)j * row, bf16, v, sh->hidden);
	}
	CHECK(!n || lib_put(lr, lr->cur->recv_x, lr->host, (size_t)n * row) == 0,
	      "expert rows to the device");
	const rw_client_rank_combine_t cb = { .dispatch = kd, .rows = lr->cur->recv_x, .out = lr->cur->x };
	int rc = rw_client_rank_combine(lr->rp, &lr->cs, &cb, k_p);
	if (rc == RW_E_CLOSED && lib_until) /* the daemon went before this call */
		return 2;
	CHECK(rc == 0, "combine: %s: %s", rw_client_strerror(rc), rw_client_rank_message(lr->rp));
	return 0;
}

/* Combine k's end: every token's combined row (lr->cur) checked against mine's. */
static int lib_ccheck(lib_rank_t *lr, const rw_wl_shape_t *sh, uint32_t step, uint32_t layer,
		      uint64_t k, int *st_p, uint64_t *tokens_p)
{
	const int bf16 = rw_wl_bf16(step, layer);
	const uint32_t row = sh->hidden * (bf16 ? 2 : 4);
	*st_p = lib_wait(lr, k, layer, NULL);
	CHECK(*st_p != RW_E_TIMEOUT, "combine %llu: not done", (unsigned long long)k);
	if (*st_p)
		return 0;
	CHECK(!mine.n || lib_get(lr, lr->host, lr->cur->x, (size_t)mine.n * row) == 0,
	      "combined rows from the device");
	for (uint32_t t = 0; t < mine.n; t++)
		for (uint32_t e = 0; e < sh->hidden; e++) {
			const float got = rw_wl_get_elem(lr->host + (size_t)t * row, bf16, e);
			CHECK(got == rw_wl_combined(&mine, t, e, sh->hidden), "step %u layer %u token "
			      "%u elem %u: combine %g, expected %g", step, layer, t, e, got,
			      rw_wl_combined(&mine, t, e, sh->hidden));
		}
	*tokens_p += mine.n;
	return 0;
}

/* The combine of dispatch kd: lib_csend, then lib_ccheck. */
static int lib_combine(lib_rank_t *lr, const rw_wl_shape_t *sh, uint32_t step, uint32_t layer,
		       uint64_t kd, uint32_t n, int *st_p, uint64_t *tokens_p)
{
	uint64_t k = 0;
	const int sent = lib_csend(lr, sh, step, layer, kd, n, &k);
	if (sent == 2) { /* refused by a daemon that is gone: this phase failed */
		*st_p = RW_E_CLOSED;
		return 0;
	}
	if (sent)
		return 1;
	return lib_ccheck(lr, sh, step, layer, k, st_p, tokens_p);
}

static int work_alloc(rw_wl_work_t *w)
{
	w->ids = calloc(MAX_ROWS, sizeof(*w->ids));
	w->w = calloc(MAX_ROWS, sizeof(*w->w));
	w->x = calloc((size_t)MAX_ROWS * 64, sizeof(float));
	return w->ids && w->w && w->x ? 0 : -1;
}

int main(int argc, char **argv)
{
	if (argc < 10) {
		fprintf(stderr, "usage: rw_pagerank SOCKET GROUP RANK NODES GPUS EXPERTS LAYERS STEPS "
				"SEED [ok|lie|clie|one|until|late-until|die-plan|die-done|die-after|lib|host[-one|-until|-die|-bad]|fuzz]\n");
		return 2;
	}
	me = (uint32_t)atoi(argv[3]);
	nodes = (uint32_t)atoi(argv[4]);
	gpus = (uint32_t)atoi(argv[5]);
	experts = (uint32_t)atoi(argv[6]);
	const uint32_t layers = (uint32_t)atoi(argv[7]), steps = (uint32_t)atoi(argv[8]);
	const char *mode = argc > 10 ? argv[10] : "ok";
	world = nodes * gpus;
	per_rank = experts / world;
	CHECK(nodes <= 64 && world * MAX_ROWS <= RW_PAGE_MAX_RECV, "cluster too big for the test rank");
	rw_client_opts_t o = { .socket_path = argv[1], .group = argv[2], .rank = me,
			       .world_size = world, .node = me / gpus, .local_gpu = (int32_t)(me % gpus) };
	const rw_wl_shape_t sh = { .seed = strtoull(argv[9], NULL, 10), .gpus = gpus,
				   .experts = experts, .per_rank = per_rank, .hidden = HIDDEN };
	all = calloc(world, sizeof(*all));
	seen = calloc((size_t)world * MAX_ROWS, 1);
	CHECK(all && seen && work_alloc(&mine) == 0, "out of memory");
	for (uint32_t q = 0; q < world; q++)
		CHECK(work_alloc(&all[q]) == 0, "out of memory");
	if (strcmp(mode, "fuzz") == 0)
		return fuzz_main(&o, &sh, layers, steps);
	rw_client_t *c = NULL;
	int rc = rw_client_connect(&o, &c);
	CHECK(rc == 0, "connect: %s", rw_client_strerror(rc));
	const char *go = getenv("RW_PAGERANK_GO"), *hold = getenv("RW_PAGERANK_HOLD");
	if (wait_file(go))
		return 1;
	uint64_t k = 0, rows = 0;
	const int host = strncmp(mode, "host", 4) == 0;
	if (strcmp(mode, "lib") == 0 || host) { /* the library's rank path, CUDA or host */
		const char *sub = host && mode[4] == '-' ? mode + 5 : "";
		const int one = strcmp(sub, "one") == 0, bad = strcmp(sub, "bad") == 0;
		const int rejoin = strcmp(sub, "rejoin") == 0, skip = strcmp(sub, "skip") == 0;
		const int quit = strcmp(sub, "quit") == 0, abort_ = strcmp(sub, "abort") == 0;
		const int cskip = strcmp(sub, "cskip") == 0;
		const char *delay = getenv("RW_PAGERANK_DELAY_MS");
		int until = strcmp(sub, "until") == 0, expect_fail = bad;
		static lib_rank_t lr;
		lr.on_host = host;
		lib_die = strcmp(sub, "die") == 0;
		lib_until = strcmp(sub, "until") == 0;
		if (lib_open(c, &lr))
			return 1;
		uint64_t tokens = 0;
		if (strcmp(sub, "pipe") == 0) { /* each combine left in flight: the next dispatch's */
			uint64_t kc = 0;        /* call ends it first */
			uint32_t pstep = 0, player = 0;
			int st = 0;
			for (uint32_t step = 0; step < steps; step++)
				for (uint32_t layer = 0; layer < layers; layer++) {
					uint64_t kd;
					uint32_t n;
					rw_wl_gen(&sh, step, layer, me, &mine);
					lr.cur = &lr.b[(step * layers + layer) & 1];
					if (lib_send(&lr, &sh, step, layer, 0, &kd) ||
					    lib_check(&lr, &sh, step, layer, &kd, &st, &rows, &n))
						return 1;
					CHECK(st == 0, "phase %llu failed: %s: %s", (unsigned long long)kd,
					      rw_client_strerror(st), rw_client_rank_message(lr.rp));
					if (kc) { /* the previous layer's combine: ended already */
						rw_wl_gen(&sh, pstep, player, me, &mine);
						lr.cur = &lr.b[(pstep * layers + player) & 1];
						if (lib_ccheck(&lr, &sh, pstep, player, kc, &st, &tokens))
							return 1;
						CHECK(st == 0, "combine %llu failed: %s: %s",
						      (unsigned long long)kc, rw_client_strerror(st),
						      rw_client_rank_message(lr.rp));
						rw_wl_gen(&sh, step, layer, me, &mine);
						lr.cur = &lr.b[(step * layers + layer) & 1];
					}
					if (lib_csend(&lr, &sh, step, layer, kd, n, &kc))
						return 1;
					pstep = step;
					player = layer;
				}
			if (kc && (lib_ccheck(&lr, &sh, pstep, player, kc, &st, &tokens) || st != 0))
				return 1;
		}
		for (uint32_t step = 0; step < steps && strcmp(sub, "pipe") != 0; step++)
			for (uint32_t layer = 0; layer < layers; layer++) {
				if (quit && step == 1) {
					printf("quit after step 0\n");
					goto lib_out;
				}
				if (rejoin && step == 1) { /* leave, join again, go on at step 2 */
					if (layer == 0) {
						const char *ld = getenv("RW_PAGERANK_LEAVE_DELAY_MS");
						usleep(ld ? (useconds_t)atoi(ld) * 1000 : 0);
						rw_client_rank_close(lr.rp);
						rw_client_close(c);
						c = NULL;
						rc = rw_client_connect(&o, &c);
						CHECK(rc == 0, "connect again: %s", rw_client_strerror(rc));
						if (lib_open(c, &lr))
							return 1;
						usleep(delay ? (useconds_t)atoi(delay) * 1000 : 0);
					}
					continue;
				}
				if (skip && step == 1 && layer == 0) {
					usleep(delay ? (useconds_t)atoi(delay) * 1000 : 0);
					expect_fail = 1;
				}
				rw_wl_gen(&sh, step, layer, me, &mine);
				int st = 0;
				uint32_t n = 0;
				if (lib_phase(&lr, &sh, step, layer, bad && me == 0 && k == 0, &k, &st,
					      &rows, &n))
					return 1;
				if (st != 0 && (expect_fail || one || until)) { /* failed, named */
					printf("%s: phase %llu failed: %s: %s\n", mode,
					       (unsigned long long)k, rw_client_strerror(st),
					       rw_client_rank_message(lr.rp));
					fflush(stdout);
					expect_fail = 0;
					if (one || until)
						goto lib_out;
					continue;
				}
				CHECK(!expect_fail, "%s: phase %llu passed", mode, (unsigned long long)k);
				CHECK(st == 0, "phase %llu (step %u layer %u) failed: %s: %s",
				      (unsigned long long)k, step, layer, rw_client_strerror(st),
				      rw_client_rank_message(lr.rp));
				if (one) {
					printf("%s: phase %llu passed\n", mode, (unsigned long long)k);
					goto lib_out;
				}
				if (abort_ && step == 1 && layer == 0) { /* no combine: fail the pair */
					uint64_t ka = 0;
					rc = rw_client_rank_abort(lr.rp, NULL, k, RW_RANK_ABORT_ARGUMENT,
								  &ka);
					CHECK(rc == 0, "abort of phase %llu: %s: %s",
					      (unsigned long long)k, rw_client_strerror(rc),
					      rw_client_rank_message(lr.rp));
					rc = rw_client_rank_wait(lr.rp, ka, WAIT_S * 1000, NULL);
					printf("host-abort: phase %llu aborted: %s: %s\n",
					       (unsigned long long)ka, rw_client_strerror(rc),
					       rw_client_rank_message(lr.rp));
					fflush(stdout);
					CHECK(rc == RW_E_PHASE, "the abort answered %s, not RW_E_PHASE",
					      rw_client_strerror(rc));
					continue;
				}
				if (lib_combine(&lr, &sh, step, layer, k, n, &st, &tokens))
					return 1;
				if (st != 0 && cskip && step == 1 && layer == 0) { /* another aborted it */
					printf("host-cskip: phase %llu failed: %s: %s\n",
					       (unsigned long long)k + 1, rw_client_strerror(st),
					       rw_client_rank_message(lr.rp));
					fflush(stdout);
					continue;
				}
				if (st != 0 && until) {
					printf("%s: phase %llu failed: %s: %s\n", mode,
					       (unsigned long long)k + 1, rw_client_strerror(st),
					       rw_client_rank_message(lr.rp));
					goto lib_out;
				}
				CHECK(st == 0, "combine of phase %llu (step %u layer %u) failed: %s: %s",
				      (unsigned long long)k, step, layer, rw_client_strerror(st),
				      rw_client_rank_message(lr.rp));
				if (until == 1 && k >= 3) { /* two dispatches and combines passed */
					printf("%s: running\n", mode);
					fflush(stdout);
					until = 2;
				}
			}
		printf("rank %u: %u steps x %u layers dispatched and combined through librailwave's "
		       "%s rank path, verified (%llu rows, %llu tokens combined; SM budget %d)\n", me,
		       steps, layers, host ? "host" : "CUDA", (unsigned long long)rows,
		       (unsigned long long)tokens, lib_sms());
lib_out:
		if (wait_file(hold))
			return 1;
		rw_client_rank_close(lr.rp);
		rw_client_close(c);
		return 0;
	}
	if (page_join(c))
		return 1;
	if (wait_file(getenv("RW_PAGERANK_SUBMIT_GO")))
		return 1;
	int expect_fail = strcmp(mode, "lie") == 0;
	const int liar = expect_fail && me == 0, one = strcmp(mode, "one") == 0;
	const int late = strcmp(mode, "late-until") == 0;
	int until = late || strcmp(mode, "until") == 0, expect_cfail = strcmp(mode, "clie") == 0;
	const int clie = expect_cfail && me == 0;
	uint64_t combined = 0;
	for (uint32_t step = 0; step < steps; step++)
		for (uint32_t layer = 0; layer < layers; layer++) {
			const int bf16 = rw_wl_bf16(step, layer);
			rw_wl_gen(&sh, step, layer, me, &mine);
			uint8_t *slot = dispatch_slot(&sh, step, layer, ++k);
			word_set(RW_PW_SUBMIT, k); /* P1 */
			if (strcmp(mode, "die-plan") == 0) {
				printf("dying at submit %llu\n", (unsigned long long)k);
				fflush(stdout);
				_exit(3);
			}
			int32_t st = 0;
			if (wait_status(RW_PW_PLAN, k, &st))
				return 1;
			if (st == 0) {
				if (pack(&mine, slot, bf16, sh.hidden, liar && k == 1 ? REC_TOKEN : REC_OK))
					return 1;
				word_set(RW_PW_PACKED, k); /* P3 */
				if (wait_status(RW_PW_ARRIVED, k, &st))
					return 1;
			}
			if (expect_fail || ((one || until) && st != 0)) { /* the phase failed, named */
				CHECK(st != 0, "%s: phase %llu passed", mode, (unsigned long long)k);
				printf("%s: phase %llu failed: %s: %s\n", mode, (unsigned long long)k,
				       rw_client_strerror(st), reason(c));
				fflush(stdout);
				expect_fail = 0;
				word_set(RW_PW_DONE, k);
				if (one || until)
					goto out;
				continue;
			}
			CHECK(st == 0, "phase %llu (step %u layer %u) failed: %s: %s",
			      (unsigned long long)k, step, layer, rw_client_strerror(st), reason(c));
			if (forward(&sh, slot, step, layer, bf16, &rows))
				return 1;
			if (strcmp(mode, "die-done") == 0) {
				/* after the ranks beside it wrote their done: they hear of the
				 * failure at their combine */
				usleep(300 * 1000);
				printf("dying at arrived %llu\n", (unsigned long long)k);
				fflush(stdout);
				_exit(3);
			}
			if (late && k == 1)
				usleep(500 * 1000); /* its node's pair still flushing the dispatch */
			word_set(RW_PW_DONE, k); /* P5 */
			if (strcmp(mode, "die-after") == 0) { /* its rows taken: gone before the combine */
				printf("dying after done %llu\n", (unsigned long long)k);
				fflush(stdout);
				_exit(3);
			}
			if (one) {
				printf("one: phase %llu passed\n", (unsigned long long)k);
				goto out;
			}
			k++; /* the combine takes the next phase number */
			int32_t cst = 0;
			if (combine(&sh, slot, k, step, layer, bf16, clie && k == 2 ? CLIE_SLOT : CLIE_OK,
				    &cst, &combined))
				return 1;
			if (cst != 0 && (expect_cfail || until)) {
				printf("%s: phase %llu failed: %s: %s\n", mode, (unsigned long long)k,
				       rw_client_strerror(cst), reason(c));
				fflush(stdout);
				expect_cfail = 0;
				if (until)
					goto out;
				continue;
			}
			CHECK(!expect_cfail, "%s: combine %llu passed", mode, (unsigned long long)k);
			CHECK(cst == 0, "combine %llu (step %u layer %u) failed: %s: %s",
			      (unsigned long long)k, step, layer, rw_client_strerror(cst), reason(c));
			if (until == 1 && k >= 4) {
				printf("until: running\n");
				fflush(stdout);
				until = 2;
			}
		}
	printf("rank %u: %u steps x %u layers dispatched and combined on the rank path, verified "
	       "(%llu rows, %llu tokens combined)\n", me, steps, layers, (unsigned long long)rows,
	       (unsigned long long)combined);
out:
	rw_client_close(c);
	return 0;
}
