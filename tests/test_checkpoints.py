"""Checkpoints: torch.save of remote tensors, and torch.load(map_location=...) straight onto the device."""
from __future__ import annotations

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


def test_only_loaded_storages_can_back_a_remote_tensor(dev):
    y = torch.arange(12.0).to(dev)
    with pytest.raises(genie.UnsupportedOperationError, match="only at a storage that torch.load placed"):
        torch.empty(0, device=dev).set_(y.untyped_storage(), 0, (3,), (1,))
