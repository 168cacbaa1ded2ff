"""Which operators a client may run, resolved from their ATen overload names.

Only the `aten` namespace is reachable, looked up by name on `torch.ops.aten`
(no eval, no import). Ops that touch the file system or the process are refused. Ops that
skip bounds checks (and so could read another client's memory) run as their checked
equivalents (checked_ops.py; `unsafe=True` arguments given False), never as themselves.
"""
from __future__ import annotations

import functools

import torch

from genie.transport.errors import ProtocolError

from . import checked_ops

DENIED = frozenset({
    "aten::from_file",          # reads files on the daemon host
    "aten::_print",             # writes to the daemon's stdout
    "aten::_assert_scalar",     # aborts on purpose
    "aten::set_",               # can point a tensor at arbitrary storage
    "aten::_cpu_cuda_sync",
})


class OpRefused(ProtocolError):
    """The op name is unknown or not allowed on a daemon."""


@functools.lru_cache(maxsize=4096)
def resolve(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    if namespace != "aten":
        raise OpRefused(f"operator {name} is not allowed: only aten operators run on a daemon")
    if f"{namespace}::{packet_name}" in DENIED:
        raise OpRefused(f"operator {name} is not allowed on a daemon")
    try:
        packet = getattr(torch.ops.aten, packet_name)
        op = getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        raise OpRefused(f"unknown operator {name}") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise OpRefused(f"unknown operator {name}")
    if f"aten::{packet_name}" in checked_ops.UNSAFE_OPS and checked_ops.replacement(op) is None:
        raise OpRefused(f"operator {name} skips bounds checks and is not allowed on a daemon")
    for arg in op._schema.arguments:
        if "Storage" in str(arg.type):
            raise OpRefused(f"operator {name} takes a Storage and is not allowed on a daemon")
    return op


@functools.lru_cache(maxsize=4096)
def unsafe_flags(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of the op's `unsafe` arguments; `check_call` looks at these."""
    return tuple((i, a.name) for i, a in enumerate(op._schema.arguments) if a.name == "unsafe")


def check_call(op: torch._ops.OpOverload, args: list, kwargs: dict) -> None:
    """A call that switches off the op's own bounds checks (`segment_reduce(unsafe=True)`,
    `_index_put_impl_(unsafe=True)`) keeps them: its `unsafe` arguments are set to False, in place."""
    for position, name in unsafe_flags(op):
        if position < len(args):
            if args[position]:
                args[position] = False
        elif kwargs.get(name):
            kwargs[name] = False


@functools.lru_cache(maxsize=4096)
def written_arguments(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument the op writes to (in-place and out= ops)."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(op._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


_RESIZING = frozenset({"aten::resize_", "aten::resize_as_", "aten::set_", "aten::_resize_output_"})


def resized_arguments(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments whose storage the op may replace or grow: an out=
    variant's outputs (resized to fit, as `torch.arange(0, 1024.0, device=...)` makes one
    from an empty tensor) and what resize_ / set_ write. Other in-place ops keep the storage."""
    if op._schema.name in _RESIZING:
        return written_arguments(op)
    return tuple((i, a.name) for i, a in enumerate(op._schema.arguments)
                 if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)


@functools.lru_cache(maxsize=4096)
def takes_generator(op: torch._ops.OpOverload) -> bool:
    return any(a.name == "generator" for a in op._schema.arguments)


@functools.lru_cache(maxsize=4096)
def seeded(op: torch._ops.OpOverload) -> bool:
    """Random ops (the `nondeterministic_seeded` tag)."""
    return torch.Tag.nondeterministic_seeded in op.tags


@functools.lru_cache(maxsize=4096)
def seeded_without_generator(op: torch._ops.OpOverload) -> bool:
    """Random ops that draw from the device's default generator, having no `generator` argument
    (native_dropout, rand.default, randperm.default, ...)."""
    return seeded(op) and not takes_generator(op)


def int_arg(call, i: int) -> int:
    """Argument i of a genie op call, which must be an integer (a program, event or stream id)."""
    if len(call.args) <= i or type(call.args[i]) is not int:
        raise ProtocolError(f"{call.name} takes an integer id")
    return call.args[i]
