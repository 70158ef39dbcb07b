/* railwaved's metrics (service/core/metrics.c) and the text they are rendered in
 * (service/core/text.c): counters, latency histograms and selector decisions kept by the loop
 * thread, the snapshot published to other threads, the growable text buffer and the names that
 * logs, the stats socket and the Prometheus endpoint share (docs/service.md "How the metrics work (and why)"). */
#ifndef RW_SVC_METRICS_H
#define RW_SVC_METRICS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "rdma/rail.h"
#include "sched/sched.h"
#include "service/core/svc_config.h"

/* The loop thread is the only writer: it updates the live rw_svc_metrics_t with plain stores
 * through the inline helpers below (no locks, no atomics). Other threads (HTTP) never read the
 * live copy; the loop publishes a copy every RW_SVC_METRICS_PUBLISH_MS (and on demand) under a
 * mutex held only for the memcpy, and readers copy it out under the same mutex. A reader thus
 * sees a consistent snapshot at most one publish interval old. */

#define RW_SVC_HIST_SUB 4        /* log-linear: 4 buckets per power of two (<= 19% wide) */
#define RW_SVC_HIST_MIN_LOG2 10  /* bucket 0: < 2^10 ns (~1 us) */
#define RW_SVC_HIST_MAX_LOG2 38  /* last bucket: >= 2^38 ns (~275 s) */
#define RW_SVC_HIST_BUCKETS (2 + RW_SVC_HIST_SUB * (RW_SVC_HIST_MAX_LOG2 - RW_SVC_HIST_MIN_LOG2))
#define RW_SVC_DECISIONS 64      /* selector decisions kept (ring) */
#define RW_SVC_ERR_KINDS 64      /* errors[k] counts status -k; k >= 62 lumped into 63 */
#define RW_SVC_METRICS_PUBLISH_MS 250

typedef enum rw_svc_phase_kind {
	RW_SVC_DISPATCH = 0,
	RW_SVC_COMBINE = 1,
	RW_SVC_KIND_COUNT = 2,
} rw_svc_phase_kind_t;

typedef enum rw_svc_peer_state {
	RW_SVC_PEER_DOWN = 0,        /* not connected, not trying yet */
	RW_SVC_PEER_CONNECTING = 1,  /* connect/handshake in progress or backing off */
	RW_SVC_PEER_UP = 2,          /* control channel and every rail connected */
	RW_SVC_PEER_FAILED = 3,      /* detected dead (heartbeat timeout, reset); will retry */
	RW_SVC_PEER_SELF = 4,        /* this node */
} rw_svc_peer_state_t;

/* Names for logs, the stats socket and metric labels (service/core/text.c). */
const char *rw_svc_peer_state_name(rw_svc_peer_state_t s);
const char *rw_svc_kind_name(rw_svc_phase_kind_t k);       /* "dispatch" | "combine" */
const char *rw_svc_err_name(rw_status_t st);                /* short label: "peer", "timeout" */

/* Latency histogram in nanoseconds, log-linear buckets (see rw_svc_hist_bucket()). */
typedef struct rw_svc_hist {
	uint64_t count;
	uint64_t sum_ns;
	uint64_t max_ns;
	uint64_t bucket[RW_SVC_HIST_BUCKETS];
} rw_svc_hist_t;

typedef struct rw_svc_rail_metrics {
	uint64_t tx_bytes, tx_records, tx_writes, tx_busy_ns;
	uint64_t rx_bytes, rx_records, rx_writes, rx_busy_ns;
	uint64_t errors;
	uint32_t weight;             /* this node's capacity weight of the rail (its count rows) */
	uint32_t pad_;
	/* The transport's own counters of the rail's device (rdma/rail.h rw_rail_dev_stats_t),
	 * copied in by the mesh at every heartbeat tick and write completion: bytes it handed to
	 * the wire, frame headers and acks included (tcp; 0 with verbs), and times a send waited
	 * for the pacing budget (tcp with "pace": true). */
	uint64_t wire_tx_bytes, pace_waits;
	/* The rest of the device's counters (failures by cause, back-pressure), sampled likewise. */
	rw_rail_dev_stats_t transport;
} rw_svc_rail_metrics_t;

typedef struct rw_svc_peer_metrics {
	uint32_t state;              /* rw_svc_peer_state_t */
	uint32_t rails_up;           /* rails connected to this peer */
	uint32_t ever_up;            /* reached UP at least once */
	uint32_t pad_;
	uint64_t reconnects;         /* times the peer came back up after having been up */
	uint64_t errors;             /* peer/link errors attributed to it */
	uint64_t heartbeat_rtt_ns;   /* last measured control round trip, 0 = none */
	/* Rail health (docs/dataflow.md "Rail health"), published by the mesh: bit r = rail r to
	 * this peer is connected; per rail the times it went down while the peer stayed up, the
	 * time spent down in outages that ended, and when the running outage began (0: none). */
	uint32_t rail_up_mask;
	uint32_t pad2_;
	uint64_t rail_failovers[RW_MAX_RAILS];
	uint64_t rail_degraded_ns[RW_MAX_RAILS];
	uint64_t rail_down_since_ns[RW_MAX_RAILS];
} rw_svc_peer_metrics_t;

typedef struct rw_svc_phase_metrics {
	uint64_t ok;
	uint64_t failed;
	rw_svc_hist_t latency;       /* completed phases only */
} rw_svc_phase_metrics_t;

typedef struct rw_svc_decision {
	uint64_t seq;                /* 1-based; 0 = empty slot */
	uint64_t mono_ns;            /* rw_now_ns() when decided */
	uint32_t group, layer;
	uint64_t step;
	rw_features_t feat;
	rw_selection_t sel;
} rw_svc_decision_t;

/* Why a rank asking for its group's slab of a rail was lent none (the rank path stays off for
 * it): the daemon has no carve-outs (group_area_mib 0), the group's carve-out could not be made
 * though the pool had room (its reason logged), or the pool (group_pool_mib) was spent when the
 * group formed. rw_svc_slab_why_name: "off", "failed", "pool". */
typedef enum rw_svc_slab_why {
	RW_SVC_SLAB_OFF = 0,
	RW_SVC_SLAB_FAILED = 1,
	RW_SVC_SLAB_POOL = 2,
	RW_SVC_SLAB_WHY_COUNT = 3,
} rw_svc_slab_why_t;
const char *rw_svc_slab_why_name(rw_svc_slab_why_t w);
/* The name of a client code (RW_E_*) the rank path refuses a phase with: "tokens", "state",
 * "phase", "dtype", "internal", "closed" or "other". */
const char *rw_svc_client_code_name(int code);

typedef struct rw_svc_metrics {
	uint32_t rails, peers;       /* sizes (R, N) */
	uint64_t start_ns;
	rw_svc_rail_metrics_t rail[RW_MAX_RAILS];
	rw_svc_phase_metrics_t phase[RW_PATH_COUNT][RW_SVC_KIND_COUNT];
	uint64_t selected[RW_PATH_COUNT][RW_SELECT_FORCED + 1]; /* decisions by path and reason */
	uint64_t n_decisions;        /* total ever; the newest is decision[(n - 1) % RW_SVC_DECISIONS] */
	rw_svc_decision_t decision[RW_SVC_DECISIONS];
	uint64_t errors[RW_SVC_ERR_KINDS];
	uint32_t clients;            /* trainer ranks connected (ipc/) */
	uint32_t stats_clients;      /* stats socket connections open */
	uint64_t stats_rejected;     /* stats clients dropped for bad input/timeouts/limits */
	/* Early rows, tombs and ended attempts not kept: a node past its bound (exec_keys.c). */
	uint64_t peer_keys_refused;
	uint64_t anchor_reloads, anchor_reload_failures;
	/* Waved paths: the most sources seen writing one phase's data into this node at once (1 under
	 * the receiver gate, docs/dataflow.md "Send"). */
	uint32_t wave_fanin_max;
	/* Dispatches whose count row this node's CPU counted / a data mover counted on the GPU
	 * (docs/dataflow.md "Count on the GPU"). */
	uint64_t counts_host, counts_gpu;
	/* Prefixes of ranges handed to a data mover before the range completed (its forward or
	 * reduce overlapping the transfer: rw_svc_mover_ops_t.part, docs/dataflow.md "Receive and
	 * forward"). */
	uint64_t rx_prefixes;
	/* Times a write waited for the mover to finish writing its piece of a slab while earlier
	 * pieces were already posted (rw_svc_mover_ops_t.ready, docs/dataflow.md "Send"). */
	uint64_t tx_piece_waits;
	/* Phases planned without some rail for some pair (a rail down at either end, docs/dataflow.md
	 * "Rail health"). */
	uint64_t phases_rail_excluded;
	/* Where the rails' send and receive slabs live and why (docs/cuda.md "Where the slabs
	 * live"): set once by the mesh at start, e.g. "host (tcp rails are sockets)". */
	char slabs[160];
	/* The groups' carve-outs (docs/rankpath.md "The slab areas, lent per group"): held now (by
	 * groups, and by pairs still draining), the pool's size, and groups that formed with the
	 * pool spent or their uid at group_carve_per_uid (their pairs share the region, their ranks
	 * are lent no slabs), and carve-outs taken back from a group idle for group_carve_idle_s. */
	uint32_t rank_path_busy;     /* rank-path pairs whose running kind is in flight now */
	uint64_t rank_path_phases;   /* rank-path phases (dispatch or combine) completed */
	uint32_t carve_outs, carve_outs_max;
	uint64_t carve_outs_refused;
	uint64_t carve_outs_taken_back;
	/* The rank path as an operator sees it (docs/service.md "Turning on the rank path"): its
	 * phases completed, by kind; its phases failed once in a pair, by rw_status_t (index as
	 * errors'); its submissions refused on the page before a pair or for a word out of order,
	 * by RW_E_ code (index: -code); the group slabs a rank asked for and was not lent, by why
	 * (such a rank has no rank path: it falls back to the daemon's movers). */
	uint32_t rank_pages;         /* ranks holding a rank page, as of the last publish */
	uint64_t rank_path_done[RW_SVC_KIND_COUNT];
	uint64_t rank_path_failed[RW_SVC_ERR_KINDS];
	uint64_t rank_path_refused[RW_SVC_ERR_KINDS];
	uint64_t slabs_refused[RW_SVC_SLAB_WHY_COUNT];
	rw_svc_peer_metrics_t *peer; /* [peers], owned */
} rw_svc_metrics_t;

rw_status_t rw_svc_metrics_init(rw_svc_metrics_t *m, uint32_t rails, uint32_t peers);
/* Seconds rail `rail` to `peer` spent down while the peer stayed up, the running outage
 * included (rail health). */
static inline double rw_svc_metrics_rail_degraded_s(const rw_svc_peer_metrics_t *p, uint32_t rail,
						    uint64_t now)
{
	uint64_t since = p->rail_down_since_ns[rail];
	return (double)(p->rail_degraded_ns[rail] + (since && now > since ? now - since : 0)) * 1e-9;
}
void rw_svc_metrics_fini(rw_svc_metrics_t *m);
/* Copy src into dst (same rails/peers, dst initialised). */
void rw_svc_metrics_copy(rw_svc_metrics_t *dst, const rw_svc_metrics_t *src);

static inline uint32_t rw_svc_hist_bucket(uint64_t ns)
{
	if (ns < (1ull << RW_SVC_HIST_MIN_LOG2))
		return 0;
	uint32_t msb = 63u - (uint32_t)__builtin_clzll(ns);
	if (msb >= RW_SVC_HIST_MAX_LOG2)
		return RW_SVC_HIST_BUCKETS - 1;
	uint32_t sub = (uint32_t)(ns >> (msb - 2)) & 3u; /* the two bits after the leading one */
	return 1 + RW_SVC_HIST_SUB * (msb - RW_SVC_HIST_MIN_LOG2) + sub;
}
/* Exclusive upper bound of bucket b in ns (UINT64_MAX for the last). */
uint64_t rw_svc_hist_upper(uint32_t b);
/* Value at quantile q in [0,1]: the upper bound of the bucket holding the ceil(q*count)-th
 * sample, clamped to max_ns (so never above the largest sample). 0 when empty. */
uint64_t rw_svc_hist_quantile(const rw_svc_hist_t *h, double q);

static inline void rw_svc_hist_add(rw_svc_hist_t *h, uint64_t ns)
{
	h->count++;
	h->sum_ns += ns;
	if (ns > h->max_ns)
		h->max_ns = ns;
	h->bucket[rw_svc_hist_bucket(ns)]++;
}

/* ---- writer helpers (loop thread only) ---- */

static inline void rw_svc_metrics_tx(rw_svc_metrics_t *m, uint32_t rail, uint64_t bytes,
				     uint64_t records, uint64_t busy_ns)
{
	if (rail >= m->rails)
		return;
	m->rail[rail].tx_bytes += bytes;
	m->rail[rail].tx_records += records;
	m->rail[rail].tx_writes++;
	m->rail[rail].tx_busy_ns += busy_ns;
}

static inline void rw_svc_metrics_rx(rw_svc_metrics_t *m, uint32_t rail, uint64_t bytes,
				     uint64_t records, uint64_t busy_ns)
{
	if (rail >= m->rails)
		return;
	m->rail[rail].rx_bytes += bytes;
	m->rail[rail].rx_records += records;
	m->rail[rail].rx_writes++;
	m->rail[rail].rx_busy_ns += busy_ns;
}

/* The rail device's counters as the transport reports them now (they only grow). */
static inline void rw_svc_metrics_rail_dev(rw_svc_metrics_t *m, uint32_t rail,
					   uint64_t wire_tx_bytes, uint64_t pace_waits)
{
	if (rail >= m->rails)
		return;
	m->rail[rail].wire_tx_bytes = wire_tx_bytes;
	m->rail[rail].pace_waits = pace_waits;
}

static inline void rw_svc_metrics_rail_transport(rw_svc_metrics_t *m, uint32_t rail,
						 const rw_rail_dev_stats_t *st)
{
	if (rail < m->rails)
		m->rail[rail].transport = *st;
}

/* errors[], rank_path_failed[], rank_path_refused[]: the slot of a negative code (the last one
 * for every code past it). */
static inline uint32_t rw_svc_err_slot(int code)
{
	uint32_t k = code < 0 ? (uint32_t)-code : 0;
	return k < RW_SVC_ERR_KINDS ? k : RW_SVC_ERR_KINDS - 1;
}

static inline void rw_svc_metrics_error(rw_svc_metrics_t *m, rw_status_t st)
{
	m->errors[rw_svc_err_slot((int)st)]++;
}

static inline void rw_svc_metrics_peer_state(rw_svc_metrics_t *m, uint32_t peer,
					     rw_svc_peer_state_t s)
{
	if (peer >= m->peers)
		return;
	rw_svc_peer_metrics_t *p = &m->peer[peer];
	if (s == RW_SVC_PEER_UP && p->state != RW_SVC_PEER_UP) {
		if (p->ever_up)
			p->reconnects++;
		p->ever_up = 1;
	}
	p->state = (uint32_t)s;
}

/* A finished phase (ok = 0 on failure; the latency is only recorded for successes). */
static inline void rw_svc_metrics_phase(rw_svc_metrics_t *m, rw_path_t path,
					rw_svc_phase_kind_t kind, int ok, uint64_t ns)
{
	if ((unsigned)path >= RW_PATH_COUNT || (unsigned)kind >= RW_SVC_KIND_COUNT)
		return;
	rw_svc_phase_metrics_t *p = &m->phase[path][kind];
	if (ok) {
		p->ok++;
		rw_svc_hist_add(&p->latency, ns);
	} else {
		p->failed++;
	}
}

/* Record a selector decision (copies feat and sel). */
void rw_svc_metrics_decision(rw_svc_metrics_t *m, uint32_t group, uint32_t layer, uint64_t step,
			     const rw_features_t *feat, const rw_selection_t *sel);

/* ---- publishing to other threads ---- */

typedef struct rw_svc_metrics_pub {
	pthread_mutex_t lock;
	rw_svc_metrics_t snap;       /* guarded by lock */
	uint64_t version;            /* publishes so far, guarded by lock */
} rw_svc_metrics_pub_t;

rw_status_t rw_svc_metrics_pub_init(rw_svc_metrics_pub_t *pub, uint32_t rails, uint32_t peers);
void rw_svc_metrics_pub_fini(rw_svc_metrics_pub_t *pub);
/* Loop thread: copy the live metrics into the published snapshot. */
void rw_svc_metrics_publish(rw_svc_metrics_pub_t *pub, const rw_svc_metrics_t *live);
/* Any thread: copy the latest snapshot into out (initialised with the same sizes). Returns the
 * snapshot's version (0 = nothing published yet; out then holds zeros). */
uint64_t rw_svc_metrics_read(rw_svc_metrics_pub_t *pub, rw_svc_metrics_t *out);

/* Text renderers, shared by the stats socket and tests. Each appends to a growable buffer
 * (rw_svc_buf_*: service/core/text.c). */
typedef struct rw_svc_buf {
	char *data;
	size_t len, cap;
	int oom;                     /* an append failed; data holds what fit */
} rw_svc_buf_t;

void rw_svc_buf_printf(rw_svc_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void rw_svc_buf_free(rw_svc_buf_t *b);

/* Prometheus text exposition format 0.0.4 of a snapshot (names in docs/service.md). */
void rw_svc_metrics_prometheus(const rw_svc_config_t *cfg, const rw_svc_metrics_t *m,
			       rw_svc_buf_t *out);

#endif /* RW_SVC_METRICS_H */
