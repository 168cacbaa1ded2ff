"""`torch.remote_accelerator.Stream` / `Event`, with the API of `torch.cuda.Stream` / `Event`.

A stream is an ordered queue of work on a remote device; stream 0 is the
default. The current stream is per thread and per device, as in CUDA, and ops
captured while a stream is current run on it (a CUDA stream each on a GPU
daemon). Cross-stream dependencies are expressed with events. Before a wait on
an event (or a stream), the recording stream's queued ops are sent, so the
daemon always sees a record before a wait that depends on it.
"""
from __future__ import annotations

import contextlib
import itertools
import time

import torch

from genie.runtime import get_runtime
from genie.runtime.stream import current_stream_id, set_current_stream_id

EVENT_RECORD_OP, EVENT_WAIT_OP = "genie::event_record", "genie::event_wait"

_stream_ids = itertools.count(1)
_event_ids = itertools.count(1)


def _device_index(device) -> int:
    rt = get_runtime()
    if device is None:
        return rt.current_device
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return rt.current_device if d.index is None else d.index


class Stream:
    def __init__(self, device=None, priority: int = 0, *, _stream_id: int | None = None) -> None:
        self.device_index = _device_index(device)
        self.device = torch.device("remote_accelerator", self.device_index)
        self.priority = priority
        self.stream_id = next(_stream_ids) if _stream_id is None else _stream_id
        self._mark: tuple[int, Event] | None = None  # (ops captured on the device then, event recorded)

    @property
    def _queue(self):
        return get_runtime().stream(self.device_index)

    def _enqueue(self, entry: list) -> None:
        q = self._queue
        previous = current_stream_id(self.device_index)
        set_current_stream_id(self.device_index, self.stream_id)
        try:
            with q.lock:
                q.append(entry)
        finally:
            set_current_stream_id(self.device_index, previous)

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def _completion_event(self) -> "Event":
        """An event after all work queued so far (reused while nothing new was queued)."""
        captured = self._queue.ops_captured
        if self._mark is None or self._mark[0] != captured:
            event = self.record_event()
            self._mark = (self._queue.ops_captured, event)
        return self._mark[1]

    def query(self) -> bool:
        """True when all work queued on this stream so far has completed."""
        return self._completion_event().query()

    def synchronize(self) -> None:
        self._completion_event().synchronize()

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and (self.device_index, self.stream_id) == (other.device_index, other.stream_id)

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.remote_accelerator.Stream device={self.device} stream_id={self.stream_id}>"


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        if interprocess:
            raise NotImplementedError("interprocess events are not supported on remote_accelerator")
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.event_id = next(_event_ids)
        self._stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        self._stream = stream
        stream._enqueue([EVENT_RECORD_OP, [self.event_id, self.enable_timing], {}, None])

    def wait(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        if self._stream is not None:
            self._stream._queue.flush()  # the record reaches the daemon before the wait
        stream._enqueue([EVENT_WAIT_OP, [self.event_id], {}, None])

    def query(self) -> bool:
        if self._stream is None:
            return True  # never recorded: nothing to wait for, as with CUDA events
        q = self._stream._queue
        q.flush()
        done = q.link.request("event", {"query": [self.event_id]}).body["done"][0]
        return bool(done)

    def synchronize(self) -> None:
        if self._stream is None:
            return
        delay = 1e-4
        while not self.query():
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between this event and `end_event` (both recorded with enable_timing=True)."""
        if self._stream is None or end_event._stream is None:
            raise RuntimeError("both events must be recorded before calling elapsed_time()")
        self.synchronize()
        end_event.synchronize()
        return float(self._stream._queue.link.request(
            "event", {"elapsed": [self.event_id, end_event.event_id]}).body["ms"])

    def __repr__(self) -> str:
        return f"<torch.remote_accelerator.Event id={self.event_id}>"


def current_stream(device=None) -> Stream:
    index = _device_index(device)
    return Stream(index, _stream_id=current_stream_id(index))


def default_stream(device=None) -> Stream:
    return Stream(_device_index(device), _stream_id=0)


def set_stream(stream: Stream) -> None:
    set_current_stream_id(stream.device_index, stream.stream_id)


@contextlib.contextmanager
def stream(s: Stream | None):
    """Like torch.cuda.stream: make `s` current (on its device) inside the block; None does nothing."""
    if s is None:
        yield
        return
    previous = current_stream_id(s.device_index)
    set_current_stream_id(s.device_index, s.stream_id)
    try:
        yield s
    finally:
        set_current_stream_id(s.device_index, previous)
