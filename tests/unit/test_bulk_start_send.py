"""Lane.start_send (genie/transport/bulk.py): a transfer begun on one thread without waiting and
finished on another, as the daemon's event loop and worker do with downloads. No daemon."""
from __future__ import annotations

import select
import socket
import threading
import time

import pytest
import torch

from genie.transport import bulk
from genie.transport.hostmem import HostBufferPool

MiB = 1 << 20


@pytest.fixture
def plain_pair():
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = bulk.Lane(a_sock, HostBufferPool(0), 1 << 30, "a")
    b = bulk.Lane(b_sock, HostBufferPool(0), 1 << 30, "b")
    yield a, b
    a.close()
    b.close()


def _payload(n: int) -> torch.Tensor:
    return torch.randint(0, 255, (n,), dtype=torch.uint8)


def test_a_started_transfer_arrives_whole_once_finished_elsewhere_and_holds_the_lane_until_then(plain_pair):
    a, b = plain_pair
    first, second = _payload(3 * MiB + 5), _payload(1000)
    finish = a.start_send(1, bulk.tensor_bytes(first), first_bytes=MiB)
    later = threading.Thread(target=a.send, args=(2, bulk.tensor_bytes(second)))
    later.start()  # waits for the lane: its bytes must not land inside the first transfer's
    time.sleep(0.05)
    assert not b.arrivals.ready(2)
    worker = threading.Thread(target=finish)
    worker.start()
    assert torch.equal(b.arrivals.take(1, timeout=10), first)
    assert torch.equal(b.arrivals.take(2, timeout=10), second)
    worker.join(10)
    later.join(10)
    assert a.bytes_sent == first.numel() + second.numel() + 2 * bulk._HEADER.size


def test_starting_never_waits_for_a_receiver_that_does_not_read():
    a_sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = bulk.Lane(a_sock, HostBufferPool(0), 1 << 30, "a")
    try:
        data = _payload(16 * MiB)
        t0 = time.monotonic()
        finish = a.start_send(5, bulk.tensor_bytes(data), first_bytes=16 * MiB)
        assert time.monotonic() - t0 < 2.0  # the socket took what it could; the rest is finish's
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(bulk.recv_exactly(peer, bulk._HEADER.size + data.numel())))
        reader.start()
        finish()
        reader.join(10)
        assert bulk._HEADER.unpack(bytes(got[:bulk._HEADER.size]))[:3] == (bulk.STREAM, 5, data.numel())
        assert bytes(got[bulk._HEADER.size:]) == data.numpy().tobytes()
    finally:
        a.close()
        peer.close()


def test_on_a_busy_lane_nothing_is_sent_until_the_returned_call(plain_pair):
    a, b = plain_pair
    data = _payload(2 * MiB)
    a._send_lock.acquire()  # another transfer holds the lane
    finish = a.start_send(3, bulk.tensor_bytes(data), first_bytes=MiB)
    assert not select.select([b.sock], [], [], 0.05)[0]  # not one byte went out
    a._send_lock.release()
    finish()
    assert torch.equal(b.arrivals.take(3, timeout=10), data)


def test_a_closed_lane_refuses_to_start_and_is_not_left_held(plain_pair):
    a, _ = plain_pair
    a.close()
    with pytest.raises(ConnectionError):
        a.start_send(4, bulk.tensor_bytes(_payload(10)), first_bytes=MiB)
    assert a._send_lock.acquire(blocking=False)  # not left held
    a._send_lock.release()


def test_a_lane_closed_before_the_finish_fails_it_and_frees_the_lane(plain_pair):
    a, _ = plain_pair
    finish = a.start_send(6, bulk.tensor_bytes(_payload(4 * MiB)), first_bytes=64 << 10)
    a.close()
    with pytest.raises(ConnectionError):
        finish()
    assert a._send_lock.acquire(blocking=False)
    a._send_lock.release()
