"""Clients and daemons of different protocol versions refuse each other at hello, saying why."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import zmq

from daemons import child_pythonpath
from genie.transport import protocol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _connect_in_a_new_process(endpoint: str) -> subprocess.CompletedProcess:
    code = f"import genie\ngenie.init({endpoint!r})\n"
    env = {**os.environ, "GENIE_CONNECT_TIMEOUT": "10", "PYTHONPATH": child_pythonpath(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_a_client_refuses_a_daemon_that_speaks_another_version():
    # An older daemon does not check the client's version: it answers hello with its own.
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    seen = []

    def old_daemon():
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, header, *_ = router.recv_multipart()
            kind, rid, body = protocol.unpack_header(header)
            seen.append((kind, body))
            if kind == "hello":
                reply = {"version": protocol.VERSION - 1, "devices": [{"type": "cpu", "index": 0}]}
                router.send_multipart([identity, protocol.pack([rid, True, reply])])

    thread = threading.Thread(target=old_daemon, daemon=True)
    thread.start()
    try:
        done = _connect_in_a_new_process(f"tcp://127.0.0.1:{port}")
    finally:
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.destroy(linger=0)
    assert done.returncode != 0
    assert f"speaks protocol version {protocol.VERSION - 1} and this client {protocol.VERSION}" in done.stderr
    assert any(kind == "hello" and body.get("version") == protocol.VERSION for kind, body in seen)  # its own
