"""The daemon's idle polling (DaemonServer._spin): when it polls, what ends it, and its back-off."""
from __future__ import annotations

import time

import torch
import zmq

from genie.transport import busy_poll
from daemon.handles import ClientState, MemoryAccount
from daemon.server import DaemonServer


def _client(peer: str | None = None) -> ClientState:
    client = ClientState(b"x" * 16, MemoryAccount())
    client.peer = peer
    return client


def _server(spin_s: float) -> DaemonServer:
    srv = DaemonServer("tcp://127.0.0.1:0", [torch.device("cpu")], bulk_lanes=False, spin_s=spin_s)
    srv.bind()
    srv.clients[b"one-client-id-xx"] = _client()  # polling needs exactly one client
    return srv


def test_idle_polling_returns_as_soon_as_a_request_is_queued_and_backs_off_after_misses():
    srv = _server(spin_s=0.05)
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        client.connect(srv.bound_endpoint)
        client.send(b"hello")
        deadline = time.monotonic() + 5
        while not srv._spin(srv._socket):  # the first polls may run out before the connection is up
            assert time.monotonic() < deadline
        srv._socket.recv_multipart()
        srv._busy_poll.off_until = 0.0
        misses = busy_poll.SPIN_MISSES
        started = time.perf_counter()
        for _ in range(misses):
            assert srv._spin(srv._socket) is False  # nothing queued: each poll runs out
        assert time.perf_counter() - started >= misses * 0.05 * 0.9
        started = time.perf_counter()
        assert srv._spin(srv._socket) is False  # backed off: returns at once
        assert time.perf_counter() - started < 0.025
        srv._busy_poll.off_until = 0.0
        srv.clients[b"a-peer-elsewhere"] = _client("elsewhere")  # a peer daemon on another host
        client.send(b"again")
        deadline = time.monotonic() + 5
        while not srv._spin(srv._socket):  # it takes no CPU here: still polling
            assert time.monotonic() < deadline
        srv._socket.recv_multipart()
        srv._busy_poll.off_until = 0.0
        srv.clients[b"another-client-x"] = _client()
        started = time.perf_counter()
        assert srv._spin(srv._socket) is False  # never with two clients
        assert time.perf_counter() - started < 0.025
    finally:
        client.close(0)
        ctx.destroy(linger=0)
        srv._socket.close(0)
        srv._worker.shutdown(wait=False)


def test_no_polling_when_switched_off():
    srv = _server(spin_s=0.0)  # --spin-us 0
    try:
        started = time.perf_counter()
        assert srv._spin(srv._socket) is False
        assert time.perf_counter() - started < 0.025
    finally:
        srv._socket.close(0)
        srv._worker.shutdown(wait=False)


def test_no_polling_while_an_answer_waits_to_be_written():
    # The rest of an answer too big for its direct lane's socket goes when the socket is writable,
    # which the event loop itself services: a spin then only delayed it (a 1 MiB .cpu() by ~0.9 ms).
    import socket

    from daemon.direct_lanes import DirectLane
    from genie.transport import stream_framing

    srv = _server(spin_s=0.05)
    ours, peer = socket.socketpair()
    try:
        ours.setblocking(False)
        lane = DirectLane(ours, b"lane", stream_framing.MessageReader(ours, 8, 1 << 20, 1 << 20),
                           stream_framing.MessageWriter(ours))
        srv._direct[lane.identity] = lane
        lane.writer.write([b"x" * (16 << 20)])  # more than the socket buffers take; the peer reads nothing
        assert lane.writer.pending
        started = time.perf_counter()
        assert srv._spin(srv._socket) is False
        assert time.perf_counter() - started < 0.025
    finally:
        ours.close()
        peer.close()
        srv._socket.close(0)
        srv._worker.shutdown(wait=False)
