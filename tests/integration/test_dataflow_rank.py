#!/usr/bin/env python3
"""integration_dataflow's scenarios with CUDA ranks on the rank path (docs/rankpath.md): every
rank runs librailwave's rw_client_rank_* (rw_rank --rank-path: the count, pack, forward, gather
and reduce kernels on the rank's own stream, the daemons answering by the words of each rank's
page and moving the records through the group's slabs) against real railwaved, and checks every
row, its metadata, the per-expert counts and every combined sum as the scenario does with host
ranks. From tests/integration/test_dataflow.py: `paths` (every forced path and the selector, 3
and 4 nodes), `peer` (a peer daemon killed while the ranks wait for its counts), `flight` (a peer
killed with rail writes in flight, Native at N = 3 and Joint at N = 4), `rank` (a rank killed
mid-phase), `timeout` (a phase timing out) and `rail` (a rail cut mid-run, the ranks retrying);
each failure is named on every surviving rank (the daemon's notice) and their streams run
through, and the next phases pass. Then, written here:
  cuda    two daemons, every forced path and the selector with every rank on the rank path, a
          node of rank-path ranks beside a node of host-memory ranks in one group, and nodes
          whose two ranks are one of each; on the stand-in, the selector again on GPU slabs
          (RAILWAVE_TEST_GPUDIRECT=1: the groups' carve-outs CUDA allocations lent by fd);
  stream  the ranks' stand-in GPU slow (RW_FAKE_CUDA_LAG_MS: their copies and kernels run late,
          in order): the inputs are copied in with no synchronization and the outputs read
          only after the phase's done, so a kernel that ran before its word or a done written
          before the kernel leaves stale bytes the exact checks catch; then a daemon killed
          while its rank's phase waits: the library writes the owed words and the rank's
          stream runs through;
  mixfail `rank`, `peer` and `timeout` again with one rank-path and one host-memory ring rank of
          the group on each node;
  exact   rows of full mantissas (rw_rank --noisy: a token's three or more terms sum to other
          bits in another order): through two and three real daemons, every rank's combined
          rows on the rank path are bit-equal to the host mover's for the same inputs.
After each scenario every daemon's last stats (tests/lib/cluster.py keeps them) must show
rank-path phases completed, on each node whose ranks took the rank path.

CI: the kernel stand-in (libfakecuda_kern.so); RW_IT_CUDA=real runs the same on the system's
driver and GPU (scripts/gpu-carry). A build without kernels (no nvcc) skips (exit 77). Run by
tests/run as $b/test/integration_rankpath; RW_IT_ONLY picks scenarios."""
import filecmp
import os
import sys
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
sys.path.insert(0, os.path.join(B, "tests", "integration"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)
import test_dataflow as it  # noqa: E402  (its scenarios, run here on the rank path)
from cluster import GPUS, WAIT, Cluster, RankPath  # noqa: E402


def driver():
    return "real" if os.environ.get("RW_IT_CUDA") == "real" else cluster.FAKE_KERN


def rank_phases(tmp, nodes=None):
    """{node: the smallest rank_path_phases of the stats its daemons left at their stops (each
    cluster of the scenario's that ran that node)}."""
    out = {}
    for f in sorted(os.listdir(tmp)):
        if f.startswith("d") and f.endswith(".stats"):
            n = int(f[1:-6])
            if nodes is not None and n not in nodes:
                continue
            with open(os.path.join(tmp, f)) as fh:
                vals = [int(l.split()[1]) for l in fh if l.startswith("rank_path_phases ")]
            out[n] = min(vals or [0])
    return out


def require_rank_phases(tmp, name, nodes=None):
    got = rank_phases(tmp, nodes)
    if not got or not all(got.values()):
        raise RuntimeError("%s: a daemon completed no rank-path phase (per node: %s)" % (name, got))
    return got


def scenario_cuda(tmp, seed):
    """Two daemons, 2 ranks per node: every forced path and the selector with every rank on the
    rank path, then a node of rank-path ranks beside a node of host-memory ranks, then on each
    node a rank-path rank beside a host-memory ring rank of the same group (the rank mover
    carries the whole pair, docs/rankpath.md "Ring and page ranks in one group"); every rank
    verifies every row and sum; the rank-path nodes' daemons count their phases."""
    runs = [(p, None) for p in ("native", "rail-only", "perm-only", "joint", "auto")]
    runs += [("joint", [0, 1]), ("auto", [2, 3]), ("joint", [0, 3]), ("perm-only", [1, 2])]
    # On the stand-in, the selector once more with GPU slabs (the test hook: each group's
    # carve-out a CUDA allocation lent by fd, imported by the ranks; docs/rankpath.md).
    gpu_run = len(runs) if driver() != "real" else -1
    if gpu_run >= 0:
        runs.append(("auto", None))
    for i, (path, ranks) in enumerate(runs):
        sub = os.path.join(tmp, "cuda%d" % i)
        os.makedirs(sub)
        c = Cluster(sub, 2, path=path, cuda_ranks=RankPath(driver(), ranks))
        if i == gpu_run:  # the daemons' environment only (the ranks keep the kernel stand-in)
            for n in range(c.nodes):
                c.node_env[n] = {"RAILWAVE_TEST_GPUDIRECT": "1", "RW_CUDA_DRIVER": cluster.FAKE_CUDA}
        try:
            c.start_all()
            outs = c.run_ranks("g.cuda", layers=4, steps=2, seed=seed + i, flags=["--empty"])
        finally:
            c.stop()
        on = range(c.nodes * GPUS) if ranks is None else ranks
        for r, o in outs.items():
            if ("(rank path)" in o) != (r in on):
                raise RuntimeError("rank %d: %s" % (r, o))
        got = require_rank_phases(sub, "cuda %s" % path, {r // GPUS for r in on})
        if i == gpu_run and not all("the groups' carve-outs in GPU 0's memory, lent by fd" in
                                    open(os.path.join(sub, "d%d.log" % n)).read()
                                    for n in range(c.nodes)):
            raise RuntimeError("cuda gpu slabs: a daemon did not make GPU carve-outs")
        print("ok   cuda %-9s rank-path ranks %s N=2 G=%d (%s)%s: rank-path phases per node %s"
              % (path, "all" if ranks is None else ranks, GPUS, seed + i,
                 " on GPU slabs" if i == gpu_run else "", got))


def scenario_stream(tmp, seed):
    """Slow rank GPUs (stand-in lag 25 ms, and 2 ms in one run), every path, then a daemon killed
    mid-phase: the rank's stream runs through."""
    real = driver() == "real"
    runs = [(p, 0) for p in ("joint", "auto")] if real else \
        [("native", 25), ("perm-only", 25), ("joint", 2), ("auto", 25)]
    for i, (path, lag) in enumerate(runs):
        sub = os.path.join(tmp, "stream%d" % i)
        os.makedirs(sub)
        c = Cluster(sub, 2, path=path, cuda_ranks=RankPath(driver()))
        if not real:
            c.env["RW_FAKE_CUDA_LAG_MS"] = str(lag)
        try:
            c.start_all()
            c.run_ranks("g.stream", layers=3, steps=2, seed=seed + i, flags=["--empty"])
        finally:
            c.stop()
        require_rank_phases(sub, "stream %s" % path)
        print("ok   stream %-9s the ranks' GPU %d ms late: every row and sum exact (%s)"
              % (path, lag, seed + i))
    # Rank 0's phase waits for rank 1, which never submits, when their daemon is killed.
    sub = os.path.join(tmp, "streamlost")
    os.makedirs(sub)
    c = Cluster(sub, 1, cuda_ranks=RankPath(driver()))
    if not real:
        c.env["RW_FAKE_CUDA_LAG_MS"] = "2"
    try:
        c.start_all()
        idle = c.rank(1, "g.streamlost", 1, 1, seed, mode="idle")
        line = b"-"
        while line and line.strip() != b"ready":
            line = idle.stdout.readline()
        p = c.rank(0, "g.streamlost", 1, 1, seed, mode="fail")
        line = b"-"
        while line and line.strip() != b"submitted":
            line = p.stdout.readline()
        time.sleep(0.3)  # the submit reaches the daemon (the kill works either way)
        c.kill(0)
        out = line.decode() + p.communicate(timeout=WAIT)[0].decode()
        idle.kill()
        idle.wait()
        idle.stdout.close()
        if p.returncode != 3 or "daemon lost: the rank path's stream ran through" not in out:
            raise RuntimeError("rank after its daemon died: rc %s: %s" % (p.returncode, out))
    finally:
        c.stop()
    print("ok   stream: daemon killed mid-phase, the library wrote the owed words, the stream ran "
          "through")


def exact_run(tmp, nodes, path, seed, rank_path):
    """One run of the noisy workload; returns each rank's dump file and output."""
    tag = "rank" if rank_path else "host"
    sub = os.path.join(tmp, "exact%d%s%s" % (nodes, path, tag))
    os.makedirs(sub)
    c = Cluster(sub, nodes, path=path, cuda_ranks=RankPath(driver()) if rank_path else None)
    dumps = {r: os.path.join(sub, "r%d.bin" % r) for r in range(nodes * GPUS)}
    try:
        c.start_all()
        outs = c.collect([(r, c.rank(r, "g.exact", 3, 2, seed,
                                     flags=["--noisy", "--dump", dumps[r]])) for r in dumps])
    finally:
        c.stop()
    if rank_path:
        require_rank_phases(sub, "exact N=%d %s" % (nodes, path))
    return dumps, outs


def scenario_exact(tmp, seed):
    """Full-mantissa expert outputs: each rank's combined rows on the rank path equal, bit for
    bit, the host mover's for the same workload (the owner's summation order is the protocol's),
    through 2 and 3 real daemons."""
    for i, (nodes, path) in enumerate([(2, "joint"), (3, "rail-only"), (3, "perm-only")]):
        host, houts = exact_run(tmp, nodes, path, seed + i, False)
        rank, routs = exact_run(tmp, nodes, path, seed + i, True)
        terms3 = order = size = 0
        for r in host:
            if not filecmp.cmp(host[r], rank[r], shallow=False):
                raise RuntimeError("N=%d %s: rank %d's combined rows differ between the host mover "
                                   "and the rank path" % (nodes, path, r))
            size += os.path.getsize(host[r])
            words = routs[r].strip().split()
            terms3 += int(words[words.index("tokens") - 1])
            order += int(words[words.index("changed") - 3])
        if terms3 == 0 or order == 0:
            raise RuntimeError("N=%d %s: the workload has %d tokens of >= 3 terms, %d of them "
                               "order-sensitive: nothing tested" % (nodes, path, terms3, order))
        print("ok   exact N=%d %-9s combined rows bit-equal to the host mover's (%d bytes; %d "
              "tokens of >= 3 terms, %d of them changed by another order) (%s)"
              % (nodes, path, size, terms3, order, seed + i))


def scenario_mixfail(tmp, seed):
    """test_dataflow's `rank`, `peer` and `timeout` where each node's ranks are one of each kind
    (ranks 0 and 3 on the rank path, 1 and 2 host-memory ring ranks of the same group): the
    killed or silent rank 3 is a rank-path one beside a ring rank, every survivor of both kinds
    names the failure, and the same key passes after."""
    for name, fn in (("rank", it.scenario_rank_dies), ("peer", it.scenario_peer_dies),
                     ("timeout", it.scenario_timeout)):
        sub = os.path.join(tmp, name)
        os.makedirs(sub)
        fn(sub, seed, cuda_ranks=RankPath(driver(), ranks=[0, 3]))
        got = require_rank_phases(sub, "mixfail " + name, {0, 3 // GPUS})
        print("     (%s with mixed nodes: rank-path phases per daemon %s)" % (name, got))


SCENARIOS = [("paths", it.scenario_paths), ("cuda", scenario_cuda), ("stream", scenario_stream),
             ("peer", it.scenario_peer_dies), ("flight", it.scenario_in_flight),
             ("rank", it.scenario_rank_dies), ("timeout", it.scenario_timeout),
             ("rail", it.scenario_rail), ("mixfail", scenario_mixfail), ("exact", scenario_exact)]
SHARED = ("paths", "peer", "flight", "rank", "timeout", "rail")  # test_dataflow's, cuda_ranks=


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.RAILWAVE):
        print("skip: railwaved, rw_rank or railwave not built")
        return 77
    real = driver() == "real"
    if not real and not os.path.exists(cluster.FAKE_KERN):
        print("skip: no GPU and no kernel stand-in built")
        return 77
    seed = cluster.test_seed()
    print("CUDA ranks on the rank path, the %s"
          % ("system's driver" if real else "kernel stand-in"))
    for name, fn, tmp in cluster.picked(SCENARIOS, "rwrp."):
        try:
            if name in SHARED:
                # flight's rows (96 tokens of 2048 fp32 at N = 4) want larger carve-outs
                big = name == "flight"
                fn(tmp, seed, cuda_ranks=RankPath(driver(), area_mib=96 if big else 8,
                                                  pool_mib=1024 if big else 256))
                got = require_rank_phases(tmp, name)
                print("     (%s: rank-path phases per daemon %s)" % (name, got))
            else:
                fn(tmp, seed)
        except Exception as e:  # report and fail
            if " rc 77: " in str(e):  # a rank found no CUDA or no rank path here
                print("skip: %s" % str(e).split(" rc 77: ", 1)[1].splitlines()[0][-200:])
                return 77
            cluster.print_failure(name, e)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
