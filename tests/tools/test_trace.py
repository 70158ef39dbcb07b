#!/usr/bin/env python3
"""Phase traces end to end (docs/service.md "Phase traces", docs/tools.md): real railwaved
processes with `trace_dir` set, real rank processes (tests/integration/rw_rank.c, through the
Cluster of tests/lib/cluster.py), then `railwave trace export`, `trace late`,
`analyze` and `top --once` on what they wrote. Exact checks:

* every phase has one record per node, status ok, the same count matrix on every node, and that
  matrix equals the one computed here from the ranks' own workload generator (rw_rank's gen(),
  re-implemented below); the expert loads equal the ranks' (token, expert) hits;
* the bytes a node received from each source equal that source's records for it times the
  record size; the bytes of each wave equal the records for its destination; per rail, the tx
  and rx bytes summed over a daemon's records equal its `stats rails` counters;
* the export has one phase slice per record, tracks per node x rail, slices that never overlap
  without nesting, and the same rx bytes as the records; `trace late` names the rank started
  1 s after the others; `analyze` reads them and draws its plots; `top` runs in a real terminal
  (tmux) and redraws in place;
* rotation: with trace_max_kib 16 both files stay within 8 KiB each, hold whole records, and the
  newest is the last phase; an unwritable trace_dir costs no phase, is logged once and every
  record is counted as dropped; a trace_dir that is a file is refused at start.

Exit 0 pass, 1 fail, 77 skip."""
import json
import os
import re
import resource
import signal
import shutil
import subprocess
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # build/ or build-asan/
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)
TOOL = os.path.join(B, "tools", "railwave")
GPUS, RAILS, TOPK, MAXT = cluster.GPUS, cluster.RAILS, 4, 48
M64 = (1 << 64) - 1


class Fail(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Fail(what)


# ---- rw_rank's workload (tests/integration/rw_rank.c gen()), ids only ---------------------------

def mix(z):
    z = (z + 0x9e3779b97f4a7c15) & M64
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
    return z ^ (z >> 31)


def gen_ids(seed, step, layer, rank, experts, hidden=24):
    s = [mix(seed ^ (step << 40) ^ (layer << 20) ^ rank)]

    def nxt():
        s[0] = mix(s[0])
        return s[0] >> 32
    base = 1 + nxt() % MAXT
    n = base * 3 if rank % GPUS == 0 else base
    hot = experts // 4 or 1
    shift = (rank * 7 + layer) % experts
    out = []
    for _ in range(n):
        ids = []
        for _k in range(TOPK):
            while True:
                u = nxt()
                if u % 8 == 0:
                    e = -1
                    break
                e = (shift + nxt() % hot) % experts if u % 2 else nxt() % experts
                if e not in ids:
                    break
            ids.append(e)
            nxt()  # the weight
        for _h in range(hidden):
            nxt()  # the row
        out.append(ids)
    return out


def oracle(nodes, experts, seed, layer, step):
    """The count matrix [s][d][r] (records by native rail; d == s: those that stay on the node)
    and the expert loads."""
    per_node = experts // nodes
    counts = [0] * (nodes * nodes * RAILS)
    load = [0] * experts
    for rank in range(nodes * GPUS):
        s, g = divmod(rank, GPUS)
        for ids in gen_ids(seed, step, layer, rank, experts):
            for d in {e // per_node for e in ids if e >= 0}:  # the diagonal holds local records
                counts[(s * nodes + d) * RAILS + g % RAILS] += 1
            for e in ids:
                if e >= 0:
                    load[e] += 1
    return counts, load


# ---- helpers ----------------------------------------------------------------------------------

def records(tdir):
    out = {}
    for f in sorted(os.listdir(tdir)):
        with open(os.path.join(tdir, f)) as fh:
            for line in fh:
                r = json.loads(line)
                out.setdefault(r["node"], []).append(r)
    return out


def rail_counters(c, n):
    out = {}
    for line in c.stats(n, "stats rails").splitlines():
        kv = dict(t.split("=", 1) for t in line.split() if "=" in t)
        if "rail" in kv:
            out[int(kv["rail"])] = (int(kv["tx_bytes"]), int(kv["rx_bytes"]))
    return out


def tool(*args, want=0):
    p = subprocess.run([TOOL] + list(args), capture_output=True, text=True, timeout=120)
    if p.returncode != want:
        raise Fail("railwave %s: exit %d (want %d): %s" % (" ".join(args), p.returncode, want,
                                                           (p.stdout + p.stderr)[-800:]))
    return p.stdout


def flows(counts, nodes, s, d):
    return sum(counts[(s * nodes + d) * RAILS + r] for r in range(RAILS))


# ---- scenarios ----------------------------------------------------------------------------------

def check_records(recs, nodes, experts, seed, layers, steps, rails_seen, path):
    for n in range(nodes):
        check(len(recs.get(n, [])) == layers * steps * 2,
              "node %d: %d records, want %d" % (n, len(recs.get(n, [])), layers * steps * 2))
    by_key = {}
    for n, rs in recs.items():
        tx = [0] * RAILS
        rx = [0] * RAILS
        for r in rs:
            check(r["status"] == "ok", "node %d: record %s" % (n, r))
            check(r["path"] == path, "node %d: path %s, want %s" % (n, r["path"], path))
            check(r["N"] == nodes and r["R"] == RAILS and r["G"] == GPUS, "geometry %s" % r)
            check(n * GPUS <= r["last_rank"] < (n + 1) * GPUS, "last_rank %d on node %d" % (r["last_rank"], n))
            check(r["last_peer"] is None or (r["last_peer"] != n and 0 <= r["last_peer"] < nodes),
                  "last_peer %s on node %d" % (r["last_peer"], n))
            by_key.setdefault((r["layer"], r["step"], r["kind"]), {})[n] = r
            for rail, b, *_ in r["tx"]:
                tx[rail] += b
            for _src, rail, b, *_ in r["rx"]:
                rx[rail] += b
        for rail in range(RAILS):
            check((tx[rail], rx[rail]) == rails_seen[n][rail],
                  "node %d rail %d: records say tx/rx %s, stats rails say %s" % (
                      n, rail, (tx[rail], rx[rail]), rails_seen[n][rail]))
    for layer in range(layers):
        for step in range(steps):
            want, load = oracle(nodes, experts, seed, layer, step)
            for kind in ("dispatch", "combine"):
                rs = by_key.get((layer, step, kind), {})
                check(len(rs) == nodes, "L%d s%d %s: %d nodes recorded it" % (layer, step, kind, len(rs)))
                for n, r in rs.items():
                    check(r["counts"] == want, "L%d s%d %s node %d: counts %s, the ranks submitted %s" % (
                        layer, step, kind, n, r["counts"], want))
                    size = r["rec_size"]
                    got = {}
                    for src, _rail, b, _f, done in r["rx"]:
                        check(done is not None, "node %d: range from %d incomplete: %s" % (n, src, r))
                        got[src] = got.get(src, 0) + b
                    for s in range(nodes):
                        if s == n:
                            continue
                        recs_in = flows(want, nodes, s, n) if kind == "dispatch" else flows(want, nodes, n, s)
                        check(got.get(s, 0) == recs_in * size,
                              "L%d s%d %s node %d: %d bytes from node %d, the counts say %d x %d" % (
                                  layer, step, kind, n, got.get(s, 0), s, recs_in, size))
                    for w, dst, b, _wr, post, done, _wait in r["waves"]:
                        if dst < 0:
                            out = sum(flows(want, nodes, n, d) if kind == "dispatch" else flows(want, nodes, d, n)
                                      for d in range(nodes) if d != n)
                        else:
                            check(dst == (n + w) % nodes, "wave %d of node %d goes to %d" % (w, n, dst))
                            out = flows(want, nodes, n, dst) if kind == "dispatch" else flows(want, nodes, dst, n)
                        check(b == out * size, "L%d s%d %s node %d wave %d: %d bytes, counts say %d" % (
                            layer, step, kind, n, w, b, out * size))
                        check(post is not None and done is not None and post <= done, "wave times %s" % r["waves"])
                    if kind == "dispatch":
                        lo = r["expert_first"]
                        check(r["expert_load"] == load[lo:lo + len(r["expert_load"])],
                              "L%d s%d node %d: expert loads %s, the ranks routed %s" % (
                                  layer, step, n, r["expert_load"], load[lo:lo + len(r["expert_load"])]))
                        check(len(r["expert_load"]) == experts // nodes, "expert_load length")
                # grants: every one this node sent answers a wave that had data for it
                for n, r in rs.items():
                    for w, src, _at in r.get("grants", []):
                        sw = [x for x in rs[src]["waves"] if x[0] == w]
                        check(sw and sw[0][1] == n and sw[0][2] > 0,
                              "node %d granted wave %d to node %d, which sent no such wave" % (n, w, src))


def check_export(tdir, recs, tmp):
    out = os.path.join(tmp, "chrome.json")
    tool("trace", "export", tdir, "-o", out)
    with open(out) as f:
        doc = json.load(f)
    ev = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    nrec = sum(len(v) for v in recs.values())
    phase_slices = [e for e in ev if e["ph"] == "X" and names[(e["pid"], e["tid"])] == "phases"
                    and e["name"].startswith("L")]
    check(len(phase_slices) == nrec, "export: %d phase slices for %d records" % (len(phase_slices), nrec))
    for n in recs:
        for rail in range(RAILS):
            for d in ("tx", "rx"):
                check(any(p == n + 1 and v.startswith("rail %d %s" % (rail, d)) for (p, _t), v in names.items()),
                      "export: no 'rail %d %s' track for node %d" % (rail, d, n))
    # slices of one track nest or are disjoint
    by_track = {}
    for e in ev:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for k, sl in by_track.items():
        stack = []
        for a, b in sorted(sl, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= a + 1e-3:
                stack.pop()
            check(not stack or b <= stack[-1] + 1e-3, "export: overlapping slices on track %s (%s)" % (names[k], k))
            stack.append(b)
    rx_export = sum(e["args"]["bytes"] for e in ev if e["ph"] == "X" and " rx from " in e["name"])
    rx_recs = sum(x[2] for rs in recs.values() for r in rs for x in r["rx"])
    check(rx_export == rx_recs, "export: rx bytes %d, records %d" % (rx_export, rx_recs))


def scenario_record(tmp, seed):
    """Joint (waves, grants) at N = 3 and Rail-only at N = 3: exact records, export, analyze."""
    for i, path in enumerate(("joint", "rail-only")):
        nodes, layers, steps = 3, 2, 2
        tdir = os.path.join(tmp, "traces-" + path)
        os.mkdir(tdir)
        c = cluster.Cluster(tmp, nodes, path=path, extra={"trace_dir": tdir})
        try:
            c.start_all()
            c.run_ranks("g." + path, layers=layers, steps=steps, seed=seed + i)
            rails_seen = {n: rail_counters(c, n) for n in range(nodes)}
        finally:
            c.stop()
        recs = records(tdir)
        check_records(recs, nodes, c.experts, seed + i, layers, steps, rails_seen, path)
        check_export(tdir, recs, tmp)
        an = json.loads(tool("analyze", tdir, "--json", "--plots", os.path.join(tmp, "plots-" + path)))
        check(an["phases"] == layers * steps, "analyze: %d phases, want %d" % (an["phases"], layers * steps))
        check(an["fits"]["source"]["n"] == layers * steps, "analyze: fit over %d points" % an["fits"]["source"]["n"])
        check(list(an["paths"]) == [path], "analyze: paths %s" % list(an["paths"]))
        rp = an["replay"]
        check(rp["phases"] == layers * steps, "analyze: %d phases replayed" % rp["phases"])
        check(sum(rp["paths"][q]["best_dispatch"] for q in rp["paths"]) == layers * steps,
              "analyze: best-path tally %s" % rp["paths"])
        for row in an["rows"]:
            for kind in ("dispatch", "combine"):
                for q, v in row["sim"][kind]["paths"].items():
                    check(v["ratio"] >= 1 - 1e-9, "sim-replay: %s %s below the lower bound: %s" % (q, kind, v))
            check(row["dispatch_over_lb"] == row["dispatch_ms"] / row["sim_lb_ms_dispatch"], "analyze ratio")

            want, load = oracle(nodes, c.experts, seed + i, row["layer"], row["step"])
            check(abs(row["expert_imb"] - max(load) / (sum(load) / len(load))) < 1e-9,
                  "analyze: expert imbalance %s" % row["expert_imb"])
        for png in ("imbalance.png", "features.png"):
            p = os.path.join(tmp, "plots-" + path, png)
            check(os.path.exists(p) and open(p, "rb").read(4) == b"\x89PNG", "analyze: no plot %s" % p)
        print("ok   records, export, analyze: %s N=%d R=%d G=%d, %d records" % (
            path, nodes, RAILS, GPUS, sum(len(v) for v in recs.values())))


def scenario_late(tmp, seed):
    """Rank 3 (node 1) starts 1 s after the others: `trace late` names it for the first phase;
    `top --once` shows the daemons while they are up."""
    nodes = 3
    tdir = os.path.join(tmp, "traces-late")
    os.mkdir(tdir)
    c = cluster.Cluster(tmp, nodes, path="auto", extra={"trace_dir": tdir})
    try:
        c.start_all()
        procs = [(r, c.rank(r, "g.late", 1, 2, seed)) for r in range(nodes * GPUS) if r != 3]
        time.sleep(1.0)
        procs.append((3, c.rank(3, "g.late", 1, 2, seed)))
        c.collect(procs)
        top = tool("top", "--once", "--interval", "0.2", "--socket", c.cfg["nodes"][0]["stats_socket"],
                   "--socket", c.cfg["nodes"][1]["stats_socket"])
        check(top.count("state running") == 2, "top: %s" % top)
        check("peer 1" in top and "peer 2" in top, "top shows no peers: %s" % top)
        rail_rows = [l for l in top.splitlines() if re.match(r"^\s+\d+\s+[\d.]+\s+[\d.]+\s+[#.]+", l)]
        check(len(rail_rows) == 2 * RAILS, "top: %d rail rows, want %d: %s" % (len(rail_rows), 2 * RAILS, top))
        ok_lines = [l for l in top.splitlines() if " dispatch " in l]
        check(ok_lines and all(l.split()[3] == "2" for l in ok_lines[:1]), "top phases: %s" % ok_lines)
        tool("top", "--once", "--socket", os.path.join(tmp, "nobody.stats"), want=1)
        top_in_tmux(tmp, c)
    finally:
        c.stop()
    rows = json.loads(tool("trace", "late", tdir, "--json"))
    first = [w for w in rows if w["layer"] == 0 and w["step"] == 0 and w["kind"] == "dispatch"]
    check(len(first) == 1, "trace late: %s" % rows)
    w = first[0]
    check(w["last_rank"] == 3 and w["last_node"] == 1 and w["nodes"] == nodes,
          "trace late: first dispatch blames %s" % w)
    check(w["late_by_ms"] > 200, "trace late: rank 3 late by only %.1f ms after a 1 s delay" % w["late_by_ms"])
    text = tool("trace", "late", tdir)
    check("n1 rank 3" in text.splitlines()[1], "trace late table: %s" % text)
    print("ok   trace late names rank 3 (%.0f ms); top --once" % w["late_by_ms"])


def scenario_fail(tmp, seed):
    """Rank 3 (node 1) joins but never submits: every node records the failed dispatch with its
    status, the message its ranks got and the rank that never submitted; the next step is
    recorded ok."""
    nodes = 2
    tdir = os.path.join(tmp, "traces-fail")
    os.mkdir(tdir)
    c = cluster.Cluster(tmp, nodes, path="joint", extra={"trace_dir": tdir, "phase_timeout_ms": 1500})
    try:
        c.start_all()
        idle = c.rank(3, "g.fail", 1, 1, seed, mode="idle")
        check(idle.stdout.readline().strip() == b"ready", "idle rank not ready")
        c.collect([(r, c.rank(r, "g.fail", 1, 1, seed, mode="fail")) for r in range(3)])
        idle.kill()
        idle.wait()
        idle.stdout.close()
        c.run_ranks("g.fail", layers=1, steps=1, seed=seed, flags=["--first-step", "1"])
    finally:
        c.stop()
    recs = records(tdir)
    for n in range(nodes):
        rs = [r for r in recs.get(n, []) if r["kind"] == "dispatch"]
        check(len(rs) == 2, "node %d: %d dispatch records, want the failed one and the next" % (n, len(rs)))
        bad, good = rs
        check(bad["status"] == "timeout" and "timed out after 1500 ms" in bad.get("error", ""),
              "node %d: failed record %s" % (n, bad))
        check((bad["layer"], bad["step"], good["layer"], good["step"]) == (0, 0, 0, 1), "keys %s %s" % (bad, good))
        check(good["status"] == "ok" and "error" not in good, "node %d: next record %s" % (n, good))
    # node 1 waited for its own rank 3; node 0 for node 1's count row (or heard node 1's reason)
    check("local ranks 3" in recs[1][0]["error"] or "count rows of node 1" in recs[1][0]["error"],
          "node 1's error: %s" % recs[1][0]["error"])
    check(recs[1][0]["counts"] is None and recs[1][0]["path"] is None, "a phase that never decided: %s" % recs[1][0])
    check(recs[1][0]["missing"] == [3] and recs[0][0]["missing"] == [], "missing ranks: %s, %s" % (
        recs[0][0]["missing"], recs[1][0]["missing"]))
    rows = json.loads(tool("trace", "late", tdir, "--json"))
    first = [w for w in rows if w["kind"] == "dispatch" and w["step"] == 0]
    check(len(first) == 1 and first[0]["last_rank"] == 3 and first[0]["late_by_ms"] is None and
          first[0]["never"] == [3] and first[0]["status"] == "timeout",
          "trace late on the failed attempt: %s" % first)
    check("n1 rank 3" in tool("trace", "late", tdir) and "never" in tool("trace", "late", tdir), "late table")
    print("ok   failed phase recorded (timeout, its message, the missing rank) on every node; trace late names it")


def top_in_tmux(tmp, c):
    """`railwave top` in a real terminal (tmux, 100 x 40): it redraws in place — one frame on
    the screen, its clock moving — and Ctrl-C ends it with status 0."""
    if not shutil.which("tmux"):
        print("note: tmux not installed; top's live mode not tried in a terminal")
        return
    sess = "rwtop%d" % os.getpid()
    done = os.path.join(tmp, "top.rc")
    cmd = "%s top --interval 0.2 --socket %s; echo $? > %s; sleep 30" % (
        TOOL, c.cfg["nodes"][0]["stats_socket"], done)
    env = dict(os.environ, TMUX="")
    subprocess.run(["tmux", "-L", sess, "new-session", "-d", "-s", sess, "-x", "100", "-y", "40", cmd],
                   check=True, env=env, timeout=30)
    try:
        def screen():
            return subprocess.run(["tmux", "-L", sess, "capture-pane", "-p", "-t", sess], capture_output=True,
                                  text=True, timeout=10, env=env).stdout
        shots = []
        for _ in range(100):
            time.sleep(0.1)
            sc = screen()
            if "railwave top" in sc and "peer 1" in sc:
                shots.append(sc)
                if len(shots) >= 2 and shots[-1].splitlines()[0] != shots[0].splitlines()[0]:
                    break
        check(len(shots) >= 2, "top in tmux: no frame on the screen: %s" % screen())
        last = shots[-1]
        check(last.count("railwave top") == 1 and last.count("state running") == 1,
              "top in tmux: not one frame in place:\n%s" % last)
        check(shots[-1].splitlines()[0] != shots[0].splitlines()[0], "top in tmux: the clock did not move")
        subprocess.run(["tmux", "-L", sess, "send-keys", "-t", sess, "C-c"], check=True, env=env, timeout=10)
        for _ in range(50):
            if os.path.exists(done):
                break
            time.sleep(0.1)
        check(os.path.exists(done) and open(done).read().strip() == "0", "top in tmux: Ctrl-C did not end it with 0")
    finally:
        subprocess.run(["tmux", "-L", sess, "kill-server"], env=env, timeout=10, capture_output=True)


def scenario_full(tmp, seed):
    """A full disk: every daemon runs in its own mount namespace with a 16 KiB tmpfs on
    trace_dir (needs root; skipped otherwise). Every phase still runs, each daemon warns once,
    and every record is either written or counted as dropped."""
    nodes, layers, steps, batches = 2, 4, 2, 4
    tdir = os.path.join(tmp, "traces-full")
    os.mkdir(tdir)
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            'mount -t tmpfs -o size=16k rwfull "$0"', tdir], capture_output=True)
    if probe.returncode != 0:
        print("note: cannot mount a tmpfs in a mount namespace (not root?); full disk not tried")
        return
    c = cluster.Cluster(tmp, nodes, path="native", extra={"trace_dir": tdir})

    def start(n):
        log = open(os.path.join(tmp, "d%d.log" % n), "a")
        c.procs[n] = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs -o size=16k rwfull "$0" && exec "$@"', tdir,
             cluster.DAEMON, "--config", c.cfg_path, "--node", str(n), "--path", c.path],
            stdout=log, stderr=subprocess.STDOUT, env=c.env)
    c.start = start
    try:
        c.start_all()
        # Batches more than a flush period (1 s) apart: the first fits, the later flushes fail
        # one after the other (the warning must still come once).
        for b in range(batches):
            c.run_ranks("g.full", layers=layers, steps=steps, seed=seed,
                        flags=["--first-step", str(b * steps)])
            time.sleep(1.3)
    finally:
        c.stop()
    total = layers * steps * 2 * batches
    seen = []
    for n in range(nodes):
        with open(os.path.join(tmp, "d%d.log" % n)) as f:
            log = f.read()
        warn = [l for l in log.splitlines() if "trace: cannot write" in l]
        check(len(warn) == 1, "node %d: %d write warnings, want 1" % (n, len(warn)))
        m = re.search(r"trace: (\d+) phase records .* written, (\d+) dropped, (\d+) write failures", log)
        check(m and int(m.group(1)) + int(m.group(2)) == total and int(m.group(1)) > 0 and
              int(m.group(2)) > 0 and int(m.group(3)) >= 2,
              "node %d: want written + dropped = %d, some of each, 2+ failures: %s" % (
                  n, total, m.group(0) if m else [l for l in log.splitlines() if "trace:" in l]))
        seen.append("%s written/%s dropped/%s failures" % m.groups())
    print("ok   full disk (16 KiB tmpfs): phases ran, one warning per daemon; %s" % "; ".join(seen))


def scenario_rotate(tmp, seed):
    """trace_max_kib 16: two files of at most 8 KiB of whole records, the newest last."""
    nodes, layers, steps = 3, 4, 3
    tdir = os.path.join(tmp, "traces-rot")
    os.mkdir(tdir)
    c = cluster.Cluster(tmp, nodes, path="native", extra={"trace_dir": tdir, "trace_max_kib": 16})
    try:
        c.start_all()
        c.run_ranks("g.rot", layers=layers, steps=steps, seed=seed)
    finally:
        c.stop()
    for n in range(nodes):
        cur = os.path.join(tdir, "n%d.trace.jsonl" % n)
        old = os.path.join(tdir, "n%d.trace.1.jsonl" % n)
        check(os.path.exists(cur) and os.path.exists(old), "node %d: not rotated: %s" % (n, os.listdir(tdir)))
        sizes = [os.path.getsize(cur), os.path.getsize(old)]
        check(max(sizes) <= 8192 and sum(sizes) <= 16384, "node %d: sizes %s over the bound" % (n, sizes))
        lines = open(old).read().splitlines() + open(cur).read().splitlines()
        recs = [json.loads(l) for l in lines]  # whole records only
        check(len(recs) < layers * steps * 2, "node %d: %d records kept, nothing rotated away" % (n, len(recs)))
        keys = [(r["step"], r["layer"], r["kind"] == "combine") for r in recs]
        check(keys == sorted(keys), "node %d: records out of order: %s" % (n, keys))
        check(keys[-1] == (steps - 1, layers - 1, True), "node %d: newest record %s" % (n, keys[-1]))
        with open(os.path.join(tmp, "d%d.log" % n)) as f:
            log = f.read()
        check("trace: %d phase records" % (layers * steps * 2) in log and " 0 dropped" in log,
              "node %d: the final trace line: %s" % (n, [l for l in log.splitlines() if "trace:" in l]))
    print("ok   rotation within 16 KiB (%s)" % sorted(os.listdir(tdir)))


def scenario_unwritable(tmp, seed):
    """A trace_dir that cannot be opened: every phase runs, one warning per daemon, every record
    counted as dropped; a trace_dir that is a file is refused at start."""
    nodes, layers, steps = 3, 2, 2
    tdir = os.path.join(tmp, "no-such-dir", "traces")
    c = cluster.Cluster(tmp, nodes, path="perm-only", extra={"trace_dir": tdir})
    for n in range(nodes):
        open(os.path.join(tmp, "d%d.log" % n), "w").close()
    try:
        c.start_all()
        c.run_ranks("g.unw", layers=layers, steps=steps, seed=seed)
    finally:
        c.stop()
    for n in range(nodes):
        with open(os.path.join(tmp, "d%d.log" % n)) as f:
            log = f.read()
        warn = [l for l in log.splitlines() if "trace: cannot open" in l]
        check(len(warn) == 1, "node %d: %d open warnings, want 1" % (n, len(warn)))
        check("trace: 0 phase records" in log and "%d dropped" % (layers * steps * 2) in log,
              "node %d: %s" % (n, [l for l in log.splitlines() if "trace:" in l]))
    afile = os.path.join(tmp, "a-file")
    open(afile, "w").close()
    p = subprocess.run([cluster.DAEMON, "--config", c.cfg_path, "--node", "0", "--trace-dir", afile],
                       capture_output=True, text=True, timeout=30)
    check(p.returncode != 0 and "trace_dir" in p.stderr and "not a directory" in p.stderr,
          "a file as trace_dir: rc %d: %s" % (p.returncode, p.stderr[-300:]))
    for bad, why in ((["--trace-max-kib", "8"], "--trace-max-kib: 8 out of range"),
                     (["--trace-max-kib", "x"], "--trace-max-kib")):
        p = subprocess.run([cluster.DAEMON, "--config", c.cfg_path, "--node", "0"] + bad,
                           capture_output=True, text=True, timeout=30)
        check(p.returncode == 2 and why in p.stderr, "%s: rc %d: %s" % (bad, p.returncode, p.stderr[-300:]))
    print("ok   unwritable trace_dir: phases ran, 1 warning, %d dropped per node; a file refused" % (
        layers * steps * 2))


def main():
    for f in (cluster.DAEMON, cluster.RANK, TOOL):
        if not os.access(f, os.X_OK):
            print("skip: %s not built" % f)
            return 77
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or int(time.time()) % (1 << 20) + 1
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    only = os.environ.get("RW_TRACE_ONLY", "")
    with tempfile.TemporaryDirectory(prefix="rwtrace.", dir="/tmp") as tmp:
        for name, fn in (("record", scenario_record), ("late", scenario_late), ("fail", scenario_fail),
                         ("full", scenario_full),
                         ("rotate", scenario_rotate), ("unwritable", scenario_unwritable)):
            if only and name not in only.split(","):
                continue
            sub = os.path.join(tmp, name)
            os.mkdir(sub)
            try:
                fn(sub, seed)
            except (Fail, RuntimeError, subprocess.SubprocessError, OSError, ValueError, KeyError) as e:
                print("FAIL %s: %s" % (name, e))
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
