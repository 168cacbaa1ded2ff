"""The daemon's mailbox with deposits whose bytes come on a peer's lane (daemon/peers.py): no daemon."""
from __future__ import annotations

import time

import pytest
import torch

from genie.transport.errors import ProtocolError
from genie_daemon.peers import LaneDeposit, Mailbox


class FakeLanes:
    """The two calls LaneDeposit makes of the bulk listener, over a dict of arrived transfers."""

    def __init__(self) -> None:
        self.arrived: dict[tuple[bytes, int], torch.Tensor] = {}

    def upload_ready(self, identity: bytes, xfer: int) -> bool:
        return (identity, xfer) in self.arrived

    def take_upload(self, identity: bytes, xfer: int, timeout: float) -> torch.Tensor:
        try:
            return self.arrived.pop((identity, xfer))
        except KeyError:
            raise ProtocolError(f"bulk transfer {xfer} did not arrive") from None


TID = "ab" * 16


def test_a_lane_deposit_is_ready_once_its_bytes_arrived_and_taken_as_its_dtype_and_shape():
    lanes, box = FakeLanes(), Mailbox()
    box.put(TID, LaneDeposit(lanes, b"peer", 7, torch.float32, (2, 3)))
    assert box.bytes == 24 and not box.has(TID)
    values = torch.arange(6, dtype=torch.float32)
    lanes.arrived[(b"peer", 7)] = values.view(torch.uint8).clone()
    assert box.has(TID)
    got = box.take(TID, 0.0)
    assert got.dtype == torch.float32 and torch.equal(got, values.view(2, 3))
    assert box.bytes == 0 and not box.has(TID)


def test_a_lane_deposit_of_the_wrong_size_is_refused():
    lanes, box = FakeLanes(), Mailbox()
    box.put(TID, LaneDeposit(lanes, b"peer", 1, torch.float32, (4,)))
    lanes.arrived[(b"peer", 1)] = torch.zeros(12, dtype=torch.uint8)
    with pytest.raises(ProtocolError, match="holds 12 bytes"):
        box.take(TID, 0.0)


def test_an_unclaimed_lane_deposit_expires_with_its_bytes():
    lanes, box = FakeLanes(), Mailbox(ttl_s=0.01)
    box.put(TID, LaneDeposit(lanes, b"peer", 3, torch.uint8, (8,)))
    lanes.arrived[(b"peer", 3)] = torch.zeros(8, dtype=torch.uint8)
    time.sleep(0.02)
    box.expire()
    assert box.bytes == 0 and not box.has(TID) and not lanes.arrived


def test_lane_deposits_count_against_the_mailbox_bound():
    lanes, box = FakeLanes(), Mailbox(max_bytes=100)
    box.put(TID, LaneDeposit(lanes, b"peer", 1, torch.float32, (20,)))
    with pytest.raises(ProtocolError, match="mailbox full"):
        box.put("cd" * 16, LaneDeposit(lanes, b"peer", 2, torch.float32, (10,)))
