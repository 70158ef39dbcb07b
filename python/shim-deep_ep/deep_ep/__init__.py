"""deep_ep served by RailWave: this distribution (railwave-deep-ep) exists so that frameworks
which `import deep_ep` (Megatron-Core's flex dispatcher, deepep backend) run on
railwave.deep_ep. It refuses to import when a real DeepEP is installed, so it never shadows one
silently (docs/python.md "Megatron-Core")."""
import os

import railwave.deep_ep as _rw

_real = _rw.real_deep_ep(skip=os.path.dirname(os.path.realpath(__file__)))
if _real is not None:
    raise ImportError("deep_ep (railwave-deep-ep): a real DeepEP is installed too (%s); "
                      "uninstall one of the two (pip uninstall railwave-deep-ep)" % _real)

from railwave.deep_ep import (Buffer, Config, EventHandle, EventOverlap,  # noqa: E402
                              Handle, Unsupported)
from . import utils  # noqa: E402,F401

RAILWAVE = True
__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "Handle", "Unsupported"]
