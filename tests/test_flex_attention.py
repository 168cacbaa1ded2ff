"""torch.nn.attention.flex_attention on remote tensors (genie/frontend/flex_attention.py): refused
before ("only supported on CUDA, CPU, HPU, or MPS devices")."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as fa

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def causal(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


def alibi(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * (q_idx - kv_idx).abs()


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _qkv(*shape):
    torch.manual_seed(0)
    return [torch.randn(*shape) for _ in range(3)]


def test_score_mods_block_masks_and_lse_match_the_cpu(dev):
    q, k, v = _qkv(2, 4, 16, 8)
    remote = [t.to(dev) for t in (q, k, v)]
    for score_mod in (causal, alibi):
        torch.testing.assert_close(fa.flex_attention(*remote, score_mod=score_mod).cpu(),
                                   fa.flex_attention(q, k, v, score_mod=score_mod))
    on_cpu = fa.create_block_mask(causal_mask, 2, 4, 16, 16, device="cpu", BLOCK_SIZE=8)
    on_dev = fa.create_block_mask(causal_mask, 2, 4, 16, 16, device=dev, BLOCK_SIZE=8)
    assert on_dev.kv_num_blocks.device == torch.device(dev)
    torch.testing.assert_close(fa.flex_attention(*remote, block_mask=on_dev).cpu(),
                               fa.flex_attention(q, k, v, block_mask=on_cpu))
    out, aux = fa.flex_attention(*remote, score_mod=causal, return_aux=fa.AuxRequest(lse=True))
    _, expected = fa.flex_attention(q, k, v, score_mod=causal, return_aux=fa.AuxRequest(lse=True))
    torch.testing.assert_close(aux.lse.cpu(), expected.lse)
    with torch.inference_mode():  # below autograd: the op's dense kernel, on the daemon
        torch.testing.assert_close(fa.flex_attention(*remote, score_mod=alibi).cpu(),
                                   fa.flex_attention(q, k, v, score_mod=alibi))


def test_gradients_equal_those_of_causal_attention_on_the_cpu(dev):
    """PyTorch's CPU flex_attention has no backward: the reference is causal SDPA, the same function."""
    q, k, v = _qkv(2, 4, 16, 8)
    remote = [t.to(dev).requires_grad_() for t in (q, k, v)]
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa.flex_attention(*remote, score_mod=causal, enable_gqa=False)
    expected = F.scaled_dot_product_attention(*local, is_causal=True)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach())
    for a, b in zip(remote, local):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-5, rtol=1e-4)


def test_compiling_flex_attention_for_cpu_and_remote_tensors(dev):
    """Dynamo still traces flex_attention whole for CPU tensors through the device check Genie
    wraps (fullgraph=True). The program's torch.compile(flex_attention) runs eagerly on remote
    tensors, and after that, flex_attention on the CPU, which compiles its op with fullgraph=True,
    failed (dynamo had compiled, and marked to skip, frames of that remote call). (The program's
    compiled flex_attention itself is then left to run eagerly, as any function torch.compile
    first met with remote tensors.)"""
    q, k, v = _qkv(1, 2, 8, 4)
    expected = fa.flex_attention(q, k, v, score_mod=causal)
    whole = torch.compile(fa.flex_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(whole(q, k, v, score_mod=causal), expected)
    compiled = torch.compile(fa.flex_attention)
    torch.testing.assert_close(compiled(*(t.to(dev) for t in (q, k, v)), score_mod=causal).cpu(), expected)
    alibi_bias = -(torch.arange(2.0).view(2, 1, 1) + 1) * (torch.arange(8.0).view(8, 1) - torch.arange(8.0)).abs()
    torch.testing.assert_close(fa.flex_attention(q, k, v, score_mod=alibi),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias))
    with pytest.raises(NotImplementedError, match="backward on CPU"):  # PyTorch's own check still there
        fa.flex_attention(q.requires_grad_(), k, v)


def test_score_mod_over_a_learned_bias_on_the_device_trains(dev):
    """A relative-position bias table held by the model (on the device), read by score_mod, and
    a document mask over ids on the device: values, and the bias's gradient, as SDPA's on the CPU."""
    q, k, v = _qkv(2, 4, 16, 8)
    bias = torch.randn(4, 16, 16)
    remote_bias = bias.to(dev).requires_grad_()
    out = fa.flex_attention(*(t.to(dev) for t in (q, k, v)),
                            score_mod=lambda score, b, h, q_idx, kv_idx: score + remote_bias[h, q_idx, kv_idx])
    local_bias = bias.clone().requires_grad_()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=local_bias)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach())
    torch.testing.assert_close(remote_bias.grad.cpu(), local_bias.grad, atol=1e-5, rtol=1e-4)

    docs = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
    on_dev = docs.to(dev)
    block_mask = fa.create_block_mask(lambda b, h, q_idx, kv_idx: on_dev[q_idx] == on_dev[kv_idx],
                                      None, None, 16, 16, device=dev)
    same_doc = docs.view(16, 1) == docs.view(1, 16)
    torch.testing.assert_close(fa.flex_attention(*(t.to(dev) for t in (q, k, v)), block_mask=block_mask).cpu(),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=same_doc))
