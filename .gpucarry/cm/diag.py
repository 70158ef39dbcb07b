#!/usr/bin/env python3
"""Diagnosis by hand: the cuda scenario on the real driver with RAILWAVE_CUDA_MOVER=check (every
row the kernels copy is read back and compared); prints the daemons' check lines."""
import importlib.machinery, os, sys, tempfile, glob
b = sys.argv[1]
td = importlib.machinery.SourceFileLoader("td", os.path.join(b, "test", "integration_dataflow")).load_module()
os.environ["RW_IT_CUDA"] = "real"
os.environ["RAILWAVE_CUDA_MOVER"] = "check"
seed = int(sys.argv[2])
with tempfile.TemporaryDirectory(prefix="rwdiag.", dir="/tmp") as tmp:
    res = "passed"
    try:
        td.scenario_cuda(tmp, seed)
    except Exception as e:
        res = "FAILED: " + " | ".join(str(e).splitlines()[:6])[:900]
    print("diag seed %d: %s" % (seed, res))
    for f in sorted(glob.glob(os.path.join(tmp, "d*.log"))):
        lines = [l for l in open(f).read().splitlines() if "check" in l or "mapped" in l or "ERR" in l or "failed" in l]
        print("--- %s: %d lines" % (os.path.basename(f), len(lines)))
        for l in [l for l in lines if "differ" in l][:12] + [l for l in lines if "differ" not in l][:14]:
            print("   " + l[:330])
