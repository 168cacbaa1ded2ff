"""Checkpoints: torch.save of remote tensors, and torch.load(map_location=...) straight onto the device."""
from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

import genie


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("map_location", ["remote_accelerator:0", "remote_accelerator",
                                          torch.device("remote_accelerator:0"), {"cpu": "remote_accelerator:0"}])
def test_load_onto_the_device_keeps_values_and_sharing(dev, map_location):
    torch.manual_seed(0)
    sd = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 4)).state_dict()
    sd["tied"] = sd["0.weight"]  # the same storage twice
    sd["view"] = sd["0.weight"][1:, ::2]  # a strided view into it, at an offset
    sd["half"] = torch.randn(5, dtype=torch.float16)
    loaded = torch.load(_saved(sd), map_location=map_location, weights_only=True)
    for name, value in sd.items():
        got = loaded[name]
        assert got.device == torch.device(dev), name
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == \
            (value.dtype, value.shape, value.stride(), value.storage_offset()), name
        assert torch.equal(got.cpu(), value), name
    # Shared in the checkpoint, shared on the daemon.
    loaded["tied"].add_(1)
    assert torch.equal(loaded["0.weight"].cpu(), sd["0.weight"] + 1)
    assert torch.equal(loaded["view"].cpu(), sd["view"] + 1)


def test_load_state_dict_with_map_location_the_device(dev):
    local = torch.nn.Conv2d(3, 4, 3)
    remote = torch.nn.Conv2d(3, 4, 3).to(dev)
    remote.load_state_dict(torch.load(_saved(local.state_dict()), map_location=dev))  # weights_only by default
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(remote(x.to(dev)).cpu(), local(x))


def test_loaded_tensors_take_their_bytes_once_and_give_them_back(dev):
    ra = torch.remote_accelerator
    checkpoint = {"w": torch.randn(1 << 20), "b": torch.randn(1000)}
    buf = _saved(checkpoint)
    gc.collect()  # remote tensors earlier tests left to the collector are freed before the baseline
    genie.flush()
    ra.synchronize()
    base = ra.memory_allocated(0)
    loaded = torch.load(buf, map_location=dev, weights_only=True)
    gc.collect()
    genie.flush()
    ra.synchronize()
    payload = sum(t.numel() * t.element_size() for t in checkpoint.values())
    assert ra.memory_allocated(0) - base == pytest.approx(payload, rel=0.01)  # no second copy kept
    del loaded
    gc.collect()
    genie.flush()
    ra.synchronize()
    assert ra.memory_allocated(0) == base


def test_saving_remote_tensors_saves_their_values(dev):
    x = torch.randn(3, 4).to(dev)
    back = torch.load(_saved({"x": x}), weights_only=True)["x"]
    assert back.device.type == "cpu" and torch.equal(back, x.cpu())


def test_only_storages_of_the_device_can_back_a_remote_tensor(dev):
    y = torch.arange(12.0).to(dev)
    view = torch.empty(0, device=dev).set_(y.untyped_storage(), 0, (3,), (1,))  # y's own storage
    assert view.cpu().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(genie.UnsupportedOperationError, match="only at a storage of its device"):
        torch.empty(0, device=dev).set_(torch.arange(12.0).untyped_storage(), 0, (3,), (1,))


def test_saving_remote_views_keeps_them_views_of_one_storage(dev):
    """torch.save keeps views (PyTorch's serialization notes): a base and its views saved together
    load as views of one storage, written once, as from CPU tensors."""
    base = torch.arange(24.0).reshape(4, 6)
    local = {"x": base, "col": base[:, 1], "t": base.t(), "tail": base.view(-1)[20:]}
    remote_base = base.to(dev)
    remote = {"x": remote_base, "col": remote_base[:, 1], "t": remote_base.t(), "tail": remote_base.view(-1)[20:]}
    from_cpu, from_remote = _saved(local), _saved(remote)
    assert len(from_remote.getvalue()) == pytest.approx(len(from_cpu.getvalue()), abs=64)  # one storage
    for map_location in ("cpu", dev):
        loaded = torch.load(_saved(remote), map_location=map_location, weights_only=True)
        for name, value in local.items():
            got = loaded[name]
            assert (got.shape, got.stride(), got.storage_offset()) == \
                (value.shape, value.stride(), value.storage_offset()), name
            assert torch.equal(got.cpu(), value), name
        loaded["col"].mul_(-1)  # written through one view, seen through the others
        assert loaded["x"][:, 1].cpu().tolist() == [-1.0, -7.0, -13.0, -19.0]
        assert loaded["t"][1].cpu().tolist() == [-1.0, -7.0, -13.0, -19.0]


def test_each_save_takes_the_values_of_its_moment(dev):
    x = torch.zeros(4).to(dev)
    first = _saved({"x": x, "v": x[1:]})
    x.add_(1)
    second = _saved({"x": x, "v": x[1:]})
    assert torch.load(first, weights_only=True)["v"].tolist() == [0.0, 0.0, 0.0]
    assert torch.load(second, weights_only=True)["v"].tolist() == [1.0, 1.0, 1.0]


def test_saved_remote_tensors_keep_requires_grad(dev):
    w = torch.nn.Parameter(torch.randn(3).to(dev))
    leaf = torch.ones(2, device=dev, requires_grad=True)
    loaded = torch.load(_saved({"w": w, "leaf": leaf, "plain": leaf.detach()}), weights_only=True)
    assert isinstance(loaded["w"], torch.nn.Parameter) and loaded["w"].requires_grad
    assert loaded["leaf"].requires_grad and not loaded["plain"].requires_grad
    assert torch.equal(loaded["w"].detach(), w.detach().cpu())


def test_saved_conjugate_and_negative_views_keep_their_values(dev):
    x = torch.complex(torch.arange(3.0), torch.ones(3))
    remote = x.to(dev)
    loaded = torch.load(_saved({"conj": remote.conj(), "neg": torch._neg_view(remote), "x": remote}), weights_only=True)
    assert torch.equal(loaded["conj"].resolve_conj(), x.conj().resolve_conj())
    assert torch.equal(loaded["neg"].resolve_neg(), -x)
    assert torch.equal(loaded["x"], x)


def test_conjugate_and_negative_views_load_onto_the_device_with_their_values(dev):
    x = torch.complex(torch.arange(3.0), torch.ones(3))
    checkpoint = {"conj": x.conj(), "neg": torch._neg_view(x), "x": x, "tail": x[1:].conj()}
    loaded = torch.load(_saved(checkpoint), map_location=dev, weights_only=True)
    for name, value in checkpoint.items():
        want = value.resolve_conj().resolve_neg()
        assert torch.equal(loaded[name].cpu(), want), name
        assert torch.equal((loaded[name] * 1).cpu(), want), name  # ops see the view too
    loaded["x"].mul_(2)  # still one storage on the daemon
    assert torch.equal(loaded["conj"].cpu(), (2 * x).conj().resolve_conj())
    assert torch.equal(loaded["tail"].cpu(), (2 * x[1:]).conj().resolve_conj())


def test_saved_remote_tensors_keep_their_attributes(dev):
    """Attributes set on a tensor or parameter are saved with it, as torch.save keeps them on CPU
    (they were dropped from remote ones)."""
    import pickle

    t = torch.arange(3.0, device=dev)
    t.tag = {"step": 3}
    p = torch.nn.Parameter(torch.ones(2, device=dev))
    p.note = "frozen"
    buffer = io.BytesIO()
    torch.save({"t": t, "p": p}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["t"].tag == {"step": 3} and torch.equal(loaded["t"], torch.arange(3.0))
    assert isinstance(loaded["p"], torch.nn.Parameter) and loaded["p"].note == "frozen" and loaded["p"].requires_grad
    assert pickle.loads(pickle.dumps(t)).tag == {"step": 3}


def _waits() -> int:
    endpoint, = genie.transport_stats()
    return genie.transport_stats()[endpoint]["blocking_waits"]


@pytest.mark.parametrize("what", ["state_dict", "module"])
def test_saving_many_remote_tensors_waits_twice(dev, what):
    """torch.save waited for two round trips per remote tensor, one tensor after another as
    pickling reached it (701 for a 350-tensor state_dict). Now every tensor it writes is fetched
    before it starts: one round trip names their storages, one fetches them."""
    torch.manual_seed(0)
    local = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)], torch.nn.BatchNorm1d(4))
    remote = copy.deepcopy(local).to(dev)
    obj = remote.state_dict() if what == "state_dict" else remote
    if what == "state_dict":
        obj["view"] = obj["0.weight"][1:]  # shares 0.weight's storage: written once
    genie.synchronize()
    before = _waits()
    buf = _saved(obj)
    assert _waits() - before == 2
    loaded = torch.load(buf, weights_only=what == "state_dict")
    loaded = loaded if what == "state_dict" else loaded.state_dict()
    for name, want in local.state_dict().items():
        assert loaded[name].device.type == "cpu" and torch.equal(loaded[name], want), name
    if what == "state_dict":
        assert loaded["view"].untyped_storage().data_ptr() == loaded["0.weight"].untyped_storage().data_ptr()
        assert torch.equal(loaded["view"], local.state_dict()["0.weight"][1:])


class _WritesWhenPickled:
    """Pickling it queues a write to a remote tensor (the way a custom __reduce__ might)."""

    def __init__(self, t):
        self.t = t

    def __reduce__(self):
        self.t.add_(1)
        return (int, (0,))


def test_a_tensor_written_while_saving_is_saved_with_its_value_then(dev):
    """A value fetched before torch.save began is used only while no op was queued on its device
    since: here `b` is written while pickling reaches it, and saved as it is then."""
    a, b = torch.zeros(3).to(dev), torch.zeros(3).to(dev)
    loaded = torch.load(_saved({"a": a, "bump": _WritesWhenPickled(b), "b": b}), weights_only=False)
    assert loaded["a"].tolist() == [0.0] * 3 and loaded["b"].tolist() == [1.0] * 3
