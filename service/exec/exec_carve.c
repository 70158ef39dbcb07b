/* Each group's carve-out of the mesh's pool (service/mesh/mesh.h; docs/rankpath.md "The slab
 * areas, lent per group"): taken at the group's first slab request (a group whose ranks map
 * nothing runs on the shared slots and holds none of the pool), held by the group and by each of its
 * pairs until that pair is freed, and given back when the last rank left — after a heartbeat
 * timeout when the group's last pair failed, since a peer may still have writes in flight into
 * it then (docs/dataflow.md "Region reuse"). A group without one shares the area's slots.
 *
 * Who gets one (docs/security.md "The carve-out pool"): a carve-out is charged to the uid of the
 * rank whose request took it, and one uid's groups hold at most group_carve_per_uid of them. A
 * group that finds the pool spent takes back the carve-out in which no phase completed for
 * group_carve_idle_s (the longest idle), if no pair of its group holds it: the daemon
 * deregisters it and closes its memfds (the holder's ranks keep mappings of their own pages
 * only, and the next group gets new objects), its group's ranks are told, and its later page
 * phases and slab requests fail, named. A uid's carve-out given back with no phase run in it
 * passes its idle clock on to that uid's next one, so leaving and joining again under another
 * group name does not start the clock again. */
#include <stdio.h>

#include "service/exec/exec_int.h"

static uint64_t idle_ns(const exec_t *x)
{
	return (uint64_t)x->svc->cfg.group_carve_idle_s * 1000000000ull;
}

/* Keep uid's clock (its entry, a free one, else the oldest). */
static void idle_put(exec_t *x, const struct exec_carve_idle *keep)
{
	struct exec_carve_idle *e = &x->carve_idle[0];
	for (uint32_t i = 0; i < EXEC_CARVE_IDLE_UIDS; i++) {
		struct exec_carve_idle *c = &x->carve_idle[i];
		if (c->at && c->uid == keep->uid) {
			e = c;
			break;
		}
		if (c->at < e->at)
			e = c;
	}
	*e = *keep;
}

/* Group g gives its carve-out back having run no phase in it: its uid's clock is kept. */
static void idle_keep(exec_t *x, const exec_group_t *g, uint64_t now)
{
	if (!g->carve_ran && idle_ns(x))
		idle_put(x, &(struct exec_carve_idle){ .uid = g->carve_uid, .since = g->carve_idle_at,
						       .at = now });
}

/* The clock uid's last carve-out given back idle left (taken out of the table), or at 0. */
static struct exec_carve_idle idle_take(exec_t *x, uid_t uid)
{
	for (uint32_t i = 0; i < EXEC_CARVE_IDLE_UIDS; i++) {
		struct exec_carve_idle *c = &x->carve_idle[i];
		if (c->at && c->uid == uid) {
			const struct exec_carve_idle e = *c;
			c->at = 0;
			return e;
		}
	}
	return (struct exec_carve_idle){ .uid = uid };
}

static uint32_t uid_holds(const exec_t *x, uid_t uid)
{
	uint32_t n = 0;
	const exec_group_t *h;
	rw_list_for_each(&x->groups, h, link)
		n += h->carve >= 0 && h->carve_uid == uid;
	return n;
}

/* A pair, open or draining, still holds carve-out i (its writes may read it). */
static int carve_in_use(const exec_t *x, int i)
{
	const exec_pair_t *p;
	rw_list_for_each(&x->pairs, p, link)
		if (p->carve == i)
			return 1;
	return 0;
}

/* The carve-out to take back for a group that found the pool spent: the one idle longest past
 * group_carve_idle_s that no pair of its group holds (open past its gather, or draining) nor
 * waits for (a heartbeat timeout after a failed one); NULL: none. A pair still gathering its
 * local ranks' dispatches holds none yet: it takes a shared slot once they are all there. */
static exec_group_t *idle_holder(const exec_t *x, uint64_t now)
{
	exec_group_t *h, *best = NULL;
	if (!idle_ns(x))
		return NULL;
	rw_list_for_each(&x->groups, h, link)
		if (h->carve >= 0 && now >= h->carve_free_at &&
		    now - h->carve_idle_at >= idle_ns(x) && !carve_in_use(x, h->carve) &&
		    (!best || h->carve_idle_at < best->carve_idle_at))
			best = h;
	return best;
}

/* Take h's carve-out back for group `to` of uid `by`: its regions deregistered and memfds closed
 * now (no pair reads them), its ranks told; the group goes on without slabs, its page phases
 * refused. Its clock is kept for its uid's next carve-out unless that uid takes it itself. */
static void take_back(exec_t *x, exec_group_t *h, const char *to, uid_t by, uint64_t now)
{
	const unsigned long long idle = (now - h->carve_idle_at) / 1000000000ull;
	snprintf(h->carve_why, sizeof(h->carve_why), "the group's carve-out was taken back, %llu s "
		 "idle (group_carve_idle_s): leave and join again to ask anew", idle);
	h->carve_code = RW_E_LIMIT;
	h->carve_lost = 1;
	rw_warn("group %s (uid %u): its carve-out taken back for group %s: no phase completed in it "
		"for %llu s (group_carve_idle_s %u); its ranks are told, its page phases and slab "
		"requests refused", h->name, (unsigned)h->carve_uid, to, idle,
		x->svc->cfg.group_carve_idle_s);
	for (uint32_t l = 0; x->ipc && l < x->gpus; l++)
		if (h->member[l])
			rw_ipc_client_notice(x->ipc, h->member[l]->client, RW_E_LIMIT, h->carve_why);
	if (h->carve_uid != by)
		idle_keep(x, h, now);
	const uint32_t i = (uint32_t)h->carve;
	h->carve = -1;
	rw_svc_mesh_carve_put(x->mesh, i); /* the last reference: deregistered, unmapped, closed */
	x->svc->metrics.carve_outs_taken_back++;
}

/* The pool spent and nothing to take back: the log names what holds it. */
static void pool_spent(const exec_t *x, exec_group_t *g, uint64_t now)
{
	snprintf(g->carve_why, sizeof(g->carve_why), "the daemon's pool (group_pool_mib) was spent "
		 "when it first asked, none idle for group_carve_idle_s");
	const exec_group_t *h;
	rw_list_for_each(&x->groups, h, link)
		if (h->carve >= 0)
			rw_info("group %s: the pool is held by group %s (uid %u), no phase in it for "
				"%llu s of group_carve_idle_s %u%s", g->name, h->name,
				(unsigned)h->carve_uid,
				(unsigned long long)((now - h->carve_idle_at) / 1000000000ull),
				x->svc->cfg.group_carve_idle_s,
				carve_in_use(x, h->carve) ? ", a phase of it in the carve-out" :
				now < h->carve_free_at ? ", a failed phase's writes may still come" : "");
}

static void carve_take(exec_t *x, exec_group_t *g, uid_t uid)
{
	g->carve = -1;
	g->carve_code = 0;
	g->carve_why[0] = 0;
	if (!x->carve_max)
		return;
	const uint32_t bound = x->svc->cfg.group_carve_per_uid;
	const uint32_t held = uid_holds(x, uid);
	if (bound && held >= bound) {
		x->svc->metrics.carve_outs_refused++;
		g->carve_code = RW_E_LIMIT;
		snprintf(g->carve_why, sizeof(g->carve_why), "no slabs of its own: uid %u's groups "
			 "hold %u carve-outs, the per-uid bound (group_carve_per_uid)", (unsigned)uid,
			 held);
		rw_warn("group %s: no carve-out of its own (%s)", g->name, g->carve_why);
		return;
	}
	const uint64_t now = rw_now_ns();
	/* Its idle clock starts now, or goes on from its uid's carve-out given back idle within
	 * group_carve_idle_s: found before any is taken back, so a uid taking back its own idle
	 * one does not inherit that one's clock. */
	const struct exec_carve_idle was = idle_take(x, uid);
	const uint64_t since = was.at && now - was.at < idle_ns(x) ? was.since : now;
	uint32_t i;
	rw_status_t st = rw_svc_mesh_carve_take(x->mesh, g->name, &i);
	exec_group_t *h;
	if (st == RW_ERR_AGAIN && (h = idle_holder(x, now)) != NULL) {
		take_back(x, h, g->name, uid, now);
		st = rw_svc_mesh_carve_take(x->mesh, g->name, &i);
	}
	if (st == RW_OK) {
		g->carve = (int)i;
		g->carve_uid = uid;
		g->carve_ran = 0;
		g->carve_idle_at = since;
		rw_dbg("group %s: carve-out %u (%llu MiB per rail), uid %u", g->name, i,
		       (unsigned long long)x->carve_bytes >> 20, (unsigned)uid);
		return;
	}
	if (was.at)
		idle_put(x, &was); /* kept for its next */
	x->svc->metrics.carve_outs_refused++;
	g->carve_code = st == RW_ERR_AGAIN ? RW_E_LIMIT : RW_E_STATE;
	if (st == RW_ERR_AGAIN)
		pool_spent(x, g, now);
	else
		snprintf(g->carve_why, sizeof(g->carve_why), "no group slabs: %s",
			 rw_svc_mesh_carve_why(x->mesh)[0] ? rw_svc_mesh_carve_why(x->mesh)
							   : rw_status_str(st));
	rw_warn("group %s: no carve-out of its own (%s): its pairs share the region and its ranks "
		"are lent no slabs", g->name, st == RW_ERR_AGAIN ? "the pool is spent: every one of "
		"group_pool_mib / group_area_mib is held" : g->carve_why);
}

void exec_carve_want(exec_t *x, const exec_member_t *mb)
{
	exec_group_t *g = mb->g;
	if (g->carve_tried)
		return;
	g->carve_tried = 1;
	carve_take(x, g, rw_ipc_client_info(mb->client)->uid);
}

int exec_carve_lost(const exec_group_t *g, char *why, size_t len, int32_t *code_p)
{
	if (!g->carve_lost)
		return 0;
	snprintf(why, len, "%s", g->carve_why);
	*code_p = RW_E_LIMIT;
	return 1;
}

void exec_carve_ran(exec_pair_t *p)
{
	if (p->g && p->carve >= 0 && p->g->carve == p->carve) {
		p->g->carve_ran = 1;
		p->g->carve_idle_at = rw_now_ns();
	}
}

void exec_carve_drop(exec_t *x, exec_group_t *g)
{
	if (g->carve < 0)
		return;
	const uint32_t i = (uint32_t)g->carve;
	const uint64_t now = rw_now_ns();
	idle_keep(x, g, now);
	g->carve = -1;
	if (now < g->carve_free_at) {
		x->carve_put_at[i] = g->carve_free_at; /* exec_carve_tick puts it */
		return;
	}
	rw_svc_mesh_carve_put(x->mesh, i);
}

void exec_carve_tick(exec_t *x, uint64_t now)
{
	for (uint32_t i = 0; i < x->carve_max; i++)
		if (x->carve_put_at[i] && now >= x->carve_put_at[i]) {
			x->carve_put_at[i] = 0;
			rw_svc_mesh_carve_put(x->mesh, i);
		}
}

int exec_carve_lend(exec_t *x, const exec_group_t *g, uint32_t rail, rw_ipc_slab_t *slab_p,
		    const char **why_p)
{
	if (g->carve < 0) {
		*why_p = g->carve_why[0] ? g->carve_why : "the group has no slabs of its own";
		return g->carve_code ? g->carve_code : RW_E_STATE;
	}
	const uint32_t i = (uint32_t)g->carve;
	slab_p->fd = rw_svc_mesh_carve_fd(x->mesh, i, rail, &slab_p->bytes);
	slab_p->device = rw_svc_mesh_carve_gpu(x->mesh, i, rail, slab_p->uuid);
	slab_p->kind = slab_p->device >= 0 ? RW_CLIENT_SLAB_GPU : RW_CLIENT_SLAB_HOST;
	slab_p->rails = x->rails;
	slab_p->area_bytes = x->carve_sub;
	const uint64_t base = rw_svc_mesh_carve_off(x->mesh, i);
	slab_p->local_off = exec_sub_off(x, EXEC_SLOTS + (int)i, SUB_LOCAL) - base;
	for (int k = 0; k < RW_SVC_KIND_COUNT; k++) { /* the slot's sub-areas, inside the slab */
		slab_p->recv_off[k] = exec_sub_off(x, EXEC_SLOTS + (int)i, exec_kind_desc(k)->sub_recv) -
				      base;
		slab_p->send_off[k] = exec_sub_off(x, EXEC_SLOTS + (int)i, exec_kind_desc(k)->sub_send) -
				      base;
	}
	return 0;
}

int exec_movers_settled(const exec_t *x, const exec_pair_t *p)
{
	for (uint32_t i = 0; i < x->n_movers; i++)
		if (x->movers[i].ops->settled && !x->movers[i].ops->settled(x->movers[i].mover, &p->ph))
			return 0;
	return 1;
}

int exec_carve_settled(const exec_t *x, const exec_pair_t *p)
{
	return p->carve < 0 || exec_movers_settled(x, p);
}

unsigned exec_carves_moving(const exec_t *x, unsigned *held_p, uint64_t *devs_p)
{
	unsigned moving = 0, held = 0;
	uint64_t devs = 0;
	const exec_pair_t *p;
	rw_list_for_each(&x->pairs, p, link) {
		if (exec_open(p) || p->carve < 0 || exec_carve_settled(x, p))
			continue;
		const uint64_t gpus = rw_svc_phase_devs(&p->ph, RW_SVC_DEVS_CARVE);
		devs |= gpus;
		held++;
		moving += !rw_svc_gpus_stalled(gpus, NULL, 0);
	}
	*held_p = held;
	*devs_p = devs;
	return moving;
}

void exec_carves_leave(exec_t *x)
{
	const exec_pair_t *p;
	rw_list_for_each(&x->pairs, p, link) {
		if (p->carve < 0 || exec_carve_settled(x, p))
			continue;
		const uint64_t devs = rw_svc_phase_devs(&p->ph, RW_SVC_DEVS_CARVE);
		char gpus[192], why[256];
		rw_svc_gpu_list(devs, gpus, sizeof(gpus));
		snprintf(why, sizeof(why), "GPU %s %s with a header pull out of it queued", gpus,
			 rw_svc_gpus_stalled(devs, NULL, 0) ? "stalled" : "not declared stalled");
		rw_svc_mesh_carve_leave(x->mesh, (uint32_t)p->carve, why);
	}
}
