#!/usr/bin/env python3
"""The CUDA data mover on a real GPU (docs/dataflow.md "CUDA buffers"): the integration test's
cuda scenario (two railwaved, ranks with CUDA buffers, every forced path and the selector, CUDA
and host-memory ranks side by side, every row, count and combined sum checked exactly by the
ranks) with the system's driver, for three row shapes: hidden 24 (16-byte vector kernels), hidden
7 (14- and 28-byte rows: the byte kernels) and hidden 4096 x 128 tokens. Each daemon must say that
it loaded its kernels and mapped its slabs into the GPU, i.e. that the CUDA mover carried the
pairs, not the host mover.

Without a usable CUDA driver and device (CI) it checks the mover's ordering on a slow stand-in GPU
instead: the kernel stand-in (tests/integration/fake_cuda_kernels.c) with RW_FAKE_CUDA_LAG_MS, whose
copies, kernels and marks run late, in order, on a worker thread. A write posted before the pack
kernels finished, a row forwarded before it arrived or an output reported before it was written
would leave stale bytes that the ranks' exact checks catch. The daemons' blocking waits are
counted from the stand-in's "cuStreamSynchronize blocked" lines: with an executor that waits for
the mover's pack report there must be none. A build without kernels (no nvcc) skips (exit 77).
Run by tests/run as $b/test/cuda_mover; on the GPU machine see docs/perf/cuda-mover.md."""
import ctypes
import os
import random
import sys
import tempfile

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
sys.path.insert(0, os.path.join(B, "tests", "integration"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)
import test_dataflow as td  # noqa: E402  (its CUDA scenario, run here on the CUDA mover)


def gpu_reason():
    """None when libcuda loads, initialises and sees a device, else why not."""
    try:
        cu = ctypes.CDLL(os.environ.get("RW_CUDA_DRIVER") or "libcuda.so.1")
    except OSError as e:
        return "no CUDA driver (%s)" % e
    if cu.cuInit(0) != 0:
        return "cuInit failed"
    n = ctypes.c_int(0)
    if cu.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
        return "no CUDA device"
    return None


SYNC_LINE = "fake cuda: cuStreamSynchronize blocked"
ASYNC_LINE = "cuda mover: the dispatch pack is asynchronous"


def stand_in_ordering(seed, why):
    """The CUDA mover on a slow stand-in GPU (no real one here: `why`)."""
    if not os.path.exists(cluster.FAKE_KERN):
        print("skip: no GPU (%s) and no kernel stand-in built" % why)
        return 77
    os.environ["RW_FAKE_CUDA_LAG_MS"] = "3"
    runs = [("joint", [0, 1, 2, 3]), ("perm-only", [0, 1, 2, 3]), ("auto", [1, 2])]
    with tempfile.TemporaryDirectory(prefix="rwcm.", dir="/tmp") as tmp:
        try:
            if not td.scenario_cuda_runs(tmp, seed, False, runs, "slow stand-in", cluster.FAKE_KERN):
                return 77
        except Exception as e:
            print("FAIL cuda mover on a slow stand-in GPU: %s" % e)
            return 1
        logs = [open(os.path.join(tmp, "d%d.log" % n)).read() for n in (0, 1)]
    waits = [l.count(SYNC_LINE) for l in logs]
    if not all(ASYNC_LINE in l for l in logs):
        print("FAIL: the daemons never said that the dispatch pack is asynchronous")
        return 1
    if any(waits):
        print("FAIL: the executor waits for pack reports, yet the daemons blocked on their "
              "streams %s times" % waits)
        return 1
    print("ok   no daemon blocked its loop on a stream (asynchronous pack)")
    return 0


def main():
    if not cluster.built(cluster.DAEMON, cluster.RANK):
        print("skip: railwaved or rw_rank not built")
        return 77
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or random.randrange(1, 1 << 30)
    why = gpu_reason()
    if why:
        print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
        return stand_in_ordering(seed, why)
    os.environ["RW_IT_CUDA"] = "real"
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    for flags, recv_mib in [("", 16), ("--hidden 7", 16), ("--hidden 4096 --tokens 128", 128)]:
        os.environ["RW_IT_RANK_FLAGS"] = flags
        os.environ["RW_IT_RECV_MIB"] = str(recv_mib)
        with tempfile.TemporaryDirectory(prefix="rwcm.", dir="/tmp") as tmp:
            try:
                td.scenario_cuda(tmp, seed)
            except Exception as e:
                print("FAIL cuda mover (%s): %s" % (flags or "hidden 24", e))
                return 1
            for n in (0, 1):
                with open(os.path.join(tmp, "d%d.log" % n)) as f:
                    log = f.read()
                for want in ("cuda mover: kernels loaded on device", "mapped into the GPUs",
                             "count rows come from the GPU"):
                    if want not in log:
                        print("FAIL: daemon %d never said '%s': the CUDA mover did not carry its "
                              "pairs\n%s" % (n, want, log[-3000:]))
                        return 1
        print("ok   CUDA mover carried every pair (%s)" % (flags or "hidden 24"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
