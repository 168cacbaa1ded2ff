"""torch.load(f, map_location="remote_accelerator[:N]"): checkpoints straight onto a remote device.

torch.load restores each storage through the deserializers registered with
`torch.serialization.register_package`, then rebuilds every tensor as
`torch.empty(0, device=storage.device).set_(storage, offset, size, stride)`. This
process holds no storage for remote tensors, so Genie's deserializer returns a
stand-in: a storage object on the device carrying the checkpoint's bytes. The
first `set_` on it (see transfers) uploads
those bytes once as a uint8 tensor, and each rebuilt tensor becomes a view of
that tensor's storage on the daemon (genie::alias_storage): tensors that shared
a storage in the checkpoint share it on the daemon. The stand-in, and with it
the uploaded tensor's handle, goes when torch.load drops its storages.
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch

from genie.runtime.device_type import DEVICE_TYPE
from genie.transport.tensors import as_marked_view

PRIORITY = 1  # before PyTorch's own (cpu 10 ... privateuse1 23), which would ask this device for storage


def _deserialize(storage, location: str):
    if not location.startswith(DEVICE_TYPE):
        return None
    device = torch.device(location)
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    if storage.device.type != "cpu":
        storage = storage.cpu()
    # A storage on the device that points at the checkpoint's bytes in this process: torch.load
    # caches a storage (so tensors sharing it share it) only where its data pointer is not null.
    # Nothing reads through it: the only use of it is the rebuild's set_, which uploads the bytes.
    stand_in = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), device, storage.nbytes())
    stand_in._genie_bytes = storage  # the checkpoint's bytes: kept as long as the stand-in points at them
    stand_in._genie_source = None  # once uploaded: those bytes on the daemon, one uint8 tensor
    return stand_in


def _tag(storage):
    return None  # saving: remote tensors pickle as CPU tensors (cpu_for_saving)


# (daemon link, the storage's name there) -> the CPU copy of that storage, while something holds it:
# during a torch.save, its table of storages to write does, so every tensor of that storage
# saved by the same call becomes a view of one CPU storage, which torch.save writes once.
# Nothing else keeps these copies, so a later save fetches the storage's values anew.
_fetched_storages: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_fetch_lock = threading.Lock()


def cpu_for_saving(t) -> torch.Tensor:
    """The CPU tensor a remote tensor pickles as: a view, at t's offset and strides, of a CPU copy
    of t's whole storage on the daemon. torch.save writes whole storages and restores views of
    them (PyTorch's serialization notes: "saving and loading tensors preserves views"); a view of
    a large storage therefore saves all of it, as on CPU and CUDA (save `t.clone()` to save less)."""
    place = _fetched_ahead(t)
    if place is None:
        place = _fetch_storage(t)
    storage, offset, strides, (conj, neg) = place
    view = torch.empty(0, dtype=t.dtype).set_(storage, offset, t.shape, strides)
    view = as_marked_view(view, conj, neg)  # as torch.save keeps a conjugate / negative view
    return view.requires_grad_(t.requires_grad)  # as torch.save keeps it (a loaded tensor is a leaf)


def _fetch_storage(t) -> tuple:
    """t's CPU storage (fetched, or shared with a tensor of the same storage saved before it in
    this torch.save), its place in it and its conjugate / negative bits. Two round trips."""
    from .transfers import storage_of
    from .materialize import to_cpu

    with _fetch_lock:
        whole, key, offset, strides, bits = storage_of(t)
        storage = _fetched_storages.get(key)  # never an empty one: those all share one name
        if storage is None:
            storage = to_cpu(whole).untyped_storage()
            if storage.nbytes():
                _fetched_storages[key] = storage
        del whole  # its handle on the daemon goes with it
    return storage, offset, strides, bits


# While torch.save runs on this thread: {id(t): (t, ops queued on its device then, storage, offset,
# strides, bits)} for the remote tensors found in what it saves, fetched before it starts.
_ahead = threading.local()


def _fetched_ahead(t) -> tuple | None:
    """t's place fetched before this torch.save began, while no op has been queued on its device
    since (one may have written to it); else None."""
    places = getattr(_ahead, "places", None)
    entry = places.get(id(t)) if places else None
    if entry is None or entry[0] is not t or t._genie.stream.ops_captured != entry[1]:
        return None
    return entry[2:]


def _remote_tensors_in(obj) -> list:
    """The remote tensors torch.save(obj) will write: those in nested dicts, lists and tuples (a
    state_dict, an optimizer's) and the parameters and buffers of modules among them. Nothing is
    walked while no daemon is connected (no remote tensor can exist): torch.save of a large
    Python structure pays for this walk (~0.05 s per million items) only in a program using Genie."""
    from genie.runtime import started_runtime

    from .lazy_tensor import LazyTensor, tensors_in

    if started_runtime() is None:
        return []
    found, seen = [], set()
    for t in tensors_in(obj):
        if isinstance(t, LazyTensor) and t._genie.storage_nbytes and id(t) not in seen:
            seen.add(id(t))
            found.append(t)
    return found


def _fetch_all(tensors: list) -> dict:
    """The places of `tensors` in their storages, and those storages' values, fetched together:
    one round trip per daemon to name the storages, then one fetch of each storage for all."""
    from .transfers import storages_of
    from .materialize import to_cpu_many

    by_stream: dict = {}
    for t in tensors:
        by_stream.setdefault(t._genie.stream, []).append(t)
    found, wholes = [], {}
    for stream, group in by_stream.items():
        before = stream.ops_captured
        places = storages_of(group)  # queued on the stream itself, as one op
        # Another thread's op queued meanwhile may or may not be in the values: none are used then.
        queued = stream.ops_captured if stream.ops_captured == before + 1 else -1
        for t, (whole, key, offset, strides, bits) in zip(group, places):
            wholes.setdefault(key, whole)
            found.append((t, queued, key, offset, strides, bits))
    storages = dict(zip(wholes, (v.untyped_storage() for v in to_cpu_many(list(wholes.values())))))
    return {id(t): (t, queued, storages[key], offset, strides, bits) for t, queued, key, offset, strides, bits in found}


def _saving_together(save):
    """torch.save that fetches the remote tensors it will write all at once: a state_dict of 350
    tensors took 701 round trips, two per tensor, one after another as pickling reached each."""
    @functools.wraps(save)
    def saving(obj, f, *args, **kwargs):
        if getattr(_ahead, "places", None) is not None:  # a torch.save inside one (a __reduce__)
            return save(obj, f, *args, **kwargs)
        tensors = _remote_tensors_in(obj)
        _ahead.places = _fetch_all(tensors) if len(tensors) > 1 else {}
        try:
            return save(obj, f, *args, **kwargs)
        finally:
            _ahead.places = None

    saving._genie_wraps = save
    return saving


def uploaded(storage: torch.UntypedStorage, device: torch.device):
    """The uint8 remote tensor holding a stand-in's bytes (uploaded on first use); None for any
    other storage, which cannot be named to a daemon."""
    if not hasattr(storage, "_genie_bytes"):
        return None
    if storage._genie_source is None:
        raw = torch.empty(0, dtype=torch.uint8).set_(storage._genie_bytes)
        storage._genie_source = raw.to(device)
    return storage._genie_source


_registered = False


def register() -> None:
    global _registered
    if not _registered:
        torch.serialization.register_package(PRIORITY, _tag, _deserialize)
        torch.save = torch.serialization.save = _saving_together(torch.serialization.save)
        _registered = True
