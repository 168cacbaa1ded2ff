"""Read ahead: fetch a module's remote tensors together when it is moved off the device, any
list of tensors a caller is about to read one by one (`reading_together`), and a state_dict's
once the program goes through them (`_Sequence`).

`model.cpu()` / `model.to("cpu")` (nn.Module._apply) moves each parameter, buffer and gradient
with its own `.cpu()`, and each `.cpu()` of a remote tensor waits for its own round trip: 350
waits for a 50-layer conv net, 44 ms over loopback and ~0.35 s at a network round trip of 1 ms.
While a module converts, its remote tensors are listed here in the order _apply visits them;
the first one read fetches it and those after it together (one round trip per daemon, up to
READ_AHEAD_BYTES of values), and the later `.cpu()` calls take their values.

A value fetched ahead is handed out only while it is still current: if any op other than a view
(views write nothing) has been queued on its tensor's device since it was fetched (`_moment`
moved), it may be stale, and the tensor is read again. Each value is handed out once: it is the fresh CPU tensor
that `.cpu()` returns.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch

from .lazy_tensor import LazyTensor, storage_identity
from .materialize import to_cpu_many

# Values fetched ahead at most per round trip: small tensors share one, large ones are
# bandwidth-bound anyway, and the CPU copies held before they are asked for stay bounded.
READ_AHEAD_BYTES = 64 << 20


# A state_dict's first read ahead (_Sequence) fetches this much, each next one twice as much up to
# READ_AHEAD_BYTES: a program that reads a few of its tensors in order fetches little it never reads.
FIRST_WINDOW_BYTES = 1 << 20


def _moment(stream) -> int:
    """How many ops that may write were queued on `stream` so far (view ops write nothing)."""
    return stream.ops_captured - stream.views_captured


class _Group:
    def __init__(self, tensors: list[LazyTensor], window: int | None = None) -> None:
        self.waiting: dict[int, LazyTensor] = {id(t): t for t in tensors}  # in visiting order
        self.fetched: dict[int, tuple[LazyTensor, int, torch.Tensor]] = {}  # id -> (t, _moment, value)
        self.window = window  # bytes per round trip, doubling each time; None: READ_AHEAD_BYTES throughout

    def take(self, t: LazyTensor) -> torch.Tensor | None:
        key = id(t)
        held = self.fetched.pop(key, None)
        if held is not None and held[0] is t:
            if _moment(t._genie.stream) == held[1]:
                return held[2]
            self.waiting[key] = t  # written to since (perhaps): read it again
        if self.waiting.get(key) is not t:
            return None
        self._fetch_from(t)
        return self.fetched.pop(key)[2]

    def _fetch_from(self, first: LazyTensor) -> None:
        budget = READ_AHEAD_BYTES
        if self.window is not None:
            budget, self.window = min(self.window, budget), self.window * 2
        chosen, total = [first], _nbytes(first)
        del self.waiting[id(first)]
        for key, t in list(self.waiting.items()):
            size = _nbytes(t)
            if total + size > budget:
                break
            chosen.append(t)
            total += size
            del self.waiting[key]
        counts = [_moment(t._genie.stream) for t in chosen]  # before the fetch: a later write marks it stale
        for t, count, value in zip(chosen, counts, to_cpu_many(chosen)):
            self.fetched[id(t)] = (t, count, value)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_current = threading.local()


def take(t: LazyTensor) -> torch.Tensor | None:
    """t's value, fetched ahead with others, when t is being read as one of a group; else None."""
    group = getattr(_current, "group", None)
    if group is not None:
        return group.take(t)
    sequence = getattr(_current, "sequence", None)
    return sequence.take(t) if sequence is not None else None


class _Sequence:
    """The remote tensors of the state_dict this thread took last, in order. A program reading
    them one by one (`{k: v.cpu() for k, v in sd.items()}`, or `.detach().cpu()` of each: a
    tensor sharing a noted one's storage and metadata stands for it) waited once per tensor. The
    first read is a read of one tensor; when the next read is of a later tensor of the same
    state_dict with nothing but views queued on its device in between, the program is going
    through them, and from there on they are read ahead as a module's are (_Group), in windows
    of FIRST_WINDOW_BYTES doubling up to READ_AHEAD_BYTES. A program that reads only one of
    them fetches nothing more; one that reads two in order, at most a first window more."""

    def __init__(self, tensors: list[LazyTensor]) -> None:
        self.tensors = [weakref.ref(t) for t in tensors]
        self.position = {id(t): i for i, t in enumerate(tensors)}
        # Held, so that no other storage's identity takes one of these ids while this lives.
        self.identities = [storage_identity(t._genie) for t in tensors]
        self.by_storage = {(id(s), t._genie.meta_key): i for i, (s, t) in enumerate(zip(self.identities, tensors))}
        self.last: tuple[int, object, int] | None = None  # (position, stream, its _moment) of the last read
        self.group: _Group | None = None

    def _noted(self, t: LazyTensor) -> tuple[int, LazyTensor] | None:
        """t's position among the noted tensors and the one it stands for (itself, or the noted
        tensor whose storage and metadata it shares: a .detach() of it)."""
        i = self.position.get(id(t))
        if i is None:
            ref = t._genie
            i = self.by_storage.get((id(ref.storage), ref.meta_key)) if ref.storage is not None else None
            if i is None:
                return None
        noted = self.tensors[i]()
        return (i, noted) if noted is not None else None

    def take(self, t: LazyTensor) -> torch.Tensor | None:
        found = self._noted(t)
        if found is None:
            return None
        i, noted = found
        group = self.group
        if group is None:
            stream = noted._genie.stream
            last, self.last = self.last, (i, stream, _moment(stream))
            if last is None or last[0] >= i or last[1] is not stream or last[2] != _moment(stream):
                return None  # not (yet) going through them in order
            rest = [ref() for ref in self.tensors[i:]]
            group = self.group = _Group([r for r in rest if r is not None], FIRST_WINDOW_BYTES)
        return group.take(noted)

    def forget(self) -> None:
        """The state_dict is gone: so are the values fetched ahead from it."""
        self.position, self.by_storage, self.group = {}, {}, None


def remote_values(tensors: dict) -> list[LazyTensor]:
    """The remote tensors among a dict's values (a state_dict's), in its order; none while no
    daemon is connected (then there is nothing remote to find, and nothing is walked)."""
    from genie.runtime import started_runtime

    if started_runtime() is None:
        return []
    return [v for v in tensors.values() if isinstance(v, LazyTensor)]


def _noting_state_dicts(state_dict):
    """Module.state_dict that notes its remote values for _Sequence (the outermost call only: it
    calls itself for every child)."""
    @functools.wraps(state_dict)
    def noting(self, *args, **kwargs):
        if getattr(_current, "in_state_dict", False):
            return state_dict(self, *args, **kwargs)
        _current.in_state_dict = True
        try:
            state = state_dict(self, *args, **kwargs)
        finally:
            _current.in_state_dict = False
        if isinstance(state, dict):
            tensors = remote_values(state)
            sequence = _current.sequence = _Sequence(tensors) if len(tensors) > 1 else None
            if sequence is not None:
                try:  # values fetched ahead go with the state_dict, not with the next one
                    weakref.finalize(state, sequence.forget)
                except TypeError:  # a dict type without weak references: they go with the next one
                    pass
        return state

    noting._genie_wraps = state_dict
    return noting


def install() -> None:
    """Read a state_dict's remote tensors ahead once a program goes through them (_Sequence). Idempotent."""
    if not hasattr(torch.nn.Module.state_dict, "_genie_wraps"):
        torch.nn.Module.state_dict = _noting_state_dicts(torch.nn.Module.state_dict)


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
