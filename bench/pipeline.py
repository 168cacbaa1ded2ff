"""Two-stage pipeline across two genie-daemon processes: back to back vs pipelined.

Stage 1 runs on daemon A, its activation moves daemon-to-daemon to B, stage 2
runs on B. "Back to back" finishes each microbatch (both stages, waiting at
every hand-off) before starting the next: the sum of the stages. "Pipelined"
issues every microbatch without waiting, so A computes microbatch i+1 while
the activation of i is in flight and B computes it. Reports medians of several
runs and the reduction in wall time.

    python -m bench.pipeline [--microbatches 8] [--size 1024] [--depth 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import genie
from bench.common import machine, median, print_table, write_json

A, B = "remote_accelerator:0", "remote_accelerator:1"


def stage(x: torch.Tensor, depth: int) -> torch.Tensor:
    for _ in range(depth):
        x = torch.sin(x) * 1.0001 + 0.001
    return x


def make_inputs(n: int, size: int) -> list[torch.Tensor]:
    return [torch.full((size, size), float(i) / n, device=A) for i in range(n)]


def back_to_back(inputs, depth: int, parts: list | None = None) -> list[float]:
    out = []
    for x in inputs:
        t0 = time.perf_counter()
        h = stage(x, depth)
        torch.remote_accelerator.synchronize(0)       # stage 1 done
        t1 = time.perf_counter()
        h = h.to(B)
        torch.remote_accelerator.synchronize(1)       # transfer done
        t2 = time.perf_counter()
        out.append(stage(h, depth).sum().item())      # stage 2 done
        if parts is not None:
            parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return out


def pipelined(inputs, depth: int) -> list[float]:
    sums = []
    for x in inputs:
        h = stage(x, depth).to(B)   # daemon to daemon; A is not waited for
        sums.append(stage(h, depth).sum())
        genie.flush()               # both daemons can start on what is queued
    return [s.item() for s in sums]


def run(microbatches: int, size: int, depth: int, repeats: int) -> dict:
    inputs = make_inputs(microbatches, size)
    genie.synchronize()
    pipelined(inputs[:2], depth), back_to_back(inputs[:2], depth)  # warm up both paths
    seq, pipe, parts = [], [], []
    for _ in range(repeats):
        for s in genie.get_runtime().streams:
            s.exec_log.clear()
        t0 = time.perf_counter()
        r_seq = back_to_back(inputs, depth, parts)
        seq.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r_pipe = pipelined(inputs, depth)
        pipe.append(time.perf_counter() - t0)
        assert all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(r_seq, r_pipe)), (r_seq, r_pipe)
    return {
        "microbatches": microbatches, "activation_bytes": size * size * 4, "depth": depth,
        "back_to_back_s": median(seq), "pipelined_s": median(pipe),
        "reduction": 1.0 - median(pipe) / median(seq), "runs": {"back_to_back": seq, "pipelined": pipe},
        "stage1_s": median([p[0] for p in parts]), "transfer_s": median([p[1] for p in parts]),
        "stage2_s": median([p[2] for p in parts]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from daemons import DaemonProcess

    with DaemonProcess(extra=["--threads", "1"]) as a, DaemonProcess(extra=["--threads", "1"]) as b:
        genie.init(f"{a.endpoint},{b.endpoint}")
        result = run(args.microbatches, args.size, args.depth, args.repeats)
        genie.shutdown()
    m = machine()
    print(f"# two-stage pipeline over two daemons -- {m['cpus']} cpus, torch {m['torch']}, medians of {args.repeats}")
    print_table([
        ("per microbatch: stage 1 / transfer / stage 2",
         f"{result['stage1_s'] * 1e3:.1f} / {result['transfer_s'] * 1e3:.1f} / {result['stage2_s'] * 1e3:.1f} ms"),
        ("back to back (sum of stages)", f"{result['back_to_back_s'] * 1e3:.0f} ms"),
        ("pipelined", f"{result['pipelined_s'] * 1e3:.0f} ms"),
        ("wall-time reduction", f"{result['reduction'] * 100:.0f}%"),
    ], ("mode", f"{args.microbatches} microbatches of {result['activation_bytes'] / 2**20:.0f} MiB"))
    print("wrote", write_json("pipeline", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
