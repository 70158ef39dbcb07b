"""railwave.Group: one trainer rank's membership of an expert-parallel group, served by its
node's railwaved through librailwave (docs/python.md is the contract; docs/dataflow.md "Dispatch
output" and "Combine" the daemon's side).

One operation is in flight per Group at a time (the daemon runs one dispatch/combine pair per
group: a combine needs its dispatch's handle, and the next dispatch closes the previous pair).
Host (CPU) tensors are copied into two memfd buffers registered once and grown when needed; CUDA
tensors are lent by IPC handle of their allocator segment (railwave._cuda). Returned tensors are
always fresh copies: they stay valid after the next operation and after close()."""
import ctypes
import os
import time

import numpy as np
import torch

from . import _lib
from .errors import (CODES, ConnectError, DaemonLost, PhaseError, RailWaveError, Timeout)

BACKWARD_LAYER = 1 << 31  # layer bit of the pairs autograd opens for a layer's backward

_DTYPES = {torch.float32: _lib.DTYPE_FP32, torch.bfloat16: _lib.DTYPE_BF16}


def _align(n, a=16):
    return (n + a - 1) // a * a


def _env_int(names, what):
    for name in names:
        v = os.environ.get(name)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise ValueError("railwave: %s=%r is not an integer (%s)" % (name, v, what))
    return None


class _HostBuf:
    """A memfd buffer lent to the daemon: mapped here at addr, viewed as numpy uint8/int32 (the
    per-call work on host tensors is memmove and numpy: a torch operator costs several µs each
    in the interpreter, numpy well under one, docs/perf/python.md)."""

    def __init__(self, group, size):
        buf, addr = ctypes.c_uint32(0), ctypes.c_void_p(0)
        rc = group._lib.rw_client_register_host(group._c, size, ctypes.byref(buf),
                                                ctypes.byref(addr))
        if rc:
            raise group._error(rc, "register a %d-byte host buffer" % size)
        self.id, self.size, self.addr = buf.value, size, addr.value
        self.np = np.frombuffer((ctypes.c_uint8 * size).from_address(addr.value), dtype=np.uint8)
        self.i32 = self.np.view(np.int32)


class Handle:
    """What a combine (and autograd) needs of a completed dispatch. Attributes: num_tokens (rows
    this rank dispatched), num_recv (rows it received), src_rank and src_token (int64 tensors
    [num_recv]: whose token each received row is), layer, step."""

    def __init__(self, group, handle_id, layer, step, dtype, hidden, topk, n_experts, num_tokens,
                 num_recv, src, local_mask, device):
        self.group, self.handle_id, self.layer, self.step = group, handle_id, layer, step
        self.dtype, self.hidden, self.topk, self.n_experts = dtype, hidden, topk, n_experts
        self.num_tokens, self.num_recv, self.device = num_tokens, num_recv, device
        self._src = src                # [num_recv, 2] (source rank, token), numpy or tensor
        self._local_mask = local_mask  # [num_recv, topk] bool: top-k entries hosted here
        self.combined = False
        # Set by autograd only (railwave/autograd.py): the dispatch's inputs for the backward
        # pair, whether topk_weights need a gradient, the open backward pair.
        self.topk_idx = self.topk_weights = None
        self.need_w_grad = False
        self.bwd = None

    def _tensor(self, a):
        return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))

    @property
    def src_rank(self):
        return self._tensor(self._src[:, 0]).to(torch.int64)

    @property
    def src_token(self):
        return self._tensor(self._src[:, 1]).to(torch.int64)

    @property
    def local_mask(self):
        return self._tensor(self._local_mask)

    def keys(self):
        """int64 [num_recv]: one key per received row, unique on this rank (src_rank, token)."""
        return self.src_rank * (1 << 32) + self.src_token


class Work:
    """An operation in flight (async_op=True). wait() returns what the synchronous call would
    have returned, or raises its error; done() says, without blocking, whether wait() would."""

    def __init__(self, group, phase_id, op, finish, keep):
        self.group, self.phase_id, self.op = group, phase_id, op
        self._finish, self._keep = finish, keep  # keep: tensors the daemon reads until done
        self._cqe, self._result, self._exc = None, None, None

    def done(self):
        if self._cqe is None and self._exc is None and self._result is None:
            self._cqe = self.group._reap(self, block=False)
        return self._cqe is not None or self._result is not None or self._exc is not None

    def wait(self, timeout=None):
        if self._result is None and self._exc is None:
            cqe = self._cqe or self.group._reap(self, block=True, timeout=timeout)
            self.group._pending, self._keep = None, None
            try:
                self._result = self._finish(cqe)
            except Exception as e:  # kept: a second wait() raises the same
                self._exc = e
        if self._exc is not None:
            raise self._exc
        return self._result


class Group:
    """Join expert-parallel group `name` as `rank` of `world_size` through this node's railwaved.

    Unset arguments come from the environment torchrun and Slurm set: rank ← RANK (SLURM_PROCID),
    world_size ← WORLD_SIZE (SLURM_NTASKS), socket ← RAILWAVE_SOCKET (else the daemon's default
    /run/railwave/railwaved.sock), node ← RAILWAVE_NODE, else rank // LOCAL_WORLD_SIZE
    (SLURM_NTASKS_PER_NODE), else SLURM_NODEID / GROUP_RANK; local_gpu (the GPU index the daemon
    logs and keeps unique per group) ← LOCAL_RANK (SLURM_LOCALID) when torch sees CUDA, else -1. max_recv_tokens bounds the rows one dispatch may deliver to this
    rank (default world_size × the most tokens this rank dispatched so far). timeout (seconds)
    bounds every wait for the daemon; spin_us is how long a wait busy-polls before sleeping
    (RAILWAVE_SPIN_US)."""

    def __init__(self, name, rank=None, world_size=None, socket=None, *, node=None,
                 local_gpu=None, max_recv_tokens=None, timeout=300.0, spin_us=None):
        self._c = None
        if rank is None:
            rank = _env_int(["RANK", "SLURM_PROCID"], "this process's rank")
        if world_size is None:
            world_size = _env_int(["WORLD_SIZE", "SLURM_NTASKS"], "ranks in the job")
        if rank is None or world_size is None:
            raise ValueError("railwave: Group(%r) needs rank and world_size (arguments, or RANK "
                             "and WORLD_SIZE as torchrun sets them)" % (name,))
        if not (0 <= rank < world_size):
            raise ValueError("railwave: rank %d is not in [0, world_size %d)" % (rank, world_size))
        if node is None:
            node = _env_int(["RAILWAVE_NODE"], "this node's index")
        if node is None:
            per = _env_int(["LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"], "ranks per node")
            node = rank // per if per else _env_int(["SLURM_NODEID", "GROUP_RANK"], "node index")
        if node is None:
            raise ValueError("railwave: cannot tell rank %d's node: pass node= or set "
                             "LOCAL_WORLD_SIZE (torchrun does) or RAILWAVE_NODE" % rank)
        if local_gpu is None:
            local_gpu = _env_int(["LOCAL_RANK", "SLURM_LOCALID"], "local rank") \
                if torch.cuda.is_available() else None
            local_gpu = -1 if local_gpu is None else local_gpu
        self.socket = socket or os.environ.get("RAILWAVE_SOCKET") or _lib.DEFAULT_SOCKET
        self.name, self.rank, self.world_size, self.node = name, rank, world_size, node
        self.timeout = float(timeout)
        if spin_us is None:
            spin_us = _env_int(["RAILWAVE_SPIN_US"], "busy-poll microseconds")
        self.spin = (50 if spin_us is None else spin_us) * 1e-6
        self.max_recv_tokens = max_recv_tokens
        self._lib = _lib.load()
        opts = self._opts = _lib.Opts()
        self._opts_bytes = (self.socket.encode(), name.encode())  # what opts' pointers point at
        opts.socket_path, opts.group = self._opts_bytes
        opts.rank, opts.world_size, opts.node, opts.local_gpu = rank, world_size, node, local_gpu
        opts.timeout_ms = int(min(self.timeout, 60.0) * 1000)
        self._connect()
        self._open = None  # the handle of the dispatch whose combine is due, if any
        self._in = self._out = None
        self._cuda = None
        self._cuda_out = None
        self._pending = None
        self._phase_id = 0
        self._auto_step = {}
        self._max_tokens = 0
        self._cqe = _lib.Cqe()  # the one completion buffer (one operation in flight)
        self._cqe_counts = np.frombuffer(self._cqe.counts, dtype=np.uint32)

    # ---- lifetime ------------------------------------------------------------------------
    def _connect(self, retry_s=0.0):
        """Join (hello, rings). retry_s: keep retrying RW_E_RANK_DUP that long (a rejoin may
        reach the daemon before it has let the previous connection of this rank go)."""
        c = ctypes.c_void_p(0)
        deadline = time.monotonic() + retry_s
        while True:
            rc = self._lib.rw_client_connect(ctypes.byref(self._opts), ctypes.byref(c))
            if rc != CODES["RW_E_RANK_DUP"] or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if rc:
            raise ConnectError(rc, "join group %r as rank %d of %d (node %d) at %s"
                               % (self.name, self.rank, self.world_size, self.node, self.socket))
        self._c = c

    def _abort_pair(self):
        """Fail the group's open pair for every rank now, by leaving and joining again: a rank
        that leaves fails its group's open pair on every node at once (docs/dataflow.md
        "Failures"). Used when this rank cannot give its combine, so that the others are told
        at once instead of at the daemon's phase timeout. Buffers are registered anew."""
        if self._open is not None:
            self._open.combined = True
            self._open = None
        self.close()
        self._connect(retry_s=min(self.timeout, 10.0))

    def close(self):
        """Leave the group: every buffer is released and the connection closed. An operation
        still in flight is abandoned (the daemon fails that phase for the group). Idempotent."""
        if self._c is None:
            return
        if self._cuda is not None:
            self._cuda.release()
        self._lib.rw_client_close(self._c)
        self._c, self._in, self._out, self._cuda, self._cuda_out = None, None, None, None, None
        self._pending = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return "railwave.Group(%r, rank=%d, world_size=%d, node=%d, socket=%r%s)" % (
            self.name, self.rank, self.world_size, self.node, self.socket,
            "" if self._c is not None else ", closed")

    # ---- public operations -----------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, num_experts, layer=0, step=None,
                 async_op=False):
        """Send each token row of x (T × hidden, fp32 or bf16, contiguous) to the ranks hosting
        its top-k experts (topk_idx T × k int32/int64, -1 = none; topk_weights T × k fp32).
        Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_per_expert, handle):
        recv_x: rows received (N × hidden, in no promised order); recv_topk_idx (int64 N × k):
        the row's experts as this rank's local expert index, -1 where not hosted here;
        recv_topk_weights (fp32 N × k, 0 where not hosted here); num_recv_per_expert (int64
        [num_experts / world_size]); handle for combine(). Differentiable in x and topk_weights
        (autograd). async_op=True returns a Work (not differentiable). step=None numbers this
        layer's calls 0, 1, 2, ... (every rank must make the same calls)."""
        grad = torch.is_grad_enabled() and (getattr(x, "requires_grad", False) or
                                            getattr(topk_weights, "requires_grad", False))
        if grad and not async_op:
            from . import autograd
            return autograd.dispatch(self, x, topk_idx, topk_weights, num_experts, layer, step)
        work = self._submit_dispatch(x, topk_idx, topk_weights, num_experts, layer, step)
        return work if async_op else work.wait()

    def combine(self, expert_out, handle, async_op=False):
        """Sum each received row's output back into its token's position on the rank that sent
        it. expert_out: one row per received row, in recv_x's order (N × hidden, the dispatch's
        dtype), already reduced over this rank's experts (Σ weight × expert(x) over the row's
        local experts). Returns the combined T × hidden tensor. Differentiable in expert_out."""
        if torch.is_grad_enabled() and getattr(expert_out, "requires_grad", False) and not async_op:
            from . import autograd
            return autograd.combine(expert_out, handle)
        work = self._submit_combine(expert_out, handle)
        return work if async_op else work.wait()

    # ---- internals -------------------------------------------------------------------------
    def _error(self, code, op, cls=RailWaveError):
        msg = self._lib.rw_client_last_message(self._c).decode() if self._c else ""
        if code == CODES["RW_E_CLOSED"]:
            cls = DaemonLost
        return cls(code, "%s [group %r rank %d]" % (op, self.name, self.rank), msg)

    def _check_usable(self):
        if self._c is None:
            raise RuntimeError("railwave: %r is closed" % self)
        if self._pending is not None:
            raise RuntimeError("railwave: %s is still in flight on group %r: wait() for it first"
                               % (self._pending.op, self.name))

    def _key(self, layer, step):
        if not isinstance(layer, int) or not 0 <= layer < BACKWARD_LAYER:
            raise ValueError("railwave: layer must be an int in [0, 2^31), got %r" % (layer,))
        if step is None:
            step = self._auto_step.get(layer, 0)
            self._auto_step[layer] = step + 1
        if not isinstance(step, int) or not 0 <= step < 1 << 64:
            raise ValueError("railwave: step must be a non-negative int, got %r" % (step,))
        return layer, step

    def _buffer(self, which, nbytes):
        """The host buffer `which` ('in' or 'out'), at least nbytes, registered once and grown
        (re-registered, the old one released) only when a phase needs more."""
        cur = getattr(self, "_" + which)
        if cur is None or cur.size < nbytes:
            size = max(nbytes, 2 * cur.size if cur else 0, 1 << 16)
            size = _align(size, 4096)
            new = _HostBuf(self, size)
            if cur is not None:
                self._lib.rw_client_deregister(self._c, cur.id)
            setattr(self, "_" + which, new)
            cur = new
        return cur

    def _cuda_span(self, t):
        if self._cuda is None:
            from ._cuda import CudaRegistry
            self._cuda = CudaRegistry(self._c, self._lib)
        return self._cuda.span(t)

    def _cuda_out_buffer(self, nbytes, device):
        t = self._cuda_out
        if t is None or t.numel() < nbytes or t.device != device:
            size = _align(max(nbytes, 2 * (t.numel() if t is not None else 0), 1 << 16), 4096)
            self._cuda_out = torch.empty(size, dtype=torch.uint8, device=device)
        return self._cuda_out

    def _submit(self, sqe, op, finish, keep):
        self._phase_id += 1
        sqe.phase_id = self._phase_id
        rc = self._lib.rw_client_submit(self._c, ctypes.byref(sqe), 1)
        if rc:
            raise self._error(rc, "submit " + op)
        self._pending = Work(self, self._phase_id, op, finish, keep)
        return self._pending

    def _reap(self, work, block, timeout=None):
        """The completion of `work` (Cqe copy), or None when not blocking and none is there."""
        lib, c, cqe = self._lib, self._c, self._cqe
        if c is None:
            raise RuntimeError("railwave: %r is closed" % self)
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        spin_end = time.perf_counter() + self.spin
        while True:
            n = lib.rw_client_poll(c, ctypes.byref(cqe), 1)
            if n == 0 and not block:
                n = lib.rw_client_wait(c, ctypes.byref(cqe), 1, 0)  # notices a dead daemon
                if n == 0:
                    return None
            while n == 0:
                if time.perf_counter() < spin_end:
                    n = lib.rw_client_poll(c, ctypes.byref(cqe), 1)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(CODES["RW_E_TIMEOUT"], work.op,
                                  "no completion from railwaved in %.1f s (the operation is "
                                  "still in flight: wait() again or close())" % limit)
                n = lib.rw_client_wait(c, ctypes.byref(cqe), 1, int(min(left, 1.0) * 1000) + 1)
            if n < 0:
                raise self._error(n, work.op)
            if cqe.phase_id == work.phase_id:
                return cqe  # one operation in flight: read by its finish before the next reap
            # A completion of something abandoned earlier (e.g. after a Timeout): not ours.

    def _poison(self, layer, step, num_experts):
        """Fail this (layer, step) for the whole group at once: a one-row dispatch whose expert
        id is out of range, which the daemon refuses for every rank of every node
        (docs/dataflow.md "Gather"). Used when this rank's own arguments are wrong, so the
        other ranks get RW_E_PHASE now instead of waiting for the daemon's phase timeout."""
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
            w = self._submit(sqe, "refuse dispatch layer %d step %d" % (layer, step),
                             lambda cqe: None, None)
            w.wait(timeout=min(self.timeout, 30.0))
        except Exception:
            self._pending = None  # best effort: the caller raises the real error

    def _check_dispatch(self, x, topk_idx, topk_weights, num_experts):
        if not isinstance(x, torch.Tensor):
            raise TypeError("railwave: dispatch: x must be a torch.Tensor, got %s" % type(x).__name__)
        if x.dtype not in _DTYPES:
            raise TypeError("railwave: dispatch: x has dtype %s; railwaved carries float32 and "
                            "bfloat16 rows" % x.dtype)
        if x.dim() != 2 or x.shape[1] < 1:
            raise ValueError("railwave: dispatch: x must be 2-D (tokens × hidden), got shape %s"
                             % (tuple(x.shape),))
        for n, t, dts in (("topk_idx", topk_idx, (torch.int32, torch.int64)),
                          ("topk_weights", topk_weights, (torch.float32,))):
            if not isinstance(t, torch.Tensor):
                raise TypeError("railwave: dispatch: %s must be a torch.Tensor" % n)
            if t.dtype not in dts:
                raise TypeError("railwave: dispatch: %s has dtype %s, expected %s"
                                % (n, t.dtype, " or ".join(str(d) for d in dts)))
            if t.dim() != 2 or t.shape[0] != x.shape[0] or t.shape[1] < 1:
                raise ValueError("railwave: dispatch: %s must be (tokens %d) × topk, got %s"
                                 % (n, x.shape[0], tuple(t.shape)))
            if t.device != x.device:
                raise ValueError("railwave: dispatch: %s is on %s, x on %s" % (n, t.device, x.device))
        if topk_idx.shape[1] != topk_weights.shape[1]:
            raise ValueError("railwave: dispatch: topk_idx has %d columns, topk_weights %d"
                             % (topk_idx.shape[1], topk_weights.shape[1]))
        for n, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not t.is_contiguous():
                raise ValueError("railwave: dispatch: %s is not contiguous (strides %s): call "
                                 ".contiguous() first" % (n, tuple(t.stride())))
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError("railwave: dispatch: tensors on %s; CPU and CUDA are supported"
                             % x.device)
        if not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError("railwave: dispatch: num_experts must be a positive int, got %r"
                             % (num_experts,))

    def _submit_dispatch(self, x, topk_idx, topk_weights, num_experts, layer, step):
        self._check_usable()
        layer, step = self._key(layer, step)
        return self._dispatch_key(x, topk_idx, topk_weights, num_experts, layer, step)

    def _dispatch_key(self, x, topk_idx, topk_weights, num_experts, layer, step):
        op = "dispatch layer %d step %d" % (layer & ~BACKWARD_LAYER, step) + \
            (" (backward)" if layer & BACKWARD_LAYER else "")
        try:
            self._check_dispatch(x, topk_idx, topk_weights, num_experts)
        except (TypeError, ValueError):
            self._poison(layer, step, num_experts)
            raise
        T, H = x.shape
        K = topk_idx.shape[1]
        dt, cuda = x.dtype, x.is_cuda
        E, W = num_experts, self.world_size
        rb, mb = H * x.element_size(), 16 + 8 * K
        self._max_tokens = max(self._max_tokens, T)
        cap = self.max_recv_tokens or W * max(self._max_tokens, 1)
        cap = _align(cap, 8)  # keeps the metadata 16-byte aligned for any row size
        counts_b = _align(4 * E) if E > _lib.CQE_INLINE_COUNTS else 0
        out_bytes = counts_b + cap * (rb + mb)
        el = E // W
        lo = self.rank * el
        sqe = _lib.Sqe(kind=_lib.KIND_DISPATCH, dtype=_DTYPES[dt], topk=K, layer=layer, step=step,
                       token_count=T, hidden=H, n_experts=E)
        if not T:
            sqe.tokens = sqe.topk_ids = sqe.topk_weights = _lib.Span(_lib.BUF_NONE, 0, 0)
        # An id that is not an expert goes out as one that is out of range for sure, so the
        # daemon fails the phase for every rank at once; this rank then raises naming it.
        first_bad = None
        if cuda:
            keep, ob_t, first_bad = self._dispatch_cuda_inputs(sqe, x, topk_idx, topk_weights, E,
                                                               out_bytes)
        else:
            keep = None
            ids_off = _align(T * rb)
            w_off = ids_off + _align(T * K * 4)
            ib = self._buffer("in", max(w_off + T * K * 4, 64))
            ob = self._buffer("out", out_bytes)
            if T:
                ctypes.memmove(ib.addr, x.data_ptr(), T * rb)
                mn, mx = torch.aminmax(topk_idx)  # one pass; a torch call, not two numpy ones
                dst = ib.i32[ids_off // 4:ids_off // 4 + T * K]
                if topk_idx.dtype == torch.int32:
                    ctypes.memmove(ib.addr + ids_off, topk_idx.data_ptr(), T * K * 4)
                else:
                    dst[:] = topk_idx.numpy().reshape(-1)
                if mn.item() < -1 or mx.item() >= E:
                    src = topk_idx.numpy()
                    bad = (src < -1) | (src >= E)
                    t, k = (int(v[0]) for v in np.nonzero(bad))
                    first_bad = ((t, k), int(src[t, k]))
                    dst[bad.reshape(-1)] = 0x7FFFFFFF
                ctypes.memmove(ib.addr + w_off, topk_weights.data_ptr(), T * K * 4)
                sqe.tokens = _lib.Span(ib.id, 0, 0)
                sqe.topk_ids = _lib.Span(ib.id, 0, ids_off)
                sqe.topk_weights = _lib.Span(ib.id, 0, w_off)
            sqe.output = _lib.Span(ob.id, 0, 0)
            sqe.output_capacity = ob.size
            cap = (ob.size - counts_b) // (rb + mb)  # what the daemon will use (rw_svc_out_layout)
        meta_off = counts_b + cap * rb

        def fail(cqe):
            if first_bad is not None:
                (t, k), v = first_bad
                raise ValueError(
                    "railwave: %s: topk_idx[%d, %d] = %d is not an expert id (valid: -1 for "
                    "none, 0..%d); the daemon failed this phase on every rank (%s)"
                    % (op, t, k, v, E - 1, _lib.strerror(cqe.error)))
            if cqe.error == CODES["RW_E_RANGE"]:
                raise PhaseError(cqe.error, "%s [group %r rank %d]" % (op, self.name, self.rank),
                                 "receive capacity %d rows" % cap)
            raise self._error(cqe.error, op, PhaseError)

        def finish_host(cqe):
            if cqe.status != _lib.CQ_OK:
                fail(cqe)
            n = cqe.recv_tokens
            if n > cap:
                raise RailWaveError(CODES["RW_E_BADREPLY"], op,
                                    "%d rows received into room for %d" % (n, cap))
            recv_x = torch.empty((n, H), dtype=dt)
            if n:
                ctypes.memmove(recv_x.data_ptr(), ob.addr + counts_b, n * rb)
            meta = ob.i32[meta_off // 4:meta_off // 4 + n * (4 + 2 * K)].reshape(n, 4 + 2 * K)
            loc = meta[:, 4:4 + K].astype(np.int64)
            loc -= lo
            mine = loc.view(np.uint64) < el      # unsigned: negative ids (none, others') fail
            np.putmask(loc, ~mine, -1)
            recv_w = meta[:, 4 + K:].view(np.float32) * mine
            if cqe.counts_buf == _lib.BUF_NONE:
                counts = torch.from_numpy(self._cqe_counts[lo:lo + el].astype(np.int64))
            else:
                c0 = cqe.counts_offset // 4 + lo
                counts = torch.from_numpy(ob.i32[c0:c0 + el].astype(np.int64))
            h = self._open = Handle(self, cqe.handle_id, layer, step, dt, H, K, E, T, n,
                                    meta[:, 1:3].copy(), mine, x.device)
            return recv_x, torch.from_numpy(loc), torch.from_numpy(recv_w), counts, h

        def finish_cuda(cqe):
            if cqe.status != _lib.CQ_OK:
                fail(cqe)
            n = cqe.recv_tokens
            if n > cap:
                raise RailWaveError(CODES["RW_E_BADREPLY"], op,
                                    "%d rows received into room for %d" % (n, cap))
            recv_x = ob_t[counts_b:counts_b + n * rb].view(dt).view(n, H).clone()
            meta = ob_t[meta_off:meta_off + n * mb].view(torch.int32).view(n, 4 + 2 * K)
            ids = meta[:, 4:4 + K].to(torch.int64)
            loc = ids - lo
            mine = (loc >= 0) & (loc < el)
            recv_idx = torch.where(mine, loc, torch.full_like(loc, -1))
            recv_w = meta[:, 4 + K:].view(torch.float32) * mine
            if cqe.counts_buf == _lib.BUF_NONE:
                counts = torch.tensor(cqe.counts[lo:lo + el], dtype=torch.int64, device=x.device)
            else:
                co = cqe.counts_offset
                counts = ob_t[co + 4 * lo:co + 4 * (lo + el)].view(torch.int32).to(torch.int64)
            h = self._open = Handle(self, cqe.handle_id, layer, step, dt, H, K, E, T, n,
                                    meta[:, 1:3].to(torch.int64), mine, x.device)
            return recv_x, recv_idx, recv_w, counts, h

        return self._submit(sqe, op, finish_cuda if cuda else finish_host, keep)

    def _dispatch_cuda_inputs(self, sqe, x, topk_idx, topk_weights, E, out_bytes):
        """Spans of a CUDA dispatch: the tensors' own memory (by segment), ids converted to
        int32 on the device, the output in the Group's CUDA buffer. Returns (tensors to keep
        alive until the completion, the output buffer, first bad id or None)."""
        bad = (topk_idx < -1) | (topk_idx >= E)
        first_bad = None
        idx32 = topk_idx.to(torch.int32)
        if bool(bad.any()):
            t, k = bad.nonzero()[0].tolist()
            first_bad = ((t, k), int(topk_idx[t, k]))
            idx32 = idx32.masked_fill(bad, 0x7FFFFFFF)
        torch.cuda.current_stream(x.device).synchronize()  # inputs complete (railwave.h)
        if x.shape[0]:
            for name, t in (("tokens", x), ("topk_ids", idx32), ("topk_weights", topk_weights)):
                b, o = self._cuda_span(t)
                setattr(sqe, name, _lib.Span(b, 0, o))
        ob_t = self._cuda_out_buffer(out_bytes, x.device)
        b, o = self._cuda_span(ob_t)
        sqe.output = _lib.Span(b, 0, o)
        sqe.output_capacity = out_bytes
        return (x, idx32, topk_weights), ob_t, first_bad

    def _check_combine(self, expert_out, handle):
        """Validate a combine's arguments; returns its op name."""
        if not isinstance(handle, Handle) or handle.group is not self:
            raise ValueError("railwave: combine: handle is not from a dispatch of this group")
        op = "combine layer %d step %d" % (handle.layer & ~BACKWARD_LAYER, handle.step) + \
            (" (backward)" if handle.layer & BACKWARD_LAYER else "")
        if handle.combined:
            raise ValueError("railwave: %s: this handle was already combined" % op)
        y = expert_out
        if not isinstance(y, torch.Tensor):
            raise TypeError("railwave: %s: expert_out must be a torch.Tensor" % op)
        if y.dtype != handle.dtype:
            raise TypeError("railwave: %s: expert_out has dtype %s, the dispatch carried %s"
                            % (op, y.dtype, handle.dtype))
        if tuple(y.shape) != (handle.num_recv, handle.hidden):
            raise ValueError("railwave: %s: expert_out must be (received rows %d) × (hidden %d), "
                             "got %s" % (op, handle.num_recv, handle.hidden, tuple(y.shape)))
        if not y.is_contiguous():
            raise ValueError("railwave: %s: expert_out is not contiguous (strides %s): call "
                             ".contiguous() first" % (op, tuple(y.stride())))
        if y.device != handle.device:
            raise ValueError("railwave: %s: expert_out is on %s, the dispatch on %s"
                             % (op, y.device, handle.device))
        return op

    def _submit_combine(self, expert_out, handle):
        self._check_usable()
        try:
            op = self._check_combine(expert_out, handle)
        except (TypeError, ValueError):
            if self._open is not None:
                self._abort_pair()
            raise
        y = expert_out
        n, T, H, dt = handle.num_recv, handle.num_tokens, handle.hidden, handle.dtype
        rb = H * y.element_size()
        sqe = _lib.Sqe(kind=_lib.KIND_COMBINE, dtype=_DTYPES[dt], topk=handle.topk,
                       layer=handle.layer, step=handle.step, token_count=n, hidden=H,
                       handle_id=handle.handle_id, n_experts=handle.n_experts)
        none = _lib.Span(_lib.BUF_NONE, 0, 0)
        sqe.topk_ids = sqe.topk_weights = none
        keep = None
        if y.is_cuda:
            torch.cuda.current_stream(y.device).synchronize()
            keep = y
            if n:
                b, o = self._cuda_span(y)
                sqe.tokens = _lib.Span(b, 0, o)
            else:
                sqe.tokens = none
            ob_t = self._cuda_out_buffer(max(T * rb, 1), y.device)
            if T:
                b, o = self._cuda_span(ob_t)
                sqe.output, sqe.output_capacity = _lib.Span(b, 0, o), T * rb
            else:
                sqe.output, sqe.output_capacity = none, 0
        else:
            ib = self._buffer("in", max(n * rb, 64))
            ob = self._buffer("out", max(T * rb, 64))
            if n:
                ctypes.memmove(ib.addr, y.data_ptr(), n * rb)
                sqe.tokens = _lib.Span(ib.id, 0, 0)
            else:
                sqe.tokens = none
            if T:
                sqe.output, sqe.output_capacity = _lib.Span(ob.id, 0, 0), ob.size
            else:
                sqe.output, sqe.output_capacity = none, 0
            ob_t = None

        def finish(cqe):
            handle.combined = True
            if self._open is handle:
                self._open = None
            if cqe.status != _lib.CQ_OK:
                raise self._error(cqe.error, op, PhaseError)
            if ob_t is not None:
                return ob_t[:T * rb].view(dt).view(T, H).clone()
            out = torch.empty((T, H), dtype=dt)
            if T:
                ctypes.memmove(out.data_ptr(), ob.addr, T * rb)
            return out

        return self._submit(sqe, op, finish, keep)
