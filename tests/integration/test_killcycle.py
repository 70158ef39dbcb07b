#!/usr/bin/env python3
"""Kill cycles (docs/security.md "What holds today"): one peer daemon is SIGKILLed again and
again while rail writes are in flight, and the survivors must keep their promises every time.

Each cycle: every rank of the cluster (tests/integration/rw_rank.c) submits one large dispatch;
the daemons post their rail writes in 32 KiB chunks one per 20 ms (the executor's test hook), so
a slab takes a good part of a second; as soon as a survivor has posted rail bytes for this phase
the victim (the last node) is killed. Then:
  * every rank on a survivor gets an error completion for that phase whose message names the
    dead peer ("peer K (nK)") - long before the phase timeout - and never calls it a rail's
    failure to be retried on the other rails;
  * the survivor daemons are alive (same pids) and, once the victim is back, every rank of the
    cluster runs the next phase and verifies every row it received and every combined sum;
  * at the end the survivors hold the same number of descriptors as after the warm-up cycles and
    their resident memory grew by less than a bound (flat, not growing per cycle);
  * no daemon log holds a sanitizer report, and every daemon exits 0 on SIGTERM (in the ASan
    build the survivors run the whole test under ASan + UBSan, so one use-after-free or leak in
    any of the cycles fails it).
Every other cycle the survivors are stopped (SIGSTOP) across the kill and continued once the
kernel has closed every connection of theirs to the victim: they then find the control and rail
closes waiting together, and whichever the loop takes first, the answer must name the dead
peer, never a rail to retry on. (A daemon that took the first rail close for a rail's own failure
answered so in 7 of 10 such cycles here, 0 of 10 unfrozen ones: the loop's order among events
that are all ready is not under the test's control, so one frozen cycle may pass by luck, 50 do
not.)

  test_killcycle.py [--kills N] [--nodes N]   (default: 100 kills, 3 nodes; RW_KILLS overrides)
Run by tests/run as $b/test/integration_killcycle; exits 0 pass, 1 fail, 77 skip."""
import argparse
import os
import random
import signal
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

WARMUP = 5              # cycles before the descriptor and memory baseline is taken
RSS_BOUND_KIB = 32 << 10  # survivors' resident growth allowed after the warm-up
# Under ASan freed memory waits in a quarantine (256 MiB by default) before it is reused, so
# resident memory climbs for a long time without any leak. A 16 MiB quarantine still catches a
# use right after a free (the shape of the bug docs/security.md "What holds today" lists) and lets
# the memory bound mean something; leaks are LeakSanitizer's, at the survivors' exit.
ASAN_QUARANTINE = "quarantine_size_mb=16"
SANITIZER_MARKS = ("AddressSanitizer", "LeakSanitizer", "runtime error:", "UndefinedBehavior")


def tx_bytes(c, n):
    return sum(int(f.split("=")[1]) for f in c.stats(n, "stats rails").split()
               if f.startswith("tx_bytes="))


def fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def settled_fds(pid, want):
    """Descriptors of `pid`, waiting (bounded) for transient ones (a stats connection being
    closed, a reconnect in progress) to go; returns the last count."""
    deadline = time.time() + 5
    n = fds(pid)
    while n != want and time.time() < deadline:
        time.sleep(0.02)
        n = fds(pid)
    return n


def quiet_fds(pid):
    """Descriptors of `pid` once they stopped changing for half a second (bounded): the
    baseline, taken right after a cycle, must not count the ranks' IPC connections or a stats
    connection the daemon has not closed yet."""
    deadline = time.time() + 5
    n, since = fds(pid), time.time()
    while time.time() - since < 0.5 and time.time() < deadline:
        time.sleep(0.02)
        m = fds(pid)
        if m != n:
            n, since = m, time.time()
    return n


def victim_links(c, victim):
    """TCP connections still established to the victim's control and rail ports (any process):
    /proc/net/tcp, remote address and port in hex, state 01."""
    ends = set()
    node = c.cfg["nodes"][victim]
    for addr in [node["control"]] + ["%s:%d" % (r["address"], r["port"]) for r in node["rails"]]:
        ip, port = addr.rsplit(":", 1)
        a = ip.split(".")
        ends.add("%02X%02X%02X%02X:%04X" % (int(a[3]), int(a[2]), int(a[1]), int(a[0]), int(port)))
    with open("/proc/net/tcp") as f:
        return [l for l in f.read().splitlines()[1:] if l.split()[2] in ends and l.split()[3] == "01"]


def one_cycle(c, i, victim, seed, freeze=False):
    """Kill the victim with writes in flight, check the survivors, restart it, run a verified
    phase. freeze: the survivors are stopped across the kill and continued once the kernel has
    closed their connections to the victim (every close waits for them at once). Returns the
    bytes the survivors had posted when the kill landed and how many of the survivor ranks'
    errors named the dead node."""
    survivors = range(victim)
    before = sum(tx_bytes(c, n) for n in survivors)
    big = ["--hidden", "2048", "--tokens", "96", "--first-step", str(2 * i)]
    procs = [(r, c.rank(r, "g.kc", 1, 1, seed + i, mode="fail", flags=big))
             for r in range(c.nodes * cluster.GPUS)]
    deadline = time.time() + cluster.WAIT
    while True:
        posted = sum(tx_bytes(c, n) for n in survivors) - before
        if posted > 0:
            break
        if time.time() > deadline:
            done = ["rank %d: %s" % (r, p.communicate()[0].decode().strip()[-300:])
                    for r, p in procs if p.poll() is not None]
            raise RuntimeError("cycle %d: no rail write was posted (ranks that ended: %s)\n%s"
                               % (i, "; ".join(done) or "none", c.logs()))
        time.sleep(0.002)
    t_kill = time.time()
    if freeze:
        for n in survivors:
            c.procs[n].send_signal(signal.SIGSTOP)
    try:
        c.kill(victim)
        closing = time.time() + 2  # loopback: the kernel closes them as the victim exits
        while freeze and victim_links(c, victim) and time.time() < closing:
            time.sleep(0.005)
    finally:
        if freeze:
            for n in survivors:
                c.procs[n].send_signal(signal.SIGCONT)
    outs = c.collect([rp for rp in procs if rp[0] < victim * cluster.GPUS])  # each: error, exit 0
    took = time.time() - t_kill
    for r, p in procs[victim * cluster.GPUS:]:  # the victim's ranks lost their daemon
        p.communicate(timeout=cluster.WAIT)
    # The reason names the dead node: "peer 1 (n1) ..." when the survivor learnt it from the
    # mesh, "cannot write to node 1 (n1) rail 0: ..." when a write could not be posted, "a rail
    # write to node 1 (n1) on rail 0 failed: ..." when a write already posted was the first to
    # notice; anything else is not a clear answer.
    node = "%d (%s)" % (victim, c.cfg["nodes"][victim]["name"])
    named = 0
    # A rail-down answer ("retry the phase, it runs on the other rail(s)") would be wrong: the
    # peer is dead, there is no other rail to it (the first rail close seen before the control
    # close must not be taken for a rail's own failure). With two rails the sentence says "rail":
    # the check looked for "rails" before, and missed every such answer.
    for r, out in outs.items():
        names = "peer " + node in out or "node " + node in out
        if "failed as expected" not in out or not names or "on the other rail" in out:
            raise RuntimeError("cycle %d: rank %d's error does not say the peer failed: %s\n%s"
                               % (i, r, out.strip(), c.logs()))
        named += names
    if took > cluster.WAIT / 2:
        raise RuntimeError("cycle %d: survivors failed the phase only by timeout (%.1f s)" % (i, took))
    c.start(victim)
    c.wait_mesh()
    outs = c.run_ranks("g.kc", layers=1, steps=1, seed=seed + i,
                       flags=["--first-step", str(2 * i + 1)])
    for r, out in outs.items():
        if "1 steps x 1 layers verified" not in out:
            raise RuntimeError("cycle %d: rank %d did not verify the next phase: %s" % (i, r, out))
    return posted, named


def sanitized():
    with open(os.path.join(B, "config.h")) as f:
        return "#define RW_SANITIZE 1" in f.read()


def sanitizer_reports(c):
    bad = []
    for n in range(c.nodes):
        path = os.path.join(c.tmp, "d%d.log" % n)
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                bad += ["d%d: %s" % (n, l.strip()) for l in f if any(m in l for m in SANITIZER_MARKS)]
    return bad


def run(kills, nodes, seed):
    victim = nodes - 1
    with tempfile.TemporaryDirectory(prefix="rwkc.", dir="/tmp") as tmp:
        # A phase timeout far above any cycle: a survivor that only fails by timeout is caught.
        c = cluster.Cluster(tmp, nodes, path="native",
                       extra={"phase_timeout_ms": 60000, "recv_region_mib": 16})
        c.env.update(RAILWAVE_TEST_CHUNK_KIB="32", RAILWAVE_TEST_WRITE_GAP_MS="20")
        if sanitized():
            opts = c.env.get("ASAN_OPTIONS", "")
            c.env["ASAN_OPTIONS"] = (opts + ":" if opts else "") + ASAN_QUARANTINE
        t0 = time.time()
        posted_min, named, told = None, 0, 0
        try:
            c.start_all()
            pids = {n: c.procs[n].pid for n in range(victim)}
            base_fds, base_rss = {}, {}
            for i in range(kills):
                posted, n_named = one_cycle(c, i, victim, seed, freeze=i % 2 == 1)
                named += n_named
                told += victim * cluster.GPUS
                posted_min = posted if posted_min is None else min(posted_min, posted)
                for n in range(victim):
                    if c.procs[n].poll() is not None or c.procs[n].pid != pids[n]:
                        raise RuntimeError("cycle %d: survivor %d died\n%s" % (i, n, c.logs()))
                if i + 1 == WARMUP:
                    for n in range(victim):
                        base_fds[n] = quiet_fds(pids[n])
                        base_rss[n] = cluster.rss_kib(pids[n])
            growth = {}
            for n in range(victim):
                now = settled_fds(pids[n], base_fds.get(n, 0))
                if base_fds and now != base_fds[n]:
                    raise RuntimeError("survivor %d: %d descriptors after the warm-up, %d after "
                                       "%d kills" % (n, base_fds[n], now, kills))
                growth[n] = cluster.rss_kib(pids[n]) - base_rss.get(n, 0)
                if base_rss and growth[n] > RSS_BOUND_KIB:
                    raise RuntimeError("survivor %d: resident memory grew %d KiB over %d kills"
                                       % (n, growth[n], kills - WARMUP))
        finally:
            c.stop()  # every daemon exits 0: under ASan, no leak and no report at exit
        bad = sanitizer_reports(c)
        if bad:
            raise RuntimeError("sanitizer reports:\n" + "\n".join(bad[:20]))
    print("ok   %d kills of node %d with rail writes in flight (at least %d bytes posted by the "
          "survivors at each kill; %d of them with the survivors stopped across the kill), every "
          "survivor rank told its phase failed for a peer (%d of %d errors named the node), next "
          "phase verified every time; survivors' descriptors flat, resident growth %s KiB after "
          "the warm-up; %.1f s"
          % (kills, victim, posted_min or 0, kills // 2, named, told,
                               ", ".join(str(g) for g in growth.values()) if base_rss else "-",
                               time.time() - t0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=int(os.environ.get("RW_KILLS", "100")))
    ap.add_argument("--nodes", type=int, default=3)
    args = ap.parse_args()
    if not cluster.built(cluster.DAEMON, cluster.RANK):
        print("skip: railwaved or rw_rank not built")
        return 77
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or random.randrange(1, 1 << 30)
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    try:
        run(args.kills, args.nodes, seed)
    except Exception as e:  # report and fail
        print("FAIL: %s" % e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
