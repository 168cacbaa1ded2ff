"""The UCX lane (genie.transport.ucx_lane): bulk payloads over UCX between a client and a real
daemon. This host has no RDMA device, so `auto` keeps the socket lane (checked); the lane
itself is tested with both ends forced on, UCX then running over its TCP/shared-memory
transports."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses

import numpy as np
import pytest
import torch

import genie
from daemons import DaemonProcess
from genie.transport import ucx_lane
from genie.transport.hostmem import HostBufferPool

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
    # A CPU daemon has no GPU memory for UCX to move: uploads land in host memory, and it says so.
    assert lane.peer_devices == frozenset() and lane.device_bytes_sent == 0
    assert genie.transport_info()["links"][ucx_daemon.endpoint]["gpu_memory_over_ucx"] == "no: this daemon has no GPU"


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
    with DaemonProcess(extra=["--ucx", "on"], local_lane=False) as d:  # the daemon offers UCX; the client declines it
        genie.init(d.endpoint)
        try:
            info = genie.transport_info()
            assert info["links"][d.endpoint]["path"] == "zmq+bulk-tcp"
            assert "no RDMA device" in info["local"]["ucx_lane"]
            x = torch.randn(BIG)
            assert torch.equal(x.to("remote_accelerator:0").cpu(), x)
        finally:
            genie.shutdown()


# ---------------------------------------------------------------- TO_DEVICE records, lane to lane
# Both ends in this process, over a loopback UCX listener. The landing device here is the CPU:
# the records, their checks and the tensors they land in are the same code a GPU daemon runs
# (only the allocation's device differs; tests/test_cuda_ucx.py runs it on a GPU).


@pytest.fixture
def lane_pair():
    pool = HostBufferPool(0)
    accepted: concurrent.futures.Future = concurrent.futures.Future()
    listener = ucx_lane.UcxListener(lambda token: True, lambda token, lane: accepted.set_result(lane), pool,
                                    1 << 30, landing_devices={0: torch.device("cpu")})
    client = ucx_lane.open_client_lane("127.0.0.1", listener.port, b"t" * 16, pool, 1 << 30, 10.0)
    daemon_side = accepted.result(10)
    client.peer_devices = frozenset({0})
    try:
        yield client, daemon_side
    finally:
        client.close()
        daemon_side.close()
        listener.close()


@pytest.mark.timeout(60)
def test_an_upload_for_a_landing_device_arrives_as_a_tensor_on_it(lane_pair):
    client, daemon_side = lane_pair
    payload = np.arange(5 << 20, dtype=np.uint8) * 7
    client.send(1, memoryview(payload), device=0)
    client.send(2, memoryview(payload[:1000]))  # a plain STREAM record: host pool, as before
    landed = daemon_side.arrivals.take(1, 10)
    assert isinstance(landed, torch.Tensor) and landed.device.type == "cpu"
    assert np.array_equal(landed.numpy(), payload)
    assert np.array_equal(daemon_side.arrivals.take(2, 10).numpy(), payload[:1000])
    assert daemon_side.device_bytes_received == payload.nbytes


@pytest.mark.timeout(60)
def test_a_result_is_sent_from_a_tensor_as_it_is(lane_pair):
    client, daemon_side = lane_pair
    result = torch.arange(3 << 20, dtype=torch.int32)
    daemon_side.send(7, result.view(torch.uint8))
    assert torch.equal(client.arrivals.take(7, 10).view(torch.int32), result)
    assert daemon_side.device_bytes_sent == result.nbytes
    with pytest.raises(ValueError, match="contiguous bytes"):
        daemon_side.send(8, result.view(torch.uint8)[::2])


@pytest.mark.timeout(60)
def test_a_device_the_receiver_lands_nothing_on_is_refused(lane_pair):
    client, daemon_side = lane_pair
    with pytest.raises(ValueError, match="device 3"):
        client.send(1, memoryview(b"x" * 64), device=3)  # refused before anything is sent
    client.peer_devices = frozenset({0, 3})  # a client that names a device the daemon never offered
    client.send(2, memoryview(b"x" * 64), device=3)
    with pytest.raises(ConnectionError, match="device 3, on which this end lands none"):
        daemon_side.arrivals.take(2, 10)
    assert daemon_side.closed


@pytest.mark.timeout(60)
def test_the_device_memory_check_round_trips_bytes_through_each_device():
    working, how = ucx_lane.check_device_memory({0: torch.device("cpu"), 2: torch.device("cpu")})
    assert working == {0: torch.device("cpu"), 2: torch.device("cpu")} and how.startswith("yes:")
    assert ucx_lane.check_device_memory({}) == ({}, "no: this daemon has no GPU")
