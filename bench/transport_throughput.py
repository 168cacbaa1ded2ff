"""Tensor transfer throughput from 4 KB to 1 GB, over tcp and ipc, against the baselines.

In one run, for each size and transport:
- raw socket: `sendall` / `recv_into` between two processes (TCP loopback, or a Unix socket for ipc,
  with the same widened buffers as Genie's bulk lane), the receiver answering one byte: the best a
  byte stream can do here;
- plain pyzmq: a DEALER sends the payload as one zero-copy frame, a ROUTER answers with an ack;
- Genie upload: `t.to("remote_accelerator:0")` then synchronize, to a genie-daemon process;
- Genie download: `.cpu()` of a tensor resident on the daemon.
Over ipc Genie is measured twice: as it runs by default (payloads of 4 MiB and more in shared
memory, client and daemon being one user on one host) and with the daemon's --no-shared-memory
(the same payloads through the Unix socket).
Throughput is payload bytes / median time of several repetitions (25 for payloads up to 16 MB,
fewer for larger ones, at least --repeats).

    python -m bench.transport_throughput [--max-mb 1024] [--repeats 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import tempfile
import time

import torch
import zmq

from bench.common import machine, median, print_table, write_json
from genie.transport.bulk import widen_buffers

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]


def repetitions(n: int, repeats: int) -> int:
    """At least `repeats`; more for small payloads (up to 25, about 0.25 s at 2 GB/s), whose
    times are short enough for this shared machine's noise to move a median of three."""
    return max(repeats, min(25, int(0.25 / (n / 2e9))))


# ---------------------------------------------------------------- raw sockets


def _raw_server(family, address, ready, max_size):
    srv = socket.socket(family, socket.SOCK_STREAM)
    widen_buffers(srv)
    srv.bind(address)
    srv.listen(1)
    ready.put(srv.getsockname())
    conn, _ = srv.accept()
    if family == socket.AF_INET:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(max_size)
    view = memoryview(buf)
    while True:
        header = conn.recv(8, socket.MSG_WAITALL)
        if len(header) < 8:
            return
        n = int.from_bytes(header, "little")
        got = 0
        while got < n:
            got += conn.recv_into(view[got:n], n - got)
        conn.sendall(b"k")


def raw_socket_times(kind: str, sizes: list[int], repeats: int) -> dict[int, float]:
    if kind == "tcp":
        family, address = socket.AF_INET, ("127.0.0.1", 0)
    else:
        family, address = socket.AF_UNIX, os.path.join(tempfile.mkdtemp(), "raw.sock")
    ready = mp.Queue()
    p = mp.Process(target=_raw_server, args=(family, address, ready, max(sizes)), daemon=True)
    p.start()
    cli = socket.socket(family, socket.SOCK_STREAM)
    widen_buffers(cli)
    cli.connect(ready.get(timeout=30))
    if family == socket.AF_INET:
        cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle delay on small sends
    out = {}
    for n in sizes:
        payload = memoryview(bytearray(n))
        times = []
        for _ in range(repetitions(n, repeats) + 1):
            t0 = time.perf_counter()
            cli.sendall(n.to_bytes(8, "little"))
            cli.sendall(payload)
            cli.recv(1)
            times.append(time.perf_counter() - t0)
        out[n] = median(times[1:])
    cli.close()
    p.terminate()
    return out


# ---------------------------------------------------------------- plain pyzmq


def _zmq_server(endpoint, ready):
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    if endpoint.endswith(":0"):
        port = s.bind_to_random_port(endpoint.rsplit(":", 1)[0])
        endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"
    else:
        s.bind(endpoint)
    ready.put(endpoint)
    while True:
        identity, _payload = s.recv_multipart(copy=False)
        s.send_multipart([identity, b"k"])


def zmq_times(kind: str, sizes: list[int], repeats: int) -> dict[int, float]:
    endpoint = "tcp://127.0.0.1:0" if kind == "tcp" else f"ipc://{tempfile.mkdtemp()}/zmq.sock"
    ready = mp.Queue()
    p = mp.Process(target=_zmq_server, args=(endpoint, ready), daemon=True)
    p.start()
    ctx = zmq.Context()
    c = ctx.socket(zmq.DEALER)
    c.connect(ready.get(timeout=30))
    out = {}
    for n in sizes:
        payload = bytearray(n)
        times = []
        for _ in range(repetitions(n, repeats) + 1):
            t0 = time.perf_counter()
            c.send(payload, copy=n < 65536)
            c.recv()
            times.append(time.perf_counter() - t0)
        out[n] = median(times[1:])
    c.close(0)
    ctx.term()
    p.terminate()
    return out


# ---------------------------------------------------------------- genie


def genie_times(endpoint: str, sizes: list[int], repeats: int) -> tuple[dict[int, float], dict[int, float]]:
    import genie

    genie.init(endpoint)
    ra = torch.remote_accelerator
    up, down = {}, {}
    for n in sizes:
        host = torch.empty(n // 4, dtype=torch.float32).fill_(1.0)
        t_up, t_down = [], []
        for _ in range(repetitions(n, repeats) + 1):
            t0 = time.perf_counter()
            remote = host.to("remote_accelerator:0")
            ra.synchronize()
            t_up.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = remote.cpu()
            t_down.append(time.perf_counter() - t0)
            del remote, back
        up[n], down[n] = median(t_up[1:]), median(t_down[1:])
    genie.shutdown()
    return up, down


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-mb", type=float, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    sizes = [s for s in SIZES if s <= args.max_mb * 2**20]
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from daemons import DaemonProcess

    results = {}
    for kind, variants in (("tcp", [("tcp", [])]),
                           ("ipc", [("ipc", []), ("ipc, no shared memory", ["--no-shared-memory"])])):
        raw = raw_socket_times(kind, sizes, args.repeats)
        plain = zmq_times(kind, sizes, args.repeats)
        for label, extra in variants:
            listen = "tcp://127.0.0.1:0" if kind == "tcp" else f"ipc://{tempfile.mkdtemp()}/genie.sock"
            with DaemonProcess(listen, extra=extra) as d:
                up, down = genie_times(d.endpoint, sizes, args.repeats)
            results[label] = {
                str(n): {"raw_MBps": n / raw[n] / 1e6, "zmq_MBps": n / plain[n] / 1e6,
                         "genie_up_MBps": n / up[n] / 1e6, "genie_down_MBps": n / down[n] / 1e6}
                for n in sizes
            }
    m = machine()
    print(f"# tensor transfer throughput (MB/s), medians of {args.repeats} to 25 runs -- {m['cpus']} cpus, "
          f"pyzmq {m['pyzmq']}, libzmq {m['libzmq']}")
    rows = []
    for kind, per_size in results.items():
        for n, r in per_size.items():
            n = int(n)
            label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
            rows.append((kind, label, f"{r['raw_MBps']:.0f}", f"{r['zmq_MBps']:.0f}", f"{r['genie_up_MBps']:.0f}",
                         f"{r['genie_down_MBps']:.0f}",
                         f"{min(r['genie_up_MBps'], r['genie_down_MBps']) / r['raw_MBps'] * 100:.0f}%"))
    print_table(rows, ("transport", "size", "raw socket", "pyzmq", "genie up", "genie down", "genie/raw (worse way)"))
    print("wrote", write_json("transport_throughput", {"sizes": sizes, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
