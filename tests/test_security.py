"""Authenticated, encrypted daemons (CURVE), and no open daemon on a network by accident."""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import zmq

import genie
from daemons import DaemonProcess, RecordingProxy, child_pythonpath, keygen
from genie import GenieConnectionError
from genie.runtime import get_runtime
from genie.transport import bulk, protocol, sealed_lane, stream_framing

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="needs a libzmq built with CURVE")

MARKER = b"GENIE-PLAINTEXT-MARKER-0123456789"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    allow = root / "allowed"
    allow.mkdir()
    server_public, server_secret = keygen(root, "daemon")
    good_public, good_secret = keygen(root, "alice")
    _, bad_secret = keygen(root, "mallory")
    os.replace(good_public, allow / "alice.key")  # only alice's public key is allowed
    _, other_server_secret = keygen(root, "impostor")
    return dict(server_public=server_public, server_secret=server_secret, allow=str(allow),
                good=good_secret, bad=bad_secret, impostor_public=str(root / "impostor.key"))


@pytest.fixture
def short_connect(monkeypatch):
    rt = get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, connect_timeout=3.0))


@pytest.fixture(scope="module")
def curve_daemon(keys):
    with DaemonProcess(extra=["--curve-secret", keys["server_secret"], "--allow-keys", keys["allow"]],
                       local_lane=False) as d:  # its clients' lanes: sealed tcp ones
        yield d


def _marker_tensor():
    raw = (MARKER * 64)[: 2048]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def test_an_allowed_client_runs_work_encrypted(keys, curve_daemon):
    genie.init(curve_daemon.endpoint, client_key=keys["good"], server_key=keys["server_public"])
    try:
        x = torch.arange(6.0, device="remote_accelerator:0")
        assert (x * 2).sum().item() == 30.0
        info = genie.transport_info()["links"][curve_daemon.endpoint]
        # Large payloads and blocking requests on sealed lanes (no plaintext lane under CURVE).
        assert info["encrypted"] is True and info["path"] == "zmq+bulk-tcp-sealed" and info["direct_lane"] is True
        assert get_runtime().links[0].channel.direct_sealing is not None
        big = torch.randn(3 << 20)  # 12 MiB each way, in sealed units
        lane = get_runtime().links[0].bulk_lane
        sent, received = lane.bytes_sent, lane.bytes_received
        assert torch.equal((big.to("remote_accelerator:0") * 1).cpu(), big)
        assert lane.bytes_sent - sent >= big.nbytes and lane.bytes_received - received >= big.nbytes
        # A direct lane dropped (as a Ctrl-C mid-answer drops it) is opened again, sealed.
        channel = get_runtime().links[0].channel
        channel._drop_direct_stream("dropped by the test")
        deadline = time.monotonic() + 20
        while channel.direct_stream is None:
            assert time.monotonic() < deadline, "no new direct lane"
            time.sleep(0.01)
        assert channel.direct_sealing is not None and (x * 3).sum().item() == 45.0
        assert channel.direct_stream in channel._pollers  # answered on the new, sealed lane
    finally:
        genie.shutdown()


@pytest.mark.skipif(not sealed_lane.available(), reason="needs the cryptography package")
def test_the_lane_listener_of_a_curve_daemon_takes_only_sealed_lanes_keyed_by_hello(keys, curve_daemon):
    """Someone who saw a client's token on the wire (it opens the lane in the clear) can attach
    neither a plaintext lane (which would receive that client's downloads) nor a sealed one
    without the key hello gave the client; the client's own lane carries on."""
    genie.init(curve_daemon.endpoint, client_key=keys["good"], server_key=keys["server_public"])
    try:
        link = get_runtime().links[0]
        address = (socket.AF_INET, link.bulk_lane.sock.getpeername())
        for magic in (bulk.MAGIC, bulk.MAGIC_SHARED, stream_framing.MAGIC):
            with pytest.raises(ConnectionError):
                bulk.connect_greeted(address, magic, link.token, timeout=10.0)
        with pytest.raises((ConnectionError, OSError)):
            sock, sealing = bulk.connect_sealed(address, link.token, sealed_lane.new_lane_key(), timeout=10.0)
            sock.settimeout(10.0)
            assert bulk.recv_exactly(sock, 1) is None  # the daemon closes it: HELLO failed
        big = torch.randn(1 << 20)
        assert torch.equal((big.to("remote_accelerator:0") + 1).cpu(), big + 1)
        assert not link.bulk_lane.closed
    finally:
        genie.shutdown()


@pytest.mark.parametrize("who", ["unlisted client key", "no keys", "wrong daemon key"])
def test_other_clients_cannot_connect(keys, curve_daemon, short_connect, who):
    kwargs = {
        "unlisted client key": dict(client_key=keys["bad"], server_key=keys["server_public"]),
        "no keys": {},
        "wrong daemon key": dict(client_key=keys["good"], server_key=keys["impostor_public"]),
    }[who]
    t0 = time.monotonic()
    with pytest.raises(GenieConnectionError):
        genie.init(curve_daemon.endpoint, **kwargs)
    assert time.monotonic() - t0 < 10
    genie.shutdown()


def test_an_unlisted_key_cannot_execute_anything(keys, curve_daemon):
    """Below the client library: a raw socket with a valid but unlisted key gets no answer at all."""
    public, secret = zmq.auth.load_certificate(keys["bad"])
    server_public, _ = zmq.auth.load_certificate(keys["server_public"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public
    sock.connect(curve_daemon.endpoint)
    try:
        op = ["aten::ones", [[4]], {}, 1 << 16]
        sock.send_multipart([protocol.pack(["exec", 1, {"ops": [op], "fetch": [1 << 16]}])])
        assert sock.poll(2000) == 0
    finally:
        sock.close(0)
        ctx.destroy(linger=0)


@pytest.mark.parametrize("encrypted", [False, True])
def test_payloads_are_unreadable_on_the_wire_only_with_curve(keys, encrypted, monkeypatch):
    import dataclasses

    # The proxy records the ZeroMQ connection; the direct lane (sealed under CURVE, and checked
    # apart in tests/unit/test_sealed_lane.py) would carry this small request past it.
    rt = genie.get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, direct_lane=False))
    extra = ["--curve-secret", keys["server_secret"], "--allow-keys", keys["allow"]] if encrypted else []
    with DaemonProcess("tcp://127.0.0.1:0", extra=extra) as d:
        proxy = RecordingProxy(int(d.endpoint.rsplit(":", 1)[1]))
        kwargs = dict(client_key=keys["good"], server_key=keys["server_public"]) if encrypted else {}
        genie.init(f"tcp://127.0.0.1:{proxy.port}", **kwargs)
        try:
            back = (_marker_tensor().to("remote_accelerator:0") + 0).cpu()
            assert bytes(back.numpy()).startswith(MARKER)
        finally:
            genie.shutdown()
            proxy.close()
        assert len(proxy.recorded) > 4096
        assert (MARKER in proxy.recorded) is (not encrypted)


def test_refuses_a_network_address_without_keys():
    out = subprocess.run([sys.executable, "-m", "genie_daemon", "--listen", "tcp://0.0.0.0:0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "refusing to listen" in out.stderr and "--insecure" in out.stderr
    assert "GENIE_DAEMON_READY" not in out.stdout


def test_keys_must_come_in_pairs(keys):
    out = subprocess.run([sys.executable, "-m", "genie_daemon", "--curve-secret", keys["server_secret"]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "go together" in out.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("local_lane", [False, True])
def test_a_client_given_keys_reconnects_with_them_when_its_daemon_comes_back(keys, monkeypatch, local_lane):
    # genie.init's keys, not only GENIE_CURVE_* ones, carry over a reconnect (before, the
    # reconnect connected without them and a CURVE daemon never answered). With the daemon's local
    # lane, the new daemon's (a new abstract socket) is the one opened.
    rt = get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, connect_refused_timeout=0.5, connect_timeout=5.0))
    extra = ["--curve-secret", keys["server_secret"], "--allow-keys", keys["allow"]]
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    first = DaemonProcess(endpoint, extra=extra, local_lane=local_lane)
    first.start()
    try:
        genie.init(endpoint, client_key=keys["good"], server_key=keys["server_public"])
        assert torch.ones(2, device="remote_accelerator:0").sum().item() == 2.0
        first.proc.kill()
        first.proc.wait(10)
        with pytest.raises(genie.GenieConnectionError):
            torch.ones(2, device="remote_accelerator:0").sum().item()  # lost, and nothing there yet
        with DaemonProcess(endpoint, extra=extra, local_lane=local_lane):
            assert torch.ones(3, device="remote_accelerator:0").sum().item() == 3.0
            info = genie.transport_info()["links"][endpoint]
            assert info["encrypted"] is True and info["local_lane"] is local_lane
            big = torch.randn(1 << 20)  # 4 MiB: on the (new) bulk lane
            assert torch.equal((big.to("remote_accelerator:0") + 1).cpu(), big + 1)
    finally:
        genie.shutdown()
        first.stop()


FORKED_WITH_KEYS = """
import os, sys, torch, genie
endpoint, client_key, server_key = sys.argv[1:4]
genie.init(endpoint, client_key=client_key, server_key=server_key)
assert torch.ones(2, device="remote_accelerator:0").sum().item() == 2.0
pid = os.fork()
if pid == 0:
    try:
        ok = torch.ones(3, device="remote_accelerator:0").sum().item() == 3.0
        os._exit(0 if ok and genie.transport_info()["links"][endpoint]["encrypted"] else 1)
    except BaseException as e:
        print("child:", repr(e), flush=True)
        os._exit(2)
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_connects_with_the_keys_its_parent_was_given(keys, curve_daemon):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(root), "GENIE_CONNECT_TIMEOUT": "5"}
    for name in ("GENIE_SERVER_URL", "GENIE_CURVE_CLIENT_KEY", "GENIE_CURVE_SERVER_KEY"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", FORKED_WITH_KEYS, curve_daemon.endpoint, keys["good"],
                           keys["server_public"]], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "CHILD 0" in done.stdout, done.stdout + done.stderr[-2000:]


def test_without_the_cryptography_package_a_curve_link_sends_everything_through_zeromq(keys, curve_daemon,
                                                                                      monkeypatch):
    """A client without `cryptography` (a node installed with --no-deps) cannot seal lanes: it opens
    none and its payloads go inside CURVE-encrypted ZeroMQ messages, as before sealed lanes."""
    monkeypatch.setattr(sealed_lane, "AESGCM", None)
    genie.init(curve_daemon.endpoint, client_key=keys["good"], server_key=keys["server_public"])
    try:
        info = genie.transport_info()["links"][curve_daemon.endpoint]
        assert info["path"] == "zmq" and info["direct_lane"] is False and info["encrypted"] is True
        big = torch.randn(1 << 20)
        assert torch.equal((big.to("remote_accelerator:0") * 2).cpu(), big * 2)
    finally:
        genie.shutdown()


@pytest.mark.skipif(not sealed_lane.available(), reason="needs the cryptography package")
@pytest.mark.parametrize("local_lane", [False, True])
def test_curve_daemons_send_each_other_large_tensors_on_sealed_lanes(keys, tmp_path, local_lane):
    """Daemons of one cluster share a key pair and allow it: a daemon greets its peer as a client
    does, and large tensors go to it on a sealed lane; or, where the peer offers its local lane
    (one host, one user), in shared memory."""
    import shutil

    allow = tmp_path / "allow"
    allow.mkdir()
    shutil.copy(os.path.join(keys["allow"], "alice.key"), allow / "alice.key")
    shutil.copy(keys["server_public"], allow / "daemon.key")  # the peers' own public key
    flags = ["--curve-secret", keys["server_secret"], "--allow-keys", str(allow)]
    with DaemonProcess(extra=flags, local_lane=local_lane) as a, DaemonProcess(extra=flags, local_lane=local_lane) as b:
        genie.init(f"{a.endpoint},{b.endpoint}", client_key=keys["good"], server_key=keys["server_public"])
        try:
            x = torch.randn(1 << 20, device="remote_accelerator:0")  # 4 MiB
            expected = x.cpu()
            stream = get_runtime().streams[0]
            deadline = time.monotonic() + 20
            while True:
                assert torch.equal(x.to("remote_accelerator:1").cpu(), expected)
                stream.synchronize()
                stats = stream.link.request("stats", {"dev": 0}).body
                if stats["peer_lane_bytes_sent"] or stats["peer_segment_bytes_lent"]:
                    break
                assert time.monotonic() < deadline, "no lane between the daemons"
                time.sleep(0.05)
            assert stats["peer_lanes"] == {b.endpoint: "shared-memory" if local_lane else "tcp-sealed"}
            assert torch.equal((x * 3).to("remote_accelerator:1").cpu(), expected * 3)
        finally:
            genie.shutdown()
