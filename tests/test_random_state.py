"""Random state on remote devices: seeds, saved states, and activation checkpointing with dropout.

Dropout (native_dropout) has no `generator` argument: it drew from the daemon's default generator,
so torch.manual_seed did not make it reproducible, and torch.utils.checkpoint, which found no RNG
state to save for the device, recomputed it with another mask: silently wrong gradients.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint


def test_seeded_dropout_is_reproducible(dev):
    drop = torch.nn.Dropout(0.5)
    masks = []
    for _ in range(2):
        torch.manual_seed(3)
        masks.append(drop(torch.ones(1000, device=dev)).cpu())
    assert torch.equal(*masks)
    assert 300 < int((masks[0] == 0).sum()) < 700  # it does drop


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_dropout_gives_the_same_gradients(dev, reentrant):
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5), torch.nn.ReLU()).to(dev).train()
    x0 = torch.randn(16, 64)

    def input_grad(checkpointed: bool) -> torch.Tensor:
        x = x0.to(dev).requires_grad_()
        torch.manual_seed(1)
        y = checkpoint(block, x, use_reentrant=reentrant) if checkpointed else block(x)
        y.pow(2).sum().backward()
        return x.grad.cpu()

    torch.testing.assert_close(input_grad(True), input_grad(False))


def test_rng_state_round_trip_and_fork_rng(dev):
    ra = torch.remote_accelerator
    state = ra.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    first = torch.rand(5, device=dev).cpu()
    ra.set_rng_state(state)
    assert torch.equal(torch.rand(5, device=dev).cpu(), first)
    before = ra.get_rng_state()
    with torch.random.fork_rng(device_type="remote_accelerator"):
        torch.rand(100, device=dev)
    assert torch.equal(ra.get_rng_state(), before)
    with pytest.raises(TypeError, match="uint8"):
        ra.set_rng_state(torch.zeros(3))


def test_replayed_dropout_follows_the_seed_like_op_by_op(dev):
    """A genie.graph step with dropout: replays draw from the client's generator (the daemon swaps
    it in for programs with random ops), and tracing the step on its first replay draws nothing."""
    import genie

    drop = torch.nn.Dropout(0.5)
    x, out = torch.ones(256, device=dev), torch.zeros(256, device=dev)

    def step():
        out.copy_(drop(x))

    torch.manual_seed(5)
    step()
    op_by_op = out.cpu()
    graph = genie.Graph()
    with genie.graph(graph):
        step()
    replays = []
    for _ in range(2):
        torch.manual_seed(5)
        graph.replay()  # the first one traces the step
        replays.append(out.cpu())
        graph.replay()
        replays.append(out.cpu())
    assert torch.equal(replays[0], op_by_op) and torch.equal(replays[2], op_by_op)
    assert torch.equal(replays[1], replays[3]) and not torch.equal(replays[0], replays[1])
