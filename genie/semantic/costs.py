"""Cost model: FLOPs and bytes per node, and transfer time over a measured network.

FLOPs follow the usual conventions (2*M*N*K for a matmul, 2 per multiply-add of
a convolution, one per element for elementwise ops). Bytes are what a node
reads and writes. Network bytes are what must cross a link: data inputs that
are not already resident on a remote device, and the graph's results. The
network model's bandwidth and latency per device come from the runtime's probe
at connect time, never from constants.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .graph import Graph, Node

MATMUL_LIKE = {"aten::mm", "aten::bmm", "aten::matmul"}


@dataclass(frozen=True)
class LinkSpec:
    bandwidth: float  # bytes per second between the client and the device
    latency: float    # seconds per message

    def transfer_time(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes else 0.0


@dataclass(frozen=True)
class DeviceSpec:
    name: str            # "remote_accelerator:0" or "local"
    flops: float         # measured FLOP/s
    link: LinkSpec       # client <-> device; zero-cost for the local device
    is_local: bool = False
    op_overhead: float = 0.0  # seconds per op (capture and dispatch)


@dataclass
class NetworkModel:
    devices: list[DeviceSpec] = field(default_factory=list)

    def by_name(self, name: str) -> DeviceSpec:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def transfer_time(self, src: str, dst: str, nbytes: int) -> float:
        """Moving nbytes from device src to device dst (through the client)."""
        if src == dst or nbytes == 0:
            return 0.0
        a, b = self.by_name(src), self.by_name(dst)
        return (0.0 if a.is_local else a.link.transfer_time(nbytes)) + \
               (0.0 if b.is_local else b.link.transfer_time(nbytes))

    def key(self) -> tuple:
        return tuple((d.name, round(d.flops, -6), round(d.link.bandwidth, -3), round(d.link.latency, 6))
                     for d in self.devices)


@dataclass(frozen=True)
class NodeCost:
    flops: float
    bytes_read: int
    bytes_written: int

    @property
    def intensity(self) -> float:
        moved = self.bytes_read + self.bytes_written
        return self.flops / moved if moved else 0.0


@dataclass
class GraphCosts:
    nodes: dict[int, NodeCost]
    total_flops: float
    total_bytes: int
    network_bytes_in: int    # data inputs that are not resident anywhere remote
    network_bytes_out: int   # graph results brought back
    transfer_time: dict[str, float]  # per device: moving network bytes over its link

    @property
    def network_bytes(self) -> int:
        return self.network_bytes_in + self.network_bytes_out


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def node_flops(graph: Graph, n: Node) -> float:
    out = n.meta
    if out is None or n.is_input:
        return 0.0
    ins = [graph[i].outputs[k] for i, k in n.inputs if graph[i].outputs and k < len(graph[i].outputs)]
    ins = [m for m in ins if m is not None]
    op = n.op
    if op in MATMUL_LIKE and len(ins) >= 2:
        k = ins[0].shape[-1] if ins[0].shape else 1
        return 2.0 * out.numel * k
    if op in ("aten::addmm", "aten::baddbmm") and len(ins) >= 3:
        k = ins[1].shape[-1] if ins[1].shape else 1
        return 2.0 * out.numel * k + out.numel
    if op == "aten::linear" and len(ins) >= 2:
        return 2.0 * out.numel * (ins[0].shape[-1] if ins[0].shape else 1)
    if "convolution" in op or op.startswith("aten::conv"):
        if len(ins) >= 2 and len(ins[1].shape) >= 3:
            w = ins[1].shape  # (out_ch, in_ch/groups, *kernel)
            return 2.0 * out.numel * w[1] * _prod(w[2:])
        return float(out.numel)
    if "scaled_dot_product" in op and len(ins) >= 3:
        q, k = ins[0].shape, ins[1].shape
        if len(q) >= 2 and len(k) >= 2:
            return 4.0 * _prod(q[:-2]) * q[-2] * k[-2] * q[-1]
    if "softmax" in op:
        return 5.0 * out.numel
    if "norm" in op:
        return 5.0 * (ins[0].numel if ins else out.numel)
    if op in ("aten::embedding",) or op.startswith("aten::view") or op in (
            "aten::_unsafe_view", "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::alias",
            "aten::detach", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::split"):
        return 0.0
    return float(max(out.numel, max((m.numel for m in ins), default=0)))


def node_cost(graph: Graph, n: Node) -> NodeCost:
    if n.is_input:
        return NodeCost(0.0, 0, 0)
    read = 0
    for i, k in n.inputs:
        outs = graph[i].outputs
        if k < len(outs) and outs[k] is not None:
            read += outs[k].nbytes
    written = sum(o.nbytes for o in n.outputs if o is not None)
    return NodeCost(node_flops(graph, n), read, written)


def estimate(graph: Graph, network: NetworkModel | None = None, resident_outputs: set[int] | None = None,
             resident_inputs: set[int] | None = None) -> GraphCosts:
    """Costs of every node and of the graph.

    `resident_outputs`: results that stay on their device (KV caches); `resident_inputs`:
    inputs that are already there (the past of a KV cache, produced by the previous step).
    """
    nodes = {n.id: node_cost(graph, n) for n in graph.nodes}
    resident_inputs = resident_inputs or set()
    bytes_in = sum(n.meta.nbytes for n in graph.nodes
                   if n.op == "input" and n.resident is None and n.meta is not None and n.id not in resident_inputs)
    resident_outputs = resident_outputs or set()
    bytes_out = 0
    for nid, k in graph.outputs:
        if nid in resident_outputs or graph[nid].is_input:
            continue
        outs = graph[nid].outputs
        if k < len(outs) and outs[k] is not None:
            bytes_out += outs[k].nbytes
    transfer = {}
    if network is not None:
        for d in network.devices:
            transfer[d.name] = 0.0 if d.is_local else d.link.transfer_time(bytes_in) + d.link.transfer_time(bytes_out)
    return GraphCosts(
        nodes=nodes,
        total_flops=sum(c.flops for c in nodes.values()),
        total_bytes=sum(c.bytes_read + c.bytes_written for c in nodes.values()),
        network_bytes_in=bytes_in, network_bytes_out=bytes_out, transfer_time=transfer,
    )
