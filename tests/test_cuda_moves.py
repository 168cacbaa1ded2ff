"""Copies that change dtype or device with a daemon on a CUDA GPU: narrowing uploads convert on the
client, narrowing downloads cast on the GPU, and daemon-to-daemon copies of GPU tensors keep their
values and memory layout. These need a GPU on this machine (CI's has none); the CPU forms of the
same paths are tested in test_copy_semantics.py and test_multi_daemon.py."""
from __future__ import annotations

import pytest
import torch

import genie
from daemons import DaemonProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU on this machine)")


@pytest.fixture(scope="module")
def two_gpu_daemons():
    """Two daemons on the first GPU (one node with one GPU: still two processes and a peer link)."""
    with DaemonProcess(extra=["--device", "cuda:0"]) as a, DaemonProcess(extra=["--device", "cuda:0"]) as b:
        genie.init(f"{a.endpoint},{b.endpoint}")
        try:
            yield a, b
        finally:
            genie.shutdown()


def _bytes_sent() -> int:
    return sum(v["bytes_sent"] for v in genie.transport_stats().values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_narrowing_upload_sends_the_narrow_bytes_and_rounds_as_cuda(two_gpu_daemons, dtype):
    src = torch.randn(1 << 20) * 1e3
    before = _bytes_sent()
    x = src.to("remote_accelerator:0", dtype)
    torch.remote_accelerator.synchronize(0)
    assert _bytes_sent() - before < src.nbytes * 3 // 4  # half the bytes went, not all of them
    assert x.dtype == dtype
    torch.testing.assert_close(x.cpu(), src.cuda().to(dtype).cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_narrowing_download_casts_on_the_gpu(two_gpu_daemons, dtype):
    src = torch.randn(1 << 20) * 1e3
    x = src.to("remote_accelerator:0")
    back = x.to("cpu", dtype)
    assert back.device.type == "cpu" and back.dtype == dtype
    torch.testing.assert_close(back, src.cuda().to(dtype).cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("numel", [1000, 1 << 20])  # inside a ZeroMQ message / on the peer's bulk lane
def test_gpu_tensors_move_between_daemons_with_their_values(two_gpu_daemons, numel):
    src = torch.randn(numel)
    moved = src.to("remote_accelerator:0").mul(2).to("remote_accelerator:1")
    assert moved.device == torch.device("remote_accelerator:1")
    torch.testing.assert_close(moved.cpu(), src * 2, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "gappy"])
def test_gpu_tensors_keep_their_layout_between_daemons(two_gpu_daemons, layout):
    base = torch.randn(16, 32, 32, 32)  # 2 MiB; its first two rows 256 KiB: both ways of carrying bytes
    src = {"channels_last": base.to(memory_format=torch.channels_last),
           "transposed": base.reshape(512, 1024).t(),
           "gappy": base[:, :, ::2]}[layout]
    for part in (src[:2], src):
        on_0 = part.to("remote_accelerator:0")
        moved = on_0.to("remote_accelerator:1")
        # PyTorch's .to() between GPUs: a dense tensor keeps its strides, one with gaps is row-major.
        expected = part.cuda().to("cuda:0", copy=True)
        assert moved.stride() == expected.stride()
        back = moved.cpu()
        torch.testing.assert_close(back, part, rtol=0, atol=0)
        assert back.stride() == expected.stride()
