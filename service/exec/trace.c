/* Phase traces (docs/service.md "Phase traces"): the executor's hooks fill a pair's
 * exec_trace_pair_t as the phase runs; when a kind ends, one JSON line describing it is appended
 * to a bounded buffer, written to <trace_dir>/<node>.trace.jsonl at most every second or every
 * 64 KiB. The file rotates to <node>.trace.1.jsonl at trace_max_kib / 2, so the two never hold
 * more than trace_max_kib. A write or open that fails is counted and logged once (until it works
 * again); the records are dropped, the phase never notices. Loop thread only. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "service/exec/exec_int.h"

#define TRACE_FLUSH_AT (64u << 10)  /* write once this much is buffered */
#define TRACE_BUF_MAX (4u << 20)    /* buffered bytes beyond this: records are dropped */
#define TRACE_FLUSH_S 1.0

struct rw_svc_trace {
	exec_t *x;
	ev_timer flush_timer;
	char path[RW_SVC_PATH_MAX + 96], old[RW_SVC_PATH_MAX + 96];
	int fd;
	uint64_t file_bytes, seg_bytes;
	char *buf;                   /* whole records waiting to be written */
	size_t len;
	uint32_t pending;            /* records in buf */
	char *rec;                   /* the record being built */
	size_t rec_len, rec_cap;
	int rec_bad;                 /* out of memory while building it */
	int failing;                 /* a failure was logged and nothing has worked since */
	exec_trace_counters_t c;
};

/* ---- the file ----------------------------------------------------------------------------- */

static void trace_failed(rw_svc_trace_t *t, const char *what, int err)
{
	t->c.errors++;
	if (!t->failing)
		rw_warn("trace: cannot %s %s: %s (phase records are dropped and counted until it "
			"works again)", what, t->path, strerror(err));
	t->failing = 1;
}

static int trace_open(rw_svc_trace_t *t)
{
	if (t->fd >= 0)
		return 0;
	t->fd = open(t->path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	if (t->fd < 0) {
		trace_failed(t, "open", errno);
		return -1;
	}
	struct stat sb;
	t->file_bytes = fstat(t->fd, &sb) == 0 ? (uint64_t)sb.st_size : 0;
	/* A write cut short (full disk) left half a line: end it, so the next record is whole. */
	char last = '\n';
	if (t->file_bytes && pread(t->fd, &last, 1, (off_t)t->file_bytes - 1) == 1 && last != '\n' &&
	    write(t->fd, "\n", 1) == 1)
		t->file_bytes++;
	return 0;
}

static void trace_drop_pending(rw_svc_trace_t *t)
{
	t->c.dropped += t->pending;
	t->pending = 0;
	t->len = 0;
}

/* Write every buffered record to the current file. */
static void trace_flush(rw_svc_trace_t *t)
{
	if (!t->len)
		return;
	if (trace_open(t) != 0)
		return trace_drop_pending(t);
	size_t off = 0;
	while (off < t->len) {
		ssize_t n = write(t->fd, t->buf + off, t->len - off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			trace_failed(t, "write", n < 0 ? errno : ENOSPC);
			close(t->fd); /* reopened (and a cut line ended) at the next flush */
			t->fd = -1;
			return trace_drop_pending(t); /* the written ones too: they are not counted yet */
		}
		off += (size_t)n;
	}
	if (t->failing)
		rw_info("trace: writing to %s again", t->path);
	t->failing = 0;
	t->file_bytes += t->len;
	t->c.bytes += t->len;
	t->c.records += t->pending;
	t->pending = 0;
	t->len = 0;
}

/* The current file would pass half the budget: it becomes the old one. */
static void trace_rotate(rw_svc_trace_t *t)
{
	trace_flush(t);
	if (t->fd >= 0)
		close(t->fd);
	t->fd = -1;
	if (rename(t->path, t->old) != 0 && errno != ENOENT)
		trace_failed(t, "rotate", errno);
	t->file_bytes = 0;
	t->c.rotations++;
	(void)trace_open(t);
}

static void flush_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
	(void)loop, (void)revents;
	trace_flush(w->data);
}

void exec_trace_start(exec_t *x)
{
	const rw_svc_config_t *cfg = &x->svc->cfg;
	if (!cfg->trace_dir[0])
		return;
	rw_svc_trace_t *t = calloc(1, sizeof(*t));
	char *buf = malloc(TRACE_BUF_MAX);
	if (!t || !buf) {
		rw_warn("trace: out of memory, phase traces are off");
		free(t);
		free(buf);
		return;
	}
	t->x = x;
	t->buf = buf;
	t->fd = -1;
	t->seg_bytes = (uint64_t)cfg->trace_max_kib << 9; /* half the budget per file */
	const char *name = cfg->nodes[cfg->me].name;
	snprintf(t->path, sizeof(t->path), "%s/%s.trace.jsonl", cfg->trace_dir, name);
	snprintf(t->old, sizeof(t->old), "%s/%s.trace.1.jsonl", cfg->trace_dir, name);
	if (trace_open(t) == 0)
		rw_info("trace: phase records go to %s (at most %u KiB with %s)", t->path,
			cfg->trace_max_kib, t->old);
	ev_timer_init(&t->flush_timer, flush_cb, TRACE_FLUSH_S, TRACE_FLUSH_S);
	t->flush_timer.data = t;
	ev_timer_start(x->svc->loop, &t->flush_timer);
	x->trace = t;
}

void exec_trace_stop(exec_t *x)
{
	rw_svc_trace_t *t = x->trace;
	if (!t)
		return;
	ev_timer_stop(x->svc->loop, &t->flush_timer);
	trace_flush(t);
	trace_drop_pending(t);
	rw_info("trace: %llu phase records (%llu bytes, %llu rotations) written, %llu dropped, "
		"%llu write failures; %.1f us of loop time per record", (unsigned long long)t->c.records,
		(unsigned long long)t->c.bytes, (unsigned long long)t->c.rotations,
		(unsigned long long)t->c.dropped, (unsigned long long)t->c.errors,
		t->c.ended ? (double)t->c.end_ns / (double)t->c.ended / 1e3 : 0.0);
	if (t->fd >= 0)
		close(t->fd);
	free(t->buf);
	free(t->rec);
	free(t);
	x->trace = NULL;
}

/* ---- the pair's hooks ------------------------------------------------------------------------ */

static exec_trace_kind_t *tk(exec_pair_t *p, rw_svc_phase_kind_t kind) { return &p->tr->k[kind]; }

void exec_trace_open_(exec_pair_t *p)
{
	exec_t *x = p->x;
	exec_trace_pair_t *tr = rw_arena_alloc(&p->mem, 1, sizeof(*tr));
	int ok = tr != NULL;
	for (int k = 0; ok && k < 2; k++) {
		tr->k[k].wave = rw_arena_alloc(&p->mem, x->nodes, sizeof(exec_trace_wave_t));
		tr->k[k].rx = rw_arena_alloc(&p->mem, (size_t)x->nodes * x->rails,
					     sizeof(exec_trace_range_t));
		tr->k[k].granted_ns = rw_arena_alloc(&p->mem, x->nodes, sizeof(uint64_t));
		tr->k[k].last_peer = -1;
		ok = tr->k[k].wave && tr->k[k].rx && tr->k[k].granted_ns;
	}
	if (!ok) {
		x->trace->c.dropped++;
		return;
	}
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	tr->wall0_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	tr->mono0_ns = tr->k[RW_SVC_DISPATCH].t0_ns = rw_now_ns();
	snprintf(tr->group, sizeof(tr->group), "%s", p->g ? p->g->name : "?");
	p->tr = tr;
}

void exec_trace_submit_(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t local)
{
	exec_trace_kind_t *k = tk(p, kind);
	uint64_t now = rw_now_ns();
	if (!k->t0_ns)
		k->t0_ns = now;
	k->last_submit_ns = now;
	k->last_local = local;
	k->submitted |= 1u << local;
}

void exec_trace_mark_(exec_pair_t *p, rw_svc_phase_kind_t kind, int what)
{
	uint64_t now = rw_now_ns();
	if (what == EXEC_TRACE_READY)
		tk(p, kind)->ready_ns = now;
	else
		tk(p, kind)->run_ns = now;
}

void exec_trace_decided_(exec_pair_t *p)
{
	const rw_svc_metrics_t *m = &p->x->svc->metrics;
	p->tr->decided_ns = rw_now_ns();
	if (!m->n_decisions)
		return;
	/* exec_plan_decide recorded the decision just now: the newest in the metrics' ring. */
	const rw_svc_decision_t *d = &m->decision[(m->n_decisions - 1) % RW_SVC_DECISIONS];
	if (d->group != p->key.group || d->layer != p->key.layer || d->step != p->key.step)
		return;
	p->tr->feat = d->feat;
	p->tr->sel = d->sel;
	p->tr->have_sel = 1;
}

void exec_trace_wave_post_(exec_pair_t *p)
{
	if (p->send.wave < p->x->nodes)
		tk(p, p->send.kind)->wave[p->send.wave].post_ns = rw_now_ns();
}

void exec_trace_wave_done_(exec_pair_t *p)
{
	if (p->send.wave < p->x->nodes)
		tk(p, p->send.kind)->wave[p->send.wave].done_ns = rw_now_ns();
}

void exec_trace_grant_wait_(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t wave)
{
	if (wave < p->x->nodes && !tk(p, kind)->wave[wave].wait_ns)
		tk(p, kind)->wave[wave].wait_ns = rw_now_ns();
}

void exec_trace_granted_(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t wave)
{
	if (wave < p->x->nodes)
		tk(p, kind)->wave[wave].grant_ns = rw_now_ns();
}

void exec_trace_grant_sent_(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t wave)
{
	if (wave < p->x->nodes)
		tk(p, kind)->granted_ns[wave] = rw_now_ns();
}

void exec_trace_tx_(exec_pair_t *p, uint32_t rail, uint64_t bytes)
{
	exec_trace_kind_t *k = tk(p, p->send.kind);
	uint64_t now = rw_now_ns();
	if (rail >= RW_MAX_RAILS)
		return;
	exec_trace_rail_t *r = &k->tx[rail];
	if (!r->first_ns)
		r->first_ns = now;
	r->last_ns = now;
	r->bytes += bytes;
	r->writes++;
	r->last_wave = p->send.wave;
	if (p->send.wave < p->x->nodes) {
		k->wave[p->send.wave].bytes += bytes;
		k->wave[p->send.wave].writes++;
	}
}

void exec_trace_rx_(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail,
		    uint64_t bytes)
{
	exec_trace_range_t *r = &tk(p, kind)->rx[(size_t)src * p->x->rails + rail];
	if (!r->first_ns)
		r->first_ns = rw_now_ns();
	r->bytes += bytes;
}

void exec_trace_range_done_(exec_pair_t *p, rw_svc_phase_kind_t kind, uint32_t src, uint32_t rail)
{
	exec_trace_kind_t *k = tk(p, kind);
	uint64_t now = rw_now_ns();
	k->rx[(size_t)src * p->x->rails + rail].done_ns = now;
	k->last_peer = (int32_t)src;
	k->last_peer_ns = now;
}

/* ---- writing a record ---------------------------------------------------------------------- */

static void out(rw_svc_trace_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void out(rw_svc_trace_t *t, const char *fmt, ...)
{
	for (int pass = 0; pass < 2 && !t->rec_bad; pass++) {
		va_list ap;
		va_start(ap, fmt);
		int n = vsnprintf(t->rec + t->rec_len, t->rec_cap - t->rec_len, fmt, ap);
		va_end(ap);
		if (n < 0) {
			t->rec_bad = 1;
		} else if ((size_t)n < t->rec_cap - t->rec_len) {
			t->rec_len += (size_t)n;
			return;
		} else if (pass == 0) {
			size_t cap = RW_MAX(t->rec_cap * 2, t->rec_len + (size_t)n + 4096);
			char *nb = realloc(t->rec, cap);
			if (!nb)
				t->rec_bad = 1;
			else
				t->rec = nb, t->rec_cap = cap;
		}
	}
}

/* A JSON string (quotes, backslashes and control bytes escaped). */
static void out_str(rw_svc_trace_t *t, const char *s)
{
	out(t, "\"");
	for (; *s; s++) {
		unsigned char ch = (unsigned char)*s;
		if (ch == '"' || ch == '\\')
			out(t, "\\%c", ch);
		else if (ch < 0x20)
			out(t, "\\u%04x", ch);
		else
			out(t, "%c", ch);
	}
	out(t, "\"");
}

/* Microseconds from the kind's start as JSON (negative: before it, e.g. data that came before
 * this node's ranks submitted; null: never happened). The text lives until 8 more calls. */
static const char *us(const exec_trace_kind_t *k, uint64_t ns)
{
	static char ring[8][32];
	static unsigned next;
	char *b = ring[next++ % 8];
	if (!ns)
		return "null";
	snprintf(b, sizeof(ring[0]), "%.1f", ((double)ns - (double)k->t0_ns) / 1e3);
	return b;
}

static void out_counts(rw_svc_trace_t *t, const exec_pair_t *p)
{
	const exec_t *x = p->x;
	const uint32_t N = x->nodes, R = x->rails;
	const uint32_t *c = p->xchg.counts;
	if (!c || p->xchg.n_rows < N) {
		out(t, ",\"counts\":null");
		return;
	}
	if ((uint64_t)N * N * R <= EXEC_TRACE_FULL_COUNTS) {
		out(t, ",\"counts\":[");
		for (size_t i = 0; i < (size_t)N * N * R; i++)
			out(t, "%s%u", i ? "," : "", c[i]);
		out(t, "]");
		return;
	}
	/* Large: node-pair totals, source-rail and destination-rail (native) sums. */
	out(t, ",\"counts\":null,\"counts_nn\":[");
	for (uint32_t s = 0; s < N; s++)
		for (uint32_t d = 0; d < N; d++) {
			uint64_t sum = 0;
			for (uint32_t r = 0; r < R; r++)
				sum += c[((size_t)s * N + d) * R + r];
			out(t, "%s%llu", s || d ? "," : "", (unsigned long long)sum);
		}
	for (int dst = 0; dst < 2; dst++) {
		out(t, "],\"counts_%s_rail\":[", dst ? "dst" : "src");
		for (uint32_t n = 0; n < N; n++)
			for (uint32_t r = 0; r < R; r++) {
				uint64_t sum = 0;
				for (uint32_t o = 0; o < N; o++)
					if (o != n)
						sum += c[(dst ? (size_t)o * N + n : (size_t)n * N + o) * R + r];
				out(t, "%s%llu", n || r ? "," : "", (unsigned long long)sum);
			}
	}
	out(t, "]");
}

void exec_trace_end_(exec_pair_t *p, rw_svc_phase_kind_t kind, rw_status_t st)
{
	exec_t *x = p->x;
	rw_svc_trace_t *t = x->trace;
	exec_trace_pair_t *tr = p->tr;
	exec_trace_kind_t *k = tk(p, kind);
	const rw_svc_config_t *cfg = &x->svc->cfg;
	const uint64_t began = k->end_ns = rw_now_ns();
	t->c.ended++;
	if (!k->t0_ns)
		k->t0_ns = k->end_ns;
	t->rec_len = 0;
	t->rec_bad = 0;
	out(t, "{\"v\":1,\"node\":%u,\"name\":", x->me);
	out_str(t, cfg->nodes[x->me].name);
	out(t, ",\"group\":");
	out_str(t, tr->group);
	out(t, ",\"layer\":%u,\"step\":%llu,\"kind\":\"%s\",\"N\":%u,\"R\":%u,\"G\":%u,\"epoch\":%u",
	    p->key.layer, (unsigned long long)p->key.step, rw_svc_kind_name(kind), x->nodes, x->rails,
	    x->gpus, p->xchg.params.epoch);
	out(t, ",\"gbps\":[");
	for (uint32_t r = 0; r < x->rails; r++)
		out(t, "%s%.6g", r ? "," : "", cfg->nodes[x->me].rails[r].rate_gbps);
	out(t, "]");
	out(t, ",\"status\":\"%s\"", st == RW_OK ? "ok" : rw_svc_err_name(st));
	if (st != RW_OK) {
		out(t, ",\"error\":");
		out_str(t, p->err.msg);
	}
	out(t, ",\"t0_ns\":%llu,\"us\":%s", (unsigned long long)(tr->wall0_ns + (k->t0_ns - tr->mono0_ns)),
	    us(k, k->end_ns));
	out(t, ",\"last_rank\":%u,\"last_submit_us\":%s,\"ready_us\":%s,\"run_us\":%s",
	    x->me * x->gpus + k->last_local, us(k, k->last_submit_ns), us(k, k->ready_ns),
	    us(k, k->run_ns));
	out(t, ",\"missing\":[");
	for (uint32_t g = 0, n = 0; g < x->gpus; g++)
		if (!(k->submitted >> g & 1))
			out(t, "%s%u", n++ ? "," : "", x->me * x->gpus + g);
	out(t, "]");
	if (k->last_peer >= 0)
		out(t, ",\"last_peer\":%d,\"last_peer_us\":%s", k->last_peer, us(k, k->last_peer_ns));
	else
		out(t, ",\"last_peer\":null");
	if (p->plan.have_layout)
		out(t, ",\"path\":\"%s\"", rw_sched_path_name(p->plan.path));
	else
		out(t, ",\"path\":null");
	if (tr->have_sel) {
		const rw_features_t *f = &tr->feat;
		out(t, ",\"reason\":\"%s\",\"case\":%lld,\"dist2\":%.6g,\"decided_us\":%s",
		    rw_sched_reason_name(tr->sel.reason), (long long)tr->sel.case_id, tr->sel.distance2,
		    us(&tr->k[RW_SVC_DISPATCH], tr->decided_ns));
		out(t, ",\"features\":{\"remote_bytes\":%llu,\"B\":%.6g,\"rho_g\":%.6g,\"kappa\":%.6g,"
		    "\"f\":[%.6g,%.6g,%.6g],\"max_fan_in\":%u,\"busiest_dst_rail_share\":%.6g}",
		    (unsigned long long)f->remote_bytes, f->B, f->rho_g, f->kappa, f->f[0], f->f[1],
		    f->f[2], f->max_fan_in, f->busiest_dst_rail_share);
	}
	out(t, ",\"rec_size\":%llu,\"experts\":%u,\"topk\":%u",
	    (unsigned long long)(kind == RW_SVC_COMBINE ? p->ph.crec_size : p->ph.rec_size),
	    p->ph.n_experts, p->ph.topk);
	out_counts(t, p);
	/* A completed dispatch: the load of every expert this node hosts (token copies it got,
	 * local ones included) and the rows each local rank received. */
	uint32_t world = x->nodes * x->gpus;
	if (kind == RW_SVC_DISPATCH && st == RW_OK && p->mv_state && p->ph.n_experts % world == 0) {
		uint32_t per = p->ph.n_experts / world;
		out(t, ",\"expert_first\":%u,\"expert_load\":[", x->me * x->gpus * per);
		for (uint32_t g = 0; g < x->gpus; g++) {
			uint32_t rows = 0;
			const uint32_t *ec = NULL;
			p->mv->result(p->mv_state, g, &rows, &ec);
			for (uint32_t e = 0; e < per; e++)
				out(t, "%s%u", g || e ? "," : "", ec ? ec[(x->me * x->gpus + g) * per + e] : 0);
		}
		out(t, "],\"recv_rows\":[");
		for (uint32_t g = 0; g < x->gpus; g++) {
			uint32_t rows = 0;
			const uint32_t *ec = NULL;
			p->mv->result(p->mv_state, g, &rows, &ec);
			out(t, "%s%u", g ? "," : "", rows);
		}
		out(t, "]");
	}
	/* tx: [rail, bytes, writes, first post us, last post us, done us (its last wave's)] */
	out(t, ",\"tx\":[");
	int first = 1;
	for (uint32_t r = 0; r < x->rails; r++) {
		const exec_trace_rail_t *rl = &k->tx[r];
		if (!rl->writes)
			continue;
		uint64_t done = rl->last_wave < x->nodes ? k->wave[rl->last_wave].done_ns : 0;
		out(t, "%s[%u,%llu,%u,%s,%s,%s]", first ? "" : ",", r,
		    (unsigned long long)rl->bytes, rl->writes, us(k, rl->first_ns), us(k, rl->last_ns),
		    us(k, done));
		first = 0;
	}
	/* waves: [wave, destination (-1: all), bytes, writes, post us, done us, grant wait us] */
	out(t, "],\"waves\":[");
	first = 1;
	const int waved = p->plan.have_layout && rw_path_waved(p->plan.path);
	for (uint32_t w = 1; w < x->nodes; w++) {
		const exec_trace_wave_t *wv = &k->wave[w];
		if (!wv->post_ns && !wv->wait_ns)
			continue;
		double wait = wv->wait_ns ? ((double)(wv->grant_ns ? wv->grant_ns : k->end_ns) -
					     (double)wv->wait_ns) / 1e3 : 0.0;
		out(t, "%s[%u,%d,%llu,%u,%s,%s,%.1f]", first ? "" : ",", w,
		    waved ? (int)rw_sched_wave_dst(x->nodes, x->me, w) : -1,
		    (unsigned long long)wv->bytes, wv->writes, us(k, wv->post_ns),
		    us(k, wv->done_ns ? wv->done_ns : wv->post_ns), wait);
		first = 0;
	}
	/* rx: [source, rail, bytes, first arrival us, range complete us] */
	out(t, "],\"rx\":[");
	first = 1;
	for (uint32_t s = 0; s < x->nodes; s++)
		for (uint32_t r = 0; r < x->rails; r++) {
			const exec_trace_range_t *rg = &k->rx[(size_t)s * x->rails + r];
			if (!rg->bytes && !rg->done_ns)
				continue;
			out(t, "%s[%u,%u,%llu,%s,%s]", first ? "" : ",", s, r,
			    (unsigned long long)rg->bytes, us(k, rg->first_ns), us(k, rg->done_ns));
			first = 0;
		}
	/* grants this node sent: [wave, source, us] */
	out(t, "],\"grants\":[");
	first = 1;
	for (uint32_t w = 2; w < x->nodes; w++)
		if (k->granted_ns[w]) {
			out(t, "%s[%u,%u,%s]", first ? "" : ",", w, (x->me + x->nodes - w) % x->nodes,
			    us(k, k->granted_ns[w]));
			first = 0;
		}
	out(t, "]}\n");

	if (t->rec_bad || t->len + t->rec_len > TRACE_BUF_MAX) {
		t->c.dropped++;
	} else {
		if (t->file_bytes + t->len + t->rec_len > t->seg_bytes && t->file_bytes + t->len > 0)
			trace_rotate(t);
		memcpy(t->buf + t->len, t->rec, t->rec_len);
		t->len += t->rec_len;
		t->pending++;
		if (t->len >= TRACE_FLUSH_AT)
			trace_flush(t);
	}
	t->c.end_ns += rw_now_ns() - began;
}
