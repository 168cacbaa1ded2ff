"""The daemon's answers about memory: `stats` (figures for torch.remote_accelerator.memory_*),
resetting peaks, and emptying caches. Run by the worker thread, in order with the asking
client's requests, like the CUDA calls they stand for.

`MemoryQueries` is a mixin of `DaemonServer`.
"""
from __future__ import annotations

import torch

from genie.transport.errors import ProtocolError

from . import fused
from .hardware import host_ram


class MemoryQueries:
    """The memory half of DaemonServer (its devices, account, clients, executor and bulk lanes)."""

    def _stats(self, body: dict) -> dict:
        dev = body.get("dev", 0)
        if type(dev) is not int or not 0 <= dev < len(self.devices):
            raise ProtocolError(f"bad device index {dev!r}")
        device = self.devices[dev]
        stats = {
            "resident": self.account.allocated,
            "resident_peak": self.account.peak,
            "handles": sum(len(c.tensors) for c in self.clients.values()),
            "persistent_handles": sum(len(c.persistent) for c in self.clients.values()),
            "generators": sum(len(c.own_generators) for c in self.clients.values()),
            "copy_memos": sum(len(c.copy_memos) for c in self.clients.values()),
            "clients": len(self.clients),
            "mailbox_bytes": self.mailbox.bytes,
            # Uploads in, and not yet taken by the request that reads them (see bulk_server.expire_unclaimed).
            "upload_bytes_waiting": self.bulk.waiting_bytes() if self.bulk is not None else 0,
            "segment_bytes_lent": self.bulk.segment_bytes_lent() if self.bulk is not None else 0,
            # Clients whose lanes came to a tcp daemon's local listener from its own user.
            "local_lane_clients": len(self.bulk.local_users) if self.bulk is not None else 0,
            # Tensors this daemon sent to peer daemons, and of those, on lanes (see peers.PeerLinks).
            "peer_bytes_sent": self.peers.bytes_sent if self.peers is not None else 0,
            "peer_lane_bytes_sent": self.peers.lane_bytes_sent if self.peers is not None else 0,
            "peer_lanes": self.peers.lane_paths() if self.peers is not None else {},
            "peer_lane_counts": self.peers.lane_counts() if self.peers is not None else {},
            "peer_direct_lanes": self.peers.direct_paths() if self.peers is not None else {},
            "peer_direct_deposits": self.peers.direct_deposits if self.peers is not None else 0,
            "peer_segment_bytes_lent": self.peers.segment_bytes_lent() if self.peers is not None else 0,
            "parked_requests": sum(len(q) for q in self._parked.values()),
            "limit": self.memory_limit,
            "process_cap": self.process_cap or 0,
            "programs": sum(len(c.programs) for c in self.clients.values()),  # recorded genie.graph blocks held
            "program_segments": dict(fused.counts),
            **self.executor.gpu_path_stats(),
            **self.kv_store.stats(),
        }
        if device.type == "cuda":
            from .cuda_staging import memory_figures

            stats.update(memory_figures(device))
            stats["free"], stats["total"] = torch.cuda.mem_get_info(device)
        else:
            # The CPU path has no pooled allocator (tensors come from the system allocator), so
            # reserved equals allocated and there is no pool fragmentation to report.
            stats.update(allocated=self.account.allocated, reserved=self.account.allocated, peak=self.account.peak,
                         reserved_peak=self.account.peak, fragmentation=0.0, **self._host_memory())
        return stats

    def _host_memory(self) -> dict:
        """free/total for a CPU device: the memory limit when one is set, else the host's RAM."""
        total, available = host_ram()
        if self.memory_limit:
            headroom = max(0, self.memory_limit - self.account.allocated)
            total, available = self.memory_limit, min(available, headroom) if available else headroom
        return {"free": available, "total": total}

    def _reset_peak(self) -> dict:
        """Peaks start again from what is allocated now (all clients, like CUDA's per process)."""
        self.account.peak = self.account.allocated
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        return {}

    def _empty_cache(self) -> dict:
        """Memory kept for reuse goes back to the system (the executor's caches, and idle receive
        buffers of the bulk lanes); in order with the asking client's requests, like a CUDA call."""
        released = self.executor.release_cached()
        if self.bulk is not None:
            released += self.bulk.pool.release_idle()
        return {"released": released}
