"""The daemon's mailbox with deposits whose bytes come on a peer's lane (daemon/peers.py): no daemon."""
from __future__ import annotations

import time

import pytest
import torch

from genie.transport.errors import ProtocolError
from genie_daemon.peers import LaneDeposit, Mailbox


class FakeLanes:
    """The calls LaneDeposit makes of the bulk listener, over a bulk.Arrivals per peer."""

    def __init__(self) -> None:
        self.arrived: dict[tuple[bytes, int], torch.Tensor] = {}
        self.abandoned: set[tuple[bytes, int]] = set()

    def land(self, identity: bytes, xfer: int, data: torch.Tensor) -> None:
        if (identity, xfer) in self.abandoned:
            self.abandoned.discard((identity, xfer))
        else:
            self.arrived[(identity, xfer)] = data

    def abandon_upload(self, identity: bytes, xfer: int) -> None:
        if self.arrived.pop((identity, xfer), None) is None:
            self.abandoned.add((identity, xfer))

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
    lanes.land(b"peer", 7, values.view(torch.uint8).clone())
    assert box.has(TID)
    got = box.take(TID, 0.0)
    assert got.dtype == torch.float32 and torch.equal(got, values.view(2, 3))
    assert box.bytes == 0 and not box.has(TID)


def test_a_lane_deposit_of_the_wrong_size_is_refused():
    lanes, box = FakeLanes(), Mailbox()
    box.put(TID, LaneDeposit(lanes, b"peer", 1, torch.float32, (4,)))
    lanes.land(b"peer", 1, torch.zeros(12, dtype=torch.uint8))
    with pytest.raises(ProtocolError, match="holds 12 bytes"):
        box.take(TID, 0.0)


def test_an_unclaimed_lane_deposit_expires_with_its_bytes():
    lanes, box = FakeLanes(), Mailbox(ttl_s=0.01)
    box.put(TID, LaneDeposit(lanes, b"peer", 3, torch.uint8, (8,)))
    lanes.land(b"peer", 3, torch.zeros(8, dtype=torch.uint8))
    time.sleep(0.02)
    box.expire()
    assert box.bytes == 0 and not box.has(TID) and not lanes.arrived


def test_a_lane_deposit_that_expires_before_its_bytes_land_drops_them_as_they_do():
    lanes, box = FakeLanes(), Mailbox(ttl_s=0.01)
    box.put(TID, LaneDeposit(lanes, b"peer", 4, torch.uint8, (8,)))
    time.sleep(0.02)
    box.expire()
    lanes.land(b"peer", 4, torch.zeros(8, dtype=torch.uint8))  # before: kept for good
    assert not lanes.arrived and box.bytes == 0


def test_lane_deposits_count_against_the_mailbox_bound():
    lanes, box = FakeLanes(), Mailbox(max_bytes=100)
    box.put(TID, LaneDeposit(lanes, b"peer", 1, torch.float32, (20,)))
    with pytest.raises(ProtocolError, match="mailbox full"):
        box.put("cd" * 16, LaneDeposit(lanes, b"peer", 2, torch.float32, (10,)))
