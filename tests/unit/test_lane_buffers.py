"""The daemon's side of a Unix-socket lane gets the widened buffers too: accept() gives a Unix
socket the system's default buffers, not the listener's (TCP's inherit them), and a stream's
sender's buffer bounds how much one send takes (a 1 MiB answer left in ~200 KiB pieces)."""
from __future__ import annotations

import queue
import socket
import tempfile
import time

import pytest

from daemon.bulk_server import BulkListener
from genie.transport import bulk, stream_framing


def _wmem_max() -> int:
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            return int(f.read())
    except OSError:
        pytest.skip("needs /proc/sys/net/core/wmem_max (Linux)")


def _lane_socket(listener: BulkListener) -> socket.socket:
    deadline = time.monotonic() + 5
    while not listener._lanes:
        assert time.monotonic() < deadline, "the lane was not set up"
        time.sleep(0.02)
    return next(iter(listener._lanes.values())).sock


@pytest.mark.parametrize("magic", [bulk.MAGIC, stream_framing.MAGIC])
def test_accepted_unix_lanes_have_widened_send_buffers(magic):
    wanted = min(bulk.UNIX_BUFFER_BYTES, _wmem_max())  # the kernel caps the request there (and doubles it)
    token = bulk.new_token()
    listener = BulkListener(f"ipc://{tempfile.mkdtemp()}/daemon.sock", lambda t: t == token, max_transfer=1 << 30,
                            shared_memory=False)
    accepted: queue.Queue = queue.Queue()
    listener.on_direct = lambda conn, _token, _sealing: accepted.put(conn)
    try:
        client, _ = bulk.connect_greeted(bulk.connect_address(listener.advertised, "ipc:///unused"), magic, token, 5.0)
        try:
            conn = accepted.get(timeout=5) if magic == stream_framing.MAGIC else _lane_socket(listener)
            assert conn.family == socket.AF_UNIX
            assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= wanted
        finally:
            client.close()
    finally:
        listener.close()
