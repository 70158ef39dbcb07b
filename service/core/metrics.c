/* railwaved metrics: the live counters the loop thread updates (inline helpers in
 * svc_metrics.h), the snapshot handed to other threads, latency percentiles, and the Prometheus
 * text rendering. Threading contract (svc_metrics.h): one writer (the loop) on the live copy
 * with plain stores; readers on other threads only ever see published snapshots, copied under
 * a mutex that is held for one memcpy on each side. */
#include "service/core/svc.h"

#include "config.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Histograms
 * ------------------------------------------------------------------------------------------- */

uint64_t rw_svc_hist_upper(uint32_t b)
{
	if (b == 0)
		return 1ull << RW_SVC_HIST_MIN_LOG2;
	if (b >= RW_SVC_HIST_BUCKETS - 1)
		return UINT64_MAX;
	uint32_t msb = (b - 1) / RW_SVC_HIST_SUB + RW_SVC_HIST_MIN_LOG2;
	uint32_t sub = (b - 1) % RW_SVC_HIST_SUB;
	return (uint64_t)(5 + sub) << (msb - 2); /* bucket holds [(4+sub), (5+sub)) << (msb-2) */
}

uint64_t rw_svc_hist_quantile(const rw_svc_hist_t *h, double q)
{
	if (!h->count)
		return 0;
	if (q < 0)
		q = 0;
	if (q > 1)
		q = 1;
	uint64_t rank = (uint64_t)ceil(q * (double)h->count);
	if (rank == 0)
		rank = 1;
	uint64_t seen = 0;
	for (uint32_t b = 0; b < RW_SVC_HIST_BUCKETS; b++) {
		seen += h->bucket[b];
		if (seen >= rank) {
			uint64_t up = rw_svc_hist_upper(b);
			return up > h->max_ns ? h->max_ns : up;
		}
	}
	return h->max_ns;
}

/* ---------------------------------------------------------------------------------------------
 * Live metrics and snapshots
 * ------------------------------------------------------------------------------------------- */

rw_status_t rw_svc_metrics_init(rw_svc_metrics_t *m, uint32_t rails, uint32_t peers)
{
	memset(m, 0, sizeof(*m));
	if (rails > RW_MAX_RAILS || peers == 0 || peers > RW_MAX_NODES)
		return RW_ERR_INVAL;
	m->peer = calloc(peers, sizeof(*m->peer));
	if (!m->peer)
		return RW_ERR_NOMEM;
	m->rails = rails;
	m->peers = peers;
	m->start_ns = rw_now_ns();
	return RW_OK;
}

void rw_svc_metrics_fini(rw_svc_metrics_t *m)
{
	if (!m)
		return;
	free(m->peer);
	memset(m, 0, sizeof(*m));
}

void rw_svc_metrics_copy(rw_svc_metrics_t *dst, const rw_svc_metrics_t *src)
{
	rw_svc_peer_metrics_t *peer = dst->peer;
	uint32_t n = RW_MIN(dst->peers, src->peers);
	memcpy(dst, src, sizeof(*dst));
	dst->peer = peer;
	dst->peers = n;
	memcpy(peer, src->peer, n * sizeof(*peer));
}

void rw_svc_metrics_decision(rw_svc_metrics_t *m, uint32_t group, uint32_t layer, uint64_t step,
			     const rw_features_t *feat, const rw_selection_t *sel)
{
	rw_svc_decision_t *d = &m->decision[m->n_decisions % RW_SVC_DECISIONS];
	m->n_decisions++;
	d->seq = m->n_decisions;
	d->mono_ns = rw_now_ns();
	d->group = group;
	d->layer = layer;
	d->step = step;
	d->feat = *feat;
	d->sel = *sel;
	if ((unsigned)sel->path < RW_PATH_COUNT && (unsigned)sel->reason <= RW_SELECT_FORCED)
		m->selected[sel->path][sel->reason]++;
}

rw_status_t rw_svc_metrics_pub_init(rw_svc_metrics_pub_t *pub, uint32_t rails, uint32_t peers)
{
	memset(pub, 0, sizeof(*pub));
	rw_status_t st = rw_svc_metrics_init(&pub->snap, rails, peers);
	if (st)
		return st;
	if (pthread_mutex_init(&pub->lock, NULL)) {
		rw_svc_metrics_fini(&pub->snap);
		return RW_ERR_SYS;
	}
	return RW_OK;
}

void rw_svc_metrics_pub_fini(rw_svc_metrics_pub_t *pub)
{
	if (!pub || !pub->snap.peer)
		return;
	pthread_mutex_destroy(&pub->lock);
	rw_svc_metrics_fini(&pub->snap);
}

void rw_svc_metrics_publish(rw_svc_metrics_pub_t *pub, const rw_svc_metrics_t *live)
{
	pthread_mutex_lock(&pub->lock);
	rw_svc_metrics_copy(&pub->snap, live);
	pub->version++;
	pthread_mutex_unlock(&pub->lock);
}

uint64_t rw_svc_metrics_read(rw_svc_metrics_pub_t *pub, rw_svc_metrics_t *out)
{
	pthread_mutex_lock(&pub->lock);
	rw_svc_metrics_copy(out, &pub->snap);
	uint64_t v = pub->version;
	pthread_mutex_unlock(&pub->lock);
	return v;
}

/* ---------------------------------------------------------------------------------------------
 * Growable text buffer
 * ------------------------------------------------------------------------------------------- */

/* ---------------------------------------------------------------------------------------------
 * Prometheus text exposition format (version 0.0.4)
 * Names: railwave_<what>[_<unit>][_total]; labels rail, peer, path, kind, reason.
 * ------------------------------------------------------------------------------------------- */

static void head(rw_svc_buf_t *o, const char *name, const char *type, const char *help)
{
	rw_svc_buf_printf(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* Label values come from the validated config (names are [A-Za-z0-9._-]) or fixed tables,
 * so they never need escaping; keep it that way when adding labels. */
/* One series per (peer, rail) connection: rail health (docs/dataflow.md "Rail health"). */
enum link_value { LINK_UP, LINK_FAILOVERS, LINK_DEGRADED };
static void link_series(rw_svc_buf_t *o, const rw_svc_config_t *cfg, const rw_svc_metrics_t *m,
			const char *name, const char *type, const char *help, enum link_value what)
{
	const uint64_t now = rw_now_ns();
	head(o, name, type, help);
	for (uint32_t p = 0; p < m->peers && p < cfg->n_nodes; p++)
		for (uint32_t r = 0; r < m->rails && p != cfg->me; r++) {
			const rw_svc_peer_metrics_t *pm = &m->peer[p];
			double v = what == LINK_UP ? (double)((pm->rail_up_mask >> r) & 1) :
				   what == LINK_FAILOVERS ? (double)pm->rail_failovers[r] :
				   rw_svc_metrics_rail_degraded_s(pm, r, now);
			rw_svc_buf_printf(o, "%s{peer=\"%s\",rail=\"%u\"} %.9g\n", name, cfg->nodes[p].name,
					  r, v);
		}
}

static void rail_series(rw_svc_buf_t *o, const rw_svc_metrics_t *m, const char *name,
			const char *type, const char *help, size_t off, double scale)
{
	head(o, name, type, help);
	for (uint32_t r = 0; r < m->rails; r++) {
		uint64_t v = *(const uint64_t *)(const void *)((const char *)&m->rail[r] + off);
		if (scale == 1)
			rw_svc_buf_printf(o, "%s{rail=\"%u\"} %llu\n", name, r, (unsigned long long)v);
		else
			rw_svc_buf_printf(o, "%s{rail=\"%u\"} %.9g\n", name, r, (double)v * scale);
	}
}

static const char *status_name(int code)
{
	return rw_svc_err_name((rw_status_t)code);
}

/* One series per named reason of v (indexed by -code, as errors'), every unnamed one and the
 * last slot summed into "other": no two series with one label. */
static void by_reason(rw_svc_buf_t *o, const char *metric, const char *label, const uint64_t *v,
		      const char *(*name)(int code))
{
	uint64_t other = 0;
	for (uint32_t k = 1; k < RW_SVC_ERR_KINDS; k++) {
		const char *n = name(-(int)k);
		if (k == RW_SVC_ERR_KINDS - 1 || !strcmp(n, "other"))
			other += v[k];
		else if (v[k])
			rw_svc_buf_printf(o, "%s{%s=\"%s\"} %llu\n", metric, label, n,
					  (unsigned long long)v[k]);
	}
	if (other)
		rw_svc_buf_printf(o, "%s{%s=\"other\"} %llu\n", metric, label,
				  (unsigned long long)other);
}

/* A family of one unlabelled sample. */
static void one(rw_svc_buf_t *o, const char *name, const char *type, const char *help, uint64_t v)
{
	head(o, name, type, help);
	rw_svc_buf_printf(o, "%s %llu\n", name, (unsigned long long)v);
}

/* A counter with a sample for each of its n label values, zeros too. */
static void each(rw_svc_buf_t *o, const char *metric, const char *help, const char *label,
		 const uint64_t *v, int n, const char *(*name)(int i))
{
	head(o, metric, "counter", help);
	for (int i = 0; i < n; i++)
		rw_svc_buf_printf(o, "%s{%s=\"%s\"} %llu\n", metric, label, name(i),
				  (unsigned long long)v[i]);
}

static const char *kind_name(int i)
{
	return rw_svc_kind_name((rw_svc_phase_kind_t)i);
}

static const char *slab_why_name(int i)
{
	return rw_svc_slab_why_name((rw_svc_slab_why_t)i);
}

/* The rank path (docs/service.md "Turning on the rank path"): its ranks, phases, failures and
 * refusals by reason, carve-outs, and the slabs not lent by why. */
static void rank_path_series(rw_svc_buf_t *o, const rw_svc_metrics_t *m)
{
	one(o, "railwave_rank_pages", "gauge", "Ranks holding a rank page (the rank path).",
	    m->rank_pages);
	one(o, "railwave_rank_path_busy", "gauge", "Rank-path pairs with a kind in flight.",
	    m->rank_path_busy);
	each(o, "railwave_rank_path_phases_total", "Rank-path phases completed here, by kind.",
	     "kind", m->rank_path_done, RW_SVC_KIND_COUNT, kind_name);
	head(o, "railwave_rank_path_failed_total", "counter",
	     "Rank-path phases failed once in a pair, by error kind.");
	by_reason(o, "railwave_rank_path_failed_total", "kind", m->rank_path_failed, status_name);
	head(o, "railwave_rank_path_refused_total", "counter",
	     "Rank-path phases the daemon refused on the rank's page, by client code.");
	by_reason(o, "railwave_rank_path_refused_total", "code", m->rank_path_refused,
		  rw_svc_client_code_name);
	int stalled[64];
	uint64_t held = 0;
	one(o, "railwave_gpus_stalled", "gauge", "GPUs whose copies stopped landing (gpu_stall_ms).",
	    rw_svc_gpu_stalled_list(stalled, 64, &held));
	one(o, "railwave_gpu_held_bytes", "gauge",
	    "Page-locked memory held for GPU copies that may still land.", held);
	one(o, "railwave_carve_outs", "gauge", "Group carve-outs held now.", m->carve_outs);
	one(o, "railwave_carve_outs_max", "gauge", "Group carve-outs the pool holds.",
	    m->carve_outs_max);
	one(o, "railwave_carve_outs_refused_total", "counter",
	    "Groups refused a carve-out: the pool spent, or their uid at group_carve_per_uid.",
	    m->carve_outs_refused);
	one(o, "railwave_carve_outs_taken_back_total", "counter",
	    "Carve-outs taken back from a group idle for group_carve_idle_s.",
	    m->carve_outs_taken_back);
	each(o, "railwave_rank_slabs_refused_total",
	     "Group slabs a rank asked for and was not lent (its rank path off), by why.", "why",
	     m->slabs_refused, RW_SVC_SLAB_WHY_COUNT, slab_why_name);
}

void rw_svc_metrics_prometheus(const rw_svc_config_t *cfg, const rw_svc_metrics_t *m,
			       rw_svc_buf_t *o)
{
	head(o, "railwave_info", "gauge", "Constant 1 with the daemon's identity as labels.");
	rw_svc_buf_printf(o, "railwave_info{cluster=\"%s\",node=\"%s\",transport=\"%s\"} 1\n",
			  cfg->cluster, cfg->nodes[cfg->me].name,
			  rw_svc_transport_name(cfg->transport));
	head(o, "railwave_build_info", "gauge", "Constant 1 with the daemon's version as a label.");
	rw_svc_buf_printf(o, "railwave_build_info{version=\"%s\"} 1\n", RW_VERSION);
	uint32_t up;
	rw_svc_ready_eval(cfg, m, 0, &up, NULL);
	head(o, "railwave_peers_up", "gauge",
	     "Other nodes with the control channel and every rail connected.");
	rw_svc_buf_printf(o, "railwave_peers_up %u\n", up);
	head(o, "railwave_peers_configured", "gauge", "Other nodes in the cluster configuration.");
	rw_svc_buf_printf(o, "railwave_peers_configured %u\n", cfg->n_nodes - 1);
	head(o, "railwave_uptime_seconds", "gauge", "Seconds since the daemon started.");
	rw_svc_buf_printf(o, "railwave_uptime_seconds %.3f\n",
			  (double)(rw_now_ns() - m->start_ns) * 1e-9);

#define RAIL(n, t, h, f, s) rail_series(o, m, n, t, h, offsetof(rw_svc_rail_metrics_t, f), s)
	RAIL("railwave_rail_tx_bytes_total", "counter", "Bytes sent on each rail.", tx_bytes, 1);
	RAIL("railwave_rail_tx_records_total", "counter", "Records sent on each rail.", tx_records, 1);
	RAIL("railwave_rail_tx_writes_total", "counter", "One-sided writes posted on each rail.",
	     tx_writes, 1);
	RAIL("railwave_rail_tx_busy_seconds_total", "counter",
	     "Time each rail had a write in flight.", tx_busy_ns, 1e-9);
	RAIL("railwave_rail_rx_bytes_total", "counter", "Bytes received on each rail.", rx_bytes, 1);
	RAIL("railwave_rail_rx_records_total", "counter", "Records received on each rail.",
	     rx_records, 1);
	RAIL("railwave_rail_rx_writes_total", "counter", "One-sided writes received on each rail.",
	     rx_writes, 1);
	RAIL("railwave_rail_rx_busy_seconds_total", "counter",
	     "Time each rail was receiving.", rx_busy_ns, 1e-9);
	RAIL("railwave_rail_errors_total", "counter", "Transport errors on each rail.", errors, 1);
	RAIL("railwave_rail_wire_tx_bytes_total", "counter",
	     "Bytes the transport handed to each rail's wire, framing and acks included (tcp).",
	     wire_tx_bytes, 1);
	RAIL("railwave_rail_pace_waits_total", "counter",
	     "Times a send on each rail waited for its pacing budget (tcp with pace on).",
	     pace_waits, 1);
	RAIL("railwave_rail_conn_failures_total", "counter",
	     "Rail connections that failed, whatever failed first.", transport.conn_failures, 1);
	RAIL("railwave_rail_retry_exceeded_total", "counter",
	     "Writes never acknowledged: the peer was unreachable (verbs RETRY_EXC).",
	     transport.retry_exceeded, 1);
	RAIL("railwave_rail_rnr_retry_exceeded_total", "counter",
	     "Writes whose receiver had no receive posted until the retries ran out (verbs).",
	     transport.rnr_retry_exceeded, 1);
	RAIL("railwave_rail_remote_errors_total", "counter",
	     "Writes the peer refused (verbs: remote access, invalid request or operation).",
	     transport.remote_errors, 1);
	RAIL("railwave_rail_wc_errors_total", "counter",
	     "Other failed work completions, flushes excepted (verbs).", transport.wc_errors, 1);
	RAIL("railwave_rail_write_again_total", "counter",
	     "Writes refused for a full send queue and retried later.", transport.write_again, 1);
#undef RAIL

	head(o, "railwave_peer_state", "gauge",
	     "Peer connection state: 0 down, 1 connecting, 2 up, 3 failed, 4 self.");
	for (uint32_t p = 0; p < m->peers && p < cfg->n_nodes; p++)
		rw_svc_buf_printf(o, "railwave_peer_state{peer=\"%s\"} %u\n", cfg->nodes[p].name,
				  p == cfg->me ? (unsigned)RW_SVC_PEER_SELF : m->peer[p].state);
	head(o, "railwave_rail_weight", "gauge",
	     "This node's capacity weight of each rail, as its count rows carry it.");
	for (uint32_t r = 0; r < m->rails; r++)
		rw_svc_buf_printf(o, "railwave_rail_weight{rail=\"%u\"} %u\n", r, m->rail[r].weight);
	link_series(o, cfg, m, "railwave_rail_link_up", "gauge",
		    "Rail connection to each peer: 1 up, 0 down (the peer itself may be up).", LINK_UP);
	link_series(o, cfg, m, "railwave_rail_failovers_total", "counter",
		    "Times a rail connection went down while its peer stayed up.", LINK_FAILOVERS);
	link_series(o, cfg, m, "railwave_rail_degraded_seconds_total", "counter",
		    "Time a rail connection spent down while its peer stayed up.", LINK_DEGRADED);
	head(o, "railwave_phases_rail_excluded_total", "counter",
	     "Phases planned without some rail for some pair of nodes (a rail down at either end).");
	rw_svc_buf_printf(o, "railwave_phases_rail_excluded_total %llu\n",
			  (unsigned long long)m->phases_rail_excluded);
	head(o, "railwave_peer_rails_up", "gauge", "Rails connected to each peer.");
	for (uint32_t p = 0; p < m->peers && p < cfg->n_nodes; p++)
		if (p != cfg->me)
			rw_svc_buf_printf(o, "railwave_peer_rails_up{peer=\"%s\"} %u\n",
					  cfg->nodes[p].name, m->peer[p].rails_up);
	head(o, "railwave_peer_reconnects_total", "counter",
	     "Times each peer came back after being lost.");
	for (uint32_t p = 0; p < m->peers && p < cfg->n_nodes; p++)
		if (p != cfg->me)
			rw_svc_buf_printf(o, "railwave_peer_reconnects_total{peer=\"%s\"} %llu\n",
					  cfg->nodes[p].name,
					  (unsigned long long)m->peer[p].reconnects);
	head(o, "railwave_peer_errors_total", "counter", "Peer and link errors per peer.");
	for (uint32_t p = 0; p < m->peers && p < cfg->n_nodes; p++)
		if (p != cfg->me)
			rw_svc_buf_printf(o, "railwave_peer_errors_total{peer=\"%s\"} %llu\n",
					  cfg->nodes[p].name, (unsigned long long)m->peer[p].errors);

	head(o, "railwave_phases_total", "counter", "Phases completed, by path and kind.");
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int k = 0; k < RW_SVC_KIND_COUNT; k++)
			rw_svc_buf_printf(o, "railwave_phases_total{path=\"%s\",kind=\"%s\"} %llu\n",
					  rw_sched_path_name((rw_path_t)p), rw_svc_kind_name(k),
					  (unsigned long long)m->phase[p][k].ok);
	head(o, "railwave_phase_failures_total", "counter", "Phases failed, by path and kind.");
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int k = 0; k < RW_SVC_KIND_COUNT; k++)
			rw_svc_buf_printf(o,
					  "railwave_phase_failures_total{path=\"%s\",kind=\"%s\"} %llu\n",
					  rw_sched_path_name((rw_path_t)p), rw_svc_kind_name(k),
					  (unsigned long long)m->phase[p][k].failed);

	/* Histogram: cumulative buckets at the powers of two (every RW_SVC_HIST_SUB-th internal
	 * boundary), which the log-linear buckets give exactly. */
	head(o, "railwave_phase_duration_seconds", "histogram",
	     "Latency of completed phases, by path and kind.");
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int k = 0; k < RW_SVC_KIND_COUNT; k++) {
			const rw_svc_hist_t *h = &m->phase[p][k].latency;
			const char *pn = rw_sched_path_name((rw_path_t)p), *kn = rw_svc_kind_name(k);
			uint64_t cum = 0;
			for (uint32_t b = 0; b < RW_SVC_HIST_BUCKETS - 1; b++) {
				cum += h->bucket[b];
				if (b % RW_SVC_HIST_SUB != 0)
					continue; /* bucket 0, 4, 8, ... end at a power of two */
				rw_svc_buf_printf(o, "railwave_phase_duration_seconds_bucket{path=\"%s\","
						  "kind=\"%s\",le=\"%.9g\"} %llu\n", pn, kn,
						  (double)rw_svc_hist_upper(b) * 1e-9,
						  (unsigned long long)cum);
			}
			rw_svc_buf_printf(o, "railwave_phase_duration_seconds_bucket{path=\"%s\","
					  "kind=\"%s\",le=\"+Inf\"} %llu\n", pn, kn,
					  (unsigned long long)h->count);
			rw_svc_buf_printf(o, "railwave_phase_duration_seconds_sum{path=\"%s\","
					  "kind=\"%s\"} %.9g\n", pn, kn, (double)h->sum_ns * 1e-9);
			rw_svc_buf_printf(o, "railwave_phase_duration_seconds_count{path=\"%s\","
					  "kind=\"%s\"} %llu\n", pn, kn, (unsigned long long)h->count);
		}

	head(o, "railwave_selector_decisions_total", "counter",
	     "Selector decisions, by chosen path and reason.");
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int r = 0; r <= RW_SELECT_FORCED; r++)
			if (m->selected[p][r])
				rw_svc_buf_printf(o, "railwave_selector_decisions_total{path=\"%s\","
						  "reason=\"%s\"} %llu\n", rw_sched_path_name((rw_path_t)p),
						  rw_sched_reason_name((rw_select_reason_t)r),
						  (unsigned long long)m->selected[p][r]);
	if (m->n_decisions) {
		const rw_svc_decision_t *d = &m->decision[(m->n_decisions - 1) % RW_SVC_DECISIONS];
		head(o, "railwave_selector_last_feature", "gauge",
		     "Features of the latest decision (f0 = log2 B, f1 rail skew, f2 receiver "
		     "concentration).");
		for (int f = 0; f < 3; f++)
			rw_svc_buf_printf(o, "railwave_selector_last_feature{feature=\"f%d\"} %.9g\n", f,
					  d->feat.f[f]);
	}

	head(o, "railwave_errors_total", "counter", "Errors by kind (rw_status_t).");
	by_reason(o, "railwave_errors_total", "kind", m->errors, status_name);

	head(o, "railwave_clients", "gauge", "Trainer ranks connected.");
	rw_svc_buf_printf(o, "railwave_clients %u\n", m->clients);
	rank_path_series(o, m);
	head(o, "railwave_stats_clients", "gauge", "Stats socket connections open.");
	rw_svc_buf_printf(o, "railwave_stats_clients %u\n", m->stats_clients);
	head(o, "railwave_stats_rejected_total", "counter",
	     "Stats clients dropped for bad input, timeouts or limits.");
	rw_svc_buf_printf(o, "railwave_stats_rejected_total %llu\n",
			  (unsigned long long)m->stats_rejected);
	head(o, "railwave_anchor_reloads_total", "counter", "Anchor table reloads (SIGHUP).");
	rw_svc_buf_printf(o, "railwave_anchor_reloads_total{result=\"ok\"} %llu\n",
			  (unsigned long long)m->anchor_reloads);
	rw_svc_buf_printf(o, "railwave_anchor_reloads_total{result=\"refused\"} %llu\n",
			  (unsigned long long)m->anchor_reload_failures);
}
