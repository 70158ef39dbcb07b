#!/usr/bin/env python3
"""Peer authentication against real daemons on loopback (docs/security.md "Peer
authentication"). A two-node cluster (node n0 connects to the victim n1)
shares a key from `railwave keygen`; n0 reaches n1's control port through a relay here, which
records n0's real HELLO and AUTH. Rank processes (tests/integration/rw_rank) carry verified
dispatch/combine phases the whole time, in rounds; every round must pass.

1. keygen writes a 0600 file of 64 hex digits and will not overwrite it; a daemon refuses a key
   file that others may read (a clear error, exit != 0) and a file that is not a key; a daemon
   without a key says AUTH NONE once and `stats` says `auth none`, with one `auth key`.
2. Strangers with the cluster file cannot join n1: the recorded HELLO and AUTH replayed, a fresh
   HELLO with a random or wrong-key proof, a hello of wire version 4, a railwaved with no key
   and one with another key. None of them gets a REGIONS frame (no region key, no rail
   address); n1 keeps n0 up with no error, and phases keep passing. A client that does hold the
   key is taken (the positive control of this model of the protocol) - that comes last.
3. Strangers cannot break a live tcp rail link or have a byte accepted: rail HELLOs with no, a
   random or an old-version proof, and WRITE frames with and without a HELLO, to every rail of
   n1: each connection is closed without a single byte back (no HELLO_ACK, no ACK). n0's own
   rail handshake of the live session (recomputed with the key from the recorded control
   handshake: the dial number it used) replayed: refused; the same proof with a fresh dial
   number is answered (positive control, at the end: it takes the rail over).
4. Unauthenticated connections cannot exhaust n1 (measured while no phase runs; phases run
   again afterwards): 300 half-open handshakes (a HELLO, then silence) and 300 silent rail
   connections cost under 8 MiB of RSS and 0.5 CPU s over 2 s; at
   most 64 wait per listener; the control ones are closed after heartbeat_timeout_ms (3 s); 500 failed
   handshakes in a row cost a bounded CPU time each and at most one log line a second.
Bounds are resource budgets, not timings of a feature. Run by tests/run as $b/test/svc_auth;
exits 0 pass, 1 fail, 77 skip."""
import hashlib
import hmac
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAILWAVE = os.path.join(B, "tools", "railwave")
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)
FAILS = []
HB_TIMEOUT_S = 3.0  # heartbeat_timeout_ms: also how long a handshake may take


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)


define = cluster.define


WIRE_MAGIC, WIRE_VERSION = 0x434D5752, define("service/phase/wire.h", "RW_WIRE_VERSION")
HELLO, AUTH, REGIONS = 1, 7, 8
TCP_MAGIC, TCP_VERSION = 0x43545752, define("rdma/tcp_wire.h", "RW_TCP_VERSION")


def frame(typ, payload, version=WIRE_VERSION):
    return struct.pack("<IHHII", WIRE_MAGIC, version, typ, len(payload), 1) + payload


def frames(data):
    """(type, payload) of every whole frame in data."""
    out, off = [], 0
    while off + 16 <= len(data):
        _, _, typ, length, _ = struct.unpack_from("<IHHII", data, off)
        if off + 16 + length > len(data):
            break
        out.append((typ, data[off + 16:off + 16 + length]))
        off += 16 + length
    return out


def read_all(s, within=5.0):
    """Everything s receives until the peer closes it (or `within` s pass: then None)."""
    s.settimeout(within)
    data, end = b"", time.time() + within
    try:
        while time.time() < end:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk
    except ConnectionResetError:
        return data
    except socket.timeout:
        pass
    return None


def mac(key, msg):
    """libsodium's crypto_auth: HMAC-SHA512 truncated to 32 bytes."""
    return hmac.new(key, msg, hashlib.sha512).digest()[:32]


def proof(key, role, connector, acceptor, fp, nonce_c, nonce_a):
    """service/mesh/mesh_auth.c's proof: label | role | connector | acceptor | fingerprint | nonces."""
    msg = b"railwave-auth-5".ljust(16, b"\0") + struct.pack("<IIIQ", role, connector, acceptor, fp)
    return mac(key, msg + nonce_c + nonce_a)


def rail_proof(session, rail, dial):
    """service/mesh/mesh_auth.c's rail proof (connector): MAC(session, label | role 1 | rail | dial)
    truncated to 24 bytes, then the dial number."""
    msg = b"railwave-rail-5".ljust(16, b"\0") + struct.pack("<IIQ", 1, rail, dial)
    return mac(session, msg)[:24] + struct.pack("<Q", dial)


def hello_with_nonce(hello_payload, nonce):
    return hello_payload[:-32] + nonce


def open_handshake(addr, hello_payload):
    """Connect, send a hello with a fresh nonce, read the victim's first two frames (its HELLO
    and AUTH). Returns (socket, nonce, bytes read, frames)."""
    nonce = os.urandom(32)
    s = socket.create_connection(addr, timeout=5)
    s.sendall(frame(HELLO, hello_with_nonce(hello_payload, nonce)))
    data, got = b"", []
    while len(got) < 2:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        got = frames(data)
    return s, nonce, data, got


def stranger_handshake(addr, hello_payload, make_proof):
    """Send a hello (fresh nonce) and then make_proof(victim's hello) as AUTH; returns the
    frame types the victim sent before it closed the connection (None: it did not close)."""
    s, nonce, data, got = open_handshake(addr, hello_payload)
    if len(got) == 2 and got[0][0] == HELLO:
        s.sendall(frame(AUTH, make_proof(nonce, got[0][1])))
    rest = read_all(s)
    s.close()
    if rest is None:
        return None
    return [t for t, _ in frames(data + rest)]


class Relay:
    """n0's way to n1's control port: records what n0 sends on its first connection."""

    def __init__(self, ip, target):
        self.target, self.sent, self.back = target, b"", b""
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind((ip, 0))
        self.lsock.listen(8)
        self.addr = self.lsock.getsockname()
        self.first = True
        threading.Thread(target=self.accept_loop, daemon=True).start()

    def accept_loop(self):
        while True:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target)
            except OSError:  # n1 not listening yet: n0 tries again
                a.close()
                continue
            record, self.first = self.first, False
            threading.Thread(target=self.pipe, args=(a, b, "sent" if record else None),
                             daemon=True).start()
            threading.Thread(target=self.pipe, args=(b, a, "back" if record else None),
                             daemon=True).start()

    def pipe(self, src, dst, record):
        """Copy src to dst; `record` names the attribute that keeps the bytes (first session)."""
        try:
            while True:
                d = src.recv(65536)
                if not d:
                    break
                if record:
                    setattr(self, record, getattr(self, record) + d)
                dst.sendall(d)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Rounds:
    """Verified phases in rounds, in the background, until stopped."""

    def __init__(self, c, group):
        self.c, self.group, self.ok, self.errors = c, group, 0, []
        self.stop_flag = False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        k = 0
        while not self.stop_flag:
            try:
                self.c.run_ranks(self.group, layers=2, steps=2, seed=7,
                                 flags=["--first-step", str(k * 2)])
                self.ok += 1
            except Exception as e:  # a failed round is the finding
                self.errors.append(str(e)[:2000])
                return
            k += 1

    def stop(self):
        self.stop_flag = True
        self.t.join(120)
        return self.ok, self.errors


def keygen(path, *extra):
    return subprocess.run([RAILWAVE, "keygen"] + list(extra) + [path], capture_output=True,
                          text=True)


def start_alone(tmp, name, extra, nodes_from=None, wait=8.0):
    """A daemon of a cluster file like the test cluster's; returns (Popen, log path)."""
    cfg = json.loads(json.dumps(nodes_from))
    cfg.update(extra)
    cfg["nodes"][0]["ipc_socket"] = os.path.join(tmp, name + ".sock")
    cfg["nodes"][0]["stats_socket"] = os.path.join(tmp, name + ".stats")
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    log = os.path.join(tmp, name + ".log")
    p = subprocess.Popen([cluster.DAEMON, "--config", path, "--node", "0"], stdout=open(log, "w"),
                         stderr=subprocess.STDOUT)
    return p, log


def text(path):
    with open(path) as f:
        return f.read()


def part_keys(tmp):
    """1. keygen and key files."""
    key = os.path.join(tmp, "cluster.key")
    r = keygen(key)
    mode = os.stat(key).st_mode & 0o777
    body = text(key)
    check(r.returncode == 0 and mode == 0o600 and len(body) == 65 and body.endswith("\n") and
          all(ch in "0123456789abcdef" for ch in body[:64]),
          "keygen wrote a 0600 file of 64 hex digits (mode %o, %d bytes)" % (mode, len(body)))
    r2 = keygen(key)
    check(r2.returncode != 0 and text(key) == body and "--force" in r2.stderr,
          "keygen keeps an existing key file (%s)" % r2.stderr.strip())
    r3 = subprocess.run([RAILWAVE, "keygen"], capture_output=True, text=True)
    check(r3.returncode == 0 and len(r3.stdout.strip()) == 64 and r3.stdout != body,
          "keygen without a path prints a new key")
    return key


def part_bad_key_files(tmp, cfg):
    loose = os.path.join(tmp, "loose.key")
    keygen(loose)
    os.chmod(loose, 0o640)
    junk = os.path.join(tmp, "junk.key")
    with open(junk, "w") as f:
        f.write("not a key\n")
    os.chmod(junk, 0o600)
    for name, path, want in [("loose", loose, "chmod 600"), ("junk", junk, "does not hold one key"),
                             ("missing", os.path.join(tmp, "nope.key"), "cannot open key file")]:
        p, log = start_alone(tmp, "bad-" + name, {"key_file": path}, cfg)
        try:
            rc = p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "still running"
        check(rc not in (0, "still running") and want in text(log) and path in text(log),
              "a daemon with a %s key file refuses to start (exit %s): %s" % (
                  name, rc, [l for l in text(log).splitlines() if want in l][:1]))


def part_strangers(tmp, c, relay, key, hello0, auth0, victim):
    """2. Strangers on n1's control port."""
    fp = struct.unpack_from("<Q", hello0, 64 + 16)[0]
    types = stranger_handshake(victim, hello0, lambda n, h: os.urandom(32))
    check(types is not None and REGIONS not in types,
          "a hello with a random proof: closed, no REGIONS (got frame types %s)" % types)
    wrong = os.urandom(32)
    types = stranger_handshake(victim, hello0, lambda n, h: proof(wrong, 1, 0, 1, fp, n, h[-32:]))
    check(types is not None and REGIONS not in types,
          "a hello with a proof under another key: closed, no REGIONS (got %s)" % types)
    # The recorded hello and proof of n0's real session, replayed as they were.
    s = socket.create_connection(victim, timeout=5)
    s.sendall(frame(HELLO, hello0) + frame(AUTH, auth0))
    rest = read_all(s)
    s.close()
    types = None if rest is None else [t for t, _ in frames(rest)]
    check(types is not None and REGIONS not in types,
          "n0's recorded hello and proof replayed: closed, no REGIONS (got %s)" % types)
    time.sleep(1.1)  # the refusal log is once a second: the next line is this one's
    s = socket.create_connection(victim, timeout=5)
    s.sendall(struct.pack("<IHHII", WIRE_MAGIC, 4, HELLO, 2000, 1) + bytes(64))
    rest = read_all(s)
    s.close()
    time.sleep(0.2)
    check(rest == b"" and "speaks wire version 4" in text(os.path.join(tmp, "d1.log")),
          "a wire-version-4 hello: closed, logged as 'speaks wire version 4'")
    # Real daemons with the cluster file: one with no key, one with another key.
    other = os.path.join(tmp, "other.key")
    keygen(other)
    for name, extra in [("nokey", {"key_file": ""}), ("otherkey", {"key_file": other})]:
        cfg = json.loads(json.dumps(c.cfg))
        cfg["nodes"][0]["control"] = "127.0.0.9:%d" % cluster.free_port("127.0.0.9")
        for r, rail in enumerate(cfg["nodes"][0]["rails"]):
            rail["address"] = "127.0.%d.9" % r
            rail["port"] = cluster.free_port(rail["address"])
        p, log = start_alone(tmp, name, extra, cfg)
        time.sleep(2.5)
        p.terminate()
        p.wait(20)
        lines = text(log)
        if name == "nokey":
            check(lines.count("AUTH NONE") == 1,
                  "a daemon without key_file says AUTH NONE once at start")
        check("peer=n1: down" in lines and "peer=n1: up" not in lines,
              "a railwaved with %s claiming n0 was refused: %s" % (
                  name, [l.split("down ", 1)[-1] for l in lines.splitlines() if "peer=n1: down" in l][:1]))


def rail_attack(addr, payload):
    """Bytes the rail listener sent back before closing (None: it kept the connection)."""
    s = socket.create_connection(addr, timeout=5)
    try:
        s.sendall(payload)
    except OSError:
        pass
    rest = read_all(s, 12.0)
    s.close()
    return rest


def tcp_hdr(typ, key=0, offset=0, length=0, seq=0, proof=bytes(32), version=TCP_VERSION):
    head = struct.pack("<IBBHII", TCP_MAGIC, version, typ, 0, 0, 0) + struct.pack("<QQ", key, offset)
    if typ in (1, 2) and version == TCP_VERSION:
        return head + proof
    return head + struct.pack("<QQ", length, seq) + bytes(16)


def part_rails(c):
    """3. Strangers on n1's rail ports."""
    for r, rail in enumerate(c.cfg["nodes"][1]["rails"]):
        addr = (rail["address"], rail["port"])
        write = tcp_hdr(3, key=(1 << 32) | 1, offset=0, length=64, seq=1) + b"\xee" * 64
        cases = [("no proof", tcp_hdr(1, key=0, offset=r) + write),
                 ("a random proof", tcp_hdr(1, key=0, offset=r, proof=os.urandom(32)) + write),
                 ("version 1", tcp_hdr(1, key=0, offset=r, version=1) + write),
                 ("no hello", write)]
        for what, payload in cases:
            back = rail_attack(addr, payload)
            check(back == b"", "rail %d: a stranger's HELLO with %s and a WRITE: closed, "
                  "nothing acknowledged (%s bytes back)" % (r, what,
                                                            "no" if back is None else len(back)))


def part_rail_replay(c, relay, key):
    """3b. A rail handshake of the live session cannot be replayed. n0 dialed each rail of n1
    once (dial 1); the test holds the key, so it computes that very proof from the session the
    relay saw and sends it again: refused. A member's fresh dial number would be taken (the
    positive control, last in main)."""
    sent, back = frames(relay.sent), frames(relay.back)
    hello_c = [p for t, p in sent if t == HELLO][0]
    hello_a = [p for t, p in back if t == HELLO][0]
    fp = struct.unpack_from("<Q", hello_c, 64 + 16)[0]
    k = bytes.fromhex(open(key).read().strip())
    session = mac(k, b"railwave-sess-5".ljust(16, b"\0") + struct.pack("<IIIQ", 0, 0, 1, fp) +
                  hello_c[-32:] + hello_a[-32:])
    for r, rail in enumerate(c.cfg["nodes"][1]["rails"]):
        addr = (rail["address"], rail["port"])
        back_bytes = rail_attack(addr, tcp_hdr(1, key=0, offset=r, proof=rail_proof(session, r, 1)))
        check(back_bytes == b"", "rail %d: n0's own rail handshake of the live session, replayed "
              "(dial 1, a valid proof): closed, no HELLO_ACK (%s bytes back)"
              % (r, "no" if back_bytes is None else len(back_bytes)))
    return session


def part_rail_fresh_dial(c, session):
    """Positive control for 3b: with the session key and a dial number never used, the same
    handshake is answered (HELLO_ACK): what refused the replay was the dial number."""
    rail = c.cfg["nodes"][1]["rails"][0]
    s = socket.create_connection((rail["address"], rail["port"]), timeout=5)
    s.sendall(tcp_hdr(1, key=0, offset=0, proof=rail_proof(session, 0, 1 << 40)))
    s.settimeout(5)
    data = b""
    try:
        while len(data) < 64:
            chunk = s.recv(64 - len(data))
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        pass
    s.close()
    check(len(data) == 64 and data[5] == 2, "rail 0: the session's proof with a fresh dial "
          "number is answered with HELLO_ACK (%d bytes)" % len(data))


STRANGER = "127.0.0.9"  # no node's control or rail address: a stranger's budget applies


def hold(addr, payload, n):
    """n connections from a stranger's address, each sent payload and kept open."""
    out = []
    for _ in range(n):
        try:
            s = socket.create_connection(addr, timeout=5, source_address=(STRANGER, 0))
            if payload:
                s.sendall(payload)
            out.append(s)
        except OSError:
            break
    return out


def closed_now(s):
    """The peer closed s (whatever it had sent before is read and dropped)."""
    s.setblocking(False)
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def part_exhaustion(c, victim, hello0, pid):
    """4. Budgets of unauthenticated connections."""
    rss0, cpu0, t0 = cluster.rss_kib(pid), cluster.cpu_seconds(pid), time.time()
    ctl = hold(victim, frame(HELLO, hello_with_nonce(hello0, os.urandom(32))), 300)
    # The deadline runs from each accept: the burst overflows the listen backlog and a
    # connect that waits for a SYN retry is accepted up to seconds later, so the closing
    # below is timed from the last connect, not from the first.
    t_last = time.time()
    time.sleep(0.2)
    open_ctl = sum(not closed_now(s) for s in ctl)
    if open_ctl == 0:
        # The burst outlasted the half-open deadline (a loaded machine: each backlog overflow
        # costs a SYN retry), so every one it left waiting has been closed by now: a fresh
        # handful shows the listener still takes strangers up to its budget.
        ctl += hold(victim, frame(HELLO, hello_with_nonce(hello0, os.urandom(32))), 8)
        t_last = time.time()
        time.sleep(0.2)
        open_ctl = sum(not closed_now(s) for s in ctl)
    r0 = c.cfg["nodes"][1]["rails"][0]
    rails = hold((r0["address"], r0["port"]), b"", 300)
    time.sleep(0.2)
    open_rail = sum(not closed_now(s) for s in rails)
    if open_rail == 0:  # likewise
        rails += hold((r0["address"], r0["port"]), b"", 8)
        t_last = time.time()
        time.sleep(0.2)
        open_rail = sum(not closed_now(s) for s in rails)
    check(0 < open_ctl <= 64 and 0 < open_rail <= 64,
          "at most 64 wait per listener (%.1f s in: control %d, rail %d of 300 open)" % (
              time.time() - t0, open_ctl, open_rail))
    time.sleep(max(0.0, 2.0 - (time.time() - t0)))
    rss1, cpu1 = cluster.rss_kib(pid), cluster.cpu_seconds(pid)
    check(rss1 - rss0 < 8192 and cpu1 - cpu0 < 0.5,
          "%d half-open handshakes and %d silent rail connections: RSS +%d KiB, %.2f CPU s in 2 s"
          % (len(ctl), len(rails), rss1 - rss0, cpu1 - cpu0))
    time.sleep(max(0.0, HB_TIMEOUT_S + 1.0 - (time.time() - t_last)))  # and a heartbeat
    open_ctl = sum(not closed_now(s) for s in ctl)
    check(open_ctl == 0, "the half-open handshakes are closed after heartbeat_timeout_ms "
          "(%d still open)" % open_ctl)
    for s in ctl + rails:
        s.close()
    log = os.path.join(c.tmp, "d1.log")
    before = text(log).count("unauthenticated connection(s)")
    cpu0, t0, n, answered = cluster.cpu_seconds(pid), time.time(), 500, 0
    for _ in range(n):
        s = socket.create_connection(victim, timeout=5)
        s.sendall(frame(HELLO, hello_with_nonce(hello0, os.urandom(32))) + frame(AUTH, os.urandom(32)))
        back = read_all(s)
        answered += back is not None and [t for t, _ in frames(back)] == [HELLO, AUTH]
        s.close()
    elapsed, cpu = time.time() - t0, cluster.cpu_seconds(pid) - cpu0
    lines = text(log).count("unauthenticated connection(s)") - before
    check(answered == n and cpu / n < 0.002 and lines <= elapsed + 2,
          "%d failed handshakes (%d went as far as the proof) in %.1f s: %.0f us CPU each, "
          "%d log lines" % (n, answered, elapsed, 1e6 * cpu / n, lines))


def part_positive_control(victim, key, hello0):
    """A client that holds the key is taken: the model of the protocol above is right."""
    fp = struct.unpack_from("<Q", hello0, 64 + 16)[0]
    k = bytes.fromhex(open(key).read().strip())
    s, nonce, data, got = open_handshake(victim, hello0)
    ok = len(got) == 2 and got[1][1] == proof(k, 2, 0, 1, fp, nonce, got[0][1][-32:])
    s.sendall(frame(AUTH, proof(k, 1, 0, 1, fp, nonce, got[0][1][-32:])))
    s.settimeout(5)
    try:
        while REGIONS not in [t for t, _ in frames(data)]:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        pass
    s.close()
    check(ok and REGIONS in [t for t, _ in frames(data)],
          "with the key, the same handshake is taken (acceptor proof checked, REGIONS sent)")


def main():
    for f in ("railwaved", os.path.join("tools", "railwave"),
              os.path.join("tests", "integration", "rw_rank")):
        if not os.access(os.path.join(B, f), os.X_OK):
            print("skip: %s not built" % f)
            return 77
    with tempfile.TemporaryDirectory(prefix="rwauth.", dir="/tmp") as tmp:
        key = part_keys(tmp)
        c = cluster.Cluster(tmp, 2, extra={"key_file": key, "heartbeat_timeout_ms": int(HB_TIMEOUT_S * 1000)})
        part_bad_key_files(tmp, c.cfg)
        n1 = c.cfg["nodes"][1]["control"].split(":")
        victim = (n1[0], int(n1[1]))
        relay = Relay("127.0.0.7", victim)
        cfg0 = json.loads(json.dumps(c.cfg))
        cfg0["nodes"][1]["control"] = "%s:%d" % relay.addr
        path0 = os.path.join(tmp, "n0.json")
        with open(path0, "w") as f:
            json.dump(cfg0, f)
        rounds = None
        try:
            c.start(1)
            main_path, c.cfg_path = c.cfg_path, path0
            c.start(0)
            c.cfg_path = main_path
            c.wait_mesh()
            st = c.stats(1, "stats")
            check("auth key" in st, "stats says 'auth key' with a key file")
            got = frames(relay.sent)
            hello0 = [p for t, p in got if t == HELLO][0]
            auth0 = [p for t, p in got if t == AUTH][0]
            rounds = Rounds(c, "g.auth")
            part_strangers(tmp, c, relay, key, hello0, auth0, victim)
            part_rails(c)
            session = part_rail_replay(c, relay, key)
            ok, errors = rounds.stop()
            # The budgets are measured on a daemon that does nothing else meanwhile; phases
            # run again afterwards.
            part_exhaustion(c, victim, hello0, c.procs[1].pid)
            rounds = Rounds(c, "g.auth2")
            time.sleep(2.0)
            ok2, errors2 = rounds.stop()
            rounds = None
            ok, errors = ok + ok2, errors + errors2
            peers = c.stats(1, "stats peers")
            check(not errors and ok >= 3, "verified phases all along: %d rounds passed, %d failed%s"
                  % (ok, len(errors), (": " + errors[0]) if errors else ""))
            line = [l for l in peers.splitlines() if l.startswith("peer=0 ")][0]
            check("state=up" in line and "reconnects=0" in line and "errors=0" in line,
                  "n1 kept n0 up the whole time: %s" % line)
            part_rail_fresh_dial(c, session)  # before the next: it takes n0's session over
            part_positive_control(victim, key, hello0)
        finally:
            if rounds:
                rounds.stop()
            c.stop()
    if FAILS:
        print("%d check(s) failed" % len(FAILS))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
