"""The registry of daemons and devices, and the process-wide runtime.

Device indices enumerate the devices of each connected daemon, daemon by daemon,
in the order their endpoints were given. With no endpoint configured, the first
use starts an embedded local daemon.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import errno
import itertools
import logging
import math
import os
import socket
import threading
import time

import torch
import zmq.asyncio

from genie import config as config_module
from genie.errors import GenieConnectionError, GenieError
from genie.transport import bulk, cuda_ipc, protocol, reachability, stream_framing, ucx_lane
from genie.transport.channel import Channel, ChannelClosed, RemoteError
from genie.transport.hostmem import HostBufferPool

from .embedded import LocalDaemon
from .loop import LoopThread
from .stream import DeviceStream, remote_error

log = logging.getLogger("genie.runtime")


# How many ops a client may post on the direct socket ahead of reading their answers (see
# DaemonLink.post_direct): like a CUDA device's launch queue, about a thousand deep, past which
# launching waits for the device.
MAX_OPS_AHEAD = 1024
RECONNECT_RETRY_S = 5.0  # how often work on the other daemons tries a lost one again (see _reconnect)
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
        self._inflight = threading.Condition()
        self._outstanding = 0  # exec requests posted through the loop and not yet answered
        self.blocking_waits = 0  # answers a caller thread blocked on (transport_stats)
        self._waits_lock = threading.Lock()
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
        self.cuda_ipc_offer: dict | None = None  # hello's cuda_ipc: the daemon takes handles from this host
        self.ucx_gpu_memory = "no: no UCX lane to this daemon"  # whether its UCX lane moves GPU memory, in words
        self._cuda_ipc_ok: dict[int, bool] = {}  # client GPU index -> whether its tensors go by CUDA IPC

    async def connect(self, timeout: float, heartbeat: float) -> None:
        self.channel = Channel(self.endpoint, self.runtime.zmq_context, routing_id=self.token,
                               curve=self.runtime.curve)
        self.channel.on_disconnect = self.lose
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
        await self._open_lanes(reply.body.get("bulk"), reply.body.get("ucx"), timeout)
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

    async def _open_lanes(self, advertised, ucx_port, timeout: float) -> None:
        """The bulk lane (UCX where chosen, see ucx_lane) and the direct lane, both to the daemon's
        lane listeners (plaintext: not under CURVE)."""
        config = self.runtime.config
        address = bulk.connect_address(advertised, self.endpoint)
        if address is None or self.runtime.curve is not None:
            return
        loop = asyncio.get_running_loop()
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
        unreachable = None  # the lanes' listener could not be reached: both lanes go to it
        if config.bulk_min_bytes > 0 and self.bulk_lane is None:
            try:
                self.bulk_lane = await loop.run_in_executor(
                    None, bulk.open_client_lane, address, self.token, self.runtime.host_pool, 1 << 40,
                    min(timeout, 10.0), config.shared_memory)
                # Shared memory wins from a smaller size than the socket does (see README, GENIE_SHARED_MIN_KB).
                self.bulk_min_bytes = config.shared_min_bytes if self.bulk_lane.shared else config.bulk_min_bytes
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
            try:
                self.channel.direct_stream, _ = await loop.run_in_executor(
                    None, bulk.connect_greeted, address, stream_framing.MAGIC, self.token, min(timeout, 10.0))
                self.channel.busy_poll.seconds = max(0.0, config.client_spin_us) / 1e6
                self.channel.loss_grace_s = config.heartbeat_timeout + 2 * config.heartbeat
            except (OSError, ConnectionError) as e:
                log.warning("no direct lane to %s (blocking requests go over ZeroMQ): %s", self.endpoint, e)

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
            reason = "its GPU's CUDA context was lost, and it restarts"
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
        self._inflight = threading.Condition()
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
        self.collect_direct()  # an unread direct answer goes first: program order, and it frees the direct socket
        with self._inflight:
            # Wait while too much is in flight (a single batch larger than the bound still goes alone).
            if not self._inflight.wait_for(lambda: self.lost is not None or not self._direct_busy and (
                    self.inflight_bytes == 0 or self.inflight_bytes + nbytes <= limit),
                    timeout=self.runtime.config.request_timeout):
                raise GenieConnectionError(f"genie-daemon at {self.endpoint} acknowledged nothing for "
                                           f"{self.runtime.config.request_timeout:.0f}s ({self.inflight_bytes} bytes in flight)")
            if self.lost is not None:
                raise GenieConnectionError(self.lost)
            self.inflight_bytes += nbytes
            self._outstanding += 1
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
        rid = None
        try:
            rid = self.channel.send_direct("exec", body, frames)
            self._read_posted(everything=True)
            reply = self.channel.receive_direct(rid, self.runtime.config.request_timeout, alive=self._alive)
            self._log_timing(reply, stream)
            return _Answered(reply)
        except Exception as e:  # noqa: BLE001 - handed to the waiter like a loop-path failure
            return _Answered(error=self._direct_failure(e))
        except KeyboardInterrupt:
            # Ctrl-C while blocked: the request runs on (as CUDA work does), its answer is dropped
            # when it comes, and the program carries on with the next op.
            if rid is not None:
                self.channel.forget_reply(rid)
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
        except Exception:
            if posted.rid is None:
                raise  # never sent: the caller settles it
            return posted.future  # sent, and failed with the connection (settled by `_read_posted`)
        self._collect_in_background()
        return posted.future

    def _send_posted(self, body: dict, frames: list, posted: _Posted) -> None:
        """Send a posted batch on the claimed direct socket, then release it (see `post_direct`)."""
        try:
            posted.rid = self.channel.send_direct("exec", body, frames)
            posted.ops, posted.nbytes = max(1, len(body["ops"])), sum(memoryview(f).nbytes for f in frames)
            self._direct_unread.append(posted)
            self._direct_unread_ops += posted.ops
            self._direct_unread_bytes += posted.nbytes
            self._read_posted(everything=False)
        except Exception as e:  # noqa: BLE001 - a lost connection, said to this caller
            raise self._direct_failure(e) from None
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
            try:
                reply = self.channel.receive_direct(posted.rid, self.runtime.config.request_timeout, alive=self._alive)
            except RemoteError as e:
                self._forget_oldest_posted()
                posted.settle(error=self._error_from(e))
                continue
            except KeyboardInterrupt:
                raise  # Ctrl-C while waiting: the answer still comes, and the next reader reads it
            except BaseException as e:
                # The connection is gone: no answer will come. Each batch's waiter, or its
                # stream's next sync, learns it too (this caller may be the collector thread).
                self._drop_posted(self._direct_failure(e) if isinstance(e, Exception)
                                  else GenieConnectionError(repr(e)))
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

    def wait(self, future: concurrent.futures.Future, timeout: float | None = None):
        if self.runtime.loop.in_loop_thread():
            raise GenieError("blocking materialization called from Genie's own event loop thread")
        timeout = self.runtime.config.request_timeout if timeout is None else timeout
        with self._waits_lock:
            self.blocking_waits += 1
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise GenieConnectionError(f"genie-daemon at {self.endpoint} did not answer within {timeout:.0f}s") from None
        except (RemoteError, ChannelClosed) as e:
            raise self._error_from(e) from None
        finally:
            # The future holds its exception, whose traceback holds this frame: drop the local so
            # that cycle (and every tensor the callers' frames hold) does not wait for the GC.
            del future

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


class Runtime:
    def __init__(self) -> None:
        self.config = config_module.load()
        from genie.transport import tensors

        tensors.MAX_FRAME_BYTES = max(1, self.config.max_frame_bytes)
        self._lock = threading.RLock()
        self._loop: LoopThread | None = None
        self.zmq_context: zmq.asyncio.Context | None = None
        self.links: list[DaemonLink] = []
        self.streams: list[DeviceStream] = []
        self.local_daemon: LocalDaemon | None = None
        self._reconnect_to: tuple | None = None  # (endpoints, keys) a failed reconnect still means (see _reconnect)
        self._started = False
        self.current_device = 0
        self._atexit_registered = False
        self._unreachable_since = -math.inf  # when device_count last found no daemon (monotonic clock)
        self.on_start: list = []  # callbacks run after each (re)connection, e.g. to replay a seed
        self.warm_ups: list = []  # work for the wait while daemons start or connect (e.g. imports)
        self.host_pool = HostBufferPool(self.config.host_pool_bytes)  # receive buffers of bulk downloads
        self.curve = None  # security.ClientKeys when connections use CURVE
        self.inherited_endpoints: list[str] | None = None  # in a forked child: the daemons the parent used
        self.inherited_curve = None  # and the CURVE keys it used them with
        self._forked_away = False  # in a forked child, this is the parent's runtime: inert

    @property
    def loop(self) -> LoopThread:
        if self._loop is None:
            self._loop = LoopThread()
            self.zmq_context = zmq.asyncio.Context()
        return self._loop

    # ------------------------------------------------------------ connecting

    def init(self, urls: str | list[str] | None = None, client_key: str | None = None,
             server_key: str | None = None, curve=None) -> None:
        """Connect to the given daemons (comma-separated string or list); None: config or embedded.
        `curve`: CURVE keys already loaded (a reconnect's), in place of the key files."""
        with self._lock:
            if self._started:
                self.shutdown()
            if urls is None and self.inherited_endpoints:  # a forked child: the parent's daemons, keys too
                urls, curve = self.inherited_endpoints, curve or self.inherited_curve
            self.curve = curve or self._curve_keys(client_key, server_key)
            if urls is None:
                urls = self.config.server_url
            endpoints = _split(urls) if urls else []
            if not endpoints:
                self.local_daemon = LocalDaemon(threads=self.config.daemon_threads)
                endpoints = [self.local_daemon.start(self.config.connect_timeout, while_waiting=self._warm_up)]
            links = [DaemonLink(self, ep) for ep in endpoints]
            futures = [self.loop.submit(l.connect(self.config.connect_timeout, self.config.heartbeat)) for l in links]
            if self.local_daemon is None:
                # Meanwhile (an embedded daemon's start already did it), what PyTorch loads on the
                # first ops on a subclass tensor: paid here, not by the first remote op (a client
                # of a running daemon had its first `(x * i).sum().item()` take 0.5 s).
                self._warm_up()
            try:
                for f in futures:
                    f.result(self.config.connect_timeout + 5)
            except BaseException:
                for link in links:
                    self.loop.submit(link.close(say_bye=False))
                if self.local_daemon:
                    self.local_daemon.stop()
                    self.local_daemon = None
                raise
            self.links = links
            self.streams = []
            for link in links:
                for local_index in range(len(link.devices)):
                    self.streams.append(DeviceStream(
                        link, local_index, len(self.streams), self.config.batch_ops, self.config.batch_bytes,
                    ))
            self._started = True
            self._reconnect_to = None
            self.current_device = 0
            if not self._atexit_registered:
                atexit.register(self.shutdown)
                self._atexit_registered = True
            for callback in self.on_start:
                callback()
            log.info("genie connected to %s (%d devices); data paths: %s", ", ".join(endpoints), len(self.streams),
                     ", ".join(f"{link.endpoint} {link.transport_path()}" for link in links))

    def _warm_up(self) -> None:
        """Optional work while this process waits for daemons anyway; a failure only means the
        first ops do it themselves."""
        for fn in self.warm_ups:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log.debug("warm-up %s failed: %s", getattr(fn, "__name__", fn), e)

    def ensure_started(self) -> None:
        if not self._started:
            with self._lock:
                if not self._started:
                    endpoints, curve = self._reconnect_to or (None, None)
                    self.init(endpoints, curve=curve)

    def _curve_keys(self, client_key: str | None, server_key: str | None):
        from genie.transport import security

        client_key = client_key or self.config.curve_client_key
        server_key = server_key or self.config.curve_server_key
        if not client_key and not server_key:
            return None
        if not (client_key and server_key):
            raise GenieError("CURVE needs both a client key (.key_secret) and the daemon's public key (.key)")
        try:
            return security.client_keys(client_key, server_key)
        except (OSError, ValueError) as e:
            raise GenieError(f"CURVE keys: {e}") from None

    def _reconnect(self, wanted: "DaemonLink | None" = None) -> None:
        """A daemon was lost: connect again to the same endpoints (a fresh embedded daemon if that was
        the one). Tensors made before on a lost daemon keep pointing at its lost streams and raise
        when used; those on the daemons that were not lost stay (see _replace_lost_links)."""
        with self._lock:
            lost = [link for link in self.links if link.lost]
            if not lost:
                return
            endpoints = None if self.local_daemon is not None else [link.endpoint for link in self.links]
            # A daemon restarting after its GPU failed (see _error_from) is back in seconds: wait for it.
            deadline = time.monotonic() + (self.config.connect_timeout if any(l.restarting for l in lost) else 0)
            partial = endpoints is not None and len(lost) < len(self.links)
            # Work for a daemon that is there (`wanted`) goes on while a lost one is away, trying it
            # again at most every RECONNECT_RETRY_S (each try can take seconds).
            on_healthy = partial and wanted is not None and not wanted.lost
            if on_healthy and all(time.monotonic() < link.retry_at for link in lost):
                return
            log.warning("reconnecting after: %s", "; ".join(link.lost for link in lost))
            if partial:
                try:
                    if _retry_until(deadline, lambda: self._replace_lost_links(lost)):
                        return
                    # it came back with other devices: connect to all afresh, below
                except GenieConnectionError as e:
                    if not on_healthy:
                        raise
                    for link in lost:
                        link.retry_at = time.monotonic() + RECONNECT_RETRY_S
                    log.warning("%s; the other daemons carry on", e)
                    return
            curve = self.curve
            self.shutdown()
            # Until a connection is made again, to these, with these keys: a failed attempt must not
            # leave the next use to start an embedded daemon in their place (work meant for a GPU
            # node, on this CPU), nor to connect without the keys genie.init was given.
            self._reconnect_to = (endpoints, curve)
            _retry_until(deadline, lambda: self.init(endpoints, curve=curve))

    def _replace_lost_links(self, lost: list) -> bool:
        """Connect to the lost daemons again and put the new links and their streams in the lost
        ones' places (same device indices), leaving the other daemons' links, streams and tensors
        as they are: one GPU node failing costs only its own tensors. False, with nothing changed,
        when a daemon came back with another number of devices. Raises when one cannot be reached."""
        fresh = {id(old): DaemonLink(self, old.endpoint) for old in lost}
        futures = [self.loop.submit(link.connect(self.config.connect_timeout, self.config.heartbeat))
                   for link in fresh.values()]
        try:
            for f in futures:
                f.result(self.config.connect_timeout + 5)
        except BaseException:
            for link in fresh.values():
                self.loop.submit(link.close(say_bye=False))
            raise
        if any(len(fresh[id(old)].devices) != len(old.devices) for old in lost):
            for link in fresh.values():
                self.loop.submit(link.close(say_bye=True))
            return False
        for old in lost:
            self.loop.submit(old.close(say_bye=False))
        self.links = [fresh.get(id(link), link) for link in self.links]
        self.streams = [DeviceStream(fresh[id(s.link)], s.local_index, s.global_index, self.config.batch_ops,
                                     self.config.batch_bytes) if id(s.link) in fresh else s for s in self.streams]
        # No on_start callbacks: the device count is the same, and the seed they send would restart
        # the random streams of the daemons that were not lost.
        log.info("genie reconnected to %s", ", ".join(link.endpoint for link in fresh.values()))
        return True

    @property
    def started(self) -> bool:
        return self._started

    def stream(self, index: int | None) -> DeviceStream:
        self.ensure_started()
        if index is None:
            index = self.current_device
        if any(link.lost for link in self.links):
            self._reconnect(self.streams[index].link if 0 <= index < len(self.streams) else None)
        if not 0 <= index < len(self.streams):
            raise GenieError(
                f"remote_accelerator:{index} does not exist: {len(self.streams)} remote device(s) connected"
            )
        return self.streams[index]

    def device_count(self) -> int:
        # device_count never throws, like torch.cuda.device_count; and after a failed connect it
        # answers 0 at once for a while, so that `is_available()` checks do not each wait it out.
        if not self._started and time.monotonic() - self._unreachable_since < self.config.connect_timeout:
            return 0
        try:
            self.ensure_started()
        except Exception as e:
            log.warning("no remote devices reachable: %s", e)
            self._unreachable_since = time.monotonic()
            return 0
        return len(self.streams)

    # ------------------------------------------------------------ stats and teardown

    def transport_stats(self) -> dict[str, dict]:
        stats = {}
        for link in self.links:
            ch = link.channel
            lane = link.bulk_lane
            bulk_sent = lane.bytes_sent if lane else 0
            bulk_received = lane.bytes_received if lane else 0
            stats[link.endpoint] = {
                "bytes_sent": ch.bytes_sent + bulk_sent, "bytes_received": ch.bytes_received + bulk_received,
                "bulk_bytes_sent": bulk_sent, "bulk_bytes_received": bulk_received,
                "messages_sent": ch.messages_sent, "blocking_waits": link.blocking_waits,
                "latency_s": link.measured_rtt_s,
                "bandwidth_Bps": link.bandwidth,
            }
        return stats

    def transport_info(self) -> dict:
        """The data path to each daemon, and what this process could use."""
        from genie.transport.paths import local_capabilities

        self.ensure_started()
        links = {}
        for link in self.links:
            lane = link.bulk_lane
            links[link.endpoint] = {
                "path": link.transport_path(),
                "cuda_ipc": ("CUDA tensors of this process go by CUDA IPC handle (same host)"
                             if link.cuda_ipc_offer else "no: CUDA tensors travel as bytes"),
                "bulk_min_bytes": link.bulk_min_bytes if lane is not None else None,
                "gpu_memory_over_ucx": link.ucx_gpu_memory,
                "direct_lane": link.channel is not None and link.channel.direct_stream is not None,
                "encrypted": self.curve is not None,
            }
        return {"links": links, "local": local_capabilities(self.config.ucx)}

    def shutdown(self) -> None:
        if self._forked_away:  # the parent's runtime, seen from a forked child (e.g. at its exit): not ours to close
            return
        with self._lock:
            self._reconnect_to = None  # disconnecting on purpose: the next use connects as at first
            if self._started and self._loop is not None:
                for stream in self.streams:
                    try:
                        stream.flush()
                    except Exception:
                        pass
                for link in self.links:
                    link.say_bye_behind_posted()
                closes = [self._loop.submit(link.close(say_bye=True)) for link in self.links]
                for f in closes:
                    try:
                        f.result(3.0)
                    except Exception:
                        pass
                for link in self.links:  # what a remote tensor from before says when used after
                    link.lost = link.lost or (
                        f"genie.shutdown() closed the connection to {link.endpoint}: remote tensors made before "
                        "it are gone with it (the daemon freed them); make them again")
            self.links, self.streams = [], []
            self._started = False
            if self.local_daemon is not None:
                self.local_daemon.stop()
                self.local_daemon = None

    def hand_over_after_fork(self) -> "Runtime":
        """In a forked child: a fresh runtime for this process, which connects on first use to the
        daemons this one used (the parent's embedded daemon included: it serves the child as
        another client), while this one, the parent's, goes inert: its links are marked lost with
        the reason, its loop thread and lane threads did not survive the fork, its sockets are the
        parent's, and its shutdown (at the child's exit) does nothing, so it neither talks on them
        nor stops the parent's embedded daemon."""
        fresh = Runtime()
        if self._started:
            fresh.inherited_endpoints = [link.endpoint for link in self.links]
            fresh.inherited_curve = self.curve
        fresh.on_start = list(self.on_start)
        fresh.warm_ups = list(self.warm_ups)
        reason = (f"this process (pid {os.getpid()}) was forked from pid {os.getppid()} after Genie connected: "
                  "remote tensors made before the fork belong to the parent's connection and cannot be used "
                  "here; make them again in this process (its remote devices use a connection of its own)")
        self._forked_away = True
        self._lock = threading.RLock()
        self.local_daemon = None
        for link in self.links:
            link.abandon(reason)
        for stream in self.streams:
            stream.abandon()
        return fresh


def _retry_until(deadline: float, attempt):
    """attempt()'s result, trying again every 0.2 s while it raises GenieConnectionError until
    time.monotonic() passes `deadline` (then the error is raised)."""
    while True:
        try:
            return attempt()
        except GenieConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def to_genie_error(exc: BaseException, endpoint: str) -> BaseException:
    """Transport-level failures as the errors users catch."""
    if isinstance(exc, RemoteError):
        return remote_error(exc, endpoint)
    if isinstance(exc, ChannelClosed):
        return GenieConnectionError(f"connection to {endpoint} closed: {exc}")
    return exc


def _split(urls: str | list[str]) -> list[str]:
    if isinstance(urls, str):
        urls = urls.split(",")
    return [u.strip() for u in urls if u and u.strip()]


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime()
    return _runtime


def _after_fork_in_child() -> None:
    # Only the forking thread survives a fork: the runtime's loop and lane threads are gone and its
    # sockets are shared with the parent. Without this, a child's requests went out on the parent's
    # sockets, and both processes read each other's answers (seen: a direct-lane message of
    # 16,830,099 frames, and a child that never got its answer).
    global _runtime, _runtime_lock
    _runtime_lock = threading.Lock()
    if _runtime is not None:
        _runtime = _runtime.hand_over_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
