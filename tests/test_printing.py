"""print / repr of remote tensors: the text torch gives the same values on the CPU (plus the
device), and for a tensor torch summarizes, only the values it shows cross the wire."""
import pytest
import torch

from genie.frontend import printing

torch.manual_seed(0)
CASES = [torch.randn(5), torch.tensor(3.5), torch.empty(0, 5), torch.randn(2000), torch.randn(40, 50),
         torch.randn(3, 400), torch.randn(7, 8, 30), torch.randn(2, 3, 4, 5, 6, 7), torch.randint(0, 9, (100, 100)),
         torch.rand(50, 50) > 0.5, torch.randn(100, 30, dtype=torch.complex64), torch.randn(64, 64).half(),
         torch.randn(64, 64).bfloat16(), torch.randn(64, 64).to(torch.float8_e4m3fn),
         torch.full((40, 40), float("nan")), torch.randn(4, 500).t(), torch.randn(60, 60).mul(1e6)]


@pytest.mark.parametrize("cpu", CASES, ids=[f"{tuple(c.shape)}-{c.dtype}" for c in CASES])
def test_repr_is_the_cpu_text_with_the_device(dev, cpu):
    assert repr(cpu.to(dev)) == repr(cpu)[:-1] + ", device='remote_accelerator:0')"


def test_views_and_printoptions_as_on_cpu(dev):
    base = torch.arange(4000.0).reshape(40, 100)
    remote = base.to(dev)
    assert repr(remote[5:, ::3].conj()) == repr(base[5:, ::3])[:-1] + ", device='remote_accelerator:0')"
    try:
        torch.set_printoptions(edgeitems=1, threshold=50)
        assert repr(remote) == repr(base)[:-1] + ", device='remote_accelerator:0')"
    finally:
        torch.set_printoptions(profile="default")


def test_printing_a_large_tensor_fetches_only_what_is_shown(dev, monkeypatch):
    fetched = []
    real = printing.to_cpu_many

    def counting(tensors):
        fetched.extend(t.numel() for t in tensors)
        return real(tensors)

    monkeypatch.setattr(printing, "to_cpu_many", counting)
    big = torch.randn(16, 256, 1024, device=dev)  # 4M elements, 16 MiB
    text = str(big)
    assert "..." in text and sum(fetched) == 6 * 6 * 6  # the first and last 3 along each dimension
