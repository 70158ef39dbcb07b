#!/usr/bin/env python3
"""One local process churning the IPC socket (docs/security.md "What holds today"). A real
railwaved (one node, ipc_max_per_uid 8) and a real client process (librailwave through
ctypes, this file with --churn):

1. Reconnect at once: the process holds 8 connections (its uid's limit), closes all 8 and
   connects 8 again at once, 60 times over. Every connect must be taken: connections the process
   has closed are not held against it (before: the new hellos could meet RW_E_LIMIT while the
   daemon had not read the old ones' ends yet).
2. Groups opened and abandoned in a loop for 3 s (thousands: connect, join a group of two that
   never completes, close). The daemon's log grows by a bounded number of lines a second
   (connect, join, leave and refusal lines, the IPC server's and the executor's, pass at most 20
   a second, the rest are counted and reported), and a job run afterwards verifies.
Bounds are log-line budgets, not timings. Run by tests/run as $b/test/ipc_churn; exits 0 pass,
1 fail, 77 skip."""
import ctypes
import os
import subprocess
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

LIB = os.path.join(B, "lib", "librailwave.so.1")
PER_UID = 8
CHURN_S = 3.0
LOG_PER_S = 20   # ipc/server_int.h IPC_CHURN_LOG_PER_S
FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)


Opts = cluster.ClientOpts  # ipc/railwave.h rw_client_opts_t


def churn(sock, what):
    """The client process. 'reconnect': 30 rounds of 8 connects, 8 closes; prints the refused
    connects' codes. 'groups': groups opened and abandoned for CHURN_S; prints how many."""
    lib = ctypes.CDLL(LIB)
    lib.rw_client_connect.argtypes = [ctypes.POINTER(Opts), ctypes.POINTER(ctypes.c_void_p)]
    lib.rw_client_close.argtypes = [ctypes.c_void_p]

    def connect(group, rank, world):
        o = Opts(sock.encode(), group.encode(), rank, world, 0, rank % cluster.GPUS)
        c = ctypes.c_void_p()
        rc = lib.rw_client_connect(ctypes.byref(o), ctypes.byref(c))
        return rc, c

    if what == "reconnect":
        refused = []
        for i in range(60):
            held = []
            for r in range(PER_UID):
                rc, c = connect("re.%d.%d" % (i, r), 0, 2)
                if rc:
                    refused.append(rc)
                else:
                    held.append(c)
            for c in held:
                lib.rw_client_close(c)
        print("refused %d %s" % (len(refused), sorted(set(refused))))
        return 0
    n, end = 0, time.time() + CHURN_S
    while time.time() < end:
        rc, c = connect("churn.%d" % n, 0, 2)
        if rc == 0:
            lib.rw_client_close(c)
        n += 1
    print("groups %d" % n)
    return 0


def lines(path):
    with open(path) as f:
        return f.read().splitlines()


def main():
    if not cluster.built() or not os.path.exists(LIB):
        print("skip: railwaved, rw_rank or librailwave not built")
        return 77
    with tempfile.TemporaryDirectory(prefix="rwchurn.", dir="/tmp") as tmp:
        c = cluster.Cluster(tmp, 1, extra={"ipc_max_per_uid": PER_UID})
        try:
            c.start_all()
            sock = c.cfg["nodes"][0]["ipc_socket"]
            me = [sys.executable, os.path.abspath(__file__), "--churn", sock]
            out = subprocess.run(me + ["reconnect"], capture_output=True, text=True,
                                 timeout=cluster.WAIT).stdout
            check(out.startswith("refused 0 "), "a process that closes its %d connections and "
                  "connects again at once is taken every time (60 rounds): %s"
                  % (PER_UID, out.strip()))
            log = os.path.join(tmp, "d0.log")
            before = len(lines(log))
            t0 = time.time()
            out = subprocess.run(me + ["groups"], capture_output=True, text=True,
                                 timeout=cluster.WAIT).stdout
            elapsed = time.time() - t0
            time.sleep(1.1)
            c.stats(0, "stats")  # anything that logs nothing, to let the daemon catch up
            grew = lines(log)[before:]
            groups = int(out.split()[1]) if out.startswith("groups ") else 0
            # Per second: the budgeted lines, one report of the rest, plus slack for the
            # service's own lines of a second that began before the budget did.
            bound = (elapsed + 2) * (LOG_PER_S + 2)
            check(groups > 2 * bound and len(grew) <= bound,
                  "%d groups opened and abandoned in %.1f s: the log grew by %d lines (bound %d)"
                  % (groups, elapsed, len(grew), bound))
            check(any("left out of the log" in l for l in grew),
                  "the lines left out are counted in the log: %s"
                  % [l.split("WARN ")[-1] for l in grew if "left out" in l][:1])
            c.run_ranks("g.after", layers=1, steps=2, seed=11)
            check(True, "a job run afterwards verified")
        except Exception as e:  # a failed run is the finding
            check(False, "%s\n%s" % (str(e)[:3000], c.logs()[-3000:]))
        finally:
            c.stop()
    print("%d check(s) failed" % len(FAILS) if FAILS else "all checks passed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--churn":
        sys.exit(churn(sys.argv[2], sys.argv[3]))
    sys.exit(main())
