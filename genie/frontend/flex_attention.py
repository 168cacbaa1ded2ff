"""`torch.nn.attention.flex_attention` on remote tensors: PyTorch's unfused implementation.

Called without torch.compile, flex_attention refuses devices other than its own list, and for
the others compiles its higher-order op with torch.compile(fullgraph=True), which cannot trace
a remote tensor. For remote inputs it now takes PyTorch's own eager path (the one its
`_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG` switch selects): the op runs `math_attention`, scores
materialized as for the CPU, every op captured and run on the daemon. score_mod, mask_mod and
`create_block_mask(..., device="remote_accelerator")` work as on the CPU.

Gradients: PyTorch's autograd rule traces score_mod on fake tensors, and the scalars score_mod
makes on the device (`torch.where(..., -inf)`) become remote tensors, which fake tensors cannot
take. For remote inputs autograd records `math_attention`'s own ops instead (vmap over score_mod
is differentiable), which gives the same gradients; PyTorch's CPU implementation has no backward.
That rule is registered for AutogradPrivateUse1 only: CPU and CUDA calls keep PyTorch's kernels.

The device check this wraps is in flex_attention_check.py, the one Genie module dynamo traces.
"""
from __future__ import annotations

import contextlib
import logging

from . import flex_attention_check as check
from .lazy_tensor import LazyTensor

log = logging.getLogger("genie.frontend")


class _EagerForRemoteCalls:
    """Stands in for flex_attention's `_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG` (read at each call,
    after its device check): true for a call on remote tensors, else the program's setting."""

    def __init__(self, setting) -> None:
        self.setting = setting

    def __bool__(self) -> bool:
        return getattr(check.call, "remote", False) or bool(self.setting)

    def __repr__(self) -> str:
        return f"{bool(self.setting)} (True for remote_accelerator inputs: Genie)"


def _compiling_unless_remote(setup_compilation_env):
    @contextlib.contextmanager
    def _setup_compilation_env():
        if not getattr(check.call, "remote", False):
            with setup_compilation_env() as backend:
                yield backend
            return
        # A remote call runs the op directly (the switch above). Under the program's own
        # torch.compile that call's frame would still be compiled, fail on remote tensors and be
        # marked to skip, and flex_attention's later compiles of it for CPU or CUDA tensors (with
        # fullgraph=True) then failed: it runs with dynamo standing aside.
        from torch._C._dynamo.eval_frame import set_eval_frame

        prior = set_eval_frame(None)  # what torch._dynamo.disable does around a call
        try:
            yield None
        finally:
            set_eval_frame(prior)

    _setup_compilation_env._genie_wraps = setup_compilation_env
    return _setup_compilation_env


def _remote_autograd(query, key, value, score_mod, block_mask, scale, kernel_options,
                     score_mod_other_buffers=(), mask_mod_other_buffers=()):
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch._higher_order_ops.flex_attention import _permute_strides, math_attention

    with TransformGetItemToIndex():
        out, lse, max_scores = math_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                                              score_mod_other_buffers, mask_mod_other_buffers)
    return _permute_strides(out, query.stride()), lse, max_scores


def install() -> None:
    """Once, and only where this PyTorch has every piece used (they are its internals): otherwise
    flex_attention keeps refusing remote tensors with PyTorch's own message."""
    import importlib

    import torch.nn.attention.flex_attention as api
    from torch._C import DispatchKey

    # By name: torch._higher_order_ops exports the op itself under the module's name.
    ops = importlib.import_module("torch._higher_order_ops.flex_attention")

    missing = [name for module, names in ((api, _API_NAMES), (ops, _OP_NAMES)) for name in names
               if not hasattr(module, name)]
    if missing:
        log.debug("flex_attention stays refused on remote tensors: this PyTorch has no %s", ", ".join(missing))
        return
    if hasattr(api._validate_device, "_genie_wraps"):
        return
    try:  # the op's rules first: if this PyTorch refuses one, the calls stay refused as they were
        # Below autograd (no_grad, inference_mode) the op reaches the Python key: PyTorch's dense kernels.
        ops.flex_attention.py_impl(LazyTensor)(ops.sdpa_dense)
        ops.flex_attention_backward.py_impl(LazyTensor)(ops.sdpa_dense_backward)
        ops.flex_attention.py_impl(DispatchKey.AutogradPrivateUse1)(_remote_autograd)
    except Exception as e:  # noqa: BLE001 - another PyTorch's internals
        log.debug("flex_attention stays refused on remote tensors: %s", e)
        return
    api._validate_device = check.validating_remote_calls(api._validate_device)
    api._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = _EagerForRemoteCalls(api._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)
    api.setup_compilation_env = _compiling_unless_remote(api.setup_compilation_env)


_API_NAMES = ("_validate_device", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", "setup_compilation_env")
_OP_NAMES = ("flex_attention", "flex_attention_backward", "sdpa_dense", "sdpa_dense_backward", "math_attention",
             "_permute_strides")
