"""railwave.deep_ep: DeepEP's V1 Buffer API (the subset Megatron-Core's flex dispatcher calls)
over a railwave.Group, so a framework that imports `deep_ep` runs its expert-parallel
dispatch/combine through railwaved (docs/python.md "Megatron-Core").

It is importable as `deep_ep` only on purpose: install the shim distribution in
python/shim-deep_ep (pip install ./python/shim-deep_ep), or call use_as_deep_ep() before the
framework imports it. Both refuse when a real DeepEP is importable."""
import importlib.util
import sys

from . import utils
from .buffer import Buffer, Config, Handle, Unsupported
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "Handle", "Unsupported",
           "use_as_deep_ep", "real_deep_ep"]


def real_deep_ep(skip=None):
    """Where a real DeepEP is installed (its deep_ep_cpp extension, or a deep_ep package that
    is not railwave's), else None. skip: a folder to ignore (the shim's own)."""
    spec = importlib.util.find_spec("deep_ep_cpp")
    if spec is not None:
        return spec.origin
    import os
    for entry in sys.path:
        d = os.path.join(entry or ".", "deep_ep")
        init = os.path.join(d, "__init__.py")
        if os.path.isfile(init) and (skip is None or os.path.realpath(d) != skip):
            with open(init, errors="replace") as f:
                if "railwave.deep_ep" not in f.read(4096):
                    return d
    return None


def use_as_deep_ep():
    """Make `import deep_ep` and `import deep_ep.utils` give this module, for a process that
    did not install the shim distribution. Raises ImportError when a real DeepEP is importable
    (never shadows it) or another deep_ep is already imported."""
    cur = sys.modules.get("deep_ep")
    if cur is not None and getattr(cur, "RAILWAVE", False):
        return
    if cur is not None:
        raise ImportError("railwave.deep_ep: a deep_ep module is already imported (%s)"
                          % getattr(cur, "__file__", cur))
    real = real_deep_ep()
    if real is not None:
        raise ImportError("railwave.deep_ep: a real DeepEP is installed (%s); refusing to stand "
                          "in for it" % real)
    me = sys.modules[__name__]
    me.RAILWAVE = True
    sys.modules["deep_ep"], sys.modules["deep_ep.utils"] = me, utils
