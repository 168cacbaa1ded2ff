"""Materialization: bring remote values to the CPU, blocking or async.

The blocking forms (`to_cpu`, used by .cpu()/.item()/print/...) wrap the same
per-device fetch that `await genie.materialize(...)` awaits. Fetches for tensors
on different devices are issued together and awaited together.
"""
from __future__ import annotations

import asyncio

import torch
import torch.utils._pytree as pytree

from genie.transport.interrupts import is_interrupt

from . import sync_debug
from .lazy_tensor import LazyTensor
from .sparse_coo import RemoteSparse


def _check(t) -> LazyTensor:
    if not isinstance(t, LazyTensor):  # a subclass: the program's own class's remote twin
        raise TypeError(f"expected a remote_accelerator tensor, got {type(t).__name__} on {getattr(t, 'device', '?')}")
    return t


def _group(tensors: list[LazyTensor]) -> dict:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t._genie.stream, []).append(i)
    return groups


def _largest(tensors: list, idx: list[int]) -> int:
    """Bytes of the biggest of these tensors (their shapes are known here before any data is)."""
    return max(tensors[i].numel() * tensors[i].element_size() for i in idx)


def _parts(tensors: list) -> list:
    """The remote tensors to fetch for `tensors`: a sparse tensor's parts in its place."""
    flat: list = []
    for t in tensors:
        flat.extend(t.parts() if isinstance(t, RemoteSparse) else (t,))
    return flat


def _rebuilt(tensors: list, values: list) -> list:
    """`tensors`' CPU values from their parts' (`values`, in _parts' order)."""
    out, at = [], 0
    for t in tensors:
        if isinstance(t, RemoteSparse):
            n = len(t.parts())
            out.append(t.cpu_from(values[at:at + n]))
            at += n
        else:
            out.append(values[at])
            at += 1
    return out


def to_cpu_many(tensors: list) -> list[torch.Tensor]:
    if any(isinstance(t, RemoteSparse) for t in tensors):  # a sparse tensor's parts fetched with the rest
        return _rebuilt(tensors, to_cpu_many(_parts(tensors)))
    tensors = [_check(t) for t in tensors]
    sync_debug.note("reading values on the CPU (.cpu(), .to('cpu'), .tolist(), print(t), .numpy())")
    out: list = [None] * len(tensors)
    groups = _group(tensors)
    # One group: block on it directly. Several: post them all first so the daemons work in parallel.
    direct = len(groups) == 1
    futures = [(s, idx, s.fetch_async([tensors[i]._genie.id for i in idx], direct=direct,
                                      largest=_largest(tensors, idx)))
               for s, idx in groups.items()]
    failure = None
    for n, (stream, idx, future) in enumerate(futures):
        try:
            failure = failure or _place(out, idx, lambda: stream.take_fetched(stream.link.wait(future)))
        except BaseException:  # Ctrl-C: the other daemons' answers are let go as they come
            for other, _, later in futures[n + 1:]:
                other.link.abandon_future(later)
            raise
    if failure is not None:
        raise failure
    return out


def _place(out: list, idx: list, take) -> BaseException | None:
    """Put what `take()` returns at positions `idx` of `out`; what it raised instead, to be raised
    once every daemon's answer is taken."""
    try:
        fetched = take()
    except Exception as e:  # noqa: BLE001 - raised by the caller after the other answers
        if is_interrupt(e):
            raise  # a program's SIGINT handler raised it: the caller lets the other answers go
        return e
    for i, value in zip(idx, fetched):
        out[i] = value
    return None


def to_cpu(t) -> torch.Tensor:
    return to_cpu_many([t])[0]


async def materialize_many(tensors: list) -> list[torch.Tensor]:
    """Async form: awaits the daemons without blocking the caller's event loop. Cancelled (by
    `asyncio.wait_for`, a task's `cancel()`) or failing part way, it lets go of the answers it
    will not take: their bytes still come and are dropped as they land (before, a cancelled
    32 MiB materialize held its bytes for good: 30 of them, 1 GB)."""
    if any(isinstance(t, RemoteSparse) for t in tensors):  # as in to_cpu_many
        return _rebuilt(tensors, await materialize_many(_parts(tensors)))
    tensors = [_check(t) for t in tensors]
    out: list = [None] * len(tensors)
    groups = _group(tensors)
    pending = [(s, idx, s.fetch_async([tensors[i]._genie.id for i in idx], largest=_largest(tensors, idx)))
               for s, idx in groups.items()]
    taken, failure = 0, None
    try:
        replies = await asyncio.gather(*(_awaitable(f) for _, _, f in pending))
        for (stream, idx, _), reply in zip(pending, replies):
            await _bulk_arrived(stream, reply)
            taken += 1
            failure = failure or _place(out, idx, lambda: stream.take_fetched(reply))
    except BaseException:
        for stream, _, future in pending[taken:]:
            stream.link.abandon_future(future)
        raise
    if failure is not None:
        raise failure
    return out


def _awaitable(future):
    """An asyncio future of the caller's loop with `future`'s outcome. Unlike asyncio.wrap_future,
    cancelling it leaves `future` alone: Genie settles it when the answer comes (and the
    canceller lets go of that answer, see materialize_many)."""
    loop = asyncio.get_running_loop()
    mirror = loop.create_future()

    def copy(done) -> None:
        if mirror.done():
            return
        if done.cancelled():
            mirror.cancel()
        elif done.exception() is not None:
            mirror.set_exception(done.exception())
        else:
            mirror.set_result(done.result())

    def settled(done) -> None:
        try:
            loop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the caller's loop has closed: nobody awaits it
            pass

    future.add_done_callback(settled)
    return mirror


async def _bulk_arrived(stream, reply, poll_s: float = 0.0005) -> None:
    """Wait, without blocking the caller's loop, until the reply's bulk transfers have landed."""
    lane = stream.link.bulk_lane
    for xfer in stream.bulk_transfers(reply):
        while lane is not None and not lane.arrivals.ready(xfer):
            await asyncio.sleep(poll_s)


def _leaves(tree) -> tuple[list, object, list[int]]:
    """tree's leaves (torch's pytree: dicts, lists, tuples, namedtuples, OrderedDicts...), its
    structure, and where among the leaves its remote tensors are."""
    leaves, spec = pytree.tree_flatten(tree)
    return leaves, spec, [i for i, v in enumerate(leaves) if isinstance(v, (LazyTensor, RemoteSparse))]


def _refill(tree, leaves: list, spec, at: list[int], values: list):
    for i, value in zip(at, values):
        leaves[i] = value
    rebuilt = pytree.tree_unflatten(leaves, spec)
    if hasattr(tree, "_metadata"):  # a state_dict's module versions, which load_state_dict reads
        rebuilt._metadata = tree._metadata
    return rebuilt


def to_cpu_tree(tree):
    """`tree` with every remote tensor in it replaced by its CPU value, all fetched together (one
    round trip per daemon); other values kept. A state_dict of 350 tensors read one `.cpu()` at a
    time waits 350 times."""
    leaves, spec, at = _leaves(tree)
    return _refill(tree, leaves, spec, at, to_cpu_many([leaves[i] for i in at])) if at else tree


async def materialize_tree(tree):
    """The async form of to_cpu_tree."""
    leaves, spec, at = _leaves(tree)
    return _refill(tree, leaves, spec, at, await materialize_many([leaves[i] for i in at])) if at else tree
