"""The core of a railwave.Group: its connection to the node's railwaved through librailwave, the
buffers it lends, and the dispatch and combine operations as they travel (submission, completion,
results), without autograd. railwave.group (the public Group) and railwave.autograd (the
differentiable dispatch and combine) both build on it; it knows neither (docs/python.md is the
contract; docs/dataflow.md "Dispatch output" and "Combine" the daemon's side).

One operation is in flight per Group at a time (the daemon runs one dispatch/combine pair per
group: a combine needs its dispatch's handle, and the next dispatch closes the previous pair).
Host (CPU) tensors are copied into two memfd buffers registered once and grown when needed; CUDA
tensors are lent by IPC handle of their allocator segment (railwave._cuda). Returned tensors are
always fresh copies: they stay valid after the next operation and after close()."""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

from . import _host, _lib, _rank
from ._cuda import CudaRegistry, StreamOrder
from .errors import (CODES, NAMES, BackwardMismatch, BadArgument, BadArgumentType,
                     ConnectError, GroupClosed, PhaseError, PhaseInFlight, RailWaveError,
                     ReceiveRoomExceeded, Timeout)

BACKWARD_LAYER = 1 << 31  # layer bit of the pairs autograd opens for a layer's backward

DTYPES = {torch.float32: _lib.DTYPE_FP32, torch.bfloat16: _lib.DTYPE_BF16}
_NONE = _lib.Span(_lib.BUF_NONE, 0, 0)
_CPU = torch.device("cpu")
_memmove = ctypes.memmove


_align = _host.align


def weight_cols(dtype: torch.dtype, topk: int) -> int:
    """Columns a backward pair's rows give the topk_weights gradient: topk for fp32 rows, 2 ×
    topk for bf16 rows (a high and a low bf16 part, put_weights). Exact either way: only the
    rank hosting an expert contributes that entry, so the combine adds zeros to it."""
    return topk if dtype == torch.float32 else 2 * topk


def put_weights(rows: torch.Tensor, hidden: int, w: torch.Tensor) -> None:
    """Write fp32 w [N, K] into rows[:, hidden:hidden + weight_cols(rows.dtype, K)]."""
    K = w.shape[1]
    if rows.dtype == torch.float32:
        rows[:, hidden:hidden + K] = w
    else:
        hi = w.to(rows.dtype)
        rows[:, hidden:hidden + K] = hi
        rows[:, hidden + K:hidden + 2 * K] = (w - hi.float()).to(rows.dtype)


def get_weights(out: torch.Tensor, hidden: int, topk: int) -> torch.Tensor:
    """The fp32 [N, topk] put_weights wrote into out's rows (after the combine's sum)."""
    if out.dtype == torch.float32:
        return out[:, hidden:hidden + topk].clone()
    return out[:, hidden:hidden + topk].float() + out[:, hidden + topk:hidden + 2 * topk].float()


class Handle:
    """What a combine (and autograd) needs of a completed dispatch. Attributes: num_tokens (rows
    this rank dispatched), num_recv (rows it received), src_rank and src_token (int64 tensors
    [num_recv]: whose token each received row is), layer, step."""

    __slots__ = ("group", "handle_id", "layer", "step", "dtype", "hidden", "topk", "n_experts",
                 "num_tokens", "num_recv", "device", "_src", "_local_mask", "combined",
                 "topk_idx", "topk_weights", "routing_version", "need_w_grad",
                 "dispatch_backward", "bwd", "_plan", "rank_phase", "recv_n")

    def __init__(self, group: Core, handle_id: int, layer: int, step: int, dtype: torch.dtype,
                 hidden: int, topk: int, n_experts: int, num_tokens: int, num_recv: int, src: Any,
                 local_mask: Any, device: torch.device):
        self.group, self.handle_id, self.layer, self.step = group, handle_id, layer, step
        self.dtype, self.hidden, self.topk, self.n_experts = dtype, hidden, topk, n_experts
        self.num_tokens, self.num_recv, self.device = num_tokens, num_recv, device
        self._src = src                # [num_recv, 2] (source rank, token), numpy or tensor
        self._local_mask = local_mask  # [num_recv, topk] bool: top-k entries hosted here
        self.combined = False
        # For the backward pair only (open_backward, close_backward): the dispatch's routing,
        # which the backward pair sends again (keep_routing), whether topk_weights need a
        # gradient, whether the dispatch has a backward (close_backward will be called), the
        # open backward pair.
        self.topk_idx: Optional[torch.Tensor] = None
        self.topk_weights: Optional[torch.Tensor] = None
        self.routing_version = (0, 0)
        self.need_w_grad = False
        self.dispatch_backward = False
        self.bwd = None
        self._plan = None  # host path: the dispatch's plan (its combine reads through it)
        self.rank_phase = 0  # rank path: the dispatch's phase number (its combine names it)
        self.recv_n = None  # static mode: int32 [1] on the device, the rows received

    def keep_routing(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Keep the dispatch's routing for a backward pair, whenever autograd may run: a combine
        may be differentiable (trained experts) even when its dispatch was not (a frozen
        router). Kept as autograd keeps saved tensors, by reference with their version
        counters: the backward refuses a routing changed in place since (no copy per call)."""
        self.topk_idx, self.topk_weights = topk_idx, topk_weights.detach()
        self.routing_version = (topk_idx._version, self.topk_weights._version)

    def _tensor(self, a: Any) -> torch.Tensor:
        return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))

    @property
    def src_rank(self) -> torch.Tensor:
        return self._tensor(self._src[:, 0]).to(torch.int64)

    @property
    def src_token(self) -> torch.Tensor:
        return self._tensor(self._src[:, 1]).to(torch.int64)

    @property
    def local_mask(self) -> torch.Tensor:
        return self._tensor(self._local_mask)

    def keys(self) -> torch.Tensor:
        """int64 [num_recv]: one key per received row, unique on this rank (src_rank, token)."""
        return self.src_rank * (1 << 32) + self.src_token

    # ---- the backward pair -------------------------------------------------------------------
    # A dispatch/combine pair A's backward is one more pair B on the key (layer | 2^31, step):
    # combine's backward dispatches the output gradient with A's routing (open_backward: every
    # rank receives the gradient of exactly the tokens it received in A), dispatch's backward
    # combines the received rows' gradients through B (close_backward: the daemon sums every
    # copy of a token back at its owner, the gradient of a replication). railwave.autograd,
    # railwave.ops (through railwave.deep_ep) and railwave.deep_ep.Buffer all run B here. Both
    # calls are collective: every rank of the group must run the same backward.

    def open_backward(self, rows: torch.Tensor, keep_open: Optional[bool] = None) -> torch.Tensor:
        """Dispatch rows ([num_tokens, width], contiguous, the pair's dtype) as this dispatch's
        backward pair B with the routing keep_routing kept; returns B's received rows in this
        dispatch's received order, and keeps (B's handle, where each of A's rows sits in B) for
        close_backward. keep_open (default: dispatch_backward): False when nothing will call
        close_backward — the dispatch ran without autograd (a frozen router) — and then B is
        ended here, on every rank alike, with a combine of zeros. Leaving B for the group's
        next dispatch to close is not enough: a rank whose B completed may leave (the end of
        training) or move on while another node still delivers B's rows, and a rank that leaves
        fails its group's open pair everywhere. A routing changed in place since the dispatch,
        or B delivering other rows than A, is a BackwardMismatch here after B was failed for
        every rank (PhaseError there, at once)."""
        g = self.group
        g._check_usable()
        key = self.layer | BACKWARD_LAYER
        idx, w = self.topk_idx, self.topk_weights
        if idx is None or (idx._version, w._version) != self.routing_version:
            g._poison(key, self.step, self.n_experts)  # static mode: through the stream
            raise BackwardMismatch(g._where(op_name("dispatch", key, self.step)), (
                "the dispatch kept no routing for a backward (it ran with async_op=True or "
                "under torch.no_grad())" if idx is None else
                "topk_idx or topk_weights was changed in place after the dispatch; its "
                "backward sends the routing of the forward again"))
        recv, _, _, _, hb = g._dispatch_key(rows, idx, w, self.n_experts, key, self.step).wait()
        if self.recv_n is not None:  # static mode: matched on the device, judged by check()
            perm = _permutation_static(self, hb)
        else:
            try:
                perm = _permutation(self, hb)
            except BackwardMismatch as e:
                g._refuse_combine(e, hb, _lib.RANK_ABORT_ROUTING)  # B: fail it, then raise
        if keep_open is None:
            keep_open = self.dispatch_backward
        if keep_open:
            self.bwd = (hb, perm)
        else:
            g._submit_combine(torch.zeros(hb.num_recv, hb.hidden, dtype=hb.dtype,
                                          device=hb.device), hb).wait()
        return recv[perm]

    def close_backward(self, rows: torch.Tensor) -> torch.Tensor:
        """Combine rows ([num_recv, width] in this dispatch's received order, the width
        open_backward dispatched) through the backward pair; returns [num_tokens, width]. When
        open_backward did not run first (the dispatch was used without its combine's backward)
        B is opened here with rows of zeros."""
        if self.bwd is None:
            self.open_backward(torch.zeros(self.num_tokens, rows.shape[1], dtype=rows.dtype,
                                           device=rows.device), keep_open=True)
        hb, perm = self.bwd
        self.bwd = None
        in_b = torch.empty_like(rows)
        in_b[perm] = rows
        return self.group._submit_combine(in_b, hb).wait()


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


def _static_keys(h: Handle) -> torch.Tensor:
    """int64 [room] on the device: keys() for the rows a static dispatch received, and for the
    rows past its received count (garbage metadata) 2^62 + the row index, unique and last."""
    room = h.num_recv
    pos = torch.arange(room, dtype=torch.int64, device=h.device)
    src = h._src.to(torch.int64)
    k = src[:, 0] * (1 << 32) + src[:, 1]
    return torch.where(pos < h.recv_n, k, pos + (1 << 62))


def _permutation_static(a: Handle, b: Handle) -> torch.Tensor:
    """_permutation of two static dispatches (room-sized, the received counts on the device),
    with no host read: where A's keys and B's differ (the routing changed between forward and
    backward, or B received other rows) the group's device flag is set, and Group.check()
    raises BackwardMismatch. Rows past A's count map to rows past B's."""
    ka, kb = _static_keys(a), _static_keys(b)
    sa, sb = torch.argsort(ka), torch.argsort(kb)
    a.group._static_bad |= (ka[sa] != kb[sb]).any().to(torch.int32)
    perm = torch.empty_like(sa)
    perm[sa] = sb
    return perm


# How the daemon answers _poison's dispatch when it failed the pair for the whole group: local
# ranks disagree (RW_E_FIELD, RW_E_EXPERTS), the id refused (RW_E_TOKENS), the pair already
# failed by it on another node (RW_E_PHASE).
_FAILED_FOR_ALL = (CODES["RW_E_FIELD"], CODES["RW_E_EXPERTS"], CODES["RW_E_TOKENS"],
                   CODES["RW_E_PHASE"])


def _received(meta: torch.Tensor, K: int, lut: torch.Tensor):
    """From the dispatch output's metadata ([n, 4 + 2K] int32: src node, src rank, token, 0,
    ids, fp32 weights; docs/dataflow.md "Dispatch output"), with lut (Core._lut: global id + 1 →
    this rank's local expert index, or -1): (recv_idx, recv_w, mine) as Group.dispatch returns
    them and the handle keeps. Five device operations (each costs the host a launch); an id
    outside [-1, E) (the daemon lets none through) reads -1, never out of the table."""
    n, E = meta.shape[0], lut.shape[0] - 2
    pos = (meta[:, 4:4 + K] + 1).clamp_(0, E + 1).reshape(-1)
    recv_idx = torch.index_select(lut, 0, pos).view(n, K)
    mine = recv_idx >= 0
    recv_w = meta[:, 4 + K:].view(torch.float32) * mine
    return recv_idx, recv_w, mine


def _rank_args(rp, x, topk_idx, topk_weights, E, layer, step, zero_rows=False):
    """A rank-path dispatch's argument block and the tensors it names: x (copied when not
    16-byte aligned: the pack reads rows 16 bytes at a time), the int32 ids, and fresh outputs
    of the room's size (rows, metadata, per-expert counts). zero_rows: the rows start zero
    (static mode, where the rows past the received count are returned: garbage there would
    reach the experts, and inf or NaN times a zero weight is NaN in their gradients)."""
    T, H = x.shape
    K = topk_idx.shape[1]
    cap, dev = rp.cap, x.device
    if x.data_ptr() % 16:
        x = x.clone()
    # int64 ids clamped first, so that none wraps into a valid int32 id (-2 and E are both out
    # of range: the count kernel reports the token)
    ids = topk_idx if topk_idx.dtype == torch.int32 else topk_idx.clamp(-2, E).to(torch.int32)
    rx = (torch.zeros if zero_rows else torch.empty)(cap, H, dtype=x.dtype, device=dev)
    meta = torch.empty(cap, 4 + 2 * K, dtype=torch.int32, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    d = _lib.RankDispatch(dtype=DTYPES[x.dtype], topk=K, layer=layer, step=step, token_count=T,
                          hidden=H, n_experts=E, tokens=x.data_ptr(), topk_ids=ids.data_ptr(),
                          topk_weights=topk_weights.data_ptr(), recv_x=rx.data_ptr(),
                          recv_meta=meta.data_ptr(), recv_counts=counts.data_ptr(),
                          recv_cap=cap)
    return x, ids, rx, meta, counts, d


def op_name(kind: str, layer: int, step: int) -> str:
    """How errors name an operation: "dispatch layer 3 step 7 (backward)"."""
    return "%s layer %d step %d%s" % (kind, layer & ~BACKWARD_LAYER, step,
                                      " (backward)" if layer & BACKWARD_LAYER else "")


class Work:
    """An operation in flight (async_op=True). wait() returns what the synchronous call would
    have returned, or raises its error; done() says, without blocking, whether wait() would."""

    __slots__ = ("group", "phase_id", "_what", "_finish", "_args", "_keep", "_cqe", "_result",
                 "_exc")

    def __init__(self, group: Core, phase_id: int, what: Tuple[str, int, int],
                 finish: Callable[..., Any], args: tuple, keep: Any):
        self.group, self.phase_id, self._what = group, phase_id, what  # what: (kind, layer, step)
        self._finish, self._args = finish, args  # finish(cqe, *args) gives the result
        self._keep = keep  # tensors the daemon reads until done
        self._cqe = self._result = self._exc = None

    @property
    def op(self) -> str:
        return op_name(*self._what)

    def _reap(self, block: bool, timeout: Optional[float] = None) -> Any:
        return self.group._reap(self, block, timeout)

    def done(self) -> bool:
        if self._cqe is None and self._exc is None and self._result is None:
            self._cqe = self._reap(block=False)
        return self._cqe is not None or self._result is not None or self._exc is not None

    def wait(self, timeout: Optional[float] = None) -> Any:
        if self._result is None and self._exc is None:
            cqe = self._cqe or self._reap(block=True, timeout=timeout)
            self.group._pending = self._keep = None
            try:
                self._result = self._finish(cqe, *self._args)
            except Exception as e:  # kept: a second wait() raises the same
                self._exc = e
        if self._exc is not None:
            raise self._exc
        return self._result


class _Done:
    """A static-mode call's Work: enqueued, nothing to wait for on the host (its failures are
    raised by the next host-visible call: Group.check, or the next static call)."""

    __slots__ = ("_result", "_what")

    def __init__(self, result: Any, what: Tuple[str, int, int]):
        self._result, self._what = result, what

    @property
    def op(self) -> str:
        return op_name(*self._what)

    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float] = None) -> Any:
        return self._result


class RankWork(Work):
    """An operation on the rank path: its phase_id is the rank page's phase number, and what
    finish gets is railwave._rank.RankPath.reap's (code, rows received, rows dropped,
    message)."""

    __slots__ = ()

    def _reap(self, block: bool, timeout: Optional[float] = None) -> Any:
        g = self.group
        if g._c is None or g._rank is None:
            raise GroupClosed(repr(g), "the group was closed while %s was in flight" % self.op)
        return g._rank.reap(g, self, block, timeout)


class Core:
    """A rank's connection to its group through railwaved, and the operations without autograd:
    _submit_dispatch/_dispatch_key and _submit_combine return a Work; _check_usable and _key
    check a call before it. railwave.Group (the public face: arguments, environment, autograd)
    is a Core; railwave.autograd calls these methods, users call Group's. Arguments arrive
    checked (Group.__init__)."""

    DTYPES = DTYPES  # torch dtype → the ring's dtype code (the rows railwaved carries)

    def __init__(self, name: str, rank: int, world_size: int, node: int, socket: str,
                 local_gpu: int, max_tokens_per_rank: Optional[int],
                 max_recv_tokens: Optional[int], timeout: float, spin_us: int,
                 stream_ordered: bool, static: bool = False, num_sms: int = 0):
        self._c = None
        self.num_sms = num_sms  # the rank path's SM budget (0: the kernels' own choice)
        self.static = bool(static)  # the rank path's static mode (docs/python.md "Static mode")
        self._static_bad = None  # int32 [1] on the device: a static backward pair mismatched
        self._static_over = None  # a failure a static call read, for check() to raise
        self._rank = None  # railwave._rank.RankPath, opened at the first dispatch it serves
        self._rank_off = None  # why this Group fell back to the ring path, when it did
        self._said = ""  # the daemon's last reason a rank-path failure showed
        self._luts = {}  # (E, device) -> _lut's table
        self._rejoined = False  # _rejoin ran and no rank-path dispatch completed since
        self._rank_mode = _rank.mode()
        self._host_dev = _rank.host_as_device()
        self.socket = socket
        self.name, self.rank, self.world_size, self.node = name, rank, world_size, node
        self.timeout = float(timeout)
        self.spin = spin_us * 1e-6
        self.max_tokens_per_rank, self.max_recv_tokens = max_tokens_per_rank, max_recv_tokens
        self.stream_ordered = bool(stream_ordered)
        self._order = None  # railwave._cuda.StreamOrder, made at the first CUDA operation
        lib = self._lib = _lib.load()
        self._submit_fn, self._poll_fn = lib.rw_client_submit, lib.rw_client_poll
        opts = self._opts = _lib.Opts()
        self._opts_bytes = (socket.encode(), name.encode())  # what opts' pointers point at
        opts.socket_path, opts.group = self._opts_bytes
        opts.rank, opts.world_size, opts.node, opts.local_gpu = rank, world_size, node, local_gpu
        opts.timeout_ms = int(min(self.timeout, 60.0) * 1000)
        self._connect()
        self._open = None  # the handle of the dispatch whose combine is due, if any
        self._static_due = None  # static mode: the last dispatch (its combine due, if not yet)
        self._in = self._out = None
        self._plans = {}  # host dispatch shape → _host.DispatchPlan on the current buffers
        self._cuda = None
        self._cuda_out = None
        self._pending = None
        self._phase_id = 0
        self._auto_step = {}
        self._max_tokens = 0  # the most tokens this rank dispatched
        self._cqe = _lib.Cqe()  # the one completion buffer (one operation in flight)
        self._cqe_ref = ctypes.byref(self._cqe)
        self._cqe_counts = np.frombuffer(self._cqe.counts, dtype=np.uint32)
        self._csqe = _lib.Sqe(kind=_lib.KIND_COMBINE)  # the combine entry, refilled per call
        self._csqe.topk_ids = self._csqe.topk_weights = _NONE
        self._csqe_ref = ctypes.byref(self._csqe)

    # ---- lifetime ------------------------------------------------------------------------
    def _connect(self) -> None:
        """Join (hello, rings)."""
        c = ctypes.c_void_p(0)
        rc = self._lib.rw_client_connect(ctypes.byref(self._opts), ctypes.byref(c))
        if rc:
            raise _lib.error(rc, "join group %r as rank %d of %d (node %d) at %s"
                             % (self.name, self.rank, self.world_size, self.node, self.socket),
                             default=ConnectError)
        self._c = c

    def _abort_pair(self) -> None:
        """Fail the open pair (the dispatch whose combine is due) for every rank now, by its key:
        its combine submitted with RW_SQE_ABORT (ipc/railwave.h "Failing a pair by its key").
        Used when this rank cannot give that combine, so that the others are told at once
        instead of at the daemon's phase timeout: each gets PhaseError from its combine of this
        pair, never from another pair (an abort that comes after the pair ended, failed by
        another rank, fails nothing). Waits for the daemon's answer, so the pair has failed
        here before this rank's next submission."""
        h = self._open
        if h is None:
            return
        h.combined = True
        self._open = None
        sqe = _lib.Sqe(kind=_lib.KIND_COMBINE, dtype=DTYPES[h.dtype], topk=h.topk,
                       layer=h.layer, step=h.step, hidden=h.hidden, handle_id=h.handle_id,
                       n_experts=h.n_experts, flags=_lib.SQE_ABORT)
        sqe.tokens = sqe.topk_ids = sqe.topk_weights = sqe.output = _NONE
        self._phase_id += 1
        sqe.phase_id = self._phase_id
        what = ("abort", h.layer, h.step)
        rc = self._submit_fn(self._c, ctypes.byref(sqe), 1)
        if rc:
            raise self._error(rc, "submit " + op_name(*what))
        w = self._pending = Work(self, self._phase_id, what, lambda cqe: None, (), None)
        try:
            w.wait()  # RW_E_PHASE (it failed the pair) or RW_E_STATE (the pair had ended)
        except RailWaveError:
            self._pending = None  # the daemon gone or slow: the caller raises the real error

    def close(self) -> None:
        """Leave the group: every buffer is released and the connection closed. An operation
        still in flight is abandoned (the daemon fails that phase for the group). Idempotent."""
        if self._c is None:
            return
        if self._order is not None:  # before the buffers: one of them holds its flag
            if self._pending is not None:
                self._order.settle()
            self._order.release()
            self._order = None
        if self._rank is not None:  # before the client: the client unmaps the rank page
            if self._rank.static:  # its phases are on the stream: let them pass
                try:
                    self._rank.sync(torch, torch.device("cuda", self._rank.device))
                except Exception:
                    pass
            elif self._pending is not None:
                self._rank.settle(min(self.timeout, 10.0))
            self._rank.close()
            self._rank = None
        if self._cuda is not None:
            self._cuda.release()
        self._lib.rw_client_close(self._c)
        self._c, self._in, self._out, self._cuda, self._cuda_out = None, None, None, None, None
        self._pending = None
        self._plans.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- internals -------------------------------------------------------------------------
    def _where(self, op: str) -> str:
        return "%s [group %r rank %d]" % (op, self.name, self.rank)

    def _error(self, code: int, op: str, default: type = RailWaveError,
               detail: Optional[str] = None) -> RailWaveError:
        """The exception for RW_E_* code met while doing op (errors.class_for picks its class;
        default: the class of the call's errors); detail: the daemon's last message unless
        given."""
        if detail is None:
            detail = self._lib.rw_client_last_message(self._c).decode() if self._c else ""
        return _lib.error(code, self._where(op), detail, default)

    def _check_usable(self) -> None:
        if self._c is None:
            raise GroupClosed(repr(self), "the group was closed (close() or a with block)")
        if self._pending is not None:
            raise PhaseInFlight(self._where(self._pending.op),
                                "still in flight: wait() for it first")

    def _key(self, layer: int, step: Optional[int]) -> Tuple[int, int]:
        if not isinstance(layer, int) or not 0 <= layer < BACKWARD_LAYER:
            raise BadArgument("dispatch", "layer must be an int in [0, 2^31), got %r" % (layer,))
        if step is None:
            step = self._auto_step.get(layer, 0)
            self._auto_step[layer] = step + 1
        if not isinstance(step, int) or not 0 <= step < 1 << 64:
            raise BadArgument("dispatch", "step must be a non-negative int, got %r" % (step,))
        return layer, step

    def _room(self) -> int:
        """Rows one dispatch may deliver to this rank (the class docstring)."""
        if self.max_recv_tokens:
            return self.max_recv_tokens
        return self.world_size * (self.max_tokens_per_rank or max(self._max_tokens, 1))

    def _room_error(self, op, cap, rb, mb, counts_b):
        """The ReceiveRoomExceeded of a rank whose receive room was too small (RW_E_RANGE)."""
        W = self.world_size
        per_row = rb + mb
        if self.max_recv_tokens:
            why = "max_recv_tokens=%d" % self.max_recv_tokens
        elif self.max_tokens_per_rank:
            why = "max_tokens_per_rank=%d, so world_size %d × that" % (self.max_tokens_per_rank, W)
        else:
            why = ("max_tokens_per_rank unset, so world_size %d × the most tokens this rank "
                   "dispatched so far (%d): another rank dispatched more" % (W, self._max_tokens))
        M = self.max_tokens_per_rank
        counts = " + %d bytes of per-expert counts" % counts_b if counts_b else ""
        need = "%d rows = %d bytes" % (W * M, counts_b + W * M * per_row) if M else \
            "world_size %d × M rows of %d bytes (a row with its metadata)%s" % (W, per_row, counts)
        return self._error(
            CODES["RW_E_RANGE"], op, PhaseError,
            "this rank received more rows than its receive room of %d rows (%s). A rank receives "
            "at most one row per token of every rank: with M the most tokens any rank dispatches "
            "(max_tokens_per_rank, or RAILWAVE_MAX_TOKENS_PER_RANK), the room needed is %s"
            % (cap, why, need))

    def _buffer(self, which, nbytes):
        """The host buffer `which` ('in' or 'out'), at least nbytes, registered once and grown
        (re-registered, the old one released) only when a phase needs more. Growing one drops
        the dispatch plans, which point into the old buffers."""
        cur = self._in if which == "in" else self._out
        if cur is None or cur.size < nbytes:
            size = max(nbytes, 2 * cur.size if cur else 0, 1 << 16)
            size = _align(size, 4096)
            new = _host.HostBuf(self, size)
            if cur is not None:
                self._lib.rw_client_deregister(self._c, cur.id)
            setattr(self, "_" + which, new)
            self._plans.clear()
            cur = new
        return cur

    def _cuda_span(self, t):
        if self._cuda is None:
            self._cuda = CudaRegistry(self._c, self._lib)
        return self._cuda.span(t)

    def _stream_order(self, device):
        """The Group's StreamOrder (stream_ordered=True), or None (synchronous mode)."""
        if not self.stream_ordered:
            return None
        if self._order is None or self._order.device != device:
            if self._order is not None:
                self._order.release()
            if self._cuda is None:
                self._cuda = CudaRegistry(self._c, self._lib)
            self._order = StreamOrder(self._cuda, device)
        return self._order

    def _cuda_out_buffer(self, nbytes, device):
        t = self._cuda_out
        if t is None or t.numel() < nbytes or t.device != device:
            size = _align(max(nbytes, 2 * (t.numel() if t is not None else 0), 1 << 16), 4096)
            self._cuda_out = torch.empty(size, dtype=torch.uint8, device=device)
        return self._cuda_out

    def _submit(self, sqe, sqe_ref, what, finish, args, keep, order=None):
        """Post one entry (sqe, with sqe_ref its byref) and return its Work; what = (kind,
        layer, step) names it in errors; finish(cqe, *args) makes the result. With `order` (a
        StreamOrder) the entry waits on the event recorded now on the current stream, and the
        current stream then waits for the entry's flag."""
        self._phase_id += 1
        sqe.phase_id = self._phase_id
        if order is not None:
            order.before_submit(sqe)
        else:
            sqe.flags, sqe.event_id, sqe.output.reserved = 0, 0, 0
        rc = self._submit_fn(self._c, sqe_ref, 1)
        if rc:
            raise self._error(rc, "submit " + op_name(*what))
        if order is not None:
            order.after_submit()
        w = self._pending = Work(self, self._phase_id, what, finish, args, keep)
        return w

    def _reap(self, work, block, timeout=None):
        """The completion of `work` (the Group's Cqe), or None when not blocking and none is
        there."""
        c, cqe, ref = self._c, self._cqe, self._cqe_ref
        if c is None:
            raise GroupClosed(repr(self), "the group was closed while %s was in flight" % work.op)
        n = self._poll_fn(c, ref, 1)
        if n == 1 and cqe.phase_id == work.phase_id:
            return cqe  # one operation in flight: read by its finish before the next reap
        lib = self._lib
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        spin_end = time.perf_counter() + self.spin
        while True:
            if n == 1:  # a completion of something abandoned earlier (e.g. after a Timeout)
                n = lib.rw_client_poll(c, ref, 1)
            if n == 0 and not block:
                n = lib.rw_client_wait(c, ref, 1, 0)  # notices a dead daemon
                if n == 0:
                    return None
            while n == 0:
                if time.perf_counter() < spin_end:
                    n = lib.rw_client_poll(c, ref, 1)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._error(CODES["RW_E_TIMEOUT"], work.op, Timeout,
                                      "no completion from railwaved in %.1f s (the operation is "
                                      "still in flight: wait() again or close())" % limit)
                n = lib.rw_client_wait(c, ref, 1, int(min(left, 1.0) * 1000) + 1)
            if n < 0:
                if self._order is not None and n == CODES["RW_E_CLOSED"]:
                    self._order.pay_lost()  # or the current stream waits on the flag forever
                raise self._error(n, work.op)
            if cqe.phase_id == work.phase_id:
                return cqe

    def _poison(self, layer: int, step: int, num_experts: Any) -> None:
        """Fail this (layer, step) for the whole group at once: a one-row dispatch whose expert
        id is out of range, which the daemon refuses for every rank of every node
        (docs/dataflow.md "Gather"). Used when this rank's own arguments are wrong, so the
        other ranks get RW_E_PHASE now instead of waiting for the daemon's phase timeout.
        Static mode: _poison_static (the same refusal, through the stream)."""
        if self.static:
            self._poison_static(layer, step, num_experts)
            return
        try:
            ib, ob = self._buffer("in", 64), self._buffer("out", 4096)
            ib.np[:48] = 0
            ib.i32[4] = 0x7FFFFFFF  # byte 16: the one top-k id
            e = num_experts if isinstance(num_experts, int) and 0 < num_experts < 1 << 32 \
                else self.world_size
            sqe = _lib.Sqe(kind=_lib.KIND_DISPATCH, dtype=_lib.DTYPE_FP32, topk=1, layer=layer,
                           step=step, token_count=1, hidden=1, n_experts=e,
                           output_capacity=ob.size)
            sqe.tokens = _lib.Span(ib.id, 0, 0)
            sqe.topk_ids = _lib.Span(ib.id, 0, 16)
            sqe.topk_weights = _lib.Span(ib.id, 0, 32)
            sqe.output = _lib.Span(ob.id, 0, 0)
            w = self._submit(sqe, ctypes.byref(sqe), ("refuse dispatch", layer, step),
                             lambda cqe: cqe.error if cqe.status != _lib.CQ_OK else 0, (), None)
            code = w.wait(timeout=min(self.timeout, 30.0))
        except Exception:
            self._pending = None  # best effort: the caller raises the real error
            code = None
        if self._rank is not None and code not in _FAILED_FOR_ALL:
            # The rank path: a pair of the key already open that the refused dispatch did not
            # fail (answered alone: it came after every local rank's page submit, or not at
            # all) — this rank leaves, which fails it, and joins again.
            try:
                self._rejoin()
            except RailWaveError:
                pass

    def _poison_static(self, layer: int, step: int, num_experts: Any, like: Any = None) -> None:
        """_poison on a static Group: this rank still takes its seat in the call the others
        make, with a one-token static dispatch on (layer, step) whose expert id is out of range.
        The stream takes the pair's key from its counters as the others' calls do (so they stay
        in step), the count kernel marks the token, and the daemon refuses the submission and
        fails the key on every node naming this rank (docs/rankpath.md "Failure"): the others'
        next host-visible call (check(), the next static dispatch) raises PeerFailed at once
        instead of at the daemon's phase timeout. The stream is then waited for (an error path,
        never captured) and the refusal read off the report, so that this rank's own check()
        does not raise it again; a failure the report held before is kept for check(). Best
        effort: the caller raises the real error. like: a tensor of the call (the device of
        a rank path not open yet)."""
        try:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return  # a capture cannot wait; the graph is spoiled anyway
            rp = self._rank
            if rp is None:
                if not (isinstance(like, torch.Tensor) and (like.is_cuda or self._host_dev)):
                    like = torch.empty(0, device="cpu" if self._host_dev else "cuda")
                rp = self._rank_for(like)
            if rp is None or not rp.static:
                return
            self._static_hold()
            dev = torch.device("cpu") if rp.host else torch.device("cuda", rp.device)
            E = num_experts if isinstance(num_experts, int) and 0 < num_experts < 1 << 31 \
                else self.world_size
            x = torch.zeros(1, 4, dtype=torch.float32, device=dev)
            ids = torch.full((1, 1), E, dtype=torch.int32, device=dev)  # past the experts
            w = torch.zeros(1, 1, dtype=torch.float32, device=dev)
            _, _, rx, meta, counts, d = _rank_args(rp, x, ids, w, E, layer, step)
            n = torch.zeros(1, dtype=torch.int32, device=dev)
            if not rp.host:
                rp.stream.handle = torch.cuda.current_stream(dev).cuda_stream
            if self._lib.rw_client_rank_dispatch_static(rp.rp, rp.stream_ref, ctypes.byref(d),
                                                        n.data_ptr(), rp.phase_ref):
                return
            rp.sync(torch, None if rp.host else dev)
            del x, ids, w, rx, meta, counts
            rp.check()  # the refusal just made: this rank raises its own error instead
            self._rank_detail("")  # and the daemon's notice of it is read
        except Exception:
            pass

    def _static_hold(self) -> None:
        """Wait for the stream and keep what the report holds for check() (the earliest failure
        first), so that a call reading the report next sees its own phases only."""
        self._rank.sync(torch, None if self._rank.host else torch.device("cuda", self._rank.device))
        try:
            self._static_report(overflow_now=False)
        except RailWaveError as e:
            if self._static_over is None:
                self._static_over = e

    def _check_dispatch(self, x, topk_idx, topk_weights, num_experts):
        if not isinstance(x, torch.Tensor):
            raise BadArgumentType("dispatch", "x must be a torch.Tensor, got %s"
                                  % type(x).__name__)
        if x.dtype not in DTYPES:
            raise BadArgumentType("dispatch", "x has dtype %s; railwaved carries float32 and "
                                  "bfloat16 rows" % x.dtype)
        if x.dim() != 2 or x.shape[1] < 1:
            raise BadArgument("dispatch", "x must be 2-D (tokens × hidden), got shape %s"
                              % (tuple(x.shape),))
        for n, t, dts in (("topk_idx", topk_idx, (torch.int32, torch.int64)),
                          ("topk_weights", topk_weights, (torch.float32,))):
            if not isinstance(t, torch.Tensor):
                raise BadArgumentType("dispatch", "%s must be a torch.Tensor" % n)
            if t.dtype not in dts:
                raise BadArgumentType("dispatch", "%s has dtype %s, expected %s"
                                      % (n, t.dtype, " or ".join(str(d) for d in dts)))
            if t.dim() != 2 or t.shape[0] != x.shape[0] or t.shape[1] < 1:
                raise BadArgument("dispatch", "%s must be (tokens %d) × topk, got %s"
                                  % (n, x.shape[0], tuple(t.shape)))
            if t.device != x.device:
                raise BadArgument("dispatch", "%s is on %s, x on %s" % (n, t.device, x.device))
        if topk_idx.shape[1] != topk_weights.shape[1]:
            raise BadArgument("dispatch", "topk_idx has %d columns, topk_weights %d"
                              % (topk_idx.shape[1], topk_weights.shape[1]))
        for n, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not t.is_contiguous():
                raise BadArgument("dispatch", "%s is not contiguous (strides %s): call "
                                  ".contiguous() first" % (n, tuple(t.stride())))
        if x.device.type not in ("cpu", "cuda"):
            raise BadArgument("dispatch", "tensors on %s; CPU and CUDA are supported" % x.device)
        if not isinstance(num_experts, int) or num_experts <= 0:
            raise BadArgument("dispatch", "num_experts must be a positive int, got %r"
                              % (num_experts,))
        M = self.max_tokens_per_rank
        if M is not None and x.shape[0] > M:
            raise BadArgument("dispatch", "x has %d tokens, above max_tokens_per_rank %d "
                              "(every rank's receive room is sized for world_size × that)"
                              % (x.shape[0], M))

    def _submit_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                         topk_weights: torch.Tensor, num_experts: int, layer: int,
                         step: Optional[int]) -> Work:
        self._check_usable()
        layer, step = self._key(layer, step)
        return self._dispatch_key(x, topk_idx, topk_weights, num_experts, layer, step)

    def _dispatch_key(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      num_experts: int, layer: int, step: int) -> Work:
        """Submit a dispatch on (layer, step); returns its Work. Host tensors of a shape seen
        before take the plan made for it (every check a plan stands for is in its key)."""
        try:
            key = (x.dtype, x.shape, x.device, topk_idx.dtype, topk_idx.shape, topk_idx.device,
                   topk_weights.dtype, topk_weights.shape, topk_weights.device, num_experts)
            plan = self._plans.get(key)
        except (AttributeError, TypeError):  # not tensors, or an unhashable num_experts
            key = plan = None
        if plan is None or not (x.is_contiguous() and topk_idx.is_contiguous() and
                                topk_weights.is_contiguous()):
            try:
                self._check_dispatch(x, topk_idx, topk_weights, num_experts)
            except BadArgument:
                if self.static:
                    self._poison_static(layer, step, num_experts, x)
                else:
                    self._poison(layer, step, num_experts)
                raise
            if x.shape[0] > self._max_tokens:
                self._max_tokens = x.shape[0]
                self._plans.clear()  # their receive room depends on it
            rp = self._rank_for(x)
            if rp is not None and rp.static:
                return self._dispatch_static(rp, x, topk_idx, topk_weights, num_experts, layer,
                                             step)
            if rp is not None:
                return self._dispatch_rank(rp, x, topk_idx, topk_weights, num_experts, layer,
                                           step)
            if x.is_cuda:
                return self._dispatch_cuda(x, topk_idx, topk_weights, num_experts, layer, step)
            plan = self._host_plan(x, topk_idx, num_experts)
            self._plans[key] = plan
        first_bad = plan.put(x, topk_idx, topk_weights)
        s = plan.sqe
        s.layer, s.step = layer, step
        return self._submit(s, plan.sqe_ref, ("dispatch", layer, step), self._finish_host,
                            (plan, layer, step, first_bad), None)

    def _host_plan(self, x, topk_idx, E):
        T, H = x.shape
        K = topk_idx.shape[1]
        rb, mb = H * x.element_size(), _host.meta_bytes(K)
        rows = _align(self._room(), 8)  # keeps the metadata 16-byte aligned for any row size
        counts_b = _align(4 * E) if E > _lib.CQE_INLINE_COUNTS else 0
        # Inputs: this dispatch's, and the combine's rows (as many as may be received).
        ib = self._buffer("in", max(_align(T * rb) + 2 * _align(T * K * 4), rows * rb, 64))
        ob = self._buffer("out", max(counts_b + rows * (rb + mb), 64))
        return _host.DispatchPlan(self, x, topk_idx, E, ib, ob, counts_b)

    def _dispatch_fail(self, cqe, what, E, cap, rb, mb, counts_b, first_bad):
        op = op_name(*what)
        if first_bad is not None:
            (t, k), v = first_bad
            raise BadArgument(
                op, "topk_idx[%d, %d] = %d is not an expert id (valid: -1 for none, 0..%d); "
                "the daemon failed this phase on every rank (%s: %s)"
                % (t, k, v, E - 1, NAMES.get(cqe.error, cqe.error), _lib.strerror(cqe.error)))
        if cqe.error == CODES["RW_E_RANGE"]:
            raise self._room_error(op, cap, rb, mb, counts_b)
        raise self._error(cqe.error, op, PhaseError)

    def _finish_host(self, cqe, plan, layer, step, first_bad):
        if cqe.status != _lib.CQ_OK:
            if first_bad is None and cqe.error == CODES["RW_E_TOKENS"]:
                first_bad = plan.first_bad()  # int32 ids went unchecked: the daemon refused
            self._dispatch_fail(cqe, ("dispatch", layer, step), plan.E, plan.cap, plan.rb,
                                _host.meta_bytes(plan.K), plan.counts_b, first_bad)
        n = cqe.recv_tokens
        if n > plan.cap:
            raise self._error(CODES["RW_E_BADREPLY"], op_name("dispatch", layer, step),
                              detail="%d rows received into room for %d" % (n, plan.cap))
        recv_x, loc, recv_w, counts, src, mine = plan.result(cqe, n)
        h = self._open = Handle(self, cqe.handle_id, layer, step, plan.dtype, plan.H, plan.K,
                                plan.E, plan.T, n, src, mine, _CPU)
        h._plan = plan
        return recv_x, loc, recv_w, counts, h

    def _dispatch_cuda(self, x, topk_idx, topk_weights, E, layer, step):
        """A CUDA dispatch: the tensors' own memory (by allocator segment), ids converted to
        int32 on the device, the output in the Group's CUDA buffer, sized for the receive
        room."""
        T, H = x.shape
        K = topk_idx.shape[1]
        dt, W = x.dtype, self.world_size
        rb, mb = H * x.element_size(), _host.meta_bytes(K)
        cap = _align(self._room(), 8)
        counts_b = _align(4 * E) if E > _lib.CQE_INLINE_COUNTS else 0
        out_bytes = counts_b + cap * (rb + mb)
        meta_off = counts_b + cap * rb
        el = E // W
        lo = self.rank * el
        sqe = _lib.Sqe(kind=_lib.KIND_DISPATCH, dtype=DTYPES[dt], topk=K, layer=layer, step=step,
                       token_count=T, hidden=H, n_experts=E)
        none = _lib.Span(_lib.BUF_NONE, 0, 0)
        sqe.tokens = sqe.topk_ids = sqe.topk_weights = none
        bad = (topk_idx < -1) | (topk_idx >= E)
        first_bad = None
        idx32 = topk_idx.to(torch.int32)
        order = self._stream_order(x.device)
        if order is not None:  # no host synchronization: the daemon names a bad id itself
            idx32 = idx32.masked_fill(bad, 0x7FFFFFFF)
        elif bool(bad.any()):
            t, k = bad.nonzero()[0].tolist()
            first_bad = ((t, k), int(topk_idx[t, k]))
            idx32 = idx32.masked_fill(bad, 0x7FFFFFFF)
        if order is None:
            torch.cuda.current_stream(x.device).synchronize()  # inputs complete (railwave.h)
        if T:
            for name, t in (("tokens", x), ("topk_ids", idx32), ("topk_weights", topk_weights)):
                b, o = self._cuda_span(t)
                setattr(sqe, name, _lib.Span(b, 0, o))
        ob_t = self._cuda_out_buffer(out_bytes, x.device)
        b, o = self._cuda_span(ob_t)
        sqe.output = _lib.Span(b, 0, o)
        sqe.output_capacity = out_bytes

        def finish(cqe):
            if cqe.status != _lib.CQ_OK:
                self._dispatch_fail(cqe, ("dispatch", layer, step), E, cap, rb, mb, counts_b,
                                    first_bad)
            n = cqe.recv_tokens
            if n > cap:
                raise self._error(CODES["RW_E_BADREPLY"], op_name("dispatch", layer, step),
                                  detail="%d rows received into room for %d" % (n, cap))
            recv_x = ob_t[counts_b:counts_b + n * rb].view(dt).view(n, H).clone()
            meta = ob_t[meta_off:meta_off + n * mb].view(torch.int32).view(n, 4 + 2 * K)
            recv_idx, recv_w, mine = _received(meta, K, self._lut(E, x.device))
            if cqe.counts_buf == _lib.BUF_NONE:
                counts = torch.tensor(cqe.counts[lo:lo + el], dtype=torch.int64, device=x.device)
            else:
                co = cqe.counts_offset
                counts = ob_t[co + 4 * lo:co + 4 * (lo + el)].view(torch.int32).to(torch.int64)
            h = self._open = Handle(self, cqe.handle_id, layer, step, dt, H, K, E, T, n,
                                    meta[:, 1:3].to(torch.int64), mine, x.device)
            return recv_x, recv_idx, recv_w, counts, h

        return self._submit(sqe, ctypes.byref(sqe), ("dispatch", layer, step),
                            finish, (), (x, idx32, topk_weights), order)

    # ---- the rank path (railwave._rank; docs/python.md "The rank path") ----------------------
    def _rank_for(self, x):
        """The RankPath that carries x's dispatch, opened at the first one it serves, or None
        (the ring path: host tensors, RAILWAVE_RANK_PATH=0, or a Group where it did not open)."""
        rp = self._rank
        if x.is_cuda:
            dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
        elif self._host_dev and x.device.type == "cpu":
            dev = 0
        else:
            return None
        if rp is not None:
            if rp.device != dev:
                raise BadArgument("dispatch", "x is on %s; this Group's rank path is on cuda:%d"
                                  " (one device per Group)" % (x.device, rp.device))
            return rp
        if not self.static and (self._rank_mode == 0 or self._rank_off is not None):
            return None
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RailWaveError(self._where("open the rank path"), (
                "the first dispatch of a Group opens its rank path (device memory, the daemon's "
                "page and slabs, with host waits), which a CUDA graph capture cannot hold: make "
                "one dispatch before capturing"))
        self._rank = _rank.open_for(self, dev, self._rank_room(), not x.is_cuda, self.static,
                                    self.max_recv_tokens if self.static else None,
                                    self.num_sms)
        return self._rank

    def path(self) -> Tuple[str, str]:
        """Which path this Group's CUDA tensors take, and why (docs/service.md "Turning on the
        rank path"): ("rank", "") once its rank path is open (kernels in the caller's stream);
        ("mover", why) when it fell back to the daemon's movers (why: the library's or the
        daemon's reason, such as no group slabs while group_area_mib is 0) or
        RAILWAVE_RANK_PATH=0 keeps it off; ("undecided", "") until the first dispatch of a
        device tensor decides."""
        if self._rank is not None:
            return ("rank", "")
        if self._rank_off is not None:
            return ("mover", self._rank_off)
        if self._rank_mode == 0 and not self.static:
            return ("mover", "RAILWAVE_RANK_PATH=0")
        return ("undecided", "")

    def _lut(self, E: int, device: torch.device) -> torch.Tensor:
        """int64 [E + 2] on device: entry id + 1 is global expert id's index among this rank's
        experts, or -1 (entry 0: id -1, none; entry E + 1: any id past the experts). Made once
        per (E, device), copied from the host (complete when made, for any stream). One first
        needed during a CUDA graph capture, which cannot hold a host copy, is written on the
        device by the graph, for that graph alone (its values exist once the graph replays)."""
        lut = self._luts.get((E, device))
        if lut is None:
            el = E // self.world_size
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            lut = torch.full((E + 2,), -1, dtype=torch.int64,
                             device=device if capturing else _CPU)
            lut[1 + self.rank * el:1 + (self.rank + 1) * el] = torch.arange(el, device=lut.device)
            if capturing:
                return lut
            lut = self._luts[(E, device)] = lut.to(device)
        return lut

    def _rank_room(self) -> int:
        """The rank path's receive room, fixed when it opens (the rank page is sized for it):
        max_recv_tokens, else world_size × max_tokens_per_rank, else world_size × the larger of
        this first dispatch's tokens and 256 — at most 65536, the daemon's default max_tokens,
        which bounds a page's records. Static mode with max_tokens_per_rank: the page holds
        that worst case, and max_recv_tokens (when less) is the outputs' capacity (RankPath.cap:
        rows past it are dropped and counted on the device, the group runs on)."""
        if self.static and self.max_tokens_per_rank:
            return self.world_size * self.max_tokens_per_rank
        if self.max_recv_tokens:
            return self.max_recv_tokens
        if self.max_tokens_per_rank:
            return self.world_size * self.max_tokens_per_rank
        return min(self.world_size * max(self._max_tokens, 256), 65536)

    def _rank_enqueue(self, rp, t, fn, arg, what):
        """Enqueue one phase on the current stream of t's device (the legacy stream for the
        stand-in's host tensors); returns its phase number."""
        if not rp.host:
            rp.stream.handle = torch.cuda.current_stream(t.device).cuda_stream
        rc = fn(rp.rp, rp.stream_ref, ctypes.byref(arg), rp.phase_ref)
        if rc:
            raise self._error(rc, "enqueue " + op_name(*what), detail=rp.message())
        return rp.phase.value

    def _dispatch_rank(self, rp, x, topk_idx, topk_weights, E, layer, step):
        """A dispatch on the rank path: the kernels read the caller's tensors in stream order and
        write fresh output tensors sized for the room (returned as views of their first n rows).
        The received row count n is in the page once the stream wrote the phase's done: eager
        dispatch waits for that (Work.wait), as its results' shapes need it."""
        T, H = x.shape
        K = topk_idx.shape[1]
        dt, dev, cap = x.dtype, x.device, rp.max_recv
        what = ("dispatch", layer, step)
        x, ids, rx, meta, counts, d = _rank_args(rp, x, topk_idx, topk_weights, E, layer, step)
        try:
            k = self._rank_enqueue(rp, x, self._lib.rw_client_rank_dispatch, d, what)
        except RailWaveError as e:
            if e.code != CODES["RW_E_CLOSED"]:
                self._poison(layer, step, E)  # nothing of it was submitted: fail it for all
            raise
        el = E // self.world_size
        lo = self.rank * el
        lut = self._lut(E, dev)

        # What d names, held by this closure: Work.wait lets go of its own references before
        # finish runs, and a retry below enqueues d again (a freed ids tensor read as ids was
        # seen: "token 1 has a top-k expert id outside [0, n_experts)")
        inputs = (x, ids, topk_weights)

        def finish(res):
            rc, n, dropped, msg = res
            deadline, nap = time.monotonic() + self.timeout, 0.002
            while rc == CODES["RW_E_STATE"] and self._rejoined and time.monotonic() < deadline:
                # Joined again (_rejoin) while the pair this rank left was still ending there:
                # the daemon refused the submit alone (no pair of this key saw it), so it is
                # enqueued again until that pair has ended.
                time.sleep(nap)
                nap = min(2 * nap, 0.1)  # each refusal is a line in the daemon's log
                w.phase_id = self._rank_enqueue(rp, inputs[0], self._lib.rw_client_rank_dispatch,
                                                d, what)
                rc, n, dropped, msg = rp.reap(self, w, True)
            self._rejoined = False
            k = w.phase_id
            if rc == CODES["RW_E_TOKENS"] and "top-k expert id" in msg:
                # the daemon refused this rank's submit alone (its count kernel found a bad
                # id): the others' pair is open, so fail it for them now
                self._poison(layer, step, E)
            if rc:
                raise self._rank_error(rc, self._rank_detail(msg), what, topk_idx, E, cap,
                                       dropped)
            m = meta[:n]
            recv_idx, recv_w, mine = _received(m, K, lut)
            h = self._open = Handle(self, k, layer, step, dt, H, K, E, T, n, m[:, 1:3], mine,
                                    dev)  # (src rank, token) int32: Handle's properties widen
            h.rank_phase = k
            return rx[:n], recv_idx, recv_w, counts[lo:lo + el].to(torch.int64), h

        w = self._pending = RankWork(self, k, what, finish, (),
                                     (x, ids, topk_weights, rx, meta, counts))
        return w

    # ---- static mode (docs/python.md "Static mode") -------------------------------------------
    def _dispatch_static(self, rp, x, topk_idx, topk_weights, E, layer, step):
        """A dispatch in static mode: enqueued and returned at once, nothing read back. The
        outputs are the room's size (recv_x [room, hidden], the tensors from the metadata
        [room, k]); rows from the received count on (handle.recv_n, int32 on the device) are
        zero in recv_x and carry expert index -1 and weight 0. A failure of an earlier phase is
        raised here first (the report, read from page-locked memory: the next host-visible
        call; an overflow waits for check()). Differentiable through railwave.autograd: its
        backward pairs are static calls too (Handle.open_backward)."""
        self._static_report(overflow_now=False)
        T, H = x.shape
        K = topk_idx.shape[1]
        dt, dev, cap = x.dtype, x.device, rp.cap
        what = ("dispatch", layer, step)
        x, ids, rx, meta, counts, d = _rank_args(rp, x, topk_idx, topk_weights, E, layer, step,
                                                 zero_rows=True)
        if self._static_bad is None:  # before any capture: it outlives every graph
            self._static_bad = torch.zeros(1, dtype=torch.int32, device=dev)
        n = torch.zeros(1, dtype=torch.int32, device=dev)
        if not rp.host:
            rp.stream.handle = torch.cuda.current_stream(dev).cuda_stream
        rc = self._lib.rw_client_rank_dispatch_static(rp.rp, rp.stream_ref, ctypes.byref(d),
                                                      n.data_ptr(), rp.phase_ref)
        if rc:
            raise self._error(rc, "enqueue " + op_name(*what), detail=rp.message())
        k = rp.phase.value
        if rp.host:
            # The stand-in's host tensors: the tensor operations below run on the CPU at once,
            # not in stream order, so its stream is waited for first (the test switch only)
            rp.sync(torch, None)
        el = E // self.world_size
        valid = (torch.arange(cap, dtype=torch.int32, device=dev) < n).unsqueeze(1)
        recv_idx, _, _ = _received(meta, K, self._lut(E, dev))
        recv_idx = recv_idx.masked_fill(~valid, -1)
        mine = recv_idx >= 0
        recv_w = meta[:, 4 + K:].view(torch.float32).masked_fill(~mine, 0.0)
        h = Handle(self, k, layer, step, dt, H, K, E, T, cap, meta[:, 1:3], mine, dev)
        h.rank_phase, h.recv_n = k, n
        self._static_due = h
        lo = self.rank * el
        return _Done((rx, recv_idx, recv_w, counts[lo:lo + el].to(torch.int64), h), what)

    def _combine_static(self, y, h):
        """The combine of a static dispatch: y has the room's rows (those past the received
        count are not read); the combined rows come back at once, written in stream order.
        Always enqueued (a failure reported since is raised by the next dispatch or check()):
        the dispatch is on the stream, and its pair needs this rank's combine."""
        rp = self._rank
        what = ("combine", h.layer, h.step)
        if y.data_ptr() % 16:
            y = y.clone()
        out = torch.empty(h.num_tokens, h.hidden, dtype=h.dtype, device=y.device)
        c = _lib.RankCombine(h.rank_phase, y.data_ptr(), out.data_ptr() if h.num_tokens else 0)
        if not rp.host:
            rp.stream.handle = torch.cuda.current_stream(y.device).cuda_stream
        call = ctypes.c_uint64(0)
        rc = self._lib.rw_client_rank_combine_static(rp.rp, rp.stream_ref, ctypes.byref(c),
                                                     ctypes.byref(call))
        if rc:
            raise self._error(rc, "enqueue " + op_name(*what), detail=rp.message())
        h.combined = True
        if rp.host:  # the stand-in's host tensors: out is read on the CPU at once
            rp.sync(torch, None)
        return _Done(out, what)

    def _static_report(self, overflow_now=True):
        """Raise what the stream reported failed since the last look (rw_client_rank_check).
        An overflow (rows dropped past the capacity; the group ran on) is kept for check()
        unless overflow_now: raised by a dispatch, this rank would stop while the others
        run on into a phase that then waits for it."""
        rp = self._rank
        if rp is None or not rp.static:
            return
        rc, c, msg = rp.check()
        if rc == CODES["RW_E_OVERFLOW"]:
            e = ReceiveRoomExceeded(self._where("static dispatch phase %d" % c.over_phase),
                                    "%d rows arrived past the room of %d rows and were dropped"
                                    "; the room needed: %d rows (max_recv_tokens) (%s)"
                                    % (c.overflow, rp.cap, c.need, msg), code=rc,
                                    text=_lib.strerror(rc))
            if overflow_now:
                raise e
            if self._static_over is None:
                self._static_over = e
            return
        if rc and self._static_bad is not None:  # a failed backward pair mismatches its
            self._static_bad.zero_()               # forward: the failure is what is raised
        if rc == CODES["RW_E_RANGE"]:
            raise ReceiveRoomExceeded(self._where("static phase %d" % c.phase), (
                "the daemon listed more rows for this rank than its rank page holds (%d rows: "
                "%s), and failed the phase for the group; with max_tokens_per_rank the page "
                "holds the worst case, world_size × that, and rows past max_recv_tokens are "
                "dropped and counted instead (%s)")
                % (rp.max_recv, "max_recv_tokens, max_tokens_per_rank unset"
                   if not self.max_tokens_per_rank else "world_size × max_tokens_per_rank",
                   msg), code=rc, text=_lib.strerror(rc))
        if rc:
            raise self._error(rc, "static phase %d" % c.phase, PhaseError,
                              detail=self._rank_detail(msg))

    def set_num_sms(self, num_sms: int) -> None:
        """The SM budget of the rank path's kernels (docs/python.md "SMs"): every kernel this
        Group enqueues in this process from now on takes at most num_sms blocks, so at most
        num_sms SMs at a time; 0: the kernels' own choice. Kept for the rank path's open when
        it is not open yet; a CUDA graph keeps the budget it was captured with. BadArgument:
        not an int, below 0, or (from librailwave) above the device's SMs."""
        if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 0:
            raise BadArgument(self._where("set_num_sms"), "num_sms must be an int >= 0 (0: the "
                              "kernels' own choice), got %r" % (num_sms,))
        if self._rank is not None:
            self._rank.set_sms(num_sms)
        self.num_sms = num_sms

    def check(self) -> None:
        """Static mode: wait for the current stream's work, then raise the first failure the
        stream reported since the last check (PhaseError, PeerFailed, DaemonLost, or
        ReceiveRoomExceeded naming the room needed), else BackwardMismatch when a backward
        pair received other rows than its forward. The host-visible call after graph
        replays. A no-op outside static mode."""
        rp = self._rank
        if rp is None or not rp.static:
            return
        rp.sync(torch, torch.device("cuda", rp.device) if not rp.host else None)
        over, self._static_over = self._static_over, None
        if over is not None:  # the earliest: what the report holds now stays for the next
            raise over
        self._static_report()
        bad = self._static_bad
        if bad is not None and int(bad.item()):
            bad.zero_()
            raise BackwardMismatch(self._where("static backward"), "a backward pair received "
                                   "other rows than its forward (the routing changed between "
                                   "forward and backward, or the ranks ran different "
                                   "backwards); its gradients are wrong")

    def _rank_detail(self, msg):
        """The library's message for a failed phase, with the daemon's reason when it sent a new
        one (a notice on the control socket, read here: the page's status word holds a code
        only; the last reason shown is not repeated, as it may be an older phase's)."""
        if self._c is None:
            return msg
        if hasattr(self._lib, "rw_client_take_notices"):
            self._lib.rw_client_take_notices(self._c)
        else:  # an older library: a wait takes them only when a completion failed
            self._lib.rw_client_wait(self._c, self._cqe_ref, 1, 0)
        said = self._lib.rw_client_last_message(self._c).decode()
        if not said or said == self._said:  # nothing new: not this phase's
            return msg
        self._said = said
        return "%s; railwaved: %s" % (msg, said)

    def _rank_error(self, rc, msg, what, topk_idx, E, cap, dropped):
        """The exception of a rank-path dispatch that completed with rc (msg: the library's)."""
        op = self._where(op_name(*what))
        if rc == CODES["RW_E_TOKENS"] and "top-k expert id" in msg:
            bad = (topk_idx < -1) | (topk_idx >= E)  # read back on the error path only
            if bool(bad.any()):
                t, j = bad.nonzero()[0].tolist()
                return BadArgument(op, "topk_idx[%d, %d] = %d is not an expert id (valid: -1 "
                                   "for none, 0..%d); the phase failed (%s)"
                                   % (t, j, int(topk_idx[t, j]), E - 1, msg),
                                   code=rc, text=_lib.strerror(rc))
        if rc == CODES["RW_E_OVERFLOW"]:
            return ReceiveRoomExceeded(op, "%d rows arrived past the rank path's receive room "
                                       "of %d rows and were dropped (%s)" % (dropped, cap, msg),
                                       code=rc, text=_lib.strerror(rc))
        return self._error(rc, op_name(*what), PhaseError, detail=msg)

    def _combine_rank(self, y, h):
        """The combine of a rank-path dispatch: the rows given back read in stream order, the
        combined rows written into a fresh [num_tokens, hidden] tensor. Work.wait waits for the
        phase's done (its status)."""
        rp, T = self._rank, h.num_tokens
        what = ("combine", h.layer, h.step)
        if y.data_ptr() % 16:
            y = y.clone()
        out = torch.empty(T, h.hidden, dtype=h.dtype, device=y.device)
        c = _lib.RankCombine(h.rank_phase, y.data_ptr() if h.num_recv else 0,
                             out.data_ptr() if T else 0)
        try:
            k = self._rank_enqueue(rp, y, self._lib.rw_client_rank_combine, c, what)
        except RailWaveError as e:
            self._refuse_combine(e, h)  # fail the pair for every rank, then raise
        h.combined = True

        def finish(res):
            if self._open is h:
                self._open = None
            if res[0]:
                raise self._error(res[0], op_name(*what), PhaseError,
                                  detail=self._rank_detail(res[3]))
            return out

        w = self._pending = RankWork(self, k, what, finish, (), (y, out))
        return w

    def _check_combine(self, expert_out, handle):
        """Validate a combine's arguments (raises BadArgument naming what is wrong)."""
        if not isinstance(handle, Handle) or handle.group is not self:
            raise BadArgument("combine", "handle is not from a dispatch of this group")
        op = op_name("combine", handle.layer, handle.step)
        if handle.combined:
            raise BadArgument(op, "this handle was already combined")
        y = expert_out
        if not isinstance(y, torch.Tensor):
            raise BadArgumentType(op, "expert_out must be a torch.Tensor")
        if y.dtype != handle.dtype:
            raise BadArgumentType(op, "expert_out has dtype %s, the dispatch carried %s"
                                  % (y.dtype, handle.dtype))
        if tuple(y.shape) != (handle.num_recv, handle.hidden):
            raise BadArgument(op, "expert_out must be (received rows %d) × (hidden %d), got %s"
                              % (handle.num_recv, handle.hidden, tuple(y.shape)))
        if not y.is_contiguous():
            raise BadArgument(op, "expert_out is not contiguous (strides %s): call "
                              ".contiguous() first" % (tuple(y.stride()),))
        if y.device != handle.device:
            raise BadArgument(op, "expert_out is on %s, the dispatch on %s"
                              % (y.device, handle.device))

    def _submit_combine(self, expert_out: torch.Tensor, handle: Handle) -> Work:
        if self._c is None or self._pending is not None:
            self._check_usable()
        h, y = handle, expert_out
        try:
            ok = h.group is self and not h.combined and y.dtype == h.dtype and \
                y.shape == (h.num_recv, h.hidden) and y.device == h.device and \
                y.is_contiguous() and type(h) is Handle
        except AttributeError:
            ok = False
        if not ok:
            try:
                self._check_combine(expert_out, handle)
            except BadArgument as e:
                self._refuse_combine(e, handle)
        if h.recv_n is not None:
            return self._combine_static(y, h)
        if h.rank_phase:
            return self._combine_rank(y, h)
        n, T, H, dt = h.num_recv, h.num_tokens, h.hidden, h.dtype
        rb = H * y.element_size()
        s = self._csqe
        s.dtype, s.topk, s.layer, s.step = DTYPES[dt], h.topk, h.layer, h.step
        s.token_count, s.hidden, s.handle_id, s.n_experts = n, H, h.handle_id, h.n_experts
        none = _NONE
        keep = None
        order = None
        if y.is_cuda:
            order = self._stream_order(y.device)
            if order is None:
                torch.cuda.current_stream(y.device).synchronize()
            keep = y
            if n:
                b, o = self._cuda_span(y)
                s.tokens = _lib.Span(b, 0, o)
            else:
                s.tokens = none
            ob_t = self._cuda_out_buffer(max(T * rb, 1), y.device)
            if T:
                b, o = self._cuda_span(ob_t)
                s.output, s.output_capacity = _lib.Span(b, 0, o), T * rb
            else:
                s.output, s.output_capacity = none, 0
            finish, args = self._finish_combine_cuda, (h, ob_t, T, H, dt, rb)
        else:
            ib, ob = self._in, self._out
            if ib is None or ib.size < n * rb:
                ib = self._buffer("in", max(n * rb, 64))
            if ob is None or ob.size < T * rb:
                ob = self._buffer("out", max(T * rb, 64))
            if n:
                _memmove(ib.addr, y.data_ptr(), n * rb)
                s.tokens = ib.span
            else:
                s.tokens = none
            if T:
                s.output, s.output_capacity = ob.span, ob.size
            else:
                s.output, s.output_capacity = none, 0
            finish, args = self._finish_combine_host, (h, ob, T, H, dt, rb)
        return self._submit(s, self._csqe_ref, ("combine", h.layer, h.step), finish, args, keep,
                            order)

    def _refuse_combine(self, err: RailWaveError, handle: Any = None,
                        reason: int = _lib.RANK_ABORT_ARGUMENT) -> None:
        """Raise err, the reason this rank cannot give a pair's combine, after failing that pair
        for every rank, so that their combines fail at once: the pair of handle when it is one
        of this Group's dispatches not combined yet, else the open pair (eager), else the last
        static dispatch not combined. The ring path aborts it by its key (_abort_pair); the
        rank path by the combine's own slot, marked abort (_abort_rank: eager, static, and
        captured alike), so that the phase numbers and the stream's counters stay in step; a
        library without the abort leaves the group and joins again (_rejoin) instead."""
        h = None
        for c in (handle, self._open, self._static_due):
            if isinstance(c, Handle) and c.group is self and not c.combined:
                h = c
                break
        if h is not None and h.rank_phase:
            h.combined = True
            if self._open is h:
                self._open = None
            if not self._abort_rank(h, reason) and h.recv_n is None:
                try:
                    self._rejoin()
                except RailWaveError:  # the daemon gone: err is still the reason to give
                    pass
        elif h is not None:
            self._abort_pair()
        raise err

    def _abort_rank(self, h, reason: int) -> bool:
        """Give no combine for rank-path dispatch h: rw_client_rank_abort enqueues, in the
        combine's place on the current stream, a combine of h's key whose page slot is marked
        abort, with its words and no kernel. The daemon fails h's pair on every node while it
        waits for this rank ("local rank R: aborted its combine of layer L step S: ..."): every
        other rank's combine raises PeerFailed at once. Eager: its phase is waited for here (an
        error path). Static: the stream takes the phase's number and key from its counters as
        a combine would, so this rank's next call still meets the others'; outside a capture
        the stream is waited for and the abort's own failure read off the report (this rank
        raises err instead), what the report held before kept for check(). During a capture
        the abort is captured as the combine would have been: each replay fails its pair the
        same way, at once, and never leaves the others waiting (shapes and dtypes are fixed
        in a graph, so a call refused at capture would be refused at every replay). False:
        the library has no abort."""
        rp = self._rank
        if rp is None or not getattr(self._lib, "rank_abort", False):
            return False
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        try:
            if h.recv_n is not None and not capturing:
                self._static_hold()
            if not rp.host:
                rp.stream.handle = torch.cuda.current_stream(h.device).cuda_stream
            k = ctypes.c_uint64(0)
            if self._lib.rw_client_rank_abort(rp.rp, rp.stream_ref, h.rank_phase, reason,
                                              ctypes.byref(k)):
                return True  # the pair had ended, or the rank path is gone: nothing to fail
            if capturing:
                return True
            if h.recv_n is not None:
                rp.sync(torch, None if rp.host else h.device)
                rp.check()  # its own failure: this rank raises err instead
            else:
                deadline, wait = time.monotonic() + min(self.timeout, 30.0), CODES["RW_E_TIMEOUT"]
                while self._lib.rw_client_rank_wait(rp.rp, k.value, 100, None) == wait and \
                        time.monotonic() < deadline:
                    pass
            self._rank_detail("")  # and the daemon's notice of it is read
        except Exception:  # best effort: the caller raises the real error
            pass
        return True

    def _rejoin(self) -> None:
        """Leave the group and join again. The daemon fails the open pair for every rank (a rank
        that left it): how a rank-path rank fails a pair whose combine it cannot give (the
        ring's abort names the pair by a handle the rank path never sees). What was lent on the
        old connection (buffers, CUDA segments, the event, the rank page and slabs) goes with
        it; the rank path opens again at the next dispatch."""
        if self._order is not None:
            self._order.release()
            self._order = None
        if self._cuda is not None:
            self._cuda.release()
        if self._rank is not None:
            self._rank.close()
            self._rank = None
        self._lib.rw_client_close(self._c)
        self._c, self._in, self._out, self._cuda, self._cuda_out = None, None, None, None, None
        self._pending = None
        self._plans.clear()
        self._connect()
        self._rejoined = True

    def _combined(self, cqe, h):
        h.combined = True
        if self._open is h:
            self._open = None
        if cqe.status != _lib.CQ_OK:
            raise self._error(cqe.error, op_name("combine", h.layer, h.step), PhaseError)

    def _finish_combine_host(self, cqe, h, ob, T, H, dt, rb):
        self._combined(cqe, h)
        return _host.combine_result(h._plan, ob, T, H, dt, rb)

    def _finish_combine_cuda(self, cqe, h, ob_t, T, H, dt, rb):
        self._combined(cqe, h)
        return ob_t[:T * rb].view(dt).view(T, H).clone()
