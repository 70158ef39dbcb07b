#!/usr/bin/env python3
"""The failure scenarios of the integration test with CUDA ranks on the CUDA mover (a peer
killed mid-phase, a rank killed mid-phase, with the kernels carrying the bytes): every
rank of every cluster registers device memory (rw_rank --cuda), and each scenario of
tests/integration/test_dataflow.py named below runs as it does with host ranks — a peer daemon
killed while the ranks wait for its counts, a peer killed with rail writes in flight (Native at
N = 3, Joint at N = 4, large rows), a rank killed mid-phase, a phase that times out, a rail cut
mid-phase and the paths' exact runs — and then every daemon's log must say the CUDA mover loaded
its kernels and mapped its slabs, i.e. the kernels, not the host mover, carried the pairs and
were quiesced by the failures.

Without a GPU (CI) the kernels run on the stand-in (tests/integration/fake_cuda_kernels.c) with
its lag (copies, kernels and marks late, in order, on a worker thread), so a pair freed or an
output reported while the mover still works on it leaves stale bytes the next phase's exact
checks catch, and the ASan build catches a use after free; its legacy stream is slower still, so
a rank whose buffer fill was not waited for gets its inputs zeroed. RW_IT_CUDA=real uses the system's
driver and GPU (docs/perf/runs/gpu-e2e.md). A build without kernels (no nvcc) skips (exit 77).
Run by tests/run as $b/test/integration_faults_cuda. RW_IT_ONLY picks scenarios."""
import os
import random
import sys

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
sys.path.insert(0, os.path.join(B, "tests", "integration"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)
import test_dataflow as it  # noqa: E402  (its scenarios, run here with CUDA ranks)

SCENARIOS = [("paths", it.scenario_paths), ("peer", it.scenario_peer_dies),
             ("flight", it.scenario_in_flight), ("rank", it.scenario_rank_dies),
             ("timeout", it.scenario_timeout), ("rail", it.scenario_rail)]


def carried(tmp, name):
    """Every daemon log of the scenario says the CUDA mover carried its pairs."""
    logs = sorted(f for f in os.listdir(tmp) if f.startswith("d") and f.endswith(".log"))
    if not logs:
        raise RuntimeError("%s: no daemon log" % name)
    for f in logs:
        text = open(os.path.join(tmp, f)).read()
        if "cuda mover: kernels loaded" not in text or "mapped into the GPUs" not in text:
            raise RuntimeError("%s: %s does not say the CUDA mover carried the pairs:\n%s"
                               % (name, f, text[-3000:]))
    return len(logs)


def main():
    real = os.environ.get("RW_IT_CUDA") == "real"
    if not cluster.built(cluster.DAEMON, cluster.RANK):
        print("skip: railwaved or rw_rank not built")
        return 77
    if not real and not os.path.exists(cluster.FAKE_KERN):
        print("skip: no GPU and no kernel stand-in built")
        return 77
    cuda_ranks = "real" if real else cluster.FAKE_KERN
    if not real:
        os.environ.setdefault("RW_FAKE_CUDA_LAG_MS", "1")
        # The legacy stream much slower: a rank's buffer fill (cuMemsetD8, asynchronous on the
        # legacy stream) lands on its inputs unless rw_cuda_memset_d8 waits for it, as it did on
        # the H200 (docs/perf/runs/gpu-e2e.md, fourth session).
        os.environ.setdefault("RW_FAKE_CUDA_LEGACY_LAG_MS", "50")
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or random.randrange(1, 1 << 30)
    print("seed %d (RW_TEST_SEED=%d reproduces); CUDA ranks on the %s" %
          (seed, seed, "system's driver" if real else "kernel stand-in"))
    for name, fn, tmp in cluster.picked(SCENARIOS, "rwfc."):
        try:
            fn(tmp, seed, cuda_ranks=cuda_ranks)
            if not real and any("built without nvcc" in open(os.path.join(tmp, f)).read()
                                for f in os.listdir(tmp) if f.endswith(".log")):
                print("skip: this build embeds no kernels (no nvcc)")
                return 77
            n = carried(tmp, name)
        except Exception as e:  # report and fail
            print("FAIL %s: %s" % (name, e))
            return 1
        print("     (%s: the CUDA mover carried the pairs on all %d daemons)" % (name, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
