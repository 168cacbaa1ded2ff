"""One remote device as an ordered stream of ops, batched until someone needs a result.

The frontend appends encoded ops under `lock` (the hot path touches nothing
else); a batch goes out when a materialization needs it, or when it grows past
the configured op/byte bounds. Batches are posted to the loop in the order they
were taken, so the daemon sees exactly the program order. Handles freed by
dying tensors are queued on the stream of their device and sent after the ops
of the next batch, so a free never overtakes an op that still reads it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from genie.errors import GenieConnectionError, RemoteExecutionError, remote_execution_error
from genie.transport import bulk, numerics, protocol
from genie.transport.channel import RemoteError
from genie.transport.death_notes import DeathNotes, KeyedRef as _KeyedRef
from genie.transport.bulk import tensor_bytes
from genie.transport.errors import ProtocolError
from genie.transport.interrupts import Condition, held_between_waits, held_interrupts, is_interrupt
from genie.transport.tensors import bytes_as_tensor, check_frames, check_shape, frames_to_tensor, laid_out, parse_dtype

from .device_type import DEVICE_TYPE

if TYPE_CHECKING:
    from .link import DaemonLink

log = logging.getLogger("genie.runtime")

# The empty tensor `.to(device)` makes before its copy_: a full batch waits one op for that copy_,
# which then becomes a genie::adopt of the received bytes (frontend/transfers._try_adopt). Posted
# at once, the 32nd op's upload was copied in on the daemon instead (a channels-last one permuted
# there and back: ~115 ms for 64 MiB against ~8).
UPLOAD_FIRST_HALVES = frozenset(("aten::empty.memory_format", "aten::empty_strided"))


class _CurrentStreams(threading.local):
    """The current remote stream id per device, per thread (like CUDA's current stream)."""

    # A device's global index -> its current stream id, once a thread sets one. The class-level
    # default makes reading it in a thread that never did a plain attribute read (~70 ns), not a
    # failed lookup (~440 ns): every captured op reads it.
    ids: dict | None = None


_current = _CurrentStreams()
_get_ident = threading.get_ident


class _OnBehalf(threading.local):
    """The stream whose recording the op this thread is running belongs to, on a thread other than
    the recording one: PyTorch's autograd engine runs a block's backward on its own thread for the
    device, carrying the block's dispatch modes along, and the recording's mode sets this around
    each op it sees there (frontend/graphs.py). Per op, not per thread: the engine's thread runs
    other threads' backwards too."""

    stream = None


on_behalf = _OnBehalf()


thread_streams = _current


def current_stream_id(global_index: int) -> int:
    ids = _current.ids
    return ids.get(global_index, 0) if ids else 0


def set_current_stream_id(global_index: int, stream_id: int) -> None:
    ids = _current.ids
    if ids is None:
        ids = _current.ids = {}
    ids[global_index] = stream_id


_ExtType, _EXT_HANDLE, _pack_handle = protocol.msgpack.ExtType, protocol.EXT_HANDLE, protocol._HANDLE.pack


class HandleRef:
    """Owns one remote handle; when the last Python reference dies, the handle is freed (batched)."""

    __slots__ = ("stream", "id", "storage_nbytes", "meta_key", "storage", "wire", "__weakref__")

    def __init__(self, stream: "DeviceStream", handle_id: int, storage_nbytes: int) -> None:
        self.id = handle_id
        self.stream = stream
        self.storage_nbytes = storage_nbytes
        self.meta_key = None  # the tensor's metadata as a cache-key part (set by the frontend)
        # What the handles of one storage on the daemon share (views of one another), set by the
        # frontend when a view is made or the identity is asked for; None: not shared so far.
        self.storage = None
        # Encoded once, reused by every op that reads it (protocol.encode_handle, inlined: once per op).
        self.wire = tuple.__new__(_ExtType, (_EXT_HANDLE, _pack_handle(handle_id)))
        # When this dies, its id is noted for the next batch's frees (a C callback, see
        # death_notes.py: a `__del__` ran Python wherever the last reference went, and a Ctrl-C
        # landing there was swallowed with the free). The stream keeps the weak reference, so
        # that it fires also when a cycle held this. (DeathNotes.watch, inlined: once per op.)
        deaths = stream.deaths
        ref = _KeyedRef(self, deaths.dead.append)
        ref.key = handle_id
        deaths.watching[handle_id] = ref

    def __reduce__(self):
        raise TypeError("a remote handle cannot be copied or pickled; copy the tensor instead")


class _Once:
    """Calls `fn` the first time it is called, from whichever thread (list.pop is atomic)."""

    __slots__ = ("_fn",)

    def __init__(self, fn) -> None:
        self._fn = [fn]

    def __call__(self) -> None:
        try:
            fn = self._fn.pop()
        except IndexError:
            return
        fn()


class DeviceStream:
    def __init__(self, link: "DaemonLink", local_index: int, global_index: int, batch_ops: int, batch_bytes: int) -> None:
        self.link = link
        self.local_index = local_index
        self.global_index = global_index
        self.device = torch.device(DEVICE_TYPE, global_index)
        self.lock = threading.RLock()
        self.ops: list[list] = []
        self.frames: list = []
        self.inline_bytes = 0
        # Ids of handles whose HandleRef died (noted from any thread, at any moment), freed with
        # the next batch.
        self.deaths = DeathNotes()
        # Programs (genie.graph) whose Graph died, dropped with the next batch; like frees, queued
        # from finalizers at any moment, so never into `ops` directly: a Graph collected while
        # another block records would have its drop recorded into that block's program.
        self.dropped_programs: collections.deque[int] = collections.deque()
        self.batch_ops = batch_ops
        self.batch_bytes = batch_bytes
        self._async_error: BaseException | None = None
        self.ops_captured = 0
        self.views_captured = 0  # of those, view ops (they write nothing: values read before stay current)
        # Per daemon-side stream id: ops_captured when its last batch was taken, and the frontend's
        # [ops covered, event, seen complete] for its last completion event (frontend/streams.py:
        # a stream's query needs no round trip once its work is known complete).
        self.last_op_on: dict[int, int] = {}
        self.completion_marks: dict[int, list] = {}
        # A batch holds the ops of one daemon-side stream, and, while a block records, either the
        # recording thread's ops or other threads' (see `own_batch`).
        self.batch_stream = 0  # daemon-side stream id of the ops in the current batch
        self.batch_recorded = False  # the current batch is the recording thread's
        # (start, end) wall-clock times of recent batches on the daemon, for overlap checks.
        self.exec_log: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)
        # While a genie.graph records this stream: the [ops, frees] of each batch taken (see graphs).
        self.recording: list | None = None
        self.record_only = False  # while recording: the batches are kept, not sent (torch.accelerator.Graph)
        # The thread that records: a recording takes only its ops (and those autograd's thread runs
        # for it: see `on_behalf`), as a CUDA capture takes only its stream's; other threads' ops
        # on the device run as usual meanwhile.
        self.recording_thread: int | None = None
        self.recording_made: set[int] = set()  # handles the recorded ops make (see `_record`)
        # (transfer id, bytes, device or None) claimed by the op being queued; the bytes hold the tensor.
        self.pending_bulk: list = []
        # A CPU device. Its daemon keeps an adopted upload as received, reading it only for later
        # ops (a GPU copies it in at once): such payloads may be copied in behind their record. And
        # its kernels are the CPU's, which meta.plan_op's dtype check runs (their refusals are exact).
        self.runs_cpu_kernels = link.devices[local_index].get("type") == "cpu"
        self._unsettled = 0  # batches posted through the loop whose answer has not been handled yet
        self._settled = Condition()
        # Batches taken and never sent, oldest first: a Ctrl-C stopped the wait before they went
        # (see `put_back`). The next post sends them first.
        self.unsent: collections.deque[tuple[dict, list]] = collections.deque()

    def abandon(self) -> None:
        """In a forked child: fresh locks (a parent thread may have held these at the fork), so ops
        on this stream's tensors reach its link and fail there with the reason, instead of hanging."""
        self.lock = threading.RLock()
        self._settled = Condition()
        self._unsettled = 0
        self.pending_bulk = []
        self.unsent.clear()

    # ------------------------------------------------------------ building batches (lock held by caller)

    def new_handle(self) -> int:
        return next(self.link.handle_ids)

    def records_here(self) -> bool:
        """Whether this thread's ops on the stream are being recorded now."""
        return self.recording is not None and (_get_ident() == self.recording_thread or on_behalf.stream is self)

    def own_batch(self) -> None:
        """Close the current batch if this thread's next op does not belong in it: it is for
        another daemon-side stream, or for the recording when the batch is not (or the other way
        round). Called before the op's arguments are encoded: an inline payload goes in the
        batch of the op that reads it (a frame attached before the switch left with the batch
        before, and the op read another frame: a wrong value, silently, for `x * torch.tensor(2.5)`
        under another stream)."""
        ids = _current.ids
        sid = ids.get(self.global_index, 0) if ids else 0
        recorded = self.records_here()
        if sid == self.batch_stream and recorded is self.batch_recorded:
            return
        if self.ops:
            pending, self.pending_bulk = self.pending_bulk, []  # they belong to the next op
            with held_between_waits():  # taken and sent, or put back (see `put_back`)
                self._post_unwaited(self._take(fetch=[], report=False))
            self.pending_bulk = pending
        self.batch_stream, self.batch_recorded = sid, recorded

    def _not_while_recording(self, what: str) -> None:
        if self.records_here():
            from genie.errors import GenieError

            raise GenieError(f"{what} cannot be recorded in a genie.graph (a replay sends no data and reads "
                             "no values): copy inputs into remote tensors before the block, read results after it")

    def add_frame(self, buffer) -> int:
        """Attach an inline payload to the current batch; returns its frame index."""
        self._not_while_recording("a host-to-device copy")
        self.own_batch()
        self.frames.append(buffer)
        self.inline_bytes += memoryview(buffer).nbytes
        return len(self.frames) - 1

    def send_bulk(self, value: torch.Tensor) -> int | None:
        """Claim a bulk-lane transfer for a large CPU tensor; its id, or None to inline the bytes.

        The bytes go out in `append`, right after the batch holding the op that reads them, so the
        daemon has the op in hand while the payload streams in and answers as soon as it lands
        (sending the payload first put a whole round trip after every transfer). They are sent
        before `append` returns, like a blocking host-to-device copy: later writes to `value` do
        not change what the daemon receives.
        """
        self._not_while_recording("a host-to-device copy")
        lane = self.link.bulk_lane
        nbytes = value.numel() * value.element_size()
        if lane is None or lane.closed or nbytes < self.link.bulk_min_bytes:
            return None  # inlined: add_frame picks the batch
        self.own_batch()  # before the claim: the transfer goes with this op's batch
        xfer = lane.next_id()
        # A daemon GPU that the UCX lane fills directly: the bytes land there, not in host memory.
        to_device = self.local_index if self.local_index in lane.peer_devices else None
        self.pending_bulk.append((xfer, tensor_bytes(value), to_device))
        return xfer

    def discard_pending_bulk(self) -> None:
        """The op that claimed these transfers was never queued (its arguments failed to encode)."""
        self.pending_bulk.clear()

    def _send_pending_bulk(self, post=None, write_behind: bool = False, records: list | None = None) -> None:
        """Send the claimed transfers' bytes; `post` (sending their batch) runs once the first
        transfer's head is out (see `bulk.Lane.send`, also for `write_behind` and `records`)."""
        pending, self.pending_bulk = self.pending_bulk, []
        lane = self.link.bulk_lane
        for xfer, payload, to_device in pending:
            try:
                if to_device is None:
                    lane.send(xfer, payload, after_head=post, write_behind=write_behind, records=records)
                else:  # a UCX lane (see ucx_lane.UcxLane.send)
                    lane.send(xfer, payload, after_head=post, device=to_device)
            except ConnectionError as e:
                # The batch naming this transfer is out (or never will be): the daemon fails it.
                raise GenieConnectionError(f"genie-daemon at {self.link.endpoint}: {e}") from None
            post = None

    def append(self, entry: list, send_now: bool = True) -> None:
        """Queue an op. With transfers claimed for it (`send_bulk`), the batch goes out now and
        then their bytes, and a full batch goes out unasked, unless `send_now` is False (the caller
        posts the batch itself, then `_send_pending_bulk`)."""
        ids = _current.ids  # current_stream_id, inlined: this runs once per captured op
        if (ids.get(self.global_index, 0) if ids else 0) != self.batch_stream or self.recording is not None:
            self.own_batch()
        self.ops.append(entry)
        self.ops_captured += 1
        if self.pending_bulk:
            if send_now:
                with held_interrupts():  # a Ctrl-C comes once the batch and its bytes are out (interrupts.py)
                    body, frames = self._take(fetch=[], report=False)
                    body["wait"] = True  # a hint: answered soon after its bytes land, not queued behind
                    named: list = []  # uploads the batch names in segments itself (see bulk.Lane.send)

                    def post() -> None:
                        if named:
                            body["segments"] = named
                        if not self.link.post_direct(body, frames, self):
                            self._post((body, frames), wait=False)
                    # An adopt is the batch's last op, and this thread's next message goes after the
                    # copy: on a daemon that keeps it as received, nothing reads it before then.
                    self._send_pending_bulk(post, records=named,
                                            write_behind=entry[0] == protocol.ADOPT_OP and self.runs_cpu_kernels)
        elif send_now and (len(self.ops) >= self.batch_ops and len(self.ops) >= self._batch_limit()
                           or self.inline_bytes >= self.batch_bytes):
            # Not on an upload's empty (UPLOAD_FIRST_HALVES), unless empties alone filled it twice over.
            if entry[0] not in UPLOAD_FIRST_HALVES or len(self.ops) >= 2 * self._batch_limit():
                with held_between_waits():  # taken and sent, or put back (see `put_back`)
                    self._post_unwaited(self._take(fetch=[], report=False))

    def _batch_limit(self) -> int:
        """Ops in a batch sent unasked: batch_ops, doubled for every 4 posted batches whose answers
        are unread, up to 8x. Small batches let the daemon start early; when many are unread, the
        program is running far ahead, and fewer, larger messages cost both sides less."""
        return self.batch_ops << min(3, len(self.link._direct_unread) >> 2)

    def _take(self, fetch: list[int], report: bool, largest: int | None = None,
              settings: list | None = None) -> tuple[dict, list]:
        if self.dropped_programs and self.recording is None:
            drops = []
            while self.dropped_programs:
                drops.append([protocol.DROP_PROGRAM_OP, [self.dropped_programs.popleft()], {}, None])
            # After every queued op (a replay of the program may be one), before a reported op (it stays last).
            at = len(self.ops) - 1 if report and self.ops else len(self.ops)
            self.ops[at:at] = drops
        frees = self.deaths.take_all()
        body = {"dev": self.local_index, "stream": self.batch_stream, "ops": self.ops, "frees": frees,
                "fetch": fetch, "report": report}
        if self.ops:
            self.last_op_on[self.batch_stream] = self.ops_captured
            # TF32, deterministic algorithms...: as this process has them now, or as the caller
            # read them when the ops were captured (frontend/settings_barrier.py)
            settings = numerics.current() if settings is None else (None if settings == numerics.DEFAULT else settings)
            if settings is not None:
                body["num"] = settings
        lane = self.link.bulk_lane
        if fetch and lane is not None and not lane.closed and (largest is None or largest >= self.link.bulk_min_bytes):
            body["bulk_min"] = self.link.bulk_min_bytes
        frames = self.frames
        if self.recording is not None:
            self._record(body, frees)
        self.ops, self.frames, self.inline_bytes = [], [], 0
        return body, frames

    def _record(self, body: dict, frees: list) -> None:
        """While a block records: keep the batch for its program if it is the recording's, with
        the frees of handles the block made, whichever batch took them: a replay makes those
        handles again, and the program frees them after each replay. Other frees go now, as the
        handles exist; those the block made go now too unless the block ran nothing (a
        torch.accelerator.Graph capture: they exist from its first replay). Before 2026-11-30 a
        capture kept every free for its program, and a tensor that died during a capture never
        replayed stayed on the daemon (1 MB per capture in a loop)."""
        made = self.recording_made
        if self.batch_recorded:
            for op in self.ops:
                made.update(protocol.handles_in(op[3]))
        mine = [h for h in frees if h in made] if made and frees else []
        if self.batch_recorded and self.ops or mine:
            self.recording.append([self.ops if self.batch_recorded else [], mine, body.get("num")])
        if self.record_only:
            if self.batch_recorded:
                body["ops"] = []
            if mine:
                body["frees"] = [h for h in frees if h not in made]

    def _post(self, batch: tuple[dict, list], wait: bool, direct: bool = False) -> concurrent.futures.Future:
        """Send a batch; `direct`: the caller is about to block on it, so it may go on its own thread
        (then what comes back may be an already-answered stand-in with `result()`, for `link.wait`).
        Callers take the batch and post it within `held_between_waits`: a Ctrl-C in between would
        lose it (see `put_back`)."""
        if self.unsent:
            self._send_unsent(batch)
        body, frames = batch
        if direct:
            body["wait"] = True  # the daemon may run it at once rather than queue it for its worker
            done = self.link.direct_exec(body, frames, self)
            if done is not None:
                return done
        return self._post_through_loop(batch, wait)

    def _post_through_loop(self, batch: tuple[dict, list], wait: bool) -> concurrent.futures.Future:
        with self._settled:
            self._unsettled += 1
        settled = _Once(self._on_settled)
        try:
            return self.link.submit_exec(*batch, self, waited=wait, on_settled=settled)
        except BaseException:
            settled()  # never posted (or a Ctrl-C after: then its answer, read later, settles nothing)
            raise

    def _post_unwaited(self, batch: tuple[dict, list]) -> None:
        """Send a batch nobody waits for: on the direct socket when it is free (the daemon runs it
        while this thread captures the next, and no thread hop on either side), else through the loop."""
        if self.unsent:
            self._send_unsent(batch)
        self._send_unwaited(batch)

    def _send_unwaited(self, batch: tuple[dict, list]) -> None:
        if not self.link.post_direct(*batch, self):
            self._post_through_loop(batch, wait=False)

    def put_back(self, body: dict, frames: list, last: bool = False) -> None:
        """(The link, when a Ctrl-C stopped a taken batch before it went out.) Keep it, as taken
        (its ops, frees, frames and settings), to go before anything posted later: left out, its
        ops would never run and every later read would be off by them. What it fetched, nobody
        reads now. `last`: behind the batches already kept (`_send_unsent`, interrupted)."""
        body["fetch"] = []
        body.pop("bulk_min", None)
        if last:
            self.unsent.append((body, frames))
        else:
            self.unsent.appendleft((body, frames))

    def _send_unsent(self, behind: tuple[dict, list]) -> None:
        """Post the batches a Ctrl-C kept back, oldest first, before `behind` (the batch being posted)."""
        try:
            while self.unsent:
                self._send_unwaited(self.unsent.popleft())  # held: a Ctrl-C waits for the send, which puts it back
        except BaseException as e:
            if is_interrupt(e):
                self.put_back(*behind, last=True)
            raise

    def _on_settled(self) -> None:
        """A posted batch's answer was handled (a failure nobody waited for is recorded by now)."""
        with self._settled:
            self._unsettled -= 1
            self._settled.notify_all()

    def _wait_settled(self) -> None:
        timeout = self.link.runtime.config.request_timeout
        with self._settled:
            if not self._settled.wait_for(lambda: self._unsettled == 0 or self.link.lost is not None, timeout):
                raise GenieConnectionError(f"genie-daemon at {self.link.endpoint} did not answer within {timeout:.0f}s")
        if self._unsettled and self.link.lost is not None:
            raise GenieConnectionError(self.link.lost)

    # ------------------------------------------------------------ errors from batches nobody waited for

    def record_async_error(self, exc: BaseException) -> None:
        if self._async_error is None:
            self._async_error = exc

    def note_failure(self, reply) -> None:
        """A failure the daemon reports with an answer because it poisoned no tensor (an op with no
        outputs, e.g. a replay of a program that failed to define): raised at the next sync."""
        failed = reply.body.get("failed")
        if failed is not None:
            self.record_async_error(remote_error(RemoteError(failed), self.link.endpoint))

    def _raise_async_error(self) -> None:
        exc, self._async_error = self._async_error, None
        if exc is not None:
            raise exc

    # ------------------------------------------------------------ synchronisation points

    def _anything_to_send(self) -> bool:
        """Ops, frees, batches put back, or drops of programs (those wait while a block records)."""
        return bool(self.ops or self.deaths.dead or self.unsent or (self.dropped_programs and self.recording is None))

    def flush(self, settings: list | None = None) -> None:
        """Send what is queued without waiting; a failure of the batch is kept for the next sync.
        `settings`: the numerics settings (numerics.read()) the queued ops run under, when not
        this process's current ones."""
        with self.lock, held_between_waits():  # taken and sent, or put back (see `put_back`)
            if self._anything_to_send():
                self._post_unwaited(self._take(fetch=[], report=False, settings=settings))

    def synchronize(self) -> None:
        """Wait until every op queued so far has run on the daemon.

        With nothing queued, the answers to batches already posted say that: no round trip."""
        with self.lock, held_between_waits():  # taken and sent, or put back (see `put_back`)
            future = None
            if self._anything_to_send():
                future = self._post(self._take(fetch=[], report=False), wait=True, direct=True)
        if future is not None:
            self.note_failure(self.link.wait(future))
        self.link.collect_direct()
        self._wait_settled()
        self._raise_async_error()

    def fetch_async(self, handles: list[int], direct: bool = False, largest: int | None = None
                    ) -> concurrent.futures.Future:
        """`direct=True` only for callers that block on the result right away (with `link.wait`:
        it may return an answered stand-in, not a Future). `largest`: the
        biggest fetched tensor's bytes, when known: below the bulk threshold the request does not
        ask for the bulk lane, and the daemon may answer it on its event loop (one thread hop less)."""
        self._not_while_recording("reading a tensor's value")
        with self.lock, held_between_waits():  # taken and sent, or put back (see `put_back`)
            return self._post(self._take(fetch=handles, report=False, largest=largest), wait=True, direct=direct)

    def fetch(self, handles: list[int], largest: int | None = None) -> list[torch.Tensor]:
        return self.take_fetched(self.link.wait(self.fetch_async(handles, direct=True, largest=largest)))

    def take_fetched(self, reply) -> list[torch.Tensor]:
        """The reply's fetched tensors, all taken before an earlier batch's error is raised (see decode_fetched)."""
        fetched = self.decode_fetched(reply)
        self.note_failure(reply)
        self._raise_async_error()
        return fetched

    def bulk_transfers(self, reply) -> list[int]:
        """Transfer ids of the fetched tensors that come on the bulk lane."""
        return [d["bulk"] for d in reply.body["fetched"] if isinstance(d, dict) and "bulk" in d]

    def decode_fetched(self, reply) -> list[torch.Tensor]:
        """The fetched tensors of `reply`. A tensor that failed on the daemon raises, but only once
        every other one is taken: a bulk transfer left unclaimed, or a shared segment untaken,
        would stay held (the daemon reuses a segment only once the tensor over it is freed)."""
        out, failure = [], None
        fetched = reply.body["fetched"]
        for desc in fetched:
            if isinstance(desc, dict) and ("bulk" in desc or "segment" in desc):
                try:
                    out.append(self._take_bulk(desc) if "bulk" in desc else self._take_named(desc))
                except BaseException:  # Ctrl-C while waiting for the bytes, or a failure: the
                    # rest of what the reply names is let go (else held for good)
                    self.link.abandon_fetched(fetched[len(out):])
                    self.link.took(fetched)
                    raise
                continue
            if isinstance(desc, dict):
                err = desc.get("error") or {}
                failure = failure or remote_execution_error(err.get("op"), _explained(err.get("message", ""), self.link.endpoint),
                                                            err.get("type", "RuntimeError"), daemon=self.link.endpoint)
                out.append(None)
                continue
            if type(desc) is not list or len(desc) not in (3, 4):
                raise ProtocolError(f"bad fetched tensor {desc!r}")
            frame, dtype, shape = desc[:3]
            frames = check_frames(frame, len(reply.frames))
            shape = check_shape(shape)
            out.append(laid_out(frames_to_tensor([reply.frames[i].buffer for i in frames], parse_dtype(dtype), shape),
                                 desc[3] if len(desc) == 4 else None))
        self.link.took(fetched)
        if failure is not None:
            raise failure
        return out

    def _take_bulk(self, desc: dict) -> torch.Tensor:
        lane = self.link.bulk_lane
        xfer, dtype, shape = desc.get("bulk"), parse_dtype(desc.get("dtype")), check_shape(desc.get("shape"))
        if lane is None or type(xfer) is not int:
            raise GenieConnectionError(f"genie-daemon at {self.link.endpoint} sent a bulk transfer this client "
                                       "cannot receive")
        try:
            raw = lane.arrivals.take(xfer, self.link.runtime.config.request_timeout)
            return laid_out(bytes_as_tensor(raw, dtype, shape, f"bulk transfer {xfer}"), desc.get("strides"))
        except (TimeoutError, ConnectionError, ProtocolError) as e:
            raise GenieConnectionError(f"genie-daemon at {self.link.endpoint}: {e}") from None

    def _take_named(self, desc: dict) -> torch.Tensor:
        """A fetched tensor the daemon copied into one of its shared segments and named in the reply."""
        lane = self.link.bulk_lane
        where, dtype, shape = desc.get("segment"), parse_dtype(desc.get("dtype")), check_shape(desc.get("shape"))
        try:
            if lane is None or not bulk.is_segment_name(where):
                raise ProtocolError(f"a fetched tensor named in a shared segment this client cannot read: {where!r}")
            return laid_out(bytes_as_tensor(self.link.take_named(desc, where), dtype, shape, f"segment {where[0]}"),
                             desc.get("strides"))
        except ProtocolError as e:
            raise GenieConnectionError(f"genie-daemon at {self.link.endpoint}: {e}") from None

    def run_reported(self, entry: list) -> Any:
        """Queue `entry` last and run the batch now, returning its outputs described by the daemon."""
        self._not_while_recording(f"{entry[0]} (its result is a value or has a data-dependent shape)")
        with self.lock:
            # Not send_now: an entry that filled the batch went out with it, unreported (its
            # answer came back empty, and the op was captured and run a second time).
            self.append(entry, send_now=False)
            with held_interrupts() if self.pending_bulk else held_between_waits():
                # With bulk bytes to follow, the request cannot go direct (that thread would block
                # on the answer before sending them).
                future = self._post(self._take(fetch=[], report=True), wait=True, direct=not self.pending_bulk)
                self._send_pending_bulk()
        reply = self.link.wait(future)
        self.note_failure(reply)
        self._raise_async_error()
        return reply.body["report"]


# Handle ids made inside a torch.accelerator.Graph capture whose graph has not been replayed yet,
# as (endpoint, first id, end id): the capture ran nothing, so they exist on the daemon only from
# the first replay (see frontend/graphs.py). Consulted only to explain a failure.
unreplayed_captures: set[tuple[str, int, int]] = set()
_MISSING_HANDLE = re.compile(r"handle (\d+) does not exist")


def _explained(message: str, endpoint: str) -> str:
    """A daemon's error message, with the reason when it names a handle made by a capture not yet replayed."""
    missing = _MISSING_HANDLE.search(message) if unreplayed_captures else None
    if missing and any(at == endpoint and first <= int(missing.group(1)) < end
                       for at, first, end in list(unreplayed_captures)):
        message += (" (it was made inside a torch.accelerator.Graph capture, which runs nothing: it "
                    "has a value once the graph has been replayed)")
    return message


def remote_error(exc: RemoteError, endpoint: str) -> RemoteExecutionError:
    return remote_execution_error(exc.op, _explained(exc.message, endpoint), exc.error_type, daemon=endpoint)


__all__ = ["DeviceStream", "HandleRef", "remote_error"]
