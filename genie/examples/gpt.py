"""A small GPT-style decoder with a KV cache, written in plain PyTorch (random weights).

Positions are passed as a tensor so that a decode loop can advance them on the
device (`pos + 1`) instead of sending new Python integers every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    max_seq_len: int = 512
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4


def _is_cache_object(past) -> bool:
    # Looked up on the type, so that an FX proxy (which answers every attribute) is not one.
    return callable(getattr(type(past), "update", None)) and not isinstance(past, (list, tuple, dict))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, past, layer: int = 0):
        """`past`: None, a (keys, values) pair, or a cache object with update(layer, k, v) -> (keys, values)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        mask = None
        if _is_cache_object(past):
            causal = not past.has_layer(layer) and t > 1
            k, v = past.update(layer, k, v)  # a KV store keeps the cache (genie.KVSession, StaticKVCache)
            mask = getattr(past, "attention_mask", None)  # a static cache masks the positions not yet written
            if mask is not None:
                causal = False
        else:
            causal = past is None and t > 1  # (written so that torch.fx can trace it)
            if past is not None:
                k = torch.cat([past[0], k], dim=2)  # the KV cache grows along the sequence axis
                v = torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.proj(y), (k, v)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.GELU(), nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        )

    def forward(self, x, past, layer: int = 0):
        a, present = self.attn(self.ln1(x), past, layer)
        x = x + a
        x = x + self.mlp(self.ln2(x))
        return x, present


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor, past_key_values=None):
        """idx: (B, T) token ids; pos: (T,) positions; returns logits and the updated cache."""
        x = self.tok_emb(idx) + self.pos_emb(pos)
        presents = []
        cache_object = _is_cache_object(past_key_values)
        if cache_object and callable(getattr(type(past_key_values), "begin", None)):
            past_key_values.begin(pos)
        for i, block in enumerate(self.blocks):
            past = past_key_values if cache_object else (None if past_key_values is None else past_key_values[i])
            x, present = block(x, past, i)
            presents.append(present)
        return self.head(self.ln_f(x)), presents


@torch.no_grad()
def generate(model: TinyGPT, prompt: torch.Tensor, new_tokens: int, on_token=None, kv_session=None,
             read_every: int = 1) -> list[int]:
    """Greedy decoding with a KV cache. `prompt` is (1, T) on the model's device.

    Each step reads only the chosen token (`.item()`); the cache, positions and
    the next input stay on the model's device. With `kv_session` (a genie.KVSession)
    the daemon's KV store keeps the cache instead of `torch.cat`. `read_every=N` reads the
    tokens N at a time (one round trip per N tokens instead of per token: what counts on a
    link with latency; a stopping check would then see each token up to N - 1 steps late).
    """
    device = prompt.device
    t = prompt.shape[1]
    pos = torch.arange(t, device=device)
    logits, past = model(prompt, pos, kv_session)
    next_tok = logits[:, -1].argmax(dim=-1, keepdim=True)
    pos = pos[-1:] + 1
    out, unread = [], []
    for i in range(new_tokens):
        unread.append(next_tok)
        if len(unread) == read_every or i == new_tokens - 1:
            _take_tokens(unread, out, on_token)
        logits, past = model(next_tok, pos, kv_session if kv_session is not None else past)
        next_tok = logits[:, -1].argmax(dim=-1, keepdim=True)
        pos = pos + 1
    return out


def _take_tokens(unread: list, out: list, on_token) -> None:
    """Read the token tensors in `unread` ((1, n) each) with one round trip, append them to `out`."""
    values = unread[0] if len(unread) == 1 else torch.cat(unread, dim=1)
    tokens = [values.item()] if values.numel() == 1 else values.flatten().tolist()
    unread.clear()
    for token in tokens:
        out.append(token)
        if on_token is not None:
            on_token(token)


class StaticKVCache:
    """Keys and values preallocated for `max_len` positions and written in place at `pos`.

    Shapes never change from one decode step to the next, so a step can be recorded once and
    replayed (`genie.graph`), as CUDA graphs need too. Attention masks the positions not yet written.
    """

    def __init__(self, cfg: GPTConfig, batch: int, max_len: int, device) -> None:
        shape = (batch, cfg.n_heads, max_len, cfg.dim // cfg.n_heads)
        self.keys = [torch.zeros(shape, device=device) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape, device=device) for _ in range(cfg.n_layers)]
        self.slots = torch.arange(max_len, device=device)
        self.attention_mask = None
        self._positions = None
        self._written: set[int] = set()

    def begin(self, pos: torch.Tensor) -> None:
        """Called by the model with this step's positions: query i sees slots up to pos[i]."""
        self._positions = pos
        self.attention_mask = self.slots[None, :] <= pos[:, None]

    def has_layer(self, layer: int) -> bool:
        return layer in self._written

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.keys[layer].index_copy_(2, self._positions, k)
        self.values[layer].index_copy_(2, self._positions, v)
        self._written.add(layer)
        return self.keys[layer], self.values[layer]


@torch.no_grad()
def generate_static(model: TinyGPT, prompt: torch.Tensor, new_tokens: int, replay: bool = True,
                    on_token=None, read_every: int = 1) -> list[int]:
    """Greedy decoding with a `StaticKVCache`; on a remote device with `replay`, the decode step is
    recorded once with `genie.graph` and then replayed, so each token costs one small message and
    no Python model code. The same tokens as `generate`. `read_every=N`: as in `generate`; the
    step then also writes its token into a list of tokens on the device, read N at a time."""
    device = prompt.device
    cache = StaticKVCache(model.cfg, prompt.shape[0], prompt.shape[1] + new_tokens, device)
    pos = torch.arange(prompt.shape[1], device=device)
    logits, _ = model(prompt, pos, cache)
    token = logits[:, -1].argmax(dim=-1, keepdim=True)  # static input and output of the step
    pos = pos[-1:] + 1
    first = prompt.shape[1]
    history = torch.zeros(new_tokens, dtype=token.dtype, device=device) if read_every > 1 else None

    def step() -> None:
        if history is not None:
            history.index_copy_(0, pos - first, token.view(1))  # before the step replaces it
        logits, _ = model(token, pos, cache)
        token.copy_(logits[:, -1].argmax(dim=-1, keepdim=True))
        pos.add_(1)

    graph = None
    if replay and device.type == "remote_accelerator":
        import genie

        graph = genie.Graph()
    out = []
    for i in range(new_tokens):
        if history is None:
            _take_tokens([token], out, on_token)
        if graph is None:
            step()
        elif i == 0:
            with genie.graph(graph, device):
                step()
        else:
            graph.replay()
        if history is not None and (i + 1 - len(out) == read_every or i == new_tokens - 1):
            _take_tokens([history[len(out):i + 1].view(1, -1)], out, on_token)
    return out
