#!/usr/bin/env python3
"""Benchmark (not a test): the railwave Python package's overhead per dispatch+combine pair
against the C client (build/bench/pair_bench) on the same phases, in the same run. Results and
the command: docs/perf/python.md.

  /usr/bin/python3 python/bench/overhead.py [--build build] [--iters 2000] [--before DIR]
  /usr/bin/python3 python/bench/overhead.py --rank-path [--build build] [--iters 2000]

--before DIR also measures another copy of the package (DIR holds its railwave/, e.g. an older
commit's python/ from `git archive`), in the same run, between the C and the current package.

Two daemons, each measured with C then Python, for every size:
  * echo: build/bench/ipc_bench --serve, which completes every submission at once — what is left
    is the client side alone (submit, wait, Python's argument checks, copies, result tensors);
  * railwaved: one real node (G = 2 ranks, both run the same client concurrently), a purely
    node-local phase, so the daemon's work is included and the same for both clients.
Both clients wait alike (busy-poll --spin-us, then sleep on the eventfd), use identity experts
(each received row is combined back as is), fp32 rows, and report the median pair time (wall)
and the process's CPU time per pair (cpu: what the client itself spent, spinning included; on a
shared machine it moves less than wall time) after 100 warm-up pairs.

--rank-path: librailwave's rank path instead (docs/python.md "The rank path"), on two real
nodes (two ranks each, group carve-outs of 32 MiB, tcp loopback rails; the first two sizes fit),
CUDA tensors where torch sees a GPU, else CPU tensors on the kernel stand-in driver (tests/integration/libfakecuda_kern.so: its "kernels" run on the CPU,
some inside the enqueueing call). Per dispatch and per combine: the host time of the call (its
wall time less the time it was blocked waiting for the stream's done word: the enqueue, the
argument checks, the result tensors), p50 over the pairs, and the pair's wall time; beside it
the ring path with CPU tensors on the same daemons in the same run, whose calls wait on the
completion ring inside (their whole wall time per call: no host part is separable there)."""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
SIZES = [(16, 256, 2, 8), (128, 1024, 4, 8), (512, 4096, 8, 16)]  # tokens, hidden, topk, experts


def worker(a):
    """One Python rank: a.iters pairs, prints the C bench's line format."""
    import torch
    sys.path.insert(0, a.pkg or os.path.join(SRC, "python"))
    import railwave
    torch.set_num_threads(1)
    T, H, K, E = a.tokens, a.hidden, a.topk, a.experts
    x = torch.arange(T, dtype=torch.float32).unsqueeze(1).expand(T, H).contiguous()
    w = torch.ones(T, K)
    base = (torch.arange(T).unsqueeze(1) + torch.arange(K).unsqueeze(0) * (E // K))
    with railwave.Group(a.group, a.rank, a.world, socket=a.socket, node=a.node,
                        spin_us=a.spin_us) as g:
        times = []
        idxs = [(base + it) % E for it in range(a.iters + 100)]
        for it in range(a.iters + 100):
            idx = idxs[it]
            if it == 100:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            rx, ridx, rw, cnt, h = g.dispatch(x, idx, w, E, layer=0, step=it)
            g.combine(rx, h)
            if it >= 100:
                times.append((time.perf_counter() - t0) * 1e6)
        cpu = (time.process_time() - cpu0) / a.iters * 1e6
    print("pairs %d p50_us %.2f mean_us %.2f cpu_us %.2f" % (
        a.iters, statistics.median(times), statistics.mean(times), cpu))


def rank_worker(a):
    """One Python rank on the rank path: a.iters pairs; prints host µs per dispatch and per
    combine (p50) and the pair's wall time. a.ring: the ring path with CPU tensors instead."""
    import torch
    sys.path.insert(0, os.path.join(SRC, "python"))
    import railwave
    torch.set_num_threads(1)
    dev = torch.device("cuda", 0) if torch.cuda.is_available() and not a.ring else \
        torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    T, H, K, E = a.tokens, a.hidden, a.topk, a.experts
    x = torch.arange(T, dtype=torch.float32).unsqueeze(1).expand(T, H).contiguous().to(dev)
    w = torch.ones(T, K, device=dev)
    base = (torch.arange(T).unsqueeze(1) + torch.arange(K).unsqueeze(0) * (E // K))
    idxs = [((base + it) % E).to(dev) for it in range(a.iters + 100)]
    hd, hc, wall = [], [], []
    with railwave.Group(a.group, a.rank, a.world, socket=a.socket, node=a.node,
                        local_gpu=a.rank % 2, max_tokens_per_rank=T,
                        spin_us=a.spin_us) as g:
        with torch.no_grad():
            for it in range(a.iters + 100):
                rp = g._rank
                w0 = rp.waited if rp else 0.0
                t0 = time.perf_counter()
                rx, ridx, rw, cnt, h = g.dispatch(x, idxs[it], w, E, layer=0, step=it)
                t1 = time.perf_counter()
                rp = g._rank
                w1 = rp.waited if rp else 0.0
                g.combine(rx, h)
                t2 = time.perf_counter()
                w2 = rp.waited if rp else 0.0
                if it >= 100:
                    hd.append((t1 - t0 - (w1 - w0)) * 1e6)
                    hc.append((t2 - t1 - (w2 - w1)) * 1e6)
                    wall.append((t2 - t0) * 1e6)
        if not a.ring and (g._rank is None or g._rank.phase.value == 0):
            raise RuntimeError("the rank path did not open: %s" % g._rank_off)
    print("pairs %d host_dispatch_us %.2f host_combine_us %.2f wall_us %.2f dev %s" % (
        a.iters, statistics.median(hd), statistics.median(hc), statistics.median(wall), dev))


def rank_main(a, build, env):
    """--rank-path: the table of the module docstring."""
    import torch
    env = dict(env, RAILWAVE_RANK_PATH="1")
    if not torch.cuda.is_available():
        env.update(RW_CUDA_DRIVER=os.path.join(build, "tests", "integration",
                                               "libfakecuda_kern.so"),
                   RAILWAVE_TEST_HOST_AS_DEVICE="1")
    print("rank path, %s; up to %d pairs per size, spin %d us, fp32, identity experts; medians "
          "of rank 0; load average %s" % (
              "CUDA tensors on %s" % torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else "CPU tensors on the kernel stand-in", a.iters, a.spin_us,
              open("/proc/loadavg").read().split()[:3]))
    print("%-18s %12s %12s %10s %12s %12s %10s" % (
        "T x H, topk, E", "rank: disp", "comb", "pair", "ring: disp", "comb", "pair"))
    print("%-18s %12s %12s %10s %12s %12s %10s" % (
        "", "host µs", "host µs", "wall µs", "call µs", "call µs", "wall µs"))
    with tempfile.TemporaryDirectory(prefix="rwbench.", dir="/tmp") as tmp:
        sys.path.insert(0, os.path.join(build, "tests", "lib"))
        import cluster
        # two nodes: a one-node group fails on the rank path today ("record at rail 0 slot 0
        # of the local area: bad header")
        c = cluster.Cluster(tmp, 2, path="auto", extra={"log_level": "warn", "group_area_mib": 32,
                                                        "group_pool_mib": 128})
        c.start_all()
        try:
            socks = [n["ipc_socket"] for n in c.cfg["nodes"]]
            world = 2 * c.gpus
            for T, H, K, E in SIZES[:a.sizes]:
                iters = max(100, min(a.iters, a.iters * 16384 // (T * H)))
                res = {}
                for kind in ("rank", "ring"):
                    cmds = [[sys.executable, os.path.abspath(__file__), "--rank-worker",
                             "--socket", socks[r // c.gpus], "--rank", str(r), "--world",
                             str(world), "--node", str(r // c.gpus), "--group", "r.%s.%d" % (kind, T), "--tokens",
                             str(T), "--hidden", str(H), "--topk", str(K), "--experts", str(E),
                             "--iters", str(iters), "--spin-us", str(a.spin_us)]
                            + (["--ring"] if kind == "ring" else []) for r in range(world)]
                    renv = env if kind == "rank" else dict(env, RAILWAVE_RANK_PATH="0")
                    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                              stderr=subprocess.STDOUT, env=renv)
                             for cmd in cmds]
                    outs = [p.communicate(timeout=600)[0] for p in procs]
                    bad = ["rank %d: %s" % (r, o[-600:]) for r, (p, o) in
                           enumerate(zip(procs, outs)) if p.returncode]
                    if bad:
                        raise RuntimeError("%s\n%s" % ("\n".join(bad), c.logs()))
                    f = outs[0].strip().splitlines()[-1].split()
                    res[kind] = [float(f[f.index(k) + 1]) for k in
                                 ("host_dispatch_us", "host_combine_us", "wall_us")]
                print("%-18s %12.1f %12.1f %10.1f %12.1f %12.1f %10.1f" % ((
                    "%d x %d, %d, %d" % (T, H, K, E),) + tuple(res["rank"]) + tuple(res["ring"])),
                    flush=True)
        finally:
            c.stop()
    print("load average at the end %s" % open("/proc/loadavg").read().split()[:3])
    return 0


def parse(out):
    f = out.split()
    return float(f[f.index("p50_us") + 1]), float(f[f.index("cpu_us") + 1])


def run_ranks(cmds, env):
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for c in cmds]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, o in zip(procs, outs):
        if p.returncode:
            raise RuntimeError("rank failed: %s" % o[-800:])
    return [parse(o.strip().splitlines()[-1]) for o in outs]


def measure(build, sockets, world, per_node, group, T, H, K, E, iters, spin, env, before):
    iters = max(100, min(iters, iters * 16384 // (T * H)))  # fewer pairs for the big rows
    common = ["--tokens", str(T), "--hidden", str(H), "--topk", str(K), "--experts", str(E),
              "--iters", str(iters), "--spin-us", str(spin)]
    res = {}
    for kind in ("c", "before", "py") if before else ("c", "py"):
        cmds = []
        for r in range(world):
            args = ["--rank", str(r), "--world", str(world), "--node", str(r // per_node),
                    "--group", "%s.%s.%d" % (group, kind, T)] + common
            if kind == "c":
                cmds.append([os.path.join(build, "bench", "pair_bench"), sockets[r // per_node]]
                            + args)
            else:
                cmds.append([sys.executable, os.path.abspath(__file__), "--worker",
                             "--socket", sockets[r // per_node]] + args +
                            (["--pkg", before] if kind == "before" else []))
        res[kind] = run_ranks(cmds, env)[0]  # rank 0's (median wall, CPU per pair)
    return res


def row(daemon, T, H, K, E, r):
    (cw, cc), (pw, pc) = r["c"], r["py"]
    if "before" in r:
        (bw, bc) = r["before"]
        print("%-10s %-18s %8.1f %8.1f %8.1f %10.1f %10.1f %8.1f %8.1f %8.1f %10.1f %10.1f" % (
            daemon, "%d x %d, %d, %d" % (T, H, K, E), cw, bw, pw, (bw - cw) / 2, (pw - cw) / 2,
            cc, bc, pc, (bc - cc) / 2, (pc - cc) / 2), flush=True)
        return
    print("%-10s %-18s %8.1f %8.1f %8.1f %10.1f %8.1f %8.1f %8.1f %10.1f" % (
        daemon, "%d x %d, %d, %d" % (T, H, K, E), cw, pw, pw - cw, (pw - cw) / 2,
        cc, pc, pc - cc, (pc - cc) / 2), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(SRC, "build"))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--spin-us", type=int, default=50)
    ap.add_argument("--sizes", type=int, default=len(SIZES), help="the first N sizes only")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank-path", action="store_true", help="the rank path's host time")
    ap.add_argument("--rank-worker", action="store_true")
    ap.add_argument("--ring", action="store_true")
    for o in ("socket", "group", "pkg", "before"):
        ap.add_argument("--" + o)
    for o in ("rank", "world", "node", "tokens", "hidden", "topk", "experts"):
        ap.add_argument("--" + o, type=int, default=0)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.rank_worker:
        return rank_worker(a)
    build = os.path.abspath(a.build)
    env = dict(os.environ, RAILWAVE_LIB=os.path.join(build, "lib", "librailwave.so.1"),
               OMP_NUM_THREADS="1")
    if a.rank_path:
        return rank_main(a, build, env)
    print("up to %d pairs per size (fewer for big rows), spin %d us, fp32, identity experts; "
          "medians of rank 0 (µs per dispatch+combine pair); load average %s"
          % (a.iters, a.spin_us, open("/proc/loadavg").read().split()[:3]))
    before = os.path.abspath(a.before) if a.before else None
    if before:
        print("%-10s %-18s %8s %8s %8s %10s %10s %8s %8s %8s %10s %10s" % (
            "daemon", "T x H, topk, E", "wall C", "before", "after", "call-C bef",
            "call-C aft", "cpu C", "before", "after", "call-C bef", "call-C aft"))
    else:
        print("%-10s %-18s %8s %8s %8s %10s %8s %8s %8s %10s" % (
            "daemon", "T x H, topk, E", "wall C", "Python", "py - C", "per call",
            "cpu C", "Python", "py - C", "per call"))
    with tempfile.TemporaryDirectory(prefix="rwbench.", dir="/tmp") as tmp:
        sock = os.path.join(tmp, "echo.sock")
        echo = subprocess.Popen([os.path.join(build, "bench", "ipc_bench"), "--serve", sock])
        try:
            for _ in range(100):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
            for T, H, K, E in SIZES[:a.sizes]:
                row("echo", T, H, K, E,
                    measure(build, [sock], 1, 1, "echo", T, H, K, E, a.iters, a.spin_us, env,
                            before))
        finally:
            echo.terminate()
            echo.wait()
        sys.path.insert(0, os.path.join(build, "tests", "lib"))
        import cluster  # tests/lib/cluster.py as the build copied it: that build's binaries
        c = cluster.Cluster(tmp, 1, path="auto", extra={"log_level": "warn"})
        c.start_all()
        try:
            for T, H, K, E in SIZES[:a.sizes]:
                row("railwaved", T, H, K, E,
                    measure(build, [c.cfg["nodes"][0]["ipc_socket"]], c.gpus, c.gpus,
                            "d", T, H, K, E, a.iters, a.spin_us, env, before))
        finally:
            c.stop()
    print("load average at the end %s" % open("/proc/loadavg").read().split()[:3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
