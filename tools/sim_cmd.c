/* `railwave sim`: draw a synthetic MoE phase (tools/synth.c) on an N x R rail-optimized cluster,
 * plan it through the four paths exactly as the daemons would (sched/), and simulate each path's
 * flows under the lossless and/or max-min fabric models (tools/sim.c). Also replays a test-bed
 * benchmark's workloads (`--testbed FILE`) to compare the simulator with measurements.
 * docs/sim.md is the manual; docs/perf/sim.md has the results. */
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/bench.h"
#include "tools/sim.h"
#include "tools/synth.h"
#include "tools/tools.h"

static const char CMD[] = "sim";


typedef struct sim_args {
	uint32_t nodes, rails, gpus, tokens, layer, fan_in, topk;
	const rw_synth_shape_t *shape;
	uint64_t seed;
	double zipf, dirichlet, rail_skew;
	double rail_gbps[RW_MAX_RAILS];
	int n_rail_gbps;
	double gbps;
	int models;        /* bit m: run model m */
	int paths;         /* bit p: run path p */
	int combine;
	rw_sim_opts_t opts;
	const char *anchors, *transport, *testbed;
	int json;
} sim_args_t;

static void usage(FILE *f)
{
	fprintf(f,
		"usage: railwave sim [--nodes N] [--rails R] [--gpus G] [--shape dsv3|glm] [--tokens T]\n"
		"                    [--seed S] [--layer L] [--zipf A] [--dirichlet C] [--rail-skew X]\n"
		"                    [--fan-in K] [--gbps C | --rail-gbps C0,C1,...] [--phase dispatch|combine]\n"
		"                    [--model lossless|maxmin|both] [--hol H] [--eps E] [--no-gate]\n"
		"                    [--paths LIST] [--anchors FILE] [--transport T] [--threads N] [--json]\n"
		"       railwave sim --testbed BENCH.json [--model ...] [--eps E] [--json]\n\n"
		"Simulates one MoE phase on N nodes x R rails (flow-level, docs/sim.md) through the four\n"
		"paths and prints per path: phase time, time / lower bound, busiest NIC, receiver fan-in,\n"
		"and the selector's choice.\n"
		"  --nodes N --rails R --gpus G  cluster (default 32, 8, 8; GPU g on rail g %% R)\n"
		"  --shape S          dsv3 (256 experts, 8 groups / top-4, hidden 7168) or glm (128 experts,\n"
		"                     hidden 4096); top-8, bf16 (default dsv3)\n"
		"  --tokens T         tokens per rank (default 4096)\n"
		"  --seed S --layer L routing seed and layer (default 1, 0); the seed is printed\n"
		"  --zipf A           global expert skew (default 0.8)\n"
		"  --dirichlet C      per-GPU heterogeneity, Dirichlet concentration (default 100; 0 = off)\n"
		"  --rail-skew X      direct source-rail skew in [0,1] (default 0; tools/synth.h)\n"
		"  --fan-in K         fold each source's demand onto K receivers (same bytes per rail;\n"
		"                     every node then has receiver fan-in K); 0 = off (default)\n"
		"  --gbps C           NIC rate in Gbit/s, every rail (default 400)\n"
		"  --rail-gbps LIST   per-rail rates (R values); RailBalance then weights rails by rate\n"
		"  --phase P          dispatch (default) or combine (the reverse flows, combine records)\n"
		"  --model M          lossless (default: PFC back-pressure), maxmin, or both\n"
		"  --hol H            lossless: weight in [0,1] of burst-level head-of-line blocking at a\n"
		"                     port with several senders (1; 0 = fluid congestion spreading only)\n"
		"  --eps E            completion batching window, relative (default 1e-3; 0 = exact)\n"
		"  --no-gate          waved paths without the receiver gate (each node advances on its\n"
		"                     own completions only, as the daemon did before; docs/dataflow.md)\n"
		"  --paths LIST       comma-separated subset of native,rail-only,perm-only,joint\n"
		"  --anchors FILE     anchor table for the selector (default none: Joint)\n"
		"  --transport T      transport in the cluster fingerprint (default verbs)\n"
		"  --testbed FILE     replay the workloads of a `railwave bench` / `railwave demo --json`\n"
		"                     result through the simulator and print sim / measured per path\n"
		"  --threads N        worker threads for drawing the routing and for independent rails\n"
		"                     (default 0 = one per CPU; results do not depend on it)\n"
		"  --json             one JSON object instead of the tables\n");
}

static int parse_list(const char *arg, double *v, int max)
{
	int n = 0;
	char *end;
	const char *p = arg;
	while (*p) {
		if (n == max)
			return -1;
		v[n] = strtod(p, &end);
		if (end == p || !(v[n] > 0) || !isfinite(v[n]))
			return -1;
		n++;
		p = end;
		if (*p == ',')
			p++;
		else if (*p)
			return -1;
	}
	return n;
}

static int parse_paths(const char *arg)
{
	int bits = 0;
	char buf[128];
	snprintf(buf, sizeof(buf), "%s", arg);
	for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		rw_path_t p;
		if (rw_sched_path_parse(tok, &p) != RW_OK)
			return -1;
		bits |= 1 << p;
	}
	return bits;
}

/* ---- one synthetic phase ------------------------------------------------------------------ */

typedef struct sim_phase {
	rw_topo_t topo;
	rw_sim_fabric_t fab;
	uint32_t *counts;      /* N x N x R */
	uint64_t rec, crec;    /* dispatch / combine record bytes on the wire */
	rw_features_t feat;
	double gen_s;          /* seconds spent drawing and counting the routing */
} sim_phase_t;

/* Drawing the routing is per rank and independent of order (tools/synth.h), so nodes are
 * drawn by several threads, each with its own generator: the counts do not depend on it. */
typedef struct gen_job {
	const rw_synth_cfg_t *cfg;
	const rw_topo_t *topo;
	uint32_t *counts;
	atomic_uint next;
	atomic_int failed;
} gen_job_t;

static void *gen_worker(void *arg)
{
	gen_job_t *job = arg;
	const rw_synth_cfg_t *c = job->cfg;
	const uint32_t N = job->topo->nodes, R = job->topo->rails;
	rw_synth_t gen;
	if (rw_synth_init(&gen, c) != RW_OK) {
		atomic_store(&job->failed, 1);
		return NULL;
	}
	int32_t *ids = malloc(sizeof(int32_t) * c->gpus_per_node * c->tokens_per_rank * c->topk);
	if (!ids)
		atomic_store(&job->failed, 1);
	while (ids && !atomic_load(&job->failed)) {
		uint32_t n = atomic_fetch_add(&job->next, 1);
		if (n >= N)
			break;
		rw_rank_tokens_t ranks[RW_MAX_GPUS];
		rw_synth_node(&gen, n, ids, ranks);
		if (rw_sched_count(job->topo, gen.phys_experts, n, ranks, c->gpus_per_node,
				   job->counts + (size_t)n * N * R, NULL) != RW_OK)
			atomic_store(&job->failed, 1);
	}
	free(ids);
	rw_synth_free(&gen);
	return NULL;
}

static uint32_t thread_count(uint32_t want)
{
	if (want)
		return want;
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	return cpus > 0 ? (uint32_t)cpus : 1;
}

static rw_status_t phase_build(const rw_synth_cfg_t *scfg, uint32_t rails, const double *rail_Bps,
			       uint32_t hidden, uint32_t fan_in, uint32_t threads, sim_phase_t *ph)
{
	memset(ph, 0, sizeof(*ph));
	const uint32_t N = scfg->nodes, G = scfg->gpus_per_node, R = rails;
	rw_status_t st = rw_sched_topo_init(&ph->topo, N, G, R);
	if (st != RW_OK)
		return st;
	ph->fab.nodes = N;
	ph->fab.rails = R;
	memcpy(ph->fab.rail_Bps, rail_Bps, sizeof(double) * R);
	rw_sim_topo_weights(&ph->topo, &ph->fab);
	rw_synth_t probe; /* validates the configuration once, before any thread starts */
	if ((st = rw_synth_init(&probe, scfg)) != RW_OK)
		return st;
	rw_synth_free(&probe);
	uint64_t t0 = rw_now_ns();
	ph->counts = calloc((size_t)N * N * R, sizeof(uint32_t));
	uint32_t *folded = fan_in ? calloc((size_t)N * N * R, sizeof(uint32_t)) : NULL;
	st = RW_ERR_NOMEM;
	if (!ph->counts || (fan_in && !folded))
		goto cleanup;
	gen_job_t job = { .cfg = scfg, .topo = &ph->topo, .counts = ph->counts };
	atomic_init(&job.next, 0);
	atomic_init(&job.failed, 0);
	threads = thread_count(threads);
	if (threads > N)
		threads = N;
	pthread_t *tid = calloc(threads, sizeof(pthread_t));
	uint32_t started = 0;
	for (uint32_t i = 1; tid && i < threads; i++)
		if (pthread_create(&tid[started], NULL, gen_worker, &job) == 0)
			started++;
	gen_worker(&job);
	for (uint32_t i = 0; i < started; i++)
		pthread_join(tid[i], NULL);
	free(tid);
	if (atomic_load(&job.failed)) {
		st = RW_ERR_INVAL;
		goto cleanup;
	}
	if (fan_in) {
		rw_sim_fold_fan_in(N, R, fan_in, ph->counts, folded);
		free(ph->counts);
		ph->counts = folded;
		folded = NULL;
	}
	ph->rec = rw_sched_rec_bytes(scfg->topk, hidden, 2);
	ph->crec = rw_sched_crec_bytes(hidden, 2);
	rw_sched_features(&ph->topo, ph->counts, ph->rec, &ph->feat);
	ph->gen_s = (rw_now_ns() - t0) / 1e9;
	st = RW_OK;
cleanup:
	free(folded);
	if (st != RW_OK) {
		free(ph->counts);
		ph->counts = NULL;
	}
	return st;
}

typedef struct sim_cell {
	int ran;
	rw_sim_report_t rep;
	double wall_s;
} sim_cell_t;

static rw_status_t run_cells(const sim_phase_t *ph, const rw_sim_opts_t *base, int models,
			     int paths, int combine, sim_cell_t cells[RW_PATH_COUNT][RW_SIM_MODEL_COUNT])
{
	memset(cells, 0, sizeof(sim_cell_t) * RW_PATH_COUNT * RW_SIM_MODEL_COUNT);
	for (int p = 0; p < RW_PATH_COUNT; p++)
		for (int m = 0; m < RW_SIM_MODEL_COUNT; m++) {
			if (!(paths >> p & 1) || !(models >> m & 1))
				continue;
			rw_sim_opts_t o = *base;
			o.model = (rw_sim_model_t)m;
			uint64_t t0 = rw_now_ns();
			rw_status_t st = rw_sim_path(&ph->topo, &ph->fab, &o, (rw_path_t)p, ph->counts,
						     combine ? ph->crec : ph->rec, combine,
						     &cells[p][m].rep);
			if (st != RW_OK)
				return st;
			cells[p][m].wall_s = (rw_now_ns() - t0) / 1e9;
			cells[p][m].ran = 1;
		}
	return RW_OK;
}

/* ---- the synthetic run -------------------------------------------------------------------- */

static json_t *report_json(const sim_cell_t *c)
{
	const rw_sim_report_t *r = &c->rep;
	return json_pack("{s:f,s:f,s:I,s:i,s:f,s:f}", "time_s", r->run.time, "ratio", r->ratio,
			 "events", (json_int_t)r->run.events, "max_fan_in", (int)r->run.max_fan_in,
			 "bytes", r->run.bytes, "wall_s", c->wall_s);
}

static int run_synthetic(const sim_args_t *a, int argc, char **argv)
{
	rw_synth_cfg_t scfg = {
		.nodes = a->nodes, .gpus_per_node = a->gpus, .n_experts = a->shape->n_experts,
		.topk = a->topk, .n_groups = a->shape->n_groups, .topk_groups = a->shape->topk_groups,
		.tokens_per_rank = a->tokens, .layer = a->layer, .seed = a->seed, .zipf_s = a->zipf,
		.dirichlet = a->dirichlet, .rail_skew = a->rail_skew,
	};
	double bps[RW_MAX_RAILS];
	for (uint32_t r = 0; r < a->rails; r++)
		bps[r] = (a->n_rail_gbps ? a->rail_gbps[r] : a->gbps) * 1e9 / 8;
	sim_phase_t ph;
	rw_status_t st = phase_build(&scfg, a->rails, bps, a->shape->hidden, a->fan_in, a->opts.threads, &ph);
	if (st != RW_OK) {
		fprintf(stderr, "railwave %s: cannot draw the workload: %s\n", CMD, rw_status_str(st));
		return st == RW_ERR_INVAL ? 2 : 1;
	}
	int rc = 1;
	rw_anchor_table_t table;
	memset(&table, 0, sizeof(table));
	char note[320] = "";
	rw_selection_t sel = { .path = RW_PATH_JOINT, .reason = RW_SELECT_NO_TABLE, .case_id = -1 };
	if (a->anchors) {
		if (rw_tool_load_anchors(a->anchors, &table, note, sizeof(note)) == RW_OK) {
			double nic = a->n_rail_gbps ? a->rail_gbps[0] : a->gbps;
			if (rw_sched_anchors_match(&table, &ph.topo, nic, a->transport))
				rw_sched_select(&table, &ph.feat, &sel);
			else
				snprintf(note, sizeof(note), "%s: calibrated for another cluster, not used",
					 a->anchors);
		}
	} else {
		rw_sched_select(NULL, &ph.feat, &sel);
	}
	static sim_cell_t cells[RW_PATH_COUNT][RW_SIM_MODEL_COUNT];
	if ((st = run_cells(&ph, &a->opts, a->models, a->paths, a->combine, cells)) != RW_OK) {
		fprintf(stderr, "railwave %s: simulation failed: %s\n", CMD, rw_status_str(st));
		goto cleanup;
	}
	const uint64_t rec = a->combine ? ph.crec : ph.rec;
	const double lb = rw_sim_lower_bound(&ph.topo, &ph.fab, ph.counts, rec);
	const char *phase = a->combine ? "combine" : "dispatch";
	if (a->json) {
		json_t *out = json_object(), *paths = json_object(), *rates = json_array();
		for (uint32_t r = 0; r < a->rails; r++)
			json_array_append_new(rates, json_real(bps[r] * 8 / 1e9));
		json_t *cmd = json_array();
		for (int i = 0; i < argc; i++)
			json_array_append_new(cmd, json_string(argv[i]));
		json_object_set_new(out, "argv", cmd);
		json_object_set_new(out, "cluster", json_pack("{s:i,s:i,s:i,s:o}", "nodes", (int)a->nodes,
							       "gpus", (int)a->gpus, "rails", (int)a->rails,
							       "rail_gbps", rates));
		json_object_set_new(out, "workload",
				    json_pack("{s:s,s:i,s:i,s:i,s:I,s:i,s:f,s:f,s:f,s:i}", "shape", a->shape->name,
					      "experts", (int)a->shape->n_experts, "topk", (int)a->topk,
					      "tokens", (int)a->tokens, "seed", (json_int_t)a->seed,
					      "layer", (int)a->layer, "zipf", a->zipf, "dirichlet", a->dirichlet,
					      "rail_skew", a->rail_skew, "fan_in_fold", (int)a->fan_in));
		json_object_set_new(out, "phase", json_string(phase));
		json_object_set_new(out, "record_bytes", json_integer((json_int_t)rec));
		json_object_set_new(out, "features",
				    json_pack("{s:f,s:f,s:f,s:[f,f,f],s:i,s:f}", "B", ph.feat.B, "rho_g",
					      ph.feat.rho_g, "kappa", ph.feat.kappa, "f", ph.feat.f[0],
					      ph.feat.f[1], ph.feat.f[2], "max_fan_in", (int)ph.feat.max_fan_in,
					      "busiest_dst_rail_share", ph.feat.busiest_dst_rail_share));
		json_object_set_new(out, "selection",
				    json_pack("{s:s,s:s,s:I,s:s}", "path", rw_sched_path_name(sel.path), "reason",
					      rw_sched_reason_name(sel.reason), "case_id", (json_int_t)sel.case_id,
					      "note", note));
		json_object_set_new(out, "lower_bound_s", json_real(lb));
		json_object_set_new(out, "model_params",
				    json_pack("{s:f,s:f,s:b}", "hol", a->opts.hol, "eps", a->opts.batch_eps,
					      "wave_gate", a->opts.wave_gate));
		json_object_set_new(out, "generate_s", json_real(ph.gen_s));
		for (int p = 0; p < RW_PATH_COUNT; p++) {
			json_t *pj = NULL;
			for (int m = 0; m < RW_SIM_MODEL_COUNT; m++) {
				const sim_cell_t *c = &cells[p][m];
				if (!c->ran)
					continue;
				if (!pj) {
					const rw_sim_nic_t *b = &c->rep.busiest;
					pj = json_pack("{s:{s:i,s:i,s:s,s:f,s:f},s:i}", "busiest", "node", (int)b->node,
						       "rail", (int)b->rail, "dir", b->ingress ? "ingress" : "egress",
						       "bytes", b->bytes, "seconds", b->seconds, "static_fan_in",
						       (int)c->rep.static_fan_in);
				}
				json_object_set_new(pj, rw_sim_model_name((rw_sim_model_t)m), report_json(c));
			}
			if (pj)
				json_object_set_new(paths, rw_sched_path_name((rw_path_t)p), pj);
		}
		json_object_set_new(out, "paths", paths);
		char *text = json_dumps(out, JSON_INDENT(1) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9));
		json_decref(out);
		if (!text)
			goto cleanup;
		puts(text);
		free(text);
		rc = 0;
		goto cleanup;
	}
	printf("railwave sim: %u nodes x %u GPUs x %u rails (%u GPUs), %s, seed %llu\n", a->nodes,
	       a->gpus, a->rails, a->nodes * a->gpus, phase, (unsigned long long)a->seed);
	printf("NIC rate:");
	for (uint32_t r = 0; r < a->rails; r++)
		if (a->n_rail_gbps || r == 0)
			printf(" %g", bps[r] * 8 / 1e9);
	printf(" Gbit/s%s\n", a->n_rail_gbps ? " (per rail)" : " on every NIC");
	printf("workload: %s (%u experts, top-%u%s, hidden %u bf16, %llu B records), %u tokens/rank, "
	       "layer %u, zipf %g, dirichlet %g, rail-skew %g%s\n",
	       a->shape->name, a->shape->n_experts, a->topk, a->shape->n_groups ? ", 8 groups / top-4" : "",
	       a->shape->hidden, (unsigned long long)rec, a->tokens, a->layer, a->zipf, a->dirichlet,
	       a->rail_skew, a->fan_in ? "" : "");
	if (a->fan_in)
		printf("demand folded onto %u receivers per source (same bytes per source and rail)\n", a->fan_in);
	printf("features: B %.3g MB/GPU (f0 %.2f), rho_g %.3f (f1 %.3f), kappa %.3f (f2 %.3f), "
	       "max receiver fan-in %u, busiest dst-rail share %.3f\n",
	       ph.feat.B / 1e6, ph.feat.f[0], ph.feat.rho_g, ph.feat.f[1], ph.feat.kappa, ph.feat.f[2],
	       ph.feat.max_fan_in, ph.feat.busiest_dst_rail_share);
	printf("selector: %s (%s", rw_sched_path_name(sel.path), rw_sched_reason_name(sel.reason));
	if (sel.case_id >= 0)
		printf(", case %lld, distance^2 %.4f", (long long)sel.case_id, sel.distance2);
	printf(")%s%s\n", note[0] ? "; " : "", note);
	printf("lower bound: %.3f ms (busiest NIC after the best per-pair balance / its rate)\n", lb * 1e3);
	printf("models: lossless = PFC back-pressure, a paused NIC stalls all its flows, head-of-line "
	       "weight %g; maxmin = ideal fair sharing; batching eps %g; waved paths %s receiver gate\n\n",
	       a->opts.hol, a->opts.batch_eps, a->opts.wave_gate ? "with the" : "without the");
	printf("%-10s", "path");
	for (int m = 0; m < RW_SIM_MODEL_COUNT; m++)
		if (a->models >> m & 1)
			printf(" %10s ms %7s", rw_sim_model_name((rw_sim_model_t)m), "/ LB");
	printf("  %-22s %6s %6s %8s\n", "busiest NIC", "fan-in", "(seen)", "events");
	for (int p = 0; p < RW_PATH_COUNT; p++) {
		if (!(a->paths >> p & 1))
			continue;
		const sim_cell_t *any = NULL;
		printf("%-10s", rw_sched_path_name((rw_path_t)p));
		for (int m = 0; m < RW_SIM_MODEL_COUNT; m++) {
			const sim_cell_t *c = &cells[p][m];
			if (!c->ran)
				continue;
			any = c;
			printf(" %13.3f %7.3f", c->rep.run.time * 1e3, c->rep.ratio);
		}
		const rw_sim_nic_t *b = &any->rep.busiest;
		char where[64];
		snprintf(where, sizeof(where), "node %u rail %u %s %.1f MB", b->node, b->rail,
			 b->ingress ? "in" : "out", b->bytes / 1e6);
		printf("  %-22s %6u %6u %8llu\n", where, any->rep.static_fan_in, any->rep.run.max_fan_in,
		       (unsigned long long)any->rep.run.events);
	}
	printf("\nfan-in: most sources with demand into one node; (seen): most sending to one node at the "
	       "same time in the simulation.\n");
	rc = 0;
cleanup:
	rw_sched_anchors_free(&table);
	free(ph.counts);
	return rc;
}

/* ---- replaying a test-bed result ---------------------------------------------------------- */

static int wl_from_json(json_t *w, json_t *top, rw_bench_wl_t *wl, double *mbit)
{
	rw_bench_wl_default(wl);
	json_t *v;
#define U32(obj, key, dst) do { if ((v = json_object_get(obj, key)) && json_is_integer(v)) dst = (uint32_t)json_integer_value(v); } while (0)
#define F64(obj, key, dst) do { if ((v = json_object_get(obj, key)) && json_is_number(v)) dst = json_number_value(v); } while (0)
	U32(top, "nodes", wl->nodes);
	U32(top, "rails", wl->rails);
	U32(top, "gpus", wl->gpus);
	U32(w, "nodes", wl->nodes);
	U32(w, "rails", wl->rails);
	U32(w, "gpus", wl->gpus);
	U32(w, "experts", wl->experts);
	U32(w, "topk", wl->topk);
	U32(w, "hidden", wl->hidden);
	U32(w, "tokens", wl->tokens);
	U32(w, "layer", wl->layer);
	F64(w, "zipf", wl->zipf);
	F64(w, "dirichlet", wl->dirichlet);
	F64(w, "rail_skew", wl->rail_skew);
	if ((v = json_object_get(w, "seed")) && json_is_integer(v))
		wl->seed = (uint64_t)json_integer_value(v);
	F64(top, "mbit", *mbit);
	if ((v = json_object_get(top, "nic_gbps")) && json_is_number(v))
		*mbit = json_number_value(v) * 1000;
#undef U32
#undef F64
	return *mbit > 0 ? 0 : -1;
}

static double median_of(json_t *res, const char *path, const char *phase)
{
	json_t *m = json_object_get(json_object_get(json_object_get(res, path), phase), "median");
	return json_is_number(m) ? json_number_value(m) : -1;
}

static int run_testbed(const sim_args_t *a)
{
	json_error_t jerr;
	json_t *doc = json_load_file(a->testbed, 0, &jerr);
	if (!doc) {
		fprintf(stderr, "railwave %s: %s:%d: %s\n", CMD, a->testbed, jerr.line, jerr.text);
		return 1;
	}
	/* `railwave bench` writes {"nodes", "rails", "gpus", "mbit", "points": [{"workload",
	 * "record_bytes", "results": {path: {"dispatch": {"median"}, "combine": ...}}}]};
	 * `railwave demo --json` writes {"describe": {"workload", "nic_gbps", "record_bytes",
	 * "combine_record_bytes"}, "results": {...}}. */
	json_t *points = json_object_get(doc, "points");
	json_t *single = NULL;
	if (!json_is_array(points)) {
		json_t *desc = json_object_get(doc, "describe");
		if (!json_is_object(desc) || !json_is_object(json_object_get(doc, "results"))) {
			fprintf(stderr, "railwave %s: %s: neither a bench result (points) nor a demo result "
				"(describe, results)\n", CMD, a->testbed);
			json_decref(doc);
			return 1;
		}
		single = json_array();
		json_array_append_new(single, json_pack("{s:O,s:O,s:O,s:O,s:O}", "workload",
							 json_object_get(desc, "workload"), "results",
							 json_object_get(doc, "results"), "record_bytes",
							 json_object_get(desc, "record_bytes"), "nic_gbps",
							 json_object_get(desc, "nic_gbps"), "combine_record_bytes",
							 json_object_get(desc, "combine_record_bytes")));
		points = single;
	}
	int rc = 1;
	json_t *out = json_array();
	if (!a->json)
		printf("railwave sim --testbed %s: sim / measured (phase medians) per point and path; "
		       "lower bound = busiest NIC / rate\n", a->testbed);
	for (size_t i = 0; i < json_array_size(points); i++) {
		json_t *pt = json_array_get(points, i), *res = json_object_get(pt, "results");
		rw_bench_wl_t wl;
		double mbit = 0;
		json_t *nic = json_object_get(pt, "nic_gbps");
		if (json_is_number(nic))
			mbit = json_number_value(nic) * 1000;
		if (wl_from_json(json_object_get(pt, "workload"), single ? pt : doc, &wl, &mbit) < 0) {
			fprintf(stderr, "railwave %s: point %zu: no NIC rate (mbit / nic_gbps)\n", CMD, i);
			goto cleanup;
		}
		rw_synth_cfg_t scfg;
		rw_bench_wl_synth(&wl, &scfg);
		double bps[RW_MAX_RAILS];
		for (uint32_t r = 0; r < wl.rails && r < RW_MAX_RAILS; r++)
			bps[r] = mbit * 1e6 / 8;
		sim_phase_t ph;
		rw_status_t st = phase_build(&scfg, wl.rails, bps, wl.hidden, 0, a->opts.threads, &ph);
		if (st != RW_OK) {
			fprintf(stderr, "railwave %s: point %zu: bad workload: %s\n", CMD, i, rw_status_str(st));
			goto cleanup;
		}
		json_t *rb = json_object_get(pt, "record_bytes"), *crb = json_object_get(pt, "combine_record_bytes");
		if (json_is_integer(rb))
			ph.rec = (uint64_t)json_integer_value(rb);
		if (json_is_integer(crb))
			ph.crec = (uint64_t)json_integer_value(crb);
		json_t *pj = json_pack("{s:i,s:O,s:f}", "point", (int)i, "workload",
				       json_object_get(pt, "workload"), "mbit", mbit);
		if (!a->json) {
			json_t *ax = json_object_get(pt, "axis");
			printf("\npoint %zu%s%s: %u nodes x %u rails x %u GPUs, %g Mbit/s, tokens %u, zipf %g, "
			       "dirichlet %g, rail-skew %g, seed %llu (rho_g %.2f, fan-in %u)\n",
			       i, json_is_string(ax) ? " " : "", json_is_string(ax) ? json_string_value(ax) : "",
			       wl.nodes, wl.rails, wl.gpus, mbit, wl.tokens, wl.zipf, wl.dirichlet, wl.rail_skew,
			       (unsigned long long)wl.seed, ph.feat.rho_g, ph.feat.max_fan_in);
			printf("  %-10s %-8s %10s %10s %8s", "path", "phase", "measured s", "LB s", "meas/LB");
			for (int m = 0; m < RW_SIM_MODEL_COUNT; m++)
				if (a->models >> m & 1)
					printf(" %10s s %7s", rw_sim_model_name((rw_sim_model_t)m), "sim/meas");
			printf("\n");
		}
		for (int combine = 0; combine < 2; combine++) {
			static sim_cell_t cells[RW_PATH_COUNT][RW_SIM_MODEL_COUNT];
			const char *phase = combine ? "combine" : "dispatch";
			if ((st = run_cells(&ph, &a->opts, a->models, a->paths, combine, cells)) != RW_OK) {
				fprintf(stderr, "railwave %s: simulation failed: %s\n", CMD, rw_status_str(st));
				free(ph.counts);
				json_decref(pj);
				goto cleanup;
			}
			double lb = rw_sim_lower_bound(&ph.topo, &ph.fab, ph.counts, combine ? ph.crec : ph.rec);
			json_t *phj = json_pack("{s:f}", "lower_bound_s", lb);
			for (int p = 0; p < RW_PATH_COUNT; p++) {
				if (!(a->paths >> p & 1))
					continue;
				const char *name = rw_sched_path_name((rw_path_t)p);
				double meas = median_of(res, name, phase);
				json_t *cj = json_pack("{s:f}", "measured_s", meas);
				if (!a->json)
					printf("  %-10s %-8s %10.4f %10.4f %8.3f", name, phase, meas, lb, meas / lb);
				for (int m = 0; m < RW_SIM_MODEL_COUNT; m++) {
					const sim_cell_t *c = &cells[p][m];
					if (!c->ran)
						continue;
					double t = c->rep.run.time;
					json_object_set_new(cj, rw_sim_model_name((rw_sim_model_t)m),
							    json_pack("{s:f,s:f}", "sim_s", t, "sim_over_measured",
								      meas > 0 ? t / meas : 0));
					if (!a->json)
						printf(" %12.4f %8.3f", t, meas > 0 ? t / meas : 0);
				}
				if (!a->json)
					printf("\n");
				json_object_set_new(phj, name, cj);
			}
			json_object_set_new(pj, phase, phj);
		}
		json_array_append_new(out, pj);
		free(ph.counts);
	}
	if (a->json) {
		json_t *top = json_pack("{s:s,s:o,s:f,s:f}", "testbed", a->testbed, "points", out,
					"hol", a->opts.hol, "eps", a->opts.batch_eps);
		out = NULL;
		char *text = json_dumps(top, JSON_INDENT(1) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9));
		json_decref(top);
		if (!text)
			goto cleanup;
		puts(text);
		free(text);
	}
	rc = 0;
cleanup:
	json_decref(out);
	json_decref(single);
	json_decref(doc);
	return rc;
}

/* ---- options ------------------------------------------------------------------------------ */

enum {
	O_NODES = 0x300, O_RAILS, O_GPUS, O_SHAPE, O_TOKENS, O_SEED, O_LAYER, O_ZIPF, O_DIRICHLET,
	O_RAIL_SKEW, O_FAN_IN, O_GBPS, O_RAIL_GBPS, O_PHASE, O_MODEL, O_HOL, O_EPS, O_NO_GATE, O_PATHS,
	O_ANCHORS, O_TRANSPORT, O_TESTBED, O_JSON, O_THREADS, O_HELP,
};

static int u32_range(const char *opt, const char *arg, uint32_t lo, uint32_t hi, uint32_t *out)
{
	unsigned long long v;
	if (rw_tool_parse_u64(CMD, opt, arg, &v) < 0)
		return -1;
	if (v < lo || v > hi) {
		fprintf(stderr, "railwave %s: %s must be in [%u, %u]\n", CMD, opt, lo, hi);
		return -1;
	}
	*out = (uint32_t)v;
	return 0;
}

static int f64_range(const char *opt, const char *arg, double lo, double hi, double *out)
{
	double v;
	if (rw_tool_parse_double(CMD, opt, arg, &v) < 0)
		return -1;
	if (!(v >= lo && v <= hi)) {
		fprintf(stderr, "railwave %s: %s must be in [%g, %g]\n", CMD, opt, lo, hi);
		return -1;
	}
	*out = v;
	return 0;
}

int rw_tool_sim(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "nodes", required_argument, NULL, O_NODES },
		{ "rails", required_argument, NULL, O_RAILS },
		{ "gpus", required_argument, NULL, O_GPUS },
		{ "shape", required_argument, NULL, O_SHAPE },
		{ "tokens", required_argument, NULL, O_TOKENS },
		{ "seed", required_argument, NULL, O_SEED },
		{ "layer", required_argument, NULL, O_LAYER },
		{ "zipf", required_argument, NULL, O_ZIPF },
		{ "dirichlet", required_argument, NULL, O_DIRICHLET },
		{ "rail-skew", required_argument, NULL, O_RAIL_SKEW },
		{ "fan-in", required_argument, NULL, O_FAN_IN },
		{ "gbps", required_argument, NULL, O_GBPS },
		{ "rail-gbps", required_argument, NULL, O_RAIL_GBPS },
		{ "phase", required_argument, NULL, O_PHASE },
		{ "model", required_argument, NULL, O_MODEL },
		{ "hol", required_argument, NULL, O_HOL },
		{ "eps", required_argument, NULL, O_EPS },
		{ "no-gate", no_argument, NULL, O_NO_GATE },
		{ "paths", required_argument, NULL, O_PATHS },
		{ "anchors", required_argument, NULL, O_ANCHORS },
		{ "transport", required_argument, NULL, O_TRANSPORT },
		{ "testbed", required_argument, NULL, O_TESTBED },
		{ "json", no_argument, NULL, O_JSON },
		{ "threads", required_argument, NULL, O_THREADS },
		{ "help", no_argument, NULL, O_HELP },
		{ NULL, 0, NULL, 0 },
	};
	sim_args_t a = {
		.nodes = 32, .rails = 8, .gpus = 8, .tokens = 4096, .topk = 8, .shape = &rw_synth_shapes[0],
		.seed = 1, .zipf = 0.8, .dirichlet = 100, .gbps = 400,
		.models = 1 << RW_SIM_LOSSLESS, .paths = (1 << RW_PATH_COUNT) - 1, .transport = "verbs",
	};
	rw_sim_opts_default(&a.opts);
	unsigned long long u;
	int c;
	optind = 0;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		int bad = 0;
		switch (c) {
		case O_NODES: bad = u32_range("--nodes", optarg, 2, RW_MAX_NODES, &a.nodes); break;
		case O_RAILS: bad = u32_range("--rails", optarg, 1, RW_MAX_RAILS, &a.rails); break;
		case O_GPUS: bad = u32_range("--gpus", optarg, 1, RW_MAX_GPUS, &a.gpus); break;
		case O_TOKENS: bad = u32_range("--tokens", optarg, 1, 1u << 20, &a.tokens); break;
		case O_LAYER: bad = u32_range("--layer", optarg, 0, 1u << 20, &a.layer); break;
		case O_FAN_IN: bad = u32_range("--fan-in", optarg, 0, RW_MAX_NODES, &a.fan_in); break;
		case O_SEED:
			bad = rw_tool_parse_u64(CMD, "--seed", optarg, &u);
			a.seed = u;
			break;
		case O_SHAPE:
			a.shape = rw_synth_shape(optarg);
			if (!a.shape) {
				fprintf(stderr, "railwave %s: --shape must be dsv3 or glm\n", CMD);
				bad = 1;
			}
			break;
		case O_ZIPF: bad = f64_range("--zipf", optarg, 0, 10, &a.zipf); break;
		case O_DIRICHLET: bad = f64_range("--dirichlet", optarg, 0, 1e9, &a.dirichlet); break;
		case O_RAIL_SKEW: bad = f64_range("--rail-skew", optarg, 0, 1, &a.rail_skew); break;
		case O_GBPS: bad = f64_range("--gbps", optarg, 1e-6, 1e6, &a.gbps); break;
		case O_RAIL_GBPS:
			a.n_rail_gbps = parse_list(optarg, a.rail_gbps, RW_MAX_RAILS);
			if (a.n_rail_gbps <= 0) {
				fprintf(stderr, "railwave %s: --rail-gbps wants positive rates, comma-separated\n", CMD);
				bad = 1;
			}
			break;
		case O_PHASE:
			a.combine = strcmp(optarg, "combine") == 0;
			if (!a.combine && strcmp(optarg, "dispatch") != 0) {
				fprintf(stderr, "railwave %s: --phase must be dispatch or combine\n", CMD);
				bad = 1;
			}
			break;
		case O_MODEL: {
			rw_sim_model_t m;
			if (strcmp(optarg, "both") == 0)
				a.models = (1 << RW_SIM_MODEL_COUNT) - 1;
			else if (rw_sim_model_parse(optarg, &m) == RW_OK)
				a.models = 1 << m;
			else {
				fprintf(stderr, "railwave %s: --model must be lossless, maxmin or both\n", CMD);
				bad = 1;
			}
			break;
		}
		case O_HOL: bad = f64_range("--hol", optarg, 0, 1, &a.opts.hol); break;
		case O_EPS: bad = f64_range("--eps", optarg, 0, 1, &a.opts.batch_eps); break;
		case O_NO_GATE: a.opts.wave_gate = 0; break;
		case O_PATHS:
			a.paths = parse_paths(optarg);
			if (a.paths <= 0) {
				fprintf(stderr, "railwave %s: --paths wants native,rail-only,perm-only,joint\n", CMD);
				bad = 1;
			}
			break;
		case O_ANCHORS: a.anchors = strcmp(optarg, "none") == 0 ? NULL : optarg; break;
		case O_TRANSPORT: a.transport = optarg; break;
		case O_TESTBED: a.testbed = optarg; break;
		case O_JSON: a.json = 1; break;
		case O_THREADS: bad = u32_range("--threads", optarg, 0, 1024, &a.opts.threads); break;
		case 'h':
		case O_HELP:
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
		if (bad)
			return 2;
	}
	if (optind < argc) {
		fprintf(stderr, "railwave %s: unexpected argument '%s'\n", CMD, argv[optind]);
		return 2;
	}
	if (a.n_rail_gbps && (uint32_t)a.n_rail_gbps != a.rails) {
		fprintf(stderr, "railwave %s: --rail-gbps has %d rates for %u rails\n", CMD, a.n_rail_gbps, a.rails);
		return 2;
	}
	if (a.fan_in >= a.nodes) {
		fprintf(stderr, "railwave %s: --fan-in must be below --nodes\n", CMD);
		return 2;
	}
	if (a.testbed)
		return run_testbed(&a);
	return run_synthetic(&a, argc, argv);
}
