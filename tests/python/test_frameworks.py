#!/usr/bin/env python3
"""railwave.deep_ep (DeepEP's V1 Buffer subset, what Megatron-Core's flex dispatcher calls) and
the railwave::dispatch/combine torch.library operators (what the TorchTitan dispatcher runs)
against real daemons (docs/python.md "Megatron-Core", "TorchTitan"): 2 railwaved on loopback,
2 rank processes per node (tests/python/deep_ep_rank.py) in a torch.distributed gloo group.

buffer: get_dispatch_layout's outputs, the fresh dispatch (rows, local ids, weights, aligned
counts), the forward combine, the cached dispatch and the combine with topk_weights (combine's
and dispatch's backward), fp32 and bf16, −1 top-k slots, a rank with no tokens, num_worst_tokens
padding, a second Buffer sharing the group, a frozen dispatch whose cached dispatch ends the
backward pair — equal to the one-process reference. errors: what RailWave cannot do raises
Unsupported, bad arguments TypeError/ValueError, on every rank alike and on one rank alone in
each phase (the others then get PhaseError at once, not the phase timeout), a num_worst_tokens
overflow, a late abort of a failed pair after a rank opened the next one (which must pass), a
strided subgroup refused; the Buffer serves on, with no barrier between a failed step and the
next. ops: two MoE steps through the operators (autograd) and the expert-major layout, output and
gradients equal, also under activation checkpointing and with a frozen router; steps without
a backward free their handles. The shim distribution (python/shim-deep_ep) has the release's
VERSION, makes `import deep_ep` give railwave.deep_ep and refuses to when a real DeepEP is
importable.

static: the Buffer on a static Group (the rank path's static mode on the kernel stand-in):
check_dispatch's forms with their host reads, and the sync-free form (num_worst_tokens = the
capacity) forward and backward, equal; num_worst_tokens below the capacity refused.

Run by tests/run as $b/test/python_frameworks; RW_PY_ONLY=buffer,errors,ops,shim,static picks
scenarios. Exits 0 pass, 1 fail, 77 skip."""
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import harness  # noqa: E402
import test_moe  # noqa: E402  (the daemons and the rank processes: its Cluster and Ranks)


class Ranks(test_moe.Ranks):
    """test_moe's rank processes running deep_ep_rank.py."""

    SCRIPT = os.path.join(HERE, "deep_ep_rank.py")


def scenario(td, tmp, ranks, nodes, seed, op):
    c = td.Cluster(tmp, nodes, path="auto", extra=test_moe.CARVE if op == "static" else
                   test_moe.PHASE_TIMEOUT)
    store = os.path.join(tmp, "store.%s" % op)
    try:
        c.start_all()
        outs = test_moe.check(ranks.run({
            "op": op, "group": "deep_ep." + op, "experts": nodes * td.GPUS * 2, "seed": seed,
            "store": store, "sockets": [n["ipc_socket"] for n in c.cfg["nodes"]]}), op, c)
    finally:
        c.stop()
    for r in sorted(outs):
        for line in outs[r]["log"] if r == 0 else outs[r]["log"][:1]:
            print("ok   %s rank %d: %s" % (op, r, line))


def scenario_shim(env):
    """The shim distribution on PYTHONPATH: `import deep_ep` is railwave.deep_ep; with a real
    DeepEP importable (a deep_ep_cpp module on the path) it refuses, naming it."""
    shim = os.path.join(SRC, "python", "shim-deep_ep")
    with open(os.path.join(SRC, "VERSION")) as f:
        version = f.read().strip()
    with open(os.path.join(shim, "pyproject.toml")) as f:
        meta = f.read()
    for line in ('version = "%s"' % version, 'dependencies = ["railwave==%s"]' % version):
        if line not in meta.splitlines():
            raise RuntimeError("python/shim-deep_ep/pyproject.toml lacks %r (VERSION is %s)"
                               % (line, version))
    print("ok   shim: version %s, requires railwave==%s (VERSION)" % (version, version))
    probe = ("import deep_ep, deep_ep.utils, railwave.deep_ep as r; "
             "assert deep_ep.Buffer is r.Buffer and deep_ep.utils.EventOverlap is "
             "r.EventOverlap; print('deep_ep is railwave.deep_ep')")
    e = dict(env, PYTHONPATH=shim + os.pathsep + env["PYTHONPATH"])
    p = subprocess.run([sys.executable, "-c", probe], env=e, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError("shim import failed:\n" + p.stdout + p.stderr)
    print("ok   shim: %s" % p.stdout.strip())
    with tempfile.TemporaryDirectory(prefix="rwshim.") as fake:
        open(os.path.join(fake, "deep_ep_cpp.py"), "w").close()
        e2 = dict(e, PYTHONPATH=fake + os.pathsep + e["PYTHONPATH"])
        p = subprocess.run([sys.executable, "-c", probe], env=e2, capture_output=True, text=True)
        if p.returncode == 0 or "a real DeepEP is installed" not in p.stderr:
            raise RuntimeError("the shim did not refuse beside a real DeepEP:\n%s%s"
                               % (p.stdout, p.stderr))
        p = subprocess.run([sys.executable, "-c", "import railwave.deep_ep as r; "
                            "r.use_as_deep_ep()"], env=e2, capture_output=True, text=True)
        if p.returncode == 0 or "refusing to stand in" not in p.stderr:
            raise RuntimeError("use_as_deep_ep() did not refuse beside a real DeepEP:\n%s%s"
                               % (p.stdout, p.stderr))
    print("ok   shim: refuses beside a real DeepEP (%s)" % p.stderr.strip().splitlines()[-1])


def scenario_static(td, build, tmp, env, nodes, seed):
    """The Buffer on a static Group (docs/python.md "Megatron-Core"), on librailwave's rank path
    with the kernel stand-in (CPU tensors standing for device memory, as test_moe's rank
    scenarios): the exception, or None (also after a skip line)."""
    renv = test_moe.stand_in_env(build, env)
    if renv is None:
        return None
    ranks = Ranks(nodes * td.GPUS, td.GPUS, renv)
    try:
        scenario(td, tmp, ranks, nodes, seed, "static")
    except Exception as e:
        return e
    finally:
        ranks.stop()
    return None


def main():
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(SRC, "build"))
    torch = harness.torch_or_skip()
    if torch is None:
        return 77
    if not torch.distributed.is_available():
        print("skip: this torch has no torch.distributed")
        return 77
    lib = os.path.join(build, "lib", "librailwave.so.1")
    if not (os.access(os.path.join(build, "railwaved"), os.X_OK) and os.path.exists(lib)):
        print("skip: railwaved or librailwave.so.1 not built in %s" % build)
        return 77
    td = test_moe.load_cluster(build)
    only = [s for s in os.environ.get("RW_PY_ONLY", "buffer,errors,ops,shim,static").split(",")
            if s]
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or int(time.time()) % 100000 + 1
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    env = dict(os.environ, RAILWAVE_LIB=lib, OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.join(SRC, "python") + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    nodes = 2
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rwfw.", dir="/tmp") as tmp:
        ranks = Ranks(nodes * td.GPUS, td.GPUS, env)
        failed = None
        try:
            for op in [o for o in ("buffer", "errors", "ops") if o in only]:
                scenario(td, tmp, ranks, nodes, seed, op)
            if "shim" in only:
                scenario_shim(env)
        except Exception as e:
            failed = e
        ranks.stop()
        if failed is None and "static" in only:
            failed = scenario_static(td, build, tmp, env, nodes, seed)
        if failed is not None:
            print("FAIL %s" % failed)
            return 1
    print("python_frameworks: %.1f s" % (time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
