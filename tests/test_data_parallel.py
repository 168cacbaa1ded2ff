"""nn.DataParallel over remote devices (genie/frontend/data_parallel.py): remote_accelerator is the
current accelerator here, so DataParallel uses it; its collectives are made of ordinary ops."""
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import comm

import genie

# nn.DataParallel takes this machine's own GPUs where it has them (cuda comes first in its choice
# of device type), as without Genie: it spreads over remote_accelerator on machines without.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="DataParallel uses this machine's CUDA GPUs")

DEV = "remote_accelerator"


def _train_side_by_side(dp: nn.DataParallel, reference: nn.Module, steps: int = 3) -> list[tuple[float, float]]:
    """SGD steps of `dp` and of `reference` (on the CPU) on the same batches; their losses."""
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        out = dp(x)  # a CPU batch: DataParallel scatters it to the devices
        assert out.device == torch.device(DEV, 0)
        loss = nn.functional.cross_entropy(out, y.to(out.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return losses


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def test_data_parallel_on_one_device_moves_the_model_and_trains_as_the_cpu(dev):
    net = _net()
    reference = copy.deepcopy(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NCCL warning either
        dp = nn.DataParallel(net)
        assert dp.device_ids == list(range(torch.remote_accelerator.device_count()))
        if len(dp.device_ids) > 1:
            pytest.skip("the test daemon has more than one device")
        assert next(dp.parameters()).device == torch.device(DEV, 0)  # moved, as to cuda:0
        losses = _train_side_by_side(dp, reference)
    for loss, ref_loss in losses:
        assert loss == pytest.approx(ref_loss, abs=1e-6)
    for p, q in zip(dp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_data_parallel_over_two_daemons_trains_as_the_cpu(two_daemons):
    net = _net()
    reference = copy.deepcopy(net)
    dp = nn.DataParallel(net.to(f"{DEV}:0"))  # several devices: the model's place is the user's, as on CUDA
    assert dp.device_ids == [0, 1]
    before = genie.transport_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = _train_side_by_side(dp, reference)
    after = genie.transport_stats()
    for loss, ref_loss in losses:
        assert loss == pytest.approx(ref_loss, abs=1e-6)
    for p, q in zip(dp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    # Each daemon ran a replica: both were sent work.
    assert all(after[k]["messages_sent"] > before[k]["messages_sent"] for k in after)


def test_comm_functions_for_remote_tensors(two_daemons):
    x = torch.arange(12.0).reshape(6, 2)
    parts = comm.scatter(x, [0, 1], chunk_sizes=[4, 2])
    assert [p.device for p in parts] == [torch.device(DEV, 0), torch.device(DEV, 1)]
    assert [p.cpu().tolist() for p in parts] == [x[:4].tolist(), x[4:].tolist()]
    gathered = comm.gather(parts, 0, 1)
    assert gathered.device == torch.device(DEV, 1) and torch.equal(gathered.cpu(), x)
    assert torch.equal(comm.gather(parts, 0, "cpu"), x)
    a = torch.ones(3, device=f"{DEV}:0")
    b0, b1 = comm.broadcast(a, [0, 1])
    assert b1.device == torch.device(DEV, 1) and b1.cpu().tolist() == [1.0] * 3
    (c0, d0), (c1, d1) = comm.broadcast_coalesced([a, a * 2], [0, 1])
    assert c0 is a and d1.device == torch.device(DEV, 1) and d1.cpu().tolist() == [2.0] * 3
    with pytest.raises(RuntimeError, match="devices\\[0\\]"):
        comm.broadcast_coalesced([b1], [0, 1])
    total = comm.reduce_add([b0, b1 * 3], destination=1)
    assert total.device == torch.device(DEV, 1) and total.cpu().tolist() == [4.0] * 3
    summed = comm.reduce_add_coalesced([[a, a * 2], [b1, b1]], destination=0)
    assert [t.cpu().tolist() for t in summed] == [[2.0] * 3, [3.0] * 3]
