#!/usr/bin/env python3
"""The railwave package without a cluster (docs/python.md "Tests"):
  * its copies of ipc/railwave.h's wire values (error codes, kinds, dtypes, struct layout) equal
    the header's, so a change of the ABI cannot leave the binding behind unnoticed;
  * `pip install ./python` into a fresh virtual environment (offline: --no-build-isolation
    --no-index; Debian's torch through --system-site-packages) bundles this build's
    librailwave.so.1, and the installed package, imported from elsewhere, loads it;
  * joining without a daemon, or with arguments the library refuses, raises errors that say
    what failed; RAILWAVE_LIB naming a missing file is an error, not a silent fallback.

Run by tests/run as $b/test/python_package (test_package.py BUILDDIR). Exits 0/1/77."""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))


def header_values():
    text = open(os.path.join(SRC, "ipc", "railwave.h")).read()
    vals = {m.group(1): int(m.group(2)) for m in
            re.finditer(r"\b(RW_E_[A-Z_]+)\s*=\s*(-?\d+)", text)}
    for m in re.finditer(r"\b(RW_(?:KIND|DTYPE)_[A-Z0-9]+)\s*=\s*(\d+)", text):
        vals[m.group(1)] = int(m.group(2))
    for m in re.finditer(r"#define\s+(RW_[A-Z_]+)\s+(0x[0-9a-fA-F]+u?|\d+)\b", text):
        vals[m.group(1)] = int(m.group(2).rstrip("u"), 0)
    return vals


def check_abi(fails):
    from railwave import _lib
    from railwave.errors import CODES
    h = header_values()
    for name, v in CODES.items():
        if h.get(name) != v:
            fails.append("errors.CODES[%s] = %s, railwave.h says %s" % (name, v, h.get(name)))
    missing = sorted(n for n in h if n.startswith("RW_E_") and n not in CODES)
    if missing:
        fails.append("railwave.h codes unknown to the package: %s" % missing)
    for name, mine in [("RW_KIND_DISPATCH", _lib.KIND_DISPATCH), ("RW_KIND_COMBINE", _lib.KIND_COMBINE),
                       ("RW_DTYPE_BF16", _lib.DTYPE_BF16), ("RW_DTYPE_FP32", _lib.DTYPE_FP32),
                       ("RW_BUF_NONE", _lib.BUF_NONE),
                       ("RW_SQE_WAIT_EVENT", _lib.SQE_WAIT_EVENT), ("RW_SQE_SIGNAL", _lib.SQE_SIGNAL),
                       ("RW_SQE_ABORT", _lib.SQE_ABORT),
                       ("RW_CQE_INLINE_COUNTS", _lib.CQE_INLINE_COUNTS),
                       ("RW_GROUP_NAME_MAX", _lib.GROUP_NAME_MAX)]:
        if h.get(name) != mine:
            fails.append("%s: package %s, railwave.h %s" % (name, mine, h.get(name)))
    # Field offsets against the C compiler's view of the header.
    fields = {"rw_sqe_t": _lib.Sqe, "rw_cqe_t": _lib.Cqe, "rw_client_opts_t": _lib.Opts,
              "rw_client_cuda_desc_t": _lib.CudaDesc, "rw_span_t": _lib.Span,
              "rw_client_stream_t": _lib.ClientStream,
              "rw_client_rank_dispatch_t": _lib.RankDispatch,
              "rw_client_rank_combine_t": _lib.RankCombine,
              "rw_client_rank_done_t": _lib.RankDone, "rw_client_slab_t": _lib.ClientSlab,
              "rw_client_rank_check_t": _lib.RankCheck}
    prog = ['#include <stdio.h>', '#include <stddef.h>', '#include "ipc/railwave.h"', 'int main(void){']
    for cname, cls in fields.items():
        prog.append('printf("%s size %%zu\\n", sizeof(%s));' % (cname, cname))
        for f, _ in cls._fields_:
            prog.append('printf("%s %s %%zu\\n", offsetof(%s, %s));' % (cname, f, cname, f))
    prog.append("return 0;}")
    with tempfile.TemporaryDirectory() as d:
        c, exe = os.path.join(d, "abi.c"), os.path.join(d, "abi")
        open(c, "w").write("\n".join(prog))
        subprocess.run(["cc", "-I", SRC, "-o", exe, c], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        cname, f, v = line.split()
        cls = fields[cname]
        mine = ctypes.sizeof(cls) if f == "size" else getattr(cls, f).offset
        if mine != int(v):
            fails.append("%s.%s: ctypes %d, C %s" % (cname, f, mine, v))


def check_errors(fails, lib):
    import railwave
    try:
        railwave.Group("g", 0, 2, socket="/nonexistent/rw.sock", node=0)
        fails.append("Group() without a daemon did not raise")
    except railwave.ConnectError as e:
        if "/nonexistent/rw.sock" not in str(e) or e.name != "RW_E_CONNECT":
            fails.append("connect error does not name the socket and code: %s" % e)
    for args, kw, exc, needle in [
            (("g", 3, 2), dict(node=0), railwave.BadArgument, "rank 3 is not in"),
            (("g", 0, 2), dict(node="1"), railwave.BadArgumentType, "node must be an int"),
            (("g", 0, 2), dict(node=0, max_tokens_per_rank=0), railwave.BadArgument,
             "max_tokens_per_rank must be at least 1")]:
        try:
            railwave.Group(*args, socket="/nonexistent/rw.sock", **kw)
            fails.append("Group(%s, %s) did not raise" % (args, kw))
        except exc as e:
            if needle not in str(e):
                fails.append("Group(%s, %s): %s lacks %r" % (args, kw, e, needle))
    # An explicit RAILWAVE_LIB that is missing is an error naming it (no silent fallback).
    r = subprocess.run([sys.executable, "-c", "import railwave; railwave.library_path()"],
                       env=dict(os.environ, RAILWAVE_LIB="/nonexistent/librailwave.so.1",
                                PYTHONPATH=os.path.join(SRC, "python")),
                       capture_output=True, text=True)
    if r.returncode == 0 or "/nonexistent/librailwave.so.1 (absent)" not in r.stderr or \
            "LibraryNotFound" not in r.stderr:
        fails.append("a missing RAILWAVE_LIB was not reported: rc %d %s" % (r.returncode,
                                                                          r.stderr[-300:]))


def check_from_env(fails):
    """Group.from_env reads each launcher's variables: the join error (no daemon at the socket)
    names the group, rank, world size, node and socket it resolved."""
    import railwave
    sock = "/nonexistent/env.sock"
    cases = [
        ("torchrun", dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                          RAILWAVE_SOCKET=sock), ("moe",), {},
         "join group 'moe' as rank 5 of 8 (node 1) at " + sock),
        ("srun", dict(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_NODEID="1", SLURM_LOCALID="1",
                      RAILWAVE_SOCKET=sock), ("moe",), {},
         "join group 'moe' as rank 3 of 4 (node 1) at " + sock),
        ("srun --ntasks-per-node", dict(SLURM_PROCID="6", SLURM_NTASKS="8",
                                        SLURM_NTASKS_PER_NODE="4", SLURM_NODEID="0",
                                        RAILWAVE_SOCKET=sock), ("moe",), {},
         "join group 'moe' as rank 6 of 8 (node 1) at " + sock),
        ("railwave-run.sh", dict(SLURM_PROCID="9", SLURM_NTASKS="12", SLURM_NODEID="0",
                                 RAILWAVE_NODE="2", RAILWAVE_GROUP="job-77",
                                 RAILWAVE_SOCKET=sock), (), {},
         "join group 'job-77' as rank 9 of 12 (node 2) at " + sock),
        ("arguments win", dict(RANK="5", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4",
                               RAILWAVE_SOCKET="/nonexistent/other.sock"), ("moe",),
         dict(rank=1, node=3, socket=sock), "join group 'moe' as rank 1 of 8 (node 3) at " + sock),
    ]
    for what, env, args, kw, needle in cases:
        try:
            railwave.Group.from_env(*args, environ=env, **kw)
            fails.append("from_env (%s) did not raise without a daemon" % what)
        except railwave.ConnectError as e:
            if needle not in str(e):
                fails.append("from_env (%s): %s lacks %r" % (what, e, needle))
    for what, env, needle in [
            ("no rank", dict(WORLD_SIZE="2", RAILWAVE_NODE="0"), "needs rank and world_size"),
            ("no node", dict(RANK="1", WORLD_SIZE="2"), "cannot tell rank 1's node"),
            ("not an int", dict(RANK="one", WORLD_SIZE="2"), "RANK='one' is not an integer"),
            ("rank out of range", dict(RANK="2", WORLD_SIZE="2", RAILWAVE_NODE="0"),
             "rank 2 is not in [0, world_size 2)")]:
        try:
            railwave.Group.from_env("moe", environ=dict(env, RAILWAVE_SOCKET=sock))
            fails.append("from_env (%s) did not raise" % what)
        except railwave.BadArgument as e:
            if needle not in str(e):
                fails.append("from_env (%s): %s lacks %r" % (what, e, needle))
        except Exception as e:
            fails.append("from_env (%s): %s, not BadArgument: %s" % (what, type(e).__name__, e))
    try:
        railwave.Group.from_env(environ=dict(RANK="0", WORLD_SIZE="1", RAILWAVE_NODE="0"))
        fails.append("from_env without a name or RAILWAVE_GROUP did not raise")
    except railwave.BadArgument as e:
        if "RAILWAVE_GROUP" not in str(e):
            fails.append("from_env without a name: %s" % e)


def check_exceptions(fails):
    """Every exception the package exports is a RailWaveError, the ones Python's conventions
    want are also ValueError/TypeError/TimeoutError/OSError, codes map to their classes, and no
    module of the package raises a bare built-in exception (every raise names its meaning) nor
    makes a RailWaveError without (op, detail)."""
    import ast
    import builtins

    import railwave
    from railwave import errors
    for name in railwave.__all__:
        obj = getattr(railwave, name)
        if isinstance(obj, type) and issubclass(obj, BaseException) and \
                not issubclass(obj, railwave.RailWaveError):
            fails.append("railwave.%s is not a RailWaveError" % name)
    for cls, base in [(railwave.BadArgument, ValueError), (railwave.BadArgumentType, TypeError),
                      (railwave.BadArgumentType, railwave.BadArgument),
                      (railwave.Timeout, TimeoutError), (railwave.LibraryNotFound, OSError),
                      (railwave.WorldMismatch, railwave.ConnectError),
                      (railwave.PeerFailed, railwave.PhaseError),
                      (railwave.ReceiveRoomExceeded, railwave.PhaseError)]:
        if not issubclass(cls, base):
            fails.append("%s is not a %s" % (cls.__name__, base.__name__))
    C = errors.CODES
    for code, default, want in [
            (C["RW_E_WORLD_MISMATCH"], railwave.ConnectError, railwave.WorldMismatch),
            (C["RW_E_NODE_MISMATCH"], railwave.ConnectError, railwave.WorldMismatch),
            (C["RW_E_RANK_DUP"], railwave.ConnectError, railwave.RankTaken),
            (C["RW_E_GROUP_KEY"], railwave.ConnectError, railwave.GroupKeyMismatch),
            (C["RW_E_TIMEOUT"], railwave.ConnectError, railwave.ConnectError),
            (C["RW_E_PHASE"], railwave.PhaseError, railwave.PeerFailed),
            (C["RW_E_RANGE"], railwave.PhaseError, railwave.ReceiveRoomExceeded),
            (C["RW_E_FIELD"], railwave.PhaseError, railwave.PhaseError),
            (C["RW_E_CLOSED"], railwave.RailWaveError, railwave.DaemonLost),
            (C["RW_E_TIMEOUT"], railwave.RailWaveError, railwave.Timeout),
            (C["RW_E_STATE"], railwave.RailWaveError, railwave.PhaseInFlight)]:
        got = errors.class_for(code, default)
        if got is not want:
            fails.append("class_for(%s, %s) = %s, want %s" % (errors.NAMES[code], default.__name__,
                                                              got.__name__, want.__name__))
    e = railwave._lib.error(C["RW_E_PHASE"], "dispatch layer 1 step 2", "peer node 2 lost",
                            railwave.PhaseError)
    if not (isinstance(e, railwave.PeerFailed) and e.code == C["RW_E_PHASE"] and
            e.name == "RW_E_PHASE" and "dispatch layer 1 step 2" in str(e) and
            "peer node 2 lost" in str(e)):
        fails.append("_lib.error(RW_E_PHASE): %s %r" % (type(e).__name__, str(e)))
    # Python's protocols want these very classes (__getattr__, an import refused, an abstract
    # method): they are not errors the package decides.
    protocol = {"AttributeError", "ImportError", "NotImplementedError", "StopIteration"}
    builtin = {n for n, v in vars(builtins).items()
               if isinstance(v, type) and issubclass(v, BaseException)} - protocol
    pkg = os.path.join(SRC, "python", "railwave")
    from railwave.deep_ep import Unsupported
    ours = {n for n, v in vars(errors).items()
            if isinstance(v, type) and issubclass(v, errors.RailWaveError)} | {"Unsupported"}
    if not issubclass(Unsupported, errors.RailWaveError):
        fails.append("railwave.deep_ep.Unsupported is not a RailWaveError")
    for d, _, files in sorted(os.walk(pkg)):
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(d, f), pkg)
            if not f.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(d, f)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    x = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                    if isinstance(x, ast.Name) and x.id in builtin:
                        fails.append("python/railwave/%s:%d raises a bare %s"
                                     % (rel, node.lineno, x.id))
                # A RailWaveError names the operation in op and what failed in detail (two
                # arguments), so that callers and messages can tell them apart.
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                        node.func.id in ours and len(node.args) < 2 and not node.keywords:
                    fails.append("python/railwave/%s:%d: %s(...) without a detail (op, detail)"
                                 % (rel, node.lineno, node.func.id))


def check_rank_switches(fails):
    """RAILWAVE_RANK_PATH takes 0, 1 or nothing; the test switch that lets CPU tensors stand for
    device memory (RAILWAVE_TEST_HOST_AS_DEVICE) is refused unless RW_CUDA_DRIVER names the
    kernel stand-in, so it never hands host addresses to a real driver."""
    from railwave import _rank
    from railwave.errors import BadArgument
    for env, want in (({}, -1), ({"RAILWAVE_RANK_PATH": ""}, -1),
                      ({"RAILWAVE_RANK_PATH": "0"}, 0), ({"RAILWAVE_RANK_PATH": "1"}, 1)):
        if _rank.mode(env) != want:
            fails.append("RAILWAVE_RANK_PATH %s: mode %s, want %s" % (env, _rank.mode(env), want))
    for bad in ("yes", "2", "on"):
        try:
            _rank.mode({"RAILWAVE_RANK_PATH": bad})
            fails.append("RAILWAVE_RANK_PATH=%s accepted" % bad)
        except BadArgument as e:
            if "RAILWAVE_RANK_PATH" not in str(e):
                fails.append("RAILWAVE_RANK_PATH=%s: the error does not name it: %s" % (bad, e))
    stand_in = "/b/tests/integration/libfakecuda_kern.so"
    if _rank.host_as_device({"RW_CUDA_DRIVER": stand_in}) or _rank.host_as_device(
            {"RAILWAVE_TEST_HOST_AS_DEVICE": "0", "RW_CUDA_DRIVER": stand_in}):
        fails.append("host-as-device on without RAILWAVE_TEST_HOST_AS_DEVICE=1")
    if not _rank.host_as_device({"RAILWAVE_TEST_HOST_AS_DEVICE": "1", "RW_CUDA_DRIVER": stand_in}):
        fails.append("host-as-device off with the switch and the stand-in")
    for drv in (None, "libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                "/b/tests/cuda/libfakecuda.so"):
        env = {"RAILWAVE_TEST_HOST_AS_DEVICE": "1"}
        if drv:
            env["RW_CUDA_DRIVER"] = drv
        try:
            _rank.host_as_device(env)
            fails.append("RAILWAVE_TEST_HOST_AS_DEVICE=1 accepted with driver %s" % drv)
        except BadArgument as e:
            if "test switch" not in str(e):
                fails.append("host-as-device refusal does not say why: %s" % e)


def check_install(fails, lib):
    with tempfile.TemporaryDirectory(prefix="rwpip.") as d:
        # From a copy, as pip builds in the tree it is given (build/, *.egg-info).
        pkg = os.path.join(d, "python")
        shutil.copytree(os.path.join(SRC, "python"), pkg,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        venv = os.path.join(d, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        env = dict(os.environ, RAILWAVE_LIB=lib)  # what setup.py bundles
        env.pop("PYTHONPATH", None)
        r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index",
                            pkg], env=env, capture_output=True, text=True,
                           cwd=d)
        if r.returncode:
            fails.append("pip install ./python failed: %s" % (r.stdout + r.stderr)[-800:])
            return
        env.pop("RAILWAVE_LIB")
        r = subprocess.run([py, "-c", "import railwave, os; p = railwave.library_path(); "
                            "print(p); print(os.path.realpath(p))"],
                           env=env, capture_output=True, text=True, cwd=d)
        if r.returncode:
            fails.append("installed package does not import: %s" % r.stderr[-800:])
            return
        p = r.stdout.split()[0]
        if not p.startswith(venv) or not open(p, "rb").read() == open(lib, "rb").read():
            fails.append("installed package loads %s, not its bundled copy of %s" % (p, lib))
        print("ok   pip install ./python: loads %s" % p.replace(d, "$TMP"))


def check_static_permutation(fails):
    """railwave._core._permutation_static, the static backward's row matching (pure tensor
    code, no daemon): two room-sized dispatches with the same received rows in other orders
    and garbage metadata past their counts map each of A's rows to B's row of the same
    (source rank, token), rows past the count to rows past the count; other rows in B set the
    group's mismatch flag, the same rows leave it clear. 50 random cases."""
    import torch
    from railwave import _core
    g = torch.Generator().manual_seed(7)

    class Group:
        _static_bad = torch.zeros(1, dtype=torch.int32)

    def handle(src, n, room):
        h = _core.Handle.__new__(_core.Handle)
        meta = torch.randint(0, 1 << 20, (room, 2), generator=g, dtype=torch.int32)  # garbage
        meta[:n] = src
        h.group, h._src, h.num_recv, h.device = Group, meta, room, torch.device("cpu")
        h.recv_n = torch.tensor([n], dtype=torch.int32)
        return h

    for case in range(50):
        room = int(torch.randint(1, 40, (1,), generator=g))
        n = int(torch.randint(0, room + 1, (1,), generator=g))
        keys = torch.randperm(6 * 50, generator=g)[:n]
        src = torch.stack([keys // 50, keys % 50], 1).to(torch.int32)
        shuf = torch.randperm(n, generator=g)
        a, b = handle(src, n, room), handle(src[shuf], n, room)
        Group._static_bad.zero_()
        perm = _core._permutation_static(a, b)
        if not torch.equal(b._src[perm[:n]], a._src[:n]) or bool((perm[n:] < n).any()) or \
                sorted(perm.tolist()) != list(range(room)) or int(Group._static_bad):
            fails.append("static permutation case %d (room %d, %d rows) wrong: %s"
                         % (case, room, n, perm.tolist()))
            return
        if n:
            other = src.clone()
            other[int(torch.randint(0, n, (1,), generator=g)), 1] += 1000  # another token
            _core._permutation_static(a, handle(other, n, room))
            if not int(Group._static_bad):
                fails.append("static permutation case %d: other rows in B set no flag" % case)
                return


def main():
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(SRC, "build"))
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skip: no torch for %s (Debian: python3-torch, installed by scripts/setup)"
              % sys.executable)
        return 77
    lib = os.path.join(build, "lib", "librailwave.so.1")
    if not os.path.exists(lib):
        print("skip: %s not built" % lib)
        return 77
    os.environ["RAILWAVE_LIB"] = lib
    sys.path.insert(0, os.path.join(SRC, "python"))
    fails = []
    check_abi(fails)
    print("ok   wire values and struct layouts equal ipc/railwave.h" if not fails else "")
    n = len(fails)
    check_errors(fails, lib)
    if len(fails) == n:
        print("ok   errors name the socket, the rank, the node and a missing RAILWAVE_LIB")
    n = len(fails)
    check_from_env(fails)
    if len(fails) == n:
        print("ok   Group.from_env: torchrun, srun and railwave-run.sh variables; arguments win")
    n = len(fails)
    check_exceptions(fails)
    if len(fails) == n:
        print("ok   exceptions: one RailWaveError class per meaning, codes mapped, no bare raise")
    n = len(fails)
    check_rank_switches(fails)
    if len(fails) == n:
        print("ok   RAILWAVE_RANK_PATH 0/1/unset; the host-as-device test switch only on the "
              "kernel stand-in")
    n = len(fails)
    check_static_permutation(fails)
    if len(fails) == n:
        print("ok   static backward: rows matched by (source rank, token) on the device, rows "
              "past the count last, other rows flagged (50 random cases)")
    check_install(fails, lib)
    for f in fails:
        print("FAIL " + f)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
