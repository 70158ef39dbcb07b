#!/usr/bin/env python3
"""Group slabs: per-group carve-outs lent to the ranks (docs/rankpath.md "The slab areas, lent per
group"; docs/ipc.md SLAB_SETUP / SLAB_OK) with real railwaved daemons on loopback, real rank
processes (tests/integration/rw_rank.c --slabs, which verify every row they receive) and real
sockets; the daemons run with group_area_mib 1 and group_pool_mib 2 (a pool of two carve-outs)
and heartbeat_timeout_ms 5000:

1. Lent (tcp and shm rails): a job's ranks each map their group's slab of every rail and
   register it with CUDA (the stand-in driver); every row a rank received from the other node
   lies byte for byte in the dispatch receive area of one of those slabs (the daemon's memory of
   the rail is the slab: its pairs run on the carve-out), and every phase verifies. The ranks of
   one node hold one object per rail; the other node's daemon lent others.
2. As an attacker, while that job carries phases: a rank of another group gets a different
   object and fills it with garbage (the job's phases still verify); it cannot name the first
   group's slab (the request names a rail and nothing else; a reserved field set is refused with
   RW_E_FIELD); asking for a rail's slab twice is RW_E_STATE and the connection stays good; a
   rail the daemon does not have is RW_E_INVAL; a slab request before the hello is RW_E_STATE
   and the connection is closed.
3. The pool spent: a third group gets no carve-out of its own; its rank's slab request is
   RW_E_LIMIT with a message naming the pool, and a full workload of that group still verifies
   on the shared area while the two carve-outs are held.
4. After leave: the attacker's group ends; a new group is lent a fresh object from the freed
   place of the pool. What one writes, the other never sees, although the old rank still maps
   its slab.
5. A peer that comes later: node 0's ranks join (their group's carve-out made) while node 1 is
   not running, the first time and after a SIGKILL of node 1 (rw_rank --go holds their first
   dispatch); node 1 hears of the carve-out right behind REGIONS and every phase runs in it
   (without that CARVE its writes find no region and the phases fail).
6. A hostile rank scribbles over its group's send areas while its node posts them: the peer
   finds the records bad and, since they came from the group's slabs, fails that group's phase
   on every rank, named, and drops no node; another job verifies on both daemons meanwhile.
7. The rank path (librailwave's rank/slabs.c through ctypes, on the kernel stand-in driver): a
   rank path opened on a daemon that lends slabs maps and registers its group's slab of every
   rail; another rank of the group, lent the same rail's slab, holds the same object and sees
   what is written through the rank path's mapping; another group's rank path holds other
   objects; one of a group formed with the pool spent opens without slabs (RW_E_LIMIT).
8. GPU slabs (the test hook RAILWAVE_TEST_GPUDIRECT=1 on tcp, the stand-in drivers): each
   group's carve-out is a CUDA allocation exported as a POSIX fd; the ranks import it
   (rw_client_group_slab_kind, rank/slabs.c) and find every remote row in it; a client of the
   first form is refused it, named; the rank path imports it (the same memory as another rank
   of the group is lent, another group's apart, nothing mapped after leave, a refused import
   named); with two GPUs per node a rank maps another GPU's slab only where the two reach each
   other; a daemon whose export fails refuses the group its slabs, named, and serves another job;
   once every group left the daemons hold and map no allocation.
9. GPU slabs the daemon's CPU cannot read (the stand-in's discrete GPU, RW_FAKE_CUDA_VMM_NOCPU=1
   in the daemons only: their mappings of the carve-outs are PROT_NONE, readable only through
   the driver's copies; the test hook's tcp rail reads its own mapping of the export, as a NIC's
   dmabuf would): every check reads the headers pulled into the carve-out's host shadow. A rank
   of a CPU-played job lies in its first pack: that phase fails on every rank, named, no node is
   dropped, the next phases are exact; likewise a rank whose gather writes a wrong return header
   (the combine's pull); librailwave's rank path (the kernel stand-in) runs 6
   dispatches and their combines exact; a host job of another group runs on the shared area
   meanwhile (its pairs cannot use a carve-out the CPU cannot reach); the daemons made no kernel
   launch and called no host function, and their pulls' marks are stream writes. Then one
   daemon's copies fail (RW_FAKE_CUDA_VMM_FAIL=copy): the group's phase fails, naming the pull,
   while a host job on the same daemons verifies.
Every daemon then stops cleanly on SIGTERM (exit 0; under ASan: no leak, no report).
Run by tests/run as $b/test/svc_slabs; exits 0 pass, 1 fail, 77 skip."""
import ctypes
import mmap
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

check = cluster.Checks()
E_INVAL, E_STATE, E_FIELD, E_LIMIT = -1, -26, -27, -51  # ipc/railwave.h
# heartbeat_timeout_ms 5000 (cluster.py's default is 1000): no scenario waits for a peer to be
# timed out (a killed daemon's connections close at once), and on a loaded test machine one
# daemon's process was seen not to run for 1.2 s, which its peer rightly took for a dead node.
AREA = {"group_area_mib": 1, "group_pool_mib": 2, "heartbeat_timeout_ms": 5000}


MAGIC, VERSION = 0x50495752, cluster.define("ipc/railwave.h", "RW_PROTOCOL_VERSION")
HELLO, HELLO_OK, ERROR, SLAB_SETUP, SLAB_OK = 1, 2, 11, 16, 17  # ipc/proto.h


class Raw:
    """A rank speaking ipc/proto.h by hand on the daemon's socket."""

    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.s.settimeout(10)
        self.s.connect(path)
        self.seq = 0

    def hdr(self, typ):
        self.seq += 1
        return struct.pack("<IHHII", MAGIC, VERSION, typ, self.seq, 0)

    def hello(self, group, rank, world, node, gpu):
        self.s.send(self.hdr(HELLO) + struct.pack("<64sIIIi16sII64s", group.encode(), rank, world,
                                                   node, gpu, b"\0" * 16, 0, 0, b""))
        reply = self.s.recv(512)
        typ = struct.unpack_from("<IHHII", reply)[2]
        if typ != HELLO_OK:
            raise RuntimeError("hello refused: %r" % reply)

    def slab(self, rail, reserved=0):
        """("ok", fd, fields) or ("error", code, message) or ("closed",); reserved is the
        request's form field (was reserved)."""
        self.s.send(self.hdr(SLAB_SETUP) + struct.pack("<II", rail, reserved))
        msg, fds, _, _ = socket.recv_fds(self.s, 512, 4)
        if not msg:
            return ("closed",)
        typ = struct.unpack_from("<IHHII", msg)[2]
        if typ == ERROR:
            code, _fatal = struct.unpack_from("<iI", msg, 16)
            for fd in fds:
                os.close(fd)
            return ("error", code, msg[24:136].split(b"\0")[0].decode())
        if typ != SLAB_OK or len(msg) != (104 if reserved == 1 else 80) or len(fds) != 1:
            raise RuntimeError("bad slab reply: type %d, %d bytes, %d fds" % (typ, len(msg), len(fds)))
        nbytes, r, rails, area, rd, rc, sd, sc, loc = struct.unpack_from("<QIIQQQQQQ", msg, 16)
        fields = dict(bytes=nbytes, rail=r, rails=rails, area=area, recv=(rd, rc), send=(sd, sc),
                      local=loc)
        if reserved == 1:  # form 1 (kinds)
            kind, device = struct.unpack_from("<Ii", msg, 80)
            fields.update(kind=kind, device=device, uuid=msg[88:104])
        return ("ok", fds[0], fields)

    def slab_kind(self, rail):
        """Form 1 (kinds): the reply adds kind, device and uuid to the fields."""
        return self.slab(rail, 1)

    def closed(self):
        """True once the daemon has closed the connection."""
        try:
            return self.s.recv(512) == b""
        except (ConnectionResetError, socket.timeout):
            return False

    def close(self):
        self.s.close()


def joined(c, n, group):
    return [l for l in c.stats(n, "stats clients").splitlines() if "group=%s " % group in l]


def wait_joined(c, n, group, count, procs=()):
    deadline = time.time() + cluster.WAIT
    while len(joined(c, n, group)) < count:
        if time.time() > deadline or any(p.poll() is not None for _, p in procs):
            raise RuntimeError("group %s did not join node %d\n%s" % (group, n, c.logs()))
        time.sleep(0.01)


def wait_left(c, n, group):
    deadline = time.time() + cluster.WAIT
    while joined(c, n, group):
        if time.time() > deadline:
            raise RuntimeError("group %s did not leave node %d" % (group, n))
        time.sleep(0.01)


def daemon_log(tmp, n):
    with open(os.path.join(tmp, "d%d.log" % n)) as f:
        return f.read()


slab_objects, remote_rows = cluster.slab_objects, cluster.remote_rows


def scenario_lent(tmp, seed, transport):
    c = cluster.Cluster(tmp, 2, extra=dict(AREA, transport=transport))
    env = dict(c.env, RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    try:
        c.start_all()
        outs = c.collect([(r, c.rank(r, "job.a", 2, 4, seed, flags=["--slabs", str(c.rails)], env=env))
                          for r in range(c.nodes * c.gpus)])
    finally:
        c.stop()
    objs = {r: slab_objects(outs[r]) for r in outs}
    for r in outs:
        check("4 steps x 2 layers verified" in outs[r] and remote_rows(outs[r]) > 0,
              "%s: rank %d verified every phase; %d rows from the other node found in its group's "
              "slabs" % (transport, r, remote_rows(outs[r])))
        check(sorted(objs[r]) == list(range(c.rails)), "%s: rank %d mapped and registered a slab "
              "per rail: %s" % (transport, r, objs[r]))
    g = c.gpus
    check(all(objs[r] == objs[r - r % g] for r in outs),
          "%s: the ranks of one node share their group's slab objects" % transport)


def wait_serving(c, n):
    deadline = time.time() + cluster.WAIT
    while True:
        try:
            c.stats(n)
            return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError("node %d does not serve\n%s" % (n, c.logs()))
            time.sleep(0.05)


def scenario_late_peer(tmp, seed):
    """Carve-outs taken before a peer is there: node 0's ranks join (their group's carve-out
    made) while node 1 is not running, the first time and after node 1 was killed; node 1 then
    comes up, hears of the carve-out right behind REGIONS, and every phase runs in it."""
    c = cluster.Cluster(tmp, 2, extra=AREA)
    env = dict(c.env, RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    try:
        for i, group in enumerate(["job.first", "job.again"]):
            if i == 0:
                c.start(0)
                wait_serving(c, 0)
            else:
                c.kill(1)
            go = os.path.join(tmp, "go." + group)
            flags = ["--slabs", str(c.rails), "--go", go]
            early = [(r, c.rank(r, group, 2, 3, seed + i, flags=flags, env=env))
                     for r in range(c.gpus)]
            wait_joined(c, 0, group, c.gpus, early)
            c.start(1)
            c.wait_mesh()
            open(go, "w").close()
            late = [(r, c.rank(r, group, 2, 3, seed + i, flags=flags, env=env))
                    for r in range(c.gpus, c.nodes * c.gpus)]
            outs = c.collect(early + late)
            check(all("3 steps x 2 layers verified" in outs[r] and remote_rows(outs[r]) > 0
                      for r in outs),
                  "%s: node 0's ranks joined (their carve-out made) before node 1 %s; every "
                  "phase verified and every remote row in the slabs"
                  % (group, "started" if i == 0 else "was back from a SIGKILL"))
    finally:
        c.stop()


def scenario_hostile_rank(tmp, seed):
    """A rank that scribbles over its group's send areas while its node posts them (writes slowed
    by the test hooks, so the areas are read long after they were packed): the peer finds the
    records bad, and since they came from the group's slabs, that group's phase fails on every
    rank, named, and no node is dropped — another job on both daemons verifies all along."""
    c = cluster.Cluster(tmp, 2, extra=AREA)
    c.env.update(RAILWAVE_TEST_CHUNK_KIB="4", RAILWAVE_TEST_WRITE_GAP_MS="2")
    env = dict(c.env, RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    world = c.nodes * c.gpus
    big = ["--hidden", "256", "--tokens", "64"]
    try:
        c.start_all()
        other = [(r, c.rank(r, "job.z", 2, 20, seed)) for r in range(world)]
        hostile = [(r, c.rank(r, "job.h", 1, 1, seed + 1, mode="fail", env=env,
                              flags=big + (["--slabs", str(c.rails), "--scribble"] if r == 0
                                           else []))) for r in range(world)]
        outs = c.collect(hostile)
        check(all("failed as expected: phase failed" in outs[r] for r in outs),
              "the scribbling rank's group: every rank's dispatch failed (%s)"
              % sorted({outs[r].strip().splitlines()[-1][:90] for r in outs}))
        outs = c.collect(other)
        check(all("20 steps x 2 layers verified" in outs[r] for r in outs),
              "the other job verified 40 phases on both daemons meanwhile")
        for n in range(c.nodes):
            st = c.stats(n, "stats peers")
            check("state=up" in st and "reconnects=0" in st,
                  "node %d dropped no peer: %s" % (n, " ".join(st.split())))
    finally:
        c.stop()
    check("through the group's slabs, which its ranks may write: node 0 is not dropped" in
          daemon_log(tmp, 1), "node 1 names the bad records and why it keeps node 0")


def scenario_attacks(tmp, seed):
    c = cluster.Cluster(tmp, 2, extra=AREA)
    env = dict(c.env, RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    sock0 = c.cfg["nodes"][0]["ipc_socket"]
    world = c.nodes * c.gpus
    try:
        c.start_all()
        procs = [(r, c.rank(r, "job.a", 2, 300, seed, flags=["--slabs", str(c.rails)], env=env))
                 for r in range(world)]
        wait_joined(c, 0, "job.a", c.gpus, procs)

        # 2. Another group's rank: its own object, which it fills with garbage.
        x = Raw(sock0)
        x.hello("job.b", 0, world, 0, 0)
        res = x.slab(0)
        area = (1 << 20) // 5 & ~63
        check(res[0] == "ok" and res[2]["bytes"] == 1 << 20 and res[2]["rails"] == c.rails and
              res[2]["area"] == area and sorted(res[2]["recv"] + res[2]["send"] +
                                                (res[2]["local"],)) == [i * area for i in range(5)],
              "another group's rank is lent its own slab of rail 0 (1 MiB, five areas of %d "
              "bytes): %s" % (area, res[:1] + res[2:]))
        b_fd = res[1] if res[0] == "ok" else None
        b_obj = os.fstat(b_fd).st_ino if b_fd is not None else None
        b_map = mmap.mmap(b_fd, 1 << 20) if b_fd is not None else None
        if b_map:
            b_map[:] = b"\xaa" * (1 << 20)
        res = x.slab(0)
        check(res[0] == "error" and res[1] == E_STATE and "already lent" in res[2],
              "the same rail's slab twice: RW_E_STATE (%s)" % (res,))
        res = x.slab(1, reserved=7)
        check(res[0] == "error" and res[1] == E_FIELD,
              "a request with its reserved field set: RW_E_FIELD (%s)" % (res,))
        res = x.slab(c.rails)
        check(res[0] == "error" and res[1] == E_INVAL and "no such rail" in res[2],
              "a rail the daemon does not have: RW_E_INVAL (%s)" % (res,))
        res = x.slab(1)
        check(res[0] == "ok", "the connection is still good after the refusals: rail 1 lent")
        b_obj1 = os.fstat(res[1]).st_ino if res[0] == "ok" else None
        if res[0] == "ok":
            os.close(res[1])

        # Before the hello: refused, and the connection closed.
        y = Raw(sock0)
        res = y.slab(0)
        check(res[0] == "error" and res[1] == E_STATE and "hello" in res[2] and y.closed(),
              "a slab request before the hello: RW_E_STATE and the connection closed (%s)" % (res,))
        y.close()

        # 3. The pool (two carve-outs) is held by job.a and job.b: job.c gets none.
        z = Raw(sock0)
        z.hello("job.c", 1, world, 0, 1)
        res = z.slab(0)
        check(res[0] == "error" and res[1] == E_LIMIT and "group_pool_mib" in res[2],
              "the pool spent: a third group's slab request is RW_E_LIMIT naming the pool (%s)"
              % (res,))
        st = c.stats(0)
        check("carve_outs 2/2\n" in st and "carve_outs_refused 1\n" in st,
              "stats: both carve-outs held, one group refused (%s)"
              % [l for l in st.splitlines() if l.startswith("carve_outs")])
        z.close()
        wait_left(c, 0, "job.c")
        outs_c = c.collect([(r, c.rank(r, "job.c", 1, 2, seed + 1)) for r in range(world)])
        check(all("2 steps x 1 layers verified" in outs_c[r] for r in outs_c),
              "the group without a carve-out runs on the shared area, verified, beside the two "
              "on carve-outs")

        # job.a all along: every phase verified, its objects none of job.b's.
        outs = c.collect(procs)
        a_objs = [o for r in outs for o in slab_objects(outs[r]).values()]
        check(all("300 steps x 2 layers verified" in outs[r] and remote_rows(outs[r]) > 0
                  for r in outs),
              "job.a verified 600 phases through its slabs while job.b wrote garbage into its own")
        check(b_obj is not None and b_obj not in a_objs and b_obj1 not in a_objs,
              "job.b's objects (%s, %s) are none of job.a's (%s)" % (b_obj, b_obj1, a_objs))

        # 4. After leave: job.b ends (its rank still maps its slab); job.d gets a fresh object.
        x.close()
        wait_left(c, 0, "job.b")
        wait_left(c, 0, "job.a")
        # a group whose rank asks for no slab (any local process, keyless) takes none of the
        # pool: before, a carve-out was taken at the group's first join
        squat = Raw(sock0)
        squat.hello("squat", 0, world, 0, 0)
        d = Raw(sock0)
        d.hello("job.d", 0, world, 0, 0)
        res = d.slab(0)
        st = c.stats(0)
        check(res[0] == "ok" and "carve_outs 1/2\n" in st,
              "a new group is lent a slab from the pool's freed places, a group that asked for "
              "none holding nothing; stats: %s"
              % [l for l in st.splitlines() if l.startswith("carve_outs ")])
        if res[0] == "ok" and b_map:
            d_obj = os.fstat(res[1]).st_ino
            d_map = mmap.mmap(res[1], 1 << 20)
            check(d_obj != b_obj and d_map[:4096] != b"\xaa" * 4096,
                  "it is a fresh object (%d, the old %d), none of the old garbage in it"
                  % (d_obj, b_obj))
            d_map[:4096] = b"\x5a" * 4096
            b_map[4096:8192] = b"\x11" * 4096
            check(b_map[:4096] == b"\xaa" * 4096 and d_map[4096:8192] != b"\x11" * 4096,
                  "what the new group writes the old rank never sees, and the other way round")
            d_map.close()
            os.close(res[1])
        d.close()
        squat.close()
        if b_map:
            b_map.close()
        if b_fd is not None:
            os.close(b_fd)
    finally:
        c.stop()
    check("group job.c: no carve-out of its own (the pool is spent" in daemon_log(tmp, 0),
          "the daemon logs the group that found the pool spent")


class Slab(ctypes.Structure):
    """ipc/railwave.h rw_client_slab_t."""
    _fields_ = [("base", ctypes.c_void_p), ("bytes", ctypes.c_size_t), ("rail", ctypes.c_uint32),
                ("rails", ctypes.c_uint32), ("area_bytes", ctypes.c_uint64),
                ("recv_off", ctypes.c_uint64 * 2), ("send_off", ctypes.c_uint64 * 2),
                ("local_off", ctypes.c_uint64), ("object", ctypes.c_uint64)]


def rank_lib(driver=cluster.FAKE_KERN):
    """librailwave through ctypes, this process a rank on `driver` (the kernel stand-in)."""
    os.environ["RW_CUDA_DRIVER"] = driver  # the driver this process (the rank) loads
    lib = ctypes.CDLL(cluster.LIBRAILWAVE)
    lib.rw_client_connect.argtypes = [ctypes.POINTER(cluster.ClientOpts),
                                      ctypes.POINTER(ctypes.c_void_p)]
    lib.rw_client_close.argtypes = [ctypes.c_void_p]
    lib.rw_client_rank_open.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32,
                                        ctypes.POINTER(ctypes.c_void_p)]
    lib.rw_client_rank_close.argtypes = [ctypes.c_void_p]
    lib.rw_client_rank_message.argtypes = [ctypes.c_void_p]
    lib.rw_client_rank_message.restype = ctypes.c_char_p
    lib.rw_client_group_slab.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(Slab)]
    lib.rw_client_rank_slab.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(Slab),
                                        ctypes.POINTER(ctypes.c_uint64)]
    return lib


def rank_slabs(lib, rp, rails):
    """[(rc, Slab, device address)] of each rail, as rw_client_rank_slab gives them."""
    out = []
    for r in range(rails):
        sl, dptr = Slab(), ctypes.c_uint64()
        rc = lib.rw_client_rank_slab(rp, r, ctypes.byref(sl), ctypes.byref(dptr))
        out.append((rc, sl, dptr.value))
    return out


def seen_by_other(fd, size, sl, addr, byte, what):
    """4 KiB of `byte` written at the rank path's mapping `addr` of slab `sl`, read back through
    another rank's lent fd: one object (the inode) and one memory. Closes fd."""
    view = mmap.mmap(fd, size)
    ctypes.memset(addr + sl.local_off, byte, 4096)
    check(os.fstat(fd).st_ino == sl.object and
          view[sl.local_off:sl.local_off + 4096] == bytes([byte]) * 4096, what)
    view.close()
    os.close(fd)


def scenario_rank_path(tmp, seed):
    with open(cluster.FAKE_KERN, "rb") as f:
        if b"libasan" in f.read():  # this (unsanitized) interpreter cannot load it
            print("skip rank path: the kernel stand-in is built with ASan here (the release "
                  "build runs it)")
            return
    c = cluster.Cluster(tmp, 2, extra=AREA)
    world = c.nodes * c.gpus
    sock0 = c.cfg["nodes"][0]["ipc_socket"].encode()
    lib = rank_lib()
    held = []

    def rank_path(group, rank):
        o = cluster.ClientOpts(sock0, group.encode(), rank, world, 0, rank % c.gpus)
        cl, rp = ctypes.c_void_p(), ctypes.c_void_p()
        if lib.rw_client_connect(ctypes.byref(o), ctypes.byref(cl)) != 0:
            raise RuntimeError("rank %d of %s cannot connect" % (rank, group))
        rc = lib.rw_client_rank_open(cl, 0, 64, ctypes.byref(rp))
        held.append((cl, rp if rc == 0 else None))
        if rc != 0:
            raise RuntimeError("%s: rank path open: %d %s" % (group, rc,
                                                              lib.rw_client_rank_message(None)))
        return rp

    def slabs(rp):
        return rank_slabs(lib, rp, c.rails)

    try:
        c.start_all()
        a = slabs(rank_path("g.rp", 0))
        check(all(rc == 0 and sl.bytes == 1 << 20 and sl.rail == r and dptr for r, (rc, sl, dptr)
                  in enumerate(a)),
              "the rank path maps and registers its group's slab of every rail: %s"
              % [(rc, sl.bytes, hex(dptr)) for rc, sl, dptr in a])
        x = Raw(sock0.decode())
        x.hello("g.rp", 1, world, 0, 1)
        res = x.slab(0)
        if res[0] == "ok" and a[0][0] == 0:
            sl = a[0][1]
            seen_by_other(res[1], 1 << 20, sl, sl.base, 0x3c,
                          "another rank of the group holds the same object (inode %d) and sees "
                          "what the rank path wrote" % sl.object)
        else:
            check(False, "another rank of the group is lent its slab: %s" % (res,))
        b = slabs(rank_path("g.other", 0))
        check(all(rc == 0 for rc, _, _ in b) and
              not {sl.object for _, sl, _ in b} & {sl.object for _, sl, _ in a},
              "another group's rank path holds other objects")
        # Asked again on the same connection (the daemon lends once): the mapping the library holds.
        again = Slab()
        rc = lib.rw_client_group_slab(held[-1][0], 0, ctypes.byref(again))
        check(rc == 0 and again.base == b[0][1].base and again.object == b[0][1].object,
              "asked again, librailwave gives the mapping it holds (rc %d)" % rc)
        sp = slabs(rank_path("g.spent", 0))
        check(all(rc == E_LIMIT for rc, _, _ in sp),
              "the pool spent: a rank path opens without slabs and says RW_E_LIMIT (%s)"
              % [rc for rc, _, _ in sp])
        x.close()
    finally:
        for cl, rp in held:
            if rp:
                lib.rw_client_rank_close(rp)
            lib.rw_client_close(cl)
        c.stop()


def vmm_fds(pid):
    """How many of process pid's fds are GPU allocations of the stand-in (tests/cuda/fake_cuda_vmm.c)."""
    return cluster.fds_named(pid, "/memfd:rw-fake-vmm")


def vmm_maps(pid):
    return cluster.maps_named(pid, "rw-fake-vmm")


def gpu_rank_path(c):
    """librailwave's rank path (rank/slabs.c) on GPU slabs, through ctypes on the kernel stand-in
    (this process is the rank; release build only): imported and mapped, the same memory as
    another rank of the group is lent, another group's apart, unmapped when the rank leaves, and
    an import the driver refuses fails the open, naming the call."""
    with open(cluster.FAKE_KERN, "rb") as f:
        if b"libasan" in f.read():
            print("skip gpu rank path: the kernel stand-in is built with ASan here")
            return
    world = c.nodes * c.gpus
    sock0 = c.cfg["nodes"][0]["ipc_socket"]
    lib = rank_lib()
    held = []

    def rank_path(group, rank):
        o = cluster.ClientOpts(sock0.encode(), group.encode(), rank, world, 0, rank % c.gpus)
        cl, rp = ctypes.c_void_p(), ctypes.c_void_p()
        if lib.rw_client_connect(ctypes.byref(o), ctypes.byref(cl)) != 0:
            raise RuntimeError("rank %d of %s cannot connect" % (rank, group))
        rc = lib.rw_client_rank_open(cl, 0, 64, ctypes.byref(rp))
        held.append((cl, rp if rc == 0 else None))
        return rc, rp

    def slabs(rp):
        return rank_slabs(lib, rp, c.rails)

    try:
        rc, rp = rank_path("g.gpu", 0)
        a = slabs(rp) if rc == 0 else []
        check(rc == 0 and len(a) == c.rails and all(
                  r == 0 and not sl.base and sl.bytes == 2 << 20 and dptr for r, sl, dptr in a),
              "the rank path imports and maps its group's GPU slab of every rail (rc %d: %s)"
              % (rc, [(r, sl.base, sl.bytes, hex(dptr)) for r, sl, dptr in a]))
        check(vmm_maps(os.getpid()) == c.rails, "the rank maps one allocation per rail (%d)"
              % vmm_maps(os.getpid()))
        x = Raw(sock0)
        x.hello("g.gpu", 1, world, 0, 1)
        res = x.slab_kind(0)
        if a and res[0] == "ok":
            sl, dptr = a[0][1], a[0][2]  # dptr: the stand-in's device address, host-writable
            seen_by_other(res[1], res[2]["bytes"], sl, dptr, 0x6d,
                          "another rank of the group is lent the same allocation (inode %d) and "
                          "sees what the rank path wrote through its mapping" % sl.object)
        else:
            check(False, "another rank of the group is lent its GPU slab: %s" % (res,))
        x.close()
        rc, rp2 = rank_path("g.gpu2", 0)
        b = slabs(rp2) if rc == 0 else []
        check(rc == 0 and b and not {sl.object for _, sl, _ in b} & {sl.object for _, sl, _ in a},
              "another group's rank path holds other allocations")
        for cl, p in held:
            lib.rw_client_rank_close(p)
            lib.rw_client_close(cl)
        held.clear()
        check(vmm_maps(os.getpid()) == 0 and vmm_fds(os.getpid()) == 0,
              "ranks that left map and hold no allocation (maps %d, fds %d)"
              % (vmm_maps(os.getpid()), vmm_fds(os.getpid())))
        os.environ["RW_FAKE_CUDA_VMM_FAIL"] = "import"
        rc, _ = rank_path("g.gpu3", 0)
        msg = lib.rw_client_rank_message(None) or b""
        check(rc != 0 and b"cuMemImportFromShareableHandle" in msg,
              "an import the driver refuses fails the rank path's open, named (%d: %s)"
              % (rc, msg.decode()))
    finally:
        os.environ.pop("RW_FAKE_CUDA_VMM_FAIL", None)
        for cl, p in held:
            if p:
                lib.rw_client_rank_close(p)
            lib.rw_client_close(cl)


def open_rank_path(sock, group, rank, world, device):
    """In a process of its own (python3 test_slabs.py --open ...: its driver and devices are the
    environment's): the rank path opened on `device`; prints "open RC MESSAGE"."""
    lib = rank_lib(os.environ["RW_CUDA_DRIVER"])
    o = cluster.ClientOpts(sock.encode(), group.encode(), rank, world, 0, device)
    cl, rp = ctypes.c_void_p(), ctypes.c_void_p()
    if lib.rw_client_connect(ctypes.byref(o), ctypes.byref(cl)) != 0:
        print("open connect-failed")
        return 1
    rc = lib.rw_client_rank_open(cl, device, 64, ctypes.byref(rp))
    print("open %d %s" % (rc, (lib.rw_client_rank_message(None) or b"").decode() if rc else ""))
    if rc == 0:
        lib.rw_client_rank_close(rp)
    lib.rw_client_close(cl)
    return 0


def two_gpus(tmp, seed):
    """Two GPUs per node (the stand-ins' RW_FAKE_CUDA_DEVICES=2): rail r's carve-outs on GPU r;
    a rank on GPU 0 maps rail 1's only where GPU 0 reaches GPU 1: the multi-GPU stand-in
    (cuDeviceCanAccessPeer yes) opens, with RW_FAKE_CUDA_NO_P2P=1 and on a driver without the
    peer query the open is refused, naming the two devices."""
    sub = os.path.join(tmp, "two")
    os.makedirs(sub, exist_ok=True)
    c = cluster.Cluster(sub, 2, extra=dict(AREA, transport="tcp"))
    c.env.update(RAILWAVE_TEST_GPUDIRECT="1", RW_CUDA_DRIVER=cluster.FAKE_CUDA,
                 RW_FAKE_CUDA_DEVICES="2")
    mgpu = os.path.join(os.path.dirname(cluster.FAKE_KERN), "libfakecuda_mgpu.so")
    try:
        c.start_all()
        log = daemon_log(sub, 0)
        check("rail=0: the groups' carve-outs in GPU 0's memory" in log and
              "rail=1: the groups' carve-outs in GPU 1's memory" in log,
              "two GPUs: rail r's carve-outs on GPU r")
        sock = c.cfg["nodes"][0]["ipc_socket"]
        world = c.nodes * c.gpus

        def opened(group, **env):
            e = dict(os.environ, RW_FAKE_CUDA_DEVICES="2", **env)
            e.pop("RW_FAKE_CUDA_VMM_FAIL", None)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--open", sock,
                                  group, "0", str(world), "0"], env=e, capture_output=True,
                                 text=True, timeout=cluster.WAIT).stdout
            return [l for l in out.splitlines() if l.startswith("open ")] or [out]

        res = opened("g.p2p", RW_CUDA_DRIVER=mgpu)
        check(res == ["open 0 "], "a rank on GPU 0 imports rail 1's slab on GPU 1 where the two "
              "reach each other (the multi-GPU stand-in): %s" % res)
        res = opened("g.nop2p", RW_CUDA_DRIVER=mgpu, RW_FAKE_CUDA_NO_P2P="1")
        check(len(res) == 1 and res[0].startswith("open -50 ") and
              "device 0 cannot reach device 1's memory" in res[0],
              "without peer access between them the open is refused, naming both: %s" % res)
        res = opened("g.noquery", RW_CUDA_DRIVER=cluster.FAKE_KERN)
        check(len(res) == 1 and res[0].startswith("open -50 ") and "cannot reach" in res[0],
              "a driver that cannot say (no cuDeviceCanAccessPeer): refused too: %s" % res)
    finally:
        c.stop()


def scenario_gpu(tmp, seed):
    """GPU slabs (the test hook RAILWAVE_TEST_GPUDIRECT=1 on tcp, the cross-process stand-in
    driver in the daemons and the ranks): each group's carve-out is a CUDA allocation exported as
    a POSIX fd, lent by SLAB_OK form 1 and imported by the ranks."""
    c = cluster.Cluster(tmp, 2, extra=dict(AREA, transport="tcp"))
    c.env.update(RAILWAVE_TEST_GPUDIRECT="1", RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    env = dict(c.env)
    pids = []
    try:
        c.start_all()
        pids = [c.procs[n].pid for n in range(c.nodes)]
        check(all("the groups' carve-outs in GPU 0's memory, lent by fd" in daemon_log(tmp, n)
                  for n in range(c.nodes)), "both daemons place the groups' carve-outs on GPU 0")
        check(all(vmm_fds(p) == 0 for p in pids), "no GPU allocation before a group joins")
        outs = c.collect([(r, c.rank(r, "job.a", 2, 4, seed, flags=["--slabs", str(c.rails)],
                                     env=env)) for r in range(c.nodes * c.gpus)])
        for r in outs:
            gpu = [l for l in outs[r].splitlines() if l.startswith("slab ") and " gpu device " in l]
            check("4 steps x 2 layers verified" in outs[r] and remote_rows(outs[r]) > 0 and
                  len(gpu) == c.rails,
                  "rank %d imported its group's GPU slab of each rail (%d), verified every phase, "
                  "and found %d rows from the other node in them (read back from the GPU)"
                  % (r, len(gpu), remote_rows(outs[r])))
        x = Raw(c.cfg["nodes"][0]["ipc_socket"])
        x.hello("g.raw", 0, c.nodes * c.gpus, 0, 0)
        old = x.slab(0)
        check(old[0] == "error" and old[1] == E_STATE and "GPU memory" in old[2],
              "a client of the first form is refused a GPU slab, named: %s" % (old,))
        res = x.slab_kind(0)
        if res[0] == "ok":
            name = os.readlink("/proc/self/fd/%d" % res[1])
            check(res[2]["kind"] == 2 and res[2]["device"] == 0 and
                  res[2]["bytes"] % (2 << 20) == 0 and name.startswith("/memfd:rw-fake-vmm-d0"),
                  "form 1: kind GPU, device 0, %d bytes (the granularity's multiple), the fd the "
                  "driver exported (%s)" % (res[2]["bytes"], name))
            os.close(res[1])
        else:
            check(False, "form 1 lends the GPU slab: %s" % (res,))
        check(vmm_fds(pids[0]) > 0, "the daemon holds the group's allocation while it is joined")
        x.close()
        gpu_rank_path(c)
        check(cluster.wait_for(lambda: all(vmm_fds(p) == 0 and vmm_maps(p) == 0 for p in pids)),
              "every group gone: the daemons hold no GPU allocation and map none (fds %s, maps %s)"
              % ([vmm_fds(p) for p in pids], [vmm_maps(p) for p in pids]))
    finally:
        c.stop()
    with open(cluster.FAKE_KERN, "rb") as f:
        if b"libasan" in f.read():
            print("skip two gpus: the kernel stand-in is built with ASan here")
        else:
            two_gpus(tmp, seed)
    # The export failing: the group gets no slabs, told why; another job runs meanwhile.
    os.makedirs(os.path.join(tmp, "fail"), exist_ok=True)
    c = cluster.Cluster(os.path.join(tmp, "fail"), 2, extra=dict(AREA, transport="tcp"))
    c.env.update(RAILWAVE_TEST_GPUDIRECT="1", RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    c.node_env[0] = {"RW_FAKE_CUDA_VMM_FAIL": "export"}
    try:
        c.start_all()
        x = Raw(c.cfg["nodes"][0]["ipc_socket"])
        x.hello("g.nogpu", 0, c.nodes * c.gpus, 0, 0)
        res = x.slab_kind(0)
        check(res[0] == "error" and res[1] == E_STATE and "no group slabs" in res[2] and
              "cuMemExportToShareableHandle" in res[2],
              "the export failing: the group is refused its slabs, naming the call: %s" % (res,))
        outs = c.collect([(r, c.rank(r, "job.b", 2, 2, seed, env=dict(c.env)))
                          for r in range(c.nodes * c.gpus)])
        check(all("2 steps x 2 layers verified" in o for o in outs.values()),
              "the daemon serves another job meanwhile (verified on the shared area)")
        x.close()
    finally:
        c.stop()


def scenario_gpu_pull(tmp, seed):
    """GPU slabs the daemons' CPUs cannot read (RW_FAKE_CUDA_VMM_NOCPU=1 in the daemons): the
    checks go through the header pull."""
    tmp = os.path.join(tmp, "pull")  # logs of its own (the other scenarios' daemons went down)
    folder = os.path.join(tmp, "counts")
    os.makedirs(folder, exist_ok=True)
    c = cluster.Cluster(tmp, 2, extra=dict(AREA, transport="tcp"))
    c.env.update(RAILWAVE_TEST_GPUDIRECT="1", RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    nocpu = {"RW_FAKE_CUDA_VMM_NOCPU": "1", "RW_FAKE_CUDA_COUNTS": folder}
    for n in range(c.nodes):
        c.node_env[n] = dict(nocpu)
    world = c.nodes * c.gpus
    try:
        c.start_all()
        pids = [c.procs[n].pid for n in range(c.nodes)]
        check(all("the groups' carve-outs in GPU 0's memory, lent by fd" in daemon_log(tmp, n)
                  for n in range(c.nodes)), "pulled: both daemons place the carve-outs on GPU 0")
        host = [(r, c.rank(r, "pull.host", 2, 20, seed)) for r in range(world)]
        lie = [(r, c.pagerank(r, "pull.lie", 1, 3, 5, "lie")) for r in range(world)]
        res = cluster.outputs(lie)
        bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
        check(not bad, "pulled: a CPU-played job on GPU slabs, phases 2 and 3 after the lie "
              "exact on every rank %s" % (bad or ""))
        check(all("lie: phase 1 failed: phase failed" in v[1] for v in res.values()),
              "pulled: the lying rank's bad header, caught through the pull, failed phase 1 on "
              "every rank of both nodes: %s" % [v[1].splitlines()[:1] for v in res.values()])
        check("rank 0: record 0 to node" in daemon_log(tmp, 0) and "its token is past the "
              "rank's tokens" in daemon_log(tmp, 0), "pulled: the daemon's log names the lying "
              "rank and its record")
        res = cluster.outputs([(r, c.pagerank(r, "pull.clie", 1, 3, 5, "clie"))
                               for r in range(world)])
        check(all(v[0] == 0 and "clie: phase 2 failed: phase failed" in v[1] and "verified" in v[1]
                  for v in res.values()),
              "pulled: a return with a wrong header, caught through the combine's pull, failed "
              "that combine on every rank, the next phases exact: %s"
              % [v[1][-160:] for v in res.values()])
        check("rank 0: its combine record for node 1" in daemon_log(tmp, 0) and "has a wrong "
              "header" in daemon_log(tmp, 0), "pulled: the daemon's log names the rank whose "
              "return was wrong")
        outs = c.collect(host)
        check(all("20 steps x 2 layers verified" in outs[r] for r in outs),
              "pulled: a host job of another group verified meanwhile (on the shared area)")
        lib = [(r, c.pagerank(r, "pull.lib", 2, 3, seed, "lib",
                              dict(c.env, RW_CUDA_DRIVER=cluster.FAKE_KERN))) for r in range(world)]
        res = cluster.outputs(lib)
        bad = {r: (v[0], v[1][-300:]) for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
        check(not bad, "pulled: 6 dispatches and their combines through librailwave's rank path "
              "on GPU slabs, every row and sum exact on every rank %s" % (bad or ""))
        log = daemon_log(tmp, 0) + daemon_log(tmp, 1)
        check(": down (" not in log, "pulled: no node was dropped")
        for n, pid in enumerate(pids):
            k = cluster.fake_cuda_counts(folder, pid)
            check(k["host_fn"] == 0 and k["kernel"] == 0 and k["word_write"] > 0 and
                  k["work"] > k["word_write"],
                  "pulled: daemon %d pulled by copies with words as marks, no kernel and no host "
                  "function (%s)" % (n, k))
    finally:
        c.stop()
    # the copies failing on node 0: that group's phase fails, named; another job runs meanwhile
    sub = os.path.join(tmp, "copyfail")
    os.makedirs(sub, exist_ok=True)
    c = cluster.Cluster(sub, 2, extra=dict(AREA, transport="tcp"))
    c.env.update(RAILWAVE_TEST_GPUDIRECT="1", RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    c.node_env[0] = {"RW_FAKE_CUDA_VMM_NOCPU": "1", "RW_FAKE_CUDA_VMM_FAIL": "copy"}
    c.node_env[1] = {"RW_FAKE_CUDA_VMM_NOCPU": "1"}
    try:
        c.start_all()
        host = [(r, c.rank(r, "fail.host", 2, 10, seed)) for r in range(world)]
        res = cluster.outputs([(r, c.pagerank(r, "fail.pull", 1, 3, 5, "until"))
                               for r in range(world)])
        check(all(v[0] == 0 and "until: phase 1 failed" in v[1] for v in res.values()),
              "copies failing: the group's first phase fails on every rank: %s"
              % [v[1].splitlines()[-1:] for v in res.values()])
        check(any("cuMemcpy2DAsync" in v[1] or "GPU slab" in v[1] for v in res.values()) or
              "cuMemcpy2DAsync" in daemon_log(sub, 0),
              "copies failing: the failure names the pull: %s"
              % [v[1].splitlines()[-1:] for v in res.values()])
        outs = c.collect(host)
        check(all("10 steps x 2 layers verified" in outs[r] for r in outs),
              "copies failing: a host job on the same daemons verified meanwhile")
    finally:
        c.stop()


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.LIBRAILWAVE) or not all(
            os.path.exists(p) for p in (cluster.FAKE_CUDA, cluster.FAKE_KERN)):
        print("skip: railwaved, rw_rank, librailwave or the CUDA stand-ins not built")
        return 77
    seed = cluster.test_seed()
    with tempfile.TemporaryDirectory(prefix="rwslabs.", dir="/tmp") as tmp:
        check.scenarios([("lent tcp", lambda t, s: scenario_lent(t, s, "tcp")),
                         ("lent shm", lambda t, s: scenario_lent(t, s, "shm")),
                         ("late peer", scenario_late_peer),
                         ("hostile rank", scenario_hostile_rank),
                         ("attacks", scenario_attacks),
                         ("rank path", scenario_rank_path),
                         ("gpu slabs", scenario_gpu),
                         ("gpu slabs pulled", scenario_gpu_pull)], tmp, seed)
    return check.exit_code()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--open"]:
        sys.exit(open_rank_path(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                                int(sys.argv[6])))
    sys.exit(main())
