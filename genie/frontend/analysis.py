"""genie.analyze / genie.capture().run: build a graph, analyse it against the measured
network, and execute a captured graph according to its schedule."""
from __future__ import annotations

import math

import torch

from genie.runtime import get_runtime
from genie.semantic import analyzer
from genie.semantic.costs import DeviceSpec, LinkSpec, NetworkModel
from genie.semantic.graph import Graph, NodeRef
from genie.transport import calibration

from . import graph_capture

_local_flops: list[float] = []

# Seconds per captured op on a remote device, from bench/capture_overhead.py on the
# development machine; refined by nothing yet, so it only breaks ties between devices.
REMOTE_OP_OVERHEAD = 15e-6


def local_device() -> DeviceSpec:
    if not _local_flops:
        _local_flops.append(calibration.matmul_flops(torch.device("cpu")))
    return DeviceSpec("local", _local_flops[0], LinkSpec(math.inf, 0.0), is_local=True)


def network_model(devices: list[int] | None = None, allow_local: bool = True) -> NetworkModel:
    """Devices as measured by the runtime: each daemon's FLOP/s and its link's bandwidth and latency."""
    rt = get_runtime()
    rt.ensure_started()
    specs = []
    for stream in rt.streams:
        if devices is not None and stream.global_index not in devices:
            continue
        link = stream.link
        info = link.devices[stream.local_index]
        specs.append(DeviceSpec(str(stream.device), float(info.get("flops") or 1e9),
                                LinkSpec(link.bandwidth or 1e8, link.measured_rtt_s or 1e-3),
                                op_overhead=REMOTE_OP_OVERHEAD))
    if allow_local:
        specs.append(local_device())
    return NetworkModel(specs)


def analyze(model_or_graph, *args, network: NetworkModel | None = None, devices: list[int] | None = None,
            allow_local: bool = True, quiet: bool = False, **kwargs) -> analyzer.Analysis:
    """Analyse a model call `model(*args, **kwargs)` (or a Graph): patterns, phases, costs, schedule.

    The network model comes from the connected daemons unless `network` is given.
    Prints a summary unless quiet; the returned Analysis has `.to_png()`/`.to_svg()`.
    """
    if isinstance(model_or_graph, Graph):
        graph = model_or_graph
    elif hasattr(model_or_graph, "graph") and isinstance(model_or_graph.graph, Graph):
        graph = model_or_graph.graph
    else:
        with torch.no_grad():
            graph, _ = graph_capture.build_graph(model_or_graph, args, kwargs)
    if network is None:
        network = network_model(devices, allow_local)
    result = analyzer.analyze_graph(graph, network)
    if not quiet:
        print(result.summary())
    return result


# ---------------------------------------------------------------- executing a captured graph


class ScheduleRunner:
    """Replays a recorded graph stage by stage on the devices its schedule chose.

    Inputs are uploaded once per device (weights stay where they were sent);
    a value needed on another device is moved; after each stage every used
    device's queue is flushed so that independent groups run at the same time.
    KV-cache tensors are marked persistent on their daemon.
    """

    def __init__(self, analysis: analyzer.Analysis, inputs: dict[int, torch.Tensor]) -> None:
        if analysis.schedule is None:
            raise ValueError("the analysis has no schedule (no devices)")
        self.analysis = analysis
        self.graph = analysis.graph
        self.inputs = inputs
        self.values: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def _on(self, ref: NodeRef, device: str):
        copies = self.values.setdefault((ref.id, ref.index), {})
        if device in copies:
            return copies[device]
        if not copies:
            node = self.graph[ref.id]
            if not node.is_input:
                raise RuntimeError(f"value of node {ref.id} used before it was computed")
            source = self.inputs[ref.id]
        else:
            source = next(iter(copies.values()))
        moved = source if _location(source) == device else source.to("cpu" if device == "local" else device)
        copies[device] = moved
        return moved

    def run(self):
        from torch.utils import _pytree as pytree

        sched = self.analysis.schedule
        kv = self.analysis.kv_cache_nodes()
        rt = get_runtime()
        for stage in sched.stages:
            for gid in stage.groups:
                group = sched.groups[gid]
                for nid in group.nodes:
                    node = self.graph[nid]
                    args, kwargs = pytree.tree_map_only(NodeRef, lambda r: self._on(r, group.device),
                                                        node.args_template)
                    out = node.target(*args, **kwargs)
                    tensors = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
                    for k, t in enumerate(tensors):
                        # Keyed by where it really is (an op may have made a CPU tensor on purpose).
                        self.values[(nid, k)] = {_location(t): t}
                    if nid in kv and tensors:
                        from . import device as device_module

                        device_module.mark_persistent(tensors[0])
            for stream in rt.streams:  # let every device start on this stage now
                stream.flush()
        return [self._result(i, k) for i, k in self.graph.outputs]

    def _result(self, node_id: int, index: int):
        copies = self.values.get((node_id, index))
        if not copies:
            return self.inputs.get(node_id)
        return next(iter(copies.values()))


def _location(t: torch.Tensor) -> str:
    return "local" if t.device.type == "cpu" else str(t.device)


def run_captured(capture, network: NetworkModel | None = None, devices: list[int] | None = None,
                 allow_local: bool = False, quiet: bool = True):
    """Analyse a `genie.capture()` graph and execute it per its schedule; returns (outputs, analysis)."""
    if capture.graph is None:
        raise RuntimeError("run() after the `with genie.capture()` block has ended")
    result = analyze(capture.graph, network=network, devices=devices, allow_local=allow_local, quiet=quiet)
    outputs = ScheduleRunner(result, capture.writer.input_values).run()
    return outputs, result
