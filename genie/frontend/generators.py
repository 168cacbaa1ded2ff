"""torch.Generator(device="remote_accelerator") as an op argument.

The generator object is Genie's C++ one (genie/csrc/device_guard.cpp): it knows its id, its
seed and how often it was seeded. Each op that draws from it carries all three; the daemon keeps
a twin generator per id for this client and re-seeds the twin when the count it saw differs, so
`g.manual_seed(s)` followed by draws gives the same numbers every time, as on CUDA. A generator
the program drops (its C++ object destroyed: Python wrappers of one generator come and go) is
dropped on the daemon too, with the next op that draws from a generator on the same device.
`g.get_state()` / `g.set_state(s)` read or set the twin's state in program order (the C++
generator calls genie.frontend.device's hooks).
"""
from __future__ import annotations

import torch

from genie.errors import GenieError, UnsupportedOperationError
from genie.runtime.device_type import DEVICE_TYPE
from genie.transport import protocol
from genie.transport.protocol import FREE_GENERATORS_OP

from . import native_guard


_homes: dict[int, object] = {}  # generator id -> the DeviceStream it last drew on (its daemon has a twin)
_dropped: list[int] = []  # ids of generators gone from this process, not yet dropped on their daemon


def encode(generator: torch.Generator, stream) -> protocol.msgpack.ExtType:
    """The wire form of `generator` for an op queued on `stream` (stream lock held)."""
    if generator.device.type != DEVICE_TYPE:
        raise RuntimeError(f"Expected a '{DEVICE_TYPE}' device type for generator but found '{generator.device.type}'")
    info = native_guard.generator_info(generator)
    if info is None:
        raise UnsupportedOperationError("generator", "remote_accelerator generators need Genie's C++ device "
                                        "guard, which could not be built here (see the warning at import)")
    if generator.device.index != stream.device.index:
        raise RuntimeError(f"Expected a generator on {stream.device}, but found one on {generator.device}")
    return encode_fields(*info, stream)


def encode_fields(uid: int, version: int, seed: int, stream) -> protocol.msgpack.ExtType:
    """The wire form of the generator with these fields (generator_info's) for an op queued on
    `stream` (stream lock held): the daemon then holds its twin there until it is dropped."""
    if stream.records_here():
        raise GenieError("an op in a genie.graph cannot use a torch.Generator (its position would be "
                         "fixed at recording): draw from the default generator, seeded with torch.manual_seed")
    _homes[uid] = stream
    _dropped.extend(native_guard.generators_dropped())
    if _dropped:
        _drop_generators(stream)
    return protocol.encode_generator(uid, version, seed)


def _drop_generators(stream) -> None:
    """Queue the drop of dropped generators that last drew on `stream` (queued after their last
    draw: another device's batches on the same daemon may still be unsent). The entry goes
    straight into this thread's open batch: posting it here would send payloads already attached
    for the op being encoded without that op (with those attached, the batch is already this
    thread's, and `own_batch` posts nothing). Threads queuing ops on other devices run this at
    the same time (each under its own stream's lock): `_dropped` is taken by atomic pops."""
    here, elsewhere = [], []
    while True:
        try:
            uid = _dropped.pop()
        except IndexError:
            break
        home = _homes.get(uid)
        if home is None:
            continue
        (here if home is stream else elsewhere).append(uid)
    for uid in here:
        del _homes[uid]
    _dropped.extend(elsewhere)
    if here:
        stream.own_batch()  # into this thread's batch (not one a genie.graph on another thread records)
        stream.ops.append([FREE_GENERATORS_OP, here, {}, None])


def _rebuild(device: str, seed: int, state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    generator.set_state(state)
    return generator


def _reduce(generator: torch.Generator):
    """copy.deepcopy and pickling of a remote_accelerator generator, as of a CUDA one: a new
    generator with its seed and its state (read from the daemon after the queued ops). PyTorch's
    own reduction asks every non-CPU generator for a Philox offset, which this one has not (its
    position lives on the daemon, in its state), and failed with "returned a result with an
    exception set". Every other generator keeps PyTorch's reduction."""
    if generator.device.type != DEVICE_TYPE:
        return generator.__reduce__()
    return _rebuild, (str(generator.device), generator.initial_seed(), generator.get_state())


def register_copying() -> None:
    """Route copy.deepcopy / pickle of torch.Generator through _reduce (copyreg's table is where
    both look before a type's own __reduce__)."""
    import copyreg

    copyreg.pickle(torch.Generator, _reduce)
