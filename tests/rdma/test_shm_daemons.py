#!/usr/bin/env python3
"""railwaved over the shm rail transport (docs/rdma.md "The shm transport"): real daemons of one
host whose rails are shared-memory copies paced at each rail's rate_gbps, a forced path and the
selector, real rank processes (tests/integration/rw_rank) that verify every dispatched row and
every combined sum; each daemon must say it runs shm and count the bytes its rails copied (the
transport's own counter, wire_tx_bytes, at least the payload the executor wrote), and stop
cleanly (exit 0: under ASan, no leak). The transport itself is tests/rdma/conformance.c's.

Run by tests/run as $b/test/rail_shm_daemons; exits 0 pass, 1 fail, 77 skip."""
import os
import sys
import tempfile

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)


def one(tmp, path, nodes, seed):
    c = cluster.Cluster(tmp, nodes, path=path,
                        extra={"transport": "shm", "pace": True, "nic_gbps": 8})
    try:
        c.start_all()
        c.run_ranks("g." + path, layers=2, steps=3, seed=seed, flags=["--empty"])
        copied = []
        for n in range(nodes):
            st = dict(l.split(None, 1) for l in c.stats(n).splitlines() if " " in l)
            if st.get("transport") != "shm":
                raise RuntimeError("node %d: stats says transport %s" % (n, st.get("transport")))
            for r, rail in enumerate(c.rail_stats(n)):
                if rail["wire_tx_bytes"] < rail["tx_bytes"] or rail["tx_bytes"] <= 0:
                    raise RuntimeError("node %d rail %d: the executor wrote %d bytes, the shm "
                                       "transport copied %d" % (n, r, rail["tx_bytes"],
                                                                rail["wire_tx_bytes"]))
                copied.append(int(rail["wire_tx_bytes"]))
    finally:
        c.stop()
    print("ok   shm %-6s N=%d R=%d G=%d paced at 1 GB/s, seed %d: every row and sum verified; "
          "bytes copied per (node, rail) %s" % (path, nodes, c.rails, c.gpus, seed,
                                                " ".join(map(str, copied))))


def main():
    if not cluster.built():
        print("skip: build railwaved, tools/railwave and tests/integration/rw_rank first")
        return 77
    with tempfile.TemporaryDirectory(prefix="rwshmd.", dir="/tmp") as tmp:
        for i, (path, nodes) in enumerate([("joint", 2), ("auto", 3)]):
            sub = os.path.join(tmp, "c%d" % i)
            os.makedirs(sub)
            one(sub, path, nodes, 7100 + i)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print("FAIL: %s" % e)
        sys.exit(1)
