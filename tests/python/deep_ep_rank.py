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
from railwave.errors import (BackwardMismatch, BadArgument, BadArgumentType, PhaseError,
                             RailWaveError, ReceiveRoomExceeded)
from railwave.layout import combine_rows, expert_major, expert_major_static, static_rows

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


def join(c, static=False):
    os.environ["RAILWAVE_SOCKET"] = c["sockets"][RANK // int(os.environ["LOCAL_WORLD_SIZE"])]
    os.environ["RAILWAVE_DEEP_EP_GROUP"] = c["group"]
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="file://" + c["store"], rank=RANK,
                                world_size=WORLD)
    if static:  # as a launcher would ask for it (docs/python.md "Environment")
        os.environ["RAILWAVE_STATIC"] = "1"
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

    # x requiring grad says the dispatch has a backward (Megatron-Core's FusedDispatch): the
    # cached dispatch leaves the backward pair open for the combine with topk_weights.
    recv_x, recv_idx, recv_w, counts, h, ev = buf.dispatch(
        x.to(dtype).detach().requires_grad_(), topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
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


def identity_combined(data, E):
    """What combine of the received rows themselves (identity experts) gives each token of
    this rank: x times the number of ranks hosting one of its experts."""
    x, idx = data[RANK][0], data[RANK][1]
    el = E // WORLD
    hosts = sum(((idx >= r * el) & (idx < (r + 1) * el)).any(1).float() for r in range(WORLD))
    return hosts.unsqueeze(1) * x if x.shape[0] else x.clone()


def check_frozen(buf, E, data, log):
    """A dispatch of tensors that need no gradient (a frozen router over frozen inputs) has no
    backward: the cached dispatch (combine's backward) must end the backward pair itself, on
    every rank, and a combine with the handle after it is refused."""
    x, idx, w, gout = data[RANK]
    g = buf.railwave_group
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    out, _, _ = buf.combine(recv_x, h)
    equal(out, identity_combined(data, E), "frozen: combine")
    g_recv = buf.dispatch(gout, handle=h)[0]
    equal(g_recv, torch.stack([data[r][3][t] for r, t in zip(h.src_rank.tolist(),
                                                              h.src_token.tolist())])
          if h.num_recv_tokens else torch.zeros(0, H), "frozen: cached dispatch rows")
    expect(g._open is None, "frozen: the cached dispatch left the backward pair open (the "
           "group's open pair is %s)" % (g._open and (g._open.layer, g._open.step),))
    log.append("frozen dispatch: the cached dispatch ended its backward pair; " +
               raises(BadArgument, "ended this handle's backward pair",
                      lambda: buf.combine(g_recv, h)))


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
    equal(out, identity_combined(data, E), "combine of num_worst_tokens-padded rows")
    log.append("num_worst_tokens=%d: padded, combine equal" % worst)
    check_frozen(buf, E, data, log)

    # A second Buffer (Megatron-Core makes one when its size hints grow) shares the group.
    b2 = deep_ep.Buffer(dist.group.WORLD, 1 << 20, 0)
    expect(b2.railwave_group is buf.railwave_group, "a second Buffer joined the group again")
    b2.destroy()
    buf.destroy()
    log.append("second Buffer shares the group")
    return log


def peer_failed(what, fn):
    """fn() on a rank whose peer made the error must raise PhaseError at once: the phase failed
    by the erring rank (its poisoned dispatch, or its abort of the open pair), never the daemon's
    phase timeout (60 s here)."""
    try:
        fn()
    except PhaseError as e:
        msg = str(e)
        expect(e.code is not None and "timed out after" not in msg,
               "peer of %s: %s is the daemon's phase timeout (the phase was not failed at "
               "once)" % (what, msg))
        return "peer of %s -> %s: %s" % (what, type(e).__name__, msg[:110])
    except Exception as e:
        raise AssertionError("peer of %s: expected PhaseError, got %s: %s"
                             % (what, type(e).__name__, e))
    raise AssertionError("peer of %s: no error raised" % what)


def cmd_errors(c):
    """What RailWave cannot do raises Unsupported, bad arguments TypeError/ValueError. Errors
    every rank makes alike; then errors one rank makes alone, in each phase of a step (layout,
    fresh dispatch, forward combine, cached dispatch, backward combine, num_worst_tokens
    overflow): that rank raises its error, every other rank PhaseError at once. The Buffer
    serves on: a step after each is equal to the reference."""
    E = c["experts"]
    buf = join(c)
    data = workload(c["seed"], E)
    x, idx, w, gout = data[RANK]
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
    try:
        buf.dispatch(x, topk_idx=idx, num_experts=E, expert_alignment=0)
        raise AssertionError("expert_alignment=0: no error raised")
    except BadArgument as e:
        expect(e.op == "deep_ep: dispatch" and e.detail.startswith("expert_alignment"),
               "deep_ep errors name the call in op and what failed in detail: op %r detail %r"
               % (e.op, e.detail))
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    log += [
        raises(deep_ep.Unsupported, "after a cached dispatch",
               lambda: buf.combine(recv_x, h, topk_weights=torch.zeros(recv_x.shape[0], K))),
    ]
    want = identity_combined(data, E)

    def good(what):
        # No barrier: a rank that cannot give a pair's combine fails that pair by its key
        # (_core's _abort_pair), so however late its abort comes it never reaches this step.
        rx, _, _, _, hh, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        equal(buf.combine(rx, hh)[0], want, "step after %s" % what)

    good("the errors every rank made")
    log.append("a step after the errors every rank made is equal")

    # One rank alone makes each error; the others make the call right.
    W = WORLD
    bad_rows = lambda rx: torch.zeros(rx.shape[0] + 1, H)  # noqa: E731
    backward = lambda rx, hh: buf.dispatch(gout, handle=hh)  # noqa: E731
    one = [
        (0, "get_dispatch_layout of float ids", BadArgumentType, "int64",
         lambda: buf.get_dispatch_layout(idx.float(), E),
         lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w,
                              num_tokens_per_expert=buf.get_dispatch_layout(idx, E)[2])),
        (1 % W, "dispatch of FP8 rows", deep_ep.Unsupported, "FP8",
         lambda: buf.dispatch((x, x), topk_idx=idx, num_experts=E),
         lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)),
        (2 % W, "dispatch without num_tokens_per_expert", BadArgument, "num_tokens_per_expert",
         lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w),
         lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)),
    ]
    for who, what, exc, needle, bad, right in one:
        if RANK == who:
            log.append("%s -> %s" % (what, raises(exc, needle, bad)))
        else:
            log.append(peer_failed(what, right))
        good(what)
    # Errors in the pair: the forward combine, the cached dispatch, the backward combine.
    for who, what, exc, needle, phase, bad in [
            (3 % W, "combine of wrong rows", BadArgument, "rows", "combine",
             lambda rx, hh: buf.combine(bad_rows(rx), hh)),
            (4 % W, "forward combine with topk_weights", deep_ep.Unsupported,
             "after a cached dispatch", "combine",
             lambda rx, hh: buf.combine(rx, hh, topk_weights=torch.zeros(rx.shape[0], K))),
            (5 % W, "cached dispatch of wrong tokens", BadArgument, "tokens", "cached",
             lambda rx, hh: buf.dispatch(torch.zeros(x.shape[0] + 1, H), handle=hh)),
            (0, "backward combine of another hidden", BadArgument, "hidden", "backward",
             lambda rx, hh: buf.combine(torch.zeros(rx.shape[0], H + 1), hh)),
            (1 % W, "backward combine without a cached dispatch, wrong rows", BadArgument,
             "rows", "backward-open", lambda rx, hh: buf.combine(bad_rows(rx), hh))]:
        rx, _, _, _, hh, _ = buf.dispatch(x.detach().requires_grad_(), topk_idx=idx,
                                          topk_weights=w, num_experts=E)
        steps = {"combine": [], "cached": ["combine"], "backward": ["combine", "cached"],
                 "backward-open": ["combine"]}[phase]
        if "combine" in steps:
            buf.combine(rx, hh)
        if "cached" in steps:
            backward(rx, hh)
        if RANK == who:
            log.append("%s -> %s" % (what, raises(exc, needle, lambda: bad(rx, hh))))
        elif phase == "combine":
            log.append(peer_failed(what, lambda: buf.combine(rx, hh)))
        elif phase == "cached":
            log.append(peer_failed(what, lambda: backward(rx, hh)))
        else:
            log.append(peer_failed(what, lambda: buf.combine(
                rx, hh, topk_weights=torch.zeros(rx.shape[0], K))))
        good(what)
    # num_worst_tokens overflow: every token to expert 0 (rank 0), which allows itself 1 row.
    cidx = torch.full_like(idx, -1)
    cidx[:, 0] = 0
    worst = 1 if RANK == 0 else WORLD * 16
    total = sum(d[0].shape[0] for d in data)

    def overflow():
        rx, _, _, _, hh, _ = buf.dispatch(x, topk_idx=cidx, topk_weights=w, num_experts=E,
                                          num_worst_tokens=worst)
        buf.combine(rx, hh)
    if RANK == 0:
        try:
            overflow()
            raise AssertionError("num_worst_tokens exceeded: no error raised")
        except ReceiveRoomExceeded as e:
            expect("received %d rows, above num_worst_tokens 1" % total in str(e),
                   "num_worst_tokens overflow: %s" % e)
            log.append("num_worst_tokens overflow -> %s: %s" % (type(e).__name__, e))
    else:
        log.append(peer_failed("a num_worst_tokens overflow", overflow))
    good("a num_worst_tokens overflow")

    # The ranks run different backwards (rank 0's backward sends other routing than its
    # forward): a rank whose backward pair receives other rows than the forward raises
    # BackwardMismatch after failing that pair for every rank; no rank waits for the timeout.
    g = buf.railwave_group
    xg = x.clone().requires_grad_()
    rx, _, _, _, hg = g.dispatch(xg, idx, w, E, layer=9, step=0)
    out = g.combine(rx * 2, hg)
    if RANK == 0:
        el = E // WORLD
        hg.keep_routing(torch.where(idx >= 0, (idx + el) % E, idx), w)
    try:
        out.sum().backward()
        seen = "no error"
    except BackwardMismatch as e:
        seen = "BackwardMismatch: %s" % str(e)[:100]
    except PhaseError as e:
        expect("timed out after" not in str(e), "different backwards: %s is the phase timeout"
               % e)
        seen = "PhaseError: %s" % str(e)[:100]
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, seen)
    expect(any(v.startswith("BackwardMismatch") for v in everyone) and
           all(v != "no error" for v in everyone),
           "different backwards: every rank must fail, one with BackwardMismatch: %s" % everyone)
    log.append("different backwards -> %s" % seen)
    good("different backwards")

    # A late abort names its pair: node 1's rank LW + 1 refuses its combine of step 0 (failing
    # that pair), rank 0 gets its PhaseError and opens step 1 on node 0, and only then does
    # rank 1, on node 0 too, refuse its combine of step 0. Its abort fails nothing more: step 1
    # is equal. (Failing a pair by leaving the group failed step 1 here: the pair open on node 0
    # when the leave came.)
    LW = int(os.environ["LOCAL_WORLD_SIZE"])
    if LW >= 2 and WORLD >= 2 * LW:
        first, late = LW + 1, 1
        wrong = lambda rx, hh: g.combine(torch.zeros(rx.shape[0] + 1, H), hh)  # noqa: E731
        rx, _, _, _, hl = g.dispatch(x, idx, w, E, layer=11, step=0)
        if RANK == first:
            log.append("first abort of step 0 -> %s" % raises(BadArgument, "rows",
                                                                lambda: wrong(rx, hl)))
        elif RANK != late:
            log.append(peer_failed("an aborted pair", lambda: g.combine(rx, hl)))
        work = g.dispatch(x, idx, w, E, layer=11, step=1, async_op=True) if RANK == 0 else None
        dist.barrier()  # rank 0 has submitted step 1 before rank 1 aborts step 0
        if RANK == late:
            log.append("late abort of step 0 -> %s" % raises(BadArgument, "rows",
                                                               lambda: wrong(rx, hl)))
        rx1, _, _, _, h1 = work.wait() if work is not None else \
            g.dispatch(x, idx, w, E, layer=11, step=1)
        equal(g.combine(rx1, h1), want, "step 1 after a late abort of step 0")
        log.append("a late abort of step 0, after rank 0 opened step 1, fails nothing more: "
                   "step 1 is equal")

    # Megatron-Core's expert-parallel group as a strided subgroup (TP = 2) has no railwave group.
    members = list(range(0, WORLD, 2))
    sub = dist.new_group(members)
    if RANK in members:
        log.append(raises(deep_ep.Unsupported, "global ranks %s" % members,
                          lambda: deep_ep.Buffer(sub, 0, 0)))
    log.append("a step after every error is equal")
    buf.destroy()
    return log


def ops_layer(x, idx, w, E, scale=None):
    """One MoE layer through railwave::dispatch / railwave::combine and the expert-major layout
    (alignment 4): local expert e multiplies its rows by its global id + 1 (and by scale)."""
    from railwave import ops
    el = E // WORLD
    recv_x, recv_idx, recv_w, counts, hid = ops.dispatch(x, idx, w, E)
    rows, lay = expert_major(recv_x, recv_idx, recv_w, el, alignment=4)
    fac = torch.repeat_interleave(torch.arange(el) + RANK * el + 1.0, lay.counts).unsqueeze(1)
    y = rows * fac if scale is None else rows * fac * scale
    return ops.combine(combine_rows(y, lay), hid), recv_idx, counts, lay


def scale_grad(data, E):
    """d Σ(out · gout) / d scale of this rank's experts: Σ over every rank's tokens and their
    top-k entries hosted here of w (e + 1) (x · gout)."""
    el = E // WORLD
    total = torch.zeros(())
    for x, idx, w, gout in data:
        mine = (idx >= RANK * el) & (idx < (RANK + 1) * el)
        total += (w * factor(idx) * mine * (x * gout).sum(1, keepdim=True)).sum()
    return total


def cmd_ops(c):
    """railwave::dispatch / railwave::combine with autograd: MoE steps through the operators
    and the expert-major layout (alignment 4), output and gradients equal to the reference;
    under activation checkpointing (recompute: the operators run again in the backward);
    with a frozen router (only the experts' scale trained: the backward pair must be ended by
    combine's backward); without a backward (no_grad, and grad enabled with nothing requiring
    grad): the handle table stays empty."""
    from railwave import ops
    E = c["experts"]
    el = E // WORLD
    buf = join(c)
    g = buf.railwave_group
    ops.use(buf)
    data = workload(c["seed"], E)
    log = []
    x0, idx, w0, gout = data[RANK]
    want_out, want_gx, want_gw = reference(x0, idx, w0, gout)
    for step in range(2):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        y, recv_idx, counts, lay = ops_layer(x, idx, w, E)
        expect(bool((lay.counts % 4 == 0).all()) and torch.equal(
            lay.counts, (torch.bincount(recv_idx[recv_idx >= 0], minlength=el) + 3) // 4 * 4),
            "expert-major counts %s" % lay.counts.tolist())
        expect(torch.equal(counts, torch.bincount(recv_idx[recv_idx >= 0], minlength=el)),
               "num_recv_per_expert")
        (y * gout).sum().backward()
        equal(y.detach(), want_out, "ops output")
        equal(x.grad, want_gx, "ops grad x")
        equal(w.grad, want_gw, "ops grad topk_weights")
        log.append("ops step %d: output, grad x, grad topk_weights equal" % step)
    # Activation checkpointing: the region is recomputed in the backward (its dispatch and
    # combine communicate again, on every rank alike), before the backward pair opens.
    from torch.utils import checkpoint as ckpt
    for reentrant in (True, False):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        y = ckpt.checkpoint(lambda a, b: ops_layer(a, idx, b, E)[0], x, w,
                            use_reentrant=reentrant)
        (y * gout).sum().backward()
        equal(y.detach(), want_out, "checkpointed ops output")
        equal(x.grad, want_gx, "checkpointed ops grad x")
        equal(w.grad, want_gw, "checkpointed ops grad topk_weights")
        expect(not ops._handles and g._open is None, "checkpointed step left handles %s, "
               "open pair %s" % (list(ops._handles), g._open and (g._open.layer, g._open.step)))
        log.append("checkpoint (use_reentrant=%s, recompute): output and gradients equal"
                   % reentrant)
    sac = getattr(ckpt, "create_selective_checkpoint_contexts", None)
    if sac is None:
        log.append("selective checkpoint skipped: torch %s has no "
                   "create_selective_checkpoint_contexts (PyTorch >= 2.4)" % torch.__version__)
    else:  # the save list keeps the operators' outputs: they are replayed, not recomputed
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        y = ckpt.checkpoint(lambda a, b: ops_layer(a, idx, b, E)[0], x, w, use_reentrant=False,
                            context_fn=lambda: sac(ops.save_list()))
        (y * gout).sum().backward()
        equal(x.grad, want_gx, "selective checkpoint grad x")
        equal(w.grad, want_gw, "selective checkpoint grad topk_weights")
        expect(not ops._handles and g._open is None, "selective checkpoint left handles %s"
               % list(ops._handles))
        log.append("selective checkpoint (save list): gradients equal")
    # A frozen router: x and topk_weights need no gradient, the experts' scale does. Only
    # combine's backward runs; it must end the backward pair itself.
    scale = torch.ones((), requires_grad=True)
    y = ops_layer(x0, idx, w0, E, scale)[0]
    (y * gout).sum().backward()
    equal(y.detach(), want_out, "frozen-router ops output")
    equal(scale.grad, scale_grad(data, E), "frozen-router grad of the experts' scale")
    expect(g._open is None, "frozen router: the backward pair is left open (%s)"
           % (g._open and (g._open.layer, g._open.step),))
    expect(not ops._handles, "frozen router: handles left %s" % list(ops._handles))
    log.append("frozen router: experts' gradient equal, the backward pair ended")
    # The same step through Group.dispatch_expert_major / combine_expert_major (autograd).
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    rows, counts, lay, h = g.dispatch_expert_major(x, idx, w, E, alignment=8, layer=5)
    expect(bool((counts % 8 == 0).all()) and rows.shape[0] == int(counts.sum()),
           "Group.dispatch_expert_major counts %s for %d rows" % (counts.tolist(),
                                                                  rows.shape[0]))
    fac = torch.repeat_interleave(torch.arange(el) + RANK * el + 1.0, counts)
    y = g.combine_expert_major(rows * fac.unsqueeze(1), lay, h)
    (y * gout).sum().backward()
    equal(y.detach(), want_out, "Group expert-major output")
    equal(x.grad, want_gx, "Group expert-major grad x")
    equal(w.grad, want_gw, "Group expert-major grad topk_weights")
    log.append("Group.dispatch_expert_major (alignment 8): output, grad x, grad topk_weights "
               "equal")
    # bf16 rows through the Group's autograd: the topk_weights gradient (here k/3 multiples,
    # no bf16 number) travels as a bf16 high and low part, so it arrives to 2^-16, not bf16's
    # 2^-9. The output gradient is made a bf16 number first: it travels as bf16 rows.
    x = x0.to(torch.bfloat16).requires_grad_()
    w = w0.clone().requires_grad_()
    gout_b = (gout / 3).to(torch.bfloat16).float()
    rows, counts, lay, h = g.dispatch_expert_major(x, idx, w, E, alignment=8, layer=6)
    fac = torch.repeat_interleave(torch.arange(el) + RANK * el + 1.0, counts)
    y = g.combine_expert_major((rows * fac.unsqueeze(1)).to(torch.bfloat16), lay, h)
    (y.float() * gout_b).sum().backward()
    want = factor(idx) * (x0 * gout_b).sum(1, keepdim=True)
    err = ((w.grad - want).abs() / (want.abs() + 2 ** -20)).max().item() if want.numel() else 0
    expect(err <= 2 ** -14, "bf16 Group autograd: grad topk_weights relative error %g" % err)
    log.append("bf16 Group autograd: grad topk_weights within %.1e relative (bf16 alone: 2^-9)"
               % err)
    # No backward: the combine frees the handle, under no_grad and with grad enabled but
    # nothing requiring grad (evaluation without no_grad).
    with torch.no_grad():
        ops_layer(x0, idx, w0, E)
        expect(not ops._handles, "handles left after a no-grad step: %s" % list(ops._handles))
    y = ops_layer(x0, idx, w0, E)[0]
    equal(y, want_out, "grad-enabled step without gradients")
    expect(not ops._handles, "handles left after a step with grad enabled and nothing "
           "requiring grad: %s" % list(ops._handles))
    log.append("steps without a backward free their handles; save list %s"
               % [str(o) for o in ops.save_list()])
    buf.destroy()
    return log


def check_ops_static(buf, E, data, worst):
    """The TorchTitan dispatcher's static form (railwave/torchtitan.py) without TorchTitan:
    railwave::dispatch with num_worst_tokens = the capacity, the fixed-size expert-major layout
    (alignment 4), experts, combine_rows, railwave::combine, and the backward (autograd), twice:
    the rows' count is static_rows(capacity) whatever the routing, the counts (on the device)
    are the padded blocks, and the output and gradients equal the reference."""
    from railwave import ops
    ops.use(buf)
    el, lo = E // WORLD, RANK * E // WORLD
    x0, idx, w0, gout = data[RANK]
    want_out, want_gx, want_gw = reference(x0, idx, w0, gout)
    R = static_rows(worst, idx.shape[1], el, 4)
    expect(buf.static_capacity() == worst, "static_capacity() %s, the capacity %d"
           % (buf.static_capacity(), worst))
    for step in range(2):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        recv_x, recv_idx, recv_w, counts, hid = ops.dispatch(x, idx, w, E, worst)
        rows, lay = expert_major_static(recv_x, recv_idx, recv_w, el, alignment=4)
        n = int((recv_idx >= 0).any(1).sum())
        want_counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=el)
        expect(rows.shape[0] == R and recv_x.shape[0] == worst and
               torch.equal(counts, want_counts) and
               torch.equal(lay.counts, (want_counts + 3) // 4 * 4),
               "static ops: %d rows (want %d), counts %s, layout counts %s for %d rows received"
               % (rows.shape[0], R, counts.tolist(), lay.counts.tolist(), n))
        used = int(lay.counts.sum())  # the test's own host read, to build the experts' factor
        fac = torch.cat([torch.repeat_interleave(torch.arange(el) + lo + 1.0, lay.counts),
                         torch.full((R - used,), float("nan"))]).unsqueeze(1)
        y = ops.combine(combine_rows(rows * fac, lay), hid)  # NaN past the blocks: never read
        (y * gout).sum().backward()
        buf.railwave_group.check()
        equal(y.detach(), want_out, "static ops output")
        equal(x.grad, want_gx, "static ops grad x")
        equal(w.grad, want_gw, "static ops grad topk_weights")
    return ("TorchTitan's static form (ops num_worst_tokens %d, expert_major_static): %d rows "
            "fixed by the shapes (%d used here), forward and backward equal, twice"
            % (worst, R, used))


def cmd_static(c):
    """The Buffer on a static Group (the rank path's static mode, on the kernel stand-in): every
    form of check_dispatch (its host list of counts and exact shapes: a host read), the frozen
    dispatch, then the sync-free form, num_worst_tokens = the capacity: the rows padded to it
    in (source rank, token) order (rows past the count zero, expert -1, weight 0), the list
    empty, forward combine, cached dispatch and weighted combine equal to the reference; a
    num_worst_tokens below the capacity refused on every rank alike, then a step equal."""
    import ctypes
    grid = ctypes.CDLL(os.environ["RW_CUDA_DRIVER"]).rw_fake_cuda_grid_take
    grid.restype = ctypes.c_ulonglong
    E = c["experts"]
    log = []
    buf = join(c, static=True)
    g = buf.railwave_group
    deep_ep.Buffer.set_num_sms(2)  # before the rank path opens: kept for its open
    data = workload(c["seed"], E)
    for dtype in (torch.float32, torch.bfloat16):
        check_dispatch(buf, c, E, dtype, data, log)
    check_frozen(buf, E, data, log)
    expect(g._rank is not None and g._rank.static, "the Buffer's group is not on the static "
           "rank path (%s)" % g._rank_off)
    el, lo = E // WORLD, RANK * E // WORLD
    worst = g._rank.cap
    x, idx, w, gout = data[RANK]
    for step in range(2):
        grid()
        recv_x, recv_idx, recv_w, counts, h, _ = buf.dispatch(
            x.clone().requires_grad_(), topk_idx=idx, topk_weights=w, num_experts=E,
            num_worst_tokens=worst)
        expect(h.a.recv_n is not None and counts == [] and recv_x.shape[0] == worst,
               "sync-free form: recv_n %s, counts %s, %d rows for num_worst_tokens %d"
               % (h.a.recv_n, counts, recv_x.shape[0], worst))
        f = factor(torch.where(recv_idx >= 0, recv_idx + lo, recv_idx))
        y = (recv_w * f).sum(1, keepdim=True) * recv_x
        out, _, _ = buf.combine(y, h)
        g_recv = buf.dispatch(gout, handle=h)[0]
        g_rows = (recv_w * f).sum(1, keepdim=True) * g_recv
        g_w = f * (recv_x * g_recv).sum(1, keepdim=True)
        gx, gw, _ = buf.combine(g_rows, h, topk_weights=g_w)
        g.check()  # the host-visible call: nothing above read the device
        most = grid()
        expect(most <= 2, "Buffer.set_num_sms(2): a rank kernel launched %d blocks" % most)
        n = h.num_recv_tokens
        src = list(zip(h.src_rank.tolist(), h.src_token.tolist()))
        want_rows = [(r, t) for r in range(WORLD) for t in range(data[r][0].shape[0])
                     if ((data[r][1][t] >= lo) & (data[r][1][t] < lo + el)).any()]
        expect(src == want_rows, "sync-free form: rows %s, wanted %s" % (src, want_rows))
        if n:
            equal(recv_x[:n], torch.stack([data[r][0][t] for r, t in src]), "sync-free recv_x")
            equal(g_recv[:n], torch.stack([data[r][3][t] for r, t in src]),
                  "sync-free cached dispatch rows")
        expect(not recv_x[n:].any() and bool((recv_idx[n:] == -1).all()) and
               not recv_w[n:].any(), "sync-free form: rows past the count %d not 0 / -1 / 0"
               % n)
        want_out, want_gx, want_gw = reference(x, idx, w, gout)
        equal(out, want_out, "sync-free combined x")
        equal(gx, want_gx, "sync-free grad x")
        equal(gw, want_gw, "sync-free grad topk_weights")
    log.append("sync-free form (num_worst_tokens %d = the capacity, %d rows here): dispatch, "
               "combine, cached dispatch, weighted combine equal, twice" % (worst, n))
    log.append(check_ops_static(buf, E, data, worst))
    log.append("num_worst_tokens below the capacity: " + raises(
        BadArgument, "below this static group's capacity", lambda: buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=E, num_worst_tokens=worst - 1)))
    log.append("Buffer.set_num_sms(2): no rank kernel above 2 blocks; " + raises(
        BadArgument, "outside 1..", lambda: deep_ep.Buffer.set_num_sms(100000)))
    check_dispatch(buf, c, E, torch.float32, data, log)
    buf.destroy()
    return log


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import serve
    serve({"buffer": cmd_buffer, "errors": cmd_errors, "ops": cmd_ops, "static": cmd_static})
