"""Expert-major layout of a dispatch's output: the rows of each local expert together, each
expert's block padded to a multiple of `alignment` rows (grouped GEMMs and FP8/MXFP8 kernels
want 8–256), and the way back to one row per received row for combine. Pure tensor code,
differentiable in the rows and the weights (used by Group.dispatch_expert_major and the
TorchTitan dispatcher, railwave/torchtitan.py). expert_major sizes its rows from the counts (a
host read); expert_major_static pads to a size fixed by the shapes (no host read)."""
import torch

from .errors import BadArgument


class ExpertMajor:
    """Where each (received row, local expert) entry sits in the expert-major rows.
    pos: its row there; src: the received row; weight: its top-k weight (fp32);
    counts: rows per local expert, padding included (int64); num_recv: received rows;
    valid: None, or (the static form) a bool per entry, False for the slots of no entry."""

    __slots__ = ("pos", "src", "weight", "counts", "num_recv", "num_rows", "valid")

    def __init__(self, pos, src, weight, counts, num_recv, num_rows, valid=None):
        self.pos, self.src, self.weight, self.counts = pos, src, weight, counts
        self.num_recv, self.num_rows, self.valid = num_recv, num_rows, valid


def expert_major(recv_x, recv_topk_idx, recv_topk_weights, num_local_experts, alignment=1):
    """(rows [R, hidden], ExpertMajor) for a dispatch's recv_x, recv_topk_idx (local expert ids,
    -1 elsewhere) and recv_topk_weights: one row per (received row, local expert) entry, expert
    0's first, in received order within an expert; padding rows are zero."""
    if not isinstance(alignment, int) or alignment < 1:
        raise BadArgument("expert_major", "alignment must be a positive int, got %r"
                          % (alignment,))
    dev = recv_x.device
    mask = recv_topk_idx >= 0
    rows_n, ks = mask.nonzero(as_tuple=True)
    experts = recv_topk_idx[rows_n, ks]
    experts, order = torch.sort(experts, stable=True)
    src = rows_n[order]
    weight = recv_topk_weights[rows_n, ks][order].float()
    counts = torch.bincount(experts, minlength=num_local_experts)[:num_local_experts]
    padded = (counts + alignment - 1) // alignment * alignment
    first = torch.cumsum(counts, 0) - counts         # entry index where each expert starts
    first_row = torch.cumsum(padded, 0) - padded     # output row where each expert starts
    pos = first_row[experts] + torch.arange(experts.numel(), device=dev) - first[experts]
    R = int(padded.sum())
    rows = recv_x.new_zeros(R, recv_x.shape[1]).index_copy(0, pos, recv_x[src])
    return rows, ExpertMajor(pos, src, weight, padded, recv_x.shape[0], R)


def static_rows(num_recv, topk, num_local_experts, alignment):
    """The rows of expert_major_static's layout for num_recv received rows: every entry of
    every row on this rank's experts (at most min(topk, experts) a row), plus each expert's
    padding to the alignment, rounded up to a multiple of it (a grouped GEMM may want the
    whole operand aligned, as each block is)."""
    n = num_recv * min(topk, num_local_experts) + num_local_experts * (alignment - 1)
    return (n + alignment - 1) // alignment * alignment


def expert_major_static(recv_x, recv_topk_idx, recv_topk_weights, num_local_experts,
                        alignment=1):
    """expert_major without a host read (sync-free, capturable): the rows' count is fixed by the
    shapes alone, static_rows(recv_x rows, topk, experts, alignment), whatever the routing.
    Expert 0's entries first, each expert's block padded with zero rows to a multiple of
    alignment and starting at one, then zero rows to the end; counts (int64 on the device) are
    the padded blocks, so a grouped GEMM's offsets (their cumulative sum) cover the entries and
    leave the tail out. Entries are found from recv_topk_idx (-1: none, as the rows past a
    static dispatch's received count carry)."""
    if not isinstance(alignment, int) or alignment < 1:
        raise BadArgument("expert_major", "alignment must be a positive int, got %r"
                          % (alignment,))
    dev, L = recv_x.device, num_local_experts
    N, K = recv_topk_idx.shape
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, L))  # no entry: sorts last
    key, order = torch.sort(key, stable=True)
    valid = key < L
    src = order // K
    weight = recv_topk_weights.reshape(-1)[order].float() * valid
    counts = torch.zeros(L + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, key, torch.ones_like(key))[:L]
    padded = (counts + alignment - 1) // alignment * alignment
    first = torch.cumsum(counts, 0) - counts
    first_row = torch.cumsum(padded, 0) - padded
    e = key.clamp(max=L - 1)
    R = static_rows(N, K, L, alignment)
    pos = torch.where(valid, first_row[e] + torch.arange(N * K, device=dev) - first[e],
                      torch.full_like(key, R))  # no entry: a row past the end, dropped
    rows = recv_x.new_zeros(R + 1, recv_x.shape[1]).index_copy(0, pos, recv_x[src])[:R]
    return rows, ExpertMajor(pos.clamp(max=R - 1), src, weight, padded, N, R, valid)


def combine_rows(expert_out, layout, weighted=True):
    """One row per received row: Σ over the row's local experts of (weight ×) that expert's
    output (expert_out: the expert-major rows' outputs, [R, hidden]). Weights multiply in fp32
    and round once to expert_out's dtype; the row's sum is in that dtype."""
    if expert_out.shape[0] != layout.num_rows:
        raise BadArgument("combine_rows", "expert_out has %d rows, the layout %d"
                          % (expert_out.shape[0], layout.num_rows))
    y = expert_out[layout.pos]
    if layout.valid is not None:  # the static form: the slots of no entry add nothing
        y = torch.where(layout.valid.unsqueeze(1), y, y.new_zeros(()))
    if weighted:
        y = (y.float() * layout.weight.unsqueeze(1)).to(expert_out.dtype)
    out = expert_out.new_zeros(layout.num_recv, expert_out.shape[1])
    return out.index_add(0, layout.src, y)
