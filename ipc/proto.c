/* Daemon-side parsing and validation of everything a client sends: control datagrams and ring
 * submissions. Pure functions (no I/O, no state), so the fuzzer (tests/ipc/fuzz_ipc.c) and the
 * server share them. Inputs are hostile: every length, index and product is checked before use. */
#include "ipc/proto.h"

#include <string.h>
#include <sys/socket.h>

static int fail(const char **why_p, const char *why, int code)
{
	*why_p = why;
	return code;
}

static int all_zero(const void *p, size_t n)
{
	const uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		if (b[i])
			return 0;
	return 1;
}

int rw_ipc_parse_request(const void *buf, size_t len, int msg_flags, unsigned nfds,
			 rw_ipc_msg_t *msg_p, const char **why_p)
{
	if (msg_flags & MSG_TRUNC)
		return fail(why_p, "message longer than any request (MSG_TRUNC)", RW_E_TRUNC);
	if (msg_flags & MSG_CTRUNC)
		return fail(why_p, "more file descriptors than any request carries (MSG_CTRUNC)",
			    RW_E_FDS);
	if (len < sizeof(rw_ipc_hdr_t))
		return fail(why_p, "message shorter than the header", RW_E_MSG_SIZE);
	rw_ipc_hdr_t hdr;
	memcpy(&hdr, buf, sizeof(hdr));
	if (hdr.magic != RW_IPC_MAGIC)
		return fail(why_p, "bad magic in message header", RW_E_MAGIC);
	if (hdr.version != RW_IPC_VERSION)
		return fail(why_p, "protocol version mismatch (daemon speaks version 2)",
			    RW_E_VERSION);
	if (hdr.reserved != 0)
		return fail(why_p, "header reserved field not zero", RW_E_FIELD);

	size_t want;
	unsigned want_fds = 0;
	switch (hdr.type) {
	case RW_IPC_HELLO: want = sizeof(rw_ipc_hello_t); break;
	case RW_IPC_REG_HOST: want = sizeof(rw_ipc_reg_host_t); want_fds = 1; break;
	case RW_IPC_REG_CUDA: want = sizeof(rw_ipc_reg_cuda_t); break;
	case RW_IPC_DEREG: want = sizeof(rw_ipc_dereg_t); break;
	case RW_IPC_REG_EVENT: want = sizeof(rw_ipc_reg_event_t); break;
	case RW_IPC_DEREG_EVENT: want = sizeof(rw_ipc_dereg_t); break;
	case RW_IPC_RING_SETUP: want = sizeof(rw_ipc_ring_setup_t); break;
	case RW_IPC_PAGE_SETUP: want = sizeof(rw_ipc_page_setup_t); break;
	case RW_IPC_SLAB_SETUP: want = sizeof(rw_ipc_slab_setup_t); break;
	case RW_IPC_GOODBYE: want = sizeof(rw_ipc_hdr_t); break;
	default: return fail(why_p, "unknown or daemon-to-client message type", RW_E_MSG_TYPE);
	}
	if (len != want && !(hdr.type == RW_IPC_HELLO && len == RW_IPC_HELLO_BASE_BYTES))
		return fail(why_p, "message length does not match its type", RW_E_MSG_SIZE);
	if (nfds != want_fds)
		return fail(why_p, want_fds ? "register host buffer needs exactly one fd"
					    : "this message type carries no fds",
			    RW_E_FDS);

	rw_ipc_msg_t msg;
	memset(&msg, 0, sizeof(msg));
	memcpy(&msg, buf, len);
	switch (hdr.type) {
	case RW_IPC_REG_HOST:
		if (msg.reg_host.flags != 0 || msg.reg_host.reserved != 0)
			return fail(why_p, "register host: flags/reserved not zero", RW_E_FIELD);
		break;
	case RW_IPC_REG_CUDA:
		if (msg.reg_cuda.reserved != 0)
			return fail(why_p, "register cuda: reserved not zero", RW_E_FIELD);
		break;
	case RW_IPC_REG_EVENT:
		if (msg.reg_event.reserved != 0)
			return fail(why_p, "register event: reserved not zero", RW_E_FIELD);
		break;
	case RW_IPC_PAGE_SETUP:
		if (msg.page_setup.reserved != 0)
			return fail(why_p, "page setup: reserved not zero", RW_E_FIELD);
		break;
	case RW_IPC_SLAB_SETUP:
		if (msg.slab_setup.form != 0 && msg.slab_setup.form != RW_IPC_SLAB_FORM_KINDS)
			return fail(why_p, "slab setup: unknown form (0 or 1)", RW_E_FIELD);
		break;
	case RW_IPC_DEREG:
	case RW_IPC_DEREG_EVENT:
		if (msg.dereg.reserved != 0)
			return fail(why_p, "deregister: reserved not zero", RW_E_FIELD);
		break;
	default: break;
	}
	*msg_p = msg;
	return 0;
}

int rw_ipc_check_hello(const rw_ipc_hello_t *hello, const rw_ipc_limits_t *lim,
		       const char **why_p)
{
	const char *g = hello->group;
	size_t n = strnlen(g, sizeof(hello->group));
	if (n == 0)
		return fail(why_p, "group name empty", RW_E_GROUP_NAME);
	if (n == sizeof(hello->group))
		return fail(why_p, "group name not NUL-terminated within 64 bytes", RW_E_GROUP_NAME);
	if (!all_zero(g + n, sizeof(hello->group) - n))
		return fail(why_p, "bytes after the group name's NUL not zero", RW_E_GROUP_NAME);
	for (size_t i = 0; i < n; i++) {
		char c = g[i];
		int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
			 c == '.' || c == '_' || c == ':' || c == '-';
		if (!ok)
			return fail(why_p, "group name has a character outside [A-Za-z0-9._:-]",
				    RW_E_GROUP_NAME);
	}
	if (hello->world_size == 0 || hello->world_size > lim->max_world)
		return fail(why_p, "world size zero or above the daemon's limit", RW_E_RANK_RANGE);
	if (hello->rank >= hello->world_size)
		return fail(why_p, "rank not below world size", RW_E_RANK_RANGE);
	if (hello->local_gpu < -1 || hello->local_gpu >= lim->max_local_gpu)
		return fail(why_p, "local GPU index out of range", RW_E_GPU);
	if (hello->key_reserved != 0 || hello->key_len > RW_IPC_GROUP_KEY_MAX ||
	    !all_zero(hello->key + hello->key_len, RW_IPC_GROUP_KEY_MAX - hello->key_len))
		return fail(why_p, "hello: key length above 64, or key padding/reserved not zero",
			    RW_E_FIELD);
	if (hello->key_len && hello->key_len < RW_IPC_GROUP_KEY_MIN)
		return fail(why_p, "group key shorter than 16 bytes (RAILWAVE_GROUP_KEY: use 32 "
			    "random bytes in hex)", RW_E_GROUP_KEY);
	return 0;
}

int rw_ipc_check_ring_setup(const rw_ipc_ring_setup_t *setup, const rw_ipc_limits_t *lim,
			    const char **why_p)
{
	uint32_t s = setup->sq_entries, c = setup->cq_entries;
	if (s < 2 || c < 2 || s > lim->max_ring_entries || c > lim->max_ring_entries)
		return fail(why_p, "ring entries outside [2, max_ring_entries]", RW_E_RING_SIZE);
	if ((s & (s - 1)) || (c & (c - 1)))
		return fail(why_p, "ring entries not a power of two", RW_E_RING_SIZE);
	return 0;
}

unsigned rw_ipc_dtype_size(unsigned dtype)
{
	switch (dtype) {
	case RW_DTYPE_BF16: return 2;
	case RW_DTYPE_FP16: return 2;
	case RW_DTYPE_FP8: return 1;
	case RW_DTYPE_FP32: return 4;
	}
	return 0;
}

/* One span: buffer known, reserved zero, [offset, offset + len) inside it without overflow.
 * A span of length 0 may name no buffer (RW_BUF_NONE, offset 0). */
static int check_span(const rw_span_t *span, uint64_t len, rw_ipc_buf_size_fn size_of, void *ctx,
		      const char *name_unknown, const char *name_range, const char **why_p)
{
	if (span->reserved != 0)
		return fail(why_p, "span reserved field not zero", RW_E_FIELD);
	if (len == 0 && span->buf_id == RW_BUF_NONE) {
		if (span->offset != 0)
			return fail(why_p, "span offset without a buffer", RW_E_FIELD);
		return 0;
	}
	uint64_t size = span->buf_id == RW_BUF_NONE ? 0 : size_of(ctx, span->buf_id);
	if (size == 0)
		return fail(why_p, name_unknown, RW_E_BUF_ID);
	uint64_t end;
	if (__builtin_add_overflow(span->offset, len, &end))
		return fail(why_p, "span offset + length overflows", RW_E_OVERFLOW);
	if (end > size)
		return fail(why_p, name_range, RW_E_RANGE);
	return 0;
}

int rw_ipc_check_sqe(const rw_sqe_t *sqe, const rw_ipc_limits_t *lim, rw_ipc_buf_size_fn size_of,
		     void *ctx, const char **why_p)
{
	if (sqe->kind != RW_KIND_DISPATCH && sqe->kind != RW_KIND_COMBINE)
		return fail(why_p, "unknown submission kind", RW_E_KIND);
	unsigned esize = rw_ipc_dtype_size(sqe->dtype);
	if (esize == 0)
		return fail(why_p, "unknown dtype", RW_E_DTYPE);
	if (!(lim->dtypes & (1u << sqe->dtype)))
		return fail(why_p, "dtype not carried by this daemon", RW_E_DTYPE);
	const uint32_t stream = sqe->flags & (RW_SQE_WAIT_EVENT | RW_SQE_SIGNAL);
	if (sqe->flags & ~(RW_SQE_WAIT_EVENT | RW_SQE_SIGNAL | RW_SQE_ABORT))
		return fail(why_p, "submission flags: unknown bit (RW_SQE_WAIT_EVENT, RW_SQE_SIGNAL and "
			    "RW_SQE_ABORT are the only ones)", RW_E_FIELD);
	if ((sqe->flags & RW_SQE_ABORT) && (stream || sqe->kind != RW_KIND_COMBINE))
		return fail(why_p, "RW_SQE_ABORT is a combine's flag, and comes alone", RW_E_FIELD);
	if ((stream != 0) != (sqe->event_id != 0))
		return fail(why_p, stream ? "stream-ordered submission without an event id"
					  : "event id without RW_SQE_WAIT_EVENT or RW_SQE_SIGNAL",
			    RW_E_FIELD);
	if (sqe->path > RW_PATH_REQ_JOINT)
		return fail(why_p, "submission path unknown (0 = the daemon's choice, 1 native, "
			    "2 rail-only, 3 perm-only, 4 joint)", RW_E_FIELD);
	if (sqe->token_count > lim->max_tokens)
		return fail(why_p, "token count above the daemon's limit", RW_E_TOKENS);
	if (sqe->hidden == 0 || sqe->hidden > lim->max_hidden)
		return fail(why_p, "hidden zero or above the daemon's limit", RW_E_TOKENS);
	if (sqe->topk == 0 || sqe->topk > lim->max_topk)
		return fail(why_p, "topk zero or above the daemon's limit", RW_E_TOKENS);
	if (sqe->kind == RW_KIND_DISPATCH && sqe->n_experts == 0)
		return fail(why_p, "dispatch without n_experts (the group's number of experts)",
			    RW_E_EXPERTS);
	if (sqe->n_experts > lim->max_experts)
		return fail(why_p, "n_experts above the daemon's limit", RW_E_EXPERTS);
	if (sqe->kind == RW_KIND_DISPATCH && sqe->handle_id != 0)
		return fail(why_p, "dispatch with a handle id", RW_E_FIELD);
	if (sqe->kind == RW_KIND_COMBINE && sqe->handle_id == 0)
		return fail(why_p, "combine without the dispatch's handle id", RW_E_HANDLE);
	if (sqe->flags & RW_SQE_ABORT) { /* railwave.h "Failing a pair by its key" */
		const rw_span_t none = { .buf_id = RW_BUF_NONE };
		if (sqe->token_count || sqe->output_capacity ||
		    memcmp(&sqe->tokens, &none, sizeof(none)) || memcmp(&sqe->topk_ids, &none, sizeof(none)) ||
		    memcmp(&sqe->topk_weights, &none, sizeof(none)) || memcmp(&sqe->output, &none, sizeof(none)))
			return fail(why_p, "an abort (RW_SQE_ABORT) carries no data: token_count 0, every "
				    "span RW_BUF_NONE at offset 0, output_capacity 0", RW_E_FIELD);
		return 0;
	}

	/* Lengths in 64 bits with checked multiplies: limits are configurable, so never assume
	 * the products fit. */
	uint64_t row_bytes, tokens_len, topk_len;
	if (__builtin_mul_overflow((uint64_t)sqe->hidden, (uint64_t)esize, &row_bytes) ||
	    __builtin_mul_overflow(row_bytes, (uint64_t)sqe->token_count, &tokens_len) ||
	    __builtin_mul_overflow((uint64_t)sqe->token_count, (uint64_t)sqe->topk * 4u, &topk_len))
		return fail(why_p, "data length overflows", RW_E_OVERFLOW);

	int rc = check_span(&sqe->tokens, tokens_len, size_of, ctx, "tokens: unknown buffer id",
			    "tokens: outside the registered buffer", why_p);
	if (rc)
		return rc;
	int need_topk = sqe->kind == RW_KIND_DISPATCH;
	if (need_topk || sqe->topk_ids.buf_id != RW_BUF_NONE) {
		rc = check_span(&sqe->topk_ids, topk_len, size_of, ctx, "topk ids: unknown buffer id",
				"topk ids: outside the registered buffer", why_p);
		if (rc)
			return rc;
	} else if (sqe->topk_ids.offset || sqe->topk_ids.reserved) {
		return fail(why_p, "topk ids: offset without a buffer", RW_E_FIELD);
	}
	if (need_topk || sqe->topk_weights.buf_id != RW_BUF_NONE) {
		rc = check_span(&sqe->topk_weights, topk_len, size_of, ctx,
				"topk weights: unknown buffer id",
				"topk weights: outside the registered buffer", why_p);
		if (rc)
			return rc;
	} else if (sqe->topk_weights.offset || sqe->topk_weights.reserved) {
		return fail(why_p, "topk weights: offset without a buffer", RW_E_FIELD);
	}
	/* A dispatch always has somewhere to put what it receives; a combine's output may be
	 * absent (capacity 0) when the rank sent no token: the service checks the size. */
	if (sqe->output_capacity == 0 &&
	    (sqe->kind == RW_KIND_DISPATCH || sqe->output.buf_id != RW_BUF_NONE))
		return fail(why_p, "output capacity zero", RW_E_RANGE);
	rw_span_t out = sqe->output;
	if (sqe->flags & RW_SQE_SIGNAL)
		out.reserved = 0; /* the flag value V */
	return check_span(&out, sqe->output_capacity, size_of, ctx,
			  "output: unknown buffer id", "output: outside the registered buffer",
			  why_p);
}

int rw_ipc_error_is_fatal(int code)
{
	switch (code) {
	case RW_E_VERSION:
	case RW_E_MAGIC:
	case RW_E_MSG_TYPE:
	case RW_E_MSG_SIZE:
	case RW_E_TRUNC:
	case RW_E_GROUP_NAME:
	case RW_E_RANK_RANGE:
	case RW_E_RANK_DUP:
	case RW_E_WORLD_MISMATCH:
	case RW_E_NODE_MISMATCH:
	case RW_E_GPU:
	case RW_E_RING_INDEX:
		return 1;
	}
	return 0;
}
