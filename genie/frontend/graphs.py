"""Record a block of remote work once, replay it with one small message (like torch.cuda.CUDAGraph).

    g = genie.Graph()
    with genie.graph(g):          # runs the block once, as usual, and records its ops
        step()                     # e.g. a decode step writing into static remote tensors
    for _ in range(n):
        g.replay()                 # the daemon re-runs the recorded ops; nothing is captured here

A replay runs the same ops on the same tensors, so, as with CUDA graphs, shapes must not
change: feed new inputs by writing into the tensors the block read (`copy_`, in-place ops
recorded in the block), and read results from the tensors it wrote. Inside the block nothing
may move data between host and daemon or read a value (`.cpu()`, `.item()`, ops whose output
shape depends on data): those raise a GenieError, and so does an op in the block that writes
into a tensor elsewhere (on the CPU, or on another device): it would run now and never in a
replay. Replays queue like any op, in program order. A recording takes the ops of the thread
that records and of its block's backward (on autograd's thread); other threads' work on the device
meanwhile runs as usual, unrecorded (runtime.stream.DeviceStream.own_batch).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from genie.errors import GenieError
from genie.runtime import get_runtime
from genie.runtime.device_type import DEVICE_TYPE
from genie.runtime.stream import on_behalf, unreplayed_captures
from genie.transport.interrupts import runs_whole
from genie.transport.protocol import DEFINE_PROGRAM_OP as DEFINE_OP, REPLAY_OP

from .lazy_tensor import LazyTensor


class Graph:
    """A recorded program of remote ops on one device."""

    def __init__(self) -> None:
        self.program_id: int | None = None
        self.ops = 0  # ops recorded
        self.op_names: list[str] = []  # their names, in order
        self._stream = None
        self._finalizer = None
        # The tensors from before the block that it reads (weights, static inputs, caches): held
        # while the graph lives, so a replay never finds them dropped by the code that made them
        # (e.g. a step function's closure that went out of scope after recording).
        self._inputs: dict = {}
        # Captured without running (torch.accelerator.Graph) and not replayed yet: the range of
        # handle ids the capture made (see runtime.stream.unreplayed_captures).
        self._unreplayed: tuple[str, int, int] | None = None

    def replay(self) -> None:
        if self.program_id is None:
            raise GenieError("this genie.Graph has not recorded anything yet: use `with genie.graph(g):` first")
        stream = self._stream
        with stream.lock:
            stream.append([REPLAY_OP, [self.program_id], {}, None])
        if self._unreplayed is not None:  # the handles its capture made exist from now on
            unreplayed_captures.discard(self._unreplayed)
            self._unreplayed = None

    def __repr__(self) -> str:
        state = f"program {self.program_id}, {self.ops} ops" if self.program_id is not None else "empty"
        return f"genie.Graph({state})"


def _drop(stream, program_id: int) -> None:
    """When a Graph dies, its program is dropped on the daemon (with the stream's next batch
    that is not being recorded). deque.append is atomic: safe from a finalizer on any thread."""
    stream.dropped_programs.append(program_id)


class _OnlyThisDevice(TorchDispatchMode):
    """While a block records: refuse an op that writes into a tensor off the recorded device (a
    CPU tensor, another device's). It runs once, now, and a replay would not run it: the value
    would silently stop changing, as a torch.optim optimizer's CPU step count does (bias
    correction then freezes: seen with AdamW, whose replayed training drifted from eager).

    It also collects the handles of the recorded stream that ops read and that existed before
    the block (ids below `first_new`: ids only grow), for the graph to hold."""

    def __init__(self, device: torch.device, stream, first_new: int) -> None:
        super().__init__()
        self.device = device
        self.stream = stream
        self.thread = threading.get_ident()  # the recording one (see runtime.stream.on_behalf)
        self.first_new = first_new
        self.inputs: dict = {}  # handle id -> HandleRef

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, LazyTensor) and t._genie.id < self.first_new and t._genie.stream is self.stream:
                self.inputs[t._genie.id] = t._genie
        if func._schema.is_mutable:
            for i, spec in enumerate(func._schema.arguments):
                if spec.alias_info is None or not spec.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) and not spec.kwarg_only else kwargs.get(spec.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor) and t.device != self.device and t.device.type != "meta":
                        raise GenieError(
                            f"genie.graph: {func.name()} writes into a tensor on {t.device} (shape "
                            f"{list(t.shape)}), which a recording of {self.device} does not capture: a replay "
                            "would not run it. torch.optim optimizers keep their step counts on the CPU unless "
                            "built with capturable=True: pass capturable=True (their state then lives on the device)")
        if threading.get_ident() == self.thread:
            return func(*args, **kwargs)
        before, on_behalf.stream = on_behalf.stream, self.stream  # the block's backward, on autograd's thread
        try:
            return func(*args, **kwargs)
        finally:
            on_behalf.stream = before


def _begin(g: Graph, device, run: bool, began: list) -> None:
    """Start recording into `g` on `device`, appending (stream, guard) to `began` once recording is
    on; `run`: the recorded ops also run now (genie.graph), else they only record
    (torch.accelerator.Graph, whose capture runs nothing, as CUDA's). The caller calls this inside
    its `try`, and `_stop_recording` if `began` was appended to, whatever was raised."""
    if g.program_id is not None:
        raise GenieError("this genie.Graph already holds a program; make a new one")
    device = torch.device(device)
    stream = get_runtime().stream(device.index)
    with stream.lock:
        if stream.recording is not None:
            if stream.recording_thread != threading.get_ident():
                raise GenieError(f"another thread is recording a block on {device} (a genie.graph or a "
                                 "torch.accelerator.Graph capture): a device records one block at a time")
            raise GenieError("genie.graph blocks cannot be nested on one device")
        stream.flush()  # ops from before the block are not part of it
        _start_recording(stream, run, began)


# These two run whole (a Ctrl-C is kept for the next Genie call): one that stopped them halfway
# left the stream recording for good, every later read refused (scripts/interrupt_fuzz.py).

@runs_whole
def _start_recording(stream, run: bool, began: list) -> None:
    stream.recording = []
    stream.record_only = not run
    stream.recording_thread, stream.recording_made = threading.get_ident(), set()
    guard = _OnlyThisDevice(stream.device, stream, first_new=stream.new_handle())
    guard.__enter__()
    began.append((stream, guard))


@runs_whole
def _stop_recording(stream, guard, completed: bool, state: list | None = None) -> tuple[list, bool]:
    """Stop recording (and clear `state[1]`, a torch.accelerator.Graph's capture); the batches
    recorded, and whether they ran."""
    try:
        guard.__exit__(None, None, None)
        if completed:
            with stream.lock:
                stream.flush()
    finally:
        with stream.lock:
            batches, stream.recording = stream.recording, None
            stream.recording_thread, stream.batch_recorded, stream.recording_made = None, False, set()
            ran, stream.record_only = not stream.record_only, False
        if state is not None:
            state[1] = None
    return batches, ran


def _define(g: Graph, stream, guard, batches: list, ran: bool) -> bool:
    """Define the program of a block that completed on the daemon, and make `g` replay it; False
    (nothing defined) where the block recorded no remote ops."""
    kept: list = []
    for ops, frees, settings in batches:  # frees alone go with the ops before them
        if ops:
            kept.append([ops, list(frees), settings])
        elif kept:
            kept[-1][1] += frees
    batches = kept
    if not batches:
        return False
    # A replay runs under the numerics settings its ops were recorded under (as a CUDA graph
    # keeps the kernels chosen when it was captured), whatever is in force when it is replayed.
    settings = {repr(b[2]) for b in batches}
    if len(settings) > 1:
        raise GenieError(
            "numerics settings (TF32 / matmul precision, deterministic algorithms, cuDNN flags, "
            "sdpa_kernel backends) changed inside the genie.graph block; a replay runs under one set: "
            "put the setting around the whole block (e.g. `with sdpa_kernel(...), genie.graph(g):`)")
    recorded = batches[0][2]
    with stream.lock:
        program_id = stream.new_handle()
        # The drop is set up before the definition is queued: set up after the synchronize below,
        # a Ctrl-C in it left the program on the daemon for good (scripts/interrupt_fuzz.py). A drop
        # of a program never defined, or refused, does nothing.
        g._finalizer = weakref.finalize(g, _drop, stream, program_id)
        stream.append([DEFINE_OP, [program_id, [b[:2] for b in batches]] + ([recorded] if recorded else []), {}, None])
    stream.synchronize()  # the daemon checks the program now, so a bad one fails here, not at replay
    g.program_id, g._stream, g._inputs = program_id, stream, guard.inputs
    g.ops = sum(len(b[0]) for b in batches)
    g.op_names = [op[0] for b in batches for op in b[0]]
    if not ran:
        g._unreplayed = (stream.link.endpoint, guard.first_new, program_id)
        unreplayed_captures.add(g._unreplayed)
        weakref.finalize(g, unreplayed_captures.discard, g._unreplayed)
    return True


@contextlib.contextmanager
def graph(g: Graph, device="remote_accelerator:0"):
    """Run the block once and record its ops on `device` into `g` (see the module docstring)."""
    began = []  # (stream, guard) once recording is on
    try:
        _begin(g, device, True, began)
        yield g
    except BaseException:
        if began:
            _stop_recording(*began[0], completed=False)
        raise
    recorded = _stop_recording(*began[0], completed=True)
    if not _define(g, *began[0], *recorded):
        raise GenieError("the genie.graph block recorded no remote ops")


# ------------------------------------------------------------------ torch.accelerator.Graph
# Genie's C++ graph implementation for the device (genie/csrc/device_guard.cpp) calls this: a
# capture records a program on the current device without running it, as a CUDA graph's capture
# runs nothing (tensors the block makes get their values at the first replay); replay() replays it.


def _accelerator_graph(action: str, state: list | None, path: str):
    """state: [genie.Graph, (stream, guard) while capturing, else None], made by "begin"."""
    if action == "begin":
        g, began = Graph(), []
        try:
            _begin(g, torch.device(DEVICE_TYPE, get_runtime().current_device), False, began)
        except BaseException:
            if began:
                _stop_recording(*began[0], completed=False)
            raise
        return [g, began[0]]
    if action == "end":
        g, capture = state
        batches, ran = _stop_recording(*capture, completed=True, state=state)
        if not _define(g, *capture, batches, ran):
            # As CUDA's: a warning, and replays that do nothing (raising here would replace the
            # exception of a block that ended early, a Ctrl-C among them: torch's __exit__ ends
            # the capture whatever happened).
            state[0] = None
            warnings.warn("this torch.accelerator.Graph captured no remote_accelerator ops (on another "
                          "device or stream, or the block ended early): its replays do nothing", stacklevel=2)
    elif action == "replay":
        if state[0] is not None:
            state[0].replay()
    elif action == "reset":  # the graph (and its program on the daemon) goes; a capture in progress ends
        if state[1] is not None:
            _stop_recording(*state[1], completed=False, state=state)
        state[0] = None
    elif action == "dump":
        with open(path, "w") as f:
            f.write("".join(f"{name}\n" for name in (state[0].op_names if state[0] is not None else ())))
    else:
        raise ValueError(f"unknown graph action {action!r}")
    return None


def install_accelerator_graph() -> None:
    from . import native_guard

    native_guard.set_graph_hook(_accelerator_graph)  # a module function: alive for good
