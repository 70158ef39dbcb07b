"""Exceptions of the railwave package. Every error the daemon or librailwave reports is a
RailWaveError carrying the RW_E_* code (ipc/railwave.h) and what was being done; argument mistakes
found before anything is sent are TypeError/ValueError."""
from . import _lib

# ipc/railwave.h rw_client_error_t (checked against the header by tests/python/test_package.py).
CODES = {
    "RW_E_OK": 0, "RW_E_INVAL": -1, "RW_E_NOMEM": -2, "RW_E_SYS": -3, "RW_E_CONNECT": -4,
    "RW_E_CLOSED": -5, "RW_E_TIMEOUT": -6, "RW_E_AGAIN": -7, "RW_E_BADREPLY": -8,
    "RW_E_VERSION": -20, "RW_E_MAGIC": -21, "RW_E_MSG_TYPE": -22, "RW_E_MSG_SIZE": -23,
    "RW_E_TRUNC": -24, "RW_E_FDS": -25, "RW_E_STATE": -26, "RW_E_FIELD": -27,
    "RW_E_GROUP_NAME": -28, "RW_E_RANK_RANGE": -29, "RW_E_RANK_DUP": -30,
    "RW_E_WORLD_MISMATCH": -31, "RW_E_NODE_MISMATCH": -32, "RW_E_GPU": -33, "RW_E_BUF_SIZE": -34,
    "RW_E_BUF_FD": -35, "RW_E_BUF_SEAL": -36, "RW_E_BUF_ID": -37, "RW_E_BUF_LIMIT": -38,
    "RW_E_BUF_BUSY": -39, "RW_E_RING_SIZE": -40, "RW_E_RING_STATE": -41, "RW_E_RING_INDEX": -42,
    "RW_E_KIND": -43, "RW_E_DTYPE": -44, "RW_E_TOKENS": -45, "RW_E_RANGE": -46,
    "RW_E_OVERFLOW": -47, "RW_E_HANDLE": -48, "RW_E_NO_CUDA": -49, "RW_E_CUDA": -50,
    "RW_E_LIMIT": -51, "RW_E_INTERNAL": -52, "RW_E_PHASE": -53, "RW_E_EXPERTS": -54,
    "RW_E_GROUP_KEY": -55, "RW_E_EVENT": -56,
}
NAMES = {v: k for k, v in CODES.items()}
globals().update(CODES)

# What a trainer should know beyond the library's one-line text, by code.
_HINTS = {
    CODES["RW_E_CONNECT"]: "is railwaved running on this node, and is RAILWAVE_SOCKET its "
                           "ipc_socket?",
    CODES["RW_E_CLOSED"]: "the daemon stopped or dropped this rank: close this Group (its log "
                          "says why) and join again once it is back",
    CODES["RW_E_PHASE"]: "the daemon failed the phase for the whole group: a peer node was lost, "
                         "another rank's input was refused, a rank left, or the phase timed out "
                         "(phase_timeout_ms); railwaved's log names the cause",
    CODES["RW_E_WORLD_MISMATCH"]: "every rank of a group must pass the same world_size",
    CODES["RW_E_NODE_MISMATCH"]: "node must be rank // ranks_per_node and this daemon's node",
    CODES["RW_E_RANK_DUP"]: "another process already joined the group with this rank",
    CODES["RW_E_EXPERTS"]: "num_experts must be a multiple of world_size and equal on every rank",
    CODES["RW_E_RANGE"]: "a buffer was too small for the phase: for a dispatch's receive room "
                         "see docs/python.md \"Receive room\"",
    CODES["RW_E_STATE"]: "a phase of this group is still running (dispatch/combine out of order?)",
    CODES["RW_E_HANDLE"]: "the handle is not the group's open dispatch (already combined, or a "
                          "later dispatch closed it)",
    CODES["RW_E_GROUP_KEY"]: "every rank of a job must run with the same RAILWAVE_GROUP_KEY "
                             "(its launcher's); railwaved's log says what differed",
    CODES["RW_E_NO_CUDA"]: "railwaved has no usable CUDA driver: use CPU tensors on this node",
}


class RailWaveError(RuntimeError):
    """A failure reported by railwaved or librailwave. Attributes: code (RW_E_* value), name
    ("RW_E_PHASE"), op (what was being done, e.g. "dispatch layer 3 step 7")."""

    def __init__(self, code, op, detail=""):
        self.code, self.op = code, op
        self.name = NAMES.get(code, "RW_E_%d" % code)
        text = "railwave: %s: %s (%s)" % (op, _lib.strerror(code), self.name)
        if detail:
            text += ": " + detail
        hint = _HINTS.get(code)
        if hint:
            text += " — " + hint
        super().__init__(text)


class ConnectError(RailWaveError):
    """Joining the group failed (no daemon, world/node/rank refused)."""


class PhaseError(RailWaveError):
    """A dispatch or combine completed with an error."""


class DaemonLost(RailWaveError):
    """railwaved is gone or dropped this rank; the Group is unusable (close it)."""


class Timeout(RailWaveError, TimeoutError):
    """No completion within the Group's timeout."""
