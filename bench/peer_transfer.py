"""Daemon to daemon: a tensor moved between two genie-daemons, against moving it through the client.

`x.to("remote_accelerator:1")` of a tensor on another daemon's device goes daemon to daemon: the
first daemon greets the second as a client does and sends large tensors on its bulk lanes (four
TCP connections over TCP, `genie-daemon --peer-lanes`). What a program would do without that is
read the tensor back and send it on: `x.cpu().to("remote_accelerator:1")`. In one run, for each
size and each pair of daemons, these take turns copy by copy:
- peer: `x.to(dev1)` then `synchronize(1)` (until the second daemon holds the bytes), with the
  daemons' default lanes, and with one lane each (a second pair started with `--peer-lanes 1`);
  copies of 8 MiB and more are split across the lanes;
- through the client: `x.cpu().to(dev1)` then `synchronize(1)`;
- raw socket: the same bytes once over one TCP connection and a one-byte answer (the floor of
  one hop; bench.transport_throughput's baseline), beside the default pair's copies.
With `--ipc` the daemons listen on ipc:// (one host, one user): a peer then copies large tensors
into a shared segment the other maps (since 2026-11-28; before, through the Unix socket), measured
against a pair started with --no-shared-memory, and the raw socket is a Unix socket.
With `--local` they listen on tcp:// on this host as they run by default there: a peer's lane goes
to the other's local listener (an abstract Unix socket named in hello) and large tensors travel in
shared memory, as with `--ipc`; measured against a pair started with --no-local-lane (tcp lanes),
with a TCP raw socket.
With `--curve` the daemons run under CURVE (sharing a key pair, as a cluster's daemons do): their
lanes to each other, and the client's, are sealed (AES-GCM); the raw socket stays plaintext.
Times are medians over rounds (4x --repeats up to 16 MiB); the ratio to the client path is the
median of the ratios within a round. Both daemons and the client share this machine's cores. After the rounds, the copy's
values are checked against the source.

    python -m bench.peer_transfer [--sizes-mb 4,16,64,256] [--repeats 5] [--curve] [--ipc | --local]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench.common import machine, median, print_table, timed, write_json
from bench.transport_throughput import RawSocket, curve_keys

SRC, DST = "remote_accelerator:0", "remote_accelerator:1"


def _peer_lanes() -> list:
    """Daemon 0's lanes to its peer (its `stats`): [how they carry bytes, how many connections]."""
    import genie

    stream = genie.get_runtime().streams[0]
    stream.synchronize()
    stats = stream.link.request("stats", {"dev": stream.local_index}).body
    return [[stats["peer_lanes"][peer], count] for peer, count in stats["peer_lane_counts"].items()]


def _pair(extra: list[str], ipc: bool = False, local: bool = False):
    from daemons import DaemonProcess, ipc_endpoint

    if ipc:
        return DaemonProcess(ipc_endpoint()[0], extra=extra), DaemonProcess(ipc_endpoint()[0], extra=extra)
    return tuple(DaemonProcess("tcp://127.0.0.1:0", extra=extra, local_lane=local) for _ in range(2))


def _cluster_keys() -> tuple[dict, list[str]]:
    """CURVE keys for a run: the client's (genie.init's key arguments), and the daemons' flags; the
    daemons allow their own public key, so each takes the other as a client."""
    import shutil

    client, flags = curve_keys()
    allowed = flags[flags.index("--allow-keys") + 1]
    shutil.copy(client["server_key"], os.path.join(allowed, "daemon.key"))
    return client, flags


def measure(sizes: list[int], repeats: int, curve: bool = False, ipc: bool = False, local: bool = False) -> dict:
    import genie
    from genie_daemon.peers import PEER_LANE_MIN_BYTES

    keys, flags = _cluster_keys() if curve else ({}, [])
    if ipc:  # one lane over a Unix socket either way; shared memory (the default) or not
        variants = {"peer, shared memory": [], "peer, Unix socket": ["--no-shared-memory"]}
    elif local:
        variants = {"peer, local lane": [], "peer, tcp lanes": ["--no-local-lane"]}
    else:
        variants = {"peer, default lanes": [], "peer, one lane": ["--peer-lanes", "1"]}
    first_variant = next(iter(variants))
    pairs = {name: _pair(extra + flags, ipc, local) for name, extra in variants.items()}
    raw = RawSocket("ipc" if ipc else "tcp", max(sizes))
    out: dict = {"lanes": {}, "curve": curve, "ipc": ipc, "local": local}
    try:
        for a, b in pairs.values():
            a.start(), b.start()
        for n in sizes:
            times: dict[str, list[float]] = {k: [] for k in (*variants, "through the client", "raw socket")}
            ratios: dict[str, list[float]] = {k: [] for k in variants}
            checks = []
            for name, (a, b) in pairs.items():
                genie.init(f"{a.endpoint},{b.endpoint}", **keys)
                try:
                    x = torch.randn(n // 4, device=SRC)
                    # Untimed: the first large copy greets the peer (inside ZeroMQ) and its answer
                    # opens the lanes (a copy below PEER_LANE_MIN_BYTES greets no one and goes
                    # inside ZeroMQ, lanes or not); then buffers of this size exist on both ends.
                    opener = torch.randn(max(n, PEER_LANE_MIN_BYTES) // 4, device=SRC)
                    deadline = time.monotonic() + 30
                    while not _peer_lanes():
                        if time.monotonic() > deadline:
                            raise RuntimeError("daemon 0 opened no lane to daemon 1")
                        opener.to(DST)
                        time.sleep(0.05)
                    del opener
                    for _ in range(2):
                        x.to(DST), x.cpu().to(DST)
                        torch.remote_accelerator.synchronize(1)
                    # More rounds of small copies: a few ms each, and the machine's noise is larger.
                    for _ in range(repeats * 4 if n <= 16 << 20 else repeats):
                        peer = timed(lambda: (x.to(DST), torch.remote_accelerator.synchronize(1)))
                        hop = timed(lambda: (x.cpu().to(DST), torch.remote_accelerator.synchronize(1)))
                        times[name].append(peer)
                        ratios[name].append(hop / peer)
                        if name == first_variant:
                            times["through the client"].append(hop)
                            times["raw socket"].append(raw.transfer(n))
                    checks.append(torch.equal(x.to(DST).cpu(), x.cpu()))
                    out["lanes"][name] = _peer_lanes()
                finally:
                    genie.shutdown()
            if not all(checks):
                raise AssertionError(f"a daemon-to-daemon copy of {n} bytes differs from its source")
            out[str(n)] = {
                "ms": {k: median(v) * 1e3 for k, v in times.items()},
                "GBps": {k: n / median(v) / 1e9 for k, v in times.items()},
                "speedup_over_client_path": {k: median(v) for k, v in ratios.items()},
            }
    finally:
        raw.close()
        for a, b in pairs.values():
            a.stop(), b.stop()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="4,16,64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--curve", action="store_true", help="daemons under CURVE: sealed lanes between them")
    p.add_argument("--ipc", action="store_true", help="ipc:// daemons on this host: shared memory between them, "
                   "against --no-shared-memory (the Unix socket)")
    p.add_argument("--local", action="store_true", help="tcp:// daemons on this host with their local lanes "
                   "(shared memory), against --no-local-lane (tcp lanes)")
    args = p.parse_args(argv)
    if args.ipc and args.local:
        p.error("--ipc and --local are two different pairs: one at a time")
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mb.split(",")]
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    result = measure(sizes, args.repeats, args.curve, args.ipc, args.local)
    m = machine()
    where = "ipc (one host)" if args.ipc else "tcp loopback" + (", local lanes" if args.local else "")
    print(f"# daemon to daemon over {where}{', CURVE' if args.curve else ''} -- {m['cpus']} cpus, torch {m['torch']}, "
          f"medians of {args.repeats} rounds (ms; GB/s; speed-up over x.cpu().to(dev1))")
    print("lanes from daemon 0 to daemon 1 [kind, connections]:", result["lanes"])
    rows = []
    for n in sizes:
        r = result[str(n)]
        label = f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / (1 << 10):g} KiB"
        rows.append((label, *(f"{r['ms'][k]:.1f} ({r['GBps'][k]:.2f})" for k in r["ms"]),
                     *(f"{r['speedup_over_client_path'][k]:.2f}x" for k in r["speedup_over_client_path"])))
    first = result[str(sizes[0])]
    print_table(rows, ("size", *first["ms"], *(f"{k}: speed-up" for k in first["speedup_over_client_path"])))
    name = "peer_transfer" + ("_curve" if args.curve else "") + ("_ipc" if args.ipc else "") + ("_local" if args.local else "")
    print("wrote", write_json(name,
                              {**result, "repeats": args.repeats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
