"""torch.optim on remote parameters: every optimizer, in its default, foreach and fused forms,
steps the parameters as on the CPU; GradScaler unscales and skips like the CPU's. The fused
SGD and Adagrad steps have no meta kernel in PyTorch: they failed ("returned more outputs than
the client has handles for (0)") until Genie planned them itself."""
import pytest
import torch
from torch import nn

from genie.frontend import capture


def _trained(device, kind, kwargs, steps=4, scaler=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = getattr(torch.optim, kind)(model.parameters(), lr=0.05, **kwargs)
    amp = torch.amp.GradScaler(device.split(":")[0], init_scale=2.0 ** 8) if scaler else None
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        if amp is None:
            loss.backward()
            opt.step()
        else:
            amp.scale(loss).backward()
            amp.step(opt)
            amp.update()
    return torch.cat([p.detach().cpu().flatten() for p in model.parameters()])


@pytest.mark.parametrize("kind, kwargs", [
    ("SGD", {"fused": True, "momentum": 0.9}), ("SGD", {"fused": True}), ("Adagrad", {"fused": True}),
    ("Adam", {"fused": True}), ("AdamW", {"fused": True, "amsgrad": True}),
    ("SGD", {"foreach": True, "momentum": 0.9, "nesterov": True}), ("Adam", {"foreach": True}),
    ("RMSprop", {"foreach": True, "centered": True}), ("NAdam", {"foreach": True}), ("RAdam", {"foreach": True}),
    ("Adamax", {"foreach": True}), ("ASGD", {"foreach": True}), ("Rprop", {"foreach": True}),
    ("Adadelta", {"foreach": True}), ("Adam", {"foreach": False}),
])
def test_optimizers_step_as_on_cpu(dev, kind, kwargs):
    want = _trained("cpu", kind, kwargs)
    got = _trained(dev, kind, kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["SGD", "Adagrad", "Adam"])
def test_fused_steps_under_grad_scaler_as_on_cpu(dev, kind):
    want = _trained("cpu", kind, {"fused": True}, scaler=True)
    got = _trained(dev, kind, {"fused": True}, scaler=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_optimizers_default_to_foreach_kernels_as_on_cuda(dev, kind, sent_ops):
    """A default optimizer (foreach=None) and clip_grad_norm_ take the foreach kernels for remote
    parameters, as for CUDA ones (genie/frontend/foreach_defaults.py): one op per step for all the
    parameters where the loop sent one per parameter (AdamW on a 4-tensor model: 9 lerp_ and
    addcmul_ ops per step became 1 each). Values as the CPU's loop."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = list(nn.Linear(4, 4).to(dev).parameters())
    assert _default_to_fused_or_foreach(params, differentiable=False) == (False, True)
    want = _trained("cpu", kind, {"foreach": False})
    sent_ops.clear()
    got = _trained(dev, kind, {})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert any(op.startswith("aten::_foreach_") for op in sent_ops), sent_ops
    assert not any(op.startswith(("aten::lerp_", "aten::addcmul_")) for op in sent_ops), sent_ops
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)).to(dev)
    model(torch.ones(2, 4, device=dev)).sum().backward()
    local = [p.grad.cpu() for p in model.parameters()]
    sent_ops.clear()
    total = nn.utils.clip_grad_norm_(model.parameters(), 0.5).cpu()
    assert any(op.startswith("aten::_foreach_norm") for op in sent_ops), sent_ops
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)


def test_fused_steps_queue_without_a_round_trip(dev):
    model = nn.Linear(4, 4).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    model(torch.ones(2, 4, device=dev)).sum().backward()
    opt.step()  # first step: plans made
    before = capture.meta_cache.bypasses
    for _ in range(3):
        opt.step()
    assert capture.meta_cache.bypasses == before  # none run alone on the daemon


def test_an_op_returning_nothing_runs_alone_on_the_daemon_when_unplanned(dev, monkeypatch):
    """The way any op without a meta kernel runs (reported by the daemon): for one returning
    nothing the client asked for an empty list of outputs, which the daemon refused."""
    from genie.frontend import shape_rules

    op = torch.ops.aten._fused_sgd_.default
    monkeypatch.delitem(shape_rules.RULES, id(op))
    params = [torch.ones(7, device=dev), torch.ones(3, 5, device=dev)]  # shapes no other test plans
    grads = [torch.full((7,), 2.0, device=dev), torch.full((3, 5), 2.0, device=dev)]
    before = capture.meta_cache.bypasses
    op(params, grads, [], weight_decay=0.0, momentum=0.0, lr=0.25, dampening=0.0, nesterov=False,
       maximize=False, is_first_step=True)
    assert capture.meta_cache.bypasses == before + 1
    assert all(torch.equal(p.cpu(), torch.full(p.shape, 0.5)) for p in params)
