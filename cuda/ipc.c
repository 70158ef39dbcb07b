/* cuda/ipc.c: CUDA IPC export (client side) and the daemon's import cache.
 * The cache opens each exported allocation once and refcounts its users; docs/cuda.md
 * "IPC import cache" explains the identity rule and the freed-and-reallocated case. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <stdlib.h>
#include <string.h>

struct rw_cuda_ipc_map {
	struct rw_cuda_ipc_map *next, *prev;
	rw_cuda_ipc_handle_t handle;
	int device;
	uint64_t owner;
	uint64_t buffer_id;   /* exporter's CU_POINTER_ATTRIBUTE_BUFFER_ID */
	rw_cuda_dptr_t base;  /* mapping in this process */
	uint64_t bytes;       /* allocation size as the driver reports it here */
	unsigned refs;
	int retired;          /* superseded by a newer allocation with the same handle bytes */
};

struct rw_cuda_ipc_cache {
	struct rw_cuda_ipc_map *head; /* registration-time only: a list is plenty (tens of entries) */
	rw_cuda_ipc_stats_t stats;
};

/* ---- client side ----------------------------------------------------------------------- */

rw_status_t rw_cuda_ipc_export(rw_cuda_dptr_t dptr, size_t bytes, rw_cuda_ipc_desc_t *desc_p)
{
	rw_status_t st = rw_cuda_init();
	rw_cuda_ipc_desc_t desc;
	CUcontext saved = NULL;
	CUdeviceptr base = 0;
	size_t alloc = 0;
	unsigned long long buffer_id = 0;
	unsigned int mem_type = 0;
	int ordinal = -1;
	CUipcMemHandle h;
	CUresult res;

	if (st != RW_OK)
		return st;
	if (dptr == 0 || bytes == 0)
		return RW_ERR_INVAL;
	res = rw_cu.cuPointerGetAttribute(&mem_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)dptr);
	if (res != CUDA_SUCCESS || mem_type != CU_MEMORYTYPE_DEVICE) {
		rw_err("cuda: export: 0x%llx is not device memory", (unsigned long long)dptr);
		return RW_ERR_INVAL;
	}
	res = rw_cu.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)dptr);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuPointerGetAttribute(DEVICE_ORDINAL)");
	/* The caller (a trainer) has its own current context; give it back untouched. */
	rw_cu.cuCtxGetCurrent(&saved);
	st = rw_cu_enter(ordinal);
	if (st != RW_OK)
		goto restore;
	res = rw_cu.cuMemGetAddressRange(&base, &alloc, (CUdeviceptr)dptr);
	if (res != CUDA_SUCCESS) {
		st = rw_cu_fail(res, "cuMemGetAddressRange");
		goto restore;
	}
	if (bytes > alloc || dptr - base > alloc - bytes) {
		rw_err("cuda: export: range 0x%llx+%zu runs past its allocation (%zu bytes)",
		       (unsigned long long)dptr, bytes, alloc);
		st = RW_ERR_INVAL;
		goto restore;
	}
	res = rw_cu.cuIpcGetMemHandle(&h, base);
	if (res != CUDA_SUCCESS) {
		/* e.g. memory from cuMemCreate/VMM or a memory pool: not legacy-IPC exportable */
		rw_cu_fail(res, "cuIpcGetMemHandle");
		st = RW_ERR_UNSUPPORTED;
		goto restore;
	}
	res = rw_cu.cuPointerGetAttribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, base);
	if (res != CUDA_SUCCESS) {
		st = rw_cu_fail(res, "cuPointerGetAttribute(BUFFER_ID)");
		goto restore;
	}
	memset(&desc, 0, sizeof(desc));
	memcpy(desc.handle.bytes, h.reserved, RW_CUDA_IPC_HANDLE_BYTES);
	desc.buffer_id = buffer_id;
	desc.alloc_bytes = alloc;
	desc.offset = dptr - base;
	desc.bytes = bytes;
	st = rw_cuda_device_uuid(ordinal, desc.device_uuid);
	if (st == RW_OK)
		*desc_p = desc;
restore:
	rw_cu.cuCtxSetCurrent(saved);
	return st;
}

/* ---- daemon side ----------------------------------------------------------------------- */

rw_status_t rw_cuda_ipc_cache_create(rw_cuda_ipc_cache_t **cache_p)
{
	rw_cuda_ipc_cache_t *cache = calloc(1, sizeof(*cache));
	if (cache == NULL)
		return RW_ERR_NOMEM;
	*cache_p = cache;
	return RW_OK;
}

static void map_close(rw_cuda_ipc_cache_t *cache, struct rw_cuda_ipc_map *m)
{
	CUresult res;

	if (rw_cu_enter(m->device) == RW_OK) {
		res = rw_cu.cuIpcCloseMemHandle((CUdeviceptr)m->base);
		if (res != CUDA_SUCCESS)
			rw_cu_fail(res, "cuIpcCloseMemHandle");
	}
	if (m->prev)
		m->prev->next = m->next;
	else
		cache->head = m->next;
	if (m->next)
		m->next->prev = m->prev;
	cache->stats.closes++;
	cache->stats.live--;
	free(m);
}

void rw_cuda_ipc_cache_destroy(rw_cuda_ipc_cache_t *cache)
{
	unsigned n = 0;

	if (cache == NULL)
		return;
	while (cache->head) {
		n++;
		map_close(cache, cache->head);
	}
	if (n)
		rw_info("cuda: ipc cache closed %u mapping(s) still in use", n);
	free(cache);
}

static struct rw_cuda_ipc_map *find_current(rw_cuda_ipc_cache_t *cache, int device,
					     const rw_cuda_ipc_handle_t *h)
{
	for (struct rw_cuda_ipc_map *m = cache->head; m; m = m->next)
		if (!m->retired && m->device == device &&
		    memcmp(m->handle.bytes, h->bytes, RW_CUDA_IPC_HANDLE_BYTES) == 0)
			return m;
	return NULL;
}

static struct rw_cuda_ipc_map *find_base(rw_cuda_ipc_cache_t *cache, int device, rw_cuda_dptr_t base)
{
	for (struct rw_cuda_ipc_map *m = cache->head; m; m = m->next)
		if (m->device == device && m->base == base)
			return m;
	return NULL;
}

rw_status_t rw_cuda_ipc_import(rw_cuda_ipc_cache_t *cache, const rw_cuda_ipc_desc_t *desc,
			       uint64_t owner, rw_cuda_ipc_map_t **map_p, rw_cuda_dptr_t *dptr_p)
{
	struct rw_cuda_ipc_map *m, *old;
	CUipcMemHandle h;
	CUdeviceptr d = 0, base = 0;
	size_t size = 0;
	int device = -1;
	rw_status_t st;
	CUresult res;

	st = rw_cuda_init();
	if (st != RW_OK)
		return st;
	if (cache == NULL || desc == NULL || desc->bytes == 0 || desc->alloc_bytes == 0 ||
	    desc->bytes > desc->alloc_bytes || desc->offset > desc->alloc_bytes - desc->bytes) {
		rw_err("cuda: import (owner %llu): range %llu+%llu outside a %llu-byte allocation",
		       (unsigned long long)owner, (unsigned long long)(desc ? desc->offset : 0),
		       (unsigned long long)(desc ? desc->bytes : 0),
		       (unsigned long long)(desc ? desc->alloc_bytes : 0));
		return RW_ERR_INVAL;
	}
	st = rw_cuda_device_by_uuid(desc->device_uuid, &device);
	if (st != RW_OK) {
		rw_err("cuda: import (owner %llu): no device with the buffer's UUID here",
		       (unsigned long long)owner);
		return RW_ERR_NOTFOUND;
	}

	old = find_current(cache, device, &desc->handle);
	if (old && old->owner == owner && old->buffer_id == desc->buffer_id) {
		/* Same allocation, same exporter: share the mapping. */
		if (old->bytes != desc->alloc_bytes) {
			rw_err("cuda: import (owner %llu): allocation size %llu disagrees with the mapped %llu",
			       (unsigned long long)owner, (unsigned long long)desc->alloc_bytes,
			       (unsigned long long)old->bytes);
			return RW_ERR_INVAL;
		}
		old->refs++;
		cache->stats.hits++;
		*map_p = old;
		*dptr_p = old->base + desc->offset;
		return RW_OK;
	}

	st = rw_cu_enter(device);
	if (st != RW_OK)
		return st;
	memcpy(h.reserved, desc->handle.bytes, RW_CUDA_IPC_HANDLE_BYTES);
	res = rw_cu.cuIpcOpenMemHandle(&d, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	if (res == CUDA_ERROR_ALREADY_MAPPED) {
		cache->stats.refused_stale++;
		rw_err("cuda: import (owner %llu): handle already mapped in this process",
		       (unsigned long long)owner);
		return RW_ERR_EXISTS;
	}
	if (res != CUDA_SUCCESS) {
		rw_cu_fail(res, "cuIpcOpenMemHandle");
		return res == CUDA_ERROR_OUT_OF_MEMORY ? RW_ERR_NOMEM : RW_ERR_CLIENT;
	}
	/* The driver refcounts opens of one handle per context and returns the existing address.
	 * If that address is a mapping we already hold for a *different* (owner, buffer_id), the
	 * handle bytes were recycled by a new allocation (or claimed by another client) while the
	 * old mapping is still referenced: using it would serve stale memory. Refuse. */
	if (find_base(cache, device, (rw_cuda_dptr_t)d) != NULL) {
		rw_cu.cuIpcCloseMemHandle(d); /* undo the driver's extra reference only */
		cache->stats.refused_stale++;
		rw_err("cuda: import (owner %llu, buffer %llu): handle bytes still mapped for an earlier "
		       "registration; release it first", (unsigned long long)owner,
		       (unsigned long long)desc->buffer_id);
		return RW_ERR_EXISTS;
	}
	/* Trust the driver's view of the allocation, not the client's. */
	res = rw_cu.cuMemGetAddressRange(&base, &size, d);
	if (res != CUDA_SUCCESS || base != d || desc->bytes > size || desc->offset > size - desc->bytes) {
		if (res != CUDA_SUCCESS)
			rw_cu_fail(res, "cuMemGetAddressRange");
		else
			rw_err("cuda: import (owner %llu): range %llu+%llu outside the %zu-byte mapping",
			       (unsigned long long)owner, (unsigned long long)desc->offset,
			       (unsigned long long)desc->bytes, size);
		rw_cu.cuIpcCloseMemHandle(d);
		return RW_ERR_INVAL;
	}
	m = calloc(1, sizeof(*m));
	if (m == NULL) {
		rw_cu.cuIpcCloseMemHandle(d);
		return RW_ERR_NOMEM;
	}
	m->handle = desc->handle;
	m->device = device;
	m->owner = owner;
	m->buffer_id = desc->buffer_id;
	m->base = (rw_cuda_dptr_t)d;
	m->bytes = size;
	m->refs = 1;
	if (old)
		old->retired = 1; /* its holders keep it; new lookups find the new mapping */
	m->next = cache->head;
	if (cache->head)
		cache->head->prev = m;
	cache->head = m;
	cache->stats.opens++;
	cache->stats.live++;
	*map_p = m;
	*dptr_p = m->base + desc->offset;
	return RW_OK;
}

void rw_cuda_ipc_release(rw_cuda_ipc_cache_t *cache, rw_cuda_ipc_map_t *map)
{
	if (cache == NULL || map == NULL || map->refs == 0)
		return;
	if (--map->refs == 0)
		map_close(cache, map);
}

unsigned rw_cuda_ipc_release_owner(rw_cuda_ipc_cache_t *cache, uint64_t owner)
{
	struct rw_cuda_ipc_map *m, *next;
	unsigned n = 0;

	if (cache == NULL)
		return 0;
	for (m = cache->head; m; m = next) {
		next = m->next;
		if (m->owner != owner)
			continue;
		n += m->refs;
		map_close(cache, m);
	}
	return n;
}

rw_cuda_dptr_t rw_cuda_ipc_map_base(const rw_cuda_ipc_map_t *map) { return map->base; }
uint64_t rw_cuda_ipc_map_bytes(const rw_cuda_ipc_map_t *map) { return map->bytes; }
int rw_cuda_ipc_map_device(const rw_cuda_ipc_map_t *map) { return map->device; }
unsigned rw_cuda_ipc_map_refs(const rw_cuda_ipc_map_t *map) { return map->refs; }

void rw_cuda_ipc_cache_stats(const rw_cuda_ipc_cache_t *cache, rw_cuda_ipc_stats_t *stats_p)
{
	*stats_p = cache->stats;
}

#endif /* RW_HAVE_CUDA_H */
