"""Ops a CPU daemon runs for dtypes CUDA's kernels take and the CPU's refuse.

Programs choose their code path by device type, and remote_accelerator is not "cpu": they take
the path they take on a GPU. Hugging Face's mixture-of-experts layers (Mixtral, Qwen-MoE, ...)
count tokens per expert with torch.histc of int32 expert ids on any device but the CPU and MPS,
whose histc has no integer kernel; a CPU daemon then failed ('"histogram_cpu" not implemented
for 'Int''). Here such an op runs on a CPU daemon in a floating dtype the CPU kernel takes,
exact for the values involved, and returns what CUDA's kernel returns (its dtype, its values).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def histc(input, bins=100, min=0, max=0):  # noqa: A002 - the op's own argument names
    if input.device.type != "cpu" or input.is_floating_point():
        return aten.histc.default(input, bins, min, max)
    # CUDA's integer histc: the bin of x is (x - min) * bins // (max - min), counts in the input's
    # dtype; float64 holds every int32 exactly, and its bins are the same.
    return aten.histc.default(input.double(), bins, min, max).to(input.dtype)


REPLACED = {"aten::histc": histc}


def replacement(name: str):
    return REPLACED.get(name)
