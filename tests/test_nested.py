"""Nested tensors on a remote device. Jagged ones (`layout=torch.jagged`, a Python tensor subclass
over ordinary values and offsets tensors) work as on the CPU: their ops run on remote values.
Strided ones (torch.nested's default layout, a C++ tensor type) have no remote counterpart and
are refused, saying to use the jagged layout; the one place PyTorch makes them itself,
nn.TransformerEncoder's fast path, runs padded and gives the CPU's results."""
import copy
import re

import pytest
import torch

from genie.errors import RemoteExecutionError, UnsupportedOperationError


def _same(cpu, remote) -> bool:
    return all(torch.allclose(a, b.cpu(), atol=1e-5) for a, b in zip(cpu.unbind(), remote.unbind()))


def test_jagged_made_on_the_device_matches_cpu(dev):
    torch.manual_seed(0)
    values, offsets = torch.randn(6, 8), torch.tensor([0, 2, 6])
    cpu = torch.nested.nested_tensor_from_jagged(values, offsets)
    # torch builds it through an op whose arguments include a CPU "dummy" jagged tensor: the
    # remote values must let the jagged class run it (PyTorch's subclass protocol).
    remote = torch.nested.nested_tensor_from_jagged(values.to(dev), offsets.to(dev))
    assert remote.device.type == "remote_accelerator" and remote.values().device.type == "remote_accelerator"
    assert _same(cpu, remote)
    made = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged, device=dev)
    assert made.values().device.type == "remote_accelerator"
    listed = torch.nested.as_nested_tensor([torch.ones(2, 3, device=dev), 2 * torch.ones(4, 3, device=dev)],
                                           layout=torch.jagged)
    assert _same(torch.nested.as_nested_tensor([torch.ones(2, 3), 2 * torch.ones(4, 3)], layout=torch.jagged), listed)


def test_jagged_ops_attention_and_gradients_match_cpu(dev):
    torch.manual_seed(0)
    q_cpu = torch.nested.nested_tensor([torch.randn(2, 5, 8), torch.randn(2, 3, 8)], layout=torch.jagged).transpose(1, 2)
    q = q_cpu.to(dev)
    assert _same(torch.nn.functional.scaled_dot_product_attention(q_cpu, q_cpu, q_cpu),
                 torch.nn.functional.scaled_dot_product_attention(q, q, q))
    x_cpu = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(4, 8)], layout=torch.jagged)
    x = x_cpu.to(dev)
    assert _same(torch.nn.functional.layer_norm(x_cpu, (8,)).softmax(-1), torch.nn.functional.layer_norm(x, (8,)).softmax(-1))
    assert torch.allclose(x.mean(dim=1).cpu(), x_cpu.mean(dim=1), atol=1e-6)
    assert torch.equal(x.to_padded_tensor(0.0).cpu(), x_cpu.to_padded_tensor(0.0))
    back = x.cpu()
    assert back.values().device.type == "cpu" and _same(x_cpu, back)

    linear = torch.nn.Linear(8, 4)
    remote_linear = torch.nn.Linear(8, 4).to(dev)
    remote_linear.load_state_dict(linear.state_dict())
    a, b = x_cpu.clone().requires_grad_(), x.clone().requires_grad_()
    linear(a).values().pow(2).sum().backward()
    remote_linear(b).values().pow(2).sum().backward()
    assert torch.allclose(linear.weight.grad, remote_linear.weight.grad.cpu(), atol=1e-5)
    assert _same(a.grad, b.grad)


def test_strided_nested_tensors_are_refused_clearly(dev):
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)])
    with pytest.raises(UnsupportedOperationError, match="layout=torch.jagged"):
        nested.to(dev)
    # Made from remote tensors: only the daemon's kernel can make it, and it says why it refuses.
    with pytest.raises(RemoteExecutionError, match="layout=torch.jagged"):
        torch.nested.as_nested_tensor([torch.ones(2, 3, device=dev), torch.ones(4, 3, device=dev)])
    assert (torch.ones(3, device=dev) + 1).tolist() == [2.0, 2.0, 2.0]  # the daemon carries on


def _encoder(layers=2, norm=None):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    return torch.nn.TransformerEncoder(layer, layers, norm=norm).eval()


def test_transformer_encoder_nested_fast_path_matches_cpu(dev):
    """nn.TransformerEncoder in eval with a src_key_padding_mask packs its input into a strided
    nested tensor: on the device the same path runs padded (genie/frontend/padded_sequences.py) and
    gives the CPU's values, zeros at padded positions included; a fully padded sequence, NaNs
    where padding sits, a final norm and a mask on the CPU change nothing."""
    x = torch.randn(3, 6, 8)
    x[1, 2:] = float("nan")  # never attended on the CPU's nested path: must not leak into real positions
    mask = torch.tensor([[False] * 6, [False, False, True, True, True, True], [True] * 6])
    for encoder in (_encoder(), _encoder(3, torch.nn.LayerNorm(8))):
        remote = copy.deepcopy(encoder).to(dev)
        with torch.no_grad():
            want = encoder(x, src_key_padding_mask=mask)
            for remote_mask in (mask.to(dev), mask):
                got = remote(x.to(dev), src_key_padding_mask=remote_mask)
                assert got.device.type == "remote_accelerator"
                torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
        assert want[1, 2:].abs().sum() == 0 or encoder.norm is not None  # the nested path ran on the CPU


def test_transformer_encoder_masks_not_left_aligned_match_cpu(dev):
    """A mask with gaps: the encoder's check sends it down the dense path, on both; with
    mask_check=False the nested path takes each sequence's leading positions, on both."""
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [True, False, False, True, False]])
    for check in (True, False):
        encoder = _encoder()
        encoder.mask_check = check
        with torch.no_grad():
            want = encoder(x, src_key_padding_mask=mask)
            got = copy.deepcopy(encoder).to(dev)(x.to(dev), src_key_padding_mask=mask.to(dev))
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)


def test_nested_from_mask_padding_and_refusals_match_cpu(dev):
    """torch._nested_tensor_from_mask of remote tensors: to_padded_tensor's sizes and errors as on the
    CPU; any other op on it is refused by name."""
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[True, True, True, False, False], [True, True, False, False, False]])
    cpu = torch._nested_tensor_from_mask(x, mask)
    remote = torch._nested_tensor_from_mask(x.to(dev), mask.to(dev))
    for size in (None, (2, 5, 8), (3, 6, 9), (2, 3, 8), (2, 4, 10)):
        torch.testing.assert_close(remote.to_padded_tensor(-1.0, size).cpu(), cpu.to_padded_tensor(-1.0, size))
    for size in ((2, 2, 8), (1, 5, 8), (2, 5)):
        with pytest.raises(RuntimeError) as on_cpu:
            cpu.to_padded_tensor(0.0, size)
        with pytest.raises(RuntimeError, match=re.escape(str(on_cpu.value).split(".")[0])):
            remote.to_padded_tensor(0.0, size)
    for bad_args in ((x, mask.float()), (x[0], mask), (x, mask[:, :4]), (x, mask[0]),
                     (x, torch.tensor([[True, False, True, False, False]] * 2))):
        with pytest.raises(RuntimeError) as on_cpu:
            torch._nested_tensor_from_mask(*bad_args)
        with pytest.raises(RuntimeError, match=re.escape(str(on_cpu.value))):
            torch._nested_tensor_from_mask(*(a.to(dev) for a in bad_args))
    with pytest.raises(UnsupportedOperationError, match="nested tensors are not supported"):
        remote + 1
    assert "PaddedSequences(batch=2, max_length=5" in repr(remote)
