"""The daemon's end of the bulk lanes (see `genie.transport.bulk`).

One listening socket beside the ZeroMQ endpoint; each connection must open
with the magic and the routing id of a client the daemon already knows, within
a few seconds, or it is closed. A CURVE daemon's listener takes only sealed lanes
(see `genie.transport.sealed_lane`), of clients holding the lane key it gave them.
Uploads land in recycled host buffers and wait there, per client, until the op
that reads them runs; downloads are written from the tensor's memory by the
executor thread, with a send timeout so a client that stops reading cannot
stall the daemon.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Callable

import torch

from genie.transport import bulk, lane_set, shared_segments, stream_framing
from genie.transport.errors import ProtocolError
from genie.transport.hostmem import HostBufferPool

log = logging.getLogger("genie.daemon")

GREETING_TIMEOUT_S = 5.0
BULK_POOL_BYTES = 2 << 30  # most bytes of idle receive buffers the daemon keeps for reuse


class BulkListener:
    def __init__(self, zmq_endpoint: str, is_known_client: Callable[[bytes], bool], max_transfer: int,
                 pool_bytes: int = BULK_POOL_BYTES, send_timeout_s: float = 60.0,
                 shared_memory: bool = True, tcp_port: int = 0, local_lane: bool = True,
                 lane_key_of: Callable[[bytes], bytes | None] | None = None) -> None:
        address = bulk.listen_address_for(zmq_endpoint)
        if address is None:
            raise OSError(f"no bulk lane for endpoint {zmq_endpoint}")
        kind, where = address
        if kind == "tcp":
            family = socket.AF_INET6 if ":" in where else socket.AF_INET
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((where, tcp_port))  # 0: any free port (advertised to clients in hello)
            self.advertised = ["tcp", self._sock.getsockname()[1]]
        else:
            if os.path.exists(where):
                os.unlink(where)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(where)
            self.advertised = ["unix", where]
        self._path = where if kind == "unix" else None
        self._sock.listen(64)
        # Beside a tcp listener, a local one (an abstract Unix socket) for clients and peers on this
        # host, whose lanes can then use shared memory; named in hello (local_offer). Under CURVE it
        # takes plain lanes too, from the daemon's own user only: their bytes never leave the
        # kernel, and such a process can read this one's memory anyway.
        self._local_sock, self.local_offer = None, None
        if kind == "tcp" and local_lane and shared_memory and shared_segments.supported():
            self._listen_locally()
        self._is_known = is_known_client
        self.max_transfer = max_transfer
        self.pool = HostBufferPool(pool_bytes)
        self.send_timeout_s = send_timeout_s
        self.shared_memory = shared_memory  # agree to shared-memory segments with clients that ask (Unix lanes)
        # Sealed lanes only (a CURVE daemon): a client's lane key, given to it in hello (None: none given).
        self._lane_key_of = lane_key_of
        self._lanes: dict[bytes, bulk.Lane] = {}
        # Clients that connected to the local listener as this daemon's user (SO_PEERCRED): on this
        # host, of this user, for certain (a tcp daemon takes CUDA IPC handles only from them).
        self.local_users: set[bytes] = set()
        self._lock = threading.Lock()
        self._attached = threading.Condition(self._lock)  # a client's first lane was attached
        self._closed = False
        self.on_arrival: Callable[[], None] | None = None  # told (from a lane's thread) when an upload lands
        # Given direct-lane connections (see genie.transport.stream_framing), from a greeting thread,
        # with their (sending, receiving) sealed_lane directions on a sealed listener (else None).
        self.on_direct: Callable[[socket.socket, bytes, tuple | None], None] | None = None
        # An ipc daemon's listener is local too: under CURVE it takes plain lanes (shared memory)
        # from the daemon's own user, sealed ones from anyone it gave a lane key.
        threading.Thread(target=self._accept_loop, args=(self._sock, kind == "unix"), name="genie-bulk-accept",
                         daemon=True).start()
        if self._local_sock is not None:
            threading.Thread(target=self._accept_loop, args=(self._local_sock, True), name="genie-bulk-accept-local",
                             daemon=True).start()

    def _listen_locally(self) -> None:
        name = bulk.local_lane_name()
        offer = bulk.local_lane_offer(name) if name is not None else None
        if offer is None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
            sock.listen(64)
        except OSError as e:
            sock.close()
            log.info("no local lane listener (clients on this host use the tcp lanes): %s", e)
            return
        self._local_sock, self.local_offer = sock, offer

    # ------------------------------------------------------------ connections

    def _accept_loop(self, listener: socket.socket, local: bool) -> None:
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn, local), name="genie-bulk-greet", daemon=True).start()

    def _greet(self, conn: socket.socket, local: bool = False) -> None:
        try:
            conn.settimeout(GREETING_TIMEOUT_S)
            greeting = bulk.recv_exactly(conn, len(bulk.MAGIC) + bulk.TOKEN_BYTES)
            token, magic = greeting[len(bulk.MAGIC):], greeting[:len(bulk.MAGIC)]
            sealing, shared, direct, joining = None, False, False, None
            sealed_magic = magic in (bulk.MAGIC_SEALED, bulk.MAGIC_SEALED_JOIN, stream_framing.MAGIC_SEALED)
            if self._lane_key_of is not None and (not local or sealed_magic):
                direct = magic == stream_framing.MAGIC_SEALED and self.on_direct is not None
                joins = magic == bulk.MAGIC_SEALED_JOIN
                lane_key = self._lane_key_of(token) if magic == bulk.MAGIC_SEALED or direct or joins else None
                if lane_key is None:
                    raise ProtocolError("this daemon takes only sealed lanes, of clients it gave a lane key")
                joining = self._set_to_join(token) if joins else None
                sealing = bulk.accept_sealed(conn, lane_key)
            else:
                direct = magic == stream_framing.MAGIC and self.on_direct is not None
                known = (bulk.MAGIC, bulk.MAGIC_SHARED, bulk.MAGIC_JOIN)
                if (magic not in known and not direct) or not self._is_known(token):
                    raise ProtocolError("bad bulk greeting or unknown client")
                same_user = conn.family == socket.AF_UNIX and shared_segments.same_user(conn)
                if self._lane_key_of is not None and not (local and same_user):
                    raise ProtocolError("under CURVE the local lanes are only for the daemon's own user")
                if local and same_user:
                    self.local_users.add(token)  # before the answer: the client's next request may rely on it
                joining = self._set_to_join(token) if magic == bulk.MAGIC_JOIN else None
                shared = (magic == bulk.MAGIC_SHARED and self.shared_memory and same_user
                          and shared_segments.supported())
            self._prepare(conn)
            # Each lane is in place before the client hears it was taken (plain lanes; a sealed
            # one's answer went before its HELLO): what the client sends next may use it.
            if joining is not None:
                joining.add(bulk.Lane(conn, self.pool, self.max_transfer, name=token.hex()[:8], sealing=sealing,
                                      **joining.member_kwargs()))
            elif not direct:
                self._attach(token, bulk.Lane(conn, self.pool, self.max_transfer, name=token.hex()[:8],
                                              shared=shared, sealing=sealing))
            if sealing is None:
                conn.sendall(bulk.ACCEPTED_SHARED if shared else bulk.ACCEPTED)
        except (OSError, ConnectionError, ProtocolError) as e:
            log.warning("refused a bulk connection: %s", e)
            conn.close()
            return
        if direct:
            self.on_direct(conn, token, sealing)  # the server's: requests and answers, on its event loop

    def _attach(self, token: bytes, lane: bulk.Lane) -> None:
        """A client's (new) bulk lane. Every one is a set from the start, so parts sent on it
        while a joining lane is still being greeted wait in the set's assembly for the rest."""
        lanes = lane_set.LaneSet(lane, on_close=self._forget)
        lanes.arrivals.on_change = self._arrived
        with self._lock:
            old = self._lanes.pop(token, None)
            self._lanes[token] = lanes
            self._attached.notify_all()
        if old is not None:
            old.close()

    def _set_to_join(self, token: bytes) -> lane_set.LaneSet:
        """The client's lane set, waiting (within the greeting's time) for a sealed first lane,
        which the client may join before the daemon has read its HELLO."""
        with self._lock:
            self._attached.wait_for(lambda: token in self._lanes or self._closed, GREETING_TIMEOUT_S)
            joining = self._lanes.get(token)
        if not isinstance(joining, lane_set.LaneSet) or joining.closed:
            raise ProtocolError("a lane may join only a client's open bulk lane")
        return joining

    def _prepare(self, conn: socket.socket) -> None:
        """A lane's socket options, once greeted."""
        conn.settimeout(None)
        # Per connection: a Unix socket made by accept() has the default buffers, not the
        # listener's (TCP's inherit them), and a stream's sender's buffer bounds what one
        # send takes: downloads of 1 MiB left in ~200 KiB pieces, a wake-up of each side apiece.
        bulk.widen_buffers(conn)
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Bound each send, not receives: an idle lane waits for uploads indefinitely.
        seconds = int(self.send_timeout_s)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", seconds, int((self.send_timeout_s - seconds) * 1e6)))

    @property
    def last_transfer(self) -> float:
        """time.monotonic() of the last payload that went through a lane's socket (its thread needed
        the GIL throughout); payloads in shared memory do not count: their threads barely run."""
        with self._lock:
            return max((lane.last_streamed for lane in self._lanes.values()), default=0.0)

    def _arrived(self) -> None:
        if self.on_arrival is not None:
            self.on_arrival()

    def _forget(self, lane: bulk.Lane) -> None:
        with self._lock:
            for token, known in list(self._lanes.items()):
                if known is lane:
                    del self._lanes[token]

    def add_lane(self, token: bytes, lane) -> None:
        """A lane that reached this daemon another way (a ucx_lane.UcxLane): the client's lane now."""
        lane.arrivals.on_change = self._arrived
        lane.on_close = self._forget
        with self._lock:
            old = self._lanes.pop(token, None)
            self._lanes[token] = lane
        if old is not None:
            old.close()

    def lane(self, identity: bytes) -> bulk.Lane | None:
        with self._lock:
            return self._lanes.get(identity)

    def lane_sockets(self) -> list[socket.socket]:
        with self._lock:
            lanes = [lane for lane in self._lanes.values() if not lane.closed]
        return [sock for lane in lanes for sock in getattr(lane, "sockets", (lane.sock,)) if sock is not None]

    def drop(self, identity: bytes) -> None:
        self.local_users.discard(identity)
        with self._lock:
            lane = self._lanes.pop(identity, None)
        if lane is not None:
            lane.arrivals.clear()
            lane.close()

    # ------------------------------------------------------------ transfers (executor thread)

    def upload_ready(self, identity: bytes, xfer: int) -> bool:
        """Whether `take_upload` would return (or fail) at once: the bytes are in, or there is no lane."""
        lane = self.lane(identity)
        return lane is None or lane.arrivals.ready(xfer)

    def spoken_for(self, identity: bytes, xfers: list[int]) -> None:
        """A received request will take these uploads (see expire_unclaimed)."""
        lane = self.lane(identity)
        if lane is not None and xfers:
            lane.arrivals.spoken_for(xfers)

    def accept_named(self, identity: bytes, records) -> None:
        """Uploads a request named in the client's shared segments (see bulk.Lane.accept_named)."""
        lane = self.lane(identity)
        if lane is None:
            raise ProtocolError("this client has no bulk lane open")
        lane.accept_named(records)

    def take_upload(self, identity: bytes, xfer: int, timeout: float, being_written_ok: bool = False) -> torch.Tensor:
        """Upload `xfer`'s payload (see bulk.Arrivals.take for `being_written_ok`)."""
        lane = self.lane(identity)
        if lane is None:
            raise ProtocolError("this client has no bulk lane open")
        try:
            return lane.arrivals.take(xfer, timeout, being_written_ok)
        except (TimeoutError, ConnectionError) as e:
            raise ProtocolError(str(e)) from None

    def moves_gpu_memory(self, identity: bytes, device: torch.device) -> bool:
        """Whether the client's lane sends straight from `device`'s memory (a UCX lane that
        checked it: see ucx_lane.check_device_memory)."""
        lane = self.lane(identity)
        return lane is not None and not lane.closed and device in lane.landing_devices.values()

    def claim_download(self, identity: bytes) -> int | None:
        """A transfer id for a download sent later with `send_download`; None: the client has no lane."""
        lane = self.lane(identity)
        return None if lane is None else lane.next_id()

    def named_download(self, identity: bytes, payload: memoryview) -> list[int] | None:
        """`payload` copied into a segment the client has mapped, as [segment, bytes] for the answer
        to name (see bulk.Lane.name_in_segment); None: send it on the lane."""
        lane = self.lane(identity)
        return None if lane is None else lane.name_in_segment(payload)

    def later_download(self, identity: bytes, payload: memoryview) -> "LaterDownload | None":
        """A download to send once its answer is out (see Executor.run's `later`); None: no lane."""
        xfer = self.claim_download(identity)
        return None if xfer is None else LaterDownload(self, identity, payload, xfer)

    def send_download(self, identity: bytes, payload: memoryview, xfer: int | None = None) -> int | None:
        """Send a payload to the client (as transfer `xfer` when claimed before); its transfer id,
        or None when the client has no lane."""
        lane = self.lane(identity)
        if lane is None:
            if xfer is not None:
                raise ConnectionError("the client's bulk lane closed before its download was sent")
            return None
        if xfer is None:
            xfer = lane.next_id()
        lane.send(xfer, payload)
        return xfer

    def waiting_bytes(self) -> int:
        with self._lock:
            lanes = list(self._lanes.values())
        return sum(lane.pending_bytes() if isinstance(lane, lane_set.LaneSet) else lane.arrivals.pending_bytes()
                   for lane in lanes)

    def segment_bytes_lent(self) -> int:
        """Bytes in this daemon's shared segments that clients have not handed back: downloads
        they still use, or were named in replies and never taken."""
        with self._lock:
            lanes = list(self._lanes.values())
        return sum(lane.segment_bytes_lent() for lane in lanes)

    def expire_unclaimed(self, max_age_s: float) -> int:
        """Let go of uploads that no request named within `max_age_s` of their coming (a request
        sent with its bytes is at most a transfer timeout behind them); the bytes let go."""
        with self._lock:
            lanes = list(self._lanes.values())
        dropped = sum(lane.arrivals.expire(max_age_s) for lane in lanes)
        if dropped:
            log.info("let go of %d bytes of uploads no request claimed within %.0fs", dropped, max_age_s)
        return dropped

    def close(self) -> None:
        self._closed = True
        for listener in (self._sock, self._local_sock):
            try:
                if listener is not None:
                    listener.close()
            except OSError:
                pass
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
            self._attached.notify_all()
        for lane in lanes:
            lane.close()
        if self._path and os.path.exists(self._path):
            os.unlink(self._path)


class LaterDownload:
    """A claimed download: called, it sends the payload (blocking); `start` begins it without waiting."""

    __slots__ = ("listener", "identity", "payload", "xfer")

    def __init__(self, listener: BulkListener, identity: bytes, payload: memoryview, xfer: int) -> None:
        self.listener, self.identity, self.payload, self.xfer = listener, identity, payload, xfer

    def __call__(self) -> None:
        self.listener.send_download(self.identity, self.payload, self.xfer)

    def start(self, first_bytes: int) -> Callable[[], None]:
        """Send what the socket takes now, up to `first_bytes`, on this thread; the call returned
        sends the rest (see bulk.Lane.start_send)."""
        lane = self.listener.lane(self.identity)
        if lane is None:
            raise ConnectionError("the client's bulk lane closed before its download was sent")
        return lane.start_send(self.xfer, self.payload, first_bytes)
