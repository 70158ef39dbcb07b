"""Autograd for dispatch and combine (docs/python.md "Autograd").

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
Both are collective: every rank of the group must run the same backward."""
import torch

from .group import BACKWARD_LAYER


class _Box:
    handle = None


def _permutation(a, b):
    """perm with b.keys()[perm] == a.keys(): where each of A's rows sits in B."""
    ka, kb = a.keys(), b.keys()
    if ka.shape != kb.shape:
        raise RuntimeError("railwave: backward pair received %d rows, the forward %d: the "
                           "routing changed between forward and backward" % (kb.numel(), ka.numel()))
    sa, sb = torch.argsort(ka), torch.argsort(kb)
    if not torch.equal(ka[sa], kb[sb]):
        raise RuntimeError("railwave: backward pair received other tokens than the forward")
    perm = torch.empty_like(sa)
    perm[sa] = sb
    return perm


def _open_backward(h, rows):
    """Dispatch rows ([T, width], h's dtype) as h's backward pair; returns (recv rows in h's
    order, backward handle, permutation)."""
    g = h.group
    g._check_usable()
    work = g._dispatch_key(rows, h.topk_idx, h.topk_weights, h.n_experts,
                           h.layer | BACKWARD_LAYER, h.step)
    recv, _, _, _, hb = work.wait()
    perm = _permutation(h, hb)
    h.bwd = (hb, perm)
    return recv[perm]


def _width(h):
    return h.hidden + (h.topk if h.need_w_grad else 0)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, group, topk_idx, num_experts, layer, step, box):
        group._check_usable()
        layer, step = group._key(layer, step)
        recv_x, recv_idx, recv_w, counts, h = group._dispatch_key(
            x.detach(), topk_idx, topk_weights.detach(), num_experts, layer, step).wait()
        h.need_w_grad = bool(ctx.needs_input_grad[1])
        # The backward pair re-sends the same routing: keep it safe from in-place changes.
        h.topk_idx, h.topk_weights = topk_idx.clone(), topk_weights.detach().clone()
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
        return recv[:, :h.hidden].contiguous(), None


def dispatch(group, x, topk_idx, topk_weights, num_experts, layer=0, step=None):
    """Group.dispatch with autograd (Group.dispatch calls this when x or topk_weights requires
    grad)."""
    if not isinstance(topk_weights, torch.Tensor):
        raise TypeError("railwave: dispatch: topk_weights must be a torch.Tensor")
    box = _Box()
    recv_x, recv_idx, recv_w, counts = _Dispatch.apply(x, topk_weights, group, topk_idx,
                                                       num_experts, layer, step, box)
    return recv_x, recv_idx, recv_w, counts, box.handle


def combine(expert_out, handle):
    """Group.combine with autograd."""
    from .group import Handle
    if not isinstance(handle, Handle):
        raise ValueError("railwave: combine: handle is not a railwave dispatch handle")
    return _Combine.apply(expert_out, handle)
