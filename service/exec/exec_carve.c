/* Each group's carve-out of the mesh's pool (service/mesh/mesh.h; docs/rankpath.md "The slab
 * areas, lent per group"): taken at the group's first slab request (a group whose ranks map
 * nothing runs on the shared slots and holds none of the pool), held by the group and by each of its
 * pairs until that pair is freed, and given back when the last rank left — after a heartbeat
 * timeout when the group's last pair failed, since a peer may still have writes in flight into
 * it then (docs/dataflow.md "Region reuse"). A group without one shares the area's slots. */
#include <stdio.h>

#include "service/exec/exec_int.h"

static void carve_take(exec_t *x, exec_group_t *g)
{
	g->carve = -1;
	g->carve_why[0] = 0;
	if (!x->carve_max)
		return;
	uint32_t i;
	rw_status_t st = rw_svc_mesh_carve_take(x->mesh, g->name, &i);
	if (st == RW_OK) {
		g->carve = (int)i;
		rw_dbg("group %s: carve-out %u (%llu MiB per rail)", g->name, i,
		       (unsigned long long)x->carve_bytes >> 20);
		return;
	}
	x->svc->metrics.carve_outs_refused++;
	if (st != RW_ERR_AGAIN)
		snprintf(g->carve_why, sizeof(g->carve_why), "no group slabs: %s",
			 rw_svc_mesh_carve_why(x->mesh)[0] ? rw_svc_mesh_carve_why(x->mesh)
							   : rw_status_str(st));
	rw_warn("group %s: no carve-out of its own (%s): its pairs share the region and its ranks "
		"are lent no slabs", g->name, st == RW_ERR_AGAIN ? "the pool is spent: every one of "
		"group_pool_mib / group_area_mib is held" : g->carve_why);
}

void exec_carve_want(exec_t *x, exec_group_t *g)
{
	if (g->carve_tried)
		return;
	g->carve_tried = 1;
	carve_take(x, g);
}

void exec_carve_drop(exec_t *x, exec_group_t *g)
{
	if (g->carve < 0)
		return;
	const uint32_t i = (uint32_t)g->carve;
	g->carve = -1;
	if (rw_now_ns() < g->carve_free_at) {
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
	if (g->carve < 0 && g->carve_why[0]) {
		*why_p = g->carve_why;
		return RW_E_STATE;
	}
	if (g->carve < 0) {
		*why_p = "the group has no slabs of its own: the daemon's pool (group_pool_mib) was "
			 "spent when it first asked";
		return RW_E_LIMIT;
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
