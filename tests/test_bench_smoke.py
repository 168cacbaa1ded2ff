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
