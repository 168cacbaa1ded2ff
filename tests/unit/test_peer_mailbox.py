"""The daemon's mailbox with deposits whose bytes come on a peer's lane (daemon/peers.py): no daemon."""
from __future__ import annotations

import time

import pytest
import torch

from genie.transport.bulk import Arrivals
from genie.transport.errors import ProtocolError
from genie_daemon.peers import LaneDeposit, Mailbox


class FakeLane:
    """What LaneDeposit uses of a peer's lane: its bulk.Arrivals, and whether it closed."""

    def __init__(self) -> None:
        self.arrivals = Arrivals()
        self.closed = False

    def land(self, xfer: int, data: torch.Tensor) -> None:
        self.arrivals.put(xfer, data)

    @property
    def arrived(self) -> int:
        return self.arrivals.pending_bytes()


TID = "ab" * 16


def test_a_lane_deposit_is_ready_once_its_bytes_arrived_and_taken_as_its_dtype_and_shape():
    lane, box = FakeLane(), Mailbox()
    box.put(TID, LaneDeposit(lane, 7, torch.float32, (2, 3)))
    assert box.bytes == 24 and not box.has(TID)
    values = torch.arange(6, dtype=torch.float32)
    lane.land(7, values.view(torch.uint8).clone())
    assert box.has(TID)
    got = box.take(TID, 0.0)
    assert got.dtype == torch.float32 and torch.equal(got, values.view(2, 3))
    assert box.bytes == 0 and not box.has(TID)


def test_a_lane_deposit_of_the_wrong_size_is_refused():
    lane, box = FakeLane(), Mailbox()
    box.put(TID, LaneDeposit(lane, 1, torch.float32, (4,)))
    lane.land(1, torch.zeros(12, dtype=torch.uint8))
    with pytest.raises(ProtocolError, match="holds 12 bytes"):
        box.take(TID, 0.0)


def test_an_unclaimed_lane_deposit_expires_with_its_bytes():
    lane, box = FakeLane(), Mailbox(ttl_s=0.01)
    box.put(TID, LaneDeposit(lane, 3, torch.uint8, (8,)))
    lane.land(3, torch.zeros(8, dtype=torch.uint8))
    time.sleep(0.02)
    box.expire()
    assert box.bytes == 0 and not box.has(TID) and not lane.arrived


def test_a_lane_deposit_that_expires_before_its_bytes_land_drops_them_as_they_do():
    lane, box = FakeLane(), Mailbox(ttl_s=0.01)
    box.put(TID, LaneDeposit(lane, 4, torch.uint8, (8,)))
    time.sleep(0.02)
    box.expire()
    lane.land(4, torch.zeros(8, dtype=torch.uint8))  # before: kept for good
    assert not lane.arrived and box.bytes == 0


def test_lane_deposits_count_against_the_mailbox_bound():
    lane, box = FakeLane(), Mailbox(max_bytes=100)
    box.put(TID, LaneDeposit(lane, 1, torch.float32, (20,)))
    with pytest.raises(ProtocolError, match="mailbox full"):
        box.put("cd" * 16, LaneDeposit(lane, 2, torch.float32, (10,)))


def test_a_lane_deposit_whose_lane_failed_waits_for_the_replacement_then_tells_of_the_failure(monkeypatch):
    import genie_daemon.peers as peers

    monkeypatch.setattr(peers, "REPLACEMENT_WAIT_S", 0.05)
    lane, box = FakeLane(), Mailbox()
    box.put(TID, LaneDeposit(lane, 5, torch.uint8, (8,)))  # the deposit came before its bytes
    lane.closed = True
    lane.arrivals.fail(ConnectionError("bulk lane closed"))
    assert not box.has(TID)  # the sender's deposit of the bytes themselves may be on its way
    time.sleep(0.08)
    assert box.has(TID)
    with pytest.raises(ProtocolError, match="bulk lane failed before transfer 5 arrived"):
        box.take(TID, 1.0)


def test_the_senders_replacement_takes_a_failed_lane_deposits_place_and_its_late_bytes_are_dropped():
    lane, box = FakeLane(), Mailbox()
    box.put(TID, LaneDeposit(lane, 6, torch.float32, (2,)))
    lane.arrivals.fail(ConnectionError("bulk lane closed"))
    box.put(TID, torch.tensor([1.0, 2.0]))  # the same transfer, its bytes in the deposit
    assert box.has(TID) and box.bytes == 8
    assert box.take(TID, 0.0).tolist() == [1.0, 2.0]
    lane.arrivals.failure = None
    lane.land(6, torch.zeros(8, dtype=torch.uint8))  # a part that still made it: nobody takes it
    assert not lane.arrived
