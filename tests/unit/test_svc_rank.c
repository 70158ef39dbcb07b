/* tests/unit/test_svc_rank.c: the rank path's arithmetic on the daemon's side
 * (service/mover/mover_rank.c) against the host mover's own: over random clusters, workloads
 * and paths, every record of every local rank, looked up in its plan block the way its pack
 * kernel does (rw_page_plan_find), lands exactly where the host mover's pack puts it (the CSR of
 * rw_sched_records, rw_sched_map_rail, the layout's out_first), records for this node in the local
 * area in segment order; no two records share a place. Records packed there with the host's
 * record writer pass the daemon's check, and each lie a rank's kernel could write fails it,
 * named. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "service/mover/mover.h"
#include "service/phase/phase.h"
#include "tests/unit/test_rng.h"

#define REC_AREA (1u << 20) /* bytes between one rail's send area and its local area */

typedef struct cluster {
	uint32_t N, G, R, E, topk, me;
	rw_topo_t topo;
	rw_rank_tokens_t rt[RW_MAX_GPUS];
	int32_t *ids[RW_MAX_GPUS];
	float *w[RW_MAX_GPUS];
	uint32_t *rank_row[RW_MAX_GPUS]; /* each local rank's own count row */
	uint32_t *counts;                /* N x N x R */
	uint32_t *offset;                /* this node's CSR */
	rw_record_t *rec;
	rw_svc_layout_t layout;
	uint32_t tag_to[64];
	rw_svc_phase_t ph;
	rw_page_plan_rail_t areas[RW_MAX_RAILS];
	uint8_t *slab[RW_MAX_RAILS];
} cluster_t;

static void make_ids(int32_t *ids, uint32_t n, uint32_t topk, uint32_t E)
{
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t k = 0; k < topk; k++) {
			int32_t e;
			int dup;
			do {
				e = rng_below(5) == 0 ? -1 : (int32_t)rng_below(E);
				dup = 0;
				for (uint32_t j = 0; j < k && e >= 0; j++)
					dup |= ids[t * topk + j] == e;
			} while (dup);
			ids[t * topk + k] = e;
		}
}

static void cluster_make(cluster_t *c, rw_path_t path)
{
	memset(c, 0, sizeof(*c));
	c->N = 2 + rng_below(5);
	c->G = 1 + rng_below(6);
	c->R = 1 + rng_below(4);
	c->E = c->N * c->G * (1 + rng_below(3));
	c->topk = 1 + rng_below(RW_MIN(8u, c->E));
	c->me = rng_below(c->N);
	assert_int_equal(rw_sched_topo_init(&c->topo, c->N, c->G, c->R), RW_OK);
	for (uint32_t g = 0; g < c->G; g++) /* ranks of a rail need not be neighbours */
		c->topo.gpu_rail[g] = (uint8_t)rng_below(c->R);
	const size_t cells = (size_t)c->N * c->R;
	c->counts = calloc((size_t)c->N * cells, sizeof(uint32_t));
	assert_non_null(c->counts);
	for (uint32_t n = 0; n < c->N; n++) {
		uint32_t *row = c->counts + (size_t)n * cells;
		if (n != c->me) { /* another node's demand: any row of its ranks' rails */
			for (uint32_t d = 0; d < c->N; d++)
				for (uint32_t r = 0; r < c->R; r++)
					row[d * c->R + r] = rng_below(40);
			continue;
		}
		for (uint32_t g = 0; g < c->G; g++) {
			uint32_t n_tok = rng_below(60);
			c->ids[g] = calloc((size_t)n_tok * c->topk + 1, sizeof(int32_t));
			c->w[g] = calloc((size_t)n_tok * c->topk + 1, sizeof(float));
			c->rank_row[g] = calloc(cells, sizeof(uint32_t));
			make_ids(c->ids[g], n_tok, c->topk, c->E);
			for (uint32_t i = 0; i < n_tok * c->topk; i++)
				c->w[g][i] = (float)i;
			c->rt[g] = (rw_rank_tokens_t){ .local_gpu = g, .n_tokens = n_tok,
						       .topk = c->topk, .expert_ids = c->ids[g] };
			assert_int_equal(rw_sched_count(&c->topo, c->E, c->me, &c->rt[g], 1,
							c->rank_row[g], NULL), RW_OK);
		}
		assert_int_equal(rw_sched_count(&c->topo, c->E, c->me, c->rt, c->G, row, NULL), RW_OK);
		c->offset = calloc(cells + 1, sizeof(uint32_t));
		rw_sched_prefix(row, (uint32_t)cells, c->offset);
		c->rec = calloc((size_t)c->offset[cells] + 1, sizeof(rw_record_t));
		assert_int_equal(rw_sched_records(&c->topo, c->E, c->me, c->rt, c->G, c->offset,
						  c->rec), RW_OK);
	}
	assert_int_equal(rw_svc_layout_alloc(&c->layout, c->N, c->R), RW_OK);
	assert_int_equal(rw_svc_layout_build(&c->layout, &c->topo, path, c->me, c->counts), RW_OK);
	for (uint32_t d = 0; d < c->N; d++)
		c->tag_to[d] = 0x1000u + d * 7u;
	c->ph = (rw_svc_phase_t){ .nodes = c->N, .rails = c->R, .gpus = c->G, .me = c->me,
				  .n_experts = c->E, .topk = c->topk, .hidden = 8,
				  .dtype = RW_WIRE_F32, .tag_in = 0x77u, .tag_to = c->tag_to,
				  .layout = &c->layout, .row_off = c->offset, .rec = c->rec,
				  .topo = &c->topo };
	c->ph.row_bytes = rw_wire_row_bytes(8, RW_WIRE_F32);
	c->ph.rec_size = rw_wire_rec_size(c->topk, 8, RW_WIRE_F32);
	for (uint32_t r = 0; r < c->R; r++) {
		/* a send area somewhere in the slab, the local area after it */
		c->areas[r] = (rw_page_plan_rail_t){ .send_off = 64u * (1 + rng_below(8)),
						     .local_off = REC_AREA, .slab_bytes = 2 * REC_AREA };
		c->slab[r] = calloc(2 * REC_AREA, 1);
		assert_non_null(c->slab[r]);
	}
	for (uint32_t d = 0; d < c->N; d++)
		for (uint32_t r = 0; r < c->R; r++) /* the test's slab holds every record */
			assert_true(((uint64_t)c->offset[c->N * c->R] + 1) * c->ph.rec_size < REC_AREA -
				    c->areas[r].send_off);
}

static void cluster_free(cluster_t *c)
{
	for (uint32_t g = 0; g < c->G; g++) {
		free(c->ids[g]);
		free(c->w[g]);
		free(c->rank_row[g]);
	}
	for (uint32_t r = 0; r < c->R; r++)
		free(c->slab[r]);
	free(c->counts);
	free(c->offset);
	free(c->rec);
	rw_svc_layout_free(&c->layout);
}

/* Where the host mover's pack (dispatch_pack) puts each record of this node: where[i] for record
 * i of the CSR, as (rail << 40) | byte offset; local records at their segment position. */
static uint64_t *host_places(const cluster_t *c)
{
	const uint32_t R = c->R;
	uint64_t *where = calloc((size_t)c->offset[c->N * R] + 1, sizeof(uint64_t));
	uint8_t *egress = calloc((size_t)c->offset[c->N * R] + 1, 1);
	uint32_t *slot = calloc((size_t)c->offset[c->N * R] + 1, sizeof(uint32_t));
	assert_non_null(where);
	for (uint32_t d = 0; d < c->N; d++)
		for (uint32_t r = 0; r < R; r++) {
			uint32_t first = c->offset[d * R + r], cnt = c->offset[d * R + r + 1] - first;
			if (d == c->me) {
				for (uint32_t i = 0; i < cnt; i++)
					where[first + i] = ((uint64_t)r << 40) |
							   (c->areas[r].local_off + (uint64_t)i * c->ph.rec_size);
				continue;
			}
			if (!cnt)
				continue;
			rw_sched_map_rail(&c->layout.out_pairs[d], r, egress, slot);
			for (uint32_t i = 0; i < cnt; i++) {
				uint32_t e = egress[i];
				where[first + i] = ((uint64_t)e << 40) |
						   (c->areas[e].send_off +
						    ((uint64_t)c->layout.out_first[d * R + e] + slot[i]) *
							    c->ph.rec_size);
			}
		}
	free(egress);
	free(slot);
	return where;
}

/* Does token t of rank g have an expert on node d? */
static int token_goes(const cluster_t *c, uint32_t g, uint32_t t, uint32_t d)
{
	for (uint32_t k = 0; k < c->topk; k++) {
		int32_t e = c->ids[g][t * c->topk + k];
		if (e >= 0 && rw_sched_expert_node(c->E, c->N, (uint32_t)e) == d)
			return 1;
	}
	return 0;
}

typedef struct plan_block {
	rw_page_plan_head_t head;
	uint32_t tags[64];
	rw_page_plan_entry_t entry[64 * RW_MAX_RAILS];
} plan_block_t;

static void plan_all(cluster_t *c, plan_block_t *pb)
{
	for (uint32_t g = 0; g < c->G; g++)
		rw_svc_rank_plan(&c->ph, g, (const uint32_t *const *)c->rank_row, c->areas, 9,
				 &pb[g].head, pb[g].tags, pb[g].entry);
}

static void test_plan_matches_host_pack(void **state)
{
	(void)state;
	seed_rng("test_plan_matches_host_pack");
	const rw_path_t paths[] = { RW_PATH_NATIVE, RW_PATH_RAIL_ONLY, RW_PATH_PERM_ONLY,
				    RW_PATH_JOINT };
	for (int it = 0; it < 400; it++) {
		cluster_t c;
		cluster_make(&c, paths[it % 4]);
		uint64_t *where = host_places(&c);
		plan_block_t *pb = calloc(c.G, sizeof(*pb));
		assert_non_null(pb);
		plan_all(&c, pb);
		/* the oracle by (rank, token, node): the CSR walked in order */
		const uint32_t R = c.R;
		uint64_t n_seen = 0;
		for (uint32_t d = 0; d < c.N; d++)
			for (uint32_t g = 0; g < c.G; g++) {
				const uint32_t r = c.topo.gpu_rail[g];
				assert_int_equal(pb[g].head.owner, g);
				assert_int_equal(pb[g].head.phase, 9);
				assert_int_equal(pb[g].tags[d], d == c.me ? c.ph.tag_in : c.tag_to[d]);
				uint32_t i = 0; /* g's records to d, in token order */
				for (uint32_t t = 0; t < c.rt[g].n_tokens; t++) {
					if (!token_goes(&c, g, t, d))
						continue;
					uint32_t rail = 0;
					uint64_t off = 0;
					assert_int_equal(rw_page_plan_find(pb[g].entry, R, d, i,
									   (uint32_t)c.ph.rec_size,
									   &rail, &off), 0);
					/* find (g, t) in segment (d, r) of the CSR */
					uint32_t j = c.offset[d * R + r];
					while (j < c.offset[d * R + r + 1] &&
					       (c.rec[j].rank != g || c.rec[j].token != t))
						j++;
					assert_true(j < c.offset[d * R + r + 1]);
					assert_int_equal(((uint64_t)rail << 40) | off, where[j]);
					i++;
					n_seen++;
				}
				uint32_t rail;
				uint64_t off; /* nothing past its records */
				assert_int_equal(rw_page_plan_find(pb[g].entry, R, d, i,
								   (uint32_t)c.ph.rec_size, &rail, &off), -1);
			}
		assert_int_equal(n_seen, c.offset[c.N * R]); /* every record of the node, once */
		uint64_t send = 0, local = 0;
		for (uint32_t g = 0; g < c.G; g++) {
			send += pb[g].head.n_send;
			local += pb[g].head.n_local;
		}
		assert_int_equal(local, c.offset[(c.me + 1) * R] - c.offset[c.me * R]);
		assert_int_equal(send + local, c.offset[c.N * R]);
		free(pb);
		free(where);
		cluster_free(&c);
	}
}

/* Pack every record of rank g where its plan says, as its kernel would (the host's writer). */
static void pack_rank(cluster_t *c, const plan_block_t *pb, uint32_t g)
{
	for (uint32_t d = 0; d < c->N; d++) {
		uint32_t i = 0;
		for (uint32_t t = 0; t < c->rt[g].n_tokens; t++) {
			if (!token_goes(c, g, t, d))
				continue;
			uint32_t rail = 0;
			uint64_t off = 0;
			assert_int_equal(rw_page_plan_find(pb->entry, c->R, d, i++,
							   (uint32_t)c->ph.rec_size, &rail, &off), 0);
			rw_wire_rec_hdr_t h = { .tag = pb->tags[d], .src_node = c->me, .owner = g,
						.token = t, .topk = c->topk };
			rw_wire_rec_pack(c->slab[rail] + off, &h, c->ids[g] + (size_t)t * c->topk,
					 c->w[g] + (size_t)t * c->topk);
		}
	}
}

/* The first record of rank g (any destination): its bytes, or NULL when it has none. */
static uint8_t *first_record(cluster_t *c, const plan_block_t *pb, uint32_t *d_p)
{
	for (uint32_t d = 0; d < c->N; d++) {
		uint32_t rail;
		uint64_t off;
		if (rw_page_plan_find(pb->entry, c->R, d, 0, (uint32_t)c->ph.rec_size, &rail, &off) == 0) {
			*d_p = d;
			return c->slab[rail] + off;
		}
	}
	return NULL;
}

static void test_records_check(void **state)
{
	(void)state;
	seed_rng("test_records_check");
	int lies = 0;
	for (int it = 0; it < 200; it++) {
		cluster_t c;
		cluster_make(&c, (rw_path_t)(it % 4));
		plan_block_t *pb = calloc(c.G, sizeof(*pb));
		assert_non_null(pb);
		plan_all(&c, pb);
		const uint8_t *slab[RW_MAX_RAILS];
		for (uint32_t r = 0; r < c.R; r++)
			slab[r] = c.slab[r];
		char why[RW_SVC_WHY_MAX];
		for (uint32_t g = 0; g < c.G; g++) {
			pack_rank(&c, &pb[g], g);
			assert_int_equal(rw_svc_rank_records_check(&c.ph, g, c.rt[g].n_tokens,
								   pb[g].tags, pb[g].entry, slab, why),
					 RW_OK);
		}
		/* one lie per case, on the first record of a rank that has one */
		uint32_t g = rng_below(c.G), d;
		uint8_t *rec = first_record(&c, &pb[g], &d);
		if (!rec) {
			free(pb);
			cluster_free(&c);
			continue;
		}
		uint8_t saved[64];
		memcpy(saved, rec, sizeof(saved));
		rw_wire_rec_hdr_t h;
		assert_int_equal(rw_wire_rec_unpack(rec, c.topk, &h), RW_OK);
		const char *want;
		switch (it % 7) {
		case 0:
			rw_wire_put32(rec, h.tag ^ 1u);
			want = "its tag is not this phase's";
			break;
		case 1:
			rw_wire_put16(rec + 4, (uint16_t)((c.me + 1) % c.N));
			want = "it names another source node";
			break;
		case 2:
			rw_wire_put16(rec + 6, (uint16_t)(g + 1));
			want = "it names another local rank as its owner";
			break;
		case 3: /* a token of another rank's range: past this rank's */
			rw_wire_put32(rec + 8, c.rt[g].n_tokens);
			want = "its token is past the rank's tokens";
			break;
		case 4:
			rw_wire_put32(rec + 16, (uint32_t)c.E); /* id 0 = E */
			want = "a top-k id is out of range";
			break;
		case 5: /* every expert elsewhere (or none): the record goes where nothing waits */
			for (uint32_t k = 0; k < c.topk; k++)
				rw_wire_put32(rec + 16 + 4 * k, (uint32_t)-1);
			want = "none of its experts lives on the node it goes to";
			break;
		default:
			rw_wire_put16(rec + 12, (uint16_t)(c.topk + 1));
			want = "its top-k count is not the phase's";
			break;
		}
		assert_int_equal(rw_svc_rank_records_check(&c.ph, g, c.rt[g].n_tokens, pb[g].tags,
							   pb[g].entry, slab, why), RW_ERR_INVAL);
		char head[64];
		snprintf(head, sizeof(head), "rank %u: record 0 to node %u", c.me * c.G + g, d);
		if (!strstr(why, head) || !strstr(why, want))
			fail_msg("case %d: got \"%s\", want \"%s\" ... \"%s\"", it % 7, why, head, want);
		memcpy(rec, saved, sizeof(saved));
		assert_int_equal(rw_svc_rank_records_check(&c.ph, g, c.rt[g].n_tokens, pb[g].tags,
							   pb[g].entry, slab, why), RW_OK);
		lies++;
		free(pb);
		cluster_free(&c);
	}
	assert_true(lies > 100); /* most cases had a record to lie in */
}

/* Two records to one node swapped: the order check names the second. */
static void test_records_order(void **state)
{
	(void)state;
	seed_rng("test_records_order");
	int done = 0;
	for (int it = 0; it < 500 && done < 20; it++) {
		cluster_t c;
		cluster_make(&c, RW_PATH_NATIVE);
		plan_block_t *pb = calloc(c.G, sizeof(*pb));
		plan_all(&c, pb);
		const uint8_t *slab[RW_MAX_RAILS];
		for (uint32_t r = 0; r < c.R; r++)
			slab[r] = c.slab[r];
		uint32_t g = rng_below(c.G);
		pack_rank(&c, &pb[g], g);
		int swapped = 0;
		for (uint32_t d = 0; d < c.N && !swapped; d++) {
			uint32_t r0 = 0, r1 = 0;
			uint64_t o0 = 0, o1 = 0;
			if (rw_page_plan_find(pb[g].entry, c.R, d, 1, (uint32_t)c.ph.rec_size, &r1, &o1))
				continue;
			assert_int_equal(rw_page_plan_find(pb[g].entry, c.R, d, 0,
							   (uint32_t)c.ph.rec_size, &r0, &o0), 0);
			uint8_t *a = c.slab[r0] + o0, *b = c.slab[r1] + o1;
			uint8_t t[16];
			memcpy(t, a + 8, 4); /* swap the tokens only: each still goes to d */
			memcpy(a + 8, b + 8, 4);
			memcpy(b + 8, t, 4);
			char why[RW_SVC_WHY_MAX];
			assert_int_equal(rw_svc_rank_records_check(&c.ph, g, c.rt[g].n_tokens, pb[g].tags,
								   pb[g].entry, slab, why),
					 RW_ERR_INVAL);
			assert_non_null(strstr(why, "its token is out of order"));
			swapped = 1;
			done++;
		}
		free(pb);
		cluster_free(&c);
	}
	assert_int_equal(done, 20);
}

/* Records from the other nodes in this node's receive areas, as the peers' packs would leave
 * them: each with at least one expert here. recv[r] holds in_total[r] records. */
static void arrive(cluster_t *c, uint8_t **recv)
{
	const uint32_t R = c->R, per_node = c->E / c->N;
	for (uint32_t r = 0; r < R; r++) {
		recv[r] = calloc((size_t)c->layout.in_total[r] + 1, c->ph.rec_size);
		assert_non_null(recv[r]);
		for (uint32_t sn = 0; sn < c->N; sn++)
			for (uint32_t k = 0; k < c->layout.in_quota[sn * R + r]; k++) {
				int32_t ids[RW_MAX_TOPK];
				float w[RW_MAX_TOPK] = { 0 };
				make_ids(ids, 1, c->topk, c->E);
				ids[rng_below(c->topk)] = -1; /* then one expert here, not a duplicate */
				for (uint32_t q = 0; q < c->topk; q++)
					if (ids[q] == -1) {
						int32_t e = (int32_t)(c->me * per_node + rng_below(per_node));
						int dup = 0;
						for (uint32_t z = 0; z < c->topk; z++)
							dup |= ids[z] == e;
						if (!dup) {
							ids[q] = e;
							break;
						}
					}
				rw_wire_rec_hdr_t h = { .tag = c->ph.tag_in, .src_node = sn,
							.owner = rng_below(c->G), .token = rng_below(500),
							.topk = c->topk };
				uint32_t p = c->layout.in_first[sn * R + r] + k;
				rw_wire_rec_pack(recv[r] + (uint64_t)p * c->ph.rec_size, &h, ids, w);
			}
	}
}

static int has_expert_here(const cluster_t *c, const uint8_t *rec)
{
	return rw_svc_fwd_mask_rec(c->E, c->N, c->G, c->me, rec, c->topk) != 0;
}

/* The lists against the host mover's forwarding (rw_svc_rank_out_add fed the same records in
 * the same order), the terms against its contrib table, the reduce lists against the owner's
 * order built from the CSR and the pair plans. */
static void test_lists_match_host_forwarding(void **state)
{
	(void)state;
	seed_rng("test_lists_match_host_forwarding");
	for (int it = 0; it < 150; it++) {
		cluster_t c;
		cluster_make(&c, (rw_path_t)(it % 4));
		const uint32_t R = c.R, G = c.G;
		plan_block_t *pb = calloc(G, sizeof(*pb));
		assert_non_null(pb);
		plan_all(&c, pb);
		for (uint32_t g = 0; g < G; g++)
			pack_rank(&c, &pb[g], g);
		uint8_t *recv[RW_MAX_RAILS];
		arrive(&c, recv);
		const uint32_t max_recv = 4096;
		rw_svc_rank_lists_t ls;
		memset(&ls, 0, sizeof(ls));
		ls.max_recv = max_recv;
		for (uint32_t r = 0; r < R; r++) {
			ls.recv[r] = recv[r];
			ls.local[r] = c.slab[r] + c.areas[r].local_off;
			ls.local_n[r] = c.offset[c.me * R + r + 1] - c.offset[c.me * R + r];
		}
		for (uint32_t g = 0; g < G; g++) {
			ls.list[g] = calloc(max_recv, sizeof(rw_page_list_entry_t));
			ls.term_off[g] = calloc(max_recv + 1, sizeof(uint32_t));
			ls.term_ref[g] = calloc((size_t)G * max_recv, sizeof(uint32_t));
		}
		char why[RW_SVC_WHY_MAX];
		assert_int_equal(rw_svc_rank_fwd_lists(&c.ph, &ls, why), RW_OK);

		/* the oracle: the host mover's helper, fed in the same order; ref = that order */
		uint32_t n_ref = 0;
		for (uint32_t r = 0; r < R; r++)
			n_ref += c.layout.in_total[r] + ls.local_n[r];
		rw_svc_rank_out_t ro;
		memset(&ro, 0, sizeof(ro));
		ro.contrib = calloc((size_t)n_ref * G + 1, sizeof(uint32_t));
		ro.n_contrib = n_ref;
		rw_page_list_entry_t *where = calloc(n_ref + 1, sizeof(*where));
		for (uint32_t g = 0; g < G; g++) {
			ro.layout[g] = (rw_svc_out_layout_t){ .rows_cap = n_ref + 1,
							      .meta_bytes = 16 + 8ull * c.topk };
			ro.meta[g] = calloc((size_t)n_ref + 1, ro.layout[g].meta_bytes);
			ro.ref[g] = calloc((size_t)n_ref + 1, sizeof(uint32_t));
			ro.expert_counts[g] = calloc(c.E, sizeof(uint32_t));
		}
		uint32_t ref = 0, rows[RW_MAX_GPUS];
		for (int area = 0; area < 2; area++)
			for (uint32_t r = 0; r < R; r++) {
				uint32_t n = area ? ls.local_n[r] : c.layout.in_total[r];
				const uint8_t *base = area ? ls.local[r] : recv[r];
				for (uint32_t p = 0; p < n; p++, ref++) {
					const uint8_t *rec = base + (uint64_t)p * c.ph.rec_size;
					rw_wire_rec_hdr_t h;
					assert_int_equal(rw_wire_rec_unpack(rec, c.topk, &h), RW_OK);
					int32_t ids[RW_MAX_TOPK];
					float w[RW_MAX_TOPK];
					for (uint32_t q = 0; q < c.topk; q++) {
						ids[q] = rw_wire_rec_id(rec, q);
						w[q] = rw_wire_rec_weight(rec, c.topk, q);
					}
					assert_true(area || has_expert_here(&c, rec));
					assert_true(rw_svc_rank_out_add(&ro, &c.ph, ref, h.src_node, 0,
									h.token, ids, w, rows) >= 0);
					where[ref] = (rw_page_list_entry_t){
						.slot = p, .rail = (uint16_t)r, .area = (uint16_t)area,
						.node = h.src_node, .token = h.token };
				}
			}
		for (uint32_t g = 0; g < G; g++) {
			assert_int_equal(ls.n[g], ro.n[g]);
			for (uint32_t j = 0; j < ls.n[g]; j++) {
				const rw_page_list_entry_t *e = &ls.list[g][j], *o = &where[ro.ref[g][j]];
				assert_int_equal(e->area, o->area);
				assert_int_equal(e->rail, o->rail);
				assert_int_equal(e->slot, o->slot);
				assert_int_equal(e->node, e->area ? c.me : o->node);
				assert_int_equal(e->token, o->token);
				assert_int_equal(j < ls.n_recv[g], e->area == RW_PAGE_AREA_RECV);
				/* terms: a received record's by its lowest rank, every rank's row */
				uint32_t t0 = ls.term_off[g][j], t1 = ls.term_off[g][j + 1];
				const uint32_t *cb = &ro.contrib[(size_t)ro.ref[g][j] * G];
				if (e->area == RW_PAGE_AREA_LOCAL) {
					assert_int_equal(t1 - t0, 1);
					assert_int_equal(ls.term_ref[g][t0], RW_PAGE_TERM(g, j));
					continue;
				}
				uint32_t lowest = 0;
				while (!cb[lowest])
					lowest++;
				if (g != lowest) {
					assert_int_equal(t1, t0);
					continue;
				}
				uint32_t q = t0;
				for (uint32_t h = 0; h < G; h++)
					if (cb[h])
						assert_int_equal(ls.term_ref[g][q++], RW_PAGE_TERM(h, cb[h] - 1));
				assert_int_equal(q, t1);
			}
		}
		/* the combine plans: each writer's record goes where the host mover's combine_pack
		 * writes it (the return area, slot for slot with the receive area), each local row to
		 * where the owners' reduce lists below look for it */
		c.ph.crec_size = rw_wire_crec_size(8, RW_WIRE_F32);
		plan_block_t *cp = calloc(G, sizeof(*cp));
		assert_non_null(cp);
		for (uint32_t g = 0; g < G; g++) {
			rw_svc_rank_plan_combine(&c.ph, g, ls.local_n, c.areas, 10, &cp[g].head,
						 cp[g].tags, cp[g].entry);
			assert_int_equal(cp[g].head.kind, 1);
			assert_int_equal(cp[g].head.n_stage, G); /* the staging table: one per rank */
			assert_int_equal(cp[g].head.rec_size, c.ph.crec_size);
			for (uint32_t j = 0; j < ls.n[g]; j++) {
				const rw_page_list_entry_t *e = &ls.list[g][j];
				const rw_page_plan_entry_t *pe = &cp[g].entry[e->node * R + e->rail];
				assert_true(e->slot >= pe->first && e->slot - pe->first < pe->count);
				uint64_t at = pe->offset + (uint64_t)(e->slot - pe->first) * c.ph.crec_size;
				if (e->area == RW_PAGE_AREA_RECV) {
					assert_int_equal(at, c.areas[e->rail].send_off +
								     (uint64_t)e->slot * c.ph.crec_size);
					assert_int_equal(cp[g].tags[e->node], c.tag_to[e->node]);
				} else {
					assert_int_equal(e->node, c.me);
					assert_int_equal(at, c.areas[e->rail].local_off +
								     ((uint64_t)g * ls.local_n[e->rail] + e->slot) *
									     c.ph.crec_size);
				}
			}
		}
		/* the returns as the gathers write them (headers as combine_pack's), checked before
		 * they are posted; one writer's header wrong, or one record never written: named */
		uint8_t *ret[RW_MAX_RAILS];
		for (uint32_t r = 0; r < R; r++) {
			ret[r] = calloc((size_t)c.layout.in_total[r] + 1, c.ph.crec_size);
			assert_non_null(ret[r]);
		}
		uint32_t writers = 0, wg = 0, wj = 0;
		for (uint32_t g = 0; g < G; g++)
			for (uint32_t j = 0; j < ls.n_recv[g]; j++) {
				if (ls.term_off[g][j] == ls.term_off[g][j + 1])
					continue;
				const rw_page_list_entry_t *e = &ls.list[g][j];
				const rw_page_plan_entry_t *pe = &cp[g].entry[e->node * R + e->rail];
				rw_wire_crec_hdr_t h = { .tag = cp[g].tags[e->node], .src_node = c.me,
							 .rail = e->rail, .slot = e->slot - pe->first };
				rw_wire_crec_pack(ret[e->rail] + (uint64_t)e->slot * c.ph.crec_size, &h);
				if (rng_below(++writers) == 0) { /* one writer at random */
					wg = g;
					wj = j;
				}
			}
		const uint8_t *retc[RW_MAX_RAILS];
		for (uint32_t r = 0; r < R; r++)
			retc[r] = ret[r];
		assert_int_equal(rw_svc_rank_crecords_check(&c.ph, &ls, retc, why), RW_OK);
		if (writers) {
			const rw_page_list_entry_t *e = &ls.list[wg][wj];
			uint8_t *rec = ret[e->rail] + (uint64_t)e->slot * c.ph.crec_size;
			rw_wire_put32(rec + 8, rw_wire_get32(rec + 8) + 1); /* its slot field */
			assert_int_equal(rw_svc_rank_crecords_check(&c.ph, &ls, retc, why), RW_ERR_INVAL);
			char want[64];
			snprintf(want, sizeof(want), "rank %u: its combine record for node %u",
				 c.me * G + wg, e->node);
			assert_non_null(strstr(why, want));
			memset(rec, 0, 16); /* never written */
			assert_int_equal(rw_svc_rank_crecords_check(&c.ph, &ls, retc, why), RW_ERR_INVAL);
			assert_non_null(strstr(why, want));
		}
		for (uint32_t r = 0; r < R; r++)
			free(ret[r]);
		free(cp);
		/* the reduce lists */
		const uint8_t *sent[RW_MAX_RAILS];
		for (uint32_t r = 0; r < R; r++)
			sent[r] = c.slab[r] + c.areas[r].send_off;
		for (uint32_t g = 0; g < G; g++) {
			const uint32_t nt = c.rt[g].n_tokens, rg = c.topo.gpu_rail[g];
			uint32_t *cursor = calloc(nt + 1, sizeof(uint32_t));
			rw_page_list_entry_t *red = calloc(max_recv, sizeof(*red));
			uint32_t n_red = 0, q = 0;
			assert_int_equal(rw_svc_rank_reduce_list(&c.ph, &ls, sent, g, nt, cursor, red,
								 max_recv, &n_red, why), RW_OK);
			for (uint32_t t = 0; t < nt; t++) {
				/* local terms: each rank that got g's local record of t, by rank */
				uint32_t lref = UINT32_MAX, lref_slot = 0; /* that record's ref, slot */
				for (uint32_t x = 0; x < ls.local_n[rg]; x++) {
					uint32_t o = c.offset[c.me * R + rg] + x;
					if (c.rec[o].rank == g && c.rec[o].token == t) {
						lref = x;
						lref_slot = x;
						for (uint32_t r = 0; r < rg; r++)
							lref += ls.local_n[r];
						break;
					}
				}
				if (lref != UINT32_MAX) {
					for (uint32_t r = 0; r < R; r++)
						lref += c.layout.in_total[r];
					for (uint32_t h = 0; h < G; h++) {
						uint32_t cj = ro.contrib[(size_t)lref * G + h];
						if (!cj)
							continue;
						const rw_page_list_entry_t *e = &red[q++];
						assert_int_equal(e->area, RW_PAGE_AREA_LOCAL);
						assert_int_equal(e->token, t);
						assert_int_equal(e->rail, rg);
						assert_int_equal(e->slot, h * ls.local_n[rg] + lref_slot);
					}
				}
				/* remote terms: by node, where the record left */
				for (uint32_t d = 0; d < c.N; d++) {
					if (d == c.me)
						continue;
					uint32_t seg = c.offset[d * R + rg], end = c.offset[d * R + rg + 1];
					for (uint32_t o = seg; o < end; o++) {
						if (c.rec[o].rank != g || c.rec[o].token != t)
							continue;
						uint32_t e_rail, slot;
						rw_sched_map(&c.layout.out_pairs[d], rg, o - seg, &e_rail, &slot);
						const rw_page_list_entry_t *e = &red[q++];
						assert_int_equal(e->area, RW_PAGE_AREA_RECV);
						assert_int_equal(e->node, d);
						assert_int_equal(e->token, t);
						assert_int_equal(e->rail, e_rail);
						assert_int_equal(e->slot, c.layout.out_first[d * R + e_rail] + slot);
					}
				}
			}
			assert_int_equal(q, n_red);
			if (n_red > 0) { /* one entry fewer allowed: refused, named */
				assert_int_equal(rw_svc_rank_reduce_list(&c.ph, &ls, sent, g, nt, cursor,
									 red, n_red - 1, &n_red, why),
						 RW_ERR_SUB_SPACE);
				assert_non_null(strstr(why, "combine terms, above"));
			}
			free(cursor);
			free(red);
		}
		/* a rank past its max_recv: refused, named */
		for (uint32_t g = 0; g < G; g++)
			if (ls.n[g] > 0) {
				ls.max_recv = ls.n[g] - 1;
				assert_int_equal(rw_svc_rank_fwd_lists(&c.ph, &ls, why), RW_ERR_SUB_SPACE);
				assert_non_null(strstr(why, "receives more than its"));
				break;
			}
		for (uint32_t g = 0; g < G; g++) {
			free(ls.list[g]);
			free(ls.term_off[g]);
			free(ls.term_ref[g]);
			free(ro.meta[g]);
			free(ro.ref[g]);
			free(ro.expert_counts[g]);
		}
		free(ro.contrib);
		free(where);
		for (uint32_t r = 0; r < R; r++)
			free(recv[r]);
		free(pb);
		cluster_free(&c);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_plan_matches_host_pack),
		cmocka_unit_test(test_records_check),
		cmocka_unit_test(test_records_order),
		cmocka_unit_test(test_lists_match_host_forwarding),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
