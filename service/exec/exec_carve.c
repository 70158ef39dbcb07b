/* Each group's carve-out of the mesh's pool (service/mesh/mesh.h; docs/rankpath.md "The slab
 * areas, lent per group"): taken at the group's first join, held by the group and by each of its
 * pairs until that pair is freed, and given back when the last rank left — after a heartbeat
 * timeout when the group's last pair failed, since a peer may still have writes in flight into
 * it then (docs/dataflow.md "Region reuse"). A group without one shares the area's slots. */
#include "service/exec/exec_int.h"

void exec_carve_take(exec_t *x, exec_group_t *g)
{
	g->carve = -1;
	if (!x->carve_max)
		return;
	for (uint32_t r = 0; r < x->rails; r++)
		if (rw_svc_mesh_slab_dev(x->mesh, r, NULL) >= 0)
			return; /* GPU slabs: carve-outs in GPU memory are a later step */
	uint32_t i;
	rw_status_t st = rw_svc_mesh_carve_take(x->mesh, g->name, &i);
	if (st == RW_OK) {
		g->carve = (int)i;
		rw_dbg("group %s: carve-out %u (%llu MiB per rail)", g->name, i,
		       (unsigned long long)x->carve_bytes >> 20);
		return;
	}
	x->svc->metrics.carve_outs_refused++;
	rw_warn("group %s: no carve-out of its own (%s): its pairs share the region and its ranks "
		"are lent no slabs", g->name, st == RW_ERR_AGAIN ? "the pool is spent: every one of "
		"group_pool_mib / group_area_mib is held" : rw_status_str(st));
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
