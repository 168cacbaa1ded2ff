"""CPU kernels for the batch-norm ops nn.SyncBatchNorm calls, which torch has for CUDA only.

nn.SyncBatchNorm accepts inputs on CUDA and PrivateUse1 devices (Genie's remote_accelerator).
Training over several processes, its forward computes each process's per-channel statistics
(aten::batch_norm_stats), all-gathers them, combines them (batch_norm_gather_stats_with_counts,
which also updates the running statistics) and normalises (batch_norm_elemt); its backward
reduces (batch_norm_backward_reduce), all-reduces and applies (batch_norm_backward_elemt).
torch has those ops for CUDA only, so a CPU daemon registers them here, in aten ops, with the
CUDA kernels' contract: statistics in the accumulation type (float32 for half types), combined
as CUDA combines them, results of the input's dtype laid out as its suggested memory format,
undefined outputs where the flags ask for none.
"""
from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from . import cpu_kernels


def register() -> None:
    """Give the ops a CPU kernel where torch has none (once per process)."""
    cpu_kernels.register_where_missing(__name__, {
        "batch_norm_stats": stats,
        "batch_norm_gather_stats": gather_stats,
        "batch_norm_gather_stats_with_counts": gather_stats_with_counts,
        "batch_norm_elemt": elemt,
        "batch_norm_backward_reduce": backward_reduce,
        "batch_norm_backward_elemt": backward_elemt,
    })


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduced_dims(t: torch.Tensor) -> list[int]:
    return [d for d in range(t.dim()) if d != 1]


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (C,) vector shaped to broadcast over `like`'s channel dimension (dim 1)."""
    return v.reshape([1, -1] + [1] * (like.dim() - 2))


def _inverse_std(var: torch.Tensor, eps: float) -> torch.Tensor:
    # CUDA's InvStd: 0 where variance and eps are both 0, not inf.
    return torch.where(var + eps == 0, torch.zeros_like(var), (var + eps).rsqrt())


def _in_suggested_format(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`values` of `like`'s dtype, laid out as CUDA's kernels lay it out: empty_like(like,
    like.suggest_memory_format()) (C++ only; torch._prims_common has the same rule)."""
    out = torch.empty_like(like, memory_format=suggest_memory_format(like))
    return out.copy_(values)


def stats(input: torch.Tensor, eps: float):
    """(mean, invstd) per channel, biased variance, in the accumulation type."""
    var, mean = torch.var_mean(input.to(_accumulation(input.dtype)), dim=_reduced_dims(input), correction=0)
    return mean, _inverse_std(var, eps)


def gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum: float, eps: float, counts):
    """Combine (W, C) per-process means and inverse stds of `counts` elements each into the global
    (mean, invstd); update the running statistics (running_var with the unbiased variance)."""
    counts = counts.to(mean.dtype).unsqueeze(1)
    total = counts.sum()
    global_mean = (counts * mean).sum(0) / total
    local_var = invstd.reciprocal().square() - eps
    var_sum = (counts * (local_var + (mean - global_mean).square())).sum(0)
    if running_mean is not None:
        running_mean.copy_(running_mean * (1 - momentum) + global_mean * momentum)
    if running_var is not None:
        running_var.copy_(running_var * (1 - momentum) + var_sum / (total - 1) * momentum)
    return global_mean, _inverse_std(var_sum / total, eps).to(invstd.dtype)


def gather_stats(input, mean, invstd, running_mean, running_var, momentum: float, eps: float, count: int):
    counts = torch.full((mean.shape[0],), count, dtype=mean.dtype)
    return gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts)


def elemt(input, weight, bias, mean, invstd, eps: float):
    """(input - mean) * invstd * weight + bias per channel."""
    x = input.to(_accumulation(input.dtype))
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight, x)
    if bias is not None:
        out = out + _per_channel(bias, x)
    return _in_suggested_format(out, input)


def backward_reduce(grad_out, input, mean, invstd, weight, input_g: bool, weight_g: bool, bias_g: bool):
    """(sum of grad_out, sum of grad_out * (input - mean), grad_weight, grad_bias) per channel,
    each only where its flag asks (the first two for input_g)."""
    acc = _accumulation(input.dtype)
    dims = _reduced_dims(input)
    dy = grad_out.to(acc)
    sum_dy = dy.sum(dims).to(mean.dtype)
    sum_dy_xmu = (dy * (input.to(acc) - _per_channel(mean, input))).sum(dims).to(mean.dtype)
    param_dtype = weight.dtype if weight is not None else mean.dtype
    return (sum_dy if input_g else None, sum_dy_xmu if input_g else None,
            (sum_dy_xmu * invstd).to(param_dtype) if weight_g else None,
            sum_dy.to(param_dtype) if bias_g else None)


def backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """The input's gradient from the globally reduced sums; `count`: every process's element count."""
    acc = _accumulation(input.dtype)
    total = count.to(acc).sum()
    x, dy = input.to(acc), grad_out.to(acc)
    scale = invstd * weight if weight is not None else invstd
    grad = (dy - _per_channel(sum_dy / total, x)
            - (x - _per_channel(mean, x)) * _per_channel(invstd.square() * sum_dy_xmu / total, x)) * _per_channel(scale, x)
    return _in_suggested_format(grad, input)
