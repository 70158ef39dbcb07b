#!/usr/bin/env python3
"""Host ranks on the rank path against real railwaved daemons (docs/rankpath.md "Host ranks"):
ranks whose buffers are host memory open the rank path with RW_RANK_HOST (no CUDA) and run
dispatch and combine through librailwave's calls, the pack, forward, gather and reduce done by
the rank's own CPU (rank/host.c, cuda/rank_cpu.c) straight into and out of the group's
slabs; the daemons only plan, post and track. tests/integration/rw_pagerank.c mode host.

1. Two daemons (2 ranks a node, 2 rails): a group of four host ranks over 6 phases of the host
   job's workload (tests/lib/workload), every data path asked for in turn, each dispatch
   followed by its combine: every received row, its metadata (source, token, top-k ids and
   weights), each expert's count and every token's combined row checked against the workload,
   which a host job of four rw_rank on the host mover (group job, the same seed and shape)
   verifies at the same time on the same daemons: both paths deliver the same rows and sums.
   The daemons' stats show the rank-path phases counted and none in flight after. Odd layers
   wait by looking with timeout 0 until done (each look drives the phase as far as it can); the
   same 6 phases with each combine left in flight when the next dispatch is made (that call
   ends it first, as a stream's order would).
2. Failures, named as on the CUDA rank path: a rank whose dispatch has a top-k id past the
   experts gets RW_E_TOKENS naming the token, and the group's phase fails on the others at
   once (each daemon's log naming that rank), while it stays connected (awaited far below the phase timeout); a
   new group's phases pass. A rank killed after its submit, before its
   pack: the phase fails on the three others and their calls return; a new group's phases
   pass. A peer daemon killed (SIGKILL) while a group runs phases: every rank's phase fails and
   its wait returns (node 0: the survivor's failure; node 1: the library's watcher,
   RW_E_CLOSED).
   A group whose ranks on each node are a host rank and a CUDA rank (the kernel stand-in):
   the same 6 phases verified on every rank. The benchmark's rank (rw_bench_rank
   --host-rank-path) verifies 5 pairs over every path at DeepSeek-V3's shape, 64 tokens a rank,
   its copies and sums split over 3 threads.
3. Three daemons (2 ranks a node, 2 rails): six host ranks, the same checks beside a host job.
Run by tests/run as $b/test/svc_hostrank; exits 0 pass, 1 fail, 77 skip."""
import os
import shutil
import subprocess
import sys
import tempfile

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

PAGERANK = cluster.PAGERANK
BENCH = os.path.join(B, "tools", "rw_bench_rank")
# the CUDA stand-in with the rank kernels on the CPU (built where nvcc embeds the kernels)
FAKE_KERN = os.path.join(B, "tests", "integration", "libfakecuda_kern.so")
SEED = 5  # the workload's seed: the page ranks' (rw_pagerank's) and the host job's
check = cluster.Checks()
# A phase left to its timeout is not awaited by the bad-id case: its deadline is far below.
PHASE_TIMEOUT_S, BAD_DEADLINE_S = 120, 30


def host_job(c, group, layers, steps, modes=None, ranks=None, env=None):
    """Every rank of `group` (or those of `ranks`) a host rank on the rank path (rw_pagerank
    host, or its mode in `modes`)."""
    modes = modes or {}
    ranks = range(c.nodes * c.gpus) if ranks is None else ranks
    return [(r, c.pagerank(r, group, layers, steps, SEED, modes.get(r, "host"), env))
            for r in ranks]


def passed(res, what):
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items()
           if v[0] != 0 or "rank path, verified" not in v[1]}
    check(not bad, "%s: every rank verified its dispatches and combines %s" %
          (what, bad or ""))


def verified_beside_host_job(c, group, what):
    """A group of host ranks on the rank path and a host job on the host mover, the same
    workload, at the same time: both verify every row and sum."""
    job = [(r, c.rank(r, group + "-ring", 2, 3, SEED)) for r in range(c.nodes * c.gpus)]
    res = cluster.outputs(host_job(c, group, 2, 3))
    passed(res, what)
    check(all("(0 rows" not in v[1] for v in res.values()), "%s: every host rank received rows"
          % what)
    try:
        c.collect(job)
        check(True, "%s: the host job on the host mover verified the same workload" % what)
    except RuntimeError as e:
        check(False, "%s: the host job failed: %s" % (what, e))


def on_cluster(tmp, nodes, body, extra=None):
    """Daemons with group carve-outs (the host ranks' records live in their group's slabs; 72
    MiB a rail holds the benchmark's DeepSeek-V3 phase, tcp maps no page before it is written),
    the scenario `body(c)`, then every daemon still running must stop cleanly; logs on a
    failure."""
    os.makedirs(tmp)
    c = cluster.Cluster(tmp, nodes, rails=2, extra=dict({"group_area_mib": 72,
                                                         "group_pool_mib": 720}, **(extra or {})))
    fails = len(check.fails)
    try:
        c.start_all()
        body(c)
        c.stop()
        check(True, "every daemon still running exited 0")
    finally:
        if len(check.fails) > fails:
            print(c.logs())
        for n in list(c.procs):
            c.kill(n)


def two_daemons(c):
    verified_beside_host_job(c, "run", "2 daemons, 6 phases")
    ph = c.stats(0, "stats phases")
    for path in ("native", "rail-only", "perm-only"):
        line = [l for l in ph.splitlines()
                if l.startswith("path=%s kind=combine " % path)]
        check(line and " ok=0 " not in line[0] and " failed=0 " in line[0],
              "the host ranks' combines ran on path %s: %s" % (path, line))

    # each combine left in flight when the next dispatch is made (that call ends it first)
    passed(cluster.outputs(host_job(c, "pipe", 2, 3, {r: "host-pipe" for r in range(4)})),
           "each combine ended by the next dispatch's call")

    # the benchmark's rank (tools/rw_bench_rank --host-rank-path: every row, count and sum
    # checked) over every data path, DeepSeek-V3's shape (hidden 7168, 256 experts, top-8) at 64
    # tokens a rank: its pack, forward, gather and reduce split over 3 threads (each step moves
    # megabytes, past the 256 KiB a thread)
    bench = [(r, subprocess.Popen(
        [BENCH, "--socket", c.cfg["nodes"][r // c.gpus]["ipc_socket"], "--group", "bench",
         "--rank", str(r), "--steps", "5", "--paths", "native,rail-only,perm-only,joint,auto",
         "--host-rank-path", "--nodes", "2", "--gpus", str(c.gpus), "--rails", "2",
         "--experts", "256", "--topk", "8", "--hidden", "7168", "--tokens", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(c.env, RAILWAVE_RANK_THREADS="3"))) for r in range(4)]
    res = cluster.outputs(bench)
    check(all(v[0] == 0 and "verified rank" in v[1] and "(host rank path)" in v[1]
              for v in res.values()), "rw_bench_rank --host-rank-path: 5 pairs verified on "
          "every rank, 3 threads %s" % {r: v[1][-300:] for r, v in res.items() if v[0] != 0})

    # a group mixing host ranks and CUDA ranks (the kernel stand-in) on each node
    if os.path.exists(FAKE_KERN):
        res = cluster.outputs(host_job(c, "mixed", 2, 3, {1: "lib", 3: "lib"},
                                       env=dict(c.env, RW_CUDA_DRIVER=FAKE_KERN)))
        passed(res, "host ranks 0 and 2 beside CUDA ranks 1 and 3 in one group")
        check("CUDA rank path, verified" in res[1][1] and "host rank path, verified" in
              res[0][1], "the mixed group ran both kinds")
    else:
        print("skip the mixed group: no kernel stand-in (%s)" % FAKE_KERN)

    # a rank killed after its submit, before its pack
    res = cluster.outputs(host_job(c, "die", 1, 1, {0: "host-one", 1: "host-die",
                                                    2: "host-one", 3: "host-one"}))
    check(res[1][0] == 3 and "dying at submit 1" in res[1][1], "rank 1 died after submit")
    others = [res[r] for r in (0, 2, 3)]
    check(all(v[0] == 0 and "host-one: phase 1 failed" in v[1] for v in others),
          "the phase failed on the other ranks and their waits returned: %s" % others)
    passed(cluster.outputs(host_job(c, "afterdie", 1, 2)),
           "after the death, a new group's phases")

    for n in range(2):
        st = c.stats(n)
        check("rank_path_busy 0\n" in st and "rank_path_phases 0\n" not in st,
              "daemon %d: no rank-path phase in flight, the completed ones counted" % n)

    # daemon 1 killed while a group of host ranks runs phases
    peer = host_job(c, "peer", 1, 1000000, {r: "host-until" for r in range(4)})
    line = peer[0][1].stdout.readline().decode()
    check("host-until: running" in line, "the host ranks of group peer run (%r)" % line)
    c.kill(1)
    res = cluster.outputs(peer)
    check(all(v[0] == 0 and "host-until: phase" in v[1] and "failed" in v[1]
              for v in res.values()),
          "daemon killed mid-run: every host rank's phase failed and its wait returned: %s"
          % {r: (v[0], v[1][-160:]) for r, v in res.items()})
    check(any("closed" in res[r][1] or "gone" in res[r][1] for r in (2, 3)),
          "the killed daemon's ranks: RW_E_CLOSED (%s)" % [res[r][1][-120:] for r in (2, 3)])
    c.procs.pop(1, None)


def bad_id(c):
    """A top-k id past the experts, on daemons whose phase timeout is PHASE_TIMEOUT_S: this
    rank's submit is refused, named, and the refusal fails the group's phase on the three
    others at once, naming the rank, while the bad rank stays connected (RW_PAGERANK_HOLD): the others' answers are awaited for BAD_DEADLINE_S only; no
    node is dropped, a new group's phases pass."""
    held = os.path.join(c.tmp, "bad-release")
    bad = host_job(c, "bad", 1, 1, {0: "host-bad"}, ranks=[0],
                   env=dict(c.env, RW_PAGERANK_HOLD=held))
    others = host_job(c, "bad", 1, 1, {r: "host-one" for r in (1, 2, 3)}, ranks=[1, 2, 3])
    res = {}
    for r, p in others:
        try:
            res[r] = (p.communicate(timeout=BAD_DEADLINE_S)[0].decode(), p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            res[r] = (p.communicate()[0].decode(), None)
    open(held, "w").close()
    res0 = cluster.outputs(bad)[0]
    check(res0[0] == 0 and "host-bad: phase 1 failed: " in res0[1] and
          "token 1 has a top-k expert id" in res0[1],
          "the bad id's rank: RW_E_TOKENS naming the token (%r)" % res0[1][:200])
    check(all(res[r][1] == 0 and "host-one: phase 1 failed: " in res[r][0] for r in (1, 2, 3)),
          "the bad id failed the group's phase on the other ranks while it stayed: %s" %
          {r: (v[1], v[0].splitlines()[:1]) for r, v in res.items()})
    check(any("group bad " in l and "node 0 (n0): local rank 0: token 1 has a top-k id outside"
              in l for l in c.log(1).splitlines()),
          "the other node's daemon names the bad rank in the group's failure: %s" %
          [l for l in c.log(1).splitlines() if "group bad " in l])
    check("token 1 has a top-k id outside" in c.log(0), "the daemon's log names the token")
    passed(cluster.outputs(host_job(c, "afterbad", 1, 2)),
           "after the bad id, a new group's phases")


def three_daemons(c):
    verified_beside_host_job(c, "three", "3 daemons, 6 phases")


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.RAILWAVE, PAGERANK, BENCH):
        print("skip: railwaved, rw_rank, rw_pagerank, rw_bench_rank or railwave not built")
        return 77
    tmp = tempfile.mkdtemp(prefix="rw-hostrank-")
    check.scenarios([("two daemons", lambda t, _: on_cluster(t + "/2", 2, two_daemons)),
                     ("a bad id", lambda t, _: on_cluster(
                         t + "/bad", 2, bad_id, {"phase_timeout_ms": PHASE_TIMEOUT_S * 1000})),
                     ("three daemons", lambda t, _: on_cluster(t + "/3", 3, three_daemons))],
                    tmp, 0)
    if not check.fails:
        shutil.rmtree(tmp, ignore_errors=True)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
