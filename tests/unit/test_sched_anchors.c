/* Anchor tables (docs/selector.md §3): a valid table parses; every kind of bad field is rejected
 * with a message that names the field and leaves the table empty (LSan checks nothing leaks);
 * truncated and garbage JSON are rejected; parse -> format -> parse round-trips exactly. */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "sched/sched.h"

static const char base_json[] =
	"{\n"
	"  \"schema_version\": 1,\n"
	"  \"fingerprint\": {\"nodes\": 4, \"gpus_per_node\": 8, \"rails\": 8,\n"
	"                  \"nic_gbps\": 400, \"transport\": \"verbs\"},\n"
	"  \"max_size_ratio\": 2.0,\n"
	"  \"shape_tolerance\": 0.15,\n"
	"  \"anchors\": [\n"
	"    {\"case_id\": 5, \"features\": [24.5, 0.10, 0.05], \"selected\": \"native\",\n"
	"     \"samples\": {\"native\": {\"median\": 0.0010, \"p10\": 0.0009, \"p90\": 0.0011, \"n\": 20},\n"
	"                 \"joint\": {\"median\": 0.0014, \"p10\": 0.0013, \"p90\": 0.0015, \"n\": 20}}},\n"
	"    {\"case_id\": 2, \"features\": [27, 0.6, 0.1], \"selected\": \"rail-only\",\n"
	"     \"samples\": {\"rail-only\": {\"median\": 0.004, \"p10\": 0.0038, \"p90\": 0.0042, \"n\": 16},\n"
	"                 \"joint\": {\"median\": 0.005, \"p10\": 0.0048, \"p90\": 0.0052, \"n\": 16}}},\n"
	"    {\"case_id\": 9, \"features\": [26, 0.3, 1], \"selected\": \"joint\", \"samples\": {}}\n"
	"  ]\n"
	"}\n";

static void test_parse_valid(void **state)
{
	(void)state;
	rw_anchor_table_t t;
	char err[256];
	assert_int_equal(rw_sched_anchors_parse(base_json, strlen(base_json), &t, err, sizeof(err)), RW_OK);
	assert_string_equal(err, "");
	assert_int_equal(t.schema_version, 1);
	assert_int_equal(t.fingerprint.nodes, 4);
	assert_int_equal(t.fingerprint.gpus_per_node, 8);
	assert_int_equal(t.fingerprint.rails, 8);
	assert_true(t.fingerprint.nic_gbps == 400.0);
	assert_string_equal(t.fingerprint.transport, "verbs");
	assert_true(t.max_size_ratio == 2.0);
	assert_true(t.shape_tolerance == 0.15);
	assert_int_equal(t.n_anchors, 3);
	assert_int_equal(t.anchors[0].case_id, 5);
	assert_int_equal(t.anchors[0].selected, RW_PATH_NATIVE);
	assert_true(t.anchors[0].feat[0] == 24.5 && t.anchors[0].feat[1] == 0.10 && t.anchors[0].feat[2] == 0.05);
	assert_true(t.anchors[0].samples[RW_PATH_NATIVE].median == 0.0010);
	assert_int_equal(t.anchors[0].samples[RW_PATH_NATIVE].n, 20);
	assert_int_equal(t.anchors[0].samples[RW_PATH_RAIL_ONLY].n, 0); /* absent path: zeros */
	assert_int_equal(t.anchors[1].selected, RW_PATH_RAIL_ONLY);
	assert_true(t.anchors[1].feat[0] == 27.0); /* integers are numbers too */
	assert_int_equal(t.anchors[1].samples[RW_PATH_RAIL_ONLY].n, 16);
	assert_int_equal(t.anchors[2].selected, RW_PATH_JOINT);
	assert_true(t.anchors[2].feat[2] == 1.0);

	/* The parsed table drives the selector. */
	rw_features_t f;
	memset(&f, 0, sizeof(f));
	f.remote_bytes = 1;
	f.f[0] = 27.2;
	f.f[1] = 0.55;
	f.f[2] = 0.12;
	rw_selection_t sel;
	rw_sched_select(&t, &f, &sel);
	assert_int_equal(sel.path, RW_PATH_RAIL_ONLY);
	assert_int_equal(sel.case_id, 2);

	rw_sched_anchors_free(&t);
	assert_int_equal(t.n_anchors, 0);
	assert_null(t.anchors);
	rw_sched_anchors_free(&t); /* idempotent */

	/* Not NUL-terminated: only len bytes are read. */
	size_t len = strlen(base_json);
	char *copy = malloc(len + 8);
	assert_non_null(copy);
	memcpy(copy, base_json, len);
	memcpy(copy + len, "garbage!", 8);
	assert_int_equal(rw_sched_anchors_parse(copy, len, &t, err, sizeof(err)), RW_OK);
	assert_int_equal(t.n_anchors, 3);
	rw_sched_anchors_free(&t);
	free(copy);

	/* An empty anchors array is a valid (if useless) table. */
	const char *empty = "{\"schema_version\":1,\"fingerprint\":{\"nodes\":2,\"gpus_per_node\":1,"
			    "\"rails\":1,\"nic_gbps\":25,\"transport\":\"tcp\"},\"max_size_ratio\":4,"
			    "\"shape_tolerance\":0,\"anchors\":[]}";
	assert_int_equal(rw_sched_anchors_parse(empty, strlen(empty), &t, err, sizeof(err)), RW_OK);
	assert_int_equal(t.n_anchors, 0);
	assert_null(t.anchors);
	rw_sched_anchors_free(&t);
}

/* ---- malformed tables: each case edits one field of base_json ---- */

/* Walk "a.b[2].c" to the parent object/array of the last component. Returns the parent and
 * sets *key or *index for the last component. */
static json_t *walk(json_t *root, const char *path, char *key, size_t key_len, long *index)
{
	json_t *cur = root;
	const char *p = path;
	for (;;) {
		char name[64];
		size_t n = strcspn(p, ".[");
		assert_true(n < sizeof(name));
		memcpy(name, p, n);
		name[n] = '\0';
		p += n;
		long idx = -1;
		if (*p == '[') {
			idx = strtol(p + 1, (char **)&p, 10);
			assert_true(*p == ']');
			p++;
		}
		if (*p == '\0') {
			if (idx < 0) {
				snprintf(key, key_len, "%s", name);
				*index = -1;
				return cur;
			}
			json_t *arr = json_object_get(cur, name);
			assert_non_null(arr);
			snprintf(key, key_len, "%s", name);
			*index = idx;
			return arr;
		}
		cur = json_object_get(cur, name);
		assert_non_null(cur);
		if (idx >= 0) {
			cur = json_array_get(cur, (size_t)idx);
			assert_non_null(cur);
		}
		assert_true(*p == '.');
		p++;
	}
}

typedef struct bad_case {
	const char *name;
	const char *path;     /* field to edit */
	const char *value;    /* new JSON value, or NULL to delete the field */
	const char *expect;   /* the error message must start with this */
} bad_case_t;

static const bad_case_t bad_cases[] = {
	{ "schema_version_wrong", "schema_version", "2", "schema_version: " },
	{ "schema_version_string", "schema_version", "\"1\"", "schema_version: expected an integer" },
	{ "schema_version_missing", "schema_version", NULL, "schema_version: missing" },
	{ "fingerprint_missing", "fingerprint", NULL, "fingerprint: missing" },
	{ "fingerprint_not_object", "fingerprint", "[4, 8, 8]", "fingerprint: expected an object" },
	{ "fingerprint_nodes_zero", "fingerprint.nodes", "0", "fingerprint.nodes: 0 out of range" },
	{ "fingerprint_nodes_negative", "fingerprint.nodes", "-4", "fingerprint.nodes: -4 out of range" },
	{ "fingerprint_nodes_missing", "fingerprint.nodes", NULL, "fingerprint.nodes: missing" },
	{ "fingerprint_gpus_too_many", "fingerprint.gpus_per_node", "17", "fingerprint.gpus_per_node: " },
	{ "fingerprint_rails_fraction", "fingerprint.rails", "1.5", "fingerprint.rails: expected an integer" },
	{ "fingerprint_rails_too_many", "fingerprint.rails", "17", "fingerprint.rails: 17 out of range" },
	{ "fingerprint_nic_zero", "fingerprint.nic_gbps", "0", "fingerprint.nic_gbps: must be > 0" },
	{ "fingerprint_nic_string", "fingerprint.nic_gbps", "\"400G\"", "fingerprint.nic_gbps: expected a number" },
	{ "fingerprint_transport_empty", "fingerprint.transport", "\"\"", "fingerprint.transport: " },
	{ "fingerprint_transport_long", "fingerprint.transport", "\"verbs-over-something\"", "fingerprint.transport: " },
	{ "fingerprint_transport_number", "fingerprint.transport", "3", "fingerprint.transport: " },
	{ "max_size_ratio_one", "max_size_ratio", "1.0", "max_size_ratio: must be > 1" },
	{ "max_size_ratio_below_one", "max_size_ratio", "0.5", "max_size_ratio: must be > 1" },
	{ "max_size_ratio_string", "max_size_ratio", "\"2\"", "max_size_ratio: expected a number" },
	{ "max_size_ratio_missing", "max_size_ratio", NULL, "max_size_ratio: missing" },
	{ "shape_tolerance_negative", "shape_tolerance", "-0.01", "shape_tolerance: must be >= 0" },
	{ "shape_tolerance_null", "shape_tolerance", "null", "shape_tolerance: expected a number" },
	{ "anchors_missing", "anchors", NULL, "anchors: missing" },
	{ "anchors_object", "anchors", "{}", "anchors: expected an array" },
	{ "anchor_not_object", "anchors[1]", "5", "anchors[1]: expected an object" },
	{ "case_id_duplicate", "anchors[2].case_id", "5", "anchors[2].case_id: 5 duplicates anchors[0].case_id" },
	{ "case_id_negative", "anchors[1].case_id", "-3", "anchors[1].case_id: -3 out of range" },
	{ "case_id_fraction", "anchors[1].case_id", "1.5", "anchors[1].case_id: expected an integer" },
	{ "case_id_missing", "anchors[0].case_id", NULL, "anchors[0].case_id: missing" },
	{ "features_short", "anchors[0].features", "[1, 0.5]", "anchors[0].features: expected an array of 3" },
	{ "features_long", "anchors[0].features", "[1, 0.5, 0.5, 0]", "anchors[0].features: expected an array of 3" },
	{ "features_not_array", "anchors[0].features", "\"24,0,0\"", "anchors[0].features: expected an array" },
	{ "features_missing", "anchors[2].features", NULL, "anchors[2].features: missing" },
	{ "feature0_string", "anchors[1].features[0]", "\"big\"", "anchors[1].features[0]: expected a number" },
	{ "feature1_above_one", "anchors[1].features[1]", "1.5", "anchors[1].features[1]: expected a number in [0,1]" },
	{ "feature2_negative", "anchors[2].features[2]", "-0.1", "anchors[2].features[2]: expected a number in [0,1]" },
	{ "selected_unknown", "anchors[1].selected", "\"fast\"", "anchors[1].selected: expected one of" },
	{ "selected_number", "anchors[1].selected", "3", "anchors[1].selected: expected one of" },
	{ "selected_missing", "anchors[0].selected", NULL, "anchors[0].selected: missing" },
	{ "samples_missing", "anchors[2].samples", NULL, "anchors[2].samples: missing" },
	{ "samples_array", "anchors[2].samples", "[]", "anchors[2].samples: expected an object" },
	{ "samples_unknown_path", "anchors[0].samples.fast", "{\"median\":1,\"p10\":1,\"p90\":1,\"n\":1}",
	  "anchors[0].samples.fast: unknown path name" },
	{ "samples_path_not_object", "anchors[1].samples.joint", "4", "anchors[1].samples.joint: expected an object" },
	{ "samples_median_missing", "anchors[1].samples.joint.median", NULL, "anchors[1].samples.joint.median: missing" },
	{ "samples_p10_above_median", "anchors[1].samples.joint.p10", "0.006",
	  "anchors[1].samples.joint.p10: 0.006 exceeds median" },
	{ "samples_p10_negative", "anchors[1].samples.joint.p10", "-1", "anchors[1].samples.joint.p10: must be >= 0" },
	{ "samples_p90_below_median", "anchors[0].samples.native.p90", "0.0005",
	  "anchors[0].samples.native.p90: 0.0005 is below median" },
	{ "samples_p90_string", "anchors[0].samples.native.p90", "\"x\"", "anchors[0].samples.native.p90: expected a number" },
	{ "samples_n_negative", "anchors[1].samples.rail-only.n", "-1", "anchors[1].samples.rail-only.n: -1 out of range" },
	{ "samples_n_fraction", "anchors[1].samples.rail-only.n", "2.5", "anchors[1].samples.rail-only.n: expected an integer" },
};

static void expect_rejected(const char *text, size_t len, const char *expect)
{
	rw_anchor_table_t t;
	char err[256];
	memset(&t, 0x5a, sizeof(t));
	rw_status_t st = rw_sched_anchors_parse(text, len, &t, err, sizeof(err));
	if (st != RW_ERR_PARSE || strncmp(err, expect, strlen(expect)) != 0)
		fail_msg("status %d, message \"%s\", expected \"%s...\"", st, err, expect);
	/* Left empty: nothing to free, nothing leaked. */
	assert_int_equal(t.n_anchors, 0);
	assert_null(t.anchors);
	rw_sched_anchors_free(&t);
}

static void test_bad_field(void **state)
{
	const bad_case_t *c = *state;
	json_error_t jerr;
	json_t *root = json_loads(base_json, 0, &jerr);
	assert_non_null(root);
	char key[64];
	long index;
	json_t *parent = walk(root, c->path, key, sizeof(key), &index);
	if (!c->value) {
		assert_int_equal(json_object_del(parent, key), 0);
	} else {
		json_t *v = json_loads(c->value, JSON_DECODE_ANY, &jerr);
		assert_non_null(v);
		if (index >= 0)
			assert_int_equal(json_array_set_new(parent, (size_t)index, v), 0);
		else
			assert_int_equal(json_object_set_new(parent, key, v), 0);
	}
	char *text = json_dumps(root, JSON_PRESERVE_ORDER);
	json_decref(root);
	assert_non_null(text);
	expect_rejected(text, strlen(text), c->expect);
	free(text);
}

static void test_bad_json(void **state)
{
	(void)state;
	/* Truncated at every length short of the whole text (the final newline is optional). */
	size_t len = strlen(base_json);
	for (size_t cut = 0; cut + 2 < len; cut += 7)
		expect_rejected(base_json, cut, "json: ");
	expect_rejected(base_json, len - 3, "json: ");
	expect_rejected("hello", 5, "json: line 1");
	expect_rejected("\x01\xff\xfe{", 4, "json: ");
	expect_rejected("[1, 2, 3]", 9, "json: expected an object");
	expect_rejected("42", 2, "json: ");
	expect_rejected(NULL, 0, "json: ");
	const char *dup = "{\"schema_version\": 1, \"schema_version\": 1}";
	expect_rejected(dup, strlen(dup), "json: ");
	/* A short error buffer is still NUL-terminated; a NULL one is allowed. */
	rw_anchor_table_t t;
	char small[8];
	assert_int_equal(rw_sched_anchors_parse("{", 1, &t, small, sizeof(small)), RW_ERR_PARSE);
	assert_true(strlen(small) < sizeof(small));
	assert_int_equal(rw_sched_anchors_parse("{", 1, &t, NULL, 0), RW_ERR_PARSE);
}

/* ---- format ---- */

static void assert_tables_equal(const rw_anchor_table_t *a, const rw_anchor_table_t *b)
{
	assert_int_equal(a->schema_version, b->schema_version);
	assert_int_equal(a->fingerprint.nodes, b->fingerprint.nodes);
	assert_int_equal(a->fingerprint.gpus_per_node, b->fingerprint.gpus_per_node);
	assert_int_equal(a->fingerprint.rails, b->fingerprint.rails);
	assert_true(a->fingerprint.nic_gbps == b->fingerprint.nic_gbps);
	assert_string_equal(a->fingerprint.transport, b->fingerprint.transport);
	assert_true(a->max_size_ratio == b->max_size_ratio);
	assert_true(a->shape_tolerance == b->shape_tolerance);
	assert_int_equal(a->n_anchors, b->n_anchors);
	for (uint32_t i = 0; i < a->n_anchors; i++) {
		const rw_anchor_t *x = &a->anchors[i], *y = &b->anchors[i];
		assert_int_equal(x->case_id, y->case_id);
		assert_int_equal(x->selected, y->selected);
		for (unsigned k = 0; k < 3; k++)
			assert_true(x->feat[k] == y->feat[k]);
		for (unsigned p = 0; p < RW_PATH_COUNT; p++) {
			assert_true(x->samples[p].median == y->samples[p].median);
			assert_true(x->samples[p].p10 == y->samples[p].p10);
			assert_true(x->samples[p].p90 == y->samples[p].p90);
			assert_int_equal(x->samples[p].n, y->samples[p].n);
		}
	}
}

static char *format_alloc(const rw_anchor_table_t *t)
{
	size_t need = rw_sched_anchors_format(t, NULL, 0);
	assert_true(need > 0);
	char *buf = malloc(need + 1);
	assert_non_null(buf);
	assert_int_equal(rw_sched_anchors_format(t, buf, need + 1), need);
	assert_int_equal(strlen(buf), need);
	return buf;
}

static void test_round_trip(void **state)
{
	(void)state;
	rw_anchor_table_t a, b;
	char err[256];
	assert_int_equal(rw_sched_anchors_parse(base_json, strlen(base_json), &a, err, sizeof(err)), RW_OK);
	char *text = format_alloc(&a);
	assert_int_equal(rw_sched_anchors_parse(text, strlen(text), &b, err, sizeof(err)), RW_OK);
	assert_tables_equal(&a, &b);
	/* The formatted text is a fixed point. */
	char *text2 = format_alloc(&b);
	assert_string_equal(text, text2);
	free(text2);
	rw_sched_anchors_free(&b);

	/* Awkward doubles survive exactly (17 significant digits). */
	a.max_size_ratio = 1.0 + 1.0 / 3.0;
	a.shape_tolerance = 0.1 + 0.2;
	a.fingerprint.nic_gbps = 199.99999999999997;
	a.anchors[0].feat[0] = -3.3e-7;
	a.anchors[0].feat[1] = 1.0 / 7.0;
	a.anchors[0].samples[RW_PATH_PERM_ONLY] = (rw_path_samples_t){ 2.5e-5, 1e-300, 0.1, 7 };
	a.anchors[2].samples[RW_PATH_NATIVE] = (rw_path_samples_t){ 0, 0, 0, 3 }; /* n alone counts */
	free(text);
	text = format_alloc(&a);
	assert_int_equal(rw_sched_anchors_parse(text, strlen(text), &b, err, sizeof(err)), RW_OK);
	assert_tables_equal(&a, &b);
	rw_sched_anchors_free(&b);

	/* Truncating buffer: returns the full size, writes a NUL-terminated prefix. */
	size_t need = strlen(text);
	char small[16];
	memset(small, 'x', sizeof(small));
	assert_int_equal(rw_sched_anchors_format(&a, small, sizeof(small)), need);
	assert_int_equal(strlen(small), sizeof(small) - 1);
	assert_memory_equal(small, text, sizeof(small) - 1);
	free(text);

	/* A value JSON cannot hold: 0, and an empty string. */
	a.anchors[1].feat[0] = NAN;
	memset(small, 'x', sizeof(small));
	assert_int_equal(rw_sched_anchors_format(&a, small, sizeof(small)), 0);
	assert_string_equal(small, "");
	rw_sched_anchors_free(&a);
}

static void test_match(void **state)
{
	(void)state;
	rw_anchor_table_t t;
	char err[256];
	assert_int_equal(rw_sched_anchors_parse(base_json, strlen(base_json), &t, err, sizeof(err)), RW_OK);
	rw_topo_t topo;
	memset(&topo, 0, sizeof(topo));
	topo.nodes = 4;
	topo.gpus_per_node = 8;
	topo.rails = 8;
	assert_true(rw_sched_anchors_match(&t, &topo, 400.0, "verbs"));
	assert_true(rw_sched_anchors_match(&t, &topo, 400.0 * (1 + 1e-9), "verbs"));
	assert_false(rw_sched_anchors_match(&t, &topo, 200.0, "verbs"));
	assert_false(rw_sched_anchors_match(&t, &topo, 400.0, "tcp"));
	assert_false(rw_sched_anchors_match(&t, &topo, 400.0, "verbsx"));
	assert_false(rw_sched_anchors_match(&t, &topo, 400.0, NULL));
	assert_false(rw_sched_anchors_match(NULL, &topo, 400.0, "verbs"));
	topo.nodes = 8;
	assert_false(rw_sched_anchors_match(&t, &topo, 400.0, "verbs"));
	topo.nodes = 4;
	topo.gpus_per_node = 4;
	assert_false(rw_sched_anchors_match(&t, &topo, 400.0, "verbs"));
	topo.gpus_per_node = 8;
	topo.rails = 4;
	assert_false(rw_sched_anchors_match(&t, &topo, 400.0, "verbs"));
	rw_sched_anchors_free(&t);
}

int main(void)
{
	enum { N_BAD = sizeof(bad_cases) / sizeof(bad_cases[0]) };
	struct CMUnitTest tests[4 + N_BAD];
	size_t n = 0;
	tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_parse_valid);
	tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_bad_json);
	tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_round_trip);
	tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_match);
	for (size_t i = 0; i < N_BAD; i++)
		tests[n++] = (struct CMUnitTest){ .name = bad_cases[i].name, .test_func = test_bad_field,
						  .initial_state = (void *)&bad_cases[i] };
	return _cmocka_run_group_tests("sched_anchors", tests, n, NULL, NULL);
}
