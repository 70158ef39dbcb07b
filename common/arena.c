/* common/arena.h: one calloc per allocation, chained, so a large array costs no copy, its pages
 * are zeroed lazily by the kernel (calloc of a large block maps fresh zero pages: a pair's fp32
 * sums of megabytes cost nothing until written), and an arena frees in one walk. */
#include "common/arena.h"

#include <stdint.h>
#include <stdlib.h>

struct rw_arena_block {
	struct rw_arena_block *next;
	unsigned char pad[8];        /* the payload starts 16 bytes in: malloc's alignment */
};

void *rw_arena_alloc(rw_arena_t *a, size_t n, size_t size)
{
	if (size && n > (SIZE_MAX - sizeof(struct rw_arena_block)) / size)
		return NULL;
	size_t bytes = n * size;
	struct rw_arena_block *b = calloc(1, sizeof(*b) + bytes);
	if (!b)
		return NULL;
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
