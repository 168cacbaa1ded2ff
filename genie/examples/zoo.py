"""Small models with random weights, each typical of a workload Genie should recognise:
a GPT-style decoder (in gpt.py), a BERT-style encoder, a CNN and a two-tower multimodal model."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import GPTConfig, TinyGPT


class EncoderLayer(nn.Module):
    """Bidirectional self-attention + MLP (post-norm, BERT style)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln2 = nn.LayerNorm(dim)

    def forward(self, x, mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        attn = F.softmax(scores, dim=-1) @ v
        x = self.ln1(x + self.out(attn.transpose(1, 2).reshape(b, t, d)))
        return self.ln2(x + self.ff(x))


class TinyBERT(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(layers))
        self.pool = nn.Linear(dim, dim)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return torch.tanh(self.pool(x[:, 0]))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class TwoTower(nn.Module):
    """Image encoder (CNN) + text encoder (transformer) + fusion head."""

    def __init__(self, dim: int = 64, image_width: int = 32, text_layers: int = 2) -> None:
        super().__init__()
        self.image_encoder = nn.Sequential(
            nn.Conv2d(3, image_width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(image_width, image_width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(image_width, 2 * image_width, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * image_width, dim),
        )
        self.text_encoder = TinyBERT(dim=dim, layers=text_layers)
        self.fusion = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, 2))

    def forward(self, image, ids):
        return self.fusion(torch.cat([self.image_encoder(image), self.text_encoder(ids)], dim=-1))


__all__ = ["GPTConfig", "TinyGPT", "TinyBERT", "SmallCNN", "TwoTower", "EncoderLayer"]
