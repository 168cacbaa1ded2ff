"""torch.autocast("remote_accelerator"): the same casts, values and gradients as CPU autocast.

PyTorch has no autocast kernels for a PrivateUse1 device; Genie registers its own (PyTorch's op
lists and policies, genie/csrc/autocast.cpp) when torch.autocast first asks for the device's
dtypes. Without them every op in the region failed ("Could not run 'aten::linear' ... Autocast").
"""
from __future__ import annotations

import copy

import pytest
import torch

from genie.errors import GenieError


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.norm = torch.nn.LayerNorm(4 * 8 * 8)
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        h = self.conv(x)
        conv_dtype = h.dtype
        h = self.norm(torch.relu(h).flatten(1))
        norm_dtype = h.dtype
        logits = self.fc(h)
        return logits, torch.log_softmax(logits, -1), (conv_dtype, norm_dtype)


def explicit_casts(model: Net, x, dtype):
    """Net's forward (on its own device) with the casts autocast's policies make, written out: convolutions
    and matmuls in `dtype`, layer_norm and log_softmax in float32 (PyTorch's lists, as for CUDA)."""
    F = torch.nn.functional
    h = F.conv2d(x.to(dtype), model.conv.weight.to(dtype), model.conv.bias.to(dtype), padding=1)
    h = F.layer_norm(torch.relu(h).flatten(1).float(), model.norm.normalized_shape, model.norm.weight,
                     model.norm.bias, model.norm.eps)
    logits = F.linear(h.to(dtype), model.fc.weight.to(dtype), model.fc.bias.to(dtype))
    return logits, torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_like_an_accelerator(dev, reference, dtype):
    torch.manual_seed(0)
    local = Net()
    remote = copy.deepcopy(local).to(dev)
    x, target = torch.randn(2, 3, 8, 8), torch.tensor([1, 3])

    with torch.autocast(device_type="remote_accelerator", dtype=dtype):
        logits, logp, (conv_dtype, norm_dtype) = remote(x.to(dev))
        loss = torch.nn.functional.nll_loss(logp, target.to(dev))
    loss.backward()
    assert (conv_dtype, norm_dtype, logits.dtype, logp.dtype, loss.dtype) == \
        (dtype, torch.float32, dtype, torch.float32, torch.float32)

    local = local.to(reference)  # the daemon's kind of device: the same kernels
    ref_logits, ref_logp = explicit_casts(local, x.to(reference), dtype)
    ref_loss = torch.nn.functional.nll_loss(ref_logp, target.to(reference))
    ref_loss.backward()
    torch.testing.assert_close(logits.cpu(), ref_logits.cpu())
    torch.testing.assert_close(logp.cpu(), ref_logp.cpu())
    for p_remote, p_local in zip(remote.parameters(), local.parameters()):
        assert p_remote.grad.dtype == torch.float32  # gradients reach the float32 weights
        torch.testing.assert_close(p_remote.grad.cpu(), p_local.grad.cpu())
    # Outside the region, ops run as written again.
    assert remote.fc(torch.zeros(1, 4 * 8 * 8, device=dev)).dtype == torch.float32


def test_grad_scaler_steps_like_on_cpu(dev):
    torch.manual_seed(1)
    local = torch.nn.Linear(16, 4)
    remote = copy.deepcopy(local).to(dev)
    x = torch.randn(8, 16)
    for model, device, xi in ((local, "cpu", x), (remote, "remote_accelerator", x.to(dev))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device)
        for _ in range(3):
            with torch.autocast(device_type=device, dtype=torch.float16):
                loss = model(xi).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    torch.testing.assert_close(remote.weight.cpu(), local.weight)
    torch.testing.assert_close(remote.bias.cpu(), local.bias)


def test_autocast_without_its_kernels_says_why(monkeypatch):
    from genie.frontend import device, native_guard

    def no_compiler(source):
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")

    monkeypatch.setattr(native_guard, "_autocast_lib", None)
    monkeypatch.setattr(native_guard, "_built", no_compiler)
    with pytest.raises(GenieError, match="autocast kernels, which could not be built here: no C\\+\\+ compiler"):
        device.get_amp_supported_dtype()


def test_sparse_mm_is_cast_as_on_the_cpu(dev):
    """torch.sparse.mm(sparse, dense) under autocast: bfloat16 on the CPU (its kernel calls addmm,
    which autocast casts), float32 on the device before (the sparse classes take _sparse_addmm
    whole, below autocast); _sparse_addmm is now on Genie's lower-precision list."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.sparse.mm(sparse, x)
    with torch.autocast("remote_accelerator", dtype=torch.bfloat16):
        for remote in (sparse.to(dev), sparse.to_sparse_csr().to(dev)):
            got = torch.sparse.mm(remote, x.to(dev))
            assert got.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(got.cpu(), want)
    assert torch.sparse.mm(sparse.to(dev), x.to(dev)).dtype == torch.float32  # outside autocast
