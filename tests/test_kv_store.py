"""The daemon's KV-cache store: constant bytes per decode step, resume after reconnect, clear eviction."""
import gc

import pytest
import torch

import genie
from daemons import DaemonProcess
from genie.examples.gpt import GPTConfig, TinyGPT, generate


def sent_received():
    s = genie.transport_stats().values()
    return sum(x["bytes_sent"] for x in s), sum(x["bytes_received"] for x in s)


def test_generation_with_a_kv_session_matches_cpu(dev):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2, dim=64)).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 8))
    expected = generate(model, prompt, 12)
    model.to(dev)
    session = genie.KVSession(dev)
    assert generate(model, prompt.to(dev), 12, kv_session=session) == expected
    session.close()


def test_decode_256_steps_constant_bytes_per_step(dev):
    torch.manual_seed(0)
    heads, head_dim = 4, 16
    session = genie.KVSession(dev)
    q = torch.randn(1, heads, 1, head_dim, device=dev)
    per_step = []
    for step in range(256):
        k_new = torch.randn(1, heads, 1, head_dim, device=dev)
        v_new = torch.randn(1, heads, 1, head_dim, device=dev)
        s0, r0 = sent_received()
        k, v = session.append(0, k_new, v_new, dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out.sum().item()
        s1, r1 = sent_received()
        per_step.append((s1 - s0, r1 - r0))
        assert k.shape == (1, heads, step + 1, head_dim)
    # Exactly equal once request/handle counters have the same msgpack width; never growing with context.
    assert per_step[128] == per_step[255], (per_step[128], per_step[255])
    sent = [s for s, _ in per_step[16:]]
    assert max(sent) - min(sent) <= 32, (min(sent), max(sent))
    assert torch.remote_accelerator.memory_stats()["kv_sessions"] >= 1
    session.close()


def test_session_survives_reconnect(daemon_endpoint):
    genie.init(daemon_endpoint)
    session = genie.KVSession("remote_accelerator:0")
    k0 = torch.arange(24.0).reshape(1, 2, 3, 4)
    session.append(3, k0.to("remote_accelerator:0"), (k0 + 100).to("remote_accelerator:0"), dim=2)
    genie.synchronize()
    sid = session.id
    genie.shutdown()  # the client goes away: its handles are freed, the session stays
    genie.init(daemon_endpoint)
    resumed = genie.KVSession.resume(sid, "remote_accelerator:0")
    k, v = resumed.get(3)
    assert torch.equal(k.cpu(), k0) and torch.equal(v.cpu(), k0 + 100)
    k2, _ = resumed.append(3, torch.ones(1, 2, 1, 4, device="remote_accelerator:0"),
                           torch.ones(1, 2, 1, 4, device="remote_accelerator:0"), dim=2)
    assert k2.shape == (1, 2, 4, 4) and torch.equal(k2.cpu()[:, :, :3], k0)
    resumed.close()


def test_idle_session_is_evicted_under_pressure_with_a_clear_error(daemon_endpoint):
    with DaemonProcess(extra=["--memory-limit", "0.01"]) as d:  # 10.24 MiB
        genie.init(d.endpoint)
        try:
            idle = genie.KVSession("remote_accelerator:0")
            kv = torch.zeros(1, 8, 256, 256, device="remote_accelerator:0")  # 2 MiB each for k and v
            idle.append(0, kv, kv, dim=2)
            del kv
            genie.synchronize()
            assert torch.remote_accelerator.memory_stats()["kv_bytes"] == 4 * 2**20
            big = torch.ones(2 * 2**20, device="remote_accelerator:0")  # 8 MiB: needs the session's memory
            assert big[0].item() == 1.0
            with pytest.raises(genie.RemoteExecutionError, match="evicted"):
                idle.get(0)
            del big
            gc.collect()
        finally:
            genie.init(daemon_endpoint)
