"""Many clients, one daemon: requests/s and latency percentiles under 1, 4 and 16 client processes.

Each client process connects to the same genie-daemon and runs small requests
(an op on a resident tensor and a blocking `.item()`), checking every answer.
Latency is per request; throughput is all requests over the wall time of the
slowest client (start to finish, after every client has connected).

    python -m bench.many_clients [--clients 1,4,16] [--requests 200]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

from bench.common import machine, print_table, write_json


def client(endpoint: str, requests: int, seed: int, start, out) -> None:
    import torch

    import genie

    genie.init(endpoint)
    x = torch.full((64,), float(seed), device="remote_accelerator:0")
    x.sum().item()
    start.wait()
    lat, wrong = [], 0
    t0 = time.perf_counter()
    for i in range(requests):
        r0 = time.perf_counter()
        got = (x * i).sum().item()
        lat.append(time.perf_counter() - r0)
        wrong += got != 64.0 * seed * i
    out.put((seed, time.perf_counter() - t0, lat, wrong))
    genie.shutdown()


def run(endpoint: str, n: int, requests: int) -> dict:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=client, args=(endpoint, requests, i + 1, start, out)) for i in range(n)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    lat = sorted(x for r in results for x in r[2])
    wall = max(r[1] for r in results)
    return {
        "clients": n, "requests": n * requests, "wrong": sum(r[3] for r in results),
        "requests_per_s": n * requests / wall,
        "p50_ms": statistics.median(lat) * 1e3, "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from daemons import DaemonProcess

    rows = []
    with DaemonProcess() as d:
        for n in (int(c) for c in args.clients.split(",")):
            rows.append(run(d.endpoint, n, args.requests))
    m = machine()
    print(f"# one daemon, many clients -- {m['cpus']} cpus")
    print_table([(r["clients"], r["requests"], f"{r['requests_per_s']:.0f}", f"{r['p50_ms']:.2f}",
                  f"{r['p99_ms']:.2f}", r["wrong"]) for r in rows],
                ("clients", "requests", "requests/s", "p50 ms", "p99 ms", "wrong answers"))
    print("wrote", write_json("many_clients", {"runs": rows}))
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
