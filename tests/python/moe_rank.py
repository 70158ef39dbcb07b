"""One trainer rank of tests/python/test_moe.py, started torchrun-style (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE in the environment). It reads one JSON command per line on stdin,
runs it against the daemon named in the command, and answers one JSON line on stdout:
{"ok": true, "log": [...]} or {"ok": false, "error": "..."}.

Every check compares this rank's share of a MoE layer run through RailWave with the same layer
computed in this one process over every rank's tokens (the workload is regenerated from the
seed, so each rank knows all of it)."""
import json
import os
import sys
import time
import traceback
import warnings

import torch

import railwave
from railwave.moe import MoE

torch.set_num_threads(1)
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
H, F, K = 16, 8, 3
BF16_ERR = []  # worst relative error of each bf16 comparison (logged)


def workload(seed, step, E, dtype, router):
    """Every rank's tokens, ids, weights and output gradient for one step, plus the experts.
    fp32 without router: small integers, so every sum is exact in any order. bf16 and the
    router: real-valued data, where rounding and summation order show."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    real = router or dtype != torch.float32
    val = (lambda shape: torch.randn(shape, generator=g)) if real else \
        (lambda shape: torch.randint(-1, 2, shape, generator=g).float())
    ranks = []
    for r in range(WORLD):
        T = [0, 5, 9, 13][int(torch.randint(0, 4, (1,), generator=g))] if r % 3 == 1 else 11
        x = val((T, H))
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) \
            if T else torch.zeros(0, K, dtype=torch.int64)
        if T:  # some top-k entries unused (-1), as a capacity-dropping router would leave them
            idx[torch.rand(T, K, generator=g) < 0.15] = -1
        w = torch.rand(T, K, generator=g) + 0.5 if real else \
            torch.randint(1, 3, (T, K), generator=g).float()
        gout = val((T, H))
        ranks.append((x.to(dtype), idx, w, gout.to(dtype)))
    experts = [(val((F, H)), val((H, F))) for _ in range(E)]
    router_w = torch.randn(E, H, generator=g) * 0.5
    return ranks, experts, router_w


def reference(ranks, experts, router_w, dtype, router):
    """The layer in one process: per source rank, output and gradients of sum(out * gout).
    The experts' gradients are of fresh copies: .to() of an fp32 tensor to fp32 is the tensor
    itself, whose .grad would gather every call's gradients (a caller reusing its experts over
    steps got step 0's added to step 1's)."""
    params = [(a.detach().to(dtype, copy=True).requires_grad_(),
               b.detach().to(dtype, copy=True).requires_grad_()) for a, b in experts]
    res = []
    for x0, idx0, w0, gout in ranks:
        x = x0.clone().requires_grad_()
        rw = router_w.clone().to(dtype).requires_grad_()
        if router:
            probs = torch.softmax((x @ rw.t()).float(), dim=-1)
            w, idx = torch.topk(probs, K, dim=-1)
            w = w / w.sum(-1, keepdim=True)
        else:
            idx, w = idx0, w0.clone().requires_grad_()
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for k in range(K):
                e = int(idx[t, k])
                if e >= 0:
                    a, b = params[e]
                    y = torch.relu(x[t] @ a.t()) @ b.t()
                    out[t] = out[t] + (y * w[t, k].to(dtype)).float()
        out = out.to(dtype)
        if x.shape[0]:
            (out.float() * gout.float()).sum().backward()
        else:  # nothing routed: every gradient of this rank is empty or zero
            x.grad = torch.zeros_like(x)
            rw.grad = torch.zeros_like(rw)
            if not router:
                w.grad = torch.zeros_like(w)
        res.append({"out": out.detach(), "gx": x.grad, "gw": None if router else w.grad,
                    "grouter": rw.grad if router else None})
    return res, [(a.grad, b.grad) for a, b in params]


def close(a, b, dtype, zeros_for_none=False, bound=2 ** -6):
    """a (RailWave's) equals b (the reference's): exactly for fp32, within bf16's rounding.
    None (no gradient) equals only None; with zeros_for_none an a of zeros also equals a b of
    None: railwave.MoE on a rank that received no rows of a frozen router's dispatch makes its
    output depend on an expert (a zero gradient) that the reference never used. a and b in the
    same memory is an error: such a check passes whatever RailWave computed (CPU tensors,
    where .to(device) copies nothing, once hid a wrong reference that way)."""
    if b is None:
        return a is None or (zeros_for_none and not a.any())
    if a is None:
        return False
    if a.numel() and a.device == b.device and a.data_ptr() == b.data_ptr():
        raise AssertionError("a check compares a tensor with the reference's own memory")
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False
    if dtype == torch.float32:
        return torch.equal(a, b)
    if b.numel() == 0:
        return True
    # bf16: 8 significant bits; the layer rounds a few times per element (docs/python.md):
    # |got - want| <= bound (|want| + max |want| + 1), bound 2^-6 unless the caller says.
    err = (a - b).abs() / (b.abs() + b.abs().max() + 1)
    BF16_ERR.append(float(err.max()))
    return bool((err <= bound).all())


def run_step(group, seed, step, E, dtype, router=False, layer=0, dev=torch.device("cpu"),
             frozen=False):
    """One forward + backward through RailWave; returns a list of mismatches (empty = equal).
    frozen: neither x nor topk_weights needs a gradient (a frozen router, expert-only
    fine-tuning), so the dispatch runs without autograd and only the experts are trained."""
    ranks, experts, router_w = workload(seed, step, E, dtype, router)
    moe = MoE(group, H, F, E, K, layer=layer).to(dtype)
    with torch.no_grad():
        moe.router.weight.copy_(router_w)
        for i, ex in enumerate(moe.experts):
            a, b = experts[moe.first + i]
            ex.w1.weight.copy_(a)
            ex.w2.weight.copy_(b)
    moe.to(dev)
    x0, idx, w0, gout = (t.to(dev) for t in ranks[RANK])
    x = x0.clone().requires_grad_(not frozen)
    if router:
        out = moe(x, step=step)
        w = None
    else:
        w = w0.clone().requires_grad_(not frozen)
        out = moe(x, topk_idx=idx, topk_weights=w, step=step)
    (out.float() * gout.float()).sum().backward()
    ref, ref_experts = reference(ranks, experts, router_w, dtype, router)
    mine = ref[RANK]
    bad = []
    tol = torch.float32 if (dtype == torch.float32 and not router) else torch.bfloat16
    if router and dtype == torch.float32:  # softmax: same math, other summation order
        cl = lambda a, b, z: a is not None and b is not None and torch.allclose(
            a.float(), b.float(), rtol=1e-4, atol=1e-5)
    else:
        cl = lambda a, b, z: close(a, b, tol, z)
    checks = [("output", out.detach(), mine["out"], False)]
    if frozen:  # no gradient may reach the inputs
        checks += [("grad x", x.grad, None, False), ("grad topk_weights", w.grad, None, False)]
    else:
        checks.append(("grad x", x.grad, mine["gx"], False))
    if router:
        checks.append(("grad router", moe.router.weight.grad, mine["grouter"], False))
    elif not frozen:
        checks.append(("grad topk_weights", w.grad, mine["gw"], False))
    for i, ex in enumerate(moe.experts):
        ga, gb = ref_experts[moe.first + i]
        checks += [("grad expert %d w1" % (moe.first + i), ex.w1.weight.grad, ga, frozen),
                   ("grad expert %d w2" % (moe.first + i), ex.w2.weight.grad, gb, frozen)]
    for name, a, b, zeros_for_none in checks:
        a = None if a is None else a.cpu()
        if not cl(a, b, zeros_for_none):
            diff = (a.float() - b.float()).abs().max().item() if a is not None and b is not None \
                and a.shape == b.shape else "shape %s vs %s" % (
                    None if a is None else tuple(a.shape), None if b is None else tuple(b.shape))
            bad.append("step %d %s %s differs (max |diff| %s)" % (step, dtype, name, diff))
    return bad, x0.shape[0]


def run_async(group, seed, step, E, dev):
    """Forward only, through the async form: Work.done() polls, Work.wait() returns the call's
    result (twice: the same objects); the output must equal the reference and the per-expert
    counts must equal the local expert ids among the received rows."""
    ranks, experts, router_w = workload(seed, step, E, torch.float32, False)
    moe = MoE(group, H, F, E, K, layer=7)
    with torch.no_grad():
        for i, ex in enumerate(moe.experts):
            a, b = experts[moe.first + i]
            ex.w1.weight.copy_(a)
            ex.w2.weight.copy_(b)
    moe.to(dev)
    x, idx, w, _ = (t.to(dev) for t in ranks[RANK])
    with torch.no_grad():
        work = group.dispatch(x, idx, w, E, layer=7, step=step, async_op=True)
        polls = 0
        while not work.done():
            polls += 1
            time.sleep(0.0005)
        res = work.wait()
        if work.wait() is not res:
            raise AssertionError("a second wait() returned another result")
        rx, ridx, rw, counts, h = res
        want = torch.stack([(ridx == e).sum() for e in range(moe.local)]).cpu() \
            if moe.local else torch.zeros(0, dtype=torch.int64)
        if not torch.equal(counts.cpu(), want):
            raise AssertionError("num_recv_per_expert %s, recv_topk_idx says %s"
                                 % (counts.tolist(), want.tolist()))
        out = group.combine(moe.run_experts(rx, ridx, rw), h, async_op=True).wait()
    ref, _ = reference(ranks, experts, router_w, torch.float32, False)
    if not torch.equal(out.cpu(), ref[RANK]["out"]):
        raise AssertionError("async step %d: output differs" % step)
    return "async fp32 step equal, counts equal (%d polls)" % polls


def join(c, group=None, **kw):
    """Join as torchrun would have us: everything from the environment (max_tokens_per_rank
    from the command)."""
    os.environ["RAILWAVE_SOCKET"] = c["sockets"][RANK // int(os.environ["LOCAL_WORLD_SIZE"])]
    kw.setdefault("max_tokens_per_rank", c.get("max_tokens"))
    kw.setdefault("stream_ordered", c.get("stream_ordered", False))
    return railwave.Group.from_env(group or c["group"], timeout=120,  # above the phase timeout
                                   **kw)


def device(c):
    dev = torch.device(c.get("device", "cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cmd_paths(c):
    log = []
    dev = device(c)
    with join(c) as g:
        E = c["experts"]
        for step in range(c["steps"]):
            bad, T = run_step(g, c["seed"], step, E, torch.float32, layer=step % 2, dev=dev)
            if bad:
                raise AssertionError("; ".join(bad))
            log.append("fp32 step %d T=%d equal" % (step, T))
        # The dispatch without autograd, the combine with (trained experts): combine's backward
        # runs the backward pair alone, between other steps here and as the Group's last step
        # below (every rank leaves right after it: none may find the pair still open).
        bad, _ = run_step(g, c["seed"], 40, E, torch.float32, layer=4, dev=dev, frozen=True)
        if bad:
            raise AssertionError("; ".join(bad))
        log.append("frozen-router fp32 step equal (output, expert gradients; none to x)")
        log.append(run_async(g, c["seed"], 50, E, dev))
        bad, _ = run_step(g, c["seed"], 100, E, torch.bfloat16, layer=5, dev=dev)
        if bad:
            raise AssertionError("; ".join(bad))
        log.append("bf16 within tolerance (worst relative error %.2g, bound 2^-6 = 0.0156)" % max(BF16_ERR))
        del BF16_ERR[:]
        if c.get("router"):
            bad, _ = run_step(g, c["seed"], 200, E, torch.float32, router=True, layer=6, dev=dev)
            if bad:
                raise AssertionError("; ".join(bad))
            log.append("router fp32 within 1e-4")
        bad, _ = run_step(g, c["seed"], 41, E, torch.float32, layer=4, dev=dev, frozen=True)
        if bad:
            raise AssertionError("; ".join(bad))
        log.append("last step frozen-router, equal")
        if c.get("rank_path"):  # every phase above went through librailwave's rank path
            rp = g._rank
            if rp is None or rp.phase.value == 0 or g.path() != ("rank", ""):
                raise AssertionError("the rank path was not used (%s)" % (g.path(),))
            log.append("all on the rank path (%d phases), Group.path() says so" % rp.phase.value)
    return log


FLOOD_H, FLOOD_BIG, FLOOD_SMALL, FLOOD_TO = 256, 40, 3, 1


def flood_inputs(seed, r, E):
    """Rank r's tokens of a flood step: every top-k entry names an expert of rank FLOOD_TO,
    which sends FLOOD_SMALL tokens and receives one row per token of every rank. Integer
    values: every product and sum is exact."""
    g = torch.Generator().manual_seed(seed * 100 + r)
    T = FLOOD_SMALL if r == FLOOD_TO else FLOOD_BIG
    per = E // WORLD
    x = torch.randint(-2, 3, (T, FLOOD_H), generator=g).float()
    t = torch.arange(T)
    idx = torch.stack([FLOOD_TO * per + t % per, FLOOD_TO * per + (t + 1) % per], 1)
    if per == 1:
        idx[:, 1] = -1
    w = torch.randint(1, 3, (T, 2), generator=g).float()
    return x, idx, w


def flood_step(g, seed, E, dev, layer, step):
    """One dispatch + combine of a flood; checks every received row (source, token, data), the
    per-expert counts and the combined output (identity experts: x × Σ weights)."""
    x, idx, w = flood_inputs(seed, RANK, E)
    rx, ridx, rw, counts, h = g.dispatch(x.to(dev), idx.to(dev), w.to(dev), E, layer=layer,
                                         step=step)
    want_n = FLOOD_SMALL + (WORLD - 1) * FLOOD_BIG if RANK == FLOOD_TO else 0
    if rx.shape[0] != want_n:
        raise AssertionError("flood: received %d rows, want %d" % (rx.shape[0], want_n))
    src, tok = h.src_rank.cpu(), h.src_token.cpu()
    inputs = {}
    for i in range(want_n):
        s, t = int(src[i]), int(tok[i])
        if s not in inputs:
            inputs[s] = flood_inputs(seed, s, E)
        if not torch.equal(rx[i].cpu(), inputs[s][0][t]):
            raise AssertionError("flood: row %d (rank %d token %d) differs" % (i, s, t))
    if want_n and sorted(zip(src.tolist(), tok.tolist())) != sorted(
            (s, t) for s in range(WORLD) for t in range(flood_inputs(seed, s, E)[0].shape[0])):
        raise AssertionError("flood: the received rows are not every token once")
    want_counts = torch.stack([(ridx == e).sum() for e in range(E // WORLD)]).cpu()
    if not torch.equal(counts.cpu(), want_counts):
        raise AssertionError("flood: num_recv_per_expert %s, want %s" % (counts.tolist(),
                                                                      want_counts.tolist()))
    out = g.combine(rx * rw.sum(1, keepdim=True), h)
    if not torch.equal(out.cpu(), x * w.sum(1, keepdim=True)):
        raise AssertionError("flood: combined output differs")
    return want_n


def cmd_flood(c):
    """One rank receives a row of every token of every rank (many more than it sent). With
    max_tokens_per_rank the room is right on every rank: exact. A dispatch above that bound is
    refused (the others get PhaseError at once). Without the bound the receiver's room is
    world_size × its own few tokens: the phase fails for everyone, and the receiver's error
    names the room it needed. Then a bounded step is exact again (the daemons serve on)."""
    log = []
    dev, E, seed = device(c), c["experts"], c["seed"]
    # Two Groups of this process at once, as two overlapping MoE layers hold them: with CUDA
    # tensors both lend the same allocator segments, which the daemon maps once and shares
    # between the Groups' connections (docs/cuda.md "IPC import cache").
    with join(c, max_tokens_per_rank=FLOOD_BIG) as g:
        n = flood_step(g, seed, E, dev, 20, 0)
        log.append("rank %d received %d rows for its %d tokens, equal" % (
            FLOOD_TO, n, FLOOD_SMALL) if RANK == FLOOD_TO else "sent %d tokens" % FLOOD_BIG)
        x = torch.zeros(FLOOD_BIG + 1 if RANK == 0 else 1, FLOOD_H, device=dev)
        idx = torch.zeros(x.shape[0], 2, dtype=torch.int64, device=dev)
        w = torch.ones(x.shape[0], 2, device=dev)
        log.append(expect("dispatch above max_tokens_per_rank" if RANK == 0 else
                          "peer of a dispatch above max_tokens_per_rank",
                          lambda: g.dispatch(x, idx, w, E, layer=20, step=1),
                          *((ValueError, "above max_tokens_per_rank %d" % FLOOD_BIG)
                            if RANK == 0 else (railwave.PhaseError,)),
                          cause=None if RANK == 0 else POISONED))
        del x, idx, w
        with join(c, c["group"] + ".small", max_tokens_per_rank=None) as small:
            needles = ("RW_E_RANGE", "receive room of", "max_tokens_per_rank") \
                if RANK == FLOOD_TO else ()
            log.append(expect("flood without max_tokens_per_rank", lambda: flood_step(
                small, seed, E, dev, 20, 0), railwave.PhaseError, *needles,
                full=RANK == FLOOD_TO))
            if dev.type == "cuda":
                shared = set(g._cuda.segs) & set(small._cuda.segs)
                if not shared:
                    raise AssertionError("two Groups: no allocator segment lent by both (%s, %s)"
                                         % (sorted(g._cuda.segs), sorted(small._cuda.segs)))
                log.append("two Groups lent %d allocator segment(s) to the daemon at once"
                           % len(shared))
        # The second Group has left: its references went, the first's mapping must serve on.
        flood_step(g, seed + 1, E, dev, 20, 2)
        log.append("bounded flood equal again on the first Group after the second left")
    return log


# How the daemon tells a rank that another rank failed its phase on purpose, (codes, texts):
# POISONED, a rank's refused dispatch (railwave._core's _poison: an expert id out of range, with
# a top-k and hidden unlike its node's other ranks', which these hear as RW_E_FIELD; or its own
# bad ids; or num_experts unlike the phase's, RW_E_EXPERTS on its node); LEFT, a rank that left
# the open pair (its refused combine: RW_E_PHASE, or RW_E_HANDLE for a combine submitted after
# the pair had failed). The daemon's phase timeout says "timed out after".
POISONED = ((railwave.errors.RW_E_PHASE, railwave.errors.RW_E_FIELD,
             railwave.errors.RW_E_EXPERTS),
            ("expert id out of range", "local ranks disagree on", "n_experts",
             "has a top-k id outside",  # the daemon's words for a page rank's bad id
             # the rank path: the refused rank left, and joined again past the key
             "joined again", "left before this dispatch"))
LEFT = ((railwave.errors.RW_E_PHASE, railwave.errors.RW_E_HANDLE),
        (" left", "is not this rank's open dispatch", "aborted the pair",
         "aborted its combine"))  # the ring's RW_SQE_ABORT, the rank path's abort slot


RANK_PATH = [False]  # the command's rank_path: librailwave's rank path carries the phases


def expect(what, fn, exc, *needles, full=False, cause=None):
    """fn() must raise exc whose message has every needle; a PhaseError must be the phase failed
    at once by another rank, never the daemon's phase timeout: with cause (POISONED, LEFT) its
    code and text must be that cause's. Returns a log line (with the whole message if full)."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        if missing:
            raise AssertionError("%s: %s lacks %s" % (what, msg, missing))
        if isinstance(e, railwave.PhaseError) and "timed out after" in msg:
            raise AssertionError("%s: the error is the daemon's phase timeout: the phase was "
                                 "not failed at once (%s)" % (what, msg))
        # On the rank path a phase failed by the daemon for another rank's fault ends with the
        # code in the rank page and, where the notice came first, the daemon's reason.
        quiet = RANK_PATH[0] and "railwaved:" not in msg
        if cause is not None and (e.code not in cause[0] or
                                  not (quiet or any(t in msg for t in cause[1]))):
            raise AssertionError("%s: %s (%s) is not a phase failed by another rank (codes %s, "
                                 "texts %s)" % (what, msg, e.name, [railwave.errors.NAMES[c]
                                                                    for c in cause[0]], cause[1]))
        return "%s -> %s: %s" % (what, type(e).__name__, msg if full else
                                 msg.splitlines()[0][:160])
    except Exception as e:
        raise AssertionError("%s: expected %s, got %s: %s" % (what, exc.__name__,
                                                              type(e).__name__, e))
    raise AssertionError("%s: no error raised" % what)


def cmd_bad(c):
    """Bad input on one rank (or all); every rank must get an error at once, then the next
    step must verify exactly (the daemons serve on)."""
    log = []
    E, seed = c["experts"], c["seed"]
    with join(c) as g:
        step = [0]

        def good():
            bad, _ = run_step(g, seed, 1000 + step[0], E, torch.float32, layer=1)
            step[0] += 1
            if bad:
                raise AssertionError("; ".join(bad))

        x = torch.ones(4, H)
        idx = torch.tensor([[0, 1, -1]] * 4)
        w = torch.ones(4, K)
        cases = [
            (0, "wrong dtype", lambda s: g.dispatch(x.double(), idx, w, E, layer=2, step=s),
             TypeError, ("x has dtype torch.float64",)),
            (1, "non-contiguous x", lambda s: g.dispatch(torch.ones(H, 4).t(), idx, w, E,
                                                        layer=2, step=s),
             ValueError, ("x is not contiguous",)),
            (2 % WORLD, "expert id out of range", lambda s: g.dispatch(
                x, torch.tensor([[0, E, 1]] * 4), w, E, layer=2, step=s),
             ValueError, ("topk_idx[0, 1] = %d is not an expert id" % E,)),
            (3 % WORLD, "negative expert id", lambda s: g.dispatch(
                x, torch.tensor([[0, 1, -7]] * 4), w, E, layer=2, step=s),
             ValueError, ("topk_idx[0, 2] = -7 is not an expert id",)),
            (0, "num_experts differs from the phase's", lambda s: g.dispatch(
                x, idx, w, E + WORLD, layer=2, step=s), railwave.PhaseError, ()),
            (1, "wrong topk_weights dtype", lambda s: g.dispatch(x, idx, w.double(), E, layer=2,
                                                                 step=s),
             TypeError, ("topk_weights has dtype torch.float64",)),
            # int32 ids go to the daemon unchecked (it refuses them, RW_E_TOKENS); the error
            # still names the entry
            (4 % WORLD, "int32 expert id out of range", lambda s: g.dispatch(
                x, torch.tensor([[0, 1, -1]] * 3 + [[1, -2, 0]], dtype=torch.int32), w, E,
                layer=2, step=s),
             ValueError, ("topk_idx[3, 1] = -2 is not an expert id", "RW_E_TOKENS")),
        ]
        for i, (who, what, fn, exc, needles) in enumerate(cases):
            s = 500 + i
            if RANK == who:
                log.append(expect(what, lambda: fn(s), exc, *needles))
            else:
                log.append(expect("peer of " + what, lambda: g.dispatch(x, idx, w, E, layer=2,
                                                                       step=s),
                                  railwave.PhaseError, cause=POISONED))
            good()
        # One rank combines with the wrong shape / dtype / a non-contiguous tensor: it is refused
        # there, and that rank aborts the pair so that the others' combines fail at once (the
        # ring: RW_SQE_ABORT; the rank path: its combine's page slot marked abort, _abort_rank).
        # Every token goes to that rank's experts (expert e lives on rank e / (E / WORLD)), so
        # the others' combines depend on its rows (with none received, whether they saw it leave
        # depended on timing).
        for i, (who, what, bad_y, exc, needle) in enumerate([
                (0, "combine wrong rows", lambda rx: torch.zeros(rx.shape[0] + 1, H), ValueError,
                 "received rows"),
                (1, "combine wrong dtype", lambda rx: rx.to(torch.bfloat16), TypeError,
                 "dtype torch.bfloat16"),
                (2 % WORLD, "combine non-contiguous",
                 lambda rx: torch.zeros(rx.shape[0], 2 * H)[:, ::2], ValueError,
                 "not contiguous")]):
            per = E // WORLD
            cidx = torch.tensor([[who * per, who * per + per - 1, -1]] * 4)
            if RANK == who:
                rx, ridx, rw, cnt, h = g.dispatch(x, cidx, w, E, layer=3, step=10 + i)
                y = bad_y(rx)
                if y.is_contiguous() and what == "combine non-contiguous":
                    # no rows received: no tensor of that shape is non-contiguous; still bad
                    y, needle = torch.zeros(1, H), "received rows"
                log.append(expect(what, lambda: g.combine(y, h), exc, needle))
            else:  # the pair fails in this rank's combine, or in its dispatch if it is still there
                log.append(expect("peer of " + what, lambda: g.combine(*(lambda r: (r[0], r[4]))(
                    g.dispatch(x, cidx, w, E, layer=3, step=10 + i))), railwave.PhaseError,
                    cause=LEFT))
            good()
        # Rank 0 changes its topk_idx in place between forward and backward: its backward is
        # refused (BackwardMismatch: it would send other routing than the forward's), and the
        # backward pair fails for the others at once. Not on the rank path either: its one-row
        # poison may be answered alone when the others' page dispatches opened the pair first,
        # and leaving then fails nothing where its node's pair is not open yet (1 run in 3
        # hung until a peer timed out).
        if not RANK_PATH[0]:
            x1 = torch.ones(4, H, requires_grad=True)
            idx1 = idx.clone()
            rx, _, _, _, h = g.dispatch(x1, idx1, w, E, layer=8, step=0)
            out = g.combine(rx * 2, h)
            if RANK == 0:
                idx1.add_(0)  # same values, a new version: an in-place routing change
                log.append(expect("topk_idx changed in place before the backward",
                                  lambda: out.sum().backward(), railwave.BackwardMismatch,
                                  "changed in place"))
            else:
                log.append(expect("peer of a routing changed in place",
                                  lambda: out.sum().backward(),
                                  railwave.PhaseError, cause=POISONED))
            good()
        # Joining with the wrong world size or node is refused; the group serves on.
        log.append(expect("join with world+2", lambda: railwave.Group(
            c["group"], RANK, WORLD + 2, node=g.node), railwave.WorldMismatch,
            "RW_E_WORLD_MISMATCH"))
        log.append(expect("join with another node", lambda: railwave.Group(
            c["group"] + ".n", RANK, WORLD, node=g.node + 1),
            railwave.WorldMismatch, "RW_E_NODE_MISMATCH"))
        good()
        # One operation per Group at a time (every rank does the same, so the pair completes).
        work = g.dispatch(x, idx, w, E, layer=2, step=900, async_op=True)
        log.append(expect("dispatch while one is in flight", lambda: g.dispatch(
            x, idx, w, E, layer=2, step=901), railwave.PhaseInFlight, "still in flight"))
        rx, _, _, _, h = work.wait()
        g.combine(rx, h)
        good()
        log.append("good steps verified after every bad one: %d" % step[0])
        if c.get("rank_path") and (g._rank is None or g._rank.phase.value == 0):
            raise AssertionError("the rank path was not used (%s)" % g._rank_off)
    log.append(expect("dispatch on a closed group", lambda: g.dispatch(x, idx, w, E, layer=2),
                      railwave.GroupClosed, "closed"))
    return log


KEPT = {}  # the Group kept open across the commands of the peer-loss scenario


def cmd_open(c):
    g = KEPT["g"] = join(c)
    bad, _ = run_step(g, c["seed"], 0, c["experts"], torch.float32, layer=0)
    if bad:
        raise AssertionError("; ".join(bad))
    return ["step before the loss equal"]


def cmd_lost(c):
    """The launcher killed node c["dead"]'s daemon: its ranks must learn that their daemon is
    gone (DaemonLost), the others that the phase failed (PhaseError), both without a hang."""
    g = KEPT.pop("g")
    node = RANK // int(os.environ["LOCAL_WORLD_SIZE"])
    exc = railwave.DaemonLost if node == c["dead"] else railwave.PhaseError
    line = expect("dispatch after node %d's daemon died" % c["dead"], lambda: run_step(
        g, c["seed"], 1, c["experts"], torch.float32, layer=0), exc)
    g.close()
    return [line]


def cmd_kill_a(c):
    """A forward step's dispatch on every rank; every rank but c["victim"] then submits its
    combine (async) and keeps it: the launcher kills the victim next (cmd_kill_b)."""
    g = KEPT["g"] = join(c)
    dev, E = device(c), c["experts"]
    ranks, experts, _ = workload(c["seed"], 0, E, torch.float32, False)
    x, idx, w, _ = (t.to(dev) for t in ranks[RANK])
    with torch.no_grad():
        rx, ridx, rw, _, h = g.dispatch(x, idx, w, E, layer=9, step=0)
        if RANK == c["victim"]:
            return ["dispatched %d rows; waiting to be killed" % rx.shape[0]]
        KEPT["work"] = g.combine(rx * rw.sum(1, keepdim=True), h, async_op=True)
    return ["combine submitted"]


def cmd_kill_b(c):
    """The victim was killed: the kept combine must fail at once (the pair it left)."""
    g, work = KEPT.pop("g"), KEPT.pop("work")
    line = expect("combine of a pair whose rank %d was killed" % c["victim"], work.wait,
                  railwave.PhaseError, cause=LEFT)
    g.close()
    return [line]


def dense_experts(experts, first, rx, ridx, rw):
    """Σ over this rank's experts of weight × expert(row), computed for every row (no host
    read: capturable in a CUDA graph); rows with no local expert give 0 (or what garbage past
    the received count gives: the combine reads the received rows only)."""
    y = (rx * 0).float()
    for i, (a, b) in enumerate(experts):
        we = (rw * (ridx == i)).sum(1, keepdim=True)
        y = y + (torch.relu(rx @ a.t()) @ b.t()).float() * we
    return y.to(rx.dtype)


def static_inputs(seed, step, E, dev, rank=None, dtype=torch.float32, gout=False):
    """A rank's (default: this rank's) tokens for a static step: the workload's shape for that
    rank (fixed over steps, as a captured graph needs), fresh values and routing each step:
    small integers for fp32 (every sum exact in any order), real values for bf16. gout: the
    output gradient too."""
    r = RANK if rank is None else rank
    T = workload(seed, 0, E, torch.float32, False)[0][r][0].shape[0]
    g = torch.Generator().manual_seed(seed * 7919 + step * 31 + r)
    real = dtype != torch.float32
    val = (lambda shape: torch.randn(shape, generator=g)) if real else \
        (lambda shape: torch.randint(-1, 2, shape, generator=g).float())
    x = val((T, H))
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) \
        if T else torch.zeros(0, K, dtype=torch.int64)
    if T:
        idx[torch.rand(T, K, generator=g) < 0.15] = -1
    w = torch.rand(T, K, generator=g) + 0.5 if real else \
        torch.randint(1, 3, (T, K), generator=g).float()
    out = [x.to(dtype).to(dev), idx.to(dev), w.to(dev)]
    if gout:
        out.append(val((T, H)).to(dtype).to(dev))
    return tuple(out)


def static_experts(seed, E, dtype, dev):
    """(every expert's weights as the reference takes them, this rank's as trainable
    parameters on dev: copies on every device, so that on the stand-in's CPU tensors too
    RailWave's gradients and the reference's are apart, as on a GPU)."""
    _, experts, _ = workload(seed, 0, E, dtype, dtype != torch.float32)
    per = E // WORLD
    mine = [(a.to(dtype).to(dev, copy=True).requires_grad_(),
             b.to(dtype).to(dev, copy=True).requires_grad_())
            for a, b in experts[RANK * per:(RANK + 1) * per]]
    return experts, mine


def static_layer(g, mine, x, idx, w, E, layer, seen=None, mark=None):
    """The MoE layer on a static Group, differentiable: dispatch -> dense experts -> combine,
    nothing read back (capturable). seen (a dict, not in a capture): gets the received rows
    ("rx") and, in the backward, the gradient that reaches the experts' output ("gy"). mark
    (cmd_graph_train's probes): called with each stage's name once the stage is enqueued, in
    the forward here and in the backward from hooks (on autograd's device thread)."""
    stage = mark or (lambda what: None)
    rx, ridx, rw, _, h = g.dispatch(x, idx, w, E, layer=layer, step=0)
    stage("dispatch")
    y = dense_experts(mine, 0, rx, ridx, rw)
    stage("experts")
    if seen is not None:
        seen["rx"] = rx
        y.register_hook(lambda gy: seen.__setitem__("gy", gy))
    out = g.combine(y, h)
    stage("combine")
    if mark is not None and out.requires_grad:  # post-hooks: after each backward node ran
        out.grad_fn.register_hook(lambda gi, go: mark("combine's backward (static dispatch)"))
        rx.register_hook(lambda grad: mark("the experts' backward"))
        rx.grad_fn.register_hook(lambda gi, go: mark("dispatch's backward (static combine)"))
    return out, h


def static_padding(what, h, seen):
    """docs/python.md "Static mode": the rows past the received count are zero in recv_x, and
    the gradient that reaches them in the backward is zero, so experts that compute on the
    whole capacity add nothing from them to their weights' gradients."""
    n = int(h.recv_n)
    bad = []
    if seen["rx"][n:].any():
        bad.append("%s: recv_x rows past the received %d are not zero" % (what, n))
    if "gy" not in seen or seen["gy"].shape[0] != h.num_recv or seen["gy"][n:].any():
        bad.append("%s: the experts' output gradient past the received %d rows is %s" % (
            what, n, "missing" if "gy" not in seen else "not zero"))
    return bad


def static_compare(what, dtype, got, ref, mine, ref_experts):
    """Mismatches of one static forward + backward against the one-process reference: got
    (output, grad x, grad topk_weights), ref the reference's entry of this rank."""
    bad = []
    per = len(mine)
    checks = [("output", got[0], ref["out"]), ("grad x", got[1], ref["gx"]),
              ("grad topk_weights", got[2], ref["gw"])]
    for i, (a, b) in enumerate(mine):
        ga, gb = ref_experts[RANK * per + i]
        checks += [("grad expert %d w1" % (RANK * per + i), a.grad, ga),
                   ("grad expert %d w2" % (RANK * per + i), b.grad, gb)]
    for name, a, b in checks:
        a = None if a is None else a.detach().cpu()
        # A gradient sums bf16 terms much larger than itself, each rounded on its way through
        # the experts' backward (bf16's ulp at 45 is 0.25): RW_TEST_SEED=8 gave grad x 1.875
        # for 1.125 at max |want| 45.5, 1.01 times the output's bound. Wrong rows miss by
        # far more than 2^-5.
        if not close(a, b, dtype, bound=2 ** -6 if name == "output" else 2 ** -5):
            diff = (a.float() - b.float()).abs().max().item() if a is not None and \
                a.shape == b.shape else "shape %s vs %s" % (
                    None if a is None else tuple(a.shape), tuple(b.shape))
            bad.append("%s %s %s differs (max |diff| %s)" % (what, dtype, name, diff))
    return bad


def static_reference(seed, step, E, dtype, experts):
    """The one-process reference of a static step over every rank's inputs."""
    ranks = [static_inputs(seed, step, E, torch.device("cpu"), rank=r, dtype=dtype, gout=True)
             for r in range(WORLD)]
    res, ref_experts = reference(ranks, experts, torch.zeros(len(experts), H), dtype, False)
    return res[RANK], ref_experts


def local_reference(x, idx, w, experts):
    """This rank's MoE output for its tokens, in one process (exact: integer-valued fp32)."""
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(idx[t, j])
            if e >= 0:
                a, b = experts[e]
                out[t] += (torch.relu(x[t] @ a.t()) @ b.t()) * w[t, j]
    return out


def cmd_static(c):
    """Static mode (docs/python.md "Static mode"): steps of dispatch -> experts -> combine with
    nothing read back; Group.check() after each phase (the host-visible call: on the stand-in
    it also lets the host compute on the rows); every output equal to the one-process
    reference; the rows past the received count are zero, with expert -1 and weight 0."""
    dev, E, seed = device(c), c["experts"], c["seed"]
    _, experts, _ = workload(seed, 0, E, torch.float32, False)
    per = E // WORLD
    mine = [(a.to(dev), b.to(dev)) for a, b in experts[RANK * per:(RANK + 1) * per]]
    with join(c, static=True) as g, torch.no_grad():
        for step in range(c["steps"]):
            x, idx, w = static_inputs(seed, step, E, dev)
            rx, ridx, rw, counts, h = g.dispatch(x, idx, w, E, layer=11, step=0)
            g.check()
            n = int(h.recv_n)
            if rx.shape[0] != g._rank.max_recv or (ridx[n:] != -1).any() or rw[n:].any() or \
                    rx[n:].any():
                raise AssertionError("static step %d: rows past the received %d are not "
                                     "zero, expert -1, weight 0" % (step, n))
            want = torch.stack([(ridx[:n] == e).sum() for e in range(per)]).cpu()
            if not torch.equal(counts.cpu(), want):
                raise AssertionError("static step %d: counts %s, want %s" % (
                    step, counts.tolist(), want.tolist()))
            out = g.combine(dense_experts(mine, 0, rx, ridx, rw), h)
            g.check()
            ref = local_reference(x.cpu(), idx.cpu(), w.cpu(), experts)
            if not torch.equal(out.cpu(), ref):
                raise AssertionError("static step %d: output differs (max |diff| %s)" % (
                    step, (out.cpu() - ref).abs().max().item()))
        if g._rank is None or not g._rank.static:
            raise AssertionError("static mode did not open")
    return ["%d static steps equal (nothing read back between the calls)" % c["steps"]]


def cmd_static_train(c):
    """Static mode with autograd (docs/python.md "Static mode"): steps of forward and backward
    (the combine's backward a static dispatch of the output gradient along the same routing,
    the dispatch's backward that pair's static combine), fp32 and bf16, each step's output and
    gradients (x, topk_weights, this rank's experts) equal to the one-process reference (fp32
    exactly, bf16 within its bound); Group.check() after the forward and after the backward
    (on the stand-in it lets the host compute on the rows)."""
    dev, E, seed = device(c), c["experts"], c["seed"]
    log = []
    with join(c, static=True) as g:
        for dtype, steps in ((torch.float32, c["steps"]), (torch.bfloat16, 2)):
            experts, mine = static_experts(seed, E, dtype, dev)
            for step in range(steps):
                x0, idx, w0, gout = static_inputs(seed, 100 + step, E, dev, dtype=dtype,
                                                  gout=True)
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                for a, b in mine:
                    a.grad = b.grad = None
                seen = {}
                out, h = static_layer(g, mine, x, idx, w, E, layer=13, seen=seen)
                if h.recv_n is None:
                    raise AssertionError("the dispatch did not run in static mode")
                g.check()
                (out.float() * gout.float()).sum().backward()
                g.check()
                ref, ref_experts = static_reference(seed, 100 + step, E, dtype, experts)
                bad = static_compare("static step %d" % step, dtype, (out, x.grad, w.grad),
                                     ref, mine, ref_experts)
                bad += static_padding("static step %d %s" % (step, dtype), h, seen)
                if bad:
                    raise AssertionError("; ".join(bad))
            log.append("%d %s" % (steps, str(dtype).split(".")[1]))
        mismatch = static_mismatch(g, seed, E, dev)
    worst = " (bf16 worst relative error %.2g)" % max(BF16_ERR) if BF16_ERR else ""
    return ["static forward + backward equal: %s steps%s; %s" % (", ".join(log), worst,
                                                                 mismatch)]


def static_mismatch(g, seed, E, dev):
    """Rank 0 changes token 0's routing between forward and backward behind autograd's back
    (through .data, which no version counter sees): its backward pair sends that token to
    other ranks than the forward did. Every rank whose rows differ between the two pairs
    (the token's old ranks and its new one) gets BackwardMismatch from check() (found on the
    device, no host read), the others no error; then a step is equal again."""
    per = E // WORLD
    experts, mine = static_experts(seed, E, torch.float32, dev)
    x0, idx, w0, gout = static_inputs(seed, 200, E, dev, gout=True)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    out, _ = static_layer(g, mine, x, idx, w, E, layer=13)
    g.check()
    first = static_inputs(seed, 200, E, torch.device("cpu"), rank=0)[1][0]
    old = {int(e) // per for e in first if e >= 0}
    new = min(set(range(WORLD)) - old)
    if RANK == 0:
        idx.data[0] = torch.tensor([new * per] + [-1] * (K - 1), dtype=idx.dtype)
    (out.float() * gout.float()).sum().backward()
    if RANK in old | {new}:
        line = expect("static backward with other routing", g.check, railwave.BackwardMismatch,
                      "other rows than its forward")
    else:
        g.check()
        line = "routing changed elsewhere: no error here"
    x0, idx, w0, gout = static_inputs(seed, 201, E, dev, gout=True)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    for a, b in mine:
        a.grad = b.grad = None
    out, _ = static_layer(g, mine, x, idx, w, E, layer=13)
    g.check()
    (out.float() * gout.float()).sum().backward()
    g.check()
    ref, ref_experts = static_reference(seed, 201, E, torch.float32, experts)
    bad = static_compare("static step after the mismatch", torch.float32,
                         (out, x.grad, w.grad), ref, mine, ref_experts)
    if bad:
        raise AssertionError("; ".join(bad))
    return line + "; the next step equal"


def cmd_static_over(c):
    """Static mode with a capacity (max_recv_tokens) below what some rank receives, the rank
    page holding the worst case (max_tokens_per_rank): the rows past the capacity are
    dropped, the stream runs on, and Group.check() raises ReceiveRoomExceeded naming the room
    needed (the rows this rank was sent, counted from the reference's routing) on every rank
    that overflowed, once; a rank that fitted gets no error. A second step runs (the group
    was not failed) and says the same."""
    dev, E, seed = device(c), c["experts"], c["seed"]
    per = E // WORLD
    room = c["room"]
    x, idx, w = static_inputs(seed, 0, E, dev)
    need = 0  # rows this rank receives: every token of every rank with an expert here
    for r in range(WORLD):
        ridx = static_inputs(seed, 0, E, torch.device("cpu"), rank=r)[1]
        need += int(((ridx >= RANK * per) & (ridx < (RANK + 1) * per)).any(1).sum())
    _, experts, _ = workload(seed, 0, E, torch.float32, False)
    mine = [(a.to(dev), b.to(dev)) for a, b in experts[RANK * per:(RANK + 1) * per]]
    with join(c, static=True, max_recv_tokens=room) as g, torch.no_grad():
        lines = []
        for step in range(2):
            rx, ridx, rw, _, h = g.dispatch(x, idx, w, E, layer=14, step=0)
            if rx.shape[0] != room:
                raise AssertionError("recv_x has %d rows, the capacity is %d"
                                     % (rx.shape[0], room))
            g.combine(dense_experts(mine, 0, rx, ridx, rw), h)
            if need <= room:
                g.check()
                lines.append("capacity %d, %d rows: no error" % (room, need))
                continue
            lines.append(expect("static dispatch past the capacity", g.check,
                                railwave.ReceiveRoomExceeded, "the room needed: %d rows" % need,
                                "room of %d rows" % room))
            g.check()  # said once
    return lines


# The most a rank may wait for its check() to raise after another rank refused its own static
# call: a resource budget, a third of the clusters' 60 s phase timeout (PHASE_TIMEOUT in
# test_moe.py), so a rank left to the phase timeout fails it; the refusal itself takes a
# daemon's round trip.
STATIC_BAD_BUDGET_S = 20.0


def static_bad_step(g, mine, E, dev, seed, step, fn):
    """One static step of this rank: fn() instead of its dispatch when given (the bad call),
    else dispatch -> experts -> combine and check(). Returns (seconds to the raise, the error)
    or (seconds, None)."""
    x, idx, w = static_inputs(seed, step, E, dev)
    t0 = time.monotonic()
    try:
        if fn is not None:
            fn(x, idx, w)
        else:
            rx, ridx, rw, _, h = g.dispatch(x, idx, w, E, layer=21, step=0)
            g.combine(dense_experts(mine, 0, rx, ridx, rw), h)
        g.check()
    except railwave.RailWaveError as e:
        return time.monotonic() - t0, e
    return time.monotonic() - t0, None


def cmd_static_bad(c):
    """A bad argument on one rank of a static Group (docs/python.md "Static mode"): the rank
    raises its error naming the argument, and still takes its seat in the call with a refused
    one-token dispatch (railwave._core _poison_static), so every other rank's check() raises
    PeerFailed (the daemon's reason naming the refused rank) within STATIC_BAD_BUDGET_S, far
    below the phase timeout; then a step of every rank is equal to the one-process reference
    (the ranks' stream counters stayed in step). The first case is every rank's first call
    (the bad rank's rank path opens for the refusal). A combine's bad argument after a good
    dispatch: the rank aborts its combine through the stream (_abort_rank), every other rank's
    check() raises PeerFailed naming the abort, and 20 static pairs after it are equal. Last, a routing changed in place between
    forward and backward on one rank: BackwardMismatch there, PeerFailed naming it from the
    others' check() after their backward, then a forward + backward step equal (output and
    gradients) to the one-process reference."""
    dev, E, seed = device(c), c["experts"], c["seed"]
    _, experts, _ = workload(seed, 0, E, torch.float32, False)
    per = E // WORLD
    mine = [(a.to(dev), b.to(dev)) for a, b in experts[RANK * per:(RANK + 1) * per]]
    M = c["max_tokens"]
    cases = [
        (1 % WORLD, "wrong x dtype (the first call)",
         lambda x, i, w: g.dispatch(x.double(), i, w, E, layer=21, step=0),
         railwave.BadArgumentType, ("x has dtype torch.float64",)),
        (2 % WORLD, "above max_tokens_per_rank",
         lambda x, i, w: g.dispatch(torch.zeros(M + 1, H, device=dev), torch.zeros(
             M + 1, K, dtype=torch.int64, device=dev), torch.ones(M + 1, K, device=dev), E,
             layer=21, step=0),
         railwave.BadArgument, ("above max_tokens_per_rank %d" % M,)),
        (3 % WORLD, "topk_weights of another shape",
         lambda x, i, w: g.dispatch(x, i, w[:, :1].contiguous(), E, layer=21, step=0),
         railwave.BadArgument, ("topk_weights 1",)),
        (0, "an expert id out of range (found by the stream)",
         lambda x, i, w: g.dispatch(x, torch.full_like(i, E), w, E, layer=21, step=0),
         railwave.PhaseError, ("top-k expert id outside",)),
        (1 % WORLD, "a combine of another dtype (after a good dispatch)",
         lambda x, i, w: bad_combine(x, i, w),
         railwave.BadArgumentType, ("expert_out has dtype torch.float64",)),
    ]

    def bad_combine(x, i, w):
        """The dispatch as every rank's, then a combine its checks refuse: the rank aborts its
        combine through the stream (its slot marked abort), and the pair fails everywhere."""
        rx, ridx, rw, _, h = g.dispatch(x, i, w, E, layer=21, step=0)
        g.combine(dense_experts(mine, 0, rx, ridx, rw).double(), h)

    log, worst = [], 0.0
    with join(c, static=True) as g:
        for k, (who, what, fn, exc, needles) in enumerate(cases):
            combine = "combine" in what
            with torch.no_grad():
                took, err = static_bad_step(g, mine, E, dev, seed, 300 + k,
                                            fn if RANK == who else None)
            if err is None:
                raise AssertionError("%s on rank %d: rank %d raised nothing" % (what, who, RANK))
            if RANK == who:
                if not isinstance(err, exc) or any(n not in str(err) for n in needles):
                    raise AssertionError("%s: %s: %s, expected %s with %s"
                                         % (what, type(err).__name__, err, exc.__name__, needles))
                log.append("%s -> %s" % (what, str(err).splitlines()[0][:150]))
            else:
                msg = str(err)
                if not isinstance(err, railwave.PeerFailed) or "timed out after" in msg:
                    raise AssertionError("peer of %s: %s: %s, expected PeerFailed at once"
                                         % (what, type(err).__name__, msg))
                per_node = int(os.environ["LOCAL_WORLD_SIZE"])
                name = "local rank %d:" % who  # the daemon names a rank by its group rank
                if who // per_node != RANK // per_node:
                    name = "node %d (n%d): %s" % (who // per_node, who // per_node, name)
                # (a node that heard it from another node prefixes that node's name too)
                if "railwaved: " not in msg or name not in msg or \
                        (combine and "aborted its combine of layer 21" not in msg):
                    raise AssertionError("peer of %s: %s does not name the refused rank (%r)"
                                         % (what, msg, name))
                if took > STATIC_BAD_BUDGET_S:
                    raise AssertionError("peer of %s: check() raised after %.1f s, above the "
                                         "budget of %.0f s" % (what, took, STATIC_BAD_BUDGET_S))
                worst = max(worst, took)
                if k == 0 or RANK == (who + 1) % WORLD:
                    log.append("peer of %s -> %s" % (what, msg[msg.index("railwaved: "):][:160]))
            # the next step equal (after an aborted combine, 20: the ranks' phase numbers and
            # stream counters stayed in step, where a rank that left and joined again restarted
            # its counters and no later static call of it met the others')
            for j in range(20 if combine else 1):
                x, idx, w = static_inputs(seed, 400 + 20 * k + j, E, dev)
                with torch.no_grad():
                    rx, ridx, rw, _, h = g.dispatch(x, idx, w, E, layer=21, step=0)
                    out = g.combine(dense_experts(mine, 0, rx, ridx, rw), h)
                g.check()
                ref = local_reference(x.cpu(), idx.cpu(), w.cpu(), experts)
                if not torch.equal(out.cpu(), ref):
                    raise AssertionError("static step %d after %s: output differs" % (j, what))
            if combine:
                log.append("20 static pairs after the aborted combine equal")
        # Rank 1 changes its topk_idx in place between forward and backward: its backward is
        # refused before its backward pair (BackwardMismatch), and the pair fails for the
        # others through the stream (their check() after the backward: PeerFailed naming it).
        experts_t, mine_t = static_experts(seed, E, torch.float32, dev)
        if not c.get("backward", True):
            log.append("skip: a routing changed in place before the static backward (the "
                       "ASan stand-in preloaded: the release build runs it)")
        for step in (500, 501) if c.get("backward", True) else ():
            x0, idx, w0, gout = static_inputs(seed, step, E, dev, gout=True)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            for a, b in mine_t:
                a.grad = b.grad = None
            out, _ = static_layer(g, mine_t, x, idx, w, E, layer=22)
            g.check()
            if step == 500 and RANK == 1 % WORLD:
                idx.add_(0)  # same values, a new version: an in-place routing change
                log.append(expect("topk_idx changed in place before the static backward",
                                  lambda: (out.float() * gout.float()).sum().backward(),
                                  railwave.BackwardMismatch, "changed in place"))
                continue
            t0 = time.monotonic()
            (out.float() * gout.float()).sum().backward()
            if step == 500:
                log.append(expect("peer of a routing changed in place", g.check,
                                  railwave.PeerFailed, "railwaved: ", "local rank %d:"
                                  % (1 % WORLD)))
                worst = max(worst, time.monotonic() - t0)
                continue
            g.check()
            ref, ref_experts = static_reference(seed, step, E, torch.float32, experts_t)
            bad = static_compare("static step after the refused backward", torch.float32,
                                 (out, x.grad, w.grad), ref, mine_t, ref_experts)
            if bad:
                raise AssertionError("; ".join(bad))
    log.append("every step after a refusal equal; the others' check() raised within %.2f s "
               "(budget %.0f s, phase timeout 60 s)" % (worst, STATIC_BAD_BUDGET_S))
    return log


def cmd_static_sms(c):
    """The SM budget (docs/python.md "SMs"): static steps with Group(num_sms=2), then
    set_num_sms(0) (the kernels' own choice), then set_num_sms(2) again, each step's output
    equal to the one-process reference; the kernel stand-in tells the largest grid each step
    launched: at most 2 blocks under the budget, more without it (the check can fail). Bad
    budgets raise BadArgument (below 0 in the package, above the device's SMs from
    librailwave) and leave the budget as it was."""
    dev, E, seed = device(c), c["experts"], c["seed"]
    if dev.type != "cpu":
        return ["skip: the largest grid is the kernel stand-in's"]
    import ctypes
    grid = ctypes.CDLL(os.environ["RW_CUDA_DRIVER"]).rw_fake_cuda_grid_take
    grid.restype = ctypes.c_ulonglong
    _, experts, _ = workload(seed, 0, E, torch.float32, False)
    per = E // WORLD
    mine = [(a.to(dev), b.to(dev)) for a, b in experts[RANK * per:(RANK + 1) * per]]
    seen = []
    with join(c, static=True, num_sms=2) as g, torch.no_grad():
        for step, budget in enumerate((2, 0, 2)):
            if step:
                g.set_num_sms(budget)
            x, idx, w = static_inputs(seed, 300 + step, E, dev)
            grid()
            rx, ridx, rw, _, h = g.dispatch(x, idx, w, E, layer=16, step=0)
            out = g.combine(dense_experts(mine, 0, rx, ridx, rw), h)
            g.check()
            most = grid()
            seen.append(most)
            if not torch.equal(out.cpu(), local_reference(x.cpu(), idx.cpu(), w.cpu(),
                                                          experts)):
                raise AssertionError("budget %d: output differs" % budget)
            if budget and most > budget:
                raise AssertionError("budget %d: a kernel launched %d blocks" % (budget, most))
            if not budget and most <= 2:
                raise AssertionError("no budget: the largest grid is %d blocks, so the budget "
                                     "cases prove nothing" % most)
        lines = [expect("num_sms -1", lambda: g.set_num_sms(-1), railwave.BadArgument,
                        "num_sms must be an int >= 0"),
                 expect("num_sms 100000", lambda: g.set_num_sms(100000),
                        railwave.BadArgument, "100000")]
        if g.num_sms != 2:
            raise AssertionError("a refused budget changed it to %d" % g.num_sms)
    return ["SM budget: largest grids %s at budgets 2, none, 2; outputs equal; %s"
            % (seen, "; ".join(lines))]


def cmd_graph(c):
    """A CUDA graph of dispatch -> experts -> combine captured once and replayed c["replays"]
    times with fresh inputs copied into its input tensors: every replay's output equal to the
    one-process reference (GPU only). First a capture whose dispatch would open the rank path:
    refused with RailWaveError before anything is enqueued (the open waits on the host)."""
    dev, E, seed = device(c), c["experts"], c["seed"]
    _, experts, _ = workload(seed, 0, E, torch.float32, False)
    per = E // WORLD
    mine = [(a.to(dev), b.to(dev)) for a, b in experts[RANK * per:(RANK + 1) * per]]
    with join(c, static=True) as g, torch.no_grad():
        xs, idxs, ws = static_inputs(seed, 0, E, dev)
        early = torch.cuda.CUDAGraph()

        def capture_first():
            with torch.cuda.graph(early):
                xs.add(0)  # a node: the capture ends cleanly when the dispatch raises
                g.dispatch(xs, idxs, ws, E, layer=12, step=0)
        refused = expect("a dispatch captured before the rank path opened", capture_first,
                         railwave.RailWaveError, "make one dispatch before capturing")
        del early
        rx, ridx, rw, _, h = g.dispatch(xs, idxs, ws, E, layer=12, step=0)  # opens the path
        g.combine(dense_experts(mine, 0, rx, ridx, rw), h)
        g.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rx, ridx, rw, _, h = g.dispatch(xs, idxs, ws, E, layer=12, step=0)
            outs = g.combine(dense_experts(mine, 0, rx, ridx, rw), h)
        g.check()
        for r in range(c["replays"]):
            x, idx, w = static_inputs(seed, 1 + r, E, dev)
            xs.copy_(x)
            idxs.copy_(idx)
            ws.copy_(w)
            graph.replay()
            g.check()
            ref = local_reference(x.cpu(), idx.cpu(), w.cpu(), experts)
            if not torch.equal(outs.cpu(), ref):
                raise AssertionError("replay %d: output differs (max |diff| %s)" % (
                    r, (outs.cpu() - ref).abs().max().item()))
    return ["graph captured once, %d replays with fresh inputs equal; %s" % (c["replays"],
                                                                              refused)]


CAPTURE_STATUS = ("none", "active", "invalidated")  # CUstreamCaptureStatus


class CaptureProbe:
    """Where a CUDA graph capture broke: mark(stage), after each stage of the captured step,
    reads the capturing stream's status (cuStreamIsCapturing, legal during a capture: from the
    first illegal call on it reads "invalidated"), in the forward and from the backward's hooks
    on autograd's device thread. Every later call on the stream fails with "operation failed
    due to a previous error during capture", which names nothing."""

    def __init__(self, stream):
        import ctypes
        self.ctypes = ctypes
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.cu.cuStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self.stream = ctypes.c_void_p(stream.cuda_stream)
        self.seen = []  # (stage, status)

    def mark(self, stage):
        st = self.ctypes.c_int(-1)
        rc = self.cu.cuStreamIsCapturing(self.stream, self.ctypes.byref(st))
        ok = rc == 0 and 0 <= st.value < len(CAPTURE_STATUS)
        self.seen.append((stage, CAPTURE_STATUS[st.value] if ok else "CUresult %d" % rc))

    def where(self):
        last = "its start"
        for stage, status in self.seen:
            if status != "active":
                return "capture %s by the stage '%s' (active after '%s')" % (status, stage, last)
            last = stage
        return "capture still active after its last stage marked, '%s'" % last


def exception_chain(e, width=240):
    """e and the exceptions it was raised while handling, the first raised first, one line each
    (a failed capture's own error comes last: torch.cuda.graph ends the capture on the way
    out, and that raises too)."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).strip().splitlines()
        chain.append("%s: %s" % (type(e).__name__, text[0][:width] if text else ""))
        e = e.__cause__ or e.__context__
    return chain[::-1]


def capture(graph, stream, step, mark):
    """step(mark) captured into graph on stream, a host synchronization in it raising at once
    (torch.cuda.set_sync_debug_mode: a capture cannot wait). Returns (step's result or None,
    what was raised or None, the distinct warnings PyTorch gave meanwhile, first lines)."""
    res = err = None
    prev = torch.cuda.current_stream(stream.device)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            with torch.cuda.graph(graph, stream=stream):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    res = step(mark)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
        except Exception as e:
            err = e
            torch.cuda.set_stream(prev)  # a failed capture_end skips torch.cuda.graph's restore
    said = []
    for w in warned:
        line = (str(w.message).strip().splitlines() or [""])[0][:300]
        if line not in said:
            said.append(line)
    return res, err, said


def stage_waits(done, limit=90.0):
    """A mark for an eager run of a captured step: waits (at most limit s, above the test
    clusters' phase timeout) for the current stream's work so far, so that an asynchronous
    error is raised by the stage that made it; done gets each stage passed."""
    def mark(stage):
        ev = torch.cuda.Event()
        ev.record()
        deadline = time.monotonic() + limit
        while not ev.query():
            if time.monotonic() > deadline:
                raise TimeoutError("the stream did not get through '%s' in %.0f s" % (stage, limit))
            time.sleep(1e-3)
        torch.cuda.synchronize()
        done.append(stage)
    return mark


def cmd_graph_train(c):
    """A CUDA graph of the layer's forward and backward (dispatch -> experts -> combine, the
    loss, backward: two pairs a replay) captured once after an eager warm-up and replayed
    c["replays"] times with fresh inputs, routing and output gradients copied in: every
    replay's output and gradients equal to the one-process reference (GPU only).

    The warm-up runs on the stream the capture then uses (PyTorch's recipe), and its autograd
    graph is dropped before the capture: a leaf's gradient accumulator (AccumulateGrad) kept
    alive from the warm-up keeps the stream it was made on, and the captured backward makes
    that stream wait for captured work; the default stream cannot join a capture, which is
    then invalidated (PyTorch warns: "The AccumulateGrad node's stream does not match ...
    break CUDA graph capture if the AccumulateGrad node's stream is the default stream"). This
    test's warm-up once ran on the default stream and held its output through the capture.
    A failed capture is raised with where it broke (CaptureProbe), the first error of the
    chain, PyTorch's warnings, and an eager run of the same step with a wait after each stage
    (every rank fails the capture alike, so every rank runs it: the same calls as a replay)."""
    dev, E, seed = device(c), c["experts"], c["seed"]
    experts, mine = static_experts(seed, E, torch.float32, dev)
    params = [p for ab in mine for p in ab]
    with join(c, static=True) as g:
        xs, idxs, ws, gs = static_inputs(seed, 0, E, dev, gout=True)
        xs.requires_grad_()
        ws.requires_grad_()
        leaves = params + [xs, ws]

        def step(mark):
            o, _ = static_layer(g, mine, xs, idxs, ws, E, layer=15, mark=mark)
            (o.float() * gs.float()).sum().backward()
            mark("backward's end (the leaves' gradients)")
            return o

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            step(lambda what: None)  # opens the path
            g.check()
        torch.cuda.current_stream(dev).wait_stream(side)
        for p in leaves:
            p.grad = None  # the captured backward makes them in the graph's pool
        graph = torch.cuda.CUDAGraph()
        probe = CaptureProbe(side)
        outs, err, said = capture(graph, side, step, probe.mark)
        if err is not None:
            chain = exception_chain(err)
            for p in leaves:
                p.grad = None
            done = []
            try:
                with torch.cuda.stream(side):
                    step(stage_waits(done))
                    g.check()
                rerun = "all %d stages passed" % len(done)
            except Exception as e:
                rerun = "failed after '%s': %s" % (done[-1] if done else "its start",
                                                   exception_chain(e)[0])
            raise AssertionError(
                "capture of forward + backward failed: %s; first error: %s; PyTorch warned: "
                "%s; eager run with a wait after each stage: %s%s" % (
                    probe.where(), chain[0], " | ".join(said) or "nothing", rerun,
                    "; then: " + " <- ".join(chain[1:]) if len(chain) > 1 else "")) from None
        g.check()
        for r in range(c["replays"]):
            x, idx, w, gout = static_inputs(seed, 1 + r, E, dev, gout=True)
            with torch.no_grad():
                for dst, src in ((xs, x), (idxs, idx), (ws, w), (gs, gout)):
                    dst.copy_(src)
            graph.replay()
            g.check()
            ref, ref_experts = static_reference(seed, 1 + r, E, torch.float32, experts)
            bad = static_compare("replay %d" % r, torch.float32, (outs, xs.grad, ws.grad), ref,
                                 mine, ref_experts)
            if bad:
                raise AssertionError("; ".join(bad))
    return ["forward + backward graph captured once, %d replays with fresh inputs equal"
            % c["replays"]]


def cmd_recover(c):
    with join(c) as g:
        bad, _ = run_step(g, c["seed"], 2, c["experts"], torch.float32, layer=0)
        if bad:
            raise AssertionError("; ".join(bad))
    return ["rejoined; step after the restart equal"]


def main():
    for line in sys.stdin:
        c = json.loads(line)
        RANK_PATH[0] = bool(c.get("rank_path"))
        try:
            log = {"paths": cmd_paths, "flood": cmd_flood, "bad": cmd_bad, "open": cmd_open,
                   "lost": cmd_lost, "recover": cmd_recover, "kill_a": cmd_kill_a,
                   "kill_b": cmd_kill_b, "static": cmd_static,
                   "static_train": cmd_static_train, "static_over": cmd_static_over,
                   "static_sms": cmd_static_sms, "static_bad": cmd_static_bad,
                   "graph": cmd_graph, "graph_train": cmd_graph_train}[c["op"]](c)
            print(json.dumps({"ok": True, "log": log}), flush=True)
        except Exception as e:
            print(json.dumps({"ok": False, "error": "%s: %s\n%s" % (
                type(e).__name__, e, traceback.format_exc()[-1500:])}), flush=True)


if __name__ == "__main__":
    main()
