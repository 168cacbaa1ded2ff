"""A request that computes for longer than the clients' heartbeat timeout does not get its daemon
declared lost: the daemon runs it off its event loop, which keeps answering pings."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from daemons import child_pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = textwrap.dedent("""
    import time, torch, genie
    dev = "remote_accelerator:0"
    a = torch.randn(2048, 2048, device=dev) / 64
    (a @ a).sum().item()                        # warm
    t0 = time.perf_counter(); (a @ a).sum().item(); one = time.perf_counter() - t0
    n = min(12, max(2, int(1.5 / max(one, 1e-3))))  # few ops (a request the daemon could run inline), ~1.5 s
    t0 = time.perf_counter()
    x = a
    for _ in range(n):
        x = (x @ a) * 0.5
    x.sum().item()
    print("one read of", n, "matmuls took", round(time.perf_counter() - t0, 2), "s")
    b = torch.randn(1024, 1024, device=dev) / 32
    g = genie.Graph()
    with genie.graph(g):
        y = b
        for _ in range(4 * n):
            y = (y @ b) * 0.5
        b.copy_(y)
    t0 = time.perf_counter()
    for _ in range(3):                          # a long replay: after its first run, off the loop too
        g.replay()
        b.sum().item()
    print("3 replays took", round(time.perf_counter() - t0, 2), "s")
    print("ok")
""")


def test_a_read_that_computes_past_the_heartbeat_timeout_keeps_its_daemon():
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT), "GENIE_HEARTBEAT": "0.1", "GENIE_HEARTBEAT_TIMEOUT": "0.5"}
    env.pop("GENIE_SERVER_URL", None)  # an embedded daemon of its own
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr[-3000:]
