/* The CUDA mover's count() (service/mover/mover.h; docs/dataflow.md "Count on the GPU"): the node's count
 * row from the rows rw_cuda_route_count built on each device (mover_cuda_run.c launches them as
 * the ranks stage and brings the rows home), plus the host-memory ranks counted here. Only the
 * N x R row and one bad word per rank cross to the host. RAILWAVE_CUDA_MOVER=check counts every
 * rank on the host as well and fails the phase on any difference. */
#include <stdio.h>
#include <string.h>

#include "service/mover/mover_cuda_int.h"

/* The ranks not counted on a GPU (host-memory ids, or nothing to count) into cp->cnt_part. */
static rw_status_t count_host_part(cm_pair_t *cp, const rw_svc_phase_t *ph, char *why)
{
	const size_t nr = (size_t)ph->nodes * ph->rails;
	rw_rank_tokens_t rt[RW_MAX_GPUS];
	uint32_t n = 0, bad = 0;
	cp->cnt_part = rw_arena_alloc(&cp->mem, nr, sizeof(uint32_t));
	if (!cp->cnt_part) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	for (uint32_t g = 0; g < ph->gpus; g++)
		if (!(cp->cnt_ranks & (1u << g)))
			rt[n++] = (rw_rank_tokens_t){ .local_gpu = g, .n_tokens = ph->io[0][g].n_tokens,
						      .topk = ph->topk, .expert_ids = ph->io[0][g].ids };
	if (rw_sched_count(ph->topo, ph->n_experts, ph->me, rt, n, cp->cnt_part, &bad) != RW_OK)
		cp->cnt_bad = 1 + (bad < n ? rt[bad].local_gpu : 0);
	return RW_OK;
}

/* RAILWAVE_CUDA_MOVER=check: every rank's ids are on the host now (the rows came home behind
 * them): the host count pass must give the same row, or name the same rank. */
static rw_status_t count_check(cm_pair_t *cp, const rw_svc_phase_t *ph, uint32_t culprit, char *why)
{
	const size_t nr = (size_t)ph->nodes * ph->rails;
	rw_rank_tokens_t rt[RW_MAX_GPUS];
	uint32_t *want = rw_arena_alloc(&cp->mem, nr, sizeof(uint32_t)), bad = 0;
	if (!want) {
		snprintf(why, RW_SVC_WHY_MAX, "out of memory");
		return RW_ERR_NOMEM;
	}
	for (uint32_t g = 0; g < ph->gpus; g++)
		rt[g] = (rw_rank_tokens_t){ .local_gpu = g, .n_tokens = ph->io[0][g].n_tokens,
					    .topk = ph->topk, .expert_ids = ph->io[0][g].ids };
	uint32_t host_culprit = rw_sched_count(ph->topo, ph->n_experts, ph->me, rt, ph->gpus, want,
					       &bad) == RW_OK ? 0 : 1 + bad;
	size_t i = 0;
	while (!culprit && i < nr && want[i] == cp->cnt_row[i])
		i++;
	if (host_culprit == culprit && (culprit || i == nr)) {
		rw_info("cuda mover check: pair %u: the GPU count %s the host's", cp->serial,
			culprit ? "names the same bad rank as" : "row equals");
		return RW_OK;
	}
	if (host_culprit != culprit)
		snprintf(why, RW_SVC_WHY_MAX, "count check: the GPU count names bad local rank %d, the "
			 "host's %d (-1: none)", (int)culprit - 1, (int)host_culprit - 1);
	else
		snprintf(why, RW_SVC_WHY_MAX, "count check: node %u rail %u: the GPU counted %u records, "
			 "the host %u", (uint32_t)(i / ph->rails), (uint32_t)(i % ph->rails),
			 cp->cnt_row[i], want[i]);
	rw_err("cuda mover: pair %u: %s", cp->serial, why);
	return RW_ERR_STATE;
}

/* Every device's row is home: the node's row is their sum plus the host part; the culprit is the
 * lowest local rank with a bad id on either side (the host pass stops at the first one). */
static rw_status_t count_finish(cm_pair_t *cp, uint32_t *bad_p, char *why)
{
	const rw_svc_phase_t *ph = cp->ph;
	const size_t nr = (size_t)ph->nodes * ph->rails;
	uint32_t culprit = cp->cnt_bad;
	memcpy(cp->cnt_row, cp->cnt_part, nr * sizeof(uint32_t));
	for (int d = 0; d < CM_DEVICES; d++) {
		if (!(cp->cnt_devs & (1u << d)))
			continue;
		const uint32_t *dev_row = cp->cnt_host[d];
		for (size_t i = 0; i < nr; i++)
			cp->cnt_row[i] += dev_row[i];
		for (uint32_t g = 0; g < ph->gpus; g++)
			if (dev_row[nr + g] && (!culprit || g + 1 < culprit))
				culprit = g + 1;
	}
	if (cp->m->check) {
		rw_status_t st = count_check(cp, ph, culprit, why);
		if (st != RW_OK)
			return st;
	}
	if (culprit) {
		*bad_p = culprit - 1;
		snprintf(why, RW_SVC_WHY_MAX, "local rank %u: expert id out of range", culprit - 1);
		return RW_ERR_SUB_TOKENS;
	}
	return RW_OK;
}

rw_status_t cm_count(void *mover, void *state, const rw_svc_phase_t *ph, uint32_t *row,
		     int *pending_p, uint32_t *bad_p, char *why)
{
	cuda_mover_t *m = mover;
	cm_pair_t *cp = state;
	if (cp->cnt_off || !cp->cnt_sent || cp->cnt_row) {
		why[0] = '\0';
		return RW_ERR_UNSUPPORTED;
	}
	if (!m->said_count) {
		m->said_count = 1;
		rw_info("cuda mover: count rows come from the GPU (rw_cuda_route_count per CUDA rank; "
			"only the N x R row crosses to the host)");
	}
	rw_status_t st = count_host_part(cp, ph, why);
	if (st != RW_OK)
		return st;
	cp->cnt_row = row;
	*pending_p = cp->marks_cnt != 0;
	return *pending_p ? RW_OK : count_finish(cp, bad_p, why);
}

void cm_count_done(cm_pair_t *cp)
{
	if (!cp->marks_cnt || --cp->marks_cnt || !cp->cnt_row)
		return;
	char why[RW_SVC_WHY_MAX];
	uint32_t bad = 0;
	rw_status_t st = count_finish(cp, &bad, why);
	cp->m->done(cp->m->ctx, cp->serial, RW_MV_OP_COUNTED, bad, st);
}

void cm_count_release(cm_pair_t *cp)
{
	for (int d = 0; d < CM_DEVICES; d++)
		if (cp->cnt_blk[d])
			cp->m->blk[cp->cnt_blk[d] - 1].busy = 0;
}
