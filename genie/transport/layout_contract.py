"""The layout a daemon gives results whose layout PyTorch leaves to the backend.

A client plans every output's strides before the op runs and takes views of it by them, so
both ends must agree. For convolution PyTorch's meta kernel says contiguous while the CPU
kernels and cuDNN return channels-last when the input or the weight is channels-last, and
reflection/replication padding follows the input's layout on the CPU but not on CUDA. For these
ops both ends use the rule here: the client plans it (genie/frontend/meta.py) and the daemon
makes its result follow it (daemon/layouts.py, with the measurements).
"""
from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
# aten ops (default overloads) whose result takes its input's suggested memory format.
PADDING_OPS = ("reflection_pad2d", "reflection_pad3d", "replication_pad2d", "replication_pad3d")


def convolution_format(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:  # noqa: A002
    """Channels-last (3-D for 5-D tensors) when the input or the weight suggests it, as cuDNN and
    the CPU kernels choose; else contiguous. Also the format of convolution_backward's gradients."""
    channels_last = CHANNELS_LAST.get(input.dim())
    if channels_last is not None and channels_last in (suggest_memory_format(input), suggest_memory_format(weight)):
        return channels_last
    return torch.contiguous_format


def padding_format(input: torch.Tensor) -> torch.memory_format:  # noqa: A002
    return suggest_memory_format(input)
