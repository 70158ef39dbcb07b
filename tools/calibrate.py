#!/usr/bin/env python3
"""`railwave calibrate` (docs/tools.md "Calibrating the anchor table"): the offline profiling pass
that feeds the calibration rule of docs/selector.md §2, against a running cluster. Run through
build/tools/railwave, which passes --build.

  calibrate          a sweep of workloads, every one timed through all four paths (Native,
                     Rail-only, Permutation-only, Joint), repeated; the anchor table by the
                     retention rule (sched/, through `railwave bench-workload calibrate`) with the
                     cluster's fingerprint; written atomically and hot-loaded with SIGHUP into every
                     daemon that reads its table from that file.
  calibrate --check  held-out workloads (other points, another seed) through all four paths:
                     what the table picks against the fastest path (regret), and a verdict.

The daemons are not restarted: every dispatch asks for its path in the submission (rw_sqe_t.path,
docs/ipc.md "Path requests"); the ranks (build/tools/rw_bench_rank) cycle through the four paths
step by step, so drift in the machine's load touches every path alike, and verify every row.

Two ways to run the ranks (docs/tools.md "Calibrating on a cluster of hosts"):
  on this machine    every node's IPC and stats sockets are reachable here (loopback clusters);
                     a phase's time is from the last rank's submission to the last rank's
                     completion, their CLOCK_MONOTONIC stamps compared.
  --launcher PREFIX  one worker per node (`railwave calibrate --worker`, started through PREFIX:
                     srun, mpirun, or a per-node template such as `ssh {host} {cmd}`) runs that
                     node's G ranks on its own daemon and prints per-step rows; a phase's time is
                     each node's own (its last rank's submission to its last rank's completion,
                     one clock) and the slowest node's is the phase's. No clock is compared across
                     hosts; the workers also reload their own daemon."""
import argparse
import base64
import json
import math
import os
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import types
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_bed  # noqa: E402  (pct, summary: the type-7 quantiles sched/ uses)
import observe  # noqa: E402  (ask, kv_line: the stats socket)

PATHS = bench_bed.PATHS
BUILD = None
WAIT = 120.0  # bound on any single wait; never a pass/fail criterion


WORKER = None  # --worker: this node's name, for the error line the orchestrator reads


def die(msg, rc=2):
    if WORKER is not None:
        print("rwcal error %s: %s" % (WORKER, msg), flush=True)
    sys.stderr.write("railwave calibrate%s: %s\n" % (" --worker" if WORKER is not None else "", msg))
    sys.exit(rc)


def binary(name):
    if name == "railwaved" and os.environ.get("RAILWAVE_DAEMON"):
        return os.environ["RAILWAVE_DAEMON"]
    for p in (os.path.join(BUILD, name), os.path.join(BUILD, "tools", name)):
        if os.access(p, os.X_OK):
            return p
    die("%s not built in %s (run ninja)" % (name, BUILD))


# ---- the cluster ---------------------------------------------------------------------------

class Cluster:
    """The daemons as their cluster file describes them (railwaved --dump-config per node),
    checked against what each running daemon says on its stats socket."""

    def __init__(self, config, launcher=None):
        self.config, self.launcher = config, launcher
        self.nodes = []
        first = self.dump(config, 0)
        n = len(first["nodes"])
        for i in range(n):
            self.nodes.append(first if i == 0 else self.dump(config, i))
        self.N, self.G = n, first["gpus_per_node"]
        self.R = len(first["nodes"][0]["rails"])
        self.gbps, self.transport = first["nic_gbps"], first["transport"]
        if launcher:
            # The sockets are the workers' business; ask every node's worker about its daemon.
            self.probed = launcher.probe(self)
            for i, info in self.probed.items():
                self.nodes[i]["recv_region_mib"] = info["recv_region_mib"]
                self.nodes[i]["anchors"] = info["anchors"]
            return
        for i, c in enumerate(self.nodes):
            check_daemon(self, c["node"], self.stats(i))

    @staticmethod
    def dump(config, node=None):
        """railwaved's view of the file for a node; node None: the node railwaved itself would
        be here (--node, RAILWAVE_NODE, the host name; RAILWAVE_SOCKET and friends apply)."""
        r = subprocess.run([binary("railwaved"), "--config", config] +
                           ([] if node is None else ["--node", str(node)]) + ["--dump-config"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            die("%s: %s" % (config, r.stderr.strip()))
        return json.loads(r.stdout)

    def stats(self, i, cmd="stats"):
        return ask_stats(self.nodes[i]["node"], self.nodes[i]["stats_socket"], cmd)

    def fingerprint(self):
        return {"nodes": self.N, "gpus_per_node": self.G, "rails": self.R,
                "nic_gbps": self.gbps, "transport": self.transport}


def ask_stats(name, path, cmd="stats"):
    try:
        lines = observe.ask(path, cmd, timeout=10)
    except OSError as e:
        die("node %s: stats socket %s: %s (is railwaved running?)" % (name, path, e))
    return dict(l.partition(" ")[::2] for l in lines)


def daemon_pid(path):
    """The daemon's pid: the peer credentials of its stats socket."""
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                struct.calcsize("3i")))[0]
    finally:
        s.close()


def check_daemon(cl, name, st):
    """The running daemon is the cluster file's node `name`, and has every peer up."""
    want = {"nodes": str(cl.N), "rails": str(cl.R), "gpus_per_node": str(cl.G),
            "transport": cl.transport, "node": name}
    for k, v in want.items():
        if st.get(k) != v:
            die("node %s: the running daemon says %s %s, the cluster file %s (another "
                "cluster file?)" % (name, k, st.get(k), v))
    if st.get("peers_up") != "%d/%d" % (cl.N - 1, cl.N - 1) or st.get("state") != "running":
        die("node %s: not every peer is up (peers_up %s, state %s); `railwave wait` first"
            % (name, st.get("peers_up"), st.get("state")))


# ---- workloads and timing ------------------------------------------------------------------

def points(a, held_out):
    """The sweep: rail skew (rho_g), payload size, receiver fan-in. Held-out points lie between
    the calibration points and draw their routing from another seed."""
    base = {"experts": a.experts, "topk": a.topk, "hidden": a.hidden, "tokens": a.tokens,
            "zipf": a.zipf, "dirichlet": a.dirichlet, "rail_skew": 0.0,
            "seed": a.seed + (1000 if held_out else 0), "layer": a.layer}
    skews = ([0.33, 0.89] if held_out else [0.0, 1.0]) if a.short else \
        ([0.33, 0.89] if held_out else [0.0, 0.67, 1.0])
    pts = [("rail-skew %.2f" % s, dict(base, rail_skew=s)) for s in skews]
    if not a.short:
        for mult in ((0.5, 2.0) if held_out else (0.25, 4.0)):
            pts.append(("size x%g" % mult, dict(base, rail_skew=0.67,
                                                 tokens=max(1, int(a.tokens * mult)))))
        pts.append(("fan-in", dict(base, rail_skew=0.67, dirichlet=0.2 if held_out else 0.05)))
    return pts


def wl_args(cl, wl):
    """The workload options of rw_bench_rank and bench-workload, as demo and bench pass them."""
    return bench_bed.wl_args(types.SimpleNamespace(nodes=cl.N, gpus=cl.G, rails=cl.R), wl)


def describe(cl, wl, table=None):
    argv = [binary("railwave"), "bench-workload", "describe", "--nic-gbps", str(cl.gbps),
            "--transport", cl.transport] + wl_args(cl, wl)
    if table:
        argv += ["--anchors", table]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        die("bench-workload describe: " + r.stderr.strip())
    return json.loads(r.stdout)


def run_all(jobs, limit, what):
    """Run every (name, argv[, env]) at once; stop them all at the first failure. Returns each
    one's stdout lines; raises RuntimeError naming the first that failed (its stderr's tail)."""
    procs, outs = [], []
    tmp = tempfile.mkdtemp(prefix="rw-calibrate.")
    try:
        for k, job in enumerate(jobs):
            of = open(os.path.join(tmp, "%d.out" % k), "w+")
            ef = open(os.path.join(tmp, "%d.err" % k), "w+")
            outs.append((of, ef))
            try:
                procs.append(subprocess.Popen(job[1], stdout=of, stderr=ef, start_new_session=True,
                                              env=job[2] if len(job) > 2 else None))
            except OSError as e:
                raise RuntimeError("%s: cannot start %s: %s" % (job[0], job[1][0], e.strerror))
        deadline = time.time() + limit
        failed = None

        def why(k):
            of, ef = outs[k]
            ef.seek(0)
            of.seek(0)
            # A worker says what went wrong on stdout ("rwcal error ..."); a rank on stderr.
            said = [l for l in of.read().splitlines() if l.startswith("rwcal error ")]
            return "%s exited %d: %s" % (jobs[k][0], procs[k].returncode,
                                         (said[0][12:] if said else ef.read().strip()[-500:]))
        while any(p.poll() is None for p in procs) and not failed:
            bad = [k for k, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = why(bad[0])
            elif time.time() > deadline:
                failed = "%s did not finish in %d s" % (what, limit)
            time.sleep(0.05)
        for k, p in enumerate(procs):
            if not failed and p.returncode != 0:
                failed = why(k)
        if failed:
            raise RuntimeError(failed)
        lines = []
        for of, _ in outs:
            of.seek(0)
            lines.append(of.read().splitlines())
        return lines
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for of, ef in outs:
            of.close()
            ef.close()
        for f in os.listdir(tmp):
            os.remove(os.path.join(tmp, f))
        os.rmdir(tmp)


def rank_job(sock, group, q, steps, rank_args):
    return ("rank %d" % q, [binary("rw_bench_rank"), "--socket", sock, "--group", group, "--rank",
                            str(q), "--steps", str(steps), "--paths", ",".join(PATHS), "--barrier"]
            + rank_args)


def node_steps(rank_lines, steps):
    """One node's ranks' `pair` lines -> per step (path, last dispatch submission, last dispatch
    completion, last combine submission, last combine completion), all on that node's clock."""
    rows = [[l.split() for l in lines if l.startswith("pair ")] for lines in rank_lines]
    out = []
    for s in range(steps):
        if any(len(r) <= s for r in rows):
            raise RuntimeError("step %d: a rank printed no row" % s)
        st = [r[s] for r in rows]
        path = st[0][7]
        if any(x[7] != path for x in st) or path != PATHS[s % len(PATHS)]:
            raise RuntimeError("step %d: the ranks ran different paths" % s)
        out.append((path,) + tuple(max(int(x[k]) for x in st) for k in (2, 3, 4, 5)))
    return out


def per_node(nodes, steps):
    """Each node's own phase time (its last submission to its last completion, one clock), the
    slowest node's: {path: [dispatch s]}, {path: [combine s]} over the timed steps."""
    disp, comb = {p: [] for p in PATHS}, {p: [] for p in PATHS}
    for s in range(len(PATHS), steps):
        path = nodes[0][s][0]
        if any(n[s][0] != path for n in nodes):
            raise RuntimeError("step %d: the nodes ran different paths" % s)
        disp[path].append(max(n[s][2] - n[s][1] for n in nodes) / 1e9)
        comb[path].append(max(n[s][4] - n[s][3] for n in nodes) / 1e9)
    return disp, comb


def cross_clock(nodes, steps):
    """The phase from the last submission anywhere to the last completion anywhere: needs every
    node's stamps on one clock (one machine)."""
    disp, comb = {p: [] for p in PATHS}, {p: [] for p in PATHS}
    for s in range(len(PATHS), steps):
        path = nodes[0][s][0]
        disp[path].append((max(n[s][2] for n in nodes) - max(n[s][1] for n in nodes)) / 1e9)
        comb[path].append((max(n[s][4] for n in nodes) - max(n[s][3] for n in nodes)) / 1e9)
    return disp, comb


def time_paths(cl, wl, reps, group):
    """One run of every rank: 4 x (reps + 1) pairs cycling through the paths (the first cycle
    is a warm-up), each after an empty barrier pair. Returns {path: [dispatch seconds]},
    {path: [combine seconds]} and, on one machine, the per-node dispatch times too (what the
    launcher mode measures) for comparison."""
    steps = len(PATHS) * (reps + 1)
    limit = WAIT + steps * 10
    if cl.launcher:
        nodes = cl.launcher.run(cl, group, steps, wl_args(cl, wl), limit)
        disp, comb = per_node(nodes, steps)
        return disp, comb, None
    jobs = [rank_job(cl.nodes[q // cl.G]["ipc_socket"], group, q, steps, wl_args(cl, wl))
            for q in range(cl.N * cl.G)]
    lines = run_all(jobs, limit, "the ranks")
    nodes = [node_steps(lines[i * cl.G:(i + 1) * cl.G], steps) for i in range(cl.N)]
    disp, comb = cross_clock(nodes, steps)
    return disp, comb, per_node(nodes, steps)[0]


def measure(cl, a, pts, label):
    """Every point through every path; skips points the daemons' receive region cannot hold."""
    out, t0 = [], time.monotonic()
    for i, (axis, wl) in enumerate(pts):
        desc = describe(cl, wl)
        need = desc["recv_region_mib"]
        have = min(c["recv_region_mib"] for c in cl.nodes)
        f = desc["features"]["f"]
        if need > have:
            print("%s point %d [%s]: skipped, needs recv_region_mib %d (the daemons have %d)"
                  % (label, i + 1, axis, need, have), flush=True)
            continue
        group = "calibrate.%d.%s.%d" % (os.getpid(), label, i + 1)
        try:
            disp, comb, node = time_paths(cl, wl, a.reps, group)
        except RuntimeError as e:
            die("%s point %d [%s]: %s" % (label, i + 1, axis, e), 1)
        med = {p: bench_bed.pct(disp[p], 0.5) for p in PATHS}
        print("%s point %d/%d [%s] f=[%.2f %.3f %.3f]: %s" % (
            label, i + 1, len(pts), axis, f[0], f[1], f[2],
            "  ".join("%s %.3f ms" % (p, med[p] * 1e3) for p in PATHS)), flush=True)
        case = {"case_id": i + 1, "axis": axis, "workload": wl, "features": f, "desc": desc,
                "dispatch": {p: bench_bed.summary(disp[p]) for p in PATHS},
                "combine": {p: bench_bed.summary(comb[p]) for p in PATHS}}
        if node:
            # The launcher mode's per-node times from the same stamps: never shorter, by at
            # most how far apart the nodes submitted (docs/tools.md).
            case["dispatch_per_node"] = {p: bench_bed.summary(node[p]) for p in PATHS}
            extra = [n - d for p in PATHS for n, d in zip(node[p], disp[p])]
            print("%s point %d: per-node timing (the --launcher mode's) over this one: median "
                  "%+.3f ms, max %+.3f ms per dispatch" % (label, i + 1,
                                                            bench_bed.pct(extra, 0.5) * 1e3,
                                                            max(extra) * 1e3), flush=True)
        out.append(case)
    if not out:
        die("no point of the sweep fits the daemons' receive region (lower --tokens/--hidden)", 1)
    print("%s: %d points x 4 paths x %d pairs (with the warm-up) in %.1f s" % (
        label, len(out), a.reps + 1, time.monotonic() - t0), flush=True)
    return out


def beats(a, fast, slow):
    """The retention rule's test (docs/selector.md §2) between two measured paths: both stable and the
    faster one's p90 x (1 + margin) under the slower one's p10."""
    return (cv(fast["samples"]) < a.cv_bound and cv(slow["samples"]) < a.cv_bound and
            fast["p90"] * (1 + a.margin) < slow["p10"])


def cv(xs):
    m = sum(xs) / len(xs) if xs else 0
    if len(xs) < 2 or m <= 0:
        return math.inf
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) / m


# ---- calibrate -----------------------------------------------------------------------------

def build_table(cl, a, cases):
    doc = {"fingerprint": cl.fingerprint(), "max_size_ratio": a.max_size_ratio,
           "shape_tolerance": a.shape_tolerance, "cv_bound": a.cv_bound, "margin": a.margin,
           "cases": [{"case_id": c["case_id"], "features": c["features"],
                      "samples": {p: c["dispatch"][p]["samples"] for p in PATHS}} for c in cases]}
    r = subprocess.run([binary("railwave"), "bench-workload", "calibrate"], input=json.dumps(doc),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        die("calibration: " + r.stderr.strip(), 1)
    return r.stdout


def explain(a, case, anchor):
    """Why the rule kept what it kept (the decision itself is sched/'s, in the table)."""
    s = anchor["samples"]
    j = s["joint"]
    cj = cv(case["dispatch"]["joint"]["samples"])
    if anchor["selected"] != "joint":
        p = anchor["selected"]
        return "keeps %s: CV %.1f%% / joint %.1f%% under %.0f%%, p90 %.3f ms x %.2f < joint p10 %.3f ms" % (
            p, cv(case["dispatch"][p]["samples"]) * 100, cj * 100, a.cv_bound * 100,
            s[p]["p90"] * 1e3, 1 + a.margin, j["p10"] * 1e3)
    why = []
    for p in PATHS[:-1]:
        c = cv(case["dispatch"][p]["samples"])
        if not (c < a.cv_bound and cj < a.cv_bound):
            why.append("%s unstable (CV %.1f%%, joint %.1f%%)" % (p, c * 100, cj * 100))
        elif not s[p]["p90"] * (1 + a.margin) < j["p10"]:
            why.append("%s not conservatively faster (p90 %.3f ms x %.2f >= joint p10 %.3f ms)"
                       % (p, s[p]["p90"] * 1e3, 1 + a.margin, j["p10"] * 1e3))
    return "joint: " + "; ".join(why)


def write_atomic(path, text):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".anchors.", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)  # a daemon reloading now reads the old file or the new one, whole


def hup(name, stats_path, n_anchors):
    """SIGHUP to the daemon behind stats_path; wait until it has taken a table of n_anchors."""
    before = ask_stats(name, stats_path)
    pid = daemon_pid(stats_path)
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as e:
        die("node %s: cannot signal railwaved (pid %d): %s; reload it yourself "
            "(systemctl reload railwaved, or kill -HUP)" % (name, pid, e.strerror), 1)
    deadline = time.time() + 10
    while True:
        st = ask_stats(name, stats_path)
        if int(st["anchor_reloads_refused"]) > int(before["anchor_reloads_refused"]):
            die("node %s refused the new table (its log says why)" % name, 1)
        if int(st["anchor_reloads"]) > int(before["anchor_reloads"]):
            break
        if time.time() > deadline:
            die("node %s did not reload in 10 s" % name, 1)
        time.sleep(0.05)
    if st["anchors"] != str(n_anchors):
        die("node %s holds %s anchors after the reload, the table has %d"
            % (name, st["anchors"], n_anchors), 1)
    return pid


def reload(cl, out, text, n_anchors):
    """SIGHUP to every daemon whose `anchors` is this file; wait until it has taken the table.
    With a launcher, each node's worker does it on its node (and installs the file there)."""
    if cl.launcher:
        return cl.launcher.install(cl, out, text, n_anchors)
    target = os.path.realpath(out)
    done, skipped = [], []
    for i, c in enumerate(cl.nodes):
        if not c["anchors"] or os.path.realpath(c["anchors"]) != target:
            skipped.append("%s (reads %s)" % (c["node"], c["anchors"] or "no table"))
            continue
        pid = hup(c["node"], c["stats_socket"], n_anchors)
        done.append("%s (pid %d)" % (c["node"], pid))
    return done, skipped


def cmd_calibrate(cl, a):
    out = a.out or cl.nodes[0]["anchors"]
    if not out:
        die("no --out and the daemons have no `anchors` file configured")
    fp = cl.fingerprint()
    print("calibrate: %d nodes x %d GPUs x %d rails, %g Gbit/s %s; %d repetitions of 4 paths per "
          "point; rule: CV < %.0f%%, p90 x %.2f < joint p10" % (
              cl.N, cl.G, cl.R, cl.gbps, cl.transport, a.reps, a.cv_bound * 100, 1 + a.margin),
          flush=True)
    cases = measure(cl, a, points(a, False), "calibrate")
    text = build_table(cl, a, cases)
    table = json.loads(text)
    table["comment"] = ("railwave calibrate %s: %d points x 4 paths x %d repetitions" % (
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), len(cases), a.reps))
    anchors = {x["case_id"]: x for x in table["anchors"]}
    for c in cases:
        print("case %d [%s]: %s" % (c["case_id"], c["axis"], explain(a, c, anchors[c["case_id"]])))
    text = json.dumps(table, indent=2) + "\n"
    try:
        write_atomic(out, text)
    except OSError as e:
        if not cl.launcher:
            die("%s: %s" % (out, e), 1)
        print("could not write %s here (%s); the workers install it on their nodes" % (out, e))
    print("wrote %s: %d anchors (%s), fingerprint N=%d G=%d R=%d %g Gbit/s %s" % (
        out, len(table["anchors"]), ", ".join("case %d %s" % (x["case_id"], x["selected"])
                                             for x in table["anchors"]),
        fp["nodes"], fp["gpus_per_node"], fp["rails"], fp["nic_gbps"], fp["transport"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"fingerprint": fp, "table": out, "cases": strip(cases)}, f, indent=1)
    if a.no_reload:
        return 0
    done, skipped = reload(cl, out, text, len(table["anchors"]))
    if done:
        print("reloaded (SIGHUP): %s" % ", ".join(done))
    if skipped:
        print("not reloaded, their `anchors` is another file: %s" % ", ".join(skipped))
    return 0


def strip(cases):
    return [{k: v for k, v in c.items() if k != "desc"} for c in cases]


# ---- launcher mode: one worker per node ------------------------------------------------------

class Launcher:
    """How the workers start. PREFIX without placeholders runs once and must start one worker
    per node itself (`srun -N4 --ntasks-per-node=1`, `mpirun --map-by ppr:1:node`); the worker
    finds its node as railwaved does. A template with {host}, {name} or {node} runs once per
    node, with `--node NAME` added; {cmd} stands for the worker's command as one shell-quoted
    word (`ssh {host} {cmd}`), otherwise the command's words are appended."""

    def __init__(self, spec, railwave):
        self.words = shlex.split(spec)
        if not self.words:
            die("--launcher: empty")
        self.per_node = any(k in spec for k in ("{host}", "{name}", "{node}"))
        self.railwave = railwave

    def jobs(self, cl, argv):
        base = [self.railwave, "calibrate", "--worker"] + argv[:1] + \
            ["--config", os.path.abspath(cl.config)]
        if not self.per_node:
            return [("the launcher (%s)" % self.words[0], self.command(base + argv[1:], {}))]
        out = []
        for i, c in enumerate(cl.nodes):
            me = c["nodes"][i]
            sub = {"{host}": me.get("host", me["name"]), "{name}": me["name"], "{node}": str(i)}
            out.append(("the launcher for node %s" % me["name"],
                        self.command(base + ["--node", me["name"]] + argv[1:], sub)))
        return out

    def command(self, cmd, sub):
        words, placed = [], False
        for w in self.words:
            for k, v in sub.items():
                w = w.replace(k, v)
            if "{cmd}" in w:
                w, placed = w.replace("{cmd}", shlex.join(cmd)), True
            words.append(w)
        return words if placed else words + cmd

    def launch(self, cl, argv, limit, what):
        """Run the workers; returns {node index: [its lines, without the prefix]} and checks
        that every node had exactly one worker."""
        try:
            outs = run_all(self.jobs(cl, argv), limit, what)
        except RuntimeError as e:
            die("%s: %s" % (what, e), 1)
        by = {}
        for lines in outs:
            for l in lines:
                w = l[l.find("rwcal "):].split() if "rwcal " in l else []  # srun --label: "0: rwcal"
                if len(w) >= 3 and w[0] == "rwcal" and w[1].isdigit():
                    by.setdefault(int(w[1]), []).append(w[2:])
        seen = {i: sum(1 for x in by.get(i, []) if x[0] == "node") for i in range(cl.N)}
        twice = [cl.nodes[i]["node"] for i, k in seen.items() if k > 1]
        none = [cl.nodes[i]["node"] for i, k in seen.items() if k == 0]
        if twice or none or set(by) - set(range(cl.N)):
            die("%s: the launcher must start one worker per node (%s%s); e.g. srun -N%d "
                "--ntasks-per-node=1, or a per-node template such as 'ssh {host} {cmd}'" % (
                    what, "no worker on %s" % ", ".join(none) if none else "",
                    ("; " if none else "") + "more than one on %s" % ", ".join(twice) if twice else "",
                    cl.N), 1)
        return by

    def probe(self, cl):
        """Each worker checks its daemon; returns {node: its recv region and anchors file}."""
        by = self.launch(cl, ["probe"], WAIT, "probing the nodes")
        out = {}
        for i, rows in sorted(by.items()):
            rows = [x for x in rows if x[0] == "node"]
            kv = dict(zip(rows[0][0::2], rows[0][1::2]))
            out[i] = {"recv_region_mib": int(kv["recv_region_mib"]),
                      "anchors": kv["anchors"] if kv["anchors"] != "-" else ""}
            print("node %s: worker on %s, railwaved pid %s, peers up" % (
                cl.nodes[i]["node"], kv["host"], kv["pid"]), flush=True)
        return out

    def run(self, cl, group, steps, rank_args, limit):
        """Every node's ranks through its worker; returns every node's node_steps()."""
        by = self.launch(cl, ["run", "--group", group, "--steps", str(steps), "--"] + rank_args,
                         limit, "the workers")
        nodes = []
        for i in range(cl.N):
            rows = sorted((int(x[1]), x[2], int(x[3]), int(x[4]), int(x[5]), int(x[6]))
                          for x in by[i] if x[0] == "step")
            if [r[0] for r in rows] != list(range(steps)):
                die("node %s's worker printed steps %s, not 0..%d" % (
                    cl.nodes[i]["node"], [r[0] for r in rows], steps - 1), 1)
            nodes.append([r[1:] for r in rows])
        return nodes

    def install(self, cl, out, text, n_anchors):
        z = base64.b64encode(zlib.compress(text.encode(), 9)).decode()
        by = self.launch(cl, ["install", "--out", out, "--anchor-count", str(n_anchors),
                              "--table-z", z], WAIT, "installing the table")
        done, skipped = [], []
        for i in range(cl.N):
            for x in by[i]:
                if x[0] == "reloaded":
                    done.append("%s (pid %s, on %s)" % (cl.nodes[i]["node"], x[2], x[4]))
                elif x[0] == "skipped":
                    skipped.append("%s (reads %s)" % (cl.nodes[i]["node"], x[1]))
        return done, skipped


def worker_main(argv):
    """`railwave calibrate --worker probe|run|install`: this node's part, on this host."""
    global WORKER
    p = argparse.ArgumentParser(prog="railwave calibrate --worker",
                                description="One node's part of a launched calibration "
                                            "(docs/tools.md); started by `railwave calibrate "
                                            "--launcher`, not by hand.")
    p.add_argument("action", choices=["probe", "run", "install"])
    p.add_argument("--config", required=True)
    p.add_argument("--node", help="this node (default: RAILWAVE_NODE, else the host name)")
    p.add_argument("--group")
    p.add_argument("--steps", type=int)
    p.add_argument("--out")
    p.add_argument("--anchor-count", type=int)
    p.add_argument("--table-z")
    rank_args = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    WORKER = a.node or os.environ.get("RAILWAVE_NODE") or socket.gethostname()
    me = Cluster.dump(a.config, a.node)
    WORKER = me["node"]
    names = [n["name"] for n in me["nodes"]]
    i, G = names.index(me["node"]), me["gpus_per_node"]
    cl = types.SimpleNamespace(N=len(names), G=G, R=len(me["nodes"][0]["rails"]),
                               transport=me["transport"])
    check_daemon(cl, me["node"], ask_stats(me["node"], me["stats_socket"]))
    say = ["rwcal %d node %s host %s pid %d anchors %s recv_region_mib %d" % (
        i, me["node"], socket.gethostname(), daemon_pid(me["stats_socket"]), me["anchors"] or "-",
        me["recv_region_mib"])]
    if a.action == "run":
        jobs = [rank_job(me["ipc_socket"], a.group, q, a.steps, rank_args)
                for q in range(i * G, (i + 1) * G)]
        try:
            rows = node_steps(run_all(jobs, WAIT + a.steps * 10, "the ranks"), a.steps)
        except RuntimeError as e:
            die("node %s: %s" % (me["node"], e), 1)
        say += ["rwcal %d step %d %s %d %d %d %d" % ((i, s) + r) for s, r in enumerate(rows)]
    elif a.action == "install":
        text = zlib.decompress(base64.b64decode(a.table_z)).decode()
        if not me["anchors"] or os.path.realpath(me["anchors"]) != os.path.realpath(a.out):
            say.append("rwcal %d skipped %s" % (i, me["anchors"] or "no-table"))
        else:
            try:
                with open(me["anchors"]) as f:
                    same = f.read() == text  # shared storage: the orchestrator wrote it
            except OSError:
                same = False
            if not same:
                try:
                    write_atomic(me["anchors"], text)
                except OSError as e:
                    die("node %s: %s: %s" % (me["node"], me["anchors"], e), 1)
            pid = hup(me["node"], me["stats_socket"], a.anchor_count)
            say.append("rwcal %d reloaded pid %d host %s %s" % (
                i, pid, socket.gethostname(), "written" if not same else "already-there"))
    sys.stdout.write("".join(l + "\n" for l in say))  # one write: launchers merge streams
    sys.stdout.flush()
    return 0


# ---- check ---------------------------------------------------------------------------------

def replayed(cl, a, pts):
    """--check --samples FILE: the held-out points' dispatch times as FILE gives them (the
    "points" of an earlier --check --json report: each point's axis and its per-path samples)
    instead of timing them here; the table's picks and the verdict are reached as for a
    measured run. What --check decides from given times, not what the machine's noise did."""
    try:
        with open(a.samples) as f:
            given = {p["axis"]: p["dispatch"] for p in json.load(f)["points"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        die("--samples %s: %s" % (a.samples, e))
    out = []
    for i, (axis, wl) in enumerate(pts):
        if axis not in given:
            continue
        try:
            d = {p: bench_bed.summary([float(x) for x in given[axis][p]["samples"]])
                 for p in PATHS}
        except (KeyError, TypeError, ValueError) as e:
            die("--samples %s: point [%s]: no samples for every path (%s)" % (a.samples, axis, e))
        out.append({"case_id": i + 1, "axis": axis, "workload": wl,
                    "features": describe(cl, wl)["features"]["f"], "dispatch": d})
    if not out:
        die("--samples %s: none of the held-out points (%s)" % (
            a.samples, ", ".join(axis for axis, _ in pts)))
    print("check: %d points x 4 paths from %s (not timed here)" % (len(out), a.samples), flush=True)
    return out


def cmd_check(cl, a):
    try:
        with open(a.check) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        die("%s: %s" % (a.check, e))
    fp, tf = cl.fingerprint(), table.get("fingerprint", {})
    same = all(tf.get(k) == fp[k] for k in ("nodes", "gpus_per_node", "rails", "transport")) and \
        abs(float(tf.get("nic_gbps", 0)) - fp["nic_gbps"]) <= 1e-6 * fp["nic_gbps"]
    if not same:
        print("%s does not hold: calibrated for %s, this cluster is %s" % (a.check, tf, fp))
        return 1
    if not a.samples:
        print("check %s (%d anchors) on %d held-out points, %d repetitions of 4 paths each" % (
            a.check, len(table.get("anchors", [])), len(points(a, True)), a.reps), flush=True)
    rows = []
    cases = replayed(cl, a, points(a, True)) if a.samples else \
        measure(cl, a, points(a, True), "check")
    for c in cases:
        sel = describe(cl, c["workload"], a.check)["selection"]
        if sel["table_error"]:
            die(sel["table_error"], 1)
        d = c["dispatch"]
        med = {p: d[p]["median"] for p in PATHS}
        best, pick = min(PATHS, key=lambda p: med[p]), sel["path"]
        rows.append({"point": c["case_id"], "axis": c["axis"], "features": c["features"],
                     "selected": pick, "reason": sel["reason"], "case": sel["case_id"],
                     "median_s": med, "best": best,
                     "regret": med[pick] / med[best] - 1,
                     "reliable": beats(a, d[best], d[pick]) if best != pick else False,
                     "joint_regret": med["joint"] / med[best] - 1, "dispatch": d})
    print("%-5s %-15s %-22s %-26s %s" % ("point", "workload", "features f0 f1 f2", "table picks",
                                         "  ".join("%9s" % p for p in PATHS) +
                                         "  best       regret  reliably"))
    for r in rows:
        f = r["features"]
        pick = "%s (%s)" % (r["selected"], "case %d" % r["case"] if r["case"] >= 0 else r["reason"])
        print("%-5d %-15s %6.2f %6.3f %6.3f   %-26s %s  %-9s %6.1f%%  %s" % (
            r["point"], r["axis"], f[0], f[1], f[2], pick,
            "  ".join("%6.3f ms" % (r["median_s"][p] * 1e3) for p in PATHS), r["best"],
            r["regret"] * 100, "yes" if r["reliable"] else "no"))
    worst = max(r["regret"] for r in rows)
    mean = sum(r["regret"] for r in rows) / len(rows)
    jw = max(r["joint_regret"] for r in rows)
    bad = [r for r in rows if r["reliable"] and r["regret"] > a.tolerance]
    holds = not bad
    print("regret against the fastest path: worst %.1f%%, mean %.1f%% (always Joint: worst %.1f%%); "
          "reliably beaten by more than %.0f%% at %d of %d points" % (
              worst * 100, mean * 100, jw * 100, a.tolerance * 100, len(bad), len(rows)))
    print("%s %s on this cluster" % (
        a.check, "holds" if holds else "does NOT hold (points %s): recalibrate (railwave calibrate)"
        % ",".join(str(r["point"]) for r in bad)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"table": a.check, "fingerprint": fp, "holds": holds, "worst_regret": worst,
                       "failing_points": [r["point"] for r in bad],
                       "mean_regret": mean, "joint_worst_regret": jw, "tolerance": a.tolerance,
                       "points": rows}, f, indent=1)
    return 0 if holds else 1


def main(argv):
    global BUILD
    if argv and argv[0] == "calibrate":  # the mode tools/pyexec.c passes first
        argv = argv[1:]
    if len(argv) >= 2 and argv[0] == "--build":
        BUILD, argv = os.path.abspath(argv[1]), argv[2:]
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="railwave calibrate",
        description="Time a sweep of workloads through all four paths on the running daemons and "
                    "write the anchor table (docs/selector.md §2), hot-loaded with SIGHUP; or, with "
                    "--check TABLE, say whether a table still holds here (docs/tools.md).")
    p.add_argument("--config", required=True, metavar="FILE", help="the daemons' cluster file")
    p.add_argument("--out", metavar="FILE",
                   help="where to write the table (default: the daemons' `anchors` file)")
    p.add_argument("--check", metavar="TABLE", help="check TABLE on held-out points instead")
    p.add_argument("--samples", metavar="FILE",
                   help="--check: the held-out points' times from FILE (an earlier --check "
                   "--json report) instead of timing them")
    p.add_argument("--launcher", metavar="PREFIX",
                   help="start one worker per node through PREFIX (a cluster of hosts): "
                        "'srun -N4 --ntasks-per-node=1', or a per-node template with {host} "
                        "{name} {node} {cmd} such as 'ssh {host} {cmd}' (docs/tools.md)")
    p.add_argument("--railwave", metavar="PATH",
                   help="--launcher: the railwave the workers run (default: this one's path)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per path and point [10]")
    p.add_argument("--short", action="store_true", help="two points (rail skew) instead of six")
    p.add_argument("--no-reload", action="store_true", help="write the table, send no SIGHUP")
    p.add_argument("--json", metavar="FILE", help="also write every sample and verdict as JSON")
    p.add_argument("--cv-bound", type=float, default=0.10, help="stability bound on CV [0.10]")
    p.add_argument("--margin", type=float, default=0.05, help="conservative margin [0.05]")
    p.add_argument("--max-size-ratio", type=float, default=4.0, help="anchor size window [4]")
    p.add_argument("--shape-tolerance", type=float, default=0.15, help="anchor shape window [0.15]")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="--check: a pick reliably beaten by more than this fails the table [0.10]")
    g = p.add_argument_group("workload (the model's shape; the sweep varies skew, size, fan-in)")
    g.add_argument("--experts", type=int, default=128)
    g.add_argument("--topk", type=int, default=8)
    g.add_argument("--hidden", type=int, default=4096, help="bf16 elements per row [4096]")
    g.add_argument("--tokens", type=int, default=256, help="tokens per rank [256]")
    g.add_argument("--zipf", type=float, default=0.8)
    g.add_argument("--dirichlet", type=float, default=20.0)
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--layer", type=int, default=0)
    a = p.parse_args(argv)
    if a.reps < 2:
        die("--reps: at least 2 (the rule needs a spread)")
    if a.samples and not a.check:
        die("--samples: only with --check TABLE")
    launcher = Launcher(a.launcher, a.railwave or binary("railwave")) if a.launcher else None
    cl = Cluster(a.config, launcher)
    return cmd_check(cl, a) if a.check else cmd_calibrate(cl, a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
