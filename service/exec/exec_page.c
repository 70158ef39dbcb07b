/* The executor's adapter for the words of the rank path (docs/rankpath.md "A phase"): what a
 * rank's stream writes in its rank page (ipc/page.h) — submit, packed, done — as the IPC server's
 * poller reports it. Each phase a word moved over is taken in order; its slot is read once into
 * the daemon's copies and checked before anything reads it (rw_page_submit_check, then the
 * parameters as a ring submission's are checked), so a rank that rewrites its slot later changes
 * nothing the daemon decided. A phase this daemon does not carry is failed on the rank's page
 * (status, then plan and arrived: pair P6), named in the log and in the rank's last message, so
 * the rank's stream never waits for a word that will not come. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/page.h"
#include "service/exec/exec_int.h"

/* Phase k of this rank fails with `code` (RW_E_*): the sentence goes to the log and to the
 * rank, then its page owes the words (rw_page_fail). */
static void page_phase_fail(exec_t *x, exec_member_t *mb, rw_page_head_t *pg, uint64_t k,
			    int32_t code, const char *why)
{
	char msg[RW_SVC_WHY_MAX + 96];
	snprintf(msg, sizeof(msg), "group %s rank %u phase %llu: %s", mb->g->name,
		 x->me * x->gpus + mb->local, (unsigned long long)k, why);
	rw_warn("%s", msg);
	rw_ipc_client_notice(x->ipc, mb->client, code, msg);
	rw_page_fail(pg, k, code);
}

/* The parameters as the executor would check a ring submission's, beyond rw_page_submit_check:
 * what the movers carry. 0, or -1 with why and *code_p set. */
static int params_check(const exec_t *x, const exec_member_t *mb, const rw_page_params_t *p,
			char *why, int32_t *code_p)
{
	if (p->kind == RW_KIND_DISPATCH &&
	    (p->topk == 0 || p->topk > RW_MAX_TOPK || p->hidden == 0 || p->n_experts == 0 ||
	     p->n_experts % mb->g->world != 0)) {
		snprintf(why, RW_SVC_WHY_MAX, "topk %u (1..%u), hidden %u, n_experts %u (a multiple "
			 "of the world size %u)", p->topk, RW_MAX_TOPK, p->hidden, p->n_experts,
			 mb->g->world);
		*code_p = p->n_experts == 0 || p->n_experts % mb->g->world ? RW_E_EXPERTS : RW_E_TOKENS;
		return -1;
	}
	if (p->dtype != RW_DTYPE_BF16 && p->dtype != RW_DTYPE_FP32) {
		snprintf(why, RW_SVC_WHY_MAX, "dtype %u: the daemon carries bf16 and fp32 rows",
			 p->dtype);
		*code_p = RW_E_DTYPE;
		return -1;
	}
	(void)x;
	return 0;
}

/* Phase k submitted by the rank: its slot read once, checked. */
static void page_submit(exec_t *x, exec_member_t *mb, rw_page_head_t *pg, uint64_t k)
{
	const rw_page_geom_t *geom = rw_ipc_client_page_geom(mb->client);
	rw_page_layout_t l;
	if (rw_page_layout(geom->nodes, geom->rails, geom->gpus, geom->max_recv, 1, &l) != 0)
		return page_phase_fail(x, mb, pg, k, RW_E_INTERNAL, "the page's geometry is bad");
	const uint8_t *slot = rw_page_slot_at(pg, &l, k);
	rw_page_params_t params;
	memcpy(&params, slot + l.params, sizeof(params));
	const size_t cells = (size_t)geom->nodes * geom->rails;
	uint32_t *row = malloc(cells * sizeof(*row));
	if (!row)
		return page_phase_fail(x, mb, pg, k, RW_E_INTERNAL, "out of memory");
	memcpy(row, slot + l.count_row, cells * sizeof(*row));
	char why[RW_SVC_WHY_MAX];
	int32_t code = RW_E_TOKENS;
	if (rw_page_submit_check(geom, &params, row, k, x->svc->topo.gpu_rail[mb->local], why,
				 sizeof(why)) != 0 ||
	    params_check(x, mb, &params, why, &code) != 0) {
		free(row);
		return page_phase_fail(x, mb, pg, k, code, why);
	}
	free(row);
	/* The slabs a rank's kernels write are not lent yet (docs/rankpath.md "Status"): refused,
	 * named, rather than left waiting. */
	snprintf(why, sizeof(why), "layer %u step %llu: this daemon does not carry rank-path "
		 "phases yet (submit through the rings)", params.layer,
		 (unsigned long long)params.step);
	page_phase_fail(x, mb, pg, k, RW_E_STATE, why);
}

/* A word the daemon answers (`answer`: plan for packed, arrived for done) must never be passed
 * by the rank's (its stream waits on the answer before it writes). */
static int page_word_ahead(const rw_page_head_t *pg, unsigned answer, uint64_t value)
{
	uint64_t a = atomic_load_explicit(&pg->word[answer].v, memory_order_acquire);
	return (int64_t)(value - a) > 0;
}

void exec_page_word(void *ctx, rw_ipc_client_t *client, unsigned word, uint64_t value)
{
	exec_t *x = ctx;
	exec_member_t *mb = rw_ipc_client_data(client);
	rw_page_head_t *pg = rw_ipc_client_page(client, NULL);
	if (!mb || !pg || word >= RW_PW_COUNT)
		return; /* not a member (a rank's words count only once it joined) */
	uint64_t from = mb->page_seen[word];
	mb->page_seen[word] = value;
	switch (word) {
	case RW_PW_SUBMIT:
		/* P1: the poller's report is the load-acquire of submit; every phase it moved over
		 * was published before it, in order. */
		for (uint64_t k = from + 1; (int64_t)(value - k) >= 0; k++)
			page_submit(x, mb, pg, k);
		break;
	case RW_PW_PACKED:
	case RW_PW_DONE: {
		unsigned answer = word == RW_PW_PACKED ? RW_PW_PLAN : RW_PW_ARRIVED;
		if (page_word_ahead(pg, answer, value)) {
			char why[RW_SVC_WHY_MAX];
			snprintf(why, sizeof(why), "%s moved to %llu, past the daemon's %s",
				 word == RW_PW_PACKED ? "packed" : "done", (unsigned long long)value,
				 answer == RW_PW_PLAN ? "plan" : "arrived");
			page_phase_fail(x, mb, pg, value, RW_E_TOKENS, why);
		}
		break;
	}
	default:
		break;
	}
}
