/* Rail health, private to service/ (docs/dataflow.md "Rail health"): the state of one rail
 * connection to one peer apart from the peer's own state — down while its peer stays up, the
 * back-off of its background reconnect, the time it spent down — and the test switch that takes
 * one rail down on purpose. Pure bookkeeping: no I/O; the mesh (mesh_rail.c) acts on it. */
#ifndef RW_SVC_RAIL_HEALTH_H
#define RW_SVC_RAIL_HEALTH_H

#include <stdint.h>

#include "common/common.h"

#define RAIL_BACKOFF_MIN_MS 50
#define RAIL_BACKOFF_MAX_MS 2000
/* A reconnected rail must stay connected this long before it counts as up again (an accept
 * that is closed at once, a flapping link, is one outage, not many). */
#define RAIL_SETTLE_MS 200

typedef struct rw_svc_rail_health {
	int down;               /* failed while its peer stayed up; reconnecting in the background */
	uint32_t backoff_ms;    /* the last reconnect delay (0: none yet) */
	uint64_t down_since_ns;
	uint64_t hold_until_ns; /* the test switch keeps it down (refused) until then */
	uint64_t failovers;     /* times it went down while its peer stayed up */
	uint64_t degraded_ns;   /* time spent down, outages that ended */
} rw_svc_rail_health_t;

/* The rail failed with its peer up. Returns 1 when it was up (a new outage), 0 when it was
 * already down (a reconnect attempt failed). */
int rw_svc_rail_health_down(rw_svc_rail_health_t *h, uint64_t now);
/* Delay before the next reconnect: 50 ms doubling to 2 s, and never before the test hold ends. */
uint32_t rw_svc_rail_health_backoff(rw_svc_rail_health_t *h, uint64_t now);
/* Connected again. Returns the outage's length (0 when it was not down). */
uint64_t rw_svc_rail_health_up(rw_svc_rail_health_t *h, uint64_t now);
/* Time down so far, the running outage included. */
uint64_t rw_svc_rail_health_degraded(const rw_svc_rail_health_t *h, uint64_t now);
/* The test hold is on: connections of this rail are refused. */
static inline int rw_svc_rail_health_held(const rw_svc_rail_health_t *h, uint64_t now)
{
	return h->hold_until_ns > now;
}

/* Measured rail weights (`rail_weights: measured`): a rail's send throughput, bytes over the
 * time it had writes in flight (the metrics' tx_bytes and tx_busy_ns), taken once at least
 * RAIL_METER_MIN_BYTES went out since the last sample and smoothed (new = 0.7 old + 0.3 sample).
 * Its weight is the estimate in Mbit/s rounded to a power of 2^(1/4) (steps of 19%), so small
 * changes do not change the plan; the count rows carry it, so every node plans with the same
 * integers. */
#define RAIL_METER_MIN_BYTES (1u << 20)
typedef struct rw_svc_rail_meter {
	uint64_t bytes, busy_ns;  /* the counters at the last sample */
	double mbit;              /* the estimate; 0 = none yet */
} rw_svc_rail_meter_t;

void rw_svc_rail_meter_sample(rw_svc_rail_meter_t *m, uint64_t tx_bytes, uint64_t tx_busy_ns);
/* The weight of a rate in Mbit/s: 1 .. RW_MAX_RAIL_WEIGHT, on the 2^(k/4) grid. */
uint32_t rw_svc_rail_weight_quantize(double mbit);

/* The test switch RAILWAVE_TEST_RAIL_DOWN=RAIL:PEER:AT_MS:FOR_MS (docs/dataflow.md "Tests"): AT_MS
 * after this node's first rail write to the peer PEER (so the outage lands while phases run,
 * however late the ranks start), this node closes its connection of rail RAIL to it and
 * refuses that rail (does not dial it, closes it when accepted) for FOR_MS. AT_MS "start":
 * refused from the daemon's start (a NIC dead before the peers meet). */
typedef struct rw_svc_rail_fault {
	int on, fired;
	int at_start;           /* AT_MS was "start": refused from the daemon's start */
	uint32_t rail, peer, at_ms, for_ms;
} rw_svc_rail_fault_t;

/* Read the switch; RW_ERR_INVAL (and a message) when it is set but malformed or out of range. */
rw_status_t rw_svc_rail_fault_from_env(rw_svc_rail_fault_t *f, uint32_t nodes, uint32_t rails,
				       uint32_t me);

#endif /* RW_SVC_RAIL_HEALTH_H */
