"""A GPU whose CUDA context is lost (a device-side assert, an illegal address): the client is told
what happened, and the daemon restarts in place instead of failing every later request.

A CPU machine cannot lose a CUDA context: the daemon's GENIE_TEST_LOSE_DEVICE_ON makes one op
fail as a device-side assert does (daemon/device_faults.py). scripts/gpu_quick_check.sh runs a real
one on GPU nodes (scripts/gpu_device_assert.py).
"""
from __future__ import annotations

import time

import pytest
import torch

import genie
from daemons import DaemonProcess, ipc_endpoint
from genie import GenieConnectionError, GenieError
from genie.runtime.runtime import _retry_until  # the runtime's own wait for a restarting daemon

DEV = "remote_accelerator:0"


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "ipc"])
def test_a_lost_device_is_reported_and_the_daemon_restarts_in_place(monkeypatch, listen):
    monkeypatch.setenv("GENIE_TEST_LOSE_DEVICE_ON", "aten::digamma")
    tmp = None
    if listen == "ipc":
        listen, tmp = ipc_endpoint()
    daemon = DaemonProcess(listen)  # tcp port 0: the restart binds the port it had, not a new one
    daemon.start()
    try:
        genie.init(daemon.endpoint)
        kept = torch.full((3,), 2.0, device=DEV)
        assert kept.sum().item() == 6.0
        with pytest.raises(GenieError) as caught:
            torch.ones(4, device=DEV).digamma().cpu()
        message = str(caught.value)
        assert "aten::digamma" in message and "device-side assert" in message, message
        assert "restarts" in message and "every tensor on it is gone" in message, message

        # The same process serves again at the same endpoint, and the next use reconnects.
        fresh = _retry_until(time.monotonic() + 20.0, lambda: (torch.full((2,), 3.0, device=DEV) * 2).cpu())
        assert fresh.tolist() == [6.0, 6.0]
        assert daemon.proc.poll() is None
        assert genie.get_runtime().links[0].endpoint == daemon.endpoint
        with pytest.raises(GenieConnectionError, match="lost"):
            kept.cpu()  # it lived in the lost context
        assert any("restarting (pid" in line for line in daemon.stderr_lines), daemon.stderr_lines[-5:]
    finally:
        genie.shutdown()
        daemon.stop()
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def test_an_ordinary_op_failure_does_not_restart_the_daemon(monkeypatch):
    monkeypatch.setenv("GENIE_TEST_LOSE_DEVICE_ON", "aten::digamma")
    with DaemonProcess() as daemon:
        genie.init(daemon.endpoint)
        try:
            kept = torch.full((3,), 2.0, device=DEV)
            # Found on the daemon, from the values, on a GPU too (an index out of range is not: a
            # CUDA kernel asserts, and that context is lost).
            with pytest.raises(GenieError, match="positive-definite"):
                torch.linalg.cholesky(-torch.eye(3, device=DEV)).cpu()
            assert kept.sum().item() == 6.0  # still there: the daemon went on
            assert not any("restarting" in line for line in daemon.stderr_lines)
        finally:
            genie.shutdown()


def test_only_an_error_that_outlives_two_synchronizes_counts_as_a_lost_context(monkeypatch):
    from genie.transport import protocol
    from genie_daemon import device_faults

    assert device_faults.DeviceLost.__name__ == protocol.DEVICE_LOST_ERROR  # the client knows it by this
    gpu = [torch.device("cuda", 0)]
    failures = []

    def synchronize(device):
        if failures and failures.pop(0):
            raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    assert not device_faults.context_lost(ValueError("CUDA"), gpu)  # not a RuntimeError
    failures[:] = [True, True]
    assert not device_faults.context_lost(RuntimeError("index out of range in self"), gpu)  # never probed
    assert not device_faults.context_lost(RuntimeError("no CUDA IPC handles here"), gpu)  # nor this
    assert failures == [True, True]
    assert device_faults.context_lost(RuntimeError("CUDA error: device-side assert triggered"), gpu)
    failures[:] = [True, False]  # reported once, then the device synchronizes: it goes on
    assert not device_faults.context_lost(RuntimeError("CUDA error: invalid argument"), gpu)
    failures[:] = [True, True]
    assert not device_faults.context_lost(RuntimeError("CUDA error: x"), [torch.device("cpu")])
