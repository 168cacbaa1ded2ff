"""One analysis: patterns, phases, costs and schedule of a graph, through the cache."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from . import costs as cost_model
from . import patterns as pattern_lib
from .cache import AnalysisCache
from .costs import GraphCosts, NetworkModel
from .graph import Graph
from .patterns import PatternMatch
from .phases import detect_phases
from .scheduler import ExecutionSchedule, plan_structure, schedule

default_cache = AnalysisCache()


@dataclass
class Analysis:
    graph: Graph
    patterns: list[PatternMatch]
    phases: dict[int, str]
    costs: GraphCosts
    schedule: ExecutionSchedule | None
    topology_hash: str
    seconds: float
    cache_hit: bool

    # ---------------------------------------------------------- queries

    def matches(self, pattern: str) -> list[PatternMatch]:
        return [m for m in self.patterns if m.pattern == pattern]

    def pattern_counts(self) -> dict[str, int]:
        return dict(collections.Counter(m.pattern for m in self.patterns))

    def phase_counts(self) -> dict[str, int]:
        return dict(collections.Counter(self.phases[n.id] for n in self.graph.op_nodes()))

    def kv_cache_nodes(self) -> set[int]:
        return {m.hints["cache_node"] for m in self.matches("kv_cache")}

    # ---------------------------------------------------------- report

    def summary(self) -> str:
        g = self.graph
        lines = [f"Genie analysis: {len(g.op_nodes())} ops, {len(g) - len(g.op_nodes())} inputs "
                 f"(builder: {g.builder}, topology {self.topology_hash[:12]}, "
                 f"{'cache hit' if self.cache_hit else 'analysed'} in {self.seconds * 1e3:.2f} ms)"]
        lines.append("patterns: " + (", ".join(f"{k} x{v}" for k, v in sorted(self.pattern_counts().items())) or "none"))
        lines.append("phases:   " + ", ".join(f"{k} {v}" for k, v in sorted(self.phase_counts().items())))
        c = self.costs
        lines.append(f"costs:    {c.total_flops / 1e6:.2f} MFLOP, {c.total_bytes / 1e6:.2f} MB touched, "
                     f"network {c.network_bytes_in} B in + {c.network_bytes_out} B out")
        if self.schedule is not None:
            s = self.schedule
            per_dev = collections.Counter(s.placement[n.id] for n in g.op_nodes())
            lines.append(f"schedule: {len(s.stages)} stages, {len(s.groups)} groups, est. {s.makespan * 1e3:.2f} ms, "
                         f"{s.bytes_moved} B moved; strategies "
                         + ", ".join(f"{k} {v}" for k, v in collections.Counter(st.strategy for st in s.stages).items()))
            lines.append("placement: " + ", ".join(f"{d}: {n} ops" for d, n in sorted(per_dev.items())))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_png(self, path: str) -> str:
        from .drawing import draw

        return draw(self, path, "png")

    def to_svg(self, path: str) -> str:
        from .drawing import draw

        return draw(self, path, "svg")


def analyze_graph(graph: Graph, network: NetworkModel | None = None, cache: AnalysisCache | None = None) -> Analysis:
    cache = cache or default_cache
    t0 = time.perf_counter()
    hits_before = cache.topology.hits + cache.shapes.hits

    def level1():
        matches = pattern_lib.match_all(graph)
        return matches, detect_phases(graph, matches), graph.wl_hash(), plan_structure(graph, matches)

    matches, phases, topo_hash, structure = cache.lookup(1, graph.fingerprint, level1)
    resident = {m.hints["cache_node"] for m in matches if m.pattern == "kv_cache"}
    past = {p for m in matches if m.pattern == "kv_cache" for p in m.hints["past_inputs"]}

    def level2():
        c = cost_model.estimate(graph, network, resident_outputs=resident, resident_inputs=past)
        sched = schedule(graph, structure, c, network, resident_outputs=resident, resident_inputs=past) if network and network.devices else None
        return c, sched

    net_key = network.key() if network is not None else None
    graph_costs, sched = cache.lookup(2, (graph.fingerprint, graph.shape_fingerprint, net_key), level2)
    hit = cache.topology.hits + cache.shapes.hits - hits_before == 2
    return Analysis(graph, matches, phases, graph_costs, sched, topo_hash, time.perf_counter() - t0, hit)
