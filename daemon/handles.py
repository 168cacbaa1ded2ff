"""Per-client handle tables and the accounting of resident memory.

A handle is a client-chosen integer naming a tensor the daemon keeps for that
client. Tables are strictly per client: ids are never looked up across clients.
A handle can instead hold a `Poison`, the error of the op that should have
produced it, so that failures surface when (and only if) the client uses it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from genie.transport.errors import ProtocolError

MAX_OWN_GENERATORS = 4096  # torch.Generators one client may draw from at once (each has a twin here)
MAX_COPY_MEMOS = 256  # copy.deepcopy calls of one client whose memo is not freed yet (nested ones included)


@dataclass(frozen=True, slots=True)
class Poison:
    op: str
    type: str
    message: str

    def describe(self) -> dict:
        return {"type": self.type, "message": self.message, "op": self.op}


class Poisoned(Exception):
    """An op's input holds a Poison: the op fails with that input's original error."""

    def __init__(self, poison: Poison) -> None:
        self.poison = poison


def held(client: "ClientState", ref) -> torch.Tensor:
    """The tensor the client holds under `ref` (a HandleRef); raises Poisoned if that handle is
    poisoned (KeyError if unknown)."""
    found = client.get(ref.id)
    if isinstance(found, Poison):
        raise Poisoned(found)
    return found


class MemoryAccount:
    """Bytes of distinct storages held through handles, with the peak."""

    def __init__(self) -> None:
        self._storages: dict[int, list[int]] = {}  # storage key -> [nbytes, refs]
        self.allocated = 0
        self.peak = 0

    @staticmethod
    def key_of(t: torch.Tensor) -> tuple[int, int]:
        # The storage object's identity, not its memory's address: that changes when the storage
        # is resized (FSDP2 frees and re-allocates unsharded parameters so).
        s = t.untyped_storage()
        return s._cdata, s.nbytes()

    def add(self, key: int, nbytes: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            self._storages[key] = [nbytes, 1]
            self.allocated += nbytes
            if self.allocated > self.peak:
                self.peak = self.allocated
        else:
            entry[1] += 1

    def resized(self, key: int, nbytes: int) -> None:
        """A held storage now has `nbytes` (t.untyped_storage().resize_())."""
        entry = self._storages.get(key)
        if entry is None:
            return
        self.allocated += nbytes - entry[0]
        entry[0] = nbytes
        if self.allocated > self.peak:
            self.peak = self.allocated

    def remove(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.allocated -= entry[0]


class ClientState:
    """Everything the daemon holds for one connected client."""

    def __init__(self, identity: bytes, account: MemoryAccount) -> None:
        self.identity = identity
        self.tensors: dict[int, torch.Tensor | Poison] = {}
        self._keys: dict[int, int] = {}
        self._account = account
        self.generators: dict[str, torch.Generator] = {}
        # the client's torch.Generator objects: id -> (seedings seen, device, twin generator)
        self.own_generators: dict[int, tuple[int, torch.device, torch.Generator]] = {}
        self.persistent: set[int] = set()  # handles marked as long-lived state (KV caches)
        from .streams import ClientStreams

        self.streams = ClientStreams()
        self.last_seen = time.monotonic()
        # Set by hello: how often the client pings (None: not said, 0: never). With it, a client
        # whose direct lane closed (its process ended) and that has been silent since is known gone
        # before its lease runs out (DaemonServer._sweep_idle_clients).
        self.heartbeat_s: float | None = None
        self.lane_closed_at: float | None = None  # time.monotonic() of its direct lane's end
        self.lane_key: bytes | None = None  # a CURVE daemon's key for this client's sealed lane (given in hello)
        # A peer daemon (it deposits tensors here), not a program: "here" (loopback or ipc), or
        # "elsewhere" (another host's address); None: a program's client.
        self.peer: str | None = None
        self.programs: dict = {}  # program id -> executor.Program (recorded genie.graph blocks)
        self.program_handles: dict[int, list] = {}  # handle a program writes -> those programs
        # memo handle -> {(storage address, bytes): (that storage, its copy)}: one copy.deepcopy's
        # copies of storages (executor._copy_storage), until the client frees the memo handle.
        self.copy_memos: dict[int, dict] = {}

    def get(self, handle: int) -> torch.Tensor | Poison:
        try:
            return self.tensors[handle]
        except KeyError:
            raise KeyError(f"handle {handle} does not exist for this client") from None

    def put(self, handle: int, value: torch.Tensor | Poison) -> None:
        if handle in self.tensors:
            key = self._keys.pop(handle, None)
            if key is not None:
                self._account.remove(key)
            if self.persistent:
                self.persistent.discard(handle)
        self.tensors[handle] = value
        if isinstance(value, torch.Tensor):
            key, nbytes = MemoryAccount.key_of(value)
            self._keys[handle] = key
            self._account.add(key, nbytes)

    def recount(self, handle: int) -> None:
        """The tensor under `handle` may have a resized or another storage now (an out= op, resize_,
        set_): the memory account follows."""
        value = self.tensors.get(handle)
        if not isinstance(value, torch.Tensor):
            return
        key, nbytes = MemoryAccount.key_of(value)
        old = self._keys.get(handle)
        if old == key:
            self._account.resized(key, nbytes)
        else:
            if old is not None:
                self._account.remove(old)
            self._keys[handle] = key
            self._account.add(key, nbytes)

    def free(self, handle: int) -> None:
        self.tensors.pop(handle, None)
        if self.copy_memos:
            self.copy_memos.pop(handle, None)
        if self.persistent:
            self.persistent.discard(handle)
        key = self._keys.pop(handle, None)
        if key is not None:
            self._account.remove(key)

    def release(self, handle: int) -> None:
        """The client dropped `handle`: free it, and have programs that write it free it after each replay."""
        self.free(handle)
        for program in self.program_handles.get(handle, ()):
            program.released.add(handle)

    def free_all(self) -> None:
        for handle in list(self.tensors):
            self.free(handle)
        self.copy_memos.clear()
        self.programs.clear()
        self.program_handles.clear()

    def drawing_generator(self, ref, device: torch.device) -> torch.Generator:
        """The twin of the client's torch.Generator `ref` (a protocol.GeneratorRef) for an op on
        `device`, (re)seeded when the client seeded its generator since the twin last drew."""
        entry = self.own_generators.get(ref.id)
        if entry is not None:
            if entry[1] != device:
                raise ProtocolError(f"generator {ref.id} belongs to {entry[1]}, not {device}")
            if entry[0] == ref.version:
                return entry[2]
        elif len(self.own_generators) >= MAX_OWN_GENERATORS:
            raise ProtocolError(f"a client may draw from at most {MAX_OWN_GENERATORS} torch.Generators at once; "
                                "drop some")
        gen = torch.Generator(device=device)
        gen.manual_seed(ref.seed)
        self.own_generators[ref.id] = (ref.version, device, gen)
        return gen

    def generator(self, device: torch.device) -> torch.Generator:
        """This client's own RNG on `device`, so one client's seed never moves another's stream."""
        key = str(device)
        gen = self.generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.seed()
            self.generators[key] = gen
        return gen

