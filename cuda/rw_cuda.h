/* RailWave cuda/: the daemon's (and librailwave's) only door to CUDA. The driver is loaded at run
 * time (dlopen "libcuda.so.1"), so one build runs on CPU-only nodes: there every call reports
 * RW_ERR_UNSUPPORTED and rw_cuda_unavailable_reason() says why. Contracts and design: docs/cuda.md.
 *
 * Threads: rw_cuda_init() may be called from any thread, any number of times. Every other call
 * makes the named device's primary context current on the calling thread itself. An IPC cache or a
 * stream is owned by one thread (the daemon's event loop); it is not locked. */
#ifndef RW_CUDA_H
#define RW_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

/* ---------------------------------------------------------------------------------------------
 * Driver and devices
 * ------------------------------------------------------------------------------------------- */

typedef uint64_t rw_cuda_dptr_t; /* a device address (CUdeviceptr); 0 is never valid */

/* Load the driver (once per process; later calls return the first call's result) and cuInit it.
 * RW_ERR_UNSUPPORTED: no libcuda.so.1 (or the file named by $RW_CUDA_DRIVER), a driver too old
 * for a required entry point, cuInit failed, or no device. Never blocks for long, never aborts. */
rw_status_t rw_cuda_init(void);

/* Why rw_cuda_init() failed (static text), or "" after success or before any call. */
const char *rw_cuda_unavailable_reason(void);

/* Number of devices visible to this process (0 when the driver is absent). */
int rw_cuda_device_count(void);

/* The device's 16-byte UUID (ordinals differ between processes with different
 * CUDA_VISIBLE_DEVICES; the UUID does not). */
rw_status_t rw_cuda_device_uuid(int device, uint8_t uuid_p[16]);

/* Ordinal in this process of the device with this UUID; RW_ERR_NOTFOUND if none. */
rw_status_t rw_cuda_device_by_uuid(const uint8_t uuid[16], int *device_p);

/* Short name, e.g. "NVIDIA H200", into buf (always NUL-terminated). */
rw_status_t rw_cuda_device_name(int device, char *buf, size_t len);

/* Driver version as the driver reports it (e.g. 13000 for 13.0). */
rw_status_t rw_cuda_driver_version(int *version_p);

/* Release the primary contexts this module retained and forget the loaded kernels. Call once at
 * shutdown, after every cache and stream is destroyed. rw_cuda_init() stays done (the library
 * stays loaded: unloading a CUDA driver mid-process is not supported by the driver). */
void rw_cuda_shutdown(void);

/* ---------------------------------------------------------------------------------------------
 * Device and pinned host memory, blocking copies (setup, tests and tools; not for the hot path)
 * ------------------------------------------------------------------------------------------- */

/* memcpy_htod, memcpy_dtoh and memset_d8 are complete when they return, for every stream and
 * every process that maps the memory (they wait for the legacy default stream they run on). */

rw_status_t rw_cuda_mem_alloc(int device, size_t bytes, rw_cuda_dptr_t *dptr_p);
void rw_cuda_mem_free(int device, rw_cuda_dptr_t dptr);
rw_status_t rw_cuda_memcpy_htod(int device, rw_cuda_dptr_t dst, const void *src, size_t bytes);
rw_status_t rw_cuda_memcpy_dtoh(int device, void *dst, rw_cuda_dptr_t src, size_t bytes);
rw_status_t rw_cuda_memset_d8(int device, rw_cuda_dptr_t dst, uint8_t value, size_t bytes);

/* Page-locked host memory usable by async copies on any device (portable). */
rw_status_t rw_cuda_host_alloc(size_t bytes, void **ptr_p);
void rw_cuda_host_free(void *ptr);
/* Page-lock existing host memory (e.g. a client's memfd mapping) for async copies. */
rw_status_t rw_cuda_host_register(void *ptr, size_t bytes);
void rw_cuda_host_unregister(void *ptr);
/* Page-lock existing host memory and map it into every device (DEVICEMAP): kernels read and
 * write it at *dptr_p (over PCIe or C2C). With unified addressing that is ptr itself. Undo with
 * rw_cuda_host_unregister(ptr). Memory from rw_cuda_host_alloc() needs no call: with unified
 * addressing kernels use its host pointer as it is. */
rw_status_t rw_cuda_host_register_mapped(void *ptr, size_t bytes, rw_cuda_dptr_t *dptr_p);

/* ---------------------------------------------------------------------------------------------
 * CUDA IPC: the client exports, the daemon imports through a cache
 * ------------------------------------------------------------------------------------------- */

#define RW_CUDA_IPC_HANDLE_BYTES 64

typedef struct rw_cuda_ipc_handle {
	uint8_t bytes[RW_CUDA_IPC_HANDLE_BYTES]; /* CUipcMemHandle, opaque */
} rw_cuda_ipc_handle_t;

/* What a client sends to register a range of device memory. Plain data, safe to put on a wire
 * (fixed-size fields; the receiver validates everything). */
typedef struct rw_cuda_ipc_desc {
	rw_cuda_ipc_handle_t handle; /* cuIpcGetMemHandle of the allocation that holds the range */
	uint64_t buffer_id;          /* CU_POINTER_ATTRIBUTE_BUFFER_ID of that allocation in the
	                                exporting process: unique there, never reused */
	uint64_t alloc_bytes;        /* size of the whole allocation (cuMemGetAddressRange) */
	uint64_t offset;             /* start of the registered range inside the allocation */
	uint64_t bytes;              /* length of the registered range */
	uint8_t device_uuid[16];     /* device of the allocation */
} rw_cuda_ipc_desc_t;

/* Client side: describe [dptr, dptr + bytes), which must lie inside one cuMemAlloc allocation of
 * this process. RW_ERR_INVAL if it does not; RW_ERR_UNSUPPORTED if the memory cannot be exported
 * (e.g. it was not allocated with cuMemAlloc/cudaMalloc). */
rw_status_t rw_cuda_ipc_export(rw_cuda_dptr_t dptr, size_t bytes, rw_cuda_ipc_desc_t *desc_p);

typedef struct rw_cuda_ipc_cache rw_cuda_ipc_cache_t;
typedef struct rw_cuda_ipc_map rw_cuda_ipc_map_t; /* one imported allocation, refs per connection */

rw_status_t rw_cuda_ipc_cache_create(rw_cuda_ipc_cache_t **cache_p);
/* Closes every mapping still held (and logs how many there were). */
void rw_cuda_ipc_cache_destroy(rw_cuda_ipc_cache_t *cache);
/* Frees the cache and closes no mapping (logs how many it left): at shutdown, where copies queued
 * on a GPU that did not finish them may still use the mappings; the process's exit unmaps them. */
void rw_cuda_ipc_cache_leave(rw_cuda_ipc_cache_t *cache);

/* Who asks for an import: the connection that will hold the reference, and the process that
 * exported the memory as the daemon knows it. Every connection of one process shares that
 * process's mappings (docs/cuda.md "IPC import cache"). */
typedef struct rw_cuda_ipc_owner {
	uint64_t conn;       /* the importing connection: an incarnation number, never reused while
	                        the daemon runs */
	int32_t pid;         /* the exporting process (SO_PEERCRED of the connection); 0: unknown */
	uint64_t start_time; /* that process's start time (/proc/<pid>/stat field 22), so a reused
	                        pid never names an exited process; 0: unknown. With either unknown
	                        the connection shares nothing with other connections. */
} rw_cuda_ipc_owner_t;

/* Daemon side: map the client's range for `owner->conn`.
 * The allocation is opened once per exporting process: a later import of the same (device,
 * handle bytes, buffer_id) from any connection of the same process (same pid and start time) is
 * a cache hit and takes another reference for that connection. Every successful import must be
 * paired with one rw_cuda_ipc_release() by the same connection (or that connection's
 * rw_cuda_ipc_release_owner()); the mapping is closed when the last reference of its last
 * connection goes. On success *map_p is the reference and *dptr_p the range's address in this
 * process (mapped base + desc->offset).
 * Errors: RW_ERR_INVAL (range outside the allocation, zero length, sizes that disagree with
 * what the driver reports), RW_ERR_NOTFOUND (no device with that UUID), RW_ERR_EXISTS (the
 * handle bytes are still mapped for a different allocation or another process: the driver would
 * hand back the old, stale mapping, so the import is refused until that one is released),
 * RW_ERR_UNSUPPORTED (no driver), RW_ERR_CLIENT (the driver refused the handle), RW_ERR_NOMEM. */
rw_status_t rw_cuda_ipc_import(rw_cuda_ipc_cache_t *cache, const rw_cuda_ipc_desc_t *desc,
			       const rw_cuda_ipc_owner_t *owner, rw_cuda_ipc_map_t **map_p,
			       rw_cuda_dptr_t *dptr_p);

/* Drop one reference that connection `conn` took with rw_cuda_ipc_import(). */
void rw_cuda_ipc_release(rw_cuda_ipc_cache_t *cache, rw_cuda_ipc_map_t *map, uint64_t conn);

/* Drop every reference still held by connection `conn` (it went away), leaving other
 * connections' references to the same mappings alone; returns how many. The caller must not
 * release those references again. */
unsigned rw_cuda_ipc_release_owner(rw_cuda_ipc_cache_t *cache, uint64_t conn);

rw_cuda_dptr_t rw_cuda_ipc_map_base(const rw_cuda_ipc_map_t *map); /* mapped allocation base */
uint64_t rw_cuda_ipc_map_bytes(const rw_cuda_ipc_map_t *map);     /* allocation size */
int rw_cuda_ipc_map_device(const rw_cuda_ipc_map_t *map);         /* ordinal in this process */
unsigned rw_cuda_ipc_map_refs(const rw_cuda_ipc_map_t *map);    /* all connections' references */
unsigned rw_cuda_ipc_map_users(const rw_cuda_ipc_map_t *map);   /* connections holding any */

typedef struct rw_cuda_ipc_stats {
	uint64_t hits;          /* imports served from the cache */
	uint64_t shared;        /* of those, hits by a connection that was not yet a user */
	uint64_t opens;         /* cuIpcOpenMemHandle calls that produced a mapping */
	uint64_t closes;        /* mappings closed */
	uint64_t refused_stale; /* imports refused with RW_ERR_EXISTS */
	uint64_t live;          /* mappings open now */
} rw_cuda_ipc_stats_t;
void rw_cuda_ipc_cache_stats(const rw_cuda_ipc_cache_t *cache, rw_cuda_ipc_stats_t *stats_p);

/* ---------------------------------------------------------------------------------------------
 * dmabuf export for NIC registration (ibv_reg_dmabuf_mr)
 * ------------------------------------------------------------------------------------------- */

/* 1 if the device can export device memory as a dmabuf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
 * and the driver has cuMemGetHandleForAddressRange), else 0. */
int rw_cuda_dmabuf_supported(int device);

/* A dmabuf fd for [dptr, dptr + bytes); both must be aligned to the host page size (callers
 * round the registration outwards and keep the offset). The caller owns and closes the fd.
 * RW_ERR_UNSUPPORTED when the device or driver cannot; RW_ERR_INVAL for unaligned ranges. */
rw_status_t rw_cuda_dmabuf_export(int device, rw_cuda_dptr_t dptr, size_t bytes, int *fd_p);

/* GPUDirect RDMA consistency (docs/cuda.md "Consistency"): the widest scope in which writes a NIC
 * made into `device`'s memory are seen in order without a flush
 * (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: 0 none, 100 the owning device, 200 every
 * device); 0 where unknown. */
int rw_cuda_gdr_ordering(int device);
/* Make every NIC write into `device`'s memory that completed before this call visible to the
 * owning device's work (all_devices 0) or to every device's (1): cuFlushGPUDirectRDMAWrites,
 * skipped where rw_cuda_gdr_ordering already covers the scope. Blocks briefly.
 * RW_ERR_UNSUPPORTED: a flush is needed and the driver or device cannot do it. */
rw_status_t rw_cuda_gdr_flush(int device, int all_devices);

/* ---------------------------------------------------------------------------------------------
 * GPU memory lent by fd (cuda/vmm.c; docs/rankpath.md "The slab areas, lent per group")
 * ------------------------------------------------------------------------------------------- */

/* One physical allocation on one device made shareable as a POSIX fd (cuMemCreate with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), mapped into this process. The owner creates and
 * exports it; a process given a copy of the fd (SCM_RIGHTS) imports it. Release unmaps it here;
 * the memory itself goes when no process maps or holds it. */
typedef struct rw_cuda_vmm rw_cuda_vmm_t;
#define RW_CUDA_VMM_DEVICES 16 /* devices one import grants access to, at most */

/* 1 if `device` makes such memory (virtual memory management and POSIX fd handles, and the
 * driver has every entry point), else 0. */
int rw_cuda_vmm_supported(int device);
/* The allocation granularity (CU_MEM_ALLOC_GRANULARITY_MINIMUM, a power of two). */
rw_status_t rw_cuda_vmm_granularity(int device, size_t *gran_p);
/* Owner: `bytes` rounded up to the granularity on `device`, exported once (rw_cuda_vmm_fd, owned
 * by the allocation: send copies) and mapped read-write for `device`. On failure the reason is
 * in why (naming the call that failed) and nothing is kept. */
rw_status_t rw_cuda_vmm_create(int device, size_t bytes, rw_cuda_vmm_t **vmm_p, char *why,
			       size_t cap);
/* Importer: the allocation behind `fd` (a copy of an owner's export; the caller keeps and closes
 * its fd), `bytes` long (a multiple of the granularity), on `device` (an ordinal of this
 * process), mapped and granted read-write to each of devices[0..n) (1 <= n <=
 * RW_CUDA_VMM_DEVICES). A device other than `device` gets access only where the two reach each
 * other (cuDeviceCanAccessPeer): else RW_ERR_UNSUPPORTED, named. RW_ERR_INVAL: a bad fd (not
 * such an export), size or device. The reason in why; nothing kept on failure. */
rw_status_t rw_cuda_vmm_import(int fd, size_t bytes, int device, const int *devices, unsigned n,
			       rw_cuda_vmm_t **vmm_p, char *why, size_t cap);
void rw_cuda_vmm_release(rw_cuda_vmm_t *vmm);
int rw_cuda_vmm_fd(const rw_cuda_vmm_t *vmm);             /* the owner's export; -1 imported */
rw_cuda_dptr_t rw_cuda_vmm_dptr(const rw_cuda_vmm_t *vmm); /* the mapping in this process */
size_t rw_cuda_vmm_bytes(const rw_cuda_vmm_t *vmm);
int rw_cuda_vmm_device(const rw_cuda_vmm_t *vmm);

/* ---------------------------------------------------------------------------------------------
 * Pulls: device memory read into host memory by copies, a word as the mark (cuda/pull.c;
 * docs/rankpath.md "The slab areas, lent per group": the daemon reads its GPU carve-outs' record
 * headers this way). No host function, no kernel, no eventfd: the caller's loop polls the word.
 * ------------------------------------------------------------------------------------------- */

/* A non-blocking stream on `device` and a page-locked word its marks write. Destroy waits for
 * what is enqueued. RW_ERR_UNSUPPORTED: no cuMemcpy2DAsync or no 64-bit stream writes. */
typedef struct rw_cuda_pull rw_cuda_pull_t;
rw_status_t rw_cuda_pull_create(int device, rw_cuda_pull_t **pull_p);
void rw_cuda_pull_destroy(rw_cuda_pull_t *pull);
/* A hung device's pull given up without waiting (cuStreamDestroy returns at once and the driver
 * releases the stream once its work is done): the word its marks write is left allocated while
 * a mark may still land in it (the process's exit reclaims it). */
void rw_cuda_pull_abandon(rw_cuda_pull_t *pull);
int rw_cuda_pull_device(const rw_cuda_pull_t *pull);
/* Enqueue `rows` copies of `width` bytes, row i from src + i x src_pitch (device memory) to
 * dst + i x dst_pitch (page-locked host memory, valid until a later mark landed): one
 * cuMemcpy2DAsync, so records' headers come without their rows. rows or width 0: nothing. */
rw_status_t rw_cuda_pull_rows(rw_cuda_pull_t *pull, void *dst, size_t dst_pitch, rw_cuda_dptr_t src,
			      size_t src_pitch, size_t width, size_t rows);
/* Enqueue the next mark (1, 2, ...; its number in *mark_p): the word takes that value once every
 * copy enqueued before it is done, after the driver's memory barrier (cuStreamWriteValue64,
 * default flags), so a CPU that sees it with rw_cuda_pull_landed sees those copies' bytes. */
rw_status_t rw_cuda_pull_mark(rw_cuda_pull_t *pull, uint64_t *mark_p);
/* The last mark landed (a load-acquire of the word; no CUDA call, any thread). */
uint64_t rw_cuda_pull_landed(const rw_cuda_pull_t *pull);
/* RW_OK while the stream is healthy (busy or idle); the failure (logged, named) when a copy on
 * it faulted: no later mark lands then. */
rw_status_t rw_cuda_pull_fault(rw_cuda_pull_t *pull);

/* ---------------------------------------------------------------------------------------------
 * Streams: async copies and kernels, with completions an event loop can watch
 * ------------------------------------------------------------------------------------------- */

typedef struct rw_cuda_stream rw_cuda_stream_t;

/* A non-blocking stream on `device` plus an eventfd that becomes readable when a mark completes. */
rw_status_t rw_cuda_stream_create(int device, rw_cuda_stream_t **stream_p);
/* The same at the context's greatest stream priority when `high` (cuCtxGetStreamPriorityRange,
 * cuStreamCreateWithPriority; RW_ERR_UNSUPPORTED where the driver has neither), else at the
 * default one; *priority_p (if given): the priority the stream got (0 = the default). */
rw_status_t rw_cuda_stream_create_prio(int device, int high, rw_cuda_stream_t **stream_p,
				       int *priority_p);
/* Waits for the stream's outstanding work, then frees it. */
void rw_cuda_stream_destroy(rw_cuda_stream_t *stream);
/* A hung device's stream given up without waiting (cuStreamDestroy returns at once and the
 * driver releases the stream once its work is done): its record and eventfd stay allocated while
 * a queued mark's host function may still write them (the process's exit reclaims them). */
void rw_cuda_stream_abandon(rw_cuda_stream_t *stream);

int rw_cuda_stream_device(const rw_cuda_stream_t *stream);
/* The eventfd (EFD_NONBLOCK) to watch for EV_READ; rw_cuda_stream_poll() drains it. */
int rw_cuda_stream_fd(const rw_cuda_stream_t *stream);

/* Enqueue async copies. Host memory must be pinned (rw_cuda_host_alloc/_register) for the copy
 * to be asynchronous; it must stay valid until a later mark completes. */
rw_status_t rw_cuda_copy_dtoh_async(rw_cuda_stream_t *stream, void *dst, rw_cuda_dptr_t src,
				    size_t bytes);
rw_status_t rw_cuda_copy_htod_async(rw_cuda_stream_t *stream, rw_cuda_dptr_t dst,
				    const void *src, size_t bytes);
rw_status_t rw_cuda_copy_dtod_async(rw_cuda_stream_t *stream, rw_cuda_dptr_t dst,
				    rw_cuda_dptr_t src, size_t bytes);

/* Enqueue a byte fill of device memory. RW_ERR_UNSUPPORTED when the driver lacks it. */
rw_status_t rw_cuda_memset_async(rw_cuda_stream_t *stream, rw_cuda_dptr_t dst, uint8_t value,
				 size_t bytes);

/* Enqueue a completion mark carrying `token`: once all work enqueued before it has finished, the
 * token becomes pollable and the eventfd is signalled. Marks complete in the order made.
 * RW_ERR_AGAIN when RW_CUDA_STREAM_MAX_MARKS are outstanding (poll first). */
#define RW_CUDA_STREAM_MAX_MARKS 1024
rw_status_t rw_cuda_stream_mark(rw_cuda_stream_t *stream, uint64_t token);

/* Never blocks: drains the eventfd and stores up to `max` completed tokens, oldest first.
 * Returns how many were stored (0 if none), or a negative rw_status_t if the stream failed
 * (a faulted kernel or copy: the stream is then unusable and must be destroyed). */
int rw_cuda_stream_poll(rw_cuda_stream_t *stream, uint64_t *tokens_p, int max);

/* Blocking wait for everything enqueued (tests, tools and shutdown only). */
rw_status_t rw_cuda_stream_sync(rw_cuda_stream_t *stream);

/* ---------------------------------------------------------------------------------------------
 * Kernels (cuda/kernels.cu, embedded at build time when nvcc was found)
 * ------------------------------------------------------------------------------------------- */

typedef enum rw_cuda_dtype {
	RW_CUDA_BF16 = 0,
	RW_CUDA_FP32 = 1,
} rw_cuda_dtype_t;

/* 1 if this build embeds the kernels and they load on `device` (sm_90 code, or PTX the driver
 * can compile), else 0: callers then take their host paths. */
int rw_cuda_kernels_available(int device);

/* Pack (gather): for i < nrows, slab[i] = src[idx[i]], rows of row_bytes bytes.
 * slab, src: device memory; idx: device array of nrows uint32 row numbers (caller guarantees
 * they are in range: the kernel does not check). Any row_bytes; 16-byte aligned rows are fastest. */
rw_status_t rw_cuda_pack(rw_cuda_stream_t *stream, rw_cuda_dptr_t slab, rw_cuda_dptr_t src,
			 rw_cuda_dptr_t idx, uint32_t nrows, uint32_t row_bytes);

/* Unpack / forward (scatter): for i < nrows, dst[idx[i]] = slab[i]. Distinct idx[i] expected
 * (duplicates: one of the rows wins). */
rw_status_t rw_cuda_unpack(rw_cuda_stream_t *stream, rw_cuda_dptr_t dst, rw_cuda_dptr_t slab,
			   rw_cuda_dptr_t idx, uint32_t nrows, uint32_t row_bytes);

/* Combine-reduce, deterministic (no atomics; a fixed summation order):
 * for t < ntokens: out[t] += sum over j in [offsets[t], offsets[t+1]) of weights[j] * rows[row_idx[j]]
 * rows: (row dtype) × hidden per row; out: (out dtype) × hidden per token; accumulation in fp32.
 * offsets: ntokens + 1 uint32 (CSR), row_idx: uint32, weights: fp32 — all device arrays. */
rw_status_t rw_cuda_combine(rw_cuda_stream_t *stream, rw_cuda_dptr_t out, rw_cuda_dtype_t out_dtype,
			    rw_cuda_dptr_t rows, rw_cuda_dtype_t row_dtype, uint32_t hidden,
			    uint32_t ntokens, rw_cuda_dptr_t offsets, rw_cuda_dptr_t row_idx,
			    rw_cuda_dptr_t weights);

/* Row lists (the daemon's CUDA data mover, service/mover/mover_cuda.c): every entry names its own
 * source and destination address, each of which may be device memory, another device's (peer)
 * memory or mapped pinned host memory. The list itself must be readable by the kernel (device
 * memory or pinned host memory, 16-byte aligned) and stay unchanged until the work is done. */
typedef struct rw_cuda_row_copy {
	uint64_t src, dst;
} rw_cuda_row_copy_t;
typedef struct rw_cuda_row_sum {
	uint64_t dst;
	uint32_t first, count;   /* rows srcs[first .. first + count) */
} rw_cuda_row_sum_t;

/* for i < n: copy row_bytes from list[i].src to list[i].dst. aligned16: every address is 16-byte
 * aligned (the caller checked), so 16-byte vectors are used when row_bytes allows. */
rw_status_t rw_cuda_copy_rows(rw_cuda_stream_t *stream, rw_cuda_dptr_t list, uint32_t n,
			      uint32_t row_bytes, int aligned16);
/* Combine slabs: for i < n, dst = the one row srcs[first] as it is (count 1), or the fp32 sum of
 * count rows (the first loaded, the others added in order) stored as dtype, bf16 rounded to nearest
 * even with a NaN kept quiet — bit for bit service/phase/forward.c's arithmetic. Rows and dst are
 * hidden elements of dtype; srcs: u64 addresses (8-byte aligned array). aligned16: every address is
 * 16-byte aligned. */
rw_status_t rw_cuda_rows_sum(rw_cuda_stream_t *stream, rw_cuda_dptr_t list, rw_cuda_dptr_t srcs,
			     uint32_t n, uint32_t hidden, rw_cuda_dtype_t dtype, int aligned16);
/* Owner sums: for i < n, the fp32 row dst += each of its count rows (dtype), in order. Entries
 * of one call must name distinct dst rows. */
rw_status_t rw_cuda_rows_acc(rw_cuda_stream_t *stream, rw_cuda_dptr_t list, rw_cuda_dptr_t srcs,
			     uint32_t n, uint32_t hidden, rw_cuda_dtype_t dtype);
/* dst[i] = (dtype) src[i] for i < n fp32 elements, rounded as rw_cuda_rows_sum rounds. */
rw_status_t rw_cuda_store_f32(rw_cuda_stream_t *stream, rw_cuda_dptr_t dst, rw_cuda_dtype_t dtype,
			      rw_cuda_dptr_t src, uint64_t n);

/* Routing counts on the GPU (sched/counts.c's pass 1, bit for bit): for one rank's n_tokens x
 * topk int32 expert ids, add each token's distinct destination nodes (expert e on node
 * e / (n_experts / nodes)) into the uint32 row[nodes * rails] at the rank's native `rail`;
 * launched once per local rank into one zeroed row, it is the node's count row, the only bytes
 * the exchange needs on the host. An id of -1 is skipped; another id outside [0, n_experts)
 * writes 1 + that token's index into the uint32 at `bad` (zero it first) and counts nothing for
 * the token. */
rw_status_t rw_cuda_route_count(rw_cuda_stream_t *stream, rw_cuda_dptr_t ids, uint32_t n_tokens,
				uint32_t topk, uint32_t n_experts, uint32_t nodes, uint32_t rails,
				uint32_t rail, rw_cuda_dptr_t row, rw_cuda_dptr_t bad);

/* ---- several devices (cuda/peer.c; docs/cuda.md "Several GPUs") ----------------------------- */

/* Let kernels on `device` read and write `peer`'s memory (cuCtxEnablePeerAccess on device's
 * primary context; enabling it again is fine). RW_OK also for device == peer. RW_ERR_UNSUPPORTED:
 * the two cannot reach each other (cuDeviceCanAccessPeer), or the driver lacks the entry points:
 * a kernel on device must not touch peer's memory then (copy it over first). */
rw_status_t rw_cuda_peer_enable(int device, int peer);

/* ---- stream order across processes (cuda/event.c; docs/cuda.md "Stream-ordered submission") -- */

typedef struct rw_cuda_event rw_cuda_event_t;
/* Trainer side: an interprocess event (no timing) on `device` and its 64 handle bytes. */
rw_status_t rw_cuda_event_export(int device, rw_cuda_event_t **ev_p,
				 uint8_t handle[RW_CUDA_IPC_HANDLE_BYTES]);
/* Daemon side: open a trainer's event by its handle bytes. RW_ERR_INVAL: not an event handle. */
rw_status_t rw_cuda_event_import(int device, const uint8_t handle[RW_CUDA_IPC_HANDLE_BYTES],
				 rw_cuda_event_t **ev_p);
void rw_cuda_event_destroy(rw_cuda_event_t *ev);
rw_status_t rw_cuda_event_record(rw_cuda_event_t *ev, rw_cuda_stream_t *stream);
/* Work enqueued on `stream` after this waits for the event's most recent record *as of this
 * call* (a record made later is not waited for: the recorder must record before it tells us). */
rw_status_t rw_cuda_stream_wait_event(rw_cuda_stream_t *stream, rw_cuda_event_t *ev);
/* Stream-ordered 32-bit flags in device memory (any process's mapping of it): write `value`
 * once the work before it is done; make later work wait until the flag is >= `value` (a wait may
 * be enqueued before the write it waits for). */
rw_status_t rw_cuda_stream_write_u32(rw_cuda_stream_t *stream, rw_cuda_dptr_t addr, uint32_t value);
rw_status_t rw_cuda_stream_wait_u32(rw_cuda_stream_t *stream, rw_cuda_dptr_t addr, uint32_t value);
/* Write `value` into the 32-bit word at addr (device memory of `device`) now, from the host
 * (cuMemcpyHtoD on this process's legacy stream, which no other process's stream can block):
 * a stream-ordered submission's flag on its error paths. */
rw_status_t rw_cuda_write_u32(int device, rw_cuda_dptr_t addr, uint32_t value);
/* Block until the event's most recent record (as of this call) has completed. */
rw_status_t rw_cuda_event_sync(rw_cuda_event_t *ev);

/* ---- words on a stream: the rank path's hand-offs (cuda/words.c; docs/rankpath.md) ----------- */

/* A stream librailwave enqueues on and never owns: the caller's (a CUstream as an integer, as
 * torch.cuda.Stream.cuda_stream gives it; 0 is the legacy stream) on `device`. */
typedef struct rw_cuda_ext_stream {
	int device;
	uint32_t max_blocks;   /* 0, or the most blocks any kernel enqueued through this takes (the
	                          rank path's SM budget: a grid of N blocks runs on at most N SMs at a
	                          time); the kernels loop over their items, so any grid is correct */
	uint64_t handle;
} rw_cuda_ext_stream_t;

/* One of our streams, seen as a caller's (tests, tools). */
rw_status_t rw_cuda_ext_stream_of(rw_cuda_stream_t *stream, rw_cuda_ext_stream_t *ext_p);

/* 1 if `device` runs 64-bit stream memory operations (the entry points are there and
 * CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS says yes), else 0. */
int rw_cuda_words_supported(int device);

/* Both enqueue and return at once; neither blocks the host. `addr` is an 8-byte aligned word in
 * device memory or in host memory mapped with rw_cuda_host_register_mapped (its *dptr_p).
 * Write: `value` lands once the stream's earlier work is done, after a memory barrier, so a
 * reader that sees it (load-acquire) sees everything the stream wrote before it.
 * Wait: the stream's later work starts once (int64_t)(*addr - value) >= 0 (cyclic GEQ), whoever
 * writes the word — another stream, another process's stream, or a CPU store.
 * RW_ERR_INVAL: addr 0, unaligned, or not memory the device can reach; RW_ERR_UNSUPPORTED: the
 * driver lacks the operation (rw_cuda_words_supported says 0). */
rw_status_t rw_cuda_word_write(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t addr, uint64_t value);
rw_status_t rw_cuda_word_wait(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t addr, uint64_t value);

/* An async copy of `bytes` from src to dst on a caller's stream (device memory, or host memory
 * mapped with rw_cuda_host_register_mapped, on either side). */
rw_status_t rw_cuda_copy_ext(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t dst, rw_cuda_dptr_t src,
			     size_t bytes);

/* rw_cuda_route_count on a caller's stream (the rank path's count kernel, launched in the rank's
 * own process: docs/rankpath.md "A phase"), on at most s->max_blocks blocks when that is set.
 * Same arguments and errors; RW_ERR_INVAL also for a device this process does not have. */
rw_status_t rw_cuda_route_count_ext(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t ids,
				    uint32_t n_tokens, uint32_t topk, uint32_t n_experts,
				    uint32_t nodes, uint32_t rails, uint32_t rail, rw_cuda_dptr_t row,
				    rw_cuda_dptr_t bad);
/* ---- rank kernels: the rank path's data kernels (cuda/rank_kernels.cu, a second image;
 * cuda/rank_kernels.c; docs/rankpath.md "A phase") ------------------------------------------- *
 * Launched in the rank's own process, on the caller's stream, with every argument a plain
 * device-visible address (device memory, or host memory mapped with
 * rw_cuda_host_register_mapped: the rank page, the group's slabs) and sizes, in the argument
 * blocks of cuda/rank_abi.h; they read the rank page's plan and list entries in place. The bytes
 * they write are the host mover's (service/mover/mover_host.c, docs/dataflow.md): dispatch
 * records, a rank's dispatch output (rows, metadata, per-expert counts), combine records and
 * the owner's sums; the daemon's CPU writes only plans and lists. A kernel that finds a nonzero
 * int32 at `status` (the phase failed, pair P6) writes nothing but its empty outputs (forward:
 * recv_n, overflow and counts 0). Every wrapper checks its block (RW_ERR_INVAL: the caller's
 * bug), enqueues, and returns; RW_ERR_UNSUPPORTED when the rank image is absent. Every launch
 * takes at most s->max_blocks blocks when that is set (the kernels are grid-stride). */
#include "cuda/rank_abi.h"

/* 1 if this build embeds the rank kernels and they load on `device`, else 0. */
int rw_cuda_rank_kernels_available(int device);

/* The SMs of `device` (CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT), or 0 when the driver does not
 * say: the most an SM budget (rw_cuda_ext_stream_t.max_blocks) may ask. */
int rw_cuda_device_sms(int device);

/* Pack: the rank's n_tokens tokens (x: rows of hidden x dtype; ids: topk int32, or int64 with
 * ids_int64, -1 a dropped slot; weights: topk f32) into dispatch records in the slabs: one per
 * (token, node d holding one of its experts, expert e on node e / (n_experts / nodes)),
 * d == me included (its entries place them in the local area). The rank's records to d are
 * numbered in token order; record i goes where the entry (d, r) with first <= i < first + count
 * says: slab[r] + offset + (i - first) x rec_size (ipc/page.h rw_page_plan_find). A record is
 * the header (tag = tags[d], src_node me, owner, token, topk), the top-k block (ids as int32,
 * weights), the row, padding zeroed. The numbering is a prefix count per destination (one block
 * counts, then one block per token writes; no atomics decide a slot). Errors on the device
 * (err): an id out of range (E_ID: that token gets no record, as the count kernel counts none
 * for it), a record no entry holds (E_PLAN: not written). scratch: device memory of
 * rw_cuda_rank_pack_scratch(n_tokens, topk) bytes. Host-side checks: topk 1..32, nodes 1..4096,
 * rails 1..RW_CUDA_RANK_RAILS, n_experts a multiple of nodes, addresses aligned to their types,
 * slabs 16-byte aligned. */
size_t rw_cuda_rank_pack_scratch(uint32_t n_tokens, uint32_t topk);
rw_status_t rw_cuda_rank_pack(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_pack_t *a);

/* Forward: the records the dispatch list names (list_n entries, each a record at
 * area[entry.area][entry.rail] + slot x rec_size) into the rank's dispatch output, in list order:
 * row j = the record's row; meta j = src_node | src_node x gpus + owner | token | 0 | ids |
 * weights (16 + 8 topk bytes; docs/dataflow.md "Dispatch output"); counts[e] = how many of the
 * written rows' ids name e, for this rank's experts (global rank me x gpus + g), 0 for every
 * other expert. Rows beyond cap are dropped: recv_n = min(list_n, cap), overflow = list_n -
 * recv_n. The daemon checked the records (P4); a header whose top-k or owner does not fit
 * still sets E_RECORD, an entry naming no area or rail E_REF (that row is left as it was). */
rw_status_t rw_cuda_rank_forward(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_forward_t *a);

/* Gather (combine, per rank): for entry j of the rank's dispatch list (list_n <= cap), the
 * combine record of the dispatch record at (rail r, slot p) from node s = entry.node goes where
 * the combine plan's entry (s, r) with first <= p < first + count says: slab[r] + offset +
 * (p - first) x crec_size, header tag = tags[s], src_node me, rail r, slot p - first; its row is
 * the entry's terms — rows[g] row j alone (term_off 0), or terms [term_off[j], term_off[j+1]),
 * each a row of a local rank (ref g' << 24 | row: rows[g'] + row x row bytes): one term copied as
 * it is, several summed in fp32 in order (the first loaded, the others added) and rounded once,
 * as service/mover/mover_host.c's combine_pack sums a record several local ranks answered; an
 * entry with no terms is left to another rank (nothing written). */
rw_status_t rw_cuda_rank_gather(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_gather_t *a);

/* Reduce (the owner): for t < n_tokens, output row t = the fp32 sum, from +0, of the combine
 * rows the reduce list gives token t (entries sorted by token; each at area[area][rail] + slot
 * x crec_size + 16), in list order, rounded once (bf16: to nearest even, NaN kept quiet); a
 * token without entries gets +0: the owner's sum of docs/dataflow.md "Combine"
 * (service/phase/forward.c rw_svc_rows_reduce) for terms listed in its order. A list out of token order or longer than cap,
 * or an entry naming a token >= n_tokens or no area or rail, sets E_REF (the sums are then not
 * the list's). */
rw_status_t rw_cuda_rank_reduce(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_reduce_t *a);

/* Static mode's hand-offs (cuda/rank_abi.h RW_CUDA_RANK_OP_*; docs/rankpath.md "Static mode and
 * CUDA graphs"): one operation of rw_rank_ctl on the stream, reading the phase number from the
 * control block, so that a replayed graph takes a new phase each time; and eager mode's SNAP,
 * which copies page slot slot_k into a device mirror after the stream's wait on the word
 * (docs/rankpath.md "Eager mode's mirrors"; ctl and report unused). The block's addresses
 * are device addresses (the page and the report through rw_cuda_host_register_mapped /
 * rw_cuda_host_alloc). RW_ERR_INVAL: an address 0 or unaligned, an unknown operation or word,
 * slot_k past depth. */
rw_status_t rw_cuda_rank_ctl(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_ctl_t *a);

/* ---- the rank kernels on the CPU (cuda/rank_cpu.c) ------------------------------------------ *
 * One implementation for every CPU that plays a rank's stream: host ranks (rank/host.c), the
 * daemon playing a ring rank of a rank-path pair (service/mover/mover_mix.c) and the CUDA
 * stand-in driver (tests/integration/fake_cuda_rank.c). Each does what its kernel above states
 * for its block, on this thread (or the threads `par` asks for), every address a pointer of this
 * process, the sizes set (rec_size, crec_size: the functions below); errors go to the block's
 * error word as the kernel's do. No allocation, no system call but the threads' start and join.
 * `par`: rows copied and summed by up to par.threads threads (1: this one), each given at least
 * par.min_bytes of rows (0: any split); the same bytes for any split. */
#define RW_CUDA_CPU_THREADS_MAX 64
typedef struct rw_cuda_cpu_par {
	uint32_t threads;
	uint32_t min_bytes;
	uint32_t blocks;       /* 0: as above; N: a GPU grid of N blocks played on this thread, one
	                          block after another, block b taking items b, b + N, b + 2N, ...
	                          (rank_kernels.cu's grid-stride loops; the stand-in's launches) */
} rw_cuda_cpu_par_t;
/* Bytes of a dispatch record and of a combine record (common/wire_rec.h) of this shape. */
uint32_t rw_cuda_cpu_rec_size(uint32_t topk, uint32_t hidden, uint32_t dtype);
uint32_t rw_cuda_cpu_crec_size(uint32_t hidden, uint32_t dtype);
/* rw_cuda_route_count's row and bad word (int32 ids), added to row[] and *bad. */
void rw_cuda_cpu_count(const int32_t *ids, uint32_t n_tokens, uint32_t topk, uint32_t n_experts,
		       uint32_t nodes, uint32_t rails, uint32_t rail, uint32_t *row, uint32_t *bad);
/* rw_cuda_rank_pack. next: u32[nodes] of the caller's (the records to each node so far). In
 * one pass on this thread, the block's scratch unused; or in two steps, the numbering into the
 * scratch, then the records (split over threads). */
void rw_cuda_cpu_pack(const rw_cuda_rank_pack_t *a, uint32_t *next);
void rw_cuda_cpu_pack_index(const rw_cuda_rank_pack_t *a, uint32_t *next);
void rw_cuda_cpu_pack_rows(const rw_cuda_rank_pack_t *a, rw_cuda_cpu_par_t par);
void rw_cuda_cpu_forward(const rw_cuda_rank_forward_t *a, rw_cuda_cpu_par_t par);
void rw_cuda_cpu_gather(const rw_cuda_rank_gather_t *a, rw_cuda_cpu_par_t par);
void rw_cuda_cpu_reduce(const rw_cuda_rank_reduce_t *a, rw_cuda_cpu_par_t par);

/* ---- graphs (cuda/graph.c) ----------------------------------------------------------------- *
 * Begin: what is enqueued on the stream from now on is recorded, not run (global capture mode:
 * a host synchronization of this process meanwhile fails and spoils the capture). End: the
 * recorded work as a graph ready to launch (RW_ERR_* from the driver when the capture was spoilt).
 * Launch: one replay of it on a stream of its device, in that stream's order. */
typedef struct rw_cuda_graph rw_cuda_graph_t;
rw_status_t rw_cuda_graph_begin(const rw_cuda_ext_stream_t *s);
rw_status_t rw_cuda_graph_end(const rw_cuda_ext_stream_t *s, rw_cuda_graph_t **graph_p);
rw_status_t rw_cuda_graph_launch(rw_cuda_graph_t *g, const rw_cuda_ext_stream_t *s);
void rw_cuda_graph_destroy(rw_cuda_graph_t *g);

#endif /* RW_CUDA_H */
