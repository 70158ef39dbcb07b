/* `railwave size`: the group carve-out the rank path needs for a model's shape (docs/service.md
 * "Turning on the rank path"). The daemon's own arithmetic (service/phase/phase.h
 * rw_svc_carve_size): the largest phase of the shape — every rank's tokens each naming every
 * node, under each of the four paths — against the two checks a phase meets, one record area of
 * the carve-out and its local area. Prints group_area_mib and group_local_mib (per rail, per
 * group), the group_pool_mib for --groups groups, the memory the carve-outs take per node, and
 * each part of a carve-out. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "service/phase/phase.h"
#include "tools/tools.h"

#define AREA_MIB_MAX 65536u /* the config's bound on group_area_mib (service/core/config.c) */

static int usage(FILE *f)
{
	fprintf(f,
		"usage: railwave size --hidden H [--dtype bf16|fp32] --topk K [--experts E]\n"
		"                     --tokens T --gpus G --nodes N --rails R [--gpu-rail LIST]\n"
		"                     [--max-recv M] [--groups J]\n"
		"  The group carve-out a rank-path group of this shape needs: every phase of T tokens\n"
		"  per rank fits it, whatever the routing and the path (the largest one: every token\n"
		"  of the world sent to one node).\n"
		"  --hidden H      the rows' width (elements)       --dtype  bf16 (default) or fp32\n"
		"  --topk K        experts per token                --experts E  checked: a multiple of N x G\n"
		"  --tokens T      tokens per rank per phase (the largest a trainer submits)\n"
		"  --gpus G        ranks per node                   --nodes N    --rails R\n"
		"  --gpu-rail LIST each local GPU's rail, as the config's gpu_rail (default g %% R)\n"
		"  --max-recv M    rows a rank receives per phase at most, as its rank open's max_recv\n"
		"                  (default: every token of the world, N x G x T)\n"
		"  --groups J      groups (jobs) a daemon holds at once: the pool (default 1)\n"
		"Prints 'key value' lines: group_area_mib, group_local_mib (of it, the local area),\n"
		"group_pool_mib, node_mib (carve-out memory per node at J groups: host memory, taken\n"
		"at each group's first join); '#' lines give each part of a carve-out.\n");
	return f == stdout ? 0 : 2;
}

static int parse_u32(const char *opt, const char *arg, uint32_t lo, uint32_t hi, uint32_t *out)
{
	unsigned long long v;
	if (rw_tool_parse_u64("size", opt, arg, &v))
		return -1;
	if (v < lo || v > hi) {
		fprintf(stderr, "railwave size: %s %llu: outside [%u, %u]\n", opt, v, lo, hi);
		return -1;
	}
	*out = (uint32_t)v;
	return 0;
}

static int parse_rails(const char *arg, uint8_t *gpu_rail, uint32_t *n_p)
{
	char buf[512], *tok, *save = NULL, *list = buf;
	snprintf(buf, sizeof(buf), "%s", arg);
	*n_p = 0;
	while ((tok = strtok_r(list, ",", &save))) {
		list = NULL;
		uint32_t r;
		if (*n_p >= RW_MAX_GPUS || parse_u32("--gpu-rail", tok, 0, RW_MAX_RAILS - 1, &r))
			return -1;
		gpu_rail[(*n_p)++] = (uint8_t)r;
	}
	return 0;
}

int rw_tool_size(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "hidden", required_argument, NULL, 'H' }, { "dtype", required_argument, NULL, 'd' },
		{ "topk", required_argument, NULL, 'k' },   { "experts", required_argument, NULL, 'e' },
		{ "tokens", required_argument, NULL, 't' }, { "gpus", required_argument, NULL, 'g' },
		{ "nodes", required_argument, NULL, 'n' },  { "rails", required_argument, NULL, 'r' },
		{ "gpu-rail", required_argument, NULL, 'm' }, { "groups", required_argument, NULL, 'j' },
		{ "max-recv", required_argument, NULL, 'x' }, { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	uint32_t hidden = 0, topk = 0, experts = 0, tokens = 0, gpus = 0, nodes = 0, rails = 0;
	uint32_t groups = 1, dtype = RW_WIRE_BF16, n_map = 0, max_recv = 0;
	uint8_t gpu_rail[RW_MAX_GPUS];
	int c, bad = 0;
	optind = 0; /* GNU getopt: full re-initialisation */
	while (!bad && (c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'H': bad = parse_u32("--hidden", optarg, 1, 1u << 20, &hidden); break;
		case 'k': bad = parse_u32("--topk", optarg, 1, 1024, &topk); break;
		case 'e': bad = parse_u32("--experts", optarg, 1, 1u << 20, &experts); break;
		case 't': bad = parse_u32("--tokens", optarg, 1, 1u << 24, &tokens); break;
		case 'g': bad = parse_u32("--gpus", optarg, 1, RW_MAX_GPUS, &gpus); break;
		case 'n': bad = parse_u32("--nodes", optarg, 1, RW_MAX_NODES, &nodes); break;
		case 'r': bad = parse_u32("--rails", optarg, 1, RW_MAX_RAILS, &rails); break;
		case 'j': bad = parse_u32("--groups", optarg, 1, 1024, &groups); break;
		case 'x': bad = parse_u32("--max-recv", optarg, 1, 1u << 24, &max_recv); break;
		case 'm': bad = parse_rails(optarg, gpu_rail, &n_map); break;
		case 'd':
			if (!strcmp(optarg, "bf16"))
				dtype = RW_WIRE_BF16;
			else if (!strcmp(optarg, "fp32"))
				dtype = RW_WIRE_F32;
			else {
				fprintf(stderr, "railwave size: --dtype %s: bf16 or fp32\n", optarg);
				bad = 1;
			}
			break;
		case 'h': return usage(stdout);
		default: return usage(stderr);
		}
	}
	if (bad)
		return 2;
	if (optind < argc || !hidden || !topk || !tokens || !gpus || !nodes || !rails) {
		fprintf(stderr, "railwave size: --hidden, --topk, --tokens, --gpus, --nodes and --rails "
				"are needed\n");
		return usage(stderr);
	}
	if (experts && experts % (nodes * gpus)) {
		fprintf(stderr, "railwave size: --experts %u is not a multiple of the %u ranks\n",
			experts, nodes * gpus);
		return 2;
	}
	rw_topo_t topo;
	if (rw_sched_topo_init(&topo, nodes, gpus, rails) != RW_OK) {
		fprintf(stderr, "railwave size: %u nodes x %u GPUs x %u rails is not a topology\n",
			nodes, gpus, rails);
		return 2;
	}
	if (n_map) {
		if (n_map != gpus) {
			fprintf(stderr, "railwave size: --gpu-rail names %u GPUs, --gpus is %u\n", n_map,
				gpus);
			return 2;
		}
		for (uint32_t g = 0; g < gpus; g++)
			if (gpu_rail[g] >= rails) {
				fprintf(stderr, "railwave size: --gpu-rail: GPU %u on rail %u, past the "
						"%u rails\n", g, gpu_rail[g], rails);
				return 2;
			}
		memcpy(topo.gpu_rail, gpu_rail, gpus);
	}
	rw_svc_carve_need_t need;
	rw_status_t st = rw_svc_carve_size(&topo, topk, hidden, dtype, tokens, max_recv, AREA_MIB_MAX,
					   &need);
	if (st != RW_OK) {
		fprintf(stderr, "railwave size: %s\n", rw_status_str(st));
		return 2;
	}
	const double mib = 1048576.0;
	printf("# %u nodes x %u ranks, %u rails; hidden %u %s, top-%u, %u tokens per rank, %llu rows "
	       "received per rank at most\n", nodes, gpus, rails, hidden,
	       dtype == RW_WIRE_BF16 ? "bf16" : "fp32", topk, tokens,
	       (unsigned long long)need.rank_rows);
	printf("# record areas (dispatch receive and send, combine receive and send): %llu records "
	       "on one rail at most, %.1f MiB each\n", (unsigned long long)need.max_records,
	       need.sub_need / mib);
	printf("# local area: %.1f MiB (local records %.1f, combine's local copies %.1f, the "
	       "staged combine inputs of the rail's ranks %.1f)\n", need.local_need / mib,
	       need.local_records / mib, need.local_copies / mib, need.local_staging / mib);
	if (!need.area_mib) {
		fprintf(stderr, "railwave size: no group_area_mib up to %u holds this shape's largest "
				"phase: fewer tokens per rank per phase (or a smaller --max-recv)\n",
			AREA_MIB_MAX);
		return 1;
	}
	printf("group_area_mib %u\n", need.area_mib);
	printf("group_local_mib %u\n", need.local_mib);
	printf("group_pool_mib %llu\n", (unsigned long long)need.area_mib * groups);
	printf("node_mib %llu\n", (unsigned long long)need.area_mib * groups * rails);
	return 0;
}
