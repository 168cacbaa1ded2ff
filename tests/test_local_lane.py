"""A tcp:// daemon's local lane: clients on the daemon's host, as its user, open their lanes on an
abstract Unix socket the daemon names in hello, and large payloads travel in shared memory (as to
an ipc:// daemon) instead of through TCP. Anyone else, or a client that cannot reach that socket
(another network namespace), keeps the tcp lanes; the offer is checked before it is used."""
from __future__ import annotations

import contextlib
import dataclasses
import socket

import pytest
import torch

import genie
from daemons import DaemonProcess
from genie.runtime import get_runtime
from genie.transport import bulk, lane_set, shared_segments

pytestmark = pytest.mark.skipif(not shared_segments.supported() or bulk.local_lane_name() is None,
                                reason="needs Linux shared-memory segments and abstract Unix sockets")


@contextlib.contextmanager
def _connected(endpoint: str, **config):
    rt = get_runtime()
    saved = rt.config
    rt.config = dataclasses.replace(saved, **config)
    try:
        genie.init(endpoint)
        yield rt.links[0]
    finally:
        genie.shutdown()
        rt.config = saved


@pytest.fixture(scope="module")
def local_daemon():
    with DaemonProcess("tcp://127.0.0.1:0", local_lane=True) as d:
        yield d


def _round_trip(n: int = 1 << 20) -> None:
    src = torch.randn(n)
    on = src.to("remote_accelerator:0")
    assert torch.equal((on * 2).cpu(), src * 2)
    strided = torch.randn(64, 3, 32, 32).to(memory_format=torch.channels_last)
    back = strided.to("remote_accelerator:0").cpu()
    assert torch.equal(back, strided) and back.stride() == strided.stride()


def test_a_client_on_the_daemons_host_moves_payloads_in_shared_memory(local_daemon):
    with _connected(local_daemon.endpoint) as link:
        info = genie.transport_info()["links"][local_daemon.endpoint]
        assert info["path"] == "zmq+bulk-shared-memory" and info["direct_lane"]
        assert link.bulk_lane.sock.family == socket.AF_UNIX
        _round_trip()
        x = torch.randn(1 << 22, device="remote_accelerator:0")  # 16 MiB down: a segment of the daemon's
        held = x.cpu()
        assert link.bulk_lane.shared and link.bulk_lane._incoming.in_use() == 1  # the daemon's segment, mapped here
        assert torch.equal(held, x.cpu())
        assert (x[:4] + 1).sum().item() == pytest.approx((held[:4] + 1).sum().item(), rel=1e-5)


def test_a_client_that_asks_for_no_shared_memory_keeps_the_tcp_lanes(local_daemon):
    with _connected(local_daemon.endpoint, shared_memory=False) as link:
        assert genie.transport_info()["links"][local_daemon.endpoint]["path"] == "zmq+bulk-tcp"
        assert len(link.bulk_lane.lanes) == lane_set.DEFAULT_TCP_LANES
        _round_trip()


def test_an_offer_from_another_host_or_user_is_not_taken(local_daemon, monkeypatch):
    monkeypatch.setattr(shared_segments, "host_id", lambda: "another-host")
    with _connected(local_daemon.endpoint):
        assert genie.transport_info()["links"][local_daemon.endpoint]["path"] == "zmq+bulk-tcp"
        _round_trip()


def test_an_unreachable_local_listener_falls_back_to_tcp(local_daemon, monkeypatch):
    """As from a container on the daemon's host with a network namespace of its own (the abstract
    socket is not there): the connect is refused at once, and the tcp lanes are opened."""
    monkeypatch.setattr(bulk, "local_lane_address",
                        lambda offered: (socket.AF_UNIX, "\0genie-lanes-1-0000000000000000"))
    with _connected(local_daemon.endpoint) as link:
        assert genie.transport_info()["links"][local_daemon.endpoint]["path"] == "zmq+bulk-tcp"
        assert link.bulk_lane.sock.family != socket.AF_UNIX
        _round_trip()


def test_a_daemon_started_with_no_local_lane_offers_none():
    with DaemonProcess("tcp://127.0.0.1:0") as d, _connected(d.endpoint):  # the tests' --no-local-lane
        assert genie.transport_info()["links"][d.endpoint]["path"] == "zmq+bulk-tcp"


def test_offers_are_checked_before_use():
    good = bulk.local_lane_offer(bulk.local_lane_name())
    assert bulk.local_lane_address(good) == (socket.AF_UNIX, good["path"])
    for bad in (None, [], "x", {**good, "host": "another-host"}, {**good, "uid": good["uid"] + 1},
                {**good, "uid": str(good["uid"])}, {**good, "path": "/tmp/genie.sock"},
                {**good, "path": "\0some-other-service"}, {**good, "path": good["path"] + "0"},
                {**good, "path": b"\0genie-lanes-1-0000000000000000"}, {k: v for k, v in good.items() if k != "path"}):
        assert bulk.local_lane_address(bad) is None, bad
