"""The program's own tensor subclasses on a remote device.

`class Boxes(torch.Tensor)`, with or without a `__torch_function__` (torchvision's tv_tensors,
MONAI's MetaTensor and most "tensor with metadata" classes are such), moves with `.to(device)`
and keeps its class through ops, as on CUDA. A remote tensor's Python object must be a
LazyTensor (its `__torch_dispatch__` captures the ops), so PyTorch's `as_subclass(Boxes)`,
which every op on a Boxes does to its result, refused: the tensor already had a Python object of
another class. Each such class gets a remote twin here, a subclass of it and of LazyTensor
(`isinstance(t, Boxes)` holds, and Boxes' methods and attributes work):

- its `__torch_function__` is Boxes' own, called as Boxes' (so `super()` in it, and the results
  it wraps, are as on any device: a result fetched to the CPU is a CPU Boxes, not a twin);
- its `__torch_dispatch__` hands the op to Genie's capture with the twins shown as plain remote
  tensors for the op's length (capture's fast paths test for the exact class);
- its daemon handle lives outside the object's `__dict__`: such classes copy or replace whole
  `__dict__`s from tensor to tensor (MONAI's copy_meta_from), which would carry handles along.

A subclass with a `__torch_dispatch__` of its own (a wrapper subclass) cannot be a twin: both
would decide what an op does. It is refused, saying so.

For the length of an op a twin's class is LazyTensor: another thread using the same tensor at that
moment would see a plain remote tensor (its class's `__torch_function__` skipped for that op).
"""
from __future__ import annotations

import weakref

import torch

from genie.errors import UnsupportedOperationError
from . import process_sharing
from .lazy_tensor import LazyTensor

_AS_SUBCLASS = torch._C.TensorBase.as_subclass
_TENSOR_DISPATCH = torch.Tensor.__dict__["__torch_dispatch__"]
_twins: dict[type, type] = {}  # the program's class -> its twin (which holds the class: both live on)
# id(twin tensor) -> its HandleRef, dropped with the tensor (by its finalizer, also kept by id). A
# dict keyed by the tensors themselves cannot be used: their == is elementwise.
_handles: dict = {}
_finalizers: dict = {}


def as_subclass(t: LazyTensor, cls: type) -> torch.Tensor:
    """`t.as_subclass(cls)` of a remote tensor: an alias of it (autograd sees a view, as for
    torch's) whose class is `cls`, or `cls`'s twin."""
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
        raise TypeError(f"as_subclass(): cls must be a subclass of torch.Tensor, got {cls!r}")
    if issubclass(LazyTensor, cls):  # torch.Tensor: torch's own alias, still a LazyTensor
        return _AS_SUBCLASS(t, cls)
    target = cls if issubclass(cls, LazyTensor) else remote_twin(cls)
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.ops.aten.alias.default(t)
    become(out, target)
    return out


def become(t: LazyTensor, twin: type) -> None:
    """Make a plain remote tensor, new and not yet seen by the program, of class `twin`."""
    handle = t.__dict__.pop("_genie")
    t.__class__ = twin
    t._genie = handle


def remote_twin(cls: type) -> type:
    """The class a remote tensor of the program's class `cls` has."""
    twin = _twins.get(cls)
    if twin is not None:
        return twin
    if cls.__dict__.get("_genie_user_class") is not None:
        return cls
    if _defined_by(cls, "__torch_dispatch__").__dict__["__torch_dispatch__"] is not _TENSOR_DISPATCH:
        raise UnsupportedOperationError(
            f"a {cls.__qualname__} tensor",
            "a tensor subclass with its own __torch_dispatch__ decides what each op does, as Genie's "
            "remote tensors do; keep it on the CPU, or move the plain tensor it wraps")
    namespace = {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        "_genie_user_class": cls,
        "__torch_dispatch__": classmethod(_twin_dispatch),
        "_genie": property(_handle_of, _set_handle),
    }
    user_function = _defined_by(cls, "__torch_function__").__dict__["__torch_function__"]
    if user_function is torch._C._disabled_torch_function_impl:
        namespace["__torch_function__"] = user_function
    else:
        namespace["__torch_function__"] = classmethod(_twin_function)
    if _defined_by(cls, "__deepcopy__") in (torch.Tensor, torch.nn.Parameter):
        namespace["__deepcopy__"] = LazyTensor.__deepcopy__  # the daemon copies (nn.Parameter's would not be one)
    twin = _twins[cls] = type(cls.__name__, (cls, LazyTensor), namespace)
    process_sharing.register_class(twin)
    return twin


def _defined_by(cls: type, name: str) -> type:
    return next(k for k in cls.__mro__ if name in k.__dict__)


def _twin_function(twin: type, func, types, args=(), kwargs=None):
    user = twin._genie_user_class
    types = tuple(getattr(k, "_genie_user_class", k) for k in types)
    return user.__torch_function__(func, types, args, kwargs)


def _twin_dispatch(twin: type, func, types, args=(), kwargs=None):
    shown = []
    _show_plain((args, kwargs), shown)
    try:
        return LazyTensor.__torch_dispatch__(func, types, args, kwargs)
    finally:
        for t, cls in shown:
            t.__class__ = cls
            if id(t) in _handles:  # else the handle is in __dict__ for a swap (handle_into_dict)
                # The op may have made t name another daemon tensor (set_, .data =).
                _handles[id(t)] = t.__dict__.pop("_genie")


def _show_plain(value, shown: list) -> None:
    if isinstance(value, LazyTensor):
        cls = type(value)
        if cls is not LazyTensor:
            handle = value._genie
            value.__class__ = LazyTensor
            value.__dict__["_genie"] = handle
            shown.append((value, cls))
    elif isinstance(value, (list, tuple)):
        for v in value:
            _show_plain(v, shown)
    elif isinstance(value, dict):
        for v in value.values():
            _show_plain(v, shown)


def program_class(t) -> type | None:
    """The program's own class of a remote tensor whose class is its twin; None for any other tensor."""
    return getattr(type(t), "_genie_user_class", None)


def is_twin(t) -> bool:
    return program_class(t) is not None


def handle_into_dict(t) -> None:
    """For torch.utils.swap_tensors (nn.Module.to() of a parameter of the program's class): the
    handle goes where the swap moves it, the __dict__, and the finalizer's weak reference, which
    the swap refuses, is dropped. `handle_out_of_dict` after the swap puts it back."""
    finalizer = _finalizers.pop(id(t), None)
    if finalizer is not None:
        finalizer.detach()
    t.__dict__["_genie"] = _handles.pop(id(t))


def handle_out_of_dict(t) -> None:
    handle = t.__dict__.pop("_genie", None)
    if handle is not None:
        t._genie = handle


def _handle_of(t):
    handle = _handles.get(id(t))
    if handle is None:
        handle = t.__dict__.get("_genie")  # during a swap (handle_into_dict)
    if handle is None:
        raise AttributeError("_genie")
    return handle


def _set_handle(t, handle) -> None:
    key = id(t)
    if key not in _finalizers:
        _finalizers[key] = weakref.finalize(t, _forget, key)
    _handles[key] = handle


def _forget(key: int) -> None:
    _handles.pop(key, None)
    _finalizers.pop(key, None)
