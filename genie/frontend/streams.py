"""`torch.remote_accelerator.Stream` / `Event`, with the API of `torch.cuda.Stream` / `Event`.

A stream is an ordered queue of work on a remote device; stream 0 is the
default. The current stream is per thread and per device, as in CUDA, and ops
captured while a stream is current run on it (a CUDA stream each on a GPU
daemon). Cross-stream dependencies are expressed with events. Before a wait on
an event (or a stream), the recording stream's queued ops are sent, so the
daemon always sees a record before a wait that depends on it.

These streams are PyTorch's streams of the device (a Stream is a torch.Stream;
the C++ device guard's current stream is Genie's), so PyTorch's device-generic
API acts on the remote work: `torch.accelerator.synchronize()` / `set_stream()` /
`current_stream()`, `torch.Stream` and `torch.Event` (through the hooks below),
`t.record_stream(s)`, and the autograd engine, which runs each op's backward on
the stream its forward ran on.
"""
from __future__ import annotations

import contextlib
import itertools
import time

import torch

from genie.runtime import get_runtime
from genie.runtime.stream import current_stream_id, set_current_stream_id
from genie.transport.protocol import EVENT_RECORD_OP, EVENT_WAIT_OP, RECORD_STREAM_OP

from . import native_guard

_stream_ids = itertools.count(1)  # without the C++ guard (whose count torch.Stream shares)
_event_ids = itertools.count(1)
_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)  # torch.Stream's device_type of remote_accelerator


def _device_index(device) -> int:
    rt = get_runtime()
    if device is None:
        return rt.current_device
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return rt.current_device if d.index is None else d.index


def _make_current(device_index: int, stream_id: int) -> None:
    set_current_stream_id(device_index, stream_id)
    native_guard.set_current_stream(device_index, stream_id)


class Stream(torch.Stream):
    """A stream of a remote device; `torch.Stream(device="remote_accelerator")` makes one too, and
    every Genie call that takes a stream accepts either."""

    def __new__(cls, device=None, priority: int = 0, *, _stream_id: int | None = None):
        index = _device_index(device)
        if _stream_id is None:
            _stream_id = native_guard.new_stream_id()
            if _stream_id is None:
                _stream_id = next(_stream_ids)
        return super().__new__(cls, stream_id=_stream_id, device_index=index, device_type=_PRIVATEUSE1)

    def __init__(self, device=None, priority: int = 0, *, _stream_id: int | None = None) -> None:
        self.priority = priority
        self._previous: list[int] = []  # the streams current before each `with` of this one

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

    def _completion_event(self) -> list | None:
        """[ops covered, event, seen complete]: an event recorded after all work queued on this
        stream so far (reused while nothing new is queued); None when all of it is known to have
        completed, or there never was any: that needs no round trip."""
        q = self._queue
        q.flush()
        last = q.last_op_on.get(self.stream_id, 0)
        mark = q.completion_marks.get(self.stream_id)
        if last == 0 or mark is not None and mark[2] and mark[0] >= last:
            return None
        if mark is None or mark[0] < last:
            event = self.record_event()
            q.flush()
            mark = q.completion_marks[self.stream_id] = [q.last_op_on[self.stream_id], event, False]
        return mark

    def _known_complete_to(self, ops_covered: int, event: "Event") -> None:
        """An event recorded on this stream completed: the work queued before it did too, so a
        query that asks no more than that needs no new event (nor its round trip)."""
        marks = self._queue.completion_marks
        mark = marks.get(self.stream_id)
        if mark is None or mark[0] < ops_covered or mark[0] == ops_covered and not mark[2]:
            marks[self.stream_id] = [ops_covered, event, True]

    def query(self) -> bool:
        """True when all work queued on this stream so far has completed (answered at once)."""
        mark = self._completion_event()
        if mark is None:
            return True
        mark[2] = mark[1].query()
        return mark[2]

    def synchronize(self) -> None:
        mark = self._completion_event()
        if mark is not None:
            mark[1].synchronize()
            mark[2] = True

    def __enter__(self) -> "Stream":
        self._previous.append(current_stream_id(self.device_index))
        _make_current(self.device_index, self.stream_id)
        return self

    def __exit__(self, *exc) -> None:
        _make_current(self.device_index, self._previous.pop())

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
        self._covers = 0  # ops_captured of its stream's queue at the record: the work it follows

    def record(self, stream: torch.Stream | None = None) -> None:
        stream = current_stream() if stream is None else _as_stream(stream)
        self._stream = stream
        stream._enqueue([EVENT_RECORD_OP, [self.event_id, self.enable_timing], {}, None])
        self._covers = stream._queue.ops_captured

    def wait(self, stream: torch.Stream | None = None) -> None:
        stream = current_stream() if stream is None else _as_stream(stream)
        if self._stream is not None:
            self._stream._queue.flush()  # the record reaches the daemon before the wait
        stream._enqueue([EVENT_WAIT_OP, [self.event_id], {}, None])

    def query(self) -> bool:
        """Whether the work before the record has completed; answered at once, as CUDA's is (the
        daemon answers event queries without waiting behind queued work)."""
        if self._stream is None:
            return True  # never recorded: nothing to wait for, as with CUDA events
        q = self._stream._queue
        q.flush()
        done = bool(q.link.request("event", {"query": [self.event_id]}, collect=False).body["done"][0])
        if done:
            self._stream._known_complete_to(self._covers, self)
        return done

    def synchronize(self) -> None:
        if self._stream is None:
            return
        q = self._stream._queue
        q.flush()
        q.link.collect_direct()  # the answers to batches already sent (the record's among them) first
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


def _as_stream(s: torch.Stream) -> Stream:
    """Genie's Stream for a torch.Stream of a remote device (torch.Stream(device=...), or one
    torch.accelerator returned)."""
    if isinstance(s, Stream):
        return s
    if isinstance(s, torch.Stream) and s.device_type == _PRIVATEUSE1:
        return _stream_at(s.device_index, s.stream_id)
    raise TypeError(f"expected a remote_accelerator stream, got {s!r}")


def _stream_at(device_index: int, stream_id: int) -> Stream:
    """Stream `stream_id` of a device as PyTorch names it (index -1: the current device)."""
    return Stream(None if device_index < 0 else device_index, _stream_id=stream_id)


def current_stream(device=None) -> Stream:
    index = _device_index(device)
    return Stream(index, _stream_id=current_stream_id(index))


def default_stream(device=None) -> Stream:
    return Stream(_device_index(device), _stream_id=0)


def set_stream(stream: torch.Stream) -> None:
    stream = _as_stream(stream)
    _make_current(stream.device_index, stream.stream_id)


@contextlib.contextmanager
def stream(s: torch.Stream | None):
    """Like torch.cuda.stream: make `s` current (on its device) inside the block; None does nothing."""
    if s is None:
        yield
        return
    with _as_stream(s) as current:
        yield current


class StreamContext:
    """`with StreamContext(s):` as torch.cuda.StreamContext: `stream(s)` as an object."""

    def __init__(self, stream: torch.Stream | None) -> None:
        self.stream = stream
        self._block = None

    def __enter__(self):
        self._block = stream(self.stream)
        return self._block.__enter__()

    def __exit__(self, *exc) -> None:
        self._block.__exit__(*exc)


def is_current_stream_capturing() -> bool:
    """Whether ops on the current device are being recorded into a graph now (a
    torch.accelerator.Graph capture or a genie.graph block), as torch.cuda's answers for CUDA graphs."""
    rt = get_runtime()
    return rt.started and rt.stream(rt.current_device).records_here()


def record_stream(tensor: torch.Tensor, s: torch.Stream) -> None:
    """`t.record_stream(s)`, as on CUDA: the daemon's allocator does not reuse `t`'s memory, once
    it is freed, until the work queued on `s` so far has run (on a GPU daemon; a CPU daemon runs
    every stream's work in order, so there its memory is never reused early)."""
    s = _as_stream(s)
    if tensor._genie.stream.global_index != s.device_index:
        raise RuntimeError(f"record_stream: the stream is on remote_accelerator:{s.device_index}, "
                           f"the tensor on {tensor.device}")
    s._enqueue([RECORD_STREAM_OP, [tensor._genie.wire], {}, None])


# ------------------------------------------------------------------ PyTorch's device-generic API
# The C++ device guard (genie/csrc/device_guard.cpp) calls these for torch.Stream, torch.Event,
# torch.accelerator and the autograd engine's stream guards.


def _guard_stream(action: str, device: int, stream_id: int):
    if action == "current":  # a C++ caller made this stream current on this thread
        set_current_stream_id(device, stream_id)
        return None
    rt = get_runtime()
    if not rt.started:
        return True  # nothing was ever queued: nothing to wait for (and no daemon to start for it)
    s = _stream_at(device, stream_id)
    if action == "synchronize_device":
        s._queue.synchronize()
        return None
    if action == "query":
        return s.query()
    if action == "synchronize":
        s.synchronize()
        return None
    raise ValueError(f"unknown stream action {action!r}")


def _guard_event(action: str, event: Event | None, other: Event | None, device: int, stream_id: int,
                 timing: int):
    if action == "record":
        event = Event(enable_timing=bool(timing)) if event is None else event
        event.record(_stream_at(device, stream_id))
        return event
    if action == "wait":
        event.wait(_stream_at(device, stream_id))
        return None
    if action == "query":
        return event.query()
    if action == "synchronize":
        event.synchronize()
        return None
    if action == "elapsed":
        return event.elapsed_time(other)
    raise ValueError(f"unknown event action {action!r}")


def install_guard_hooks() -> None:
    native_guard.set_stream_hooks(_guard_stream, _guard_event)  # module functions: alive for good
