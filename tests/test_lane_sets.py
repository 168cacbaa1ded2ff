"""Several bulk lanes to one daemon (genie/transport/lane_set.py): large payloads split across
them both ways, plain and sealed; joins the daemon refuses; a lane lost mid-use."""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import zmq

import genie
from daemons import DaemonProcess, connected, curve_pair, ipc_endpoint
from genie.runtime import get_runtime
from genie.transport import bulk, lane_set, sealed_lane

BIG = 3 << 20  # float32 elements: 12 MiB, above the 8 MiB striping threshold both ways


def _round_trip_uses_every_lane(lane) -> None:
    before = [(m.bytes_sent, m.bytes_received) for m in lane.lanes]
    src = torch.randn(BIG)
    assert torch.equal((src.to("remote_accelerator:0") * 2).cpu(), src * 2)
    for (sent, received), member in zip(before, lane.lanes):
        assert member.bytes_sent - sent >= src.nbytes // len(lane.lanes) - lane_set.PART_ALIGN
        assert member.bytes_received - received >= src.nbytes // len(lane.lanes) - lane_set.PART_ALIGN


def test_tcp_clients_split_large_payloads_over_four_lanes_by_default(tcp_lanes):
    info = genie.transport_info()["links"]
    assert next(iter(info.values()))["bulk_lanes"] == lane_set.DEFAULT_TCP_LANES
    lane = get_runtime().links[0].bulk_lane
    assert isinstance(lane, lane_set.LaneSet) and len(lane.lanes) == lane_set.DEFAULT_TCP_LANES
    _round_trip_uses_every_lane(lane)
    small = torch.randn(1 << 18)  # 1 MiB: the first lane alone
    sent = [m.bytes_sent for m in lane.lanes]
    assert torch.equal((small.to("remote_accelerator:0") + 1).cpu(), small + 1)
    assert [m.bytes_sent for m in lane.lanes][1:] == sent[1:]


def test_one_lane_when_asked_and_over_unix_sockets(daemon_endpoint):
    with connected(daemon_endpoint, bulk_lanes=1):
        assert genie.transport_info()["links"][daemon_endpoint]["bulk_lanes"] == 1
        assert isinstance(get_runtime().links[0].bulk_lane, bulk.Lane)
    ipc, tmpdir = ipc_endpoint()
    try:
        with DaemonProcess(ipc, extra=["--no-shared-memory"]) as d, connected(d.endpoint):
            info = genie.transport_info()["links"][d.endpoint]
            assert info["path"] == "zmq+bulk-unix" and info["bulk_lanes"] == 1
            src = torch.randn(BIG)
            assert torch.equal((src.to("remote_accelerator:0") + 1).cpu(), src + 1)
        with DaemonProcess(ipc, extra=["--no-shared-memory"]) as d, connected(d.endpoint, bulk_lanes=3):
            _round_trip_uses_every_lane(get_runtime().links[0].bulk_lane)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_smaller_striping_threshold_and_odd_sizes_arrive_whole(daemon_endpoint):
    with connected(daemon_endpoint, bulk_lanes=3, stripe_min_bytes=1 << 20):
        for n in (1 << 18, (1 << 18) + 1, (5 << 18) + 7):
            src = torch.randn(n)
            assert torch.equal((src.to("remote_accelerator:0") - 1).cpu(), src - 1)


def test_the_daemon_refuses_joins_it_cannot_place_and_carries_on(tcp_lane_endpoint):
    daemon_endpoint = tcp_lane_endpoint
    with connected(daemon_endpoint, bulk_lanes=2) as link:
        address = (socket.AF_INET, link.bulk_lane.sock.getpeername())
        with pytest.raises(ConnectionError):  # a token it does not know
            bulk.connect_greeted(address, bulk.MAGIC_JOIN, os.urandom(bulk.TOKEN_BYTES), timeout=10.0)
        # Up to MAX_LANES lanes for one client, then no more.
        extra = [bulk.connect_greeted(address, bulk.MAGIC_JOIN, link.token, timeout=10.0)[0]
                 for _ in range(lane_set.MAX_LANES - 2)]
        with pytest.raises(ConnectionError):
            bulk.connect_greeted(address, bulk.MAGIC_JOIN, link.token, timeout=10.0)
        src = torch.randn(1 << 18)
        assert torch.equal((src.to("remote_accelerator:0") + 1).cpu(), src + 1)
        # One of its lanes going away closes the client's set on the daemon, so on the client:
        # the work goes on inside ZeroMQ, every value still right.
        extra[0].close()
        src = torch.randn(BIG)
        for _ in range(3):
            assert torch.equal((src.to("remote_accelerator:0") + 1).cpu(), src + 1)
        for s in extra[1:]:
            s.close()


@pytest.mark.skipif(not zmq.has("curve") or not sealed_lane.available(),
                    reason="needs a libzmq built with CURVE and the cryptography package")
def test_sealed_lanes_join_only_with_the_lane_key_and_carry_striped_payloads(tmp_path):
    flags, keys = curve_pair(tmp_path)
    with DaemonProcess(extra=flags, local_lane=False) as d:
        rt = get_runtime()
        saved = rt.config
        rt.config = dataclasses.replace(saved, bulk_lanes=3)
        try:
            genie.init(d.endpoint, **keys)
            link = rt.links[0]
            assert genie.transport_info()["links"][d.endpoint]["path"] == "zmq+bulk-tcp-sealed"
            assert len(link.bulk_lane.lanes) == 3
            _round_trip_uses_every_lane(link.bulk_lane)
            address = (socket.AF_INET, link.bulk_lane.sock.getpeername())
            with pytest.raises(ConnectionError):  # plaintext joins: refused under CURVE
                bulk.connect_greeted(address, bulk.MAGIC_JOIN, link.token, timeout=10.0)
            with pytest.raises((ConnectionError, OSError)):  # the token without the lane key: HELLO fails
                sock, _ = bulk.connect_sealed(address, link.token, sealed_lane.new_lane_key(), timeout=10.0,
                                              magic=bulk.MAGIC_SEALED_JOIN)
                sock.settimeout(10.0)
                assert bulk.recv_exactly(sock, 1) is None
            assert len(link.bulk_lane.lanes) == 3 and not link.bulk_lane.closed
            _round_trip_uses_every_lane(link.bulk_lane)
        finally:
            genie.shutdown()
            rt.config = saved


_UPLOADER = """
import sys, torch, genie
genie.init(sys.argv[1])
big = torch.ones(16 << 20)  # 64 MiB: split over the lanes
print("ready", flush=True)
while True:
    big.to("remote_accelerator:0")
"""


def test_a_client_killed_mid_striped_upload_leaves_the_daemon_serving_others():
    with DaemonProcess(local_lane=False) as d:
        uploader = subprocess.Popen([sys.executable, "-c", _UPLOADER, d.endpoint], stdout=subprocess.PIPE, text=True)
        try:
            assert uploader.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # uploads under way
            uploader.kill()
            uploader.wait(10)
        finally:
            uploader.kill()
            uploader.wait(10)
        with connected(d.endpoint) as link:
            _round_trip_uses_every_lane(link.bulk_lane)
        assert d.proc.poll() is None
