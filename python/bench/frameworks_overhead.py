#!/usr/bin/env python3
"""Benchmark (not a test): host time per dispatch+combine pair of the framework wrappers against
the bare railwave.Group pair on the same group, in the same run (docs/perf/python.md
"Framework wrappers"):

  /usr/bin/python3 python/bench/frameworks_overhead.py [--build build] [--iters 1000] [--device cpu]

One railwaved node, 2 rank processes running the same loop. Each size measures, interleaved in
blocks of 50 pairs so that load drifts hit all alike:
  * group:   Group.dispatch + Group.combine (identity experts: each received row back as is);
  * buffer:  railwave.deep_ep.Buffer as Megatron-Core calls it: get_dispatch_layout, dispatch
             with previous_event and async_finish (then current_stream_wait), combine likewise;
  * ops:     torch.ops.railwave.dispatch + torch.ops.railwave.combine under no_grad;
  * layout:  the same plus expert_major (alignment 1) and combine_rows between them, as the
             TorchTitan dispatcher runs them (its own all-to-all dispatcher permutes likewise).
Prints rank 0's median µs per pair and each wrapper's extra over the group pair."""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
SIZES = [(16, 256, 2, 8), (128, 1024, 4, 8), (512, 4096, 8, 16)]  # tokens, hidden, topk, experts
KINDS = ("group", "buffer", "ops", "layout")


def worker(a):
    import torch
    sys.path.insert(0, os.path.join(SRC, "python"))
    import railwave
    from railwave import deep_ep, ops
    from railwave.layout import combine_rows, expert_major
    torch.set_num_threads(1)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    T, H, K, E = a.tokens, a.hidden, a.topk, a.experts
    x = torch.randn(T, H, device=dev)
    w = torch.ones(T, K, device=dev)
    base = torch.arange(T).unsqueeze(1) + torch.arange(K).unsqueeze(0) * (E // K)
    idxs = [((base + it) % E).to(dev) for it in range(64)]
    g = railwave.Group(a.group, a.rank, a.world, socket=a.socket, node=0)
    buf = deep_ep.Buffer(g)
    ops.use(buf)
    el = E // a.world

    def group_pair(it):
        rx, _, _, _, h = g.dispatch(x, idxs[it % 64], w, E, layer=1, step=it)
        g.combine(rx, h)

    def buffer_pair(it):
        idx = idxs[it % 64]
        per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(
            idx, E, previous_event=buf.capture(), async_finish=True)
        rx, ridx, rw, counts, h, ev = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=ev,
            async_finish=True)
        ev.current_stream_wait()
        out, _, ev = buf.combine(rx, h, previous_event=buf.capture(), async_finish=True)
        ev.current_stream_wait()

    def ops_pair(it):
        with torch.no_grad():
            rx, ridx, rw, _, hid = ops.dispatch(x, idxs[it % 64], w, E)
            ops.combine(rx, hid)

    def layout_pair(it):
        with torch.no_grad():
            rx, ridx, rw, _, hid = ops.dispatch(x, idxs[it % 64], w, E)
            rows, lay = expert_major(rx, ridx, rw, el)
            ops.combine(combine_rows(rows, lay, weighted=False), hid)

    fns = {"group": group_pair, "buffer": buffer_pair, "ops": ops_pair, "layout": layout_pair}
    times = {k: [] for k in KINDS}
    it = 0
    for block in range(a.iters // 50 + 2):  # the first two blocks warm up
        for k in KINDS:
            for _ in range(50):
                t0 = time.perf_counter()
                fns[k](it)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if block >= 2:
                    times[k].append((time.perf_counter() - t0) * 1e6)
                it += 1
    buf.destroy()
    g.close()
    print(" ".join("%s %.2f" % (k, statistics.median(times[k])) for k in KINDS))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(SRC, "build"))
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", type=int, default=len(SIZES))
    ap.add_argument("--worker", help="run one rank: its settings as JSON (run_size)")
    a = ap.parse_args()
    if a.worker:
        return worker(argparse.Namespace(device=a.device, iters=a.iters, **json.loads(a.worker)))
    build = os.path.abspath(a.build)
    env = dict(os.environ, RAILWAVE_LIB=os.path.join(build, "lib", "librailwave.so.1"),
               OMP_NUM_THREADS="1")
    sys.path.insert(0, os.path.join(build, "tests", "lib"))
    import cluster as td  # tests/lib/cluster.py as the build copied it: that build's binaries
    print("%s tensors, fp32, identity experts, medians of rank 0 in µs per pair (%d pairs per "
          "kind); load average %s" % (a.device, a.iters, load()))
    print("%-18s %9s %9s %9s %9s %11s %11s %11s" % (
        "T x H, topk, E", "group", "buffer", "ops", "layout", "buffer-grp", "ops-grp",
        "layout-grp"))
    with tempfile.TemporaryDirectory(prefix="rwfwb.", dir="/tmp") as tmp, \
            one_node(td, tmp) as sock:
        for T, H, K, E in SIZES[:a.sizes]:
            m = run_size(a, sock, td.GPUS, env, T, H, K, E)
            print("%-18s %9.1f %9.1f %9.1f %9.1f %11.1f %11.1f %11.1f" % (
                "%d x %d, %d, %d" % (T, H, K, E), m["group"], m["buffer"], m["ops"],
                m["layout"], m["buffer"] - m["group"], m["ops"] - m["group"],
                m["layout"] - m["group"]), flush=True)
    print("load average at the end %s" % load())


def load():
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


@contextlib.contextmanager
def one_node(td, tmp):
    """One railwaved (tests/lib/cluster.py's Cluster); yields its IPC socket."""
    c = td.Cluster(tmp, 1, path="auto", extra={"log_level": "warn"})
    c.start_all()
    try:
        yield c.cfg["nodes"][0]["ipc_socket"]
    finally:
        c.stop()


def run_size(a, sock, world, env, T, H, K, E):
    """Rank 0's medians {kind: µs} for one size."""
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--device", a.device, "--iters", str(a.iters),
         "--worker", json.dumps({"socket": sock, "group": "fw%d" % T, "rank": r, "world": world,
                                 "tokens": T, "hidden": H, "topk": K, "experts": E})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for r in range(world)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(o[-1500:] for o in outs))
    f = outs[0].strip().splitlines()[-1].split()
    return {f[i]: float(f[i + 1]) for i in range(0, len(f), 2)}


if __name__ == "__main__":
    sys.exit(main())
