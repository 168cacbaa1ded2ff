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

GPU memory (GPUDirect): UCX moves CUDA memory itself (`__cuda_array_interface__` buffers),
with the NIC reading and writing GPU memory where the driver allows it (nvidia_peermem or
dma-buf), else through its own staging. A daemon whose UCX can do so (checked at start by a
loopback round through each GPU, `check_device_memory`) names those devices in its hello;
the client then sends uploads for them as TO_DEVICE records, which the daemon's lane
receives straight into a new tensor on that GPU, and the daemon sends results from GPU
memory as they are (`send` takes a CUDA tensor): no pinned staging and no host copy on it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
from typing import Callable, Mapping

import numpy as np
import torch

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
        self._landing_streams: dict[torch.device, object] = {}  # used on the loop's thread only
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

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A new byte tensor on `device` for UCX to fill (on the loop's thread). On a GPU it comes
        from a stream on which no kernel runs, so the caching allocator hands it only a block
        whose earlier users are done (the users of a landed tensor record their streams on it):
        a block freed on a compute stream may still be read by that stream's queued kernels, and
        UCX's writes are ordered with no stream of ours."""
        if device.type != "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = self._landing_streams.get(device)
        if stream is None:
            stream = self._landing_streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False


def _ucx_buffer(payload) -> tuple[object, int]:
    """What ucxx sends or fills for a payload (flat bytes of host memory, or a contiguous uint8
    tensor, whose CUDA memory UCX reads itself), and its length."""
    if isinstance(payload, torch.Tensor):
        flat = payload.reshape(-1)
        if flat.dtype != torch.uint8 or not flat.is_contiguous():
            raise ValueError("a tensor payload must be contiguous bytes (uint8)")
        return (flat.numpy() if flat.device.type == "cpu" else flat), flat.numel()
    flat = bulk._flat_bytes(payload)
    return np.frombuffer(flat, dtype=np.uint8), flat.nbytes


class UcxLane:
    """One UCX endpoint carrying a client's bulk transfers both ways (see `bulk.Lane`)."""

    shared = False
    sock = None  # no socket for the daemon to poll
    path = "ucx"

    def __init__(self, endpoint, pool: HostBufferPool, max_transfer: int, name: str,
                 on_close: Callable[["UcxLane"], None] | None = None,
                 landing_devices: Mapping[int, torch.device] | None = None) -> None:
        self._ucx = _UcxLoop.get()
        self._endpoint = endpoint
        self.pool = pool
        self.max_transfer = max_transfer
        self.name = name
        # This end's devices (by the index the peer names) that TO_DEVICE payloads land on (a
        # daemon's checked GPUs), and the peer's that this end's uploads may name (a client's).
        self.landing_devices = dict(landing_devices or {})
        self.peer_devices: frozenset[int] = frozenset()
        self.device_bytes_received = 0  # payloads landed on landing_devices
        self.device_bytes_sent = 0  # payloads sent from tensors as they are (GPU memory, on a daemon)
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

    async def _send(self, xfer: int, buffer, nbytes: int, device: int | None, from_tensor: bool,
                    head_out: concurrent.futures.Future | None) -> None:
        async with self._send_lock:  # records are read in order
            if self.closed:
                raise ConnectionError("UCX lane is closed")
            record = (bulk.STREAM, xfer, nbytes, 0) if device is None else (bulk.TO_DEVICE, xfer, nbytes, device)
            await self._endpoint.send(np.frombuffer(bulk._HEADER.pack(*record), dtype=np.uint8).copy())
            if head_out is not None:
                head_out.set_result(None)
            if nbytes:
                await self._endpoint.send(buffer)
            self.bytes_sent += nbytes + bulk._HEADER.size
            if from_tensor:
                self.device_bytes_sent += nbytes
            self.last_streamed = time.monotonic()

    def _start(self, xfer: int, payload, head_out=None, device: int | None = None) -> concurrent.futures.Future:
        if self.closed:
            raise ConnectionError("UCX lane is closed")
        if device is not None and device not in self.peer_devices:
            raise ValueError(f"the peer's UCX lane lands no payloads on its device {device}")
        buffer, nbytes = _ucx_buffer(payload)
        return self._ucx.submit(self._send(xfer, buffer, nbytes, device, isinstance(payload, torch.Tensor), head_out))

    def _wait(self, done: concurrent.futures.Future) -> None:
        try:
            done.result()
        except (ConnectionError, ProtocolError):
            raise
        except Exception as e:  # noqa: BLE001 - a UCX failure ends the lane, as a socket error does
            self.close(e)
            raise ConnectionError(f"UCX lane send failed: {e}") from e

    def send(self, xfer: int, payload, after_head: Callable[[], None] | None = None,
             write_behind: bool = False, records: list | None = None, device: int | None = None) -> None:
        """Send transfer `xfer` and wait until it is out. `after_head` runs on this thread once
        the record's header is out (the ZeroMQ message naming the transfer goes then, so the
        receiver is already taking the payload when it is handled). `payload` is host memory,
        or a contiguous uint8 CUDA tensor whose producing work is done (UCX reads it on streams
        of its own). With `device` (one of `peer_devices`) the payload lands in that GPU's memory."""
        head_out = concurrent.futures.Future() if after_head is not None else None
        done = self._start(xfer, payload, head_out, device)
        deferred = None
        if head_out is not None:
            concurrent.futures.wait([head_out, done], return_when=concurrent.futures.FIRST_COMPLETED)
            if head_out.done():
                deferred = bulk._call(after_head)
        self._wait(done)
        if deferred is not None:
            raise deferred

    def start_send(self, xfer: int, payload, first_bytes: int) -> Callable[[], None]:
        """Begin transfer `xfer` without waiting; the call returned waits for it to be out."""
        done = self._start(xfer, payload)
        return lambda: self._wait(done)

    # ------------------------------------------------------------ receiving

    async def _receive_loop(self) -> None:
        header = np.empty(bulk._HEADER.size, dtype=np.uint8)
        try:
            while True:
                await self._endpoint.recv(header)
                kind, xfer, nbytes, device = bulk._HEADER.unpack(header.tobytes())
                if kind not in (bulk.STREAM, bulk.TO_DEVICE):
                    raise ProtocolError(f"unexpected UCX lane record of kind {kind}")
                if nbytes > self.max_transfer:
                    raise ProtocolError(f"bulk transfer of {nbytes} bytes exceeds the limit of {self.max_transfer}")
                if kind == bulk.STREAM:
                    data = self.pool.take(nbytes)
                else:
                    landing = self.landing_devices.get(device)
                    if landing is None:
                        raise ProtocolError(f"a UCX lane payload for device {device}, on which this end lands none")
                    data = self._ucx.empty(nbytes, landing)  # its users record their streams on it
                if nbytes:
                    await self._endpoint.recv(_ucx_buffer(data)[0])
                self.bytes_received += nbytes + bulk._HEADER.size
                if kind == bulk.TO_DEVICE:
                    self.device_bytes_received += nbytes
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
                 pool: HostBufferPool, max_transfer: int, greeting_timeout: float = 10.0,
                 landing_devices: Mapping[int, torch.device] | None = None) -> None:
        import ucxx

        self.landing_devices = dict(landing_devices or {})  # see UcxLane
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
        self._on_lane(token, UcxLane(endpoint, self.pool, self.max_transfer, name=token.hex()[:8],
                                     landing_devices=self.landing_devices))

    def close(self) -> None:
        async def stop():
            self._listener.close()

        try:
            _UcxLoop.get().submit(stop()).result(5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass


# ---------------------------------------------------------------- GPU memory


PROBE_BYTES = 1 << 20
NVIDIA_PEERMEM = "/sys/module/nvidia_peermem"


def check_device_memory(devices: Mapping[int, torch.device], timeout: float = 20.0) -> tuple[dict, str]:
    """Which of `devices` (index -> device) UCX moves bytes into and out of here, and how, in
    words. Each device's check is a round through a loopback endpoint of this process: host
    bytes received straight into a new tensor on the device, then sent back from it and
    compared, which is what the lane does with uploads and results."""
    if not devices:
        return {}, "no: this daemon has no GPU"
    import ucxx

    pattern = (np.arange(PROBE_BYTES, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)

    async def echo(endpoint) -> None:
        try:
            for device in devices.values():
                landed = _UcxLoop.get().empty(PROBE_BYTES, device)
                await endpoint.recv(_ucx_buffer(landed)[0])
                if landed.is_cuda:
                    torch.cuda.synchronize(landed.device)
                await endpoint.send(_ucx_buffer(landed)[0])
        except Exception as e:  # noqa: BLE001 - closing makes the checking side's round fail at once
            log.info("UCX device-memory check (receiving end): %s", e)
            await endpoint.close()

    async def check() -> dict:
        listener = ucxx.create_listener(echo)
        endpoint = None
        working = {}
        try:
            endpoint = await ucxx.create_endpoint("127.0.0.1", listener.port)
            for index, device in devices.items():
                await endpoint.send(pattern)
                back = np.empty_like(pattern)
                await endpoint.recv(back)
                if not np.array_equal(back, pattern):
                    raise RuntimeError(f"bytes changed on a round through {device}")
                working[index] = device
        finally:
            if endpoint is not None:
                await endpoint.close()
            listener.close()
        return working

    try:
        working = _UcxLoop.get().submit(asyncio.wait_for(check(), timeout)).result(timeout + 1)
    except Exception as e:  # noqa: BLE001 - UCX without its CUDA transports, or no CUDA: host memory then
        return {}, f"no: UCX could not move this daemon's GPU memory ({type(e).__name__}: {e}); bulk data is staged through pinned host buffers"
    if not rdma_devices():
        how = "no RDMA device here: UCX copies GPU memory through buffers of its own to other hosts"
    elif os.path.isdir(NVIDIA_PEERMEM):
        how = "GPUDirect RDMA: the NIC reads and writes GPU memory itself (nvidia_peermem is loaded)"
    else:
        how = ("nvidia_peermem is not loaded: the NIC reads GPU memory by dma-buf where the kernel and driver "
               "support it, else UCX copies through buffers of its own")
    names = ", ".join(str(d) for d in working.values())
    return working, f"yes: uploads land in and results leave from GPU memory ({names}) over UCX; {how}"
