"""railwave.Group: one trainer rank's membership of an expert-parallel group, served by its
node's railwaved through librailwave (docs/python.md is the contract). This is the public face:
the arguments (explicit, or from the launcher's environment with Group.from_env), and dispatch
and combine, differentiable or not; the connection and the operations themselves are
railwave._core's, their backward railwave.autograd's."""
from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple, Union

import torch

from . import _lib, _rank, autograd, layout
from ._core import Core, Handle, Work
from .errors import BadArgument, BadArgumentType

DispatchResult = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Handle]


def _env_int(env: Mapping[str, str], names: Tuple[str, ...], what: str) -> Optional[int]:
    """The first of the variables `names` set (and not empty) in env, as an int."""
    for name in names:
        v = env.get(name)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise BadArgument("Group.from_env", "%s=%r is not an integer (%s)"
                                  % (name, v, what)) from None
    return None


def _check_int(what: str, v: object, lo: int, none_ok: bool = False) -> None:
    if v is None and none_ok:
        return
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadArgumentType("Group", "%s must be an int, got %r" % (what, v))
    if v < lo:
        raise BadArgument("Group", "%s must be at least %d, got %d" % (what, lo, v))


class Group(Core):
    """Join expert-parallel group `name` as `rank` of `world_size` ranks, on node `node` (the
    cluster file's index of this node), through this node's railwaved at `socket` (None:
    librailwave's choice, RAILWAVE_SOCKET, else /run/railwave/railwaved.sock). Group.from_env()
    takes the arguments from the variables torchrun, Slurm or deploy/slurm/railwave-run.sh set.
    local_gpu is the GPU index the daemon logs and keeps unique per group (-1: none).

    Receive room: a rank receives at most one row per token of every rank, so one dispatch
    delivers it at most world_size × (the most tokens any rank dispatches) rows.
    max_tokens_per_rank (DeepEP's num_max_dispatch_tokens_per_rank) is that most: every rank's
    receive buffer (host or CUDA) is sized for the worst case once, and a dispatch of more tokens
    is refused. Unset, the room is world_size × the most tokens this rank dispatched so far, which
    is right only when no rank dispatches more than this one. max_recv_tokens overrides the room
    (rows) for a caller who knows the routing is balanced. A rank that receives more rows than
    its room fails the phase for everyone (ReceiveRoomExceeded, naming the size needed).
    timeout (seconds) bounds every wait for the daemon; spin_us is how long a wait busy-polls
    before sleeping; stream_ordered: CUDA submissions without host synchronization
    (docs/python.md "Stream order"); static: the rank path's static mode, forward and backward
    with nothing read back, capturable in a CUDA graph (docs/python.md "Static mode": the
    outputs hold max_recv_tokens rows, or world_size × max_tokens_per_rank; check() raises
    what failed). num_sms: the SM budget of the rank path's kernels in this process (0: their
    own choice; set_num_sms changes it; docs/python.md "SMs")."""

    def __init__(self, name: str, rank: int, world_size: int, socket: Optional[str] = None, *,
                 node: int, local_gpu: int = -1, max_tokens_per_rank: Optional[int] = None,
                 max_recv_tokens: Optional[int] = None, timeout: float = 300.0,
                 spin_us: int = 50, stream_ordered: bool = False, static: bool = False,
                 num_sms: int = 0):
        self._c = None  # close() (from __del__) sees a Group that never joined
        if not isinstance(name, str) or not name:
            raise BadArgumentType("Group", "name must be a non-empty str, got %r" % (name,))
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise BadArgument("Group", "rank %d is not in [0, world_size %d)" % (rank, world_size))
        _check_int("node", node, 0)
        _check_int("local_gpu", local_gpu, -1)
        _check_int("max_tokens_per_rank", max_tokens_per_rank, 1, none_ok=True)
        _check_int("max_recv_tokens", max_recv_tokens, 1, none_ok=True)
        _check_int("spin_us", spin_us, 0)
        _check_int("num_sms", num_sms, 0)
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise BadArgument("Group", "timeout must be a positive number of seconds, got %r"
                              % (timeout,))
        if static and not (max_tokens_per_rank or max_recv_tokens):
            raise BadArgument("Group", "static=True fixes the receive room when the rank path "
                              "opens: give max_tokens_per_rank or max_recv_tokens")
        socket = socket or os.environ.get("RAILWAVE_SOCKET") or _lib.DEFAULT_SOCKET
        super().__init__(name, rank, world_size, node, socket, local_gpu, max_tokens_per_rank,
                         max_recv_tokens, timeout, spin_us, stream_ordered, static, num_sms)

    @classmethod
    def from_env(cls, name: Optional[str] = None, *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, node: Optional[int] = None,
                 socket: Optional[str] = None, local_gpu: Optional[int] = None,
                 max_tokens_per_rank: Optional[int] = None,
                 max_recv_tokens: Optional[int] = None, timeout: float = 300.0,
                 spin_us: Optional[int] = None, stream_ordered: Optional[bool] = None,
                 static: Optional[bool] = None, num_sms: Optional[int] = None,
                 environ: Optional[Mapping[str, str]] = None) -> Group:
        """Join with the arguments a launcher set in the environment (environ, default
        os.environ); an argument given here wins over its variable.
          name ← RAILWAVE_GROUP (deploy/slurm/railwave-run.sh: one name per job)
          rank ← RANK (torchrun), SLURM_PROCID;  world_size ← WORLD_SIZE, SLURM_NTASKS
          node ← RAILWAVE_NODE (the project's launcher), else rank // LOCAL_WORLD_SIZE
                 (SLURM_NTASKS_PER_NODE), else SLURM_NODEID, GROUP_RANK
          socket ← RAILWAVE_SOCKET;  local_gpu ← LOCAL_RANK, SLURM_LOCALID when torch sees
                 CUDA (or the rank path's test switch is on), else -1
          max_tokens_per_rank ← RAILWAVE_MAX_TOKENS_PER_RANK;  spin_us ← RAILWAVE_SPIN_US
                 (default 50);  stream_ordered ← RAILWAVE_STREAM_ORDERED (1: on)
          static ← RAILWAVE_STATIC (1: the rank path's static mode);  num_sms ←
                 RAILWAVE_NUM_SMS (the rank kernels' SM budget, default 0: none)
        BadArgument names what is missing or not an integer."""
        env = os.environ if environ is None else environ
        if name is None:
            name = env.get("RAILWAVE_GROUP") or None
        if name is None:
            raise BadArgument("Group.from_env", "no group name: pass one or set RAILWAVE_GROUP")
        if rank is None:
            rank = _env_int(env, ("RANK", "SLURM_PROCID"), "this process's rank")
        if world_size is None:
            world_size = _env_int(env, ("WORLD_SIZE", "SLURM_NTASKS"), "ranks in the job")
        if rank is None or world_size is None:
            raise BadArgument("Group.from_env", "group %r needs rank and world_size (arguments, "
                              "RANK and WORLD_SIZE as torchrun sets them, or SLURM_PROCID and "
                              "SLURM_NTASKS)" % (name,))
        if node is None:
            node = _env_int(env, ("RAILWAVE_NODE",), "this node's index")
        if node is None:
            per = _env_int(env, ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"), "ranks per node")
            node = rank // per if per else _env_int(env, ("SLURM_NODEID", "GROUP_RANK"),
                                                    "node index")
        if node is None:
            raise BadArgument("Group.from_env", "cannot tell rank %d's node: pass node= or set "
                              "LOCAL_WORLD_SIZE (torchrun does) or RAILWAVE_NODE" % rank)
        if local_gpu is None:  # the rank path's native rail is its local GPU's
            local_gpu = _env_int(env, ("LOCAL_RANK", "SLURM_LOCALID"), "local rank") \
                if torch.cuda.is_available() or _rank.host_as_device(env) else None
        if max_tokens_per_rank is None:
            max_tokens_per_rank = _env_int(env, ("RAILWAVE_MAX_TOKENS_PER_RANK",),
                                           "the most tokens a rank dispatches")
        if spin_us is None:
            spin_us = _env_int(env, ("RAILWAVE_SPIN_US",), "busy-poll microseconds")
        if stream_ordered is None:
            stream_ordered = (_env_int(env, ("RAILWAVE_STREAM_ORDERED",), "0 or 1") or 0) != 0
        if static is None:
            static = (_env_int(env, ("RAILWAVE_STATIC",), "0 or 1") or 0) != 0
        if num_sms is None:
            num_sms = _env_int(env, ("RAILWAVE_NUM_SMS",), "the rank kernels' SM budget") or 0
        socket = socket or env.get("RAILWAVE_SOCKET") or _lib.DEFAULT_SOCKET
        return cls(name, rank, world_size, socket,
                   node=node, local_gpu=-1 if local_gpu is None else local_gpu,
                   max_tokens_per_rank=max_tokens_per_rank, max_recv_tokens=max_recv_tokens,
                   timeout=timeout, spin_us=50 if spin_us is None else spin_us,
                   stream_ordered=stream_ordered, static=static, num_sms=num_sms)

    def __repr__(self) -> str:
        return "railwave.Group(%r, rank=%d, world_size=%d, node=%d, socket=%r%s)" % (
            self.name, self.rank, self.world_size, self.node, self.socket,
            "" if self._c is not None else ", closed")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, layer: int = 0, step: Optional[int] = None,
                 async_op: bool = False) -> Union[DispatchResult, Work]:
        """Send each token row of x (T × hidden, fp32 or bf16, contiguous) to the ranks hosting
        its top-k experts (topk_idx T × k int32/int64, -1 = none; topk_weights T × k fp32).
        Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_per_expert, handle):
        recv_x: rows received (N × hidden, in no promised order); recv_topk_idx (int64 N × k):
        the row's experts as this rank's local expert index, -1 where not hosted here;
        recv_topk_weights (fp32 N × k, 0 where not hosted here); num_recv_per_expert (int64
        [num_experts / world_size]); handle for combine(). Differentiable in x and topk_weights
        (autograd); with grad enabled the handle keeps the routing even when neither needs a
        gradient, for a differentiable combine (a frozen router). async_op=True returns a Work
        (not differentiable). step=None numbers this layer's calls 0, 1, 2, ... (every rank must
        make the same calls)."""
        if async_op:
            return self._submit_dispatch(x, topk_idx, topk_weights, num_experts, layer, step)
        if not torch.is_grad_enabled():
            return self._submit_dispatch(x, topk_idx, topk_weights, num_experts, layer,
                                         step).wait()
        if getattr(x, "requires_grad", False) or getattr(topk_weights, "requires_grad", False):
            return autograd.dispatch(self, x, topk_idx, topk_weights, num_experts, layer, step)
        result = self._submit_dispatch(x, topk_idx, topk_weights, num_experts, layer,
                                       step).wait()
        result[4].keep_routing(topk_idx, topk_weights)
        return result

    def combine(self, expert_out: torch.Tensor, handle: Handle,
                async_op: bool = False) -> Union[torch.Tensor, Work]:
        """Sum each received row's output back into its token's position on the rank that sent
        it. expert_out: one row per received row, in recv_x's order (N × hidden, the dispatch's
        dtype), already reduced over this rank's experts (Σ weight × expert(x) over the row's
        local experts). Returns the combined T × hidden tensor. Differentiable in expert_out."""
        if torch.is_grad_enabled() and getattr(expert_out, "requires_grad", False) and not async_op:
            return autograd.combine(expert_out, handle)
        work = self._submit_combine(expert_out, handle)
        return work if async_op else work.wait()

    def dispatch_expert_major(self, x: torch.Tensor, topk_idx: torch.Tensor,
                              topk_weights: torch.Tensor, num_experts: int, alignment: int = 1,
                              layer: int = 0, step: Optional[int] = None
                              ) -> Tuple[torch.Tensor, torch.Tensor, layout.ExpertMajor, Handle]:
        """dispatch(), the received rows laid out for grouped GEMMs (railwave/layout.py): one
        row per (received row, local expert) entry, local expert 0's first, each expert's block
        padded with zero rows to a multiple of alignment. Returns (rows, rows per local expert
        (int64, padding included), the layout (its weight: each row's top-k weight), handle).
        Differentiable as dispatch() is; combine_expert_major() goes back."""
        recv_x, recv_idx, recv_w, _, handle = self.dispatch(x, topk_idx, topk_weights,
                                                            num_experts, layer, step)
        rows, lay = layout.expert_major(recv_x, recv_idx, recv_w,
                                        num_experts // self.world_size, alignment)
        return rows, lay.counts, lay, handle

    def combine_expert_major(self, expert_out: torch.Tensor, lay: layout.ExpertMajor,
                             handle: Handle, weighted: bool = True) -> torch.Tensor:
        """combine() of expert-major outputs (expert_out: one row per row of
        dispatch_expert_major's rows): each received row is Σ over its local experts of (its
        top-k weight ×, when weighted) that expert's output, then summed back to its token."""
        return self.combine(layout.combine_rows(expert_out, lay, weighted).contiguous(), handle)
