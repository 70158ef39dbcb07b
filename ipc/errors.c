/* Messages for librailwave's error codes (ipc/railwave.h); linked into both the client library
 * and the daemon, which logs with the same words the client sees. */
#include "ipc/railwave.h"

const char *rw_client_strerror(int err)
{
	switch ((rw_client_error_t)err) {
	case RW_E_OK: return "success";
	case RW_E_INVAL: return "invalid argument";
	case RW_E_NOMEM: return "out of memory";
	case RW_E_SYS: return "system call failed";
	case RW_E_CONNECT: return "cannot connect to railwaved";
	case RW_E_CLOSED: return "railwaved closed the connection";
	case RW_E_TIMEOUT: return "timed out";
	case RW_E_AGAIN: return "submission ring full";
	case RW_E_BADREPLY: return "malformed reply from railwaved";
	case RW_E_VERSION: return "protocol version mismatch";
	case RW_E_MAGIC: return "bad message magic";
	case RW_E_MSG_TYPE: return "unknown message type";
	case RW_E_MSG_SIZE: return "message size wrong for its type";
	case RW_E_TRUNC: return "message truncated";
	case RW_E_FDS: return "wrong number of file descriptors";
	case RW_E_STATE: return "message not valid in this state";
	case RW_E_FIELD: return "reserved field, flag or enum value invalid";
	case RW_E_GROUP_NAME: return "invalid group name";
	case RW_E_RANK_RANGE: return "rank or world size out of range";
	case RW_E_RANK_DUP: return "rank already connected in this group";
	case RW_E_WORLD_MISMATCH: return "world size differs from the cluster's or the group's";
	case RW_E_NODE_MISMATCH: return "node differs from the group's or the daemon's";
	case RW_E_GPU: return "local GPU index invalid or taken";
	case RW_E_BUF_SIZE: return "buffer size invalid or not matching";
	case RW_E_BUF_FD: return "buffer fd is not a mappable memfd";
	case RW_E_BUF_SEAL: return "buffer memfd not sealed against shrinking";
	case RW_E_BUF_ID: return "unknown buffer id";
	case RW_E_BUF_LIMIT: return "too many buffers";
	case RW_E_BUF_BUSY: return "buffer busy: submissions in flight";
	case RW_E_RING_SIZE: return "invalid ring size";
	case RW_E_RING_STATE: return "rings already set up or missing";
	case RW_E_RING_INDEX: return "shared ring indices corrupted";
	case RW_E_KIND: return "unknown submission kind";
	case RW_E_DTYPE: return "unknown dtype";
	case RW_E_TOKENS: return "token count, topk or hidden out of range";
	case RW_E_RANGE: return "data outside its registered buffer";
	case RW_E_OVERFLOW: return "overflow: a span past its buffer, or rows past the receive capacity";
	case RW_E_HANDLE: return "unknown combine handle";
	case RW_E_NO_CUDA: return "railwaved has no CUDA";
	case RW_E_CUDA: return "CUDA failed";
	case RW_E_LIMIT: return "railwaved client limit reached";
	case RW_E_INTERNAL: return "railwaved internal error";
	case RW_E_PHASE: return "phase failed";
	case RW_E_EXPERTS: return "n_experts missing, not a multiple of the world size, or not the phase's";
	case RW_E_GROUP_KEY: return "group key missing, wrong or too short (RAILWAVE_GROUP_KEY)";
	case RW_E_EVENT: return "unknown event id, or an unusable event registration";
	}
	return "unknown error";
}
