"""A Mixture-of-Experts layer whose experts are spread over a railwave.Group: rank r hosts
experts [r·E/W, (r+1)·E/W). The router is replicated (every rank routes its own tokens); tokens
travel to their experts with Group.dispatch and back with Group.combine, both differentiable, so
the layer trains like a local one (examples/moe_train.py; tested against a single-process
computation by tests/python/test_moe.py)."""
import torch
from torch import nn


class Expert(nn.Module):
    """The usual two-layer FFN: w2(act(w1 x))."""

    def __init__(self, hidden, ffn, act=nn.ReLU):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.act = act()
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)))


class MoE(nn.Module):
    """Router (linear, softmax, top-k, renormalised) + this rank's experts. `layer` names the
    layer in RailWave's phase keys (distinct per MoE layer of the model)."""

    def __init__(self, group, hidden, ffn, num_experts, topk, layer=0, expert=Expert):
        super().__init__()
        if num_experts % group.world_size:
            raise ValueError("railwave.MoE: num_experts %d is not a multiple of the world size "
                             "%d" % (num_experts, group.world_size))
        self.group, self.num_experts, self.topk, self.layer = group, num_experts, topk, layer
        self.local = num_experts // group.world_size
        self.first = group.rank * self.local  # global id of local expert 0
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(expert(hidden, ffn) for _ in range(self.local))

    def route(self, x):
        probs = torch.softmax(self.router(x).float(), dim=-1)
        w, idx = torch.topk(probs, self.topk, dim=-1)
        return idx, w / w.sum(dim=-1, keepdim=True)

    def run_experts(self, recv_x, recv_idx, recv_w):
        """One output row per received row: Σ over the row's local experts of weight × expert."""
        # Start from recv_x·0, not zeros: the output must depend on recv_x on every rank, even
        # one that received nothing, so that every rank runs dispatch's (collective) backward.
        y = recv_x * 0
        for e, expert in enumerate(self.experts):
            rows, ks = (recv_idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = expert(recv_x[rows]) * recv_w[rows, ks].unsqueeze(1).to(recv_x.dtype)
                y = y.index_add(0, rows, out)
        return y

    def forward(self, x, topk_idx=None, topk_weights=None, step=None):
        """x: tokens × hidden. topk_idx/topk_weights override the router (tests, replay)."""
        if topk_idx is None:
            topk_idx, topk_weights = self.route(x)
        recv_x, recv_idx, recv_w, _, handle = self.group.dispatch(
            x, topk_idx, topk_weights, self.num_experts, layer=self.layer, step=step)
        return self.group.combine(self.run_experts(recv_x, recv_idx, recv_w), handle)
