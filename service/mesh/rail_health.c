/* Rail health bookkeeping (service/mesh/rail_health.h; docs/dataflow.md "Rail health"): one rail
 * connection's outages, its reconnect back-off and the test switch that makes one. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "sched/sched.h"

#include "service/mesh/rail_health.h"

int rw_svc_rail_health_down(rw_svc_rail_health_t *h, uint64_t now)
{
	if (h->down)
		return 0;
	h->down = 1;
	h->down_since_ns = now;
	h->backoff_ms = 0;
	h->failovers++;
	return 1;
}

uint32_t rw_svc_rail_health_backoff(rw_svc_rail_health_t *h, uint64_t now)
{
	h->backoff_ms = h->backoff_ms ? RW_MIN(h->backoff_ms * 2, RAIL_BACKOFF_MAX_MS)
				      : RAIL_BACKOFF_MIN_MS;
	uint32_t ms = h->backoff_ms;
	if (rw_svc_rail_health_held(h, now))
		ms = RW_MAX(ms, (uint32_t)((h->hold_until_ns - now) / 1000000u) + 1);
	return ms;
}

uint64_t rw_svc_rail_health_up(rw_svc_rail_health_t *h, uint64_t now)
{
	if (!h->down)
		return 0;
	uint64_t outage = now - h->down_since_ns;
	h->degraded_ns += outage;
	h->down = 0;
	h->backoff_ms = 0;
	return outage;
}

uint64_t rw_svc_rail_health_degraded(const rw_svc_rail_health_t *h, uint64_t now)
{
	return h->degraded_ns + (h->down ? now - h->down_since_ns : 0);
}

rw_status_t rw_svc_rail_fault_from_env(rw_svc_rail_fault_t *f, uint32_t nodes, uint32_t rails,
				       uint32_t me)
{
	*f = (rw_svc_rail_fault_t){ 0 };
	const char *v = getenv("RAILWAVE_TEST_RAIL_DOWN");
	if (!v || !*v)
		return RW_OK;
	unsigned rail, peer, at = 0, len;
	char extra;
	int start = sscanf(v, "%u:%u:start:%u%c", &rail, &peer, &len, &extra) == 3;
	if ((!start && sscanf(v, "%u:%u:%u:%u%c", &rail, &peer, &at, &len, &extra) != 4) ||
	    rail >= rails || peer >= nodes || peer == me) {
		rw_err("RAILWAVE_TEST_RAIL_DOWN=%s: expected RAIL:PEER:AT_MS:FOR_MS (AT_MS may be "
		       "\"start\") with RAIL < %u and PEER < %u, not this node (%u)", v, rails, nodes, me);
		return RW_ERR_INVAL;
	}
	*f = (rw_svc_rail_fault_t){ .on = 1, .at_start = start, .rail = rail, .peer = peer,
				    .at_ms = at, .for_ms = len };
	if (start)
		rw_warn("test switch RAILWAVE_TEST_RAIL_DOWN: rail %u to node %u refused from the start "
			"for %u ms", rail, peer, len);
	else
		rw_warn("test switch RAILWAVE_TEST_RAIL_DOWN: rail %u to node %u goes down %u ms after "
			"this node's first write to that peer, for %u ms", rail, peer, at, len);
	return RW_OK;
}

void rw_svc_rail_meter_sample(rw_svc_rail_meter_t *m, uint64_t tx_bytes, uint64_t tx_busy_ns)
{
	if (tx_bytes < m->bytes || tx_busy_ns < m->busy_ns) { /* counters restarted */
		m->bytes = tx_bytes;
		m->busy_ns = tx_busy_ns;
		return;
	}
	uint64_t bytes = tx_bytes - m->bytes, ns = tx_busy_ns - m->busy_ns;
	if (bytes < RAIL_METER_MIN_BYTES || ns == 0)
		return;
	double mbit = (double)bytes * 8e3 / (double)ns; /* bits per ns = Gbit/s */
	m->mbit = m->mbit > 0 ? 0.7 * m->mbit + 0.3 * mbit : mbit;
	m->bytes = tx_bytes;
	m->busy_ns = tx_busy_ns;
}

uint32_t rw_svc_rail_weight_quantize(double mbit)
{
	if (!(mbit > 1))
		return 1;
	double w = exp2(round(4 * log2(mbit)) / 4);
	return w >= RW_MAX_RAIL_WEIGHT ? RW_MAX_RAIL_WEIGHT : (uint32_t)lround(w);
}
