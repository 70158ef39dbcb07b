/* `railwave sim`: a flow-level (fluid) simulator of one dispatch or combine phase on a
 * rail-optimized fabric, for the cluster sizes no test bed here reaches (docs/sim.md).
 * Two bandwidth models: ideal max-min sharing, and a lossless (PFC) fabric where a paused NIC
 * stalls all of its flows. docs/sim.md states the models exactly. Private to tools/ and its tests. */
#ifndef RW_TOOLS_SIM_H
#define RW_TOOLS_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "sched/sched.h"

typedef enum rw_sim_model {
	RW_SIM_LOSSLESS = 0, /* PFC back-pressure with head-of-line blocking (docs/sim.md §2.2) */
	RW_SIM_MAXMIN = 1,   /* max-min fair over NIC egress and ingress (docs/sim.md §2.1) */
	RW_SIM_MODEL_COUNT = 2,
} rw_sim_model_t;

const char *rw_sim_model_name(rw_sim_model_t model); /* "lossless", "maxmin" */

/* Saturation throughput of a k x k input-queued switch with FIFO (head-of-line blocked) inputs
 * under uniform traffic, as a share of line rate (Karol, Hluchyj and Morgan, 1987): 1, 0.75,
 * 0.6825, 0.6553, 0.6399, 0.6302, 0.6234, 0.6184 for k = 1..8, then 0.5858 + 0.0326 * 8 / k
 * (-> 2 - sqrt(2)). k = 0 gives 1. */
double rw_sim_hol_throughput(uint32_t k);
rw_status_t rw_sim_model_parse(const char *name, rw_sim_model_t *model_p);

/* N nodes x R rails; NIC r of every node has `rail_Bps[r]` bytes/s of egress and the same of
 * ingress; rail switches are non-blocking. */
typedef struct rw_sim_fabric {
	uint32_t nodes, rails;
	double rail_Bps[RW_MAX_RAILS];
} rw_sim_fabric_t;

typedef struct rw_sim_opts {
	rw_sim_model_t model;
	/* Lossless only, in [0, 1]: the weight of burst-level head-of-line blocking. An ingress
	 * port with k >= 2 sender NICs active toward it is PFC-paced and delivers
	 * C * (1 - hol * (1 - h(k))), h(k) the saturation throughput of a k x k FIFO input-queued
	 * switch (rw_sim_hol_throughput). 0 = fluid spreading only; 1 = the full HOL loss. */
	double hol;
	/* Completion batching, >= 0, on dense rails (more than 2N active flows, recomputed whole):
	 * when the first pending completion there is flow f at time t1, every flow of the rail
	 * finishing by t1 + batch_eps * (T - start of f), T the rail's projected end (its busiest
	 * port's remaining work at the last allocation), completes at its own time, and the rates
	 * are recomputed once, at the end of that window. Sparse components are always exact;
	 * 0 = exact everywhere. docs/sim.md §2.3. */
	double batch_eps;
	/* Tests: after every allocation check that no port carries more than its capacity and
	 * count the offending ports in rw_sim_result_t.violations. */
	int verify;
	/* Worker threads when the rails are independent (every node sends all its flows in one
	 * wave, so no flow starts after t = 0 and each rail is its own simulation); 0 = one per
	 * online CPU, at most R. The result does not depend on it. */
	uint32_t threads;
	/* The daemons' receiver gate (docs/dataflow.md "Send"): a flow of wave w into node d starts
	 * only when every flow into d of a lower wave has finished (and, as always, its sender's
	 * previous wave). 0 = each node advances on its own completions only (the daemon before the
	 * gate: nodes drift apart and a receiver is fed by several waves at once). */
	int wave_gate;
} rw_sim_opts_t;

/* Defaults: lossless, hol 1, batch_eps 1e-3, no verification, threads 0, wave_gate 1. */
void rw_sim_opts_default(rw_sim_opts_t *opts);

/* One flow: `bytes` from egress NIC `rail` of node src to ingress NIC `rail` of node dst. A node
 * sends its flows in increasing `wave` order: the flows of its smallest wave start at t = 0, those
 * of its next wave when every flow of the previous one has finished (the per-node progression of
 * docs/algorithms.md §3) and, with opts->wave_gate, when their receivers admit them; equal waves
 * start together. */
typedef struct rw_sim_flow {
	uint32_t src, dst, rail;
	uint32_t wave;
	double bytes; /* > 0 */
} rw_sim_flow_t;

typedef struct rw_sim_result {
	double time;          /* last completion, seconds */
	double bytes;         /* bytes moved, integrated over the rates (= sum of flow bytes) */
	uint64_t events;      /* allocation rounds after t = 0 */
	uint32_t max_fan_in;  /* most distinct source nodes sending to one node at the same time */
	uint64_t violations;  /* opts->verify: ports found above capacity (0 when correct) */
} rw_sim_result_t;

/* Simulate the flows to completion. finish (may be NULL) gets every flow's completion time.
 * RW_ERR_INVAL: a flow names a node/rail outside the fabric, src == dst, bytes not > 0, a rate
 * not > 0, or bad options; RW_ERR_NOMEM. Deterministic: same input, same output. */
rw_status_t rw_sim_run(const rw_sim_fabric_t *fab, const rw_sim_opts_t *opts,
		       const rw_sim_flow_t *flows, size_t n_flows, double *finish,
		       rw_sim_result_t *res);

/* ---------------------------------------------------------------------------------------------
 * One phase under one of the four paths
 * ------------------------------------------------------------------------------------------- */

/* The flows of one phase under `path`: every node's rw_sched_plan_build (native rails for
 * Native / Permutation-only, RailBalance quotas for Rail-only / Joint), one flow per
 * (source, destination, rail) with a non-zero quota of quota x record_bytes bytes. Waved paths
 * put every flow in wave rw_sched_wave_of(its src, its dst); the others use wave 0. combine != 0
 * reverses every flow (d -> s on the same rail, as the daemon returns outputs: in wave k node d
 * sends to d + k). *flows_p is malloc'd (NULL when there are none). */
rw_status_t rw_sim_path_flows(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts,
			      uint64_t record_bytes, int combine, rw_sim_flow_t **flows_p,
			      size_t *n_p);

typedef struct rw_sim_nic {
	uint32_t node, rail;
	int ingress;     /* 0 egress, 1 ingress */
	double bytes;
	double seconds;  /* bytes / rail rate */
} rw_sim_nic_t;

typedef struct rw_sim_report {
	rw_path_t path;
	rw_sim_result_t run;
	double lower_bound;    /* seconds: busiest NIC under RailBalance quotas / its rate */
	double ratio;          /* run.time / lower_bound */
	rw_sim_nic_t busiest;  /* busiest NIC under this path (by seconds of work) */
	uint32_t static_fan_in;/* most sources with demand into one destination (whole phase) */
} rw_sim_report_t;

/* Build the path's flows and simulate them. The topology's rail weights should follow the
 * fabric's rail rates (rw_sim_topo_weights) so that RailBalance quotas follow capacity. */
rw_status_t rw_sim_path(const rw_topo_t *topo, const rw_sim_fabric_t *fab,
			const rw_sim_opts_t *opts, rw_path_t path, const uint32_t *counts,
			uint64_t record_bytes, int combine, rw_sim_report_t *rep);

/* Lower bound (docs/architecture.md §6) in seconds: max over every node's egress and ingress NICs
 * of its bytes under RailBalance quotas divided by its rail's rate. With equal rates this is
 * rw_sched_lower_bound() x record_bytes / rate. */
double rw_sim_lower_bound(const rw_topo_t *topo, const rw_sim_fabric_t *fab,
			  const uint32_t *counts, uint64_t record_bytes);

/* Rail weights proportional to the fabric's rail rates (in Mbit/s, at least 1), so that
 * weighted RailBalance gives a slower rail proportionally fewer records; all weights 1 when the
 * rates are equal (plain RailBalance, exactly what the daemons run). */
void rw_sim_topo_weights(rw_topo_t *topo, const rw_sim_fabric_t *fab);

/* Concentrate the demand onto `fan_in` receivers per source, keeping every source's bytes per
 * rail: count[s][(s + 1 + (j mod fan_in)) mod N][r] collects count[s][(s + 1 + j) mod N][r] for
 * j = 0 .. N-2. Every node then receives from exactly fan_in sources (fan_in in 1 .. N-1).
 * out must not alias counts. */
void rw_sim_fold_fan_in(uint32_t nodes, uint32_t rails, uint32_t fan_in, const uint32_t *counts,
			uint32_t *out);

#endif /* RW_TOOLS_SIM_H */
