"""torch.load(f, map_location="remote_accelerator[:N]"): checkpoints straight onto a remote device.

torch.load restores each storage through the deserializers registered with
`torch.serialization.register_package`, then rebuilds every tensor as
`torch.empty(0, device=storage.device).set_(storage, offset, size, stride)`. This
process holds no storage for remote tensors, so Genie's deserializer returns a
stand-in: a storage object on the device carrying the checkpoint's bytes. The
first `set_` on it (see capture) uploads
those bytes once as a uint8 tensor, and each rebuilt tensor becomes a view of
that tensor's storage on the daemon (genie::alias_storage): tensors that shared
a storage in the checkpoint share it on the daemon. The stand-in, and with it
the uploaded tensor's handle, goes when torch.load drops its storages.
"""
from __future__ import annotations

import threading
import weakref

import torch

from genie.transport.tensors import as_marked_view

NAME = "remote_accelerator"
PRIORITY = 1  # before PyTorch's own (cpu 10 ... privateuse1 23), which would ask this device for storage


def _deserialize(storage, location: str):
    if not location.startswith(NAME):
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
    from .capture import storage_of
    from .materialize import to_cpu

    with _fetch_lock:
        whole, key, offset, strides, (conj, neg) = storage_of(t)
        storage = _fetched_storages.get(key)  # never an empty one: those all share one name
        if storage is None:
            storage = to_cpu(whole).untyped_storage()
            if storage.nbytes():
                _fetched_storages[key] = storage
        del whole  # its handle on the daemon goes with it
    view = torch.empty(0, dtype=t.dtype).set_(storage, offset, t.shape, strides)
    view = as_marked_view(view, conj, neg)  # as torch.save keeps a conjugate / negative view
    return view.requires_grad_(t.requires_grad)  # as torch.save keeps it (a loaded tensor is a leaf)


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
        _registered = True
