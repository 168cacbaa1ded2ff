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


def _rebuild(values: torch.Tensor, device: str, requires_grad: bool, is_parameter: bool,
             cls: type | None = None, state: dict | None = None) -> torch.Tensor:
    """`cls`: the program's own tensor class (frontend/subclasses.py), with the attributes in `state`."""
    tensor = values.to(device)
    if cls is not None and not issubclass(cls, torch.nn.Parameter):
        tensor = tensor.as_subclass(cls)
    if is_parameter:
        tensor = torch.nn.Parameter(tensor, requires_grad)
        if cls is not None and type(tensor) is LazyTensor:  # a subclass of nn.Parameter's
            from .subclasses import become, remote_twin

            become(tensor, remote_twin(cls))
    else:
        tensor.requires_grad_(requires_grad)
    if state:
        tensor.__dict__.update(state)
    return tensor


def _reduce(t: LazyTensor):
    from .serialization import cpu_for_saving

    if t.requires_grad and not t.is_leaf:  # torch.multiprocessing's own refusal, in its words
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not "
            "support crossing process boundaries.  If you just want to transfer the data, call detach() "
            "on the tensor before serializing (e.g., putting it on the queue).")
    values = cpu_for_saving(t).detach()
    from .subclasses import program_class

    cls = program_class(t)
    return _rebuild, (values, str(t.device), t.requires_grad, bool(getattr(t, "_is_param", False)),
                      cls, t._user_attributes() if cls is not None else None)


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


def register_class(twin: type) -> None:
    """ForkingPickler looks reducers up by exact class: each remote twin of a program's class
    (frontend/subclasses.py) needs its own, or it pickled as for torch.save (arriving on the CPU).
    So does default_collate, whose lookup by exact class comes before torch.Tensor's rule (which
    failed in DataLoader workers, as for plain remote tensors before `_collate`)."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    ForkingPickler.register(twin, _reduce)
    default_collate_fn_map.setdefault(twin, _collate)
