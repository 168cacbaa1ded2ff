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
(the same payloads through the Unix socket). With CURVE (`--only curve`, in the default run; up to
256 MiB), over tcp: as it runs by default (payloads from 128 KiB on a sealed bulk lane, AES-GCM) and
with GENIE_SEALED_MIN_KB=0 (every payload inside ZeroMQ messages, encrypted by CURVE: as before
sealed lanes); the raw socket and pyzmq baselines stay plaintext, so the ratio is what encryption costs.
Over tcp Genie runs as by default: four bulk lanes (connections), payloads from 8 MiB split across
them (see genie/transport/lane_set.py); `--only lanes` (in the default run; from 4 MiB) measures it
with one lane (GENIE_BULK_LANES=1) beside. The raw socket is one connection throughout.
Those tcp daemons run with --no-local-lane, as from another host; `--only local` (in the default
run) measures a tcp daemon as it runs for a client on its own host: lanes on its local Unix socket,
payloads in shared memory, against the same TCP raw socket.
The four take turns in rounds of a few transfers each, and Genie's ratio to the raw socket is the
median over rounds of the ratio within a round, so that each ratio compares times taken under the
same conditions (this shared machine's speed drifts by tens of percent from one second to the
next). Throughput is payload bytes / median time of several repetitions (up to 60 for payloads up
to 16 MB, fewer for larger ones, at least --repeats). Steady state is measured: before the rounds
of a size, each method runs two untimed transfers of it (the raw server's buffer was allocated and
touched before any timing; a daemon's first two receive blocks of a size are fresh memory, slow to
fault in on some VMs), and the first upload's own rate is kept as `genie_first_up_MBps`.

    python -m bench.transport_throughput [--max-mb 1024] [--min-mb 0] [--repeats 3] [--only tcp,ipc,curve]
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import socket
import tempfile
import time

import torch
import zmq

from bench.common import machine, median, print_table, write_json
from genie.transport.bulk import widen_buffers

ROUNDS = 10  # the methods take turns at most this many times per size (at least --repeats)
CURVE_MAX_BYTES = 256 << 20  # ZeroMQ under CURVE moves ~0.3 GB/s here: 1 GiB rounds would take minutes
SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]


def repetitions(n: int, repeats: int) -> int:
    """At least `repeats`; more for small payloads (up to 60, about 0.5 s at 2 GB/s), whose
    times are short enough for this shared machine's noise to move a median of a few."""
    return max(repeats, min(60, int(0.5 / (n / 2e9))))


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
    serve_transfers(conn, memoryview(bytearray(max_size)))


def serve_transfers(conn: socket.socket, view: memoryview) -> None:
    """The raw baseline's receiving end: transfers of a u64 length and that many bytes into
    `view`, each answered by one byte, until the sender closes."""
    while True:
        header = conn.recv(8, socket.MSG_WAITALL)
        if len(header) < 8:
            return
        n = int.from_bytes(header, "little")
        got = 0
        while got < n:
            received = conn.recv_into(view[got:n], n - got)
            if not received:
                return
            got += received
        conn.sendall(b"k")


class RawSocket:
    """A client of `_raw_server` in another process; `transfer(n)` times one payload and its ack."""

    def __init__(self, kind: str, max_size: int) -> None:
        if kind == "tcp":
            family, address = socket.AF_INET, ("127.0.0.1", 0)
        else:
            family, address = socket.AF_UNIX, os.path.join(tempfile.mkdtemp(), "raw.sock")
        ready = mp.Queue()
        self.process = mp.Process(target=_raw_server, args=(family, address, ready, max_size), daemon=True)
        self.process.start()
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        widen_buffers(self.sock)
        self.sock.connect(ready.get(timeout=30))
        if family == socket.AF_INET:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle delay on small sends
        self.payload = memoryview(bytearray(max_size))

    def transfer(self, n: int) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(n.to_bytes(8, "little"))
        self.sock.sendall(self.payload[:n])
        self.sock.recv(1)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.process.terminate()


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


class PlainZmq:
    """A DEALER talking to `_zmq_server` in another process; `transfer(n)` times one payload and its ack."""

    def __init__(self, kind: str, max_size: int) -> None:
        endpoint = "tcp://127.0.0.1:0" if kind == "tcp" else f"ipc://{tempfile.mkdtemp()}/zmq.sock"
        ready = mp.Queue()
        self.process = mp.Process(target=_zmq_server, args=(endpoint, ready), daemon=True)
        self.process.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(ready.get(timeout=30))
        self.payload = memoryview(bytearray(max_size))

    def transfer(self, n: int) -> float:
        t0 = time.perf_counter()
        self.sock.send(self.payload[:n], copy=n < 65536)
        self.sock.recv()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        self.process.terminate()


# ---------------------------------------------------------------- genie


class GenieTransfers:
    """`upload(n)`: `t.to("remote_accelerator:0")` then synchronize; `download()`: `.cpu()` of it."""

    def __init__(self, endpoint: str, keys: dict | None = None, sealed: bool = True, lanes: int = 0) -> None:
        import genie
        from genie import config

        runtime = genie.get_runtime()
        default = config.load().sealed_min_bytes
        runtime.config = dataclasses.replace(runtime.config, sealed_min_bytes=default if sealed else 0,
                                             bulk_lanes=lanes)
        genie.init(endpoint, **(keys or {}))
        self.genie = genie
        self.remote = None
        # One-time costs of a process's first remote ops (planning `.to()`'s ops; PyTorch's lazy
        # imports, which genie.init now does): not a cost of any transfer size.
        self.upload(torch.ones(256))
        self.download()

    def upload(self, host: torch.Tensor) -> float:
        t0 = time.perf_counter()
        self.remote = host.to("remote_accelerator:0")
        torch.remote_accelerator.synchronize()
        return time.perf_counter() - t0

    def download(self) -> float:
        t0 = time.perf_counter()
        back = self.remote.cpu()
        elapsed = time.perf_counter() - t0
        del back
        self.remote = None
        return elapsed

    def close(self) -> None:
        self.genie.shutdown()


def interleaved_times(kind: str, endpoint: str, sizes: list[int], repeats: int, keys: dict | None = None,
                      sealed: bool = True, lanes: int = 0) -> dict[str, dict[int, float]]:
    """Per size: median seconds per transfer of the raw socket, plain pyzmq, and Genie up and down;
    Genie's paired ratios to the raw socket ("up_ratio", "down_ratio": raw time / Genie time,
    median over rounds); and the first upload's seconds ("first_up").

    This machine's speed drifts by tens of percent from one second to the next, so the methods
    take turns, in rounds: each round runs a short block of each (a warm-up transfer, not
    counted, then the block), and medians are over all rounds. A ratio then compares times taken
    under the same conditions, and each method still runs warm, back to back, as it would alone
    (taking turns transfer by transfer made the raw socket, whose buffers the others had just
    pushed out of the cache, the slowest of the three)."""
    raw, plain = RawSocket(kind, max(sizes)), PlainZmq(kind, max(sizes))
    gen = GenieTransfers(endpoint, keys, sealed, lanes)
    keys = ("raw", "zmq", "up", "down", "up_ratio", "down_ratio", "first_up")
    out: dict[str, dict[int, float]] = {k: {} for k in keys}
    try:
        for n in sizes:
            host = torch.empty(n // 4, dtype=torch.float32).fill_(1.0)
            times: dict[str, list[float]] = {k: [] for k in keys}
            times["first_up"].append(gen.upload(host))
            gen.download()
            for _ in range(2):  # steady state for each method (see the module's text)
                raw.transfer(n), plain.transfer(n)
                gen.upload(host), gen.download()
            reps = repetitions(n, repeats)
            # At least `repeats` rounds, even of the largest payloads (one transfer each after its
            # warm-up): one round of three there left a ratio to a single moment of the machine.
            rounds = min(ROUNDS, max(repeats, reps // 3))
            for _ in range(rounds):
                block = -(-reps // rounds)
                round_times: dict[str, list[float]] = {"raw": [], "zmq": [], "up": [], "down": []}
                for name, transfer in (("raw", raw.transfer), ("zmq", plain.transfer)):
                    round_times[name] = [transfer(n) for _ in range(block + 1)][1:]
                for i in range(block + 1):
                    up, down = gen.upload(host), gen.download()
                    if i:
                        round_times["up"].append(up)
                        round_times["down"].append(down)
                for name, spent in round_times.items():
                    times[name].extend(spent)
                raw_s = median(round_times["raw"])
                times["up_ratio"].append(raw_s / median(round_times["up"]))
                times["down_ratio"].append(raw_s / median(round_times["down"]))
            for k in out:
                out[k][n] = median(times[k])
    finally:
        gen.close()
        plain.close()
        raw.close()
    return out


def curve_keys() -> tuple[dict, list[str]]:
    """A daemon key pair and a client's, made for this run: (genie.init's key arguments, the
    daemon's flags)."""
    import subprocess
    import sys

    folder = tempfile.mkdtemp()
    allowed = os.path.join(folder, "allowed")
    os.mkdir(allowed)
    for name in ("daemon", "bench"):
        subprocess.run([sys.executable, "-m", "genie_daemon", "keygen", folder, "--name", name], check=True,
                       capture_output=True, timeout=60)
    os.replace(os.path.join(folder, "bench.key"), os.path.join(allowed, "bench.key"))
    return (dict(client_key=os.path.join(folder, "bench.key_secret"), server_key=os.path.join(folder, "daemon.key")),
            ["--curve-secret", os.path.join(folder, "daemon.key_secret"), "--allow-keys", allowed])


def worse_way(r: dict) -> float:
    """Genie's throughput over the raw socket's, the worse of upload and download: the median of
    ratios within rounds, or in results from before those were kept, the ratio of medians."""
    if "genie_up_over_raw" in r:
        return min(r["genie_up_over_raw"], r["genie_down_over_raw"])
    return min(r["genie_up_MBps"], r["genie_down_MBps"]) / r["raw_MBps"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-mb", type=float, default=1024)
    p.add_argument("--min-mb", type=float, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="tcp,ipc,curve,lanes,local",
                   help="transports to measure: tcp, ipc, curve (tcp with CURVE), lanes (tcp with one bulk lane), "
                        "local (a tcp daemon's local lane: shared memory with a client on its host)")
    args = p.parse_args(argv)
    sizes = [s for s in SIZES if args.min_mb * 2**20 <= s <= args.max_mb * 2**20]
    kinds = set(args.only.split(","))
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from daemons import DaemonProcess

    results = {}
    for kind, variants in (("tcp", [("tcp", [])]),
                           ("lanes", [("tcp, 1 lane", [])]),
                           ("local", [("tcp, local lane", [])]),
                           ("ipc", [("ipc", []), ("ipc, no shared memory", ["--no-shared-memory"])]),
                           ("curve", [("tcp, CURVE, sealed lane", []), ("tcp, CURVE, all in ZeroMQ", [])])):
        if kind not in kinds:
            continue
        client_keys, daemon_flags = curve_keys() if kind == "curve" else (None, [])
        for label, extra in variants:
            listen = f"ipc://{tempfile.mkdtemp()}/genie.sock" if kind == "ipc" else "tcp://127.0.0.1:0"
            sizes_here = [n for n in sizes if (kind != "curve" or n <= CURVE_MAX_BYTES)
                          and (kind != "lanes" or n >= 4 << 20)]
            if not sizes_here:
                continue
            with DaemonProcess(listen, extra=extra + daemon_flags, local_lane=kind == "local") as d:
                t = interleaved_times("ipc" if kind == "ipc" else "tcp", d.endpoint, sizes_here, args.repeats,
                                      client_keys, sealed="all in ZeroMQ" not in label,
                                      lanes=1 if kind == "lanes" else 0)
            results[label] = {
                str(n): {"raw_MBps": n / t["raw"][n] / 1e6, "zmq_MBps": n / t["zmq"][n] / 1e6,
                         "genie_up_MBps": n / t["up"][n] / 1e6, "genie_down_MBps": n / t["down"][n] / 1e6,
                         "genie_up_over_raw": t["up_ratio"][n], "genie_down_over_raw": t["down_ratio"][n],
                         "genie_first_up_MBps": n / t["first_up"][n] / 1e6}
                for n in sizes_here
            }
    m = machine()
    print(f"# tensor transfer throughput (MB/s), medians of {args.repeats} to 60 runs in turns -- {m['cpus']} cpus, "
          f"pyzmq {m['pyzmq']}, libzmq {m['libzmq']}")
    rows = []
    for kind, per_size in results.items():
        for n, r in per_size.items():
            n = int(n)
            label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
            rows.append((kind, label, f"{r['raw_MBps']:.0f}", f"{r['zmq_MBps']:.0f}", f"{r['genie_up_MBps']:.0f}",
                         f"{r['genie_down_MBps']:.0f}",
                         f"{worse_way(r) * 100:.0f}%", f"{r['genie_first_up_MBps']:.0f}"))
    print_table(rows, ("transport", "size", "raw socket", "pyzmq", "genie up", "genie down",
                       "genie/raw (worse way, in rounds)", "first genie up"))
    print("wrote", write_json("transport_throughput", {"sizes": sizes, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
