"""Remote tensors sent to another process through torch.multiprocessing (Queue, Pipe, Process
arguments, DataLoader workers' results) arrive on remote_accelerator, as CUDA tensors arrive on
CUDA. Before, they pickled as for torch.save and arrived as CPU tensors: the receiver's work
silently moved to its CPU.

A CUDA tensor is shared through CUDA IPC, so both processes then write one memory. A remote
tensor's memory belongs to one client of a daemon, which no other process can name: the
receiver gets a copy, made from the values sent (which travel as CPU tensors do, in shared
memory) and uploaded to the same-numbered remote device of its own (the same daemon where both
processes use one configuration). Writes in one process are not seen by the other.

DataLoader workers' batches of remote samples are stacked on the device (`_collate`): torch's
default collate stacks a worker's batch into new shared-memory storage of the samples' device,
which remote tensors cannot have (it failed with Genie's storage refusal); the batch then leaves
the worker as any remote tensor does, above.
"""
from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import torch

from .lazy_tensor import LazyTensor


def _rebuild(values: torch.Tensor, device: str, requires_grad: bool, is_parameter: bool) -> torch.Tensor:
    tensor = values.to(device)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad)
    return tensor.requires_grad_(requires_grad)


def _reduce(t: LazyTensor):
    from .serialization import cpu_for_saving

    if t.requires_grad and not t.is_leaf:  # torch.multiprocessing's own refusal, in its words
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not "
            "support crossing process boundaries.  If you just want to transfer the data, call detach() "
            "on the tensor before serializing (e.g., putting it on the queue).")
    values = cpu_for_saving(t).detach()
    return _rebuild, (values, str(t.device), t.requires_grad, bool(getattr(t, "_is_param", False)))


def _collate(batch, *, collate_fn_map=None) -> torch.Tensor:
    """default_collate's rule for remote tensors: stacked on their device, in workers too."""
    return torch.stack(batch, 0)


_registered = False


def register() -> None:
    global _registered
    if not _registered:
        from torch.utils.data._utils.collate import default_collate_fn_map

        ForkingPickler.register(LazyTensor, _reduce)
        default_collate_fn_map.setdefault(LazyTensor, _collate)
        _registered = True
