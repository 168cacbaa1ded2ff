"""Nested tensors on a remote device. Jagged ones (`layout=torch.jagged`, a Python tensor subclass
over ordinary values and offsets tensors) work as on the CPU: their ops run on remote values.
Strided ones (torch.nested's default layout, a C++ tensor type) have no remote counterpart and
are refused, saying to use the jagged layout."""
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
