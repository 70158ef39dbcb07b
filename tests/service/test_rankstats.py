#!/usr/bin/env python3
"""The rank path as an operator sees it (docs/service.md "Turning on the rank path"): the
counters of `stats` and /metrics against real railwaved daemons.

Two daemons (tcp rails on loopback, 2 nodes x 2 ranks x 2 rails, group_area_mib 1, a pool of
two carve-outs, /metrics on loopback):
1. Before any rank: rank_pages 0, no rank-path phase, no refusal.
2. A rank-path job (group `lib`: four rw_pagerank ranks through librailwave's rank path on the
   CUDA kernel stand-in, 2 layers x 2 steps, every row checked by the ranks): on both daemons
   rank_path_dispatches 4 and rank_path_combines 4, rank_path_failed 0.
3. A page rank in this process (librailwave through ctypes) holding its page: rank_pages 1 on
   its daemon; its count row with records on a rail that is not its own is refused on the page:
   rank_path_refused 1, rank_path_refused_tokens 1.
4. A lying job (group `lie`: every rank's pack writes a record past its tokens in its first
   phase, 1 layer x 3 steps): that phase fails in the pair on both daemons:
   rank_path_failed_* counted there; its next two phases pass.
5. The pool spent (two groups whose ranks asked for slabs hold the two carve-outs): a third
   group's rank asking for its slab
   is refused (RW_E_LIMIT): rank_slabs_refused_pool 1. A daemon without carve-outs
   (group_area_mib 0): rank_slabs_refused_off 1.
6. /metrics of both daemons: the same numbers as `stats` (railwave_rank_path_phases_total{kind},
   railwave_rank_path_failed_total, railwave_rank_path_refused_total{code="tokens"},
   railwave_rank_slabs_refused_total{why="pool"}, railwave_carve_outs*), and `promtool check
   metrics` finds nothing to fix in either scrape.
7. `railwave stats` prints the rank path's lines.
Run by tests/run as $b/test/svc_rankstats; exits 0 pass, 1 fail, 77 skip."""
import ctypes
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

Opts = cluster.ClientOpts
FAKE_KERN = os.path.join(B, "tests", "integration", "libfakecuda_kern.so")
E_STATE, E_LIMIT, E_TOKENS = -26, -51, -45  # ipc/railwave.h
W_SUBMIT, W_PLAN = 0, 1
DEPTH, LINE, SLOT0, ROW_OFF = 4, 64, 640, 64  # ipc/page.h
NODES, RAILS = 2, 2
FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)


def kv(text):
    """`stats` as {key: value}."""
    return dict(ln.split(" ", 1) for ln in text.splitlines() if " " in ln)


def scrape(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as f:
        return f.read().decode()


def sample(text, series):
    m = re.search(r"^%s (\S+)$" % re.escape(series), text, re.M)
    return float(m.group(1)) if m else None


class Lib:
    def __init__(self):
        self.lib = lib = ctypes.CDLL(cluster.LIBRAILWAVE)
        lib.rw_client_connect.argtypes = [ctypes.POINTER(Opts), ctypes.POINTER(ctypes.c_void_p)]
        lib.rw_client_close.argtypes = [ctypes.c_void_p]
        lib.rw_client_rank_page.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                            ctypes.POINTER(ctypes.c_void_p),
                                            ctypes.POINTER(ctypes.c_size_t)]
        lib.rw_client_group_slab.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p]

    def join(self, c, group, rank, world):
        node = rank // c.gpus
        o = Opts(c.cfg["nodes"][node]["ipc_socket"].encode(), group.encode(), rank, world,
                 node, rank % c.gpus)
        cl = ctypes.c_void_p()
        rc = self.lib.rw_client_connect(ctypes.byref(o), ctypes.byref(cl))
        check(rc == 0, "rank %d of %s joins (rc %d)" % (rank, group, rc))
        return cl if rc == 0 else None

    def slab(self, cl):
        buf = ctypes.create_string_buffer(512)  # rw_client_slab_t, with room to spare
        return self.lib.rw_client_group_slab(cl, 0, buf)


def main():
    if not cluster.built(cluster.DAEMON, cluster.RAILWAVE, cluster.LIBRAILWAVE, cluster.PAGERANK):
        print("skip: railwaved, railwave, rw_pagerank or librailwave not built")
        return 77
    promtool = shutil.which("promtool")
    lib = Lib()
    tmp = tempfile.mkdtemp(prefix="rw-rankstats-")
    c = cluster.Cluster(tmp, NODES, rails=RAILS,
                        extra={"group_area_mib": 1, "group_pool_mib": 2})
    ports = []
    for n in range(NODES):
        ports.append(cluster.free_port("127.0.0.1"))
        c.cfg["nodes"][n]["http"] = "127.0.0.1:%d" % ports[-1]
    c.write_config()
    held = []
    world = NODES * c.gpus
    try:
        c.start_all()
        for n in range(NODES):
            st = kv(c.stats(n))
            check(st.get("rank_pages") == "0" and st.get("rank_path_dispatches") == "0" and
                  st.get("rank_path_refused") == "0" and st.get("rank_slabs_refused_off") == "0",
                  "node %d before any rank: no page, no phase, no refusal" % n)

        env = dict(c.env, RW_CUDA_DRIVER=FAKE_KERN)
        res = cluster.outputs([(r, c.pagerank(r, "lib", 2, 2, 5, "lib", env))
                               for r in range(world)])
        bad = {r: v[1][-300:] for r, v in res.items() if v[0] != 0 or "verified" not in v[1]}
        check(not bad, "the rank-path job: every rank verified its phases %s" % (bad or ""))
        for n in range(NODES):
            st = kv(c.stats(n))
            check(st.get("rank_path_dispatches") == "4" and st.get("rank_path_combines") == "4"
                  and st.get("rank_path_failed") == "0",
                  "node %d: 4 dispatches and 4 combines on the rank path, none failed (%s)"
                  % (n, {k: v for k, v in st.items() if k.startswith("rank_path")}))

        cl = lib.join(c, "pg", 0, world)
        addr, size = ctypes.c_void_p(), ctypes.c_size_t()
        rc = lib.lib.rw_client_rank_page(cl, 64, ctypes.byref(addr), ctypes.byref(size))
        check(rc == 0, "railwaved lends the rank a page (rc %d)" % rc)
        if rc == 0:
            held.append(cl)
            check(kv(c.stats(0)).get("rank_pages") == "1" and
                  kv(c.stats(1)).get("rank_pages") == "0",
                  "rank_pages 1 on the page's daemon, 0 on the other")
            a = addr.value
            slot_bytes = ctypes.c_uint32.from_address(a + 28).value
            base = a + SLOT0 + 1 * slot_bytes
            params = struct.pack("<BBHIIIIHHQQII", 1, 1, 2, 3, 32, 8, 4, 0, 0, 1, 1, 0, 0)
            ctypes.memmove(base, params, len(params))
            row = [0] * (NODES * RAILS)
            row[1 * RAILS + 1] = 3  # rail 1: not rank 0's (GPU 0 is on rail 0)
            ctypes.memmove(base + ROW_OFF, struct.pack("<%dI" % len(row), *row), 4 * len(row))
            ctypes.c_uint64.from_address(a + LINE * (1 + W_SUBMIT)).value = 1
            plan = ctypes.c_uint64.from_address(a + LINE * (1 + W_PLAN))
            deadline = time.time() + cluster.WAIT
            while time.time() < deadline and plan.value < 1:
                time.sleep(0.005)
            status = ctypes.c_int32.from_address(a + LINE * 6 + LINE * 1).value
            check(status == E_TOKENS, "the lying count row is refused on the page (%d)" % status)
            st = kv(c.stats(0))
            check(st.get("rank_path_refused") == "1" and st.get("rank_path_refused_tokens") == "1",
                  "rank_path_refused 1, rank_path_refused_tokens 1")

        res = cluster.outputs([(r, c.pagerank(r, "lie", 1, 3, 5, "lie")) for r in range(world)])
        check(all("lie: phase 1 failed" in v[1] for v in res.values()),
              "the lying job: its first phase fails on every rank")
        for n in range(NODES):
            st = kv(c.stats(n))
            kinds = {k: v for k, v in st.items() if k.startswith("rank_path_failed_")}
            check(int(st.get("rank_path_failed", "0")) >= 1 and kinds,
                  "node %d: the failed phase counted, by kind (%s, %s)"
                  % (n, st.get("rank_path_failed"), kinds))

        # groups whose ranks ask for slabs until the pool is spent (a job above may still
        # hold one: a failed pair's carve-out goes back a heartbeat timeout later); the first
        # refused is named RW_E_LIMIT and counted once
        codes = []
        for g in ("ca", "cb", "cc"):
            x = lib.join(c, g, 0, world)
            if not x:
                break
            held.append(x)
            codes.append(lib.slab(x))
            if codes[-1] != 0:
                break
        check(codes and codes[-1] == E_LIMIT and all(r == 0 for r in codes[:-1]),
              "the pool spent: the next group's slab refused RW_E_LIMIT (codes %s)" % codes)
        check(kv(c.stats(0)).get("rank_slabs_refused_pool") == "1",
              "rank_slabs_refused_pool 1")

        time.sleep(0.6)  # /metrics serves a snapshot published every 250 ms
        for n in range(NODES):
            text = scrape(ports[n])
            st = kv(c.stats(n))
            d, cb = (sample(text, 'railwave_rank_path_phases_total{kind="%s"}' % k)
                     for k in ("dispatch", "combine"))
            check(d == int(st["rank_path_dispatches"]) and cb == int(st["rank_path_combines"])
                  and d >= 6,  # the job's 4, the lying job's 2 after its failed one
                  "node %d /metrics: the rank path's dispatches and combines as stats says "
                  "(%s, %s)" % (n, d, cb))
            failed = sum(float(v) for v in re.findall(
                r"^railwave_rank_path_failed_total\{kind=\"\w+\"\} (\S+)$", text, re.M))
            check(failed == int(st["rank_path_failed"]),
                  "node %d /metrics: the failed phases as stats says (%s)" % (n, failed))
            check(sample(text, "railwave_rank_pages") == (1 if n == 0 else 0),
                  "node %d /metrics: railwave_rank_pages" % n)
            if n == 0:
                check(sample(text, 'railwave_rank_path_refused_total{code="tokens"}') == 1 and
                      sample(text, 'railwave_rank_slabs_refused_total{why="pool"}') == 1 and
                      sample(text, "railwave_carve_outs_max") == 2,
                      "node 0 /metrics: the refusal, the slab refused, the pool")
            if promtool:
                p = subprocess.run([promtool, "check", "metrics"], input=text,
                                   capture_output=True, text=True)
                out = (p.stdout + p.stderr).strip()
                check(p.returncode == 0 and not out,
                      "node %d: promtool check metrics finds nothing (%s)" % (n, out[-400:]))
            else:
                check(False, "no promtool (Debian's prometheus package; scripts/setup installs it)")
        st0 = kv(c.stats(0))
        p = subprocess.run([cluster.RAILWAVE, "stats", "--socket", c.cfg["nodes"][0]["stats_socket"]],
                           capture_output=True, text=True)
        check(p.returncode == 0 and "rank_path_dispatches %s\n" % st0["rank_path_dispatches"]
              in p.stdout and
              "rank_slabs_refused_pool 1" in p.stdout,
              "railwave stats prints the rank path's lines (rc %d) %s" % (p.returncode,
                                                                       p.stderr[-200:]))
        for x in held:
            lib.lib.rw_client_close(x)
        held = []
        c.stop()
        check(True, "both daemons exited 0")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        for x in held:
            lib.lib.rw_client_close(x)
        c.finish(bool(FAILS))

    tmp = tempfile.mkdtemp(prefix="rw-rankstats-off-")
    c = cluster.Cluster(tmp, 1)
    try:
        c.start_all()
        x = lib.join(c, "off", 0, c.gpus)
        if x:
            rc = lib.slab(x)
            check(rc == E_STATE, "no carve-outs: the slab refused (rc %d)" % rc)
            check(kv(c.stats(0)).get("rank_slabs_refused_off") == "1",
                  "rank_slabs_refused_off 1")
            lib.lib.rw_client_close(x)
        c.stop()
    except RuntimeError as e:
        check(False, str(e))
    finally:
        c.finish(bool(FAILS))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
