#!/usr/bin/env python3
"""A page rank that leaves fails its group's pair on every node at once (docs/dataflow.md
"Failures"): two railwaved daemons with a 60 s phase timeout, a group of page ranks
(tests/integration/rw_pagerank) in which rank 1 runs its first dispatch to its done and exits
before its combine while its node still flushes that dispatch (rank 0 of the node writes its
done 0.5 s late). Every other rank of both nodes must see its phase fail well before the
timeout (under 20 s), and a new group's phases must pass right after. A survivor on
librailwave's rank path gets the reason from rw_client_rank_message.
Then a rank that leaves between two steps and joins again past the next one (host ranks on
librailwave's rank path, rw_pagerank host-rejoin: steps 0 and 2, while the others run 0, 1, 2,
as railwave's package does when its own input was refused): step 1 can never gather on its
node, so it fails on every other rank at once (well under the phase timeout), naming the
rank that joined again, and step 2 passes for all; once with the others' step 1 opening its
node's pair first, once with the rejoined rank's step 2 first, once with rank 1 leaving while
its node's pair of step 1 is open (its leave fails that pair). Before, step 1 waited for the
phase timeout on the others and step 2 was refused to the rejoined rank ("still running").
And a page rank that leaves for good after step 0 before its node opened step 1's pair
(rw_pagerank host-quit, the others 1.5 s late): step 1 fails on every other rank at once,
naming it ("local rank 1 left"); before, it waited for the phase timeout.
Then a rank that aborts its combine of step 1 through its page (rw_client_rank_abort: its
own call refused on its host): every other rank's combine fails at once naming the abort, and
steps 0 and 2 pass. A ring rank (rw_rank) that leaves for good after step 0: every other
rank's step 1 fails at once, naming it (before, a ring rank's leave owed no gap and step 1
waited). And a group formed again, its ranks restarted one by one, whose old rank 1 leaves
after the new rank 0 joined and before it dispatches: the new run passes (a rank new since its
join is not charged with the old rank's gap; before, every rank failed "left before this
dispatch").
Run by tests/run as $b/test/svc_rankleave; exits 0 pass, 1 fail, 77 skip."""
import os
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

TIMEOUT_S = 60
check = cluster.Checks()


def rejoin(c, world, first, delayed, leave_late=False):
    """Rank 1 leaves after step 0 and joins again at step 2; the others' step 1 must fail at
    once, naming it, and step 2 pass everywhere. `delayed`: the mode whose ranks wait 1.5 s at
    that point, so that `first` opens node 0's pair. leave_late: rank 1 leaves 1 s after step
    0, while its node's pair of step 1 is open (its leave fails that pair, so its seat owes no
    gap: before, a leave that failed the pair was taken for one that failed nothing, and step
    2 then failed on every rank, "left before this dispatch")."""
    group = "rejoin" + delayed[5:] + ("late" if leave_late else "")
    t0 = time.time()
    procs = []
    for r in range(world):
        mode = "host-rejoin" if r == 1 else "host-skip"
        env = dict(c.env, RW_PAGERANK_DELAY_MS="1500") if mode == delayed else None
        if leave_late and r == 1:
            env = dict(c.env, RW_PAGERANK_LEAVE_DELAY_MS="1000")
        procs.append((r, c.pagerank(r, group, 1, 3, 7, mode, env=env)))
    res = cluster.outputs(procs)
    took = time.time() - t0
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
    check(not bad, "%s first: every rank's steps 0 and 2 passed %s" % (first, bad or ""))
    bad = {r: v[1][-300:] for r, v in res.items()
           if r != 1 and not any(l.startswith("host-skip: phase ") and (
               "local rank 1 joined again" in l or "local rank 1 left" in l)
               for l in v[1].splitlines())}
    # named as joined again, or as gone where its node's pair opened in between
    check(not bad, "%s first: every other rank's step 1 failed naming the rank that joined "
          "again %s" % (first, bad or ""))
    check(took < 20, "%s first: the group ran in %.1f s, the phase timeout is %d s" %
          (first, took, TIMEOUT_S))


def quit(c, world):
    """Rank 1 leaves for good after step 0, before its node's step 1 pair opens: every other
    rank's step 1 must fail at once, naming it."""
    t0 = time.time()
    res = cluster.outputs([(r, c.pagerank(
        r, "quit", 1, 2, 7, "host-quit" if r == 1 else "host-skip",
        env=None if r == 1 else dict(c.env, RW_PAGERANK_DELAY_MS="1500")))
        for r in range(world)])
    took = time.time() - t0
    check(res[1][0] == 0 and "quit after step 0" in res[1][1],
          "rank 1 ran step 0 and left (%r)" % res[1][1][-200:])
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if r != 1 and (
        v[0] != 0 or not any(l.startswith("host-skip: phase ") and "local rank 1 left" in l
                             for l in v[1].splitlines()))}
    check(not bad, "every other rank's step 1 failed naming the rank that left %s" %
          (bad or ""))
    check(took < 20, "the group's step 1 failed in %.1f s, the phase timeout is %d s" %
          (took, TIMEOUT_S))


def abort(c, world):
    """Rank 1 cannot give its combine of step 1 (its own call refused on its host): it aborts
    it through its page (rw_client_rank_abort: a combine slot marked abort). Every other rank's
    combine of step 1 must fail at once, naming rank 1 and the abort, the aborting rank's own
    answer be RW_E_PHASE, and steps 0 and 2 pass for all: the ranks' phase numbers stay in step
    (before, the rank left and joined again, and the other nodes waited for the timeout)."""
    t0 = time.time()
    res = cluster.outputs([(r, c.pagerank(r, "abort", 1, 3, 7,
                                          "host-abort" if r == 1 else "host-cskip"))
                           for r in range(world)])
    took = time.time() - t0
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
    check(not bad, "abort: every rank's steps 0 and 2 passed %s" % (bad or ""))
    check(any(l.startswith("host-abort: phase ") and "aborted: phase failed:" in l and
              "aborted its combine of layer 0 step 1" in l for l in res[1][1].splitlines()),
          "abort: rank 1's abort answered RW_E_PHASE, naming it (%r)" % res[1][1][-300:])
    bad = {r: v[1][-300:] for r, v in res.items()
           if r != 1 and not any(l.startswith("host-cskip: phase ") and "local rank 1" in l and
                                 "aborted its combine of layer 0 step 1" in l
                                 for l in v[1].splitlines())}
    check(not bad, "abort: every other rank's combine of step 1 failed naming rank 1's abort %s"
          % (bad or ""))
    check(took < 20, "abort: the group ran in %.1f s, the phase timeout is %d s" %
          (took, TIMEOUT_S))


def ring_quit(c, world):
    """A ring rank (rw_rank: host buffers, submissions on its ring) leaves for good after step
    0, before its node's step 1 pair opens (the others 1.5 s late): every other rank's step 1
    must fail at once, naming it ("local rank 1 left before this dispatch"), as a page rank's
    leave does. Before, a ring rank's leave marked no gap and step 1 waited for the phase
    timeout on every other rank."""
    t0 = time.time()
    late = dict(c.env, RW_RANK_STEP_DELAY_MS="1500")
    res = cluster.outputs([(r, c.rank(r, "ringquit", 1, 1 if r == 1 else 2, 7,
                                      env=None if r == 1 else late)) for r in range(world)])
    took = time.time() - t0
    check(res[1][0] == 0 and "verified" in res[1][1],
          "ring: rank 1 ran step 0 and left (%r)" % res[1][1][-200:])
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if r != 1 and (
        v[0] == 0 or "step 1 layer 0 dispatch failed" not in v[1] or
        "local rank 1 left before this dispatch" not in v[1])}
    check(not bad, "ring: every other rank's step 1 failed naming the ring rank that left %s" %
          (bad or ""))
    check(took < 20, "ring: the group's step 1 failed in %.1f s, the phase timeout is %d s" %
          (took, TIMEOUT_S))


def reform(c, world, tmp):
    """A group formed again, its ranks restarted one by one: rank 1 of the first run stays
    connected after its last phase until rank 0's new process joined, then leaves (its leave
    fails nothing: a gap), and only then does the new rank 0 dispatch; the new rank 1 comes
    last. The new run must pass: a rank new since its join is not owed the gap (the seat's
    next rank runs the key with it). Before, the new rank 0's dispatch failed on every rank,
    "local rank 1 left before this dispatch" (a page rank's leave; a ring rank's too, once its
    leave owed a gap)."""
    hold, go = os.path.join(tmp, "reform.hold"), os.path.join(tmp, "reform.go")
    first = [(r, c.pagerank(r, "reform", 1, 1, 7, "host",
                            env=dict(c.env, RW_PAGERANK_HOLD=hold) if r == 1 else None))
             for r in range(world)]
    res = cluster.outputs([p for p in first if p[0] != 1])
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
    check(not bad, "reform: the first run passed %s" % (bad or ""))
    new0 = c.pagerank(0, "reform", 1, 1, 7, "host", env=dict(c.env, RW_PAGERANK_GO=go))
    others = [(r, c.pagerank(r, "reform", 1, 1, 7, "host")) for r in range(2, world)]
    joined = cluster.wait_for(lambda: c.log(0).count("rank 0 of group reform joined") >= 2, 20)
    check(joined, "reform: the new rank 0 joined beside the old rank 1")
    open(hold, "w").close()  # the old rank 1 leaves
    res = cluster.outputs([first[1]])
    check(res[1][0] == 0, "reform: the old rank 1 passed and left (%r)" % res[1][1][-200:])
    cluster.wait_for(lambda: "rank 1 of group reform left" in c.log(0), 20)
    open(go, "w").close()  # the new rank 0 dispatches, then the new rank 1 comes
    time.sleep(0.5)
    res = cluster.outputs([(0, new0), (1, c.pagerank(1, "reform", 1, 1, 7, "host"))] + others)
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
    check(not bad, "reform: the run formed again passed on every rank %s" % (bad or ""))


def main():
    if not cluster.built(cluster.DAEMON, cluster.PAGERANK):
        print("skip: railwaved or rw_pagerank not built")
        return 77
    tmp = tempfile.mkdtemp(prefix="rw-rankleave-")
    c = cluster.Cluster(tmp, 2, rails=2, extra={"group_area_mib": 1, "group_pool_mib": 10,
                                                "phase_timeout_ms": TIMEOUT_S * 1000})
    world = 2 * c.gpus
    try:
        c.start_all()
        t0 = time.time()
        res = cluster.outputs([(r, c.pagerank(r, "leave", 2, 3, 5,
                                              {0: "late-until", 1: "die-after"}.get(r, "until")))
                               for r in range(world)])
        took = time.time() - t0
        check(res[1][0] == 3 and "dying after done 1" in res[1][1],
              "rank 1 ran its first dispatch to its done and left (%r)" % res[1][1][-200:])
        bad = {r: v[1][-300:] for r, v in res.items()
               if r != 1 and (v[0] != 0 or "until: phase 2 failed" not in v[1])}
        check(not bad, "every other rank of both nodes got its first dispatch's rows, then its "
              "combine (phase 2) failed %s" % (bad or ""))
        check(took < 20, "the survivors' failure came in %.1f s, the phase timeout is %d s" %
              (took, TIMEOUT_S))
        check("local rank 1 left" in c.log(0), "node 0's log names the rank that left")
        if os.path.exists(cluster.FAKE_KERN):  # the survivor's reason through librailwave
            res = cluster.outputs([(r, c.pagerank(
                r, "libleave", 2, 3, 5, {0: "lib", 1: "die-after"}.get(r, "until"),
                env=dict(c.env, RW_CUDA_DRIVER=cluster.FAKE_KERN) if r == 0 else None))
                for r in range(world)])
            check(res[0][0] != 0 and "local rank 1 left" in res[0][1],
                  "rank 0 on librailwave's rank path: rw_client_rank_message names the rank "
                  "that left (%r)" % res[0][1][-200:])
        else:
            print("skip the librailwave survivor: no kernel stand-in")
        for first, delayed in (("the others' step 1", "host-rejoin"),
                               ("the rejoined rank's step 2", "host-skip")):
            rejoin(c, world, first, delayed)
        rejoin(c, world, "the others' step 1 (rank 1 leaving while it runs)", "none",
               leave_late=True)
        quit(c, world)
        abort(c, world)
        ring_quit(c, world)
        reform(c, world, tmp)
        res = cluster.outputs([(r, c.pagerank(r, "after", 2, 3, 5, "ok")) for r in range(world)])
        bad = {r: (v[0], v[1][-300:]) for r, v in res.items()
               if v[0] != 0 or "verified" not in v[1]}
        check(not bad, "a new group's 6 phases pass right after %s" % (bad or ""))
        c.stop()
    except RuntimeError as e:
        check(False, str(e))
    finally:
        c.finish(check.fails)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
