"""Genie over a network with latency: a loopback proxy that delays every byte by half a round trip.

Loopback has almost no latency, and a GPU node in a rack is 0.1-1 ms away (more across
buildings). This runs the same workloads with the client's connection going through a
forwarding proxy (DelayProxy, tests/daemons.py) that holds each chunk for RTT/2 in each direction (propagation delay only,
no bandwidth limit), at several round-trip times, and reports for each:
- a tiny op's round trip, `(x + 1).item()`;
- a training step of the demo GPT (AdamW), reading its loss each step, op by op;
- greedy decoding op by op (`torch.cat` cache) and with the step replayed (`genie.graph`), the
  latter also reading its tokens 8 at a time (`read_every=8`: one round trip per 8 tokens);
- `model.cpu()` and `torch.save(model.state_dict())` of the demo GPT, each also as it was before
  they fetched a model's tensors together (one round trip per tensor, two for torch.save);
- reading its state_dict with `genie.materialize_sync`, and with a `{k: v.cpu()}` loop of the
  program's own, and safetensors' `save` of it (where installed), the last two also with a
  tensor per round trip as before they were read ahead;
- the round trips each needed (`transport_stats()[...]["blocking_waits"]`), and the ops each
  captured, so the cost of a design that waits on every op (ops x RTT) can be set beside it.
One daemon (tcp, `--no-bulk-lane`); the client's direct lane is off (GENIE_DIRECT_LANE=0), so
every message takes the one proxied connection. Medians of several repetitions; the RTT-0 row
is the same path through the proxy with no delay.

    python -m bench.network_latency [--rtt-ms 0,1,5] [--repeats 5]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

from bench.common import blocking_waits, machine, median, print_table, write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from daemons import DaemonProcess, DelayProxy  # noqa: E402 - the tests' helpers, as bench.many_clients uses

DEV = "remote_accelerator:0"
READ_EVERY = 8  # tokens read per round trip in the last decode way


def _ops() -> int:
    from genie.runtime import get_runtime

    return sum(s.ops_captured for s in get_runtime().streams)


def _timed(fn, repeats: int) -> tuple[float, float, int]:
    """Median seconds of `fn`, and the round trips and ops of one call."""
    fn()
    w0, o0 = blocking_waits(), _ops()
    fn()
    waits, ops = blocking_waits() - w0, _ops() - o0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times), waits, ops


def measure(repeats: int, tokens: int) -> dict:
    from genie.examples.gpt import GPTConfig, TinyGPT, generate, generate_static

    x = torch.zeros((), device=DEV)
    tiny = _timed(lambda: (x + 1).item(), repeats * 4)

    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, dim=64)
    model = TinyGPT(cfg).to(DEV)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (4, 32), device=DEV)
    pos = torch.arange(32, device=DEV)

    def train_step():
        optimizer.zero_grad(set_to_none=False)
        logits, _ = model(idx, pos)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), idx.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.item()

    train = _timed(train_step, repeats)
    decoder = copy.deepcopy(model).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), device=DEV)
    with torch.no_grad():
        decode = _timed(lambda: generate(decoder, prompt, tokens), repeats)
        replay = _timed(lambda: generate_static(decoder, prompt, tokens), repeats)
        batched = _timed(lambda: generate_static(decoder, prompt, tokens, read_every=READ_EVERY), repeats)
    per_token = lambda r: (r[0] / tokens, r[1] / tokens, r[2] / tokens)  # noqa: E731
    return {"tiny_round_trip": tiny, "train_step": train, "decode_per_token": per_token(decode),
            "replayed_decode_per_token": per_token(replay), "replayed_read_every_per_token": per_token(batched),
            **_reading_a_model(model, repeats)}


def _reading_a_model(model, repeats: int) -> dict:
    """model.cpu() and torch.save(state_dict) of a remote model, together and one tensor at a time
    (the read-ahead's byte budget at 0 reads each tensor alone; torch.save unwrapped, as torch has it)."""
    import io

    import genie
    from genie.frontend import read_ahead

    def measured(fn) -> tuple[float, int]:
        """Seconds and round trips of one call of `fn`."""
        w0, t0 = blocking_waits(), time.perf_counter()
        fn()
        return time.perf_counter() - t0, blocking_waits() - w0

    def to_cpu():
        model.to(DEV)
        genie.synchronize()  # the upload is not what is measured
        return measured(model.cpu)

    def save(saver):
        return lambda: measured(lambda: saver(state, io.BytesIO()))

    def timed(fn) -> tuple[float, float, int]:
        fn()
        runs = [fn() for _ in range(repeats)]
        return median([s for s, _ in runs]), median([w for _, w in runs]), 0

    moved = sum(1 + (p.grad is not None) for p in model.parameters()) + len(list(model.buffers()))
    together = timed(to_cpu)
    budget, read_ahead.READ_AHEAD_BYTES = read_ahead.READ_AHEAD_BYTES, 0
    try:
        one_by_one = timed(to_cpu)
    finally:
        read_ahead.READ_AHEAD_BYTES = budget
    model.to(DEV)
    state = model.state_dict()
    saved = timed(save(torch.save)), timed(save(torch.save._genie_wraps))
    def loop():  # the program's own loop over a state_dict it has just taken
        return measured(lambda: {k: v.cpu() for k, v in model.state_dict().items()})

    out = {"model_tensors": moved, "state_tensors": len(state), "model_cpu": together, "model_cpu_one_by_one": one_by_one,
           "save_state_dict": saved[0], "save_state_dict_one_by_one": saved[1],
           "materialize_state_dict": timed(lambda: measured(lambda: genie.materialize_sync(state))),
           "state_dict_cpu_loop": timed(loop)}
    try:
        import safetensors.torch
    except ImportError:
        safetensors = None
    if safetensors is not None:
        out["safetensors_save"] = timed(lambda: measured(lambda: safetensors.torch.save(state)))
    read_ahead.READ_AHEAD_BYTES = 0  # each tensor read with its own wait, as before the read-ahead
    try:
        out["state_dict_cpu_loop_one_by_one"] = timed(loop)
        if safetensors is not None:
            out["safetensors_save_one_by_one"] = timed(lambda: measured(lambda: safetensors.torch.save(state)))
    finally:
        read_ahead.READ_AHEAD_BYTES = budget
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt-ms", default="0,1,5")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args(argv)
    os.environ["GENIE_DIRECT_LANE"] = "0"  # before genie reads its configuration
    import genie

    rtts = [float(r) for r in args.rtt_ms.split(",")]
    runs = []
    with DaemonProcess(extra=["--no-bulk-lane", "--threads", "1"]) as daemon:
        port = int(daemon.endpoint.rsplit(":", 1)[1])
        for rtt in rtts:
            proxy = DelayProxy(port, rtt / 2e3)
            try:
                genie.init(f"tcp://127.0.0.1:{proxy.port}")
                runs.append({"rtt_ms": rtt, **measure(args.repeats, args.tokens)})
            finally:
                genie.shutdown()
                proxy.close()
    m = machine()
    print(f"# Genie through a loopback proxy adding round-trip latency -- {m['cpus']} cpus, medians of {args.repeats}")
    rows = []
    for r in runs:
        for name, label in (("tiny_round_trip", "(x + 1).item()"), ("train_step", "GPT training step, loss read"),
                            ("decode_per_token", "GPT decode, per token, op by op"),
                            ("replayed_decode_per_token", "GPT decode, per token, replayed"),
                            ("replayed_read_every_per_token", f"same, tokens read {READ_EVERY} at a time"),
                            ("model_cpu", f"GPT model.cpu() ({r['model_tensors']} tensors with grads)"),
                            ("model_cpu_one_by_one", "same, a tensor per round trip (before)"),
                            ("save_state_dict", f"torch.save(GPT state_dict) ({r['state_tensors']} tensors)"),
                            ("save_state_dict_one_by_one", "same, two round trips per tensor (before)"),
                            ("materialize_state_dict", "genie.materialize_sync(GPT state_dict)"),
                            ("state_dict_cpu_loop", "{k: v.cpu() for k, v in model.state_dict().items()}"),
                            ("state_dict_cpu_loop_one_by_one", "same, a tensor per round trip (before)"),
                            ("safetensors_save", "safetensors.torch.save(GPT state_dict)"),
                            ("safetensors_save_one_by_one", "same, a tensor per round trip (before)")):
            if name not in r:  # safetensors not installed
                continue
            seconds, waits, ops = r[name]
            rows.append((f"{r['rtt_ms']:g}", label, f"{seconds * 1e3:.2f}", f"{waits:.2f}", f"{ops:.0f}",
                         f"{ops * r['rtt_ms']:.1f}"))
    print_table(rows, ("RTT ms", "workload", "ms", "round trips", "ops captured", "ops x RTT ms"))
    print("wrote", write_json("network_latency", {"runs": runs, "repeats": args.repeats, "tokens": args.tokens}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
