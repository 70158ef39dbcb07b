#!/usr/bin/env python3
"""A stranger cannot keep a restarted node out of the mesh (docs/security.md "Peer
authentication"). Two real daemons on loopback with a cluster key. A stranger process with no
key (tests/service/test_flood.py --attack, from 127.0.0.9) keeps n1's waiting slots full: it holds
silent connections to n1's control port and to each of its tcp rail ports and reopens every one
the moment n1 closes it (at accept when the strangers' budget is full, or at the handshake
deadline). While it does, n0 is killed and started again: n0 must join n1 again on its control
channel and every rail, and verified phases must pass, all while the refill goes on (the
stranger's connect count keeps growing). Then the stranger is stopped and both daemons exit 0.

Before a configured node's address had its own waiting room, n0's connections were closed at
accept like any stranger's and it stayed out for as long as the flood lasted.
Run by tests/run as $b/test/svc_flood; exits 0 pass, 1 fail, 77 skip."""
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

STRANGER = "127.0.0.9"  # no node of the cluster has this address
HOLD = 128              # connections the stranger keeps open or opening per target
RATE = 200              # at most this many (re)connects per second per target
FLOOD_S = 25.0          # how long the join may take while the flood goes on (a bound, not a timing)
FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)


def attack(targets):
    """The stranger: keep HOLD silent connections to every target, reopen each one closed.
    Prints 'connects N refused M' every 0.2 s until SIGTERM; refused counts connections closed
    within 0.2 s of their connect (closed at accept: the strangers' budget was full)."""
    sel = selectors.DefaultSelector()
    live = {t: 0 for t in targets}
    budget = {t: 0.0 for t in targets}
    connects, refused, stop = 0, 0, []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    last, report = time.time(), 0.0
    while not stop:
        now = time.time()
        for t in targets:
            budget[t] = min(RATE / 5.0, budget[t] + (now - last) * RATE)
            while live[t] < HOLD and budget[t] >= 1.0:
                s = socket.socket()
                s.setblocking(False)
                try:
                    s.bind((STRANGER, 0))
                    s.connect_ex(t)
                except OSError:
                    s.close()
                    break
                sel.register(s, selectors.EVENT_READ, (t, now))
                live[t] += 1
                budget[t] -= 1.0
                connects += 1
        last = now
        for key, _ in sel.select(0.005):
            s = key.fileobj
            try:
                gone = s.recv(4096) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                sel.unregister(s)
                s.close()
                live[key.data[0]] -= 1
                refused += time.time() - key.data[1] < 0.2
        if now - report >= 0.2:
            print("connects %d refused %d" % (connects, refused), flush=True)
            report = now
    return 0


class Stranger:
    def __init__(self, targets):
        args = [sys.executable, os.path.abspath(__file__), "--attack"]
        args += ["%s:%d" % t for t in targets]
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.connects = self.refused = 0
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.p.stdout:
            w = line.split()
            if len(w) == 4 and w[0] == "connects":
                self.connects, self.refused = int(w[1]), int(w[3])

    def stop(self):
        self.p.terminate()
        return self.p.wait(20)


def peer_line(c, n, peer):
    try:
        for l in c.stats(n, "stats peers").splitlines():
            if l.startswith("peer=%d " % peer):
                return l
    except OSError:
        pass
    return ""


def main():
    for f in (cluster.DAEMON, cluster.RANK, os.path.join(B, "tools", "railwave")):
        if not os.access(f, os.X_OK):
            print("skip: %s not built" % f)
            return 77
    with tempfile.TemporaryDirectory(prefix="rwflood.", dir="/tmp") as tmp:
        c = cluster.Cluster(tmp, 2)
        stranger = None
        try:
            c.start_all()
            c.run_ranks("g.before", layers=1, steps=1, seed=3)
            n1 = c.cfg["nodes"][1]
            targets = [(n1["control"].split(":")[0], int(n1["control"].split(":")[1]))]
            targets += [(r["address"], r["port"]) for r in n1["rails"]]
            stranger = Stranger(targets)
            time.sleep(3.0)  # the control slots have been refilled after a handshake deadline
            c.kill(0)
            r0 = stranger.refused
            c.start(0)
            t0, up = time.time(), ""
            while time.time() - t0 < FLOOD_S:
                line = peer_line(c, 1, 0)
                if "state=up" in line and "rails_up=%d " % cluster.RAILS in line + " ":
                    up = line
                    break
                time.sleep(0.1)
            check(bool(up), "the restarted n0 joined n1 on its control channel and all %d rails "
                  "during the flood (%s)" % (cluster.RAILS, up or peer_line(c, 1, 0)))
            if up:
                c.wait_mesh()
                c.run_ranks("g.during", layers=2, steps=2, seed=5)
                check(True, "verified phases passed with the flood still on")
            time.sleep(0.5)  # the stranger's last report
            refused = stranger.refused - r0
            check(stranger.p.poll() is None and refused > 0,
                  "the strangers' budget stayed full meanwhile: %d of the stranger's connections "
                  "were closed at accept since the restart (%d connects in all)"
                  % (refused, stranger.connects))
            check(stranger.stop() == 0, "the stranger stopped")
            stranger = None
        except Exception as e:  # a failed wait or phase is the finding
            check(False, "%s\n%s" % (str(e)[:3000], c.logs()[-3000:]))
        finally:
            if stranger:
                stranger.stop()
            c.stop()
    print("%d check(s) failed" % len(FAILS) if FAILS else "all checks passed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--attack":
        sys.exit(attack([(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[2:]]))
    sys.exit(main())
