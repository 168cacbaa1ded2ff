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
ZeroMQ routing id, 16 random bytes, which ties the lane to that client) and
the daemon answers one byte, ``b"\\x01"``. Then, in each direction, transfers
follow each other as ``<u64 transfer id, u64 nbytes>`` + payload. Each side's
transfer ids are its own. A violation closes the lane; ops that wait on a
transfer then fail with a clear error after a timeout.

The lane is plaintext: it is not used when CURVE encryption is on.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
from typing import Callable

import torch

from .errors import ProtocolError
from .hostmem import HostBufferPool

log = logging.getLogger("genie.transport")

MAGIC = b"GNB1"
TOKEN_BYTES = 16
_HEADER = struct.Struct("<QQ")
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

    return tensor_to_buffer(t).cast("B")


class Arrivals:
    """Transfers received and not yet claimed, keyed by transfer id; waiters block on a condition."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._done: dict[int, torch.Tensor] = {}
        self._cond = threading.Condition()
        self.failure: BaseException | None = None
        self.on_change = on_change  # called (on the receiving thread) after each arrival or failure

    def put(self, xfer: int, data: torch.Tensor) -> None:
        with self._cond:
            self._done[xfer] = data
            self._cond.notify_all()
        if self.on_change is not None:
            self.on_change()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.failure = exc
            self._cond.notify_all()
        if self.on_change is not None:
            self.on_change()

    def take(self, xfer: int, timeout: float) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: xfer in self._done or self.failure is not None, timeout):
                raise TimeoutError(f"bulk transfer {xfer} did not arrive" + (f" within {timeout:.0f}s" if timeout else ""))
            if xfer in self._done:
                return self._done.pop(xfer)
            raise ConnectionError(f"bulk lane failed before transfer {xfer} arrived: {self.failure}")

    def ready(self, xfer: int) -> bool:
        with self._cond:
            return xfer in self._done or self.failure is not None

    def pending_bytes(self) -> int:
        with self._cond:
            return sum(t.nbytes for t in self._done.values())

    def clear(self) -> None:
        with self._cond:
            self._done.clear()


class Lane:
    """One established bulk connection: a locked sender and a receiving thread feeding `arrivals`."""

    def __init__(self, sock: socket.socket, pool: HostBufferPool, max_transfer: int, name: str,
                 on_close: Callable[["Lane"], None] | None = None) -> None:
        self.sock = sock
        self.pool = pool
        self.max_transfer = max_transfer
        self.arrivals = Arrivals()
        self._send_lock = threading.Lock()
        self._ids = iter(range(1, 1 << 63))
        self._on_close = on_close
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self._thread = threading.Thread(target=self._receive_loop, name=f"genie-bulk-{name}", daemon=True)
        self._thread.start()

    def next_id(self) -> int:
        with self._send_lock:
            return next(self._ids)

    def send(self, xfer: int, payload: memoryview, after_head: Callable[[], None] | None = None) -> None:
        """Write one transfer; holds the lane for its whole length so transfers never interleave.

        `after_head` runs once the first HEAD_BYTES are out: the sender's ZeroMQ message about
        this transfer goes then, so the receiving thread is already reading (woken while the
        receiver's CPU was free) when that message lands; sent before the payload, its handling
        could hold that CPU at the moment the payload's wake-up came, and on a two-core machine
        the receiving thread then waited behind the sender for the whole transfer. An exception
        from `after_head` is raised once the payload is out (the stream must stay in step).
        """
        payload = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        deferred: BaseException | None = None
        with self._send_lock:
            if self.closed:
                raise ConnectionError("bulk lane is closed")
            try:
                self.sock.sendall(_HEADER.pack(xfer, payload.nbytes))
                start = 0
                if after_head is not None:
                    start = min(HEAD_BYTES, payload.nbytes)
                    self.sock.sendall(payload[:start])
                    try:
                        after_head()
                    except BaseException as e:  # noqa: BLE001 - raised below, after the payload
                        deferred = e
                for i in range(start, payload.nbytes, _SEND_SLICE):
                    self.sock.sendall(payload[i:i + _SEND_SLICE])
            except OSError as e:
                self.close(e)
                raise ConnectionError(f"bulk lane send failed: {e}") from e
            self.bytes_sent += payload.nbytes + _HEADER.size
        if deferred is not None:
            raise deferred

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
                poller.poll()
                xfer, nbytes = _HEADER.unpack(recv_exactly(self.sock, _HEADER.size))
                if nbytes > self.max_transfer:
                    raise ProtocolError(f"bulk transfer of {nbytes} bytes exceeds the limit of {self.max_transfer}")
                data = self.pool.take(nbytes)
                if nbytes:
                    recv_into_exactly(self.sock, memoryview(data.numpy()))
                self.bytes_received += nbytes + _HEADER.size
                self.arrivals.put(xfer, data)
                del data  # the pool sees the block as free once the consumer drops it
        except (OSError, ConnectionError, ProtocolError, ValueError, MemoryError, RuntimeError) as e:
            if not self.closed:
                log.info("bulk lane closed: %s", e)
            self.close(e)

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
        if self._on_close is not None:
            self._on_close(self)


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


def widen_buffers(sock: socket.socket) -> None:
    """Unix sockets buffer ~200 KiB by default: a 4 MiB transfer would take 20 wake-ups each way."""
    if sock.family == socket.AF_UNIX:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, UNIX_BUFFER_BYTES)  # capped by net.core.*mem_max
            except OSError:
                pass


def connect_greeted(address: tuple[int, object], magic: bytes, token: bytes, timeout: float) -> socket.socket:
    """A connection to the daemon's lane listener, greeted with `magic` + `token` and accepted."""
    family, where = address
    sock = socket.socket(family, socket.SOCK_STREAM)
    widen_buffers(sock)
    sock.settimeout(timeout)
    try:
        sock.connect(where)
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(magic + token)
        if recv_exactly(sock, 1) != b"\x01":
            raise ConnectionError("daemon refused the connection")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def open_client_lane(address: tuple[int, object], token: bytes, pool: HostBufferPool, max_transfer: int,
                     timeout: float) -> Lane:
    return Lane(connect_greeted(address, MAGIC, token, timeout), pool, max_transfer, name="client")


def new_token() -> bytes:
    return os.urandom(TOKEN_BYTES)
