"""A program's numerics settings (TF32 and bf16 matmuls, deterministic algorithms, cuDNN flags,
the attention backends of torch.nn.attention.sdpa_kernel) govern its ops on the daemon, as they
would on a local device."""
from __future__ import annotations

import pytest
import torch

from genie.transport import numerics

pytestmark = pytest.mark.skipif(not numerics.AVAILABLE, reason="this PyTorch cannot report its numerics settings")


@pytest.fixture
def settings_restored():
    yield
    numerics.apply(numerics.DEFAULT)


def test_deterministic_algorithms_fill_new_remote_memory(dev, settings_restored):
    torch.use_deterministic_algorithms(True)  # with it, PyTorch fills uninitialized memory with NaN
    assert torch.isnan(torch.empty(64, device=dev).cpu()).all()
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.empty(64, device=dev).cpu()  # runs, unfilled (its values are whatever the memory held)
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert not torch.isnan(torch.zeros(64, device=dev).cpu()).any()


@pytest.mark.parametrize("precision", ["highest", "medium", "high"])
def test_float32_matmul_precision_is_the_programs(dev, settings_restored, precision):
    torch.manual_seed(0)
    a, b = torch.randn(128, 256), torch.randn(256, 64)
    torch.set_float32_matmul_precision(precision)
    remote = (a.to(dev) @ b.to(dev)).cpu()
    local = a @ b  # the same kernels on this host's CPU, the daemon's device here
    assert torch.equal(remote, local)


def _put(dev):
    x = torch.zeros(5, device=dev)
    x.put_(torch.tensor([0, 0], device=dev), torch.tensor([1.0, 2.0], device=dev))  # no deterministic kernel
    return x.cpu()


def test_each_client_runs_under_its_own_settings(dev, daemon_endpoint, settings_restored):
    import subprocess
    import sys

    assert _put(dev)[0] in (1.0, 2.0)
    other = subprocess.run([sys.executable, "-c", f"""
import torch, genie
genie.init({daemon_endpoint!r})
torch.use_deterministic_algorithms(True)
x = torch.zeros(5, device="remote_accelerator")
x.put_(torch.tensor([0, 0], device="remote_accelerator"), torch.tensor([1.0, 2.0], device="remote_accelerator"))
try:
    x.cpu()
except RuntimeError as e:
    print("refused:", e)
torch.use_deterministic_algorithms(True, warn_only=True)
y = torch.zeros(2, device="remote_accelerator")
y.put_(torch.tensor([1], device="remote_accelerator"), torch.tensor([3.0], device="remote_accelerator"))
print("warn only:", y.cpu().tolist())
"""], capture_output=True, text=True, timeout=120)
    assert "refused:" in other.stdout and "does not have a deterministic implementation" in other.stdout, \
        other.stdout + other.stderr[-2000:]
    assert "warn only: [0.0, 3.0]" in other.stdout, other.stdout + other.stderr[-2000:]
    # The daemon ran the other client's batches deterministic; this one's run under the defaults again.
    assert _put(dev)[0] in (1.0, 2.0)
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        _put(dev)


@pytest.mark.parametrize("backends", [["MATH"], ["FLASH_ATTENTION"], ["MATH", "FLASH_ATTENTION"]])
@pytest.mark.parametrize("grad", [False, True])
def test_sdpa_kernel_choice_is_the_programs(dev, settings_restored, backends, grad):
    """Under sdpa_kernel(MATH) the daemon ran its flash kernel anyway (results differ from the
    math backend's in the last bits); now each choice gives the CPU's values exactly, with and
    without autograd recording."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32) for _ in range(3))

    def run(device):
        query = q.clone().to(device).requires_grad_(grad)
        with sdpa_kernel([getattr(SDPBackend, b) for b in backends]):
            out = F.scaled_dot_product_attention(query, k.to(device), v.to(device), is_causal=True)
        if not grad:
            return out.cpu()
        out.sum().backward()  # outside the block, as a training loop does
        return torch.cat([out.detach().cpu().flatten(), query.grad.cpu().flatten()])

    assert torch.equal(run(dev), run("cpu"))


def test_ops_run_under_the_settings_they_were_captured_under(dev, settings_restored):
    """Ops wait in batches; a batch sent after the program changed a setting ran under the new
    one. Each op now runs under the settings in force when it was captured."""
    torch.manual_seed(0)
    a, b = torch.randn(128, 256), torch.randn(256, 64)
    torch.set_float32_matmul_precision("medium")
    want_medium = a @ b
    medium = a.to(dev) @ b.to(dev)  # queued under "medium"
    torch.set_float32_matmul_precision("highest")
    want_highest = a @ b
    highest = a.to(dev) @ b.to(dev)
    if torch.equal(want_medium, want_highest):
        pytest.skip("this CPU computes float32 matmuls the same at every precision")
    assert torch.equal(medium.cpu(), want_medium) and torch.equal(highest.cpu(), want_highest)
    with torch.backends.cudnn.flags(enabled=False):  # a change with ops queued, through a bound setter
        x = torch.ones(3, device=dev) * 2
    assert torch.equal(x.cpu(), torch.full((3,), 2.0))
