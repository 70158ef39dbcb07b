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
