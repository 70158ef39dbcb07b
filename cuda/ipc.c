/* cuda/ipc.c: CUDA IPC export (client side) and the daemon's import cache.
 * The cache opens each exported allocation once per exporting process and counts references per
 * connection; docs/cuda.md "IPC import cache" explains the identity rule, the
 * freed-and-reallocated case and pid reuse. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <stdlib.h>
#include <string.h>

struct ipc_user {
	uint64_t conn;
	unsigned refs; /* > 0 while listed */
};

struct rw_cuda_ipc_map {
	struct rw_cuda_ipc_map *next, *prev;
	rw_cuda_ipc_handle_t handle;
	int device;
	/* The exporter: a process (pid, start time) whose connections all share the mapping, or,
	 * where the process is unknown, the one connection that imported it (pid 0). */
	int32_t pid;
	uint64_t start_time;
	uint64_t solo_conn;
	uint64_t buffer_id;   /* exporter's CU_POINTER_ATTRIBUTE_BUFFER_ID */
	rw_cuda_dptr_t base;  /* mapping in this process */
	uint64_t bytes;       /* allocation size as the driver reports it here */
	unsigned refs;        /* sum over users */
	struct ipc_user *users;
	unsigned nusers, users_cap;
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
	free(m->users);
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

void rw_cuda_ipc_cache_leave(rw_cuda_ipc_cache_t *cache)
{
	unsigned n = 0;

	if (cache == NULL)
		return;
	for (struct rw_cuda_ipc_map *m = cache->head, *nx; m; m = nx) {
		nx = m->next;
		n++;
		free(m->users);
		free(m);
	}
	if (n)
		rw_warn("cuda: ipc cache left %u mapping(s) open to the process's exit: copies queued "
			"on a GPU may still use them", n);
	free(cache);
}

static int process_known(const rw_cuda_ipc_owner_t *o)
{
	return o->pid > 0 && o->start_time != 0;
}

/* Did `o`'s process export the allocation behind `m`? A pid alone is not enough: the start time
 * tells a new process that reused the pid from the one that exported (docs/cuda.md). */
static int same_exporter(const struct rw_cuda_ipc_map *m, const rw_cuda_ipc_owner_t *o)
{
	if (process_known(o))
		return m->pid == o->pid && m->start_time == o->start_time;
	return m->pid == 0 && m->solo_conn == o->conn;
}

static struct ipc_user *user_of(struct rw_cuda_ipc_map *m, uint64_t conn)
{
	for (unsigned i = 0; i < m->nusers; i++)
		if (m->users[i].conn == conn)
			return &m->users[i];
	return NULL;
}

/* One more reference for `conn`; RW_ERR_NOMEM leaves `m` as it was. */
static rw_status_t user_ref(rw_cuda_ipc_cache_t *cache, struct rw_cuda_ipc_map *m, uint64_t conn)
{
	struct ipc_user *u = user_of(m, conn);

	if (u == NULL) {
		if (m->nusers == m->users_cap) {
			unsigned cap = m->users_cap ? 2 * m->users_cap : 2;
			struct ipc_user *grown = realloc(m->users, cap * sizeof(*grown));
			if (grown == NULL)
				return RW_ERR_NOMEM;
			m->users = grown;
			m->users_cap = cap;
		}
		u = &m->users[m->nusers++];
		u->conn = conn;
		u->refs = 0;
		if (m->refs)
			cache->stats.shared++;
	}
	u->refs++;
	m->refs++;
	return RW_OK;
}

/* Take `n` of `u`'s references away (all of them: the user goes); closes `m` with its last. */
static void user_unref(rw_cuda_ipc_cache_t *cache, struct rw_cuda_ipc_map *m, struct ipc_user *u,
		       unsigned n)
{
	u->refs -= n;
	m->refs -= n;
	if (u->refs == 0)
		*u = m->users[--m->nusers];
	if (m->nusers == 0)
		map_close(cache, m);
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

/* A hit: the mapping `m` holds this very allocation of this process. */
static rw_status_t import_hit(rw_cuda_ipc_cache_t *cache, struct rw_cuda_ipc_map *m,
			      const rw_cuda_ipc_desc_t *desc, const rw_cuda_ipc_owner_t *owner,
			      rw_cuda_ipc_map_t **map_p, rw_cuda_dptr_t *dptr_p)
{
	if (m->bytes != desc->alloc_bytes) {
		rw_err("cuda: import (connection %llu): allocation size %llu disagrees with the mapped %llu",
		       (unsigned long long)owner->conn, (unsigned long long)desc->alloc_bytes,
		       (unsigned long long)m->bytes);
		return RW_ERR_INVAL;
	}
	if (user_ref(cache, m, owner->conn) != RW_OK)
		return RW_ERR_NOMEM;
	cache->stats.hits++;
	*map_p = m;
	*dptr_p = m->base + desc->offset;
	return RW_OK;
}

rw_status_t rw_cuda_ipc_import(rw_cuda_ipc_cache_t *cache, const rw_cuda_ipc_desc_t *desc,
			       const rw_cuda_ipc_owner_t *owner, rw_cuda_ipc_map_t **map_p,
			       rw_cuda_dptr_t *dptr_p)
{
	struct rw_cuda_ipc_map *m, *old, *held;
	CUipcMemHandle h;
	CUdeviceptr d = 0, base = 0;
	size_t size = 0;
	int device = -1;
	rw_status_t st;
	CUresult res;

	st = rw_cuda_init();
	if (st != RW_OK)
		return st;
	if (cache == NULL || desc == NULL || owner == NULL || desc->bytes == 0 ||
	    desc->alloc_bytes == 0 || desc->bytes > desc->alloc_bytes ||
	    desc->offset > desc->alloc_bytes - desc->bytes) {
		rw_err("cuda: import (connection %llu): range %llu+%llu outside a %llu-byte allocation",
		       (unsigned long long)(owner ? owner->conn : 0),
		       (unsigned long long)(desc ? desc->offset : 0),
		       (unsigned long long)(desc ? desc->bytes : 0),
		       (unsigned long long)(desc ? desc->alloc_bytes : 0));
		return RW_ERR_INVAL;
	}
	st = rw_cuda_device_by_uuid(desc->device_uuid, &device);
	if (st != RW_OK) {
		rw_err("cuda: import (connection %llu): no device with the buffer's UUID here",
		       (unsigned long long)owner->conn);
		return RW_ERR_NOTFOUND;
	}

	old = find_current(cache, device, &desc->handle);
	if (old && same_exporter(old, owner) && old->buffer_id == desc->buffer_id)
		return import_hit(cache, old, desc, owner, map_p, dptr_p);

	st = rw_cu_enter(device);
	if (st != RW_OK)
		return st;
	memcpy(h.reserved, desc->handle.bytes, RW_CUDA_IPC_HANDLE_BYTES);
	res = rw_cu.cuIpcOpenMemHandle(&d, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	if (res == CUDA_ERROR_ALREADY_MAPPED) {
		cache->stats.refused_stale++;
		rw_err("cuda: import (connection %llu): handle already mapped in this process",
		       (unsigned long long)owner->conn);
		return RW_ERR_EXISTS;
	}
	if (res != CUDA_SUCCESS) {
		rw_cu_fail(res, "cuIpcOpenMemHandle");
		return res == CUDA_ERROR_OUT_OF_MEMORY ? RW_ERR_NOMEM : RW_ERR_CLIENT;
	}
	/* The driver refcounts opens of one allocation per context and returns the existing
	 * address. If that address is a mapping we already hold, either it is this allocation of
	 * this process under other handle bytes (share it), or the handle bytes were recycled by a
	 * new allocation, or presented by another process, while the old mapping is still
	 * referenced: using it would serve stale or foreign memory. Refuse. Either way the
	 * driver's extra reference is undone. */
	held = find_base(cache, device, (rw_cuda_dptr_t)d);
	if (held != NULL) {
		rw_cu.cuIpcCloseMemHandle(d);
		if (same_exporter(held, owner) && held->buffer_id == desc->buffer_id)
			return import_hit(cache, held, desc, owner, map_p, dptr_p);
		cache->stats.refused_stale++;
		rw_err("cuda: import (connection %llu pid %d, buffer %llu): handle bytes still mapped for "
		       "an earlier registration%s; release it first", (unsigned long long)owner->conn,
		       (int)owner->pid, (unsigned long long)desc->buffer_id,
		       same_exporter(held, owner) ? "" : " of another process");
		return RW_ERR_EXISTS;
	}
	/* Trust the driver's view of the allocation, not the client's. */
	res = rw_cu.cuMemGetAddressRange(&base, &size, d);
	if (res != CUDA_SUCCESS || base != d || desc->bytes > size || desc->offset > size - desc->bytes) {
		if (res != CUDA_SUCCESS)
			rw_cu_fail(res, "cuMemGetAddressRange");
		else
			rw_err("cuda: import (connection %llu): range %llu+%llu outside the %zu-byte mapping",
			       (unsigned long long)owner->conn, (unsigned long long)desc->offset,
			       (unsigned long long)desc->bytes, size);
		rw_cu.cuIpcCloseMemHandle(d);
		return RW_ERR_INVAL;
	}
	m = calloc(1, sizeof(*m));
	if (m == NULL || user_ref(cache, m, owner->conn) != RW_OK) {
		free(m);
		rw_cu.cuIpcCloseMemHandle(d);
		return RW_ERR_NOMEM;
	}
	m->handle = desc->handle;
	m->device = device;
	if (process_known(owner)) {
		m->pid = owner->pid;
		m->start_time = owner->start_time;
	} else {
		m->solo_conn = owner->conn;
	}
	m->buffer_id = desc->buffer_id;
	m->base = (rw_cuda_dptr_t)d;
	m->bytes = size;
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

void rw_cuda_ipc_release(rw_cuda_ipc_cache_t *cache, rw_cuda_ipc_map_t *map, uint64_t conn)
{
	struct ipc_user *u;

	if (cache == NULL || map == NULL)
		return;
	u = user_of(map, conn);
	if (u == NULL) {
		rw_err("cuda: release by connection %llu, which holds no reference to the mapping at "
		       "0x%llx (ignored)", (unsigned long long)conn, (unsigned long long)map->base);
		return;
	}
	user_unref(cache, map, u, 1);
}

unsigned rw_cuda_ipc_release_owner(rw_cuda_ipc_cache_t *cache, uint64_t conn)
{
	struct rw_cuda_ipc_map *m, *next;
	struct ipc_user *u;
	unsigned n = 0;

	if (cache == NULL)
		return 0;
	for (m = cache->head; m; m = next) {
		next = m->next;
		u = user_of(m, conn);
		if (u == NULL)
			continue;
		n += u->refs;
		user_unref(cache, m, u, u->refs);
	}
	return n;
}

rw_cuda_dptr_t rw_cuda_ipc_map_base(const rw_cuda_ipc_map_t *map) { return map->base; }
uint64_t rw_cuda_ipc_map_bytes(const rw_cuda_ipc_map_t *map) { return map->bytes; }
int rw_cuda_ipc_map_device(const rw_cuda_ipc_map_t *map) { return map->device; }
unsigned rw_cuda_ipc_map_refs(const rw_cuda_ipc_map_t *map) { return map->refs; }
unsigned rw_cuda_ipc_map_users(const rw_cuda_ipc_map_t *map) { return map->nusers; }

void rw_cuda_ipc_cache_stats(const rw_cuda_ipc_cache_t *cache, rw_cuda_ipc_stats_t *stats_p)
{
	*stats_p = cache->stats;
}

#endif /* RW_HAVE_CUDA_H */
