"""Scheduler and placement: an ExecutionSchedule for a graph over measured devices.

1. Groups. Nodes that must stay together are united: an attention with the KV
   cache it reads and the projections that produce its query/key/value; each
   convolution block and MLP; views and copies with their producer. Groups are
   contracted into a DAG (cycles collapse into one group).
2. Stages. Topological generations of the group DAG: groups in one stage are
   independent of each other.
3. Placement. Groups pinned by residency go where their data lives (weights stay
   where they were uploaded, a cache stays with its attention). The rest are
   placed by list scheduling: each group goes to the device where it would
   finish first, counting compute at the device's measured FLOP/s, transfers
   over the measured links, and bringing results back.
4. Strategy per stage: parallel (several devices at once), pipeline (the stage
   runs on another device than the one feeding it), or sequential.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from .costs import GraphCosts, NetworkModel
from .graph import Graph
from .patterns import LINEAR, TRANSPARENT, PatternMatch, source_through_transparent


@dataclass
class Group:
    id: int
    nodes: list[int]
    label: str
    device: str | None = None
    pinned: str | None = None
    start: float = 0.0
    finish: float = 0.0


@dataclass
class Stage:
    index: int
    groups: list[int]
    strategy: str  # "sequential" | "parallel" | "pipeline"


@dataclass
class ExecutionSchedule:
    groups: dict[int, Group]
    stages: list[Stage]
    placement: dict[int, str]          # node id -> device name
    makespan: float                    # estimated seconds
    bytes_moved: int                   # network bytes: inputs in, cross-device edges, results out
    device_busy: dict[str, float] = field(default_factory=dict)

    def devices_used(self) -> set[str]:
        return {g.device for g in self.groups.values() if g.device}

    def device_of(self, node_id: int) -> str:
        return self.placement[node_id]


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def build_groups(graph: Graph, matches: list[PatternMatch]) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Co-location groups (root id -> op node ids) and a label per root."""
    uf = _UnionFind(len(graph))
    labels: dict[int, str] = {}
    by_name: dict[str, list[PatternMatch]] = {}
    for m in matches:
        by_name.setdefault(m.pattern, []).append(m)

    attention_of_cache = {m.hints["cache_node"]: m.hints.get("attention") for m in by_name.get("kv_cache", [])}
    for m in by_name.get("attention", []):
        members = set(m.nodes)
        for role in ("q", "k", "v"):
            nid = m.hints.get(role)
            if nid is None:
                continue
            for src in source_through_transparent(graph, nid):
                if graph[src].op in LINEAR or graph[src].op in TRANSPARENT or graph[src].op == "aten::cat":
                    members.add(src)
        for cache, attn in attention_of_cache.items():
            if attn == m.hints["output"]:
                members.add(cache)
        members = [x for x in members if not graph[x].is_input]
        for x in members[1:]:
            uf.union(members[0], x)
        labels[members[0]] = "attention+kv" if any(c in members for c in attention_of_cache) else "attention"
    for name in ("convolution", "mlp"):
        for m in by_name.get(name, []):
            ops = [x for x in m.nodes if not graph[x].is_input]
            for x in ops[1:]:
                uf.union(ops[0], x)
            labels.setdefault(ops[0], name)
    # Views and copies travel with what they view; a view of a weight travels with its user.
    for n in graph.nodes:
        if n.op in TRANSPARENT or n.op == "aten::getitem":
            producers = [i for i in n.input_ids if not graph[i].is_input]
            if producers:
                uf.union(producers[0], n.id)
            elif len(graph.consumers(n.id)) == 1:
                uf.union(graph.consumers(n.id)[0], n.id)

    groups: dict[int, list[int]] = {}
    for n in graph.nodes:
        if not n.is_input:
            groups.setdefault(uf.find(n.id), []).append(n.id)
    out_labels = {}
    for root, members in groups.items():
        label = next((labels[uf.find(x)] for x in members if uf.find(x) in labels and x in labels), None)
        label = label or labels.get(root) or graph[members[0]].op.split("::")[-1]
        out_labels[root] = label
    return groups, out_labels


@dataclass(frozen=True)
class Structure:
    """The topology-only part of a schedule (cached with the patterns): groups and their order."""

    members: dict[int, tuple[int, ...]]
    labels: dict[int, str]
    node_group: dict[int, int]
    generations: dict[int, int]
    order: tuple[int, ...]
    inputs: dict[int, tuple[tuple[int, int], ...]]  # group -> (node, output index) it reads from outside


def plan_structure(graph: Graph, matches: list[PatternMatch]) -> Structure:
    raw_groups, labels = build_groups(graph, matches)
    group_of: dict[int, int] = {n: root for root, members in raw_groups.items() for n in members}
    # Contract into a DAG; strongly connected pieces (rare) become one group.
    gdag = nx.DiGraph()
    gdag.add_nodes_from(raw_groups)
    for n in graph.nodes:
        if n.is_input:
            continue
        for i in n.input_ids:
            if not graph[i].is_input and group_of[i] != group_of[n.id]:
                gdag.add_edge(group_of[i], group_of[n.id])
    cond = nx.condensation(gdag)
    members, group_labels = {}, {}
    for cid in cond.nodes:
        members[cid] = tuple(sorted(x for root in cond.nodes[cid]["members"] for x in raw_groups[root]))
        group_labels[cid] = labels[min(cond.nodes[cid]["members"])]
    node_group = {x: gid for gid, nodes in members.items() for x in nodes}
    generations: dict[int, int] = {}
    for gid in nx.topological_sort(cond):  # longest path from a source = the group's stage
        generations[gid] = 1 + max((generations[p] for p in cond.predecessors(gid)), default=-1)
    order = tuple(sorted(cond.nodes, key=lambda gid: (generations[gid], members[gid][0])))
    inputs = {}
    for gid, nodes in members.items():
        seen = []
        for x in nodes:
            for ref in graph[x].inputs:
                if (graph[ref[0]].is_input or node_group[ref[0]] != gid) and ref not in seen:
                    seen.append(ref)
        inputs[gid] = tuple(seen)
    return Structure(members, group_labels, node_group, generations, order, inputs)


def schedule(graph: Graph, structure: Structure, costs: GraphCosts, network: NetworkModel,
             resident_outputs: set[int] | None = None, resident_inputs: set[int] | None = None) -> ExecutionSchedule:
    """Place every group; `resident_*` are KV-cache tensors that live with their attention."""
    if not network.devices:
        raise ValueError("scheduling needs at least one device in the network model")
    groups = {gid: Group(gid, list(nodes), structure.labels[gid]) for gid, nodes in structure.members.items()}
    node_group = structure.node_group

    # Pins: a group reading a resident tensor runs where that tensor lives.
    device_names = {d.name for d in network.devices}
    for n in graph.nodes:
        if n.is_input and n.resident in device_names:
            for c in graph.consumers(n.id):
                groups[node_group[c]].pinned = groups[node_group[c]].pinned or n.resident

    outputs = graph.output_ids()
    resident_outputs = resident_outputs or set()
    resident_inputs = resident_inputs or set()
    avail = {d.name: 0.0 for d in network.devices}
    busy = {d.name: 0.0 for d in network.devices}
    generations, order = structure.generations, structure.order
    for gid in order:
        g = groups[gid]
        flops = sum(costs.nodes[x].flops for x in g.nodes)
        back = sum(graph[x].meta.nbytes for x in g.nodes
                   if x in outputs and x not in resident_outputs and graph[x].meta is not None)
        candidates = [network.by_name(g.pinned)] if g.pinned else network.devices
        best = None
        for d in candidates:
            ready = 0.0
            for i, k in structure.inputs[gid]:
                src = graph[i]
                nbytes = src.outputs[k].nbytes if k < len(src.outputs) and src.outputs[k] else 0
                if src.is_input:
                    if i in resident_inputs:
                        continue  # e.g. a KV cache's past: it already lives where its attention runs
                    if src.resident in device_names:
                        ready = max(ready, network.transfer_time(src.resident, d.name, nbytes))
                    elif src.op == "input" and not d.is_local:
                        ready = max(ready, d.link.transfer_time(nbytes))  # data comes from the client
                else:
                    pg = groups[node_group[i]]
                    ready = max(ready, pg.finish + network.transfer_time(pg.device, d.name, nbytes))
            start = max(ready, avail[d.name])
            finish = start + flops / d.flops + len(g.nodes) * d.op_overhead
            score = finish + (0.0 if d.is_local or not back else d.link.transfer_time(back))
            if best is None or score < best[0] - 1e-12:
                best = (score, d.name, start, finish)
        _, g.device, g.start, g.finish = best
        avail[g.device] = g.finish
        busy[g.device] += g.finish - g.start

    stages = []
    by_gen: dict[int, list[int]] = {}
    for gid in order:
        by_gen.setdefault(generations[gid], []).append(gid)
    previous: set[str] = set()
    for index, gen in enumerate(sorted(by_gen)):
        gids = by_gen[gen]
        devs = {groups[g].device for g in gids}
        if len(devs) > 1:
            strategy = "parallel"
        elif previous and devs != previous:
            strategy = "pipeline"
        else:
            strategy = "sequential"
        stages.append(Stage(index, gids, strategy))
        previous = devs

    placement = {x: g.device for g in groups.values() for x in g.nodes}
    for n in graph.nodes:
        if n.is_input:
            users = graph.consumers(n.id)
            placement[n.id] = n.resident or (placement[users[0]] if users else "local")
    moved = costs.network_bytes_in + costs.network_bytes_out
    for n in graph.nodes:
        if n.is_input:
            continue
        for i, k in n.inputs:
            if not graph[i].is_input and placement[i] != placement[n.id]:
                src = graph[i].outputs[k] if k < len(graph[i].outputs) else None
                moved += src.nbytes if src else 0
    makespan = max((g.finish for g in groups.values()), default=0.0)
    return ExecutionSchedule(groups, stages, placement, makespan, moved, busy)
