#!/usr/bin/env python3
"""`railwave demo` and `railwave bench` (docs/demo.md, docs/perf/testbed.md): the main job on the
rail test bed. Run through build/tools/railwave, which passes --build.

Process glue only: it brings up the test bed (tests/testbed/testbed.sh) or falls back to
loopback, writes the cluster file, starts one railwaved per node and the rank programs
(build/tools/rw_bench_rank: they submit, time and verify every phase), runs Open MPI's
MPI_Alltoallv (build/bin/rw_mpi_alltoallv) on the same byte matrix, and prints/writes what they
measured. Every number about the workload (counts, features, per-path NIC loads, lower bound,
selector verdict, calibration) comes from sched/ through `railwave bench-workload`.

Nothing is left running: daemons, ranks and mpirun are killed and the test bed is torn down on
normal exit, on an error, on Ctrl-C and on SIGTERM."""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its modules, however loaded
# (Bed, Ctx, Daemons, Procs, pct, summary and PATHS are also what calibrate.py and
# tests/testbed/rail_health.py take from here.)
from bench_procs import WAIT, Bed, Ctx, Daemons, Procs, pct, say, summary  # noqa: E402,F401
from bench_report import PATHS, WHAT, write_bench  # noqa: E402,F401


def wl_args(a, wl):
    out = ["--nodes", str(a.nodes), "--gpus", str(a.gpus), "--rails", str(a.rails)]
    for k in ("experts", "topk", "hidden", "tokens", "zipf", "dirichlet", "rail_skew", "seed", "layer"):
        out += ["--" + k.replace("_", "-"), str(wl[k])]
    return out


def describe(ctx, wl, anchors=None):
    argv = [ctx.bin("railwave"), "bench-workload", "describe", "--nic-gbps",
            str(ctx.args.mbit / 1000.0)] + wl_args(ctx.args, wl)
    if anchors:
        argv += ["--anchors", anchors]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError("bench-workload describe failed: " + r.stderr.strip())
    return json.loads(r.stdout)


def run_ranks(ctx, daemons, wl, group, steps, label, progress=True):
    """Run every rank for `steps` pairs (+1 warm-up, dropped). Returns per-step dispatch and
    combine times: from the last rank's submission to the last rank's completion."""
    a = ctx.args
    W = a.nodes * a.gpus
    outs, ranks = [], []
    for q in range(W):
        node = q // a.gpus
        of = open(os.path.join(daemons.tmp, "rank%d.out" % q), "w+")
        ef = open(os.path.join(daemons.tmp, "rank%d.err" % q), "w+")
        argv = ctx.bed.wrap(node, [ctx.bin("rw_bench_rank"), "--socket",
                                   daemons.cfg["nodes"][node]["ipc_socket"], "--group", group,
                                   "--rank", str(q), "--steps", str(steps + 1)] + wl_args(a, wl))
        ranks.append(ctx.procs.spawn(argv, stdout=of, stderr=ef))
        outs.append((of, ef))
    shown = 0
    disp, comb = [], []
    deadline = time.time() + WAIT + steps * 60
    failed = None
    try:
        while True:
            done = all(p.poll() is not None for p in ranks)
            for q, p in enumerate(ranks):
                if p.poll() not in (None, 0):
                    outs[q][1].seek(0)
                    failed = "rank %d exited %s: %s" % (q, p.returncode, outs[q][1].read().strip()[-600:])
                    break
            if failed:
                break
            rows = []
            for of, _ in outs:
                of.seek(0)
                rows.append([l.split() for l in of.read().splitlines() if l.startswith("pair ")])
            n_ok = min(len(r) for r in rows)
            while shown < n_ok:
                st = [r[shown] for r in rows]
                d = (max(int(s[3]) for s in st) - max(int(s[2]) for s in st)) / 1e9
                c = (max(int(s[5]) for s in st) - max(int(s[4]) for s in st)) / 1e9
                if shown > 0:
                    disp.append(d)
                    comb.append(c)
                if progress:
                    say("  %-10s %-9s dispatch %6.3f s  combine %6.3f s" % (
                        label, "warm-up" if shown == 0 else "%d/%d" % (shown, steps), d, c))
                shown += 1
            if done:
                break
            if time.time() > deadline:
                failed = "ranks did not finish in time"
                break
            time.sleep(0.1)
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            ctx.procs.forget(p)
        for of, ef in outs:
            of.close()
            ef.close()
    if failed:
        raise RuntimeError(failed + "\n" + daemons.log_tail(0))
    if len(disp) != steps:
        raise RuntimeError("ranks ended after %d of %d pairs" % (len(disp), steps))
    return disp, comb


def run_contender(ctx, tmp_root, wl, desc, path, steps, label, anchors=None, progress=True):
    """Daemons for one contender, the ranks, and what the daemons counted."""
    tmp = tempfile.mkdtemp(prefix="c.", dir=tmp_root)
    d = Daemons(ctx, tmp, path, desc["recv_region_mib"], desc["workload"]["expert_slots"], anchors)
    try:
        d.start()
        tx0 = d.rail_tx()
        cpu0, wall0 = d.cpu_seconds(), time.time()
        disp, comb = run_ranks(ctx, d, wl, "rw.%s" % path, steps, label, progress)
        cpu = d.cpu_seconds() - cpu0
        wall = time.time() - wall0
        tx1 = d.rail_tx()
        decision = d.last_decision()
    finally:
        bad = d.stop()
    if bad:
        raise RuntimeError("daemons did not stop cleanly: %s" % ", ".join(bad))
    tx = [[tx1[n][r] - tx0[n][r] for r in range(len(tx0[n]))] for n in range(len(tx0))]
    return {"dispatch": summary(disp), "combine": summary(comb), "tx_bytes": tx,
            "decision": decision, "pairs": steps + 1,
            "daemon_cpu_s_per_pair": cpu / (steps + 1), "run_wall_s": wall,
            "loadavg": os.getloadavg()[0]}


def run_mpi(ctx, tmp_root, wl, desc, steps, progress=True, tries=3):
    """MPI_Alltoallv on the workload's byte matrix; a launcher failure is retried, and after
    `tries` the contender is recorded as failed (the RailWave contenders still count)."""
    for attempt in range(tries):
        try:
            return run_mpi_once(ctx, tmp_root, wl, desc, steps, progress)
        except RuntimeError as e:
            say("  mpi        attempt %d failed: %s" % (attempt + 1, str(e).strip().splitlines()[0][:200]))
            err = str(e)
    return {"error": err[-800:]}


def run_mpi_once(ctx, tmp_root, wl, desc, steps, progress=True):
    a = ctx.args
    W = a.nodes * a.gpus
    mpirun = shutil.which("mpirun")
    if not mpirun:
        return {"skipped": "no mpirun"}
    try:
        prog = ctx.bin("rw_mpi_alltoallv")
    except RuntimeError as e:
        return {"skipped": str(e)}
    tmp = tempfile.mkdtemp(prefix="mpi.", dir=tmp_root)
    mfile, rfile = os.path.join(tmp, "matrix.txt"), os.path.join(tmp, "return.txt")
    m = desc["mpi_matrix"]
    # The combine's trip back: every record returns from the rank that got it, at the combine
    # record size (the transpose of the dispatch matrix, in records, times combine bytes).
    crec = desc["combine_record_bytes"]
    back = [m[d * W + s] // desc["record_bytes"] * crec for s in range(W) for d in range(W)]
    for path, mat in ((mfile, m), (rfile, back)):
        with open(path, "w") as f:
            f.write("%d\n" % W)
            for s in range(W):
                f.write(" ".join(str(x) for x in mat[s * W:(s + 1) * W]) + "\n")
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(W)]
    env = dict(os.environ, RW_TESTBED_PREFIX=ctx.bed.prefix, OMPI_MCA_btl_tcp_links="1")
    if ctx.bed.mode == "testbed":
        argv += ["--host", ",".join("node%d:%d" % (n, a.gpus) for n in range(a.nodes)),
                 "--mca", "plm_rsh_agent", os.path.join(ctx.src, "tests", "testbed", "mpi_agent.sh"),
                 "--mca", "oob_tcp_if_include", "10.78.0.0/24",
                 "--mca", "btl_tcp_if_include", ",".join("10.77.%d.0/24" % r for r in range(a.rails))]
    else:
        argv += ["--host", "localhost:%d" % W, "--mca", "btl_tcp_if_include", "lo"]
    # routed=direct: ORTE's default tree routing sometimes loses its way between the namespaces
    # ("does not know how to route a message to the specified daemon").
    argv += ["--mca", "routed", "direct", "--mca", "btl", "tcp,self", prog, mfile, str(steps + 1),
             rfile]
    log = os.path.join(tmp, "mpirun.log")
    with open(log, "w") as lf:
        p = ctx.procs.spawn(argv, stdout=subprocess.PIPE, stderr=lf, env=env, text=True)
        try:
            out, _ = p.communicate(timeout=WAIT + steps * 60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            out = ""
        ctx.procs.forget(p)
    res = None
    for line in (out or "").splitlines():
        if line.startswith("{"):
            res = json.loads(line)
    if p.returncode != 0 or not res or res.get("errors"):
        with open(log) as lf:
            tail = lf.read()[-800:]
        raise RuntimeError("MPI_Alltoallv run failed (exit %s): %s" % (p.returncode, tail))
    secs, back_secs = res["seconds"][1:], res["return_seconds"][1:]
    if progress:
        say("  %-10s %d alltoallv: median %.3f s, return trip %.3f s" % (
            "mpi", len(secs), pct(secs, 0.5), pct(back_secs, 0.5)))
    return {"dispatch": summary(secs), "combine": summary(back_secs), "bytes": res["bytes"]}


def calibrate(ctx, cases, out_path):
    """Anchor table from the forced paths' dispatch samples (docs/selector.md §2, in sched/)."""
    a = ctx.args
    doc = {"fingerprint": {"nodes": a.nodes, "gpus_per_node": a.gpus, "rails": a.rails,
                           "nic_gbps": a.mbit / 1000.0, "transport": "tcp"},
           "max_size_ratio": 4.0, "shape_tolerance": 0.15, "cv_bound": 0.10, "margin": 0.05,
           "cases": cases}
    r = subprocess.run([ctx.bin("railwave"), "bench-workload", "calibrate"], input=json.dumps(doc),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError("calibration failed: " + r.stderr.strip())
    with open(out_path, "w") as f:
        f.write(r.stdout)
    return json.loads(r.stdout)


def nic_view(desc, path, rec, crec):
    """Per-path NIC numbers from the plan: busiest NIC and the mean over all NICs (egress)."""
    p = desc["paths"][path]
    eg = p["egress_records"]
    busiest = p["busiest_records"]
    mean_eg = sum(eg) / len(eg)
    return busiest, mean_eg


def expected_tx(desc, path, pairs):
    """What every daemon's tx_bytes counters must show after `pairs` dispatch+combine pairs:
    dispatch egress records x record bytes + combine egress (= dispatch ingress) x combine
    record bytes, per (node, rail)."""
    a = desc["workload"]
    N, R = a["nodes"], a["rails"]
    p = desc["paths"][path]
    return [[pairs * (p["egress_records"][n * R + r] * desc["record_bytes"] +
                      p["ingress_records"][n * R + r] * desc["combine_record_bytes"])
             for r in range(R)] for n in range(N)]


def where_busiest(desc, path):
    a = desc["workload"]
    R = a["rails"]
    p = desc["paths"][path]
    best = max(range(len(p["egress_records"])), key=lambda i: p["egress_records"][i])
    besti = max(range(len(p["ingress_records"])), key=lambda i: p["ingress_records"][i])
    if p["ingress_records"][besti] > p["egress_records"][best]:
        return "node %d rail %d ingress" % (besti // R, besti % R)
    return "node %d rail %d egress" % (best // R, best % R)


# ---------------------------------------------------------------------------------------------
# demo


def demo(ctx, tmp):
    a = ctx.args
    wl = {"experts": a.experts, "topk": a.topk, "hidden": a.hidden, "tokens": a.tokens,
          "zipf": a.zipf, "dirichlet": a.dirichlet, "rail_skew": a.rail_skew, "seed": a.seed,
          "layer": a.layer}
    desc = describe(ctx, wl)
    f = desc["features"]
    rec, crec = desc["record_bytes"], desc["combine_record_bytes"]
    shaped = ctx.bed.mode == "testbed"
    say("cluster: %d nodes x %d rails, %d ranks per node, one railwaved per node (tcp transport); "
        "this machine: %d CPUs, load average %.1f" % (a.nodes, a.rails, a.gpus, os.cpu_count(),
                                                      os.getloadavg()[0]))
    if shaped:
        say("network: rail test bed, %d Mbit/s per NIC (tc tbf on both directions of every NIC, packets < 512 B first), "
            "control channel on the management bridge" % a.mbit)
    else:
        say("network: LOOPBACK (%s). The tcp transport has no rate pacing, so this run is "
            "UNSHAPED: its times are CPU/memory-bound, not NIC-bound, and time / lower bound "
            "below is not meaningful." % ctx.bed.why)
    say("workload: %d experts, top-%d, hidden %d bf16 (%d B per dispatch record), %d tokens per "
        "rank, zipf %.2g, dirichlet %.3g, rail-skew %.3g, seed %d"
        % (a.experts, a.topk, a.hidden, rec, a.tokens, a.zipf, a.dirichlet, a.rail_skew, a.seed))
    say("features: B = %.2f MB per GPU (f0 %.2f), rho_g = %.2f (f1 %.3f), kappa = %.2f (f2 %.3f), "
        "max receiver fan-in %d" % (f["B"] / 1e6, f["f"][0], f["rho_g"], f["f"][1], f["kappa"],
                                    f["f"][2], f["max_fan_in"]))
    lb = desc["lower_bound_records"]
    say("lower bound: busiest NIC after the best per-pair balance carries %d records (%.2f MB): "
        "%.3f s dispatch, %.3f s combine at %d Mbit/s" % (lb, lb * rec / 1e6,
                                                           desc["lower_bound_s"]["dispatch"],
                                                           desc["lower_bound_s"]["combine"], a.mbit))
    say("")
    res = {}
    for path in PATHS:
        if path not in a.paths.split(","):
            continue
        say("[%s] %s" % (path, WHAT[path]))
        res[path] = run_contender(ctx, tmp, wl, desc, path, a.pairs, path)
    # The selector: calibrate one anchor from the forced paths' samples, then let it choose.
    table_path = os.path.join(tmp, "anchors.json")
    case = {"case_id": 1, "features": f["f"],
            "samples": {p: res[p]["dispatch"]["samples"] for p in PATHS if p in res}}
    if len(case["samples"]) < len(PATHS):
        return {"mode": ctx.bed.mode, "results": res}  # --paths: a debugging subset, no tables
    table = calibrate(ctx, [case], table_path)
    say("[auto] selector with an anchor table calibrated from the runs above (docs/selector.md §2 rule)")
    res["auto"] = run_contender(ctx, tmp, wl, desc, "auto", a.pairs, "auto", anchors=table_path)
    if a.mpi:
        say("[mpi] %s" % WHAT["mpi"])
        res["mpi"] = run_mpi(ctx, tmp, wl, desc, a.pairs)

    # ---- tables
    say("")
    native = res["native"]["dispatch"]["median"]
    native_c = res["native"]["combine"]["median"]
    W = a.nodes * a.gpus
    mismatched = []
    for path in PATHS + ["auto"]:
        r = res[path]
        planned = path if path != "auto" else r["decision"].get("path", "joint")
        busiest, mean_eg = nic_view(desc, planned, rec, crec)
        d, c = r["dispatch"], r["combine"]
        exp = expected_tx(desc, planned, r["pairs"])
        match = exp == r["tx_bytes"]
        say("== %s: %s" % (path if path != "auto" else "selector (auto -> %s)" % planned, WHAT[path]))
        say("   %-34s %14s %14s" % ("", "dispatch", "combine"))
        say("   %-34s %8.3f s      %8.3f s" % ("phase time, median", d["median"], c["median"]))
        say("   %-34s %5.3f-%5.3f s  %5.3f-%5.3f s" % ("  p10-p90 over %d pairs" % d["n"], d["p10"],
                                                     d["p90"], c["p10"], c["p90"]))
        say("   %-34s %8.2f MB     %8.2f MB" % ("busiest NIC bytes (%s)" % where_busiest(desc, planned),
                                                 busiest * rec / 1e6, busiest * crec / 1e6))
        say("   %-34s %8.1f        %8.1f" % ("busiest NIC Mbit/s", busiest * rec * 8 / d["median"] / 1e6,
                                              busiest * crec * 8 / c["median"] / 1e6))
        say("   %-34s %8.1f        %8.1f" % ("mean NIC Mbit/s (%d NICs)" % (a.nodes * a.rails),
                                              mean_eg * rec * 8 / d["median"] / 1e6,
                                              mean_eg * crec * 8 / c["median"] / 1e6))
        say("   %-34s %8.2f%s      %8.2f%s" % ("time / lower bound", d["median"] / desc["lower_bound_s"]["dispatch"],
                                                "" if shaped else "*", c["median"] / desc["lower_bound_s"]["combine"],
                                                "" if shaped else "*"))
        say("   %-34s %8.2fx       %8.2fx" % ("speedup vs native", native / d["median"], native_c / c["median"]))
        say("   %-34s %8.3f s per dispatch+combine pair (all %d daemons)" % (
            "daemon CPU time", r["daemon_cpu_s_per_pair"], a.nodes))
        say("   verified: %d ranks x %d pairs, every row, id, weight, expert count and combined sum "
            "exact; daemons' per-NIC tx bytes %s the plan" % (W, r["pairs"],
                                                              "match" if match else "DIFFER FROM"))
        say("")
        if not match:
            mismatched.append(path)
    if "mpi" in res and "dispatch" in res["mpi"]:
        m = res["mpi"]["dispatch"]
        say("== mpi: %s" % WHAT["mpi"])
        say("   alltoallv of the same bytes, median %.3f s (p10 %.3f, p90 %.3f): %.2f x lower bound, "
            "%.2fx vs native dispatch" % (m["median"], m["p10"], m["p90"],
                                          m["median"] / desc["lower_bound_s"]["dispatch"], native / m["median"]))
        if "combine" in res["mpi"]:
            c = res["mpi"]["combine"]
            say("   return trip (the combine's bytes), median %.3f s (p10 %.3f, p90 %.3f): %.2f x lower "
                "bound" % (c["median"], c["p10"], c["p90"], c["median"] / desc["lower_bound_s"]["combine"]))
        say("")
    dec = res["auto"]["decision"]
    anc = table["anchors"][0]
    say("selector: picked %s, reason %s (anchor case %s, squared distance %s)"
        % (dec.get("path"), dec.get("reason"), dec.get("case"), dec.get("d2")))
    say("  features it saw: f0 = %s, f1 = %s, f2 = %s (B %s, rho_g %s, kappa %s, fan-in %s)"
        % (dec.get("f0"), dec.get("f1"), dec.get("f2"), dec.get("B"), dec.get("rho_g"),
           dec.get("kappa"), dec.get("fan_in")))
    sm = anc["samples"]
    say("  anchor 1 says %s: measured dispatch medians %s" % (
        anc["selected"], ", ".join("%s %.3f s" % (p, sm[p]["median"]) for p in PATHS)))
    say("  rule: keep a path other than joint only if both are stable (CV < 10%%) and its p90 x 1.05 "
        "< joint's p10 (%.3f s)" % sm["joint"]["p10"])
    best = min(PATHS, key=lambda p: res[p]["dispatch"]["median"])
    say("")
    say("summary (dispatch median, time / lower bound%s):" % ("" if shaped else ", unshaped*"))
    for p in PATHS + ["auto"] + (["mpi"] if "mpi" in res and "dispatch" in res["mpi"] else []):
        m = res[p]["dispatch"]["median"]
        say("  %-10s %7.3f s  %5.2f  %5.2fx vs native%s" % (
            p, m, m / desc["lower_bound_s"]["dispatch"], native / m, "  <- fastest forced path" if p == best else ""))
    if mismatched:
        raise RuntimeError("daemon byte counters differ from the plan for: " + ", ".join(mismatched))
    return {"mode": ctx.bed.mode, "describe": {k: v for k, v in desc.items() if k not in ("mpi_matrix",)},
            "results": res, "anchors": table}


# ---------------------------------------------------------------------------------------------
# bench


def run_retry(ctx, tmp, wl, desc, path, steps, label, **kw):
    """A bench run that failed (a rank's check, a daemon) is reported and run once more; a
    second failure ends the bench. Failures are kept in the results, never hidden."""
    try:
        return run_contender(ctx, tmp, wl, desc, path, steps, label, **kw)
    except RuntimeError as e:
        say("  %-10s FAILED, running it again: %s" % (path, str(e).strip().splitlines()[0][:300]))
        r = run_contender(ctx, tmp, wl, desc, path, steps, label, **kw)
        r["failed_once"] = str(e)[-800:]
        return r


def bench_points(a):
    """The sweep: rail skew (rho_g 1..R), payload size, expert skew, receiver fan-in."""
    base = {"experts": a.experts, "topk": a.topk, "hidden": a.hidden, "tokens": a.tokens,
            "zipf": 0.0, "dirichlet": 0.0, "rail_skew": 0.0, "seed": a.seed, "layer": a.layer}
    pts = []
    # rail_skew for target rho_g = t when G = R: the hot GPU owns R/t... share 1/(1+(G-1)(1-s)).
    skews = [0.0, 0.67, 0.89, 1.0] if not a.short else [0.0, 0.89]
    for s in skews:
        pts.append(("rail-skew", dict(base, rail_skew=s)))
    if not a.short:
        for mult in (0.25, 2.0):
            pts.append(("size", dict(base, rail_skew=0.89, tokens=max(1, int(a.tokens * mult)))))
        pts.append(("expert-skew", dict(base, rail_skew=0.89, zipf=1.2)))
        for alpha in (0.5, 0.05):
            pts.append(("fan-in", dict(base, rail_skew=0.89, dirichlet=alpha)))
    return pts


def bench(ctx, tmp):
    a = ctx.args
    pts = bench_points(a)
    os.makedirs(a.out, exist_ok=True)
    shaped = ctx.bed.mode == "testbed"
    say("bench: %d nodes x %d rails x %d ranks/node, %s, %d points x (4 paths + MPI, then the "
        "selector), %d pairs each" % (a.nodes, a.rails, a.gpus,
                                      "%d Mbit/s per NIC" % a.mbit if shaped else
                                      "LOOPBACK, unshaped: " + ctx.bed.why, len(pts), a.pairs))
    load0 = os.getloadavg()
    results, mpi_failed = [], []
    for i, (axis, wl) in enumerate(pts):
        desc = describe(ctx, wl)
        f = desc["features"]
        say("point %d/%d [%s] tokens %d zipf %.2g dirichlet %.3g rail-skew %.2f: rho_g %.2f kappa %.2f "
            "fan-in %d, lower bound %.3f s" % (i + 1, len(pts), axis, wl["tokens"], wl["zipf"],
                                               wl["dirichlet"], wl["rail_skew"], f["rho_g"], f["kappa"],
                                               f["max_fan_in"], desc["lower_bound_s"]["dispatch"]))
        r = {}
        for path in PATHS:
            r[path] = run_retry(ctx, tmp, wl, desc, path, a.pairs, path, progress=a.verbose)
            say("  %-10s dispatch %.3f s (p10 %.3f p90 %.3f)  combine %.3f s" % (
                path, r[path]["dispatch"]["median"], r[path]["dispatch"]["p10"],
                r[path]["dispatch"]["p90"], r[path]["combine"]["median"]))
        if not a.no_mpi:
            r["mpi"] = run_mpi(ctx, tmp, wl, desc, a.pairs, progress=True)
        if not a.no_mpi and "error" in r["mpi"]:
            mpi_failed.append(i + 1)
        results.append({"axis": axis, "workload": wl, "features": f,
                        "lower_bound_s": desc["lower_bound_s"],
                        "busiest_records": {p: desc["paths"][p]["busiest_records"] for p in PATHS},
                        "lower_bound_records": desc["lower_bound_records"],
                        "record_bytes": desc["record_bytes"], "results": r})
        with open(os.path.join(a.out, a.name + ".partial.json"), "w") as pf:
            json.dump(results, pf)
    cases = [{"case_id": i + 1, "features": p["features"]["f"],
              "samples": {q: p["results"][q]["dispatch"]["samples"] for q in PATHS}}
             for i, p in enumerate(results)]
    table_path = os.path.join(a.out, a.name + "-anchors.json")
    table = calibrate(ctx, cases, table_path)
    say("anchor table calibrated from the forced paths: %s (%s)" % (
        table_path, ", ".join("case %d %s" % (x["case_id"], x["selected"]) for x in table["anchors"])))
    # The selector is judged out of sample: at point i it runs with a table calibrated from
    # every other point's forced runs (leave one point out), so it never sees the point's own
    # measurements.
    for i, (axis, wl) in enumerate(pts):
        desc = describe(ctx, wl)
        loo_path = os.path.join(tmp, "anchors-without-%d.json" % (i + 1))
        calibrate(ctx, [c for c in cases if c["case_id"] != i + 1], loo_path)
        r = run_retry(ctx, tmp, wl, desc, "auto", a.pairs, "auto", anchors=loo_path,
                      progress=a.verbose)
        results[i]["results"]["auto"] = r
        say("point %d/%d selector (table without this point) -> %s (%s, case %s): dispatch %.3f s" % (
            i + 1, len(pts), r["decision"].get("path"), r["decision"].get("reason"),
            r["decision"].get("case"), r["dispatch"]["median"]))
    doc = {"command": " ".join(["railwave", "bench"] + sys.argv[4:]), "mode": ctx.bed.mode,
           "nodes": a.nodes, "rails": a.rails, "gpus": a.gpus, "mbit": a.mbit, "pairs": a.pairs,
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": load0,
           "loadavg_end": os.getloadavg(), "anchors": table, "points": results}
    for p in doc["points"]:
        for c in p["results"].values():
            c.pop("tx_bytes", None)
    write_bench(a, doc)
    try:
        os.remove(os.path.join(a.out, a.name + ".partial.json"))
    except OSError:
        pass
    if mpi_failed:
        say("MPI_Alltoallv failed at point(s) %s: see %s.json" % (mpi_failed, a.name))
    return doc


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("demo", "bench") else None
    if mode is None:
        sys.exit("bench_bed.py: first argument must be demo or bench (run it as 'railwave demo')")
    what = {"demo": "Runs the main job on the rail test bed (network namespaces, shaped NICs; "
                    "loopback when there is none): every path and the selector, every result "
                    "verified, one table per path (docs/demo.md).",
            "bench": "Sweeps skew, message size and fan-in on the rail test bed: the four paths, "
                     "the selector and MPI_Alltoallv side by side, with a plot (docs/demo.md)."}[mode]
    ap = argparse.ArgumentParser(prog="railwave " + mode, description=what,
                                 epilog="Defaults in [brackets]; 'demo|bench:' marks an option "
                                        "that only one of the two uses.")
    ap.add_argument("--build", required=True, help=argparse.SUPPRESS)
    ap.add_argument("--nodes", type=int, default=4, metavar="N", help="nodes (daemons) [4]")
    ap.add_argument("--rails", type=int, default=4, metavar="R", help="rails (NICs) per node [4]")
    ap.add_argument("--gpus", type=int, default=None, metavar="G",
                    help="ranks per node [demo 2, bench = rails]")
    ap.add_argument("--mbit", type=int, default=50, help="shaped rate of every NIC, Mbit/s [50]")
    ap.add_argument("--pairs", type=int, default=None,
                    help="dispatch+combine pairs per run, after one warm-up "
                         "[demo 5 (3 with --short), bench 7 (3)]")
    ap.add_argument("--experts", type=int, default=128, metavar="E", help="routed experts [128]")
    ap.add_argument("--topk", type=int, default=8, metavar="K", help="experts per token [8]")
    ap.add_argument("--hidden", type=int, default=4096, metavar="H",
                    help="hidden size of a bf16 row [4096; demo --short at most 1024]")
    ap.add_argument("--tokens", type=int, default=None, metavar="T",
                    help="tokens per rank [demo 550 (40 with --short), bench 400]")
    ap.add_argument("--zipf", type=float, default=0.8, metavar="S",
                    help="global expert popularity skew, Zipf exponent [0.8]")
    ap.add_argument("--dirichlet", type=float, default=20.0, metavar="A",
                    help="per-source heterogeneity, Dirichlet concentration [20]")
    ap.add_argument("--rail-skew", type=float, default=0.67, metavar="P",
                    help="direct source-rail skew in [0,1] (tools/synth.h) [0.67]")
    ap.add_argument("--seed", type=int, default=1, help="routing seed [1]")
    ap.add_argument("--layer", type=int, default=0, help="synthetic layer drawn [0]")
    ap.add_argument("--mpi", action="store_true", help="demo: also run MPI_Alltoallv")
    ap.add_argument("--no-mpi", action="store_true", help="bench: skip MPI_Alltoallv")
    ap.add_argument("--short", action="store_true", help="bench: two points; demo: small and quick")
    ap.add_argument("--loopback", action="store_true", help="do not use network namespaces")
    ap.add_argument("--prefix", default=os.environ.get("RW_TESTBED_PREFIX", "rwdemo"),
                    help="test-bed name prefix [$RW_TESTBED_PREFIX or rwdemo]")
    ap.add_argument("--out", default="bench-out", metavar="DIR", help="bench: output directory [bench-out]")
    ap.add_argument("--name", default="testbed-bench", help="bench: output file name stem [testbed-bench]")
    ap.add_argument("--json", default=None, metavar="FILE", help="demo: also write the results as JSON here")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="demo: forced paths to run, comma-separated (debugging) [all four]")
    ap.add_argument("--phase-timeout-ms", type=int, default=120000, metavar="MS",
                    help="the daemons' phase_timeout_ms [120000]")
    ap.add_argument("--require-testbed", action="store_true", help="fail instead of falling back to loopback")
    ap.add_argument("--workdir", default=None, metavar="DIR",
                    help="directory for cluster files and logs [a new one in /tmp]")
    ap.add_argument("--keep", action="store_true", help="keep logs and cluster files")
    ap.add_argument("--verbose", action="store_true", help="bench: a progress line per pair")
    a = ap.parse_args(sys.argv[2:])
    a.mode = mode
    if a.gpus is None:
        a.gpus = 2 if a.mode == "demo" else a.rails
    if a.pairs is None:
        a.pairs = (3 if a.short else 5) if a.mode == "demo" else (3 if a.short else 7)
    if a.tokens is None:
        if a.short and a.mode == "demo":
            a.tokens = 40
        else:
            a.tokens = 550 if a.mode == "demo" else 400
    if a.short and a.mode == "demo":
        a.hidden = min(a.hidden, 1024)
    src = os.environ.get("RAILWAVE_SRC") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = Procs()
    bed = Bed(a, procs, src)
    ctx = Ctx(a, procs, bed, src)

    def on_term(signum, frame):
        raise KeyboardInterrupt("signal %d" % signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    rc = 1
    if a.workdir:
        os.makedirs(a.workdir, exist_ok=True)
        tmp = a.workdir
    else:
        tmp = tempfile.mkdtemp(prefix="railwave-%s." % a.mode)
    try:
        mode = bed.up()
        if a.require_testbed and mode != "testbed":
            raise RuntimeError("no test bed: " + bed.why)
        say("railwave %s: %s%s" % (a.mode, "rail test bed (network namespaces, prefix %s)" % a.prefix
                                   if mode == "testbed" else "loopback", "" if mode == "testbed"
                                   else " - " + bed.why))
        if a.mode == "demo":
            doc = demo(ctx, tmp)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(doc, f, indent=1)
        else:
            bench(ctx, tmp)
        rc = 0
    except KeyboardInterrupt:
        say("\ninterrupted: stopping everything")
        rc = 130
    except Exception as e:  # report, then tear everything down below
        if not isinstance(e, RuntimeError):
            import traceback
            traceback.print_exc()
        say("railwave %s: FAILED: %s" % (a.mode, e))
        say("  (logs kept in %s)" % tmp)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        procs.kill_all()
        if bed.is_up and not bed.down():
            say("railwave %s: WARNING: test bed %s not fully removed" % (a.mode, a.prefix))
            rc = rc or 1
        elif mode_was_testbed(bed):
            say("teardown: daemons and ranks stopped, test bed %s removed" % a.prefix)
        if rc == 0 and not a.keep and not a.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
    return rc


def mode_was_testbed(bed):
    return bed.mode == "testbed"


if __name__ == "__main__":
    sys.exit(main())
