/* railwaved's text helpers (svc_metrics.h): the growable buffer every text reply is built in,
 * and the names of peer states, phase kinds and error statuses that logs, the stats socket and
 * the metrics share. A leaf: it calls nothing else in service/. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/railwave.h"
#include "service/core/svc.h"

const char *rw_svc_peer_state_name(rw_svc_peer_state_t s)
{
	static const char *const names[] = {"down", "connecting", "up", "failed", "self"};
	return (unsigned)s < RW_ARRAY_SIZE(names) ? names[s] : "?";
}

const char *rw_svc_kind_name(rw_svc_phase_kind_t k)
{
	return k == RW_SVC_DISPATCH ? "dispatch" : k == RW_SVC_COMBINE ? "combine" : "?";
}

const char *rw_svc_err_name(rw_status_t st)
{
	switch (st) {
	case RW_OK: return "ok";
	case RW_ERR_INVAL: return "inval";
	case RW_ERR_NOMEM: return "nomem";
	case RW_ERR_UNSUPPORTED: return "unsupported";
	case RW_ERR_AGAIN: return "again";
	case RW_ERR_RANGE: return "range";
	case RW_ERR_NOTFOUND: return "notfound";
	case RW_ERR_EXISTS: return "exists";
	case RW_ERR_STATE: return "state";
	case RW_ERR_TIMEOUT: return "timeout";
	case RW_ERR_PARSE: return "parse";
	case RW_ERR_PEER: return "peer";
	case RW_ERR_PROTO: return "proto";
	case RW_ERR_LINK: return "link";
	case RW_ERR_CLIENT: return "client";
	case RW_ERR_SUB_KIND: return "sub_kind";
	case RW_ERR_SUB_DTYPE: return "sub_dtype";
	case RW_ERR_SUB_TOKENS: return "sub_tokens";
	case RW_ERR_SUB_EXPERTS: return "sub_experts";
	case RW_ERR_SUB_FIELD: return "sub_field";
	case RW_ERR_SUB_BUFFER: return "sub_buffer";
	case RW_ERR_SUB_HANDLE: return "sub_handle";
	case RW_ERR_SUB_STATE: return "sub_state";
	case RW_ERR_SUB_SPACE: return "sub_space";
	case RW_ERR_DEVICE: return "device";
	case RW_ERR_SYS: return "sys";
	case RW_ERR_FATAL: return "fatal";
	}
	return "other";
}

const char *rw_svc_slab_why_name(rw_svc_slab_why_t w)
{
	return w == RW_SVC_SLAB_OFF ? "off" : w == RW_SVC_SLAB_FAILED ? "failed" :
	       w == RW_SVC_SLAB_POOL ? "pool" : "?";
}

const char *rw_svc_client_code_name(int code)
{
	switch (code) {
	case RW_E_TOKENS: return "tokens";
	case RW_E_STATE: return "state";
	case RW_E_PHASE: return "phase";
	case RW_E_DTYPE: return "dtype";
	case RW_E_INTERNAL: return "internal";
	case RW_E_CLOSED: return "closed";
	}
	return "other";
}

void rw_svc_buf_printf(rw_svc_buf_t *b, const char *fmt, ...)
{
	if (b->oom)
		return;
	for (int attempt = 0; attempt < 2; attempt++) {
		size_t room = b->cap - b->len;
		va_list ap;
		va_start(ap, fmt);
		int n = vsnprintf(b->data ? b->data + b->len : NULL, room, fmt, ap);
		va_end(ap);
		if (n < 0) {
			b->oom = 1;
			return;
		}
		if ((size_t)n < room) {
			b->len += (size_t)n;
			return;
		}
		size_t cap = b->cap ? b->cap : 4096;
		while (cap < b->len + (size_t)n + 1)
			cap *= 2;
		char *d = realloc(b->data, cap);
		if (!d) {
			b->oom = 1;
			if (b->data && b->cap)
				b->data[b->len] = '\0';
			return;
		}
		b->data = d;
		b->cap = cap;
	}
}

void rw_svc_buf_free(rw_svc_buf_t *b)
{
	free(b->data);
	memset(b, 0, sizeof(*b));
}
