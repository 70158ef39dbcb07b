/* The executor as the daemon sees it (service/exec/exec.h): created with its data movers and the
 * peer mesh, given its IPC socket, drained on SIGTERM and torn down after the loop — in an order
 * that never lets a part outlive what it uses: the copies queued into ranks' memory land (or are
 * named and their mappings left open) before the ranks' buffers go (IPC stop), the buffers go
 * before the movers, every outstanding write reports (mesh destroy) before the pairs are freed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ev.h>

#include "service/exec/exec_int.h"

void rw_svc_exec_hooks_from_env(char *const *envp, rw_svc_exec_hooks_t *hooks_p)
{
	rw_svc_exec_hooks_t h = { 0 };
	for (char *const *e = envp; e && *e; e++) {
		const char *v = strchr(*e, '=');
		if (!v)
			continue;
		size_t n = (size_t)(v++ - *e);
		if (n == 23 && !strncmp(*e, "RAILWAVE_TEST_CHUNK_KIB", n))
			h.chunk_bytes = strtoull(v, NULL, 10) << 10;
		else if (n == 26 && !strncmp(*e, "RAILWAVE_TEST_WRITE_GAP_MS", n))
			h.write_gap_s = strtod(v, NULL) / 1000.0;
		else if (n == 25 && !strncmp(*e, "RAILWAVE_TEST_LOCAL_SLICE", n))
			h.local_slice = (uint32_t)strtoul(v, NULL, 10);
		else if (n == 23 && !strncmp(*e, "RAILWAVE_TEST_DONE_DEAF", n))
			h.done_deaf_step = strtoull(v, NULL, 10) + 1;
	}
	if (h.done_deaf_step)
		rw_warn("test switch RAILWAVE_TEST_DONE_DEAF: the ranks' done of the dispatch of "
			"layer 0 step %llu is not taken", (unsigned long long)(h.done_deaf_step - 1));
	if (h.chunk_bytes || h.write_gap_s > 0 || h.local_slice)
		rw_warn("test hooks on: rail writes of at most %llu bytes, one per %.0f ms per phase, "
			"%u local records per idle slice",
			(unsigned long long)(h.chunk_bytes ? h.chunk_bytes : EXEC_CHUNK_MAX),
			h.write_gap_s * 1000, h.local_slice ? h.local_slice : EXEC_LOCAL_SLICE);
	*hooks_p = h;
}

rw_status_t rw_svc_exec_create(rw_svc_t *svc, const rw_svc_mover_ops_t *const *movers,
			       uint32_t n_movers, const rw_svc_exec_hooks_t *hooks,
			       rw_svc_exec_t **exec_p)
{
	if (n_movers == 0 || n_movers > EXEC_MOVERS_MAX)
		return RW_ERR_INVAL;
	exec_t *x = calloc(1, sizeof(*x));
	if (!x)
		return RW_ERR_NOMEM;
	x->svc = svc;
	x->nodes = svc->cfg.n_nodes;
	x->rails = svc->cfg.rails;
	x->gpus = svc->cfg.gpus_per_node;
	x->me = svc->cfg.me;
	x->hooks = *hooks;
	rw_list_init(&x->groups);
	rw_list_init(&x->pairs);
	rw_list_init(&x->rows);
	rw_list_init(&x->tombs);
	rw_list_init(&x->ended);
	rw_list_init(&x->refused);
	if (exec_keys_init(x) != RW_OK) {
		exec_keys_free(x);
		free(x);
		return RW_ERR_NOMEM;
	}
	/* recv_region_mib is the receive memory of the node; each rail gets an equal share, and
	 * the same again for send staging: 4 sub-areas per slot. */
	uint64_t recv = (uint64_t)svc->cfg.recv_region_mib << 20;
	x->area_bytes = 2 * recv / x->rails;
	x->sub_bytes = (x->area_bytes / (4 * EXEC_SLOTS)) & ~(uint64_t)63;
	x->area_bytes = x->sub_bytes * 4 * EXEC_SLOTS;
	/* Each group's own carve-out (docs/rankpath.md "The slab areas, lent per group"): a slot of
	 * four record areas and the local area per rail (group_local_mib of it), as many as the
	 * pool holds and the wire's slot numbers name. */
	const rw_svc_config_t *cfg = &svc->cfg;
	if (cfg->group_area_mib) {
		x->carve_bytes = (uint64_t)cfg->group_area_mib << 20;
		x->carve_sub = rw_svc_carve_sub(x->carve_bytes, (uint64_t)cfg->group_local_mib << 20);
		x->carve_max = RW_MIN(cfg->group_pool_mib / cfg->group_area_mib,
				      RW_WIRE_MAX_SLOTS - EXEC_SLOTS);
		if (!x->carve_max) {
			rw_warn("group_area_mib %u is above group_pool_mib %u: no group gets a carve-out",
				cfg->group_area_mib, cfg->group_pool_mib);
			x->carve_bytes = 0;
		}
	}
	x->carve_put_at = x->carve_max ? calloc(x->carve_max, sizeof(*x->carve_put_at)) : NULL;
	if (x->carve_max && !x->carve_put_at) {
		exec_keys_free(x);
		free(x);
		return RW_ERR_NOMEM;
	}
	rw_status_t st = RW_OK;
	for (uint32_t i = 0; i < n_movers && st == RW_OK; i++) {
		x->movers[i].ops = movers[i];
		st = movers[i]->create(svc->loop, exec_on_mover_done, x, &x->movers[i].mover);
		if (st == RW_OK)
			x->n_movers++;
	}
	if (st == RW_OK)
		st = rw_svc_mesh_create(svc, x->area_bytes, x->carve_max ? x->carve_bytes : 0,
					x->carve_max, &exec_mesh_cbs, x, &x->mesh);
	if (st != RW_OK) {
		while (x->n_movers--)
			x->movers[x->n_movers].ops->destroy(x->movers[x->n_movers].mover);
		exec_keys_free(x);
		free(x->carve_put_at);
		free(x);
		return st;
	}
	exec_start(x);
	*exec_p = x;
	return RW_OK;
}

rw_status_t rw_svc_exec_ipc_start(rw_svc_exec_t *x)
{
	rw_svc_t *svc = x->svc;
	const rw_ipc_poller_config_t poller = {
		.spin_us = svc->cfg.poller_spin_us, .yield_us = svc->cfg.poller_yield_us,
		.sleep_min_us = svc->cfg.poller_sleep_min_us,
		.sleep_max_us = svc->cfg.poller_sleep_max_us,
		.busy_sleep_max_us = svc->cfg.poller_busy_sleep_max_us,
		.loop_waits = 1, /* a host rank's word wakes the loop itself (docs/rankpath.md) */
	};
	rw_ipc_server_config_t cfg = {
		.socket_path = svc->cfg.ipc_socket,
		.group = svc->cfg.ipc_group[0] ? svc->cfg.ipc_group : NULL,
		.node = (int32_t)svc->cfg.me,
		.world_size = svc->cfg.n_nodes * svc->cfg.gpus_per_node,
		.gpus_per_node = svc->cfg.gpus_per_node,
		.max_topk = RW_MAX_TOPK,
		.max_tokens = svc->cfg.max_tokens, /* bounds every per-token pass of a phase */
		.dtypes = 1u << RW_DTYPE_BF16 | 1u << RW_DTYPE_FP32, /* what the movers carry */
		.require_group_key = svc->cfg.ipc_require_group_key,
		.max_per_uid = svc->cfg.ipc_max_per_uid,
		.hello_timeout_ms = svc->cfg.ipc_hello_timeout_ms,
		.busy_poll_us = svc->cfg.ipc_busy_poll_us,
		.page_rails = svc->cfg.rails, /* rank pages, their words watched (exec_page.c) */
		.poller = &poller,
		.page_gpu_rail = svc->topo.gpu_rail,
	};
	rw_status_t st = rw_ipc_server_create(svc->loop, &cfg, &exec_ipc_ops, x, &x->ipc);
	svc->ipc = x->ipc; /* the stats socket lists its clients */
	return st;
}

static void drain_wake(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)w, (void)revents; /* its only job: ev_run(EVRUN_ONCE) returns */
}

/* What shutdown waits for: the held answers' copies (ranks' CUDA memory) and the closed pairs'
 * carve-out pulls; how many of either have not landed, how many of those on no stalled GPU
 * (returned), and their GPUs. */
typedef struct copies_left {
	unsigned ranks, carves; /* not landed */
	uint64_t devs;
} copies_left_t;

static unsigned copies_moving(exec_t *x, copies_left_t *c)
{
	uint64_t d1, d2;
	const unsigned moving = exec_answer_late_moving(x, &c->ranks, &d1) +
				exec_carves_moving(x, &c->carves, &d2);
	c->devs = d1 | d2;
	return moving;
}

/* Shutdown's wait for the GPUs (docs/service.md "Signals"): the copies the movers queued into or
 * out of ranks' CUDA memory (the failed pairs' held answers, exec_answer_late) land before the
 * IPC server closes the mappings they use, and the header pulls out of closed pairs' carve-outs
 * before the mesh frees them (rw_svc_exec_destroy). The loop turns again meanwhile — the
 * stage's marks are eventfds on it and its stall bound a timer (service/mover/stage.c) — until
 * every such copy landed or waits on a GPU declared stalled, at most gpu_stall_ms + 2 s (the
 * stall is declared within a second of its bound). New phases stay refused (draining); the
 * peers, the stats and the ranks are served. What has not landed by then is named; the ranks'
 * mappings it may use are left open. A second signal does not end the wait: the stage's destroy
 * would then wait for the same copies, unbounded, on a GPU not yet declared stalled. */
static void copies_drain(exec_t *x)
{
	struct ev_loop *loop = x->svc->loop;
	copies_left_t left;
	unsigned moving = copies_moving(x, &left);
	if (!left.ranks && !left.carves)
		return;
	const uint64_t t0 = rw_now_ns();
	const uint64_t cap = rw_svc_gpu_stall_ns() + RW_SVC_GPU_DRAIN_MARGIN_MS * 1000000ull;
	char gpus[192];
	rw_svc_gpu_list(left.devs, gpus, sizeof(gpus));
	if (moving)
		rw_info("shutdown: waiting up to %llu ms for the copies queued into or out of %u "
			"ranks' CUDA memory and %u group carve-outs on GPU %s to land before their "
			"memory goes", (unsigned long long)(cap / 1000000), left.ranks, left.carves,
			gpus);
	ev_timer wake;
	ev_init(&wake, drain_wake);
	while (moving) {
		const uint64_t spent = rw_now_ns() - t0;
		if (spent >= cap)
			break;
		ev_timer_set(&wake, (double)(cap - spent) * 1e-9, 0.);
		ev_timer_start(loop, &wake);
		ev_run(loop, EVRUN_ONCE);
		ev_timer_stop(loop, &wake);
		moving = copies_moving(x, &left);
	}
	const unsigned long long ms = (rw_now_ns() - t0) / 1000000;
	if (!left.ranks && !left.carves) {
		rw_info("shutdown: the copies into ranks' CUDA memory and group carve-outs landed "
			"after %llu ms", ms);
		return;
	}
	rw_svc_gpu_list(left.devs, gpus, sizeof(gpus));
	const char *why = moving ? "not declared stalled" : "stalled";
	if (left.ranks)
		rw_warn("shutdown: GPU %s: copies queued into or out of %u ranks' CUDA memory have "
			"not landed (%s, after %llu ms): their mappings are left open to the "
			"process's exit, never closed under a copy", gpus, left.ranks, why, ms);
	if (left.carves)
		rw_warn("shutdown: GPU %s: header pulls out of %u group carve-outs have not landed "
			"(%s, after %llu ms): the carve-outs are left to the process's exit, never "
			"freed under a copy", gpus, left.carves, why, ms);
}

void rw_svc_exec_ipc_stop(rw_svc_exec_t *x)
{
	if (!x || !x->ipc)
		return;
	x->svc->draining = 1; /* nothing new opens while the copies drain */
	exec_fail_open(x, "daemon stopping"); /* before the clients' buffers go away */
	copies_drain(x);
	exec_answer_late_flush(x); /* then the held answers, and the mappings that may close */
	rw_ipc_server_destroy(x->ipc);
	x->ipc = NULL;
	x->svc->ipc = NULL;
}

void rw_svc_exec_drain(rw_svc_exec_t *x)
{
	x->svc->draining = 1;
	if (exec_drained(x))
		rw_svc_stop(x->svc);
}

void rw_svc_exec_destroy(rw_svc_exec_t *x)
{
	if (!x)
		return;
	exec_stop(x);
	exec_carves_leave(x); /* what a copy on a GPU may still use, the mesh does not free */
	rw_svc_mesh_destroy(x->mesh); /* reports every outstanding write */
	exec_free_pairs(x);
	exec_keys_free(x);
	/* After the IPC server closed its CUDA imports. */
	for (uint32_t i = 0; i < x->n_movers; i++)
		x->movers[i].ops->destroy(x->movers[i].mover);
	exec_group_t *g, *gn;
	rw_list_for_each_safe(&x->groups, g, gn, link) {
		for (uint32_t i = 0; i < RW_MAX_GPUS; i++)
			if (g->member[i])
				exec_member_free(g->member[i]);
		rw_list_del(&g->link);
		free(g);
	}
	free(x->carve_put_at);
	free(x);
}
