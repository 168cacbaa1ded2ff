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

import torch

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
    return None  # saving: remote tensors pickle as their CPU values already


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
