"""A Mixture-of-Experts layer whose experts are spread over a railwave.Group: rank r hosts
experts [r·E/W, (r+1)·E/W). The router is replicated (every rank routes its own tokens); tokens
travel to their experts with Group.dispatch and back with Group.combine, both differentiable, so
the layer trains like a local one (examples/moe_train.py; tested against a single-process
computation by tests/python/test_moe.py). The group is anything with Group's rank, world_size,
dispatch and combine (examples/moe_train.py's one-process reference passes a stand-in)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .errors import BadArgument


class Expert(nn.Module):
    """The usual two-layer FFN: w2(act(w1 x))."""

    def __init__(self, hidden: int, ffn: int, act: type = nn.ReLU):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.act = act()
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))


class MoE(nn.Module):
    """Router (linear, softmax, top-k, renormalised) + this rank's experts. `layer` names the
    layer in RailWave's phase keys (distinct per MoE layer of the model)."""

    def __init__(self, group, hidden: int, ffn: int, num_experts: int, topk: int, layer: int = 0,
                 expert: type = Expert):
        super().__init__()
        if num_experts % group.world_size:
            raise BadArgument("MoE", "num_experts %d is not a multiple of the world size %d"
                              % (num_experts, group.world_size))
        self.group, self.num_experts, self.topk, self.layer = group, num_experts, topk, layer
        self.local = num_experts // group.world_size
        self.first = group.rank * self.local  # global id of local expert 0
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(expert(hidden, ffn) for _ in range(self.local))

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        w, idx = torch.topk(probs, self.topk, dim=-1)
        return idx, w / w.sum(dim=-1, keepdim=True)

    def run_experts(self, recv_x: torch.Tensor, recv_idx: torch.Tensor,
                    recv_w: torch.Tensor) -> torch.Tensor:
        """One output row per received row: Σ over the row's local experts of weight × expert."""
        # Start from recv_x·0, not zeros: the output must depend on recv_x on every rank, even
        # one that received nothing, so that every rank runs dispatch's (collective) backward.
        y = recv_x * 0
        for e, expert in enumerate(self.experts):
            rows, ks = (recv_idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = expert(recv_x[rows]) * recv_w[rows, ks].unsqueeze(1).to(recv_x.dtype)
                y = y.index_add(0, rows, out)
        if not y.requires_grad and torch.is_grad_enabled():
            # No row here and recv_x needs no gradient (a frozen router): the output must still
            # depend on the trained experts, as on the ranks that received rows, so that every
            # rank runs combine's (collective) backward.
            for p in self.experts.parameters():
                if p.requires_grad:
                    y = y + (p.view(-1)[:1] * 0).to(y.dtype)
                    break
        return y

    def forward(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                topk_weights: Optional[torch.Tensor] = None,
                step: Optional[int] = None) -> torch.Tensor:
        """x: tokens × hidden. topk_idx/topk_weights override the router (tests, replay)."""
        if topk_idx is None:
            topk_idx, topk_weights = self.route(x)
        recv_x, recv_idx, recv_w, _, handle = self.group.dispatch(
            x, topk_idx, topk_weights, self.num_experts, layer=self.layer, step=step)
        return self.group.combine(self.run_experts(recv_x, recv_idx, recv_w), handle)
