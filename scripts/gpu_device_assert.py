"""A real device-side assert on a GPU daemon (run by scripts/gpu_quick_check.sh on GPU nodes).

An index out of range in a CUDA kernel loses the daemon's CUDA context (tests/test_device_loss.py
simulates it on CPU machines). Checks: the client's error says what happened, the daemon restarts in
place, and the next use of the device works, on the embedded default daemon as users meet it.
"""
from __future__ import annotations

import time

import torch

import genie

DEV = "remote_accelerator:0"


def main() -> None:
    kept = torch.full((3,), 2.0, device=DEV)
    print("before:", kept.sum().item(), genie.get_runtime().links[0].endpoint)
    table = torch.arange(3.0, device=DEV)
    index = torch.tensor([5], device=DEV)  # out of range: CUDA's index kernel asserts on the device
    t0 = time.monotonic()
    try:
        print("no error?!", table[index].cpu())
    except genie.GenieError as e:
        print(f"error after {time.monotonic() - t0:.2f}s: {type(e).__name__}: {e}")
    for attempt in range(100):
        try:
            value = (torch.full((2,), 3.0, device=DEV) * 2).cpu().tolist()
            print(f"after: {value} ({attempt} tries, {time.monotonic() - t0:.1f}s from the assert)")
            break
        except genie.GenieConnectionError as e:
            if attempt == 0:
                print("while restarting:", e)
            time.sleep(0.2)
    try:
        kept.cpu()
        print("kept survived?!")
    except genie.GenieError as e:
        print("kept:", type(e).__name__, str(e)[:120])


if __name__ == "__main__":
    main()
