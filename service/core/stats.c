/* railwaved stats socket: a Unix stream socket served on the loop with a line-oriented text
 * protocol ("stats", "stats rails", ..., "help"; every reply ends with an empty line).
 * Defensive by construction: each client has a fixed input buffer (one line, 4 KiB) and at most
 * one reply pending (input is not read while a reply drains), binary or overlong input gets an
 * error line and a disconnect, a client that stalls (half a line, or not reading its reply) past
 * stats_timeout_ms is dropped, and when RW_SVC_STATS_CLIENTS_MAX are open the one that has waited
 * longest makes room for a new one (a slowloris that keeps every slot busy cannot keep a prompt
 * client out).
 * Closed clients are freed from an idle watcher, never inside their own callback. */
#include "common/list.h"
#include "common/listen_pause.h"
#include "service/core/svc.h"
#include "ipc/ipc.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

typedef struct stats_client {
	rw_svc_stats_t *srv;
	int fd;
	ev_io rio, wio;
	ev_timer deadline;       /* running whenever we wait on the client */
	uint64_t wait_since;     /* when that wait began (the longest waiting makes room) */
	char in[RW_SVC_STATS_LINE_MAX];
	size_t in_len;
	rw_svc_buf_t out;        /* the one pending reply */
	size_t out_off;
	int close_after_flush;   /* an error was sent; disconnect once it is out */
	rw_list_t link;          /* in the server's clients, then its zombies */
} stats_client_t;

struct rw_svc_stats {
	rw_svc_t *svc;
	int fd;
	char path[RW_SVC_SOCK_MAX];
	dev_t dev;
	ino_t ino;
	ev_io accept_io;
	rw_listen_pause_t accept_pause; /* rests the listener when descriptors run out */
	ev_idle reaper;
	rw_list_t clients;       /* open */
	rw_list_t zombies;       /* closed, freed by the reaper */
};

/* ---------------------------------------------------------------------------------------------
 * Replies
 * ------------------------------------------------------------------------------------------- */

static double ns_to_us(uint64_t ns) { return (double)ns / 1e3; }


/* The rank path's lines of `stats` (docs/service.md "Turning on the rank path"): the ranks
 * holding a rank page, its phases by kind, its failures and refusals by reason, the slabs not
 * lent by why. A reason's line only once it counted. */
uint32_t rw_svc_rank_pages(const rw_svc_t *svc)
{
	uint32_t pages = 0;
	for (const rw_ipc_client_t *c = svc->ipc ? rw_ipc_server_next_client(svc->ipc, NULL) : NULL;
	     c; c = rw_ipc_server_next_client(svc->ipc, c))
		pages += rw_ipc_client_page(c, NULL) != NULL;
	return pages;
}

static void answer_rank_path(const rw_svc_t *svc, rw_svc_buf_t *o)
{
	const rw_svc_metrics_t *m = &svc->metrics;
	rw_svc_buf_printf(o, "rank_pages %u\n", rw_svc_rank_pages(svc));
	rw_svc_buf_printf(o, "rank_path_dispatches %llu\nrank_path_combines %llu\n",
			  (unsigned long long)m->rank_path_done[RW_SVC_DISPATCH],
			  (unsigned long long)m->rank_path_done[RW_SVC_COMBINE]);
	uint64_t failed = 0, refused = 0;
	for (uint32_t k = 0; k < RW_SVC_ERR_KINDS; k++) {
		failed += m->rank_path_failed[k];
		refused += m->rank_path_refused[k];
	}
	rw_svc_buf_printf(o, "rank_path_failed %llu\n", (unsigned long long)failed);
	for (uint32_t k = 1; k < RW_SVC_ERR_KINDS; k++)
		if (m->rank_path_failed[k])
			rw_svc_buf_printf(o, "rank_path_failed_%s %llu\n",
					  rw_svc_err_name((rw_status_t)-(int)k),
					  (unsigned long long)m->rank_path_failed[k]);
	rw_svc_buf_printf(o, "rank_path_refused %llu\n", (unsigned long long)refused);
	for (uint32_t k = 1; k < RW_SVC_ERR_KINDS; k++)
		if (m->rank_path_refused[k])
			rw_svc_buf_printf(o, "rank_path_refused_%s %llu\n",
					  rw_svc_client_code_name(-(int)k),
					  (unsigned long long)m->rank_path_refused[k]);
	for (int w = 0; w < RW_SVC_SLAB_WHY_COUNT; w++)
		rw_svc_buf_printf(o, "rank_slabs_refused_%s %llu\n",
				  rw_svc_slab_why_name((rw_svc_slab_why_t)w),
				  (unsigned long long)m->slabs_refused[w]);
}
/* The daemon's GPUs that stopped making progress (docs/rankpath.md "A hung GPU"): how many, which,
 * and the page-locked memory held for their copies that may still land. */
static void answer_gpus(rw_svc_buf_t *o)
{
	int dev[64];
	uint64_t held = 0, devs = 0;
	const unsigned n = rw_svc_gpu_stalled_list(dev, 64, &held);
	for (unsigned i = 0; i < n; i++)
		devs |= 1ull << dev[i];
	char list[192];
	rw_svc_gpu_list(devs, list, sizeof(list));
	rw_svc_buf_printf(o, "gpus_stalled %u%s%s\ngpu_held_bytes %llu\n", n, n ? " " : "", list,
			  (unsigned long long)held);
}

static void answer_summary(const rw_svc_t *svc, rw_svc_buf_t *o)
{
	const rw_svc_config_t *cfg = &svc->cfg;
	const rw_svc_metrics_t *m = &svc->metrics;
	uint32_t up;
	int ready = rw_svc_ready_eval(cfg, m, svc->draining, &up, NULL);
	uint64_t ok = 0, failed = 0, errors = 0;
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int k = 0; k < RW_SVC_KIND_COUNT; k++) {
			ok += m->phase[p][k].ok;
			failed += m->phase[p][k].failed;
		}
	for (uint32_t k = 1; k < RW_SVC_ERR_KINDS; k++)
		errors += m->errors[k];
	rw_svc_buf_printf(o, "cluster %s\n", cfg->cluster);
	rw_svc_buf_printf(o, "node %s\n", cfg->nodes[cfg->me].name);
	rw_svc_buf_printf(o, "node_index %u\n", cfg->me);
	rw_svc_buf_printf(o, "transport %s\n", rw_svc_transport_name(cfg->transport));
	rw_svc_buf_printf(o, "auth %s\n", cfg->key_file[0] ? "key" : "none");
	rw_svc_buf_printf(o, "slabs %s\n", m->slabs[0] ? m->slabs : "-");
	rw_svc_buf_printf(o, "nodes %u\n", cfg->n_nodes);
	rw_svc_buf_printf(o, "rails %u\n", cfg->rails);
	rw_svc_buf_printf(o, "gpus_per_node %u\n", cfg->gpus_per_node);
	rw_svc_buf_printf(o, "uptime_s %.3f\n", (double)(rw_now_ns() - m->start_ns) * 1e-9);
	rw_svc_buf_printf(o, "state %s\n", svc->stopping ? "stopping" :
			  svc->draining ? "draining" : "running");
	rw_svc_buf_printf(o, "peers_up %u/%u\n", up, cfg->n_nodes - 1);
	rw_svc_buf_printf(o, "ready %s\n", ready ? "yes" : "no");
	rw_svc_buf_printf(o, "clients %u\n", m->clients);
	rw_svc_buf_printf(o, "stats_clients %u\n", m->stats_clients);
	rw_svc_buf_printf(o, "phases_ok %llu\n", (unsigned long long)ok);
	rw_svc_buf_printf(o, "phases_failed %llu\n", (unsigned long long)failed);
	rw_svc_buf_printf(o, "decisions %llu\n", (unsigned long long)m->n_decisions);
	rw_svc_buf_printf(o, "wave_fanin_max %u\n", m->wave_fanin_max);
	rw_svc_buf_printf(o, "phases_rail_excluded %llu\n", (unsigned long long)m->phases_rail_excluded);
	rw_svc_buf_printf(o, "counts_host %llu\ncounts_gpu %llu\n", (unsigned long long)m->counts_host,
			  (unsigned long long)m->counts_gpu);
	rw_svc_buf_printf(o, "rx_prefixes %llu\ntx_piece_waits %llu\n",
			  (unsigned long long)m->rx_prefixes, (unsigned long long)m->tx_piece_waits);
	rw_svc_buf_printf(o, "peer_keys_refused %llu\n", (unsigned long long)m->peer_keys_refused);
	rw_svc_buf_printf(o, "rank_path_busy %u\nrank_path_phases %llu\n", m->rank_path_busy,
			  (unsigned long long)m->rank_path_phases);
	rw_svc_buf_printf(o, "carve_outs %u/%u\ncarve_outs_refused %llu\ncarve_outs_taken_back %llu\n",
			  m->carve_outs, m->carve_outs_max, (unsigned long long)m->carve_outs_refused,
			  (unsigned long long)m->carve_outs_taken_back);
	answer_rank_path(svc, o);
	answer_gpus(o);
	rw_svc_buf_printf(o, "path %s\n", cfg->force_path == RW_SVC_PATH_AUTO ? "auto" :
			  rw_sched_path_name((rw_path_t)cfg->force_path));
	if (svc->anchors)
		rw_svc_buf_printf(o, "anchors %u\n", svc->anchors->n_anchors);
	else
		rw_svc_buf_printf(o, "anchors none\n");
	rw_svc_buf_printf(o, "anchor_reloads %llu\n", (unsigned long long)m->anchor_reloads);
	rw_svc_buf_printf(o, "anchor_reloads_refused %llu\n",
			  (unsigned long long)m->anchor_reload_failures);
	rw_svc_buf_printf(o, "errors %llu\n", (unsigned long long)errors);
	for (uint32_t k = 1; k < RW_SVC_ERR_KINDS; k++)
		if (m->errors[k])
			rw_svc_buf_printf(o, "error_%s %llu\n", k == RW_SVC_ERR_KINDS - 1 ? "other" :
					  rw_svc_err_name((rw_status_t)-(int)k),
					  (unsigned long long)m->errors[k]);
	if (svc->ipc) { /* rank authentication refusals (docs/ipc.md "Rank authentication") */
		rw_ipc_server_stats_t is;
		rw_ipc_server_stats(svc->ipc, &is);
		rw_svc_buf_printf(o, "ipc_refused_key %llu\n", (unsigned long long)is.refused_key);
		rw_svc_buf_printf(o, "ipc_refused_uid %llu\n", (unsigned long long)is.refused_uid);
		rw_svc_buf_printf(o, "ipc_groups_claimed %llu\n",
				  (unsigned long long)is.groups_claimed);
		rw_svc_buf_printf(o, "ipc_hello_timeouts %llu\n",
				  (unsigned long long)is.hello_timeouts);
	}
}

/* `stats clients`: every IPC connection with the credentials the kernel vouched for
 * (SO_PEERCRED), so an operator can see which process holds which rank. */
static void answer_clients(const rw_svc_t *svc, rw_svc_buf_t *o)
{
	rw_ipc_server_stats_t is = {0};
	if (svc->ipc)
		rw_ipc_server_stats(svc->ipc, &is);
	rw_svc_buf_printf(o, "connections %u\n", is.clients); /* so the answer is never empty */
	if (!svc->ipc)
		return;
	for (const rw_ipc_client_t *c = rw_ipc_server_next_client(svc->ipc, NULL); c;
	     c = rw_ipc_server_next_client(svc->ipc, c)) {
		const rw_ipc_client_info_t *in = rw_ipc_client_info(c);
		rw_svc_buf_printf(o, "client=%u pid=%d uid=%d gid=%d", in->id, (int)in->pid,
				  (int)in->uid, (int)in->gid);
		if (rw_ipc_client_joined(c))
			rw_svc_buf_printf(o, " group=%s rank=%u world=%u gpu=%d\n", in->group,
					  in->rank, in->world_size, in->local_gpu);
		else
			rw_svc_buf_printf(o, " group=- (no hello yet)\n");
	}
}

static void answer_rails(const rw_svc_t *svc, rw_svc_buf_t *o)
{
	const rw_svc_metrics_t *m = &svc->metrics;
	const uint64_t now = rw_now_ns();
	for (uint32_t r = 0; r < m->rails; r++) {
		const rw_svc_rail_metrics_t *x = &m->rail[r];
		/* Rate while busy: bytes over the time the rail had work in flight. */
		double tx_gbps = x->tx_busy_ns ? (double)x->tx_bytes * 8 / (double)x->tx_busy_ns : 0;
		double rx_gbps = x->rx_busy_ns ? (double)x->rx_bytes * 8 / (double)x->rx_busy_ns : 0;
		rw_svc_buf_printf(o, "rail=%u tx_bytes=%llu tx_records=%llu tx_writes=%llu "
				  "tx_busy_s=%.6f tx_gbps=%.3f rx_bytes=%llu rx_records=%llu "
				  "rx_writes=%llu rx_busy_s=%.6f rx_gbps=%.3f errors=%llu "
				  "wire_tx_bytes=%llu pace_waits=%llu", r,
				  (unsigned long long)x->tx_bytes, (unsigned long long)x->tx_records,
				  (unsigned long long)x->tx_writes, (double)x->tx_busy_ns * 1e-9,
				  tx_gbps, (unsigned long long)x->rx_bytes,
				  (unsigned long long)x->rx_records, (unsigned long long)x->rx_writes,
				  (double)x->rx_busy_ns * 1e-9, rx_gbps, (unsigned long long)x->errors,
				  (unsigned long long)x->wire_tx_bytes,
				  (unsigned long long)x->pace_waits);
		/* ---- the transport's failure and back-pressure counters (rdma/rail.h) ---- */
		const rw_rail_dev_stats_t *t = &x->transport; /* sampled by the mesh */
		rw_svc_buf_printf(o, " conn_failures=%llu retry_exceeded=%llu "
					  "rnr_retry_exceeded=%llu remote_errors=%llu wc_errors=%llu "
					  "write_again=%llu chunked_writes=%llu poll_yields=%llu",
					  (unsigned long long)t->conn_failures,
					  (unsigned long long)t->retry_exceeded,
					  (unsigned long long)t->rnr_retry_exceeded,
					  (unsigned long long)t->remote_errors,
					  (unsigned long long)t->wc_errors,
					  (unsigned long long)t->write_again,
					  (unsigned long long)t->chunked_writes,
					  (unsigned long long)t->poll_yields);
		/* ---- rail health: over every peer (docs/dataflow.md "Rail health") ---- */
		uint32_t down = 0;
		uint64_t failovers = 0;
		double degraded = 0;
		for (uint32_t p = 0; p < m->peers && p < svc->cfg.n_nodes; p++) {
			if (p == svc->cfg.me)
				continue;
			const rw_svc_peer_metrics_t *pm = &m->peer[p];
			down += pm->state == RW_SVC_PEER_UP && !((pm->rail_up_mask >> r) & 1);
			failovers += pm->rail_failovers[r];
			degraded += rw_svc_metrics_rail_degraded_s(pm, r, now);
		}
		rw_svc_buf_printf(o, " weight=%u peers_down=%u failovers=%llu degraded_s=%.3f\n",
				  x->weight, down, (unsigned long long)failovers, degraded);
	}
	/* One line per (peer, rail) connection, keyed link=PEER/RAIL (no rail= key: readers of the
	 * per-rail lines pick those by it). */
	for (uint32_t p = 0; p < m->peers && p < svc->cfg.n_nodes; p++) {
		if (p == svc->cfg.me)
			continue;
		const rw_svc_peer_metrics_t *pm = &m->peer[p];
		for (uint32_t r = 0; r < m->rails; r++)
			rw_svc_buf_printf(o, "link=%s/%u state=%s failovers=%llu degraded_s=%.3f\n",
					  svc->cfg.nodes[p].name, r,
					  pm->state != RW_SVC_PEER_UP ? "peer-down" :
					  (pm->rail_up_mask >> r) & 1 ? "up" : "down",
					  (unsigned long long)pm->rail_failovers[r],
					  rw_svc_metrics_rail_degraded_s(pm, r, now));
	}
}

static void answer_peers(const rw_svc_t *svc, rw_svc_buf_t *o)
{
	const rw_svc_config_t *cfg = &svc->cfg;
	const rw_svc_metrics_t *m = &svc->metrics;
	for (uint32_t p = 0; p < m->peers && p < cfg->n_nodes; p++) {
		const rw_svc_peer_metrics_t *x = &m->peer[p];
		rw_svc_buf_printf(o, "peer=%u name=%s state=%s rails_up=%u reconnects=%llu errors=%llu "
				  "rtt_us=%.1f\n", p, cfg->nodes[p].name,
				  rw_svc_peer_state_name(p == cfg->me ? RW_SVC_PEER_SELF :
							 (rw_svc_peer_state_t)x->state),
				  p == cfg->me ? cfg->rails : x->rails_up,
				  (unsigned long long)x->reconnects, (unsigned long long)x->errors,
				  ns_to_us(x->heartbeat_rtt_ns));
	}
}

static void answer_phases(const rw_svc_t *svc, rw_svc_buf_t *o)
{
	const rw_svc_metrics_t *m = &svc->metrics;
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int k = 0; k < RW_SVC_KIND_COUNT; k++) {
			const rw_svc_phase_metrics_t *x = &m->phase[p][k];
			const rw_svc_hist_t *h = &x->latency;
			rw_svc_buf_printf(o, "path=%s kind=%s ok=%llu failed=%llu mean_us=%.1f "
					  "p50_us=%.1f p90_us=%.1f p99_us=%.1f max_us=%.1f\n",
					  rw_sched_path_name((rw_path_t)p), rw_svc_kind_name(k),
					  (unsigned long long)x->ok, (unsigned long long)x->failed,
					  h->count ? ns_to_us(h->sum_ns) / (double)h->count : 0,
					  ns_to_us(rw_svc_hist_quantile(h, 0.50)),
					  ns_to_us(rw_svc_hist_quantile(h, 0.90)),
					  ns_to_us(rw_svc_hist_quantile(h, 0.99)), ns_to_us(h->max_ns));
		}
}

static void answer_selector(const rw_svc_t *svc, rw_svc_buf_t *o)
{
	const rw_svc_metrics_t *m = &svc->metrics;
	rw_svc_buf_printf(o, "mode %s\n", svc->cfg.force_path == RW_SVC_PATH_AUTO ? "auto" :
			  rw_sched_path_name((rw_path_t)svc->cfg.force_path));
	if (svc->anchors)
		rw_svc_buf_printf(o, "anchors %u max_size_ratio=%g shape_tolerance=%g "
				  "fingerprint=%ux%ux%u@%ggbps/%s file=%s\n",
				  svc->anchors->n_anchors, svc->anchors->max_size_ratio,
				  svc->anchors->shape_tolerance, svc->anchors->fingerprint.nodes,
				  svc->anchors->fingerprint.gpus_per_node,
				  svc->anchors->fingerprint.rails, svc->anchors->fingerprint.nic_gbps,
				  svc->anchors->fingerprint.transport, svc->cfg.anchors);
	else
		rw_svc_buf_printf(o, "anchors none\n");
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int r = 0; r <= RW_SELECT_FORCED; r++)
			if (m->selected[p][r])
				rw_svc_buf_printf(o, "selected path=%s reason=%s count=%llu\n",
						  rw_sched_path_name((rw_path_t)p), rw_sched_reason_name((rw_select_reason_t)r),
						  (unsigned long long)m->selected[p][r]);
	uint64_t now = rw_now_ns();
	uint64_t n = RW_MIN(m->n_decisions, (uint64_t)RW_SVC_DECISIONS);
	for (uint64_t i = 0; i < n; i++) { /* newest first */
		const rw_svc_decision_t *d = &m->decision[(m->n_decisions - 1 - i) % RW_SVC_DECISIONS];
		rw_svc_buf_printf(o, "decision seq=%llu age_s=%.3f group=%u layer=%u step=%llu "
				  "path=%s reason=%s case=%lld d2=%.6g f0=%.6g f1=%.6g f2=%.6g "
				  "B=%.6g rho_g=%.6g kappa=%.6g fan_in=%u remote_bytes=%llu\n",
				  (unsigned long long)d->seq, (double)(now - d->mono_ns) * 1e-9,
				  d->group, d->layer, (unsigned long long)d->step,
				  rw_sched_path_name(d->sel.path), rw_sched_reason_name(d->sel.reason),
				  (long long)d->sel.case_id, d->sel.distance2, d->feat.f[0],
				  d->feat.f[1], d->feat.f[2], d->feat.B, d->feat.rho_g, d->feat.kappa,
				  d->feat.max_fan_in, (unsigned long long)d->feat.remote_bytes);
	}
}

/* `ready`: what `railwave wait` polls. The stats socket is served by the loop, so an answer
 * also proves the loop is alive; the reply says whether every peer is up and who is missing. */
static void answer_ready(const rw_svc_t *svc, rw_svc_buf_t *o)
{
	uint32_t up;
	rw_svc_buf_t why = {0};
	int ready = rw_svc_ready_eval(&svc->cfg, &svc->metrics, svc->draining, &up, &why);
	rw_svc_buf_printf(o, "ready %s\n", ready ? "yes" : "no");
	rw_svc_buf_printf(o, "state %s\n", svc->stopping ? "stopping" :
			  svc->draining ? "draining" : "running");
	rw_svc_buf_printf(o, "peers_up %u/%u\n", up, svc->cfg.n_nodes - 1);
	if (why.len)
		rw_svc_buf_printf(o, "%s", why.data);
	if (why.oom)
		o->oom = 1;
	rw_svc_buf_free(&why);
}

static const char help_text[] =
	"stats            summary: node, peers up, clients, phases, errors by kind\n"
	"stats rails      per rail: tx/rx bytes, records, writes, busy time, rate while busy, weight,\n"
	"                 rail health (peers down, failovers, time degraded); per link: state\n"
	"stats peers      per peer: state, rails up, reconnects, errors, heartbeat rtt\n"
	"stats phases     per path and kind: ok, failed, mean/p50/p90/p99/max latency\n"
	"stats selector   decisions by path and reason, then the latest decisions with features\n"
	"stats clients    per IPC connection: pid, uid, gid (SO_PEERCRED), group, rank\n"
	"health           'health ok' (the daemon's loop answers)\n"
	"ready            'ready yes|no', state, peers up, and a 'waiting peer=...' line per missing peer\n"
	"help             this list\n";

int rw_svc_stats_answer(const rw_svc_t *svc, const char *line, rw_svc_buf_t *out)
{
	char buf[RW_SVC_STATS_LINE_MAX];
	char *tok[4] = {0};
	int n = 0;
	snprintf(buf, sizeof(buf), "%s", line);
	char *save = NULL;
	for (char *t = strtok_r(buf, " \t\r", &save); t; t = strtok_r(NULL, " \t\r", &save)) {
		if (n == (int)RW_ARRAY_SIZE(tok)) {
			n++;
			break;
		}
		tok[n++] = t;
	}
	if (n == 1 && !strcmp(tok[0], "help")) {
		rw_svc_buf_printf(out, "%s", help_text);
		return 0;
	}
	if (n == 1 && !strcmp(tok[0], "health")) {
		rw_svc_buf_printf(out, "health ok\n");
		return 0;
	}
	if (n == 1 && !strcmp(tok[0], "ready")) {
		answer_ready(svc, out);
		return 0;
	}
	if (n >= 1 && n <= 2 && !strcmp(tok[0], "stats")) {
		const char *what = n == 2 ? tok[1] : "";
		if (!*what)
			answer_summary(svc, out);
		else if (!strcmp(what, "rails"))
			answer_rails(svc, out);
		else if (!strcmp(what, "peers"))
			answer_peers(svc, out);
		else if (!strcmp(what, "phases"))
			answer_phases(svc, out);
		else if (!strcmp(what, "selector"))
			answer_selector(svc, out);
		else if (!strcmp(what, "clients"))
			answer_clients(svc, out);
		else
			goto unknown;
		return 0;
	}
unknown:
	rw_svc_buf_printf(out, "error unknown command '%.64s' (try help)\n", line);
	return -1;
}

/* ---------------------------------------------------------------------------------------------
 * Clients
 * ------------------------------------------------------------------------------------------- */

static void client_close(stats_client_t *c, int rejected)
{
	rw_svc_stats_t *srv = c->srv;
	struct ev_loop *loop = srv->svc->loop;
	ev_io_stop(loop, &c->rio);
	ev_io_stop(loop, &c->wio);
	ev_timer_stop(loop, &c->deadline);
	close(c->fd);
	c->fd = -1;
	rw_list_del(&c->link);
	rw_list_add(&srv->zombies, &c->link);
	ev_idle_start(loop, &srv->reaper);
	srv->svc->metrics.stats_clients--;
	if (rejected) {
		srv->svc->metrics.stats_rejected++;
		rw_svc_metrics_error(&srv->svc->metrics, RW_ERR_CLIENT);
	}
}

static void reaper_cb(struct ev_loop *loop, ev_idle *w, int revents)
{
	(void)revents;
	rw_svc_stats_t *srv = w->data;
	stats_client_t *c, *nx;
	rw_list_for_each_safe(&srv->zombies, c, nx, link) {
		rw_list_del(&c->link);
		rw_svc_buf_free(&c->out);
		free(c);
	}
	ev_idle_stop(loop, w);
}

static void restart_deadline(stats_client_t *c)
{
	c->wait_since = rw_now_ns();
	ev_timer_stop(c->srv->svc->loop, &c->deadline);
	ev_timer_set(&c->deadline, c->srv->svc->cfg.stats_timeout_ms / 1e3, 0.);
	ev_timer_start(c->srv->svc->loop, &c->deadline);
}

static void process_input(stats_client_t *c);

/* Send what is pending. Returns 0 while the client stays open, -1 once it is closed. */
static int client_flush(stats_client_t *c)
{
	struct ev_loop *loop = c->srv->svc->loop;
	while (c->out_off < c->out.len) {
		ssize_t n = send(c->fd, c->out.data + c->out_off, c->out.len - c->out_off,
				 MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n > 0) {
			c->out_off += (size_t)n;
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			ev_io_start(loop, &c->wio);
			return 0;
		}
		client_close(c, 0); /* reader went away: nothing to report */
		return -1;
	}
	ev_io_stop(loop, &c->wio);
	c->out.len = 0;
	c->out_off = 0;
	if (c->close_after_flush) {
		client_close(c, 1);
		return -1;
	}
	restart_deadline(c);
	return 0;
}

/* Queue an error line (plus the reply terminator) and disconnect once it is sent. */
static void client_fail(stats_client_t *c, const char *msg)
{
	c->out.len = 0;
	c->out_off = 0;
	rw_svc_buf_printf(&c->out, "error %s\n\n", msg);
	c->close_after_flush = 1;
	ev_io_stop(c->srv->svc->loop, &c->rio);
	client_flush(c);
}

static int printable(const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		unsigned char ch = (unsigned char)s[i];
		if ((ch < 0x20 && ch != '\t' && ch != '\r' && ch != '\n') || ch >= 0x7f)
			return 0;
	}
	return 1;
}

/* Answer complete lines, one reply at a time: stop at the first reply that cannot be sent
 * at once (the write watcher resumes here), and read again only when all output is out. */
static void process_input(stats_client_t *c)
{
	struct ev_loop *loop = c->srv->svc->loop;
	for (;;) {
		char *nl = memchr(c->in, '\n', c->in_len);
		if (!nl)
			break;
		size_t len = (size_t)(nl - c->in);
		*nl = '\0';
		if (len && c->in[len - 1] == '\r')
			c->in[len - 1] = '\0';
		int blank = strspn(c->in, " \t") == strlen(c->in);
		if (!blank) {
			rw_svc_stats_answer(c->srv->svc, c->in, &c->out);
			rw_svc_buf_printf(&c->out, "\n");
			if (c->out.oom) {
				client_fail(c, "out of memory");
				return;
			}
		}
		memmove(c->in, nl + 1, c->in_len - len - 1);
		c->in_len -= len + 1;
		if (!blank) {
			if (client_flush(c) < 0)
				return;
			if (c->out.len) {
				ev_io_stop(loop, &c->rio); /* one reply pending at most */
				return;
			}
		}
	}
	if (c->in_len == sizeof(c->in)) {
		client_fail(c, "line too long (limit 4096 bytes), closing");
		return;
	}
	ev_io_start(loop, &c->rio);
}

static void client_read_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	stats_client_t *c = w->data;
	ssize_t n = recv(c->fd, c->in + c->in_len, sizeof(c->in) - c->in_len, MSG_DONTWAIT);
	if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
		return;
	if (n <= 0) {
		client_close(c, 0); /* EOF or reset */
		return;
	}
	if (!printable(c->in + c->in_len, (size_t)n)) {
		client_fail(c, "binary input, closing");
		return;
	}
	c->in_len += (size_t)n;
	process_input(c);
}

static void client_write_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)loop;
	(void)revents;
	stats_client_t *c = w->data;
	if (client_flush(c) < 0 || c->out.len)
		return;
	process_input(c); /* lines that arrived while the reply drained */
}

static void client_deadline_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	stats_client_t *c = w->data;
	rw_dbg("stats: client fd %d timed out", c->fd);
	if (c->close_after_flush || c->out.len) {
		client_close(c, 1); /* it is not reading: do not wait for it again */
		return;
	}
	client_fail(c, "timeout, closing");
}

/* Every slot is taken: the client that has waited longest (half a line, or silence, or not
 * reading its reply) is told and closed now, whatever its deadline says. A prompt client is
 * answered within a loop turn and never waits longest for long. */
static void make_room(rw_svc_stats_t *srv)
{
	stats_client_t *oldest = NULL, *c;
	rw_list_for_each(&srv->clients, c, link)
		if (!oldest || c->wait_since < oldest->wait_since)
			oldest = c;
	if (!oldest)
		return;
	static const char msg[] = "error too many clients: the one waiting longest is closed\n\n";
	ssize_t wr = send(oldest->fd, msg, sizeof(msg) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
	(void)wr;
	client_close(oldest, 1);
}

static void accept_cb(struct ev_loop *loop, ev_io *w, int revents)
{
	(void)revents;
	rw_svc_stats_t *srv = w->data;
	rw_svc_metrics_t *m = &srv->svc->metrics;
	for (int i = 0; i < 16; i++) { /* bounded, to stay fair to the rest of the loop */
		int fd = accept4(srv->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (!rw_listen_pause_on(&srv->accept_pause, errno) && errno != EAGAIN &&
			    errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
				rw_warn("stats: accept on %s: %m", srv->path);
			return;
		}
		if (m->stats_clients >= RW_SVC_STATS_CLIENTS_MAX)
			make_room(srv);
		stats_client_t *c = calloc(1, sizeof(*c));
		if (!c) {
			close(fd);
			m->stats_rejected++;
			rw_svc_metrics_error(m, RW_ERR_NOMEM);
			continue;
		}
		c->srv = srv;
		c->fd = fd;
		ev_io_init(&c->rio, client_read_cb, fd, EV_READ);
		ev_io_init(&c->wio, client_write_cb, fd, EV_WRITE);
		ev_init(&c->deadline, client_deadline_cb);
		c->rio.data = c->wio.data = c->deadline.data = c;
		rw_list_add(&srv->clients, &c->link);
		m->stats_clients++;
		ev_io_start(loop, &c->rio);
		restart_deadline(c);
	}
}

/* ---------------------------------------------------------------------------------------------
 * Listening socket
 * ------------------------------------------------------------------------------------------- */

/* Make room for the socket at path: refuse a live one, remove a stale one, refuse other files. */
static rw_status_t clear_path(const char *path)
{
	struct stat st;
	if (lstat(path, &st) != 0)
		return errno == ENOENT ? RW_OK : RW_ERR_SYS;
	if (!S_ISSOCK(st.st_mode)) {
		rw_err("stats: %s exists and is not a socket; not touching it", path);
		return RW_ERR_EXISTS;
	}
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return RW_ERR_SYS;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	int live = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
	int refused = !live && errno == ECONNREFUSED;
	close(fd);
	if (live) {
		rw_err("stats: %s is in use by a running process (another railwaved?)", path);
		return RW_ERR_EXISTS;
	}
	if (refused && unlink(path) != 0 && errno != ENOENT) {
		rw_err("stats: cannot remove stale socket %s: %m", path);
		return RW_ERR_SYS;
	}
	return RW_OK;
}

rw_status_t rw_svc_stats_start(rw_svc_t *svc, rw_svc_stats_t **stats_p)
{
	const char *path = svc->cfg.stats_socket;
	rw_status_t st;
	*stats_p = NULL;
	if (!path[0]) {
		rw_info("stats: socket disabled");
		return RW_OK;
	}
	rw_svc_stats_t *srv = calloc(1, sizeof(*srv));
	if (!srv)
		return RW_ERR_NOMEM;
	srv->svc = svc;
	rw_list_init(&srv->clients);
	rw_list_init(&srv->zombies);
	snprintf(srv->path, sizeof(srv->path), "%s", path);

	/* The folder as the IPC socket's (mode and ipc_group), when it is missing. */
	if ((st = rw_ipc_socket_dir(path, svc->cfg.ipc_group)) == RW_ERR_INVAL)
		goto free_srv;
	/* Create the parent folder if it is missing (one level, e.g. /run/railwave). */
	char dir[RW_SVC_SOCK_MAX];
	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (slash && slash != dir) {
		*slash = '\0';
		if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
			/* /run/railwave is the default everywhere; systemd, tmpfiles.d and the
			 * launchers create it, a user trying the loopback cluster may not have. */
			rw_err("stats: cannot create %s: %m%s", dir, errno == EACCES ?
			       " (create it once with 'sudo install -d -o $USER /run/railwave', "
			       "or pass --stats-socket and --ipc-socket)" : "");
			st = RW_ERR_SYS;
			goto free_srv;
		}
	}
	if ((st = clear_path(path)))
		goto free_srv;
	srv->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (srv->fd < 0) {
		rw_err("stats: socket: %m");
		st = RW_ERR_SYS;
		goto free_srv;
	}
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (bind(srv->fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		rw_err("stats: bind %s: %m", path);
		st = RW_ERR_SYS;
		goto close_fd;
	}
	struct stat sb;
	if (stat(path, &sb) == 0) {
		srv->dev = sb.st_dev;
		srv->ino = sb.st_ino;
	}
	/* Read-only statistics, but still not for everyone: owner and the IPC group. */
	if (chmod(path, 0660) != 0)
		rw_warn("stats: chmod %s: %m", path);
	if (svc->cfg.ipc_group[0]) {
		struct group gr, *grp = NULL;
		char gbuf[4096];
		if (getgrnam_r(svc->cfg.ipc_group, &gr, gbuf, sizeof(gbuf), &grp) != 0 || !grp) {
			rw_err("stats: group '%s' not found", svc->cfg.ipc_group);
			st = RW_ERR_NOTFOUND;
			goto unlink_path;
		}
		if (chown(path, (uid_t)-1, grp->gr_gid) != 0)
			rw_warn("stats: chown %s to group %s: %m", path, svc->cfg.ipc_group);
	}
	if (listen(srv->fd, 64) != 0) {
		rw_err("stats: listen %s: %m", path);
		st = RW_ERR_SYS;
		goto unlink_path;
	}
	ev_io_init(&srv->accept_io, accept_cb, srv->fd, EV_READ);
	srv->accept_io.data = srv;
	rw_listen_pause_init(&srv->accept_pause, svc->loop, &srv->accept_io, "stats socket");
	ev_idle_init(&srv->reaper, reaper_cb);
	srv->reaper.data = srv;
	ev_io_start(svc->loop, &srv->accept_io);
	rw_info("stats: listening on %s", path);
	*stats_p = srv;
	return RW_OK;

unlink_path:
	unlink(path);
close_fd:
	close(srv->fd);
free_srv:
	free(srv);
	return st;
}

void rw_svc_stats_stop(rw_svc_stats_t *srv)
{
	if (!srv)
		return;
	struct ev_loop *loop = srv->svc->loop;
	while (!rw_list_empty(&srv->clients))
		client_close(rw_container_of(srv->clients.next, stats_client_t, link), 0);
	reaper_cb(loop, &srv->reaper, 0);
	ev_io_stop(loop, &srv->accept_io);
	rw_listen_pause_stop(&srv->accept_pause);
	close(srv->fd);
	struct stat sb;
	if (stat(srv->path, &sb) == 0 && sb.st_dev == srv->dev && sb.st_ino == srv->ino)
		unlink(srv->path); /* only if it is still ours */
	free(srv);
}
