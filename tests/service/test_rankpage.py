#!/usr/bin/env python3
"""The rank path's words against real railwaved daemons (docs/rankpath.md "A phase", "Failure"):
a rank of group `pg` (librailwave through ctypes, its page lent by the daemon) plays its stream's
part from the CPU — it writes a slot's parameters and count row, then `submit`, as the count
kernel and cuStreamWriteValue64 would — while a host job (group `job`, four rw_rank processes
that verify every row and sum) runs on the same two daemons.

1. railwaved lends pages (page_rails = its rails) and its executor takes every submit: a
   combine is refused, named (the rank path carries dispatches only so far), a lying one is
   refused with RW_E_TOKENS, named: a count row at a rail that is not the rank's, a row
   adding up to more records than its tokens can make, a slot holding another phase's
   parameters, a bad top-k id the count kernel met; an unknown dtype (RW_E_DTYPE). Each refusal writes the phase's status, then plan
   and arrived = k on the page (the words a stream waits on), and the daemon's log names the
   group, the rank, the phase and what is wrong.
2. `done` written past the daemon's `arrived`, `packed` past its `plan`: each fails that phase
   (RW_E_TOKENS), named.
3. Two phases published with one submit (the poller may see only the last value) are both
   taken, in order.
4. `submit` jumped past the depth: the daemon drops the rank (RW_E_RING_INDEX); the rank's
   watcher writes the owed words of a lost daemon (every status RW_E_CLOSED, plan 2^62 ahead).
5. The host job's ranks all pass while this goes on.
6. Dispatches on the rank path complete between the two daemons: a group of four page ranks
   (tests/integration/rw_pagerank.c: each plays its stream from the CPU — count row, submit,
   records where its plan block says, packed, its forward list read, done) over 6 phases of the
   host job's workload (each data path requested in turn), every row, its metadata and each
   expert's count checked against it,
   each dispatch followed by its combine (the expert outputs staged in the group's slab, the
   gather's returns, the owner's reduce in the daemon's list order): every token's combined row
   equal to the workload's. A rank whose gather writes a return with a wrong slot field fails
   that combine on every rank of both nodes (RW_E_PHASE, named); the next phases pass. A group
   whose ranks on a node mix the ring and the page: its phase passes on every rank
   (tests/service/test_rankmix.py has the rest).
   As an attacker: a rank whose pack writes a record with a token past its tokens fails that
   phase on every rank of both nodes (RW_E_PHASE, the log naming the rank and the record), the
   node not dropped: the group's next phases pass; a rank killed between submit and packed, and
   one between arrived and done: the group's phase fails on the others (their words written;
   a rank beside it whose dispatch ran through before it died hears of it at its combine,
   RW_E_PHASE naming the rank), and a new group's phases pass right after. The same 6 phases through librailwave's rank path
   itself (rw_client_rank_dispatch: the count, pack and forward kernels on the CUDA stand-in's
   stream; the outputs — rows, metadata, per-expert counts — checked the same way), and again
   with the SM budget 1 (RW_PAGERANK_SMS: every launch of the ranks' kernels on one block).
7. A daemon killed (SIGKILL) while a rank's stream waits on its words: the rank's watcher
   writes them (plan and arrived 2^62 ahead, every status RW_E_CLOSED), so the stream runs
   through; a group of four page ranks running phases at that moment: every one's phase fails
   and its stream runs through (the survivor daemon's words on node 0, the watcher's on node
   1); the other daemon stops cleanly (ASan: no leak).
8. The lib job again on GPU slabs (the test hook RAILWAVE_TEST_GPUDIRECT=1, the stand-in
   drivers): the groups' carve-outs are CUDA allocations lent by fd and imported by the rank
   path, whose kernels pack into and forward from them; every rank verified.
Run by tests/run as $b/test/svc_rankpage; exits 0 pass, 1 fail, 77 skip."""
import ctypes
import os
import shutil
import struct
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

LIB = cluster.LIBRAILWAVE
PAGERANK = cluster.PAGERANK
# the CUDA stand-in with the kernels' CPU stand-ins: librailwave's rank path runs on it
FAKE_KERN = os.path.join(B, "tests", "integration", "libfakecuda_kern.so")
# RW_RANKPAGE_DRIVER=libcuda.so.1: the lib job's kernels on a GPU (scripts/gpu-carry)
KERN_DRIVER = os.environ.get("RW_RANKPAGE_DRIVER", FAKE_KERN)
Opts = cluster.ClientOpts
E_CLOSED, E_STATE, E_TOKENS, E_DTYPE = -5, -26, -45, -44  # ipc/railwave.h
# ipc/page.h: the head's words and status lines each on a 64-byte line; slot 0 after the head;
# in a slot the parameters (rw_page_params_t, 40 bytes) then, on the next line, the count row.
W_SUBMIT, W_PLAN, W_PACKED, W_ARRIVED, W_DONE = range(5)
DEPTH, LINE, SLOT0, ROW_OFF = 4, 64, 640, 64
OWED_AHEAD = 1 << 62
FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)


class Page:
    """A rank page mapped in this process, written as the rank's stream would."""

    def __init__(self, addr, nodes, rails):
        self.addr, self.nodes, self.rails = addr, nodes, rails
        self.slot_bytes = ctypes.c_uint32.from_address(addr + 28).value

    def word(self, w):
        return ctypes.c_uint64.from_address(self.addr + LINE * (1 + w))

    def status(self, k):
        return ctypes.c_int32.from_address(self.addr + LINE * 6 + LINE * (k % DEPTH)).value

    def slot(self, k, kind=1, dtype=1, topk=2, layer=3, hidden=32, experts=8, tokens=4,
             phase=None, row=None, bad=0):
        """Slot k: rw_page_params_t then the count row (default: nothing counted)."""
        base = self.addr + SLOT0 + (k % DEPTH) * self.slot_bytes
        params = struct.pack("<BBHIIIIHHQQII", kind, dtype, topk, layer, hidden, experts, tokens,
                             0, 0, k if phase is None else phase, k, bad, 0)
        ctypes.memmove(base, params, len(params))
        row = row or [0] * (self.nodes * self.rails)
        ctypes.memmove(base + ROW_OFF, struct.pack("<%dI" % len(row), *row), 4 * len(row))

    def wait_plan(self, k):
        """Until the daemon's plan word reaches k (cyclically); False past the bound."""
        deadline = time.time() + cluster.WAIT
        while time.time() < deadline:
            if (self.word(W_PLAN).value - k) % (1 << 64) < (1 << 63):
                return True
            time.sleep(0.005)
        return False


def row_at(nodes, rails, cells):
    row = [0] * (nodes * rails)
    for (d, r), v in cells.items():
        row[d * rails + r] = v
    return row


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK, cluster.RAILWAVE, LIB, PAGERANK):
        print("skip: railwaved, rw_rank, rw_pagerank, railwave or librailwave not built")
        return 77
    lib = ctypes.CDLL(LIB)
    lib.rw_client_connect.argtypes = [ctypes.POINTER(Opts), ctypes.POINTER(ctypes.c_void_p)]
    lib.rw_client_close.argtypes = [ctypes.c_void_p]
    lib.rw_client_rank_page.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                        ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_size_t)]
    tmp = tempfile.mkdtemp(prefix="rw-rankpage-")
    nodes, rails = 2, 2
    # group carve-outs: the page ranks' records live in their group's slabs
    c = cluster.Cluster(tmp, nodes, rails=rails,
                        extra={"group_area_mib": 1, "group_pool_mib": 10})
    try:
        c.start_all()
        job = [(r, c.rank(r, "job", 2, 30, 11)) for r in range(nodes * c.gpus)]

        def page_rank(group, rank):
            """A rank of `group` joined on its node's daemon, with its page mapped."""
            node = rank // c.gpus
            o = Opts(c.cfg["nodes"][node]["ipc_socket"].encode(), group.encode(), rank,
                     nodes * c.gpus, node, rank % c.gpus)
            cl = ctypes.c_void_p()
            check(lib.rw_client_connect(ctypes.byref(o), ctypes.byref(cl)) == 0,
                  "rank %d of %s joins" % (rank, group))
            addr, size = ctypes.c_void_p(), ctypes.c_size_t()
            rc = lib.rw_client_rank_page(cl, 64, ctypes.byref(addr), ctypes.byref(size))
            check(rc == 0, "railwaved lends rank %d a page (rc %d)" % (rank, rc))
            return cl, (Page(addr.value, nodes, rails) if rc == 0 else None)

        cl, pg = page_rank("pg", 0)
        waiter, wpg = page_rank("pk", 2)  # on node 1, killed at the end
        if pg is None or wpg is None:
            return 1
        native = 0  # local GPU 0's rail (the config's default gpu_rail: g % rails)

        def phase(k, code, line, **slot):
            pg.slot(k, **slot)
            pg.word(W_SUBMIT).value = k
            check(pg.wait_plan(k), "phase %d: plan reaches %d" % (k, k))
            check(pg.status(k) == code, "phase %d: status %d (want %d)" % (k, pg.status(k), code))
            check(pg.word(W_ARRIVED).value == k, "phase %d: arrived = %d" % (k, k))
            log = c.log(0)
            check("group pg rank 0 phase %d: %s" % (k, line) in log,
                  "phase %d named in the log: %r" % (k, line))

        # done past arrived, then packed past plan: the rank's words move (0 -> 1, 0 -> 2)
        # while the daemon answered nothing, resp. only phase 1's failure
        pg.word(W_DONE).value = 1
        check(pg.wait_plan(1), "done past arrived: the phase is failed (plan reaches 1)")
        check(pg.status(1) == E_TOKENS, "done past arrived: status RW_E_TOKENS (%d)" % pg.status(1))
        check("group pg rank 0 phase 1: done moved to 1, past the daemon's arrived" in c.log(0),
              "done past arrived named in the log")
        pg.word(W_PACKED).value = 2
        check(pg.wait_plan(2), "packed past plan: the phase is failed (plan reaches 2)")
        check(pg.status(2) == E_TOKENS, "packed past plan: status RW_E_TOKENS (%d)" % pg.status(2))
        check("group pg rank 0 phase 2: packed moved to 2, past the daemon's plan" in c.log(0),
              "packed past plan named in the log")

        phase(3, E_STATE, "combine of layer 3 step 3: no dispatch of this rank waits for it",
              kind=2)
        phase(4, E_TOKENS, "count row entry (node 1, rail 1) is 3, where the rank counts "
              "nothing (not its rail)", row=row_at(nodes, rails, {(1, 1): 3}))
        phase(5, E_TOKENS, "the count row adds up to 8 records, above 4 tokens x 1 nodes each",
              topk=1, row=row_at(nodes, rails, {(0, native): 4, (1, native): 4}))
        phase(6, E_TOKENS, "slot 2 holds phase 9's parameters, submitted as phase 6", phase=9)
        phase(7, E_DTYPE, "dtype 3: the daemon carries bf16 and fp32 rows", dtype=3)
        phase(8, E_TOKENS, "token 2 has a top-k id outside [0, 8) (the count kernel counted "
              "nothing for it)", bad=3)

        # two phases, one submit store: both taken, in order
        pg.slot(9, row=row_at(nodes, rails, {(1, 1): 1}))
        pg.slot(10, kind=2)
        pg.word(W_SUBMIT).value = 10
        check(pg.wait_plan(10), "phases 9 and 10 under one submit: plan reaches 10")
        check(pg.status(9) == E_TOKENS and pg.status(10) == E_STATE,
              "phase 9 refused (its row), phase 10 taken (%d, %d)" % (pg.status(9), pg.status(10)))

        # submit jumped past the depth: dropped; the watcher owes the words of a lost daemon
        pg.word(W_SUBMIT).value = 10 + DEPTH + 1
        deadline = time.time() + cluster.WAIT
        while time.time() < deadline and pg.word(W_PLAN).value < OWED_AHEAD:
            time.sleep(0.005)
        check(pg.word(W_PLAN).value >= OWED_AHEAD,
              "submit jumped: the rank is dropped and its watcher raised plan 2^62 ahead")
        check(all(pg.status(k) == E_CLOSED for k in range(DEPTH)),
              "every status RW_E_CLOSED after the drop")
        check("rank page word submit went from 10 to 15" in c.log(0), "the jump named in the log")
        lib.rw_client_close(cl)

        def page_job(group, layers, steps, modes=None, env=None, ranks=None):
            """Every rank of `group` (or those of `ranks`) a page rank (rw_pagerank), in its
            mode (default ok)."""
            modes = modes or {}
            ranks = range(nodes * c.gpus) if ranks is None else ranks
            return [(r, c.pagerank(r, group, layers, steps, 5, modes.get(r, "ok"), env))
                    for r in ranks]

        def passed(res, what):
            bad = {r: (v[0], v[1][-300:]) for r, v in res.items()
                   if v[0] != 0 or "verified" not in v[1]}
            check(not bad, "%s: every page rank verified its dispatches %s" % (what, bad or ""))

        res = cluster.outputs(page_job("run", 2, 3))
        passed(res, "6 phases on the rank path")
        # the phases asked for every path in turn; the host job runs the daemon's choice only
        for path in ("native", "rail-only", "perm-only"):
            for kind in ("dispatch", "combine"):
                check(c.phases_passed(0, path, kind),
                      "the rank path ran %s on path %s" % (kind, path))

        check(all("(0 rows)" not in v[1] for v in res.values()),
              "every page rank received rows")

        if "/" not in KERN_DRIVER or os.path.exists(KERN_DRIVER):  # nvcc embeds the kernels
            res = cluster.outputs(page_job("lib", 2, 3, {r: "lib" for r in range(nodes * c.gpus)},
                                   env=dict(c.env, RW_CUDA_DRIVER=KERN_DRIVER)))
            passed(res, "6 dispatches and their combines through librailwave's rank path "
                   "(count, pack, forward, gather and reduce kernels on the stand-in driver)")
            # the same with every launch of the ranks' kernels on one block (the SM budget)
            res = cluster.outputs(page_job("libsms", 2, 3,
                                           {r: "lib" for r in range(nodes * c.gpus)},
                                           env=dict(c.env, RW_CUDA_DRIVER=KERN_DRIVER,
                                                    RW_PAGERANK_SMS="1")))
            passed(res, "the same with the SM budget 1 (rw_client_rank_open_opts)")
            check(all("SM budget 1)" in v[1] for v in res.values()),
                  "every lib rank ran under the SM budget 1")
        else:
            print("skip librailwave's rank path: no kernel stand-in (%s)" % KERN_DRIVER)

        res = cluster.outputs(page_job("lie", 1, 3, {r: "lie" for r in range(nodes * c.gpus)}))
        passed(res, "after the lie, phases 2 and 3")
        # rw_client_strerror(RW_E_PHASE) is "phase failed"
        check(all("lie: phase 1 failed: phase failed" in v[1] for v in res.values()),
              "the lying rank's phase failed with RW_E_PHASE on every rank of both nodes: %s" %
              [v[1].splitlines()[:1] for v in res.values()])
        check("rank 0: record 0 to node" in c.log(0) and "its token is past the rank's tokens"
              in c.log(0), "the daemon's log names the lying rank and its record")
        check(": down (" not in c.log(0) + c.log(1),
              "no node was dropped for the lying rank (no peer went down on either daemon)")

        res = cluster.outputs(page_job("clie", 1, 3, {r: "clie" for r in range(nodes * c.gpus)}))
        passed(res, "after the gather's lie, the next phases")
        check(all("clie: phase 2 failed: phase failed" in v[1] for v in res.values()),
              "the lying gather's combine failed with RW_E_PHASE on every rank of both nodes: %s"
              % [v[1][-200:] for v in res.values()])
        check("rank 0: its combine record for node 1" in c.log(0) and "has a wrong header"
              in c.log(0), "the daemon's log names the rank whose return was wrong")

        # a node whose ranks of one group mix the ring and the page: one phase (test_rankmix.py
        # has the rest)
        mix = page_job("mix", 1, 1, ranks=(0, 2, 3))
        ring = c.rank(1, "mix", 1, 1, 5)  # rank 1 submits on its ring
        passed(cluster.outputs(mix), "a group mixing ring and page ranks on a node")
        ring_out = c.collect([(1, ring)])[1]
        check("verified" in ring_out, "its ring rank verified its phase (%r)" % ring_out[-200:])

        for mode in ("die-plan", "die-done"):
            # die-done: the others go on to the combine (until), and the ones whose dispatch
            # ran through before rank 1 died hear of its failure there
            other = "one" if mode == "die-plan" else "until"
            res = cluster.outputs(page_job(mode.replace("-", ""), 1, 1,
                                   {r: other for r in range(nodes * c.gpus)} | {1: mode}))
            check(res[1][0] == 3 and "dying at" in res[1][1], "%s: rank 1 died" % mode)
            others = [res[r] for r in res if r != 1]
            check(all(v[0] == 0 and "%s: phase " % other in v[1] for v in others),
                  "%s: the other ranks' streams ran through: %s" % (mode, others))
            if mode == "die-plan":
                check(all("one: phase 1 failed" in v[1] for v in others),
                      "die-plan: the phase failed on every other rank")
            else:
                check(all("failed: phase failed: " in v[1] and "local rank 1" in v[1]
                          for v in others),
                      "die-done: every other rank's dispatch or combine failed with "
                      "RW_E_PHASE naming local rank 1: %s" % others)
                check(any("until: phase 2 failed" in v[1] for v in others),
                      "die-done: a rank beside rank 1 had its dispatch and heard at its "
                      "combine: %s" % others)
            passed(cluster.outputs(page_job("after" + mode.replace("-", ""), 1, 2)),
                   "after %s, a new group's phases" % mode)

        # the poller spins only while a rank-path phase runs: none runs now on either daemon
        for n in range(nodes):
            st = c.stats(n)
            busy = [l for l in st.splitlines() if l.startswith("rank_path_")]
            check("rank_path_busy 0\n" in st and "rank_path_phases 0\n" not in st,
                  "daemon %d: no rank-path phase in flight, the completed ones counted (%s)"
                  % (n, busy))

        try:
            c.collect(job)
            check(True, "the host job's 4 ranks passed every verified phase meanwhile")
        except RuntimeError as e:
            check(False, "the host job failed: %s" % e)

        # a group of page ranks running phases when daemon 1 is killed (below)
        peer = page_job("peer", 1, 1000000, {r: "until" for r in range(nodes * c.gpus)})
        line = peer[0][1].stdout.readline().decode()
        check("until: running" in line, "the page ranks of group peer run phases (%r)" % line)

        # daemon 1 killed while rank 2's stream waits for plan 1: its watcher owes the words
        wpg.slot(1)
        check(wpg.word(W_PLAN).value == 0, "rank 2 waits: plan 0 before its daemon dies")
        c.kill(1)
        deadline = time.time() + cluster.WAIT
        while time.time() < deadline and wpg.word(W_ARRIVED).value < OWED_AHEAD:
            time.sleep(0.005)
        check(wpg.word(W_PLAN).value >= OWED_AHEAD and wpg.word(W_ARRIVED).value >= OWED_AHEAD,
              "daemon killed: the rank's watcher raised plan and arrived 2^62 ahead")
        check(all(wpg.status(k) == E_CLOSED for k in range(DEPTH)),
              "daemon killed: every status RW_E_CLOSED")
        res = cluster.outputs(peer)
        check(all(v[0] == 0 and "until: phase" in v[1] and "failed" in v[1]
                  for v in res.values()),
              "daemon killed mid-run: every page rank's phase failed and its stream ran "
              "through (node 0: the daemon's words, node 1: the watcher's): %s" %
              {r: (v[0], v[1][-200:]) for r, v in res.items()})
        lib.rw_client_close(waiter)
        c.stop()
        check(True, "every daemon exited 0")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        cleanup(c, tmp)
    if KERN_DRIVER == FAKE_KERN and os.path.exists(FAKE_KERN):
        gpu_slabs_lib()
    return 1 if FAILS else 0


def cleanup(c, tmp):
    """Every daemon still running killed; the logs kept (and shown) when a check failed."""
    for n in list(c.procs):
        c.kill(n)
    if not FAILS:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print("logs kept in %s\n%s" % (tmp, c.logs()))


def gpu_slabs_lib():
    """8. The lib job on GPU slabs: daemons with the test hook RAILWAVE_TEST_GPUDIRECT=1 on the
    cross-process stand-in make each group's carve-out a CUDA allocation lent by fd
    (docs/rankpath.md "The slab areas, lent per group"); librailwave's rank path imports it and
    its kernels (the stand-in's) pack into and forward from it: 6 dispatches and their combines,
    every row, metadata entry, count and combined row verified; the daemons stop cleanly."""
    tmp = tempfile.mkdtemp(prefix="rw-rankpage-gpu-")
    nodes = 2
    c = cluster.Cluster(tmp, nodes, rails=2, extra={"group_area_mib": 1, "group_pool_mib": 10})
    c.env.update(RAILWAVE_TEST_GPUDIRECT="1", RW_CUDA_DRIVER=cluster.FAKE_CUDA)
    try:
        c.start_all()
        check(all("the groups' carve-outs in GPU 0's memory, lent by fd" in c.log(n)
                  for n in range(nodes)), "GPU slabs: both daemons make the groups' carve-outs "
              "GPU allocations")
        res = cluster.outputs([(r, c.pagerank(r, "libgpu", 2, 3, 5, "lib",
                                              dict(c.env, RW_CUDA_DRIVER=KERN_DRIVER)))
                               for r in range(nodes * c.gpus)])
        bad = {r: (v[0], v[1][-300:]) for r, v in res.items()
               if v[0] != 0 or "verified" not in v[1]}
        check(not bad, "GPU slabs: 6 dispatches and their combines through librailwave's rank "
              "path on imported GPU slabs, every rank verified %s" % (bad or ""))
        c.stop()
        check(True, "GPU slabs: every daemon exited 0")
    except RuntimeError as e:
        check(False, str(e))
    finally:
        cleanup(c, tmp)


if __name__ == "__main__":
    sys.exit(main())
