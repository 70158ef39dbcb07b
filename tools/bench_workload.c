/* `railwave bench-workload`: the planner's view of one test-bed workload, as JSON, for the
 * `railwave demo` / `railwave bench` orchestrator (tools/bench_bed.py), and the calibration of
 * an anchor table from that run's measured samples (docs/selector.md §2). Everything numeric the
 * demo and the bench print about a workload comes from here, i.e. from sched/:
 *
 *   describe  counts, features (docs/algorithms.md §5), the selector's verdict for a table, per
 *             path every NIC's egress/ingress records and the busiest one, the lower bound
 *             (docs/architecture.md §6), the record sizes the daemon puts on the wire, the MPI_Alltoallv byte matrix of the same phase, and
 *             the receive region the daemons need for it;
 *   calibrate read {"fingerprint", "max_size_ratio", "shape_tolerance", "cv_bound", "margin",
 *             "cases": [{"case_id", "features": [f0,f1,f2], "samples": {path: [seconds...]}}]}
 *             on stdin and print the anchor table (rw_sched_anchor_decide per case). */
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/bench.h"
#include "tools/tools.h"

static const char CMD[] = "bench-workload";

static void usage(FILE *f)
{
	fprintf(f,
		"usage: railwave bench-workload describe [--nic-gbps G] [--transport T] [--anchors FILE]\n"
		"                                         [workload]\n"
		"       railwave bench-workload calibrate < cases.json > anchors.json\n\n"
		"describe prints, as one JSON object, what sched/ says about the workload: counts,\n"
		"features, the selector's verdict, per-path NIC loads, the lower bound, wire record\n"
		"sizes, the MPI_Alltoallv byte matrix and the receive region size the daemons need.\n\n%s",
		rw_bench_wl_usage);
}

static json_t *u64_array(const uint64_t *v, size_t n)
{
	json_t *a = json_array();
	for (size_t i = 0; i < n; i++)
		json_array_append_new(a, json_integer((json_int_t)v[i]));
	return a;
}

static int describe(int argc, char **argv)
{
	rw_bench_wl_t wl;
	rw_bench_wl_default(&wl);
	double gbps = 0.05;
	const char *anchors_path = NULL, *transport = "tcp";
	struct option opts[RW_BENCH_WL_NOPTS + 5];
	memcpy(opts, rw_bench_wl_options, sizeof(struct option) * RW_BENCH_WL_NOPTS);
	opts[RW_BENCH_WL_NOPTS] = (struct option){ "nic-gbps", required_argument, NULL, 'g' };
	opts[RW_BENCH_WL_NOPTS + 1] = (struct option){ "anchors", required_argument, NULL, 'a' };
	opts[RW_BENCH_WL_NOPTS + 2] = (struct option){ "help", no_argument, NULL, 'h' };
	opts[RW_BENCH_WL_NOPTS + 3] = (struct option){ "transport", required_argument, NULL, 't' };
	opts[RW_BENCH_WL_NOPTS + 4] = (struct option){ NULL, 0, NULL, 0 };
	optind = 0;
	int c;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (c == 'g') {
			if (rw_tool_parse_double(CMD, "--nic-gbps", optarg, &gbps) < 0 || !(gbps > 0))
				return 2;
		} else if (c == 'a') {
			anchors_path = optarg;
		} else if (c == 't') {
			transport = optarg; /* the table's fingerprint must name it (default tcp) */
		} else if (c == 'h') {
			usage(stdout);
			return 0;
		} else if (rw_bench_wl_opt(CMD, c, optarg, &wl) != 0) {
			return 2;
		}
	}
	rw_topo_t topo;
	if (rw_sched_topo_init(&topo, wl.nodes, wl.gpus, wl.rails) != RW_OK) {
		fprintf(stderr, "railwave %s: bad cluster shape\n", CMD);
		return 2;
	}
	rw_synth_cfg_t scfg;
	rw_bench_wl_synth(&wl, &scfg);
	rw_synth_t gen;
	if (rw_synth_init(&gen, &scfg) != RW_OK) {
		fprintf(stderr, "railwave %s: bad workload (experts, topk, knobs)\n", CMD);
		return 2;
	}
	const uint32_t N = wl.nodes, G = wl.gpus, R = wl.rails, W = N * G, T = wl.tokens, K = wl.topk;
	const uint32_t E = gen.phys_experts;
	const uint64_t rec = rw_sched_rec_bytes(K, wl.hidden, 2);
	const uint64_t crec = rw_sched_crec_bytes(wl.hidden, 2);
	int rc = 1;
	json_t *out = NULL;
	rw_anchor_table_t table;
	memset(&table, 0, sizeof(table));
	int have_table = 0;
	uint32_t *counts = calloc((size_t)N * N * R, sizeof(uint32_t));
	int32_t *ids = malloc((size_t)T * K * sizeof(int32_t));
	uint64_t *mpi = calloc((size_t)W * W, sizeof(uint64_t));
	uint32_t *row = calloc((size_t)N * R, sizeof(uint32_t));
	rw_pair_plan_t *pairs = calloc(N, sizeof(rw_pair_plan_t));
	uint64_t *eg = calloc((size_t)N * R, sizeof(uint64_t)), *ig = calloc((size_t)N * R, sizeof(uint64_t));
	if (!counts || !ids || !mpi || !row || !pairs || !eg || !ig) {
		fprintf(stderr, "railwave %s: out of memory\n", CMD);
		goto cleanup;
	}
	/* Counts one rank at a time: the node's row is the sum of its ranks' rows (records are
	 * per (token, destination node), and a token belongs to one rank). The MPI matrix sends the
	 * same records, rec bytes each, from rank (a, g) to rank (b, g): GPU g's peer on node b,
	 * as DeepEP's rail-aligned first hop does. */
	for (uint32_t q = 0; q < W; q++) {
		uint32_t node = q / G, gpu = q % G;
		rw_synth_rank(&gen, node, gpu, ids);
		rw_rank_tokens_t rt = { .local_gpu = gpu, .n_tokens = T, .topk = K, .expert_ids = ids };
		if (rw_sched_count(&topo, E, node, &rt, 1, row, NULL) != RW_OK) {
			fprintf(stderr, "railwave %s: counting failed\n", CMD);
			goto cleanup;
		}
		for (uint32_t d = 0; d < N; d++) {
			uint64_t recs = 0;
			for (uint32_t r = 0; r < R; r++) {
				counts[((size_t)node * N + d) * R + r] += row[d * R + r];
				recs += row[d * R + r];
			}
			if (d != node)
				mpi[(size_t)q * W + d * G + gpu] += recs * rec;
		}
	}
	rw_features_t feat;
	rw_sched_features(&topo, counts, rec, &feat);
	rw_selection_t sel = { .path = RW_PATH_JOINT, .reason = RW_SELECT_NO_TABLE, .case_id = -1 };
	char err[256] = "";
	if (anchors_path) {
		if (rw_tool_load_anchors(anchors_path, &table, err, sizeof(err)) == RW_OK) {
			have_table = 1;
			if (rw_sched_anchors_match(&table, &topo, gbps, transport))
				rw_sched_select(&table, &feat, &sel);
			else
				snprintf(err, sizeof(err), "%s: calibrated for another cluster", anchors_path);
		}
	} else {
		rw_sched_select(NULL, &feat, &sel);
	}
	const uint64_t lb = rw_sched_lower_bound(&topo, counts);
	const double bps = gbps * 1e9 / 8.0;
	out = json_object();
	json_t *w = json_object();
	json_object_set_new(w, "nodes", json_integer(N));
	json_object_set_new(w, "gpus", json_integer(G));
	json_object_set_new(w, "rails", json_integer(R));
	json_object_set_new(w, "experts", json_integer(wl.experts));
	json_object_set_new(w, "expert_slots", json_integer(E));
	json_object_set_new(w, "topk", json_integer(K));
	json_object_set_new(w, "hidden", json_integer(wl.hidden));
	json_object_set_new(w, "dtype", json_string("bf16"));
	json_object_set_new(w, "tokens", json_integer(T));
	json_object_set_new(w, "zipf", json_real(wl.zipf));
	json_object_set_new(w, "dirichlet", json_real(wl.dirichlet));
	json_object_set_new(w, "rail_skew", json_real(wl.rail_skew));
	json_object_set_new(w, "seed", json_integer((json_int_t)wl.seed));
	json_object_set_new(w, "layer", json_integer(wl.layer));
	json_object_set_new(out, "workload", w);
	json_object_set_new(out, "nic_gbps", json_real(gbps));
	json_object_set_new(out, "record_bytes", json_integer((json_int_t)rec));
	json_object_set_new(out, "combine_record_bytes", json_integer((json_int_t)crec));
	json_t *ca = json_array();
	for (size_t i = 0; i < (size_t)N * N * R; i++)
		json_array_append_new(ca, json_integer(counts[i]));
	json_object_set_new(out, "counts", ca);
	json_t *f = json_object();
	json_object_set_new(f, "remote_bytes", json_integer((json_int_t)feat.remote_bytes));
	json_object_set_new(f, "B", json_real(feat.B));
	json_object_set_new(f, "rho_g", json_real(feat.rho_g));
	json_object_set_new(f, "kappa", json_real(feat.kappa));
	json_object_set_new(f, "f", json_pack("[f,f,f]", feat.f[0], feat.f[1], feat.f[2]));
	json_object_set_new(f, "max_fan_in", json_integer(feat.max_fan_in));
	json_object_set_new(f, "busiest_dst_rail_share", json_real(feat.busiest_dst_rail_share));
	json_object_set_new(out, "features", f);
	json_object_set_new(out, "selection",
			    json_pack("{s:s,s:s,s:I,s:f,s:s}", "path", rw_sched_path_name(sel.path),
				      "reason", rw_sched_reason_name(sel.reason), "case_id",
				      (json_int_t)sel.case_id, "distance2", sel.distance2, "table_error", err));
	json_object_set_new(out, "lower_bound_records", json_integer((json_int_t)lb));
	json_object_set_new(out, "lower_bound_s", json_pack("{s:f,s:f}", "dispatch", (double)(lb * rec) / bps,
							     "combine", (double)(lb * crec) / bps));
	json_t *paths = json_object();
	uint64_t worst = 0;
	for (int p = 0; p < RW_PATH_COUNT; p++) {
		memset(eg, 0, sizeof(uint64_t) * N * R);
		memset(ig, 0, sizeof(uint64_t) * N * R);
		rw_phase_plan_t plan = { .pairs = pairs };
		for (uint32_t s = 0; s < N; s++) {
			if (rw_sched_plan_build(&topo, (rw_path_t)p, s, counts, &plan) != RW_OK) {
				fprintf(stderr, "railwave %s: planning failed\n", CMD);
				goto cleanup;
			}
			for (uint32_t d = 0; d < N; d++)
				for (uint32_t r = 0; r < R && d != s; r++) {
					eg[s * R + r] += pairs[d].quota[r];
					ig[d * R + r] += pairs[d].quota[r];
				}
		}
		uint64_t busiest = rw_sched_busiest_nic(&topo, (rw_path_t)p, counts);
		worst = busiest > worst ? busiest : worst;
		json_t *pj = json_object();
		json_object_set_new(pj, "busiest_records", json_integer((json_int_t)busiest));
		json_object_set_new(pj, "busiest_bytes", json_integer((json_int_t)(busiest * rec)));
		json_object_set_new(pj, "bound_s", json_real((double)(busiest * rec) / bps));
		json_object_set_new(pj, "waves", json_integer(rw_path_waved((rw_path_t)p) && N > 2 ? N - 1 : 1));
		json_object_set_new(pj, "egress_records", u64_array(eg, (size_t)N * R));
		json_object_set_new(pj, "ingress_records", u64_array(ig, (size_t)N * R));
		json_object_set_new(paths, rw_sched_path_name((rw_path_t)p), pj);
	}
	json_object_set_new(out, "paths", paths);
	json_object_set_new(out, "mpi_matrix", u64_array(mpi, (size_t)W * W));
	/* railwaved gives each (slot, kind, direction) sub-area recv_region_mib * 2^20 / (4 R) bytes
	 * (service/exec/exec.c); the busiest NIC of the worst path must fit one, with 10% to spare. */
	uint64_t need = worst * (rec > crec ? rec : crec) * 4ull * R;
	json_object_set_new(out, "recv_region_mib", json_integer((json_int_t)(need * 11 / 10 / (1u << 20) + 2)));
	if (json_dumpf(out, stdout, JSON_COMPACT) != 0) {
		fprintf(stderr, "railwave %s: write failed\n", CMD);
		goto cleanup;
	}
	fputc('\n', stdout);
	(void)have_table;
	rc = 0;
cleanup:
	json_decref(out);
	if (have_table)
		rw_sched_anchors_free(&table);
	rw_synth_free(&gen);
	free(counts);
	free(ids);
	free(mpi);
	free(row);
	free(pairs);
	free(eg);
	free(ig);
	return rc;
}

static int bad(const char *what)
{
	fprintf(stderr, "railwave %s calibrate: %s\n", CMD, what);
	return 2;
}

static int calibrate(void)
{
	json_error_t jerr;
	json_t *in = json_loadf(stdin, 0, &jerr);
	if (!in)
		return bad(jerr.text);
	int rc = 2;
	rw_anchor_table_t t;
	memset(&t, 0, sizeof(t));
	char *text = NULL;
	const char *transport = "tcp";
	json_int_t nodes = 0, gpus = 0, rails = 0;
	double gbps = 0, cv = 0.10, margin = 0.05;
	json_t *cases = NULL;
	if (json_unpack_ex(in, &jerr, 0, "{s:{s:I,s:I,s:I,s:F,s?s},s:F,s:F,s?F,s?F,s:o}", "fingerprint",
			   "nodes", &nodes, "gpus_per_node", &gpus, "rails", &rails, "nic_gbps", &gbps,
			   "transport", &transport, "max_size_ratio", &t.max_size_ratio, "shape_tolerance",
			   &t.shape_tolerance, "cv_bound", &cv, "margin", &margin, "cases", &cases) != 0 ||
	    !json_is_array(cases)) {
		rc = bad(jerr.text);
		goto cleanup;
	}
	t.schema_version = RW_ANCHOR_SCHEMA;
	t.fingerprint.nodes = (uint32_t)nodes;
	t.fingerprint.gpus_per_node = (uint32_t)gpus;
	t.fingerprint.rails = (uint32_t)rails;
	t.fingerprint.nic_gbps = gbps;
	snprintf(t.fingerprint.transport, sizeof(t.fingerprint.transport), "%s", transport);
	t.n_anchors = (uint32_t)json_array_size(cases);
	t.anchors = calloc(t.n_anchors + 1, sizeof(rw_anchor_t));
	if (!t.anchors) {
		rc = bad("out of memory");
		goto cleanup;
	}
	rw_calib_rule_t rule = { .cv_bound = cv, .margin = margin };
	for (uint32_t i = 0; i < t.n_anchors; i++) {
		json_t *cs = json_array_get(cases, i), *samples = NULL;
		json_int_t id = 0;
		double f0, f1, f2;
		if (json_unpack_ex(cs, &jerr, 0, "{s:I,s:[FFF],s:o}", "case_id", &id, "features", &f0, &f1,
				   &f2, "samples", &samples) != 0) {
			rc = bad(jerr.text);
			goto cleanup;
		}
		rw_anchor_t *a = &t.anchors[i];
		a->case_id = (uint32_t)id;
		a->feat[0] = f0;
		a->feat[1] = f1;
		a->feat[2] = f2;
		double *s[RW_PATH_COUNT] = { 0 };
		uint32_t n[RW_PATH_COUNT] = { 0 };
		int ok = 1;
		for (int p = 0; p < RW_PATH_COUNT; p++) {
			json_t *arr = json_object_get(samples, rw_sched_path_name((rw_path_t)p));
			n[p] = (uint32_t)json_array_size(arr);
			s[p] = calloc(n[p] + 1, sizeof(double));
			ok &= s[p] != NULL && n[p] > 0;
			for (uint32_t j = 0; s[p] && j < n[p]; j++)
				s[p][j] = json_number_value(json_array_get(arr, j));
		}
		if (ok)
			rw_sched_anchor_decide(&rule, (double *const *)s, n, a);
		for (int p = 0; p < RW_PATH_COUNT; p++)
			free(s[p]);
		if (!ok) {
			rc = bad("every case needs samples for native, rail-only, perm-only and joint");
			goto cleanup;
		}
	}
	size_t len = rw_sched_anchors_format(&t, NULL, 0);
	text = malloc(len + 1);
	if (!text) {
		rc = bad("out of memory");
		goto cleanup;
	}
	rw_sched_anchors_format(&t, text, len + 1);
	/* Round trip through the daemon's own parser: a table railwaved would refuse is an error. */
	rw_anchor_table_t check;
	char err[256];
	if (rw_sched_anchors_parse(text, len, &check, err, sizeof(err)) != RW_OK) {
		rc = bad(err);
		goto cleanup;
	}
	rw_sched_anchors_free(&check);
	fputs(text, stdout);
	fputc('\n', stdout);
	rc = 0;
cleanup:
	free(text);
	free(t.anchors);
	json_decref(in);
	return rc;
}

int rw_tool_bench_workload(int argc, char **argv)
{
	if (argc >= 2 && strcmp(argv[1], "describe") == 0)
		return describe(argc - 1, argv + 1);
	if (argc >= 2 && strcmp(argv[1], "calibrate") == 0)
		return calibrate();
	usage(argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) ? stdout : stderr);
	return argc >= 2 && argv[1][0] == '-' && argv[1][1] == '-' && argv[1][2] == 'h' ? 0 : 2;
}
