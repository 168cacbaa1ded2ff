"""A daemon's sends to a peer over its lane (daemon/peers.PeerLinks): the deposit naming the bytes
goes once their head is out, and one carrying them if the lane then fails. No daemon, no sockets."""
from __future__ import annotations

import torch

from genie.transport import protocol
from genie_daemon.peers import PeerLinks

PEER = "tcp://127.0.0.1:5555"
TID = "ab" * 16


class PostedCalls:
    """The event loop's call_soon_threadsafe, run at once on the calling thread."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


class FakeSocket:
    def __init__(self) -> None:
        self.sent: list[tuple[dict, list]] = []

    def send_multipart(self, frames, copy=False):
        kind, _, body = protocol.unpack_header(frames[0])
        assert kind == "deposit"
        self.sent.append((body, frames[1:]))


class LaneFailingAfterTheHead:
    """A lane that takes the transfer's head (so its deposit goes) and then breaks."""

    closed = False

    def next_id(self) -> int:
        return 9

    def send(self, xfer, payload, after_head=None):
        after_head()
        raise ConnectionResetError("connection reset by peer")


class WorkingLane(LaneFailingAfterTheHead):
    def send(self, xfer, payload, after_head=None):
        after_head()


def _links(lane) -> tuple[PeerLinks, FakeSocket]:
    links = PeerLinks(context=None, loop=PostedCalls())
    sock = FakeSocket()
    links._socket = lambda endpoint: sock
    links._lanes[PEER] = lane
    return links, sock


def test_the_deposit_naming_lane_bytes_goes_once_their_head_is_out():
    links, sock = _links(WorkingLane())
    payload = memoryview(torch.arange(4.0).numpy()).cast("B")
    links._send_on_lane(PEER, links._lanes[PEER], {"tid": TID}, payload)
    assert [body for body, _ in sock.sent] == [{"tid": TID, "xfer": 9}]
    assert links.bytes_sent == links.lane_bytes_sent == 16


def test_a_lane_failing_after_the_head_is_followed_by_a_deposit_of_the_bytes():
    links, sock = _links(LaneFailingAfterTheHead())
    values = torch.arange(4.0)
    payload = memoryview(values.numpy()).cast("B")
    links._send_on_lane(PEER, links._lanes[PEER], {"tid": TID}, payload)
    (first, no_frames), (second, frames) = sock.sent
    assert first == {"tid": TID, "xfer": 9} and not no_frames
    assert second == {"tid": TID} and len(frames) == 1  # same transfer: the peer keeps this one
    assert torch.equal(torch.frombuffer(bytearray(frames[0]), dtype=torch.float32), values)
    assert links.bytes_sent == 16 and links.lane_bytes_sent == 0  # counted once, over ZeroMQ
