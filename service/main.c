/* railwaved: the per-node RailWave daemon. Parses flags, loads the configuration, and runs the
 * libev default loop with, in start order, the stats socket, the Prometheus endpoint, the peer
 * mesh/phase executor and the trainer IPC server. SIGTERM/SIGINT drain, SIGHUP reloads the
 * anchor table. Exit status: 0 clean stop, 1 runtime failure, 2 bad usage or configuration. */
#include "service/exec/exec.h"
#include "service/mover/mover.h"
#include "service/core/svc.h"

#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char **environ;

#define ANCHORS_MAX_BYTES (64u << 20) /* a table is kilobytes; this only stops a wrong path */

/* ---------------------------------------------------------------------------------------------
 * Anchor table (SIGHUP)
 * ------------------------------------------------------------------------------------------- */

/* Read and validate the table at path for this cluster. *table_p is set only on success. */
static rw_status_t anchors_load(const rw_svc_t *svc, const char *path, rw_anchor_table_t **table_p,
				char *why, size_t why_len)
{
	char *text = NULL;
	size_t len = 0;
	rw_status_t st = rw_read_file(path, ANCHORS_MAX_BYTES, &text, &len, why, why_len);
	if (st)
		return st;
	rw_anchor_table_t *table = calloc(1, sizeof(*table));
	if (!table) {
		snprintf(why, why_len, "out of memory");
		st = RW_ERR_NOMEM;
		goto free_text;
	}
	char perr[256] = "";
	st = rw_sched_anchors_parse(text, len, table, perr, sizeof(perr));
	if (st) {
		snprintf(why, why_len, "%s: %s", path, perr);
		free(table);
		goto free_text;
	}
	const char *transport = rw_svc_transport_name(svc->cfg.transport);
	if (!rw_sched_anchors_match(table, &svc->topo, svc->cfg.nic_gbps, transport)) {
		snprintf(why, why_len, "%s: calibrated for another cluster (N=%u G=%u R=%u %g Gbit/s "
			 "%s; this one is N=%u G=%u R=%u %g Gbit/s %s)", path,
			 table->fingerprint.nodes, table->fingerprint.gpus_per_node,
			 table->fingerprint.rails, table->fingerprint.nic_gbps,
			 table->fingerprint.transport, svc->topo.nodes, svc->topo.gpus_per_node,
			 svc->topo.rails, svc->cfg.nic_gbps, transport);
		rw_sched_anchors_free(table);
		free(table);
		st = RW_ERR_PARSE;
		goto free_text;
	}
	*table_p = table;
free_text:
	free(text);
	return st;
}

static void anchors_free(rw_anchor_table_t *table)
{
	if (!table)
		return;
	rw_sched_anchors_free(table);
	free(table);
}

rw_status_t rw_svc_anchors_reload(rw_svc_t *svc)
{
	const char *path = svc->cfg.anchors;
	if (!path[0]) {
		anchors_free(svc->anchors);
		svc->anchors = NULL;
		svc->metrics.anchor_reloads++;
		rw_info("anchors: no table configured; the selector uses Joint");
		return RW_OK;
	}
	char why[512] = "";
	rw_anchor_table_t *table = NULL;
	rw_status_t st = anchors_load(svc, path, &table, why, sizeof(why));
	if (st) {
		svc->metrics.anchor_reload_failures++;
		rw_svc_metrics_error(&svc->metrics, st);
		rw_err("anchors: reload refused, keeping the %s: %s",
		       svc->anchors ? "current table" : "Joint default (no table)", why);
		return st;
	}
	anchors_free(svc->anchors);
	svc->anchors = table;
	svc->metrics.anchor_reloads++;
	rw_info("anchors: loaded %u anchors from %s (fingerprint %ux%ux%u@%ggbps/%s, "
		"max_size_ratio %g, shape_tolerance %g)", table->n_anchors, path,
		table->fingerprint.nodes, table->fingerprint.gpus_per_node, table->fingerprint.rails,
		table->fingerprint.nic_gbps, table->fingerprint.transport, table->max_size_ratio,
		table->shape_tolerance);
	return RW_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Signals and timers
 * ------------------------------------------------------------------------------------------- */

static void drain_timeout_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_t *svc = w->data;
	rw_warn("shutdown: drain did not finish within %u ms; stopping now",
		svc->cfg.phase_timeout_ms + 1000);
	rw_svc_stop(svc);
}

static void term_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_t *svc = w->data;
	if (svc->draining) {
		rw_warn("shutdown: signal %d again; stopping without waiting", w->signum);
		rw_svc_stop(svc);
		return;
	}
	rw_info("shutdown: signal %d, draining in-flight phases", w->signum);
	svc->draining = 1;
	rw_svc_health_stopping(svc); /* deploy: STOPPING=1, /ready fails (service/core/health.h) */
	ev_timer_set(&svc->drain_timer, (svc->cfg.phase_timeout_ms + 1000) / 1e3, 0.);
	ev_timer_start(svc->loop, &svc->drain_timer);
	rw_svc_exec_drain(svc->exec);
}

static void hup_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_t *svc = w->data;
	rw_info("SIGHUP: reloading the anchor table");
	rw_svc_anchors_reload(svc);
}

static void publish_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)revents;
	rw_svc_t *svc = w->data;
	svc->metrics.rank_pages = rw_svc_rank_pages(svc);
	rw_svc_metrics_publish(&svc->pub, &svc->metrics);
}

/* ---------------------------------------------------------------------------------------------
 * Command line
 * ------------------------------------------------------------------------------------------- */

enum { OPT_DUMP = 1000, OPT_HELP, OPT_VERSION, OPT_CONFIG, OPT_FIRST_FIELD };

static void usage(FILE *out)
{
	fprintf(out, "usage: railwaved [options]\n"
		"RailWave per-node daemon: MoE dispatch/combine over every rail (docs/service.md).\n\n"
		"  --dump-config                 print the effective configuration as JSON and exit\n"
		"  -h, --help                    this text\n"
		"  -V, --version                 print the version and exit\n");
	for (const rw_svc_option_t *o = rw_svc_options; o->key; o++) {
		char lhs[64];
		snprintf(lhs, sizeof(lhs), "--%s %s", o->flag, o->arg);
		if (strlen(lhs) > 29) /* deploy: a long placeholder gets its own line */
			fprintf(out, "  %s\n  %-29s %s [%s]\n", lhs, "", o->help, o->env);
		else
			fprintf(out, "  %-29s %s [%s]\n", lhs, o->help, o->env);
	}
	fprintf(out, "\nPrecedence: flags > environment > file > defaults. Exit status: 0 stopped "
		"cleanly, 1 runtime failure, 2 bad usage or configuration.\n");
}

/* The exit status of a failed start (docs/service.md "Flags and environment"): 2 for what a restart cannot
 * fix, because the configuration names something this host does not have or someone else holds
 * (an address in use or not on this host, no such RDMA device, a key file that is missing,
 * unreadable, too open or not a key, a socket path another daemon serves); 1 for the rest
 * (memory, an unexpected system call failure), which a restart may cure. */
static int start_exit_status(rw_status_t st)
{
	switch (st) {
	case RW_ERR_INVAL:
	case RW_ERR_PARSE:
	case RW_ERR_NOTFOUND:
	case RW_ERR_EXISTS:
	case RW_ERR_UNSUPPORTED:
		return 2;
	default:
		return 1;
	}
}

int main(int argc, char **argv)
{
	size_t n_opts = 0;
	while (rw_svc_options[n_opts].key)
		n_opts++;
	struct option *longopts = calloc(n_opts + 4, sizeof(*longopts));
	rw_svc_kv_t *kv = calloc(n_opts + 1, sizeof(*kv));
	const char *config_path = NULL;
	int dump = 0, rc = 2;
	rw_svc_t svc;
	memset(&svc, 0, sizeof(svc));
	if (!longopts || !kv) {
		rw_log_early_error("railwaved: out of memory");
		goto free_args;
	}
	size_t k = 0;
	longopts[k++] = (struct option){"dump-config", no_argument, NULL, OPT_DUMP};
	longopts[k++] = (struct option){"help", no_argument, NULL, OPT_HELP};
	longopts[k++] = (struct option){"version", no_argument, NULL, OPT_VERSION};
	for (size_t i = 0; i < n_opts; i++)
		longopts[k++] = (struct option){rw_svc_options[i].flag, required_argument, NULL,
						!strcmp(rw_svc_options[i].key, "config") ? OPT_CONFIG :
						OPT_FIRST_FIELD + (int)i};
	size_t n_kv = 0;
	int c;
	opterr = 0; /* deploy: we name the bad flag ourselves, below */
	while ((c = getopt_long(argc, argv, ":hV", longopts, NULL)) != -1) {
		if (c == OPT_DUMP) {
			dump = 1;
		} else if (c == OPT_HELP || c == 'h') {
			usage(stdout);
			rc = 0;
			goto free_args;
		} else if (c == OPT_VERSION || c == 'V') {
			printf("railwaved %s\n", RW_VERSION);
			rc = 0;
			goto free_args;
		} else if (c == OPT_CONFIG) {
			config_path = optarg;
		} else if (c >= OPT_FIRST_FIELD && c < OPT_FIRST_FIELD + (int)n_opts) {
			const char *key = rw_svc_options[c - OPT_FIRST_FIELD].key;
			size_t j = 0; /* a repeated flag replaces the earlier value */
			while (j < n_kv && strcmp(kv[j].key, key))
				j++;
			kv[j] = (rw_svc_kv_t){key, optarg};
			if (j == n_kv)
				n_kv++;
		} else {
			/* deploy: one line naming the flag instead of the whole usage */
			const char *bad = argv[optind - 1];
			if (c == ':')
				rw_log_early_error("railwaved: %s needs a value (see --help)", bad);
			else
				rw_log_early_error("railwaved: unknown option %s (see --help)", bad);
			goto free_args;
		}
	}
	if (optind < argc) {
		rw_log_early_error("railwaved: unexpected argument '%s' (see --help)", argv[optind]);
		goto free_args;
	}

	char err[512];
	rw_status_t st = rw_svc_config_load(config_path, environ, kv, n_kv, &svc.cfg, err,
					    sizeof(err));
	if (st) {
		rw_log_early_error("railwaved: configuration: %s", err);
		goto free_args;
	}
	rw_svc_config_topo(&svc.cfg, &svc.topo);
	if (dump) {
		/* The anchor table is part of what the daemon would run with: opened and checked
		 * against this cluster as at start, so a bad one is found before a restart is. */
		if (svc.cfg.anchors[0]) {
			char why[512] = "";
			rw_anchor_table_t *table = NULL;
			st = anchors_load(&svc, svc.cfg.anchors, &table, why, sizeof(why));
			anchors_free(table);
			if (st == RW_ERR_NOTFOUND) {
				rw_log_early_error("railwaved: anchors: %s: no such file; the daemon would "
						   "run without a table (the selector says Joint)",
						   svc.cfg.anchors);
			} else if (st) {
				rw_log_early_error("railwaved: configuration: anchors: %s", why);
				goto free_config;
			}
		}
		char *text = rw_svc_config_dump(&svc.cfg);
		if (text) {
			printf("%s\n", text);
			free(text);
			rc = 0;
		} else {
			rw_log_early_error("railwaved: out of memory");
		}
		goto free_config;
	}

	rc = 1;
	char ident[96];
	snprintf(ident, sizeof(ident), "railwaved node=%s", svc.cfg.nodes[svc.cfg.me].name);
	rw_log_set_ident(ident);
	rw_log_set_level(svc.cfg.log_level);
	rw_svc_gpu_stall_set(svc.cfg.gpu_stall_ms); /* the movers' bound on a GPU's progress */
	if (rw_svc_metrics_init(&svc.metrics, svc.cfg.rails, svc.cfg.n_nodes) ||
	    rw_svc_metrics_pub_init(&svc.pub, svc.cfg.rails, svc.cfg.n_nodes)) {
		rw_err("out of memory");
		goto free_metrics;
	}
	svc.metrics.peer[svc.cfg.me].state = RW_SVC_PEER_SELF;
	if (svc.cfg.anchors[0]) {
		char why[512] = "";
		st = anchors_load(&svc, svc.cfg.anchors, &svc.anchors, why, sizeof(why));
		if (st == RW_ERR_NOTFOUND) {
			/* A first deploy has no table yet (calibration needs running daemons): no table
			 * means Joint, as with "anchors": "". SIGHUP loads it once it is there. */
			rw_warn("anchors: %s does not exist: running without a table, the selector uses "
				"Joint (railwave calibrate writes one; then systemctl reload railwaved or "
				"SIGHUP)", svc.cfg.anchors);
		} else if (st) {
			rw_err("anchors: %s", why);
			rc = 2;
			goto free_metrics;
		} else {
			rw_info("anchors: loaded %u anchors from %s", svc.anchors->n_anchors,
				svc.cfg.anchors);
		}
	}

	struct sigaction sa = {.sa_handler = SIG_IGN};
	sigaction(SIGPIPE, &sa, NULL);
	svc.loop = ev_default_loop(EVFLAG_AUTO);
	if (!svc.loop) {
		rw_err("cannot initialise the event loop");
		goto free_anchors;
	}
	ev_signal_init(&svc.sig_term, term_cb, SIGTERM);
	ev_signal_init(&svc.sig_int, term_cb, SIGINT);
	ev_signal_init(&svc.sig_hup, hup_cb, SIGHUP);
	ev_timer_init(&svc.publish_timer, publish_cb, 0., RW_SVC_METRICS_PUBLISH_MS / 1e3);
	ev_init(&svc.drain_timer, drain_timeout_cb);
	svc.sig_term.data = svc.sig_int.data = svc.sig_hup.data = &svc;
	svc.publish_timer.data = svc.drain_timer.data = &svc;
	ev_signal_start(svc.loop, &svc.sig_term);
	ev_signal_start(svc.loop, &svc.sig_int);
	ev_signal_start(svc.loop, &svc.sig_hup);
	ev_timer_start(svc.loop, &svc.publish_timer);

	rw_info("starting: cluster %s, node %u of %u, %u rails, %u GPUs, transport %s, path %s",
		svc.cfg.cluster, svc.cfg.me, svc.cfg.n_nodes, svc.cfg.rails, svc.cfg.gpus_per_node,
		rw_svc_transport_name(svc.cfg.transport),
		svc.cfg.force_path == RW_SVC_PATH_AUTO ? "auto" :
		rw_sched_path_name((rw_path_t)svc.cfg.force_path));
	if ((st = rw_svc_stats_start(&svc, &svc.stats))) {
		rc = start_exit_status(st);
		goto stop_watchers;
	}
	rw_svc_metrics_publish(&svc.pub, &svc.metrics);
	if ((st = rw_svc_http_start(&svc, &svc.http))) {
		rc = start_exit_status(st);
		goto stop_stats;
	}
	/* The data movers, tried in this order for every pair: the rank mover takes pairs of page
	 * ranks, the CUDA mover CUDA buffers, the host mover the rest. */
	static const rw_svc_mover_ops_t *const movers[] = { &rw_svc_mover_rank, &rw_svc_mover_cuda,
							    &rw_svc_mover_host };
	rw_svc_exec_hooks_t hooks;
	rw_svc_exec_hooks_from_env(environ, &hooks);
	if ((st = rw_svc_exec_create(&svc, movers, RW_ARRAY_SIZE(movers), &hooks, &svc.exec))) {
		rw_err("executor: start failed: %s", rw_status_str(st));
		rc = start_exit_status(st);
		goto stop_http;
	}
	if ((st = rw_svc_exec_ipc_start(svc.exec))) {
		rw_err("ipc: start failed: %s", rw_status_str(st));
		rc = start_exit_status(st);
		goto stop_exec;
	}
	rw_info("running");
	/* ---- deploy: health tick, READY=1, watchdog (service/core/health.h, docs/service.md) ---- */
	rw_svc_health_start(&svc);
	/* ---- end deploy ---- */
	ev_run(svc.loop, 0);
	rc = 0;
	rw_info("stopping");

	rw_svc_exec_ipc_stop(svc.exec); /* may wait for the GPUs, the loop turning */
	rw_svc_health_stop(&svc); /* after: the watchdog is fed meanwhile; idempotent */
stop_exec:
	rw_svc_exec_destroy(svc.exec);
	svc.exec = NULL;
stop_http:
	rw_svc_http_stop(svc.http);
stop_stats:
	rw_svc_stats_stop(svc.stats);
stop_watchers:
	ev_timer_stop(svc.loop, &svc.drain_timer);
	ev_timer_stop(svc.loop, &svc.publish_timer);
	ev_signal_stop(svc.loop, &svc.sig_hup);
	ev_signal_stop(svc.loop, &svc.sig_int);
	ev_signal_stop(svc.loop, &svc.sig_term);
	ev_loop_destroy(svc.loop);
free_anchors:
	anchors_free(svc.anchors);
free_metrics:
	rw_svc_metrics_pub_fini(&svc.pub);
	rw_svc_metrics_fini(&svc.metrics);
free_config:
	rw_svc_config_free(&svc.cfg);
free_args:
	free(kv);
	free(longopts);
	return rc;
}
