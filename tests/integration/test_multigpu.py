#!/usr/bin/env python3
"""Several GPUs per node (issue 18; docs/cuda.md "Several GPUs"): two railwaved on loopback, G
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
77 skip (no stand-in built and no GPU). RW_MGPU_ONLY=granted|strict picks the stand-in cases;
RW_MGPU_G=2,4 the ranks per node."""
import ctypes
import importlib.machinery
import os
import random
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
B = os.path.dirname(HERE)
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


def run_case(td, tmp, seed, gpus, ndev, env, label):
    """Every path with every rank on CUDA, then a mixed node pair; raises on any failure with
    the stand-in's fault line (if any) first."""
    td.GPUS = gpus  # test_dataflow's Cluster and rank() read it
    w = 2 * gpus
    runs = [(p, list(range(w))) for p in PATHS]
    runs += [("joint", [g for g in range(w) if g % gpus != 1]), ("auto", [1, w - 1])]
    for i, (path, cuda_ranks) in enumerate(runs):
        c = td.Cluster(tmp, 2, path=path)
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
            raise RuntimeError("%s G=%d %s CUDA ranks %s: %s%s" % (
                label, gpus, path, cuda_ranks,
                ("stand-in: %s\n" % faults[0]) if faults else "", e))
        finally:
            c.stop()
        for r in cuda_ranks:
            if "(CUDA buffers)" not in outs[r]:
                raise RuntimeError("rank %d did not run with CUDA buffers: %s" % (r, outs[r]))
        if any("built without nvcc" in l for l in logs):
            raise Skip("this build embeds no kernels (no nvcc)")
        for n in (0, 1):
            devs = sorted({(r % gpus) % ndev for r in cuda_ranks if r // gpus == n})
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


def main():
    td = importlib.machinery.SourceFileLoader(
        "test_dataflow", os.path.join(HERE, "integration_dataflow")).load_module()
    if not (os.access(td.DAEMON, os.X_OK) and os.access(td.RANK, os.X_OK)):
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
    with tempfile.TemporaryDirectory(prefix="rwmg.", dir="/tmp") as tmp:
        for gpus, nd, env, label in cases:
            try:
                run_case(td, tmp, seed, gpus, nd, env, label)
            except Skip as e:
                print("skip: %s" % e)
                return 77
            except Exception as e:
                print("FAIL %s" % e)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
