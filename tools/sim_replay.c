/* `railwave sim-replay`: recorded count matrices (from phase traces, through `railwave
 * analyze`) replayed through the simulator of docs/sim.md, every path, dispatch and combine, so a
 * recorded phase can be compared with what the other paths would have cost on the same demand.
 *   railwave sim-replay [--model lossless|maxmin] [FILE | -]
 * Input: one JSON object per line, {"id": any, "nodes": N, "rails": R, "gpus": G,
 * "counts": [N*N*R], "record_bytes": B, "combine_record_bytes": C, "gbps": [R rates]}.
 * Output: one line per input, {"id", "dispatch": {"lower_bound_s", "paths": {PATH: {"time_s",
 * "ratio"}}}, "combine": {...}}. A line that does not parse or does not fit is an error naming
 * the line (exit 1). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tools/sim.h"
#include "tools/tools.h"

static const char CMD[] = "sim-replay";

typedef struct replay_in {
	uint32_t nodes, rails, gpus;
	uint32_t *counts;
	json_int_t rec, crec;
	double gbps[RW_MAX_RAILS];
} replay_in_t;

/* Decode one input object; on error writes why into err. */
static int replay_parse(json_t *o, replay_in_t *in, char *err, size_t len)
{
	json_t *counts = json_object_get(o, "counts"), *gbps = json_object_get(o, "gbps");
	json_int_t n = json_integer_value(json_object_get(o, "nodes"));
	json_int_t r = json_integer_value(json_object_get(o, "rails"));
	json_int_t g = json_integer_value(json_object_get(o, "gpus"));
	in->rec = json_integer_value(json_object_get(o, "record_bytes"));
	in->crec = json_integer_value(json_object_get(o, "combine_record_bytes"));
	if (n < 2 || n > RW_MAX_NODES || r < 1 || r > RW_MAX_RAILS || g < 1 || g > RW_MAX_GPUS) {
		snprintf(err, len, "nodes/rails/gpus missing or out of range");
		return -1;
	}
	if (in->rec <= 0 || in->crec <= 0) {
		snprintf(err, len, "record_bytes and combine_record_bytes must be > 0");
		return -1;
	}
	size_t cells = (size_t)n * (size_t)n * (size_t)r;
	if (!json_is_array(counts) || json_array_size(counts) != cells) {
		snprintf(err, len, "counts must be an array of nodes*nodes*rails = %zu integers", cells);
		return -1;
	}
	if (!json_is_array(gbps) || json_array_size(gbps) != (size_t)r) {
		snprintf(err, len, "gbps must hold one rate per rail");
		return -1;
	}
	in->nodes = (uint32_t)n, in->rails = (uint32_t)r, in->gpus = (uint32_t)g;
	for (size_t k = 0; k < (size_t)r; k++) {
		in->gbps[k] = json_number_value(json_array_get(gbps, k));
		if (!(in->gbps[k] > 0)) {
			snprintf(err, len, "gbps[%zu] is not a positive number", k);
			return -1;
		}
	}
	in->counts = malloc(cells * sizeof(uint32_t));
	if (!in->counts) {
		snprintf(err, len, "out of memory");
		return -1;
	}
	for (size_t k = 0; k < cells; k++) {
		json_t *v = json_array_get(counts, k);
		if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT32_MAX) {
			snprintf(err, len, "counts[%zu] is not a record count", k);
			free(in->counts);
			in->counts = NULL;
			return -1;
		}
		in->counts[k] = (uint32_t)json_integer_value(v);
	}
	return 0;
}

/* Every path of one kind: its simulated time and the ratio to the lower bound. */
static json_t *replay_kind(const rw_topo_t *topo, const rw_sim_fabric_t *fab,
			   const rw_sim_opts_t *opts, const replay_in_t *in, int combine, char *err,
			   size_t len)
{
	uint64_t rec = (uint64_t)(combine ? in->crec : in->rec);
	json_t *paths = json_object();
	json_t *out = json_pack("{s:f,s:o}", "lower_bound_s",
				rw_sim_lower_bound(topo, fab, in->counts, rec), "paths", paths);
	for (int p = 0; out && p < RW_PATH_COUNT; p++) {
		rw_sim_report_t rep;
		rw_status_t st = rw_sim_path(topo, fab, opts, (rw_path_t)p, in->counts, rec, combine, &rep);
		if (st != RW_OK) {
			snprintf(err, len, "%s: simulation failed: %s", rw_sched_path_name((rw_path_t)p),
				 rw_status_str(st));
			json_decref(out);
			return NULL;
		}
		json_object_set_new(paths, rw_sched_path_name((rw_path_t)p),
				    json_pack("{s:f,s:f}", "time_s", rep.run.time, "ratio", rep.ratio));
	}
	return out;
}

static int replay_line(json_t *o, const rw_sim_opts_t *opts, char *err, size_t len)
{
	replay_in_t in = { 0 };
	if (replay_parse(o, &in, err, len) != 0)
		return -1;
	rw_topo_t topo;
	rw_sim_fabric_t fab = { .nodes = in.nodes, .rails = in.rails };
	int rc = -1;
	json_t *d = NULL, *c = NULL;
	if (rw_sched_topo_init(&topo, in.nodes, in.gpus, in.rails) != RW_OK) {
		snprintf(err, len, "invalid topology");
		goto out;
	}
	for (uint32_t r = 0; r < in.rails; r++)
		fab.rail_Bps[r] = in.gbps[r] * 1e9 / 8;
	rw_sim_topo_weights(&topo, &fab);
	if (!(d = replay_kind(&topo, &fab, opts, &in, 0, err, len)) ||
	    !(c = replay_kind(&topo, &fab, opts, &in, 1, err, len)))
		goto out;
	json_t *id = json_object_get(o, "id");
	json_t *res = json_pack("{s:O,s:o,s:o}", "id", id ? id : json_null(), "dispatch", d, "combine", c);
	d = c = NULL;
	char *text = res ? json_dumps(res, JSON_COMPACT | JSON_REAL_PRECISION(9)) : NULL;
	json_decref(res);
	if (!text) {
		snprintf(err, len, "out of memory");
		goto out;
	}
	puts(text);
	free(text);
	rc = 0;
out:
	json_decref(d);
	json_decref(c);
	free(in.counts);
	return rc;
}

int rw_tool_sim_replay(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	rw_sim_opts_t so;
	rw_sim_opts_default(&so);
	so.model = RW_SIM_MAXMIN;
	int c;
	optind = 0;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		if (c == 'm' && rw_sim_model_parse(optarg, &so.model) == RW_OK)
			continue;
		FILE *f = c == 'h' ? stdout : stderr;
		if (c == 'm')
			fprintf(stderr, "railwave %s: --model must be lossless or maxmin\n", CMD);
		fprintf(f, "usage: railwave %s [--model lossless|maxmin] [FILE | -]\n"
			"Replays recorded count matrices (one JSON object per line: id, nodes, rails, gpus,\n"
			"counts, record_bytes, combine_record_bytes, gbps) through the simulator, every path,\n"
			"dispatch and combine; one JSON line out per line in (default model: maxmin).\n", CMD);
		return c == 'h' ? 0 : 2;
	}
	if (argc - optind > 1) {
		fprintf(stderr, "railwave %s: one input file at most\n", CMD);
		return 2;
	}
	const char *path = optind < argc ? argv[optind] : "-";
	FILE *in = strcmp(path, "-") ? fopen(path, "r") : stdin;
	if (!in) {
		fprintf(stderr, "railwave %s: %s: %m\n", CMD, path);
		return 1;
	}
	char *line = NULL;
	size_t cap = 0;
	int rc = 0;
	unsigned long no = 0;
	while (getline(&line, &cap, in) > 0) {
		no++;
		if (line[strspn(line, " \t\r\n")] == '\0')
			continue;
		json_error_t jerr;
		json_t *o = json_loads(line, 0, &jerr);
		char err[256];
		if (!json_is_object(o)) {
			fprintf(stderr, "railwave %s: %s:%lu: %s\n", CMD, path, no,
				o ? "not a JSON object" : jerr.text);
			rc = 1;
		} else if (replay_line(o, &so, err, sizeof(err)) != 0) {
			fprintf(stderr, "railwave %s: %s:%lu: %s\n", CMD, path, no, err);
			rc = 1;
		}
		json_decref(o);
		if (rc)
			break;
	}
	free(line);
	if (in != stdin)
		fclose(in);
	return rc;
}
