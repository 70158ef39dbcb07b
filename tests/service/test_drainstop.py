#!/usr/bin/env python3
"""Shutdown waits for the GPU (docs/service.md "Signals", docs/rankpath.md "A hung GPU"): on
SIGTERM the copies a daemon queued into or out of its ranks' CUDA memory land before it closes
the IPC mappings they use, and the header pulls out of group carve-outs before the carve-outs
are freed, bounded by gpu_stall_ms. Two real railwaved daemons on loopback tcp,
real CUDA rank processes (tests/integration/rw_rank.c --cuda, staged through node 0's pinned
memory) on the cross-process CUDA stand-in, node 0 with its hang switch (RW_FAKE_CUDA_HANG=FILE:
while FILE exists no stream work of that process runs; tests/lib/cluster.py HangSwitch). In
scenarios 1, 2 and 5 FILE is created, every rank submits a dispatch, and once node 0 staged its
ranks' inputs (the stand-in counts a mark per rank) node 1's first rank is killed: the pairs fail
on both nodes and node 0's CUDA ranks have their answers held while the copies staging their
inputs hang (node 0 maps their buffers). Then node 0 gets SIGTERM. The stand-in says on stderr (into node 0's log) when an
IPC mapping is closed, page-locked memory freed or a VMM mapping unmapped while a copy naming it
is queued ("fake cuda: ... under N queued copies").

1. Lands (gpu_stall_ms 60000): node 0 does not exit while the copies hang; it logs that it
   waits for them, answers `stats`, and keeps the ranks' buffers mapped. FILE removed: the
   copies land, node 0 answers its ranks (their error names the killed rank's leave), closes
   the mappings after the copies (no "closed under" line) and exits 0.
2. Stays hung (gpu_stall_ms 4000): node 0 exits 0 by itself, FILE still there, after the stall
   bound (plus the drain's 2 s margin at most), naming GPU 0 in its log; no mapping is closed
   under the queued copies (the import cache leaves them to the process's exit, logged), CUDA
   is not shut down under them (left to the exit, logged), and its ranks were told their copies
   may still land.
3. A carve-out's pull (the groups' carve-outs on the stand-in's discrete GPU, phase_timeout_ms
   3000, gpu_stall_ms 60000): a GPU group's phase (rw_pagerank) times out with node 0's header
   pull out of its carve-out hung; node 0 holds the carve-out. SIGTERM: node 0 waits; FILE
   removed: the pull lands, then the mesh frees the carve-out (no "under" line), exit 0.
4. As 3 with gpu_stall_ms 2000, FILE left: GPU 0 is declared stalled (the phase fails naming
   it) with the pull still queued. SIGTERM: node 0 exits 0 by itself within the bound, FILE
   still there; it names the pull that did not land and the carve-out it left to its exit (the
   VMM mapping and page-locked shadow of each rail); nothing is freed or unmapped under the
   pull (no "under" line).
5. As 1, with the kernel stand-in (where the build has the CUDA mover's kernels): node 0's CUDA
   mover carries the CUDA ranks, its copies and kernels on the stage's streams.
Run by tests/run as $b/test/svc_drainstop; exits 0 pass, 1 fail, 77 skip."""
import os
import signal
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

check = cluster.Checks()
UNDER = "queued copies"  # the stand-in's "fake cuda: ... under N queued copies"
LANDED = "shutdown: the copies into ranks' CUDA memory and group carve-outs landed after"


def node0_exit(c):
    """Wait for node 0 (signalled) to exit; it is no longer the cluster's to stop. Its status,
    or "hang" when it was still running after cluster.WAIT (then killed)."""
    d0 = c.procs.pop(0)
    try:
        return d0.wait(cluster.WAIT)
    except Exception:
        d0.kill()
        d0.wait()
        return "hang"


def with_held_job(tmp, name, stall_ms, seed, body, driver=cluster.FAKE_CUDA):
    """Two daemons (node 0 with the hang switch, gpu_stall_ms stall_ms) on the stand-in `driver`
    in tmp/name, a cluster.held_cuda_job of group drain.NAME (node 0's ranks checked unanswered
    while the stall bound is far), then body(c, hang, node 0's ranks, node 0's mappings before
    the job); node 1 must exit 0 at the end (ASan: no report, no leak)."""
    tmp = os.path.join(tmp, name)
    os.mkdir(tmp)
    c, hang = cluster.hang_cluster(tmp, {"transport": "tcp", "gpu_stall_ms": stall_ms}, driver)
    group = "drain." + name
    try:
        c.start_all()
        if driver == cluster.FAKE_KERN:
            c.run_ranks("drain.warm", 1, 1, seed, flags=["--cuda"])
            check("cuda mover: kernels loaded on device 0" in c.log(0),
                  "%s: node 0's CUDA mover carries the CUDA ranks' pairs" % name)
        ranks0, maps0 = cluster.held_cuda_job(c, hang, check, group, seed)
        if stall_ms > 10000:
            check(cluster.still_running(ranks0),
                  "%s: node 0's CUDA ranks not answered while their copies hang" % group)
        body(c, hang, ranks0, maps0)
    finally:
        hang.release()
        c.stop()


def sigterm_waits(c, what):
    """SIGTERM to node 0, which must say it waits for the copies (`what`) and not exit while
    they hang (watched for a second once it said so). Returns its process."""
    d0 = c.procs[0]
    d0.send_signal(signal.SIGTERM)
    check(cluster.wait_for(lambda: "shutdown: waiting up to" in c.log(0),
                           what="node 0 to say it waits"),
          "SIGTERM: node 0 waits for %s: %s"
          % (what, [ln for ln in c.log(0).splitlines() if "shutdown" in ln][-3:]))
    check(cluster.still_running([(0, d0)]), "SIGTERM: node 0 still runs while %s hang" % what)
    return d0


def lands(c, hang, ranks0, maps0):
    d0 = sigterm_waits(c, "the copies queued into its ranks' memory")
    check(c.summary(0).get("gpus_stalled") == "0",
          "SIGTERM: node 0 answers stats meanwhile, GPU 0 not declared stalled")
    check(cluster.maps_named(d0.pid, "rw-fake-cuda") > maps0,
          "SIGTERM: node 0 keeps its ranks' buffers mapped (%d > %d)"
          % (cluster.maps_named(d0.pid, "rw-fake-cuda"), maps0))
    hang.off()
    rc = node0_exit(c)
    check(rc == 0, "FILE removed: node 0 exited 0 (%s)" % rc)
    log0 = c.log(0)
    check(LANDED in log0,
          "FILE removed: node 0 logged that the copies landed before the mappings closed")
    check(UNDER not in log0 and "left open" not in log0,
          "no mapping was closed under a queued copy: %s"
          % [ln for ln in log0.splitlines() if UNDER in ln or "left open" in ln])
    res0 = cluster.outputs(ranks0)
    check(all(v[0] == 0 and "failed as expected" in v[1] and "left" in v[1] and
              "stalled" not in v[1] for v in res0.values()),
          "node 0's ranks were answered once their copies landed, naming the leave: %s"
          % {r: v[1][-200:] for r, v in res0.items()})


def sigterm_hung(c, hang, name, line, left, bound_s=None):
    """SIGTERM to node 0 with FILE left (its GPU stalled, or about to be): it must exit 0 by
    itself (within bound_s seconds, when given), FILE still there, and name in one log line
    (the one with `line`) the copies that have not landed on its stalled GPU and what it left
    to its exit (`left`). Returns node 0's log."""
    t0 = time.time()
    c.procs[0].send_signal(signal.SIGTERM)
    rc = node0_exit(c)
    took = time.time() - t0
    check(rc == 0 and (bound_s is None or took < bound_s),
          "%s: node 0 exited 0 by itself in %.1f s (%s)" % (name, took, rc))
    check(hang.is_on(), "%s: the copies never landed (FILE kept)" % name)
    log0 = c.log(0)
    named = [ln for ln in log0.splitlines() if line in ln]
    check(len(named) == 1 and "have not landed (stalled" in named[0] and left in named[0],
          "%s: node 0 named GPU 0's copies that did not land, %s: %s"
          % (name, left, named or [ln for ln in log0.splitlines() if "shutdown" in ln][-3:]))
    return log0


def hung(c, hang, ranks0, maps0):
    log0 = sigterm_hung(c, hang, "GPU hung at SIGTERM", "shutdown: GPU 0: copies queued",
                        "left open to the process's exit", 4.0 + 2.0 + 3.0)  # stall, +2 s, ASan
    check("cuda: ipc cache left" in log0 and UNDER not in log0,
          "GPU hung at SIGTERM: no mapping closed under the queued copies: %s"
          % [ln for ln in log0.splitlines() if UNDER in ln or "ipc cache" in ln])
    check("stage: CUDA left to the process's exit" in log0,
          "GPU hung at SIGTERM: CUDA not shut down (module unload, context release) under the "
          "queued copies: %s" % [ln for ln in log0.splitlines() if "stage:" in ln])
    res0 = cluster.outputs(ranks0)
    check(all(v[0] == 0 and "GPU 0 stalled, copies into this rank may still land" in v[1]
              for v in res0.values()),
          "GPU hung at SIGTERM: node 0's ranks were told their copies may still land: %s"
          % {r: v[1][-200:] for r, v in res0.items()})


def scenario_carve(tmp, seed, stalled):
    """A GPU group's phase fails with node 0's header pull out of its carve-out hung; SIGTERM.
    `stalled` (gpu_stall_ms 2000): GPU 0 is declared stalled first, node 0 exits by itself with
    the pull still hung and leaves the carve-out to its exit, named. Else (60000): it waits, and
    frees the carve-out once the pull landed (FILE removed)."""
    name = "carvestall" if stalled else "carve"
    tmp = os.path.join(tmp, name)
    os.mkdir(tmp)
    c, hang = cluster.hang_cluster(tmp, {"transport": "tcp", "group_area_mib": 1,
                                         "group_pool_mib": 2, "phase_timeout_ms": 3000,
                                         "gpu_stall_ms": 2000 if stalled else 60000},
                                   gpu_carve_outs=True)
    group = "drain." + name
    try:
        c.start_all()
        check("the groups' carve-outs in GPU 0's memory" in c.log(0),
              "%s: node 0 places the carve-outs on GPU 0" % name)
        hang.on()
        res = cluster.outputs([(r, c.pagerank(r, group, 1, 1, seed, "one"))
                               for r in range(c.nodes * c.gpus)])
        check(all(v[0] == 0 and "one: phase 1 failed" in v[1] for v in res.values()),
              "%s: the GPU group's phase failed, node 0's header pull hung: %s"
              % (name, [v[1].splitlines()[-1:] for v in res.values()]))
        check(c.summary(0).get("carve_outs", "").startswith("1/"),
              "%s: node 0 holds the failed pair's carve-out for its pull (%s)"
              % (name, c.summary(0).get("carve_outs")))
        if stalled:
            carve_stalled(c, hang, group)
            return
        sigterm_waits(c, "the pulls out of the carve-out")
        hang.off()
        rc = node0_exit(c)
        check(rc == 0, "carve: FILE removed: node 0 exited 0 (%s)" % rc)
        log0 = c.log(0)
        check(LANDED in log0 and UNDER not in log0,
              "carve: the pull landed before the carve-out was freed: %s"
              % [ln for ln in log0.splitlines() if UNDER in ln or "shutdown" in ln][-3:])
    finally:
        hang.release()
        c.stop()


def carve_stalled(c, hang, group):
    """GPU 0 declared stalled with the pull out of group's carve-out still queued: SIGTERM ends
    node 0 within the bound (gpu_stall_ms + 2 s, with a margin for ASan), exit 0, the carve-out's
    memory (VMM mapping, page-locked shadow) left to the exit and named, nothing freed or unmapped
    under the pull (no stand-in "under" line)."""
    check(cluster.wait_for(lambda: c.summary(0).get("gpus_stalled", "").split()[1:2] == ["0"]),
          "carvestall: node 0 declared GPU 0 stalled (%s)" % c.summary(0).get("gpus_stalled"))
    log0 = sigterm_hung(c, hang, "carvestall", "header pulls out of", "left to the process's exit",
                        2.0 + 2.0 + 3.0)
    left = [ln for ln in log0.splitlines()
            if "group %s: carve-out" % group in ln and "left to the process's exit" in ln]
    check(len(left) == 1 and "(GPU 0 stalled with a header pull out of it queued)" in left[0] and
          "rail 0: GPU 0's mapping of" in left[0] and "page-locked shadow" in left[0],
          "carvestall: node 0 named the carve-out it left, its GPU mapping and shadow: %s"
          % (left or [ln for ln in log0.splitlines() if "carve" in ln][-3:]))
    check(UNDER not in log0,
          "carvestall: nothing freed or unmapped under the queued pull: %s"
          % [ln for ln in log0.splitlines() if UNDER in ln])


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK) or not os.path.exists(cluster.FAKE_CUDA):
        print("skip: railwaved, rw_rank or the CUDA stand-in not built")
        return 77
    seed = cluster.test_seed()
    with tempfile.TemporaryDirectory(prefix="rwdrainstop.", dir="/tmp") as tmp:
        check.scenarios([
            ("copies land at SIGTERM", lambda t, s: with_held_job(t, "lands", 60000, s, lands)),
            ("GPU hung at SIGTERM", lambda t, s: with_held_job(t, "hung", 4000, s, hung)),
            ("a carve-out's pull at SIGTERM", lambda t, s: scenario_carve(t, s, False)),
            ("a carve-out's pull, GPU stalled at SIGTERM",
             lambda t, s: scenario_carve(t, s, True))]
            + ([("CUDA mover: copies land at SIGTERM", lambda t, s: with_held_job(
                t, "mover", 60000, s, lands, cluster.FAKE_KERN))]
               if os.path.exists(cluster.FAKE_KERN) else []),
            tmp, seed)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
