"""Kernels for the "overrideable" fused-attention ops, which torch leaves to out-of-tree devices.

A client that records autograd through scaled_dot_product_attention sends it as
aten::_scaled_dot_product_fused_attention_overrideable (forward: output and log-sum-exp) and,
in backward, its _backward op: two ops instead of the ~15 of the math decomposition, and the
daemon's own fused kernel where it has one. torch has no CPU or CUDA kernel for these ops
(they exist for devices like Genie's), so the daemon registers them here:

- on CPU, torch's flash-attention kernels for CPU (forward and backward) where torch itself
  would choose them: its selector checks the inputs (last dimension contiguous, ...) and the
  client's settings (torch.nn.attention.sdpa_kernel, sent with its ops: genie/transport/numerics.py);
- elsewhere (GPU daemons included), torch's MATH backend (`_scaled_dot_product_attention_math`),
  its backward by autograd through it, so gradients are the ones torch gives with that backend.

A boolean attn_bias is read as scaled_dot_product_attention reads a boolean mask (True: attend).

Outputs are laid out as the ops' meta kernels say (the client plans with those), so the
result is copied into tensors of that layout where the kernel's own differs.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten
FORWARD = "_scaled_dot_product_fused_attention_overrideable"
BACKWARD = "_scaled_dot_product_fused_attention_overrideable_backward"

_lib: torch.library.Library | None = None


def traceable(name: str):
    """The kernel itself, called from Python, for an op of a recorded program: torch.jit.trace
    cannot record these ops (they return ints), but records the aten ops their kernels call."""
    return _BY_NAME.get(name)


def register() -> None:
    """Give both ops a kernel on CPU and CUDA where torch has none (once per process)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    for key in ("CPU", "CUDA"):
        for name, kernel in ((FORWARD, forward), (BACKWARD, backward)):
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
                lib.impl(name, kernel, key)
    _lib = lib


def forward(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    if dropout_p or return_debug_mask:
        raise NotImplementedError("genie-daemon's fused attention runs without dropout or a debug mask "
                                  "(clients send those as the math decomposition)")
    if query.dim() != 4:
        raise NotImplementedError("genie-daemon's fused attention takes 4-D (batch, heads, length, dim) inputs")
    attn_bias = _as_bias(attn_bias, query)
    out = lse = None
    if _flash_on_cpu(query, key, value, attn_bias, is_causal, scale):
        try:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, is_causal, attn_mask=attn_bias, scale=scale)
        except RuntimeError:  # inputs its checks refuse (e.g. differing head dims): the math below
            pass
    if out is None:
        out, lse = _math_forward(query, key, value, attn_bias, is_causal, _scale(query, scale))
    b, h, lq, _ = query.shape
    result = _like_query(query, (b, h, lq, value.shape[-1]))
    result.copy_(out)
    seed = torch.zeros((), dtype=torch.long, device=query.device)
    offset = torch.zeros((), dtype=torch.long, device=query.device)
    return result, _contiguous(lse.float()), None, None, lq, key.shape[-2], seed, offset, None


def backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q, cum_seq_k,
             max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if dropout_p:
        raise NotImplementedError("genie-daemon's fused attention runs without dropout")
    bias = _as_bias(attn_bias, query) if attn_bias is not None and attn_bias.numel() else None
    bias_grad = bias is not None and grad_input_mask[3]  # the CPU flash kernel gives none
    grads = None
    if not bias_grad and _flash_on_cpu(query, key, value, bias, is_causal, scale):
        if logsumexp.dtype != query.dtype and query.dtype == torch.float64:
            # The op's log-sum-exp is float32 (its meta kernel's), the CPU kernel's for double
            # inputs double: taken again at full precision (gradients were off by ~1e-6 relative).
            logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, is_causal, attn_mask=bias, scale=scale)[1]
        try:
            grads = (*aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous(), query, key, value, out, logsumexp,
                0.0, is_causal, attn_mask=bias, scale=scale), None)
        except RuntimeError:  # as in forward: the math below
            pass
    if grads is None:
        grads = _math_backward(grad_out, query, key, value, bias, is_causal, _scale(query, scale), grad_bias=bias_grad)
    results = []
    for grad, like in zip(grads[:3], (query, key, value)):
        placed = torch.empty_like(like)
        placed.copy_(grad)
        results.append(placed)
    grad_bias = None  # as the meta kernel: a tensor like the bias whenever there is one
    if attn_bias is not None:
        grad_bias = torch.zeros_like(attn_bias)  # zeros where no gradient was asked for
        if grads[3] is not None:
            grad_bias.copy_(grads[3])
    return (*results, grad_bias)


def _flash_on_cpu(query, key, value, bias, is_causal: bool, scale) -> bool:
    """Whether torch would run these inputs through its CPU flash kernel: its own choice, which
    also honours the client's sdpa_kernel settings (in force on the daemon for this request).
    The kernel reads the last dimension as contiguous; called directly on inputs whose last
    dimension is not (channels-last 4-D tensors), it gave wrong outputs and gradients."""
    return query.device.type == "cpu" and torch._fused_sdp_choice(
        query, key, value, bias, 0.0, is_causal, scale=scale) == _FLASH


_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _as_bias(mask, query):
    """A boolean mask (True: attend; the client sends scaled_dot_product_attention's as it is) as
    the additive bias the kernels take."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _scale(query, scale) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])


def _scores(query, key, bias, is_causal: bool, scale: float):
    """Scaled scores in float32 or wider, bias and causal mask (top-left aligned, as torch's) applied."""
    work = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(work), key.to(work).transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.to(work)
    if is_causal:
        lq, lk = scores.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _math_forward(query, key, value, bias, is_causal: bool, scale: float):
    """torch's MATH backend itself (what torch computes where it picks it), and the log-sum-exp."""
    out = aten._scaled_dot_product_attention_math(query, key, value, bias, 0.0, is_causal, scale=scale)[0]
    return out, torch.logsumexp(_scores(query, key, bias, is_causal, scale), dim=-1)


def _math_backward(grad_out, query, key, value, bias, is_causal: bool, scale: float, grad_bias: bool):
    """Gradients as torch's MATH backend gives them: its forward again, under autograd (a formula
    of our own from the saved log-sum-exp differed from the CPU's in the last bits)."""
    # The daemon runs ops in inference mode: autograd needs it off, and normal tensors (copies).
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [t.clone().requires_grad_() for t in (query, key, value)]
        grad_out = grad_out.clone()
        if bias is not None:
            bias = bias.clone().requires_grad_(grad_bias)
        out = aten._scaled_dot_product_attention_math(*leaves, bias, 0.0, is_causal, scale=scale)[0]
        grads = torch.autograd.grad(out, leaves + ([bias] if grad_bias else []), grad_out)
    return (*grads[:3], grads[3] if grad_bias else None)


def _contiguous(t) -> torch.Tensor:
    """`t` with row-major strides in every dimension, size-1 ones too (as the meta kernel's log-sum-exp)."""
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= n
    if tuple(t.stride()) == tuple(reversed(strides)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _like_query(query, shape) -> torch.Tensor:
    """An empty tensor of `shape` laid out as the op's meta kernel lays out its output (the
    query's dimension order), so the client's metadata holds."""
    if tuple(query.shape) == tuple(shape):
        return torch.empty_like(query)
    order = sorted(range(4), key=lambda i: query.stride()[i], reverse=True)
    strides = [0] * 4
    step = 1
    for i in reversed(order):
        strides[i] = step
        step *= shape[i]
    return torch.empty_strided(shape, strides, dtype=query.dtype, device=query.device)


def sdpa_contiguous(*args, **kwargs) -> torch.Tensor:
    """aten::scaled_dot_product_attention, its result laid out as the op's meta kernel (the math
    decomposition) lays it out, row-major, which is what clients plan with
    (genie/frontend/shape_rules.py). A fused kernel may lay the same values out otherwise (the CPU
    flash kernel follows the query's layout: a query made by view + transpose, as in most models,
    gave a result that a `.view` the client's metadata allows could not take). Strides of size-1
    dimensions may stay as the kernel left them: they address nothing (decoding, one query
    position, the CPU kernel's result differs from row-major only there, and was copied)."""
    out = aten.scaled_dot_product_attention.default(*args, **kwargs)
    return out if out.is_contiguous() else out.contiguous()


# Ops this daemon runs through its own function rather than the dispatcher's kernel.
REPLACED = {"aten::scaled_dot_product_attention": sdpa_contiguous}


def replacement(name: str):
    return REPLACED.get(name)


_BY_NAME = {f"aten::{FORWARD}": forward, f"aten::{BACKWARD}": backward, **REPLACED}
