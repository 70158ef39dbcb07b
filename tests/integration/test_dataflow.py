#!/usr/bin/env python3
"""Multi-daemon integration test (docs/dataflow.md "Tests"): real railwaved processes on loopback
(rail r of node n on 127.0.r.(n+1)), real rank processes (tests/integration/rw_rank.c, 2 per node)
that verify every dispatched row and every combined sum against their own reference; for every
forced path and the selector; then faults: a peer daemon killed mid-phase, a rank killed
mid-phase, garbage on the stats socket, a control port and a rail port, one rail connection
down for a while (rail health). After every scenario the
daemons must stop cleanly on SIGTERM (exit 0: under ASan that also means no leak).

Run by tests/run as $b/test/integration_dataflow; exits 0 pass, 1 fail, 77 skip."""
import os
import random
import socket
import sys
import tempfile
import time

if __name__ == "__main__":  # run as $b/test/integration_dataflow (importers put $b/tests/lib first)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)
from cluster import Cluster, FAKE_CUDA, FAKE_KERN, GPUS, RAILS, WAIT  # noqa: E402


def scenario_paths(tmp, seed, cuda_ranks=None):
    """Every forced path and the selector, several steps x layers, fp32 and bf16 alternating."""
    for i, (path, nodes) in enumerate([("native", 3), ("rail-only", 4), ("perm-only", 4),
                                       ("joint", 3), ("auto", 4)]):
        c = Cluster(tmp, nodes, path=path, cuda_ranks=cuda_ranks)
        # One local-node record per idle slice: the forwarding and combine folding of local
        # records resume across many loop iterations, interleaved with the network.
        c.env.update(RAILWAVE_TEST_LOCAL_SLICE="1")
        try:
            c.start_all()
            c.run_ranks("g." + path, layers=4, steps=3, seed=seed + i, flags=["--empty"])
            st = c.stats(0, "stats selector")
            if path != "auto" and ("path=" + path) not in st and path not in st:
                raise RuntimeError("selector stats do not show the forced path %s:\n%s" % (path, st))
            if path in ("perm-only", "joint"):
                # The receiver gate: one wave source at a time writes into any node.
                for n in range(nodes):
                    fan = [l for l in c.stats(n, "stats").splitlines()
                           if l.startswith("wave_fanin_max ")]
                    if fan != ["wave_fanin_max 1"]:
                        raise RuntimeError("node %d: %s with the receiver gate" % (n, fan))
        finally:
            c.stop()
        print("ok   path %-9s N=%d R=%d G=%d (%s)" % (path, nodes, RAILS, GPUS, seed + i))


def scenario_gate(tmp, seed):
    """The receiver gate of the waved paths (docs/dataflow.md "Send"): with writes slowed by the
    test hooks (4 KiB chunks, one per 2 ms per phase) senders with little data would run ahead
    into later waves; under the gate every node still sees one wave source at a time
    (`wave_fanin_max 1`), and all data verifies."""
    for i, (path, nodes) in enumerate([("perm-only", 5), ("joint", 4)]):
        c = Cluster(tmp, nodes, path=path)
        c.env.update(RAILWAVE_TEST_CHUNK_KIB="4", RAILWAVE_TEST_WRITE_GAP_MS="2",
                     RAILWAVE_TEST_LOCAL_SLICE="1")
        try:
            c.start_all()
            c.run_ranks("g.gate", layers=1, steps=2, seed=seed + i, flags=["--hidden", "256"])
            for n in range(nodes):
                fan = [l for l in c.stats(n, "stats").splitlines() if l.startswith("wave_fanin_max ")]
                if fan != ["wave_fanin_max 1"]:
                    raise RuntimeError("node %d: %s with the receiver gate" % (n, fan))
        finally:
            c.stop()
        print("ok   gate %-9s N=%d: one wave source at a time at every receiver" % (path, nodes))


def scenario_pace(tmp, seed):
    """Paced tcp rails (0.2 Gbit/s, so a phase's rows overflow the 2 ms bucket): the transport's
    device counters reach `stats rails` - every rail's wire bytes cover its payload plus framing
    once the run is done, and the senders waited for the pacing budget."""
    c = Cluster(tmp, 2, path="native", extra={"pace": True, "nic_gbps": 0.2})
    try:
        c.start_all()
        c.run_ranks("g.pace", layers=1, steps=1, seed=seed,
                     flags=["--hidden", "1024", "--tokens", "64"])
        waits = 0
        for n in range(c.nodes):
            for x in c.rail_stats(n):
                if x["wire_tx_bytes"] < x["tx_bytes"] or (x["tx_bytes"] and
                                                         x["wire_tx_bytes"] == x["tx_bytes"]):
                    raise RuntimeError("node %d rail %d: wire_tx_bytes %d, payload %d" % (
                        n, x["rail"], x["wire_tx_bytes"], x["tx_bytes"]))
                waits += x["pace_waits"]
        if waits == 0:
            raise RuntimeError("paced rails never waited:\n" + c.stats(0, "stats rails"))
    finally:
        c.stop()
    print("ok   paced rails: wire bytes and pacing waits in stats rails (%d waits)" % waits)


def scenario_experts(tmp, seed):
    """E travels in the submission: a rank whose n_experts is not a multiple of W, or differs
    from its phase's, gets RW_E_EXPERTS and every other rank of the phase, on every node, fails
    at once (no phase timeout); then runs with the right E (and another E) pass."""
    c = Cluster(tmp, 2, extra={"phase_timeout_ms": 60000})
    w = c.nodes * GPUS
    try:
        c.start_all()
        # Every attempt reuses the key of the one that just failed (step 0), as a trainer that
        # retries a failed layer would: a failed attempt's late count rows and writes must not
        # be taken for the retry's (docs/dataflow.md "Failures").
        for bad in (c.experts + 1, 2 * c.experts):
            t0 = time.time()
            first = ["--first-step", "0"]
            procs = [(r, c.rank(r, "g.experts", 1, 1, seed, mode="fail",
                                flags=(["--submit-experts", str(bad)] if r == 0 else []) + first))
                     for r in range(w)]
            outs = c.collect(procs)
            # E not a multiple of W: rank 0 is refused. A valid E that differs from the
            # phase's: whichever rank of node 0 came second is refused.
            refused = [r for r in outs if "n_experts" in outs[r]]
            if (0 not in refused) if bad % w else not refused:
                raise RuntimeError("E=%d: RW_E_EXPERTS went to ranks %s:\n%s" % (bad, refused, outs))
            if time.time() - t0 > WAIT / 2:  # a bound, not a timing test: the timeout is 60 s
                raise RuntimeError("the phase failed only by timeout")
        c.run_ranks("g.experts", layers=2, steps=2, seed=seed, flags=["--first-step", "0"])
        c.experts = 3 * w  # another E for the same group: E is per phase
        c.run_ranks("g.experts", layers=2, steps=1, seed=seed + 1, flags=["--first-step", "4"])
    finally:
        c.stop()
    print("ok   n_experts validated per rank and per phase; wrong E fails the phase everywhere")


def scenario_cuda(tmp, seed):
    """Ranks with CUDA buffers (rw_rank --cuda: device memory exported by IPC handle): the
    daemons stage through pinned host memory with async copies watched by the loop. Two daemons,
    2 ranks per node sharing one GPU, every forced path and the selector, verified like the host
    runs, and mixed nodes (CUDA and host ranks side by side); with the stand-in driver also a
    daemon without a driver refusing CUDA registration. RW_IT_CUDA=real uses the system's
    driver and GPU (the GPU machine); otherwise the stand-in driver (CI), or skip."""
    real = os.environ.get("RW_IT_CUDA") == "real"
    if not real and not os.path.exists(FAKE_CUDA):
        print("skip cuda: no stand-in driver built")
        return
    runs = [(p, [0, 1, 2, 3]) for p in ("native", "rail-only", "perm-only", "joint", "auto")]
    runs += [("joint", [0, 3]), ("auto", [1, 2])]  # CUDA and host ranks side by side
    drivers = [("stand-in", FAKE_CUDA)]
    if not real and os.path.exists(FAKE_KERN):
        # Again with kernels: the CUDA mover (service/mover/mover_cuda.c) carries the pairs, its
        # kernels emulated on the CPU — where the build embeds kernels (nvcc was found).
        drivers.append(("stand-in with kernels", FAKE_KERN))
    for label, driver in drivers:
        if not scenario_cuda_runs(tmp, seed, real, runs, label, driver):
            break
    if real:
        return
    # A daemon without a driver refuses CUDA registration with a clear error and keeps the rank.
    c = Cluster(tmp, 1)
    c.env["RW_CUDA_DRIVER"] = "/nonexistent/libcuda.so.1"
    try:
        c.start_all()
        p = c.rank(0, "g.nocuda", 1, 1, seed, flags=["--cuda"],
                   env=dict(os.environ, RW_CUDA_DRIVER=FAKE_CUDA))
        out = p.communicate(timeout=WAIT)[0].decode()
        if p.returncode != 1 or "railwaved has no CUDA" not in out:
            raise RuntimeError("CUDA registration without a driver: rc %s: %s" % (p.returncode, out))
    finally:
        c.stop()
    print("ok   cuda registration refused by a daemon without a driver: %s" % out.strip()[-80:])


def scenario_cuda_runs(tmp, seed, real, runs, label, driver):
    """The cuda scenario's runs with one driver. With the kernel stand-in, each daemon must have
    carried its pairs with the CUDA mover; a build without embedded kernels says so once and the
    rest is skipped (False)."""
    # Knobs for a heavier run by hand (docs/perf/runs/gpu-e2e.md): extra rank flags (--hidden,
    # --tokens), a bigger receive region, and each daemon's phase statistics printed at the end.
    extra_flags = os.environ.get("RW_IT_RANK_FLAGS", "").split()
    recv_mib = int(os.environ.get("RW_IT_RECV_MIB", "16"))
    for i, (path, cuda_ranks) in enumerate(runs):
        c = Cluster(tmp, 2, path=path, extra={"recv_region_mib": recv_mib})
        c.rank_flags = extra_flags
        if not real:
            c.env["RW_CUDA_DRIVER"] = driver
        # Every other run on the CUDA mover with 1 KiB rail writes (a few records each, cut
        # mid-record): it forwards and sums each range piece by piece as the pieces arrive
        # (rw_svc_mover_ops_t.part), and the exact checks hold.
        pieces = (driver == FAKE_KERN or real) and i % 2 == 0
        if pieces:
            c.env["RAILWAVE_TEST_CHUNK_KIB"] = "1"
        # The last run with kernels (stand-in or real) takes the slab placement as far as a machine
        # without a dmabuf NIC can (service/mesh/mesh_slabs.c): every rail taken for such a NIC, the
        # stand-in's GPU exporting dmabufs; the registration (tcp refuses dmabufs) then answers
        # and the daemon falls back to host slabs, saying why, and every check still holds.
        placement = (driver == FAKE_KERN or real) and i == len(runs) - 1
        if placement:
            c.env["RAILWAVE_TEST_GPUDIRECT"] = "1"
            c.env["RW_FAKE_CUDA_DMABUF"] = "1"
        want_slabs = ("slabs host, mapped into the GPUs (no GPUDirect: ibv_reg_dmabuf_mr refused "
                      "GPU 0's memory (not supported))" if placement else
                      "slabs host, mapped into the GPUs (no GPUDirect: tcp rails are sockets)")
        try:
            c.start_all()
            procs = [(r, c.rank(r, "g.cuda", 4, 2, seed + i,
                                flags=["--empty"] + (["--cuda"] if r in cuda_ranks else [])))
                     for r in range(c.nodes * GPUS)]
            skipped = [r for r, p in procs if p.wait(WAIT) == 77]
            if skipped:
                print("skip cuda: %s" % procs[skipped[0]][1].stdout.read().decode().strip())
                return False
            outs = c.collect(procs)
            for r in cuda_ranks:
                if "(CUDA buffers)" not in outs[r]:
                    raise RuntimeError("rank %d did not run with CUDA buffers: %s" % (r, outs[r]))
            for n in range(c.nodes):  # where the slabs live, and why (docs/cuda.md)
                slabs = [l for l in c.stats(n, "stats").splitlines() if l.startswith("slabs ")]
                if slabs != [want_slabs]:
                    raise RuntimeError("node %d: stats says %s about the slabs" % (n, slabs))
            if os.environ.get("RW_IT_STATS"):
                for n in range(c.nodes):
                    for line in c.stats(n, "stats phases").splitlines():
                        if line.strip() and " ok=0 failed=0 " not in line:
                            print("  node %d %s" % (n, line))
            logs = [open(os.path.join(tmp, "d%d.log" % n)).read() for n in range(c.nodes)]
            # Who counted each dispatch's row (docs/dataflow.md "Count on the GPU").
            counted = [(stat_value(c, n, "counts_gpu"), stat_value(c, n, "counts_host"))
                       for n in range(c.nodes)]
            prefixes = [stat_value(c, n, "rx_prefixes") for n in range(c.nodes)]
            piece_waits = [stat_value(c, n, "tx_piece_waits") for n in range(c.nodes)]
        finally:
            c.stop()
        if (driver == FAKE_KERN or real) and len(cuda_ranks) == 2 * GPUS:
            # With kernels the CUDA mover counts on the GPU whenever a CUDA rank routes tokens:
            # with every rank on the GPU every node has such phases. (A mixed node's pair goes
            # to the host mover when a host-memory rank submits first: no assertion there; the
            # in-process test svc_exec_gpu orders the ranks and covers mixed nodes.)
            if not all(gpu > 0 for gpu, _ in counted) and not any("built without nvcc" in l
                                                                  for l in logs):
                raise RuntimeError("no count row came from the GPU (counts_gpu, counts_host "
                                   "per node: %s)" % counted)
        if driver == FAKE_KERN:
            if any("built without nvcc" in l for l in logs):
                print("skip cuda with the kernel stand-in: this build embeds no kernels (no nvcc)")
                return False
            if not all("cuda mover: kernels loaded" in l and "mapped into the GPUs" in l for l in logs):
                raise RuntimeError("the CUDA mover did not carry the pairs with the kernel stand-in\n"
                                   + c.logs())
        if pieces and len(cuda_ranks) == 2 * GPUS and not (all(prefixes) and all(piece_waits)):
            raise RuntimeError("1 KiB writes: no range was taken in pieces (rx_prefixes per "
                               "node: %s) or no slab sent in pieces (tx_piece_waits: %s)"
                               % (prefixes, piece_waits))
        print("ok   cuda %-9s CUDA ranks %s N=2 R=%d G=%d (%s, %s driver; count rows gpu/host "
              "per node %s%s)" % (path, cuda_ranks, RAILS, GPUS, seed + i, "real" if real else label,
                                  " ".join("%d/%d" % gh for gh in counted),
                                  "; 1 KiB writes, prefixes taken per node %s, waits for a "
                                  "packed piece %s" % (" ".join(map(str, prefixes)),
                                                       " ".join(map(str, piece_waits)))
                                  if pieces else ""))
    return True


def scenario_stream(tmp, seed):
    """Stream-ordered submission (ipc/railwave.h, docs/cuda.md "Stream-ordered submission"):
    CUDA ranks (rw_rank --cuda --stream-ordered) copy their inputs in on their own stream WITHOUT
    synchronizing, record an interprocess event behind the copies, and ask the daemon to wait on
    it and to write the next flag value when the outputs are written; their stream waits on the
    flag before copying the outputs back. On a slow stand-in GPU (RW_FAKE_CUDA_LAG_MS: every
    stream's work runs late, in order, in the daemons and in the ranks) a daemon that read the
    inputs before the event, or wrote the flag before the outputs, leaves stale bytes the ranks'
    exact checks catch; each rank checks that the flag holds V-1 before each submission and
    exactly V after its completion. Every forced path and the selector on the CUDA mover (kernel
    stand-in), two on the host mover (the stand-in without kernels: its staging stream waits
    on the event, and it writes the flag with a driver call); then an error still writes the flag, and a daemon
    killed mid-phase leaves the rank to write its owed flag itself (rw_client_lost_signals)."""
    if os.environ.get("RW_IT_CUDA") == "real":
        drivers = [("real", None, [(p, 0, 0) for p in ("native", "rail-only", "perm-only",
                                                        "joint", "auto")])]
    else:
        if not os.path.exists(FAKE_CUDA):
            print("skip stream: no stand-in driver built")
            return
        # (path, the daemons' and the ranks' stand-in lag in ms): a slow rank GPU catches a
        # daemon that reads before the event; a slow daemon GPU and an immediate rank, whose
        # copy back runs the moment the flag appears, one that writes the flag early.
        drivers = [("host mover", FAKE_CUDA, [("joint", 2, 25), ("auto", 20, 0)])]
        if os.path.exists(FAKE_KERN):
            drivers.append(("cuda mover", FAKE_KERN,
                            [(p, 2, 25) for p in ("native", "rail-only", "perm-only", "joint",
                                                  "auto")] + [("joint", 20, 0)]))
    flags = ["--empty", "--cuda", "--stream-ordered"]
    for label, driver, paths in drivers:
        for i, (path, d_lag, r_lag) in enumerate(paths):
            c = Cluster(tmp, 2, path=path)
            if driver:
                c.env["RW_CUDA_DRIVER"] = driver
                c.env["RW_FAKE_CUDA_LAG_MS"] = str(d_lag)
            try:
                c.start_all()
                env = dict(c.env, RW_FAKE_CUDA_LAG_MS=str(r_lag)) if driver else None
                procs = [(r, c.rank(r, "g.stream", 3, 2, seed + i, flags=flags, env=env))
                         for r in range(c.nodes * GPUS)]
                if any(p.wait(WAIT) == 77 for _, p in procs):
                    print("skip stream: no CUDA for the ranks")
                    return
                outs = c.collect(procs)
                logs = [open(os.path.join(tmp, "d%d.log" % n)).read() for n in range(c.nodes)]
            finally:
                c.stop()
            if any("(stream-ordered)" not in o for o in outs.values()):
                raise RuntimeError("a rank did not run stream-ordered: %s" % outs)
            mover_on = all("cuda mover: kernels loaded" in l for l in logs)
            if driver == FAKE_KERN and not mover_on:
                if any("built without nvcc" in l for l in logs):
                    print("skip stream on the CUDA mover: this build embeds no kernels")
                    break
                raise RuntimeError("the CUDA mover did not carry the stream-ordered pairs")
            print("ok   stream %-9s N=2 R=%d G=%d %s, lag %d/%d ms (%s, %s), flags exact"
                  % (path, RAILS, GPUS, "CUDA mover" if mover_on else "host mover", d_lag, r_lag,
                     seed + i, label))
    driver = drivers[-1][1]
    # A refused dispatch (E not a multiple of the world) still writes its flag before its CQE.
    c = Cluster(tmp, 1)
    if driver:
        c.env["RW_CUDA_DRIVER"] = driver
    try:
        c.start_all()
        outs = c.collect([(r, c.rank(r, "g.streamfail", 1, 1, seed, mode="fail",
                                     flags=flags + ["--submit-experts", "3"])) for r in range(GPUS)])
    finally:
        c.stop()
    print("ok   stream: a refused submission wrote its flag: %s" % outs[0].strip()[-70:])
    # The daemon dies mid-phase (its other rank never submits): the rank's library hands it the
    # owed flag, the rank writes it, and its stream drains instead of waiting forever.
    c = Cluster(tmp, 1)
    if driver:
        c.env["RW_CUDA_DRIVER"] = driver
        c.env["RW_FAKE_CUDA_LAG_MS"] = "2"
    try:
        c.start_all()
        idle = c.rank(1, "g.streamlost", 1, 1, seed, mode="idle", flags=flags)
        p = c.rank(0, "g.streamlost", 1, 1, seed, flags=flags)
        deadline = time.time() + WAIT
        while time.time() < deadline and sum("group=g.streamlost " in l for l in
                                             c.stats(0, "stats clients").splitlines()) < 2:
            time.sleep(0.05)
        time.sleep(1.0)  # rank 0 registers and submits (its phase waits for rank 1: forever)
        c.kill(0)
        out = p.communicate(timeout=WAIT)[0].decode()
        idle.kill()
        idle.wait()
        if p.returncode != 3 or "daemon lost: wrote 1 owed flags, stream drained" not in out:
            raise RuntimeError("rank after its daemon died: rc %s: %s" % (p.returncode, out))
        # A host thread that blocked on the flag wait (the stand-in, like the driver, finishes a
        # copy into pageable memory before returning) is only freed by the stand-in's give-up.
        if "still not satisfied" in out:
            raise RuntimeError("the rank's host thread blocked on its stream's flag wait: %s" % out)
    finally:
        c.stop()
    print("ok   stream: daemon killed mid-phase, the rank wrote its owed flag and its stream drained")


def scenario_peer_dies(tmp, seed, cuda_ranks=None):
    """Nodes 0 and 1 are in a phase waiting for node 2's counts when node 2's daemon is killed:
    their ranks get an error completion, the daemons keep serving, node 2 comes back and a
    full run passes."""
    c = Cluster(tmp, 3, cuda_ranks=cuda_ranks)
    try:
        c.start_all()
        waiting = [c.rank(r, "g.fault", 1, 1, seed, mode="fail") for r in range(4)]
        time.sleep(0.3)  # let them submit (not a pass criterion: the kill works either way)
        c.kill(2)
        for r, p in enumerate(waiting):
            out, _ = p.communicate(timeout=WAIT)
            if p.returncode != 0:
                raise RuntimeError("rank did not see its phase fail: %s\n%s" % (out, c.logs()))
            # rw_client_last_message says what failed: the dead node, by index and name.
            if b"peer 2 (n2)" not in out:
                raise RuntimeError("rank %d's error does not name node 2: %s" % (r, out))
        c.start(2)
        c.wait_mesh()
        # The failed key (layer 0, step 0) again at once, as a retrying trainer would.
        c.run_ranks("g.fault", layers=2, steps=1, seed=seed + 1, flags=["--first-step", "0"])
    finally:
        c.stop()
    print("ok   peer daemon killed mid-phase, others failed the phase and recovered (same key retried)")


def rx_bytes(c, n):
    return sum(int(f.split("=")[1]) for f in c.stats(n, "stats rails").split()
               if f.startswith("rx_bytes="))


def scenario_in_flight(tmp, seed, cuda_ranks=None):
    """A peer daemon dies while rail writes are in flight: large rows, and the executor's test
    hook posts 32 KiB writes one per 20 ms, so the slabs take seconds; the last node is killed as
    soon as another has received its first bytes. Every local rank of the survivors gets its
    error (long before the 60 s phase timeout), the survivors keep serving, the node comes back
    and a full run passes; every daemon exits cleanly (ASan: no leak). Native at N = 3, and
    Joint at N = 4, where survivors are then also waiting for wave grants (the receiver gate,
    docs/dataflow.md "Send"): a dead grantor must fail the phase just as fast."""
    for path, nodes in (("native", 3), ("joint", 4)):
        in_flight_one(tmp, seed, path, nodes, cuda_ranks)


def in_flight_one(tmp, seed, path, nodes, cuda_ranks):
    c = Cluster(tmp, nodes, path=path, extra={"phase_timeout_ms": 60000, "recv_region_mib": 64},
                cuda_ranks=cuda_ranks)
    c.env.update(RAILWAVE_TEST_CHUNK_KIB="32", RAILWAVE_TEST_WRITE_GAP_MS="20")
    victim = nodes - 1
    try:
        c.start_all()
        flags = ["--hidden", "2048", "--tokens", "96"]
        procs = [(r, c.rank(r, "g.flight", 1, 1, seed, mode="fail", flags=flags))
                 for r in range(c.nodes * GPUS)]
        deadline = time.time() + WAIT
        while sum(rx_bytes(c, n) for n in range(victim)) == 0:
            if time.time() > deadline:
                raise RuntimeError("no rail data arrived\n" + c.logs())
            time.sleep(0.005)
        t_kill = time.time()
        c.kill(victim)
        in_flight = sum(int(f.split("=")[1]) for n in range(victim)
                        for f in c.stats(n, "stats rails").split() if f.startswith("tx_bytes="))
        c.collect([rp for rp in procs if rp[0] < victim * GPUS])  # survivors: an error each
        took = time.time() - t_kill
        for r, p in procs[victim * GPUS:]:  # the victim's ranks lost their daemon
            p.communicate(timeout=WAIT)
        if took > WAIT / 2:
            raise RuntimeError("survivors failed the phase only by timeout (%.1f s)" % took)
        c.start(victim)
        c.wait_mesh()
        # The failed key again at once (docs/dataflow.md "Failures").
        c.run_ranks("g.flight", layers=2, steps=1, seed=seed + 1, flags=["--first-step", "0"])
    finally:
        c.stop()
    print("ok   %s N=%d: peer daemon killed with rail writes in flight (%d bytes posted by "
          "survivors), survivors failed every rank in %.2f s, recovered (same key retried)" % (path, nodes, in_flight, took))


def scenario_rank_dies(tmp, seed, cuda_ranks=None):
    """Rank 3 (node 1) connects and then dies while everyone else is in the phase: every other
    rank's dispatch fails; afterwards a complete run passes."""
    c = Cluster(tmp, 2, cuda_ranks=cuda_ranks)
    try:
        c.start_all()
        idle = c.rank(3, "g.rank", 1, 1, seed, mode="idle")
        line = b"-"
        while line and line.strip() != b"ready":  # (a CUDA rank logs its driver first)
            line = idle.stdout.readline()
        if not line:
            raise RuntimeError("the idle rank did not get ready\n" + c.logs())
        waiting = [c.rank(r, "g.rank", 1, 1, seed, mode="fail") for r in range(3)]
        # Every other rank in its phase first (a CUDA rank starts its driver for a second or
        # more), and a moment for the daemons to take the submissions in.
        for p in waiting:
            line = b"-"
            while line and line.strip() != b"submitted":
                line = p.stdout.readline()
        time.sleep(0.3)
        idle.kill()
        idle.wait()
        idle.stdout.close()
        for r, p in enumerate(waiting):
            out, _ = p.communicate(timeout=WAIT)
            if p.returncode != 0:
                raise RuntimeError("rank did not see its phase fail: %s\n%s" % (out, c.logs()))
            if b"local rank 3 left" not in out:
                raise RuntimeError("rank %d's error does not name rank 3: %s" % (r, out))
        # The failed key again at once (docs/dataflow.md "Failures").
        c.run_ranks("g.rank", layers=2, steps=1, seed=seed + 1, flags=["--first-step", "0"])
    finally:
        c.stop()
    print("ok   rank killed mid-phase, its group's phase failed everywhere, then recovered (same key retried)")


def scenario_timeout(tmp, seed, cuda_ranks=None):
    """Rank 3 (node 1) joins but never submits: the phase times out, and every rank's error
    names what was waited for — node 1's rank 3, or node 1's count row — never another node.
    Then a complete run passes."""
    c = Cluster(tmp, 2, extra={"phase_timeout_ms": 1500}, cuda_ranks=cuda_ranks)
    try:
        c.start_all()
        idle = c.rank(3, "g.late", 1, 1, seed, mode="idle")
        line = b"-"
        while line and line.strip() != b"ready":  # (a CUDA rank logs its driver first)
            line = idle.stdout.readline()
        if not line:
            raise RuntimeError("the idle rank did not get ready\n" + c.logs())
        outs = c.collect([(r, c.rank(r, "g.late", 1, 1, seed, mode="fail")) for r in range(3)])
        idle.kill()
        idle.wait()
        idle.stdout.close()
        # Whichever node's timer fires first decides, and the others hear its reason.
        for r in range(3):
            if ("waiting for local ranks 3" not in outs[r] and
                    "waiting for the count rows of node 1 (n1, ranks 2-3)" not in outs[r]):
                raise RuntimeError("rank %d was not told the phase waited for node 1's rank 3: %s"
                                   % (r, outs[r]))
        # The timed-out key again at once: every node timed out on its own (docs/dataflow.md
        # "Failures" 5: each report names the attempt it ended, so none fails the retry).
        c.run_ranks("g.late", layers=1, steps=1, seed=seed + 1, flags=["--first-step", "0"])
    finally:
        c.stop()
    print("ok   a phase timeout names what it waited for: %s" % outs[0].strip().split(": ", 2)[-1])


def scenario_garbage(tmp, seed):
    """Random bytes on the stats socket, on a peer's control port and on a rail port, plus a
    well-framed hello with a wrong fingerprint: the daemons keep working."""
    c = Cluster(tmp, 3)
    rnd = random.Random(seed)
    try:
        c.start_all()
        targets = []
        for n in range(3):
            ip, port = c.cfg["nodes"][n]["control"].split(":")
            targets.append((ip, int(port)))
            r = c.cfg["nodes"][n]["rails"][1]
            targets.append((r["address"], r["port"]))
        for ip, port in targets:
            for _ in range(3):
                s = socket.create_connection((ip, port), timeout=5)
                s.sendall(bytes(rnd.getrandbits(8) for _ in range(rnd.randint(1, 4096))))
                s.close()
            # A valid frame header announcing a huge payload, then silence and close.
            s = socket.create_connection((ip, port), timeout=5)
            s.sendall(b"RWMC\x01\x00\x01\x00" + (1 << 30).to_bytes(4, "little") + b"\0\0\0\0")
            s.close()
        for n in range(3):
            s = socket.socket(socket.AF_UNIX)
            s.connect(c.cfg["nodes"][n]["stats_socket"])
            s.sendall(bytes(rnd.getrandbits(8) for _ in range(2000)) + b"\n")
            s.close()
        c.wait_mesh()
        c.run_ranks("g.garbage", layers=2, steps=1, seed=seed)
    finally:
        c.stop()
    print("ok   garbage on stats, control and rail ports")


def scenario_rewrite(tmp, seed):
    """Hostile ranks rewrite their top-k ids after submitting a dispatch, over and over until
    its completion (rw_rank mode rewrite; every id moved to the other node's experts and back),
    in 40 phases, while an unrelated job runs verified phases on both daemons. A daemon reads a
    rank's routing once: each hostile phase passes or fails with a reason, no daemon blames or
    drops its peer for what a rank did (reconnects=0 errors=0 on both sides), and every phase
    of the other job verifies."""
    import threading
    c = Cluster(tmp, 2)
    errors, rounds, stop = [], [0], []

    def innocent():
        k = 0
        while not stop:
            try:
                c.run_ranks("g.innocent", layers=2, steps=1, seed=seed, flags=["--first-step", str(k)])
                rounds[0] += 1
            except Exception as e:  # a failed round is the finding
                errors.append(str(e)[:3000])
                return
            k += 1

    try:
        c.start_all()
        t = threading.Thread(target=innocent, daemon=True)
        t.start()
        outcomes = {}
        for i in range(40):
            outs = c.collect([(r, c.rank(r, "g.rewrite%d" % i, 1, 1, seed + i, mode="rewrite"))
                              for r in range(c.nodes * GPUS)])
            for r, out in outs.items():
                line = [l for l in out.splitlines() if l.startswith("rewrite: dispatch")]
                if not line:
                    raise RuntimeError("rank %d said no outcome: %s" % (r, out))
                what = line[0].split(" (")[0] if "dispatch ok" in line[0] else line[0]
                outcomes[what] = outcomes.get(what, 0) + 1
        stop.append(1)
        t.join(WAIT)
        if errors or rounds[0] < 1:
            raise RuntimeError("the unrelated job failed while ranks rewrote their ids (%d rounds "
                               "passed): %s" % (rounds[0], errors[:1]))
        for n in range(2):
            line = [l for l in c.stats(n, "stats peers").splitlines()
                    if l.startswith("peer=%d " % (1 - n))][0]
            if "state=up" not in line or "reconnects=0 " not in line or "errors=0 " not in line:
                raise RuntimeError("node %d blamed its peer for its ranks' rewrites: %s\n%s"
                                   % (n, line, c.logs()))
    finally:
        stop.append(1)
        c.stop()
    print("ok   ranks rewriting their ids after submitting: %s; no peer dropped, %d rounds of "
          "another job verified" % (sorted(outcomes.items()), rounds[0]))


# (path, node whose switch takes the rail down, rail, the peer it is cut from). The switch sits
# on the acceptor of that rail connection in some runs (it refuses the redials) and on the
# connector in others (it does not redial): either way both ends must plan alike.
RAIL_FAULTS = [("joint", 2, 1, 0), ("native", 0, 1, 2), ("rail-only", 1, 0, 2),
               ("perm-only", 2, 0, 1), ("auto", 0, 1, 1)]


def link_lines(c, n):
    """`stats rails` of daemon n: {(peer name, rail): {key: value}} for every rail connection."""
    out = {}
    for line in c.stats(n, "stats rails").splitlines():
        if line.startswith("link="):
            kv = dict(w.split("=", 1) for w in line.split())
            peer, rail = kv["link"].rsplit("/", 1)
            out[(peer, int(rail))] = kv
    return out


def stat_value(c, n, key):
    return int([l for l in c.stats(n, "stats").splitlines() if l.startswith(key + " ")][0].split()[1])


def scenario_rail(tmp, seed, cuda_ranks=None):
    """Rail health (docs/dataflow.md "Rail health"): one rail connection of one node closes
    mid-run and stays refused for 1.2 s (RAILWAVE_TEST_RAIL_DOWN); when a phase fails with
    RW_E_PHASE on any rank, every rank redoes it at once (--retry: the ranks vote after each
    phase, as a trainer's step agreement would). Every rank's rows and sums must
    verify, no peer may go down (reconnects 0, state up), both ends must log the outage and the
    return, every node must have planned phases without the rail (both ends agree, or the data
    would not verify), and once the rail is back a second run plans no phase without it."""
    for i, (path, node, rail, peer) in enumerate(RAIL_FAULTS):
        c = Cluster(tmp, 3, path=path, cuda_ranks=cuda_ranks)
        # Slow writes (4 KiB chunks, one per ms per phase) keep phases in flight when it closes.
        c.env.update(RAILWAVE_TEST_CHUNK_KIB="4", RAILWAVE_TEST_WRITE_GAP_MS="1")
        c.node_env[node] = {"RAILWAVE_TEST_RAIL_DOWN": "%d:%d:200:1200" % (rail, peer)}
        try:
            c.start_all()
            votes = os.path.join(tmp, "votes.%s" % path)
            os.makedirs(votes, exist_ok=True)
            outs = c.run_ranks("g.rail." + path, layers=4, steps=12, seed=seed + i,
                               flags=["--retry", "40", votes, "--empty"])
            retries = sum(int(o.strip().split()[-2]) for o in outs.values()
                          if o.strip().endswith("retries"))
            why = sorted(set(l.split("after: ", 1)[1] for o in outs.values() for l in o.splitlines()
                             if l.startswith("retry ")))
            if any("rail %d between node" % rail not in w for w in why):
                raise RuntimeError("a phase failed for another reason than the rail: %s\n%s"
                                   % (why, c.logs()))
            deadline = time.time() + WAIT  # the rail comes back (back-off after the hold)
            while any(v["state"] != "up" for n in range(3) for v in link_lines(c, n).values()):
                if time.time() > deadline:
                    raise RuntimeError("rail %d of node %d did not come back\n%s" % (rail, node, c.logs()))
                time.sleep(0.05)
            for n in range(3):
                st = c.stats(n, "stats peers")
                if st.count("state=up") != 2 or "reconnects=0" not in st or "reconnects=1" in st:
                    raise RuntimeError("node %d: a peer went down over one rail:\n%s" % (n, st))
            for a, b in ((node, peer), (peer, node)):
                with open(os.path.join(tmp, "d%d.log" % a)) as f:
                    log = f.read()
                for what in ("rail %d of node %d (n%d) down" % (rail, b, b),
                             "rail %d of node %d (n%d) back up" % (rail, b, b)):
                    if what not in log:
                        raise RuntimeError("node %d did not log '%s'\n%s" % (a, what, c.logs()))
                fo = link_lines(c, a)[("n%d" % b, rail)]
                if int(fo["failovers"]) < 1 or float(fo["degraded_s"]) <= 0:
                    raise RuntimeError("node %d: link to n%d rail %d: %s" % (a, b, rail, fo))
            excluded = [stat_value(c, n, "phases_rail_excluded") for n in range(3)]
            if min(excluded) == 0:
                raise RuntimeError("a node never planned without the rail: %s\n%s" % (excluded, c.logs()))
            c.run_ranks("g.rail." + path, layers=2, steps=2, seed=seed + i,
                        flags=["--first-step", "100"])
            after = [stat_value(c, n, "phases_rail_excluded") for n in range(3)]
            if after != excluded:
                raise RuntimeError("phases planned without the rail after it came back: %s -> %s"
                                   % (excluded, after))
        finally:
            c.stop()
        print("ok   rail %-9s rail %d of n%d cut from n%d: %s phases without it per node, "
              "%d retries, no peer down, back in use" % (path, rail, node, peer, excluded, retries))
        for w in why:
            print("       retried after: %s" % w)


def scenario_rail_join(tmp, seed):
    """A node whose rail cannot connect when the peers meet (a NIC dead at start: the test switch
    with AT_MS "start" makes node 1 refuse node 0's rail 1 for 5 s): the two come up on their
    other rail after heartbeat_timeout_ms instead of waiting for every rail, both log the missing
    rail, every phase runs exactly without it (both ends plan without it), no peer goes down,
    and once the rail connects the next phases use it again."""
    node, peer, rail, hold_ms = 1, 0, 1, 5000
    c = Cluster(tmp, 3, path="joint")
    c.node_env[node] = {"RAILWAVE_TEST_RAIL_DOWN": "%d:%d:start:%d" % (rail, peer, hold_ms)}
    t0 = time.time()
    try:
        c.start_all()
        took = time.time() - t0
        if took > hold_ms / 1000.0:
            raise RuntimeError("the mesh came up after %.1f s: it waited for the dead rail" % took)
        for a, b in ((node, peer), (peer, node)):
            state = link_lines(c, a)[("n%d" % b, rail)]["state"]
            with open(os.path.join(tmp, "d%d.log" % a)) as f:
                log = f.read()
            if state != "down" or "up on 1 of 2 rails: rail(s) %d did not connect" % rail not in log:
                raise RuntimeError("node %d: link to n%d rail %d is %s; log:\n%s"
                                   % (a, b, rail, state, log[-2000:]))
        c.run_ranks("g.join", layers=2, steps=2, seed=seed, flags=["--empty"])
        excluded = [stat_value(c, n, "phases_rail_excluded") for n in range(3)]
        if min(excluded) == 0:
            raise RuntimeError("a node planned with the missing rail: %s\n%s" % (excluded, c.logs()))
        deadline = time.time() + WAIT
        while any(v["state"] != "up" for n in range(3) for v in link_lines(c, n).values()):
            if time.time() > deadline:
                raise RuntimeError("rail %d never joined\n%s" % (rail, c.logs()))
            time.sleep(0.05)
        c.run_ranks("g.join", layers=2, steps=1, seed=seed + 1, flags=["--first-step", "100"])
        after = [stat_value(c, n, "phases_rail_excluded") for n in range(3)]
        if after != excluded:
            raise RuntimeError("phases planned without the rail after it joined: %s -> %s"
                               % (excluded, after))
        for n in range(3):
            st = c.stats(n, "stats peers")
            if st.count("state=up") != 2 or "reconnects=0" not in st or "reconnects=1" in st:
                raise RuntimeError("node %d: a peer went down:\n%s" % (n, st))
    finally:
        c.stop()
    print("ok   rail join: n%d refused n%d's rail %d from the start; up on the other rail in "
          "%.1f s, %s phases planned without it per node, then it joined and was used"
          % (node, peer, rail, took, excluded))


def on_weight_grid(w):
    """Whether w is a weight the daemon's quantizer gives (service/mesh/rail_health.c: the
    rounded 2^(k/4) Mbit/s, at least 1)."""
    return any(w == round(2 ** (k / 4)) for k in range(0, 4 * 20))


def scenario_weights(tmp, seed):
    """Measured rail weights (`rail_weights: measured`, docs/dataflow.md "Rail health"): paced tcp
    rails, node 0's rail 1 at a quarter of the others' rate (0.1 vs 0.4 Gbit/s). After a Joint
    run every node's rows carry measured weights, which is what this asserts, exactly: every
    rail's weight (`stats rails` weight=, the one its last row carried) is a quantized
    measurement (on the 2^(k/4) Mbit/s grid), none the configured rate (400 and 100 Mbit/s are
    off the grid); and every row and sum verifies with the plans weighted by them. How the
    measured rates compare (the slow rail lower, equal rails alike) depends on timing and on the
    machine's load, so it is printed, not asserted (two equal rails measured [256, 431] under a
    load of 18, outside the factor 5/3 this test used to demand)."""
    c = Cluster(tmp, 3, path="joint", extra={"pace": True, "rail_weights": "measured",
                                             "nic_gbps": 0.4, "recv_region_mib": 64})
    c.cfg["nodes"][0]["rails"][1]["rate_gbps"] = 0.1
    c.write_config()
    try:
        c.start_all()
        configured = [[round(r.get("rate_gbps", c.cfg["nic_gbps"]) * 1000) for r in node["rails"]]
                      for node in c.cfg["nodes"]]
        c.run_ranks("g.weights", layers=3, steps=3, seed=seed,
                    flags=["--hidden", "2048", "--tokens", "96"])
        w = [[int(l["weight"]) for l in c.rail_stats(n)] for n in range(3)]
        for n in range(3):
            for r in range(2):
                if not on_weight_grid(w[n][r]) or w[n][r] == configured[n][r]:
                    raise RuntimeError("node %d rail %d: weight %d is not a measured one "
                                       "(configured %d): %s" % (n, r, w[n][r], configured[n][r], w))
    finally:
        c.stop()
    print("ok   measured rail weights (Mbit/s, per node and rail): %s; node 0's slow rail / its "
          "rail 0 = %.2f, nodes 1 and 2 rail 1 / rail 0 = %.2f, %.2f (timing: not asserted)"
          % (w, w[0][1] / w[0][0], w[1][1] / w[1][0], w[2][1] / w[2][0]))


def main():
    if not cluster.built():
        print("skip: railwaved, railwave or rw_rank not built")
        return 77
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or random.randrange(1, 1 << 30)
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    only = os.environ.get("RW_IT_ONLY", "")
    with tempfile.TemporaryDirectory(prefix="rwit.", dir="/tmp") as tmp:
        for name, fn in [("paths", scenario_paths), ("experts", scenario_experts),
                         ("cuda", scenario_cuda), ("stream", scenario_stream),
                         ("pace", scenario_pace), ("gate", scenario_gate),
                         ("peer", scenario_peer_dies), ("flight", scenario_in_flight),
                         ("rank", scenario_rank_dies), ("timeout", scenario_timeout),
                         ("garbage", scenario_garbage), ("rail", scenario_rail),
                         ("join", scenario_rail_join), ("rewrite", scenario_rewrite),
                         ("weights", scenario_weights)]:
            if only and name not in only.split(","):
                continue
            try:
                fn(tmp, seed)
            except Exception as e:  # report and fail
                cluster.print_failure(name, e)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
