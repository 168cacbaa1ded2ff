"""Remote tensors sent to another process through torch.multiprocessing (Queue, Pipe, Process
arguments, DataLoader workers' results) arrive on remote_accelerator, as CUDA tensors arrive on
CUDA. Before, they pickled as for torch.save and arrived as CPU tensors: the receiver's work
silently moved to its CPU.

A CUDA tensor is shared through CUDA IPC, so both processes then write one memory. A remote
tensor's memory belongs to one client of a daemon, which no other process can name: the
receiver gets a copy, made from the values sent (which travel as CPU tensors do, in shared
memory) and uploaded to the same-numbered remote device of its own (the same daemon where both
processes use one configuration). Writes in one process are not seen by the other.
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


_registered = False


def register() -> None:
    global _registered
    if not _registered:
        ForkingPickler.register(LazyTensor, _reduce)
        _registered = True
