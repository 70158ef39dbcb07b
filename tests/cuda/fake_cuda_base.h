/* tests/cuda/fake_cuda_base.h: what the stand-in libcuda.so.1 files share beyond the driver's own
 * entry points (tests/cuda/fake_cuda_base.c): the stream work queue. */
#ifndef RW_FAKE_CUDA_BASE_H
#define RW_FAKE_CUDA_BASE_H

#include <stddef.h>

/* Stream work (async copies, memsets, kernels, host functions) runs at once by default. With
 * $RW_FAKE_CUDA_LAG_MS set it is queued and run in submission order by one worker thread that
 * sleeps that long before each item: a slow GPU, so a caller that reads, posts or reports before
 * the completion it was promised sees stale bytes. `arg` (at most 64 bytes) is copied. */
typedef void (*rw_fake_work_fn)(const void *arg);
void rw_fake_cuda_submit(rw_fake_work_fn fn, const void *arg, size_t len);
/* Items queued or running (0 without the lag). */
unsigned rw_fake_cuda_busy(void);
/* Wait until the queue is empty; returns how many items were queued or running. */
unsigned rw_fake_cuda_drain(void);

/* Open another process's fd `fd` (pid's /proc/<pid>/fd/<fd>) read-write: how both stand-ins
 * share "device" memory and events across processes. -1 when it cannot. */
int rw_fake_open_peer_fd(int pid, int fd);

#endif /* RW_FAKE_CUDA_BASE_H */
