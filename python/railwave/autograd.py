"""Autograd for dispatch and combine (docs/python.md "Autograd"), on railwave._core's operations.

Forward of a MoE layer: pair A = dispatch(x) ... combine(y, A). Its backward runs one more pair
B on the key (layer | 2^31, step), in the order autograd calls the two backward functions, with
railwave._core's backward-pair helpers (Handle.open_backward, Handle.close_backward):
  * combine's backward (first): dispatch the output gradient with the same top-k ids — every
    rank receives grad_out of exactly the tokens it received in A — in A's row order. When the
    dispatch's topk_weights need a gradient, B's rows carry extra zero columns for it (k for
    fp32 rows, 2k for bf16 rows: a high and a low part, so the gradient arrives exact).
  * dispatch's backward (second): combine [grad recv_x | grad recv_topk_weights] through B — the
    daemon sums every copy of a token back at its owner, which is exactly the gradient of a
    replication. If combine's backward did not run first (dispatch used without combine), B is
    opened here with rows of zeros.
When the dispatch ran without autograd (a frozen router: neither x nor topk_weights needs a
gradient) it has no backward: combine's backward ends B itself with a combine of zeros right
after its dispatch (Handle.open_backward says why that cannot wait).
Both are collective: every rank of the group must run the same backward."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._core import Core, Handle, get_weights, op_name, put_weights, weight_cols
from .errors import BadArgument, BadArgumentType


class _Box:
    handle = None


def _width(h: Handle) -> int:
    return h.hidden + (weight_cols(h.dtype, h.topk) if h.need_w_grad else 0)


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
        rows = torch.zeros(h.num_recv, _width(h), dtype=h.dtype, device=h.device)
        if g_x is not None:
            rows[:, :h.hidden] = g_x
        if h.need_w_grad and g_w is not None:
            put_weights(rows, h.hidden, g_w.float() * h.local_mask)
        out = h.close_backward(rows)
        grad_x = out[:, :h.hidden] if ctx.needs_input_grad[0] else None
        grad_w = get_weights(out, h.hidden, h.topk) if h.need_w_grad else None
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
        return h.open_backward(rows)[:, :h.hidden].contiguous(), None


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
            "grad enabled"), handle)
    return _Combine.apply(expert_out, handle)
