"""PinnedPool's buffers are normal tensors even when first taken inside the daemon's inference mode
(an upload), since a later download writes them outside it. Pinned memory needs CUDA; here
torch.empty is stood in for by one that ignores pin_memory, to check the mode alone."""
from __future__ import annotations

import torch

from genie_daemon.cuda_staging import PinnedPool


def test_a_buffer_taken_in_inference_mode_can_be_written_outside_it(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    pool = PinnedPool()
    with torch.inference_mode():
        buf = pool.take(1000)
    assert not buf.is_inference()
    buf[:4].copy_(torch.arange(4, dtype=torch.uint8))  # as PinnedStaging.download writes it
    assert buf[:4].tolist() == [0, 1, 2, 3]
