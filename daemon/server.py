"""The daemon's server loop: a ZeroMQ ROUTER socket drained by an asyncio reader callback.

`exec`, `stats` and `bye` go, in arrival order, to one worker thread that owns all
tensors (so each client's ops run in program order), and their replies are sent when
that work is done; a small request a client is blocked on (or a small copy to or from a
peer daemon) runs at once on the loop when the worker is idle. A request that needs a peer's
tensor or bulk-lane bytes not yet arrived is parked (with that client's later requests)
until they come, so it never holds up other clients. `hello`, `ping` and `event` are
answered at once. Any malformed message gets an error reply; nothing a client sends can
stop the loop.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import ipaddress
import logging
import os
import socket
import time

import torch
import zmq
import zmq.asyncio

from genie.transport import bulk, cuda_ipc, protocol, sealed_lane, ucx_lane
from genie.transport.busy_poll import BusyPoll
from genie.transport.errors import ProtocolError
from genie.transport.protocol import BulkTensor, HandleRef


from . import device_faults
from .bulk_server import BulkListener
from .direct_lanes import DIRECT_SUFFIX, DirectLane, DirectLanes, client_key, max_frame_bytes
from .executor import Executor, RemoteOpError
from .handles import ClientState, MemoryAccount
from .hardware import describe_device, host_ram
from .kv_store import KVDisk, KVStore
from .memory_queries import MemoryQueries
from .peers import LaneDeposit, Mailbox, PeerLinks, check_transfer_id

log = logging.getLogger("genie.daemon")


class DaemonServer(DirectLanes, MemoryQueries):
    def __init__(self, endpoint: str, devices: list[torch.device], client_lease_s: float = 60.0,
                 memory_limit: int = 0, bulk_lanes: bool = True, curve=None, transfer_timeout: float = 120.0,
                 kv_dir: str | None = None, spin_s: float = 0.0, cuda_ipc_allowed: bool = True,
                 shared_memory: bool = True, ucx: str = "auto", lane_port: int = 0, peer_lanes: int = 0,
                 local_lane: bool = True) -> None:
        self.endpoint = endpoint
        self.peer_lanes = peer_lanes  # bulk lanes to each peer daemon (0: lane_set.lanes_wanted's default)
        self.lane_port = lane_port  # the lanes' TCP listener (0: any free port)
        self.ucx_mode = ucx  # the UCX lane (ucx_lane.wanted): auto, on, off
        self.ucx: ucx_lane.UcxListener | None = None
        self.ucx_gpu_memory = "no: no UCX lane"  # whether its lanes move GPU memory, in words (check_device_memory)
        self.cuda_ipc_allowed = cuda_ipc_allowed
        self.shared_memory = shared_memory  # shared-memory segments on ipc:// bulk lanes
        self.local_lane = local_lane  # a tcp daemon's local lane listener, for clients on this host
        self.ipc_offer: dict | None = None  # hello's cuda_ipc: set once bound, where handles are accepted
        self._busy_poll = BusyPoll(spin_s)  # an idle daemon polls for the next request before sleeping
        self.curve = curve  # ServerKeys: CURVE on, only allow-listed clients; None: plaintext, open
        # Under CURVE only sealed lanes (bulk and direct; no shared memory or UCX: plaintext), which
        # need the `cryptography` package; without it everything goes over ZeroMQ.
        self.bulk_lanes = bulk_lanes and (curve is None or sealed_lane.available())
        self._authenticator = None
        self.bulk: BulkListener | None = None
        self.devices = devices
        self.client_lease_s = client_lease_s
        self.memory_limit = memory_limit
        self.account = MemoryAccount()
        self.transfer_timeout = transfer_timeout  # how long a request may wait for its peer or bulk bytes
        self.mailbox = Mailbox(ttl_s=2 * transfer_timeout, max_bytes=memory_limit)
        self.peers: PeerLinks | None = None
        self.kv_store = KVStore(self.account, KVDisk(kv_dir) if kv_dir else None, devices)
        # The server waits for transfers before a request reaches the executor (see `_park`), so the
        # executor never waits: what has not arrived by then never will.
        self.executor = Executor(devices, self.account, memory_limit, kv_store=self.kv_store, mailbox=self.mailbox,
                                 send_to_peer=lambda *a: self.peers.send(*a), transfer_timeout=0.0)
        self.clients: dict[bytes, ClientState] = {}
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="genie-exec")
        self._ctx = zmq.asyncio.Context()
        # The ROUTER is a plain socket driven by the loop's reader callback (see `_on_readable`):
        # measured here, ~25 us less per request than awaiting an asyncio socket.
        self._sync_ctx = zmq.Context.shadow(self._ctx.underlying)
        self._socket: zmq.Socket | None = None
        self._socket_file: tuple[str, int] | None = None  # an ipc:// socket's path and inode, removed at stop
        self._direct: dict[bytes, DirectLane] = {}  # identity -> a client's direct-lane connection
        self._drain_scheduled = False
        self._stopping = asyncio.Event()
        self.device_lost: device_faults.DeviceLost | None = None  # set: stop, and cli restarts the process
        # After such a restart: the clients whose tensors the lost context took (until they say
        # hello again), and the op that met the loss. Their requests are answered with the loss.
        self.lost_clients, self._lost_op = device_faults.take_restart_notice()
        self.bound_endpoint: str | None = None
        self._pending = 0  # requests handed to the worker and not yet answered
        self._parked: dict[bytes, collections.deque] = {}  # client key -> requests waiting, in order
        self._loop: asyncio.AbstractEventLoop | None = None
        # Ops with parallel regions run on one thread only, the worker: with several torch threads,
        # OpenMP teams started from two threads slow each other's ops down ~15x (measured here: a
        # 1x128 @ 128x512 linear on the worker, 5.6 us; after one matmul on the loop thread, 83 us).
        # So the calibration matmul runs there too, and requests run inline (on the loop thread)
        # only when torch uses a single thread, which starts no team, or on GPUs, whose ops start
        # none on the host. A CPU daemon with 2 threads here: batch-32 CNN 1,740 -> 3,057 images/s.
        self.device_info = self._worker.submit(lambda: [describe_device(d) for d in devices]).result()
        self.inline_ok = torch.get_num_threads() == 1 or all(d.type == "cuda" for d in devices)
        self.process_cap: int | None = None  # bytes the process may map (memory_guard), reported in stats

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> str:
        sock = self._sync_ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self._start_authenticator()
            self.curve.apply(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A frame bigger than any valid one (header or payload chunk) drops that peer, unallocated.
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes())
        sock.bind(self.endpoint)
        self._socket = sock
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket_file = _ipc_socket_file(self.bound_endpoint)
        if self.bulk_lanes:
            self._open_lanes()
        if self.cuda_ipc_allowed and self.executor.has_cuda:
            local_lane = self.bulk is not None and self.bulk.local_offer is not None
            self.ipc_offer = cuda_ipc.offer(self.bound_endpoint, local_lane)
            self.executor.cuda_ipc_with = self._takes_cuda_ipc
            log.info("CUDA IPC from clients on this host: %s", "off (the daemon listens beyond this host and has "
                     "no local lane)" if self.ipc_offer is None else "accepted from those on its local lane"
                     if self.ipc_offer.get("local_lane") else "accepted")
        return self.bound_endpoint

    def _start_authenticator(self) -> None:
        """ZAP handler: the CURVE handshake succeeds only for public keys in the allow directory."""
        from zmq.auth.thread import ThreadAuthenticator

        sync_context = zmq.Context.shadow(self._ctx.underlying)  # same context: ZAP is per context
        self._authenticator = ThreadAuthenticator(sync_context, log=logging.getLogger("genie.daemon.auth"))
        self._authenticator.start()
        self._authenticator.configure_curve(domain="*", location=self.curve.allow_dir)
        log.info("CURVE on: accepting the public keys in %s", self.curve.allow_dir)

    def _open_lanes(self) -> None:
        total = host_ram()[0] or (1 << 40)
        try:
            sealed = self.curve is not None
            self.bulk = BulkListener(self.bound_endpoint, lambda token: token in self.clients,
                                     max_transfer=self.memory_limit or total,
                                     shared_memory=self.shared_memory, tcp_port=self.lane_port,
                                     local_lane=self.local_lane,
                                     lane_key_of=self._lane_key_of if sealed else None)
        except OSError as e:
            if self.lane_port:  # asked for by the operator (a firewall's open port): not quietly another
                raise OSError(f"cannot listen for lanes on port {self.lane_port}: {e}") from None
            log.warning("no bulk lane (large payloads go over ZeroMQ): %s", e)
            return
        self.executor.bulk = self.bulk
        self.bulk.on_arrival = self._wake_threadsafe
        log.info("bulk lane listening: %s%s", " ".join(map(str, self.bulk.advertised)), " (sealed)" if sealed else "")
        self.bulk.on_direct = self._direct_threadsafe
        if sealed:
            return
        use, why = ucx_lane.wanted(self.ucx_mode)
        if not use:
            log.info("no UCX lane: %s", why)
            return
        gpus = {i: d for i, d in enumerate(self.executor.devices) if d.type == "cuda"}
        try:
            landing, self.ucx_gpu_memory = ucx_lane.check_device_memory(gpus)
            self.ucx = ucx_lane.UcxListener(lambda token: token in self.clients, self.bulk.add_lane,
                                            self.bulk.pool, self.bulk.max_transfer, landing_devices=landing)
        except Exception as e:  # noqa: BLE001 - UCX could not start here: the socket lane serves everyone
            log.warning("no UCX lane (%s): %s", why, e)
            return
        log.info("UCX lane listening on port %d: %s; GPU memory over UCX: %s", self.ucx.port, why, self.ucx_gpu_memory)

    def _takes_cuda_ipc(self, token: bytes) -> bool:
        """Whether CUDA IPC handles may go between this daemon and client `token`: offered at all,
        and where the daemon listens beyond this host, the client's lanes came to the local
        listener from this daemon's user (which a remote peer cannot fake)."""
        if self.ipc_offer is None:
            return False
        return not self.ipc_offer.get("local_lane") or (self.bulk is not None and token in self.bulk.local_users)

    def _lane_key_of(self, token: bytes) -> bytes | None:
        """(A greeting thread.) The lane key hello gave this client, if it is connected."""
        client = self.clients.get(token)
        return None if client is None else client.lane_key

    def stop(self) -> None:
        self._stopping.set()

    async def serve(self) -> None:
        if self._socket is None:
            self.bind()
        peer_keys = self.curve.as_client_of(self.curve.public) if self.curve is not None else None
        self._loop = asyncio.get_running_loop()
        self.peers = PeerLinks(self._ctx, self._loop, curve=peer_keys, quiet_s=self.client_lease_s / 2,
                                lanes=self.peer_lanes, shared_memory=self.shared_memory)
        sweeper = asyncio.create_task(self._sweep_idle_clients())
        fd = self._socket.getsockopt(zmq.FD)
        self._loop.add_reader(fd, self._on_readable)
        self._on_readable()  # the descriptor is edge-triggered: take what is already queued
        await self._stopping.wait()
        self._loop.remove_reader(fd)
        sweeper.cancel()
        # Drain: work already handed to the worker finishes and is answered; parked work is refused.
        for queue in self._parked.values():
            for _, _, identity, rid, _, _ in queue:
                self._reply_error(identity, rid, ConnectionAbortedError("genie-daemon is shutting down"))
        self._parked.clear()
        await asyncio.get_running_loop().run_in_executor(None, self._worker.shutdown, True)
        await asyncio.sleep(0)  # the last replies' callbacks
        for lane in list(self._direct.values()):
            try:
                lane.sock.setblocking(True)
                lane.sock.settimeout(DRAIN_LINGER_MS / 1000)
                lane.writer.flush()  # answers still queued, as the ROUTER's linger does below
            except (ConnectionError, OSError):
                pass
            self._close_direct(lane, "daemon stopping")
        self.peers.close()
        if self.ucx is not None:
            self.ucx.close()
        if self.bulk is not None:
            self.bulk.close()
        self._socket.close(linger=DRAIN_LINGER_MS)  # let queued replies reach their clients
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()
        _remove_socket_file(self._socket_file)
        log.info("daemon stopped")

    # ------------------------------------------------------------ receive

    def _on_readable(self) -> None:
        """Take queued requests, a few at a time so replies and peer sends are not starved."""
        self._drain_scheduled = False
        sock = self._socket
        for _ in range(DRAIN_BATCH):
            try:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN and not self._spin(sock):
                    return
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                log.warning("receive failed: %s", e)
                return
            self._handle_safely(parts)
        self._schedule_drain()

    def _handle_safely(self, parts: list) -> None:
        try:
            self._handle(parts)
        except device_faults.DeviceLost as e:
            if len(parts) >= 2:
                self._reply_error(parts[0].bytes, 0, e)
        except Exception as e:  # a bug here must not stop the daemon, and the client still gets an answer
            log.exception("unexpected error handling a message")
            if len(parts) >= 2:
                self._reply_error(parts[0].bytes, 0, RuntimeError(f"genie-daemon internal error: {e!r}"))

    def _spin(self, sock) -> bool:
        """Poll for the next request for up to `spin_s` when nothing else is running; True if
        one came. A client waiting on a reply usually sends again within a few hundred
        microseconds, and a core that went idle in between (a halted vCPU) takes longer than that
        to wake: measured here, (x+1).item() 200-311 -> 147-177 us, a replayed decode step
        1.14-1.21 -> 0.90-0.98 ms. Only while the worker is idle and no request is parked on a
        transfer, and only with one client: with several, and their processes on the same cores,
        polling took CPU they needed (4 clients: 642-656 -> 520-577 requests/s). The bulk lanes'
        sockets are polled too, and bytes arriving there end the spin: the lane thread needs the
        GIL this loop would keep taking back (a 4 MiB upload's receive started 0.59 ms late);
        for the same reason there is no spin within BULK_QUIET_S of a payload through a lane's socket
        (payloads in shared memory do not count). SPIN_MISSES
        spins in a row that see nothing switch it off for SPIN_BACKOFF_S (genie.transport.busy_poll): a client on these cores
        can be the one kept waiting (4 KiB upload + sync: 0.55 ms without polling, 1.4 ms with,
        each spin running out just before the client's next request came)."""
        if not self._busy_poll.available() or self._pending or self._programs_served() != 1 \
                or any(self._parked.values()) or self.peers is not None and self.peers.sending():
            return False
        if any(lane.writer.pending for lane in self._direct.values()):
            return False  # the rest of an answer goes when its socket is writable: this loop's job
        if self.bulk is not None and time.monotonic() - self.bulk.last_transfer < BULK_QUIET_S:
            return False
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        for lane_socket in self.bulk.lane_sockets() if self.bulk is not None else ():
            poller.register(lane_socket, zmq.POLLIN)
        direct = {lane.sock: lane for lane in self._direct.values()}
        for direct_socket in direct:
            poller.register(direct_socket, zmq.POLLIN)
        ready = self._busy_poll.run(lambda: poller.poll(0))
        for s, _ in ready or ():
            if s in direct:  # its reader runs next, not nested in this one
                self._loop.call_soon(self._on_direct_readable, direct[s])
        return any(s is sock for s, _ in ready or ())

    def _programs_served(self) -> int:
        """Clients that count against polling: all but peer daemons on other hosts, which deposit
        tensors and take no CPU here (a daemon that received one copy from such a peer stopped
        polling for its own client's requests: its round trips went from 0.13 to 0.20-0.21 ms
        for as long as that peer stayed). A peer on this host does count: its process runs on
        these cores (a copy and a read of it polling on both: 0.77-0.81 against 0.68-0.70 ms)."""
        count = len(self.clients)
        if count > 1:
            count -= sum(client.peer == "elsewhere" for client in self.clients.values())
        return count

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _handle(self, parts: list) -> None:
        if len(parts) < 2:
            return  # no identity + header: nothing to answer
        identity = parts[0].bytes
        header_raw, payload = parts[1], parts[2:]
        header = None
        try:
            if len(payload) > protocol.MAX_FRAMES:
                raise ProtocolError(f"{len(payload)} frames exceed the limit of {protocol.MAX_FRAMES}")
            bulk_refs: list = []
            header = protocol.unpack_header(header_raw.buffer, bulk_refs)
            request = protocol.parse_request(header)
        except ProtocolError as e:
            self._reply_error(identity, protocol.request_id_of(header), e)
            return
        if self.device_lost is not None:  # stopping to restart: nothing more runs in the lost context
            self._reply_error(identity, request.request_id, self.device_lost)
            return
        key = client_key(identity)
        client = self.clients.get(key)
        if client is None and key in self.lost_clients:
            if request.kind == "hello":
                del self.lost_clients[key]  # it knows: a new start
            elif request.kind in ("exec", "event", "stats", "empty_cache", "reset_peak"):
                # A request sent before its client learnt of the loss (its connection came back by
                # itself): it gets the loss, not "handle ... does not exist".
                self._send(identity, [request.request_id, False, {
                    "type": protocol.DEVICE_LOST_ERROR, "op": self._lost_op,
                    "message": f"{self.lost_clients[key]} (this request reached the restarted daemon)"}], [])
                return
        if client is None:
            client = self.clients[key] = ClientState(key, self.account)
            log.info("client %s connected", key.hex())
        client.last_seen = time.monotonic()
        rid = request.request_id
        if request.kind == "ping":
            self._reply(identity, rid, {})
        elif request.kind == "event":
            try:
                self._reply(identity, rid, self._event(client, request.body))
            except ProtocolError as e:
                self._reply_error(identity, rid, e)
        elif request.kind == "deposit":
            if client.peer is None:
                lane = self._direct.get(identity)  # (a peer's direct lane, or None: ZeroMQ)
                client.peer = "elsewhere" if _from_another_host(lane.sock if lane is not None else header_raw) else "here"
            try:
                self._deposit(key, request.body, payload)
            except ProtocolError as e:
                self._reply_error(identity, rid, e)
                return
            if self._parked:  # first: a client waits on these, the peer only drains its answer
                self._release_parked()
            self._reply(identity, rid, {})
        elif request.kind == "probe":
            # Bandwidth probe: the client times sending these frames and getting this answer.
            self._reply(identity, rid, {"bytes": sum(len(p) for p in payload)})
        elif request.kind == "hello":
            theirs = request.body.get("version")
            if theirs != protocol.VERSION:
                self._reply_error(identity, rid, ProtocolError(
                    f"this genie-daemon speaks protocol version {protocol.VERSION} and the client "
                    f"{'sent none' if theirs is None else f'speaks {theirs!r}'}: install the same Genie version on both"))
                return
            heartbeat = request.body.get("heartbeat")
            if heartbeat is not None:
                if type(heartbeat) not in (int, float) or not 0 <= heartbeat <= protocol.MAX_HEARTBEAT_S:
                    self._reply_error(identity, rid, ProtocolError(
                        f"hello's heartbeat must be a number of seconds from 0 to {protocol.MAX_HEARTBEAT_S}"))
                    return
                client.heartbeat_s = float(heartbeat)
            hello = {"version": protocol.VERSION, "devices": self.device_info}
            if self.bulk is not None:
                hello["bulk"] = self.bulk.advertised
                if self.bulk.local_offer is not None:
                    hello["local_lane"] = self.bulk.local_offer
                if self.curve is not None:  # sent encrypted by CURVE; a new one at each hello
                    client.lane_key = hello["lane_key"] = sealed_lane.new_lane_key()
            if self.ucx is not None:
                hello["ucx"] = self.ucx.port
                hello["ucx_devices"] = sorted(self.ucx.landing_devices)  # uploads for these land in GPU memory
                hello["ucx_gpu_memory"] = self.ucx_gpu_memory
            if self.ipc_offer is not None:
                hello["cuda_ipc"] = self.ipc_offer
            self._reply(identity, rid, hello)
        elif request.kind == "exec":
            try:
                parsed = protocol.parse_exec(request.body)
                shared = tuple(m for m in bulk_refs if type(m) is cuda_ipc.SharedCudaTensor)
                if shared:
                    if not self._takes_cuda_ipc(key):
                        raise ProtocolError("this daemon takes no CUDA IPC handles from this client (it has no "
                                            "GPU, or --no-cuda-ipc, or it listens beyond this host and the client's "
                                            "lanes did not come to its local listener): send the tensor's bytes")
                    parsed = dataclasses.replace(parsed, shared=shared)
                if parsed.segments:
                    if self.bulk is None:
                        raise ProtocolError("this daemon has no bulk lanes")
                    self.bulk.accept_named(key, parsed.segments)
            except ProtocolError as e:
                self._reply_error(identity, rid, e)
                return
            waits = _transfers_awaited(parsed, bulk_refs)
            if self.bulk is not None:
                self.bulk.spoken_for(key, [ident for kind, ident in waits if kind == "bulk"])
            if key in self._parked or (waits and not self._transfers_ready(key, waits)):
                self._park(key, waits, identity, rid, self.executor.run, client, parsed, payload)
                return
            self._run_exec(identity, rid, client, parsed, payload)
        elif request.kind == "stats":
            self._submit_in_order(key, identity, rid, self._stats, request.body)
        elif request.kind == "empty_cache":
            self._submit_in_order(key, identity, rid, self._empty_cache)
        elif request.kind == "reset_peak":
            self._submit_in_order(key, identity, rid, self._reset_peak)
        elif request.kind == "bye":
            # The client's direct lane stays open for this answer (the client closes it after
            # reading): closed here first, the client met the end of the stream where the answer was due.
            self._submit_in_order(key, identity, rid, self._drop_client, key, False)

    def _run_exec(self, identity: bytes, rid: int, client: ClientState, parsed, payload: list) -> None:
        """Run an exec whose transfers are in: here when that is quicker, else on the worker."""
        if (self._pending == 0 and _small(parsed, bulk_ok=not self.executor.has_cuda)
                and sum(len(p) for p in payload) <= INLINE_MAX_BYTES and self._peer_copies_small(client, parsed)
                and (self.inline_ok and self.executor.quick_to_start(client, parsed)
                     or self.executor.moves_memory_only(client, parsed))):
            # Nothing is queued for the worker: running a small request here keeps program
            # order and saves two thread hops on the round trip a blocking read waits for.
            downloads: list = []
            try:
                result = self.executor.run(client, parsed, payload, later=downloads)
            except (Exception, device_faults.DeviceLost) as e:  # noqa: BLE001 - reported like any failure
                self._answer_failure(identity, rid, e)
            else:
                self._reply(identity, rid, *result)
            if downloads:
                self._send_downloads(identity, downloads)
            return
        self._submit_exec(identity, rid, client, parsed, payload)

    def _peer_copies_small(self, client: ClientState, request) -> bool:
        """Whether the request's copies between daemons may run on the loop: each tensor it sends
        (genie::send) that is held already at most INLINE_MAX_BYTES (a larger one goes on to a lane
        thread anyway, after a copy that would hold up the loop; one the request makes is as large
        as quick_to_start allows its ops' work to be), each it receives (genie::recv) as small and
        in the mailbox, taken without waiting and put on a GPU quickly. (A request whose wait for
        one ran out comes here too, to fail on the worker.)"""
        for op in request.ops:
            if op.name == protocol.SEND_OP:
                found = client.tensors.get(op.args[0].id) if op.args and isinstance(op.args[0], HandleRef) else None
                if isinstance(found, torch.Tensor) and found.nbytes > INLINE_MAX_BYTES:
                    return False
            elif op.name == protocol.RECV_OP:
                nbytes = self.mailbox.ready_bytes(op.args[0]) if op.args and isinstance(op.args[0], str) else None
                if nbytes is None or nbytes > INLINE_MAX_BYTES:
                    return False
        return True

    def _send_downloads(self, identity: bytes, downloads: list) -> None:
        """The bulk downloads of a request run here, after its answer. The first starts on this
        thread, as far as its socket takes it now (up to FIRST_SEND_BYTES, never waiting): the
        client reads those bytes while the worker wakes to send the rest, instead of waiting for
        that hop before the first byte (4 MiB over tcp: +5-46% in six alternating runs against
        running the request on the worker and sending all from there). Pending until sent, so no
        later request runs meanwhile."""
        sends = list(downloads)
        try:
            sends[0] = sends[0].start(FIRST_SEND_BYTES)
        except ConnectionError as e:
            log.warning("bulk download to %s failed: %s", identity.hex(), e)
            sends.pop(0)
        self._pending += 1
        loop = self._loop

        def job() -> None:
            try:
                _send_all(identity, sends)
            finally:
                loop.call_soon_threadsafe(self._settle)

        self._worker.submit(job)

    # ------------------------------------------------------------ requests that wait for transfers

    def _submit_in_order(self, key: bytes, identity: bytes, rid: int, fn, *args) -> None:
        """Submit now, or behind this client's parked requests so its requests keep their order."""
        if key in self._parked:
            self._park(key, [], identity, rid, fn, *args)
        else:
            self._submit(identity, rid, fn, *args)

    def _park(self, key: bytes, waits: list, identity: bytes, rid: int, fn, *args) -> None:
        """Hold a request whose peer or bulk bytes have not arrived, off the executor thread.

        Waiting on the executor would stall every client behind one missing transfer; parked,
        only this client's later requests wait (behind it, to keep its program order).
        """
        queue = self._parked.setdefault(key, collections.deque())
        queue.append((time.monotonic() + self.transfer_timeout, waits, identity, rid, fn, args))
        if len(queue) == 1:
            self._loop.call_later(min(self.transfer_timeout, PARK_POLL_S), self._release_parked)

    def _transfers_ready(self, key: bytes, waits: list) -> bool:
        for kind, ident in waits:
            if kind == "recv" and not self.mailbox.has(ident):
                return False
            if kind == "bulk" and self.bulk is not None and not self.bulk.upload_ready(key, ident):
                return False
        return True

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None and self._parked:
            loop.call_soon_threadsafe(self._release_parked)

    def _release_parked(self) -> None:
        """Submit parked requests whose transfers are in (or whose wait ran out: they fail there)."""
        now = time.monotonic()
        for key, queue in list(self._parked.items()):
            while queue:
                deadline, waits, identity, rid, fn, args = queue[0]
                if now < deadline and waits and not self._transfers_ready(key, waits):
                    break
                queue.popleft()
                if fn == self.executor.run:
                    self._run_exec(identity, rid, *args)
                else:
                    self._submit(identity, rid, fn, *args)
            if not queue:
                del self._parked[key]
        if self._parked:
            soonest = min(q[0][0] for q in self._parked.values())
            self._loop.call_later(min(max(soonest - now, 0.0), PARK_POLL_S), self._release_parked)

    def _submit(self, identity: bytes, rid: int, fn, *args) -> None:
        self._pending += 1
        future = self._worker.submit(fn, *args)
        loop = asyncio.get_running_loop()
        future.add_done_callback(
            lambda f: loop.call_soon_threadsafe(self._finish, identity, rid, f)
        )

    def _submit_exec(self, identity: bytes, rid: int, client: ClientState, parsed, payload: list) -> None:
        """Run an exec on the worker. Its bulk-lane downloads go after its answer: the client
        reads the answer while the bytes stream in, rather than after them. The request counts
        as pending until they are sent, so nothing runs meanwhile (they read the tensors' memory)."""
        self._pending += 1
        loop = self._loop

        def job() -> None:
            downloads: list = []
            answer: concurrent.futures.Future = concurrent.futures.Future()
            try:
                try:
                    answer.set_result(self.executor.run(client, parsed, payload, later=downloads))
                except BaseException as e:  # noqa: BLE001 - reported to the client like any failure
                    answer.set_exception(e)
                loop.call_soon_threadsafe(self._answer, identity, rid, answer)
                _send_all(identity, downloads)
            finally:
                loop.call_soon_threadsafe(self._settle)

        self._worker.submit(job)

    def _settle(self) -> None:
        self._pending -= 1

    def _finish(self, identity: bytes, rid: int, future: concurrent.futures.Future) -> None:
        self._pending -= 1
        self._answer(identity, rid, future)

    def _answer(self, identity: bytes, rid: int, future: concurrent.futures.Future) -> None:
        try:
            result = future.result()
        except (Exception, device_faults.DeviceLost) as e:
            self._answer_failure(identity, rid, e)
            return
        body, frames = result if isinstance(result, tuple) else (result, [])
        self._reply(identity, rid, body, frames)

    def _answer_failure(self, identity: bytes, rid: int, e: Exception) -> None:
        if isinstance(e, RemoteOpError):
            self._send(identity, [rid, False, e.poison.describe()], [])
            return
        if not isinstance(e, (ProtocolError, KeyError)):
            log.exception("request %d failed", rid, exc_info=e)
        self._reply_error(identity, rid, e)

    @staticmethod
    def _event(client: ClientState, body: dict) -> dict:
        """Event queries are answered at once, without waiting behind queued work."""
        if "query" in body:
            ids = body["query"]
            if not isinstance(ids, list) or not all(type(i) is int for i in ids):
                raise ProtocolError("query takes a list of event ids")
            return {"done": [client.streams.query(i) for i in ids]}
        pair = body.get("elapsed")
        if not isinstance(pair, list) or len(pair) != 2 or not all(type(i) is int for i in pair):
            raise ProtocolError("elapsed takes [start event id, end event id]")
        return {"ms": client.streams.elapsed_ms(*pair)}

    def _deposit(self, key: bytes, body: dict, payload: list) -> None:
        """A peer daemon's tensor for a transfer: in the message's frames, or (`xfer`) on the lane
        the peer opened as a client of ours, or (`segment`) in one of the peer's shared segments
        that lane mapped here (see peers.PeerLinks)."""
        from genie.transport.tensors import (bytes_as_tensor, check_shape, check_strides, frames_to_tensor, laid_out,
                                             parse_dtype)

        tid, dtype, shape = check_transfer_id(body.get("tid")), parse_dtype(body.get("dtype")), check_shape(body.get("shape"))
        # With strides, the bytes are the tensor's elements in its own memory order (channels-last, ...).
        strides = body.get("strides")
        xfer = body.get("xfer")
        if xfer is not None:
            if type(xfer) is not int or payload:
                raise ProtocolError("a deposit names a lane transfer (an int) or carries frames, not both")
            lane = self.bulk.lane(key) if self.bulk is not None else None
            if lane is None:
                raise ProtocolError("a deposit names a lane transfer, and this peer has no lane open")
            # Checked now, so that a bad deposit is refused at once rather than when it is claimed.
            checked = None if strides is None else check_strides(strides, shape)
            lane.arrivals.spoken_for([xfer])  # the mailbox's ttl governs it from here
            self.mailbox.put(tid, LaneDeposit(lane, xfer, dtype, shape, checked))
            return
        where = body.get("segment")
        if where is not None:  # copied into one of the peer's shared segments this daemon mapped
            lane = self.bulk.lane(key) if self.bulk is not None else None
            if payload or not bulk.is_segment_name(where) or lane is None or not lane.shared:
                raise ProtocolError("a deposit names [segment, bytes] of the peer's shared lane, and carries no frames")
            raw = lane.take_named(*where)
            self.mailbox.put(tid, laid_out(bytes_as_tensor(raw, dtype, shape, f"segment {where[0]}"), strides))
            return
        if not payload:
            raise ProtocolError("a deposit carries the tensor's frames")
        self.mailbox.put(tid, laid_out(frames_to_tensor([p.buffer for p in payload], dtype, shape), strides))

    def _drop_client(self, identity: bytes, close_direct_lane: bool = True) -> dict:
        client = self.clients.pop(identity, None)
        if client is not None:
            client.free_all()
            log.info("client %s left", identity.hex())
        if self.bulk is not None:
            self.bulk.drop(identity)
        if close_direct_lane and self._loop is not None:
            self._loop.call_soon_threadsafe(self._drop_direct, identity + DIRECT_SUFFIX)
        return {}

    async def _sweep_idle_clients(self) -> None:
        while True:
            await asyncio.sleep(max(min(self.client_lease_s / 4, self.mailbox.ttl_s / 4, SWEEP_S), 0.05))
            self.mailbox.expire()
            if self.bulk is not None:  # as long as a peer's deposit is kept (Mailbox ttl)
                self.bulk.expire_unclaimed(self.mailbox.ttl_s)
            now = time.monotonic()
            for identity, client in list(self.clients.items()):
                if identity in self._parked:
                    continue
                if now - client.last_seen > self.client_lease_s:
                    log.info("client %s lease expired; freeing its memory", identity.hex())
                    self._worker.submit(self._drop_client, identity)
                elif self._gone(client, now):
                    log.info("client %s closed its connection and has been silent for %.1fs; freeing its memory",
                             identity.hex(), now - client.last_seen)
                    self._worker.submit(self._drop_client, identity)

    @staticmethod
    def _gone(client: ClientState, now: float) -> bool:
        """A client that ended without a goodbye (killed, crashed): its direct lane closed, and no
        message came since, not even the pings it promised at hello. Its memory (a GPU's, on a GPU
        node) goes back within seconds, as a CUDA process's does when it dies, rather than after
        the lease. A live client whose lane failed goes on over ZeroMQ, pinging: it stays."""
        if client.lane_closed_at is None or not client.heartbeat_s or client.last_seen > client.lane_closed_at:
            return False
        return now - client.last_seen > max(GONE_AFTER_PINGS * client.heartbeat_s, GONE_MIN_S)

    # ------------------------------------------------------------ send

    def _reply(self, identity: bytes, rid: int, body: dict, frames: list | None = None) -> None:
        self._send(identity, [rid, True, body], frames or [])

    def _reply_error(self, identity: bytes, rid: int, exc: BaseException) -> None:
        if not isinstance(exc, device_faults.DeviceLost) and self.executor.has_cuda \
                and device_faults.context_lost(exc, self.executor.devices):
            exc = device_faults.DeviceLost(None, exc)  # e.g. a download met an earlier kernel's assert
        op = exc.op if isinstance(exc, device_faults.DeviceLost) else None
        self._send(identity, [rid, False, protocol.error_body(exc, op)], [])
        if isinstance(exc, device_faults.DeviceLost) and self.device_lost is None:
            log.error("%s", exc)
            self.device_lost = exc
            self.executor.device_lost = self.executor.device_lost or exc  # what is queued on the worker too
            self.stop()

    def restart_notice(self) -> str:
        """For the process that restarts after self.device_lost: whose tensors went, and why."""
        return device_faults.restart_notice(self.device_lost, set(self.clients) | set(self.lost_clients))

    def _send(self, identity: bytes, header: list, frames: list) -> None:
        lane = self._direct.get(identity)
        if lane is not None:
            self._send_direct(lane, [protocol.pack(header), *frames])
            return
        parts = [identity, protocol.pack(header), *frames]
        copy = all(memoryview(f).nbytes < COPY_THRESHOLD for f in frames)
        try:
            self._socket.send_multipart(parts, copy=copy)
        except zmq.ZMQError as e:
            log.warning("reply to %s failed: %s", identity.hex(), e)
        # A send can consume the descriptor's edge for input that is already queued: look again.
        if self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule_drain()


def _ipc_socket_file(endpoint: str) -> tuple[str, int] | None:
    """The path and inode of the file an ipc:// endpoint bound (ZeroMQ leaves it behind at close)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):  # @: abstract, no file
        return None
    path = endpoint[len("ipc://"):]
    try:
        return path, os.stat(path).st_ino
    except OSError:
        return None


def _remove_socket_file(bound: tuple[str, int] | None) -> None:
    """Remove the socket file this daemon bound, unless another process has bound that path since."""
    if bound is None:
        return
    path, inode = bound
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


# A client whose direct lane closed is gone once this many of its ping periods (at least
# GONE_MIN_S seconds) pass without a message from it; clients are checked every SWEEP_S.
GONE_AFTER_PINGS = 4
GONE_MIN_S = 2.0
SWEEP_S = 0.5

# No idle polling for this long after a bulk-lane transfer (see DaemonServer._spin).
BULK_QUIET_S = 0.1
# Requests taken per reader callback before other callbacks get a turn.
DRAIN_BATCH = 4
# On shutdown, how long queued replies may take to leave before the socket closes.
DRAIN_LINGER_MS = 2000
# A parked request is re-checked at least this often (arrivals also wake it at once).
PARK_POLL_S = 0.05


def _from_another_host(source) -> bool:
    """Whether a message (a ZeroMQ frame of it, or the direct lane's socket it came on) came over
    TCP from another host: not from loopback, nor from one of this host's own addresses (a peer
    daemon on this host that reached us by our LAN address shares our cores all the same)."""
    try:
        if isinstance(source, socket.socket):
            if source.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            address = source.getpeername()[0]
        else:
            address = source.get("Peer-Address")
    except (AttributeError, OSError, zmq.ZMQError):  # no address
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # ipc ("localhost:..."): this host
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:  # a dual-stack listener's view of an IPv4 peer
        ip = ip.ipv4_mapped
    return not ip.is_loopback and not _own_address(ip)


def _own_address(ip) -> bool:
    """Whether `ip` is an address of this host: only those can be bound (once per peer client)."""
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError:  # EADDRNOTAVAIL: another host's
            return False
    return True


def _transfers_awaited(request, bulk_refs: list) -> list:
    """("recv", transfer id) and ("bulk", transfer number) for each transfer the request consumes.

    `bulk_refs`: the bulk tensors met while decoding the request's header.
    """
    waits = [("recv", op.args[0]) for op in request.ops
             if op.name == protocol.RECV_OP and op.args and isinstance(op.args[0], str)] if request.ops else []
    waits.extend(("bulk", b.xfer) for b in bulk_refs if type(b) is BulkTensor)
    return waits


# Requests at most this big may run on the event loop when the worker is idle.
INLINE_MAX_OPS = 32
INLINE_MAX_BYTES = 1 << 20


def _small(request, bulk_ok: bool) -> bool:
    # Only requests someone is blocked on gain from running inline: the client (it waits, fetches
    # or asks for a report), or, for a send to a peer daemon, the peer's client waiting for the
    # tensor there. Bulk uploads are in by the time a request gets here (see `_park`). Bulk
    # downloads (clients ask for them, with bulk_min, only when a fetched tensor is big enough to
    # go so) are started after the answer and finished by the worker (see `_send_downloads`);
    # `bulk_ok` False: not inline at all (a GPU tensor's download is staged and sent synchronously
    # by the executor). The sizes of its copies between daemons are checked by the server (`_peer_copies_small`).
    return ((request.waited or request.fetch or request.report or any(op.name == protocol.SEND_OP for op in request.ops))
            and len(request.ops) <= INLINE_MAX_OPS and len(request.fetch) <= 4 and (bulk_ok or not request.bulk_min))


def _send_all(identity: bytes, sends: list) -> None:
    for send in sends:
        try:
            send()
        except (ConnectionError, OSError) as e:  # the lane closed: the client's wait fails with it
            log.warning("bulk download to %s failed: %s", identity.hex(), e)


# The most of a download the event loop writes itself (a non-blocking send; see `_send_downloads`).
FIRST_SEND_BYTES = 1 << 20

# Below this size a copying send is cheaper than pinning the buffer for zero-copy.
COPY_THRESHOLD = 64 * 1024
