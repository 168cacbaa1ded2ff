"""Composite ops kept whole on `remote_accelerator` when no gradient is being recorded.

ATen decomposes a CompositeImplicitAutograd op (linear, matmul, layer_norm, softmax, ...) at
its autograd key, before __torch_dispatch__ sees it: under torch.no_grad a 3-D `F.linear`
reached capture as view + t + addmm + view, each a C++ -> Python -> C++ trip. These kernels sit
at AutogradPrivateUse1: when no gradient is needed they skip to below autograd, where capture
gets the whole op (as it does under torch.inference_mode) and the daemon runs it as one;
when one is, they decompose exactly as ATen would, so autograd records the same graph.
Only ops whose result is a new tensor (no aliasing, no writes to arguments) are listed.
"""
from __future__ import annotations

import torch
from torch.autograd import forward_ad as _forward_ad

# Overload names of CompositeImplicitAutograd ops with fresh outputs, common in models. The
# activation backwards are the ops with both such a decomposition and CPU/CUDA kernels of their
# own: PyTorch computes them fused (in float32 for half types), while on this device their
# decomposition ran (8 ops for SiLU's, in bfloat16 arithmetic for bfloat16: its gradients
# differed from the CPU's in the last bits; Llama-style MLPs take one per layer in backward).
WHOLE_WHEN_NO_GRAD = ("linear", "matmul", "layer_norm", "softmax.int", "log_softmax.int",
                      "silu_backward", "mish_backward")


def _needs_grad(args, kwargs) -> bool:
    """Whether autograd must see the decomposition: a gradient is being recorded, or forward-mode
    AD is on (torch.func.jvp / jacfwd, fwAD.dual_level: dual tensors need no requires_grad, and
    below autograd their tangents were dropped, so jvp through F.linear gave zeros)."""
    if _forward_ad._current_level >= 0:
        return True
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))


def _whole_unless_grad(op):
    def kernel(*args, **kwargs):
        if _needs_grad(args, kwargs):
            return op.decompose(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    kernel.__name__ = f"whole_{op.__name__}"
    return kernel


def sdpa_whole(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Keep scaled_dot_product_attention one op on remote tensors (it would otherwise decompose into
    ~15 ops before capture sees it): the daemon then runs its fused kernel, and the op's arguments
    carry no sequence lengths. With autograd recording, it is torch's fused op for out-of-tree
    devices, whose derivative is its own backward op (kernels: daemon/attention.py); where that op
    does not apply (dropout, GQA, a mask that needs a gradient, not 4-D), the math decomposition."""
    op = torch.ops.aten.scaled_dot_product_attention.default
    if _forward_ad._current_level >= 0:  # the fused op has no forward-mode derivative: as the CPU, math
        return op.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if _needs_grad((query, key, value, attn_mask), {}):
        # sdpa_kernel(...) leaving out both fused backends the daemon may use (the flash kernel,
        # Genie's own): torch's math decomposition, recorded here, as on the CPU.
        if (dropout_p or enable_gqa or query.dim() != 4 or key.dim() != 4 or value.dim() != 4
                or (attn_mask is not None and attn_mask.requires_grad)
                or not (torch._C._get_flash_sdp_enabled() or torch._C._get_overrideable_sdp_enabled())):
            return op.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        # A boolean mask goes as it is: the daemon's kernel reads it as this op does (True: attend).
        return _FUSED(query, key, value, attn_mask, 0.0, is_causal, False, scale=scale)[0]
    with torch._C._AutoDispatchBelowAutograd():
        return op(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


_FUSED = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default


def register(lib: torch.library.Library) -> None:
    for name in WHOLE_WHEN_NO_GRAD:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        lib.impl(name, _whole_unless_grad(op), "AutogradPrivateUse1")
    lib.impl("scaled_dot_product_attention", sdpa_whole, "AutogradPrivateUse1")
