"""Semantic analysis and scheduling: pure functions over captured graphs, no I/O.

graph      the graph every builder produces (nodes with op, inputs, shapes, module path)
patterns   pattern plugins (attention, KV cache, convolution, MLP, ...) and their registry
phases     per-node phase: llm_prefill, llm_decode, vision_backbone, forward, backward
costs      FLOPs, bytes, intensity, network bytes and transfer time under a network model
cache      content-addressed two-level analysis cache with hit statistics
scheduler  ExecutionSchedule: groups, stages, strategies, placement over devices
analyzer   ties the above together; report renders summaries and pictures

Imports only torch (for dtypes), networkx and the standard library; nothing of the
runtime or the frontend.
"""
from .analyzer import Analysis, analyze_graph
from .costs import DeviceSpec, LinkSpec, NetworkModel
from .graph import Graph, Node
from .patterns import PatternMatch, PatternPlugin, register_pattern, registered_patterns
from .scheduler import ExecutionSchedule

__all__ = [
    "Analysis", "analyze_graph", "DeviceSpec", "LinkSpec", "NetworkModel", "Graph", "Node",
    "PatternMatch", "PatternPlugin", "register_pattern", "registered_patterns", "ExecutionSchedule",
]
