/* tests/cuda/fake_cuda_base.h: what the stand-in libcuda.so.1 files share beyond the driver's own
 * entry points (tests/cuda/fake_cuda_base.c): the stream work queues. */
#ifndef RW_FAKE_CUDA_BASE_H
#define RW_FAKE_CUDA_BASE_H

#include <stddef.h>
#include <stdint.h>

/* Stream work (async copies, memsets, kernels, host functions) runs at once by default, unless
 * the stream holds a wait that is not yet satisfied (then it queues behind the wait). With
 * $RW_FAKE_CUDA_LAG_MS set it is queued per stream and run in submission order by the stream's
 * worker thread, which sleeps that long before each item ($RW_FAKE_CUDA_LEGACY_LAG_MS for the
 * legacy stream, if set): a slow GPU, so a caller that reads, posts or reports before the
 * completion it was promised sees stale bytes. Streams are
 * independent (a held wait holds only its own); `stream` is a handle from
 * rw_fake_cuda_stream_create, anything else is the legacy stream. `arg` (at most RW_FAKE_WORK_ARG
 * bytes) is copied. While the stream is captured (cuStreamBeginCapture) the item is recorded,
 * not run; cuGraphLaunch submits the recorded items again, in order. */
typedef void (*rw_fake_work_fn)(const void *arg);
#define RW_FAKE_WORK_ARG 512 /* bytes of a work item's argument at most (a rank kernel's block) */
void *rw_fake_cuda_stream_create(void);
/* Drains the stream, stops its worker, frees it. */
void rw_fake_cuda_stream_destroy(void *stream);
void rw_fake_cuda_submit(const void *stream, rw_fake_work_fn fn, const void *arg, size_t len);
/* As rw_fake_cuda_submit, for an item that may not start before hold(arg) says 1 (a wait): it
 * runs at once only when the stream is idle and hold already says 1, else it is queued and the
 * stream's worker runs it (which may then block: rw_fake_cuda_wait_until). */
void rw_fake_cuda_submit_held(const void *stream, rw_fake_work_fn fn, const void *arg, size_t len,
			      int (*hold)(const void *));
/* Block until ready(arg) says 1, polling every 200 us; give up after $RW_FAKE_CUDA_WAIT_S
 * (default 20) seconds with a line on stderr naming `what`: 0, or -1 when it gave up. */
int rw_fake_cuda_wait_until(int (*ready)(const void *), const void *arg, const char *what);
/* A host synchronization during a global-mode capture: 1 (and the capture is spoilt) when
 * `stream` (NULL: any stream) is being captured, else 0. Each stand-in's cuStreamSynchronize
 * asks this first. */
int rw_fake_cuda_capture_refuses(const void *stream);
/* Items queued or running on the stream (0 without the lag). */
unsigned rw_fake_cuda_busy(const void *stream);
/* A fill of n bytes of v at dst as stream work (cuMemsetD8 on the legacy stream, the Async one on
 * its stream). */
void rw_fake_cuda_fill(const void *stream, void *dst, unsigned char v, size_t n);
/* A host function (cuLaunchHostFunc's fn(arg)) as stream work. */
void rw_fake_cuda_host_fn(const void *stream, void (*fn)(void *), void *arg);
/* Wait until the stream's queue is empty (NULL: every stream's); returns how many items were
 * queued or running. */
unsigned rw_fake_cuda_drain(const void *stream);

/* As rw_fake_cuda_submit, for a copy that writes [dst, dst + dst_n) and reads [src, src + src_n). */
void rw_fake_cuda_submit_copy(const void *stream, rw_fake_work_fn fn, const void *arg, size_t len,
			      uintptr_t dst, size_t dst_n, uintptr_t src, size_t src_n);
/* Copies (rw_fake_cuda_submit_copy: cuMemcpy*Async, the 2D pull) queued or running on any stream
 * whose source or destination overlaps [p, p + n): what memory freed or unmapped now would pull
 * from under them. cuIpcCloseMemHandle (cross-process stand-in), cuMemFreeHost and cuMemUnmap
 * say so on stderr: "fake cuda: ... under N queued copies". */
unsigned rw_fake_cuda_copies_naming(uintptr_t p, size_t n);

/* Open another process's fd `fd` (pid's /proc/<pid>/fd/<fd>) read-write: how both stand-ins
 * share "device" memory and events across processes. -1 when it cannot. */
int rw_fake_open_peer_fd(int pid, int fd);

/* Each stand-in's answer to "is [p, p + n) device memory of this process" (its allocations and
 * IPC mappings); stream memory operations take that or page-locked host memory, nothing else.
 * fake_cuda_base.c has a weak default that says yes to everything. */
int rw_fake_cuda_is_device_mem(uintptr_t p, size_t n);

/* What this process asked of the GPU, counted per process: host functions (cuLaunchHostFunc:
 * a driver thread calls back into the process, as a CUDA mover's mark writes its eventfd),
 * kernel launches, stream work of any kind (copies, memsets, kernels, host functions, stream
 * memory operations), 64-bit stream writes and waits of words; and the stream work that ran
 * (work less work_run: the items queued and not run yet, under the hang switch too, plus those
 * a capture recorded instead of running; a graph's launch counts its items again in both). With
 * $RW_FAKE_CUDA_COUNTS set to a folder, the counts live in <folder>/<pid> from the first counted
 * call: RW_FAKE_N_END little-endian uint64 words in this order, mapped shared and each added to
 * atomically, so a reader at any time sees exact totals; the file stays after the process. */
enum rw_fake_count {
	RW_FAKE_N_HOST_FN, RW_FAKE_N_KERNEL, RW_FAKE_N_WORK, RW_FAKE_N_WORD_WRITE,
	RW_FAKE_N_WORD_WAIT, RW_FAKE_N_WORK_RUN, RW_FAKE_N_END
};
void rw_fake_cuda_count(enum rw_fake_count what);

#endif /* RW_FAKE_CUDA_BASE_H */
