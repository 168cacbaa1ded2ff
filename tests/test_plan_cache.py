"""The client's plan cache: keyed so that a training loop's changing numbers reuse plans."""
from __future__ import annotations

import torch
from torch import nn

import genie


def _train(device, steps, stats_after=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # bias corrections change every step
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)  # so does the learning rate
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 1])
    losses, before = [], None
    for step in range(steps):
        if step == stats_after:
            before = dict(genie.capture_stats())
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach())
    return [float(l) for l in losses], before


def test_an_optimizers_changing_step_sizes_reuse_cached_plans(dev, reference):
    remote, before = _train(dev, 30, stats_after=10)
    after = genie.capture_stats()
    assert after["misses"] - before["misses"] == 0  # 12 per step when keyed by the numbers' values
    assert after["size"] == before["size"]
    local, _ = _train(reference, 30)  # the daemon's kind of device: the same kernels
    assert remote == local


def test_numbers_keep_their_type_in_keys_and_their_value_where_it_shapes(dev):
    ints = torch.arange(6).reshape(2, 3)
    remote = ints.to(dev)
    for scalar in (1, 2.5, True, 3, 0.5, False):  # type promotion follows the number's type
        for got, want in ((remote + scalar, ints + scalar), (remote * scalar, ints * scalar),
                          (remote.masked_fill(remote > 2, scalar), ints.masked_fill(ints > 2, scalar))):
            assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    for i in range(3):  # where a number decides shape or place, it stays in the key
        assert torch.equal(remote.select(1, i).cpu(), ints.select(1, i))
        assert torch.equal(remote.narrow(1, i, 3 - i).cpu(), ints.narrow(1, i, 3 - i))
        assert torch.equal(torch.full_like(remote, i * 1.5).cpu(), torch.full_like(ints, i * 1.5))
