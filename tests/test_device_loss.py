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


@pytest.mark.parametrize("batch_ops", [None, 1], ids=["batched", "op by op"])
@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "ipc"])
def test_a_lost_device_is_reported_and_the_daemon_restarts_in_place(monkeypatch, listen, batch_ops):
    # Op by op (GENIE_BATCH_OPS=1), the failing op's batch is posted ahead and its answer read by a
    # Genie thread: the read that fails next is told of the loss, and the loss names its cause.
    # That read's request was queued on the daemon's worker behind the failing batch, and under
    # load got "handle ... does not exist" (4 of 20 runs beside two busy loops): now the loss.
    monkeypatch.setenv("GENIE_TEST_LOSE_DEVICE_ON", "aten::digamma")
    if batch_ops is not None:
        import dataclasses

        rt = genie.get_runtime()
        monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, batch_ops=batch_ops))
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


def test_a_request_that_reaches_the_restarted_daemon_is_answered_with_the_loss(monkeypatch, zmq_ctx):
    """A client's connection reconnects by itself to the restarted daemon, and a request it sent
    before it learnt of the loss (a fetch racing the answer that carried it, or the next use of an
    idle client) reached a daemon that never knew its handles: "handle ... does not exist". The
    restarted daemon knows which clients the loss took, and answers them with the loss until
    they say hello again."""
    import zmq

    from genie.transport import protocol

    monkeypatch.setenv("GENIE_TEST_LOSE_DEVICE_ON", "aten::digamma")
    with DaemonProcess() as daemon:
        idle = zmq_ctx.socket(zmq.DEALER)
        idle.setsockopt(zmq.ROUTING_ID, b"idle-client-0123")  # 16 bytes, as a client's token
        idle.setsockopt(zmq.RCVTIMEO, 20_000)
        idle.connect(daemon.endpoint)

        def ask(kind: str, rid: int, body: dict) -> tuple[bool, dict]:
            idle.send_multipart([protocol.pack([kind, rid, body])])
            _, ok, answer = protocol.unpack_header(idle.recv_multipart()[0], [])
            return ok, answer

        assert ask("hello", 1, {"version": protocol.VERSION, "heartbeat": 0})[0]
        genie.init(daemon.endpoint)
        try:
            with pytest.raises(GenieError, match="aten::digamma"):
                torch.ones(4, device=DEV).digamma().cpu()
        finally:
            genie.shutdown()
        deadline = time.monotonic() + 20.0
        while not any("restarting (pid" in line for line in daemon.stderr_lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        ok, answer = ask("stats", 2, {})  # queued until the restarted daemon takes the connection
        assert not ok and answer["type"] == protocol.DEVICE_LOST_ERROR, answer
        assert "aten::digamma" in answer["message"] and "restarted daemon" in answer["message"], answer
        assert answer["op"] == "aten::digamma"
        assert ask("hello", 3, {"version": protocol.VERSION, "heartbeat": 0})[0]  # a new start
        assert ask("stats", 4, {})[0]


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


def test_the_restart_notice_is_read_once_and_a_malformed_one_is_ignored(monkeypatch):
    from genie_daemon import device_faults

    lost = device_faults.DeviceLost("aten::digamma", RuntimeError("CUDA error: device-side assert triggered"))
    monkeypatch.setenv(device_faults.RESTART_NOTICE_ENV, device_faults.restart_notice(lost, {b"a" * 16, b"b" * 16}))
    clients, op = device_faults.take_restart_notice()
    assert clients == {b"a" * 16: str(lost), b"b" * 16: str(lost)} and op == "aten::digamma"
    assert device_faults.take_restart_notice() == ({}, None)  # popped: a later restart does not inherit it
    for bad in ("{", "[]", '{"reason": "x", "clients": ["zz"]}', '{"clients": []}'):
        monkeypatch.setenv(device_faults.RESTART_NOTICE_ENV, bad)
        assert device_faults.take_restart_notice() == ({}, None)


def test_requests_queued_behind_the_loss_get_the_loss(monkeypatch):
    """The worker runs the requests queued behind the one that lost the context before the event
    loop hears of the loss: they get the loss (a fetch of the lost op's output got "handle ...
    does not exist", which is what a client reading op by op was told)."""
    from genie.transport.protocol import Exec, HandleRef, OpCall
    from genie_daemon import device_faults
    from genie_daemon.executor import Executor
    from genie_daemon.handles import ClientState, MemoryAccount

    monkeypatch.setattr(device_faults, "SIMULATED_OP", "aten::digamma")
    monkeypatch.setattr(device_faults, "_simulated_loss", False)
    executor = Executor([torch.device("cpu")])
    client = ClientState(b"unit", MemoryAccount())

    def request(*ops, fetch=()):
        return Exec(device=0, ops=list(ops), frees=[], fetch=list(fetch), report=False)

    executor.run(client, request(OpCall("aten::ones", [[4]], {}, 1)), [])
    with pytest.raises(device_faults.DeviceLost) as lost:
        executor.run(client, request(OpCall("aten::digamma", [HandleRef(1)], {}, 2)), [])
    for later in (request(fetch=[2]), request(OpCall("aten::neg", [HandleRef(1)], {}, 3))):
        with pytest.raises(device_faults.DeviceLost) as again:
            executor.run(client, later, [])
        assert again.value is lost.value and "aten::digamma" in str(again.value)
