/* common/arena.h: one malloc per allocation, chained, so a large array costs no copy and an
 * arena of a few dozen arrays frees in one walk. */
#include "common/arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct rw_arena_block {
	struct rw_arena_block *next;
	unsigned char pad[56];       /* the payload starts 64 bytes in */
};

void *rw_arena_alloc(rw_arena_t *a, size_t n, size_t size)
{
	if (size && n > (SIZE_MAX - sizeof(struct rw_arena_block)) / size)
		return NULL;
	size_t bytes = n * size;
	struct rw_arena_block *b = NULL;
	if (posix_memalign((void **)&b, 64, sizeof(*b) + (bytes ? bytes : 1)) != 0)
		return NULL;
	memset(b, 0, sizeof(*b) + bytes);
	b->next = a->blocks;
	a->blocks = b;
	return b + 1;
}

void rw_arena_free(rw_arena_t *a)
{
	while (a->blocks) {
		struct rw_arena_block *b = a->blocks;
		a->blocks = b->next;
		free(b);
	}
}
