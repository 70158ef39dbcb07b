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
                       ("RW_CQE_INLINE_COUNTS", _lib.CQE_INLINE_COUNTS),
                       ("RW_GROUP_NAME_MAX", _lib.GROUP_NAME_MAX)]:
        if h.get(name) != mine:
            fails.append("%s: package %s, railwave.h %s" % (name, mine, h.get(name)))
    # Field offsets against the C compiler's view of the header.
    fields = {"rw_sqe_t": _lib.Sqe, "rw_cqe_t": _lib.Cqe, "rw_client_opts_t": _lib.Opts,
              "rw_client_cuda_desc_t": _lib.CudaDesc, "rw_span_t": _lib.Span}
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
    for kw, needle in [(dict(rank=3, world_size=2), "rank 3 is not in"),
                       (dict(rank=0, world_size=2, node=None), "node")]:
        env = dict(os.environ)
        for k in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID", "GROUP_RANK",
                  "RAILWAVE_NODE"):
            os.environ.pop(k, None)
        try:
            railwave.Group("g", socket="/nonexistent/rw.sock", **kw)
            fails.append("Group(%s) did not raise" % kw)
        except ValueError as e:
            if needle not in str(e):
                fails.append("Group(%s): %s lacks %r" % (kw, e, needle))
        finally:
            os.environ.clear()
            os.environ.update(env)
    # An explicit RAILWAVE_LIB that is missing is an error naming it (no silent fallback).
    r = subprocess.run([sys.executable, "-c", "import railwave; railwave.library_path()"],
                       env=dict(os.environ, RAILWAVE_LIB="/nonexistent/librailwave.so.1",
                                PYTHONPATH=os.path.join(SRC, "python")),
                       capture_output=True, text=True)
    if r.returncode == 0 or "/nonexistent/librailwave.so.1 (absent)" not in r.stderr:
        fails.append("a missing RAILWAVE_LIB was not reported: rc %d %s" % (r.returncode,
                                                                          r.stderr[-300:]))


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
    check_install(fails, lib)
    for f in fails:
        print("FAIL " + f)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
