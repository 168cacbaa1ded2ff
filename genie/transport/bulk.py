"""The bulk lane: large tensor payloads over a plain stream socket, beside ZeroMQ.

ZeroMQ copies every received message into a buffer it allocates itself, so a
large payload pays a fresh allocation (page faults) and cannot land in memory
of our choosing. Payloads at or above a size threshold therefore travel on a
second connection per client, a TCP socket (tcp:// daemons) or a Unix socket
(ipc:// daemons): the sender writes straight from the tensor's memory
(`sendall` of a memoryview), the receiver reads straight into a recycled
destination buffer (`recv_into`). The ZeroMQ messages keep carrying the ops;
a tensor descriptor names the transfer by id instead of by frame.

Stream format: the client opens with ``MAGIC + token`` (the token is its
ZeroMQ routing id, 16 random bytes, which ties the lane to that client), or
``MAGIC_SHARED + token`` to ask for shared memory, and the daemon answers one
byte: ACCEPTED, or ACCEPTED_SHARED when it agrees to shared memory (Unix
socket, same user; see `shared_segments`). Then, in each direction, records
follow each other, each ``<u32 kind, u64 transfer id, u64 nbytes, u64
segment>``: STREAM followed by the payload; on shared lanes also SEGMENT (the
payload is in a segment), WRITING (the same, but the sender is still copying the
payload in: see `Lane.send`'s `write_behind`), HAND_BACK and FORGET (a segment's
life). Each side's
transfer ids are its own. A violation closes the lane; ops that wait on a
transfer then fail with a clear error after a timeout.

A client may open more lanes beside its first (``MAGIC_JOIN + token``): they form one
`lane_set.LaneSet`, and a large payload goes as PART records, one per lane, side by side.

With CURVE encryption on, the lane is sealed instead (``MAGIC_SEALED``): the same records,
encrypted and authenticated with keys handed out over CURVE (see `sealed_lane`), and never in
shared memory. A CURVE daemon takes no plaintext lane.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
import re
import select
import socket
import struct
import sys
import threading
import time
import types
from typing import Callable, Mapping

import numpy as np
import torch

from . import sealed_lane, shared_segments
from .errors import ProtocolError
from .hostmem import HostBufferPool

log = logging.getLogger("genie.transport")

MAGIC = b"GNB2"          # a bulk lane: payloads through the socket
MAGIC_SHARED = b"GNS2"   # a bulk lane on which payloads may go in shared-memory segments
MAGIC_SEALED = b"GNE2"   # a sealed bulk lane (see sealed_lane), then the client's random
MAGIC_JOIN = b"GNJ2"     # one more bulk lane of a client that has one: joins its lane_set.LaneSet
MAGIC_SEALED_JOIN = b"GNK2"  # the same for a sealed lane
TOKEN_BYTES = 16
# Every record: kind, transfer id, payload bytes, segment (shared-memory lanes; 0 otherwise).
_HEADER = struct.Struct("<IQQQ")
STREAM = 1     # the payload follows on the socket
SEGMENT = 2    # the payload is in the sender's segment (whose fd rides along the first time)
HAND_BACK = 3  # the receiver no longer uses the sender's segment
FORGET = 4     # the sender dropped one of its (idle) segments: the receiver unmaps it
WRITING = 5    # SEGMENT, sent before the payload is in: complete before the sender's next message
TO_DEVICE = 6  # (UCX lanes only) STREAM landing in the receiver's GPU memory: segment = its device index
HELLO = 7      # (sealed lanes only) the client's first record: proof that it holds the lane key
PART = 8       # one part of a transfer striped over a lane set (see lane_set); segment = which part
UNIX_BUFFER_BYTES = 4 << 20
_SEND_SLICE = 64 << 20  # sendall in slices: bounded time per call, and the GIL is let go between
HEAD_BYTES = 64 << 10  # sent before the `after_head` callback of `Lane.send`


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("bulk lane closed")
        data += chunk
    return bytes(data)


def recv_into_exactly(sock: socket.socket, view: memoryview) -> None:
    # MSG_WAITALL: one blocking call for the whole payload (it returns early only on a signal or
    # a closed peer), so the receiving thread does not need the GIL back after every chunk.
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("bulk lane closed mid-transfer")
        got += k


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a flat byte view (no copy)."""
    from .tensors import tensor_to_buffer

    return tensor_to_buffer(t)  # already flat bytes ("B")


class Arrivals:
    """Transfers received and not yet claimed, keyed by transfer id; waiters block on a condition."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._done: dict[int, torch.Tensor] = {}
        self._being_written: set[int] = set()  # transfers whose sender is still copying them in (WRITING)
        self._abandoned: set[int] = set()  # transfers nobody will take: dropped as they come (see abandon)
        self._landed: dict[int, float] = {}  # time.monotonic() each unclaimed transfer came (see expire)
        self._spoken_for: set[int] = set()  # transfers a received request will take: never expired
        self._cond = threading.Condition()
        self.failure: BaseException | None = None
        self.on_change = on_change  # called (on the receiving thread) after each arrival or failure

    def put(self, xfer: int, data: torch.Tensor, being_written: bool = False) -> None:
        with self._cond:
            if xfer in self._abandoned:
                self._abandoned.discard(xfer)
                return
            self._done[xfer] = data
            self._landed[xfer] = time.monotonic()
            if being_written:
                self._being_written.add(xfer)
            self._cond.notify_all()
        if self.on_change is not None:
            self.on_change()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.failure = exc
            self._cond.notify_all()
        if self.on_change is not None:
            self.on_change()

    def take(self, xfer: int, timeout: float, being_written_ok: bool = False) -> torch.Tensor:
        """Transfer `xfer`'s payload, waiting up to `timeout` for it. One whose sender may still be
        copying it in (a WRITING record) goes only to a taker that will not read it now
        (`being_written_ok`: it keeps the payload as a tensor, read for later messages only); to
        any other taker it is the sender's protocol error."""
        with self._cond:
            if not self._cond.wait_for(lambda: xfer in self._done or self.failure is not None, timeout):
                raise TimeoutError(f"bulk transfer {xfer} did not arrive" + (f" within {timeout:.0f}s" if timeout else ""))
            if xfer not in self._done:
                raise ConnectionError(f"bulk lane failed before transfer {xfer} arrived: {self.failure}")
            data = self._done.pop(xfer)
            self._landed.pop(xfer, None)
            self._spoken_for.discard(xfer)
            if xfer in self._being_written:
                self._being_written.discard(xfer)
                if not being_written_ok:
                    raise ProtocolError(f"bulk transfer {xfer} was named before its bytes were in, and what "
                                        "takes it reads it at once: only a tensor kept as received may be")
            return data

    def abandon(self, xfer: int) -> None:
        """Nobody will take transfer `xfer` (its reader was interrupted): drop it, now if it is in,
        else when it comes (until then, or until `clear`, its id is remembered). Left, a 64 MiB
        download interrupted 30 times held 1.9 GB of the client's memory for good."""
        with self._cond:
            if self._done.pop(xfer, None) is None:
                self._abandoned.add(xfer)
            self._landed.pop(xfer, None)
            self._spoken_for.discard(xfer)
            self._being_written.discard(xfer)

    def spoken_for(self, xfers) -> None:
        """Requests that take these transfers have come (and may wait long in a queue to run)."""
        with self._cond:
            self._spoken_for.update(xfers)

    def expire(self, max_age_s: float) -> int:
        """Drop transfers that no request has named for over `max_age_s` since they came (no op
        came for them: a client interrupted between sending bytes and the batch that reads them,
        or one that sends bytes alone); the bytes dropped."""
        cutoff = time.monotonic() - max_age_s
        with self._cond:
            stale = [xfer for xfer, at in self._landed.items() if at < cutoff and xfer not in self._spoken_for]
            dropped = 0
            for xfer in stale:
                del self._landed[xfer]
                self._being_written.discard(xfer)
                dropped += self._done.pop(xfer).nbytes
            return dropped

    def ready(self, xfer: int) -> bool:
        with self._cond:
            return xfer in self._done or self.failure is not None

    def landed(self, xfer: int) -> bool:
        """Whether transfer `xfer` is in (not taken yet); unlike `ready`, False after a failure."""
        with self._cond:
            return xfer in self._done

    def pending_bytes(self) -> int:
        with self._cond:
            return sum(t.nbytes for t in self._done.values())

    def clear(self) -> None:
        with self._cond:
            self._done.clear()
            self._being_written.clear()
            self._abandoned.clear()
            self._landed.clear()
            self._spoken_for.clear()


class Lane:
    """One established bulk connection: a locked sender and a receiving thread feeding `arrivals`.

    `shared`: both ends agreed (by the greeting) to pass payloads in shared-memory segments (see
    `shared_segments`; Unix sockets, same user). Then a payload goes in a segment when one is free
    or can be made within `segments`' bounds, else through the socket.

    `sealing`: (sending, receiving) sealed_lane.Direction of a sealed lane (never shared): each
    record goes as sealed units, see `sealed_lane`.
    """

    # GPU memory never travels on a socket lane (see ucx_lane.UcxLane, which shares this surface).
    landing_devices: Mapping[int, torch.device] = types.MappingProxyType({})
    peer_devices: frozenset[int] = frozenset()

    def __init__(self, sock: socket.socket, pool: HostBufferPool, max_transfer: int, name: str,
                 on_close: Callable[["Lane"], None] | None = None, shared: bool = False,
                 segments: shared_segments.OutgoingSegments | None = None,
                 sealing: tuple[sealed_lane.Direction, sealed_lane.Direction] | None = None,
                 arrivals: Arrivals | None = None, assembly=None) -> None:
        if sealing is not None and shared:
            raise ValueError("a sealed lane does not use shared memory")
        self.sock = sock
        self._sealing = sealing
        # One unit's worth each way, reused: sealed into before a send, received into before opening.
        # Made at first use: a client's four lanes would hold 8 MiB each end before carrying anything.
        self._unit_out: bytearray | None = None
        self._unit_in: bytearray | None = None
        self.pool = pool
        self.max_transfer = max_transfer
        self.arrivals = arrivals if arrivals is not None else Arrivals()
        # A lane_set.Assembly where this lane belongs to a set: PART records land there.
        self.assembly = assembly
        self._send_lock = threading.Lock()
        self._ids = iter(range(1, 1 << 63))
        self.on_close = on_close
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_streamed = 0.0  # time.monotonic() when a payload last went through the socket
        self.shared = shared
        self._outgoing = (segments or shared_segments.OutgoingSegments()) if shared else None
        self._incoming = shared_segments.IncomingSegments(self._hand_back) if shared else None
        # Records about segments (hand-backs, forgets) waiting for a turn on the socket; see _flush_controls.
        self._controls: collections.deque[bytes] = collections.deque()
        self._unsent = b""  # the part of a control record a non-blocking send left over
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._receive_loop, name=f"genie-bulk-{name}", daemon=True)
        self._thread.start()

    def next_id(self) -> int:
        with self._send_lock:
            return next(self._ids)

    @property
    def path(self) -> str:
        """How payloads travel: "shared-memory", "unix" or "tcp" (with "-sealed" on sealed lanes)."""
        if self.shared:
            return "shared-memory"
        return ("unix" if self.sock.family == socket.AF_UNIX else "tcp") + ("-sealed" if self._sealing else "")

    def send(self, xfer: int, payload: memoryview, after_head: Callable[[], None] | None = None,
             write_behind: bool = False, records: list | None = None) -> None:
        """Write one transfer; holds the lane for its whole length so transfers never interleave.

        `after_head` runs once the first HEAD_BYTES are out: the sender's ZeroMQ message about
        this transfer goes then, so the receiving thread is already reading (woken while the
        receiver's CPU was free) when that message lands; sent before the payload, its handling
        could hold that CPU at the moment the payload's wake-up came, and on a two-core machine
        the receiving thread then waited behind the sender for the whole transfer. In a shared
        segment it runs before the copy: the receiver handles the message meanwhile, and has no
        payload to read. An exception from `after_head` is raised once the payload is out (the
        stream must stay in step).

        `write_behind`, the caller's promise that the receiver keeps this payload as a tensor and
        reads it only for messages this thread sends after this call returns: in a segment, the
        record (WRITING) goes first, then `after_head`, then the copy, so the receiver takes the
        message and answers it while the bytes are copied in. With `records` too (a list the
        message of `after_head` carries, see protocol.Exec.segments), a segment the receiver has
        mapped is named there, [xfer, segment, bytes], instead of on this lane: the receiver takes
        it with the message, without its lane thread's wake-up and turn at the interpreter lock.
        """
        payload = _flat_bytes(payload)
        with self._send_lock:
            if self.closed:
                raise ConnectionError("bulk lane is closed")
            segment, forgotten = None, []
            if self._outgoing is not None and payload.nbytes:
                # Under the lock: the receiver hears of dropped segments before of any new one.
                segment, forgotten = self._outgoing.acquire(payload.nbytes)
            try:
                self._controls.extend(_HEADER.pack(FORGET, 0, 0, ident) for ident in forgotten)
                self._write_controls(blocking=True)
                if segment is not None:
                    deferred = self._send_in_segment(segment, xfer, payload, after_head, write_behind, records)
                    segment = None
                else:
                    deferred = self._write_record(_HEADER.pack(STREAM, xfer, payload.nbytes, 0), payload, after_head)
            except OSError as e:
                self.close(e)
                raise ConnectionError(f"bulk lane send failed: {e}") from e
            finally:
                if segment is not None:  # taken, never named to the receiver
                    self._outgoing.give_back(segment)
        self._flush_controls()
        if deferred is not None:
            raise deferred

    def send_part(self, xfer: int, part: memoryview, word: int, after_head: Callable[[], None] | None = None) -> None:
        """Write one part of a striped transfer (see lane_set.LaneSet.send) as a PART record; `word`
        says which part (lane_set.pack_part). Never in a shared segment."""
        with self._send_lock:
            if self.closed:
                raise ConnectionError("bulk lane is closed")
            try:
                deferred = self._write_record(_HEADER.pack(PART, xfer, part.nbytes, word), part, after_head)
            except OSError as e:
                self.close(e)
                raise ConnectionError(f"bulk lane send failed: {e}") from e
        if deferred is not None:
            raise deferred

    def start_send(self, xfer: int, payload: memoryview, first_bytes: int) -> Callable[[], None]:
        """Begin transfer `xfer` on this thread without waiting: its header and up to `first_bytes`
        of the payload, as much as the socket takes now. Returns the call that sends the rest (on
        another thread), and until it has, the lane is held. The receiver is then reading while
        that thread wakes up. Nothing is sent here on a shared-memory lane (the payload is a copy
        into a segment, not a socket write), on a sealed one (sealing is the work) or while the
        lane is busy: the call sends it all."""
        payload = _flat_bytes(payload)
        if self.shared or self._sealing is not None or not self._send_lock.acquire(blocking=False):
            return functools.partial(self.send, xfer, payload)
        header = _HEADER.pack(STREAM, xfer, payload.nbytes, 0)
        try:
            if self.closed:
                raise ConnectionError("bulk lane is closed")
            try:
                sent = self.sock.sendmsg([header, payload[:first_bytes]], [], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
        except OSError as e:
            self._send_lock.release()
            self.close(e)
            raise ConnectionError(f"bulk lane send failed: {e}") from e
        except BaseException:
            self._send_lock.release()
            raise

        def finish() -> None:
            try:
                if self.closed:
                    raise ConnectionError("bulk lane is closed")
                if sent < len(header):
                    self.sock.sendall(header[sent:])
                self._stream_rest(payload, max(0, sent - len(header)))
            except OSError as e:
                self.close(e)
                raise ConnectionError(f"bulk lane send failed: {e}") from e
            finally:
                self._send_lock.release()

        return finish

    def _write_record(self, header: bytes, payload: memoryview, after_head) -> BaseException | None:
        """(Holding the send lock.) A record and its payload through the socket, sealed on a sealed lane."""
        if self._sealing is not None:
            return self._send_sealed(header, payload, after_head)
        return self._send_through_socket(header, payload, after_head)

    def _send_through_socket(self, header: bytes, payload: memoryview, after_head) -> BaseException | None:
        deferred = None
        self.sock.sendall(header)
        start = 0
        if after_head is not None:
            start = min(HEAD_BYTES, payload.nbytes)
            self.sock.sendall(payload[:start])
            deferred = _call(after_head)
        self._stream_rest(payload, start)
        return deferred

    def _stream_rest(self, payload: memoryview, start: int) -> None:
        """(Holding the send lock, the header out.) Send the payload from byte `start` on, and count it."""
        for i in range(start, payload.nbytes, _SEND_SLICE):
            self.sock.sendall(payload[i:i + _SEND_SLICE])
        self.bytes_sent += payload.nbytes + _HEADER.size
        self.last_streamed = time.monotonic()

    def _send_sealed(self, header: bytes, payload: memoryview, after_head) -> BaseException | None:
        """(Holding the send lock.) The record's header as one sealed unit, then the payload as
        units of up to CHUNK_BYTES; `after_head` runs after the first."""
        sending = self._sealing[0]
        if self._unit_out is None and payload.nbytes:
            self._unit_out = bytearray(sealed_lane.CHUNK_BYTES + sealed_lane.TAG_BYTES)
        self.sock.sendall(sending.seal(header))
        deferred = None
        for i in range(0, payload.nbytes, sealed_lane.CHUNK_BYTES):
            self.sock.sendall(sending.seal_into(payload[i:i + sealed_lane.CHUNK_BYTES], self._unit_out))
            if i == 0 and after_head is not None:
                deferred = _call(after_head)
        if not payload.nbytes and after_head is not None:
            deferred = _call(after_head)
        self.bytes_sent += payload.nbytes + _HEADER.size
        self.last_streamed = time.monotonic()
        return deferred

    def _send_in_segment(self, segment, xfer: int, payload: memoryview, after_head,
                         write_behind: bool, records: list | None) -> BaseException | None:
        if write_behind and records is not None and segment.peer_attached:
            records.append([xfer, segment.ident, payload.nbytes])
        elif write_behind:
            self._send_segment_record(WRITING, segment, xfer, payload.nbytes)
        deferred = _call(after_head) if after_head is not None else None
        copy_bytes(segment.array, payload)
        if not write_behind:
            self._send_segment_record(SEGMENT, segment, xfer, payload.nbytes)
        self.bytes_sent += payload.nbytes
        return deferred

    def _send_segment_record(self, kind: int, segment, xfer: int, nbytes: int) -> None:
        """(Holding the send lock.) Name `segment` as transfer `xfer`'s; its fd rides along the first time."""
        record = _HEADER.pack(kind, xfer, nbytes, segment.ident)
        if segment.peer_has_fd:
            self.sock.sendall(record)
        else:
            if socket.send_fds(self.sock, [record], [segment.fd]) != len(record):
                raise OSError("short write of a segment record")
            segment.peer_has_fd = True

    # ------------------------------------------------------------ control records

    def _hand_back(self, ident: int) -> None:
        """A received segment's payload was freed (any thread, from a finalizer): return it. Not
        from a forked child, whose copy of this lane's socket is its parent's connection."""
        if not self.closed and os.getpid() == self._pid:
            self._controls.append(_HEADER.pack(HAND_BACK, 0, 0, ident))
            self._flush_controls()

    def _flush_controls(self) -> None:
        """Send waiting control records if nobody is sending, without blocking: the thread here may
        be the receiving one, and if both sides' receiving threads waited to send, neither would read.
        Otherwise the sender writes them at its next turn."""
        while (self._controls or self._unsent) and self._send_lock.acquire(blocking=False):
            failure = None
            try:
                if self.closed:
                    return
                self._write_controls(blocking=False)
            except OSError as e:
                failure = e
            finally:
                self._send_lock.release()
            if failure is not None:
                self.close(failure)
                return
            if self._unsent:  # the socket is full: the receiving loop tries again shortly
                return

    def _write_controls(self, blocking: bool) -> None:
        """(Holding the send lock.) Write the waiting control records."""
        while self._controls:
            self._unsent += self._controls.popleft()
        while self._unsent:
            if blocking:
                self.sock.sendall(self._unsent)
                self._unsent = b""
            else:
                try:
                    sent = self.sock.send(self._unsent, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return
                self._unsent = self._unsent[sent:]

    # ------------------------------------------------------------ receiving

    def _receive_loop(self) -> None:
        # Wait for the next header in poll(), not in a blocking recv: a thread blocked in recv is
        # woken each time this socket gains send space (the kernel does not filter that wake-up
        # for it), so while this side sends a large payload it was woken every ~15 us (seen in
        # `perf sched`), taking a core from the two threads doing the copy. A poll() waiter is
        # woken only for the events it asked for.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLPRI)
        try:
            while True:
                if not poller.poll(50 if self._unsent or self._controls else None):
                    self._flush_controls()
                    continue
                header, fds = self._read_header()
                kind, xfer, nbytes, segment = _HEADER.unpack(header)
                if nbytes > self.max_transfer:  # control records carry 0
                    _close_all(fds)
                    raise ProtocolError(f"bulk transfer of {nbytes} bytes exceeds the limit of {self.max_transfer}")
                if kind == STREAM and not fds:
                    self._receive_stream(xfer, nbytes)
                elif kind == PART and not fds and self.assembly is not None:
                    self._receive_part(xfer, nbytes, segment)
                elif kind in (SEGMENT, WRITING, HAND_BACK, FORGET) and self.shared:
                    self._receive_control(kind, xfer, nbytes, segment, fds)
                else:
                    _close_all(fds)
                    raise ProtocolError(f"unexpected bulk record of kind {kind}")
                self._flush_controls()
        except (OSError, ConnectionError, ProtocolError, ValueError, MemoryError, RuntimeError) as e:
            if not self.closed:
                log.info("bulk lane closed: %s", e)
            self.close(e)
        except Exception as e:  # a bug: close the lane so waiters fail now, not after their timeout
            log.exception("bulk lane receiver failed")
            self.close(e)

    def _read_header(self) -> tuple[bytes, list[int]]:
        if self._sealing is not None:
            return self._sealing[1].open(recv_exactly(self.sock, _HEADER.size + sealed_lane.TAG_BYTES)), []
        if not self.shared:
            return recv_exactly(self.sock, _HEADER.size), []
        # A segment's file descriptor rides on the first record naming it, and arrives with its first byte.
        data, fds = b"", []
        while len(data) < _HEADER.size:
            chunk, new_fds, flags, _ = socket.recv_fds(self.sock, _HEADER.size - len(data), 1)
            fds.extend(new_fds)
            if flags & socket.MSG_CTRUNC:
                _close_all(fds)
                raise ProtocolError("too many file descriptors on the bulk lane")
            if not chunk:
                _close_all(fds)
                raise ConnectionError("bulk lane closed")
            data += chunk
        return data, fds

    def _receive_stream(self, xfer: int, nbytes: int) -> None:
        data = self.pool.take(nbytes)
        if nbytes:
            self._receive_into(memoryview(data.numpy()))
        self.bytes_received += nbytes + _HEADER.size
        self.last_streamed = time.monotonic()
        self.arrivals.put(xfer, data)

    def _receive_part(self, xfer: int, nbytes: int, word: int) -> None:
        destination = self.assembly.begin(xfer, nbytes, word)  # checks the part against the transfer
        if nbytes:
            self._receive_into(destination)
        self.bytes_received += nbytes + _HEADER.size
        self.last_streamed = time.monotonic()
        self.assembly.finish(xfer)

    def _receive_into(self, destination: memoryview) -> None:
        """The payload that follows a header, into `destination` (exactly its length)."""
        if self._sealing is None:
            recv_into_exactly(self.sock, destination)
            return
        receiving, nbytes = self._sealing[1], destination.nbytes
        if self._unit_in is None:
            self._unit_in = bytearray(sealed_lane.CHUNK_BYTES + sealed_lane.TAG_BYTES)
        for i in range(0, nbytes, sealed_lane.CHUNK_BYTES):
            n = min(sealed_lane.CHUNK_BYTES, nbytes - i)
            unit = memoryview(self._unit_in)[:n + sealed_lane.TAG_BYTES]
            recv_into_exactly(self.sock, unit)
            receiving.open_into(unit, destination[i:i + n])

    def _receive_control(self, kind: int, xfer: int, nbytes: int, segment: int, fds: list[int]) -> None:
        """SEGMENT: transfer `xfer`'s payload is in `segment` (its fd comes along the first time);
        WRITING: the same, still being copied in; HAND_BACK: the peer is done with one of our
        segments; FORGET: the peer dropped one of its own."""
        if fds and not (kind in (SEGMENT, WRITING) and len(fds) == 1):
            _close_all(fds)
            raise ProtocolError("unexpected file descriptor on the bulk lane")
        if kind == HAND_BACK:
            self._outgoing.release(segment)
        elif kind == FORGET:
            self._incoming.forget(segment)
        else:
            if fds:
                self._incoming.attach(segment, fds[0])
            data = self.take_named(segment, nbytes)
            self.bytes_received += _HEADER.size
            self.arrivals.put(xfer, data, being_written=kind == WRITING)

    def name_in_segment(self, payload: memoryview) -> list[int] | None:
        """Copy `payload` into a free segment the receiver has mapped and return [segment, bytes],
        for a message to name (the receiver takes it with `take_named`, no record on this lane,
        no wake-up of its lane thread); None when no such segment is free: send it instead."""
        if self._outgoing is None or self.closed or not payload.nbytes:
            return None
        segment = self._outgoing.acquire_attached(payload.nbytes)
        if segment is None:
            return None
        copy_bytes(segment.array, _flat_bytes(payload))
        self.bytes_sent += payload.nbytes
        return [segment.ident, payload.nbytes]

    def segment_bytes_lent(self) -> int:
        """Bytes of this side's shared segments the peer has not handed back."""
        return self._outgoing.lent_bytes() if self._outgoing is not None else 0

    def take_named(self, segment: int, nbytes: int) -> torch.Tensor:
        """The payload a message named in the peer's `segment` (see `name_in_segment`)."""
        if not self.shared:
            raise ProtocolError("a segment named on a lane without shared memory")
        data = self._incoming.payload(segment, nbytes)
        self.bytes_received += nbytes
        return data

    def accept_named(self, records) -> None:
        """Take the uploads a message named in this lane's segments ((xfer, segment, bytes) each,
        still being copied in), as if their WRITING records had come here. A bad one closes the
        lane, as a bad record on it would."""
        try:
            for xfer, segment, nbytes in records:
                if nbytes > self.max_transfer:
                    raise ProtocolError(f"bulk transfer of {nbytes} bytes exceeds the limit of {self.max_transfer}")
                self.arrivals.put(xfer, self.take_named(segment, nbytes), being_written=True)
        except ProtocolError as e:
            self.close(e)
            raise

    def abandon(self) -> None:
        """In a forked child: stop using the parent's lane. The socket's descriptor is closed in this
        process only (a close, not a shutdown: the parent's connection stays as it was); segments'
        hand-backs already stay in the process that received them (see `_hand_back`)."""
        self.closed = True
        self._send_lock = threading.Lock()  # a parent thread may have held it at the fork
        self.sock.close()

    def close(self, reason: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.arrivals.fail(reason or ConnectionError("bulk lane closed"))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._outgoing is not None:
            self._outgoing.close()
        if self.on_close is not None:
            self.on_close(self)


def _call(callback: Callable[[], None]) -> BaseException | None:
    """Run `callback`; what it raised, to be raised once the payload is out (the stream must stay in step)."""
    try:
        callback()
    except BaseException as e:  # noqa: BLE001 - re-raised by the caller
        return e
    return None


def _flat_bytes(payload: memoryview) -> memoryview:
    """`payload` as a flat view of bytes (the same memory)."""
    return payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def copy_bytes(destination, source: memoryview) -> None:
    """Copy `source` into the start of `destination` (a uint8 numpy array) with one plain memcpy,
    the GIL let go (ctypes releases it). Not Tensor.copy_: torch splits a large copy over its
    intra-op threads, which then spin waiting for more work, and on the two-core test machine
    that took a core from the other process (a 16 MiB upload ran at 2.2 GB/s instead of ~8)."""
    n = source.nbytes
    if n > destination.nbytes:
        raise ValueError("payload larger than its segment")
    source_array = np.frombuffer(source, dtype=np.uint8)
    ctypes.memmove(destination.ctypes.data, source_array.ctypes.data, n)


# ---------------------------------------------------------------- addresses


def listen_address_for(zmq_endpoint: str) -> tuple[str, object] | None:
    """Where a daemon bound at `zmq_endpoint` listens for bulk lanes: ("tcp", host) or ("unix", path)."""
    if zmq_endpoint.startswith("tcp://"):
        host = zmq_endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        return ("tcp", host or "127.0.0.1")
    if zmq_endpoint.startswith("ipc://"):
        path = zmq_endpoint[len("ipc://"):] + ".bulk"
        if len(path.encode()) >= 100:  # sun_path holds 108 bytes
            return None
        return ("unix", path)
    return None


def connect_address(advertised: object, zmq_endpoint: str) -> tuple[int, object] | None:
    """Where a client connects, from what the daemon advertised in hello. None: no usable lane."""
    if not isinstance(advertised, list) or len(advertised) != 2:
        return None
    kind, where = advertised
    if kind == "tcp" and type(where) is int and 0 < where < 65536 and zmq_endpoint.startswith("tcp://"):
        # The host the client already reaches the daemon at (the daemon may have bound a wildcard).
        host = zmq_endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return (family, (host, where))
    if kind == "unix" and isinstance(where, str) and zmq_endpoint.startswith("ipc://"):
        return (socket.AF_UNIX, where)
    return None


# A daemon listening on tcp also listens on an abstract Unix socket of this form (Linux), which it
# names in hello (`local_lane`) for clients and peers on its host: lanes there can use shared
# memory, where a TCP connection cannot pass a segment's file descriptor.
_LOCAL_LANE_NAME = re.compile(r"\0genie-lanes-[0-9]{1,10}-[0-9a-f]{16}")


def local_lane_name() -> str | None:
    """A fresh abstract socket name for the local lane listener, or None off Linux (no abstract names)."""
    if not sys.platform.startswith("linux"):
        return None
    return f"\0genie-lanes-{os.getpid()}-{os.urandom(8).hex()}"


def local_lane_offer(name: str) -> dict | None:
    """What a tcp daemon says in hello about its local lane listener `name`: who may use it."""
    host = shared_segments.host_id()
    return None if host is None else {"host": host, "uid": os.getuid(), "path": name}


def local_lane_address(offered: object) -> tuple[int, str] | None:
    """Client (or peer) side: the daemon's local lane listener as a connect address, where the offer
    comes from a daemon on this host running as this user; None otherwise, or for a malformed offer.
    Only a name of Genie's own form is connected to: a daemon cannot point us at another service."""
    if (not isinstance(offered, dict) or offered.get("host") != shared_segments.host_id()
            or offered.get("uid") != os.getuid()):
        return None
    name = offered.get("path")
    if type(name) is not str or _LOCAL_LANE_NAME.fullmatch(name) is None:
        return None
    return (socket.AF_UNIX, name)


def own_unix_listener(address: tuple[int, object] | None) -> tuple[int, str] | None:
    """`address` if it is a Unix socket file owned by this process's user (an ipc daemon of ours:
    the daemon binds it), else None. Under CURVE such a daemon takes plain lanes from us (it
    checks our credentials itself); the check here spares another user's daemon a refused try."""
    if address is None or address[0] != socket.AF_UNIX or type(address[1]) is not str:
        return None
    try:
        return address if os.stat(address[1]).st_uid == os.getuid() else None
    except OSError:
        return None


def widen_buffers(sock: socket.socket) -> None:
    """Unix sockets buffer ~200 KiB by default: a 4 MiB transfer would take 20 wake-ups each way."""
    if sock.family == socket.AF_UNIX:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, UNIX_BUFFER_BYTES)  # capped by net.core.*mem_max
            except OSError:
                pass


ACCEPTED, ACCEPTED_SHARED = b"\x01", b"\x02"  # the daemon's answer to a greeting


def connect_greeted(address: tuple[int, object], magic: bytes, token: bytes, timeout: float
                    ) -> tuple[socket.socket, bytes]:
    """A connection to the daemon's lane listener, greeted with `magic` + `token` and accepted, and
    the daemon's answer (ACCEPTED_SHARED: it agreed to shared memory, asked for by MAGIC_SHARED)."""
    family, where = address
    sock = socket.socket(family, socket.SOCK_STREAM)
    widen_buffers(sock)
    sock.settimeout(timeout)
    try:
        sock.connect(where)
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(magic + token)
        answer = recv_exactly(sock, 1)
        if answer not in (ACCEPTED, ACCEPTED_SHARED):
            raise ConnectionError("daemon refused the connection")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock, answer


def open_client_lane(address: tuple[int, object], token: bytes, pool: HostBufferPool, max_transfer: int,
                     timeout: float, shared: bool = True, lane_key: bytes | None = None,
                     joining: dict | None = None) -> Lane:
    """The client's bulk lane; asks for shared memory when `shared` and the lane is a Unix socket.
    With `lane_key` (a CURVE daemon's, from hello), a sealed lane (see sealed_lane). With `joining`
    (a lane_set.LaneSet's member_kwargs()), one more lane of that set, never shared."""
    if lane_key is not None:
        sock, sealing = connect_sealed(address, token, lane_key, timeout,
                                       MAGIC_SEALED_JOIN if joining else MAGIC_SEALED)
        return Lane(sock, pool, max_transfer, name="client", sealing=sealing, **(joining or {}))
    if joining:
        sock, _ = connect_greeted(address, MAGIC_JOIN, token, timeout)
        return Lane(sock, pool, max_transfer, name="client", **joining)
    shared = shared and address[0] == socket.AF_UNIX and shared_segments.supported()
    sock, answer = connect_greeted(address, MAGIC_SHARED if shared else MAGIC, token, timeout)
    return Lane(sock, pool, max_transfer, name="client", shared=answer == ACCEPTED_SHARED)


def open_shared_lane(address: tuple[int, object], token: bytes, pool: HostBufferPool, timeout: float) -> Lane | None:
    """A bulk lane to a Unix-socket listener with shared memory, or None (the lane closed again)
    where the daemon did not agree to it; connection errors are raised."""
    lane = open_client_lane(address, token, pool, 1 << 40, timeout, shared=True)
    if lane.shared:
        return lane
    lane.close()
    return None


def connect_sealed(address: tuple[int, object], token: bytes, lane_key: bytes, timeout: float,
                   magic: bytes = MAGIC_SEALED) -> tuple[socket.socket, tuple[sealed_lane.Direction, sealed_lane.Direction]]:
    """A sealed lane's connection (a bulk lane; with stream_framing.MAGIC_SEALED, a direct lane):
    greeted with the client's random, answered with the daemon's, keys derived, and the HELLO
    record sent (the daemon attaches the lane once it opens)."""
    client_random = sealed_lane.new_random()
    sock, _ = connect_greeted(address, magic, token + client_random, timeout)
    try:
        sock.settimeout(timeout)
        sealing = finish_sealed_greeting(sock, lane_key, client_random)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock, sealing


def finish_sealed_greeting(sock: socket.socket, lane_key: bytes, client_random: bytes
                           ) -> tuple[sealed_lane.Direction, sealed_lane.Direction]:
    """(The client, once the daemon accepted its sealed greeting.) The daemon's random read, keys
    derived, HELLO sent: the lane's (sending, receiving) directions."""
    server_random = recv_exactly(sock, sealed_lane.RANDOM_BYTES)
    sealing = sealed_lane.directions(lane_key, client_random, server_random, client_side=True)
    sock.sendall(sealing[0].seal(_HEADER.pack(HELLO, 0, 0, 0)))
    return sealing


def accept_sealed(conn: socket.socket, lane_key: bytes) -> tuple[sealed_lane.Direction, sealed_lane.Direction]:
    """The daemon's side of `connect_sealed`, after the magic and token: the client's random read,
    ACCEPTED and the daemon's random sent, keys derived, and the client's HELLO opened (a client
    without the lane key fails here)."""
    client_random = recv_exactly(conn, sealed_lane.RANDOM_BYTES)
    server_random = sealed_lane.new_random()
    conn.sendall(ACCEPTED + server_random)
    sealing = sealed_lane.directions(lane_key, client_random, server_random, client_side=False)
    hello = sealing[1].open(recv_exactly(conn, _HEADER.size + sealed_lane.TAG_BYTES))
    if _HEADER.unpack(hello) != (HELLO, 0, 0, 0):
        raise ProtocolError("a sealed lane must open with HELLO")
    return sealing


def is_segment_name(value) -> bool:
    """Whether `value` is a [segment, bytes] pair as `Lane.name_in_segment` gives (checked before
    `take_named`, wherever a message names one)."""
    return type(value) is list and len(value) == 2 and all(type(v) is int for v in value)


def new_token() -> bytes:
    return os.urandom(TOKEN_BYTES)
