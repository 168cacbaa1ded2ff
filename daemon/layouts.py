"""Results whose memory layout PyTorch leaves to the backend, made to follow one rule.

A client plans every output's strides before the op runs (genie/frontend/meta.py) and takes
views of it by those strides, so a daemon's result must have them. For a few ops PyTorch's
kernels disagree with its meta kernels, and with each other, about the result's layout:
convolution's meta kernel says contiguous while the CPU kernels and cuDNN return channels-last
when the input or the weight is channels-last (measured: a channels-last conv2d's result on a
CPU daemon was channels-last, the client planned contiguous, and `y.reshape(-1)` then failed on
the daemon); reflection and replication padding follow the input's layout on the CPU and are
contiguous on CUDA. For these, both sides use the rule below: the input's suggested memory
format (for convolution, channels-last when the input or the weight suggests it, as cuDNN and
the CPU kernels decide). The client plans it and the daemon makes its result follow it, a copy
only where a kernel chose otherwise.
"""
from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def convolution_format(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:  # noqa: A002
    channels_last = _CHANNELS_LAST.get(input.dim())
    if channels_last is not None and channels_last in (suggest_memory_format(input), suggest_memory_format(weight)):
        return channels_last
    return torch.contiguous_format


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
        return op(input, *args, **kwargs).contiguous(memory_format=suggest_memory_format(input))
    return run


_aten = torch.ops.aten
_RULES = {
    "aten::convolution": (_aten.convolution.default, _convolution),
    "aten::convolution_backward": (_aten.convolution_backward.default, _convolution_backward),
    **{f"aten::{name}": (getattr(_aten, name).default, _padding)
       for name in ("reflection_pad2d", "reflection_pad3d", "replication_pad2d", "replication_pad3d")},
}
_KERNELS = {name: wrap(op) for name, (op, wrap) in _RULES.items()}


def replacement(name: str):
    """The kernel that runs op `name` with the agreed result layout; None for ops that need none."""
    return _KERNELS.get(name)
