#!/usr/bin/env python3
"""A page rank told its dispatch passed hears a later failure of that pair at its combine
(docs/rankpath.md "Failure"): two railwaved daemons, host page ranks (rw_pagerank host-cskip,
1 layer x 3 steps). Node 0 takes none of its ranks' done of step 1's dispatch
(RAILWAVE_TEST_DONE_DEAF=1: as if the poller's reports came after the failure), so its pair
waits in the flush with both ranks' done in their pages, and fails when its phase timeout
runs out. Its ranks had read their dispatch's status as ok and gone on to their combine; the
daemon must see their done in the pages and fail that combine with RW_E_PHASE naming the
pair's failure, as every rank of node 1 hears it, and step 2 passes for all. Before, node 0's
ranks were counted answered at the dispatch, the key left no tomb for them, and their combine
was refused "combine of layer 0 step 1: no dispatch of this rank waits for it" (RW_E_STATE),
so a trainer's retry votes disagreed (integration_rankpath `rail`, 1 run in 5-10 under load).
Run by tests/run as $b/test/svc_rankdone; exits 0 pass, 1 fail, 77 skip."""
import os
import sys
import tempfile

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

TIMEOUT_MS = 3000
check = cluster.Checks()


def body(c):
    world = 2 * c.gpus
    c.start_all()
    res = cluster.outputs([(r, c.pagerank(r, "done", 1, 3, 11, "host-cskip"))
                           for r in range(world)])
    for r, (rc, out) in sorted(res.items()):
        line = [ln for ln in out.splitlines() if ln.startswith("host-cskip: phase 4 failed")]
        check(rc == 0 and "verified" in out,
              "rank %d: steps 0 and 2 verified (rc %d): %r" % (r, rc, out[-300:]))
        check(len(line) == 1 and ": phase failed: " in line[0] and "timed out" in line[0]
              and "no dispatch" not in line[0],
              "rank %d: step 1's dispatch passed, its combine failed with RW_E_PHASE naming the "
              "timeout: %r" % (r, line or out[-300:]))
    check("test switch RAILWAVE_TEST_DONE_DEAF" in c.log(0), "node 0 ran with the switch")
    check("no dispatch of this rank waits" not in c.log(0) + c.log(1),
          "no combine refused as one no dispatch waits for")
    c.stop()


def main():
    if not cluster.built(cluster.DAEMON, cluster.PAGERANK):
        print("skip: railwaved or rw_pagerank not built")
        return 77
    c = cluster.Cluster(tempfile.mkdtemp(prefix="rw-rankdone-"), 2, rails=2,
                        extra={"group_area_mib": 1, "group_pool_mib": 10,
                               "phase_timeout_ms": TIMEOUT_MS})
    c.node_env[0] = {"RAILWAVE_TEST_DONE_DEAF": "1"}
    return check.run(c, lambda: body(c))


if __name__ == "__main__":
    sys.exit(main())
