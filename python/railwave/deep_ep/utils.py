"""DeepEP's deep_ep.utils face: EventHandle and EventOverlap (docs/python.md "Megatron-Core").

An EventHandle is a point in a CUDA stream: made with no argument it marks the current stream
now, as DeepEP's does. Buffer returns an EventOverlap wrapping the event its communication
stream recorded after an operation's outputs were written (async_finish=True), or wrapping
nothing (async_finish=False: the current stream already waits for them). With host tensors there
is no stream: every event is complete when it is made and waiting on it does nothing."""
import torch

from ..errors import BadArgument, BadArgumentType


def _cuda_live():
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class EventHandle:
    """A CUDA event recorded on `stream` (default: the current stream) when made; None inside
    when CUDA is not in use in this process (a complete event)."""

    __slots__ = ("event",)

    def __init__(self, stream=None):
        self.event = None
        if stream is not None or _cuda_live():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    @classmethod
    def completed(cls):
        """An event that is already reached (host tensors: there is no stream)."""
        h = cls.__new__(cls)
        h.event = None
        return h

    def current_stream_wait(self):
        """Make the current stream wait for this point (no host wait)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def stream_wait(self, stream):
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)

    def synchronize(self):
        """Block the host until the point is reached."""
        if self.event is not None:
            self.event.synchronize()

    def query(self):
        return self.event is None or self.event.query()


class EventOverlap:
    """DeepEP's wrapper of an optional EventHandle plus tensors to keep alive until it is
    waited on. `with overlap:` runs the block and then makes the current stream wait."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is None:
            raise BadArgument("deep_ep: EventOverlap.current_stream_wait",
                              "this EventOverlap holds no event (the operation ran with "
                              "async_finish=False: the current stream already waits for it)")
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.event is not None:
            self.event.current_stream_wait()


def as_event(previous_event):
    """The EventHandle inside what a caller passed as previous_event (EventOverlap,
    EventHandle, torch.cuda.Event or None)."""
    if previous_event is None:
        return None
    if isinstance(previous_event, EventOverlap):
        return previous_event.event
    if isinstance(previous_event, EventHandle):
        return previous_event
    if hasattr(torch.cuda, "Event") and isinstance(previous_event, torch.cuda.Event):
        h = EventHandle.completed()
        h.event = previous_event
        return h
    raise BadArgumentType("deep_ep: previous_event", "an EventOverlap, EventHandle or "
                          "torch.cuda.Event, got %s" % type(previous_event).__name__)
