"""Several bulk lanes to one peer used as one (LaneSet): large payloads striped across them.

One TCP connection is often the limit before the network is: its bytes are copied by one
core at each end, and cloud networks cap each flow (commonly 5-10 Gbit/s on links of 25-100).
A client may open more lanes to a daemon (`GENIE_BULK_LANES`; each greets with
bulk.MAGIC_JOIN, or MAGIC_SEALED_JOIN under CURVE: every sealed lane has keys of its own).
A payload of `stripe_min` bytes or more is then cut into one part per lane, at 64 KiB
boundaries, and the parts go side by side as PART records, the first from the caller's
thread (which runs `after_head`) and the others from one sender thread per extra lane. The
receiver reads each part straight into its place in one buffer (`Assembly`) and hands the
whole transfer to the set's arrivals once every part is in: no copy, as on one lane.

A part names its transfer's total size, the number of parts and its own index (`pack_part`);
the receiver checks each against the others and against its limits before it allocates.
Smaller payloads, and everything on a shared-memory lane (never joined), use the first lane.
A lane of the set that closes closes the set: a transfer missing a part fails at once.
"""
from __future__ import annotations

import concurrent.futures
import functools
import socket
import threading
import types
from typing import Callable, Mapping

import torch

from .bulk import Arrivals, Lane, _flat_bytes
from .errors import ProtocolError
from .hostmem import HostBufferPool

MAX_LANES = 8             # lanes one client may have in a set (the daemon refuses more joins)
DEFAULT_TCP_LANES = 4     # a client's lanes to a daemon over TCP unless GENIE_BULK_LANES says otherwise
MAX_ASSEMBLING = 32       # striped transfers one set may have partly received at once
PART_ALIGN = 64 << 10     # part boundaries (except the end) fall on multiples of this
DEFAULT_STRIPE_MIN = 8 << 20  # payloads at least this big are striped (see README, GENIE_BULK_LANES)
_TOTAL_BITS = 48


def part_bounds(total: int, count: int) -> list[tuple[int, int]]:
    """(offset, bytes) of each of `count` parts of a `total`-byte payload; trailing parts may be empty."""
    step = -(-total // count)
    step = -(-step // PART_ALIGN) * PART_ALIGN
    return [(min(i * step, total), max(0, min(step, total - i * step))) for i in range(count)]


def pack_part(index: int, count: int, total: int) -> int:
    """A PART record's word: which part of how many, of a transfer of how many bytes."""
    return index << 56 | count << _TOTAL_BITS | total


def unpack_part(word: int) -> tuple[int, int, int]:
    index, count, total = word >> 56, (word >> _TOTAL_BITS) & 0xFF, word & ((1 << _TOTAL_BITS) - 1)
    if not 2 <= count <= MAX_LANES or index >= count:
        raise ProtocolError(f"bad striped part {index} of {count}")
    return index, count, total


def lanes_wanted(family: int, asked: int = 0) -> int:
    """How many bulk lanes to open to a peer reached over `family`: `asked` (GENIE_BULK_LANES) if
    given, else DEFAULT_TCP_LANES over TCP and 1 over a Unix socket (measured: 4 no faster there)."""
    return asked or (1 if family == socket.AF_UNIX else DEFAULT_TCP_LANES)


def join_lanes(first: Lane, wanted: int, open_member: Callable[[dict], Lane],
               stripe_min: int = DEFAULT_STRIPE_MIN) -> tuple["LaneSet", BaseException | None]:
    """(Blocking.) `first` made a LaneSet and grown to `wanted` lanes, each opened by
    `open_member(member_kwargs)` (a joining bulk.open_client_lane); the set, and what stopped it
    short (the first failure), if anything did."""
    lanes = LaneSet(first, stripe_min=stripe_min)
    for _ in range(wanted - 1):
        try:
            lanes.add(open_member(lanes.member_kwargs()))
        except (OSError, ConnectionError, ProtocolError) as e:
            return lanes, e
    return lanes, None


class Assembly:
    """The receiving side of a set: striped transfers being put together, then handed to `arrivals`."""

    def __init__(self, pool: HostBufferPool, max_transfer: int, arrivals: Arrivals) -> None:
        self.pool = pool
        self.max_transfer = max_transfer
        self.arrivals = arrivals
        self._lock = threading.Lock()
        # xfer -> [buffer, total, count, parts not yet begun, parts being received]
        self._open: dict[int, list] = {}

    def begin(self, xfer: int, nbytes: int, word: int) -> memoryview:
        """Where part `word` of transfer `xfer` (`nbytes` long) goes; checked first, then allocated
        (the whole transfer's buffer, by whichever of its parts comes first)."""
        index, count, total = unpack_part(word)
        if total > self.max_transfer:
            raise ProtocolError(f"bulk transfer of {total} bytes exceeds the limit of {self.max_transfer}")
        offset, expected = part_bounds(total, count)[index]
        if nbytes != expected:
            raise ProtocolError(f"striped part {index} of {count} of {total} bytes is {nbytes} bytes, not {expected}")
        with self._lock:
            entry = self._open.get(xfer)
            if entry is None:
                if len(self._open) >= MAX_ASSEMBLING:
                    raise ProtocolError(f"more than {MAX_ASSEMBLING} striped transfers under way at once")
                entry = self._open[xfer] = [None, total, count, set(range(count)), 0]
            elif entry[1] != total or entry[2] != count:
                raise ProtocolError(f"striped transfer {xfer}'s parts disagree on its size")
            if index not in entry[3]:
                raise ProtocolError(f"striped transfer {xfer}'s part {index} came twice")
            entry[3].discard(index)
            entry[4] += 1
            if entry[0] is None:
                entry[0] = self.pool.take(total)
            return memoryview(entry[0].numpy())[offset:offset + nbytes]

    def finish(self, xfer: int) -> None:
        """A part begun with `begin` is in; the transfer arrives with its last part."""
        with self._lock:
            entry = self._open.get(xfer)
            if entry is None:  # cleared meanwhile: the lane set is closing
                return
            entry[4] -= 1
            if entry[3] or entry[4]:
                return
            del self._open[xfer]
        self.arrivals.put(xfer, entry[0])

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(entry[1] for entry in self._open.values())

    def clear(self) -> None:
        with self._lock:
            self._open.clear()


class _Done:
    """A part sent on the calling thread, with a Future's `result()`."""

    def __init__(self, part: Callable[[], None]) -> None:
        self._failure = None
        try:
            part()
        except BaseException as e:  # noqa: BLE001 - raised by result(), as a Future's would be
            self._failure = e

    def result(self) -> None:
        if self._failure is not None:
            raise self._failure


class LaneSet:
    """A peer's bulk lanes as one lane (the surface of bulk.Lane that senders and receivers use)."""

    landing_devices: Mapping[int, torch.device] = types.MappingProxyType({})
    peer_devices: frozenset[int] = frozenset()

    def __init__(self, first: Lane, on_close: Callable[["LaneSet"], None] | None = None,
                 stripe_min: int = DEFAULT_STRIPE_MIN) -> None:
        self.lanes = [first]
        self.arrivals = first.arrivals
        self.assembly = Assembly(first.pool, first.max_transfer, first.arrivals)
        first.assembly = self.assembly
        first.on_close = self._member_closed
        self.on_close = on_close
        self.stripe_min = max(stripe_min, PART_ALIGN)
        self._closed = False
        self._lock = threading.Lock()
        self._senders: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ membership

    def member_kwargs(self) -> dict:
        """What a lane joining this set is made with (bulk.Lane's arrivals, assembly, on_close)."""
        return {"arrivals": self.arrivals, "assembly": self.assembly, "on_close": self._member_closed}

    def add(self, lane: Lane) -> None:
        """A lane made with member_kwargs(), connected: striped transfers use it from now on."""
        with self._lock:
            taken = not self._closed and len(self.lanes) < MAX_LANES and not self.lanes[0].shared
            if taken:
                self.lanes.append(lane)
                senders, self._senders = self._senders, None  # sized anew for the next striped send
        if not taken:
            # Refusing it neither closes the set nor fails the set's waiters.
            lane.on_close, lane.assembly, lane.arrivals = None, None, Arrivals()
            lane.close()
            raise ConnectionError("this bulk lane set takes no more lanes")
        if senders is not None:
            senders.shutdown(wait=False)

    def _member_closed(self, lane: Lane) -> None:
        self.close(ConnectionError("a bulk lane of the set closed"))

    # ------------------------------------------------------------ the Lane surface

    @property
    def closed(self) -> bool:
        """Closed, or about to be: a member lane closed (it closes the set once its waiters are told)."""
        return self._closed or any(lane.closed for lane in self.lanes)

    @property
    def sock(self):
        return self.lanes[0].sock

    @property
    def sockets(self) -> list:
        return [lane.sock for lane in self.lanes]

    @property
    def shared(self) -> bool:
        return self.lanes[0].shared

    @property
    def path(self) -> str:
        return self.lanes[0].path

    @property
    def bytes_sent(self) -> int:
        return sum(lane.bytes_sent for lane in self.lanes)

    @property
    def bytes_received(self) -> int:
        return sum(lane.bytes_received for lane in self.lanes)

    @property
    def last_streamed(self) -> float:
        return max(lane.last_streamed for lane in self.lanes)

    def next_id(self) -> int:
        return self.lanes[0].next_id()  # one id space: every transfer of the set is numbered by the first lane

    def name_in_segment(self, payload: memoryview):
        return self.lanes[0].name_in_segment(payload)

    def take_named(self, segment: int, nbytes: int) -> torch.Tensor:
        return self.lanes[0].take_named(segment, nbytes)

    def accept_named(self, records) -> None:
        self.lanes[0].accept_named(records)

    def segment_bytes_lent(self) -> int:
        return self.lanes[0].segment_bytes_lent()

    def pending_bytes(self) -> int:
        return self.arrivals.pending_bytes() + self.assembly.pending_bytes()

    def _striping(self, nbytes: int) -> list[Lane] | None:
        lanes = self.lanes
        if len(lanes) < 2 or nbytes < self.stripe_min or lanes[0].shared:
            return None
        return list(lanes)

    def send(self, xfer: int, payload: memoryview, after_head: Callable[[], None] | None = None,
             write_behind: bool = False, records: list | None = None) -> None:
        """As bulk.Lane.send; a payload of `stripe_min` bytes or more goes as one part per lane,
        side by side (`after_head` runs once the first part's head is out)."""
        payload = _flat_bytes(payload)
        lanes = self._striping(payload.nbytes)
        if lanes is None:
            self.lanes[0].send(xfer, payload, after_head, write_behind, records)
            return
        if self.closed:
            raise ConnectionError("bulk lane is closed")
        count, total = len(lanes), payload.nbytes
        bounds = part_bounds(total, count)
        parts = [functools.partial(lane.send_part, xfer, payload[offset:offset + n], pack_part(i, count, total))
                 for i, (lane, (offset, n)) in enumerate(zip(lanes, bounds)) if i]
        senders, others = self._sender_pool(count - 1), []
        for part in parts:
            try:
                others.append(senders.submit(part))
            except RuntimeError:  # the pool was shut (a lane joined, or the interpreter exits): sent here
                others.append(_Done(part))
        failure = None
        try:
            lanes[0].send_part(xfer, payload[:bounds[0][1]], pack_part(0, count, total), after_head)
        except BaseException as e:  # noqa: BLE001 - raised once the other parts are done with the payload
            failure = e
        for future in others:
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001
                failure = failure or e
        if failure is not None:
            raise failure

    def start_send(self, xfer: int, payload: memoryview, first_bytes: int) -> Callable[[], None]:
        """As bulk.Lane.start_send; a striped payload is all sent by the call returned."""
        payload = _flat_bytes(payload)
        if self._striping(payload.nbytes) is not None:
            return functools.partial(self.send, xfer, payload)
        return self.lanes[0].start_send(xfer, payload, first_bytes)

    def _sender_pool(self, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._senders is None:
                self._senders = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="genie-bulk-part")
            return self._senders

    def abandon(self) -> None:
        """In a forked child (see bulk.Lane.abandon): the parent's sender threads are not ours."""
        self._closed = True
        self._senders = None
        for lane in self.lanes:
            lane.abandon()

    def close(self, reason: BaseException | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            senders, self._senders = self._senders, None
        for lane in self.lanes:
            lane.close(reason)
        self.assembly.clear()
        if senders is not None:
            senders.shutdown(wait=False)
        if self.on_close is not None:
            self.on_close(self)
