"""PrivateUse1 kernels: how tensors come into being on `remote_accelerator`.

Factory calls with `device="remote_accelerator"` reach these kernels (there is
no tensor yet for __torch_dispatch__ to see): `empty` creates a LazyTensor and
queues the allocation; composite factories (randn = empty + normal_, zeros =
empty + zero_, arange, eye, ...) then continue on the LazyTensor and are
captured. `_copy_from` is how `torch.tensor(data, device=...)` uploads.
"""
from __future__ import annotations

import functools
import math

import torch

from genie.errors import UnsupportedOperationError
from genie.runtime import get_runtime
from genie.transport import protocol

from . import capture, whole_ops
from .lazy_tensor import LazyTensor

_lib: torch.library.Library | None = None
_nested_lib: torch.library.Library | None = None

STRIDED_NESTED = ("strided nested tensors (torch.nested's default layout, a C++ tensor type) have no "
                  "remote counterpart: use layout=torch.jagged, whose values and offsets are ordinary tensors")


def _stream_for(device) -> object:
    index = None
    if device is not None:
        index = device.index if type(device) is torch.device else torch.device(device).index
    return get_runtime().stream(index)


def _new_empty(op: str, size, stride, dtype, device, memory_format=None):
    dtype = dtype or torch.get_default_dtype()
    stream = _stream_for(device)
    shape = tuple(size)
    dense = memory_format in (None, torch.contiguous_format) and all(type(s) is int and s >= 0 for s in shape)
    strides = capture.contiguous_strides(shape) if dense else None
    if dense and (stride is None or tuple(stride) == strides):
        # The common case (empty, and the empty_strided of a contiguous tensor's .to()), worked
        # out here: a meta tensor (which checks the rest) costs more.
        nbytes = math.prod(shape) * dtype.itemsize
    else:
        if stride is None:
            probe = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format or torch.contiguous_format)
        else:
            probe = torch.empty_strided(size, stride, dtype=dtype, device="meta")
        shape, strides, nbytes = probe.shape, probe.stride(), probe.untyped_storage().nbytes()
    with stream.lock:
        handle = stream.new_handle()
        t = LazyTensor(stream, handle, shape, strides, 0, dtype, nbytes)
        if dense:  # plain ints and known constants: their wire form directly (a .to() upload replaces
            # this op with an adopt right after, see transfers._try_adopt)
            wire_kwargs = {"dtype": protocol.encode_dtype(dtype),
                           "device": protocol.encode_device("remote", stream.local_index)}
            if stride is None:
                wire_kwargs["memory_format"] = protocol.encode_memory_format(
                    memory_format or torch.contiguous_format)
                wire_args = [list(shape)]
            else:
                wire_args = [list(shape), list(strides)]
            stream.append([op, wire_args, wire_kwargs, handle])
            return t
        kwargs = {"dtype": dtype, "device": stream.device}
        if stride is None:
            kwargs["memory_format"] = memory_format or torch.contiguous_format
            args = [list(size)]
        else:
            args = [list(size), list(stride)]
        stream.append([op, *capture.encode_call(args, kwargs, stream), handle])
    return t


_ARANGE = torch.ops.aten.arange.start_step


def _one_op(name: str, wire_args: list, shape: tuple, dtype: torch.dtype, device) -> LazyTensor:
    """A dense new tensor made by one op `name(*wire_args, dtype=, device=)` on the daemon, its
    metadata worked out by the caller (arange, zeros, ones, full)."""
    stream = _stream_for(device)
    with stream.lock:
        handle = stream.new_handle()
        t = LazyTensor(stream, handle, shape, capture.contiguous_strides(shape), 0, dtype,
                       math.prod(shape) * dtype.itemsize)
        stream.append([name, wire_args, {"dtype": protocol.encode_dtype(dtype),
                                         "device": protocol.encode_device("remote", stream.local_index)}, handle])
    return t


def arange_start_step(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """torch.arange(..., device=) with Python int bounds (positions, masks: in many models' every
    forward) as one op, its length worked out here exactly as torch does for integers, rather than
    torch's composite form: an empty, then arange.out resizing it (three captures, ~90 µs). Other
    bounds (floats, tensors), other dtypes and inconsistent steps take that form."""
    if (type(start) is not int or type(end) is not int or type(step) is not int or step == 0
            or (end - start) * step < 0 or (dtype is not None and (dtype == torch.bool or dtype.is_complex))
            or layout not in (None, torch.strided)):
        return _ARANGE.redispatch(capture.ANY_DEVICE_KEYS, start, end, step, dtype=dtype, layout=layout,
                                  device=device, pin_memory=pin_memory)
    dtype = dtype or torch.int64
    return _one_op("aten::arange.start_step", [start, end, step], (-((start - end) // step),), dtype, device)


def _dense_factory(name: str, op, fill: bool):
    """A PrivateUse1 kernel for zeros / ones / full: one op with its dense result planned here,
    rather than torch's composite form (an empty, then zero_ or fill_: two captures; zeros 36 ->
    ~18 µs, full 65 -> ~20). Symbolic sizes, layouts other than strided, complex fill values and
    dtypes this cannot infer as torch does take the composite form."""

    def kernel(size, *fill_value, dtype=None, layout=None, device=None, pin_memory=None):
        value = fill_value[0] if fill else None
        shape = tuple(size)
        if dtype is None and fill:
            dtype = {bool: torch.bool, int: torch.int64, float: torch.get_default_dtype()}.get(type(value))
        elif dtype is None:
            dtype = torch.get_default_dtype()
        if (dtype is None or layout not in (None, torch.strided)
                or not all(type(n) is int and n >= 0 for n in shape)
                or (fill and (type(value) not in (bool, int, float)
                              or type(value) is int and not -(1 << 63) <= value < (1 << 63)))):
            return op.redispatch(capture.ANY_DEVICE_KEYS, size, *fill_value, dtype=dtype, layout=layout,
                                 device=device, pin_memory=pin_memory)
        return _one_op(name, [list(shape), value] if fill else [list(shape)], shape, dtype, device)

    return kernel


def efficient_zero_tensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    """torch._efficientzerotensor (forward-mode AD's zero tangents: torch.func.hessian, jacfwd).
    CUDA makes a tensor without memory that reads as zeros; a remote tensor names memory the
    daemon holds, so this is a zeros tensor there: the same values, at one allocation."""
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _new_empty("aten::empty.memory_format", size, None, dtype, device, memory_format)


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _new_empty("aten::empty_strided", size, stride, dtype, device)


def copy_from(self, dst, non_blocking=False):
    if type(dst) is LazyTensor:
        return capture.dispatch(torch.ops.aten.copy_.default, (dst, self), {})
    from .materialize import to_cpu

    return dst.copy_(to_cpu(self))


def copy_from_and_resize(self, dst):
    if tuple(dst.shape) != tuple(self.shape):
        torch.ops.aten.resize_.default(dst, self.shape)
    return copy_from(self, dst)


def local_scalar_dense(self):
    from .materialize import to_cpu

    return to_cpu(self).item()


def _made_on_host(op):
    """A kernel for a factory that torch implements per backend with no composite form
    (tril_indices, triu_indices) or whose composite form ends in a CPU/CUDA-only kernel
    (kaiser_window): its values depend only on its arguments, so the CPU makes them and they are
    uploaded (a few bytes per element, as torch.tensor(..., device=) sends its data)."""

    def kernel(*args, **kwargs):
        device = kwargs.pop("device", None)
        kwargs.pop("pin_memory", None)
        return op(*args, **kwargs, device="cpu").to(device)

    return kernel


def register() -> None:
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", copy_from_and_resize, "PrivateUse1")
    lib.impl("_local_scalar_dense", local_scalar_dense, "PrivateUse1")
    lib.impl("_efficientzerotensor", efficient_zero_tensor, "PrivateUse1")
    lib.impl("arange.start_step", arange_start_step, "PrivateUse1")
    lib.impl("arange.start", arange_start_step, "PrivateUse1")
    lib.impl("arange", functools.partial(arange_start_step, 0), "PrivateUse1")
    for name, fill in (("zeros", False), ("ones", False), ("full", True)):
        lib.impl(name, _dense_factory(f"aten::{name}", getattr(torch.ops.aten, name).default, fill), "PrivateUse1")
    for name in ("tril_indices", "triu_indices", "kaiser_window", "kaiser_window.periodic", "kaiser_window.beta"):
        packet, _, overload = name.partition(".")
        lib.impl(name, _made_on_host(getattr(getattr(torch.ops.aten, packet), overload or "default")), "PrivateUse1")
    whole_ops.register(lib)
    _lib = lib
    global _nested_lib
    _nested_lib = torch.library.Library("_", "IMPL")
    _nested_lib.fallback(_refuse_strided_nested, "NestedTensorPrivateUse1")
    _nested_lib.fallback(_refuse_quantized, "QuantizedPrivateUse1")


def _refuse_quantized(op, *args, **kwargs):
    """Every op that reaches a quantized tensor on the device: `q.to(device)` of a quantized CPU
    tensor makes one with aten::empty_quantized (before, PyTorch's "Could not run
    'aten::empty_quantized' with arguments from the 'Quantizedremote_accelerator' backend")."""
    raise UnsupportedOperationError(capture.op_name(op), capture.QUANTIZED)


def _refuse_strided_nested(op, *args, **kwargs):
    """Every op that reaches a strided nested tensor on the device (`nt.to(device)` included)."""
    raise UnsupportedOperationError(capture.op_name(op), STRIDED_NESTED)
