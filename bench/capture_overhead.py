"""Capture overhead per op (hot metadata cache) against the floor, and tiny-op round-trip latency.

The floor is a minimal `__torch_dispatch__` wrapper subclass that records
nothing and returns a new wrapper: what any Python-level capture pays.

Capture is timed twice: alone (the batch is sent after the timed loop, so the daemon,
which shares this host's cores, does not compete with it: on a real deployment it runs
on another machine), and as usual (batches sent every 32 ops while the daemon runs them
on the same cores). As usual, capture runs at most 1,024 ops ahead of the daemon (as CUDA
launches do): where the daemon is the slower, that time is its pace, so the time until those
ops have also run (capture + synchronize, per op) is reported beside it.
The round trip is `(x + 1).item()` through a local genie-daemon process,
against a plain pyzmq DEALER/ROUTER echo between two processes. Each ratio is the median of
ratios of pairs timed in turns (capture and floor chunk by chunk, round trip and echo block by
block), so that both sides of a ratio see the same machine.

    python -m bench.capture_overhead [--ops 20000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch

import genie
from bench.common import machine, median, print_table, write_json


class Floor(torch.Tensor):
    """Records nothing: the cost of reaching Python for an op at all."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return Floor(args[0])


CHUNK = 2000  # ops timed per batch when capture is timed alone (a small batch keeps the heap small, as in use)


def per_op_us(x, n: int) -> float:
    y = x
    t0 = time.perf_counter()
    for _ in range(n // 4):
        y = x + 1.0
        y = y * x
        y = torch.relu(y)
        y = y.view(-1)
    return (time.perf_counter() - t0) / (n // 4 * 4) * 1e6


def echo_server(endpoint_q, stop_q) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    endpoint_q.put(f"tcp://127.0.0.1:{port}")
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    while stop_q.empty():
        if poller.poll(100):
            s.send_multipart(s.recv_multipart())
    s.close(0)
    ctx.term()


class ZmqEcho:
    """A DEALER talking to `echo_server` in another process; `us(n)` times n round trips of 64 bytes."""

    def __init__(self) -> None:
        import zmq

        self.stop_q = mp.Queue()
        endpoint_q = mp.Queue()
        self.process = mp.Process(target=echo_server, args=(endpoint_q, self.stop_q), daemon=True)
        self.process.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint_q.get(timeout=30))
        self.us(100)  # warm

    def us(self, n: int) -> float:
        msg = [b"x" * 64]
        t0 = time.perf_counter()
        for _ in range(n):
            self.sock.send_multipart(msg)
            self.sock.recv_multipart()
        return (time.perf_counter() - t0) / n * 1e6

    def close(self) -> None:
        self.stop_q.put(1)
        self.sock.close(0)
        self.ctx.term()
        self.process.join(5)


def roundtrip_us(x, n: int) -> float:
    for _ in range(20):
        (x + 1).item()
    t0 = time.perf_counter()
    for _ in range(n):
        (x + 1).item()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--roundtrips", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    dev = "remote_accelerator:0"
    lazy = torch.randn(16, 16, device=dev)
    floor = Floor(torch.randn(16, 16))
    per_op_us(lazy, 2000), per_op_us(floor, 2000)  # warm caches
    # Capture and its floor take turns, chunk by chunk, and each ratio is of a pair timed a moment
    # apart: this shared machine's speed drifts by tens of percent between seconds. Alone: each
    # chunk of CHUNK ops is held in one batch and sent (untimed) after it is timed.
    capture, shared, done, base, capture_ratios = [], [], [], [], []
    stream = genie.get_runtime().stream(0)
    for _ in range(args.repeats):
        default_batch, stream.batch_ops = stream.batch_ops, CHUNK + 1
        try:
            for _ in range(max(1, args.ops // CHUNK)):
                base.append(per_op_us(floor, CHUNK))
                capture.append(per_op_us(lazy, CHUNK))
                capture_ratios.append(capture[-1] / base[-1])
                torch.remote_accelerator.synchronize()
        finally:
            stream.batch_ops = default_batch
        t0 = time.perf_counter()
        shared.append(per_op_us(lazy, args.ops))
        torch.remote_accelerator.synchronize()
        done.append((time.perf_counter() - t0) / (args.ops // 4 * 4) * 1e6)
    # The round trip and the echo take turns likewise, one block of each per repeat.
    scalar = torch.ones((), device=dev)
    echo_client = ZmqEcho()
    rtt, echo, rtt_ratios = [], [], []
    try:
        for _ in range(args.repeats):
            rtt.append(roundtrip_us(scalar, args.roundtrips))
            echo.append(echo_client.us(args.roundtrips))
            rtt_ratios.append(rtt[-1] / echo[-1])
    finally:
        echo_client.close()

    result = {
        "capture_us_per_op": median(capture), "floor_us_per_op": median(base),
        "capture_over_floor": median(capture_ratios),
        "capture_with_daemon_us_per_op": median(shared), "captured_and_run_us_per_op": median(done),
        "tiny_op_roundtrip_us": median(rtt), "zmq_echo_us": median(echo),
        "roundtrip_over_echo": median(rtt_ratios),
        "runs": {"capture": capture, "capture_with_daemon": shared, "captured_and_run": done, "floor": base, "roundtrip": rtt, "echo": echo},
        "meta_cache": genie.capture_stats(),
    }
    m = machine()
    print(f"# capture overhead and round trip -- torch {m['torch']}, {m['cpus']} cpus, medians of {args.repeats}")
    print_table([
        ("capture per op (hot cache)", f"{result['capture_us_per_op']:.1f} us", f"{result['capture_over_floor']:.2f}x floor"),
        ("floor: no-op __torch_dispatch__", f"{result['floor_us_per_op']:.1f} us", "1.00x"),
        ("capture per op, daemon running on the same cores", f"{result['capture_with_daemon_us_per_op']:.1f} us",
         f"{result['capture_with_daemon_us_per_op'] / result['floor_us_per_op']:.2f}x floor"),
        ("  and run: capture + synchronize, per op", f"{result['captured_and_run_us_per_op']:.1f} us", ""),
        ("tiny op round trip (x+1).item()", f"{result['tiny_op_roundtrip_us']:.0f} us",
         f"{result['roundtrip_over_echo']:.2f}x echo"),
        ("pyzmq DEALER/ROUTER echo (tcp)", f"{result['zmq_echo_us']:.0f} us", "1.00x"),
    ], ("measure", "median", "ratio"))
    print("wrote", write_json("capture_overhead", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
