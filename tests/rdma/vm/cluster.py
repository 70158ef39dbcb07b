#!/usr/bin/env python3
"""railwaved over real RDMA verbs, end to end (docs/rdma-verbs.md "The daemon on Soft-RoCE").

Three qemu guests (tests/rdma/vm/railvm.sh builds their kernel and initramfs from Debian packages),
each with two Soft-RoCE rails (rxe0, rxe1) and a third NIC for the daemons' control channel, all
three links switched by a small learning switch in this process on loopback UDP ports. Every
guest runs one real railwaved with "transport": "verbs" and two real ranks
(tests/integration/rw_rank.c) that check every dispatched row and every combined sum against their
own reference. Rail 0 is forced to RDMA WRITE + SEND (the iWARP path), rail 1 uses RDMA WRITE WITH
IMMEDIATE. The host drives the guests through a command server on a serial port of each
(guest-agent). Scenarios: every forced path and the selector over several layers and steps, the
daemons' per-rail record counters checked against the plan computed here from the ranks'
workload; writes longer than the device's message limit with few writes in flight (chunking,
back-pressure, RNR at a receiver with few receives posted); CUDA ranks with the stand-in driver
(dmabuf unsupported on rxe: logged once per rail, host staging); faults: a peer daemon killed mid-phase,
a rank killed, one rail of one node cut off by the switch mid-phase (retry exceeded).

  tests/rdma/vm/cluster.py BUILDDIR        exit 0 pass, 1 fail, 77 skip (no qemu, kernel, ...)
Environment: RW_TEST_SEED (workload seed), RW_VM_CLUSTER_ONLY=paths,big,... (some scenarios),
RW_VM_KEEP=DIR (keep the guests' logs), RW_VM_ACCEL=kvm (default tcg)."""
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NODES, GPUS, RAILS = 3, 2, 2
LINKS = ["rail0", "rail1", "ctl"]
BOOT_WAIT = 240.0  # bound on boot + barrier (never a pass criterion)
WAIT = 90          # bound on any rank or daemon wait in the guests, seconds
# The guests' CPU model (railvm.sh's default too): without ERMS/FSRM the guest kernel copies with
# mov loops, not `rep movsb`, which TCG emulates one iteration (byte) at a time.
VM_CPU = "max,-erms,-fsrm"
SOCK, STATS = "/tmp/rw.sock", "/tmp/rw.stats"


def log(msg):
    print(msg, flush=True)


# ---- the switch ---------------------------------------------------------------------------------

class Switch(threading.Thread):
    """A learning Ethernet switch per link, on loopback UDP: qemu's "-netdev socket,udp=" NIC of
    guest n on link L sends its frames to our socket (L, n) and receives on its own port. Frames
    from or to a node cut off on a link (cut()) are dropped, as by a pulled cable."""

    def __init__(self, nodes):
        super().__init__(daemon=True)
        self.sock, self.guest_port, self.owner = {}, {}, {}
        self.mac, self.blocked = {}, set()
        self.frames = {l: 0 for l in LINKS}
        self.dropped = {l: 0 for l in LINKS}  # by cut()
        self.lost = {l: 0 for l in LINKS}     # sendto failed
        self.lock = threading.Lock()
        self.nodes = nodes
        held = []
        for l in LINKS:
            for n in range(nodes):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                for opt in (33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF):  # *BUFFORCE, *BUF
                    try:  # deep buffers: a busy host must not drop frames on this "fabric"
                        s.setsockopt(socket.SOL_SOCKET, opt[0], 8 << 20)
                    except OSError:
                        s.setsockopt(socket.SOL_SOCKET, opt[1], 8 << 20)
                s.bind(("127.0.0.1", 0))
                s.setblocking(False)
                self.sock[l, n] = s
                self.owner[s.fileno()] = (l, n)
                g = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                g.bind(("127.0.0.1", 0))  # a free port for the guest's end, released below
                held.append(g)
                self.guest_port[l, n] = g.getsockname()[1]
        for g in held:
            g.close()
        self.stop_r, self.stop_w = os.pipe()

    def netdev(self, link, n):
        return "socket,id=%s,udp=127.0.0.1:%d,localaddr=127.0.0.1:%d" % (
            link, self.sock[link, n].getsockname()[1], self.guest_port[link, n])

    def cut(self, link, n, on=True):
        with self.lock:
            (self.blocked.add if on else self.blocked.discard)((link, n))

    def run(self):
        poll = select.poll()
        for s in self.sock.values():
            poll.register(s.fileno(), select.POLLIN)
        poll.register(self.stop_r, select.POLLIN)
        while True:
            for fd, _ in poll.poll():
                if fd == self.stop_r:
                    return
                link, n = self.owner[fd]
                s = self.sock[link, n]
                while True:
                    try:
                        frame = s.recv(65536)
                    except BlockingIOError:
                        break
                    self.forward(link, n, frame)

    def forward(self, link, n, frame):
        if len(frame) < 14:
            return
        self.frames[link] += 1
        with self.lock:
            blocked = set(self.blocked)
        if (link, n) in blocked:
            self.dropped[link] += 1
            return
        self.mac[link, frame[6:12]] = n
        to = self.mac.get((link, frame[0:6])) if not frame[0] & 1 else None
        for m in ([to] if to is not None else range(self.nodes)):
            if m == n:
                continue
            if (link, m) in blocked:
                self.dropped[link] += 1
                continue
            try:
                self.sock[link, m].sendto(frame, ("127.0.0.1", self.guest_port[link, m]))
            except OSError:  # the guest is not up (yet, or any more), or no buffer space
                self.lost[link] += 1

    def stop(self):
        os.write(self.stop_w, b"x")
        self.join(5)
        for s in self.sock.values():
            s.close()
        os.close(self.stop_r)
        os.close(self.stop_w)


# ---- the guests ---------------------------------------------------------------------------------

class Guest:
    """One qemu guest and the connection to its command server (guest-agent on ttyS2)."""

    def __init__(self, n, work, image, switch, accel):
        self.n, self.work = n, work
        self.agent_path = os.path.join(work, "agent%d.sock" % n)
        self.console = os.path.join(work, "guest%d.console" % n)
        self.out = os.path.join(work, "guest%d.out" % n)
        net = []
        for i, l in enumerate(LINKS):
            net += ["-netdev", switch.netdev(l, n), "-device",
                    "virtio-net-pci,netdev=%s,mac=52:54:00:0%d:0%d:01,romfile=" % (l, i, n)]
        cmd = ["qemu-system-x86_64"] + accel + [
            "-cpu", os.environ.get("RW_VM_CPU", VM_CPU), "-smp", "1", "-m", "768", "-nodefaults", "-no-user-config",
            "-display", "none", "-no-reboot",
            "-kernel", os.path.join(image, "vmlinuz"), "-initrd", os.path.join(image, "initrd.cpio"),
            # no_timer_check: under TCG on a loaded host the kernel's IO-APIC timer check can
            # miss its ticks and panic at boot ("IO-APIC + timer doesn't work"); skip it.
            "-append", "console=ttyS0 quiet panic=-1 no_timer_check rwnode=%d rwnodes=%d "
                       "rwrails=%d rwctl=1 rwagent=1" % (n, NODES, RAILS),
            "-serial", "file:" + self.console, "-serial", "file:" + self.out,
            "-chardev", "socket,id=agent,path=%s,server=on,wait=off" % self.agent_path,
            "-serial", "chardev:agent"] + net
        self.qlog = open(os.path.join(work, "qemu%d.log" % n), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.qlog, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.sock, self.buf, self.seq = None, b"", 0

    def connect(self, deadline):
        while self.sock is None:
            if self.proc.poll() is not None:
                raise RuntimeError("guest %d: qemu exited %s: %s" % (self.n, self.proc.returncode,
                                                                     self.tail()))
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(self.agent_path)
                self.sock = s
            except OSError:
                s.close()
                if time.time() > deadline:
                    raise RuntimeError("guest %d: no agent socket" % self.n)
                time.sleep(0.05)

    def readline(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0 or self.proc.poll() is not None:
                raise RuntimeError("guest %d: no answer (%s)\n%s" % (
                    self.n, "qemu exited" if self.proc.poll() is not None else "timeout",
                    self.tail()))
            self.sock.settimeout(min(left, 1.0))
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                raise RuntimeError("guest %d: agent connection closed\n%s" % (self.n, self.tail()))
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace").rstrip("\r")

    def wait_ready(self, deadline):
        while self.readline(deadline) != "@@RWVM-AGENT ready":
            pass

    def send(self, cmd):
        assert "\n" not in cmd
        self.seq += 1
        self.sock.sendall(("%d %s\n" % (self.seq, cmd)).encode())
        return self.seq

    def answer(self, seq, timeout):
        deadline = time.time() + timeout
        out = []
        while True:
            line = self.readline(deadline)
            if line.startswith("@@RWVM-DONE "):
                _, sid, rc = line.split()
                if int(sid) == seq:
                    return int(rc), "\n".join(out)
                continue
            out.append(line)

    def run(self, cmd, timeout=WAIT + 30, check=True):
        rc, out = self.answer(self.send(cmd), timeout)
        if check and rc != 0:
            raise RuntimeError("guest %d: `%s` exited %d:\n%s" % (self.n, cmd, rc, out))
        return out if check else (rc, out)

    def tail(self, lines=25):
        text = []
        for path in (self.out, self.console):
            try:
                with open(path, errors="replace") as f:
                    text += ["  g%d| %s" % (self.n, l.rstrip("\r"))
                             for l in f.read().splitlines()[-lines:]]
            except OSError:
                pass
        return "\n".join(text)

    def poweroff(self):
        if self.sock is not None and self.proc.poll() is None:
            try:
                self.answer(self.send("@@poweroff"), 10)
            except (RuntimeError, OSError):
                pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.sock is not None:
            self.sock.close()
        self.qlog.close()


def on_all(guests, cmds, timeout=WAIT + 30):
    """Run cmds[n] on guest n, all at once; returns the outputs (each must exit 0)."""
    seqs = {g.n: g.send(cmds[g.n]) for g in guests if cmds.get(g.n)}
    outs = {}
    for g in guests:
        if g.n in seqs:
            rc, out = g.answer(seqs[g.n], timeout)
            if rc != 0:
                raise RuntimeError("guest %d: `%s` exited %d:\n%s" % (g.n, cmds[g.n], rc, out))
            outs[g.n] = out
    return outs


def q(s):
    """Quote for the guests' shell."""
    return "'" + str(s).replace("'", "'\\''") + "'"


# ---- the ranks' workload and the plan (tests/integration/rw_rank.c, docs/algorithms.md) --------

M64 = (1 << 64) - 1
TOPK, MAX_TOKENS = 4, 48


def mix(z):
    z = (z + 0x9e3779b97f4a7c15) & M64
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
    return z ^ (z >> 31)


class Rng:
    def __init__(self, s):
        self.s = s

    def next(self):
        self.s = mix(self.s)
        return self.s >> 32


def rank_ids(seed, step, layer, rank, experts, hidden, empty, tokens=0):
    """The top-k expert ids of every token rank `rank` dispatches at (step, layer): rw_rank's
    gen(), draw for draw (the rows' values are drawn too, to keep the sequence)."""
    r = Rng(mix((seed ^ (step << 40) ^ (layer << 20) ^ rank) & M64))
    base = 1 + r.next() % MAX_TOKENS
    n = base * 3 if rank % GPUS == 0 else base
    if tokens:
        n = tokens
    if empty:
        ph = mix((seed ^ 0x5eed ^ (step << 40) ^ (layer << 20)) & M64)
        if ph % 5 == 1 or (step == 0 and layer == 1) or r.next() % 4 == 0:
            n = 0
    hot = experts // 4 or 1
    shift = (rank * 7 + layer) % experts
    out = []
    for _ in range(n):
        ids = []
        for _ in range(TOPK):
            while True:
                u = r.next()
                if u % 8 == 0:
                    e = -1
                    break
                e = (shift + r.next() % hot) % experts if u % 2 else r.next() % experts
                if e not in ids:
                    break
            ids.append(e)
            r.next()  # the weight
        for _ in range(hidden):
            r.next()  # the row's values
        out.append(ids)
    return out


def phase_counts(seed, step, layer, experts, hidden, empty, tokens=0):
    """count[s][d][r]: records (token, remote node) from node s to node d whose native rail is r
    (the rail of the owning GPU, g % R)."""
    c = [[[0] * RAILS for _ in range(NODES)] for _ in range(NODES)]
    per_node = experts // NODES
    for rank in range(NODES * GPUS):
        s, g = divmod(rank, GPUS)
        for ids in rank_ids(seed, step, layer, rank, experts, hidden, empty, tokens):
            for d in {e // per_node for e in ids if e >= 0} - {s}:
                c[s][d][g % RAILS] += 1
    return c


def expected_records(counts_by_phase, balanced):
    """Per node and rail, the records it sends over the run: its dispatch rows to every other
    node plus the combine rows it returns to their owners, on the rail that carried them. Native
    rails: exact; RailBalance (balanced): each (s, d) pair's quotas are floor or ceil of T / R, so
    a (lo, hi) range per rail, and the exact total."""
    lo = [[0] * RAILS for _ in range(NODES)]
    hi = [[0] * RAILS for _ in range(NODES)]
    total = [0] * NODES
    for c in counts_by_phase:
        for s in range(NODES):
            for d in range(NODES):
                if s == d:
                    continue
                t = sum(c[s][d])
                for node in (s, d):  # s sends the dispatch, d returns the combine
                    total[node] += t
                    for r in range(RAILS):
                        if balanced:
                            lo[node][r] += t // RAILS
                            hi[node][r] += -(-t // RAILS)
                        else:
                            lo[node][r] += c[s][d][r]
                            hi[node][r] += c[s][d][r]
    return lo, hi, total


# ---- the cluster of daemons ---------------------------------------------------------------------

class Cluster:
    def __init__(self, guests, switch):
        self.g, self.switch = guests, switch
        self.experts = NODES * GPUS * 2
        self.cfg = {
            "cluster": "vm", "transport": "verbs", "gpus_per_node": GPUS,
            "phase_timeout_ms": 30000, "heartbeat_interval_ms": 250,
            "heartbeat_timeout_ms": 5000, "recv_region_mib": 16, "http": "127.0.0.1:9100",
            "log_level": "info", "ipc_socket": SOCK, "stats_socket": STATS,
            "nodes": [{"name": "n%d" % n, "control": "169.254.100.%d:7400" % (n + 1),
                       "rails": [{"address": "169.254.%d.%d" % (r + 1, n + 1), "port": 7500 + r}
                                 for r in range(RAILS)]} for n in range(NODES)]}
        self.running = set()
        self.key = os.urandom(32).hex()

    def configure(self, **extra):
        # Peers authenticate (docs/security.md): one key for the cluster, mode 0600 in every
        # guest, so the verbs rails carry their session proofs in the CM hello.
        cfg = dict(self.cfg, key_file="/tmp/cluster.key", **extra)
        text = json.dumps(cfg, separators=(",", ":"))
        key = self.key
        on_all(self.g, {g.n: "umask 077 && printf '%%s\\n' %s >/tmp/cluster.key && "
                             "printf '%%s\\n' %s >/tmp/cluster.json" % (key, q(text))
                        for g in self.g})

    def start(self, nodes=None, path="auto", env=None):
        nodes = range(NODES) if nodes is None else nodes
        cmds = {}
        for n in nodes:
            e = dict(RW_VERBS_WRITE_SEND_RAILS="0")
            e.update((env or {}).get("all", {}))
            e.update((env or {}).get(n, {}))
            envs = " ".join("%s=%s" % (k, q(v)) for k, v in sorted(e.items()))
            cmds[n] = ("echo '--- start (path %s, %s)' >>/tmp/d.log; rwvm-agent spawn d env %s "
                       "railwaved --config /tmp/cluster.json --node %d --path %s"
                       % (path, envs, envs, n, path))
            self.running.add(n)
        on_all(self.g, cmds)

    def stats(self, n, cmd="stats"):
        return self.g[n].run("railwave stats --socket %s %s" % (STATS, q(cmd)))

    def wait_mesh(self, nodes=None):
        nodes = range(NODES) if nodes is None else nodes
        deadline = time.time() + WAIT
        while time.time() < deadline:
            ok = True
            for n in nodes:
                rc, out = self.g[n].run("railwave stats --socket %s 'stats peers'" % STATS,
                                        check=False)
                ok = ok and rc == 0 and out.count("state=up") == NODES - 1
            if ok:
                return
            time.sleep(0.3)
        raise RuntimeError("mesh did not come up\n" + self.logs())

    def kill(self, n, sig="KILL"):
        self.g[n].run("kill -%s $(cat /tmp/d.pid); rwvm-agent wait d %d; true" % (sig, WAIT))
        self.running.discard(n)

    def stop(self):
        """SIGTERM every daemon; each must exit 0."""
        nodes = sorted(self.running)
        outs = on_all(self.g, {n: "kill -TERM $(cat /tmp/d.pid); rwvm-agent wait d %d; echo rc=$?"
                                  % WAIT for n in nodes})
        self.running = set()
        bad = [(n, outs[n].strip()) for n in nodes if outs[n].strip() != "rc=0"]
        if bad:
            raise RuntimeError("daemons exited badly: %s\n%s" % (bad, self.logs()))

    def logs(self, lines=30):
        out = []
        for g in self.g:
            rc, text = g.run("tail -n %d /tmp/d.log" % lines, timeout=30, check=False)
            out += ["  d%d| %s" % (g.n, l) for l in text.splitlines()]
        return "\n".join(out)

    def daemon_log(self, n):
        return self.g[n].run("cat /tmp/d.log")

    def spawn_ranks(self, group, layers, steps, seed, mode="ok", flags=(), ranks=None, env=None):
        ranks = range(NODES * GPUS) if ranks is None else ranks
        cmds = {}
        for r in ranks:
            n = r // GPUS
            args = [SOCK, group, r, NODES, GPUS, self.experts, layers, steps, seed, mode]
            pre = "env %s " % " ".join("%s=%s" % kv for kv in sorted(env.items())) if env else ""
            cmds.setdefault(n, []).append(
                "rm -f /tmp/rk%d.log; rwvm-agent spawn rk%d %srw_rank %s >/dev/null"
                % (r, r, pre, " ".join(q(a) for a in args + list(flags))))
        on_all(self.g, {n: "; ".join(c) for n, c in cmds.items()})
        return list(ranks)

    def collect(self, ranks, want=0):
        by_node = {}
        for r in ranks:
            by_node.setdefault(r // GPUS, []).append(r)
        cmds = {n: "; ".join("rwvm-agent wait rk%d %d; echo \"@@rc rk%d $?\"; cat /tmp/rk%d.log"
                             % (r, WAIT, r, r) for r in rs) for n, rs in by_node.items()}
        outs = on_all(self.g, cmds, timeout=WAIT * len(ranks) + 30)
        res, fails = {}, []
        for n, text in outs.items():
            cur = None
            for line in text.splitlines():
                if line.startswith("@@rc rk"):
                    _, name, rc = line.split()
                    cur = int(name[2:])
                    res[cur] = [int(rc), []]
                elif cur is not None:
                    res[cur][1].append(line)
        for r in ranks:
            rc, lines = res.get(r, [None, ["no status"]])
            if rc is None or (want is not None and rc != want):
                fails.append("rank %d rc %s: %s" % (r, rc, " | ".join(lines)[-400:]))
        if fails:
            raise RuntimeError("\n".join(fails) + "\n" + self.logs())
        return {r: "\n".join(res[r][1]) for r in ranks}

    def run_ranks(self, group, layers, steps, seed, flags=(), env=None):
        return self.collect(self.spawn_ranks(group, layers, steps, seed, flags=flags, env=env))

    def rails(self, n):
        """`stats rails` of daemon n as one {key: number} dict per rail."""
        return [{k: float(v) for k, v in (w.split("=", 1) for w in line.split() if "=" in w)
                 if v.replace(".", "", 1).isdigit()}
                for line in self.stats(n, "stats rails").splitlines() if line.startswith("rail=")]

    RXE = ("rcvd_rnr_err", "send_rnr_err", "out_of_seq_request", "duplicate_request",
           "rcvd_seq_err", "completer_retry_err", "retry_exceeded_err", "sent_pkts")

    def rxe_counters(self, n):
        """Soft-RoCE's own counters of node n (sysfs hw_counters), summed over its rails."""
        cmd = "; ".join("echo %s $(cat /sys/class/infiniband/rxe%d/ports/1/hw_counters/%s)"
                        % (k, r, k) for k in self.RXE for r in range(RAILS))
        out = {k: 0 for k in self.RXE}
        for line in self.g[n].run(cmd).splitlines():
            k, _, v = line.partition(" ")
            out[k] += int(v or 0)
        return out


# ---- scenarios ------------------------------------------------------------------------------------

def check_write_modes(c):
    """Rail 0 forced to WRITE + SEND on every daemon, rail 1 with immediate: every connection
    each daemon made or accepted since it started must show its rail's mode."""
    for n in range(NODES):
        text = c.daemon_log(n).split("--- start")[-1]
        for r, want, other in ((0, "RDMA WRITE + SEND", "RDMA WRITE WITH IMM"),
                               (1, "RDMA WRITE WITH IMM", "RDMA WRITE + SEND")):
            lines = [l for l in text.splitlines() if "verbs: rail %d: " % r in l and
                     (" connected to " in l or " accepted " in l)]
            good = [l for l in lines if "(" + want in l]
            if len(good) < NODES - 1 or any("(" + other in l for l in lines):
                raise RuntimeError("node %d rail %d: connections not all %s:\n%s"
                                   % (n, r, want, "\n".join(lines)))


def check_rails(c, seed, layers, steps, path, hidden=24, empty=True, tokens=0, first=0):
    """The daemons' per-rail record counters against the plan of the run."""
    counts = [phase_counts(seed, s, l, c.experts, hidden, empty, tokens)
              for s in range(first, first + steps) for l in range(layers)]
    balanced = path in ("rail-only", "joint", "auto")
    lo, hi, total = expected_records(counts, balanced)
    rows = []
    for n in range(NODES):
        got = c.rails(n)
        recs = [int(x["tx_records"]) for x in got]
        if sum(recs) != total[n] or any(not lo[n][r] <= recs[r] <= hi[n][r] for r in range(RAILS)):
            raise RuntimeError("node %d (%s): tx_records per rail %s, plan %s..%s (total %d)"
                               % (n, path, recs, lo[n], hi[n], total[n]))
        for x in got:
            if x["errors"]:
                raise RuntimeError("node %d rail %d: %d errors in a clean run" % (
                    n, x["rail"], x["errors"]))
        rows.append("n%d %s" % (n, "/".join("%d rec %d B" % (recs[r], got[r]["tx_bytes"])
                                             for r in range(RAILS))))
    return "; ".join(rows)


def memory_regions(c, n):
    """Memory regions registered on each rxe device of node n (the kernel's resource table)."""
    out = c.g[n].run("rdma resource show mr")
    return {d: sum(1 for l in out.splitlines() if l.startswith("dev %s " % d))
            for d in ("rxe%d" % r for r in range(RAILS))}, out


def scenario_paths(c, seed):
    """Every forced path and the selector: 3 daemons x 2 rails over verbs, 6 ranks, 3 layers x
    2 steps (fp32 and bf16 alternating, some empty phases), rows and sums checked by the ranks,
    per-rail records by the plan, write modes per rail, clean SIGTERM."""
    for i, path in enumerate(["native", "rail-only", "perm-only", "joint", "auto"]):
        c.start(path=path)
        try:
            c.wait_mesh()
            layers, steps = 3, 2
            mr0 = [memory_regions(c, n) for n in range(NODES)]
            c.run_ranks("g." + path, layers, steps, seed + i, flags=["--empty"])
            # Registration once per rail: the daemon's region plus one small MR of receive
            # slots per connection, the same before and after all those phases.
            for n in range(NODES):
                mr, text = memory_regions(c, n)
                if mr != mr0[n][0] or any(v != 1 + (NODES - 1) for v in mr.values()):
                    raise RuntimeError("node %d: memory regions %s before, %s after:\n%s"
                                       % (n, mr0[n][0], mr, text))
            sel = c.stats(0, "stats selector")
            if path != "auto" and "path=%s reason=forced" % path not in sel:
                raise RuntimeError("selector does not show the forced path %s:\n%s" % (path, sel))
            rails = check_rails(c, seed + i, layers, steps, path)
            check_write_modes(c)
        finally:
            c.stop()
        log("ok   path %-9s N=%d R=%d G=%d over verbs (%d): %s; MRs per rail %d" % (
            path, NODES, RAILS, GPUS, seed + i, rails, 1 + (NODES - 1)))


def transport(c, n):
    """The transport counters of daemon n's `stats rails`, summed over its rails."""
    keys = ("conn_failures", "retry_exceeded", "rnr_retry_exceeded", "remote_errors", "wc_errors",
            "write_again", "chunked_writes", "poll_yields", "errors")
    rails = c.rails(n)
    return {k: int(sum(x.get(k, 0) for x in rails)) for k in keys}, rails


def scenario_big(c, seed):
    """What the daemon needs of verbs beyond the conformance suite: rows of 16 KiB in slabs of
    hundreds of KiB on devices that take at most 64 KiB per message (RW_VERBS_MAX_MSG); nodes 0
    and 1 post 8 KiB writes (the executor's test hook), so that hundreds are in flight; node 0
    allows 4 writes in flight (its sends meet the bound: back-pressure), node 1 handles at most 2
    completions per connection before its loop runs again (RW_VERBS_POLL_BUDGET), node 2 only 2 (2
    receives posted per connection: its peers' notifications meet RNR NAKs now and then,
    retried, never a failure) and writes 192 KiB at a time (3 messages each: chunked). Joint
    path, exact checks."""
    c.configure(recv_region_mib=48)
    env = {"all": {"RW_VERBS_MAX_MSG": "65536", "RAILWAVE_TEST_CHUNK_KIB": "8"},
           0: {"RW_VERBS_MAX_WRITES": "4"}, 1: {"RW_VERBS_POLL_BUDGET": "2"},
           2: {"RW_VERBS_MAX_WRITES": "2", "RAILWAVE_TEST_CHUNK_KIB": "1024"}}
    rxe0 = {n: c.rxe_counters(n) for n in range(NODES)}
    c.start(path="joint", env=env)
    try:
        c.wait_mesh()
        layers, steps, hidden, tokens = 1, 1, 4096, 32
        c.run_ranks("g.big", layers, steps, seed, flags=["--hidden", str(hidden), "--tokens",
                                                         str(tokens)])
        try:
            rails = check_rails(c, seed, layers, steps, "joint", hidden=hidden, empty=False,
                                tokens=tokens)
        finally:
            rxe = {n: {k: v - rxe0[n][k] for k, v in c.rxe_counters(n).items()}
                   for n in range(NODES)}
            log("     rxe counters during the run: %s; switch: %s lost" % (rxe, c.switch.lost))
        t = {n: transport(c, n)[0] for n in range(NODES)}
        rnr = {n: rxe[n]["rcvd_rnr_err"] for n in range(NODES)}
    finally:
        c.stop()
    if t[2]["chunked_writes"] == 0:
        raise RuntimeError("node 2: no write was chunked: %s" % t[2])
    for n in range(NODES):
        if t[n]["conn_failures"] or t[n]["errors"]:
            raise RuntimeError("node %d: failures in a clean run: %s" % (n, t[n]))
    if t[0]["write_again"] == 0:
        raise RuntimeError("node 0 (4 writes in flight) never met the bound: %s" % t[0])
    if t[1]["poll_yields"] == 0:
        raise RuntimeError("node 1 (2 completions per poll) never yielded to its loop: %s" % t[1])
    if rnr[0] + rnr[1] == 0:
        raise RuntimeError("no RNR NAK reached nodes 0 and 1 (node 2 posts 2 receives)")
    log("ok   big rows over 64 KiB messages: node 2 chunked %d writes, node 0 met its send queue "
        "bound %d times, node 1's completion handling yielded to its loop %d times, nodes 0-2 "
        "got %s RNR NAKs from node 2, no failure: %s"
        % (t[2]["chunked_writes"], t[0]["write_again"], t[1]["poll_yields"],
           [rnr[n] for n in range(NODES)], rails))
    c.configure()


NO_DMABUF = "the NIC registers no dmabufs (ibv_reg_dmabuf_mr unsupported)"


def scenario_cuda(c, seed):
    """CUDA ranks (the stand-in driver, tests/integration/fake_cuda_ipc.c) next to host ranks:
    rxe has no dmabuf registration, so each daemon says so once and stages the GPU buffers
    through its registered host memory; every row and sum checked."""
    fake = "/usr/bin/libfakecuda_ipc.so"
    if c.g[0].run("[ -f %s ] && echo yes || echo no" % fake).strip() != "yes":
        log("skip cuda: the stand-in driver is not built")
        return
    env = {"RW_CUDA_DRIVER": fake}
    c.start(path="auto", env={"all": env})
    try:
        c.wait_mesh()
        cuda = [0, 1, 2, 5]
        procs = []
        for r in range(NODES * GPUS):
            procs += c.spawn_ranks("g.cuda", 2, 2, seed, env=env,
                                   flags=["--empty"] + (["--cuda"] if r in cuda else []), ranks=[r])
        outs = c.collect(procs)
        for r in cuda:
            if "(CUDA buffers)" not in outs[r]:
                raise RuntimeError("rank %d did not run with CUDA buffers: %s" % (r, outs[r]))
        rails = check_rails(c, seed, 2, 2, "auto")
        for n in range(NODES):  # the same reason in `stats` (docs/cuda.md "Where the slabs live")
            slabs = [l for l in c.stats(n).splitlines() if l.startswith("slabs ")]
            if slabs != ["slabs host, mapped into the GPUs (no GPUDirect: %s)" % NO_DMABUF]:
                raise RuntimeError("node %d: stats says %s about the slabs" % (n, slabs))
    finally:
        c.stop()
    for n in range(NODES):  # service/mesh/mesh_slabs.c: the placement and its reason, once per rail
        text = c.daemon_log(n).split("--- start")[-1]
        said = [l for l in text.splitlines() if "slabs in host memory" in l]
        logged = sorted(l.split("rail=", 1)[1].split(":", 1)[0] for l in said if "rail=" in l)
        if logged != [str(r) for r in range(RAILS)] or not all(NO_DMABUF in l for l in said):
            raise RuntimeError("node %d: host slabs for want of dmabuf support should be logged "
                               "once per rail: %s" % (n, said))
    log("ok   cuda ranks %s (stand-in driver) over verbs, dmabuf unsupported on rxe: logged once "
        "per rail, staged through host memory: %s" % (cuda, rails))


def wait_rx(c, nodes, rail=None):
    """Until rail data (of `rail`, or any) has arrived at one of `nodes`."""
    deadline = time.time() + WAIT
    while sum(x["rx_bytes"] for n in nodes for x in c.rails(n)
              if rail is None or x["rail"] == rail) == 0:
        if time.time() > deadline:
            raise RuntimeError("no rail data arrived\n" + c.logs())
        time.sleep(0.05)


# The executor's test hooks: 16 KiB writes, one per 50 ms per phase, so that a phase's ~2 MB of
# rows per node take seconds and a fault lands while every node still has writes to make.
SLOW = {"RAILWAVE_TEST_CHUNK_KIB": "16", "RAILWAVE_TEST_WRITE_GAP_MS": "50"}
FLIGHT = ["--hidden", "2048", "--tokens", "96"]


def scenario_peer_dies(c, seed):
    """A peer daemon is SIGKILLed while rail writes are in flight (the executor's hooks post
    16 KiB writes one per 50 ms): the survivors' ranks all get a named error long before the
    phase timeout, the survivors keep serving, their queue pairs to the dead node are torn down;
    the node restarts, the rails are connected again through rdmacm, and the failed key passes."""
    c.configure(recv_region_mib=48)
    c.start(path="native", env={"all": SLOW})
    victim = NODES - 1
    try:
        c.wait_mesh()
        procs = c.spawn_ranks("g.flight", 1, 1, seed, mode="fail", flags=FLIGHT)
        wait_rx(c, range(victim))
        t_kill = time.time()
        c.kill(victim)
        outs = c.collect([r for r in procs if r < victim * GPUS])
        took = time.time() - t_kill
        c.collect([r for r in procs if r >= victim * GPUS], want=None)  # lost their daemon
        errs = sorted({o.strip().split("failed as expected: ")[-1] for o in outs.values()})
        if took > 25:
            raise RuntimeError("survivors failed the phase only after %.1f s" % took)
        how = sorted({l.split("WARN ", 1)[1] for n in range(victim)
                      for l in c.daemon_log(n).split("--- start")[-1].splitlines()
                      if "WARN peer %d: down" % victim in l})
        c.start(nodes=[victim], path="native", env={"all": SLOW})
        c.wait_mesh()
        text = c.daemon_log(victim).split("--- start")[-1]
        qps = [l for l in text.splitlines() if "verbs: rail" in l and " accepted " in l]
        if len(qps) < RAILS * victim:
            raise RuntimeError("node %d after restart: rails not re-established through rdmacm:\n%s"
                               % (victim, "\n".join(qps)))
        c.run_ranks("g.flight", 2, 1, seed + 1, flags=["--first-step", "0"])
    finally:
        c.stop()
        c.configure()
    log("ok   peer daemon killed with rail writes in flight: survivors' ranks failed in %.1f s "
        "with %s (survivors: %s), %d queue pairs re-established through rdmacm, same key passed"
        % (took, errs, how, len(qps)))


def scenario_rank_dies(c, seed):
    """Rank 3 (node 1) connects and dies while every other rank is in the phase: every other
    rank's dispatch fails on every node; then the ranks move on to the next step and pass. (Not
    the same key at once: with 3 nodes that retry can time out on tcp too, an executor issue
    outside this test's scope; the 2-node integration test covers the same-key retry.)"""
    c.start(path="joint")
    try:
        c.wait_mesh()
        c.spawn_ranks("g.rank", 1, 1, seed, mode="idle", ranks=[3])
        c.g[1].run("i=0; until grep -q ready /tmp/rk3.log; do i=$((i+1)); [ $i -gt 600 ] && exit 1; "
                   "usleep 50000; done")
        procs = c.spawn_ranks("g.rank", 1, 1, seed, mode="fail", ranks=[0, 1, 2, 4, 5])
        time.sleep(0.5)
        c.g[1].run("kill -9 $(cat /tmp/rk3.pid)")
        outs = c.collect(procs)
        c.collect([3], want=137)
        errs = sorted({o.strip().split("failed as expected: ")[-1] for o in outs.values()})
        c.run_ranks("g.rank", 2, 1, seed + 1, flags=["--first-step", "1"])
    finally:
        c.stop()
    log("ok   rank killed mid-phase: the phase failed on every node (%s), the next step passed"
        % errs)


def scenario_cut(c, seed):
    """Rail 0 of node 2 is cut off by the switch while rail writes are in flight (the control
    link stays up): writes on it are never acknowledged, the queue pairs fail with retry
    exceeded, every rank's phase fails with a named error, the daemons keep serving; the cable
    goes back, the rail reconnects through rdmacm and the failed key passes."""
    c.configure(recv_region_mib=48)
    # Tries of 0.27 s instead of the CM's ~2 s: a dead rail fails writes in ~2 s, not ~17 s.
    c.start(path="native", env={"all": dict(SLOW, RW_VERBS_ACK_TIMEOUT="16")})
    try:
        c.wait_mesh()
        procs = c.spawn_ranks("g.cut", 1, 1, seed, mode="fail", flags=FLIGHT)
        wait_rx(c, [2], rail=0)  # a peer is writing to node 2 on rail 0: cut that now
        t_cut = time.time()
        c.switch.cut("rail0", 2)
        outs = c.collect(procs)
        took = time.time() - t_cut
        errs = sorted({o.strip().split("failed as expected: ")[-1] for o in outs.values()})
        t = {n: transport(c, n)[0] for n in range(NODES)}
        c.switch.cut("rail0", 2, on=False)
        if sum(t[n]["retry_exceeded"] for n in range(NODES)) == 0:
            raise RuntimeError("no write failed with retry exceeded: %s\n%s" % (t, c.logs()))
        # The failures per rail in Prometheus too (railwave_rail_errors_total, published every
        # 250 ms): rail 0 of a node whose writes were never acknowledged.
        n = [n for n in range(NODES) if t[n]["retry_exceeded"]][0]
        prom = c.g[n].run("sleep 1; wget -qO- http://127.0.0.1:9100/metrics | "
                          "grep '^railwave_rail_errors_total'")
        if 'railwave_rail_errors_total{rail="0"} 0' in prom or 'rail="0"' not in prom:
            raise RuntimeError("node %d: rail 0's failure is not in Prometheus:\n%s" % (n, prom))
        c.wait_mesh()
        c.run_ranks("g.cut", 2, 1, seed + 1, flags=["--first-step", "0"])
    finally:
        c.switch.cut("rail0", 2, on=False)
        c.stop()
        c.configure()
    log("ok   rail 0 of node 2 cut mid-phase: every rank failed in %.1f s with %s; retry exceeded "
        "%s, connection failures %s; node %d: %s; reconnected, same key passed"
        % (took, errs, [t[n]["retry_exceeded"] for n in range(NODES)],
           [t[n]["conn_failures"] for n in range(NODES)], n, " ".join(prom.split())))


def links_up(c, n):
    """{"PEER/RAIL": state} of daemon n's `stats rails` link lines."""
    return {w.split("=", 1)[1]: line.split("state=", 1)[1].split()[0]
            for line in c.stats(n, "stats rails").splitlines() if line.startswith("link=")
            for w in line.split()[:1]}


def stat(c, n, key):
    return int([l for l in c.stats(n).splitlines() if l.startswith(key + " ")][0].split()[1])


def scenario_join(c, seed):
    """Rail 1 of node 2 is cut off by the switch before the daemons start (a NIC dead at start:
    rdmacm cannot reach node 2 on rail 1): node 2 and its peers come up on rail 0 after
    heartbeat_timeout_ms instead of waiting for every rail, both ends say which rail is missing,
    every phase runs exactly without it; the cable goes back, rail 1 connects through rdmacm and
    the next phases use it again."""
    c.switch.cut("rail1", 2)
    try:
        c.start(path="joint")
        t0 = time.time()
        c.wait_mesh()
        took = time.time() - t0
        for n in range(NODES):
            text = c.daemon_log(n).split("--- start")[-1]
            want = 2 if n == 2 else 1  # node 2 misses rail 1 to both peers
            said = [l for l in text.splitlines() if "up on 1 of 2 rails: rail(s) 1 did not" in l]
            if len(said) != want or links_up(c, n)["n2/1" if n != 2 else "n0/1"] != "down":
                raise RuntimeError("node %d: %s, links %s\n%s" % (n, said, links_up(c, n), c.logs()))
        c.run_ranks("g.join", 2, 1, seed, flags=["--empty"])
        excluded = [stat(c, n, "phases_rail_excluded") for n in range(NODES)]
        if min(excluded) == 0:
            raise RuntimeError("a node planned with the missing rail: %s" % excluded)
        c.switch.cut("rail1", 2, on=False)
        deadline = time.time() + WAIT
        while any(s != "up" for n in range(NODES) for s in links_up(c, n).values()):
            if time.time() > deadline:
                raise RuntimeError("rail 1 of node 2 never joined\n%s" % c.logs())
            time.sleep(0.3)
        c.run_ranks("g.join", 2, 1, seed + 1, flags=["--first-step", "10"])
        after = [stat(c, n, "phases_rail_excluded") for n in range(NODES)]
        if after != excluded:
            raise RuntimeError("phases without rail 1 after it joined: %s -> %s" % (excluded, after))
    finally:
        c.switch.cut("rail1", 2, on=False)
        c.stop()
    log("ok   rail 1 of node 2 cut before the start: the mesh came up on rail 0 in %.1f s, %s "
        "phases planned without rail 1 per node, exact; the cable back, rail 1 joined through "
        "rdmacm and was used" % (took, excluded))


def scenario_carve(c, seed):
    """Groups on carve-outs of their own over verbs (docs/rankpath.md "The slab areas, lent per
    group"): with group_area_mib each group's pairs run in a memfd per rail that the daemon
    registered with the rxe device (one more MR per rail while the group lives, deregistered
    when it ends) and announced to the peers (CARVE: their writes carry its rkey); each rank maps
    its group's slab of every rail (and registers it with the CUDA stand-in where the guest has
    it) and finds every row the NIC brought from another node in it, byte for byte."""
    fake = "/usr/bin/libfakecuda_ipc.so"
    has_fake = c.g[0].run("[ -f %s ] && echo yes || echo no" % fake).strip() == "yes"
    env = {"RW_CUDA_DRIVER": fake} if has_fake else None
    c.configure(group_area_mib=2, group_pool_mib=4)
    c.start(path="auto")
    try:
        c.wait_mesh()
        base = [memory_regions(c, n)[0] for n in range(NODES)]
        flags = ["--empty"] + (["--slabs", str(RAILS)] if has_fake else [])
        ranks = c.spawn_ranks("g.carve", 2, 2, seed, env=env, flags=flags)
        outs = c.collect(ranks)
        if has_fake:
            for r in ranks:
                if "remote rows seen in the group's slabs" not in outs[r]:
                    raise RuntimeError("rank %d did not check its slabs: %s" % (r, outs[r]))
        rails = check_rails(c, seed, 2, 2, "auto")
        deadline = time.time() + WAIT
        while [memory_regions(c, n)[0] for n in range(NODES)] != base:  # the group's MRs go
            if time.time() > deadline:
                raise RuntimeError("carve-out MRs not deregistered: %s, before %s" % (
                    [memory_regions(c, n)[0] for n in range(NODES)], base))
            time.sleep(0.3)
    finally:
        c.stop()
        c.configure()
    log("ok   carve-outs over verbs: every rank's group on a registered carve-out, %s; their MRs "
        "gone with the group: %s" % ("each rank found its remote rows in its slabs" if has_fake
                                     else "the stand-in driver is not built: slabs not mapped",
                                     rails))


SCENARIOS = [("paths", scenario_paths), ("big", scenario_big), ("cuda", scenario_cuda),
             ("peer", scenario_peer_dies), ("rank", scenario_rank_dies), ("cut", scenario_cut),
             ("join", scenario_join), ("carve", scenario_carve)]


def main():
    b = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
    bins = [os.path.join(b, p) for p in ("railwaved", "tests/integration/rw_rank", "tools/railwave")]
    missing = [p for p in bins if not os.access(p, os.X_OK)]
    if missing:
        log("cluster: SKIP: not built: %s" % " ".join(missing))
        return 77
    if not os.path.exists("/etc/os-release") or not shutil.which("qemu-system-x86_64"):
        log("cluster: SKIP: qemu-system-x86_64 missing (apt-get install qemu-system-x86)")
        return 77
    fake = os.path.join(b, "tests", "integration", "libfakecuda_ipc.so")
    if os.path.exists(fake):
        bins.append(fake)
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or random.randrange(1, 1 << 30)
    log("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    only = [s for s in os.environ.get("RW_VM_CLUSTER_ONLY", "").split(",") if s]
    t0 = time.time()
    work = tempfile.mkdtemp(prefix="rwvmc.", dir=os.environ.get("TMPDIR", "/tmp"))
    guests, switch, rc = [], None, 1
    try:
        image = os.path.join(work, "image")
        argv = ["sh", os.path.join(HERE, "railvm.sh"), "-I", image]
        for p in bins:
            argv += ["-b", p]
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        text = p.stdout.decode(errors="replace").strip()
        if p.returncode == 77:
            log("cluster: " + text)
            return 77
        if p.returncode != 0:
            log("cluster: cannot build the guests' image:\n" + text)
            return 1
        accel = (["-accel", "kvm"] if os.environ.get("RW_VM_ACCEL") == "kvm"
                 else ["-accel", "tcg,thread=multi"])
        switch = Switch(NODES)
        switch.start()
        guests = [Guest(n, work, image, switch, accel) for n in range(NODES)]
        deadline = time.time() + BOOT_WAIT
        try:
            for g in guests:
                g.connect(deadline)
            for g in guests:
                g.wait_ready(deadline)
        except RuntimeError as e:
            log("FAIL boot: %s" % e)
            for g in guests:
                with open(os.path.join(work, "qemu%d.log" % g.n)) as f:
                    log("".join("  qemu%d| %s" % (g.n, l) for l in f.readlines()[-10:]))
            return 1
        with open(os.path.join(image, "package")) as f:
            pkg = f.read().strip()
        log("cluster: %d guests up (%s, %s) in %.0f s" % (NODES, pkg, accel[1].split(",")[0],
                                                          time.time() - t0))
        c = Cluster(guests, switch)
        c.configure()
        for name, fn in SCENARIOS:
            if only and name not in only:
                continue
            t1 = time.time()
            try:
                fn(c, seed)
            except Exception as e:  # report and fail
                log("FAIL %s: %s" % (name, e))
                return 1
            finally:
                if c.running:
                    try:
                        c.stop()
                    except Exception as e:  # already failing, or a daemon that died badly
                        log("FAIL %s: %s" % (name, e))
                        return 1
            log("     (%s: %.0f s)" % (name, time.time() - t1))
        rc = 0
        return 0
    finally:
        keep = os.environ.get("RW_VM_KEEP")
        for g in guests:
            if keep:
                try:
                    g.run("cat /tmp/d.log >/dev/ttyS1", timeout=20, check=False)
                except (RuntimeError, OSError):
                    pass
            g.poweroff()
        if switch:
            switch.stop()
        if keep:
            os.makedirs(keep, exist_ok=True)
            for f in os.listdir(work):
                if f.startswith(("guest", "qemu")):
                    shutil.copy(os.path.join(work, f), keep)
        if rc != 0:
            for g in guests:
                print(g.tail(15))
        shutil.rmtree(work, ignore_errors=True)
        log("cluster: %.0f s in all" % (time.time() - t0))


if __name__ == "__main__":
    # SIGTERM (a CI job cancelled, timeout(1)) unwinds like ^C: the guests are powered off or
    # killed and the work directory removed by main's finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
