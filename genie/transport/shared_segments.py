"""Shared-memory segments: bulk payloads between two processes of one user on one host, copied once.

On a Unix-socket bulk lane (an ipc:// daemon) whose peer runs as the same user,
the sender copies a payload into a memory segment (a memfd) and sends a short
record naming it; the first record naming a segment carries its file descriptor
(SCM_RIGHTS). The receiver maps each segment once and hands out the payload in
place, as a tensor over the mapping: one memcpy in all, where a socket copies
every byte twice (into the socket buffer and out of it). When that tensor's
storage is freed the receiver hands the segment back (a finalizer on the array
the tensor was made from), and the sender reuses it; segments are recycled, as
fresh shared pages cost a fault and a zeroing each (measured: 1.1-1.4 GB/s).

Safety. Segments are sealed against shrinking and growing, so neither side can
truncate one under the other's mapping (touching a mapped page past the end of
a file raises SIGBUS, which would kill the daemon); the receiver checks the
seals, the size and its bound before mapping. The sender keeps a writable
mapping, so it could change a payload the receiver is using: that is why these
lanes are only agreed between processes of the same user (SO_PEERCRED), which
can already signal or trace each other.
"""
from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import socket
import stat
import struct
import threading
import weakref
from typing import Callable

import numpy as np
import torch

from .death_notes import DeathNotes
from .errors import ProtocolError
from .interrupts import held_interrupts

SEGMENT_CLASS_BYTES = 2 << 20  # segment sizes are multiples of this
MAX_PEER_BYTES = 64 << 30      # the most a receiver maps of one peer's segments at once
MAX_PEER_SEGMENTS = 4096       # and in how many mappings (a process has ~65,000: vm.max_map_count)
IDLE_BYTES = 1 << 30           # the most a sender keeps of segments nobody uses, for reuse
REQUIRED_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)


def supported() -> bool:
    """Whether this platform has what segments need: memfd with seals, and fd passing on sockets."""
    return (hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING") and hasattr(fcntl, "F_ADD_SEALS")
            and hasattr(fcntl, "F_GET_SEALS") and hasattr(socket, "send_fds") and hasattr(socket, "SO_PEERCRED"))


def host_id() -> str | None:
    """A digest of this kernel's boot id: equal in two processes only when they run on one machine
    (containers on one host share it, though not always a network or mount namespace). Daemons
    say it in hello, to clients on the network too: a digest, not the id itself."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        return None
    return hashlib.sha256(b"genie-host:" + boot_id.encode()).hexdigest() if boot_id else None


def same_user(sock) -> bool:
    """Whether the process at the other end of Unix socket `sock` runs as this process's user."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    except OSError:
        return False
    _pid, uid, _gid = struct.unpack("iII", creds)  # struct ucred
    return uid == os.getuid()


def size_class(nbytes: int) -> int:
    return -(-nbytes // SEGMENT_CLASS_BYTES) * SEGMENT_CLASS_BYTES


class Segment:
    """The sender's segment: a sealed memfd mapped read-write; `busy` while the receiver holds it."""

    def __init__(self, ident: int, nbytes: int) -> None:
        self.ident = ident
        self.nbytes = nbytes
        self.fd = os.memfd_create(f"genie-bulk-{ident}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            self.array = np.frombuffer(mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED), dtype=np.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        self.peer_has_fd = False
        self.peer_attached = False  # handed back once: the receiver has it mapped for sure
        self.busy = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the mapping lives on while `array` does
            self.fd = -1


class OutgoingSegments:
    """The sender's segments, one transfer in each at a time, made on demand up to `max_bytes` in
    all (the receiver's bound), of which at most `idle_bytes` are kept while nobody uses them.

    Segments in use are memory the receiver is using (its tensors live in them, e.g. a model's
    weights on the daemon), so they are bounded only as the receiver bounds them; the idle ones
    are a cache of already-faulted memory (a fresh segment is written at ~1.2 GB/s here, a
    reused one at memcpy speed), bounded like the host buffer pool."""

    def __init__(self, max_bytes: int = MAX_PEER_BYTES, idle_bytes: int = IDLE_BYTES,
                 max_segments: int = MAX_PEER_SEGMENTS) -> None:
        self.max_bytes = max_bytes
        self.idle_bytes = idle_bytes
        self.max_segments = max_segments
        self._segments: dict[int, Segment] = {}
        self._next_ident = 1
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> tuple[Segment | None, list[int]]:
        """A free segment of `nbytes`' size class, marked busy (None: none fits within the bound),
        and the idents of idle segments dropped to make room: the receiver must forget them."""
        size = size_class(nbytes)
        dropped: list[int] = []
        with self._lock:
            segment = self._take_free(size, attached_only=False)
            if segment is not None:
                return segment, dropped
            total = sum(s.nbytes for s in self._segments.values())
            idle = sum(s.nbytes for s in self._segments.values() if not s.busy)
            for segment in [s for s in self._segments.values() if not s.busy]:  # first made, first dropped
                if (total + size <= self.max_bytes and idle <= self.idle_bytes
                        and len(self._segments) < self.max_segments):
                    break
                del self._segments[segment.ident]
                segment.close()
                total -= segment.nbytes
                idle -= segment.nbytes
                if segment.peer_has_fd:
                    dropped.append(segment.ident)
            if total + size > self.max_bytes or len(self._segments) >= self.max_segments:
                return None, dropped
            try:
                segment = Segment(self._next_ident, size)
            except OSError:  # no memory or fds for it: this payload goes through the socket
                return None, dropped
            self._next_ident += 1
            segment.busy = True
            self._segments[segment.ident] = segment
            return segment, dropped

    def acquire_attached(self, nbytes: int) -> Segment | None:
        """A free segment of `nbytes`' size class that the receiver has mapped (it handed it back
        once), marked busy; None if there is none. Makes and drops nothing."""
        with self._lock:
            return self._take_free(size_class(nbytes), attached_only=True)

    def _take_free(self, size: int, attached_only: bool) -> Segment | None:
        """(Lock held.) A free segment of exactly `size` bytes (the receiver has mapped it, if
        `attached_only`), marked busy."""
        for segment in self._segments.values():
            if not segment.busy and segment.nbytes == size and (segment.peer_attached or not attached_only):
                segment.busy = True
                return segment
        return None

    def give_back(self, segment: Segment) -> None:
        """The segment was taken but not sent (the send failed before its record went out)."""
        with self._lock:
            segment.busy = False

    def release(self, ident: int) -> None:
        """The receiver no longer uses segment `ident`."""
        with self._lock:
            segment = self._segments.get(ident)
            if segment is None or not segment.busy:
                raise ProtocolError(f"release of segment {ident}, which is not in use")
            segment.busy = False
            segment.peer_attached = True

    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._segments.values())

    def lent_bytes(self) -> int:
        """Bytes in segments the receiver has not handed back (in use, or never taken)."""
        with self._lock:
            return sum(s.nbytes for s in self._segments.values() if s.busy)

    def close(self) -> None:
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()


class IncomingSegments:
    """The receiver's mappings of its peer's segments, and which of them it still uses.

    `on_free(ident)` is called (from whichever thread drops the last tensor over a payload) once a
    payload's storage is freed: the segment goes back to the sender.

    A Ctrl-C can land in any Python finalizer, and one landing in the finalizer that handed a
    segment back lost it for good (the sender never reused it; scripts/interrupt_fuzz.py, 1 in
    about 4,200 checks). So a payload's death is first noted in C (death_notes.py: no Python
    frame), and a finalizer then hands back whatever is noted (`reclaim`). A Ctrl-C that comes
    while it runs is kept for the program's next Genie call (any `weakref.finalize` callback
    runs whole: `interrupts.runs_whole`); should something still cut it (a handler the program set since
    Genie's last call), what is noted is handed back by the next `reclaim` (the next payload's
    death, or the next payload taken).
    """

    def __init__(self, on_free: Callable[[int], None], max_bytes: int = MAX_PEER_BYTES,
                 max_segments: int = MAX_PEER_SEGMENTS) -> None:
        self.max_bytes = max_bytes
        self.max_segments = max_segments
        self._maps: dict[int, mmap.mmap] = {}
        self._busy: set[int] = set()
        self._mapped = 0
        self._on_free = on_free
        self._lock = threading.Lock()
        self._deaths = DeathNotes()  # busy segments, each watching its payload

    def attach(self, ident: int, fd: int) -> None:
        """Map segment `ident` from `fd` (which this call closes) after checking what it is."""
        try:
            with self._lock:
                if ident in self._maps:
                    raise ProtocolError(f"segment {ident} is already attached")
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ProtocolError("a shared segment must be a memory file")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise ProtocolError("a shared segment must be a sealable memory file (memfd)") from None
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise ProtocolError("a shared segment must be sealed against shrinking and growing")
            size = info.st_size
            with self._lock:
                if (size <= 0 or size % SEGMENT_CLASS_BYTES or self._mapped + size > self.max_bytes
                        or len(self._maps) >= self.max_segments):
                    raise ProtocolError(f"a shared segment of {size} bytes is refused ({self._mapped} of at most "
                                        f"{self.max_bytes} bytes mapped, in {len(self._maps)} segments)")
                self._maps[ident] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                self._mapped += size
        finally:
            os.close(fd)

    def payload(self, ident: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of segment `ident` as a uint8 tensor, in place; the segment counts as
        in use until that tensor's storage is freed."""
        if self._deaths.dead:
            self.reclaim()
        with held_interrupts():  # in use and its hand-back set up, or neither (a Ctrl-C between kept it for good)
            with self._lock:
                mapping = self._maps.get(ident)
                if mapping is None:
                    raise ProtocolError(f"unknown shared segment {ident}")
                if ident in self._busy:
                    raise ProtocolError(f"shared segment {ident} reused before it was handed back")
                if not 0 < nbytes <= len(mapping):
                    raise ProtocolError(f"{nbytes} bytes do not fit shared segment {ident}")
                self._busy.add(ident)
            array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
            # When the tensor below lets go of `array`, the later of these runs first: the death
            # is noted (C), then the finalizer hands it back.
            release = weakref.finalize(array, self.reclaim)
            release.atexit = False  # at exit there is nobody to hand it back to
            self._deaths.watch(array, ident)
        return torch.from_numpy(array)

    def reclaim(self) -> None:
        """Hand back the segments whose payloads died (see the class)."""
        with held_interrupts():
            while self._deaths.dead:
                ident = self._deaths.take()
                if ident is None:  # another thread took the last one
                    return
                with self._lock:
                    self._busy.discard(ident)
                self._on_free(ident)

    def forget(self, ident: int) -> None:
        with self._lock:
            if ident in self._busy or ident not in self._maps:
                raise ProtocolError(f"forget of shared segment {ident}, which is unknown or in use")
            mapping = self._maps.pop(ident)
            self._mapped -= len(mapping)
        # Unmapped when the last array over it goes (mmap.close() would fail while arrays export it).
        del mapping

    def in_use(self) -> int:
        if self._deaths.dead:
            self.reclaim()
        with self._lock:
            return len(self._busy)
