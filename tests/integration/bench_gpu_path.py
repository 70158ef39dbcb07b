#!/usr/bin/env python3
"""Benchmark (not a test; docs/perf/gpu-path.md): the GPU data path on one machine.
Two railwaved on loopback (tcp rails, R=2, as the integration test), four ranks per node with CUDA
buffers on the one GPU (tools/rw_bench_rank --cuda: every row, count and combined sum checked),
MoE shapes of real models, bf16, several tokens-per-rank sizes. Per (shape, tokens), in the same
run: the staging path (the host mover: RAILWAVE_CUDA_MOVER=0), the CUDA mover, optionally a second
daemon binary (--alt NAME=PATH, e.g. one whose executor waits for the mover's pack report), and
two ceilings: plain TCP moving the same bytes per direction over the same number of connections
(one per rail and direction) between the same loopback addresses, with a thread per connection
end, and with one thread per node multiplexing its connections (one core, as a daemon's loop).

Per phase kind: the median over steps 1.. (step 0 warms up: IPC imports, slab mapping, kernel
load) of the time from the last rank's submission to the last rank's completion (CLOCK_MONOTONIC
of the one machine); the bytes one node sends the other per phase (from the daemons' rail
counters); each daemon's user and system CPU seconds per phase (from the moment every rank
printed its step 0 to the end, divided by those phases). The kernels' bandwidth against the copy
engines is build/cuda/bench_pack's (run it beside this).

Mode `rank` is the rank path (docs/rankpath.md: tools/rw_bench_rank --rank-path, the kernels in
the ranks' own streams, the daemons as planners; carve-outs of group_area_mib sized for the shape).

--suite rank (docs/perf/rankpath.md): the rank path against the CUDA mover, alone and beside a bf16
matmul loop (torch, another process, the same GPU), in one run. Per (shape, tokens) one cluster
per mode (old = the CUDA mover, new = the rank path), one run of the ranks: step 0 warms up,
steps 1..S run alone, then the matmul loop starts and steps S+1..2S run beside it (the ranks
wait at a gate file, rw_bench_rank --gate). The new mode's ranks alternate their stream's
priority step by step (--priority both: even steps the default, odd steps the greatest). --sms
LIST (a comma list of SM budgets, 0 = none: rw_client_rank_opts_t.max_sms, docs/rankpath.md "SMs
beside the trainer's compute") crosses that with the budgets: each value holds for one step of
each priority in turn (rw_bench_rank --sms), each segment runs that many times the steps, and
every new cell is (priority, budget). With
MPS (nvidia-cuda-mps-control on the machine) the ranks and the matmul loop are MPS clients (its
pipe and log folders in the run's temp folder) and the daemons are kept out of it (their
CUDA_MPS_PIPE_DIRECTORY an empty folder, where no control daemon answers). Printed per cell: p50
of last submission -> last completion (dispatch / combine), host ns inside the rank's submitting
calls (p50 / p99), daemon CPU ms per timed phase (utime + stime over the segment / its phases,
the barrier pairs' work included), the matmul loop's TFLOP/s while phases ran, and the ratios
against the targets (docs/perf/rankpath.md). --matmul-sm-pct P gives the matmul loop P % of the
SMs (its MPS client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): the trainer's compute on a budget of
SMs, the ranks' kernels on the rest, as a trainer reserving SMs for communication would run.

  python3 bench_gpu_path.py [--shapes deepseek,glm,deepseek-h1024] [--tokens 512,1024,2048,4096]
                            [--steps 4] [--modes staging,cuda,rank] [--alt NAME=PATH] [--trace]
  python3 bench_gpu_path.py --suite rank [--shapes deepseek,glm] [--tokens 1,128,512,4096]
                            [--mps auto|on|off] [--sms 0,8,16,32] [--matmul-sm-pct P] [--trace]
  (run from the build directory's bench/ copy: $b/bench/gpu_path)"""
import argparse
import json
import os
import selectors
import shutil
import signal
import socket
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
# name: (hidden, routed experts, top-k) — DeepSeek-V3 and GLM-4.5-Air, and DeepSeek-V3's routing
# with 1024-wide rows (the daemon's CPU per phase must not follow the row width).
# `tiny`: the CI smoke run's (tests/integration/test_bench_rankpath.sh, on the kernel stand-in).
SHAPES = {"deepseek": (7168, 256, 8), "glm": (4096, 128, 8), "deepseek-h1024": (1024, 256, 8),
          "tiny": (40, 64, 8)}
GPUS = 4
RAILS = 2


def carve_mib(shape, tokens):
    """group_area_mib, group_local_mib and group_pool_mib for the rank path at (shape, tokens
    per rank): what `railwave size` prints for this cluster (2 nodes x GPUS ranks, RAILS rails),
    the sizes the daemons' own arithmetic needs for the shape's largest phase."""
    hidden, experts, topk = SHAPES[shape]
    rc, keys, err = cluster.railwave_size(hidden, topk, experts, tokens, GPUS, 2, RAILS)
    if rc != 0:
        raise RuntimeError("railwave size: %s" % err.strip())
    return {k: keys[k] for k in ("group_area_mib", "group_local_mib", "group_pool_mib")}


def cpu_times(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def rail_counters(c, n):
    """(tx_bytes, tx_records) per rail of node n."""
    return [(int(r["tx_bytes"]), int(r["tx_records"])) for r in c.rail_stats(n)]


def trace_split(trace_dir, steps, only=None):
    """Where a phase's time goes, from the daemons' phase traces (docs/service.md "Phase
    traces"): per kind, the median over steps 1.. (or the steps in `only`) and both nodes of each
    milestone in ms after the node's last local submission: inputs staged, path decided (count
    rows exchanged), first and last write posted, last write done, last range complete, kind
    done here. The --barrier pairs (the layer after the timed one) are left out."""
    recs = []
    for f in sorted(os.listdir(trace_dir)):
        with open(os.path.join(trace_dir, f)) as fh:
            recs += [json.loads(l) for l in fh if l.strip()]
    layer = min((r.get("layer", 0) for r in recs), default=0)
    out = {}
    for kind in ("dispatch", "combine"):
        rows = []
        for r in recs:
            if r.get("kind") != kind or r.get("step", 0) < 1 or r.get("status") != "ok" or \
                    r.get("layer", 0) != layer or (only is not None and r.get("step") not in only):
                continue
            base = r.get("last_submit_us") or 0
            tx = r.get("tx") or []
            rx = r.get("rx") or []

            def rel(v):
                return None if v is None else (v - base) / 1e3
            rows.append([rel(r.get("ready_us")), rel(r.get("decided_us")), rel(r.get("run_us")),
                         rel(min((t[3] for t in tx if t[3] is not None), default=None)),
                         rel(max((t[4] for t in tx if t[4] is not None), default=None)),
                         rel(max((t[5] for t in tx if t[5] is not None), default=None)),
                         rel(max((x[4] for x in rx if x[4] is not None), default=None)),
                         rel(r.get("us"))])
        out[kind] = [statistics.median([x[i] for x in rows if x[i] is not None])
                     if any(x[i] is not None for x in rows) else None for i in range(8)]
    return out


def run_daemons(tmp, mode, daemon, shape, tokens, steps, seed, trace=False, rank_env=None,
                daemon_env=None, gate=None, fake=None, sms=None):
    """One cluster (2 railwaved) and its 2 x GPUS ranks of `mode` (staging, cuda or rank) for
    `steps` pairs. gate (STEP, fn): the ranks wait before step STEP until fn() has run (it
    returns once other work is going). rank_env / daemon_env: extra environment of the ranks /
    the daemons. fake: a CUDA stand-in driver for both (CI). sms: the rank path's SM budgets
    (rw_bench_rank --sms LIST). Returns the medians over steps 1.. and the raw pairs, host-call
    lines, each step's budget and daemon CPU readings."""
    hidden, experts, topk = SHAPES[shape]
    rec = ((16 + topk * 8 + 15) & ~15) + ((hidden * 2 + 15) & ~15)
    recv_mib = 64 + 6 * GPUS * tokens * rec // (1 << 20)
    # The staging mover's copies hold the loop for a second or more at the largest sizes: longer
    # heartbeats, so that is measured rather than a peer declared down.
    extra = {"recv_region_mib": recv_mib, "phase_timeout_ms": 60000, "heartbeat_timeout_ms": 10000}
    if mode == "rank":  # the rank path's records live in the group's carve-out
        extra["recv_region_mib"] = 16
        extra.update(carve_mib(shape, tokens))
    trace_dir = os.path.join(tmp, "trace-%s-%s-%d" % (mode, shape, tokens))
    if trace:
        os.makedirs(trace_dir, exist_ok=True)
        extra["trace_dir"] = trace_dir
    c = cluster.Cluster(tmp, 2, path="joint", extra=extra, gpus=GPUS, daemon=daemon,
                        rails=RAILS, cuda_ranks=fake)
    if mode == "staging":
        c.env["RAILWAVE_CUDA_MOVER"] = "0"
    else:
        c.env.pop("RAILWAVE_CUDA_MOVER", None)
    env = dict(c.env, **(rank_env or {}))
    c.env.update(daemon_env or {})
    c.start_all()
    res, procs = {}, []
    gate_file = os.path.join(tmp, "gate")
    if os.path.exists(gate_file):
        os.unlink(gate_file)
    try:
        wl = ["--nodes", "2", "--gpus", str(GPUS), "--rails", str(RAILS), "--experts",
              str(experts), "--topk", str(topk), "--hidden", str(hidden), "--tokens", str(tokens),
              "--seed", str(seed), "--host-ns"]
        if gate:
            wl += ["--barrier", "--gate", "%d:%s" % (gate[0], gate_file)]
        flags = ["--rank-path", "--priority", "both" if gate else "normal"] if mode == "rank" \
            else ["--cuda"]
        if mode == "rank" and sms:
            flags += ["--sms", sms]
        for r in range(2 * GPUS):
            sock = c.cfg["nodes"][r // GPUS]["ipc_socket"]
            procs.append(subprocess.Popen(
                [RANK, "--socket", sock, "--group", "bench", "--rank", str(r), "--steps", str(steps)]
                + flags + wl, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
        outs = [[] for _ in procs]

        def reader(i, p):
            for line in p.stdout:
                outs[i].append(line.decode())

        def all_printed(step):
            return all(any(l.startswith("pair %d " % step) for l in o) for o in outs)

        readers = [threading.Thread(target=reader, args=(i, p)) for i, p in enumerate(procs)]
        for t in readers:
            t.start()
        cpu0 = cpu_g = None  # once every rank printed its step 0: the warm-up is over
        deadline = time.monotonic() + 600
        while any(t.is_alive() for t in readers) and time.monotonic() < deadline:
            if cpu0 is None and all_printed(0):
                cpu0 = [cpu_times(c.procs[n].pid) for n in range(2)]
            if gate and cpu_g is None and all_printed(gate[0] - 1):
                cpu_g = [cpu_times(c.procs[n].pid) for n in range(2)]
                gate[1]()
                with open(gate_file, "w"):
                    pass
            time.sleep(0.002)
        pairs, calls, budgets = {}, {}, {}
        marker = "(rank path)" if mode == "rank" else "(CUDA buffer)"
        for r, p in enumerate(procs):
            p.wait(timeout=60)
            out = "".join(outs[r])
            if p.returncode != 0 or marker not in out:
                raise RuntimeError("%s %s T=%d rank %d rc %s: %s\n%s" % (
                    mode, shape, tokens, r, p.returncode, out[-2000:], c.logs()))
            for line in out.splitlines():
                f = line.split()
                if f[:1] == ["pair"]:
                    pairs.setdefault(int(f[1]), []).append([int(x) for x in f[2:6]])
                elif f[:1] == ["call"]:
                    calls.setdefault(int(f[1]), []).append((int(f[2]), int(f[3]), f[4]))
                elif f[:1] == ["sms"]:
                    budgets[int(f[1])] = int(f[2])
        cpu1 = [cpu_times(c.procs[n].pid) for n in range(2)]
        rails = [rail_counters(c, n) for n in range(2)]
        with open(os.path.join(tmp, "d0.log")) as f:
            res["log"] = f.read()
        # Who counted each dispatch's row: the CUDA mover's kernels (gpu) or the daemon's CPU
        # (-1: a daemon from before these counters).
        stats = [dict(l.split(None, 1) for l in c.stats(n, "stats").splitlines() if " " in l)
                 for n in range(2)]
        res["counted"] = [tuple(int(st.get(k, -1)) for k in ("counts_gpu", "counts_host"))
                          for st in stats]
    finally:
        for p in procs:  # a rank left waiting (at its gate, for a phase) when something failed
            if p.poll() is None:
                p.kill()
                p.wait()
        c.stop()
    disp = [max(v[1] for v in ps) - max(v[0] for v in ps) for s, ps in sorted(pairs.items()) if s > 0]
    comb = [max(v[3] for v in ps) - max(v[2] for v in ps) for s, ps in sorted(pairs.items()) if s > 0]
    res["ms"] = {"dispatch": statistics.median(disp) / 1e6, "combine": statistics.median(comb) / 1e6}
    res["pairs"], res["calls"], res["cpu_read"] = pairs, calls, (cpu0, cpu_g, cpu1)
    res["sms"] = budgets
    phases = 2 * steps
    timed = 2 * (steps - 1)  # the CPU is read from the end of step 0 on
    res["cpu"] = [((b[0] - a[0]) / timed, (b[1] - a[1]) / timed) for a, b in zip(cpu0, cpu1)]
    # Records node n sends per phase (the same count each way for dispatch and combine), and
    # so the bytes per kind per rail: dispatch records are `rec` bytes, combine 16 + row. (The
    # barrier pairs send nothing.)
    crec = 16 + ((hidden * 2 + 15) & ~15)
    res["bytes"] = {}
    for kind, size in (("dispatch", rec), ("combine", crec)):
        res["bytes"][kind] = [[recs // phases * size for _, recs in rails[n]] for n in range(2)]
    res["rails"] = c.cfg["nodes"]
    if trace:
        res["split"] = trace_split(trace_dir, steps)
        res["trace_dir"] = trace_dir
    return res


def tcp_ceiling(nodes_cfg, per_rail, per_node):
    """Seconds for plain TCP to move per_rail[n][r] bytes from node n to the other node on rail
    r, every (node, rail) at once, each on its own connection between the rails' addresses.
    per_node False: a thread per connection end (all the cores the machine has); True: one
    thread per node multiplexing its sends and receives (one core per node, as a daemon's loop)."""
    conns = []  # (node that sends, sending socket, receiving socket, bytes)
    for n in range(2):
        for r, nbytes in enumerate(per_rail[n]):
            srv = socket.socket()
            srv.bind((nodes_cfg[1 - n]["rails"][r]["address"], 0))
            srv.listen(1)
            s = socket.socket()
            s.bind((nodes_cfg[n]["rails"][r]["address"], 0))
            s.connect(srv.getsockname())
            conn, _ = srv.accept()
            srv.close()
            conns.append((n, s, conn, nbytes))
    out = memoryview(bytearray(8 << 20))
    done = []

    def pump(ends):
        """Move every (socket, direction, bytes) of `ends` to completion, multiplexed."""
        sel = selectors.DefaultSelector()
        for sock, send, nbytes in ends:
            if nbytes:
                sock.setblocking(False)
                sel.register(sock, selectors.EVENT_WRITE if send else selectors.EVENT_READ,
                             [send, nbytes])
        buf = memoryview(bytearray(8 << 20))
        while sel.get_map():
            for key, _ in sel.select():
                send, left = key.data
                try:
                    k = (key.fileobj.send(out[:min(len(out), left)]) if send else
                         key.fileobj.recv_into(buf[:min(len(buf), left)]))
                except BlockingIOError:
                    continue
                key.data[1] -= k
                if key.data[1] == 0 or (not send and k == 0):
                    sel.unregister(key.fileobj)
                    if not send:
                        done.append(time.monotonic())

    def blocking(sock, send, nbytes):
        """One connection end in blocking calls (the GIL is released for each whole copy)."""
        buf = memoryview(bytearray(8 << 20))
        while nbytes:
            k = min(len(buf), nbytes)
            if send:
                sock.sendall(out[:k])
            else:
                k = sock.recv_into(buf[:k])
                if not k:
                    break
            nbytes -= k
        if not send:
            done.append(time.monotonic())

    if per_node:
        groups = [[(s, True, b) for m, s, _, b in conns if m == n] +
                  [(c, False, b) for m, _, c, b in conns if m != n] for n in range(2)]
        threads = [threading.Thread(target=pump, args=(g,)) for g in groups]
    else:
        ends = [(s, True, b) for _, s, _, b in conns] + [(c, False, b) for _, _, c, b in conns]
        threads = [threading.Thread(target=blocking, args=e) for e in ends]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, s, c, _ in conns:
        s.close()
        c.close()
    return (max(done) if done else t0) - t0


# --suite rank ------------------------------------------------------------------------------
MATMUL_N = 8192  # the trainer's compute: bf16 N x N x N products, 2 N^3 flops each
# steps per segment (alone, beside) by tokens per rank: more where a step is short
SEGMENT_STEPS = {1: 16, 128: 16, 512: 10, 4096: 6}
TARGETS_US = {1: 150, 128: 250}  # p50 of each kind alone on tcp loopback


def matmul_loop(folder):
    """The trainer's compute (another process: `gpu_path --matmul-loop FOLDER`, under MPS when
    the suite runs it): while FOLDER/on exists, one product after another, each followed by a
    synchronize, its [start, end] on CLOCK_MONOTONIC kept; FOLDER/running exists while it runs
    (made after the first product of a run); at the end of each run the products are appended
    to FOLDER/batches ("START_NS END_NS" lines). FOLDER/stop ends it."""
    import torch
    n = MATMUL_N
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    on, run, stop = (os.path.join(folder, x) for x in ("on", "running", "stop"))
    open(os.path.join(folder, "ready"), "w").close()
    done = []
    while not os.path.exists(stop):
        if not os.path.exists(on):
            if done:
                with open(os.path.join(folder, "batches"), "a") as f:
                    f.writelines("%d %d\n" % x for x in done)
                done = []
                os.unlink(run)
            time.sleep(0.0005)
            continue
        t0 = time.monotonic_ns()
        torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        done.append((t0, time.monotonic_ns()))
        if len(done) == 1:
            open(run, "w").close()
    return 0


class Matmul:
    """The matmul loop, started once, switched on and off by its files."""

    def __init__(self, tmp, env):
        self.dir = os.path.join(tmp, "matmul")
        os.makedirs(self.dir)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--matmul-loop",
                                      self.dir], env=env)
        self.wait_for(lambda: os.path.exists(os.path.join(self.dir, "ready")), 180, "ready")
        self.read = 0

    def wait_for(self, cond, secs, what):
        end = time.monotonic() + secs
        while not cond():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("matmul loop: not %s (rc %s)" % (what, self.proc.poll()))
            time.sleep(0.0005)

    def on(self):
        open(os.path.join(self.dir, "on"), "w").close()
        self.wait_for(lambda: os.path.exists(os.path.join(self.dir, "running")), 60, "running")

    def off(self):
        """Stop it; the products of that run, [(start_ns, end_ns)]."""
        os.unlink(os.path.join(self.dir, "on"))
        self.wait_for(lambda: not os.path.exists(os.path.join(self.dir, "running")), 60, "stopped")
        with open(os.path.join(self.dir, "batches")) as f:
            f.seek(self.read)
            text = f.read()
            self.read = f.tell()
        return [tuple(int(x) for x in l.split()) for l in text.splitlines() if l.strip()]

    def stop(self):
        open(os.path.join(self.dir, "stop"), "w").close()
        self.proc.wait(timeout=60)


def tflops(batches, spans=None):
    """TFLOP/s of the products that overlap one of spans [(start_ns, end_ns)] (all if None):
    their flops over their own time (the loop's rate while those phases ran)."""
    sel = batches if spans is None else [
        (a, b) for a, b in batches if any(a < y and b > x for x, y in spans)]
    t = sum(b - a for a, b in sel)
    return (len(sel) * 2 * MATMUL_N ** 3 / t / 1e3 if t else None), len(sel)


def mps_start(tmp, want):
    """The MPS control daemon with its pipe and log folders in tmp: (the clients' environment,
    the daemons' environment, the control program), or (None, None, None) without it."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if want == "off" or not ctl:
        if want == "on":
            raise RuntimeError("--mps on: no nvidia-cuda-mps-control on PATH")
        return None, None, None
    pipe, log, none = (os.path.join(tmp, x) for x in ("mps-pipe", "mps-log", "no-mps"))
    for d in (pipe, log, none):
        os.makedirs(d)
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
    subprocess.run([ctl, "-d"], env=dict(os.environ, **env), check=True)
    # The daemons look for a control daemon in a folder where none runs: their own contexts.
    return env, {"CUDA_MPS_PIPE_DIRECTORY": none, "CUDA_MPS_LOG_DIRECTORY": none}, ctl


def pct(v, q):
    v = sorted(v)
    return v[max(0, -(-len(v) * q // 100) - 1)] if v else None


def cell_label(res, step, mode):
    """A step's cell besides its segment: the CUDA mover's `-`; the rank path's stream priority
    (--priority both: odd steps high), with its SM budget where --sms set one (0: none)."""
    if mode != "rank":
        return "-"
    prio = "high" if step & 1 else "normal"
    return prio if step not in res.get("sms", {}) else "%s,sms=%d" % (prio, res["sms"][step])


def cells(res, S, mode):
    """Per (segment, cell label) of one run: the steps, p50 ms of each kind, host ns per call
    p50/p99 of each kind, and the phases' spans (for the matmul loop's rate)."""
    out = {}
    for seg, steps in (("alone", range(1, S + 1)), ("beside", range(S + 1, 2 * S + 1))):
        for prio in sorted({cell_label(res, x, mode) for x in steps}):
            st = [x for x in steps if cell_label(res, x, mode) == prio]
            ps = [res["pairs"][x] for x in st]
            cl = [c for x in st for c in res["calls"].get(x, [])]
            out[seg, prio] = {
                "n": len(st),
                "d": statistics.median(max(v[1] for v in p) - max(v[0] for v in p) for p in ps) / 1e6,
                "c": statistics.median(max(v[3] for v in p) - max(v[2] for v in p) for p in ps) / 1e6,
                "dns": (pct([c[0] for c in cl], 50), pct([c[0] for c in cl], 99)),
                "cns": (pct([c[1] for c in cl], 50), pct([c[1] for c in cl], 99)),
                "spans": [(min(v[0] for v in p), max(v[1] for v in p)) for p in ps] +
                         [(min(v[2] for v in p), max(v[3] for v in p)) for p in ps],
                "steps": set(st)}
    return out


def daemon_cpu(res, S):
    """Daemon CPU ms per timed phase (user, system; the larger daemon) alone and beside."""
    c0, cg, c1 = res["cpu_read"]
    out = {}
    for seg, a, b in (("alone", c0, cg), ("beside", cg, c1)):
        out[seg] = tuple(max((y[i] - x[i]) * 1e3 / (2 * S) for x, y in zip(a, b)) for i in (0, 1))
    return out


def suite(a):
    modes = (("old", "cuda"), ("new", "rank"))
    print("== rank path vs CUDA mover: 2 railwaved (tcp loopback, R=%d), %d CUDA ranks per node on "
          "one GPU, bf16, joint path, --barrier; ms = p50 of last submission -> last completion "
          "(the rank path: done word seen, then cuStreamSynchronize); steps: warm-up, S alone, S "
          "beside a bf16 %d^3 matmul loop; new: even steps default stream priority, odd the "
          "greatest" % (RAILS, GPUS, MATMUL_N))
    rows = []
    # `timeout` sends SIGTERM: unwind, so the daemons stop and the MPS control daemon quits.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="rwrp.", dir="/tmp") as tmp:
        cli_env, dmn_env, ctl = mps_start(tmp, a.mps)
        print("# MPS: %s" % ("ranks and matmul loop are clients (%s), daemons outside" % ctl
                             if ctl else "off (every process a context of its own)"))
        fake = os.environ.get("RW_BENCH_FAKE_CUDA")  # CI: the kernel stand-in, no matmul loop
        mm = None
        try:
            if not fake:
                mm_env = dict(os.environ, **(cli_env or {}))
                if a.matmul_sm_pct:  # the trainer's compute leaves the other SMs to the ranks
                    if not ctl:
                        raise RuntimeError("--matmul-sm-pct needs MPS (its clients' SM share)")
                    mm_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(a.matmul_sm_pct)
                    print("# matmul loop: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%d (its share of "
                          "the SMs; the ranks' kernels take the rest)" % a.matmul_sm_pct)
                mm = Matmul(tmp, mm_env)
                mm.on()
                time.sleep(2)
                alone = mm.off()
                print("# matmul loop alone: %.1f TFLOP/s (%d products)" % tflops(alone))
            smi, failed, t_start = [], 0, time.monotonic()
            for tokens in [int(t) for t in a.tokens.split(",")]:
                for shape in a.shapes.split(","):
                    S0 = SEGMENT_STEPS.get(tokens, 6) if not fake else 2
                    for name, mode in modes:
                        # every (priority, budget) cell gets the steps a priority gets alone
                        S = S0 * (len(a.sms.split(",")) if a.sms and mode == "rank" else 1)
                        if a.budget_s and time.monotonic() - t_start > a.budget_s:
                            print("# %s T=%d %s: skipped (past --budget-s %d)" % (
                                shape, tokens, name, a.budget_s))
                            continue

                        def beside():
                            if mm:
                                mm.on()
                            if mm and not smi and shutil.which("nvidia-smi"):
                                smi.append(subprocess.run(["nvidia-smi"], capture_output=True,
                                                          text=True).stdout)
                        try:
                            res = run_daemons(tmp, mode, cluster.DAEMON, shape, tokens, 2 * S + 1,
                                              a.seed, a.trace, rank_env=cli_env,
                                              daemon_env=dmn_env, gate=(S + 1, beside), fake=fake,
                                              sms=a.sms)
                        except Exception as e:  # the other cells still run
                            failed += 1
                            print("# FAILED %s T=%d %s: %s" % (shape, tokens, name, str(e)[-3000:]))
                            if mm and os.path.exists(os.path.join(mm.dir, "on")):
                                mm.off()
                            continue
                        finally:
                            sys.stdout.flush()
                        batches = mm.off() if mm else []
                        report(a, res, S, mode, shape, tokens, name, batches, rows)
            if mm:
                mm.on()
                time.sleep(2)
                end = mm.off()
                print("# matmul loop alone again at the end: %.1f TFLOP/s (%d products)" %
                      tflops(end))
                alone += end
            for text in smi:
                print("# nvidia-smi during the first beside segment:")
                print("\n".join("#   " + l for l in text.splitlines()))
        finally:
            if mm:
                mm.stop()
            if ctl:
                subprocess.run([ctl], input=b"quit\n", env=dict(os.environ, **cli_env))
    targets(rows, tflops(alone)[0] if mm else None)
    if failed:
        print("%d cluster run(s) failed" % failed)
    return 1 if failed else 0


def report(a, res, S, mode, shape, tokens, name, batches, rows):
    """One cluster's cells printed (and kept in rows for the targets)."""
    cs = cells(res, S, mode)
    for (seg, prio), v in sorted(cs.items()):
        mmr = tflops(batches, v["spans"]) if seg == "beside" and batches else (None, 0)
        rows.append((shape, tokens, name, seg, prio, v, mmr))
        print_row(rows[-1])
    cpu = daemon_cpu(res, S)
    print("# %s T=%d %s daemon cpu ms per phase (usr/sys, larger daemon): alone %.3f/%.3f, "
          "beside %.3f/%.3f; matmul beside (whole segment) %s TFLOP/s" % (
              shape, tokens, name, cpu["alone"][0], cpu["alone"][1], cpu["beside"][0],
              cpu["beside"][1], "%.1f" % tflops(batches)[0] if batches else "-"))
    for (seg, prio), v in sorted(cs.items()) if a.trace else ():
        for kind, x in sorted(trace_split(res["trace_dir"], 2 * S + 1, v["steps"]).items()):
            print("# split %s T=%d %s %s %s %-8s ms after the last submission: staged %s, "
                  "decided %s, running %s, first post %s, last post %s, last write done %s, "
                  "last range in %s, done %s" % ((shape, tokens, name, seg, prio, kind) + tuple(
                      "-" if y is None else "%.2f" % y for y in x)))
    sys.stdout.flush()


def print_row(r):
    shape, tokens, name, seg, prio, v, mmr = r
    print("%-8s %5d %-3s %-6s %-6s n=%-2d dispatch %8.3f ms combine %8.3f ms  host ns p50/p99 "
          "dispatch %s/%s combine %s/%s  matmul %s" % (
              shape, tokens, name, seg, prio, v["n"], v["d"], v["c"], v["dns"][0], v["dns"][1],
              v["cns"][0], v["cns"][1],
              "%.1f TFLOP/s (%d products)" % mmr if mmr[0] else "-"))


def targets(rows, base):
    """The issue's targets against this run's cells (docs/perf/rankpath.md)."""
    at = {(r[0], r[1], r[2], r[3], r[4]): r for r in rows}
    print("== targets (new = rank path, default priority and no SM budget unless named)")

    def say(what, got, ok):
        print("%-7s %s: %s" % ("met" if ok else "MISSED", what, got))
    for (shape, tokens, name, seg, prio), r in sorted(at.items()):
        # the base cell: the default priority, no budget (or the first of --sms)
        bases = sorted(k[4] for k in at if k[:4] == (shape, tokens, "new", "alone") and
                       k[4].split(",")[0] == "normal")
        if name != "new" or seg != "alone" or not bases or prio != bases[0]:
            continue
        labels = sorted(k[4] for k in at if k[:4] == (shape, tokens, "new", "alone"))
        v = r[5]
        old = at.get((shape, tokens, "old", "alone", "-"))
        if tokens in TARGETS_US:
            lim = TARGETS_US[tokens] / 1e3
            say("%s T=%d alone p50 <= %d us" % (shape, tokens, TARGETS_US[tokens]),
                "dispatch %.0f us, combine %.0f us" % (v["d"] * 1e3, v["c"] * 1e3),
                v["d"] <= lim and v["c"] <= lim)
        if old:
            ov = old[5]
            print("        %s T=%d new/old alone: dispatch %.2fx, combine %.2fx" % (
                shape, tokens, v["d"] / ov["d"], v["c"] / ov["c"]))
            if tokens >= 4096:
                say("%s T=%d no slower than the CUDA mover alone" % (shape, tokens),
                    "dispatch %.2f vs %.2f ms, combine %.2f vs %.2f ms" % (
                        v["d"], ov["d"], v["c"], ov["c"]), v["d"] <= ov["d"] and v["c"] <= ov["c"])
        for prio2 in labels:
            b = at.get((shape, tokens, "new", "beside", prio2))
            al = at.get((shape, tokens, "new", "alone", prio2))
            if not b or not al:
                continue
            bv, av = b[5], al[5]
            say("%s T=%d beside within 1.2x of alone (%s priority)" % (shape, tokens, prio2),
                "dispatch %.2fx, combine %.2fx" % (bv["d"] / av["d"], bv["c"] / av["c"]),
                bv["d"] <= 1.2 * av["d"] and bv["c"] <= 1.2 * av["c"])
            if base and b[6][0]:
                say("%s T=%d matmul keeps >= 95%% beside (%s priority)" % (shape, tokens, prio2),
                    "%.1f of %.1f TFLOP/s = %.1f%%" % (b[6][0], base, 100 * b[6][0] / base),
                    b[6][0] >= 0.95 * base)
        for prio2 in labels:
            al = at.get((shape, tokens, "new", "alone", prio2))
            if al and al[5]["dns"][1] is not None:
                x = al[5]
                say("%s T=%d host time per call <= 10 us in C (%s priority)" % (
                    shape, tokens, prio2), "dispatch p50 %d p99 %d ns, combine p50 %d p99 %d ns" % (
                        x["dns"] + x["cns"]), x["dns"][1] <= 10000 and x["cns"][1] <= 10000)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek,glm,deepseek-h1024")
    ap.add_argument("--tokens", default="512,1024,2048,4096")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", default="staging,cuda")
    ap.add_argument("--alt", action="append", default=[], help="NAME=PATH: another railwaved")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--trace", action="store_true",
                    help="phase traces on: print where each daemon's phase time goes")
    ap.add_argument("--suite", choices=["rank"], help="rank: the rank path's benchmark")
    ap.add_argument("--mps", choices=["auto", "on", "off"], default="auto",
                    help="--suite rank: ranks and matmul loop as MPS clients (auto: if found)")
    ap.add_argument("--sms", metavar="LIST",
                    help="--suite rank: the rank path's SM budgets in turn, crossed with the "
                         "stream priorities (0: none; e.g. 0,8,16,32)")
    ap.add_argument("--matmul-sm-pct", type=int, default=0,
                    help="--suite rank, MPS: the matmul loop's share of the SMs in percent "
                         "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), the trainer's SM budget for "
                         "its compute; 0: all")
    ap.add_argument("--budget-s", type=int, default=0,
                    help="--suite rank: start no cluster run after this many seconds")
    ap.add_argument("--matmul-loop", metavar="FOLDER", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.matmul_loop:
        return matmul_loop(a.matmul_loop)
    if a.suite:
        if "--shapes" not in sys.argv:
            a.shapes = "deepseek,glm"
        if "--tokens" not in sys.argv:
            a.tokens = "1,128,512,4096"
        return suite(a)
    modes = [(m, cluster.DAEMON) for m in a.modes.split(",")]
    modes += [tuple(x.split("=", 1)) for x in a.alt]
    print("== 2 railwaved (tcp loopback, R=2), %d CUDA ranks per node on one GPU, bf16, joint "
          "path, %d steps (median of steps 1..%d); ms = last submission to last completion"
          % (GPUS, a.steps, a.steps - 1))
    print("%-14s %5s %-8s %-14s %8s %8s %7s %9s %9s %7s" % (
        "shape", "tok/r", "kind", "mover", "MB/dir", "ms", "GB/s", "cpu usr/s", "cpu sys/s",
        "x tcp"))
    with tempfile.TemporaryDirectory(prefix="rwgp.", dir="/tmp") as tmp:
        for shape in a.shapes.split(","):
            for tokens in [int(t) for t in a.tokens.split(",")]:
                got = {}
                for name, daemon in modes:
                    got[name] = run_daemons(tmp, name if name in ("staging", "rank") else "cuda",
                                            daemon, shape, tokens, a.steps, a.seed, a.trace)
                    if name not in ("staging", "rank") and \
                            "kernels loaded on device" not in got[name]["log"]:
                        raise RuntimeError("%s: the CUDA mover did not carry the pairs" % name)
                print("# %s T=%d count rows gpu/host per node: %s" % (shape, tokens, ", ".join(
                    "%s %s" % (n, " ".join("%d/%d" % gh for gh in g["counted"]))
                    for n, g in got.items())))
                ref = got[modes[-1][0]]
                for kind in ("dispatch", "combine"):
                    per_rail = ref["bytes"][kind]
                    ceil_ms = tcp_ceiling(ref["rails"], per_rail, False) * 1e3
                    one_ms = tcp_ceiling(ref["rails"], per_rail, True) * 1e3
                    mb = max(sum(r) for r in per_rail) / 1e6
                    rows = [(n, g["ms"][kind], g["cpu"]) for n, g in got.items()]
                    rows += [("tcp ceiling", ceil_ms, None), ("tcp 1 thr/node", one_ms, None)]
                    for n, ms, cpu in rows:
                        cu = "%9.4f %9.4f" % (max(c[0] for c in cpu), max(c[1] for c in cpu)) \
                            if cpu else "%9s %9s" % ("-", "-")
                        print("%-14s %5d %-8s %-14s %8.1f %8.2f %7.2f %s %7.2f" % (
                            shape, tokens, kind, n, mb, ms, mb / ms if ms > 0 else 0, cu,
                            ms / ceil_ms if ceil_ms > 0 else 0))
                    sys.stdout.flush()
                for n, g in got.items():
                    for kind, v in sorted(g.get("split", {}).items()):
                        print("# split %-8s %-8s ms after the last submission: staged %s, "
                              "decided %s, running %s, first post %s, last post %s, last write "
                              "done %s, last range in %s, done %s" % ((n, kind) + tuple(
                                  "-" if x is None else "%.2f" % x for x in v)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
