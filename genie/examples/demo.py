"""Genie demo: a small GPT-style decoder generating on a remote_accelerator.

Builds TinyGPT with random weights, generates greedily with a KV cache on the
CPU (reference) and on `remote_accelerator:0`, checks the tokens are identical,
and prints the tokens, the time per token and the bytes on the wire per token;
then again with the decode step recorded once and replayed (`genie.graph`).

    python -m genie.examples.demo [--tokens 32] [--prompt-len 16]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import genie
from genie.examples.gpt import GPTConfig, TinyGPT, generate, generate_static


def _wire_totals() -> tuple[int, int]:
    stats = genie.transport_stats().values()
    return sum(s["bytes_sent"] for s in stats), sum(s["bytes_received"] for s in stats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    model = TinyGPT(GPTConfig()).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt_len))

    t0 = time.perf_counter()
    reference = generate(model, prompt, args.tokens)
    local_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    device = torch.device("remote_accelerator:0")
    print(f"remote device: {torch.remote_accelerator.get_device_name(0)}")
    connect_s = time.perf_counter() - t0
    base_sent, _ = _wire_totals()  # the connection's link probe is not part of the upload
    t0 = time.perf_counter()
    model.to(device)
    remote_prompt = prompt.to(device)
    genie.synchronize()
    upload_s = time.perf_counter() - t0
    sent0, recv0 = _wire_totals()
    upload_bytes = sent0 - base_sent

    t0 = time.perf_counter()
    tokens = generate(model, remote_prompt, args.tokens)
    remote_s = time.perf_counter() - t0
    sent1, recv1 = _wire_totals()

    stamps = [time.perf_counter()]  # start, then one per token read
    replayed = generate_static(model, remote_prompt, args.tokens,  # static cache, step recorded once
                               on_token=lambda _: stamps.append(time.perf_counter()))
    sent2, recv2 = _wire_totals()
    # stamps[1]: after the prefill; [2]: after the recorded step; [3]: after the first replay,
    # which the daemon traces (its first trace also loads torch's compiler stack, ~1.4 s here).
    first_s = stamps[3] - stamps[0]
    steady_s = (stamps[-1] - stamps[3]) / max(1, len(stamps) - 4)

    print(f"tokens (remote): {tokens}")
    match = tokens == reference and replayed == reference
    print(f"equal to local CPU run: {match}")
    print(f"connect: {connect_s * 1e3:.0f} ms; weights upload: {upload_s * 1e3:.0f} ms ({upload_bytes / 1e6:.2f} MB sent)")
    print(f"local eager:  {local_s / args.tokens * 1e3:.2f} ms/token")
    print(f"remote:       {remote_s / args.tokens * 1e3:.2f} ms/token (prefill included)")
    print(f"wire per generated token: {(sent1 - sent0) / args.tokens:.0f} B sent, "
          f"{(recv1 - recv0) / args.tokens:.0f} B received")
    print(f"remote, step replayed with genie.graph: {steady_s * 1e3:.2f} ms/token (after {first_s * 1e3:.0f} ms "
          f"for prefill, recording the step and its first replay, which the daemon traces), "
          f"{(sent2 - sent1) / args.tokens:.0f} B sent per token; same tokens: {replayed == reference}")
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
