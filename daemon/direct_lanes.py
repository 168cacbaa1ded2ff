"""Direct lanes: one stream socket per client, beside ZeroMQ, for the requests it blocks on
and their answers (read and written by the daemon's event loop, without ZeroMQ's I/O thread).

`DirectLanes` is a mixin of `DaemonServer`: the bulk listener hands over each accepted
connection (`_direct_threadsafe`); messages read from it go to the server's `_handle_safely`
with the lane's identity (the client's token plus DIRECT_SUFFIX) in front, as a ZeroMQ routing
id would be, and answers to that identity are written back on the lane.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time

from genie.transport import protocol, stream_framing, tensors
from genie.transport.errors import ProtocolError

log = logging.getLogger("genie.daemon")

DIRECT_SUFFIX = b"\x02"  # appended to a client's token: the identity of its direct lane


def max_frame_bytes() -> int:
    """The largest frame a valid message has (a header or a payload chunk), with some slack."""
    return max(tensors.MAX_FRAME_BYTES, protocol.MAX_HEADER_BYTES) + 4096


def client_key(routing_id: bytes) -> bytes:
    """The client a routing id belongs to: a client's direct socket uses its 16-byte id plus one byte."""
    return routing_id[:16] if len(routing_id) == 17 else routing_id


@dataclasses.dataclass(eq=False)
class DirectLane:
    """One client's direct-lane connection, with its framing state each way."""

    sock: object
    identity: bytes
    reader: stream_framing.MessageReader | stream_framing.SealedMessageReader
    # Once an answer could not be written (the client cut the lane, or left) it fails and later
    # answers are dropped, and the lane is still read to its end, since requests the client wrote
    # before the cut wait in it and must run, in order (a Unix socket refuses writes to a peer gone at once).
    writer: stream_framing.LoopMessageWriter

    def __post_init__(self) -> None:
        self.identity_frame = stream_framing.Frame(self.identity)  # heads each request, as a ZeroMQ routing id would


class DirectLanes:
    """The direct-lane half of DaemonServer (self._direct: identity -> DirectLane)."""

    def _direct_threadsafe(self, conn, token: bytes, sealing=None) -> None:
        loop = self._loop
        if loop is None or self._stopping.is_set():
            conn.close()
            return
        loop.call_soon_threadsafe(self._adopt_direct, conn, token, sealing)

    def _adopt_direct(self, conn, token: bytes, sealing=None) -> None:
        """A client's direct lane: its blocking requests and their answers, read and written here
        (sealed, with `sealing`'s (sending, receiving) directions, under CURVE)."""
        conn.setblocking(False)
        identity = token + DIRECT_SUFFIX  # client_key() maps it to the client, like its ZeroMQ sockets
        limits = (protocol.MAX_FRAMES + 1, max_frame_bytes(), self.bulk.max_transfer if self.bulk is not None else 1 << 40)
        if sealing is None:
            reader = stream_framing.MessageReader(conn, *limits)
        else:
            reader = stream_framing.SealedMessageReader(conn, sealing[1], *limits)
        writer = stream_framing.LoopMessageWriter(self._loop, conn, sealing[0] if sealing is not None else None)
        lane = DirectLane(conn, identity, reader, writer)
        writer.on_failure = functools.partial(self._stopped_writing, lane)
        old = self._direct.get(identity)
        if old is not None:
            # The client opened a new lane (its old one was cut by a Ctrl-C mid-answer): requests
            # it sent on the old one before are handled first, in order, then that one is closed.
            self._on_direct_readable(old)
            if self._direct.get(identity) is old:
                self._close_direct(old, "replaced")
        client = self.clients.get(token)
        if client is not None:
            client.lane_closed_at = None  # it has a lane again (see DaemonServer._gone)
        self._direct[identity] = lane
        self._loop.add_reader(conn.fileno(), self._on_direct_readable, lane)

    def _on_direct_readable(self, lane: "DirectLane") -> None:
        if self._direct.get(lane.identity) is not lane:
            return  # closed meanwhile
        try:
            messages = lane.reader.read()
        except (ConnectionError, OSError) as e:  # the client closed it: most often, its process ended
            self._close_direct(lane, e)
            client = self.clients.get(client_key(lane.identity))
            if client is not None:
                client.lane_closed_at = time.monotonic()
            return
        except ProtocolError as e:  # framing is lost: no way to find the next message
            log.warning("closing the direct lane of %s: %s", lane.identity.hex(), e)
            self._close_direct(lane, e)
            return
        for parts in messages:
            self._handle_safely([lane.identity_frame, *parts])
        if messages and self._direct.get(lane.identity) is lane and self._spin(self._socket):
            self._schedule_drain()

    def _send_direct(self, lane: "DirectLane", parts: list) -> None:
        lane.writer.send(parts)  # dropped once the writer failed: nobody reads this lane any more

    @staticmethod
    def _stopped_writing(lane: "DirectLane", why) -> None:
        """An answer could not be written: no more answers go on this lane, but requests already in
        it are still read and run (the reader closes the lane at its end)."""
        log.info("direct lane of %s takes no more answers: %s", lane.identity.hex(), why)

    def _close_direct(self, lane: "DirectLane", why) -> None:
        if self._direct.get(lane.identity) is lane:
            del self._direct[lane.identity]
        try:
            self._loop.remove_reader(lane.sock.fileno())
        except (ValueError, OSError):
            pass
        lane.writer.stop()
        lane.sock.close()
        log.info("direct lane of %s closed: %s", lane.identity.hex(), why)

    def _drop_direct(self, identity: bytes) -> None:
        lane = self._direct.get(identity)
        if lane is not None:
            self._close_direct(lane, "client left")
