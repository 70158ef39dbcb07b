#!/usr/bin/env python3
"""Rank authentication on the IPC socket (docs/ipc.md "Rank authentication")
with real railwaved daemons, real rank processes (tests/integration/rw_rank.c, which verify every
row they receive) and real sockets:

1. A job's ranks join with its group key (RAILWAVE_GROUP_KEY). While they carry verified
   phases, squatters try to take their ranks: with no key, with a wrong key, with the hello of
   the first form (no key field), and as a librailwave rank with a wrong key. Each is refused
   with RW_E_GROUP_KEY and a message naming the group and why; the job's ranks finish every
   phase verified; the squatters' attempts show in `stats` (ipc_refused_key).
2. `stats clients` shows every rank's pid, uid and gid (SO_PEERCRED) and the rank it holds, and
   the daemon's join/leave log lines carry them too.
3. The socket is 0660 and owned by root's group: a client run as `nobody` (setpriv) cannot
   connect at all (EACCES).
4. With ipc_group = nobody's group and ipc_max_per_uid = 4, `nobody` holds 4 connections; its
   fifth is refused with RW_E_LIMIT and a message naming the per-uid limit, and the job's ranks
   (root) still connect and carry verified phases.
5. Name squatters (docs/security.md): a real process opens a job's group name on node 0 before
   the job. Without a key it loses the name to the keyed job; with a key of its own it keeps it,
   and the job's peers hear of their ranks' refusals at once; a rank of the job refused while its
   siblings gather fails the phase everywhere at once; a stranger's refused try at a starting
   job changes nothing; a squatter running phases with its own key meets the job in the count
   exchange, and both fail without a row moving.
Every daemon then stops cleanly on SIGTERM (exit 0; under ASan: no leak, no report).
Run by tests/run as $b/test/ipc_rankauth; exits 0 pass, 1 fail, 77 skip."""
import grp
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

E_GROUP_KEY, E_LIMIT = -55, -51  # ipc/railwave.h
KEY = "9f2c4e7a1b3d5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8"
FAILS = []


def check(cond, what):
    if not cond:
        FAILS.append(what)
        print("FAIL: " + what)


def hello(group, rank, world, node, gpu, key=None, first_form=False):
    """An ipc/proto.h HELLO: header, group[64], rank, world, node, local_gpu, uuid[16], then
    key_len, reserved, key[64] (absent in the first form)."""
    version = 2
    body = struct.pack("<IHHII64sIIIi16s", 0x50495752, version, 1, 1, 0, group.encode(), rank,
                       world, node, gpu, b"\0" * 16)
    if first_form:
        return body
    k = (key or "").encode()
    return body + struct.pack("<II64s", len(k), 0, k)


def try_hello(path, msg):
    """Send one hello; returns ("ok", None) or ("error", code, message)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    s.send(msg)
    reply = s.recv(256)
    s.close()
    _, _, typ, _, _ = struct.unpack_from("<IHHII", reply)
    if typ == 2:
        return ("ok", None, "")
    code, _fatal = struct.unpack_from("<iI", reply, 16)
    return ("error", code, reply[24:136].split(b"\0")[0].decode())


def joined_clients(c, n, group):
    return [l for l in c.stats(n, "stats clients").splitlines() if "group=%s " % group in l]


def wait_joined(c, group, count, procs):
    deadline = time.time() + cluster.WAIT
    while sum(len(joined_clients(c, n, group)) for n in range(c.nodes)) < count:
        if time.time() > deadline or any(p.poll() is not None for _, p in procs):
            raise RuntimeError("the job's ranks did not all join\n" + c.logs())
        time.sleep(0.01)


def scenario_squatters(tmp, seed):
    c = cluster.Cluster(tmp, 2)
    env = dict(c.env, RAILWAVE_GROUP_KEY=KEY)
    try:
        c.start_all()
        # Many small phases, so the job is still running while the squatters try.
        procs = [(r, c.rank(r, "job.k", 2, 500, seed, env=env)) for r in range(2 * cluster.GPUS)]
        wait_joined(c, "job.k", 2 * cluster.GPUS, procs)
        # 2. SO_PEERCRED in `stats clients`: each rank's line names its process.
        lines = c.stats(0, "stats clients").splitlines() + c.stats(1, "stats clients").splitlines()
        for r, p in procs:
            want = "pid=%d uid=%d gid=%d group=job.k rank=%d " % (p.pid, os.getuid(), os.getgid(), r)
            check(any(l.startswith("client=") and want in l for l in lines),
                  "stats clients shows rank %d as '%s': %s" % (r, want, lines))
        sock0 = c.cfg["nodes"][0]["ipc_socket"]
        attempts = [
            ("no key", hello("job.k", 1, 4, 0, -1), "group job.k has a group key and this rank gave none"),
            ("wrong key", hello("job.k", 1, 4, 0, -1, key=KEY[:-1] + "0"),
             "group job.k: key differs from the one its first rank set"),
            ("first-form hello", hello("job.k", 0, 4, 0, -1, first_form=True),
             "group job.k has a group key and this rank gave none"),
            ("short key", hello("job.k", 1, 4, 0, -1, key="abc"), "shorter than 16 bytes"),
        ]
        for what, msg, want in attempts:
            res = try_hello(sock0, msg)
            check(res[0] == "error" and res[1] == E_GROUP_KEY and want in res[2],
                  "squatter (%s) refused with RW_E_GROUP_KEY '%s': got %s" % (what, want, res))
        # A librailwave rank with a wrong key: the same refusal, as its trainer would see it.
        bad = c.rank(1, "job.k", 1, 1, seed, env=dict(c.env, RAILWAVE_GROUP_KEY="x" * 32))
        out, _ = bad.communicate(timeout=cluster.WAIT)
        check(bad.returncode != 0 and b"group key" in out,
              "a wrong-key rank is refused with a group-key error: rc %s %r" % (bad.returncode, out))
        alive = all(p.poll() is None for _, p in procs)
        check(alive, "the job was still running while the squatters tried (raise its steps)")
        outs = c.collect(procs)  # every phase verified, exit 0
        for r in range(2 * cluster.GPUS):
            check("500 steps x 2 layers verified" in outs[r], "rank %d verified: %s" % (r, outs[r]))
        summary = c.stats(0, "stats")
        check("ipc_refused_key 5\n" in summary, "stats counts 5 key refusals: %s" % summary)
    finally:
        c.stop()
    with open(os.path.join(tmp, "d0.log")) as f:
        log = f.read()
    pid0 = procs[0][1].pid
    check("rank 0/4 node 0 gpu 0 (pid %d uid %d gid %d, keyed group)" % (pid0, os.getuid(), os.getgid()) in log,
          "the join log line carries the rank's credentials")
    check("left: group job.k rank 0 (pid %d uid %d gid %d)" % (pid0, os.getuid(), os.getgid()) in log,
          "the leave log line carries the rank's credentials")
    print("ok   squatters (no key, wrong key, first-form hello, short key, librailwave with a "
          "wrong key) refused with RW_E_GROUP_KEY while the job carried 1000 verified phases; "
          "stats clients and the logs show pid/uid/gid")


# A name squatter: a real process that opens a job's group on node 0 before the job, holding
# ranks of it with the given key ("" for none); it prints what the daemon tells each connection
# ("joined", "refused CODE MSG", "dropped CODE MSG"); once every connection was dropped it tries
# a fresh hello without a key ("again CODE MSG") and exits. It exits when its stdin closes too.
SQUATTER = r"""
import select, socket, struct, sys
path, group, key, ranks = sys.argv[1], sys.argv[2], sys.argv[3], [int(r) for r in sys.argv[4:]]
def hello(rank, k):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    k = k.encode()
    s.send(struct.pack("<IHHII64sIIIi16sII64s", 0x50495752, 2, 1, 1, 0, group.encode(), rank, 4,
                       0, rank % 2, b"\0" * 16, len(k), 0, k))
    return s
def error(reply):
    code = struct.unpack_from("<i", reply, 16)[0]
    return "%d %s" % (code, reply[24:136].split(b"\0")[0].decode())
held = []
for r in ranks:
    s = hello(r, key)
    reply = s.recv(256)
    if struct.unpack_from("<IHHII", reply)[2] == 2:
        print("joined")
        held.append(s)
    else:
        print("refused " + error(reply))
sys.stdout.flush()
while held:
    ready, _, _ = select.select(held + [sys.stdin], [], [])
    if sys.stdin in ready and not sys.stdin.read():
        sys.exit(0)
    for s in ready:
        if s is sys.stdin:
            continue
        reply = s.recv(256)
        if reply:
            print("dropped " + error(reply))
        held.remove(s)
        s.close()
    sys.stdout.flush()
s = hello(ranks[0], "")
print("again " + error(s.recv(256)))
"""


def squatter(c, group, key, ranks):
    """Starts the squatter on node 0's socket; returns it once it printed its hellos' answers."""
    p = subprocess.Popen([sys.executable, "-c", SQUATTER, c.cfg["nodes"][0]["ipc_socket"], group,
                          key] + [str(r) for r in ranks],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    p.lines = [p.stdout.readline().decode().strip() for _ in ranks]
    return p


def squat_claimed(c, env, seed):
    """A squatter without a key holds ranks 0 and 1 of job.sq on node 0. The job (keyed) claims
    the name: the squatter's connections are dropped and told why, it cannot come back without
    the key, and every phase of the job verifies."""
    sq = squatter(c, "job.sq", "", [0, 1])
    check(sq.lines == ["joined", "joined"], "the keyless squatter joined job.sq: %s" % sq.lines)
    procs = [(r, c.rank(r, "job.sq", 2, 20, seed, env=env)) for r in range(2 * cluster.GPUS)]
    try:
        outs = c.collect(procs)
        for r in range(2 * cluster.GPUS):
            check("20 steps x 2 layers verified" in outs[r], "rank %d verified: %s" % (r, outs[r]))
    finally:  # closes its stdin: a squatter still holding on (the claim failed) exits
        rest = sq.communicate(timeout=cluster.WAIT)[0].decode().splitlines()
    dropped = [l for l in rest if l.startswith("dropped")]
    check(len(dropped) == 2 and all(
        "%d group job.sq, opened without a key, was claimed by a rank with one" % E_GROUP_KEY in l
        for l in dropped), "both squatter connections dropped, told why: %s" % rest)
    check(any(l.startswith("again %d group job.sq has a group key and this rank gave none"
                           % E_GROUP_KEY) for l in rest),
          "the squatter cannot come back without the key: %s" % rest)
    check("ipc_groups_claimed 1\n" in c.stats(0, "stats"), "stats counts the claim")


def squat_keyed(c, env, seed):
    """A squatter with a key of its own holds rank 0 of job.sk on node 0: the job's ranks there
    are refused (the key differs), and their peers on node 1 hear it at once, named, in the
    phase's error, whether their rows reach node 0 after the refusals or before them."""
    sq = squatter(c, "job.sk", "squatter-key-0123456789", [0])
    check(sq.lines == ["joined"], "the keyed squatter joined job.sk: %s" % sq.lines)
    sq2 = squatter(c, "job.sk2", "squatter-key-0123456789", [0])
    try:
        for r in (0, 1):
            bad = c.rank(r, "job.sk", 1, 1, seed, env=env)
            out, _ = bad.communicate(timeout=cluster.WAIT)
            check(bad.returncode != 0 and b"group key" in out,
                  "job rank %d refused at node 0 (group key): %r" % (r, out))
        want = "node 0 (n0): rank 1 could not join: group job.sk: key differs"
        peers = [(r, c.rank(r, "job.sk", 1, 1, seed, mode="fail", env=env)) for r in (2, 3)]
        for r, out in c.collect(peers).items():
            check("failed as expected" in out and want in out,
                  "rank %d's phase failed naming node 0's refusal (%s): %s" % (r, want, out))
        # The peers' rows first: they wait at node 0 when the refusal comes.
        peers = [(r, c.rank(r, "job.sk2", 1, 1, seed, mode="fail", env=env)) for r in (2, 3)]
        for r, p in peers:
            line = p.stdout.readline().strip()
            check(line == b"submitted", "peer rank %d submitted: %r" % (r, line))
        bad = c.rank(0, "job.sk2", 1, 1, seed, env=env)
        bad.communicate(timeout=cluster.WAIT)
        want = "node 0 (n0): rank 0 could not join: group job.sk2: key differs"
        for r, out in c.collect(peers).items():
            check("failed as expected" in out and want in out,
                  "rank %d's phase failed naming node 0's refusal (%s): %s" % (r, want, out))
    finally:
        for p in (sq, sq2):
            p.stdin.close()
            p.wait(timeout=cluster.WAIT)


def squat_dup(c, env, seed):
    """A rank of the job refused while its siblings' dispatch gathers on node 0 (rank 0 started
    twice, its seat taken): the pair fails on every node at once, naming it."""
    peers = [(r, c.rank(r, "job.dup", 1, 1, seed, mode="fail", env=env)) for r in (0, 2, 3)]
    for r, p in peers:
        line = p.stdout.readline().strip()
        check(line == b"submitted", "rank %d submitted: %r" % (r, line))
    dup = c.rank(0, "job.dup", 1, 1, seed, env=env)
    out, _ = dup.communicate(timeout=cluster.WAIT)
    check(dup.returncode != 0 and b"already connected" in out, "the second rank 0 refused: %r" % out)
    for r, out in c.collect(peers).items():
        check("failed as expected" in out and "rank 0 could not join: this rank of this group is "
              "already connected" in out, "rank %d's phase failed naming the refused rank: %s"
              % (r, out))


def squat_stranger(c, env, seed):
    """A stranger's refused try (a wrong key) at a seat the job has not taken yet changes
    nothing: the job's ranks that came wait for their sibling as usual, and verify."""
    procs = [(r, c.rank(r, "job.st", 1, 3, seed, env=env)) for r in (0, 2, 3)]
    wait_joined(c, "job.st", 3, procs)
    res = try_hello(c.cfg["nodes"][0]["ipc_socket"], hello("job.st", 1, 4, 0, 1, key=KEY[:-1] + "0"))
    check(res[0] == "error" and res[1] == E_GROUP_KEY, "the stranger refused: %s" % (res,))
    procs.append((1, c.rank(1, "job.st", 1, 3, seed, env=env)))
    outs = c.collect(procs)
    check(all("3 steps x 1 layers verified" in o for o in outs.values()),
          "job.st verified despite the stranger: %s" % outs)


def squat_other_key(c, env, seed):
    """A squatter with a key of its own that holds every seat of node 0 and runs phases (two
    rank processes): the job's ranks on node 1 meet it in the count exchange, and the phase fails
    on both sides, naming the other key; no row of the job reaches the squatter (before, the
    phase ran between them: the squatter's ranks received the job's rows)."""
    senv = dict(c.env, RAILWAVE_GROUP_KEY="squatter-key-0123456789")
    both = [(r, c.rank(r, "job.sf", 1, 1, seed, mode="fail", env=senv if r < 2 else env))
            for r in range(2 * cluster.GPUS)]
    for r, out in c.collect(both).items():
        check("failed as expected" in out and "with another group key" in out,
              "rank %d's phase failed naming the other key: %s" % (r, out))


def scenario_name_squatters(tmp, seed):
    # A long phase timeout: before, the peers of a blocked job waited it out (and their message
    # said so); now they hear why at once, so nothing here waits for it.
    c = cluster.Cluster(tmp, 2, extra={"phase_timeout_ms": 20000})
    env = dict(c.env, RAILWAVE_GROUP_KEY=KEY)
    try:
        c.start_all()
        for fn in (squat_claimed, squat_keyed, squat_dup, squat_stranger, squat_other_key):
            n = len(FAILS)
            try:
                fn(c, env, seed)
            except Exception as e:  # counted; the next part still runs
                check(False, "%s: %s" % (fn.__name__, e))
            print("%s %s" % ("ok  " if len(FAILS) == n else "FAIL", fn.__doc__.split(":")[0]))
    finally:
        c.stop()


AS_NOBODY = r"""
import socket, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    return s
if n == 0:
    try:
        conn()
        print("connected")
    except PermissionError:
        print("EACCES")
    sys.exit(0)
held = []
for i in range(n):  # ranks 0 and 1 (node 0 of the 2x2 test cluster) of groups squat0, squat1...
    s = conn()
    s.send(struct.pack("<IHHII64sIIIi16sII64s", 0x50495752, 2, 1, 1, 0, b"squat%d" % (i // 2),
                       i % 2, 4, 0, i % 2, b"\0" * 16, 0, 0, b""))
    reply = s.recv(256)
    print("joined" if struct.unpack_from("<IHHII", reply)[2] == 2 else "refused")
    held.append(s)
s = conn()
reply = s.recv(256)
code = struct.unpack_from("<i", reply, 16)[0]
print("extra %d %s" % (code, reply[24:136].split(b"\0")[0].decode()))
sys.stdout.flush()
sys.stdin.read()  # hold the connections until the test closes our stdin
"""


def as_nobody(args, **kw):
    nobody = pwd.getpwnam("nobody")
    return subprocess.Popen(["setpriv", "--reuid=%d" % nobody.pw_uid, "--regid=%d" % nobody.pw_gid,
                             "--clear-groups", sys.executable, "-c", AS_NOBODY] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def scenario_other_uid(tmp, seed):
    # 3. Socket 0660, group root's own: nobody is not let in at all.
    c = cluster.Cluster(tmp, 1)
    try:
        c.start_all()
        p = as_nobody([c.cfg["nodes"][0]["ipc_socket"], "0"])
        out, _ = p.communicate(timeout=cluster.WAIT)
        check(out.strip() == b"EACCES", "nobody connecting to a 0660 root socket: %r" % out)
        mode = os.stat(c.cfg["nodes"][0]["ipc_socket"]).st_mode & 0o777
        check(mode == 0o660, "socket mode %o, want 660" % mode)
    finally:
        c.stop()
    print("ok   a process of another uid, not in ipc_group, cannot connect (socket 0660)")


def scenario_uid_cap(tmp, seed):
    # 4. ipc_group = nobody's group: nobody may connect, but only ipc_max_per_uid times.
    group = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    c = cluster.Cluster(tmp, 2, extra={"ipc_group": group, "ipc_max_per_uid": 4})
    try:
        c.start_all()
        sock0 = c.cfg["nodes"][0]["ipc_socket"]
        st = os.stat(sock0)
        check(st.st_gid == grp.getgrnam(group).gr_gid and st.st_mode & 0o777 == 0o660,
              "socket owned by group %s, mode 0660" % group)
        p = as_nobody([sock0, "4"], stdin=subprocess.PIPE)
        lines = [p.stdout.readline().decode().strip() for _ in range(5)]
        check(lines[:4] == ["joined"] * 4, "nobody's 4 connections joined: %s" % lines)
        want = "extra %d uid %d already holds 4 connections, the per-uid limit" % (
            E_LIMIT, pwd.getpwnam("nobody").pw_uid)
        check(lines[4].startswith(want), "nobody's fifth connection refused: %r" % lines[4])
        held = [l for l in c.stats(0, "stats clients").splitlines()
                if "pid=%d uid=%d " % (p.pid, pwd.getpwnam("nobody").pw_uid) in l]
        check(len(held) == 4, "stats clients shows nobody's 4 connections by pid/uid: %s" % held)
        # The job's ranks (root) are not locked out by nobody's connections.
        outs = c.run_ranks("job.cap", layers=2, steps=3, seed=seed)
        check(all("verified" in o for o in outs.values()), "job verified: %s" % outs)
        check("ipc_refused_uid 1\n" in c.stats(0, "stats"), "stats counts the per-uid refusal")
        p.stdin.close()
        p.wait(timeout=cluster.WAIT)
    finally:
        c.stop()
    print("ok   per-uid cap: nobody's fifth connection refused (RW_E_LIMIT, names the limit), "
          "the job's ranks still connect and verify")


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK):
        print("skip: railwaved or rw_rank not built")
        return 77
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or int(time.time()) % (1 << 30)
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    uid_ok = os.getuid() == 0 and shutil.which("setpriv")
    with tempfile.TemporaryDirectory(prefix="rwauth.", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)  # the folder is not what keeps other uids out: the socket is
        for name, fn, needs_root in [("squatters", scenario_squatters, False),
                                     ("name_squatters", scenario_name_squatters, False),
                                     ("other_uid", scenario_other_uid, True),
                                     ("uid_cap", scenario_uid_cap, True)]:
            if needs_root and not uid_ok:
                print("skip %s: needs root and setpriv to run a client as nobody" % name)
                continue
            try:
                fn(tmp, seed)
            except Exception as e:  # counted; the other scenarios still run
                check(False, "%s: %s" % (name, e))
    if FAILS:
        print("%d check(s) failed" % len(FAILS))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
