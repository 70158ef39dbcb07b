/* A pair's (or any short-lived object's) one memory owner: every array is carved from a list
 * of blocks that one call frees together, so teardown cannot miss one or free one twice. */
#ifndef RW_COMMON_ARENA_H
#define RW_COMMON_ARENA_H

#include <stddef.h>

typedef struct rw_arena {
	struct rw_arena_block *blocks;
} rw_arena_t;

/* n * size zeroed bytes, aligned as malloc's, owned by the arena; NULL on overflow or ENOMEM. */
void *rw_arena_alloc(rw_arena_t *a, size_t n, size_t size);
/* Free everything allocated from the arena; it is empty (and usable) again. */
void rw_arena_free(rw_arena_t *a);

#endif /* RW_COMMON_ARENA_H */
