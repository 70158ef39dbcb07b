/* Encoders and validating decoders for railwaved's peer wire formats (service/phase/wire.h,
 * docs/dataflow.md). Decoders see bytes from the network: every length and field is checked
 * before use, and nothing is written to an output parameter unless the whole input is valid. */
#include <string.h>

#include "service/phase/wire.h"

void rw_wire_hdr_pack(const rw_wire_hdr_t *h, uint8_t out[RW_WIRE_HDR_SIZE])
{
	rw_wire_put32(out, RW_WIRE_MAGIC);
	rw_wire_put16(out + 4, RW_WIRE_VERSION);
	rw_wire_put16(out + 6, h->type);
	rw_wire_put32(out + 8, h->length);
	rw_wire_put32(out + 12, h->seq);
}

rw_status_t rw_wire_hdr_unpack(const uint8_t in[RW_WIRE_HDR_SIZE], rw_wire_hdr_t *h_p)
{
	if (rw_wire_get32(in) != RW_WIRE_MAGIC || rw_wire_get16(in + 4) != RW_WIRE_VERSION)
		return RW_ERR_PROTO;
	uint16_t type = rw_wire_get16(in + 6);
	uint32_t length = rw_wire_get32(in + 8);
	if (type < 1 || type > RW_WIRE_TYPE_MAX || length > RW_WIRE_MAX_PAYLOAD)
		return RW_ERR_PROTO;
	h_p->type = type;
	h_p->length = length;
	h_p->seq = rw_wire_get32(in + 12);
	return RW_OK;
}

static int str_field_ok(const char *s, size_t n)
{
	return memchr(s, '\0', n) != NULL;
}

/* Copy a string into a zeroed fixed field, truncating so the field stays NUL-terminated. */
static void str_field_put(uint8_t *field, const char *s, size_t n)
{
	size_t len = strnlen(s, n - 1);
	memcpy(field, s, len);
}

/* ---- HELLO (layout in wire.h) ---- */

#define HELLO_IDS RW_WIRE_CLUSTER_MAX
#define HELLO_FLAGS (HELLO_IDS + 32)
#define HELLO_NONCE (HELLO_FLAGS + 8)

size_t rw_wire_hello_pack(const rw_wire_hello_t *h, uint8_t *buf, size_t buf_len)
{
	if (buf_len < RW_WIRE_HELLO_SIZE)
		return 0;
	memset(buf, 0, RW_WIRE_HELLO_SIZE);
	str_field_put(buf, h->cluster, RW_WIRE_CLUSTER_MAX);
	uint8_t *p = buf + HELLO_IDS;
	rw_wire_put32(p, h->node);
	rw_wire_put32(p + 4, h->nodes);
	rw_wire_put32(p + 8, h->gpus);
	rw_wire_put32(p + 12, h->rails);
	rw_wire_put64(p + 16, h->fingerprint);
	rw_wire_put64(p + 24, h->boot_id);
	rw_wire_put32(buf + HELLO_FLAGS, h->flags);
	memcpy(buf + HELLO_NONCE, h->nonce, RW_WIRE_NONCE_SIZE);
	return RW_WIRE_HELLO_SIZE;
}

rw_status_t rw_wire_hello_unpack(const uint8_t *in, size_t len, rw_wire_hello_t *h_p)
{
	if (len != RW_WIRE_HELLO_SIZE || !str_field_ok((const char *)in, RW_WIRE_CLUSTER_MAX))
		return RW_ERR_PROTO;
	const uint8_t *p = in + HELLO_IDS;
	uint32_t node = rw_wire_get32(p), nodes = rw_wire_get32(p + 4);
	uint32_t gpus = rw_wire_get32(p + 8), rails = rw_wire_get32(p + 12);
	uint32_t flags = rw_wire_get32(in + HELLO_FLAGS);
	if (rails == 0 || rails > RW_MAX_RAILS || nodes == 0 || nodes > RW_MAX_NODES ||
	    node >= nodes || gpus == 0 || gpus > RW_MAX_GPUS || (flags & ~RW_WIRE_HELLO_KEYED) ||
	    rw_wire_get32(in + HELLO_FLAGS + 4) != 0)
		return RW_ERR_PROTO;
	memset(h_p, 0, sizeof(*h_p));
	memcpy(h_p->cluster, in, RW_WIRE_CLUSTER_MAX);
	h_p->node = node;
	h_p->nodes = nodes;
	h_p->gpus = gpus;
	h_p->rails = rails;
	h_p->fingerprint = rw_wire_get64(p + 16);
	h_p->boot_id = rw_wire_get64(p + 24);
	h_p->flags = flags;
	memcpy(h_p->nonce, in + HELLO_NONCE, RW_WIRE_NONCE_SIZE);
	return RW_OK;
}

/* ---- REGIONS: rails reserved (u32) | rails x (desc[32] addr[64]) ---- */

#define REGIONS_FIXED 8
#define REGIONS_PER_RAIL (RW_WIRE_DESC_SIZE + RW_WIRE_ADDR_MAX)

size_t rw_wire_regions_size(uint32_t rails)
{
	return REGIONS_FIXED + (size_t)rails * REGIONS_PER_RAIL;
}

size_t rw_wire_regions_pack(const rw_wire_regions_t *r, uint8_t *buf, size_t buf_len)
{
	if (r->rails == 0 || r->rails > RW_MAX_RAILS)
		return 0;
	size_t need = rw_wire_regions_size(r->rails);
	if (buf_len < need)
		return 0;
	memset(buf, 0, need);
	rw_wire_put32(buf, r->rails);
	uint8_t *p = buf + REGIONS_FIXED;
	for (uint32_t i = 0; i < r->rails; i++, p += REGIONS_PER_RAIL) {
		memcpy(p, r->desc[i], RW_WIRE_DESC_SIZE);
		str_field_put(p + RW_WIRE_DESC_SIZE, r->rail_addr[i], RW_WIRE_ADDR_MAX);
	}
	return need;
}

rw_status_t rw_wire_regions_unpack(const uint8_t *in, size_t len, rw_wire_regions_t *r_p)
{
	if (len < REGIONS_FIXED)
		return RW_ERR_PROTO;
	uint32_t rails = rw_wire_get32(in);
	if (rails == 0 || rails > RW_MAX_RAILS || rw_wire_get32(in + 4) != 0 ||
	    len != rw_wire_regions_size(rails))
		return RW_ERR_PROTO;
	const uint8_t *p = in + REGIONS_FIXED;
	for (uint32_t i = 0; i < rails; i++, p += REGIONS_PER_RAIL)
		if (!str_field_ok((const char *)p + RW_WIRE_DESC_SIZE, RW_WIRE_ADDR_MAX))
			return RW_ERR_PROTO;
	memset(r_p, 0, sizeof(*r_p));
	r_p->rails = rails;
	p = in + REGIONS_FIXED;
	for (uint32_t i = 0; i < rails; i++, p += REGIONS_PER_RAIL) {
		memcpy(r_p->desc[i], p, RW_WIRE_DESC_SIZE);
		memcpy(r_p->rail_addr[i], p + RW_WIRE_DESC_SIZE, RW_WIRE_ADDR_MAX);
	}
	return RW_OK;
}

/* ---- carve-outs ---- */

size_t rw_wire_carve_size(uint32_t rails)
{
	return 8 + (size_t)rails * RW_WIRE_DESC_SIZE;
}

size_t rw_wire_carve_pack(const rw_wire_carve_t *c, uint8_t *buf, size_t buf_len)
{
	if (c->rails == 0 || c->rails > RW_MAX_RAILS || buf_len < rw_wire_carve_size(c->rails))
		return 0;
	rw_wire_put32(buf, c->index);
	rw_wire_put32(buf + 4, c->rails);
	memcpy(buf + 8, c->desc, (size_t)c->rails * RW_WIRE_DESC_SIZE);
	return rw_wire_carve_size(c->rails);
}

rw_status_t rw_wire_carve_unpack(const uint8_t *in, size_t len, rw_wire_carve_t *c_p)
{
	if (len < 8)
		return RW_ERR_PROTO;
	uint32_t rails = rw_wire_get32(in + 4);
	if (rails == 0 || rails > RW_MAX_RAILS || len != rw_wire_carve_size(rails))
		return RW_ERR_PROTO;
	memset(c_p, 0, sizeof(*c_p));
	c_p->index = rw_wire_get32(in);
	c_p->rails = rails;
	memcpy(c_p->desc, in + 8, (size_t)rails * RW_WIRE_DESC_SIZE);
	return RW_OK;
}

/* ---- keys ---- */

static uint32_t fnv1a32(uint32_t h, const uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= 16777619u;
	}
	return h;
}

uint32_t rw_wire_group_hash(const char *name)
{
	return fnv1a32(2166136261u, (const uint8_t *)name, strlen(name));
}

uint32_t rw_wire_key_tag(const rw_wire_key_t *key)
{
	uint8_t b[16];
	rw_wire_put32(b, key->group);
	rw_wire_put32(b + 4, key->layer);
	rw_wire_put64(b + 8, key->step);
	return fnv1a32(2166136261u, b, sizeof(b));
}

static void key_pack(uint8_t *p, const rw_wire_key_t *k)
{
	rw_wire_put32(p, k->group);
	rw_wire_put32(p + 4, k->layer);
	rw_wire_put64(p + 8, k->step);
}

static void key_unpack(const uint8_t *p, rw_wire_key_t *k)
{
	k->group = rw_wire_get32(p);
	k->layer = rw_wire_get32(p + 4);
	k->step = rw_wire_get64(p + 8);
}

/* ---- COUNTS (layout in wire.h) ---- */

#define COUNTS_FIXED (16 + RW_WIRE_GROUP_MAX + 40 + RW_WIRE_KEY_FP_SIZE)

size_t rw_wire_counts_size(uint32_t nodes, uint32_t rails)
{
	return COUNTS_FIXED + ((size_t)nodes * rails + rails + nodes) * 4u;
}

size_t rw_wire_counts_pack(const rw_wire_counts_t *c, uint8_t *buf, size_t buf_len)
{
	size_t need = rw_wire_counts_size(c->nodes, c->rails);
	if (buf_len < need)
		return 0;
	memset(buf, 0, COUNTS_FIXED);
	key_pack(buf, &c->key);
	str_field_put(buf + 16, c->group_name, RW_WIRE_GROUP_MAX);
	uint8_t *p = buf + 16 + RW_WIRE_GROUP_MAX;
	rw_wire_put32(p, c->node);
	rw_wire_put32(p + 4, c->nodes);
	rw_wire_put32(p + 8, c->rails);
	rw_wire_put32(p + 12, c->slot);
	rw_wire_put32(p + 16, c->params.n_experts);
	rw_wire_put32(p + 20, c->params.topk);
	rw_wire_put32(p + 24, c->params.hidden);
	rw_wire_put32(p + 28, c->params.dtype);
	rw_wire_put32(p + 32, c->params.requested_path);
	rw_wire_put32(p + 36, c->params.epoch);
	memcpy(p + 40, c->params.key_fp, RW_WIRE_KEY_FP_SIZE);
	const size_t nr = (size_t)c->nodes * c->rails;
	for (size_t i = 0; i < nr; i++)
		rw_wire_put32(buf + COUNTS_FIXED + 4 * i, c->row[i]);
	uint8_t *view = buf + COUNTS_FIXED + 4 * nr;
	for (uint32_t r = 0; r < c->rails; r++)
		rw_wire_put32(view + 4 * r, c->rail_weight[r]);
	for (uint32_t n = 0; n < c->nodes; n++)
		rw_wire_put32(view + 4 * ((size_t)c->rails + n), c->rail_up[n]);
	return need;
}

/* An rw_path_t, RW_WIRE_PATH_AUTO, or an rw_path_t | RW_WIRE_PATH_BY_RANKS. */
static int path_ok(uint32_t v)
{
	uint32_t p = v & ~RW_WIRE_PATH_BY_RANKS;
	return p < RW_PATH_COUNT || v == RW_WIRE_PATH_AUTO;
}

rw_status_t rw_wire_counts_unpack(const uint8_t *in, size_t len, rw_wire_counts_t *c_p)
{
	if (len < COUNTS_FIXED || !str_field_ok((const char *)in + 16, RW_WIRE_GROUP_MAX))
		return RW_ERR_PROTO;
	rw_wire_counts_t c;
	memset(&c, 0, sizeof(c));
	key_unpack(in, &c.key);
	memcpy(c.group_name, in + 16, RW_WIRE_GROUP_MAX);
	const uint8_t *p = in + 16 + RW_WIRE_GROUP_MAX;
	c.node = rw_wire_get32(p);
	c.nodes = rw_wire_get32(p + 4);
	c.rails = rw_wire_get32(p + 8);
	c.slot = rw_wire_get32(p + 12);
	c.params.n_experts = rw_wire_get32(p + 16);
	c.params.topk = rw_wire_get32(p + 20);
	c.params.hidden = rw_wire_get32(p + 24);
	c.params.dtype = rw_wire_get32(p + 28);
	c.params.requested_path = rw_wire_get32(p + 32);
	c.params.epoch = rw_wire_get32(p + 36);
	memcpy(c.params.key_fp, p + 40, RW_WIRE_KEY_FP_SIZE);
	if (c.nodes == 0 || c.nodes > RW_MAX_NODES || c.node >= c.nodes || c.rails == 0 ||
	    c.rails > RW_MAX_RAILS || c.slot >= RW_WIRE_MAX_SLOTS ||
	    len != rw_wire_counts_size(c.nodes, c.rails))
		return RW_ERR_PROTO;
	if (c.params.epoch == 0 || c.params.topk == 0 || c.params.topk > RW_MAX_TOPK || c.params.n_experts == 0 ||
	    c.params.hidden == 0 || c.params.dtype >= RW_WIRE_DTYPE_COUNT ||
	    !path_ok(c.params.requested_path))
		return RW_ERR_PROTO;
	if (c.key.group != rw_wire_group_hash(c.group_name))
		return RW_ERR_PROTO;
	c.row = NULL;
	c.row_le = in + COUNTS_FIXED;
	c.view_le = c.row_le + 4 * (size_t)c.nodes * c.rails;
	for (uint32_t r = 0; r < c.rails; r++)
		if (rw_wire_counts_weight(&c, r) > RW_MAX_RAIL_WEIGHT)
			return RW_ERR_PROTO;
	for (uint32_t n = 0; n < c.nodes; n++)
		if (rw_wire_counts_up(&c, n) >> c.rails)
			return RW_ERR_PROTO;
	/* Records are counted in 32 bits everywhere after this (a pair's total T, the CSR of a
	 * node's records): a row whose records add up to 2^32 or more would be planned wrapped. */
	uint64_t records = 0;
	for (uint32_t i = 0; i < c.nodes * c.rails; i++)
		records += rw_wire_counts_row(&c, i);
	if (records > UINT32_MAX)
		return RW_ERR_PROTO;
	*c_p = c;
	return RW_OK;
}

uint32_t rw_wire_counts_row(const rw_wire_counts_t *c, uint32_t i)
{
	return rw_wire_get32(c->row_le + 4u * i);
}

uint32_t rw_wire_counts_weight(const rw_wire_counts_t *c, uint32_t rail)
{
	return rw_wire_get32(c->view_le + 4u * rail);
}

uint32_t rw_wire_counts_up(const rw_wire_counts_t *c, uint32_t node)
{
	return rw_wire_get32(c->view_le + 4u * ((size_t)c->rails + node));
}

/* ---- PHASE_ERR: key(16) | kind+relay<<16 status node epoch cause_node cause_id dst_epoch (u32) | msg[128] ---- */

size_t rw_wire_phase_err_pack(const rw_wire_phase_err_t *e, uint8_t *buf, size_t buf_len)
{
	if (buf_len < RW_WIRE_PHASE_ERR_SIZE)
		return 0;
	memset(buf, 0, RW_WIRE_PHASE_ERR_SIZE);
	key_pack(buf, &e->key);
	rw_wire_put32(buf + 16, e->kind | (e->relay ? 1u << 16 : 0));
	rw_wire_put32(buf + 20, (uint32_t)e->status);
	rw_wire_put32(buf + 24, e->node);
	rw_wire_put32(buf + 28, e->epoch);
	rw_wire_put32(buf + 32, e->cause_node);
	rw_wire_put32(buf + 36, e->cause_id);
	rw_wire_put32(buf + 40, e->dst_epoch);
	str_field_put(buf + 44, e->msg, RW_WIRE_ERRMSG_MAX);
	return RW_WIRE_PHASE_ERR_SIZE;
}

rw_status_t rw_wire_phase_err_unpack(const uint8_t *in, size_t len, rw_wire_phase_err_t *e_p)
{
	if (len != RW_WIRE_PHASE_ERR_SIZE || !str_field_ok((const char *)in + 44, RW_WIRE_ERRMSG_MAX))
		return RW_ERR_PROTO;
	uint32_t kind = rw_wire_get32(in + 16) & 0xffffu, relay = rw_wire_get32(in + 16) >> 16;
	int32_t status = (int32_t)rw_wire_get32(in + 20);
	if (kind > 1 || relay > 1 || status >= 0 || status < -1000)
		return RW_ERR_PROTO;
	key_unpack(in, &e_p->key);
	e_p->kind = kind;
	e_p->relay = relay;
	e_p->status = status;
	e_p->node = rw_wire_get32(in + 24);
	e_p->epoch = rw_wire_get32(in + 28);
	e_p->cause_node = rw_wire_get32(in + 32);
	e_p->cause_id = rw_wire_get32(in + 36);
	if (e_p->cause_id == 0)
		return RW_ERR_PROTO;
	e_p->dst_epoch = rw_wire_get32(in + 40);
	memcpy(e_p->msg, in + 44, RW_WIRE_ERRMSG_MAX);
	return RW_OK;
}

/* ---- GRANT: key(16) | kind wave (u32) ---- */

size_t rw_wire_grant_pack(const rw_wire_grant_t *g, uint8_t *buf, size_t buf_len)
{
	if (buf_len < RW_WIRE_GRANT_SIZE)
		return 0;
	key_pack(buf, &g->key);
	rw_wire_put32(buf + 16, g->kind);
	rw_wire_put32(buf + 20, g->wave);
	return RW_WIRE_GRANT_SIZE;
}

rw_status_t rw_wire_grant_unpack(const uint8_t *in, size_t len, rw_wire_grant_t *g_p)
{
	if (len != RW_WIRE_GRANT_SIZE)
		return RW_ERR_PROTO;
	uint32_t kind = rw_wire_get32(in + 16), wave = rw_wire_get32(in + 20);
	if (kind > 1 || wave < 2)
		return RW_ERR_PROTO;
	key_unpack(in, &g_p->key);
	g_p->kind = kind;
	g_p->wave = wave;
	return RW_OK;
}

/* ---- HEARTBEAT ---- */

size_t rw_wire_heartbeat_pack(const rw_wire_heartbeat_t *hb, uint8_t *buf, size_t buf_len)
{
	if (buf_len < RW_WIRE_HEARTBEAT_SIZE)
		return 0;
	rw_wire_put64(buf, hb->stamp);
	rw_wire_put64(buf + 8, hb->echo);
	rw_wire_put64(buf + 16, hb->hold);
	return RW_WIRE_HEARTBEAT_SIZE;
}

rw_status_t rw_wire_heartbeat_unpack(const uint8_t *in, size_t len, rw_wire_heartbeat_t *hb_p)
{
	if (len != RW_WIRE_HEARTBEAT_SIZE)
		return RW_ERR_PROTO;
	hb_p->stamp = rw_wire_get64(in);
	hb_p->echo = rw_wire_get64(in + 8);
	hb_p->hold = rw_wire_get64(in + 16);
	return RW_OK;
}

/* ---- fingerprint ---- */

static uint64_t fnv1a64(uint64_t h, const void *data, size_t n)
{
	const uint8_t *p = data;
	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= 1099511628211ull;
	}
	return h;
}

uint64_t rw_wire_fingerprint(const char *cluster, const rw_topo_t *topo, const char *transport,
			     uint64_t region_bytes)
{
	uint64_t h = 14695981039346656037ull;
	uint8_t b[8];
	h = fnv1a64(h, cluster, strlen(cluster) + 1);
	rw_wire_put32(b, topo->nodes);
	rw_wire_put32(b + 4, topo->gpus_per_node);
	h = fnv1a64(h, b, 8);
	rw_wire_put32(b, topo->rails);
	h = fnv1a64(h, b, 4);
	h = fnv1a64(h, topo->gpu_rail, topo->gpus_per_node);
	h = fnv1a64(h, transport, strlen(transport) + 1);
	rw_wire_put64(b, region_bytes);
	h = fnv1a64(h, b, 8);
	return h;
}

/* ---- records ---- */

void rw_wire_rec_pack(uint8_t *rec, const rw_wire_rec_hdr_t *h, const int32_t *ids,
		      const float *weights)
{
	rw_wire_put32(rec, h->tag);
	rw_wire_put16(rec + 4, (uint16_t)h->src_node);
	rw_wire_put16(rec + 6, (uint16_t)h->owner);
	rw_wire_put32(rec + 8, h->token);
	rw_wire_put16(rec + 12, (uint16_t)h->topk);
	rw_wire_put16(rec + 14, 0);
	uint8_t *p = rec + RW_WIRE_REC_HDR;
	for (uint32_t i = 0; i < h->topk; i++)
		rw_wire_put32(p + 4 * i, (uint32_t)ids[i]);
	p += 4u * h->topk;
	for (uint32_t i = 0; i < h->topk; i++) {
		uint32_t w;
		memcpy(&w, &weights[i], 4);
		rw_wire_put32(p + 4 * i, w);
	}
}

rw_status_t rw_wire_rec_unpack(const uint8_t *rec, uint32_t topk, rw_wire_rec_hdr_t *h_p)
{
	if (rw_wire_get16(rec + 12) != topk)
		return RW_ERR_PROTO;
	h_p->tag = rw_wire_get32(rec);
	h_p->src_node = rw_wire_get16(rec + 4);
	h_p->owner = rw_wire_get16(rec + 6);
	h_p->token = rw_wire_get32(rec + 8);
	h_p->topk = topk;
	return RW_OK;
}

int32_t rw_wire_rec_id(const uint8_t *rec, uint32_t i)
{
	return (int32_t)rw_wire_get32(rec + RW_WIRE_REC_HDR + 4 * i);
}

float rw_wire_rec_weight(const uint8_t *rec, uint32_t topk, uint32_t i)
{
	uint32_t w = rw_wire_get32(rec + RW_WIRE_REC_HDR + 4 * topk + 4 * i);
	float f;
	memcpy(&f, &w, 4);
	return f;
}

void rw_wire_crec_pack(uint8_t *rec, const rw_wire_crec_hdr_t *h)
{
	rw_wire_put32(rec, h->tag);
	rw_wire_put16(rec + 4, (uint16_t)h->src_node);
	rw_wire_put16(rec + 6, (uint16_t)h->rail);
	rw_wire_put32(rec + 8, h->slot);
	rw_wire_put32(rec + 12, 0);
}

void rw_wire_crec_unpack(const uint8_t *rec, rw_wire_crec_hdr_t *h_p)
{
	h_p->tag = rw_wire_get32(rec);
	h_p->src_node = rw_wire_get16(rec + 4);
	h_p->rail = rw_wire_get16(rec + 6);
	h_p->slot = rw_wire_get32(rec + 8);
}
