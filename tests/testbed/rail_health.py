#!/usr/bin/env python3
"""Rail health on the rail test bed (docs/perf/rail-health.md). Root only; it owns the
test bed while it runs (prefix rwrh) and tears it down at the end, whatever happens.

  rail_health.py BUILD [--nodes 4] [--rails 4] [--mbit 50] [--tokens 200] [--pairs 5]

Two experiments, each measured in the same run, Joint path, `railwave bench` workload
(tools/bench_bed.py does the process glue; rw_bench_rank times and verifies every pair):
  A. `ip link set rail1 down` on node 1 during a run of many pairs: the rail is found dead (its
     writes stall), the phases that used it fail and are redone (tests/integration/rw_rank
     --retry), then Joint is measured on the surviving rails against their lower bound; then
     `ip link set rail1 up`, the rail rejoins, and Joint is measured again on every rail.
  B. Node 1's rail-1 NIC shaped to half rate (both directions): Joint with the daemons told
     (rate_gbps of that NIC, the weighted quotas), not told (equal weights), and learning it
     (`rail_weights: measured`), against the weighted lower bound.
Lower bounds: every pair's records split over its eligible rails in proportion to their weights
(min of the two ends' rates; 0 for a rail down at either end), each NIC's load over its own
rate, the busiest NIC (docs/algorithms.md §2.5)."""
import argparse
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))


def load_bench_bed(src):
    path = os.path.join(src, "tools", "bench_bed.py")
    mod = types.ModuleType("bench_bed")
    mod.__file__ = path
    importlib.machinery.SourceFileLoader("bench_bed", path).exec_module(mod)
    return mod


def lower_bound(desc, rate, up, equal=False):
    """Busiest NIC time (s) for dispatch records: rate[n][r] in bit/s, up(s, d, r) -> bool; each
    pair's records split over its rails in proportion to min(rate[s][r], rate[d][r]) (0 when
    not up), or equally (`equal`: what daemons plan that do not know the rates)."""
    wl = desc["workload"]
    n_nodes, rails = wl["nodes"], wl["rails"]
    counts, rec = desc["counts"], desc["record_bytes"]
    egress = [[0.0] * rails for _ in range(n_nodes)]
    ingress = [[0.0] * rails for _ in range(n_nodes)]
    for s in range(n_nodes):
        for d in range(n_nodes):
            if s == d:
                continue
            c = counts[(s * n_nodes + d) * rails:(s * n_nodes + d + 1) * rails]
            w = [(1.0 if equal else min(rate[s][r], rate[d][r])) if up(s, d, r) else 0.0
                 for r in range(rails)]
            t, ws = sum(c), sum(w)
            for r in range(rails):
                share = t * w[r] / ws
                egress[s][r] += share
                ingress[d][r] += share
    return max(max(egress[n][r], ingress[n][r]) * rec * 8 / rate[n][r]
               for n in range(n_nodes) for r in range(rails))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rails", type=int, default=4)
    ap.add_argument("--mbit", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--node", type=int, default=1, help="the node whose NIC fails / is slow")
    ap.add_argument("--rail", type=int, default=1, help="that NIC's rail")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    src = os.path.dirname(os.path.dirname(HERE)) if os.path.isdir(os.path.join(HERE, "..", "..", "tools")) \
        else os.path.dirname(os.path.abspath(a.build))
    bb = load_bench_bed(src)
    args = argparse.Namespace(
        build=os.path.abspath(a.build), nodes=a.nodes, rails=a.rails, gpus=a.rails, mbit=a.mbit,
        experts=128, topk=8, hidden=4096, tokens=a.tokens, zipf=0.8, dirichlet=20.0,
        rail_skew=0.67, seed=1, layer=0, prefix="rwrh", loopback=False, phase_timeout_ms=120000)
    wl = {k: getattr(args, k) for k in ("experts", "topk", "hidden", "tokens", "zipf", "dirichlet",
                                         "rail_skew", "seed", "layer")}
    procs = bb.Procs()
    bed = bb.Bed(args, procs, src)
    ctx = bb.Ctx(args, procs, bed, src)
    res = {"command": " ".join(sys.argv), "nodes": a.nodes, "rails": a.rails, "mbit": a.mbit,
           "tokens": a.tokens, "pairs": a.pairs, "node": a.node, "rail": a.rail}
    tmp_root = tempfile.mkdtemp(prefix="rwrh.", dir="/tmp")
    nic = "rail%d" % a.rail
    ns = "rwrh-n%d" % a.node
    try:
        if bed.up() != "testbed":
            sys.exit("rail_health: no test bed (%s)" % bed.why)
        desc = bb.describe(ctx, wl)
        full = [[a.mbit * 1e6] * a.rails for _ in range(a.nodes)]
        res["lb_all_rails_s"] = lower_bound(desc, full, lambda s, d, r: True)
        res["lb_tool_s"] = desc["lower_bound_s"]["dispatch"]
        down = lambda s, d, r: not (r == a.rail and a.node in (s, d))
        res["lb_rail_down_s"] = lower_bound(desc, full, down)

        def daemons(tag, rate_gbps=None, measured=False):
            tmp = tempfile.mkdtemp(prefix=tag + ".", dir=tmp_root)
            d = bb.Daemons(ctx, tmp, "joint", desc["recv_region_mib"],
                           desc["workload"]["expert_slots"])
            d.cfg["heartbeat_interval_ms"] = 500
            d.cfg["heartbeat_timeout_ms"] = 4000  # a stalled rail is down after 8 s
            if rate_gbps is not None:
                d.cfg["nodes"][a.node]["rails"][a.rail]["rate_gbps"] = rate_gbps
            if measured:
                d.cfg["rail_weights"] = "measured"
            with open(d.cfg_path, "w") as f:
                json.dump(d.cfg, f, indent=1)
            d.start()
            return d

        def measure(d, label):
            disp, comb = bb.run_ranks(ctx, d, wl, "rh." + label, a.pairs, label)
            return {"dispatch": bb.summary(disp), "combine": bb.summary(comb)}

        def links(d):
            out = {}
            for n in range(a.nodes):
                for line in d.stats(n, "stats rails").splitlines():
                    if line.startswith("link="):
                        kv = dict(w.split("=", 1) for w in line.split())
                        peer, rail = kv["link"].rsplit("/", 1)
                        out[(n, peer, int(rail))] = kv
            return out

        def retry_run(d, label):
            """tests/integration/rw_rank on every rank with --retry: phases that fail while the
            rail is found dead are redone."""
            votes = tempfile.mkdtemp(prefix="votes.", dir=d.tmp)
            rank = os.path.join(args.build, "tests", "integration", "rw_rank")
            W = a.nodes * a.rails
            ps = []
            for q in range(W):
                node = q // a.rails
                argv = bed.wrap(node, [rank, d.cfg["nodes"][node]["ipc_socket"], "rh.r." + label,
                                       str(q), str(a.nodes), str(a.rails), str(4 * W), "4", "3",
                                       "7", "ok", "--hidden", "1024", "--retry", "20", votes])
                ps.append(procs.spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            outs = []
            for p in ps:
                o, _ = p.communicate(timeout=600)
                procs.forget(p)
                outs.append((p.returncode, o.decode()))
            bad = [o for rc, o in outs if rc != 0]
            if bad:
                raise RuntimeError("rw_rank failed: " + bad[0][-600:])
            return [l for rc, o in outs for l in o.splitlines() if l.startswith("retry ")][:3], \
                [o.strip().splitlines()[-1] for rc, o in outs][:1]

        # ---- A: a NIC goes down during a run, then comes back ----
        d = daemons("a")
        try:
            res["a_before"] = measure(d, "before")
            bb.say("ip netns exec %s ip link set %s down" % (ns, nic))
            t0 = time.time()
            subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", nic, "down"], check=True)
            retried, last = retry_run(d, "down")
            res["a_detect_run_s"] = time.time() - t0
            res["a_retried_after"] = retried
            res["a_retry_run_last"] = last
            lk = links(d)
            res["a_links_down"] = sorted("n%d->%s rail %d" % k for k, v in lk.items() if v["state"] == "down")
            res["a_down"] = measure(d, "down")
            res["a_excluded"] = [int(l.split()[1]) for n in range(a.nodes)
                                 for l in d.stats(n, "stats").splitlines()
                                 if l.startswith("phases_rail_excluded ")]
            subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", nic, "up"], check=True)
            t1 = time.time()
            while any(v["state"] != "up" for v in links(d).values()):
                if time.time() - t1 > 60:
                    raise RuntimeError("the rail did not come back")
                time.sleep(0.1)
            res["a_rejoin_s"] = time.time() - t1
            res["a_after"] = measure(d, "after")
            res["a_peers"] = [l for n in range(a.nodes) for l in d.stats(n, "stats peers").splitlines()
                              if "reconnects=" in l and "reconnects=0" not in l]
        finally:
            bad = d.stop()
            if bad:
                raise RuntimeError("daemons did not stop cleanly: %s" % bad)

        # ---- B: one NIC at half rate ----
        half = a.mbit / 2
        burst = max(16000, int(half * 1e6 / 8 / 250))
        for argv in (["ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", nic],
                     ["tc", "qdisc", "change", "dev", "rwrh-%dr%d" % (a.node, a.rail)]):
            subprocess.run(argv + ["root", "handle", "10:", "tbf", "rate", "%dkbit" % int(half * 1000),
                                   "burst", str(burst), "latency", "200ms"], check=True)
        slow = [row[:] for row in full]
        slow[a.node][a.rail] = half * 1e6
        res["lb_half_weighted_s"] = lower_bound(desc, slow, lambda s, d, r: True)
        eq = lambda s, d, r: True
        res["lb_half_unweighted_plan_s"] = lower_bound(desc, slow, lambda s, d, r: True, equal=True)
        for tag, rate, meas in (("b_unweighted", None, False), ("b_weighted", half / 1000.0, False),
                                ("b_measured", None, True)):
            d = daemons(tag, rate, meas)
            try:
                res[tag] = measure(d, tag)
                res[tag]["weights"] = [[int(kv["weight"]) for kv in
                                        (dict(w.split("=", 1) for w in l.split() if "=" in w)
                                         for l in d.stats(n, "stats rails").splitlines()
                                         if l.startswith("rail="))] for n in range(a.nodes)]
            finally:
                bad = d.stop()
                if bad:
                    raise RuntimeError("daemons did not stop cleanly: %s" % bad)
        del eq
    finally:
        procs.kill_all()
        bed.down()
    report(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def report(res):
    def row(label, m, lb):
        d, c = m["dispatch"], m["combine"]
        return "%-34s dispatch %6.3f s [%5.3f-%5.3f]  %5.2fx   combine %6.3f s  %5.2fx   (LB %.3f s)" % (
            label, d["median"], d["p10"], d["p90"], d["median"] / lb, c["median"], c["median"] / lb, lb)
    print("rail health on the test bed: %d nodes x %d rails at %d Mbit/s, %d tokens/rank, "
          "%d measured pairs each; Joint" % (res["nodes"], res["rails"], res["mbit"], res["tokens"],
                                            res["pairs"]))
    print("lower bounds (dispatch records): all rails %.3f s (railwave bench-workload: %.3f s), "
          "rail %d of node %d down %.3f s, that NIC at half rate: weighted %.3f s, equal split %.3f s"
          % (res["lb_all_rails_s"], res["lb_tool_s"], res["rail"], res["node"], res["lb_rail_down_s"],
             res["lb_half_weighted_s"], res["lb_half_unweighted_plan_s"]))
    print("A. ip link set rail%d down on node %d during a run, then up" % (res["rail"], res["node"]))
    print("   " + row("all rails, before", res["a_before"], res["lb_all_rails_s"]))
    print("   run with the link down (rw_rank --retry): %.1f s; retried after: %s" % (
        res["a_detect_run_s"], res["a_retried_after"][:2]))
    print("   links seen down: %s" % res["a_links_down"])
    print("   " + row("rail down (vs surviving-rails LB)", res["a_down"], res["lb_rail_down_s"]))
    print("   phases planned without the rail, per node: %s" % res["a_excluded"])
    print("   ip link set up -> every link up again in %.1f s" % res["a_rejoin_s"])
    print("   " + row("all rails, after it rejoined", res["a_after"], res["lb_all_rails_s"]))
    print("   peers that went down: %s" % (res["a_peers"] or "none"))
    print("B. rail%d of node %d at half rate" % (res["rail"], res["node"]))
    print("   " + row("unweighted (vs weighted LB)", res["b_unweighted"], res["lb_half_weighted_s"]))
    print("   " + row("weighted (vs weighted LB)", res["b_weighted"], res["lb_half_weighted_s"]))
    print("   " + row("measured weights (vs weighted LB)", res["b_measured"], res["lb_half_weighted_s"]))
    print("   weighted / unweighted (dispatch medians): %.3f, measured / unweighted: %.3f" % (
        res["b_weighted"]["dispatch"]["median"] / res["b_unweighted"]["dispatch"]["median"],
        res["b_measured"]["dispatch"]["median"] / res["b_unweighted"]["dispatch"]["median"]))
    print("   weights in the count rows (Mbit/s, per node: rails 0..R-1): configured %s, measured %s" % (
        res["b_weighted"]["weights"], res["b_measured"]["weights"]))


if __name__ == "__main__":
    main()
