"""TorchScript modules on remote_accelerator: `torch.jit.load(f, map_location="remote_accelerator")`
and `script_module.to("remote_accelerator")`; torch.jit.trace of remote models refused, saying what works.

A ScriptModule runs its ops through the TorchScript interpreter, which dispatches them like any
others, so remote parameters work in it (captured op by op). Getting them there did not:
- torch.jit.load's C++ loader copies each storage to the device and then points a fresh tensor
  at the copy's storage without dispatching: a remote tensor's storage holds no data, so every
  parameter silently became a handle on an empty tensor with the metadata of another (a
  Linear's bias reported the weight's shape; reads gave empty tensors). The load now happens on
  the CPU and the module's tensors are then moved.
- `.to(device)` on a ScriptModule failed ("_apply(): Couldn't swap Linear.weight"): nn.Module
  swaps parameters in place for tensor subclasses, and a ScriptModule's C++ slots hold a second
  reference to each, which torch.utils.swap_tensors refuses. Script modules take new Parameter
  objects instead, as nn.Module does when the two tensor types are not interchangeable (for CPU
  and CUDA, which are, `param.data = new` as before).
- torch.jit.save writes each tensor's whole storage, which its C++ writer reads through a fresh
  tensor pointed at that storage (`set_(storage)`), then copied to the CPU. A storage object
  names no remote tensor, so the module's remote tensors' storages are registered first
  (lazy_tensor.storage_owner) and that `set_` becomes a view of the tensor's storage on the daemon.
"""
from __future__ import annotations

import functools

import torch

from genie.runtime.device_type import DEVICE_TYPE

from .lazy_tensor import LazyTensor, register_storage, tensors_in


_installed = False


def _is_remote(location) -> bool:
    if isinstance(location, str):
        return location.split(":")[0] == DEVICE_TYPE
    return isinstance(location, torch.device) and location.type == DEVICE_TYPE


def _load(original):
    @functools.wraps(original)
    def load(f, map_location=None, _extra_files=None, _restore_shapes=False):
        if _is_remote(map_location):
            return original(f, "cpu", _extra_files, _restore_shapes).to(map_location)
        start = f.tell() if hasattr(f, "seek") else None
        module = original(f, map_location, _extra_files, _restore_shapes)
        # Saved from remote tensors (no map_location): the loader placed them as described above.
        placed = {name: t.device for name, t in _named_tensors(module) if type(t) is LazyTensor}
        if not placed or not isinstance(module, torch.jit.ScriptModule):
            return module
        if start is not None:
            f.seek(start)
        module = original(f, "cpu", _extra_files, _restore_shapes)
        for name, device in placed.items():
            _move(module, name, device)
        return module

    return load


def _named_tensors(module):
    if not isinstance(module, torch.nn.Module):  # a ScriptFunction holds none
        return []
    return [*module.named_parameters(), *module.named_buffers()]


def _move(module, name: str, device) -> None:
    *path, leaf = name.split(".")
    owner = module
    for part in path:  # ScriptModules have no get_submodule
        owner = getattr(owner, part)
    if leaf in owner._parameters:
        param = owner._parameters[leaf]
        owner._parameters[leaf] = torch.nn.Parameter(param.to(device), param.requires_grad)
    else:
        owner._buffers[leaf] = owner._buffers[leaf].to(device)


def _save(original):
    @functools.wraps(original)
    def save(m, f, _extra_files=None):
        for t in (*m.parameters(), *m.buffers()):
            if type(t) is LazyTensor:
                register_storage(t)
        return original(m, f, _extra_files)

    return save


def _script_module_apply(self, fn, recurse=True):
    """nn.Module._apply without its tensor swap, which a ScriptModule's slots refuse."""
    if recurse:
        for module in self.children():
            module._apply(fn)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    for key, param in self._parameters.items():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        if torch._has_compatible_shallow_copy_type(param, applied) and not overwrite:
            param.data = applied
            out = param
        else:
            out = torch.nn.Parameter(applied, param.requires_grad)
            self._parameters[key] = out
        if param.grad is not None:
            with torch.no_grad():
                grad = fn(param.grad)
            if out is param and torch._has_compatible_shallow_copy_type(param.grad, grad) and not overwrite:
                param.grad.data = grad
            else:
                out.grad = grad.requires_grad_(param.grad.requires_grad)
    for key, buffer in self._buffers.items():
        if buffer is not None:
            self._buffers[key] = fn(buffer)
    return self


_TRACE_REFUSED = (
    "torch.jit.trace cannot record a model or inputs on remote_accelerator: while it records, PyTorch "
    "hands Python the sizes of tensors as traced tensors, and Genie plans each op from those sizes. "
    "Trace on the CPU (or on meta tensors) and move the traced module: traced.to('remote_accelerator') "
    "(torch.jit.script works on the device as it is)")


def _holds_remote(value) -> bool:
    """Whether `value` (modules, tensors, and lists, tuples and dicts of them) holds a remote tensor."""
    return any(t.device.type == DEVICE_TYPE for t in tensors_in(value))


def _refuse_remote_trace(original):
    """torch.jit.trace / trace_module refuse remote models and inputs at the call, saying what works
    (before, ops whose planning reads sizes failed partway: 'cond must be a bool, but got a Tensor')."""
    @functools.wraps(original)
    def trace(*args, **kwargs):
        if _holds_remote((args, kwargs)):
            raise RuntimeError(_TRACE_REFUSED)
        return original(*args, **kwargs)

    trace._genie_wraps = original
    return trace


def install() -> None:
    global _installed
    if _installed:
        return
    torch.jit.load = _load(torch.jit.load)
    torch.jit.save = _save(torch.jit.save)
    torch.jit.trace = _refuse_remote_trace(torch.jit.trace)
    torch.jit.trace_module = _refuse_remote_trace(torch.jit.trace_module)
    torch.jit.ScriptModule._apply = _script_module_apply  # scripted, traced and loaded modules alike
    _installed = True
