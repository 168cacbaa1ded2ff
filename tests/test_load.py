"""Load: 16 client processes x 200 mixed requests (2 threads each) against one daemon.

Every answer is checked against the same computation done locally (no lost,
duplicated or swapped results); afterwards the daemon holds what it held before.
Prints requests/s (a figure to read, not a timed assertion).
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import time

import msgpack
import pytest
import zmq

from daemons import DaemonProcess, ipc_endpoint
from genie.transport import protocol
from load_worker import client

CLIENTS = 16
REQUESTS = 200
THREADS = 2


def _stats(endpoint: str) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    try:
        sock.send_multipart([protocol.pack(["stats", 1, {}])])
        _, ok, body = msgpack.unpackb(sock.recv_multipart()[0], raw=False, strict_map_key=False)
        sock.send_multipart([protocol.pack(["bye", 2, {}])])
        sock.recv_multipart()
        assert ok, body
        return {k: body[k] for k in ("resident", "handles", "mailbox_bytes", "parked_requests")}
    finally:
        sock.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("transport, clients, requests", [
    ("tcp", CLIENTS, REQUESTS),
    ("ipc", 6, 80),  # the 1 MiB payloads go in shared memory: hand-backs from many threads and processes
])
def test_many_clients_x_mixed_requests_all_correct_memory_back_to_baseline(transport, clients, requests):
    ipc, tmpdir = ipc_endpoint()
    with DaemonProcess(ipc if transport == "ipc" else "tcp://127.0.0.1:0") as daemon:
        baseline = _stats(daemon.endpoint)
        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=client, args=(daemon.endpoint, seed, requests, THREADS, start, out), daemon=True)
                 for seed in range(1, clients + 1)]
        for p in procs:
            p.start()
        try:
            time.sleep(1.0)
            start.set()
            results = [out.get(timeout=240) for _ in procs]
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        errors = [e for r in results for e in r[3]]
        assert not errors, "\n".join(errors[:5])
        done = sum(r[2] for r in results)
        assert done == clients * requests
        wall = max(r[1] for r in results)
        print(f"load over {transport}: {clients} clients x {requests} mixed requests ({THREADS} threads each): "
              f"{done} verified in {wall:.2f} s = {done / wall:.0f} requests/s")
        deadline = time.monotonic() + 10
        while (after := _stats(daemon.endpoint)) != baseline and time.monotonic() < deadline:
            time.sleep(0.1)
        assert after == baseline, (baseline, after)
        assert daemon.proc.poll() is None
    shutil.rmtree(tmpdir, ignore_errors=True)
