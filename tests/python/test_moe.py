#!/usr/bin/env python3
"""The railwave Python package against real daemons (docs/python.md "Tests"): 2–3 railwaved on
loopback (tests/lib/cluster.py's Cluster), 2 rank processes per node started
torchrun-style (tests/python/moe_rank.py). A MoE layer runs forward and backward through
RailWave on every forced path and the selector; outputs and gradients must equal the same layer
computed in one process (exactly for fp32 integer-valued data, within the stated tolerance for
bf16 and for a softmax router). Then bad input — wrong dtype, non-contiguous tensors, expert ids
out of range, num_experts that differ, bad combines, a join with the wrong world size or node —
must raise a clear error on the rank that made it and fail the phase at once for the others,
with the next step verifying exactly. A daemon killed between steps: its ranks get DaemonLost,
the others PhaseError; after its restart every rank joins again and a step verifies. Daemons must exit 0 on SIGTERM (ASan: no leak).
`cuda` runs the paths scenario with CUDA tensors (skipped without a GPU), and with `stream` also
in stream-ordered mode (Group(stream_ordered=True): no host synchronization before a submission;
the event and the flag of docs/python.md "Stream order").
`rank` runs the paths scenario on librailwave's rank path (docs/python.md "The rank path": the
kernels in the rank's process on its stream, the daemons lending pages and group slabs), `rankbad`
the bad-input scenario there, and `rankkill` kills a rank whose peers wait in their combine:
without a GPU on the kernel stand-in driver (tests/integration/libfakecuda_kern.so, CPU tensors
standing for device memory: RAILWAVE_TEST_HOST_AS_DEVICE), with RW_PY_RANK_DEVICE=cuda on a GPU
with CUDA tensors; skipped where the build has no stand-in (no nvcc: no rank kernels).

Run by tests/run as $b/test/python_moe (a wrapper ninja writes: test_moe.py BUILDDIR);
RW_PY_ONLY=paths,bad,peer,cuda,stream,rank,rankbad,rankstatic,rankstaticbad,rankkill picks
scenarios (rankstatic: the static mode, and on a GPU its CUDA graph; rankbad, the bad-input
cases on the rank path; rankstaticbad, a bad argument on one rank of a static Group).
RW_PY_WAIT bounds each wait for a rank
(default 300 s). Exits 0 pass, 1 fail, 77 skip."""
import json
import os
import select
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
# bound on any wait for a rank (never a pass/fail timing criterion)
WAIT = float(os.environ.get("RW_PY_WAIT", "300"))
# Phase timeout of every cluster here: far above any phase, so that ranks drifting apart on a
# loaded machine (each computes the single-process reference between steps) never hit it, and
# a rank left waiting for it instead of failing at once shows (moe_rank.py's expect()).
PHASE_TIMEOUT = {"phase_timeout_ms": 60000}


def load_cluster(build):
    """tests/lib/cluster.py as the build copied it ($b/tests/lib): its binaries are that build's."""
    sys.path.insert(0, os.path.join(build, "tests", "lib"))
    import cluster
    return cluster


class Ranks:
    """W long-lived rank processes (torch is imported once per process, not per scenario), each
    running SCRIPT (a subclass names another rank program)."""

    SCRIPT = os.path.join(HERE, "moe_rank.py")

    def __init__(self, world, per_node, env):
        self.procs, self.part = [], {}  # part: each rank's output past its last newline
        for r in range(world):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % per_node),
                     LOCAL_WORLD_SIZE=str(per_node))
            self.procs.append(subprocess.Popen(
                [sys.executable, self.SCRIPT], env=e, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))

    def run(self, cmd, ranks=None):
        ranks = range(len(self.procs)) if ranks is None else ranks
        for r in ranks:
            self.procs[r].stdin.write(json.dumps(cmd) + "\n")
            self.procs[r].stdin.flush()
        out, deadline = {}, time.time() + WAIT
        # Raw reads, lines split here: a buffered readline() after select() can pull the answer
        # into Python's buffer together with a line of noise before it, and select() then never
        # reports it (the rank waits for its next command, this loop for its answer).
        pending = {self.procs[r].stdout.fileno(): r for r in ranks}
        noise = {r: [] for r in ranks}
        while pending and time.time() < deadline:
            ready, _, _ = select.select(list(pending), [], [], 1.0)
            for fd in ready:
                r = pending[fd]
                data = os.read(fd, 1 << 16)
                if not data:
                    out[r] = {"ok": False, "error": "rank exited: " + "".join(noise[r][-20:])}
                    del pending[fd]
                    continue
                *lines, self.part[r] = (self.part.get(r, b"") + data).split(b"\n")
                for line in (l.decode(errors="replace") + "\n" for l in lines):
                    if r in out:
                        noise[r].append(line)
                    elif line.startswith("{"):
                        out[r] = json.loads(line)
                        del pending[fd]
                        if not out[r]["ok"] and noise[r]:  # what it printed (PyTorch's warnings)
                            out[r]["error"] += "\n  (its output before: %s)" % "".join(
                                noise[r][-4:]).strip()[-600:]
                    else:
                        noise[r].append(line)
        for r in pending.values():
            out[r] = {"ok": False, "error": "no answer in %.0f s (hang?)" % WAIT}
        return out

    def stop(self):
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def check(outs, what, cluster):
    """outs when every rank answered ok, else RuntimeError: the daemons' last log lines, then
    the first failing rank's error in full and the others' first lines (the end of the output
    is what a GPU run keeps)."""
    bad = [(r, o["error"]) for r, o in sorted(outs.items()) if not o["ok"]]
    if bad:
        errs = ["rank %d: %s" % bad[0]] + ["rank %d: %s" % (r, (e.splitlines() or [""])[0][:400])
                                            for r, e in bad[1:]]
        raise RuntimeError("%s:\n%s\n%s" % (what, cluster.logs(), "\n".join(errs)))
    return outs


# The daemons of the rank path's scenarios lend each group carve-outs (docs/rankpath.md "The slab
# areas, lent per group"): without them a rank path opens with no slabs and is not used.
CARVE = dict(PHASE_TIMEOUT, group_area_mib=1, group_pool_mib=16)


def scenario_paths(cluster, tmp, ranks, nodes, seed, device="cpu", stream_ordered=False,
                   rank_path=False):
    for i, path in enumerate(["native", "rail-only", "perm-only", "joint", "auto"]):
        c = cluster.Cluster(tmp, nodes, path=path, extra=CARVE if rank_path else PHASE_TIMEOUT)
        try:
            c.start_all()
            sockets = [n["ipc_socket"] for n in c.cfg["nodes"]]
            outs = check(ranks.run({"op": "paths", "socket": None, "group": "py." + path,
                                    "experts": nodes * cluster.GPUS * 2, "steps": 3,
                                    "seed": seed + i, "router": path == "auto",
                                    "device": device, "sockets": sockets,
                                    "stream_ordered": stream_ordered,
                                    "rank_path": rank_path,
                                    "max_tokens": 13}),  # moe_rank.workload's most
                         "path " + path, c)
            if rank_path:  # flood's room cases are the ring path's (the rank path: "bad")
                print("ok   rank path %-9s N=%d W=%d: %s" % (path, nodes, nodes * cluster.GPUS,
                                                           "; ".join(outs[0]["log"])))
                continue
            flood = check(ranks.run({"op": "flood", "group": "py.flood." + path,
                                     "experts": nodes * cluster.GPUS * 2, "seed": seed + i,
                                     "device": device, "sockets": sockets,
                                     "stream_ordered": stream_ordered}),
                          "flood " + path, c)
            st = c.stats(0, "stats selector")
            if path != "auto" and path not in st:
                raise RuntimeError("selector stats do not show the forced path %s:\n%s"
                                   % (path, st))
        finally:
            c.stop()
        dv = device + (" stream-ordered" if stream_ordered else "")
        print("ok   %s path %-9s N=%d W=%d: %s" % (dv, path, nodes, nodes * cluster.GPUS,
                                                   "; ".join(outs[0]["log"])))
        print("ok   %s path %-9s flood: %s" % (dv, path, "; ".join(flood[1]["log"])))


def scenario_bad(cluster, tmp, ranks, nodes, seed, rank_path=False):
    c = cluster.Cluster(tmp, nodes, path="auto", extra=CARVE if rank_path else PHASE_TIMEOUT)
    try:
        c.start_all()
        outs = check(ranks.run({"op": "bad", "group": "py.bad", "experts": nodes * cluster.GPUS * 2,
                                "seed": seed, "rank_path": rank_path, "sockets": [
                                    n["ipc_socket"] for n in c.cfg["nodes"]]}), "bad input", c)
    finally:
        c.stop()
    how = "rank path " if rank_path else ""
    for line in outs[0]["log"]:
        print("ok   %sbad input rank 0: %s" % (how, line))
    for r in sorted(outs)[1:]:
        print("ok   %sbad input rank %d: %d checks (%s)" % (how, r, len(outs[r]["log"]), "; ".join(
            l.split(":")[0] for l in outs[r]["log"] if not l.startswith("peer of"))))


def scenario_static(cluster, tmp, ranks, nodes, seed, device):
    """The rank path's static mode: steps with nothing read back, exact (moe_rank.cmd_static);
    on a GPU also a CUDA graph of the layer replayed 100 times with fresh inputs
    (moe_rank.cmd_graph)."""
    c = cluster.Cluster(tmp, nodes, path="joint", extra=CARVE)
    base = {"group": "py.static", "experts": nodes * cluster.GPUS * 2, "seed": seed,
            "device": device, "rank_path": True, "max_tokens": 13, "steps": 4, "replays": 100,
            "sockets": [n["ipc_socket"] for n in c.cfg["nodes"]]}
    try:
        c.start_all()
        outs = check(ranks.run(dict(base, op="static")), "static mode", c)
        print("ok   rank path static: %s" % outs[0]["log"][0])
        outs = check(ranks.run(dict(base, op="static_train", group="py.static.train")),
                     "static forward + backward", c)
        print("ok   rank path static: %s" % outs[0]["log"][0])
        outs = check(ranks.run(dict(base, op="static_over", group="py.static.over", room=4)),
                     "static overflow", c)
        over = [o["log"][0] for o in outs.values() if "ReceiveRoomExceeded" in o["log"][0]]
        if not over:
            raise AssertionError("static overflow: no rank overflowed a room of 4 rows")
        print("ok   rank path static: %d of %d ranks overflowed, e.g. %s"
              % (len(over), len(outs), over[0]))
        outs = check(ranks.run(dict(base, op="static_sms", group="py.static.sms")),
                     "SM budget", c)
        print("ok   rank path static: %s" % outs[0]["log"][0])
        if device == "cuda":
            outs = check(ranks.run(dict(base, op="graph", group="py.graph")), "CUDA graph", c)
            print("ok   rank path static: %s" % outs[0]["log"][0])
            outs = check(ranks.run(dict(base, op="graph_train", group="py.graph.train")),
                         "CUDA graph with backward", c)
            print("ok   rank path static: %s" % outs[0]["log"][0])
    finally:
        c.stop()


def scenario_static_bad(cluster, tmp, ranks, nodes, seed, device, asan=False):
    """A bad argument on one rank of a static Group: that rank raises it, every other rank's
    check() raises PeerFailed within a budget far below the phase timeout, and the next step
    is equal on every rank (moe_rank.cmd_static_bad)."""
    c = cluster.Cluster(tmp, nodes, path="joint", extra=CARVE)
    base = {"group": "py.static.bad", "experts": nodes * cluster.GPUS * 2, "seed": seed,
            "device": device, "rank_path": True, "max_tokens": 13,
            # an exception raised in a backward is a C++ throw inside torch, which a preloaded
            # ASan runtime aborts on (as rankbad): the release build runs that case
            "backward": not asan, "sockets": [n["ipc_socket"] for n in c.cfg["nodes"]]}
    try:
        c.start_all()
        outs = check(ranks.run(dict(base, op="static_bad")), "static bad argument", c)
    finally:
        c.stop()
    for r in sorted(outs):
        for line in outs[r]["log"]:
            print("ok   rank path static bad input rank %d: %s" % (r, line))


def scenario_rankkill(cluster, tmp, ranks, nodes, seed, device):
    """On the rank path, a rank killed (SIGKILL) after its dispatch while every other rank waits
    in its combine of that pair: each of those gets PeerFailed at once (the daemon fails the
    pair when the rank's connection closes), no stream waits forever, and every daemon exits
    0. Kills the last rank's process: run it last."""
    c = cluster.Cluster(tmp, nodes, path="joint", extra=CARVE)
    world = nodes * cluster.GPUS
    victim, rest = world - 1, list(range(world - 1))
    base = {"group": "py.kill", "experts": world * 2, "seed": seed, "device": device,
            "rank_path": True, "victim": victim,
            "sockets": [n["ipc_socket"] for n in c.cfg["nodes"]]}
    try:
        c.start_all()
        check(ranks.run(dict(base, op="kill_a")), "dispatch, then the others' combines", c)
        p = ranks.procs[victim]
        p.kill()
        p.wait()
        outs = check(ranks.run(dict(base, op="kill_b"), rest), "after the kill", c)
    finally:
        c.stop()
    print("ok   rank path: rank %d killed in its pair: %s" % (victim, outs[0]["log"][0][:200]))


def scenario_peer(cluster, tmp, ranks, nodes, seed):
    """A daemon killed between steps: its ranks get DaemonLost, the others PhaseError (60 s phase
    timeout, so waiting for it would show as a failure); the daemon restarts, every rank joins
    again and a step verifies exactly; every daemon exits 0."""
    c = cluster.Cluster(tmp, nodes, path="joint", extra=PHASE_TIMEOUT)
    dead = nodes - 1
    base = {"group": "py.peer", "experts": nodes * cluster.GPUS * 2, "seed": seed,
            "sockets": [n["ipc_socket"] for n in c.cfg["nodes"]]}
    try:
        c.start_all()
        check(ranks.run(dict(base, op="open")), "step before the loss", c)
        c.kill(dead)
        outs = check(ranks.run(dict(base, op="lost", dead=dead)), "after the loss", c)
        c.start(dead)
        c.wait_mesh()
        check(ranks.run(dict(base, op="recover")), "after the restart", c)
    finally:
        c.stop()
    print("ok   peer: rank 0: %s; rank %d: %s; all rejoined, next step equal" % (
        outs[0]["log"][0], nodes * cluster.GPUS - 1, outs[nodes * cluster.GPUS - 1]["log"][0]))


def main():
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(SRC, "build"))
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skip: no torch for %s (Debian: python3-torch, installed by scripts/setup)"
              % sys.executable)
        return 77
    lib = os.path.join(build, "lib", "librailwave.so.1")
    if not (os.access(os.path.join(build, "railwaved"), os.X_OK) and os.path.exists(lib)):
        print("skip: railwaved or librailwave.so.1 not built in %s" % build)
        return 77
    cluster = load_cluster(build)
    only = [s for s in os.environ.get("RW_PY_ONLY", "paths,bad,peer,cuda,stream,rank,rankbad,"
                                      "rankstatic,rankstaticbad,rankkill").split(",") if s]
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or int(time.time()) % 100000 + 1
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    env = dict(os.environ, RAILWAVE_LIB=lib,
               PYTHONPATH=os.path.join(SRC, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    nodes = 3
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rwpy.", dir="/tmp") as tmp:
        ranks = Ranks(nodes * cluster.GPUS, cluster.GPUS, env)
        try:
            if "paths" in only:
                scenario_paths(cluster, tmp, ranks, nodes, seed)
            if "bad" in only:
                scenario_bad(cluster, tmp, ranks, nodes, seed)
            if "peer" in only:
                scenario_peer(cluster, tmp, ranks, nodes, seed)
        except Exception as e:
            print("FAIL %s" % e)
            return 1
        finally:
            ranks.stop()
        if "cuda" in only or "stream" in only:
            if not torch.cuda.is_available():
                print("skip: cuda scenario: torch sees no CUDA device")
            else:
                cranks = Ranks(nodes * cluster.GPUS, cluster.GPUS, env)
                try:
                    if "cuda" in only:
                        scenario_paths(cluster, tmp, cranks, nodes, seed, device="cuda")
                    if "stream" in only:  # stream order (docs/python.md "Stream order")
                        scenario_paths(cluster, tmp, cranks, nodes, seed, device="cuda",
                                       stream_ordered=True)
                except Exception as e:
                    print("FAIL cuda %s" % e)
                    return 1
                finally:
                    cranks.stop()
        if {"rank", "rankbad", "rankstatic", "rankstaticbad", "rankkill"} & set(only):
            rc = rank_scenarios(cluster, build, tmp, env, nodes, seed, only, torch)
            if rc:
                return rc
    print("python_moe: %.1f s" % (time.time() - t0))
    return 0


def stand_in_env(build, env):
    """env for ranks on librailwave's rank path with the kernel stand-in, CPU tensors standing
    for device memory (the package's test switch), or None after a skip line (no stand-in:
    built with nvcc only)."""
    kern = os.path.join(build, "tests", "integration", "libfakecuda_kern.so")
    if not os.path.exists(kern):
        print("skip: rank scenarios: no kernel stand-in %s (built with nvcc only)" % kern)
        return None
    renv = dict(env, RAILWAVE_RANK_PATH="1", RW_CUDA_DRIVER=kern,
                RAILWAVE_TEST_HOST_AS_DEVICE="1")
    # A sanitizer build's stand-in needs its runtime first in these (unsanitized) pythons.
    asan = [l.split("=>")[1].split()[0] for l in subprocess.run(
        ["ldd", kern], capture_output=True, text=True).stdout.splitlines()
        if "libasan" in l and "=>" in l]
    if asan:
        renv.update(LD_PRELOAD=asan[0], ASAN_OPTIONS="detect_leaks=0")
    return renv


def rank_scenarios(cluster, build, tmp, env, nodes, seed, only, torch):
    """The rank path's scenarios (module docstring). 0, 1 (failed) or 0 after a skip line."""
    dev = os.environ.get("RW_PY_RANK_DEVICE", "cpu")
    renv = dict(env, RAILWAVE_RANK_PATH="1")
    if dev == "cpu":
        renv = stand_in_env(build, env)
        if renv is None:
            return 0
    elif not torch.cuda.is_available():
        print("skip: rank scenarios on cuda: torch sees no CUDA device")
        return 0
    ranks = Ranks(nodes * cluster.GPUS, cluster.GPUS, renv)
    try:
        if "rank" in only:
            scenario_paths(cluster, tmp, ranks, nodes, seed, device=dev, rank_path=True)
        if "rankbad" in only and dev != "cpu":  # moe_rank.cmd_bad makes CPU tensors
            print("skip: rankbad on %s: its inputs are CPU tensors (the stand-in's run is it)"
                  % dev)
        elif "rankbad" in only and "LD_PRELOAD" in renv:
            # an exception raised in a backward is a C++ throw inside torch, which the
            # preloaded ASan runtime aborts on (its __cxa_throw interceptor has no target)
            print("skip: rankbad with the ASan stand-in preloaded (the release build runs it)")
        elif "rankbad" in only:
            scenario_bad(cluster, tmp, ranks, nodes, seed, rank_path=True)
        if "rankstatic" in only:
            scenario_static(cluster, tmp, ranks, nodes, seed, dev)
        if "rankstaticbad" in only:
            scenario_static_bad(cluster, tmp, ranks, nodes, seed, dev, "LD_PRELOAD" in renv)
        if "rankkill" in only:
            scenario_rankkill(cluster, tmp, ranks, nodes, seed, dev)
    except Exception as e:
        print("FAIL rank path %s" % e)
        return 1
    finally:
        ranks.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
