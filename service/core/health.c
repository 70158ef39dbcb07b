/* railwaved health and readiness (service/core/health.h): the loop's health tick, the readiness
 * rule shared by HTTP, the stats socket and `railwave wait`, and the sd_notify(3) protocol through
 * libsystemd. The state is one static object: rw_svc_t has no slot for it, and what it mirrors
 * ($NOTIFY_SOCKET, the watchdog) belongs to the process anyway. */
#include "service/core/svc.h"

#include "config.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if RW_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

static struct {
	rw_svc_t *svc;                /* loop thread only */
	ev_timer tick;
	ev_signal wedge;              /* test hook, see below */
	unsigned wedge_ms;
	uint64_t watchdog_ns;         /* systemd's WatchdogSec (0 = off) */
	uint64_t last_watchdog_ns;
	int last_ready;               /* -1 before the first STATUS */
	uint32_t last_up;
	_Atomic uint64_t last_tick_ns; /* 0 = never ticked */
	_Atomic int draining;
} health = {.last_ready = -1};

static void notify(const char *msg)
{
#if RW_HAVE_SYSTEMD
	int r = sd_notify(0, msg);
	if (r < 0)
		rw_warn("sd_notify: %s", strerror(-r));
#else
	(void)msg;
#endif
}

int rw_svc_ready_eval(const rw_svc_config_t *cfg, const rw_svc_metrics_t *m, int draining,
		      uint32_t *up_p, rw_svc_buf_t *why)
{
	uint32_t up = 0;
	for (uint32_t p = 0; p < m->peers && p < cfg->n_nodes; p++) {
		if (p == cfg->me)
			continue;
		if (m->peer[p].state == RW_SVC_PEER_UP) {
			up++;
			continue;
		}
		if (why)
			rw_svc_buf_printf(why, "waiting peer=%s state=%s rails_up=%u/%u\n",
					  cfg->nodes[p].name,
					  rw_svc_peer_state_name((rw_svc_peer_state_t)m->peer[p].state),
					  m->peer[p].rails_up, cfg->rails);
	}
	*up_p = up;
	return !draining && up + 1 == cfg->n_nodes;
}

/* STATUS= for `systemctl status`: what the daemon is doing, and who it waits for. */
static void status_update(rw_svc_t *svc, int force)
{
	uint32_t up;
	int ready = rw_svc_ready_eval(&svc->cfg, &svc->metrics, svc->draining, &up, NULL);
	if (!force && ready == health.last_ready && up == health.last_up)
		return;
	health.last_ready = ready;
	health.last_up = up;
	char msg[160];
	snprintf(msg, sizeof(msg), "STATUS=%s: %u/%u peers up on %u rails", svc->draining ?
		 "draining" : ready ? "ready" : "waiting for peers", up, svc->cfg.n_nodes - 1,
		 svc->cfg.rails);
	notify(msg);
}

static void tick_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop;
	(void)w;
	(void)revents;
	uint64_t now = rw_now_ns();
	atomic_store(&health.last_tick_ns, now);
	if (health.watchdog_ns && now - health.last_watchdog_ns >= health.watchdog_ns / 4) {
		notify("WATCHDOG=1");
		health.last_watchdog_ns = now;
	}
	status_update(health.svc, 0);
}

/* RAILWAVE_TEST_WEDGE_MS=N: SIGUSR1 makes the loop sleep N ms, as a wedged loop would, so the
 * tests can see /healthz fail and the watchdog stop while the HTTP thread still answers. */
static void wedge_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
	(void)loop;
	(void)w;
	(void)revents;
	rw_warn("test hook: wedging the loop for %u ms", health.wedge_ms);
	struct timespec ts = {health.wedge_ms / 1000, (long)(health.wedge_ms % 1000) * 1000000L};
	while (nanosleep(&ts, &ts) != 0)
		;
}

rw_status_t rw_svc_health_start(rw_svc_t *svc)
{
	health.svc = svc;
	atomic_store(&health.draining, 0);
	atomic_store(&health.last_tick_ns, rw_now_ns());
	ev_timer_init(&health.tick, tick_cb, RW_SVC_HEALTH_TICK_MS / 1e3,
		      RW_SVC_HEALTH_TICK_MS / 1e3);
	ev_timer_start(svc->loop, &health.tick);
	const char *wedge = getenv("RAILWAVE_TEST_WEDGE_MS");
	if (wedge && *wedge) {
		health.wedge_ms = (unsigned)strtoul(wedge, NULL, 10);
		ev_signal_init(&health.wedge, wedge_cb, SIGUSR1);
		ev_signal_start(svc->loop, &health.wedge);
	}
#if RW_HAVE_SYSTEMD
	uint64_t usec = 0;
	if (sd_watchdog_enabled(0, &usec) > 0) {
		health.watchdog_ns = usec * 1000u;
		if (health.watchdog_ns < 4ull * RW_SVC_HEALTH_TICK_MS * 1000000u)
			rw_warn("systemd: WatchdogSec of %llu ms is shorter than 4 health ticks "
				"(%u ms); expect spurious watchdog kills",
				(unsigned long long)(usec / 1000), 4 * RW_SVC_HEALTH_TICK_MS);
		rw_info("systemd: watchdog every %llu ms", (unsigned long long)(usec / 1000));
	}
#else
	if (getenv("NOTIFY_SOCKET"))
		rw_warn("systemd: $NOTIFY_SOCKET is set but this railwaved was built without "
			"libsystemd; use Type=simple");
#endif
	notify("READY=1");
	health.last_watchdog_ns = rw_now_ns();
	if (health.watchdog_ns)
		notify("WATCHDOG=1");
	status_update(svc, 1);
	return RW_OK;
}

void rw_svc_health_stopping(rw_svc_t *svc)
{
	atomic_store(&health.draining, 1);
	/* the phases' drain, then the GPUs' (rw_svc_exec_ipc_stop), then the teardown's margin */
	uint64_t bound_ms = (uint64_t)svc->cfg.phase_timeout_ms + 1000 +
			    rw_svc_gpu_stall_ns() / 1000000 + RW_SVC_GPU_DRAIN_MARGIN_MS +
			    RW_SVC_HEALTH_STOP_MARGIN_MS;
	char msg[96];
	snprintf(msg, sizeof(msg), "STOPPING=1\nEXTEND_TIMEOUT_USEC=%llu",
		 (unsigned long long)bound_ms * 1000u);
	notify(msg);
	status_update(svc, 1);
}

void rw_svc_health_stop(rw_svc_t *svc)
{
	if (health.svc != svc)
		return;
	ev_timer_stop(svc->loop, &health.tick);
	if (health.wedge_ms)
		ev_signal_stop(svc->loop, &health.wedge);
	health.svc = NULL;
}

int rw_svc_health_live(uint64_t *age_ms_p)
{
	uint64_t last = atomic_load(&health.last_tick_ns);
	if (!last) {
		*age_ms_p = UINT64_MAX;
		return 0;
	}
	uint64_t now = rw_now_ns();
	*age_ms_p = now > last ? (now - last) / 1000000u : 0;
	return *age_ms_p < RW_SVC_HEALTH_STALE_MS;
}

int rw_svc_health_draining(void) { return atomic_load(&health.draining); }
