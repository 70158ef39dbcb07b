#!/usr/bin/env python3
"""Ring and page ranks in one group, on the same nodes, against real railwaved daemons
(docs/rankpath.md "Ring and page ranks in one group"): the page ranks are
tests/integration/rw_pagerank (the CPU playing the stream, or its `lib` mode: librailwave's rank
path on the kernel stand-in), the ring ranks tests/integration/rw_rank with host buffers. Every
rank checks every row it received, its metadata, each expert's count and every token's combined
row against the workload (tests/lib/workload.h) — the checks an all-ring and an all-page run pass,
so the sums have the same bits whatever kind of rank each term came from.

1. Two daemons, four ranks a node on two rails, the kinds interleaved so that each rail's records
   of a node come from a page rank and a ring rank, in both orders (node 0: page, ring, ring,
   page; node 1: ring, page, page, ring): 2 layers x 3 steps, every phase asking for a data path
   in turn (rw_rank --paths), every rank verified; the daemons' stats show dispatches and
   combines passed on the native, rail-only and perm-only paths. The same with the page ranks in
   `lib` mode (count, pack, forward, gather and reduce kernels on the CUDA stand-in). And with
   the ring ranks first: each node's pair opened by a ring rank before any rank there held a
   page (the host mover's), moved to the rank path's mover when the first page rank's dispatch
   came, every rank verified.
2. A lying page rank (rank 0's pack writes a record with a token past its tokens): the phase
   fails on every rank of both kinds on both nodes, each told rank 0's record (a ring rank in its
   error's message, a page rank in the daemon's notice on its control socket), the daemon's log
   naming it too; no node dropped.
3. A ring rank killed (rank 1, joined, SIGKILL) while the others' phase waits for it: the phase
   fails on every page rank (their streams run through) and on every other ring rank, each told
   that rank 1 left; a new mixed group's phases pass after each failure.
4. Three daemons, two ranks a node, page (CPU and lib) and ring ranks on every node: 2 layers x
   3 steps, every rank verified; 48 experts, so a ring rank's per-expert counts go to the head
   of its output (more than a completion carries).
5. Ring ranks with CUDA buffers (rw_rank --cuda on the IPC stand-in, one stream-ordered) beside
   a CPU-played and a lib page rank, 64 experts: the daemons copy their inputs to pinned host
   memory and their outputs back, per-expert counts included (and write the stream-ordered
   rank's flag); every rank verified, also with the ring ranks first (each node's pair moved
   from the host mover to the rank mover).
Run by tests/run as $b/test/svc_rankmix; exits 0 pass, 1 fail, 77 skip."""
import os
import shutil
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

PAGERANK = cluster.PAGERANK
FAKE_KERN = os.path.join(B, "tests", "integration", "libfakecuda_kern.so")
# the CUDA stand-in whose IPC works across processes: CUDA ring ranks' buffers, the daemons' copies
FAKE_IPC = os.path.join(B, "tests", "integration", "libfakecuda_ipc.so")
# On a GPU (scripts/gpu-carry): RW_RANKPAGE_DRIVER=libcuda.so.1 runs the lib page ranks' kernels
# there, RW_RANKMIX_CUDA=real the CUDA ring ranks' buffers and the daemons' copies.
KERN_DRIVER = os.environ.get("RW_RANKPAGE_DRIVER", FAKE_KERN)
LIB = "/" not in KERN_DRIVER or os.path.exists(KERN_DRIVER)
RING_CUDA = "real" if os.environ.get("RW_RANKMIX_CUDA") == "real" else FAKE_IPC
check = cluster.Checks()


class Mixed:
    """One group of a cluster whose ranks are page ranks (`page`: rank -> rw_pagerank mode) and
    ring ranks (`ring`: rank -> rw_rank mode), started together."""

    def __init__(self, c, group, layers, steps, page, ring, seed=5, go=None, ring_flags=None):
        self.c = c
        env = dict(c.env, RW_CUDA_DRIVER=KERN_DRIVER)
        if go:  # the page ranks join, then wait for the file before they take their pages
            env["RW_PAGERANK_GO"] = go
        self.page = {r: c.pagerank(r, group, layers, steps, seed, mode, env)
                     for r, mode in page.items()}
        self.ring = {r: c.rank(r, group, layers, steps, seed, mode=mode,
                               flags=(["--paths"] if mode == "ok" else []) +
                               (ring_flags or {}).get(r, []))
                     for r, mode in ring.items()}

    def outputs(self):
        return cluster.outputs(sorted(list(self.page.items()) + list(self.ring.items())))


def kinds(c, page_ranks):
    """Every rank of the cluster: rank -> 'page' or 'ring'."""
    return {r: "page" if r in page_ranks else "ring" for r in range(c.nodes * c.gpus)}


def run_ok(c, group, page_ranks, page_mode="ok", lib_ranks=(), go=None, ring_flags=None):
    """A mixed group's 2 layers x 3 steps; every rank must verify each. go: the page ranks take
    their pages once the ring ranks' first dispatch opened each node's pair."""
    k = kinds(c, page_ranks)
    lib_ranks = lib_ranks if LIB else ()  # no kernels to run them on: played by the CPU
    m = Mixed(c, group, 2, 3, {r: "lib" if r in lib_ranks else page_mode
                               for r in k if k[r] == "page"},
              {r: "ok" for r in k if k[r] == "ring"}, go=go, ring_flags=ring_flags)
    if go:
        deadline = time.time() + cluster.WAIT
        while time.time() < deadline and not all(
                "L0 s0 dispatch" in c.log(n) and "submitted first: the host mover" in c.log(n)
                for n in range(c.nodes)):
            time.sleep(0.01)
        open(go, "w").close()
    res = m.outputs()
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
    check(not bad, "%s: every rank of both kinds verified every dispatch and combine %s"
          % (group, bad or ""))
    check(all("(0 rows" not in v[1] for r, v in res.items() if k[r] == "page"),
          "%s: every page rank received rows" % group)
    return res


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, PAGERANK):
        print("skip: railwaved, rw_rank or rw_pagerank not built")
        return 77
    tmp = tempfile.mkdtemp(prefix="rw-rankmix-")
    c = None
    try:
        # 1-3: two daemons, four ranks a node on two rails (local ranks 0, 2 on rail 0; 1, 3 on 1)
        c = cluster.Cluster(tmp, 2, gpus=4, rails=2, extra={
            "group_area_mib": 1, "group_pool_mib": 10, "log_level": "debug"})
        c.start_all()
        page = (0, 3, 5, 6)
        # the ring ranks first: each node's pair opened by the host mover, then moved
        run_ok(c, "late", page, go=os.path.join(tmp, "late.go"))
        check(all("moved to the rank path mover" in c.log(n) for n in range(c.nodes)),
              "late: each node's pair, opened by a ring rank before any rank there held a page, "
              "moved to the rank path's mover at the first page rank's dispatch")
        run_ok(c, "mix", page)
        for path in ("native", "rail-only", "perm-only"):
            for kind in ("dispatch", "combine"):
                check(c.phases_passed(0, path, kind),
                      "the mixed group ran %s on path %s" % (kind, path))
        if LIB:
            run_ok(c, "mixlib", page, page_mode="lib")
        else:
            print("skip the lib page ranks: no kernel stand-in (%s)" % KERN_DRIVER)

        # 2: a lying page rank
        k = kinds(c, page)
        res = Mixed(c, "lie", 1, 1, {r: "lie" for r in k if k[r] == "page"},
                    {r: "fail" for r in k if k[r] == "ring"}).outputs()
        check(all(v[0] == 0 and ("lie: phase 1 failed: phase failed" in v[1]
                                 if k[r] == "page" else "failed as expected" in v[1]) and
                  "rank 0: record 0 to node" in v[1] and "past the rank's tokens" in v[1]
                  for r, v in res.items()),
              "a lying page rank: the phase failed on every rank of both kinds, each told "
              "rank 0's record: %s" % {r: (v[0], v[1][-160:]) for r, v in res.items()})
        check("rank 0: record 0 to node" in c.log(0) and "its token is past the rank's tokens"
              in c.log(0), "the daemon's log names the lying rank and its record")
        check(": down (" not in c.log(0) + c.log(1), "no node was dropped for the lying rank")
        run_ok(c, "afterlie", page)

        # 3: a ring rank killed while the others' phase waits for it
        idle = c.rank(1, "kill", 1, 1, 5, mode="idle")
        check("ready" in idle.stdout.readline().decode(), "ring rank 1 joined group kill")
        m = Mixed(c, "kill", 1, 1, {r: "one" for r in k if k[r] == "page"},
                  {r: "fail" for r in k if k[r] == "ring" and r != 1})
        deadline = time.time() + cluster.WAIT  # until a page rank's phase is in on node 0
        while time.time() < deadline and "rank_path_busy 0\n" in c.stats(0):
            time.sleep(0.01)
        idle.kill()
        idle.communicate()
        res = m.outputs()
        check(all(v[0] == 0 and ("one: phase 1 failed" in v[1] if k[r] == "page"
                                 else "failed as expected" in v[1]) and
                  "local rank 1 left" in v[1] for r, v in res.items()),
              "a ring rank killed mid-phase: the phase failed on every other rank of both "
              "kinds, each told that rank 1 left, the page ranks' streams ran through: %s"
              % {r: (v[0], v[1][-160:]) for r, v in res.items()})
        check("local rank 1 left" in c.log(0), "the daemon's log names the rank that left")
        run_ok(c, "afterkill", page)
        c.stop()
        check(True, "both daemons exited 0")

        # 4: three daemons, two ranks a node: CPU-played and lib page ranks beside ring ranks
        os.mkdir(os.path.join(tmp, "three"))
        c = cluster.Cluster(os.path.join(tmp, "three"), 3, gpus=2, rails=2, experts=48,
                            extra={"group_area_mib": 1, "group_pool_mib": 10})
        c.start_all()
        run_ok(c, "three", (0, 3, 4), lib_ranks=(3, 4))
        c.stop()
        check(True, "the three daemons exited 0")

        # 5: ring ranks with CUDA buffers (the IPC stand-in), one of them stream-ordered
        if RING_CUDA == "real" or os.path.exists(FAKE_IPC):
            os.mkdir(os.path.join(tmp, "cuda"))
            c = cluster.Cluster(os.path.join(tmp, "cuda"), 2, gpus=2, rails=2, experts=64,
                                cuda_ranks=RING_CUDA,
                                extra={"group_area_mib": 1, "group_pool_mib": 10,
                                       "log_level": "debug"})
            c.start_all()
            for group, go in (("cudalate", os.path.join(tmp, "cuda.go")), ("cuda", None)):
                res = run_ok(c, group, (0, 3), lib_ranks=(3,), go=go,
                             ring_flags={2: ["--stream-ordered"]})
                check(all("(CUDA buffers)" in res[r][1] for r in (1, 2)),
                      "%s: the ring ranks ran with CUDA buffers: %s"
                      % (group, [res[r][1][-120:] for r in (1, 2)]))
            check(all("moved to the rank path mover" in c.log(n) for n in range(c.nodes)),
                  "cudalate: each node's pair, opened by a CUDA ring rank on the host mover, "
                  "moved to the rank path's mover")
            c.stop()
            check(True, "both daemons exited 0")
        else:
            print("skip CUDA ring ranks: no %s" % FAKE_IPC)
    except RuntimeError as e:
        check(False, str(e))
    finally:
        if c:
            for n in list(c.procs):
                c.kill(n)
        if not check.fails:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print("logs kept in %s\n%s" % (tmp, c.logs() if c else ""))
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
