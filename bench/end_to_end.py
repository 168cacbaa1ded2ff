"""End to end: the demo's GPT-style decoder and a CNN, remote (a local genie-daemon) vs local eager.

GPT: prefill tokens/s, decode tokens/s in the steady state (greedy; from the second generated
token on, the first step, with the prefill, timed apart) with the model's torch.cat KV cache,
a daemon-side genie.KVSession, and a static cache whose step is recorded once and replayed
(genie.graph); bytes on the wire per generated token.
CNN: images/s for batched inference. Training: steps/s of a GPT training step (AdamW,
`capturable=True` on the device so that its state lives there), op by op and recorded once
with genie.graph and replayed. Medians of several runs; the local eager run in the same
process is the baseline (for decode and training, local and remote runs take turns).

    python -m bench.end_to_end [--tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import genie
from bench.common import blocking_waits, machine, median, print_table, write_json
from genie.examples.gpt import GPTConfig, TinyGPT, generate, generate_static
from genie.examples.zoo import SmallCNN

DEV = "remote_accelerator:0"
DECODE_ROUNDS = 7  # at least this many turns of each decode run (one generation each, ~0.1 s)
TRAIN_ROUNDS = 5  # at least this many turns of each training run (two steps each, ~0.1-0.3 s)


def wire_bytes() -> int:
    return sum(s["bytes_sent"] + s["bytes_received"] for s in genie.transport_stats().values())


def time_it(fn, repeats: int) -> float:
    fn()  # warm (capture caches, allocator)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return median(runs)


def decode_rates(runs: dict, rounds: int, per_round: dict | None = None) -> dict[str, tuple[float, float]]:
    """For each run(on_token): (tokens/s from the second token on, seconds to the second token), medians.
    With `per_round` (a dict), each run's rate in every round is stored there too, for ratios
    taken round by round.

    The runs take turns, one generation each per round, so that the local and remote rates,
    whose ratio is the result, are measured under the same conditions (this shared machine's
    speed drifts by tens of percent between seconds). The first decode step is timed apart:
    with genie.graph it records the step (and traces it on the daemon), a one-time cost like
    CUDA graph capture; later steps are the steady state."""
    for run in runs.values():
        run(lambda token: None)  # warm
    rates: dict[str, list[float]] = {name: [] for name in runs}
    firsts: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            stamps = [time.perf_counter()]
            run(lambda token: stamps.append(time.perf_counter()))
            # stamps: start, then one per token as it is read; token k's step ends at stamp k+1.
            rates[name].append((len(stamps) - 3) / (stamps[-1] - stamps[2]))
            firsts[name].append(stamps[2] - stamps[0])
    if per_round is not None:
        per_round.update(rates)
    return {name: (median(rates[name]), median(firsts[name])) for name in runs}


def gpt(tokens: int, prompt_len: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig()).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, prompt_len))
    remote = copy.deepcopy(model).to(DEV)
    rprompt = prompt.to(DEV)

    def prefill(m, p):
        with torch.no_grad():
            logits, _ = m(p, torch.arange(prompt_len, device=p.device))
            logits[0, -1, 0].item()

    local_prefill = time_it(lambda: prefill(model, prompt), repeats)
    remote_prefill = time_it(lambda: prefill(remote, rprompt), repeats)

    def with_session(cb):
        session = genie.KVSession(DEV)
        generate(remote, rprompt, tokens, on_token=cb, kv_session=session)
        session.close()

    # Static cache: locally the same Python step each token; remotely recorded once and replayed (genie.graph).
    rounds: dict = {}
    decode = decode_rates({
        "local": lambda cb: generate(model, prompt, tokens, on_token=cb),
        "remote": lambda cb: generate(remote, rprompt, tokens, on_token=cb),
        "remote_kv_session": with_session,
        "local_static": lambda cb: generate_static(model, prompt, tokens, replay=False, on_token=cb),
        "remote_replay": lambda cb: generate_static(remote, rprompt, tokens, on_token=cb),
    }, max(repeats, DECODE_ROUNDS), rounds)
    (local_gen, local_first), (remote_gen, remote_first) = decode["local"], decode["remote"]
    remote_kv = decode["remote_kv_session"][0]
    (local_static, local_static_first), (remote_replay, replay_first) = decode["local_static"], decode["remote_replay"]
    best_local = max(local_gen, local_static)
    faster_local = "local" if local_gen >= local_static else "local_static"
    b0, w0 = wire_bytes(), blocking_waits()
    generate(remote, rprompt, tokens)
    per_token, waits_per_token = (wire_bytes() - b0) / tokens, (blocking_waits() - w0) / tokens
    b0, w0 = wire_bytes(), blocking_waits()
    generate_static(remote, rprompt, tokens)
    per_token_replay, waits_per_token_replay = (wire_bytes() - b0) / tokens, (blocking_waits() - w0) / tokens
    assert generate(remote, rprompt, 8) == generate(model, prompt, 8) == generate_static(remote, rprompt, 8)
    return {
        "prefill_tokens_per_s": {"local": prompt_len / local_prefill, "remote": prompt_len / remote_prefill},
        "decode_tokens_per_s": {"local": local_gen, "remote": remote_gen, "remote_kv_session": remote_kv,
                                "local_static": local_static, "remote_replay": remote_replay},
        "prefill_and_first_step_s": {"local": local_first, "remote": remote_first,
                                     "local_static": local_static_first, "remote_replay": replay_first},
        "decode_slowdown": local_gen / remote_gen, "decode_slowdown_kv_session": local_gen / remote_kv,
        # Round by round (the runs of a round are seconds apart; rounds can be a minute apart and
        # the machine's speed drifts), against the local way that is faster over all rounds. Not
        # the faster of the two in each round: the larger of two noisy rates overstates the
        # local side (e.g. 1.39x that way against 1.14x of medians in one run).
        "decode_replay_baseline": faster_local,
        "decode_slowdown_replay": median([a / r for a, r in zip(rounds[faster_local], rounds["remote_replay"])]),
        "decode_slowdown_replay_of_medians": best_local / remote_replay,
        "decode_slowdown_replay_vs_each_rounds_faster": median([max(a, b) / r for a, b, r in zip(
            rounds["local"], rounds["local_static"], rounds["remote_replay"])]),
        "decode_rounds_tokens_per_s": {name: rounds[name] for name in ("local", "local_static", "remote_replay")},
        "wire_bytes_per_token": per_token, "wire_bytes_per_token_replay": per_token_replay,
        # prefill and (replay) the recording included, as for the bytes
        "blocking_waits_per_token": waits_per_token, "blocking_waits_per_token_replay": waits_per_token_replay,
    }


def training(batch: int, seq: int, rounds: int) -> dict:
    """Steps/s of one training step of the demo GPT (next-token loss, AdamW), local eager vs
    remote op by op vs remote replayed, two steps of each per round, in turns; every copy of the
    model takes the same number of steps, and their losses then agree."""
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    idx, target = torch.randint(0, cfg.vocab_size, (batch, seq)), torch.randint(0, cfg.vocab_size, (batch, seq))
    pos = torch.arange(seq)
    inputs = (idx.to(DEV), target.to(DEV), pos.to(DEV))

    def step(m, optimizer, a, b, p):
        optimizer.zero_grad(set_to_none=False)
        logits, _ = m(a, p)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), b.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss

    copies = {"local": model, "remote": copy.deepcopy(model).to(DEV), "remote_replay": copy.deepcopy(model).to(DEV)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=name != "local")
                  for name, m in copies.items()}
    args = {"local": (idx, target, pos), "remote": inputs, "remote_replay": inputs}
    losses = {name: step(copies[name], optimizers[name], *args[name]).item() for name in copies}  # state made
    recorded_loss = torch.zeros((), device=DEV)
    graph = genie.Graph()
    with genie.graph(graph):
        recorded_loss.copy_(step(copies["remote_replay"], optimizers["remote_replay"], *inputs))
    losses["remote_replay"] = recorded_loss.item()
    runs = {
        "local": lambda: step(copies["local"], optimizers["local"], *args["local"]).item(),
        "remote": lambda: step(copies["remote"], optimizers["remote"], *inputs).item(),
        "remote_replay": lambda: (graph.replay(), recorded_loss.item())[1],
    }
    for name in ("local", "remote"):
        losses[name] = runs[name]()  # the second step, as recorded above
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            for _ in range(2):
                t0 = time.perf_counter()
                losses[name] = run()
                times[name].append(time.perf_counter() - t0)
    assert abs(losses["remote"] - losses["local"]) <= 1e-3 * abs(losses["local"]) + 1e-4, losses
    assert abs(losses["remote_replay"] - losses["local"]) <= 1e-3 * abs(losses["local"]) + 1e-4, losses
    rates = {name: 1 / median(ts) for name, ts in times.items()}
    w0 = blocking_waits()
    for _ in range(4):
        step(copies["remote"], optimizers["remote"], *inputs)
    waits = (blocking_waits() - w0) / 4  # without reading the loss (the timed runs read it: one wait)
    torch.remote_accelerator.synchronize()
    return {"steps_per_s": rates, "ops_per_step": graph.ops, "final_loss": losses,
            "blocking_waits_per_step_unread": waits,
            "slowdown": rates["local"] / rates["remote"], "slowdown_replay": rates["local"] / rates["remote_replay"]}


def cnn(batch: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    images = torch.randn(batch, 3, 64, 64)
    remote = copy.deepcopy(model).to(DEV)

    def run(m, x):
        with torch.no_grad():
            m(x).argmax(-1).tolist()

    local = time_it(lambda: run(model, images), repeats)
    rem = time_it(lambda: run(remote, images.to(DEV)), repeats)
    return {"images_per_s": {"local": batch / local, "remote": batch / rem}, "slowdown": rem / local}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-seq", type=int, default=64)
    args = p.parse_args(argv)
    g = gpt(args.tokens, args.prompt_len, args.repeats)
    c = cnn(args.batch, args.repeats)
    t = training(args.train_batch, args.train_seq, max(args.repeats, TRAIN_ROUNDS))
    m = machine()
    print(f"# end to end, local genie-daemon vs local eager -- {m['cpus']} cpus, torch {m['torch']}, "
          f"medians of {args.repeats}")
    print_table([
        ("GPT prefill tokens/s", f"{g['prefill_tokens_per_s']['local']:.0f}", f"{g['prefill_tokens_per_s']['remote']:.0f}", ""),
        ("GPT decode tokens/s (torch.cat cache)", f"{g['decode_tokens_per_s']['local']:.0f}",
         f"{g['decode_tokens_per_s']['remote']:.0f}", f"{g['decode_slowdown']:.1f}x slower"),
        ("GPT decode tokens/s (KVSession)", "", f"{g['decode_tokens_per_s']['remote_kv_session']:.0f}",
         f"{g['decode_slowdown_kv_session']:.1f}x slower"),
        ("GPT decode tokens/s (static cache; genie.graph replay)", f"{g['decode_tokens_per_s']['local_static']:.0f}",
         f"{g['decode_tokens_per_s']['remote_replay']:.0f}",
         f"{g['decode_slowdown_replay']:.2f}x slower than the faster local way, round by round"),
        ("GPT prefill + first decode step ms (static cache; replay records)",
         f"{g['prefill_and_first_step_s']['local_static'] * 1e3:.1f}",
         f"{g['prefill_and_first_step_s']['remote_replay'] * 1e3:.1f}", ""),
        ("GPT bytes on the wire per token (torch.cat / replay)", "",
         f"{g['wire_bytes_per_token']:.0f} / {g['wire_bytes_per_token_replay']:.0f}", ""),
        ("GPT waits for the daemon per token (torch.cat / replay)", "",
         f"{g['blocking_waits_per_token']:.2f} / {g['blocking_waits_per_token_replay']:.2f}", ""),
        ("CNN images/s (batch 32, 64x64)", f"{c['images_per_s']['local']:.0f}", f"{c['images_per_s']['remote']:.0f}",
         f"{c['slowdown']:.1f}x slower"),
        (f"GPT training steps/s (AdamW, batch {args.train_batch} x {args.train_seq}), op by op",
         f"{t['steps_per_s']['local']:.1f}", f"{t['steps_per_s']['remote']:.1f}", f"{t['slowdown']:.1f}x slower"),
        (f"GPT training steps/s, step replayed ({t['ops_per_step']} ops)", "",
         f"{t['steps_per_s']['remote_replay']:.1f}", f"{t['slowdown_replay']:.2f}x slower"),
        ("GPT training: waits for the daemon per step, loss not read", "",
         f"{t['blocking_waits_per_step_unread']:.2f}", ""),
    ], ("workload", "local eager", "genie (local daemon)", "ratio"))
    print("wrote", write_json("end_to_end", {"gpt": g, "cnn": c, "training": t}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
