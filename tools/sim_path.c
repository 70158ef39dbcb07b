/* One phase of `railwave sim` under one of the four paths (tools/sim.h): the flows every node's
 * plan sends (sched/ decides, nothing here re-derives a quota), the lower bound,
 * the busiest NIC, and the fan-in fold used by the incast experiment (docs/sim.md §3). */
#include <stdlib.h>
#include <string.h>

#include "tools/sim.h"

rw_status_t rw_sim_path_flows(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts,
			      uint64_t record_bytes, int combine, rw_sim_flow_t **flows_p,
			      size_t *n_p)
{
	if (!topo || !counts || !flows_p || !n_p || (unsigned)path >= RW_PATH_COUNT ||
	    record_bytes == 0 || rw_sched_topo_check(topo) != RW_OK)
		return RW_ERR_INVAL;
	const uint32_t N = topo->nodes, R = topo->rails;
	rw_pair_plan_t *pairs = calloc(N, sizeof(*pairs));
	if (!pairs)
		return RW_ERR_NOMEM;
	rw_status_t st = RW_OK;
	size_t n = 0, cap = 0;
	rw_sim_flow_t *flows = NULL;
	for (uint32_t s = 0; s < N; s++) {
		rw_phase_plan_t plan = { .pairs = pairs };
		if ((st = rw_sched_plan_build(topo, path, s, counts, &plan)) != RW_OK)
			goto fail;
		for (uint32_t d = 0; d < N; d++) {
			if (d == s)
				continue;
			/* Combine: node d returns in wave k to d + k (service/exec/exec_send.c), so its wave
			 * is wave_of(d, s), not the dispatch wave of (s, d). */
			uint32_t wave = !rw_path_waved(path) ? 0 :
					combine ? rw_sched_wave_of(N, d, s) : rw_sched_wave_of(N, s, d);
			for (uint32_t r = 0; r < R; r++) {
				uint32_t q = pairs[d].quota[r];
				if (q == 0)
					continue;
				if (n == cap) {
					size_t nc = cap ? 2 * cap : 1024;
					rw_sim_flow_t *p = realloc(flows, nc * sizeof(*p));
					if (!p) {
						st = RW_ERR_NOMEM;
						goto fail;
					}
					flows = p;
					cap = nc;
				}
				flows[n++] = (rw_sim_flow_t){ .src = combine ? d : s, .dst = combine ? s : d,
							      .rail = r, .wave = wave,
							      .bytes = (double)q * (double)record_bytes };
			}
		}
	}
	free(pairs);
	*flows_p = flows;
	*n_p = n;
	return RW_OK;
fail:
	free(flows);
	free(pairs);
	return st;
}

/* Per-NIC records under `path` (egress[s*R + r], ingress[d*R + r]) from every node's plan. */
static rw_status_t path_loads(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts,
			      uint64_t *egress, uint64_t *ingress)
{
	const uint32_t N = topo->nodes, R = topo->rails;
	rw_pair_plan_t *pairs = calloc(N, sizeof(*pairs));
	if (!pairs)
		return RW_ERR_NOMEM;
	memset(egress, 0, sizeof(uint64_t) * N * R);
	memset(ingress, 0, sizeof(uint64_t) * N * R);
	rw_status_t st = RW_OK;
	for (uint32_t s = 0; s < N && st == RW_OK; s++) {
		rw_phase_plan_t plan = { .pairs = pairs };
		if ((st = rw_sched_plan_build(topo, path, s, counts, &plan)) != RW_OK)
			break;
		for (uint32_t d = 0; d < N; d++)
			for (uint32_t r = 0; r < R && d != s; r++) {
				egress[s * R + r] += pairs[d].quota[r];
				ingress[d * R + r] += pairs[d].quota[r];
			}
	}
	free(pairs);
	return st;
}

/* Busiest NIC by seconds of work (bytes / its rail's rate); ties: lowest node, rail, egress. */
static void busiest_nic(const rw_topo_t *topo, const rw_sim_fabric_t *fab, const uint64_t *egress,
			const uint64_t *ingress, uint64_t record_bytes, rw_sim_nic_t *nic)
{
	const uint32_t N = topo->nodes, R = topo->rails;
	memset(nic, 0, sizeof(*nic));
	nic->seconds = -1;
	for (int dir = 0; dir < 2; dir++)
		for (uint32_t n = 0; n < N; n++)
			for (uint32_t r = 0; r < R; r++) {
				double b = (double)(dir ? ingress : egress)[n * R + r] * (double)record_bytes;
				double sec = b / fab->rail_Bps[r];
				if (sec > nic->seconds)
					*nic = (rw_sim_nic_t){ .node = n, .rail = r, .ingress = dir,
							       .bytes = b, .seconds = sec };
			}
}

double rw_sim_lower_bound(const rw_topo_t *topo, const rw_sim_fabric_t *fab,
			  const uint32_t *counts, uint64_t record_bytes)
{
	const size_t NR = (size_t)topo->nodes * topo->rails;
	uint64_t *eg = malloc(NR * sizeof(uint64_t)), *ig = malloc(NR * sizeof(uint64_t));
	double lb = -1;
	if (eg && ig && path_loads(topo, RW_PATH_RAIL_ONLY, counts, eg, ig) == RW_OK) {
		rw_sim_nic_t nic;
		busiest_nic(topo, fab, eg, ig, record_bytes, &nic);
		lb = nic.seconds;
	}
	free(eg);
	free(ig);
	return lb;
}

rw_status_t rw_sim_path(const rw_topo_t *topo, const rw_sim_fabric_t *fab,
			const rw_sim_opts_t *opts, rw_path_t path, const uint32_t *counts,
			uint64_t record_bytes, int combine, rw_sim_report_t *rep)
{
	if (!topo || !fab || !rep || topo->nodes != fab->nodes || topo->rails != fab->rails)
		return RW_ERR_INVAL;
	const uint32_t N = topo->nodes, R = topo->rails;
	rw_sim_flow_t *flows = NULL;
	size_t n = 0;
	uint64_t *eg = malloc((size_t)N * R * sizeof(uint64_t));
	uint64_t *ig = malloc((size_t)N * R * sizeof(uint64_t));
	rw_status_t st = RW_ERR_NOMEM;
	if (!eg || !ig)
		goto cleanup;
	if ((st = rw_sim_path_flows(topo, path, counts, record_bytes, combine, &flows, &n)) != RW_OK)
		goto cleanup;
	rw_sim_report_t r;
	memset(&r, 0, sizeof(r));
	r.path = path;
	if ((st = rw_sim_run(fab, opts, flows, n, NULL, &r.run)) != RW_OK)
		goto cleanup;
	if ((st = path_loads(topo, path, counts, eg, ig)) != RW_OK)
		goto cleanup;
	/* Combine moves the same records the other way: a dispatch egress NIC is a combine
	 * ingress NIC. */
	busiest_nic(topo, fab, combine ? ig : eg, combine ? eg : ig, record_bytes, &r.busiest);
	r.lower_bound = rw_sim_lower_bound(topo, fab, counts, record_bytes);
	r.ratio = r.lower_bound > 0 ? r.run.time / r.lower_bound : 0;
	for (uint32_t d = 0; d < N; d++) {
		uint32_t fan = 0;
		for (uint32_t s = 0; s < N; s++) {
			const uint32_t *c = counts + ((size_t)s * N + d) * R;
			uint64_t t = 0;
			for (uint32_t k = 0; k < R && s != d; k++)
				t += c[k];
			fan += t > 0;
		}
		if (fan > r.static_fan_in)
			r.static_fan_in = fan;
	}
	*rep = r;
	st = RW_OK;
cleanup:
	free(flows);
	free(eg);
	free(ig);
	return st;
}

void rw_sim_topo_weights(rw_topo_t *topo, const rw_sim_fabric_t *fab)
{
	int equal = 1;
	for (uint32_t r = 1; r < topo->rails && r < fab->rails; r++)
		equal &= fab->rail_Bps[r] == fab->rail_Bps[0];
	for (uint32_t r = 0; r < topo->rails && r < fab->rails; r++) {
		if (equal) { /* plain RailBalance, bit for bit what the daemons run */
			topo->rail_weight[r] = 1;
			continue;
		}
		double mbit = fab->rail_Bps[r] * 8 / 1e6;
		if (mbit < 1)
			mbit = 1;
		if (mbit > RW_MAX_RAIL_WEIGHT)
			mbit = RW_MAX_RAIL_WEIGHT;
		topo->rail_weight[r] = (uint32_t)(mbit + 0.5);
	}
}

void rw_sim_fold_fan_in(uint32_t nodes, uint32_t rails, uint32_t fan_in, const uint32_t *counts,
			uint32_t *out)
{
	const uint32_t N = nodes, R = rails;
	memset(out, 0, sizeof(uint32_t) * N * N * R);
	if (N < 2 || fan_in == 0)
		return;
	for (uint32_t s = 0; s < N; s++)
		for (uint32_t j = 0; j + 1 < N; j++) {
			uint32_t from = (s + 1 + j) % N, to = (s + 1 + j % fan_in) % N;
			for (uint32_t r = 0; r < R; r++)
				out[((size_t)s * N + to) * R + r] += counts[((size_t)s * N + from) * R + r];
		}
}
