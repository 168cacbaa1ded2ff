"""GPU data paths of a daemon serving a CUDA GPU on this host (needs a GPU; prints why not and exits 0).

In one run, for each size, against a genie-daemon on cuda:0 listening on an ipc:// path:
- local baselines in this process: pageable CPU -> GPU copy (`t.cuda()`), pinned CPU -> GPU
  copy, and GPU -> GPU copy (`clone`);
- Genie upload of a CPU tensor: bytes over the bulk lane into the daemon's pinned staging, then a
  copy-stream host-to-device copy;
- Genie upload of a CUDA tensor: by CUDA IPC handle (one device-to-device copy on the daemon),
  and the same with IPC off (bytes: GPU -> host -> socket -> host -> GPU);
- Genie download to the CPU (`.cpu()`: device-to-host into the daemon's pinned staging, then
  the bulk lane), and to a CUDA tensor (`.to("cuda")`) by CUDA IPC and with IPC off;
- where ucxx is installed, upload and download of a CPU tensor over the UCX lane, which lands
  uploads in GPU memory and sends results from it (no pinned staging; a second daemon, on tcp
  with its UCX lane on at both ends).
Each figure: payload bytes / median time of several repetitions, each timed to completion
(`synchronize` on both sides).

    python -m bench.gpu_paths [--max-mb 1024] [--repeats 5]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

import torch

from bench.common import median, print_table, write_json

SIZES = [4 << 20, 64 << 20, 256 << 20, 1 << 30]


def _time(fn, repeats: int) -> float:
    fn()  # warm: first use allocates, opens handles, pins staging
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()  # local copies are asynchronous: time them to completion
        times.append(time.perf_counter() - t0)
    return median(times)


def _ucx_gpu_memory(sizes: list[int], repeats: int, device: str = "cuda:0") -> dict[int, dict[str, float]]:
    """Seconds per upload and download of a CPU tensor over the UCX lane, for each size, with a
    daemon on `device` whose UCX moves its GPU memory; {} (and why, printed) where it cannot."""
    import dataclasses

    import genie
    from genie.runtime.embedded import LocalDaemon
    from genie.transport.paths import importable

    if not importable("ucxx"):
        print("gpu_paths: no UCX rows, needs ucxx (pip install ucxx-cu12)")
        return {}
    rt = genie.get_runtime()
    config, rt.config = rt.config, dataclasses.replace(rt.config, ucx="on")
    daemon = LocalDaemon(listen="tcp://127.0.0.1:0", extra_args=["--device", device, "--ucx", "on"])
    rows: dict[int, dict[str, float]] = {}
    try:
        genie.init(daemon.start())
        info = genie.transport_info()["links"][genie.get_runtime().links[0].endpoint]
        if info["path"] != "zmq+bulk-ucx" or not info["gpu_memory_over_ucx"].startswith("yes:"):
            print(f"gpu_paths: no UCX rows: lane {info['path']}, GPU memory over UCX: {info['gpu_memory_over_ucx']}")
            return {}
        for n in sizes:
            reps = repeats if n < 1 << 30 else max(2, repeats // 2)
            cpu = torch.randn(n // 4)

            def up():
                x = cpu.to("remote_accelerator:0")
                torch.remote_accelerator.synchronize()
                del x

            resident = cpu.to("remote_accelerator:0")
            rows[n] = {"genie_up_cpu_ucx": _time(up, reps), "genie_down_cpu_ucx": _time(lambda: resident.cpu(), reps)}
            resident = cpu = None
    finally:
        genie.shutdown()
        daemon.stop()
        rt.config = config
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_paths: skipped, needs CUDA (no GPU on this machine)")
        return 0
    sizes = [s for s in SIZES if s <= args.max_mb << 20]
    # Pinned buffers first: once genie is imported, torch takes remote_accelerator for the
    # current accelerator, and pin_memory() without a device asks it for pinned memory.
    pinned_of = {n: torch.empty(n // 4, pin_memory=True) for n in sizes}
    import genie
    from genie.runtime.embedded import LocalDaemon

    tmp = tempfile.mkdtemp(prefix="genie-bench-")
    daemon = LocalDaemon(listen=f"ipc://{tmp}/d.sock", extra_args=["--device", "cuda:0"])
    endpoint = daemon.start()
    genie.init(endpoint)
    dev = "remote_accelerator:0"
    sync = torch.remote_accelerator.synchronize
    link = genie.get_runtime().links[0]
    results = {}
    try:
        for n in sizes:
            reps = args.repeats if n < 1 << 30 else max(2, args.repeats // 2)
            cpu = torch.randn(n // 4)
            pinned = pinned_of.pop(n)
            pinned.copy_(cpu)
            gpu = cpu.cuda()
            row = {
                "local_pageable_h2d": _time(lambda: cpu.cuda(), reps),
                "local_pinned_h2d": _time(lambda: pinned.cuda(non_blocking=True), reps),
                "local_d2d": _time(lambda: gpu.clone(), reps),
            }

            def up(src):
                def run():
                    x = src.to(dev)
                    sync()
                    del x
                return run

            row["genie_up_cpu"] = _time(up(cpu), reps)
            row["genie_up_cuda_ipc"] = _time(up(gpu), reps)
            offer, link.cuda_ipc_offer = link.cuda_ipc_offer, None
            row["genie_up_cuda_bytes"] = _time(up(gpu), reps)
            link.cuda_ipc_offer = offer
            resident = cpu.to(dev)
            sync()
            row["genie_down_cpu"] = _time(lambda: resident.cpu(), reps)
            row["genie_down_cuda_ipc"] = _time(lambda: resident.to("cuda"), reps)
            offer, link.cuda_ipc_offer = link.cuda_ipc_offer, None
            row["genie_down_cuda_bytes"] = _time(lambda: resident.to("cuda"), reps)
            link.cuda_ipc_offer = offer
            results[n] = {k: n / v / 1e6 for k, v in row.items()}  # MB/s
            print(f"{n >> 20} MiB: " + ", ".join(f"{k} {v:,.0f}" for k, v in results[n].items()), flush=True)
            resident = cpu = pinned = gpu = None  # this size's buffers go before the next size's are made
    finally:
        genie.shutdown()
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    cols = ["local_pageable_h2d", "local_pinned_h2d", "local_d2d", "genie_up_cpu", "genie_up_cuda_ipc",
            "genie_up_cuda_bytes", "genie_down_cpu", "genie_down_cuda_ipc", "genie_down_cuda_bytes"]
    over_ucx = _ucx_gpu_memory(sizes, args.repeats)
    for n, row in over_ucx.items():
        results[n].update({k: n / v / 1e6 for k, v in row.items()})
    if over_ucx:
        cols += ["genie_up_cpu_ucx", "genie_down_cpu_ucx"]
    print_table([(f"{n >> 20} MiB", *(f"{results[n][c]:,.0f}" for c in cols)) for n in results], ("MB/s", *cols))
    print("wrote", write_json("gpu_paths", {"device": torch.cuda.get_device_name(), "results_MBps": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
