"""Copies between the program and a daemon hold the values of the moment they were asked for,
as PyTorch's copies do. `.to(device)`: what the program writes into the source afterwards never
reaches the remote tensor (inline payloads leave with their batch, later; before, the daemon got
the source's memory as it was then: a reused buffer gave every upload its last values), and the
source is left as it was (its storage still resizable). Reads: a value read asynchronously is
the tensor's at the read, whatever later requests write into it while the answer is leaving."""
import asyncio

import pytest
import torch

import genie


def test_writes_after_an_upload_do_not_reach_it(dev):
    for n in (3, 256 * 1024, 5 * 1024 * 1024 // 4):  # a few bytes, 1 MiB, 5 MiB (inline or bulk by GENIE_BULK_MIN_KB)
        source = torch.zeros(n)
        remote = source.to(dev)
        operand = torch.zeros(n)
        summed = torch.ones(n, device=dev) + operand  # a CPU operand is uploaded the same way
        source.fill_(5)
        operand.fill_(5)
        assert torch.equal(remote.cpu(), torch.zeros(n)), n
        assert torch.equal(summed.cpu(), torch.ones(n)), n


def test_a_reused_host_buffer_gives_each_upload_its_own_values(dev):
    buffer = torch.empty(4, 4)
    uploads = []
    for step in range(6):
        buffer.fill_(step)
        uploads.append(buffer.to(dev) * 1)
    assert [u.cpu()[0, 0].item() for u in uploads] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_the_source_is_left_as_it_was(dev):
    source = torch.arange(4.0)
    source.to(dev).cpu()
    assert source.untyped_storage().resizable()  # numpy's export of it had pinned its size
    source.resize_(8)  # raised "Trying to resize storage that is not resizable"
    assert source.shape == (8,)


def test_non_blocking_uploads_of_pageable_memory_can_be_overwritten_at_once(dev):
    """CUDA's non_blocking copy from pageable (not pinned) memory has taken the bytes when it
    returns, and the common loop refills one host buffer right away (it gave every upload the
    last fill here when non_blocking borrowed the memory of any source)."""
    buffer = torch.empty(5)
    uploads = []
    for step in range(5):
        buffer.fill_(step)
        uploads.append(buffer.to(dev, non_blocking=True))
    assert [u.cpu().tolist() for u in uploads] == [[float(step)] * 5 for step in range(5)]


def test_non_blocking_uploads_are_right_after_synchronize(dev):
    source = torch.arange(8.0)
    remote = source.to(dev, non_blocking=True)  # the source's memory may leave as it is, later
    torch.remote_accelerator.synchronize()
    source.fill_(-1)
    assert torch.equal(remote.cpu(), torch.arange(8.0))
    assert genie.LazyTensor is type(remote)


def test_non_blocking_uploads_from_pinned_memory_are_right_after_synchronize(dev):
    """Pinned memory (is_pinned() on a machine without a GPU too) is lent to a non_blocking copy
    without a snapshot, as CUDA's copy reads it later: right once synchronized, as there."""
    buffer = torch.empty(6, pin_memory=True)
    assert buffer.is_pinned()
    uploads = []
    for step in range(4):
        buffer.fill_(step)
        uploads.append(buffer.to(dev, non_blocking=True))
        torch.remote_accelerator.synchronize()
    buffer.fill_(-1)
    assert [u.cpu().tolist() for u in uploads] == [[float(step)] * 6 for step in range(4)]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2)),
                                         batch_size=2, pin_memory=True)
    sums = [b.to(dev, non_blocking=True).sum() for (b,) in loader]  # each batch its own pinned tensor
    assert [s.item() for s in sums] == [6.0, 22.0, 38.0]


def test_an_async_read_is_not_changed_by_writes_queued_after_it(dev):
    n = (512 * 1024) // 4  # 0.5 MiB: an answer bigger than the socket takes at once

    async def reads():
        wrong = 0
        for _ in range(30):
            x = torch.zeros(n, device=dev)
            read = asyncio.ensure_future(genie.materialize(x))
            await asyncio.sleep(0)  # the read is sent
            for _ in range(5):
                x.add_(1)
            torch.remote_accelerator.synchronize()
            wrong += int((await read).abs().max().item() != 0)
        return wrong

    assert asyncio.run(reads()) == 0  # 8-10 of 40 such reads got later values before


@pytest.mark.parametrize("queued", [31, 63])
@pytest.mark.parametrize("layout", ["contiguous", "channels last"])
def test_an_upload_that_fills_a_batch_is_still_adopted(dev, sent_ops, queued, layout):
    """A batch goes out when its 32nd op is queued. When that op was the empty tensor of an
    upload, its copy_ came in the next batch and was run on the daemon instead of adopting the
    received bytes: a 64 MiB channels-last upload after 31 queued ops took 185-214 ms (permuted
    there and back) against 6-9 ms after none. The batch now waits one op for the copy_."""
    y = torch.ones(4, device=dev)
    torch.remote_accelerator.synchronize()
    for _ in range(queued):
        y = y + 1
    sent_ops.clear()
    x = torch.randn(2, 8, 4, 4)
    if layout == "channels last":
        x = x.contiguous(memory_format=torch.channels_last)
    r = x.to(dev)
    torch.remote_accelerator.synchronize()
    assert sent_ops.count("genie::adopt") == 1 and "aten::copy_" not in sent_ops, sent_ops
    assert r.stride() == x.stride() and torch.equal(r.cpu(), x)
    assert (y - queued).sum().item() == 4  # the queued ops ran, in order


def test_parameters_upload_as_adopted_frames_and_keep_autograd(dev, sent_ops):
    """module.to(dev) moves parameters, which require grad: they take the adopt path (the daemon
    keeps the received bytes as the tensor) like any upload, not an allocation plus a copy there
    (that path halved model upload throughput). Autograd is recorded above Genie either way."""
    layer = torch.nn.Linear(512, 512)  # a 1 MiB weight: over the bulk lane; the bias inline
    expected = [p.detach().clone() for p in layer.parameters()]
    sent_ops.clear()
    layer.to(dev)
    torch.remote_accelerator.synchronize()
    assert sent_ops.count("genie::adopt") == 2 and "aten::copy_" not in sent_ops, sent_ops
    assert all(p.requires_grad and torch.equal(p.cpu(), e) for p, e in zip(layer.parameters(), expected))
    leaf = torch.randn(3, requires_grad=True)
    (leaf.to(dev) * 2).sum().backward()
    assert torch.equal(leaf.grad, torch.full((3,), 2.0))


def test_an_upload_that_narrows_its_dtype_sends_the_smaller_elements(dev, sent_ops):
    """`x.to(dev, torch.float16)` converts on the host, as PyTorch's CPU-to-CUDA copy does, so the
    wire carries 2 bytes an element, not 4, and the daemon keeps them as received; a widening
    cast goes as the smaller source and converts there. Values as on the CPU either way, from
    pinned memory with non_blocking too, and the warning of a complex-to-real cast is the program's."""
    import warnings

    def sent_bytes():
        return sum(s["bytes_sent"] for s in genie.transport_stats().values())

    x = torch.randn(1 << 20) * 1000  # 4 MiB of float32: on the bulk lane
    torch.remote_accelerator.synchronize()
    before, _ = sent_bytes(), sent_ops.clear()
    half = x.to(dev, torch.float16)
    torch.remote_accelerator.synchronize()
    assert (2 << 20) <= sent_bytes() - before < (2 << 20) + 4096
    assert "genie::adopt" in sent_ops and "aten::copy_" not in sent_ops, sent_ops
    assert half.dtype == torch.float16 and torch.equal(half.cpu(), x.half())
    before = sent_bytes()
    widened = x.half().to(dev, torch.float64)
    assert torch.equal(widened.cpu(), x.half().double())
    assert sent_bytes() - before < (2 << 20) + 4096
    small = torch.tensor([1.5, -2.7, 300.0, 255.9])
    assert torch.equal(small.to(dev, torch.uint8).cpu(), small.to(torch.uint8))
    assert torch.equal(small.to(dev, torch.bfloat16).cpu(), small.bfloat16())
    pinned = x.pin_memory() if torch.cuda.is_available() else x
    assert torch.equal(pinned.to(dev, torch.bfloat16, non_blocking=True).cpu(), x.bfloat16())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        real = torch.tensor([1 + 2j, 3 - 1j]).to(dev, torch.float32)
    assert torch.equal(real.cpu(), torch.tensor([1.0, 3.0]))
    assert any("imaginary part" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_a_download_that_narrows_its_dtype_receives_the_smaller_elements(dev):
    """`x.to("cpu", torch.float16)` of a float32 remote tensor casts on the daemon first: half the
    bytes come back, the values those of casting on the CPU (floating narrowing rounds to nearest
    even everywhere). Casts to integers, and widening ones, happen on the CPU as before."""
    def received():
        return sum(s["bytes_received"] for s in genie.transport_stats().values())

    host = torch.randn(1 << 20) * 1000
    x = host.to(dev)
    torch.remote_accelerator.synchronize()
    before = received()
    half = x.to("cpu", torch.float16)
    assert (2 << 20) <= received() - before < (2 << 20) + 4096
    assert half.dtype == torch.float16 and half.device.type == "cpu" and torch.equal(half, host.half())
    assert torch.equal(x.to("cpu", torch.bfloat16), host.bfloat16())
    assert torch.equal(x.to("cpu", torch.int16), host.to(torch.int16))
    assert torch.equal(x.to("cpu", torch.float64), host.double())
    z = torch.randn(8, dtype=torch.complex128)
    assert torch.equal(z.to(dev).to("cpu", torch.complex64), z.to(torch.complex64))
    cl = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    back = cl.to(dev).to("cpu", torch.float16)
    assert back.stride() == cl.half().stride() and torch.equal(back, cl.half())


def _deepcopies_on(device):
    import copy

    x = torch.arange(6.0).reshape(2, 3).to(device)
    x.tag = {"step": 3}
    z = torch.tensor([1 + 2j, 3 - 1j]).to(device)
    w = torch.ones(2, device=device, requires_grad=True)
    (w * 3).sum().backward()
    c = copy.deepcopy({"x": x, "row": x[1], "col": x[:, 2], "zc": z.conj(), "zn": torch._neg_view(z), "w": w})
    c["row"].fill_(7)  # a write through one copied view shows in the copies of the others
    return x, c


def test_deepcopy_keeps_views_bits_grads_and_attributes_as_on_cpu(dev):
    """copy.deepcopy of remote tensors copies as PyTorch does: views of one storage stay views of
    one copy of it (each became its own tensor before), conjugate and negative views keep their
    values, a leaf's grad and attributes are copied, the originals are untouched."""
    x_cpu, want = _deepcopies_on("cpu")
    x, got = _deepcopies_on(dev)
    for key in ("x", "row", "col", "zc", "zn"):
        assert torch.equal(got[key].cpu(), want[key]), key
        assert (got[key].stride(), got[key].storage_offset()) == (want[key].stride(), want[key].storage_offset()), key
    assert torch.equal(x.cpu(), x_cpu) and x_cpu[1, 0] == 3
    assert got["x"].tag == {"step": 3} and got["x"].tag is not x.tag
    assert got["w"].requires_grad and got["w"].is_leaf and torch.equal(got["w"].grad.cpu(), torch.full((2,), 3.0))


def test_deepcopy_refuses_non_leaves_and_copies_parameters_as_torch_does(dev):
    import copy

    w = torch.ones(2, device=dev, requires_grad=True)
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(w * 2)
    m = torch.nn.Linear(2, 2).to(dev)
    m.weight.grad = torch.ones(2, 2, device=dev)
    c = copy.deepcopy(m)  # nn.Parameter.__deepcopy__: a clone of the data, no grad
    assert isinstance(c.weight, torch.nn.Parameter) and c.weight.requires_grad and c.weight.grad is None
    assert torch.equal(c.weight.detach().cpu(), m.weight.detach().cpu())


def test_a_deepcopys_storage_copies_are_let_go_on_the_daemon(dev):
    import copy
    import gc

    from genie.runtime import get_runtime

    link = get_runtime().stream(0).link

    def memos():
        get_runtime().stream(0).synchronize()
        return link.request("stats", {"dev": 0}).body["copy_memos"]

    before = memos()
    x = torch.arange(8.0, device=dev)
    for _ in range(5):
        c = copy.deepcopy([x, x[2:]])
        assert torch.equal(c[1].cpu(), torch.arange(2.0, 8.0))
    gc.collect()
    assert memos() == before


def test_a_cpu_tensor_that_requires_grad_is_refused_in_a_remote_op_as_on_cuda(dev):
    """A CPU tensor mixed into a remote op is sent along, but when it required grad, backward
    stopped inside PyTorch with 'opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED'
    (the gradient would come back across devices). The op now refuses, as CUDA does, saying
    how to move it; 0-dim CPU tensors (allowed with CUDA) and moved tensors keep their gradients."""
    weight = torch.full((3,), 2.0, device=dev, requires_grad=True)
    cpu = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="found at least two devices.*move it to the device first"):
        cpu * weight
    with pytest.raises(RuntimeError, match="found at least two devices"):
        torch.nn.functional.linear(weight.reshape(1, 3), cpu.reshape(1, 3))
    (cpu.to(dev) * weight).sum().backward()
    assert torch.equal(cpu.grad, torch.full((3,), 2.0)) and torch.equal(weight.grad.cpu(), torch.ones(3))
    scale = torch.tensor(3.0, requires_grad=True)
    (scale * weight).sum().backward()
    assert scale.grad.item() == 6.0
    with torch.no_grad():  # no gradient to carry: the CPU tensor's values are sent, as before
        assert torch.equal((cpu * weight).cpu(), torch.full((3,), 2.0))
    assert torch.equal((cpu.detach() * weight).detach().cpu(), torch.full((3,), 2.0))
