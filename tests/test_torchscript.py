"""TorchScript modules on remote_accelerator: loading onto the device, moving there, saving from there."""
import io

import torch
import torch.nn as nn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).eval()


def _saved(module) -> io.BytesIO:
    buf = io.BytesIO()
    torch.jit.save(module, buf)
    buf.seek(0)
    return buf


def test_jit_load_onto_the_device(dev):
    """torch.jit.load(f, map_location=dev) left every tensor a handle on an empty daemon tensor
    with another's metadata (the C++ loader points tensors at storages without dispatch): a
    Linear's bias reported the weight's shape and the forward failed."""
    model = _model()
    x = torch.randn(5, 3)
    loaded = torch.jit.load(_saved(torch.jit.script(model)), map_location=dev)
    for (name, want), (_, got) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert got.device.type == "remote_accelerator" and got.shape == want.shape, name
        assert torch.equal(got.cpu(), want), name
    torch.testing.assert_close(loaded(x.to(dev)).cpu(), model(x))


def test_script_and_traced_modules_move_to_the_device_and_train(dev):
    """.to(dev) on a ScriptModule failed: "_apply(): Couldn't swap Linear.weight"."""
    model = _model()
    x = torch.randn(5, 3)
    for module in (torch.jit.script(_model()), torch.jit.trace(_model(), x)):
        assert module.to(dev) is module
        assert all(p.device.type == "remote_accelerator" for p in module.parameters())
        torch.testing.assert_close(module(x.to(dev)).cpu(), model(x))
        torch.testing.assert_close(module.to("cpu")(x), model(x))
    local, remote = torch.jit.script(nn.Linear(3, 1)), torch.jit.script(nn.Linear(3, 1))
    remote.load_state_dict(local.state_dict())
    remote.to(dev)
    for m, data in ((local, x), (remote, x.to(dev))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            m(data).pow(2).mean().backward()
            opt.step()
    torch.testing.assert_close(remote.weight.detach().cpu(), local.weight.detach())


def test_jit_save_of_a_module_on_the_device(dev):
    """torch.jit.save reads each storage through `set_(storage)`, which named no remote tensor;
    loading it back without map_location put the tensors on the device through the same
    broken path as above."""
    model = _model()
    x = torch.randn(5, 3)
    module = torch.jit.script(_model()).to(dev)
    buf = _saved(module)
    back = torch.jit.load(buf)
    assert all(p.device.type == "remote_accelerator" for p in back.parameters())
    torch.testing.assert_close(back(x.to(dev)).cpu(), model(x))
    buf.seek(0)
    on_cpu = torch.jit.load(buf, map_location="cpu")
    assert all(p.device.type == "cpu" for p in on_cpu.parameters())
    torch.testing.assert_close(on_cpu(x), model(x))


def test_tracing_on_the_device_is_refused_with_the_way_that_works(dev):
    """torch.jit.trace of a remote model failed partway (planning a convolution under the tracer
    saw sizes as traced tensors: "cond must be a bool, but got a Tensor"); now it is refused at
    the call, for models and inputs alike, and tracing on the CPU then moving gives the CPU's values."""
    import pytest

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)).eval()
    x = torch.randn(2, 3, 6, 6)
    with pytest.raises(RuntimeError, match="Trace on the CPU"):
        torch.jit.trace(_copy_to(model, dev), x.to(dev))
    with pytest.raises(RuntimeError, match="Trace on the CPU"):
        torch.jit.trace_module(_copy_to(model, dev), {"forward": (x,)})
    with pytest.raises(RuntimeError, match="Trace on the CPU"):
        torch.jit.trace(lambda t: t * 2, (x.to(dev),))
    traced = torch.jit.trace(model, x).to(dev)
    torch.testing.assert_close(traced(x.to(dev)).cpu(), model(x))


def _copy_to(model, dev):
    import copy

    return copy.deepcopy(model).to(dev)
