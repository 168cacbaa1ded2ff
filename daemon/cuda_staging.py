"""GPU data path of the daemon: pinned staging buffers and a copy stream.

Device memory itself comes from torch's CUDA caching allocator: it already does
what seed 004's chunked allocator describes (large cudaMalloc segments, split
into blocks, recycled without returning to the driver), it is what every kernel
torch launches allocates from, and its statistics (allocated, reserved, peak,
inactive split bytes = fragmentation) are what `stats` reports on a GPU. Writing
a second allocator beside it would only fragment memory between the two.

What torch does not do for us is the host side of a transfer: a payload arriving
in a ZeroMQ frame is pageable memory, and a copy from pageable memory to the
GPU is synchronous and slow. `PinnedStaging.upload` copies it into a pinned
buffer taken from a pool (recycled once the copy that used it has finished),
starts a non_blocking host-to-device copy on a dedicated copy stream, and makes
the compute stream wait for it with an event, so compute never waits on the host.
`PinnedStaging.download` is the way back for large results: device-to-host into a
recycled pinned buffer (not a fresh pageable one, whose first touch alone costs
more than the copy), sent from there. Nothing here runs on a machine without CUDA.
"""
from __future__ import annotations

import collections
import contextlib

import torch

from genie.transport.tensors import dense_bytes


class PinnedPool:
    """Pinned host buffers by power-of-two size class, reused after their copy has completed."""

    def __init__(self, max_cached_bytes: int = 1 << 30) -> None:
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._in_use: list[tuple[torch.cuda.Event, int, torch.Tensor]] = []
        self.cached_bytes = 0
        self.max_cached_bytes = max_cached_bytes
        self.pinned_bytes = 0  # pinned host memory this pool has allocated (cached or in use)

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return 1 << max(12, (nbytes - 1).bit_length())

    def _reclaim(self) -> None:
        still = []
        for event, size, buf in self._in_use:
            if event.query():
                if self.cached_bytes + size <= self.max_cached_bytes:
                    self._free[size].append(buf)
                    self.cached_bytes += size
                else:
                    self.pinned_bytes -= size  # dropped: freed with `buf`
            else:
                still.append((event, size, buf))
        self._in_use = still

    def take(self, nbytes: int) -> torch.Tensor:
        self._reclaim()
        size = self._size_class(nbytes)
        if self._free[size]:
            self.cached_bytes -= size
            return self._free[size].pop()
        self.pinned_bytes += size
        # A normal tensor, not an inference tensor: a buffer first taken for an upload (which runs
        # in the daemon's inference mode) is written outside it by a later download.
        with torch.inference_mode(False):
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def release_idle(self) -> int:
        """Unpin and drop the free buffers (empty_cache); the bytes let go."""
        self._reclaim()
        released = 0
        for size, buffers in self._free.items():
            released += size * len(buffers)
            buffers.clear()
        self.cached_bytes -= released
        self.pinned_bytes -= released
        return released

    def give_back_after(self, buf: torch.Tensor, event: torch.cuda.Event) -> None:
        self._in_use.append((event, buf.numel(), buf))


class PinnedStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)
        self.pool = PinnedPool()
        self.uploads = 0
        self.bytes = 0
        self.downloads = 0
        self.download_bytes = 0

    def stats(self) -> dict:
        return {"uploads": self.uploads, "bytes": self.bytes, "downloads": self.downloads,
                "download_bytes": self.download_bytes, "pinned_bytes": self.pool.pinned_bytes}

    @contextlib.contextmanager
    def download(self, t: torch.Tensor):
        """The bytes of a GPU tensor in a pinned buffer, as a memoryview valid inside the block
        (the caller sends them synchronously); the buffer goes back to the pool after it."""
        src = dense_bytes(t.detach())
        nbytes = src.numel()
        staging = self.pool.take(nbytes)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            staging[:nbytes].copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        done.synchronize()
        self.downloads += 1
        self.download_bytes += nbytes
        try:
            yield memoryview(staging[:nbytes].numpy())
        finally:
            self.pool.give_back_after(staging, done)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a CPU tensor (from a received frame), ordered before later compute."""
        nbytes = host.numel() * host.element_size()
        if nbytes == 0:
            return host.to(self.device)
        self.uploads += 1
        self.bytes += nbytes
        staging = self.pool.take(nbytes)
        flat = host.reshape(-1).view(torch.uint8)
        staging[:nbytes].copy_(flat)
        with torch.cuda.stream(self.copy_stream):
            raw = staging[:nbytes].to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        raw.record_stream(torch.cuda.current_stream(self.device))
        self.pool.give_back_after(staging, done)
        return raw.view(host.dtype).view(host.shape)


def memory_figures(device: torch.device) -> dict:
    stats = torch.cuda.memory_stats(device)
    reserved = stats.get("reserved_bytes.all.current", 0)
    inactive = stats.get("inactive_split_bytes.all.current", 0)
    return {
        "allocated": stats.get("allocated_bytes.all.current", 0),
        "reserved": reserved,
        "peak": stats.get("allocated_bytes.all.peak", 0),
        "reserved_peak": stats.get("reserved_bytes.all.peak", 0),
        "fragmentation": inactive / reserved if reserved else 0.0,
    }
