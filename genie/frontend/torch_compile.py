"""torch.compile in a program that uses remote tensors.

Compiled code cannot hold a remote tensor (LazyTensor.__tensor_unflatten__ makes that a graph
break: the code runs eagerly and Genie captures it). Two more things keep such programs working:

- Genie's own code is outside what dynamo compiles. PyTorch calls some of it from code it runs
  eagerly inside a compiled function (the factory kernels, for `torch.arange(n, device=x.device)`),
  and dynamo compiled those frames too, broke the graph inside LazyTensor.__new__ and read the
  half-made tensor ("'LazyTensor' object has no attribute '_genie'"). Every Genie module but
  flex_attention_check.py (the device check dynamo traces in flex_attention for CPU and CUDA
  calls) is on dynamo's skip list: it always runs as written.
- A graph that makes remote tensors from nothing (`torch.arange(n, device="remote_accelerator")`:
  no remote input to break on; Hugging Face's compiled create_block_mask) reached inductor,
  which has no code generator for this device (KeyError 'remote_accelerator'). Such graphs run
  as traced, op by op, as the "eager" backend runs them, and Genie captures their ops.
"""
from __future__ import annotations

import functools
import os

import torch
from torch.utils._pytree import tree_leaves

from genie.runtime.device_type import DEVICE_TYPE


_TRACED_BY_DYNAMO = {"genie.frontend.flex_attention_check"}
_dynamo_kept_out = False


def keep_dynamo_out() -> None:
    """Put Genie's files on dynamo's skip list (once; dynamo is imported by then: the runtime's
    warm-up imports it)."""
    global _dynamo_kept_out
    if _dynamo_kept_out:
        return
    import torch._dynamo.trace_rules as trace_rules

    if not (hasattr(trace_rules, "SKIP_DIRS") and hasattr(trace_rules, "_recompile_re")):
        return  # another PyTorch: compiled code that makes remote tensors may fail as it did

    import genie

    # File by file (the rules match path prefixes: a package's folder would take in every module),
    # found on disk: walking the packages imports them (89 ms, measured, at every runtime start).
    root = os.path.dirname(os.path.abspath(genie.__file__))
    traced = {os.path.join(root, *name.split(".")[1:]) + ".py" for name in _TRACED_BY_DYNAMO}
    files = [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names
             if name.endswith(".py") and os.path.join(folder, name) not in traced]
    trace_rules.SKIP_DIRS.extend(files)
    trace_rules._recompile_re()
    _dynamo_kept_out = True


def _on_remote_device(value) -> bool:
    return any(isinstance(leaf, torch.Tensor) and leaf.device.type == DEVICE_TYPE for leaf in tree_leaves(value))


def _makes_remote_tensors(graph_module: torch.fx.GraphModule, example_inputs) -> bool:
    # Dynamo keeps each node's fake value as "example_value" (traced graphs later as "val").
    return _on_remote_device(list(example_inputs)) or any(
        _on_remote_device(node.meta.get("example_value", node.meta.get("val"))) for node in graph_module.graph.nodes)


def _inductor_unless_remote(compile_with_inductor):
    @functools.wraps(compile_with_inductor)
    def __call__(self, model_, inputs_, **kwargs):
        if isinstance(model_, torch.fx.GraphModule) and _makes_remote_tensors(model_, inputs_):
            return model_.forward
        return compile_with_inductor(self, model_, inputs_, **kwargs)

    __call__._genie_wraps = compile_with_inductor
    return __call__


def install() -> None:
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)  # what torch.compile(backend="inductor") calls
    if wrapper is not None and not hasattr(wrapper.__call__, "_genie_wraps"):
        wrapper.__call__ = _inductor_unless_remote(wrapper.__call__)
