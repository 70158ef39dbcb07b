/* cuda/absent.c: the module as built without the CUDA toolkit's cuda.h (RW_HAVE_CUDA_H 0).
 * Every entry point answers RW_ERR_UNSUPPORTED (or 0 / nothing), like a node without a driver. */
#include "config.h"

#if !RW_HAVE_CUDA_H
#include <stdio.h>

#include "cuda/rw_cuda.h"

#define RW_NO_CUDA RW_ERR_UNSUPPORTED

rw_status_t rw_cuda_init(void) { return RW_NO_CUDA; }
const char *rw_cuda_unavailable_reason(void)
{
	return "built without the CUDA toolkit's cuda.h: CUDA buffers and kernels are disabled";
}
int rw_cuda_device_count(void) { return 0; }
rw_status_t rw_cuda_device_uuid(int d, uint8_t u[16]) { (void)d; (void)u; return RW_NO_CUDA; }
rw_status_t rw_cuda_device_by_uuid(const uint8_t u[16], int *d) { (void)u; (void)d; return RW_NO_CUDA; }
rw_status_t rw_cuda_device_name(int d, char *b, size_t l) { (void)d; (void)b; (void)l; return RW_NO_CUDA; }
rw_status_t rw_cuda_driver_version(int *v) { (void)v; return RW_NO_CUDA; }
void rw_cuda_shutdown(void) {}
rw_status_t rw_cuda_mem_alloc(int d, size_t n, rw_cuda_dptr_t *p) { (void)d; (void)n; (void)p; return RW_NO_CUDA; }
void rw_cuda_mem_free(int d, rw_cuda_dptr_t p) { (void)d; (void)p; }
rw_status_t rw_cuda_memcpy_htod(int d, rw_cuda_dptr_t a, const void *b, size_t n)
{ (void)d; (void)a; (void)b; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_memcpy_dtoh(int d, void *a, rw_cuda_dptr_t b, size_t n)
{ (void)d; (void)a; (void)b; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_memset_d8(int d, rw_cuda_dptr_t a, uint8_t v, size_t n)
{ (void)d; (void)a; (void)v; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_host_alloc(size_t n, void **p) { (void)n; (void)p; return RW_NO_CUDA; }
void rw_cuda_host_free(void *p) { (void)p; }
rw_status_t rw_cuda_host_register(void *p, size_t n) { (void)p; (void)n; return RW_NO_CUDA; }
void rw_cuda_host_unregister(void *p) { (void)p; }
rw_status_t rw_cuda_ipc_export(rw_cuda_dptr_t p, size_t n, rw_cuda_ipc_desc_t *d)
{ (void)p; (void)n; (void)d; return RW_NO_CUDA; }
rw_status_t rw_cuda_ipc_cache_create(rw_cuda_ipc_cache_t **c) { (void)c; return RW_NO_CUDA; }
void rw_cuda_ipc_cache_destroy(rw_cuda_ipc_cache_t *c) { (void)c; }
void rw_cuda_ipc_cache_leave(rw_cuda_ipc_cache_t *c) { (void)c; }
rw_status_t rw_cuda_ipc_import(rw_cuda_ipc_cache_t *c, const rw_cuda_ipc_desc_t *d,
			       const rw_cuda_ipc_owner_t *o, rw_cuda_ipc_map_t **m, rw_cuda_dptr_t *p)
{ (void)c; (void)d; (void)o; (void)m; (void)p; return RW_NO_CUDA; }
void rw_cuda_ipc_release(rw_cuda_ipc_cache_t *c, rw_cuda_ipc_map_t *m, uint64_t o)
{ (void)c; (void)m; (void)o; }
unsigned rw_cuda_ipc_release_owner(rw_cuda_ipc_cache_t *c, uint64_t o) { (void)c; (void)o; return 0; }
rw_cuda_dptr_t rw_cuda_ipc_map_base(const rw_cuda_ipc_map_t *m) { (void)m; return 0; }
uint64_t rw_cuda_ipc_map_bytes(const rw_cuda_ipc_map_t *m) { (void)m; return 0; }
int rw_cuda_ipc_map_device(const rw_cuda_ipc_map_t *m) { (void)m; return -1; }
unsigned rw_cuda_ipc_map_refs(const rw_cuda_ipc_map_t *m) { (void)m; return 0; }
unsigned rw_cuda_ipc_map_users(const rw_cuda_ipc_map_t *m) { (void)m; return 0; }
void rw_cuda_ipc_cache_stats(const rw_cuda_ipc_cache_t *c, rw_cuda_ipc_stats_t *s)
{ (void)c; *s = (rw_cuda_ipc_stats_t){ 0 }; }
int rw_cuda_dmabuf_supported(int d) { (void)d; return 0; }
rw_status_t rw_cuda_dmabuf_export(int d, rw_cuda_dptr_t p, size_t n, int *fd)
{ (void)d; (void)p; (void)n; (void)fd; return RW_NO_CUDA; }
int rw_cuda_gdr_ordering(int d) { (void)d; return 0; }
rw_status_t rw_cuda_gdr_flush(int d, int a) { (void)d; (void)a; return RW_NO_CUDA; }
rw_status_t rw_cuda_stream_create(int d, rw_cuda_stream_t **s) { (void)d; (void)s; return RW_NO_CUDA; }
rw_status_t rw_cuda_stream_create_prio(int d, int h, rw_cuda_stream_t **s, int *p)
{
	(void)d; (void)h; (void)s; (void)p;
	return RW_NO_CUDA;
}
void rw_cuda_stream_destroy(rw_cuda_stream_t *s) { (void)s; }
void rw_cuda_stream_abandon(rw_cuda_stream_t *s) { (void)s; }
int rw_cuda_stream_device(const rw_cuda_stream_t *s) { (void)s; return -1; }
int rw_cuda_stream_fd(const rw_cuda_stream_t *s) { (void)s; return -1; }
rw_status_t rw_cuda_copy_dtoh_async(rw_cuda_stream_t *s, void *a, rw_cuda_dptr_t b, size_t n)
{ (void)s; (void)a; (void)b; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_copy_htod_async(rw_cuda_stream_t *s, rw_cuda_dptr_t a, const void *b, size_t n)
{ (void)s; (void)a; (void)b; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_copy_dtod_async(rw_cuda_stream_t *s, rw_cuda_dptr_t a, rw_cuda_dptr_t b, size_t n)
{ (void)s; (void)a; (void)b; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_stream_mark(rw_cuda_stream_t *s, uint64_t t) { (void)s; (void)t; return RW_NO_CUDA; }
int rw_cuda_stream_poll(rw_cuda_stream_t *s, uint64_t *t, int m) { (void)s; (void)t; (void)m; return RW_NO_CUDA; }
rw_status_t rw_cuda_stream_sync(rw_cuda_stream_t *s) { (void)s; return RW_NO_CUDA; }
int rw_cuda_kernels_available(int d) { (void)d; return 0; }
rw_status_t rw_cuda_pack(rw_cuda_stream_t *s, rw_cuda_dptr_t a, rw_cuda_dptr_t b, rw_cuda_dptr_t i,
			 uint32_t n, uint32_t l)
{ (void)s; (void)a; (void)b; (void)i; (void)n; (void)l; return RW_NO_CUDA; }
rw_status_t rw_cuda_unpack(rw_cuda_stream_t *s, rw_cuda_dptr_t a, rw_cuda_dptr_t b, rw_cuda_dptr_t i,
			   uint32_t n, uint32_t l)
{ (void)s; (void)a; (void)b; (void)i; (void)n; (void)l; return RW_NO_CUDA; }
rw_status_t rw_cuda_combine(rw_cuda_stream_t *s, rw_cuda_dptr_t o, rw_cuda_dtype_t od, rw_cuda_dptr_t r,
			    rw_cuda_dtype_t rd, uint32_t h, uint32_t n, rw_cuda_dptr_t off,
			    rw_cuda_dptr_t ri, rw_cuda_dptr_t w)
{ (void)s; (void)o; (void)od; (void)r; (void)rd; (void)h; (void)n; (void)off; (void)ri; (void)w; return RW_NO_CUDA; }
rw_status_t rw_cuda_host_register_mapped(void *p, size_t n, rw_cuda_dptr_t *d)
{ (void)p; (void)n; (void)d; return RW_NO_CUDA; }
rw_status_t rw_cuda_memset_async(rw_cuda_stream_t *s, rw_cuda_dptr_t d, uint8_t v, size_t n)
{ (void)s; (void)d; (void)v; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_copy_rows(rw_cuda_stream_t *s, rw_cuda_dptr_t l, uint32_t n, uint32_t b, int a)
{ (void)s; (void)l; (void)n; (void)b; (void)a; return RW_NO_CUDA; }
rw_status_t rw_cuda_rows_sum(rw_cuda_stream_t *s, rw_cuda_dptr_t l, rw_cuda_dptr_t r, uint32_t n,
			     uint32_t h, rw_cuda_dtype_t t, int a)
{ (void)s; (void)l; (void)r; (void)n; (void)h; (void)t; (void)a; return RW_NO_CUDA; }
rw_status_t rw_cuda_rows_acc(rw_cuda_stream_t *s, rw_cuda_dptr_t l, rw_cuda_dptr_t r, uint32_t n,
			     uint32_t h, rw_cuda_dtype_t t)
{ (void)s; (void)l; (void)r; (void)n; (void)h; (void)t; return RW_NO_CUDA; }
rw_status_t rw_cuda_store_f32(rw_cuda_stream_t *s, rw_cuda_dptr_t d, rw_cuda_dtype_t t, rw_cuda_dptr_t r,
			      uint64_t n)
{ (void)s; (void)d; (void)t; (void)r; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_event_export(int d, rw_cuda_event_t **e, uint8_t h[RW_CUDA_IPC_HANDLE_BYTES])
{ (void)d; (void)e; (void)h; return RW_NO_CUDA; }
rw_status_t rw_cuda_event_import(int d, const uint8_t h[RW_CUDA_IPC_HANDLE_BYTES], rw_cuda_event_t **e)
{ (void)d; (void)e; (void)h; return RW_NO_CUDA; }
void rw_cuda_event_destroy(rw_cuda_event_t *e) { (void)e; }
rw_status_t rw_cuda_peer_enable(int d, int p) { (void)d; (void)p; return RW_NO_CUDA; }
rw_status_t rw_cuda_event_record(rw_cuda_event_t *e, rw_cuda_stream_t *s) { (void)e; (void)s; return RW_NO_CUDA; }
rw_status_t rw_cuda_stream_wait_event(rw_cuda_stream_t *s, rw_cuda_event_t *e) { (void)e; (void)s; return RW_NO_CUDA; }
rw_status_t rw_cuda_stream_write_u32(rw_cuda_stream_t *s, rw_cuda_dptr_t a, uint32_t v)
{ (void)s; (void)a; (void)v; return RW_NO_CUDA; }
rw_status_t rw_cuda_stream_wait_u32(rw_cuda_stream_t *s, rw_cuda_dptr_t a, uint32_t v)
{ (void)s; (void)a; (void)v; return RW_NO_CUDA; }
rw_status_t rw_cuda_write_u32(int d, rw_cuda_dptr_t a, uint32_t v) { (void)d; (void)a; (void)v; return RW_NO_CUDA; }
rw_status_t rw_cuda_event_sync(rw_cuda_event_t *e) { (void)e; return RW_NO_CUDA; }
rw_status_t rw_cuda_route_count(rw_cuda_stream_t *s, rw_cuda_dptr_t i, uint32_t n, uint32_t k, uint32_t e,
				uint32_t nodes, uint32_t rails, uint32_t rail, rw_cuda_dptr_t row, rw_cuda_dptr_t bad)
{
	(void)s; (void)i; (void)n; (void)k; (void)e; (void)nodes; (void)rails; (void)rail; (void)row; (void)bad;
	return RW_NO_CUDA;
}
rw_status_t rw_cuda_ext_stream_of(rw_cuda_stream_t *s, rw_cuda_ext_stream_t *e) { (void)s; (void)e; return RW_NO_CUDA; }
int rw_cuda_words_supported(int d) { (void)d; return 0; }
rw_status_t rw_cuda_word_write(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t a, uint64_t v)
{ (void)s; (void)a; (void)v; return RW_NO_CUDA; }
rw_status_t rw_cuda_word_wait(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t a, uint64_t v)
{ (void)s; (void)a; (void)v; return RW_NO_CUDA; }
int rw_cuda_rank_kernels_available(int d) { (void)d; return 0; }
int rw_cuda_device_sms(int d) { (void)d; return 0; }
rw_status_t rw_cuda_rank_pack(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_pack_t *a)
{ (void)s; (void)a; return RW_NO_CUDA; }
rw_status_t rw_cuda_rank_forward(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_forward_t *a)
{ (void)s; (void)a; return RW_NO_CUDA; }
rw_status_t rw_cuda_rank_gather(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_gather_t *a)
{ (void)s; (void)a; return RW_NO_CUDA; }
rw_status_t rw_cuda_rank_reduce(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_reduce_t *a)
{ (void)s; (void)a; return RW_NO_CUDA; }
rw_status_t rw_cuda_copy_ext(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t d, rw_cuda_dptr_t r, size_t n)
{ (void)s; (void)d; (void)r; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_route_count_ext(const rw_cuda_ext_stream_t *s, rw_cuda_dptr_t i, uint32_t n,
				    uint32_t k, uint32_t e, uint32_t nodes, uint32_t rails, uint32_t rail,
				    rw_cuda_dptr_t row, rw_cuda_dptr_t bad)
{
	(void)s; (void)i; (void)n; (void)k; (void)e; (void)nodes; (void)rails; (void)rail; (void)row; (void)bad;
	return RW_NO_CUDA;
}
rw_status_t rw_cuda_rank_ctl(const rw_cuda_ext_stream_t *s, const rw_cuda_rank_ctl_t *a)
{ (void)s; (void)a; return RW_NO_CUDA; }
rw_status_t rw_cuda_graph_begin(const rw_cuda_ext_stream_t *s) { (void)s; return RW_NO_CUDA; }
rw_status_t rw_cuda_graph_end(const rw_cuda_ext_stream_t *s, rw_cuda_graph_t **g)
{ (void)s; (void)g; return RW_NO_CUDA; }
rw_status_t rw_cuda_graph_launch(rw_cuda_graph_t *g, const rw_cuda_ext_stream_t *s)
{ (void)g; (void)s; return RW_NO_CUDA; }
void rw_cuda_graph_destroy(rw_cuda_graph_t *g) { (void)g; }
int rw_cuda_vmm_supported(int d) { (void)d; return 0; }
rw_status_t rw_cuda_vmm_granularity(int d, size_t *g) { (void)d; (void)g; return RW_NO_CUDA; }
rw_status_t rw_cuda_vmm_create(int d, size_t n, rw_cuda_vmm_t **v, char *why, size_t cap)
{
	(void)d; (void)n; (void)v;
	if (why && cap)
		snprintf(why, cap, "built without the CUDA toolkit's cuda.h");
	return RW_NO_CUDA;
}
rw_status_t rw_cuda_vmm_import(int fd, size_t n, int d, const int *ds, unsigned nd,
			       rw_cuda_vmm_t **v, char *why, size_t cap)
{
	(void)fd; (void)n; (void)d; (void)ds; (void)nd; (void)v;
	if (why && cap)
		snprintf(why, cap, "built without the CUDA toolkit's cuda.h");
	return RW_NO_CUDA;
}
void rw_cuda_vmm_release(rw_cuda_vmm_t *v) { (void)v; }
int rw_cuda_vmm_fd(const rw_cuda_vmm_t *v) { (void)v; return -1; }
rw_status_t rw_cuda_pull_create(int d, rw_cuda_pull_t **p) { (void)d; (void)p; return RW_NO_CUDA; }
void rw_cuda_pull_destroy(rw_cuda_pull_t *p) { (void)p; }
void rw_cuda_pull_abandon(rw_cuda_pull_t *p) { (void)p; }
int rw_cuda_pull_device(const rw_cuda_pull_t *p) { (void)p; return -1; }
rw_status_t rw_cuda_pull_rows(rw_cuda_pull_t *p, void *d, size_t dp, rw_cuda_dptr_t s, size_t sp,
			      size_t w, size_t n)
{ (void)p; (void)d; (void)dp; (void)s; (void)sp; (void)w; (void)n; return RW_NO_CUDA; }
rw_status_t rw_cuda_pull_mark(rw_cuda_pull_t *p, uint64_t *m) { (void)p; (void)m; return RW_NO_CUDA; }
uint64_t rw_cuda_pull_landed(const rw_cuda_pull_t *p) { (void)p; return 0; }
rw_status_t rw_cuda_pull_fault(rw_cuda_pull_t *p) { (void)p; return RW_NO_CUDA; }
rw_cuda_dptr_t rw_cuda_vmm_dptr(const rw_cuda_vmm_t *v) { (void)v; return 0; }
size_t rw_cuda_vmm_bytes(const rw_cuda_vmm_t *v) { (void)v; return 0; }
int rw_cuda_vmm_device(const rw_cuda_vmm_t *v) { (void)v; return -1; }
#endif /* !RW_HAVE_CUDA_H */
