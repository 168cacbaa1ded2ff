"""Pattern plugins: name what a graph does (attention, KV cache, convolution, ...).

A plugin has a name, the ops it looks for, bounds on how many nodes a match
spans, and `match(graph) -> [PatternMatch]`. Each match has a confidence in
[0, 1], the node ids it covers and hints for later stages (e.g. which nodes are
the query/key/value inputs of an attention). Third parties register their own
with `register_pattern`.

Matching walks "transparent" ops (views, copies, casts, scaling) so that the
same pattern is found whether a model was written with `view`/`transpose` or
`reshape`/`permute`, or traced to ATen by make_fx or by the recorder.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .graph import Graph

# Ops that move or re-view data without changing what it means for pattern matching.
TRANSPARENT = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::transpose", "aten::t", "aten::permute",
    "aten::expand", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to", "aten::detach",
    "aten::alias", "aten::unsqueeze", "aten::squeeze", "aten::mul", "aten::div", "aten::masked_fill",
    "aten::add", "aten::dropout", "aten::native_dropout", "aten::slice", "aten::select", "aten::split",
    "aten::split_with_sizes", "aten::getitem", "aten::lift_fresh", "aten::_reshape_alias",
    "aten::where", "aten::neg", "aten::scalar_tensor", "aten::type_as", "aten::copy",
    "aten::float", "aten::half", "aten::bfloat16", "aten::double", "aten::type",  # casts as an FX graph names them
})
MATMUL = frozenset({"aten::mm", "aten::bmm", "aten::matmul", "aten::baddbmm", "aten::addmm", "aten::einsum"})
SOFTMAX = frozenset({"aten::softmax", "aten::_softmax", "aten::_safe_softmax", "aten::special_softmax"})
FUSED_ATTENTION = frozenset({
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_fused_attention_overrideable",
})
CONV = frozenset({"aten::convolution", "aten::_convolution", "aten::conv2d", "aten::conv1d", "aten::conv3d",
                  "aten::mkldnn_convolution", "aten::cudnn_convolution", "aten::_slow_conv2d_forward",
                  "aten::thnn_conv2d"})
NORM = frozenset({"aten::native_layer_norm", "aten::layer_norm", "aten::native_batch_norm",
                  "aten::_native_batch_norm_legit_no_training", "aten::_native_batch_norm_legit",
                  "aten::batch_norm", "aten::native_group_norm", "aten::group_norm", "aten::rms_norm",
                  "aten::_fused_rms_norm", "aten::_batch_norm_impl_index", "aten::cudnn_batch_norm"})
ACTIVATION = frozenset({"aten::relu", "aten::gelu", "aten::silu", "aten::tanh", "aten::sigmoid",
                        "aten::hardtanh", "aten::leaky_relu", "aten::elu", "aten::mish", "aten::relu_",
                        "aten::hardswish", "aten::clamp_min"})
LINEAR = frozenset({"aten::addmm", "aten::linear", "aten::mm", "aten::matmul", "aten::bmm"})
CONCAT = frozenset({"aten::cat", "aten::concat", "aten::index_copy", "aten::index_put", "aten::slice_scatter"})
EMBEDDING = frozenset({"aten::embedding", "aten::embedding_bag", "aten::_embedding_bag"})

# Matches below this confidence are not reported.
REPORT_THRESHOLD = 0.5


@dataclass(frozen=True)
class PatternMatch:
    pattern: str
    confidence: float
    nodes: tuple[int, ...]
    hints: dict = field(default_factory=dict, compare=False, hash=False)


class PatternPlugin:
    """Base class of pattern plugins; subclasses set the attributes and implement `match`."""

    name: str = ""
    expected_ops: frozenset[str] = frozenset()
    min_nodes: int = 1
    max_nodes: int = 64

    def applies_to(self, graph: Graph) -> bool:
        return not self.expected_ops or any(n.op in self.expected_ops for n in graph.nodes)

    def match(self, graph: Graph) -> list[PatternMatch]:
        raise NotImplementedError

    def _accept(self, m: PatternMatch) -> bool:
        return self.min_nodes <= len(m.nodes) <= self.max_nodes


# ---------------------------------------------------------------- walking helpers


def walk_back(graph: Graph, node_id: int, targets: frozenset[str], limit: int = 8) -> tuple[int | None, list[int]]:
    """From `node_id`'s inputs, follow transparent ops back to the nearest node in `targets`."""
    frontier = [(i, []) for i in graph[node_id].input_ids]
    seen = set()
    while frontier:
        nid, path = frontier.pop(0)
        if nid in seen or len(path) > limit:
            continue
        seen.add(nid)
        node = graph[nid]
        if node.op in targets:
            return nid, path
        if node.op in TRANSPARENT:
            frontier.extend((i, path + [nid]) for i in node.input_ids)
    return None, []


def walk_forward(graph: Graph, node_id: int, targets: frozenset[str], limit: int = 8) -> tuple[int | None, list[int]]:
    frontier = [(c, []) for c in graph.consumers(node_id)]
    seen = set()
    while frontier:
        nid, path = frontier.pop(0)
        if nid in seen or len(path) > limit:
            continue
        seen.add(nid)
        node = graph[nid]
        if node.op in targets:
            return nid, path
        if node.op in TRANSPARENT:
            frontier.extend((c, path + [nid]) for c in graph.consumers(nid))
    return None, []


def source_through_transparent(graph: Graph, node_id: int, limit: int = 10) -> list[int]:
    """Nodes reached going back from node_id through transparent ops (including where it stops)."""
    out, frontier, seen = [], [node_id], set()
    while frontier and len(seen) < 64:
        nid = frontier.pop()
        if nid in seen:
            continue
        seen.add(nid)
        out.append(nid)
        if graph[nid].op in TRANSPARENT:
            frontier.extend(graph[nid].input_ids)
    return out


# ---------------------------------------------------------------- built-in plugins


class AttentionPattern(PatternPlugin):
    """softmax(q @ k^T) @ v, unfused (matmul -> softmax -> matmul) or as one fused SDPA op."""

    name = "attention"
    expected_ops = FUSED_ATTENTION | SOFTMAX
    min_nodes, max_nodes = 1, 32

    def match(self, graph: Graph) -> list[PatternMatch]:
        found = []
        for n in graph.nodes:
            if n.op in FUSED_ATTENTION:
                q, k, v = (n.input_ids + (None, None, None))[:3]
                found.append(PatternMatch(self.name, 1.0, (n.id,), {
                    "q": q, "k": k, "v": v, "fused": True, "causal": bool(n.attrs.get("is_causal", False)),
                    "output": n.id,
                }))
            elif n.op in SOFTMAX:
                scores, pre = walk_back(graph, n.id, MATMUL)
                out, post = walk_forward(graph, n.id, MATMUL)
                if scores is None or out is None:
                    continue
                score_inputs = graph[scores].input_ids
                k = score_inputs[1] if len(score_inputs) > 1 else None
                v_inputs = [i for i in graph[out].input_ids if i not in post and i != n.id]
                causal = any(graph[p].op in ("aten::masked_fill", "aten::add", "aten::where") for p in pre)
                nodes = tuple(sorted({scores, *pre, n.id, *post, out}))
                found.append(PatternMatch(self.name, 0.9, nodes, {
                    "q": score_inputs[0], "k": k, "v": v_inputs[0] if v_inputs else None, "fused": False,
                    "causal": causal, "output": out,
                }))
        return [m for m in found if self._accept(m)]


class KVCachePattern(PatternPlugin):
    """A key/value tensor from outside the step, extended along the sequence axis, fed to attention
    and returned (so the next step feeds it back): the signature of a KV cache."""

    name = "kv_cache"
    expected_ops = CONCAT
    min_nodes, max_nodes = 1, 16

    def __init__(self, attention: AttentionPattern | None = None) -> None:
        self.attention = attention or AttentionPattern()

    def match(self, graph: Graph) -> list[PatternMatch]:
        attn = self.attention.match(graph)
        kv_inputs: dict[int, PatternMatch] = {}
        for m in attn:
            for role in ("k", "v"):
                if m.hints.get(role) is not None:
                    for src in source_through_transparent(graph, m.hints[role]):
                        kv_inputs.setdefault(src, m)
        outputs = graph.output_ids()
        found = []
        for n in graph.nodes:
            if n.op not in CONCAT:
                continue
            past = [i for i in n.input_ids if graph[i].op == "input"]
            if not past:
                continue
            fed_to_attention = n.id in kv_inputs
            returned = n.id in outputs or any(c in outputs for c in graph.consumers(n.id)
                                              if graph[c].op in TRANSPARENT)
            confidence = 0.4 + 0.35 * fed_to_attention + 0.25 * returned
            axis = n.attrs.get("dim", 0)
            meta = n.meta
            if meta is not None and isinstance(axis, int) and axis < 0:
                axis += len(meta.shape)
            found.append(PatternMatch(self.name, round(confidence, 2), (n.id, *past), {
                "cache_node": n.id, "past_inputs": tuple(past), "seq_axis": axis,
                "attention": kv_inputs[n.id].hints["output"] if fed_to_attention else None,
            }))
        return [m for m in found if self._accept(m)]


class ConvolutionPattern(PatternPlugin):
    """A convolution with the normalisation and activation that directly follow it."""

    name = "convolution"
    expected_ops = CONV
    min_nodes, max_nodes = 1, 8

    def match(self, graph: Graph) -> list[PatternMatch]:
        found = []
        for n in graph.nodes:
            if n.op not in CONV:
                continue
            nodes = [n.id]
            cur = n.id
            for wanted in (NORM, ACTIVATION):
                nxt = [c for c in graph.consumers(cur) if graph[c].op in wanted]
                if len(graph.consumers(cur)) == 1 and nxt:
                    cur = nxt[0]
                    nodes.append(cur)
                    getitem = [c for c in graph.consumers(cur) if graph[c].op == "aten::getitem"]
                    if getitem:
                        cur = getitem[0]
                        nodes.append(cur)
            found.append(PatternMatch(self.name, 1.0, tuple(nodes), {"conv": n.id}))
        return [m for m in found if self._accept(m)]


class MLPPattern(PatternPlugin):
    """linear -> activation -> linear."""

    name = "mlp"
    expected_ops = ACTIVATION
    min_nodes, max_nodes = 3, 12

    def match(self, graph: Graph) -> list[PatternMatch]:
        found = []
        for n in graph.nodes:
            if n.op not in ACTIVATION:
                continue
            first, pre = walk_back(graph, n.id, LINEAR, limit=3)
            second, post = walk_forward(graph, n.id, LINEAR, limit=3)
            if first is None or second is None:
                continue
            found.append(PatternMatch(self.name, 0.9, tuple(sorted({first, *pre, n.id, *post, second})),
                                      {"activation": graph[n.id].op}))
        return [m for m in found if self._accept(m)]


class EmbeddingPattern(PatternPlugin):
    name = "embedding"
    expected_ops = EMBEDDING

    def match(self, graph: Graph) -> list[PatternMatch]:
        return [PatternMatch(self.name, 1.0, (n.id,), {}) for n in graph.nodes if n.op in EMBEDDING]


class NormalizationPattern(PatternPlugin):
    """A normalisation op, or RMSNorm written out as most LLMs write it (Llama, Mistral, Qwen, T5):
    x * rsqrt(mean(x ** 2, -1) + eps), then times a weight."""

    name = "normalization"
    expected_ops = NORM | {"aten::rsqrt"}

    def match(self, graph: Graph) -> list[PatternMatch]:
        found = [PatternMatch(self.name, 1.0, (n.id,), {"kind": n.op.split("::")[-1]})
                 for n in graph.nodes if n.op in NORM]
        found += [m for n in graph.nodes if n.op == "aten::rsqrt" for m in [_written_out_rms_norm(graph, n.id)] if m]
        return found


def _written_out_rms_norm(graph: Graph, rsqrt: int) -> PatternMatch | None:
    def producer(nid: int, ops: tuple[str, ...]):
        ids = graph[nid].input_ids
        return ids[0] if ids and graph[ids[0]].op in ops else None

    add = producer(rsqrt, ("aten::add",))
    mean = producer(add, ("aten::mean",)) if add is not None else None
    square = producer(mean, ("aten::pow", "aten::square", "aten::mul")) if mean is not None else None
    if square is None or not graph[square].input_ids:
        return None
    x = set(source_through_transparent(graph, graph[square].input_ids[0]))
    scaled = next((c for c in graph.consumers(rsqrt) if graph[c].op == "aten::mul" and any(
        i != rsqrt and x & set(source_through_transparent(graph, i)) for i in graph[c].input_ids)), None)
    if scaled is None:
        return None
    nodes = [square, mean, add, rsqrt, scaled]
    weighted, path = walk_forward(graph, scaled, frozenset({"aten::mul"}), limit=2)
    if weighted is not None and any(graph[i].op == "param" for i in graph[weighted].input_ids):
        nodes += [*path, weighted]
    return PatternMatch("normalization", 0.9, tuple(sorted(nodes)), {"kind": "rms_norm", "written_out": True})


class ResidualAddPattern(PatternPlugin):
    """x + f(x): an add whose operands have the same shape and one is computed from the other."""

    name = "residual_add"
    expected_ops = frozenset({"aten::add"})
    min_nodes, max_nodes = 1, 1

    def match(self, graph: Graph) -> list[PatternMatch]:
        found = []
        for n in graph.nodes:
            if n.op != "aten::add" or len(n.inputs) < 2:
                continue
            a, b = n.input_ids[:2]
            ma, mb = graph[a].meta, graph[b].meta
            if ma is None or mb is None or ma.shape != mb.shape or a == b:
                continue
            if _reaches(graph, a, b) or _reaches(graph, b, a):
                found.append(PatternMatch(self.name, 0.9, (n.id,), {"skip": a, "branch": b}))
        return found


def _reaches(graph: Graph, src: int, dst: int, limit: int = 400) -> bool:
    """Is `dst` computed from `src` through at least two ops (a real branch, not a view)?"""
    if dst <= src:
        return False
    frontier, seen, depth = [dst], set(), {dst: 0}
    while frontier and len(seen) < limit:
        nid = frontier.pop()
        if nid in seen:
            continue
        seen.add(nid)
        for i in graph[nid].input_ids:
            if i == src and depth[nid] >= 1:
                return True
            if i > src and i not in seen:
                depth[i] = depth[nid] + 1
                frontier.append(i)
    return False


# ---------------------------------------------------------------- registry

_registry: dict[str, PatternPlugin] = {}


def register_pattern(plugin: PatternPlugin) -> None:
    """Add (or replace, by name) a pattern plugin used by every later analysis."""
    if not plugin.name:
        raise ValueError("a pattern plugin needs a name")
    _registry[plugin.name] = plugin


def unregister_pattern(name: str) -> None:
    _registry.pop(name, None)


def registered_patterns() -> list[PatternPlugin]:
    return list(_registry.values())


def match_all(graph: Graph) -> list[PatternMatch]:
    matches = []
    for plugin in registered_patterns():
        if plugin.applies_to(graph):
            matches.extend(m for m in plugin.match(graph) if m.confidence >= REPORT_THRESHOLD)
    return matches


for _plugin in (AttentionPattern(), KVCachePattern(), ConvolutionPattern(), MLPPattern(), EmbeddingPattern(),
                NormalizationPattern(), ResidualAddPattern()):
    register_pattern(_plugin)
