"""A daemon's direct lane to a peer (daemon/peer_direct.py) over a socket pair: messages written
without waiting arrive whole and in order, the peer's answers are read (a refusal logged), and a
lane the peer closed says so, so that deposits go inside ZeroMQ again. No daemon."""
from __future__ import annotations

import asyncio
import logging
import socket

from genie.transport import protocol, stream_framing
from genie_daemon.peer_direct import PeerDirectLane


def test_messages_arrive_whole_and_in_order_even_past_the_socket_buffer(caplog):
    async def scenario():
        ours, theirs = socket.socketpair()
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        lane = PeerDirectLane(asyncio.get_running_loop(), "tcp://peer:1", ours)
        big = bytes(range(256)) * 4096  # 1 MiB: more than the socket takes at once
        for n in range(3):
            assert lane.write([protocol.pack(["deposit", n, {"n": n}]), big])
        assert lane.writer.pending  # the rest waits for the socket to be writable
        theirs.setblocking(False)
        reader = stream_framing.MessageReader(theirs, 8, 1 << 22, 1 << 24)
        got: list = []
        for _ in range(5000):
            await asyncio.sleep(0.001)  # the loop flushes as this end reads
            got.extend(reader.read())
            if len(got) == 3:
                break
        theirs.setblocking(True)
        theirs.sendall(b"".join(stream_framing.encode([protocol.pack([1, False, {"message": "mailbox full"}])])))
        await asyncio.sleep(0.05)  # the answer is read by the loop
        theirs.close()
        await asyncio.sleep(0.05)
        return lane, got

    with caplog.at_level(logging.INFO, logger="genie.daemon"):
        lane, got = asyncio.run(scenario())
    assert [protocol.unpack_header(m[0].buffer)[2] for m in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert all(m[1].bytes == bytes(range(256)) * 4096 for m in got)
    assert "refused a transfer" in caplog.text and "mailbox full" in caplog.text
    assert lane.closed  # the peer closed: the next deposit goes another way
    assert not lane.write([protocol.pack(["deposit", 9, {}])])
