#!/usr/bin/env python3
"""Benchmark (not a test): what phase traces cost (docs/perf/trace.md). The same workload —
real daemons and ranks through tests/lib/cluster.py's Cluster — runs with
`trace_dir` off and on, alternating, ROUNDS times each; printed per mode: the ranks' wall time,
the daemons' dispatch/combine mean and p50 phase times (`stats phases`, averaged over nodes), and
with traces on the recorder's own loop time per record (the daemon's final "trace:" log line).

  build/bench/tools_trace [--nodes N] [--layers L] [--steps S] [--rounds K] [--rank-flags "..."]"""
import argparse
import os
import re
import shlex
import statistics
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)


def phase_times(c, n):
    out = {}
    for line in c.stats(n, "stats phases").splitlines():
        kv = dict(t.split("=", 1) for t in line.split() if "=" in t)
        if int(kv.get("ok", 0)):
            out[kv["kind"]] = (float(kv["mean_us"]), float(kv["p50_us"]))
    return out


def one(tmp, a, trace, seed):
    # Generous liveness bounds: a loaded machine must not turn into peer failures here.
    extra = {"log_level": "info", "heartbeat_timeout_ms": 20000, "phase_timeout_ms": 60000}
    if trace:
        extra["trace_dir"] = os.path.join(tmp, "traces")
        os.makedirs(extra["trace_dir"], exist_ok=True)
    for n in range(a.nodes):
        open(os.path.join(tmp, "d%d.log" % n), "w").close()
    c = cluster.Cluster(tmp, a.nodes, path=a.path, extra=extra)
    c.rank_flags = shlex.split(a.rank_flags)
    try:
        c.start_all()
        t0 = time.monotonic()
        c.run_ranks("g.bench", layers=a.layers, steps=a.steps, seed=seed)
        wall = time.monotonic() - t0
        ph = [phase_times(c, n) for n in range(a.nodes)]
    finally:
        c.stop()
    per_rec = []
    for n in range(a.nodes):
        with open(os.path.join(tmp, "d%d.log" % n)) as f:
            m = re.search(r"trace: (\d+) phase records .*; ([\d.]+) us of loop time per record", f.read())
        if m:
            per_rec.append(float(m.group(2)))
    res = {"wall": wall, "per_rec_us": statistics.mean(per_rec) if per_rec else None}
    for kind in ("dispatch", "combine"):
        res[kind + "_mean"] = statistics.mean(p[kind][0] for p in ph)
        res[kind + "_p50"] = statistics.mean(p[kind][1] for p in ph)
    return res


def main():
    ap = argparse.ArgumentParser(description="phase trace cost")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--path", default="auto")
    ap.add_argument("--rank-flags", default="--tokens 96 --hidden 256")
    a = ap.parse_args()
    runs = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="rwbtrace.", dir="/tmp") as tmp:
        for r in range(a.rounds):
            for trace in (False, True) if r % 2 == 0 else (True, False):
                for attempt in range(2):  # a run that fails (a stalled machine) is run again once
                    sub = os.path.join(tmp, "r%d%s%d" % (r, "on" if trace else "off", attempt))
                    os.mkdir(sub)
                    try:
                        runs[trace].append(one(sub, a, trace, 1000 + r))
                        break
                    except RuntimeError as e:
                        print("run failed, once more: %s" % str(e).splitlines()[0])
                else:
                    return 1
    print("railwave trace cost: N=%d R=%d G=%d, %d layers x %d steps, rank flags '%s', path %s, %d rounds" % (
        a.nodes, cluster.RAILS, cluster.GPUS, a.layers, a.steps, a.rank_flags, a.path, a.rounds))
    print("%-6s %10s %14s %14s %14s %14s %16s" % ("trace", "wall s", "dispatch mean", "dispatch p50",
                                                  "combine mean", "combine p50", "us per record"))
    med = {}
    for trace in (False, True):
        rs = runs[trace]
        m = {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "per_rec_us"}
        pr = [x["per_rec_us"] for x in rs if x["per_rec_us"] is not None]
        med[trace] = m
        print("%-6s %10.3f %11.0f us %11.0f us %11.0f us %11.0f us %16s" % (
            "on" if trace else "off", m["wall"], m["dispatch_mean"], m["dispatch_p50"],
            m["combine_mean"], m["combine_p50"], "%.1f" % statistics.median(pr) if pr else "-"))
    print("on/off (medians): wall %.3f, dispatch mean %.3f, combine mean %.3f" % (
        med[True]["wall"] / med[False]["wall"], med[True]["dispatch_mean"] / med[False]["dispatch_mean"],
        med[True]["combine_mean"] / med[False]["combine_mean"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
