/* Status strings for rw_status_t. */
#include "common/common.h"

const char *rw_status_str(rw_status_t st)
{
	switch (st) {
	case RW_OK: return "ok";
	case RW_ERR_INVAL: return "invalid argument";
	case RW_ERR_NOMEM: return "out of memory";
	case RW_ERR_UNSUPPORTED: return "not supported";
	case RW_ERR_AGAIN: return "resource busy, try again";
	case RW_ERR_RANGE: return "outside registered region";
	case RW_ERR_NOTFOUND: return "not found";
	case RW_ERR_EXISTS: return "already exists";
	case RW_ERR_STATE: return "invalid state";
	case RW_ERR_TIMEOUT: return "timed out";
	case RW_ERR_PARSE: return "malformed input";
	case RW_ERR_PEER: return "peer failure";
	case RW_ERR_PROTO: return "protocol violation";
	case RW_ERR_LINK: return "link failure";
	case RW_ERR_CLIENT: return "client failure";
	case RW_ERR_SUB_KIND: return "unknown submission kind";
	case RW_ERR_SUB_DTYPE: return "unsupported dtype";
	case RW_ERR_SUB_TOKENS: return "token count, top-k, hidden or expert id out of range";
	case RW_ERR_SUB_EXPERTS: return "n_experts does not fit the group or the phase";
	case RW_ERR_SUB_FIELD: return "local ranks disagree on top-k, hidden or dtype";
	case RW_ERR_SUB_BUFFER: return "unknown or missing buffer";
	case RW_ERR_SUB_HANDLE: return "unknown combine handle";
	case RW_ERR_SUB_STATE: return "submission not valid in this state";
	case RW_ERR_SUB_SPACE: return "output too small";
	case RW_ERR_DEVICE: return "GPU copy failed";
	case RW_ERR_SYS: return "system error";
	case RW_ERR_FATAL: return "fatal error";
	}
	return "unknown status";
}
