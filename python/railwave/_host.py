"""Host (CPU) tensors through registered memfd buffers: the per-call path of railwave.Group for
them, kept to a few interpreter operations (docs/perf/python.md: each torch or numpy call costs
about a microsecond, so the cost of a call is the number of them, not its bytes).

A Group has two buffers, inputs and outputs, registered once and grown only when a phase needs
more. Everything a dispatch of one shape needs — offsets, the submission entry with its spans,
numpy views of the id and metadata regions, lookup tables from global expert id to local index —
is computed once into a DispatchPlan and reused while the shape, the buffers and the receive room
stay the same; a call then copies its inputs in (memmove), converts the ids, submits, and splits
the output (docs/dataflow.md "Dispatch output") with a handful of numpy operations."""
import ctypes

import numpy as np
import torch

from . import _lib

_memmove = ctypes.memmove
_min, _max = np.minimum.reduce, np.maximum.reduce
# numpy's dtype for the rows of a phase dtype (bfloat16 as its bits; torch views them back)
_NP_ROWS = {torch.float32: np.float32, torch.bfloat16: np.int16}


def align(n, a=16):
    return (n + a - 1) // a * a


def meta_bytes(topk):
    """Bytes of one dispatch-output metadata entry: src_node, src_rank, token, 0, ids, weights."""
    return 16 + 8 * topk


class HostBuf:
    """A memfd buffer lent to the daemon: mapped here at addr, viewed as numpy uint8/int32."""

    def __init__(self, group, size):
        buf, addr = ctypes.c_uint32(0), ctypes.c_void_p(0)
        rc = group._lib.rw_client_register_host(group._c, size, ctypes.byref(buf),
                                                ctypes.byref(addr))
        if rc:
            raise group._error(rc, "register a %d-byte host buffer" % size)
        self.id, self.size, self.addr = buf.value, size, addr.value
        self.np = np.frombuffer((ctypes.c_uint8 * size).from_address(addr.value), dtype=np.uint8)
        self.i32 = self.np.view(np.int32)
        self.span = _lib.Span(self.id, 0, 0)  # the whole buffer from offset 0


class DispatchPlan:
    """One dispatch shape (T tokens × hidden of dtype, top-k, E experts) on a Group's current
    buffers and receive room. sqe is the submission entry with everything but layer, step and
    phase id filled in."""

    __slots__ = ("T", "H", "K", "E", "dtype", "rb", "x_bytes", "ids_off", "ids_bytes", "w_off",
                 "idx64", "ids", "scratch", "scratch_addr", "in_addr", "out", "out_addr", "cap",
                 "counts_b", "rows", "meta", "lo", "el", "lut_loc", "lut_mine", "inline_counts",
                 "combined", "sqe", "sqe_ref")

    def __init__(self, group, x, topk_idx, E, ib, ob, counts_b):
        T, H = x.shape
        K = topk_idx.shape[1]
        self.T, self.H, self.K, self.E, self.dtype = T, H, K, E, x.dtype
        self.rb = rb = H * x.element_size()
        self.x_bytes = T * rb
        self.ids_off = align(T * rb)
        self.ids_bytes = T * K * 4
        self.w_off = self.ids_off + align(T * K * 4)
        self.idx64 = topk_idx.dtype == torch.int64
        self.ids = ib.i32[self.ids_off // 4:self.ids_off // 4 + T * K].reshape(T, K)
        # int64 ids land here first (one memmove; numpy then converts and checks them: cheaper
        # than torch operators on the caller's tensor)
        self.scratch = np.empty((T, K), dtype=np.int64)
        self.scratch_addr = self.scratch.ctypes.data
        self.in_addr, self.out, self.out_addr = ib.addr, ob, ob.addr
        self.counts_b = counts_b
        mb = meta_bytes(K)
        # The rows the daemon will use: what fits (rw_svc_out_layout in service/phase/phase.h).
        self.cap = cap = (ob.size - counts_b) // (rb + mb)
        meta_off = counts_b + cap * rb
        npd = _NP_ROWS[x.dtype]
        self.rows = ob.np[counts_b:meta_off].view(npd).reshape(cap, H)
        # the combine of this shape writes T rows at the buffer's start
        self.combined = ob.np[:T * rb].view(npd).reshape(T, H)
        self.meta = ob.i32[meta_off // 4:meta_off // 4 + cap * mb // 4].reshape(cap, mb // 4)
        W = group.world_size
        self.el = el = E // W
        self.lo = lo = group.rank * el
        # Global id (or -1, the last entry: numpy's take reads index -1 from the end) → local
        # expert index or -1, and → whether it is hosted here.
        self.lut_loc = np.full(E + 1, -1, dtype=np.int64)
        self.lut_loc[lo:lo + el] = np.arange(el)
        self.lut_mine = self.lut_loc >= 0
        self.inline_counts = group._cqe_counts[lo:lo + el] if E <= _lib.CQE_INLINE_COUNTS \
            else None
        none = _lib.Span(_lib.BUF_NONE, 0, 0)
        s = self.sqe = _lib.Sqe(kind=_lib.KIND_DISPATCH, dtype=group.DTYPES[x.dtype], topk=K,
                                token_count=T, hidden=H, n_experts=E,
                                output_capacity=ob.size)
        if T:
            s.tokens = _lib.Span(ib.id, 0, 0)
            s.topk_ids = _lib.Span(ib.id, 0, self.ids_off)
            s.topk_weights = _lib.Span(ib.id, 0, self.w_off)
        else:
            s.tokens = s.topk_ids = s.topk_weights = none
        s.output = _lib.Span(ob.id, 0, 0)
        self.sqe_ref = ctypes.byref(s)

    def put(self, x, topk_idx, topk_weights):
        """Copy one call's inputs into the input buffer. Returns None, or ((t, k), id) of the
        first top-k entry that is not an expert id; that entry is sent as one out of range for
        sure, so the daemon fails the phase for every rank. int32 ids go as they are: the daemon
        refuses the same ids (RW_E_TOKENS) and first_bad() names the entry then."""
        if not self.T:
            return None
        a = self.in_addr
        _memmove(a, x.data_ptr(), self.x_bytes)
        _memmove(a + self.w_off, topk_weights.data_ptr(), self.ids_bytes)
        if not self.idx64:
            _memmove(a + self.ids_off, topk_idx.data_ptr(), self.ids_bytes)
            return None
        src = self.scratch
        _memmove(self.scratch_addr, topk_idx.data_ptr(), 2 * self.ids_bytes)
        np.copyto(self.ids, src, casting="unsafe")
        if _min(src, axis=None) < -1 or _max(src, axis=None) >= self.E:  # before int32 wraps
            bad = (src < -1) | (src >= self.E)
            self.ids[bad] = 0x7FFFFFFF
            t, k = (int(v[0]) for v in np.nonzero(bad))
            return (t, k), int(src[t, k])
        return None

    def first_bad(self):
        """((t, k), id) of the first entry of the ids sent that is not an expert id, or None."""
        bad = (self.ids < -1) | (self.ids >= self.E)
        if not bad.any():
            return None
        t, k = (int(v[0]) for v in np.nonzero(bad))
        return (t, k), int(self.ids[t, k])

    def result(self, cqe, n):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_per_expert, Handle args) of a
        completed dispatch that delivered n rows."""
        K = self.K
        recv_x = tensor(self.rows[:n].copy(), self.dtype)
        meta = self.meta[:n]
        ids = meta[:, 4:4 + K]
        mine = self.lut_mine.take(ids)
        recv_w = meta[:, 4 + K:].view(np.float32) * mine
        if self.inline_counts is not None and cqe.counts_buf == _lib.BUF_NONE:
            counts = self.inline_counts.astype(np.int64)
        else:
            c0 = cqe.counts_offset // 4 + self.lo
            counts = self.out.i32[c0:c0 + self.el].astype(np.int64)
        return (recv_x, torch.from_numpy(self.lut_loc.take(ids)), torch.from_numpy(recv_w),
                torch.from_numpy(counts), meta[:, 1:3].copy(), mine)


def tensor(a, dtype):
    """A torch tensor of dtype owning numpy array a (a fresh copy the caller made)."""
    t = torch.from_numpy(a)
    return t if dtype is torch.float32 else t.view(dtype)


def combine_result(plan, ob, T, H, dtype, rb):
    """The T rows a combine left at the start of ob, as a fresh tensor."""
    if plan is not None and plan.out is ob:
        return tensor(plan.combined.copy(), dtype)
    out = torch.empty((T, H), dtype=dtype)
    if T:
        _memmove(out.data_ptr(), ob.addr, T * rb)
    return out
