/* Seeded synthetic MoE routing for the tools (docs/tools.md "Synthetic routing"): top-k expert ids
 * per token for every rank of a group, with the three knobs kept separate because they cause
 * different things. Same seed and configuration -> same ids, whatever order ranks are drawn in.
 * Private to tools/ (and its tests). */
#ifndef RW_TOOLS_SYNTH_H
#define RW_TOOLS_SYNTH_H

#include <stdint.h>

#include "common/common.h"
#include "sched/sched.h"

typedef struct rw_synth_cfg {
	uint32_t nodes, gpus_per_node;
	uint32_t n_experts;        /* logical routed experts (GLM-4.5-Air 128, DeepSeek-V3 256) */
	uint32_t topk;             /* experts per token (8) */
	uint32_t n_groups;         /* group-limited routing: expert groups (DeepSeek-V3: 8, <= 32); 0 = off */
	uint32_t topk_groups;      /* groups a token may use (DeepSeek-V3: 4) */
	uint32_t tokens_per_rank;
	uint32_t layer;            /* the layer drawn: hot experts and per-GPU preferences change */
	uint64_t seed;
	/* Global expert skew: P(expert of popularity rank i) ~ 1 / (i + 1)^zipf_s; 0 = uniform.
	 * Which experts are hot is a seeded per-layer permutation. */
	double zipf_s;
	/* Per-source heterogeneity: each GPU's expert distribution is a Dirichlet draw with mean
	 * the global one and total concentration `dirichlet` (smaller = more heterogeneous);
	 * 0 = off (every GPU uses the global distribution). */
	double dirichlet;
	/* Direct rail skew: in each node one hot GPU (node % G) routes normally; each token of the
	 * other GPUs stays on its own node (experts drawn among the node's local experts) with
	 * probability rail_skew. The hot GPU then owns about 1 / (1 + (G - 1)(1 - rail_skew)) of
	 * the node's remote records. 0 = off. In [0, 1]. */
	double rail_skew;
} rw_synth_cfg_t;

typedef struct rw_synth {
	rw_synth_cfg_t cfg;
	/* Expert slots the ids index: n_experts, or a multiple of it when the group has more ranks
	 * than experts (every expert then has phys_experts / n_experts replicas, "redundant
	 * experts", and a token's pick goes to a uniformly drawn replica). A multiple of W. */
	uint32_t phys_experts;
	double *global_p;     /* [E] the layer's global distribution */
	double *q;            /* [E] one GPU's distribution */
	double *alias_prob;   /* [E] Vose alias table over q */
	uint32_t *alias_idx;  /* [E] */
	double *local_prob;   /* [E] alias table over q restricted to one node's experts */
	uint32_t *local_idx;  /* [E] */
	uint32_t *scratch;    /* [2E] Vose work lists */
	double *group_mass;   /* [n_groups] */
} rw_synth_t;

/* Validate cfg and allocate. RW_ERR_INVAL names nothing: cfg fields are checked in order
 * (counts > 0, topk <= min(E, RW_MAX_TOPK), topk_groups <= n_groups, E % n_groups == 0,
 * knobs in range). */
rw_status_t rw_synth_init(rw_synth_t *gen, const rw_synth_cfg_t *cfg);

/* The model shapes the tools draw workloads for: rw_synth_shapes[0] DeepSeek-V3 ("dsv3"),
 * [1] GLM-4.5-Air ("glm"). rw_synth_shape() finds one by name (NULL if unknown). */
typedef struct rw_synth_shape {
	const char *name;
	uint32_t n_experts, n_groups, topk_groups, hidden;
} rw_synth_shape_t;
#define RW_SYNTH_N_SHAPES 2
extern const rw_synth_shape_t rw_synth_shapes[RW_SYNTH_N_SHAPES];
const rw_synth_shape_t *rw_synth_shape(const char *name);
void rw_synth_free(rw_synth_t *gen);

/* Expert ids (slots < phys_experts) of rank (node, gpu): tokens_per_rank * topk, row-major,
 * the top-k of a token distinct logical experts. */
void rw_synth_rank(rw_synth_t *gen, uint32_t node, uint32_t gpu, int32_t *expert_ids);

/* Fill the full N x N x R count matrix (counts[(s*N + d)*R + r]) by drawing every node's ranks
 * and counting them with rw_sched_count(). ids must hold G * tokens_per_rank * topk entries. */
rw_status_t rw_synth_counts(rw_synth_t *gen, const rw_topo_t *topo, int32_t *ids,
			    uint32_t *counts);

/* Draw one node's G ranks into ids and describe them as rank_tokens (G entries). */
void rw_synth_node(rw_synth_t *gen, uint32_t node, int32_t *ids, rw_rank_tokens_t *ranks);

#endif /* RW_TOOLS_SYNTH_H */
