#!/usr/bin/env python3
"""A hung GPU never holds the daemon's loop (docs/rankpath.md "A hung GPU"): two real railwaved
daemons on loopback tcp, real rank processes (tests/integration/rw_rank.c, rw_pagerank.c), the
groups' carve-outs in GPU memory the daemons' CPUs cannot read (the CUDA stand-in's discrete
GPU, RW_FAKE_CUDA_VMM_NOCPU=1, as test_slabs.py's pulled scenario), so every check of a GPU
group reads headers the daemon pulls out of GPU 0 by copies on its own stream. Node 0's daemon
runs with the stand-in's hang switch (RW_FAKE_CUDA_HANG=FILE: while FILE exists no stream work
of that process runs, as on a GPU whose copy engine is wedged or whose kernel never ends) and
gpu_stall_ms 1000:

1. Stalled: with FILE created, a GPU group's first phase fails on every rank of both nodes; node
   0's log says once that GPU 0's copies have not landed and names it in the pair's failure;
   `stats` on node 0 answers and names the stalled GPU. A second GPU group is refused, named
   (GPU 0 is stalled), while the device stays stalled. Meanwhile a host job of another group on
   the same daemons verifies every phase through node 0's loop, the peer never takes node 0
   down (its heartbeats answered), and the page-locked memory and carve-outs held for the
   stalled copies are not given back while the device is stalled.
2. Moves again: FILE removed, the queued copies land; node 0 logs that GPU 0 moves again, `stats`
   shows no stalled GPU, and a new GPU group's phases verify exactly.
3. The staging stalls: FILE created again, a job of CUDA ranks (rw_rank --cuda, staged through
   the daemon's pinned memory) fails its dispatch on every rank, the failure naming GPU 0, node
   0's ranks told their copies may still land (answered once GPU 0 is declared stalled), and
   its staging is held (stats gpu_held_bytes) instead of freed under copies that may land; a GPU
   group is then refused, named. The CUDA ranks leave at once; node 0 keeps their buffers
   mapped until the copies land (docs/rankpath.md "A hung GPU", a rank's own memory).
4. FILE removed: the staging's copies land, the staging is freed. FILE created again, a GPU
   group stalls the pull once more, and both daemons stop on SIGTERM with exit 0 (under ASan:
   no leak, no report): the hung device's pull stream is abandoned, never waited for.
Answered late (two more daemons, gpu_stall_ms 60000, node 0 hung, host carve-outs): a CUDA
job's node-1 rank is killed once every rank submitted and node 0 staged its ranks' inputs (the
stand-in counts a mark per rank); node 0's CUDA ranks are not answered while their copies are
hung, then fail naming the leave once FILE goes; in a second round they are killed while their
answers are held, and node 0 keeps their buffers mapped (the stand-in's memfds in
/proc/PID/maps) until the copies landed, then unmaps them and serves a host job.
The CUDA mover (two more daemons, gpu_stall_ms 1000, node 0 hung, CUDA ranks on the kernel
stand-in, so the daemon's CUDA mover carries them with kernels on its own streams): a CUDA job
verifies first; with FILE created a CUDA job's dispatch fails on every rank, node 0's failure and
its ranks' errors naming GPU 0 once the bound passed, while a host job of another group verifies
every phase through node 0's loop, `stats` answers `gpus_stalled 1 0` and the failed pair's
staging is held; a second CUDA job is refused naming GPU 0; FILE removed, GPU 0 moves again,
nothing stays held, and a new CUDA job verifies; both daemons exit 0 (ASan: no leak).
Slot settle (two more daemons, node 0 hung at debug log level, so its milestones name each
pair's shared slot): a CUDA pair whose pack kernels hang fails and node 0 keeps its slot out of
use past the heartbeat timeout; a host job of another group verifies on the other slot, none of
its pairs on the kept one; FILE removed while a host job runs, it verifies and the slot returns;
two such CUDA pairs keep both slots, and a host job is then refused on every rank, naming GPU 0;
FILE removed, both slots return and a CUDA job and a host job verify side by side.
Each step waits for the condition it needs, bounded (cluster.WAIT), never for time to pass: a
log line, a stats field, node 0's stand-in counts (tests/cuda/fake_cuda_base.h: the marks it
queued, the stream work that ran); the one timed wait is the heartbeat timeout a kept slot must
outlast.
Run by tests/run as $b/test/svc_gpuhang; exits 0 pass, 1 fail, 77 skip."""
import os
import signal
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

check = cluster.Checks()
AREA = {"group_area_mib": 1, "group_pool_mib": 2, "heartbeat_timeout_ms": 5000,
        "transport": "tcp", "gpu_stall_ms": 1000}


def served_meanwhile(c, host):
    """While a GPU is stalled: the host job of another group verified every phase through
    node 0's loop, and neither node took its peer down."""
    outs = c.collect(host)
    check(all("30 steps x 2 layers verified" in outs[r] for r in outs),
          "stalled: a host job of another group verified every phase meanwhile")
    for n in range(c.nodes):
        peers = " ".join(c.stats(n, "stats peers").split())
        check("state=up" in peers and "reconnects=0" in peers,
              "stalled: node %d kept its peer up: %s" % (n, peers))


def nothing_held(c):
    """Until node 0 names no stalled GPU and holds no memory for copies that may land."""
    return cluster.wait_for(lambda: c.summary(0).get("gpus_stalled") == "0" and
                            c.summary(0).get("gpu_held_bytes") == "0",
                            what=lambda: "node 0 to hold nothing: %s" % {
                                k: v for k, v in c.summary(0).items()
                                if k in ("gpus_stalled", "gpu_held_bytes")})


def gpu_job(c, group, mode, seed, steps=3):
    return [(r, c.pagerank(r, group, 1, steps, seed, mode)) for r in range(c.nodes * c.gpus)]


def scenario_hang(tmp, seed):
    c, hang = cluster.hang_cluster(tmp, AREA, gpu_carve_outs=True)
    world = c.nodes * c.gpus
    try:
        c.start_all()
        check("the groups' carve-outs in GPU 0's memory" in c.log(0),
              "node 0 places the carve-outs on GPU 0")
        host = [(r, c.rank(r, "hang.host", 2, 30, seed)) for r in range(world)]
        # 1. stalled
        hang.on()
        res = cluster.outputs(gpu_job(c, "hang.gpu", "until", 5))
        check(all(v[0] == 0 and "until: phase 1 failed" in v[1] for v in res.values()),
              "stalled: the GPU group's first phase failed on every rank of both nodes: %s"
              % [v[1].splitlines()[-1:] for v in res.values()])
        log0 = c.log(0)
        check(log0.count("GPU 0: copies queued") == 1 and "have not landed; its pairs fail"
              in log0, "stalled: node 0 logged GPU 0's stall once")
        check("group hang.gpu layer 0 step 0: dispatch failed" in log0 and
              "GPU 0 is stalled: copies queued" in log0,
              "stalled: the pair's failure names the GPU: %s"
              % [ln for ln in log0.splitlines() if "hang.gpu" in ln][:2])
        st = c.summary(0)
        check(st.get("gpus_stalled") == "1 0", "stalled: stats names GPU 0 stalled (%s)"
              % st.get("gpus_stalled"))
        check(st.get("carve_outs", "").startswith("1/"),
              "stalled: the failed group's carve-out is held while its copies may land (%s)"
              % st.get("carve_outs"))
        res = cluster.outputs(gpu_job(c, "hang.again", "until", 6))
        check(all(v[0] == 0 and "until: phase 1 failed" in v[1] for v in res.values()),
              "stalled: a second GPU group's first phase failed on every rank: %s"
              % [v[1].splitlines()[-1:] for v in res.values()])
        check(c.log(0).count("GPU 0 is stalled") > log0.count("GPU 0 is stalled"),
              "stalled: the second group was refused, naming the stalled GPU")
        check(c.log(0).count("GPU 0: copies queued") == 1,
              "stalled: the stall was logged once, not per pair")
        served_meanwhile(c, host)
        check(": down (" not in c.log(0) + c.log(1), "stalled: no node was dropped")
        # 2. moves again
        hang.off()
        check(cluster.wait_for(lambda: "GPU 0 moves again" in c.log(0),
                               what="GPU 0 to move again"),
              "moved: node 0 logged that GPU 0 moves again once its copies landed")
        check(cluster.wait_for(lambda: c.summary(0).get("gpus_stalled") == "0",
                               what="stats to clear"), "moved: stats shows no stalled GPU")
        check(cluster.wait_for(lambda: c.summary(0).get("gpu_held_bytes") == "0" and
                               c.summary(0).get("carve_outs", "").startswith("0/"),
                               what="the held memory to go"),
              "moved: nothing held for the landed copies (%s)" % {
                  k: v for k, v in c.summary(0).items() if k in ("gpu_held_bytes", "carve_outs")})
        res = cluster.outputs(gpu_job(c, "hang.after", "ok", seed))
        bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
        check(not bad, "moved: a new GPU group verified every phase %s" % (bad or ""))
        # 3. the staging stalls: CUDA ranks staged through pinned memory get their error once
        # GPU 0 is declared stalled, told that its copies may still land, and leave at once:
        # node 0 keeps their buffers mapped until the copies queued into them landed
        hang.on()
        cuda = [(r, c.rank(r, "hang.cuda", 1, 1, seed, mode="fail", flags=["--cuda"]))
                for r in range(world)]
        check(cluster.wait_for(lambda: "hang.cuda layer 0 step 0: dispatch failed" in c.log(0),
                               what="the staging to stall"),
              "staging stalled: the CUDA group's pair failed")
        log0 = c.log(0)
        check(log0.count("GPU 0: copies queued") == 2, "staging stalled: the stall logged")
        check("a CUDA copy for local rank" in log0 and "GPU 0 is stalled: copies queued" in
              log0.split("hang.cuda layer 0 step 0: dispatch failed", 1)[1].split("\n", 1)[0],
              "staging stalled: the pair's failure names the GPU: %s"
              % [ln for ln in log0.splitlines() if "hang.cuda" in ln and "failed" in ln][:1])
        check(cluster.wait_for(lambda: int(c.summary(0).get("gpu_held_bytes", "0")) > 0,
                               what="the failed pair's staging to be held"),
              "staging stalled: the failed pair's staging is held for its copies (%s bytes)"
              % c.summary(0).get("gpu_held_bytes"))
        res = cluster.outputs(cuda)
        check(all(v[0] == 0 for v in res.values()),
              "staging stalled: every CUDA rank's dispatch failed: %s"
              % {r: v[1][-200:] for r, v in res.items() if v[0] != 0})
        check(all("GPU 0 stalled, copies into this rank may still land" in res[r][1]
                  for r in range(c.gpus)),
              "staging stalled: node 0's CUDA ranks were told their copies may still land: %s"
              % [res[r][1].splitlines()[-1:] for r in range(c.gpus)])
        check("answered with its copies still queued on stalled GPU 0" in c.log(0),
              "staging stalled: node 0 logged the answers given with copies queued")
        res = cluster.outputs(gpu_job(c, "hang.last", "until", 7))
        check(all(v[0] == 0 and "GPU 0 is stalled" in v[1] for v in res.values()),
              "staging stalled: a GPU group is refused, named, on every rank: %s"
              % [v[1].splitlines()[-1:] for v in res.values()])
        # 4. the staging moves again; then the pull stalls once more, and SIGTERM
        hang.off()
        check(nothing_held(c), "staging moved: its copies landed into the gone ranks' buffers, "
              "still mapped; GPU 0 no longer stalled, the staging freed")
        hang.on()
        res = cluster.outputs(gpu_job(c, "hang.end", "until", 8))
        check(all(v[0] == 0 and "until: phase 1 failed" in v[1] for v in res.values()),
              "stalled at the end: the GPU group's first phase failed on every rank")
        check(c.summary(0).get("gpus_stalled") == "1 0", "stalled at the end: GPU 0 stalled")
    finally:
        c.stop()  # raises unless every daemon exits 0
    check("header pull: GPU 0's stream abandoned with its copies queued" in c.log(0),
          "SIGTERM while stalled: node 0 gave GPU 0's pull stream up without waiting, exit 0")


def late_round(c, hang, group, seed, leave):
    """One CUDA job with node 0's copies hung and node 1's rank killed after every rank
    submitted and node 0 staged its ranks (cluster.held_cuda_job): node 0's CUDA ranks are not
    answered while their copies may land; with `leave` they are killed meanwhile. Then the switch
    goes off and the copies land. Returns node 0's outputs."""
    pid0 = c.procs[0].pid
    cuda0, maps0 = cluster.held_cuda_job(c, hang, check, group, seed)
    check(cluster.still_running(cuda0),
          "%s: node 0's CUDA ranks not answered while their copies are hung" % group)
    check(c.summary(0).get("gpus_stalled") == "0",
          "%s: GPU 0 not declared stalled (gpu_stall_ms 60000)" % group)
    if leave:
        for _, p in cuda0:
            p.kill()
            p.wait()
        check(cluster.wait_for(lambda: "group=%s " % group not in c.stats(0, "stats clients"),
                               what="node 0 to see them go"),
              "%s: node 0's CUDA ranks left while their answers were held" % group)
        check(cluster.maps_named(pid0, "rw-fake-cuda") > maps0,
              "%s: their CUDA buffers stay mapped in node 0 for the copies (%d > %d)"
              % (group, cluster.maps_named(pid0, "rw-fake-cuda"), maps0))
    hang.off()
    res0 = cluster.outputs(cuda0)
    check(cluster.wait_for(lambda: c.summary(0).get("gpu_held_bytes") == "0",
                           what="the staging to be freed"),
          "%s: the copies landed, the staging freed" % group)
    check(cluster.wait_for(lambda: cluster.maps_named(pid0, "rw-fake-cuda") == maps0,
                           what="the buffers to be unmapped"),
          "%s: then node 0 maps no buffer of the job's ranks" % group)
    return res0


def scenario_late(tmp, seed):
    """A failed pair's CUDA ranks get their error only once the copies into their memory
    landed (the hang lifted before the stall bound); ranks that leave before it keep their
    buffers mapped in the daemon until then, so the late copies reach nothing unmapped."""
    tmp = os.path.join(tmp, "late")
    os.mkdir(tmp)
    c, hang = cluster.hang_cluster(tmp, dict(AREA, gpu_stall_ms=60000))
    try:
        c.start_all()
        res = late_round(c, hang, "late.answer", seed, False)
        check(all(v[0] == 0 and "failed as expected" in v[1] and "left" in v[1] and
                  "stalled" not in v[1] for v in res.values()),
              "answered late: node 0's CUDA ranks failed once their copies landed, naming the "
              "leave: %s" % {r: v[1][-200:] for r, v in res.items()})
        late_round(c, hang, "late.leave", seed + 1, True)
        host = [(r, c.rank(r, "late.host", 2, 5, seed)) for r in range(c.nodes * c.gpus)]
        outs = c.collect(host)
        check(all("5 steps x 2 layers verified" in outs[r] for r in outs),
              "after the late copies: node 0 serves a host job")
    finally:
        hang.release()
        c.stop()  # raises unless every daemon exits 0 (ASan: no report, no leak)


def kern_cluster(tmp, name, extra):
    """Two daemons whose CUDA ranks run on the kernel stand-in (the daemon's CUDA mover carries
    them), node 0's with the hang switch under tmp/name and at debug log level, so that its
    milestones name each pair's shared slot (slots_taken). Returns (the cluster, its switch)."""
    tmp = os.path.join(tmp, name)
    os.mkdir(tmp)
    return cluster.hang_cluster(tmp, dict(extra, log_level="debug"), driver=cluster.FAKE_KERN)


def hang_after_plan(c, hang, groups, seed):
    """A CUDA job per group (1 step, mode fail) whose pack kernels hang on node 0: every rank but
    node 1's last submits; node 0 stages them, counts their rows on GPU 0 and takes a slot for
    each group's pair (its debug milestones), and every item of stream work it asked for ran (the
    stand-in's counts); then the switch on, then node 1's last rank of each group submits, so
    node 0 plans and only its pack kernels queue behind the switch. (group, rank) -> (exit code,
    output)."""
    world = c.nodes * c.gpus
    procs = [((grp, r), c.rank(r, grp, 1, 1, seed + i, mode="fail", flags=["--cuda"]))
             for i, grp in enumerate(groups) for r in range(world - 1)]
    check(all(cluster.read_until(p, "submitted") for _, p in procs),
          "after the plan: ranks submitted")
    check(cluster.wait_for(lambda: all(slots_taken(c.log(0), grp) for grp in groups),
                           what=lambda: "node 0's pairs of %s to take slots: %s"
                           % (groups, {grp: slots_taken(c.log(0), grp) for grp in groups}))
          and hang.wait_ran(), "after the plan: node 0 staged and counted, its GPU idle")
    hang.on()
    procs += [((grp, world - 1), c.rank(world - 1, grp, 1, 1, seed + i, mode="fail",
                                        flags=["--cuda"])) for i, grp in enumerate(groups)]
    return cluster.outputs(procs)


def scenario_cuda_mover(tmp, seed):
    """The CUDA mover's failed pair is given up without waiting for its GPU: failed naming the
    device once the bound passed, what its kernels and copies may touch held until they land."""
    c, hang = kern_cluster(tmp, "mover", AREA)
    cu = ["--cuda"]
    world, g = c.nodes * c.gpus, c.gpus
    try:
        c.start_all()
        c.run_ranks("mover.warm", 1, 2, seed, flags=cu)
        check("cuda mover: kernels loaded on device 0" in c.log(0) and
              "cuda mover: rail 0 slot area" in c.log(0),
              "cuda mover: node 0's CUDA mover carried the CUDA job's pairs")
        host = [(r, c.rank(r, "mover.host", 2, 30, seed)) for r in range(world)]
        hang.on()
        cuda = [(r, c.rank(r, "mover.hang", 1, 1, seed + 1, mode="fail", flags=cu))
                for r in range(world)]
        res = cluster.outputs(cuda)
        log0 = c.log(0)
        check(all(v[0] == 0 for v in res.values()),
              "stalled: the CUDA job's dispatch failed on every rank: %s"
              % {r: v[1][-200:] for r, v in res.items() if v[0] != 0})
        check(log0.count("GPU 0: copies queued") == 1, "stalled: node 0 logged GPU 0's stall once")
        failed = [ln for ln in log0.splitlines()
                  if "mover.hang layer 0 step 0: dispatch failed" in ln]
        check(failed and "GPU 0 is stalled: copies queued" in failed[0],
              "stalled: node 0's pair failure names the GPU: %s" % failed[:1])
        check(all("GPU 0 stalled, copies into this rank may still land" in res[r][1]
                  for r in range(g)),
              "stalled: node 0's CUDA ranks were told GPU 0 stalled: %s"
              % [res[r][1].splitlines()[-1:] for r in range(g)])
        st = c.summary(0)
        check(st.get("gpus_stalled") == "1 0", "stalled: stats names GPU 0 stalled (%s)"
              % st.get("gpus_stalled"))
        check(int(st.get("gpu_held_bytes", "0")) > 0,
              "stalled: the failed pair's staging is held for its copies (%s bytes)"
              % st.get("gpu_held_bytes"))
        res = cluster.outputs([(r, c.rank(r, "mover.again", 1, 1, seed + 2, mode="fail", flags=cu))
                               for r in range(world)])
        check(all(v[0] == 0 for v in res.values()) and
              all("GPU 0 is stalled" in res[r][1] for r in range(g)),
              "stalled: a second CUDA job is refused, naming GPU 0: %s"
              % [v[1].splitlines()[-1:] for v in res.values()])
        served_meanwhile(c, host)
        hang.off()
        check(cluster.wait_for(lambda: "GPU 0 moves again" in c.log(0),
                               what="GPU 0 to move again"),
              "moved: node 0 logged that GPU 0 moves again")
        check(nothing_held(c), "moved: GPU 0 not stalled, nothing held (%s)"
              % {k: v for k, v in c.summary(0).items()
                 if k in ("gpus_stalled", "gpu_held_bytes")})
        res = hang_after_plan(c, hang, ["mover.plan"], seed + 4)
        check(all(v[0] == 0 for v in res.values()) and
              all("GPU 0 stalled, copies into this rank may still land" in res["mover.plan", r][1]
                  for r in range(g)),
              "after the plan: every rank failed, node 0's naming GPU 0: %s"
              % [v[1].splitlines()[-1:] for v in res.values()])
        check("row lists and 2 device blocks held until it lands" in c.log(0),
              "after the plan: the pair's row lists and device blocks held for its kernels")
        check(int(c.summary(0).get("gpu_held_bytes", "0")) > 0,
              "after the plan: held memory counted (%s bytes)"
              % c.summary(0).get("gpu_held_bytes"))
        hang.off()
        check(nothing_held(c), "after the plan: the kernels landed, nothing held")
        outs = c.run_ranks("mover.after", 2, 3, seed + 3, flags=cu)
        check(all("verified" in outs[r] for r in outs), "moved: a new CUDA job verified")
    finally:
        hang.release()
        c.stop()  # raises unless every daemon exits 0 (ASan: no report, no leak)


def slots_taken(log, group):
    """The shared slots node 0's pairs of `group` took (its debug milestones)."""
    return [int(ln.rsplit(" ", 1)[1]) for ln in log.splitlines()
            if ": group %s: slot " % group in ln]


def scenario_slot(tmp, seed):
    """A failed CUDA pair's shared slot stays out of use while its pack kernels may still write
    it, past the heartbeat timeout that keeps it idle for the peers' writes; a pair that would
    need it runs on another slot, or is refused, named, when every slot waits on the stalled
    GPU; once the kernels land the slot returns."""
    hb_ms = 1000
    c, hang = kern_cluster(tmp, "slot", dict(AREA, heartbeat_timeout_ms=hb_ms))
    cu = ["--cuda"]
    world, g = c.nodes * c.gpus, c.gpus
    kept = "kept out of use: failed pair"
    try:
        c.start_all()
        c.run_ranks("slot.warm", 1, 2, seed, flags=cu)
        check("cuda mover: rail 0 slot area" in c.log(0),
              "slot: node 0's CUDA mover carried the CUDA job's pairs")
        # 1. one slot kept: a host job runs on the other one while the hang lasts
        res = hang_after_plan(c, hang, ["slot.one"], seed + 1)
        check(all(v[0] == 0 for v in res.values()) and
              all("GPU 0 stalled" in res["slot.one", r][1] for r in range(g)),
              "one kept: the CUDA job failed on every rank, node 0's naming GPU 0: %s"
              % [v[1].splitlines()[-1:] for v in res.values()])
        lines = [ln for ln in c.log(0).splitlines() if kept in ln]
        check(len(lines) == 1, "one kept: node 0 keeps the failed pair's slot: %s" % lines)
        held = int(lines[0].split("slot ", 1)[1].split(" ", 1)[0]) if lines else -1
        check(slots_taken(c.log(0), "slot.one") == [held], "one kept: the slot kept is the "
              "failed pair's (%s)" % slots_taken(c.log(0), "slot.one"))
        # The heartbeat timeout that keeps a failed pair's slot idle for the peers' writes
        # passes: it began as the pair closed, before the line above was logged.
        time.sleep(hb_ms / 1000.0)
        outs = c.run_ranks("slot.host", 2, 5, seed + 2)
        check(all("5 steps x 2 layers verified" in outs[r] for r in outs),
              "one kept: a host job verified every phase meanwhile")
        took = slots_taken(c.log(0), "slot.host")
        check(len(took) == 10 and held not in took,
              "one kept: none of its 10 pairs took slot %d while the hang lasted (%s)"
              % (held, took))
        check("back in use" not in c.log(0) and c.summary(0).get("gpus_stalled") == "1 0",
              "one kept: still kept, GPU 0 stalled")
        # the kernels land while a host job runs: it verifies, the slot returns
        host = [(r, c.rank(r, "slot.land", 2, 20, seed + 3)) for r in range(world)]
        check(cluster.wait_for(lambda: slots_taken(c.log(0), "slot.land"),
                               what="the host job's first pair on node 0"),
              "landed: a host job runs (its first pair took a slot)")
        hang.off()
        outs = c.collect(host)
        check(all("20 steps x 2 layers verified" in outs[r] for r in outs),
              "landed: a host job running as the kernels landed verified every phase")
        check(cluster.wait_for(lambda: "slot %d back in use: failed pair" % held in c.log(0),
                               what="the slot to return"),
              "landed: node 0 put slot %d back in use" % held)
        check(nothing_held(c), "landed: GPU 0 moves again, nothing held")
        # 2. both slots kept on the stalled GPU: a host job is refused, named
        res = hang_after_plan(c, hang, ["slot.a", "slot.b"], seed + 4)
        check(all(v[0] == 0 for v in res.values()),
              "both kept: both CUDA jobs failed on every rank: %s"
              % {k: v[1][-200:] for k, v in res.items() if v[0] != 0})
        lines = [ln for ln in c.log(0).splitlines() if kept in ln][1:]
        check(sorted(int(ln.split("slot ", 1)[1].split(" ", 1)[0]) for ln in lines) == [0, 1],
              "both kept: node 0 keeps slots 0 and 1: %s" % lines)
        time.sleep(hb_ms / 1000.0)  # past their heartbeat timeout, as above
        res = cluster.outputs([(r, c.rank(r, "slot.refused", 1, 1, seed + 5, mode="fail"))
                               for r in range(world)])
        check(all(v[0] == 0 for v in res.values()) and
              all("no receive slot is free: GPU 0 is stalled" in res[r][1] for r in range(g)),
              "both kept: a host job is refused on every rank, node 0's naming the slots and "
              "GPU 0: %s" % [v[1].splitlines()[-1:] for v in res.values()])
        check(not slots_taken(c.log(0), "slot.refused"), "both kept: the refused job took no slot")
        hang.off()
        check(cluster.wait_for(lambda: c.log(0).count("back in use: failed pair") == 3,
                               what="both slots to return"),
              "landed: node 0 put both slots back in use")
        check(nothing_held(c), "landed: GPU 0 moves again, nothing held")
        cuda = [(r, c.rank(r, "slot.cuda", 2, 3, seed + 6, flags=cu)) for r in range(world)]
        host = [(r, c.rank(r, "slot.after", 2, 3, seed + 7)) for r in range(world)]
        outs = list(c.collect(cuda).values()) + list(c.collect(host).values())
        check(all("3 steps x 2 layers verified" in v for v in outs),
              "landed: a CUDA job and a host job verified side by side")
    finally:
        hang.release()
        c.stop()  # raises unless every daemon exits 0 (ASan: no report, no leak)


def scenario_own_stall(tmp, seed):
    """A daemon's own stall is not its GPU's (as service/mesh/mesh_session.c's heartbeats forgive
    a late tick): node 0, whose stand-in GPU takes 5 ms a work item (RW_FAKE_CUDA_LAG_MS), is
    stopped (SIGSTOP, as a loaded machine stops a process) for 1.5 x gpu_stall_ms at a moment its
    stream work is queued, while a CUDA job runs; once continued, its copies land at once. The job
    verifies every phase and node 0 declares no GPU stalled."""
    tmp = os.path.join(tmp, "own")
    os.mkdir(tmp)
    c = cluster.Cluster(tmp, 2, extra=AREA)
    c.env.update(RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    hang = cluster.HangSwitch(c, tmp, 0, {"RW_FAKE_CUDA_LAG_MS": "5"})  # its counts; never on
    world = c.nodes * c.gpus
    try:
        c.start_all()
        ranks = [(r, c.rank(r, "own.cuda", 1, 100, seed, flags=["--cuda"]))
                 for r in range(world)]

        def queued():
            k = hang.counts()
            return k["work"] > k["work_run"]
        check(cluster.wait_for(queued, what="node 0's stream work to be queued"),
              "own stall: node 0 has stream work queued")
        c.procs[0].send_signal(signal.SIGSTOP)
        time.sleep(1.5 * AREA["gpu_stall_ms"] / 1000.0)  # the stop is the condition
        c.procs[0].send_signal(signal.SIGCONT)
        outs = c.collect(ranks)
        check(all("100 steps x 1 layers verified" in outs[r] for r in outs),
              "own stall: the CUDA job verified every phase")
        check("GPU 0: copies queued" not in c.log(0),
              "own stall: node 0 declared no GPU stalled: %s"
              % [ln for ln in c.log(0).splitlines() if "GPU 0" in ln][:2])
    finally:
        c.stop()


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.PAGERANK) or \
            not os.path.exists(cluster.FAKE_CUDA) or not os.path.exists(cluster.FAKE_KERN):
        print("skip: railwaved, the ranks or the CUDA stand-in not built")
        return 77
    seed = cluster.test_seed()
    with tempfile.TemporaryDirectory(prefix="rwgpuhang.", dir="/tmp") as tmp:
        check.scenarios([("hung gpu", scenario_hang), ("answered late", scenario_late),
                         ("cuda mover", scenario_cuda_mover), ("slot settle", scenario_slot),
                         ("own stall", scenario_own_stall)],
                        tmp, seed)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
