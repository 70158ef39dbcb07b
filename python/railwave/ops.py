"""Dispatch and combine as torch.library custom operators with autograd: railwave::dispatch
and railwave::combine (docs/python.md "TorchTitan").

They are the DeepEP duality on a railwave.deep_ep.Buffer (set with use()): dispatch's backward
is a combine of [grad recv_x, grad recv_topk_weights]; combine's backward is a cached dispatch
of the output gradient. Being single operators, they are what a selective activation
checkpointing policy sees and can save by name: torch.ops.railwave.dispatch.default and
torch.ops.railwave.combine.default (railwave.torchtitan adds both to TorchTitan's save list).
The dispatch handle crosses the operator boundary as a CPU int64 tensor naming an entry of a
process-local table.

    dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts,
             int num_worst_tokens=0)
        -> (recv_x, recv_topk_idx, recv_topk_weights, num_recv_per_expert, handle_id)
    combine(Tensor x, Tensor handle_id, bool will_backward) -> combined

will_backward is whether autograd records the combine — the caller's torch.is_grad_enabled()
(inside an operator it always reads False) and x requiring grad, which is when PyTorch ≥ 2.4
calls setup_context — and when False the combine frees the handle itself. The backward pair
(railwave._core Handle.open_backward / close_backward) runs through the Buffer: combine's
backward is its cached dispatch, dispatch's backward its combine with topk_weights; a dispatch
of x and topk_weights that need no gradient (a frozen router) has no backward, and the cached
dispatch then ends the pair itself. num_worst_tokens > 0 is the Buffer's sync-free form on a
static Group (rows padded to it, num_recv_per_expert counted on the device); 0 reads the counts
back. No fake (meta) kernels, so torch.compile does not trace through them. PyTorch ≥ 2.4 registers the backward with
torch.library.register_autograd; older PyTorch (Debian's 1.13) gets an Autograd kernel around
an autograd.Function."""
import itertools

import torch

from .errors import RailWaveError

NAMESPACE = "railwave"
_lib = torch.library.Library(NAMESPACE, "DEF")
_lib.define("dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, "
            "int num_worst_tokens=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_lib.define("combine(Tensor x, Tensor handle_id, bool will_backward) -> Tensor")

_state = {"buffer": None}
_handles = {}
_ids = itertools.count(1)


def use(buffer):
    """The railwave.deep_ep.Buffer the operators run on (one per process, as DeepEP's)."""
    _state["buffer"] = buffer


def _buffer():
    b = _state["buffer"]
    if b is None:
        raise RailWaveError("ops", "no Buffer: call railwave.ops.use(railwave.deep_ep."
                            "Buffer(group)) first (the TorchTitan dispatcher does it in "
                            "wire_meshes)")
    return b


def _handle(handle_id, pop):
    key = int(handle_id.reshape(-1)[0])
    h = _handles.pop(key, None) if pop else _handles.get(key)
    if h is None:
        raise RailWaveError("ops", "no dispatch handle %d (already combined without "
                            "backward, or from another process)" % key)
    return h


def _dispatch_kernel(x, topk_idx, topk_weights, num_experts, num_worst_tokens=0):
    b = _buffer()
    recv_x, recv_idx, recv_w, counts, h, _ = b.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
        num_worst_tokens=num_worst_tokens)
    key = next(_ids)
    _handles[key] = h
    if num_worst_tokens:  # the sync-free form: no host list, counted here on the device
        el = num_experts // b.group_size
        flat = torch.where(recv_idx >= 0, recv_idx, torch.full_like(recv_idx, el)).reshape(-1)
        counts = torch.zeros(el + 1, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))[:el]
    else:
        counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
    return recv_x, recv_idx, recv_w, counts, torch.tensor([key], dtype=torch.int64)


def _combine_kernel(x, handle_id, will_backward):
    h = _handle(handle_id, pop=not will_backward)
    return _buffer().combine(x.contiguous(), h)[0]


for _key in ("CPU", "CUDA"):
    _lib.impl("dispatch", _dispatch_kernel, _key)
    _lib.impl("combine", _combine_kernel, _key)


def _dispatch_backward(handle, g_recv_x, g_recv_w, like_x):
    if g_recv_x is None:
        g_recv_x = torch.zeros(handle.rows, handle.a.hidden,
                               dtype=like_x, device=handle.a.device)
    if g_recv_w is None:
        g_recv_w = torch.zeros(g_recv_x.shape[0], handle.a.topk, dtype=torch.float32,
                               device=g_recv_x.device)
    gx, gw, _ = _buffer().combine(g_recv_x.contiguous(), handle, topk_weights=g_recv_w.float())
    return gx, gw


def _combine_backward(handle, g_out):
    """The cached dispatch that opens the backward pair. Its caller first unpacks the handle_id
    tensor saved by the combine: under activation checkpointing that is what makes the region
    recompute now, before the pair opens — a recomputed dispatch inside the open backward pair
    would close it (the daemon runs one pair per group at a time)."""
    return _buffer().dispatch(g_out.contiguous(), handle=handle)[0]


if hasattr(torch.library, "register_autograd"):
    # setup_context also runs when activation checkpointing replays an operator whose output
    # it saved; that replay's ctx is never used for a backward and its handle may be gone, so
    # these look the handle up without insisting.
    def _d_setup(ctx, inputs, output):
        ctx.handle = _handles.get(int(output[4].reshape(-1)[0]))
        ctx.x_dtype = inputs[0].dtype

    def _d_backward(ctx, g_recv_x, g_idx, g_recv_w, g_counts, g_hid):
        gx, gw = _dispatch_backward(ctx.handle, g_recv_x, g_recv_w, ctx.x_dtype)
        return gx.to(ctx.x_dtype), None, gw, None, None

    def _c_setup(ctx, inputs, output):
        ctx.handle = _handles.pop(int(inputs[1].reshape(-1)[0]), None) if inputs[2] else None
        ctx.save_for_backward(inputs[1])  # see _combine_backward

    def _c_backward(ctx, g_out):
        ctx.saved_tensors
        return _combine_backward(ctx.handle, g_out), None, None

    torch.library.register_autograd(NAMESPACE + "::dispatch", _d_backward, setup_context=_d_setup)
    torch.library.register_autograd(NAMESPACE + "::combine", _c_backward, setup_context=_c_setup)
else:  # PyTorch < 2.4: an Autograd kernel that calls the operator below autograd
    def _below_autograd(op, *args):
        guard = torch._C._AutoDispatchBelowAutograd()  # a guard object, not a context manager
        try:
            return op(*args)
        finally:
            del guard

    class _DispatchFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, topk_idx, topk_weights, num_experts, num_worst_tokens=0):
            out = _below_autograd(torch.ops.railwave.dispatch, x, topk_idx, topk_weights,
                                  num_experts, num_worst_tokens)
            ctx.handle = _handle(out[4], pop=False)
            ctx.x_dtype = x.dtype
            ctx.mark_non_differentiable(out[1], out[3], out[4])
            return out

        @staticmethod
        def backward(ctx, g_recv_x, g_idx, g_recv_w, g_counts, g_hid):
            gx, gw = _dispatch_backward(ctx.handle, g_recv_x, g_recv_w, ctx.x_dtype)
            return gx.to(ctx.x_dtype), None, gw, None, None

    class _CombineFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, handle_id, will_backward):
            out = _below_autograd(torch.ops.railwave.combine, x, handle_id, will_backward)
            ctx.handle = _handle(handle_id, pop=True) if will_backward else None
            ctx.save_for_backward(handle_id)  # see _combine_backward
            return out

        @staticmethod
        def backward(ctx, g_out):
            ctx.saved_tensors
            return _combine_backward(ctx.handle, g_out), None, None

    _lib.impl("dispatch", lambda *a: _DispatchFn.apply(*a), "Autograd")
    _lib.impl("combine", lambda *a: _CombineFn.apply(*a), "Autograd")


def dispatch(x, topk_idx, topk_weights, num_experts, num_worst_tokens=0):
    """torch.ops.railwave.dispatch (differentiable in x and topk_weights); num_worst_tokens:
    the Buffer's, the sync-free form on a static Group."""
    return torch.ops.railwave.dispatch(x, topk_idx, topk_weights, num_experts, num_worst_tokens)


def combine(x, handle_id):
    """torch.ops.railwave.combine (differentiable in x), freeing the handle when no backward
    will run."""
    return torch.ops.railwave.combine(x, handle_id,
                                      torch.is_grad_enabled() and bool(x.requires_grad))


SAVE_OPS = ("dispatch", "combine")


def save_list():
    """The OpOverloads a selective activation checkpointing policy should save (never
    recompute: recomputing them would communicate again)."""
    return [getattr(torch.ops.railwave, n).default for n in SAVE_OPS]
