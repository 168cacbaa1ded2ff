"""`nn.DataParallel` over remote devices.

After `import genie` on a machine without CUDA, remote_accelerator is PyTorch's current
accelerator, so `nn.DataParallel(model)` uses every remote device: it moves the model to
remote_accelerator:0 (as it moves one to cuda:0), scatters each batch over the devices, runs a
replica on each and gathers the outputs on the first. Its data movement goes through
`torch.nn.parallel.comm`, whose scatter, gather and broadcasts are C++ functions of CUDA builds
(`torch._C._scatter` and others): without this module DataParallel failed there with "module
'torch._C' has no attribute '_scatter'", with one device as with several.

Here those four functions, given remote tensors (or device indices of remote_accelerator, the
current accelerator), are made of ordinary ops: chunks and copies between devices (`.to`),
and a `cat` on the destination; so is reduce_add (backward's sum of the replicas' gradients),
whose NCCL check warned at every step on a build without NCCL. Everything else goes to
PyTorch's own functions.
"""
from __future__ import annotations

import warnings

import torch
from torch._utils import _get_device_index
from torch.nn.parallel import comm

from genie.runtime.device_type import DEVICE_TYPE


_originals: dict[str, object] = {}


def _remote(tensors, devices=()) -> bool:
    """Whether this call is about remote devices: a tensor is remote, or the indices name devices
    of the current accelerator and that is remote_accelerator (CUDA, where present, comes first)."""
    if any(isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE for t in tensors):
        return True
    if any(isinstance(d, torch.device) and d.type == DEVICE_TYPE for d in devices):
        return True
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors):
        return False
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == DEVICE_TYPE


def _device(index: int) -> torch.device:
    return torch.device("cpu") if index == -1 else torch.device(DEVICE_TYPE, index)


def _indices(devices) -> list[int]:
    return [_get_device_index(d) for d in devices]


def broadcast(tensor, devices=None, *, out=None):
    if not _remote([tensor, *(out or ())], devices or ()):
        return _originals["broadcast"](tensor, devices, out=out)
    if (devices is None) == (out is None):
        raise RuntimeError(f"Exactly one of 'devices' and 'out' must be specified, but got devices={devices} and out={out}")
    if out is not None:
        for target in out:
            target.copy_(tensor, non_blocking=True)
        return tuple(out)
    return tuple(tensor.to(_device(index), non_blocking=True) for index in _indices(devices))


def broadcast_coalesced(tensors, devices, buffer_size=10485760):
    if not _remote(tensors, devices):
        return _originals["broadcast_coalesced"](tensors, devices, buffer_size)
    indices = _indices(devices)
    source = _device(indices[0])
    if any(t.device != source for t in tensors):
        raise RuntimeError(f"All tensors must be on devices[0]: {indices[0]}")
    # As PyTorch's: the first device's "copies" are the tensors themselves.
    return [list(tensors)] + [[t.to(_device(index), non_blocking=True) for t in tensors] for index in indices[1:]]


def scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
    if not _remote([tensor, *(out or ())], devices or ()):
        return _originals["scatter"](tensor, devices, chunk_sizes, dim, streams, out=out)
    # Streams are ignored: each copy is queued on its device's current stream, which the caller's
    # wait on `streams` then orders after nothing more.
    if out is not None:
        if devices is not None or chunk_sizes is not None:
            raise RuntimeError("'devices' and 'chunk_sizes' must not be given with 'out'")
        sizes = [t.size(dim) for t in out]
        for target, chunk in zip(out, tensor.split(sizes, dim)):
            target.copy_(chunk, non_blocking=True)
        return tuple(out)
    indices = _indices(devices)
    chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes is not None else tensor.chunk(len(indices), dim)
    # A chunk already on its device stays a view of the input, as PyTorch's does.
    return tuple(chunk.to(_device(index), non_blocking=True) for chunk, index in zip(chunks, indices))


def gather(tensors, dim=0, destination=None, *, out=None):
    if not _remote([*tensors, *([out] if out is not None else [])]):
        return _originals["gather"](tensors, dim, destination, out=out)
    if out is not None:
        if destination is not None:
            raise RuntimeError("'destination' must not be given with 'out'")
        return torch.cat([t.to(out.device) for t in tensors], dim, out=out)
    if destination == -1:
        warnings.warn("Using -1 to represent CPU tensor is deprecated. Please use a device object or string instead, "
                      "e.g., \"cpu\".", FutureWarning, stacklevel=2)
    index = _get_device_index(destination, allow_cpu=True, optional=True)
    target = _device(index)
    return torch.cat([t.to(target, non_blocking=True) for t in tensors], dim)


def reduce_add(inputs, destination=None):
    if not _remote(inputs):
        return _originals["reduce_add"](inputs, destination)
    # PyTorch's own, less its NCCL check (which, on a build without NCCL, warns at every call).
    index = _get_device_index(destination, optional=True)
    roots = [i for i, t in enumerate(inputs) if t.device == _device(index)]
    if not roots:
        raise RuntimeError("reduce_add expects destination to be on the same GPU with one of the tensors")
    if any(t.size() != inputs[0].size() for t in inputs):
        raise ValueError(f"reduce_add: inputs differ in size: {[tuple(t.size()) for t in inputs]}")
    if len(inputs) == 1:
        return inputs[0]
    root = roots[0]
    others = [t for i, t in enumerate(inputs) if i != root]
    result = inputs[root] + others[0].to(_device(index), non_blocking=True)
    for other in others[1:]:
        result.add_(other.to(_device(index), non_blocking=True))
    return result


def forget_copy_streams() -> None:
    """DataParallel keeps one copy stream per device in a list sized by the device count of its
    first use; Genie's count changes when it connects to other daemons (genie.init)."""
    from torch.nn.parallel import _functions

    _functions._streams = None


def install() -> None:
    """Put the functions above in torch.nn.parallel.comm (DataParallel's _functions look them up
    there at each call). Idempotent."""
    for name, replacement in (("broadcast", broadcast), ("broadcast_coalesced", broadcast_coalesced),
                              ("scatter", scatter), ("gather", gather), ("reduce_add", reduce_add)):
        if name not in _originals:
            _originals[name] = getattr(comm, name)
            setattr(comm, name, replacement)
