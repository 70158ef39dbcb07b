/* An intrusive doubly linked list (in the manner of rdma-core's ccan/list.h): the node lives
 * inside the object, the list head owns nothing, and removal is O(1) without a walk. Removing
 * the node being visited is safe with rw_list_for_each_safe(). Header-only. */
#ifndef RW_COMMON_LIST_H
#define RW_COMMON_LIST_H

#include <stddef.h>

typedef struct rw_list {
	struct rw_list *next, *prev;
} rw_list_t;

#define RW_LIST_INIT(name) { &(name), &(name) }

static inline void rw_list_init(rw_list_t *h) { h->next = h->prev = h; }
static inline int rw_list_empty(const rw_list_t *h) { return h->next == h; }

/* Insert n after h (at the head) or before h (at the tail). */
static inline void rw_list_add(rw_list_t *h, rw_list_t *n)
{
	n->next = h->next;
	n->prev = h;
	h->next->prev = n;
	h->next = n;
}

static inline void rw_list_add_tail(rw_list_t *h, rw_list_t *n)
{
	n->prev = h->prev;
	n->next = h;
	h->prev->next = n;
	h->prev = n;
}

/* Unlink n; n then points at itself, so a second rw_list_del is harmless. */
static inline void rw_list_del(rw_list_t *n)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	n->next = n->prev = n;
}

#define rw_container_of(ptr, type, member) ((type *)(void *)((char *)(ptr) - offsetof(type, member)))

/* for (type *it = first; it; it = next) over the list h whose nodes are it->member. */
#define rw_list_for_each(h, it, member)                                                         \
	for ((it) = rw_container_of((h)->next, __typeof__(*(it)), member); &(it)->member != (h); \
	     (it) = rw_container_of((it)->member.next, __typeof__(*(it)), member))

/* The same, allowing rw_list_del(&it->member) (and freeing it) inside the body. */
#define rw_list_for_each_safe(h, it, nx, member)                                                \
	for ((it) = rw_container_of((h)->next, __typeof__(*(it)), member),                      \
	    (nx) = rw_container_of((it)->member.next, __typeof__(*(it)), member);               \
	     &(it)->member != (h);                                                               \
	     (it) = (nx), (nx) = rw_container_of((nx)->member.next, __typeof__(*(it)), member))

#endif /* RW_COMMON_LIST_H */
