"""GPU memory over the UCX lane (GPUDirect where the NIC allows): uploads land in a daemon's GPU
memory and results leave from it, with no pinned host staging. Needs a GPU and ucxx on this
machine; CI's machine has neither GPU nor RDMA (see README, GPU nodes)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import genie
from daemons import DaemonProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU on this machine)")


@pytest.fixture
def gpu_ucx_daemon(monkeypatch):
    """A daemon on the GPU with its UCX lane on (both ends forced: this host may have no RDMA
    device; UCX then moves GPU memory with its cuda_copy / cuda_ipc transports)."""
    pytest.importorskip("ucxx", reason="needs ucxx (pip install ucxx-cu12)")
    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, ucx="on"))
    with DaemonProcess(extra=["--device", "cuda:0", "--ucx", "on"]) as d:
        genie.init(d.endpoint)
        try:
            yield d.endpoint
        finally:
            genie.shutdown()


def test_the_ucx_lane_lands_uploads_in_gpu_memory_and_sends_results_from_it(gpu_ucx_daemon):
    info = genie.transport_info()["links"][gpu_ucx_daemon]
    assert info["path"] == "zmq+bulk-ucx"
    assert info["gpu_memory_over_ucx"].startswith("yes:"), info["gpu_memory_over_ucx"]
    before = _daemon_stats()
    src = torch.randn(16 << 20)  # 64 MiB: the bulk lane
    x = src.to("remote_accelerator:0")
    y = (x * 2).cpu()
    torch.testing.assert_close(y, src * 2)
    after = _daemon_stats()
    moved, staged = after["ucx_gpu_memory"], after["pinned_staging"]
    assert moved["uploads"] >= before["ucx_gpu_memory"]["uploads"] + 1
    assert moved["downloads"] >= before["ucx_gpu_memory"]["downloads"] + 1
    assert moved["bytes"] - before["ucx_gpu_memory"]["bytes"] >= 64 << 20
    assert staged["uploads"] == before["pinned_staging"]["uploads"]  # no host staging on the way
    assert staged["downloads"] == before["pinned_staging"]["downloads"]


def _daemon_stats():
    return genie.get_runtime().links[0].request("stats", {"dev": 0}).body
