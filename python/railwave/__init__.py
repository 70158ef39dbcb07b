"""railwave: PyTorch face of RailWave (docs/python.md). A trainer rank joins its expert-parallel
group through its node's railwaved and moves a MoE layer's tokens with dispatch() and combine():

    import railwave
    with railwave.Group("moe") as g:            # RANK, WORLD_SIZE, RAILWAVE_SOCKET from the env
        recv_x, recv_idx, recv_w, counts, h = g.dispatch(x, topk_idx, topk_weights, num_experts)
        out = g.combine(expert_out, h)          # both differentiable
"""
from . import _lib
from .errors import (ConnectError, DaemonLost, PhaseError, RailWaveError, Timeout)
from .group import Group, Handle, Work
from .moe import MoE

__version__ = "1.0.0"
__all__ = ["Group", "Handle", "Work", "MoE", "RailWaveError", "ConnectError", "PhaseError",
           "DaemonLost", "Timeout", "library_path"]


def library_path():
    """The librailwave.so file in use (loads it if needed)."""
    _lib.load()
    return _lib.path
