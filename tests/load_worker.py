"""One client process of the load test: several threads issue mixed requests and check every answer.

Lives in its own module so `multiprocessing` (spawn) can import it in the child processes.
"""
from __future__ import annotations

import threading
import time
import traceback

DEV = "remote_accelerator:0"


def _one_request(kind: int, seed: int, i: int, torch) -> None:
    """Run request `i` of this thread and check its answer against the same computation done locally."""
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    if kind == 0:  # small op on a fresh tensor, blocking scalar read
        x = torch.full((64,), float(seed), device=DEV)
        got = (x * i).sum().item()
        assert got == 64.0 * seed * i, (got, seed, i)
    elif kind == 1:  # upload, compute, download
        a = torch.randn(48, 32, generator=g)
        b = torch.randn(32, 16, generator=g)
        got = (a.to(DEV) @ b.to(DEV)).relu().cpu()
        torch.testing.assert_close(got, (a @ b).relu())
    elif kind == 2:  # views and in-place writes
        t = torch.arange(40, dtype=torch.float32).reshape(8, 5)
        r = t.to(DEV)
        r[::2] += i
        r[:, 1].mul_(2)
        expected = t.clone()
        expected[::2] += i
        expected[:, 1].mul_(2)
        torch.testing.assert_close(r.cpu(), expected)
    elif kind == 3:  # data-dependent output shape
        v = torch.randn(200, generator=g)
        got = v.to(DEV)[v.to(DEV) > 0.5].cpu()
        torch.testing.assert_close(got, v[v > 0.5])
    else:  # a larger payload both ways (1 MiB)
        big = torch.randn(256, 1024, generator=g)
        got = (big.to(DEV) * 0.5 + i).cpu()
        torch.testing.assert_close(got, big * 0.5 + i)


def client(endpoint: str, seed: int, requests: int, threads: int, start, out) -> None:
    import torch

    import genie

    try:
        genie.init(endpoint)
        torch.ones(1, device=DEV).sum().item()  # connected
    except Exception:
        out.put((seed, 0.0, 0, [traceback.format_exc()]))
        return
    start.wait(120)
    errors: list[str] = []
    done = [0]
    lock = threading.Lock()

    def run(thread: int) -> None:
        for i in range(thread, requests, threads):
            try:
                _one_request((seed + i) % 5, seed, i, torch)
                with lock:
                    done[0] += 1
            except Exception:
                with lock:
                    errors.append(f"client {seed} request {i}: {traceback.format_exc()}")

    t0 = time.perf_counter()
    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    try:
        genie.shutdown()  # says bye: the daemon frees this client's tensors
    except Exception:
        errors.append(traceback.format_exc())
    out.put((seed, elapsed, done[0], errors))
