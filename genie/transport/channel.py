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
import select
import socket
import threading
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from . import protocol, stream_framing
from .busy_poll import BusyPoll
from .errors import ProtocolError
from .interrupts import held_between_waits, is_interrupt, let_through

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


def _receive_whole(sock: zmq.Socket) -> tuple[list, bool]:
    """One multipart message, and whether a KeyboardInterrupt came while it was being read. An
    interrupt before its first frame is raised (nothing was taken); after it, the rest is read
    anyway, so that the socket stays in step (recv_multipart would leave the rest behind)."""
    parts = [sock.recv(copy=False)]
    interrupted = False
    while True:
        try:
            while parts[-1].more:
                parts.append(sock.recv(copy=False))
            return parts, interrupted
        except KeyboardInterrupt:
            interrupted = True


class ChannelClosed(ConnectionError):
    pass


class AnswerLost(ChannelClosed):
    """The answer to a request was to come on a direct lane that Ctrl-C cut in the middle of an
    answer (its framing lost): the daemon ran the request, its answer will not be read."""


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


WAIT_AVERAGING = 0.25  # weight of the latest wait in the moving average that decides on spinning

# Monitor endpoints, one per socket for the process's life. pyzmq's default names one after the
# socket's file descriptor, and descriptors are reused: a new socket could meet the endpoint of a
# closed one that libzmq has not torn down yet.
_monitor_ids = itertools.count()
_HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                       | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_WATCHED_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILURES


class Channel:
    def __init__(self, endpoint: str, context: zmq.asyncio.Context, routing_id: bytes | None = None,
                 curve=None) -> None:
        self.endpoint = endpoint
        self.curve = curve  # security.ClientKeys, or None for a plaintext connection
        self.routing_id = routing_id
        self._ctx = context
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # reading end of the connection watch (see _stop_monitor)
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
        self._direct: zmq.Socket | None = None  # the caller-thread socket of `send_direct`
        # The direct lane (stream_framing): a plain socket that `send_direct` uses instead of
        # `_direct` once attached; dropped for `_direct` if it fails.
        self.direct_stream: socket.socket | None = None
        # Its (sending, receiving) sealed_lane directions when it is sealed (under CURVE), else None.
        self.direct_sealing: tuple | None = None
        # Direct requests sent and not yet answered: where each went and when. The daemon may answer
        # them out of order (a malformed one at once, ahead of earlier execs), so an answer read
        # while waiting for another is kept in `_direct_early` for its own reader.
        self._direct_awaiting: dict[int, tuple[socket.socket | None, float]] = {}
        self._direct_early: dict[int, tuple[bool, object, list]] = {}
        # Direct lanes Ctrl-C dropped mid-answer: answers due there are lost. (The link opens a fresh
        # lane after each drop; a cut one is forgotten once no request awaits an answer on it.)
        self._cut_streams: set[socket.socket] = set()
        self.on_direct_dropped = None  # callback(): the direct lane was dropped (the link opens another)
        self.on_unread_reply = None  # callback(ok, body): a direct answer nobody will read (see forget_reply)
        self._pollers: dict = {}  # the direct lane's socket -> a poll object on it
        self.loss_grace_s = 5.0  # after the direct lane breaks, how long to wait for the link's verdict
        self.busy_poll = BusyPoll(0.0)  # a direct request polls for its answer before blocking (_spin_for_reply)
        self._typical_wait = 0.0  # moving average of how long direct requests waited for their answer
        self._sync_ctx: zmq.Context | None = None
        self._direct_lock = threading.Lock()
        self.last_heard = 0.0  # time.monotonic() of the last reply from the daemon
        self.on_disconnect = None  # callback(reason): set before open() to learn of dropped connections
        self.connected = False  # whether the watch (on with on_disconnect) saw the connection come up

    async def open(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.routing_id:
            sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        if self.curve is not None:
            self.curve.apply(sock)
        if self.on_disconnect is not None:
            # Attached before connect(): an ipc connection is up within connect(), and a watch that
            # missed its EVENT_CONNECTED would never report that connection dropping.
            self._monitor = sock.get_monitor_socket(_WATCHED_EVENTS, addr=f"inproc://genie-monitor-{next(_monitor_ids)}")
        sock.connect(self.endpoint)
        self._socket = sock
        self._outbox = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._send_loop()), asyncio.create_task(self._receive_loop())]
        if self._monitor is not None:
            self._tasks.append(asyncio.create_task(self._watch_connection(self._monitor)))

    async def _watch_connection(self, monitor) -> None:
        """Report a dropped connection at once: replies to anything in flight are lost with it."""
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] & _HANDSHAKE_FAILURES:
                    self._stop_monitor()
                    self.on_disconnect("the CURVE handshake failed: the daemon's key or this client's is not "
                                       "the expected one" if self.curve else "the ZeroMQ handshake failed")
                    return
                if event["event"] == zmq.EVENT_CONNECTED:
                    self.connected = True
                elif event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                    self._stop_monitor()
                    self.on_disconnect("the connection dropped")
                    return
        finally:
            # Nobody reads the monitor after this: detach it, or its events would pile up until
            # libzmq's send blocks (see _stop_monitor). After close() (cancelled) this is a no-op.
            self._stop_monitor()

    def _stop_monitor(self) -> None:
        """Detach the connection watch while the socket is still open, and only then close its
        reading end. libzmq's I/O thread sends each event with a blocking send: an event for a
        monitor whose reader is gone (e.g. the connection dropping while a closed socket is still
        being torn down) blocks that thread for good, and with it every connection of the context,
        so every later connect in this process waits forever (seen once in CI: each later hello
        timed out; reproduced with bare pyzmq)."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        try:
            self._socket.disable_monitor()
        except zmq.ZMQError as e:  # the monitor may still be attached: leave its reader open
            log.warning("could not detach the connection monitor of %s: %s", self.endpoint, e)
            return
        monitor.close(linger=0)

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
            self.last_heard = time.monotonic()
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

    # ------------------------------------------------------------ direct requests (caller's thread)

    def send_direct(self, kind: str, body: dict, frames: list | None) -> int:
        """Send a request from the calling thread on a second socket; its reply is read there by
        `receive_direct(id)`, the id returned.

        This skips both thread hops of `post_threadsafe` (the round trip a blocking read waits
        for drops from ~270 to ~100 us here). The daemon treats the second socket as the same
        client. The caller guarantees that nothing posted on the loop is still unanswered and
        that one thread at a time sends and reads here, so program order holds across the two
        sockets; several requests may be sent before their replies are read."""
        with self._direct_lock, held_between_waits():  # sent and noted as awaited, or neither (interrupts.py)
            return self._send_direct(kind, body, frames)

    def receive_direct(self, rid: int, timeout: float, alive=lambda: True, poll_s: float = 0.5) -> Reply:
        """The reply to `send_direct`'s request `rid`. Raises TimeoutError, ChannelClosed, or RemoteError."""
        with self._direct_lock, held_between_waits():  # an answer taken is filed (interrupts.py)
            return self._receive_direct(rid, timeout, alive, poll_s)

    def _send_direct(self, kind, body, frames) -> int:
        if self.closed:
            raise ChannelClosed(f"connection to {self.endpoint} is closed")
        rid = next(self._ids)
        header = protocol.pack([kind, rid, body])
        frames = frames or []
        sizes = [memoryview(f).nbytes for f in frames]
        stream = self.direct_stream
        if stream is not None:
            try:
                # Only a full socket buffer makes this wait, and only there Ctrl-C stops it (below).
                stream_framing.send_message(stream, [header, *frames],
                                            self.direct_sealing[0] if self.direct_sealing else None, let_through)
            except OSError as e:
                self._drop_direct_stream(e)
                if self._direct_awaiting:  # their answers were to come on that lane: lost with it
                    raise ChannelClosed(f"direct lane to {self.endpoint} failed with "
                                        f"{len(self._direct_awaiting)} answers unread: {e}") from None
                stream = None  # nothing usable went out: this request goes by ZeroMQ
            except BaseException as e:
                if is_interrupt(e):
                    # Ctrl-C in the middle of sending (a full socket buffer): the daemon would read the
                    # rest of the lane misframed. It is dropped, as a cut mid-answer is, and answers
                    # due on it are lost; this request did not go.
                    self._cut_streams.add(stream)
                    self._drop_direct_stream("interrupted while sending a request")
                raise
        if stream is None:
            self._direct_socket().send_multipart([header, *frames], copy=all(n < COPY_THRESHOLD for n in sizes))
        self.bytes_sent += len(header) + sum(sizes)
        self.messages_sent += 1
        self._direct_awaiting[rid] = (stream, time.perf_counter())
        return rid

    def _drop_direct_stream(self, why) -> None:
        log.warning("direct lane to %s failed (%s); blocking requests go by ZeroMQ until another is open",
                    self.endpoint, why)
        try:
            self.direct_stream.close()
        except (OSError, AttributeError):
            pass
        self.direct_stream = None
        self.direct_sealing = None
        awaited = {stream for stream, _ in self._direct_awaiting.values()}
        self._cut_streams &= awaited
        if self.on_direct_dropped is not None:
            self.on_direct_dropped()

    def _receive_direct(self, rid, timeout, alive, poll_s) -> Reply:
        reading_from = time.perf_counter()
        interrupted = False
        try:
            if self.closed:
                raise ChannelClosed(f"connection to {self.endpoint} is closed")
            early = self._direct_early.pop(rid, None)
            if early is not None:
                return self._settle(*early)
            stream, sent_at = self._direct_awaiting[rid]
            if stream is not None and stream in self._cut_streams:
                del self._direct_awaiting[rid]
                if all(other is not stream for other, _ in self._direct_awaiting.values()):
                    self._cut_streams.discard(stream)  # the last answer due there
                raise AnswerLost(f"the answer to request {rid} was lost: Ctrl-C cut the direct lane to "
                                 f"{self.endpoint} in the middle of an answer")
            reply = (self._receive_zmq_direct(rid, timeout, alive, poll_s) if stream is None
                     else self._receive_stream_direct(stream, rid, timeout, alive, poll_s))
            # The wait this reader saw: an answer read long after its request went (a posted
            # batch, read after the next ones were captured) says nothing about the daemon's pace.
            waited = time.perf_counter() - max(sent_at, reading_from)
            self._typical_wait += WAIT_AVERAGING * (waited - self._typical_wait)
            return reply
        except BaseException as e:
            # Ctrl-C while waiting (see _receive_stream_direct): the answer still comes, in order,
            # and a later reader keeps it for this request's next reader (or `forget_reply` drops it).
            interrupted = is_interrupt(e)
            raise
        finally:
            if not interrupted:
                self._direct_awaiting.pop(rid, None)  # answered, failed, or timed out: a late answer is dropped

    def forget_reply(self, rid: int) -> None:
        """Nobody will read the answer to direct request `rid` (its waiter was interrupted): drop it
        when it comes, or now if it came already."""
        self._direct_awaiting.pop(rid, None)
        early = self._direct_early.pop(rid, None)
        if early is not None:
            self._unread(early[0], early[1])

    def _unread(self, ok: bool, body) -> None:
        """A reply dropped unread: the link lets go of what it names (bulk transfers to come)."""
        if self.on_unread_reply is not None:
            self.on_unread_reply(ok, body)

    def _receive_stream_direct(self, stream, rid, timeout, alive, poll_s) -> Reply:
        poller = self._pollers.get(stream)
        if poller is None:  # one per lane socket, kept: made per answer it cost ~2 us of every read
            poller = select.poll()
            poller.register(stream, select.POLLIN)
            self._pollers = {stream: poller}
        readable = self._spin_for_reply(poller)
        waited = 0.0
        receiving = self.direct_sealing[1] if self.direct_sealing and stream is self.direct_stream else None
        while True:
            if not readable:
                waited = self._wait_readable(poller.poll, timeout, alive, poll_s, waited)
            readable = False
            try:
                parts = stream_framing.receive_message(stream, protocol.MAX_FRAMES + 1, 1 << 62, 1 << 62, receiving)
            except KeyboardInterrupt:
                # Ctrl-C in the middle of a message (the waits above are where it almost always
                # lands, harmlessly): the lane's framing is lost, so requests go by ZeroMQ until the link
                # has opened another lane.
                if self.direct_stream is stream:
                    self._cut_streams.add(stream)
                    self._drop_direct_stream("interrupted while reading an answer")
                raise
            except (OSError, ProtocolError) as e:
                if self.direct_stream is stream:
                    self._drop_direct_stream(e)
                # The daemon may have died: its ZeroMQ link is what says so (and how), within
                # its heartbeat timeout. If it is alive, it closed only this lane.
                deadline = time.monotonic() + self.loss_grace_s
                while time.monotonic() < deadline and not self.closed and alive():
                    time.sleep(0.02)
                if self.closed or not alive():
                    raise ChannelClosed(f"connection to {self.endpoint} was lost") from None
                raise ChannelClosed(f"direct lane to {self.endpoint} failed: {e}") from None
            reply = self._reply_for(rid, parts)
            if reply is not None:
                return reply

    def _wait_readable(self, poll, timeout: float, alive, poll_s: float, waited: float) -> float:
        """Block until `poll(ms)` reports input; the seconds waited so far, updated. Raises
        ChannelClosed when the link is gone, TimeoutError past `timeout`."""
        with let_through():  # nothing is taken while waiting: Ctrl-C stops the wait at once
            while not poll(int(min(poll_s, timeout - waited) * 1000) or 1):
                waited += poll_s
                if self.closed or not alive():
                    raise ChannelClosed(f"connection to {self.endpoint} was lost")
                if waited >= timeout:
                    raise TimeoutError(f"genie-daemon at {self.endpoint} did not answer within {timeout:.0f}s")
        return waited

    def _spin_for_reply(self, poller) -> bool:
        """Poll for the answer for up to `busy_poll.seconds` before blocking; whether it came (the
        reader then skips one more poll). A thread blocked in poll() on this 2-vCPU machine took
        ~50 us to wake once the answer came; polling, (x+1).item() went from ~180 to ~105 us and a
        replayed GPT decode step from ~1.45x to ~1.3x local eager. Not when answers have lately taken longer than that (a busy daemon:
        with 16 clients on these 2 cores, polling cost them 17% of their requests/s), nor while
        backed off after misses (busy_poll)."""
        if self._typical_wait <= self.busy_poll.seconds and self.busy_poll.available():
            return bool(self.busy_poll.run(lambda: poller.poll(0)))
        return False

    def _reply_for(self, rid: int | None, parts: list) -> Reply | None:
        """The reply in `parts` if it answers `rid`. None: the answer to another direct request
        still awaited (kept for its reader), a late answer, or malformed (both dropped)."""
        self.last_heard = time.monotonic()
        self.bytes_received += sum(map(len, parts))
        try:
            got_rid, ok, reply_body = protocol.unpack_header(parts[0].buffer)
        except (ProtocolError, ValueError, TypeError) as e:
            log.warning("dropping a malformed reply from %s: %s", self.endpoint, e)
            return None
        if got_rid != rid:
            if got_rid in self._direct_awaiting:
                self._direct_early[got_rid] = (ok, reply_body, parts[1:])
            else:  # a late answer: its reader gave up (interrupted, or timed out)
                self._unread(ok, reply_body)
            return None
        return self._settle(ok, reply_body, parts[1:])

    @staticmethod
    def _settle(ok: bool, body, frames: list) -> Reply:
        if ok:
            return Reply(body, frames)
        raise RemoteError(body)

    def _receive_zmq_direct(self, rid, timeout, alive, poll_s) -> Reply:
        sock = self._direct_socket()
        waited = 0.0
        while True:
            waited = self._wait_readable(sock.poll, timeout, alive, poll_s, waited)
            parts, interrupted = _receive_whole(sock)
            if interrupted:  # Ctrl-C between its frames: the answer waits for its next reader
                self._reply_for(None, parts)
                raise KeyboardInterrupt
            reply = self._reply_for(rid, parts)
            if reply is not None:
                return reply

    def _direct_socket(self) -> zmq.Socket:
        if self._direct is None:
            self._sync_ctx = zmq.Context.shadow(self._ctx.underlying)
            sock = self._sync_ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.routing_id:
                sock.setsockopt(zmq.ROUTING_ID, self.routing_id + b"\x01")
            if self.curve is not None:
                self.curve.apply(sock)
            sock.connect(self.endpoint)
            self._direct = sock
        return self._direct

    def fail_pending(self, exc: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()

    def abandon(self) -> None:
        """In a forked child: stop using the parent's connection without a word on it. ZeroMQ
        objects are left alone (pyzmq never closes them outside the process that made them); the
        direct lane's descriptor is closed in this process only (a close, not a shutdown: the
        parent's connection stays as it was)."""
        self.closed = True
        self._pending = {}  # futures of the parent's threads
        self._direct_lock = threading.Lock()  # a parent thread may have held it at the fork
        if self.direct_stream is not None:
            self.direct_stream.close()
            self.direct_stream = None
        self._direct_awaiting = {}
        self._direct_early = {}

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        self.fail_pending(ChannelClosed(f"connection to {self.endpoint} closed"))
        if self._socket is not None:
            self._stop_monitor()
            self._socket.close(linger=0)
        # A thread may be inside receive_direct: it sees `closed` within one poll and gives up.
        if (self._direct is not None or self.direct_stream is not None) and self._direct_lock.acquire(timeout=1.0):
            try:
                if self._direct is not None:
                    self._direct.close(linger=0)
                if self.direct_stream is not None:
                    self.direct_stream.close()
            finally:
                self._direct_lock.release()
