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
shape depends on data): those raise a GenieError. Replays queue like any op, in program order.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from genie.errors import GenieError
from genie.runtime import get_runtime

DEFINE_OP = "genie::define_program"
REPLAY_OP = "genie::replay"
DROP_OP = "genie::drop_program"


class Graph:
    """A recorded program of remote ops on one device."""

    def __init__(self) -> None:
        self.program_id: int | None = None
        self.ops = 0  # ops recorded
        self._stream = None
        self._finalizer = None

    def replay(self) -> None:
        if self.program_id is None:
            raise GenieError("this genie.Graph has not recorded anything yet: use `with genie.graph(g):` first")
        stream = self._stream
        with stream.lock:
            stream.append([REPLAY_OP, [self.program_id], {}, None])

    def __repr__(self) -> str:
        state = f"program {self.program_id}, {self.ops} ops" if self.program_id is not None else "empty"
        return f"genie.Graph({state})"


def _drop(stream, program_id: int) -> None:
    """When a Graph dies, its program is dropped on the daemon (queued with the stream's next batch)."""
    try:
        with stream.lock:
            stream.append([DROP_OP, [program_id], {}, None])
    except Exception:  # noqa: BLE001 - the runtime may already be shut down at exit
        pass


@contextlib.contextmanager
def graph(g: Graph, device="remote_accelerator:0"):
    """Run the block once and record its ops on `device` into `g` (see the module docstring)."""
    if g.program_id is not None:
        raise GenieError("this genie.Graph already holds a program; make a new one")
    device = torch.device(device)
    stream = get_runtime().stream(device.index)
    with stream.lock:
        if stream.recording is not None:
            raise GenieError("genie.graph blocks cannot be nested on one device")
        stream.flush()  # ops from before the block are not part of it
        stream.recording = []
    try:
        yield g
        with stream.lock:
            stream.flush()
    finally:
        with stream.lock:
            batches, stream.recording = stream.recording, None
    batches = [b for b in batches if b[0]]  # frees alone need no replay
    if not batches:
        raise GenieError("the genie.graph block recorded no remote ops")
    with stream.lock:
        program_id = stream.new_handle()
        stream.append([DEFINE_OP, [program_id, batches], {}, None])
    stream.synchronize()  # the daemon checks the program now, so a bad one fails here, not at replay
    g.program_id, g._stream = program_id, stream
    g.ops = sum(len(ops) for ops, _ in batches)
    g._finalizer = weakref.finalize(g, _drop, stream, program_id)
