"""Daemon-to-daemon copies run on an idle daemon's event loop (daemon/server.py `_small`,
`_peer_copies_small`; daemon/peers.py `PeerLinks.send`): a send, which the peer's client waits
for (of a tensor the request makes, or a small one held), and a small receive whose tensor is
already in the mailbox. Each skips two thread hops: a 16 KiB copy and a read of it took
0.81-0.87 ms, 0.57-0.61 since. No daemon, no sockets."""
from __future__ import annotations

import asyncio
import threading
import types

import pytest
import torch
import zmq

from genie.transport import protocol
from genie.transport.protocol import Exec, HandleRef, OpCall
from genie_daemon.handles import ClientState, MemoryAccount
from genie_daemon.peers import LaneDeposit, Mailbox, PeerLinks
from genie_daemon.server import INLINE_MAX_BYTES, DaemonServer, _small

PEER = "tcp://127.0.0.1:5555"
TID = "cd" * 16


def _request(*ops, waited=False):
    return Exec(device=0, ops=[OpCall(name, list(args), {}, out) for name, args, out in ops], frees=[], fetch=[],
                report=False, waited=waited)


def test_a_send_to_a_peer_may_run_inline_though_its_client_does_not_wait():
    send = (protocol.SEND_OP, [HandleRef(1), PEER, TID], None)
    add = ("aten::add.Tensor", [HandleRef(1), HandleRef(1)], 2)
    assert _small(_request(send), bulk_ok=True)
    assert _small(_request(add, send), bulk_ok=True)
    assert not _small(_request(add), bulk_ok=True)  # nobody waits on it: the worker's
    assert _small(_request(add, waited=True), bulk_ok=True)


class _Arrivals:
    def __init__(self, landed: bool) -> None:
        self._landed, self.failure = landed, None

    def landed(self, xfer) -> bool:
        return self._landed


def _lane_deposit(landed: bool, n: int) -> LaneDeposit:
    return LaneDeposit(types.SimpleNamespace(arrivals=_Arrivals(landed), closed=False), 1, torch.float32, (n,))


def test_a_receive_runs_inline_only_with_its_tensor_in_hand_and_small():
    mailbox = Mailbox()
    server = types.SimpleNamespace(mailbox=mailbox)
    client = ClientState(b"unit", MemoryAccount())

    def inline(tid):
        return DaemonServer._peer_copies_small(server, client, _request((protocol.RECV_OP, [tid], 1), waited=True))

    small, large, coming, landed = "01" * 16, "02" * 16, "03" * 16, "04" * 16
    mailbox.put(small, torch.zeros(16))
    mailbox.put(large, torch.zeros(INLINE_MAX_BYTES // 4 + 1))  # a copy to a GPU would stall the loop
    mailbox.put(coming, _lane_deposit(False, 4))
    mailbox.put(landed, _lane_deposit(True, 4))
    assert mailbox.ready_bytes(small) == 64 and inline(small)
    assert mailbox.ready_bytes(large) == INLINE_MAX_BYTES + 4 and not inline(large)
    assert mailbox.ready_bytes(coming) is None and not mailbox.has(coming) and not inline(coming)
    assert mailbox.ready_bytes(landed) == 16 and inline(landed)
    # Not deposited: a request whose wait ran out reaches _run_exec too; it fails on the worker.
    assert mailbox.ready_bytes("05" * 16) is None and not inline("05" * 16)


def test_sends_of_large_held_tensors_go_to_the_worker():
    # A large one goes on to a lane thread anyway, after a copy that would hold up the loop. One
    # made by the request itself (the usual case: `stage(x).to(dev1)`) is as large as
    # Executor.quick_to_start lets the request's ops make: a 16 KiB copy and a read of it
    # 0.68-0.72 -> 0.57-0.61 ms when such sends also ran inline.
    server = types.SimpleNamespace(mailbox=Mailbox())
    client = ClientState(b"unit", MemoryAccount())
    client.put(1, torch.zeros(INLINE_MAX_BYTES // 4))
    client.put(2, torch.zeros(INLINE_MAX_BYTES // 4 + 1))

    def inline(handle):
        request = _request((protocol.SEND_OP, [HandleRef(handle), PEER, TID], None))
        return DaemonServer._peer_copies_small(server, client, request)

    assert inline(1) and not inline(2)
    assert inline(3)  # not held yet: made by an earlier op of the request
    assert DaemonServer._peer_copies_small(server, client, _request(("aten::add.Tensor", [HandleRef(1), 1], 2)))


class _Socket:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send_multipart(self, frames, copy=False):
        kind, _, body = protocol.unpack_header(frames[0])
        if kind == "deposit":  # (a first copy also greets the peer)
            self.sent.append(body)


def test_a_send_made_on_the_loop_leaves_at_once_and_one_from_a_thread_on_the_loop():
    # Queued on the loop, an inline send waited for the server's idle poll for the client's
    # next request to end: a 16 KiB copy took 1.6 ms instead of 0.6.
    async def scenario():
        links = PeerLinks(context=None, loop=asyncio.get_running_loop())
        sock = _Socket()
        links._socket = lambda endpoint: sock
        links.send(PEER, TID, torch.arange(4.0))
        on_the_loop = list(sock.sent)
        thread = threading.Thread(target=links.send, args=(PEER, "ef" * 16, torch.arange(4.0)))
        thread.start()
        thread.join()
        from_a_thread = list(sock.sent)
        await asyncio.sleep(0)
        return on_the_loop, from_a_thread, sock.sent

    on_the_loop, from_a_thread, finally_sent = asyncio.run(scenario())
    assert [body["tid"] for body in on_the_loop] == [TID]
    assert len(from_a_thread) == 1  # posted to the loop, not sent from the thread's side
    assert [body["tid"] for body in finally_sent] == [TID, "ef" * 16]


class _PostedCalls:
    def __init__(self) -> None:
        self.calls: list = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))

    def run(self) -> None:
        while self.calls:
            fn, args = self.calls.pop(0)
            fn(*args)


class _HeldLane:
    """A lane whose send waits for `go` after its head (so its deposit is posted first)."""

    closed = False

    def __init__(self) -> None:
        self.go = threading.Event()

    def next_id(self) -> int:
        return 3

    def send(self, xfer, payload, after_head=None):
        after_head()
        assert self.go.wait(10)


def test_a_lane_send_counts_as_sending_until_the_loop_has_its_deposit():
    # While a sender thread has bytes out, the server does not poll idle for requests: the poll
    # would hold up the deposit the thread posts to the loop.
    loop = _PostedCalls()
    links = PeerLinks(context=None, loop=loop)
    sock = _Socket()
    links._socket = lambda endpoint: sock
    lane = _HeldLane()
    assert not links.sending()
    links._hand_to_sender(PEER, lane, {"tid": TID}, memoryview(bytes(64)))
    assert links.sending()
    lane.go.set()
    links._senders().shutdown(wait=True)
    assert links.sending()  # the thread is done; the loop has not run its posts yet
    loop.run()
    assert not links.sending()
    assert sock.sent == [{"tid": TID, "xfer": 3}]


class _Frame:
    def __init__(self, address) -> None:
        self._address = address

    def get(self, name):
        assert name == "Peer-Address"
        if self._address is None:
            raise zmq.ZMQError(zmq.EINVAL)
        return self._address


def test_peers_on_other_hosts_do_not_stop_the_idle_poll_for_a_programs_requests():
    # A daemon that received one copy from a peer counted it as a second client and stopped
    # polling for its own client's requests: round trips 0.13 -> 0.20-0.21 ms while the peer
    # stayed (peer in a network namespace, 10.77.0.2). One on this host still counts: its
    # process runs on these cores.
    from genie_daemon.server import _from_another_host

    assert _from_another_host(_Frame("10.77.0.2")) and _from_another_host(_Frame("2001:db8::5"))
    assert not _from_another_host(_Frame("127.0.0.1")) and not _from_another_host(_Frame("::1"))
    assert not _from_another_host(_Frame("localhost:0:0:22621"))  # ipc
    assert not _from_another_host(_Frame(None)) and not _from_another_host(object())  # a direct lane's frame

    def served(*peers):
        clients = {}
        for n, peer in enumerate(peers):
            clients[bytes([n])] = ClientState(bytes([n]), MemoryAccount())
            clients[bytes([n])].peer = peer
        return DaemonServer._programs_served(types.SimpleNamespace(clients=clients))

    assert served(None) == 1 and served(None, "elsewhere") == 1 and served(None, "elsewhere", "elsewhere") == 1
    assert served(None, "here") == 2 and served(None, None) == 2 and served() == 0


def _own_lan_address() -> str | None:
    """This host's address towards a LAN (a UDP socket's connect sends nothing), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))  # TEST-NET-1: only the route is looked up
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_a_peer_on_this_host_reached_by_its_lan_address_counts_as_here():
    # Before, a peer daemon on this host that connected to our LAN address counted as another
    # host's, so the idle poll went on while its process shared these cores.
    from genie_daemon.server import _from_another_host

    address = _own_lan_address()
    if address is None:
        pytest.skip("needs a non-loopback IPv4 address on this host (none is routed here)")
    assert not _from_another_host(_Frame(address))
    assert not _from_another_host(_Frame(f"::ffff:{address}"))  # as a dual-stack listener sees it
    assert not _from_another_host(_Frame("::ffff:127.0.0.1"))
    assert _from_another_host(_Frame("::ffff:10.77.0.2"))
