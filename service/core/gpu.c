/* The daemon's GPUs' progress (docs/rankpath.md "A hung GPU"): one table per process (one daemon
 * per process), kept by the movers' streams (service/mover/stage.c, mover_pull.c) and read by
 * the stats and the metrics; and GPU sets as the logs and the stats name them. The loop's
 * thread only. */
#include <stdio.h>

#include "service/core/svc.h"

#define RW_SVC_GPUS_MAX 64

#define GPU_STALL_DEFAULT_MS 5000u

static struct {
	uint32_t stall_ms;
	uint64_t held_bytes;      /* page-locked memory retired pairs' copies may still write */
	struct {
		uint32_t streams;     /* the daemon's streams stalled on it */
		uint64_t since_ns;    /* when the first of them last saw a mark land */
	} dev[RW_SVC_GPUS_MAX];
} gpus;

void rw_svc_gpu_stall_set(uint32_t ms)
{
	gpus.stall_ms = ms;
}

uint64_t rw_svc_gpu_stall_ns(void)
{
	return (uint64_t)(gpus.stall_ms ? gpus.stall_ms : GPU_STALL_DEFAULT_MS) * 1000000ull;
}

void rw_svc_gpu_stall(int device, uint64_t since_ns)
{
	if (device < 0 || device >= RW_SVC_GPUS_MAX)
		return;
	if (gpus.dev[device].streams++ == 0) {
		gpus.dev[device].since_ns = since_ns;
		rw_err("GPU %d: copies queued %.1f s ago have not landed; its pairs fail, and pairs "
		       "that need it are refused until it moves again", device,
		       (double)(rw_now_ns() - since_ns) * 1e-9);
	}
}

void rw_svc_gpu_moved(int device, int landed)
{
	if (device < 0 || device >= RW_SVC_GPUS_MAX || !gpus.dev[device].streams)
		return;
	if (--gpus.dev[device].streams == 0 && landed)
		rw_warn("GPU %d moves again: its copies landed after %.1f s; pairs may use it",
			device, (double)(rw_now_ns() - gpus.dev[device].since_ns) * 1e-9);
}

int rw_svc_gpu_stalled(int device, char *why, size_t len)
{
	if (device < 0 || device >= RW_SVC_GPUS_MAX || !gpus.dev[device].streams)
		return 0;
	if (why)
		snprintf(why, len, "GPU %d is stalled: copies queued %.1f s ago have not "
			 "landed (refused until it moves again)", device,
			 (double)(rw_now_ns() - gpus.dev[device].since_ns) * 1e-9);
	return 1;
}

unsigned rw_svc_gpu_stalled_list(int *devices, unsigned max, uint64_t *held_bytes_p)
{
	unsigned n = 0;
	for (int d = 0; d < RW_SVC_GPUS_MAX; d++)
		if (gpus.dev[d].streams && n < max)
			devices[n++] = d;
	if (held_bytes_p)
		*held_bytes_p = gpus.held_bytes;
	return n;
}

void rw_svc_gpu_held(int64_t delta_bytes)
{
	gpus.held_bytes = (uint64_t)((int64_t)gpus.held_bytes + delta_bytes);
}

int rw_svc_gpus_stalled(uint64_t devs, char *why, size_t len)
{
	for (int d = 0; d < RW_SVC_GPUS_MAX; d++)
		if ((devs >> d & 1) && rw_svc_gpu_stalled(d, why, len))
			return 1;
	return 0;
}

void rw_svc_gpu_list(uint64_t devs, char *out, size_t len)
{
	size_t at = 0;
	if (len)
		out[0] = '\0';
	for (int d = 0; d < 64 && at < len; d++)
		if (devs >> d & 1) {
			int n = snprintf(out + at, len - at, "%s%d", at ? "," : "", d);
			at += n > 0 ? (size_t)n : 0;
		}
}
