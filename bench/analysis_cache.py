"""Analysis cache over repeated decode steps: hit rate and the cost of a hit.

Generates with TinyGPT on the CPU; at every decode step the step's graph is
built (FX, or the recorder with --builder capture) and analysed through a fresh
AnalysisCache. Reports the level-1 (topology: patterns, phases) and level-2
(shapes: costs, schedule) hit rates, the median time of an analysis that hit,
of one that missed, and of building the graph.

    python -m bench.analysis_cache [--steps 50] [--builder fx|capture]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import median, print_table, write_json
from genie.examples.gpt import GPTConfig, TinyGPT
from genie.frontend.graph_capture import build_graph
from genie.semantic import DeviceSpec, LinkSpec, NetworkModel, analyze_graph
from genie.semantic.cache import AnalysisCache


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--builder", choices=["fx", "capture"], default="fx")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=args.layers)).eval()
    network = NetworkModel([
        DeviceSpec("remote_accelerator:0", 1e12, LinkSpec(1e9, 1e-4), op_overhead=15e-6),
        DeviceSpec("local", 5e10, LinkSpec(float("inf"), 0.0), is_local=True),
    ])
    cache = AnalysisCache()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 16))
    build_s, hit_s, miss_s = [], [], []
    with torch.no_grad():
        logits, past = model(ids, torch.arange(16))
        token, pos = logits[:, -1].argmax(-1, keepdim=True), torch.tensor([16])
        for _ in range(args.steps):
            t0 = time.perf_counter()
            graph, (logits, past) = build_graph(model, (token, pos), {"past_key_values": past}, prefer=args.builder)
            t1 = time.perf_counter()
            hits_before = cache.topology.hits
            analysis = analyze_graph(graph, network, cache=cache)
            t2 = time.perf_counter()
            build_s.append(t1 - t0)
            (hit_s if cache.topology.hits > hits_before else miss_s).append(t2 - t1)
            token, pos = logits[:, -1].argmax(-1, keepdim=True), pos + 1
    stats = cache.stats()
    result = {
        "steps": args.steps, "builder": args.builder, "nodes": len(graph),
        "topology_hit_rate": stats["topology"]["hit_rate"], "shape_hit_rate": stats["shapes"]["hit_rate"],
        "topology_lookup_us": stats["topology"]["mean_hit_us"],
        "analysis_on_topology_hit_ms": median(hit_s) * 1e3 if hit_s else None,
        "analysis_on_miss_ms": median(miss_s) * 1e3 if miss_s else None,
        "graph_build_ms": median(build_s) * 1e3,
        "kv_cache_matches": len(analysis.matches("kv_cache")),
    }
    print(f"# analysis cache over {args.steps} decode steps ({args.builder} graphs of {len(graph)} nodes)")
    print_table([
        ("level 1 (topology -> patterns, phases) hit rate", f"{result['topology_hit_rate'] * 100:.0f}%"),
        ("level 1 lookup on a hit", f"{result['topology_lookup_us']:.1f} us"),
        ("level 2 (shapes -> costs, schedule) hit rate", f"{result['shape_hit_rate'] * 100:.0f}%"),
        ("whole analysis when level 1 hits (median)", f"{result['analysis_on_topology_hit_ms']:.2f} ms"),
        ("whole analysis on a miss", f"{result['analysis_on_miss_ms']:.2f} ms"),
        ("building the step's graph (median)", f"{result['graph_build_ms']:.2f} ms"),
    ], ("measure", "value"))
    print("wrote", write_json(f"analysis_cache_{args.builder}", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
