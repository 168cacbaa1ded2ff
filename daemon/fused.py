"""Compiled programs run as TorchScript graphs: their ops called from C++, not one by one from Python.

A replay interpreted in Python pays several microseconds of interpreter and binding overhead
per op, more than the op itself for decode-sized tensors. So a compiled program is cut into
segments, each traced once with `torch.jit.trace` on stand-ins for its inputs (zero-filled
copies of their shapes when small, else meta tensors: never the data) at its first replay and
called as one TorchScript function from then on. The trace records the aten
ops the program names, with its constants, and nothing else: no Python from a client is run,
evaluated or imported, and the graph is the same op sequence whatever the inputs hold.
Traces are kept by content, so a program recorded again (a new genie.Graph for the same
step) reuses them.

Every op of a traced segment is free of side effects or makes a write that a re-run makes
again identically (an overwrite: copy_, index_copy_, fill_...); other in-place ops run alone,
and no op of a segment reads what a later op of it writes (see plan_segments). If a traced segment fails (a data error such as an index out of
range), the replay re-runs it op by op from its start, which poisons exactly what the general
path would and lands no write twice with different values. Segments of one op, and those the
tracer refuses, are interpreted, each op once.
"""
from __future__ import annotations

import collections
import logging
import threading
import warnings

import torch

log = logging.getLogger("genie.daemon")

INTERPRET = False  # Segment.fn of a segment run op by op from Python
MAX_TRACES = 4096  # traced segments kept (least recently used dropped first)
counts = {"traced": 0, "reused": 0, "interpreted": 0}  # segments so far, for the daemon's stats

_traces: collections.OrderedDict = collections.OrderedDict()  # key -> (fn, same_inputs)
_traces_lock = threading.Lock()


class Segment:
    """Steps [start, stop) of a compiled program, with the registers crossing its edges."""

    __slots__ = ("start", "stop", "inputs", "outputs", "drop", "key", "fn", "same_inputs", "targets")

    def __init__(self, start: int, stop: int, inputs: list[int], outputs: list[int], drop: list[int],
                 key: tuple) -> None:
        self.start, self.stop = start, stop
        self.inputs = inputs      # registers it reads that earlier steps (or the program's inputs) wrote
        self.outputs = outputs    # registers it writes that later steps read or that are live at the end
        self.drop = drop          # registers nothing reads after it: cleared to free their memory
        self.key = key            # what the trace depends on: its steps and edges
        self.fn = None            # traced function after the first run, or INTERPRET
        self.same_inputs: list[tuple[int, int]] = []  # input positions that held one tensor when traced
        self.targets: list[int] = []  # registers its steps write in place (see plan_segments)


def plan_segments(steps: list, reads_of, writes_of, targets_of, describe, kept: set[int],
                  overwrites=lambda step: None) -> list[Segment]:
    """Cut `steps` into segments whose re-run after a failure is exact.

    reads_of(step) / writes_of(step): the registers it reads / outputs; targets_of(step): the
    registers it writes in place (in-place and out= ops; empty for others); describe(step): a
    hashable, exact description (op and constants, with their types); kept: registers live
    when the program ends; overwrites(step): the register an idempotent write (copy_,
    index_copy_, fill_...) sets, else None.

    An idempotent write (an overwrite) does not end its segment: a re-run writes the same
    values again, and the steps after it then read what they read the first time (a decode
    step's K- and V-cache writes of every layer, and the attention reading them, make one
    segment). Other in-place writes (add_, index_add_...) run alone, interpreted, as a write
    that fails halfway and is re-run would land twice. A segment also ends before an in-place
    write into a register an earlier step of it reads: a write that fails halfway (an index out
    of range) can leave part of its target changed, and the re-run's earlier steps must not
    read that; nor may they read a value that a later write of the segment changes."""
    bounds, start, targets, read_here = [], 0, [], set()  # read_here: registers read since `start`
    for i, step in enumerate(steps):
        written = targets_of(step)
        overwrite = overwrites(step) is not None
        if written and i > start and (not overwrite or read_here.intersection(written)):
            bounds.append((start, i, targets))
            start, targets, read_here = i, [], set()
        read_here.update(reads_of(step))
        if written:
            targets = targets + list(written)
        if i == len(steps) - 1:
            bounds.append((start, i + 1, targets))
        elif written and not overwrite:
            bounds.append((start, i + 1, targets))
            start, targets, read_here = i + 1, [], set()
    last_read: dict[int, int] = {}
    for i, step in enumerate(steps):
        for r in reads_of(step):
            last_read[r] = i
    segments = []
    for start, stop, written_in_place in bounds:
        written: set[int] = set()
        inputs: list[int] = []
        for step in steps[start:stop]:
            for r in reads_of(step):
                if r not in written and r not in inputs:
                    inputs.append(r)
            written.update(writes_of(step))
        outputs = sorted(r for r in written if r in kept or last_read.get(r, -1) >= stop)
        done = [r for r in inputs if last_read.get(r, -1) < stop and r not in kept]
        drop = sorted(set(done) | (written - set(outputs)))
        key = (tuple(describe(s) for s in steps[start:stop]), tuple(inputs), tuple(outputs))
        segment = Segment(start, stop, inputs, outputs, drop, key)
        segment.targets = written_in_place
        if stop - start == 1:
            segment.fn = INTERPRET  # one op: a TorchScript call would cost more than it saves
        segments.append(segment)
    return segments


def run_traced(segment: Segment, regs: list, interpret) -> bool:
    """Run the segment as TorchScript on `regs` (tracing it first if new) and drop what it no
    longer needs; False when it is to be interpreted, by the caller, which then calls `drop`.
    interpret(registers) runs its steps one by one and returns what the last returned. An
    exception from an op propagates; the caller then re-runs the segment op by op, which is
    exact: only its last op writes in place, and writes what a re-run writes again."""
    _exact_execution()
    if segment.fn is None:
        if _writes_shared_storage(segment, regs):
            segment.fn = INTERPRET  # a re-run could read what a write of it changed
        else:
            _trace(segment, regs, interpret)
    fn = segment.fn
    if fn is INTERPRET:
        return False
    values = [regs[r] for r in segment.inputs]
    if any(values[i] is not values[j] for i, j in segment.same_inputs):
        return False
    results = fn(*values)
    if type(results) is not tuple:
        results = (results,)
    for r, value in zip(segment.outputs, results):
        regs[r] = value
    drop(segment, regs)
    return True


def drop(segment: Segment, regs: list) -> None:
    for r in segment.drop:
        regs[r] = None


def _trace(segment: Segment, regs: list, interpret) -> None:
    """Trace the segment on stand-ins for its inputs, never on the inputs themselves, so tracing
    has no side effects and the first real run is the traced function's: zero-filled tensors on
    the inputs' device when they are small (real kernels), else meta tensors (no data at all; the
    first use of torch's Python meta kernels imports torch._dynamo, ~1.4 s here)."""
    with _traces_lock:
        known = _traces.get(segment.key)
        if known is not None:
            _traces.move_to_end(segment.key)
    if known is not None:
        segment.fn, segment.same_inputs = known
        counts["reused"] += 1
        return
    values = [regs[r] for r in segment.inputs]
    segment.same_inputs = [(i, j) for j in range(len(values)) for i in range(j) if values[i] is values[j]]
    segment.fn = INTERPRET
    if not hasattr(torch.jit, "trace"):
        counts["interpreted"] += 1
        return  # a torch without the tracer

    def body(*inputs):
        local = _Registers([None] * len(regs))
        for r, value in zip(segment.inputs, inputs):
            local[r] = value
        last = interpret(local)
        if not segment.outputs:
            # Nothing read later (e.g. it ends in an in-place write): hand back what the last op
            # returned, as the tracer needs an output; run() ignores it.
            return last if isinstance(last, torch.Tensor) else ()
        return tuple(local[r] for r in segment.outputs)

    for stand_in in ("zeros", "meta"):
        try:
            examples = _stand_ins(values, stand_in)
            if examples is None:
                continue
            # Tracing runs the ops once, on stand-ins: random ones must not move the generators, or
            # the first replay after torch.manual_seed draws other numbers than every later one.
            gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
            with warnings.catch_warnings(), torch.random.fork_rng(devices=gpus):
                warnings.simplefilter("ignore")  # torch.jit's deprecation and "may not generalize" notes
                segment.fn = torch.jit.trace(body, examples, check_trace=False, strict=False)
            counts["traced"] += 1
            break
        except Exception as e:  # noqa: BLE001 - e.g. an op that rejects zeros, one without a meta kernel
            log.debug("program segment of %d ops not traced on %s: %s", segment.stop - segment.start, stand_in, e)
    else:
        counts["interpreted"] += 1
    with _traces_lock:
        _traces[segment.key] = (segment.fn, segment.same_inputs)
        while len(_traces) > MAX_TRACES:
            _traces.popitem(last=False)


def _writes_shared_storage(segment: Segment, regs: list) -> bool:
    """Whether an in-place write of the segment lands in memory another of its inputs also
    uses (plan_segments sees registers, not storage: two input handles can view one tensor)."""
    inputs = {r: regs[r] for r in segment.inputs}
    for target in segment.targets:
        if target not in inputs:
            continue  # written by the segment itself: fresh on every run
        storage = inputs[target].untyped_storage().data_ptr()
        if any(r != target and v.untyped_storage().data_ptr() == storage for r, v in inputs.items()):
            return True
    return False


_thread_state = threading.local()


def _exact_execution() -> None:
    """No TorchScript graph optimisation on this thread: common-subexpression elimination could
    hand one tensor back for two outputs the client keeps apart, and dead-code elimination could
    skip a recorded op. A replay runs exactly the ops it recorded (measured: ~8% slower than with
    the optimiser on, still ~2x faster than interpreting). The switch is per thread, and a
    segment traced on the worker may run on the event loop later (with it on there, the profiling
    executor made each decode replay 2.4 ms instead of 0.9), so every thread that runs one sets it."""
    if getattr(_thread_state, "exact", False):
        return
    setter = getattr(torch._C, "_set_graph_executor_optimize", None)
    if setter is not None:
        setter(False)
    _thread_state.exact = True


# Inputs up to this many bytes in all are traced on zeros on their own device (a GPU's zeros
# are made in microseconds and trace the device constants of factory ops right).
ZEROS_MAX_BYTES = {"cpu": 16 << 20, "cuda": 256 << 20}


def _stand_ins(values: list, kind: str) -> tuple | None:
    """Tensors with each value's shape, strides, offset and dtype (one per distinct value), on
    the meta device or zero-filled on the inputs' own device; None where zeros do not apply."""
    storages = {id(v): v.untyped_storage().nbytes() for v in values}
    if kind == "zeros":
        devices = {v.device for v in values}
        if len(devices) > 1:
            return None
        device = devices.pop() if devices else torch.device("cpu")
        if sum(storages.values()) > ZEROS_MAX_BYTES.get(device.type, 0):
            return None
    else:
        device = torch.device("meta")
    made: dict[int, torch.Tensor] = {}
    for v in values:
        if id(v) not in made:
            base = torch.zeros(storages[id(v)] // v.element_size(), dtype=v.dtype, device=device)
            made[id(v)] = base.as_strided(v.shape, v.stride(), v.storage_offset())
    return tuple(made[id(v)] for v in values)


class _Registers(list):
    """Registers of a traced run. Reading one the segment did not receive would bake a real
    tensor into the graph as a constant, so it fails instead (and the segment is interpreted)."""

    def __getitem__(self, r):
        value = list.__getitem__(self, r)
        if value is None:
            raise LookupError(f"register {r} read before it was written")
        return value
