"""Multi-tensor (foreach) kernels by default for remote tensors, as for CUDA tensors.

PyTorch's optimizers (Adam, AdamW, SGD, ...) and `clip_grad_norm_` / `clip_grad_value_` choose
their `torch._foreach_*` implementation by default only for tensors whose type is in a list
(`torch.Tensor`, `Parameter`); a tensor subclass gets the one-op-per-tensor loop unless it adds
itself, as DTensor does (torch/distributed/tensor/__init__.py). Remote tensors are LazyTensor, so
`AdamW(model.parameters())` took the loop: 11 ops per parameter per step where CUDA runs one
foreach op per step for all of them. The foreach kernels run on the daemon like any aten op
(results equal to the loop's; tests/test_optimizers.py).
"""
from __future__ import annotations

import importlib

from .lazy_tensor import LazyTensor

_LISTS = ("torch.optim.optimizer", "torch.utils._foreach_utils")  # each module's _foreach_supported_types


def install() -> None:
    """Add LazyTensor to PyTorch's lists of types that default to foreach kernels. Idempotent; a
    PyTorch without such a list keeps its own default."""
    for name in _LISTS:
        supported = getattr(importlib.import_module(name), "_foreach_supported_types", None)
        if isinstance(supported, list) and LazyTensor not in supported:
            supported.append(LazyTensor)
