"""Shared helpers for the benchmarks: medians, machine facts, JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch


def machine() -> dict:
    import zmq

    return {
        "python": platform.python_version(), "torch": torch.__version__, "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }


def blocking_waits() -> int:
    """Answers this process has blocked on, over all daemons: on a real network, a round trip each."""
    import genie

    return sum(s["blocking_waits"] for s in genie.transport_stats().values())


def timed(fn) -> float:
    """Seconds one call of `fn` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs) -> float:
    return statistics.median(xs)


def results_dir() -> str:
    """bench/results, or GENIE_BENCH_RESULTS (the tests' smoke runs write elsewhere)."""
    return os.environ.get("GENIE_BENCH_RESULTS") or os.path.join(os.path.dirname(__file__), "results")


def write_json(name: str, data: dict) -> str:
    out_dir = results_dir()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine(), **data}, f, indent=1)
    return path


def print_table(rows: list[tuple], header: tuple) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
