"""The benchmarks still run: each module, shrunk to seconds, in its own process.

The figures are not checked here (targets are for `python -m bench` on a quiet machine); what
is checked is that each run completes and writes its results, so a change to a shared helper
cannot leave the suite broken until the next full run (a renamed helper once broke
bench.rpc_peer that way). Results go to a temporary folder, not bench/results.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNS = {
    "transport_throughput": ["--max-mb", "0.07", "--repeats", "1"],
    "end_to_end": ["--tokens", "4", "--prompt-len", "8", "--batch", "2", "--repeats", "1", "--train-batch", "2",
                   "--train-seq", "8"],
    "rpc_peer": ["--tokens", "4", "--repeats", "1"],
    "capture_overhead": ["--ops", "400", "--repeats", "1", "--roundtrips", "20"],
    "hf_decode": ["--tokens", "4", "--repeats", "1"],
    "model_transfer": ["--layers", "1", "--width", "64", "--vocab", "100", "--repeats", "1"],
    "network_latency": ["--rtt-ms", "0,1", "--repeats", "1", "--tokens", "2"],
    "layouts": ["--mb", "0.5", "--repeats", "1"],
    "peer_transfer": ["--sizes-mb", "0.25,2", "--repeats", "1"],  # below and above the lane threshold
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs(name, tmp_path):
    env = {**os.environ, "GENIE_BENCH_RESULTS": str(tmp_path)}
    env.pop("GENIE_SERVER_URL", None)
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", *RUNS[name]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    with open(tmp_path / f"{name}.json") as f:
        assert json.load(f)["machine"]["cpus"] == os.cpu_count()


def test_the_flow_cap_benchmark_runs_where_it_can_make_its_link(tmp_path):
    """bench.flow_cap needs root and iproute2 (it makes a network namespace); elsewhere it says so."""
    from bench.flow_cap import missing

    if missing():
        pytest.skip(missing())
    env = {**os.environ, "GENIE_BENCH_RESULTS": str(tmp_path)}
    env.pop("GENIE_SERVER_URL", None)
    out = subprocess.run([sys.executable, "-m", "bench.flow_cap", "--sizes-mb", "2", "--repeats", "1",
                          "--flow-mbit", "4000"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    if "cannot make the shaped link here" in out.stdout:
        pytest.skip(out.stdout.strip().splitlines()[-1])
    with open(tmp_path / "flow_cap.json") as f:
        results = json.load(f)
    assert set(results["genie_MBps"]) == {"1", "2", "4"}
    assert all(rate > 0 for lanes in results["genie_MBps"].values() for way in lanes.values() for rate in way.values())


def test_the_latency_proxy_delays_and_keeps_every_byte_in_order():
    """bench.network_latency's proxy (tests/daemons.py): a round trip through it takes at least its RTT, and a large
    payload arrives whole and in order (else that benchmark would measure something else)."""
    import socket
    import threading
    import time

    from daemons import DelayProxy

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def echo():
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    proxy = DelayProxy(server.getsockname()[1], one_way_s=0.01)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            t0 = time.perf_counter()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            assert time.perf_counter() - t0 >= 0.02
            payload = os.urandom(3 << 20)
            threading.Thread(target=s.sendall, args=(payload,), daemon=True).start()
            got = bytearray()
            while len(got) < len(payload):
                chunk = s.recv(1 << 20)
                assert chunk
                got += chunk
            assert bytes(got) == payload
    finally:
        proxy.close()
        server.close()
