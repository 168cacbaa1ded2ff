"""Ops run under the numerics settings in force when they were captured, not when they are sent.

A batch carries the settings of the moment it is sent (genie/transport/numerics.py), and ops
wait in batches: in `with sdpa_kernel(SDPBackend.MATH): out = attn(q, k, v)` the attention is
still queued when the block ends, and went out under the restored settings (the daemon ran its
flash kernel). So every PyTorch setter of a setting that travels with ops (torch._C's, called by
torch.backends, sdpa_kernel, torch.use_deterministic_algorithms, ...) is wrapped: when it
changes a setting while ops are queued, those ops are sent first, with the settings they were
captured under. A setter that changes nothing, or runs with nothing queued, costs two reads of
the settings (~3 us) or less.
"""
from __future__ import annotations

import functools
import sys

import torch

from genie.transport import numerics

# torch._C's setters of the settings numerics.FIELDS lists.
SETTERS = (
    "_set_float32_matmul_precision", "_set_fp32_precision_setter", "_set_cudnn_allow_tf32", "_set_cublas_allow_tf32",
    "_set_cublas_allow_fp16_reduced_precision_reduction", "_set_cublas_allow_bf16_reduced_precision_reduction",
    "_set_cublas_allow_fp16_accumulation", "_set_cpu_allow_fp16_reduced_precision_reduction", "_set_cudnn_enabled",
    "_set_cudnn_benchmark", "_set_cudnn_deterministic", "_set_deterministic_algorithms",
    "_set_deterministic_fill_uninitialized_memory", "_set_sdp_use_flash", "_set_sdp_use_mem_efficient",
    "_set_sdp_use_math", "_set_sdp_use_cudnn", "_set_sdp_use_overrideable", "_set_sdp_use_fa3",
    "_set_math_sdp_allow_fp16_bf16_reduction", "_set_sdp_priority_order",
)

_installed = False


def _queued_streams() -> list:
    from genie.runtime import started_runtime

    rt = started_runtime()  # never starts one: without a runtime nothing is queued
    return [s for s in rt.streams if s.ops] if rt is not None else []


def _barrier(setter):
    @functools.wraps(setter)
    def set_and_keep_order(*args, **kwargs):
        queued = _queued_streams()
        if not queued:
            return setter(*args, **kwargs)
        before = numerics.read()
        result = setter(*args, **kwargs)
        if numerics.read() != before:
            for stream in queued:
                stream.flush(settings=before)
        return result

    set_and_keep_order._genie_wraps = setter
    return set_and_keep_order


def install() -> None:
    """Wrap the setters (once): torch._C's, and the copies torch.backends' properties hold
    (`torch.backends.cudnn.benchmark = True` calls the function it bound at import)."""
    global _installed
    if _installed or not numerics.AVAILABLE:
        return
    wrapped = {}
    for name in SETTERS:
        setter = getattr(torch._C, name, None)
        if setter is not None and not hasattr(setter, "_genie_wraps"):
            wrapped[setter] = _barrier(setter)
            setattr(torch._C, name, wrapped[setter])
    from torch.backends import ContextProp

    for name, module in list(sys.modules.items()):
        if name.startswith("torch.backends") and module is not None:
            for prop in vars(type(module)).values():
                if isinstance(prop, ContextProp) and prop.setter in wrapped:
                    prop.setter = wrapped[prop.setter]
    _installed = True
