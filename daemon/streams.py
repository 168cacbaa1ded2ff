"""Streams and events on the daemon, per client.

On a GPU each (client, device, stream id) is a `torch.cuda.Stream`, and events
are `torch.cuda.Event`s recorded on them, so ordering, waits and timings are the
GPU's own. On the CPU the executor is one ordered queue, so every stream's work
already runs in arrival order; an event is then complete when its record op
has run, and its time is the host clock at that moment.
"""
from __future__ import annotations

import contextlib
import time

import torch

from genie.transport.errors import ProtocolError

_NO_STREAM = contextlib.nullcontext()  # reusable: what a CPU device's requests enter


class EventState:
    __slots__ = ("cuda_event", "time", "timing")

    def __init__(self, timing: bool) -> None:
        self.cuda_event = None
        self.time: float | None = None
        self.timing = timing

    def done(self) -> bool:
        if self.cuda_event is not None:
            return self.cuda_event.query()
        return self.time is not None


class ClientStreams:
    def __init__(self) -> None:
        self._cuda: dict[tuple[str, int], torch.cuda.Stream] = {}
        self.events: dict[int, EventState] = {}

    def context(self, device: torch.device, stream_id: int):
        if device.type != "cuda":
            return _NO_STREAM
        if stream_id == 0:
            return torch.cuda.stream(torch.cuda.default_stream(device))
        key = (str(device), stream_id)
        if key not in self._cuda:
            self._cuda[key] = torch.cuda.Stream(device=device)
        return torch.cuda.stream(self._cuda[key])

    def idle(self, devices: list[torch.device]) -> bool:
        """Whether no kernel of this client is queued or running on these GPUs (CPU: always).
        Reading a result back waits for the GPU: on the event loop, that wait could outlast a
        heartbeat (a long training step before `.item()`), so the server runs such a request
        inline only when this holds."""
        for device in devices:
            if device.type == "cuda" and not torch.cuda.default_stream(device).query():
                return False
        return all(s.query() for s in self._cuda.values())

    def record(self, event_id: int, timing: bool, device: torch.device) -> None:
        state = EventState(bool(timing))
        if device.type == "cuda":
            state.cuda_event = torch.cuda.Event(enable_timing=bool(timing))
            state.cuda_event.record(torch.cuda.current_stream(device))
        else:
            state.time = time.perf_counter()
        self.events[event_id] = state

    def wait(self, event_id: int, device: torch.device) -> None:
        state = self.events.get(event_id)
        if state is None:
            return  # like CUDA: waiting for an event never recorded does nothing
        if state.cuda_event is not None:
            torch.cuda.current_stream(device).wait_event(state.cuda_event)
        # On the CPU the record op ran before this one (one ordered queue): nothing to wait for.

    def query(self, event_id: int) -> bool | None:
        """True/False once the record op has run; None while it has not (the client knows whether it asked)."""
        state = self.events.get(event_id)
        return None if state is None else state.done()

    def elapsed_ms(self, start: int, end: int) -> float:
        a, b = self.events.get(start), self.events.get(end)
        if a is None or b is None:
            raise ProtocolError("both events must be recorded before elapsed_time")
        if not (a.timing and b.timing):
            raise ProtocolError("events were not created with enable_timing=True")
        if not (a.done() and b.done()):
            raise ProtocolError("events have not completed yet: synchronize first")
        if a.cuda_event is not None:
            return a.cuda_event.elapsed_time(b.cuda_event)
        return (b.time - a.time) * 1e3
