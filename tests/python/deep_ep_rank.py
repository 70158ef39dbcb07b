"""One rank of tests/python/test_frameworks.py, started torchrun-style (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE). Reads one JSON command per line, answers one JSON line
({"ok": true, "log": [...]} or {"ok": false, "error": "..."}), like tests/python/moe_rank.py.

The ranks form a real torch.distributed gloo group (a FileStore), which is what
railwave.deep_ep.Buffer is given, as Megatron-Core gives DeepEP's. Every check compares this
rank's results with the same layer computed in this one process over every rank's tokens (the
workload is regenerated from the seed): integer-valued data, so fp32 and bf16 sums are exact."""
import os
import sys

import torch
import torch.distributed as dist

from railwave import deep_ep
from railwave.errors import BadArgument, BadArgumentType, RailWaveError
from railwave.layout import combine_rows, expert_major

torch.set_num_threads(1)
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
H, K = 16, 3
TOKENS = [11, 0, 7, 13, 5, 9]  # per rank (rank 1 dispatches nothing)


def workload(seed, E):
    """Every rank's (x, topk_idx int64 with -1 slots, topk_weights, output gradient); token 0 of
    every rank has no expert at all."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(WORLD):
        T = TOKENS[r % len(TOKENS)]
        x = torch.randint(-1, 2, (T, H), generator=g).float()
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.zeros(0, K, dtype=torch.int64)
        if T:
            idx[torch.rand(T, K, generator=g) < 0.15] = -1
            idx[0] = -1
        w = torch.randint(1, 3, (T, K), generator=g).float()
        gout = torch.randint(-2, 3, (T, H), generator=g).float()
        out.append((x, idx, w, gout))
    return out


def factor(ids):
    """The test's expert e multiplies its row by e + 1 (ids: global ids, -1 → 0)."""
    return torch.where(ids >= 0, ids + 1, torch.zeros_like(ids)).float()


def reference(x, idx, w, gout):
    """Output, grad x and grad topk_weights of out_t = Σ_k w_tk (e_tk + 1) x_t."""
    f = factor(idx)
    out = (w * f).sum(1, keepdim=True) * x
    gx = (w * f).sum(1, keepdim=True) * gout
    gw = f * (x * gout).sum(1, keepdim=True)
    return out, gx, gw


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def equal(a, b, what):
    a, b = a.float().cpu(), b.float().cpu()
    expect(a.shape == b.shape and torch.equal(a, b), "%s differs: shape %s vs %s, max |diff| %s"
           % (what, tuple(a.shape), tuple(b.shape),
              (a - b).abs().max().item() if a.shape == b.shape and a.numel() else "-"))


def raises(exc, needle, fn):
    try:
        fn()
    except exc as e:
        expect(needle in str(e), "%s raised %r, wanted it to name %r" % (exc.__name__, str(e),
                                                                          needle))
        return "%s: %s" % (type(e).__name__, str(e)[:90])
    raise AssertionError("no %s (wanted one naming %r)" % (exc.__name__, needle))


def join(c):
    os.environ["RAILWAVE_SOCKET"] = c["sockets"][RANK // int(os.environ["LOCAL_WORLD_SIZE"])]
    os.environ["RAILWAVE_DEEP_EP_GROUP"] = c["group"]
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="file://" + c["store"], rank=RANK,
                                world_size=WORLD)
    return deep_ep.Buffer(dist.group.WORLD, 0, 0, group_kwargs={"timeout": 120,
                                                                "max_tokens_per_rank": 16})


def check_dispatch(buf, c, E, dtype, data, log):
    """Layout, a fresh dispatch, the forward combine, the cached dispatch and the combine with
    topk_weights (Megatron-Core's forward and backward), each against the reference."""
    el = E // WORLD
    lo = RANK * el
    x, idx, w, gout = (t.clone() for t in data[RANK])
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(
        idx, E, previous_event=buf.capture(), async_finish=True)
    ev.current_stream_wait()
    valid = idx >= 0
    want_in = torch.zeros(idx.shape[0], WORLD, dtype=torch.bool)
    for t, k in valid.nonzero().tolist():
        want_in[t, int(idx[t, k]) // el] = True
    equal(in_rank, want_in, "is_token_in_rank")
    equal(per_rank, want_in.sum(0), "num_tokens_per_rank")
    equal(per_expert, torch.bincount(idx[valid], minlength=E), "num_tokens_per_expert")
    expect(per_rdma is None and per_rank.dtype == torch.int32 and in_rank.dtype == torch.bool,
           "layout dtypes")

    recv_x, recv_idx, recv_w, counts, h, ev = buf.dispatch(
        x.to(dtype), topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, expert_alignment=4)
    expect(ev.event is None, "async_finish=False returned an event")
    src_rank, src_tok = h.src_rank, h.src_token
    want_rows = [(r, t) for r in range(WORLD) for t in range(data[r][0].shape[0])
                 if ((data[r][1][t] >= lo) & (data[r][1][t] < lo + el)).any()]
    got_rows = list(zip(src_rank.tolist(), src_tok.tolist()))
    expect(got_rows == want_rows, "received tokens %s, wanted %s in (source rank, token) order"
           % (got_rows, want_rows))
    rx, ri, rw = data[0][0].new_zeros(0, H), [], []
    rows_x, rows_i, rows_w = [], [], []
    for r, t in zip(src_rank.tolist(), src_tok.tolist()):
        gi = data[r][1][t]
        mine = (gi >= lo) & (gi < lo + el)
        rows_x.append(data[r][0][t])
        rows_i.append(torch.where(mine, gi - lo, torch.full_like(gi, -1)))
        rows_w.append(data[r][2][t] * mine)
    if rows_x:
        rx, ri, rw = torch.stack(rows_x), torch.stack(rows_i), torch.stack(rows_w)
    else:
        ri, rw = torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K)
    equal(recv_x, rx, "recv_x")
    equal(recv_idx, ri, "recv_topk_idx")
    expect(recv_idx.dtype == torch.int64 and recv_w.dtype == torch.float32, "recv dtypes")
    equal(recv_w, rw, "recv_topk_weights")
    raw = torch.bincount(ri[ri >= 0], minlength=el)
    expect(counts == [(int(n) + 3) // 4 * 4 for n in raw], "num_recv_tokens_per_expert_list %s "
           "for raw counts %s with expert_alignment 4" % (counts, raw.tolist()))

    # The experts: row · Σ_k w (e + 1) over this rank's entries; forward combine.
    f = factor(torch.where(recv_idx >= 0, recv_idx + lo, recv_idx))
    y = ((recv_w * f).sum(1, keepdim=True) * recv_x.float()).to(dtype)
    out, cw, ev = buf.combine(y, h, previous_event=ev, async_finish=True)
    with ev:
        pass
    want_out, want_gx, want_gw = reference(x, idx, w, gout)
    equal(out, want_out, "combined x")
    expect(cw is None, "combined_topk_weights without topk_weights")

    # Backward as Megatron-Core runs it: combine's backward = cached dispatch of grad out...
    g_recv, n1, n2, n3, n4, _ = buf.dispatch(gout.to(dtype), handle=h)
    expect((n1, n2, n3, n4) == (None,) * 4, "cached dispatch returns Nones besides recv_x")
    equal(g_recv, torch.stack([data[r][3][t] for r, t in zip(src_rank.tolist(),
                                                            src_tok.tolist())])
          if rows_x else torch.zeros(0, H), "cached dispatch rows (in recv_x's order)")
    # ... dispatch's backward = combine of (grad recv_x, grad recv_topk_weights).
    g_rows = ((recv_w * f).sum(1, keepdim=True) * g_recv.float()).to(dtype)
    g_w = f * (recv_x.float() * g_recv.float()).sum(1, keepdim=True)
    if dtype == torch.bfloat16:
        g_w = g_w + 1.0 / 3  # not a bf16 number: the high/low split carries it
    gx, gw, _ = buf.combine(g_rows, h, topk_weights=g_w)
    equal(gx, want_gx, "grad x (combine of the cached pair)")
    if dtype == torch.float32:
        equal(gw, want_gw, "grad topk_weights")
    else:
        want = want_gw + (idx >= 0).float() / 3
        err = float((gw - want).abs().max()) if gw.numel() else 0.0
        expect(err <= 2 ** -14 * (1 + float(want.abs().max() if want.numel() else 0)),
               "bf16 grad topk_weights: max |diff| %g" % err)
    log.append("%s: layout, dispatch (%d rows, counts %s aligned to 4), combine, cached "
               "dispatch and weighted combine equal" % (str(dtype)[6:], h.num_recv_tokens, counts))


def cmd_buffer(c):
    E = c["experts"]
    log = []
    buf = join(c)
    data = workload(c["seed"], E)
    for dtype in (torch.float32, torch.bfloat16):
        check_dispatch(buf, c, E, dtype, data, log)

    # num_worst_tokens: rows padded, the list empty, combine takes the padded rows.
    x, idx, w, _ = data[RANK]
    worst = WORLD * max(d[0].shape[0] for d in data)
    recv_x, recv_idx, _, counts, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                     num_experts=E, num_worst_tokens=worst)
    n = h.num_recv_tokens
    expect(recv_x.shape[0] == worst and counts == [] and bool((recv_idx[n:] == -1).all()),
           "num_worst_tokens padding")
    out, _, _ = buf.combine(recv_x, h)
    want = torch.zeros_like(x)
    for r in range(WORLD):  # Σ over ranks that received the token: its count of hosting ranks
        el = E // WORLD
        hosted = ((idx >= r * el) & (idx < (r + 1) * el)).any(1)
        want += hosted.float().unsqueeze(1) * x
    equal(out, want, "combine of num_worst_tokens-padded rows")
    log.append("num_worst_tokens=%d: padded, combine equal" % worst)

    # A second Buffer (Megatron-Core makes one when its size hints grow) shares the group.
    b2 = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0)
    expect(b2.railwave_group is buf.railwave_group, "a second Buffer joined the group again")
    b2.destroy()
    buf.destroy()
    log.append("second Buffer shares the group")
    return log


def cmd_errors(c):
    """What RailWave cannot do raises Unsupported, bad arguments TypeError/ValueError, on every
    rank alike (nothing is submitted), and the Buffer serves on: a step after them is equal."""
    E = c["experts"]
    buf = join(c)
    data = workload(c["seed"], E)
    x, idx, w, _ = data[RANK]
    expect(issubclass(deep_ep.Unsupported, RailWaveError), "Unsupported is a RailWaveError")
    log = [
        raises(deep_ep.Unsupported, "low_latency_mode",
               lambda: deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True)),
        raises(deep_ep.Unsupported, "low_latency_dispatch", lambda: buf.low_latency_dispatch),
        raises(deep_ep.Unsupported, "FP8", lambda: buf.dispatch((x, x), topk_idx=idx,
                                                                num_experts=E)),
        raises(BadArgumentType, "int64", lambda: buf.get_dispatch_layout(idx.float(), E)),
        raises(BadArgument, "multiple of the group size",
               lambda: buf.get_dispatch_layout(idx, E + 1)),
        raises(BadArgument, "num_tokens_per_expert", lambda: buf.dispatch(x, topk_idx=idx,
                                                                         topk_weights=w)),
        raises(BadArgumentType, "handle must come from", lambda: buf.dispatch(x, handle=(1, 2))),
    ]
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    log += [
        raises(deep_ep.Unsupported, "after a cached dispatch",
               lambda: buf.combine(recv_x, h, topk_weights=torch.zeros(recv_x.shape[0], K))),
        raises(BadArgument, "rows", lambda: buf.combine(recv_x[:0] if recv_x.shape[0] else
                                                       torch.zeros(1, H), h)),
    ]
    out, _, _ = buf.combine(recv_x, h)
    expect(out.shape == x.shape, "combine after the errors")
    log.append("combine after the errors served")
    buf.destroy()
    return log


def cmd_ops(c):
    """railwave::dispatch / railwave::combine with autograd: a MoE step through the operators
    and the expert-major layout (alignment 4), output and gradients equal to the reference."""
    from railwave import ops
    E = c["experts"]
    el = E // WORLD
    buf = join(c)
    ops.use(buf)
    data = workload(c["seed"], E)
    log = []
    for step in range(2):
        x0, idx, w0, gout = data[RANK]
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        recv_x, recv_idx, recv_w, counts, hid = ops.dispatch(x, idx, w, E)
        rows, lay = expert_major(recv_x, recv_idx, recv_w, el, alignment=4)
        expect(bool((lay.counts % 4 == 0).all()) and torch.equal(
            lay.counts, (torch.bincount(recv_idx[recv_idx >= 0], minlength=el) + 3) // 4 * 4),
            "expert-major counts %s" % lay.counts.tolist())
        expect(torch.equal(counts, torch.bincount(recv_idx[recv_idx >= 0], minlength=el)),
               "num_recv_per_expert")
        # expert e (local) multiplies by its global id + 1: a per-row factor of the blocks
        fac = torch.repeat_interleave(torch.arange(el) + RANK * el + 1.0, lay.counts)
        y = ops.combine(combine_rows(rows * fac.unsqueeze(1), lay), hid)
        (y * gout).sum().backward()
        want_out, want_gx, want_gw = reference(x0, idx, w0, gout)
        equal(y.detach(), want_out, "ops output")
        equal(x.grad, want_gx, "ops grad x")
        equal(w.grad, want_gw, "ops grad topk_weights")
        log.append("ops step %d: output, grad x, grad topk_weights equal" % step)
    # The same step through Group.dispatch_expert_major / combine_expert_major (autograd).
    g = buf.railwave_group
    x0, idx, w0, gout = data[RANK]
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    rows, counts, lay, h = g.dispatch_expert_major(x, idx, w, E, alignment=8, layer=5)
    expect(bool((counts % 8 == 0).all()) and rows.shape[0] == int(counts.sum()),
           "Group.dispatch_expert_major counts %s for %d rows" % (counts.tolist(),
                                                                  rows.shape[0]))
    fac = torch.repeat_interleave(torch.arange(el) + RANK * el + 1.0, counts)
    y = g.combine_expert_major(rows * fac.unsqueeze(1), lay, h)
    (y * gout).sum().backward()
    want_out, want_gx, want_gw = reference(x0, idx, w0, gout)
    equal(y.detach(), want_out, "Group expert-major output")
    equal(x.grad, want_gx, "Group expert-major grad x")
    equal(w.grad, want_gw, "Group expert-major grad topk_weights")
    log.append("Group.dispatch_expert_major (alignment 8): output, grad x, grad topk_weights "
               "equal")
    with torch.no_grad():  # no backward: combine frees the handle
        x0, idx, w0, _ = data[RANK]
        recv_x, recv_idx, recv_w, _, hid = ops.dispatch(x0, idx, w0, E)
        rows, lay = expert_major(recv_x, recv_idx, recv_w, el)
        ops.combine(combine_rows(rows, lay), hid)
        expect(not ops._handles, "handles left after a no-grad step: %s" % list(ops._handles))
    log.append("no-grad step frees its handle; save list %s" % [str(o) for o in ops.save_list()])
    buf.destroy()
    return log


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import serve
    serve({"buffer": cmd_buffer, "errors": cmd_errors, "ops": cmd_ops})
