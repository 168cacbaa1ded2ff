"""Layouts on the wire: a channels-last or transposed tensor moved to the device and back,
against the same bytes row-major.

A tensor whose elements fill one run of memory in another order than row-major (channels-last,
transposed) travels as it lies, with its strides: the daemon keeps an upload as received and a
download comes back in the same layout (as PyTorch's copies keep it), so neither side permutes.
This measures, in turns, for a row-major batch and the same values channels-last and
transposed: the upload (`t.to(device)` then synchronize) and the download (`r.cpu()`), medians
over the rounds, and the ratio to the row-major tensor's time in the same round. After the last
round each download's layout and values are checked.

    python -m bench.layouts [--mb 64] [--repeats 5]
"""
from __future__ import annotations

import argparse

import torch

from bench.common import machine, median, print_table, timed, write_json

DEV = "remote_accelerator:0"


def _layouts(mb: float) -> dict[str, torch.Tensor]:
    channels = 64
    side = max(2, int((mb * (1 << 20) / (4 * 16 * channels)) ** 0.5))
    base = torch.randn(16, channels, side, side)
    return {"row-major": base, "channels-last": base.contiguous(memory_format=torch.channels_last),
            "transposed": base.transpose(2, 3)}


def measure(mb: float, repeats: int) -> dict:
    import genie

    tensors = _layouts(mb)
    remote = {name: t.to(DEV) for name, t in tensors.items()}
    genie.synchronize()
    for t, r in zip(tensors.values(), remote.values()):  # untimed: buffers of these sizes exist after
        t.to(DEV)
        r.cpu()
    genie.synchronize()

    def upload(t):
        t.to(DEV)
        genie.synchronize()

    times: dict[str, dict[str, list]] = {name: {"up": [], "down": []} for name in tensors}
    for _ in range(repeats):
        for name in tensors:  # each layout in turn within a round
            times[name]["up"].append(timed(lambda: upload(tensors[name])))
            times[name]["down"].append(timed(lambda: remote[name].cpu()))
    for name, t in tensors.items():  # the layout and the values came back
        back = remote[name].cpu()
        assert back.stride() == t.stride() and torch.equal(back, t), name
    nbytes = tensors["row-major"].numel() * 4
    out = {}
    for name in tensors:
        up, down = times[name]["up"], times[name]["down"]
        ref_up, ref_down = times["row-major"]["up"], times["row-major"]["down"]
        out[name] = {"up_ms": median(up) * 1e3, "down_ms": median(down) * 1e3,
                     "up_vs_row_major": median([a / b for a, b in zip(up, ref_up)]),
                     "down_vs_row_major": median([a / b for a, b in zip(down, ref_down)])}
    return {"bytes": nbytes, "layouts": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    result = measure(args.mb, args.repeats)
    m = machine()
    print(f"# layouts on the wire, {result['bytes'] / (1 << 20):.0f} MiB, embedded daemon -- {m['cpus']} cpus, "
          f"torch {m['torch']}, medians of {args.repeats} rounds")
    rows = [(name, f"{r['up_ms']:.1f}", f"{r['up_vs_row_major']:.2f}x", f"{r['down_ms']:.1f}", f"{r['down_vs_row_major']:.2f}x")
            for name, r in result["layouts"].items()]
    print_table(rows, ("layout", "upload + sync ms", "vs row-major", ".cpu() ms", "vs row-major"))
    print("wrote", write_json("layouts", {**result, "repeats": args.repeats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
