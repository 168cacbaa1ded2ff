"""Semantic analysis over the in-repo model zoo, without daemons: patterns, phases, costs, cache, plugins.

Reported matches have confidence >= patterns.REPORT_THRESHOLD (0.5); "nothing spurious" means no
match of an unexpected pattern at or above that threshold.
"""
import pytest
import torch
import torch.nn as nn

from genie.examples.gpt import GPTConfig, TinyGPT
from genie.examples.zoo import SmallCNN, TinyBERT, TwoTower
from genie.frontend.graph_capture import Capture, build_graph
from genie.semantic import PatternMatch, PatternPlugin, analyze_graph, register_pattern
from genie.semantic.cache import AnalysisCache
from genie.semantic.costs import estimate
from genie.semantic.patterns import REPORT_THRESHOLD, unregister_pattern

BUILDERS = ["fx", "capture"]
N_LAYERS = 3


def analyse(model, args, kwargs=None, prefer="fx"):
    with torch.no_grad():
        graph, out = build_graph(model, args, kwargs or {}, prefer=prefer)
    return analyze_graph(graph, cache=AnalysisCache()), out


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=N_LAYERS, dim=64)).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 12))
    return model, ids


def decode_args(model, ids, prefer):
    _, (logits, past) = analyse(model, (ids, torch.arange(ids.shape[1])), prefer=prefer)
    token = logits[:, -1].argmax(-1, keepdim=True)
    return (token, torch.tensor([ids.shape[1]])), {"past_key_values": past}


@pytest.mark.parametrize("prefer", BUILDERS)
def test_gpt_prefill(gpt, prefer):
    model, ids = gpt
    a, _ = analyse(model, (ids, torch.arange(ids.shape[1])), prefer=prefer)
    assert a.graph.builder == prefer
    counts = a.pattern_counts()
    assert counts["attention"] == N_LAYERS
    assert "kv_cache" not in counts and "convolution" not in counts
    assert all(m.hints["causal"] for m in a.matches("attention"))
    assert set(a.phase_counts()) == {"llm_prefill"}


@pytest.mark.parametrize("prefer", BUILDERS)
def test_gpt_decode(gpt, prefer):
    model, ids = gpt
    args, kwargs = decode_args(model, ids, prefer)
    a, _ = analyse(model, args, kwargs, prefer=prefer)
    counts = a.pattern_counts()
    assert counts["attention"] == N_LAYERS
    assert counts["kv_cache"] == 2 * N_LAYERS  # a key and a value cache per layer
    for m in a.matches("kv_cache"):
        assert m.confidence == 1.0 and m.hints["seq_axis"] == 2 and m.hints["attention"] is not None
    assert set(a.phase_counts()) == {"llm_decode"}
    assert "convolution" not in counts


@pytest.mark.parametrize("prefer", BUILDERS)
def test_bert_encoder(prefer):
    torch.manual_seed(0)
    a, _ = analyse(TinyBERT(layers=2).eval(), (torch.randint(0, 1000, (2, 10)),), prefer=prefer)
    counts = a.pattern_counts()
    assert counts["attention"] == 2 and counts["mlp"] == 2 and counts["embedding"] == 2
    assert "kv_cache" not in counts and "convolution" not in counts
    assert not any(m.hints["causal"] for m in a.matches("attention"))
    assert set(a.phase_counts()) == {"forward"}  # bidirectional attention: no prefill/decode


@pytest.mark.parametrize("prefer", BUILDERS)
def test_cnn(prefer):
    torch.manual_seed(0)
    a, _ = analyse(SmallCNN().eval(), (torch.randn(2, 3, 16, 16),), prefer=prefer)
    counts = a.pattern_counts()
    assert counts["convolution"] == 3
    assert not {"attention", "kv_cache", "embedding", "mlp"} & set(counts)
    conv_nodes = {n for m in a.matches("convolution") for n in m.nodes}
    assert all(a.phases[n] == "vision_backbone" for n in conv_nodes)
    assert {"llm_prefill", "llm_decode"}.isdisjoint(a.phase_counts())


@pytest.mark.parametrize("prefer", BUILDERS)
def test_two_tower(prefer):
    torch.manual_seed(0)
    a, _ = analyse(TwoTower().eval(), (torch.randn(2, 3, 16, 16), torch.randint(0, 1000, (2, 8))), prefer=prefer)
    counts = a.pattern_counts()
    assert counts["convolution"] == 3 and counts["attention"] == 2
    assert "kv_cache" not in counts
    for n in a.graph.op_nodes():
        if n.module_path.startswith("image_encoder.") and n.op.endswith("convolution"):
            assert a.phases[n.id] == "vision_backbone"
        if n.module_path.startswith("text_encoder."):
            assert a.phases[n.id] == "forward"


def test_fx_falls_back_to_the_recorder_on_data_dependent_control_flow():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.b(x)

    a, _ = analyse(Branchy(), (torch.ones(2, 4),))
    assert a.graph.builder == "capture"
    assert any(n.module_path == "a" for n in a.graph.op_nodes())
    assert not any(n.module_path == "b" for n in a.graph.op_nodes())


def test_backward_phase_is_detected():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with Capture(model) as cap:
        model(torch.randn(3, 4)).sum().backward()
    a = analyze_graph(cap.graph, cache=AnalysisCache())
    phases = a.phase_counts()
    assert phases.get("backward", 0) > 0 and phases.get("forward", 0) > 0
    assert any(n.module_path == "0" for n in cap.graph.op_nodes())


def test_third_party_plugin():
    class TanhPattern(PatternPlugin):
        name = "tanh_squash"
        expected_ops = frozenset({"aten::tanh"})

        def match(self, graph):
            return [PatternMatch(self.name, 0.8, (n.id,)) for n in graph.nodes if n.op == "aten::tanh"]

    register_pattern(TanhPattern())
    try:
        a, _ = analyse(TinyBERT(layers=1).eval(), (torch.randint(0, 1000, (1, 4)),))
        assert a.pattern_counts()["tanh_squash"] == 1
    finally:
        unregister_pattern("tanh_squash")
    a, _ = analyse(TinyBERT(layers=1).eval(), (torch.randint(0, 1000, (1, 4)),))
    assert "tanh_squash" not in a.pattern_counts()


def test_matches_below_the_report_threshold_are_not_reported():
    class UnsureTanh(PatternPlugin):
        name = "unsure_tanh"
        expected_ops = frozenset({"aten::tanh"})

        def match(self, graph):
            return [PatternMatch(self.name, REPORT_THRESHOLD - 0.01, (n.id,)) for n in graph.nodes if n.op == "aten::tanh"]

    register_pattern(UnsureTanh())
    try:
        a, _ = analyse(TinyBERT(layers=1).eval(), (torch.randint(0, 1000, (1, 4)),))
        assert "unsure_tanh" not in a.pattern_counts()
    finally:
        unregister_pattern("unsure_tanh")


def test_costs_count_matmul_flops_and_network_bytes():
    w = torch.randn(32, 16)
    with Capture() as cap:
        x = torch.randn(8, 32)
        y = x @ w
        cap.set_outputs(y)
    c = estimate(cap.graph)
    mm = next(n for n in cap.graph.op_nodes() if n.op == "aten::mm")
    assert c.nodes[mm.id].flops == 2 * 8 * 16 * 32
    assert c.nodes[mm.id].bytes_read == (8 * 32 + 32 * 16) * 4
    assert c.network_bytes_out == 8 * 16 * 4
    assert c.nodes[mm.id].intensity > 0


@pytest.mark.parametrize("prefer", BUILDERS)
def test_repeated_decode_steps_hit_the_cache(gpt, prefer):
    model, ids = gpt
    cache = AnalysisCache()
    (token, pos), kwargs = decode_args(model, ids, prefer)
    past = kwargs["past_key_values"]
    with torch.no_grad():
        for _ in range(50):
            graph, (logits, past) = build_graph(model, (token, pos), {"past_key_values": past}, prefer=prefer)
            a = analyze_graph(graph, cache=cache)
            assert a.pattern_counts()["kv_cache"] == 2 * N_LAYERS
            token, pos = logits[:, -1].argmax(-1, keepdim=True), pos + 1
    stats = cache.stats()
    assert stats["topology"]["hit_rate"] >= 0.9, stats
    assert stats["topology"]["misses"] == 1


class _RMSNorm(nn.Module):
    """As Llama, Mistral and Qwen write it (transformers' LlamaRMSNorm)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


@pytest.mark.parametrize("prefer", BUILDERS)
def test_written_out_rms_norm_is_a_normalization(prefer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _RMSNorm(16), nn.Linear(16, 16), _RMSNorm(16)).eval()
    a, _ = analyse(model, (torch.randn(2, 16),), prefer=prefer)
    norms = a.matches("normalization")
    assert len(norms) == 2 and all(m.hints["kind"] == "rms_norm" for m in norms)
    ops = [{a.graph[i].op for i in m.nodes} for m in norms]
    assert all({"aten::pow", "aten::mean", "aten::rsqrt", "aten::mul"} <= o for o in ops)
    assert all(any(a.graph[i].op == "param" for n in m.nodes for i in a.graph[n].input_ids) for m in norms)  # the weight

    class Rsqrt(nn.Module):  # an rsqrt alone is no normalisation
        def forward(self, x):
            return x * torch.rsqrt(x.abs() + 1)

    b, _ = analyse(nn.Sequential(nn.Linear(16, 16), Rsqrt()).eval(), (torch.randn(2, 16),), prefer=prefer)
    assert not b.matches("normalization")
