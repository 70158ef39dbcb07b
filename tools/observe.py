#!/usr/bin/env python3
"""`railwave trace`, `railwave analyze`, `railwave top` (docs/tools.md "Seeing what the fabric
does"). Run by tools/observe.c as `observe.py MODE --build DIR ARGS...`.

  trace export TRACE... [-o OUT] [--group G] [--layer L] [--step S]
      phase traces (railwaved's trace_dir files, docs/service.md "Phase traces") -> Chrome trace /
      Perfetto JSON: one process per node, tracks per rail (tx, rx), waves and grants as slices.
  trace late TRACE... [--group G] [--top K]
      per step and phase: which node (and local rank) submitted last, by how much it held the
      others up, and whose data arrived last.
  analyze TRACE... [--plots DIR] [--gbps G]
      expert-load imbalance against source- and destination-rail imbalance (linear fits, R^2),
      distributions of rho_g, kappa and receiver fan-in, phase time / lower bound per path.
  top [--socket PATH | --node NAME]... [--interval S] [--once]
      live per-rail rates, peers, phases/s and latency percentiles of running daemons.

A TRACE argument is a trace file or a directory (every *.trace*.jsonl in it). Exit status: 0 ok,
1 failed (no usable records, a daemon not answering), 2 usage error."""
import argparse
import errno
import glob
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time

KINDS = ("dispatch", "combine")
BUILD = None  # the build directory of the railwave binary that ran us


def die(msg, rc=1):
    sys.stderr.write("railwave %s\n" % msg)
    sys.exit(rc)


# ---- reading traces ------------------------------------------------------------------------

def trace_files(paths, cmd):
    files = []
    for p in paths:
        if os.path.isdir(p):
            # the rotated (older) file first, so records stay in time order per node
            found = sorted(glob.glob(os.path.join(p, "*.trace*.jsonl")),
                           key=lambda f: (f.replace(".trace.1.jsonl", ".trace.jsonl"),
                                          not f.endswith(".trace.1.jsonl")))
            if not found:
                die("%s: %s: no *.trace*.jsonl files in this directory" % (cmd, p))
            files += found
        elif os.path.exists(p):
            files.append(p)
        else:
            die("%s: %s: no such file or directory" % (cmd, p))
    return files


def load(paths, cmd):
    """Every record of the files, in file order. A line that is not a record (a write cut by a
    crash or a full disk) is reported and skipped."""
    recs, bad = [], 0
    for f in trace_files(paths, cmd):
        with open(f, errors="replace") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    if not isinstance(r, dict) or r.get("v") != 1:
                        raise ValueError("not a version-1 phase record")
                    for k in ("node", "group", "layer", "step", "kind", "t0_ns", "us", "status"):
                        if k not in r:
                            raise ValueError("field '%s' missing" % k)
                except ValueError as e:
                    bad += 1
                    sys.stderr.write("railwave %s: %s:%d: skipped: %s\n" % (cmd, f, i, e))
                    continue
                recs.append(r)
    if not recs:
        die("%s: no phase records in %s" % (cmd, " ".join(paths)))
    return recs, bad


def phases(recs):
    """Group records into phases: (group, layer, step, kind, attempt) -> {node: record}. The
    i-th record of a key on a node is attempt i (a failed key retried)."""
    seen, out = {}, {}
    for r in recs:
        key = (r["group"], r["layer"], r["step"], r["kind"])
        n = r["node"]
        att = seen.get((key, n), 0)
        seen[(key, n)] = att + 1
        out.setdefault(key + (att,), {})[n] = r
    return out


def name_of(r):
    return r.get("name") or "n%d" % r["node"]


# ---- trace export ----------------------------------------------------------------------------

class Chrome:
    """Chrome trace events with slices placed in lanes so that slices of one track never overlap
    without nesting (the JSON importers of chrome://tracing and Perfetto require that)."""

    def __init__(self):
        self.events, self.lanes, self.tids, self.procs = [], {}, {}, {}

    def proc(self, pid, name):
        if pid not in self.procs:
            self.procs[pid] = name
            self.events.append({"ph": "M", "pid": pid, "name": "process_name",
                                "args": {"name": name}})
            self.events.append({"ph": "M", "pid": pid, "name": "process_sort_index",
                                "args": {"sort_index": pid}})

    def tid(self, pid, track, lane, order):
        key = (pid, track, lane)
        if key not in self.tids:
            tid = len(self.tids) + 1
            self.tids[key] = tid
            label = track if lane == 0 else "%s (%d)" % (track, lane + 1)
            self.events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                                "args": {"name": label}})
            self.events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                                "args": {"sort_index": order * 100 + lane}})
        return self.tids[key]

    def slice(self, pid, track, order, name, ts, dur, args, nest=False):
        dur = max(dur, 0.001)
        lanes = self.lanes.setdefault((pid, track), [])
        lane = None
        for i, end in enumerate(lanes):
            if end <= ts or nest:
                lane = i
                break
        if lane is None:
            lanes.append(0.0)
            lane = len(lanes) - 1
        lanes[lane] = max(lanes[lane], ts + dur)
        self.events.append({"ph": "X", "pid": pid, "tid": self.tid(pid, track, lane, order),
                            "name": name, "ts": round(ts, 3), "dur": round(dur, 3), "args": args})

    def instant(self, pid, track, order, name, ts, args):
        self.events.append({"ph": "i", "s": "t", "pid": pid, "tid": self.tid(pid, track, 0, order),
                            "name": name, "ts": round(ts, 3), "args": args})


def export_record(ch, r):
    """A record's slices. Times in a record are microseconds from its t0 (null: never)."""
    pid = r["node"] + 1
    ch.proc(pid, "node %s (%d)" % (name_of(r), r["node"]))
    t0 = r["t0_ns"] / 1e3
    end = r["us"]
    label = "L%d s%d %s" % (r["layer"], r["step"], r["kind"])
    args = {k: r.get(k) for k in ("group", "path", "reason", "status", "error", "last_rank",
                                  "last_peer", "epoch") if k in r}
    # The phase with its gather and count exchange nested in it.
    ch.slice(pid, "phases", 0, "%s %s" % (label, r.get("path") or "?"), t0, end, args)
    sub, ready, run = r.get("last_submit_us"), r.get("ready_us"), r.get("run_us")
    if sub is not None and sub > 0:
        ch.slice(pid, "phases", 0, "gather (last: rank %d)" % r["last_rank"], t0, sub, {}, nest=True)
    if ready is not None and run is not None and run > ready:
        ch.slice(pid, "phases", 0, "count exchange + decide" if r["kind"] == "dispatch" else "start",
                 t0 + ready, run - ready, {}, nest=True)
    for w, dst, nbytes, writes, post, done, wait in r.get("waves", []):
        if post is None:
            continue
        if wait > 0:
            ch.slice(pid, "waves", 1, "grant wait %d" % w, t0 + post - wait, wait,
                     {"wave": w, "destination": dst})
        ch.slice(pid, "waves", 1, "%s wave %d -> %s" % (label, w, "all" if dst < 0 else "n%d" % dst),
                 t0 + post, (done if done is not None else end) - post,
                 {"bytes": nbytes, "writes": writes, "destination": dst})
    for w, src, at in r.get("grants", []):
        ch.instant(pid, "waves", 1, "grant wave %d to node %d" % (w, src), t0 + at, {})
    for rail, nbytes, writes, first, last, done in r.get("tx", []):
        stop = done if done is not None else (last if last is not None else end)
        ch.slice(pid, "rail %d tx" % rail, 2 + 2 * rail, "%s tx" % label, t0 + first, stop - first,
                 {"bytes": nbytes, "writes": writes})
    for src, rail, nbytes, first, done in r.get("rx", []):
        if first is None:
            continue
        stop = done if done is not None else end
        ch.slice(pid, "rail %d rx" % rail, 3 + 2 * rail, "%s rx from node %d" % (label, src),
                 t0 + first, stop - first, {"bytes": nbytes, "complete": done is not None})


def cmd_export(a):
    recs, _ = load(a.trace, "trace export")
    ch = Chrome()
    n = 0
    for r in recs:
        if (a.group is not None and r["group"] != a.group) or \
           (a.layer is not None and r["layer"] != a.layer) or \
           (a.step is not None and r["step"] != a.step):
            continue
        export_record(ch, r)
        n += 1
    if not n:
        die("trace export: no record matches the filters")
    doc = {"traceEvents": ch.events, "displayTimeUnit": "ms",
           "otherData": {"source": "railwave trace export", "records": n}}
    if a.output in (None, "-"):
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        with open(a.output, "w") as f:
            json.dump(doc, f)
        print("railwave trace export: %d phase records, %d events -> %s" % (n, len(ch.events), a.output))
    return 0


# ---- trace late ------------------------------------------------------------------------------

def late_rows(recs):
    """One row per phase seen by at least two nodes: the node whose last local rank submitted
    last (wall clock: t0 + last_submit), how much after the next-latest node it came (the time
    it held everyone up at least) and after the first, and whose data arrived last elsewhere."""
    rows = []
    for key, by_node in sorted(phases(recs).items(), key=lambda kv: min(r["t0_ns"] for r in kv[1].values())):
        if len(by_node) < 2:
            continue
        sub = sorted(((r["t0_ns"] / 1e3 + r["last_submit_us"], n, r) for n, r in by_node.items()
                      if r.get("last_submit_us") is not None), key=lambda x: (x[0], x[1]))
        if len(sub) < 2:
            continue
        t_last, n_last, r_last = sub[-1]
        late_by = (t_last - sub[-2][0]) / 1e3
        last_rank = r_last["last_rank"]
        never = sorted((n, r) for n, r in by_node.items() if r.get("missing"))
        if never:  # a rank that never submitted held everyone up for the whole phase
            n_last, r_last = never[0]
            last_rank, late_by = r_last["missing"][0], None
        peers = {}
        for n, r in by_node.items():
            if r.get("last_peer") is not None and r["last_peer"] != n:
                peers[r["last_peer"]] = peers.get(r["last_peer"], 0) + 1
        slow_peer = max(sorted(peers), key=lambda p: peers[p]) if peers else None
        rows.append({
            "group": key[0], "layer": key[1], "step": key[2], "kind": key[3], "attempt": key[4],
            "nodes": len(by_node), "last_node": n_last, "last_name": name_of(r_last),
            "last_rank": last_rank, "never": [x for _, r in never for x in r["missing"]],
            "late_by_ms": late_by, "spread_ms": (t_last - sub[0][0]) / 1e3,
            "phase_ms": max(r["us"] for r in by_node.values()) / 1e3,
            "status": ",".join(sorted({r["status"] for r in by_node.values()})),
            "last_peer": slow_peer, "last_peer_votes": peers.get(slow_peer, 0),
        })
    return rows


def cmd_late(a):
    recs, _ = load(a.trace, "trace late")
    if a.group is not None:
        recs = [r for r in recs if r["group"] == a.group]
    rows = late_rows(recs)
    if not rows:
        die("trace late: no phase was recorded by two or more nodes")
    if a.json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print("%-12s %5s %6s %-8s  %-16s %10s %9s %9s  %-12s %s" % (
        "group", "layer", "step", "phase", "last to submit", "late by", "spread", "phase",
        "last data", "status"))
    for w in rows:
        late = "never" if w["late_by_ms"] is None else "%.2f ms" % w["late_by_ms"]
        print("%-12s %5d %6d %-8s  %-16s %10s %6.2f ms %6.2f ms  %-12s %s" % (
            w["group"][:12], w["layer"], w["step"], w["kind"],
            "%s rank %d" % (w["last_name"], w["last_rank"]), late, w["spread_ms"],
            w["phase_ms"], "-" if w["last_peer"] is None else "node %d (%d)" % (w["last_peer"], w["last_peer_votes"]),
            w["status"]))
    tally = {}
    for w in rows:
        t = tally.setdefault((w["last_node"], w["last_name"]), [0, 0.0])
        t[0] += 1
        t[1] += w["late_by_ms"] or 0.0
    print("\nlast to submit, by node (phases, total ms it held the others up; 'never' phases add 0):")
    for (n, name), (cnt, ms) in sorted(tally.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print("  node %d (%s): %d of %d phases, %.2f ms" % (n, name, cnt, len(rows), ms))
    return 0


# ---- analyze ---------------------------------------------------------------------------------

def linfit(xs, ys):
    """Least squares y = a + b x; returns (a, b, R^2). R^2 = 1 - SSres/SStot (0 when y is
    constant or fewer than 3 points)."""
    n = len(xs)
    if n < 3:
        return float("nan"), float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return my, 0.0, 0.0
    b = sxy / sxx
    a = my - b * mx
    ssr = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, 1 - ssr / syy


def imbalance(v):
    v = list(v)
    m = sum(v) / len(v) if v else 0
    return max(v) / m if m > 0 else float("nan")


def rail_loads(r):
    """Native egress per (source, rail) and ingress per (destination, rail), remote records."""
    N, R = r["N"], r["R"]
    c = r.get("counts")
    if c:
        src = [[sum(c[(s * N + d) * R + k] for d in range(N) if d != s) for k in range(R)] for s in range(N)]
        dst = [[sum(c[(s * N + d) * R + k] for s in range(N) if s != d) for k in range(R)] for d in range(N)]
        node_out = [sum(row) for row in src]
        node_in = [sum(row) for row in dst]
        return src, dst, node_out, node_in
    if r.get("counts_src_rail"):
        cs, cd = r["counts_src_rail"], r["counts_dst_rail"]
        src = [cs[n * R:(n + 1) * R] for n in range(N)]
        dst = [cd[n * R:(n + 1) * R] for n in range(N)]
        return src, dst, [sum(x) for x in src], [sum(x) for x in dst]
    return None


def pct(v, q):
    v = sorted(v)
    if not v:
        return float("nan")
    return v[min(len(v) - 1, max(0, int(math.ceil(q * len(v))) - 1))]


def analyze_rows(recs, gbps):
    rows = []
    by_phase = phases(recs)
    for key, by_node in by_phase.items():
        if key[3] != "dispatch" or key[4] != 0:
            continue
        ok = [r for r in by_node.values() if r["status"] == "ok"]
        if not ok:
            continue
        r0 = ok[0]
        loads = rail_loads(r0)
        if not loads:
            continue
        src, dst, node_out, node_in = loads
        N, R = r0["N"], r0["R"]
        row = {"group": key[0], "layer": key[1], "step": key[2], "path": r0.get("path"),
               "reason": r0.get("reason"), "nodes_seen": len(ok), "N": N, "R": R,
               "src_rail_imb": imbalance(x for s in src for x in s),
               "dst_rail_imb": imbalance(x for d in dst for x in d),
               "rho_g": r0.get("features", {}).get("rho_g"),
               "kappa": r0.get("features", {}).get("kappa"),
               "fan_in": r0.get("features", {}).get("max_fan_in"),
               "remote_bytes": r0.get("features", {}).get("remote_bytes"),
               "rec_size": r0.get("rec_size")}
        # Expert loads: every node reports its own experts; complete only with every node.
        if len(ok) == N and all("expert_load" in r for r in ok):
            load = [0] * r0["experts"]
            for r in ok:
                for i, v in enumerate(r["expert_load"]):
                    load[r["expert_first"] + i] = v
            row["expert_imb"] = imbalance(load)
        # Phase time: the slowest node's, dispatch and its combine.
        timed = len(ok) == N and all(r["us"] is not None for r in ok)  # trace-synth: no times
        row["dispatch_ms"] = max(r["us"] for r in ok) / 1e3 if timed else None
        comb = by_phase.get(key[:3] + ("combine", 0), {})
        cok = [r for r in comb.values() if r["status"] == "ok"]
        row["combine_ms"] = max(r["us"] for r in cok) / 1e3 if len(cok) == N and timed else None
        # Lower bound (in the spirit of docs/architecture.md §6, for any plan): the busiest node's
        # remote bytes spread evenly over its R NICs, at the NIC rate.
        rate = gbps or (r0.get("gbps") or [None])[0]
        if rate:
            busiest = max(max(node_out), max(node_in)) * r0["rec_size"] / R
            row["lb_ms"] = busiest * 8 / (rate * 1e9) * 1e3
        rows.append(row)
    return rows


def gnuplot(script, cmd):
    if not shutil.which("gnuplot"):
        sys.stderr.write("railwave %s: gnuplot not found; no plots\n" % cmd)
        return False
    p = subprocess.run(["gnuplot"], input=script.encode(), capture_output=True)
    if p.returncode != 0:
        sys.stderr.write("railwave %s: gnuplot failed: %s\n" % (cmd, p.stderr.decode()[-400:]))
        return False
    return True


def plots(rows, fits, outdir):
    os.makedirs(outdir, exist_ok=True)
    pts = [r for r in rows if r.get("expert_imb") is not None]
    data = os.path.join(outdir, "imbalance.dat")
    with open(data, "w") as f:
        f.write("# expert_imb src_rail_imb dst_rail_imb rho_g kappa fan_in\n")
        for r in pts:
            f.write("%g %g %g %g %g %g\n" % (r["expert_imb"], r["src_rail_imb"], r["dst_rail_imb"],
                                             r["rho_g"] or 0, r["kappa"] or 0, r["fan_in"] or 0))
    made = []
    (a1, b1, r1), (a2, b2, r2) = fits
    script = ["set terminal png size 900,450", "set output '%s'" % os.path.join(outdir, "imbalance.png"),
              "set multiplot layout 1,2", "set xlabel 'expert-load imbalance (max/mean)'",
              "set ylabel 'source-rail imbalance (max/mean)'",
              "set title 'source rails: R^2 = %.3f'" % r1 if not math.isnan(r1) else "set title 'source rails'",
              "plot '%s' using 1:2 with points pt 7 title 'step-layer'%s" % (
                  data, "" if math.isnan(b1) else ", %g + %g*x title 'fit'" % (a1, b1)),
              "set ylabel 'destination-rail imbalance (max/mean)'",
              "set title 'destination rails: R^2 = %.3f'" % r2 if not math.isnan(r2) else "set title 'destination rails'",
              "plot '%s' using 1:3 with points pt 7 title 'step-layer'%s" % (
                  data, "" if math.isnan(b2) else ", %g + %g*x title 'fit'" % (a2, b2)),
              "unset multiplot"]
    if pts and gnuplot("\n".join(script) + "\n", "analyze"):
        made.append(os.path.join(outdir, "imbalance.png"))
    feat = os.path.join(outdir, "features.dat")
    with open(feat, "w") as f:
        f.write("# rho_g kappa fan_in\n")
        for r in rows:
            f.write("%g %g %g\n" % (r["rho_g"] or 0, r["kappa"] or 0, r["fan_in"] or 0))
    script = ["set terminal png size 1200,400", "set output '%s'" % os.path.join(outdir, "features.png"),
              "set multiplot layout 1,3", "set style fill solid 0.6", "set ylabel 'phases'",
              "bin(x,w)=w*floor(x/w)"]
    for col, label in ((1, "rho_g"), (2, "kappa"), (3, "receiver fan-in")):
        vals = [float(x) for x in ([r["rho_g"] for r in rows], [r["kappa"] for r in rows],
                                   [r["fan_in"] for r in rows])[col - 1] if x is not None]
        lo, hi = (min(vals), max(vals)) if vals else (0, 1)
        w = (hi - lo) / 20 if hi > lo else 1
        script += ["set boxwidth %g" % (w * 0.9),
                   "set xrange [%g:%g]" % (lo - w, hi + w),
                   "set xlabel '%s'" % label,
                   "plot '%s' using (bin($%d,%g)):(1.0) smooth freq with boxes notitle" % (feat, col, w)]
    script.append("unset multiplot")
    if rows and gnuplot("\n".join(script) + "\n", "analyze"):
        made.append(os.path.join(outdir, "features.png"))
    return made


PATHS = ("native", "rail-only", "perm-only", "joint")


def replay(rows, recs, model):
    """Every row's recorded count matrix through `railwave sim-replay` (tools/sim_replay.c):
    each path's simulated dispatch and combine time and its ratio to the lower bound of
    docs/architecture.md §6. Rows with per-node sums only (large N) are not replayed."""
    first = {}
    for r in recs:
        if r["kind"] == "dispatch" and r["status"] == "ok" and r.get("counts"):
            first.setdefault((r["group"], r["layer"], r["step"]), r)
    comb = {}
    for r in recs:
        if r["kind"] == "combine" and r["status"] == "ok":
            comb.setdefault((r["group"], r["layer"], r["step"]), r["rec_size"])
    lines, keys = [], []
    for i, row in enumerate(rows):
        key = (row["group"], row["layer"], row["step"])
        r = first.get(key)
        crec = comb.get(key) or (r or {}).get("combine_rec_size")
        if not r or not crec:
            continue
        lines.append(json.dumps({"id": i, "nodes": r["N"], "rails": r["R"], "gpus": r["G"],
                                 "counts": r["counts"], "record_bytes": r["rec_size"],
                                 "combine_record_bytes": crec,
                                 "gbps": r.get("gbps") or [100.0] * r["R"]}))
        keys.append(i)
    if not lines:
        return 0
    tool = os.path.join(BUILD, "tools", "railwave") if BUILD else "railwave"
    p = subprocess.run([tool, "sim-replay", "--model", model, "-"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True)
    if p.returncode != 0:
        die("analyze: railwave sim-replay failed: %s" % p.stderr.strip()[-400:])
    for line in p.stdout.splitlines():
        res = json.loads(line)
        row = rows[res["id"]]
        row["sim"] = res
        for kind in ("dispatch", "combine"):
            lb = res[kind]["lower_bound_s"] * 1e3
            row["sim_lb_ms_" + kind] = lb
            if row.get(kind + "_ms") is not None and lb > 0:
                row[kind + "_over_lb"] = row[kind + "_ms"] / lb
    return len(lines)


def cmd_analyze(a):
    recs, _ = load(a.trace, "analyze")
    rows = analyze_rows(recs, a.gbps)
    if not rows:
        die("analyze: no completed dispatch phase with a count matrix in the traces")
    replayed = 0 if a.no_sim else replay(rows, recs, a.model)
    pts = [r for r in rows if r.get("expert_imb") is not None]
    xs = [r["expert_imb"] for r in pts]
    fits = (linfit(xs, [r["src_rail_imb"] for r in pts]), linfit(xs, [r["dst_rail_imb"] for r in pts]))
    out = {"phases": len(rows), "fits": {
        "source": dict(zip(("intercept", "slope", "r2"), fits[0]), n=len(pts)),
        "destination": dict(zip(("intercept", "slope", "r2"), fits[1]), n=len(pts))}}
    dist = {}
    for k in ("rho_g", "kappa", "fan_in", "expert_imb", "src_rail_imb", "dst_rail_imb"):
        v = [r[k] for r in rows if r.get(k) is not None]
        dist[k] = {"min": pct(v, 0), "p50": pct(v, 0.5), "p90": pct(v, 0.9), "max": pct(v, 1.0), "n": len(v)}
    out["distributions"] = dist
    paths = {}
    for r in rows:
        p = paths.setdefault(r["path"], {"phases": 0, "dispatch_ms": [], "combine_ms": [], "ratio": []})
        p["phases"] += 1
        if r["dispatch_ms"] is not None:
            p["dispatch_ms"].append(r["dispatch_ms"])
            if r.get("dispatch_over_lb") is not None:  # the simulator's bound (docs/architecture.md §6)
                p["ratio"].append(r["dispatch_over_lb"])
            elif r.get("lb_ms"):
                p["ratio"].append(r["dispatch_ms"] / r["lb_ms"])
        if r["combine_ms"] is not None:
            p["combine_ms"].append(r["combine_ms"])
    out["paths"] = {k: {"phases": v["phases"], "dispatch_ms_p50": pct(v["dispatch_ms"], 0.5),
                        "combine_ms_p50": pct(v["combine_ms"], 0.5),
                        "dispatch_over_lb_p50": pct(v["ratio"], 0.5)} for k, v in paths.items()}
    # What every path would have cost on the recorded demand (simulated, ratio to the bound),
    # and how the recorded path compares with the simulated best.
    sim_rows = [r for r in rows if "sim" in r]
    if sim_rows:
        what = {}
        for kind in ("dispatch", "combine"):
            for pth in PATHS:
                what.setdefault(pth, {})[kind + "_over_lb_p50"] = pct(
                    [r["sim"][kind]["paths"][pth]["ratio"] for r in sim_rows], 0.5)
            for pth in PATHS:
                what[pth]["best_" + kind] = sum(
                    1 for r in sim_rows
                    if min(PATHS, key=lambda q: (r["sim"][kind]["paths"][q]["time_s"], PATHS.index(q))) == pth)
        # A phase with nothing to move between nodes (calibrate's barrier pairs, a step whose
        # tokens all stayed home) takes no time on any path: there is nothing to regret.
        regret = []
        for r in sim_rows:
            best = min(r["sim"]["dispatch"]["paths"][q]["time_s"] for q in PATHS)
            if r["path"] in PATHS and best > 0:
                regret.append(r["sim"]["dispatch"]["paths"][r["path"]]["time_s"] / best)
        out["replay"] = {"model": a.model, "phases": len(sim_rows), "paths": what,
                         "chosen_over_best_p50": pct(regret, 0.5), "chosen_over_best_max": pct(regret, 1.0)}
    if a.plots:
        out["plots"] = plots(rows, fits, a.plots)
    if a.json:
        out["rows"] = rows
        json.dump(out, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
        return 0
    print("railwave analyze: %d dispatch phases (%d with every node's expert loads)" % (len(rows), len(pts)))
    print("\nexpert-load imbalance vs rail imbalance (max/mean; linear fit y = a + b x):")
    for name, (fa, fb, r2) in (("source rails", fits[0]), ("destination rails", fits[1])):
        print("  %-18s a %8.4f  b %8.4f  R^2 %.3f  (n %d)" % (name, fa, fb, r2, len(pts)))
    print("\n%-14s %8s %8s %8s %8s %5s" % ("distribution", "min", "p50", "p90", "max", "n"))
    for k, label in (("rho_g", "rho_g"), ("kappa", "kappa"), ("fan_in", "fan-in"),
                     ("expert_imb", "expert imb."), ("src_rail_imb", "src-rail imb."),
                     ("dst_rail_imb", "dst-rail imb.")):
        d = dist[k]
        print("%-14s %8.3f %8.3f %8.3f %8.3f %5d" % (label, d["min"], d["p50"], d["p90"], d["max"], d["n"]))
    print("\nrecorded (phase time: the slowest node's; LB: %s):" % (
        "docs/architecture.md §6, from railwave sim" if "replay" in out else "every node's remote bytes over its NICs"))
    print("%-10s %7s %14s %14s %16s" % ("path", "phases", "dispatch p50", "combine p50", "dispatch/LB p50"))
    for k, v in sorted(out["paths"].items(), key=lambda kv: str(kv[0])):
        f = lambda x, unit="": "-" if math.isnan(x) else "%.2f%s" % (x, unit)  # noqa: E731
        print("%-10s %7d %14s %14s %16s" % (k, v["phases"], f(v["dispatch_ms_p50"], " ms"),
                                            f(v["combine_ms_p50"], " ms"), f(v["dispatch_over_lb_p50"])))
    if "replay" in out:
        rp = out["replay"]
        print("\nevery path on the recorded matrices (railwave sim, %s model, %d phases; time / lower "
              "bound, median; best = fastest in that many phases):" % (rp["model"], rp["phases"]))
        print("%-10s %14s %10s %14s %10s" % ("path", "dispatch/LB", "best", "combine/LB", "best"))
        for pth in PATHS:
            w = rp["paths"][pth]
            print("%-10s %14.3f %10d %14.3f %10d" % (pth, w["dispatch_over_lb_p50"], w["best_dispatch"],
                                                     w["combine_over_lb_p50"], w["best_combine"]))
        print("recorded path / simulated best (dispatch): median %.3f, max %.3f" % (
            rp["chosen_over_best_p50"], rp["chosen_over_best_max"]))
    for pth in out.get("plots", []):
        print("plot: %s" % pth)
    return 0


# ---- top -------------------------------------------------------------------------------------

def ask(path, cmd, timeout=2.0):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(cmd.encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    finally:
        s.close()
    return buf.decode(errors="replace").strip("\n").splitlines()


def kv_line(line):
    out = {}
    for tok in line.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
    return out


def sample(path):
    st = {}
    for line in ask(path, "stats"):
        k, _, v = line.partition(" ")
        st[k] = v
    rails = [kv_line(l) for l in ask(path, "stats rails") if l.startswith("rail=")]
    peers = [kv_line(l) for l in ask(path, "stats peers") if l.startswith("peer=")]
    ph = [kv_line(l) for l in ask(path, "stats phases") if l.startswith("path=")]
    sel = [kv_line(l) for l in ask(path, "stats selector") if l.startswith("decision ")]
    return {"t": time.monotonic(), "stats": st, "rails": rails, "peers": peers, "phases": ph,
            "decisions": sel[:3]}


def bar(frac, width=20):
    frac = max(0.0, min(1.0, frac))
    n = int(round(frac * width))
    return "#" * n + "." * (width - n)


def frame(name, a, b, gbps):
    """One daemon's block from two samples a (older) and b."""
    dt = max(b["t"] - a["t"], 1e-6)
    st = b["stats"]
    out = ["%s  node %s (%s)  state %s  peers up %s  ranks %s  uptime %ss" % (
        name, st.get("node", "?"), st.get("node_index", "?"), st.get("state", "?"),
        st.get("peers_up", "?"), st.get("clients", "?"), st.get("uptime_s", "?"))]
    out.append("  rail   tx MB/s   rx MB/s   tx util              errors")
    for ra, rb in zip(a["rails"], b["rails"]):
        tx = (int(rb["tx_bytes"]) - int(ra["tx_bytes"])) / dt
        rx = (int(rb["rx_bytes"]) - int(ra["rx_bytes"])) / dt
        util = tx * 8 / (gbps * 1e9) if gbps else 0.0
        out.append("  %4s %9.2f %9.2f   %s %3.0f%%  %s" % (rb["rail"], tx / 1e6, rx / 1e6, bar(util),
                                                       util * 100, rb.get("errors", "0")))
    pa = {(p["path"], p["kind"]): p for p in a["phases"]}
    out.append("  path       kind      phases/s    ok  failed   p50 ms   p99 ms")
    for p in b["phases"]:
        q = pa.get((p["path"], p["kind"]), p)
        rate = (int(p["ok"]) + int(p["failed"]) - int(q["ok"]) - int(q["failed"])) / dt
        if int(p["ok"]) + int(p["failed"]) == 0:
            continue
        out.append("  %-10s %-8s %9.1f %5s %7s %8.2f %8.2f" % (
            p["path"], p["kind"], rate, p["ok"], p["failed"], float(p["p50_us"]) / 1e3,
            float(p["p99_us"]) / 1e3))
    for p in b["peers"]:
        if p.get("state") == "self":
            continue
        out.append("  peer %-3s %-10s %-10s rails up %-2s rtt %s us  errors %s" % (
            p["peer"], p.get("name", ""), p.get("state", ""), p.get("rails_up", ""),
            p.get("rtt_us", "?"), p.get("errors", "0")))
    for d in b["decisions"]:
        out.append("  decision L%s s%s %s (%s) rho_g %s kappa %s" % (
            d.get("layer"), d.get("step"), d.get("path"), d.get("reason"), d.get("rho_g"), d.get("kappa")))
    errs = [(k, v) for k, v in st.items() if k.startswith("error_")]
    out.append("  errors %s%s" % (st.get("errors", "0"), "".join("  %s %s" % e for e in errs)))
    return out


COMPACT_HEAD = "%-8s %-9s %-6s %5s %9s %9s %-12s %9s %6s %8s %6s" % (
    "node", "state", "peers", "ranks", "tx MB/s", "rx MB/s", "hot rail", "phases/s", "failed",
    "p99 ms", "errors")


def compact(a, b, gbps):
    """One daemon in one line (top --compact): totals over its rails and paths, its hottest rail."""
    dt = max(b["t"] - a["t"], 1e-6)
    st = b["stats"]
    tx = [(int(rb["tx_bytes"]) - int(ra["tx_bytes"])) / dt for ra, rb in zip(a["rails"], b["rails"])]
    rx = [(int(rb["rx_bytes"]) - int(ra["rx_bytes"])) / dt for ra, rb in zip(a["rails"], b["rails"])]
    hot = max(range(len(tx)), key=lambda r: tx[r]) if tx else None
    hot_txt = "-" if hot is None else "%s %s" % (
        b["rails"][hot]["rail"], "%.0f%%" % (tx[hot] * 8 / (gbps * 1e9) * 100) if gbps else
        "%.1fMB/s" % (tx[hot] / 1e6))
    pa = {(p["path"], p["kind"]): p for p in a["phases"]}
    done = sum(int(p["ok"]) + int(p["failed"]) - int(pa.get((p["path"], p["kind"]), p)["ok"]) -
               int(pa.get((p["path"], p["kind"]), p)["failed"]) for p in b["phases"])
    failed = sum(int(p["failed"]) for p in b["phases"])
    p99 = max([float(p["p99_us"]) / 1e3 for p in b["phases"] if int(p["ok"]) + int(p["failed"])] or [0.0])
    return "%-8s %-9s %-6s %5s %9.2f %9.2f %-12s %9.1f %6d %8.2f %6s" % (
        st.get("node", "?")[:8], st.get("state", "?")[:9], st.get("peers_up", "?"),
        st.get("clients", "?"), sum(tx) / 1e6, sum(rx) / 1e6, hot_txt, done / dt, failed, p99,
        st.get("errors", "0"))


def cmd_top(a):
    # The same defaults as `railwave stats` (docs/service.md "Sockets").
    socks = list(a.socket or []) + ["/run/railwave/%s.stats" % n for n in (a.node or [])]
    if not socks and os.environ.get("RAILWAVE_STATS_SOCKET"):
        socks = [os.environ["RAILWAVE_STATS_SOCKET"]]
    if not socks:
        socks = sorted(glob.glob("/run/railwave/*.stats") + glob.glob("/run/railwave/stats.sock"))
    if not socks:
        die("top: no stats socket given, no $RAILWAVE_STATS_SOCKET, none in /run/railwave "
            "(use --socket PATH)")
    # One line per daemon when the blocks (a dozen lines each) would not fit: more than two
    # daemons, unless --full; --compact asks for it with any number.
    short = a.compact or (len(socks) > 2 and not a.full)
    prev = {}
    try:
        while True:
            cur, lines = {}, [COMPACT_HEAD] if short else []
            for s in socks:
                try:
                    if s not in prev:
                        prev[s] = sample(s)
                        time.sleep(a.interval)
                    cur[s] = sample(s)
                except OSError as e:
                    if a.once:
                        die("top: %s: %s (%s)" % (s, e, "join group railwave, the sockets' group"
                                                   if e.errno == errno.EACCES else "is railwaved running?"))
                    lines.append("%s: %s" % (s, e))
                    continue
                if short:
                    lines.append(compact(prev[s], cur[s], a.gbps))
                else:
                    lines += frame(s, prev[s], cur[s], a.gbps)
                    lines.append("")
            prev.update(cur)
            if a.once:
                print("\n".join(lines))
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S  railwave top  (Ctrl-C quits)\n\n")
                             + "\n".join(lines) + "\n")
            sys.stdout.flush()
            time.sleep(a.interval)
    except KeyboardInterrupt:
        return 0


# ---- main --------------------------------------------------------------------------------------

def main(argv):
    if len(argv) < 1:
        die("observe.py: no mode", 2)
    global BUILD
    mode, rest = argv[0], argv[1:]
    if len(rest) >= 2 and rest[0] == "--build":
        BUILD, rest = rest[1], rest[2:]
    if mode == "trace":
        p = argparse.ArgumentParser(prog="railwave trace", description="phase traces: export, late")
        sub = p.add_subparsers(dest="sub", required=True)
        e = sub.add_parser("export", help="Chrome trace / Perfetto JSON")
        e.add_argument("trace", nargs="+", help="trace files or directories")
        e.add_argument("-o", "--output", help="output file (default: stdout)")
        e.add_argument("--group")
        e.add_argument("--layer", type=int)
        e.add_argument("--step", type=int)
        l = sub.add_parser("late", help="per step: who submitted last and by how much")
        l.add_argument("trace", nargs="+")
        l.add_argument("--group")
        l.add_argument("--top", type=int, default=10, help="nodes in the summary (10)")
        l.add_argument("--json", action="store_true")
        a = p.parse_args(rest)
        return cmd_export(a) if a.sub == "export" else cmd_late(a)
    if mode == "analyze":
        p = argparse.ArgumentParser(
            prog="railwave analyze",
            description="Over phase traces (files or directories): expert-load vs source/destination-"
                        "rail imbalance with linear fits, distributions of rho_g, kappa and fan-in, "
                        "phase time / lower bound per path, and every path replayed on the recorded "
                        "matrices through the simulator (docs/tools.md).")
        p.add_argument("trace", nargs="+")
        p.add_argument("--plots", metavar="DIR", help="write PNG plots (gnuplot) into DIR")
        p.add_argument("--gbps", type=float, help="NIC rate for the lower bound (default: the traces')")
        p.add_argument("--model", default="maxmin", choices=("maxmin", "lossless"),
                       help="simulator model for the replay (maxmin)")
        p.add_argument("--no-sim", action="store_true", help="do not replay through railwave sim")
        p.add_argument("--json", action="store_true")
        return cmd_analyze(p.parse_args(rest))
    if mode == "top":
        p = argparse.ArgumentParser(prog="railwave top", description="live view over stats sockets")
        p.add_argument("--socket", action="append", help="a stats socket (repeatable)")
        p.add_argument("--node", action="append", help="/run/railwave/NAME.stats (repeatable)")
        p.add_argument("--interval", type=float, default=1.0, help="refresh seconds (1)")
        p.add_argument("--gbps", type=float, default=0.0, help="NIC rate for the utilisation bars")
        p.add_argument("--once", action="store_true", help="print one frame (two samples) and exit")
        p.add_argument("--compact", action="store_true",
                       help="one line per daemon (the default with more than two daemons)")
        p.add_argument("--full", action="store_true",
                       help="a block per daemon: rails, paths, peers, decisions (default with two or fewer)")
        return cmd_top(p.parse_args(rest))
    die("observe.py: unknown mode %s" % mode, 2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
