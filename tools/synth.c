/* Seeded synthetic MoE routing (docs/tools.md "Synthetic routing"; knobs in tools/synth.h). Every
 * random stream is derived from (seed, layer, what it draws), so a rank's ids do not depend on
 * which other ranks were drawn before it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/synth.h"

/* ---- random numbers: splitmix64 to seed, xoshiro256** to draw ---- */

typedef struct rng {
	uint64_t s[4];
} rng_t;

static uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static void rng_seed(rng_t *r, uint64_t seed, uint64_t layer, uint64_t stream)
{
	uint64_t x = seed ^ (layer * 0xd1342543de82ef95ull) ^ (stream * 0x2545f4914f6cdd1dull);
	for (int i = 0; i < 4; i++)
		r->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t rng_next(rng_t *r)
{
	uint64_t *s = r->s;
	uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return result;
}

/* Uniform in [0, 1). */
static inline double rng_uniform(rng_t *r) { return (double)(rng_next(r) >> 11) * 0x1.0p-53; }

/* Uniform integer in [0, n) (multiply-high; the bias is below 2^-32 for the n used here). */
static inline uint32_t rng_below(rng_t *r, uint32_t n)
{
	return (uint32_t)(((rng_next(r) >> 32) * (uint64_t)n) >> 32);
}

static double rng_normal(rng_t *r)
{
	double u1 = 1.0 - rng_uniform(r), u2 = rng_uniform(r); /* u1 in (0, 1] */
	return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* Gamma(shape, 1) by Marsaglia and Tsang; shape < 1 through Gamma(shape + 1) * U^(1/shape). */
static double rng_gamma(rng_t *r, double shape)
{
	if (shape < 1.0) {
		double u = 1.0 - rng_uniform(r);
		return rng_gamma(r, shape + 1.0) * pow(u, 1.0 / shape);
	}
	double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
	for (;;) {
		double x = rng_normal(r), v = 1.0 + c * x;
		if (v <= 0.0)
			continue;
		v = v * v * v;
		double u = 1.0 - rng_uniform(r);
		if (u < 1.0 - 0.0331 * x * x * x * x || log(u) < 0.5 * x * x + d * (1.0 - v + log(v)))
			return d * v;
	}
}

/* ---- Vose alias tables ---- */

static void alias_build(const double *w, uint32_t n, double *prob, uint32_t *alias, uint32_t *work)
{
	double sum = 0.0;
	for (uint32_t i = 0; i < n; i++)
		sum += w[i];
	uint32_t *small = work, *large = work + n;
	uint32_t ns = 0, nl = 0;
	for (uint32_t i = 0; i < n; i++) {
		prob[i] = sum > 0.0 ? w[i] * n / sum : 1.0;
		alias[i] = i;
		if (prob[i] < 1.0)
			small[ns++] = i;
		else
			large[nl++] = i;
	}
	while (ns > 0 && nl > 0) {
		uint32_t s = small[--ns], l = large[nl - 1];
		alias[s] = l;
		prob[l] -= 1.0 - prob[s];
		if (prob[l] < 1.0) {
			nl--;
			small[ns++] = l;
		}
	}
	while (nl > 0)
		prob[large[--nl]] = 1.0;
	while (ns > 0)
		prob[small[--ns]] = 1.0; /* rounding leftovers */
}

static inline uint32_t alias_draw(rng_t *r, const double *prob, const uint32_t *alias, uint32_t n)
{
	uint32_t i = rng_below(r, n);
	return rng_uniform(r) < prob[i] ? i : alias[i];
}

/* ---- generator ---- */

static uint64_t gcd64(uint64_t a, uint64_t b)
{
	while (b) {
		uint64_t t = a % b;
		a = b;
		b = t;
	}
	return a;
}

rw_status_t rw_synth_init(rw_synth_t *gen, const rw_synth_cfg_t *cfg)
{
	memset(gen, 0, sizeof(*gen));
	const uint32_t E = cfg->n_experts;
	if (cfg->nodes == 0 || cfg->gpus_per_node == 0 || E == 0 || cfg->topk == 0 ||
	    cfg->topk > E || cfg->topk > RW_MAX_TOPK || cfg->tokens_per_rank == 0)
		return RW_ERR_INVAL;
	if (cfg->n_groups && (cfg->n_groups > 32 || E % cfg->n_groups || cfg->topk_groups == 0 ||
			      cfg->topk_groups > cfg->n_groups ||
			      (uint64_t)cfg->topk_groups * (E / cfg->n_groups) < cfg->topk))
		return RW_ERR_INVAL;
	if (!(cfg->zipf_s >= 0.0) || !(cfg->dirichlet >= 0.0) ||
	    !(cfg->rail_skew >= 0.0 && cfg->rail_skew <= 1.0))
		return RW_ERR_INVAL;
	uint64_t world = (uint64_t)cfg->nodes * cfg->gpus_per_node;
	uint64_t slots = E / gcd64(E, world) * world; /* lcm(E, W) */
	if (slots > (1u << 24))
		return RW_ERR_INVAL;
	gen->cfg = *cfg;
	gen->phys_experts = (uint32_t)slots;

	gen->global_p = calloc(E, sizeof(double));
	gen->q = calloc(E, sizeof(double));
	gen->alias_prob = calloc(E, sizeof(double));
	gen->alias_idx = calloc(E, sizeof(uint32_t));
	gen->local_prob = calloc(E, sizeof(double));
	gen->local_idx = calloc(E, sizeof(uint32_t));
	gen->scratch = calloc(2 * (size_t)E, sizeof(uint32_t));
	gen->group_mass = calloc(cfg->n_groups ? cfg->n_groups : 1, sizeof(double));
	if (!gen->global_p || !gen->q || !gen->alias_prob || !gen->alias_idx || !gen->local_prob ||
	    !gen->local_idx || !gen->scratch || !gen->group_mass) {
		rw_synth_free(gen);
		return RW_ERR_NOMEM;
	}

	/* The layer's popularity order: a seeded permutation, Zipf weights by position. */
	rng_t r;
	rng_seed(&r, cfg->seed, cfg->layer, 0);
	uint32_t *perm = gen->scratch;
	for (uint32_t i = 0; i < E; i++)
		perm[i] = i;
	for (uint32_t i = E - 1; i > 0; i--) {
		uint32_t j = rng_below(&r, i + 1), t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	double sum = 0.0;
	for (uint32_t i = 0; i < E; i++) {
		double w = pow((double)(i + 1), -cfg->zipf_s);
		gen->global_p[perm[i]] = w;
		sum += w;
	}
	for (uint32_t e = 0; e < E; e++)
		gen->global_p[e] /= sum;
	return RW_OK;
}

void rw_synth_free(rw_synth_t *gen)
{
	free(gen->global_p);
	free(gen->q);
	free(gen->alias_prob);
	free(gen->alias_idx);
	free(gen->local_prob);
	free(gen->local_idx);
	free(gen->scratch);
	free(gen->group_mass);
	memset(gen, 0, sizeof(*gen));
}

static int chosen(const int32_t *ids, uint32_t n, uint32_t e)
{
	for (uint32_t i = 0; i < n; i++)
		if ((uint32_t)ids[i] == e)
			return 1;
	return 0;
}

/* Logical expert -> one of its slots (replica drawn uniformly). */
static inline int32_t to_slot(const rw_synth_t *gen, rng_t *r, uint32_t e)
{
	uint32_t reps = gen->phys_experts / gen->cfg.n_experts;
	return (int32_t)(e + (reps > 1 ? rng_below(r, reps) : 0) * gen->cfg.n_experts);
}

/* A token kept on its node: distinct experts among the node's first n_local slots (slot s
 * holds logical expert s % E; n_local <= E, so these are distinct experts). */
static void draw_local(rw_synth_t *gen, rng_t *r, uint32_t n_local, uint32_t slot0, int32_t *ids)
{
	const uint32_t k = RW_MIN(gen->cfg.topk, n_local);
	uint32_t n = 0, tries = 0;
	while (n < k && tries++ < 64 * k) {
		uint32_t slot = slot0 + alias_draw(r, gen->local_prob, gen->local_idx, n_local);
		if (!chosen(ids, n, slot))
			ids[n++] = (int32_t)slot;
	}
	for (uint32_t i = 0; n < k && i < n_local; i++) /* zero-probability leftovers */
		if (!chosen(ids, n, slot0 + i))
			ids[n++] = (int32_t)(slot0 + i);
	for (uint32_t j = n; j < gen->cfg.topk; j++)
		ids[j] = -1; /* fewer local experts than top-k: dropped slots */
}

/* A normal token: top-k distinct experts from q, inside top-k groups when group-limited. */
static void draw_routed(rw_synth_t *gen, rng_t *r, int32_t *ids)
{
	const rw_synth_cfg_t *c = &gen->cfg;
	const uint32_t E = c->n_experts, k = c->topk;
	uint32_t group_ok = UINT32_MAX; /* bit per group; rw_synth_init() allows <= 32 groups */
	uint32_t per_group = c->n_groups ? E / c->n_groups : E;
	if (c->n_groups) {
		group_ok = 0;
		double left = 0.0;
		for (uint32_t g = 0; g < c->n_groups; g++)
			left += gen->group_mass[g];
		for (uint32_t j = 0; j < c->topk_groups; j++) {
			double u = rng_uniform(r) * left, acc = 0.0;
			uint32_t pick = c->n_groups, last = 0;
			for (uint32_t g = 0; g < c->n_groups; g++) {
				if (group_ok & (1u << g))
					continue;
				last = g;
				acc += gen->group_mass[g];
				if (u < acc) {
					pick = g;
					break;
				}
			}
			if (pick == c->n_groups)
				pick = last;
			group_ok |= 1u << pick;
			left -= gen->group_mass[pick];
		}
	}
	uint32_t n = 0, tries = 0;
	while (n < k && tries++ < 64 * k) {
		uint32_t e = alias_draw(r, gen->alias_prob, gen->alias_idx, E);
		if (!(group_ok & (1u << ((e / per_group) & 31))) || chosen(ids, n, e))
			continue;
		ids[n++] = (int32_t)e;
	}
	for (uint32_t e = 0; n < k && e < E; e++)
		if ((group_ok & (1u << ((e / per_group) & 31))) && !chosen(ids, n, e))
			ids[n++] = (int32_t)e;
	for (uint32_t j = 0; j < n; j++)
		ids[j] = to_slot(gen, r, (uint32_t)ids[j]);
}

void rw_synth_rank(rw_synth_t *gen, uint32_t node, uint32_t gpu, int32_t *expert_ids)
{
	const rw_synth_cfg_t *c = &gen->cfg;
	const uint32_t E = c->n_experts;
	const uint64_t rank = (uint64_t)node * c->gpus_per_node + gpu;
	rng_t r;

	/* This GPU's distribution: a Dirichlet draw around the global one. */
	rng_seed(&r, c->seed, c->layer, 1 + 2 * rank);
	double sum = 0.0;
	for (uint32_t e = 0; e < E; e++) {
		double a = c->dirichlet * gen->global_p[e];
		gen->q[e] = c->dirichlet > 0.0 ? (a > 0.0 ? rng_gamma(&r, a) : 0.0) : gen->global_p[e];
		sum += gen->q[e];
	}
	if (!(sum > 0.0)) { /* every gamma underflowed: keep the global distribution */
		memcpy(gen->q, gen->global_p, E * sizeof(double));
		sum = 1.0;
	}
	for (uint32_t e = 0; e < E; e++)
		gen->q[e] /= sum;
	alias_build(gen->q, E, gen->alias_prob, gen->alias_idx, gen->scratch);
	if (c->n_groups) {
		uint32_t per_group = E / c->n_groups;
		for (uint32_t g = 0; g < c->n_groups; g++) {
			gen->group_mass[g] = 0.0;
			for (uint32_t e = g * per_group; e < (g + 1) * per_group; e++)
				gen->group_mass[g] += gen->q[e];
		}
	}

	/* The node's local slots [slot0, slot0 + n_local) and their logical experts. */
	const uint32_t n_local = gen->phys_experts / c->nodes;
	const uint32_t slot0 = node * n_local;
	const int skew = c->rail_skew > 0.0 && gpu != node % c->gpus_per_node;
	const uint32_t m = RW_MIN(n_local, E);
	if (skew) {
		for (uint32_t i = 0; i < m; i++)
			gen->local_prob[i] = gen->q[(slot0 + i) % E];
		/* In place: alias_build reads weight i before it writes probability i. */
		alias_build(gen->local_prob, m, gen->local_prob, gen->local_idx, gen->scratch);
	}

	rng_seed(&r, c->seed, c->layer, 2 + 2 * rank);
	int32_t *ids = expert_ids;
	for (uint32_t t = 0; t < c->tokens_per_rank; t++, ids += c->topk) {
		if (skew && rng_uniform(&r) < c->rail_skew)
			draw_local(gen, &r, m, slot0, ids);
		else
			draw_routed(gen, &r, ids);
	}
}

void rw_synth_node(rw_synth_t *gen, uint32_t node, int32_t *ids, rw_rank_tokens_t *ranks)
{
	const rw_synth_cfg_t *c = &gen->cfg;
	const size_t per_rank = (size_t)c->tokens_per_rank * c->topk;
	for (uint32_t g = 0; g < c->gpus_per_node; g++) {
		rw_synth_rank(gen, node, g, ids + g * per_rank);
		ranks[g] = (rw_rank_tokens_t){ .local_gpu = g, .n_tokens = c->tokens_per_rank,
					       .topk = c->topk, .expert_ids = ids + g * per_rank };
	}
}

rw_status_t rw_synth_counts(rw_synth_t *gen, const rw_topo_t *topo, int32_t *ids,
			    uint32_t *counts)
{
	rw_rank_tokens_t ranks[RW_MAX_GPUS];
	const uint32_t N = topo->nodes, R = topo->rails;
	if (N != gen->cfg.nodes || topo->gpus_per_node != gen->cfg.gpus_per_node)
		return RW_ERR_INVAL;
	for (uint32_t s = 0; s < N; s++) {
		rw_synth_node(gen, s, ids, ranks);
		rw_status_t st = rw_sched_count(topo, gen->phys_experts, s, ranks,
						gen->cfg.gpus_per_node, counts + (size_t)s * N * R, NULL);
		if (st != RW_OK)
			return st;
	}
	return RW_OK;
}

const rw_synth_shape_t rw_synth_shapes[RW_SYNTH_N_SHAPES] = {
	{ "dsv3", 256, 8, 4, 7168 }, /* DeepSeek-V3: 256 routed experts, 8 groups, top-4 groups */
	{ "glm", 128, 0, 0, 4096 },  /* GLM-4.5-Air: 128 routed experts */
};

const rw_synth_shape_t *rw_synth_shape(const char *name)
{
	for (size_t i = 0; i < RW_SYNTH_N_SHAPES; i++)
		if (strcmp(name, rw_synth_shapes[i].name) == 0)
			return &rw_synth_shapes[i];
	return NULL;
}
