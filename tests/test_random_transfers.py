"""Random programs of large transfers over each data path: uploads (some laid out transposed, some
written after `.to()`), downloads of random views (narrowing, strided, transposed) that are then
written or uploaded again, writes from host tensors into device views, casts, ops and frees, side
by side with the same program on the CPU. At the end every device tensor equals its CPU twin, and
every download still holds what it read: a download over shared memory is the daemon's segment
mapped here, so a segment handed back or reused too early would show.

Paths: tcp lanes (four, payloads from 8 MiB split across them), sealed lanes under CURVE, an ipc
daemon's shared memory, a tcp daemon's local lane (shared memory too), and the Unix socket
(`--no-shared-memory`); and large tensors moved between two tcp daemons, over their local lanes
(shared memory) and over tcp lanes. Seeded; a failure names the seed and its steps. GENIE_RANDOM_TRANSFERS=N runs N seeds per path."""
from __future__ import annotations

import gc
import os
import random
import shutil

import pytest
import torch
import zmq

import genie
from daemons import DaemonProcess, curve_pair, ipc_endpoint
from genie.transport import sealed_lane

SEEDS = range(int(os.environ.get("GENIE_RANDOM_TRANSFERS", "12")))
DEV = "remote_accelerator:0"


def _view(rng, t):
    """(name, function) of a random view of `t` (the same view of its twin)."""
    if t.dim() == 0:
        return "id", lambda x: x
    d = rng.randrange(t.dim())
    n = t.shape[d]
    kind = rng.choice(["narrow", "step", "transpose", "select", "id"])
    if kind == "narrow" and n > 1:
        a = rng.randrange(n)
        b = rng.randrange(a + 1, n + 1)
        return f"narrow({d},{a},{b - a})", lambda x: x.narrow(d, a, b - a)
    if kind == "step":
        s = rng.choice([2, 3])
        return f"step({d},{s})", lambda x: x[(slice(None),) * d + (slice(None, None, s),)]
    if kind == "transpose" and t.dim() >= 2:
        return "t", lambda x: x.transpose(0, 1)
    if kind == "select" and t.dim() >= 2:
        k = rng.randrange(n)
        return f"select({d},{k})", lambda x: x.select(d, k)
    return "id", lambda x: x


def _new_host_tensor(rng, g) -> torch.Tensor:
    numel = rng.choice([1 << 10, 1 << 16, 1 << 18, 1 << 20, 3 << 20, 1 << 22])  # up to 32 MiB (float64)
    rows = rng.choice([1, 4, 64, 256])
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.int32, torch.float16])
    t = (torch.randn(rows, numel // rows, generator=g) * 10).to(dtype)
    return t.t() if rng.random() < 0.2 else t


def _same(want: torch.Tensor, got: torch.Tensor) -> bool:
    if want.dtype != got.dtype or want.shape != got.shape:
        return False
    if not want.is_floating_point():
        return torch.equal(want, got)
    return torch.allclose(want.double(), got.double(), rtol=1e-2 if want.dtype == torch.float16 else 1e-5,
                          atol=1e-3, equal_nan=True)


def run_transfer_program(seed: int, steps: int = 30) -> str | None:
    """The program of `seed` on the CPU and on DEV; None, or what went wrong and the steps taken."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    pairs, downloads, taken = [], [], []

    def failed(what: str) -> str:
        return f"seed {seed}: {what}: {' '.join(taken)}"

    for _ in range(steps):
        if not pairs or rng.random() < 0.2:
            t = _new_host_tensor(rng, g)
            pairs.append((t.clone(), t.to(DEV)))
            if rng.random() < 0.5:
                t.add_(1)  # after .to(): the device copy was taken before
            taken.append(f"up{tuple(t.shape)}:{str(t.dtype)[6:]}")
            continue
        k = rng.randrange(len(pairs))
        c, r = pairs[k]
        op = rng.choice(["down", "down", "reupload", "write_view", "setitem", "compute", "add_", "free", "cast"])
        name, view = _view(rng, c)
        taken.append(f"{k}.{op}.{name}")
        if op == "down":
            got = view(r).cpu()
            if not _same(view(c), got):
                return failed("a download differs")
            want = view(c).clone()
            if rng.random() < 0.5:
                got.mul_(2), want.mul_(2)  # a write into a download reaches neither device nor CPU twin
            downloads.append((want, got))
        elif op == "reupload" and downloads:
            want, got = downloads[rng.randrange(len(downloads))]
            pairs.append((want.clone(), got.to(DEV)))
        elif op == "write_view":
            source = (torch.randn(view(c).shape, generator=g) * 5).to(c.dtype)
            view(c).copy_(source), view(r).copy_(source)
        elif op == "setitem" and c.dim() and c.shape[0]:
            i = rng.randrange(c.shape[0])
            value = torch.randn(c[i].shape, generator=g).to(c.dtype)
            c[i], r[i] = value, value
        elif op == "compute":
            pairs.append(tuple((view(x) * 2 + 1).flip(0) if x.dim() else view(x) * 2 for x in (c, r)))
        elif op == "add_":
            view(c).add_(3), view(r).add_(3)
        elif op == "free":
            pairs.pop(k)
            if rng.random() < 0.3:
                gc.collect()
        elif op == "cast":
            to = rng.choice([torch.float32, torch.float64, torch.float16])
            pairs.append((view(c).to(to), view(r).to(to)))
    for i, (c, r) in enumerate(pairs):
        if not _same(c, r.cpu()):
            return failed(f"device tensor {i} differs")
    for i, (want, got) in enumerate(downloads):
        if not _same(want, got):
            return failed(f"download {i} changed after it was read")
    return None


def _run_seeds() -> None:
    failures = [f for f in map(run_transfer_program, SEEDS) if f is not None]
    assert not failures, "\n".join(failures)


def test_random_transfer_programs_over_tcp_lanes_match_cpu(tcp_lanes):
    assert genie.transport_info()["links"][genie.get_runtime().links[0].endpoint]["path"] == "zmq+bulk-tcp"
    _run_seeds()


@pytest.mark.skipif(not zmq.has("curve") or not sealed_lane.available(),
                    reason="needs a libzmq built with CURVE and the cryptography package")
def test_random_transfer_programs_over_sealed_lanes_match_cpu(tmp_path):
    """Under CURVE: payloads from 128 KiB on sealed lanes (AES-GCM records), split across four."""
    flags, keys = curve_pair(tmp_path)
    with DaemonProcess(extra=flags, local_lane=False) as d:
        genie.init(d.endpoint, **keys)
        try:
            assert genie.transport_info()["links"][d.endpoint]["path"] == "zmq+bulk-tcp-sealed"
            _run_seeds()
        finally:
            genie.shutdown()


@pytest.mark.parametrize("path", ["ipc shared memory", "tcp local lane", "unix socket"])
def test_random_transfer_programs_over_host_paths_match_cpu(path):
    listen, tmp = ipc_endpoint() if path != "tcp local lane" else ("tcp://127.0.0.1:0", None)
    extra = ["--no-shared-memory"] if path == "unix socket" else []
    try:
        with DaemonProcess(listen, extra=extra, local_lane=True) as d:
            genie.init(d.endpoint)
            try:
                want = "zmq+bulk-unix" if path == "unix socket" else "zmq+bulk-shared-memory"
                assert genie.transport_info()["links"][d.endpoint]["path"] == want
                _run_seeds()
            finally:
                genie.shutdown()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


TWO = ("remote_accelerator:0", "remote_accelerator:1")


def run_moving_program(seed: int, steps: int = 30) -> str | None:
    """Large tensors moved between two daemons' devices (views too), some written right after the
    move (the write must not reach the moved copy), with ops and frees; None, or what went wrong."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    pairs, taken = [], []
    for _ in range(steps):
        if not pairs or rng.random() < 0.2:
            t, dev = _new_host_tensor(rng, g), rng.choice(TWO)
            pairs.append((t.clone(), t.to(dev)))
            taken.append(f"up{tuple(t.shape)}:{str(t.dtype)[6:]}->{dev[-1]}")
            continue
        k = rng.randrange(len(pairs))
        c, r = pairs[k]
        name, view = _view(rng, c)
        op = rng.choice(["move", "move_then_write", "mul_", "compute", "free"])
        taken.append(f"{k}.{op}.{name}")
        if op.startswith("move"):
            pairs.append((view(c).clone(), view(r).to(TWO[1 - TWO.index(str(r.device))])))
            if op == "move_then_write":
                view(c).add_(5), view(r).add_(5)
        elif op == "mul_":
            view(c).mul_(2), view(r).mul_(2)
        elif op == "compute":
            pairs.append(((view(c) + 1) * 2, (view(r) + 1) * 2))
        elif op == "free":
            pairs.pop(k)
    for i, (c, r) in enumerate(pairs):
        if not _same(c, r.cpu()):
            return f"seed {seed}: tensor {i} differs: {' '.join(taken)}"
    return None


@pytest.mark.parametrize("local_lane", [True, False], ids=["local lanes", "tcp lanes"])
def test_random_programs_moving_large_tensors_between_two_daemons_match_cpu(local_lane):
    """Two tcp daemons on this host: their copies to each other go in shared memory (local lanes)
    or on tcp lanes (--no-local-lane)."""
    with DaemonProcess(local_lane=local_lane) as a, DaemonProcess(local_lane=local_lane) as b:
        genie.init(f"{a.endpoint},{b.endpoint}")
        try:
            failures = [f for f in map(run_moving_program, SEEDS) if f is not None]
            assert not failures, "\n".join(failures)
            stream = genie.get_runtime().streams[0]
            lanes = stream.link.request("stats", {"dev": stream.local_index}).body["peer_lanes"]
            assert lanes == {b.endpoint: "shared-memory" if local_lane else "tcp"}
        finally:
            genie.shutdown()
