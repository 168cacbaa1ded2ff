"""LaneSet (genie/transport/lane_set.py): payloads striped over several bulk lanes and put back
together in one buffer, plain and sealed; parts checked before anything is allocated. No daemon."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from genie.transport import bulk, lane_set, sealed_lane
from genie.transport.errors import ProtocolError
from genie.transport.hostmem import HostBufferPool

MiB = 1 << 20


def _sets(lanes: int, sealed: bool = False, stripe_min: int = MiB):
    """Two LaneSets joined by `lanes` socket pairs (sealed with per-pair keys when `sealed`)."""
    a = b = None
    for _ in range(lanes):
        a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        seal_a = seal_b = None
        if sealed:
            key, randoms = sealed_lane.new_random() * 2, (sealed_lane.new_random(), sealed_lane.new_random())
            seal_a = sealed_lane.directions(key, *randoms, client_side=True)
            seal_b = sealed_lane.directions(key, *randoms, client_side=False)
        extra_a = a.member_kwargs() if a else {}
        extra_b = b.member_kwargs() if b else {}
        lane_a = bulk.Lane(a_sock, HostBufferPool(0), 1 << 30, "a", sealing=seal_a, **extra_a)
        lane_b = bulk.Lane(b_sock, HostBufferPool(0), 1 << 30, "b", sealing=seal_b, **extra_b)
        if a is None:
            a, b = lane_set.LaneSet(lane_a, stripe_min=stripe_min), lane_set.LaneSet(lane_b, stripe_min=stripe_min)
        else:
            a.add(lane_a)
            b.add(lane_b)
    return a, b


@pytest.fixture
def closing():
    made = []
    yield made.append
    for s in made:
        s.close()


def _payload(n: int) -> torch.Tensor:
    return torch.randint(0, 255, (n,), dtype=torch.uint8)


def test_part_bounds_cover_the_payload_in_order_at_aligned_offsets():
    for total in (0, 1, lane_set.PART_ALIGN, 3 * MiB + 7, 64 * MiB):
        for count in range(2, lane_set.MAX_LANES + 1):
            bounds = lane_set.part_bounds(total, count)
            assert len(bounds) == count
            assert sum(n for _, n in bounds) == total
            position = 0
            for offset, n in bounds:
                assert offset == position or n == 0
                assert offset % lane_set.PART_ALIGN == 0 or n == 0
                position += n
    assert lane_set.unpack_part(lane_set.pack_part(3, 4, 5 * MiB)) == (3, 4, 5 * MiB)


@pytest.mark.parametrize("lanes,sealed", [(2, False), (4, False), (3, True)])
def test_striped_payloads_arrive_whole_both_ways(lanes, sealed, closing):
    a, b = _sets(lanes, sealed)
    closing(a)
    closing(b)
    big, small, odd = _payload(9 * MiB + 3), _payload(1000), _payload(lane_set.PART_ALIGN * lanes + 1)
    heads = []
    a.send(a.next_id(), bulk.tensor_bytes(big), after_head=lambda: heads.append(1))
    a.send(a.next_id(), bulk.tensor_bytes(small))
    b.send(b.next_id(), bulk.tensor_bytes(odd))
    assert heads == [1]
    assert torch.equal(b.arrivals.take(1, timeout=10), big)
    assert torch.equal(b.arrivals.take(2, timeout=10), small)
    assert torch.equal(a.arrivals.take(1, timeout=10), odd)
    # every lane carried a part of the striped payload; the small one went on the first alone
    assert all(lane.bytes_sent > 0 for lane in a.lanes)
    assert a.lanes[0].bytes_sent > big.numel() // lanes + small.numel()
    assert b.assembly.pending_bytes() == 0


def test_striped_sends_from_several_threads_do_not_mix(closing):
    a, b = _sets(3)
    closing(a)
    closing(b)
    payloads = {a.next_id(): _payload(3 * MiB + i) for i in range(6)}
    threads = [threading.Thread(target=a.send, args=(x, bulk.tensor_bytes(p))) for x, p in payloads.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for x, p in payloads.items():
        assert torch.equal(b.arrivals.take(x, timeout=10), p)


def test_a_started_striped_download_is_sent_by_the_call_returned(closing):
    a, b = _sets(2)
    closing(a)
    closing(b)
    data = _payload(4 * MiB)
    finish = a.start_send(7, bulk.tensor_bytes(data), first_bytes=MiB)
    assert not b.arrivals.ready(7)
    finish()
    assert torch.equal(b.arrivals.take(7, timeout=10), data)


@pytest.mark.parametrize("word,nbytes,why", [
    (lane_set.pack_part(0, 1, MiB), MiB, "bad striped part"),           # one part is no stripe
    (lane_set.pack_part(2, 2, MiB), MiB // 2, "bad striped part"),      # index past the count
    (lane_set.pack_part(0, 2, 2 * MiB), 5, "is 5 bytes"),               # not its part's length
    (lane_set.pack_part(0, 2, 1 << 40), 1 << 39, "exceeds the limit"),  # over the receiver's limit
])
def test_a_bad_part_closes_the_set_before_anything_is_allocated(word, nbytes, why, closing):
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b = lane_set.LaneSet(bulk.Lane(b_sock, HostBufferPool(0), 1 << 30, "b"))
    closing(b)
    a_sock.sendall(bulk._HEADER.pack(bulk.PART, 1, nbytes, word))
    with pytest.raises(ConnectionError, match=why):
        b.arrivals.take(1, timeout=10)
    assert b.closed
    a_sock.close()


def test_a_part_sent_twice_or_disagreeing_is_refused():
    assembly = lane_set.Assembly(HostBufferPool(0), 1 << 30, bulk.Arrivals())
    first = lane_set.pack_part(0, 2, 2 * MiB)
    assembly.begin(1, MiB, first)
    with pytest.raises(ProtocolError, match="came twice"):
        assembly.begin(1, MiB, first)
    with pytest.raises(ProtocolError, match="disagree"):
        assembly.begin(1, 3 * MiB // 2, lane_set.pack_part(1, 2, 3 * MiB))


def test_a_lane_of_the_set_closing_fails_waiters_and_closes_the_set(closing):
    a, b = _sets(2)
    closing(a)
    closing(b)
    b.lanes[1].close(ConnectionError("gone"))
    assert b.closed and all(lane.closed for lane in b.lanes)
    with pytest.raises(ConnectionError):
        b.arrivals.take(1, timeout=10)


def test_a_plain_lane_ignores_parts_it_was_not_set_up_for():
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b = bulk.Lane(b_sock, HostBufferPool(0), 1 << 30, "b")
    try:
        a_sock.sendall(bulk._HEADER.pack(bulk.PART, 1, 4, lane_set.pack_part(0, 2, 8)))
        with pytest.raises(ConnectionError, match="unexpected bulk record"):
            b.arrivals.take(1, timeout=10)
    finally:
        b.close()
        a_sock.close()


def test_a_set_takes_at_most_max_lanes(closing):
    a, b = _sets(lane_set.MAX_LANES)
    closing(a)
    closing(b)
    one, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    extra = bulk.Lane(one, HostBufferPool(0), 1 << 30, "x", **a.member_kwargs())
    with pytest.raises(ConnectionError, match="no more lanes"):
        a.add(extra)
    assert extra.closed and not a.closed
    data = _payload(3 * MiB)
    a.send(9, bulk.tensor_bytes(data))
    assert torch.equal(b.arrivals.take(9, timeout=10), data)
    other.close()


def test_parts_go_on_the_calling_thread_when_no_sender_thread_can_start(closing):
    a, b = _sets(3)
    closing(a)
    closing(b)
    a._sender_pool(2).shutdown()  # as after a lane joined mid-send, or at interpreter exit
    data = _payload(5 * MiB)
    a.send(4, bulk.tensor_bytes(data))
    assert torch.equal(b.arrivals.take(4, timeout=10), data)


def test_a_sender_gone_mid_transfer_fails_its_waiters_and_frees_the_assembly():
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b = lane_set.LaneSet(bulk.Lane(b_sock, HostBufferPool(0), 1 << 30, "b"))
    try:
        a_sock.sendall(bulk._HEADER.pack(bulk.PART, 1, 2 * MiB, lane_set.pack_part(0, 2, 4 * MiB)) + b"x" * MiB)
        deadline = time.monotonic() + 10
        while b.assembly.pending_bytes() == 0:  # the first part is being received into its buffer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        a_sock.close()
        with pytest.raises(ConnectionError):
            b.arrivals.take(1, timeout=10)
        assert b.closed
        while b.assembly.pending_bytes():  # cleared as the set closes, just after waiters are told
            assert time.monotonic() < deadline + 10
            time.sleep(0.01)
    finally:
        b.close()


def test_four_lanes_over_tcp_one_over_unix_sockets_unless_asked():
    assert lane_set.lanes_wanted(socket.AF_INET) == lane_set.lanes_wanted(socket.AF_INET6) == lane_set.DEFAULT_TCP_LANES
    assert lane_set.lanes_wanted(socket.AF_UNIX) == 1
    assert lane_set.lanes_wanted(socket.AF_UNIX, 3) == lane_set.lanes_wanted(socket.AF_INET, 3) == 3


def test_abandoned_transfers_are_dropped_whether_they_came_before_or_after():
    arrivals = bulk.Arrivals()
    arrivals.put(1, torch.zeros(8, dtype=torch.uint8))
    arrivals.abandon(1)  # it came before: dropped now
    arrivals.abandon(2)  # it comes after: dropped as it lands
    arrivals.put(2, torch.zeros(8, dtype=torch.uint8))
    arrivals.put(3, torch.ones(8, dtype=torch.uint8))
    assert arrivals.pending_bytes() == 8 and not arrivals.ready(1) and not arrivals.ready(2)
    assert arrivals.take(3, 1.0).tolist() == [1] * 8
    arrivals.put(2, torch.zeros(8, dtype=torch.uint8))  # an id is dropped once, not for ever
    assert arrivals.ready(2)


def test_a_part_finishing_after_the_assembly_was_cleared_is_ignored():
    assembly = lane_set.Assembly(HostBufferPool(0), 1 << 30, bulk.Arrivals())
    (_, first), _ = lane_set.part_bounds(1 << 20, 2)
    assembly.begin(7, first, lane_set.pack_part(0, 2, 1 << 20))
    assembly.clear()  # the set closed while the part was being received
    assembly.finish(7)  # before: KeyError on the lane's thread
    assert assembly.pending_bytes() == 0 and not assembly.arrivals.ready(7)


def test_uploads_no_request_named_expire_and_named_ones_wait():
    arrivals = bulk.Arrivals()
    arrivals.put(1, torch.zeros(16, dtype=torch.uint8))  # no request will name it
    arrivals.put(2, torch.zeros(8, dtype=torch.uint8))
    arrivals.spoken_for([2, 3])  # its request came (and may queue a long time); 3 is still coming
    assert arrivals.expire(60.0) == 0  # none old enough
    time.sleep(0.02)
    assert arrivals.expire(0.01) == 16 and not arrivals.ready(1)
    arrivals.put(3, torch.ones(4, dtype=torch.uint8))
    time.sleep(0.02)
    assert arrivals.expire(0.01) == 0
    assert arrivals.take(2, 1.0).numel() == 8 and arrivals.take(3, 1.0).numel() == 4
