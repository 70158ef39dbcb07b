#!/usr/bin/env python3
"""Hostile local clients at the rank path's daemon entry points (docs/ipc.md "Protocol", the
rank page and the group slabs; docs/security.md), against real railwaved on loopback: a host
job of another group verifies every row and sum on both daemons all along, and every attack is
made by this script on the daemon's socket with hand-built datagrams (SCM_RIGHTS where it
passes fds). For each: the error's code and message, whether the connection is kept or
dropped, and that the daemon serves the next client; descriptors and shared mappings of the
daemon (/proc/PID/fd, /proc/PID/maps) are counted before and after.

1. Out of order and repeated: PAGE_SETUP before the hello (RW_E_STATE, closed), PAGE_SETUP
   twice (RW_E_STATE, kept), after GOODBYE in the same burst (never answered: the connection
   is closed), a hello after the page (RW_E_STATE, kept).
2. Fields: PAGE_SETUP with its reserved word set (RW_E_FIELD), max_recv 0 or above the daemon's
   bound (RW_E_TOKENS); SLAB_SETUP of an unknown form (RW_E_FIELD), rail 64 and 2^32 - 1
   (RW_E_INVAL); a byte long (RW_E_MSG_SIZE, dropped); the page that is lent is a sealed memfd
   of the size PAGE_OK says.
3. Descriptors where none are expected: 1 to 4 memfds on PAGE_SETUP and SLAB_SETUP (RW_E_FDS;
   kept after the hello, dropped before it), 5 (MSG_CTRUNC: RW_E_FDS): none of those fds stays
   open in the daemon.
4. Many connections, each with a page of the largest max_recv, up to the per-uid cap
   (ipc_max_per_uid 16 here): the next one is refused at accept (RW_E_LIMIT); all closed, the
   daemon's descriptors and page mappings are back to the baseline.
5. Churn: connections that join, take a page and a slab and close at once, many rounds: the
   mappings come back to the baseline and a joining rank is lent a page afterwards.
6. A client that sends requests and never reads the replies is dropped when its socket fills;
   the others are served.
7. A TCP socket with SO_LINGER (an hour) and data its peer never reads, passed on a request
   and closed by the sender: refused (RW_E_FDS), and the next client is served at once (the
   daemon's close() of it would wait out the linger).
Then the host job's every phase verified, and every daemon exits 0 on SIGTERM (ASan: no leak).
Run by tests/run as $b/test/svc_rankhostile; exits 0 pass, 1 fail, 77 skip."""
import mmap
import os
import signal
import socket
import struct
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

check = cluster.Checks()
E_INVAL, E_MSG_SIZE, E_FDS, E_STATE, E_FIELD = -1, -23, -25, -26, -27  # ipc/railwave.h
E_TOKENS, E_LIMIT = -45, -51
MAGIC, VERSION = 0x50495752, cluster.define("ipc/railwave.h", "RW_PROTOCOL_VERSION")
HELLO, HELLO_OK, ERROR, GOODBYE = 1, 2, 11, 10  # ipc/proto.h
PAGE_SETUP, PAGE_OK, SLAB_SETUP, SLAB_OK = 14, 15, 16, 17
PER_UID = 16
AREA = {"group_area_mib": 1, "group_pool_mib": 4, "heartbeat_timeout_ms": 5000,
        "ipc_max_per_uid": PER_UID}


class Raw:
    """A client speaking ipc/proto.h by hand on the daemon's socket."""

    def __init__(self, path):
        self.seq = 0
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.s.settimeout(10)
        self.s.connect(path)

    def send(self, typ, body=b"", fds=()):
        """One request: the header (the next seq), its body, fds by SCM_RIGHTS."""
        self.seq += 1
        msg = struct.pack("<IHHII", MAGIC, VERSION, typ, self.seq, 0) + body
        if fds:
            socket.send_fds(self.s, [msg], list(fds))
        else:
            self.s.send(msg)

    def reply(self):
        """("ok", type, message, fds) or ("error", code, text, fatal) or ("closed",)."""
        try:
            msg, fds, _, _ = socket.recv_fds(self.s, 512, 4)
        except (ConnectionResetError, socket.timeout):
            return ("closed",)
        if not msg:
            return ("closed",)
        typ = struct.unpack_from("<IHHII", msg)[2]
        if typ == ERROR:
            code, fatal = struct.unpack_from("<iI", msg, 16)
            for fd in fds:
                os.close(fd)
            return ("error", code, msg[24:136].split(b"\0")[0].decode(), fatal)
        return ("ok", typ, msg, fds)

    def hello(self, group, rank, world, node, gpu):
        self.send(HELLO, struct.pack("<64sIIIi16sII64s", group.encode(), rank, world, node, gpu,
                                     b"\0" * 16, 0, 0, b""))
        res = self.reply()
        if res[0] != "ok" or res[1] != HELLO_OK:
            raise RuntimeError("hello refused: %r" % (res,))

    def page(self, max_recv, reserved=0, fds=(), extra=b""):
        self.send(PAGE_SETUP, struct.pack("<II", max_recv, reserved) + extra, fds)
        return self.reply()

    def slab(self, rail, form=0, fds=(), extra=b""):
        self.send(SLAB_SETUP, struct.pack("<II", rail, form) + extra, fds)
        return self.reply()

    def closed(self):
        try:
            while True:
                msg = self.s.recv(512)
                if msg == b"":
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False

    def close(self):
        self.s.close()


def err(res, code, text=None):
    return res[0] == "error" and res[1] == code and (text is None or text in res[2])


def close_fds(res):
    if res[0] == "ok":
        for fd in res[3]:
            os.close(fd)


def footprint(pid):
    """(memfd descriptors, rank page mappings) of the daemon: what an attack could leave. Its
    sockets come and go with the host job's ranks; all descriptors are compared at the end."""
    fds = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            fds += os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("/memfd:")
        except OSError:
            pass  # closed meanwhile
    with open("/proc/%d/maps" % pid) as f:
        pages = sum("railwave-rank-page" in line for line in f)
    return fds, pages


def descriptors(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def settled(pid, base, what, of=footprint):
    """Waits (bounded) for the daemon's footprint to come back to `base`."""
    deadline = time.time() + cluster.WAIT
    while True:
        now = of(pid)
        if now == base or time.time() > deadline:
            break
        time.sleep(0.05)
    check(now == base, "%s: the daemon's %s back to %s (now %s)"
          % (what, "memfds and page mappings" if of is footprint else "descriptors", base, now))


def memfds(n):
    return [os.memfd_create("hostile-%d" % i) for i in range(n)]


def scenario(c, tmp):
    sock = c.cfg["nodes"][0]["ipc_socket"]
    pid = c.procs[0].pid
    world = c.nodes * c.gpus
    max_tokens = 65536  # the daemon's max_tokens default bounds max_recv
    base = footprint(pid)
    fds0 = descriptors(pid)
    time.sleep(0.5)
    while descriptors(pid) != fds0:  # the mesh's connections settled
        fds0 = descriptors(pid)
        time.sleep(0.5)
    job = [(r, c.rank(r, "job.h", 2, 400, 5)) for r in range(world)]
    # The job's ranks on node 0 hold their connections before the attacks begin: step 4 fills
    # the uid's connection cap, and a rank still starting (a loaded machine) would lose its
    # place to it.
    local = ["rank %d of group job.h joined" % r for r in range(c.gpus)]
    check(cluster.wait_for(lambda: all(x in c.log(0) for x in local),
                           what="node 0's job ranks to join"),
          "the host job's ranks on node 0 joined before the attacks")

    # 1. Out of order, repeated.
    x = Raw(sock)
    res = x.page(64)
    check(err(res, E_STATE, "hello") and res[3] == 1 and x.closed(),
          "PAGE_SETUP before the hello: RW_E_STATE, the connection closed (%s)" % (res,))
    x.close()
    x = Raw(sock)
    x.hello("hx.a", 0, world, 0, 0)
    res = x.page(64)
    ok = res[0] == "ok" and res[1] == PAGE_OK and len(res[3]) == 1
    check(ok, "a joined client is lent a page (%s)" % (res[:2],))
    if ok:
        nbytes = struct.unpack_from("<Q", res[2], 16)[0]
        import fcntl
        seals = fcntl.fcntl(res[3][0], fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        check(os.fstat(res[3][0]).st_size == nbytes and seals & want == want,
              "the page is a memfd of the %d bytes PAGE_OK says, sealed (seals %#x)"
              % (nbytes, seals))
    close_fds(res)
    res = x.page(64)
    check(err(res, E_STATE, "already"), "PAGE_SETUP twice: RW_E_STATE (%s)" % (res,))
    x.send(HELLO, struct.pack("<64sIIIi16sII64s", b"hx.a", 0, world, 0, 0, b"\0" * 16, 0, 0, b""))
    res = x.reply()
    check(err(res, E_STATE, "hello twice") and res[3] == 0,
          "a hello after the page: RW_E_STATE, kept (%s)" % (res,))
    res = x.slab(0)
    check(res[0] == "ok" and res[1] == SLAB_OK, "the connection still serves: slab of rail 0 lent")
    close_fds(res)

    # The page's head says what the daemon checks: the rank's local index (rank % GPUs per node),
    # its records' owner, and that index's rail, whatever local GPU its hello named (-1: none).
    for rank, gpu in ((1, -1), (1, 0), (0, 1), (1, 7)):
        v = Raw(sock)
        v.hello("hx.own%d%d" % (rank, gpu + 1), rank, world, 0, gpu)
        res = v.page(64)
        if res[0] == "ok":
            with mmap.mmap(res[3][0], 4096) as m:
                gpus, rail, node, owner = struct.unpack_from("<IIII", m, 40)
            local = rank % c.gpus
            check(gpus == c.gpus and node == 0 and owner == local and rail == local % c.rails,
                  "rank %d with local GPU %d: the page names owner %d (local rank %d) and rail %d "
                  "(its local rank's rail %d)" % (rank, gpu, owner, local, rail, local % c.rails))
        else:
            check(False, "rank %d with local GPU %d is lent a page (%s)" % (rank, gpu, res))
        close_fds(res)
        v.close()

    # 2. Fields.
    res = x.page(64, reserved=1)
    check(err(res, E_FIELD), "PAGE_SETUP with its reserved word set: RW_E_FIELD (%s)" % (res,))
    y = Raw(sock)
    y.hello("hx.b", 0, world, 0, 0)
    for mr in (0, max_tokens + 1, 0xffffffff):
        res = y.page(mr)
        check(err(res, E_TOKENS, "max_recv"), "PAGE_SETUP max_recv %d: RW_E_TOKENS (%s)"
              % (mr, res))
    for form in (2, 0xffffffff):
        res = y.slab(1, form)
        check(err(res, E_FIELD, "form"), "SLAB_SETUP form %d: RW_E_FIELD (%s)" % (form, res))
    for rail in (c.rails, 64, 0xffffffff):
        res = y.slab(rail)
        check(err(res, E_INVAL, "no such rail"), "SLAB_SETUP rail %d: RW_E_INVAL (%s)"
              % (rail, res))
    res = y.page(max_tokens)
    check(res[0] == "ok", "after the refusals the largest page (max_recv %d) is lent" % max_tokens)
    close_fds(res)
    res = y.slab(0, extra=b"\0")
    check(err(res, E_MSG_SIZE) and res[3] == 1 and y.closed(),
          "SLAB_SETUP a byte long: RW_E_MSG_SIZE, dropped (%s)" % (res,))
    y.close()

    # 3. Descriptors where none are expected.
    for n in (1, 4, 5):
        fds = memfds(n)
        res = x.page(64, fds=fds)
        check(err(res, E_FDS) and res[3] == 0,
              "PAGE_SETUP with %d fds: RW_E_FDS, kept (%s)" % (n, res))
        res = x.slab(1, fds=fds)
        check(err(res, E_FDS) and res[3] == 0,
              "SLAB_SETUP with %d fds: RW_E_FDS, kept (%s)" % (n, res))
        for fd in fds:
            os.close(fd)
    res = x.slab(1)
    check(res[0] == "ok", "the connection still serves: slab of rail 1 lent")
    close_fds(res)
    z = Raw(sock)
    fds = memfds(2)
    z.send(PAGE_SETUP, struct.pack("<II", 64, 0), fds)
    for fd in fds:
        os.close(fd)
    res = z.reply()
    check(err(res, E_FDS) and res[3] == 1 and z.closed(),
          "PAGE_SETUP with fds before the hello: RW_E_FDS, dropped (%s)" % (res,))
    z.close()

    # GOODBYE, then requests in the same burst: nothing answered.
    x.send(GOODBYE)
    try:  # the daemon may have closed it already
        x.send(PAGE_SETUP, struct.pack("<II", 64, 0))
        x.send(SLAB_SETUP, struct.pack("<II", 0, 0))
    except (BrokenPipeError, ConnectionResetError):
        pass
    check(x.closed(), "requests after GOODBYE are not answered: the connection is closed")
    x.close()
    settled(pid, base, "after the single attacks")

    # 4. Many connections, each with the largest page, up to the per-uid cap.
    held, refused = [], None
    for i in range(PER_UID + 1):  # the job's ranks on node 0 hold some of the uid's connections
        h = Raw(sock)
        try:
            h.send(HELLO, struct.pack("<64sIIIi16sII64s", b"hx.m%d" % i, 0, world, 0, 0,
                                      b"\0" * 16, 0, 0, b""))
            res = h.reply()
        except (BrokenPipeError, ConnectionResetError):  # refused and closed before the hello
            res = ("closed",)
        if res[0] != "ok":  # refused at accept (the error may be lost to our hello's reset)
            refused = res
            h.close()
            break
        res = h.page(max_tokens)
        check(res[0] == "ok", "connection %d is lent a page of max_recv %d (%s)"
              % (i, max_tokens, res[:2]))
        close_fds(res)
        held.append(h)
    fp = footprint(pid)
    check(fp[1] == base[1] + len(held), "the daemon maps one page per connection (%s)" % (fp,))
    st = c.stats(0)
    check(refused is not None and (refused[0] == "closed" or err(refused, E_LIMIT, "per-uid"))
          and "ipc_refused_uid 1\n" in st and len(held) >= PER_UID - world // c.nodes,
          "after %d connections the next is refused at accept: RW_E_LIMIT (%s)"
          % (len(held), refused))
    for h in held:
        h.close()
    settled(pid, base, "after %d connections with pages" % len(held))

    # 5. Churn.
    for i in range(200):
        h = Raw(sock)
        h.hello("hx.c%d" % i, 0, world, 0, 0)
        close_fds(h.page(1 + i))
        close_fds(h.slab(i % c.rails, i % 2))
        h.close()
    settled(pid, base, "after 200 connections that took a page and a slab and left")
    h = Raw(sock)
    h.hello("hx.after", 0, world, 0, 0)
    res = h.page(64)
    check(res[0] == "ok", "a rank joining after the churn is lent a page")
    close_fds(res)
    h.close()

    # 6. A client that never reads its replies.
    w = Raw(sock)
    w.hello("hx.w", 0, world, 0, 0)
    w.s.settimeout(0.2)
    sent = 0
    for sent in range(100000):  # until the daemon drops it (a bound, not a timing)
        try:
            w.send(SLAB_SETUP, struct.pack("<II", 64, 0))
        except socket.timeout:
            continue  # the daemon has not read them yet
        except (BrokenPipeError, ConnectionResetError):
            break
    w.s.settimeout(10)
    check(w.closed(), "a client that never reads its replies is dropped (%d requests sent)" % sent)
    w.close()
    settled(pid, base, "after the client that never read")

    # 7. A socket with SO_LINGER and data its peer never reads, passed as an fd: the sender
    # closes its copy, so the daemon's close is the last, and close() waits out the linger
    # (an hour here) with whatever thread makes it held.
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    tcp.connect(lst.getsockname())
    peer, _ = lst.accept()
    tcp.setblocking(False)
    try:
        while True:
            tcp.send(b"x" * 65536)
    except BlockingIOError:
        pass
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 3600))
    z = Raw(sock)
    c.procs[0].send_signal(signal.SIGSTOP)  # so that the daemon's close is the last one
    z.send(PAGE_SETUP, struct.pack("<II", 64, 0), [tcp.fileno()])
    tcp.close()
    c.procs[0].send_signal(signal.SIGCONT)
    res = z.reply()
    check(err(res, E_FDS) and z.closed(), "a lingering socket passed before the hello: RW_E_FDS, "
          "dropped (%s)" % (res,))
    z.close()
    q = Raw(sock)
    try:
        q.hello("hx.linger", 0, world, 0, 0)
        served = True
    except (socket.timeout, RuntimeError):
        served = False
    check(served, "the daemon serves the next client at once (the old daemon's loop waited in "
          "close() for the socket's linger)")
    q.close()
    peer.setblocking(False)
    try:  # the old daemon's close returns once the data is read
        while peer.recv(1 << 20):
            pass
    except BlockingIOError:
        pass
    peer.close()
    lst.close()
    settled(pid, base, "after the lingering socket")

    outs = c.collect(job)
    check(all("400 steps x 2 layers verified" in outs[r] for r in outs),
          "the host job verified every phase beside the attacks")
    settled(pid, fds0, "after the job", of=descriptors)
    c.stop()


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK):
        print("skip: railwaved or rw_rank not built")
        return 77
    tmp = tempfile.mkdtemp(prefix="rw-rankhostile-")
    c = cluster.Cluster(tmp, 2, extra=AREA)
    return check.run(c, lambda: (c.start_all(), scenario(c, tmp)))


if __name__ == "__main__":
    sys.exit(main())
