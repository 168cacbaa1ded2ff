"""In a KV-cache generation loop, bytes on the wire per token do not grow with the context."""
import torch

import genie
from genie.examples.gpt import GPTConfig, TinyGPT, generate


def wire_bytes():
    stats = genie.transport_stats().values()
    return sum(s["bytes_sent"] for s in stats), sum(s["bytes_received"] for s in stats)


def per_token_bytes(model, dev, context: int, steps: int = 8):
    prompt = torch.randint(0, model.cfg.vocab_size, (1, context)).to(dev)
    generate(model, prompt, 1)  # warm the capture cache for this shape family
    genie.synchronize()
    s0, r0 = wire_bytes()
    generate(model, prompt, steps)
    s1, r1 = wire_bytes()
    # The prefill is common to both runs; subtract a run with 0 decode steps.
    genie.synchronize()
    s2, r2 = wire_bytes()
    generate(model, prompt, 0)
    s3, r3 = wire_bytes()
    return ((s1 - s0) - (s3 - s2)) / steps, ((r1 - r0) - (r3 - r2)) / steps


def test_bytes_per_token_independent_of_context(dev):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2, dim=64, max_seq_len=320)).eval().to(dev)
    sent16, recv16 = per_token_bytes(model, dev, 16)
    sent256, recv256 = per_token_bytes(model, dev, 256)
    print(f"bytes/token sent: ctx16={sent16:.0f} ctx256={sent256:.0f}; received: {recv16:.0f} {recv256:.0f}")
    assert sent16 > 0 and recv16 > 0
    # Equal up to msgpack's variable-length integers in op headers (a few bytes at most).
    assert abs(sent256 - sent16) <= 0.01 * sent16
    assert abs(recv256 - recv16) <= 0.05 * recv16
