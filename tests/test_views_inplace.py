"""Views and in-place ops are exactly right: the daemon replays them in program order."""
import pytest
import torch
from outcomes import outcome


def both(dev, fn):
    """Run `fn` on a CPU tensor and on a remote copy; return both results on the CPU."""
    base = torch.arange(24.0).reshape(4, 6)
    local = fn(base.clone())
    remote = fn(base.clone().to(dev))
    return local, remote.cpu()


def test_write_through_view(dev):
    def fn(x):
        x[1].mul_(10)
        return x
    a, b = both(dev, fn)
    assert torch.equal(a, b)


def test_setitem_scalar_and_tensor(dev):
    def fn(x):
        x[0, 2] = 7
        x[2] = torch.full((6,), -1.0, device=x.device)
        x[:, 3] += 1
        x[x > 20] = 0
        return x
    a, b = both(dev, fn)
    assert torch.equal(a, b)


def test_chains_of_views_alias(dev):
    def fn(x):
        v = x.view(2, 12)[:, 3:9].reshape(2, 2, 3).transpose(0, 2)
        v.add_(100)
        d = x.diagonal()
        d.zero_()
        x.t()[1].neg_()
        return x
    a, b = both(dev, fn)
    assert torch.equal(a, b)


def test_inplace_view_ops_update_metadata(dev):
    x = torch.zeros(2, 3, device=dev)
    x.t_()
    assert x.shape == (3, 2)
    x.unsqueeze_(0)
    assert x.shape == (1, 3, 2)
    x.squeeze_()
    assert x.shape == (3, 2)
    assert x.cpu().shape == (3, 2)


def test_inplace_returns_same_object(dev):
    x = torch.ones(3, device=dev)
    assert x.add_(1) is x
    out = torch.empty(3, device=dev)
    r = torch.add(x, 1, out=out)
    assert r is out
    assert torch.equal(out.cpu(), torch.full((3,), 3.0))


def test_out_resize(dev):
    out = torch.empty(0, device=dev)
    torch.mul(torch.ones(5, device=dev), 2, out=out)
    assert out.shape == (5,)
    assert torch.equal(out.cpu(), torch.full((5,), 2.0))


def test_views_of_a_freed_base_stay_valid(dev):
    x = torch.arange(10.0, device=dev)
    v = x[2:5]
    del x
    assert torch.equal(v.cpu(), torch.tensor([2.0, 3.0, 4.0]))


def test_clone_is_independent(dev):
    x = torch.ones(4, device=dev)
    y = x.clone()
    x.mul_(3)
    assert torch.equal(y.cpu(), torch.ones(4))
    assert torch.equal(x.cpu(), torch.full((4,), 3.0))


def test_split_unbind_chunk(dev):
    x = torch.arange(12.0).reshape(3, 4)
    r = x.to(dev)
    for a, b in zip(x.split([1, 2]), r.split([1, 2])):
        assert torch.equal(a, b.cpu())
    for a, b in zip(x.unbind(1), r.unbind(1)):
        assert torch.equal(a, b.cpu())
    for a, b in zip(x.chunk(2, dim=1), r.chunk(2, dim=1)):
        assert torch.equal(a, b.cpu())


def _set_cases(d):
    """t.set_(source) as PyTorch does it: each case's values, geometry, or error."""
    a = torch.arange(6.0).to(d)
    b = torch.zeros(100).to(d)
    b.set_(a)  # b now names a's storage, whatever its own was
    b.mul_(2)
    a.add_(1)
    view = torch.empty(0).to(d)
    view.set_(a.as_strided((2, 2), (1, 2), 2))  # a view at an offset, with its strides
    t = torch.zeros(2).to(d)
    version = t._version
    t.set_(a.reshape(2, 3).t())
    return {
        "a": a.cpu().tolist(), "b": b.cpu().tolist(), "b geometry": (b.shape, b.stride(), b.untyped_storage().nbytes()),
        "view": view.cpu().tolist(), "view geometry": (view.storage_offset(), view.stride()),
        "t": t.cpu().tolist(), "t geometry": (t.stride(), t.is_contiguous(), t._version - version),
        "dtype": outcome(lambda: torch.empty(0, dtype=torch.float64).to(d).set_(a)),
    }


def test_set_points_a_tensor_at_another_ones_storage(dev):
    """`t.set_(source)` was refused ("aten::set_ is not allowed on a daemon"): t now becomes a
    view of source's storage on the daemon, as on the CPU (writes through either are seen by both)."""
    assert _set_cases(dev) == _set_cases("cpu")
    with pytest.raises(RuntimeError, match="devices must match"):
        torch.empty(0).to(dev).set_(torch.arange(6.0))


def _storage_cases(d):
    """Reading and re-viewing a tensor's storage, as PyTorch does it."""
    t = torch.arange(6.0).to(d)
    view = t[2:]
    s = view.untyped_storage()
    strided = torch.empty(0).to(d).set_(t.untyped_storage(), 1, (2, 2), (2, 1))
    strided.mul_(10)  # writes through to t
    reread = torch.empty(0, dtype=torch.int32).to(d).set_(t.untyped_storage())  # the same bytes as int32
    orphan = t[1:3].storage()  # its tensor is gone at once; the storage still reads
    return {
        "storage values": view.storage().tolist(), "element": t.storage()[4], "bytes": bytes(s)[:8],
        "untyped": s.tolist()[:8], "nbytes": s.nbytes(), "as floats": s.float().tolist()[:8],
        "strided": strided.cpu().tolist(), "t after": t.cpu().tolist(),
        "reinterpreted": reread.cpu().tolist(), "orphan": orphan.tolist(),
    }


def test_a_remote_tensors_storage_reads_and_can_be_viewed(dev):
    """`storage.tolist()`, `storage[i]`, `bytes(storage)`, `.float()` and `t.set_(storage, offset,
    size, stride)` were refused: torch reads a storage through a tensor pointed at it (`set_`),
    and a storage object named no remote tensor. The storages a remote tensor hands out now
    name its daemon tensor (and keep it alive, as a CPU storage keeps its memory)."""
    from genie.errors import UnsupportedOperationError

    assert _storage_cases(dev) == _storage_cases("cpu")
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 24"):
        torch.empty(0).to(dev).set_(torch.arange(6.0).to(dev).untyped_storage(), 3, (2, 2), (2, 1))
    with pytest.raises(UnsupportedOperationError, match="storage of its device"):
        torch.empty(0).to(dev).set_(torch.arange(6.0).untyped_storage())  # a CPU storage


def test_dtype_rules_checked_by_kernels_raise_at_the_call(dev):
    """int_tensor.mul_(0.5), float32 @ float64, ...: PyTorch's meta kernels skip these checks, so
    the daemon refused the op at the next read, far from the line at fault; the CPU and CUDA
    raise at the call."""
    for make, other in ((lambda d: torch.arange(4, device=d), 0.5),
                        (lambda d: torch.ones(2, device=d), lambda d: torch.ones(2, dtype=torch.complex64, device=d))):
        with pytest.raises(RuntimeError, match="can't be cast to the desired output type") as on_cpu:
            make("cpu").mul_(other("cpu") if callable(other) else other)
        x = make(dev)
        with pytest.raises(RuntimeError, match="can't be cast to the desired output type") as remote:
            x.mul_(other(dev) if callable(other) else other)
        assert str(remote.value) == str(on_cpu.value)
        assert torch.equal(x.cpu(), make("cpu"))  # unchanged, and the device still usable
    # Other dtype rules PyTorch checks in kernels, not meta kernels: raised at the call as well.
    for refused in (lambda d: torch.ones(2, 2, device=d) @ torch.ones(2, 2, dtype=torch.float64, device=d),
                    lambda d: torch.ones(2, device=d).masked_fill_(torch.ones(2, device=d), 0),
                    lambda d: torch.zeros(3, device=d).index_add_(0, torch.tensor([0], device=d),
                                                                  torch.ones(1, dtype=torch.float64, device=d)),
                    lambda d: torch.arange(1, 4, device=d).pow(-1)):
        with pytest.raises(RuntimeError) as on_cpu:
            refused("cpu")
        with pytest.raises(RuntimeError) as remote:
            refused(dev)
        assert str(remote.value) == str(on_cpu.value)
    # A kernel missing for a dtype: the CPU daemon's kernels are the CPU's, so its refusal is
    # known at the call too (before, it came at the next read).
    for refused in (lambda d: torch.ones(2, dtype=torch.complex64, device=d) < 1,
                    lambda d: torch.ones(2, device=d) & 1):
        with pytest.raises(NotImplementedError) as on_cpu:
            refused("cpu")
        with pytest.raises(NotImplementedError) as remote:
            refused(dev)
        assert str(remote.value) == str(on_cpu.value)
    # What type promotion allows still runs, with the CPU's values.
    for make in (lambda d: torch.ones(2, device=d).add_(torch.full((), 2.5, dtype=torch.float64, device=d)),
                 lambda d: torch.ones(2, dtype=torch.int32, device=d).add_(torch.tensor(3)),
                 lambda d: torch.ones(2, dtype=torch.half, device=d).mul_(2.5)):
        assert torch.equal(make(dev).cpu(), make("cpu"))


def _waits():
    import genie

    return sum(v["blocking_waits"] for v in genie.transport_stats().values())


def test_data_ptr_relations_are_the_cpus(dev):
    # Programs compare data_ptr() to tell a view from a copy; a remote tensor's is a stand-in with
    # the same relations as CPU addresses (before: its offset alone, so any two compared equal).
    def relations(device):
        t = torch.arange(12.0, device=device).reshape(3, 4)
        other = torch.arange(12.0, device=device)
        same = [t.view(-1), t.reshape(12), t.contiguous(), t.add_(1), t[0], t.detach()]
        moved = [(t[1], 4), (t[:, 2], 2), (t.view(-1)[-1], 11), (t.t()[1], 1)]
        return ([x.data_ptr() == t.data_ptr() for x in same],
                [x.data_ptr() - t.data_ptr() == k * t.element_size() for x, k in moved],
                [x.data_ptr() != t.data_ptr() for x in (other, t.clone(), t.t().contiguous(), t.float().double())],
                torch.empty(0, device=device).data_ptr() == 0)

    cpu, remote = relations("cpu"), relations(dev)
    assert cpu == remote and all(all(x) if isinstance(x, list) else x for x in remote)


def test_storage_identity_relations_are_the_cpus(dev):
    # untyped_storage().data_ptr() names a storage (safetensors and Hugging Face find shared and
    # tied tensors by it; safetensors' save_model wants data_ptr() == it for a whole tensor).
    # Remote tensors answer from storages tracked here, with the CPU's relations and no wait.
    import copy
    import io

    def relations(device):
        t = torch.arange(12.0, device=device).reshape(3, 4)
        p = torch.nn.Parameter(torch.zeros(4, device=device))
        p.data = t[1]  # p now shares t's storage
        target = torch.zeros(2, device=device)
        target.set_(t)
        copies = copy.deepcopy([t, t[1:], t.clone()])
        buf = io.BytesIO()
        values = t.cpu()
        torch.save({"t": values, "row": values[2]}, buf)
        buf.seek(0)
        loaded = torch.load(buf, map_location=device)
        first, *parts = t.split(2, dim=1)
        storage = t.untyped_storage().data_ptr
        shared = [x.untyped_storage().data_ptr() == storage() for x in
                  (t.view(-1), t[1:], t.detach(), t.t(), p, target, first, *parts, t.unbind(0)[2])]
        apart = [x.untyped_storage().data_ptr() != storage() for x in
                 (t.clone(), t + 0, torch.arange(12.0, device=device), *copies)]
        whole = [x.data_ptr() == x.untyped_storage().data_ptr() for x in (t, t.view(-1), t.t())]
        offset = [t[1:].data_ptr() - storage() == 4 * t.element_size(), p.data_ptr() - storage() == 16]
        kept = [copies[0].untyped_storage().data_ptr() == copies[1].untyped_storage().data_ptr(),
                copies[0].untyped_storage().data_ptr() != copies[2].untyped_storage().data_ptr(),
                loaded["t"].untyped_storage().data_ptr() == loaded["row"].untyped_storage().data_ptr()]
        return shared, apart, whole, offset, kept, torch.empty(0, device=device).untyped_storage().data_ptr() == 0

    cpu = relations("cpu")
    before = _waits()
    remote = relations(dev)
    assert cpu == remote and all(all(x) if isinstance(x, list) else x for x in remote)
    assert _waits() == before + 1  # t.cpu() for torch.save; data_ptr() waits for nothing


def test_resizing_a_storage_frees_and_allocates_it_on_the_daemon(dev):
    """`t.untyped_storage().resize_(0)` and back, as FSDP2 frees and re-allocates unsharded
    parameters: the daemon's memory goes and comes back, and a view made before sees what is
    written into the new memory."""
    t = torch.ones(1024, device=dev) + 1  # a result: its memory is the daemon's own
    view = t[512:]
    torch.remote_accelerator.synchronize()
    base = torch.remote_accelerator.memory_allocated()
    storage = t.untyped_storage()
    assert storage.size() == storage.nbytes() == 4096
    storage.resize_(0)
    assert t.untyped_storage().size() == 0
    assert torch.remote_accelerator.memory_allocated() == base - 4096
    t.untyped_storage().resize_(4096)
    assert torch.remote_accelerator.memory_allocated() == base
    t.copy_(torch.full((1024,), 3.0))
    assert view.cpu().tolist() == [3.0] * 512
    with pytest.raises(RuntimeError, match="at least 0"):
        storage.resize_(-1)


def test_memory_allocated_counts_storages_that_out_ops_grow(dev):
    """An out= op resizes its output to fit (torch.arange with float bounds is empty() then
    arange.out): the daemon's memory account followed only new tensors, so these counted 0."""
    torch.remote_accelerator.synchronize()
    base = torch.remote_accelerator.memory_allocated()
    t = torch.arange(1024.0, device=dev)
    grown = torch.empty(0, device=dev)
    torch.cat([t, t], out=grown)
    torch.remote_accelerator.synchronize()
    assert torch.remote_accelerator.memory_allocated() == base + 4096 + 8192
    del t, grown
    torch.remote_accelerator.synchronize()
    assert torch.remote_accelerator.memory_allocated() == base
