"""Transfers over a link that caps each TCP flow: one bulk lane against several (GENIE_BULK_LANES).

Cloud networks commonly cap each flow well below the link (5 Gbit/s a flow on links of 25-100
Gbit/s), and one connection's bytes are copied by one core at each end. This bench makes such a
link here: a network namespace joined by a veth pair, with an htb class per hash bucket of the
client's TCP port on both ends (u32 filters over 256 buckets), each capped at --flow-mbit. The
daemon runs inside the namespace; the client here reaches it at its veth address.

In one run, for each size: the raw socket with one flow and with as many flows as the most lanes
(sendall/recv_into, the receiver answering one byte), then Genie's upload (`.to()` + synchronize)
and download (`.cpu()`) with 1, 2 and 4 bulk lanes, each with its own daemon. Medians of
--repeats transfers after two untimed ones. The flows' buckets are printed: two flows that share
a bucket share one cap (the table says so). With --curve, Genie's daemons run with CURVE keys, so
its lanes are sealed (each with keys of its own); the raw socket stays plaintext.

Needs root, `ip` and `tc` with the htb qdisc and u32 filter; says so and stops otherwise.

    sudo python -m bench.flow_cap [--flow-mbit 2000] [--sizes-mb 16,64] [--repeats 7] [--curve]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import torch

from bench.common import machine, median, print_table, write_json
from bench.transport_throughput import curve_keys, serve_transfers

NAMESPACE = f"genie-flowcap-{os.getpid()}"
HOST_SIDE, NS_SIDE = "gfc0", "gfc1"
HOST_ADDR, NS_ADDR = "10.213.0.1", "10.213.0.2"
BUCKETS = 256
LANE_COUNTS = (1, 2, 4)


def bucket(port: int) -> int:
    """The hash bucket (so the rate cap) a client port falls in: bits 1-8 (connect() picks even ports)."""
    return (port >> 1) & (BUCKETS - 1)


def _run(cmd: list[str], namespace: bool = False, stdin: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", NAMESPACE] if namespace else []
    subprocess.run(prefix + cmd, check=True, capture_output=True, text=True, input=stdin, timeout=60)


def _shape(device: str, port_mask: str, mbit: int, namespace: bool) -> None:
    """htb on `device`'s egress: a class per bucket of the client port (`port_mask` of the TCP
    header's first word), each capped at `mbit`; other traffic (pings, ARP) unlimited."""
    lines = [f"qdisc add dev {device} root handle 1: htb default 999 r2q 100000",
             f"class add dev {device} parent 1: classid 1:999 htb rate 100gbit",
             f"filter add dev {device} parent 1: prio 1 handle 2: protocol ip u32 divisor {BUCKETS}",
             f"filter add dev {device} parent 1: prio 1 protocol ip u32 ht 800:: match ip protocol 6 0xff "
             f"hashkey mask {port_mask} at 20 link 2:"]
    for i in range(BUCKETS):
        lines.append(f"class add dev {device} parent 1: classid 1:{i + 1:x} htb rate {mbit}mbit ceil {mbit}mbit "
                     f"burst 256kb cburst 256kb")
        lines.append(f"filter add dev {device} parent 1: prio 1 protocol ip u32 ht 2:{i:x}: match u32 0 0 "
                     f"flowid 1:{i + 1:x}")
    _run(["tc", "-batch", "-"], namespace, "\n".join(lines) + "\n")


def make_link(mbit: int) -> None:
    _run(["ip", "netns", "add", NAMESPACE])
    _run(["ip", "link", "add", HOST_SIDE, "type", "veth", "peer", "name", NS_SIDE])
    _run(["ip", "link", "set", NS_SIDE, "netns", NAMESPACE])
    _run(["ip", "addr", "add", f"{HOST_ADDR}/24", "dev", HOST_SIDE])
    _run(["ip", "link", "set", HOST_SIDE, "up"])
    _run(["ip", "addr", "add", f"{NS_ADDR}/24", "dev", NS_SIDE], namespace=True)
    _run(["ip", "link", "set", NS_SIDE, "up"], namespace=True)
    _run(["ip", "link", "set", "lo", "up"], namespace=True)
    _shape(HOST_SIDE, "0x01fe0000", mbit, namespace=False)  # uploads: the client's port is the source
    _shape(NS_SIDE, "0x000001fe", mbit, namespace=True)     # downloads: it is the destination


def remove_link() -> None:
    subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True, timeout=60)  # takes the veth pair along
    subprocess.run(["ip", "link", "del", HOST_SIDE], capture_output=True, timeout=60)


def missing() -> str | None:
    """Why this bench cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (it makes a network namespace and shapes its traffic)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2)"
    return None


# ---------------------------------------------------------------- raw sockets


def serve_raw(port: int) -> None:
    """(In the namespace.) Read each connection's transfers: a u64 length, then that many bytes, answered by one byte."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((NS_ADDR, port))
    listener.listen(64)
    print("ready", flush=True)

    while True:
        conn, _ = listener.accept()
        # Untouched pages of the buffer cost nothing: only the largest part read is ever faulted in.
        threading.Thread(target=serve_transfers, args=(conn, memoryview(bytearray(1 << 30))), daemon=True).start()


class RawFlows:
    """`transfer(n)`: n bytes split over this many connections side by side, each answered."""

    def __init__(self, flows: int, port: int) -> None:
        self.socks = [socket.create_connection((NS_ADDR, port), timeout=30) for _ in range(flows)]
        for s in self.socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buckets = [bucket(s.getsockname()[1]) for s in self.socks]

    def transfer(self, payload: memoryview) -> float:
        part = -(-len(payload) // len(self.socks))

        def one(s, piece):
            s.sendall(len(piece).to_bytes(8, "little"))
            s.sendall(piece)
            s.recv(1)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(s, payload[i * part:(i + 1) * part]))
                   for i, s in enumerate(self.socks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    def close(self) -> None:
        for s in self.socks:
            s.close()


# ---------------------------------------------------------------- genie


def genie_times(lanes: int, sizes: list[int], repeats: int, curve: tuple | None = None) -> tuple[dict, list[int]]:
    """Median upload and download seconds per size with `lanes` bulk lanes, and the lanes' buckets.
    `curve`: (genie.init's key arguments, the daemon's flags) for sealed lanes."""
    import genie

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from daemons import DaemonProcess

    # --insecure without CURVE: the namespace's veth is reachable from this host only.
    keys, flags = curve or ({}, ["--insecure"])
    daemon = DaemonProcess(f"tcp://{NS_ADDR}:0", extra=flags)
    daemon.cmd = ["ip", "netns", "exec", NAMESPACE, *daemon.cmd]
    out: dict = {"up": {}, "down": {}}
    with daemon as d:
        runtime = genie.get_runtime()
        saved = runtime.config
        runtime.config = dataclasses.replace(saved, bulk_lanes=lanes)
        try:
            genie.init(d.endpoint, **keys)
            lane = runtime.links[0].bulk_lane
            buckets = [bucket(s.getsockname()[1]) for s in getattr(lane, "sockets", [lane.sock])]
            for n in sizes:
                host = torch.ones(n // 4)
                ups, downs = [], []
                for i in range(repeats + 2):
                    t0 = time.perf_counter()
                    remote = host.to("remote_accelerator:0")
                    torch.remote_accelerator.synchronize()
                    t1 = time.perf_counter()
                    remote.cpu()
                    t2 = time.perf_counter()
                    del remote
                    if i >= 2:
                        ups.append(t1 - t0)
                        downs.append(t2 - t1)
                out["up"][n], out["down"][n] = median(ups), median(downs)
        finally:
            genie.shutdown()
            runtime.config = saved
    return out, buckets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flow-mbit", type=int, default=2000, help="the cap on each TCP flow, Mbit/s")
    p.add_argument("--sizes-mb", default="16,64")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--curve", action="store_true", help="CURVE on: Genie's lanes sealed (the raw socket stays plain)")
    p.add_argument("--serve-raw", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_raw is not None:
        serve_raw(args.serve_raw)
        return 0
    why = missing()
    if why:
        print(f"bench.flow_cap: {why}")
        return 0
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mb.split(",")]
    remove_link()
    server = None
    try:
        try:
            make_link(args.flow_mbit)
        except subprocess.CalledProcessError as e:
            print(f"bench.flow_cap: cannot make the shaped link here: {' '.join(e.cmd)}: {e.stderr.strip()}")
            return 0
        port = 7311
        server = subprocess.Popen(["ip", "netns", "exec", NAMESPACE, sys.executable, "-m", "bench.flow_cap",
                                   "--serve-raw", str(port)], stdout=subprocess.PIPE, text=True,
                                  cwd=os.path.join(os.path.dirname(__file__), ".."))
        server.stdout.readline()
        raw: dict = {}
        raw_buckets: dict = {}
        for flows in (1, max(LANE_COUNTS)):
            conn = RawFlows(flows, port)
            raw_buckets[flows] = conn.buckets
            for n in sizes:
                payload = memoryview(bytearray(n))
                times = [conn.transfer(payload) for _ in range(args.repeats + 2)][2:]
                raw.setdefault(flows, {})[n] = median(times)
            conn.close()
        genie: dict = {}
        genie_buckets: dict = {}
        curve = curve_keys() if args.curve else None
        for lanes in LANE_COUNTS:
            genie[lanes], genie_buckets[lanes] = genie_times(lanes, sizes, args.repeats, curve)
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        remove_link()
    m = machine()
    print(f"# transfers over a veth link capping each TCP flow at {args.flow_mbit} Mbit/s"
          f"{', Genie under CURVE (sealed lanes)' if args.curve else ''} "
          f"({args.flow_mbit / 8:.0f} MB/s), MB/s, medians of {args.repeats} -- {m['cpus']} cpus, torch {m['torch']}")
    rows = []
    for n in sizes:
        size = f"{n >> 20} MiB"
        for flows in raw:
            rows.append((size, f"raw socket, {flows} flow{'s' * (flows > 1)}", f"{n / raw[flows][n] / 1e6:.0f}", "",
                         _buckets_note(raw_buckets[flows])))
        for lanes in LANE_COUNTS:
            t = genie[lanes]
            rows.append((size, f"genie, {lanes} lane{'s' * (lanes > 1)}", f"{n / t['up'][n] / 1e6:.0f}",
                         f"{n / t['down'][n] / 1e6:.0f}", _buckets_note(genie_buckets[lanes])))
    print_table(rows, ("size", "how", "up", "down", "flows' buckets"))
    results = {
        "flow_mbit": args.flow_mbit, "curve": args.curve,
        "raw_MBps": {str(f): {str(n): n / t / 1e6 for n, t in per.items()} for f, per in raw.items()},
        "genie_MBps": {str(lanes): {way: {str(n): n / t / 1e6 for n, t in per.items()} for way, per in g.items()}
                       for lanes, g in genie.items()},
        "buckets": {"raw": raw_buckets, "genie": genie_buckets},
    }
    print("wrote", write_json("flow_cap", results))
    return 0


def _buckets_note(buckets: list[int]) -> str:
    shared = len(buckets) - len(set(buckets))
    return " ".join(map(str, buckets)) + (f" ({shared} shared)" if shared else "")


if __name__ == "__main__":
    raise SystemExit(main())
