"""Authenticated, encrypted daemons (CURVE), and no open daemon on a network by accident."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch
import zmq

import genie
from daemons import DaemonProcess, RecordingProxy
from genie import GenieConnectionError
from genie.runtime import get_runtime
from genie.transport import protocol

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="needs a libzmq built with CURVE")

MARKER = b"GENIE-PLAINTEXT-MARKER-0123456789"


def _keygen(directory, name):
    out = subprocess.run([sys.executable, "-m", "genie_daemon", "keygen", str(directory), "--name", name],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return str(directory / f"{name}.key"), str(directory / f"{name}.key_secret")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    allow = root / "allowed"
    allow.mkdir()
    server_public, server_secret = _keygen(root, "daemon")
    good_public, good_secret = _keygen(root, "alice")
    _, bad_secret = _keygen(root, "mallory")
    os.replace(good_public, allow / "alice.key")  # only alice's public key is allowed
    _, other_server_secret = _keygen(root, "impostor")
    return dict(server_public=server_public, server_secret=server_secret, allow=str(allow),
                good=good_secret, bad=bad_secret, impostor_public=str(root / "impostor.key"))


@pytest.fixture
def short_connect(monkeypatch):
    rt = get_runtime()
    monkeypatch.setattr(rt, "config", dataclasses.replace(rt.config, connect_timeout=3.0))


@pytest.fixture(scope="module")
def curve_daemon(keys):
    with DaemonProcess(extra=["--curve-secret", keys["server_secret"], "--allow-keys", keys["allow"]]) as d:
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
        assert info["encrypted"] is True and info["path"] == "zmq"  # no plaintext bulk lane under CURVE
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
        ctx.term()


@pytest.mark.parametrize("encrypted", [False, True])
def test_payloads_are_unreadable_on_the_wire_only_with_curve(keys, encrypted, monkeypatch):
    import dataclasses

    # The proxy records the ZeroMQ connection; the plaintext direct lane (off under CURVE) would
    # carry this small request past it.
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
