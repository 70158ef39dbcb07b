/* `railwave plan`: plan one dispatch phase on the built-in example cluster (4 nodes x 8 GPUs x 8
 * rails, GLM-4.5-Air-shaped synthetic routing) and print what every node would derive: the counts,
 * the features, the selector's decision with its reason, and each path's per-rail loads against the
 * lower bound of docs/architecture.md §6. The interim main job of scripts/demo. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/sched.h"
#include "tools/synth.h"
#include "tools/tools.h"

#define EXAMPLE_NODES 4
#define EXAMPLE_GPUS 8
#define EXAMPLE_RAILS 8
#define EXAMPLE_NIC_GBPS 400.0
#define EXAMPLE_TRANSPORT "verbs"
#define GLM_EXPERTS 128
#define GLM_TOPK 8
#define GLM_HIDDEN 4096
#define DEFAULT_ANCHORS "deploy/anchors/example-4x8x8.json"
#define ANCHORS_MAX_BYTES (64u << 20) /* as railwaved: a table is kilobytes */

rw_status_t rw_tool_load_anchors(const char *path, rw_anchor_table_t *table, char *err,
				 size_t err_len)
{
	char *text = NULL;
	size_t len = 0;
	rw_status_t st = rw_read_file(path, ANCHORS_MAX_BYTES, &text, &len, err, err_len);
	if (st != RW_OK)
		return st;
	char perr[200];
	st = rw_sched_anchors_parse(text, len, table, perr, sizeof(perr));
	if (st != RW_OK)
		snprintf(err, err_len, "%s: %s", path, perr);
	free(text);
	return st;
}

static void usage(FILE *out)
{
	fprintf(out,
		"usage: railwave plan [--seed N] [--layer L] [--zipf S] [--dirichlet A] [--rail-skew X]\n"
		"                     [--tokens T] [--anchors FILE|none]\n"
		"Plans one dispatch phase on the example cluster (%d nodes x %d GPUs x %d rails, %.0f Gbit/s\n"
		"NICs) with GLM-4.5-Air-shaped routing (%d experts, top-%d, hidden %d bf16) and prints the\n"
		"counts, the features, the selector's decision and each path's rail loads.\n"
		"  --seed N        routing seed (default 1)          --layer L    layer drawn (default 0)\n"
		"  --zipf S        global expert skew (default 0.8)  --dirichlet A per-GPU heterogeneity,\n"
		"                  Dirichlet concentration (default 100; 0 = homogeneous)\n"
		"  --rail-skew X   share of non-hot GPUs' tokens kept node-local (default 0.5)\n"
		"  --tokens T      tokens per rank (default 4096)\n"
		"  --anchors FILE  anchor table (default %s; 'none' = no table)\n",
		EXAMPLE_NODES, EXAMPLE_GPUS, EXAMPLE_RAILS, EXAMPLE_NIC_GBPS, GLM_EXPERTS, GLM_TOPK,
		GLM_HIDDEN, DEFAULT_ANCHORS);
}

/* Per-rail egress and ingress records of every node under `path`, from the same pair plans the
 * daemons build (rw_sched_plan_build for each source). */
static rw_status_t path_loads(const rw_topo_t *topo, rw_path_t path, const uint32_t *counts,
			      uint64_t *egress, uint64_t *ingress)
{
	const uint32_t N = topo->nodes, R = topo->rails;
	rw_pair_plan_t pairs[EXAMPLE_NODES];
	memset(ingress, 0, sizeof(uint64_t) * N * R);
	for (uint32_t s = 0; s < N; s++) {
		rw_phase_plan_t plan = { .pairs = pairs };
		rw_status_t st = rw_sched_plan_build(topo, path, s, counts, &plan);
		if (st != RW_OK)
			return st;
		for (uint32_t r = 0; r < R; r++)
			egress[s * R + r] = plan.egress[r];
		for (uint32_t d = 0; d < N; d++)
			for (uint32_t r = 0; r < R; r++)
				ingress[d * R + r] += pairs[d].quota[r];
	}
	return RW_OK;
}

static void print_row(const char *label, const uint64_t *v, uint32_t n)
{
	printf("%s", label);
	for (uint32_t i = 0; i < n; i++)
		printf(" %6llu", (unsigned long long)v[i]);
	printf("\n");
}

int rw_tool_plan(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "seed", required_argument, NULL, 's' },
		{ "layer", required_argument, NULL, 'l' },
		{ "zipf", required_argument, NULL, 'z' },
		{ "dirichlet", required_argument, NULL, 'd' },
		{ "rail-skew", required_argument, NULL, 'k' },
		{ "tokens", required_argument, NULL, 't' },
		{ "anchors", required_argument, NULL, 'a' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	rw_synth_cfg_t cfg = {
		.nodes = EXAMPLE_NODES, .gpus_per_node = EXAMPLE_GPUS, .n_experts = GLM_EXPERTS,
		.topk = GLM_TOPK, .tokens_per_rank = 4096, .seed = 1, .zipf_s = 0.8,
		.dirichlet = 100.0, .rail_skew = 0.5,
	};
	const char *anchors_path = DEFAULT_ANCHORS;
	unsigned long long u;
	int c, rc = 1;

	optind = 0; /* GNU getopt: full re-initialisation (subcommands may run more than once in tests) */
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 's':
			if (rw_tool_parse_u64("plan", "--seed", optarg, &u))
				return 2;
			cfg.seed = u;
			break;
		case 'l':
			if (rw_tool_parse_u64("plan", "--layer", optarg, &u) || u > UINT32_MAX)
				return 2;
			cfg.layer = (uint32_t)u;
			break;
		case 't':
			if (rw_tool_parse_u64("plan", "--tokens", optarg, &u) || u == 0 || u > (1u << 20)) {
				fprintf(stderr, "railwave plan: --tokens must be in [1, %u]\n", 1u << 20);
				return 2;
			}
			cfg.tokens_per_rank = (uint32_t)u;
			break;
		case 'z':
			if (rw_tool_parse_double("plan", "--zipf", optarg, &cfg.zipf_s))
				return 2;
			break;
		case 'd':
			if (rw_tool_parse_double("plan", "--dirichlet", optarg, &cfg.dirichlet))
				return 2;
			break;
		case 'k':
			if (rw_tool_parse_double("plan", "--rail-skew", optarg, &cfg.rail_skew))
				return 2;
			break;
		case 'a':
			anchors_path = strcmp(optarg, "none") == 0 ? NULL : optarg;
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "railwave plan: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}

	rw_topo_t topo;
	rw_sched_topo_init(&topo, EXAMPLE_NODES, EXAMPLE_GPUS, EXAMPLE_RAILS);
	const uint32_t N = topo.nodes, R = topo.rails;
	const uint64_t record_bytes = GLM_HIDDEN * 2; /* bf16 */
	rw_synth_t gen;
	if (rw_synth_init(&gen, &cfg) != RW_OK) {
		fprintf(stderr, "railwave plan: bad workload knobs (zipf >= 0, dirichlet >= 0, rail-skew in [0,1])\n");
		return 2;
	}
	uint32_t *counts = calloc((size_t)N * N * R, sizeof(uint32_t));
	int32_t *ids = malloc(sizeof(int32_t) * EXAMPLE_GPUS * cfg.tokens_per_rank * cfg.topk);
	uint64_t *egress = malloc(sizeof(uint64_t) * N * R), *ingress = malloc(sizeof(uint64_t) * N * R);
	rw_anchor_table_t table;
	int have_table = 0;
	memset(&table, 0, sizeof(table));
	if (!counts || !ids || !egress || !ingress) {
		fprintf(stderr, "railwave plan: out of memory\n");
		goto cleanup;
	}
	rw_status_t st = rw_synth_counts(&gen, &topo, ids, counts);
	if (st != RW_OK) {
		fprintf(stderr, "railwave plan: counting failed: %s\n", rw_status_str(st));
		goto cleanup;
	}

	printf("RailWave plan: example cluster %u nodes x %u GPUs x %u rails, %.0f Gbit/s NICs (%s)\n",
	       N, topo.gpus_per_node, R, EXAMPLE_NIC_GBPS, EXAMPLE_TRANSPORT);
	printf("workload: GLM-4.5-Air shape: %u experts, top-%u, %u tokens/rank, hidden %u bf16 = %llu B/record\n",
	       cfg.n_experts, cfg.topk, cfg.tokens_per_rank, GLM_HIDDEN, (unsigned long long)record_bytes);
	printf("routing:  synthetic, seed %llu, layer %u, zipf %.2f, dirichlet %.1f, rail-skew %.2f\n\n",
	       (unsigned long long)cfg.seed, cfg.layer, cfg.zipf_s, cfg.dirichlet, cfg.rail_skew);

	printf("counts: records per (source -> destination, native rail); local = stays in the node\n");
	printf("  src->dst   ");
	for (uint32_t r = 0; r < R; r++)
		printf("    r%u", r);
	printf("    total\n");
	for (uint32_t s = 0; s < N; s++) {
		for (uint32_t d = 0; d < N; d++) {
			const uint32_t *row = counts + ((size_t)s * N + d) * R;
			uint64_t total = 0;
			printf("  %3u->%-3u%s", s, d, s == d ? " L" : "  ");
			for (uint32_t r = 0; r < R; r++) {
				printf(" %5u", row[r]);
				total += row[r];
			}
			printf(" %8llu%s\n", (unsigned long long)total, s == d ? "  (local)" : "");
		}
	}

	rw_features_t feat;
	rw_sched_features(&topo, counts, record_bytes, &feat);
	printf("\nfeatures (docs/algorithms.md §5):\n");
	printf("  remote bytes      %llu (%.1f MiB)\n", (unsigned long long)feat.remote_bytes,
	       feat.remote_bytes / 1048576.0);
	printf("  B  = %.1f MiB/GPU      f0 = log2 B = %.3f\n", feat.B / 1048576.0, feat.f[0]);
	printf("  rho_g = %.3f           f1 = %.3f   (source-rail skew)\n", feat.rho_g, feat.f[1]);
	printf("  kappa = %.3f           f2 = %.3f   (receiver concentration)\n", feat.kappa, feat.f[2]);
	printf("  max receiver fan-in %u, busiest destination-rail share %.3f\n\n", feat.max_fan_in,
	       feat.busiest_dst_rail_share);

	char err[320];
	if (anchors_path) {
		st = rw_tool_load_anchors(anchors_path, &table, err, sizeof(err));
		if (st != RW_OK) {
			printf("anchor table: rejected, %s\n  -> no valid table: the selector falls back to Joint\n", err);
		} else if (!rw_sched_anchors_match(&table, &topo, EXAMPLE_NIC_GBPS, EXAMPLE_TRANSPORT)) {
			printf("anchor table: %s was calibrated for another cluster (%u x %u x %u, %.0f Gbit/s %s)\n"
			       "  -> not used: the selector falls back to Joint\n", anchors_path,
			       table.fingerprint.nodes, table.fingerprint.gpus_per_node,
			       table.fingerprint.rails, table.fingerprint.nic_gbps, table.fingerprint.transport);
		} else {
			have_table = 1;
			printf("anchor table: %s (%u anchors, max_size_ratio %.2f, shape_tolerance %.3f)\n",
			       anchors_path, table.n_anchors, table.max_size_ratio, table.shape_tolerance);
		}
	} else {
		printf("anchor table: none\n");
	}
	rw_selection_t sel;
	rw_sched_select(have_table ? &table : NULL, &feat, &sel);
	printf("decision: %s   (reason: %s", rw_sched_path_name(sel.path), rw_sched_reason_name(sel.reason));
	if (sel.reason == RW_SELECT_ANCHOR)
		printf(", anchor case %lld, squared distance %.4f", (long long)sel.case_id, sel.distance2);
	printf(")\n\n");

	const uint64_t lb = rw_sched_lower_bound(&topo, counts);
	const double nic_bytes_per_s = EXAMPLE_NIC_GBPS * 1e9 / 8.0;
	printf("per-path rail loads, records per NIC (egress = leaving the node on rail r, ingress = arriving)\n");
	printf("lower bound (busiest NIC under the best per-pair balance): %llu records = %.3f ms at %.0f Gbit/s\n",
	       (unsigned long long)lb, lb * (double)record_bytes / nic_bytes_per_s * 1e3, EXAMPLE_NIC_GBPS);
	double ratio[RW_PATH_COUNT];
	uint64_t busiest[RW_PATH_COUNT];
	for (unsigned p = 0; p < RW_PATH_COUNT; p++) {
		rw_path_t path = (rw_path_t)p;
		if ((st = path_loads(&topo, path, counts, egress, ingress)) != RW_OK) {
			fprintf(stderr, "railwave plan: planning failed: %s\n", rw_status_str(st));
			goto cleanup;
		}
		busiest[p] = rw_sched_busiest_nic(&topo, path, counts);
		ratio[p] = lb ? (double)busiest[p] / (double)lb : 1.0;
		printf("\n%s%s: %s, %s\n", rw_sched_path_name(path), path == sel.path ? " (selected)" : "",
		       rw_path_balanced(path) ? "RailBalance quotas" : "native rails",
		       rw_path_waved(path) ? "N-1 permutation waves (receiver fan-in 1 per wave)"
					   : "all destinations at once");
		printf("  node      ");
		for (uint32_t r = 0; r < R; r++)
			printf("     r%u", r);
		printf("\n");
		for (uint32_t s = 0; s < N; s++) {
			char label[32];
			snprintf(label, sizeof(label), "  %u egress ", s);
			print_row(label, egress + s * R, R);
			snprintf(label, sizeof(label), "  %u ingress", s);
			print_row(label, ingress + s * R, R);
		}
		printf("  busiest NIC %llu records = %.3f ms; busiest / lower bound = %.3f\n",
		       (unsigned long long)busiest[p], busiest[p] * (double)record_bytes / nic_bytes_per_s * 1e3,
		       ratio[p]);
	}
	printf("\nsummary   path        waves  max fan-in  busiest NIC  / lower bound\n");
	for (unsigned p = 0; p < RW_PATH_COUNT; p++) {
		rw_path_t path = (rw_path_t)p;
		printf("        %s %-10s  %5u  %10u  %11llu  %6.3f\n", path == sel.path ? "->" : "  ",
		       rw_sched_path_name(path), rw_path_waved(path) ? N - 1 : 1,
		       rw_path_waved(path) ? (feat.max_fan_in ? 1 : 0) : feat.max_fan_in,
		       (unsigned long long)busiest[p], ratio[p]);
	}
	rc = 0;

cleanup:
	rw_sched_anchors_free(&table);
	free(ingress);
	free(egress);
	free(ids);
	free(counts);
	rw_synth_free(&gen);
	return rc;
}
