#!/usr/bin/env python3
"""The rank path's phases ask no host function and no daemon kernel (docs/rankpath.md: "There is
no host function (cuLaunchHostFunc), no eventfd from a GPU and no daemon kernel on a phase's
path"), checked by counting what each process asks of the GPU.

Two real railwaved on loopback tcp (2 nodes, 2 rails, 2 ranks per node) and every rank load the
counting CUDA stand-in (tests/integration/libfakecuda_kern.so through $RW_CUDA_DRIVER; each
process's counts of host functions, kernel launches, stream work and 64-bit word writes and waits
mapped at $RW_FAKE_CUDA_COUNTS/<pid>, tests/cuda/fake_cuda_base.h).

1. A group of four page ranks (tests/integration/rw_pagerank.c, mode `lib`: librailwave's
   rw_client_rank_dispatch and rw_client_rank_combine, the count, pack, forward, gather and
   reduce kernels on the stand-in's stream) runs 6 dispatches and their combines, each verified
   by the rank. Across those phases each daemon's counts stay where they were: no host function,
   no kernel launch, no stream work of any kind. Each rank made no host function call, and did
   launch its kernels and write and wait on its page's words on its stream (its counts are live).
2. The same daemons then carry a CUDA-mover job (four rw_rank --cuda, every row and sum
   verified): each daemon's host functions and kernel launches go up, so the counter the first
   part reads as zero is the one the daemon's GPU work moves.
Run by tests/run as $b/test/svc_nohost; exits 0 pass, 1 fail, 77 skip."""
import os
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

PAGERANK = cluster.PAGERANK
FAKE_KERN = cluster.FAKE_KERN
KEYS = cluster.FAKE_COUNT_KEYS
check = cluster.Checks()


counts = cluster.fake_cuda_counts


def delta(after, before):
    return {k: after[k] - before[k] for k in KEYS}


def scenario(tmp, seed):
    folder = os.path.join(tmp, "counts")
    os.mkdir(folder)
    nodes, rails = 2, 2
    c = cluster.Cluster(tmp, nodes, rails=rails, cuda_ranks=FAKE_KERN,
                        extra={"group_area_mib": 1, "group_pool_mib": 10})
    c.env["RW_FAKE_CUDA_COUNTS"] = folder
    try:
        c.start_all()
        daemons = {n: c.procs[n].pid for n in range(nodes)}
        before = {n: counts(folder, pid) for n, pid in daemons.items()}

        ranks = [(r, c.pagerank(r, "lib", 2, 3, seed, "lib")) for r in range(nodes * c.gpus)]
        outs = c.collect(ranks)
        check(all("verified" in o for o in outs.values()),
              "6 dispatches and their combines through librailwave's rank path, every rank "
              "verified them: %s" % [o.splitlines()[-1:] for o in outs.values()])
        # the phases are over on both daemons (the page ranks waited for their last done)
        for n in range(nodes):
            deadline = time.time() + cluster.WAIT
            while time.time() < deadline and "rank_path_busy 0\n" not in c.stats(n):
                time.sleep(0.01)
            st = c.stats(n)
            check("rank_path_busy 0\n" in st and "rank_path_phases 0\n" not in st,
                  "daemon %d ran rank-path phases and has none in flight" % n)
        after = {n: counts(folder, pid) for n, pid in daemons.items()}
        for n in range(nodes):
            d = delta(after[n], before[n])
            check(all(v == 0 for v in d.values()),
                  "daemon %d during the rank-path phases: no host function, no kernel, no stream "
                  "work (%s)" % (n, d))
        for r, p in ranks:
            k = counts(folder, p.pid)
            check(k["host_fn"] == 0,
                  "rank %d called no host function on its stream (%s)" % (r, k))
            check(k["kernel"] > 0 and k["word_write"] > 0 and k["word_wait"] > 0,
                  "rank %d launched its kernels and wrote and waited on its words (%s)" % (r, k))

        # the counter is live: a CUDA-mover job on the same daemons moves it
        c.run_ranks("mover", 2, 3, seed + 1)
        check(True, "a CUDA-mover job (4 rw_rank --cuda) passed every verified phase")
        for n in range(nodes):
            d = delta(counts(folder, daemons[n]), after[n])
            check(d["host_fn"] > 0 and d["kernel"] > 0,
                  "daemon %d during the CUDA-mover job: host functions and kernel launches "
                  "counted (%s)" % (n, d))
        c.stop()
        check(True, "every daemon exited 0")
    finally:
        if check.fails:
            print(c.logs())
        for n in list(c.procs):
            c.kill(n)


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.RAILWAVE, PAGERANK):
        print("skip: railwaved, rw_rank, rw_pagerank or railwave not built")
        return 77
    if not os.path.exists(FAKE_KERN):
        print("skip: no kernel stand-in (%s; built where nvcc embeds the kernels)" % FAKE_KERN)
        return 77
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or int(time.time()) % (1 << 30)
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    with tempfile.TemporaryDirectory(prefix="rw-nohost.", dir="/tmp") as tmp:
        check.scenarios([("rank path against the CUDA mover", scenario)], tmp, seed)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
