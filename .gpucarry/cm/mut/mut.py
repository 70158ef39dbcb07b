#!/usr/bin/env python3
"""Mutation check by hand (not a test): the cuda scenario on the real driver with a railwaved
whose kernels were deliberately broken must fail. argv: BUILD_DIR BROKEN_RAILWAVED NAME"""
import importlib.machinery, os, sys, tempfile
b, daemon, name = sys.argv[1:4]
td = importlib.machinery.SourceFileLoader("td", os.path.join(b, "test", "integration_dataflow")).load_module()
td.DAEMON = daemon
os.environ["RW_IT_CUDA"] = "real"
with tempfile.TemporaryDirectory(prefix="rwmut.", dir="/tmp") as tmp:
    try:
        td.scenario_cuda(tmp, 777)
    except Exception as e:
        print("mutation %s caught: %s" % (name, " | ".join(str(e).splitlines()[:2])[:300]))
        sys.exit(0)
print("mutation %s NOT caught" % name)
sys.exit(1)
