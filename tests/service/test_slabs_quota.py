#!/usr/bin/env python3
"""The carve-out pool is not first come, first served (docs/security.md "The carve-out pool";
docs/rankpath.md "The slab areas, lent per group"): real railwaved daemons on loopback, real rank
processes (tests/integration/rw_rank.c --slabs, which verify every row they receive), and as the
attacker a process of another uid (`nobody`, setpriv; the socket's group is nobody's) speaking
ipc/proto.h by hand. The pool holds one carve-out (group_pool_mib = group_area_mib, as the example
cluster files size it) unless a scenario says otherwise.

1. Taken back: a squatter takes the pool with a group of its own (one rank, one slab request)
   and fills its slab with garbage; a job's rank that asks at once is refused (RW_E_LIMIT,
   naming the pool and group_carve_idle_s). The squatter leaves and, under another group name,
   takes the pool again at once (its idle clock goes on: leaving and joining again does not start
   it again). Past group_carve_idle_s from its first take (4 s; the second group is then 2 s old)
   a job's ranks ask: the squatter's carve-out is taken back (logged, counted in `stats`), the job
   is lent fresh objects and verifies 40 phases with every remote row in its slabs; the squatter
   is told (a notice, RW_E_LIMIT, "taken back"), its next slab request is refused, named, its own
   mapping still holds its own garbage and nothing of the job's; after the job, joining again it
   is lent the pool's carve-out anew (a new object).
2. A lone rank that keeps a dispatch pending (rw_rank as nobody, one rank of a group of two
   local ranks, its slabs mapped): its pair waits for the other local rank and never reaches the
   carve-out, so past group_carve_idle_s (2 s) a job takes it back all the same and verifies 40
   phases; the lone rank's dispatch then fails on the phase timeout as it would have.
3. An idle rank-path job (rw_pagerank, every rank of a group on both nodes, its page and slabs
   taken, its first submit held back: RW_PAGERANK_SUBMIT_GO): past group_carve_idle_s (2 s) a
   job takes its carve-out back on both nodes and verifies 40 phases; the idle job's first page
   phase then fails on every rank, named ("taken back").
4. A GPU carve-out (the daemons' test hook RAILWAVE_TEST_GPUDIRECT=1 on tcp, the stand-in
   driver: each carve-out a CUDA allocation exported as a POSIX fd): the squatter holds the
   exported fd of its group's and maps it; taken back for a job that verifies 40 phases, the
   daemon keeps no handle nor mapping of it although the squatter still does, and the squatter's
   mapping holds its own bytes only.
5. Per uid (a pool of two, group_carve_per_uid 1): the squatter's first group gets a carve-out,
   its second is refused (RW_E_LIMIT, naming the uid and the bound); a job of another uid gets the
   other carve-out and verifies 40 phases.
Each scenario ends with every client gone: the daemon's carve-out memfds, their mappings and
`stats carve_outs` are back to what they were before it, and every daemon stops cleanly on
SIGTERM (exit 0; under ASan: no leak, no report).
Run by tests/run as $b/test/svc_slabs_quota; exits 0 pass, 1 fail, 77 skip (needs root and
setpriv to run the attacker as another uid)."""
import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

check = cluster.Checks()
E_LIMIT = -51  # ipc/railwave.h
VERSION = cluster.define("ipc/railwave.h", "RW_PROTOCOL_VERSION")
SLAB = "railwave-group-slab"  # the carve-outs' memfd name (service/mesh/mesh_carve.c)

# The attacker, run as nobody: connections by name, driven by one command a line on stdin, one
# answer a line on stdout. ERROR messages of seq 0 are notices (ipc/proto.h): kept, and printed
# by `notice`.
SQUAT = r"""
import mmap, os, socket, struct, sys
path, version = sys.argv[1], int(sys.argv[2])
MAGIC, HELLO, HELLO_OK, ERROR, SLAB_SETUP, SLAB_OK = 0x50495752, 1, 2, 11, 16, 17
conns, maps, notices, seq = {}, {}, {}, [0]
def hdr(typ):
    seq[0] += 1
    return struct.pack("<IHHII", MAGIC, version, typ, seq[0], 0)
def recv(name):
    while True:
        msg, fds, _, _ = socket.recv_fds(conns[name], 512, 4)
        if not msg:
            return msg, fds, None
        typ, s = struct.unpack_from("<IHHII", msg)[2:4]
        if typ == ERROR and s == 0:
            notices.setdefault(name, []).append(msg)
            continue
        return msg, fds, typ
def error(msg):
    code = struct.unpack_from("<i", msg, 16)[0]
    return "error %d %s" % (code, msg[24:136].split(b"\0")[0].decode())
for line in sys.stdin:
    w = line.split()
    name = w[1] if len(w) > 1 else ""
    if w[0] == "hello":  # hello NAME GROUP RANK WORLD
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(20)
        s.connect(path)
        conns[name] = s
        s.send(hdr(HELLO) + struct.pack("<64sIIIi16sII64s", w[2].encode(), int(w[3]), int(w[4]),
                                        0, 0, b"\0" * 16, 0, 0, b""))
        msg, _, typ = recv(name)
        print("ok" if typ == HELLO_OK else "refused")
    elif w[0] in ("slab", "slabk"):  # slab[k] NAME RAIL: "ok INODE" (mapped, filled with 0xaa)
        form = 1 if w[0] == "slabk" else 0  # or the error; slabk: form 1 (GPU slabs too)
        conns[name].send(hdr(SLAB_SETUP) + struct.pack("<II", int(w[2]), form))
        msg, fds, typ = recv(name)
        if typ == SLAB_OK and len(fds) == 1:  # the stand-in's GPU allocation maps as a memfd
            size = struct.unpack_from("<Q", msg, 16)[0]
            maps[name] = mmap.mmap(fds[0], size)
            maps[name][:] = b"\xaa" * size
            print("ok %d" % os.fstat(fds[0]).st_ino)
            os.close(fds[0])
        else:
            for fd in fds:
                os.close(fd)
            print(error(msg) if typ == ERROR else "closed")
    elif w[0] == "notice":  # notice NAME: the first notice that came, waiting for one a while
        if not notices.get(name):
            conns[name].settimeout(10)
            try:
                msg, _, typ = recv(name)
                print("unexpected %s" % typ)
                sys.stdout.flush()
                continue
            except socket.timeout:
                pass
        print(("notice " + error(notices[name][0])[6:]) if notices.get(name) else "none")
    elif w[0] == "look":  # look NAME: does its mapping hold its own garbage and nothing else
        print("own" if maps[name][:] == b"\xaa" * len(maps[name]) else "changed")
    elif w[0] == "close":
        if name in maps:
            maps.pop(name).close()
        conns.pop(name).close()
        print("closed")
    sys.stdout.flush()
"""


class Squatter:
    """The attacker's process, as nobody."""

    def __init__(self, sock):
        nobody = pwd.getpwnam("nobody")
        self.uid = nobody.pw_uid
        self.p = subprocess.Popen(["setpriv", "--reuid=%d" % nobody.pw_uid,
                                   "--regid=%d" % nobody.pw_gid, "--clear-groups",
                                   sys.executable, "-c", SQUAT, sock, str(VERSION)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)

    def do(self, *words):
        self.p.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().strip()
        if not line:
            raise RuntimeError("the squatter's process ended: %s" % self.p.stdout.read())
        return line

    def end(self):
        self.p.stdin.close()
        self.p.wait(cluster.WAIT)


def nobody_cluster(tmp, nodes, extra):
    group = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    return cluster.Cluster(tmp, nodes, extra=dict({"ipc_group": group, "group_area_mib": 1,
                                                    "group_pool_mib": 1,
                                                    "heartbeat_timeout_ms": 5000}, **extra))


def slab_state(c, n):
    """(memfds of carve-outs open in daemon n, their mappings, `carve_outs H/M`)."""
    pid = c.procs[n].pid
    fds, maps = cluster.fds_named(pid, "/memfd:" + SLAB), cluster.maps_named(pid, SLAB)
    held = [l for l in c.stats(n).splitlines() if l.startswith("carve_outs ")]
    return fds, maps, held


wait_for = cluster.wait_for


def joined(c, n, group):
    return any("group=%s " % group in l for l in c.stats(n, "stats clients").splitlines())


def run_job(c, group, seed):
    env = dict(c.env, RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    outs = c.collect([(r, c.rank(r, group, 2, 20, seed, flags=["--slabs", str(c.rails)], env=env))
                      for r in range(c.nodes * c.gpus)])
    ok = all("20 steps x 2 layers verified" in outs[r] and cluster.remote_rows(outs[r]) > 0
             for r in outs)
    objs = {o for r in outs if r < c.gpus for o in cluster.slab_objects(outs[r]).values()}
    return ok, objs


def back_to(c, n, base, what):
    """Every client gone: daemon n holds and maps no carve-out more than at `base`."""
    ok = wait_for(lambda: slab_state(c, n) == base)
    check(ok, "%s: daemon %d's carve-out memfds, mappings and stats back to %s (now %s)"
          % (what, n, base, slab_state(c, n)))


def scenario_taken_back(tmp, seed):
    idle = 4
    c = nobody_cluster(tmp, 2, {"group_carve_idle_s": idle})
    sock0 = c.cfg["nodes"][0]["ipc_socket"]
    world = c.nodes * c.gpus
    sq = None
    try:
        c.start_all()
        base = slab_state(c, 0)
        sq = Squatter(sock0)
        check(sq.do("hello", "a", "squat.1", 0, world) == "ok", "the squatter (nobody) joins "
              "group squat.1 as its only rank")
        t0 = time.time()
        res = sq.do("slab", "a", 0).split()
        held = slab_state(c, 0)
        check(res[0] == "ok" and held[0] >= c.rails and held[1] >= c.rails,
              "it takes the pool's one carve-out (%s): daemon 0 holds and maps its memfds (%s)"
              % (res, held))
        early = Squatter(sock0)  # another process of nobody's: a job's rank asking now
        check(early.do("hello", "j", "job.early", 1, world) == "ok" and
              "carve_outs 1/1" in c.stats(0), "a job's rank joins; stats: carve_outs 1/1")
        res = early.do("slab", "j", 0)
        check(res.startswith("error %d " % E_LIMIT) and "group_pool_mib" in res and
              "group_carve_idle_s" in res, "asking at once, it is refused: %s" % res)
        early.do("close", "j")
        early.end()
        # Leave and join again under another name, still within the idle time: its clock runs on.
        time.sleep(idle / 2)
        sq.do("close", "a")
        check(sq.do("hello", "b", "squat.2", 0, world) == "ok", "the squatter leaves and joins "
              "again as group squat.2")
        res = sq.do("slab", "b", 0).split()
        check(res[0] == "ok", "squat.2 takes the pool again (%s)" % res)
        first = int(res[1]) if res[0] == "ok" else None
        time.sleep(max(0.0, t0 + idle + 0.5 - time.time()))
        ok, objs = run_job(c, "job.a", seed)
        check(ok, "the job's ranks are lent slabs and verify 40 phases, every remote row in them")
        check(first is not None and first not in objs,
              "its objects %s are none of the squatter's (%s)" % (sorted(objs), first))
        res = sq.do("notice", "b")
        check(res.startswith("notice %d " % E_LIMIT) and "taken back" in res,
              "the squatter is told: %s" % res)
        check(sq.do("look", "b") == "own", "the squatter's mapping holds its own garbage and "
              "nothing of the job's")
        res = sq.do("slab", "b", 1)
        check(res.startswith("error %d " % E_LIMIT) and "taken back" in res,
              "its next slab request is refused, named: %s" % res)
        st = c.stats(0)
        check("carve_outs_taken_back 1\n" in st, "stats counts the carve-out taken back: %s"
              % [l for l in st.splitlines() if l.startswith("carve_outs")])
        log = c.log(0)
        check("group squat.2 (uid %d): its carve-out taken back for group job.a" % sq.uid in log,
              "the daemon logs whose carve-out went to whom")
        sq.do("close", "b")
        check(wait_for(lambda: not joined(c, 0, "job.a") and not joined(c, 0, "squat.2")),
              "the job and the squatter left")
        check(sq.do("hello", "c", "squat.3", 0, world) == "ok", "the squatter joins again")
        res = sq.do("slab", "c", 0).split()
        check(res[0] == "ok" and int(res[1]) != first and int(res[1]) not in objs,
              "and, the pool free, is lent a carve-out anew, a new object: %s" % res)
        sq.do("close", "c")
        sq.end()
        sq = None
        back_to(c, 0, base, "taken back")
    finally:
        if sq:
            sq.p.kill()
        c.stop()


def scenario_lone_rank(tmp, seed):
    idle = 2
    c = nobody_cluster(tmp, 2, {"group_carve_idle_s": idle, "phase_timeout_ms": 20000})
    world = c.nodes * c.gpus
    nobody = pwd.getpwnam("nobody")
    lone = None
    try:
        c.start_all()
        base = slab_state(c, 0)
        env = dict(c.env, RW_CUDA_DRIVER=cluster.FAKE_CUDA)
        lone = subprocess.Popen(["setpriv", "--reuid=%d" % nobody.pw_uid,
                                 "--regid=%d" % nobody.pw_gid, "--clear-groups", cluster.RANK,
                                 c.cfg["nodes"][0]["ipc_socket"], "squat.lone", "0",
                                 str(c.nodes), str(c.gpus), str(c.experts), "1", "1", str(seed),
                                 "fail", "--slabs", str(c.rails)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t0 = time.time()
        check(wait_for(lambda: "carve_outs 1/1\n" in c.stats(0) or lone.poll() is not None),
              "the lone rank (nobody) takes the pool's one carve-out")
        time.sleep(max(0.0, t0 + idle + 0.5 - time.time()))
        ok, _ = run_job(c, "job.a", seed)
        check(ok, "a job takes it back and verifies 40 phases, every remote row in its slabs")
        check("group squat.lone (uid %d): its carve-out taken back for group job.a"
              % nobody.pw_uid in c.log(0), "the daemon logs the carve-out taken back")
        out = lone.communicate(timeout=cluster.WAIT)[0]
        check(lone.returncode == 0 and "failed as expected" in out,
              "the lone rank's dispatch, pending all along, failed on the phase timeout: %s"
              % out.strip().splitlines()[-1:])
        lone = None
        check(wait_for(lambda: not joined(c, 0, "squat.lone")), "the lone rank is gone")
        back_to(c, 0, base, "lone rank")
    finally:
        if lone:
            lone.kill()
            lone.wait()
        c.stop()


def scenario_idle_page(tmp, seed):
    idle = 2
    c = nobody_cluster(tmp, 2, {"group_carve_idle_s": idle})
    go = os.path.join(tmp, "go.idle")
    procs = []
    try:
        c.start_all()
        base = slab_state(c, 0)
        env = dict(c.env, RW_PAGERANK_SUBMIT_GO=go)
        procs = [(r, c.pagerank(r, "job.idle", 1, 1, seed, "one", env))
                 for r in range(c.nodes * c.gpus)]
        t0 = time.time()
        check(wait_for(lambda: all("carve_outs 1/1\n" in c.stats(n) for n in range(c.nodes))
                       or any(p.poll() is not None for _, p in procs)),
              "an idle rank-path job holds the pool of both nodes")
        time.sleep(max(0.0, t0 + idle + 0.5 - time.time()))
        ok, _ = run_job(c, "job.a", seed)
        check(ok, "a job takes it back on both nodes and verifies 40 phases in its slabs")
        check(all("group job.idle (uid 0): its carve-out taken back for group job.a" in c.log(n)
                  for n in range(c.nodes)), "both daemons log the carve-out taken back")
        open(go, "w").close()
        res = cluster.outputs(procs)
        procs = []
        bad = {r: v for r, v in res.items() if v[0] != 0 or "one: phase 1 failed" not in v[1]
               or "taken back" not in v[1]}
        check(not bad, "the idle job's first page phase fails on every rank, named: %s"
              % (bad or sorted({v[1].strip().splitlines()[-1][:110] for v in res.values()})))
        refused = [[l for l in c.stats(n).splitlines() if l.startswith("rank_path_refused")]
                   for n in range(c.nodes)]
        check(all("rank_path_refused %d" % c.gpus in r for r in refused),
              "each daemon refused its ranks' submits on their pages: %s" % refused)
        back_to(c, 0, base, "idle page job")
    finally:
        for _, p in procs:
            p.kill()
            p.wait()
        c.stop()


def vmm_held(pid):
    """(fds, mappings) of the CUDA stand-in's GPU allocations in process pid."""
    return cluster.fds_named(pid, "/memfd:rw-fake-vmm"), cluster.maps_named(pid, "rw-fake-vmm")


def scenario_gpu(tmp, seed):
    idle = 2
    tmp = os.path.join(tmp, "gpu")  # logs of its own
    os.makedirs(tmp, exist_ok=True)
    c = nobody_cluster(tmp, 2, {"group_carve_idle_s": idle})
    c.env.update(RAILWAVE_TEST_GPUDIRECT="1", RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    sq = None
    try:
        c.start_all()
        pid0 = c.procs[0].pid
        check("the groups' carve-outs in GPU 0's memory, lent by fd" in c.log(0) and
              vmm_held(pid0) == (0, 0), "the daemon places carve-outs on GPU 0, none made yet")
        sq = Squatter(c.cfg["nodes"][0]["ipc_socket"])
        sq.do("hello", "a", "squat.gpu", 0, c.nodes * c.gpus)
        t0 = time.time()
        res = sq.do("slabk", "a", 0).split()
        check(res[0] == "ok" and vmm_held(pid0)[0] > 0, "the squatter holds its group's GPU "
              "carve-out's exported fd and maps it; the daemon holds the allocation (%s)"
              % (vmm_held(pid0),))
        time.sleep(max(0.0, t0 + idle + 0.5 - time.time()))
        ok, _ = run_job(c, "job.a", seed)
        check(ok, "a job takes it back and verifies 40 phases in its GPU slabs")
        check("group squat.gpu (uid %d): its carve-out taken back for group job.a" % sq.uid
              in c.log(0), "the daemon logs the GPU carve-out taken back")
        check(wait_for(lambda: vmm_held(pid0) == (0, 0)), "the job gone, the daemon holds and "
              "maps no GPU allocation (%s) while the squatter still maps the one taken back"
              % (vmm_held(pid0),))
        check(sq.do("look", "a") == "own", "the squatter's mapping holds its own bytes only")
        sq.do("close", "a")
        sq.end()
        sq = None
    finally:
        if sq:
            sq.p.kill()
        c.stop()


def scenario_per_uid(tmp, seed):
    c = nobody_cluster(tmp, 2, {"group_pool_mib": 2, "group_carve_per_uid": 1})
    sock0 = c.cfg["nodes"][0]["ipc_socket"]
    world = c.nodes * c.gpus
    sq = Squatter(sock0)
    try:
        c.start_all()
        base = slab_state(c, 0)
        sq.do("hello", "a", "squat.1", 0, world)
        res = sq.do("slab", "a", 0).split()
        check(res[0] == "ok", "the squatter's (nobody's) first group takes a carve-out: %s" % res)
        mine = int(res[1]) if res[0] == "ok" else None
        sq.do("hello", "b", "squat.2", 0, world)
        res = sq.do("slab", "b", 0)
        want = "error %d no slabs of its own: uid %d's groups hold 1 carve-outs, the per-uid " \
               "bound (group_carve_per_uid)" % (E_LIMIT, sq.uid)
        check(res == want, "its second group is refused, named: %s" % res)
        st = c.stats(0)
        check("carve_outs 1/2\n" in st and "carve_outs_refused 1\n" in st,
              "stats: one of two held, one group refused")
        ok, objs = run_job(c, "job.a", seed)
        check(ok, "a job of another uid gets the other carve-out and verifies 40 phases, every "
              "remote row in its slabs")
        check(mine is not None and mine not in objs, "its objects %s are none of the squatter's "
              "(%s)" % (sorted(objs), mine))
        sq.do("close", "a")
        sq.do("close", "b")
        sq.end()
        back_to(c, 0, base, "per uid")
    finally:
        if sq.p.poll() is None:
            sq.p.kill()
        c.stop()


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.PAGERANK) or not os.path.exists(
            cluster.FAKE_CUDA):
        print("skip: railwaved, rw_rank, rw_pagerank or the CUDA stand-in not built")
        return 77
    if os.getuid() != 0 or not shutil.which("setpriv"):
        print("skip: needs root and setpriv to run the squatter as nobody")
        return 77
    seed = cluster.test_seed()
    with tempfile.TemporaryDirectory(prefix="rwquota.", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)  # the socket's group and mode keep other uids out, not the folder
        check.scenarios([("taken back", scenario_taken_back),
                         ("lone rank", scenario_lone_rank),
                         ("idle page job", scenario_idle_page),
                         ("gpu carve-out", scenario_gpu),
                         ("per uid", scenario_per_uid)], tmp, seed)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
