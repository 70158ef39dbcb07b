/* The configuration loader's private header: what its files share. Only service/core/config*.c
 * include it. Files and who calls whom:
 *   config.c         the field table and the flags' table, defaults, the file / environment / flag
 *                    passes, checks across fields, and the public load, free and topo functions.
 *   config_nodes.c   nodes[] and gpu_rail, unique names and endpoints, this node's identity.
 *   config_dump.c    --dump-config (reads config.c's field table; calls nothing there).
 *   config_parse.c   primitive parsers, enum names, and the error helper cfg_fail().
 * config.c calls config_nodes.c and config_parse.c; config_nodes.c and config_dump.c call only
 * config_parse.c; config_parse.c calls no other config file. No file calls back up that order. */
#ifndef RW_SVC_CONFIG_INT_H
#define RW_SVC_CONFIG_INT_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "service/core/svc.h"

/* ---------------------------------------------------------------------------------------------
 * Scalar top-level fields (the table itself is in config.c)
 * ------------------------------------------------------------------------------------------- */

typedef enum field_kind {
	K_NAME,      /* [A-Za-z0-9._-]{1,63} */
	K_NODE,      /* node name or index (identity) */
	K_SOCK,      /* Unix socket path template ("{node}" expands) */
	K_FILE,      /* other path; "" allowed */
	K_GROUP,     /* group name; "" allowed */
	K_U32,
	K_F64,
	K_TRANSPORT,
	K_LOGLEVEL,
	K_FORCEPATH,
	K_RAILWEIGHTS, /* "config" | "measured" */
	K_HTTP,      /* "ADDR:PORT" | "0" | "off" | "" */
	K_BOOL,      /* JSON true/false; text on|off, true|false, yes|no, 1|0 */
} field_kind_t;

typedef struct field {
	const char *key;
	field_kind_t kind;
	size_t off;          /* into rw_svc_config_t (unused for K_NODE and K_HTTP) */
	size_t size;         /* string capacity */
	double min, max;     /* numeric range, inclusive */
} field_t;

/* config.c's table, for the dump; config_n_fields <= CONFIG_FIELDS_MAX (a static assert there). */
extern const field_t *const config_fields;
extern const size_t config_n_fields;

#define CONFIG_FIELDS_MAX 64 /* bound of loader_t.src; raise it when the table outgrows it */

/* ---------------------------------------------------------------------------------------------
 * The loader: one per load, on the stack of rw_svc_config_load_text
 * ------------------------------------------------------------------------------------------- */

typedef enum source {
	SRC_DEFAULT = 0,
	SRC_FILE,
	SRC_NODE,
	SRC_ENV,
	SRC_FLAG,
} source_t;

typedef struct loader {
	rw_svc_config_t *cfg;
	char *err;
	size_t err_len;
	source_t src[CONFIG_FIELDS_MAX]; /* per field of the table: where its value came from */
	char node_sel[RW_SVC_NAME_MAX];
	char http_text[64];
} loader_t;

/* ---------------------------------------------------------------------------------------------
 * config_parse.c: leaves. The int-returning parsers return 1 if valid, 0 if not, and write their
 * outputs only when valid; the caller writes the message (it knows the field's name).
 * ------------------------------------------------------------------------------------------- */

extern const char *const cfg_log_level_names[RW_LOG_DEBUG + 1]; /* indexed by rw_log_level_t */

/* Write the message into the loader's error buffer; returns RW_ERR_PARSE. */
rw_status_t cfg_fail(loader_t *ld, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int cfg_is_name(const char *s); /* [A-Za-z0-9._-]{1,63} */
const char *cfg_json_type_name(const json_t *v); /* "an object", "a string", ... for messages */
int cfg_parse_ipv4(const char *s, rw_svc_endpoint_t *ep);
void cfg_set_port(rw_svc_endpoint_t *ep, uint16_t port);
int cfg_parse_uint(const char *s, unsigned long long min, unsigned long long max,
	       unsigned long long *v_p);
int cfg_parse_addr_port(const char *s, int allow_zero, rw_svc_endpoint_t *ep, int *has_port_p);
int cfg_parse_http(const char *s, int *enabled_p, rw_svc_endpoint_t *ep);
int cfg_lookup_name(const char *const *names, size_t n, const char *s); /* index, or -1 */

/* ---------------------------------------------------------------------------------------------
 * config_nodes.c: each fails through cfg_fail() (or returns RW_ERR_NOMEM) and returns the status.
 * ------------------------------------------------------------------------------------------- */

/* nodes[] into ld->cfg->nodes (allocated here; rw_svc_config_free frees it) and ->rails. The
 * rails' and control endpoints' default ports come from ld->cfg, so the scalars come first. */
rw_status_t cfg_parse_nodes(loader_t *ld, const json_t *nodes);
rw_status_t cfg_parse_gpu_rail(loader_t *ld, const json_t *v); /* after parse_nodes */
rw_status_t cfg_check_duplicates(loader_t *ld); /* every control and rail ADDR:PORT unique */
/* ld->cfg->me from ld->node_sel (name, then index) or else the host name. RW_ERR_NOTFOUND when
 * no node matches. */
rw_status_t cfg_find_me(loader_t *ld);

#endif
