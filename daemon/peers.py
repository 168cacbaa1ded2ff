"""Daemon-to-daemon tensor transfer: a mailbox for arriving tensors and senders to peers.

When a client moves a tensor from daemon A to daemon B, A's executor runs
`genie::send` (hand the tensor to `PeerLinks`, which ships it to B as a
`deposit` message on the event loop, without blocking A's executor) and B's runs
`genie::recv` (wait in the `Mailbox` for that transfer id). The bytes never pass
through the client. Transfer ids are 128-bit random strings chosen by the client.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import torch
import zmq
import zmq.asyncio

from genie.transport import protocol
from genie.transport.errors import ProtocolError
from genie.transport.tensors import dtype_name, tensor_to_frames

log = logging.getLogger("genie.daemon")

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

    def put(self, tid: str, tensor: torch.Tensor) -> None:
        with self._cond:
            self._expire_locked()
            if self.max_bytes and self.bytes + tensor.nbytes > self.max_bytes:
                raise ProtocolError(f"mailbox full: {self.bytes} bytes wait unclaimed (limit {self.max_bytes})")
            old = self._items.pop(tid, None)
            if old is not None:
                self.bytes -= old[1].nbytes
            self._items[tid] = (time.monotonic(), tensor)
            self.bytes += tensor.nbytes
            self._cond.notify_all()

    def has(self, tid: str) -> bool:
        with self._cond:
            return tid in self._items

    def expire(self) -> None:
        with self._cond:
            self._expire_locked()

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for key in [k for k, (t, _) in self._items.items() if now - t > self.ttl_s]:
            self.bytes -= self._items.pop(key)[1].nbytes  # never claimed: drop

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
            return tensor


class PeerLinks:
    """DEALER sockets from this daemon to its peers, used only on the event loop."""

    def __init__(self, context: zmq.asyncio.Context, loop: asyncio.AbstractEventLoop, curve=None) -> None:
        self._ctx = context
        self._curve = curve  # ClientKeys: this daemon's key pair, peers' (shared) public key
        self._loop = loop
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._ids = 0
        self.bytes_sent = 0

    def send(self, endpoint: str, tid: str, tensor: torch.Tensor) -> None:
        """Thread-safe: called by the executor; the send happens on the loop."""
        if not PEER_ENDPOINT.match(endpoint):
            raise ProtocolError(f"bad peer endpoint {endpoint!r}")
        payload = tensor_to_frames(tensor.detach())
        header_body = {"tid": tid, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}
        self._loop.call_soon_threadsafe(self._send, endpoint, header_body, payload)

    def _send(self, endpoint: str, body: dict, payload: list) -> None:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                self._curve.apply(sock)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
            asyncio.ensure_future(self._drain(endpoint, sock))
        self._ids += 1
        sock.send_multipart([protocol.pack(["deposit", self._ids, body]), *payload], copy=False)
        self.bytes_sent += sum(memoryview(p).nbytes for p in payload)

    async def _drain(self, endpoint: str, sock) -> None:
        while True:
            try:
                header = protocol.unpack_header((await sock.recv_multipart())[0])
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            except ProtocolError:
                continue
            if isinstance(header, list) and len(header) == 3 and header[1] is False:
                log.warning("peer %s refused a transfer: %s", endpoint, header[2])

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
