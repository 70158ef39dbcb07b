#!/usr/bin/env python3
"""A daemon's own silence is not its peer's (service/mesh/mesh_session.c mesh_hb_cb): two real
railwaved daemons on loopback (heartbeat_interval_ms 100, heartbeat_timeout_ms 1000) and real
rank processes (tests/integration/rw_rank.c):

1. Both daemons stopped together (SIGSTOP) for 1.5 s, as a loaded machine or a throttled cgroup
   stops them, then continued: each wakes with the other's heartbeats unread in its socket and
   must read them before judging the silence; no peer goes down, no connection is made again,
   and a job then verifies every phase. (Before the fix both woke, timed each other out, and
   the job running then failed "peer went down": svc_slabs under load.)
2. One daemon stopped for 1.5 s: the other, whose loop ran all along, hears nothing and takes
   it down ("nothing heard for 1000 ms"); once continued, the mesh forms again and a job
   verifies. The grace a late tick gets does not hide a peer's real silence.
Every daemon then stops cleanly on SIGTERM (exit 0).
Run by tests/run as $b/test/svc_stall; exits 0 pass, 1 fail, 77 skip."""
import os
import signal
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

check = cluster.Checks()
STOP_S = 1.5  # > heartbeat_timeout_ms (cluster.py: 1000)


def peers(c, n):
    return " ".join(c.stats(n, "stats peers").split())


def pause(c, nodes):
    for n in nodes:
        c.procs[n].send_signal(signal.SIGSTOP)
    time.sleep(STOP_S)
    for n in nodes:
        c.procs[n].send_signal(signal.SIGCONT)


def scenario_both(tmp, seed):
    c = cluster.Cluster(os.path.join(tmp, "both"), 2)
    try:
        c.start_all()
        pause(c, range(c.nodes))
        outs = c.run_ranks("job.both", 2, 4, seed)
        check(all("4 steps x 2 layers verified" in outs[r] for r in outs),
              "both stopped together for %.1f s: a job afterwards verified every phase" % STOP_S)
        for n in range(c.nodes):
            st = peers(c, n)
            check("state=up" in st and "reconnects=0" in st,
                  "node %d took no peer down and connected again to none: %s" % (n, st))
    finally:
        c.stop()
    for n in range(c.nodes):
        check("nothing heard for" not in c.log(n),
              "node %d logged no peer timed out" % n)


def scenario_one(tmp, seed):
    c = cluster.Cluster(os.path.join(tmp, "one"), 2)
    try:
        c.start_all()
        pause(c, [1])
        c.wait_mesh()
        outs = c.run_ranks("job.one", 2, 4, seed)
        check(all("4 steps x 2 layers verified" in outs[r] for r in outs),
              "node 1 stopped alone, then back: a job verified every phase")
    finally:
        c.stop()
    check("peer=n1: down (timed out): nothing heard for 1000 ms" in c.log(0),
          "node 0, running all along, took the silent node 1 down")


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK):
        print("skip: railwaved or rw_rank not built")
        return 77
    seed = cluster.test_seed()
    with tempfile.TemporaryDirectory(prefix="rwstall.", dir="/tmp") as tmp:
        for d in ("both", "one"):
            os.mkdir(os.path.join(tmp, d))
        check.scenarios([("both stopped", scenario_both), ("one stopped", scenario_one)],
                        tmp, seed)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
