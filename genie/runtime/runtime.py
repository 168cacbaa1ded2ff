"""The registry of daemons and devices, and the process-wide runtime.

Device indices enumerate the devices of each connected daemon, daemon by daemon,
in the order their endpoints were given. With no endpoint configured, the first
use starts an embedded local daemon.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time

import zmq.asyncio

from genie import config as config_module
from genie.errors import GenieConnectionError, GenieError
from genie.transport import interrupts
from genie.transport.hostmem import HostBufferPool

from .embedded import LocalDaemon
from .link import DaemonLink
from .loop import LoopThread
from .stream import DeviceStream

log = logging.getLogger("genie.runtime")


RECONNECT_RETRY_S = 5.0  # how often work on the other daemons tries a lost one again (see _reconnect)


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
            if urls is None and self.inherited_endpoints and client_key is None and server_key is None:
                # A forked child: the parent's daemons, with the parent's keys or none (its embedded
                # daemon takes none: the environment's keys, read again here, failed the handshake).
                urls, self.curve = self.inherited_endpoints, curve or self.inherited_curve
            else:
                self.curve = curve or self._curve_keys(client_key, server_key)
            if urls is None:
                urls = self.config.server_url
            endpoints = _split(urls) if urls else []
            if not endpoints:
                if self.curve is not None:
                    # Keys name daemons on a network (GENIE_SERVER_URL); this one is private to the
                    # process (an ipc path in a folder only this user reads). With them, a client
                    # configured for its cluster failed its first op here: "the CURVE handshake failed".
                    log.info("starting an embedded genie-daemon: CURVE keys are for daemons named by "
                             "GENIE_SERVER_URL or genie.init, and are not used for it")
                    self.curve = None
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
                "bulk_lanes": 0 if lane is None or lane.closed else len(getattr(lane, "lanes", (lane,))),
                "gpu_memory_over_ucx": link.ucx_gpu_memory,
                "direct_lane": link.channel is not None and link.channel.direct_stream is not None,
                "local_lane": link.local_lane,
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
        interrupts.stand_down()  # Python's own SIGINT handler again (genie/transport/interrupts.py)

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


def started_runtime() -> Runtime | None:
    """The runtime if one exists and is connected; None otherwise. Never starts one (callers that
    only look for remote tensors or queued ops: without a runtime there are none)."""
    rt = _runtime
    return rt if rt is not None and rt.started else None


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
