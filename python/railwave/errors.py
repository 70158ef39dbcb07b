"""Exceptions of the railwave package (docs/python.md "Errors"). Every error the package raises
is a RailWaveError; its subclasses say what happened, so a caller catches by meaning:

    RailWaveError                    code (RW_E_* value or None), name ("RW_E_PHASE"), op, detail
    ├── ConnectError                 joining the group failed (no daemon, refused)
    │   ├── WorldMismatch            RW_E_WORLD_MISMATCH, RW_E_NODE_MISMATCH
    │   ├── RankTaken                RW_E_RANK_DUP
    │   └── GroupKeyMismatch         RW_E_GROUP_KEY
    ├── PhaseError                   a dispatch or combine completed with an error
    │   ├── PeerFailed               RW_E_PHASE: failed for the whole group by another rank or node
    │   └── ReceiveRoomExceeded      RW_E_RANGE: more rows arrived than the receive room holds
    ├── DaemonLost                   RW_E_CLOSED: railwaved is gone or dropped this rank
    ├── Timeout (TimeoutError)       no completion within the Group's timeout
    ├── GroupClosed                  the Group was closed by its owner
    ├── PhaseInFlight                RW_E_STATE: one operation per Group at a time
    ├── BackwardMismatch             autograd's backward pair received other rows than the forward
    ├── CudaError                    a CUDA driver call of the package failed
    ├── LibraryNotFound (OSError)    librailwave.so.1 could not be loaded
    └── BadArgument (ValueError)     an argument refused before anything was sent
        └── BadArgumentType (TypeError)

A code from librailwave or the daemon picks its class with class_for() (railwave._lib.error
builds the exception with the library's text); the errors the package decides itself carry
code None. This module imports nothing of the package: every other module may raise from it."""

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
    CODES["RW_E_WORLD_MISMATCH"]: "world_size must be the cluster file's nodes x GPUs per node, "
                                  "the same on every rank (railwaved's log says which)",
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


class RailWaveError(Exception):
    """An error of the railwave package. Attributes: op (what was being done, e.g. "dispatch
    layer 3 step 7"), detail, code (the RW_E_* value from librailwave or the daemon, None when
    the package decided), name ("RW_E_PHASE" or None). text is the library's one-line text for
    code (railwave._lib.error passes it)."""

    def __init__(self, op: str, detail: str = "", code: "int | None" = None,
                 text: "str | None" = None):
        self.op, self.detail, self.code = op, detail, code
        self.name = None if code is None else NAMES.get(code, "RW_E_%d" % code)
        msg = "railwave: %s" % op
        if code is not None:
            msg += ": %s(%s)" % (text + " " if text else "", self.name)
        if detail:
            msg += ": " + detail
        hint = _HINTS.get(code)
        if hint:
            msg += " — " + hint
        super().__init__(msg)


class ConnectError(RailWaveError):
    """Joining the group failed: no daemon at the socket, or the daemon refused the join."""


class WorldMismatch(ConnectError):
    """The group's earlier members (or this daemon) have another world size or node."""


class RankTaken(ConnectError):
    """Another process already joined the group with this rank."""


class GroupKeyMismatch(ConnectError):
    """RAILWAVE_GROUP_KEY missing or different from the group's first rank's."""


class PhaseError(RailWaveError):
    """A dispatch or combine completed with an error (the Group stays usable: the next step
    opens a fresh pair)."""


class PeerFailed(PhaseError):
    """RW_E_PHASE: the daemon failed the phase for the whole group — a peer node was lost, another
    rank's input was refused, a rank left, or the phase timed out."""


class ReceiveRoomExceeded(PhaseError):
    """RW_E_RANGE: more rows arrived than this rank's receive room holds (docs/python.md
    "Receive room")."""


class DaemonLost(RailWaveError):
    """railwaved is gone or dropped this rank; the Group is unusable (close it)."""


class Timeout(RailWaveError, TimeoutError):
    """No completion within the Group's timeout (the operation is still in flight)."""


class GroupClosed(RailWaveError):
    """An operation on a Group after close()."""


class PhaseInFlight(RailWaveError):
    """An operation while another of the same Group is still in flight (wait() for it first);
    the daemon's RW_E_STATE means the same."""


class BackwardMismatch(RailWaveError):
    """The pair autograd opened for a layer's backward received other rows than the forward:
    the routing changed between forward and backward, or the ranks ran different backwards."""


class CudaError(RailWaveError):
    """A CUDA driver call of the package failed (detail names the call and the CUresult)."""


class LibraryNotFound(RailWaveError, OSError):
    """librailwave.so.1 could not be loaded (detail lists every place tried)."""


class BadArgument(RailWaveError, ValueError):
    """An argument (or a launcher variable) refused before anything was sent."""


class BadArgumentType(BadArgument, TypeError):
    """An argument of the wrong type or dtype."""


# The class of an error code when the call that returned it allows it (class_for).
_CLASS_OF = {
    CODES["RW_E_WORLD_MISMATCH"]: WorldMismatch, CODES["RW_E_NODE_MISMATCH"]: WorldMismatch,
    CODES["RW_E_RANK_DUP"]: RankTaken, CODES["RW_E_GROUP_KEY"]: GroupKeyMismatch,
    CODES["RW_E_PHASE"]: PeerFailed, CODES["RW_E_RANGE"]: ReceiveRoomExceeded,
    CODES["RW_E_CLOSED"]: DaemonLost, CODES["RW_E_TIMEOUT"]: Timeout,
    CODES["RW_E_STATE"]: PhaseInFlight,
}


def class_for(code: int, default: type = RailWaveError) -> type:
    """The exception class of RW_E_* code returned by a call whose errors are `default`s
    (ConnectError for a join, PhaseError for a completion, RailWaveError for the rest): the
    code's own class when it is one of them (a join's RW_E_RANK_DUP is a RankTaken, a
    completion's RW_E_PHASE a PeerFailed), else default (a join's RW_E_TIMEOUT stays a
    ConnectError, so that catching ConnectError around a join catches every refusal)."""
    cls = _CLASS_OF.get(code)
    return cls if cls is not None and issubclass(cls, default) else default
