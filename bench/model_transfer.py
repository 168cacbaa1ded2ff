"""Moving a whole model: `model.to("remote_accelerator:0")` and `model.to("cpu")`, against a raw socket.

What a user waits for before the first step and when saving: a GPT-2-small-shaped model (token
embedding + 12 `nn.TransformerEncoderLayer` of width 768, ~124M parameters in 147 tensors,
~472 MiB of float32) moved to a genie-daemon process and back, over tcp and over ipc (shared
memory, the default for a daemon of the same user on this host). The baseline is the same
number of bytes sent as one payload over a raw socket (`bench.transport_throughput`'s): the best
a byte stream does here, without the per-tensor work a module's `.to()` makes (PyTorch moves
its tensors one at a time; a download, which must have its bytes before `.to("cpu")` returns,
was a round trip per tensor until a module's tensors were read together, up to 64 MiB per
round trip: genie/frontend/read_ahead.py). Raw, upload and download take turns in rounds; the
ratios are medians over rounds of the ratio within a round. After the last round the model's
values are checked against the original.

    python -m bench.model_transfer [--repeats 5] [--layers 12] [--width 768] [--vocab 50257] [--only tcp,ipc]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import torch
from torch import nn

from bench.common import machine, median, print_table, write_json
from bench.transport_throughput import RawSocket


def gpt_shaped(layers: int, width: int, vocab: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({
        "embed": nn.Embedding(vocab, width),
        "blocks": nn.ModuleList(nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, batch_first=True)
                                for _ in range(layers)),
        "norm": nn.LayerNorm(width),
    })


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def timed_round_trip(model: nn.Module) -> tuple[float, float]:
    """Seconds of `model.to(remote)` (until the daemon holds every tensor) and of `model.to("cpu")`."""
    t0 = time.perf_counter()
    model.to("remote_accelerator:0")
    torch.remote_accelerator.synchronize()
    t1 = time.perf_counter()
    model.to("cpu")
    return t1 - t0, time.perf_counter() - t1


def measure(kind: str, endpoint: str, model: nn.Module, reference: dict, repeats: int) -> dict:
    import genie

    n = model_bytes(model)
    raw = RawSocket(kind, n)
    genie.init(endpoint)
    try:
        timed_round_trip(model)  # warm-up: first plans, fresh memory at both ends
        ups, downs, raws, up_ratio, down_ratio = [], [], [], [], []
        for _ in range(repeats):
            raw_s = raw.transfer(n)
            up, down = timed_round_trip(model)
            raws.append(raw_s), ups.append(up), downs.append(down)
            up_ratio.append(raw_s / up), down_ratio.append(raw_s / down)
        wrong = [k for k, v in model.state_dict().items() if not torch.equal(v, reference[k])]
    finally:
        genie.shutdown()
        raw.close()
    if wrong:
        raise AssertionError(f"{kind}: {len(wrong)} tensors changed on the way, e.g. {wrong[:3]}")
    return {"bytes": n, "tensors": len(reference), "raw_MBps": n / median(raws) / 1e6,
            "up_MBps": n / median(ups) / 1e6, "down_MBps": n / median(downs) / 1e6,
            "up_over_raw": median(up_ratio), "down_over_raw": median(down_ratio),
            "up_ms": median(ups) * 1e3, "down_ms": median(downs) * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--only", default="tcp,ipc", help="transports to measure: tcp, ipc or both")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from daemons import DaemonProcess

    model = gpt_shaped(args.layers, args.width, args.vocab)
    reference = copy.deepcopy(model.state_dict())
    results = {}
    for kind in ("tcp", "ipc"):
        if kind not in args.only.split(","):
            continue
        listen = "tcp://127.0.0.1:0" if kind == "tcp" else f"ipc://{tempfile.mkdtemp()}/genie.sock"
        with DaemonProcess(listen) as d:
            results[kind] = measure(kind, d.endpoint, model, reference, args.repeats)
    m = machine()
    first = next(iter(results.values()))
    print(f"# model.to(remote) / model.to('cpu'), {first['tensors']} tensors, {first['bytes'] / 2**20:.0f} MiB, "
          f"medians of {args.repeats} rounds -- {m['cpus']} cpus, torch {m['torch']}")
    rows = [(kind, f"{r['raw_MBps']:.0f}", f"{r['up_MBps']:.0f} ({r['up_ms']:.0f} ms)",
             f"{r['down_MBps']:.0f} ({r['down_ms']:.0f} ms)", f"{r['up_over_raw'] * 100:.0f}%",
             f"{r['down_over_raw'] * 100:.0f}%") for kind, r in results.items()]
    print_table(rows, ("transport", "raw socket MB/s", "upload MB/s", "download MB/s", "up/raw", "down/raw"))
    print("wrote", write_json("model_transfer", {"layers": args.layers, "width": args.width, "vocab": args.vocab,
                                                  "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
