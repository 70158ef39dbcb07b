/* --dump-config: the effective configuration as JSON, walking the same field table as the loader
 * (config.c) so that every field round-trips. Calls only config_parse.c (enum names). */
#include "service/core/config_int.h"

#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * --dump-config
 * ------------------------------------------------------------------------------------------- */

static json_t *ep_json(const rw_svc_endpoint_t *ep)
{
	char buf[32];
	snprintf(buf, sizeof(buf), "%s:%u", ep->text, ep->port);
	return json_string(buf);
}

/* json_object_set_new that records allocation failure instead of leaking. */
static void put(json_t *obj, const char *key, json_t *v, int *oom)
{
	if (!v || json_object_set_new(obj, key, v))
		*oom = 1;
}

char *rw_svc_config_dump(const rw_svc_config_t *cfg)
{
	int oom = 0;
	json_t *root = json_object();
	if (!root)
		return NULL;
	const char *base = (const char *)cfg;
	for (size_t i = 0; i < config_n_fields; i++) {
		const field_t *f = &config_fields[i];
		json_t *v = NULL;
		switch (f->kind) {
		case K_NAME:
		case K_SOCK:
		case K_FILE:
		case K_GROUP:
			v = json_string(base + f->off);
			break;
		case K_NODE:
			v = json_string(cfg->nodes[cfg->me].name);
			break;
		case K_U32:
			v = json_integer(*(const uint32_t *)(const void *)(base + f->off));
			break;
		case K_F64:
			v = json_real(*(const double *)(const void *)(base + f->off));
			break;
		case K_TRANSPORT:
			v = json_string(rw_svc_transport_name(cfg->transport));
			break;
		case K_LOGLEVEL:
			v = json_string(cfg_log_level_names[cfg->log_level]);
			break;
		case K_FORCEPATH:
			v = json_string(cfg->force_path == RW_SVC_PATH_AUTO ? "auto" :
					rw_sched_path_name((rw_path_t)cfg->force_path));
			break;
		case K_RAILWEIGHTS:
			v = json_string(cfg->rail_weights_measured ? "measured" : "config");
			break;
		case K_HTTP:
			v = cfg->http_enabled ? ep_json(&cfg->http) : json_string("0");
			break;
		case K_BOOL:
			v = json_boolean(*(const int *)(const void *)(base + f->off));
			break;
		}
		put(root, f->key, v, &oom);
	}
	json_t *gr = json_array();
	for (uint32_t g = 0; gr && g < cfg->gpus_per_node; g++)
		if (json_array_append_new(gr, json_integer(cfg->gpu_rail[g])))
			oom = 1;
	put(root, "gpu_rail", gr, &oom);

	json_t *nodes = json_array();
	put(root, "nodes", nodes, &oom);
	for (uint32_t i = 0; nodes && i < cfg->n_nodes; i++) {
		const rw_svc_node_cfg_t *nd = &cfg->nodes[i];
		json_t *n = json_object();
		if (!n || json_array_append_new(nodes, n)) {
			oom = 1;
			break;
		}
		put(n, "name", json_string(nd->name), &oom);
		if (strcmp(nd->host, nd->name))
			put(n, "host", json_string(nd->host), &oom);
		put(n, "control", ep_json(&nd->control), &oom);
		/* This node's overrides are already folded into the top-level values. */
		if (i != cfg->me) {
			if (nd->ipc_socket[0])
				put(n, "ipc_socket", json_string(nd->ipc_socket), &oom);
			if (nd->stats_socket[0])
				put(n, "stats_socket", json_string(nd->stats_socket[0] == '\x01' ?
								   "" : nd->stats_socket), &oom);
			if (nd->http[0])
				put(n, "http", json_string(nd->http), &oom);
		}
		json_t *rails = json_array();
		put(n, "rails", rails, &oom);
		for (uint32_t r = 0; rails && r < cfg->rails; r++) {
			const rw_svc_rail_cfg_t *rl = &nd->rails[r];
			json_t *ro = json_object();
			if (!ro || json_array_append_new(rails, ro)) {
				oom = 1;
				break;
			}
			if (rl->has_addr) {
				put(ro, "address", json_string(rl->addr.text), &oom);
				put(ro, "port", json_integer(rl->addr.port), &oom);
			}
			if (rl->device[0]) {
				put(ro, "device", json_string(rl->device), &oom);
				put(ro, "device_port", json_integer(rl->device_port), &oom);
			}
			put(ro, "rate_gbps", json_real(rl->rate_gbps), &oom);
		}
	}
	char *out = oom ? NULL : json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
	json_decref(root);
	return out;
}
