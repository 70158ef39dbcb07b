/* railwaved HTTP endpoint: GET /metrics in the Prometheus text exposition format, /healthz
 * (the loop answers) and /ready (every peer up; service/core/health.h), served by libmicrohttpd on
 * its own internal polling thread. That thread never touches the loop's live metrics: it copies
 * the snapshot the loop publishes (svc->pub) and renders the copy. We bind the listening socket
 * ourselves (exact address, port 0 allowed) and hand it to MHD. */
#include "service/core/svc.h"

#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#if RW_HAVE_MHD
#include <microhttpd.h>

/* Connections we keep, and how many one address may hold. MHD's own limit sits HTTP_CONNS_SLACK
 * above ours: a connection we shut down to make room stays in MHD's count until its thread next
 * polls and reaps it, and had MHD's limit been ours, a connection accepted in that window (a
 * scrape, under a slowloris that reopens as fast as it is closed) would be refused by MHD. */
#define HTTP_CONNS_MAX 32u
#define HTTP_CONNS_SLACK 8u
#define HTTP_CONNS_PER_ADDR 4u

struct rw_svc_http {
	rw_svc_t *svc;
	struct MHD_Daemon *mhd;
	uint16_t port;
	rw_svc_metrics_t snap; /* used only by MHD's thread (one request at a time) */
	/* Open connections, oldest first, with their peers' addresses (MHD's thread only): when
	 * every slot is taken, the oldest of the address holding the most is shut down, so
	 * that the next scraper always finds one (a slowloris from many addresses cannot keep
	 * every slot) and a scraper's one connection is not taken while another address holds
	 * more (under a fast slowloris on a slow host it could become the oldest before MHD read
	 * its request). */
	int conn_fd[HTTP_CONNS_MAX];
	uint32_t conn_addr[HTTP_CONNS_MAX];
	uint32_t n_conn;
};

/* Drop entry i of the open-connection list, keeping the order. */
static void conn_forget(rw_svc_http_t *http, uint32_t i)
{
	memmove(&http->conn_fd[i], &http->conn_fd[i + 1], (http->n_conn - i - 1) * sizeof(int));
	memmove(&http->conn_addr[i], &http->conn_addr[i + 1],
		(http->n_conn - i - 1) * sizeof(uint32_t));
	http->n_conn--;
}

/* MHD_OPTION_NOTIFY_CONNECTION: keep the list; make room when the slots run low. A prompt
 * client is served within milliseconds of connecting, so it is never the oldest for long. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
			  enum MHD_ConnectionNotificationCode code)
{
	(void)socket_context;
	rw_svc_http_t *http = cls;
	const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn,
								      MHD_CONNECTION_INFO_CONNECTION_FD);
	if (!ci)
		return;
	int fd = (int)ci->connect_fd;
	if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
		for (uint32_t i = 0; i < http->n_conn; i++)
			if (http->conn_fd[i] == fd) {
				conn_forget(http, i);
				break;
			}
		return;
	}
	if (http->n_conn >= HTTP_CONNS_MAX) {
		/* the oldest of the address holding the most; MHD sees the end at its next poll
		 * and closes it (CLOSED would find it gone from the list; until then it holds one
		 * of MHD's HTTP_CONNS_SLACK spare slots) */
		uint32_t victim = 0, most = 0;
		for (uint32_t i = 0; i < http->n_conn; i++) {
			uint32_t held = 0;
			for (uint32_t j = 0; j < http->n_conn; j++)
				held += http->conn_addr[j] == http->conn_addr[i];
			if (held > most) {
				most = held;
				victim = i;
			}
		}
		shutdown(http->conn_fd[victim], SHUT_RDWR);
		conn_forget(http, victim);
	}
	struct sockaddr_in sa = {0};
	socklen_t len = sizeof(sa);
	if (getpeername(fd, (struct sockaddr *)&sa, &len) != 0 || sa.sin_family != AF_INET)
		sa.sin_addr.s_addr = 0;
	http->conn_addr[http->n_conn] = sa.sin_addr.s_addr;
	http->conn_fd[http->n_conn++] = fd;
}

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, const char *type,
			     char *body, size_t len, enum MHD_ResponseMemoryMode mode)
{
	struct MHD_Response *resp = MHD_create_response_from_buffer(len, body, mode);
	if (!resp) {
		if (mode == MHD_RESPMEM_MUST_FREE)
			free(body);
		return MHD_NO;
	}
	MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
	enum MHD_Result r = MHD_queue_response(conn, status, resp);
	MHD_destroy_response(resp);
	return r;
}

/* /healthz: 200 "ok" while the loop ticks, else 503 naming how long it has been silent.
 * /ready: 200 when healthy, not draining and every peer up in the latest snapshot (at most
 * RW_SVC_METRICS_PUBLISH_MS old), else 503 with the reason and one "waiting peer=..." line
 * per missing node. */
static enum MHD_Result probe(rw_svc_http_t *http, struct MHD_Connection *conn, int ready)
{
	rw_svc_buf_t out = {0};
	uint64_t age_ms;
	int ok = rw_svc_health_live(&age_ms);
	if (!ok && age_ms == UINT64_MAX)
		rw_svc_buf_printf(&out, "unhealthy: the loop has not started\n");
	else if (!ok)
		rw_svc_buf_printf(&out, "unhealthy: the loop has not ticked for %llu ms\n",
				  (unsigned long long)age_ms);
	else if (ready && rw_svc_health_draining()) {
		ok = 0;
		rw_svc_buf_printf(&out, "not ready: draining\n");
	} else if (ready) {
		rw_svc_metrics_read(&http->svc->pub, &http->snap);
		uint32_t up;
		rw_svc_buf_t why = {0};
		ok = rw_svc_ready_eval(&http->svc->cfg, &http->snap, 0, &up, &why);
		rw_svc_buf_printf(&out, "%s: %u/%u peers up\n%s", ok ? "ready" : "not ready", up,
				  http->svc->cfg.n_nodes - 1, why.data ? why.data : "");
		rw_svc_buf_free(&why);
	} else {
		rw_svc_buf_printf(&out, "ok\n");
	}
	if (out.oom) {
		rw_svc_buf_free(&out);
		return MHD_NO;
	}
	return reply(conn, ok ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE,
		     "text/plain; charset=utf-8", out.data, out.len, MHD_RESPMEM_MUST_FREE);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
			      const char *method, const char *version, const char *upload,
			      size_t *upload_size, void **con_cls)
{
	(void)version;
	(void)upload;
	rw_svc_http_t *http = cls;
	static char not_found[] = "not found: try /metrics, /healthz or /ready\n";
	static char bad_method[] = "only GET and HEAD\n";
	if (*upload_size) {
		*upload_size = 0; /* ignore request bodies */
		return MHD_YES;
	}
	(void)con_cls;
	int metrics = !strcmp(url, "/metrics"), healthz = !strcmp(url, "/healthz"),
	    ready = !strcmp(url, "/ready");
	if (!metrics && !healthz && !ready)
		return reply(conn, MHD_HTTP_NOT_FOUND, "text/plain; charset=utf-8", not_found,
			     sizeof(not_found) - 1, MHD_RESPMEM_PERSISTENT);
	if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
		return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain; charset=utf-8",
			     bad_method, sizeof(bad_method) - 1, MHD_RESPMEM_PERSISTENT);
	if (healthz || ready)
		return probe(http, conn, ready);

	rw_svc_metrics_read(&http->svc->pub, &http->snap);
	rw_svc_buf_t out = {0};
	rw_svc_metrics_prometheus(&http->svc->cfg, &http->snap, &out);
	if (out.oom) {
		rw_svc_buf_free(&out);
		return MHD_NO;
	}
	return reply(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", out.data,
		     out.len, MHD_RESPMEM_MUST_FREE);
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
	(void)cls;
	char msg[512];
	vsnprintf(msg, sizeof(msg), fmt, ap);
	size_t n = strlen(msg);
	while (n && msg[n - 1] == '\n')
		msg[--n] = '\0';
	rw_warn("http: %s", msg);
}

rw_status_t rw_svc_http_start(rw_svc_t *svc, rw_svc_http_t **http_p)
{
	rw_status_t st;
	*http_p = NULL;
	if (!svc->cfg.http_enabled) {
		rw_info("http: metrics endpoint disabled");
		return RW_OK;
	}
	rw_svc_http_t *http = calloc(1, sizeof(*http));
	if (!http)
		return RW_ERR_NOMEM;
	http->svc = svc;
	st = rw_svc_metrics_init(&http->snap, svc->metrics.rails, svc->metrics.peers);
	if (st)
		goto free_http;

	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		rw_err("http: socket: %m");
		st = RW_ERR_SYS;
		goto free_snap;
	}
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	struct sockaddr_in sin = svc->cfg.http.sin;
	socklen_t slen = sizeof(sin);
	if (bind(fd, (struct sockaddr *)&sin, sizeof(sin)) != 0 || listen(fd, 64) != 0 ||
	    getsockname(fd, (struct sockaddr *)&sin, &slen) != 0) {
		/* In use or not this host's: a configuration-class error (railwaved exits 2). */
		st = errno == EADDRINUSE ? RW_ERR_EXISTS : errno == EADDRNOTAVAIL ? RW_ERR_NOTFOUND :
		     RW_ERR_SYS;
		rw_err("http: listen on %s:%u: %m", svc->cfg.http.text, svc->cfg.http.port);
		close(fd);
		goto free_snap;
	}
	http->port = ntohs(sin.sin_port);
	/* One internal thread; a request renders at most a few hundred KiB. Idle connections
	 * are closed after 10 s, at most 32 are kept and an old one makes room for a new one
	 * (on_connection). MHD owns fd from here on. */
	http->mhd = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, 0, NULL,
				     NULL, handle, http, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
				     MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_TIMEOUT, 10u,
				     MHD_OPTION_CONNECTION_LIMIT, HTTP_CONNS_MAX + HTTP_CONNS_SLACK,
				     /* one address cannot take every slot from the scrapers */
				     MHD_OPTION_PER_IP_CONNECTION_LIMIT, HTTP_CONNS_PER_ADDR,
				     MHD_OPTION_NOTIFY_CONNECTION, on_connection, http,
				     MHD_OPTION_END);
	if (!http->mhd) {
		rw_err("http: cannot start the metrics server on %s:%u", svc->cfg.http.text,
		       http->port);
		close(fd);
		st = RW_ERR_SYS;
		goto free_snap;
	}
	rw_info("http: metrics on http://%s:%u/metrics, probes on /healthz and /ready",
		svc->cfg.http.text, http->port);
	*http_p = http;
	return RW_OK;

free_snap:
	rw_svc_metrics_fini(&http->snap);
free_http:
	free(http);
	return st;
}

void rw_svc_http_stop(rw_svc_http_t *http)
{
	if (!http)
		return;
	MHD_stop_daemon(http->mhd); /* joins the thread and closes the listening socket */
	rw_svc_metrics_fini(&http->snap);
	free(http);
}

uint16_t rw_svc_http_port(const rw_svc_http_t *http)
{
	return http ? http->port : 0;
}

#else /* !RW_HAVE_MHD */

rw_status_t rw_svc_http_start(rw_svc_t *svc, rw_svc_http_t **http_p)
{
	*http_p = NULL;
	if (svc->cfg.http_enabled)
		rw_warn("http: built without libmicrohttpd; metrics endpoint %s:%u not served",
			svc->cfg.http.text, svc->cfg.http.port);
	return RW_OK;
}

void rw_svc_http_stop(rw_svc_http_t *http) { (void)http; }

uint16_t rw_svc_http_port(const rw_svc_http_t *http)
{
	(void)http;
	return 0;
}

#endif
