"""`model.to(...)`, `model.cpu()`, `model.half()` keep a module's Parameter objects, as for CUDA.

For CPU and CUDA tensors nn.Module._apply changes each parameter in place (`param.data = new`).
A remote tensor is another tensor type, so for it _apply either swaps the Python objects'
contents (torch.utils.swap_tensors, chosen for tensor subclasses) or makes new Parameters. Two
cases went wrong:
- `model.cpu()` of a remote model: a CPU result is no subclass, so each module got a new
  Parameter. Tied weights came apart (an embedding and its tied output layer then trained as
  two CPU copies) and an optimizer made before the move held parameters the model no longer had.
- `model.to("remote_accelerator")` while an autograd graph of an earlier forward is alive (a
  notebook's `loss` from a CPU run): swap_tensors refuses a tensor another holder references,
  so `.to()` failed with "_apply(): Couldn't swap Linear.weight".

Now a module that holds remote parameters converts them by swapping (PyTorch's own swap mode,
torch.__future__, turned on for this thread while that module converts), and a swap that
involves a remote tensor goes ahead when the only objection is such a reference. The holder
keeps the old tensor and values. If the holder is an autograd graph, its backward would put
gradients on the old tensor, so that tensor's gradient accumulator raises instead, as
swap_tensors arranges when the graph's accumulator is the only holder. On CUDA the same
backward fails too (a CPU gradient for a CUDA parameter).
"""
from __future__ import annotations

import copyreg
import functools
import threading
import weakref

import torch

from .lazy_tensor import LazyTensor

_state = threading.local()  # .swap: this thread is converting a module that holds remote parameters
_installed = False

_STALE_GRAPH = (
    "this autograd graph was built before its parameter moved to another device or dtype "
    "(module.to / .cpu / .half on remote_accelerator): run the forward again after moving the model")


def _holds_remote(module: torch.nn.Module) -> bool:
    return any(isinstance(p, LazyTensor) for p in module._parameters.values())


def _wrap_apply(original):
    @functools.wraps(original)
    def _apply(self, fn, recurse=True):
        before = getattr(_state, "swap", False)
        # Children set and restore their own mode; the module's own parameters convert after them.
        _state.swap = _holds_remote(self)
        try:
            return original(self, fn, recurse)
        finally:
            _state.swap = before

    _apply._genie_wraps = original
    return _apply


def _wrap_swap_mode(original):
    @functools.wraps(original)
    def get_swap_module_params_on_conversion():
        return getattr(_state, "swap", False) or original()

    get_swap_module_params_on_conversion._genie_wraps = original
    return get_swap_module_params_on_conversion


def _poison_accumulator(t: torch.Tensor) -> None:
    if t.requires_grad and t.is_leaf:
        def refuse(grad_outputs):
            raise RuntimeError(_STALE_GRAPH)

        torch.autograd.graph.get_gradient_edge(t).node.register_prehook(refuse)


def _swap_held(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """torch.utils.swap_tensors without its objection to other references to t1's tensor: they
    keep the old tensor (and t1's old gradient accumulator refuses to run)."""
    _poison_accumulator(t1)
    for name in ("__class__", "__dict__"):
        tmp = getattr(t1, name)
        setattr(t1, name, getattr(t2, name))
        setattr(t2, name, tmp)
    for slot in copyreg._slotnames(t1.__class__):  # both classes' slots are equal (checked first)
        has1, has2 = hasattr(t1, slot), hasattr(t2, slot)
        v1, v2 = getattr(t1, slot, None), getattr(t2, slot, None)
        if has2:
            setattr(t1, slot, v2)
        elif has1:
            delattr(t1, slot)
        if has1:
            setattr(t2, slot, v1)
        elif has2:
            delattr(t2, slot)
    torch._C._swap_tensor_impl(t1, t2)


def _wrap_swap(original):
    @functools.wraps(original)
    def swap_tensors(t1, t2):
        try:
            return original(t1, t2)
        except RuntimeError as e:
            # Checked before anything is swapped: the other reasons (weak references, slots) stand.
            if not (str(e).startswith("Expected use_count of t1")
                    and (isinstance(t1, LazyTensor) or isinstance(t2, LazyTensor))
                    and not weakref.getweakrefs(t1) and not weakref.getweakrefs(t2)
                    and set(copyreg._slotnames(t1.__class__)) == set(copyreg._slotnames(t2.__class__))):
                raise
        _swap_held(t1, t2)

    swap_tensors._genie_wraps = original
    return swap_tensors


def install() -> None:
    global _installed
    if _installed:
        return
    torch.nn.Module._apply = _wrap_apply(torch.nn.Module._apply)
    torch.__future__.get_swap_module_params_on_conversion = _wrap_swap_mode(
        torch.__future__.get_swap_module_params_on_conversion)
    torch.utils.swap_tensors = _wrap_swap(torch.utils.swap_tensors)
    _installed = True
