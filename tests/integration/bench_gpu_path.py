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

  python3 bench_gpu_path.py [--shapes deepseek,glm,deepseek-h1024] [--tokens 512,1024,2048,4096]
                            [--steps 4] [--modes staging,cuda] [--alt NAME=PATH] [--trace]
  (run from the build directory's bench/ copy: $b/bench/gpu_path)"""
import argparse
import json
import os
import selectors
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
SHAPES = {"deepseek": (7168, 256, 8), "glm": (4096, 128, 8), "deepseek-h1024": (1024, 256, 8)}
GPUS = 4


def cpu_times(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def rail_counters(c, n):
    """(tx_bytes, tx_records) per rail of node n."""
    return [(int(r["tx_bytes"]), int(r["tx_records"])) for r in c.rail_stats(n)]


def trace_split(trace_dir, steps):
    """Where a phase's time goes, from the daemons' phase traces (docs/service.md "Phase
    traces"): per kind, the median over steps 1.. and both nodes of each milestone in ms after
    the node's last local submission: inputs staged, path decided (count rows exchanged), first
    and last write posted, last write done, last range complete, kind done here."""
    recs = []
    for f in sorted(os.listdir(trace_dir)):
        with open(os.path.join(trace_dir, f)) as fh:
            recs += [json.loads(l) for l in fh if l.strip()]
    out = {}
    for kind in ("dispatch", "combine"):
        rows = []
        for r in recs:
            if r.get("kind") != kind or r.get("step", 0) < 1 or r.get("status") != "ok":
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


def run_daemons(tmp, mode, daemon, shape, tokens, steps, seed, trace=False):
    hidden, experts, topk = SHAPES[shape]
    rec = ((16 + topk * 8 + 15) & ~15) + ((hidden * 2 + 15) & ~15)
    recv_mib = 64 + 6 * GPUS * tokens * rec // (1 << 20)
    # The staging mover's copies hold the loop for a second or more at the largest sizes: longer
    # heartbeats, so that is measured rather than a peer declared down.
    extra = {"recv_region_mib": recv_mib, "phase_timeout_ms": 60000, "heartbeat_timeout_ms": 10000}
    trace_dir = os.path.join(tmp, "trace-%s-%s-%d" % (mode, shape, tokens))
    if trace:
        os.makedirs(trace_dir, exist_ok=True)
        extra["trace_dir"] = trace_dir
    c = cluster.Cluster(tmp, 2, path="joint", extra=extra, gpus=GPUS, daemon=daemon)
    if mode == "staging":
        c.env["RAILWAVE_CUDA_MOVER"] = "0"
    else:
        c.env.pop("RAILWAVE_CUDA_MOVER", None)
    c.start_all()
    res = {}
    try:
        wl = ["--nodes", "2", "--gpus", str(GPUS), "--rails", "2", "--experts", str(experts),
              "--topk", str(topk), "--hidden", str(hidden), "--tokens", str(tokens),
              "--seed", str(seed)]
        procs = []
        for r in range(2 * GPUS):
            sock = c.cfg["nodes"][r // GPUS]["ipc_socket"]
            procs.append(subprocess.Popen(
                [RANK, "--socket", sock, "--group", "bench", "--rank", str(r), "--steps", str(steps),
                 "--cuda"] + wl, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=c.env))
        outs = [[] for _ in procs]

        def reader(i, p):
            for line in p.stdout:
                outs[i].append(line.decode())

        readers = [threading.Thread(target=reader, args=(i, p)) for i, p in enumerate(procs)]
        for t in readers:
            t.start()
        cpu0 = None  # once every rank printed its step 0: the warm-up is over
        deadline = time.monotonic() + 600
        while any(t.is_alive() for t in readers) and time.monotonic() < deadline:
            if cpu0 is None and all(any(l.startswith("pair 0 ") for l in o) for o in outs):
                cpu0 = [cpu_times(c.procs[n].pid) for n in range(2)]
            time.sleep(0.002)
        pairs = {}
        for r, p in enumerate(procs):
            p.wait(timeout=60)
            out = "".join(outs[r])
            if p.returncode != 0 or "(CUDA buffer)" not in out:
                raise RuntimeError("%s %s T=%d rank %d rc %s: %s\n%s" % (
                    mode, shape, tokens, r, p.returncode, out[-2000:], c.logs()))
            for line in out.splitlines():
                f = line.split()
                if f[:1] == ["pair"]:
                    pairs.setdefault(int(f[1]), []).append([int(x) for x in f[2:6]])
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
        c.stop()
    disp = [max(v[1] for v in ps) - max(v[0] for v in ps) for s, ps in sorted(pairs.items()) if s > 0]
    comb = [max(v[3] for v in ps) - max(v[2] for v in ps) for s, ps in sorted(pairs.items()) if s > 0]
    res["ms"] = {"dispatch": statistics.median(disp) / 1e6, "combine": statistics.median(comb) / 1e6}
    phases = 2 * steps
    timed = 2 * (steps - 1)  # the CPU is read from the end of step 0 on
    res["cpu"] = [((b[0] - a[0]) / timed, (b[1] - a[1]) / timed) for a, b in zip(cpu0, cpu1)]
    # Records node n sends per phase (the same count each way for dispatch and combine), and
    # so the bytes per kind per rail: dispatch records are `rec` bytes, combine 16 + row.
    crec = 16 + ((hidden * 2 + 15) & ~15)
    res["bytes"] = {}
    for kind, size in (("dispatch", rec), ("combine", crec)):
        res["bytes"][kind] = [[recs // phases * size for _, recs in rails[n]] for n in range(2)]
    res["rails"] = c.cfg["nodes"]
    if trace:
        res["split"] = trace_split(trace_dir, steps)
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
    a = ap.parse_args()
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
                    got[name] = run_daemons(tmp, "staging" if name == "staging" else "cuda",
                                            daemon, shape, tokens, a.steps, a.seed, a.trace)
                    if name != "staging" and "kernels loaded on device" not in got[name]["log"]:
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
