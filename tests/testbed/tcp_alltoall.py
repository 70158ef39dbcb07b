#!/usr/bin/env python3
"""One node of a plain-TCP all-to-all on the rail test bed (tests/testbed/ceiling.sh runs one per
namespace). Node ME listens on its rail addresses 10.77.<r>.<ME+1>, connects once to every other
node on every rail, then for each repetition k, at monotonic time T0 + 2 + k (every node uses the
same T0, and CLOCK_MONOTONIC is one clock for every namespace of a machine), sends BYTES to every
other node on every rail at once and prints how long after the start its last incoming flow
completed. Connections stay open across repetitions, as a daemon's do, so what is timed is the
transfer alone: no process start, no connection setup.

usage: tcp_alltoall.py ME NODES RAILS BYTES REPS T0"""
import socket
import sys
import threading
import time

PORT = 7800


def main():
    me, nodes, rails, nbytes, reps = (int(v) for v in sys.argv[1:6])
    t0 = float(sys.argv[6])
    listeners = []
    for r in range(rails):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("10.77.%d.%d" % (r, me + 1), PORT))
        s.listen(nodes)
        listeners.append(s)
    time.sleep(1.0)  # every node listens before anyone connects
    out = []
    for d in range(nodes):
        for r in range(rails if d != me else 0):
            c = socket.socket()
            c.bind(("10.77.%d.%d" % (r, me + 1), 0))
            c.connect(("10.77.%d.%d" % (r, d + 1), PORT))
            out.append(c)
    inc = [l.accept()[0] for l in listeners for _ in range(nodes - 1)]
    payload = b"x" * nbytes
    for k in range(reps):
        start = t0 + 2.0 + k
        while time.monotonic() < start:
            time.sleep(0.0005)
        done = []

        def rx(c):
            got = 0
            while got < nbytes:
                b = c.recv(1 << 20)
                if not b:
                    raise RuntimeError("peer closed")
                got += len(b)
            done.append(time.monotonic())

        threads = [threading.Thread(target=rx, args=(c,)) for c in inc]
        threads += [threading.Thread(target=c.sendall, args=(payload,)) for c in out]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("%d %.4f" % (k, max(done) - start), flush=True)
    for c in out + inc + listeners:
        c.close()


if __name__ == "__main__":
    main()
