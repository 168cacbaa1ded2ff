"""Read ahead: fetch a module's remote tensors together when it is moved off the device (and
any list of tensors a caller is about to read one by one: `reading_together`).

`model.cpu()` / `model.to("cpu")` (nn.Module._apply) moves each parameter, buffer and gradient
with its own `.cpu()`, and each `.cpu()` of a remote tensor waits for its own round trip: 350
waits for a 50-layer conv net, 44 ms over loopback and ~0.35 s at a network round trip of 1 ms.
While a module converts, its remote tensors are listed here in the order _apply visits them;
the first one read fetches it and those after it together (one round trip per daemon, up to
READ_AHEAD_BYTES of values), and the later `.cpu()` calls take their values.

A value fetched ahead is handed out only while it is still current: if any op has been queued
on its tensor's device since it was fetched (`DeviceStream.ops_captured` moved), it may be
stale, and the tensor is read again. Each value is handed out once: it is the fresh CPU tensor
that `.cpu()` returns.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from .lazy_tensor import LazyTensor
from .materialize import to_cpu_many

# Values fetched ahead at most per round trip: small tensors share one, large ones are
# bandwidth-bound anyway, and the CPU copies held before they are asked for stay bounded.
READ_AHEAD_BYTES = 64 << 20


class _Group:
    def __init__(self, tensors: list[LazyTensor]) -> None:
        self.waiting: dict[int, LazyTensor] = {id(t): t for t in tensors}  # in visiting order
        self.fetched: dict[int, tuple[LazyTensor, int, torch.Tensor]] = {}  # id -> (t, ops_captured, value)

    def take(self, t: LazyTensor) -> torch.Tensor | None:
        key = id(t)
        held = self.fetched.pop(key, None)
        if held is not None and held[0] is t:
            if t._genie.stream.ops_captured == held[1]:
                return held[2]
            self.waiting[key] = t  # written to since (perhaps): read it again
        if self.waiting.get(key) is not t:
            return None
        self._fetch_from(t)
        return self.fetched.pop(key)[2]

    def _fetch_from(self, first: LazyTensor) -> None:
        chosen, total = [first], _nbytes(first)
        del self.waiting[id(first)]
        for key, t in list(self.waiting.items()):
            size = _nbytes(t)
            if total + size > READ_AHEAD_BYTES:
                break
            chosen.append(t)
            total += size
            del self.waiting[key]
        counts = [t._genie.stream.ops_captured for t in chosen]  # before the fetch: a later op marks it stale
        for t, count, value in zip(chosen, counts, to_cpu_many(chosen)):
            self.fetched[id(t)] = (t, count, value)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_current = threading.local()


def take(t: LazyTensor) -> torch.Tensor | None:
    """t's value, fetched ahead with others, when t is being read as one of a group; else None."""
    group = getattr(_current, "group", None)
    return group.take(t) if group is not None else None


def _visit_order(module: torch.nn.Module) -> list[LazyTensor]:
    """The module's dense remote tensors in the order nn.Module._apply converts them: children
    first, then each parameter and its gradient, then the buffers."""
    found: list = []
    seen: set = set()

    def add(t) -> None:
        if not isinstance(t, LazyTensor) or id(t) in seen:
            return
        seen.add(id(t))
        found.append(t)

    def visit(m: torch.nn.Module) -> None:
        for child in m.children():
            visit(child)
        for p in m._parameters.values():
            if p is not None:
                add(p)
                add(p.grad)
        for b in m._buffers.values():
            add(b)

    visit(module)
    return found


@contextlib.contextmanager
def reading_module(module: torch.nn.Module):
    """While `module` converts: its remote tensors are read together. _apply calls itself for each
    child: those calls add nothing (the outermost listed the whole tree once)."""
    if getattr(_current, "inside", False):
        yield
        return
    with reading_together(_visit_order(module)):
        yield


@contextlib.contextmanager
def reading_together(tensors: list[LazyTensor]):
    """While the block runs on this thread, `.cpu()` of any of `tensors` fetches it and those listed
    after it together (up to READ_AHEAD_BYTES per round trip). Inside another such block: nothing
    more (the outer one's tensors are read together already)."""
    if getattr(_current, "inside", False):
        yield
        return
    _current.group = _Group(tensors) if len(tensors) > 1 else None
    _current.inside = True
    try:
        yield
    finally:
        _current.group = None
        _current.inside = False
