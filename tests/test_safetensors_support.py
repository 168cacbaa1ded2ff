"""safetensors files opened straight onto remote_accelerator, as onto "cuda"
(genie/frontend/safetensors_support.py)."""
import pytest
import torch

safetensors = pytest.importorskip("safetensors", reason="needs safetensors (comes with transformers: pip install -e '.[test]')")
import safetensors.torch  # noqa: E402


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g),
               "ids": torch.randint(0, 9, (4,), generator=g), "half": torch.randn(3, 3, generator=g).half()}
    path = str(tmp_path / "model.safetensors")
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def _waits():
    import genie

    return sum(s["blocking_waits"] for s in genie.transport_stats().values())


@pytest.mark.parametrize("device", ["remote_accelerator:0", "remote_accelerator", "a torch.device"])
def test_load_file_onto_the_remote_device(dev, saved, device):
    path, tensors = saved
    device = torch.device(dev) if device == "a torch.device" else device
    torch.ones(1, device=dev).cpu()  # connected before counting
    before = _waits()
    loaded = safetensors.torch.load_file(path, device=device)
    assert _waits() == before  # uploads queued, as .to(dev) would: nothing waited on
    assert set(loaded) == set(tensors)
    for name, expected in tensors.items():
        assert loaded[name].device == torch.device(dev)
        assert loaded[name].dtype == expected.dtype
        torch.testing.assert_close(loaded[name].cpu(), expected, rtol=0, atol=0)


def test_safe_open_reads_tensors_slices_and_metadata(dev, saved):
    path, tensors = saved
    with safetensors.safe_open(path, framework="pt", device=dev) as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert f.metadata() == {"format": "pt"}
        w = f.get_tensor("w")
        part = f.get_slice("w")[1:3, ::2]
        assert f.get_slice("w").get_shape() == [6, 5]
    assert w.device == part.device == torch.device(dev)
    torch.testing.assert_close(w.cpu(), tensors["w"], rtol=0, atol=0)
    torch.testing.assert_close(part.cpu(), tensors["w"][1:3, ::2], rtol=0, atol=0)
    # Used without `with` too, and by safetensors.torch's own name for it.
    f = safetensors.torch.safe_open(path, framework="pt", device=dev)
    torch.testing.assert_close(f.get_tensor("ids").cpu(), tensors["ids"], rtol=0, atol=0)


def test_a_model_loads_its_weights_from_the_file(dev, saved, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    path = str(tmp_path / "m.safetensors")
    safetensors.torch.save_model(model, path)
    remote = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to(dev)
    remote.load_state_dict(safetensors.torch.load_file(path, device=dev))
    x = torch.randn(3, 8)
    torch.testing.assert_close(remote(x.to(dev)).cpu(), model(x), rtol=0, atol=0)


def test_other_devices_are_safetensors_own(dev, saved):
    path, tensors = saved
    opened = safetensors.safe_open(path, framework="pt", device="cpu")
    assert type(opened) is safetensors.safe_open._genie_wraps  # safetensors' own object, untouched
    torch.testing.assert_close(safetensors.torch.load_file(path)["b"], tensors["b"], rtol=0, atol=0)
    with pytest.raises(Exception, match="invalid"):
        safetensors.safe_open(path, framework="pt", device="nosuchdevice")


def test_refusals_say_why(dev, saved):
    path, _ = saved
    with pytest.raises(ValueError, match="framework='pt'"):
        safetensors.safe_open(path, framework="numpy", device=dev)
    with pytest.raises(RuntimeError):
        safetensors.torch.load_file(path, device="remote_accelerator:x")


def test_saving_remote_tensors_reads_them_in_one_wait(dev, tmp_path):
    g = torch.Generator().manual_seed(1)
    values = {f"layer{i}.{kind}": torch.randn(8, 4, generator=g) for i in range(20) for kind in ("w", "b")}
    remote = {name: v.to(dev) for name, v in values.items()}
    torch.remote_accelerator.synchronize()
    path = str(tmp_path / "saved.safetensors")
    before = _waits()
    safetensors.torch.save_file(remote, path)
    assert _waits() == before + 1  # 40 tensors: one wait each before
    loaded = safetensors.torch.load_file(path)
    for name, expected in values.items():
        torch.testing.assert_close(loaded[name], expected, rtol=0, atol=0)
    before = _waits()
    data = safetensors.torch.save(remote)
    assert _waits() == before + 1
    torch.testing.assert_close(safetensors.torch.load(data)["layer3.w"], values["layer3.w"], rtol=0, atol=0)


def test_a_value_written_after_the_save_is_not_the_saved_one(dev, tmp_path):
    x = torch.zeros(4, device=dev)
    path = str(tmp_path / "x.safetensors")
    safetensors.torch.save_file({"x": x, "y": x + 1}, path)
    x.add_(5)
    safetensors.torch.save_file({"x": x, "y": x + 1}, path)
    loaded = safetensors.torch.load_file(path)
    assert loaded["x"].tolist() == [5.0] * 4 and loaded["y"].tolist() == [6.0] * 4


def _tied():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as language models tie embeddings and head
    return model


def test_save_model_of_a_remote_model_with_tied_weights(dev, tmp_path):
    # save_model finds tensors sharing a storage and keeps one name; it needs a whole tensor's
    # data_ptr() to equal its storage's (refused before: no name was "complete").
    model = _tied()
    remote = _tied().to(dev)
    path = str(tmp_path / "tied.safetensors")
    safetensors.torch.save_model(remote, path)
    assert len(safetensors.torch.load_file(path)) == 1  # the tied weight written once, as from the CPU
    fresh = _tied()
    torch.nn.init.zeros_(fresh[0].weight)
    missing, unexpected = safetensors.torch.load_model(fresh, path)
    assert not unexpected
    torch.testing.assert_close(fresh[1].weight, model[1].weight, rtol=0, atol=0)


def test_save_file_refuses_shared_tensors_as_from_the_cpu(dev, tmp_path):
    path = str(tmp_path / "shared.safetensors")
    with pytest.raises(RuntimeError, match="share memory") as on_cpu:
        safetensors.torch.save_file(_tied().state_dict(), path)
    with pytest.raises(RuntimeError, match="share memory") as remote:
        safetensors.torch.save_file(_tied().to(dev).state_dict(), path)
    assert str(remote.value) == str(on_cpu.value)
