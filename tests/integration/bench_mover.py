#!/usr/bin/env python3
"""Benchmark (not a test; docs/perf/cuda-mover.md): the CUDA data mover against the host
(staging) mover on the same phases. Two railwaved on loopback (tcp rails, as the integration
test), 2 ranks per node with CUDA buffers on the one GPU (rw_rank --cuda --timing: every result
still checked exactly), the same seed for both movers (RAILWAVE_CUDA_MOVER=0 turns the CUDA mover
off). Per phase: time from the last rank's submission to the last rank's completion (one clock:
CLOCK_MONOTONIC of the one machine), bytes = the rows delivered (dispatch) or given back
(combine) x row bytes; the median over the phases of each (tokens, dtype, kind). Also each
daemon's CPU seconds (user + system) over the run, and the device-to-device copy bandwidth of
the same GPU in the same run (build/cuda/bench_pack).

  python3 bench_mover.py [--hidden 7168] [--tokens 256,1024] [--layers 4] [--steps 2]
  (run from the build directory's bench/ copy: $b/bench/cuda_mover)"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)
from cluster import cpu_seconds  # noqa: E402


def run(tmp, mover, tokens, hidden, layers, steps, seed):
    recv_mib = max(64, 4 * tokens * hidden * 4 * 4 // (1 << 20))
    c = cluster.Cluster(tmp, 2, path="joint", extra={"recv_region_mib": recv_mib})
    if mover == "host":
        c.env["RAILWAVE_CUDA_MOVER"] = "0"
    else:
        c.env.pop("RAILWAVE_CUDA_MOVER", None)
    phases, cpu = {}, 0.0
    try:
        c.start_all()
        procs = [(r, c.rank(r, "g.bench", layers, steps, seed,
                            flags=["--cuda", "--timing", "--tokens", str(tokens), "--hidden", str(hidden)]))
                 for r in range(c.nodes * c.gpus)]
        outs = c.collect(procs)
        cpu = sum(cpu_seconds(p.pid) for p in c.procs.values())
        for r, out in outs.items():
            if "(CUDA buffers)" not in out:
                raise RuntimeError("rank %d: %s" % (r, out))
            for line in out.splitlines():
                f = line.split()
                if f[:1] != ["timing"]:
                    continue
                key = (f[1], int(f[2]), int(f[3]))
                sub, done, rows, row = int(f[4]), int(f[5]), int(f[6]), int(f[7])
                p = phases.setdefault(key, [0, 0, 0, row])
                p[0] = max(p[0], sub)
                p[1] = max(p[1], done)
                p[2] += rows
    finally:
        c.stop()
    res = {}
    for (kind, layer, step), (sub, done, rows, row) in phases.items():
        dt = "bf16" if row == hidden * 2 else "fp32"
        res.setdefault((kind, dt), []).append((rows * row, (done - sub) / 1e9))
    return res, cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", default="256,1024")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=12345)
    a = ap.parse_args()
    bp = os.path.join(B, "cuda", "bench_pack")
    if os.access(bp, os.X_OK):
        print("== device-to-device copy bandwidth (bench_pack, same GPU, same run)")
        sys.stdout.write(subprocess.run([bp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        timeout=300).stdout.decode())
    print("== phases: 2 daemons (tcp loopback, R=2), 2 CUDA ranks per node on one GPU, hidden %d, "
          "top-4, joint path, %d layers x %d steps (fp32 and bf16 alternate)"
          % (a.hidden, a.layers, a.steps))
    print("%6s %5s %-8s | %9s %8s %9s | %9s %8s %9s | %7s" % (
        "tokens", "dtype", "kind", "host MB", "host ms", "host GB/s", "cuda MB", "cuda ms",
        "cuda GB/s", "speedup"))
    with tempfile.TemporaryDirectory(prefix="rwbm.", dir="/tmp") as tmp:
        for tokens in [int(t) for t in a.tokens.split(",")]:
            got, cpu = {}, {}
            for mover in ("host", "cuda"):
                got[mover], cpu[mover] = run(tmp, mover, tokens, a.hidden, a.layers, a.steps,
                                             a.seed)
            for key in sorted(got["host"]):
                cols = []
                for mover in ("host", "cuda"):
                    v = got[mover].get(key, [])
                    nb = statistics.median(b for b, _ in v)
                    t = statistics.median(t for _, t in v)
                    cols.append((nb / 1e6, t * 1e3, nb / t / 1e9 if t > 0 else 0.0))
                print("%6d %5s %-8s | %9.1f %8.2f %9.2f | %9.1f %8.2f %9.2f | %6.2fx" % (
                    tokens, key[1], key[0], *cols[0], *cols[1],
                    cols[0][1] / cols[1][1] if cols[1][1] > 0 else 0.0))
            print("%6d daemon CPU seconds (user+sys, both daemons, whole run): host %.2f, cuda %.2f"
                  % (tokens, cpu["host"], cpu["cuda"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
