"""Autograd for dispatch and combine (docs/python.md "Autograd"), on railwave._core's operations.

Forward of a MoE layer: pair A = dispatch(x) ... combine(y, A). Its backward runs one more pair
B on the key (layer | 2^31, step), in the order autograd calls the two backward functions:
  * combine's backward (first): dispatch the output gradient with the same top-k ids — every
    rank receives grad_out of exactly the tokens it received in A — and reorder B's rows into A's
    order (rows come in no promised order; (source rank, token) names each row). When the
    dispatch's topk_weights need a gradient, B's rows carry k extra zero columns for it.
  * dispatch's backward (second): combine [grad recv_x | grad recv_topk_weights] in B's order
    with B's handle — the daemon sums every copy of a token back at its owner, which is exactly
    the gradient of a replication. If combine's backward did not run first (dispatch used without
    combine), B is opened here with rows of zeros.
When the dispatch ran without autograd (a frozen router: neither x nor topk_weights needs a
gradient) it has no backward: combine's backward ends B itself with a combine of zeros right
after its dispatch. Leaving B open for the group's next dispatch to close is not enough: a rank
whose B completed may leave (the end of training) or move on while another node still delivers
B's rows, and a rank that leaves fails its group's open pair everywhere.
Both are collective: every rank of the group must run the same backward."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._core import BACKWARD_LAYER, Core, Handle, op_name
from .errors import BackwardMismatch, BadArgument, BadArgumentType


class _Box:
    handle = None


def _refuse(h: Handle, detail: str) -> BackwardMismatch:
    """The error of a backward this rank cannot run; the backward pair is failed for every rank
    first, so the others' backward raises at once instead of at the phase timeout."""
    key_layer = h.layer | BACKWARD_LAYER
    h.group._poison(key_layer, h.step, h.n_experts)
    return BackwardMismatch(h.group._where(op_name("dispatch", key_layer, h.step)), detail)


def _permutation(a: Handle, b: Handle) -> torch.Tensor:
    """perm with b.keys()[perm] == a.keys(): where each of A's rows sits in B."""
    ka, kb = a.keys(), b.keys()
    op = a.group._where(op_name("dispatch", b.layer, b.step))
    if ka.shape != kb.shape:
        raise BackwardMismatch(op, "the backward pair received %d rows, the forward %d: the "
                               "routing changed between forward and backward"
                               % (kb.numel(), ka.numel()))
    sa, sb = torch.argsort(ka), torch.argsort(kb)
    if not torch.equal(ka[sa], kb[sb]):
        raise BackwardMismatch(op, "the backward pair received other tokens than the forward")
    perm = torch.empty_like(sa)
    perm[sa] = sb
    return perm


def _open_backward(h: Handle, rows: torch.Tensor) -> torch.Tensor:
    """Dispatch rows ([T, width], h's dtype) as h's backward pair with h's routing; returns the
    rows received in h's order (h.bwd: the backward pair's handle and the permutation)."""
    g = h.group
    g._check_usable()
    idx, w = h.topk_idx, h.topk_weights
    if (idx._version, w._version) != h.routing_version:
        raise _refuse(h, "topk_idx or topk_weights was changed in place after the dispatch; its "
                      "backward sends the routing of the forward again")
    work = g._dispatch_key(rows, idx, w, h.n_experts, h.layer | BACKWARD_LAYER, h.step)
    recv, _, _, _, hb = work.wait()
    perm = _permutation(h, hb)
    h.bwd = (hb, perm)
    return recv[perm]


def _width(h: Handle) -> int:
    return h.hidden + (h.topk if h.need_w_grad else 0)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, group, topk_idx, num_experts, layer, step, box):
        group._check_usable()
        layer, step = group._key(layer, step)
        recv_x, recv_idx, recv_w, counts, h = group._dispatch_key(
            x.detach(), topk_idx, topk_weights.detach(), num_experts, layer, step).wait()
        h.need_w_grad = bool(ctx.needs_input_grad[1])
        h.dispatch_backward = True
        h.keep_routing(topk_idx, topk_weights)
        box.handle = h
        ctx.handle = h
        ctx.mark_non_differentiable(recv_idx, counts)
        return recv_x, recv_idx, recv_w, counts

    @staticmethod
    def backward(ctx, g_x, g_idx, g_w, g_counts):
        h = ctx.handle
        n = h.num_recv
        if h.bwd is None:
            _open_backward(h, torch.zeros(h.num_tokens, _width(h), dtype=h.dtype,
                                          device=h.device))
        hb, perm = h.bwd
        h.bwd = None
        rows = torch.zeros(n, _width(h), dtype=h.dtype, device=h.device)
        if g_x is not None:
            rows[:, :h.hidden] = g_x
        if h.need_w_grad and g_w is not None:
            rows[:, h.hidden:] = (g_w * h.local_mask).to(h.dtype)
        in_b = torch.empty_like(rows)
        in_b[perm] = rows
        out = h.group._submit_combine(in_b, hb).wait()
        grad_x = out[:, :h.hidden] if ctx.needs_input_grad[0] else None
        grad_w = out[:, h.hidden:].float() if h.need_w_grad else None
        return grad_x, grad_w, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, handle):
        ctx.handle = handle
        return handle.group._submit_combine(expert_out.detach(), handle).wait()

    @staticmethod
    def backward(ctx, g_out):
        h = ctx.handle
        rows = torch.zeros(h.num_tokens, _width(h), dtype=h.dtype, device=h.device)
        rows[:, :h.hidden] = g_out
        recv = _open_backward(h, rows)
        if not h.dispatch_backward:  # nothing else will combine B: end it on every rank now
            hb, _ = h.bwd
            h.bwd = None
            hb.group._submit_combine(torch.zeros(hb.num_recv, hb.hidden, dtype=hb.dtype,
                                                 device=hb.device), hb).wait()
        return recv[:, :h.hidden].contiguous(), None


def dispatch(group: Core, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, layer: int = 0, step: Optional[int] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Handle]:
    """Group.dispatch with autograd (Group.dispatch calls this when x or topk_weights requires
    grad)."""
    if not isinstance(topk_weights, torch.Tensor):
        raise BadArgumentType("dispatch", "topk_weights must be a torch.Tensor")
    box = _Box()
    recv_x, recv_idx, recv_w, counts = _Dispatch.apply(x, topk_weights, group, topk_idx,
                                                       num_experts, layer, step, box)
    return recv_x, recv_idx, recv_w, counts, box.handle


def combine(expert_out: torch.Tensor, handle: Handle) -> torch.Tensor:
    """Group.combine with autograd. Its backward sends the routing of the handle's dispatch
    again, which a dispatch keeps when it ran with grad enabled and without async_op."""
    if not isinstance(handle, Handle):
        raise BadArgument("combine", "handle is not a railwave dispatch handle")
    if handle.topk_idx is None:
        handle.group._refuse_combine(BadArgument(
            op_name("combine", handle.layer, handle.step),
            "expert_out needs a gradient but the dispatch kept no routing for the backward "
            "(it ran with async_op=True or under torch.no_grad()): dispatch synchronously with "
            "grad enabled"))
    return _Combine.apply(expert_out, handle)
