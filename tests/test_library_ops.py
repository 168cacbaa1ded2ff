"""Ops from outside aten (torch.library.custom_op, a library's own namespace) on remote tensors.

A daemon runs aten ops only, so such an op runs its kernel for every device on the client, on
the remote tensors, and the aten ops inside it are what the daemon sees; an op with kernels only
for particular devices is refused when it is called, by name."""
import pytest
import torch

from genie.errors import UnsupportedOperationError


@torch.library.custom_op("genie_test::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x + alpha * y


@scaled_add.register_fake
def _(x, y, alpha):
    return torch.empty_like(x)


def _scaled_add_backward(ctx, grad):
    return grad, grad * ctx.alpha, None


def _scaled_add_context(ctx, inputs, output):
    ctx.alpha = inputs[2]


scaled_add.register_autograd(_scaled_add_backward, setup_context=_scaled_add_context)


@torch.library.custom_op("genie_test::add_into", mutates_args=("out",))
def add_into(out: torch.Tensor, x: torch.Tensor) -> None:
    out.add_(x)


@torch.library.custom_op("genie_test::cuda_only", mutates_args=(), device_types="cuda")
def cuda_only(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("genie_test::for_this_device", mutates_args=(), device_types="remote_accelerator")
def for_this_device(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


_LIB = torch.library.Library("genie_test_lib", "DEF")
_LIB.define("halve(Tensor x) -> Tensor")
# As FSDP2 registers its copy-in ops: a Python kernel per device key, PrivateUse1 among them.
torch.library.impl(_LIB, "halve", "PrivateUse1")(lambda x: x / 2)
torch.library.impl(_LIB, "halve", "Meta")(lambda x: torch.empty_like(x))


def test_custom_op_runs_as_the_aten_ops_it_calls(dev):
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    got = scaled_add(x.to(dev), y.to(dev), 2.5)
    assert got.device == torch.device(dev)
    torch.testing.assert_close(got.cpu(), x + 2.5 * y)
    got = scaled_add(got, y.to(dev), -1.0)  # second call: straight from dispatch
    torch.testing.assert_close(got.cpu(), x + 1.5 * y)


def test_custom_op_backward_on_the_device(dev):
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    xr = x.detach().to(dev).requires_grad_()
    yr = y.detach().to(dev).requires_grad_()
    scaled_add(xr, yr, 3.0).sum().backward()
    scaled_add(x, y, 3.0).sum().backward()
    torch.testing.assert_close(xr.grad.cpu(), x.grad)
    torch.testing.assert_close(yr.grad.cpu(), y.grad)


def test_ops_with_a_kernel_for_this_device_run_it(dev, sent_ops):
    """A kernel registered for remote_accelerator (custom_op's device_types, or a library's for
    "PrivateUse1", as FSDP2 registers its copy-in ops) runs on the client; the daemon sees the
    aten ops it calls. Such ops were refused before."""
    x = torch.arange(4.0)
    assert for_this_device(x.to(dev)).cpu().tolist() == (x * 3 + 1).tolist()
    assert torch.ops.genie_test_lib.halve(x.to(dev)).cpu().tolist() == (x / 2).tolist()
    assert "aten::div.Tensor" in sent_ops or "aten::div.Scalar" in sent_ops


def test_mutating_custom_op_writes_the_remote_tensor(dev):
    out, x = torch.zeros(6), torch.arange(6.0)
    remote = out.to(dev)
    add_into(remote, x.to(dev))
    add_into(remote, x.to(dev))
    torch.testing.assert_close(remote.cpu(), 2 * x)


def test_op_with_kernels_for_particular_devices_is_refused_when_called(dev):
    with pytest.raises(UnsupportedOperationError, match="genie_test::cuda_only"):
        cuda_only(torch.ones(2).to(dev))
    torch.testing.assert_close((torch.ones(2).to(dev) + 1).cpu(), torch.full((2,), 2.0))  # the stream goes on


def test_quantized_tensors_and_models_are_refused_saying_what_to_do(dev):
    # q.to(device) failed inside PyTorch ("Could not run 'aten::empty_quantized' with arguments
    # from the 'Quantizedremote_accelerator' backend"), a dynamically quantized model's forward
    # with the message for any op from outside aten.
    import warnings

    q = torch.quantize_per_tensor(torch.tensor([0.5, -1.0]), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedOperationError, match="quantized tensors .* dequantize"):
        q.to(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 4)), {torch.nn.Linear})
    model.to(dev)
    with pytest.raises(UnsupportedOperationError, match="quantized::linear_dynamic.*quantize and run quantized"):
        model(torch.ones(1, 4).to(dev))
    torch.testing.assert_close(q.dequantize().to(dev).cpu(), torch.tensor([0.5, -1.0]))


def test_distributed_collectives_on_remote_tensors_run_through_the_cpu_backend(dev, tmp_path):
    """One process (the group of several is tests/test_collectives.py): the c10d op reaches Genie,
    which runs it on CPU copies through gloo and writes the results back to the device."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        t = torch.arange(4.0, device=dev)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        assert work.is_completed() and work.get_future().value()[0] is t
        assert t.device.type == "remote_accelerator" and t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        outs = [torch.zeros(4, device=dev)]
        dist.all_gather(outs, t * 2)
        assert outs[0].cpu().tolist() == [0.0, 2.0, 4.0, 6.0]
        flat = torch.zeros(4, device=dev)
        dist.all_gather_single(flat, t + 1)
        assert flat.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
        dist.broadcast(t, 0)
        dist.barrier()
        from torch.distributed import _functional_collectives as funcol

        r = funcol.all_reduce(t, "sum", dist.group.WORLD)
        assert r.device == t.device and r.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()
