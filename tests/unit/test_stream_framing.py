"""Direct-lane framing (genie.transport.stream_framing) over a socketpair: no daemon."""
from __future__ import annotations

import random
import socket
import struct
import threading

import pytest

from genie.transport import stream_framing as sf
from genie.transport.errors import ProtocolError


def _pair():
    a, b = socket.socketpair()
    b.setblocking(False)
    return a, b


def test_messages_arriving_in_pieces_are_put_back_together():
    a, b = _pair()
    reader = sf.MessageReader(b, 16, 1 << 20, 1 << 22)
    messages = [[b"header", b"", b"x" * 100_000], [b"h2"], [b"a" * 5, b"b" * 70_000, b""]]
    rng = random.Random(0)
    out = []
    for m in messages:
        data = b"".join(bytes(x) for x in sf.encode(m))
        i = 0
        while i < len(data):
            k = rng.randint(1, 30_000)
            a.sendall(data[i:i + k])
            i += k
            out += reader.read()
    out += reader.read()
    assert [[f.bytes for f in m] for m in out] == messages
    a.close(), b.close()


@pytest.mark.parametrize("prefix, match", [
    (struct.pack("<I", 0), "0 frames"),
    (struct.pack("<I", 17), "17 frames"),
    (struct.pack("<IQ", 1, (1 << 20) + 1), "exceeds the limit"),
    (struct.pack("<IQQ", 2, 1 << 20, 1 << 20) , "exceeds the limit"),
])
def test_bad_counts_and_lengths_are_refused_before_anything_is_allocated(prefix, match):
    a, b = _pair()
    reader = sf.MessageReader(b, 16, 1 << 20, (1 << 20) + 10)
    a.sendall(prefix)
    with pytest.raises(ProtocolError, match=match):
        reader.read()
    a.close(), b.close()


def test_a_closed_peer_is_reported():
    a, b = _pair()
    reader = sf.MessageReader(b, 16, 1 << 20, 1 << 20)
    a.sendall(b"\x01\x00")
    a.close()
    with pytest.raises(ConnectionError):
        reader.read()
    b.close()


def test_messages_sent_just_before_the_peer_closed_are_returned_first():
    a, b = _pair()
    reader = sf.MessageReader(b, 16, 1 << 20, 1 << 20)
    for m in ([b"exec"], [b"bye", b"x" * 10]):
        a.sendall(b"".join(bytes(x) for x in sf.encode(m)))
    a.close()
    assert [[f.bytes for f in m] for m in reader.read()] == [[b"exec"], [b"bye", b"x" * 10]]
    with pytest.raises(ConnectionError):
        reader.read()
    b.close()


def test_the_writer_never_blocks_and_keeps_order():
    a, b = _pair()
    writer = sf.MessageWriter(b)
    big = bytes(range(256)) * 8192  # 2 MiB: more than the socket takes at once
    writer.write([b"first", big])
    writer.write([b"second"])
    assert writer.pending  # the rest waits for the reader
    got = []
    t = threading.Thread(target=lambda: got.extend(sf.receive_message(a, 4, 1 << 22, 1 << 23) for _ in range(2)))
    t.start()
    while writer.pending:
        writer.flush()
    t.join(10)
    assert [[f.bytes for f in m] for m in got] == [[b"first", big], [b"second"]]
    a.close(), b.close()
