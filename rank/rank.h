/* rank/: librailwave's rank path — a phase's GPU work enqueued in the rank's own process, on the
 * caller's stream, with the hand-offs to railwaved as words of the rank page (docs/rankpath.md).
 * The public calls are ipc/railwave.h's rw_client_rank_*; this header is the module's face
 * inside the tree: the state the files of rank/ share. Nothing outside rank/ touches the struct.
 *
 * Layering: rank/ sits above ipc/ (the client, the rank page's layout and rules) and cuda/ (the
 * driver loaded at run time, the words on a stream, the kernels); neither calls into it. */
#ifndef RW_RANK_H
#define RW_RANK_H

#include <stdint.h>

#include "cuda/rw_cuda.h"
#include "ipc/page.h"
#include "ipc/railwave.h"

#define RW_RANK_MSG_MAX 256
#define RW_RANK_KEPT (2 * RW_PAGE_DEPTH) /* answers kept: the phases in flight and those before */

/* How a phase of a slot ended: kept from its first answer (rw_client_rank_wait), or when the slot
 * is taken by a later phase, so that rw_client_rank_wait answers for it the same way again. */
typedef struct rw_rank_result {
	uint64_t phase;        /* 0: none kept */
	int32_t error;         /* 0 or RW_E_* */
	uint32_t bad;          /* the count kernel's bad word (1 + token), RW_E_TOKENS */
} rw_rank_result_t;

struct rw_client_rank {
	rw_client_t *client;
	rw_page_head_t *pg;    /* the rank page, mapped by the client */
	size_t bytes;
	rw_cuda_dptr_t dptr;   /* the page as the device addresses it */
	int device;
	rw_page_layout_t layout;
	uint64_t next;         /* k of the next phase (1, 2, ...) */
	int broken;            /* 0, or RW_E_CUDA once an enqueue failed after submit */
	rw_rank_result_t kept[RW_RANK_KEPT]; /* phase k at k mod RW_RANK_KEPT */
	char msg[RW_RANK_MSG_MAX];
};

#endif /* RW_RANK_H */
