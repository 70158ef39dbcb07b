#!/usr/bin/env python3
"""Benchmark (not a test; docs/perf/shm.md): RailWave at NIC speed on one host. 2 and 4 railwaved
on `shm` rails paced at 25 and 50 GB/s per rail, and the same phases on `tcp` loopback (unpaced),
host ranks (tools/rw_bench_rank: every row, count and sum checked) or CUDA ranks (--cuda: the
daemon-side CUDA mover, as docs/perf/gpu-path.md), DeepSeek-V3 and GLM-4.5-Air shapes, bf16.
Every path is asked for in turn (--paths cycles them step by step) and the selector (auto).

Per (cluster, shape, tokens, path, kind), medians over the steps after the first round of paths:
  ms      last rank's submission to last rank's completion (the ranks' CLOCK_MONOTONIC);
  LB ms   lower bound: the busiest rail's bytes in the phase (any node's tx or rx on one rail,
          from the daemons' phase traces) at the rail rate;
  x LB    ms / LB ms;
  split   from the traces, ms after the cluster's last submission (one host, one clock): the
          latest node's decision (count rows exchanged, path chosen; dispatch only: a combine
          takes its dispatch's path), the earliest first post, the latest last byte in (last
          range complete) and the latest done;
  cpu     the daemons' CPU (user + system) per phase, all nodes together, ms;
  wakes   the daemons' voluntary context switches per phase (every thread: loop and copiers),
          all nodes together: how often a daemon slept and was woken, which a loaded machine
          changes less than it changes time (with --idle-s counted, as cpu, from the end of
          the idle window; else from before the ranks join, their setup spread over the steps);
  rank    the ranks' CPU (user + system) per phase, every rank together, ms, and their voluntary
          context switches per phase (whole processes: setup and checks included);
  memcpy  the same bytes per (node, rail) copied by plain memcpy with one thread per (node,
          rail), as many threads as the shm copiers (rdma/bench/memcpy_ceiling.c), ms; shm
          rows of 1024 tokens per rank and more.
The 1-token rows are the control-plane floor (their p50 in µs is printed separately).
--daemons base=DIR/railwaved,new=$b/railwaved runs every cluster with each build in turn
(--repeat times, alternating), rows labelled: a before/after in one run on one machine;
--rank-env LABEL=VAR=VALUE,... sets VAR in the ranks' environment for that label's runs (the
same daemon under two labels: an A/B of a rank-side setting such as RAILWAVE_WAIT_SPIN_US);
--daemon-env LABEL=VAR=VALUE,... the same for the daemons' environment.
--ranks LABEL=PATH,...: that label's rank program (an old build's tools/rw_bench_rank: an A/B
of a change on both sides of the rank path, the daemon's and librailwave's); default this build's.
--idle-s S: the ranks of each (shape, tokens) join, open their path and wait S s (after the
daemons settle: a 0.5 s window under 3% of a core each, 10 s at most) before their first step: the daemons' CPU over those S s (idle: rank pages watched, no
phase) and over the steps (busy), per daemon, in % of a core (every thread's
/proc/PID/task/TID/schedstat: ns on a CPU, since a 1-token run's steps last well under a second).
--modes ring,rank: host ranks on the ring (the daemons' host mover copies every row) and on the
rank path (rw_bench_rank --host-rank-path: the ranks pack, forward, gather and reduce on their
own threads straight into and out of their group's carve-out, the daemons plan, post and track;
docs/rankpath.md "Host ranks"), the same (shape, tokens) one after the other on the same
daemons; rows labelled by mode. With --cuda, ring is the daemon's CUDA mover and rank the rank
path with CUDA ranks (rw_bench_rank --rank-path: the kernels in each rank's stream, on the
system's driver, or on $RW_BENCH_FAKE_CUDA, a stand-in libcuda, where there is no GPU). The
host rank path's threads: RAILWAVE_RANK_THREADS = the CPUs left
after each daemon's loop, poller and shm copiers, over every rank of the run (one host plays
every node), unless --rank-env sets it.

  $b/bench/shm_nic [--nodes 2,4] [--rates 25,50] [--tcp] [--shapes deepseek,glm]
                   [--tokens 1,128,1024,4096] [--paths native,rail-only,perm-only,joint,auto]
                   [--rounds 3] [--floor-rounds 20] [--gpus 2] [--rails 2] [--cuda]
                   [--daemons LABEL=PATH,...] [--rank-env LABEL=VAR=VALUE,...]
                   [--daemon-env LABEL=VAR=VALUE,...] [--ranks LABEL=PATH,...]
                   [--repeat 1] [--modes ring,rank]
                   [--idle-s S]"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

RANK = os.path.join(B, "tools", "rw_bench_rank")
CEILING = os.path.join(B, "bench", "memcpy_ceiling")
# name: (hidden, routed experts, top-k): DeepSeek-V3, GLM-4.5-Air.
SHAPES = {"deepseek": (7168, 256, 8), "glm": (4096, 128, 8)}


def cpu_s(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_s(pid):
    """CPU time of every thread of pid (/proc/PID/task/TID/schedstat: ns on a CPU), seconds: finer
    than /proc/PID/stat's 10 ms ticks over a short window."""
    n = 0
    for t in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
                n += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return n / 1e9


def wakes(pid, loop_only=False):
    """Voluntary context switches of every thread of pid (loop_only: of its main thread, the
    daemon's event loop)."""
    n = 0
    for t in ["%d" % pid] if loop_only else os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, t)) as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        n += int(line.split()[1])
        except OSError:
            pass  # a thread that ended meanwhile
    return n


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_ranks(c, a, shape, tokens, paths, steps, group, env, mode="ring", gated=None, prog=RANK):
    """One rank process per (node, GPU); returns ({step: [(dsub, ddone, csub, cdone)]}, the
    ranks' CPU seconds, their voluntary context switches). gated: (FILE, fn): the ranks join
    (and open the rank path) and wait before their first step until FILE exists; fn() runs
    meanwhile and creates it."""
    hidden, experts, topk = SHAPES[shape]
    wl = ["--nodes", str(c.nodes), "--gpus", str(a.gpus), "--rails", str(a.rails),
          "--experts", str(experts), "--topk", str(topk), "--hidden", str(hidden),
          "--tokens", str(tokens), "--seed", str(a.seed)]
    procs = []
    for r in range(c.nodes * a.gpus):
        sock = c.cfg["nodes"][r // a.gpus]["ipc_socket"]
        if mode == "rank":  # the rank path: CUDA ranks' kernels in their streams, or host ranks'
            flags = ["--rank-path"] if a.cuda else ["--host-rank-path"]
        else:  # the ring: the daemon's CUDA mover, or its host mover
            flags = ["--cuda"] if a.cuda else []
        argv = [prog, "--socket", sock, "--group", group, "--rank", str(r), "--steps",
                str(steps), "--paths", ",".join(paths)] + flags + \
            (["--gate", "0:" + gated[0]] if gated else []) + wl
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env=env))
    outs = [None] * len(procs)

    def reader(i, p):
        outs[i] = p.stdout.read().decode()
    ts = [threading.Thread(target=reader, args=(i, p)) for i, p in enumerate(procs)]
    for t in ts:
        t.start()
    if gated:
        gated[1]()
    for t in ts:
        t.join(900)
    pairs, cpu, wk = {}, 0.0, 0
    for r, p in enumerate(procs):
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        cpu += ru.ru_utime + ru.ru_stime
        wk += ru.ru_nvcsw
        if p.returncode != 0:
            raise RuntimeError("%s T=%d rank %d rc %s: %s\n%s" % (
                shape, tokens, r, p.returncode, outs[r][-1500:], c.logs()))
        for line in outs[r].splitlines():
            f = line.split()
            if f[:1] == ["pair"]:
                pairs.setdefault(int(f[1]), []).append([int(x) for x in f[2:6]])
    return pairs, cpu, wk


def traces(trace_dir):
    recs = []
    for f in sorted(os.listdir(trace_dir)):
        with open(os.path.join(trace_dir, f)) as fh:
            for line in fh:
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
    return recs


def phase_facts(recs, group, step, kind, rails):
    """From every node's record of one phase: busiest rail bytes (tx or rx), per-(node, rail)
    tx bytes, and the split: ms after the cluster's last submission (the nodes share one clock:
    t0_ns places each record), the latest node's decided, the earliest first post, the latest
    last byte in and done."""
    rs = [r for r in recs if r.get("group") == group and r.get("step") == step and
          r.get("kind") == kind and r.get("status") == "ok"]
    if not rs:
        return None

    def at(r, v):  # a record's µs field as ns of the shared clock
        return None if v is None else r["t0_ns"] + v * 1000
    last_submit = max(at(r, r.get("last_submit_us") or 0) for r in rs)
    busiest, per_rail, split = 0, [], [[], [], [], []]
    for r in rs:
        tx = {t[0]: t for t in (r.get("tx") or [])}
        rx = {}
        for x in r.get("rx") or []:
            rx[x[1]] = rx.get(x[1], 0) + x[2]
        for k in range(rails):
            b = tx[k][1] if k in tx else 0
            per_rail.append(b)
            busiest = max(busiest, b, rx.get(k, 0))

        def rel(v):
            return None if v is None else (at(r, v) - last_submit) / 1e6
        posts = [t[3] for t in tx.values() if t[3] is not None]
        ins = [x[4] for x in (r.get("rx") or []) if x[4] is not None]
        split[0].append(rel(r.get("decided_us")) if kind == "dispatch" else None)
        split[1].append(rel(min(posts)) if posts else None)
        split[2].append(rel(max(ins)) if ins else None)
        split[3].append(rel(r.get("us")))
    pick = (max, min, max, max)
    return busiest, per_rail, [pick[i]([x for x in s if x is not None], default=None)
                               for i, s in enumerate(split)]


def line_up(n):
    return (n + 63) & ~63


def carve_mib(a, nodes, shape, tokens):
    """group_area_mib for host ranks on the rank path at (shape, tokens per rank): a carve-out's
    local area (a fifth of it, service/mover/mover_page.c) holds on rail 0 the dispatch's local
    records, every local rank's copies of them for the combine, and each rank's staging room for
    all the rows its node can receive; bounded as if every token reached every node."""
    hidden, _, topk = SHAPES[shape]
    row = hidden * 2
    rec = ((16 + topk * 8 + 15) & ~15) + ((row + 15) & ~15)
    crec = 16 + ((row + 15) & ~15)
    local = a.gpus * tokens
    rows_max = nodes * a.gpus * tokens
    need = line_up(local * rec) + line_up(a.gpus * local * crec) + \
        a.gpus * line_up(rows_max * row)
    return max(4, -(-(5 * need + (4 << 20)) // (1 << 20)))


def ceiling_us(per_rail):
    out = subprocess.run([CEILING, "--reps", "3"] + [str(b) for b in per_rail],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    return int(out.split()[0])


def run_cluster(tmp, a, nodes, transport, rate_gbs, results,
                build=("", cluster.DAEMON, {}, {}, RANK)):
    """One cluster of railwaved build[1] (labelled build[0], its ranks' environment build[2],
    its daemons' build[3], its rank program build[4]); every (shape, tokens) in turn; rows
    appended to results."""
    max_rec = max(((16 + k * 8 + 15) & ~15) + ((h * 2 + 15) & ~15) for h, _, k in SHAPES.values())
    tmax = max(int(t) for t in a.tokens.split(","))
    # A node may receive every rank's records in one phase: the region grows with N.
    recv_mib = 64 + 4 * nodes * a.gpus * tmax * max_rec // (1 << 20)
    label = "%s %g GB/s" % (transport, rate_gbs) if transport == "shm" else "tcp loopback"
    trace_dir = os.path.join(tmp, "trace-%d-%s-%g" % (nodes, transport, rate_gbs))
    os.makedirs(trace_dir)
    extra = {"transport": transport, "pace": transport == "shm",
             "nic_gbps": rate_gbs * 8, "recv_region_mib": recv_mib, "trace_dir": trace_dir,
             "phase_timeout_ms": 60000, "heartbeat_timeout_ms": 10000, "log_level": "warn",
             # a loaded host: a daemon mapping one rank's large buffers may not read the next
             # rank's hello for seconds (the default 5 s dropped ranks at 128+ tokens, load 30+)
             "ipc_hello_timeout_ms": 60000}
    modes = a.modes.split(",")
    if "rank" in modes:  # the rank path's records live in each group's carve-out
        area = max(carve_mib(a, nodes, s, t) for s in a.shapes.split(",")
                   for t in (int(x) for x in a.tokens.split(",")))
        extra["group_area_mib"], extra["group_pool_mib"] = area, 2 * area
    fake = os.environ.get("RW_BENCH_FAKE_CUDA")  # a stand-in libcuda: the run without a GPU
    c = cluster.Cluster(tmp, nodes, path="auto", extra=extra, gpus=a.gpus, rails=a.rails,
                        cuda_ranks=(fake or "real") if a.cuda else None, daemon=build[1])
    if a.cuda:
        c.env.pop("RAILWAVE_CUDA_MOVER", None)
    rank_env = dict(c.env, **build[2])
    # The rank path's copy threads: during a phase each daemon keeps its loop, its word poller
    # and its shm copiers (one a rail) busy; the ranks share the other CPUs.
    rank_env.setdefault("RAILWAVE_RANK_THREADS", str(max(1, ((os.cpu_count() or 1) - nodes *
                                                             (2 + a.rails)) // (nodes * a.gpus))))
    c.env.update(build[3])
    c.start_all()
    paths = a.paths.split(",")
    try:
        for shape in a.shapes.split(","):
            for tokens, mode in [(int(t), m) for t in a.tokens.split(",") for m in modes]:
                rounds = a.floor_rounds if tokens == 1 else a.rounds
                steps = len(paths) * (rounds + 1)
                group = "%s-%d-%s" % (shape, tokens, mode)
                idle = {}
                gate = os.path.join(tmp, "gate-" + group)

                def at_gate():
                    """The ranks joined and wait before their first step (pages watched, no
                    phase): the daemons' CPU over a.idle_s of wall time, then open the gate."""
                    # every rank joined and opened its path, the daemons mapped its buffers
                    # and the group's areas: wait until a 0.5 s window costs each daemon under
                    # 3% of a core (10 s at most)
                    for _ in range(20):
                        r0 = sum(run_s(p.pid) for p in c.procs.values())
                        time.sleep(0.5)
                        if sum(run_s(p.pid) for p in c.procs.values()) - r0 < 0.015 * nodes:
                            break
                    t0, c0 = time.monotonic(), sum(run_s(p.pid) for p in c.procs.values())
                    time.sleep(a.idle_s)
                    idle["pct"] = 100 * (sum(run_s(p.pid) for p in c.procs.values()) - c0) / \
                        (time.monotonic() - t0) / nodes
                    idle["t0"], idle["run0"] = time.monotonic(), sum(run_s(p.pid)
                                                                     for p in c.procs.values())
                    idle["cpu0"] = sum(cpu_s(p.pid) for p in c.procs.values())
                    # the wake-ups too from here: the idle window's sleeps are not the phases'
                    idle["wk0"] = sum(wakes(p.pid) for p in c.procs.values())
                    idle["lw0"] = sum(wakes(p.pid, True) for p in c.procs.values())
                    open(gate, "w").close()
                cpu0 = sum(cpu_s(p.pid) for p in c.procs.values())
                wk0 = sum(wakes(p.pid) for p in c.procs.values())
                lw0 = sum(wakes(p.pid, True) for p in c.procs.values())
                pairs, rcpu, rwk = run_ranks(c, a, shape, tokens, paths, steps, group,
                                             rank_env, mode, (gate, at_gate) if a.idle_s else None,
                                             build[4])
                busy = None
                if idle:  # the daemons' CPU while the phases ran, per daemon, % of a core
                    busy = 100 * (sum(run_s(p.pid) for p in c.procs.values()) - idle["run0"]) / \
                        (time.monotonic() - idle["t0"]) / nodes
                    cpu0, wk0, lw0 = idle["cpu0"], idle["wk0"], idle["lw0"]
                cpu = (sum(cpu_s(p.pid) for p in c.procs.values()) - cpu0) / (2 * steps)
                wk = (sum(wakes(p.pid) for p in c.procs.values()) - wk0) / (2 * steps)
                lw = (sum(wakes(p.pid, True) for p in c.procs.values()) - lw0) / (2 * steps)
                time.sleep(1.2)  # the daemons write their trace buffers at most every second
                recs = traces(trace_dir)
                for pi, path in enumerate(paths):
                    sel = [s for s in sorted(pairs) if s >= len(paths) and s % len(paths) == pi]
                    for kind, (i0, i1) in (("dispatch", (0, 1)), ("combine", (2, 3))):
                        ms = [(max(v[i1] for v in pairs[s]) - max(v[i0] for v in pairs[s])) / 1e6
                              for s in sel]
                        facts = [phase_facts(recs, group, s, kind, a.rails) for s in sel]
                        facts = [f for f in facts if f]
                        lb = med([f[0] / (rate_gbs * 1e9) * 1e3 for f in facts])
                        split = [med([f[2][i] for f in facts]) for i in range(4)]
                        per_rail = facts[len(facts) // 2][1] if facts else []
                        row = {
                            "nodes": nodes, "transport": label, "rate": rate_gbs,
                            "daemon": build[0], "mode": mode,
                            "shape": shape, "tokens": tokens, "path": path, "kind": kind,
                            "ms": med(ms), "p50_us": med(ms) * 1e3 if ms else None,
                            "lb_ms": lb, "split": split, "cpu_ms": cpu * 1e3, "wakes": wk, "loop_wakes": lw,
                            "rank_cpu_ms": rcpu / steps * 1e3, "rank_wakes": rwk / steps,
                            "idle_pct": idle.get("pct"), "busy_pct": busy,
                            "mb": max(per_rail, default=0) / 1e6, "per_rail": per_rail,
                            "memcpy_ms": None}
                        if transport == "shm" and per_rail and tokens >= 1024:
                            row["memcpy_ms"] = ceiling_us(per_rail) / 1e3
                        results.append(row)
                        print_row(row)
                        if a.json:
                            with open(a.json, "a") as f:
                                f.write(json.dumps(row) + "\n")
    finally:
        c.stop()


def fmt(x, spec="%.3f"):
    return "-" if x is None else spec % x


def print_row(r):
    ratio = r["ms"] / r["lb_ms"] if r["ms"] and r["lb_ms"] else None
    print("%s%d %-14s %-4s %-8s %5d %-9s %-8s %8s %8s %6s  %6s %6s %6s %6s  %6s %7s %7s %7s %8s %7s" % (
        r["daemon"] + " " if r["daemon"] else "", r["nodes"], r["transport"], r["mode"], r["shape"],
        r["tokens"], r["path"], r["kind"],
        fmt(r["ms"]), fmt(r["lb_ms"]), fmt(ratio, "%.2f"),
        *[fmt(x) for x in r["split"]], fmt(r["cpu_ms"], "%.2f"), fmt(r["mb"], "%.1f"),
        fmt(r["memcpy_ms"]), fmt(r.get("wakes"), "%.1f"), fmt(r.get("rank_cpu_ms"), "%.2f"),
        fmt(r.get("rank_wakes"), "%.1f")), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--rates", default="25,50", help="shm rail rates, GB/s")
    ap.add_argument("--tcp", action="store_true", help="also the same phases on tcp loopback")
    ap.add_argument("--shapes", default="deepseek,glm")
    ap.add_argument("--tokens", default="1,128,1024,4096")
    ap.add_argument("--paths", default="native,rail-only,perm-only,joint,auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--floor-rounds", type=int, default=20)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--cuda", action="store_true", help="CUDA ranks (the daemon's CUDA mover)")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--json", help="append every row here, one JSON object a line")
    ap.add_argument("--daemons", help="LABEL=PATH,...: run every cluster with each railwaved")
    ap.add_argument("--rank-env", help="LABEL=VAR=VALUE,...: the ranks' environment per label")
    ap.add_argument("--daemon-env", help="LABEL=VAR=VALUE,...: the daemons' environment per label")
    ap.add_argument("--ranks", help="LABEL=PATH,...: the rank program per label (default: "
                    "this build's tools/rw_bench_rank)")
    ap.add_argument("--repeat", type=int, default=1, help="with --daemons: times each, alternating")
    ap.add_argument("--idle-s", type=float, default=0,
                    help="the ranks join and wait this long before their first step: the "
                         "daemons' CPU idle (pages watched, no phase) and while the steps run")
    ap.add_argument("--modes", default="ring", help="ring,rank: the ring (the daemons' host or, "
                    "with --cuda, CUDA mover) and the rank path (host ranks' threads or, with "
                    "--cuda, CUDA ranks' kernels), each (shape, tokens) in turn")
    a = ap.parse_args()
    print("== railwave at NIC speed: G=%d %s ranks per node, R=%d rails, bf16; %d rounds of "
          "every path after one warm-up round (%d for 1 token); nproc %d" % (
              a.gpus, "CUDA" if a.cuda else "host", a.rails, a.rounds, a.floor_rounds,
              os.cpu_count()))
    print("N transport      mode shape    tok/r path      kind           ms    LB ms   x LB  "
          "decide  1stpost lastin   done   cpu/ph  MB/rail  memcpy wakes/ph rank-cpu rank-wk")
    builds = [("", cluster.DAEMON, {}, {}, RANK)]
    if a.daemons:
        builds = [(d.split("=", 1)[0], os.path.abspath(d.split("=", 1)[1]), {}, {}, RANK)
                  for d in a.daemons.split(",")]
    for e in (a.ranks.split(",") if a.ranks else []):
        label, path = e.split("=", 1)
        builds = [b[:4] + (os.path.abspath(path),) if b[0] == label else b for b in builds]
    for i, opt in ((2, a.rank_env), (3, a.daemon_env)):
        for e in (opt.split(",") if opt else []):
            label, var, value = e.split("=", 2)
            for b in builds:
                if b[0] == label:
                    b[i][var] = value
    results = []
    with tempfile.TemporaryDirectory(prefix="rwshm.", dir="/tmp") as tmp:
        for nodes in [int(n) for n in a.nodes.split(",")]:
            # tcp right after the first shm rate: a run cut short still has the pair
            confs = [("shm", float(r)) for r in a.rates.split(",")]
            if a.tcp:
                confs.insert(1, ("tcp", float(a.rates.split(",")[0])))
            for transport, rate in confs:
                for i, build in enumerate(builds * a.repeat):
                    sub = os.path.join(tmp, "%d-%s-%g-%d" % (nodes, transport, rate, i))
                    os.makedirs(sub)
                    run_cluster(sub, a, nodes, transport, rate, results, build)
    print("== control-plane floor (1 token per rank): phase p50 µs; the daemons' wake-ups per "
          "phase, their loop threads' and the others'")
    for r in results:
        if r["tokens"] == 1:
            print("%s%d %-14s %-4s %-8s %-9s %-8s %8.0f  loop %5.1f  other %5.1f" % (
                r["daemon"] + " " if r["daemon"] else "", r["nodes"], r["transport"], r["mode"],
                r["shape"],
                r["path"], r["kind"], r["p50_us"], r["loop_wakes"], r["wakes"] - r["loop_wakes"]))
    if a.idle_s:
        print("== the daemons' CPU, %% of a core per daemon: idle (ranks joined, no phase, %g s) "
              "and busy (while the steps ran)" % a.idle_s)
        for r in results:
            if r["kind"] == "dispatch" and r["path"] == a.paths.split(",")[0]:
                print("%s%d %-14s %-4s %-8s %5d  idle %6.2f  busy %6.2f" % (
                    r["daemon"] + " " if r["daemon"] else "", r["nodes"], r["transport"],
                    r["mode"], r["shape"], r["tokens"], r["idle_pct"], r["busy_pct"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
