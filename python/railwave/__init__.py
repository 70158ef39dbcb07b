"""railwave: PyTorch face of RailWave (docs/python.md). A trainer rank joins its expert-parallel
group through its node's railwaved and moves a MoE layer's tokens with dispatch() and combine():

    import railwave
    with railwave.Group.from_env("moe") as g:   # RANK, WORLD_SIZE, RAILWAVE_SOCKET, ... (torchrun)
        recv_x, recv_idx, recv_w, counts, h = g.dispatch(x, topk_idx, topk_weights, num_experts)
        out = g.combine(expert_out, h)          # both differentiable

Every error it raises is a railwave.RailWaveError (railwave.errors: one class per meaning)."""
from . import _lib
from .errors import (BackwardMismatch, BadArgument, BadArgumentType, ConnectError, CudaError,
                     DaemonLost, GroupClosed, GroupKeyMismatch, LibraryNotFound, PeerFailed,
                     PhaseError, PhaseInFlight, RailWaveError, RankTaken, ReceiveRoomExceeded,
                     Timeout, WorldMismatch)
from ._core import Handle, Work
from .group import Group
from .moe import MoE

__version__ = "0.1.0"  # = the repository's VERSION (tests/deploy/test_install.sh checks)
__all__ = ["Group", "Handle", "Work", "MoE", "library_path",
           "RailWaveError", "ConnectError", "WorldMismatch", "RankTaken", "GroupKeyMismatch",
           "PhaseError", "PeerFailed", "ReceiveRoomExceeded", "DaemonLost", "Timeout",
           "GroupClosed", "PhaseInFlight", "BackwardMismatch", "CudaError", "LibraryNotFound",
           "BadArgument", "BadArgumentType"]


def library_path() -> str:
    """The librailwave.so file in use (loads it if needed)."""
    _lib.load()
    return _lib.path
