"""The graph that every builder (FX/make_fx, the capture recorder) produces.

Nodes are numbered in program order. An op node has the ATen op name without
overload (``aten::mm``), its input node ids (with the output index it reads),
the metadata of each output, the module path that produced it, and a few
scalar attributes the analysis reads (``dim`` of a cat, ``is_causal``).
Input nodes stand for tensors that came from outside: ``param``/``buffer``
(model state) or ``input`` (data). `resident` marks inputs that already live on
a remote device (their bytes do not cross the network again).

The structural fingerprint is built incrementally as nodes are added, so that
looking a graph up in the analysis cache costs O(1) after recording.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import networkx as nx


@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    itemsize: int

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(slots=True)
class Node:
    id: int
    op: str                                   # "aten::mm", or "input" / "param" / "buffer"
    inputs: tuple[tuple[int, int], ...]       # (producer node id, output index)
    outputs: tuple[TensorMeta | None, ...]    # metadata of each tensor output
    module_path: str = ""
    attrs: dict = field(default_factory=dict)
    backward: bool = False                    # recorded while autograd ran a backward pass
    resident: str | None = None               # for inputs: the device the tensor already lives on
    target: Any = None                        # the OpOverload (for replay), never hashed
    args_template: Any = None                 # args/kwargs with tensors as NodeRef, for replay

    @property
    def meta(self) -> TensorMeta | None:
        return self.outputs[0] if self.outputs else None

    @property
    def is_input(self) -> bool:
        return self.op in ("input", "param", "buffer")

    @property
    def input_ids(self) -> tuple[int, ...]:
        return tuple(i for i, _ in self.inputs)


@dataclass(frozen=True, slots=True)
class NodeRef:
    """A tensor argument in a replay template: output `index` of node `id`."""
    id: int
    index: int = 0


class Graph:
    def __init__(self, builder: str) -> None:
        self.builder = builder            # "fx" or "capture"
        self.nodes: list[Node] = []
        self.outputs: list[tuple[int, int]] = []  # graph results (node id, output index)
        self._topology = hashlib.blake2b(digest_size=16)
        self._shapes = hashlib.blake2b(digest_size=16)
        self._consumers: dict[int, list[int]] | None = None

    # ------------------------------------------------------------ building

    def add(self, node: Node) -> Node:
        assert node.id == len(self.nodes), "nodes are numbered in insertion order"
        self.nodes.append(node)
        attrs = ",".join(f"{k}={v}" for k, v in sorted(node.attrs.items()))
        self._topology.update(f"{node.op}|{node.inputs}|{attrs}|{node.backward}|{node.resident is not None};".encode())
        self._shapes.update(repr([(o.shape, o.dtype) if o else None for o in node.outputs]).encode())
        self._consumers = None
        return node

    def set_outputs(self, outputs: list[tuple[int, int]]) -> None:
        self.outputs = list(outputs)
        self._topology.update(f"out{self.outputs}".encode())

    # ------------------------------------------------------------ keys

    @property
    def fingerprint(self) -> str:
        """Exact structure in program order: ops, edges, attributes (no shapes)."""
        return self._topology.hexdigest()

    @property
    def shape_fingerprint(self) -> str:
        return self._shapes.hexdigest()

    def wl_hash(self, iterations: int = 3) -> str:
        """Weisfeiler-Lehman hash of the topology (order-independent; costs ms on large graphs)."""
        import warnings

        with warnings.catch_warnings():  # networkx notes that directed hashes changed in 3.5
            warnings.simplefilter("ignore", UserWarning)
            return nx.weisfeiler_lehman_graph_hash(self.to_networkx(), node_attr="op", iterations=iterations)

    # ------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def op_nodes(self) -> list[Node]:
        return [n for n in self.nodes if not n.is_input]

    def consumers(self, node_id: int) -> list[int]:
        if self._consumers is None:
            cons: dict[int, list[int]] = {n.id: [] for n in self.nodes}
            for n in self.nodes:
                for i in n.input_ids:
                    if n.id not in cons[i]:
                        cons[i].append(n.id)
            self._consumers = cons
        return self._consumers[node_id]

    def output_ids(self) -> set[int]:
        return {i for i, _ in self.outputs}

    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.id, op=n.op, module=n.module_path, shape=n.meta.shape if n.meta else None)
        for n in self.nodes:
            for src, idx in n.inputs:
                g.add_edge(src, n.id, index=idx)
        return g
