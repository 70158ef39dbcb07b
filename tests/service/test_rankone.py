#!/usr/bin/env python3
"""A group whose ranks are all on one node, on the rank path (docs/rankpath.md "A phase"):
railwaved alone (one node), its group of page ranks (tests/integration/rw_pagerank: each plays
its stream from the CPU; and librailwave's rank path on the kernels' CPU stand-ins) over 6
phases asking each data path in turn, every dispatched row and every combined row checked,
with 2 and with 4 ranks on the node; a group mixing page ranks and host-memory ring ranks
(rw_rank, the daemon playing their part) on that node passes too.
Every record of a one-node group is local: this is the local area alone.
Run by tests/run as $b/test/svc_rankone; exits 0 pass, 1 fail, 77 skip."""
import os
import sys
import tempfile

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

FAKE_KERN = os.path.join(B, "tests", "integration", "libfakecuda_kern.so")
check = cluster.Checks()


def unverified(res):
    """The ranks that failed or did not verify every phase: rank -> (exit code, output tail)."""
    return {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}


def one_node(gpus):
    tmp = tempfile.mkdtemp(prefix="rw-rankone-")
    c = cluster.Cluster(tmp, 1, gpus=gpus, rails=2,
                        extra={"group_area_mib": 1, "group_pool_mib": 10})
    try:
        c.start_all()

        def page_job(group, mode, env=None, ranks=range(gpus)):
            return [(r, c.pagerank(r, group, 2, 3, 5, mode, env=env)) for r in ranks]

        res = cluster.outputs(page_job("run", "ok"))
        bad = unverified(res)
        check(not bad, "1 node x %d page ranks: 6 phases, every row verified %s" %
              (gpus, bad or ""))
        for path in ("native", "rail-only", "perm-only"):
            for kind in ("dispatch", "combine"):
                check(c.phases_passed(0, path, kind),
                      "1 node x %d: the rank path ran %s on path %s" % (gpus, kind, path))
        if os.path.exists(FAKE_KERN):
            res = cluster.outputs(page_job("lib", "lib", dict(c.env, RW_CUDA_DRIVER=FAKE_KERN)))
            bad = unverified(res)
            check(not bad, "1 node x %d: librailwave's rank path (kernel stand-ins), 6 phases "
                  "verified %s" % (gpus, bad or ""))
        page = range(0, gpus, 2)  # even ranks on the page, odd ones on their rings
        mixed = page_job("mix", "ok", ranks=page) + [
            (r, c.rank(r, "mix", 2, 3, 5, flags=["--paths"])) for r in range(1, gpus, 2)]
        res = cluster.outputs(mixed)
        bad = unverified(res)
        check(not bad, "1 node x %d: a group of page and ring ranks, 6 phases, every rank "
              "verified %s" % (gpus, bad or ""))
        c.stop()
    except RuntimeError as e:
        check(False, str(e))
    finally:
        c.finish(check.fails)


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.LIBRAILWAVE, cluster.PAGERANK):
        print("skip: railwaved, rw_rank, rw_pagerank or librailwave not built")
        return 77
    for gpus in (2, 4):
        one_node(gpus)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
