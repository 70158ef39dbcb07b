#!/usr/bin/env python3
"""`railwave size` against real railwaved daemons (docs/service.md "Turning on the rank path"):
the group_area_mib and group_local_mib it prints for a shape are exactly what the daemons need
for that shape's largest phase.

Two daemons (tcp rails on loopback), 2 nodes x 2 ranks x 2 rails; the shape: hidden 7168 bf16,
top-8, 8 experts, T tokens per rank. Every rank of group `sz` is a page rank in this process
(librailwave through ctypes, its page lent by the daemon with max_recv M) that plays its stream
from the CPU: its slot's parameters and its count row — the largest the shape allows, each of
its T tokens naming both nodes (T records to each node at its native rail) — then `submit`.
1. group_area_mib, group_local_mib = the printed sizes: every rank's plan word reaches the phase
   with status 0 (the daemons planned it: the layout fits a record area of the carve-out and
   the local area holds the local records, the combine copies and the staging of its rail's
   ranks). M = every token of the world (the default) and M = a quarter of it (--max-recv).
2. group_area_mib - 1: the phase is refused on every rank (RW_E_PHASE), the daemon's log names
   the rail's need and group_area_mib (the record areas are a quarter MiB short).
3. group_local_mib - 1: refused the same, the log naming the local area and group_local_mib.
4. The '#' lines give each part; bad options are refused, named (a shape with no topology,
   --experts not a multiple).
Run by tests/run as $b/test/svc_carvesize; exits 0 pass, 1 fail, 77 skip."""
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

Opts = cluster.ClientOpts
E_PHASE = -53  # ipc/railwave.h: the service failed the phase
W_SUBMIT, W_PLAN = 0, 1
DEPTH, LINE, SLOT0, ROW_OFF = 4, 64, 640, 64  # ipc/page.h
NODES, GPUS, RAILS = 2, 2, 2
HIDDEN, TOPK, EXPERTS, TOKENS = 7168, 8, 8, 24
BF16 = 1
FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)


def size(*extra):
    """`railwave size` for the test's shape: (exit code, {key: value}, stderr)."""
    return cluster.railwave_size(HIDDEN, TOPK, EXPERTS, TOKENS, GPUS, NODES, RAILS, *extra)


def one_phase(lib, area_mib, local_mib, max_recv):
    """Daemons with group_area_mib = area_mib and group_local_mib = local_mib, pages of
    max_recv rows, the group's largest phase submitted by every rank: each rank's status once
    its plan word reaches the phase (None: never), and daemon 0's log."""
    tmp = tempfile.mkdtemp(prefix="rw-carvesize-")
    c = cluster.Cluster(tmp, NODES, gpus=GPUS, rails=RAILS, experts=EXPERTS,
                        extra={"group_area_mib": area_mib, "group_local_mib": local_mib,
                               "group_pool_mib": 4 * area_mib})
    clients, status = [], []
    try:
        c.start_all()
        pages = []
        for rank in range(NODES * GPUS):
            node = rank // GPUS
            o = Opts(c.cfg["nodes"][node]["ipc_socket"].encode(), b"sz", rank, NODES * GPUS,
                     node, rank % GPUS)
            cl = ctypes.c_void_p()
            if lib.rw_client_connect(ctypes.byref(o), ctypes.byref(cl)) != 0:
                check(False, "rank %d joins" % rank)
                return [], c.log(0)
            clients.append(cl)
            addr, nbytes = ctypes.c_void_p(), ctypes.c_size_t()
            rc = lib.rw_client_rank_page(cl, max_recv, ctypes.byref(addr),
                                         ctypes.byref(nbytes))
            if rc != 0:
                check(False, "rank %d is lent a page (rc %d)" % (rank, rc))
                return [], c.log(0)
            pages.append(addr.value)
        k = 1
        for rank, addr in enumerate(pages):
            slot_bytes = ctypes.c_uint32.from_address(addr + 28).value
            base = addr + SLOT0 + (k % DEPTH) * slot_bytes
            params = struct.pack("<BBHIIIIHHQQII", 1, BF16, TOPK, 0, HIDDEN, EXPERTS, TOKENS,
                                 0, 0, k, k, 0, 0)
            ctypes.memmove(base, params, len(params))
            row = [0] * (NODES * RAILS)
            native = (rank % GPUS) % RAILS  # the config's default gpu_rail: g % rails
            for d in range(NODES):
                row[d * RAILS + native] = TOKENS
            ctypes.memmove(base + ROW_OFF, struct.pack("<%dI" % len(row), *row), 4 * len(row))
        for addr in pages:
            ctypes.c_uint64.from_address(addr + LINE * (1 + W_SUBMIT)).value = k
        for addr in pages:
            plan = ctypes.c_uint64.from_address(addr + LINE * (1 + W_PLAN))
            deadline = time.time() + cluster.WAIT
            while time.time() < deadline and plan.value < k:
                time.sleep(0.005)
            status.append(ctypes.c_int32.from_address(addr + LINE * 6 + LINE * (k % DEPTH)).value
                          if plan.value >= k else None)
        return status, c.log(0)
    except RuntimeError as e:
        check(False, str(e))
        return status, ""
    finally:
        for cl in clients:
            lib.rw_client_close(cl)
        c.finish(bool(FAILS))


def main():
    if not cluster.built(cluster.DAEMON, cluster.RAILWAVE, cluster.LIBRAILWAVE):
        print("skip: railwaved, railwave or librailwave not built")
        return 77
    lib = ctypes.CDLL(cluster.LIBRAILWAVE)
    lib.rw_client_connect.argtypes = [ctypes.POINTER(Opts), ctypes.POINTER(ctypes.c_void_p)]
    lib.rw_client_close.argtypes = [ctypes.c_void_p]
    lib.rw_client_rank_page.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                        ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_size_t)]
    rc, keys, err = size("--groups", "3")
    check(rc == 0 and keys.get("group_area_mib", 0) > keys.get("group_local_mib", 0) > 1,
          "railwave size prints a group_area_mib and its group_local_mib (%r %s)"
          % (keys, err.strip()))
    if FAILS:
        return 1
    area, local = keys["group_area_mib"], keys["group_local_mib"]
    check(keys.get("group_pool_mib") == 3 * area and keys.get("node_mib") == 3 * area * RAILS,
          "the pool for 3 groups and the memory per node (%r)" % keys)
    world = NODES * GPUS * TOKENS
    p = subprocess.run([cluster.RAILWAVE, "size", "--hidden", str(HIDDEN), "--topk", str(TOPK),
                        "--tokens", str(TOKENS), "--gpus", str(GPUS), "--nodes", str(NODES),
                        "--rails", str(RAILS)], capture_output=True, text=True)
    parts = [ln for ln in p.stdout.splitlines() if ln.startswith("#")]
    print("\n".join(parts))
    check(any("%d rows received per rank" % world in ln for ln in parts) and
          any("record areas" in ln for ln in parts) and
          any("local area" in ln and "staged combine inputs" in ln for ln in parts),
          "the '#' lines give each part of the carve-out")

    status, _ = one_phase(lib, area, local, world)
    check(len(status) == NODES * GPUS and all(s == 0 for s in status),
          "group_area_mib %d, group_local_mib %d: the largest phase is planned on every rank "
          "(statuses %s)" % (area, local, status))
    status, log = one_phase(lib, area - 1, local, world)
    check(len(status) == NODES * GPUS and all(s == E_PHASE for s in status),
          "group_area_mib %d: the phase is refused on every rank, RW_E_PHASE (statuses %s)"
          % (area - 1, status))
    print("\n".join(ln for ln in log.splitlines() if "a rail needs" in ln)[:400])
    check("a rail needs" in log and "group_area_mib" in log,
          "the refusal names the rail's need and group_area_mib in the daemon's log")
    status, log = one_phase(lib, area, local - 1, world)
    check(len(status) == NODES * GPUS and all(s == E_PHASE for s in status),
          "group_local_mib %d: the phase is refused on every rank, RW_E_PHASE (statuses %s)"
          % (local - 1, status))
    print("\n".join(ln for ln in log.splitlines() if "local area holds" in ln)[:400])
    check("local area holds" in log and "group_local_mib" in log,
          "the refusal names the local area and group_local_mib in the daemon's log")

    # a rank's staging holds its max_recv rows: a smaller bound, a smaller local area
    rc, small, err = size("--max-recv", str(world // 4))
    check(rc == 0 and small.get("group_local_mib", 0) < local,
          "--max-recv %d: a smaller group_local_mib (%r %s)" % (world // 4, small, err.strip()))
    if rc == 0:
        status, _ = one_phase(lib, small["group_area_mib"], small["group_local_mib"],
                              world // 4)
        check(len(status) == NODES * GPUS and all(s == 0 for s in status),
              "pages of max_recv %d: the printed sizes plan the largest phase (statuses %s)"
              % (world // 4, status))

    rc, _, err = size("--experts", "6")
    check(rc == 2 and "not a multiple" in err, "--experts 6 refused, named: %s" % err.strip())
    rc, _, err = size("--gpu-rail", "0,5")
    check(rc == 2 and "--gpu-rail" in err, "--gpu-rail past --rails refused, named: %s"
          % err.strip())
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
