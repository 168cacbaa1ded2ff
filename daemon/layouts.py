"""Results whose memory layout PyTorch leaves to the backend, made to follow one rule.

A client plans every output's strides before the op runs (genie/frontend/meta.py) and takes
views of it by those strides, so a daemon's result must have them. For a few ops PyTorch's
kernels disagree with its meta kernels, and with each other, about the result's layout:
convolution's meta kernel says contiguous while the CPU kernels and cuDNN return channels-last
when the input or the weight is channels-last (measured: a channels-last conv2d's result on a
CPU daemon was channels-last, the client planned contiguous, and `y.reshape(-1)` then failed on
the daemon); reflection and replication padding follow the input's layout on the CPU and are
contiguous on CUDA. For these, both sides use the rule in genie/transport/layout_contract.py:
the input's suggested memory format (for convolution, channels-last when the input or the
weight suggests it, as cuDNN and the CPU kernels decide). The client plans it and the daemon
makes its result follow it, a copy only where a kernel chose otherwise.

Other ops are planned by their meta kernels, and for some of those the CPU kernels lay results
out otherwise: found by comparing every aten op's CPU and meta results over PyTorch's OpInfo
samples, as given, channels-last and with reversed memory order (bench/opinfo_sweep.py
--layout checks the daemon end to end). For these the daemon runs the meta kernel too and
copies its result into the meta layout where they differ: always for the ops that differ on
ordinary inputs (fft, SVD, eig, max_unpool2d, nonzero_static), and only for inputs that are not
row-major for the ops that differ on such inputs alone (some binary ops, batch norm, ...).
"""
from __future__ import annotations

import torch

from genie.transport.layout_contract import PADDING_OPS, convolution_format, grouped_mm_result, padding_format


def _convolution(op):
    def run(input, weight, *args, **kwargs):  # noqa: A002
        return op(input, weight, *args, **kwargs).contiguous(memory_format=convolution_format(input, weight))
    return run


def _convolution_backward(op):
    def run(grad_output, input, weight, *args, **kwargs):  # noqa: A002
        grad_input, grad_weight, grad_bias = op(grad_output, input, weight, *args, **kwargs)
        fmt = convolution_format(input, weight)
        return (None if grad_input is None else grad_input.contiguous(memory_format=fmt),
                None if grad_weight is None else grad_weight.contiguous(memory_format=fmt), grad_bias)
    return run


def _padding(op):
    def run(input, *args, **kwargs):  # noqa: A002
        return op(input, *args, **kwargs).contiguous(memory_format=padding_format(input))
    return run


def _meta_like(value):
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta_like(v) for v in value)
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def _into(result, planned):
    """`result` laid out as `planned` (its meta twin) says: itself where the strides agree."""
    if isinstance(result, torch.Tensor):
        if (not isinstance(planned, torch.Tensor) or result.shape != planned.shape
                or result.stride() == planned.stride()):
            return result
        laid_out = torch.empty_strided(planned.shape, planned.stride(), dtype=result.dtype, device=result.device)
        return laid_out.copy_(result)
    if isinstance(result, (list, tuple)) and isinstance(planned, (list, tuple)) and len(result) == len(planned):
        return type(result)(_into(r, p) for r, p in zip(result, planned))
    return result


def _signature(value):
    """What the meta kernel's result layout depends on: tensors' metadata and the other arguments."""
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape), value.stride()
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return value


_PLANNED_MAX = 1024
_planned: dict = {}  # (op, signature) -> the meta kernel's result: a repeated call skips it (fft 115 -> ~5 us)


def _following_meta(op, always: bool):
    def run(*args, **kwargs):
        result = op(*args, **kwargs)
        if not always and all(t.is_contiguous() for t in args if isinstance(t, torch.Tensor)):
            return result  # row-major inputs: the kernels agree (see the module notes)
        try:
            key = (op, _signature(args), _signature(tuple(sorted(kwargs.items()))))
            planned = _planned.get(key)
        except TypeError:  # an unhashable argument
            key = planned = None
        if planned is None:
            try:
                planned = op(*_meta_like(args), **_meta_like(kwargs))
            except Exception:  # noqa: BLE001 - no meta kernel for these arguments: the client ran it remotely
                return result
            if key is not None:
                if len(_planned) >= _PLANNED_MAX:
                    _planned.clear()
                _planned[key] = planned
        return _into(result, planned)
    return run


_aten = torch.ops.aten
# Ops whose CPU results are laid out otherwise than their meta kernels say: on ordinary inputs, and
# on inputs that are not row-major only.
_META_ALWAYS = ("_fft_c2r", "_fft_r2c", "_linalg_svd", "linalg_eig", "max_unpool2d", "nonzero_static")
_META_FOR_UNUSUAL_INPUTS = (
    "_batch_norm_with_update", "native_batch_norm", "channel_shuffle", "pixel_shuffle", "copysign.Tensor",
    "div.Tensor_mode", "floor_divide", "heaviside", "ldexp.Tensor", "logaddexp", "logical_and", "logical_or",
    "logical_xor", "log_sigmoid_forward", "nll_loss2d_forward",
)


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(_aten, packet), overload or "default")


def _wire_name(name: str) -> str:
    return f"aten::{name}"


def _grouped_mm(op):
    def run(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        out = op(mat_a, mat_b, offs, bias, out_dtype)
        agreed = grouped_mm_result(mat_a, mat_b, offs, out.dtype)
        if agreed is None or tuple(out.stride()) == agreed[1]:
            return out  # the kernels' own layout (CPU, CUDA): the client planned it
        return torch.empty_strided(*agreed, dtype=out.dtype, device=out.device).copy_(out)  # ROCm's unpadded one
    return run


def _group_norm_on_gpu(op, tensor_args: int):
    """torch's composite group_norm hands remote_accelerator the input in its suggested memory
    format, as it does the CPU (channels-last stays channels-last), and the client plans the
    results by that; CUDA's native_group_norm takes contiguous inputs only ("Expected
    X.is_contiguous(memory_format)", met on an H100 with a UNet-like channels-last input). On
    a GPU the first `tensor_args` arguments go contiguous, and the results follow the meta
    kernel's layout, which the client planned. The CPU's kernels take either."""
    def run(*args, **kwargs):
        inputs = args[:tensor_args]
        if all(t.device.type == "cpu" or t.is_contiguous() for t in inputs):
            return op(*args, **kwargs)
        result = op(*(t.contiguous() for t in inputs), *args[tensor_args:], **kwargs)
        return _into(result, op(*_meta_like(args), **_meta_like(kwargs)))
    return run


_RULES = {
    "aten::_grouped_mm": (_aten._grouped_mm.default, _grouped_mm),
    "aten::native_group_norm": (_aten.native_group_norm.default, lambda op: _group_norm_on_gpu(op, 1)),
    "aten::native_group_norm_backward": (_aten.native_group_norm_backward.default,
                                         lambda op: _group_norm_on_gpu(op, 2)),
    "aten::convolution": (_aten.convolution.default, _convolution),
    "aten::convolution_backward": (_aten.convolution_backward.default, _convolution_backward),
    **{f"aten::{name}": (getattr(_aten, name).default, _padding) for name in PADDING_OPS},
}
_KERNELS = {name: wrap(op) for name, (op, wrap) in _RULES.items()}
_KERNELS.update({_wire_name(n): _following_meta(_overload(n), True) for n in _META_ALWAYS})
_KERNELS.update({_wire_name(n): _following_meta(_overload(n), False) for n in _META_FOR_UNUSUAL_INPUTS})


def replacement(name: str):
    """The kernel that runs op `name` with the agreed result layout; None for ops that need none."""
    return _KERNELS.get(name)


def with_planned_strides(result, strides):
    """`result` with the strides the client planned (protocol.OpCall.strides: 4-D and 5-D results
    with a dimension of size 1) where they differ from the kernel's in such dimensions only: a
    view of the same memory (such a stride moves no element). Any other difference is left as
    the kernel made it."""
    if isinstance(result, torch.Tensor):
        if (strides is None or len(strides) != result.dim() or result.stride() == tuple(strides)
                or any(a != b and n != 1 for a, b, n in zip(result.stride(), strides, result.shape))):
            return result
        return result.as_strided(result.shape, strides, result.storage_offset())
    if isinstance(result, (list, tuple)) and isinstance(strides, list) and len(strides) == len(result):
        return [with_planned_strides(r, s) for r, s in zip(result, strides)]
    return result


def planned_strides(kernel, strides):
    """`kernel` giving its results the planned strides (a compiled program's step)."""
    def restrided(*args, **kwargs):
        return with_planned_strides(kernel(*args, **kwargs), strides)

    return restrided
