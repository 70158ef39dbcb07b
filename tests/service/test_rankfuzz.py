#!/usr/bin/env python3
"""Hostile page ranks and kill cycles against two real railwaved (docs/rankpath.md "Failure"),
with a host job of another group verified beside them (every row and sum exact) all along.

1. A group of four page ranks (tests/integration/rw_pagerank, mode fuzz: each plays its stream
   from the CPU) runs RW_RANKFUZZ_ROUNDS rounds (a dispatch and its combine each); a seeded plan
   makes one rank of most rounds hostile: a slot of garbage (one field or count-row entry made
   wrong, the reserved word noise), a slot rewritten while the daemon copies it, its page
   head and status lines rewritten, a lying pack (a record's tag, source, owner, top-k count,
   ids or token wrong) or gather (a return's header wrong or never written), a combine submit
   whose rows, hidden or dtype are not its dispatch's, a combine slot of garbage (its phase,
   kind, rows, count row, dtype, path or abort reason wrong: refused, naming the field) or
   marked an abort (rw_client_rank_abort's slot: "aborted its combine"), and the round's
   combine fails on every other rank at once, RW_E_PHASE naming the attacker), random bytes over
   the group's slabs, a word moved back or far ahead, packed before its records, done before
   arrived, the daemon's plan or arrived forged by the rank, its slot rewritten once the daemon
   took it, or the rank gone at one of seven points of the phase (before its dispatch's submit,
   after that submit, packed or done, after its combine's submit, packed or done), SIGKILLed or
   saying goodbye, alone, with a second rank in the same phase, or first joining another group
   under its rank — a dropped, leaving or killed rank joins again and plays on (one gone before
   its submit without waiting for the others). Every rank checks what the round allows
   (rw_pagerank.c "mode fuzz"): the others' phases pass with every row checked where the
   attack is refused on its own (a rewritten head, a slot rewritten after the daemon took it,
   a stray combine's slot); a round whose rank went before its submit fails on every other rank
   naming it gone, and no round a rank went in ends by the phase timeout; a garbage dispatch
   slot is refused to its rank naming the field, and fails the round's phase on every other
   rank at once, RW_E_PHASE naming the attacker ("local rank A: ..."), the next round passing
   on; other attacks end the others' phases named; the attacker is told what it did. Every
   rank must exit 0.
2. The daemon at node 1 SIGKILLed while a group of page ranks runs phases, RW_RANKFUZZ_KILLS
   times: every rank's phase fails and its stream runs through; the daemon restarted, a new
   page group and a host job pass. (A host job spans both daemons: it runs beside stage 1 and
   after each restart, not across a kill.)
3. After all of it: a new page group passes; no peer was ever dropped for a hostile rank; each
   daemon's descriptors and shared mappings (/proc/PID/fd, /proc/PID/maps) are back to what
   they were before (node 0's across both stages; node 1's before its first kill); every
   daemon exits 0 on SIGTERM (ASan build: no leak, no error).
The seed is 1 unless RW_TEST_SEED names another; RW_RANKFUZZ_ROUNDS (default 40) and
RW_RANKFUZZ_KILLS (default 2) make a longer soak. Run by tests/run as $b/test/svc_rankfuzz; exits 0 pass, 1 fail, 77 skip."""
import collections
import os
import random
import re
import sys
import tempfile
import threading
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

check = cluster.Checks()
FUZZ_WAIT = 600  # bound on the fuzz group's run (never a pass/fail timing criterion)


def footprint(pid):
    """(descriptors, shared mappings, their bytes) of a process."""
    fds = len(os.listdir("/proc/%d/fd" % pid))
    n = size = 0
    with open("/proc/%d/maps" % pid) as f:
        for line in f:
            addr, perms = line.split()[:2]
            if perms[3] == "s":
                lo, hi = (int(x, 16) for x in addr.split("-"))
                n += 1
                size += hi - lo
    return fds, n, size


def settled(c, n, base, what):
    """Daemon n's footprint back to `base` (carve-outs go a heartbeat timeout after a failed
    pair, pages once the poller retired their words): polled within the wait bound."""
    pid = c.procs[n].pid
    deadline = time.time() + cluster.WAIT
    now = footprint(pid)
    while now != base and time.time() < deadline:
        time.sleep(0.2)
        now = footprint(pid)
    check(now == base, "%s: daemon %d's descriptors, shared mappings and their bytes %s, as "
          "before %s" % (what, n, now, base))


class HostJob(threading.Thread):
    """Host jobs of four rw_rank (group jobN) one after the other until stopped, each verifying
    every row and sum; every one must pass."""

    def __init__(self, c, seed):
        super().__init__(daemon=True)
        self.c, self.seed, self.stopping, self.runs, self.fails = c, seed, False, 0, []

    def run(self):
        while not self.stopping:
            try:
                self.c.run_ranks("job%d" % self.runs, 2, 20, self.seed + self.runs)
            except RuntimeError as e:
                self.fails.append(str(e)[-800:])
                return
            self.runs += 1

    def finish(self, what):
        self.stopping = True
        self.join(cluster.WAIT * 2)
        check(not self.is_alive() and not self.fails and self.runs > 0,
              "%s: the host job passed %d runs beside it, every row and sum verified %s"
              % (what, self.runs, self.fails or ""))


def good_group(c, name, seed):
    res = cluster.outputs([(r, c.pagerank(r, name, 1, 2, seed, "ok"))
                           for r in range(c.nodes * c.gpus)])
    bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
    return bad


def fuzz(c, seed, rounds):
    """Stage 1: the fuzz group's four ranks; their outputs."""
    meet = os.path.join(c.tmp, "meet")
    os.makedirs(meet, exist_ok=True)
    env = dict(c.env, RW_PAGERANK_FUZZ=str(seed), RW_PAGERANK_FUZZ_DIR=meet)
    return cluster.outputs([(r, c.pagerank(r, "fuzz", 2, rounds // 2, seed, "fuzz", env))
                            for r in range(c.nodes * c.gpus)], FUZZ_WAIT)


def fuzz_checks(res, rounds):
    kinds, dropped, lines = collections.Counter(), {}, collections.defaultdict(dict)
    for r, (rc, out) in sorted(res.items()):
        summary = [ln for ln in out.splitlines() if ln.startswith("fuzz: rank")]
        ok = rc == 0 and summary and "check failed" not in summary[0]
        check(ok, "fuzz rank %d exits 0 after %d rounds: %s" % (r, rounds, summary or "")
              + ("" if ok else "\n" + out[-2500:]))
        for ln in out.splitlines():
            m = re.match(r"fuzz round (\d+) (\S+) by rank (\d+): rank (\d+) (.*)", ln)
            if m:
                lines[int(m.group(1))][int(m.group(4))] = ln
            if m and m.group(3) == m.group(4):
                print("  " + ln[:240])  # what each attacker did and heard
                kinds[m.group(2)] += 1
                if "dropped: rank page word" in m.group(5):
                    dropped[m.group(1)] = m.group(5)
    for i, by in sorted(lines.items()):  # a refused slot: the round fails everywhere, named
        att = [ln for ln in by.values() if re.search(r" slot by rank (\d+): rank \1 refused .*"
                                                      r"the round failed", ln) or
               re.search(r" cslot by rank (\d+): rank \1 combine failed", ln)]
        if att:
            a = re.search(r"by rank (\d+)", att[0]).group(1)
            what = "combine" if " cslot " in att[0] else "dispatch"
            others = {r: ln.split(": rank %d " % r, 1)[1][:160] for r, ln in by.items()
                      if str(r) != a}
            check(len(others) == len(res) - 1 and all(
                "failed: " in v and "local rank %s: " % a in v and
                (what == "dispatch" or v.startswith("combine failed")) for v in others.values()),
                "round %d: rank %s's refused %s slot failed the %s of every other rank, naming "
                "it: %s" % (i, a, what, what, others))
    check(dropped, "ranks that moved a word were dropped, told why (rw_pagerank checks the "
          "words): %s" % sorted(dropped.items())[:3])
    print("attacks played (lines of the attackers, a killed life's round counted again): %s"
          % dict(sorted(kinds.items())))
    check(len(kinds) >= 6, "the rounds covered at least 6 kinds of attack (%d)" % len(kinds))


def stages(c, seed, rng, rounds, kills):
    """Stages 1 to 3 (the docstring's) on the cluster c."""
    c.start_all()
    # what stays once a page group and a host job ran and left: the baseline
    check(not good_group(c, "warm", seed), "a page group passes on fresh daemons")
    c.run_ranks("warmjob", 1, 2, seed)
    base = {}
    for n in range(c.nodes):
        time.sleep(0.5)
        base[n] = footprint(c.procs[n].pid)
        settled(c, n, base[n], "baseline")

    host = HostJob(c, seed)
    host.start()
    t0 = time.time()
    fuzz_checks(fuzz(c, seed, rounds), rounds)
    print("stage 1: %d rounds in %.1f s" % (rounds, time.time() - t0))
    bad = good_group(c, "after", seed)
    check(not bad, "after the hostile ranks a new page group passes %s" % (bad or ""))
    host.finish("hostile ranks")
    check(": down (" not in c.log(0) + c.log(1),
          "no node dropped its peer for a hostile rank (no peer went down on either daemon)")
    for n in range(c.nodes):
        settled(c, n, base[n], "after the hostile ranks")

    for cyc in range(kills):
        peer = [(r, c.pagerank(r, "peer%d" % cyc, 1, 1000000, seed, "until"))
                for r in range(c.nodes * c.gpus)]
        line = peer[0][1].stdout.readline().decode()
        check("until: running" in line, "kill %d: a page group runs phases (%r)" % (cyc, line))
        time.sleep(rng.random() * 0.3)  # a seeded point of its phases
        c.kill(1)
        res = cluster.outputs(peer)
        bad = {r: (v[0], v[1][-300:]) for r, v in res.items()
               if v[0] != 0 or "until: phase" not in v[1] or "failed" not in v[1]}
        check(not bad, "kill %d: daemon 1 SIGKILLed mid-job: every page rank's phase failed "
              "and its stream ran through %s" % (cyc, bad or ""))
        c.start(1)
        c.wait_mesh()
        bad = good_group(c, "back%d" % cyc, seed)
        check(not bad, "kill %d: daemon 1 restarted, a new page group passes %s"
              % (cyc, bad or ""))
        try:
            c.run_ranks("backjob%d" % cyc, 1, 2, seed)
            check(True, "kill %d: a host job passes after the restart" % cyc)
        except RuntimeError as e:
            check(False, "kill %d: a host job after the restart: %s" % (cyc, e))
    if kills:
        settled(c, 0, base[0], "after %d peer kills" % kills)
    c.stop()
    check(True, "every daemon exited 0 on SIGTERM")


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.PAGERANK):
        print("skip: railwaved, rw_rank or rw_pagerank not built")
        return 77
    # a fixed seed by default (seed 1 found the three defects this test was written with); the
    # soak and replays name theirs
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or 1
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    rng = random.Random(seed)
    rounds = max(2, int(os.environ.get("RW_RANKFUZZ_ROUNDS", "40")) // 2 * 2)
    kills = int(os.environ.get("RW_RANKFUZZ_KILLS", "2"))
    tmp = tempfile.mkdtemp(prefix="rw-rankfuzz-")
    c = cluster.Cluster(tmp, 2, rails=2, extra={"group_area_mib": 1, "group_pool_mib": 12})
    return check.run(c, lambda: stages(c, seed, rng, rounds, kills))


if __name__ == "__main__":
    sys.exit(main())
