"""Sealed bulk lanes (genie/transport/sealed_lane.py, bulk.connect_sealed / accept_sealed): payloads
arrive whole, the wire never shows them, and any altered, dropped or replayed byte closes the
lane. Two Lanes over socket pairs, with a relay between them that records (and may alter) what
passes. No daemon."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

from genie.transport import bulk, sealed_lane
from genie.transport.errors import ProtocolError
from genie.transport.hostmem import HostBufferPool

pytestmark = pytest.mark.skipif(not sealed_lane.available(), reason="needs the cryptography package")

MiB = 1 << 20
MARKER = b"GENIE-PLAINTEXT-MARKER-0123456789"


class Relay:
    """Bytes from `a` to `b` and back, recorded; `alter(offset)` flips one byte a->b at that offset."""

    def __init__(self) -> None:
        self.a, self._a_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.b, self._b_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.recorded = bytearray()
        self.flip_at: int | None = None
        self._forward = 0
        for src, dst, forward in ((self._a_end, self._b_end, True), (self._b_end, self._a_end, False)):
            threading.Thread(target=self._pump, args=(src, dst, forward), daemon=True).start()

    def _pump(self, src, dst, forward: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                chunk = bytearray(chunk)
                if forward:
                    if self.flip_at is not None and self._forward <= self.flip_at < self._forward + len(chunk):
                        chunk[self.flip_at - self._forward] ^= 0x40
                    self._forward += len(chunk)
                self.recorded += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _sealed_pair(relay: Relay, key_a: bytes | None = None, key_b: bytes | None = None):
    """(client lane, daemon lane) over `relay`, greeted and keyed as a client and a daemon do."""
    key = sealed_lane.new_lane_key()
    token = bulk.new_token()
    accepted: dict = {}

    def daemon_side() -> None:
        try:
            greeting = bulk.recv_exactly(relay.b, len(bulk.MAGIC) + bulk.TOKEN_BYTES)
            assert greeting == bulk.MAGIC_SEALED + token
            accepted["sealing"] = bulk.accept_sealed(relay.b, key_b or key)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            accepted["error"] = e

    thread = threading.Thread(target=daemon_side)
    thread.start()
    sock, sealing = _connect(relay.a, token, key_a or key)
    thread.join(10)
    if "error" in accepted:
        raise accepted["error"]
    client = bulk.Lane(sock, HostBufferPool(0), 1 << 30, "client", sealing=sealing)
    daemon = bulk.Lane(relay.b, HostBufferPool(0), 1 << 30, "daemon", sealing=accepted["sealing"])
    return client, daemon


def _connect(sock: socket.socket, token: bytes, key: bytes):
    """bulk.connect_sealed over an already connected socket (it normally dials an address)."""
    client_random = sealed_lane.new_random()
    sock.sendall(bulk.MAGIC_SEALED + token + client_random)
    assert bulk.recv_exactly(sock, 1) == bulk.ACCEPTED
    return sock, bulk.finish_sealed_greeting(sock, key, client_random)


def _marked(n: int) -> torch.Tensor:
    raw = (MARKER * (n // len(MARKER) + 1))[:n]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("nbytes", [0, 1000, MiB, 3 * MiB + 7])
def test_payloads_arrive_whole_both_ways_and_never_show_on_the_wire(nbytes):
    relay = Relay()
    client, daemon = _sealed_pair(relay)
    try:
        up, down = _marked(nbytes), _marked(nbytes + 5)
        client.send(1, bulk.tensor_bytes(up))
        daemon.send(client.next_id(), bulk.tensor_bytes(down))  # the daemon's ids are its own
        assert torch.equal(daemon.arrivals.take(1, timeout=10), up)
        assert torch.equal(client.arrivals.take(1, timeout=10), down)
        assert client.path == "unix-sealed" and not client.shared
        assert MARKER not in relay.recorded
        on_wire = len(relay.recorded)
        assert on_wire >= sealed_lane.sealed_size(nbytes) + sealed_lane.sealed_size(nbytes + 5)
    finally:
        client.close()
        daemon.close()


def test_a_started_send_on_a_sealed_lane_sends_it_all_when_called():
    relay = Relay()
    client, daemon = _sealed_pair(relay)
    try:
        data = _marked(2 * MiB + 3)
        finish = daemon.start_send(9, bulk.tensor_bytes(data), first_bytes=MiB)
        finish()
        assert torch.equal(client.arrivals.take(9, timeout=10), data)
    finally:
        client.close()
        daemon.close()


@pytest.mark.parametrize("where", ["header", "payload", "last unit's tag"])
def test_an_altered_byte_closes_the_lane_and_fails_waiters(where):
    relay = Relay()
    client, daemon = _sealed_pair(relay)
    try:
        data = _marked(2 * MiB + 100)
        start = relay._forward  # greeting and HELLO passed
        header = bulk._HEADER.size + sealed_lane.TAG_BYTES
        relay.flip_at = start + {"header": 3, "payload": header + MiB // 2,
                                 "last unit's tag": header + sealed_lane.sealed_size(data.numel()) - 1}[where]
        try:
            client.send(4, bulk.tensor_bytes(data))
        except ConnectionError:
            pass  # the receiver closed the lane at the altered unit, before the rest was sent
        with pytest.raises(ConnectionError, match="authentication"):
            daemon.arrivals.take(4, timeout=10)
        assert daemon.closed
    finally:
        client.close()
        daemon.close()


def test_a_unit_replayed_or_reordered_fails_authentication():
    key, randoms = sealed_lane.new_lane_key(), (sealed_lane.new_random(), sealed_lane.new_random())
    sending, _ = sealed_lane.directions(key, *randoms, client_side=True)

    def receiving():
        return sealed_lane.directions(key, *randoms, client_side=False)[1]

    first, second = sending.seal(b"first unit"), sending.seal(b"second unit")
    in_order = receiving()
    assert in_order.open(first) == b"first unit" and in_order.open(second) == b"second unit"
    replayed = receiving()
    replayed.open(first)
    with pytest.raises(ProtocolError):
        replayed.open(first)  # the same unit again: its number is past
    with pytest.raises(ProtocolError):
        receiving().open(second)  # a unit ahead of its turn (one dropped, or the order changed)


def test_each_connection_has_its_own_keys():
    """Two connections with one lane key: a unit sealed on one does not open on the other (nonces
    restart at 0 per connection, so the keys must differ)."""
    key = sealed_lane.new_lane_key()
    one, _ = sealed_lane.directions(key, sealed_lane.new_random(), sealed_lane.new_random(), client_side=True)
    _, other = sealed_lane.directions(key, sealed_lane.new_random(), sealed_lane.new_random(), client_side=False)
    with pytest.raises(ProtocolError):
        other.open(one.seal(b"x" * 64))


def test_a_client_without_the_lane_key_is_refused_at_hello():
    relay = Relay()
    with pytest.raises(ProtocolError, match="authentication"):
        _sealed_pair(relay, key_a=sealed_lane.new_lane_key())


# ---------------------------------------------------------------- the direct lane, sealed


def _direct_pair():
    """A client's blocking socket and a daemon's non-blocking one, with keys for both directions."""
    a, b = socket.socketpair()
    b.setblocking(False)
    key, randoms = sealed_lane.new_lane_key(), (sealed_lane.new_random(), sealed_lane.new_random())
    client = sealed_lane.directions(key, *randoms, client_side=True)
    daemon = sealed_lane.directions(key, *randoms, client_side=False)
    return a, b, client, daemon


def test_sealed_direct_messages_arrive_in_pieces_and_never_show_on_the_wire():
    import random

    from genie.transport import stream_framing as sf

    a, b, client, daemon = _direct_pair()
    reader = sf.SealedMessageReader(b, daemon[1], 16, 8 * MiB, 16 * MiB)
    # Up to 6.6 MB: several units, and past the reader's largest single recv.
    messages = [[MARKER, b"", MARKER * 40_000], [b"h2"], [b"a" * 5, MARKER * 200_000, b""]]
    wire = b"".join(sf.seal_message(sf.encode(m), client[0]) for m in messages)
    assert MARKER not in wire
    rng, out, i = random.Random(0), [], 0
    while i < len(wire):
        k = rng.randint(1, 30_000)  # under the socket pair's buffer: the reader reads only between sends
        a.sendall(wire[i:i + k])
        i += k
        out += reader.read()
    out += reader.read()
    assert [[f.bytes for f in m] for m in out] == messages
    # And back, written by the daemon's writer and read by the client's blocking reader.
    writer = sf.MessageWriter(b, daemon[0])
    writer.write([b"answer", MARKER * 3])
    while writer.pending:
        writer.flush()
    got = sf.receive_message(a, 16, 8 * MiB, 16 * MiB, client[1])
    assert [f.bytes for f in got] == [b"answer", MARKER * 3]
    a.close(), b.close()


def test_a_sealed_direct_message_altered_or_too_long_is_refused():
    from genie.transport import stream_framing as sf

    a, b, client, daemon = _direct_pair()
    reader = sf.SealedMessageReader(b, daemon[1], 16, 1 << 20, 1 << 20)
    wire = bytearray(sf.seal_message(sf.encode([b"header", b"x" * 1000]), client[0]))
    wire[-20] ^= 1
    a.sendall(wire)
    with pytest.raises(ProtocolError, match="authentication"):
        reader.read()
    a2, b2, client2, daemon2 = _direct_pair()
    reader = sf.SealedMessageReader(b2, daemon2[1], 16, 1 << 20, 1 << 20)
    a2.sendall(client2[0].seal(sf._LENGTH.pack(1 << 40)))  # a length past the limit, refused unallocated
    with pytest.raises(ProtocolError, match="sealed message of"):
        reader.read()
    for s in (a, b, a2, b2):
        s.close()
