"""Recorded programs (genie.graph): compiled once when defined, replayed on registers.

A program is the ops and frees of a recorded block. Compiling gives every handle it mentions
a register; the handles it reads but does not write are its inputs, loaded from the client's
table when a replay starts. A replay then runs the ops on registers, as traced TorchScript
segments (daemon/fused.py) or one by one: intermediates never enter the handle table or the
memory account, and only the handles still live when the program ends are stored (those the
client has dropped since recording are not). This keeps a replay close to the cost of the
calls themselves.

If an input is missing or poisoned, or an op fails, the replay falls back to the executor's
general path from that point on, so errors poison outputs exactly as in an ordinary batch.
"""
from __future__ import annotations

import functools

import torch

from genie.transport.protocol import REPLAY_OP, BulkTensor, DeviceRef, HandleRef, InlineTensor, OpCall

from . import attention, checked_ops, cuda_parity, fused, layouts
from . import ops as op_table
from .handles import ClientState, Poison

CONST, REG, LIST = 0, 1, 2
MAX_PROGRAMS = 1024  # recorded programs one client may keep
# Replays run as traced TorchScript segments (daemon/fused.py); False (--no-fuse-programs,
# GENIE_FUSE_PROGRAMS=0) interprets every op from Python instead.
FUSE = True


class Program:
    """A recorded genie.graph block: `batches` of (ops, frees), and its compiled form when it has one."""

    __slots__ = ("batches", "writes", "released", "compiled", "seeded", "seconds", "numerics")

    def __init__(self, batches: list[tuple[list[OpCall], list[int]]], writes: set[int], seeded: bool = False,
                 numerics: list | None = None) -> None:
        self.batches = batches
        self.numerics = numerics  # the settings it was recorded under (None: PyTorch's defaults)
        self.writes = writes               # handles its ops write
        self.seeded = seeded               # it has random ops (dropout, rand, ...)
        self.released: set[int] = set()    # of those, the ones the client has dropped since
        self.compiled: Compiled | None = None
        self.seconds: float | None = None  # how long the last request replaying it ran (where the next runs)


class Compiled:
    __slots__ = ("registers", "inputs", "batches", "live", "handle_of", "segments", "position")

    def __init__(self, registers: int, inputs: list, batches: list, live: list, handle_of: list) -> None:
        self.registers = registers
        self.inputs = inputs        # (register, handle) loaded when a replay starts
        self.batches = batches      # ([(op, args, kwargs, out, call)], [register to clear], [handles freed])
        self.live = live            # (handle, register) written and still live at the end
        self.handle_of = handle_of  # register -> handle
        steps = [step for b_steps, _, _ in batches for step in b_steps]
        self.position = [(b, s) for b, (b_steps, _, _) in enumerate(batches) for s in range(len(b_steps))]
        # (segment, its steps run one by one) for the fused replay; None: interpret every op
        self.segments = _segments(steps, {r for _, r in live}) if FUSE and steps else None


class NotCompilable(Exception):
    pass


def replaced_kernel(op: torch._ops.OpOverload, name: str, attention_kernel=attention.replacement):
    """What runs `op` instead of its own kernel, or None: the checked twins of ops that skip bounds
    checks (first: their own kernels must never run), attention, layout and CUDA-parity kernels.
    One list for ops run one by one and in compiled programs (which take attention's traceable kernel)."""
    return (checked_ops.replacement(op) or attention_kernel(name) or layouts.replacement(name)
            or cuda_parity.replacement(name))


def compile_program(batches: list[tuple[list[OpCall], list[int]]], devices: list[torch.device]) -> Compiled | None:
    """Registers for a program, or None when one of its ops needs the general path (e.g. RNG ops)."""
    registers: dict[int, int] = {}
    written: set[int] = set()
    inputs: list[tuple[int, int]] = []

    def register(handle: int) -> int:
        r = registers.get(handle)
        if r is None:
            r = registers[handle] = len(registers)
        return r

    def arg(value, depth: int):
        if isinstance(value, HandleRef):
            if value.id not in written and value.id not in registers:
                inputs.append((register(value.id), value.id))
            return (REG, register(value.id))
        if isinstance(value, list):
            if depth >= 2 or any(isinstance(v, (InlineTensor, BulkTensor, DeviceRef, dict)) for v in value):
                raise NotCompilable
            specs = [arg(v, depth + 1) for v in value]
            return (LIST, specs) if any(kind != CONST for kind, _ in specs) else (CONST, value)
        if isinstance(value, (InlineTensor, BulkTensor, dict)):
            raise NotCompilable
        if isinstance(value, DeviceRef):
            if value.type == "cpu":
                return (CONST, torch.device("cpu"))
            if value.index >= len(devices):
                raise NotCompilable  # the general path reports the bad index
            return (CONST, devices[value.index])
        return (CONST, value)

    def out(spec):
        if spec is None:
            return None
        if type(spec) is int:
            written.add(spec)
            return register(spec)
        return [out(s) for s in spec]

    compiled_batches = []
    try:
        for calls, frees in batches:
            steps = []
            for call in calls:
                op = op_table.resolve(call.name)
                if op_table.takes_generator(op):
                    return None  # per-client generators: the general path handles them
                args = [arg(a, 0) for a in call.args]
                kwargs = {k: arg(v, 0) for k, v in call.kwargs.items()}
                kernel = replaced_kernel(op, call.name, attention.traceable) or op._op
                if call.strides is not None:
                    kernel = layouts.planned_strides(kernel, call.strides)
                steps.append((kernel, args, kwargs, out(call.outs), call))
            cleared = [registers[h] for h in frees if h in written]
            external = [h for h in frees if h not in written]
            compiled_batches.append((steps, cleared, external))
    except NotCompilable:
        return None
    freed = {h for _, f in batches for h in f}
    live = [(h, registers[h]) for h in written if h not in freed]
    handle_of = [0] * len(registers)
    for h, r in registers.items():
        handle_of[r] = h
    return Compiled(len(registers), inputs, compiled_batches, live, handle_of)


def _reads(step) -> list[int]:
    _, args, kwargs, _, _ = step
    return _registers([*args, *kwargs.values()])


def _registers(specs) -> list[int]:
    """The registers in compiled argument specs, (kind, value) pairs, lists included."""
    found: list[int] = []
    for kind, v in specs:
        if kind == REG:
            found.append(v)
        elif kind == LIST:
            found.extend(_registers(v))
    return found


def _writes(step) -> list[int]:
    found: list[int] = []

    def visit(spec):
        if type(spec) is int:
            found.append(spec)
        elif spec is not None:
            for s in spec:
                visit(s)

    visit(step[3])
    return found


def _targets(step) -> list[int]:
    """Registers the step writes in place: its arguments the schema marks as written."""
    _, args, kwargs, _, call = step
    found: list[int] = []
    for position, name in op_table.written_arguments(op_table.resolve(call.name)):
        spec = args[position] if position < len(args) else kwargs.get(name)
        if spec is not None:
            found.extend(_registers([spec]))
    return found


def _describe(step) -> tuple:
    _, args, kwargs, out, call = step
    return call.name, _freeze(args), _freeze(sorted(kwargs.items())), _freeze(out)


def _freeze(value):
    """A hashable form that tells apart what Python's == does not (1, 1.0 and True; 0.0 and -0.0)."""
    t = type(value)
    if t is list or t is tuple:
        return list, tuple(_freeze(v) for v in value)
    if t is float:
        return float, value.hex()
    if t is complex:
        return complex, value.real.hex(), value.imag.hex()
    return t, value


# In-place writes whose result does not depend on what the target held (see fused.plan_segments).
_OVERWRITES = frozenset({"aten::copy_", "aten::index_copy_", "aten::fill_.Scalar", "aten::fill_.Tensor",
                         "aten::zero_", "aten::index_fill_.int_Scalar", "aten::masked_fill_.Scalar"})


def _overwrites(step):
    _, args, kwargs, _, call = step
    if call.name not in _OVERWRITES or not args or args[0][0] != REG:
        return None
    target = args[0][1]
    return None if target in _registers([*args[1:], *kwargs.values()]) else target


def _segments(steps: list, kept: set[int]) -> list:
    segments = fused.plan_segments(steps, _reads, _writes, _targets, _describe, kept, _overwrites)
    return [(seg, functools.partial(_run_steps, steps[seg.start:seg.stop])) for seg in segments]


def _run_steps(steps: list, regs: list):
    result = None
    for step in steps:
        result = _run_step(step, regs)
    return result


def _run_step(step, regs: list):
    op, args, kwargs, out, _ = step
    values = [v if k == CONST else _value(k, v, regs) for k, v in args]
    if kwargs:
        result = op(*values, **{n: v if k == CONST else _value(k, v, regs) for n, (k, v) in kwargs.items()})
    else:
        result = op(*values)
    _assign(out, result, regs)
    return result


def _value(kind: int, v, regs: list):
    if kind == REG:
        return regs[v]
    if kind == LIST:
        return [x if k == CONST else _value(k, x, regs) for k, x in v]
    return v


def _assign(spec, result, regs: list) -> None:
    if type(spec) is int:
        if not isinstance(result, torch.Tensor):
            raise TypeError(f"expected a tensor output, got {type(result).__name__}")
        regs[spec] = result
    elif spec is not None:
        if not isinstance(result, (list, tuple)) or len(result) > len(spec):
            raise TypeError("the op returned more outputs than recorded")
        for s, r in zip(spec, result):
            _assign(s, r, regs)


def traced(program: Program) -> bool:
    """Whether replaying runs no first-time trace (tracing a large step can take seconds: it
    must not run on the daemon's event loop)."""
    compiled = program.compiled
    return compiled is None or not compiled.segments or all(seg.fn is not None for seg, _ in compiled.segments)


def replay(executor, client: ClientState, program: Program, device: torch.device) -> None:
    compiled = program.compiled
    if compiled is None:
        return _general(executor, client, program, device, 0, 0)
    regs: list = [None] * compiled.registers
    tensors = client.tensors
    for r, h in compiled.inputs:
        t = tensors.get(h)
        if not isinstance(t, torch.Tensor):  # missing or poisoned: the general path says which
            return _general(executor, client, program, device, 0, 0)
        regs[r] = t
    if compiled.segments is None:
        if not _interpret_steps(executor, client, program, compiled, regs, device, 0, len(compiled.position)):
            return
    for segment, interpret in compiled.segments or ():
        try:
            if fused.run_traced(segment, regs, interpret):
                continue
        except Exception:  # noqa: BLE001 - re-run it op by op below, which poisons what failed
            pass
        if not _interpret_steps(executor, client, program, compiled, regs, device, segment.start, segment.stop):
            return
        fused.drop(segment, regs)
    for _, _, external in compiled.batches:
        for h in external:
            client.free(h)
    _finish(executor, client, program, compiled, regs)


def _interpret_steps(executor, client: ClientState, program: Program, compiled: Compiled, regs: list,
                     device: torch.device, start: int, stop: int) -> bool:
    """Run steps [start, stop) of the whole program one by one, each once. False: one failed and
    the general path has finished the program from there."""
    for k in range(start, stop):
        b, s = compiled.position[k]
        steps, cleared, _ = compiled.batches[b]
        try:
            _run_step(steps[s], regs)
        except Exception as e:  # noqa: BLE001 - hand over to the general path, which poisons
            _spill(compiled, regs, client)
            executor._fail(client, steps[s][4], e, raise_errors=False)
            for _, _, external in compiled.batches[:b]:
                for h in external:
                    client.free(h)
            _general(executor, client, program, device, b, s + 1)
            return False
        if s == len(steps) - 1:
            for r in cleared:  # the client dropped these handles during recording: nothing reads them
                regs[r] = None
    return True


def _finish(executor, client: ClientState, program: Program, compiled: Compiled, regs: list) -> None:
    """Store the outputs still live (freeing those the client dropped) and check the memory limit."""
    released = program.released
    for h, r in compiled.live:
        if h in released:
            client.free(h)
        else:
            client.put(h, regs[r])
    if executor.memory_limit and executor.account.allocated > executor.memory_limit:
        poison = Poison(REPLAY_OP, "OutOfMemoryError",
                        f"genie-daemon memory limit of {executor.memory_limit} bytes exceeded by a replay's outputs")
        for h, _ in compiled.live:
            client.put(h, poison)


def _spill(compiled: Compiled, regs: list, client: ClientState) -> None:
    """Store the registers written so far under their handles, for the general path to continue."""
    inputs = {h for _, h in compiled.inputs}
    for r, value in enumerate(regs):
        h = compiled.handle_of[r]
        if value is not None and h not in inputs:
            client.put(h, value)


def _general(executor, client: ClientState, program: Program, device: torch.device, batch: int, step: int) -> None:
    """Op by op through the executor's general path, from (batch, step) on."""
    for b in range(batch, len(program.batches)):
        calls, frees = program.batches[b]
        for call in calls[step if b == batch else 0:]:
            executor._run_op(client, call, (), device, raise_errors=False)
        for h in frees:
            client.free(h)
    for h in program.released:
        client.free(h)
