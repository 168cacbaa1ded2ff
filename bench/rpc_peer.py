"""The same GPT decode served through torch.distributed.rpc, as a peer to compare with.

A server process holds the model and its KV cache; each decode step is one
`rpc_sync` call that returns the next token (the cheapest protocol such a
hand-written service can have: all state server-side, one round trip per token).
Reports steady-state decode tokens/s (from the second generated token on, as bench.end_to_end)
next to local eager in the same run.

    python -m bench.rpc_peer [--tokens 32] [--repeats 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket

import torch

from bench.common import print_table, write_json

_state: dict = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_start(prompt: list[int]) -> int:
    from genie.examples.gpt import GPTConfig, TinyGPT

    if "model" not in _state:
        torch.manual_seed(0)
        _state["model"] = TinyGPT(GPTConfig()).eval()
    model = _state["model"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits, past = model(ids, torch.arange(len(prompt)))
    _state["past"], _state["pos"] = past, torch.tensor([len(prompt)])
    _state["tok"] = logits[:, -1].argmax(-1, keepdim=True)
    return int(_state["tok"].item())


def server_step() -> int:
    model = _state["model"]
    with torch.no_grad():
        logits, _state["past"] = model(_state["tok"], _state["pos"], _state["past"])
    _state["tok"] = logits[:, -1].argmax(-1, keepdim=True)
    _state["pos"] = _state["pos"] + 1
    return int(_state["tok"].item())


def _worker(rank: int, port: int) -> None:
    import torch.distributed.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    rpc.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import torch.distributed.rpc as rpc

    from bench.end_to_end import DECODE_ROUNDS, decode_rates
    from genie.examples.gpt import GPTConfig, TinyGPT, generate

    port = _free_port()
    server = mp.get_context("spawn").Process(target=_worker, args=(1, port))
    server.start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("w0", rank=0, world_size=2)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig()).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 16))
    expected = generate(model, prompt, args.tokens)

    def via_rpc(on_token=None) -> list[int]:
        out = [rpc.rpc_sync("w1", server_start, args=(prompt[0].tolist(),))]
        if on_token is not None:
            on_token(out[-1])
        for _ in range(args.tokens - 1):
            out.append(rpc.rpc_sync("w1", server_step))
            if on_token is not None:
                on_token(out[-1])
        return out

    assert via_rpc() == expected
    # Steady-state decode, timed as in bench.end_to_end (from the second generated token on, taking turns).
    rates = decode_rates({"rpc": via_rpc, "local": lambda cb: generate(model, prompt, args.tokens, on_token=cb)},
                         max(args.repeats, DECODE_ROUNDS))
    rpc_rate, local_rate = rates["rpc"][0], rates["local"][0]
    rpc.shutdown()
    server.join(30)
    result = {"decode_tokens_per_s": {"rpc": rpc_rate, "local": local_rate}}
    print("# torch.distributed.rpc peer (TensorPipe, loopback)")
    print_table([("GPT decode tokens/s", f"{result['decode_tokens_per_s']['local']:.0f}",
                  f"{result['decode_tokens_per_s']['rpc']:.0f}")], ("workload", "local eager", "torch rpc"))
    print("wrote", write_json("rpc_peer", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
