"""Bundles the C client library into the package when the build tree has it, so an installed
railwave needs no RAILWAVE_LIB (railwave/_lib.py says where it looks). The metadata is in
pyproject.toml."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SONAME = "librailwave.so.1"


class BuildPy(build_py):
    def run(self):
        super().run()
        src = os.environ.get("RAILWAVE_LIB") or os.path.join(HERE, "..", "build", "lib", SONAME)
        if os.path.isdir(src):
            src = os.path.join(src, SONAME)
        if os.path.exists(src):
            dst = os.path.join(self.build_lib, "railwave", SONAME)
            shutil.copyfile(os.path.realpath(src), dst)
            print("railwave: bundled %s" % os.path.realpath(src))
        else:
            print("railwave: %s not found (build the C tree first, or set RAILWAVE_LIB); the "
                  "package will look for the system's %s" % (src, SONAME))


setup(cmdclass={"build_py": BuildPy})
