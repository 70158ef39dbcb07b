/* Anchor tables (docs/selector.md §3): parse and validate the JSON written by calibration, format a
 * table back to JSON, check a table's cluster fingerprint. Every rejection names the exact field
 * ("anchors[2].samples.joint.p10: ...") so an operator can fix the file; docs/selector.md has the
 * schema. This is the one part of sched/ that allocates (the table's anchor array). */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/sched.h"

/* Parse state: the error buffer and the path of the field being read ("anchors[2].features"). */
typedef struct parse_ctx {
	char *err;
	size_t err_len;
} parse_ctx_t;

static rw_status_t fail(parse_ctx_t *ctx, const char *field, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static rw_status_t fail(parse_ctx_t *ctx, const char *field, const char *fmt, ...)
{
	if (ctx->err && ctx->err_len > 0) {
		int n = snprintf(ctx->err, ctx->err_len, "%s: ", field);
		if (n >= 0 && (size_t)n < ctx->err_len) {
			va_list ap;
			va_start(ap, fmt);
			vsnprintf(ctx->err + n, ctx->err_len - (size_t)n, fmt, ap);
			va_end(ap);
		}
	}
	return RW_ERR_PARSE;
}

/* "prefix.key" into buf (fields are short; truncation only shortens a message). */
static const char *field_name(char *buf, size_t len, const char *prefix, const char *key)
{
	int n = prefix[0] ? snprintf(buf, len, "%s.%s", prefix, key) : snprintf(buf, len, "%s", key);
	if (n < 0 && len > 0)
		buf[0] = '\0';
	return buf;
}

/* A required member of obj; NULL (with the error written) when missing. */
static json_t *member(parse_ctx_t *ctx, json_t *obj, const char *prefix, const char *key,
		      rw_status_t *st)
{
	json_t *v = json_object_get(obj, key);
	if (!v) {
		char f[128];
		*st = fail(ctx, field_name(f, sizeof(f), prefix, key), "missing");
	}
	return v;
}

/* Unsigned integer member in [lo, hi]. */
static rw_status_t get_uint(parse_ctx_t *ctx, json_t *obj, const char *prefix, const char *key,
			    uint64_t lo, uint64_t hi, uint32_t *out)
{
	rw_status_t st = RW_OK;
	char f[128];
	json_t *v = member(ctx, obj, prefix, key, &st);
	if (!v)
		return st;
	field_name(f, sizeof(f), prefix, key);
	if (!json_is_integer(v))
		return fail(ctx, f, "expected an integer in [%llu,%llu]", (unsigned long long)lo,
			    (unsigned long long)hi);
	json_int_t x = json_integer_value(v);
	if (x < 0 || (uint64_t)x < lo || (uint64_t)x > hi)
		return fail(ctx, f, "%lld out of range [%llu,%llu]", (long long)x,
			    (unsigned long long)lo, (unsigned long long)hi);
	*out = (uint32_t)x;
	return RW_OK;
}

/* Finite number member (integer or real). */
static rw_status_t get_number(parse_ctx_t *ctx, json_t *obj, const char *prefix, const char *key,
			      double *out)
{
	rw_status_t st = RW_OK;
	char f[128];
	json_t *v = member(ctx, obj, prefix, key, &st);
	if (!v)
		return st;
	if (!json_is_number(v) || !isfinite(json_number_value(v)))
		return fail(ctx, field_name(f, sizeof(f), prefix, key), "expected a number");
	*out = json_number_value(v);
	return RW_OK;
}

static rw_status_t parse_fingerprint(parse_ctx_t *ctx, json_t *root, rw_anchor_table_t *t)
{
	rw_status_t st = RW_OK;
	json_t *fp = member(ctx, root, "", "fingerprint", &st);
	if (!fp)
		return st;
	if (!json_is_object(fp))
		return fail(ctx, "fingerprint", "expected an object");
	if ((st = get_uint(ctx, fp, "fingerprint", "nodes", 1, RW_MAX_NODES, &t->fingerprint.nodes)) ||
	    (st = get_uint(ctx, fp, "fingerprint", "gpus_per_node", 1, RW_MAX_GPUS,
			   &t->fingerprint.gpus_per_node)) ||
	    (st = get_uint(ctx, fp, "fingerprint", "rails", 1, RW_MAX_RAILS, &t->fingerprint.rails)) ||
	    (st = get_number(ctx, fp, "fingerprint", "nic_gbps", &t->fingerprint.nic_gbps)))
		return st;
	if (!(t->fingerprint.nic_gbps > 0.0))
		return fail(ctx, "fingerprint.nic_gbps", "must be > 0");
	json_t *tr = member(ctx, fp, "fingerprint", "transport", &st);
	if (!tr)
		return st;
	const char *s = json_string_value(tr);
	if (!s || s[0] == '\0' || strlen(s) >= sizeof(t->fingerprint.transport))
		return fail(ctx, "fingerprint.transport", "expected a non-empty string of at most %zu characters",
			    sizeof(t->fingerprint.transport) - 1);
	memcpy(t->fingerprint.transport, s, strlen(s) + 1);
	return RW_OK;
}

static rw_status_t parse_samples(parse_ctx_t *ctx, json_t *obj, const char *prefix, rw_anchor_t *a)
{
	char f[128], sf[96];
	if (!json_is_object(obj))
		return fail(ctx, prefix, "expected an object keyed by path name");
	const char *key;
	json_t *v;
	json_object_foreach(obj, key, v) {
		rw_path_t p;
		rw_status_t st;
		field_name(sf, sizeof(sf), prefix, key);
		if (rw_sched_path_parse(key, &p) != RW_OK)
			return fail(ctx, sf, "unknown path name (expected native, rail-only, perm-only or joint)");
		if (!json_is_object(v))
			return fail(ctx, sf, "expected an object with median, p10, p90, n");
		rw_path_samples_t *s = &a->samples[p];
		if ((st = get_number(ctx, v, sf, "median", &s->median)) ||
		    (st = get_number(ctx, v, sf, "p10", &s->p10)) ||
		    (st = get_number(ctx, v, sf, "p90", &s->p90)) ||
		    (st = get_uint(ctx, v, sf, "n", 0, UINT32_MAX, &s->n)))
			return st;
		if (s->p10 < 0.0)
			return fail(ctx, field_name(f, sizeof(f), sf, "p10"), "must be >= 0 (seconds)");
		if (s->p10 > s->median)
			return fail(ctx, field_name(f, sizeof(f), sf, "p10"), "%g exceeds median %g",
				    s->p10, s->median);
		if (s->median > s->p90)
			return fail(ctx, field_name(f, sizeof(f), sf, "p90"), "%g is below median %g",
				    s->p90, s->median);
	}
	return RW_OK;
}

static rw_status_t parse_anchor(parse_ctx_t *ctx, json_t *obj, uint32_t i, rw_anchor_t *anchors)
{
	char prefix[48], f[128];
	rw_status_t st = RW_OK;
	rw_anchor_t *a = &anchors[i];

	snprintf(prefix, sizeof(prefix), "anchors[%u]", i);
	if (!json_is_object(obj))
		return fail(ctx, prefix, "expected an object");
	if ((st = get_uint(ctx, obj, prefix, "case_id", 0, UINT32_MAX, &a->case_id)))
		return st;
	for (uint32_t j = 0; j < i; j++)
		if (anchors[j].case_id == a->case_id)
			return fail(ctx, field_name(f, sizeof(f), prefix, "case_id"),
				    "%u duplicates anchors[%u].case_id", a->case_id, j);

	json_t *feat = member(ctx, obj, prefix, "features", &st);
	if (!feat)
		return st;
	field_name(f, sizeof(f), prefix, "features");
	if (!json_is_array(feat) || json_array_size(feat) != 3)
		return fail(ctx, f, "expected an array of 3 numbers [log2 B, f1, f2]");
	for (unsigned k = 0; k < 3; k++) {
		json_t *x = json_array_get(feat, k);
		double v = json_is_number(x) ? json_number_value(x) : NAN;
		snprintf(f, sizeof(f), "%s.features[%u]", prefix, k);
		if (k == 0 && !isfinite(v))
			return fail(ctx, f, "expected a number");
		if (k > 0 && !(v >= 0.0 && v <= 1.0))
			return fail(ctx, f, "expected a number in [0,1]");
		a->feat[k] = v;
	}

	json_t *sel = member(ctx, obj, prefix, "selected", &st);
	if (!sel)
		return st;
	if (rw_sched_path_parse(json_string_value(sel), &a->selected) != RW_OK)
		return fail(ctx, field_name(f, sizeof(f), prefix, "selected"),
			    "expected one of native, rail-only, perm-only, joint");

	json_t *samples = member(ctx, obj, prefix, "samples", &st);
	if (!samples)
		return st;
	return parse_samples(ctx, samples, field_name(f, sizeof(f), prefix, "samples"), a);
}

rw_status_t rw_sched_anchors_parse(const char *json, size_t len, rw_anchor_table_t *table,
				   char *err, size_t err_len)
{
	parse_ctx_t ctx = { .err = err, .err_len = err_len };
	rw_anchor_table_t t;
	json_error_t jerr;
	rw_status_t st = RW_OK;
	json_t *root = NULL;

	memset(table, 0, sizeof(*table));
	memset(&t, 0, sizeof(t));
	if (err && err_len)
		err[0] = '\0';
	if (!json) {
		st = fail(&ctx, "json", "no input");
		goto out;
	}
	root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!root) {
		st = fail(&ctx, "json", "line %d column %d: %s", jerr.line, jerr.column, jerr.text);
		goto out;
	}
	if (!json_is_object(root)) {
		st = fail(&ctx, "json", "expected an object at the top level");
		goto free_root;
	}
	if ((st = get_uint(&ctx, root, "", "schema_version", 0, UINT32_MAX, &t.schema_version)))
		goto free_root;
	if (t.schema_version != RW_ANCHOR_SCHEMA) {
		st = fail(&ctx, "schema_version", "%u is not supported (expected %d)", t.schema_version,
			  RW_ANCHOR_SCHEMA);
		goto free_root;
	}
	if ((st = parse_fingerprint(&ctx, root, &t)))
		goto free_root;
	if ((st = get_number(&ctx, root, "", "max_size_ratio", &t.max_size_ratio)))
		goto free_root;
	if (!(t.max_size_ratio > 1.0)) {
		st = fail(&ctx, "max_size_ratio", "must be > 1");
		goto free_root;
	}
	if ((st = get_number(&ctx, root, "", "shape_tolerance", &t.shape_tolerance)))
		goto free_root;
	if (!(t.shape_tolerance >= 0.0)) {
		st = fail(&ctx, "shape_tolerance", "must be >= 0");
		goto free_root;
	}

	json_t *arr = member(&ctx, root, "", "anchors", &st);
	if (!arr)
		goto free_root;
	if (!json_is_array(arr)) {
		st = fail(&ctx, "anchors", "expected an array");
		goto free_root;
	}
	size_t n = json_array_size(arr);
	if (n > UINT32_MAX) {
		st = fail(&ctx, "anchors", "too many anchors");
		goto free_root;
	}
	if (n > 0) {
		t.anchors = calloc(n, sizeof(*t.anchors));
		if (!t.anchors) {
			st = RW_ERR_NOMEM;
			fail(&ctx, "anchors", "out of memory for %zu anchors", n);
			goto free_root;
		}
	}
	for (size_t i = 0; i < n; i++) {
		if ((st = parse_anchor(&ctx, json_array_get(arr, i), (uint32_t)i, t.anchors)))
			goto free_anchors;
	}
	t.n_anchors = (uint32_t)n;
	json_decref(root);
	*table = t;
	return RW_OK;

free_anchors:
	free(t.anchors);
free_root:
	json_decref(root);
out:
	return st;
}

void rw_sched_anchors_free(rw_anchor_table_t *table)
{
	if (!table)
		return;
	free(table->anchors);
	memset(table, 0, sizeof(*table));
}

/* Build the JSON tree of a table; NULL when out of memory or a value cannot be represented
 * (jansson refuses NaN and infinities). */
static json_t *table_to_json(const rw_anchor_table_t *t)
{
	json_t *root = json_object();
	json_t *fp = json_object();
	json_t *arr = json_array();
	int bad = !root || !fp || !arr;

	if (!bad) {
		bad |= json_object_set_new(root, "schema_version", json_integer(t->schema_version));
		bad |= json_object_set_new(fp, "nodes", json_integer(t->fingerprint.nodes));
		bad |= json_object_set_new(fp, "gpus_per_node", json_integer(t->fingerprint.gpus_per_node));
		bad |= json_object_set_new(fp, "rails", json_integer(t->fingerprint.rails));
		bad |= json_object_set_new(fp, "nic_gbps", json_real(t->fingerprint.nic_gbps));
		bad |= json_object_set_new(fp, "transport",
					   json_stringn(t->fingerprint.transport,
							strnlen(t->fingerprint.transport,
								sizeof(t->fingerprint.transport))));
		bad |= json_object_set(root, "fingerprint", fp);
		bad |= json_object_set_new(root, "max_size_ratio", json_real(t->max_size_ratio));
		bad |= json_object_set_new(root, "shape_tolerance", json_real(t->shape_tolerance));
		bad |= json_object_set(root, "anchors", arr);
	}
	for (uint32_t i = 0; !bad && i < t->n_anchors; i++) {
		const rw_anchor_t *a = &t->anchors[i];
		json_t *o = json_object(), *feat = json_array(), *samples = json_object();
		bad |= !o || !feat || !samples;
		if (!bad) {
			bad |= json_object_set_new(o, "case_id", json_integer(a->case_id));
			for (unsigned k = 0; k < 3; k++)
				bad |= json_array_append_new(feat, json_real(a->feat[k]));
			bad |= json_object_set(o, "features", feat);
			bad |= json_object_set_new(o, "selected",
						   json_string(rw_sched_path_name(a->selected)));
		}
		/* All-zero samples are what parse fills for an absent path: omit them. */
		for (unsigned p = 0; !bad && p < RW_PATH_COUNT; p++) {
			const rw_path_samples_t *s = &a->samples[p];
			if (s->n == 0 && s->median == 0.0 && s->p10 == 0.0 && s->p90 == 0.0)
				continue;
			json_t *so = json_object();
			bad |= !so;
			if (!bad) {
				bad |= json_object_set_new(so, "median", json_real(s->median));
				bad |= json_object_set_new(so, "p10", json_real(s->p10));
				bad |= json_object_set_new(so, "p90", json_real(s->p90));
				bad |= json_object_set_new(so, "n", json_integer(s->n));
				bad |= json_object_set(samples, rw_sched_path_name((rw_path_t)p), so);
			}
			json_decref(so);
		}
		if (!bad) {
			bad |= json_object_set(o, "samples", samples);
			bad |= json_array_append(arr, o);
		}
		json_decref(samples);
		json_decref(feat);
		json_decref(o);
	}
	json_decref(fp);
	json_decref(arr);
	if (bad) {
		json_decref(root);
		return NULL;
	}
	return root;
}

/* Returns 0 when the table cannot be serialised (out of memory, or a NaN/infinite value). */
size_t rw_sched_anchors_format(const rw_anchor_table_t *table, char *buf, size_t buf_len)
{
	json_t *root = table_to_json(table);
	if (!root)
		goto fail;
	/* 17 significant digits: every double survives format -> parse unchanged. */
	char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
	json_decref(root);
	if (!text)
		goto fail;
	size_t need = strlen(text);
	if (buf_len > 0) {
		size_t copy = need < buf_len - 1 ? need : buf_len - 1;
		memcpy(buf, text, copy);
		buf[copy] = '\0';
	}
	free(text);
	return need;

fail:
	if (buf_len > 0)
		buf[0] = '\0';
	return 0;
}

int rw_sched_anchors_match(const rw_anchor_table_t *table, const rw_topo_t *topo,
			   double nic_gbps, const char *transport)
{
	if (!table || !topo || !transport)
		return 0;
	if (table->fingerprint.nodes != topo->nodes ||
	    table->fingerprint.gpus_per_node != topo->gpus_per_node ||
	    table->fingerprint.rails != topo->rails)
		return 0;
	/* The rate is a configured number, but may have passed through a text file: compare to a
	 * relative 1e-6 rather than bit for bit. */
	double a = table->fingerprint.nic_gbps, b = nic_gbps;
	if (!(fabs(a - b) <= 1e-6 * fmax(fabs(a), fabs(b))))
		return 0;
	return strncmp(table->fingerprint.transport, transport, sizeof(table->fingerprint.transport)) == 0 &&
	       strlen(transport) < sizeof(table->fingerprint.transport);
}
