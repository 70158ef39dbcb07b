/* The configuration loader's nodes[] and gpu_rail (config_int.h): each node and its rails, the
 * cluster-wide checks that names and endpoints are unique, and which node this daemon is. Calls
 * only config_parse.c. */
#include "service/core/config_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
 * nodes[] and gpu_rail
 * ------------------------------------------------------------------------------------------- */

static rw_status_t parse_rail(loader_t *ld, const json_t *v, uint32_t ni, uint32_t ri,
			      rw_svc_rail_cfg_t *rail)
{
	char where[64];
	snprintf(where, sizeof(where), "nodes[%u].rails[%u]", ni, ri);
	rail->device_port = 1;
	rail->rate_gbps = 0; /* = nic_gbps, filled later */
	cfg_set_port(&rail->addr, (uint16_t)ld->cfg->rail_port);
	if (json_is_string(v)) {
		int has_port = 0;
		if (!cfg_parse_addr_port(json_string_value(v), 0, &rail->addr, &has_port))
			return cfg_fail(ld, "%s: '%s' is not an IPv4 address (ADDR or ADDR:PORT)", where,
				    json_string_value(v));
		if (!has_port)
			cfg_set_port(&rail->addr, (uint16_t)ld->cfg->rail_port);
		rail->has_addr = 1;
		return RW_OK;
	}
	if (!json_is_object(v))
		return cfg_fail(ld, "%s: expected an address string or an object, got %s", where,
			    cfg_json_type_name(v));
	const char *key;
	json_t *x;
	json_object_foreach((json_t *)v, key, x) {
		if (key[0] == '_')
			continue; /* comment */
		if (!strcmp(key, "address")) {
			if (!json_is_string(x) || !cfg_parse_ipv4(json_string_value(x), &rail->addr))
				return cfg_fail(ld, "%s.address: not an IPv4 address", where);
			rail->has_addr = 1;
		} else if (!strcmp(key, "port")) {
			if (!json_is_integer(x) || json_integer_value(x) < 1 ||
			    json_integer_value(x) > 65535)
				return cfg_fail(ld, "%s.port: expected an integer in [1, 65535]", where);
		} else if (!strcmp(key, "device")) {
			if (!json_is_string(x) || !json_string_length(x) ||
			    json_string_length(x) >= RW_SVC_DEVICE_MAX || !cfg_is_name(json_string_value(x)))
				return cfg_fail(ld, "%s.device: expected a device name like \"mlx5_0\"", where);
			snprintf(rail->device, sizeof(rail->device), "%s", json_string_value(x));
		} else if (!strcmp(key, "device_port")) {
			if (!json_is_integer(x) || json_integer_value(x) < 1 ||
			    json_integer_value(x) > 255)
				return cfg_fail(ld, "%s.device_port: expected an integer in [1, 255]", where);
			rail->device_port = (uint32_t)json_integer_value(x);
		} else if (!strcmp(key, "rate_gbps")) {
			if (!json_is_number(x) || !(json_number_value(x) >= 0.001 &&
						     json_number_value(x) <= 100000))
				return cfg_fail(ld, "%s.rate_gbps: expected a number in [0.001, 100000]",
					    where);
			rail->rate_gbps = json_number_value(x);
		} else {
			return cfg_fail(ld, "%s.%s: unknown field", where, key);
		}
	}
	json_t *port = json_object_get(v, "port");
	if (port)
		cfg_set_port(&rail->addr, (uint16_t)json_integer_value(port));
	if (!rail->has_addr && !rail->device[0])
		return cfg_fail(ld, "%s: needs an address (or a device for verbs)", where);
	return RW_OK;
}

static rw_status_t parse_node(loader_t *ld, const json_t *v, uint32_t ni, rw_svc_node_cfg_t *node,
			      uint32_t *n_rails_p)
{
	char where[48];
	snprintf(where, sizeof(where), "nodes[%u]", ni);
	if (!json_is_object(v))
		return cfg_fail(ld, "%s: expected an object, got %s", where, cfg_json_type_name(v));
	/* Unknown keys first: a typo ("rail") is named as such, not reported as the key it was
	 * meant to be being missing. */
	static const char *const known[] = { "name", "rails", "host", "control", "ipc_socket",
					     "stats_socket", "http" };
	const char *key;
	json_t *x;
	json_object_foreach((json_t *)v, key, x) {
		size_t k = 0;
		while (k < RW_ARRAY_SIZE(known) && strcmp(key, known[k]))
			k++;
		if (key[0] != '_' && k == RW_ARRAY_SIZE(known))
			return cfg_fail(ld, "%s.%s: unknown field (a node has name, rails, host, control, "
				    "ipc_socket, stats_socket, http)", where, key);
	}
	const json_t *name = json_object_get(v, "name");
	if (!name)
		return cfg_fail(ld, "%s.name: missing", where);
	if (!json_is_string(name) || !cfg_is_name(json_string_value(name)))
		return cfg_fail(ld, "%s.name: expected a name (1-63 of A-Z a-z 0-9 . _ -)", where);
	snprintf(node->name, sizeof(node->name), "%s", json_string_value(name));
	snprintf(node->host, sizeof(node->host), "%s", node->name);

	const json_t *rails = json_object_get(v, "rails");
	if (!rails)
		return cfg_fail(ld, "%s.rails: missing", where);
	if (!json_is_array(rails) || json_array_size(rails) == 0)
		return cfg_fail(ld, "%s.rails: expected a non-empty array", where);
	if (json_array_size(rails) > RW_MAX_RAILS)
		return cfg_fail(ld, "%s.rails: %zu rails, at most %d supported", where,
			    json_array_size(rails), RW_MAX_RAILS);
	size_t ri;
	json_t *rv;
	json_array_foreach(rails, ri, rv) {
		rw_status_t st = parse_rail(ld, rv, ni, (uint32_t)ri, &node->rails[ri]);
		if (st)
			return st;
	}
	*n_rails_p = (uint32_t)json_array_size(rails);

	int has_control = 0;
	json_object_foreach((json_t *)v, key, x) {
		if (key[0] == '_' || !strcmp(key, "name") || !strcmp(key, "rails"))
			continue;
		if (!strcmp(key, "host")) {
			if (!json_is_string(x) || !json_string_length(x) ||
			    json_string_length(x) >= RW_SVC_HOST_MAX)
				return cfg_fail(ld, "%s.host: expected a host name", where);
			snprintf(node->host, sizeof(node->host), "%s", json_string_value(x));
		} else if (!strcmp(key, "control")) {
			int has_port = 0;
			if (!json_is_string(x) ||
			    !cfg_parse_addr_port(json_string_value(x), 0, &node->control, &has_port))
				return cfg_fail(ld, "%s.control: not an IPv4 address (ADDR or ADDR:PORT)",
					    where);
			if (!has_port)
				cfg_set_port(&node->control, (uint16_t)ld->cfg->control_port);
			has_control = 1;
		} else if (!strcmp(key, "ipc_socket") || !strcmp(key, "stats_socket")) {
			char *dst = key[0] == 'i' ? node->ipc_socket : node->stats_socket;
			if (!json_is_string(x) || json_string_length(x) >= RW_SVC_SOCK_MAX)
				return cfg_fail(ld, "%s.%s: expected a path shorter than %d bytes", where,
					    key, RW_SVC_SOCK_MAX);
			if (!json_string_length(x) && key[0] == 'i')
				return cfg_fail(ld, "%s.%s: must not be empty", where, key);
			/* An empty per-node stats_socket turns it off: keep a marker. */
			snprintf(dst, RW_SVC_SOCK_MAX, "%s", json_string_length(x) ?
				 json_string_value(x) : "\x01");
		} else if (!strcmp(key, "http")) {
			const char *s = json_is_string(x) ? json_string_value(x) :
				(json_is_integer(x) && json_integer_value(x) == 0) ? "0" : NULL;
			int en;
			rw_svc_endpoint_t ep;
			if (!s || strlen(s) >= sizeof(node->http) || !cfg_parse_http(s, &en, &ep))
				return cfg_fail(ld, "%s.http: not an IPv4 ADDR:PORT (or 0 = off)", where);
			snprintf(node->http, sizeof(node->http), "%s", *s ? s : "0");
		} else {
			return cfg_fail(ld, "%s.%s: unknown field", where, key);
		}
	}
	if (!has_control) {
		if (!node->rails[0].has_addr)
			return cfg_fail(ld, "%s.control: missing (rails[0] has no address to default to)",
				    where);
		node->control = node->rails[0].addr;
		cfg_set_port(&node->control, (uint16_t)ld->cfg->control_port);
	}
	return RW_OK;
}

typedef struct ep_ref {
	uint32_t ip, port;
	uint32_t node, rail; /* rail == UINT32_MAX: the control endpoint */
} ep_ref_t;

static int ep_cmp(const void *a, const void *b)
{
	const ep_ref_t *x = a, *y = b;
	if (x->ip != y->ip)
		return x->ip < y->ip ? -1 : 1;
	if (x->port != y->port)
		return x->port < y->port ? -1 : 1;
	if (x->node != y->node)
		return x->node < y->node ? -1 : 1;
	return x->rail < y->rail ? -1 : x->rail > y->rail;
}

static void ep_name(const ep_ref_t *e, char *buf, size_t len)
{
	if (e->rail == UINT32_MAX)
		snprintf(buf, len, "nodes[%u].control", e->node);
	else
		snprintf(buf, len, "nodes[%u].rails[%u]", e->node, e->rail);
}

/* Every control and rail endpoint (address:port) must be unique across the cluster. */
rw_status_t cfg_check_duplicates(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	size_t n = 0, cap = (size_t)cfg->n_nodes * (cfg->rails + 1);
	ep_ref_t *eps = calloc(cap, sizeof(*eps));
	if (!eps)
		return RW_ERR_NOMEM;
	for (uint32_t i = 0; i < cfg->n_nodes; i++) {
		const rw_svc_node_cfg_t *nd = &cfg->nodes[i];
		eps[n++] = (ep_ref_t){nd->control.sin.sin_addr.s_addr, nd->control.port, i, UINT32_MAX};
		for (uint32_t r = 0; r < cfg->rails; r++)
			if (nd->rails[r].has_addr)
				eps[n++] = (ep_ref_t){nd->rails[r].addr.sin.sin_addr.s_addr,
						      nd->rails[r].addr.port, i, r};
	}
	qsort(eps, n, sizeof(*eps), ep_cmp);
	rw_status_t st = RW_OK;
	for (size_t k = 1; k < n; k++) {
		if (eps[k].ip != eps[k - 1].ip || eps[k].port != eps[k - 1].port)
			continue;
		char a[48], b[48];
		ep_name(&eps[k], a, sizeof(a));
		ep_name(&eps[k - 1], b, sizeof(b));
		const rw_svc_endpoint_t *e = eps[k].rail == UINT32_MAX ?
			&cfg->nodes[eps[k].node].control : &cfg->nodes[eps[k].node].rails[eps[k].rail].addr;
		st = cfg_fail(ld, "%s%s: duplicate address %s:%u, also used by %s", a,
			  eps[k].rail == UINT32_MAX ? "" : ".address", e->text, e->port, b);
		break;
	}
	free(eps);
	return st;
}

static int name_cmp(const void *a, const void *b, void *nodes)
{
	const rw_svc_node_cfg_t *nd = nodes;
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	int c = strcmp(nd[x].name, nd[y].name);
	return c ? c : (x > y) - (x < y);
}

/* Node names are unique (sorted, so that 4096-node clusters load fast). */
static rw_status_t check_names(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	uint32_t *idx = malloc(cfg->n_nodes * sizeof(*idx));
	if (!idx)
		return RW_ERR_NOMEM;
	for (uint32_t i = 0; i < cfg->n_nodes; i++)
		idx[i] = i;
	qsort_r(idx, cfg->n_nodes, sizeof(*idx), name_cmp, cfg->nodes);
	rw_status_t st = RW_OK;
	for (uint32_t k = 1; k < cfg->n_nodes && !st; k++)
		if (!strcmp(cfg->nodes[idx[k]].name, cfg->nodes[idx[k - 1]].name))
			st = cfg_fail(ld, "nodes[%u].name: duplicate name '%s' (also nodes[%u])", idx[k],
				  cfg->nodes[idx[k]].name, idx[k - 1]);
	free(idx);
	return st;
}

/* Node names unique; every node has the same rail count. */
rw_status_t cfg_parse_nodes(loader_t *ld, const json_t *nodes)
{
	rw_svc_config_t *cfg = ld->cfg;
	if (!json_is_array(nodes) || json_array_size(nodes) == 0)
		return cfg_fail(ld, "nodes: expected a non-empty array");
	if (json_array_size(nodes) > RW_MAX_NODES)
		return cfg_fail(ld, "nodes: %zu nodes, at most %d supported", json_array_size(nodes),
			    RW_MAX_NODES);
	cfg->n_nodes = (uint32_t)json_array_size(nodes);
	cfg->nodes = calloc(cfg->n_nodes, sizeof(*cfg->nodes));
	if (!cfg->nodes)
		return RW_ERR_NOMEM;
	size_t i;
	json_t *v;
	json_array_foreach(nodes, i, v) {
		uint32_t n_rails = 0;
		rw_status_t st = parse_node(ld, v, (uint32_t)i, &cfg->nodes[i], &n_rails);
		if (st)
			return st;
		if (i == 0)
			cfg->rails = n_rails;
		else if (n_rails != cfg->rails)
			return cfg_fail(ld, "nodes[%zu].rails: %u rails, but nodes[0] has %u (every node "
				    "needs the same rail count)", i, n_rails, cfg->rails);
	}
	return check_names(ld);
}

rw_status_t cfg_parse_gpu_rail(loader_t *ld, const json_t *v)
{
	rw_svc_config_t *cfg = ld->cfg;
	if (!json_is_array(v))
		return cfg_fail(ld, "gpu_rail: expected an array of rail indices");
	if (json_array_size(v) != cfg->gpus_per_node)
		return cfg_fail(ld, "gpu_rail: %zu entries, but gpus_per_node is %u",
			    json_array_size(v), cfg->gpus_per_node);
	size_t g;
	json_t *x;
	json_array_foreach(v, g, x) {
		if (!json_is_integer(x) || json_integer_value(x) < 0 ||
		    json_integer_value(x) >= cfg->rails)
			return cfg_fail(ld, "gpu_rail[%zu]: expected a rail index in [0, %u]", g,
				    cfg->rails - 1);
		cfg->gpu_rail[g] = (uint8_t)json_integer_value(x);
	}
	return RW_OK;
}

/* ---------------------------------------------------------------------------------------------
 * This node's identity
 * ------------------------------------------------------------------------------------------- */

rw_status_t cfg_find_me(loader_t *ld)
{
	rw_svc_config_t *cfg = ld->cfg;
	if (ld->node_sel[0]) {
		/* A name first (a node may be called "3"), then an index. */
		for (uint32_t i = 0; i < cfg->n_nodes; i++)
			if (!strcmp(cfg->nodes[i].name, ld->node_sel)) {
				cfg->me = i;
				return RW_OK;
			}
		unsigned long long idx;
		if (cfg_parse_uint(ld->node_sel, 0, UINT32_MAX, &idx)) {
			if (idx >= cfg->n_nodes) {
				cfg_fail(ld, "node: index %llu out of range (the cluster has %u nodes)", idx,
				     cfg->n_nodes);
				return RW_ERR_NOTFOUND;
			}
			cfg->me = (uint32_t)idx;
			return RW_OK;
		}
		cfg_fail(ld, "node: '%s' not found in nodes[] (%u nodes: %s%s%s)", ld->node_sel,
		     cfg->n_nodes, cfg->nodes[0].name, cfg->n_nodes > 1 ? ", " : "",
		     cfg->n_nodes > 2 ? "..." : cfg->n_nodes > 1 ? cfg->nodes[1].name : "");
		return RW_ERR_NOTFOUND;
	}
	char host[RW_SVC_HOST_MAX] = "";
	if (gethostname(host, sizeof(host) - 1) != 0)
		host[0] = '\0';
	char short_host[RW_SVC_HOST_MAX];
	snprintf(short_host, sizeof(short_host), "%s", host);
	char *dot = strchr(short_host, '.');
	if (dot)
		*dot = '\0';
	int found = -1;
	for (uint32_t i = 0; i < cfg->n_nodes && host[0]; i++) {
		const char *h = cfg->nodes[i].host;
		if (strcmp(h, host) && strcmp(h, short_host))
			continue;
		if (found >= 0)
			return cfg_fail(ld, "node: host name '%s' matches nodes[%d] and nodes[%u]; pass "
				    "--node NAME|INDEX", host, found, i);
		found = (int)i;
	}
	if (found < 0) {
		cfg_fail(ld, "node: this host ('%s') matches no nodes[].host; pass --node NAME|INDEX "
		     "or set RAILWAVE_NODE", host);
		return RW_ERR_NOTFOUND;
	}
	cfg->me = (uint32_t)found;
	return RW_OK;
}
