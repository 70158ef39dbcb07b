#!/usr/bin/env python3
"""Several GPUs per node (docs/cuda.md "Several GPUs"): two railwaved on loopback, G
ranks per node with CUDA buffers, local rank g's buffers on device g (rw_rank --cuda puts rank g
on device g mod the devices it sees), every forced path and the selector, and a node whose CUDA
and host-memory ranks sit side by side. The ranks check every dispatched row, every expert count
and every combined sum exactly (tests/integration/rw_rank.c), so a record several local ranks on
different devices computed must come back as their fp32 sum; each daemon must have loaded its
kernels on every device its ranks use (the CUDA mover carried the pairs there).

Without a GPU (CI) it runs on the multi-device stand-in (tests/integration/fake_cuda_mgpu.c:
$RW_FAKE_CUDA_DEVICES devices that enforce peer access and page-locked host memory the way real
CUDA does, over the kernel stand-in with its lag, RW_FAKE_CUDA_LAG_MS), for G = 2 and 4:
  * "peers granted": every context starts with peer access to every other device
    (RW_FAKE_CUDA_PEERS=all): the mover's multi-device bookkeeping, exact;
  * "as the daemon sets up": peer access only where the daemon enables it. A kernel touching
    another device's memory without it faults the context (the stand-in logs which kernel,
    device and address), as it would on a several-GPU host.
With the system's driver and a GPU (RW_IT_CUDA=real, or found) it runs the same scenario on the
real devices: one GPU holds every rank; four GPUs give each rank its own. Exits 0 pass, 1 fail,
77 skip (no stand-in built and no GPU). Also on the stand-in: two GPUs without a peer path
(the phase fails naming both, the daemons keep serving). RW_MGPU_ONLY=granted|strict|nop2p picks
the stand-in cases;
RW_MGPU_G=2,4 the ranks per node."""
import ctypes
import os
import random
import subprocess
import sys
import tempfile

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

FAKE_MGPU = os.path.join(B, "tests", "integration", "libfakecuda_mgpu.so")
FAULT = "fake cuda: kernel "
PATHS = ("native", "rail-only", "perm-only", "joint", "auto")


class Skip(Exception):
    pass


def real_devices():
    """(count, None) when libcuda loads and sees a device, else (0, why not)."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return 0, "no CUDA driver (%s)" % e
    if cu.cuInit(0) != 0:
        return 0, "cuInit failed"
    n = ctypes.c_int(0)
    if cu.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
        return 0, "no CUDA device"
    return n.value, None


def stand_in_self_check():
    """The multi-device stand-in refuses what a GPU refuses and allows what it allows, checked on
    the driver calls themselves (in this process, three devices): a kernel of device 1 reading
    device 0's memory faults the context (launch succeeds, the stream reports
    CUDA_ERROR_ILLEGAL_ADDRESS, nothing is written); after cuCtxEnablePeerAccess device 2 reads
    it exactly (a second enable: ALREADY_ENABLED); pageable host memory faults device 2; an
    allocation says which device holds it. Raises on any difference."""
    os.environ.update(RW_FAKE_CUDA_DEVICES="3", RW_FAKE_CUDA_LAG_MS="0")
    os.environ.pop("RW_FAKE_CUDA_PEERS", None)
    cu = ctypes.CDLL(FAKE_MGPU)
    vp, u64, u32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32
    cu.cuLaunchKernel.argtypes = [vp] + [ctypes.c_uint] * 7 + [vp, vp, vp]
    cu.cuCtxEnablePeerAccess.argtypes = [vp, ctypes.c_uint]
    cu.cuCtxSetCurrent.argtypes = [vp]
    cu.cuStreamSynchronize.argtypes = [vp]
    cu.cuMemcpyHtoD_v2.argtypes = cu.cuMemcpyDtoH_v2.argtypes = [vp, vp, ctypes.c_size_t]

    def ok(res, what):
        if res != 0:
            raise RuntimeError("stand-in self-check: %s returned %d" % (what, res))

    ok(cu.cuInit(0), "cuInit")
    ctx, mem, fn, st = [], [], [], []
    rows, row = 4, 64
    for d in range(3):
        c, p, f, m, s = vp(), u64(), vp(), vp(), vp()
        ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d), "retain")
        ok(cu.cuCtxSetCurrent(c), "set current")
        ok(cu.cuMemAlloc_v2(ctypes.byref(p), rows * row), "cuMemAlloc")
        ok(cu.cuMemcpyHtoD_v2(vp(p.value), bytes([d + 1] * rows * row), rows * row), "HtoD")
        ok(cu.cuModuleLoadData(ctypes.byref(m), b"x"), "module")
        ok(cu.cuModuleGetFunction(ctypes.byref(f), m, b"rw_copy_rows1"), "function")
        ok(cu.cuStreamCreate(ctypes.byref(s), 0), "stream")
        ctx.append(c), mem.append(p.value), fn.append(f), st.append(s)
        o = ctypes.c_int(-1)
        ok(cu.cuPointerGetAttribute(ctypes.byref(o), 9, u64(p.value)), "DEVICE_ORDINAL")
        if o.value != d:
            raise RuntimeError("stand-in self-check: device %d's memory says device %d" % (d, o.value))
    lst = vp()
    ok(cu.cuMemHostAlloc(ctypes.byref(lst), 16 * rows, 0), "cuMemHostAlloc")
    pageable = ctypes.create_string_buffer(rows * row)

    def copy(dev, src):
        """copy_rows on `dev` from src to device dev's memory: (launch, sync, dst bytes)."""
        ok(cu.cuCtxSetCurrent(ctx[dev]), "set current")
        ent = (u64 * (2 * rows))(*[v for i in range(rows) for v in (src + i * row, mem[dev] + i * row)])
        ctypes.memmove(lst.value, ent, 16 * rows)
        args = [u64(lst.value), u32(rows), u32(row)]
        params = (vp * 3)(*[ctypes.cast(ctypes.byref(a), vp) for a in args])
        launched = cu.cuLaunchKernel(fn[dev], 1, 1, 1, 1, 1, 1, 0, st[dev], params, None)
        synced = cu.cuStreamSynchronize(st[dev])
        out = ctypes.create_string_buffer(rows * row)
        ok(cu.cuMemcpyDtoH_v2(out, vp(mem[dev]), rows * row), "DtoH")
        return launched, synced, out.raw

    got = copy(1, mem[0])
    if got != (0, 700, bytes([2] * rows * row)):
        raise RuntimeError("stand-in self-check: device 1 reading device 0 without peer access: "
                           "launch %d, sync %d, rows changed %s" % (got[0], got[1], got[2] != bytes([2] * rows * row)))
    ok(cu.cuCtxSetCurrent(ctx[2]), "set current")
    ok(cu.cuCtxEnablePeerAccess(ctx[0], 0), "cuCtxEnablePeerAccess")
    if cu.cuCtxEnablePeerAccess(ctx[0], 0) != 704:
        raise RuntimeError("stand-in self-check: a second peer enable was not ALREADY_ENABLED")
    got = copy(2, mem[0])
    if got != (0, 0, bytes([1] * rows * row)):
        raise RuntimeError("stand-in self-check: device 2 with peer access to device 0: launch %d "
                           "sync %d, rows copied %s" % (got[0], got[1], got[2] == bytes([1] * rows * row)))
    got = copy(2, ctypes.addressof(pageable))
    if got[:2] != (0, 700):
        raise RuntimeError("stand-in self-check: a kernel reading pageable host memory: launch %d "
                           "sync %d" % got[:2])
    print("ok   stand-in self-check: no peer access -> ILLEGAL_ADDRESS and nothing written; "
          "cuCtxEnablePeerAccess -> exact copy; pageable host memory -> ILLEGAL_ADDRESS")


def run_case(top, seed, gpus, ndev, env, label):
    """Every path with every rank on CUDA, then a mixed node pair; raises on any failure with
    the stand-in's fault line (if any) first."""
    w = 2 * gpus
    runs = [(p, list(range(w))) for p in PATHS]
    runs += [("joint", [g for g in range(w) if g % gpus != 1]), ("auto", [1, w - 1])]
    for i, (path, cuda_ranks) in enumerate(runs):
        tmp = tempfile.mkdtemp(dir=top)  # the daemons' logs are appended to: one folder a run
        c = cluster.Cluster(tmp, 2, path=path, gpus=gpus)
        c.env.update(env)
        logs = []
        try:
            c.start_all()
            procs = [(r, c.rank(r, "g.mgpu", 2, 2, seed + i,
                                flags=["--empty"] + (["--cuda"] if r in cuda_ranks else [])))
                     for r in range(w)]
            try:
                outs = c.collect(procs)
            finally:
                logs = [open(os.path.join(tmp, "d%d.log" % n)).read() for n in (0, 1)]
        except Exception as e:
            faults = [l for log in logs for l in log.splitlines() if FAULT in l]
            # The ranks' own words (the whole story is in the daemons' logs, above).
            said = [l for l in str(e).splitlines() if " failed" in l and l.startswith("rank ")]
            first = said[0] if said else "\n".join(str(e).splitlines()[:3])
            raise RuntimeError("%s G=%d %s CUDA ranks %s: %s%s" % (
                label, gpus, path, cuda_ranks,
                ("stand-in: %s\n" % faults[0]) if faults else "", first))
        finally:
            c.stop()
        for r in cuda_ranks:
            if "(CUDA buffers)" not in outs[r]:
                raise RuntimeError("rank %d did not run with CUDA buffers: %s" % (r, outs[r]))
        if any("built without nvcc" in l for l in logs):
            raise Skip("this build embeds no kernels (no nvcc)")
        for n in (0, 1):
            # A pair is the CUDA mover's when its first submission is a CUDA rank's (docs/
            # dataflow.md "CUDA buffers"): on a node of CUDA ranks only, every device's kernels.
            mine = [r for r in cuda_ranks if r // gpus == n]
            devs = sorted({(r % gpus) % ndev for r in mine}) if len(mine) == gpus else []
            for d in devs:
                if "cuda mover: kernels loaded on device %d" % d not in logs[n]:
                    raise RuntimeError("%s G=%d %s: daemon %d never loaded kernels on device %d "
                                       "(its ranks there were not carried by the CUDA mover)\n%s"
                                       % (label, gpus, path, n, d, logs[n][-2000:]))
            if FAULT in logs[n]:
                raise RuntimeError("daemon %d: %s" % (n, [l for l in logs[n].splitlines()
                                                          if FAULT in l][0]))
        print("ok   %-22s G=%d %-9s CUDA ranks %s on devices %s (seed %d)"
              % (label, gpus, path, cuda_ranks, [(r % gpus) % ndev for r in cuda_ranks], seed + i))


def run_no_peer_path(top, seed):
    """Two GPUs that cannot reach each other (RW_FAKE_CUDA_NO_P2P=1: cuDeviceCanAccessPeer says
    no): the phase fails on every rank with both GPUs named, nothing faults, and the same
    daemons then carry a host-memory phase exactly."""
    tmp = tempfile.mkdtemp(dir=top)
    c = cluster.Cluster(tmp, 2, path="joint", gpus=2)
    c.env.update(RW_CUDA_DRIVER=FAKE_MGPU, RW_FAKE_CUDA_DEVICES="2", RW_FAKE_CUDA_NO_P2P="1")
    try:
        c.start_all()
        outs = c.collect([(r, c.rank(r, "g.nop2p", 1, 1, seed, mode="fail", flags=["--cuda"]))
                          for r in range(4)])
        for r, out in outs.items():
            if "failed as expected" not in out or "cannot reach GPU" not in out:
                raise RuntimeError("rank %d's error does not name the GPUs: %s" % (r, out.strip()))
        c.run_ranks("g.nop2p.host", layers=2, steps=1, seed=seed + 1)
        logs = [open(os.path.join(tmp, "d%d.log" % n)).read() for n in (0, 1)]
    finally:
        c.stop()
    if any(FAULT in l for l in logs):
        raise RuntimeError("a kernel faulted a device: %s" % [l for log in logs for l in
                                                            log.splitlines() if FAULT in l][0])
    said = sorted({o.strip().split("failed as expected: ")[-1][:110] for o in outs.values()})
    print("ok   stand-in, no peer path G=2: every rank failed naming the GPUs (%s); the daemons "
          "then carried a host phase" % said[0])


def main():
    if sys.argv[1:] == ["--self-check"]:
        try:
            stand_in_self_check()
        except Exception as e:
            print("FAIL %s" % e)
            return 1
        return 0
    if not cluster.built(cluster.DAEMON, cluster.RANK):
        print("skip: railwaved or rw_rank not built")
        return 77
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or random.randrange(1, 1 << 30)
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    sizes = [int(g) for g in os.environ.get("RW_MGPU_G", "2,4").split(",")]
    ndev, why = real_devices()
    if os.environ.get("RW_IT_CUDA") == "real" or ndev:
        if not ndev:
            print("FAIL: RW_IT_CUDA=real but %s" % why)
            return 1
        cases = [(g, ndev, {}, "real driver, %d GPU%s" % (ndev, "s" if ndev > 1 else ""))
                 for g in sizes]
    else:
        if not os.path.exists(FAKE_MGPU):
            print("skip: no GPU (%s) and no multi-device stand-in built" % why)
            return 77
        only = os.environ.get("RW_MGPU_ONLY", "")
        cases = []
        for g in sizes:
            base = {"RW_CUDA_DRIVER": FAKE_MGPU, "RW_FAKE_CUDA_DEVICES": str(g),
                    "RW_FAKE_CUDA_LAG_MS": "2"}
            if only in ("", "granted"):
                cases.append((g, g, dict(base, RW_FAKE_CUDA_PEERS="all"), "stand-in, peers granted"))
            if only in ("", "strict"):
                cases.append((g, g, base, "stand-in, daemon's peers"))
    failed = 0
    if not ndev:
        # In a process of its own: the stand-in's faults are per process. A sanitizer build's
        # stand-in needs its runtime loaded first (python3 is not built with it).
        env = dict(os.environ)
        asan = [l.split("=>")[1].split()[0] for l in subprocess.run(
            ["ldd", FAKE_MGPU], capture_output=True, text=True).stdout.splitlines()
            if "libasan" in l and "=>" in l]
        if asan:
            env.update(LD_PRELOAD=asan[0], ASAN_OPTIONS="detect_leaks=0")
        sys.stdout.flush()
        failed += subprocess.run([sys.executable, os.path.abspath(__file__), "--self-check"],
                                 env=env).returncode != 0
    with tempfile.TemporaryDirectory(prefix="rwmg.", dir="/tmp") as tmp:
        for gpus, nd, env, label in cases:
            try:
                run_case(tmp, seed, gpus, nd, env, label)
            except Skip as e:
                print("skip: %s" % e)
                return 77
            except Exception as e:
                print("FAIL %s" % e)
                failed += 1
        if not ndev and os.environ.get("RW_MGPU_ONLY", "") in ("", "nop2p"):
            try:
                run_no_peer_path(tmp, seed)
            except Exception as e:
                print("FAIL %s" % e)
                failed += 1
    if failed:
        print("FAIL: %d of %d cases (above)" % (failed, len(cases) + (not ndev)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
