"""The UCX lane (genie.transport.ucx_lane): bulk payloads over UCX between a client and a real
daemon. This host has no RDMA device, so `auto` keeps the socket lane (checked); the lane
itself is tested with both ends forced on, UCX then running over its TCP/shared-memory
transports."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

import genie
from daemons import DaemonProcess
from genie.transport import ucx_lane

ucxx = pytest.importorskip("ucxx", reason="needs ucxx (pip install ucxx-cu12)")

BIG = 3 << 20  # float32 elements: 12 MiB, above the bulk lane's 4 MiB threshold


@pytest.fixture
def ucx_daemon(monkeypatch):
    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, ucx="on"))
    with DaemonProcess(extra=["--ucx", "on"]) as d:
        genie.init(d.endpoint)
        try:
            yield d
        finally:
            genie.shutdown()


@pytest.mark.timeout(120)
def test_large_tensors_go_both_ways_over_the_ucx_lane(ucx_daemon):
    link = genie.get_runtime().links[0]
    assert genie.transport_info()["links"][ucx_daemon.endpoint]["path"] == "zmq+bulk-ucx"
    lane = link.bulk_lane
    torch.manual_seed(0)
    xs = [torch.randn(BIG) for _ in range(3)]
    remote = [x.to("remote_accelerator:0") for x in xs]
    total = remote[0] * 2 + remote[1] - remote[2]
    torch.testing.assert_close(total.cpu(), xs[0] * 2 + xs[1] - xs[2])
    for x, r in zip(xs, remote):
        assert torch.equal(r.cpu(), x)
    assert lane.bytes_sent >= 3 * BIG * 4 and lane.bytes_received >= 4 * BIG * 4


@pytest.mark.timeout(120)
def test_the_daemon_refuses_a_ucx_lane_from_an_unknown_client(ucx_daemon):
    port = _advertised_port()

    async def intrude() -> bytes:
        endpoint = await ucxx.create_endpoint("127.0.0.1", port)
        await endpoint.send(np.frombuffer(ucx_lane.MAGIC + b"\x00" * 16, dtype=np.uint8).copy())
        answer = np.zeros(1, dtype=np.uint8)
        try:
            await asyncio.wait_for(endpoint.recv(answer), 5)
        except Exception:  # noqa: BLE001 - closed on us: refused
            return b""
        return answer.tobytes()

    assert ucx_lane._UcxLoop.get().submit(intrude()).result(30) != b"\x01"
    x = torch.randn(BIG)
    assert torch.equal(x.to("remote_accelerator:0").cpu(), x)  # the real client's lane still works


def _advertised_port() -> int:
    from genie.transport import protocol

    reply = genie.get_runtime().links[0].request("hello", {"version": protocol.VERSION})
    return reply.body["ucx"]


@pytest.mark.skipif(bool(ucx_lane.rdma_devices()), reason="this host has an RDMA device: auto chooses UCX")
def test_without_an_rdma_device_auto_keeps_the_socket_lane_and_says_why(monkeypatch):
    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, ucx="auto"))
    with DaemonProcess(extra=["--ucx", "on"]) as d:  # the daemon offers UCX; the client declines it
        genie.init(d.endpoint)
        try:
            info = genie.transport_info()
            assert info["links"][d.endpoint]["path"] == "zmq+bulk-tcp"
            assert "no RDMA device" in info["local"]["ucx_lane"]
            x = torch.randn(BIG)
            assert torch.equal(x.to("remote_accelerator:0").cpu(), x)
        finally:
            genie.shutdown()
