"""Direct-lane framing (genie.transport.stream_framing) over a socketpair: no daemon."""
from __future__ import annotations

import random
import socket
import struct
import threading
import time

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


def test_a_small_message_the_socket_cannot_take_now_is_kept_whole():
    a, b = _pair()
    filler, sent = b"x" * 4096, 0
    try:
        while True:  # fill the socket: the writer's one-send path for a small message meets a full socket
            sent += b.send(filler)
    except BlockingIOError:
        pass
    writer = sf.MessageWriter(b)
    writer.write([b"small"])
    assert writer.pending
    got = []

    def read() -> None:
        left = sent
        while left:
            left -= len(a.recv(min(left, 1 << 16)))
        got.append(sf.receive_message(a, 4, 1 << 10, 1 << 10))

    t = threading.Thread(target=read)
    t.start()
    deadline = time.monotonic() + 10
    while writer.pending and time.monotonic() < deadline:
        writer.flush()
    t.join(10)
    assert not writer.pending and [f.bytes for f in got[0]] == [b"small"]
    a.close(), b.close()


def test_one_part_messages_are_framed_like_any_other():
    for part in (b"", b"h", bytes(1000)):
        fast = sf.encode([part])
        assert len(fast) == 1 and fast[0] == struct.pack("<IQ", 1, len(part)) + part


class _CountingSocket:
    """The reader's side of a socketpair, counting its recv_into calls."""

    def __init__(self, sock) -> None:
        self.sock, self.reads = sock, 0

    def recv_into(self, *args):
        self.reads += 1
        return self.sock.recv_into(*args)


def test_a_small_message_takes_one_read_and_frames_outlive_the_staging_buffer():
    a, b = _pair()
    counting = _CountingSocket(b)
    reader = sf.MessageReader(counting, 16, 1 << 20, 1 << 22)
    a.sendall(b"".join(bytes(x) for x in sf.encode([b"exec-header", b"payload"])))
    first = reader.read()
    assert [[f.bytes for f in m] for m in first] == [[b"exec-header", b"payload"]]
    assert counting.reads == 1  # count, lengths and frames in one recv, and no recv that finds nothing
    # Later messages go through the same staging buffer: frames already handed out keep their bytes.
    for i in range(50):
        a.sendall(b"".join(bytes(x) for x in sf.encode([b"%d" % i * 700, b"y" * 3000])))
        assert [[f.bytes for f in m] for m in reader.read()] == [[b"%d" % i * 700, b"y" * 3000]]
    assert [f.bytes for f in first[0]] == [b"exec-header", b"payload"]
    a.close(), b.close()


def test_the_blocking_reader_takes_a_one_frame_message_in_two_reads():
    a, b = socket.socketpair()
    counting = _CountingSocket(b)
    messages = [[b"answer"], [b"header", b"", b"z" * 70000], [b""]]
    for parts in messages:
        a.sendall(b"".join(bytes(x) for x in sf.encode(parts)))
    got = [sf.receive_message(counting, 4, 1 << 20, 1 << 20) for _ in messages]
    assert [[f.bytes for f in m] for m in got] == messages
    counting.reads = 0
    a.sendall(sf.encode([b"answer"])[0])
    assert [f.bytes for f in sf.receive_message(counting, 4, 1 << 20, 1 << 20)] == [b"answer"]
    assert counting.reads == 2  # count and length together, then the frame
    a.close(), b.close()


def test_many_messages_in_one_read_and_a_length_table_bigger_than_the_stage():
    a, b = _pair()
    reader = sf.MessageReader(b, 20_000, 1 << 20, 1 << 24)
    many = [[b"m%d" % i, b"z" * (i % 7)] for i in range(300)]
    wide = [b"w%d" % i for i in range(10_000)]  # an 80 KB length table
    big = [b"h", bytes(range(256)) * 1024]  # a 256 KiB frame: its own buffer
    data = b"".join(b"".join(bytes(x) for x in sf.encode(m)) for m in [*many, wide, big])
    t = threading.Thread(target=a.sendall, args=(data,))
    t.start()
    out, deadline = [], time.monotonic() + 20
    while len(out) < len(many) + 2 and time.monotonic() < deadline:
        out += reader.read()
    t.join(10)
    assert [[f.bytes for f in m] for m in out] == [*many, wide, big]
    a.close(), b.close()


def test_a_loop_writer_flushes_on_the_loop_and_stops_once_a_write_fails():
    import asyncio

    failures: list = []

    async def scenario():
        a, b = _pair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer = sf.LoopMessageWriter(asyncio.get_running_loop(), b, on_failure=failures.append)
        big = bytes(range(256)) * 2048  # 512 KiB: more than the socket takes now
        assert writer.send([b"header", big])
        assert writer.pending  # the rest goes when the loop sees the socket writable
        a.settimeout(10)
        got = await asyncio.get_running_loop().run_in_executor(None, sf.receive_message, a, 4, 1 << 20, 1 << 20)
        for _ in range(100):
            if not writer.pending:
                break
            await asyncio.sleep(0.01)
        assert not writer.pending and [f.bytes for f in got] == [b"header", big]
        a.close()
        for _ in range(3):  # the peer is gone: the first send that meets it fails, once
            writer.send([b"after", big])
            await asyncio.sleep(0.01)
        sent_after = writer.send([b"more"])
        b.close()
        return writer, sent_after

    writer, sent_after = asyncio.run(scenario())
    assert writer.failed and not sent_after
    assert len(failures) == 1 and isinstance(failures[0], ConnectionError)


class _Waits:
    entered = 0

    def __enter__(self):
        _Waits.entered += 1

    def __exit__(self, *exc):
        pass


def test_a_message_the_socket_takes_at_once_never_enters_the_wait():
    a, b = socket.socketpair()
    _Waits.entered = 0
    sf.send_message(b, [b"header", bytes(1000)], None, _Waits)
    a.settimeout(10)
    assert [f.bytes for f in sf.receive_message(a, 4, 1 << 20, 1 << 20)] == [b"header", bytes(1000)]
    assert _Waits.entered == 0
    a.close(), b.close()


def test_only_what_a_full_socket_leaves_is_written_inside_the_wait():
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    parts = [b"header", bytes(range(256)) * 1024, b"tail" * 1000]  # 256 KiB: more than the socket takes
    got = []
    reader = threading.Thread(target=lambda: got.append(sf.receive_message(a, 4, 1 << 20, 1 << 20)))
    _Waits.entered = 0
    reader.start()
    sf.send_message(b, parts, None, _Waits)
    reader.join(10)
    assert _Waits.entered == 1 and [f.bytes for f in got[0]] == parts
    a.close(), b.close()


def test_unsent_is_what_follows_the_bytes_that_went():
    bufs = [b"abc", memoryview(b"defg"), b"hi"]
    assert [bytes(x) for x in sf._unsent(bufs, 0)] == [b"abc", b"defg", b"hi"]
    assert [bytes(x) for x in sf._unsent(bufs, 3)] == [b"defg", b"hi"]
    assert [bytes(x) for x in sf._unsent(bufs, 5)] == [b"fg", b"hi"]
    assert sf._unsent(bufs, 9) == []
