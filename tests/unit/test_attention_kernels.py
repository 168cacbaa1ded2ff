"""The daemon's kernels for torch's fused-attention ops for out-of-tree devices (daemon/attention.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from daemon import attention

FUSED = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default


@pytest.fixture(autouse=True, scope="module")
def registered():
    attention.register()


def _inputs(transposed: bool = False):
    torch.manual_seed(0)
    if transposed:  # (batch, length, heads, dim) viewed as (batch, heads, length, dim), as models do
        q, k, v = (torch.randn(2, n, 4, 8).transpose(1, 2) for n in (5, 7, 7))
    else:
        q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    mask = torch.rand(5, 7) > 0.3
    mask[:, 0] = True
    return q, k, v, mask


def _reference(q, k, v, mask, causal, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    out.backward(grad)
    return out, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("case", ["plain", "causal", "bool mask", "float bias", "transposed"])
def test_forward_and_backward_match_the_math_attention(case):
    q, k, v, mask = _inputs(transposed=case == "transposed")
    bias = torch.zeros(5, 7).masked_fill(~mask, float("-inf"))
    attn_mask = {"bool mask": mask, "float bias": bias}.get(case)
    causal = case == "causal"
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = FUSED(*inputs, attn_mask, 0.0, causal)[0]
    meta = FUSED(*(t.to("meta") for t in (q, k, v)), attn_mask, 0.0, causal)[0]
    assert out.stride() == meta.stride()  # laid out as the client plans it
    grad = torch.randn_like(out)
    out.backward(grad)  # through the op's derivative: its backward op, the other kernel here
    expected, expected_grads = _reference(q, k, v, attn_mask, causal, grad)
    torch.testing.assert_close(out, expected)
    for got, want in zip((t.grad for t in inputs), expected_grads):
        torch.testing.assert_close(got, want)


def test_the_math_path_matches_too_and_gives_the_bias_gradient():
    # What a daemon without the CPU flash kernel (a GPU) runs.
    q, k, v, mask = _inputs()
    bias = torch.randn(5, 7).masked_fill(~mask, float("-inf"))
    scale = 8 ** -0.5
    out, lse = attention._math_forward(q, k, v, bias, False, scale)
    grad = torch.randn_like(out)
    grads = attention._math_backward(grad, q, k, v, bias, False, scale, grad_bias=True)
    qr, kr, vr, br = (t.detach().clone().requires_grad_() for t in (q, k, v, bias))
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=br)
    expected.backward(grad)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-2, -1) * scale + bias, dim=-1))
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad, br.grad)):
        torch.testing.assert_close(got, want)


def test_rows_with_nothing_to_attend_to_give_zeros_on_the_math_path():
    q, k, v, _ = _inputs()
    bias = torch.zeros(5, 7)
    bias[2] = float("-inf")
    out, _ = attention._math_forward(q, k, v, bias, False, 8 ** -0.5)
    assert torch.isfinite(out).all() and (out[:, :, 2] == 0).all()


def test_dropout_is_refused_with_a_reason():
    q, k, v, _ = _inputs()
    with pytest.raises(NotImplementedError, match="dropout"):
        FUSED(q, k, v, None, 0.1)


@pytest.mark.parametrize("lq", [1, 5])
def test_every_tensor_output_is_laid_out_as_the_meta_kernel_says(lq):
    q, k, v = torch.randn(2, 4, lq, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    got = FUSED(q, k, v, None, 0.0, False)
    meta = FUSED(*(t.to("meta") for t in (q, k, v)), None, 0.0, False)
    for g, m in zip(got, meta):
        if isinstance(m, torch.Tensor):
            assert (g.shape, g.stride(), g.dtype) == (m.shape, m.stride(), m.dtype)
        else:
            assert g == m
