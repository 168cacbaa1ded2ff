"""Execution phase of every node, decided from patterns and topology.

- backward:        recorded while autograd ran a backward pass
- vision_backbone: inside a convolution block, or in the same top-level module as one
- llm_decode:      in the scope of attention that reads a KV cache (the query is the new token)
- llm_prefill:     in the scope of causal attention without a cache (the whole prompt at once)
- forward:         everything else (encoders with bidirectional attention, heads, MLPs)

A model whose attention is causal or cached and that has no vision part is one
LLM: all its nodes take the LLM phase. Otherwise (multi-tower models) the phase
applies to the attention's top-level module, the first component of its path. Phases depend
only on topology, so they are cached with the patterns.
"""
from __future__ import annotations

from .graph import Graph
from .patterns import PatternMatch

PHASES = ("llm_prefill", "llm_decode", "vision_backbone", "forward", "backward")


def _scope(path: str) -> str:
    return path.split(".", 1)[0] if path else ""


def detect_phases(graph: Graph, matches: list[PatternMatch]) -> dict[int, str]:
    by_name: dict[str, list[PatternMatch]] = {}
    for m in matches:
        by_name.setdefault(m.pattern, []).append(m)

    cached_attention = {m.hints.get("attention") for m in by_name.get("kv_cache", []) if m.hints.get("attention")}
    decode_scopes, prefill_scopes = set(), set()
    for m in by_name.get("attention", []):
        scope = _scope(graph[m.hints["output"]].module_path)
        if m.hints["output"] in cached_attention:
            decode_scopes.add(scope)
        elif m.hints.get("causal"):
            prefill_scopes.add(scope)
    conv_nodes = {n for m in by_name.get("convolution", []) for n in m.nodes}
    vision_scopes = {_scope(graph[n].module_path) for n in conv_nodes} - {""}

    # A model with LLM attention and no vision part is one LLM: every node takes its phase.
    llm_phase = "llm_decode" if decode_scopes else ("llm_prefill" if prefill_scopes else None)
    whole_graph = llm_phase is not None and not vision_scopes

    phases: dict[int, str] = {}
    for n in graph.nodes:
        scope = _scope(n.module_path)
        if n.backward:
            phase = "backward"
        elif n.id in conv_nodes or scope in vision_scopes:
            phase = "vision_backbone"
        elif whole_graph:
            phase = llm_phase
        elif scope in decode_scopes:
            phase = "llm_decode"
        elif scope in prefill_scopes:
            phase = "llm_prefill"
        else:
            phase = "forward"
        phases[n.id] = phase
    return phases
