"""A cap on the daemon process's own memory, so no single request can take the host down.

`--memory-limit` accounts tensors that clients keep, and refuses a request after its op has
allocated. An absurd allocation (a hostile `aten::ones([1 << 20, 1 << 20])`) must fail before
that, inside the allocator: on CPU-only daemons the process data limit (RLIMIT_DATA, which
covers malloc and private mmap) is set a margin above what tensors may legitimately use, so
torch raises a clear allocation error, the op is poisoned, and the daemon carries on instead
of waking the kernel's OOM killer.
"""
from __future__ import annotations

import logging
import os
import resource

import torch

log = logging.getLogger("genie.daemon")

MARGIN_MIN = 2 << 30  # interpreter, libraries, ZeroMQ buffers, temporaries inside one op
HOST_SHARE = 0.9      # never let the daemon ask for more than this share of the host's memory


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def process_cap(memory_limit: int, pooled_bytes: int, host_bytes: int) -> int:
    """Bytes the process may map: tensors + pooled receive buffers + a margin, within the host's share."""
    share = int(host_bytes * HOST_SHARE) if host_bytes else 0
    if not memory_limit:
        return share
    wanted = memory_limit + pooled_bytes + max(memory_limit // 4, MARGIN_MIN)
    return min(wanted, share) if share else wanted


def cap_process_memory(devices: list[torch.device], memory_limit: int, pooled_bytes: int) -> int | None:
    """Apply the cap; the bytes applied, or None where it does not apply (CUDA daemons, no figure)."""
    if any(d.type == "cuda" for d in devices):
        # The CUDA driver maps large private regions; device memory has its own OOM errors.
        return None
    cap = process_cap(memory_limit, pooled_bytes, physical_memory())
    if not cap:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        return soft  # already tighter
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    except (ValueError, OSError) as e:
        log.warning("could not cap the daemon's memory at %d bytes: %s", cap, e)
        return None
    log.info("process memory capped at %.3g GiB (RLIMIT_DATA)", cap / 2**30)
    return cap


def is_allocation_failure(exc: BaseException) -> bool:
    """torch's CPU allocator (and Python) report a refused allocation this way."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)
