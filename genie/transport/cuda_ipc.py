"""Same-host GPU path: a CUDA tensor crosses to a daemon on this machine as a CUDA IPC handle.

When the client and the daemon run on one host and the client's tensor is already on a GPU,
sending its bytes would copy them GPU -> host -> socket -> host -> GPU. Instead the client
shares the tensor's memory with torch's own CUDA IPC (`UntypedStorage._share_cuda_`: the
allocation's cudaIpcMemHandle, an IPC event recorded after the writes queued so far, and a
reference counter in shared memory that keeps the block out of the client's allocator until
the daemon lets go), and the daemon opens it and copies it into its own memory on a copy
stream: device-to-device copies only (a snapshot on the client's GPU, then the daemon's copy),
no host memory, no socket bytes.

Only a daemon that listens on this host alone (an ipc:// path or a loopback address) accepts
handles from any client that offers them; one that listens beyond this host takes them only from
clients whose lanes came to its local listener (an abstract Unix socket, see
bulk.local_lane_address) from the daemon's own user, which proves both. The reasons: opening one maps another process's GPU memory, and its reference counter names a
shared-memory file, which no remote peer may choose; and only from clients of its own user
(the counter file's owner), so it never changes counters its user could not. Every field is
checked before torch sees it. Nothing here needs CUDA until a handle is made or opened.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .errors import ProtocolError
from .shared_segments import host_id
from .tensors import check_shape, parse_dtype

HANDLE_MAX_BYTES = 128          # torch's handle: cudaIpcMemHandle_t (64 bytes), with a short prefix
EVENT_HANDLE_BYTES = 64         # cudaIpcEventHandle_t
REF_COUNTER_SLOTS = 10000       # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE
_REF_COUNTER_NAME = re.compile(r"/torch_\d{1,10}_\d{1,12}_\d{1,12}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_only(endpoint: str) -> bool:
    """Whether only processes on this host can reach a daemon listening on `endpoint`."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def offer(endpoint: str, local_lane: bool = False) -> dict | None:
    """What a daemon says in its hello about accepting handles, or None where it cannot. A daemon
    that listens beyond this host takes them only from clients whose lanes came to its local
    listener from its own user (`local_lane`: it has one; see bulk.local_lane_address), said in the
    offer, since only such a lane proves a client shares the host and the user."""
    on_host = local_only(endpoint)
    if not torch.cuda.is_available() or not (on_host or local_lane):
        return None
    host = host_id()
    if host is None:
        return None
    import os

    offered = {"host": host, "uid": os.getuid(), "gpus": [gpu_uuid(i) for i in range(torch.cuda.device_count())]}
    return offered if on_host else {**offered, "local_lane": True}


def needs_local_lane(offered) -> bool:
    """Client side: whether the daemon takes handles only from clients on its local lane."""
    return isinstance(offered, dict) and offered.get("local_lane") is True


def usable(offered, device: torch.device) -> bool:
    """Client side: whether a tensor on `device` can go to a daemon that offered `offered`."""
    import os

    if not isinstance(offered, dict) or offered.get("host") != host_id() or offered.get("uid") != os.getuid():
        return False  # another machine, or another user (whose handles the daemon refuses)
    gpus = offered.get("gpus")
    return isinstance(gpus, list) and gpu_uuid(device.index if device.index is not None else
                                                torch.cuda.current_device()) in gpus


# ---------------------------------------------------------------- the descriptor


@dataclass(frozen=True, slots=True)
class SharedCudaTensor:
    """A contiguous tensor in another process's GPU memory, as the daemon receives it."""
    gpu: str                 # the GPU's UUID (device indices differ between processes)
    handle: bytes
    storage_bytes: int       # the shared storage's size ...
    storage_offset: int      # ... and where it starts in the handle's allocation
    byte_offset: int         # where the tensor starts in the storage
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes | None
    event_sync: bool
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def describe(t: torch.Tensor) -> list:
    """The wire form of a snapshot of a CUDA tensor, for the process at the other end to copy.

    The receiver copies later (a daemon when it runs the request, which may be after the client
    has written to `t` again: `.to()` returns at once; a client after the reply), so what is
    shared is a contiguous copy made now on the current stream: one device-to-device copy,
    ordered before later writes. torch keeps that copy's memory out of reuse until the receiver
    has let go of it, even once this process has dropped it."""
    from .tensors import dtype_name

    t = t.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    (_, handle, storage_bytes, storage_offset, ref_counter, ref_offset,
     event, event_sync) = t.untyped_storage()._share_cuda_()
    return [gpu_uuid(t.device.index), handle, storage_bytes, storage_offset, t.storage_offset() * t.element_size(),
            ref_counter, ref_offset, event or None, bool(event_sync), dtype_name(t.dtype), list(t.shape)]


def _int(value, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"bad CUDA IPC {what} {value!r}")
    return value


def parse(fields: list) -> SharedCudaTensor:
    """Daemon side: a checked descriptor (see `describe`)."""
    if not isinstance(fields, list) or len(fields) != 11:
        raise ProtocolError("bad CUDA IPC descriptor")
    gpu, handle, storage_bytes, storage_offset, byte_offset, ref, ref_offset, event, sync, dtype, shape = fields
    if not isinstance(gpu, str) or not _UUID.fullmatch(gpu.removeprefix("GPU-")):
        raise ProtocolError(f"bad CUDA IPC gpu {gpu!r}")
    if not isinstance(handle, bytes) or not 0 < len(handle) <= HANDLE_MAX_BYTES:
        raise ProtocolError("bad CUDA IPC handle")
    if not isinstance(ref, bytes) or not _REF_COUNTER_NAME.fullmatch(ref.decode("ascii", "replace")):
        raise ProtocolError(f"bad CUDA IPC reference counter {ref!r}")
    if event is not None and (not isinstance(event, bytes) or len(event) != EVENT_HANDLE_BYTES):
        raise ProtocolError("bad CUDA IPC event handle")
    if type(sync) is not bool:
        raise ProtocolError("bad CUDA IPC event flag")
    shared = SharedCudaTensor(
        gpu, handle, _int(storage_bytes, 1, 1 << 44, "storage size"), _int(storage_offset, 0, 1 << 44, "offset"),
        _int(byte_offset, 0, 1 << 44, "tensor offset"), ref, _int(ref_offset, 0, REF_COUNTER_SLOTS - 1, "counter slot"),
        event, sync, parse_dtype(dtype), check_shape(shape))
    if shared.byte_offset + shared.nbytes > shared.storage_bytes:
        raise ProtocolError(f"CUDA IPC tensor of {shared.nbytes} bytes at {shared.byte_offset} overruns its "
                            f"storage of {shared.storage_bytes}")
    return shared


SHM_DIR = "/dev/shm"


def check_ref_counter_owner(shared: SharedCudaTensor) -> None:
    """Refuse a reference counter file this process's user does not own. Releasing an import
    decrements a slot in that file: without this, a client of another user could have the
    daemon (say, run as root) change the counters of processes it cannot touch itself."""
    import os

    path = SHM_DIR + shared.ref_counter.decode("ascii")
    try:
        owner = os.stat(path).st_uid
    except OSError:
        raise ProtocolError(f"CUDA IPC: no reference counter {shared.ref_counter.decode('ascii')} on this host "
                            "(is the client on another machine or in another container?)") from None
    if owner != os.getuid():
        raise ProtocolError("CUDA IPC: the client runs as another user than this daemon; send bytes "
                            "(GENIE_CUDA_IPC=0 on the client) or run both as one user")


# ---------------------------------------------------------------- the daemon's side


class Importer:
    """Opens shared tensors and copies them into this process's memory on a copy stream; the
    opened memory is let go (the producer's counter decremented) once its copy has finished.
    Daemons import what clients send; clients import what `.to("cuda")` fetches."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._held: list[tuple[torch.cuda.Event, torch.cuda.Stream, torch.UntypedStorage]] = []
        self._index_of: dict[str, int] | None = None
        self.imported = 0
        self.imported_bytes = 0

    def _local_index(self, gpu: str) -> int:
        if self._index_of is None:
            self._index_of = {gpu_uuid(i): i for i in range(torch.cuda.device_count())}
        if gpu not in self._index_of:
            raise ProtocolError(f"CUDA IPC: GPU {gpu} is not visible to this process")
        return self._index_of[gpu]

    def release_finished(self) -> None:
        """Let go of opened memory whose copy has finished (the producer may then free it).

        torch's deleter for opened memory synchronizes the *current* stream of its GPU, with the
        GIL held: done with the default stream current, that waits for every kernel queued there
        (the daemon's event loop, needing the GIL, would stall as long). So it runs with the copy
        stream current, whose work is the copies alone."""
        if not self._held:
            return
        finished: dict = {}
        keep = []
        for item in self._held:
            if item[0].query():
                finished.setdefault(item[1], []).append(item[2])
            else:
                keep.append(item)
        item = None
        self._held = keep
        for stream, storages in finished.items():
            with torch.cuda.stream(stream):
                storages.clear()

    def copy_in(self, shared: SharedCudaTensor, device: torch.device, wait: bool = False,
                check_owner: bool = True) -> torch.Tensor:
        """A tensor on `device` holding the shared tensor's values, ordered before later work
        on `device`'s current stream. `wait`: return once the copy is done and the producer's
        memory let go (a client reading a result); else that happens at a later call.
        `check_owner`: refuse a producer of another user (a daemon importing from clients)."""
        self.release_finished()
        if shared.nbytes == 0:
            return torch.empty(shared.shape, dtype=shared.dtype, device=device)
        if check_owner:
            check_ref_counter_owner(shared)
        source = self._local_index(shared.gpu)
        stream = self._streams.get(source)
        if stream is None:
            stream = self._streams[source] = torch.cuda.Stream(device=source)
        with torch.cuda.device(source), torch.cuda.stream(stream):
            # torch makes the current stream (the copy stream) wait for the producer's IPC event.
            storage = torch.UntypedStorage._new_shared_cuda(
                source, shared.handle, shared.storage_bytes, shared.storage_offset, shared.ref_counter,
                shared.ref_counter_offset, shared.event, shared.event_sync)
            view = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", source))
            view.set_(storage, shared.byte_offset, (shared.nbytes,), (1,))
            target = torch.empty(shared.nbytes, dtype=torch.uint8, device=device)
            target.copy_(view, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            view = None
            if wait:
                done.synchronize()
                storage = None  # released here, with the copy stream current (see release_finished)
            else:
                self._held.append((done, stream, storage))
                storage = None
        torch.cuda.current_stream(device).wait_event(done)
        target.record_stream(torch.cuda.current_stream(device))
        self.imported += 1
        self.imported_bytes += shared.nbytes
        return target.view(shared.dtype).view(shared.shape)


_client_importer: Importer | None = None


def client_importer() -> Importer:
    """This process's importer for results fetched to its GPUs (one copy stream per GPU)."""
    global _client_importer
    if _client_importer is None:
        _client_importer = Importer()
    return _client_importer
