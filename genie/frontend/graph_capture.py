"""Graph builders: FX first for nn.Modules, the dispatch recorder as the fallback.

Both write the same `genie.semantic.Graph` through `GraphWriter`, which maps
each tensor object to the node that last produced it (in-place ops make the
tensor's latest version a new node) and creates input nodes for tensors first
seen as arguments: `param`/`buffer` for model state, `input` for data. A
remote (LazyTensor) input is marked resident on its device.

- FX: `torch.fx.symbolic_trace` (non-tensor arguments passed as concrete values,
  so `if past is None:` takes the branch the call really takes), then run by an
  Interpreter on the real inputs to get every shape. Module-level nodes
  (`nn.Linear`, `nn.Conv2d`, ...) become their ATen-equivalent op names.
- Recorder: a TorchDispatchMode that runs the program eagerly and records every
  ATen op, with module paths from global module hooks. It works for anything
  that runs, data-dependent control flow included; `genie.capture()` uses it.
"""
from __future__ import annotations

import inspect
import operator
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from genie.runtime.device_type import DEVICE_TYPE
from genie.semantic.graph import Graph, Node, NodeRef, TensorMeta

# Scalar arguments the analysis reads, by name.
_ATTR_NAMES = ("dim", "is_causal", "causal", "groups", "stride", "padding")


def tensor_meta(t) -> TensorMeta | None:
    if not isinstance(t, torch.Tensor):
        return None
    return TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.element_size())


class GraphWriter:
    def __init__(self, builder: str, state: dict[int, str] | None = None) -> None:
        self.graph = Graph(builder)
        self._latest: dict[int, tuple[int, int, weakref.ref]] = {}
        self._keep: list = []  # tensors without weakref support stay alive while recording
        self.state = state or {}  # id(parameter or buffer) -> "param"/"buffer"
        self.input_values: dict[int, torch.Tensor] = {}  # input node id -> the tensor, for replay

    def ref(self, t: torch.Tensor) -> tuple[int, int]:
        entry = self._latest.get(id(t))
        if entry is not None and entry[2]() is t:
            return entry[0], entry[1]
        kind = self.state.get(id(t)) or ("param" if isinstance(t, nn.Parameter) else "input")
        resident = str(t.device) if t.device.type == DEVICE_TYPE else None
        node = self.graph.add(Node(len(self.graph), kind, (), (tensor_meta(t),), resident=resident))
        self.input_values[node.id] = t
        self._remember(t, node.id, 0)
        return node.id, 0

    def _remember(self, t: torch.Tensor, node_id: int, index: int) -> None:
        try:
            self._latest[id(t)] = (node_id, index, weakref.ref(t))
        except TypeError:
            self._keep.append(t)
            self._latest[id(t)] = (node_id, index, lambda t=t: t)

    def add_op(self, op: str, args, kwargs, outputs, module_path: str, target=None, attrs=None,
               backward: bool = False) -> Node:
        inputs = []
        seen = set()
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
                seen.add(id(leaf))
                inputs.append(self.ref(leaf))
        template = pytree.tree_map_only(torch.Tensor, lambda t: NodeRef(*self.ref(t)), (args, kwargs))
        out_leaves = [o for o in pytree.tree_leaves(outputs)]
        metas = tuple(tensor_meta(o) for o in out_leaves if isinstance(o, torch.Tensor))
        node = self.graph.add(Node(len(self.graph), op, tuple(inputs), metas, module_path=module_path,
                                   attrs=attrs or {}, backward=backward, target=target, args_template=template))
        k = 0
        for o in out_leaves:
            if isinstance(o, torch.Tensor):
                self._remember(o, node.id, k)
                k += 1
        return node

    def finish(self, outputs) -> Graph:
        refs = []
        for leaf in pytree.tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor):
                refs.append(self.ref(leaf))
        if not refs:  # no explicit results: the sinks are
            consumed = {i for n in self.graph.nodes for i in n.input_ids}
            refs = [(n.id, 0) for n in self.graph.op_nodes() if n.id not in consumed]
        self.graph.set_outputs(refs)
        return self.graph


def _attrs(args, kwargs, schema_args=None) -> dict:
    attrs = {k: v for k, v in kwargs.items() if k in _ATTR_NAMES and isinstance(v, (bool, int, float, tuple, list))}
    if schema_args is not None:
        for a, v in zip(schema_args, args):
            if a.name in _ATTR_NAMES and isinstance(v, (bool, int, float, tuple, list)):
                attrs.setdefault(a.name, v)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}


def model_state(model: nn.Module | None) -> dict[int, str]:
    if model is None:
        return {}
    state = {id(p): "param" for p in model.parameters()}
    state.update({id(b): "buffer" for b in model.buffers()})
    return state


# ---------------------------------------------------------------- the dispatch recorder


class _RecordingMode(TorchDispatchMode):
    def __init__(self, capture: "Capture") -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.capture
        with c._lock:
            c.writer.add_op(
                func._schema.name, args, kwargs, out, c.module_path(), target=func,
                attrs=_attrs(args, kwargs, func._schema.arguments),
                backward=torch._C._current_autograd_node() is not None,
            )
        return out


class Capture:
    """`with genie.capture() as g:` records the ATen ops the block runs (on any tensors) into `g.graph`.

    Module paths come from global module hooks; the first module called inside
    the block is taken as the root for naming (or pass `model=`).
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        import threading

        self.model = model
        self.writer = GraphWriter("capture", model_state(model))
        self._names: dict[int, str] = {}
        self._stack: list[str] = []
        self._hooks: list = []
        self._lock = threading.RLock()
        self._outputs = None
        self.graph: Graph | None = None
        if model is not None:
            self._name_modules(model)

    def _name_modules(self, root: nn.Module) -> None:
        for name, module in root.named_modules():
            self._names.setdefault(id(module), name)
        self.writer.state.update(model_state(root))

    def module_path(self) -> str:
        return self._stack[-1] if self._stack else ""

    def _pre(self, module, args) -> None:
        if not self._names:
            self._name_modules(module)
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _post(self, module, args, output) -> None:
        if self._stack:
            self._stack.pop()

    def run(self, devices: list[int] | None = None, allow_local: bool = False, network=None):
        """Execute the captured graph on remote devices as its schedule places it.

        Returns (outputs, analysis): outputs are the captured block's results, as
        remote tensors on the devices that computed them.
        """
        from .analysis import run_captured

        return run_captured(self, network=network, devices=devices, allow_local=allow_local)

    def set_outputs(self, *tensors) -> None:
        """Name the results of the captured block (default: every value nothing else consumed)."""
        self._outputs = tensors

    def __enter__(self) -> "Capture":
        from torch.nn.modules import module as module_mod

        self._hooks = [module_mod.register_module_forward_pre_hook(self._pre),
                       module_mod.register_module_forward_hook(self._post)]
        self._mode = _RecordingMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self.graph = self.writer.finish(self._outputs)


def record(model, args, kwargs) -> tuple[Graph, object]:
    with Capture(model) as cap:
        out = model(*args, **kwargs)
        cap.set_outputs(out)
    return cap.graph, out


# ---------------------------------------------------------------- FX

_MODULE_OPS = {
    nn.Linear: "aten::linear", nn.Conv1d: "aten::convolution", nn.Conv2d: "aten::convolution",
    nn.Conv3d: "aten::convolution", nn.LayerNorm: "aten::native_layer_norm", nn.BatchNorm1d: "aten::native_batch_norm",
    nn.BatchNorm2d: "aten::native_batch_norm", nn.GroupNorm: "aten::native_group_norm",
    nn.Embedding: "aten::embedding", nn.ReLU: "aten::relu", nn.GELU: "aten::gelu", nn.SiLU: "aten::silu",
    nn.Tanh: "aten::tanh", nn.Sigmoid: "aten::sigmoid", nn.Dropout: "aten::dropout", nn.MaxPool2d: "aten::max_pool2d",
    nn.AvgPool2d: "aten::avg_pool2d", nn.AdaptiveAvgPool2d: "aten::adaptive_avg_pool2d", nn.Flatten: "aten::view",
    nn.Softmax: "aten::softmax", nn.MultiheadAttention: "aten::_native_multi_head_attention",
    nn.Identity: "aten::alias",
}
_FUNCTION_OPS = {
    operator.add: "aten::add", operator.sub: "aten::sub", operator.mul: "aten::mul", operator.truediv: "aten::div",
    operator.matmul: "aten::matmul", operator.getitem: "aten::getitem", operator.neg: "aten::neg",
    F.scaled_dot_product_attention: "aten::scaled_dot_product_attention", F.linear: "aten::linear",
    F.conv2d: "aten::convolution", F.layer_norm: "aten::native_layer_norm", F.embedding: "aten::embedding",
    torch.cat: "aten::cat", torch.concat: "aten::cat", torch.matmul: "aten::matmul", torch.bmm: "aten::bmm",
    F.softmax: "aten::softmax", torch.softmax: "aten::softmax",
}
_METHOD_OPS = {"contiguous": "aten::clone", "size": None, "dim": None}


def _function_op(fn) -> str:
    op = _FUNCTION_OPS.get(fn)
    if op:
        return op
    return f"aten::{getattr(fn, '__name__', str(fn)).lstrip('_')}"


def build_fx(model: nn.Module, args, kwargs) -> tuple[Graph, object]:
    """Trace with torch.fx and run the trace on the real inputs. Raises when FX cannot trace the model."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {name: value for name, value in bound.arguments.items()
                if not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value))}
    traced = torch.fx.symbolic_trace(model, concrete_args=concrete)
    writer = GraphWriter("fx", model_state(model))
    modules = dict(traced.named_modules())

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if n.op in ("placeholder", "output"):
                return result
            if n.op == "get_attr":
                if isinstance(result, torch.Tensor):
                    writer.ref(result)
                return result
            stack = n.meta.get("nn_module_stack") or {}
            path = list(stack.values())[-1][0] if stack else ""
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if n.target is operator.getitem and not isinstance(args[0], torch.Tensor):
                return result  # picking from a list/tuple: the tensor keeps the node it came from
            if not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(result)):
                return result  # sizes, shapes and other plain values are not graph nodes
            if n.op == "call_module":
                module = modules[n.target]
                op = _MODULE_OPS.get(type(module), f"module::{type(module).__name__}")
                path = n.target
                if isinstance(module, nn.Linear):
                    args = (args[0], module.weight) + ((module.bias,) if module.bias is not None else ())
                elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.BatchNorm1d,
                                         nn.BatchNorm2d, nn.Embedding, nn.GroupNorm)):
                    state = [p for p in (getattr(module, "weight", None), getattr(module, "bias", None)) if p is not None]
                    args = (*args, *state) if not isinstance(module, nn.Embedding) else (args[0], module.weight)
            elif n.op == "call_method":
                op = _METHOD_OPS.get(n.target, f"aten::{n.target}")
            else:
                op = _function_op(n.target)
            writer.add_op(op, args, kwargs, result, path, attrs=_attrs(args, kwargs))
            return result

    flat_inputs = []
    for name in traced.graph.nodes:
        if name.op != "placeholder":
            continue
        value = bound.arguments.get(name.target, None)
        flat_inputs.append(value)
    with torch.no_grad():
        out = Recorder(traced).run(*[v for v in flat_inputs])
    return writer.finish(out), out


def build_graph(model, args=(), kwargs=None, prefer: str = "fx") -> tuple[Graph, object]:
    """FX first; the recorder when FX cannot trace the model (data-dependent control flow, ...)."""
    kwargs = kwargs or {}
    if prefer == "fx" and isinstance(model, nn.Module):
        try:
            return build_fx(model, args, kwargs)
        except Exception:  # noqa: BLE001 - any tracing failure means: record instead
            pass
    return record(model, args, kwargs)
