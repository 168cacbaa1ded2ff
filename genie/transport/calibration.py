"""Device throughput probe, shared by the daemon (reports it in hello) and the client (local device).

It lives in the transport package only because that is the one Genie package the
daemon may import; it does no I/O. The scheduler needs measured FLOP/s, not
constants: a short fp32 matmul run, best of a few repetitions.
"""
from __future__ import annotations

import time

import torch


def matmul_flops(device: torch.device, size: int | None = None, repeats: int = 3) -> float:
    if size is None:
        size = 2048 if device.type == "cuda" else 384
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        (a @ b).sum().item() if device.type == "cuda" else a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size ** 3 / best
