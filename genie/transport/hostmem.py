"""Recycled host buffers for received payloads.

Writing into freshly allocated memory costs a page fault per 4 KiB page, which
on a loopback link is slower than the copy itself (measured here: 64 MiB into a
new buffer 0.8 GB/s, into a reused one 6 GB/s). Large receive buffers therefore
come from this pool: big blocks, mapped with transparent huge pages where the
kernel gives them without stalling (one fault per 2 MiB), handed out again once
every tensor viewing them is gone. A block is free when the pool's own tensor is the only
holder of its storage, which torch's storage use count tells us.
"""
from __future__ import annotations

import mmap
import threading

import torch

POOL_MIN_BYTES = 1 << 20        # smaller payloads are cheap to allocate; not pooled
_CLASS_BYTES = 2 << 20          # blocks are whole huge pages


def _storage_users(t: torch.Tensor) -> int:
    """Tensors (and other holders) sharing `t`'s storage, `t` included."""
    storage = t.untyped_storage()  # this Python wrapper holds one reference of its own
    return torch._C._storage_Use_Count(storage._cdata) - 1


THP_DEFRAG = "/sys/kernel/mm/transparent_hugepage/defrag"


def _huge_pages_without_stalls() -> bool:
    """Whether asking for huge pages (MADV_HUGEPAGE) is safe: only where the kernel's defrag
    setting is `defer` or `never`, so that a fault takes a free huge page or else a small one.
    Under `madvise`, `always` or `defer+madvise`, a fault in an advised region first compacts
    memory, synchronously: on this machine (`madvise`) fresh receive blocks then filled at
    0.27-0.39 GB/s, against 1.0-1.7 GB/s with small pages (uploads of 4-256 MiB, two runs each
    way; reused blocks run at 2-3.5 GB/s either way)."""
    try:
        with open(THP_DEFRAG) as f:
            setting = f.read()
    except OSError:
        return False
    chosen = setting[setting.find("[") + 1:setting.find("]")] if "[" in setting else setting.strip()
    return chosen in ("defer", "never")


_ADVISE_HUGE = hasattr(mmap, "MADV_HUGEPAGE") and _huge_pages_without_stalls()


def allocate_host(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of `nbytes`, backed by huge pages where that never stalls the fault."""
    if nbytes < POOL_MIN_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _ADVISE_HUGE:
        try:
            block.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages still work
            pass
    return torch.frombuffer(block, dtype=torch.uint8)  # the tensor keeps the mapping alive


class HostBufferPool:
    """Size-classed free lists of host blocks; `take` returns a uint8 view of exactly `nbytes`."""

    def __init__(self, max_idle_bytes: int, min_bytes: int = POOL_MIN_BYTES, class_bytes: int = _CLASS_BYTES) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.min_bytes = min_bytes  # smaller takes are plain allocations
        self.class_bytes = class_bytes  # block sizes are multiples of this
        self._blocks: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.reuses = 0
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes < self.min_bytes or self.max_idle_bytes <= 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = -(-nbytes // self.class_bytes) * self.class_bytes
        with self._lock:
            for block in self._blocks.get(size, ()):
                if _storage_users(block) == 1:
                    self.reuses += 1
                    return block[:nbytes]  # a view: the block counts as in use while it lives
            self._trim(size)
            block = allocate_host(size)
            self._blocks.setdefault(size, []).append(block)
            self.allocations += 1
            return block[:nbytes]

    def _trim(self, incoming: int) -> None:
        """Drop idle blocks until idle bytes plus the incoming block fit the bound."""
        idle = [(s, b) for s, blocks in self._blocks.items() for b in blocks if _storage_users(b) == 1]
        total = sum(s for s, _ in idle)
        for size, block in idle:
            if total + incoming <= self.max_idle_bytes:
                break
            self._blocks[size] = [b for b in self._blocks[size] if b is not block]
            total -= size

    def release_idle(self) -> int:
        """Drop every idle block (torch.remote_accelerator.empty_cache); the bytes let go."""
        with self._lock:
            released = 0
            for size, blocks in self._blocks.items():
                kept = [b for b in blocks if _storage_users(b) != 1]
                released += size * (len(blocks) - len(kept))
                self._blocks[size] = kept
            return released

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s for s, blocks in self._blocks.items() for b in blocks if _storage_users(b) == 1)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(s * len(blocks) for s, blocks in self._blocks.items())

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()


# Snapshots of payloads that leave later than they are taken (inline payloads; the daemon's inline
# answers): copies into fresh memory cost a page fault per 4 KiB and made 1 MiB transfers ~40%
# slower (measured: uploads 1.9-2.2 -> 0.9-1.4 GB/s); recycled blocks do not. Below 64 KiB
# allocations are cheap (and ZeroMQ copies such frames anyway).
_SNAPSHOTS = HostBufferPool(max_idle_bytes=64 << 20, min_bytes=64 << 10, class_bytes=64 << 10)


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of dense CPU tensor `t` (same dtype, shape and strides), in a recycled block when
    it is large. The block is reused once nothing views it any more."""
    nbytes = t.numel() * t.element_size()
    if nbytes < _SNAPSHOTS.min_bytes:
        return t.clone()
    # Dense: its elements fill exactly numel() places from its lowest one, so the same strides fit.
    out = _SNAPSHOTS.take(nbytes).view(t.dtype).as_strided(t.shape, t.stride())
    return out.copy_(t)
