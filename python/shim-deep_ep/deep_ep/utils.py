"""deep_ep.utils served by RailWave (railwave.deep_ep.utils)."""
from railwave.deep_ep.utils import EventHandle, EventOverlap  # noqa: F401
