"""The layout a daemon gives results whose layout PyTorch leaves to the backend.

A client plans every output's strides before the op runs and takes views of it by them, so
both ends must agree. For convolution PyTorch's meta kernel says contiguous while the CPU
kernels and cuDNN return channels-last when the input or the weight is channels-last, and
reflection/replication padding follows the input's layout on the CPU but not on CUDA. For these
ops both ends use the rule here: the client plans it (genie/frontend/meta.py) and the daemon
makes its result follow it (daemon/layouts.py, with the measurements). torch._grouped_mm (the
grouped GEMM of mixture-of-experts layers) pads its result's rows to 16 bytes in its C++ kernels
(CPU and CUDA) but not in the meta kernel of a CPU-only PyTorch: both ends use the kernels' rule.
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


def grouped_mm_result(mat_a: torch.Tensor, mat_b: torch.Tensor, offs, out_dtype: torch.dtype):
    """The size and strides of torch._grouped_mm(mat_a, mat_b, offs)'s result as its kernels make
    it (at::native create_grouped_gemm_output_tensor): the last dimension's stride padded to a
    multiple of 16 bytes. None when the operands' ranks or sizes do not fit together."""
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3) or (offs is None) != (not (a_2d or b_2d)):
        return None
    if a_2d and b_2d:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a_2d:
        size = [mat_a.shape[0], mat_b.shape[-1]] if offs.shape[0] == mat_b.shape[0] else None
    elif b_2d:
        size = [mat_a.shape[1], mat_b.shape[1]] if offs.shape[0] == mat_a.shape[0] else None
    else:
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]] if mat_a.shape[0] == mat_b.shape[0] else None
    if size is None:
        return None
    alignment = 16 // out_dtype.itemsize
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [padded, 1] if a_2d != b_2d else [size[1] * padded, padded, 1]
    return tuple(size), tuple(stride)
