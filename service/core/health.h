/* railwaved health, readiness and the service manager (docs/service.md "Readiness"): what
 * /healthz, /ready, the stats socket's `health`/`ready` and `railwave wait` answer, and the
 * sd_notify(3) messages (READY, STATUS, WATCHDOG, STOPPING) for a Type=notify unit.
 * Healthy = the loop ticked within RW_SVC_HEALTH_STALE_MS. Ready = healthy, not draining, and
 * every other configured node up (its control channel and every rail connected). */
#ifndef RW_SVC_HEALTH_H
#define RW_SVC_HEALTH_H

#include <stdint.h>

#include "service/core/svc_config.h"
#include "service/core/svc_metrics.h"

struct rw_svc;

#define RW_SVC_HEALTH_TICK_MS 250    /* the loop's health tick (and STATUS refresh) */
#define RW_SVC_HEALTH_STALE_MS 2000  /* /healthz fails once the loop missed 8 ticks */
/* A stop may take the drain bound (phase_timeout_ms + 1 s, main.c) plus this for the teardown;
 * the daemon asks systemd for that much with EXTEND_TIMEOUT_USEC when it starts draining. */
#define RW_SVC_HEALTH_STOP_MARGIN_MS 4000

/* Readiness of one view of the metrics (live on the loop, or a published snapshot). Returns 1
 * when no other node is missing and draining is 0. *up_p = other nodes up. When why is not NULL,
 * appends one line per missing node: "waiting peer=NAME state=STATE rails_up=U/R\n". */
int rw_svc_ready_eval(const rw_svc_config_t *cfg, const rw_svc_metrics_t *m, int draining,
		      uint32_t *up_p, rw_svc_buf_t *why);

/* Loop thread, once running: start the health tick (which also feeds systemd's watchdog and
 * keeps STATUS= current) and tell systemd READY=1 (serving; peers may still be connecting:
 * cluster readiness is /ready). The health state is process-wide (one daemon per process, as
 * $NOTIFY_SOCKET is). Without $NOTIFY_SOCKET the sd_notify calls do nothing. */
rw_status_t rw_svc_health_start(struct rw_svc *svc);
/* Loop thread, when a drain begins: STOPPING=1 and EXTEND_TIMEOUT_USEC = the drain bound plus
 * the margin; /ready fails from now on. */
void rw_svc_health_stopping(struct rw_svc *svc);
/* Loop thread, after the loop returned: stop the tick (idempotent; fine without a start). */
void rw_svc_health_stop(struct rw_svc *svc);

/* Any thread. 1 when the loop ticked within RW_SVC_HEALTH_STALE_MS; *age_ms_p = ms since its
 * last tick (UINT64_MAX when it never ticked: health not started). */
int rw_svc_health_live(uint64_t *age_ms_p);
/* Any thread: 1 once rw_svc_health_stopping() ran. */
int rw_svc_health_draining(void);

#endif /* RW_SVC_HEALTH_H */
