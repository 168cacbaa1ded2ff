"""Shared-memory segments and the bulk lane's shared mode, over an in-process Unix socket pair."""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import sys
import threading
import tempfile
import time

import pytest
import torch

from genie.transport import bulk, shared_segments
from genie.transport.errors import ProtocolError
from genie.transport.hostmem import HostBufferPool
from genie.transport.interrupts import held_interrupts

pytestmark = pytest.mark.skipif(not shared_segments.supported(), reason="needs memfd seals and fd passing (Linux)")

MiB = 1 << 20


def _wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def _sealed_memfd(size, seals=shared_segments.REQUIRED_SEALS):
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


# ---------------------------------------------------------------- the sender's segments


def test_segments_are_reused_once_handed_back_and_bounded():
    out = shared_segments.OutgoingSegments(max_bytes=8 * MiB)
    a, dropped = out.acquire(3 * MiB)
    assert a.nbytes == 4 * MiB and a.busy and dropped == []
    b, _ = out.acquire(4 * MiB)
    assert b.ident != a.ident
    none, _ = out.acquire(MiB)  # 8 MiB in use: nothing more fits
    assert none is None
    out.release(a.ident)
    again, _ = out.acquire(4 * MiB)
    assert again is a
    with pytest.raises(ProtocolError):
        out.release(12345)
    out.close()


def test_segments_in_use_are_bounded_by_the_receivers_bound_idle_ones_by_their_own():
    out = shared_segments.OutgoingSegments(max_bytes=64 * MiB, idle_bytes=6 * MiB)
    busy = [out.acquire(8 * MiB)[0] for _ in range(4)]  # 32 MiB in use: beyond the idle bound, fine
    assert all(s is not None for s in busy) and out.held_bytes() == 32 * MiB
    for s in busy:
        s.peer_has_fd = True
        out.release(s.ident)
    small, dropped = out.acquire(2 * MiB)  # 32 MiB idle > 6: all but what fits go
    assert small is not None and len(dropped) == 4 and out.held_bytes() == 2 * MiB
    out.close()


def test_idle_segments_are_dropped_to_make_room_and_reported_if_the_peer_knows_them():
    out = shared_segments.OutgoingSegments(max_bytes=8 * MiB)
    a, _ = out.acquire(4 * MiB)
    b, _ = out.acquire(4 * MiB)
    a.peer_has_fd = True
    out.release(a.ident)
    out.release(b.ident)
    big, dropped = out.acquire(8 * MiB)
    assert big is not None and big.nbytes == 8 * MiB
    assert dropped == [a.ident]  # b was never sent: nothing for the peer to forget
    assert out.held_bytes() == 8 * MiB
    out.close()


# ---------------------------------------------------------------- the receiver's checks


def test_receiver_maps_a_sealed_memfd_and_hands_it_back_when_the_payload_is_freed():
    freed = []
    incoming = shared_segments.IncomingSegments(freed.append)
    fd = _sealed_memfd(2 * MiB)
    os.pwrite(fd, b"\x07" * 100, 0)
    incoming.attach(1, fd)
    payload = incoming.payload(1, 100)
    assert payload.dtype == torch.uint8 and torch.all(payload == 7)
    with pytest.raises(ProtocolError):
        incoming.payload(1, 100)  # still in use: the sender may not have reused it
    with pytest.raises(ProtocolError):
        incoming.forget(1)
    shaped = payload.view(torch.int32)[:5]  # views keep it in use too
    del payload
    assert freed == [] and incoming.in_use() == 1
    del shaped
    assert freed == [1] and incoming.in_use() == 0
    incoming.forget(1)
    with pytest.raises(ProtocolError):
        incoming.payload(1, 100)


def test_a_hand_back_cut_by_ctrl_c_in_the_finalizer_is_made_at_the_next_one(monkeypatch):
    """A Ctrl-C that cut the finalizer handing a segment back lost it for good (the sender never
    reused it; scripts/interrupt_fuzz.py). The payload's death is noted in C first, so should
    anything still cut it, the next reclaim (a payload taken, a count asked for) hands it back."""
    real_reclaim = shared_segments.IncomingSegments.reclaim
    cut = []

    def reclaim_cut_once(self):
        if not cut:
            cut.append(True)
            raise KeyboardInterrupt  # as a program's own SIGINT handler set since Genie's last call
        real_reclaim(self)

    monkeypatch.setattr(shared_segments.IncomingSegments, "reclaim", reclaim_cut_once)
    freed = []
    incoming = shared_segments.IncomingSegments(freed.append)
    incoming.attach(1, _sealed_memfd(2 * MiB))
    incoming.attach(2, _sealed_memfd(2 * MiB))
    payload = incoming.payload(1, 100)
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: ignored.append(raised.exc_type))  # (Python prints it as ignored)
    del payload
    assert ignored == [KeyboardInterrupt] and freed == []
    other = incoming.payload(2, 100)  # taking the next payload hands the first back
    assert freed == [1]
    del other
    assert freed == [1, 2] and incoming.in_use() == 0


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="SIGINT reaches the main thread only")
def test_a_ctrl_c_in_the_finalizer_reaches_the_program_at_its_next_genie_call(monkeypatch):
    """A Ctrl-C arriving as the finalizer starts (before any held block) was printed as
    "Exception ignored" and lost; now it is kept for the program's next Genie call, and the
    segment is handed back all the same."""
    real_reclaim = shared_segments.IncomingSegments.reclaim

    def reclaim_after_a_ctrl_c(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Python runs the handler at its next check, here in the finalizer
        real_reclaim(self)

    with held_interrupts():  # Genie's handler in front, as after any Genie call
        pass
    monkeypatch.setattr(shared_segments.IncomingSegments, "reclaim", reclaim_after_a_ctrl_c)
    freed = []
    incoming = shared_segments.IncomingSegments(freed.append)
    incoming.attach(1, _sealed_memfd(2 * MiB))
    payload = incoming.payload(1, 100)
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: ignored.append(raised.exc_type))
    del payload
    assert ignored == [] and freed == [1]
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():  # the program's next Genie call
            pass


@pytest.mark.parametrize("make, why", [
    (lambda: _sealed_memfd(2 * MiB, seals=0), "sealed"),
    (lambda: _sealed_memfd(2 * MiB, seals=fcntl.F_SEAL_GROW), "sealed"),
    (lambda: _sealed_memfd(3 * MiB), "refused"),
    (lambda: _sealed_memfd(0), "refused"),
    (lambda: os.open(tempfile.mkstemp()[1], os.O_RDWR), "memfd"),
    (lambda: os.open("/dev/null", os.O_RDWR), "memory file"),
])
def test_receiver_refuses_what_is_not_a_sealed_segment(make, why):
    incoming = shared_segments.IncomingSegments(lambda ident: None)
    fd = make()
    with pytest.raises(ProtocolError, match=why):
        incoming.attach(1, fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # attach closed it either way


def test_segments_are_bounded_in_number_too():
    out = shared_segments.OutgoingSegments(max_segments=2)
    a, _ = out.acquire(MiB)
    b, _ = out.acquire(MiB)
    assert out.acquire(MiB)[0] is None  # a third would exceed what the receiver maps
    out.close()
    incoming = shared_segments.IncomingSegments(lambda ident: None, max_segments=1)
    incoming.attach(1, _sealed_memfd(2 * MiB))
    with pytest.raises(ProtocolError, match="1 segments"):
        incoming.attach(2, _sealed_memfd(2 * MiB))


def test_receiver_bounds_what_a_peer_may_make_it_map():
    incoming = shared_segments.IncomingSegments(lambda ident: None, max_bytes=4 * MiB)
    incoming.attach(1, _sealed_memfd(4 * MiB))
    with pytest.raises(ProtocolError, match="refused"):
        incoming.attach(2, _sealed_memfd(2 * MiB))
    with pytest.raises(ProtocolError, match="already"):
        incoming.attach(1, _sealed_memfd(2 * MiB))
    with pytest.raises(ProtocolError, match="do not fit"):
        incoming.payload(1, 4 * MiB + 1)


# ---------------------------------------------------------------- lanes in shared mode


@pytest.fixture
def lane_pair():
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = bulk.Lane(a_sock, HostBufferPool(0), 1 << 34, "a", shared=True,
                  segments=shared_segments.OutgoingSegments(max_bytes=16 * MiB))
    b = bulk.Lane(b_sock, HostBufferPool(0), 1 << 34, "b", shared=True,
                  segments=shared_segments.OutgoingSegments(max_bytes=16 * MiB))
    yield a, b
    a.close()
    b.close()


def test_payloads_cross_in_segments_both_ways_and_segments_come_back(lane_pair):
    a, b = lane_pair
    for size in (5 * MiB, 6 * MiB + 3, 1000):
        data = torch.randint(0, 255, (size,), dtype=torch.uint8)
        a.send(7, bulk.tensor_bytes(data))
        got = b.arrivals.take(7, timeout=10)
        assert torch.equal(got, data)
        b.send(9, bulk.tensor_bytes(got))  # and back, from the segment it arrived in
        assert torch.equal(a.arrivals.take(9, timeout=10), data)
        assert b._incoming.in_use() == 1
        del got
        _wait_for(lambda: not any(s.busy for s in a._outgoing._segments.values()))
    assert a.path == b.path == "shared-memory"
    assert a.bytes_sent >= 11 * MiB and b.bytes_received >= 11 * MiB


def test_only_payloads_through_the_socket_count_as_streamed(lane_pair):
    a, b = lane_pair  # the daemon spins for requests unless a lane streamed lately (DaemonServer._spin)
    a.send(1, bulk.tensor_bytes(torch.ones(4 * MiB, dtype=torch.uint8)))
    b.arrivals.take(1, timeout=10)
    assert a.last_streamed == b.last_streamed == 0.0
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    plain_a = bulk.Lane(a_sock, HostBufferPool(0), 1 << 30, "pa")
    plain_b = bulk.Lane(b_sock, HostBufferPool(0), 1 << 30, "pb")
    try:
        plain_a.send(1, bulk.tensor_bytes(torch.ones(MiB, dtype=torch.uint8)))
        plain_b.arrivals.take(1, timeout=10)
        assert plain_a.last_streamed > 0 and plain_b.last_streamed > 0
    finally:
        plain_a.close()
        plain_b.close()


def test_a_dropped_segment_is_forgotten_by_the_receiver_before_a_new_one_comes():
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = bulk.Lane(a_sock, HostBufferPool(0), 1 << 30, "a", shared=True,
                  segments=shared_segments.OutgoingSegments(max_bytes=64 * MiB, idle_bytes=0))
    b = bulk.Lane(b_sock, HostBufferPool(0), 1 << 30, "b", shared=True)
    try:
        a.send(1, bulk.tensor_bytes(torch.ones(4 * MiB, dtype=torch.uint8)))
        b.arrivals.take(1, timeout=10)  # dropped at once: handed back
        _wait_for(lambda: not any(s.busy for s in a._outgoing._segments.values()))
        assert b._incoming._mapped == 4 * MiB
        a.send(2, bulk.tensor_bytes(torch.full((6 * MiB,), 2, dtype=torch.uint8)))
        assert int(b.arrivals.take(2, timeout=10)[-1]) == 2
        assert b._incoming._mapped == 6 * MiB and a._outgoing.held_bytes() == 6 * MiB  # the 4 MiB one is gone
        assert not a.closed and not b.closed
    finally:
        a.close()
        b.close()


def test_a_payload_taken_at_send_time_is_not_changed_by_later_writes(lane_pair):
    a, b = lane_pair
    data = torch.zeros(4 * MiB, dtype=torch.uint8)
    a.send(1, bulk.tensor_bytes(data))
    data.fill_(1)
    assert int(b.arrivals.take(1, timeout=10).sum()) == 0


def test_when_segments_run_out_payloads_go_through_the_socket(lane_pair):
    a, b = lane_pair
    held = []
    for xfer in range(1, 5):  # 4 x 6 MiB > the 16 MiB bound while the receiver keeps them all
        data = torch.full((6 * MiB,), xfer, dtype=torch.uint8)
        a.send(xfer, bulk.tensor_bytes(data))
        held.append(b.arrivals.take(xfer, timeout=10))
        assert torch.all(held[-1] == xfer)
    assert b._incoming.in_use() == 2  # two in segments, two through the socket
    del held
    _wait_for(lambda: b._incoming.in_use() == 0)


def test_a_bad_segment_record_closes_the_lane_and_nothing_else(lane_pair):
    a, b = lane_pair
    header = bulk._HEADER
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        socket.send_fds(a.sock, [header.pack(bulk.SEGMENT, 1, 100, 5)], [fd])
    finally:
        os.close(fd)
    _wait_for(lambda: b.closed)
    with pytest.raises(ConnectionError, match="memory file"):
        b.arrivals.take(1, timeout=1)


@pytest.mark.parametrize("record", [
    bulk._HEADER.pack(bulk.SEGMENT, 1, 100, 99),       # a segment never attached
    bulk._HEADER.pack(bulk.HAND_BACK, 0, 0, 3),         # hands back what was never lent
    bulk._HEADER.pack(bulk.FORGET, 0, 0, 3),            # forgets what was never attached
    bulk._HEADER.pack(77, 0, 0, 0),                     # no such kind
])
def test_records_out_of_turn_close_the_lane(lane_pair, record):
    a, b = lane_pair
    a.sock.sendall(record)
    _wait_for(lambda: b.closed)


def test_a_plain_lane_refuses_segment_records():
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b = bulk.Lane(b_sock, HostBufferPool(0), 1 << 30, "b", shared=False)
    try:
        a_sock.sendall(bulk._HEADER.pack(bulk.SEGMENT, 1, 100, 1))
        _wait_for(lambda: b.closed)
    finally:
        a_sock.close()
        b.close()


def test_peers_of_one_user_are_recognised():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert shared_segments.same_user(a) and shared_segments.same_user(b)
    tcp = socket.socket()
    with tcp:
        assert not shared_segments.same_user(tcp)  # no peer credentials: not agreed


@pytest.mark.parametrize("kind", [bulk.STREAM, bulk.SEGMENT])
def test_a_transfer_over_the_receivers_limit_closes_the_lane(kind):
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b = bulk.Lane(b_sock, HostBufferPool(0), 4096, "b", shared=True)
    try:
        fd = _sealed_memfd(2 * MiB)
        try:
            socket.send_fds(a_sock, [bulk._HEADER.pack(kind, 1, 4097, 1)], [fd])
        finally:
            os.close(fd)
        _wait_for(lambda: b.closed)
        with pytest.raises(ConnectionError, match="exceeds the limit"):
            b.arrivals.take(1, timeout=1)
    finally:
        a_sock.close()
        b.close()


def test_a_payload_named_before_it_is_written_goes_only_to_a_taker_that_keeps_it(lane_pair):
    a, b = lane_pair
    named_first = []

    def after_head():  # with write_behind the record is out before this runs (and before the copy)
        deadline = time.monotonic() + 5
        while not b.arrivals.ready(2) and time.monotonic() < deadline:
            time.sleep(0.001)
        named_first.append(b.arrivals.ready(2))

    data = torch.full((4 * MiB,), 3, dtype=torch.uint8)
    a.send(1, bulk.tensor_bytes(data), write_behind=True)
    with pytest.raises(ProtocolError, match="before its bytes were in"):
        b.arrivals.take(1, timeout=10)  # a taker that would read it now
    a.send(2, bulk.tensor_bytes(data), after_head=after_head, write_behind=True)
    got = b.arrivals.take(2, timeout=10, being_written_ok=True)
    assert named_first == [True]
    assert torch.equal(got, data)  # complete once send returned
    a.send(3, bulk.tensor_bytes(data))  # an ordinary SEGMENT record: anyone may take it
    assert torch.equal(b.arrivals.take(3, timeout=10), data)
    assert not a.closed and not b.closed


def test_a_segment_the_receiver_has_mapped_can_be_named_in_a_message_instead_of_a_record(lane_pair):
    a, b = lane_pair
    data = torch.arange(5 * MiB, dtype=torch.int64).to(torch.uint8)
    assert a.name_in_segment(bulk.tensor_bytes(data)) is None  # no segment b has mapped yet
    a.send(1, bulk.tensor_bytes(data))
    del_me = b.arrivals.take(1, timeout=10)
    del del_me  # handed back: now b has it mapped, and a knows
    _wait_for(lambda: any(s.peer_attached and not s.busy for s in a._outgoing._segments.values()))
    where = a.name_in_segment(bulk.tensor_bytes(data))
    assert where is not None and where[1] == data.nbytes
    assert a.name_in_segment(bulk.tensor_bytes(data)) is None  # that one is busy now, and no other is mapped
    got = b.take_named(*where)
    assert torch.equal(got, data)
    with pytest.raises(ProtocolError, match="reused before it was handed back"):
        b.take_named(*where)
    with pytest.raises(ProtocolError, match="unknown shared segment"):
        b.take_named(99, 10)
    del got
    _wait_for(lambda: not any(s.busy for s in a._outgoing._segments.values()))
