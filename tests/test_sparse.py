"""Sparse COO tensors on a remote device (genie/frontend/sparse_coo.py): remote indices and
values, each op written in dense ops. Everything is compared with the same code on the CPU."""
import copy
import itertools
import re

import pytest
import torch

from genie.errors import UnsupportedOperationError

I = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])
V = torch.tensor([1.0, 2.0, 3.0, 4.0])


def _cpu():
    return torch.sparse_coo_tensor(I, V, (2, 3))


def _same(got, want):
    """Same sparse tensor as the CPU's: flags, indices and values (or dense values)."""
    assert got.device.type == "remote_accelerator" and got.is_sparse and got.layout == torch.sparse_coo
    back = got.cpu()
    assert back.is_sparse and back.is_coalesced() == want.is_coalesced() and back.shape == want.shape
    if want.is_coalesced():
        assert torch.equal(back.indices(), want.indices())
        torch.testing.assert_close(back.values(), want.values())
    torch.testing.assert_close(back.to_dense(), want.to_dense())


def test_made_moved_and_read_like_cpu(dev):
    _same(torch.sparse_coo_tensor(I.to(dev), V.to(dev), (2, 3)), _cpu())
    _same(_cpu().to(dev), _cpu())
    _same(_cpu().to(dev).coalesce(), _cpu().coalesce())
    _same(_cpu().to(dev).double(), _cpu().double())
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])
    _same(dense.to(dev).to_sparse(), dense.to_sparse())
    hybrid = torch.tensor([[[0.0, 0.0], [1.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[3.0, 4.0], [0.0, 0.0]]])
    _same(hybrid.to(dev).to_sparse(2), hybrid.to_sparse(2))  # values of (nnz, 2)
    remote = _cpu().to(dev)
    assert remote._nnz() == 4 and remote.sparse_dim() == 2 and remote.dense_dim() == 0 and not remote.is_coalesced()
    with pytest.raises(RuntimeError, match=re.escape("Cannot get indices on an uncoalesced tensor")):
        remote.indices()
    assert torch.equal(remote._indices().cpu(), I) and torch.equal(remote._values().cpu(), V)
    assert "layout=torch.sparse_coo, device='remote_accelerator:0'" in repr(remote)


def test_arithmetic_like_cpu(dev):
    cpu, remote = _cpu(), _cpu().to(dev)
    dense = torch.randn(2, 3)
    torch.testing.assert_close((dense.to(dev) + remote).cpu(), dense + cpu)
    torch.testing.assert_close((dense.to(dev) - remote).cpu(), dense - cpu)
    in_place = dense.to(dev)
    in_place.add_(remote, alpha=-0.5)
    torch.testing.assert_close(in_place.cpu(), dense.clone().add_(cpu, alpha=-0.5))
    torch.testing.assert_close((remote + remote).to_dense().cpu(), (cpu + cpu).to_dense())
    _same(remote * 3, cpu * 3)
    _same(remote / 2, cpu / 2)
    _same(-remote, -cpu)
    _same(remote * dense.to(dev), cpu * dense)  # elementwise by a dense tensor: sparse, as on the CPU
    _same(dense[0].to(dev) * remote, dense[0] * cpu)
    _same(dense.to(dev).sparse_mask(remote.coalesce()), dense.sparse_mask(cpu.coalesce()))
    torch.testing.assert_close(torch.sparse.sum(remote).cpu(), torch.sparse.sum(cpu))
    torch.testing.assert_close(remote.t().to_dense().cpu(), cpu.t().to_dense())
    remote.zero_()
    assert remote._nnz() == 0 and remote.to_dense().abs().sum().item() == 0


def test_sparse_times_dense_and_its_gradient_like_cpu(dev):
    cpu = _cpu()
    d = torch.randn(3, 4, requires_grad=True)
    dr = d.detach().to(dev).requires_grad_()
    for f in (torch.sparse.mm, torch.mm, torch.matmul, lambda a, b: a @ b):
        torch.testing.assert_close(f(cpu.to(dev), dr).cpu(), f(cpu, d))
    torch.sparse.mm(cpu, d).pow(2).sum().backward()
    torch.sparse.mm(cpu.to(dev), dr).pow(2).sum().backward()
    torch.testing.assert_close(dr.grad.cpu(), d.grad)
    bias = torch.randn(2, 4)
    torch.testing.assert_close(torch.addmm(bias.to(dev), cpu.to(dev), dr, beta=0.5, alpha=2).cpu(),
                               torch.addmm(bias, cpu, d, beta=0.5, alpha=2))


@pytest.mark.parametrize("optimizer,options", [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1}),
                                               (torch.optim.SparseAdam, {"lr": 0.05})])
def test_sparse_embedding_training_like_cpu(dev, optimizer, options):
    """nn.Embedding(sparse=True): sparse gradients on the device (accumulated over two backward
    passes), and the optimizers that take them give the CPU's weights."""
    torch.manual_seed(0)
    cpu = torch.nn.Embedding(10, 3, sparse=True)
    remote = copy.deepcopy(cpu).to(dev)
    steps = [(cpu, optimizer(cpu.parameters(), **options), lambda t: t),
             (remote, optimizer(remote.parameters(), **options), lambda t: t.to(dev))]
    for step in range(3):
        ids = (torch.tensor([[1, 2, 2, 5], [4, 3, 2, 9]]) + step) % 10
        for model, opt, where in steps:
            opt.zero_grad()
            for half in ids:
                (model(where(half)) ** 2).sum().backward()
            if step == 2:
                assert model.weight.grad.is_sparse
            opt.step()
    torch.testing.assert_close(remote.weight.detach().cpu(), cpu.weight.detach(), atol=1e-6, rtol=1e-5)
    assert remote.weight.grad.device.type == "remote_accelerator"
    torch.testing.assert_close(remote.weight.grad.to_dense().cpu(), cpu.weight.grad.to_dense())


def test_embedding_bag_every_mode_like_cpu(dev):
    """nn.EmbeddingBag, dense and sparse gradients: outputs and gradients equal the CPU's. A CPU
    daemon gives the auxiliary results CUDA's sizes, as the client plans them (daemon/cuda_parity.py):
    before, the sparse backward read an empty offset2bag."""
    for mode, last, weighted, pad, sparse in itertools.product(["sum", "mean", "max"], [False, True], [False, True],
                                                               [None, 2], [False, True]):
        if (weighted and mode != "sum") or (sparse and mode == "max"):
            continue
        torch.manual_seed(0)
        cpu = torch.nn.EmbeddingBag(10, 3, mode=mode, include_last_offset=last, padding_idx=pad, sparse=sparse)
        remote = copy.deepcopy(cpu).to(dev)
        ids, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 8] if last else [0, 3])
        weights = torch.rand(8) if weighted else None
        want = cpu(ids, offsets, per_sample_weights=weights)
        got = remote(ids.to(dev), offsets.to(dev), per_sample_weights=weights.to(dev) if weighted else None)
        torch.testing.assert_close(got.cpu(), want)
        scale = torch.arange(want.numel(), dtype=torch.float32).view(want.shape)
        (want * scale).sum().backward()
        (got * scale.to(dev)).sum().backward()
        assert remote.weight.grad.is_sparse == sparse
        torch.testing.assert_close(remote.weight.grad.to_dense().cpu(), cpu.weight.grad.to_dense())


def test_other_ops_are_refused_by_name(dev):
    remote = _cpu().to(dev)
    with pytest.raises(UnsupportedOperationError, match=r"aten::exp .*to_dense\(\)"):
        remote.exp()
    assert (torch.ones(2, device=dev) * 2).tolist() == [2.0, 2.0]  # nothing reached the daemon


def test_gradients_of_values_and_checkpoints_like_cpu(dev):
    """Gradients reach the values a sparse tensor was made of (through mm and to_dense); torch.save
    writes a remote sparse tensor as a CPU one (as remote tensors are saved), and map_location
    brings a CPU one onto the device."""
    import io

    grads = []
    for where in ("cpu", dev):
        v = V.clone().to(where).requires_grad_()
        s = torch.sparse_coo_tensor(I.to(where), v, (2, 3))
        (torch.sparse.mm(s, torch.ones(3, 2, device=where)).sum() + (s.to_dense() * 3).sum()).backward()
        grads.append(v.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])
    saved = io.BytesIO()
    torch.save({"remote": _cpu().to(dev), "cpu": _cpu()}, saved)
    saved.seek(0)
    loaded = torch.load(saved)
    assert loaded["remote"].is_sparse and loaded["remote"].device.type == "cpu"
    torch.testing.assert_close(loaded["remote"].to_dense(), _cpu().to_dense())
    saved.seek(0)
    _same(torch.load(saved, map_location=dev)["cpu"], _cpu())


def test_materialize_and_reads_fetch_indices_and_values_together(dev, monkeypatch):
    """genie.materialize / materialize_sync accept sparse tensors beside dense ones (refused before:
    'expected a remote_accelerator tensor'), and `.cpu()` fetches indices and values in one request."""
    import asyncio

    import genie

    remote, dense = _cpu().to(dev), torch.ones(2, device=dev)
    got = genie.materialize_sync([dense, remote])
    assert torch.equal(got[0], torch.ones(2))
    assert got[1].is_sparse and got[1].device.type == "cpu"
    torch.testing.assert_close(got[1].to_dense(), _cpu().to_dense())

    async def both():
        return await genie.materialize([remote, dense])

    torch.testing.assert_close(asyncio.run(both())[0].to_dense(), _cpu().to_dense())
    from genie.runtime.stream import DeviceStream

    fetched: list = []
    fetch = DeviceStream.fetch_async

    def spy(self, ids, *args, **kwargs):
        fetched.append(list(ids))
        return fetch(self, ids, *args, **kwargs)

    monkeypatch.setattr(DeviceStream, "fetch_async", spy)
    remote.cpu()
    assert len(fetched) == 1 and len(fetched[0]) == 2  # indices and values, one request


DENSE = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0]])


def test_csr_matrices_like_cpu(dev):
    """2-D sparse CSR matrices (genie/frontend/sparse_csr.py; refused before): made from dense or COO
    tensors on the device, moved there, read back, and multiplied with dense matrices, gradient
    included; transposes are CSC, as on the CPU."""
    csr = DENSE.to_sparse_csr()
    for made in (DENSE.to(dev).to_sparse_csr(), DENSE.to_sparse().to(dev).to_sparse_csr(), csr.to(dev),
                 torch.sparse_csr_tensor(csr.crow_indices().to(dev), csr.col_indices().to(dev), csr.values().to(dev),
                                         (4, 3))):
        assert made.layout == torch.sparse_csr and made.device.type == "remote_accelerator"
        back = made.cpu()
        assert back.layout == torch.sparse_csr
        for part in ("crow_indices", "col_indices", "values"):
            assert torch.equal(getattr(back, part)(), getattr(csr, part)()), part
        assert torch.equal(made.to_dense().cpu(), DENSE)
    remote = csr.to(dev)
    assert torch.equal(remote.to_sparse().cpu().to_dense(), DENSE) and remote._nnz() == 4
    assert remote.t().layout == csr.t().layout == torch.sparse_csc
    assert torch.equal(remote.t().to_dense().cpu(), DENSE.t())
    assert torch.equal((remote * 2).to_dense().cpu(), DENSE * 2)
    x = torch.randn(3, 2, requires_grad=True)
    xr = x.detach().to(dev).requires_grad_()
    torch.testing.assert_close((remote @ xr).cpu(), csr @ x)
    torch.sparse.mm(csr, x).pow(2).sum().backward()
    torch.sparse.mm(remote, xr).pow(2).sum().backward()
    torch.testing.assert_close(xr.grad.cpu(), x.grad)
    with pytest.raises(UnsupportedOperationError, match=r"aten::exp .*to_dense\(\)"):
        remote.exp()


def test_csc_matrices_like_cpu(dev):
    """2-D sparse CSC matrices (refused before): the CSR parts of their transpose, made from dense or
    COO tensors on the device, moved there, read back part for part, transposed to CSR (and CSR to
    CSC), converted, scaled, summed, and multiplied with dense matrices either side, gradients of
    both operands included (the CPU's CSC gradient of a product is dense too)."""
    csc = DENSE.to_sparse_csc()
    for made in (DENSE.to(dev).to_sparse_csc(), DENSE.to_sparse().to(dev).to_sparse_csc(), csc.to(dev),
                 torch.sparse_csc_tensor(csc.ccol_indices().to(dev), csc.row_indices().to(dev), csc.values().to(dev),
                                         (4, 3)),
                 torch.sparse_csc_tensor(csc.ccol_indices().to(dev), csc.row_indices().to(dev), csc.values().to(dev)),
                 DENSE.to_sparse_csr().to(dev).t().t().to_sparse_csc()):
        assert made.layout == torch.sparse_csc and made.device.type == "remote_accelerator"
        back = made.cpu()
        assert back.layout == torch.sparse_csc and back.shape == csc.shape
        for part in ("ccol_indices", "row_indices", "values"):
            assert torch.equal(getattr(back, part)(), getattr(csc, part)()), part
        assert torch.equal(made.to_dense().cpu(), DENSE)
    remote = csc.to(dev)
    assert remote._nnz() == 4 and remote.sum().item() == DENSE.sum().item()
    assert remote.t().layout == csc.t().layout == torch.sparse_csr
    assert torch.equal(remote.t().cpu().to_dense(), DENSE.t())
    assert torch.equal(remote.to_sparse().cpu().to_dense(), DENSE)
    assert remote.to_sparse_csr().layout == torch.sparse_csr
    assert torch.equal(remote.to_sparse_csr().cpu().col_indices(), DENSE.to_sparse_csr().col_indices())
    assert torch.equal((remote * 2).to_dense().cpu(), DENSE * 2)
    x = torch.randn(3, 2)
    y = torch.randn(5, 4)
    torch.testing.assert_close((remote @ x.to(dev)).cpu(), csc @ x)
    torch.testing.assert_close((y.to(dev) @ remote).cpu(), y @ csc)
    torch.testing.assert_close(torch.addmm(torch.ones(4, 2).to(dev), remote, x.to(dev), beta=0.5).cpu(),
                               torch.addmm(torch.ones(4, 2), csc, x, beta=0.5))
    local = [csc.clone().requires_grad_(), x.clone().requires_grad_()]
    on_dev = [csc.to(dev).requires_grad_(), x.to(dev).requires_grad_()]
    for s, d in (local, on_dev):
        (s @ d).pow(2).sum().backward()  # (the CPU refuses torch.sparse.mm's backward for CSC)
    for mine, theirs in zip(on_dev, local):
        assert mine.grad.layout == theirs.grad.layout
        torch.testing.assert_close(mine.grad.cpu().to_dense(), theirs.grad.to_dense())
    local = [y.clone().requires_grad_(), csc.clone().requires_grad_()]  # dense @ CSC
    on_dev = [y.to(dev).requires_grad_(), csc.to(dev).requires_grad_()]
    for d, s in (local, on_dev):
        (d @ s).pow(2).sum().backward()
    for mine, theirs in zip(on_dev, local):
        assert mine.grad.layout == theirs.grad.layout
        torch.testing.assert_close(mine.grad.cpu().to_dense(), theirs.grad.to_dense())
    with pytest.raises(UnsupportedOperationError, match=r"aten::exp .*to_dense\(\)"):
        remote.exp()


@pytest.mark.parametrize("layout", [torch.sparse_bsr, torch.sparse_bsc], ids=["BSR", "BSC"])
def test_block_sparse_matrices_like_cpu(dev, layout):
    """2-D BSR and BSC matrices (refused before): made from dense, COO or CSR tensors on the device,
    from their parts (size given or inferred), moved there, read back part for part, transposed
    (BSR <-> BSC, blocks transposed), converted, scaled, summed, and multiplied with dense
    matrices; a BSR operand's gradient as the CPU's."""
    torch.manual_seed(0)
    dense = torch.zeros(4, 6)
    dense[0:2, 2:4], dense[2:4, 0:2], dense[2:4, 4:6] = torch.randn(2, 2), torch.randn(2, 2), 1.0
    dense[3, 5] = 0.0  # a zero inside a stored block stays stored
    cpu = dense.to_sparse(layout=layout, blocksize=(2, 2))
    names = ("crow_indices", "col_indices") if layout == torch.sparse_bsr else ("ccol_indices", "row_indices")
    make = torch.sparse_bsr_tensor if layout == torch.sparse_bsr else torch.sparse_bsc_tensor
    parts = [getattr(cpu, n)() for n in names] + [cpu.values()]
    for made in (dense.to(dev).to_sparse(layout=layout, blocksize=(2, 2)), cpu.to(dev),
                 make(*(p.to(dev) for p in parts), (4, 6)), make(*(p.to(dev) for p in parts)),
                 dense.to_sparse().to(dev).to_sparse(layout=layout, blocksize=(2, 2)),
                 dense.to_sparse_csr().to(dev).to_sparse(layout=layout, blocksize=(2, 2)),
                 cpu.to(dev).t().t()):
        assert made.layout == layout and made.device.type == "remote_accelerator"
        back = made.cpu()
        assert back.layout == layout and back.shape == cpu.shape
        for name, mine, theirs in zip((*names, "values"), [getattr(back, n)() for n in names] + [back.values()], parts):
            assert torch.equal(mine, theirs), name
        assert torch.equal(made.to_dense().cpu(), dense)
    remote = cpu.to(dev)
    assert remote._nnz() == cpu._nnz() == 3 and remote.sum().item() == pytest.approx(cpu.sum().item())
    assert remote.t().layout == cpu.t().layout and torch.equal(remote.t().to_dense().cpu(), dense.t())
    assert torch.equal((remote * 2).to_dense().cpu(), dense * 2)
    assert torch.equal(remote.to_sparse().to_dense().cpu(), dense)
    assert torch.equal(remote.to_sparse_csr().cpu().to_dense(), dense)
    x = torch.randn(6, 3)
    torch.testing.assert_close((remote @ x.to(dev)).cpu(), dense @ x)
    if layout == torch.sparse_bsr:  # (the CPU multiplies only BSR @ dense)
        torch.testing.assert_close((remote @ x.to(dev)).cpu(), cpu @ x)
        local, on_dev = cpu.clone().requires_grad_(), cpu.to(dev).requires_grad_()
        (local @ x).pow(2).sum().backward()
        (on_dev @ x.to(dev)).pow(2).sum().backward()
        assert on_dev.grad.layout == local.grad.layout
        torch.testing.assert_close(on_dev.grad.cpu().to_dense(), local.grad.to_dense())
    with pytest.raises(RuntimeError, match="divisible"):
        torch.randn(4, 5).to(dev).to_sparse(layout=layout, blocksize=(2, 2))
    with pytest.raises(UnsupportedOperationError, match=r"aten::exp .*to_dense\(\)"):
        remote.exp()


def test_csr_reductions_and_sampled_products_like_cpu(dev):
    """torch.sparse.mm(csr, dense, reduce) (PyTorch Geometric's aggregation) and
    torch.sparse.sampled_addmm were refused by name; now the CPU's values, and the CPU's
    gradients of both operands for every reduction."""
    csr = DENSE.to_sparse_csr()  # a row without entries included
    other = torch.randn(3, 5)
    for reduce in ("sum", "mean", "amax", "amin"):
        torch.testing.assert_close(torch.sparse.mm(csr.to(dev), other.to(dev), reduce).cpu(),
                                   torch.sparse.mm(csr, other, reduce))
    for reduce in ("sum", "mean", "amax", "amin"):
        local = [csr.clone().requires_grad_(), other.clone().requires_grad_()]
        remote = [t.detach().to(dev).requires_grad_() for t in local]
        for a, b in (local, remote):
            torch.sparse.mm(a, b, reduce).pow(2).sum().backward()
        torch.testing.assert_close(remote[1].grad.cpu(), local[1].grad)
        torch.testing.assert_close(remote[0].grad.cpu().to_dense(), local[0].grad.to_dense())
    ties = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]]).to_sparse_csr()  # equal products: the first one wins
    tied = torch.tensor([[1.0, 5.0], [1.0, 5.0], [0.5, 5.0]])
    for reduce in ("amax", "amin"):
        local = [ties.clone().requires_grad_(), tied.clone().requires_grad_()]
        remote = [t.detach().to(dev).requires_grad_() for t in local]
        for a, b in (local, remote):
            torch.sparse.mm(a, b, reduce).sum().backward()
        torch.testing.assert_close(remote[1].grad.cpu(), local[1].grad)
        torch.testing.assert_close(remote[0].grad.cpu().to_dense(), local[0].grad.to_dense())
    mat1, mat2 = torch.randn(4, 6), torch.randn(6, 3)
    got = torch.sparse.sampled_addmm(csr.to(dev), mat1.to(dev), mat2.to(dev), beta=0.5, alpha=2.0)
    expected = torch.sparse.sampled_addmm(csr, mat1, mat2, beta=0.5, alpha=2.0)
    assert got.layout == torch.sparse_csr
    torch.testing.assert_close(got.cpu().to_dense(), expected.to_dense())
    # Its gradients (they take dense @ sparse and a sparse CSR sparse_mask), and to_dense's.
    local = [csr.clone().requires_grad_(), mat1.clone().requires_grad_(), mat2.clone().requires_grad_()]
    remote = [t.detach().to(dev).requires_grad_() for t in local]
    for s, a, b in (local, remote):
        torch.sparse.sampled_addmm(s, a, b).to_dense().pow(2).sum().backward()
    for r, c in zip(remote, local):
        torch.testing.assert_close(r.grad.cpu().to_dense(), c.grad.to_dense())
    assert remote[0].grad.layout == torch.sparse_csr


def test_dense_times_sparse_and_conversions_like_cpu(dev):
    """dense @ sparse (COO and CSR) gives a dense matrix, as on the CPU (refused before: only
    sparse @ dense); dense.to_sparse(layout=torch.sparse_csr)."""
    left = torch.randn(5, 4)
    for sparse in (DENSE.to_sparse(), DENSE.to_sparse_csr()):
        for product in (lambda a, b: a @ b, torch.mm):
            got = product(left.to(dev), sparse.to(dev))
            assert got.layout == torch.strided
            torch.testing.assert_close(got.cpu(), left @ DENSE)
    made = DENSE.to(dev).to_sparse(layout=torch.sparse_csr)
    assert made.layout == torch.sparse_csr and torch.equal(made.cpu().to_dense(), DENSE)
