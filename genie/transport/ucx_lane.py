"""The UCX lane: bulk payloads over UCX (the `ucxx` library), for RDMA between nodes.

UCX picks the fastest transport both ends share: InfiniBand/RoCE verbs (RDMA) where the
hosts have such devices, else TCP or shared memory. Without RDMA it is slower than Genie's
own socket lane (measured here, loopback, 64 MiB payloads between two processes: UCX
0.65 GB/s over tcp and 1.0 GB/s with its shared-memory transports, against 2-4 GB/s for the
socket lane), so it is chosen automatically only on hosts with an RDMA device
(/sys/class/infiniband), or when asked for (GENIE_UCX=on, genie-daemon --ucx on).

It carries the socket lane's STREAM records (transfer id and byte count, then the payload)
and offers `bulk.Lane`'s surface minus shared memory, so the rest of Genie uses either.
ucxx is asyncio-based: every UCX call of the process runs on one event loop thread of its
own; a sender blocks until its transfer is out, as on the socket lane.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
from typing import Callable

import numpy as np

from . import bulk
from .errors import ProtocolError
from .hostmem import HostBufferPool
from .paths import importable

log = logging.getLogger("genie.transport")

MAGIC = b"GNU1"  # greeting: MAGIC + the client's token; the daemon answers bulk.ACCEPTED
_GREETING_BYTES = len(MAGIC) + bulk.TOKEN_BYTES
RDMA_DEVICES_DIR = "/sys/class/infiniband"
MODES = ("auto", "on", "off")


def ucxx_version() -> str | None:
    """The importable ucxx's version (this imports it), or None."""
    try:
        import ucxx
    except Exception:  # noqa: BLE001 - absent, or present but unusable (missing native libraries)
        return None
    return str(getattr(ucxx, "__version__", "unknown"))


def rdma_devices() -> list[str]:
    """This host's RDMA devices (InfiniBand / RoCE), as the kernel lists them."""
    try:
        return sorted(os.listdir(RDMA_DEVICES_DIR))
    except OSError:
        return []


def wanted(mode: str) -> tuple[bool, str]:
    """Whether to use the UCX lane under `mode` ("auto", "on", "off"), and why, in words.
    ucxx is imported only when the answer may be yes."""
    if mode not in MODES:
        raise ValueError(f"UCX mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return False, "UCX lane off (GENIE_UCX=off)"
    if not importable("ucxx"):  # located, not imported: importing loads UCX and CUDA libraries
        return False, "no UCX library (pip install ucxx-cu12 for RDMA between nodes)"
    devices = rdma_devices()
    if mode == "auto" and not devices:
        return False, ("ucxx is installed, but this host has no RDMA device: UCX would only be slower than "
                       "the socket lane here (GENIE_UCX=on forces it)")
    version = ucxx_version()
    if version is None:
        return False, "ucxx is installed but does not load here"
    if mode == "on":
        return True, f"UCX lane on (ucxx {version})"
    return True, f"UCX lane (ucxx {version}; RDMA devices {', '.join(devices)})"


class _UcxLoop:
    """The process's one event loop for UCX calls, on a thread of its own."""

    _instance: "_UcxLoop | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._pid = os.getpid()
        threading.Thread(target=self._run, name="genie-ucx", daemon=True).start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> "_UcxLoop":
        with cls._lock:
            if cls._instance is None or cls._instance._pid != os.getpid():
                cls._instance = _UcxLoop()
            return cls._instance

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False


def _as_array(payload: memoryview) -> np.ndarray:
    return np.frombuffer(payload, dtype=np.uint8)


class UcxLane:
    """One UCX endpoint carrying a client's bulk transfers both ways (see `bulk.Lane`)."""

    shared = False
    sock = None  # no socket for the daemon to poll
    path = "ucx"

    def __init__(self, endpoint, pool: HostBufferPool, max_transfer: int, name: str,
                 on_close: Callable[["UcxLane"], None] | None = None) -> None:
        self._ucx = _UcxLoop.get()
        self._endpoint = endpoint
        self.pool = pool
        self.max_transfer = max_transfer
        self.name = name
        self.arrivals = bulk.Arrivals()
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self.on_close = on_close  # called once the lane has closed (the daemon forgets it)
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_streamed = 0.0
        self._send_lock = asyncio.Lock()  # taken on the UCX loop: transfers never interleave
        self._receiver = self._ucx.submit(self._receive_loop())

    def next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    # ------------------------------------------------------------ sending

    async def _send(self, xfer: int, payload: memoryview, head_out: concurrent.futures.Future | None) -> None:
        async with self._send_lock:  # records are read in order
            if self.closed:
                raise ConnectionError("UCX lane is closed")
            header = np.frombuffer(bulk._HEADER.pack(bulk.STREAM, xfer, payload.nbytes, 0), dtype=np.uint8).copy()
            await self._endpoint.send(header)
            if head_out is not None:
                head_out.set_result(None)
            if payload.nbytes:
                await self._endpoint.send(_as_array(payload))
            self.bytes_sent += payload.nbytes + bulk._HEADER.size
            self.last_streamed = time.monotonic()

    def _start(self, xfer: int, payload: memoryview, head_out=None) -> concurrent.futures.Future:
        if self.closed:
            raise ConnectionError("UCX lane is closed")
        return self._ucx.submit(self._send(xfer, bulk._flat_bytes(payload), head_out))

    def _wait(self, done: concurrent.futures.Future) -> None:
        try:
            done.result()
        except (ConnectionError, ProtocolError):
            raise
        except Exception as e:  # noqa: BLE001 - a UCX failure ends the lane, as a socket error does
            self.close(e)
            raise ConnectionError(f"UCX lane send failed: {e}") from e

    def send(self, xfer: int, payload: memoryview, after_head: Callable[[], None] | None = None,
             write_behind: bool = False, records: list | None = None) -> None:
        """Send transfer `xfer` and wait until it is out. `after_head` runs on this thread once
        the record's header is out (the ZeroMQ message naming the transfer goes then, so the
        receiver is already taking the payload when it is handled)."""
        head_out = concurrent.futures.Future() if after_head is not None else None
        done = self._start(xfer, payload, head_out)
        deferred = None
        if head_out is not None:
            concurrent.futures.wait([head_out, done], return_when=concurrent.futures.FIRST_COMPLETED)
            if head_out.done():
                deferred = bulk._call(after_head)
        self._wait(done)
        if deferred is not None:
            raise deferred

    def start_send(self, xfer: int, payload: memoryview, first_bytes: int) -> Callable[[], None]:
        """Begin transfer `xfer` without waiting; the call returned waits for it to be out."""
        done = self._start(xfer, payload)
        return lambda: self._wait(done)

    # ------------------------------------------------------------ receiving

    async def _receive_loop(self) -> None:
        header = np.empty(bulk._HEADER.size, dtype=np.uint8)
        try:
            while True:
                await self._endpoint.recv(header)
                kind, xfer, nbytes, _ = bulk._HEADER.unpack(header.tobytes())
                if kind != bulk.STREAM:
                    raise ProtocolError(f"unexpected UCX lane record of kind {kind}")
                if nbytes > self.max_transfer:
                    raise ProtocolError(f"bulk transfer of {nbytes} bytes exceeds the limit of {self.max_transfer}")
                data = self.pool.take(nbytes)
                if nbytes:
                    await self._endpoint.recv(data.numpy())
                self.bytes_received += nbytes + bulk._HEADER.size
                self.last_streamed = time.monotonic()
                self.arrivals.put(xfer, data)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the peer went away, or broke the protocol: the lane ends
            if not self.closed:
                log.info("UCX lane %s closed: %s", self.name, e)
            self.close(e if isinstance(e, (ConnectionError, ProtocolError)) else ConnectionError(str(e)))

    # ------------------------------------------------------------ shared memory: never on this lane

    def name_in_segment(self, payload: memoryview) -> None:
        return None

    def accept_named(self, records) -> None:
        raise ProtocolError("this client's bulk lane is a UCX lane: it names no shared-memory segments")

    def take_named(self, segment: int, nbytes: int):
        raise ProtocolError("this client's bulk lane is a UCX lane: it names no shared-memory segments")

    # ------------------------------------------------------------ ending

    def abandon(self) -> None:
        """In a forked child: the parent's lane. UCX state does not survive a fork; touch nothing."""
        self.closed = True

    def close(self, reason: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.arrivals.fail(reason or ConnectionError("UCX lane closed"))

        async def shut() -> None:
            self._receiver.cancel()
            try:
                await self._endpoint.close()
            except Exception:  # noqa: BLE001 - already broken: nothing more to release
                pass

        if self._ucx.on_loop():
            asyncio.ensure_future(shut())
        else:
            self._ucx.submit(shut())
        if self.on_close is not None:
            self.on_close(self)


# ---------------------------------------------------------------- connecting


def open_client_lane(host: str, port: int, token: bytes, pool: HostBufferPool, max_transfer: int,
                     timeout: float) -> UcxLane:
    """The client's UCX lane to a daemon's UCX listener: connect, greet with the token, be accepted."""
    import ucxx

    async def connect():
        endpoint = await ucxx.create_endpoint(host, port)
        await endpoint.send(np.frombuffer(MAGIC + token, dtype=np.uint8).copy())
        answer = np.zeros(1, dtype=np.uint8)
        await endpoint.recv(answer)
        if answer.tobytes() != bulk.ACCEPTED:
            await endpoint.close()
            raise ConnectionError("the daemon refused the UCX lane")
        return endpoint

    future = _UcxLoop.get().submit(asyncio.wait_for(connect(), timeout))
    try:
        endpoint = future.result(timeout + 1)
    except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
        raise ConnectionError(f"no UCX lane to {host}:{port} within {timeout:.0f}s") from None
    except ConnectionError:
        raise
    except Exception as e:  # noqa: BLE001 - UCX's own errors, as the connection errors callers expect
        raise ConnectionError(f"no UCX lane to {host}:{port}: {e}") from e
    return UcxLane(endpoint, pool, max_transfer, name="client")


class UcxListener:
    """The daemon's UCX listener: greeted connections from known clients become their lanes."""

    def __init__(self, is_known_client: Callable[[bytes], bool], on_lane: Callable[[bytes, UcxLane], None],
                 pool: HostBufferPool, max_transfer: int, greeting_timeout: float = 10.0) -> None:
        import ucxx

        self._is_known = is_known_client
        self._on_lane = on_lane
        self.pool = pool
        self.max_transfer = max_transfer
        self._greeting_timeout = greeting_timeout
        ucx = _UcxLoop.get()

        async def listen():
            return ucxx.create_listener(self._greet)

        self._listener = ucx.submit(listen()).result(30)
        self.port = self._listener.port

    async def _greet(self, endpoint) -> None:
        try:
            greeting = np.zeros(_GREETING_BYTES, dtype=np.uint8)
            await asyncio.wait_for(endpoint.recv(greeting), self._greeting_timeout)
            raw = greeting.tobytes()
            token = raw[len(MAGIC):]
            if raw[:len(MAGIC)] != MAGIC or not self._is_known(token):
                raise ProtocolError("bad UCX lane greeting or unknown client")
            await endpoint.send(np.frombuffer(bulk.ACCEPTED, dtype=np.uint8).copy())
        except Exception as e:  # noqa: BLE001 - refuse this one connection; the listener carries on
            log.warning("refused a UCX lane: %s", e)
            try:
                await endpoint.close()
            except Exception:  # noqa: BLE001
                pass
            return
        self._on_lane(token, UcxLane(endpoint, self.pool, self.max_transfer, name=token.hex()[:8]))

    def close(self) -> None:
        async def stop():
            self._listener.close()

        try:
            _UcxLoop.get().submit(stop()).result(5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
