"""A client's connection to one daemon: a ZeroMQ DEALER socket on asyncio.

Requests are matched to replies by request id. All methods run on the owning
event loop; `post` is non-blocking and keeps submission order (one sender task
drains a FIFO), which is what makes the remote device an ordered stream.
Byte counters cover headers and payload frames in both directions.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from . import protocol
from .errors import ProtocolError

log = logging.getLogger("genie.transport")

# Below this size, copying a frame into ZeroMQ is cheaper than pinning it (see bench/).
COPY_THRESHOLD = 64 * 1024


class RemoteError(Exception):
    """The daemon answered a request with an error."""

    def __init__(self, body: dict) -> None:
        body = body if isinstance(body, dict) else {}
        self.error_type = str(body.get("type") or "RemoteError")
        self.message = str(body.get("message") or "")
        self.op = body.get("op")
        super().__init__(f"{self.op or 'request'}: {self.error_type}: {self.message}")


class ChannelClosed(ConnectionError):
    pass


def _chain(source, target) -> None:
    if source.cancelled():
        target.set_exception(ChannelClosed("request cancelled: the connection closed"))
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


@dataclass
class Reply:
    body: dict
    frames: list  # zmq.Frame objects, each exposing .buffer


class Channel:
    def __init__(self, endpoint: str, context: zmq.asyncio.Context) -> None:
        self.endpoint = endpoint
        self._ctx = context
        self._socket: zmq.asyncio.Socket | None = None
        # Ids start at 2**16 so that msgpack writes every one in 5 bytes (up to 2**32): message
        # sizes then do not creep up as a run goes on, and byte counts stay comparable.
        self._ids = itertools.count(1 << 16)
        self._pending: dict[int, asyncio.Future] = {}
        self._outbox: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0

    async def open(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._socket = sock
        self._outbox = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._send_loop()), asyncio.create_task(self._receive_loop())]

    def post(self, kind: str, body: dict, frames: list | None = None) -> asyncio.Future:
        """Queue a request; the future resolves to a `Reply` or raises `RemoteError`."""
        if self.closed:
            raise ChannelClosed(f"connection to {self.endpoint} is closed")
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        header = protocol.pack([kind, rid, body])
        self._outbox.put_nowait((header, frames or []))
        return future

    def post_threadsafe(self, loop, kind: str, body: dict, frames: list | None = None):
        """From any thread: queue a request; returns a concurrent.futures.Future of the reply.

        Cheaper than run_coroutine_threadsafe (no task, no coroutine), which matters for the
        round trip a blocking read waits on. Calls from one thread keep their order.
        """
        import concurrent.futures

        result: concurrent.futures.Future = concurrent.futures.Future()

        def start() -> None:
            try:
                future = self.post(kind, body, frames)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                result.set_exception(e)
                return
            future.add_done_callback(lambda f: _chain(f, result))

        loop.call_soon_threadsafe(start)
        return result

    async def _send_loop(self) -> None:
        sock = self._socket
        while True:
            header, frames = await self._outbox.get()
            sizes = [memoryview(f).nbytes for f in frames]
            copy = all(s < COPY_THRESHOLD for s in sizes)
            await sock.send_multipart([header, *frames], copy=copy)
            self.bytes_sent += len(header) + sum(sizes)
            self.messages_sent += 1

    async def _receive_loop(self) -> None:
        sock = self._socket
        while True:
            parts = await sock.recv_multipart(copy=False)
            self.bytes_received += sum(len(p) for p in parts)
            try:
                header = protocol.unpack_header(parts[0].buffer)
                rid, ok, body = header
            except (ProtocolError, ValueError, TypeError) as e:
                log.warning("dropping a malformed reply from %s: %s", self.endpoint, e)
                continue
            future = self._pending.pop(rid, None)
            if future is None or future.done():
                continue
            if ok:
                future.set_result(Reply(body, parts[1:]))
            else:
                future.set_exception(RemoteError(body))

    def fail_pending(self, exc: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        self.fail_pending(ChannelClosed(f"connection to {self.endpoint} closed"))
        if self._socket is not None:
            self._socket.close(linger=0)
