"""Daemon-to-daemon tensor transfer: a mailbox for arriving tensors and senders to peers.

When a client moves a tensor from daemon A to daemon B, A's executor runs
`genie::send` (hand the tensor to `PeerLinks`, which ships it to B as a
`deposit` message on the event loop, without blocking A's executor) and B's runs
`genie::recv` (wait in the `Mailbox` for that transfer id). The bytes never pass
through the client. Transfer ids are 128-bit random strings chosen by the client.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import os
import re
import threading
import time

import torch
import zmq
import zmq.asyncio

from genie.transport import bulk, lane_set, protocol, sealed_lane
from genie.transport.errors import ProtocolError
from genie.transport.hostmem import HostBufferPool, snapshot
from genie.transport.tensors import (bytes_as_tensor, dense, dense_span, dtype_name, is_dense, laid_out, tensor_to_buffer,
                                     tensor_to_frames)

from . import peer_direct

log = logging.getLogger("genie.daemon")

PEER_LANE_MIN_BYTES = 1 << 20  # tensors at least this big go to a peer on a lane, where it offers one
# Deposits carrying at most this many bytes go on the peer's direct lane, where one is open.
PEER_DIRECT_MAX_BYTES = 1 << 20
SENDER_THREADS = 4  # lane sends under way at once (to several peers; one lane takes one at a time)
# After a peer's lane fails, how long a deposit naming bytes on it waits for the peer's deposit
# of the bytes themselves (sent as soon as the peer's send fails) before its taker is told.
REPLACEMENT_WAIT_S = 2.0
TRANSFER_ID = re.compile(r"^[0-9a-f]{32}$")
PEER_ENDPOINT = re.compile(r"^(tcp://[A-Za-z0-9.\-\[\]:]+:\d+|ipc:///[A-Za-z0-9_./\-]+)$")


def check_transfer_id(tid) -> str:
    if not isinstance(tid, str) or not TRANSFER_ID.match(tid):
        raise ProtocolError(f"bad transfer id {tid!r}")
    return tid


class Mailbox:
    """Tensors that arrived from peers, waiting for the `genie::recv` that claims them.

    A deposit nobody claims within `ttl_s` is dropped, and the mailbox holds at most
    `max_bytes` in all, so deposits alone cannot fill the daemon's memory.
    """

    def __init__(self, ttl_s: float = 300.0, max_bytes: int = 0) -> None:
        self._items: dict[str, tuple[float, torch.Tensor]] = {}
        self._cond = threading.Condition()
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes  # 0: no bound
        self.bytes = 0

    def put(self, tid: str, tensor: "torch.Tensor | LaneDeposit") -> None:
        """Hold `tensor` for transfer `tid`; a LaneDeposit stands for bytes arriving on a lane."""
        with self._cond:
            self._expire_locked()
            if self.max_bytes and self.bytes + tensor.nbytes > self.max_bytes:
                raise ProtocolError(f"mailbox full: {self.bytes} bytes wait unclaimed (limit {self.max_bytes})")
            old = self._items.pop(tid, None)
            if old is not None:
                self._let_go(old[1])
            self._items[tid] = (time.monotonic(), tensor)
            self.bytes += tensor.nbytes
            self._cond.notify_all()

    def _let_go(self, item) -> None:
        self.bytes -= item.nbytes
        if isinstance(item, LaneDeposit):
            item.drop()

    def has(self, tid: str) -> bool:
        """Whether `take(tid, 0)` would return: deposited, and its bytes in where they come on a lane."""
        return self.ready_bytes(tid) is not None

    def ready_bytes(self, tid: str) -> int | None:
        """The size of transfer `tid`'s tensor where `has(tid)`, else None."""
        with self._cond:
            item = self._items.get(tid)
        if item is None or isinstance(item[1], LaneDeposit) and not item[1].ready():
            return None
        return item[1].nbytes

    def expire(self) -> None:
        with self._cond:
            self._expire_locked()

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for key in [k for k, (t, _) in self._items.items() if now - t > self.ttl_s]:
            self._let_go(self._items.pop(key)[1])  # never claimed: drop

    def take(self, tid: str, timeout: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        with self._cond:
            while tid not in self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no tensor arrived from the peer daemon for transfer {tid}")
                self._cond.wait(left)
            tensor = self._items.pop(tid)[1]
            self.bytes -= tensor.nbytes
        if isinstance(tensor, LaneDeposit):
            return tensor.take(max(0.0, deadline - time.monotonic()))
        return tensor


class LaneDeposit:
    """A peer's deposit whose bytes come on its lane: transfer `xfer` of `lane`, the lane open when
    the deposit came (a later lane from the same peer numbers its transfers afresh).

    The peer sends the deposit once the bytes' head is out, so it often comes before them. If the
    lane fails first, the peer sends the bytes in a deposit of their own, which takes this one's
    place in the mailbox; until then, or REPLACEMENT_WAIT_S after the failure was seen, this one
    is not ready (then its taker is told of the failure)."""

    __slots__ = ("lane", "xfer", "dtype", "shape", "strides", "nbytes", "failed_at")

    def __init__(self, lane, xfer: int, dtype: torch.dtype, shape: tuple[int, ...],
                 strides: tuple[int, ...] | None = None) -> None:
        self.lane, self.xfer, self.dtype, self.shape = lane, xfer, dtype, shape
        self.strides = strides  # the bytes are a run in this order (tensors.laid_out)
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.failed_at: float | None = None

    def ready(self) -> bool:
        if self.lane.arrivals.landed(self.xfer):
            return True
        if not (self.lane.closed or self.lane.arrivals.failure is not None):
            return False
        if self.failed_at is None:
            self.failed_at = time.monotonic()
        return time.monotonic() - self.failed_at > REPLACEMENT_WAIT_S

    def take(self, timeout: float) -> torch.Tensor:
        try:
            raw = self.lane.arrivals.take(self.xfer, timeout)
        except (TimeoutError, ConnectionError) as e:
            raise ProtocolError(f"peer transfer: {e}") from None
        return laid_out(bytes_as_tensor(raw, self.dtype, self.shape, f"peer transfer {self.xfer}"), self.strides)

    def drop(self) -> None:
        """Never claimed, or replaced: let its bytes go too, now or as they land."""
        self.lane.arrivals.abandon(self.xfer)


class PeerLinks:
    """DEALER sockets from this daemon to its peers, used only on the event loop.

    A peer is greeted like a client (`hello`, with a routing id of our own), and where it offers a
    bulk lane (sealed, under CURVE, with the lane key its answer gives) large tensors go there: the
    bytes on the lane, written from a thread, then a `deposit` naming the lane transfer. ZeroMQ
    allocates fresh memory for every message it receives, which held peer transfers to 0.6-0.9
    GB/s here (0.3 under CURVE); a lane lands them in the receiver's recycled buffers. Until the
    lane is open, or if it fails, deposits carry the tensor's frames. Those of small tensors go on
    a direct lane to the peer (peer_direct), opened with the bulk lanes (the first small copy
    greets the peer too), which skips ZeroMQ's I/O threads.
    """

    def __init__(self, context: zmq.asyncio.Context, loop: asyncio.AbstractEventLoop, curve=None,
                 lane_min_bytes: int = PEER_LANE_MIN_BYTES, quiet_s: float = 30.0, lanes: int = 0,
                 shared_memory: bool = True) -> None:
        self._ctx = context
        self._curve = curve  # ClientKeys: this daemon's key pair, peers' (shared) public key
        self._loop = loop
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._tokens: dict[str, bytes] = {}  # our routing id at each peer (it names our lane there)
        self._lanes: dict[str, object] = {}  # endpoint -> its lane (a lane_set.LaneSet over TCP), once open
        self._direct: dict[str, peer_direct.PeerDirectLane] = {}  # endpoint -> its direct lane, once open
        self._greeted: set[str] = set()  # peers said hello to, and whose lanes have not closed since
        self._hello_ids: dict[str, int] = {}  # endpoint -> the id of our hello awaiting its answer
        self._opening: set[str] = set()  # peers whose lanes are being opened (greeting again would replace them)
        self._ids = 0
        self.lane_min_bytes = lane_min_bytes  # 0: never a lane
        self.lanes = lanes  # bulk lanes to open to each peer (0: as many as a client would)
        # Ask an ipc:// peer on this host for shared memory, as a client does: the bytes are copied
        # once, into a segment the peer maps, instead of through the Unix socket (64-256 MiB: ~2x).
        self.shared_memory = shared_memory
        # A peer drops a client (us) silent for its lease, and our lane with it. After this long
        # without a message to it, a transfer goes inside ZeroMQ (which renews the lease) rather
        # than on a lane the peer may be closing at that very moment.
        self.quiet_s = quiet_s
        self._last_sent: dict[str, float] = {}
        self._sender_pool: concurrent.futures.ThreadPoolExecutor | None = None  # threads writing lanes
        # Sends handed to those threads whose end the loop has not yet heard of: while there are
        # any, the server does not poll idle for requests (see `sending`).
        self._lane_sends = 0
        self._lane_sends_lock = threading.Lock()
        self.bytes_sent = 0
        self.lane_bytes_sent = 0  # of those, on lanes
        self.direct_deposits = 0  # deposits written on direct lanes

    def send(self, endpoint: str, tid: str, tensor: torch.Tensor) -> None:
        """Thread-safe: called by the executor, on the worker or inline on the loop; what goes
        inside ZeroMQ goes from the loop."""
        if not PEER_ENDPOINT.match(endpoint):
            raise ProtocolError(f"bad peer endpoint {endpoint!r}")
        header_body = {"tid": tid, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}
        span = dense_span(tensor.detach())  # channels-last, transposed: as it lies, with its strides
        if span is not None:
            header_body["strides"] = list(tensor.stride())
        source = span if span is not None else tensor.detach()
        if source.device.type == "cpu":
            named = self._in_shared_segment(endpoint, source)
            if named is not None:  # copied now, into memory the peer reads: the deposit names it
                self._on_loop(self._deposit_named, endpoint, dict(header_body, segment=named))
                return
            # The bytes leave later (from the loop or a lane thread) while the executor runs the
            # client's next ops: a copy now, so that a write after the send does not reach them, as
            # a CUDA copy reads its source in stream order. (Before, `y = x.to(dev1); x.add_(1)`
            # gave y the written values in 17-30 of 30 tries. A GPU tensor's bytes come to the
            # host here anyway.)
            source = snapshot(source) if is_dense(source) else dense(source)
        payload = tensor_to_frames(source)
        lane = self._open_lane_for(endpoint, payload)
        if lane is not None:  # straight to a sender thread: no turn on the loop before the bytes go
            self._hand_to_sender(endpoint, lane, header_body, payload[0])
            return
        self._on_loop(self._send, endpoint, header_body, payload)

    def _on_loop(self, fn, *args) -> None:
        """`fn(*args)` on the loop: now, where this is the loop (a request run inline; queued, its
        send would wait out the server's idle poll for the client's next request: a 16 KiB copy
        took 1.6 ms instead of 0.7), else as its next callback."""
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _open_lane_for(self, endpoint: str, payload: list):
        """(The executor.) The open lane to send `payload` on now, or None: too small, no lane (yet),
        or the peer not written to for `quiet_s` (the loop's `_send` decides those cases)."""
        lane = self._lanes.get(endpoint)
        if (lane is None or lane.closed or not self.lane_min_bytes or len(payload) != 1
                or memoryview(payload[0]).nbytes < self.lane_min_bytes):
            return None
        now = time.monotonic()
        if now - self._last_sent.get(endpoint, 0.0) > self.quiet_s:
            return None
        self._last_sent[endpoint] = now
        return lane

    def sending(self) -> bool:
        """(The loop.) Whether bytes are on their way to a peer from a sender thread, which will
        post their deposit to the loop: the server's idle poll for requests would hold that (and
        the thread's GIL turns) up for its whole length."""
        return self._lane_sends > 0

    def _hand_to_sender(self, endpoint: str, lane, body: dict, payload) -> None:
        with self._lane_sends_lock:
            self._lane_sends += 1
        self._senders().submit(self._send_on_lane, endpoint, lane, body, payload)

    def _lane_send_over(self) -> None:
        """(The loop, after the send's deposits, which were posted before this.)"""
        with self._lane_sends_lock:
            self._lane_sends -= 1

    def _senders(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._sender_pool is None:
            self._sender_pool = concurrent.futures.ThreadPoolExecutor(SENDER_THREADS, thread_name_prefix="genie-peer-send")
        return self._sender_pool

    def _in_shared_segment(self, endpoint: str, source: torch.Tensor) -> list[int] | None:
        """(The executor.) `source`'s bytes copied into one of our shared segments that the peer has
        mapped (our lane to it is shared memory: ipc, one host), as [segment, bytes] for the deposit
        to name; None where that lane, or a free mapped segment of the size, is not there. The copy
        is the one the send needs anyway (see `send`), made once instead of twice."""
        lane = self._lanes.get(endpoint)
        nbytes = source.numel() * source.element_size()
        if (lane is None or lane.closed or not lane.shared or not self.lane_min_bytes or nbytes < self.lane_min_bytes
                or time.monotonic() - self._last_sent.get(endpoint, 0.0) > self.quiet_s):
            return None
        return lane.name_in_segment(tensor_to_buffer(source))

    def _deposit_named(self, endpoint: str, body: dict) -> None:
        self._last_sent[endpoint] = time.monotonic()
        self._deposit(endpoint, body, [], body["segment"][1], direct_ok=True)  # not quiet: see _in_shared_segment

    def _socket(self, endpoint: str):
        sock = self._sockets.get(endpoint)
        if sock is None:
            token = self._tokens[endpoint] = os.urandom(16)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, token)
            if self._curve is not None:
                self._curve.apply(sock)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
            asyncio.ensure_future(self._drain(endpoint, sock))
        return sock

    def _send(self, endpoint: str, body: dict, payload: list) -> None:
        """(The loop.) A send `send` could not hand to a lane: on one opened since, or inside ZeroMQ,
        greeting the peer first when a large tensor finds its lane missing or closed."""
        sock = self._socket(endpoint)
        lane = self._open_lane_for(endpoint, payload)
        if lane is not None:
            self._hand_to_sender(endpoint, lane, body, payload[0])
            return
        nbytes = sum(memoryview(p).nbytes for p in payload)
        lane = self._lanes.get(endpoint)
        if lane is not None and lane.closed:  # the peer dropped it (say, after a quiet spell): greet again
            del self._lanes[endpoint]
            self._greeted.discard(endpoint)
            lane = None
        direct = self._direct.get(endpoint)
        if direct is not None and direct.closed:
            del self._direct[endpoint]
            self._greeted.discard(endpoint)
            direct = None
        now = time.monotonic()
        quiet = now - self._last_sent.get(endpoint, 0.0) > self.quiet_s
        self._last_sent[endpoint] = now  # a quiet peer's lease renewed by this message
        if (lane is None and self.lane_min_bytes and nbytes >= self.lane_min_bytes and len(payload) == 1
                or direct is None and endpoint not in self._greeted):
            self._greet(endpoint, sock)
        # After a quiet spell inside ZeroMQ (see quiet_s), not on a direct lane the peer may be closing.
        self._deposit(endpoint, body, payload, nbytes, direct_ok=not quiet)

    def _send_on_lane(self, endpoint: str, lane, body: dict, payload) -> None:
        """(A thread.) The bytes on the lane; once their head is out, from the loop, the deposit naming
        them (the peer takes it in while the rest streams). If the lane fails, a deposit carrying the
        bytes follows, in place of one that went (the peer's mailbox keeps the later of the two)."""
        nbytes = memoryview(payload).nbytes
        named = []

        def deposit_naming_them() -> None:
            named.append(True)
            self._post(self._deposit, endpoint, dict(body, xfer=xfer), [], nbytes)

        try:
            xfer = lane.next_id()
            lane.send(xfer, payload, after_head=deposit_naming_them)
        except (ConnectionError, OSError) as e:
            log.info("lane to peer %s failed (%s): its transfers go over ZeroMQ", endpoint, e)
            self._post(self._deposit, endpoint, body, [payload], nbytes, bool(named))
        finally:
            self._post(self._lane_send_over)

    def _post(self, *call) -> None:
        try:
            self._loop.call_soon_threadsafe(*call)
        except RuntimeError:  # the daemon stopped meanwhile (its loop is closed): nothing to tell
            pass

    def _deposit(self, endpoint: str, body: dict, frames: list, nbytes: int, replacing: bool = False,
                 direct_ok: bool = False) -> None:
        """(The loop.) The deposit of a tensor of `nbytes`: its frames, or none when `body` names the
        lane transfer that carries them; `replacing`, the frames of one named on a lane that failed.
        With `direct_ok`, a deposit of frames up to PEER_DIRECT_MAX_BYTES (or naming a shared
        segment) goes on the peer's direct lane where one is open. One naming a lane transfer, and
        its replacement, go inside ZeroMQ, so that they arrive in order."""
        self._ids += 1
        parts = [protocol.pack(["deposit", self._ids, body]), *frames]
        direct = self._direct.get(endpoint) if direct_ok and nbytes <= PEER_DIRECT_MAX_BYTES else None
        if direct is not None and direct.write(parts):
            self.direct_deposits += 1
        else:
            self._socket(endpoint).send_multipart(parts, copy=False)
        if replacing:  # counted once, as sent over ZeroMQ
            self.lane_bytes_sent -= nbytes
            return
        self.bytes_sent += nbytes
        if not frames:
            self.lane_bytes_sent += nbytes

    def _greet(self, endpoint: str, sock) -> None:
        """Say hello to the peer once (its answer may open lanes: see `_drain`)."""
        if endpoint in self._hello_ids or endpoint in self._opening:
            return
        self._greeted.add(endpoint)
        self._ids += 1
        self._hello_ids[endpoint] = self._ids
        sock.send_multipart([protocol.pack(["hello", self._ids, {"version": protocol.VERSION, "heartbeat": 0}])])

    async def _open_lane(self, endpoint: str, body: dict) -> None:
        address = bulk.connect_address(body.get("bulk"), endpoint)
        key = body.get("lane_key")
        # A tcp peer on this host offers its local listener too: shared memory, as between ipc
        # peers (plain under CURVE as well: the peer takes such lanes from its own user only, as
        # an ipc peer of this user does on its own listener).
        local = None
        if self.shared_memory:
            local = bulk.local_lane_address(body.get("local_lane")) or (
                bulk.own_unix_listener(address) if self._curve is not None else None)
        sealable = self._curve is None or (key is not None and sealed_lane.available())
        if address is None or (local is None and not sealable):
            return  # no lane offered (or none this daemon can seal): deposits carry their frames
        self._opening.add(endpoint)
        try:
            open_lane = self._lanes.get(endpoint)
            if open_lane is None or open_lane.closed:  # (a greeting for a direct lane leaves an open one be)
                lane = None if local is None else await self._loop.run_in_executor(None, self._open_local_lane,
                                                                                   endpoint, local)
                if lane is not None:
                    self._lanes[endpoint] = lane
                    log.info("lane to peer %s: %s (on this host)", endpoint, lane.path)
                elif sealable:
                    await self._open_lanes(endpoint, address, key)
            direct = self._direct.get(endpoint)
            if direct is None or direct.closed:
                self._direct.pop(endpoint, None)
                await self._open_direct(endpoint, local, None)
                if endpoint not in self._direct and sealable:
                    await self._open_direct(endpoint, address, key if self._curve is not None else None)
        finally:
            self._opening.discard(endpoint)

    async def _open_direct(self, endpoint: str, address, key) -> None:
        """The direct lane to the peer's lane listener at `address` (None: none), for small deposits."""
        if address is None:
            return
        try:
            sock, sealing = await self._loop.run_in_executor(None, peer_direct.connect, address, self._tokens[endpoint],
                                                             key, 10.0)
        except (OSError, ConnectionError, ProtocolError) as e:
            log.info("no direct lane to peer %s (its small deposits go over ZeroMQ): %s", endpoint, e)
            return
        self._direct[endpoint] = peer_direct.PeerDirectLane(self._loop, endpoint, sock, sealing)
        log.info("direct lane to peer %s: %s", endpoint, self._direct[endpoint].path)

    def _open_local_lane(self, endpoint: str, local) -> bulk.Lane | None:
        """A shared-memory lane to a peer's local listener, or None (then its other lanes)."""
        try:
            return bulk.open_shared_lane(local, self._tokens[endpoint], HostBufferPool(0), 10.0)
        except (OSError, ConnectionError) as e:
            log.info("no local lane to peer %s: %s", endpoint, e)
            return None

    async def _open_lanes(self, endpoint: str, address, key) -> None:
        open_lane = functools.partial(bulk.open_client_lane, address, self._tokens[endpoint], HostBufferPool(0),
                                      1 << 40, 10.0, shared=self.shared_memory,
                                      lane_key=None if key is None else sealed_lane.check_lane_key(key))
        try:
            lane = await self._loop.run_in_executor(None, open_lane)
        except (OSError, ConnectionError, ProtocolError) as e:
            log.info("no lane to peer %s (its transfers go over ZeroMQ): %s", endpoint, e)
            return
        wanted = lane_set.lanes_wanted(address[0], self.lanes)
        if wanted > 1:
            lane, failure = await self._loop.run_in_executor(None, lambda: lane_set.join_lanes(
                lane, wanted, lambda member: open_lane(joining=member)))
            if failure is not None:
                log.info("%d lanes to peer %s: %s", len(lane.lanes), endpoint, failure)
        self._lanes[endpoint] = lane
        log.info("lane to peer %s: %s", endpoint, lane.path)

    async def _drain(self, endpoint: str, sock) -> None:
        while True:
            try:
                header = protocol.unpack_header((await sock.recv_multipart())[0])
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            except ProtocolError:
                continue
            if not (isinstance(header, list) and len(header) == 3):
                continue
            if header[0] == self._hello_ids.get(endpoint):
                del self._hello_ids[endpoint]
                if header[1] is True and isinstance(header[2], dict):
                    asyncio.ensure_future(self._open_lane(endpoint, header[2]))
                continue
            if header[1] is False:
                log.warning("peer %s refused a transfer: %s", endpoint, header[2])

    def lane_paths(self) -> dict[str, str]:
        """Each peer's open lane: how it carries bytes ("tcp", "unix", "tcp-sealed", ...)."""
        return {endpoint: lane.path for endpoint, lane in list(self._lanes.items()) if not lane.closed}

    def segment_bytes_lent(self) -> int:
        """Bytes of our shared segments that peers hold (tensors sent to them, kept over our memory)."""
        return sum(lane.segment_bytes_lent() for lane in list(self._lanes.values()) if not lane.closed)

    def direct_paths(self) -> dict[str, str]:
        """Each peer's open direct lane: "tcp", "unix" or "tcp-sealed"."""
        return {endpoint: direct.path for endpoint, direct in list(self._direct.items()) if not direct.closed}

    def lane_counts(self) -> dict[str, int]:
        """How many connections each peer's open lane has (a lane_set.LaneSet's, else 1)."""
        return {endpoint: len(getattr(lane, "lanes", (lane,))) for endpoint, lane in list(self._lanes.items())
                if not lane.closed}

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        for direct in self._direct.values():
            direct.close()
        if self._sender_pool is not None:
            self._sender_pool.shutdown(wait=False)
        for sock in self._sockets.values():
            sock.close(linger=0)
