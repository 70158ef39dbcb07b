/* The face of service/core/ (the folders above include this header, nothing else of core/):
 * the daemon object, its stats socket and Prometheus endpoint, with the configuration
 * (svc_config.h), the metrics (svc_metrics.h) and health and readiness (health.h) it is built
 * from. Everything here runs on the one libev loop thread unless a comment says otherwise
 * (docs/architecture.md §2, threads). See docs/service.md for the operator's view. */
#ifndef RW_SVC_H
#define RW_SVC_H

#include <stdint.h>

#include <ev.h>

#include "common/common.h"
#include "sched/sched.h"
#include "service/core/svc_config.h"
#include "service/core/svc_metrics.h"
#include "service/core/health.h"

/* =============================================================================================
 * The daemon object
 * ============================================================================================= */

typedef struct rw_svc_stats rw_svc_stats_t;
typedef struct rw_svc_http rw_svc_http_t;

typedef struct rw_svc {
	struct ev_loop *loop;
	rw_svc_config_t cfg;
	rw_topo_t topo;                 /* from cfg (rw_svc_config_topo) */
	rw_svc_metrics_t metrics;       /* live; loop thread only */
	rw_svc_metrics_pub_t pub;       /* published copy for the HTTP thread */
	/* The anchor table for the selector; NULL = none (Joint). Replaced on SIGHUP between loop
	 * callbacks: read it at selection time, never keep the pointer across callbacks. */
	rw_anchor_table_t *anchors;
	rw_svc_stats_t *stats;
	rw_svc_http_t *http;
	int draining;                   /* SIGTERM seen: no new phases */
	int stopping;                   /* rw_svc_stop() called */

	/* ---- owned by main.c ---- */
	ev_signal sig_term, sig_int, sig_hup;
	ev_timer publish_timer;
	ev_timer drain_timer;           /* forces the stop if the drain overruns */

	/* The phase executor with the peer mesh and the IPC server (service/exec/exec.h). */
	struct rw_svc_exec *exec;
	/* The executor's IPC server while it listens (NULL otherwise), for the stats socket's
	 * client listing; loop thread only. */
	struct rw_ipc_server *ipc;
} rw_svc_t;

/* main.c starts, in order: stats, HTTP, the executor (rw_svc_exec_create: mesh and movers),
 * its IPC server, the loop; and stops them in reverse. SIGTERM/SIGINT call rw_svc_exec_drain(),
 * which refuses new phases, lets the running ones finish or fail by their phase timeout and
 * then calls rw_svc_stop(); main.c also arms drain_timer at phase_timeout_ms + 1 s and stops
 * the daemon itself if the drain has not finished by then. */

/* Stop the daemon: ev_break the loop (idempotent). Inline, so the parts that end a drain need
 * not call back into main.c. */
static inline void rw_svc_stop(rw_svc_t *svc)
{
	if (svc->stopping)
		return;
	svc->stopping = 1;
	ev_timer_stop(svc->loop, &svc->drain_timer);
	ev_break(svc->loop, EVBREAK_ALL);
}

/* SIGHUP: re-read cfg.anchors. A table that does not parse or whose fingerprint does not match
 * this cluster is refused (the old one stays; the reason is logged and counted). An empty
 * anchors path unloads the table. Defined in main.c. */
rw_status_t rw_svc_anchors_reload(rw_svc_t *svc);

/* =============================================================================================
 * Stats socket (service/core/stats.c)
 * Unix stream socket on the loop; text protocol, one command per line, every reply ends with
 * an empty line. See docs/service.md for the commands and the error rules.
 * ============================================================================================= */

#define RW_SVC_STATS_LINE_MAX 4096   /* longest accepted command line, incl. newline */
#define RW_SVC_STATS_CLIENTS_MAX 64  /* further clients get an error and are closed */

/* Bind cfg->stats_socket (replacing a stale socket file, refusing a live one) and start
 * accepting on svc->loop. The server reads svc->cfg and svc->metrics when answering. */
rw_status_t rw_svc_stats_start(rw_svc_t *svc, rw_svc_stats_t **stats_p);
/* Close every client and the listening socket, unlink the path. NULL is fine. */
void rw_svc_stats_stop(rw_svc_stats_t *stats);
/* Render one command's reply (without the trailing empty line) - what the socket sends.
 * Returns 0 for a known command, -1 for an unknown one (out then holds an "error ..." line). */
int rw_svc_stats_answer(const rw_svc_t *svc, const char *line, rw_svc_buf_t *out);
/* Ranks holding a rank page now (the rank path's ranks; ipc/): what `stats` says live and what
 * the daemon copies into its metrics (rank_pages) before each publish. Loop thread only. */
uint32_t rw_svc_rank_pages(const rw_svc_t *svc);

/* =============================================================================================
 * Prometheus endpoint (service/core/http.c, libmicrohttpd; a no-op stub without RW_HAVE_MHD)
 * ============================================================================================= */

/* Listen on cfg.http (when http_enabled) with MHD's internal polling thread; GET /metrics
 * renders the published snapshot (svc->pub). *http_p = NULL when disabled. */
rw_status_t rw_svc_http_start(rw_svc_t *svc, rw_svc_http_t **http_p);
void rw_svc_http_stop(rw_svc_http_t *http);
/* The bound port (useful with port 0). */
uint16_t rw_svc_http_port(const rw_svc_http_t *http);

/* The daemon's GPUs' progress (service/core/gpu.c; docs/rankpath.md "A hung GPU"), one table per
 * process: a device one of the daemon's streams (the movers' staging, the header pull) waited on
 * for the bound without one of its marks landing is stalled: logged once, shown by stats and
 * metrics, and every copy asked of it is refused, named, until each stream that stalled on it
 * saw a mark land again. stall_set: the bound (gpu_stall_ms; 0 keeps the default, 5000 ms).
 * stall / moved: a stream of device d stalled (its oldest mark waiting since `since_ns`) / landed
 * a mark again (landed 1) or was given up (0); the first stall and the last landing are logged.
 * stalled: whether d is stalled now, with a sentence naming it in why (len bytes) if why.
 * stalled_list: the stalled devices (up to max of them) and, in *held_bytes_p, the page-locked
 * memory held for copies that may still land. held: that memory grew or shrank. gpus_stalled:
 * whether a device of devs (bit d) is stalled, the first such named in why as stalled does.
 * gpu_list: devs written as "0,2" (the empty string for none), cut to len bytes. */
void rw_svc_gpu_stall_set(uint32_t ms);
uint64_t rw_svc_gpu_stall_ns(void);
void rw_svc_gpu_stall(int device, uint64_t since_ns);
void rw_svc_gpu_moved(int device, int landed);
int rw_svc_gpu_stalled(int device, char *why, size_t len);
unsigned rw_svc_gpu_stalled_list(int *devices, unsigned max, uint64_t *held_bytes_p);
void rw_svc_gpu_held(int64_t delta_bytes);
int rw_svc_gpus_stalled(uint64_t devs, char *why, size_t len);
void rw_svc_gpu_list(uint64_t devs, char *out, size_t len);
/* Shutdown waits for the copies queued into ranks' CUDA memory (rw_svc_exec_ipc_stop) at most the
 * stall bound plus this: the stage declares a stall within a second of its bound. */
#define RW_SVC_GPU_DRAIN_MARGIN_MS 2000

#endif /* RW_SVC_H */
