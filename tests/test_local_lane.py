"""A tcp:// daemon's local lane: clients on the daemon's host, as its user, open their lanes on an
abstract Unix socket the daemon names in hello, and large payloads travel in shared memory (as to
an ipc:// daemon) instead of through TCP. Anyone else, or a client that cannot reach that socket
(another network namespace), keeps the tcp lanes; the offer is checked before it is used."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import zmq

import genie
from daemons import DaemonProcess, connected, curve_pair
from genie.transport import bulk, lane_set, shared_segments

pytestmark = pytest.mark.skipif(not shared_segments.supported() or bulk.local_lane_name() is None,
                                reason="needs Linux shared-memory segments and abstract Unix sockets")


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
    with connected(local_daemon.endpoint) as link:
        info = genie.transport_info()["links"][local_daemon.endpoint]
        assert info["path"] == "zmq+bulk-shared-memory" and info["direct_lane"] and info["local_lane"]
        assert link.request("stats", {"dev": 0}).body["local_lane_clients"] == 1  # proven of this host and user
        assert link.bulk_lane.sock.family == socket.AF_UNIX
        _round_trip()
        x = torch.randn(1 << 22, device="remote_accelerator:0")  # 16 MiB down: a segment of the daemon's
        held = x.cpu()
        assert link.bulk_lane.shared and link.bulk_lane._incoming.in_use() == 1  # the daemon's segment, mapped here
        assert torch.equal(held, x.cpu())
        assert (x[:4] + 1).sum().item() == pytest.approx((held[:4] + 1).sum().item(), rel=1e-5)


def test_a_client_that_asks_for_no_shared_memory_keeps_the_tcp_lanes(local_daemon):
    with connected(local_daemon.endpoint, shared_memory=False) as link:
        info = genie.transport_info()["links"][local_daemon.endpoint]
        assert info["path"] == "zmq+bulk-tcp" and not info["local_lane"]
        assert link.request("stats", {"dev": 0}).body["local_lane_clients"] == 0
        assert len(link.bulk_lane.lanes) == lane_set.DEFAULT_TCP_LANES
        _round_trip()


def test_an_offer_from_another_host_or_user_is_not_taken(local_daemon, monkeypatch):
    monkeypatch.setattr(shared_segments, "host_id", lambda: "another-host")
    with connected(local_daemon.endpoint):
        assert genie.transport_info()["links"][local_daemon.endpoint]["path"] == "zmq+bulk-tcp"
        _round_trip()


def test_an_unreachable_local_listener_falls_back_to_tcp(local_daemon, monkeypatch):
    """As from a container on the daemon's host with a network namespace of its own (the abstract
    socket is not there): the connect is refused at once, and the tcp lanes are opened."""
    monkeypatch.setattr(bulk, "local_lane_address",
                        lambda offered: (socket.AF_UNIX, "\0genie-lanes-1-0000000000000000"))
    with connected(local_daemon.endpoint) as link:
        assert genie.transport_info()["links"][local_daemon.endpoint]["path"] == "zmq+bulk-tcp"
        assert link.bulk_lane.sock.family != socket.AF_UNIX
        _round_trip()


def test_a_daemon_started_with_no_local_lane_offers_none():
    with DaemonProcess("tcp://127.0.0.1:0", local_lane=False) as d, connected(d.endpoint):
        assert genie.transport_info()["links"][d.endpoint]["path"] == "zmq+bulk-tcp"


def test_offers_are_checked_before_use():
    good = bulk.local_lane_offer(bulk.local_lane_name())
    assert bulk.local_lane_address(good) == (socket.AF_UNIX, good["path"])
    for bad in (None, [], "x", {**good, "host": "another-host"}, {**good, "uid": good["uid"] + 1},
                {**good, "uid": str(good["uid"])}, {**good, "path": "/tmp/genie.sock"},
                {**good, "path": "\0some-other-service"}, {**good, "path": good["path"] + "0"},
                {**good, "path": b"\0genie-lanes-1-0000000000000000"}, {k: v for k, v in good.items() if k != "path"}):
        assert bulk.local_lane_address(bad) is None, bad



def _greet_as(uid: int | None, address, greeting: bytes) -> bytes:
    """The daemon's one-byte answer to `greeting` on `address`, sent from a child process running
    as `uid` (forked: the interpreter lives under /root, which another user cannot run)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: sockets only, then out without running any of the parent's cleanup
        answer = b"?"
        try:
            if uid is not None:
                os.setgid(uid), os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(address)
            sock.sendall(greeting)
            answer = sock.recv(1) or b"-"
        finally:
            os.write(write_end, answer)
            os._exit(0)
    os.close(write_end)
    try:
        return os.read(read_end, 1)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root, to act as another user")
def test_another_user_on_the_host_gets_no_shared_memory_even_with_the_token(local_daemon):
    """An abstract socket has no file permissions: any local user can connect. A greeting with a
    live client's token (as if it leaked), asking for shared memory from another uid, is taken as
    a plain lane: the daemon checks the peer's credentials (SO_PEERCRED) before it agrees."""
    with connected(local_daemon.endpoint) as link:
        address = link.bulk_lane.sock.getpeername()
        greeting = bulk.MAGIC_SHARED + link.token
        assert _greet_as(65534, address, greeting) == bulk.ACCEPTED
        assert _greet_as(None, address, greeting) == bulk.ACCEPTED_SHARED
    # Nor does another uid's lane there count as proof of this host and user (which would let a
    # daemon listening beyond this host take CUDA IPC handles from that client).
    with connected(local_daemon.endpoint, shared_memory=False) as link:  # on the tcp lanes
        assert _greet_as(65534, address, bulk.MAGIC_SHARED + link.token) == bulk.ACCEPTED
        assert link.request("stats", {"dev": 0}).body["local_lane_clients"] == 0


@pytest.fixture(scope="module")
def curve_daemon(tmp_path_factory):
    """A tcp daemon under CURVE with its local lane, and genie.init's key arguments for it."""
    flags, keys = curve_pair(tmp_path_factory.mktemp("local-curve"))
    with DaemonProcess(extra=flags, local_lane=True) as d:
        yield d, keys


@pytest.mark.skipif(not zmq.has("curve"), reason="needs a libzmq built with CURVE")
def test_under_curve_a_client_on_the_host_uses_the_local_lane(curve_daemon):
    """ZeroMQ stays encrypted; the lanes go to the local listener, plain (the bytes never leave
    the kernel) and with shared memory, instead of sealed over TCP."""
    daemon, keys = curve_daemon
    _uses_shared_memory_under_curve(daemon.endpoint, keys, local_lane=True)


def _uses_shared_memory_under_curve(endpoint: str, keys: dict, local_lane: bool) -> None:
    """genie.init with CURVE keys: ZeroMQ encrypted, plain lanes in shared memory (`local_lane`:
    a tcp daemon's local listener), and round trips as on the CPU."""
    genie.init(endpoint, **keys)
    try:
        info = genie.transport_info()["links"][endpoint]
        assert info["encrypted"] and info["path"] == "zmq+bulk-shared-memory" and info["direct_lane"]
        assert info["local_lane"] == local_lane
        _round_trip(1 << 22)
        assert (torch.ones(3, device="remote_accelerator:0") + 1).sum().item() == 6.0
    finally:
        genie.shutdown()


@pytest.mark.skipif(not zmq.has("curve"), reason="needs a libzmq built with CURVE")
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root, to act as another user")
def test_under_curve_the_local_lanes_refuse_another_user_even_with_the_token(curve_daemon):
    """Under CURVE a plain lane is for the daemon's own user only: another uid's greeting, even
    with a live client's token, is closed unanswered (a plain tcp daemon would give it a plain lane)."""
    daemon, keys = curve_daemon
    genie.init(daemon.endpoint, **keys)
    try:
        link = genie.get_runtime().links[0]
        address = link.bulk_lane.sock.getpeername()
        for magic in (bulk.MAGIC_SHARED, bulk.MAGIC):
            assert _greet_as(65534, address, magic + link.token) == b"-"
        assert _greet_as(None, address, bulk.MAGIC_SHARED + link.token) == bulk.ACCEPTED_SHARED
    finally:
        genie.shutdown()


@pytest.mark.skipif(not zmq.has("curve"), reason="needs a libzmq built with CURVE")
def test_under_curve_a_client_of_its_users_ipc_daemon_moves_payloads_in_shared_memory(tmp_path):
    """An ipc daemon's socket file is its user's: under CURVE a client of that user opens plain
    lanes on it, with shared memory, as on a tcp daemon's local listener (before, sealed lanes
    through the socket). ZeroMQ stays encrypted."""
    from daemons import ipc_endpoint

    flags, keys = curve_pair(tmp_path)
    endpoint, _ = ipc_endpoint()
    with DaemonProcess(endpoint, extra=flags) as daemon:
        _uses_shared_memory_under_curve(daemon.endpoint, keys, local_lane=False)  # that names a tcp daemon's


@pytest.mark.skipif(not zmq.has("curve"), reason="needs a libzmq built with CURVE")
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root, to act as another user")
def test_under_curve_an_ipc_daemon_takes_plain_lanes_from_its_own_user_only(tmp_path):
    """Another uid that can reach the socket file (its permissions opened here), even with a live
    client's token, gets no plain lane there; a client whose daemon's socket file is another
    user's does not ask for one, and goes sealed."""
    from daemons import ipc_endpoint

    flags, keys = curve_pair(tmp_path)
    endpoint, directory = ipc_endpoint()
    with DaemonProcess(endpoint, extra=flags) as daemon:
        genie.init(daemon.endpoint, **keys)
        try:
            link = genie.get_runtime().links[0]
            path = link.bulk_lane.sock.getpeername()  # the lane listener's socket file, beside ZeroMQ's
            os.chmod(directory, 0o755), os.chmod(path, 0o777)
            for magic in (bulk.MAGIC_SHARED, bulk.MAGIC):
                assert _greet_as(65534, path, magic + link.token) == b"-"
            assert _greet_as(None, path, bulk.MAGIC_SHARED + link.token) == bulk.ACCEPTED_SHARED
        finally:
            genie.shutdown()
        os.chown(path, 65534, 65534)
        genie.init(daemon.endpoint, **keys)
        try:
            assert genie.transport_info()["links"][daemon.endpoint]["path"] == "zmq+bulk-unix-sealed"
            _round_trip(1 << 22)
        finally:
            genie.shutdown()


def test_only_a_unix_socket_file_of_this_user_counts_as_its_own_listener(tmp_path):
    path = str(tmp_path / "l.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        assert bulk.own_unix_listener((socket.AF_UNIX, path)) == (socket.AF_UNIX, path)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            os.chown(path, 65534, 65534)
            assert bulk.own_unix_listener((socket.AF_UNIX, path)) is None
    finally:
        listener.close()
    assert bulk.own_unix_listener((socket.AF_UNIX, str(tmp_path / "gone.sock"))) is None
    assert bulk.own_unix_listener((socket.AF_INET, ("127.0.0.1", 5555))) is None
    assert bulk.own_unix_listener(None) is None
