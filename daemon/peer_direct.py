"""A direct lane from this daemon to a peer: one plain socket beside ZeroMQ for small deposits.

Inside ZeroMQ a deposit passes an I/O thread at each end: from A's event loop to B's took ~200
us of a 16 KiB copy's ~600 on this 2-core machine. On a direct lane A's loop writes the socket
and B's loop reads it, as for a client's blocking requests (daemon/direct_lanes.py takes it at
B: the peer greets like a client). Writes never wait (stream_framing.LoopMessageWriter: what
the socket does not take now goes when it is writable); B's answers are read here and dropped, a
refusal logged. A lane that fails is closed, and deposits go inside ZeroMQ again.
"""
from __future__ import annotations

import asyncio
import logging
import socket

from genie.transport import bulk, protocol, sealed_lane, stream_framing
from genie.transport.errors import ProtocolError

log = logging.getLogger("genie.daemon")

# Answers are [request id, ok, body]: a refusal's body holds an error message.
_ANSWER_LIMITS = (4, protocol.MAX_HEADER_BYTES + 4096, 1 << 20)


def connect(address, token: bytes, lane_key: bytes | None, timeout: float):
    """(Blocking.) A greeted direct-lane socket to a peer's lane listener at `address`, and its
    sealing (under CURVE, with the lane key the peer gave in hello) or None."""
    if lane_key is None:
        return bulk.connect_greeted(address, stream_framing.MAGIC, token, timeout)[0], None
    return bulk.connect_sealed(address, token, sealed_lane.check_lane_key(lane_key), timeout,
                               stream_framing.MAGIC_SEALED)


class PeerDirectLane:
    """(The event loop.) One open direct lane to a peer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: str, sock, sealing=None) -> None:
        sock.setblocking(False)
        self.loop, self.endpoint, self.sock = loop, endpoint, sock
        if sealing is None:
            self.reader = stream_framing.MessageReader(sock, *_ANSWER_LIMITS)
        else:
            self.reader = stream_framing.SealedMessageReader(sock, sealing[1], *_ANSWER_LIMITS)
        self.writer = stream_framing.LoopMessageWriter(loop, sock, sealing[0] if sealing is not None else None,
                                                       on_failure=self.close)
        self.path = "tcp-sealed" if sealing is not None else "unix" if sock.family == socket.AF_UNIX else "tcp"
        self.closed = False
        self.sent = 0  # messages written
        loop.add_reader(sock.fileno(), self._read)

    def write(self, parts: list) -> bool:
        """Write one message (header, frames); False where the lane is closed or fails now (the
        message did not go: send it another way)."""
        if self.closed or not self.writer.send(parts):
            return False
        self.sent += 1
        return True

    def _read(self) -> None:
        try:
            messages = self.reader.read()
        except (ConnectionError, OSError, ProtocolError) as e:
            self.close(e)
            return
        for parts in messages:
            try:
                header = protocol.unpack_header(parts[0].buffer)
            except ProtocolError:
                continue
            if isinstance(header, list) and len(header) == 3 and header[1] is False:
                log.warning("peer %s refused a transfer: %s", self.endpoint, header[2])

    def close(self, why=None) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.loop.remove_reader(self.sock.fileno())
        except (ValueError, OSError, RuntimeError):  # RuntimeError: the loop is closed (daemon stopping)
            pass
        self.writer.stop()
        self.sock.close()
        if why is not None:
            log.info("direct lane to peer %s closed (its deposits go over ZeroMQ): %s", self.endpoint, why)
