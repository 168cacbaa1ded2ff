"""ZeroMQ-shaped messages on a plain stream socket: the framing of the direct lane.

A blocking read with nothing else in flight (`.item()`, `.cpu()`, a sync) is one
request and one answer. Over ZeroMQ each leg passes through two I/O threads, and
on a small VM every thread hop is a wake-up: a pyzmq echo took ~120 us here where
the same exchange on a plain Unix socket took well under 10. The direct lane
carries exactly the ZeroMQ messages (header frame + payload frames) on a plain
socket per client instead, beside the bulk lane and on the same listener.

Message: ``<u32 frame count><u64 length> * count`` then the frames back to back.
Frames are read into buffers of exactly their size (`recv_into`), and handed
out as `Frame` objects with the `.buffer` / `.bytes` of a ZeroMQ frame, so the
code above treats both transports alike and payloads are not copied again.

Under CURVE the lane is sealed (greeting MAGIC_SEALED, keys as for a sealed bulk lane: see
sealed_lane): each message goes as a sealed unit of its length (u64), then its bytes as sealed
units of up to sealed_lane.CHUNK_BYTES.
"""
from __future__ import annotations

import socket
import struct

import torch

from . import sealed_lane
from .errors import ProtocolError

MAGIC = b"GND1"  # greeting of a direct-lane connection (the bulk lane's is bulk.MAGIC)
MAGIC_SEALED = b"GNF1"  # a sealed direct lane's (then the client's random, as bulk.MAGIC_SEALED)
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_ONE_PREFIX = struct.Struct("<IQ")  # _COUNT then one _LENGTH (standard sizes: no padding)
_SMALL = 64 << 10  # messages up to this size are joined and written with one call


class Frame:
    """A received frame: the `.buffer` and `.bytes` that code reading ZeroMQ frames uses."""

    __slots__ = ("buffer",)

    def __init__(self, data) -> None:
        self.buffer = memoryview(data).cast("B")

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()

    def __len__(self) -> int:
        return self.buffer.nbytes


def encode(parts: list) -> list:
    """The buffers to write for a message of `parts` (bytes-like), prefix first."""
    if len(parts) == 1 and type(parts[0]) is bytes and len(parts[0]) < _SMALL - _ONE_PREFIX.size:
        return [_ONE_PREFIX.pack(1, len(parts[0])) + parts[0]]  # a header alone: most messages
    views = [memoryview(p).cast("B") for p in parts]
    prefix = _COUNT.pack(len(views)) + b"".join(_LENGTH.pack(v.nbytes) for v in views)
    if len(prefix) + sum(v.nbytes for v in views) <= _SMALL:
        return [b"".join([prefix, *views])]
    return [prefix, *views]


def send_message(sock: socket.socket, parts: list, sending: "sealed_lane.Direction | None" = None,
                 waiting=None) -> None:
    """Write one message on a blocking socket (sealed with `sending` on a sealed lane).

    With `waiting` (a context manager class), what the socket takes at once goes first, in one
    call that never blocks, and only what is left (the socket buffer is full) is written inside
    `waiting()`: the direct lane lets Ctrl-C through there, and nowhere else, since a request cut
    halfway costs the lane (an interrupt right after a blocking write cut 3 lanes a run in
    tests/test_interrupts.py's loop of random Ctrl-Cs, for messages that had all gone)."""
    buffers = [seal_message(encode(parts), sending)] if sending is not None else encode(parts)
    if waiting is None:
        for buf in buffers:
            sock.sendall(buf)
        return
    if len(buffers) <= _IOV_AT_ONCE:
        try:
            sent = sock.sendmsg(buffers, (), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        buffers = _unsent(buffers, sent)
        if not buffers:
            return
    with waiting():
        for buf in buffers:
            sock.sendall(buf)


_IOV_AT_ONCE = 64  # buffers one sendmsg is given (the kernel takes up to IOV_MAX, 1024 on Linux)


def _unsent(buffers: list, sent: int) -> list:
    """What is left of `buffers` once their first `sent` bytes went."""
    for i, buf in enumerate(buffers):
        n = memoryview(buf).nbytes
        if sent < n:
            return [memoryview(buf).cast("B")[sent:], *buffers[i + 1:]] if sent else buffers[i:]
        sent -= n
    return []


def seal_message(buffers: list, sending: "sealed_lane.Direction") -> bytes:
    """A message's buffers (from `encode`) as a sealed lane carries them: its length as one sealed
    unit, then its bytes as units of up to sealed_lane.CHUNK_BYTES."""
    if len(buffers) == 1 and len(buffers[0]) <= sealed_lane.CHUNK_BYTES:  # most messages: two units
        return sending.seal(_LENGTH.pack(len(buffers[0]))) + sending.seal(buffers[0])
    blob = memoryview(buffers[0] if len(buffers) == 1 else b"".join(buffers)).cast("B")
    units = [sending.seal(_LENGTH.pack(blob.nbytes))]
    units.extend(sending.seal(blob[i:i + sealed_lane.CHUNK_BYTES])
                 for i in range(0, blob.nbytes, sealed_lane.CHUNK_BYTES))
    return b"".join(units)


_SEALED_LENGTH = _LENGTH.size + sealed_lane.TAG_BYTES  # a sealed message's first unit
_RECV_CAP = 4 << 20  # most bytes one recv of a sealed reader asks for


def _sealed_length(unit, receiving: "sealed_lane.Direction", max_frames: int, max_bytes: int) -> int:
    """A sealed message's length, from its first unit, checked before anything is allocated for it."""
    (n,) = _LENGTH.unpack(receiving.open(unit))
    if not _ONE_PREFIX.size <= n <= max_bytes + _COUNT.size + _LENGTH.size * max_frames:
        raise ProtocolError(f"a sealed message of {n} bytes")
    return n


def _open_message(sealed: memoryview, n: int, receiving: "sealed_lane.Direction", max_frames: int, max_frame: int,
                  max_bytes: int) -> list[Frame]:
    """The frames of a sealed message of `n` bytes whose units (after the length's) are `sealed`."""
    if n <= sealed_lane.CHUNK_BYTES:  # one unit (most messages)
        plain = memoryview(receiving.open(sealed))
    else:
        plain = memoryview(bytearray(n))
        step = sealed_lane.CHUNK_BYTES + sealed_lane.TAG_BYTES
        for i, at in zip(range(0, n, sealed_lane.CHUNK_BYTES), range(0, sealed.nbytes, step)):
            k = min(sealed_lane.CHUNK_BYTES, n - i)
            receiving.open_into(sealed[at:at + k + sealed_lane.TAG_BYTES], plain[i:i + k])
    (count, first) = _ONE_PREFIX.unpack_from(plain, 0)
    if count == 1 and first == n - _ONE_PREFIX.size and first <= max_frame and first <= max_bytes and first < _SMALL:
        return [Frame(bytearray(plain[_ONE_PREFIX.size:]))]  # one small frame (most messages)
    _check_count(count, max_frames)
    table_end = _COUNT.size + _LENGTH.size * count
    if table_end > n:
        raise ProtocolError("a sealed message shorter than its frame table")
    lengths = [k for (k,) in _LENGTH.iter_unpack(plain[_COUNT.size:table_end])]
    _check_lengths(lengths, max_frame, max_bytes)
    if table_end + sum(lengths) != n:
        raise ProtocolError("a sealed message whose frames do not add up to its length")
    frames, at = [], table_end
    for k in lengths:  # each frame in a buffer of its own, as on a plain lane (aligned, its own lifetime)
        buf = _buffer(k)
        memoryview(buf).cast("B")[:] = plain[at:at + k]
        frames.append(Frame(buf))
        at += k
    return frames


def _buffer(n: int):
    """A writable buffer of n bytes for a frame. Large ones are not zero-filled first (bytearray's
    memset would touch every page of a payload about to be overwritten)."""
    if n < _SMALL:
        return bytearray(n)
    return torch.empty(n, dtype=torch.uint8).numpy()


def _recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("direct lane closed")
        got += n


def _check_count(count: int, max_frames: int) -> None:
    if not 1 <= count <= max_frames:
        raise ProtocolError(f"a message of {count} frames (1 to {max_frames} allowed)")


def _check_lengths(lengths: list[int], max_frame: int, max_bytes: int) -> None:
    if lengths and max(lengths) > max_frame:
        raise ProtocolError(f"a frame of {max(lengths)} bytes exceeds the limit of {max_frame}")
    if sum(lengths) > max_bytes:
        raise ProtocolError(f"a message of {sum(lengths)} bytes exceeds the limit of {max_bytes}")


def receive_message(sock: socket.socket, max_frames: int, max_frame: int, max_bytes: int,
                    receiving: "sealed_lane.Direction | None" = None) -> list[Frame]:
    """Read one whole message from a blocking socket (opened with `receiving` on a sealed lane)."""
    if receiving is not None:
        unit = bytearray(_SEALED_LENGTH)
        _recv_exactly_into(sock, memoryview(unit))
        n = _sealed_length(unit, receiving, max_frames, max_bytes)
        sealed = bytearray(sealed_lane.sealed_size(n))
        _recv_exactly_into(sock, memoryview(sealed))
        return _open_message(memoryview(sealed), n, receiving, max_frames, max_frame, max_bytes)
    # The count and the first length in one read: every valid message has both (a frame at
    # least), and a one-frame message (most answers) then takes two reads instead of three.
    head = bytearray(_ONE_PREFIX.size)
    _recv_exactly_into(sock, memoryview(head))
    count, first = _ONE_PREFIX.unpack(head)
    _check_count(count, max_frames)
    lengths = [first]
    if count > 1:
        raw = bytearray(_LENGTH.size * (count - 1))
        _recv_exactly_into(sock, memoryview(raw))
        lengths.extend(n for (n,) in _LENGTH.iter_unpack(raw))
    _check_lengths(lengths, max_frame, max_bytes)
    frames = []
    for n in lengths:
        buf = _buffer(n)
        if n:
            _recv_exactly_into(sock, memoryview(buf).cast("B"))
        frames.append(Frame(buf))
    return frames


class MessageReader:
    """Incremental reading of messages from a non-blocking socket (the daemon's event loop):
    `read()` takes what has arrived and returns the messages now complete. Every length is
    checked before anything is allocated for it.

    The socket is read into a staging buffer, so a small message (a request: count, lengths and
    a header frame) takes one `recv` instead of one per part and a last one that finds the
    socket empty (four here: 22 us of a (x+1).item() round trip's ~280 on this VM). Small frames
    are copied out of it; a frame of _SMALL bytes or more gets its own buffer, which takes what
    is staged of it and then the rest straight from the socket. A read that returns less than it
    asked for and completes a message means the socket is empty for now: `read()` returns then,
    and the event loop's level-triggered readiness brings it back when more comes (or the peer
    closes).
    """

    def __init__(self, sock: socket.socket, max_frames: int, max_frame: int, max_bytes: int) -> None:
        self.sock = sock
        self.max_frames = max_frames
        self.max_frame = max_frame
        self.max_bytes = max_bytes
        self._closed = False  # the peer closed after the messages the last read() returned
        self._stage = bytearray(_SMALL)
        self._staged = memoryview(self._stage)
        self._start = self._end = 0  # bytes received and not yet parsed: _stage[_start:_end]
        self._reset()

    def _reset(self) -> None:
        self._count: int | None = None  # frames of the message being read, once known
        self._lengths: list[int] | None = None  # their lengths, once the table is in
        self._frames: list[Frame] = []
        self._own: list | None = None  # [buffer, view, bytes filled]: a part read into its own buffer

    def read(self) -> list[list[Frame]]:
        """Complete messages; raises ConnectionError when the peer closed (once the messages it sent
        before closing are returned), ProtocolError on a bad one."""
        if self._closed:
            raise ConnectionError("direct lane closed")
        done: list[list[Frame]] = []
        while True:
            self._parse(done)
            if self._own is not None:
                target = self._own[1][self._own[2]:]
            else:
                if self._start:  # move the unparsed rest (part of one part) to the front
                    rest = bytes(self._staged[self._start:self._end])
                    self._stage[:len(rest)] = rest
                    self._start, self._end = 0, len(rest)
                target = self._staged[self._end:]
            try:
                n = self.sock.recv_into(target)
            except (BlockingIOError, InterruptedError):
                return done
            if n == 0:
                if done:  # a client that sent and closed (say, "bye"): its last messages count
                    self._closed = True
                    return done
                raise ConnectionError("direct lane closed")
            if self._own is not None:
                self._own[2] += n
            else:
                self._end += n
            if n < target.nbytes:  # the socket is empty for now
                self._parse(done)
                if done:
                    return done

    def _parse(self, done: list) -> None:
        """Take every part the received bytes complete; whole messages go to `done`."""
        while True:
            own = self._own
            if own is not None:
                if own[2] < own[1].nbytes:
                    return
                self._own = None
                if self._lengths is None:
                    self._set_lengths(own[0])
                else:
                    self._frames.append(Frame(own[0]))
            elif not self._next_part():
                return
            if self._lengths is not None and len(self._frames) == len(self._lengths):
                done.append(self._frames)
                self._reset()

    def _next_part(self) -> bool:
        """Take the next part from the staged bytes, or start reading it into its own buffer;
        False when more bytes must come first."""
        available = self._end - self._start
        if self._count is None:
            if available < _COUNT.size:
                return False
            (count,) = _COUNT.unpack_from(self._stage, self._start)
            self._start += _COUNT.size
            _check_count(count, self.max_frames)
            self._count = count
            return True
        if self._lengths is None:
            size = _LENGTH.size * self._count
            if size > len(self._stage):
                return self._read_into_own(bytearray(size))
            if available < size:
                return False
            self._set_lengths(self._staged[self._start:self._start + size])
            self._start += size
            return True
        n = self._lengths[len(self._frames)]
        if n >= _SMALL:
            return self._read_into_own(_buffer(n))
        if available < n:
            return False
        self._frames.append(Frame(bytearray(self._staged[self._start:self._start + n])))
        self._start += n
        return True

    def _read_into_own(self, buffer) -> bool:
        view = memoryview(buffer).cast("B")
        k = min(self._end - self._start, view.nbytes)
        view[:k] = self._staged[self._start:self._start + k]
        self._start += k
        self._own = [buffer, view, k]
        return True

    def _set_lengths(self, table) -> None:
        lengths = [n for (n,) in _LENGTH.iter_unpack(table)]
        _check_lengths(lengths, self.max_frame, self.max_bytes)
        self._lengths = lengths


class SealedMessageReader:
    """MessageReader's `read()` for a sealed lane: the socket's bytes are kept until a message's
    units are all in, then opened (each checked) and split into frames."""

    def __init__(self, sock: socket.socket, receiving: "sealed_lane.Direction", max_frames: int, max_frame: int,
                 max_bytes: int) -> None:
        self.sock = sock
        self.receiving = receiving
        self.max_frames = max_frames
        self.max_frame = max_frame
        self.max_bytes = max_bytes
        self._closed = False
        self._raw = bytearray()
        self._length: int | None = None  # the message being received, once its first unit is in

    def read(self) -> list[list[Frame]]:
        """As MessageReader.read."""
        if self._closed:
            raise ConnectionError("direct lane closed")
        done: list[list[Frame]] = []
        while True:
            # What the message in progress still needs, within bounds: recv allocates all it may return.
            wanted = min(max(_SMALL, sealed_lane.sealed_size(self._length or 0) - len(self._raw)), _RECV_CAP)
            try:
                chunk = self.sock.recv(wanted)
            except (BlockingIOError, InterruptedError):
                return done
            if not chunk:
                if done:
                    self._closed = True
                    return done
                raise ConnectionError("direct lane closed")
            self._raw += chunk
            self._parse(done)
            if done and len(chunk) < wanted:  # the socket is empty for now (as MessageReader.read)
                return done

    def _parse(self, done: list) -> None:
        at = 0
        while True:
            if self._length is None:
                if len(self._raw) - at < _SEALED_LENGTH:
                    break
                self._length = _sealed_length(bytes(self._raw[at:at + _SEALED_LENGTH]), self.receiving,
                                              self.max_frames, self.max_bytes)
                at += _SEALED_LENGTH
            size = sealed_lane.sealed_size(self._length)
            if len(self._raw) - at < size:
                break
            # A copy of the units (a slice of a bytearray): no view may hold _raw, which is cut below.
            done.append(_open_message(memoryview(self._raw[at:at + size]), self._length, self.receiving,
                                      self.max_frames, self.max_frame, self.max_bytes))
            at += size
            self._length = None
        if at:
            del self._raw[:at]


class MessageWriter:
    """Writes of messages on a non-blocking socket without ever waiting: what the socket does
    not take now is kept, in order, and `flush()` (called when it is writable) sends more. With
    `sending`, sealed (a sealed lane)."""

    def __init__(self, sock: socket.socket, sending: "sealed_lane.Direction | None" = None) -> None:
        self.sock = sock
        self.sending = sending
        self._queue: list[memoryview] = []

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def write(self, parts: list) -> None:
        buffers = encode(parts)
        if self.sending is not None:
            buffers = [seal_message(buffers, self.sending)]
        if not self._queue and len(buffers) == 1:  # a small message: one send, nothing queued (most answers)
            try:
                sent = self.sock.send(buffers[0])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                raise ConnectionError(f"direct lane send failed: {e}") from e
            if sent < len(buffers[0]):
                self._queue.append(memoryview(buffers[0])[sent:])
            return
        self._queue.extend(memoryview(b).cast("B") for b in buffers)
        self.flush()

    def flush(self) -> None:
        """Send what the socket takes now; raises ConnectionError when the peer is gone."""
        while self._queue:
            try:
                sent = self.sock.sendmsg(self._queue[:_IOV_AT_ONCE])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise ConnectionError(f"direct lane send failed: {e}") from e
            self._queue = _unsent(self._queue, sent)


class LoopMessageWriter(MessageWriter):
    """A MessageWriter on an asyncio event loop (the daemon's lanes, to clients and to peers):
    what the socket does not take now goes when the loop sees it writable. A write or flush that
    fails calls `on_failure(error)` once and stops the writer: later messages do not go."""

    def __init__(self, loop, sock: socket.socket, sending: "sealed_lane.Direction | None" = None,
                 on_failure=None) -> None:
        super().__init__(sock, sending)
        self.loop, self.on_failure = loop, on_failure
        self.failed = False

    def send(self, parts: list) -> bool:
        """Write one message (header, frames); False where the writer failed, now or before: the
        message did not go."""
        if self.failed:
            return False
        try:
            self.write(parts)
        except ConnectionError as e:
            self._fail(e)
            return False
        if self._queue:  # the reader is slow: the rest goes when it can take it
            self.loop.add_writer(self.sock.fileno(), self._flush_when_writable)
        return True

    def _flush_when_writable(self) -> None:
        try:
            self.flush()
        except ConnectionError as e:
            self._fail(e)
            return
        if not self._queue:
            self.loop.remove_writer(self.sock.fileno())

    def stop(self) -> None:
        """Stop waiting for the socket to be writable (it is closing)."""
        try:
            self.loop.remove_writer(self.sock.fileno())
        except (ValueError, OSError, RuntimeError):  # closed already; RuntimeError: the loop is closed
            pass

    def _fail(self, error: ConnectionError) -> None:
        self.failed = True
        self.stop()
        if self.on_failure is not None:
            self.on_failure(error)
