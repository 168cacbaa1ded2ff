"""One connected daemon (DaemonLink): its channel, devices, lanes and requests.

A link sends batches of ops to its daemon over ZeroMQ or over the direct lane (a plain socket
beside it, where batches may be posted ahead of their answers, up to MAX_OPS_AHEAD ops), opens
the bulk lane and the UCX lane for large payloads, watches the daemon's reachability and
heartbeats, and turns what fails into the errors users catch. Runtime (runtime.py) keeps the
links and the device streams built on them.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import functools
import itertools
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

import torch

from genie.errors import GenieConnectionError, GenieError
from genie.transport import bulk, cuda_ipc, lane_set, protocol, reachability, sealed_lane, stream_framing, ucx_lane
from genie.transport.channel import AnswerLost, Channel, ChannelClosed, RemoteError, Reply
from genie.transport.errors import ProtocolError
from genie.transport.interrupts import Condition, held_between_waits, held_interrupts, is_interrupt, let_through

from .stream import DeviceStream, remote_error

# A key no decoded message can hold (msgpack map keys are strings and numbers): set in a reply's
# fetched entry once its shared segment was taken (see DaemonLink.take_named).
_TAKEN = object()

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("genie.runtime")

DIRECT_REOPEN_GAP_S = 2.0  # a dropped direct lane is opened again at most this often (see _direct_lane_dropped)
DIRECT_INSTALL_WAIT_S = 10.0  # how long a new direct lane waits for the caller threads to leave the old path
# How many ops a client may post on the direct socket ahead of reading their answers (see
# DaemonLink.post_direct): like a CUDA device's launch queue, about a thousand deep, past which
# launching waits for the device.
MAX_OPS_AHEAD = 1024
EXIT_REPORT_WAIT_S = 1.0  # how long a lost embedded daemon's end is awaited for its report (see lose)


class _Answered:
    """The outcome of a direct request, in by the time the caller gets it: what `DaemonLink.wait`
    reads, as from a finished Future, without a Future's lock and condition (~5 us a read)."""

    __slots__ = ("_reply", "_error")

    def __init__(self, reply=None, error: BaseException | None = None) -> None:
        self._reply, self._error = reply, error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None):
        if self._error is not None:
            raise self._error
        return self._reply

    def cancelled(self) -> bool:
        return False

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn) -> None:
        fn(self)  # done already, as a finished Future calls it at once


class _Posted:
    """A batch sent on the direct socket whose answer is read later (see DaemonLink.post_direct)."""

    __slots__ = ("rid", "stream", "ops", "nbytes", "future", "waited", "on_settled")

    def __init__(self, stream: DeviceStream, future: concurrent.futures.Future | None = None,
                 waited: bool = False, on_settled=None) -> None:
        self.rid: int | None = None  # set once sent
        self.stream = stream
        self.ops = self.nbytes = 0  # its size, for the bound on what is posted ahead
        self.future = future  # set with the answer, when somebody holds it (see `_post_behind_direct`)
        self.waited = waited  # somebody waits on `future`: failures go there, not to the stream
        self.on_settled = on_settled

    def settle(self, reply=None, error: BaseException | None = None) -> None:
        """Hand over the answer (or the failure): to the future's waiter, else kept on the stream."""
        try:
            if not self.waited:
                if error is None:
                    self.stream.note_failure(reply)
                else:
                    self.stream.record_async_error(error)
            if self.future is not None:
                if error is None:
                    self.future.set_result(reply)
                else:
                    self.future.set_exception(error)
        finally:
            if self.on_settled is not None:
                self.on_settled()


class DaemonLink:
    """One connected daemon: its channel, its devices, and this client's handle ids on it."""

    def __init__(self, runtime: "Runtime", endpoint: str) -> None:
        self.runtime = runtime
        self.endpoint = endpoint
        self.channel: Channel | None = None
        self.devices: list[dict] = []
        self.handle_ids = itertools.count(1 << 16)  # fixed msgpack width, as for request ids
        self._heartbeat: asyncio.Task | None = None
        self.measured_rtt_s: float | None = None
        self.bandwidth: float | None = None  # bytes/s client -> daemon, measured at connect
        # Backpressure: payload bytes posted to this daemon and not yet acknowledged.
        self.inflight_bytes = 0
        self._inflight = Condition()
        self._outstanding = 0  # exec requests posted through the loop and not yet answered
        # Answers each caller thread blocked on (transport_stats): one count per thread, which only
        # it writes, so no lock (a Ctrl-C could cut a `with lock:` just after taking it).
        self._waits_by_thread: dict[int, int] = {}
        self._direct_busy = False  # a caller thread is using the direct socket (see `direct_exec`)
        # Batches posted on the direct socket whose answers are not read yet, oldest first (see `post_direct`).
        self._direct_unread: collections.deque[_Posted] = collections.deque()
        self._direct_unread_ops = 0  # the ops in those batches, and their payload bytes
        self._direct_unread_bytes = 0
        self._collector_running = False  # a thread reads posted answers for waiters (`_collect_in_background`)
        self.said_bye = False  # see `say_bye_behind_posted`
        self.lost: str | None = None  # why this daemon was declared lost, once it is
        self.restarting = False  # lost because it restarts (its GPU failed): a reconnect waits for it
        self.retry_at = 0.0  # time.monotonic() before which work on other daemons does not try it again
        self.token = bulk.new_token()  # this client's routing id on the daemon; also opens its bulk lane
        self.bulk_lane: bulk.Lane | None = None
        self.bulk_min_bytes = 0  # payloads at least this big take the bulk lane (set with the lane)
        self.local_lane = False  # the lanes go to a tcp daemon's local listener (same host: shared memory)
        self.cuda_ipc_offer: dict | None = None  # hello's cuda_ipc: the daemon takes handles from this host
        self.ucx_gpu_memory = "no: no UCX lane to this daemon"  # whether its UCX lane moves GPU memory, in words
        self._cuda_ipc_ok: dict[int, bool] = {}  # client GPU index -> whether its tensors go by CUDA IPC
        # Where the direct lane was opened (the lane listener's address, the lane key under CURVE):
        # a dropped one is opened again there (see `_direct_lane_dropped`), at most once per
        # DIRECT_REOPEN_GAP_S.
        self._direct_lane_at: tuple | None = None
        # Reader thread -> the fetched entries of the last reply handed to it, until it has taken
        # them (see hand_over): a Ctrl-C between the hand-over and the take leaves them here, and
        # that thread's next reply lets them go.
        self._handed: dict[int, list] = {}
        self._direct_reopened_at = -DIRECT_REOPEN_GAP_S

    async def connect(self, timeout: float, heartbeat: float) -> None:
        self.channel = Channel(self.endpoint, self.runtime.zmq_context, routing_id=self.token,
                               curve=self.runtime.curve)
        self.channel.on_disconnect = self.lose
        self.channel.on_unread_reply = self.abandon_reply
        await self.channel.open()
        start = time.perf_counter()
        # The ping period it promises (0: none, as with pings off or rarer than the protocol's bound).
        promised = float(heartbeat) if 0 < heartbeat <= protocol.MAX_HEARTBEAT_S else 0.0
        hello = asyncio.ensure_future(self.channel.post("hello", {"version": protocol.VERSION, "heartbeat": promised}))
        # Beside it, a plain connection attempt: a refusal says at once what ZeroMQ's silent retries
        # would only let the timeout say (nothing listens there).
        watch = asyncio.ensure_future(reachability.wait_until_refused(
            self.endpoint, min(self.runtime.config.connect_refused_timeout, timeout)))
        watch.add_done_callback(self._read_watch_outcome)
        try:
            done, _ = await asyncio.wait({hello, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if watch in done and isinstance(watch.exception(), reachability.Unreachable):
                hello.cancel()
                await self.channel.close()
                raise GenieConnectionError(str(watch.exception())) from None
            reply = await asyncio.wait_for(hello, max(0.0, timeout - (time.perf_counter() - start)))
        except asyncio.TimeoutError:
            await self.channel.close()
            why = ("the connection was made, but nothing answered on it" if self.channel.connected else
                   "no connection could be made: is a genie-daemon listening there?")
            raise GenieConnectionError(f"no answer from genie-daemon at {self.endpoint} within {timeout:.0f}s "
                                       f"({why})") from None
        except RemoteError as e:
            await self.channel.close()
            raise GenieConnectionError(f"genie-daemon at {self.endpoint} refused hello: {e}") from None
        finally:
            watch.cancel()
        self.measured_rtt_s = time.perf_counter() - start
        if reply.body.get("version") != protocol.VERSION:
            await self.channel.close()
            raise GenieConnectionError(f"genie-daemon at {self.endpoint} speaks protocol version "
                                       f"{reply.body.get('version')!r} and this client {protocol.VERSION}: "
                                       "install the same Genie version on both")
        devices = reply.body.get("devices")
        if not isinstance(devices, list) or not devices:
            raise GenieConnectionError(f"genie-daemon at {self.endpoint} reported no devices")
        self.devices = devices
        if self.runtime.config.cuda_ipc:
            self.cuda_ipc_offer = reply.body.get("cuda_ipc")
        await self._open_lanes(reply.body.get("bulk"), reply.body.get("ucx"), timeout, reply.body.get("lane_key"),
                               reply.body.get("local_lane"))
        if cuda_ipc.needs_local_lane(self.cuda_ipc_offer) and not self.local_lane:
            self.cuda_ipc_offer = None  # a daemon beyond this host takes handles only over its local lane
        if isinstance(self.bulk_lane, ucx_lane.UcxLane):
            self._take_gpu_memory_offer(reply.body.get("ucx_devices"), reply.body.get("ucx_gpu_memory"))
        await self._probe_link()
        if heartbeat > 0:
            self._heartbeat = asyncio.create_task(self._beat(heartbeat))

    def _read_watch_outcome(self, watch: asyncio.Future) -> None:
        """Reads the reachability watch's error whenever it ends: an error left unread is logged,
        traceback and all, when the task is collected, which can be in the middle of anything."""
        if not watch.cancelled() and watch.exception() is not None:
            log.debug("reachability watch of %s: %s", self.endpoint, watch.exception())

    async def _open_lanes(self, advertised, ucx_port, timeout: float, lane_key=None, local_offer=None) -> None:
        """The bulk lane (UCX where chosen, see ucx_lane) and the direct lane, both to the daemon's
        lane listeners; under CURVE both sealed, with the key hello gave (see _open_sealed_lanes).
        A tcp daemon on this host offers a local listener too, plain and sealed daemons alike: lanes
        there use shared memory (see _open_local_lanes)."""
        config = self.runtime.config
        address = bulk.connect_address(advertised, self.endpoint)
        if address is None:
            return
        loop = asyncio.get_running_loop()
        if self.runtime.curve is not None:
            # Plain lanes where they stay on this host and user: a tcp daemon's local listener, or an
            # ipc daemon's own (its socket file is ours). The daemon checks the user itself.
            local = bulk.local_lane_address(local_offer) or bulk.own_unix_listener(address)
            if not await self._open_local_lanes(local, timeout):
                await self._open_sealed_lanes(address, lane_key, timeout)
            return
        if config.bulk_min_bytes > 0 and type(ucx_port) is int and 0 < ucx_port < 65536:
            use, why = ucx_lane.wanted(config.ucx)
            if use:
                host = "127.0.0.1" if address[0] == socket.AF_UNIX else address[1][0]
                try:
                    self.bulk_lane = await loop.run_in_executor(
                        None, ucx_lane.open_client_lane, host, ucx_port, self.token, self.runtime.host_pool,
                        1 << 40, min(timeout, 10.0))
                    self.bulk_min_bytes = config.bulk_min_bytes
                    log.info("bulk lane to %s: %s", self.endpoint, why)
                except ConnectionError as e:
                    log.warning("no UCX lane to %s (the socket lane carries large payloads): %s", self.endpoint, e)
            else:
                log.info("bulk lane to %s: socket, not UCX: %s", self.endpoint, why)
        if self.bulk_lane is None and await self._open_local_lanes(bulk.local_lane_address(local_offer), timeout):
            return
        unreachable = None  # the lanes' listener could not be reached: both lanes go to it
        if config.bulk_min_bytes > 0 and self.bulk_lane is None:
            try:
                self.bulk_lane = await loop.run_in_executor(
                    None, bulk.open_client_lane, address, self.token, self.runtime.host_pool, 1 << 40,
                    min(timeout, 10.0), config.shared_memory)
                # Shared memory wins from a smaller size than the socket does (see README, GENIE_SHARED_MIN_KB).
                self.bulk_min_bytes = config.shared_min_bytes if self.bulk_lane.shared else config.bulk_min_bytes
                if not self.bulk_lane.shared:
                    await self._join_more_lanes(address, timeout)
            except (OSError, ConnectionError) as e:
                if isinstance(e, (TimeoutError, ConnectionRefusedError)) or getattr(e, "errno", None) in (
                        errno.EHOSTUNREACH, errno.ENETUNREACH):
                    unreachable = e
                where = f" at port {address[1][1]}" if address[0] != socket.AF_UNIX else ""
                log.warning("no bulk lane to %s%s (large payloads go over ZeroMQ): %s%s", self.endpoint, where, e,
                            " (a firewall? start the daemon with --lane-port and open that port too)"
                            if where and unreachable is not None else "")
        if config.direct_lane and unreachable is not None:
            log.warning("no direct lane to %s (blocking requests go over ZeroMQ): its listener is the bulk "
                        "lane's, unreachable", self.endpoint)
        elif config.direct_lane:
            await self._open_direct_lane(address, None, timeout)

    async def _open_local_lanes(self, local, timeout: float) -> bool:
        """The bulk lane (shared memory) and the direct lane to the listener at `local` (a tcp
        daemon's local listener, offered for this host and user; under CURVE an ipc daemon's too);
        whether the bulk lane opened (if not, the other lanes are opened instead: another network
        namespace, a container, cannot reach the listener or share memory with it). Under CURVE
        these lanes are plain: their bytes never leave the kernel, and the daemon takes them only
        from processes of its own user."""
        config = self.runtime.config
        if local is None or not config.shared_memory or config.bulk_min_bytes <= 0:
            return False
        loop = asyncio.get_running_loop()
        try:
            lane = await loop.run_in_executor(None, bulk.open_shared_lane, local, self.token,
                                              self.runtime.host_pool, min(timeout, 10.0))
        except (OSError, ConnectionError) as e:
            log.info("no local lane to %s (the other lanes carry large payloads): %s", self.endpoint, e)
            return False
        if lane is None:
            log.info("no shared memory with %s (the other lanes carry large payloads)", self.endpoint)
            return False
        log.info("bulk lane to %s: shared memory (the daemon runs on this host)", self.endpoint)
        # local_lane: a tcp daemon's local listener (an ipc daemon's lanes are local anyway).
        self.bulk_lane, self.bulk_min_bytes = lane, config.shared_min_bytes
        self.local_lane = not self.endpoint.startswith("ipc://")
        if config.direct_lane:
            await self._open_direct_lane(local, None, timeout)
        return True

    async def _open_sealed_lanes(self, address, lane_key, timeout: float) -> None:
        """Under CURVE: the bulk and direct lanes sealed (sealed_lane), or none where the daemon
        offers no lane key or `cryptography` is missing here (all then goes through ZeroMQ)."""
        config = self.runtime.config
        if lane_key is None or not sealed_lane.available():
            log.info("no lanes to %s (everything goes over ZeroMQ, encrypted by CURVE): %s", self.endpoint,
                     "the daemon offers no sealed lane" if lane_key is None else
                     "the cryptography package is not installed here")
            return
        lane_key = sealed_lane.check_lane_key(lane_key)
        loop = asyncio.get_running_loop()
        if config.sealed_min_bytes > 0:
            try:
                self.bulk_lane = await loop.run_in_executor(
                    None, functools.partial(bulk.open_client_lane, address, self.token, self.runtime.host_pool,
                                            1 << 40, min(timeout, 10.0), lane_key=lane_key))
                # CURVE encrypts in ZeroMQ's I/O thread at 0.4-0.7 GB/s here: the lane wins from ~128 KiB.
                self.bulk_min_bytes = config.sealed_min_bytes
                await self._join_more_lanes(address, timeout, lane_key)
            except (OSError, ConnectionError, ProtocolError) as e:
                log.warning("no sealed bulk lane to %s (large payloads go over ZeroMQ, encrypted by CURVE): %s",
                            self.endpoint, e)
        if config.direct_lane:
            await self._open_direct_lane(address, lane_key, timeout)

    async def _join_more_lanes(self, address, timeout: float, lane_key: bytes | None = None) -> None:
        """The bulk lane becomes a lane_set.LaneSet of GENIE_BULK_LANES connections (sealed ones
        each with keys of their own), across which large payloads are split (by default 4 over TCP,
        where one flow is often the limit, and 1 over a Unix socket: lane_set.lanes_wanted). A lane
        that fails to open leaves the set smaller, said in the log."""
        config = self.runtime.config
        wanted = lane_set.lanes_wanted(address[0], config.bulk_lanes)
        if wanted < 2:
            return
        open_member = functools.partial(bulk.open_client_lane, address, self.token, self.runtime.host_pool, 1 << 40,
                                        min(timeout, 10.0), lane_key=lane_key)
        self.bulk_lane, failure = await asyncio.get_running_loop().run_in_executor(
            None, lambda: lane_set.join_lanes(self.bulk_lane, wanted, lambda member: open_member(joining=member),
                                              config.stripe_min_bytes))
        if failure is not None:
            log.warning("%d of %d bulk lanes to %s: %s", len(self.bulk_lane.lanes), wanted, self.endpoint, failure)

    async def _open_direct_lane(self, address, lane_key: bytes | None, timeout: float) -> None:
        """The direct lane to the lane listener at `address` (sealed with `lane_key` under CURVE), or
        a warning: blocking requests then go over ZeroMQ."""
        try:
            sock, sealing = await asyncio.get_running_loop().run_in_executor(
                None, self._connect_direct_lane, address, lane_key, min(timeout, 10.0))
        except (OSError, ConnectionError, ProtocolError) as e:
            log.warning("no %sdirect lane to %s (blocking requests go over ZeroMQ): %s",
                        "sealed " if lane_key is not None else "", self.endpoint, e)
            return
        self._use_direct_lane(sock, sealing)
        self._direct_lane_at = (address, lane_key)

    def _connect_direct_lane(self, address, lane_key: bytes | None, timeout: float):
        """(Blocking.) A new direct-lane socket to the lane listener at `address`, and its sealing
        (sealed with `lane_key` under CURVE, else None)."""
        if lane_key is None:
            return bulk.connect_greeted(address, stream_framing.MAGIC, self.token, timeout)[0], None
        return bulk.connect_sealed(address, self.token, lane_key, timeout, stream_framing.MAGIC_SEALED)

    def _use_direct_lane(self, sock, sealing=None) -> None:
        """The channel's blocking requests go on `sock` from now (sealed with `sealing` under CURVE)."""
        config = self.runtime.config
        self.channel.direct_sealing = sealing
        self.channel.direct_stream = sock
        self.channel.busy_poll.seconds = max(0.0, config.client_spin_us) / 1e6
        self.channel.loss_grace_s = config.heartbeat_timeout + 2 * config.heartbeat
        self.channel.on_direct_dropped = self._direct_lane_dropped

    def _direct_lane_dropped(self) -> None:
        """(Any thread; from the channel.) The direct lane was dropped: Ctrl-C cut it in the middle
        of an answer, or its socket failed. Blocking requests go by ZeroMQ meanwhile, slower (a
        Jupyter user interrupts cells often, and a long session would otherwise keep that cost):
        open another on the loop, unless the daemon is lost."""
        if self._direct_lane_at is None or self.lost is not None:
            return
        delay = max(0.0, self._direct_reopened_at + DIRECT_REOPEN_GAP_S - time.monotonic())
        try:
            self.runtime.loop.submit(self._reopen_direct_lane(delay))
        except RuntimeError:  # the loop is stopping: nothing to reopen for
            pass

    async def _reopen_direct_lane(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.lost is not None or self.channel is None or self.channel.closed or self.channel.direct_stream:
            return
        self._direct_reopened_at = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            sock, sealing = await loop.run_in_executor(None, self._connect_direct_lane, *self._direct_lane_at, 10.0)
        except (OSError, ConnectionError, ProtocolError) as e:
            log.warning("no new direct lane to %s (blocking requests go over ZeroMQ): %s", self.endpoint, e)
            return
        if await loop.run_in_executor(None, self._install_direct_lane, sock, sealing):
            log.info("direct lane to %s open again", self.endpoint)

    def _install_direct_lane(self, sock, sealing) -> bool:
        """(Blocking.) Use `sock` as the direct lane once no caller thread is on the channel's
        direct path; closed instead when the link went away meanwhile."""
        # A reader whose lane failed holds the direct path while it waits for the link's verdict.
        claimed = self._claim_direct_when_free(max(DIRECT_INSTALL_WAIT_S, self.channel.loss_grace_s + 5.0))
        try:
            if claimed and self.lost is None and not self.channel.closed and self.channel.direct_stream is None:
                self._use_direct_lane(sock, sealing)
                return True
        finally:
            if claimed:
                self._release_direct()
        sock.close()
        return False

    def _take_gpu_memory_offer(self, devices, how) -> None:
        """The daemon's GPUs that uploads on the UCX lane may land in directly (see ucx_lane)."""
        if isinstance(devices, list) and all(type(i) is int and 0 <= i < len(self.devices) for i in devices):
            self.bulk_lane.peer_devices = frozenset(devices)
        if isinstance(how, str):
            self.ucx_gpu_memory = how[:500]
        log.info("GPU memory over UCX at %s: %s", self.endpoint, self.ucx_gpu_memory)

    def cuda_ipc_for(self, device) -> bool:
        """Whether a CUDA tensor on this process's `device` goes to this daemon as a CUDA IPC handle
        (same host, and the daemon sees that GPU) instead of as bytes."""
        if self.cuda_ipc_offer is None:
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        ok = self._cuda_ipc_ok.get(index)
        if ok is None:
            ok = self._cuda_ipc_ok[index] = cuda_ipc.usable(self.cuda_ipc_offer, torch.device("cuda", index))
        return ok

    def transport_path(self) -> str:
        if self.bulk_lane is None or self.bulk_lane.closed:
            return "zmq"
        return "zmq+bulk-" + self.bulk_lane.path

    async def _probe_link(self, payload: int = 4 << 20) -> None:
        """Measure this link: latency (best of a few pings) and bandwidth (a 4 MiB upload)."""
        rtts = []
        for _ in range(3):
            t0 = time.perf_counter()
            await self.channel.post("ping", {})
            rtts.append(time.perf_counter() - t0)
        self.measured_rtt_s = min(rtts)
        blob = bytearray(payload)
        t0 = time.perf_counter()
        await self.channel.post("probe", {}, [blob])
        elapsed = time.perf_counter() - t0
        self.bandwidth = payload / max(elapsed - self.measured_rtt_s, 1e-6)

    async def _beat(self, period: float) -> None:
        """Ping every `period`; a ping unanswered for the heartbeat timeout means the daemon is lost.

        The clock starts when the oldest unanswered ping was sent, by this loop: if this process
        itself was stalled, its pings went out late too, and nothing is declared lost for that.
        """
        timeout = self.runtime.config.heartbeat_timeout
        oldest_unanswered: float | None = None
        while self.lost is None:
            await asyncio.sleep(period)
            now = time.monotonic()
            if oldest_unanswered is not None and self.channel.last_heard >= oldest_unanswered:
                oldest_unanswered = None
            if oldest_unanswered is not None and timeout > 0 and now - oldest_unanswered > timeout:
                self.lose(f"no answer to heartbeats for {now - oldest_unanswered:.1f}s")
                return
            try:
                pong = self.channel.post("ping", {})
            except Exception:
                return
            if oldest_unanswered is None:
                oldest_unanswered = now
            # Nobody awaits a ping: consume its outcome so a closed channel logs nothing.
            pong.add_done_callback(lambda f: f.cancelled() or f.exception())

    def lose(self, reason: str) -> None:
        """The daemon is gone: fail everything waiting on it, at once, with a message that says so."""
        if self.lost is not None:
            return
        waiting = len(self.channel._pending) if self.channel else 0
        local = self.runtime.local_daemon
        if local is not None and local.endpoint == self.endpoint and not self.restarting:
            # Its connection dropped: it is ending. A GPU process can take a while to (its CUDA
            # context is torn down first): 0.05 s missed a killed one on an H100 node.
            ended = local.wait_for_exit_report(EXIT_REPORT_WAIT_S)
            if ended:
                reason = f"{reason}; {ended}"
        self.lost = (f"genie-daemon at {self.endpoint} was lost ({reason}); {waiting} request(s) in flight failed "
                     "and tensors that lived only on it are gone; the next use of a remote device reconnects")
        log.error("%s", self.lost)
        error = GenieConnectionError(self.lost)
        if self.channel is not None:
            self.channel.fail_pending(error)
            asyncio.get_running_loop().create_task(self.channel.close())  # lose() runs on the loop
        if self.bulk_lane is not None:
            self.bulk_lane.close(error)
        with self._inflight:
            self._inflight.notify_all()

    def _error_from(self, exc: BaseException) -> BaseException:
        """`exc` as the error users catch. A daemon whose GPU's context was lost (a device-side
        assert) says so and restarts: the link is lost from here on, as if its connection had
        dropped, so later uses fail as lost (or reconnect) instead of reaching a daemon on its way down."""
        if isinstance(exc, RemoteError) and exc.error_type == protocol.DEVICE_LOST_ERROR and self.lost is None:
            # With the daemon's words: this answer may be read by a Genie thread (a batch posted
            # ahead), and the user then meets only the loss, at the next use of the device.
            reason = f"its GPU's CUDA context was lost, and it restarts; the daemon said: {exc.message}"
            self.restarting = True
            if self.runtime.loop.in_loop_thread():
                self.lose(reason)
            else:
                done = threading.Event()
                self.runtime.loop.call(lambda: (self.lose(reason), done.set()))
                done.wait(5.0)
        return to_genie_error(exc, self.endpoint)

    def abandon(self, reason: str) -> None:
        """In a forked child: this link is the parent's. Mark it lost with `reason`, without I/O,
        and give it fresh locks (a parent thread may have held them at the fork), so that using a
        tensor from before the fork raises that reason instead of hanging or talking on the
        parent's sockets."""
        self.lost = reason
        self._inflight = Condition()
        self._direct_unread = collections.deque()
        self._direct_unread_ops = self._direct_unread_bytes = 0
        self._collector_running = False
        self._direct_busy = False
        self._outstanding = 0
        self.inflight_bytes = 0
        self._heartbeat = None  # a task of the parent's loop
        if self.channel is not None:
            self.channel.abandon()
        if self.bulk_lane is not None:
            self.bulk_lane.abandon()

    def submit_exec(self, body: dict, frames: list, stream: DeviceStream, waited: bool,
                    on_settled=None) -> concurrent.futures.Future:
        """Post an exec in order. When nobody waits for it, failures are kept on the stream.
        `on_settled` is called once its answer is handled, failures recorded included."""
        if self._direct_unread:  # it must go after batches posted on the direct socket: there too
            future = self._post_behind_direct(body, frames, stream, waited, on_settled)
            if future is not None:
                return future
        nbytes = sum(memoryview(f).nbytes for f in frames)
        limit = self.runtime.config.max_inflight_bytes
        try:
            self.collect_direct()  # an unread direct answer goes first: program order, and it frees the direct socket
            with self._inflight:
                # Wait while too much is in flight (a single batch larger than the bound still goes alone).
                with let_through():  # nothing is sent yet: a Ctrl-C stops the wait, the batch goes back
                    admitted = self._inflight.wait_for(lambda: self.lost is not None or not self._direct_busy and (
                        self.inflight_bytes == 0 or self.inflight_bytes + nbytes <= limit),
                        timeout=self.runtime.config.request_timeout)
                if not admitted:
                    raise GenieConnectionError(f"genie-daemon at {self.endpoint} acknowledged nothing for "
                                               f"{self.runtime.config.request_timeout:.0f}s ({self.inflight_bytes} bytes in flight)")
                if self.lost is not None:
                    raise GenieConnectionError(self.lost)
                self.inflight_bytes += nbytes
                self._outstanding += 1
        except BaseException as e:
            if is_interrupt(e):  # a Ctrl-C before it went: the next post sends it
                stream.put_back(body, frames)
            raise
        future = self.channel.post_threadsafe(self.runtime.loop.loop, "exec", body, frames)

        def done(f: concurrent.futures.Future) -> None:
            try:
                if not f.cancelled():
                    exc = f.exception()
                    if exc is None:
                        reply = f.result()
                        self._log_timing(reply, stream)
                        if not waited:
                            stream.note_failure(reply)
                    elif not waited:
                        stream.record_async_error(self._error_from(exc))
            finally:
                with self._inflight:
                    self.inflight_bytes -= nbytes
                    self._outstanding -= 1
                    self._inflight.notify_all()
                if on_settled is not None:
                    on_settled()
        future.add_done_callback(done)
        return future

    def direct_exec(self, body: dict, frames: list, stream: DeviceStream) -> _Answered | None:
        """Run an exec as a direct request on the calling thread when nothing else is in flight.

        Returns its outcome (with a finished future's `result()`, for `wait`), or None when the
        loop path must be used (requests in flight on it, another thread on the direct socket, or
        called on the loop thread). Answers to batches posted before it on the direct socket are
        read first (the daemon answers that socket in order): the request goes out without
        waiting for them.
        """
        if not self._claim_direct():
            return None
        rid = reply = None
        try:
            # A Ctrl-C comes in the waits, or once the answer is handed over (see interrupts.py).
            with held_between_waits():
                rid = self.channel.send_direct("exec", body, frames)
                self._read_posted(everything=True)
                reply = self.channel.receive_direct(rid, self.runtime.config.request_timeout, alive=self._alive)
                self.hand_over(reply)
                self._log_timing(reply, stream)
            return _Answered(reply)
        except BaseException as e:
            if not is_interrupt(e):  # handed to the waiter like a loop-path failure
                return _Answered(error=self._direct_failure(e))
            # Ctrl-C while blocked: the request runs on (as CUDA work does), its answer is dropped
            # when it comes (or now, if it came just before), and the program carries on. One
            # that stopped the request going out puts the batch back for the next post.
            if reply is not None:
                self.abandon_reply(True, reply.body)
            elif rid is not None:
                self.channel.forget_reply(rid)
            else:
                stream.put_back(body, frames)
            raise
        finally:
            self._release_direct()

    def post_direct(self, body: dict, frames: list, stream: DeviceStream) -> bool:
        """Send an exec nobody waits for yet on the direct socket; its answer is read later, in
        order, by the next direct request, a sync, or a post through the loop (`collect_direct`).

        For a full batch, this lets the daemon run it while this thread captures the next one,
        with neither side's thread hops of the loop path; for a batch whose bulk bytes follow
        it, the caller sends them, and the sync reads the answer off the socket itself. At most
        MAX_OPS_AHEAD ops, and max_inflight_bytes of payload, stay unread: past that, this waits
        for the oldest answers (a client that never syncs runs at most that far ahead of its
        daemon, as CUDA launches do; a single batch larger than that still goes alone). False
        when the loop path must be used (as for `direct_exec`).
        """
        if not self._claim_direct():
            return False
        self._send_posted(body, frames, _Posted(stream))
        return True

    def _post_behind_direct(self, body: dict, frames: list, stream: DeviceStream, waited: bool,
                            on_settled) -> concurrent.futures.Future | None:
        """`submit_exec` while batches posted on the direct socket are unread: post it there too,
        behind them, and have a thread read the answers, rather than block this caller until
        they are in (an asyncio caller of `genie.materialize` must not wait). None: the direct
        socket is in use by another thread (then `submit_exec` waits for it)."""
        if not self._claim_direct():
            return None
        posted = _Posted(stream, concurrent.futures.Future(), waited, on_settled)
        try:
            self._send_posted(body, frames, posted)
        except BaseException as e:
            if not is_interrupt(e) and posted.rid is not None:
                return posted.future  # sent, and failed with the connection (settled by `_read_posted`)
            if posted.rid is not None:  # sent, and a Ctrl-C came while reading older answers
                self._collect_in_background()
            raise  # (never sent: the caller settles it, or it was put back)
        self._collect_in_background()
        return posted.future

    def _send_posted(self, body: dict, frames: list, posted: _Posted) -> None:
        """Send a posted batch on the claimed direct socket, then release it (see `post_direct`)."""
        try:
            with held_between_waits():  # sent and queued for reading, or neither (see interrupts.py)
                posted.rid = self.channel.send_direct("exec", body, frames)
                posted.ops, posted.nbytes = max(1, len(body["ops"])), sum(memoryview(f).nbytes for f in frames)
                self._direct_unread.append(posted)
                self._direct_unread_ops += posted.ops
                self._direct_unread_bytes += posted.nbytes
                self._read_posted(everything=False)
        except BaseException as e:
            if not is_interrupt(e):  # a lost connection, said to this caller
                raise self._direct_failure(e) from None
            if posted.rid is None:  # a Ctrl-C stopped it going out: the next post sends it
                posted.stream.put_back(body, frames)
            raise
        finally:
            self._release_direct()

    def _collect_in_background(self) -> None:
        """Read posted answers on a thread of their own until none is left."""
        with self._inflight:
            if self._collector_running:
                return  # it looks at the queue again before it stops
            self._collector_running = True

        def collect() -> None:
            while True:
                try:
                    self.collect_direct()
                except Exception as e:  # noqa: BLE001 - the waiters got it; nobody else to tell
                    log.debug("reading posted answers from %s: %s", self.endpoint, e)
                with self._inflight:
                    if not self._direct_unread or self.lost is not None:
                        self._collector_running = False
                        return

        threading.Thread(target=collect, name="genie-collect", daemon=True).start()

    def collect_direct(self) -> None:
        """Read the answers to `post_direct` execs, if any are unread (any thread may): failures
        of their ops are kept on their streams (nobody waited for them); a lost connection raises."""
        if not self._direct_unread:
            return
        if not self._claim_direct_when_free(self.runtime.config.request_timeout):
            raise GenieConnectionError(self.lost or f"genie-daemon at {self.endpoint}: the direct socket "
                                       f"stayed busy for {self.runtime.config.request_timeout:.0f}s")
        try:
            self._read_posted(everything=True)
        except Exception as e:  # noqa: BLE001 - the connection failed: said to this caller
            raise self._direct_failure(e) from None
        finally:
            self._release_direct()

    def _read_posted(self, everything: bool) -> None:
        """Read posted answers, oldest first: all of them, or until what is left unread is within
        the bounds of `post_direct` (the caller has claimed the direct socket)."""
        while self._direct_unread and (everything or len(self._direct_unread) > 1 and (
                self._direct_unread_ops > MAX_OPS_AHEAD
                or self._direct_unread_bytes > self.runtime.config.max_inflight_bytes)):
            posted = self._direct_unread[0]
            with held_between_waits():  # an answer taken is settled before a Ctrl-C is raised
                try:
                    reply = self.channel.receive_direct(posted.rid, self.runtime.config.request_timeout,
                                                        alive=self._alive)
                except RemoteError as e:
                    self._forget_oldest_posted()
                    posted.settle(error=self._error_from(e))
                    continue
                except AnswerLost as e:
                    # Ctrl-C cut the lane mid-answer: the batch ran, its answer is gone. A failure it
                    # would have told of shows at its outputs' next read (the daemon keeps the poison);
                    # a waiter holding its future learns that the answer is lost.
                    self._forget_oldest_posted()
                    if posted.future is None:
                        posted.settle(Reply({}, []))
                    else:
                        posted.settle(error=GenieConnectionError(str(e)))
                    continue
                except BaseException as e:
                    if is_interrupt(e):
                        raise  # Ctrl-C while waiting: the answer still comes, and the next reader reads it
                    # The connection is gone: no answer will come. Each batch's waiter, or its
                    # stream's next sync, learns it too (this caller may be the collector thread).
                    self._drop_posted(self._direct_failure(e))
                    raise
                self._forget_oldest_posted()
                self._log_timing(reply, posted.stream)
                posted.settle(reply)

    def _drop_posted(self, error: BaseException) -> None:
        """No answer will come to the unread posted batches: each one's waiter, or its stream's
        next sync, gets `error`."""
        unread, self._direct_unread = self._direct_unread, collections.deque()
        self._direct_unread_ops = self._direct_unread_bytes = 0
        for lost in unread:
            lost.settle(error=error)

    def _forget_oldest_posted(self) -> None:
        posted = self._direct_unread.popleft()
        self._direct_unread_ops -= posted.ops
        self._direct_unread_bytes -= posted.nbytes

    def _claim_direct_when_free(self, timeout: float, loop_idle: bool = False) -> bool:
        """Claim the direct socket once no other thread uses it (and, with `loop_idle`, nothing
        posted through the loop is unanswered), `timeout` at most; False if it stayed in use."""
        def in_use() -> bool:
            return self._direct_busy or loop_idle and self._outstanding > 0

        with self._inflight:
            with let_through():  # nothing claimed yet: a Ctrl-C stops the wait
                self._inflight.wait_for(lambda: not in_use() or self.lost is not None, timeout)
            if in_use():
                return False
            self._direct_busy = True
        return True

    def _claim_direct(self) -> bool:
        if self.runtime.loop.in_loop_thread() or self.channel is None or self.channel.closed:
            return False
        with self._inflight:
            if self._outstanding or self._direct_busy:
                return False
            self._direct_busy = True
        return True

    def _release_direct(self) -> None:
        with self._inflight:
            self._direct_busy = False
            self._inflight.notify_all()

    def _alive(self) -> bool:
        return self.lost is None and not self.channel.closed

    def _direct_failure(self, e: Exception) -> Exception:
        if isinstance(e, TimeoutError):
            return GenieConnectionError(str(e))
        if isinstance(e, ChannelClosed):
            return GenieConnectionError(self.lost or str(e))
        return e

    @staticmethod
    def _log_timing(reply, stream: DeviceStream) -> None:
        timing = reply.body.get("time")
        if timing:
            stream.exec_log.append(tuple(timing))

    def request(self, kind: str, body: dict, timeout: float | None = None, collect: bool = True):
        """Ask the daemon (on the channel) and wait for the answer. First, with `collect`, read the
        answers to batches posted before it: it may be about their work."""
        if collect:
            self.collect_direct()
        return self.wait(self.channel.post_threadsafe(self.runtime.loop.loop, kind, body), timeout)

    def hand_over(self, reply, reader: int | None = None) -> None:
        """`reply` goes to thread `reader` (this one by default), which takes what it fetched next
        (`took`). What the previous reply handed to that thread still names was left behind (a
        Ctrl-C between the hand-over and the take): let go now."""
        fetched = reply.body.get("fetched") if isinstance(reply.body, dict) else None
        if not isinstance(fetched, list):
            return
        reader = threading.get_ident() if reader is None else reader
        left = self._handed.get(reader)
        self._handed[reader] = fetched
        if left is not None and left is not fetched:
            self.abandon_fetched(left)

    def _hand_over_answer(self, future, reader: int) -> None:
        if not future.cancelled() and future.exception() is None:
            self.hand_over(future.result(), reader)

    def took(self, fetched: list) -> None:
        """This thread has taken (or let go of) all that `fetched` names (see hand_over)."""
        reader = threading.get_ident()
        if self._handed.get(reader) is fetched:
            del self._handed[reader]

    def abandon_future(self, future) -> None:
        """Nobody will take the answer `future` brings (its awaiter was cancelled): let go of what
        it names once it comes (see abandon_reply)."""
        future.add_done_callback(self._abandon_when_answered)

    def _abandon_when_answered(self, future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.abandon_reply(True, getattr(future.result(), "body", None))

    def abandon_reply(self, ok: bool, body) -> None:
        """(Any thread.) A reply nobody will read (its waiter was interrupted, or gave up): what it
        fetched on the bulk lane is dropped as it lands, and tensors it named in shared segments
        are taken and let go (the daemon reuses a segment once the tensor over it is freed).
        Before, each such download was held for good (a 64 MiB `.cpu()` interrupted 30 times:
        1.9 GB of this process's memory)."""
        if ok and isinstance(body, dict) and isinstance(body.get("fetched"), list):
            self.abandon_fetched(body["fetched"])

    def abandon_fetched(self, descs: list) -> None:
        """Let go of the fetched tensors `descs` (a reply's "fetched" entries) that come on the
        bulk lane or in shared segments and were not taken (see abandon_reply)."""
        lane = self.bulk_lane
        if lane is None:
            return
        for desc in descs:
            if not isinstance(desc, dict):
                continue
            if type(desc.get("bulk")) is int:
                # (Ids are not reused: abandoning one taken already costs nothing.)
                lane.arrivals.abandon(desc["bulk"])
            where = desc.get("segment")
            if bulk.is_segment_name(where) and _TAKEN not in desc:
                try:
                    self.take_named(desc, where)  # dropped at once: handed back
                except (ProtocolError, ValueError, OSError) as e:
                    log.debug("an unread reply's segment %s: %s", where, e)

    def take_named(self, desc: dict, where: list) -> torch.Tensor:
        """The bytes a reply's fetched entry `desc` names in shared segment `where`, marked taken:
        an abandon of that reply leaves the segment alone (handed back since, it may hold a newer
        answer's bytes)."""
        data = self.bulk_lane.take_named(*where)
        desc[_TAKEN] = True
        return data

    def wait(self, future: concurrent.futures.Future, timeout: float | None = None):
        if self.runtime.loop.in_loop_thread():
            raise GenieError("blocking materialization called from Genie's own event loop thread")
        timeout = self.runtime.config.request_timeout if timeout is None else timeout
        reader = threading.get_ident()
        waits = self._waits_by_thread
        waits[reader] = waits.get(reader, 0) + 1
        try:
            # Held but for the wait itself: a Future's `result` takes its lock in a Python
            # `with`, which a Ctrl-C could cut with the lock held (the loop thread then hangs
            # answering it). So the wait is on a bare lock the answer releases.
            with held_between_waits():
                future.add_done_callback(lambda done: self._hand_over_answer(done, reader))
                if not future.done():
                    arrived = threading.Lock()
                    arrived.acquire()
                    future.add_done_callback(lambda _done: arrived.release())
                    with let_through():
                        if not arrived.acquire(timeout=timeout):
                            raise concurrent.futures.TimeoutError
                    # (A Ctrl-C just after the acquire: `arrived` is this call's alone.)
                return future.result(0)
        except concurrent.futures.TimeoutError:
            self.abandon_future(future)
            raise GenieConnectionError(f"genie-daemon at {self.endpoint} did not answer within {timeout:.0f}s") from None
        except (RemoteError, ChannelClosed) as e:
            raise self._error_from(e) from None
        except BaseException as e:
            if is_interrupt(e):
                # Ctrl-C while blocked: the request runs on; its reply, when it comes, is let go.
                with held_interrupts():  # (a Future's lock again: see above)
                    self.abandon_future(future)
            raise
        finally:
            # The future holds its exception, whose traceback holds this frame: drop the local so
            # that cycle (and every tensor the callers' frames hold) does not wait for the GC.
            del future

    @property
    def blocking_waits(self) -> int:
        """Answers caller threads blocked on (transport_stats)."""
        return sum(list(self._waits_by_thread.values()))

    async def close(self, say_bye: bool) -> None:
        if self._heartbeat:
            self._heartbeat.cancel()
        if self.bulk_lane is not None:
            self.bulk_lane.close()
        if self.channel is None:
            return
        if self.lost is not None:
            await self.channel.close()
            return
        if say_bye and not self.said_bye and not self.channel.closed:
            try:
                await asyncio.wait_for(self.channel.post("bye", {}), 2.0)
            except Exception:
                pass
        await self.channel.close()

    def say_bye_behind_posted(self, timeout: float = 2.0) -> None:
        """At shutdown, with batches posted on the direct socket unanswered: the bye goes there,
        behind them (through ZeroMQ it could reach the daemon first, which would free this
        client's tensors before they ran), and their answers are read, `timeout` at most: a
        socket closed with answers unread resets the connection, and the daemon loses what it
        had not read yet (seen: the bye, and the client's tensors kept until its lease ran out)."""
        if not self._direct_unread or self.lost is not None or self.channel is None or self.channel.closed:
            return
        # The collector thread may hold the socket for a while: wait for it.
        if not self._claim_direct_when_free(timeout, loop_idle=True):
            return
        try:
            if self.lost is not None or not self._direct_unread:
                return  # all read meanwhile (nothing unread: the bye may go through ZeroMQ)
            rid = self.channel.send_direct("bye", {}, None)
            self.said_bye = True
            self.channel.receive_direct(rid, timeout, alive=self._alive)  # keeps earlier answers aside
            self._read_posted(everything=True)  # all in by now
        except Exception as e:  # noqa: BLE001 - shutting down: what is unread fails
            self._drop_posted(GenieConnectionError(f"genie-daemon at {self.endpoint}: shut down before "
                                                   f"its answer came ({e})"))
        finally:
            self._release_direct()


def to_genie_error(exc: BaseException, endpoint: str) -> BaseException:
    """Transport-level failures as the errors users catch."""
    if isinstance(exc, RemoteError):
        return remote_error(exc, endpoint)
    if isinstance(exc, ChannelClosed):
        return GenieConnectionError(f"connection to {endpoint} closed: {exc}")
    return exc
