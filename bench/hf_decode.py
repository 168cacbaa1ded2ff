"""Hugging Face transformers decoding through Genie (a local daemon) against local eager.

A Llama configuration (random-initialised: nothing is downloaded), greedy decoding three ways,
taking turns one generation each per round (bench.end_to_end.decode_rates):
- local eager: `model.generate()` on the CPU;
- remote op by op: the same `generate()` on `remote_accelerator:0` (every op captured, batched
  and sent; one blocking read per token, generate's stopping check);
- local eager step loop: prefill into a `transformers.StaticCache`, then the model's decode step
  called per token in Python (generate() without its own per-token work);
- remote replayed: the README's recipe, the same loop with the step recorded once with
  `genie.graph` and replayed per token.
Each remote way is compared with the local way doing the same work.
Tokens/s from the second generated token on; every way's tokens are checked equal.

    python -m bench.hf_decode [--tokens 32] [--repeats 5] [--layers 2] [--hidden 64]
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch

import genie
from bench.common import machine, median, print_table, write_json
from bench.end_to_end import DEV, decode_rates


def build(layers: int, hidden: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=2 * hidden, vocab_size=1000, bos_token_id=0, eos_token_id=1)
    return transformers.LlamaForCausalLM(config).eval()


def generate_eager(model, prompt, tokens: int, on_token) -> list[int]:
    """model.generate() greedily, `on_token` called as each token is known (a streamer's put)."""

    class Streamer:
        first = True

        def put(self, value):
            if self.first:  # generate() passes the prompt first
                self.first = False
                return
            on_token(int(value.reshape(-1)[0]))

        def end(self):
            pass

    out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=Streamer())
    return out[0, prompt.shape[1]:].tolist()


def generate_static(model, prompt, tokens: int, on_token, replay: bool = True) -> list[int]:
    """Prefill into a StaticCache op by op, then decode one step at a time: recorded once with
    genie.graph and replayed per token (`replay`), or the same Python step each token (the local
    baseline without generate()'s own per-token work)."""
    import transformers

    device, length = prompt.device, prompt.shape[1]
    with torch.no_grad():
        cache = transformers.StaticCache(config=model.config, max_cache_len=length + tokens)
        out = model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(length, device=device))
        token = out.logits[:, -1:].argmax(-1)
        result = [token.item()]
        on_token(result[-1])
        position = torch.tensor([length], device=device)

        def step_once():
            out = model(input_ids=token, past_key_values=cache, cache_position=position)
            token.copy_(out.logits[:, -1:].argmax(-1))
            position.add_(1)

        step = genie.Graph() if replay else None
        for i in range(tokens - 1):
            if step is None:
                step_once()
            elif i == 0:
                with genie.graph(step):
                    step_once()
            else:
                step.replay()
            result.append(token.item())
            on_token(result[-1])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16)
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed (pip install transformers): nothing measured")
        return 0
    warnings.simplefilter("ignore")  # transformers' notes about random-initialised configurations
    model = build(args.layers, args.hidden)
    remote = copy.deepcopy(model).to(DEV)
    prompt = torch.randint(2, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    rprompt = prompt.to(DEV)
    expected = generate_eager(model, prompt, args.tokens, lambda t: None)
    assert generate_static(model, prompt, args.tokens, lambda t: None, replay=False) == expected
    assert generate_eager(remote, rprompt, args.tokens, lambda t: None) == expected
    assert generate_static(remote, rprompt, args.tokens, lambda t: None) == expected
    rounds: dict = {}
    rates = decode_rates({
        "local": lambda cb: generate_eager(model, prompt, args.tokens, cb),
        "local_static": lambda cb: generate_static(model, prompt, args.tokens, cb, replay=False),
        "remote": lambda cb: generate_eager(remote, rprompt, args.tokens, cb),
        "remote_replay": lambda cb: generate_static(remote, rprompt, args.tokens, cb),
    }, args.repeats, rounds)
    # remote against the local way that does the same work: generate() against generate(), the
    # replayed step against the same step run locally in Python.
    ratio = {"remote": median([a / b for a, b in zip(rounds["local"], rounds["remote"])]),
             "remote_replay": median([a / b for a, b in zip(rounds["local_static"], rounds["remote_replay"])])}
    result = {
        "machine": machine(), "tokens": args.tokens, "layers": args.layers, "hidden": args.hidden,
        "decode_tokens_per_s": {name: rate for name, (rate, _) in rates.items()},
        "slowdown_vs_local": ratio,  # local tokens/s / remote tokens/s, median over rounds
    }
    m = result["machine"]
    print(f"# Hugging Face Llama ({args.layers} layers, hidden {args.hidden}) greedy decode -- "
          f"torch {m['torch']}, transformers {transformers.__version__}, medians of {args.repeats} rounds")
    print_table([
        ("local eager generate()", f"{rates['local'][0]:.0f}", ""),
        ("remote, generate() op by op", f"{rates['remote'][0]:.0f}", f"{ratio['remote']:.2f}x local generate()'s time"),
        ("local eager, StaticCache step loop", f"{rates['local_static'][0]:.0f}", ""),
        ("remote, StaticCache step replayed (genie.graph)", f"{rates['remote_replay'][0]:.0f}",
         f"{ratio['remote_replay']:.2f}x the local step loop's time"),
    ], ("decode", "tokens/s", "per token"))
    print("wrote", write_json("hf_decode", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
